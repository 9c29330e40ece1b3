//! The wire protocol between the simulated libraries and the daemon: one Unix stream connection
//! per library instance; each frame is a 4-byte little-endian length, a JSON header, and for bulk
//! copies the raw bytes the header announces.

use std::io::{self, Read, Write};

use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::node::NodeDesc;

/// Name of the daemon's socket in its directory.
pub const SOCKET_NAME: &str = "simgpu.sock";
/// Where the CDI spec puts the daemon's socket in a container.
pub const CONTAINER_SOCKET: &str = "/run/gpu-ckpt-simgpu/simgpu.sock";
/// The node directory's directory of device nodes (`nvidia<minor>` per GPU, `nvidiactl`,
/// `nvidia-uvm`, `nvidia-uvm-tools`), which the CDI spec presents at `/dev` in a container.
pub const DEV_DIR_NAME: &str = "dev";
/// The device nodes every GPU process holds besides its GPUs' `nvidia<minor>`, and the CDI spec
/// gives every container with a GPU.
pub const COMMON_NODES: [&str; 3] = ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"];
/// Environment: the daemon's socket (else the library's own `../simgpu.sock`, else
/// [`CONTAINER_SOCKET`]).
pub const ENV_SOCKET: &str = "GPU_CKPT_SIM_SOCKET";
/// Environment: comma-separated UUIDs a process may use, among those whose device node it has.
pub const ENV_VISIBLE: &str = "GPU_CKPT_SIM_VISIBLE_DEVICES";
/// Largest JSON header accepted.
const MAX_HEADER: usize = 1 << 20;

/// What a connection is for.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A process's libcuda.so.1.
    Cuda,
    /// A process's libnvidia-ml.so.1.
    Nvml,
    /// A control client (`gpu-ckpt-simgpu fault`, tests).
    Control,
    /// A process's libnccl.so.2 (one connection per call: it holds none between calls).
    Nccl,
}

/// A GPU pair of a restore: (old UUID, new UUID).
pub type Pair = ([u8; 16], [u8; 16]);

/// One allocation a checkpointed process holds in its host memory.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct SavedAlloc {
    pub ptr: u64,
    /// The UUID the allocation lived on at the checkpoint.
    pub gpu: [u8; 16],
    pub size: u64,
}

/// The driver's checkpoint calls, as a caller's library forwards them. `args` is the 64-byte
/// argument struct exactly as the caller passed it.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub enum CkptCall {
    Lock {
        pid: i32,
        args: Vec<u8>,
    },
    Checkpoint {
        pid: i32,
        args: Vec<u8>,
        /// The GPUs on which the caller holds a retained primary context (custom storage maps
        /// the target's memory there).
        #[serde(default)]
        primaries: Vec<[u8; 16]>,
    },
    Restore {
        pid: i32,
        args: Vec<u8>,
        pairs: Vec<Pair>,
        #[serde(default)]
        primaries: Vec<[u8; 16]>,
    },
    Unlock {
        pid: i32,
        args: Vec<u8>,
    },
    GetState {
        pid: i32,
    },
    GetRestoreThreadId {
        pid: i32,
    },
}

impl CkptCall {
    /// The driver entry point this call stands for.
    pub fn name(&self) -> &'static str {
        match self {
            CkptCall::Lock { .. } => "cuCheckpointProcessLock",
            CkptCall::Checkpoint { .. } => "cuCheckpointProcessCheckpoint",
            CkptCall::Restore { .. } => "cuCheckpointProcessRestore",
            CkptCall::Unlock { .. } => "cuCheckpointProcessUnlock",
            CkptCall::GetState { .. } => "cuCheckpointProcessGetState",
            CkptCall::GetRestoreThreadId { .. } => "cuCheckpointProcessGetRestoreThreadId",
        }
    }
}

/// A fault the daemon injects into checkpoint steps.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultOp {
    /// In-flight work never finishes: a lock waits out its timeout.
    LockTimeout,
    /// The checkpoint fails (CUDA_ERROR_OPERATING_SYSTEM); the process stays LOCKED.
    CheckpointFail,
    /// The restore fails (CUDA_ERROR_OPERATING_SYSTEM); the process stays CHECKPOINTED.
    RestoreFail,
    /// The restore never finishes while the process lives (then CUDA_ERROR_OPERATING_SYSTEM);
    /// the process stays CHECKPOINTED.
    RestoreHang,
    /// The lock never returns while its caller lives (a driver stuck on NCCL or P2P work). When
    /// the caller dies the call is dropped and the process stays RUNNING, as after a failed lock.
    LockHang,
    /// The checkpoint never returns while its caller lives. When the caller dies the call is
    /// dropped and the process stays LOCKED, as after a failed checkpoint (an unlock resumes it).
    CheckpointHang,
    /// The state read never returns while its caller lives; the process's state is unchanged.
    StateHang,
}

/// A request to the daemon.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub enum Request {
    Hello {
        role: Role,
    },
    Node,
    /// The process holds a context on this GPU (NVML lists it from then on: among the MPS
    /// clients when `mps`, the process's work going through an MPS server).
    Context {
        gpu: [u8; 16],
        #[serde(default)]
        mps: bool,
    },
    Alloc {
        gpu: [u8; 16],
        size: u64,
    },
    Free {
        ptr: u64,
    },
    /// Followed by `len` bytes.
    HtoD {
        dst: u64,
        len: u64,
    },
    /// Answered by `Reply::Data` and `len` bytes.
    DtoH {
        src: u64,
        len: u64,
    },
    DtoD {
        dst: u64,
        src: u64,
        len: u64,
    },
    Memset {
        dst: u64,
        value: u32,
        elem: u8,
        count: u64,
    },
    MemInfo {
        gpu: [u8; 16],
    },
    Ckpt(CkptCall),
    /// From a target at checkpoint: its memory is copied out; free it and forget the connection.
    Release,
    /// From a target at a custom-storage checkpoint: its device memory moves to the caller's
    /// mapping (nothing is freed); forget the connection.
    Handover,
    /// From a target at restore: reconnecting, with the allocations to put back.
    Restore {
        allocs: Vec<SavedAlloc>,
    },
    /// `cuCheckpointOperationComplete`: the caller finished copying to or from the ranges of
    /// custom-storage operation `handle`.
    OperationComplete {
        handle: u64,
    },
    Processes,
    Fault {
        pid: Option<i32>,
        op: FaultOp,
        set: bool,
    },
    /// The argument struct the daemon last received for a checkpoint call (by entry point name).
    LastArgs {
        call: String,
    },
    /// Host to device from the caller's own memory at `addr`, which the daemon reads itself
    /// (`process_vm_readv`), as a copy engine reads host memory: one copy instead of two
    /// through the socket. Answered `Ok`, or an error after which the caller sends `HtoD`.
    HtoDDirect {
        dst: u64,
        len: u64,
        addr: u64,
    },
    /// Device to host into the caller's own memory at `addr` (`process_vm_writev`).
    DtoHDirect {
        src: u64,
        len: u64,
        addr: u64,
    },
    /// From a libnccl.so.2: communicators and collectives (see `nccl`).
    Nccl(crate::nccl::Call),
}

/// Copies at least this large go straight between the daemon and the caller's memory.
pub const DIRECT_MIN: usize = 1 << 20;

/// A process that uses a GPU (NVML's running compute processes).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ProcUse {
    pub pid: u32,
    pub gpu: [u8; 16],
    pub used_bytes: u64,
    /// An MPS client (NVML lists it with `nvmlDeviceGetMPSComputeRunningProcesses`).
    #[serde(default)]
    pub mps: bool,
}

/// One GPU's share of a custom-storage operation: a contiguous device range mapped into the
/// caller (`CUcheckpointCustomStoragePerDeviceData`).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct MappedRange {
    pub gpu: [u8; 16],
    pub ptr: u64,
    pub size: u64,
}

/// The daemon's answer.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub enum Reply {
    Ok,
    Err {
        code: u32,
        msg: String,
    },
    Node(NodeDesc),
    Ptr(u64),
    /// Followed by `len` bytes.
    Data {
        len: u64,
    },
    MemInfo {
        free: u64,
        total: u64,
    },
    State(u32),
    Tid(i32),
    Processes(Vec<ProcUse>),
    Args(Vec<u8>),
    /// To a target's `Restore`: old UUID → new UUID for each GPU.
    RestoreMap(Vec<Pair>),
    /// A custom-storage checkpoint or restore: the operation's handle and one range per GPU.
    Custom {
        handle: u64,
        ranges: Vec<MappedRange>,
    },
    /// The answer to a `Request::Nccl` (its errors are `Err` with an `ncclResult_t` code).
    Nccl(crate::nccl::Answer),
}

impl Reply {
    pub fn err(code: u32, msg: impl Into<String>) -> Reply {
        Reply::Err {
            code,
            msg: msg.into(),
        }
    }
}

/// Writes one frame header.
pub fn send<T: Serialize, W: Write>(w: &mut W, msg: &T) -> io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(io::Error::other)?;
    let len = u32::try_from(body.len()).map_err(io::Error::other)?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame)
}

/// Reads one frame header.
pub fn recv<T: DeserializeOwned, R: Read>(r: &mut R) -> io::Result<T> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_HEADER {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "frame header too large",
        ));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    serde_json::from_slice(&body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Reads and drops `len` bytes (the payload of a request that is refused).
pub fn drain<R: Read>(r: &mut R, len: u64) -> io::Result<()> {
    let copied = io::copy(&mut r.take(len), &mut io::sink())?;
    if copied == len {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "payload cut short",
        ))
    }
}
