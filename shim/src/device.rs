//! The device layer the checkpoint and restore steps call: which of a container's processes hold
//! GPU state, and the CUDA driver's checkpoint steps over all of them, each with its undo.
//!
//! It drives the `gpu` crate's two traits, [`DeviceCheckpoint`] (the driver's checkpoint API for
//! one process, run in a worker process with a bound on each call: `device_worker.rs`) and
//! [`Inventory`] (NVML), and knows nothing of runc or CRIU; `container/` and
//! `task.rs` call it at their steps:
//!
//! - Pause (containerd pauses a task before it checkpoints it): [`DeviceLayer::quiesce`] (lock,
//!   then checkpoint every holder) before the cgroup is frozen, since the driver's restore thread
//!   must be able to run. Resume: thaw, then [`DeviceLayer::resume`] (restore, unlock).
//! - Checkpoint of a running container: the same around the CRIU dump.
//! - Restore: after `runc restore`, [`DeviceLayer::restore_onto`] with the GPU pairs of this
//!   node, unlock, and RUNNING confirmed for every process.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use gpu::{
    DeviceCheckpoint, DeviceMemoryFile, GpuError, GpuPair, GpuUuid, Inventory, NodeInventory,
    ProcessState,
};
use image_format::compat::{self, Profile};
use image_format::manifest::{self, DeviceProcess, Devices, Manifest, ProcessGpu};
use tracing::{info, info_span, warn};

use crate::bundle::Bundle;
use crate::error::{Error, Result};
use crate::options::RuntimeOptions;
use crate::record::OpLog;

/// A process of the container that holds device state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    /// Host pid.
    pub pid: i32,
    /// Its pid in the container's pid namespace (what CRIU restores it as).
    pub ns_pid: u32,
    /// Its command name, for messages.
    pub comm: String,
    /// The GPUs it has a context on, and the device memory it holds on each.
    pub gpus: Vec<(GpuUuid, u64)>,
}

impl Holder {
    /// As the manifest records it.
    pub fn record(&self) -> DeviceProcess {
        DeviceProcess {
            pid: self.ns_pid,
            gpus: self
                .gpus
                .iter()
                .map(|(u, b)| ProcessGpu {
                    uuid: u.to_string(),
                    bytes: *b,
                })
                .collect(),
        }
    }

    /// The device memory it holds on all its GPUs.
    pub fn device_bytes(&self) -> u64 {
        self.gpus.iter().map(|(_, b)| b).sum()
    }

    /// `pid 1234 (gpu-train, pid 1 in the container) on GPU-…`, for messages.
    pub fn describe(&self) -> String {
        let gpus: Vec<String> = self.gpus.iter().map(|(u, _)| u.to_string()).collect();
        format!(
            "pid {} ({}, pid {} in the container) holding {}",
            self.pid,
            self.comm,
            self.ns_pid,
            gpus.join(", ")
        )
    }
}

impl crate::unsupported::Process for Holder {
    fn pid(&self) -> i32 {
        self.pid
    }
    fn gpus(&self) -> Vec<GpuUuid> {
        self.gpus.iter().map(|(u, _)| *u).collect()
    }
    fn describe(&self) -> String {
        Holder::describe(self)
    }
    fn other(pid: i32, gpus: Vec<GpuUuid>) -> Self {
        Holder {
            pid,
            ns_pid: ns_pid(pid).unwrap_or(0),
            comm: comm(pid),
            gpus: gpus.into_iter().map(|u| (u, 0)).collect(),
        }
    }
}

/// The driver's checkpoint API and the node's inventory.
pub struct DeviceLayer {
    cuda: Box<dyn DeviceCheckpoint>,
    nvml: Box<dyn Inventory>,
}

/// `CUDA_ERROR_ILLEGAL_STATE`: the process is not in the state the call needs.
const ILLEGAL_STATE: u32 = 401;

/// One layer per driver library directory, for the shim process's life: its driver calls run
/// in one worker process (`device_worker.rs`), started once and reused, as `cuInit` costs
/// seconds on a real driver and a restore needs it to have run in the calling process.
static LAYERS: OnceLock<Mutex<HashMap<PathBuf, Arc<DeviceLayer>>>> = OnceLock::new();

impl DeviceLayer {
    pub fn new(cuda: Box<dyn DeviceCheckpoint>, nvml: Box<dyn Inventory>) -> DeviceLayer {
        DeviceLayer { cuda, nvml }
    }

    /// The layer for the driver the options name (`DriverLibraryDir`, else the loader's search);
    /// `None` on a node without an NVIDIA driver, where no process can hold device state.
    pub fn for_options(options: &RuntimeOptions) -> Result<Option<Arc<DeviceLayer>>> {
        let dir = PathBuf::from(&options.driver_library_dir);
        let layers = LAYERS.get_or_init(Default::default);
        let mut layers = layers
            .lock()
            .map_err(|_| Error::FailedPrecondition("device layer lock poisoned".into()))?;
        if let Some(l) = layers.get(&dir) {
            return Ok(Some(l.clone()));
        }
        let bounds = crate::device_worker::Bounds::from_options(options)?;
        let cuda = match crate::device_worker::WorkerDriver::open(&dir, bounds) {
            Ok(c) => c,
            Err(GpuError::NoDriver { .. }) if dir.as_os_str().is_empty() => return Ok(None),
            Err(e) => return Err(device_error("load", e.to_string())),
        };
        let lib = |name: &str| (!dir.as_os_str().is_empty()).then(|| dir.join(name));
        let nvml = gpu::NvmlInventory::open(lib("libnvidia-ml.so.1").as_deref())
            .map_err(|e| device_error("load", e.to_string()))?;
        info!(
            cuda = cuda.library(),
            version = cuda.version(),
            "device layer loaded"
        );
        let layer = Arc::new(DeviceLayer::new(Box::new(cuda), Box::new(nvml)));
        layers.insert(dir, layer.clone());
        Ok(Some(layer))
    }

    /// The node's management library, for the checks of `unsupported.rs`.
    pub fn nvml(&self) -> &dyn Inventory {
        self.nvml.as_ref()
    }

    pub fn inventory(&self) -> Result<NodeInventory> {
        self.nvml
            .node()
            .map_err(|e| device_error("inventory", e.to_string()))
    }

    /// The processes among `pids` (host pids of the container) that hold device state: those
    /// NVML lists with a compute context, confirmed by the driver's restore thread.
    pub fn holders(&self, pids: &[i32]) -> Result<Vec<Holder>> {
        let _span = info_span!("device_holders").entered();
        let listed = self
            .nvml
            .compute_processes()
            .map_err(|e| device_error("find", e.to_string()))?;
        let mut out: Vec<Holder> = Vec::new();
        for p in listed {
            let pid = p.pid as i32;
            if !pids.contains(&pid) {
                continue;
            }
            let bytes = p.used_bytes.unwrap_or(0);
            if let Some(h) = out.iter_mut().find(|h| h.pid == pid) {
                h.gpus.push((p.gpu, bytes));
                self.cuda.set_device_bytes(pid, h.device_bytes());
                continue;
            }
            self.cuda.set_device_bytes(pid, bytes);
            if let Err(e) = self.cuda.restore_thread_id(pid) {
                // NVML lists it, but the driver has no checkpointable state for it (it exited,
                // or its context is going away).
                warn!(pid, error = %e, "listed by NVML but no CUDA restore thread: skipped");
                continue;
            }
            out.push(Holder {
                pid,
                ns_pid: ns_pid(pid).unwrap_or(0),
                comm: comm(pid),
                gpus: vec![(p.gpu, bytes)],
            });
        }
        out.sort_by_key(|h| h.pid);
        Ok(out)
    }

    /// Lock every holder (with `timeout`), all at once, then checkpoint every holder, all at
    /// once: device memory moves into each process's host memory, or with custom storage into
    /// its device-memory files in `storage`'s directory. On failure, what was done is undone
    /// (restore the checkpointed, unlock the locked) and the error names the step, the pid
    /// and the driver's error. Returns each holder's files (none when staged) and how long
    /// the two steps took.
    pub fn quiesce(
        &self,
        holders: &[Holder],
        timeout: Duration,
        storage: &Storage,
    ) -> Result<Quiesce> {
        self.quiesce_logged(holders, timeout, storage, &OpLog::default())
    }

    /// [`DeviceLayer::quiesce`], each of its two steps (`device-lock`, `device-checkpoint`)
    /// timed into `log`, in its span.
    pub fn quiesce_logged(
        &self,
        holders: &[Holder],
        timeout: Duration,
        storage: &Storage,
        log: &OpLog,
    ) -> Result<Quiesce> {
        let t = Instant::now();
        let step = log.step("device-lock");
        let locks = step.span().in_scope(|| {
            each(holders, |h| {
                let _span = info_span!("device_lock", pid = h.pid).entered();
                self.cuda.lock(h.pid, Some(timeout))
            })
        });
        let lock = t.elapsed();
        if let Some((n, e)) = first_error(&locks) {
            step.failed(&step_error("device-lock", &holders[n], e, Vec::new()));
            let mut undo = Vec::new();
            for (h, r) in holders.iter().zip(&locks) {
                if let Err(e) = r {
                    undo.extend(self.undo_unanswered(e, "unlock", || self.cuda.unlock(h.pid)));
                }
            }
            let locked: Vec<(&Holder, Option<&[DeviceMemoryFile]>)> = holders
                .iter()
                .zip(&locks)
                .filter(|(_, r)| r.is_ok())
                .map(|(h, _)| (h, None))
                .collect();
            undo.extend(self.undo(&locked, storage));
            return Err(step_error("device-lock", &holders[n], e, undo));
        }
        step.done();
        let t = Instant::now();
        let step = log.step("device-checkpoint");
        let done = step.span().in_scope(|| {
            each(holders, |h| {
                let _span = info_span!("device_checkpoint", pid = h.pid).entered();
                match storage {
                    Storage::Staged => self.cuda.checkpoint(h.pid).map(|()| Vec::new()),
                    Storage::Custom { dir } => {
                        let gpus: Vec<GpuUuid> = h.gpus.iter().map(|g| g.0).collect();
                        self.cuda.checkpoint_to(h.pid, &gpus, dir, &file_prefix(h))
                    }
                }
            })
        });
        let checkpoint = t.elapsed();
        if let Some((n, e)) = first_error(&done) {
            step.failed(&step_error("device-checkpoint", &holders[n], e, Vec::new()));
            let mut undo = Vec::new();
            for (h, r) in holders.iter().zip(&done) {
                if let Err(e) = r {
                    undo.extend(self.undo_unanswered(e, "restore", || match storage {
                        Storage::Staged => self.cuda.restore(h.pid, &[]),
                        // The files of a call that never answered are not known.
                        Storage::Custom { .. } => Err(GpuError::InvalidArgument(format!(
                            "pid {}: the device-memory files of a checkpoint that did not answer are unknown",
                            h.pid
                        ))),
                    }));
                }
            }
            let locked: Vec<(&Holder, Option<&[DeviceMemoryFile]>)> = holders
                .iter()
                .zip(&done)
                .map(|(h, r)| (h, r.as_ref().ok().map(Vec::as_slice)))
                .collect();
            undo.extend(self.undo(&locked, storage));
            return Err(step_error("device-checkpoint", &holders[n], e, undo));
        }
        step.done();
        let files = done.into_iter().flatten().collect();
        Ok(Quiesce {
            files,
            lock,
            checkpoint,
        })
    }

    /// After a call that did not return within its bound (`e`): it may have taken effect
    /// before it stuck (the driver's own state read after it, say), so `undo`, its inverse, runs
    /// for `h` too; a driver that answers CUDA_ERROR_ILLEGAL_STATE says the call never took.
    fn undo_unanswered(
        &self,
        e: &GpuError,
        what: &str,
        undo: impl FnOnce() -> std::result::Result<(), GpuError>,
    ) -> Vec<String> {
        if !matches!(e, GpuError::Unanswered { .. }) {
            return Vec::new();
        }
        match undo() {
            Ok(()) => Vec::new(),
            Err(GpuError::Driver { code, .. }) if code == ILLEGAL_STATE => Vec::new(),
            Err(u) => vec![format!("{what}: {u}")],
        }
    }

    /// Undo of [`DeviceLayer::quiesce`], every process at once: those of `locked` that were
    /// checkpointed (with their files, if any) are restored onto their own GPUs, and every
    /// one is unlocked. Returns what failed, for the error message.
    fn undo(
        &self,
        locked: &[(&Holder, Option<&[DeviceMemoryFile]>)],
        storage: &Storage,
    ) -> Vec<String> {
        each(locked, |(h, checkpointed)| {
            if let Some(files) = checkpointed {
                if let Err(e) = self.put_back(h.pid, &[], storage, files) {
                    return Some(format!("restore: {e}"));
                }
            }
            self.cuda
                .unlock(h.pid)
                .err()
                .map(|e| format!("unlock: {e}"))
        })
        .into_iter()
        .flatten()
        .collect()
    }

    /// CHECKPOINTED → LOCKED onto the GPUs `pairs` name: from the process's host memory, or
    /// with custom storage from its device-memory `files`.
    fn put_back(
        &self,
        pid: i32,
        pairs: &[GpuPair],
        storage: &Storage,
        files: &[DeviceMemoryFile],
    ) -> std::result::Result<(), GpuError> {
        match storage {
            Storage::Staged => self.cuda.restore(pid, pairs),
            Storage::Custom { dir } => self.cuda.restore_from(pid, pairs, dir, files),
        }
    }

    /// After a checkpoint that leaves the container running (or a Resume): every holder back
    /// onto its own GPUs (from its `files` with custom storage) and unlocked, all at once.
    /// Every holder is tried; the first error is returned.
    pub fn resume(
        &self,
        holders: &[Holder],
        storage: &Storage,
        files: &[Vec<DeviceMemoryFile>],
    ) -> std::result::Result<(), (Error, Vec<usize>)> {
        let items: Vec<(&Holder, &[DeviceMemoryFile])> = holders
            .iter()
            .enumerate()
            .map(|(i, h)| (h, files.get(i).map(Vec::as_slice).unwrap_or(&[])))
            .collect();
        let results = each(&items, |(h, files)| {
            let _span = info_span!("device_resume", pid = h.pid).entered();
            self.put_back(h.pid, &[], storage, files)
                .map_err(|e| step_error("device-restore", h, &e, Vec::new()))
                .and_then(|_| {
                    self.cuda
                        .unlock(h.pid)
                        .map_err(|e| step_error("device-unlock", h, &e, Vec::new()))
                })
        });
        let mut first = None;
        let mut failed = Vec::new();
        for (i, (h, r)) in holders.iter().zip(results).enumerate() {
            if let Err(e) = r {
                warn!(pid = h.pid, error = %e, "device resume");
                first.get_or_insert(e);
                failed.push(i);
            }
        }
        first.map_or(Ok(()), |e| Err((e, failed)))
    }

    /// Whether every one of `holders` is RUNNING (its state read back), after an undo.
    fn all_running(&self, holders: &[Holder]) -> bool {
        holders
            .iter()
            .all(|h| matches!(self.cuda.state(h.pid), Ok(s) if s == ProcessState::RUNNING))
    }

    /// After `runc restore`: each process the checkpoint recorded (by its pid in the
    /// container), found among `pids` (host pids of the restored container), restored onto the
    /// GPUs `pairs` name (with custom storage from its device-memory files in `files`, by
    /// its pid in the container), then unlocked, then confirmed RUNNING; every process at
    /// once. The caller kills the container on failure, so there is nothing to undo here.
    pub fn restore_onto(
        &self,
        recorded: &[DeviceProcess],
        pids: &[i32],
        pairs: &[GpuPair],
        storage: &Storage,
        files: &HashMap<u32, Vec<DeviceMemoryFile>>,
    ) -> Result<Vec<i32>> {
        let by_ns: HashMap<u32, i32> = pids.iter().filter_map(|&p| Some((ns_pid(p)?, p))).collect();
        let mut targets = Vec::new();
        for r in recorded {
            let pid = *by_ns.get(&r.pid).ok_or_else(|| {
                device_error(
                    "device-restore",
                    format!(
                        "the checkpoint's GPU process (pid {} in the container) is not among the restored processes",
                        r.pid
                    ),
                )
            })?;
            let state = self
                .cuda
                .state(pid)
                .map_err(|e| device_error("device-restore", format!("pid {pid}: {e}")))?;
            if state != ProcessState::CHECKPOINTED {
                return Err(device_error(
                    "device-restore",
                    format!(
                        "pid {pid} (pid {} in the container) is {state}, not CHECKPOINTED",
                        r.pid
                    ),
                ));
            }
            if matches!(storage, Storage::Custom { .. }) && !files.contains_key(&r.pid) {
                return Err(device_error(
                    "device-restore",
                    format!(
                        "the checkpoint lists no device-memory file of its GPU process (pid {} in the container)",
                        r.pid
                    ),
                ));
            }
            self.cuda
                .set_device_bytes(pid, r.gpus.iter().map(|g| g.bytes).sum());
            targets.push((pid, r.pid));
        }
        let named = |step: &'static str, (pid, ns): (i32, u32)| {
            move |e: GpuError| {
                device_error(step, format!("pid {pid} (pid {ns} in the container): {e}"))
            }
        };
        let restored = each(&targets, |&(pid, ns)| {
            let _span = info_span!("device_restore", pid).entered();
            let own = files.get(&ns).map(Vec::as_slice).unwrap_or(&[]);
            self.put_back(pid, pairs, storage, own)
                .map_err(named("device-restore", (pid, ns)))
        });
        restored.into_iter().collect::<Result<Vec<()>>>()?;
        let unlocked = each(&targets, |&(pid, ns)| {
            let _span = info_span!("device_unlock", pid).entered();
            self.cuda
                .unlock(pid)
                .map_err(named("device-unlock", (pid, ns)))
        });
        unlocked.into_iter().collect::<Result<Vec<()>>>()?;
        for &(pid, ns) in &targets {
            let state = self
                .cuda
                .state(pid)
                .map_err(|e| device_error("device-confirm", format!("pid {pid}: {e}")))?;
            if state != ProcessState::RUNNING {
                return Err(device_error(
                    "device-confirm",
                    format!("pid {pid} (pid {ns} in the container) is {state}, not RUNNING"),
                ));
            }
        }
        Ok(targets.into_iter().map(|(p, _)| p).collect())
    }
}

/// What [`DeviceLayer::quiesce`] did.
#[derive(Debug, Default)]
pub struct Quiesce {
    /// Each holder's device-memory files, in the holders' order (none when staged).
    pub files: Vec<Vec<DeviceMemoryFile>>,
    /// How long the lock of every holder took, and then their checkpoint.
    pub lock: Duration,
    pub checkpoint: Duration,
}

/// Where a checkpoint's device memory goes (and a restore reads it from).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Storage {
    /// Staged by the driver in each process's host memory (inside CRIU's page images).
    #[default]
    Staged,
    /// The driver's custom storage: device-memory files in `dir`.
    Custom { dir: PathBuf },
}

/// The name prefix of a holder's device-memory files: `device-memory-<pid in the container>`
/// (the driver adds `-<n>.bin`, one file per GPU), unique in a checkpoint.
fn file_prefix(h: &Holder) -> String {
    format!("device-memory-{}", h.ns_pid)
}

/// `f` run for every item at once, one scoped thread each (in place for a single item), in
/// the span of the caller; the results in the items' order. A panic in one is the caller's.
fn each<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    if items.len() <= 1 {
        return items.iter().map(&f).collect();
    }
    let span = tracing::Span::current();
    std::thread::scope(|scope| {
        let handles: Vec<_> = items
            .iter()
            .map(|item| {
                let (f, span) = (&f, span.clone());
                scope.spawn(move || span.in_scope(|| f(item)))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// The first failure among `results`, with its index.
fn first_error<T>(results: &[std::result::Result<T, GpuError>]) -> Option<(usize, &GpuError)> {
    results
        .iter()
        .enumerate()
        .find_map(|(i, r)| r.as_ref().err().map(|e| (i, e)))
}

/// The device side of one container: the layer (loaded on first need), the processes a Pause or
/// a checkpoint quiesced until Resume or the end of the checkpoint puts them back, and the
/// settings that come from the handler and the pod.
pub struct ContainerDevices {
    options: RuntimeOptions,
    /// The pod's `gpu-ckpt.io/lock-timeout`.
    lock_timeout: Option<String>,
    layer: Option<Option<Arc<DeviceLayer>>>,
    quiesced: Option<Quiesced>,
    /// How the container was given GPUs, for the refusals of `unsupported.rs`.
    given: crate::unsupported::Given,
    /// Where custom storage writes this container's device-memory files
    /// (`device_storage::dir_for`); `None`: staged only.
    storage_dir: Option<PathBuf>,
}

/// Processes found holding device state at a Pause or checkpoint.
struct Quiesced {
    holders: Vec<Holder>,
    /// False when the device steps are switched off (`DeviceSteps = false`): found, not
    /// checkpointed.
    checkpointed: bool,
    /// Where their device memory went, and each holder's files there.
    storage: Storage,
    files: Vec<Vec<DeviceMemoryFile>>,
    /// How long the lock and the checkpoint took.
    lock: Duration,
    checkpoint: Duration,
}

impl Quiesced {
    /// Removes the device-memory files (and their directory) once nothing needs them.
    fn remove_files(&self) {
        if let Storage::Custom { dir } = &self.storage {
            crate::device_storage::remove(dir);
        }
    }
}

/// The items of `v` at the indices `keep`.
fn only<T>(v: Vec<T>, keep: &[usize]) -> Vec<T> {
    v.into_iter()
        .enumerate()
        .filter(|(i, _)| keep.contains(i))
        .map(|(_, x)| x)
        .collect()
}

/// A container deleted while its processes were quiesced (killed while paused, say): their
/// device-memory files go with it.
impl Drop for ContainerDevices {
    fn drop(&mut self) {
        if let Some(q) = self.quiesced.take() {
            q.remove_files();
        }
    }
}

/// What a restore does on this node's GPUs, decided before CRIU runs.
#[derive(Debug, Default)]
pub struct RestorePlan {
    /// Checkpointed GPU → this container's GPU, in order.
    pub pairs: Vec<GpuPair>,
}

impl ContainerDevices {
    pub fn new(options: &RuntimeOptions, lock_timeout: Option<&str>) -> Self {
        ContainerDevices {
            options: options.clone(),
            lock_timeout: lock_timeout.map(str::to_string),
            layer: None,
            quiesced: None,
            given: Default::default(),
            storage_dir: None,
        }
    }

    /// The same, with custom storage writing under `dir` (`device_storage::dir_for`).
    pub fn stored_under(mut self, dir: Option<PathBuf>) -> Self {
        self.storage_dir = dir;
        self
    }

    /// The same, for a container given GPUs as `given` says.
    pub fn given(mut self, given: crate::unsupported::Given) -> Self {
        self.given = given;
        self
    }

    /// The container got gpu-ckpt's NCCL layer: its processes that map NCCL with the layer
    /// are the layer's to quiesce, not refused (`unsupported.rs`).
    pub fn nccl_managed(&mut self) {
        self.given = std::mem::take(&mut self.given).nccl_managed(true);
    }

    /// The layer, loaded once (`cuInit` can take a while on a real driver, so off the
    /// runtime's thread).
    async fn layer(&mut self) -> Result<Option<Arc<DeviceLayer>>> {
        if let Some(l) = &self.layer {
            return Ok(l.clone());
        }
        let options = self.options.clone();
        let l = tokio::task::spawn_blocking(move || DeviceLayer::for_options(&options))
            .await
            .map_err(|e| device_error("load", e.to_string()))??;
        self.layer = Some(l.clone());
        Ok(l)
    }

    /// Whether this node has a driver, so that the container's processes may hold device
    /// state (the device steps have nothing to do otherwise).
    pub async fn active(&mut self) -> Result<bool> {
        Ok(self.layer().await?.is_some())
    }

    /// Whether a Pause (or this checkpoint) has quiesced the container's device state.
    pub fn is_quiesced(&self) -> bool {
        self.quiesced.is_some()
    }

    /// Lock, then checkpoint, every process among `pids` that holds device state (nothing when
    /// none does, or on a node without a driver). With custom storage (`DeviceStorage` auto,
    /// on a driver that offers it) into device-memory files under the container's storage
    /// directory, once the disk there has room for them (`device_storage.rs`); else staged,
    /// once `room` has made sure the host memory the driver stages fits (`memory_room.rs`).
    /// Undone on failure; see [`DeviceLayer::quiesce`].
    pub async fn quiesce(
        &mut self,
        pids: Vec<i32>,
        room: impl FnOnce(&[Holder]) -> Result<()> + Send + 'static,
        log: &OpLog,
    ) -> Result<()> {
        let log = log.clone();
        if self.quiesced.is_some() {
            return Ok(());
        }
        let Some(layer) = self.layer().await? else {
            return Ok(());
        };
        let timeout = lock_timeout(self.lock_timeout.as_deref(), &self.options)?;
        let steps = self.options.device_steps();
        let given = self.given.clone();
        let custom = self
            .storage_dir
            .clone()
            .filter(|_| self.options.custom_device_storage() && layer.cuda.custom_storage());
        let q = tokio::task::spawn_blocking(move || -> Result<Quiesced> {
            let holders = layer.holders(&pids)?;
            crate::unsupported::refuse(layer.nvml(), &given, &pids, &holders)?;
            let storage = match custom {
                Some(dir) => Storage::Custom { dir },
                None => Storage::Staged,
            };
            let mut q = Quiesced {
                holders,
                checkpointed: false,
                storage,
                files: Vec::new(),
                lock: Duration::ZERO,
                checkpoint: Duration::ZERO,
            };
            if !steps || q.holders.is_empty() {
                q.storage = Storage::Staged;
                return Ok(q);
            }
            match &q.storage {
                Storage::Custom { dir } => {
                    let bytes = q.holders.iter().map(Holder::device_bytes).sum();
                    crate::device_storage::prepare(dir, bytes)?;
                }
                Storage::Staged => room(&q.holders)?,
            }
            match layer.quiesce_logged(&q.holders, timeout, &q.storage, &log) {
                Ok(done) => {
                    (q.files, q.lock, q.checkpoint) = (done.files, done.lock, done.checkpoint);
                    q.checkpointed = true;
                    Ok(q)
                }
                Err(e) => {
                    // The files are the only copy of a process whose undo did not bring it
                    // back: kept, and said where.
                    if layer.all_running(&q.holders) {
                        q.remove_files();
                    } else if let Storage::Custom { dir } = &q.storage {
                        warn!(dir = %dir.display(), "a GPU process is not running after the undo of a failed device checkpoint: its device-memory files are kept");
                    }
                    Err(e)
                }
            }
        })
        .await
        .map_err(|e| device_error("device-lock", e.to_string()))??;
        if q.holders.is_empty() {
            return Ok(());
        }
        if !steps {
            warn!(
                count = q.holders.len(),
                "DeviceSteps = false: GPU processes left as they are"
            );
        } else if let Storage::Custom { dir } = &q.storage {
            info!(count = q.holders.len(), dir = %dir.display(), "device state checkpointed into device-memory files");
        } else {
            info!(
                count = q.holders.len(),
                "device state checkpointed into host memory"
            );
        }
        self.quiesced = Some(q);
        Ok(())
    }

    /// Undo of [`ContainerDevices::quiesce`]: every quiesced process back on its GPUs, running
    /// (from its device-memory files, wherever they are now: the shim's storage directory
    /// keeps them until here); the files removed once it is.
    pub async fn resume(&mut self) -> Result<()> {
        let Some(q) = self.quiesced.take() else {
            return Ok(());
        };
        let Some(Some(layer)) = self.layer.clone() else {
            return Ok(());
        };
        if !q.checkpointed {
            return Ok(());
        }
        let (resumed, left) = tokio::task::spawn_blocking(move || {
            match layer.resume(&q.holders, &q.storage, &q.files) {
                Ok(()) => {
                    q.remove_files();
                    (Ok(()), None)
                }
                // The processes that did not come back stay quiesced, with their files, so
                // that the next Resume (containerd's, or a retry) tries them again.
                Err((e, failed)) => {
                    if let Storage::Custom { dir } = &q.storage {
                        warn!(dir = %dir.display(), "the device-memory files of a failed device resume are kept");
                    }
                    let mut q = q;
                    q.holders = only(std::mem::take(&mut q.holders), &failed);
                    // Empty on the staged path; else one entry per holder.
                    q.files = only(std::mem::take(&mut q.files), &failed);
                    (Err(e), Some(q))
                }
            }
        })
        .await
        .map_err(|e| device_error("device-restore", e.to_string()))?;
        self.quiesced = left;
        resumed
    }

    /// After a checkpoint that ended the processes (`--exit`): nothing is left to resume, and
    /// the device-memory files are the checkpoint's now (what is left of them here goes).
    pub fn forget(&mut self) {
        if let Some(q) = self.quiesced.take() {
            q.remove_files();
        }
    }

    /// The device-memory files of the quiesced processes, for the checkpoint's image
    /// directory: where they are, and each with the process's pid in the container.
    pub fn device_files(&self) -> Option<crate::device_storage::Stored> {
        let q = self.quiesced.as_ref().filter(|q| q.checkpointed)?;
        let Storage::Custom { dir } = &q.storage else {
            return None;
        };
        let files = q
            .holders
            .iter()
            .zip(&q.files)
            .flat_map(|(h, fs)| fs.iter().map(|f| (h.ns_pid, f.clone())))
            .collect();
        Some(crate::device_storage::Stored {
            dir: dir.clone(),
            files,
        })
    }

    /// The manifest's timings of the device steps (`device-lock`, `device-checkpoint`), when
    /// this checkpoint ran them.
    pub fn timings(&self) -> Vec<(&'static str, Duration)> {
        match self.quiesced.as_ref().filter(|q| q.checkpointed) {
            Some(q) => vec![("device-lock", q.lock), ("device-checkpoint", q.checkpoint)],
            None => Vec::new(),
        }
    }

    /// The processes found holding device state but left alone (`DeviceSteps = false`), for
    /// the error of the CRIU dump that then fails.
    pub fn left_alone(&self) -> Option<String> {
        let q = self.quiesced.as_ref().filter(|q| !q.checkpointed)?;
        let who: Vec<String> = q.holders.iter().map(Holder::describe).collect();
        Some(format!(
            "the device steps are off (DeviceSteps = false), so the GPU state of {} was not checkpointed",
            who.join("; ")
        ))
    }

    /// What the manifest records: the node's driver and GPUs, the container's GPUs in its
    /// order, and each quiesced process with its device bytes. Empty on a node without a
    /// driver, or for a container given no GPU and holding none.
    pub async fn record(&mut self, bundle: &Bundle) -> Result<Devices> {
        let Some(layer) = self.layer().await? else {
            return Ok(Devices::default());
        };
        let bundle = bundle.clone();
        let holders: Vec<Holder> = self
            .quiesced
            .as_ref()
            .map(|q| q.holders.clone())
            .unwrap_or_default();
        let storage = match self.quiesced.as_ref().map(|q| &q.storage) {
            Some(Storage::Custom { .. }) => manifest::STORAGE_CUSTOM,
            _ => manifest::STORAGE_STAGED,
        };
        tokio::task::spawn_blocking(move || -> Result<Devices> {
            let inv = layer.inventory()?;
            let mut gpus: Vec<GpuUuid> =
                assigned(&bundle, &inv)?.map(|a| a.gpus).unwrap_or_default();
            // A GPU a process holds that the spec does not show (a privileged container that
            // sees every device node): recorded too, in the node's order.
            for g in &inv.gpus {
                let held = holders
                    .iter()
                    .any(|h| h.gpus.iter().any(|(u, _)| *u == g.uuid));
                if held && !gpus.contains(&g.uuid) {
                    gpus.push(g.uuid);
                }
            }
            if gpus.is_empty() {
                return Ok(Devices::default());
            }
            let mut d = Profile::from_inventory(&inv, &gpus, Default::default()).devices;
            for g in d.gpus.iter_mut().chain(d.node_gpus.iter_mut()) {
                g.free_bytes = None;
            }
            d.processes = holders.iter().map(Holder::record).collect();
            if !holders.is_empty() {
                d.storage = storage.to_string();
            }
            let who: Vec<(i32, String)> = holders.iter().map(|h| (h.pid, h.describe())).collect();
            d.driver_files = crate::driver_files::capture(&who)?;
            Ok(d)
        })
        .await
        .map_err(|e| device_error("inventory", e.to_string()))?
    }

    /// Before CRIU restores: the checkpoint's GPUs held to this container's on this node
    /// (model, count, memory, free memory, driver branch, CUDA version), and the pairs. A
    /// difference is an error naming each field.
    pub async fn plan_restore(
        &mut self,
        recorded: &Devices,
        bundle: &Bundle,
    ) -> Result<RestorePlan> {
        if recorded.gpus.is_empty() {
            return Ok(RestorePlan::default());
        }
        let bundle = bundle.clone();
        // For the prestart hook, which runs inside `runc restore`.
        let file = bundle.join(compat::BUNDLE_RESTORE_DEVICES_FILE);
        let json = serde_json::to_vec(recorded).map_err(Error::json("encode devices"))?;
        std::fs::write(&file, json).map_err(Error::io(format!("write {}", file.display())))?;
        let layer = self.layer().await?;
        let recorded = recorded.clone();
        tokio::task::spawn_blocking(move || plan_restore(&bundle, layer.as_deref(), &recorded))
            .await
            .map_err(|e| device_error("compat", e.to_string()))?
    }

    /// After `runc restore`: the processes `manifest` records (found among `pids`) restored
    /// onto `plan`'s GPUs (with custom storage from the device-memory files it lists in
    /// `dir`, the checkpoint's directory), unlocked, and confirmed RUNNING. The device nodes
    /// the driver opens are the spec's: set at the gate's pre-resume (`device_nodes.rs`).
    pub async fn restore(
        &mut self,
        manifest: &Manifest,
        dir: &Path,
        pids: Vec<i32>,
        plan: &RestorePlan,
    ) -> Result<()> {
        let recorded = &manifest.devices.processes;
        if recorded.is_empty() {
            return Ok(());
        }
        let Some(layer) = self.layer().await? else {
            return Err(device_error(
                "device-restore",
                "the checkpoint holds GPU state, and this node has no NVIDIA driver".into(),
            ));
        };
        let (storage, files) = if manifest.devices.custom_storage() {
            let storage = Storage::Custom {
                dir: dir.to_path_buf(),
            };
            (storage, crate::device_storage::recorded_files(manifest)?)
        } else {
            (Storage::Staged, HashMap::new())
        };
        let (recorded, pairs) = (recorded.to_vec(), plan.pairs.clone());
        let restored = tokio::task::spawn_blocking(move || {
            layer.restore_onto(&recorded, &pids, &pairs, &storage, &files)
        })
        .await
        .map_err(|e| device_error("device-restore", e.to_string()))??;
        info!(processes = ?restored, "device state restored, processes running");
        Ok(())
    }
}

/// The differences between the checkpoint's GPUs and this container's on this node, one
/// `field: checkpoint …, node …` each (empty when they fit), with the pairs when they do.
pub fn compare(
    bundle: &Bundle,
    layer: Option<&DeviceLayer>,
    recorded: &Devices,
) -> Result<(Vec<String>, RestorePlan)> {
    if recorded.gpus.is_empty() {
        return Ok((Vec::new(), RestorePlan::default()));
    }
    // The library's restore rule, which `gpu-ckpt compat` applies too.
    let (inv, gpus);
    let node = match layer {
        None => compat::NodeGpus::NoDriver,
        Some(layer) => {
            inv = layer.inventory()?;
            gpus = assigned(bundle, &inv)?.map(|a| a.gpus).unwrap_or_default();
            compat::NodeGpus::Given(&inv, &gpus)
        }
    };
    let check = compat::restore_check(recorded, node);
    if !check.compatible() {
        return Ok((check.reasons(), RestorePlan::default()));
    }
    let verdict = check.verdict;
    let mut plan = RestorePlan::default();
    for p in &verdict.gpu_map {
        plan.pairs.push(GpuPair {
            old: p.old_uuid.parse().map_err(|e: GpuError| {
                device_error("compat", format!("the checkpoint's GPU: {e}"))
            })?,
            new: p
                .new_uuid
                .parse()
                .map_err(|e: GpuError| device_error("compat", format!("this node's GPU: {e}")))?,
        });
    }
    Ok((Vec::new(), plan))
}

/// [`compare`], with a difference as an error.
fn plan_restore(
    bundle: &Bundle,
    layer: Option<&DeviceLayer>,
    recorded: &Devices,
) -> Result<RestorePlan> {
    let (differences, plan) = compare(bundle, layer, recorded)?;
    if differences.is_empty() {
        Ok(plan)
    } else {
        Err(device_error(
            "compat",
            format!(
                "the checkpoint's GPUs do not fit this container's on this node: {}",
                differences.join("; ")
            ),
        ))
    }
}

/// A device step's error: `checkpoint failed at step device-lock: pid …` for the steps that
/// take device state out of the GPUs, `restore failed at step …` for those that put it back.
fn device_error(step: &'static str, message: String) -> Error {
    let operation = match step {
        "device-lock" | "device-checkpoint" | "find" | "load" | "inventory" | "assign" => {
            "checkpoint"
        }
        _ => "restore",
    };
    Error::Step {
        operation,
        step,
        message,
    }
}

fn step_error(step: &'static str, h: &Holder, e: &GpuError, undo_failed: Vec<String>) -> Error {
    let mut message = format!("{}: {e}", h.describe());
    if undo_failed.is_empty() {
        message.push_str("; every process is back on its GPUs, running");
    } else {
        message.push_str(&format!("; undo failed: {}", undo_failed.join("; ")));
    }
    device_error(step, message)
}

/// The pid of host process `pid` in its own (innermost) pid namespace.
pub fn ns_pid(pid: i32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// Process `pid`'s command name, for messages (`?` where it cannot be read).
pub(crate) fn comm(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

/// The lock timeout for a container: its pod's `gpu-ckpt.io/lock-timeout`, else the handler's
/// `DeviceLockTimeout`, else 30 s.
pub fn lock_timeout(
    annotation: Option<&str>,
    options: &RuntimeOptions,
) -> Result<std::time::Duration> {
    let handler = if options.device_lock_timeout.is_empty() {
        crate::options::DEFAULT_DEVICE_LOCK_TIMEOUT
    } else {
        crate::options::parse_timeout(&options.device_lock_timeout, "DeviceLockTimeout")?
    };
    let Some(v) = annotation else {
        return Ok(handler);
    };
    // The pod may ask for less than the handler's, never more: a lock's bound keeps the
    // container's lock, and so the operator's Kill, waiting.
    let pod = crate::options::parse_timeout(v, "annotation gpu-ckpt.io/lock-timeout")?;
    if pod > handler {
        return Err(Error::InvalidArgument(format!(
            "annotation gpu-ckpt.io/lock-timeout = {v:?} is longer than the handler's DeviceLockTimeout ({}s)",
            handler.as_secs_f64()
        )));
    }
    Ok(pod)
}

/// Kill of the container whose init is `init`: a driver call in flight on one of its
/// processes is abandoned (its worker killed), and later calls on that process fail at once,
/// so that the checkpoint holding the container's lock ends now rather than at the call's
/// bound, and the Kill that waits for that lock goes on.
pub fn abandon_calls_under(init: i32) {
    let Some(layers) = LAYERS.get() else { return };
    let layers: Vec<Arc<DeviceLayer>> = match layers.lock() {
        Ok(l) => l.values().cloned().collect(),
        Err(_) => return,
    };
    for layer in layers {
        for pid in layer.cuda.calls_in_flight() {
            if descends_from(pid, init) {
                layer.cuda.abandon(pid);
            }
        }
    }
}

/// Whether `pid` is `root` or one of its descendants (parents followed up to 64 levels).
fn descends_from(pid: i32, root: i32) -> bool {
    let mut p = pid;
    for _ in 0..64 {
        if p == root {
            return true;
        }
        match crate::process::parent_of(p) {
            Some(parent) if parent > 1 => p = parent,
            _ => return false,
        }
    }
    false
}

/// The GPUs the container of `bundle` was given: the createRuntime hook's record when it left
/// one, else resolved from the spec through the node's inventory.
pub fn assigned(bundle: &Bundle, inv: &NodeInventory) -> Result<Option<gpu::assign::Assigned>> {
    let recorded = bundle.join(compat::BUNDLE_GPUS_FILE);
    if let Ok(data) = std::fs::read(&recorded) {
        let a: gpu::assign::Assigned = serde_json::from_slice(&data)
            .map_err(Error::json(format!("parse {}", recorded.display())))?;
        return Ok((!a.gpus.is_empty()).then_some(a));
    }
    gpu::assign::from_spec(bundle.json(), inv).map_err(|e| device_error("assign", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu::{ComputeProcess, GpuInfo};
    use std::sync::Mutex as StdMutex;

    /// A driver that records the calls and fails the ones it is told to.
    #[derive(Default)]
    struct Recorder {
        calls: StdMutex<Vec<String>>,
        fail: Vec<(&'static str, i32)>,
        /// The failures are calls that did not return within their bound.
        unanswered: bool,
        /// How long each call takes.
        delay: Duration,
    }

    impl Recorder {
        fn call(&self, what: &'static str, pid: i32) -> std::result::Result<(), GpuError> {
            std::thread::sleep(self.delay);
            self.calls.lock().unwrap().push(format!("{what} {pid}"));
            if self.fail.contains(&(what, pid)) && self.unanswered {
                return Err(GpuError::Unanswered {
                    call: "cuCheckpointProcessLock".into(),
                    pid,
                    bound: Duration::from_secs(3),
                });
            }
            if self.fail.contains(&(what, pid)) {
                return Err(GpuError::Driver {
                    call: "cuCheckpointProcessLock",
                    pid: Some(pid),
                    code: 909,
                    name: "CUDA_ERROR_TIMEOUT".into(),
                });
            }
            Ok(())
        }
    }

    struct Shared(Arc<Recorder>);

    impl DeviceCheckpoint for Shared {
        fn lock(&self, pid: i32, _: Option<Duration>) -> std::result::Result<(), GpuError> {
            self.0.call("lock", pid)
        }
        fn checkpoint(&self, pid: i32) -> std::result::Result<(), GpuError> {
            self.0.call("checkpoint", pid)
        }
        fn restore(&self, pid: i32, _: &[GpuPair]) -> std::result::Result<(), GpuError> {
            self.0.call("restore", pid)
        }
        fn unlock(&self, pid: i32) -> std::result::Result<(), GpuError> {
            self.0.call("unlock", pid)
        }
        fn state(&self, _: i32) -> std::result::Result<ProcessState, GpuError> {
            Ok(ProcessState::RUNNING)
        }
        fn restore_thread_id(&self, pid: i32) -> std::result::Result<i32, GpuError> {
            Ok(pid)
        }
        fn driver_version(&self) -> std::result::Result<i32, GpuError> {
            Ok(13000)
        }
    }

    struct NoGpus;
    impl Inventory for NoGpus {
        fn node(&self) -> std::result::Result<NodeInventory, GpuError> {
            Ok(NodeInventory {
                driver_version: String::new(),
                cuda_driver_version: 0,
                gpus: Vec::<GpuInfo>::new(),
            })
        }
        fn compute_processes(&self) -> std::result::Result<Vec<ComputeProcess>, GpuError> {
            Ok(Vec::new())
        }
    }

    fn holder(pid: i32) -> Holder {
        Holder {
            pid,
            ns_pid: pid as u32,
            comm: "t".into(),
            gpus: vec![(GpuUuid([1; 16]), 1)],
        }
    }

    fn layer(fail: Vec<(&'static str, i32)>) -> (DeviceLayer, Arc<Recorder>) {
        let rec = Arc::new(Recorder {
            fail,
            ..Default::default()
        });
        (
            DeviceLayer::new(Box::new(Shared(rec.clone())), Box::new(NoGpus)),
            rec,
        )
    }

    /// The calls the driver saw, in phases: within each phase (the calls run at once) in
    /// sorted order; `phases` gives how many calls each phase has, in order.
    fn phased(calls: &[String], phases: &[usize]) -> Vec<Vec<String>> {
        assert_eq!(
            calls.len(),
            phases.iter().sum::<usize>(),
            "calls: {calls:?}, phases {phases:?}"
        );
        let mut out = Vec::new();
        let mut at = 0;
        for n in phases {
            let mut p = calls[at..at + n].to_vec();
            p.sort();
            out.push(p);
            at += n;
        }
        out
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn quiesce_locks_all_then_checkpoints_all() {
        let (l, rec) = layer(vec![]);
        l.quiesce(
            &[holder(1), holder(2)],
            Duration::from_secs(1),
            &Storage::Staged,
        )
        .unwrap();
        assert_eq!(
            phased(&rec.calls.lock().unwrap(), &[2, 2]),
            [
                strings(&["lock 1", "lock 2"]),
                strings(&["checkpoint 1", "checkpoint 2"])
            ]
        );
    }

    /// A driver whose every call takes 200 ms: the device steps of four processes take about
    /// as long as one process's, not four times that.
    #[test]
    fn the_steps_of_every_process_run_at_once() {
        let rec = Arc::new(Recorder {
            delay: Duration::from_millis(200),
            ..Default::default()
        });
        let l = DeviceLayer::new(Box::new(Shared(rec.clone())), Box::new(NoGpus));
        let holders: Vec<Holder> = (1..=4).map(holder).collect();
        let t = Instant::now();
        let q = l
            .quiesce(&holders, Duration::from_secs(1), &Storage::Staged)
            .unwrap();
        l.resume(&holders, &Storage::Staged, &q.files)
            .map_err(|(e, _)| e)
            .unwrap();
        let took = t.elapsed();
        // Four steps of 200 ms each, one process after another, would take 3.2 s.
        assert!(took < Duration::from_millis(1600), "{took:?}");
        assert!(q.lock >= Duration::from_millis(200) && q.checkpoint >= Duration::from_millis(200));
        assert_eq!(rec.calls.lock().unwrap().len(), 16);
    }

    #[test]
    fn a_lock_failure_unlocks_what_was_locked() {
        let (l, rec) = layer(vec![("lock", 3)]);
        let err = l
            .quiesce(
                &[holder(1), holder(2), holder(3)],
                Duration::from_secs(1),
                &Storage::Staged,
            )
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("device-lock") && err.contains("pid 3"),
            "{err}"
        );
        assert!(err.contains("CUDA_ERROR_TIMEOUT"), "{err}");
        assert_eq!(
            phased(&rec.calls.lock().unwrap(), &[3, 2]),
            [
                strings(&["lock 1", "lock 2", "lock 3"]),
                strings(&["unlock 1", "unlock 2"])
            ]
        );
    }

    /// Quiesce of pids 1 and 2 where `step` on pid 2 does not return within its bound: the
    /// error, and the calls the driver saw.
    fn quiesce_unanswered(step: &'static str) -> (String, Vec<String>) {
        let rec = Arc::new(Recorder {
            fail: vec![(step, 2)],
            unanswered: true,
            ..Default::default()
        });
        let l = DeviceLayer::new(Box::new(Shared(rec.clone())), Box::new(NoGpus));
        let err = l
            .quiesce(
                &[holder(1), holder(2)],
                Duration::from_secs(1),
                &Storage::Staged,
            )
            .unwrap_err()
            .to_string();
        let calls = rec.calls.lock().unwrap().clone();
        (err, calls)
    }

    #[test]
    fn a_lock_past_its_bound_is_unlocked_too() {
        let (err, calls) = quiesce_unanswered("lock");
        assert!(
            err.contains("device-lock")
                && err.contains("cuCheckpointProcessLock(pid 2) did not return within 3s"),
            "{err}"
        );
        assert!(err.contains("every process is back on its GPUs"), "{err}");
        // The lock past its bound is undone first, then every other locked one.
        assert_eq!(
            phased(&calls, &[2, 1, 1]),
            [
                strings(&["lock 1", "lock 2"]),
                strings(&["unlock 2"]),
                strings(&["unlock 1"])
            ]
        );
    }

    #[test]
    fn a_checkpoint_past_its_bound_is_restored_too() {
        let (err, calls) = quiesce_unanswered("checkpoint");
        assert!(err.contains("device-checkpoint"), "{err}");
        // The checkpoint past its bound is restored first; then both are put back (the other
        // restored and unlocked, this one unlocked), at once.
        let p = phased(&calls, &[2, 2, 1, 3]);
        assert_eq!(p[0], strings(&["lock 1", "lock 2"]));
        assert_eq!(p[1], strings(&["checkpoint 1", "checkpoint 2"]));
        assert_eq!(p[2], strings(&["restore 2"]));
        assert_eq!(p[3], strings(&["restore 1", "unlock 1", "unlock 2"]));
        let at = |c: &str| calls.iter().position(|x| x == c).unwrap();
        assert!(at("restore 1") < at("unlock 1"), "{calls:?}");
    }

    #[test]
    fn a_checkpoint_failure_restores_and_unlocks_in_reverse() {
        let (l, rec) = layer(vec![("checkpoint", 2)]);
        let err = l
            .quiesce(
                &[holder(1), holder(2), holder(3)],
                Duration::from_secs(1),
                &Storage::Staged,
            )
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("device-checkpoint") && err.contains("pid 2"),
            "{err}"
        );
        // Every checkpoint ran at once; the checkpointed are restored, then all unlocked.
        let calls = rec.calls.lock().unwrap().clone();
        let p = phased(&calls, &[3, 3, 5]);
        assert_eq!(p[0], strings(&["lock 1", "lock 2", "lock 3"]));
        assert_eq!(
            p[1],
            strings(&["checkpoint 1", "checkpoint 2", "checkpoint 3"])
        );
        assert_eq!(
            p[2],
            strings(&["restore 1", "restore 3", "unlock 1", "unlock 2", "unlock 3"])
        );
        let at = |c: &str| calls.iter().position(|x| x == c).unwrap();
        assert!(at("restore 1") < at("unlock 1") && at("restore 3") < at("unlock 3"));
    }

    #[test]
    fn lock_timeout_sources() {
        let mut o = RuntimeOptions::default();
        assert_eq!(
            lock_timeout(None, &o).unwrap(),
            crate::options::DEFAULT_DEVICE_LOCK_TIMEOUT
        );
        o.device_lock_timeout = "2m".into();
        assert_eq!(lock_timeout(None, &o).unwrap(), Duration::from_secs(120));
        assert_eq!(
            lock_timeout(Some("500ms"), &o).unwrap(),
            Duration::from_millis(500)
        );
        assert_eq!(lock_timeout(Some("7"), &o).unwrap(), Duration::from_secs(7));
        let err = lock_timeout(Some("soon"), &o).unwrap_err().to_string();
        assert!(err.contains("gpu-ckpt.io/lock-timeout"), "{err}");
        // The pod may shorten the handler's, not lengthen it.
        let err = lock_timeout(Some("3m"), &o).unwrap_err().to_string();
        assert!(
            err.contains("longer than the handler's DeviceLockTimeout (120s)"),
            "{err}"
        );
        o.device_lock_timeout.clear();
        assert!(lock_timeout(Some("31s"), &o).is_err());
        assert_eq!(
            lock_timeout(Some("30s"), &o).unwrap(),
            Duration::from_secs(30)
        );
    }
}
