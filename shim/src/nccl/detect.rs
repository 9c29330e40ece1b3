//! Before any Quiesce (and so before any device lock): a process of the container that maps
//! NCCL and gpu-ckpt's NCCL layer and holds a GPU (a GPU device node open, as a CUDA context
//! does), but has no control session, holds communicators the checkpoint cannot quiesce: it
//! made none yet (the layer connects with its first), or cannot reach the socket. Refused,
//! the container running on untouched.

use super::inject::SOCKET_IN_CONTAINER;
use crate::unsupported::{maps_layer, nccl_in_maps, open_files};

/// Whether a process with these mappings and open files is one the quiesce must reach.
pub fn needs_session(maps_text: &str, fd_targets: &[String]) -> bool {
    nccl_in_maps(maps_text).is_some()
        && maps_layer(maps_text)
        && fd_targets
            .iter()
            .any(|t| gpu::assign::gpu_node_minor(t).is_some())
}

/// The refusal for the first of `pids` that needs a session and has none (`known`).
pub fn refuse_unconnected(pids: &[i32], known: impl Fn(i32) -> bool) -> Option<String> {
    pids.iter().find_map(|&pid| {
        if known(pid) {
            return None;
        }
        let text = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
        if !needs_session(&text, &open_files(pid)) {
            return None;
        }
        let comm = crate::device::comm(pid);
        let ns = crate::device::ns_pid(pid).unwrap_or(0);
        Some(format!(
            "pid {pid} ({comm}, pid {ns} in the container) maps gpu-ckpt's NCCL layer and holds a GPU but has no control session with the shim (it has made no communicator yet, or cannot reach {SOCKET_IN_CONTAINER}): its communicators cannot be quiesced; the container runs on untouched"
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
