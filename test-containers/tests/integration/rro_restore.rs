//! A pod with a recursive read-only mount whose host directory has a mount below it (a tmpfs
//! at `D/sub`, so the container has both `/data` and `/data/sub`) is checkpointed through CRI
//! on one node and restored through containerd's restore-via-create on a second: the shim maps
//! the sub-mount for CRIU (runc maps only the spec's own mounts), the counter counts on, and
//! both mounts stay read-only.
//!
//! Needs root and the stack from `make deps`; fails (never skips) when it is missing.

use std::io::Read;
use std::path::Path;

use crate::common;
use crate::common::{
    counter_with, expect_rro, mount, node_with, runc_typed_handler, workloads, NestedMount,
    RUNC_TYPED,
};
use anyhow::{ensure, Context, Result};
use k8s_cri::v1 as cri;
use test_containers::cri::{ContainerSpec, Cri, PodSpec};
use test_containers::stack::Node;

/// The names of the files in the checkpoint archive CRI wrote.
fn archive_names(archive: &Path) -> Result<Vec<String>> {
    let mut bytes = Vec::new();
    std::fs::File::open(archive)?.read_to_end(&mut bytes)?;
    let mut names = Vec::new();
    for e in tar::Archive::new(&bytes[..]).entries()? {
        names.push(e?.path()?.display().to_string());
    }
    Ok(names)
}

#[test]
fn recursive_read_only_mount_with_a_sub_mount_restores_on_a_second_node() -> Result<()> {
    let a = node_with(runc_typed_handler(Node::builder("rro-a")?, "rro-a")?)?;
    let b = node_with(runc_typed_handler(Node::builder("rro-b")?, "rro-b")?)?;
    let host = NestedMount::new()?;
    let rro = || {
        mount(
            host.path(),
            true,
            true,
            cri::MountPropagation::PropagationPrivate,
        )
    };
    common::rt().block_on(async {
        let cri_a = Cri::connect(a.socket()).await?;
        let cri_b = Cri::connect(b.socket()).await?;
        cri_a.pull_image(workloads()).await?;
        let pod_a = cri_a
            .run_pod(&PodSpec::new("rro-worker", a.pod_log_root()).handler(RUNC_TYPED))
            .await?;
        let id = cri_a.run_container(&pod_a, &counter_with(rro())).await?;
        ensure!(
            !a.shim_processes("containerd-shim-gpu-ckpt-v1").is_empty(),
            "the pod runs under the gpu-ckpt shim"
        );
        expect_rro(&cri_a, &id).await?;
        let before = common::cri_counter_above(&cri_a, &id, "/counter.txt", 5).await?;
        let archive = a.paths().dir.join("checkpoint-rro-worker-counter.tar");
        let _ = std::fs::remove_file(&archive);
        cri_a
            .checkpoint_container(&id, &archive, 60)
            .await
            .context("CRI checkpoint")?;
        let after = common::cri_counter(&cri_a, &id, "/counter.txt").await?;
        let names = archive_names(&archive)?;
        ensure!(
            names
                .iter()
                .any(|n| n.ends_with("gpu-ckpt-ext-mounts.json")),
            "the checkpoint lists its sub-mounts: {names:?}"
        );
        cri_a.remove_pod(&pod_a).await?;
        // Written on the host after the checkpoint: the restored /data/sub must be the host's
        // tmpfs again, not a copy of it from the checkpoint.
        std::fs::write(host.path().join("sub/after-checkpoint"), "host")?;

        // Restore-via-create on node B: the image is the archive, the same mount.
        let mut spec = ContainerSpec::new("counter", &archive.display().to_string());
        spec.mounts.push(rro());
        let pod_b = cri_b
            .run_pod(&PodSpec::new("rro-worker", b.pod_log_root()).handler(RUNC_TYPED))
            .await?;
        let id = cri_b
            .run_container(&pod_b, &spec)
            .await
            .context("restore-via-create on node B")?;
        ensure!(
            !b.shim_processes("containerd-shim-gpu-ckpt-v1").is_empty(),
            "the restored pod runs under the gpu-ckpt shim"
        );
        let first = common::cri_counter(&cri_b, &id, "/counter.txt").await?;
        ensure!(
            first >= before && first <= after + 2,
            "the restore started at {first}, the checkpoint was between {before} and {after}"
        );
        common::cri_counter_above(&cri_b, &id, "/counter.txt", first).await?;
        expect_rro(&cri_b, &id).await?;
        let r = cri_b
            .exec_sync(&id, &["cat", "/data/sub/after-checkpoint"], 10)
            .await?;
        ensure!(
            r.exit_code == 0 && r.stdout_str().trim() == "host",
            "the restored /data/sub is not the host's tmpfs: {:?}",
            r.stderr_str()
        );
        cri_b.remove_pod(&pod_b).await
    })
}
