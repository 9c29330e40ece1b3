//! Minimal CUDA driver-API bindings, resolved at run time from `libcuda.so.1`.
//!
//! The library is opened by the dynamic loader's default search, so `LD_LIBRARY_PATH` decides
//! which driver is used (the real one, or the simulator's). Every symbol is looked up by its real
//! exported name and called with the real C ABI. Nothing here links against CUDA at build time.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::fmt;

use libloading::Library;

/// `CUresult`.
pub type CuResult = c_uint;
/// `CUdevice` (an ordinal).
pub type CuDevice = c_int;
/// `CUcontext` (opaque).
pub type CuContext = *mut c_void;
/// `CUstream` (opaque).
pub type CuStream = *mut c_void;

/// A context handle from the driver.
#[derive(Debug, Clone, Copy)]
pub struct Context(CuContext);

/// A stream handle from the driver.
#[derive(Debug, Clone, Copy)]
pub struct Stream(CuStream);
/// `CUdeviceptr`.
pub type CuDevicePtr = u64;

pub const CUDA_SUCCESS: CuResult = 0;
pub const CUDA_ERROR_NO_DEVICE: CuResult = 100;
/// `CU_STREAM_NON_BLOCKING`.
pub const CU_STREAM_NON_BLOCKING: c_uint = 1;
/// `CU_MEMHOSTALLOC_PORTABLE`.
pub const CU_MEMHOSTALLOC_PORTABLE: c_uint = 1;

/// An error from loading the driver or from one driver call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaError {
    /// `libcuda.so.1` could not be opened.
    NoDriver(String),
    /// The library lacks a symbol this program needs.
    MissingSymbol {
        symbol: &'static str,
        detail: String,
    },
    /// A driver call returned something other than `CUDA_SUCCESS`.
    Call {
        call: &'static str,
        code: CuResult,
        name: String,
    },
}

impl CudaError {
    /// The CUDA error code, for call errors.
    pub fn code(&self) -> Option<CuResult> {
        match self {
            CudaError::Call { code, .. } => Some(*code),
            _ => None,
        }
    }
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudaError::NoDriver(detail) => write!(f, "no NVIDIA driver: {detail}"),
            CudaError::MissingSymbol { symbol, detail } => {
                write!(f, "libcuda.so.1 lacks {symbol}: {detail}")
            }
            CudaError::Call { call, code, name } => write!(f, "{call} failed: {name} ({code})"),
        }
    }
}

impl std::error::Error for CudaError {}

pub type Result<T> = std::result::Result<T, CudaError>;

macro_rules! driver_api {
    ($( $field:ident = $sym:literal : fn($($arg:ty),*) ),* $(,)?) => {
        struct Fns {
            $( $field: unsafe extern "C" fn($($arg),*) -> CuResult, )*
        }

        impl Fns {
            fn load(lib: &Library) -> Result<Fns> {
                Ok(Fns {
                    $( $field: {
                        // SAFETY: the type is the documented prototype of this driver symbol.
                        let sym = unsafe {
                            lib.get::<unsafe extern "C" fn($($arg),*) -> CuResult>($sym)
                        };
                        match sym {
                            Ok(s) => *s,
                            Err(e) => {
                                return Err(CudaError::MissingSymbol {
                                    symbol: $sym,
                                    detail: chain(&e),
                                })
                            }
                        }
                    }, )*
                })
            }
        }
    };
}

driver_api! {
    init = "cuInit": fn(c_uint),
    driver_get_version = "cuDriverGetVersion": fn(*mut c_int),
    device_get_count = "cuDeviceGetCount": fn(*mut c_int),
    device_get = "cuDeviceGet": fn(*mut CuDevice, c_int),
    device_get_name = "cuDeviceGetName": fn(*mut c_char, c_int, CuDevice),
    device_get_uuid = "cuDeviceGetUuid": fn(*mut [u8; 16], CuDevice),
    device_total_mem = "cuDeviceTotalMem_v2": fn(*mut usize, CuDevice),
    primary_ctx_retain = "cuDevicePrimaryCtxRetain": fn(*mut CuContext, CuDevice),
    primary_ctx_release = "cuDevicePrimaryCtxRelease_v2": fn(CuDevice),
    ctx_set_current = "cuCtxSetCurrent": fn(CuContext),
    ctx_synchronize = "cuCtxSynchronize": fn(),
    mem_alloc = "cuMemAlloc_v2": fn(*mut CuDevicePtr, usize),
    mem_free = "cuMemFree_v2": fn(CuDevicePtr),
    mem_get_info = "cuMemGetInfo_v2": fn(*mut usize, *mut usize),
    memcpy_htod = "cuMemcpyHtoD_v2": fn(CuDevicePtr, *const c_void, usize),
    memcpy_dtoh = "cuMemcpyDtoH_v2": fn(*mut c_void, CuDevicePtr, usize),
    memcpy_dtod = "cuMemcpyDtoD_v2": fn(CuDevicePtr, CuDevicePtr, usize),
    memcpy_htod_async = "cuMemcpyHtoDAsync_v2": fn(CuDevicePtr, *const c_void, usize, CuStream),
    memcpy_dtoh_async = "cuMemcpyDtoHAsync_v2": fn(*mut c_void, CuDevicePtr, usize, CuStream),
    memset_d8 = "cuMemsetD8_v2": fn(CuDevicePtr, u8, usize),
    memset_d32 = "cuMemsetD32_v2": fn(CuDevicePtr, c_uint, usize),
    stream_create = "cuStreamCreate": fn(*mut CuStream, c_uint),
    stream_synchronize = "cuStreamSynchronize": fn(CuStream),
    stream_destroy = "cuStreamDestroy_v2": fn(CuStream),
    mem_host_alloc = "cuMemHostAlloc": fn(*mut *mut c_void, usize, c_uint),
    mem_free_host = "cuMemFreeHost": fn(*mut c_void),
    get_error_name = "cuGetErrorName": fn(CuResult, *mut *const c_char),
}

/// The loaded driver. Calls act on the calling thread's current context, as in C.
pub struct Driver {
    fns: Fns,
    // Kept last so that it is dropped after the function pointers that point into it.
    _lib: Library,
}

impl Driver {
    /// Opens `libcuda.so.1` by the loader's default search and resolves every symbol used here.
    pub fn load() -> Result<Driver> {
        Self::load_from("libcuda.so.1")
    }

    /// Opens a driver library by name or path.
    pub fn load_from(name: &str) -> Result<Driver> {
        // SAFETY: loading libcuda runs its initialisers; that is what every CUDA program does.
        let lib = unsafe { Library::new(name) }
            .map_err(|e| CudaError::NoDriver(format!("cannot load {name}: {}", chain(&e))))?;
        let fns = Fns::load(&lib)?;
        Ok(Driver { fns, _lib: lib })
    }

    fn check(&self, call: &'static str, code: CuResult) -> Result<()> {
        if code == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(CudaError::Call {
                call,
                code,
                name: self.error_name(code),
            })
        }
    }

    /// `cuGetErrorName`, or `CUDA_ERROR_<code>` when the driver does not know the code.
    pub fn error_name(&self, code: CuResult) -> String {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: p is a valid out pointer; the driver returns a static string.
        let rc = unsafe { (self.fns.get_error_name)(code, &mut p) };
        if rc != CUDA_SUCCESS || p.is_null() {
            return format!("CUDA_ERROR_{code}");
        }
        // SAFETY: non-null, NUL-terminated static string from the driver.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    pub fn init(&self) -> Result<()> {
        // SAFETY: plain value argument.
        self.check("cuInit", unsafe { (self.fns.init)(0) })
    }

    pub fn driver_version(&self) -> Result<i32> {
        let mut v: c_int = 0;
        // SAFETY: valid out pointer.
        self.check("cuDriverGetVersion", unsafe {
            (self.fns.driver_get_version)(&mut v)
        })?;
        Ok(v)
    }

    pub fn device_count(&self) -> Result<i32> {
        let mut n: c_int = 0;
        // SAFETY: valid out pointer.
        self.check("cuDeviceGetCount", unsafe {
            (self.fns.device_get_count)(&mut n)
        })?;
        Ok(n)
    }

    pub fn device_get(&self, ordinal: i32) -> Result<CuDevice> {
        let mut d: CuDevice = 0;
        // SAFETY: valid out pointer.
        self.check("cuDeviceGet", unsafe {
            (self.fns.device_get)(&mut d, ordinal)
        })?;
        Ok(d)
    }

    pub fn device_name(&self, dev: CuDevice) -> Result<String> {
        let mut buf = [0 as c_char; 256];
        // SAFETY: the buffer holds buf.len() bytes; the driver NUL-terminates within it.
        self.check("cuDeviceGetName", unsafe {
            (self.fns.device_get_name)(buf.as_mut_ptr(), buf.len() as c_int, dev)
        })?;
        let last = buf.len() - 1;
        buf[last] = 0;
        // SAFETY: NUL-terminated (forced above).
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    pub fn device_uuid(&self, dev: CuDevice) -> Result<[u8; 16]> {
        let mut u = [0u8; 16];
        // SAFETY: CUuuid is 16 bytes.
        self.check("cuDeviceGetUuid", unsafe {
            (self.fns.device_get_uuid)(&mut u, dev)
        })?;
        Ok(u)
    }

    pub fn device_total_mem(&self, dev: CuDevice) -> Result<usize> {
        let mut n: usize = 0;
        // SAFETY: valid out pointer.
        self.check("cuDeviceTotalMem_v2", unsafe {
            (self.fns.device_total_mem)(&mut n, dev)
        })?;
        Ok(n)
    }

    pub fn primary_ctx_retain(&self, dev: CuDevice) -> Result<Context> {
        let mut c: CuContext = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        self.check("cuDevicePrimaryCtxRetain", unsafe {
            (self.fns.primary_ctx_retain)(&mut c, dev)
        })?;
        Ok(Context(c))
    }

    pub fn primary_ctx_release(&self, dev: CuDevice) -> Result<()> {
        // SAFETY: plain value argument.
        self.check("cuDevicePrimaryCtxRelease_v2", unsafe {
            (self.fns.primary_ctx_release)(dev)
        })
    }

    pub fn ctx_set_current(&self, ctx: Context) -> Result<()> {
        // SAFETY: ctx came from the driver.
        self.check("cuCtxSetCurrent", unsafe {
            (self.fns.ctx_set_current)(ctx.0)
        })
    }

    pub fn ctx_synchronize(&self) -> Result<()> {
        // SAFETY: no arguments.
        self.check("cuCtxSynchronize", unsafe { (self.fns.ctx_synchronize)() })
    }

    pub fn mem_alloc(&self, bytes: usize) -> Result<CuDevicePtr> {
        let mut p: CuDevicePtr = 0;
        // SAFETY: valid out pointer.
        self.check("cuMemAlloc_v2", unsafe {
            (self.fns.mem_alloc)(&mut p, bytes)
        })?;
        Ok(p)
    }

    pub fn mem_free(&self, p: CuDevicePtr) -> Result<()> {
        // SAFETY: the driver validates device pointers.
        self.check("cuMemFree_v2", unsafe { (self.fns.mem_free)(p) })
    }

    /// `(free, total)` bytes of the current context's device.
    pub fn mem_get_info(&self) -> Result<(usize, usize)> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out pointers.
        self.check("cuMemGetInfo_v2", unsafe {
            (self.fns.mem_get_info)(&mut free, &mut total)
        })?;
        Ok((free, total))
    }

    pub fn memcpy_htod(&self, dst: CuDevicePtr, src: &[u8]) -> Result<()> {
        // SAFETY: src is valid for src.len() bytes; the driver checks dst.
        self.check("cuMemcpyHtoD_v2", unsafe {
            (self.fns.memcpy_htod)(dst, src.as_ptr().cast(), src.len())
        })
    }

    pub fn memcpy_dtoh(&self, dst: &mut [u8], src: CuDevicePtr) -> Result<()> {
        // SAFETY: dst is valid for dst.len() bytes; the driver checks src.
        self.check("cuMemcpyDtoH_v2", unsafe {
            (self.fns.memcpy_dtoh)(dst.as_mut_ptr().cast(), src, dst.len())
        })
    }

    pub fn memcpy_dtod(&self, dst: CuDevicePtr, src: CuDevicePtr, bytes: usize) -> Result<()> {
        // SAFETY: device pointers only; the driver checks them.
        self.check("cuMemcpyDtoD_v2", unsafe {
            (self.fns.memcpy_dtod)(dst, src, bytes)
        })
    }

    /// `cuMemcpyHtoDAsync_v2` followed by `cuStreamSynchronize`, so that `src` outlives the copy.
    pub fn memcpy_htod_on_stream(
        &self,
        dst: CuDevicePtr,
        src: &[u8],
        stream: Stream,
    ) -> Result<()> {
        // SAFETY: src stays borrowed until the stream is synchronized below.
        self.check("cuMemcpyHtoDAsync_v2", unsafe {
            (self.fns.memcpy_htod_async)(dst, src.as_ptr().cast(), src.len(), stream.0)
        })?;
        self.stream_synchronize(stream)
    }

    /// `cuMemcpyDtoHAsync_v2` followed by `cuStreamSynchronize`, so that `dst` outlives the copy.
    pub fn memcpy_dtoh_on_stream(
        &self,
        dst: &mut [u8],
        src: CuDevicePtr,
        stream: Stream,
    ) -> Result<()> {
        // SAFETY: dst stays borrowed until the stream is synchronized below.
        self.check("cuMemcpyDtoHAsync_v2", unsafe {
            (self.fns.memcpy_dtoh_async)(dst.as_mut_ptr().cast(), src, dst.len(), stream.0)
        })?;
        self.stream_synchronize(stream)
    }

    pub fn memset_d8(&self, dst: CuDevicePtr, value: u8, count: usize) -> Result<()> {
        // SAFETY: device pointer only.
        self.check("cuMemsetD8_v2", unsafe {
            (self.fns.memset_d8)(dst, value, count)
        })
    }

    pub fn memset_d32(&self, dst: CuDevicePtr, value: u32, count: usize) -> Result<()> {
        // SAFETY: device pointer only.
        self.check("cuMemsetD32_v2", unsafe {
            (self.fns.memset_d32)(dst, value, count)
        })
    }

    pub fn stream_create(&self, flags: u32) -> Result<Stream> {
        let mut s: CuStream = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        self.check("cuStreamCreate", unsafe {
            (self.fns.stream_create)(&mut s, flags)
        })?;
        Ok(Stream(s))
    }

    pub fn stream_synchronize(&self, s: Stream) -> Result<()> {
        // SAFETY: s came from the driver.
        self.check("cuStreamSynchronize", unsafe {
            (self.fns.stream_synchronize)(s.0)
        })
    }

    pub fn stream_destroy(&self, s: Stream) -> Result<()> {
        // SAFETY: s came from the driver.
        self.check("cuStreamDestroy_v2", unsafe {
            (self.fns.stream_destroy)(s.0)
        })
    }

    /// Page-locked host memory, freed when the returned buffer is dropped.
    pub fn pinned(&self, bytes: usize) -> Result<PinnedBuf<'_>> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        self.check("cuMemHostAlloc", unsafe {
            (self.fns.mem_host_alloc)(&mut p, bytes, CU_MEMHOSTALLOC_PORTABLE)
        })?;
        Ok(PinnedBuf {
            driver: self,
            ptr: p.cast(),
            len: bytes,
        })
    }
}

/// Pinned host memory from `cuMemHostAlloc`.
pub struct PinnedBuf<'a> {
    driver: &'a Driver,
    ptr: *mut u8,
    len: usize,
}

impl PinnedBuf<'_> {
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the driver handed out len bytes at ptr, owned by this buffer.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuf<'_> {
    fn drop(&mut self) {
        // SAFETY: ptr came from cuMemHostAlloc and is freed once.
        let _ = unsafe { (self.driver.fns.mem_free_host)(self.ptr.cast()) };
    }
}

/// An error and its sources, `a: b: c`.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        s.push_str(": ");
        s.push_str(&x.to_string());
        src = x.source();
    }
    s
}

/// The bytes of a `u32` slice (native endianness, as the device sees them).
pub fn u32_bytes(words: &[u32]) -> &[u8] {
    // SAFETY: u8 has no alignment requirement and every byte of a u32 is initialised.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast(), std::mem::size_of_val(words)) }
}

/// The bytes of a mutable `u32` slice; every byte pattern is a valid `u32`.
pub fn u32_bytes_mut(words: &mut [u32]) -> &mut [u8] {
    let len = std::mem::size_of_val(words);
    // SAFETY: as above; any bytes written form valid u32 values.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast(), len) }
}

/// A GPU UUID in NVIDIA's text form, `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn format_uuid(u: &[u8; 16]) -> String {
    let h: Vec<String> = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

/// One device ready for work: its primary context is retained and made current on selection.
pub struct Gpu {
    pub ordinal: i32,
    pub dev: CuDevice,
    pub ctx: Context,
}

impl Gpu {
    pub fn open(driver: &Driver, ordinal: i32) -> Result<Gpu> {
        let dev = driver.device_get(ordinal)?;
        let ctx = driver.primary_ctx_retain(dev)?;
        driver.ctx_set_current(ctx)?;
        Ok(Gpu { ordinal, dev, ctx })
    }

    /// Makes this device's context current on the calling thread.
    pub fn select(&self, driver: &Driver) -> Result<()> {
        driver.ctx_set_current(self.ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_text_form() {
        let u: [u8; 16] = [
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
            0xcd, 0xef,
        ];
        assert_eq!(format_uuid(&u), "GPU-12345678-9abc-def0-0123-456789abcdef");
    }

    #[test]
    fn missing_library_is_an_error_not_a_panic() {
        match Driver::load_from("libcuda-does-not-exist.so.1") {
            Err(CudaError::NoDriver(msg)) => assert!(msg.contains("libcuda-does-not-exist")),
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("loaded a library that does not exist"),
        }
    }

    #[test]
    fn byte_views_cover_every_word() {
        let mut w = [1u32, 2, 3];
        assert_eq!(u32_bytes(&w).len(), 12);
        u32_bytes_mut(&mut w)[0..4].copy_from_slice(&7u32.to_ne_bytes());
        assert_eq!(w[0], 7);
    }
}
