//! `clade-bench api` (`./x bench api`): the daemon's figures (docs/api.md), on the `ct` backend, one run.
//!
//! 1. Overhead: `exec true` through `clade serve` (HTTP over its unix socket, the CLI's own client) against the
//!    same through the embedded library call ([`Ops::exec`]), interleaved, same sandbox. Bar: p50 ratio <= 1.5.
//! 2. Load: N clients (32; `--quick` 8) each looping run -> exec -> kill through the daemon for a while (120 s;
//!    `--quick` 20 s). Bar: no error; then nothing left: no process, mount, cgroup, netns or veth of any sandbox
//!    the load started, none reported by `clade audit`. p50/p99 per operation reported.
//! 3. Restart: the same load, with the daemon stopped (SIGTERM) and started again half-way. Bars: every sandbox
//!    the ledger has running after the restart is listed by the new daemon and answers an exec; every failed
//!    request failed cleanly (the connection closed or was refused, or a JSON 4xx), none hung or got a 5xx.
//!
//! The base is the `minimal` template's ct base when that template is built, else a base of clade-ct's test
//! rootfs (busybox + agent, the one the guest tests use); the figures name which.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use clade_core::backend::BackendKind;
use clade_core::CladeHome;
use clade_ledger::{Mark, SandboxState};

use super::{median, percentile, Figure};
use clade_api::client::Remote;
use clade_host::api::{ExecRequest, ForkRequest, SandboxApi};
use clade_host::Ops;

#[derive(clap::Args)]
pub struct Args {
    /// The template whose ct base is used (falls back to the ct test rootfs when it is not built).
    #[arg(long, default_value = "minimal")]
    pub template: String,
    /// Short run: 8 clients x 20 s, fewer overhead samples.
    #[arg(long)]
    pub quick: bool,
    /// Concurrent clients (default 32, quick 8).
    #[arg(long)]
    pub clients: Option<usize>,
    /// Seconds of load (default 120, quick 20); the restart phase runs half as long, at least 10 s.
    #[arg(long)]
    pub secs: Option<u64>,
    /// Interleaved pairs for the overhead figure (default 300, quick 60).
    #[arg(long)]
    pub pairs: Option<usize>,
    /// Where the figures go as JSON.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// A request that takes longer than this has hung.
const HANG: Duration = Duration::from_secs(120);

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn emit(figs: &mut Vec<Figure>, f: Figure) {
    println!("{}", serde_json::to_string(&f).unwrap_or_default());
    figs.push(f);
}

/// The ct base: the template's when built (the base is built if missing), else one of the ct test rootfs.
pub(crate) fn base_mark(home: &CladeHome, ops: &Ops, template: &str) -> anyhow::Result<(Mark, String)> {
    if let Ok(m) = ops.engine.resolve_mark(template, Some(BackendKind::Ct)) {
        return Ok((m, format!("template {template}")));
    }
    if clade_template::find(home, template).is_ok() {
        clade_host::base::build(home, template, BackendKind::Ct, false, &|l| eprintln!("{l}"))?;
        return Ok((ops.engine.resolve_mark(template, Some(BackendKind::Ct))?, format!("template {template}")));
    }
    eprintln!("bench api: template {template} is not built here; using the ct test rootfs (busybox + agent)");
    if let Ok(m) = ops.engine.resolve_mark("ctbox", Some(BackendKind::Ct)) {
        return Ok((m, "ct test rootfs".into()));
    }
    let cfg = clade_ct::CtConfig::from_home(home)?;
    let rootfs = clade_ct::testroot::ensure(home, &cfg.agent_bin).map_err(|e| anyhow!("ct test rootfs: {e}"))?;
    let tid = clade_ledger::TemplateId::new("tmpl-ctbox");
    if ops.engine.ledger().template(&tid).is_err() {
        ops.engine.ledger().put_template(&tid, "ctbox", &serde_json::json!({}))?;
    }
    let backend = clade_ct::CtBackend::new(home.clone(), ops.engine.store.clone(), cfg)?;
    let image = clade_ct::testroot::image("ctbox", rootfs, 256, false);
    let (mark, _) = ops.engine.build_base(&backend as &dyn clade_core::backend::Backend, &tid, &image, &|_| Ok(()))?;
    Ok((mark, "ct test rootfs".into()))
}

/// A `clade serve` child on a unix socket.
struct Daemon {
    child: Child,
}

impl Daemon {
    fn start(sock: &Path) -> anyhow::Result<Daemon> {
        let mut child = Command::new(clade_host::supervisor::clade_exe()?)
            .args(["serve", "--listen", &format!("unix:{}", sock.display())])
            .stderr(Stdio::piped())
            .spawn()
            .context("start clade serve")?;
        let mut err = BufReader::new(child.stderr.take().ok_or_else(|| anyhow!("no stderr"))?);
        let mut line = String::new();
        while err.read_line(&mut line)? > 0 {
            if line.contains("ready") {
                break;
            }
            line.clear();
        }
        anyhow::ensure!(line.contains("ready"), "clade serve ended before it was ready");
        // Keep its stderr drained; show what it says about trouble.
        std::thread::spawn(move || {
            for l in err.lines().map_while(Result::ok) {
                if l.contains("error") || l.contains("panic") {
                    eprintln!("serve: {l}");
                }
            }
        });
        Ok(Daemon { child })
    }

    /// SIGTERM, then wait for it to end (operations in flight get up to 5 s).
    fn stop(mut self) -> Duration {
        self.stop_in_place()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How one request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Ok,
    /// The connection was refused, closed or reset before an answer: the daemon was going or gone.
    Dropped,
    /// A 4xx with a JSON error body.
    Refused,
    /// A 5xx, a hang, or an answer that is not what the API promises.
    Unclean,
}

struct Stats {
    lat: BTreeMap<&'static str, Vec<f64>>,
    outcomes: BTreeMap<(&'static str, Outcome), usize>,
    unclean: Vec<String>,
    ids: BTreeSet<String>,
    cycles: usize,
}

fn classify(r: &anyhow::Result<(u16, Vec<u8>)>, took: Duration) -> (Outcome, String) {
    match r {
        Ok((s, _)) if (200..300).contains(s) => (Outcome::Ok, String::new()),
        Ok((s, body)) => {
            let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
            let msg = format!("{s} {}", String::from_utf8_lossy(body));
            // A JSON 4xx, or the daemon's 503 `stopping` (an operation its shutdown cancelled before it began).
            if ((400..500).contains(s) && v["error"]["code"].is_string())
                || (*s == 503 && v["error"]["code"] == "stopping")
            {
                (Outcome::Refused, msg)
            } else {
                (Outcome::Unclean, msg)
            }
        }
        Err(e) if took >= HANG => (Outcome::Unclean, format!("no answer after {took:?}: {e:#}")),
        Err(e) => {
            let io = e.chain().find_map(|c| c.downcast_ref::<std::io::Error>()).map(|e| e.kind());
            use std::io::ErrorKind::*;
            let closed = format!("{e:#}").contains("closed the connection before answering")
                || matches!(io, Some(ConnectionRefused | ConnectionReset | NotFound | BrokenPipe | UnexpectedEof));
            (if closed { Outcome::Dropped } else { Outcome::Unclean }, format!("{e:#}"))
        }
    }
}

/// One client's loop: run, exec true, kill, until `stop`; a sandbox it started is always killed before it
/// goes on (retrying through a restart).
fn client(remote: &Remote, mark: &str, stop: &AtomicBool, stats: &Mutex<Stats>) {
    let json = |v: serde_json::Value| serde_json::to_vec(&v).unwrap_or_default();
    let call = |op: &'static str, method: &str, path: &str, body: Option<Vec<u8>>| {
        let t = Instant::now();
        let r = remote.raw(method, path, body.as_deref(), "application/json");
        let took = t.elapsed();
        let (o, msg) = classify(&r, took);
        let mut s = stats.lock().unwrap_or_else(|p| p.into_inner());
        *s.outcomes.entry((op, o)).or_default() += 1;
        if o == Outcome::Ok {
            s.lat.entry(op).or_default().push(ms(took));
        } else if o == Outcome::Unclean && s.unclean.len() < 50 {
            s.unclean.push(format!("{op}: {msg}"));
        }
        (o, r.map(|(_, b)| b).unwrap_or_default())
    };
    while !stop.load(Ordering::Relaxed) {
        let (o, body) = call("run", "POST", "/v1/sandboxes", Some(json(serde_json::json!({"from": mark}))));
        if o != Outcome::Ok {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let Some(id) = v["sandboxes"][0]["sandbox"].as_str().map(String::from) else { continue };
        stats.lock().unwrap_or_else(|p| p.into_inner()).ids.insert(id.clone());
        let (o, body) = call(
            "exec",
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json(serde_json::json!({"argv": ["true"]}))),
        );
        if o == Outcome::Ok {
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            if v["code"] != 0 {
                let mut s = stats.lock().unwrap_or_else(|p| p.into_inner());
                s.unclean.push(format!("exec true in {id} answered {v}"));
            }
        }
        let give_up = Instant::now() + HANG;
        loop {
            let (o, _) = call("kill", "DELETE", &format!("/v1/sandboxes/{id}"), None);
            if matches!(o, Outcome::Ok | Outcome::Refused | Outcome::Unclean) || Instant::now() > give_up {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        stats.lock().unwrap_or_else(|p| p.into_inner()).cycles += 1;
    }
}

/// What a load phase leaves: its stats, the daemon now serving, and with a restart how long the old daemon took
/// to stop and the new one to start.
struct Phase {
    stats: Stats,
    daemon: Daemon,
    restart: Option<(Duration, Duration)>,
}

/// `clients` clients for `secs`; with `restart`, the daemon is restarted half-way.
fn load(
    sock: &Path,
    key: &str,
    mark: &str,
    clients: usize,
    secs: u64,
    mut daemon: Daemon,
    restart: bool,
) -> anyhow::Result<Phase> {
    let stats = Mutex::new(Stats {
        lat: BTreeMap::new(),
        outcomes: BTreeMap::new(),
        unclean: Vec::new(),
        ids: BTreeSet::new(),
        cycles: 0,
    });
    let stop = AtomicBool::new(false);
    let mut restarted = None;
    std::thread::scope(|scope| -> anyhow::Result<()> {
        for _ in 0..clients {
            scope.spawn(|| client(&Remote::unix(sock, key).with_timeout(HANG), mark, &stop, &stats));
        }
        if restart {
            std::thread::sleep(Duration::from_secs(secs / 2));
            let stopping = daemon.stop_in_place();
            let t = Instant::now();
            daemon = Daemon::start(sock)?;
            restarted = Some((stopping, t.elapsed()));
            eprintln!("bench api: daemon restarted (stop {stopping:?}, start {:?})", t.elapsed());
            std::thread::sleep(Duration::from_secs(secs - secs / 2));
        } else {
            std::thread::sleep(Duration::from_secs(secs));
        }
        stop.store(true, Ordering::Relaxed);
        Ok(())
    })?;
    Ok(Phase { stats: stats.into_inner().unwrap_or_else(|p| p.into_inner()), daemon, restart: restarted })
}

impl Daemon {
    /// [`Daemon::stop`] for a daemon about to be replaced in the same variable.
    fn stop_in_place(&mut self) -> Duration {
        let t = Instant::now();
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), nix::sys::signal::SIGTERM);
        let _ = self.child.wait();
        t.elapsed()
    }
}

/// What the sandboxes in `ids` left on this host: ledger rows not dead, processes, mounts, cgroups, network
/// namespaces, and links or NAT elements that appeared since `net_before`; then `clade audit`'s findings about them.
fn leftovers(ops: &Ops, ids: &BTreeSet<String>, net_before: &clade_ct::net::HostNet) -> Vec<String> {
    let home = ops.home();
    let run = home.run_dir().display().to_string();
    let mut left = Vec::new();
    for id in ids {
        if let Ok(r) = ops.engine.ledger().sandbox(&clade_ledger::SandboxId::new(id.as_str())) {
            // A failed start holds nothing (its error is counted with the requests); anything else not dead does.
            if !matches!(r.state, SandboxState::Dead | SandboxState::Failed) {
                left.push(format!("sandbox {id} is {}", r.state.as_str()));
            }
        }
        for root in ["/sys/fs/cgroup/memory/clade", "/sys/fs/cgroup/clade"] {
            if Path::new(root).join(id).exists() {
                left.push(format!("cgroup {root}/{id}"));
            }
        }
    }
    let owner = |text: &str| ids.iter().find(|id| text.contains(&format!("{run}/{id}")) || text.contains(id.as_str()));
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(c) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
        let c = String::from_utf8_lossy(&c).replace('\0', " ");
        if let Some(id) = owner(&c) {
            left.push(format!("process {pid} of {id}: {c}"));
        }
    }
    for l in std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default().lines() {
        if let Some(id) = ids.iter().find(|id| l.contains(&format!("{run}/{id}"))) {
            left.push(format!("mount of {id}: {l}"));
        }
    }
    let now = clade_ct::net::host_state();
    for n in &now.netns {
        if owner(n).is_some() || !net_before.netns.contains(n) {
            left.push(format!("netns {n}"));
        }
    }
    for l in now.links.iter().filter(|l| !net_before.links.contains(l)) {
        left.push(format!("link {l}"));
    }
    for n in now.nat.iter().filter(|n| !net_before.nat.contains(n)) {
        left.push(format!("nat element {n}"));
    }
    match ops.audit(false) {
        Ok(rep) => {
            for f in rep.findings.iter().filter(|f| ids.contains(&f.id)) {
                left.push(format!("audit: {} {} {}", f.kind, f.id, f.detail));
            }
        }
        Err(e) => left.push(format!("audit failed: {e:#}")),
    }
    left
}

fn load_figures(figs: &mut Vec<Figure>, tag: &str, s: &Stats, secs: u64, clients: usize, base: &str) {
    let errors: usize = s.outcomes.iter().filter(|((_, o), _)| *o != Outcome::Ok).map(|(_, n)| n).sum();
    let outcomes: BTreeMap<String, usize> =
        s.outcomes.iter().map(|((op, o), n)| (format!("{op} {o:?}").to_lowercase(), *n)).collect();
    emit(
        figs,
        Figure {
            name: format!("api {tag}: {clients} clients run/exec/kill on ct for {secs} s, errors"),
            value: errors as f64,
            unit: "count".into(),
            bar: "0".into(),
            pass: errors == 0 && s.unclean.is_empty() && s.cycles > 0,
            samples: vec![],
            detail: serde_json::json!({"cycles": s.cycles, "cycles_per_min": s.cycles as f64 * 60.0 / secs as f64,
                "outcomes": outcomes, "unclean": s.unclean, "base": base}),
        },
    );
    for op in ["run", "exec", "kill"] {
        let v = s.lat.get(op).cloned().unwrap_or_default();
        emit(
            figs,
            Figure {
                name: format!("api {tag}: {op} latency p99 ({clients} clients, ct)"),
                value: percentile(&v, 0.99),
                unit: "ms".into(),
                bar: "reported".into(),
                pass: !v.is_empty(),
                samples: vec![],
                detail: serde_json::json!({"p50_ms": percentile(&v, 0.5), "p90_ms": percentile(&v, 0.9), "p99_ms": percentile(&v, 0.99),
                    "max_ms": percentile(&v, 1.0), "n": v.len(), "base": base}),
            },
        );
    }
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let home = CladeHome::from_env();
    let clients = a.clients.unwrap_or(if a.quick { 8 } else { 32 });
    let secs = a.secs.unwrap_or(if a.quick { 20 } else { 120 }).max(2);
    let pairs = a.pairs.unwrap_or(if a.quick { 60 } else { 300 });
    let ops = Ops::open(&home)?;
    let (mark, base) = base_mark(&home, &ops, &a.template)?;
    let m = mark.id.as_str().to_string();
    let host = format!(
        "{} CPUs, load {} at start; {} build",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" "),
        if cfg!(debug_assertions) { "debug" } else { "release" }
    );
    eprintln!("bench api: base {m} ({base}); {host}");
    let key = clade_api::load_or_create_key(&home)?;
    let sock = home.tmp_dir().join(format!("bench-api-{}.sock", std::process::id()));
    std::fs::create_dir_all(home.tmp_dir())?;
    let daemon = Daemon::start(&sock)?;
    let remote = Remote::unix(&sock, &key).with_timeout(HANG);
    let mut figs = Vec::new();
    let mut all_pass = true;

    // 1. exec true: HTTP vs the library, interleaved (the order alternates), on one sandbox.
    let f = ops.fork(&ForkRequest::new(m.as_str(), None, 1))?;
    let id = f.sandboxes.first().ok_or_else(|| anyhow!("fork started nothing"))?.sandbox.clone();
    let req = ExecRequest { argv: vec!["true".into()], ..Default::default() };
    let body = serde_json::to_vec(&req)?;
    let path = format!("/v1/sandboxes/{id}/exec");
    let lib = |ops: &Ops| -> anyhow::Result<f64> {
        let t = Instant::now();
        let out = ops.exec(&id, req.clone())?;
        anyhow::ensure!(out.code == 0, "exec true exited {}", out.code);
        Ok(ms(t.elapsed()))
    };
    let http = || -> anyhow::Result<f64> {
        let t = Instant::now();
        let (s, b) = remote.raw("POST", &path, Some(&body), "application/json")?;
        anyhow::ensure!(s == 200, "exec through the daemon: {s} {}", String::from_utf8_lossy(&b));
        Ok(ms(t.elapsed()))
    };
    for _ in 0..10 {
        lib(&ops)?;
        http()?;
    }
    let (mut l, mut h) = (Vec::new(), Vec::new());
    for i in 0..pairs {
        if i % 2 == 0 {
            l.push(lib(&ops)?);
            h.push(http()?);
        } else {
            h.push(http()?);
            l.push(lib(&ops)?);
        }
    }
    let _ = ops.kill(&id);
    let ratio = median(&h) / median(&l);
    all_pass &= ratio <= 1.5;
    emit(
        &mut figs,
        Figure {
            name: "api exec true: HTTP (clade serve, unix socket) / embedded library call, p50, ct".into(),
            value: ratio,
            unit: "x".into(),
            bar: "<= 1.5x".into(),
            pass: ratio <= 1.5,
            samples: h.clone(),
            detail: serde_json::json!({"http_p50_ms": median(&h), "library_p50_ms": median(&l),
                "http_p99_ms": percentile(&h, 0.99), "library_p99_ms": percentile(&l, 0.99), "pairs": pairs,
                "library_ms": l, "base": base, "host": host}),
        },
    );

    // 2. Load, then leftovers (of what the clients started, and of any sandbox the ledger got meanwhile: a run
    // that failed may have recorded one its client never heard of).
    let net_before = clade_ct::net::host_state();
    let known = |ops: &Ops| -> anyhow::Result<BTreeSet<String>> {
        Ok(ops.engine.ledger().sandboxes(None)?.into_iter().map(|s| s.id.as_str().to_string()).collect())
    };
    let before = known(&ops)?;
    let Phase { mut stats, daemon, .. } = load(&sock, &key, &m, clients, secs, daemon, false)?;
    stats.ids.extend(known(&ops)?.difference(&before).cloned());
    load_figures(&mut figs, "load", &stats, secs, clients, &base);
    all_pass &= figs.iter().all(|f| f.pass);
    // audit judges nothing younger than 10 s: let the last kills settle.
    std::thread::sleep(Duration::from_secs(11));
    let left = leftovers(&ops, &stats.ids, &net_before);
    all_pass &= left.is_empty();
    emit(
        &mut figs,
        Figure {
            name: format!(
                "api load: leftovers of {} sandboxes (ledger, process, mount, cgroup, netns, veth, audit)",
                stats.ids.len()
            ),
            value: left.len() as f64,
            unit: "count".into(),
            bar: "0".into(),
            pass: left.is_empty() && !stats.ids.is_empty(),
            samples: vec![],
            detail: serde_json::json!({"left": left.iter().take(50).collect::<Vec<_>>()}),
        },
    );

    // 3. The same load with the daemon restarted half-way.
    let before = known(&ops)?;
    let rsecs = (secs / 2).max(10);
    let Phase { stats, daemon, restart } = load(&sock, &key, &m, clients, rsecs, daemon, true)?;
    let (stop_took, start_took) = restart.unwrap_or_default();
    // Sandboxes the load started that the ledger has running now (a run in flight at the restart may have
    // started one its client never heard of): each must be listed by the new daemon and answer an exec.
    let ours: Vec<String> = ops
        .engine
        .ledger()
        .sandboxes(None)?
        .into_iter()
        .filter(|s| !before.contains(s.id.as_str()))
        .map(|s| s.id.as_str().to_string())
        .collect();
    let running: Vec<String> = ours
        .iter()
        .filter(|id| {
            ops.engine.ledger().sandbox(&clade_ledger::SandboxId::new(id.as_str())).is_ok_and(|r| {
                r.state == SandboxState::Running
                    && r.supervisor_pid.is_some_and(clade_host::supervisor::client::supervisor_alive)
            })
        })
        .cloned()
        .collect();
    let (s, listed) = remote.raw("GET", "/v1/sandboxes", None, "application/json")?;
    anyhow::ensure!(s == 200, "list after the restart: {s}");
    let listed: serde_json::Value = serde_json::from_slice(&listed)?;
    let listed: BTreeSet<String> = listed
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["state"] == "running")
        .filter_map(|r| r["id"].as_str().map(String::from))
        .collect();
    let mut drivable = 0;
    for id in &running {
        let (s, b) = remote.raw("POST", &format!("/v1/sandboxes/{id}/exec"), Some(&body), "application/json")?;
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap_or_default();
        if s == 200 && v["code"] == 0 && listed.contains(id) {
            drivable += 1;
        }
        let _ = remote.raw("DELETE", &format!("/v1/sandboxes/{id}"), None, "application/json");
    }
    let failed: usize = stats.outcomes.iter().filter(|((_, o), _)| *o != Outcome::Ok).map(|(_, n)| n).sum();
    let unclean: usize = stats.outcomes.iter().filter(|((_, o), _)| *o == Outcome::Unclean).map(|(_, n)| n).sum();
    let outcomes: BTreeMap<String, usize> =
        stats.outcomes.iter().map(|((op, o), n)| (format!("{op} {o:?}").to_lowercase(), *n)).collect();
    let found_ok = drivable == running.len();
    all_pass &= found_ok && unclean == 0 && stats.unclean.is_empty();
    emit(
        &mut figs,
        Figure {
            name: format!("api restart under load ({clients} clients, ct): running sandboxes found again and drivable"),
            value: drivable as f64,
            unit: "count".into(),
            bar: format!("= running after the restart ({})", running.len()),
            pass: found_ok && stats.cycles > 0,
            samples: vec![],
            detail: serde_json::json!({"running_after": running.len(), "listed": listed.len(), "drivable": drivable,
                "daemon_stop_ms": ms(stop_took), "daemon_start_ms": ms(start_took), "cycles": stats.cycles,
                "secs": rsecs, "base": base}),
        },
    );
    emit(
        &mut figs,
        Figure {
            name: "api restart under load: requests that failed uncleanly (5xx, hang, malformed)".into(),
            value: unclean as f64,
            unit: "count".into(),
            bar: "0 (clean: connection closed or refused, a JSON 4xx, or 503 `stopping`: not started, nothing done)"
                .into(),
            pass: unclean == 0 && stats.unclean.is_empty(),
            samples: vec![],
            detail: serde_json::json!({"failed": failed, "outcomes": outcomes, "unclean": stats.unclean}),
        },
    );
    std::thread::sleep(Duration::from_secs(11));
    let mut ids = stats.ids.clone();
    ids.extend(ours);
    let left = leftovers(&ops, &ids, &net_before);
    all_pass &= left.is_empty();
    emit(
        &mut figs,
        Figure {
            name: format!("api restart: leftovers of {} sandboxes", ids.len()),
            value: left.len() as f64,
            unit: "count".into(),
            bar: "0".into(),
            pass: left.is_empty(),
            samples: vec![],
            detail: serde_json::json!({"left": left.iter().take(50).collect::<Vec<_>>()}),
        },
    );
    daemon.stop();
    let _ = std::fs::remove_file(&sock);
    if let Some(p) = a.out {
        if let Some(d) = p.parent() {
            std::fs::create_dir_all(d)?;
        }
        std::fs::write(&p, serde_json::to_vec_pretty(&figs)?)?;
    }
    Ok(if all_pass { 0 } else { 1 })
}
