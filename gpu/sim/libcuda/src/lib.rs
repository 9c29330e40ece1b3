//! The simulated `libcuda.so.1`: the CUDA driver API under its real symbol names and C ABI.
//!
//! Device memory lives in `gpu-ckpt-simgpu`; this library keeps what a real libcuda keeps in the
//! process (contexts, streams, the allocation table, and at a checkpoint the device memory
//! itself) and talks to the daemon over one Unix socket. Every entry point passes the process's
//! gate, so a lock waits for calls in flight and holds new ones. The restore thread (created at
//! cuInit, named `cuda-restore`) carries out the daemon's lock, checkpoint, restore and unlock.
//! Operations on an idle stream run when called; behind pending work (a host function, such as
//! the simulated NCCL's collectives) they are queued in stream order (`streams`). Kernels are
//! not run (CUDA_ERROR_NOT_SUPPORTED).
//!
//! Like the real driver, it finds its GPUs from the device nodes it can open (`/dev/nvidia<N>`
//! in a container, N being the GPU's minor number), holds `nvidiactl`, `nvidia-uvm` and each
//! GPU's node open while it has a context there, closes them all at a checkpoint (the process
//! then holds no GPU resource), and opens the nodes of the GPUs a restore maps it onto.
#![allow(clippy::missing_safety_doc)] // C entry points; their contracts are NVIDIA's documentation.

mod streams;

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Condvar, Mutex, MutexGuard, Once, OnceLock, RwLock};
use std::time::{Duration, Instant};

use simgpu::client::{CallError, Client};
use simgpu::cuerr::{self, cu};
use simgpu::mailbox::{self, Mailbox};
use simgpu::node::{GpuDesc, NodeDesc};
use simgpu::proto::{CkptCall, MappedRange, Pair, Reply, Request, Role, SavedAlloc};
use simgpu::{
    CUSTOM_STORAGE_SINCE, STATE_CHECKPOINTED, STATE_CHECKPOINTING, STATE_LOCKED, STATE_RESTORING,
    STATE_RUNNING,
};

type CUresult = c_uint;
type CUdevice = c_int;
type CUcontext = *mut c_void;
type CUstream = *mut c_void;
type CUevent = *mut c_void;
type CUdeviceptr = u64;

type R<T = ()> = Result<T, CUresult>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether an MPS control daemon serves this process, as the driver finds one: a live `control`
/// socket in `$CUDA_MPS_PIPE_DIRECTORY` (default `/tmp/nvidia-mps`). Its contexts then go through
/// the MPS server, and NVML lists the process as an MPS client.
fn mps_server() -> bool {
    let dir = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp/nvidia-mps"));
    std::os::unix::net::UnixStream::connect(dir.join("control")).is_ok()
}

fn map_err(e: CallError) -> CUresult {
    e.code()
}

/// Writes through an out-pointer; NULL is CUDA_ERROR_INVALID_VALUE.
fn out<T>(p: *mut T, v: T) -> R {
    if p.is_null() {
        return Err(cu::INVALID_VALUE);
    }
    // SAFETY: the caller passed a pointer to a T, as the API requires.
    unsafe { p.write(v) };
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The process's driver state
// ---------------------------------------------------------------------------------------------

struct Gate {
    state: u32,
    /// A lock is waiting for calls in flight; new calls wait.
    locking: bool,
    inflight: u32,
}

struct Ctx {
    dev: usize,
}

#[derive(Default)]
struct Handles {
    ctxs: HashMap<usize, Ctx>,
    /// Per device: the primary context's handle and its retain count.
    primary: HashMap<usize, (usize, u32)>,
    streams: HashMap<usize, usize>,
    events: HashMap<usize, Option<Instant>>,
    /// Page-locked host allocations (`cuMemHostAlloc`, `cuMemAllocHost`): base -> size.
    host: BTreeMap<usize, usize>,
    next: usize,
}

impl Handles {
    fn new_handle(&mut self) -> usize {
        self.next += 1;
        0x5100_0000 + self.next * 0x10
    }
}

struct Driver {
    socket: PathBuf,
    /// Where the GPUs' device nodes are (`/dev` in a container).
    dev: Mutex<PathBuf>,
    /// The device nodes this process holds open, by path.
    nodes: Mutex<BTreeMap<PathBuf, std::fs::File>>,
    conn: Mutex<Option<Client>>,
    gate: Mutex<Gate>,
    cv: Condvar,
    node: RwLock<NodeDesc>,
    mailbox: Mailbox,
    /// Device pointer → (device ordinal, size).
    allocs: Mutex<BTreeMap<u64, (usize, u64)>>,
    /// Device memory held in this process while it is checkpointed.
    saved: Mutex<Vec<(SavedAlloc, Vec<u8>)>>,
    handles: Mutex<Handles>,
    /// Custom-storage operations this process started, by the handle it gave out.
    ops: Mutex<HashMap<usize, CustomOp>>,
    /// Work queued in stream order.
    streams: streams::Streams,
}

/// `CUcheckpointCustomStoragePerDeviceData` (cuda.h 13.4): 24 bytes.
#[repr(C)]
struct PerDeviceData {
    dev_ptr: CUdeviceptr,
    size: usize,
    stream: CUstream,
}

/// `CUcheckpointCustomStorageInfo` (cuda.h 13.4): handle, perDeviceData, deviceCount.
#[repr(C)]
struct CustomStorageInfo {
    handle: *mut c_void,
    per_device_data: *mut PerDeviceData,
    device_count: c_uint,
}

/// What this library allocated for one custom-storage operation (freed at its completion).
struct CustomOp {
    daemon_handle: u64,
    /// Box<CustomStorageInfo> and Box<[PerDeviceData]> as raw addresses (and the array length).
    info: usize,
    per_device: usize,
    count: usize,
    streams: Vec<usize>,
}

const _: () = assert!(std::mem::size_of::<PerDeviceData>() == 24);
const _: () = assert!(std::mem::size_of::<CustomStorageInfo>() == 24);

thread_local! {
    /// This thread's context stack; the top is current.
    static CTX_STACK: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

static DRIVER: OnceLock<R<Driver>> = OnceLock::new();
static RESTORE_THREAD: Once = Once::new();

fn drv() -> R<&'static Driver> {
    match DRIVER.get() {
        Some(Ok(d)) => Ok(d),
        Some(Err(c)) => Err(*c),
        None => Err(cu::NOT_INITIALIZED),
    }
}

fn own_socket() -> PathBuf {
    let lib = simgpu::library_file_of(cuInit as *const () as usize);
    simgpu::socket_path(lib.as_deref())
}

fn fetch_node(c: &mut Client) -> R<NodeDesc> {
    match c.call(&Request::Node).map_err(map_err)? {
        Reply::Node(n) => Ok(n),
        _ => Err(cu::UNKNOWN),
    }
}

/// Only the GPUs this process may see: those whose device node is in `dev`.
fn visible(mut node: NodeDesc, dev: &Path) -> NodeDesc {
    simgpu::retain_visible(&mut node, dev);
    node
}

/// The GPUs a restored process's device ordinals name on this node, in the order of `old` (the
/// GPUs they named before the checkpoint): an old GPU listed in `map` (the caller's GPU pairs,
/// as the daemon checked them) becomes its pair's target; any other keeps its UUID when this
/// process can see that GPU here, else takes the next GPU it can see that no ordinal has taken.
/// Ordinals for which no GPU is left (this node shows the process fewer GPUs than it saw) are
/// dropped from the end.
fn restored_ordinals(
    old: &[GpuDesc],
    map: &[Pair],
    fresh: &NodeDesc,
    seen: &NodeDesc,
) -> Vec<GpuDesc> {
    let on_node = |u: &[u8; 16]| fresh.gpus.iter().find(|n| n.uuid == *u);
    let mut chosen: Vec<Option<GpuDesc>> = old
        .iter()
        .map(|g| {
            map.iter()
                .find(|p| p.0 == g.uuid)
                .and_then(|p| on_node(&p.1))
                .cloned()
        })
        .collect();
    let taken =
        |chosen: &[Option<GpuDesc>], u: &[u8; 16]| chosen.iter().flatten().any(|c| c.uuid == *u);
    for i in 0..old.len() {
        if chosen[i].is_none() && !taken(&chosen, &old[i].uuid) {
            chosen[i] = seen.gpus.iter().find(|n| n.uuid == old[i].uuid).cloned();
        }
    }
    for i in 0..old.len() {
        if chosen[i].is_none() {
            chosen[i] = seen.gpus.iter().find(|n| !taken(&chosen, &n.uuid)).cloned();
        }
    }
    chosen.into_iter().map_while(|c| c).collect()
}

/// Opens the device nodes in `dev` of the GPUs with minor numbers `minors` and the common
/// nodes a GPU process holds (`nvidiactl`, `nvidia-uvm`), as the driver opens them.
fn open_nodes(
    dev: &Path,
    minors: impl IntoIterator<Item = u32>,
) -> R<Vec<(PathBuf, std::fs::File)>> {
    let common = ["nvidiactl", "nvidia-uvm"].map(|n| dev.join(n));
    let gpus = minors.into_iter().map(|m| simgpu::gpu_node(dev, m));
    common
        .into_iter()
        .chain(gpus)
        .map(|path| {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|e| match e.kind() {
                    std::io::ErrorKind::NotFound => cu::NO_DEVICE,
                    _ => cu::OPERATING_SYSTEM,
                })?;
            Ok((path, f))
        })
        .collect()
}

impl Driver {
    fn init() -> R<Driver> {
        let socket = own_socket();
        // No daemon is what a node without a GPU driver looks like.
        let mut c = Client::connect(&socket, Role::Cuda).map_err(|_| cu::NO_DEVICE)?;
        let dev = simgpu::dev_dir(&socket);
        let node = visible(fetch_node(&mut c)?, &dev);
        let mailbox = Mailbox::create().map_err(|_| cu::OPERATING_SYSTEM)?;
        mailbox.get().state.store(STATE_RUNNING, Ordering::Release);
        Ok(Driver {
            socket,
            dev: Mutex::new(dev),
            nodes: Mutex::new(BTreeMap::new()),
            conn: Mutex::new(Some(c)),
            gate: Mutex::new(Gate {
                state: STATE_RUNNING,
                locking: false,
                inflight: 0,
            }),
            cv: Condvar::new(),
            node: RwLock::new(node),
            mailbox,
            allocs: Mutex::new(BTreeMap::new()),
            saved: Mutex::new(Vec::new()),
            handles: Mutex::new(Handles::default()),
            ops: Mutex::new(HashMap::new()),
            streams: streams::Streams::default(),
        })
    }

    /// Passes the gate: waits while the process is locked or being locked.
    fn enter(&self) -> InFlight<'_> {
        let mut g = lock(&self.gate);
        while g.state != STATE_RUNNING || g.locking {
            g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
        g.inflight += 1;
        InFlight(self)
    }

    /// Runs `f` on the daemon connection, inside the gate.
    fn with_conn<T>(&self, f: impl FnOnce(&mut Client) -> Result<T, CallError>) -> R<T> {
        let _g = self.enter();
        let mut conn = lock(&self.conn);
        let c = conn.as_mut().ok_or(cu::OPERATING_SYSTEM)?;
        f(c).map_err(map_err)
    }

    fn device(&self, dev: CUdevice) -> R<GpuDesc> {
        let node = self.node.read().unwrap_or_else(|p| p.into_inner());
        usize::try_from(dev)
            .ok()
            .and_then(|i| node.gpus.get(i).cloned())
            .ok_or(cu::INVALID_DEVICE)
    }

    fn current_dev(&self) -> R<usize> {
        let top = CTX_STACK
            .with(|s| s.borrow().last().copied())
            .ok_or(cu::INVALID_CONTEXT)?;
        lock(&self.handles)
            .ctxs
            .get(&top)
            .map(|c| c.dev)
            .ok_or(cu::INVALID_CONTEXT)
    }

    /// A context on device `dev`: the daemon told, the GPU's node (and the common ones) held.
    fn announce_context(&self, dev: usize) -> R {
        let gpu = self.device(dev as CUdevice)?;
        let mps = mps_server();
        self.with_conn(|c| c.ok(&Request::Context { gpu: gpu.uuid, mps }))?;
        let dir = lock(&self.dev).clone();
        self.hold(open_nodes(&dir, [gpu.index])?);
        Ok(())
    }

    fn hold(&self, opened: Vec<(PathBuf, std::fs::File)>) {
        let mut nodes = lock(&self.nodes);
        for (path, f) in opened {
            nodes.entry(path).or_insert(f);
        }
    }

    // ---- the restore thread's side of the checkpoint API ------------------------------------

    fn set_state(&self, g: &mut Gate, state: u32) {
        g.state = state;
        self.mailbox.get().state.store(state, Ordering::Release);
        self.cv.notify_all();
    }

    fn do_lock(&self, timeout_ms: u32, flags: u32) -> CUresult {
        let mut g = lock(&self.gate);
        if g.state != STATE_RUNNING || g.locking {
            return cu::ILLEGAL_STATE;
        }
        g.locking = true;
        let deadline =
            (timeout_ms > 0).then(|| Instant::now() + Duration::from_millis(u64::from(timeout_ms)));
        let stall = flags & mailbox::flags::STALL != 0;
        while g.inflight > 0 || stall {
            let wait = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(w) if !w.is_zero() => w,
                    _ => {
                        g.locking = false;
                        self.cv.notify_all();
                        return cu::TIMEOUT;
                    }
                },
                None => Duration::from_secs(1),
            };
            g = self
                .cv
                .wait_timeout(g, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        g.locking = false;
        self.set_state(&mut g, STATE_LOCKED);
        cu::SUCCESS
    }

    fn do_unlock(&self) -> CUresult {
        let mut g = lock(&self.gate);
        if g.state != STATE_LOCKED {
            return cu::ILLEGAL_STATE;
        }
        self.set_state(&mut g, STATE_RUNNING);
        cu::SUCCESS
    }

    /// The UUIDs of the GPUs on which this process holds a retained primary context.
    fn primaries(&self) -> Vec<[u8; 16]> {
        let node = self.node.read().unwrap_or_else(|p| p.into_inner());
        lock(&self.handles)
            .primary
            .iter()
            .filter(|(_, p)| p.1 > 0)
            .filter_map(|(dev, _)| node.gpus.get(*dev).map(|g| g.uuid))
            .collect()
    }

    /// The GPUs this process holds state on: those with a context or an allocation.
    fn used_devices(&self) -> BTreeSet<usize> {
        let mut devs: BTreeSet<usize> = lock(&self.handles).ctxs.values().map(|c| c.dev).collect();
        devs.extend(lock(&self.allocs).values().map(|a| a.0));
        devs
    }

    fn do_checkpoint(&self, custom: bool) -> CUresult {
        match self.checkpoint_inner(custom) {
            Ok(()) => cu::SUCCESS,
            Err(c) => c,
        }
    }

    /// Custom storage: the caller finished its copies.
    fn do_complete(&self) -> CUresult {
        let mut g = lock(&self.gate);
        match g.state {
            STATE_CHECKPOINTING => {
                self.set_state(&mut g, STATE_CHECKPOINTED);
                cu::SUCCESS
            }
            STATE_RESTORING => {
                self.mailbox.get().custom.store(0, Ordering::Release);
                self.set_state(&mut g, STATE_LOCKED);
                cu::SUCCESS
            }
            _ => cu::ILLEGAL_STATE,
        }
    }

    /// Releases the device: the memory comes into this process (or, with custom storage, goes
    /// to the caller's mapping and only its layout stays here), the connection closes.
    fn checkpoint_inner(&self, custom: bool) -> R {
        if lock(&self.gate).state != STATE_LOCKED {
            return Err(cu::ILLEGAL_STATE);
        }
        let node = self.node.read().unwrap_or_else(|p| p.into_inner()).clone();
        let mut conn = lock(&self.conn);
        let c = conn.as_mut().ok_or(cu::OPERATING_SYSTEM)?;
        let allocs = lock(&self.allocs).clone();
        let mut saved = Vec::with_capacity(allocs.len());
        let mut bytes: BTreeMap<usize, u64> =
            self.used_devices().into_iter().map(|d| (d, 0)).collect();
        for (&ptr, &(dev, size)) in &allocs {
            let gpu = node.gpus.get(dev).ok_or(cu::INVALID_DEVICE)?;
            let mut data = Vec::new();
            if !custom {
                data = simgpu::zeroed_buffer(size as usize);
                c.dtoh(&mut data, ptr).map_err(map_err)?;
            }
            *bytes.entry(dev).or_default() += size;
            saved.push((
                SavedAlloc {
                    ptr,
                    gpu: gpu.uuid,
                    size,
                },
                data,
            ));
        }
        if bytes.len() > mailbox::MAX_GPUS {
            return Err(cu::NOT_SUPPORTED);
        }
        let page = self.mailbox.plain();
        for (slot, (&dev, &b)) in page.gpus.iter_mut().zip(&bytes) {
            let gpu = &node.gpus[dev];
            slot.uuid = gpu.uuid;
            slot.bytes = b;
            mailbox::put_name(&mut slot.name, &gpu.name);
        }
        self.mailbox
            .get()
            .ngpus
            .store(bytes.len() as u32, Ordering::Release);
        let req = if custom {
            Request::Handover
        } else {
            Request::Release
        };
        c.ok(&req).map_err(map_err)?;
        // Closing the connection and the device nodes (no GPU resource is left in the
        // process) is what lets CRIU dump it.
        *conn = None;
        lock(&self.nodes).clear();
        *lock(&self.saved) = saved;
        self.mailbox
            .get()
            .custom
            .store(u32::from(custom), Ordering::Release);
        let mut g = lock(&self.gate);
        let state = if custom {
            STATE_CHECKPOINTING
        } else {
            STATE_CHECKPOINTED
        };
        self.set_state(&mut g, state);
        Ok(())
    }

    fn do_restore(&self, custom: bool) -> CUresult {
        match self.restore_inner(custom) {
            Ok(()) => cu::SUCCESS,
            Err(c) => c,
        }
    }

    /// Reconnects and gets the allocations back at their addresses; their bytes come from this
    /// process (or, with custom storage, from the caller, before the operation completes).
    fn restore_inner(&self, custom: bool) -> R {
        if lock(&self.gate).state != STATE_CHECKPOINTED {
            return Err(cu::ILLEGAL_STATE);
        }
        // The daemon's own path first (a process restored on the host), then this library's
        // (a container, where the CDI spec mounts the socket).
        let mut candidates: Vec<PathBuf> = self
            .mailbox
            .socket()
            .map(PathBuf::from)
            .into_iter()
            .collect();
        candidates.push(self.socket.clone());
        candidates.push(own_socket());
        let (mut c, socket) = candidates
            .iter()
            .find_map(|p| Client::connect(p, Role::Cuda).ok().map(|c| (c, p)))
            .ok_or(cu::OPERATING_SYSTEM)?;
        let dev = simgpu::dev_dir(socket);
        let mut saved = lock(&self.saved);
        let allocs: Vec<SavedAlloc> = saved.iter().map(|(a, _)| a.clone()).collect();
        let map: Vec<Pair> = match c.call(&Request::Restore { allocs }).map_err(map_err)? {
            Reply::RestoreMap(m) => m,
            _ => return Err(cu::UNKNOWN),
        };
        // The process keeps every device ordinal it had, each now naming a GPU of this node.
        let fresh = fetch_node(&mut c)?;
        let mut node = self.node.write().unwrap_or_else(|p| p.into_inner());
        let gpus = restored_ordinals(&node.gpus, &map, &fresh, &visible(fresh.clone(), &dev));
        if self.used_devices().iter().any(|&d| d >= gpus.len()) {
            // Fewer GPUs here than the process used: an ordinal it holds state on would go.
            return Err(cu::INVALID_DEVICE);
        }
        if !custom {
            for (a, data) in saved.iter() {
                c.htod(a.ptr, data).map_err(map_err)?;
            }
        }
        *node = NodeDesc { gpus, ..fresh };
        let devs: Vec<GpuDesc> = self
            .used_devices()
            .into_iter()
            .filter_map(|d| node.gpus.get(d).cloned())
            .collect();
        drop(node);
        // The GPUs are acquired again: their device nodes here, which a container must have.
        let opened = open_nodes(&dev, devs.iter().map(|g| g.index))?;
        let mps = mps_server();
        for gpu in &devs {
            c.ok(&Request::Context { gpu: gpu.uuid, mps })
                .map_err(map_err)?;
        }
        self.hold(opened);
        *lock(&self.dev) = dev;
        *lock(&self.conn) = Some(c);
        saved.clear();
        saved.shrink_to_fit();
        let mut g = lock(&self.gate);
        let state = if custom {
            STATE_RESTORING
        } else {
            STATE_LOCKED
        };
        self.set_state(&mut g, state);
        Ok(())
    }

    fn restore_thread(&'static self) {
        let mut seen = self.mailbox.get().cmd_seq.load(Ordering::Acquire);
        loop {
            let seq = self.mailbox.wait_command(seen);
            seen = seq;
            let l = self.mailbox.get();
            let flags = l.cmd_flags.load(Ordering::Acquire);
            let custom = flags & mailbox::flags::CUSTOM != 0;
            let code = match l.cmd.load(Ordering::Acquire) {
                mailbox::cmd::LOCK => self.do_lock(l.cmd_arg.load(Ordering::Acquire), flags),
                mailbox::cmd::CHECKPOINT => self.do_checkpoint(custom),
                mailbox::cmd::RESTORE => self.do_restore(custom),
                mailbox::cmd::UNLOCK => self.do_unlock(),
                mailbox::cmd::COMPLETE => self.do_complete(),
                _ => cu::INVALID_VALUE,
            };
            self.mailbox.answer(seq, code);
        }
    }
}

struct InFlight<'a>(&'a Driver);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut g = lock(&self.0.gate);
        g.inflight -= 1;
        if g.inflight == 0 {
            self.0.cv.notify_all();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------------------------

/// Defines `extern "C"` entry points returning CUresult; a panic becomes CUDA_ERROR_UNKNOWN.
macro_rules! entry {
    ($( fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) $body:block )*) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
            let run = std::panic::AssertUnwindSafe(|| -> R { $body });
            match std::panic::catch_unwind(run) {
                Ok(Ok(())) => cu::SUCCESS,
                Ok(Err(code)) => code,
                Err(_) => cu::UNKNOWN,
            }
        }
    )*};
}

fn copy_cstr(dst: *mut c_char, len: c_int, s: &str) -> R {
    if dst.is_null() || len <= 0 {
        return Err(cu::INVALID_VALUE);
    }
    let bytes = s.as_bytes();
    let n = bytes.len().min(len as usize - 1);
    // SAFETY: the caller gave a buffer of len bytes; we write n + 1 <= len.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst.cast::<u8>(), n);
        *dst.add(n) = 0;
    }
    Ok(())
}

fn stream_ok(d: &Driver, s: CUstream) -> R {
    if s.is_null() || s as usize == 1 || s as usize == 2 {
        // NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD
        return Ok(());
    }
    if lock(&d.handles).streams.contains_key(&(s as usize)) {
        Ok(())
    } else {
        Err(cu::INVALID_HANDLE)
    }
}

/// A synchronous copy or memset: it needs a current context and, on the legacy default stream,
/// waits for the work of every blocking stream first.
fn sync_op(job: impl FnOnce() -> R) -> R {
    let d = drv()?;
    d.current_dev()?;
    d.streams.wait_legacy();
    job()
}

/// An asynchronous copy or memset on `stream`, in stream order.
fn async_op(stream: CUstream, job: impl FnOnce() -> R + Send + 'static) -> R {
    let d = stream_call(stream)?;
    d.streams.order(streams::key(stream), job)
}

/// A copy on `stream` that returns once it is done: after the stream's earlier work.
fn stream_sync_op(stream: CUstream, job: impl FnOnce() -> R) -> R {
    let d = stream_call(stream)?;
    d.streams.wait_idle(streams::key(stream));
    job()
}

/// The checks of a call on `stream`: a valid stream and a current context.
fn stream_call(stream: CUstream) -> R<&'static Driver> {
    let d = drv()?;
    stream_ok(d, stream)?;
    d.current_dev()?;
    Ok(d)
}

fn htod(dst: CUdeviceptr, src: *const c_void, n: usize) -> R {
    sync_op(|| copy_htod(dst, src as usize, n))
}

fn dtoh(dst: *mut c_void, src: CUdeviceptr, n: usize) -> R {
    sync_op(|| copy_dtoh(dst as usize, src, n))
}

fn dtod(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> R {
    sync_op(|| copy_dtod(dst, src, n))
}

fn memset(dst: CUdeviceptr, value: u32, elem: u8, count: usize) -> R {
    sync_op(|| fill(dst, value, elem, count))
}

/// Whether the `n` bytes at `p` lie in one page-locked allocation of this process. CUDA's
/// asynchronous copies are asynchronous only for such memory: from pageable memory the source
/// is staged before the call returns, into it the call returns once the copy is done.
fn pinned(p: usize, n: usize) -> R<bool> {
    let d = drv()?;
    let handles = lock(&d.handles);
    Ok(handles
        .host
        .range(..=p)
        .next_back()
        .is_some_and(|(base, size)| p.saturating_add(n) <= base.saturating_add(*size)))
}

/// The `n` host bytes at `src` (empty for `n` 0), refusing a null pointer.
fn read_host<'a>(src: *const c_void, n: usize) -> R<&'a [u8]> {
    if n == 0 {
        return Ok(&[]);
    }
    if src.is_null() {
        return Err(cu::INVALID_VALUE);
    }
    // SAFETY: the caller passed n readable bytes at src, which it keeps through the call.
    Ok(unsafe { std::slice::from_raw_parts(src.cast::<u8>(), n) })
}

/// Host memory at `src` (an address: the copy may run on a stream's worker) to the device.
fn copy_htod(dst: CUdeviceptr, src: usize, n: usize) -> R {
    write_device(dst, read_host(src as *const c_void, n)?)
}

/// `bytes` to device memory at `dst`.
fn write_device(dst: CUdeviceptr, bytes: &[u8]) -> R {
    let d = drv()?;
    if bytes.is_empty() {
        return Ok(());
    }
    d.with_conn(|c| c.htod(dst, bytes))
}

fn copy_dtoh(dst: usize, src: CUdeviceptr, n: usize) -> R {
    let d = drv()?;
    let dst = dst as *mut c_void;
    if n == 0 {
        return Ok(());
    }
    if dst.is_null() {
        return Err(cu::INVALID_VALUE);
    }
    // SAFETY: the caller passed n writable bytes at dst.
    let bytes = unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), n) };
    d.with_conn(|c| c.dtoh(bytes, src))
}

fn copy_dtod(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> R {
    let d = drv()?;
    if n == 0 {
        return Ok(());
    }
    d.with_conn(|c| {
        c.ok(&Request::DtoD {
            dst,
            src,
            len: n as u64,
        })
    })
}

fn fill(dst: CUdeviceptr, value: u32, elem: u8, count: usize) -> R {
    let d = drv()?;
    if count == 0 {
        return Ok(());
    }
    d.with_conn(|c| {
        c.ok(&Request::Memset {
            dst,
            value,
            elem,
            count: count as u64,
        })
    })
}

/// Logs once that the simulator runs no kernels.
fn no_kernels(call: &str) -> R {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        eprintln!("gpu-ckpt simulated libcuda: {call}: kernels are not supported (no GPU); CUDA_ERROR_NOT_SUPPORTED");
    });
    Err(cu::NOT_SUPPORTED)
}

fn ckpt(call: CkptCall) -> R<Reply> {
    let d = drv()?;
    d.with_conn(|c| c.call(&Request::Ckpt(call)))
}

/// The `customStorageInfo_out` pointer at `offset` of an argument struct, where the node's CUDA
/// version has custom storage (NULL otherwise, or when not set).
fn custom_out(d: &Driver, raw: &[u8], offset: usize) -> R<*mut *mut CustomStorageInfo> {
    if d.node
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .cuda_version
        < CUSTOM_STORAGE_SINCE
    {
        return Ok(std::ptr::null_mut());
    }
    let bytes: [u8; 8] = raw
        .get(offset..offset + 8)
        .and_then(|b| b.try_into().ok())
        .ok_or(cu::INVALID_VALUE)?;
    Ok(u64::from_le_bytes(bytes) as usize as *mut *mut CustomStorageInfo)
}

/// A custom-storage answer: the driver-owned CUcheckpointCustomStorageInfo, with a stream of the
/// primary context of each range's GPU, stored through `out_pp`.
fn custom_reply(d: &Driver, reply: Reply, out_pp: *mut *mut CustomStorageInfo) -> R {
    let (daemon_handle, ranges) = match reply {
        Reply::Ok if out_pp.is_null() => return Ok(()),
        Reply::Custom { handle, ranges } if !out_pp.is_null() => (handle, ranges),
        _ => return Err(cu::UNKNOWN),
    };
    let node = d.node.read().unwrap_or_else(|p| p.into_inner()).clone();
    let mut h = lock(&d.handles);
    let mut streams = Vec::new();
    let mut per: Vec<PerDeviceData> = Vec::with_capacity(ranges.len());
    for MappedRange { gpu, ptr, size } in &ranges {
        let dev = node.gpus.iter().position(|g| &g.uuid == gpu).unwrap_or(0);
        let stream = h.new_handle();
        h.streams.insert(stream, dev);
        streams.push(stream);
        per.push(PerDeviceData {
            dev_ptr: *ptr,
            size: *size as usize,
            stream: stream as CUstream,
        });
    }
    let handle = h.new_handle();
    drop(h);
    let count = per.len();
    let per_device = Box::into_raw(per.into_boxed_slice()) as *mut PerDeviceData;
    let info = Box::into_raw(Box::new(CustomStorageInfo {
        handle: handle as *mut c_void,
        per_device_data: if count == 0 {
            std::ptr::null_mut()
        } else {
            per_device
        },
        device_count: count as c_uint,
    }));
    lock(&d.ops).insert(
        handle,
        CustomOp {
            daemon_handle,
            info: info as usize,
            per_device: per_device as usize,
            count,
            streams,
        },
    );
    out(out_pp, info)
}

/// Frees what `custom_reply` allocated for an operation.
fn release_custom(d: &Driver, op: CustomOp) {
    let mut h = lock(&d.handles);
    for s in &op.streams {
        h.streams.remove(s);
    }
    drop(h);
    // SAFETY: both came from Box::into_raw in custom_reply and are freed only here, once.
    unsafe {
        drop(Box::from_raw(op.info as *mut CustomStorageInfo));
        drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
            op.per_device as *mut PerDeviceData,
            op.count,
        )));
    }
}

/// The 64 bytes of an argument struct (zeros for NULL, which the API allows).
fn args64(p: *const c_void) -> Vec<u8> {
    if p.is_null() {
        return vec![0; 64];
    }
    // SAFETY: every checkpoint argument struct is 64 bytes.
    unsafe { std::slice::from_raw_parts(p.cast::<u8>(), 64) }.to_vec()
}

/// The attributes of `cuDeviceGetAttribute` the simulator answers.
fn attribute(g: &GpuDesc, attr: c_int) -> R<c_int> {
    let bus = g
        .pci_bus_id
        .split(':')
        .nth(1)
        .and_then(|b| i32::from_str_radix(b, 16).ok())
        .unwrap_or(0);
    Ok(match attr {
        1 => 1024,           // MAX_THREADS_PER_BLOCK
        2 | 3 => 1024,       // MAX_BLOCK_DIM_X, _Y
        4 => 64,             // MAX_BLOCK_DIM_Z
        5 => 2_147_483_647,  // MAX_GRID_DIM_X
        6 | 7 => 65535,      // MAX_GRID_DIM_Y, _Z
        8 => 49152,          // MAX_SHARED_MEMORY_PER_BLOCK
        9 => 65536,          // TOTAL_CONSTANT_MEMORY
        10 => 32,            // WARP_SIZE
        11 => 2_147_483_647, // MAX_PITCH
        12 => 65536,         // MAX_REGISTERS_PER_BLOCK
        13 => 1_980_000,     // CLOCK_RATE (kHz)
        14 => 512,           // TEXTURE_ALIGNMENT
        15 => 1,             // GPU_OVERLAP
        16 => 132,           // MULTIPROCESSOR_COUNT
        17 => 0,             // KERNEL_EXEC_TIMEOUT
        18 => 0,             // INTEGRATED
        19 => 1,             // CAN_MAP_HOST_MEMORY
        20 => 0,             // COMPUTE_MODE (default)
        31 => 1,             // CONCURRENT_KERNELS
        32 => 1,             // ECC_ENABLED
        33 => bus,           // PCI_BUS_ID
        34 => 0,             // PCI_DEVICE_ID
        35 => 0,             // TCC_DRIVER
        36 => 2_619_000,     // MEMORY_CLOCK_RATE (kHz)
        37 => 5120,          // GLOBAL_MEMORY_BUS_WIDTH
        38 => 52_428_800,    // L2_CACHE_SIZE
        39 => 2048,          // MAX_THREADS_PER_MULTIPROCESSOR
        40 => 2,             // ASYNC_ENGINE_COUNT
        41 => 1,             // UNIFIED_ADDRESSING
        50 => 0,             // PCI_DOMAIN_ID
        75 => g.cc.0,        // COMPUTE_CAPABILITY_MAJOR
        76 => g.cc.1,        // COMPUTE_CAPABILITY_MINOR
        81 => 228 * 1024,    // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
        82 => 65536,         // MAX_REGISTERS_PER_MULTIPROCESSOR
        83 => 0,             // MANAGED_MEMORY: not simulated
        84 => 0,             // MULTI_GPU_BOARD
        89 => 0,             // CONCURRENT_MANAGED_ACCESS
        97 => 227 * 1024,    // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        115 => 0,            // MEMORY_POOLS_SUPPORTED: no stream-ordered allocator
        _ => return Err(cu::INVALID_VALUE),
    })
}

entry! {
    fn cuInit(flags: c_uint) {
        if flags != 0 {
            return Err(cu::INVALID_VALUE);
        }
        let d = match DRIVER.get_or_init(Driver::init) {
            Ok(d) => d,
            Err(c) => return Err(*c),
        };
        RESTORE_THREAD.call_once(|| {
            let (tx, rx) = std::sync::mpsc::channel();
            let spawned = std::thread::Builder::new().name("cuda-restore".into()).spawn(move || {
                // SAFETY: gettid has no preconditions.
                let tid = unsafe { libc::gettid() };
                d.mailbox.get().restore_tid.store(tid, Ordering::Release);
                let _ = tx.send(());
                d.restore_thread();
            });
            if spawned.is_ok() {
                let _ = rx.recv_timeout(Duration::from_secs(10));
            }
        });
        Ok(())
    }

    fn cuDriverGetVersion(version: *mut c_int) {
        let v = match drv() {
            Ok(d) => d.node.read().unwrap_or_else(|p| p.into_inner()).cuda_version,
            // Like the real call, this works before cuInit.
            Err(_) => {
                let mut c = Client::connect(&own_socket(), Role::Control).map_err(|_| cu::NO_DEVICE)?;
                fetch_node(&mut c)?.cuda_version
            }
        };
        out(version, v)
    }

    fn cuGetErrorName(error: CUresult, p_str: *mut *const c_char) {
        let name = cuerr::cu_name(error).ok_or(cu::INVALID_VALUE)?;
        out(p_str, static_cstr(name))
    }

    fn cuGetErrorString(error: CUresult, p_str: *mut *const c_char) {
        let s = cuerr::cu_string(error).ok_or(cu::INVALID_VALUE)?;
        out(p_str, static_cstr(s))
    }

    fn cuDeviceGetCount(count: *mut c_int) {
        let d = drv()?;
        out(count, d.node.read().unwrap_or_else(|p| p.into_inner()).gpus.len() as c_int)
    }

    fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) {
        drv()?.device(ordinal)?;
        out(device, ordinal)
    }

    fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) {
        copy_cstr(name, len, &drv()?.device(dev)?.name)
    }

    fn cuDeviceGetUuid(uuid: *mut [u8; 16], dev: CUdevice) {
        out(uuid, drv()?.device(dev)?.uuid)
    }

    fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: CUdevice) {
        out(uuid, drv()?.device(dev)?.uuid)
    }

    fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) {
        out(bytes, drv()?.device(dev)?.memory_bytes as usize)
    }

    fn cuDeviceGetPCIBusId(pci: *mut c_char, len: c_int, dev: CUdevice) {
        // CUDA prints a 4-digit domain where NVML prints 8.
        let id = drv()?.device(dev)?.pci_bus_id;
        let short = id.get(4..).unwrap_or(&id).to_string();
        copy_cstr(pci, len, &short)
    }

    fn cuDeviceGetAttribute(pi: *mut c_int, attrib: c_int, dev: CUdevice) {
        let g = drv()?.device(dev)?;
        out(pi, attribute(&g, attrib)?)
    }

    fn cuDeviceComputeCapability(major: *mut c_int, minor: *mut c_int, dev: CUdevice) {
        let g = drv()?.device(dev)?;
        out(major, g.cc.0)?;
        out(minor, g.cc.1)
    }

    fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) {
        let d = drv()?;
        d.device(dev)?;
        let i = dev as usize;
        let (handle, first) = {
            let mut h = lock(&d.handles);
            match h.primary.get_mut(&i) {
                Some(p) => {
                    p.1 += 1;
                    (p.0, false)
                }
                None => {
                    let handle = h.new_handle();
                    h.ctxs.insert(handle, Ctx { dev: i });
                    h.primary.insert(i, (handle, 1));
                    (handle, true)
                }
            }
        };
        if first {
            d.announce_context(i)?;
        }
        out(pctx, handle as CUcontext)
    }

    fn cuDevicePrimaryCtxRelease(dev: CUdevice) {
        primary_release(dev)
    }

    fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) {
        primary_release(dev)
    }

    fn cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut c_uint, active: *mut c_int) {
        let d = drv()?;
        d.device(dev)?;
        let on = lock(&d.handles).primary.get(&(dev as usize)).is_some_and(|p| p.1 > 0);
        out(flags, 0)?;
        out(active, c_int::from(on))
    }

    fn cuDevicePrimaryCtxSetFlags(dev: CUdevice, _flags: c_uint) {
        drv()?.device(dev).map(|_| ())
    }

    fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, _flags: c_uint) {
        drv()?.device(dev).map(|_| ())
    }

    fn cuCtxCreate_v2(pctx: *mut CUcontext, _flags: c_uint, dev: CUdevice) {
        let d = drv()?;
        d.device(dev)?;
        let handle = {
            let mut h = lock(&d.handles);
            let handle = h.new_handle();
            h.ctxs.insert(handle, Ctx { dev: dev as usize });
            handle
        };
        d.announce_context(dev as usize)?;
        CTX_STACK.with(|s| s.borrow_mut().push(handle));
        out(pctx, handle as CUcontext)
    }

    fn cuCtxDestroy_v2(ctx: CUcontext) {
        let d = drv()?;
        let handle = ctx as usize;
        let mut h = lock(&d.handles);
        if h.primary.values().any(|p| p.0 == handle) || h.ctxs.remove(&handle).is_none() {
            return Err(cu::INVALID_CONTEXT);
        }
        CTX_STACK.with(|s| s.borrow_mut().retain(|c| *c != handle));
        Ok(())
    }

    fn cuCtxSetCurrent(ctx: CUcontext) {
        let d = drv()?;
        let handle = ctx as usize;
        if handle != 0 && !lock(&d.handles).ctxs.contains_key(&handle) {
            return Err(cu::INVALID_CONTEXT);
        }
        CTX_STACK.with(|s| {
            let mut s = s.borrow_mut();
            s.pop();
            if handle != 0 {
                s.push(handle);
            }
        });
        Ok(())
    }

    fn cuCtxGetCurrent(pctx: *mut CUcontext) {
        drv()?;
        out(pctx, CTX_STACK.with(|s| s.borrow().last().copied().unwrap_or(0)) as CUcontext)
    }

    fn cuCtxPushCurrent_v2(ctx: CUcontext) {
        let d = drv()?;
        if !lock(&d.handles).ctxs.contains_key(&(ctx as usize)) {
            return Err(cu::INVALID_CONTEXT);
        }
        CTX_STACK.with(|s| s.borrow_mut().push(ctx as usize));
        Ok(())
    }

    fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) {
        drv()?;
        let top = CTX_STACK.with(|s| s.borrow_mut().pop()).ok_or(cu::INVALID_CONTEXT)?;
        if !pctx.is_null() {
            out(pctx, top as CUcontext)?;
        }
        Ok(())
    }

    fn cuCtxGetDevice(device: *mut CUdevice) {
        out(device, drv()?.current_dev()? as CUdevice)
    }

    fn cuCtxSynchronize() {
        let d = drv()?;
        d.current_dev()?;
        d.streams.wait_all();
        // Pass the gate like any call.
        let _g = d.enter();
        Ok(())
    }

    fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) {
        let d = drv()?;
        let dev = d.current_dev()?;
        if dptr.is_null() || bytesize == 0 {
            return Err(cu::INVALID_VALUE);
        }
        let gpu = d.device(dev as CUdevice)?.uuid;
        let ptr = d.with_conn(|c| match c.call(&Request::Alloc { gpu, size: bytesize as u64 })? {
            Reply::Ptr(p) => Ok(p),
            r => Err(CallError::Unexpected(format!("{r:?}"))),
        })?;
        lock(&d.allocs).insert(ptr, (dev, bytesize as u64));
        out(dptr, ptr)
    }

    fn cuMemFree_v2(dptr: CUdeviceptr) {
        let d = drv()?;
        d.with_conn(|c| c.ok(&Request::Free { ptr: dptr }))?;
        lock(&d.allocs).remove(&dptr);
        Ok(())
    }

    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) {
        let d = drv()?;
        let dev = d.current_dev()?;
        let gpu = d.device(dev as CUdevice)?.uuid;
        let (f, t) = d.with_conn(|c| match c.call(&Request::MemInfo { gpu })? {
            Reply::MemInfo { free, total } => Ok((free, total)),
            r => Err(CallError::Unexpected(format!("{r:?}"))),
        })?;
        out(free, f as usize)?;
        out(total, t as usize)
    }

    fn cuMemHostAlloc(pp: *mut *mut c_void, bytesize: usize, _flags: c_uint) {
        host_alloc(pp, bytesize)
    }

    fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytesize: usize) {
        host_alloc(pp, bytesize)
    }

    fn cuMemFreeHost(p: *mut c_void) {
        let d = drv()?;
        if lock(&d.handles).host.remove(&(p as usize)).is_none() {
            return Err(cu::INVALID_VALUE);
        }
        // SAFETY: p came from posix_memalign in host_alloc.
        unsafe { libc::free(p) };
        Ok(())
    }

    fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize) {
        htod(dst, src, n)
    }

    fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) {
        dtoh(dst, src, n)
    }

    fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) {
        dtod(dst, src, n)
    }

    fn cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, n: usize, stream: CUstream) {
        if pinned(src as usize, n)? {
            let src = src as usize;
            return async_op(stream, move || copy_htod(dst, src, n));
        }
        // Pageable memory is copied to staging memory before the call returns; the copy to
        // the device comes in stream order.
        let staged = read_host(src, n)?.to_vec();
        async_op(stream, move || write_device(dst, &staged))
    }

    fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, n: usize, stream: CUstream) {
        let dst = dst as usize;
        if pinned(dst, n)? {
            return async_op(stream, move || copy_dtoh(dst, src, n));
        }
        // Into pageable memory the call returns once the copy is done.
        stream_sync_op(stream, move || copy_dtoh(dst, src, n))
    }

    fn cuMemcpyDtoDAsync_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: CUstream) {
        async_op(stream, move || copy_dtod(dst, src, n))
    }

    fn cuMemsetD8_v2(dst: CUdeviceptr, uc: u8, n: usize) {
        memset(dst, u32::from(uc), 1, n)
    }

    fn cuMemsetD16_v2(dst: CUdeviceptr, us: u16, n: usize) {
        memset(dst, u32::from(us), 2, n)
    }

    fn cuMemsetD32_v2(dst: CUdeviceptr, ui: c_uint, n: usize) {
        memset(dst, ui, 4, n)
    }

    fn cuMemsetD8Async(dst: CUdeviceptr, uc: u8, n: usize, stream: CUstream) {
        async_op(stream, move || fill(dst, u32::from(uc), 1, n))
    }

    fn cuMemsetD32Async(dst: CUdeviceptr, ui: c_uint, n: usize, stream: CUstream) {
        async_op(stream, move || fill(dst, ui, 4, n))
    }

    fn cuStreamCreate(ph: *mut CUstream, flags: c_uint) {
        stream_create(ph, flags)
    }

    fn cuStreamCreateWithPriority(ph: *mut CUstream, flags: c_uint, _priority: c_int) {
        stream_create(ph, flags)
    }

    fn cuStreamDestroy_v2(stream: CUstream) {
        let d = drv()?;
        lock(&d.handles).streams.remove(&(stream as usize)).map(|_| ()).ok_or(cu::INVALID_HANDLE)
    }

    fn cuStreamSynchronize(stream: CUstream) {
        let d = drv()?;
        stream_ok(d, stream)?;
        d.streams.wait_idle(streams::key(stream));
        let _g = d.enter();
        Ok(())
    }

    fn cuStreamQuery(stream: CUstream) {
        let d = drv()?;
        stream_ok(d, stream)?;
        if d.streams.pending(streams::key(stream)) {
            return Err(cu::NOT_READY);
        }
        Ok(())
    }

    fn cuLaunchHostFunc(stream: CUstream, f: Option<unsafe extern "C" fn(*mut c_void)>, data: *mut c_void) {
        let d = drv()?;
        stream_ok(d, stream)?;
        let f = f.ok_or(cu::INVALID_VALUE)?;
        let data = data as usize;
        // The function counts as work in flight: a lock waits for it (or times out).
        d.streams.enqueue(streams::key(stream), Box::new(move || {
            let _g = d.enter();
            // SAFETY: the caller's function and argument, called once as CUDA documents.
            unsafe { f(data as *mut c_void) }
        }));
        Ok(())
    }

    fn cuStreamGetCtx(stream: CUstream, pctx: *mut CUcontext) {
        // The context a stream belongs to: for the default streams the current one; for a
        // stream of a device, that device's primary context where this process holds it (as
        // the streams a custom-storage operation hands out are), else the current context.
        let d = drv()?;
        stream_ok(d, stream)?;
        let current = CTX_STACK.with(|s| s.borrow().last().copied());
        let h = lock(&d.handles);
        let primary = h
            .streams
            .get(&(stream as usize))
            .and_then(|dev| h.primary.get(dev))
            .filter(|p| p.1 > 0)
            .map(|p| p.0);
        out(pctx, primary.or(current).ok_or(cu::INVALID_CONTEXT)? as CUcontext)
    }

    fn cuStreamWaitEvent(stream: CUstream, event: CUevent, _flags: c_uint) {
        let d = drv()?;
        stream_ok(d, stream)?;
        lock(&d.handles).events.get(&(event as usize)).ok_or(cu::INVALID_HANDLE)?;
        d.streams.stream_wait_event(streams::key(stream), event as usize);
        Ok(())
    }

    fn cuEventCreate(ph: *mut CUevent, _flags: c_uint) {
        let d = drv()?;
        d.current_dev()?;
        let mut h = lock(&d.handles);
        let handle = h.new_handle();
        h.events.insert(handle, None);
        out(ph, handle as CUevent)
    }

    fn cuEventRecord(event: CUevent, stream: CUstream) {
        let d = drv()?;
        stream_ok(d, stream)?;
        let ev = event as usize;
        lock(&d.handles).events.get(&ev).ok_or(cu::INVALID_HANDLE)?;
        let set = move || {
            if let Some(e) = lock(&d.handles).events.get_mut(&ev) {
                *e = Some(Instant::now());
            }
        };
        if d.streams.record(streams::key(stream), ev, set) {
            if let Some(e) = lock(&d.handles).events.get_mut(&ev) {
                *e = Some(Instant::now());
            }
        }
        Ok(())
    }

    fn cuEventSynchronize(event: CUevent) {
        let d = drv()?;
        lock(&d.handles).events.get(&(event as usize)).ok_or(cu::INVALID_HANDLE)?;
        d.streams.wait_event(event as usize);
        Ok(())
    }

    fn cuEventQuery(event: CUevent) {
        let d = drv()?;
        lock(&d.handles).events.get(&(event as usize)).ok_or(cu::INVALID_HANDLE)?;
        if d.streams.event_pending(event as usize) {
            return Err(cu::NOT_READY);
        }
        Ok(())
    }

    fn cuEventElapsedTime(ms: *mut f32, start: CUevent, end: CUevent) {
        let d = drv()?;
        if d.streams.event_pending(start as usize) || d.streams.event_pending(end as usize) {
            return Err(cu::NOT_READY);
        }
        let h = lock(&d.handles);
        let s = h.events.get(&(start as usize)).ok_or(cu::INVALID_HANDLE)?.ok_or(cu::NOT_READY)?;
        let e = h.events.get(&(end as usize)).ok_or(cu::INVALID_HANDLE)?.ok_or(cu::NOT_READY)?;
        out(ms, e.saturating_duration_since(s).as_secs_f32() * 1000.0)
    }

    fn cuEventDestroy_v2(event: CUevent) {
        let d = drv()?;
        lock(&d.handles).events.remove(&(event as usize)).map(|_| ()).ok_or(cu::INVALID_HANDLE)
    }

    fn cuModuleLoad(_module: *mut *mut c_void, _fname: *const c_char) {
        no_kernels("cuModuleLoad")
    }

    fn cuModuleLoadData(_module: *mut *mut c_void, _image: *const c_void) {
        no_kernels("cuModuleLoadData")
    }

    fn cuModuleLoadDataEx(_module: *mut *mut c_void, _image: *const c_void, _n: c_uint, _o: *mut c_void, _v: *mut *mut c_void) {
        no_kernels("cuModuleLoadDataEx")
    }

    fn cuModuleGetFunction(_f: *mut *mut c_void, _module: *mut c_void, _name: *const c_char) {
        no_kernels("cuModuleGetFunction")
    }

    fn cuModuleUnload(_module: *mut c_void) {
        no_kernels("cuModuleUnload")
    }

    fn cuLaunchKernel(
        _f: *mut c_void, _gx: c_uint, _gy: c_uint, _gz: c_uint, _bx: c_uint, _by: c_uint, _bz: c_uint,
        _shared: c_uint, _stream: CUstream, _params: *mut *mut c_void, _extra: *mut *mut c_void,
    ) {
        no_kernels("cuLaunchKernel")
    }

    fn cuCheckpointProcessLock(pid: c_int, args: *const c_void) {
        ckpt(CkptCall::Lock { pid, args: args64(args) }).map(|_| ())
    }

    fn cuCheckpointProcessCheckpoint(pid: c_int, args: *const c_void) {
        let raw = args64(args);
        let d = drv()?;
        // CUDA 13.4: bytes 0..8 are customStorageInfo_out; before, they are reserved (the daemon
        // refuses them when not zero).
        let out_pp = custom_out(d, &raw, 0)?;
        let primaries = if out_pp.is_null() { Vec::new() } else { d.primaries() };
        let reply = ckpt(CkptCall::Checkpoint { pid, args: raw, primaries })?;
        custom_reply(d, reply, out_pp)
    }

    fn cuCheckpointProcessRestore(pid: c_int, args: *const c_void) {
        let raw = args64(args);
        let ptr = u64::from_le_bytes(raw[0..8].try_into().map_err(|_| cu::INVALID_VALUE)?);
        let count = u32::from_le_bytes(raw[8..12].try_into().map_err(|_| cu::INVALID_VALUE)?);
        let d = drv()?;
        let remap = d.node.read().unwrap_or_else(|p| p.into_inner()).cuda_version >= 13000;
        let mut pairs = Vec::new();
        // Before CUDA 13.0 the struct has no pairs: those bytes are reserved (the daemon checks).
        if remap && count > 0 {
            if ptr == 0 || count as usize > mailbox::MAX_GPUS * 8 {
                return Err(cu::INVALID_VALUE);
            }
            // SAFETY: gpuPairs points at gpuPairsCount CUcheckpointGpuPair {oldUuid, newUuid}.
            let raw_pairs = unsafe { std::slice::from_raw_parts(ptr as *const [u8; 32], count as usize) };
            for p in raw_pairs {
                let mut old = [0u8; 16];
                let mut new = [0u8; 16];
                old.copy_from_slice(&p[..16]);
                new.copy_from_slice(&p[16..]);
                pairs.push((old, new));
            }
        } else if remap && ptr != 0 {
            return Err(cu::INVALID_VALUE);
        }
        // CUDA 13.4: customStorageInfo_out at byte 16.
        let out_pp = custom_out(d, &raw, 16)?;
        let primaries = if out_pp.is_null() { Vec::new() } else { d.primaries() };
        let reply = ckpt(CkptCall::Restore { pid, args: raw, pairs, primaries })?;
        custom_reply(d, reply, out_pp)
    }

    fn cuCheckpointOperationComplete(handle: *mut c_void) {
        let d = drv()?;
        if d.node.read().unwrap_or_else(|p| p.into_inner()).cuda_version < CUSTOM_STORAGE_SINCE {
            return Err(cu::NOT_SUPPORTED);
        }
        let key = handle as usize;
        let daemon_handle = lock(&d.ops).get(&key).map(|o| o.daemon_handle).ok_or(cu::INVALID_HANDLE)?;
        d.with_conn(|c| c.ok(&Request::OperationComplete { handle: daemon_handle }))?;
        if let Some(op) = lock(&d.ops).remove(&key) {
            release_custom(d, op);
        }
        Ok(())
    }

    fn cuCheckpointProcessUnlock(pid: c_int, args: *const c_void) {
        ckpt(CkptCall::Unlock { pid, args: args64(args) }).map(|_| ())
    }

    fn cuCheckpointProcessGetState(pid: c_int, state: *mut c_uint) {
        if state.is_null() {
            return Err(cu::INVALID_VALUE);
        }
        match ckpt(CkptCall::GetState { pid })? {
            Reply::State(s) => out(state, s),
            _ => Err(cu::UNKNOWN),
        }
    }

    fn cuCheckpointProcessGetRestoreThreadId(pid: c_int, tid: *mut c_int) {
        if tid.is_null() {
            return Err(cu::INVALID_VALUE);
        }
        match ckpt(CkptCall::GetRestoreThreadId { pid })? {
            Reply::Tid(t) => out(tid, t),
            _ => Err(cu::UNKNOWN),
        }
    }
}

fn primary_release(dev: CUdevice) -> R {
    let d = drv()?;
    d.device(dev)?;
    let mut h = lock(&d.handles);
    match h.primary.get_mut(&(dev as usize)) {
        Some(p) if p.1 > 0 => {
            p.1 -= 1;
            Ok(())
        }
        _ => Err(cu::INVALID_CONTEXT),
    }
}

fn host_alloc(pp: *mut *mut c_void, bytesize: usize) -> R {
    let d = drv()?;
    if pp.is_null() || bytesize == 0 {
        return Err(cu::INVALID_VALUE);
    }
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: posix_memalign writes p on success.
    if unsafe { libc::posix_memalign(&mut p, 4096, bytesize) } != 0 {
        return Err(cu::OUT_OF_MEMORY);
    }
    lock(&d.handles).host.insert(p as usize, bytesize);
    out(pp, p)
}

/// `CU_STREAM_NON_BLOCKING`.
const STREAM_NON_BLOCKING: c_uint = 1;

fn stream_create(ph: *mut CUstream, flags: c_uint) -> R {
    let d = drv()?;
    let dev = d.current_dev()?;
    let mut h = lock(&d.handles);
    let handle = h.new_handle();
    h.streams.insert(handle, dev);
    if flags & STREAM_NON_BLOCKING != 0 {
        d.streams.set_non_blocking(handle);
    }
    out(ph, handle as CUstream)
}

/// A pointer to a NUL-terminated copy of `s` that lives for the process.
fn static_cstr(s: &'static str) -> *const c_char {
    static CACHE: OnceLock<Mutex<HashMap<&'static str, &'static std::ffi::CStr>>> = OnceLock::new();
    let mut m = lock(CACHE.get_or_init(Default::default));
    let c = m.entry(s).or_insert_with(|| {
        let owned = std::ffi::CString::new(s).unwrap_or_default();
        Box::leak(owned.into_boxed_c_str())
    });
    c.as_ptr()
}

// ---------------------------------------------------------------------------------------------
// Driver entry point access (cuGetProcAddress)
// ---------------------------------------------------------------------------------------------

/// One ABI of a driver symbol: from which CUDA version a request gets it, the exported name,
/// and its per-thread-default-stream variant where the real driver has one.
struct Abi {
    since: i32,
    export: &'static str,
    per_thread: Option<&'static str>,
}

const fn abi(since: i32, export: &'static str) -> Abi {
    Abi {
        since,
        export,
        per_thread: None,
    }
}

const fn abi_pt(since: i32, export: &'static str, per_thread: &'static str) -> Abi {
    Abi {
        since,
        export,
        per_thread: Some(per_thread),
    }
}

/// Base name → its ABIs, oldest first. The ABIs the simulator does not implement are absent
/// (a request that would get one finds nothing). Every exported entry point is listed.
static ENTRY_POINTS: &[(&str, &[Abi])] = &[
    ("cuInit", &[abi(2000, "cuInit")]),
    ("cuDriverGetVersion", &[abi(2020, "cuDriverGetVersion")]),
    ("cuGetErrorName", &[abi(6000, "cuGetErrorName")]),
    ("cuGetErrorString", &[abi(6000, "cuGetErrorString")]),
    (
        "cuGetProcAddress",
        &[
            abi(11030, "cuGetProcAddress"),
            abi(12000, "cuGetProcAddress_v2"),
        ],
    ),
    ("cuDeviceGetCount", &[abi(2000, "cuDeviceGetCount")]),
    ("cuDeviceGet", &[abi(2000, "cuDeviceGet")]),
    ("cuDeviceGetName", &[abi(2000, "cuDeviceGetName")]),
    (
        "cuDeviceGetUuid",
        &[
            abi(9020, "cuDeviceGetUuid"),
            abi(11040, "cuDeviceGetUuid_v2"),
        ],
    ),
    ("cuDeviceTotalMem", &[abi(3020, "cuDeviceTotalMem_v2")]),
    ("cuDeviceGetPCIBusId", &[abi(4010, "cuDeviceGetPCIBusId")]),
    ("cuDeviceGetAttribute", &[abi(2000, "cuDeviceGetAttribute")]),
    (
        "cuDeviceComputeCapability",
        &[abi(2000, "cuDeviceComputeCapability")],
    ),
    (
        "cuDevicePrimaryCtxRetain",
        &[abi(7000, "cuDevicePrimaryCtxRetain")],
    ),
    (
        "cuDevicePrimaryCtxRelease",
        &[
            abi(7000, "cuDevicePrimaryCtxRelease"),
            abi(11000, "cuDevicePrimaryCtxRelease_v2"),
        ],
    ),
    (
        "cuDevicePrimaryCtxGetState",
        &[abi(7000, "cuDevicePrimaryCtxGetState")],
    ),
    (
        "cuDevicePrimaryCtxSetFlags",
        &[
            abi(7000, "cuDevicePrimaryCtxSetFlags"),
            abi(11000, "cuDevicePrimaryCtxSetFlags_v2"),
        ],
    ),
    (
        "cuCtxCreate",
        &[
            abi(3020, "cuCtxCreate_v2"),
            abi(11040, "cuCtxCreate_v3"),
            abi(12050, "cuCtxCreate_v4"),
        ],
    ),
    ("cuCtxDestroy", &[abi(4000, "cuCtxDestroy_v2")]),
    ("cuCtxSetCurrent", &[abi(4000, "cuCtxSetCurrent")]),
    ("cuCtxGetCurrent", &[abi(4000, "cuCtxGetCurrent")]),
    ("cuCtxPushCurrent", &[abi(4000, "cuCtxPushCurrent_v2")]),
    ("cuCtxPopCurrent", &[abi(4000, "cuCtxPopCurrent_v2")]),
    ("cuCtxGetDevice", &[abi(2000, "cuCtxGetDevice")]),
    ("cuCtxSynchronize", &[abi(2000, "cuCtxSynchronize")]),
    ("cuMemAlloc", &[abi(3020, "cuMemAlloc_v2")]),
    ("cuMemFree", &[abi(3020, "cuMemFree_v2")]),
    ("cuMemGetInfo", &[abi(3020, "cuMemGetInfo_v2")]),
    ("cuMemHostAlloc", &[abi(2020, "cuMemHostAlloc")]),
    ("cuMemAllocHost", &[abi(3020, "cuMemAllocHost_v2")]),
    ("cuMemFreeHost", &[abi(2000, "cuMemFreeHost")]),
    (
        "cuMemcpyHtoD",
        &[abi_pt(3020, "cuMemcpyHtoD_v2", "cuMemcpyHtoD_v2_ptds")],
    ),
    (
        "cuMemcpyDtoH",
        &[abi_pt(3020, "cuMemcpyDtoH_v2", "cuMemcpyDtoH_v2_ptds")],
    ),
    (
        "cuMemcpyDtoD",
        &[abi_pt(3020, "cuMemcpyDtoD_v2", "cuMemcpyDtoD_v2_ptds")],
    ),
    (
        "cuMemcpyHtoDAsync",
        &[abi_pt(
            3020,
            "cuMemcpyHtoDAsync_v2",
            "cuMemcpyHtoDAsync_v2_ptsz",
        )],
    ),
    (
        "cuMemcpyDtoHAsync",
        &[abi_pt(
            3020,
            "cuMemcpyDtoHAsync_v2",
            "cuMemcpyDtoHAsync_v2_ptsz",
        )],
    ),
    (
        "cuMemcpyDtoDAsync",
        &[abi_pt(
            3020,
            "cuMemcpyDtoDAsync_v2",
            "cuMemcpyDtoDAsync_v2_ptsz",
        )],
    ),
    (
        "cuMemsetD8",
        &[abi_pt(3020, "cuMemsetD8_v2", "cuMemsetD8_v2_ptds")],
    ),
    (
        "cuMemsetD16",
        &[abi_pt(3020, "cuMemsetD16_v2", "cuMemsetD16_v2_ptds")],
    ),
    (
        "cuMemsetD32",
        &[abi_pt(3020, "cuMemsetD32_v2", "cuMemsetD32_v2_ptds")],
    ),
    (
        "cuMemsetD8Async",
        &[abi_pt(3020, "cuMemsetD8Async", "cuMemsetD8Async_ptsz")],
    ),
    (
        "cuMemsetD32Async",
        &[abi_pt(3020, "cuMemsetD32Async", "cuMemsetD32Async_ptsz")],
    ),
    ("cuStreamCreate", &[abi(2000, "cuStreamCreate")]),
    (
        "cuStreamCreateWithPriority",
        &[abi_pt(
            5050,
            "cuStreamCreateWithPriority",
            "cuStreamCreateWithPriority",
        )],
    ),
    ("cuStreamDestroy", &[abi(4000, "cuStreamDestroy_v2")]),
    (
        "cuStreamSynchronize",
        &[abi_pt(
            2000,
            "cuStreamSynchronize",
            "cuStreamSynchronize_ptsz",
        )],
    ),
    (
        "cuStreamQuery",
        &[abi_pt(2000, "cuStreamQuery", "cuStreamQuery_ptsz")],
    ),
    ("cuStreamGetCtx", &[abi(9020, "cuStreamGetCtx")]),
    (
        "cuStreamWaitEvent",
        &[abi_pt(3020, "cuStreamWaitEvent", "cuStreamWaitEvent_ptsz")],
    ),
    ("cuEventCreate", &[abi(2000, "cuEventCreate")]),
    (
        "cuEventRecord",
        &[abi_pt(2000, "cuEventRecord", "cuEventRecord_ptsz")],
    ),
    ("cuEventSynchronize", &[abi(2000, "cuEventSynchronize")]),
    ("cuEventQuery", &[abi(2000, "cuEventQuery")]),
    ("cuEventElapsedTime", &[abi(2000, "cuEventElapsedTime")]),
    ("cuEventDestroy", &[abi(4000, "cuEventDestroy_v2")]),
    ("cuModuleLoad", &[abi(2000, "cuModuleLoad")]),
    ("cuModuleLoadData", &[abi(2000, "cuModuleLoadData")]),
    ("cuModuleLoadDataEx", &[abi(2010, "cuModuleLoadDataEx")]),
    ("cuModuleGetFunction", &[abi(2000, "cuModuleGetFunction")]),
    ("cuModuleUnload", &[abi(2000, "cuModuleUnload")]),
    (
        "cuLaunchKernel",
        &[abi_pt(4000, "cuLaunchKernel", "cuLaunchKernel_ptsz")],
    ),
    (
        "cuLaunchHostFunc",
        &[abi_pt(10000, "cuLaunchHostFunc", "cuLaunchHostFunc_ptsz")],
    ),
    (
        "cuCheckpointProcessLock",
        &[abi(12080, "cuCheckpointProcessLock")],
    ),
    (
        "cuCheckpointProcessCheckpoint",
        &[abi(12080, "cuCheckpointProcessCheckpoint")],
    ),
    (
        "cuCheckpointProcessRestore",
        &[abi(12080, "cuCheckpointProcessRestore")],
    ),
    (
        "cuCheckpointProcessUnlock",
        &[abi(12080, "cuCheckpointProcessUnlock")],
    ),
    (
        "cuCheckpointProcessGetState",
        &[abi(12080, "cuCheckpointProcessGetState")],
    ),
    (
        "cuCheckpointProcessGetRestoreThreadId",
        &[abi(12080, "cuCheckpointProcessGetRestoreThreadId")],
    ),
    (
        "cuCheckpointOperationComplete",
        &[abi(13040, "cuCheckpointOperationComplete")],
    ),
];

/// `CUdriverProcAddressQueryResult`.
const PROC_SUCCESS: c_int = 0;
const PROC_SYMBOL_NOT_FOUND: c_int = 1;
const PROC_VERSION_NOT_SUFFICIENT: c_int = 2;
/// `CUdriverProcAddress_flags`.
const PROC_PER_THREAD_DEFAULT_STREAM: u64 = 2;

/// The address of one of this library's own exports, looked up in this very library (another
/// libcuda.so.1 may be loaded beside it).
fn own_symbol(name: &str) -> *mut c_void {
    static SELF: OnceLock<usize> = OnceLock::new();
    let handle = *SELF.get_or_init(|| {
        let Some(path) = simgpu::library_file_of(cuInit as *const () as usize) else {
            return 0;
        };
        let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
            return 0;
        };
        // SAFETY: RTLD_NOLOAD only returns the handle of an already loaded object (this one).
        unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) as usize }
    });
    let Ok(c) = std::ffi::CString::new(name) else {
        return std::ptr::null_mut();
    };
    if handle == 0 {
        return std::ptr::null_mut();
    }
    // SAFETY: a handle from dlopen and a NUL-terminated name.
    unsafe { libc::dlsym(handle as *mut c_void, c.as_ptr()) }
}

/// Resolves `symbol` at `version`: Ok(address) or Err(status) with pfn NULL.
fn proc_address(symbol: &str, version: i32, flags: u64) -> Result<*mut c_void, c_int> {
    let abis = ENTRY_POINTS
        .iter()
        .find(|(name, _)| *name == symbol)
        .map(|(_, a)| *a)
        .ok_or(PROC_SYMBOL_NOT_FOUND)?;
    let abi = abis
        .iter()
        .rev()
        .find(|a| a.since <= version)
        .ok_or(PROC_VERSION_NOT_SUFFICIENT)?;
    let name = match (flags & PROC_PER_THREAD_DEFAULT_STREAM != 0, abi.per_thread) {
        (true, Some(pt)) => pt,
        _ => abi.export,
    };
    let p = own_symbol(name);
    if p.is_null() {
        Err(PROC_SYMBOL_NOT_FOUND)
    } else {
        Ok(p)
    }
}

fn get_proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> R {
    if symbol.is_null() || pfn.is_null() || flags > 2 {
        return Err(cu::INVALID_VALUE);
    }
    // SAFETY: a NUL-terminated symbol name from the caller.
    let name = unsafe { std::ffi::CStr::from_ptr(symbol) }
        .to_string_lossy()
        .into_owned();
    let driver = match drv() {
        Ok(d) => {
            d.node
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .cuda_version
        }
        Err(_) => {
            let mut c = Client::connect(&own_socket(), Role::Control).map_err(|_| cu::NO_DEVICE)?;
            fetch_node(&mut c)?.cuda_version
        }
    };
    let set_status = |s: c_int| {
        if !status.is_null() {
            // SAFETY: an optional out-pointer from the caller.
            unsafe { status.write(s) };
        }
    };
    out(pfn, std::ptr::null_mut())?;
    // A version newer than the driver: CUDA_ERROR_INVALID_VALUE, as documented.
    if version > driver {
        set_status(PROC_VERSION_NOT_SUFFICIENT);
        return Err(cu::INVALID_VALUE);
    }
    match proc_address(&name, version, flags) {
        Ok(p) => {
            set_status(PROC_SUCCESS);
            out(pfn, p)
        }
        // Not found, or no ABI at that version: CUDA_SUCCESS with pfn NULL, as documented.
        Err(s) => {
            set_status(s);
            Ok(())
        }
    }
}

/// Environment: when set (non-empty), every cuGetProcAddress request is logged to stderr as
/// `simgpu-procaddr <symbol> <version> <flags> <CUresult> <symbolStatus>` (what a client library
/// asks for, and what it got).
const ENV_TRACE_PROC: &str = "GPU_CKPT_SIM_TRACE_PROCADDR";

fn trace_proc(symbol: *const c_char, version: c_int, flags: u64, r: &R, status: *mut c_int) {
    static ON: OnceLock<bool> = OnceLock::new();
    if !*ON.get_or_init(|| std::env::var_os(ENV_TRACE_PROC).is_some_and(|v| !v.is_empty())) {
        return;
    }
    let name = if symbol.is_null() {
        "(null)".to_string()
    } else {
        // SAFETY: a NUL-terminated symbol name from the caller (checked non-null).
        unsafe { std::ffi::CStr::from_ptr(symbol) }
            .to_string_lossy()
            .into_owned()
    };
    let code = match r {
        Ok(()) => cu::SUCCESS,
        Err(c) => *c,
    };
    // SAFETY: status points at the caller's or our own c_int.
    let st = if status.is_null() {
        -1
    } else {
        unsafe { *status }
    };
    eprintln!("simgpu-procaddr {name} {version} {flags} {code} {st}");
}

entry! {
    fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64) {
        let mut st: c_int = -1;
        let r = get_proc_address(symbol, pfn, version, flags, &mut st);
        trace_proc(symbol, version, flags, &r, &mut st);
        r
    }

    fn cuGetProcAddress_v2(
        symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64, status: *mut c_int,
    ) {
        let mut own_status: c_int = -1;
        let st = if status.is_null() { &mut own_status as *mut c_int } else { status };
        let r = get_proc_address(symbol, pfn, version, flags, st);
        trace_proc(symbol, version, flags, &r, st);
        r
    }

    fn cuCtxCreate_v3(pctx: *mut CUcontext, _params: *mut c_void, _n: c_int, flags: c_uint, dev: CUdevice) {
        cuCtxCreate_v2(pctx, flags, dev).into_result()
    }

    fn cuCtxCreate_v4(pctx: *mut CUcontext, _params: *mut c_void, flags: c_uint, dev: CUdevice) {
        cuCtxCreate_v2(pctx, flags, dev).into_result()
    }

    // Per-thread default stream variants: the same calls (the per-thread default stream is one
    // queue for the process).
    fn cuMemcpyHtoD_v2_ptds(dst: CUdeviceptr, src: *const c_void, n: usize) { htod(dst, src, n) }
    fn cuMemcpyDtoH_v2_ptds(dst: *mut c_void, src: CUdeviceptr, n: usize) { dtoh(dst, src, n) }
    fn cuMemcpyDtoD_v2_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) { dtod(dst, src, n) }
    fn cuMemcpyHtoDAsync_v2_ptsz(dst: CUdeviceptr, src: *const c_void, n: usize, s: CUstream) {
        cuMemcpyHtoDAsync_v2(dst, src, n, s).into_result()
    }
    fn cuMemcpyDtoHAsync_v2_ptsz(dst: *mut c_void, src: CUdeviceptr, n: usize, s: CUstream) {
        cuMemcpyDtoHAsync_v2(dst, src, n, s).into_result()
    }
    fn cuMemcpyDtoDAsync_v2_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) {
        cuMemcpyDtoDAsync_v2(dst, src, n, s).into_result()
    }
    fn cuMemsetD8_v2_ptds(dst: CUdeviceptr, uc: u8, n: usize) { memset(dst, u32::from(uc), 1, n) }
    fn cuMemsetD16_v2_ptds(dst: CUdeviceptr, us: u16, n: usize) { memset(dst, u32::from(us), 2, n) }
    fn cuMemsetD32_v2_ptds(dst: CUdeviceptr, ui: c_uint, n: usize) { memset(dst, ui, 4, n) }
    fn cuMemsetD8Async_ptsz(dst: CUdeviceptr, uc: u8, n: usize, s: CUstream) {
        cuMemsetD8Async(dst, uc, n, s).into_result()
    }
    fn cuMemsetD32Async_ptsz(dst: CUdeviceptr, ui: c_uint, n: usize, s: CUstream) {
        cuMemsetD32Async(dst, ui, n, s).into_result()
    }
    fn cuStreamSynchronize_ptsz(s: CUstream) { cuStreamSynchronize(s).into_result() }
    fn cuStreamQuery_ptsz(s: CUstream) { cuStreamQuery(s).into_result() }
    fn cuStreamWaitEvent_ptsz(s: CUstream, e: CUevent, flags: c_uint) { cuStreamWaitEvent(s, e, flags).into_result() }
    fn cuEventRecord_ptsz(e: CUevent, s: CUstream) { cuEventRecord(e, s).into_result() }
    fn cuLaunchHostFunc_ptsz(s: CUstream, f: Option<unsafe extern "C" fn(*mut c_void)>, data: *mut c_void) {
        cuLaunchHostFunc(s, f, data).into_result()
    }
    fn cuLaunchKernel_ptsz(
        _f: *mut c_void, _gx: c_uint, _gy: c_uint, _gz: c_uint, _bx: c_uint, _by: c_uint, _bz: c_uint,
        _shared: c_uint, _stream: CUstream, _params: *mut *mut c_void, _extra: *mut *mut c_void,
    ) {
        no_kernels("cuLaunchKernel")
    }
}

/// A CUresult back into this file's Result.
trait IntoResult {
    fn into_result(self) -> R;
}

impl IntoResult for CUresult {
    fn into_result(self) -> R {
        if self == cu::SUCCESS {
            Ok(())
        } else {
            Err(self)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32, id: u8) -> GpuDesc {
        GpuDesc {
            index,
            uuid: [id; 16],
            name: "NVIDIA H100 80GB HBM3".into(),
            memory_bytes: 1 << 30,
            pci_bus_id: format!("00000000:{:02X}:00.0", index + 1),
            cc: (9, 0),
            arch: 9,
            persistence: true,
            mig: false,
        }
    }

    fn node(gpus: Vec<GpuDesc>) -> NodeDesc {
        NodeDesc {
            driver_version: "580.95.05".into(),
            cuda_version: 13000,
            gpus,
        }
    }

    fn ids(gpus: &[GpuDesc]) -> Vec<u8> {
        gpus.iter().map(|g| g.uuid[0]).collect()
    }

    #[test]
    fn every_ordinal_kept_in_order() {
        let old = [gpu(0, 1), gpu(1, 2), gpu(2, 3), gpu(3, 4)];
        let here = node(vec![gpu(0, 11), gpu(1, 12), gpu(2, 13), gpu(3, 14)]);
        // Only the GPU with memory paired: the others take the GPUs left, in order.
        let got = restored_ordinals(&old, &[([3; 16], [11; 16])], &here, &here);
        assert_eq!(ids(&got), [12, 13, 11, 14]);
        // Every GPU paired: the pairs decide.
        let map = [
            ([1; 16], [14; 16]),
            ([2; 16], [13; 16]),
            ([3; 16], [12; 16]),
            ([4; 16], [11; 16]),
        ];
        let got = restored_ordinals(&old, &map, &here, &here);
        assert_eq!(ids(&got), [14, 13, 12, 11]);
    }

    #[test]
    fn unpaired_gpus_keep_their_uuid_when_seen_here() {
        let old = [gpu(0, 1), gpu(1, 2), gpu(2, 3)];
        // The same node, ordinal 1's memory moved to GPU 0: ordinal 2 keeps its own GPU and
        // ordinal 0, whose GPU the pair took, gets the one left.
        let here = node(vec![gpu(0, 1), gpu(1, 2), gpu(2, 3)]);
        let got = restored_ordinals(&old, &[([2; 16], [1; 16])], &here, &here);
        assert_eq!(ids(&got), [2, 1, 3]);
    }

    #[test]
    fn fewer_gpus_seen_drops_ordinals_from_the_end() {
        let old = [gpu(0, 1), gpu(1, 2), gpu(2, 3)];
        let fresh = node(vec![gpu(0, 11), gpu(1, 12), gpu(2, 13)]);
        let seen = node(vec![gpu(1, 12)]);
        let got = restored_ordinals(&old, &[([1; 16], [12; 16])], &fresh, &seen);
        assert_eq!(ids(&got), [12]);
        // A pair onto a GPU this process cannot see still names it (its device node is then
        // missing, which the restore reports).
        let got = restored_ordinals(&old, &[([2; 16], [13; 16])], &fresh, &seen);
        assert_eq!(ids(&got), [12, 13]);
    }
}
