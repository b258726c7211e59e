//! The sandbox operations: `run`, `fork`, `exec`, `mark`, `retake`, `suspend`, `resume`, `kill`, `ls`, `marks`.
//! They work embedded (no daemon): each running sandbox has its own supervisor process, started here.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use base64::Engine as _;
use clade_core::backend::BackendKind;
use clade_core::engine::{from_ledger, Engine};
use clade_core::{CladeHome, ExitCoded};
use clade_ledger::{Mark, SandboxId, SandboxState};

use crate::supervisor::protocol::{Ready, Request};
use crate::supervisor::{client, ready_file, sup_dir};

#[derive(clap::Args)]
pub struct RunArgs {
    /// A mark id or label, or a template name (its base on --backend).
    pub from: String,
    #[arg(long)]
    pub backend: Option<BackendKind>,
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

fn home() -> CladeHome {
    CladeHome::from_env()
}

fn not_found(msg: String) -> anyhow::Error {
    anyhow!(ExitCoded::new(3, msg))
}

/// Start a supervisor for `sandbox` restoring `mark`, detached from this process.
fn spawn_supervisor(home: &CladeHome, sandbox: &SandboxId, mark: &Mark, generation: u64) -> anyhow::Result<()> {
    let dir = sup_dir(home, sandbox.as_str());
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let log = std::fs::File::create(crate::supervisor::log_file(home, sandbox.as_str()))?;
    let exe = std::env::current_exe().context("locate the clade binary")?;
    use std::os::unix::process::CommandExt;
    Command::new(exe)
        .args(["supervise", "--sandbox", sandbox.as_str(), "--mark", mark.id.as_str()])
        .arg("--generation")
        .arg(generation.to_string())
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .context("start the supervisor")?;
    Ok(())
}

fn wait_ready(home: &CladeHome, sandbox: &SandboxId, timeout: Duration) -> anyhow::Result<Ready> {
    let path = ready_file(home, sandbox.as_str());
    let start = Instant::now();
    loop {
        if let Ok(b) = std::fs::read(&path) {
            if let Ok(r) = serde_json::from_slice::<Ready>(&b) {
                return Ok(r);
            }
        }
        if start.elapsed() > timeout {
            let log = std::fs::read_to_string(crate::supervisor::log_file(home, sandbox.as_str())).unwrap_or_default();
            return Err(anyhow!("sandbox {sandbox} not ready after {timeout:?}; supervisor log: {}", log.trim()));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Fork `count` siblings of a mark: claim warm-pool members first (all at once), start supervisors for the
/// rest, wait for all, then refill the pool in the background.
pub fn fork_mark(engine: &Engine, mark: &Mark, count: u32) -> anyhow::Result<(Vec<Ready>, Duration)> {
    use crate::supervisor::pool;
    let home = &engine.home;
    let start = Instant::now();
    let mut claimed = Vec::new();
    let mut cold = Vec::new();
    for _ in 0..count {
        match pool::take(home, mark.id.as_str()) {
            Some(m) => claimed.push(m),
            None => {
                let rec = engine.new_sandbox(from_ledger(mark.backend), Some(mark))?;
                spawn_supervisor(home, &rec.id, mark, 1)?;
                cold.push(rec.id);
            }
        }
    }
    let mut out = Vec::new();
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let handles: Vec<_> =
            claimed.iter().map(|(id, sock)| scope.spawn(move || pool::claim(engine, mark, id, sock))).collect();
        for h in handles {
            out.push(h.join().map_err(|_| anyhow!("a claim thread panicked"))??);
        }
        Ok(())
    })?;
    for id in &cold {
        out.push(wait_ready(home, id, Duration::from_secs(180))?);
    }
    let took = start.elapsed();
    if !claimed.is_empty() {
        let _ = pool::refill(home, mark.id.as_str());
    }
    Ok((out, took))
}

pub fn fork(a: ForkArgs) -> anyhow::Result<i32> {
    if a.count == 0 {
        return Err(anyhow!(ExitCoded::new(2, "--count must be at least 1")));
    }
    let engine = Engine::open(&home())?;
    let mark = engine.resolve_mark(&a.from, a.backend)?;
    let (ready, took) = fork_mark(&engine, &mark, a.count)?;
    let failed: Vec<&Ready> = ready.iter().filter(|r| !r.ok).collect();
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "mark": mark.id, "backend": from_ledger(mark.backend), "total_ms": took.as_secs_f64() * 1e3,
                "sandboxes": ready,
            }))?
        );
    } else {
        for r in &ready {
            match &r.error {
                None => println!("{}  ready in {:.0} ms (restore {:.0} ms)", r.sandbox, r.ready_ms, r.restore_ms),
                Some(e) => println!("{}  FAILED: {e}", r.sandbox),
            }
        }
        println!("{} sandbox(es) from {} in {:.0} ms", ready.len(), mark.id, took.as_secs_f64() * 1e3);
    }
    Ok(if failed.is_empty() { 0 } else { 1 })
}

pub fn run(a: RunArgs) -> anyhow::Result<i32> {
    fork(ForkArgs { from: a.from, count: 1, backend: a.backend, json: a.json })
}

pub fn exec(a: ExecArgs) -> anyhow::Result<i32> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let body = client::call(
        &home(),
        &a.sandbox,
        &Request::Exec { argv: a.argv, env: Default::default(), cwd: None, stdin_b64: None },
    )?;
    let stdout = b64.decode(body["stdout_b64"].as_str().unwrap_or("")).unwrap_or_default();
    let stderr = b64.decode(body["stderr_b64"].as_str().unwrap_or("")).unwrap_or_default();
    let code =
        body["code"].as_i64().map(|c| c as i32).unwrap_or_else(|| 128 + body["signal"].as_i64().unwrap_or(0) as i32);
    if a.json {
        println!(
            "{}",
            serde_json::json!({"code": code, "stdout": String::from_utf8_lossy(&stdout), "stderr": String::from_utf8_lossy(&stderr)})
        );
    } else {
        std::io::stdout().write_all(&stdout)?;
        std::io::stderr().write_all(&stderr)?;
    }
    Ok(code)
}

fn print(
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

pub fn mark(a: MarkArgs) -> anyhow::Result<i32> {
    let body =
        client::call(&home(), &a.sandbox, &Request::Mark { label: a.label, keep: a.keep, not_clean: a.not_clean })?;
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
    let body = client::call(&home(), &a.sandbox, &Request::Retake { mark: a.to })?;
    print(a.json, &body, |b| {
        format!(
            "{} is back at {} ({:.0} ms)",
            a.sandbox,
            b["mark"].as_str().unwrap_or("?"),
            b["retake_ms"].as_f64().unwrap_or(0.0)
        )
    })
}

pub fn suspend(a: SbxArgs) -> anyhow::Result<i32> {
    let body = client::call(&home(), &a.sandbox, &Request::Suspend)?;
    print(a.json, &body, |b| format!("{} suspended at {}", a.sandbox, b["id"].as_str().unwrap_or("?")))
}

pub fn kill(a: SbxArgs) -> anyhow::Result<i32> {
    let home = home();
    match client::call(&home, &a.sandbox, &Request::Kill) {
        Ok(body) => print(a.json, &body, |_| format!("{} killed", a.sandbox)),
        Err(e) => {
            // No live supervisor: a suspended or lost sandbox ends in the ledger alone.
            let engine = Engine::open(&home)?;
            let id = SandboxId::new(a.sandbox.clone());
            let rec = engine.ledger().sandbox(&id).map_err(|_| not_found(format!("no sandbox {}: {e}", a.sandbox)))?;
            if rec.state == SandboxState::Dead {
                return Err(not_found(format!("sandbox {} is already dead", a.sandbox)));
            }
            engine.ledger().set_sandbox_state(&id, SandboxState::Dead, None)?;
            let reaped = reap_orphans(&home, &a.sandbox);
            let _ = std::fs::remove_dir_all(sup_dir(&home, &a.sandbox));
            let _ = std::fs::remove_dir_all(home.run_dir().join(&a.sandbox));
            if reaped > 0 {
                eprintln!("clade: ended {reaped} process(es) left behind by the dead supervisor of {}", a.sandbox);
            }
            print(a.json, &serde_json::json!({"killed": a.sandbox}), |_| format!("{} killed", a.sandbox))
        }
    }
}

pub fn resume(a: SbxArgs) -> anyhow::Result<i32> {
    let home = home();
    let engine = Engine::open(&home)?;
    let id = SandboxId::new(a.sandbox.clone());
    let rec = engine.ledger().sandbox(&id).map_err(|e| not_found(format!("no sandbox {}: {e}", a.sandbox)))?;
    if rec.state != SandboxState::Suspended {
        return Err(anyhow!(ExitCoded::new(4, format!("sandbox {} is {:?}, not suspended", a.sandbox, rec.state))));
    }
    let head = engine
        .ledger()
        .head(&rec.branch)?
        .ok_or_else(|| not_found(format!("sandbox {} has no mark to resume from", a.sandbox)))?;
    let start = Instant::now();
    spawn_supervisor(&home, &id, &head, 1)?;
    let r = wait_ready(&home, &id, Duration::from_secs(180))?;
    let took = start.elapsed();
    let body = serde_json::json!({"sandbox": a.sandbox, "mark": head.id, "ok": r.ok, "error": r.error, "resume_ms": took.as_secs_f64() * 1e3});
    print(a.json, &body, |_| match &r.error {
        None => format!("{} resumed from {} in {:.0} ms", a.sandbox, head.id, took.as_secs_f64() * 1e3),
        Some(e) => format!("{} could not resume: {e}", a.sandbox),
    })?;
    Ok(if r.ok { 0 } else { 1 })
}

/// Kill processes a dead supervisor left behind: those whose command line names the sandbox's run dir (its
/// QEMU, or a restored tree's helper). Returns how many were signalled.
fn reap_orphans(home: &CladeHome, sandbox: &str) -> usize {
    let needle = home.run_dir().join(sandbox).display().to_string() + "/";
    let mut n = 0;
    let Ok(dir) = std::fs::read_dir("/proc") else { return 0 };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
        if String::from_utf8_lossy(&cmd).contains(&needle) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
            n += 1;
        }
    }
    n
}

/// Whether a supervisor pid is alive (and is a clade supervisor, not a reused pid).
fn supervisor_alive(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| String::from_utf8_lossy(&c).contains("supervise"))
        .unwrap_or(false)
}

pub fn ls(a: ListArgs) -> anyhow::Result<i32> {
    let engine = Engine::open(&home())?;
    let mut rows = Vec::new();
    for s in engine.ledger().sandboxes(None)? {
        if s.state == SandboxState::Dead {
            continue;
        }
        let lost = s.state == SandboxState::Running && !s.supervisor_pid.is_some_and(supervisor_alive);
        let state = if lost { "lost (supervisor died)".to_string() } else { format!("{:?}", s.state).to_lowercase() };
        rows.push(serde_json::json!({"id": s.id, "backend": from_ledger(s.backend), "state": state, "origin": s.origin_mark, "branch": s.branch, "supervisor_pid": s.supervisor_pid, "error": s.error}));
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("{:<40} {:<4} {:<24} origin", "SANDBOX", "", "STATE");
        for r in &rows {
            println!(
                "{:<40} {:<4} {:<24} {}",
                r["id"].as_str().unwrap_or(""),
                r["backend"].as_str().unwrap_or(""),
                r["state"].as_str().unwrap_or(""),
                r["origin"].as_str().unwrap_or("-")
            );
        }
    }
    Ok(0)
}

pub fn marks(a: MarksArgs) -> anyhow::Result<i32> {
    let engine = Engine::open(&home())?;
    let l = engine.ledger();
    let branches = match &a.sandbox {
        Some(s) => {
            vec![l.sandbox(&SandboxId::new(s.clone())).map_err(|e| not_found(format!("no sandbox {s}: {e}")))?.branch]
        }
        None => l.branches()?.into_iter().map(|b| b.id).collect(),
    };
    let mut rows = Vec::new();
    for b in branches {
        for m in l.marks(&b)? {
            rows.push(serde_json::json!({"id": m.id, "branch": m.branch, "label": m.label, "backend": from_ledger(m.backend), "pause_ms": m.pause_ms, "logical_bytes": m.logical_bytes, "stored_bytes": m.stored_bytes, "created_ms": m.created_ms, "pinned": m.pinned}));
        }
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("{:<40} {:<3} {:>9} {:>12}  label", "MARK", "", "PAUSE ms", "STORED KiB");
        for r in &rows {
            println!(
                "{:<40} {:<3} {:>9} {:>12}  {}",
                r["id"].as_str().unwrap_or(""),
                r["backend"].as_str().unwrap_or(""),
                r["pause_ms"],
                r["stored_bytes"].as_u64().unwrap_or(0) >> 10,
                r["label"].as_str().unwrap_or("")
            );
        }
    }
    Ok(0)
}
