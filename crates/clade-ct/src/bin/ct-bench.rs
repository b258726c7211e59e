//! ct-bench: the `ct` backend's figures, both arms side by side in one run, printed as JSON lines.
//!
//! Workload (`minimal`): the test rootfs with a Python HTTP server that first builds `--payload-mib` MiB of
//! deterministic state (the warm-up a restore skips). Agent-ready = the agent answers, hygiene is applied
//! (restore arm) and the server accepts on its port.
//!
//! `ct-bench [--n 10] [--payload-mib 32] [--mem-counts 1,4,8]`

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

struct Bench {
    backend: CtBackend,
    image: TemplateImage,
    script: String,
    seq: std::sync::atomic::AtomicU32,
}

impl Bench {
    fn ident(&self, what: &str) -> Identity {
        let n = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        clade_core::hygiene::new_identity(&format!("b{}-{what}{n}", std::process::id()), 0)
    }

    /// Cold start and warm up to agent-ready.
    fn cold(&self) -> Result<(CtSandbox, Duration), String> {
        let t0 = Instant::now();
        let sb = self.backend.cold_start_ct(&self.image, &self.ident("c")).map_err(|e| e.to_string())?;
        let a = sb.agent();
        a.write_file_bytes("/root/srv.py", self.script.as_bytes(), Some(0o644)).map_err(|e| e.to_string())?;
        let out = a
            .run(ExecSpec::new(["/bin/sh", "-c", "setsid python3 /root/srv.py </dev/null >/dev/null 2>&1 &"]))
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!("start server: {out:?}"));
        }
        a.wait_ready(ReadyTarget::Port { port: PORT }, Duration::from_secs(30)).map_err(|e| e.to_string())?;
        Ok((sb, t0.elapsed()))
    }

    /// Restore with hygiene to agent-ready.
    fn restore(&self, mark: &MarkState) -> Result<(CtSandbox, Duration, Duration), String> {
        let out = self.restore_inner(mark)?;
        if std::env::var_os("CT_BENCH_PHASES").is_some() {
            let p: Vec<(String, f64)> = out.0.phases.iter().map(|(k, d)| (k.to_string(), ms(*d))).collect();
            eprintln!("{}", json!({"phases": p}));
            let _ = std::fs::copy(out.0.run_dir().join("restore.log"), "/tmp/ct-bench-restore.log");
        }
        Ok(out)
    }

    fn restore_inner(&self, mark: &MarkState) -> Result<(CtSandbox, Duration, Duration), String> {
        let t0 = Instant::now();
        let id = self.ident("r");
        let sb = self.backend.restore_ct(mark, &id).map_err(|e| e.to_string())?;
        let restored = t0.elapsed();
        clade_core::hygiene::apply(sb.agent(), &id, mark.clean).map_err(|e| e.to_string())?;
        sb.agent().wait_ready(ReadyTarget::Port { port: PORT }, Duration::from_secs(30)).map_err(|e| e.to_string())?;
        Ok((sb, t0.elapsed(), restored))
    }
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return 0.0;
    }
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn pss_of(sbs: &[CtSandbox]) -> u64 {
    sbs.iter().flat_map(|s| s.pids()).filter_map(|p| clade_core::host::pss_rss(p).map(|x| x.0)).sum()
}

/// Wait until KSM stops merging more (two equal readings of pages_sharing), at most `max`.
fn ksm_settle(max: Duration) -> u64 {
    let read = || -> u64 {
        std::fs::read_to_string("/sys/kernel/mm/ksm/pages_sharing")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    };
    let t0 = Instant::now();
    let mut last = read();
    let mut same = 0;
    while t0.elapsed() < max {
        std::thread::sleep(Duration::from_millis(500));
        let now = read();
        same = if now == last { same + 1 } else { 0 };
        last = now;
        if same >= 2 {
            break;
        }
    }
    last
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

fn run() -> Result<(), String> {
    let n: usize = arg("--n", "10").parse().map_err(|_| "--n: a number")?;
    let payload: u32 = arg("--payload-mib", "32").parse().map_err(|_| "--payload-mib: a number")?;
    let counts: Vec<usize> = arg("--mem-counts", "1,4,8").split(',').filter_map(|s| s.parse().ok()).collect();
    let real = CladeHome::from_env();
    let mut cfg = CtConfig::from_home(&real).map_err(|e| e.to_string())?;
    cfg.ksm = !std::env::args().any(|a| a == "--no-ksm");
    let rootfs = clade_ct::testroot::ensure(&real, &cfg.agent_bin)?;
    let home = CladeHome::at(real.tmp_dir().join(format!("ct-bench-{}", std::process::id())));
    let store = clade_store::Store::open(&home.store_dir(), Default::default()).map_err(|e| e.to_string())?;
    let backend = CtBackend::new(home.clone(), store, cfg).map_err(|e| e.to_string())?;
    let image = TemplateImage {
        name: "minimal-test".into(),
        hash: "test".into(),
        rootfs,
        disk_manifest: None,
        shape: Shape { memory_mib: 1024, vcpus: 1, disk_gib: 1 },
        egress: false,
    };
    let b = Bench { backend, image, script: server_py(payload), seq: Default::default() };
    let result = bench(&b, n, payload, &counts);
    let _ = std::fs::remove_dir_all(home.root());
    result
}

fn bench(b: &Bench, n: usize, payload: u32, counts: &[usize]) -> Result<(), String> {
    // The base: cold, warm, marked twice (storage of the second mark).
    let (mut base, _) = b.cold()?;
    let m1 = base.mark(&MarkOptions::default()).map_err(|e| e.to_string())?;
    base.agent()
        .run(ExecSpec::new(["/bin/sh", "-c", "wget -qO- http://127.0.0.1:8000/ >/dev/null; echo x > /root/later"]))
        .map_err(|e| e.to_string())?;
    let m2 = base.mark(&MarkOptions::default()).map_err(|e| e.to_string())?;
    println!(
        "{}",
        json!({"bench":"mark","payload_mib":payload,"pause_ms_first":ms(m1.pause),"pause_ms_second":ms(m2.pause),
               "logical_bytes":m1.logical_bytes,"stored_bytes_first":m1.stored_bytes,"stored_bytes_second":m2.stored_bytes,
               "second_over_first":m2.stored_bytes as f64 / m1.stored_bytes.max(1) as f64})
    );
    // Latency: interleaved, one sandbox at a time.
    let (mut cold, mut rest, mut rest_only) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        let (c, tc) = b.cold()?;
        let _ = Box::new(c).kill();
        let (r, tr, tro) = b.restore(&m2)?;
        let _ = Box::new(r).kill();
        println!(
            "{}",
            json!({"bench":"start","i":i,"cold_ms":ms(tc),"restore_hygiene_ms":ms(tr),"restore_only_ms":ms(tro)})
        );
        cold.push(ms(tc));
        rest.push(ms(tr));
        rest_only.push(ms(tro));
    }
    // Lazy vs eager restore of the same mark, interleaved.
    let (mut eager, mut lazy) = (Vec::new(), Vec::new());
    for i in 0..n.min(6) {
        for (is_lazy, v) in [(false, &mut eager), (true, &mut lazy)] {
            b.backend.set_lazy_threshold(is_lazy.then_some(0));
            let (r, tr, _) = b.restore(&m2)?;
            let used = r.phases.iter().any(|(k, d)| *k == "lazy" && !d.is_zero());
            let _ = Box::new(r).kill();
            println!("{}", json!({"bench":"lazy","i":i,"lazy":used,"restore_hygiene_ms":ms(tr)}));
            v.push(ms(tr));
        }
    }
    b.backend.set_lazy_threshold(None);
    println!(
        "{}",
        json!({"bench":"lazy_vs_eager","eager_p50_ms":pct(&mut eager,0.5),"lazy_p50_ms":pct(&mut lazy,0.5),
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
        sb.agent().wait_ready(ReadyTarget::Port { port: PORT }, Duration::from_secs(30)).map_err(|e| e.to_string())?;
        let t = ms(t0.elapsed());
        let _ = Box::new(sb).kill();
        println!("{}", json!({"bench":"pool","i":i,"start_hygiene_ms":t}));
        pooled.push(t);
    }
    println!("{}", json!({"bench":"pool_summary","prepared_start_hygiene_p50_ms":pct(&mut pooled,0.5)}));
    let (c50, r50) = (pct(&mut cold, 0.5), pct(&mut rest, 0.5));
    let (c95, r95) = (pct(&mut cold, 0.95), pct(&mut rest, 0.95));
    println!(
        "{}",
        json!({"bench":"latency","n":n,"cold_p50_ms":c50,"cold_p95_ms":c95,"restore_hygiene_p50_ms":r50,
               "restore_hygiene_p95_ms":r95,"restore_only_p50_ms":pct(&mut rest_only,0.5),"ratio_p50":r50/c50,"p95_not_worse":r95<=c95})
    );
    // Memory slope: PSS of N cold sandboxes vs N restored siblings (KSM given time to merge).
    let mut rows = Vec::new();
    for &k in counts {
        let mut cs = Vec::new();
        for _ in 0..k {
            cs.push(b.cold()?.0);
        }
        std::thread::sleep(Duration::from_millis(500));
        let cold_pss = pss_of(&cs);
        let mut rs = Vec::new();
        for _ in 0..k {
            rs.push(b.restore(&m2)?.0);
        }
        let sharing = ksm_settle(Duration::from_secs(20));
        let rest_pss = pss_of(&rs);
        let merging: u64 = rs
            .iter()
            .flat_map(|s| s.pids())
            .filter_map(|p| {
                std::fs::read_to_string(format!("/proc/{p}/ksm_merging_pages")).ok()?.trim().parse::<u64>().ok()
            })
            .sum();
        let merge_any = rs[0]
            .pids()
            .iter()
            .map(|p| {
                std::fs::read_to_string(format!("/proc/{p}/ksm_stat")).unwrap_or_default().contains("merge_any: yes")
            })
            .collect::<Vec<_>>();
        let audit = if k >= 2 {
            Some(clade_ct::audit_with_control(&rs[0].pids(), &rs[1].pids(), &cs[0].pids(), &cs[1].pids()))
        } else {
            None
        };
        println!(
            "{}",
            json!({"bench":"memory","count":k,"cold_pss_mib":cold_pss as f64/1048576.0,"restored_pss_mib":rest_pss as f64/1048576.0,
                   "ksm_pages_sharing":sharing,"ksm_merging_pages":merging,"merge_any":merge_any,"audit":audit})
        );
        rows.push((k as f64, cold_pss as f64, rest_pss as f64));
        kill_all(cs);
        kill_all(rs);
    }
    if rows.len() >= 2 {
        let slope = |f: fn(&(f64, f64, f64)) -> f64| {
            let (a, z) = (&rows[0], &rows[rows.len() - 1]);
            (f(z) - f(a)) / (z.0 - a.0) / 1048576.0
        };
        let (cs, rs) = (slope(|r| r.1), slope(|r| r.2));
        println!(
            "{}",
            json!({"bench":"memory_slope","cold_mib_per_sandbox":cs,"restored_mib_per_sibling":rs,"ratio":rs/cs})
        );
    }
    let _ = Box::new(base).kill();
    Ok(())
}
