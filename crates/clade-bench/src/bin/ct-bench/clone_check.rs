//! The clone check, for the browser: the page's next `Math.random()` draws and the in-sandbox Python
//! server's next `random.random()` draws in two siblings of one mark.
//!
//! Restored without hygiene, two siblings draw the same numbers: a restore is a clone, V8's and Python's
//! random state included. With hygiene (the page reopened in a new browser context, so in a new renderer
//! whose V8 isolate is seeded after the restore; the server reseeded by the agent's restore signal) every
//! draw must differ. Both pairs are taken in the same run, so the
//! check shows it can fail: if the pair without hygiene does not draw equal numbers, the check proves
//! nothing and says so.

use clade_agent::ExecSpec;
use clade_core::backend::{MarkState, Sandbox};
use clade_ct::CtSandbox;
use serde_json::json;

use crate::{figure, kill_all, Bench, Workload};

/// Asks the template's screen server (`GET /random`) for three draws of each generator.
const DRAW: &str = "import sys, urllib.request\n\
                    sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:9000/random', timeout=60).read().decode())";

/// The page's target id, its next three `Math.random()` values, then the screen server's next three
/// `random.random()` values.
fn draws(sb: &CtSandbox) -> Result<(String, Vec<f64>), String> {
    let out = sb.agent().run(ExecSpec::new(["python3", "-c", DRAW])).map_err(|e| format!("clone check: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "clone check: GET /random in {} failed: {}",
            sb.id(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("clone check: {}: {e}: {}", sb.id(), String::from_utf8_lossy(&out.stdout)))?;
    let nums: Vec<f64> = ["math_random", "python_random"]
        .iter()
        .flat_map(|k| v[*k].as_array().cloned().unwrap_or_default())
        .filter_map(|x| x.as_f64())
        .collect();
    if nums.len() != 6 {
        return Err(format!("clone check: {}: expected three draws of each generator, got {v}", sb.id()));
    }
    Ok((v["target"].as_str().unwrap_or_default().to_string(), nums))
}

/// Two siblings restored with hygiene and two without, their draws compared; prints the figure.
pub fn run(b: &Bench, w: &Workload, mark: &MarkState) -> Result<(), String> {
    let mut with = Vec::new();
    for _ in 0..2 {
        with.push(b.restore(w, mark)?.0);
    }
    let hygienic = [draws(&with[0]), draws(&with[1])];
    kill_all(with);
    let mut without = Vec::new();
    for _ in 0..2 {
        without.push(b.restore_plain(w, mark)?.0);
    }
    let clones = [draws(&without[0]), draws(&without[1])];
    kill_all(without);
    let [h0, h1] = hygienic;
    let [c0, c1] = clones;
    let ((ht0, h0), (ht1, h1), (_, c0), (_, c1)) = (h0?, h1?, c0?, c1?);
    let control_equal = c0 == c1;
    let hygiene_differs = h0.iter().zip(&h1).all(|(a, b)| a != b);
    let pass = control_equal && hygiene_differs;
    if !control_equal {
        eprintln!("ct-bench: clone check: two siblings restored without hygiene drew different numbers; the check proves nothing");
    }
    figure(
        format!(
            "ct {}: clone hygiene, page Math.random() and server random.random() of two siblings (differ with \
             hygiene, equal without)",
            w.name
        ),
        f64::from(u8::from(pass)),
        "pass",
        "pass: with hygiene every draw differs; the control pair without hygiene draws the same (a restore without hygiene is a clone)",
        pass,
        &[f64::from(u8::from(hygiene_differs)), f64::from(u8::from(control_equal))],
        json!({"with_hygiene": [h0, h1], "with_hygiene_targets": [ht0, ht1], "without_hygiene": [c0, c1],
               "hygiene_differs": hygiene_differs, "control_equal": control_equal}),
    );
    Ok(())
}
