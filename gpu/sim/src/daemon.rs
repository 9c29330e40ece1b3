//! `gpu-ckpt-simgpu serve`: the node's simulated GPUs. Device memory lives only here; processes
//! reach it through the simulated libcuda.so.1 over a Unix socket, and the checkpoint calls of
//! a caller reach their target process through its mailbox (see `mailbox`).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

mod comms;

use crate::cuerr::cu;
use crate::mailbox::{self, Mailbox};
use crate::node::{format_uuid, NodeDesc};
use crate::proto::{
    self, CkptCall, FaultOp, MappedRange, Pair, ProcUse, Reply, Request, Role, SavedAlloc,
};

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
    /// A range a custom-storage operation mapped into this process: another process's memory,
    /// not counted against the GPU again, and not the holder's to free.
    mapped: bool,
}

impl Alloc {
    /// A new allocation of `size` zero bytes on GPU `gpu`, the process's own.
    fn zeroed(gpu: usize, size: u64) -> Arc<Alloc> {
        Arc::new(Alloc {
            gpu,
            size,
            data: Mutex::new(crate::zeroed_buffer(size as usize)),
            mapped: false,
        })
    }
}

/// A custom-storage checkpoint or restore waiting for `cuCheckpointOperationComplete`.
struct Op {
    /// The calling connection, which holds the ranges.
    caller: u64,
    /// The target process.
    pid: i32,
    /// The ranges' addresses in the caller.
    ranges: Vec<u64>,
    kind: OpKind,
}

enum OpKind {
    /// The target's memory moved into the ranges; its granules stay counted until completion.
    Checkpoint { held: Vec<(usize, u64)> },
    /// Where each range's bytes go: the restored target's allocations, in order.
    Restore {
        target_conn: u64,
        layout: Vec<(u64, Vec<(u64, u64)>)>,
    },
}

type CkptResult<T> = Result<T, (u32, String)>;

/// A target's allocations (address, allocation) on their way to a custom-storage caller.
type Handover = Vec<(u64, Arc<Alloc>)>;

struct Conn {
    pid: i32,
    uid: u32,
    role: Role,
    allocs: BTreeMap<u64, Arc<Alloc>>,
    next_va: u64,
    contexts: BTreeSet<usize>,
    /// Its contexts go through an MPS server.
    mps: bool,
}

#[derive(Default)]
struct Registry {
    conns: HashMap<u64, Conn>,
    /// Bytes allocated per GPU index (in granules).
    used: Vec<u64>,
}

impl Registry {
    /// Gives back the granules a custom-storage checkpoint held: (GPU, bytes) each.
    fn release(&mut self, held: Vec<(usize, u64)>) {
        for (g, bytes) in held {
            self.used[g] = self.used[g].saturating_sub(bytes);
        }
    }
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
    /// The connection a restoring process came back on: pid → connection.
    restored_conn: Mutex<HashMap<i32, u64>>,
    /// Memory handed over by a target at a custom-storage checkpoint: pid → (address, allocation).
    handover: Mutex<HashMap<i32, Handover>>,
    /// Custom-storage operations by handle.
    ops: Mutex<HashMap<u64, Op>>,
    next_op: AtomicU64,
    next_conn: AtomicU64,
    /// NCCL communicators (libnccl.so.2's requests).
    comms: comms::Comms,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The refusal of a copy to or from `ptr`+`len` that is not the process's device memory.
fn not_device_memory(ptr: u64, len: u64) -> Reply {
    Reply::err(
        cu::INVALID_VALUE,
        format!("{ptr:#x}+{len} is not device memory of this process"),
    )
}

/// Copies `len` bytes between the daemon's `local` and process `pid`'s memory at `remote`:
/// into the process (`to_remote`, `process_vm_writev`) or out of it (`process_vm_readv`), as a
/// GPU's copy engine moves host memory. Needs the right to ptrace `pid` (the daemon runs as
/// root); the caller falls back to the socket when this fails.
fn vm_copy(pid: i32, local: *mut u8, len: usize, remote: u64, to_remote: bool) -> io::Result<()> {
    if pid <= 0 {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    let mut done = 0usize;
    while done < len {
        let l = libc::iovec {
            // SAFETY (of the arithmetic): `done < len`, inside `local`'s `len` bytes.
            iov_base: local.wrapping_add(done).cast(),
            iov_len: len - done,
        };
        let r = libc::iovec {
            iov_base: (remote as usize + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: `l` covers memory this process owns for `len - done` bytes; the kernel checks
        // the remote range against the target's mappings.
        let n = unsafe {
            if to_remote {
                libc::process_vm_writev(pid, &l, 1, &r, 1, 0)
            } else {
                libc::process_vm_readv(pid, &l, 1, &r, 1, 0)
            }
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            return Err(io::Error::from_raw_os_error(libc::EFAULT));
        }
        done += n as usize;
    }
    Ok(())
}

/// A custom-storage restore's range that holds the bytes of its GPU's one allocation (lent at
/// the restore step) moves them back into that allocation: `true` when it did.
fn lend_back<'a>(
    range: &Alloc,
    parts: &[(u64, u64)],
    target: impl FnOnce(u64) -> Option<&'a Arc<Alloc>>,
) -> bool {
    let [(ptr, size)] = parts[..] else {
        return false;
    };
    let Some(target) = target(ptr) else {
        return false;
    };
    let mut dst = lock(&target.data);
    let mut src = lock(&range.data);
    if !dst.is_empty() || src.len() as u64 != size {
        return false;
    }
    *dst = std::mem::take(&mut *src);
    true
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
            restored_conn: Mutex::new(HashMap::new()),
            handover: Mutex::new(HashMap::new()),
            ops: Mutex::new(HashMap::new()),
            next_op: AtomicU64::new(1),
            next_conn: AtomicU64::new(1),
            comms: comms::Comms::new(),
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
                mps: false,
            },
        );
        while let Ok(req) = proto::recv::<Request, _>(&mut s) {
            if self.request(id, &mut s, req).is_err() {
                break;
            }
        }
        self.drop_conn(id);
    }

    /// Frees everything a connection held, and the custom-storage operations it left open (their
    /// targets stay CHECKPOINTING or RESTORING).
    fn drop_conn(&self, id: u64) {
        let abandoned: Vec<Op> = {
            let mut ops = lock(&self.ops);
            let keys: Vec<u64> = ops
                .iter()
                .filter(|(_, o)| o.caller == id)
                .map(|(k, _)| *k)
                .collect();
            keys.iter().filter_map(|k| ops.remove(k)).collect()
        };
        let mut reg = lock(&self.reg);
        let conn = reg.conns.remove(&id);
        for op in abandoned {
            match op.kind {
                OpKind::Checkpoint { held } => reg.release(held),
                OpKind::Restore {
                    target_conn,
                    layout,
                } => {
                    let (Some(c), Some(t)) = (&conn, reg.conns.get(&target_conn)) else {
                        continue;
                    };
                    for (range_ptr, parts) in layout {
                        if let Some(range) = c.allocs.get(&range_ptr) {
                            lend_back(range, &parts, |p| t.allocs.get(&p));
                        }
                    }
                }
            }
        }
        if let Some(conn) = conn {
            for a in conn.allocs.values().filter(|a| !a.mapped) {
                reg.used[a.gpu] = reg.used[a.gpu].saturating_sub(align_up(a.size));
            }
        }
    }

    /// The allocation of connection `id` holding `[addr, addr + len)`, and the offset of addr.
    /// The pid of connection `id`'s peer (0 when it is gone).
    fn peer_pid(&self, id: u64) -> i32 {
        lock(&self.reg).conns.get(&id).map_or(0, |c| c.pid)
    }

    /// Allocation `ptr` of connection `id`.
    fn conn_alloc(&self, id: u64, ptr: u64) -> Option<Arc<Alloc>> {
        lock(&self.reg).conns.get(&id)?.allocs.get(&ptr).cloned()
    }

    fn find(&self, id: u64, addr: u64, len: u64) -> Option<(Arc<Alloc>, usize)> {
        let reg = lock(&self.reg);
        let conn = reg.conns.get(&id)?;
        let (start, a) = conn.allocs.range(..=addr).next_back()?;
        let off = addr - start;
        // Bytes lent to a custom-storage restore's range are not the process's until it completes.
        let resident = lock(&a.data).len() as u64 == a.size;
        (resident && off.checked_add(len)? <= a.size).then(|| (Arc::clone(a), off as usize))
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
            Request::Context { gpu, mps } => match self.gpu_index(&gpu) {
                Some(i) => {
                    if let Some(c) = lock(&self.reg).conns.get_mut(&id) {
                        c.contexts.insert(i);
                        c.mps |= mps;
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
                    not_device_memory(dst, len)
                }
            },
            Request::DtoH { src, len } => match self.find(id, src, len) {
                Some((a, off)) => {
                    let data = lock(&a.data);
                    proto::send(s, &Reply::Data { len })?;
                    return s.write_all(&data[off..off + len as usize]);
                }
                None => not_device_memory(src, len),
            },
            Request::HtoDDirect { dst, len, addr } => self.direct(id, dst, len, addr, false),
            Request::DtoHDirect { src, len, addr } => self.direct(id, src, len, addr, true),
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
            Request::Ckpt(call) => self.ckpt(id, s.as_raw_fd(), call),
            Request::Release => {
                let mut reg = lock(&self.reg);
                let mut freed = Vec::new();
                if let Some(c) = reg.conns.get_mut(&id) {
                    freed = std::mem::take(&mut c.allocs).into_values().collect();
                    c.contexts.clear();
                    c.role = Role::Control;
                }
                for a in freed.iter().filter(|a| !a.mapped) {
                    reg.used[a.gpu] = reg.used[a.gpu].saturating_sub(align_up(a.size));
                }
                Reply::Ok
            }
            Request::Handover => {
                let mut reg = lock(&self.reg);
                match reg.conns.get_mut(&id) {
                    Some(c) => {
                        let moved: Handover = std::mem::take(&mut c.allocs)
                            .into_iter()
                            .filter(|(_, a)| !a.mapped)
                            .collect();
                        c.contexts.clear();
                        c.role = Role::Control;
                        let pid = c.pid;
                        drop(reg);
                        lock(&self.handover).insert(pid, moved);
                        Reply::Ok
                    }
                    None => Reply::err(cu::NOT_INITIALIZED, "unknown connection"),
                }
            }
            Request::Restore { allocs } => self.restore_target(id, allocs),
            Request::OperationComplete { handle } => match self.complete(id, handle) {
                Ok(()) => Reply::Ok,
                Err((code, msg)) => {
                    Reply::err(code, format!("cuCheckpointOperationComplete: {msg}"))
                }
            },
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
            Request::Nccl(call) => self.nccl(id, s.as_raw_fd(), call),
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
        conn.allocs.insert(ptr, Alloc::zeroed(i, size));
        conn.contexts.insert(i);
        reg.used[i] += need;
        Reply::Ptr(ptr)
    }

    fn free(&self, id: u64, ptr: u64) -> Reply {
        let mut reg = lock(&self.reg);
        let Some(conn) = reg.conns.get_mut(&id) else {
            return Reply::err(cu::NOT_INITIALIZED, "unknown connection");
        };
        if conn.allocs.get(&ptr).is_some_and(|a| a.mapped) {
            return Reply::err(
                cu::INVALID_VALUE,
                format!("{ptr:#x} is a custom-storage mapping, released by cuCheckpointOperationComplete"),
            );
        }
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

    /// Copies `len` bytes between the device memory at `dev` and the peer's memory at `addr`:
    /// into the peer (DtoH) if `to_process`, else out of it (HtoD).
    fn direct(&self, id: u64, dev: u64, len: u64, addr: u64, to_process: bool) -> Reply {
        let Some((a, off)) = self.find(id, dev, len) else {
            return not_device_memory(dev, len);
        };
        let mut data = lock(&a.data);
        let mem = &mut data[off..off + len as usize];
        match vm_copy(
            self.peer_pid(id),
            mem.as_mut_ptr(),
            mem.len(),
            addr,
            to_process,
        ) {
            Ok(()) => Reply::Ok,
            Err(e) if to_process => {
                Reply::err(cu::OPERATING_SYSTEM, format!("process_vm_writev: {e}"))
            }
            Err(e) => Reply::err(cu::OPERATING_SYSTEM, format!("process_vm_readv: {e}")),
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
                    .filter(|a| a.gpu == g && !a.mapped)
                    .map(|a| align_up(a.size))
                    .sum();
                out.push(ProcUse {
                    pid: c.pid as u32,
                    gpu: self.node.gpus[g].uuid,
                    used_bytes: used,
                    mps: c.mps,
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

    fn ckpt(&self, caller: u64, caller_fd: RawFd, call: CkptCall) -> Reply {
        let name = call.name();
        match self.ckpt_inner(caller, caller_fd, call) {
            Ok(r) => r,
            Err((code, msg)) => Reply::err(code, format!("{name}: {msg}")),
        }
    }

    /// A call that never returns while its caller lives: it ends when the caller's connection
    /// closes (the caller was killed; the answer then reaches nobody), when process `pid` exits,
    /// or after the step limit, leaving the process as the failed call would.
    fn hang(&self, caller_fd: RawFd, pid: i32, step: &str) -> (u32, String) {
        let until = Instant::now() + STEP_LIMIT;
        while Instant::now() < until {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                return (
                    cu::OPERATING_SYSTEM,
                    format!("process {pid} exited during the {step}"),
                );
            }
            if peer_closed(caller_fd, Duration::from_millis(50)) {
                return (
                    cu::OPERATING_SYSTEM,
                    format!("the caller of the {step} of process {pid} is gone"),
                );
            }
        }
        (
            cu::TIMEOUT,
            format!("process {pid} did not answer the {step}"),
        )
    }

    fn ckpt_inner(
        &self,
        caller: u64,
        caller_fd: RawFd,
        call: CkptCall,
    ) -> Result<Reply, (u32, String)> {
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
        let mb = cuda_mailbox(pid)?;
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
            CkptCall::GetState { .. } if self.fault(pid, FaultOp::StateHang) => {
                Err(self.hang(caller_fd, pid, "state read"))
            }
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
                if self.fault(pid, FaultOp::LockHang) {
                    return Err(self.hang(caller_fd, pid, "lock"));
                }
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
            CkptCall::Checkpoint {
                args, primaries, ..
            } => {
                // CUDA 13.4 made the first 8 bytes customStorageInfo_out; before, they are reserved.
                let custom = self.custom_storage(&args, 0);
                check_reserved(&args, if custom { 8 } else { 0 })?;
                want(crate::STATE_LOCKED, "locked")?;
                if custom {
                    self.check_primaries(&primaries, self.target_gpus(pid))?;
                }
                if self.fault(pid, FaultOp::CheckpointFail) {
                    return Err((cu::OPERATING_SYSTEM, "injected checkpoint failure".into()));
                }
                if self.fault(pid, FaultOp::CheckpointHang) {
                    return Err(self.hang(caller_fd, pid, "checkpoint"));
                }
                let flags = if custom { mailbox::flags::CUSTOM } else { 0 };
                answer(
                    mb.call(
                        mailbox::cmd::CHECKPOINT,
                        0,
                        flags,
                        Some(Instant::now() + STEP_LIMIT),
                    ),
                    "checkpoint",
                )?;
                if custom {
                    self.custom_checkpoint(caller, pid, &mb)
                } else {
                    Ok(Reply::Ok)
                }
            }
            CkptCall::Restore {
                args,
                pairs,
                primaries,
                ..
            } => {
                // gpuPairs and gpuPairsCount exist from CUDA 13.0 on; before, all 64 bytes are
                // reserved. CUDA 13.4 adds customStorageInfo_out at byte 16 (after 4 bytes of
                // padding).
                let custom = self.custom_storage(&args, 16);
                if custom {
                    check_zero(&args, 12..16)?;
                    check_reserved(&args, 24)?;
                } else {
                    check_reserved(
                        &args,
                        if self.node.cuda_version >= 13000 {
                            12
                        } else {
                            0
                        },
                    )?;
                }
                want(crate::STATE_CHECKPOINTED, "checkpointed")?;
                let was_custom = mb.get().custom.load(Ordering::Acquire) == 1;
                if custom != was_custom {
                    return Err((
                        cu::INVALID_VALUE,
                        if was_custom {
                            format!("process {pid} was checkpointed to custom storage: its restore needs customStorageInfo_out")
                        } else {
                            format!("process {pid} was checkpointed to host memory: there is nothing to restore from custom storage")
                        },
                    ));
                }
                let (map, others) = self.restore_map(&mb, &pairs)?;
                if custom {
                    let targets = map.iter().filter_map(|p| self.gpu_index(&p.1)).collect();
                    self.check_primaries(&primaries, targets)?;
                }
                if self.fault(pid, FaultOp::RestoreFail) {
                    return Err((cu::OPERATING_SYSTEM, "injected restore failure".into()));
                }
                if self.fault(pid, FaultOp::RestoreHang) {
                    // A driver that never finishes: the call returns only when the process or
                    // its caller is gone, or after the step limit.
                    return Err(self.hang(caller_fd, pid, "restore"));
                }
                lock(&self.pending).insert(pid, map.iter().chain(&others).copied().collect());
                mb.set_socket(&self.socket);
                let flags = if custom { mailbox::flags::CUSTOM } else { 0 };
                let code = mb.call(
                    mailbox::cmd::RESTORE,
                    0,
                    flags,
                    Some(Instant::now() + STEP_LIMIT),
                );
                lock(&self.pending).remove(&pid);
                let target_conn = lock(&self.restored_conn).remove(&pid);
                answer(code, "restore")?;
                match (custom, target_conn) {
                    (false, _) => Ok(Reply::Ok),
                    (true, Some(conn)) => self.custom_restore(caller, pid, conn, &mb, &map),
                    (true, None) => Err((
                        cu::OPERATING_SYSTEM,
                        format!("process {pid} did not reconnect"),
                    )),
                }
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

    /// Whether a checkpoint or restore argument struct asks for custom storage: a non-NULL
    /// `customStorageInfo_out` at `offset`, on a CUDA version that has it.
    fn custom_storage(&self, args: &[u8], offset: usize) -> bool {
        self.node.cuda_version >= crate::CUSTOM_STORAGE_SINCE
            && args
                .get(offset..offset + 8)
                .is_some_and(|b| b.iter().any(|x| *x != 0))
    }

    /// The GPUs (node indexes) process `pid` holds state on.
    fn target_gpus(&self, pid: i32) -> BTreeSet<usize> {
        let reg = lock(&self.reg);
        reg.conns
            .values()
            .filter(|c| c.pid == pid && c.role == Role::Cuda)
            .flat_map(|c| {
                c.contexts
                    .iter()
                    .copied()
                    .chain(c.allocs.values().map(|a| a.gpu))
            })
            .collect()
    }

    /// Custom storage maps memory onto the caller's GPUs: it needs a retained primary context on
    /// each of them.
    fn check_primaries(&self, primaries: &[[u8; 16]], gpus: BTreeSet<usize>) -> CkptResult<()> {
        for i in gpus {
            let uuid = self.node.gpus[i].uuid;
            if !primaries.contains(&uuid) {
                return Err((
                    cu::INVALID_CONTEXT,
                    format!(
                        "custom storage needs a retained primary context on GPU {} in the caller",
                        format_uuid(&uuid)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Puts one contiguous range into the caller's address space.
    fn map_range(&self, caller: u64, gpu: usize, data: Vec<u8>) -> CkptResult<u64> {
        let mut reg = lock(&self.reg);
        let conn = reg
            .conns
            .get_mut(&caller)
            .ok_or((cu::NOT_INITIALIZED, "the caller is gone".to_string()))?;
        let ptr = conn.next_va;
        let size = data.len() as u64;
        conn.next_va = align_up(ptr + size.max(1));
        conn.allocs.insert(
            ptr,
            Arc::new(Alloc {
                gpu,
                size,
                data: Mutex::new(data),
                mapped: true,
            }),
        );
        Ok(ptr)
    }

    /// The GPUs of a checkpoint in the order its mailbox lists them (the process's device
    /// ordinals), as node indexes after `map` (old UUID → new UUID).
    fn slot_order(&self, mb: &Mailbox, map: &[Pair]) -> Vec<usize> {
        let l = mb.get();
        let n = (l.ngpus.load(Ordering::Acquire) as usize).min(mailbox::MAX_GPUS);
        l.gpus[..n]
            .iter()
            .map(|s| {
                map.iter()
                    .find(|p| p.0 == s.uuid)
                    .map(|p| p.1)
                    .unwrap_or(s.uuid)
            })
            .filter_map(|u| self.gpu_index(&u))
            .collect()
    }

    /// After a custom-storage checkpoint step: the target's memory, handed over, becomes one
    /// contiguous range per GPU in the caller (allocations in address order).
    fn custom_checkpoint(&self, caller: u64, pid: i32, mb: &Mailbox) -> CkptResult<Reply> {
        let moved = lock(&self.handover).remove(&pid).ok_or((
            cu::OPERATING_SYSTEM,
            format!("process {pid} handed over no memory"),
        ))?;
        let mut order = self.slot_order(mb, &[]);
        for (_, a) in &moved {
            if !order.contains(&a.gpu) {
                order.push(a.gpu);
            }
        }
        let mut held = Vec::new();
        let mut ranges = Vec::new();
        let mut ptrs = Vec::new();
        let mut failed = None;
        for gi in order {
            let mut mine: Vec<&(u64, Arc<Alloc>)> =
                moved.iter().filter(|(_, a)| a.gpu == gi).collect();
            if mine.is_empty() {
                continue;
            }
            mine.sort_by_key(|(p, _)| *p);
            let total: u64 = mine.iter().map(|(_, a)| a.size).sum();
            let granules: u64 = mine.iter().map(|(_, a)| align_up(a.size)).sum();
            held.push((gi, granules));
            if failed.is_some() {
                continue;
            }
            let data = match mine[..] {
                // One allocation becomes the range as it is: no copy.
                [(_, a)] => std::mem::take(&mut *lock(&a.data)),
                _ => {
                    let mut data = crate::zeroed_buffer(total as usize);
                    let mut off = 0;
                    for (_, a) in mine {
                        let bytes = std::mem::take(&mut *lock(&a.data));
                        data[off..off + bytes.len()].copy_from_slice(&bytes);
                        off += bytes.len();
                    }
                    data
                }
            };
            match self.map_range(caller, gi, data) {
                Ok(ptr) => {
                    ptrs.push(ptr);
                    ranges.push(MappedRange {
                        gpu: self.node.gpus[gi].uuid,
                        ptr,
                        size: total,
                    });
                }
                Err(e) => failed = Some(e),
            }
        }
        if let Some(e) = failed {
            lock(&self.reg).release(held);
            return Err(e);
        }
        let op = Op {
            caller,
            pid,
            ranges: ptrs,
            kind: OpKind::Checkpoint { held },
        };
        Ok(self.start_op(op, ranges))
    }

    /// After a custom-storage restore step: the target's restored (empty) allocations appear in
    /// the caller as one contiguous range per GPU, in the same order as at the checkpoint.
    fn custom_restore(
        &self,
        caller: u64,
        pid: i32,
        target_conn: u64,
        mb: &Mailbox,
        map: &[Pair],
    ) -> CkptResult<Reply> {
        let order = self.slot_order(mb, map);
        let per_gpu: Vec<(usize, Vec<(u64, u64)>)> = {
            let reg = lock(&self.reg);
            let conn = reg
                .conns
                .get(&target_conn)
                .ok_or((cu::OPERATING_SYSTEM, format!("process {pid} is gone")))?;
            order
                .iter()
                .map(|&gi| {
                    let parts = conn
                        .allocs
                        .iter()
                        .filter(|(_, a)| a.gpu == gi && !a.mapped)
                        .map(|(p, a)| (*p, a.size))
                        .collect();
                    (gi, parts)
                })
                .collect()
        };
        let mut layout = Vec::new();
        let mut ranges = Vec::new();
        for (gi, parts) in per_gpu {
            if parts.is_empty() {
                continue;
            }
            let total: u64 = parts.iter().map(|p| p.1).sum();
            let data = match parts[..] {
                // The one allocation's own bytes are the range until the operation completes
                // (the process, RESTORING, makes no call meanwhile): no copy at completion.
                [(ptr, _)] => self
                    .conn_alloc(target_conn, ptr)
                    .map(|a| std::mem::take(&mut *lock(&a.data)))
                    .unwrap_or_else(|| crate::zeroed_buffer(total as usize)),
                _ => crate::zeroed_buffer(total as usize),
            };
            let ptr = self.map_range(caller, gi, data)?;
            ranges.push(MappedRange {
                gpu: self.node.gpus[gi].uuid,
                ptr,
                size: total,
            });
            layout.push((ptr, parts));
        }
        let op = Op {
            caller,
            pid,
            ranges: layout.iter().map(|l| l.0).collect(),
            kind: OpKind::Restore {
                target_conn,
                layout,
            },
        };
        Ok(self.start_op(op, ranges))
    }

    /// Records the custom-storage operation `op` under a new handle: the reply that gives the
    /// caller the handle and its `ranges`.
    fn start_op(&self, op: Op, ranges: Vec<MappedRange>) -> Reply {
        let handle = self.next_op.fetch_add(1, Ordering::Relaxed);
        lock(&self.ops).insert(handle, op);
        Reply::Custom { handle, ranges }
    }

    /// `cuCheckpointOperationComplete`: releases the ranges (a restore's bytes go to the target's
    /// allocations first), then moves the target on: CHECKPOINTING → CHECKPOINTED, RESTORING →
    /// LOCKED.
    fn complete(&self, caller: u64, handle: u64) -> CkptResult<()> {
        if self.node.cuda_version < crate::CUSTOM_STORAGE_SINCE {
            return Err((
                cu::NOT_SUPPORTED,
                format!("CUDA {} has no custom storage", self.node.cuda_version),
            ));
        }
        let op = {
            let mut ops = lock(&self.ops);
            match ops.get(&handle) {
                Some(o) if o.caller == caller => ops.remove(&handle),
                _ => None,
            }
        }
        .ok_or((
            cu::INVALID_HANDLE,
            format!("no custom-storage operation {handle} of this process"),
        ))?;
        let pid = op.pid;
        let pid_lock = Arc::clone(lock(&self.pid_locks).entry(pid).or_default());
        let _serial = lock(&pid_lock);
        let ranges: HashMap<u64, Arc<Alloc>> = {
            let mut reg = lock(&self.reg);
            match reg.conns.get_mut(&caller) {
                Some(c) => op
                    .ranges
                    .iter()
                    .filter_map(|p| c.allocs.remove(p).map(|a| (*p, a)))
                    .collect(),
                None => HashMap::new(),
            }
        };
        match op.kind {
            OpKind::Checkpoint { held } => lock(&self.reg).release(held),
            OpKind::Restore {
                target_conn,
                layout,
            } => {
                let targets: HashMap<u64, Arc<Alloc>> = {
                    let reg = lock(&self.reg);
                    let conn = reg
                        .conns
                        .get(&target_conn)
                        .ok_or((cu::OPERATING_SYSTEM, format!("process {pid} is gone")))?;
                    conn.allocs
                        .iter()
                        .map(|(p, a)| (*p, Arc::clone(a)))
                        .collect()
                };
                for (range_ptr, parts) in layout {
                    let Some(range) = ranges.get(&range_ptr) else {
                        continue;
                    };
                    if lend_back(range, &parts, |p| targets.get(&p)) {
                        continue;
                    }
                    let src = lock(&range.data);
                    let mut off = 0usize;
                    for (ptr, size) in parts {
                        let n = size as usize;
                        if let (Some(a), Some(bytes)) = (targets.get(&ptr), src.get(off..off + n)) {
                            let mut dst = lock(&a.data);
                            if let Some(d) = dst.get_mut(..n) {
                                d.copy_from_slice(bytes);
                            }
                        }
                        off += n;
                    }
                }
            }
        }
        drop(ranges);
        let mb = cuda_mailbox(pid)?;
        match mb.call(
            mailbox::cmd::COMPLETE,
            0,
            0,
            Some(Instant::now() + STEP_LIMIT),
        ) {
            Some(cu::SUCCESS) => Ok(()),
            Some(code) => Err((code, format!("process {pid} refused to complete"))),
            None => Err((cu::TIMEOUT, format!("process {pid} did not answer"))),
        }
    }

    /// The GPU map of a restore, checked as the driver checks it: every checkpointed GPU listed
    /// (when pairs are given), each target present on this node, of the same chip, with the
    /// memory the process needs. The first list pairs the checkpointed GPUs; the second holds
    /// the caller's pairs for the other GPUs (those the process held nothing on), each target
    /// present and no target named twice, so that the process's other device ordinals follow
    /// them too.
    fn restore_map(
        &self,
        mb: &Mailbox,
        pairs: &[Pair],
    ) -> Result<(Vec<Pair>, Vec<Pair>), (u32, String)> {
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
        let mut others = Vec::new();
        for &(old, new) in pairs {
            if map.iter().chain(&others).any(|p: &Pair| p.0 == old) {
                continue;
            }
            if !targets.insert(new) {
                return Err((
                    cu::INVALID_VALUE,
                    format!("GPU {} is named twice as a target", format_uuid(&new)),
                ));
            }
            if self.gpu_index(&new).is_none() {
                return Err((
                    cu::INVALID_DEVICE,
                    format!("GPU {} is not on this node", format_uuid(&new)),
                ));
            }
            others.push((old, new));
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
        Ok((map, others))
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
            conn.allocs.insert(ptr, Alloc::zeroed(i, size));
            conn.contexts.insert(i);
            conn.next_va = conn.next_va.max(align_up(ptr + size));
        }
        drop(reg);
        lock(&self.restored_conn).insert(pid, id);
        Reply::RestoreMap(map)
    }
}

/// Requires bytes `range` of a 64-byte argument struct (padding) to be zero.
fn check_zero(args: &[u8], range: std::ops::Range<usize>) -> CkptResult<()> {
    match args.get(range.clone()) {
        Some(b) => match b.iter().position(|x| *x != 0) {
            Some(i) => Err((
                cu::INVALID_VALUE,
                format!(
                    "padding byte {} of the argument struct is not zero",
                    range.start + i
                ),
            )),
            None => Ok(()),
        },
        None => Err((
            cu::INVALID_VALUE,
            format!("argument struct of {} bytes, not 64", args.len()),
        )),
    }
}

/// Requires the reserved bytes of a 64-byte argument struct, from `from` on, to be zero.
/// The mailbox of process `pid`, which must have CUDA state.
fn cuda_mailbox(pid: i32) -> CkptResult<Mailbox> {
    Mailbox::open_pid(pid)
        .map_err(|e| (cu::INVALID_VALUE, format!("process {pid}: {e}")))?
        .ok_or((
            cu::NOT_INITIALIZED,
            format!("process {pid} has no CUDA state"),
        ))
}

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

/// Lays out a node directory: the driver's two libraries and NCCL (from `lib_src`, the build's
/// or the install's directory) in DIR/lib, the device nodes in DIR/dev, and the CDI spec in `cdi_dir`.
pub fn prepare_dir(
    dir: &Path,
    lib_src: &Path,
    node: &NodeDesc,
    cdi_dir: Option<&Path>,
) -> io::Result<()> {
    crate::node::lay_out_libraries(&dir.join("lib"), lib_src, &node.driver_version)?;
    let dev = dir.join(crate::proto::DEV_DIR_NAME);
    std::fs::create_dir_all(&dev)?;
    let names = node.gpus.iter().map(|g| format!("nvidia{}", g.index));
    for name in names.chain(crate::proto::COMMON_NODES.iter().map(|n| n.to_string())) {
        make_node(&dev.join(name))?;
    }
    make_mig_nodes(&dev, node)?;
    if let Some(cdi) = cdi_dir {
        std::fs::create_dir_all(cdi)?;
        let spec = crate::cdi::spec(dir, node, &std::env::current_exe()?);
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

/// The capability nodes of the MIG-mode GPUs' instances (`nvidia-caps/nvidia-cap<minor>`).
fn make_mig_nodes(dev: &Path, node: &NodeDesc) -> io::Result<()> {
    for g in node.gpus.iter().filter(|g| g.mig) {
        let caps = dev.join(crate::cdi::MIG_CAPS_DIR);
        std::fs::create_dir_all(&caps)?;
        for m in crate::cdi::mig_cap_minors(g.index) {
            make_node(&caps.join(format!("nvidia-cap{m}")))?;
        }
    }
    Ok(())
}

/// The character device behind every simulated node: `/dev/zero`'s (1:5), which opens without
/// NVIDIA's kernel module (a real GPU's node is 195:N).
const NODE_DEV: (u32, u32) = (1, 5);

/// A character device node at `path` (replacing what is there). Without the right to make one
/// (not root), a symlink to `/dev/zero`: enough for processes on the host, not for a CDI spec,
/// which needs a device node (and a container runtime, which needs root anyway).
fn make_node(path: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(_) => std::fs::remove_file(path)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let dev = libc::makedev(NODE_DEV.0, NODE_DEV.1);
    // SAFETY: c is a NUL-terminated path; mknod reads it only.
    if unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, dev) } == 0 {
        // The umask narrowed the mode; a device node of the GPUs is 0666, as NVIDIA's are.
        return std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666));
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EPERM) {
        return Err(io::Error::new(
            err.kind(),
            format!("mknod {}: {err}", path.display()),
        ));
    }
    std::os::unix::fs::symlink("/dev/zero", path)
}

/// Whether the peer of connection `fd` has closed it (waits up to `wait` for it to).
fn peer_closed(fd: RawFd, wait: Duration) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one live pollfd; `fd` stays open for the call (the connection's thread owns it).
    let n = unsafe { libc::poll(&mut p, 1, wait.as_millis() as libc::c_int) };
    n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}
