//! Capabilities of a non-root task across a restore: bounded by what a cold start of the
//! restoring spec would hold (a non-root exec keeps the ambient set only), not by the spec's
//! permitted and effective lists, which containerd fills with its 14 defaults for uid 1000 too.
//! A root task that kept its capabilities across `setresuid(1000)` (PR_SET_KEEPCAPS) would
//! otherwise restore with them into a spec whose cold start holds none.
//!
//! Where this host's root cannot checkpoint a non-root task (CRIU needs CAP_SYS_RESOURCE for
//! another uid's rlimits), the test says so, and holds the rule through the shim's check of
//! the checkpoint's own record before CRIU: a root checkpoint whose core image is rewritten to
//! show such a task, its manifest signed again by a key the restoring handler trusts.

use std::path::Path;

use crate::common;
use crate::common::*;
use anyhow::{ensure, Context, Result};
use image_format::{
    criu_creds::test_images::core_image_with_caps,
    manifest::{FileDigest, Manifest, MANIFEST_FILE},
    sign::NodeKey,
};
use sha2::Digest as _;
use test_containers::{
    cri::{v1::security_profile::ProfileType, ContainerSpec, Cri, PodSpec},
    stack::{Node, OptValue, GPU_CKPT_HANDLER, RUN_BASE},
};

/// containerd's 14 default capabilities (CapBnd 00000000a80425fb).
const DEFAULT_CAPS: u64 = 0xa804_25fb;

/// The counter, told apart from other tests' by its interval.
fn counter() -> ContainerSpec {
    ContainerSpec::new("counter", workloads()).command(&[
        "/bin/counter",
        "--interval-ms",
        "109",
        "--file",
        "/tmp/counter.txt",
    ])
}

/// What Pod Security "restricted" admits: uid 1000, no added capability, seccomp.
fn restricted() -> ContainerSpec {
    counter()
        .run_as(1000, 1000)
        .no_new_privs()
        .seccomp(ProfileType::RuntimeDefault)
}

/// Runs `spec` in a pod on `node`, checkpoints it through CRI into `archive`, removes the pod.
async fn checkpoint(node: &Node, cri: &Cri, spec: &ContainerSpec, archive: &Path) -> Result<()> {
    cri.pull_image(workloads()).await?;
    let pod = cri
        .run_pod(&PodSpec::new("caps", node.pod_log_root()).handler(GPU_CKPT_HANDLER))
        .await?;
    let result = async {
        let id = cri.run_container(&pod, spec).await?;
        cri_counter_above(cri, &id, "/tmp/counter.txt", 2).await?;
        let _ = std::fs::remove_file(archive);
        cri.checkpoint_container(&id, archive, 60).await
    }
    .await;
    cri.remove_pod(&pod).await?;
    result
}

/// `archive` with every task's core image replaced by one of a uid-1000 task holding
/// `cap_prm` permitted and effective, the manifest's entries for them updated and the manifest
/// signed by `key`; written to `out`.
fn as_non_root_task(archive: &Path, out: &Path, cap_prm: u64, key: &NodeKey) -> Result<()> {
    let core = core_image_with_caps(1000, cap_prm, DEFAULT_CAPS, &[1000], true, Some(0));
    let info = image_format::archive::read_info(archive, Default::default())?;
    let mut manifest: Manifest = info.manifest.context("no gpu-ckpt manifest")?;
    let mut replaced = 0;
    for (name, entry) in manifest.files.iter_mut() {
        if name.starts_with("core-") && name.ends_with(".img") {
            *entry = FileDigest {
                size: core.len() as u64,
                sha256: hex::encode(sha2::Sha256::digest(&core)),
                blake3: String::new(),
            };
            replaced += 1;
        }
    }
    ensure!(replaced > 0, "no core image in {:?}", manifest.files.keys());
    key.sign_manifest(&mut manifest)?;
    let json = manifest.to_json();
    rewrite_archive(archive, out, |member, bytes| {
        let name = member.strip_prefix("checkpoint/").unwrap_or(member);
        Ok(Some(
            if name.starts_with("core-") && name.ends_with(".img") {
                core.clone()
            } else if name == MANIFEST_FILE {
                json.clone()
            } else {
                bytes
            },
        ))
    })
}

#[test]
fn a_non_root_task_restores_with_at_most_the_ambient_set() -> Result<()> {
    // The signer of the rewritten checkpoints, which node B's restore handler trusts.
    let keys = Path::new(RUN_BASE).join("caps-nr-signer");
    let _ = std::fs::remove_dir_all(&keys);
    let key = NodeKey::load_or_create(&keys.join("signer.key"))?;
    let a = node("caps-nr-a")?;
    let mut handler = restore_handler("caps-nr-b", RESTORE_HANDLER)?;
    handler
        .options
        .insert("TrustedKeysDir".to_string(), OptValue::from(keys.as_path()));
    let b = node_with(Node::builder("caps-nr-b")?.extra_runtime(handler))?;
    rt().block_on(async {
        let cri_a = Cri::connect(a.socket()).await?;
        let cri_b = Cri::connect(b.socket()).await?;

        // 1. A non-root task's own checkpoint, where this host's root can take one.
        let own = a.paths().dir.join("caps-nr-own.tar");
        if root_has_cap_sys_resource() {
            checkpoint(&a, &cri_a, &restricted(), &own).await?;
            let pod = cri_b
                .run_pod(&restore_pod("caps-own", &b, &own.display().to_string()))
                .await?;
            let id = cri_b.run_container(&pod, &restricted()).await?;
            let pid = common::gpu::cri_pid(&cri_b, &id).await?;
            let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
            for field in ["CapPrm:\t0000000000000000", "CapEff:\t0000000000000000"] {
                ensure!(
                    status.contains(field),
                    "restored: no {field:?} in\n{status}"
                );
            }
            cri_b.remove_pod(&pod).await?;
        } else {
            let err = checkpoint(&a, &cri_a, &restricted(), &own)
                .await
                .err()
                .context("a non-root checkpoint worked without CAP_SYS_RESOURCE")?;
            not_run_without_cap_sys_resource(
                &err,
                "a non-root task's own checkpoint and restore (the rule is held below through \
                 the shim's check of a checkpoint's record before CRIU)",
            )?;
        }

        // 2. A root counter under the same seccomp profile, its checkpoint rewritten to show
        //    a uid-1000 task that kept the 14 default capabilities: refused before CRIU,
        //    naming permitted and effective (the spec's lists have all 14; a cold start of it
        //    holds none).
        let root = a.paths().dir.join("caps-nr-root.tar");
        checkpoint(
            &a,
            &cri_a,
            &counter().run_as(0, 0).seccomp(ProfileType::RuntimeDefault),
            &root,
        )
        .await?;
        let kept = b.paths().dir.join("caps-nr-kept.tar");
        as_non_root_task(&root, &kept, DEFAULT_CAPS, &key)?;
        let pod = cri_b
            .run_pod(&restore_pod("caps-kept", &b, &kept.display().to_string()))
            .await?;
        let msg = match cri_b.run_container(&pod, &restricted()).await {
            Ok(id) => {
                anyhow::bail!("a non-root task holding the default capabilities restored as {id}")
            }
            Err(e) => format!("{e:#}"),
        };
        println!("kept capabilities: {msg}");
        for part in [
            "the checkpoint's record is beyond this container's spec",
            "CapPrm 00000000a80425fb is beyond the spec's 0000000000000000",
            "CapEff 00000000a80425fb is beyond the spec's 0000000000000000",
        ] {
            ensure!(msg.contains(part), "{part:?} not in: {msg}");
        }
        cri_b.remove_pod(&pod).await?;
        Ok(())
    })
}
