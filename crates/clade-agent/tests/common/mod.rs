//! Test harness: a real agent process (plain, or PID 1 of a namespace sandbox) driven by the real client.
#![allow(dead_code)]

use clade_agent::AgentClient;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The agent under test: `CLADE_AGENT_BIN` (e.g. the static musl release-small build) or this build's.
pub fn agent_bin() -> PathBuf {
    std::env::var_os("CLADE_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_clade-agent")))
}

pub fn tempdir(tag: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("clade-agent-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub fn wait_for(p: &Path, timeout: Duration) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < timeout {
        if p.exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

/// The socket file appears at bind(), a moment before listen(): a connect in between is refused (seen
/// once in CI), so a failed connect is retried for a few seconds before the test fails.
pub fn connect_retrying(sock: &Path) -> AgentClient {
    let t0 = Instant::now();
    loop {
        match AgentClient::connect_unix(sock) {
            Ok(c) => return c,
            Err(_) if t0.elapsed() < Duration::from_secs(5) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => panic!("agent at {} refused connections for 5 s: {e}", sock.display()),
        }
    }
}

/// `clade-agent serve` as a plain process on a unix socket in a temp dir, with `--sysroot` there too.
pub struct PlainAgent {
    pub child: Child,
    pub dir: PathBuf,
    pub sock: PathBuf,
    pub sysroot: PathBuf,
}

impl PlainAgent {
    pub fn start(tag: &str) -> PlainAgent {
        let dir = tempdir(tag);
        let sock = dir.join("agent.sock");
        let sysroot = dir.join("root");
        std::fs::create_dir_all(&sysroot).unwrap();
        let child = Command::new(agent_bin())
            .arg("serve")
            .arg("--listen")
            .arg(format!("unix:{}", sock.display()))
            .arg("--sysroot")
            .arg(&sysroot)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        assert!(wait_for(&sock, Duration::from_secs(10)), "agent socket never appeared");
        PlainAgent { child, dir, sock, sysroot }
    }

    pub fn client(&self) -> AgentClient {
        connect_retrying(&self.sock)
    }

    pub fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for PlainAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `clade-agent init` as PID 1 of `unshare -p -m -n -u -i --fork`, chrooted into a tmpfs root with the
/// host's /usr bound in and a copy of /etc; nothing is mounted on /proc, /sys, /dev, /run, /tmp, so init
/// must mount them. The host reaches the agent as a ct host does: `/proc/<pid>/root/run/clade/agent.sock`.
pub struct NsAgent {
    pub unshare: Child,
    pub pid: u32,
    pub dir: PathBuf,
    pub root: PathBuf,
}

const SANDBOX_SH: &str = r#"
set -e
R=$1; AGENT=$2; SETUP=$3
mount -t tmpfs -o mode=0755 clade-test-root "$R"
mkdir -p "$R/usr" "$R/etc" "$R/proc" "$R/sys" "$R/dev" "$R/run" "$R/tmp" "$R/root" "$R/agent"
for d in bin sbin lib lib64; do if [ -L "/$d" ]; then ln -s "usr/$d" "$R/$d"; fi; done
mount --bind /usr "$R/usr"
cp -a /etc/. "$R/etc/" 2>/dev/null || true
cp "$AGENT" "$R/agent/clade-agent"
mkdir -p "$R/etc/clade/services.d" "$R/etc/clade/on-restore.d"
if [ -n "$SETUP" ]; then cp -a "$SETUP/." "$R/"; fi
exec chroot "$R" /agent/clade-agent init
"#;

impl NsAgent {
    /// Starts the sandbox; files under `setup` (a dir tree) are copied into its root first.
    pub fn start(tag: &str, setup: Option<&Path>) -> NsAgent {
        let dir = tempdir(tag);
        let root = dir.join("root");
        std::fs::create_dir_all(&root).unwrap();
        let unshare = Command::new("unshare")
            .args(["-p", "-m", "-n", "-u", "-i", "--fork", "sh", "-c", SANDBOX_SH, "sh"])
            .arg(&root)
            .arg(agent_bin())
            .arg(setup.map(|p| p.display().to_string()).unwrap_or_default())
            .stdin(Stdio::null())
            .spawn()
            .expect("unshare must exist on a Linux test host");
        let t0 = Instant::now();
        let children = format!("/proc/{}/task/{}/children", unshare.id(), unshare.id());
        let pid = loop {
            assert!(t0.elapsed() < Duration::from_secs(10), "sandbox init never started");
            let pid = std::fs::read_to_string(&children)
                .ok()
                .and_then(|s| s.split_whitespace().next().and_then(|p| p.parse::<u32>().ok()));
            if let Some(pid) = pid {
                let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
                if exe.ends_with("clade-agent") && Path::new(&format!("/proc/{pid}/root/run/clade/agent.sock")).exists()
                {
                    break pid;
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        NsAgent { unshare, pid, dir, root }
    }

    pub fn sock(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root/run/clade/agent.sock", self.pid))
    }

    pub fn client(&self) -> AgentClient {
        connect_retrying(&self.sock())
    }

    pub fn alive(&self) -> bool {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).unwrap_or_default();
        !stat.is_empty() && !stat.contains(") Z ")
    }
}

impl Drop for NsAgent {
    fn drop(&mut self) {
        // SIGKILL to the namespace's PID 1 from outside tears the whole sandbox down.
        let _ = Command::new("kill").args(["-KILL", &self.pid.to_string()]).status();
        let _ = self.unshare.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
