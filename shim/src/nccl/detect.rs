//! Before any Quiesce (and so before any device lock): a process of the container that maps
//! NCCL and gpu-ckpt's NCCL layer and holds a GPU (a GPU device node open, as a CUDA context
//! does), but has no control session, holds communicators the checkpoint cannot quiesce: it
//! made none yet (the layer connects with its first), or cannot reach the socket. Refused,
//! the container running on untouched.

use super::inject::{LAYER_FILE_NAME, SOCKET_IN_CONTAINER};

/// Whether a `/proc/PID/maps` text maps a file whose name starts with `prefix`.
fn maps(text: &str, prefix: &str) -> bool {
    crate::driver_files::file_mappings(text).any(|(_, path)| {
        path.rsplit('/')
            .next()
            .is_some_and(|f| f.starts_with(prefix))
    })
}

/// Whether a file descriptor target names a GPU's device node (`/dev/nvidia<N>`).
fn is_gpu_node(target: &str) -> bool {
    target
        .strip_prefix("/dev/nvidia")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Whether a process with these mappings and open files is one the quiesce must reach.
pub fn needs_session(maps_text: &str, fd_targets: &[String]) -> bool {
    maps(maps_text, "libnccl.so")
        && maps(maps_text, LAYER_FILE_NAME)
        && fd_targets.iter().any(|t| is_gpu_node(t))
}

/// The open files of host process `pid` (the links read, never followed).
fn fd_targets(pid: i32) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|p| p.to_string_lossy().into_owned())
        .collect()
}

/// The refusal for the first of `pids` that needs a session and has none (`known`).
pub fn refuse_unconnected(pids: &[i32], known: impl Fn(i32) -> bool) -> Option<String> {
    pids.iter().find_map(|&pid| {
        if known(pid) {
            return None;
        }
        let text = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
        if !needs_session(&text, &fd_targets(pid)) {
            return None;
        }
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        let ns = crate::device::ns_pid(pid).unwrap_or(0);
        Some(format!(
            "pid {pid} ({}, pid {ns} in the container) maps gpu-ckpt's NCCL layer and holds a GPU but has no control session with the shim (it has made no communicator yet, or cannot reach {SOCKET_IN_CONTAINER}): its communicators cannot be quiesced; the container runs on untouched",
            comm.trim()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str =
        "7f0000000000-7f0000001000 r-xp 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libnccl.so.2\n\
        7f0000002000-7f0000003000 r-xp 00000000 08:01 13 /usr/lib/gpu-ckpt/libgpu-ckpt-nccl.so\n";

    #[test]
    fn only_a_gpu_holder_with_nccl_and_the_layer_needs_a_session() {
        let gpu = vec!["/dev/nvidiactl".to_string(), "/dev/nvidia2".to_string()];
        let no_gpu = vec!["/dev/nvidiactl".to_string(), "/dev/nvidia-uvm".to_string()];
        assert!(needs_session(MAPS, &gpu));
        // A launcher that maps both but holds no GPU (nccl_allreduce's parent, torchrun).
        assert!(!needs_session(MAPS, &no_gpu));
        // NCCL without the layer is unsupported.rs's refusal, the layer alone nobody's.
        let nccl_only = MAPS.lines().next().unwrap();
        assert!(!needs_session(nccl_only, &gpu));
        let layer_only = MAPS.lines().nth(1).unwrap();
        assert!(!needs_session(layer_only, &gpu));
    }

    #[test]
    fn a_known_process_or_one_gone_is_not_refused() {
        let me = std::process::id() as i32;
        assert_eq!(refuse_unconnected(&[me, 999_999_999], |_| false), None);
        assert_eq!(refuse_unconnected(&[me], |_| true), None);
    }
}
