//! The sandbox operations: `run`, `fork`, `exec`, `mark`, `retake`, `suspend`, `resume`, `freeze`, `thaw`, `kill`,
//! `ls`, `marks`.
//! Each is one call on a `clade_host::SandboxApi`: embedded (no daemon; `clade_host::Ops` starts a supervisor
//! process per sandbox), or `clade serve` when `CLADE_HOST` is set (`clade_api::client::Remote`). The same
//! operation, the same answer type, the same JSON.

use std::io::Write;

use clade_core::backend::BackendKind;
use clade_core::CladeHome;

use clade_api::client::Remote;
use clade_host::api::{ExecRequest, ForkRequest, MarkRequest, ResumeRequest, SandboxApi, SuspendRequest};
use clade_host::Ops;

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
    /// Keep the disk alone, not memory or processes: a sandbox from this mark boots its disk cold.
    #[arg(long)]
    pub disk_only: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args)]
pub struct SuspendArgs {
    pub sandbox: String,
    /// Keep the disk alone: the processes end now and `resume` boots the disk cold (a new boot id), as after
    /// a shutdown. Default: the whole sandbox, memory and processes included.
    #[arg(long)]
    pub disk_only: bool,
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
pub struct KillArgs {
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    pub sandbox: Option<String>,
    /// Every sandbox not dead (several at once).
    #[arg(long)]
    pub all: bool,
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

/// Where operations run: in this process, or in the daemon named by `CLADE_HOST`.
pub(crate) fn api() -> anyhow::Result<Box<dyn SandboxApi>> {
    Ok(match Remote::from_env()? {
        Some(r) => Box::new(r),
        None => Box::new(Ops::open(&CladeHome::from_env())?),
    })
}

/// An answer: as pretty JSON with `--json`, else as `human` says it.
pub(crate) fn print<T: serde::Serialize>(
    json: bool,
    body: &T,
    human: impl FnOnce(&T) -> String,
) -> anyhow::Result<i32> {
    if json {
        println!("{}", serde_json::to_string_pretty(body)?);
    } else {
        println!("{}", human(body));
    }
    Ok(0)
}

pub fn fork(a: ForkArgs) -> anyhow::Result<i32> {
    let req = ForkRequest { from: a.from, backend: a.backend, count: a.count, make_room: a.make_room };
    req.check().map_err(|e| e.context("--count"))?;
    let out = api()?.fork(&req)?;
    let failed = out.failed();
    print(a.json, &out, |o| {
        let mut s = String::new();
        for r in &o.sandboxes {
            match &r.error {
                None => s.push_str(&format!(
                    "{}  ready in {:.0} ms (restore {:.0} ms)\n",
                    r.sandbox, r.ready_ms, r.restore_ms
                )),
                Some(e) => s.push_str(&format!("{}  FAILED: {e}\n", r.sandbox)),
            }
        }
        s.push_str(&format!("{} sandbox(es) from {} in {:.0} ms", o.sandboxes.len(), o.mark, o.total_ms));
        s
    })?;
    Ok(if failed == 0 { 0 } else { 1 })
}

pub fn run(a: RunArgs) -> anyhow::Result<i32> {
    fork(ForkArgs { from: a.from, count: 1, backend: a.backend, make_room: a.make_room, json: a.json })
}

pub fn exec(a: ExecArgs) -> anyhow::Result<i32> {
    let req = ExecRequest { argv: a.argv, ..Default::default() };
    let out = api()?.exec(&a.sandbox, req)?;
    if a.json {
        println!("{}", serde_json::to_string(&out)?);
    } else {
        std::io::stdout().write_all(&out.stdout)?;
        std::io::stderr().write_all(&out.stderr)?;
    }
    Ok(out.code)
}

pub fn mark(a: MarkArgs) -> anyhow::Result<i32> {
    let req = MarkRequest { label: a.label, keep: a.keep, not_clean: a.not_clean, disk_only: a.disk_only };
    let m = api()?.mark(&a.sandbox, &req)?;
    print(a.json, &m, |m| {
        let pause = m.pause_ms.map_or("null".to_string(), |p| p.to_string());
        format!("{}  pause {pause} ms, stored {} KiB", m.id, m.stored_bytes >> 10)
    })
}

pub fn retake(a: RetakeArgs) -> anyhow::Result<i32> {
    let r = api()?.retake(&a.sandbox, &a.to)?;
    print(a.json, &r, |r| format!("{} is back at {} ({:.0} ms)", a.sandbox, r.mark, r.retake_ms))
}

pub fn info(a: SbxArgs) -> anyhow::Result<i32> {
    let info = api()?.get(&a.sandbox)?;
    print(a.json, &info, |i| serde_json::to_string_pretty(i).unwrap_or_default())
}

/// A suspend of a sandbox holding at least this much shows progress (it writes about that much).
const BIG_SUSPEND: u64 = 256 << 20;

pub fn suspend(a: SuspendArgs) -> anyhow::Result<i32> {
    let api = api()?;
    let rss = api.get(&a.sandbox).ok().and_then(|i| i.live).map_or(0, |l| l.rss);
    let call = || api.suspend_with(&a.sandbox, &SuspendRequest { disk_only: a.disk_only });
    let m = if rss >= BIG_SUSPEND && !a.disk_only {
        super::progress::around(&format!("suspending {} ({} MiB resident)", a.sandbox, rss >> 20), call)?
    } else {
        call()?
    };
    print(a.json, &m, |m| format!("{} suspended at {}", a.sandbox, m.id))
}

#[derive(clap::Args)]
pub struct WatchArgs {
    pub sandbox: String,
    /// An absolute path of a directory in the sandbox.
    pub path: String,
    /// Its subdirectories too, those made later included.
    #[arg(long, short)]
    pub recursive: bool,
    /// Stop after this many events (default: until interrupted).
    #[arg(long)]
    pub count: Option<usize>,
    /// One JSON object a line (`{"name", "kind"}`; `{"lost": true}` where events may be missing).
    #[arg(long)]
    pub json: bool,
}

/// `clade watch`: the sandbox's own watch (docs/agent.md, "Watches"), read a second at a time.
pub fn watch(a: WatchArgs) -> anyhow::Result<i32> {
    use nix::sys::signal::{SigSet, Signal};
    // Ctrl-C or a TERM ends the loop (read from a signalfd between reads), so the watch is stopped in the
    // sandbox rather than left there.
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGINT);
    mask.add(Signal::SIGTERM);
    mask.thread_block()?;
    let stop = nix::sys::signalfd::SignalFd::with_flags(&mask, nix::sys::signalfd::SfdFlags::SFD_NONBLOCK)?;
    let api = api()?;
    let watch = api.watch_start(&a.sandbox, &a.path, a.recursive)?;
    let mut seen = 0usize;
    let mut out = std::io::stdout().lock();
    let result = loop {
        let batch = match api.watch_events(&a.sandbox, watch, 1000) {
            Ok(b) => b,
            Err(e) => break Err(e),
        };
        if batch.lost {
            let line = if a.json { r#"{"lost":true}"#.to_string() } else { "(events may be missing here)".into() };
            writeln!(out, "{line}")?;
        }
        for e in batch.events {
            let kind = serde_json::to_value(e.kind)?.as_str().unwrap_or_default().to_string();
            let line = if a.json {
                serde_json::json!({"name": e.name, "kind": kind}).to_string()
            } else {
                format!("{kind:<7} {}", e.name)
            };
            writeln!(out, "{line}")?;
            seen += 1;
            if a.count.is_some_and(|n| seen >= n) {
                break;
            }
        }
        out.flush()?;
        if a.count.is_some_and(|n| seen >= n) || matches!(stop.read_signal(), Ok(Some(_))) {
            break Ok(0);
        }
    };
    let _ = api.watch_stop(&a.sandbox, watch);
    result
}

/// `clade freeze` (`frozen`) or `clade thaw`.
pub fn freeze(a: SbxArgs, frozen: bool) -> anyhow::Result<i32> {
    let api = api()?;
    if frozen {
        api.freeze(&a.sandbox)?;
    } else {
        api.thaw(&a.sandbox)?;
    }
    let answer = serde_json::json!({"sandbox": a.sandbox, "frozen": frozen});
    print(a.json, &answer, |_| format!("{} {}", a.sandbox, if frozen { "frozen" } else { "thawed" }))
}

pub fn kill(a: KillArgs) -> anyhow::Result<i32> {
    let Some(sandbox) = a.sandbox else {
        let k = api()?.kill_all()?;
        let failed = !k.failed.is_empty();
        print(a.json, &k, |k| {
            let mut s = format!("{} killed in {:.0} ms", k.killed.len(), k.took_ms);
            for f in &k.failed {
                s.push_str(&format!("\n{}: not killed: {}", f.sandbox, f.error));
            }
            s
        })?;
        return Ok(if failed { 1 } else { 0 });
    };
    let k = api()?.kill(&sandbox)?;
    if let Some(n) = k.reaped.filter(|n| *n > 0) {
        eprintln!("clade: ended {n} process(es) left behind by the dead supervisor of {sandbox}");
    }
    print(a.json, &k, |_| format!("{sandbox} killed"))
}

#[derive(clap::Args)]
pub struct ResumeArgs {
    pub sandbox: String,
    /// Boot its disk cold instead of restoring its memory: its files as suspended, new processes, a new boot id.
    #[arg(long)]
    pub reboot: bool,
    #[arg(long)]
    pub json: bool,
}

pub fn resume(a: ResumeArgs) -> anyhow::Result<i32> {
    let r = api()?.resume_with(&a.sandbox, &ResumeRequest { reboot: a.reboot })?;
    let ok = r.ok;
    print(a.json, &r, |r| match &r.error {
        None => format!("{} resumed from {} in {:.0} ms", a.sandbox, r.mark, r.resume_ms),
        Some(e) => format!("{} could not resume: {e}", a.sandbox),
    })?;
    Ok(if ok { 0 } else { 1 })
}

pub fn ls(a: ListArgs) -> anyhow::Result<i32> {
    let rows = api()?.list()?;
    print(a.json, &rows, |rows| {
        let mut s = format!("{:<40} {:<4} {:<10} origin", "SANDBOX", "", "STATE");
        for r in rows {
            let state = match r.state.as_str() {
                "lost" => "lost (supervisor died)",
                st => st,
            };
            let origin = r.origin.as_ref().map_or("-", |m| m.as_str());
            s.push_str(&format!("\n{:<40} {:<4} {:<10} {origin}", r.id, r.backend.as_str(), state));
        }
        s
    })
}

pub fn marks(a: MarksArgs) -> anyhow::Result<i32> {
    let rows = api()?.marks(a.sandbox.as_deref())?;
    print(a.json, &rows, |rows| {
        let mut s = format!("{:<40} {:<3} {:>9} {:>12}  label", "MARK", "", "PAUSE ms", "STORED KiB");
        for r in rows {
            let pause = r.pause_ms.map_or("null".to_string(), |p| p.to_string());
            s.push_str(&format!(
                "\n{:<40} {:<3} {:>9} {:>12}  {}",
                r.id.as_str(),
                r.backend.as_str(),
                pause,
                r.stored_bytes >> 10,
                r.label.as_deref().unwrap_or("")
            ));
        }
        s
    })
}
