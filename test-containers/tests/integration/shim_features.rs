//! The shim's `-info` reports the OCI features of the runc it drives, as containerd-shim-runc-v2
//! does, so that CRI advertises the same handler features for gpu-ckpt and gpu-ckpt-restore as
//! for runc: recursive read-only mounts work on gpu-ckpt pods, invalid ones are refused as on
//! runc, and a checkpointed pod keeps its recursive read-only mount on a second node.
//!
//! Needs root and the stack from `make deps`; fails (never skips) when it is missing.

use std::path::Path;
use std::process::Command;

use crate::common::{
    can_write, counter_with, expect_rro_counter, handler_features, mount, node_with,
    restore_node_with, runc_typed_handler, workloads, NestedMount, RUNC_TYPED,
};
use anyhow::{bail, ensure, Context, Result};
use containerd_shim_protos::protobuf::well_known_types::any::Any;
use containerd_shim_protos::protobuf::Message;
use containerd_shim_protos::shim::oci::Options as RuncOptions;
use containerd_shim_protos::types::introspection::RuntimeInfo;
use k8s_cri::v1 as cri;
use test_containers::cri::{ContainerSpec, Cri, Pod, PodSpec};
use test_containers::stack::{Node, Stack, RUNC_HANDLER};

fn rt() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// `<shim> -info` with `options` (an encoded Any, or nothing) on stdin.
fn runtime_info(shim: &Path, options: &[u8]) -> Result<RuntimeInfo> {
    use std::io::Write;
    let mut child = Command::new(shim)
        .arg("-info")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("running {} -info", shim.display()))?;
    child.stdin.take().context("stdin")?.write_all(options)?;
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "{} -info: {}",
        shim.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(RuntimeInfo::parse_from_bytes(&out.stdout)?)
}

/// containerd.runc.v1.Options naming `binary`, as an Any, as containerd passes it to `-info`.
fn runc_options(binary: &Path) -> Result<Vec<u8>> {
    let opts = RuncOptions {
        binary_name: binary.display().to_string(),
        ..Default::default()
    };
    let any = Any {
        type_url: "containerd.runc.v1.Options".into(),
        value: opts.write_to_bytes()?,
        ..Default::default()
    };
    Ok(any.write_to_bytes()?)
}

/// The features of an -info answer: their type URL and JSON.
fn features_of(info: &RuntimeInfo) -> Option<(String, serde_json::Value)> {
    let f = info.features.as_ref()?;
    Some((f.type_url.clone(), serde_json::from_slice(&f.value).ok()?))
}

#[test]
fn info_reports_the_features_runc_v2_reports() -> Result<()> {
    let stack = Stack::discover()?;
    let ours = stack.shim_dir().join("containerd-shim-gpu-ckpt-v1");
    let runc_v2 = stack.prefix().join("root/usr/bin/containerd-shim-runc-v2");
    let runc = Path::new(test_containers::stack::RUNC_BINARY);
    for options in [Vec::new(), runc_options(runc)?] {
        let theirs = features_of(&runtime_info(&runc_v2, &options)?)
            .context("runc-v2 reports no features")?;
        let mine =
            features_of(&runtime_info(&ours, &options)?).context("gpu-ckpt reports no features")?;
        ensure!(
            mine == theirs,
            "gpu-ckpt -info features {mine:?}\nrunc-v2 -info features {theirs:?}"
        );
        ensure!(
            theirs.1["mountOptions"]
                .as_array()
                .is_some_and(|o| o.iter().any(|m| m == "rro")),
            "this runc has recursive read-only mounts"
        );
    }
    // A runc too old for `features`: no features and no error, as with runc-v2.
    let dir = tempfile::tempdir()?;
    let old = dir.path().join("runc");
    std::fs::write(
        &old,
        "#!/bin/sh\necho 'No help topic for features' >&2\nexit 1\n",
    )?;
    std::fs::set_permissions(
        &old,
        <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o755),
    )?;
    for shim in [&runc_v2, &ours] {
        let info = runtime_info(shim, &runc_options(&old)?)?;
        ensure!(
            info.features.is_none(),
            "{}: features from a runc without them",
            shim.display()
        );
    }
    Ok(())
}

#[test]
fn cri_reports_the_same_handler_features_as_for_runc() -> Result<()> {
    let node = restore_node_with(
        runc_typed_handler(Node::builder("feat-list")?, "feat-list")?,
        "feat-list",
    )?;
    rt()?.block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let features = handler_features(&cri).await?;
        let runc = *features
            .get(RUNC_HANDLER)
            .context("no runc handler in CRI's status")?;
        ensure!(
            runc.0,
            "runc supports recursive read-only mounts on this node: {features:?}"
        );
        let f = features
            .get(RUNC_TYPED)
            .with_context(|| format!("no {RUNC_TYPED} handler: {features:?}"))?;
        ensure!(*f == runc, "{RUNC_TYPED} reports {f:?}, runc {runc:?}");
        Ok(())
    })
}

async fn run_counter(
    cri: &Cri,
    node: &Node,
    handler: &str,
    spec: &ContainerSpec,
) -> Result<(Pod, String)> {
    cri.pull_image(workloads()).await?;
    let pod = cri
        .run_pod(&PodSpec::new("rro", node.pod_log_root()).handler(handler))
        .await?;
    let id = cri.run_container(&pod, spec).await?;
    Ok((pod, id))
}

#[test]
fn recursive_read_only_mounts_hold_under_the_gpu_ckpt_shim() -> Result<()> {
    let node = node_with(runc_typed_handler(Node::builder("feat-rro")?, "feat-rro")?)?;
    let host = NestedMount::new()?;
    rt()?.block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        // The counter with the host's nested mount bound read-only, not recursively.
        let private = cri::MountPropagation::PropagationPrivate;
        let plain = counter_with(mount(host.path(), true, false, private));
        let (pod, id) = run_counter(&cri, &node, RUNC_TYPED, &plain).await?;
        ensure!(
            !can_write(&cri, &id, "/data/top").await?,
            "a read-only bind is read-only on top"
        );
        ensure!(
            can_write(&cri, &id, "/data/sub/below").await?,
            "a plain read-only bind leaves sub-mounts writable"
        );
        cri.remove_pod(&pod).await?;

        expect_rro_counter(&cri, &node, RUNC_TYPED, host.path()).await
    })
}

#[test]
fn invalid_recursive_read_only_mounts_are_refused_as_on_runc() -> Result<()> {
    let node = node_with(runc_typed_handler(
        Node::builder("feat-invalid")?,
        "feat-invalid",
    )?)?;
    let host = NestedMount::new()?;
    rt()?.block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        cri.pull_image(workloads()).await?;
        let invalid = [
            (
                "read-write",
                mount(
                    host.path(),
                    false,
                    true,
                    cri::MountPropagation::PropagationPrivate,
                ),
            ),
            (
                "rslave",
                mount(
                    host.path(),
                    true,
                    true,
                    cri::MountPropagation::PropagationHostToContainer,
                ),
            ),
            (
                "rshared",
                mount(
                    host.path(),
                    true,
                    true,
                    cri::MountPropagation::PropagationBidirectional,
                ),
            ),
        ];
        for handler in [RUNC_HANDLER, RUNC_TYPED] {
            let pod = cri
                .run_pod(
                    &PodSpec::new(&format!("bad-{handler}"), node.pod_log_root()).handler(handler),
                )
                .await?;
            for (what, m) in &invalid {
                match cri.create_container(&pod, &counter_with(m.clone())).await {
                    Ok(id) => bail!(
                        "{handler}: a recursive read-only mount that is {what} was accepted ({id})"
                    ),
                    Err(e) => {
                        let msg = format!("{e:#}");
                        ensure!(
                            msg.contains("recursive read-only") || msg.contains("rro"),
                            "{handler}, {what}: {msg}"
                        );
                        ensure!(
                            !msg.contains("not implement"),
                            "{handler}, {what}: refused for want of the feature: {msg}"
                        );
                    }
                }
            }
            cri.remove_pod(&pod).await?;
        }
        Ok(())
    })
}
