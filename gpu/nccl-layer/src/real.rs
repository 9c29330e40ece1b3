//! The real backend: the next NCCL (see [`crate::next`](mod@crate::next)) and the CUDA driver, both found at run
//! time (the layer links neither).

use std::collections::HashMap;
use std::ffi::{c_int, c_void, CStr};
use std::sync::{Mutex, OnceLock};

use crate::backend::{Backend, Cfg, Made, RealComm};
use crate::ffi::*;
use crate::next;

type CuResult = c_int;
const CUDA_SUCCESS: CuResult = 0;
const CUDA_ERROR_NOT_READY: CuResult = 600;

/// The CUDA driver's functions the layer uses, from `libcuda.so.1`.
struct Cuda {
    stream_query: PtrFn,
    ctx_get_device: IntOutFn,
    device_get: DeviceGetFn,
    primary_ctx_retain: RetainFn,
    ctx_set_current: PtrFn,
}

type PtrFn = unsafe extern "C" fn(*mut c_void) -> CuResult;
type IntOutFn = unsafe extern "C" fn(*mut c_int) -> CuResult;
type DeviceGetFn = unsafe extern "C" fn(*mut c_int, c_int) -> CuResult;
type RetainFn = unsafe extern "C" fn(*mut *mut c_void, c_int) -> CuResult;

fn cuda() -> Result<&'static Cuda, String> {
    static CUDA: OnceLock<Result<Cuda, String>> = OnceLock::new();
    CUDA.get_or_init(|| {
        let name = c"libcuda.so.1";
        // SAFETY: dlopen of the driver's soname (the application's copy when it has one).
        let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if h.is_null() {
            return Err("cannot load libcuda.so.1".to_string());
        }
        let sym = |s: &CStr| {
            // SAFETY: a handle dlopen returned.
            let p = unsafe { libc::dlsym(h, s.as_ptr()) };
            if p.is_null() {
                Err(format!("libcuda.so.1 has no {}", s.to_string_lossy()))
            } else {
                Ok(p as usize)
            }
        };
        // SAFETY: each symbol is the driver API function of that name, with cuda.h's signature.
        unsafe {
            Ok(Cuda {
                stream_query: std::mem::transmute::<usize, PtrFn>(sym(c"cuStreamQuery")?),
                ctx_get_device: std::mem::transmute::<usize, IntOutFn>(sym(c"cuCtxGetDevice")?),
                device_get: std::mem::transmute::<usize, DeviceGetFn>(sym(c"cuDeviceGet")?),
                primary_ctx_retain: std::mem::transmute::<usize, RetainFn>(sym(
                    c"cuDevicePrimaryCtxRetain",
                )?),
                ctx_set_current: std::mem::transmute::<usize, PtrFn>(sym(c"cuCtxSetCurrent")?),
            })
        }
    })
    .as_ref()
    .map_err(Clone::clone)
}

const NO_SYMBOL: ncclResult_t = NCCL_INTERNAL_ERROR;

type Suspend = unsafe extern "C" fn(ncclComm_t, c_int) -> ncclResult_t;
type Void = unsafe extern "C" fn() -> ncclResult_t;

/// The real NCCL and CUDA under the layer.
#[derive(Default)]
pub struct Real {
    /// Primary contexts retained by the layer, by device ordinal.
    ctxs: Mutex<HashMap<i32, usize>>,
}

impl Backend for Real {
    fn version(&self) -> Result<i32, ncclResult_t> {
        let f = next!(
            ncclGetVersion,
            unsafe extern "C" fn(*mut c_int) -> ncclResult_t
        )
        .ok_or(NO_SYMBOL)?;
        let mut v = 0;
        // SAFETY: NCCL's signature, a valid out pointer.
        match unsafe { f(&mut v) } {
            NCCL_SUCCESS => Ok(v),
            r => Err(r),
        }
    }

    fn unique_id(&self) -> Result<ncclUniqueId, ncclResult_t> {
        let f = next!(
            ncclGetUniqueId,
            unsafe extern "C" fn(*mut ncclUniqueId) -> ncclResult_t
        )
        .ok_or(NO_SYMBOL)?;
        let mut id = ncclUniqueId::from_bytes(&[0; NCCL_UNIQUE_ID_BYTES]);
        // SAFETY: NCCL's signature, a valid out pointer.
        match unsafe { f(&mut id) } {
            NCCL_SUCCESS => Ok(id),
            r => Err(r),
        }
    }

    fn init_rank(&self, nranks: i32, id: &ncclUniqueId, rank: i32, config: Cfg) -> Made {
        let mut c: ncclComm_t = std::ptr::null_mut();
        // SAFETY: NCCL's signatures; the config copy outlives the call.
        let r = match config {
            Some(cfg) => match next!(ncclCommInitRankConfig, InitRankConfigFn) {
                Some(f) => unsafe { f(&mut c, nranks, *id, rank, cfg.as_ptr()) },
                None => NO_SYMBOL,
            },
            None => match next!(ncclCommInitRank, InitRankFn) {
                Some(f) => unsafe { f(&mut c, nranks, *id, rank) },
                None => NO_SYMBOL,
            },
        };
        (r, c as usize)
    }

    fn split(&self, parent: RealComm, color: i32, key: i32, config: Cfg) -> Made {
        let Some(f) = next!(ncclCommSplit, SplitFn) else {
            return (NO_SYMBOL, 0);
        };
        let mut c: ncclComm_t = std::ptr::null_mut();
        let cfg = config.map_or(std::ptr::null_mut(), |c| c.as_ptr());
        // SAFETY: NCCL's signature; parent is a communicator the next library made.
        let r = unsafe { f(parent as ncclComm_t, color, key, &mut c, cfg) };
        (r, c as usize)
    }

    fn group_start(&self) -> ncclResult_t {
        // SAFETY: NCCL's signature.
        next!(ncclGroupStart, Void).map_or(NO_SYMBOL, |f| unsafe { f() })
    }

    fn group_end(&self) -> ncclResult_t {
        // SAFETY: NCCL's signature.
        next!(ncclGroupEnd, Void).map_or(NO_SYMBOL, |f| unsafe { f() })
    }

    fn has_suspend(&self) -> bool {
        next!(ncclCommSuspend, Suspend).is_some() && next!(ncclCommResume, CommFn).is_some()
    }

    fn suspend(&self, comm: RealComm) -> ncclResult_t {
        // SAFETY: NCCL's signature; a communicator the next library made.
        next!(ncclCommSuspend, Suspend).map_or(NO_SYMBOL, |f| unsafe {
            f(comm as ncclComm_t, NCCL_SUSPEND_MEM)
        })
    }

    fn resume(&self, comm: RealComm) -> ncclResult_t {
        // SAFETY: as above.
        next!(ncclCommResume, CommFn).map_or(NO_SYMBOL, |f| unsafe { f(comm as ncclComm_t) })
    }

    fn destroy(&self, comm: RealComm) -> ncclResult_t {
        // SAFETY: as above.
        next!(ncclCommDestroy, CommFn).map_or(NO_SYMBOL, |f| unsafe { f(comm as ncclComm_t) })
    }

    fn register(&self, comm: RealComm, ptr: usize, size: usize) -> (ncclResult_t, usize) {
        let Some(f) = next!(
            ncclCommRegister,
            unsafe extern "C" fn(ncclComm_t, *mut c_void, usize, *mut *mut c_void) -> ncclResult_t
        ) else {
            return (NO_SYMBOL, 0);
        };
        let mut h: *mut c_void = std::ptr::null_mut();
        // SAFETY: NCCL's signature; the buffer is the one the application registered.
        let r = unsafe { f(comm as ncclComm_t, ptr as *mut c_void, size, &mut h) };
        (r, h as usize)
    }

    fn deregister(&self, comm: RealComm, handle: usize) -> ncclResult_t {
        // SAFETY: NCCL's signature; a handle ncclCommRegister gave.
        next!(
            ncclCommDeregister,
            unsafe extern "C" fn(ncclComm_t, *mut c_void) -> ncclResult_t
        )
        .map_or(NO_SYMBOL, |f| unsafe {
            f(comm as ncclComm_t, handle as *mut c_void)
        })
    }

    fn rank_count(&self, comm: RealComm) -> Option<(i32, i32)> {
        type Q = unsafe extern "C" fn(ncclComm_t, *mut c_int) -> ncclResult_t;
        let (mut r, mut n) = (-1, -1);
        let c = comm as ncclComm_t;
        // SAFETY: NCCL's signatures, a communicator the next library made.
        let ok = unsafe {
            next!(ncclCommUserRank, Q)?(c, &mut r) == NCCL_SUCCESS
                && next!(ncclCommCount, Q)?(c, &mut n) == NCCL_SUCCESS
        };
        (ok && r >= 0).then_some((r, n))
    }

    fn async_error(&self, comm: RealComm) -> ncclResult_t {
        type F = unsafe extern "C" fn(ncclComm_t, *mut ncclResult_t) -> ncclResult_t;
        let Some(f) = next!(ncclCommGetAsyncError, F) else {
            return NO_SYMBOL;
        };
        let mut state = NCCL_SUCCESS;
        // SAFETY: NCCL's signature; a communicator the next library made.
        match unsafe { f(comm as ncclComm_t, &mut state) } {
            NCCL_SUCCESS => state,
            r => r,
        }
    }

    fn cu_device(&self, comm: RealComm) -> Result<i32, ncclResult_t> {
        let f = next!(
            ncclCommCuDevice,
            unsafe extern "C" fn(ncclComm_t, *mut c_int) -> ncclResult_t
        )
        .ok_or(NO_SYMBOL)?;
        let mut d = -1;
        // SAFETY: NCCL's signature.
        match unsafe { f(comm as ncclComm_t, &mut d) } {
            NCCL_SUCCESS => Ok(d),
            r => Err(r),
        }
    }

    fn current_device(&self) -> Option<i32> {
        let c = cuda().ok()?;
        let mut d = -1;
        // SAFETY: the driver's signature, a valid out pointer.
        (unsafe { (c.ctx_get_device)(&mut d) } == CUDA_SUCCESS).then_some(d)
    }

    fn use_device(&self, dev: i32) -> Result<(), String> {
        let c = cuda()?;
        let mut ctxs = self.ctxs.lock().unwrap_or_else(|e| e.into_inner());
        let ctx = match ctxs.get(&dev) {
            Some(c) => *c,
            None => {
                let mut d = 0;
                let mut ctx: *mut c_void = std::ptr::null_mut();
                // SAFETY: the driver's signatures, valid out pointers.
                let r = unsafe { (c.device_get)(&mut d, dev) };
                if r != CUDA_SUCCESS {
                    return Err(format!("cuDeviceGet({dev}): CUDA error {r}"));
                }
                let r = unsafe { (c.primary_ctx_retain)(&mut ctx, d) };
                if r != CUDA_SUCCESS {
                    return Err(format!("cuDevicePrimaryCtxRetain({dev}): CUDA error {r}"));
                }
                ctxs.insert(dev, ctx as usize);
                ctx as usize
            }
        };
        // SAFETY: a context the driver gave.
        match unsafe { (c.ctx_set_current)(ctx as *mut c_void) } {
            CUDA_SUCCESS => Ok(()),
            r => Err(format!("cuCtxSetCurrent(device {dev}): CUDA error {r}")),
        }
    }

    fn stream_done(&self, stream: usize, dev: i32) -> Result<bool, String> {
        let c = cuda()?;
        self.use_device(dev)?;
        // SAFETY: a stream the application passed to NCCL (the null stream included).
        match unsafe { (c.stream_query)(stream as *mut c_void) } {
            CUDA_SUCCESS => Ok(true),
            CUDA_ERROR_NOT_READY => Ok(false),
            r => Err(format!("cuStreamQuery({stream:#x}): CUDA error {r}")),
        }
    }

    fn last_error(&self, comm: RealComm) -> Option<String> {
        let f = next!(
            ncclGetLastError,
            unsafe extern "C" fn(ncclComm_t) -> *const std::ffi::c_char
        )?;
        // SAFETY: NCCL's signature; it returns a NUL-terminated string it owns, or null.
        let p = unsafe { f(comm as ncclComm_t) };
        if p.is_null() {
            return None;
        }
        // SAFETY: non-null, NUL-terminated, alive until the next NCCL call on this thread.
        let text = unsafe { CStr::from_ptr(p) }.to_string_lossy();
        let text = text.trim();
        if text.is_empty() {
            return None;
        }
        let mut end = text.len().min(crate::backend::LAST_ERROR_MAX);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        Some(text[..end].to_string())
    }
}
