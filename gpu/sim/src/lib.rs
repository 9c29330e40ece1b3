//! A simulated NVIDIA driver for machines without a GPU, faithful at the ABI.
//!
//! `gpu-ckpt-simgpu serve` is the node's GPUs (the daemon owns device memory); the workspace's
//! `libcuda.so.1` and `libnvidia-ml.so.1` (crates `gpu/sim/libcuda`, `gpu/sim/libnvml`) export the
//! real driver symbols and speak [`proto`] to it, as the simulated `libnccl.so.2` (crate
//! `gpu/sim/libnccl`) does for communicators ([`nccl`]). This library holds what they share.

pub mod cdi;
pub mod client;
pub mod cuerr;
pub mod daemon;
pub mod mailbox;
pub mod nccl;
pub mod node;
pub mod proto;
pub mod testing;

/// `CUprocessState` values.
pub const STATE_RUNNING: u32 = 0;
pub const STATE_LOCKED: u32 = 1;
pub const STATE_CHECKPOINTED: u32 = 2;
pub const STATE_FAILED: u32 = 3;
/// Custom storage (CUDA 13.4): the caller is copying the process's device memory out.
pub const STATE_CHECKPOINTING: u32 = 4;
/// Custom storage (CUDA 13.4): the caller is copying the process's device memory back in.
pub const STATE_RESTORING: u32 = 5;
/// The first CUDA version whose checkpoint API has custom storage (`customStorageInfo_out`,
/// `cuCheckpointOperationComplete`).
pub const CUSTOM_STORAGE_SINCE: i32 = 13040;

/// Where a library finds its daemon: `$GPU_CKPT_SIM_SOCKET`, else `simgpu.sock` in the directory
/// above the library's own (a node directory's `lib/`), else the container path the CDI spec
/// mounts.
pub fn socket_path(library_file: Option<&std::path::Path>) -> std::path::PathBuf {
    if let Some(s) = std::env::var_os(proto::ENV_SOCKET) {
        if !s.is_empty() {
            return s.into();
        }
    }
    if let Some(lib) = library_file {
        if let Some(node_dir) = lib.parent().and_then(|d| d.parent()) {
            let cand = node_dir.join(proto::SOCKET_NAME);
            if cand.exists() {
                return cand;
            }
        }
    }
    proto::CONTAINER_SOCKET.into()
}

/// The file a function of the calling shared library was loaded from (dladdr). `addr` is only
/// compared against the loader's map, never dereferenced.
pub fn library_file_of(addr: usize) -> Option<std::path::PathBuf> {
    let addr = addr as *const std::ffi::c_void;
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads addr and fills info.
    if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader.
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    let path = std::path::PathBuf::from(std::ffi::OsStr::from_bytes_compat(name.to_bytes()));
    std::fs::canonicalize(&path).ok().or(Some(path))
}

trait FromBytesCompat {
    fn from_bytes_compat(b: &[u8]) -> &std::ffi::OsStr;
}
impl FromBytesCompat for std::ffi::OsStr {
    fn from_bytes_compat(b: &[u8]) -> &std::ffi::OsStr {
        std::os::unix::ffi::OsStrExt::from_bytes(b)
    }
}

/// Where a process that reaches its daemon at `socket` finds the GPUs' device nodes: the node
/// directory's `dev/` when the socket is in one (a process on the host, as on a real host where
/// every `/dev/nvidia<N>` exists), else `/dev` (a container, where the CDI spec puts the nodes
/// of the GPUs it was given).
pub fn dev_dir(socket: &std::path::Path) -> std::path::PathBuf {
    if let Some(dir) = socket.parent().map(|d| d.join(proto::DEV_DIR_NAME)) {
        if dir.is_dir() {
            return dir;
        }
    }
    "/dev".into()
}

/// The device node of the GPU with minor number `minor` (the simulated NVML's minor number is
/// the GPU's index) in `dev`.
pub fn gpu_node(dev: &std::path::Path, minor: u32) -> std::path::PathBuf {
    dev.join(format!("nvidia{minor}"))
}

/// Keeps the GPUs of `node` this process may use: those whose device node is in `dev`, as
/// the real driver finds its GPUs, and of them the ones `$GPU_CKPT_SIM_VISIBLE_DEVICES` names
/// when it is set.
pub fn retain_visible(node: &mut node::NodeDesc, dev: &std::path::Path) {
    let named: Option<Vec<[u8; 16]>> = std::env::var(proto::ENV_VISIBLE)
        .ok()
        .map(|v| v.split(',').filter_map(node::parse_uuid).collect());
    node.gpus.retain(|g| {
        named.as_ref().is_none_or(|n| n.contains(&g.uuid)) && gpu_node(dev, g.index).exists()
    });
}

/// `len` zeroed bytes for device memory or a checkpoint's staged copy of it, its pages
/// populated up front in one call (`MADV_POPULATE_WRITE`, Linux 5.14) rather than faulted in
/// one 4 KiB page at a time by the copy that fills it: a copy engine's speed is what the
/// simulator stands in for, and a gibibyte of single page faults costs more than the copy.
pub fn zeroed_buffer(len: usize) -> Vec<u8> {
    // calloc: a large buffer is fresh zeroed pages, not yet touched.
    let mut v = vec![0u8; len];
    const PAGE: usize = 4096;
    const MADV_POPULATE_WRITE: libc::c_int = 23;
    let start = v.as_mut_ptr() as usize;
    let first = (start + PAGE - 1) & !(PAGE - 1);
    let end = (start + len) & !(PAGE - 1);
    if len >= (1 << 20) && end > first {
        // SAFETY: [first, end) lies inside `v`; populating pages does not change their
        // (zero) contents. An older kernel answers EINVAL, and the pages fault in as before.
        unsafe {
            libc::madvise(first as *mut libc::c_void, end - first, MADV_POPULATE_WRITE);
        }
    }
    v
}
