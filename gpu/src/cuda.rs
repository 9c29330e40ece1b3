//! The CUDA driver's checkpoint API (`cuCheckpointProcess*`), loaded from `libcuda.so.1` at run
//! time with libloading.
//!
//! A library is opened and `cuInit(0)` called once per process and library (a process-wide
//! cache): `cuInit` costs seconds on a real driver, and a restore needs it to have run (or the
//! GPUs in persistence mode). Libraries are never unloaded once their code has run.
//!
//! Every entry point is `CUresult f(int pid, T *args)`; every argument struct is 64 bytes and
//! zeroed. GPU pairs go to the driver only from CUDA 13.0 (driver 580) on, where remapping
//! exists; see [`restore_pairs`].

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, CStr};
use std::fmt;
use std::mem::size_of;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use libloading::Library;

use crate::error::GpuError;
use crate::state::ProcessState;
use crate::storage::DeviceMemoryFile;
use crate::uuid::GpuPair;
pub use crate::version::CudaVersion;
use crate::DeviceCheckpoint;

mod custom;
pub use custom::{
    CUcheckpointCheckpointArgsCustom, CUcheckpointCustomStorageInfo,
    CUcheckpointCustomStoragePerDeviceData, CUcheckpointRestoreArgsCustom, CHUNK_BYTES,
    CUSTOM_STORAGE_MIN_VERSION,
};

/// The library loaded when no path is given (the dynamic loader's search applies).
pub const DEFAULT_LIBRARY: &str = "libcuda.so.1";

/// The first `cuDriverGetVersion` with GPU remapping in `cuCheckpointProcessRestore` (CUDA 13.0,
/// driver branch 580).
pub const REMAP_MIN_VERSION: i32 = 13000;

/// `CUresult`: a C enum, 32 bits.
pub type CUresult = u32;
/// `CUDA_SUCCESS`.
pub const CUDA_SUCCESS: CUresult = 0;

/// `CUcheckpointLockArgs`: `timeoutMs` (0 = no timeout), then reserved.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CUcheckpointLockArgs {
    /// `timeoutMs`.
    pub timeout_ms: c_uint,
    pub reserved0: c_uint,
    pub reserved1: [u64; 7],
}

/// `CUcheckpointCheckpointArgs` (CUDA 12.8–13.3 layout): all reserved.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CUcheckpointCheckpointArgs {
    pub reserved: [u64; 8],
}

/// `CUcheckpointUnlockArgs`: all reserved.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CUcheckpointUnlockArgs {
    pub reserved: [u64; 8],
}

/// `CUcheckpointGpuPair`: `oldUuid`, `newUuid` (`CUuuid`, 16 bytes each).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CUcheckpointGpuPair {
    /// `oldUuid`.
    pub old_uuid: [u8; 16],
    /// `newUuid`.
    pub new_uuid: [u8; 16],
}

/// `CUcheckpointRestoreArgs`: `gpuPairs` at offset 0, `gpuPairsCount` at 8, then reserved (the
/// same offsets in every published layout; on 12.8/12.9 the whole struct is reserved and must be
/// zero, which it is when no pairs are passed).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CUcheckpointRestoreArgs {
    /// `gpuPairs`.
    pub gpu_pairs: *const CUcheckpointGpuPair,
    /// `gpuPairsCount`.
    pub gpu_pairs_count: c_uint,
    pub reserved0: c_uint,
    pub reserved1: [u64; 6],
}

impl Default for CUcheckpointRestoreArgs {
    fn default() -> Self {
        CUcheckpointRestoreArgs {
            gpu_pairs: std::ptr::null(),
            gpu_pairs_count: 0,
            reserved0: 0,
            reserved1: [0; 6],
        }
    }
}

const _: () = assert!(size_of::<CUcheckpointLockArgs>() == 64);
const _: () = assert!(size_of::<CUcheckpointCheckpointArgs>() == 64);
const _: () = assert!(size_of::<CUcheckpointUnlockArgs>() == 64);
const _: () = assert!(size_of::<CUcheckpointRestoreArgs>() == 64);
const _: () = assert!(size_of::<CUcheckpointGpuPair>() == 32);

impl From<&GpuPair> for CUcheckpointGpuPair {
    fn from(p: &GpuPair) -> Self {
        CUcheckpointGpuPair {
            old_uuid: p.old.0,
            new_uuid: p.new.0,
        }
    }
}

/// The pairs a restore passes to a driver of `driver_version`, decided before any call.
///
/// From CUDA 13.0 on: every pair as given (empty: the same GPUs). Before 13.0 the driver has no
/// remapping: pairs that are all identity are dropped (a plain restore), and any pair onto another
/// GPU is refused with [`GpuError::NoRemap`].
pub fn restore_pairs(
    pid: i32,
    driver_version: i32,
    pairs: &[GpuPair],
) -> Result<Vec<CUcheckpointGpuPair>, GpuError> {
    if driver_version >= REMAP_MIN_VERSION {
        return Ok(pairs.iter().map(CUcheckpointGpuPair::from).collect());
    }
    let moved: Vec<String> = pairs
        .iter()
        .filter(|p| !p.is_identity())
        .map(GpuPair::to_string)
        .collect();
    if moved.is_empty() {
        Ok(Vec::new())
    } else {
        Err(GpuError::NoRemap {
            pid,
            driver_version,
            pairs: moved.join(","),
        })
    }
}

/// `gpuPairs` and `gpuPairsCount` of a restore's arguments: NULL and 0 for no pairs.
fn pairs_arg(
    pairs: &[CUcheckpointGpuPair],
) -> Result<(*const CUcheckpointGpuPair, c_uint), GpuError> {
    let count = u32::try_from(pairs.len())
        .map_err(|_| GpuError::InvalidArgument(format!("{} GPU pairs", pairs.len())))?;
    let ptr = if pairs.is_empty() {
        std::ptr::null()
    } else {
        pairs.as_ptr()
    };
    Ok((ptr, count))
}

/// The name of a common `CUresult`, for drivers whose `cuGetErrorName` fails or is missing.
pub fn fallback_error_name(code: CUresult) -> Option<&'static str> {
    Some(match code {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        34 => "CUDA_ERROR_STUB_LIBRARY",
        46 => "CUDA_ERROR_DEVICE_UNAVAILABLE",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        304 => "CUDA_ERROR_OPERATING_SYSTEM",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        401 => "CUDA_ERROR_ILLEGAL_STATE",
        500 => "CUDA_ERROR_NOT_FOUND",
        600 => "CUDA_ERROR_NOT_READY",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        719 => "CUDA_ERROR_LAUNCH_FAILED",
        800 => "CUDA_ERROR_NOT_PERMITTED",
        801 => "CUDA_ERROR_NOT_SUPPORTED",
        802 => "CUDA_ERROR_SYSTEM_NOT_READY",
        803 => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        909 => "CUDA_ERROR_TIMEOUT",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => return None,
    })
}

/// A lock timeout as the driver takes it: `None` or zero → 0 (no timeout); a fraction of a
/// millisecond rounds up, so a timeout never turns into "wait forever".
pub fn lock_timeout_ms(timeout: Option<Duration>) -> Result<u32, GpuError> {
    let Some(d) = timeout else { return Ok(0) };
    let ms = d.as_nanos().div_ceil(1_000_000);
    u32::try_from(ms).map_err(|_| {
        GpuError::InvalidArgument(format!(
            "lock timeout of {ms} ms does not fit the driver's 32-bit milliseconds"
        ))
    })
}

type InitFn = unsafe extern "C" fn(c_uint) -> CUresult;
type VersionFn = unsafe extern "C" fn(*mut c_int) -> CUresult;
type ErrorTextFn = unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult;
type PidFn<T> = unsafe extern "C" fn(c_int, *mut T) -> CUresult;

/// A checkpoint entry point, or why it is missing (older drivers lack them; the error comes when
/// it is called, so that the rest of the library stays usable).
struct Sym<T> {
    name: &'static str,
    f: Result<T, String>,
}

/// One loaded, initialised library. Lives in the process-wide cache for the rest of the process.
struct Loaded {
    library: String,
    driver_version: i32,
    get_error_name: Option<ErrorTextFn>,
    get_error_string: Option<ErrorTextFn>,
    lock: Sym<PidFn<CUcheckpointLockArgs>>,
    checkpoint: Sym<PidFn<CUcheckpointCheckpointArgs>>,
    restore: Sym<PidFn<CUcheckpointRestoreArgs>>,
    unlock: Sym<PidFn<CUcheckpointUnlockArgs>>,
    get_state: Sym<PidFn<c_uint>>,
    get_restore_tid: Sym<PidFn<c_int>>,
    /// Custom storage's entry points, or the first one missing (symbol, reason).
    custom: Result<custom::CustomApi, (String, String)>,
    /// Keeps the function pointers above valid; never dropped (the cache is never emptied).
    _lib: Library,
}

/// Told the name of each driver call (and its pid) just before it is made; see
/// [`observe_calls`].
pub type CallObserver = fn(call: &'static str, pid: Option<i32>);

static OBSERVER: OnceLock<CallObserver> = OnceLock::new();

/// Sets, once per process, a function told of every driver call before it is made: a process
/// that runs the calls for another can say which one is under way, so that a call that never
/// returns is named by its caller.
pub fn observe_calls(f: CallObserver) {
    let _ = OBSERVER.set(f);
}

/// Cache key: the canonical path, or `None` for the loader's default search.
type Cache = Mutex<HashMap<Option<PathBuf>, Arc<Loaded>>>;

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The CUDA driver, for the checkpoint API. Cheap to clone; every clone shares one loaded library.
#[derive(Clone)]
pub struct CudaDriver {
    loaded: Arc<Loaded>,
}

impl fmt::Debug for CudaDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDriver")
            .field("library", &self.loaded.library)
            .field("driver_version", &self.loaded.driver_version)
            .finish()
    }
}

impl CudaDriver {
    /// Loads `libcuda.so.1` through the loader's search and initialises it (once per process).
    pub fn load() -> Result<CudaDriver, GpuError> {
        Self::open(None)
    }

    /// Loads the library at `path` (once per process and path).
    pub fn load_from(path: impl AsRef<Path>) -> Result<CudaDriver, GpuError> {
        Self::open(Some(path.as_ref()))
    }

    /// [`load_from`](Self::load_from) when a path is given, else [`load`](Self::load).
    pub fn open(path: Option<&Path>) -> Result<CudaDriver, GpuError> {
        let key = path.map(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf()));
        let mut cache = cache().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(loaded) = cache.get(&key) {
            return Ok(CudaDriver {
                loaded: Arc::clone(loaded),
            });
        }
        let loaded = Arc::new(load_library(path)?);
        cache.insert(key, Arc::clone(&loaded));
        Ok(CudaDriver { loaded })
    }

    /// The library as it was asked for (a path, or `libcuda.so.1`).
    pub fn library(&self) -> &str {
        &self.loaded.library
    }

    /// `cuDriverGetVersion`, read once at load.
    pub fn version(&self) -> i32 {
        self.loaded.driver_version
    }

    /// Whether this driver can restore onto other GPUs.
    pub fn supports_remap(&self) -> bool {
        self.loaded.driver_version >= REMAP_MIN_VERSION
    }

    /// Runs one driver call and turns its `CUresult` into a `Result`.
    fn call(
        &self,
        call: &'static str,
        pid: Option<i32>,
        f: impl FnOnce() -> CUresult,
    ) -> Result<(), GpuError> {
        if let Some(observe) = OBSERVER.get() {
            observe(call, pid);
        }
        let start = Instant::now();
        let rc = f();
        let elapsed_us = start.elapsed().as_micros() as u64;
        if rc == CUDA_SUCCESS {
            tracing::debug!(call, pid, elapsed_us, "cuda call ok");
            return Ok(());
        }
        let err = driver_error(&self.loaded, call, pid, rc);
        tracing::debug!(
            call,
            pid,
            elapsed_us,
            code = rc,
            description = describe(self.loaded.get_error_string, rc).as_deref(),
            "cuda call failed"
        );
        Err(err)
    }

    fn sym<T: Copy>(&self, s: &Sym<T>) -> Result<T, GpuError> {
        s.f.as_ref()
            .copied()
            .map_err(|reason| GpuError::MissingSymbol {
                library: self.loaded.library.clone(),
                symbol: s.name.to_string(),
                reason: reason.clone(),
            })
    }

    /// A checkpoint-API call whose arguments are all defaults (checkpoint, unlock): `step` is
    /// the call's name, the state it must leave the process in, and the word logged after it.
    fn default_args_step<A: Default>(
        &self,
        sym: &Sym<PidFn<A>>,
        pid: i32,
        (step, expected, done): (&'static str, ProcessState, &'static str),
    ) -> Result<(), GpuError> {
        let start = Instant::now();
        let f = self.sym(sym)?;
        let mut args = A::default();
        // SAFETY: a function of this signature from the loaded library; `args` is a live,
        // zero-filled struct of the size the driver reads.
        self.call(sym.name, Some(pid), || unsafe { f(pid, &mut args) })?;
        self.expect_state(step, pid, expected)?;
        tracing::info!(elapsed_ms = start.elapsed().as_millis() as u64, "{done}");
        Ok(())
    }

    /// Reads the state back after `step` and checks it is `expected`.
    fn expect_state(
        &self,
        step: &'static str,
        pid: i32,
        expected: ProcessState,
    ) -> Result<(), GpuError> {
        let actual = self.state(pid)?;
        if actual != expected {
            tracing::warn!(step, pid, %expected, %actual, "call succeeded but the state is wrong");
            return Err(GpuError::UnexpectedState {
                step,
                pid,
                expected,
                actual,
            });
        }
        Ok(())
    }
}

impl DeviceCheckpoint for CudaDriver {
    fn lock(&self, pid: i32, timeout: Option<Duration>) -> Result<(), GpuError> {
        let timeout_ms = lock_timeout_ms(timeout)?;
        let _span = tracing::info_span!("cuda_lock", pid, timeout_ms).entered();
        let start = Instant::now();
        let f = self.sym(&self.loaded.lock)?;
        let mut args = CUcheckpointLockArgs {
            timeout_ms,
            ..Default::default()
        };
        // SAFETY: a function of this signature from the loaded library; `args` is a live,
        // zero-filled 64-byte struct.
        self.call(self.loaded.lock.name, Some(pid), || unsafe {
            f(pid, &mut args)
        })?;
        self.expect_state("lock", pid, ProcessState::LOCKED)?;
        tracing::info!(elapsed_ms = start.elapsed().as_millis() as u64, "locked");
        Ok(())
    }

    fn checkpoint(&self, pid: i32) -> Result<(), GpuError> {
        let _span = tracing::info_span!("cuda_checkpoint", pid).entered();
        let step = ("checkpoint", ProcessState::CHECKPOINTED, "checkpointed");
        self.default_args_step(&self.loaded.checkpoint, pid, step)
    }

    fn restore(&self, pid: i32, pairs: &[GpuPair]) -> Result<(), GpuError> {
        let _span = tracing::info_span!("cuda_restore", pid, pairs = pairs.len()).entered();
        let start = Instant::now();
        // Decided before any call: an old driver cannot move a process to other GPUs.
        let c_pairs = restore_pairs(pid, self.loaded.driver_version, pairs)?;
        let f = self.sym(&self.loaded.restore)?;
        let (gpu_pairs, gpu_pairs_count) = pairs_arg(&c_pairs)?;
        let mut args = CUcheckpointRestoreArgs {
            gpu_pairs,
            gpu_pairs_count,
            ..Default::default()
        };
        for p in pairs {
            tracing::debug!(pair = %p, "gpu pair");
        }
        // SAFETY: as in `lock`; `c_pairs` outlives the call.
        self.call(self.loaded.restore.name, Some(pid), || unsafe {
            f(pid, &mut args)
        })?;
        self.expect_state("restore", pid, ProcessState::LOCKED)?;
        tracing::info!(
            elapsed_ms = start.elapsed().as_millis() as u64,
            pairs_passed = c_pairs.len(),
            "restored"
        );
        Ok(())
    }

    fn unlock(&self, pid: i32) -> Result<(), GpuError> {
        let _span = tracing::info_span!("cuda_unlock", pid).entered();
        let step = ("unlock", ProcessState::RUNNING, "unlocked");
        self.default_args_step(&self.loaded.unlock, pid, step)
    }

    fn state(&self, pid: i32) -> Result<ProcessState, GpuError> {
        let f = self.sym(&self.loaded.get_state)?;
        let mut state: c_uint = 0;
        // SAFETY: writes one `CUprocessState` (a 32-bit enum) through a live pointer.
        self.call(self.loaded.get_state.name, Some(pid), || unsafe {
            f(pid, &mut state)
        })?;
        let state = ProcessState(state);
        tracing::debug!(pid, %state, "state");
        Ok(state)
    }

    fn restore_thread_id(&self, pid: i32) -> Result<i32, GpuError> {
        let f = self.sym(&self.loaded.get_restore_tid)?;
        let mut tid: c_int = 0;
        // SAFETY: writes one int through a live pointer.
        self.call(self.loaded.get_restore_tid.name, Some(pid), || unsafe {
            f(pid, &mut tid)
        })?;
        Ok(tid)
    }

    fn driver_version(&self) -> Result<i32, GpuError> {
        Ok(self.loaded.driver_version)
    }

    fn custom_storage(&self) -> bool {
        self.has_custom_storage()
    }

    fn checkpoint_to(
        &self,
        pid: i32,
        gpus: &[crate::GpuUuid],
        dir: &std::path::Path,
        prefix: &str,
    ) -> Result<Vec<DeviceMemoryFile>, GpuError> {
        self.custom_checkpoint(pid, gpus, dir, prefix)
    }

    fn restore_from(
        &self,
        pid: i32,
        pairs: &[crate::GpuPair],
        dir: &Path,
        files: &[DeviceMemoryFile],
    ) -> Result<(), GpuError> {
        self.custom_restore(pid, dir, files, pairs)
    }
}

/// `cuGetErrorName`, else the built-in table.
fn error_name(get_error_name: Option<ErrorTextFn>, code: CUresult) -> String {
    describe(get_error_name, code)
        .or_else(|| fallback_error_name(code).map(str::to_string))
        .unwrap_or_else(|| "unknown CUresult".to_string())
}

/// Calls `cuGetErrorName` or `cuGetErrorString`.
fn describe(f: Option<ErrorTextFn>, code: CUresult) -> Option<String> {
    let f = f?;
    let mut p: *const c_char = std::ptr::null();
    // SAFETY: the driver writes a pointer to a static string, or fails.
    let rc = unsafe { f(code, &mut p) };
    if rc != CUDA_SUCCESS || p.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated static string owned by the driver.
    let s = unsafe { CStr::from_ptr(p) };
    Some(s.to_string_lossy().into_owned())
}

fn driver_error(loaded: &Loaded, call: &'static str, pid: Option<i32>, code: CUresult) -> GpuError {
    GpuError::Driver {
        call,
        pid,
        code,
        name: error_name(loaded.get_error_name, code),
    }
}

/// An error and its sources on one line (libloading 0.9 keeps dlerror's text in the source).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

/// Opens the library, resolves the symbols, runs `cuInit(0)` and reads the version.
fn load_library(path: Option<&Path>) -> Result<Loaded, GpuError> {
    let library = match path {
        Some(p) => p.display().to_string(),
        None => DEFAULT_LIBRARY.to_string(),
    };
    let _span = tracing::info_span!("cuda_load", library = %library).entered();
    let start = Instant::now();
    // SAFETY: loading the CUDA driver runs its initialisers, which is what the driver expects.
    let lib = unsafe {
        match path {
            Some(p) => Library::new(p),
            None => Library::new(DEFAULT_LIBRARY),
        }
    }
    .map_err(|e| GpuError::NoDriver {
        library: library.clone(),
        reason: error_chain(&e),
    })?;

    let required = |symbol: &'static str, e: libloading::Error| GpuError::MissingSymbol {
        library: library.clone(),
        symbol: symbol.to_string(),
        reason: error_chain(&e),
    };
    // SAFETY (every `get` below): the types are the driver API's C signatures.
    let cu_init: InitFn = unsafe { lib.get::<InitFn>("cuInit") }
        .map(|s| *s)
        .map_err(|e| required("cuInit", e))?;
    let get_version: VersionFn = unsafe { lib.get::<VersionFn>("cuDriverGetVersion") }
        .map(|s| *s)
        .map_err(|e| required("cuDriverGetVersion", e))?;
    let get_error_name: Option<ErrorTextFn> = unsafe { lib.get::<ErrorTextFn>("cuGetErrorName") }
        .ok()
        .map(|s| *s);
    let get_error_string: Option<ErrorTextFn> =
        unsafe { lib.get::<ErrorTextFn>("cuGetErrorString") }
            .ok()
            .map(|s| *s);

    fn sym<T: Copy>(lib: &Library, name: &'static str) -> Sym<T> {
        // SAFETY: see above.
        let f = unsafe { lib.get::<T>(name) }
            .map(|s| *s)
            .map_err(|e| error_chain(&e));
        Sym { name, f }
    }

    // From here on the library's code has run: never unload it, whatever happens.
    // SAFETY: cuInit(0) is the driver's documented first call.
    let rc = unsafe { cu_init(0) };
    if rc != CUDA_SUCCESS {
        let name = error_name(get_error_name, rc);
        std::mem::forget(lib);
        return Err(GpuError::Driver {
            call: "cuInit",
            pid: None,
            code: rc,
            name,
        });
    }
    let mut version: c_int = 0;
    // SAFETY: writes one int through a live pointer.
    let rc = unsafe { get_version(&mut version) };
    if rc != CUDA_SUCCESS {
        let name = error_name(get_error_name, rc);
        std::mem::forget(lib);
        return Err(GpuError::Driver {
            call: "cuDriverGetVersion",
            pid: None,
            code: rc,
            name,
        });
    }
    let loaded = Loaded {
        driver_version: version,
        get_error_name,
        get_error_string,
        lock: sym(&lib, "cuCheckpointProcessLock"),
        checkpoint: sym(&lib, "cuCheckpointProcessCheckpoint"),
        restore: sym(&lib, "cuCheckpointProcessRestore"),
        unlock: sym(&lib, "cuCheckpointProcessUnlock"),
        get_state: sym(&lib, "cuCheckpointProcessGetState"),
        get_restore_tid: sym(&lib, "cuCheckpointProcessGetRestoreThreadId"),
        custom: custom::CustomApi::load(&lib),
        library,
        _lib: lib,
    };
    tracing::info!(
        driver_version = version,
        elapsed_ms = start.elapsed().as_millis() as u64,
        "cuInit done"
    );
    Ok(loaded)
}

#[cfg(test)]
mod tests {
    use std::mem::offset_of;

    use super::*;
    use crate::uuid::GpuUuid;

    #[test]
    fn struct_layouts() {
        assert_eq!(size_of::<CUcheckpointLockArgs>(), 64);
        assert_eq!(size_of::<CUcheckpointCheckpointArgs>(), 64);
        assert_eq!(size_of::<CUcheckpointUnlockArgs>(), 64);
        assert_eq!(size_of::<CUcheckpointRestoreArgs>(), 64);
        assert_eq!(size_of::<CUcheckpointGpuPair>(), 32);
        assert_eq!(offset_of!(CUcheckpointLockArgs, timeout_ms), 0);
        assert_eq!(offset_of!(CUcheckpointLockArgs, reserved0), 4);
        assert_eq!(offset_of!(CUcheckpointLockArgs, reserved1), 8);
        assert_eq!(offset_of!(CUcheckpointRestoreArgs, gpu_pairs), 0);
        assert_eq!(offset_of!(CUcheckpointRestoreArgs, gpu_pairs_count), 8);
        assert_eq!(offset_of!(CUcheckpointRestoreArgs, reserved0), 12);
        assert_eq!(offset_of!(CUcheckpointRestoreArgs, reserved1), 16);
        assert_eq!(offset_of!(CUcheckpointGpuPair, old_uuid), 0);
        assert_eq!(offset_of!(CUcheckpointGpuPair, new_uuid), 16);
        assert_eq!(std::mem::align_of::<CUcheckpointGpuPair>(), 1);
    }

    /// The bytes of a struct as the driver reads them.
    fn bytes_of<T>(v: &T) -> Vec<u8> {
        // SAFETY: every struct here is repr(C) without padding.
        unsafe { std::slice::from_raw_parts(v as *const T as *const u8, size_of::<T>()).to_vec() }
    }

    #[test]
    fn args_are_zero_filled() {
        assert!(bytes_of(&CUcheckpointCheckpointArgs::default())
            .iter()
            .all(|&b| b == 0));
        assert!(bytes_of(&CUcheckpointUnlockArgs::default())
            .iter()
            .all(|&b| b == 0));
        assert!(bytes_of(&CUcheckpointRestoreArgs::default())
            .iter()
            .all(|&b| b == 0));
        let lock = CUcheckpointLockArgs {
            timeout_ms: 0x0102_0304,
            ..Default::default()
        };
        let b = bytes_of(&lock);
        assert_eq!(&b[..4], &0x0102_0304u32.to_ne_bytes());
        assert!(b[4..].iter().all(|&x| x == 0));
        let pair = CUcheckpointGpuPair::from(&GpuPair {
            old: GpuUuid([1; 16]),
            new: GpuUuid([2; 16]),
        });
        let b = bytes_of(&pair);
        assert_eq!(&b[..16], &[1; 16]);
        assert_eq!(&b[16..], &[2; 16]);
    }

    fn u(n: u8) -> GpuUuid {
        GpuUuid([n; 16])
    }

    #[test]
    fn remap_gating() {
        let same = [
            GpuPair {
                old: u(1),
                new: u(1),
            },
            GpuPair {
                old: u(2),
                new: u(2),
            },
        ];
        let moved = [
            GpuPair {
                old: u(1),
                new: u(1),
            },
            GpuPair {
                old: u(2),
                new: u(3),
            },
        ];
        // 13.0+: everything is passed, identity pairs included.
        assert_eq!(restore_pairs(7, 13000, &moved).unwrap().len(), 2);
        assert_eq!(restore_pairs(7, 13020, &same).unwrap().len(), 2);
        assert_eq!(restore_pairs(7, 13000, &[]).unwrap().len(), 0);
        let passed = restore_pairs(7, 13000, &moved).unwrap();
        assert_eq!(passed[1].old_uuid, [2; 16]);
        assert_eq!(passed[1].new_uuid, [3; 16]);
        // 12.8: identity pairs dropped, a move refused.
        assert!(restore_pairs(7, 12080, &same).unwrap().is_empty());
        assert!(restore_pairs(7, 12090, &[]).unwrap().is_empty());
        let e = restore_pairs(7, 12080, &moved).unwrap_err();
        assert!(
            matches!(
                e,
                GpuError::NoRemap {
                    pid: 7,
                    driver_version: 12080,
                    ..
                }
            ),
            "{e}"
        );
        let msg = e.to_string();
        assert!(msg.contains("12.8"), "{msg}");
        assert!(msg.contains("no GPU remapping"), "{msg}");
        assert!(msg.contains("13.0"), "{msg}");
        assert!(msg.contains("580"), "{msg}");
        assert!(msg.contains(&format!("{}={}", u(2), u(3))), "{msg}");
        assert!(!msg.contains(&format!("{}={}", u(1), u(1))), "{msg}");
        assert!(restore_pairs(7, 12999, &moved).is_err());
    }

    #[test]
    fn timeouts() {
        assert_eq!(lock_timeout_ms(None).unwrap(), 0);
        assert_eq!(lock_timeout_ms(Some(Duration::ZERO)).unwrap(), 0);
        assert_eq!(lock_timeout_ms(Some(Duration::from_micros(1))).unwrap(), 1);
        assert_eq!(
            lock_timeout_ms(Some(Duration::from_millis(1500))).unwrap(),
            1500
        );
        assert!(lock_timeout_ms(Some(Duration::from_secs(u64::from(u32::MAX)))).is_err());
    }

    #[test]
    fn error_display() {
        let e = GpuError::Driver {
            call: "cuCheckpointProcessLock",
            pid: Some(1234),
            code: 909,
            name: error_name(None, 909),
        };
        assert_eq!(
            e.to_string(),
            "cuCheckpointProcessLock(pid 1234): CUDA_ERROR_TIMEOUT (909)"
        );
        let e = GpuError::Driver {
            call: "cuInit",
            pid: None,
            code: 100,
            name: error_name(None, 100),
        };
        assert_eq!(e.to_string(), "cuInit: CUDA_ERROR_NO_DEVICE (100)");
        assert_eq!(error_name(None, 401), "CUDA_ERROR_ILLEGAL_STATE");
        assert_eq!(error_name(None, 12345), "unknown CUresult");
        let e = GpuError::UnexpectedState {
            step: "restore",
            pid: 9,
            expected: ProcessState::LOCKED,
            actual: ProcessState::CHECKPOINTED,
        };
        assert_eq!(
            e.to_string(),
            "restore(pid 9): the driver reported success but the process is checkpointed, not locked"
        );
    }

    #[test]
    fn missing_library_is_no_driver() {
        let e = CudaDriver::load_from("/nonexistent/gpu-ckpt-test/libcuda.so.1").unwrap_err();
        assert!(matches!(e, GpuError::NoDriver { .. }), "{e}");
        assert!(e.to_string().starts_with("no NVIDIA driver"), "{e}");
        assert!(
            e.to_string()
                .contains("/nonexistent/gpu-ckpt-test/libcuda.so.1"),
            "{e}"
        );
    }

    #[test]
    fn missing_symbol_is_named() {
        // libc loads, but is no libcuda.
        let e = CudaDriver::load_from("libc.so.6").unwrap_err();
        match &e {
            GpuError::MissingSymbol {
                symbol, library, ..
            } => {
                assert_eq!(symbol, "cuInit");
                assert_eq!(library, "libc.so.6");
            }
            other => panic!("expected MissingSymbol, got {other}"),
        }
        assert!(e.to_string().contains("cuInit"), "{e}");
    }
}
