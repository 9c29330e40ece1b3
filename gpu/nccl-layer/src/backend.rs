//! What the layer asks of the NCCL and CUDA underneath it. the `real` module is the library
//! the application would have called; unit tests of the layer's logic use a test double.

use crate::config::ConfigCopy;
use crate::ffi::{ncclResult_t, ncclUniqueId};

/// A real communicator (the next library's `ncclComm_t`), as an address.
pub type RealComm = usize;

/// The config a communicator is made with, if any.
pub type Cfg<'a> = Option<&'a ConfigCopy>;

/// A call that makes a communicator: its result and the communicator (null where none).
pub type Made = (ncclResult_t, RealComm);

/// The NCCL and CUDA calls the layer makes itself (to rebuild, release, and check streams).
pub trait Backend: Send + Sync + 'static {
    /// `ncclGetVersion`.
    fn version(&self) -> Result<i32, ncclResult_t>;
    /// `ncclGetUniqueId`.
    fn unique_id(&self) -> Result<ncclUniqueId, ncclResult_t>;
    /// `ncclCommInitRankConfig` (or `ncclCommInitRank` without a config) on the calling
    /// thread's current device.
    fn init_rank(&self, nranks: i32, id: &ncclUniqueId, rank: i32, config: Cfg) -> Made;
    /// `ncclCommSplit`; a null communicator for `NCCL_SPLIT_NOCOLOR`.
    fn split(&self, parent: RealComm, color: i32, key: i32, config: Cfg) -> Made;
    fn group_start(&self) -> ncclResult_t;
    fn group_end(&self) -> ncclResult_t;
    /// Whether the library has `ncclCommSuspend` and `ncclCommResume`.
    fn has_suspend(&self) -> bool;
    /// `ncclCommSuspend(comm, NCCL_SUSPEND_MEM)`.
    fn suspend(&self, comm: RealComm) -> ncclResult_t;
    fn resume(&self, comm: RealComm) -> ncclResult_t;
    fn destroy(&self, comm: RealComm) -> ncclResult_t;
    /// `ncclCommRegister`: the registration's handle.
    fn register(&self, comm: RealComm, ptr: usize, size: usize) -> (ncclResult_t, usize);
    fn deregister(&self, comm: RealComm, handle: usize) -> ncclResult_t;
    /// `ncclCommUserRank` and `ncclCommCount` (None while the communicator is still being made).
    fn rank_count(&self, comm: RealComm) -> Option<(i32, i32)>;
    /// `ncclCommGetAsyncError`: the communicator's state (ncclInProgress while a nonblocking
    /// init or split goes on).
    fn async_error(&self, comm: RealComm) -> ncclResult_t;
    /// `ncclCommCuDevice`.
    fn cu_device(&self, comm: RealComm) -> Result<i32, ncclResult_t>;
    /// The calling thread's current CUDA device (`cuCtxGetDevice`), where there is one.
    fn current_device(&self) -> Option<i32>;
    /// Makes `dev`'s primary context current on the calling thread (what `cudaSetDevice`
    /// does), for NCCL calls the layer makes on its own thread.
    fn use_device(&self, dev: i32) -> Result<(), String>;
    /// Whether the work queued on `stream` (of device `dev`) is complete (`cuStreamQuery`):
    /// Ok(true) done, Ok(false) still running, Err the driver's error.
    fn stream_done(&self, stream: usize, dev: i32) -> Result<bool, String>;
    /// `ncclGetLastError(comm)` (`comm` may be 0): the text of NCCL's last error, where it has
    /// one, at most [`LAST_ERROR_MAX`] bytes.
    fn last_error(&self, comm: RealComm) -> Option<String>;
}

/// The most of `ncclGetLastError`'s text a failure message carries.
pub const LAST_ERROR_MAX: usize = 256;
