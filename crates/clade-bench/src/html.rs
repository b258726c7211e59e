//! `report.html`: one self-contained page (inline CSS and SVG, no script, no fetch) from a [`Report`].
//!
//! Plots, chosen per figure from what it carries:
//! - `detail.plot = {"kind": "arms", "unit": U, "arms": {ARM: [samples]}, "bar_line": X?}`: the distribution
//!   of each arm (every sample a dot, the median a tick, the box from p25 to p75), the bar drawn at X;
//! - `detail.plot = {"kind": "xy", "xlabel": .., "ylabel": .., "x": [..], "series": {NAME: [..]}}`: a line
//!   per series (memory over sandbox count, fork latency over N, storage per mark);
//! - otherwise, a figure with samples gets the arms plot of its samples with its bar's limit drawn, and one
//!   without samples a bullet: the value against the limit.

use std::fmt::Write;

use super::report::{Bar, Report, Row};

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn num(v: f64) -> String {
    if !v.is_finite() {
        return "n/a".into();
    }
    let a = v.abs();
    if a >= 1000.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 0.1 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

const W: f64 = 640.0;
const LEFT: f64 = 150.0;
const RIGHT: f64 = 20.0;

/// A scale over `[lo, hi]` onto `[a, b]` pixels: linear from 0 for data that is not negative, logarithmic
/// when positive data spans more than 50x (a cold boot in seconds next to a fork in milliseconds).
struct Scale {
    lo: f64,
    hi: f64,
    a: f64,
    b: f64,
    log: bool,
}

impl Scale {
    fn new(mut lo: f64, mut hi: f64, a: f64, b: f64) -> Scale {
        if !lo.is_finite() || !hi.is_finite() {
            (lo, hi) = (0.0, 1.0);
        }
        if lo > 0.0 && hi / lo > 50.0 {
            return Scale { lo: (lo / 1.3).log10(), hi: (hi * 1.3).log10(), a, b, log: true };
        }
        if hi - lo < 1e-12 {
            hi = lo + lo.abs().max(1.0) * 0.1;
            lo -= lo.abs().max(1.0) * 0.1;
        }
        let pad = (hi - lo) * 0.05;
        let lo = if lo >= 0.0 { 0.0 } else { lo - pad };
        Scale { lo, hi: hi + pad, a, b, log: false }
    }
    fn at(&self, v: f64) -> f64 {
        let v = if self.log { v.max(1e-12).log10() } else { v };
        self.a + (v - self.lo) / (self.hi - self.lo) * (self.b - self.a)
    }
    /// The data value at fraction `f` of the axis.
    fn value(&self, f: f64) -> f64 {
        let v = self.lo + (self.hi - self.lo) * f;
        if self.log {
            10f64.powf(v)
        } else {
            v
        }
    }
}

fn axis_ticks(svg: &mut String, s: &Scale, y: f64, unit: &str) {
    for i in 0..=4 {
        let v = s.value(f64::from(i) / 4.0);
        let x = s.at(v);
        let _ = write!(
            svg,
            r##"<line x1="{x:.1}" y1="{y:.1}" x2="{x:.1}" y2="{:.1}" stroke="#bbb"/><text x="{x:.1}" y="{:.1}" class="t" text-anchor="middle">{}</text>"##,
            y + 4.0,
            y + 16.0,
            esc(&num(v))
        );
    }
    let unit = if s.log { format!("{unit} (log scale)") } else { unit.to_string() };
    let _ = write!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" class="t" text-anchor="end">{}</text>"#,
        W - RIGHT,
        y + 30.0,
        esc(&unit)
    );
}

/// Distributions of named sample sets on one horizontal axis.
fn arms_svg(arms: &[(String, Vec<f64>)], unit: &str, bar: Option<f64>) -> String {
    let row = 28.0;
    let h = arms.len() as f64 * row + 50.0;
    let all: Vec<f64> = arms.iter().flat_map(|(_, v)| v.iter().copied()).chain(bar).filter(|v| v.is_finite()).collect();
    let lo = all.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = all.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let s = Scale::new(lo, hi, LEFT, W - RIGHT);
    let mut svg = format!(r#"<svg width="{W}" height="{h:.0}" viewBox="0 0 {W} {h:.0}" role="img">"#);
    for (i, (name, v)) in arms.iter().enumerate() {
        let y = 15.0 + i as f64 * row;
        let mut sorted: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
        sorted.sort_by(f64::total_cmp);
        let _ = write!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" class="t" text-anchor="end">{} (n={})</text>"#,
            LEFT - 6.0,
            y + 4.0,
            esc(name),
            sorted.len()
        );
        if sorted.len() >= 4 {
            let (q1, q3) = (s.at(quantile(&sorted, 0.25)), s.at(quantile(&sorted, 0.75)));
            let _ = write!(
                svg,
                r##"<rect x="{q1:.1}" y="{:.1}" width="{:.1}" height="14" fill="#dbe8f6" stroke="#7aa6d6"/>"##,
                y - 7.0,
                (q3 - q1).max(1.0)
            );
        }
        for (j, x) in sorted.iter().enumerate() {
            let jitter = ((j * 7) % 9) as f64 - 4.0;
            let _ = write!(
                svg,
                r##"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="#2a5d9f" fill-opacity="0.7"/>"##,
                s.at(*x),
                y + jitter
            );
        }
        if !sorted.is_empty() {
            let m = s.at(quantile(&sorted, 0.5));
            let _ = write!(
                svg,
                r##"<line x1="{m:.1}" y1="{:.1}" x2="{m:.1}" y2="{:.1}" stroke="#111" stroke-width="2"/>"##,
                y - 9.0,
                y + 9.0
            );
        }
    }
    let axis_y = arms.len() as f64 * row + 8.0;
    if let Some(b) = bar.filter(|b| b.is_finite()) {
        let x = s.at(b);
        // The label on the side of the line with room for it.
        let (tx, anchor) = if x > W - 80.0 { (x - 3.0, "end") } else { (x + 3.0, "start") };
        let _ = write!(
            svg,
            r##"<line x1="{x:.1}" y1="2" x2="{x:.1}" y2="{axis_y:.1}" stroke="#c0392b" stroke-dasharray="4 3"/><text x="{tx:.1}" y="10" class="t bar" text-anchor="{anchor}">bar {}</text>"##,
            esc(&num(b))
        );
    }
    axis_ticks(&mut svg, &s, axis_y, unit);
    svg.push_str("</svg>");
    svg
}

/// Lines of y over x.
fn xy_svg(x: &[f64], series: &[(String, Vec<f64>)], xlabel: &str, ylabel: &str) -> String {
    let (h, top, bottom) = (260.0, 15.0, 215.0);
    let xs = Scale::new(
        x.iter().copied().fold(f64::INFINITY, f64::min),
        x.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        LEFT,
        W - RIGHT,
    );
    let ally: Vec<f64> = series.iter().flat_map(|(_, v)| v.iter().copied()).filter(|v| v.is_finite()).collect();
    let ys = Scale::new(
        ally.iter().copied().fold(f64::INFINITY, f64::min),
        ally.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        bottom,
        top,
    );
    let colors = ["#2a5d9f", "#c0392b", "#27ae60", "#8e44ad", "#d35400"];
    let mut svg = format!(r#"<svg width="{W}" height="{h}" viewBox="0 0 {W} {h}" role="img">"#);
    for i in 0..=4 {
        let v = ys.value(f64::from(i) / 4.0);
        let y = ys.at(v);
        let _ = write!(
            svg,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#eee"/><text x="{:.1}" y="{:.1}" class="t" text-anchor="end">{}</text>"##,
            W - RIGHT,
            LEFT - 6.0,
            y + 4.0,
            esc(&num(v))
        );
    }
    for (k, (name, v)) in series.iter().enumerate() {
        let c = colors[k % colors.len()];
        let pts: Vec<String> = x
            .iter()
            .zip(v)
            .filter(|(_, y)| y.is_finite())
            .map(|(a, b)| format!("{:.1},{:.1}", xs.at(*a), ys.at(*b)))
            .collect();
        let _ = write!(svg, r#"<polyline points="{}" fill="none" stroke="{c}" stroke-width="2"/>"#, pts.join(" "));
        for p in &pts {
            let (px, py) = p.split_once(',').unwrap_or(("0", "0"));
            let _ = write!(svg, r#"<circle cx="{px}" cy="{py}" r="3" fill="{c}"/>"#);
        }
        let _ = write!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" class="t" fill="{c}">{}</text>"#,
            LEFT + 8.0,
            top + 12.0 + k as f64 * 14.0,
            esc(name)
        );
    }
    axis_ticks(&mut svg, &xs, bottom, xlabel);
    let _ = write!(
        svg,
        r#"<text x="12" y="{:.1}" class="t" transform="rotate(-90 12 {:.1})">{}</text>"#,
        (top + bottom) / 2.0,
        (top + bottom) / 2.0,
        esc(ylabel)
    );
    svg.push_str("</svg>");
    svg
}

fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array().map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect()).unwrap_or_default()
}

fn named(v: &serde_json::Value) -> Vec<(String, Vec<f64>)> {
    v.as_object().map(|o| o.iter().map(|(k, v)| (k.clone(), floats(v))).collect()).unwrap_or_default()
}

/// The plot of one figure, if it has anything to draw.
fn plot(r: &Row) -> Option<String> {
    let limit = Bar::parse(&r.bar).map(|b| b.limit());
    let p = &r.detail["plot"];
    match p["kind"].as_str() {
        Some("arms") => {
            let arms = named(&p["arms"]);
            (!arms.is_empty()).then(|| arms_svg(&arms, p["unit"].as_str().unwrap_or(&r.unit), p["bar_line"].as_f64()))
        }
        Some("xy") => {
            let x = floats(&p["x"]);
            let series = named(&p["series"]);
            (!x.is_empty() && !series.is_empty())
                .then(|| xy_svg(&x, &series, p["xlabel"].as_str().unwrap_or(""), p["ylabel"].as_str().unwrap_or("")))
        }
        _ => inferred(r, limit).or_else(|| {
            if r.samples.len() >= 2 {
                Some(arms_svg(&[("samples".into(), r.samples.clone())], &r.unit, limit))
            } else {
                limit.map(|l| arms_svg(&[("value".into(), vec![r.value])], &r.unit, Some(l)))
            }
        }),
    }
}

/// A plot read off the detail of a figure that names none, from the shapes the benches already record:
/// a memory curve (`counts` or `restored_counts` with `*pss*_bytes` series of the same length, drawn in MiB)
/// or the latency distributions of two or more arms (`<arm>_ms` arrays: cold, restore, fork, peer, ...).
fn inferred(r: &Row, limit: Option<f64>) -> Option<String> {
    let d = r.detail.as_object()?;
    let xkey = ["counts", "restored_counts"].into_iter().find(|k| d.get(*k).is_some_and(|v| floats(v).len() >= 2));
    if let Some(xk) = xkey {
        let x = floats(&d[xk]);
        let series: Vec<(String, Vec<f64>)> = d
            .iter()
            .filter(|(k, v)| k.contains("pss") && k.ends_with("_bytes") && floats(v).len() == x.len())
            .map(|(k, v)| {
                let name = k.trim_end_matches("_bytes").replace("_sum_pss", "").replace("sum_pss", "sandboxes");
                (name, floats(v).iter().map(|b| b / 1048576.0).collect())
            })
            .collect();
        if !series.is_empty() {
            return Some(xy_svg(&x, &series, "sandboxes side by side", "summed PSS (MiB)"));
        }
    }
    let arms: Vec<(String, Vec<f64>)> = d
        .iter()
        .filter(|(k, v)| k.ends_with("_ms") && floats(v).len() >= 2)
        .map(|(k, v)| (k.trim_end_matches("_ms").to_string(), floats(v)))
        .collect();
    (arms.len() >= 2).then(|| arms_svg(&arms, "ms", if r.unit == "ms" { limit } else { None }))
}

fn verdict(r: &Row) -> &'static str {
    match r.pass {
        Some(true) => r#"<span class="pass">PASS</span>"#,
        Some(false) => r#"<span class="fail">FAIL</span>"#,
        None => r#"<span class="rep">reported</span>"#,
    }
}

/// The page.
pub fn render(rep: &Report) -> String {
    let mut h = String::from(
        r#"<!doctype html><html lang="en"><head><meta charset="utf-8"><title>clade benchmark report</title><style>
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:980px;color:#222;padding:0 16px}
h1{font-size:24px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}h3{font-size:15px;margin:18px 0 4px}
table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #eee;padding:4px 6px;text-align:left;vertical-align:top}
.pass{background:#27ae60;color:#fff;padding:1px 6px;border-radius:3px}.fail{background:#c0392b;color:#fff;padding:1px 6px;border-radius:3px}
.rep{background:#888;color:#fff;padding:1px 6px;border-radius:3px}.warn{color:#c0392b}.t{font-size:11px;fill:#444}.bar{fill:#c0392b}
.fig{margin:10px 0 22px}.src{color:#888;font-size:12px}code{font-size:12px}
</style></head><body><h1>clade benchmark report</h1>"#,
    );
    let (pass, fail) = rep.figures.iter().fold((0, 0), |(p, f), r| match r.pass {
        Some(true) => (p + 1, f),
        Some(false) => (p, f + 1),
        None => (p, f),
    });
    let m = &rep.machine;
    let _ = write!(
        h,
        r#"<p id="summary"><b>{}</b> figures: <span class="pass">{pass} PASS</span> <span class="fail">{fail} FAIL</span> {} reported. Generated {} at commit <code>{}</code>{}.</p>"#,
        rep.figures.len(),
        rep.figures.len() - pass - fail,
        esc(&rep.generated),
        esc(m["git_commit"].as_str().unwrap_or("?")),
        if m["git_dirty"].as_bool().unwrap_or(false) { " (with uncommitted changes)" } else { "" }
    );
    h.push_str("<h2>Machine</h2><table>");
    for (k, label) in [
        ("cpu", "CPU"),
        ("cores", "cores"),
        ("memory_gib", "memory (GiB)"),
        ("kernel", "host kernel"),
        ("accelerator", "vm accelerator"),
        ("accelerator_reason", "why"),
        ("qemu", "QEMU"),
        ("guest_kernel", "guest kernel"),
        ("criu", "CRIU"),
        ("loadavg", "load average at report time"),
    ] {
        let v = match &m[k] {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Number(n) if n.is_f64() => num(n.as_f64().unwrap_or(f64::NAN)),
            serde_json::Value::Null => "?".into(),
            other => other.to_string(),
        };
        let _ = write!(h, "<tr><th>{label}</th><td>{}</td></tr>", esc(&v));
    }
    h.push_str(
        "</table><h2>All figures</h2><table><tr><th>figure</th><th>value</th><th>bar</th><th></th><th>bench</th></tr>",
    );
    for (i, r) in rep.figures.iter().enumerate() {
        let _ = write!(
            h,
            r##"<tr><td><a href="#f{i}">{}</a>{}</td><td>{} {}</td><td>{}</td><td>{}</td><td class="src">{}</td></tr>"##,
            esc(&r.name),
            if r.inconsistent { r#" <span class="warn">(the bench's own verdict differs)</span>"# } else { "" },
            esc(&num(r.value)),
            esc(&r.unit),
            esc(&r.bar),
            verdict(r),
            esc(&r.source)
        );
    }
    h.push_str("</table>");
    let mut sources: Vec<&str> = rep.figures.iter().map(|r| r.source.as_str()).collect();
    sources.dedup();
    for src in sources {
        let _ = write!(h, "<h2>{}</h2>", esc(src));
        for (i, r) in rep.figures.iter().enumerate().filter(|(_, r)| r.source == src) {
            let _ = write!(
                h,
                r#"<div class="fig" id="f{i}"><h3>{} {}</h3><div>{} {} &nbsp; bar: {}</div>"#,
                esc(&r.name),
                verdict(r),
                esc(&num(r.value)),
                esc(&r.unit),
                esc(&r.bar)
            );
            if let Some(svg) = plot(r) {
                h.push_str(&svg);
            }
            h.push_str("</div>");
        }
    }
    h.push_str("<p class=\"src\">Every sample, the raw per-sample records and the machine are in report.json beside this page.</p></body></html>\n");
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: &str, bar: &str, value: f64, samples: Vec<f64>, detail: serde_json::Value) -> Row {
        Row {
            source: "t.jsonl".into(),
            name: name.into(),
            value,
            unit: "ms".into(),
            bar: bar.into(),
            pass: Bar::parse(bar).map(|b| b.passes(value)),
            inconsistent: false,
            samples,
            detail,
        }
    }

    #[test]
    fn renders_every_figure_with_its_plot_and_verdict() {
        let rep = Report {
            generated: "now".into(),
            machine: serde_json::json!({"git_commit": "abc", "accelerator": "tcg"}),
            figures: vec![
                row("lat <x>", "<= 2", 3.0, vec![1.0, 2.0, 3.0, 4.0], serde_json::Value::Null),
                row(
                    "arms",
                    ">= 20",
                    30.0,
                    vec![],
                    serde_json::json!({"plot": {"kind": "arms", "unit": "ms", "arms": {"cold": [100, 120], "fork": [4, 5]}}}),
                ),
                row(
                    "slope",
                    "reported",
                    1.0,
                    vec![],
                    serde_json::json!({"plot": {"kind": "xy", "x": [1, 4, 8], "series": {"pss": [10, 40, 80]}}}),
                ),
            ],
            raw: Default::default(),
        };
        let h = render(&rep);
        assert!(h.contains("lat &lt;x&gt;"), "names are escaped");
        assert_eq!(h.matches("<svg").count(), 3);
        assert!(h.contains("1 PASS") && h.contains("1 FAIL") && h.contains("1 reported"));
        assert!(h.contains("<polyline") && h.contains("bar 2"));
        assert!(!h.contains("<script"), "self-contained and static");
    }

    #[test]
    fn plots_are_inferred_from_recorded_arms_and_memory_curves() {
        let lat = row(
            "restore / cold",
            "<= 0.33x",
            0.6,
            vec![5.0, 6.0],
            serde_json::json!({"cold_ms": [10.0, 12.0], "restore_hygiene_ms": [5.0, 6.0], "n": 2}),
        );
        let svg = plot(&lat).expect("an arms plot");
        assert!(svg.contains("cold") && svg.contains("restore_hygiene"), "{svg}");
        let mem = row(
            "memory slope",
            "<= 1.0x",
            0.3,
            vec![],
            serde_json::json!({"counts": [1.0, 4.0, 8.0], "cold_sum_pss_bytes": [1048576.0, 4194304.0, 8388608.0],
                "restored_sum_pss_bytes": [1048576.0, 2097152.0, 3145728.0], "slope": 1.0}),
        );
        let svg = plot(&mem).expect("an xy plot");
        assert!(svg.contains("<polyline") && svg.contains("restored") && svg.contains("cold"), "{svg}");
        let single = row("one arm", "<= 2", 1.0, vec![], serde_json::json!({"cold_ms": [1.0, 2.0]}));
        assert!(!plot(&single).unwrap_or_default().contains("cold"), "one arm is not a comparison");
    }
}
