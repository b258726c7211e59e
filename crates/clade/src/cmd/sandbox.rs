//! The sandbox operations: `run`, `fork`, `exec`, `mark`, `retake`, `suspend`, `resume`, `kill`, `ls`, `marks`.
//! They work embedded (no daemon; [`clade_host::ops`] starts a supervisor process per sandbox), or through
//! `clade serve` when `CLADE_HOST` is set: the same operation, the same JSON.

use std::io::Write;

use anyhow::anyhow;
use clade_core::backend::BackendKind;
use clade_core::{CladeHome, ErrorKind, OpError};

pub use clade_host::supervisor::start::fork_mark;
use clade_host::ops::{ExecRequest, Ops};
use clade_api::client::{encode, Remote};

#[derive(clap::Args)]
pub struct RunArgs {
    /// A mark id or label, or a template name (its base on --backend).
    pub from: String,
    #[arg(long)]
    pub backend: Option<BackendKind>,
    /// When the host lacks memory or CPU, suspend the idlest sandboxes to make room (else: refused, exit 5).
    #[arg(long)]
    pub make_room: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args)]
pub struct ForkArgs {
    /// A mark id or label, or a template name (its base on --backend).
    pub from: String,
    #[arg(long, default_value_t = 1)]
    pub count: u32,
    #[arg(long)]
    pub backend: Option<BackendKind>,
    /// When the host lacks memory or CPU, suspend the idlest sandboxes to make room (else: refused, exit 5).
    #[arg(long)]
    pub make_room: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args)]
pub struct ExecArgs {
    pub sandbox: String,
    /// Print one JSON object (exit code, stdout, stderr) instead of the streams.
    #[arg(long)]
    pub json: bool,
    #[arg(last = true, required = true)]
    pub argv: Vec<String>,
}

#[derive(clap::Args)]
pub struct MarkArgs {
    pub sandbox: String,
    #[arg(long)]
    pub label: Option<String>,
    /// Never thin this mark away (a pin).
    #[arg(long)]
    pub keep: bool,
    /// Keep state hygiene would disturb (e.g. a logged-in browser): restores skip identity and connection resets.
    #[arg(long)]
    pub not_clean: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args)]
pub struct RetakeArgs {
    pub sandbox: String,
    #[arg(long)]
    pub to: String,
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args)]
pub struct SbxArgs {
    pub sandbox: String,
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args)]
pub struct ListArgs {
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args)]
pub struct MarksArgs {
    /// Only this sandbox's branch.
    pub sandbox: Option<String>,
    #[arg(long)]
    pub json: bool,
}

/// Where an operation runs: in this process, or in the daemon named by `CLADE_HOST`.
pub(crate) enum Face {
    Local(Box<Ops>),
    Remote(Remote),
}

pub(crate) fn face() -> anyhow::Result<Face> {
    Ok(match Remote::from_env()? {
        Some(r) => Face::Remote(r),
        None => Face::Local(Box::new(Ops::open(&CladeHome::from_env())?)),
    })
}

pub(crate) fn print(
    json: bool,
    body: &serde_json::Value,
    human: impl FnOnce(&serde_json::Value) -> String,
) -> anyhow::Result<i32> {
    if json {
        println!("{}", serde_json::to_string_pretty(body)?);
    } else {
        println!("{}", human(body));
    }
    Ok(0)
}

pub fn fork(a: ForkArgs) -> anyhow::Result<i32> {
    if a.count == 0 {
        return Err(anyhow!(OpError::new(ErrorKind::Invalid, "--count must be at least 1")));
    }
    let out = match face()? {
        Face::Local(ops) => ops.fork_with(&a.from, a.backend, a.count, a.make_room)?,
        Face::Remote(r) => r.call(
            "POST",
            "/v1/sandboxes",
            Some(
                &serde_json::json!({"from": a.from, "backend": a.backend, "count": a.count, "make_room": a.make_room}),
            ),
        )?,
    };
    let sandboxes = out["sandboxes"].as_array().cloned().unwrap_or_default();
    let failed = sandboxes.iter().filter(|r| !r["ok"].as_bool().unwrap_or(false)).count();
    print(a.json, &out, |o| {
        let mut s = String::new();
        for r in &sandboxes {
            match r["error"].as_str() {
                None => s.push_str(&format!(
                    "{}  ready in {:.0} ms (restore {:.0} ms)\n",
                    r["sandbox"].as_str().unwrap_or("?"),
                    r["ready_ms"].as_f64().unwrap_or(0.0),
                    r["restore_ms"].as_f64().unwrap_or(0.0)
                )),
                Some(e) => s.push_str(&format!("{}  FAILED: {e}\n", r["sandbox"].as_str().unwrap_or("?"))),
            }
        }
        s.push_str(&format!(
            "{} sandbox(es) from {} in {:.0} ms",
            sandboxes.len(),
            o["mark"].as_str().unwrap_or("?"),
            o["total_ms"].as_f64().unwrap_or(0.0)
        ));
        s
    })?;
    Ok(if failed == 0 { 0 } else { 1 })
}

pub fn run(a: RunArgs) -> anyhow::Result<i32> {
    fork(ForkArgs { from: a.from, count: 1, backend: a.backend, make_room: a.make_room, json: a.json })
}

pub fn exec(a: ExecArgs) -> anyhow::Result<i32> {
    let req = ExecRequest { argv: a.argv, ..Default::default() };
    let out = match face()? {
        Face::Local(ops) => serde_json::to_value(ops.exec(&a.sandbox, req)?)?,
        Face::Remote(r) => {
            r.call("POST", &format!("/v1/sandboxes/{}/exec", encode(&a.sandbox)), Some(&serde_json::to_value(&req)?))?
        }
    };
    let code = out["code"].as_i64().unwrap_or(1) as i32;
    if a.json {
        println!("{out}");
    } else {
        std::io::stdout().write_all(out["stdout"].as_str().unwrap_or("").as_bytes())?;
        std::io::stderr().write_all(out["stderr"].as_str().unwrap_or("").as_bytes())?;
    }
    Ok(code)
}

pub fn mark(a: MarkArgs) -> anyhow::Result<i32> {
    let body = match face()? {
        Face::Local(ops) => ops.mark(&a.sandbox, a.label, a.keep, a.not_clean)?,
        Face::Remote(r) => r.call(
            "POST",
            &format!("/v1/sandboxes/{}/marks", encode(&a.sandbox)),
            Some(&serde_json::json!({"label": a.label, "keep": a.keep, "not_clean": a.not_clean})),
        )?,
    };
    print(a.json, &body, |b| {
        format!(
            "{}  pause {} ms, stored {} KiB",
            b["id"].as_str().unwrap_or("?"),
            b["pause_ms"],
            b["stored_bytes"].as_u64().unwrap_or(0) >> 10
        )
    })
}

pub fn retake(a: RetakeArgs) -> anyhow::Result<i32> {
    let body = match face()? {
        Face::Local(ops) => ops.retake(&a.sandbox, &a.to)?,
        Face::Remote(r) => r.call(
            "POST",
            &format!("/v1/sandboxes/{}/retake", encode(&a.sandbox)),
            Some(&serde_json::json!({"to": a.to})),
        )?,
    };
    print(a.json, &body, |b| {
        format!(
            "{} is back at {} ({:.0} ms)",
            a.sandbox,
            b["mark"].as_str().unwrap_or("?"),
            b["retake_ms"].as_f64().unwrap_or(0.0)
        )
    })
}

fn simple(
    a: &SbxArgs,
    local: impl FnOnce(&Ops) -> anyhow::Result<serde_json::Value>,
    method: &str,
    route: &str,
) -> anyhow::Result<serde_json::Value> {
    match face()? {
        Face::Local(ops) => local(&ops),
        Face::Remote(r) => {
            let path = format!("/v1/sandboxes/{}{route}", encode(&a.sandbox));
            r.call(method, &path, None)
        }
    }
}

pub fn info(a: SbxArgs) -> anyhow::Result<i32> {
    let body = simple(&a, |o| o.get(&a.sandbox), "GET", "")?;
    print(a.json, &body, |b| serde_json::to_string_pretty(b).unwrap_or_default())
}

/// A suspend of a sandbox holding at least this much shows progress (it writes about that much).
const BIG_SUSPEND: u64 = 256 << 20;

pub fn suspend(a: SbxArgs) -> anyhow::Result<i32> {
    let rss = match face()? {
        Face::Local(ops) => ops.get(&a.sandbox).ok(),
        Face::Remote(r) => r.call("GET", &format!("/v1/sandboxes/{}", encode(&a.sandbox)), None).ok(),
    }
    .and_then(|v| v["rss"].as_u64())
    .unwrap_or(0);
    let call = || simple(&a, |o| o.suspend(&a.sandbox), "POST", "/suspend");
    let body = if rss >= BIG_SUSPEND {
        super::progress::around(&format!("suspending {} ({} MiB resident)", a.sandbox, rss >> 20), call)?
    } else {
        call()?
    };
    print(a.json, &body, |b| format!("{} suspended at {}", a.sandbox, b["id"].as_str().unwrap_or("?")))
}

pub fn kill(a: SbxArgs) -> anyhow::Result<i32> {
    let body = simple(&a, |o| o.kill(&a.sandbox), "DELETE", "")?;
    if body["reaped"].as_u64().unwrap_or(0) > 0 {
        eprintln!("clade: ended {} process(es) left behind by the dead supervisor of {}", body["reaped"], a.sandbox);
    }
    print(a.json, &body, |_| format!("{} killed", a.sandbox))
}

pub fn resume(a: SbxArgs) -> anyhow::Result<i32> {
    let body = simple(&a, |o| o.resume(&a.sandbox), "POST", "/resume")?;
    let ok = body["ok"].as_bool().unwrap_or(false);
    print(a.json, &body, |b| match b["error"].as_str() {
        None => format!(
            "{} resumed from {} in {:.0} ms",
            a.sandbox,
            b["mark"].as_str().unwrap_or("?"),
            b["resume_ms"].as_f64().unwrap_or(0.0)
        ),
        Some(e) => format!("{} could not resume: {e}", a.sandbox),
    })?;
    Ok(if ok { 0 } else { 1 })
}

pub fn ls(a: ListArgs) -> anyhow::Result<i32> {
    let rows = match face()? {
        Face::Local(ops) => serde_json::to_value(ops.list()?)?,
        Face::Remote(r) => r.call("GET", "/v1/sandboxes", None)?,
    };
    print(a.json, &rows, |rows| {
        let mut s = format!("{:<40} {:<4} {:<10} origin", "SANDBOX", "", "STATE");
        for r in rows.as_array().into_iter().flatten() {
            let state = match r["state"].as_str().unwrap_or("") {
                "lost" => "lost (supervisor died)",
                st => st,
            };
            s.push_str(&format!(
                "\n{:<40} {:<4} {:<10} {}",
                r["id"].as_str().unwrap_or(""),
                r["backend"].as_str().unwrap_or(""),
                state,
                r["origin"].as_str().unwrap_or("-")
            ));
        }
        s
    })
}

pub fn marks(a: MarksArgs) -> anyhow::Result<i32> {
    let rows = match face()? {
        Face::Local(ops) => serde_json::to_value(ops.marks(a.sandbox.as_deref())?)?,
        Face::Remote(r) => match &a.sandbox {
            Some(s) => r.call("GET", &format!("/v1/sandboxes/{}/marks", encode(s)), None)?,
            None => r.call("GET", "/v1/marks", None)?,
        },
    };
    print(a.json, &rows, |rows| {
        let mut s = format!("{:<40} {:<3} {:>9} {:>12}  label", "MARK", "", "PAUSE ms", "STORED KiB");
        for r in rows.as_array().into_iter().flatten() {
            s.push_str(&format!(
                "\n{:<40} {:<3} {:>9} {:>12}  {}",
                r["id"].as_str().unwrap_or(""),
                r["backend"].as_str().unwrap_or(""),
                r["pause_ms"],
                r["stored_bytes"].as_u64().unwrap_or(0) >> 10,
                r["label"].as_str().unwrap_or("")
            ));
        }
        s
    })
}
