//! The CUDA driver entry points NCCL needs, from whichever `libcuda.so.1` the process loads (the
//! simulated one on a simulated node): the current device, contexts, device memory for
//! `ncclMemAlloc`, and `cuLaunchHostFunc`, which puts a collective in its stream's order.

use std::ffi::{c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

use crate::{fail, Fail, R};
use simgpu::nccl::result;

type CUresult = c_uint;
type HostFn = unsafe extern "C" fn(*mut c_void);

/// `CUDA_ERROR_NOT_READY`: a stream with work pending.
pub const NOT_READY: CUresult = 600;

#[allow(non_snake_case)]
pub struct Cuda {
    cuInit: unsafe extern "C" fn(c_uint) -> CUresult,
    cuDeviceGetCount: unsafe extern "C" fn(*mut c_int) -> CUresult,
    cuDeviceGetUuid: unsafe extern "C" fn(*mut [u8; 16], c_int) -> CUresult,
    cuDevicePrimaryCtxRetain: unsafe extern "C" fn(*mut *mut c_void, c_int) -> CUresult,
    cuCtxGetCurrent: unsafe extern "C" fn(*mut *mut c_void) -> CUresult,
    cuCtxSetCurrent: unsafe extern "C" fn(*mut c_void) -> CUresult,
    cuCtxGetDevice: unsafe extern "C" fn(*mut c_int) -> CUresult,
    cuStreamQuery: unsafe extern "C" fn(*mut c_void) -> CUresult,
    cuLaunchHostFunc: unsafe extern "C" fn(*mut c_void, HostFn, *mut c_void) -> CUresult,
    cuMemAlloc_v2: unsafe extern "C" fn(*mut u64, usize) -> CUresult,
    cuMemFree_v2: unsafe extern "C" fn(u64) -> CUresult,
}

fn cuda_fail(call: &str, code: CUresult) -> Fail {
    fail(
        result::UNHANDLED_CUDA_ERROR,
        format!("{call} failed: CUresult {code}"),
    )
}

fn check(call: &str, code: CUresult) -> R<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(cuda_fail(call, code))
    }
}

impl Cuda {
    // Each transmute's target is its field's type, spelled in the struct above.
    #[allow(clippy::missing_transmute_annotations)]
    fn load() -> Result<Cuda, String> {
        // SAFETY: dlopen of the driver by its soname; the process may have loaded it already.
        let handle = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) };
        if handle.is_null() {
            // SAFETY: dlerror returns a NUL-terminated message or NULL.
            let e = unsafe { libc::dlerror() };
            let msg = if e.is_null() {
                "unknown error".to_string()
            } else {
                // SAFETY: see above.
                unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
            };
            return Err(format!("cannot load libcuda.so.1: {msg}"));
        }
        let sym = |name: &CStr| -> Result<*mut c_void, String> {
            // SAFETY: a live handle and a NUL-terminated name.
            let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
            if p.is_null() {
                Err(format!("libcuda.so.1 has no {}", name.to_string_lossy()))
            } else {
                Ok(p)
            }
        };
        macro_rules! load {
            ($($name:ident),*) => {
                // SAFETY: each symbol is the driver entry point of that name, whose C signature
                // is the field's type (cuda.h).
                unsafe { Cuda { $($name: std::mem::transmute::<*mut c_void, _>(sym(
                    &std::ffi::CString::new(stringify!($name)).unwrap_or_default())?)),* } }
            };
        }
        Ok(load!(
            cuInit,
            cuDeviceGetCount,
            cuDeviceGetUuid,
            cuDevicePrimaryCtxRetain,
            cuCtxGetCurrent,
            cuCtxSetCurrent,
            cuCtxGetDevice,
            cuStreamQuery,
            cuLaunchHostFunc,
            cuMemAlloc_v2,
            cuMemFree_v2
        ))
    }

    /// The current device, as the CUDA runtime NCCL uses has it: the current context's, else
    /// device 0, whose primary context becomes current (the runtime's default device).
    pub fn current_device(&self) -> R<c_int> {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        let have = unsafe { (self.cuCtxGetCurrent)(&mut ctx) } == 0 && !ctx.is_null();
        if !have {
            self.make_current(0)?;
        }
        let mut dev = 0;
        // SAFETY: out-pointer to a local.
        check("cuCtxGetDevice", unsafe { (self.cuCtxGetDevice)(&mut dev) })?;
        Ok(dev)
    }

    /// Makes device `dev`'s primary context current on this thread (`cudaSetDevice`).
    pub fn make_current(&self, dev: c_int) -> R<()> {
        // SAFETY: plain driver calls with out-pointers to locals.
        unsafe {
            check("cuInit", (self.cuInit)(0))?;
            let mut ctx = std::ptr::null_mut();
            check(
                "cuDevicePrimaryCtxRetain",
                (self.cuDevicePrimaryCtxRetain)(&mut ctx, dev),
            )?;
            check("cuCtxSetCurrent", (self.cuCtxSetCurrent)(ctx))
        }
    }

    pub fn device_count(&self) -> R<c_int> {
        let mut n = 0;
        // SAFETY: plain driver calls with out-pointers to locals.
        unsafe {
            check("cuInit", (self.cuInit)(0))?;
            check("cuDeviceGetCount", (self.cuDeviceGetCount)(&mut n))?;
        }
        Ok(n)
    }

    pub fn uuid(&self, dev: c_int) -> R<[u8; 16]> {
        let mut u = [0u8; 16];
        // SAFETY: out-pointer to a local of the size cuda.h gives CUuuid.
        check("cuDeviceGetUuid", unsafe {
            (self.cuDeviceGetUuid)(&mut u, dev)
        })?;
        Ok(u)
    }

    /// Whether `stream` is a stream of this process (`cuStreamQuery` knows it).
    pub fn check_stream(&self, stream: *mut c_void) -> R<()> {
        // SAFETY: the driver checks the handle.
        match unsafe { (self.cuStreamQuery)(stream) } {
            0 | NOT_READY => Ok(()),
            code => Err(cuda_fail("cuStreamQuery", code)),
        }
    }

    /// Enqueues `f(data)` on `stream`.
    pub fn launch_host_func(&self, stream: *mut c_void, f: HostFn, data: *mut c_void) -> R<()> {
        // SAFETY: f and data stay valid until f runs (data is a leaked box f takes back).
        check("cuLaunchHostFunc", unsafe {
            (self.cuLaunchHostFunc)(stream, f, data)
        })
    }

    pub fn mem_alloc(&self, size: usize) -> R<u64> {
        self.current_device()?;
        let mut p = 0u64;
        // SAFETY: out-pointer to a local.
        check("cuMemAlloc", unsafe { (self.cuMemAlloc_v2)(&mut p, size) })?;
        Ok(p)
    }

    pub fn mem_free(&self, p: u64) -> R<()> {
        // SAFETY: the driver checks the pointer.
        check("cuMemFree", unsafe { (self.cuMemFree_v2)(p) })
    }
}

/// The process's driver entry points, loaded once.
pub fn cuda() -> R<&'static Cuda> {
    static CUDA: OnceLock<Result<Cuda, String>> = OnceLock::new();
    match CUDA.get_or_init(Cuda::load) {
        Ok(c) => Ok(c),
        Err(e) => Err(fail(result::SYSTEM_ERROR, e.clone())),
    }
}
