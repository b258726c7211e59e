//! The Task service containerd drives, over the shim's state ([`crate::state`]): each call finds the container
//! and process it names and does one thing to them. Exit statuses are kept until containerd deletes the process;
//! `wait` blocks on them; exits are published as containerd's `/tasks/exit` events (what the CRI plugin watches).

use std::sync::Arc;

use clade_host::api::MarkRequest;
use containerd_shim::api;
use containerd_shim::protos::events::task::{TaskCreate, TaskDelete, TaskPaused, TaskResumed, TaskStart};
use containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim::protos::topics;
use containerd_shim::protos::ttrpc::Code;
use containerd_shim::{TtrpcContext, TtrpcResult};
use oci_spec::runtime::Process;

use crate::bundle::{Bundle, Role};
use crate::state::{failed, proc_spec, rpc, Phase, Proc, Tasks};
use clade_core::backend::GroupOp;

/// What ttrpc serves: the shared service.
pub struct Service(pub Arc<Tasks>);

impl containerd_shim::Task for Service {
    fn connect(&self, _: &TtrpcContext, _: api::ConnectRequest) -> TtrpcResult<api::ConnectResponse> {
        Ok(api::ConnectResponse { shim_pid: std::process::id(), version: "clade".into(), ..Default::default() })
    }

    fn create(&self, _: &TtrpcContext, req: api::CreateTaskRequest) -> TtrpcResult<api::CreateTaskResponse> {
        let t = &self.0;
        if t.lock().containers.contains_key(&req.id) {
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
        let mut held = self.0.lock();
        let c =
            held.containers.get_mut(&req.id).ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {}", req.id)))?;
        if c.execs.contains_key(&req.exec_id) {
            return Err(rpc(Code::ALREADY_EXISTS, format!("exec {} exists", req.exec_id)));
        }
        let rootfs = Bundle::load(&c.bundle).map(|b| b.rootfs()).map_err(failed)?;
        let mut spec = proc_spec(&process, &rootfs).map_err(|e| rpc(Code::INVALID_ARGUMENT, format!("{e:#}")))?;
        spec.root = c.root.clone();
        c.execs.insert(req.exec_id.clone(), Proc::created(spec, &req.stdin, &req.stdout, &req.stderr, req.terminal));
        Ok(api::Empty::new())
    }

    fn state(&self, _: &TtrpcContext, req: api::StateRequest) -> TtrpcResult<api::StateResponse> {
        let mut held = self.0.lock();
        let c =
            held.containers.get_mut(&req.id).ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {}", req.id)))?;
        let bundle = c.bundle.display().to_string();
        let paused = c.paused;
        let p = c.proc(&req.exec_id)?;
        let status = if paused && p.phase == Phase::Running { api::Status::PAUSED } else { status_of(p.phase) };
        Ok(api::StateResponse {
            id: if req.exec_id.is_empty() { req.id.clone() } else { req.exec_id.clone() },
            bundle,
            pid: p.pid,
            status: status.into(),
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
        let (sandbox, pid, phase, nominal, member) = {
            let mut held = self.0.lock();
            let c = held
                .containers
                .get_mut(&req.id)
                .ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {}", req.id)))?;
            let sandbox = c.sandbox.clone();
            let member = matches!(c.role, Role::Member(_)) && req.exec_id.is_empty();
            let p = c.proc(&req.exec_id)?;
            (sandbox, p.pid, p.phase, p.nominal, member)
        };
        match phase {
            Phase::Stopped => Err(rpc(Code::NOT_FOUND, "process already finished")),
            _ if nominal || phase == Phase::Created => {
                // Never started, or a pod's nominal process: it ends here, as killed by the signal.
                self.0.exited(&req.id, &req.exec_id, 0, 128 + req.signal);
                Ok(api::Empty::new())
            }
            // A pod member's SIGKILL, or a signal to all its processes, goes to its whole group in the pod's
            // sandbox (SandboxApi::proc_group), as to a runc container's cgroup.
            _ if member
                && (req.all || req.signal == 9)
                && self.0.api.proc_group(&sandbox, pid, GroupOp::Kill).is_ok() =>
            {
                Ok(api::Empty::new())
            }
            _ => match self.0.api.proc_signal(&sandbox, pid, req.signal as i32) {
                Ok(()) => Ok(api::Empty::new()),
                // It ended and its exit is on the way (the agent reports it once its output closed, or 2 s on
                // where a child it left holds the output): what a member left goes, the rest is containerd's
                // "already finished".
                Err(e) if format!("{e:#}").contains("No such process") => {
                    if member {
                        let _ = self.0.api.proc_group(&sandbox, pid, GroupOp::Kill);
                    }
                    Err(rpc(Code::NOT_FOUND, "process already finished"))
                }
                Err(e) => Err(failed(e)),
            },
        }
    }

    fn wait(&self, _: &TtrpcContext, req: api::WaitRequest) -> TtrpcResult<api::WaitResponse> {
        let mut held = self.0.lock();
        loop {
            let c = held
                .containers
                .get_mut(&req.id)
                .ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {}", req.id)))?;
            let p = c.proc(&req.exec_id)?;
            if p.phase == Phase::Stopped {
                return Ok(api::WaitResponse {
                    exit_status: p.exit_status,
                    exited_at: p.exited_at.clone().into(),
                    ..Default::default()
                });
            }
            held = self.0.changed.wait(held).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn delete(&self, _: &TtrpcContext, req: api::DeleteRequest) -> TtrpcResult<api::DeleteResponse> {
        let t = &self.0;
        if !req.exec_id.is_empty() {
            let mut held = t.lock();
            let c = held
                .containers
                .get_mut(&req.id)
                .ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {}", req.id)))?;
            let p =
                c.execs.remove(&req.exec_id).ok_or_else(|| rpc(Code::NOT_FOUND, format!("no exec {}", req.exec_id)))?;
            return Ok(api::DeleteResponse {
                pid: p.pid,
                exit_status: p.exit_status,
                exited_at: p.exited_at.into(),
                ..Default::default()
            });
        }
        let c = t.lock().containers.remove(&req.id);
        let c = c.ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {}", req.id)))?;
        t.take_down(&req.id, &c);
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
        let sandbox = self.sandbox_of(&req.id)?;
        let procs = self.0.api.proc_list(&sandbox).map_err(failed)?;
        let processes = procs
            .into_iter()
            .map(|p| containerd_shim::protos::api::ProcessInfo { pid: p.pid, ..Default::default() })
            .collect();
        Ok(api::PidsResponse { processes, ..Default::default() })
    }

    fn resize_pty(&self, _: &TtrpcContext, req: api::ResizePtyRequest) -> TtrpcResult<api::Empty> {
        // A process that already ended has no terminal left to size (ctr resizes right after a short one ran).
        let ended = {
            let mut held = self.0.lock();
            let c = held.containers.get_mut(&req.id);
            c.and_then(|c| c.proc(&req.exec_id).ok()).is_some_and(|p| p.phase == Phase::Stopped)
        };
        if ended {
            return Ok(api::Empty::new());
        }
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
        let sandbox = self.sandbox_of(&req.id)?;
        let mark = self.0.api.mark(&sandbox, &MarkRequest::default()).map_err(failed)?;
        log::info!("container {}: marked {}", req.id, mark.id);
        Ok(api::Empty::new())
    }

    fn stats(&self, _: &TtrpcContext, req: api::StatsRequest) -> TtrpcResult<api::StatsResponse> {
        let (sandbox, member_leaders) = {
            let held = self.0.lock();
            let c =
                held.containers.get(&req.id).ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {}", req.id)))?;
            (c.sandbox.clone(), matches!(c.role, Role::Member(_)).then(|| c.leaders()))
        };
        if sandbox.is_empty() {
            return Err(rpc(Code::FAILED_PRECONDITION, format!("container {} has no sandbox yet", req.id)));
        }
        let live = self.0.api.get(&sandbox).map_err(failed)?.live.unwrap_or_default();
        let stats = match member_leaders {
            Some(leaders) => crate::stats::member_metrics(&live.pids, &leaders),
            None => crate::stats::metrics(&live),
        }
        .map_err(failed)?;
        Ok(api::StatsResponse { stats: Some(stats).into(), ..Default::default() })
    }

    fn pause(&self, _: &TtrpcContext, req: api::PauseRequest) -> TtrpcResult<api::Empty> {
        self.freeze(&req.id, true)?;
        let event = TaskPaused { container_id: req.id.clone(), ..Default::default() };
        self.0.publish(topics::TASK_PAUSED_EVENT_TOPIC, Box::new(event));
        Ok(api::Empty::new())
    }

    fn resume(&self, _: &TtrpcContext, req: api::ResumeRequest) -> TtrpcResult<api::Empty> {
        self.freeze(&req.id, false)?;
        let event = TaskResumed { container_id: req.id.clone(), ..Default::default() };
        self.0.publish(topics::TASK_RESUMED_EVENT_TOPIC, Box::new(event));
        Ok(api::Empty::new())
    }

    fn shutdown(&self, _: &TtrpcContext, _: api::ShutdownRequest) -> TtrpcResult<api::Empty> {
        if self.0.lock().containers.is_empty() {
            self.0.exit.signal();
        }
        Ok(api::Empty::new())
    }
}

impl Service {
    /// The sandbox a container runs in ("" for a pod whose sandbox waits for its first container).
    fn sandbox_of(&self, id: &str) -> TtrpcResult<String> {
        let sandbox = self.0.lock().containers.get(id).map(|c| c.sandbox.clone());
        sandbox.ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {id}")))
    }

    /// Pause (freeze) or resume (thaw) a container: its sandbox, or for a pod member (whose sandbox its pod's
    /// other containers share) the group of processes its own process leads (`SandboxApi::proc_group`).
    fn freeze(&self, id: &str, frozen: bool) -> TtrpcResult<()> {
        let (sandbox, role, leaders) = {
            let held = self.0.lock();
            let c = held.containers.get(id).ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {id}")))?;
            (c.sandbox.clone(), c.role.clone(), c.leaders())
        };
        if let Role::Member(pod) = role {
            if leaders.is_empty() {
                return Err(rpc(
                    Code::FAILED_PRECONDITION,
                    format!("container {id} of pod {pod} runs no process to pause"),
                ));
            }
            let op = if frozen { GroupOp::Freeze } else { GroupOp::Thaw };
            for leader in leaders {
                self.0.api.proc_group(&sandbox, leader, op).map_err(failed)?;
            }
        } else if !sandbox.is_empty() {
            let done = if frozen { self.0.api.freeze(&sandbox) } else { self.0.api.thaw(&sandbox) };
            done.map_err(failed)?;
        }
        if let Some(c) = self.0.lock().containers.get_mut(id) {
            c.paused = frozen;
        }
        Ok(())
    }

    fn sandbox_pid(&self, id: &str, exec_id: &str) -> TtrpcResult<(String, u32)> {
        let mut held = self.0.lock();
        let c = held.containers.get_mut(id).ok_or_else(|| rpc(Code::NOT_FOUND, format!("no container {id}")))?;
        let sandbox = c.sandbox.clone();
        let p = c.proc(exec_id)?;
        if p.phase != Phase::Running {
            return Err(rpc(Code::FAILED_PRECONDITION, format!("process {id}/{exec_id} is not running")));
        }
        Ok((sandbox, p.pid))
    }
}

fn status_of(p: Phase) -> api::Status {
    match p {
        Phase::Created => api::Status::CREATED,
        Phase::Running => api::Status::RUNNING,
        Phase::Stopped => api::Status::STOPPED,
    }
}
