//! Custom storage (CUDA 13.4 and later): the driver maps a locked process's device memory into
//! this process, one contiguous range per GPU, and this module moves it between those ranges and
//! the checkpoint's own files, one thread per GPU, in large chunks through pinned buffers, with
//! direct I/O and BLAKE3 computed in the same pass.
//!
//! What the driver requires of the caller (NVIDIA's driver API reference, "CUDA Checkpointing"):
//! `cuInit` (done at load) and a retained primary context on every GPU a range is mapped on;
//! the copies on the stream each range comes with (a stream of that GPU's primary context);
//! then `cuCheckpointOperationComplete(handle)`, which synchronizes those streams, unmaps the
//! ranges and moves the target on (CHECKPOINTING → CHECKPOINTED, RESTORING → LOCKED). The
//! primary contexts are retained for one operation and released after it: a primary context
//! costs device memory on its GPU, which a restore onto that GPU may need.
//!
//! NVIDIA documents no way to abandon an operation: from CHECKPOINTING or RESTORING the only
//! call that moves the target is `cuCheckpointOperationComplete`. See [`CudaDriver::checkpoint_to`]
//! and [`CudaDriver::restore_from`] for what a failure leaves.

use std::ffi::{c_int, c_uint, c_void, CString};
use std::fs::File;
use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

use libloading::Library;

use super::{CUcheckpointGpuPair, CUresult, CudaDriver, PidFn};
use crate::error::GpuError;
use crate::state::ProcessState;
use crate::storage::DeviceMemoryFile;
use crate::uuid::{GpuPair, GpuUuid};

/// The first `cuDriverGetVersion` with custom storage (CUDA 13.4).
pub const CUSTOM_STORAGE_MIN_VERSION: i32 = 13040;

/// Bytes moved per copy and per write or read.
pub const CHUNK_BYTES: usize = 32 << 20;

/// Pinned buffers per GPU: the copy of one chunk overlaps the write (or read) of another, with
/// one to spare for the faster side.
const BUFFERS: usize = 3;

/// Direct I/O alignment (of buffers, offsets and lengths).
const ALIGN: usize = 4096;

/// `CUcheckpointCustomStoragePerDeviceData` (CUDA 13.4): 24 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUcheckpointCustomStoragePerDeviceData {
    /// `devPtr`: the range, mapped in this process.
    pub dev_ptr: u64,
    /// `size`.
    pub size: usize,
    /// `stream`: of the primary context of the range's GPU.
    pub stream: *mut c_void,
}

/// `CUcheckpointCustomStorageInfo` (CUDA 13.4), allocated and filled by the driver: 24 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUcheckpointCustomStorageInfo {
    /// `handle`, for `cuCheckpointOperationComplete`.
    pub handle: *mut c_void,
    /// `perDeviceData`: `deviceCount` entries.
    pub per_device_data: *mut CUcheckpointCustomStoragePerDeviceData,
    /// `deviceCount`.
    pub device_count: c_uint,
}

/// `CUcheckpointCheckpointArgs`, CUDA 13.4 layout: `customStorageInfo_out` at byte 0.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUcheckpointCheckpointArgsCustom {
    /// `customStorageInfo_out`.
    pub custom_storage_info_out: *mut *mut CUcheckpointCustomStorageInfo,
    pub reserved: [u8; 56],
}

/// `CUcheckpointRestoreArgs`, CUDA 13.4 layout: `gpuPairs` @0, `gpuPairsCount` @8, `padding0`
/// @12, `customStorageInfo_out` @16.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUcheckpointRestoreArgsCustom {
    pub gpu_pairs: *const CUcheckpointGpuPair,
    pub gpu_pairs_count: c_uint,
    pub padding0: c_uint,
    /// `customStorageInfo_out`.
    pub custom_storage_info_out: *mut *mut CUcheckpointCustomStorageInfo,
    pub reserved: [u8; 40],
}

const _: () = assert!(size_of::<CUcheckpointCustomStoragePerDeviceData>() == 24);
const _: () = assert!(size_of::<CUcheckpointCustomStorageInfo>() == 24);
const _: () = assert!(size_of::<CUcheckpointCheckpointArgsCustom>() == 64);
const _: () = assert!(size_of::<CUcheckpointRestoreArgsCustom>() == 64);

type CUcontext = *mut c_void;
type CUstream = *mut c_void;

type DeviceCountFn = unsafe extern "C" fn(*mut c_int) -> CUresult;
type DeviceGetFn = unsafe extern "C" fn(*mut c_int, c_int) -> CUresult;
type DeviceUuidFn = unsafe extern "C" fn(*mut [u8; 16], c_int) -> CUresult;
type RetainFn = unsafe extern "C" fn(*mut CUcontext, c_int) -> CUresult;
type ReleaseFn = unsafe extern "C" fn(c_int) -> CUresult;
type SetCurrentFn = unsafe extern "C" fn(CUcontext) -> CUresult;
type StreamCtxFn = unsafe extern "C" fn(CUstream, *mut CUcontext) -> CUresult;
type HostAllocFn = unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CUresult;
type FreeHostFn = unsafe extern "C" fn(*mut c_void) -> CUresult;
type DtoHAsyncFn = unsafe extern "C" fn(*mut c_void, u64, usize, CUstream) -> CUresult;
type HtoDAsyncFn = unsafe extern "C" fn(u64, *const c_void, usize, CUstream) -> CUresult;
type StreamSyncFn = unsafe extern "C" fn(CUstream) -> CUresult;
type CompleteFn = unsafe extern "C" fn(*mut c_void) -> CUresult;

/// The entry points custom storage needs beyond the checkpoint API's own.
pub(super) struct CustomApi {
    device_count: DeviceCountFn,
    device_get: DeviceGetFn,
    device_uuid: DeviceUuidFn,
    retain: RetainFn,
    release: ReleaseFn,
    set_current: SetCurrentFn,
    stream_ctx: StreamCtxFn,
    host_alloc: HostAllocFn,
    free_host: FreeHostFn,
    dtoh: DtoHAsyncFn,
    htod: HtoDAsyncFn,
    stream_sync: StreamSyncFn,
    complete: CompleteFn,
    checkpoint: PidFn<CUcheckpointCheckpointArgsCustom>,
    restore: PidFn<CUcheckpointRestoreArgsCustom>,
}

impl CustomApi {
    /// Resolves every entry point, or names the first one missing.
    pub(super) fn load(lib: &Library) -> Result<CustomApi, (String, String)> {
        fn get<T: Copy>(lib: &Library, names: &[&str]) -> Result<T, (String, String)> {
            let mut last = String::new();
            for name in names {
                // SAFETY: each type below is the C signature of the driver API's function.
                match unsafe { lib.get::<T>(name.as_bytes()) } {
                    Ok(s) => return Ok(*s),
                    Err(e) => last = super::error_chain(&e),
                }
            }
            Err((names.join(" / "), last))
        }
        Ok(CustomApi {
            device_count: get(lib, &["cuDeviceGetCount"])?,
            device_get: get(lib, &["cuDeviceGet"])?,
            device_uuid: get(lib, &["cuDeviceGetUuid_v2", "cuDeviceGetUuid"])?,
            retain: get(lib, &["cuDevicePrimaryCtxRetain"])?,
            release: get(
                lib,
                &["cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"],
            )?,
            set_current: get(lib, &["cuCtxSetCurrent"])?,
            stream_ctx: get(lib, &["cuStreamGetCtx"])?,
            host_alloc: get(lib, &["cuMemHostAlloc"])?,
            free_host: get(lib, &["cuMemFreeHost"])?,
            dtoh: get(lib, &["cuMemcpyDtoHAsync_v2"])?,
            htod: get(lib, &["cuMemcpyHtoDAsync_v2"])?,
            stream_sync: get(lib, &["cuStreamSynchronize"])?,
            complete: get(lib, &["cuCheckpointOperationComplete"])?,
            checkpoint: get(lib, &["cuCheckpointProcessCheckpoint"])?,
            restore: get(lib, &["cuCheckpointProcessRestore"])?,
        })
    }
}

/// One GPU's range of an operation, with the GPU it is mapped on.
#[derive(Debug, Clone, Copy)]
struct Range {
    dev_ptr: u64,
    size: u64,
    stream: usize,
    ctx: usize,
    gpu: GpuUuid,
}

/// The primary contexts this process retained for one operation; released when dropped.
struct Primaries<'a> {
    drv: &'a CudaDriver,
    api: &'a CustomApi,
    /// (device ordinal, context, UUID).
    held: Vec<(c_int, usize, GpuUuid)>,
}

impl<'a> Primaries<'a> {
    /// Retains the primary context of every GPU (`only`: of those GPUs, each of which must be
    /// on this node).
    fn retain(
        drv: &'a CudaDriver,
        api: &'a CustomApi,
        only: Option<&[GpuUuid]>,
    ) -> Result<Primaries<'a>, GpuError> {
        let mut p = Primaries {
            drv,
            api,
            held: Vec::new(),
        };
        let mut count: c_int = 0;
        // SAFETY: writes one int.
        drv.call("cuDeviceGetCount", None, || unsafe {
            (api.device_count)(&mut count)
        })?;
        for ordinal in 0..count {
            let mut dev: c_int = 0;
            // SAFETY: writes one CUdevice (an int).
            drv.call("cuDeviceGet", None, || unsafe {
                (api.device_get)(&mut dev, ordinal)
            })?;
            let mut uuid = [0u8; 16];
            // SAFETY: writes one CUuuid (16 bytes).
            drv.call("cuDeviceGetUuid", None, || unsafe {
                (api.device_uuid)(&mut uuid, dev)
            })?;
            let uuid = GpuUuid(uuid);
            if only.is_some_and(|o| !o.contains(&uuid)) {
                continue;
            }
            let mut ctx: CUcontext = std::ptr::null_mut();
            // SAFETY: writes one CUcontext.
            drv.call("cuDevicePrimaryCtxRetain", None, || unsafe {
                (api.retain)(&mut ctx, dev)
            })?;
            p.held.push((dev, ctx as usize, uuid));
        }
        if let Some(missing) = only
            .unwrap_or_default()
            .iter()
            .find(|u| !p.held.iter().any(|h| h.2 == **u))
        {
            return Err(GpuError::InvalidArgument(format!(
                "GPU {missing} is not on this node (or not visible to the driver)"
            )));
        }
        Ok(p)
    }

    /// The primary context and GPU a range's stream belongs to.
    fn of_stream(&self, stream: CUstream) -> Result<(usize, GpuUuid), GpuError> {
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: a stream the driver handed out; writes one CUcontext.
        self.drv.call("cuStreamGetCtx", None, || unsafe {
            (self.api.stream_ctx)(stream, &mut ctx)
        })?;
        self.held
            .iter()
            .find(|h| h.1 == ctx as usize)
            .map(|h| (h.1, h.2))
            .ok_or_else(|| {
                GpuError::InvalidArgument(format!(
                    "the driver mapped a range on a context ({:#x}) that is no retained primary context",
                    ctx as usize
                ))
            })
    }
}

impl Drop for Primaries<'_> {
    fn drop(&mut self) {
        for (dev, _, uuid) in &self.held {
            // SAFETY: releases a retain this struct made.
            let r = self.drv.call("cuDevicePrimaryCtxRelease", None, || unsafe {
                (self.api.release)(*dev)
            });
            if let Err(e) = r {
                tracing::warn!(gpu = %uuid, error = %e, "release the primary context");
            }
        }
    }
}

/// A pinned host buffer (`cuMemHostAlloc`), page-aligned for direct I/O.
struct Pinned<'a> {
    drv: &'a CudaDriver,
    api: &'a CustomApi,
    ptr: *mut u8,
    len: usize,
}

impl<'a> Pinned<'a> {
    fn alloc(drv: &'a CudaDriver, api: &'a CustomApi, len: usize) -> Result<Self, GpuError> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer to `len` bytes of host memory.
        drv.call("cuMemHostAlloc", None, || unsafe {
            (api.host_alloc)(&mut p, len, 0)
        })?;
        let b = Pinned {
            drv,
            api,
            ptr: p.cast(),
            len,
        };
        if p.is_null() || !(p as usize).is_multiple_of(ALIGN) {
            return Err(GpuError::InvalidArgument(format!(
                "cuMemHostAlloc gave {p:?}, not a {ALIGN}-byte aligned buffer"
            )));
        }
        Ok(b)
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes the driver allocated for this buffer alone.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Pinned<'_> {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return;
        }
        // SAFETY: frees a buffer cuMemHostAlloc gave; no copy into it is in flight (every
        // user synchronizes its stream before dropping).
        let r = self.drv.call("cuMemFreeHost", None, || unsafe {
            (self.api.free_host)(self.ptr.cast())
        });
        if let Err(e) = r {
            tracing::warn!(error = %e, "free a pinned buffer");
        }
    }
}

/// The checkpoint's directory, opened once; its files are reached through the handle only.
struct Dir {
    fd: OwnedFd,
    shown: String,
}

impl Dir {
    fn open(path: &Path) -> Result<Dir, GpuError> {
        let shown = path.display().to_string();
        let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| {
            GpuError::InvalidArgument(format!("directory {shown:?} has a NUL byte"))
        })?;
        let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        // SAFETY: a NUL-terminated path; returns a new descriptor or -1.
        let fd = unsafe { libc::open(c.as_ptr(), flags) };
        if fd < 0 {
            return Err(GpuError::Storage {
                file: shown,
                reason: format!("open the directory: {}", io::Error::last_os_error()),
            });
        }
        // SAFETY: a new descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Dir { fd, shown })
    }

    fn path_of(&self, name: &str) -> String {
        format!("{}/{name}", self.shown)
    }

    fn err(&self, name: &str, what: &str, e: io::Error) -> GpuError {
        GpuError::Storage {
            file: self.path_of(name),
            reason: format!("{what}: {e}"),
        }
    }

    /// `openat` of `name` with `flags`: the file and whether it is open for direct I/O (a
    /// filesystem without it, such as tmpfs on older kernels, gets buffered I/O).
    fn open_at(&self, name: &str, flags: c_int, what: &str) -> Result<(File, bool), GpuError> {
        let c = flat_name(name)?;
        let base = flags | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        for direct in [true, false] {
            let f = if direct { base | libc::O_DIRECT } else { base };
            // SAFETY: openat on a directory descriptor this struct owns and a flat name.
            let fd = unsafe { libc::openat(self.fd.as_raw_fd(), c.as_ptr(), f, 0o600) };
            if fd >= 0 {
                // SAFETY: a new descriptor nothing else owns.
                return Ok((unsafe { File::from_raw_fd(fd) }, direct));
            }
            let e = io::Error::last_os_error();
            if !(direct && e.raw_os_error() == Some(libc::EINVAL)) {
                return Err(self.err(name, what, e));
            }
            // O_DIRECT refused: Linux creates the file before it checks O_DIRECT, so a new file
            // (O_EXCL: it cannot have been there) is removed before the buffered retry.
            if flags & libc::O_CREAT != 0 {
                self.remove(name);
            }
            tracing::debug!(file = %self.path_of(name), "no direct I/O here: buffered");
        }
        unreachable!("the buffered open returns")
    }

    fn create(&self, name: &str) -> Result<(File, bool), GpuError> {
        let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL;
        self.open_at(name, flags, "create")
    }

    /// A regular file opened for reading: O_NONBLOCK, so that a FIFO put in a file's place
    /// cannot hold the open, and the type checked on the descriptor before a byte is read.
    fn open_read(&self, name: &str) -> Result<(File, bool), GpuError> {
        let (f, direct) = self.open_at(name, libc::O_RDONLY | libc::O_NONBLOCK, "open")?;
        let meta = f.metadata().map_err(|e| self.err(name, "fstat", e))?;
        if !meta.file_type().is_file() {
            return Err(self.err(
                name,
                "open",
                io::Error::new(io::ErrorKind::InvalidData, "not a regular file"),
            ));
        }
        Ok((f, direct))
    }

    /// Whether `name` exists in the directory (a link counts; it is not followed).
    fn exists(&self, name: &str) -> Result<bool, GpuError> {
        let c = flat_name(name)?;
        // SAFETY: an all-zero `stat` is a valid buffer for fstatat to fill.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstatat on a directory descriptor this struct owns and a flat name.
        let r = unsafe {
            libc::fstatat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                &mut st,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        if r == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENOENT) => Ok(false),
            _ => Err(self.err(name, "stat", e)),
        }
    }

    fn remove(&self, name: &str) {
        let Ok(c) = flat_name(name) else { return };
        // SAFETY: unlinkat on a directory descriptor this struct owns and a flat name.
        if unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), 0) } != 0 {
            let e = io::Error::last_os_error();
            tracing::warn!(file = %self.path_of(name), error = %e, "remove a partial device-memory file");
        }
    }

    fn sync(&self) -> Result<(), GpuError> {
        // SAFETY: fsync of a descriptor this struct owns.
        if unsafe { libc::fsync(self.fd.as_raw_fd()) } != 0 {
            return Err(GpuError::Storage {
                file: self.shown.clone(),
                reason: format!("fsync the directory: {}", io::Error::last_os_error()),
            });
        }
        Ok(())
    }
}

/// A file name in the directory: not empty, no `/`, not `.` or `..`.
fn flat_name(name: &str) -> Result<CString, GpuError> {
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return Err(GpuError::InvalidArgument(format!(
            "{name:?} is not a file name in the checkpoint's directory"
        )));
    }
    CString::new(name)
        .map_err(|_| GpuError::InvalidArgument(format!("file name {name:?} has a NUL byte")))
}

/// Reserves `size` bytes for a new file: a full filesystem fails here, before any byte moves.
fn reserve(file: &File, size: u64) -> io::Result<()> {
    if size == 0 {
        return Ok(());
    }
    let len = libc::off_t::try_from(size).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    // SAFETY: fallocate on a descriptor the caller owns.
    if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) } == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        // A filesystem that cannot preallocate: space is found as the bytes are written.
        Some(libc::EOPNOTSUPP) => Ok(()),
        _ => Err(e),
    }
}

/// The chunks of a range of `size` bytes: (offset, length).
fn chunks(size: u64, chunk: usize) -> impl Iterator<Item = (u64, usize)> {
    let chunk = chunk as u64;
    (0..size.div_ceil(chunk)).map(move |k| {
        let off = k * chunk;
        (off, (size - off).min(chunk) as usize)
    })
}

/// The buffer size for a range: a chunk, or the whole range rounded up to the alignment.
fn buffer_len(size: u64) -> usize {
    let n = (size as usize).clamp(1, CHUNK_BYTES);
    n.div_ceil(ALIGN) * ALIGN
}

/// The operation the driver started: its handle and ranges, each with its GPU.
struct Operation {
    handle: usize,
    ranges: Vec<Range>,
}

impl Operation {
    /// Reads the driver's `CUcheckpointCustomStorageInfo`.
    fn read(info: *mut CUcheckpointCustomStorageInfo, prim: &Primaries) -> Result<Self, GpuError> {
        if info.is_null() {
            return Err(GpuError::InvalidArgument(
                "the driver returned no custom-storage information".into(),
            ));
        }
        // SAFETY: the driver allocated and filled the struct; it stays valid until the
        // operation completes.
        let info = unsafe { *info };
        let per: &[CUcheckpointCustomStoragePerDeviceData] = if info.device_count == 0
            || info.per_device_data.is_null()
        {
            &[]
        } else {
            // SAFETY: `deviceCount` entries at `perDeviceData`, the driver's.
            unsafe { std::slice::from_raw_parts(info.per_device_data, info.device_count as usize) }
        };
        let mut ranges = Vec::with_capacity(per.len());
        for p in per {
            let (ctx, gpu) = prim.of_stream(p.stream)?;
            ranges.push(Range {
                dev_ptr: p.dev_ptr,
                size: p.size as u64,
                stream: p.stream as usize,
                ctx,
                gpu,
            });
        }
        Ok(Operation {
            handle: info.handle as usize,
            ranges,
        })
    }
}

impl CudaDriver {
    /// Whether this driver has custom storage: CUDA 13.4 or later, and every entry point the
    /// copies need.
    pub(super) fn has_custom_storage(&self) -> bool {
        self.loaded.driver_version >= CUSTOM_STORAGE_MIN_VERSION && self.loaded.custom.is_ok()
    }

    fn custom_api(&self, step: &str, pid: i32) -> Result<&CustomApi, GpuError> {
        if self.loaded.driver_version < CUSTOM_STORAGE_MIN_VERSION {
            return Err(GpuError::InvalidArgument(format!(
                "{step}(pid {pid}): the driver (CUDA {}) has no custom storage (needs CUDA 13.4)",
                super::CudaVersion(self.loaded.driver_version)
            )));
        }
        self.loaded
            .custom
            .as_ref()
            .map_err(|(symbol, reason)| GpuError::MissingSymbol {
                library: self.loaded.library.clone(),
                symbol: symbol.clone(),
                reason: reason.clone(),
            })
    }

    /// `cuCheckpointOperationComplete`, then the state read back.
    fn complete(
        &self,
        api: &CustomApi,
        step: &'static str,
        pid: i32,
        handle: usize,
        expected: ProcessState,
    ) -> Result<(), GpuError> {
        // SAFETY: the handle the driver gave for this operation, completed once.
        self.call("cuCheckpointOperationComplete", Some(pid), || unsafe {
            (api.complete)(handle as *mut c_void)
        })?;
        self.expect_state(step, pid, expected)
    }

    /// LOCKED → CHECKPOINTED through files: see [`crate::DeviceCheckpoint::checkpoint_to`].
    ///
    /// What a failure leaves:
    /// - before or in `cuCheckpointProcessCheckpoint` (a bad `prefix` or `dir`, a file name
    ///   already taken, no primary context, the driver's refusal): the process LOCKED, nothing
    ///   written;
    /// - once the driver has mapped the ranges (the process CHECKPOINTING, its device memory
    ///   held only in the ranges mapped here): a file that cannot be created or reserved to its
    ///   full size (ENOSPC comes here, before any byte moves), a copy or write or sync that
    ///   fails: every file this call created is removed, and the device memory goes back to the
    ///   process through this process's memory (see `rescue`), leaving it LOCKED as before the
    ///   call, for the caller's undo (unlock). NVIDIA's API has no abort, and what the driver
    ///   does with a target whose caller goes away is not documented: if that way back fails
    ///   too (no memory for the bytes, a driver error), the process is left where it stopped
    ///   (CHECKPOINTING, or CHECKPOINTED or RESTORING on the way back), logged, and cannot be
    ///   resumed: the caller kills it. The error returned is the first one, in every case.
    /// - `cuCheckpointOperationComplete` failing, or the state read back not CHECKPOINTED:
    ///   that error, the files removed.
    pub(super) fn custom_checkpoint(
        &self,
        pid: i32,
        gpus: &[GpuUuid],
        dir: &Path,
        prefix: &str,
    ) -> Result<Vec<DeviceMemoryFile>, GpuError> {
        let _span = tracing::info_span!("cuda_checkpoint_to", pid, dir = %dir.display()).entered();
        let start = Instant::now();
        let api = self.custom_api("checkpoint_to", pid)?;
        flat_name(&format!("{prefix}-0.bin"))?;
        let dir = Dir::open(dir)?;
        // The process's GPUs only: a context on another tenant's GPU costs it memory, and on
        // an exclusive-process GPU would keep its processes out (or fail here).
        let prim = Primaries::retain(self, api, (!gpus.is_empty()).then_some(gpus))?;
        // At most one range per GPU: a name already taken is refused while the process is
        // still LOCKED (O_EXCL below refuses it anyway, but by then the driver has mapped it).
        for n in 0..prim.held.len() {
            let name = format!("{prefix}-{n}.bin");
            if dir.exists(&name)? {
                return Err(GpuError::Storage {
                    file: dir.path_of(&name),
                    reason: "already exists".into(),
                });
            }
        }
        let mut info: *mut CUcheckpointCustomStorageInfo = std::ptr::null_mut();
        let mut args = CUcheckpointCheckpointArgsCustom {
            custom_storage_info_out: &mut info,
            reserved: [0; 56],
        };
        // SAFETY: the 13.4 layout, zero but for the out pointer, which outlives the call.
        self.call("cuCheckpointProcessCheckpoint", Some(pid), || unsafe {
            (api.checkpoint)(pid, &mut args)
        })?;
        let op = Operation::read(info, &prim)?;
        let names: Vec<String> = (0..op.ranges.len())
            .map(|n| format!("{prefix}-{n}.bin"))
            .collect();
        let mut created: Vec<&str> = Vec::new();
        let written = self
            .write_ranges(api, pid, &dir, &op, &names, &mut created)
            .and_then(|f| dir.sync().map(|_| f));
        let files = match written {
            Ok(f) => f,
            Err(e) => {
                for name in created {
                    dir.remove(name);
                }
                tracing::warn!(error = %e, "checkpoint to files failed: the device memory goes back");
                match self.rescue(api, pid, &prim, &op) {
                    Ok(()) => tracing::info!("the process is locked with its device memory"),
                    Err(r) => {
                        tracing::warn!(error = %r, "the device memory could not go back");
                    }
                }
                return Err(e);
            }
        };
        if let Err(e) = self.complete(
            api,
            "checkpoint_to",
            pid,
            op.handle,
            ProcessState::CHECKPOINTED,
        ) {
            for f in &files {
                dir.remove(&f.name);
            }
            return Err(e);
        }
        let bytes: u64 = files.iter().map(|f| f.size).sum();
        tracing::info!(
            elapsed_ms = start.elapsed().as_millis() as u64,
            bytes,
            files = files.len(),
            "checkpointed to files"
        );
        Ok(files)
    }

    /// After a failure between the driver's mapping and the completion of a checkpoint: the
    /// process back to LOCKED with its device memory, held meanwhile in this process's memory
    /// (NVIDIA's API has no abort): every range copied here, the checkpoint completed
    /// (CHECKPOINTED), a custom-storage restore onto the same GPUs (RESTORING), the bytes copied
    /// back, completed (LOCKED). Fails, leaving the process where that step left it, when the
    /// memory cannot be had or a call fails.
    fn rescue(
        &self,
        api: &CustomApi,
        pid: i32,
        prim: &Primaries,
        op: &Operation,
    ) -> Result<(), GpuError> {
        let _span = tracing::info_span!("rescue", pid).entered();
        let mut saved: Vec<Vec<u8>> = Vec::with_capacity(op.ranges.len());
        for r in &op.ranges {
            let mut v: Vec<u8> = Vec::new();
            v.try_reserve_exact(r.size as usize).map_err(|e| {
                GpuError::InvalidArgument(format!(
                    "no memory to hold {} bytes of device memory: {e}",
                    r.size
                ))
            })?;
            v.resize(r.size as usize, 0);
            self.copy_range(api, pid, r, v.as_mut_ptr().cast(), true)?;
            saved.push(v);
        }
        self.complete(
            api,
            "checkpoint_to",
            pid,
            op.handle,
            ProcessState::CHECKPOINTED,
        )?;
        let back = self.start_restore(api, pid, &[], prim)?;
        for r in &back.ranges {
            let i = op
                .ranges
                .iter()
                .position(|o| o.gpu == r.gpu && o.size == r.size)
                .ok_or_else(|| {
                    GpuError::InvalidArgument(format!(
                        "the restore mapped {} bytes on GPU {}, which the checkpoint did not",
                        r.size, r.gpu
                    ))
                })?;
            self.copy_range(api, pid, r, saved[i].as_mut_ptr().cast(), false)?;
        }
        self.complete(api, "checkpoint_to", pid, back.handle, ProcessState::LOCKED)
    }

    /// `cuCheckpointProcessRestore` with custom storage (the process RESTORING): the operation
    /// it started.
    fn start_restore(
        &self,
        api: &CustomApi,
        pid: i32,
        c_pairs: &[CUcheckpointGpuPair],
        prim: &Primaries,
    ) -> Result<Operation, GpuError> {
        let (gpu_pairs, gpu_pairs_count) = super::pairs_arg(c_pairs)?;
        let mut info: *mut CUcheckpointCustomStorageInfo = std::ptr::null_mut();
        let mut args = CUcheckpointRestoreArgsCustom {
            gpu_pairs,
            gpu_pairs_count,
            padding0: 0,
            custom_storage_info_out: &mut info,
            reserved: [0; 40],
        };
        // SAFETY: the 13.4 layout; the pairs and the out pointer outlive the call.
        self.call("cuCheckpointProcessRestore", Some(pid), || unsafe {
            (api.restore)(pid, &mut args)
        })?;
        Operation::read(info, prim)
    }

    /// A whole range to (`out`) or from host memory at `host`, on its stream, synchronized.
    fn copy_range(
        &self,
        api: &CustomApi,
        pid: i32,
        r: &Range,
        host: *mut c_void,
        out: bool,
    ) -> Result<(), GpuError> {
        let stream = r.stream as CUstream;
        let n = r.size as usize;
        // SAFETY: a retained primary context, made current on this thread; `n` bytes between
        // the mapped range and `n` bytes at `host`, the caller's; the stream synchronized
        // before `host` is touched again.
        self.call("cuCtxSetCurrent", None, || unsafe {
            (api.set_current)(r.ctx as CUcontext)
        })?;
        if out {
            self.call("cuMemcpyDtoHAsync", Some(pid), || unsafe {
                (api.dtoh)(host, r.dev_ptr, n, stream)
            })?;
        } else {
            self.call("cuMemcpyHtoDAsync", Some(pid), || unsafe {
                (api.htod)(r.dev_ptr, host, n, stream)
            })?;
        }
        self.call("cuStreamSynchronize", Some(pid), || unsafe {
            (api.stream_sync)(stream)
        })
    }

    /// Creates and reserves every file, then writes each range to its file, one thread per GPU.
    fn write_ranges<'n>(
        &self,
        api: &CustomApi,
        pid: i32,
        dir: &Dir,
        op: &Operation,
        names: &'n [String],
        created: &mut Vec<&'n str>,
    ) -> Result<Vec<DeviceMemoryFile>, GpuError> {
        let mut files = Vec::with_capacity(names.len());
        for (r, name) in op.ranges.iter().zip(names) {
            let (file, direct) = dir.create(name)?;
            created.push(name);
            reserve(&file, r.size).map_err(|e| dir.err(name, "reserve", e))?;
            files.push((file, direct));
        }
        let results: Vec<Result<String, GpuError>> = std::thread::scope(|s| {
            let threads: Vec<_> = op
                .ranges
                .iter()
                .zip(files)
                .zip(names)
                .map(|((r, (file, direct)), name)| {
                    s.spawn(move || self.save_range(api, pid, r, file, direct, dir, name))
                })
                .collect();
            joined(threads)
        });
        let mut out = Vec::with_capacity(results.len());
        for ((r, name), hash) in op.ranges.iter().zip(names).zip(results) {
            out.push(DeviceMemoryFile {
                gpu: r.gpu,
                name: name.clone(),
                size: r.size,
                blake3: hash?,
            });
        }
        Ok(out)
    }

    /// On a copy thread: the range's context made current, and its pinned buffers.
    fn buffers_for<'a>(
        &'a self,
        api: &'a CustomApi,
        r: &Range,
    ) -> Result<Vec<Pinned<'a>>, GpuError> {
        // SAFETY: a retained primary context, made current on this thread.
        self.call("cuCtxSetCurrent", None, || unsafe {
            (api.set_current)(r.ctx as CUcontext)
        })?;
        let len = buffer_len(r.size);
        (0..BUFFERS)
            .map(|_| Pinned::alloc(self, api, len))
            .collect()
    }

    /// One range to its file. This thread copies chunk k+1 out of the range while a second one
    /// hashes and writes chunk k (the hash beside the write), so the copy, the hash and the
    /// disk overlap whether or not the driver's copy returns before it is done.
    #[allow(clippy::too_many_arguments)]
    fn save_range(
        &self,
        api: &CustomApi,
        pid: i32,
        r: &Range,
        file: File,
        direct: bool,
        dir: &Dir,
        name: &str,
    ) -> Result<String, GpuError> {
        let _span = tracing::info_span!("save_range", pid, gpu = %r.gpu, bytes = r.size).entered();
        let mut bufs = self.buffers_for(api, r)?;
        let mut hasher = blake3::Hasher::new();
        let plan: Vec<(u64, usize)> = chunks(r.size, CHUNK_BYTES).collect();
        let stream = r.stream as CUstream;
        let sync = || {
            // SAFETY: a stream of the operation.
            self.call("cuStreamSynchronize", Some(pid), || unsafe {
                (api.stream_sync)(stream)
            })
        };
        let copy_out = |k: usize, buf: &mut [u8]| {
            let (off, n) = plan[k];
            let dst = buf.as_mut_ptr().cast::<c_void>();
            // SAFETY: `n` bytes of the mapped range into a pinned buffer of at least `n`,
            // synchronized before the buffer is handed on.
            self.call("cuMemcpyDtoHAsync", Some(pid), || unsafe {
                (api.dtoh)(dst, r.dev_ptr + off, n, stream)
            })?;
            sync()
        };
        let hash_and_write = |k: usize, buf: &mut [u8]| {
            let (off, n) = plan[k];
            let end = pad(buf, n, direct);
            let buf = &buf[..end];
            std::thread::scope(|s| {
                let hashed = s.spawn(|| {
                    hasher.update(&buf[..n]);
                });
                let written = file.write_all_at(buf, off);
                let _ = hashed.join();
                written
            })
            .map_err(|e| dir.err(name, "write", e))
        };
        let result = pipeline(&mut bufs, plan.len(), Side::Fills, copy_out, hash_and_write);
        // Nothing may still be copying into the buffers when they are freed.
        let drained = sync();
        result?;
        drained?;
        cut_padding(&file, r.size, direct).map_err(|e| dir.err(name, "truncate", e))?;
        file.sync_data()
            .map_err(|e| dir.err(name, "fdatasync", e))?;
        Ok(hasher.finalize().to_hex().to_string())
    }

    /// CHECKPOINTED → LOCKED from files: see [`crate::DeviceCheckpoint::restore_from`].
    ///
    /// Every file is opened and its size checked against `files` before the driver is called:
    /// a missing or short file leaves the process CHECKPOINTED. After
    /// `cuCheckpointProcessRestore` (the process RESTORING, its allocations back and empty):
    /// ranges that do not match the files, a read that fails, or a file whose BLAKE3 differs
    /// from its entry fail the call naming the file, and the operation is not completed, so the
    /// process stays RESTORING and never runs on those bytes (the caller kills it).
    pub(super) fn custom_restore(
        &self,
        pid: i32,
        dir: &Path,
        files: &[DeviceMemoryFile],
        pairs: &[GpuPair],
    ) -> Result<(), GpuError> {
        let _span =
            tracing::info_span!("cuda_restore_from", pid, dir = %dir.display(), files = files.len())
                .entered();
        let start = Instant::now();
        let api = self.custom_api("restore_from", pid)?;
        let c_pairs = super::restore_pairs(pid, self.loaded.driver_version, pairs)?;
        let dir = Dir::open(dir)?;
        let opened = open_files(&dir, files)?;
        // The GPU each file's range goes to: its checkpointed GPU, or the new one a pair names.
        let targets: Vec<GpuUuid> = files
            .iter()
            .map(|f| {
                pairs
                    .iter()
                    .find(|p| p.old == f.gpu)
                    .map_or(f.gpu, |p| p.new)
            })
            .collect();
        let prim = Primaries::retain(self, api, Some(&targets))?;
        let op = self.start_restore(api, pid, &c_pairs, &prim)?;
        let order = match_files(&op.ranges, files, &targets)?;
        let results: Vec<Result<(), GpuError>> = std::thread::scope(|s| {
            let threads: Vec<_> = op
                .ranges
                .iter()
                .zip(&order)
                .map(|(r, &i)| {
                    let (file, direct) = &opened[i];
                    let (f, dir) = (&files[i], &dir);
                    s.spawn(move || self.load_range(api, pid, r, file, *direct, dir, f))
                })
                .collect();
            joined(threads)
        });
        for r in results {
            r?;
        }
        self.complete(api, "restore_from", pid, op.handle, ProcessState::LOCKED)?;
        tracing::info!(
            elapsed_ms = start.elapsed().as_millis() as u64,
            bytes = files.iter().map(|f| f.size).sum::<u64>(),
            "restored from files"
        );
        Ok(())
    }

    /// One file into its range. A second thread reads chunk k+1 from the file while this one
    /// copies chunk k into the range and hashes it (the hash beside the copy).
    #[allow(clippy::too_many_arguments)]
    fn load_range(
        &self,
        api: &CustomApi,
        pid: i32,
        r: &Range,
        file: &File,
        direct: bool,
        dir: &Dir,
        f: &DeviceMemoryFile,
    ) -> Result<(), GpuError> {
        let _span = tracing::info_span!("load_range", pid, gpu = %r.gpu, bytes = r.size).entered();
        let mut bufs = self.buffers_for(api, r)?;
        let stream = r.stream as CUstream;
        let sync = || {
            // SAFETY: a stream of the operation.
            self.call("cuStreamSynchronize", Some(pid), || unsafe {
                (api.stream_sync)(stream)
            })
        };
        let plan: Vec<(u64, usize)> = chunks(r.size, CHUNK_BYTES).collect();
        let mut hasher = blake3::Hasher::new();
        let read = |k: usize, buf: &mut [u8]| {
            let (off, n) = plan[k];
            // Direct I/O reads whole blocks; the last one comes back short at the end.
            let want = if direct { n.div_ceil(ALIGN) * ALIGN } else { n };
            read_full_at(file, &mut buf[..want], off, n).map_err(|e| dir.err(&f.name, "read", e))
        };
        let copy_in = |k: usize, buf: &mut [u8]| {
            let (off, n) = plan[k];
            let buf = &buf[..n];
            std::thread::scope(|s| {
                let hashed = s.spawn(|| {
                    hasher.update(buf);
                });
                let src = buf.as_ptr().cast::<c_void>();
                // SAFETY: `n` bytes of a pinned buffer into the mapped range, synchronized
                // before the buffer is handed back.
                let copied = self
                    .call("cuMemcpyHtoDAsync", Some(pid), || unsafe {
                        (api.htod)(r.dev_ptr + off, src, n, stream)
                    })
                    .and_then(|()| sync());
                let _ = hashed.join();
                copied
            })
        };
        let result = pipeline(&mut bufs, plan.len(), Side::Takes, copy_in, read);
        let drained = sync();
        result?;
        drained?;
        let actual = hasher.finalize().to_hex().to_string();
        if actual != f.blake3 {
            return Err(GpuError::Corrupt {
                file: dir.path_of(&f.name),
                expected: f.blake3.clone(),
                actual,
            });
        }
        Ok(())
    }
}

/// The length to write of a chunk of `n` bytes in `buf`: direct I/O writes whole blocks, the
/// last one zero-padded in `buf` (which has room for it) and cut back by [`cut_padding`].
fn pad(buf: &mut [u8], n: usize, direct: bool) -> usize {
    let end = if direct { n.div_ceil(ALIGN) * ALIGN } else { n };
    buf[n..end].fill(0);
    end
}

/// Which of a [`pipeline`]'s two steps runs on the calling thread: the one that makes driver
/// calls, in the context the calling thread has made current.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    /// The calling thread fills the buffers; a second one takes them.
    Fills,
    /// A second thread fills the buffers; the calling thread takes them.
    Takes,
}

/// A pinned buffer handed between the two threads of a [`pipeline`].
struct Slot(*mut u8, usize);

// SAFETY: a slot is used by one thread at a time: the one that received it from the channel.
unsafe impl Send for Slot {}

type Free = std::sync::mpsc::Receiver<Slot>;
type Full = std::sync::mpsc::Sender<(usize, Slot)>;

/// Moves `count` chunks through `bufs` between two threads: one fills chunk k into a free
/// buffer, the other takes it, and the buffer goes back. With two or more buffers one chunk is
/// filled while another is taken. `here` (on this thread) fills or takes as `side` says;
/// `there` (on a second thread) does the other. The first error stops both and is returned.
fn pipeline<H, T>(
    bufs: &mut [Pinned],
    count: usize,
    side: Side,
    here: H,
    there: T,
) -> Result<(), GpuError>
where
    H: FnMut(usize, &mut [u8]) -> Result<(), GpuError>,
    T: FnMut(usize, &mut [u8]) -> Result<(), GpuError> + Send,
{
    use std::sync::mpsc::channel;
    let (free_tx, free_rx) = channel::<Slot>();
    let (full_tx, full_rx) = channel::<(usize, Slot)>();
    for b in bufs.iter_mut() {
        let bytes = b.bytes();
        let _ = free_tx.send(Slot(bytes.as_mut_ptr(), bytes.len()));
    }
    std::thread::scope(|s| match side {
        Side::Fills => {
            let other = s.spawn(move || take_all(there, full_rx, free_tx));
            let filled = fill_all(here, count, free_rx, full_tx);
            filled.and(join_one(other))
        }
        Side::Takes => {
            let other = s.spawn(move || fill_all(there, count, free_rx, full_tx));
            let taken = take_all(here, full_rx, free_tx);
            join_one(other).and(taken)
        }
    })
}

/// The filling side of a [`pipeline`]; a closed channel means the other side stopped on an
/// error, which it returns.
fn fill_all(
    mut fill: impl FnMut(usize, &mut [u8]) -> Result<(), GpuError>,
    count: usize,
    free: Free,
    full: Full,
) -> Result<(), GpuError> {
    for k in 0..count {
        let Ok(Slot(p, len)) = free.recv() else {
            return Ok(());
        };
        // SAFETY: the buffer came back from the taking side, which no longer touches it.
        fill(k, unsafe { std::slice::from_raw_parts_mut(p, len) })?;
        if full.send((k, Slot(p, len))).is_err() {
            return Ok(());
        }
    }
    Ok(())
}

/// The taking side of a [`pipeline`]: until the filling side is done (or stopped).
fn take_all(
    mut take: impl FnMut(usize, &mut [u8]) -> Result<(), GpuError>,
    full: std::sync::mpsc::Receiver<(usize, Slot)>,
    free: std::sync::mpsc::Sender<Slot>,
) -> Result<(), GpuError> {
    while let Ok((k, Slot(p, len))) = full.recv() {
        // SAFETY: the buffer came from the filling side, which no longer touches it.
        take(k, unsafe { std::slice::from_raw_parts_mut(p, len) })?;
        let _ = free.send(Slot(p, len));
    }
    Ok(())
}

/// A file written in chunks [`pad`]ded to whole blocks, cut back to its `size`.
fn cut_padding(file: &File, size: u64, direct: bool) -> io::Result<()> {
    if direct && !size.is_multiple_of(ALIGN as u64) {
        file.set_len(size)?;
    }
    Ok(())
}

/// The results of copy threads, in their order.
fn joined<T>(
    threads: Vec<std::thread::ScopedJoinHandle<'_, Result<T, GpuError>>>,
) -> Vec<Result<T, GpuError>> {
    threads.into_iter().map(join_one).collect()
}

/// The result of one copy thread; a panic is an error.
fn join_one<T>(t: std::thread::ScopedJoinHandle<'_, Result<T, GpuError>>) -> Result<T, GpuError> {
    t.join()
        .unwrap_or_else(|_| Err(GpuError::InvalidArgument("a copy thread panicked".into())))
}

/// Every file of a restore opened, and its size checked against its entry.
fn open_files(dir: &Dir, files: &[DeviceMemoryFile]) -> Result<Vec<(File, bool)>, GpuError> {
    files
        .iter()
        .map(|f| {
            let (file, direct) = dir.open_read(&f.name)?;
            let len = file
                .metadata()
                .map_err(|e| dir.err(&f.name, "stat", e))?
                .len();
            if len != f.size {
                return Err(GpuError::Storage {
                    file: dir.path_of(&f.name),
                    reason: format!("{len} bytes, the checkpoint recorded {}", f.size),
                });
            }
            Ok((file, direct))
        })
        .collect()
}

/// Reads at least `need` bytes at `off` into `buf` (more may come, up to its length).
fn read_full_at(file: &File, buf: &mut [u8], off: u64, need: usize) -> io::Result<()> {
    let mut got = 0;
    while got < need {
        match file.read_at(&mut buf[got..], off + got as u64) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("{got} of {need} bytes at offset {off}"),
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Which file fills each range: range `i` gets the file whose GPU, after the pairs
/// (`targets[j]` for file `j`), is the GPU range `i` is mapped on, and it must have the range's
/// size. The driver gives one range per GPU (in the checkpoint's order on the simulator and, as
/// far as NVIDIA says, in no documented order), so the GPU identifies the file; the size
/// confirms it. Any range without its file, or file without its range, is refused.
fn match_files(
    ranges: &[Range],
    files: &[DeviceMemoryFile],
    targets: &[GpuUuid],
) -> Result<Vec<usize>, GpuError> {
    if ranges.len() != files.len() {
        return Err(GpuError::InvalidArgument(format!(
            "the driver mapped {} device-memory ranges, the checkpoint has {} files",
            ranges.len(),
            files.len()
        )));
    }
    let mut order = Vec::with_capacity(ranges.len());
    for r in ranges {
        let i = targets
            .iter()
            .position(|t| *t == r.gpu)
            .filter(|i| !order.contains(i))
            .ok_or_else(|| {
                GpuError::InvalidArgument(format!(
                    "the driver mapped a range on GPU {} that no device-memory file maps to",
                    r.gpu
                ))
            })?;
        if files[i].size != r.size {
            return Err(GpuError::InvalidArgument(format!(
                "the range on GPU {} is {} bytes, its file {} holds {}",
                r.gpu, r.size, files[i].name, files[i].size
            )));
        }
        order.push(i);
    }
    Ok(order)
}

#[cfg(test)]
mod tests {
    use std::mem::offset_of;

    use super::*;

    #[test]
    fn layouts_of_cuda_13_4() {
        type Info = CUcheckpointCustomStorageInfo;
        type Per = CUcheckpointCustomStoragePerDeviceData;
        type Ckpt = CUcheckpointCheckpointArgsCustom;
        type Rest = CUcheckpointRestoreArgsCustom;
        let offsets = [
            (offset_of!(Info, handle), 0),
            (offset_of!(Info, per_device_data), 8),
            (offset_of!(Info, device_count), 16),
            (offset_of!(Per, dev_ptr), 0),
            (offset_of!(Per, size), 8),
            (offset_of!(Per, stream), 16),
            (offset_of!(Ckpt, custom_storage_info_out), 0),
            (offset_of!(Rest, gpu_pairs), 0),
            (offset_of!(Rest, gpu_pairs_count), 8),
            (offset_of!(Rest, padding0), 12),
            (offset_of!(Rest, custom_storage_info_out), 16),
        ];
        for (i, (got, want)) in offsets.into_iter().enumerate() {
            assert_eq!(got, want, "field {i}");
        }
    }

    #[test]
    fn chunking_and_buffers() {
        let c: Vec<_> = chunks(10, 4).collect();
        assert_eq!(c, [(0, 4), (4, 4), (8, 2)]);
        assert_eq!(chunks(0, 4).count(), 0);
        assert_eq!(chunks(8, 4).count(), 2);
        assert_eq!(buffer_len(1), ALIGN);
        assert_eq!(buffer_len(5000), 2 * ALIGN);
        assert_eq!(buffer_len(1 << 40), CHUNK_BYTES);
        assert_eq!(buffer_len(0), ALIGN);
    }

    /// A page-aligned buffer, as the pinned ones are.
    struct Aligned(*mut u8, std::alloc::Layout);

    impl Aligned {
        fn new(len: usize) -> Aligned {
            let layout = std::alloc::Layout::from_size_align(len, ALIGN).unwrap();
            // SAFETY: a non-zero size.
            Aligned(unsafe { std::alloc::alloc_zeroed(layout) }, layout)
        }

        fn bytes(&mut self) -> &mut [u8] {
            // SAFETY: the allocation's own bytes.
            unsafe { std::slice::from_raw_parts_mut(self.0, self.1.size()) }
        }
    }

    impl Drop for Aligned {
        fn drop(&mut self) {
            // SAFETY: allocated with this layout.
            unsafe { std::alloc::dealloc(self.0, self.1) }
        }
    }

    /// A range whose last block is partial goes to its file and comes back byte for byte, with
    /// direct I/O where the filesystem has it.
    #[test]
    fn a_partial_last_block_round_trips() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = Dir::open(tmp.path()).unwrap();
        let size: u64 = 3 * ALIGN as u64 + 1234;
        let data: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
        let chunk = 2 * ALIGN;
        let mut buf = Aligned::new(chunk);
        let (file, direct) = dir.create("r-0.bin").unwrap();
        reserve(&file, size).unwrap();
        for (off, n) in chunks(size, chunk) {
            buf.bytes()[..n].copy_from_slice(&data[off as usize..off as usize + n]);
            let end = pad(buf.bytes(), n, direct);
            file.write_all_at(&buf.bytes()[..end], off).unwrap();
        }
        cut_padding(&file, size, direct).unwrap();
        drop(file);
        assert_eq!(std::fs::read(tmp.path().join("r-0.bin")).unwrap(), data);
        let (file, direct_read) = dir.open_read("r-0.bin").unwrap();
        assert_eq!(direct_read, direct);
        let mut back = Vec::new();
        for (off, n) in chunks(size, chunk) {
            let want = if direct { n.div_ceil(ALIGN) * ALIGN } else { n };
            read_full_at(&file, &mut buf.bytes()[..want], off, n).unwrap();
            back.extend_from_slice(&buf.bytes()[..n]);
        }
        assert_eq!(back, data);
        // Never overwritten: a second create of the name fails.
        assert!(dir.create("r-0.bin").is_err());
    }

    #[test]
    fn file_names_are_flat() {
        for bad in ["", ".", "..", "a/b", "/abs"] {
            assert!(flat_name(bad).is_err(), "{bad:?}");
        }
        assert!(flat_name("device-memory-12-0.bin").is_ok());
    }

    fn range(gpu: u8, size: u64) -> Range {
        Range {
            dev_ptr: 0,
            size,
            stream: 0,
            ctx: 0,
            gpu: GpuUuid([gpu; 16]),
        }
    }

    fn file(gpu: u8, size: u64, name: &str) -> DeviceMemoryFile {
        DeviceMemoryFile {
            gpu: GpuUuid([gpu; 16]),
            name: name.into(),
            size,
            blake3: String::new(),
        }
    }

    #[test]
    fn files_match_ranges_by_gpu_after_the_pairs() {
        let files = [file(1, 10, "a"), file(2, 20, "b")];
        // Swapped GPUs: file a (GPU 1) goes to GPU 2, b to GPU 1.
        let targets = [GpuUuid([2; 16]), GpuUuid([1; 16])];
        let order = match_files(&[range(1, 20), range(2, 10)], &files, &targets).unwrap();
        assert_eq!(order, [1, 0]);
        let e = match_files(&[range(1, 10), range(2, 10)], &files, &targets).unwrap_err();
        assert!(
            e.to_string().contains("is 10 bytes, its file b holds 20"),
            "{e}"
        );
        let e = match_files(&[range(3, 10), range(2, 10)], &files, &targets).unwrap_err();
        assert!(e.to_string().contains("no device-memory file"), "{e}");
        let e = match_files(&[range(1, 20)], &files, &targets).unwrap_err();
        assert!(e.to_string().contains("1 device-memory ranges"), "{e}");
    }
}
