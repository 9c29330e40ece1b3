//! Start (or the restore Create left pending), exec, kill and delete.

use containerd_shim::util::read_pid_from_file;
use tracing::warn;

use super::{Container, INIT_PID_FILE};
use crate::{
    error::{Error, Result},
    events::EventSender,
    process::Status,
    runc::CreateOpts,
    stdio::Absent,
};

impl Container {
    /// Starts init: `runc start`, or the restore Create left pending ([`super::PendingRestore`]).
    pub async fn start_init(&mut self, events: &EventSender) -> Result<()> {
        match self.init.status {
            Status::Created => {}
            Status::Stopped => {
                return Err(Error::FailedPrecondition(format!(
                    "container {} has already exited",
                    self.id
                )))
            }
            _ => {
                return Err(Error::FailedPrecondition(format!(
                    "container {} is already started",
                    self.id
                )))
            }
        }
        // The NCCL layer's control socket, open before any process of the container runs
        // (and, for a restore, before the restored processes connect again).
        if let Some(setup) = &self.nccl {
            let name = self.bundle.cri(&self.id).name;
            crate::nccl::open(&self.id, &name, setup, &self.options, self.init.pid)?;
        }
        if let Some(pending) = self.pending.clone() {
            let restored = self.restore(&pending).await;
            // Restored or not, nothing reads the checkpoint again (a failed Start is not
            // retried on it): what containerd extracted and what the restore handler unpacked
            // go now.
            if let Some(p) = self.pending.as_mut() {
                p.done(&self.id, &self.options);
            }
            restored?;
            self.watch_oom(events);
        } else {
            self.runc.start(&self.id).await?;
        }
        self.init.status = Status::Running;
        Ok(())
    }

    /// Starts an exec process with `runc exec --detach`; returns its pid.
    pub async fn start_exec(&mut self, exec_id: &str) -> Result<i32> {
        if self.init.is_stopped() {
            return Err(Error::FailedPrecondition(format!(
                "container {} is not running",
                self.id
            )));
        }
        let bundle = self.bundle.path().to_path_buf();
        let process = self.exec_mut(exec_id)?;
        if process.status != Status::Created {
            return Err(Error::FailedPrecondition(format!(
                "exec {exec_id} is already started"
            )));
        }
        let spec_path = bundle.join(format!("exec-{exec_id}.json"));
        std::fs::write(&spec_path, &process.spec)
            .map_err(Error::io(format!("write {}", spec_path.display())))?;
        let pid_file = bundle.join(format!("exec-{exec_id}.pid"));
        let stdio = process.stdio.clone();
        // A logging binary runs as the exec (its CONTAINER_ID), as runc-v2 starts it.
        let prepared = self.prepare_io(&stdio, exec_id, Absent::DevNull).await?;
        let mut io = prepared.io;
        let console = prepared.console;
        let console_path = console.as_ref().map(|c| c.path().to_path_buf());
        let opts = CreateOpts {
            pid_file: &pid_file,
            console_socket: console_path.as_deref(),
            no_pivot: false,
            no_new_keyring: false,
        };
        let exec = self.runc.exec(&self.id, &spec_path, &opts, prepared.child);
        let result = match console {
            Some(console) => {
                let (ran, received) = tokio::join!(exec, console.receive(&stdio, &mut io));
                ran.and(received)
            }
            None => exec.await,
        };
        let _ = std::fs::remove_file(&spec_path);
        if let Err(e) = result {
            io.tasks.abort().await;
            return Err(e);
        }
        let pid = read_pid_from_file(&pid_file).await;
        let _ = std::fs::remove_file(&pid_file);
        let pid = match pid {
            Ok(pid) => pid,
            Err(e) => {
                io.tasks.abort().await;
                return Err(e.into());
            }
        };
        let process = self.exec_mut(exec_id)?;
        process.io = io;
        process.pid = pid;
        process.status = Status::Running;
        Ok(pid)
    }

    /// Sends `signal` to a process; `all` to every process of the container.
    pub async fn kill(&self, exec_id: &str, signal: u32, all: bool) -> Result<()> {
        let process = self.process(exec_id)?;
        if process.is_stopped() && !all {
            return Err(Error::NotFound("process already finished".into()));
        }
        if exec_id.is_empty() {
            return self.runc.kill(&self.id, signal, all).await.map_err(|e| {
                if process.is_stopped() || e.to_string().contains("not running") {
                    Error::NotFound("process already finished".into())
                } else {
                    e
                }
            });
        }
        if process.status == Status::Created {
            return Err(Error::FailedPrecondition(format!(
                "exec {exec_id} is not started"
            )));
        }
        let sig = nix::sys::signal::Signal::try_from(signal as i32)
            .map_err(|_| Error::InvalidArgument(format!("invalid signal {signal}")))?;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(process.pid), sig).map_err(|e| {
            if e == nix::errno::Errno::ESRCH {
                Error::NotFound("process already finished".into())
            } else {
                Error::io(format!("kill exec {exec_id}"))(e.into())
            }
        })
    }

    /// What must happen when init has exited: report any OOM kill first, and kill the processes
    /// left behind when the container shares a PID namespace.
    pub async fn on_init_exit(&self) {
        if let Some(oom) = &self.oom {
            oom.check();
        }
        // A limit raised for a checkpoint of a container that has exited since.
        self.memory.put_back().await;
        if self.shares_pid_namespace {
            if let Err(e) = self.runc.kill(&self.id, libc::SIGKILL as u32, true).await {
                warn!(id = %self.id, error = %e, "kill processes left after init exited");
            }
        }
    }

    /// Deletes the container with runc, stops its IO and unmounts its rootfs.
    pub async fn delete(&mut self) -> Result<()> {
        if matches!(self.init.status, Status::Running | Status::Paused) {
            return Err(Error::FailedPrecondition(format!(
                "cannot delete container {}: it is still running",
                self.id
            )));
        }
        if let Err(e) = self.runc.delete(&self.id, true).await {
            if !e.to_string().contains("does not exist") {
                return Err(e);
            }
        }
        for process in self.execs.values() {
            process.io.tasks.shutdown().await;
        }
        self.init.io.tasks.shutdown().await;
        self.unmount_rootfs();
        // A container created for a restore and never started.
        self.discard_pending();
        // The NCCL control server, then its socket directory.
        crate::nccl::close(&self.id);
        self.remove_nccl();
        let _ = std::fs::remove_file(self.bundle.join(INIT_PID_FILE));
        Ok(())
    }
}
