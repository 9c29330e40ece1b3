//! The layer's state: the communicators the application holds (stable handles pointing to the
//! current real communicator), what rebuilding each needs, and the gate.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use nccl_control::{Connection, LayerMsg, Split};

use crate::backend::{Backend, RealComm};
use crate::config::ConfigCopy;
use crate::ffi::*;
use crate::gate::{Gate, Kind, StreamUse, Stuck, Ticket};

const COMM_MAGIC: u64 = 0x6763_6b70_636f_6d6d;
const BUF_MAGIC: u64 = 0x6763_6b70_6275_6666;

/// How long a message to the shim may block before the connection is dropped.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(5);

/// The object behind an `ncclComm_t` the application holds.
#[repr(C)]
pub struct CommObj {
    magic: u64,
    pub id: u64,
    rank: AtomicI32,
    dev: i32,
    real: AtomicUsize,
}

impl CommObj {
    pub fn real(&self) -> RealComm {
        self.real.load(Ordering::Acquire)
    }
    pub fn rank(&self) -> i32 {
        self.rank.load(Ordering::Relaxed)
    }
    pub fn dev(&self) -> i32 {
        self.dev
    }
}

/// The object behind a registration handle the application holds.
#[repr(C)]
pub struct BufObj {
    magic: u64,
    ptr: usize,
    size: usize,
    real: AtomicUsize,
}

impl BufObj {
    pub fn real(&self) -> usize {
        self.real.load(Ordering::Acquire)
    }
}

/// Where a communicator came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// ncclCommInitRank(Config) or ncclCommInitAll.
    Root,
    /// ncclCommSplit of communicator `parent`.
    Split { parent: u64, color: i32, key: i32 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RealState {
    Live,
    Suspended,
    /// Destroyed at Release (no ncclCommSuspend): only a Rebuild brings it back.
    Destroyed,
}

/// What the layer knows of one communicator, or of a split call that made none
/// (`NCCL_SPLIT_NOCOLOR`).
struct Entry {
    id: u64,
    handle: Option<Arc<CommObj>>,
    /// The CUDA device (for a NOCOLOR record: its parent's).
    dev: i32,
    key: String,
    nranks: i32,
    config: Option<Box<ConfigCopy>>,
    origin: Origin,
    group: Option<u64>,
    buffers: Vec<Arc<BufObj>>,
    /// Finalized, destroyed or aborted by the application (or a NOCOLOR record).
    gone: bool,
    /// Told to the shim (a communicator made in a group waits for its ncclGroupEnd).
    announced: bool,
    state: RealState,
}

impl Entry {
    fn rank(&self) -> i32 {
        self.handle.as_ref().map_or(-1, |h| h.rank())
    }
    fn dev(&self) -> i32 {
        self.dev
    }
    fn real(&self) -> RealComm {
        self.handle.as_ref().map_or(0, |h| h.real())
    }
    fn live(&self) -> bool {
        !self.gone && self.handle.is_some()
    }
    fn msg(&self) -> LayerMsg {
        LayerMsg::Comm {
            id: self.id,
            key: self.key.clone(),
            rank: self.rank(),
            nranks: self.nranks,
            cuda_dev: self.dev(),
            split: match self.origin {
                Origin::Root => None,
                Origin::Split { parent, color, key } => Some(Split { parent, color, key }),
            },
        }
    }
}

#[derive(Default)]
struct Registry {
    entries: Vec<Entry>,
    next_id: u64,
    writer: Option<Connection>,
}

impl Registry {
    fn entry(&mut self, id: u64) -> Option<&mut Entry> {
        self.entries.iter_mut().find(|e| e.id == id)
    }

    /// The ids of the live communicators, in the order they were made.
    fn live_ids(&self) -> Vec<u64> {
        self.entries
            .iter()
            .filter(|e| e.live())
            .map(|e| e.id)
            .collect()
    }

    /// Sends `msg` to the shim, if connected; a failed send drops the connection (the
    /// control thread sees it closed and connects again).
    fn send(&mut self, msg: &LayerMsg) {
        if let Some(w) = self.writer.as_mut() {
            if let Err(e) = w.send(msg, Some(SEND_TIMEOUT)) {
                tracing::warn!(error = %e, "control connection dropped");
                w.shutdown();
                self.writer = None;
            }
        }
    }
}

/// A new communicator to record.
pub struct NewComm {
    pub key: String,
    pub rank: i32,
    pub nranks: i32,
    pub dev: i32,
    pub config: Option<Box<ConfigCopy>>,
    pub origin: Origin,
    pub real: RealComm,
    /// The application's group it was made in (made again in one group).
    pub group: Option<u64>,
}

/// The layer: a backend, the gate, the registry.
pub struct Layer<B> {
    pub backend: B,
    pub gate: Gate,
    reg: Mutex<Registry>,
    /// The process that started the control thread (a forked child starts its own).
    pub control_pid: Mutex<i32>,
    /// Release destroys every communicator even where the library has ncclCommSuspend
    /// ([`ENV_RELEASE`] = `destroy`).
    pub destroy_at_release: bool,
}

/// The environment variable that chooses what Release does: `destroy` destroys every real
/// communicator (only a Rebuild brings them back), anything else suspends them where the NCCL
/// under the layer has `ncclCommSuspend` (2.29.7 and later). A suspended communicator keeps its
/// connections (its bootstrap sockets among them) and, before NCCL covers it, its NVLS state:
/// a job whose checkpoint must not hold them chooses `destroy`.
pub const ENV_RELEASE: &str = nccl_control::ENV_RELEASE;

fn failed(comm: Option<&Entry>, message: String) -> LayerMsg {
    LayerMsg::Failed {
        comm: comm.map(|e| e.id),
        rank: comm.map(Entry::rank),
        message,
    }
}

/// A failed NCCL call: its name, result, and what `ncclGetLastError` says of it (NCCL keeps the
/// text of the last error; it can be unrelated where the call failed without setting one).
fn code(call: &str, r: ncclResult_t, last: Option<String>) -> String {
    match last {
        Some(t) => format!("{call}: {} ({r}): {t}", result_name(r)),
        None => format!("{call}: {} ({r})", result_name(r)),
    }
}

impl<B: Backend> Layer<B> {
    pub fn new(backend: B) -> Layer<B> {
        Layer {
            backend,
            gate: Gate::default(),
            reg: Mutex::new(Registry {
                next_id: 1,
                ..Registry::default()
            }),
            control_pid: Mutex::new(0),
            destroy_at_release: false,
        }
    }

    fn reg(&self) -> MutexGuard<'_, Registry> {
        self.reg.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The layer's object behind an application's `ncclComm_t`, or None for null and for
    /// anything the layer did not hand out (passed on unchanged).
    ///
    /// # Safety
    /// `comm` is null or a communicator handle the application got from NCCL's API.
    pub unsafe fn handle<'a>(&self, comm: ncclComm_t) -> Option<&'a CommObj> {
        if comm.is_null() {
            return None;
        }
        let o = &*(comm as *const CommObj);
        (o.magic == COMM_MAGIC).then_some(o)
    }

    /// The layer's object behind a registration handle, if it is one of the layer's.
    ///
    /// # Safety
    /// As [`Layer::handle`], for `ncclCommRegister`'s handles.
    pub unsafe fn buffer<'a>(&self, h: *mut c_void) -> Option<&'a BufObj> {
        if h.is_null() {
            return None;
        }
        let o = &*(h as *const BufObj);
        (o.magic == BUF_MAGIC).then_some(o)
    }

    /// Enters the gate for a call on `comm` (recording `stream` for the quiesce). The calls
    /// that enqueue work on a stream are collectives, counted, except the point-to-point ones
    /// (their counts differ between ranks); a split counts on its parent.
    pub fn enter(
        &self,
        call: &'static str,
        comm: Option<&CommObj>,
        stream: Option<usize>,
    ) -> Ticket<'_> {
        let p2p = matches!(call, "ncclSend" | "ncclRecv");
        let query = matches!(
            call,
            "ncclCommCount"
                | "ncclCommCuDevice"
                | "ncclCommUserRank"
                | "ncclCommGetAsyncError"
                | "ncclGetLastError"
        );
        let kind = if call == "ncclCommSplit" || (stream.is_some() && !p2p) {
            Kind::Collective
        } else if query {
            Kind::Query
        } else {
            Kind::Other
        };
        let t = self.gate.enter(call, comm.map(|c| (c.id, c.rank())), kind);
        if let (Some(c), Some(stream)) = (comm, stream) {
            self.gate.record_stream(StreamUse {
                stream,
                comm: c.id,
                rank: c.rank(),
                dev: c.dev,
            });
        }
        t
    }

    /// Records a communicator the application now holds; returns its handle for the
    /// application (`ncclComm_t`). Made inside a group, it is told to the shim at the group's
    /// end (when its rank is known).
    pub fn adopt(&self, c: NewComm) -> ncclComm_t {
        let mut reg = self.reg();
        let id = reg.next_id;
        reg.next_id += 1;
        let obj = Arc::new(CommObj {
            magic: COMM_MAGIC,
            id,
            rank: AtomicI32::new(c.rank),
            dev: c.dev,
            real: AtomicUsize::new(c.real),
        });
        let group = c.group;
        let mut e = Entry {
            id,
            handle: Some(obj.clone()),
            dev: c.dev,
            key: c.key,
            nranks: c.nranks,
            config: c.config,
            origin: c.origin,
            group,
            buffers: Vec::new(),
            gone: false,
            announced: false,
            state: RealState::Live,
        };
        if c.rank >= 0 {
            reg.send(&e.msg());
            e.announced = true;
        }
        reg.entries.push(e);
        Arc::into_raw(obj) as ncclComm_t
    }

    /// Records a split call that made no communicator (`NCCL_SPLIT_NOCOLOR`): every rank of
    /// the parent calls split again at a rebuild.
    pub fn adopt_nocolor(&self, parent: &CommObj, key: i32, config: Option<Box<ConfigCopy>>) {
        let mut reg = self.reg();
        let id = reg.next_id;
        reg.next_id += 1;
        let group = self.gate.group_tag();
        reg.entries.push(Entry {
            id,
            handle: None,
            dev: parent.dev,
            key: String::new(),
            nranks: 0,
            config,
            origin: Origin::Split {
                parent: parent.id,
                color: NCCL_SPLIT_NOCOLOR,
                key,
            },
            group,
            buffers: Vec::new(),
            gone: true,
            announced: true,
            state: RealState::Live,
        });
    }

    /// The key of communicator `id` (for a split's key).
    pub fn key_of(&self, id: u64) -> Option<String> {
        self.reg().entry(id).map(|e| e.key.clone())
    }

    /// The ranks of communicators made without one known (in a group, or with a nonblocking
    /// config), and their announcement: at the outermost ncclGroupEnd for group `tag`; for
    /// all (`None`) at a quiesce, before the shim is told which communicators there are.
    pub fn settle(&self, tag: Option<u64>) {
        let mut reg = self.reg();
        let mut msgs = Vec::new();
        for e in reg.entries.iter_mut() {
            if (tag.is_none() || e.group == tag) && !e.announced && e.live() {
                if let (Some(h), Some((r, n))) = (&e.handle, self.backend.rank_count(e.real())) {
                    h.rank.store(r, Ordering::Relaxed);
                    e.nranks = n;
                }
                e.announced = true;
                msgs.push(e.msg());
            }
        }
        for m in &msgs {
            reg.send(m);
        }
    }

    /// The application finalized, destroyed or aborted `comm`: told to the shim once; with
    /// `freed`, the real communicator is gone too.
    pub fn gone(&self, comm: &CommObj, freed: bool) {
        let mut reg = self.reg();
        if let Some(e) = reg.entry(comm.id) {
            let first = !e.gone;
            e.gone = true;
            if freed {
                comm.real.store(0, Ordering::Release);
                e.buffers.clear();
            }
            if first && e.announced {
                reg.send(&LayerMsg::CommGone { id: comm.id });
            }
        }
        if freed {
            self.gate.forget_comm(comm.id);
        }
    }

    /// Drops the application's reference to a destroyed communicator's handle.
    ///
    /// # Safety
    /// `comm` came from [`Layer::adopt`] and the application no longer uses it.
    pub unsafe fn free_handle(&self, comm: ncclComm_t) {
        drop(Arc::from_raw(comm as *const CommObj));
    }

    /// Records a registration; returns the application's handle for it.
    pub fn add_buffer(&self, comm: &CommObj, ptr: usize, size: usize, real: usize) -> *mut c_void {
        let b = Arc::new(BufObj {
            magic: BUF_MAGIC,
            ptr,
            size,
            real: AtomicUsize::new(real),
        });
        if let Some(e) = self.reg().entry(comm.id) {
            e.buffers.push(b.clone());
        }
        Arc::into_raw(b) as *mut c_void
    }

    /// Forgets a registration the application deregistered.
    ///
    /// # Safety
    /// `h` came from [`Layer::add_buffer`] and the application no longer uses it.
    pub unsafe fn remove_buffer(&self, comm: &CommObj, h: *mut c_void) {
        if let Some(e) = self.reg().entry(comm.id) {
            e.buffers.retain(|b| Arc::as_ptr(b) as *mut c_void != h);
        }
        drop(Arc::from_raw(h as *const BufObj));
    }

    // ---- the shim's side ----

    /// Takes a new connection to the shim: announces every communicator held.
    pub fn connected(&self, writer: Connection) {
        let mut reg = self.reg();
        reg.writer = Some(writer);
        let msgs: Vec<LayerMsg> = reg
            .entries
            .iter()
            .filter(|e| e.live() && e.announced)
            .map(Entry::msg)
            .collect();
        for m in &msgs {
            reg.send(m);
        }
    }

    /// Sends a reply to the shim.
    pub fn reply(&self, msg: &LayerMsg) {
        self.reg().send(msg);
    }

    /// The connection is closed (by Disconnect, or seen closed): the writer's descriptor is
    /// closed, without a shutdown, so that the shim sees the end only once the process holds
    /// no descriptor of the connection (the reader's is closed first).
    pub fn disconnected(&self) {
        drop(self.reg().writer.take());
    }

    pub fn hello(&self, resumed: Option<String>) -> LayerMsg {
        LayerMsg::Hello {
            version: nccl_control::VERSION,
            // SAFETY: getpid has no preconditions.
            pid: unsafe { libc::getpid() },
            nccl_version: self.backend.version().unwrap_or(0),
            resumed,
        }
    }

    /// Quiesce, first round: hold new calls, wait (until the deadline) for the calls in
    /// flight; `Holding` with the collectives issued on each live communicator. On failure the
    /// held calls go on.
    pub fn quiesce(&self, deadline: Duration) -> LayerMsg {
        let _span = tracing::info_span!("nccl quiesce", ms = deadline.as_millis() as u64).entered();
        let until = std::time::Instant::now() + deadline;
        self.gate.hold();
        self.gate.set_targets(None);
        if let Err(f) = self.gate.drain(until) {
            self.gate.release();
            let message = match f.comm {
                Some((id, rank)) => format!(
                    "{} on communicator {id} (rank {rank}) still in the layer after {} ms",
                    f.call,
                    deadline.as_millis()
                ),
                None => format!(
                    "{} still in the layer after {} ms",
                    f.call,
                    deadline.as_millis()
                ),
            };
            return LayerMsg::Failed {
                comm: f.comm.map(|c| c.0),
                rank: f.comm.map(|c| c.1),
                message,
            };
        }
        self.settle(None);
        let issued = self
            .reg()
            .entries
            .iter()
            .filter(|e| e.live())
            .map(|e| (e.id, self.gate.issued(e.id)))
            .collect();
        LayerMsg::Holding { issued }
    }

    /// Quiesce, second round: the held collectives on each communicator pass until its target
    /// (the most any of its ranks issued), then wait (until the deadline) for the calls in
    /// flight and every stream used since the last quiesce; `Quiesced`. On failure (naming the
    /// communicator and rank) the held calls go on.
    pub fn drain(&self, targets: Vec<(u64, u64)>, deadline: Duration) -> LayerMsg {
        if let Some(f) = self.not_held("Drain") {
            return f;
        }
        let _span = tracing::info_span!("nccl drain", ms = deadline.as_millis() as u64).entered();
        let until = std::time::Instant::now() + deadline;
        let live = self.reg().live_ids();
        let targets = targets
            .into_iter()
            .filter(|(id, _)| live.contains(id))
            .collect();
        self.gate.set_targets(Some(targets));
        let reached = self.gate.reach(until);
        self.gate.set_targets(None);
        if let Err(stuck) = reached {
            self.gate.release();
            let ms = deadline.as_millis();
            let rank = |id: u64| self.reg().entry(id).map_or(-1, |e| e.rank());
            return match stuck {
                Stuck::Short {
                    comm,
                    issued,
                    target,
                } => {
                    let r = rank(comm);
                    LayerMsg::Failed {
                        comm: Some(comm),
                        rank: Some(r),
                        message: format!(
                            "communicator {comm} (rank {r}): {issued} of the {target} \
                             collectives its peers issued after {ms} ms (the application did \
                             not call the rest)"
                        ),
                    }
                }
                Stuck::Call(f) => LayerMsg::Failed {
                    comm: f.comm.map(|c| c.0),
                    rank: f.comm.map(|c| c.1),
                    message: match f.comm {
                        Some((id, r)) => format!(
                            "{} on communicator {id} (rank {r}) still in the layer after {ms} ms",
                            f.call
                        ),
                        None => format!("{} still in the layer after {ms} ms", f.call),
                    },
                },
            };
        }
        let mut pause = Duration::from_micros(100);
        for u in self.gate.streams() {
            loop {
                match self.backend.stream_done(u.stream, u.dev) {
                    Ok(true) => break,
                    Ok(false) if std::time::Instant::now() < until => {
                        std::thread::sleep(pause);
                        pause = (pause * 2).min(Duration::from_millis(5));
                    }
                    r => {
                        self.gate.release();
                        let why = match r {
                            Err(e) => e,
                            _ => format!("not complete after {} ms", deadline.as_millis()),
                        };
                        return LayerMsg::Failed {
                            comm: Some(u.comm),
                            rank: Some(u.rank),
                            message: format!(
                                "communicator {} (rank {}): stream {:#x}: {why}",
                                u.comm, u.rank, u.stream
                            ),
                        };
                    }
                }
            }
        }
        self.gate.clear_streams();
        let comms = self.reg().live_ids();
        LayerMsg::Quiesced { comms }
    }

    /// Go: the held calls go on.
    pub fn go(&self) {
        self.gate.release();
    }

    fn not_held(&self, what: &str) -> Option<LayerMsg> {
        (!self.gate.is_held()).then(|| failed(None, format!("{what} without a Quiesce")))
    }

    fn use_device(&self, e: &Entry) -> Result<(), LayerMsg> {
        self.backend
            .use_device(e.dev())
            .map_err(|m| failed(Some(e), m))
    }

    /// Release: deregister every buffer and suspend every communicator (destroy it where the
    /// library has no ncclCommSuspend); the handles stay. `Released { suspended }` says whether
    /// every live communicator is now suspended (a `Resume` brings them back) or some are
    /// destroyed (only a `Rebuild` does). A second Release changes nothing and answers the same.
    pub fn release(&self) -> LayerMsg {
        if let Some(f) = self.not_held("Release") {
            return f;
        }
        let _span = tracing::info_span!("nccl release").entered();
        let reg = self.reg();
        let suspend = !self.destroy_at_release && self.backend.has_suspend();
        let run = || -> Result<(), LayerMsg> {
            for e in reg.entries.iter().filter(|e| e.live()) {
                for b in &e.buffers {
                    let h = b.real.swap(0, Ordering::AcqRel);
                    if h != 0 && e.real() != 0 {
                        self.use_device(e)?;
                        let r = self.backend.deregister(e.real(), h);
                        if r != NCCL_SUCCESS {
                            return Err(failed(
                                Some(e),
                                code("ncclCommDeregister", r, self.backend.last_error(e.real())),
                            ));
                        }
                    }
                }
            }
            Ok(())
        };
        if let Err(f) = run() {
            return f;
        }
        drop(reg);
        let mut reg = self.reg();
        // Splits before their parents.
        for e in reg.entries.iter_mut().rev().filter(|e| e.live()) {
            if e.state != RealState::Live || e.real() == 0 {
                continue;
            }
            if let Err(f) = self.use_device(e) {
                return f;
            }
            let (call, r) = if suspend {
                ("ncclCommSuspend", self.backend.suspend(e.real()))
            } else {
                ("ncclCommDestroy", self.backend.destroy(e.real()))
            };
            if r != NCCL_SUCCESS {
                return failed(Some(e), code(call, r, self.backend.last_error(e.real())));
            }
            e.state = if suspend {
                RealState::Suspended
            } else {
                if let Some(h) = &e.handle {
                    h.real.store(0, Ordering::Release);
                }
                RealState::Destroyed
            };
        }
        let suspended = !reg
            .entries
            .iter()
            .any(|e| e.live() && e.state == RealState::Destroyed);
        LayerMsg::Released { suspended }
    }

    /// Registers every recorded buffer again on its (new or resumed) communicator.
    fn register_again(&self, entries: &[Entry]) -> Result<(), LayerMsg> {
        for e in entries.iter().filter(|e| e.live()) {
            for b in &e.buffers {
                self.use_device(e)?;
                let (r, h) = self.backend.register(e.real(), b.ptr, b.size);
                if r != NCCL_SUCCESS {
                    return Err(failed(
                        Some(e),
                        code("ncclCommRegister", r, self.backend.last_error(e.real())),
                    ));
                }
                b.real.store(h, Ordering::Release);
            }
        }
        Ok(())
    }

    /// Resume (same node, after a Release that suspended): ncclCommResume every communicator.
    pub fn resume(&self) -> LayerMsg {
        if let Some(f) = self.not_held("Resume") {
            return f;
        }
        let _span = tracing::info_span!("nccl resume").entered();
        let mut reg = self.reg();
        for e in reg.entries.iter_mut().filter(|e| e.live()) {
            match e.state {
                RealState::Live => {}
                RealState::Destroyed => {
                    return failed(
                        Some(e),
                        format!(
                            "communicator {} was destroyed at Release (this NCCL has no \
                             ncclCommSuspend): only a Rebuild brings it back",
                            e.id
                        ),
                    )
                }
                RealState::Suspended => {
                    if let Err(f) = self.use_device(e) {
                        return f;
                    }
                    let r = self.backend.resume(e.real());
                    if r != NCCL_SUCCESS {
                        return failed(
                            Some(e),
                            code("ncclCommResume", r, self.backend.last_error(e.real())),
                        );
                    }
                    e.state = RealState::Live;
                }
            }
        }
        match self.register_again(&reg.entries) {
            Ok(()) => LayerMsg::Rebuilt,
            Err(f) => f,
        }
    }

    /// NewUniqueId: a fresh unique id for root key `key`.
    pub fn new_unique_id(&self, key: String) -> LayerMsg {
        match self.backend.unique_id() {
            Ok(id) => LayerMsg::UniqueId {
                key,
                id: hex::encode(id.bytes()),
            },
            Err(r) => failed(None, code("ncclGetUniqueId", r, self.backend.last_error(0))),
        }
    }

    /// Rebuild: every root communicator again on its key's fresh unique id (same rank, size,
    /// device and config), then the splits in the order they were made, on the rebuilt
    /// parents, then the buffers registered again. Communicators made in one group of the
    /// application's are made again in one group. The real communicators they replace are left
    /// as they are: after a restore they belong to another machine, and freeing them could block.
    pub fn rebuild(&self, ids: Vec<(String, String)>) -> LayerMsg {
        if let Some(f) = self.not_held("Rebuild") {
            return f;
        }
        let _span = tracing::info_span!("nccl rebuild").entered();
        let mut fresh = HashMap::new();
        for (key, hexid) in ids {
            let bytes = hex::decode(&hexid)
                .ok()
                .and_then(|b| <[u8; NCCL_UNIQUE_ID_BYTES]>::try_from(b).ok());
            match bytes {
                Some(b) => fresh.insert(key, ncclUniqueId::from_bytes(&b)),
                None => {
                    return failed(
                        None,
                        format!(
                            "unique id for key {key} is not {NCCL_UNIQUE_ID_BYTES} bytes of hex"
                        ),
                    )
                }
            };
        }
        let mut reg = self.reg();
        let needed = replay_set(&reg.entries);
        // What is not made again has no real communicator any more: a destroy of its handle
        // frees nothing.
        for (e, _) in reg.entries.iter().zip(&needed).filter(|(_, n)| !**n) {
            if let Some(h) = &e.handle {
                h.real.store(0, Ordering::Release);
            }
        }
        let mut keep = needed.iter();
        reg.entries.retain(|_| *keep.next().unwrap_or(&false));
        // New real communicators by entry id.
        let mut made: HashMap<u64, RealComm> = HashMap::new();
        let mut i = 0;
        while i < reg.entries.len() {
            let tag = reg.entries[i].group;
            let mut j = i + 1;
            while tag.is_some() && j < reg.entries.len() && reg.entries[j].group == tag {
                j += 1;
            }
            if let Err(f) = self.remake(&reg.entries[i..j], &fresh, &mut made) {
                return f;
            }
            i = j;
        }
        for e in reg.entries.iter_mut() {
            let real = made.get(&e.id).copied().unwrap_or(0);
            if let Some(h) = &e.handle {
                h.real.store(real, Ordering::Release);
            }
            e.state = RealState::Live;
        }
        if let Err(f) = self.register_again(&reg.entries) {
            return f;
        }
        // Made again only for their splits: destroyed now.
        for e in reg.entries.iter().filter(|e| e.gone) {
            if let Some(&real) = made.get(&e.id).filter(|r| **r != 0) {
                let _ = self.backend.use_device(e.dev());
                let r = self.backend.destroy(real);
                if r != NCCL_SUCCESS {
                    tracing::warn!(
                        comm = e.id,
                        "{}",
                        code("ncclCommDestroy", r, self.backend.last_error(real))
                    );
                }
                if let Some(h) = &e.handle {
                    h.real.store(0, Ordering::Release);
                }
            }
        }
        let parents: Vec<bool> = reg
            .entries
            .iter()
            .map(|e| e.live() || has_children(&reg.entries, e.id))
            .collect();
        let mut keep = parents.iter();
        reg.entries.retain(|_| *keep.next().unwrap_or(&false));
        LayerMsg::Rebuilt
    }

    /// Makes `group` (one entry, or the entries of one application group) again.
    fn remake(
        &self,
        group: &[Entry],
        fresh: &HashMap<String, ncclUniqueId>,
        made: &mut HashMap<u64, RealComm>,
    ) -> Result<(), LayerMsg> {
        let grouped = group.len() > 1;
        if grouped {
            let r = self.backend.group_start();
            if r != NCCL_SUCCESS {
                return Err(failed(
                    None,
                    code("ncclGroupStart", r, self.backend.last_error(0)),
                ));
            }
        }
        let mut results = Vec::new();
        for e in group {
            let dev = e.dev();
            if dev >= 0 {
                if let Err(m) = self.backend.use_device(dev) {
                    return Err(failed(Some(e), m));
                }
            }
            let cfg = e.config.as_deref();
            let (call, (r, real)) = match &e.origin {
                Origin::Root => {
                    let Some(id) = fresh.get(&e.key) else {
                        return Err(failed(
                            Some(e),
                            format!("no unique id for key {} (communicator {})", e.key, e.id),
                        ));
                    };
                    (
                        "ncclCommInitRankConfig",
                        self.backend.init_rank(e.nranks, id, e.rank(), cfg),
                    )
                }
                Origin::Split { parent, color, key } => {
                    let Some(&p) = made.get(parent).filter(|p| **p != 0) else {
                        return Err(failed(
                            Some(e),
                            format!(
                                "the parent {parent} of split communicator {} was not rebuilt",
                                e.id
                            ),
                        ));
                    };
                    ("ncclCommSplit", self.backend.split(p, *color, *key, cfg))
                }
            };
            results.push((e, call, r));
            made.insert(e.id, real);
        }
        if grouped {
            let r = self.backend.group_end();
            if r != NCCL_SUCCESS {
                return Err(failed(
                    Some(&group[0]),
                    code("ncclGroupEnd", r, self.backend.last_error(0)),
                ));
            }
        }
        for (e, call, r) in results {
            let real = made.get(&e.id).copied().unwrap_or(0);
            // A nonblocking config: the communicator is ready when its async error says so.
            let r = if r == NCCL_IN_PROGRESS && real != 0 {
                self.ready(real)
            } else {
                r
            };
            if r != NCCL_SUCCESS {
                return Err(failed(
                    Some(e),
                    code(call, r, self.backend.last_error(real)),
                ));
            }
        }
        Ok(())
    }

    /// Waits while `ncclCommGetAsyncError` says ncclInProgress; its final answer.
    fn ready(&self, real: RealComm) -> ncclResult_t {
        let mut pause = Duration::from_micros(100);
        loop {
            match self.backend.async_error(real) {
                NCCL_IN_PROGRESS => std::thread::sleep(pause),
                r => return r,
            }
            pause = (pause * 2).min(Duration::from_millis(10));
        }
    }
}

fn has_children(entries: &[Entry], id: u64) -> bool {
    entries
        .iter()
        .any(|e| matches!(e.origin, Origin::Split { parent, .. } if parent == id))
}

/// Which entries a rebuild makes again: the live ones, the ancestors of those, and every
/// split call (live, gone or NOCOLOR) of a parent made again, since every rank of a parent
/// calls its splits again.
fn replay_set(entries: &[Entry]) -> Vec<bool> {
    let index: HashMap<u64, usize> = entries.iter().enumerate().map(|(i, e)| (e.id, i)).collect();
    let mut need: Vec<bool> = entries.iter().map(Entry::live).collect();
    for i in (0..entries.len()).rev() {
        if need[i] {
            if let Origin::Split { parent, .. } = entries[i].origin {
                if let Some(&p) = index.get(&parent) {
                    need[p] = true;
                }
            }
        }
    }
    for i in 0..entries.len() {
        if let Origin::Split { parent, .. } = entries[i].origin {
            if index.get(&parent).is_some_and(|&p| need[p]) {
                need[i] = true;
            }
        }
    }
    need
}
