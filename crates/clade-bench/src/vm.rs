//! The `vm` figures (docs/vm.md), one run, side by side:
//! cold boot vs fork from the warm pool (to ready, hygiene included), fork of 10 with a pool of 10, host memory
//! per added idle sibling and PSS/RSS, the mark pause of a 512 MiB guest and its stored bytes against what it
//! dirtied, retake end to end, and clade's fork against QEMU templating done by hand (a shell script starting the
//! same QEMU on the same RAM file and device state, with `qemu-nbd` for the disk).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use clade_core::backend::{BackendKind, MarkOptions, Sandbox};
use clade_core::engine::Engine;
use clade_core::{hygiene, CladeHome};
use clade_ledger::TemplateId;
use clade_vm::machine::RamBacking;

use super::{median, slope, Figure};
use clade_host::api::{ExecRequest, MarkRequest, SandboxApi};
use clade_host::supervisor::pool;
use clade_host::Ops;

#[derive(clap::Args)]
pub struct Args {
    /// Template spec dir (default templates/minimal).
    #[arg(long)]
    pub template: Option<PathBuf>,
    /// Fewer samples (CI-like check).
    #[arg(long)]
    pub quick: bool,
    /// Where to write the figures (JSON).
    #[arg(long, default_value = "bench/out/vm.json")]
    pub out: PathBuf,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn emit(figs: &mut Vec<Figure>, f: Figure) {
    println!("{}", serde_json::to_string(&f).unwrap_or_default());
    figs.push(f);
}

fn kill_all(ops: &Ops, ids: &[String]) {
    for id in ids {
        let _ = ops.kill(id);
    }
}

fn wait_pool(home: &CladeHome, mark: &str, n: usize) -> anyhow::Result<()> {
    pool::set_size(home, mark, n)?;
    let start = Instant::now();
    loop {
        let (ready, starting) = pool::members(home, mark);
        if ready.len() >= n {
            return Ok(());
        }
        if ready.len() + starting < n {
            pool::refill(home, mark)?;
        }
        if start.elapsed() > Duration::from_secs(600) {
            return Err(anyhow!("warm pool of {mark} not full after 600 s"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sum PSS and RSS of the guest RAM alone (the mappings of root RAM files under `ram_dir`) of `pids`, and how
/// many other processes map that RAM.
fn guest_ram_pss_of(pids: &[u32], ram_dir: &Path) -> ((u64, u64), usize) {
    let sum = pids
        .iter()
        .filter_map(|p| clade_core::host::mapped_pss_rss(*p, ram_dir))
        .fold((0, 0), |(p, r), (mp, mr)| (p + mp, r + mr));
    (sum, other_ram_mappers(ram_dir, pids))
}

/// Processes on the host mapping a file under `ram_dir` that are not in `ours`: a stray QEMU mapping the same
/// root would share its pages and flatter a PSS ratio, so the figure reports how many there were.
fn other_ram_mappers(ram_dir: &Path, ours: &[u32]) -> usize {
    let needle = ram_dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()))
                .filter(|pid| !ours.contains(pid) && *pid != std::process::id())
                .filter(|pid| {
                    std::fs::read_to_string(format!("/proc/{pid}/maps")).map(|m| m.contains(&needle)).unwrap_or(false)
                })
                .count()
        })
        .unwrap_or(0)
}

/// Sum PSS and RSS of the sandboxes' processes, and those processes, from their supervisors' facts.
fn pss_of(ops: &Ops, ids: &[String]) -> (u64, u64, Vec<u32>) {
    ids.iter().fold((0, 0, Vec::new()), |(p, r, mut pids), id| match ops.get(id).map(|i| i.live) {
        Ok(Some(l)) => {
            pids.extend(l.pids);
            (p + l.pss, r + l.rss, pids)
        }
        _ => (p, r, pids),
    })
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let home = CladeHome::from_env();
    let template = a.template.clone().unwrap_or_else(|| PathBuf::from("templates/minimal"));
    let key = template.display().to_string();
    let n = if a.quick { 3 } else { 7 };
    eprintln!("bench vm: base of {key}");
    let base = clade_host::base::build(&home, &key, BackendKind::Vm, false, &|l| eprintln!("{l}"))?;
    let ops = Ops::open(&home)?;
    let engine = &ops.engine;
    let mark = engine.ledger().mark(&clade_ledger::MarkId::new(base.mark.as_str()))?;
    let m = mark.id.as_str().to_string();
    let be = clade_host::backends::open(engine, BackendKind::Vm)?;
    let vm = clade_vm::backend::VmBackend::open(&home, engine.store.clone(), None)?;
    let record = clade_host::base::template_record(&home, &key, BackendKind::Vm)?;
    let image = clade_host::base::image_of(&record);
    let accel = vm.accel().as_str().to_string();
    let mut figs = Vec::new();

    // 1. Cold boot to agent hello vs fork from the warm pool to ready (with hygiene), interleaved.
    let (mut cold, mut fork, mut fork_hello) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        wait_pool(&home, &m, 2)?;
        let id = hygiene::new_identity(&format!("bench-cold-{i}-{}", std::process::id()), 0);
        let t = Instant::now();
        let s = be.cold_start(&image, &id).context("cold start")?;
        cold.push(ms(t.elapsed()));
        s.kill()?;
        wait_pool(&home, &m, 2)?;
        let t = Instant::now();
        let (ready, _) = clade_host::supervisor::start::fork_mark(engine, &mark, 1)?;
        fork.push(ms(t.elapsed()));
        fork_hello.push(ready[0].restore_ms);
        kill_all(&ops, &[ready[0].sandbox.clone()]);
    }
    let ratio = median(&cold) / median(&fork);
    emit(
        &mut figs,
        Figure {
            name: "vm cold boot / fork from warm pool (to ready, hygiene included)".into(),
            value: ratio,
            unit: "x".into(),
            bar: ">= 20x".into(),
            pass: ratio >= 20.0,
            samples: fork.clone(),
            detail: serde_json::json!({"accel": accel, "cold_ms": cold, "fork_ms": fork, "fork_to_hello_ms": fork_hello, "cold_p50_ms": median(&cold), "fork_p50_ms": median(&fork)}),
        },
    );

    // 2. Fork N from a warm pool of N, N = 1, 2, 4, 8 then 10: the fork-N curve; the bar is on N = 10.
    let ns: &[usize] = if a.quick { &[1, 10] } else { &[1, 2, 4, 8, 10] };
    let mut curve = Vec::new();
    let mut ready = Vec::new();
    for &k in ns {
        wait_pool(&home, &m, k)?;
        std::thread::sleep(Duration::from_secs(2));
        let t = Instant::now();
        let (r, _) = clade_host::supervisor::start::fork_mark(engine, &mark, k as u32)?;
        curve.push(ms(t.elapsed()));
        if k == 10 {
            ready = r;
        } else {
            kill_all(&ops, &r.iter().map(|x| x.sandbox.clone()).collect::<Vec<_>>());
        }
    }
    let fork10 = *curve.last().unwrap_or(&f64::NAN);
    let ids: Vec<String> = ready.iter().map(|r| r.sandbox.clone()).collect();
    let all_ok = ready.len() == 10 && ready.iter().all(|r| r.ok);
    let hellos =
        ids.iter().filter(|id| ops.get(id).ok().and_then(|i| i.live).is_some_and(|l| !l.hello.is_null())).count();
    emit(
        &mut figs,
        Figure {
            name: "vm fork 10 siblings, all answering hello, warm pool of 10".into(),
            value: fork10,
            unit: "ms".into(),
            bar: "<= 1000 ms".into(),
            pass: fork10 <= 1000.0 && all_ok && hellos == 10,
            samples: ready.iter().map(|r| r.ready_ms).collect(),
            detail: serde_json::json!({"accel": accel, "hello": hellos, "fork_n": ns, "fork_n_ms": curve,
                "plot": {"kind": "xy", "x": ns, "series": {"fork N, all ready (ms)": curve},
                    "xlabel": "siblings forked at once (N), warm pool of N", "ylabel": "ms, fork call to all ready"}}),
        },
    );
    kill_all(&ops, &ids);
    pool::drain(&home, &m);
    std::thread::sleep(Duration::from_secs(1));

    // 3. Memory: a cold sandbox's PSS, then the slope of the siblings' summed PSS over 1, 3, 4, 8, 12.
    let id = hygiene::new_identity(&format!("bench-mem-cold-{}", std::process::id()), 0);
    let s = be.cold_start(&image, &id)?;
    std::thread::sleep(Duration::from_secs(3));
    let cold_pss = s.pids().iter().filter_map(|p| clade_core::host::pss_rss(*p)).map(|m| m.0).sum::<u64>() as f64;
    s.kill()?;
    let counts: &[usize] = if a.quick { &[1, 3, 4, 8] } else { &[1, 3, 4, 8, 12] };
    let mut ids = Vec::new();
    let (mut xs, mut ys, mut at3) = (Vec::new(), Vec::new(), 0.0);
    let ram_dir = vm.root_ram_file("x").parent().map(Path::to_path_buf).unwrap_or_default();
    let (mut ram3, mut whole3, mut strays) = ((0, 0), (0, 0), 0);
    for &c in counts {
        let (ready, _) = clade_host::supervisor::start::fork_mark(engine, &mark, (c - ids.len()) as u32)?;
        ids.extend(ready.into_iter().map(|r| r.sandbox));
        std::thread::sleep(Duration::from_secs(3));
        let (p, r, pids) = pss_of(&ops, &ids);
        xs.push(c as f64);
        ys.push(p as f64);
        if c == 3 {
            at3 = p as f64 / r as f64;
            whole3 = (p, r);
            (ram3, strays) = guest_ram_pss_of(&pids, &ram_dir);
        }
    }
    kill_all(&ops, &ids);
    let per = slope(&xs, &ys);
    emit(
        &mut figs,
        Figure {
            name: "vm host memory per added idle sibling / cold sandbox".into(),
            value: per / cold_pss,
            unit: "ratio".into(),
            bar: "<= 0.15".into(),
            pass: per / cold_pss <= 0.15,
            samples: ys.clone(),
            detail: serde_json::json!({"accel": accel, "counts": xs, "sum_pss_bytes": ys, "slope_bytes": per, "cold_pss_bytes": cold_pss}),
        },
    );
    emit(
        &mut figs,
        Figure {
            name: "vm sum PSS / sum RSS at 3 siblings, whole QEMU processes".into(),
            value: at3,
            unit: "ratio".into(),
            // The 0.40 bar is held against the guest RAM figure below (engrams' measure); this one carries
            // QEMU's own per-process memory (under TCG its translation cache) and is reported beside it.
            bar: "reported (the <= 0.40 bar is judged on the guest RAM figure, engrams' measure)".into(),
            pass: true,
            samples: vec![at3],
            detail: serde_json::json!({"accel": accel, "sum_pss_bytes": whole3.0, "sum_rss_bytes": whole3.1}),
        },
    );
    // The same ratio over the guest RAM mappings alone, the measure engrams' 0.35 ("33% is ideal sharing" for
    // three guests) is of; the whole-process figure above adds QEMU's private heap and, under TCG, its
    // translation cache (docs/vm.md, "Memory of an idle sibling").
    let ram_at3 = if ram3.1 > 0 { ram3.0 as f64 / ram3.1 as f64 } else { f64::NAN };
    emit(
        &mut figs,
        Figure {
            name: "vm sum PSS / sum RSS at 3 siblings, guest RAM".into(),
            value: ram_at3,
            unit: "ratio".into(),
            bar: "<= 0.40".into(),
            pass: ram_at3 <= 0.40 && strays == 0,
            samples: vec![ram_at3],
            detail: serde_json::json!({"accel": accel, "sum_pss_bytes": ram3.0, "sum_rss_bytes": ram3.1,
                "ram_dir": ram_dir, "other_processes_mapping_guest_ram": strays}),
        },
    );

    // 4. Mark pause of a 512 MiB guest that dirtied about 32 MiB (24 MiB of RAM, 8 MiB of disk) since its restore.
    let mut big = image.clone();
    big.shape.memory_mib = 512;
    let tid = TemplateId::new(format!("{}-512", record.hash));
    engine.ledger().put_template(&tid, &format!("{}-512", record.name), &serde_json::json!({"bench": true}))?;
    // Bind first: the ledger's guard must not live through the match (build_base takes it again).
    let recorded = engine.ledger().base_for(&tid, clade_ledger::Backend::Vm)?;
    let big_base = match recorded {
        Some(b) => engine.ledger().mark(&b.mark)?,
        None => engine.build_base(be.as_ref(), &tid, &big, &|_| Ok(()))?.0,
    };
    let state = engine.mark_state(&big_base)?;
    let (mut pauses, mut ratios) = (Vec::new(), Vec::new());
    let mut last = serde_json::Value::Null;
    for i in 0..(if a.quick { 2 } else { 4 }) {
        let id = hygiene::new_identity(&format!("bench-mark-{i}-{}", std::process::id()), 1);
        let mut s = vm.restore_vm(&state, &id)?;
        let out = s.agent().run(clade_agent::proto::ExecSpec {
            argv: vec!["/bin/sh".into(), "-c".into(), "dd if=/dev/urandom of=/dev/shm/dirty bs=1M count=24 2>/dev/null; dd if=/dev/urandom of=/root/dirty bs=1M count=8 2>/dev/null; sync".into()],
            ..Default::default()
        })?;
        if out.status.code != Some(0) {
            return Err(anyhow!("dirtying the guest failed: {}", String::from_utf8_lossy(&out.stderr)));
        }
        // Growth is read off the store itself (packs + manifests), so the disk snapshot's new blocks count too.
        let before = clade_host::gc::dir_bytes(engine.store.dir());
        let ms_ = s.mark(&MarkOptions::default())?;
        let after = clade_host::gc::dir_bytes(engine.store.dir());
        let st = s.last_mark_stats().ok_or_else(|| anyhow!("no mark stats"))?;
        pauses.push(st.pause_ms);
        let truth = (st.diverged_bytes + st.disk_dirty_bytes) as f64;
        let growth = after.saturating_sub(before);
        ratios.push(growth as f64 / truth);
        last = serde_json::json!({"stats": st, "store_growth_bytes": growth, "mark_stored_bytes": ms_.stored_bytes});
        eprintln!("bench vm: mark {i}: {}", last);
        Box::new(s).kill()?;
    }
    let p = median(&pauses);
    emit(
        &mut figs,
        Figure {
            name: "vm mark pause, 512 MiB guest, ~32 MiB dirtied".into(),
            value: p,
            unit: "ms".into(),
            bar: "<= 50 ms".into(),
            pass: p <= 50.0,
            samples: pauses,
            detail: serde_json::json!({"accel": accel, "last": last}),
        },
    );
    let r = median(&ratios);
    emit(
        &mut figs,
        Figure {
            name: "vm mark stored bytes / (dirtied pages + dirtied disk blocks)".into(),
            value: r,
            unit: "ratio".into(),
            bar: "<= 1.25".into(),
            pass: r <= 1.25,
            samples: ratios,
            detail: serde_json::json!({"accel": accel}),
        },
    );

    // 4b. Agent hello round trip: over virtio-serial into a restored guest, against the ct figure on the same
    // machine (the bar: at most 5x it): a real ct sandbox of the same template (the agent in its namespaces,
    // reached through the unix socket in its /run), and, for reference, the same agent binary as a plain host
    // process. All connections are up at once and the arms alternate in blocks (200 warm-up round trips each
    // first), so a burst of host load lands on every arm: a block of one right after the other is the
    // side-by-side the ratio needs.
    {
        // The template's own base (its declared shape), not the 512 MiB variant of arm 4: on that one the same
        // round trip measured 1.2-1.6x slower with a 3-6x longer tail (docs/agent.md).
        let id = hygiene::new_identity(&format!("bench-hello-{}", std::process::id()), 1);
        let s = vm.restore_vm(&engine.mark_state(&mark)?, &id)?;
        let ct = ct_sandbox(&home, engine, &key);
        if let Err(e) = &ct {
            eprintln!("bench vm: no ct sandbox for the hello figure ({e:#}); the plain socket stands in for it");
        }
        let dir = tempfile::tempdir()?;
        let sock = dir.path().join("agent.sock");
        let agent_bin = clade_core::host::agent_binary().ok_or_else(|| anyhow!("no clade-agent next to clade"))?;
        let mut child =
            Command::new(&agent_bin).arg("serve").arg("--listen").arg(format!("unix:{}", sock.display())).spawn()?;
        let rtts = clade_agent::client::AgentClient::connect_unix_wait(&sock, Duration::from_secs(10))
            .map_err(|e| anyhow!("plain agent: {e}"))
            .and_then(|(plain, _)| {
                let ct_agent = ct.as_ref().ok().map(|c| c.agent());
                let (blocks, per_block) = if a.quick { (4, 100) } else { (10, 200) };
                hello_samples(s.agent(), 200)?;
                hello_samples(&plain, 200)?;
                if let Some(c) = ct_agent {
                    hello_samples(c, 200)?;
                }
                let (mut vm_rtt, mut host_rtt, mut ct_rtt) = (Vec::new(), Vec::new(), Vec::new());
                for _ in 0..blocks {
                    vm_rtt.extend(hello_samples(s.agent(), per_block)?);
                    host_rtt.extend(hello_samples(&plain, per_block)?);
                    if let Some(c) = ct_agent {
                        ct_rtt.extend(hello_samples(c, per_block)?);
                    }
                }
                Ok((vm_rtt, host_rtt, ct_rtt))
            });
        let _ = child.kill();
        let _ = child.wait();
        Box::new(s).kill()?;
        if let Ok(c) = ct {
            c.kill()?;
        }
        let (vm_rtt, host_rtt, ct_rtt) = rtts?;
        let method = "200 warm-up round trips per arm, then blocks alternating the arms";
        let (vm50, host50) = (median(&vm_rtt), median(&host_rtt));
        let ct50 = (!ct_rtt.is_empty()).then(|| median(&ct_rtt));
        let (denom, what) = match ct50 {
            Some(c) => (c, "ct sandbox"),
            None => (host50, "plain unix socket"),
        };
        let r = vm50 / denom;
        emit(
            &mut figs,
            Figure {
                name: "agent hello p50: vm (virtio-serial) / ct (the agent in a ct sandbox, unix socket)".into(),
                value: r,
                unit: "x".into(),
                bar: "<= 5x".into(),
                pass: r <= 5.0,
                samples: vm_rtt.clone(),
                detail: serde_json::json!({"accel": accel, "denominator": what, "vm_p50_us": vm50,
                    "ct_p50_us": ct50, "unix_p50_us": host50,
                    "vm_p90_us": super::percentile(&vm_rtt, 0.9), "ct_p90_us": (!ct_rtt.is_empty()).then(|| super::percentile(&ct_rtt, 0.9)),
                    "unix_p90_us": super::percentile(&host_rtt, 0.9), "samples_per_arm": vm_rtt.len(), "ct_samples": ct_rtt,
                    "method": method}),
            },
        );
        emit(
            &mut figs,
            Figure {
                name: "agent hello p50: vm (virtio-serial) / the agent as a plain host process (unix socket)".into(),
                value: vm50 / host50,
                unit: "x".into(),
                bar: "reported".into(),
                pass: true,
                samples: host_rtt.clone(),
                detail: serde_json::json!({"accel": accel, "vm_p50_us": vm50, "unix_p50_us": host50, "method": method}),
            },
        );
    }

    // 5. Retake end to end (CLI path: supervisor kills the sandbox, restores the mark, hygiene).
    let (ready, _) = clade_host::supervisor::start::fork_mark(engine, &mark, 1)?;
    let sbx = ready[0].sandbox.clone();
    let mk = ops.mark(&sbx, &MarkRequest::default())?.id.to_string();
    let mut retakes = Vec::new();
    for _ in 0..n {
        let write =
            ExecRequest { argv: vec!["sh".into(), "-c".into(), "echo x > /root/r".into()], ..Default::default() };
        let _ = ops.exec(&sbx, write);
        let t = Instant::now();
        ops.retake(&sbx, &mk)?;
        retakes.push(ms(t.elapsed()));
    }
    kill_all(&ops, &[sbx]);
    let rt = median(&retakes);
    emit(
        &mut figs,
        Figure {
            name: "vm retake to an earlier mark, end to end".into(),
            value: rt,
            unit: "ms".into(),
            bar: "<= 500 ms".into(),
            pass: rt <= 500.0,
            samples: retakes,
            detail: serde_json::json!({"accel": accel}),
        },
    );

    // 6. Versus QEMU templating by hand, same QEMU, RAM file and device state; qemu-nbd for the disk.
    let peer = peer_samples(engine, &vm, &mark, n)?;
    let mut clade_fork = Vec::new();
    for _ in 0..n {
        wait_pool(&home, &m, 2)?;
        let (ready, _) = clade_host::supervisor::start::fork_mark(engine, &mark, 1)?;
        clade_fork.push(ready[0].restore_ms);
        kill_all(&ops, &[ready[0].sandbox.clone()]);
    }
    pool::drain(&home, &m);
    let r = median(&clade_fork) / median(&peer);
    emit(
        &mut figs,
        Figure {
            name: "vm clade fork (pool claim to hello) / QEMU templating by hand (script start to hello)".into(),
            value: r,
            unit: "x".into(),
            bar: "<= 1.0x".into(),
            pass: r <= 1.0,
            samples: clade_fork.clone(),
            detail: serde_json::json!({"accel": accel, "peer_ms": peer, "clade_ms": clade_fork}),
        },
    );

    if let Some(dir) = a.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(
        &a.out,
        serde_json::to_vec_pretty(&serde_json::json!({"backend": "vm", "accel": accel, "figures": figs}))?,
    )?;
    eprintln!(
        "bench vm: {} figures, {} pass; written to {}",
        figs.len(),
        figs.iter().filter(|f| f.pass).count(),
        a.out.display()
    );
    Ok(0)
}

/// The peer: a shell script that serves the mark's disk with `qemu-nbd --snapshot`, starts QEMU on the root RAM
/// file (`share=off`) with `-incoming defer`, and drives QMP with python3 (x-ignore-shared, `exec:cat` of the
/// device state, `cont`). Timed from the script's start to the agent's hello.
fn peer_samples(
    engine: &Engine,
    vm: &clade_vm::backend::VmBackend,
    mark: &clade_ledger::Mark,
    n: usize,
) -> anyhow::Result<Vec<f64>> {
    let state = engine.mark_state(mark)?;
    let work = tempfile::Builder::new().prefix("clade-peer").tempdir_in("/dev/shm")?;
    let w = work.path();
    let disk = w.join("disk.raw");
    let id = |k: &str| -> anyhow::Result<clade_store::ManifestId> {
        state.manifests.get(k).ok_or_else(|| anyhow!("mark has no {k}"))?.parse().map_err(|_| anyhow!("bad id"))
    };
    engine.store.get_file(&id("disk")?, &disk)?;
    let devstate = w.join("devstate");
    engine.store.get_file(&id("devstate")?, &devstate)?;
    let ram = vm.root_ram_file(state.manifests.get("ram_root").map(String::as_str).unwrap_or_default());
    if !ram.exists() {
        engine.store.get_file(&id("ram_root")?, &ram)?;
    }
    let mut out = Vec::new();
    for i in 0..n {
        let dir = w.join(format!("p{i}"));
        std::fs::create_dir_all(&dir)?;
        let nbd = dir.join("nbd.sock");
        let agent = dir.join("agent.sock");
        let spec = vm.spec(&state.shape, RamBacking { path: ram.clone(), share: false }, &nbd, &agent, true, false);
        let args: Vec<String> = spec.args(&dir).into_iter().map(|a| format!("'{a}'")).collect();
        let script = format!(
            "set -e\nqemu-nbd --snapshot -f raw -k {nbd} {disk} &\nwhile [ ! -S {nbd} ]; do sleep 0.001; done\nqemu-system-x86_64 {args} &\n\
             python3 - <<'PY'\nimport json, socket, time\ns = socket.socket(socket.AF_UNIX)\nwhile True:\n    try:\n        s.connect('{qmp}'); break\n    except OSError: time.sleep(0.001)\nf = s.makefile('rw')\nf.readline()\n\
             def cmd(c, a=None):\n    f.write(json.dumps({{'execute': c, 'arguments': a or {{}}}}) + '\\n'); f.flush()\n    while True:\n        r = json.loads(f.readline())\n        if 'return' in r or 'error' in r: return r\n\
             cmd('qmp_capabilities')\ncmd('migrate-set-capabilities', {{'capabilities': [{{'capability': 'x-ignore-shared', 'state': True}}]}})\ncmd('migrate-incoming', {{'uri': 'exec:cat {dev}'}})\n\
             while cmd('query-migrate')['return'].get('status') != 'completed': time.sleep(0.001)\ncmd('cont')\nPY\n",
            nbd = nbd.display(), disk = disk.display(), args = args.join(" "), qmp = dir.join("qmp.sock").display(), dev = devstate.display(),
        );
        let t = Instant::now();
        let mut child = Command::new("bash").arg("-c").arg(&script).process_group(0).spawn()?;
        let hello = clade_vm::agent_link::hello_until(&agent, Duration::from_secs(60));
        let took = ms(t.elapsed());
        let _ = child.wait();
        // End the peer's QEMU and qemu-nbd (children of the script, still running).
        let _ = Command::new("pkill").arg("-f").arg(dir.display().to_string()).status();
        hello.map_err(|w| anyhow!("peer guest never said hello ({w:?}); see {}", dir.display()))?;
        out.push(took);
    }
    Ok(out)
}

/// A ct sandbox restored from the ct base of `template` (built when missing), for the hello figure.
fn ct_sandbox(
    home: &CladeHome,
    engine: &Engine,
    template: &str,
) -> anyhow::Result<Box<dyn clade_core::backend::Sandbox>> {
    let base = clade_host::base::build(home, template, BackendKind::Ct, false, &|l| eprintln!("{l}"))?;
    let mark = engine.ledger().mark(&clade_ledger::MarkId::new(base.mark.as_str()))?;
    let be = clade_host::backends::open(engine, BackendKind::Ct)?;
    let id = hygiene::new_identity(&format!("bench-hello-ct-{}", std::process::id()), 1);
    Ok(be.restore(&engine.mark_state(&mark)?, &id)?)
}

/// Round trips of `hello`, in microseconds.
fn hello_samples(agent: &clade_agent::client::AgentClient, n: usize) -> anyhow::Result<Vec<f64>> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        agent.hello()?;
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(v)
}
