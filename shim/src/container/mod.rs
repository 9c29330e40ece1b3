//! A container this shim runs: its bundle, runc driver, init process and execs, and the
//! operations on it, one file each, each a list of named steps with their undo:
//!
//! - [`create`]: options, rootfs, CRIU configuration, the restore handler's own restore
//!   prepared, `runc create`;
//! - [`lifecycle`]: start (or the restore Create left pending), exec, kill, delete;
//! - [`checkpoint`]: pause, resume, and checkpoint (device quiesce, CRIU dump, manifest);
//! - [`restore`]: the restore Start runs, and the pending restore Create hands it.
//!
//! The steps they call live in the crate's step modules (`crate::checkpoint`,
//! `crate::restore`, `crate::device`, `crate::spec_check`, `crate::mount_check`, …), which
//! never call back into a container.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::Arc,
};

use containerd_shim::{asynchronous::io::Stdio, mount::umount_recursive};
use tracing::warn;

use crate::{
    annotations::Annotations,
    bundle::Bundle,
    criu_exit::{CriuExit, ExitWatch},
    device::ContainerDevices,
    error::{Error, Result},
    events::EventSender,
    memory_room::HostMemory,
    oom::{MemoryCgroup, OomMonitor},
    options::RuntimeOptions,
    process::Process,
    runc::Runc,
    stdio::{self, Absent, PreparedIo},
};

mod checkpoint;
mod create;
mod lifecycle;
mod restore;

pub use create::RestoreAsked;
pub(crate) use restore::{PendingRestore, RestoreSource};

const INIT_PID_FILE: &str = "init.pid";
/// Where the shim keeps CRIU's work files by default; removed after a checkpoint.
const CRIU_WORK: &str = "criu-work";

pub struct Container {
    pub id: String,
    /// The bundle and its spec, read once at Create.
    pub bundle: Bundle,
    pub runc: Runc,
    pub options: RuntimeOptions,
    pub init: Process,
    pub execs: HashMap<String, Process>,
    oom: Option<Arc<OomMonitor>>,
    /// The container has no PID namespace of its own: when init dies, its other processes
    /// do not die with it and must be killed.
    shares_pid_namespace: bool,
    /// runc creates the container's network namespace, and CRIU dumps and restores it with
    /// the processes (a pod's containers join the sandbox's instead).
    own_network_namespace: bool,
    mounted_rootfs: bool,
    /// The checked gpu-ckpt annotations of the spec.
    pub annotations: Annotations,
    /// The restore Create set up for Start, if this container is restored.
    pending: Option<PendingRestore>,
    /// runc hands CRIU the shim's configuration file (not one the spec names).
    own_criu_conf: bool,
    /// The overlay upper directory of the rootfs: the container's changes, of which a
    /// checkpoint keeps a signed copy (`rootfs_changes`).
    upperdir: Option<PathBuf>,
    /// The device layer's view of this container: its GPU processes, quiesced by Pause or a
    /// checkpoint until Resume or the checkpoint's end puts them back (`device.rs`).
    devices: ContainerDevices,
    /// Host memory for what the device steps stage, and the limits raised for them
    /// (`memory_room.rs`).
    memory: HostMemory,
    /// How long the last Pause's device quiesce took, for the manifest of the checkpoint
    /// that follows it.
    paused_devices: Option<std::time::Duration>,
    /// A checkpoint resumed the container right after its dump (`ResumeAfterDump`): the
    /// Resume containerd sends after its copy has nothing left to do.
    pub resumed_after_dump: bool,
    /// gpu-ckpt's NCCL layer and its control socket's directory, for a container that opts in
    /// (`nccl::inject`): set at Create, the cold start's and the restore's.
    pub nccl: Option<crate::nccl::inject::NcclSetup>,
    /// The clock of the checkpoint or restore in progress (or of the Pause that began a
    /// checkpoint): its steps, the application's stop and run again, for its record and spans.
    pub(crate) op: crate::record::OpLog,
}

impl Container {
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

    fn watch_oom(&mut self, events: &EventSender) {
        if let Some(cgroup) = MemoryCgroup::of_pid(self.init.pid) {
            self.oom = Some(OomMonitor::start(&self.id, cgroup, events.clone()));
        }
    }

    /// Undo of the rootfs mount.
    fn unmount_rootfs(&mut self) {
        if self.mounted_rootfs {
            let rootfs = self.bundle.join("rootfs");
            if let Err(e) = umount_recursive(rootfs.to_str(), libc::MNT_DETACH) {
                warn!(id = %self.id, error = %e, "unmount rootfs");
            }
            self.mounted_rootfs = false;
        }
    }

    /// The pipes or terminal of a process runc is about to start (init at create or restore,
    /// an exec), owned by the handler's IO user.
    async fn prepare_io(&self, stdio: &Stdio, id: &str, absent: Absent) -> Result<PreparedIo> {
        stdio::prepare(stdio, id, self.options.io_uid, self.options.io_gid, absent).await
    }

    /// Where the restore Create left pending reads from, while it is pending.
    pub fn restore_source(&self) -> Option<String> {
        let pending = self.pending.as_ref()?;
        (self.init.status == crate::process::Status::Created).then(|| {
            pending
                .named
                .clone()
                .unwrap_or_else(|| pending.dir.display().to_string())
        })
    }

    /// The directory CRIU works in (its logs): the options', else the bundle's.
    fn criu_work(&self) -> PathBuf {
        if self.options.criu_work_path.is_empty() {
            self.bundle.join(CRIU_WORK)
        } else {
            PathBuf::from(&self.options.criu_work_path)
        }
    }

    /// Puts the CRIU configuration back to what runc uses between checkpoints and restores.
    fn reset_criu_conf(&self, after: &str) {
        if let Err(e) = crate::checkpoint::CriuConf::default().write(self.bundle.path()) {
            warn!(id = %self.id, error = %e, "CRIU configuration after a {after}");
        }
    }
}

/// The exits of the CRIU that a runc run started, when it `failed` (the watch is dropped
/// otherwise); read off the blocking pool, since finishing waits for the last queued events.
async fn finish_watch(watch: Option<ExitWatch>, failed: bool) -> Vec<CriuExit> {
    match watch {
        Some(w) if failed => tokio::task::spawn_blocking(move || w.finish())
            .await
            .unwrap_or_default(),
        _ => Vec::new(),
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
    // Device-memory files of a container paused when its shim went.
    if let Ok(dir) = crate::device_storage::dir_for(&options, namespace, id) {
        crate::device_storage::remove(&dir);
    }
    // The NCCL control socket's directory.
    crate::nccl::inject::remove(namespace, id);
    // The restore handler's staging directory, had the shim gone before it removed it.
    if options.restore_mode() {
        if let Ok(staging) = crate::restore::staging_dir(&options, namespace, id) {
            crate::restore::remove_staging(&staging);
        }
    }
    Ok(())
}
