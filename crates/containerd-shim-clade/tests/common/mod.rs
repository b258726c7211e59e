//! What the shim's tests share: a private containerd (Debian's, started with its own root, state and socket
//! under a temp directory, so the host's containerd, if any, is never touched), a clade home of its own that
//! borrows the installed CRIU, and OCI image archives built here (no registry is reachable from these tests).
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// The installed home whose CRIU the tests borrow (`CLADE_TEST_HOME`, else /var/lib/clade).
pub fn real_home() -> PathBuf {
    PathBuf::from(std::env::var("CLADE_TEST_HOME").unwrap_or_else(|_| "/var/lib/clade".into()))
}

/// A containerd of the test's own, with the clade shim on its PATH. Dropping it kills the sandboxes left in its
/// clade home, stops containerd, kills what shims are left and unmounts what they left.
pub struct Containerd {
    pub dir: tempfile::TempDir,
    pub home: tempfile::TempDir,
    child: Child,
}

impl Containerd {
    /// `None` (and a printed reason) where containerd or CRIU is not installed (`./x setup` installs both).
    pub fn start(extra_config: &str) -> Option<Containerd> {
        if Command::new("containerd").arg("--version").output().is_err() {
            eprintln!("skip: no containerd on PATH (./x setup installs Debian's)");
            return None;
        }
        let criu = real_home().join("criu");
        if !criu.join("bin/criu").exists() {
            eprintln!("skip: no CRIU at {} (run ./x setup)", criu.display());
            return None;
        }
        let home = tempfile::Builder::new().prefix("clade-shim-home").tempdir_in("/var/tmp").unwrap();
        std::os::unix::fs::symlink(&criu, home.path().join("criu")).unwrap();
        let dir = tempfile::Builder::new().prefix("clade-containerd").tempdir_in("/var/tmp").unwrap();
        let d = dir.path().display();
        let config = format!(
            "version = 2\nroot = \"{d}/root\"\nstate = \"{d}/state\"\n{extra_config}\n\
             [grpc]\n  address = \"{d}/containerd.sock\"\n[ttrpc]\n  address = \"{d}/containerd.sock.ttrpc\"\n\
             [debug]\n  level = \"info\"\n"
        );
        std::fs::write(dir.path().join("config.toml"), config).unwrap();
        let shim = Path::new(env!("CARGO_BIN_EXE_containerd-shim-clade-v2"));
        let path = format!("{}:{}", shim.parent().unwrap().display(), std::env::var("PATH").unwrap_or_default());
        let log = std::fs::File::create(dir.path().join("containerd.log")).unwrap();
        let child = Command::new("containerd")
            .arg("--config")
            .arg(dir.path().join("config.toml"))
            .env("PATH", path)
            .env("CLADE_HOME", home.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start containerd");
        let c = Containerd { dir, home, child };
        let t0 = Instant::now();
        while c.ctr(&["version"]).status.code() != Some(0) {
            assert!(t0.elapsed() < Duration::from_secs(30), "containerd did not answer in 30 s:\n{}", c.log());
            std::thread::sleep(Duration::from_millis(100));
        }
        Some(c)
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("containerd.sock")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("containerd.log")).unwrap_or_default()
    }

    /// `ctr -n clade ARGS` against this containerd.
    pub fn ctr(&self, args: &[&str]) -> Output {
        self.ctr_ns("clade", args)
    }

    pub fn ctr_ns(&self, namespace: &str, args: &[&str]) -> Output {
        Command::new("ctr")
            .arg("-a")
            .arg(self.socket())
            .args(["-n", namespace])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run ctr")
    }

    /// `ctr ARGS` that must succeed; its stdout.
    pub fn ctr_ok(&self, args: &[&str]) -> String {
        let out = self.ctr(args);
        assert!(out.status.success(), "ctr {args:?}: {}\n{}", String::from_utf8_lossy(&out.stderr), self.log_tail());
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn log_tail(&self) -> String {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Kills (SIGKILL) the shim serving container or pod `id` of this containerd; whether one was found.
    pub fn kill_shim(&self, id: &str) -> bool {
        let pattern = format!("containerd-shim-clade-v2 .*-id {id} .*{}", self.dir.path().display());
        Command::new("pkill").args(["-9", "-f", &pattern]).status().is_ok_and(|s| s.success())
    }

    /// The sandboxes the clade home holds (`clade ls --json`).
    pub fn sandboxes(&self) -> Vec<serde_json::Value> {
        let clade = Path::new(env!("CARGO_BIN_EXE_containerd-shim-clade-v2")).with_file_name("clade");
        let out = Command::new(clade).args(["ls", "--json"]).env("CLADE_HOME", self.home.path()).output().unwrap();
        assert!(out.status.success(), "clade ls: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let list = v.as_array().cloned().or_else(|| v["sandboxes"].as_array().cloned()).unwrap_or_default();
        list.into_iter().filter(|s| s["state"] != "killed").collect()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // Sandboxes a failed test left running, while the home's ledger still names them.
        let clade = Path::new(env!("CARGO_BIN_EXE_containerd-shim-clade-v2")).with_file_name("clade");
        let _ = Command::new(clade).args(["kill", "--all"]).env("CLADE_HOME", self.home.path()).output();
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), nix::sys::signal::SIGTERM);
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = Command::new("pkill")
            .args(["-9", "-f", &format!("containerd-shim-clade-v2.*{}", self.dir.path().display())])
            .status();
        // Whatever a killed shim left mounted under this containerd's state and root.
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut ours: Vec<&str> = mounts
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|p| p.starts_with(&*self.dir.path().to_string_lossy()))
            .collect();
        ours.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for p in ours {
            let _ = nix::mount::umount2(p, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// A file of an image layer.
pub enum Entry {
    Dir(&'static str),
    File(&'static str, Vec<u8>, u32),
    Link(&'static str, &'static str),
}

/// A busybox-only root filesystem: no glibc, no agent (the shim brings clade's static agent).
pub fn busybox_rootfs() -> Vec<Entry> {
    let mut e = vec![];
    for d in ["bin", "etc", "tmp", "root", "proc", "dev", "sys"] {
        e.push(Entry::Dir(d));
    }
    e.push(Entry::File("bin/busybox", std::fs::read("/bin/busybox").expect("busybox-static (./x setup)"), 0o755));
    for a in ["sh", "echo", "cat", "sleep", "ls", "id", "env", "pwd", "hostname", "true", "false", "kill", "ps"] {
        e.push(Entry::Link(Box::leak(format!("bin/{a}").into_boxed_str()), "busybox"));
    }
    e.push(Entry::File(
        "etc/passwd",
        b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n".to_vec(),
        0o644,
    ));
    e
}

fn layer(entries: &[Entry]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_gnu();
        h.set_mtime(0);
        match e {
            Entry::Dir(p) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(0o755);
                h.set_size(0);
                b.append_data(&mut h, p, std::io::empty()).unwrap();
            }
            Entry::File(p, data, mode) => {
                h.set_mode(*mode);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, p, &data[..]).unwrap();
            }
            Entry::Link(p, target) => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_mode(0o777);
                h.set_size(0);
                b.append_link(&mut h, p, target).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

/// Writes an OCI image archive (`ctr image import` reads it) of one layer holding `entries`, named `name`.
pub fn oci_archive(path: &Path, name: &str, entries: &[Entry], cmd: &[&str]) {
    let mut blobs: Vec<(String, Vec<u8>)> = vec![];
    let mut add = |b: Vec<u8>| {
        let d = format!("{:x}", Sha256::digest(&b));
        let size = b.len();
        blobs.push((d.clone(), b));
        (d, size)
    };
    let (ld, lsize) = add(layer(entries));
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"], "Cmd": cmd},
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{ld}")]},
    });
    let (cd, csize) = add(serde_json::to_vec(&config).unwrap());
    let manifest = serde_json::json!({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": format!("sha256:{cd}"), "size": csize},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": format!("sha256:{ld}"), "size": lsize}],
    });
    let (md, msize) = add(serde_json::to_vec(&manifest).unwrap());
    let index = serde_json::json!({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": format!("sha256:{md}"), "size": msize,
        "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": "latest"},
    }]});
    let f = std::fs::File::create(path).unwrap();
    let mut b = tar::Builder::new(f);
    let mut put = |p: &str, data: &[u8]| {
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        b.append_data(&mut h, p, data).unwrap();
    };
    put("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#);
    put("index.json", &serde_json::to_vec(&index).unwrap());
    for (d, data) in &blobs {
        put(&format!("blobs/sha256/{d}"), data);
    }
    b.into_inner().unwrap().flush().unwrap();
}
