//! `clade-bench k8s` (`./x bench k8s`): what a kubelet waits for, through containerd's CRI plugin:
//! RunPodSandbox + CreateContainer + StartContainer until the first ExecSync of the template's readiness probe
//! answers. The image is a template's root filesystem exported as an OCI archive. clade (runtime handler
//! `clade`): the pod's sandbox forks from the template's ct base, found through the image's content, services
//! already up; runc (Debian's, the peer): the image cold-started, the container's command starting the
//! template's services in order, the probe polled until it answers. Third arm: `clade fork` of the same base
//! to the same first probe answer, through the library (the shim's overhead is the CRI arm over it).
//! docs/kubernetes.md.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use clade_core::backend::BackendKind;
use clade_core::CladeHome;
use clade_host::api::{ExecRequest, ForkRequest, SandboxApi};
use clade_host::Ops;
use clade_template::{Ready, Service};
use containerd_shim_clade::testkit::{busybox_rootfs, cri_config, oci_archive, oci_archive_of_dir, Containerd, Cri};

use super::{median, Figure};

const PAUSE: &str = "clade.bench/pause:latest";

#[derive(clap::Args)]
pub struct Args {
    /// The template whose image is run (built, with its ct base, when missing).
    #[arg(long, default_value = "minimal")]
    pub template: String,
    #[arg(long, default_value_t = 5)]
    pub n: usize,
    /// The bar for clade / runc (none: reported).
    #[arg(long)]
    pub bar: Option<f64>,
}

/// The probe a kubelet's readiness check would run: the template's own `ready`.
fn probe(ready: Option<&Ready>) -> Vec<String> {
    let v = |a: &[&str]| a.iter().map(|s| s.to_string()).collect();
    match ready {
        Some(Ready::Url(u)) => {
            v(&["python3", "-c", "import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=5)", u])
        }
        Some(Ready::Port(p)) => v(&["bash", "-c", &format!("exec 3<>/dev/tcp/127.0.0.1/{p}")]),
        Some(Ready::File(f)) => v(&["test", "-e", f]),
        None => v(&["true"]),
    }
}

/// What runc's container runs: the template's services in order, each waited for as clade's agent does at a
/// cold boot, then a long sleep.
fn services_script(services: &[Service]) -> String {
    let mut s = String::new();
    for svc in services {
        s.push_str(&format!("( {} ) >/dev/null 2>&1 &\n", svc.command));
        match &svc.ready {
            Some(Ready::Port(p)) => {
                s.push_str(&format!("until (exec 3<>/dev/tcp/127.0.0.1/{p}) 2>/dev/null; do sleep 0.02; done\n"))
            }
            Some(Ready::File(f)) => s.push_str(&format!("until [ -e '{f}' ]; do sleep 0.02; done\n")),
            _ => {}
        }
    }
    s.push_str("exec sleep 2147483647\n");
    s
}

/// One pod through the CRI to its first answering probe: milliseconds; the pod is removed after.
fn pod_to_probe(
    cri: &mut Cri,
    handler: &str,
    image: &str,
    cmd: &[&str],
    probe: &[String],
    n: usize,
) -> anyhow::Result<f64> {
    let config = Cri::pod_config(&format!("{handler}-{n}"), &[]);
    let cri_err = |what: &str, e: tonic::Status| anyhow!("{what} ({handler}): {}", e.message());
    let t = Instant::now();
    let pod = cri.run_pod_on(&config, handler).map_err(|e| cri_err("RunPodSandbox", e))?;
    let id = cri.create(&pod, &config, "app", image, cmd).map_err(|e| cri_err("CreateContainer", e))?;
    cri.try_start(&id).map_err(|e| cri_err("StartContainer", e))?;
    let probe: Vec<&str> = probe.iter().map(String::as_str).collect();
    while cri.exec_sync(&id, &probe).0 != 0 {
        anyhow::ensure!(t.elapsed() < Duration::from_secs(300), "{handler}: the probe did not answer in 300 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    let ms = t.elapsed().as_secs_f64() * 1e3;
    cri.stop_and_remove(&pod);
    Ok(ms)
}

/// `clade fork` of the base to its first answering probe, through the library: milliseconds.
fn fork_to_probe(ops: &Ops, mark: &str, probe: &[String]) -> anyhow::Result<f64> {
    let t = Instant::now();
    let out = ops.fork(&ForkRequest::new(mark, Some(BackendKind::Ct), 1))?;
    let id = out.sandboxes.first().ok_or_else(|| anyhow!("the fork started nothing"))?.sandbox.clone();
    let res = loop {
        match ops.exec(&id, ExecRequest { argv: probe.to_vec(), ..Default::default() }) {
            Ok(o) if o.code == 0 => break Ok(t.elapsed().as_secs_f64() * 1e3),
            Ok(_) if t.elapsed() < Duration::from_secs(300) => std::thread::sleep(Duration::from_millis(20)),
            Ok(o) => break Err(anyhow!("the probe did not answer: {}", String::from_utf8_lossy(&o.stderr))),
            Err(e) => break Err(e),
        }
    };
    let _ = ops.kill(&id);
    res
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let home = CladeHome::from_env();
    let say = |l: String| eprintln!("{l}");
    let base = clade_host::base::build(&home, &a.template, BackendKind::Ct, false, &say)?;
    let record = clade_host::base::template_record(&home, &a.template, BackendKind::Ct)?;
    let bin = std::env::current_exe()?.parent().map(Path::to_path_buf).unwrap_or_default();
    let c = Containerd::start(&cri_config(PAUSE), &bin, Some(home.root().to_path_buf()), &[])
        .ok_or_else(|| anyhow!("no containerd or no CRIU: run ./x setup"))?;
    let pause = c.dir.path().join("pause.tar");
    oci_archive(&pause, PAUSE, &busybox_rootfs(), &["/bin/sleep", "2147483647"]);
    c.import_k8s(&pause);
    let image = format!("clade.bench/{}:latest", record.name);
    let archive = c.dir.path().join("image.tar");
    eprintln!("k8s: exporting {} ({} MiB) as an OCI image", record.name, record.rootfs_bytes >> 20);
    oci_archive_of_dir(&archive, &image, &record.rootfs, &["/bin/sh"]);
    c.import_k8s(&archive);
    std::fs::remove_file(&archive).context("remove the image archive")?;

    let probe = probe(record.ready.as_ref());
    let script = services_script(&record.services);
    let mut cri = Cri::connect(&c);
    let ops = Ops::open(&home)?;
    let (mut clade, mut runc, mut fork) = (vec![], vec![], vec![]);
    // Round 0 is a warm-up (the image's content hashed once, caches filled), not counted.
    let with_log = |e: anyhow::Error| e.context(format!("containerd's log ends:\n{}", c.log_tail()));
    for i in 0..=a.n {
        let t_clade = pod_to_probe(&mut cri, "clade", &image, &["sleep", "2147483647"], &probe, i).map_err(with_log)?;
        let t_runc = pod_to_probe(&mut cri, "runc", &image, &["bash", "-c", &script], &probe, i).map_err(with_log)?;
        let t_fork = fork_to_probe(&ops, &base.mark, &probe)?;
        eprintln!(
            "k8s {} round {i}: clade {t_clade:.0} ms, runc {t_runc:.0} ms, clade fork {t_fork:.0} ms",
            record.name
        );
        if i > 0 {
            clade.push(t_clade);
            runc.push(t_runc);
            fork.push(t_fork);
        }
    }
    let (pc, pr, pf) = (median(&clade), median(&runc), median(&fork));
    let vs_runc = pc / pr;
    let overhead = pc / pf;
    let t = &record.name;
    let plot = serde_json::json!({"kind": "arms", "unit": "ms",
        "arms": {"clade (CRI)": clade, "runc (CRI)": runc, "clade fork (library)": fork}});
    let figs = vec![
        Figure {
            name: format!("k8s: CRI pod to first ready probe, clade from its base / runc cold ({t} image, ct)"),
            value: vs_runc,
            unit: "x".into(),
            bar: a.bar.map_or("reported".into(), |b| format!("<= {b}x")),
            pass: a.bar.is_none_or(|b| vs_runc <= b),
            samples: clade.clone(),
            detail: serde_json::json!({"clade_p50_ms": pc, "runc_p50_ms": pr, "probe": probe, "plot": plot}),
        },
        Figure {
            name: format!(
                "k8s: shim overhead, CRI pod to first ready probe / clade fork to first ready probe ({t}, ct)"
            ),
            value: overhead,
            unit: "x".into(),
            bar: "<= 1.5x".into(),
            pass: overhead <= 1.5,
            samples: fork,
            detail: serde_json::json!({"clade_cri_p50_ms": pc, "clade_fork_p50_ms": pf}),
        },
    ];
    for f in &figs {
        println!("{}", serde_json::to_string(f)?);
    }
    Ok(if figs.iter().all(|f| f.pass) { 0 } else { 1 })
}
