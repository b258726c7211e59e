//! The peer arm: the same session checkpointed and restored with plain CRIU by hand, the way one would without
//! clade, so the report can state clade / peer. What the peer does not have, on purpose: clade's store (images are
//! read from a plain directory), hygiene (clones keep hostname, machine-id and RNG state), the cached kernel
//! probe (each `criu` probes the kernel again), hard-linked image caches, cgroups and KSM.
//!
//! Dump: `criu dump` of the running sandbox's init with the usual flags for such a session (external mounts,
//! established TCP, file locks, a ghost limit), the overlay upper copied by the
//! `post-dump` action while frozen. Restore, per sample: a shell script makes a fresh upper on tmpfs, mounts an
//! overlay whose lower layers are the checkpoint's upper (kept read-only as a checkpoint layer) over the template,
//! in a private mount namespace (`unshare -m`), and runs `criu restore --root ... --restore-detached`.
//! Agent-ready is polled from the host inside the restored network namespace (the same readiness URL the
//! clade arms' agent checks from inside).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use clade_ct::CtSandbox;

pub struct Peer {
    dir: PathBuf,
    shm: PathBuf,
    criu: PathBuf,
    lower: String,
    pub dump_ms: f64,
    pub image_bytes: u64,
}

fn sh_quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', "'\\''"))
}

fn dir_bytes(d: &Path) -> u64 {
    std::fs::read_dir(d).map(|rd| rd.flatten().filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum()).unwrap_or(0)
}

impl Peer {
    /// Dump `sb` (which ends with the dump, as a plain `criu dump` without `--leave-running` does).
    pub fn dump(home: &clade_core::CladeHome, criu: &Path, sb: &mut CtSandbox) -> Result<Peer, String> {
        let dir = home.tmp_dir().join(format!("ct-peer-{}", std::process::id()));
        let shm = PathBuf::from(format!("/dev/shm/clade-ct-peer-{}", std::process::id()));
        let (img, upper) = (dir.join("img"), dir.join("upper"));
        std::fs::create_dir_all(&img).map_err(|e| format!("create {}: {e}", img.display()))?;
        std::fs::create_dir_all(&shm).map_err(|e| format!("create {}: {e}", shm.display()))?;
        let script = dir.join("post-dump.sh");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\n[ \"$CRTOOLS_SCRIPT_ACTION\" = post-dump ] || exit 0\nexec cp -a {} {}\n",
                sh_quote(&sb.upper_dir()),
                sh_quote(&upper)
            ),
        )
        .map_err(|e| format!("write {}: {e}", script.display()))?;
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o700));
        }
        // The same session as clade's mark: the sandbox's pre-mark hooks first (the browser opens the window
        // its hygiene will use), so that both restores bring back the same processes and pages.
        for warning in clade_core::hygiene::pre_mark(clade_core::backend::Sandbox::agent(&*sb), true) {
            eprintln!("ct-bench: peer dump: {warning}");
        }
        sb.detach_agent().map_err(|e| e.to_string())?;
        let log = dir.join("dump.log");
        let t0 = Instant::now();
        let out = Command::new(criu)
            .arg("dump")
            .arg("-t")
            .arg(sb.init_pid().to_string())
            .arg("-D")
            .arg(&img)
            .arg("-o")
            .arg(&log)
            .args(["--external", "mnt[]", "--network-lock", "skip", "--tcp-established", "--file-locks"])
            .args(["--ghost-limit", "64M"])
            // As clade's dump: without it CRIU cannot dump the browser's inotify watch on the time zone
            // database ("fsnotify: Can't dump that handle") once the session holds a crashed tab's window.
            .args(clade_ct::dump::IRMAP_SCAN_PATHS.iter().flat_map(|p| ["--irmap-scan-path", p]))
            .arg("--action-script")
            .arg(&script)
            .output()
            .map_err(|e| format!("run {}: {e}", criu.display()))?;
        let dump_ms = t0.elapsed().as_secs_f64() * 1e3;
        if !out.status.success() || !upper.exists() {
            return Err(format!("peer: criu dump failed ({}): {}", out.status, clade_ct::dump::log_tail(&log)));
        }
        Ok(Peer {
            image_bytes: dir_bytes(&img),
            dir,
            shm,
            criu: criu.to_path_buf(),
            lower: sb.lower().to_string(),
            dump_ms,
        })
    }

    /// One restore by hand, timed from the script's start to agent-ready; the restored tree is then killed.
    pub fn restore(&self, i: usize, url: &str, timeout: Duration) -> Result<Duration, String> {
        let r = self.shm.join(format!("r{i}"));
        for d in ["upper", "work", "root"] {
            std::fs::create_dir_all(r.join(d)).map_err(|e| format!("create {}: {e}", r.display()))?;
        }
        let pidfile = r.join("pid");
        let log = r.join("restore.log");
        let inner = format!(
            "mount -t overlay overlay -o lowerdir={}:{},upperdir={},workdir={} {} && exec {} restore -D {} -W {} -o {} \
             --root {} --ext-mount-map auto --restore-detached --manage-cgroups=ignore --tcp-close --file-locks \
             --network-lock skip --pidfile {}{}",
            self.dir.join("upper").display(),
            self.lower,
            r.join("upper").display(),
            r.join("work").display(),
            r.join("root").display(),
            sh_quote(&self.criu),
            sh_quote(&self.dir.join("img")),
            sh_quote(&r),
            sh_quote(&log),
            sh_quote(&r.join("root")),
            sh_quote(&pidfile),
            if std::env::var_os("CLADE_CRIU_VERBOSE").is_some() { " -v4" } else { "" },
        );
        let t0 = Instant::now();
        let status = Command::new("unshare")
            .args(["-m", "--propagation", "private", "/bin/sh", "-c", &inner])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .status()
            .map_err(|e| format!("run unshare: {e}"))?;
        let pid: Option<i32> = std::fs::read_to_string(&pidfile).ok().and_then(|s| s.trim().parse().ok());
        let result = match (status.success(), pid) {
            (true, Some(pid)) => poll_in_netns(pid, url, t0 + timeout).map(|()| t0.elapsed()),
            _ => Err(format!("peer: criu restore failed ({status}): {}", clade_ct::dump::log_tail(&log))),
        };
        if let Some(pid) = pid {
            end_tree(pid);
        }
        if std::env::var_os("CLADE_CRIU_VERBOSE").is_some() {
            let _ = std::fs::copy(&log, format!("/tmp/ct-bench-peer-restore-{i}.log"));
        }
        let _ = std::fs::remove_dir_all(&r);
        result
    }

    pub fn cleanup(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_dir_all(&self.shm);
    }
}

/// SIGKILL the restored init (its PID namespace goes with it) and reap it: the bench is a subreaper, so the
/// detached tree is re-parented to it when CRIU exits.
fn end_tree(pid: i32) {
    use nix::sys::signal::{kill, Signal};
    let p = nix::unistd::Pid::from_raw(pid);
    let _ = kill(p, Signal::SIGKILL);
    let _ = nix::sys::wait::waitpid(p, None);
    let t0 = Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists() && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// GET `url` every 10 ms from a thread that joined the sandbox's network namespace, until it answers 2xx.
fn poll_in_netns(pid: i32, url: &str, deadline: Instant) -> Result<(), String> {
    let rest = url.strip_prefix("http://").ok_or_else(|| format!("{url}: only http:// URLs"))?;
    let (hostport, path) =
        rest.split_once('/').map(|(h, p)| (h.to_string(), format!("/{p}"))).unwrap_or((rest.into(), "/".into()));
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net")).map_err(|e| format!("open netns of {pid}: {e}"))?;
    let url = url.to_string();
    std::thread::spawn(move || -> Result<(), String> {
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| format!("setns: {e}"))?;
        while Instant::now() < deadline {
            if get_ok(&hostport, &path, deadline) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Err(format!("peer: {url} not ready in time"))
    })
    .join()
    .map_err(|_| "peer poll thread panicked".to_string())?
}

fn get_ok(hostport: &str, path: &str, deadline: Instant) -> bool {
    let Ok(addr) = hostport.parse::<std::net::SocketAddr>() else { return false };
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else { return false };
    let _ = s.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1))));
    if s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {hostport}\r\n\r\n").as_bytes()).is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    let mut got = 0;
    while got < head.len() {
        match s.read(&mut head[got..]) {
            Ok(0) | Err(_) => break,
            Ok(k) => got += k,
        }
    }
    let line = String::from_utf8_lossy(&head[..got]);
    line.starts_with("HTTP/") && line.split_whitespace().nth(1).is_some_and(|c| c.starts_with('2'))
}
