//! A container this shim runs: its bundle, runc driver, init process and execs, and the steps
//! that create, start and delete it, each with its undo.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::Arc,
};

use containerd_shim::{
    asynchronous::io::Stdio,
    mount::umount_recursive,
    protos::api::CreateTaskRequest,
    util::{mount_rootfs, read_pid_from_file},
};
use oci_spec::runtime::{LinuxNamespaceType, Spec};
use tracing::{info_span, warn, Instrument};

use crate::{
    error::{Error, Result},
    events::EventSender,
    oom::{MemoryCgroup, OomMonitor},
    options::RuntimeOptions,
    process::{Process, Status},
    runc::{CreateOpts, Runc},
    stdio,
};

const INIT_PID_FILE: &str = "init.pid";

pub struct Container {
    pub id: String,
    pub bundle: PathBuf,
    pub runc: Runc,
    pub options: RuntimeOptions,
    pub init: Process,
    pub execs: HashMap<String, Process>,
    oom: Option<Arc<OomMonitor>>,
    /// The container has no PID namespace of its own: when init dies, its other processes
    /// do not die with it and must be killed.
    shares_pid_namespace: bool,
    mounted_rootfs: bool,
}

/// Reads and checks a bundle's config.json, with an error that names the file.
pub fn load_spec(bundle: &Path) -> Result<Spec> {
    let path = bundle.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        Error::InvalidArgument(format!("cannot read bundle config {}: {e}", path.display()))
    })?;
    serde_json::from_str::<Spec>(&text).map_err(|e| {
        Error::InvalidArgument(format!("malformed bundle config {}: {e}", path.display()))
    })
}

impl Container {
    /// Creates the container: options, rootfs, stdio, `runc create`. On failure every step
    /// already taken is undone, in reverse order, and the error says which step failed.
    pub async fn create(
        req: &CreateTaskRequest,
        namespace: &str,
        events: &EventSender,
    ) -> Result<Self> {
        let bundle = PathBuf::from(&req.bundle);
        let spec = load_spec(&bundle)?;
        let options = RuntimeOptions::from_any(req.options.as_ref())?;
        options.write_to_bundle(&bundle)?;
        let runc = Runc::new(&options, namespace, &bundle);
        let shares_pid_namespace = !spec
            .linux()
            .as_ref()
            .and_then(|l| l.namespaces().as_ref())
            .is_some_and(|ns| {
                ns.iter()
                    .any(|n| n.typ() == LinuxNamespaceType::Pid && n.path().is_none())
            });

        let stdio = Stdio::new(&req.stdin, &req.stdout, &req.stderr, req.terminal);
        let mut container = Container {
            id: req.id.clone(),
            bundle: bundle.clone(),
            runc,
            options,
            init: Process::new("", stdio),
            execs: HashMap::new(),
            oom: None,
            shares_pid_namespace,
            mounted_rootfs: false,
        };

        // Step 1: the rootfs. Undo: unmount.
        if let Err(e) = container
            .mount_rootfs(req, &spec)
            .instrument(info_span!("mount_rootfs", id = %req.id))
            .await
        {
            container.unmount_rootfs();
            return Err(e);
        }
        // Step 2: stdio and runc create. Undo: stop the copies, runc delete, unmount.
        if let Err(e) = container
            .runc_create()
            .instrument(info_span!("runc_create", id = %req.id))
            .await
        {
            container.init.io.tasks.abort().await;
            if let Err(de) = container.runc.delete(&container.id, true).await {
                warn!(id = %container.id, error = %de, "undo of a failed create: runc delete");
            }
            container.unmount_rootfs();
            return Err(e);
        }
        // Step 3: OOM watch (nothing to undo: it ends with the cgroup).
        if let Some(cgroup) = MemoryCgroup::of_pid(container.init.pid) {
            container.oom = Some(OomMonitor::start(&container.id, cgroup, events.clone()));
        }
        Ok(container)
    }

    async fn mount_rootfs(&mut self, req: &CreateTaskRequest, spec: &Spec) -> Result<()> {
        let rootfs = self.bundle.join("rootfs");
        if !req.rootfs.is_empty() {
            std::fs::create_dir_all(&rootfs)
                .map_err(Error::io(format!("create {}", rootfs.display())))?;
            self.mounted_rootfs = true;
            for m in &req.rootfs {
                mount_rootfs(m, &rootfs).await?;
            }
        }
        let root = spec
            .root()
            .as_ref()
            .map(|r| r.path().clone())
            .unwrap_or_else(|| PathBuf::from("rootfs"));
        let root = if root.is_absolute() {
            root
        } else {
            self.bundle.join(root)
        };
        if !root.is_dir() {
            return Err(Error::InvalidArgument(format!(
                "container rootfs {} does not exist",
                root.display()
            )));
        }
        Ok(())
    }

    fn unmount_rootfs(&mut self) {
        if self.mounted_rootfs {
            let rootfs = self.bundle.join("rootfs");
            if let Err(e) = umount_recursive(rootfs.to_str(), libc::MNT_DETACH) {
                warn!(id = %self.id, error = %e, "unmount rootfs");
            }
            self.mounted_rootfs = false;
        }
    }

    async fn runc_create(&mut self) -> Result<()> {
        let prepared = stdio::prepare(&self.init.stdio, self.options.io_uid, self.options.io_gid)?;
        self.init.io = prepared.io;
        let pid_file = self.bundle.join(INIT_PID_FILE);
        let console = prepared.console;
        let console_path = console.as_ref().map(|c| c.path().to_path_buf());
        let opts = CreateOpts {
            pid_file: &pid_file,
            console_socket: console_path.as_deref(),
            no_pivot: self.options.no_pivot_root,
            no_new_keyring: self.options.no_new_keyring,
        };
        let create = self
            .runc
            .create(&self.id, &self.bundle, &opts, prepared.child);
        match console {
            Some(console) => {
                let stdio = self.init.stdio.clone();
                let mut io = self.init.io.clone();
                let (created, received) = tokio::join!(create, console.receive(&stdio, &mut io));
                created?;
                received?;
                self.init.io = io;
            }
            None => create.await?,
        }
        self.init.pid = read_pid_from_file(&pid_file).await?;
        Ok(())
    }

    pub async fn start_init(&mut self) -> Result<()> {
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
        self.runc.start(&self.id).await?;
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
        let bundle = self.bundle.clone();
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
        let prepared = stdio::prepare(&stdio, self.options.io_uid, self.options.io_gid)?;
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

    pub fn process(&self, exec_id: &str) -> Result<&Process> {
        if exec_id.is_empty() {
            return Ok(&self.init);
        }
        self.execs.get(exec_id).ok_or_else(|| {
            Error::NotFound(format!("exec {exec_id} not found in container {}", self.id))
        })
    }

    pub fn process_mut(&mut self, exec_id: &str) -> Result<&mut Process> {
        if exec_id.is_empty() {
            return Ok(&mut self.init);
        }
        self.exec_mut(exec_id)
    }

    fn exec_mut(&mut self, exec_id: &str) -> Result<&mut Process> {
        let id = &self.id;
        self.execs
            .get_mut(exec_id)
            .ok_or_else(|| Error::NotFound(format!("exec {exec_id} not found in container {id}")))
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
        let _ = std::fs::remove_file(self.bundle.join(INIT_PID_FILE));
        Ok(())
    }
}

/// Cleans up after a shim that is gone (the `delete` action): runc delete, unmount.
pub async fn cleanup_bundle(bundle: &Path, id: &str, namespace: &str) -> Result<()> {
    let options = RuntimeOptions::read_from_bundle(bundle)?;
    let runc = Runc::new(&options, namespace, bundle);
    if let Err(e) = runc.delete(id, true).await {
        warn!(%id, error = %e, "runc delete during cleanup");
    }
    let rootfs = bundle.join("rootfs");
    umount_recursive(rootfs.to_str(), libc::MNT_DETACH)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_config_is_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), "{\"ociVersion\": ").unwrap();
        let err = load_spec(dir.path()).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)));
        assert!(err.to_string().contains("malformed bundle config"), "{err}");
        assert!(err.to_string().contains("config.json"), "{err}");
    }

    #[test]
    fn missing_config_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = load_spec(dir.path()).unwrap_err().to_string();
        assert!(err.contains("cannot read bundle config"), "{err}");
    }
}
