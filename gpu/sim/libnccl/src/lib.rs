//! The simulated `libnccl.so.2`: NCCL's API under its exported names and C ABI (nccl.h 2.32.6),
//! on the simulated driver.
//!
//! Ranks are processes (or devices of one process, `ncclCommInitAll`) that meet in
//! `gpu-ckpt-simgpu` by unique id; the daemon moves and reduces the bytes between their device
//! memory. Collectives and sends/receives are enqueued on the caller's stream and return; the
//! stream completes when every rank has contributed and the results are written (`group`).
//! What is not simulated answers ncclInvalidUsage (docs/gpu-sim-api.md lists both).
#![allow(clippy::missing_safety_doc)] // C entry points; their contracts are NVIDIA's documentation.

mod comm;
mod cuda;
mod group;

use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::sync::{Mutex, OnceLock};

use simgpu::nccl::{
    error_string, result, version_code, Config, DataType, Kind, Op, RedOp, UniqueId, API_MAGIC,
    CONFIG_UNDEF_INT, SPLIT_NOCOLOR, UNIQUE_ID_BYTES, VERSION,
};

use comm::Comm;

type NcclResult = c_uint;
type NcclComm = *mut c_void;

/// A failed call: its `ncclResult_t` and the message `ncclGetLastError` gives.
#[derive(Debug, Clone)]
pub struct Fail {
    pub code: u32,
    pub msg: String,
}

pub type R<T> = Result<T, Fail>;

pub fn fail(code: u32, msg: impl Into<String>) -> Fail {
    Fail {
        code,
        msg: msg.into(),
    }
}

/// The message of the last failure, NUL-terminated, in one static buffer (as NCCL's): the
/// pointer `ncclGetLastError` gives stays valid, its text changes at the next failure.
static LAST_ERROR: Mutex<[u8; 1024]> = Mutex::new([0; 1024]);

/// Prints a warning where `NCCL_DEBUG` asks for them, as NCCL does.
pub fn warn(msg: &str) {
    static ON: OnceLock<bool> = OnceLock::new();
    let on = *ON.get_or_init(|| {
        std::env::var("NCCL_DEBUG").is_ok_and(|v| {
            matches!(
                v.to_ascii_uppercase().as_str(),
                "WARN" | "INFO" | "TRACE" | "ABORT"
            )
        })
    });
    if on {
        eprintln!("{}:{}:0 NCCL WARN {msg}", hostname(), std::process::id());
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

fn record(f: &Fail) {
    warn(&f.msg);
    let mut buf = LAST_ERROR.lock().unwrap_or_else(|p| p.into_inner());
    let msg = f.msg.as_bytes();
    let n = msg.len().min(buf.len() - 1);
    buf[..n].copy_from_slice(&msg[..n]);
    buf[n] = 0;
}

/// Defines `extern "C"` entry points returning ncclResult_t; a panic is ncclInternalError.
macro_rules! entry {
    ($( fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) $body:block )*) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> NcclResult {
            let run = std::panic::AssertUnwindSafe(|| -> R<()> { $body });
            match std::panic::catch_unwind(run) {
                Ok(Ok(())) => result::SUCCESS,
                Ok(Err(mut f)) => {
                    // NCCL's warnings name the call without its prefix: "CommCount : ...".
                    if !f.msg.starts_with("nccl") {
                        let call = stringify!($name);
                        f.msg = format!("{} : {}", call.strip_prefix("nccl").unwrap_or(call), f.msg);
                    }
                    record(&f);
                    f.code
                }
                Err(_) => result::INTERNAL_ERROR,
            }
        }
    )*};
}

/// Writes through an out-pointer; NULL is ncclInvalidArgument.
fn out<T>(p: *mut T, v: T, what: &str) -> R<()> {
    if p.is_null() {
        return Err(fail(
            result::INVALID_ARGUMENT,
            format!("{what} argument is NULL"),
        ));
    }
    // SAFETY: the caller passed a pointer to a T, as the API requires.
    unsafe { p.write(v) };
    Ok(())
}

fn invalid(msg: impl Into<String>) -> Fail {
    fail(result::INVALID_ARGUMENT, msg)
}

fn not_simulated(call: &str) -> R<()> {
    Err(fail(
        result::INVALID_USAGE,
        format!("{call} is not simulated"),
    ))
}

/// Whether a config asks for a non-blocking communicator. Its magic must be NCCL's (set by
/// `NCCL_CONFIG_INITIALIZER`); a field past the caller's `size` is unset.
fn blocking(config: *const Config) -> R<bool> {
    if config.is_null() {
        return Ok(true);
    }
    // SAFETY: the caller's config; the first three fields exist in every version.
    let (size, magic) = unsafe { ((*config).size, (*config).magic) };
    if magic != API_MAGIC {
        return Err(invalid(
            "ncclConfig_t argument not initialized via NCCL_CONFIG_INITIALIZER",
        ));
    }
    if size < std::mem::offset_of!(Config, blocking) + 4 {
        return Ok(true);
    }
    // SAFETY: the caller's struct has the field (its size says so).
    let b = unsafe { (*config).blocking };
    Ok(b == CONFIG_UNDEF_INT || b != 0)
}

/// Makes a communicator on the current device as rank `rank` of `nranks` of unique id `id`.
fn init_rank(
    newcomm: *mut NcclComm,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
    config: *const Config,
) -> R<()> {
    if newcomm.is_null() {
        return Err(invalid("newcomm argument is NULL"));
    }
    if nranks < 1 || rank < 0 || rank >= nranks {
        return Err(invalid(format!("rank {rank} / nranks {nranks} is invalid")));
    }
    let blocking = blocking(config)?;
    let dev = cuda::cuda()?.current_device()?;
    let c = Comm::new(dev, rank, nranks);
    let bytes: Vec<u8> = id.internal.iter().map(|b| *b as u8).collect();
    let made = {
        let c = std::sync::Arc::clone(&c);
        move || {
            let r = comm::join(&bytes, nranks, rank, dev);
            c.made(&r);
            r.map(|_| ())
        }
    };
    if group::inside() {
        c.state().deferred = true;
        group::create(Box::new(made))?;
    } else if !blocking {
        // Non-blocking: the join goes on in the background; ncclCommGetAsyncError says when
        // it is done.
        std::thread::spawn(made);
        out(newcomm, comm::publish(&c), "newcomm")?;
        return Err(fail(
            result::IN_PROGRESS,
            "communicator initialization in progress",
        ));
    } else {
        made()?;
    }
    out(newcomm, comm::publish(&c), "newcomm")
}

/// An operation's common checks: the communicator, the data type and the operator.
#[allow(clippy::too_many_arguments)] // nccl.h's arguments of a collective
fn enqueue(
    kind: Kind,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    peer: c_int,
    h: NcclComm,
    stream: *mut c_void,
) -> R<()> {
    let c = comm::get(h)?;
    let name = kind.name();
    let dtype = DataType::from_raw(dtype)
        .ok_or_else(|| invalid(format!("{name}: invalid type {dtype}")))?;
    let op = if kind.reduces() {
        let o = RedOp::from_raw(op)
            .ok_or_else(|| invalid(format!("{name}: invalid reduction operation {op}")))?;
        if !dtype.reducible() {
            return Err(invalid(format!(
                "{name}: reductions of {dtype:?} are not simulated"
            )));
        }
        o
    } else {
        RedOp::Sum
    };
    let (rank, nranks, deferred) = {
        let st = c.state();
        (st.rank, st.nranks, st.deferred)
    };
    if !deferred {
        c.ready()?;
    }
    if (kind.rooted() || kind.is_p2p()) && (peer < 0 || peer >= nranks) {
        let what = if kind.is_p2p() { "peer" } else { "root" };
        return Err(invalid(format!("{name}: {what} {peer} of {nranks} ranks")));
    }
    let size = dtype.size() as u64;
    let (in_len, out_len) = kind.extents(count as u64, size, nranks as u64, rank, peer);
    if in_len > 0 && send.is_null() {
        return Err(invalid(format!("{name}: sendbuff is NULL")));
    }
    if out_len > 0 && recv.is_null() {
        return Err(invalid(format!("{name}: recvbuff is NULL")));
    }
    group::submit(group::Pending {
        comm: c,
        stream: stream as usize,
        op: Op {
            comm: 0,
            rank,
            seq: 0,
            kind,
            send: send as u64,
            recv: recv as u64,
            count: count as u64,
            dtype,
            op,
            peer,
        },
    })
}

/// Takes communicator `h` out of use and its rank out of the daemon's communicator: after its
/// operations completed (destroy, which finalizes first where the caller did not), or failing
/// every pending operation of the communicator on every rank, whose streams then complete
/// (abort).
fn end_comm(h: NcclComm, abort: bool) -> R<()> {
    let c = comm::get(h)?;
    if !abort {
        c.flush();
    }
    comm::unpublish(h);
    let (id, rank) = {
        let st = c.state();
        (st.daemon, st.rank)
    };
    if let Some(comm) = id {
        if abort {
            comm::daemon(simgpu::nccl::Call::Abort { comm, rank })?;
        }
        comm::daemon(simgpu::nccl::Call::Leave { comm, rank })?;
    }
    Ok(())
}

fn cstr_static(s: &'static str) -> *const c_char {
    static CACHE: OnceLock<Mutex<std::collections::HashMap<&'static str, usize>>> = OnceLock::new();
    let mut m = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let p = m.entry(s).or_insert_with(|| {
        Box::leak(CString::new(s).unwrap_or_default().into_boxed_c_str()).as_ptr() as usize
    });
    *p as *const c_char
}

/// `ncclGetErrorString`.
#[no_mangle]
pub extern "C" fn ncclGetErrorString(code: NcclResult) -> *const c_char {
    cstr_static(error_string(code))
}

/// `ncclGetLastError`: the message of the last failed call ("" before any).
#[no_mangle]
pub extern "C" fn ncclGetLastError(_comm: NcclComm) -> *const c_char {
    LAST_ERROR
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ptr() as *const c_char
}

/// `ncclGetVersion`; NULL is ncclInvalidArgument and, as with NVIDIA's, no last error.
#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> NcclResult {
    if version.is_null() {
        return result::INVALID_ARGUMENT;
    }
    // SAFETY: the caller's int.
    unsafe { version.write(version_code(VERSION.0, VERSION.1, VERSION.2)) };
    result::SUCCESS
}

entry! {
    fn ncclGetUniqueId(unique_id: *mut UniqueId) {
        if unique_id.is_null() {
            return Err(invalid("uniqueId argument is NULL"));
        }
        let bytes = match comm::daemon(simgpu::nccl::Call::UniqueId)? {
            simgpu::nccl::Answer::UniqueId(b) if b.len() == UNIQUE_ID_BYTES => b,
            a => return Err(fail(result::INTERNAL_ERROR, format!("unexpected answer {a:?}"))),
        };
        let mut id = UniqueId { internal: [0; UNIQUE_ID_BYTES] };
        for (d, s) in id.internal.iter_mut().zip(bytes) {
            *d = s as c_char;
        }
        out(unique_id, id, "uniqueId")
    }

    fn ncclCommInitRank(newcomm: *mut NcclComm, nranks: c_int, id: UniqueId, rank: c_int) {
        init_rank(newcomm, nranks, id, rank, std::ptr::null())
    }

    fn ncclCommInitRankConfig(
        newcomm: *mut NcclComm, nranks: c_int, id: UniqueId, rank: c_int, config: *const Config,
    ) {
        init_rank(newcomm, nranks, id, rank, config)
    }

    fn ncclCommInitRankScalable(
        newcomm: *mut NcclComm, nranks: c_int, rank: c_int, n_id: c_int, ids: *const UniqueId,
        config: *const Config,
    ) {
        if n_id < 1 || ids.is_null() {
            return Err(invalid("nId must be at least 1 with commIds"));
        }
        // SAFETY: the caller passed nId >= 1 ids; every rank passes the same list.
        let id = unsafe { *ids };
        init_rank(newcomm, nranks, id, rank, config)
    }

    fn ncclCommInitAll(comms: *mut NcclComm, ndev: c_int, devlist: *const c_int) {
        if comms.is_null() {
            return Err(invalid("comms argument is NULL"));
        }
        if ndev < 1 {
            return Err(invalid(format!("ndev {ndev} is invalid")));
        }
        let cuda = cuda::cuda()?;
        let count = cuda.device_count()?;
        let devs: Vec<c_int> = (0..ndev)
            .map(|i| if devlist.is_null() { i } else {
                // SAFETY: the caller's devlist has ndev entries.
                unsafe { *devlist.add(i as usize) }
            })
            .collect();
        for (i, d) in devs.iter().enumerate() {
            if *d < 0 || *d >= count {
                return Err(invalid(format!("device {d} is not one of the {count} devices")));
            }
            if devs[..i].contains(d) {
                return Err(fail(result::INVALID_USAGE, format!("device {d} is listed twice")));
            }
        }
        let mut id = UniqueId { internal: [0; UNIQUE_ID_BYTES] };
        let rc = ncclGetUniqueId(&mut id);
        if rc != result::SUCCESS {
            return Err(fail(rc, "ncclGetUniqueId failed"));
        }
        let bytes: Vec<u8> = id.internal.iter().map(|b| *b as u8).collect();
        let made: Vec<_> = devs
            .iter()
            .enumerate()
            .map(|(rank, &dev)| {
                let c = Comm::new(dev, rank as i32, ndev);
                let bytes = bytes.clone();
                let c2 = std::sync::Arc::clone(&c);
                let t = std::thread::spawn(move || {
                    let r = cuda::cuda()
                        .and_then(|cu| cu.make_current(dev))
                        .and_then(|_| comm::join(&bytes, ndev, rank as i32, dev));
                    c2.made(&r);
                    r.map(|_| ())
                });
                (c, t)
            })
            .collect();
        let mut first = Ok(());
        let mut handles = Vec::new();
        for (c, t) in made {
            let r = t.join().unwrap_or_else(|_| Err(fail(result::INTERNAL_ERROR, "init panicked")));
            if first.is_ok() {
                first = r;
            }
            handles.push(c);
        }
        first?;
        for (i, c) in handles.iter().enumerate() {
            // SAFETY: the caller's comms has ndev entries.
            unsafe { *comms.add(i) = comm::publish(c) };
        }
        Ok(())
    }

    fn ncclCommSplit(h: NcclComm, color: c_int, key: c_int, newcomm: *mut NcclComm, config: *const Config) {
        let parent = comm::get(h)?;
        if newcomm.is_null() {
            return Err(invalid("newcomm argument is NULL"));
        }
        if color < 0 && color != SPLIT_NOCOLOR {
            return Err(invalid(format!("color {color} is invalid")));
        }
        // A split is made before the call returns, blocking or not.
        blocking(config)?;
        let (rank, seq) = {
            let mut st = parent.state();
            let seq = st.split_seq;
            st.split_seq += 1;
            (st.rank, seq)
        };
        let child = (color != SPLIT_NOCOLOR).then(|| Comm::new(parent.dev, 0, 0));
        let made = {
            let parent = std::sync::Arc::clone(&parent);
            let child = child.clone();
            move || {
                let r = parent.ready().and_then(|p| comm::split(p, rank, seq, color, key));
                match (&child, r) {
                    (Some(c), Ok(Some(n))) => {
                        c.made(&Ok(n));
                        Ok(())
                    }
                    (Some(c), Ok(None)) => {
                        let e = fail(result::INTERNAL_ERROR, "the split gave this rank no communicator");
                        c.made(&Err(e.clone()));
                        Err(e)
                    }
                    (Some(c), Err(e)) => {
                        c.made(&Err(e.clone()));
                        Err(e)
                    }
                    (None, r) => r.map(|_| ()),
                }
            }
        };
        if let Some(c) = &child {
            c.state().deferred = group::inside();
        }
        group::create(Box::new(made))?;
        let h = child.as_ref().map_or(std::ptr::null_mut(), comm::publish);
        out(newcomm, h, "newcomm")
    }

    fn ncclCommFinalize(h: NcclComm) {
        let c = comm::get(h)?;
        c.flush();
        c.state().finalized = true;
        Ok(())
    }

    fn ncclCommDestroy(h: NcclComm) {
        end_comm(h, false)
    }

    fn ncclCommAbort(h: NcclComm) {
        if h.is_null() {
            return Ok(());
        }
        end_comm(h, true)
    }

    // A communicator's facts.
    fn ncclCommCount(h: NcclComm, count: *mut c_int) { out(count, comm::get(h)?.state().nranks, "count") }
    fn ncclCommCuDevice(h: NcclComm, device: *mut c_int) { out(device, comm::get(h)?.dev, "device") }
    fn ncclCommUserRank(h: NcclComm, rank: *mut c_int) { out(rank, comm::get(h)?.state().rank, "rank") }
    fn ncclCommGetAsyncError(h: NcclComm, e: *mut NcclResult) { out(e, comm::get(h)?.state().async_error, "asyncError") }

    fn ncclCommRegister(h: NcclComm, buff: *mut c_void, size: usize, handle: *mut *mut c_void) {
        let c = comm::get(h)?;
        if buff.is_null() || size == 0 {
            return Err(invalid("ncclCommRegister: buff is NULL or size is 0"));
        }
        let reg = Box::into_raw(Box::new((buff as usize, size))) as usize;
        c.state().registered.insert(reg, (buff as usize, size));
        out(handle, reg as *mut c_void, "handle")
    }

    fn ncclCommDeregister(h: NcclComm, handle: *mut c_void) {
        let c = comm::get(h)?;
        if c.state().registered.remove(&(handle as usize)).is_none() {
            return Err(invalid("ncclCommDeregister: not a registration of this communicator"));
        }
        // SAFETY: the box ncclCommRegister made for this handle, freed once.
        drop(unsafe { Box::from_raw(handle as *mut (usize, usize)) });
        Ok(())
    }

    fn ncclCommSuspend(h: NcclComm, flags: c_int) {
        let c = comm::get(h)?;
        if flags & !1 != 0 {
            return Err(invalid(format!("ncclCommSuspend: unknown flags {flags:#x}")));
        }
        let mut st = c.state();
        if st.pending > 0 {
            return Err(fail(result::INVALID_USAGE, "ncclCommSuspend: operations are in flight"));
        }
        st.suspended = true;
        Ok(())
    }

    fn ncclCommResume(h: NcclComm) {
        let c = comm::get(h)?;
        let mut st = c.state();
        if !st.suspended {
            return Err(fail(result::INVALID_USAGE, "ncclCommResume: the communicator is not suspended"));
        }
        st.suspended = false;
        Ok(())
    }

    fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) {
        if size == 0 {
            return Err(invalid("ncclMemAlloc: size is 0"));
        }
        let p = cuda::cuda()?.mem_alloc(size)?;
        out(ptr, p as *mut c_void, "ptr")
    }

    fn ncclMemFree(ptr: *mut c_void) {
        if ptr.is_null() {
            return Ok(());
        }
        cuda::cuda()?.mem_free(ptr as u64)
    }

    fn ncclGroupStart() {
        group::start();
        Ok(())
    }

    fn ncclGroupEnd() {
        group::end()
    }

    // The collectives and sends/receives: nccl.h's arguments, one enqueue.
    fn ncclAllReduce(send: *const c_void, recv: *mut c_void, count: usize, dtype: c_int, op: c_int, h: NcclComm, stream: *mut c_void) { enqueue(Kind::AllReduce, send, recv, count, dtype, op, 0, h, stream) }
    fn ncclBroadcast(send: *const c_void, recv: *mut c_void, count: usize, dtype: c_int, root: c_int, h: NcclComm, stream: *mut c_void) { enqueue(Kind::Broadcast, send, recv, count, dtype, 0, root, h, stream) }
    fn ncclBcast(buff: *mut c_void, count: usize, dtype: c_int, root: c_int, h: NcclComm, stream: *mut c_void) { enqueue(Kind::Broadcast, buff, buff, count, dtype, 0, root, h, stream) }
    fn ncclReduce(send: *const c_void, recv: *mut c_void, count: usize, dtype: c_int, op: c_int, root: c_int, h: NcclComm, stream: *mut c_void) { enqueue(Kind::Reduce, send, recv, count, dtype, op, root, h, stream) }
    fn ncclAllGather(send: *const c_void, recv: *mut c_void, sendcount: usize, dtype: c_int, h: NcclComm, stream: *mut c_void) { enqueue(Kind::AllGather, send, recv, sendcount, dtype, 0, 0, h, stream) }
    fn ncclReduceScatter(send: *const c_void, recv: *mut c_void, recvcount: usize, dtype: c_int, op: c_int, h: NcclComm, stream: *mut c_void) { enqueue(Kind::ReduceScatter, send, recv, recvcount, dtype, op, 0, h, stream) }
    fn ncclAlltoAll(send: *const c_void, recv: *mut c_void, count: usize, dtype: c_int, h: NcclComm, stream: *mut c_void) { enqueue(Kind::AlltoAll, send, recv, count, dtype, 0, 0, h, stream) }
    fn ncclGather(send: *const c_void, recv: *mut c_void, count: usize, dtype: c_int, root: c_int, h: NcclComm, stream: *mut c_void) { enqueue(Kind::Gather, send, recv, count, dtype, 0, root, h, stream) }
    fn ncclScatter(send: *const c_void, recv: *mut c_void, count: usize, dtype: c_int, root: c_int, h: NcclComm, stream: *mut c_void) { enqueue(Kind::Scatter, send, recv, count, dtype, 0, root, h, stream) }
    fn ncclSend(send: *const c_void, count: usize, dtype: c_int, peer: c_int, h: NcclComm, stream: *mut c_void) { enqueue(Kind::Send, send, std::ptr::null_mut(), count, dtype, 0, peer, h, stream) }
    fn ncclRecv(recv: *mut c_void, count: usize, dtype: c_int, peer: c_int, h: NcclComm, stream: *mut c_void) { enqueue(Kind::Recv, std::ptr::null(), recv, count, dtype, 0, peer, h, stream) }

    // Not simulated: they answer ncclInvalidUsage (docs/gpu-sim-api.md).
    fn ncclCommShrink(_h: NcclComm, _ex: *mut c_int, _n: c_int, _new: *mut NcclComm, _c: *const Config, _f: c_int) { not_simulated("ncclCommShrink") }
    fn ncclCommGrow(_h: NcclComm, _n: c_int, _id: *const UniqueId, _r: c_int, _new: *mut NcclComm, _c: *const Config) { not_simulated("ncclCommGrow") }
    fn ncclCommRevoke(_h: NcclComm, _flags: c_int) { not_simulated("ncclCommRevoke") }
    fn ncclCommGetUniqueId(_h: NcclComm, _id: *mut UniqueId) { not_simulated("ncclCommGetUniqueId") }
    fn ncclRedOpCreatePreMulSum(_op: *mut c_int, _s: *mut c_void, _t: c_int, _r: c_int, _h: NcclComm) { not_simulated("ncclRedOpCreatePreMulSum") }
    fn ncclCommWindowRegister(_h: NcclComm, _b: *mut c_void, _s: usize, _w: *mut *mut c_void, _f: c_int) { not_simulated("ncclCommWindowRegister") }
    fn ncclCommWindowDeregister(_h: NcclComm, _w: *mut c_void) { not_simulated("ncclCommWindowDeregister") }
    fn ncclGroupSimulateEnd(_info: *mut c_void) { not_simulated("ncclGroupSimulateEnd") }

    fn ncclRedOpDestroy(op: c_int, _h: NcclComm) {
        Err(invalid(format!("ncclRedOpDestroy: {op} is not an operator made by ncclRedOpCreatePreMulSum")))
    }
}

const _: () = assert!(std::mem::size_of::<UniqueId>() == 128);
