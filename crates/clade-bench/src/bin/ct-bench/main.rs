//! ct-bench: the `ct` backend's figures (docs/ct.md), every arm side by side in one run, printed as JSON lines: one
//! per sample as it is taken, then one per figure with its bar and PASS computed from the samples (`name`,
//! `value`, `unit`, `bar`, `pass`, `samples`, `detail`, the same fields as the other benches).
//!
//! Workloads:
//! * `minimal`: the test rootfs with a Python HTTP server that first builds `--payload-mib` MiB of
//!   deterministic state (the warm-up a restore skips). Agent-ready = the server answers on its port.
//! * `browser` (`--browser TEMPLATE_JSON`, a built `templates/browser`): an agent's desktop session, Xvfb, openbox,
//!   D-Bus, Chromium with a page, the in-sandbox screen server. Agent-ready = the template's readiness URL
//!   answers 200 inside the sandbox: the screenshot differs from the blank desktop in more than 10% of pixels
//!   AND the page has a title.
//!
//! Arms, interleaved one sandbox at a time: cold start to agent-ready; restore of a mark with hygiene to
//! agent-ready; and the peer (`peer.rs`): the same session dumped and restored with plain CRIU by hand, as
//! one would without clade (no store, no hygiene, no cached kernel probe, no KSM). Then, for the browser, the
//! clone check (`clone_check.rs`: do two siblings draw different random numbers?); lazy vs eager, the warm pool,
//! the memory slope over `--mem-counts` with the sibling audit (the control rule: nothing shared but character
//! devices, and only those a cold pair shares too).
//!
//! `--only jail`: the jail's cost, jail on vs off side by side (jail.rs).
//!
//! `ct-bench [--n 10] [--payload-mib 32] [--mem-counts 1,4,8] [--browser PATH] [--only browser|minimal|jail]
//!  [--mark-gap-secs 60]`

mod cleanup;
mod clone_check;
mod jail;
mod peer;

use std::time::{Duration, Instant};

use clade_agent::{ExecSpec, ReadyTarget};
use clade_core::backend::{Identity, MarkOptions, MarkState, Sandbox, Shape, TemplateImage};
use clade_core::CladeHome;
use clade_ct::{CtBackend, CtConfig, CtSandbox};
use serde_json::json;

const PORT: u16 = 8000;

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned()).unwrap_or_else(|| default.to_string())
}

fn server_py(payload_mib: u32) -> String {
    format!(
        "import random, http.server, socketserver\n\
         state = random.Random(1).randbytes({payload_mib} << 20)\n\
         class H(http.server.BaseHTTPRequestHandler):\n    \
             def do_GET(self):\n        \
                 self.send_response(200); self.end_headers(); self.wfile.write(str(len(state)).encode())\n\
         socketserver.TCPServer.allow_reuse_address = True\n\
         socketserver.TCPServer(('127.0.0.1', {PORT}), H).serve_forever()\n"
    )
}

/// One workload: what starts, and when it is agent-ready.
struct Workload {
    name: &'static str,
    image: TemplateImage,
    ready: ReadyTarget,
    /// The same readiness as a URL the peer polls from the host (inside the sandbox's network namespace).
    peer_url: String,
    /// `minimal`: the server script written and started after the agent answers (a browser's services start
    /// themselves).
    script: Option<String>,
    timeout: Duration,
}

struct Bench {
    backend: CtBackend,
    home: CladeHome,
    seq: std::sync::atomic::AtomicU32,
}

impl Bench {
    fn ident(&self, what: &str) -> Identity {
        let n = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        clade_core::hygiene::new_identity(&format!("b{}-{what}{n}", std::process::id()), 0)
    }

    /// Cold start and warm up to agent-ready.
    fn cold(&self, w: &Workload) -> Result<(CtSandbox, Duration), String> {
        let t0 = Instant::now();
        let sb = self.backend.cold_start_ct(&w.image, &self.ident("c")).map_err(|e| e.to_string())?;
        let a = sb.agent();
        if let Some(script) = &w.script {
            a.write_file_bytes("/root/srv.py", script.as_bytes(), Some(0o644)).map_err(|e| e.to_string())?;
            let out = a
                .run(ExecSpec::new(["/bin/sh", "-c", "setsid python3 /root/srv.py </dev/null >/dev/null 2>&1 &"]))
                .map_err(|e| e.to_string())?;
            if !out.status.success() {
                return Err(format!("start server: {out:?}"));
            }
        }
        a.wait_ready(w.ready.clone(), w.timeout).map_err(|e| format!("{} cold: agent-ready: {e}", w.name))?;
        Ok((sb, t0.elapsed()))
    }

    /// Restore without hygiene to agent-ready (the same work as the peer's restore by hand).
    fn restore_plain(&self, w: &Workload, mark: &MarkState) -> Result<(CtSandbox, Duration), String> {
        let t0 = Instant::now();
        let sb = self.backend.restore_ct(mark, &self.ident("n")).map_err(|e| e.to_string())?;
        sb.agent()
            .wait_ready(w.ready.clone(), w.timeout)
            .map_err(|e| format!("{} restore: agent-ready: {e}", w.name))?;
        Ok((sb, t0.elapsed()))
    }

    /// Restore with hygiene to agent-ready: (sandbox, total, restore alone, hygiene alone).
    fn restore(&self, w: &Workload, mark: &MarkState) -> Result<(CtSandbox, Duration, Duration, Duration), String> {
        let t0 = Instant::now();
        let id = self.ident("r");
        let sb = self.backend.restore_ct(mark, &id).map_err(|e| e.to_string())?;
        let restored = t0.elapsed();
        let h = clade_core::hygiene::apply(sb.agent(), &id, mark.clean).map_err(|e| e.to_string())?;
        if !h.errors.is_empty() {
            eprintln!("ct-bench: {}: hygiene reported {:?}", w.name, h.errors);
        }
        sb.agent()
            .wait_ready(w.ready.clone(), w.timeout)
            .map_err(|e| format!("{} restore: agent-ready: {e}", w.name))?;
        if std::env::var_os("CT_BENCH_PHASES").is_some() {
            let p: Vec<(String, f64)> = sb.phases.iter().map(|(k, d)| (k.to_string(), ms(*d))).collect();
            eprintln!("{}", json!({"phases": p, "hygiene_ms": ms(h.took), "scripts": h.on_restore_scripts}));
            let _ = std::fs::copy(sb.run_dir().join("restore.log"), "/tmp/ct-bench-restore.log");
        }
        Ok((sb, t0.elapsed(), restored, h.took))
    }
}

fn pct(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn pss_of(sbs: &[CtSandbox]) -> u64 {
    sbs.iter().flat_map(|s| s.pids()).filter_map(|p| clade_core::host::pss_rss(p).map(|x| x.0)).sum()
}

fn cgroup_of(sbs: &[CtSandbox]) -> u64 {
    sbs.iter().filter_map(CtSandbox::cgroup_memory).sum()
}

/// Least-squares slope of y over x.
fn slope(x: &[f64], y: &[f64]) -> f64 {
    let n = x.len() as f64;
    let (mx, my) = (x.iter().sum::<f64>() / n, y.iter().sum::<f64>() / n);
    let num: f64 = x.iter().zip(y).map(|(a, b)| (a - mx) * (b - my)).sum();
    let den: f64 = x.iter().map(|a| (a - mx) * (a - mx)).sum();
    num / den
}

/// A figure line (the fields every bench prints; `./x bench` summarises `pass`).
fn figure(name: String, value: f64, unit: &str, bar: &str, pass: bool, samples: &[f64], detail: serde_json::Value) {
    println!(
        "{}",
        json!({"name": name, "value": value, "unit": unit, "bar": bar, "pass": pass, "samples": samples, "detail": detail})
    );
}

fn main() {
    if let Err(e) = run() {
        eprintln!("ct-bench: {e}");
        std::process::exit(1);
    }
}

fn kill_all(v: Vec<CtSandbox>) {
    for s in v {
        let _ = Box::new(s).kill();
    }
}

/// The browser workload from a built template's record (`$CLADE_HOME/templates/<hash>/template.json`, or that
/// directory).
fn browser_workload(path: &str) -> Result<Workload, String> {
    let mut p = std::path::PathBuf::from(path);
    if p.is_dir() {
        p = p.join("template.json");
    }
    let text = std::fs::read_to_string(&p)
        .map_err(|e| format!("--browser {}: {e} (build templates/browser first)", p.display()))?;
    let r: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", p.display()))?;
    let url = r["ready"]["url"]
        .as_str()
        .ok_or_else(|| format!("{}: the template's `ready` is not a URL", p.display()))?
        .to_string();
    let rootfs = std::path::PathBuf::from(r["rootfs"].as_str().ok_or_else(|| format!("{}: no rootfs", p.display()))?);
    let shape = Shape {
        memory_mib: r["memory_mib"].as_u64().unwrap_or(2048) as u32,
        vcpus: r["vcpus"].as_u64().unwrap_or(2) as u32,
        disk_gib: r["disk_gib"].as_u64().unwrap_or(4) as u32,
    };
    Ok(Workload {
        name: "browser",
        image: TemplateImage {
            name: r["name"].as_str().unwrap_or("browser").into(),
            hash: r["hash"].as_str().unwrap_or_default().into(),
            rootfs,
            disk_manifest: None,
            shape,
            egress: false,
            no_new_privs: true,
        },
        ready: ReadyTarget::Url { url: url.clone() },
        peer_url: url,
        script: None,
        timeout: Duration::from_secs(120),
    })
}

const USAGE: &str = "ct-bench [--n 10] [--payload-mib 32] [--mem-counts 1,4,8] [--browser PATH] \
                     [--only browser|minimal|jail] [--mark-gap-secs 60] [--no-ksm] [--vcpus 1]";

/// Every argument is a known flag (with its value); `--help` prints the usage. A typo must not start a
/// ten-minute run with the defaults.
fn check_args() -> Result<bool, String> {
    const VALUED: [&str; 7] =
        ["--n", "--payload-mib", "--mem-counts", "--mark-gap-secs", "--only", "--browser", "--vcpus"];
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "-h" | "--help" => return Ok(false),
            "--no-ksm" => i += 1,
            a if VALUED.contains(&a) && i + 1 < args.len() => i += 2,
            a => return Err(format!("unknown or incomplete argument {a:?}; usage: {USAGE}")),
        }
    }
    Ok(true)
}

fn run() -> Result<(), String> {
    if !check_args()? {
        println!("{USAGE}");
        return Ok(());
    }
    let n: usize = arg("--n", "10").parse().map_err(|_| "--n: a number")?;
    let payload: u32 = arg("--payload-mib", "32").parse().map_err(|_| "--payload-mib: a number")?;
    let counts: Vec<usize> = arg("--mem-counts", "1,4,8").split(',').filter_map(|s| s.parse().ok()).collect();
    let gap: u64 = arg("--mark-gap-secs", "60").parse().map_err(|_| "--mark-gap-secs: a number")?;
    let only = arg("--only", "");
    let real = CladeHome::from_env();
    let mut cfg = CtConfig::from_home(&real).map_err(|e| e.to_string())?;
    cfg.ksm = !std::env::args().any(|a| a == "--no-ksm");
    // Chromium answers its agent after the services ran; the restore's agent connect is not the bottleneck.
    cfg.ready_timeout = Duration::from_secs(60);
    let mut workloads = Vec::new();
    if only.is_empty() || only == "minimal" || only == "jail" {
        let rootfs = clade_ct::testroot::ensure(&real, &cfg.agent_bin)?;
        workloads.push(Workload {
            name: "minimal",
            image: TemplateImage {
                name: "minimal-test".into(),
                hash: "test".into(),
                rootfs,
                disk_manifest: None,
                shape: Shape { memory_mib: 1024, vcpus: arg("--vcpus", "1").parse().unwrap_or(1), disk_gib: 1 },
                egress: false,
                no_new_privs: true,
            },
            ready: ReadyTarget::Port { port: PORT },
            peer_url: format!("http://127.0.0.1:{PORT}/"),
            script: Some(server_py(payload)),
            timeout: Duration::from_secs(30),
        });
    }
    if only == "jail" {
        // The jail's cost on the minimal workload (jail.rs); nothing else runs.
        return jail::run(&real, &cfg, &workloads[0], n);
    }
    let browser = arg("--browser", "");
    if !browser.is_empty() && (only.is_empty() || only == "browser") {
        workloads.push(browser_workload(&browser)?);
    }
    if workloads.is_empty() {
        return Err("nothing to run: --only names a workload that is not given (--browser PATH)".into());
    }
    let home = CladeHome::at(real.tmp_dir().join(format!("ct-bench-{}", std::process::id())));
    // Before any thread starts (the blocked signals are inherited): Ctrl-C takes this run down.
    cleanup::install(
        home.root().to_path_buf(),
        format!("b{}-", std::process::id()),
        std::path::PathBuf::from(format!("/dev/shm/clade-ct-peer-{}", std::process::id())),
    )?;
    let store = clade_store::Store::open(&home.store_dir(), Default::default()).map_err(|e| e.to_string())?;
    let criu = cfg.criu.clone();
    // The peer is plain CRIU by hand on a root container, as the reference setup was: its sandbox is started
    // unjailed (CRIU by hand cannot dump a sandbox in its own user namespace without clade's netns and id-map
    // handling). The jail's own cost is `--only jail`.
    let peer = Bench {
        backend: CtBackend::new(home.clone(), store.clone(), CtConfig { jail: false, ..cfg.clone() })
            .map_err(|e| e.to_string())?,
        home: home.clone(),
        seq: Default::default(),
    };
    let backend = CtBackend::new(home.clone(), store, cfg).map_err(|e| e.to_string())?;
    let b = Bench { backend, home: home.clone(), seq: Default::default() };
    let mut result = Ok(());
    for w in &workloads {
        eprintln!("ct-bench: workload {} ({} starts per arm)", w.name, n);
        result = bench(&b, &peer, w, &criu, n, gap, &counts);
        if result.is_err() {
            break;
        }
    }
    let _ = std::fs::remove_dir_all(home.root());
    result
}

fn bench(
    b: &Bench,
    peer_bench: &Bench,
    w: &Workload,
    criu: &std::path::Path,
    n: usize,
    gap: u64,
    counts: &[usize],
) -> Result<(), String> {
    let wl = w.name;
    let fig = |what: &str| format!("ct {wl}: {what}");
    // The mark: a cold sandbox at agent-ready, marked, then marked again `gap` seconds later (dedup).
    let (mut base, t_base) = b.cold(w)?;
    eprintln!("ct-bench: {wl}: cold to agent-ready {:.0} ms; marking", ms(t_base));
    let m1 = base.mark(&MarkOptions::default()).map_err(|e| e.to_string())?;
    if w.script.is_some() {
        base.agent()
            .run(ExecSpec::new(["/bin/sh", "-c", "wget -qO- http://127.0.0.1:8000/ >/dev/null; echo x > /root/later"]))
            .map_err(|e| e.to_string())?;
    }
    std::thread::sleep(Duration::from_secs(gap));
    let m2 = base.mark(&MarkOptions::default()).map_err(|e| e.to_string())?;
    if std::env::var_os("CLADE_CRIU_VERBOSE").is_some() {
        for k in [1, 2] {
            let _ =
                std::fs::copy(base.run_dir().join(format!("dump-{k}.log")), format!("/tmp/ct-bench-{wl}-dump-{k}.log"));
        }
    }
    let _ = Box::new(base).kill();
    println!(
        "{}",
        json!({"bench":"mark","workload":wl,"gap_s":gap,"pause_ms_first":ms(m1.pause),"pause_ms_second":ms(m2.pause),
               "logical_bytes":m1.logical_bytes,"stored_bytes_first":m1.stored_bytes,"stored_bytes_second":m2.stored_bytes,
               "second_over_first":m2.stored_bytes as f64 / m1.stored_bytes.max(1) as f64})
    );
    let pauses = [ms(m1.pause), ms(m2.pause)];
    let pause = pauses[0].max(pauses[1]);
    figure(
        fig("mark pause (CRIU frozen time, worse of two marks)"),
        pause,
        "ms",
        "<= 200 ms (plain CRIU's dump of the browser session before clade: 810 ms)",
        pause <= 200.0,
        &pauses,
        json!({"logical_bytes": m1.logical_bytes}),
    );
    let ratio = m2.stored_bytes as f64 / m1.stored_bytes.max(1) as f64;
    figure(
        fig(&format!("storage of a second mark {gap} s later / the first")),
        ratio,
        "ratio",
        "<= 0.25",
        ratio <= 0.25,
        &[m1.stored_bytes as f64, m2.stored_bytes as f64],
        json!({"first_stored_bytes": m1.stored_bytes, "second_stored_bytes": m2.stored_bytes, "logical_bytes": m1.logical_bytes,
            "plot": {"kind": "xy", "x": [1, 2], "series": {"stored MiB": [m1.stored_bytes as f64 / 1048576.0, m2.stored_bytes as f64 / 1048576.0]},
                "xlabel": format!("mark: 1 the first, 2 the second ({gap} s later)"), "ylabel": "stored MiB"}}),
    );

    // The peer's checkpoint: another cold session at agent-ready, dumped by plain CRIU by hand (peer.rs).
    let (mut ps, _) = peer_bench.cold(w)?;
    let peer = peer::Peer::dump(&b.home, criu, &mut ps)?;
    let _ = Box::new(ps).kill();
    eprintln!("ct-bench: {wl}: peer dump by hand {:.0} ms, {} MiB of images", peer.dump_ms, peer.image_bytes >> 20);

    // Latency: interleaved, one sandbox at a time: cold, clade restore + hygiene, peer restore, clade restore
    // without hygiene (the peer's work).
    let (mut cold, mut rest, mut rest_only, mut hyg, mut peers) = (vec![], vec![], vec![], vec![], vec![]);
    let mut plain = Vec::new();
    // One untimed start of each arm first (the figures are for a warm page cache): the first restore of
    // a mark on a host also lays its images and upper out of the store (once per mark and host).
    let _ = Box::new(b.cold(w)?.0).kill();
    let _ = Box::new(b.restore(w, &m2)?.0).kill();
    peer.restore(n, &w.peer_url, w.timeout)?;
    for i in 0..n {
        let (c, tc) = b.cold(w)?;
        let _ = Box::new(c).kill();
        let (r, tr, tro, th) = b.restore(w, &m2)?;
        let _ = Box::new(r).kill();
        let tp = peer.restore(i, &w.peer_url, w.timeout)?;
        let (r, tn) = b.restore_plain(w, &m2)?;
        let _ = Box::new(r).kill();
        println!(
            "{}",
            json!({"bench":"start","workload":wl,"i":i,"cold_ms":ms(tc),"restore_hygiene_ms":ms(tr),"restore_only_ms":ms(tro),
                   "hygiene_ms":ms(th),"peer_ms":ms(tp),"restore_no_hygiene_ms":ms(tn)})
        );
        cold.push(ms(tc));
        rest.push(ms(tr));
        rest_only.push(ms(tro));
        hyg.push(ms(th));
        peers.push(ms(tp));
        plain.push(ms(tn));
    }
    peer.cleanup();
    let (c50, r50, p50) = (pct(&cold, 0.5), pct(&rest, 0.5), pct(&peers, 0.5));
    let (c95, r95) = (pct(&cold, 0.95), pct(&rest, 0.95));
    let lat = json!({"n": n, "cold_ms": cold, "restore_hygiene_ms": rest, "restore_only_ms": rest_only, "hygiene_ms": hyg,
        "peer_ms": peers, "restore_no_hygiene_ms": plain, "cold_p50_ms": c50, "cold_p95_ms": c95, "restore_hygiene_p50_ms": r50, "restore_hygiene_p95_ms": r95,
        "restore_only_p50_ms": pct(&rest_only, 0.5), "hygiene_p50_ms": pct(&hyg, 0.5), "peer_p50_ms": p50});
    println!("{}", json!({"bench":"latency","workload":wl,"summary":lat}));
    figure(
        fig("restore with hygiene p50 / cold p50, to agent-ready"),
        r50 / c50,
        "x",
        "<= 0.33x (plain CRIU with hygiene before clade: 0.57x)",
        r50 / c50 <= 0.33,
        &rest,
        lat.clone(),
    );
    figure(
        fig("restore with hygiene p95 vs cold p95"),
        r95,
        "ms",
        &format!("<= cold p95 ({c95:.0} ms)"),
        r95 <= c95,
        &rest,
        json!({"cold_p95_ms": c95, "cold_ms": cold}),
    );
    let n50 = pct(&plain, 0.5);
    figure(
        fig("clade restore p50 / plain CRIU restore by hand p50 (peer: no store, no caches, no KSM), both to agent-ready without hygiene"),
        n50 / p50,
        "x",
        "<= 1.0x",
        n50 / p50 <= 1.0,
        &plain,
        json!({"peer_ms": peers, "peer_p50_ms": p50, "clade_no_hygiene_ms": plain, "clade_no_hygiene_p50_ms": n50,
               "clade_with_hygiene_p50_ms": r50, "clade_with_hygiene_over_peer": r50 / p50, "peer_dump_ms": peer.dump_ms,
               "peer_image_bytes": peer.image_bytes}),
    );

    if wl == "browser" {
        clone_check::run(b, w, &m2)?;
    }

    // Lazy vs eager restore of the same mark, interleaved.
    let (mut eager, mut lazy) = (Vec::new(), Vec::new());
    for i in 0..n.min(6) {
        for (is_lazy, v) in [(false, &mut eager), (true, &mut lazy)] {
            b.backend.set_lazy_threshold(is_lazy.then_some(0));
            let (r, tr, ..) = b.restore(w, &m2)?;
            let used = r.phases.iter().any(|(k, d)| *k == "lazy" && !d.is_zero());
            let _ = Box::new(r).kill();
            println!("{}", json!({"bench":"lazy","workload":wl,"i":i,"lazy":used,"restore_hygiene_ms":ms(tr)}));
            v.push(ms(tr));
        }
    }
    b.backend.set_lazy_threshold(clade_ct::CtConfig::from_home(&b.home).ok().and_then(|c| c.lazy_min_bytes));
    println!(
        "{}",
        json!({"bench":"lazy_vs_eager","workload":wl,"eager_p50_ms":pct(&eager,0.5),"lazy_p50_ms":pct(&lazy,0.5),
               "pages_mib":m2.logical_bytes as f64/1048576.0})
    );
    // Warm pool: prepared ahead (run dir, upper, images, cgroup), then started on demand.
    let mut pooled = Vec::new();
    for i in 0..n.min(6) {
        let id = b.ident("p");
        let p = b.backend.prepare_ct(&m2, &id).map_err(|e| e.to_string())?;
        let t0 = Instant::now();
        let sb = p.start_ct().map_err(|e| e.to_string())?;
        clade_core::hygiene::apply(sb.agent(), &id, m2.clean).map_err(|e| e.to_string())?;
        sb.agent().wait_ready(w.ready.clone(), w.timeout).map_err(|e| e.to_string())?;
        let t = ms(t0.elapsed());
        let _ = Box::new(sb).kill();
        println!("{}", json!({"bench":"pool","workload":wl,"i":i,"start_hygiene_ms":t}));
        pooled.push(t);
    }
    println!("{}", json!({"bench":"pool_summary","workload":wl,"prepared_start_hygiene_p50_ms":pct(&pooled,0.5)}));

    // Memory slope: PSS of N cold sandboxes, then of N restored siblings (KSM given time to merge); the audit
    // of two siblings against the first two cold ones, kept running as the control.
    let (mut xs, mut cys, mut rys, mut ccg, mut rcg) = (vec![], vec![], vec![], vec![], vec![]);
    let mut audit = None;
    for &k in counts {
        let mut cs = Vec::new();
        for _ in 0..k {
            cs.push(b.cold(w)?.0);
        }
        std::thread::sleep(Duration::from_secs(2));
        let (cold_pss, cold_cg) = (pss_of(&cs), cgroup_of(&cs));
        let control: Vec<CtSandbox> = if k >= 2 && audit.is_none() {
            let rest = cs.split_off(2);
            kill_all(rest);
            cs
        } else {
            kill_all(cs);
            Vec::new()
        };
        let mut rs = Vec::new();
        for _ in 0..k {
            rs.push(b.restore(w, &m2)?.0);
        }
        let sharing = clade_ct::ksm_settle(Duration::from_secs(120));
        let (rest_pss, rest_cg) = (pss_of(&rs), cgroup_of(&rs));
        let merge_any = rs[0].pids().iter().all(|p| {
            std::fs::read_to_string(format!("/proc/{p}/ksm_stat")).unwrap_or_default().contains("merge_any: yes")
        });
        if control.len() == 2 {
            audit = Some(clade_ct::audit_with_control(
                &rs[0].pids(),
                &rs[1].pids(),
                &control[0].pids(),
                &control[1].pids(),
            ));
        }
        println!(
            "{}",
            json!({"bench":"memory","workload":wl,"count":k,"cold_pss_mib":cold_pss as f64/1048576.0,"restored_pss_mib":rest_pss as f64/1048576.0,
                   "cold_cgroup_mib":cold_cg as f64/1048576.0,"restored_cgroup_mib":rest_cg as f64/1048576.0,
                   "ksm_pages_sharing":sharing,"merge_any_all_tasks":merge_any})
        );
        xs.push(k as f64);
        cys.push(cold_pss as f64);
        rys.push(rest_pss as f64);
        ccg.push(cold_cg as f64);
        rcg.push(rest_cg as f64);
        kill_all(control);
        kill_all(rs);
    }
    if xs.len() >= 2 {
        let (cs, rs) = (slope(&xs, &cys), slope(&xs, &rys));
        figure(
            fig("host memory per added restored sibling / per added cold sandbox (PSS slope)"),
            rs / cs,
            "x",
            "<= 1.0x (plain CRIU before clade: 1.038x)",
            rs / cs <= 1.0,
            &rys,
            json!({"counts": xs, "cold_sum_pss_bytes": cys, "restored_sum_pss_bytes": rys, "cold_mib_per_sandbox": cs / 1048576.0,
                   "restored_mib_per_sibling": rs / 1048576.0, "cgroup_cold_mib_per_sandbox": slope(&xs, &ccg) / 1048576.0,
                   "cgroup_restored_mib_per_sibling": slope(&xs, &rcg) / 1048576.0}),
        );
    }
    match audit {
        Some(a) => {
            let pass = a.pass_control_rule == Some(true);
            figure(
                fig("sibling audit, control rule (two restored siblings, cold-pair control)"),
                f64::from(u8::from(pass)),
                "pass",
                "pass: nothing writable shared; character devices only as the cold pair shares them",
                pass,
                &[f64::from(u8::from(a.pass_literal))],
                serde_json::to_value(&a).unwrap_or_default(),
            );
        }
        None => eprintln!("ct-bench: {wl}: no audit (needs a memory count of at least 2)"),
    }
    Ok(())
}
