//! `clade-bench e2b` (`./x bench e2b`): Sandbox.create() to the first `commands.run('echo hi')` result
//! through the official e2b Python SDK against this clade's E2B API, on a warm base, against the same through
//! clade's own library (`Ops::fork` of the base, then `Ops::exec`). p50 of each and their ratio (the bar: the
//! SDK's path at most 2x the library's; docs/e2b.md). Needs the template's base built on the backend and the
//! SDK in `$CLADE_HOME/py`.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{anyhow, Context};
use clade_core::backend::BackendKind;
use clade_core::CladeHome;

use super::Figure;
use clade_host::api::{ExecRequest, ForkRequest, SandboxApi};
use clade_host::Ops;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value = "ct")]
    pub backend: BackendKind,
    #[arg(long, default_value = "minimal")]
    pub template: String,
    #[arg(long, default_value_t = 10)]
    pub n: usize,
    /// Where the figures go as JSON.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
}

fn p50(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    if s.is_empty() {
        return f64::NAN;
    }
    s[s.len() / 2]
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let home = CladeHome::from_env();
    let backend = a.backend.as_str().to_string();
    let ops = Ops::open(&home)?;
    // clade's own library call: fork the base, exec, (kill outside the timing).
    let fork = ForkRequest::new(a.template.as_str(), Some(a.backend), 1);
    let first = ops.fork(&fork)?;
    first.sandboxes.iter().for_each(|r| drop(ops.kill(&r.sandbox)));
    let mut lib = Vec::new();
    for _ in 0..a.n {
        let t = Instant::now();
        let f = ops.fork(&fork)?;
        let id = f.sandboxes.first().ok_or_else(|| anyhow!("fork started nothing"))?.sandbox.clone();
        let out = ops.exec(&id, ExecRequest { argv: vec!["echo".into(), "hi".into()], ..Default::default() })?;
        lib.push(t.elapsed().as_secs_f64() * 1e3);
        let _ = ops.kill(&id);
        anyhow::ensure!(out.stdout == b"hi\n", "echo hi printed {:?}", String::from_utf8_lossy(&out.stdout));
    }
    // Through the SDK: a `clade serve` with the E2B faces, a key, the script.
    let key = clade_api::e2b::create_key(&home)?;
    let exe = clade_host::supervisor::clade_exe()?;
    let mut serve = Command::new(&exe)
        .args(["serve", "--listen", "127.0.0.1:0", "--e2b-api", "127.0.0.1:0", "--e2b-sandbox", "127.0.0.1:0"])
        .stderr(Stdio::piped())
        .spawn()
        .context("start clade serve")?;
    let mut err = BufReader::new(serve.stderr.take().ok_or_else(|| anyhow!("no stderr"))?);
    let (mut api, mut envd) = (String::new(), String::new());
    let mut line = String::new();
    while err.read_line(&mut line)? > 0 {
        if let Some(rest) = line.trim().strip_prefix("clade serve: E2B API on ") {
            let mut p = rest.split(", envd on ");
            api = p.next().unwrap_or_default().to_string();
            envd = p.next().and_then(|s| s.split_whitespace().next()).unwrap_or_default().to_string();
        }
        if line.contains("ready") {
            break;
        }
        line.clear();
    }
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("e2b/bench_first_command.py");
    let out = Command::new(home.root().join("py/bin/python"))
        .arg(&script)
        .arg(a.n.to_string())
        .env("E2B_API_KEY", &key)
        .env("E2B_API_URL", &api)
        .env("E2B_SANDBOX_URL", &envd)
        .env("E2B_TEMPLATE", format!("{}:{backend}", a.template))
        .output()
        .context("run the SDK bench script (is the e2b SDK in $CLADE_HOME/py? ./x setup)")?;
    let _ = serve.kill();
    let _ = serve.wait();
    anyhow::ensure!(out.status.success(), "SDK bench failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("SDK bench output")?;
    let sdk: Vec<f64> = v["ms"].as_array().into_iter().flatten().filter_map(|x| x.as_f64()).collect();
    let (ps, pl) = (p50(&sdk), p50(&lib));
    let ratio = ps / pl;
    let figs = vec![
        // The bar is relative, so the figure is the ratio; both arms' samples are drawn side by side.
        Figure {
            name: format!("e2b SDK create to first command p50 / clade library fork to first exec p50 ({backend})"),
            value: ratio,
            unit: "x".into(),
            bar: "<= 2x".into(),
            pass: ratio <= 2.0,
            samples: sdk.clone(),
            detail: serde_json::json!({"sdk_p50_ms": ps, "library_p50_ms": pl,
                "plot": {"kind": "arms", "unit": "ms", "arms": {"E2B SDK": sdk, "clade library": lib.clone()}}}),
        },
        Figure {
            name: format!("e2b: clade library fork to first exec p50 ({backend}), the reference"),
            value: pl,
            unit: "ms".into(),
            bar: "reported".into(),
            pass: true,
            samples: lib,
            detail: serde_json::json!({}),
        },
    ];
    for f in &figs {
        println!("{}", serde_json::to_string(f)?);
    }
    if let Some(p) = a.out {
        if let Some(d) = p.parent() {
            std::fs::create_dir_all(d)?;
        }
        std::fs::write(&p, serde_json::to_vec_pretty(&figs)?)?;
    }
    Ok(if ratio <= 2.0 { 0 } else { 1 })
}
