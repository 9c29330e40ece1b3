//! `gpu-ckpt-simgpu serve`: the node's simulated GPUs. Device memory lives only here; processes
//! reach it through the simulated libcuda.so.1 over a Unix socket, and the checkpoint calls of
//! a caller reach their target process through its mailbox (see `mailbox`).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::cuerr::cu;
use crate::mailbox::{self, Mailbox};
use crate::node::{format_uuid, NodeDesc};
use crate::proto::{self, CkptCall, FaultOp, Pair, ProcUse, Reply, Request, Role, SavedAlloc};

/// Device allocations are placed and accounted in units of this size.
const GRANULE: u64 = 2 << 20;
/// Where a process's device address space starts.
const VA_BASE: u64 = 0x7f00_0000_0000;
/// The longest the daemon waits for a process to finish a checkpoint or restore step.
const STEP_LIMIT: Duration = Duration::from_secs(600);
/// Extra time past a lock's own timeout before the daemon stops waiting for the answer.
const LOCK_GRACE: Duration = Duration::from_secs(10);

fn align_up(v: u64) -> u64 {
    v.div_ceil(GRANULE) * GRANULE
}

struct Alloc {
    gpu: usize,
    size: u64,
    data: Mutex<Vec<u8>>,
}

struct Conn {
    pid: i32,
    uid: u32,
    role: Role,
    allocs: BTreeMap<u64, Arc<Alloc>>,
    next_va: u64,
    contexts: BTreeSet<usize>,
}

#[derive(Default)]
struct Registry {
    conns: HashMap<u64, Conn>,
    /// Bytes allocated per GPU index (in granules).
    used: Vec<u64>,
}

/// The daemon's state.
pub struct Daemon {
    node: NodeDesc,
    socket: PathBuf,
    reg: Mutex<Registry>,
    faults: Mutex<HashSet<(Option<i32>, FaultOp)>>,
    last_args: Mutex<HashMap<String, Vec<u8>>>,
    pid_locks: Mutex<HashMap<i32, Arc<Mutex<()>>>>,
    /// Restores waiting for their process to reconnect: pid → GPU map.
    pending: Mutex<HashMap<i32, Vec<Pair>>>,
    next_conn: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// (pid, uid) of the peer, in the daemon's namespaces.
fn peer_cred(s: &UnixStream) -> io::Result<(i32, u32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most len bytes into cred.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((cred.pid, cred.uid))
}

impl Daemon {
    pub fn new(node: NodeDesc, socket: PathBuf) -> Daemon {
        let n = node.gpus.len();
        Daemon {
            node,
            socket,
            reg: Mutex::new(Registry {
                conns: HashMap::new(),
                used: vec![0; n],
            }),
            faults: Mutex::new(HashSet::new()),
            last_args: Mutex::new(HashMap::new()),
            pid_locks: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
        }
    }

    /// Binds the socket (mode 0666, like /dev/nvidia*) and serves until the process ends.
    pub fn serve(self: Arc<Self>) -> io::Result<()> {
        let _ = std::fs::remove_file(&self.socket);
        let tmp = self.socket.with_extension("sock.tmp");
        let _ = std::fs::remove_file(&tmp);
        let listener = UnixListener::bind(&tmp)?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o666))?;
        // Appear under the real name only when ready to accept.
        std::fs::rename(&tmp, &self.socket)?;
        for stream in listener.incoming() {
            let stream = match stream {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("gpu-ckpt-simgpu: accept: {e}");
                    continue;
                }
            };
            let me = Arc::clone(&self);
            std::thread::spawn(move || me.connection(stream));
        }
        Ok(())
    }

    fn gpu_index(&self, uuid: &[u8; 16]) -> Option<usize> {
        self.node.gpus.iter().position(|g| &g.uuid == uuid)
    }

    fn connection(&self, mut s: UnixStream) {
        let (pid, uid) = match peer_cred(&s) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("gpu-ckpt-simgpu: SO_PEERCRED: {e}");
                return;
            }
        };
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        lock(&self.reg).conns.insert(
            id,
            Conn {
                pid,
                uid,
                role: Role::Control,
                allocs: BTreeMap::new(),
                next_va: VA_BASE,
                contexts: BTreeSet::new(),
            },
        );
        while let Ok(req) = proto::recv::<Request, _>(&mut s) {
            if self.request(id, &mut s, req).is_err() {
                break;
            }
        }
        self.drop_conn(id);
    }

    /// Frees everything a connection held.
    fn drop_conn(&self, id: u64) {
        let mut reg = lock(&self.reg);
        if let Some(conn) = reg.conns.remove(&id) {
            for a in conn.allocs.values() {
                reg.used[a.gpu] = reg.used[a.gpu].saturating_sub(align_up(a.size));
            }
        }
    }

    /// The allocation of connection `id` holding `[addr, addr + len)`, and the offset of addr.
    fn find(&self, id: u64, addr: u64, len: u64) -> Option<(Arc<Alloc>, usize)> {
        let reg = lock(&self.reg);
        let conn = reg.conns.get(&id)?;
        let (start, a) = conn.allocs.range(..=addr).next_back()?;
        let off = addr - start;
        (off.checked_add(len)? <= a.size).then(|| (Arc::clone(a), off as usize))
    }

    fn request(&self, id: u64, s: &mut UnixStream, req: Request) -> io::Result<()> {
        let reply = match req {
            Request::Hello { role } => {
                if let Some(c) = lock(&self.reg).conns.get_mut(&id) {
                    c.role = role;
                }
                Reply::Ok
            }
            Request::Node => Reply::Node(self.node.clone()),
            Request::Context { gpu } => match self.gpu_index(&gpu) {
                Some(i) => {
                    if let Some(c) = lock(&self.reg).conns.get_mut(&id) {
                        c.contexts.insert(i);
                    }
                    Reply::Ok
                }
                None => Reply::err(cu::INVALID_DEVICE, "no such GPU"),
            },
            Request::Alloc { gpu, size } => self.alloc(id, gpu, size),
            Request::Free { ptr } => self.free(id, ptr),
            Request::HtoD { dst, len } => match self.find(id, dst, len) {
                Some((a, off)) => {
                    let mut data = lock(&a.data);
                    s.read_exact(&mut data[off..off + len as usize])?;
                    Reply::Ok
                }
                None => {
                    proto::drain(s, len)?;
                    Reply::err(
                        cu::INVALID_VALUE,
                        format!("{dst:#x}+{len} is not device memory of this process"),
                    )
                }
            },
            Request::DtoH { src, len } => match self.find(id, src, len) {
                Some((a, off)) => {
                    let data = lock(&a.data);
                    proto::send(s, &Reply::Data { len })?;
                    return s.write_all(&data[off..off + len as usize]);
                }
                None => Reply::err(
                    cu::INVALID_VALUE,
                    format!("{src:#x}+{len} is not device memory of this process"),
                ),
            },
            Request::DtoD { dst, src, len } => self.dtod(id, dst, src, len),
            Request::Memset {
                dst,
                value,
                elem,
                count,
            } => self.memset(id, dst, value, elem, count),
            Request::MemInfo { gpu } => match self.gpu_index(&gpu) {
                Some(i) => {
                    let total = self.node.gpus[i].memory_bytes;
                    let used = lock(&self.reg).used[i];
                    Reply::MemInfo {
                        free: total.saturating_sub(used),
                        total,
                    }
                }
                None => Reply::err(cu::INVALID_DEVICE, "no such GPU"),
            },
            Request::Ckpt(call) => self.ckpt(id, call),
            Request::Release => {
                let mut reg = lock(&self.reg);
                let mut freed = Vec::new();
                if let Some(c) = reg.conns.get_mut(&id) {
                    freed = std::mem::take(&mut c.allocs).into_values().collect();
                    c.contexts.clear();
                    c.role = Role::Control;
                }
                for a in freed {
                    reg.used[a.gpu] = reg.used[a.gpu].saturating_sub(align_up(a.size));
                }
                Reply::Ok
            }
            Request::Restore { allocs } => self.restore_target(id, allocs),
            Request::Processes => Reply::Processes(self.processes()),
            Request::Fault { pid, op, set } => {
                let mut f = lock(&self.faults);
                if set {
                    f.insert((pid, op));
                } else {
                    f.remove(&(pid, op));
                }
                Reply::Ok
            }
            Request::LastArgs { call } => match lock(&self.last_args).get(&call) {
                Some(a) => Reply::Args(a.clone()),
                None => Reply::err(cu::NOT_FOUND, format!("{call} was not called")),
            },
        };
        proto::send(s, &reply)
    }

    fn alloc(&self, id: u64, gpu: [u8; 16], size: u64) -> Reply {
        let Some(i) = self.gpu_index(&gpu) else {
            return Reply::err(cu::INVALID_DEVICE, "no such GPU");
        };
        if size == 0 {
            return Reply::err(cu::INVALID_VALUE, "zero-byte allocation");
        }
        let mut reg = lock(&self.reg);
        let need = align_up(size);
        if reg.used[i] + need > self.node.gpus[i].memory_bytes {
            return Reply::err(cu::OUT_OF_MEMORY, "out of device memory");
        }
        let Some(conn) = reg.conns.get_mut(&id) else {
            return Reply::err(cu::NOT_INITIALIZED, "unknown connection");
        };
        let ptr = conn.next_va;
        conn.next_va = align_up(ptr + size);
        conn.allocs.insert(
            ptr,
            Arc::new(Alloc {
                gpu: i,
                size,
                data: Mutex::new(vec![0u8; size as usize]),
            }),
        );
        conn.contexts.insert(i);
        reg.used[i] += need;
        Reply::Ptr(ptr)
    }

    fn free(&self, id: u64, ptr: u64) -> Reply {
        let mut reg = lock(&self.reg);
        let Some(conn) = reg.conns.get_mut(&id) else {
            return Reply::err(cu::NOT_INITIALIZED, "unknown connection");
        };
        match conn.allocs.remove(&ptr) {
            Some(a) => {
                reg.used[a.gpu] = reg.used[a.gpu].saturating_sub(align_up(a.size));
                Reply::Ok
            }
            None => Reply::err(
                cu::INVALID_VALUE,
                format!("{ptr:#x} is not an allocation of this process"),
            ),
        }
    }

    fn dtod(&self, id: u64, dst: u64, src: u64, len: u64) -> Reply {
        let (Some((d, doff)), Some((sa, soff))) =
            (self.find(id, dst, len), self.find(id, src, len))
        else {
            return Reply::err(
                cu::INVALID_VALUE,
                "copy outside device memory of this process",
            );
        };
        let n = len as usize;
        if Arc::ptr_eq(&d, &sa) {
            lock(&d.data).copy_within(soff..soff + n, doff);
        } else {
            // A fixed lock order (by address) between two allocations.
            let (first, second) = if dst < src { (&d, &sa) } else { (&sa, &d) };
            let g1 = lock(&first.data);
            let g2 = lock(&second.data);
            let (mut dg, sg) = if dst < src { (g1, g2) } else { (g2, g1) };
            dg[doff..doff + n].copy_from_slice(&sg[soff..soff + n]);
        }
        Reply::Ok
    }

    fn memset(&self, id: u64, dst: u64, value: u32, elem: u8, count: u64) -> Reply {
        let len = count.saturating_mul(u64::from(elem));
        if !matches!(elem, 1 | 2 | 4) || (elem > 1 && !dst.is_multiple_of(u64::from(elem))) {
            return Reply::err(cu::INVALID_VALUE, "misaligned memset");
        }
        let Some((a, off)) = self.find(id, dst, len) else {
            return Reply::err(
                cu::INVALID_VALUE,
                "memset outside device memory of this process",
            );
        };
        let mut data = lock(&a.data);
        let region = &mut data[off..off + len as usize];
        match elem {
            1 => region.fill(value as u8),
            2 => region
                .chunks_exact_mut(2)
                .for_each(|c| c.copy_from_slice(&(value as u16).to_le_bytes())),
            _ => region
                .chunks_exact_mut(4)
                .for_each(|c| c.copy_from_slice(&value.to_le_bytes())),
        }
        Reply::Ok
    }

    fn processes(&self) -> Vec<ProcUse> {
        let reg = lock(&self.reg);
        let mut out = Vec::new();
        for c in reg.conns.values().filter(|c| c.role == Role::Cuda) {
            for &g in &c.contexts {
                let used = c
                    .allocs
                    .values()
                    .filter(|a| a.gpu == g)
                    .map(|a| align_up(a.size))
                    .sum();
                out.push(ProcUse {
                    pid: c.pid as u32,
                    gpu: self.node.gpus[g].uuid,
                    used_bytes: used,
                });
            }
        }
        out.sort_by_key(|p| (p.pid, p.gpu));
        out
    }

    fn fault(&self, pid: i32, op: FaultOp) -> bool {
        let f = lock(&self.faults);
        f.contains(&(Some(pid), op)) || f.contains(&(None, op))
    }

    // -----------------------------------------------------------------------------------------
    // The checkpoint API
    // -----------------------------------------------------------------------------------------

    fn ckpt(&self, caller: u64, call: CkptCall) -> Reply {
        let name = call.name();
        match self.ckpt_inner(caller, call) {
            Ok(r) => r,
            Err((code, msg)) => Reply::err(code, format!("{name}: {msg}")),
        }
    }

    fn ckpt_inner(&self, caller: u64, call: CkptCall) -> Result<Reply, (u32, String)> {
        let (caller_pid, caller_uid) = {
            let reg = lock(&self.reg);
            let c = reg
                .conns
                .get(&caller)
                .ok_or((cu::NOT_INITIALIZED, "unknown caller".to_string()))?;
            (c.pid, c.uid)
        };
        if let CkptCall::Lock { args, .. }
        | CkptCall::Checkpoint { args, .. }
        | CkptCall::Restore { args, .. }
        | CkptCall::Unlock { args, .. } = &call
        {
            lock(&self.last_args).insert(call.name().to_string(), args.clone());
        }
        let pid = match &call {
            CkptCall::Lock { pid, .. }
            | CkptCall::Checkpoint { pid, .. }
            | CkptCall::Restore { pid, .. }
            | CkptCall::Unlock { pid, .. }
            | CkptCall::GetState { pid }
            | CkptCall::GetRestoreThreadId { pid } => *pid,
        };
        let mutating = !matches!(
            call,
            CkptCall::GetState { .. } | CkptCall::GetRestoreThreadId { .. }
        );
        if pid <= 0 {
            return Err((cu::INVALID_VALUE, format!("invalid pid {pid}")));
        }
        if mutating && pid == caller_pid {
            return Err((
                cu::INVALID_VALUE,
                "a process cannot checkpoint itself".into(),
            ));
        }
        let owner = std::fs::metadata(format!("/proc/{pid}"))
            .map(|m| std::os::unix::fs::MetadataExt::uid(&m))
            .map_err(|_| (cu::INVALID_VALUE, format!("no process {pid}")))?;
        if caller_uid != 0 && caller_uid != owner {
            return Err((
                cu::NOT_PERMITTED,
                format!("uid {caller_uid} may not act on process {pid}"),
            ));
        }
        let mb = Mailbox::open_pid(pid)
            .map_err(|e| (cu::INVALID_VALUE, format!("process {pid}: {e}")))?
            .ok_or((
                cu::NOT_INITIALIZED,
                format!("process {pid} has no CUDA state"),
            ))?;
        let state = mb.get().state.load(Ordering::Acquire);
        let want = |s: u32, what: &str| {
            if state == s {
                Ok(())
            } else {
                Err((
                    cu::ILLEGAL_STATE,
                    format!("process {pid} is in state {state}, not {what}"),
                ))
            }
        };
        let pid_lock = Arc::clone(lock(&self.pid_locks).entry(pid).or_default());
        let _serial = if mutating {
            Some(lock(&pid_lock))
        } else {
            None
        };
        let answer = |code: Option<u32>, step: &str| match code {
            Some(cu::SUCCESS) => Ok(Reply::Ok),
            Some(code) => Err((code, format!("{step} of process {pid} failed"))),
            None => Err((
                cu::TIMEOUT,
                format!("process {pid} did not answer the {step}"),
            )),
        };
        match call {
            CkptCall::GetState { .. } => Ok(Reply::State(state)),
            CkptCall::GetRestoreThreadId { .. } => {
                let ns_tid = mb.get().restore_tid.load(Ordering::Acquire);
                host_tid(pid, ns_tid).map(Reply::Tid).ok_or((
                    cu::NOT_INITIALIZED,
                    format!("process {pid} has no restore thread"),
                ))
            }
            CkptCall::Lock { args, .. } => {
                check_reserved(&args, 4)?;
                want(crate::STATE_RUNNING, "running")?;
                let timeout_ms = u32::from_le_bytes([args[0], args[1], args[2], args[3]]);
                let stall = self.fault(pid, FaultOp::LockTimeout);
                let deadline = if timeout_ms > 0 {
                    Instant::now() + Duration::from_millis(u64::from(timeout_ms)) + LOCK_GRACE
                } else {
                    Instant::now() + STEP_LIMIT
                };
                let flags = if stall { mailbox::flags::STALL } else { 0 };
                answer(
                    mb.call(mailbox::cmd::LOCK, timeout_ms, flags, Some(deadline)),
                    "lock",
                )
            }
            CkptCall::Checkpoint { args, .. } => {
                check_reserved(&args, 0)?;
                want(crate::STATE_LOCKED, "locked")?;
                if self.fault(pid, FaultOp::CheckpointFail) {
                    return Err((cu::OPERATING_SYSTEM, "injected checkpoint failure".into()));
                }
                answer(
                    mb.call(
                        mailbox::cmd::CHECKPOINT,
                        0,
                        0,
                        Some(Instant::now() + STEP_LIMIT),
                    ),
                    "checkpoint",
                )
            }
            CkptCall::Restore { args, pairs, .. } => {
                // gpuPairs and gpuPairsCount exist from CUDA 13.0 on; before, all 64 bytes are reserved.
                check_reserved(
                    &args,
                    if self.node.cuda_version >= 13000 {
                        12
                    } else {
                        0
                    },
                )?;
                want(crate::STATE_CHECKPOINTED, "checkpointed")?;
                let map = self.restore_map(&mb, &pairs)?;
                if self.fault(pid, FaultOp::RestoreFail) {
                    return Err((cu::OPERATING_SYSTEM, "injected restore failure".into()));
                }
                lock(&self.pending).insert(pid, map);
                mb.set_socket(&self.socket);
                let code = mb.call(
                    mailbox::cmd::RESTORE,
                    0,
                    0,
                    Some(Instant::now() + STEP_LIMIT),
                );
                lock(&self.pending).remove(&pid);
                answer(code, "restore")
            }
            CkptCall::Unlock { args, .. } => {
                check_reserved(&args, 0)?;
                want(crate::STATE_LOCKED, "locked")?;
                answer(
                    mb.call(
                        mailbox::cmd::UNLOCK,
                        0,
                        0,
                        Some(Instant::now() + STEP_LIMIT),
                    ),
                    "unlock",
                )
            }
        }
    }

    /// The GPU map of a restore, checked as the driver checks it: every checkpointed GPU listed
    /// (when pairs are given), each target present on this node, of the same chip, with the
    /// memory the process needs.
    fn restore_map(&self, mb: &Mailbox, pairs: &[Pair]) -> Result<Vec<Pair>, (u32, String)> {
        let l = mb.get();
        let n = (l.ngpus.load(Ordering::Acquire) as usize).min(mailbox::MAX_GPUS);
        let mut map = Vec::new();
        let mut need: HashMap<usize, u64> = HashMap::new();
        let mut targets = HashSet::new();
        for slot in &l.gpus[..n] {
            let old = slot.uuid;
            let new = if pairs.is_empty() {
                old
            } else {
                pairs.iter().find(|p| p.0 == old).map(|p| p.1).ok_or((
                    cu::INVALID_VALUE,
                    format!(
                        "the GPU pairs do not list checkpointed GPU {}",
                        format_uuid(&old)
                    ),
                ))?
            };
            if !targets.insert(new) {
                return Err((
                    cu::INVALID_VALUE,
                    format!("GPU {} is named twice as a target", format_uuid(&new)),
                ));
            }
            let i = self.gpu_index(&new).ok_or((
                cu::INVALID_DEVICE,
                format!("GPU {} is not on this node", format_uuid(&new)),
            ))?;
            let old_name = mailbox::get_name(&slot.name);
            let g = &self.node.gpus[i];
            if g.name != old_name {
                return Err((
                    cu::INVALID_DEVICE,
                    format!(
                        "GPU {} is a {}, the checkpoint was taken on a {old_name}",
                        format_uuid(&new),
                        g.name
                    ),
                ));
            }
            *need.entry(i).or_default() += slot.bytes;
            map.push((old, new));
        }
        let reg = lock(&self.reg);
        for (i, bytes) in need {
            let g = &self.node.gpus[i];
            if bytes > g.memory_bytes || reg.used[i] + bytes > g.memory_bytes {
                return Err((
                    cu::OUT_OF_MEMORY,
                    format!(
                        "GPU {} has {} bytes free, the process needs {bytes}",
                        format_uuid(&g.uuid),
                        g.memory_bytes.saturating_sub(reg.used[i])
                    ),
                ));
            }
        }
        Ok(map)
    }

    /// A restoring process reconnected: put its allocations back at their addresses on the GPUs
    /// the map names.
    fn restore_target(&self, id: u64, allocs: Vec<SavedAlloc>) -> Reply {
        let mut reg = lock(&self.reg);
        let Some(pid) = reg.conns.get(&id).map(|c| c.pid) else {
            return Reply::err(cu::NOT_INITIALIZED, "unknown connection");
        };
        let Some(map) = lock(&self.pending).get(&pid).cloned() else {
            return Reply::err(
                cu::NOT_PERMITTED,
                format!("no restore is pending for process {pid}"),
            );
        };
        let mut placed = Vec::new();
        let mut add: HashMap<usize, u64> = HashMap::new();
        for a in &allocs {
            let Some(new) = map.iter().find(|p| p.0 == a.gpu).map(|p| p.1) else {
                return Reply::err(
                    cu::INVALID_VALUE,
                    format!(
                        "allocation {:#x} is on a GPU the checkpoint did not record",
                        a.ptr
                    ),
                );
            };
            let Some(i) = self.gpu_index(&new) else {
                return Reply::err(cu::INVALID_DEVICE, "no such GPU");
            };
            *add.entry(i).or_default() += align_up(a.size);
            placed.push((a.ptr, i, a.size));
        }
        for (&i, &bytes) in &add {
            if reg.used[i] + bytes > self.node.gpus[i].memory_bytes {
                return Reply::err(cu::OUT_OF_MEMORY, "out of device memory");
            }
        }
        for (&i, &bytes) in &add {
            reg.used[i] += bytes;
        }
        let Some(conn) = reg.conns.get_mut(&id) else {
            return Reply::err(cu::NOT_INITIALIZED, "unknown connection");
        };
        for (ptr, i, size) in placed {
            conn.allocs.insert(
                ptr,
                Arc::new(Alloc {
                    gpu: i,
                    size,
                    data: Mutex::new(vec![0u8; size as usize]),
                }),
            );
            conn.contexts.insert(i);
            conn.next_va = conn.next_va.max(align_up(ptr + size));
        }
        Reply::RestoreMap(map)
    }
}

/// Requires the reserved bytes of a 64-byte argument struct, from `from` on, to be zero.
fn check_reserved(args: &[u8], from: usize) -> Result<(), (u32, String)> {
    if args.len() != 64 {
        return Err((
            cu::INVALID_VALUE,
            format!("argument struct of {} bytes, not 64", args.len()),
        ));
    }
    match args[from..].iter().position(|b| *b != 0) {
        Some(i) => Err((
            cu::INVALID_VALUE,
            format!(
                "reserved byte {} of the argument struct is not zero",
                from + i
            ),
        )),
        None => Ok(()),
    }
}

/// The daemon-namespace id of the thread whose id in the process's own namespace is `ns_tid`.
fn host_tid(pid: i32, ns_tid: i32) -> Option<i32> {
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
    {
        let status = std::fs::read_to_string(entry.path().join("status")).unwrap_or_default();
        let inner = status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|t| t.parse::<i32>().ok());
        if inner == Some(ns_tid) {
            return entry.file_name().to_str()?.parse().ok();
        }
    }
    None
}

/// Lays out a node directory: the two libraries (from `lib_src`, the build's or the install's
/// directory) in DIR/lib, one file per GPU in DIR/devices, and the CDI spec in `cdi_dir`.
pub fn prepare_dir(
    dir: &Path,
    lib_src: &Path,
    node: &NodeDesc,
    cdi_dir: Option<&Path>,
) -> io::Result<()> {
    let lib = dir.join("lib");
    std::fs::create_dir_all(&lib)?;
    for (src, soname, link) in [
        ("libcuda.so", "libcuda.so.1", "libcuda.so"),
        ("libnvidia_ml.so", "libnvidia-ml.so.1", "libnvidia-ml.so"),
    ] {
        let from = lib_src.join(src);
        let tmp = lib.join(format!(".{soname}.tmp"));
        std::fs::copy(&from, &tmp)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", from.display())))?;
        // A rename, so that running processes keep the file they mapped.
        std::fs::rename(&tmp, lib.join(soname))?;
        let l = lib.join(link);
        let _ = std::fs::remove_file(&l);
        std::os::unix::fs::symlink(soname, &l)?;
    }
    let devices = dir.join("devices");
    std::fs::create_dir_all(&devices)?;
    for g in &node.gpus {
        std::fs::write(devices.join(format_uuid(&g.uuid)), format!("{}\n", g.index))?;
    }
    if let Some(cdi) = cdi_dir {
        std::fs::create_dir_all(cdi)?;
        let spec = crate::cdi::spec(dir, node);
        let path = cdi.join(crate::cdi::SPEC_FILE);
        let tmp = cdi.join(format!(".{}.tmp", crate::cdi::SPEC_FILE));
        std::fs::write(
            &tmp,
            serde_json::to_vec_pretty(&spec).map_err(io::Error::other)?,
        )?;
        std::fs::rename(tmp, path)?;
    }
    Ok(())
}
