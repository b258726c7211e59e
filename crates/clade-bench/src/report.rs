//! `clade-bench report` (the last step of `./x bench`): every figure the benches wrote under `bench/out/`
//! gathered into `report.json` (every sample, the machine, the accelerator, versions, the git commit) and
//! `report.html`, one self-contained page with plots (docs/report.md).
//!
//! A *figure* is a JSON line with `name`, `value`, `unit`, `bar` and `pass` (the shape of [`super::Figure`]);
//! other lines a bench prints (per-sample records) are kept as raw data. PASS/FAIL is never typed in: it is
//! recomputed here from the value and the bar (`<= X`, `>= X`; "reported" bars have none), and a bench whose own
//! verdict disagrees is flagged. A figure may carry a plot in `detail.plot` (see [`super::html`]); otherwise its
//! samples are drawn with the bar as a line.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use serde::Serialize;

#[derive(clap::Args)]
pub struct Args {
    /// The directory the benches wrote (`*.jsonl`, `*.json`); the report goes there too.
    #[arg(long, default_value = "bench/out")]
    pub dir: PathBuf,
}

/// A bar parsed from its text: the value must be at most / at least `limit`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum Bar {
    AtMost(f64),
    AtLeast(f64),
    /// A count that must be exactly this (`0`, `0 (clean: ...)`, `= running after the restart (5)`), or a
    /// check whose value is 1 when it passed (`pass: ...` with unit `pass`).
    Exactly(f64),
}

impl Bar {
    /// `<= 1.5`, `>= 20`, `at most 2x ...`, `at least 0.7`; `0 ...` or `= N` or `= words (N)` (exactly N);
    /// `pass...` (exactly 1: a check); anything else has no bar (a reported figure).
    pub fn parse(text: &str) -> Option<Bar> {
        let t = text.trim();
        let number = |r: &str| -> Option<f64> {
            let num: String =
                r.trim_start().chars().take_while(|c| c.is_ascii_digit() || *c == '.' || *c == '-').collect();
            num.parse().ok()
        };
        // `<= 5`, or the first number in parentheses of `<= cold p95 (1322 ms)` / `= running after (5)`.
        let limit = |r: &str| number(r).or_else(|| r.split_once('(').and_then(|(_, n)| number(n)));
        if let Some(r) = t.strip_prefix("<=").or_else(|| t.strip_prefix("at most")) {
            return limit(r).map(Bar::AtMost);
        }
        if let Some(r) = t.strip_prefix(">=").or_else(|| t.strip_prefix("at least")) {
            return limit(r).map(Bar::AtLeast);
        }
        if let Some(r) = t.strip_prefix('=') {
            return limit(r).map(Bar::Exactly);
        }
        if t.starts_with("pass") {
            return Some(Bar::Exactly(1.0));
        }
        // A bare count: `0`, `0 (clean: ...)`.
        let first = t.split_whitespace().next().unwrap_or("");
        first.parse::<f64>().ok().map(Bar::Exactly)
    }

    pub fn passes(&self, value: f64) -> bool {
        match *self {
            Bar::AtMost(l) => value <= l,
            Bar::AtLeast(l) => value >= l,
            Bar::Exactly(l) => (value - l).abs() < 1e-9,
        }
    }

    pub fn limit(&self) -> f64 {
        match *self {
            Bar::AtMost(l) | Bar::AtLeast(l) | Bar::Exactly(l) => l,
        }
    }
}

/// One figure as the report shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// The file it came from (`vm.json`, `store.jsonl`, ...).
    pub source: String,
    pub name: String,
    pub value: f64,
    pub unit: String,
    pub bar: String,
    /// Recomputed from value and bar; `None` for a reported figure.
    pub pass: Option<bool>,
    /// The bench's own verdict disagreed with the recomputed one.
    pub inconsistent: bool,
    pub samples: Vec<f64>,
    pub detail: serde_json::Value,
}

impl Row {
    fn from_json(source: &str, v: &serde_json::Value) -> Option<Row> {
        let name = v.get("name")?.as_str()?.to_string();
        let value = v.get("value")?.as_f64()?;
        let bar = match v.get("bar") {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Number(n)) => format!("reported ({n})"),
            _ => String::new(),
        };
        let pass = Bar::parse(&bar).map(|b| b.passes(value));
        let own = v.get("pass").and_then(serde_json::Value::as_bool);
        let samples =
            v.get("samples").and_then(|s| s.as_array()).map(|a| a.iter().filter_map(|x| x.as_f64()).collect());
        Some(Row {
            source: source.to_string(),
            name,
            value,
            unit: v.get("unit").and_then(|u| u.as_str()).unwrap_or("").to_string(),
            inconsistent: matches!((pass, own), (Some(p), Some(o)) if p != o),
            pass,
            bar,
            samples: samples.unwrap_or_default(),
            detail: v.get("detail").cloned().unwrap_or(serde_json::Value::Null),
        })
    }
}

/// Everything `report.json` holds.
#[derive(Debug, Serialize)]
pub struct Report {
    pub generated: String,
    pub machine: serde_json::Value,
    pub figures: Vec<Row>,
    /// Lines of each bench output that are not figures (per-sample records), by file.
    pub raw: serde_json::Map<String, serde_json::Value>,
}

/// Read every `*.jsonl` (one JSON value per line) and `*.json` (an array of figures, or one object) in `dir`.
pub fn gather(dir: &Path) -> anyhow::Result<(Vec<Row>, serde_json::Map<String, serde_json::Value>)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("read {} (run ./x bench first)", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("json" | "jsonl")))
        .filter(|p| p.file_stem().and_then(|s| s.to_str()) != Some("report"))
        .collect();
    files.sort();
    let mut rows: Vec<Row> = Vec::new();
    let mut raw = serde_json::Map::new();
    for f in files {
        let source = f.file_name().and_then(|n| n.to_str()).unwrap_or("").to_string();
        let text = std::fs::read_to_string(&f).with_context(|| format!("read {}", f.display()))?;
        let values: Vec<serde_json::Value> = if source.ends_with(".jsonl") {
            text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
        } else {
            match serde_json::from_str(&text) {
                Ok(serde_json::Value::Array(a)) => a,
                Ok(v) => vec![v],
                Err(_) => Vec::new(),
            }
        };
        let mut other = Vec::new();
        for v in values {
            match Row::from_json(&source, &v) {
                // A `.json` beside a `.jsonl` of the same bench repeats its figures: keep one of each name, the
                // one with more samples.
                Some(r) => match rows.iter_mut().find(|x| x.name == r.name) {
                    Some(old) if r.samples.len() > old.samples.len() => *old = r,
                    Some(_) => {}
                    None => rows.push(r),
                },
                None => other.push(v),
            }
        }
        if !other.is_empty() {
            raw.insert(source, serde_json::Value::Array(other));
        }
    }
    Ok((rows, raw))
}

fn cmd_line(prog: &str, args: &[&str]) -> String {
    Command::new(prog)
        .args(args)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or("").trim().to_string())
        .unwrap_or_default()
}

/// The machine the figures were measured on.
pub fn machine(home: &clade_core::CladeHome) -> serde_json::Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu =
        cpuinfo.lines().find_map(|l| l.strip_prefix("model name")).map(|l| l.trim_start_matches([' ', '\t', ':']));
    let mem_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let accel: serde_json::Value = std::fs::read(home.root().join("cache/accel.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(serde_json::Value::Null);
    let criu = home.root().join("criu/bin/criu");
    serde_json::json!({
        "hostname": cmd_line("hostname", &[]),
        "kernel": cmd_line("uname", &["-r"]),
        "cpu": cpu,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "memory_gib": mem_kib as f64 / 1048576.0,
        "loadavg": std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim(),
        "accelerator": accel.get("chosen"),
        "accelerator_reason": accel.get("reason"),
        "qemu": cmd_line("qemu-system-x86_64", &["--version"]),
        "criu": cmd_line(&criu.display().to_string(), &["--version"]),
        "guest_kernel": accel.get("kernel"),
        "git_commit": cmd_line("git", &["rev-parse", "HEAD"]),
        "git_dirty": !cmd_line("git", &["status", "--porcelain", "--untracked-files=no"]).is_empty(),
        "clade": env!("CARGO_PKG_VERSION"),
    })
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let home = clade_core::CladeHome::from_env();
    let (figures, raw) = gather(&a.dir)?;
    let report =
        Report { generated: cmd_line("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]), machine: machine(&home), figures, raw };
    let json_path = a.dir.join("report.json");
    let html_path = a.dir.join("report.html");
    write_atomic(&json_path, &serde_json::to_vec_pretty(&report)?)?;
    write_atomic(&html_path, super::html::render(&report).as_bytes())?;
    let (pass, fail) = report.figures.iter().fold((0, 0), |(p, f), r| match r.pass {
        Some(true) => (p + 1, f),
        Some(false) => (p, f + 1),
        None => (p, f),
    });
    eprintln!(
        "report: {} figures ({pass} pass, {fail} fail, {} reported) -> {} and {}",
        report.figures.len(),
        report.figures.len() - pass - fail,
        json_path.display(),
        html_path.display()
    );
    Ok(0)
}

fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("publish {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_parse_and_judge() {
        assert_eq!(Bar::parse("<= 1.5"), Some(Bar::AtMost(1.5)));
        assert_eq!(Bar::parse(">= 20"), Some(Bar::AtLeast(20.0)));
        assert_eq!(Bar::parse("at most 2x clade's library call"), Some(Bar::AtMost(2.0)));
        assert_eq!(Bar::parse("reported"), None);
        assert_eq!(Bar::parse("0"), Some(Bar::Exactly(0.0)));
        assert_eq!(Bar::parse("<= cold p95 (1322 ms)"), Some(Bar::AtMost(1322.0)));
        assert_eq!(Bar::parse("0 (clean: connection closed or refused)"), Some(Bar::Exactly(0.0)));
        assert_eq!(Bar::parse("= running after the restart (5)"), Some(Bar::Exactly(5.0)));
        assert_eq!(Bar::parse("pass: nothing writable shared"), Some(Bar::Exactly(1.0)));
        assert!(Bar::Exactly(0.0).passes(0.0) && !Bar::Exactly(0.0).passes(1.0));
        assert!(Bar::AtMost(1.0).passes(1.0) && !Bar::AtMost(1.0).passes(1.01));
        assert!(Bar::AtLeast(0.7).passes(0.9) && !Bar::AtLeast(0.7).passes(0.5));
    }

    #[test]
    fn gather_recomputes_verdicts_and_keeps_raw_lines() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(
            d.path().join("x.jsonl"),
            concat!(
                r#"{"name":"a","value":3.0,"unit":"ms","bar":"<= 2","pass":true,"samples":[1,3,5]}"#,
                "\n",
                r#"{"bench":"start","i":0,"cold_ms":10}"#,
                "\n",
                r#"{"name":"b","value":30,"unit":"x","bar":">= 20","pass":true}"#,
                "\n",
                "not json\n"
            ),
        )
        .unwrap();
        std::fs::write(d.path().join("x.json"), r#"[{"name":"a","value":3.0,"unit":"ms","bar":"<= 2","pass":true}]"#)
            .unwrap();
        let (rows, raw) = gather(d.path()).unwrap();
        assert_eq!(rows.len(), 2, "the .json repeats a figure of the .jsonl: {rows:?}");
        let a = rows.iter().find(|r| r.name == "a").unwrap();
        assert_eq!(a.pass, Some(false));
        assert!(a.inconsistent, "the bench said pass, the bar says fail");
        assert_eq!(a.samples, vec![1.0, 3.0, 5.0]);
        assert_eq!(rows.iter().find(|r| r.name == "b").unwrap().pass, Some(true));
        assert_eq!(raw["x.jsonl"].as_array().unwrap().len(), 1);
    }
}
