//! gpu-ckpt registered the way containerd's CRI reads a runtime's features: runtime type
//! `io.containerd.runc.v2` with our binary as `runtime_path`. CRI then sends
//! `containerd.runc.v1.Options`, so gpu-ckpt's own handler options come from the file next to
//! the path containerd starts (`<runtime_path>.toml`): one binary, two handlers, the restore
//! handler's `Mode = "restore"` in its file. Both handlers advertise runc's features, and a
//! checkpoint taken under one restores through the other on a second node.
//!
//! Needs root and the stack from `make deps`; fails (never skips) when it is missing.

use std::path::{Path, PathBuf};

use crate::common;
use crate::common::{counter_spec, node_with, workloads};
use anyhow::{ensure, Result};
use test_containers::cri::{Cri, PodSpec};
use test_containers::stack::{Node, Stack};

const HANDLER: &str = "gpu-ckpt-rt";
const RESTORE_HANDLER: &str = "gpu-ckpt-restore-rt";

fn rt() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// A node whose two gpu-ckpt handlers are registered with the runc type, each by its own link
/// to the shim; the restore handler's options file says `Mode = "restore"` and names the test
/// nodes' directory as a restore source. Returns the node and the directory of the links.
fn node(name: &str) -> Result<(Node, tempfile::TempDir)> {
    let stack = Stack::discover()?;
    let shim = stack.shim_dir().join("containerd-shim-gpu-ckpt-v1");
    let links = tempfile::Builder::new().prefix("runc-typed-").tempdir()?;
    let mut config = String::new();
    for (handler, binary, options) in [
        (HANDLER, "containerd-shim-gpu-ckpt-v1", None),
        (
            RESTORE_HANDLER,
            "containerd-shim-gpu-ckpt-restore-v1",
            Some(format!(
                "Mode = \"restore\"\nRestoreSources = [\"{}/\"]\nRestoreStagingDir = \"{}\"\n",
                stack.prefix().join("nodes").display(),
                stack.node_dir(name).join("restore-staging").display()
            )),
        ),
    ] {
        let link = links.path().join(binary);
        std::os::unix::fs::symlink(&shim, &link)?;
        if let Some(options) = options {
            std::fs::write(link.with_file_name(format!("{binary}.toml")), options)?;
        }
        let table = format!("plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{handler}");
        config.push_str(&format!(
            "[{table}]\n  runtime_type = \"io.containerd.runc.v2\"\n  runtime_path = \"{}\"\n  \
             pod_annotations = [\"gpu-ckpt.io/*\"]\n  container_annotations = [\"gpu-ckpt.io/*\"]\n\
             [{table}.options]\n  BinaryName = \"/usr/sbin/runc\"\n  \
             Root = \"/run/gpu-ckpt-test/{name}/{handler}-runc\"\n",
            link.display()
        ));
    }
    Ok((
        node_with(Node::builder(name)?.extra_config(&config))?,
        links,
    ))
}

fn served_by_gpu_ckpt(node: &Node) -> Result<()> {
    ensure!(
        !node.shim_processes("containerd-shim-gpu-ckpt").is_empty(),
        "no gpu-ckpt shim serves the node's pods"
    );
    Ok(())
}

#[test]
fn both_handlers_advertise_runcs_features_and_restore_across_nodes() -> Result<()> {
    let (a, _links_a) = node("rt-a")?;
    let (b, _links_b) = node("rt-b")?;
    rt()?.block_on(async {
        let cri_a = Cri::connect(a.socket()).await?;
        let cri_b = Cri::connect(b.socket()).await?;
        common::expect_runc_features(&cri_b, &[HANDLER, RESTORE_HANDLER]).await?;

        // A checkpoint through CRI under the runc-typed gpu-ckpt handler...
        cri_a.pull_image(workloads()).await?;
        let pod = cri_a
            .run_pod(&PodSpec::new("worker", a.pod_log_root()).handler(HANDLER))
            .await?;
        let id = cri_a.run_container(&pod, &counter_spec()).await?;
        served_by_gpu_ckpt(&a)?;
        let before = common::cri_counter_above(&cri_a, &id, "/counter.txt", 3).await?;
        let archive: PathBuf = a.paths().dir.join("checkpoint-runc-typed.tar");
        let _ = std::fs::remove_file(&archive);
        cri_a.checkpoint_container(&id, &archive, 60).await?;
        let after = common::cri_counter(&cri_a, &id, "/counter.txt").await?;
        cri_a.remove_pod(&pod).await?;
        ensure!(
            Path::new(&archive).is_file(),
            "no archive at {}",
            archive.display()
        );

        // ...restores through the runc-typed restore handler of another node: its mode and
        // restore sources came from its options file.
        let pod = cri_b
            .run_pod(
                &PodSpec::new("worker", b.pod_log_root())
                    .handler(RESTORE_HANDLER)
                    .annotation("gpu-ckpt.io/restore-from", &archive.display().to_string()),
            )
            .await?;
        let id = cri_b.run_container(&pod, &counter_spec()).await?;
        served_by_gpu_ckpt(&b)?;
        let first = common::cri_counter(&cri_b, &id, "/counter.txt").await?;
        ensure!(
            first >= before && first <= after + 2,
            "the restore started at {first}, the checkpoint was between {before} and {after}"
        );
        common::cri_counter_above(&cri_b, &id, "/counter.txt", first).await?;
        cri_b.remove_pod(&pod).await
    })
}
