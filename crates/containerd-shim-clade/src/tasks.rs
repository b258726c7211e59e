//! The Task service containerd drives: each container is one clade sandbox forked from a mark
//! ([`crate::bundle::origin`]), its process (and every exec) a process the sandbox's agent starts. Exit
//! statuses are kept until containerd deletes the process; `wait` blocks on them; exits are published as
//! containerd's `/tasks/exit` events (what the CRI plugin watches).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use clade_core::backend::BackendKind;
use clade_core::CladeHome;
use clade_host::api::{ForkRequest, MarkRequest, ProcSpec, SandboxApi};
use containerd_shim::api;
use containerd_shim::protos::events::task::{TaskCreate, TaskDelete, TaskExit, TaskStart};
use containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim::protos::protobuf::MessageDyn;
use containerd_shim::protos::topics;
use containerd_shim::protos::ttrpc::{self, context::Context, Code};
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{ExitSignal, TtrpcContext, TtrpcResult};
use oci_spec::runtime::Process;

use crate::bundle::{self, Bundle};
use crate::stdio;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Created,
    Running,
    Stopped,
}

/// One process of a container: its init or an exec.
struct Proc {
    spec: ProcSpec,
    stdin: String,
    stdout: String,
    stderr: String,
    terminal: bool,
    /// The process id inside the sandbox, once started.
    pid: u32,
    phase: Phase,
    exit_status: u32,
    exited_at: Option<Timestamp>,
}

impl Proc {
    /// A process not started yet, with containerd's fifo paths for its stdio (empty: none).
    fn created(spec: ProcSpec, stdin: &str, stdout: &str, stderr: &str, terminal: bool) -> Proc {
        let (stdin, stdout, stderr) = (stdin.to_string(), stdout.to_string(), stderr.to_string());
        Proc { spec, stdin, stdout, stderr, terminal, pid: 0, phase: Phase::Created, exit_status: 0, exited_at: None }
    }
}

struct Container {
    bundle: PathBuf,
    sandbox: String,
    /// The rootfs the shim mounted (unmounted at delete), if it mounted one.
    mounted: Option<PathBuf>,
    init: Proc,
    execs: HashMap<String, Proc>,
}

pub struct Tasks {
    home: CladeHome,
    api: Arc<dyn SandboxApi>,
    backend: BackendKind,
    namespace: String,
    publisher: Mutex<RemotePublisher>,
    exit: Arc<ExitSignal>,
    containers: Mutex<HashMap<String, Container>>,
    changed: Condvar,
}

fn rpc(code: Code, msg: impl ToString) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, msg))
}

fn failed(e: anyhow::Error) -> ttrpc::Error {
    rpc(Code::FAILED_PRECONDITION, format!("{e:#}"))
}

fn proc_spec(p: &Process, rootfs: &std::path::Path) -> anyhow::Result<ProcSpec> {
    let argv: Vec<String> = p.args().clone().unwrap_or_default();
    if argv.first().is_none_or(|a| a.is_empty()) {
        anyhow::bail!("the process has no args: give the container a command (the image has no entrypoint?)");
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
    Ok(ProcSpec { argv, env, cwd, user, pty, stdin: false, ..Default::default() })
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
        Tasks {
            home,
            api,
            backend,
            namespace,
            publisher: Mutex::new(publisher),
            exit,
            containers: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Container>> {
        self.containers.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn publish(&self, topic: &str, event: Box<dyn MessageDyn>) {
        let p = self.publisher.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = p.publish(Context::default(), topic, &self.namespace, event) {
            log::warn!("publish {topic}: {e}");
        }
    }

    fn create_container(&self, req: &api::CreateTaskRequest) -> anyhow::Result<(String, u32)> {
        let b = Bundle::load(std::path::Path::new(&req.bundle))?;
        let rootfs = b.rootfs();
        let mounted = bundle::mount_rootfs(&req.rootfs, &rootfs)?.then(|| rootfs.clone());
        let started = (|| {
            let spec = proc_spec(b.process()?, &rootfs)?;
            let backend = b.backend(self.backend)?;
            let mark = bundle::origin(&self.home, &b, backend, &|l| log::info!("{}: {l}", req.id))?;
            let out = self.api.fork(&ForkRequest::new(mark, Some(backend), 1))?;
            let ready = out.sandboxes.into_iter().next().ok_or_else(|| anyhow::anyhow!("the fork started nothing"))?;
            if !ready.ok {
                anyhow::bail!("the sandbox did not start: {}", ready.error.unwrap_or_default());
            }
            // Recorded in the bundle first thing, so a `delete` after this shim died finds what to take down.
            std::fs::write(b.dir.join(bundle::SANDBOX_FILE), &ready.sandbox)?;
            Ok::<_, anyhow::Error>((spec, ready))
        })();
        let (spec, ready) = match started {
            Ok(s) => s,
            Err(e) => {
                if let Some(m) = &mounted {
                    bundle::unmount_rootfs(m);
                }
                return Err(e);
            }
        };
        let init = Proc::created(spec, &req.stdin, &req.stdout, &req.stderr, req.terminal);
        let c = Container { bundle: b.dir, sandbox: ready.sandbox.clone(), mounted, init, execs: HashMap::new() };
        self.lock().insert(req.id.clone(), c);
        Ok((ready.sandbox, ready.pid))
    }

    /// Starts a created process: its stdio connected, a thread that waits for its exit.
    fn start_proc(self: &Arc<Self>, id: &str, exec_id: &str) -> TtrpcResult<u32> {
        let (sandbox, mut spec, stdin, stdout, stderr) = {
            let mut map = self.lock();
            let c = map.get_mut(id).ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {id}")))?;
            let sandbox = c.sandbox.clone();
            let p = proc_of(c, exec_id)?;
            if p.phase != Phase::Created {
                return Err(rpc(Code::FAILED_PRECONDITION, format!("process {id}/{exec_id} was already started")));
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
        {
            let mut map = self.lock();
            if let Some(p) = map.get_mut(id).and_then(|c| proc_of(c, exec_id).ok()) {
                p.pid = pid;
                p.phase = Phase::Running;
            }
        }
        let (id, exec_id) = (id.to_string(), exec_id.to_string());
        let me = self.clone();
        std::thread::spawn(move || {
            let status = stdio::copy_out(events, out, err);
            me.exited(&id, &exec_id, pid, status);
        });
        Ok(pid)
    }

    fn exited(&self, id: &str, exec_id: &str, pid: u32, status: u32) {
        let at = Timestamp::now();
        {
            let mut map = self.lock();
            if let Some(p) = map.get_mut(id).and_then(|c| proc_of(c, exec_id).ok()) {
                p.phase = Phase::Stopped;
                p.exit_status = status;
                p.exited_at = Some(at.clone());
            }
        }
        self.changed.notify_all();
        let exec = if exec_id.is_empty() { id } else { exec_id };
        self.publish(
            topics::TASK_EXIT_EVENT_TOPIC,
            Box::new(TaskExit {
                container_id: id.into(),
                id: exec.into(),
                pid,
                exit_status: status,
                exited_at: Some(at).into(),
                ..Default::default()
            }),
        );
    }
}

fn proc_of<'a>(c: &'a mut Container, exec_id: &str) -> TtrpcResult<&'a mut Proc> {
    if exec_id.is_empty() {
        return Ok(&mut c.init);
    }
    c.execs.get_mut(exec_id).ok_or_else(|| rpc(Code::NOT_FOUND, format!("no exec {exec_id}")))
}

fn status_of(p: Phase) -> api::Status {
    match p {
        Phase::Created => api::Status::CREATED,
        Phase::Running => api::Status::RUNNING,
        Phase::Stopped => api::Status::STOPPED,
    }
}

/// What ttrpc serves: the shared service.
pub struct Service(pub Arc<Tasks>);

impl containerd_shim::Task for Service {
    fn connect(&self, _: &TtrpcContext, _: api::ConnectRequest) -> TtrpcResult<api::ConnectResponse> {
        Ok(api::ConnectResponse { shim_pid: std::process::id(), version: "clade".into(), ..Default::default() })
    }

    fn create(&self, _: &TtrpcContext, req: api::CreateTaskRequest) -> TtrpcResult<api::CreateTaskResponse> {
        let t = &self.0;
        if t.lock().contains_key(&req.id) {
            return Err(rpc(Code::ALREADY_EXISTS, format!("container {} exists", req.id)));
        }
        let (sandbox, pid) = t.create_container(&req).map_err(failed)?;
        log::info!("container {} is clade sandbox {sandbox}", req.id);
        t.publish(
            topics::TASK_CREATE_EVENT_TOPIC,
            Box::new(TaskCreate {
                container_id: req.id.clone(),
                bundle: req.bundle.clone(),
                pid,
                ..Default::default()
            }),
        );
        Ok(api::CreateTaskResponse { pid, ..Default::default() })
    }

    fn start(&self, _: &TtrpcContext, req: api::StartRequest) -> TtrpcResult<api::StartResponse> {
        let pid = self.0.start_proc(&req.id, &req.exec_id)?;
        if req.exec_id.is_empty() {
            self.0.publish(
                topics::TASK_START_EVENT_TOPIC,
                Box::new(TaskStart { container_id: req.id.clone(), pid, ..Default::default() }),
            );
        }
        Ok(api::StartResponse { pid, ..Default::default() })
    }

    fn exec(&self, _: &TtrpcContext, req: api::ExecProcessRequest) -> TtrpcResult<api::Empty> {
        let process: Process = serde_json::from_slice(&req.spec.value).map_err(|e| {
            rpc(Code::INVALID_ARGUMENT, format!("exec {}: the process spec is not OCI JSON: {e}", req.exec_id))
        })?;
        let mut map = self.0.lock();
        let c = map.get_mut(&req.id).ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {}", req.id)))?;
        if c.execs.contains_key(&req.exec_id) {
            return Err(rpc(Code::ALREADY_EXISTS, format!("exec {} exists", req.exec_id)));
        }
        let rootfs = Bundle::load(&c.bundle).map(|b| b.rootfs()).map_err(failed)?;
        let spec = proc_spec(&process, &rootfs).map_err(|e| rpc(Code::INVALID_ARGUMENT, format!("{e:#}")))?;
        c.execs.insert(req.exec_id.clone(), Proc::created(spec, &req.stdin, &req.stdout, &req.stderr, req.terminal));
        Ok(api::Empty::new())
    }

    fn state(&self, _: &TtrpcContext, req: api::StateRequest) -> TtrpcResult<api::StateResponse> {
        let mut map = self.0.lock();
        let c = map.get_mut(&req.id).ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {}", req.id)))?;
        let bundle = c.bundle.display().to_string();
        let p = proc_of(c, &req.exec_id)?;
        Ok(api::StateResponse {
            id: if req.exec_id.is_empty() { req.id.clone() } else { req.exec_id.clone() },
            bundle,
            pid: p.pid,
            status: status_of(p.phase).into(),
            stdin: p.stdin.clone(),
            stdout: p.stdout.clone(),
            stderr: p.stderr.clone(),
            terminal: p.terminal,
            exit_status: p.exit_status,
            exited_at: p.exited_at.clone().into(),
            exec_id: req.exec_id.clone(),
            ..Default::default()
        })
    }

    fn kill(&self, _: &TtrpcContext, req: api::KillRequest) -> TtrpcResult<api::Empty> {
        let (sandbox, pid, phase) = {
            let mut map = self.0.lock();
            let c = map.get_mut(&req.id).ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {}", req.id)))?;
            let sandbox = c.sandbox.clone();
            let p = proc_of(c, &req.exec_id)?;
            (sandbox, p.pid, p.phase)
        };
        match phase {
            Phase::Stopped => Err(rpc(Code::NOT_FOUND, "process already finished")),
            Phase::Created => {
                // Never started: it ends here, as killed by the signal.
                self.0.exited(&req.id, &req.exec_id, 0, 128 + req.signal);
                Ok(api::Empty::new())
            }
            Phase::Running => {
                self.0.api.proc_signal(&sandbox, pid, req.signal as i32).map_err(failed)?;
                Ok(api::Empty::new())
            }
        }
    }

    fn wait(&self, _: &TtrpcContext, req: api::WaitRequest) -> TtrpcResult<api::WaitResponse> {
        let mut map = self.0.lock();
        loop {
            let c = map.get_mut(&req.id).ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {}", req.id)))?;
            let p = proc_of(c, &req.exec_id)?;
            if p.phase == Phase::Stopped {
                return Ok(api::WaitResponse {
                    exit_status: p.exit_status,
                    exited_at: p.exited_at.clone().into(),
                    ..Default::default()
                });
            }
            map = self.0.changed.wait(map).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn delete(&self, _: &TtrpcContext, req: api::DeleteRequest) -> TtrpcResult<api::DeleteResponse> {
        let t = &self.0;
        if !req.exec_id.is_empty() {
            let mut map = t.lock();
            let c = map.get_mut(&req.id).ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {}", req.id)))?;
            let p =
                c.execs.remove(&req.exec_id).ok_or_else(|| rpc(Code::NOT_FOUND, format!("no exec {}", req.exec_id)))?;
            return Ok(api::DeleteResponse {
                pid: p.pid,
                exit_status: p.exit_status,
                exited_at: p.exited_at.into(),
                ..Default::default()
            });
        }
        let c = t.lock().remove(&req.id).ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {}", req.id)))?;
        if let Err(e) = t.api.kill(&c.sandbox) {
            log::warn!("kill sandbox {} of container {}: {e:#}", c.sandbox, req.id);
        }
        if let Some(m) = &c.mounted {
            bundle::unmount_rootfs(m);
        }
        let _ = std::fs::remove_file(c.bundle.join(bundle::SANDBOX_FILE));
        t.changed.notify_all();
        let exited_at = c.init.exited_at.clone().unwrap_or_else(Timestamp::now);
        t.publish(
            topics::TASK_DELETE_EVENT_TOPIC,
            Box::new(TaskDelete {
                container_id: req.id.clone(),
                pid: c.init.pid,
                exit_status: c.init.exit_status,
                exited_at: Some(exited_at.clone()).into(),
                ..Default::default()
            }),
        );
        Ok(api::DeleteResponse {
            pid: c.init.pid,
            exit_status: c.init.exit_status,
            exited_at: Some(exited_at).into(),
            ..Default::default()
        })
    }

    fn pids(&self, _: &TtrpcContext, req: api::PidsRequest) -> TtrpcResult<api::PidsResponse> {
        let sandbox = self.0.lock().get(&req.id).map(|c| c.sandbox.clone());
        let sandbox = sandbox.ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {}", req.id)))?;
        let procs = self.0.api.proc_list(&sandbox).map_err(failed)?;
        let processes = procs
            .into_iter()
            .map(|p| containerd_shim::protos::api::ProcessInfo { pid: p.pid, ..Default::default() })
            .collect();
        Ok(api::PidsResponse { processes, ..Default::default() })
    }

    fn resize_pty(&self, _: &TtrpcContext, req: api::ResizePtyRequest) -> TtrpcResult<api::Empty> {
        let (sandbox, pid) = self.sandbox_pid(&req.id, &req.exec_id)?;
        self.0.api.proc_resize(&sandbox, pid, req.height as u16, req.width as u16).map_err(failed)?;
        Ok(api::Empty::new())
    }

    fn close_io(&self, _: &TtrpcContext, req: api::CloseIORequest) -> TtrpcResult<api::Empty> {
        if req.stdin {
            let (sandbox, pid) = self.sandbox_pid(&req.id, &req.exec_id)?;
            self.0.api.proc_close_stdin(&sandbox, pid).map_err(failed)?;
        }
        Ok(api::Empty::new())
    }

    fn checkpoint(&self, _: &TtrpcContext, req: api::CheckpointTaskRequest) -> TtrpcResult<api::Empty> {
        let sandbox = self.0.lock().get(&req.id).map(|c| c.sandbox.clone());
        let sandbox = sandbox.ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {}", req.id)))?;
        let mark = self.0.api.mark(&sandbox, &MarkRequest::default()).map_err(failed)?;
        log::info!("container {}: marked {}", req.id, mark.id);
        Ok(api::Empty::new())
    }

    fn pause(&self, _: &TtrpcContext, _: api::PauseRequest) -> TtrpcResult<api::Empty> {
        Err(rpc(Code::UNIMPLEMENTED, "clade's shim does not pause a task yet: checkpoint it (a clade mark) instead"))
    }

    fn resume(&self, _: &TtrpcContext, _: api::ResumeRequest) -> TtrpcResult<api::Empty> {
        Err(rpc(Code::UNIMPLEMENTED, "clade's shim does not pause a task yet, so there is nothing to resume"))
    }

    fn shutdown(&self, _: &TtrpcContext, _: api::ShutdownRequest) -> TtrpcResult<api::Empty> {
        if self.0.lock().is_empty() {
            self.0.exit.signal();
        }
        Ok(api::Empty::new())
    }
}

impl Service {
    fn sandbox_pid(&self, id: &str, exec_id: &str) -> TtrpcResult<(String, u32)> {
        let mut map = self.0.lock();
        let c = map.get_mut(id).ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {id}")))?;
        let sandbox = c.sandbox.clone();
        let p = proc_of(c, exec_id)?;
        if p.phase != Phase::Running {
            return Err(rpc(Code::FAILED_PRECONDITION, format!("process {id}/{exec_id} is not running")));
        }
        Ok((sandbox, p.pid))
    }
}
