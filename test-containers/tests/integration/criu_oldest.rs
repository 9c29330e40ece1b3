//! The checkpoint and restore flows with the oldest CRIU gpu-ckpt supports (4.1.1, built by the
//! install script beside the newest and put first in each node's PATH): ctr's checkpoint and
//! restore, and CRI's checkpoint with both restore paths on a second node.

use std::time::Duration;

use crate::common::*;
use anyhow::{ensure, Result};
use test_containers::{
    cri::{ContainerSpec, Cri, PodSpec},
    stack::{Node, GPU_CKPT_HANDLER},
};

/// The node's shim ran its checkpoints with CRIU 4.1.1: the manifest says so.
fn criu_of(dir: &std::path::Path) -> Result<String> {
    Ok(image_format::manifest::Manifest::read_from(dir)?.node.criu)
}

#[test]
fn ctr_checkpoint_and_restore_with_the_oldest_criu() -> Result<()> {
    let node = node_with(Node::builder("criu-old-ctr")?.oldest_criu())?;
    start_counter(&node, "c1", "100")?;
    // A paused container with a network namespace of its own and nothing to lock: with 4.2
    // the shim skips CRIU's network lock; 4.1.1 has no `skip` (it crashed on it), so the lock
    // stays.
    let dir = node.paths().dir.join("c1-exit");
    node.checkpoint_task_exit("c1", &dir)?;
    ensure!(
        criu_of(&dir)? == "4.1.1",
        "the checkpoint ran CRIU {}",
        criu_of(&dir)?
    );
    ensure!(
        inventory_network_lock(&dir)? != 2,
        "CRIU 4.1.1's dump recorded network-lock skip"
    );
    node.ctr_ok(&["task", "rm", "c1"])?;
    let restored = restore_from_dir(&node, "c1", &dir)?;
    let first = counter_value(restored).unwrap_or(0);
    ensure!(first >= 5, "the restored counter started over: {first}");
    counter_goes_on(restored, first)?;
    Ok(())
}

#[test]
fn cri_checkpoint_and_both_restores_with_the_oldest_criu() -> Result<()> {
    let a = node_with(Node::builder("criu-old-a")?.oldest_criu())?;
    let b = restore_node_with(Node::builder("criu-old-b")?.oldest_criu(), "criu-old-b")?;
    rt().block_on(async {
        // A deadline like kubelet's: a restore that hangs fails here instead of the test.
        let cri_a = Cri::connect(a.socket())
            .await?
            .with_timeout(Duration::from_secs(60));
        let cri_b = Cri::connect(b.socket())
            .await?
            .with_timeout(Duration::from_secs(60));
        let (pod, id) = cri_counter_pod(&cri_a, &a, "worker").await?;
        let before = cri_counter_above(&cri_a, &id, "/counter.txt", 5).await?;
        let archive = a.paths().dir.join("checkpoint-worker-old.tar");
        let _ = std::fs::remove_file(&archive);
        cri_a.checkpoint_container(&id, &archive, 60).await?;
        let source = archive.display().to_string();
        for (what, pod_spec, spec) in [
            (
                "restore-via-create",
                PodSpec::new("worker", b.pod_log_root()).handler(GPU_CKPT_HANDLER),
                ContainerSpec::new("counter", &source),
            ),
            (
                "the restore handler",
                PodSpec::new("worker", b.pod_log_root())
                    .handler(RESTORE_HANDLER)
                    .annotation("gpu-ckpt.io/restore-from", &source),
                counter_spec(),
            ),
        ] {
            let t = std::time::Instant::now();
            let pod_b = cri_b.run_pod(&pod_spec).await?;
            let id_b = cri_b.run_container(&pod_b, &spec).await?;
            let first = cri_counter(&cri_b, &id_b, "/counter.txt").await?;
            println!(
                "{what} with CRIU 4.1.1: restored at {first} in {:?}",
                t.elapsed()
            );
            ensure!(
                first >= before,
                "{what}: started over at {first} (< {before})"
            );
            cri_counter_above(&cri_b, &id_b, "/counter.txt", first).await?;
            cri_b.remove_pod(&pod_b).await?;
        }
        cri_a.remove_pod(&pod).await
    })
}
