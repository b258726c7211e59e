//! What the shim's tests and its bench (`clade-bench k8s`) share: a private containerd (Debian's, started with its
//! own root, state and socket under a temp directory, so the host's containerd, if any, is never touched) over a
//! clade home (a temp one borrowing the installed CRIU, or a given one), OCI image archives built here (no
//! registry is reachable from tests), and a CRI client (the CRI protos over gRPC, as a kubelet talks).
//! Test tooling: a failure panics with what went wrong; a CRI call's error is tonic's `Status`, passed on as it is.
#![allow(clippy::result_large_err)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::*;
use sha2::{Digest, Sha256};
use tonic::transport::{Channel, Endpoint, Uri};

/// The installed home whose CRIU the tests borrow (`CLADE_TEST_HOME`, else /var/lib/clade).
pub fn real_home() -> PathBuf {
    PathBuf::from(std::env::var("CLADE_TEST_HOME").unwrap_or_else(|_| "/var/lib/clade".into()))
}

/// Where the clade home of a [`Containerd`] is.
pub enum Home {
    /// A temp home of its own, borrowing the installed CRIU (removed on drop).
    Temp(tempfile::TempDir),
    /// A home given (the bench's: where the templates' bases are).
    At(PathBuf),
}

impl Home {
    pub fn path(&self) -> &Path {
        match self {
            Home::Temp(t) => t.path(),
            Home::At(p) => p,
        }
    }
}

/// A containerd of the test's own, with the clade shim on its PATH. Dropping it kills the sandboxes left in its
/// clade home, stops containerd, kills what shims are left and unmounts what they left.
pub struct Containerd {
    pub dir: tempfile::TempDir,
    pub home: Home,
    /// Where `containerd-shim-clade-v2` and `clade` are.
    bin_dir: PathBuf,
    child: Child,
}

impl Containerd {
    /// A containerd whose shims and `clade` come from `bin_dir`, over `home` (None: a temp home), with
    /// `extra_config` in its config.toml and `env` in its environment (the shims inherit it:
    /// `CLADE_SHIM_BACKEND`). `None` (and a printed reason) where containerd or CRIU is not installed
    /// (`./x setup` installs both).
    pub fn start(
        extra_config: &str,
        bin_dir: &Path,
        home: Option<PathBuf>,
        env: &[(&str, &str)],
    ) -> Option<Containerd> {
        if Command::new("containerd").arg("--version").output().is_err() {
            eprintln!("skip: no containerd on PATH (./x setup installs Debian's)");
            return None;
        }
        let criu = real_home().join("criu");
        if !criu.join("bin/criu").exists() {
            eprintln!("skip: no CRIU at {} (run ./x setup)", criu.display());
            return None;
        }
        let home = match home {
            Some(p) => Home::At(p),
            None => {
                let t = tempfile::Builder::new().prefix("clade-shim-home").tempdir_in("/var/tmp").unwrap();
                std::os::unix::fs::symlink(&criu, t.path().join("criu")).unwrap();
                // The vm backend's guest kernel and accelerator probe, borrowed too.
                std::os::unix::fs::symlink(real_home().join("kernel"), t.path().join("kernel")).unwrap();
                std::fs::create_dir_all(t.path().join("cache")).unwrap();
                let _ = std::fs::copy(real_home().join("cache/accel.json"), t.path().join("cache/accel.json"));
                Home::Temp(t)
            }
        };
        let dir = tempfile::Builder::new().prefix("clade-containerd").tempdir_in("/var/tmp").unwrap();
        let d = dir.path().display();
        let config = format!(
            "version = 2\nroot = \"{d}/root\"\nstate = \"{d}/state\"\n{extra_config}\n\
             [grpc]\n  address = \"{d}/containerd.sock\"\n[ttrpc]\n  address = \"{d}/containerd.sock.ttrpc\"\n\
             [debug]\n  level = \"info\"\n"
        );
        std::fs::write(dir.path().join("config.toml"), config).unwrap();
        let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
        let log = std::fs::File::create(dir.path().join("containerd.log")).unwrap();
        let child = Command::new("containerd")
            .arg("--config")
            .arg(dir.path().join("config.toml"))
            .env("PATH", path)
            .env("CLADE_HOME", home.path())
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start containerd");
        let c = Containerd { dir, home, bin_dir: bin_dir.to_path_buf(), child };
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
        let out = Command::new(self.bin_dir.join("clade"))
            .args(["ls", "--json"])
            .env("CLADE_HOME", self.home.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "clade ls: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let list = v.as_array().cloned().or_else(|| v["sandboxes"].as_array().cloned()).unwrap_or_default();
        list.into_iter().filter(|s| s["state"] != "killed").collect()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // Sandboxes a failed test left running in its own home, while the home's ledger still names them.
        if let Home::Temp(t) = &self.home {
            let _ =
                Command::new(self.bin_dir.join("clade")).args(["kill", "--all"]).env("CLADE_HOME", t.path()).output();
        }
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
    write_archive(path, name, layer(entries), cmd)
}

fn write_archive(path: &Path, name: &str, layer: Vec<u8>, cmd: &[&str]) {
    let mut blobs: Vec<(String, Vec<u8>)> = vec![];
    let mut add = |b: Vec<u8>| {
        let d = format!("{:x}", Sha256::digest(&b));
        let size = b.len();
        blobs.push((d.clone(), b));
        (d, size)
    };
    let (ld, lsize) = add(layer);
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

/// A CRI client over containerd's socket, blocking (its own current-thread runtime).
pub struct Cri {
    pub rt: tokio::runtime::Runtime,
    pub client: RuntimeServiceClient<Channel>,
}

impl Cri {
    pub fn connect(c: &Containerd) -> Cri {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let path = c.socket();
        let channel = rt
            .block_on(Endpoint::try_from("http://[::]").unwrap().connect_with_connector(tower::service_fn(
                move |_: Uri| {
                    let path = path.clone();
                    async move {
                        Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                            tokio::net::UnixStream::connect(path).await?,
                        ))
                    }
                },
            )))
            .expect("connect to containerd's CRI");
        Cri { rt, client: RuntimeServiceClient::new(channel) }
    }

    pub fn pod_config(name: &str, annotations: &[(&str, &str)]) -> PodSandboxConfig {
        PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: name.into(),
                uid: format!("uid-{name}"),
                namespace: "default".into(),
                attempt: 0,
            }),
            annotations: annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            linux: Some(LinuxPodSandboxConfig {
                security_context: Some(LinuxSandboxSecurityContext {
                    // The node's network: no CNI on these machines (clade gives the sandbox its own anyway).
                    namespace_options: Some(NamespaceOption {
                        network: NamespaceMode::Node as i32,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    pub fn run_pod(&mut self, config: &PodSandboxConfig) -> Result<String, tonic::Status> {
        self.run_pod_on(config, "clade")
    }

    /// RunPodSandbox with a runtime handler (`clade`, or `runc` for the peer).
    pub fn run_pod_on(&mut self, config: &PodSandboxConfig, handler: &str) -> Result<String, tonic::Status> {
        let req = RunPodSandboxRequest { config: Some(config.clone()), runtime_handler: handler.into() };
        Ok(self.rt.block_on(self.client.run_pod_sandbox(req))?.into_inner().pod_sandbox_id)
    }

    pub fn create(
        &mut self,
        pod: &str,
        config: &PodSandboxConfig,
        name: &str,
        image: &str,
        cmd: &[&str],
    ) -> Result<String, tonic::Status> {
        self.create_mounted(pod, config, name, image, cmd, &[])
    }

    /// CreateContainer with volumes: (host path, container path, read-only), as a kubelet passes them.
    pub fn create_mounted(
        &mut self,
        pod: &str,
        config: &PodSandboxConfig,
        name: &str,
        image: &str,
        cmd: &[&str],
        volumes: &[(&Path, &str, bool)],
    ) -> Result<String, tonic::Status> {
        let mounts = volumes
            .iter()
            .map(|(host, inside, readonly)| Mount {
                container_path: inside.to_string(),
                host_path: host.display().to_string(),
                readonly: *readonly,
                ..Default::default()
            })
            .collect();
        let container = ContainerConfig { mounts, ..Cri::container(name, image, cmd) };
        self.create_config(pod, config, container)
    }

    /// A container's config: its name, image and command.
    pub fn container(name: &str, image: &str, cmd: &[&str]) -> ContainerConfig {
        ContainerConfig {
            metadata: Some(ContainerMetadata { name: name.into(), attempt: 0 }),
            image: Some(ImageSpec { image: image.into(), ..Default::default() }),
            command: cmd.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    /// CreateContainer with `container` as the kubelet would send it (a security context, say).
    pub fn create_config(
        &mut self,
        pod: &str,
        config: &PodSandboxConfig,
        container: ContainerConfig,
    ) -> Result<String, tonic::Status> {
        let req = CreateContainerRequest {
            pod_sandbox_id: pod.into(),
            config: Some(container),
            sandbox_config: Some(config.clone()),
        };
        Ok(self.rt.block_on(self.client.create_container(req))?.into_inner().container_id)
    }

    pub fn start(&mut self, id: &str) {
        self.try_start(id).expect("StartContainer");
    }

    /// StartContainer: where the runtime's Create and Start happen (CreateContainer only records the container).
    pub fn try_start(&mut self, id: &str) -> Result<(), tonic::Status> {
        self.rt.block_on(self.client.start_container(StartContainerRequest { container_id: id.into() }))?;
        Ok(())
    }

    pub fn exec_sync(&mut self, id: &str, cmd: &[&str]) -> (i32, String, String) {
        let req =
            ExecSyncRequest { container_id: id.into(), cmd: cmd.iter().map(|s| s.to_string()).collect(), timeout: 30 };
        let r = self.rt.block_on(self.client.exec_sync(req)).expect("ExecSync").into_inner();
        (r.exit_code, String::from_utf8_lossy(&r.stdout).into_owned(), String::from_utf8_lossy(&r.stderr).into_owned())
    }

    pub fn status(&mut self, id: &str) -> ContainerStatus {
        let req = ContainerStatusRequest { container_id: id.into(), verbose: false };
        self.rt.block_on(self.client.container_status(req)).expect("ContainerStatus").into_inner().status.unwrap()
    }

    /// ContainerStats: (CPU time used, ns; working set, bytes).
    pub fn stats(&mut self, id: &str) -> (u64, u64) {
        let req = ContainerStatsRequest { container_id: id.into() };
        let s = self.rt.block_on(self.client.container_stats(req)).expect("ContainerStats").into_inner().stats.unwrap();
        let cpu = s.cpu.and_then(|c| c.usage_core_nano_seconds).map_or(0, |v| v.value);
        let mem = s.memory.and_then(|m| m.working_set_bytes).map_or(0, |v| v.value);
        (cpu, mem)
    }

    pub fn stop_and_remove(&mut self, pod: &str) {
        let id = pod.to_string();
        self.rt
            .block_on(self.client.stop_pod_sandbox(StopPodSandboxRequest { pod_sandbox_id: id.clone() }))
            .expect("StopPodSandbox");
        self.rt
            .block_on(self.client.remove_pod_sandbox(RemovePodSandboxRequest { pod_sandbox_id: id }))
            .expect("RemovePodSandbox");
    }
}

/// containerd's config for the CRI plugin: runtime handlers `clade` (the shim, passing clade's annotations on)
/// and `runc` (the CRI plugin wants its default runtime defined; the bench's peer); `sandbox_image` the pods'
/// own image (imported by the caller: nothing is pulled); `restrict_oom_score_adj`: where containerd itself runs
/// without CAP_SYS_RESOURCE (as in a container), runc could not lower a pod's OOM score to the -998 asked for.
pub fn cri_config(sandbox_image: &str) -> String {
    format!(
        "[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"{sandbox_image}\"\n  restrict_oom_score_adj = true\n\
         [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n  runtime_type = \"io.containerd.runc.v2\"\n\
         [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.clade]\n  runtime_type = \"io.containerd.clade.v2\"\n\
         \x20 pod_annotations = [\"clade.dev/*\"]\n  container_annotations = [\"clade.dev/*\"]\n"
    )
}

impl Containerd {
    /// Imports an OCI archive into the CRI plugin's namespace (`k8s.io`).
    pub fn import_k8s(&self, archive: &Path) {
        let out = self.ctr_ns("k8s.io", &["image", "import", archive.to_str().unwrap()]);
        assert!(out.status.success(), "import {}: {}", archive.display(), String::from_utf8_lossy(&out.stderr));
    }
}

/// Writes an OCI image archive of one layer holding the directory `rootfs` as it is (modes, owners, links,
/// device nodes), named `name`: a clade template's root filesystem as an image.
pub fn oci_archive_of_dir(path: &Path, name: &str, rootfs: &Path, cmd: &[&str]) {
    let mut b = tar::Builder::new(Vec::new());
    b.mode(tar::HeaderMode::Complete);
    b.follow_symlinks(false);
    b.append_dir_all(".", rootfs).unwrap_or_else(|e| panic!("tar {}: {e}", rootfs.display()));
    write_archive(path, name, b.into_inner().unwrap(), cmd);
}
