//! What the shim holds: its containers, the pods they form, and the processes of each, with the operations that
//! change them (create, start, exit). The Task service ([`crate::tasks`]) is a thin face over these.
//!
//! The Kata model: a pod is one clade sandbox, and each of its containers is a process group the sandbox's agent
//! starts. containerd's CRI plugin first creates the pod's own container (the "pause" container, [`Role::Pod`]);
//! its process is nominal here (no pause binary runs: the sandbox itself holds the pod). The pod's sandbox is
//! forked when the pod's annotations name a mark or template, else from the first container's image, whose
//! content then is the pod's: a later container of the same image content runs on the sandbox's own root; a
//! container of other content gets its image's root file system shown inside the pod's sandbox
//! (`SandboxApi::attach_root`, ct) and its processes run `chroot`ed there, sharing the pod's network, IPC and
//! limits (docs/kubernetes.md, "Pods of several images"). A container outside any pod (`ctr run`,
//! [`Role::Single`]) has a sandbox of its own.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use anyhow::{anyhow, bail};
use clade_core::backend::{BackendKind, GroupOp};
use clade_core::CladeHome;
use clade_host::api::{ForkRequest, ProcSpec, SandboxApi};
use containerd_shim::api;
use containerd_shim::protos::events::task::TaskExit;
use containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim::protos::protobuf::MessageDyn;
use containerd_shim::protos::topics;
use containerd_shim::protos::ttrpc::{self, context::Context, Code};
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{ExitSignal, TtrpcResult};
use oci_spec::runtime::Process;

use crate::bundle::{self, Bundle, Role};
use crate::stdio;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Phase {
    Created,
    Running,
    Stopped,
}

/// One process of a container: its init or an exec.
pub struct Proc {
    pub spec: ProcSpec,
    pub stdin: String,
    pub stdout: String,
    pub stderr: String,
    pub terminal: bool,
    /// The process id inside the sandbox, once started (the shim's own pid for a pod's nominal process).
    pub pid: u32,
    pub phase: Phase,
    pub exit_status: u32,
    pub exited_at: Option<Timestamp>,
    /// A pod container's process: nothing runs; a signal ends it.
    pub nominal: bool,
}

impl Proc {
    /// A process not started yet, with containerd's fifo paths for its stdio (empty: none).
    pub fn created(spec: ProcSpec, stdin: &str, stdout: &str, stderr: &str, terminal: bool) -> Proc {
        let (stdin, stdout, stderr) = (stdin.to_string(), stdout.to_string(), stderr.to_string());
        let (pid, phase, exit_status, exited_at, nominal) = (0, Phase::Created, 0, None, false);
        Proc { spec, stdin, stdout, stderr, terminal, pid, phase, exit_status, exited_at, nominal }
    }
}

pub struct Container {
    pub bundle: PathBuf,
    pub role: Role,
    /// The sandbox its processes run in ("" for a pod whose sandbox waits for its first container).
    pub sandbox: String,
    /// The rootfs the shim mounted (unmounted at delete), if it mounted one.
    pub mounted: Option<PathBuf>,
    pub init: Proc,
    pub execs: HashMap<String, Proc>,
    /// Paused by containerd (its sandbox frozen).
    pub paused: bool,
    /// Where its own image's root file system is shown inside the pod's sandbox (a member of another image
    /// than the pod's); its processes run with it as their root.
    pub root: Option<String>,
}

impl Container {
    /// The pids (inside the sandbox) of its running processes, its init's and its execs': each leads a group
    /// of processes in the sandbox (`SandboxApi::proc_group`), which together are the container's.
    pub fn leaders(&self) -> Vec<u32> {
        std::iter::once(&self.init)
            .chain(self.execs.values())
            .filter(|p| p.phase == Phase::Running && !p.nominal && p.pid > 0)
            .map(|p| p.pid)
            .collect()
    }

    pub fn proc(&mut self, exec_id: &str) -> TtrpcResult<&mut Proc> {
        if exec_id.is_empty() {
            return Ok(&mut self.init);
        }
        self.execs.get_mut(exec_id).ok_or_else(|| rpc(Code::NOT_FOUND, format!("no exec {exec_id}")))
    }
}

/// A pod: the sandbox its containers share, once there is one, and the image content it was made from.
#[derive(Default)]
pub struct Pod {
    pub sandbox: Option<String>,
    pub content: Option<String>,
    /// Whether the pod's annotations chose its sandbox (its containers' images do not matter then).
    pub named: bool,
}

#[derive(Default)]
pub struct Held {
    pub containers: HashMap<String, Container>,
    pub pods: HashMap<String, Pod>,
}

pub struct Tasks {
    pub home: CladeHome,
    pub api: Arc<dyn SandboxApi>,
    pub backend: BackendKind,
    namespace: String,
    publisher: Mutex<RemotePublisher>,
    pub exit: Arc<ExitSignal>,
    held: Mutex<Held>,
    pub changed: Condvar,
}

pub fn rpc(code: Code, msg: impl ToString) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, msg))
}

pub fn failed(e: anyhow::Error) -> ttrpc::Error {
    rpc(Code::FAILED_PRECONDITION, format!("{e:#}"))
}

pub fn proc_spec(p: &Process, rootfs: &std::path::Path) -> anyhow::Result<ProcSpec> {
    let argv: Vec<String> = p.args().clone().unwrap_or_default();
    if argv.first().is_none_or(|a| a.is_empty()) {
        bail!("the process has no args: give the container a command (the image has no entrypoint?)");
    }
    let env = p
        .env()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
        .collect();
    let cwd = Some(p.cwd().display().to_string()).filter(|c| c != "/" && !c.is_empty());
    let user = bundle::user_name(rootfs, p.user().uid())?;
    let pty = p
        .terminal()
        .unwrap_or(false)
        .then(|| p.console_size().as_ref().map_or((24, 80), |b| (b.height() as u16, b.width() as u16)));
    // The process's bounding set and no_new_privs, on top of the sandbox's jail (docs/kubernetes.md): the agent
    // can only take capabilities away, so asking for more than the jail holds gives the jail's.
    let caps = p.capabilities().as_ref().and_then(|c| c.bounding().as_ref()).map(|set| {
        let mut names: Vec<String> = set.iter().map(|c| format!("CAP_{c}")).collect();
        names.sort();
        names
    });
    let no_new_privs = p.no_new_privileges().unwrap_or(false);
    Ok(ProcSpec { argv, env, cwd, user, pty, stdin: false, caps, no_new_privs, ..Default::default() })
}

impl Tasks {
    pub fn new(
        home: CladeHome,
        api: Arc<dyn SandboxApi>,
        backend: BackendKind,
        namespace: String,
        publisher: RemotePublisher,
        exit: Arc<ExitSignal>,
    ) -> Tasks {
        let publisher = Mutex::new(publisher);
        let (held, changed) = (Mutex::new(Held::default()), Condvar::new());
        Tasks { home, api, backend, namespace, publisher, exit, held, changed }
    }

    pub fn lock(&self) -> MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn publish(&self, topic: &str, event: Box<dyn MessageDyn>) {
        let p = self.publisher.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = p.publish(Context::default(), topic, &self.namespace, event) {
            log::warn!("publish {topic}: {e}");
        }
    }

    /// Forks one sandbox from `origin` and records it in `owner_bundle` first thing, so a `delete` after this
    /// shim died finds what to take down.
    fn fork(&self, b: &Bundle, owner_bundle: &std::path::Path) -> anyhow::Result<(String, bundle::Origin)> {
        let backend = b.backend(self.backend)?;
        let t0 = std::time::Instant::now();
        let origin = bundle::origin(&self.home, b, backend, &|l| log::info!("{}: {l}", b.dir.display()))?;
        let t1 = std::time::Instant::now();
        let out = self.api.fork(&ForkRequest::new(origin.mark.clone(), Some(backend), 1))?;
        log::info!("{}: origin {} in {:?}, forked in {:?}", b.dir.display(), origin.mark, t1 - t0, t1.elapsed());
        let ready = out.sandboxes.into_iter().next().ok_or_else(|| anyhow!("the fork started nothing"))?;
        if !ready.ok {
            bail!("the sandbox did not start: {}", ready.error.unwrap_or_default());
        }
        std::fs::write(owner_bundle.join(bundle::SANDBOX_FILE), &ready.sandbox)?;
        Ok((ready.sandbox, origin))
    }

    /// The sandbox a pod's container runs in: the pod's, made from this container's image when the pod has
    /// none yet; with the root inside it where the container's image is not the pod's (its rootfs attached as
    /// the root named `id`).
    fn pod_sandbox(&self, pod_id: &str, id: &str, b: &Bundle) -> anyhow::Result<(String, Option<String>)> {
        let (existing, content, named, pod_bundle) = {
            let held = self.lock();
            let pod = held.pods.get(pod_id).ok_or_else(|| {
                anyhow!("pod {pod_id} is not held by this shim (its sandbox container was not created here)")
            })?;
            let pod_bundle = held.containers.get(pod_id).map(|c| c.bundle.clone());
            (pod.sandbox.clone(), pod.content.clone(), pod.named, pod_bundle)
        };
        if let Some(sandbox) = existing {
            if named || content.as_deref() == Some(b.content(&self.home)?.as_str()) {
                return Ok((sandbox, None));
            }
            let root = self.api.attach_root(&sandbox, id, &b.rootfs()).map_err(|e| {
                e.context(format!(
                    "container {id} has another image than its pod {pod_id}, whose sandbox would show that image's \
                     root file system (or name a mark or template for the pod with the annotation {})",
                    bundle::MARK_ANNOTATION
                ))
            })?;
            log::info!("{}: the image's root is {root} in the pod's sandbox {sandbox}", b.dir.display());
            return Ok((sandbox, Some(root)));
        }
        let (sandbox, origin) = self.fork(b, pod_bundle.as_deref().unwrap_or(&b.dir))?;
        let mut held = self.lock();
        let pod = held.pods.entry(pod_id.to_string()).or_default();
        pod.sandbox = Some(sandbox.clone());
        pod.content = origin.content;
        if let Some(c) = held.containers.get_mut(pod_id) {
            c.sandbox = sandbox.clone();
        }
        Ok((sandbox, None))
    }

    pub fn create_container(&self, req: &api::CreateTaskRequest) -> anyhow::Result<(String, u32)> {
        let mut b = Bundle::load(std::path::Path::new(&req.bundle))?;
        b.layers = bundle::layers_key(&req.rootfs);
        let rootfs = b.rootfs();
        let mounted = bundle::mount_rootfs(&req.rootfs, &rootfs)?.then(|| rootfs.clone());
        let role = b.role();
        let started = (|| {
            if role == Role::Pod {
                let mut pod = Pod { named: b.names_origin(), ..Pod::default() };
                if pod.named {
                    let (sandbox, _) = self.fork(&b, &b.dir)?;
                    pod.sandbox = Some(sandbox);
                }
                let sandbox = pod.sandbox.clone().unwrap_or_default();
                self.lock().pods.insert(req.id.clone(), pod);
                return Ok((ProcSpec::default(), sandbox));
            }
            let mut spec = proc_spec(b.process()?, &rootfs)?;
            let (sandbox, root) = match &role {
                Role::Member(pod) => self.pod_sandbox(pod, &req.id, &b)?,
                _ => (self.fork(&b, &b.dir)?.0, None),
            };
            // The spec's volumes, under the container's own root where it has one.
            for v in b.volumes() {
                let inside = match &root {
                    Some(r) => format!("{r}{}", v.destination),
                    None => v.destination.clone(),
                };
                match self.api.bind(&sandbox, &v.source, &inside, v.readonly) {
                    Ok(()) => {}
                    // A sandbox that cannot show a host path (a vm base whose agent is too old to mount its copy)
                    // runs the container without it, as every pod has a service-account token volume
                    // (docs/kubernetes.md).
                    Err(e) if clade_host::error::kind(&e) == clade_core::ErrorKind::Invalid => {
                        log::warn!(
                            "container {}: volume {} not mounted at {}: {e:#}",
                            req.id,
                            v.source.display(),
                            v.destination
                        )
                    }
                    Err(e) => {
                        return Err(e.context(format!(
                            "mount the volume {} at {} of container {}",
                            v.source.display(),
                            v.destination,
                            req.id
                        )))
                    }
                }
            }
            spec.root = root;
            Ok::<_, anyhow::Error>((spec, sandbox))
        })();
        let (spec, sandbox) = match started {
            Ok(s) => s,
            Err(e) => {
                if let Some(m) = &mounted {
                    bundle::unmount_rootfs(m);
                }
                return Err(e);
            }
        };
        let root = spec.root.clone();
        let mut init = Proc::created(spec, &req.stdin, &req.stdout, &req.stderr, req.terminal);
        init.nominal = role == Role::Pod;
        let execs = HashMap::new();
        let c = Container { bundle: b.dir, role, sandbox: sandbox.clone(), mounted, init, execs, paused: false, root };
        self.lock().containers.insert(req.id.clone(), c);
        Ok((sandbox, 0))
    }

    /// Starts a created process: its stdio connected, a thread that waits for its exit.
    pub fn start_proc(self: &Arc<Self>, id: &str, exec_id: &str) -> TtrpcResult<u32> {
        let (sandbox, mut spec, stdin, stdout, stderr) = {
            let mut held = self.lock();
            let c = held.containers.get_mut(id).ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {id}")))?;
            let sandbox = c.sandbox.clone();
            let p = c.proc(exec_id)?;
            if p.phase != Phase::Created {
                return Err(rpc(Code::FAILED_PRECONDITION, format!("process {id}/{exec_id} was already started")));
            }
            if p.nominal {
                p.pid = std::process::id();
                p.phase = Phase::Running;
                return Ok(p.pid);
            }
            if sandbox.is_empty() {
                return Err(rpc(Code::FAILED_PRECONDITION, format!("container {id} has no sandbox to run in")));
            }
            (sandbox, p.spec.clone(), p.stdin.clone(), p.stdout.clone(), p.stderr.clone())
        };
        spec.stdin = !stdin.is_empty();
        let out = stdio::open_output(&stdout).map_err(failed)?;
        let err = if stderr == stdout { None } else { stdio::open_output(&stderr).map_err(failed)? };
        let (pid, events) = self.api.proc_start(&sandbox, spec).map_err(failed)?;
        if !stdin.is_empty() {
            stdio::copy_in(self.api.clone(), sandbox.clone(), pid, stdin);
        }
        if let Some(p) = self.lock().containers.get_mut(id).and_then(|c| c.proc(exec_id).ok()) {
            p.pid = pid;
            p.phase = Phase::Running;
        }
        let (id, exec_id) = (id.to_string(), exec_id.to_string());
        let me = self.clone();
        std::thread::spawn(move || {
            let status = stdio::copy_out(events, out, err);
            me.exited(&id, &exec_id, pid, status);
        });
        Ok(pid)
    }

    pub fn exited(&self, id: &str, exec_id: &str, pid: u32, status: u32) {
        let at = Timestamp::now();
        let mut member_of = None;
        if let Some(c) = self.lock().containers.get_mut(id) {
            if let Ok(p) = c.proc(exec_id) {
                p.phase = Phase::Stopped;
                p.exit_status = status;
                p.exited_at = Some(at.clone());
            }
            if exec_id.is_empty() && matches!(c.role, Role::Member(_)) {
                member_of = Some((c.sandbox.clone(), c.leaders()));
            }
        }
        // A pod member's process ended: what it left running in the pod's sandbox ends too, its execs included,
        // as the end of a container's pid namespace takes them on runc.
        if let Some((sandbox, execs)) = member_of {
            for leader in std::iter::once(pid).chain(execs) {
                match self.api.proc_group(&sandbox, leader, GroupOp::Kill) {
                    Ok(0) => {}
                    Ok(n) => log::info!("container {id} ended: {n} of its processes left in the pod's sandbox killed"),
                    Err(e) => log::warn!("end what container {id} left in its pod's sandbox: {e:#}"),
                }
            }
        }
        self.changed.notify_all();
        let exec = if exec_id.is_empty() { id } else { exec_id };
        let exited_at = Some(at).into();
        let (container_id, id) = (id.into(), exec.into());
        let event = TaskExit { container_id, id, pid, exit_status: status, exited_at, ..Default::default() };
        self.publish(topics::TASK_EXIT_EVENT_TOPIC, Box::new(event));
    }

    /// Takes a deleted container down: a single container's or a pod's sandbox is killed; a pod member's
    /// process still running is killed in the pod's sandbox.
    pub fn take_down(&self, id: &str, c: &Container) {
        let sandbox = match &c.role {
            Role::Single => Some(c.sandbox.clone()),
            Role::Pod => self.lock().pods.remove(id).and_then(|p| p.sandbox),
            Role::Member(_) => {
                if c.init.phase == Phase::Running {
                    let group = self.api.proc_group(&c.sandbox, c.init.pid, GroupOp::Kill);
                    if let Err(e) = group.or_else(|_| self.api.proc_signal(&c.sandbox, c.init.pid, 9).map(|()| 1)) {
                        log::warn!("kill the process of container {id}: {e:#}");
                    }
                }
                if c.root.is_some() {
                    if let Err(e) = self.api.detach_root(&c.sandbox, id) {
                        log::warn!("detach the root of container {id}: {e:#}");
                    }
                }
                None
            }
        };
        if let Some(s) = sandbox.filter(|s| !s.is_empty()) {
            if let Err(e) = self.api.kill(&s) {
                log::warn!("kill sandbox {s} of container {id}: {e:#}");
            }
            let _ = std::fs::remove_file(c.bundle.join(bundle::SANDBOX_FILE));
        }
        if let Some(m) = &c.mounted {
            bundle::unmount_rootfs(m);
        }
    }
}
