//! `clade-bench roam` (`./x bench roam`): roaming's figures (docs/roam.md). A sandbox of a template's base runs on
//! host A (this `$CLADE_HOME`), does some work, is suspended and resumed there once (the same-host resume), then
//! suspended and pushed to the blob tier: a real 3-node Garage cluster on loopback (replication factor 3). Host A
//! runs and suspends without the blob tier, so the push uploads the whole mark; a peer client (boto3's
//! `upload_file`, what `aws s3 cp` uses: multipart, 10 threads) then uploads as many bytes to the same cluster.
//! Host B (a fresh home that shares nothing but that tier, so its caches are cold) resumes it by name and the
//! sandbox works for 10 s. Reported per backend: resume time on B and its ratio to the same-host resume, push
//! throughput and its ratio to the peer's, the bytes B fetched from the blob tier (its pull plus its
//! supervisor's reads), the sandbox's full size, and the working set it touched in those 10 s:
//! - `vm`: the resident part of QEMU's guest-RAM mapping (a page is resident once the guest or the restore
//!   touched it) plus the bytes the guest read from its disk since the mark (`/sys/block/vda/stat`);
//! - `ct`: the memory the sandbox's cgroup is charged: its processes' pages (CRIU restores every dumped page
//!   eagerly) plus the page cache of the files it read.
//!
//! Bars: bytes fetched at most 1.5x the working set; resume on B at most 3x the same-host resume (ct; reported for
//! vm); push throughput at least 0.5x the peer's.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use clade_core::backend::BackendKind;
use clade_core::CladeHome;

use super::Figure;

#[derive(clap::Args)]
pub struct Args {
    /// Backends to measure (default both).
    #[arg(long, value_delimiter = ',', default_value = "vm,ct")]
    pub backend: Vec<BackendKind>,
    /// A template name, or a template spec's path (`templates/minimal/template.toml`): a path names exactly
    /// the build of that spec (its base on each backend, built if missing), where a name picks the newest
    /// template of that name, which may be another build (a test's, with no vm base).
    #[arg(long, default_value = "minimal")]
    pub template: String,
    /// Rounds per backend (each with a fresh host B).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// How long the sandbox works on B before its working set is read.
    #[arg(long, default_value_t = 10)]
    pub work_secs: u64,
    /// Where the figures go as JSON.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// A `clade` subprocess on one home with the blob tier's environment (and, for B, its own guest-RAM dir).
struct Host {
    home: PathBuf,
    env: Vec<(&'static str, String)>,
}

impl Host {
    fn call(&self, args: &[&str]) -> anyhow::Result<serde_json::Value> {
        self.call_logged(args).map(|(v, _)| v)
    }

    /// [`Host::call`], with what clade printed on stderr (its progress lines).
    fn call_logged(&self, args: &[&str]) -> anyhow::Result<(serde_json::Value, String)> {
        let out = Command::new(clade_host::supervisor::clade_exe()?)
            .args(args)
            .env("CLADE_HOME", &self.home)
            .envs(self.env.iter().map(|(k, v)| (*k, v.as_str())))
            .output()
            .context("run clade")?;
        let text = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!("clade {args:?} on {}: {}{text}", self.home.display(), String::from_utf8_lossy(&out.stderr));
        }
        let v = serde_json::from_str(&text).with_context(|| format!("clade {args:?} printed no JSON: {text}"))?;
        Ok((v, String::from_utf8_lossy(&out.stderr).into_owned()))
    }

    fn sh(&self, sbx: &str, script: &str) -> anyhow::Result<String> {
        let out = self.call(&["exec", sbx, "--json", "--", "sh", "-c", script])?;
        if out["code"] != 0 {
            bail!("{script}: {out}");
        }
        Ok(out["stdout"].as_str().unwrap_or("").trim().to_string())
    }
}

/// Sectors read, from `/sys/block/vda/stat` (third field).
fn sectors_read(stat: &str) -> u64 {
    stat.split_whitespace().nth(2).and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// Resident bytes of process `pid`'s guest-RAM mapping (a root RAM file, or a lazy one, under /dev/shm).
fn ram_resident(pid: u32) -> anyhow::Result<u64> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    let mut best = 0u64;
    let mut in_ram = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            in_ram = line.contains("/dev/shm/") && line.trim_end().ends_with(".ram");
        } else if in_ram && first == "Rss:" {
            let kb: u64 = line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0);
            best = best.max(kb * 1024);
        }
    }
    if best == 0 {
        bail!("process {pid} maps no guest RAM file under /dev/shm");
    }
    Ok(best)
}

/// A fresh host B: its own home borrowing only the installed parts (kernel, CRIU, the accelerator probe).
fn fresh_home(a: &Path, round: usize, backend: &str) -> anyhow::Result<tempfile::TempDir> {
    let t = tempfile::Builder::new().prefix(&format!("clade-roam-{backend}-{round}-")).tempdir_in("/var/tmp")?;
    for d in ["kernel", "criu"] {
        if a.join(d).exists() {
            std::os::unix::fs::symlink(a.join(d).canonicalize()?, t.path().join(d))?;
        }
    }
    std::fs::create_dir_all(t.path().join("cache"))?;
    let _ = std::fs::copy(a.join("cache/accel.json"), t.path().join("cache/accel.json"));
    Ok(t)
}

struct Round {
    resume_ms: f64,
    local_resume_ms: f64,
    fetched: u64,
    full: u64,
    working_set: u64,
    push_bytes: u64,
    push_ms: f64,
    peer_ms: f64,
}

/// Upload `bytes` random bytes to the tier with boto3's `upload_file` (the peer of a push); milliseconds.
fn peer_upload_ms(py: &Path, env: &[(&'static str, String)], bytes: u64) -> anyhow::Result<f64> {
    let file = tempfile::NamedTempFile::new_in("/var/tmp")?;
    std::io::copy(&mut std::io::Read::take(std::fs::File::open("/dev/urandom")?, bytes), &mut file.as_file())?;
    let script = r#"
import os, sys, time, boto3
from boto3.s3.transfer import TransferConfig
s3 = boto3.client("s3", endpoint_url=os.environ["CLADE_BLOB_ENDPOINT"], region_name="us-east-1")
bucket = os.environ["CLADE_BLOB"][len("s3://"):]
t = time.monotonic()
s3.upload_file(sys.argv[1], bucket, "bench/peer-upload", Config=TransferConfig())
print((time.monotonic() - t) * 1000)
s3.delete_object(Bucket=bucket, Key="bench/peer-upload")
"#;
    let out = Command::new(py)
        .args(["-c", script])
        .arg(file.path())
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .context("run the boto3 peer")?;
    if !out.status.success() {
        bail!("boto3 peer upload: {}", String::from_utf8_lossy(&out.stderr));
    }
    String::from_utf8_lossy(&out.stdout).trim().parse::<f64>().context("boto3 peer printed no time")
}

fn round(a: &Host, b: &Host, template: &str, backend: BackendKind, work: Duration) -> anyhow::Result<Round> {
    let kind = backend.as_str();
    // Host A works without the blob tier (nothing is written through), so its push uploads the whole mark.
    let local = Host { home: a.home.clone(), env: vec![] };
    let base;
    let template = if template.ends_with(".toml") {
        base = local.call(&["base", "build", template, "--backend", kind, "--json"])?;
        base["mark"].as_str().ok_or_else(|| anyhow!("base build answered {base}"))?
    } else {
        template
    };
    let run = local.call(&["run", template, "--backend", kind, "--json"])?;
    let sbx = run["sandboxes"][0]["sandbox"].as_str().ok_or_else(|| anyhow!("run answered {run}"))?.to_string();
    // Some state of its own: a file on its disk / upper, a warm interpreter's output.
    local.sh(
        &sbx,
        "mkdir -p /root && head -c 8388608 /dev/urandom > /root/data && python3 -c 'print(sum(range(10**6)))'",
    )?;
    local.call(&["suspend", &sbx, "--json"])?;
    let here = local.call(&["resume", &sbx, "--json"])?;
    let local_resume_ms = here["resume_ms"].as_f64().unwrap_or(f64::NAN);
    let disk_before =
        if backend == BackendKind::Vm { sectors_read(&local.sh(&sbx, "cat /sys/block/vda/stat")?) } else { 0 };
    local.call(&["suspend", &sbx, "--json"])?;
    let (pushed, log) = a.call_logged(&["roam", "push", &sbx, "--json"])?;
    eprint!("{log}");
    let push_bytes = pushed["bytes_uploaded"].as_u64().unwrap_or(0);
    let push_ms = pushed["push_ms"].as_f64().unwrap_or(f64::NAN);
    let py = a.home.join("py/bin/python");
    let peer_ms = peer_upload_ms(&py, &a.env, push_bytes.max(1 << 20))?;

    let res = b.call(&["resume", &sbx, "--json"])?;
    if res["ok"] != true {
        bail!("resume on B: {res}");
    }
    let start = Instant::now();
    // The sandbox works: what an agent's first commands would do.
    let mut i = 0;
    while start.elapsed() < work {
        match i % 3 {
            0 => b.sh(&sbx, "python3 -c 'import json, hashlib; print(hashlib.sha256(b\"x\").hexdigest())'")?,
            1 => b.sh(&sbx, "md5sum /root/data")?,
            _ => b.sh(&sbx, "ls -R /usr/lib/python3* > /dev/null; echo ok")?,
        };
        i += 1;
        std::thread::sleep(Duration::from_millis(500));
    }
    let info = b.call(&["info", &sbx, "--json"])?;
    let fetched = res["blob_bytes"].as_u64().unwrap_or(0)
        + res["pulled"]["blob_bytes"].as_u64().unwrap_or(0)
        + info["blob_fetched"]["bytes"].as_u64().unwrap_or(0).saturating_sub(res["blob_bytes"].as_u64().unwrap_or(0));
    let working_set = match backend {
        BackendKind::Vm => {
            let pid = info["pids"][0].as_u64().ok_or_else(|| anyhow!("no QEMU pid in {info}"))? as u32;
            let disk = sectors_read(&b.sh(&sbx, "cat /sys/block/vda/stat")?).saturating_sub(disk_before) * 512;
            ram_resident(pid)? + disk
        }
        // The sandbox's memory cgroup: its processes' memory and the page cache of every file it read
        // (charged to it), the analogue of the guest RAM a vm touched. At least its RSS.
        BackendKind::Ct => {
            let cg = ["/sys/fs/cgroup/memory/clade", "/sys/fs/cgroup/clade"]
                .iter()
                .flat_map(|r| ["memory.usage_in_bytes", "memory.current"].map(|f| Path::new(r).join(&sbx).join(f)))
                .find_map(|p| std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok())
                .unwrap_or(0);
            cg.max(info["rss"].as_u64().unwrap_or(0))
        }
    };
    let out = Round {
        // On B the resume command pulls (takes the sandbox from the tier) and then restores it: both count.
        resume_ms: res["resume_ms"].as_f64().unwrap_or(f64::NAN) + res["pulled"]["pull_ms"].as_f64().unwrap_or(0.0),
        local_resume_ms,
        fetched,
        full: res["pulled"]["full_bytes"].as_u64().unwrap_or(0),
        working_set,
        push_bytes,
        push_ms,
        peer_ms,
    };
    b.call(&["kill", &sbx, "--json"])?;
    Ok(out)
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let home = CladeHome::from_env();
    let garage_bin = home.root().join("garage/bin/garage");
    if !garage_bin.exists() {
        bail!("{} is not installed: run ./x setup", garage_bin.display());
    }
    let garage = clade_store::testkit::Garage::start(&garage_bin, "clade-bench-roam")?;
    let env = garage.env();
    let host_a = Host { home: home.root().to_path_buf(), env: env.clone() };
    let mut figures = Vec::new();
    for backend in &a.backend {
        let kind = backend.as_str();
        let (mut resume, mut ratio, mut fetched, mut full, mut ws) = (vec![], vec![], vec![], vec![], vec![]);
        let (mut local, mut remote_over_local, mut push_tput, mut push_over_peer) = (vec![], vec![], vec![], vec![]);
        for r in 0..a.rounds {
            let b_home = fresh_home(home.root(), r, kind)?;
            let shm = ShmDir(Path::new("/dev/shm").join(b_home.path().file_name().unwrap_or_default()));
            let mut env_b = env.clone();
            env_b.push(("CLADE_SHM", shm.0.display().to_string()));
            let host_b = Host { home: b_home.path().to_path_buf(), env: env_b };
            let o = round(&host_a, &host_b, &a.template, *backend, Duration::from_secs(a.work_secs))
                .with_context(|| format!("{kind} round {r}"))?;
            drop(shm);
            let mib = |b: u64| b as f64 / 1048576.0;
            let (push_mbs, peer_mbs) =
                (mib(o.push_bytes) / o.push_ms * 1e3, mib(o.push_bytes.max(1 << 20)) / o.peer_ms * 1e3);
            eprintln!(
                "roam {kind} round {r}: resume on B {:.0} ms (here {:.0} ms), fetched {:.1} MiB of {:.1} MiB, working \
                 set {:.1} MiB; push {:.1} MiB at {push_mbs:.1} MiB/s, boto3 peer {peer_mbs:.1} MiB/s",
                o.resume_ms,
                o.local_resume_ms,
                mib(o.fetched),
                mib(o.full),
                mib(o.working_set),
                mib(o.push_bytes)
            );
            local.push(o.local_resume_ms);
            remote_over_local.push(o.resume_ms / o.local_resume_ms);
            push_tput.push(push_mbs);
            push_over_peer.push(push_mbs / peer_mbs);
            resume.push(o.resume_ms);
            ratio.push(o.fetched as f64 / o.working_set.max(1) as f64);
            fetched.push(o.fetched as f64);
            full.push(o.full as f64);
            ws.push(o.working_set as f64);
        }
        let med = super::median(&ratio);
        figures.push(Figure {
            name: format!("roam.{kind}.fetched_over_working_set"),
            value: med,
            unit: "x".into(),
            bar: "<= 1.5".into(),
            pass: med <= 1.5,
            samples: ratio,
            detail: serde_json::json!({
                "template": a.template, "work_secs": a.work_secs, "fetched_bytes": fetched,
                "working_set_bytes": ws, "full_bytes": full,
            }),
        });
        figures.push(Figure {
            name: format!("roam.{kind}.resume_on_b_cold_ms"),
            value: super::median(&resume),
            unit: "ms".into(),
            bar: "reported".into(),
            pass: true,
            samples: resume,
            detail: serde_json::json!({"fetched_over_full": super::median(&fetched) / super::median(&full).max(1.0)}),
        });
        let rol = super::median(&remote_over_local);
        let bar3 = backend == &BackendKind::Ct;
        figures.push(Figure {
            name: format!("roam.{kind}.resume_on_b_over_here"),
            value: rol,
            unit: "x".into(),
            bar: if bar3 { "<= 3.0".into() } else { "reported".into() },
            pass: !bar3 || rol <= 3.0,
            samples: remote_over_local,
            detail: serde_json::json!({"resume_here_ms": local, "blob": "garage, 3 nodes, rf 3"}),
        });
        let pop = super::median(&push_over_peer);
        figures.push(Figure {
            name: format!("roam.{kind}.push_over_boto3_upload"),
            value: pop,
            unit: "x".into(),
            bar: ">= 0.5".into(),
            pass: pop >= 0.5,
            samples: push_over_peer,
            detail: serde_json::json!({"push_mib_per_s": push_tput, "peer": "boto3 upload_file (multipart, 10 threads)"}),
        });
    }
    for f in &figures {
        println!("{}", serde_json::to_string(f)?);
    }
    if let Some(out) = &a.out {
        std::fs::write(out, serde_json::to_vec_pretty(&figures)?)?;
    }
    Ok(0)
}

/// Host B's guest-RAM directory, removed after its round (lazy mounts detached first).
struct ShmDir(PathBuf);

impl Drop for ShmDir {
    fn drop(&mut self) {
        for e in std::fs::read_dir(self.0.join("lazy")).into_iter().flatten().flatten() {
            let _ = nix::mount::umount2(&e.path(), nix::mount::MntFlags::MNT_DETACH);
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
