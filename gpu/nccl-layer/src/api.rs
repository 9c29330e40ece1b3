//! The exported NCCL API: each function passes the gate, swaps the application's handle for
//! the current real communicator, and calls the next definition of the same name.

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

use crate::backend::Backend;
use crate::config::ConfigCopy;
use crate::control;
use crate::ffi::*;
use crate::layer::{Layer, NewComm, Origin};
use crate::next;
use crate::real::Real;

/// What a wrapped function returns when the next library lacks it.
const NO_NEXT: ncclResult_t = NCCL_INTERNAL_ERROR;

fn layer() -> &'static Layer<Real> {
    static LAYER: OnceLock<Layer<Real>> = OnceLock::new();
    LAYER.get_or_init(|| {
        let mut l = Layer::new(Real::default());
        l.destroy_at_release =
            std::env::var_os(crate::layer::ENV_RELEASE).is_some_and(|v| v == "destroy");
        l
    })
}

/// A wrapped function on one communicator: `$stream` names the stream argument whose work
/// the quiesce waits for (`-` for none).
macro_rules! on_comm {
    ($name:ident ( $($a:ident : $t:ty),* ) comm = $comm:ident, stream = $stream:tt) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name($($a: $t),*) -> ncclResult_t {
            let Some(f) = next!($name, unsafe extern "C" fn($($t),*) -> ncclResult_t) else {
                return NO_NEXT;
            };
            let l = layer();
            match l.handle($comm) {
                None => f($($a),*),
                Some(h) => {
                    let _t = l.enter(stringify!($name), Some(h), on_comm!(@stream $stream));
                    let $comm = h.real() as ncclComm_t;
                    f($($a),*)
                }
            }
        }
    };
    (@stream -) => { None };
    (@stream $s:ident) => { Some($s as usize) };
}

// nccl.h's argument types, short: the send and receive buffers, an element type and count,
// a reduction, a stream.
type Src = *const c_void;
type Dst = *mut c_void;
type Dt = ncclDataType_t;
type Op = ncclRedOp_t;
type Comm = ncclComm_t;
type Stream = cudaStream_t;

#[rustfmt::skip]
mod wrapped {
    use super::*;
    on_comm!(ncclAllReduce(s: Src, r: Dst, n: usize, t: Dt, op: Op, c: Comm, st: Stream) comm = c, stream = st);
    on_comm!(ncclBroadcast(s: Src, r: Dst, n: usize, t: Dt, root: c_int, c: Comm, st: Stream) comm = c, stream = st);
    on_comm!(ncclBcast(b: Dst, n: usize, t: Dt, root: c_int, c: Comm, st: Stream) comm = c, stream = st);
    on_comm!(ncclReduce(s: Src, r: Dst, n: usize, t: Dt, op: Op, root: c_int, c: Comm, st: Stream) comm = c, stream = st);
    on_comm!(ncclAllGather(s: Src, r: Dst, n: usize, t: Dt, c: Comm, st: Stream) comm = c, stream = st);
    on_comm!(ncclReduceScatter(s: Src, r: Dst, n: usize, t: Dt, op: Op, c: Comm, st: Stream) comm = c, stream = st);
    on_comm!(ncclSend(s: Src, n: usize, t: Dt, peer: c_int, c: Comm, st: Stream) comm = c, stream = st);
    on_comm!(ncclRecv(r: Dst, n: usize, t: Dt, peer: c_int, c: Comm, st: Stream) comm = c, stream = st);
    on_comm!(ncclCommCount(c: Comm, count: *mut c_int) comm = c, stream = -);
    on_comm!(ncclCommCuDevice(c: Comm, device: *mut c_int) comm = c, stream = -);
    on_comm!(ncclCommUserRank(c: Comm, rank: *mut c_int) comm = c, stream = -);
    on_comm!(ncclCommGetAsyncError(c: Comm, e: *mut ncclResult_t) comm = c, stream = -);
    on_comm!(ncclCommSuspend(c: Comm, flags: c_int) comm = c, stream = -);
    on_comm!(ncclCommResume(c: Comm) comm = c, stream = -);
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> ncclResult_t {
    next!(
        ncclGetVersion,
        unsafe extern "C" fn(*mut c_int) -> ncclResult_t
    )
    .map_or(NO_NEXT, |f| f(version))
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(uniqueId: *mut ncclUniqueId) -> ncclResult_t {
    let Some(f) = next!(
        ncclGetUniqueId,
        unsafe extern "C" fn(*mut ncclUniqueId) -> ncclResult_t
    ) else {
        return NO_NEXT;
    };
    let _t = layer().enter("ncclGetUniqueId", None, None);
    f(uniqueId)
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetErrorString(result: ncclResult_t) -> *const c_char {
    match next!(
        ncclGetErrorString,
        unsafe extern "C" fn(ncclResult_t) -> *const c_char
    ) {
        Some(f) => f(result),
        None => c"no NCCL library under the gpu-ckpt NCCL layer".as_ptr(),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetLastError(comm: ncclComm_t) -> *const c_char {
    let Some(f) = next!(
        ncclGetLastError,
        unsafe extern "C" fn(ncclComm_t) -> *const c_char
    ) else {
        return c"no NCCL library under the gpu-ckpt NCCL layer".as_ptr();
    };
    let l = layer();
    match l.handle(comm) {
        None => f(comm),
        Some(h) => {
            let _t = l.enter("ncclGetLastError", Some(h), None);
            f(h.real() as ncclComm_t)
        }
    }
}

/// A root communicator's arguments: nranks, unique id, rank, config.
#[derive(Clone, Copy)]
struct Root(c_int, ncclUniqueId, c_int, *mut ncclConfig_t);

/// ncclCommInitRank and ncclCommInitRankConfig: the call as the application made it, then its
/// record (key: BLAKE3 of the unique id).
unsafe fn init_root(
    call: &'static str,
    out: *mut ncclComm_t,
    a: Root,
    f: impl FnOnce(*mut ncclComm_t) -> ncclResult_t,
) -> ncclResult_t {
    if out.is_null() {
        return f(out);
    }
    let l = layer();
    let r = {
        let _t = l.enter(call, None, None);
        let r = f(out);
        let real = *out;
        if real.is_null() || (r != NCCL_SUCCESS && r != NCCL_IN_PROGRESS) {
            return r;
        }
        let dev = l
            .backend
            .current_device()
            .or_else(|| l.backend.cu_device(real as usize).ok())
            .unwrap_or(-1);
        *out = l.adopt(NewComm {
            key: blake3::hash(&a.1.bytes()).to_hex().to_string(),
            rank: a.2,
            nranks: a.0,
            dev,
            config: ConfigCopy::copy(a.3),
            origin: Origin::Root,
            real: real as usize,
            group: l.gate.group_tag(),
        });
        r
    };
    control::ensure(l);
    r
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut ncclComm_t,
    nranks: c_int,
    commId: ncclUniqueId,
    rank: c_int,
) -> ncclResult_t {
    let Some(f) = next!(ncclCommInitRank, InitRankFn) else {
        return NO_NEXT;
    };
    let a = Root(nranks, commId, rank, std::ptr::null_mut());
    init_root("ncclCommInitRank", comm, a, |out| {
        f(out, nranks, commId, rank)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut ncclComm_t,
    nranks: c_int,
    commId: ncclUniqueId,
    rank: c_int,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    let Some(f) = next!(ncclCommInitRankConfig, InitRankConfigFn) else {
        return NO_NEXT;
    };
    let a = Root(nranks, commId, rank, config);
    init_root("ncclCommInitRankConfig", comm, a, |out| {
        f(out, nranks, commId, rank, config)
    })
}

/// ncclCommInitAll: NCCL makes one communicator per device in one group; the layer records them
/// under one key of its own (no unique id is seen) and makes them again in one group.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitAll(
    comm: *mut ncclComm_t,
    ndev: c_int,
    devlist: *const c_int,
) -> ncclResult_t {
    type F = unsafe extern "C" fn(*mut ncclComm_t, c_int, *const c_int) -> ncclResult_t;
    let Some(f) = next!(ncclCommInitAll, F) else {
        return NO_NEXT;
    };
    if comm.is_null() || ndev <= 0 {
        return f(comm, ndev, devlist);
    }
    let l = layer();
    let r = {
        let _t = l.enter("ncclCommInitAll", None, None);
        let r = f(comm, ndev, devlist);
        if r != NCCL_SUCCESS {
            return r;
        }
        let mut h = blake3::Hasher::new();
        h.update(&libc::getpid().to_le_bytes());
        h.update(&(comm as usize).to_le_bytes());
        if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            h.update(&t.as_nanos().to_le_bytes());
        }
        let key = h.finalize().to_hex().to_string();
        let tag = Some(l.gate.new_tag());
        for i in 0..ndev as usize {
            let real = *comm.add(i);
            let dev = if devlist.is_null() {
                i as c_int
            } else {
                *devlist.add(i)
            };
            *comm.add(i) = l.adopt(NewComm {
                key: key.clone(),
                rank: i as c_int,
                nranks: ndev,
                dev,
                config: None,
                origin: Origin::Root,
                real: real as usize,
                group: tag,
            });
        }
        r
    };
    control::ensure(l);
    r
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommSplit(
    comm: ncclComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    let Some(f) = next!(ncclCommSplit, SplitFn) else {
        return NO_NEXT;
    };
    let l = layer();
    let Some(p) = l.handle(comm) else {
        return f(comm, color, key, newcomm, config);
    };
    if newcomm.is_null() {
        return f(p.real() as ncclComm_t, color, key, newcomm, config);
    }
    let _t = l.enter("ncclCommSplit", Some(p), None);
    let r = f(p.real() as ncclComm_t, color, key, newcomm, config);
    if r != NCCL_SUCCESS && r != NCCL_IN_PROGRESS {
        return r;
    }
    let real = *newcomm;
    let copy = ConfigCopy::copy(config);
    if real.is_null() {
        if color == NCCL_SPLIT_NOCOLOR {
            l.adopt_nocolor(p, key, copy);
        }
        return r;
    }
    let (rank, nranks) = l.backend.rank_count(real as usize).unwrap_or((-1, -1));
    *newcomm = l.adopt(NewComm {
        key: format!("{}/{color}", l.key_of(p.id).unwrap_or_default()),
        rank,
        nranks,
        dev: p.dev(),
        config: copy,
        origin: Origin::Split {
            parent: p.id,
            color,
            key,
        },
        real: real as usize,
        group: l.gate.group_tag(),
    });
    r
}

/// ncclCommFinalize, ncclCommDestroy, ncclCommAbort: the real call (none when the layer
/// already let the real communicator go), then the record ends; the handle is freed with
/// `free`.
unsafe fn end(
    call: &'static str,
    comm: ncclComm_t,
    free: bool,
    f: Option<unsafe extern "C" fn(ncclComm_t) -> ncclResult_t>,
) -> ncclResult_t {
    let Some(f) = f else {
        return NO_NEXT;
    };
    let l = layer();
    let Some(h) = l.handle(comm) else {
        return f(comm);
    };
    let r = {
        let _t = l.enter(call, Some(h), None);
        let real = h.real();
        let r = if real == 0 {
            NCCL_SUCCESS
        } else {
            f(real as ncclComm_t)
        };
        if r == NCCL_SUCCESS || r == NCCL_IN_PROGRESS {
            l.gone(h, free);
        }
        r
    };
    if free && (r == NCCL_SUCCESS || r == NCCL_IN_PROGRESS) {
        l.free_handle(comm);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommFinalize(comm: ncclComm_t) -> ncclResult_t {
    end(
        "ncclCommFinalize",
        comm,
        false,
        next!(ncclCommFinalize, CommFn),
    )
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommDestroy(comm: ncclComm_t) -> ncclResult_t {
    end(
        "ncclCommDestroy",
        comm,
        true,
        next!(ncclCommDestroy, CommFn),
    )
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommAbort(comm: ncclComm_t) -> ncclResult_t {
    end("ncclCommAbort", comm, true, next!(ncclCommAbort, CommFn))
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
) -> ncclResult_t {
    type F = unsafe extern "C" fn(ncclComm_t, *mut c_void, usize, *mut *mut c_void) -> ncclResult_t;
    let Some(f) = next!(ncclCommRegister, F) else {
        return NO_NEXT;
    };
    let l = layer();
    let Some(h) = l.handle(comm) else {
        return f(comm, buff, size, handle);
    };
    if handle.is_null() {
        return f(h.real() as ncclComm_t, buff, size, handle);
    }
    let _t = l.enter("ncclCommRegister", Some(h), None);
    let r = f(h.real() as ncclComm_t, buff, size, handle);
    if r == NCCL_SUCCESS {
        *handle = l.add_buffer(h, buff as usize, size, *handle as usize);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommDeregister(comm: ncclComm_t, handle: *mut c_void) -> ncclResult_t {
    type F = unsafe extern "C" fn(ncclComm_t, *mut c_void) -> ncclResult_t;
    let Some(f) = next!(ncclCommDeregister, F) else {
        return NO_NEXT;
    };
    let l = layer();
    let Some(h) = l.handle(comm) else {
        return f(comm, handle);
    };
    let _t = l.enter("ncclCommDeregister", Some(h), None);
    match l.buffer(handle) {
        None => f(h.real() as ncclComm_t, handle),
        Some(b) => {
            let r = f(h.real() as ncclComm_t, b.real() as *mut c_void);
            if r == NCCL_SUCCESS {
                l.remove_buffer(h, handle);
            }
            r
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn ncclGroupStart() -> ncclResult_t {
    let Some(f) = next!(ncclGroupStart, unsafe extern "C" fn() -> ncclResult_t) else {
        return NO_NEXT;
    };
    let l = layer();
    l.gate.group_start();
    let r = f();
    if r != NCCL_SUCCESS {
        l.gate.group_end();
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn ncclGroupEnd() -> ncclResult_t {
    let Some(f) = next!(ncclGroupEnd, unsafe extern "C" fn() -> ncclResult_t) else {
        return NO_NEXT;
    };
    let l = layer();
    let r = f();
    let tag = l.gate.group_tag();
    l.gate.group_end();
    if let (Some(tag), None) = (tag, l.gate.group_tag()) {
        l.settle(Some(tag));
    }
    r
}
