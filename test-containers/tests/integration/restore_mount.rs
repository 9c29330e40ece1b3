//! Restore from a Kubernetes image volume (`gpu-ckpt.io/restore-from: mount:/PATH`), on a real
//! containerd through CRI: a checkpoint built into an OCI image with `gpu-ckpt build --push`
//! to the stack's TLS registry (htpasswd login, private CA), pulled by CRI with the pod's
//! credentials (as the kubelet sends imagePullSecrets), mounted with CRI `Mount.image`, and
//! restored by the restore handler, which reads it in place and takes the mount out of the
//! restored container. Paths that are not the pod's own image volume are refused.

use std::path::{Path, PathBuf};

use crate::common::*;
use anyhow::{ensure, Context, Result};
use test_containers::{
    cri::{ContainerSpec, Cri, Pod, PodSpec},
    registry::TlsRegistry,
    stack::{Node, OptValue},
};

fn key_file(node: &str) -> PathBuf {
    PathBuf::from(test_containers::stack::RUN_BASE)
        .join(format!("{node}-keys"))
        .join("node.key")
}

/// A node with the gpu-ckpt handler (checkpoints) and the restore handler (named as
/// docs/restore-from-registry.md registers it), sharing its key.
fn mount_node(name: &str) -> Result<Node> {
    let key = key_file(name);
    let _ = std::fs::remove_dir_all(key.parent().context("key dir")?);
    // The restore handler with the node's key and no RestoreSources.
    let mut restore = restore_handler(name, RESTORE_HANDLER)?;
    restore.options.remove("RestoreSources");
    restore.options.insert(
        "SigningKey".to_string(),
        OptValue::from(key.display().to_string()),
    );
    node_with(
        Node::builder(name)?
            .runtime_option("SigningKey", key.display().to_string())
            .extra_runtime(restore),
    )
}

/// `gpu-ckpt build ARCHIVE --ref REFERENCE --push FLAGS` with the registry's CA in the hosts
/// directory `hosts` and its login in the auth file `auth`; its output.
fn build_push(
    archive: &Path,
    reference: &str,
    flags: &[&str],
    hosts: &Path,
    auth: &Path,
) -> Result<String> {
    run_ok(
        std::process::Command::new(gpu_ckpt_cli())
            .arg("build")
            .arg(archive)
            .args(["--ref", reference, "--push"])
            .args(flags)
            .arg("--hosts-dir")
            .arg(hosts)
            .arg("--authfile")
            .arg(auth),
    )
}

/// Creates and starts `spec` in a new restore pod: `Ok((pod, id))` when it runs, `Err(text)`
/// when it is refused (the pod removed).
async fn try_start(
    cri: &Cri,
    pod_spec: &PodSpec,
    spec: &ContainerSpec,
) -> Result<std::result::Result<(Pod, String), String>> {
    let pod = cri.run_pod(pod_spec).await?;
    match cri.run_container(&pod, spec).await {
        Ok(id) => Ok(Ok((pod, id))),
        Err(e) => {
            cri.remove_pod(&pod).await?;
            Ok(Err(format!("{e:#}").replace("\\\"", "\"")))
        }
    }
}

/// The host pid of CRI container `id`, from containerd's task list.
fn host_pid(node: &Node, id: &str) -> Result<i32> {
    let out = node.ctr_ns_ok("k8s.io", &["task", "ls"])?;
    out.lines()
        .filter_map(|l| {
            let c: Vec<&str> = l.split_whitespace().collect();
            (c.len() >= 2 && c[0] == id).then(|| c[1].parse().ok())?
        })
        .next()
        .with_context(|| format!("task {id} not in `ctr task ls`:\n{out}"))
}

/// Checkpoints a counting pod of `node` through CRI; returns (archive, counter before).
async fn checkpoint_counter(cri: &Cri, node: &Node) -> Result<(PathBuf, u64)> {
    let (pod, id) = cri_counter_pod(cri, node, "worker").await?;
    let before = cri_counter_above(cri, &id, "/counter.txt", 5).await?;
    let archive = node.paths().dir.join("checkpoint-worker-counter.tar");
    let _ = std::fs::remove_file(&archive);
    cri.checkpoint_container(&id, &archive, 120).await?;
    cri.remove_pod(&pod).await?;
    Ok((archive, before))
}

#[test]
fn an_image_volume_pulled_with_the_pods_login_restores_and_is_not_in_the_restored_container(
) -> Result<()> {
    let registry = TlsRegistry::discover()?;
    let node = mount_node("rmount-a")?;
    // containerd trusts the registry's CA through its hosts directory, as a node would.
    registry.hosts_dir(&node.paths().certs_d, true)?;
    rt().block_on(async {
        let cri = Cri::connect(node.socket())
            .await?
            .with_timeout(std::time::Duration::from_secs(300));
        let (archive, before) = checkpoint_counter(&cri, &node).await?;

        // `gpu-ckpt build --push` with an auth file and the CA in a hosts directory.
        let files = node.paths().dir.join("registry-client");
        let hosts = registry.hosts_dir(&files.join("certs.d"), true)?;
        let auth = registry.auth_file(&files.join("auth.json"), Some(registry.password()))?;
        let reference = format!(
            "{}/ckpt/counter:{}",
            registry.addr,
            test_containers::cri::new_uid()
        );
        let out = build_push(&archive, &reference, &[], &hosts, &auth)?;
        println!("{out}");

        // Without the pod's login the pull fails; with it (an imagePullSecret), it works.
        let denied = cri
            .pull_image(&reference)
            .await
            .err()
            .with_context(|| format!("the TLS registry served {reference} without a login"))?;
        println!("without the pod's login: {denied:#}");
        let image = cri
            .pull_image_with_auth(&reference, registry.user(), registry.password())
            .await?;
        println!("pulled {reference} as {image}");

        // The restore: the image volume at /ckpt, and the annotation naming it for the
        // container `counter` only (a sidecar of the pod restores nothing). The same volume is
        // mounted a second time, at /also.
        let spec = counter_spec()
            .image_volume("/ckpt", &image)
            .image_volume("/also", &image);
        let restore = PodSpec::new("worker", node.pod_log_root())
            .handler(RESTORE_HANDLER)
            .annotation("gpu-ckpt.io/restore-from.counter", "mount:/ckpt");
        let (pod, id) = try_start(&cri, &restore, &spec)
            .await?
            .map_err(anyhow::Error::msg)
            .context("restore from the image volume")?;
        let first = cri_counter(&cri, &id, "/counter.txt").await?;
        ensure!(
            first >= before,
            "restored at {first}, checkpointed after {before}: not the checkpoint's count"
        );
        let later = cri_counter_above(&cri, &id, "/counter.txt", first).await?;
        println!("checkpointed after {before}, restored at {first}, counting on: {later}");
        ensure!(
            node.log_contains("checkpoint read in place from an image volume"),
            "the shim did not read the checkpoint from the image volume"
        );

        // The restored process has no mount at /ckpt nor at /also, and cannot read its
        // checkpoint through either.
        no_checkpoint_mounts(&cri, &node, &id, "the restored container").await?;

        // A checkpoint that does not fit (another engine version) with cold-start: the
        // container starts fresh from its spec, in which neither mount of the volume is left.
        let cold = PodSpec::new("worker-cold", node.pod_log_root())
            .handler(RESTORE_HANDLER)
            .annotation("gpu-ckpt.io/restore-from.counter", "mount:/ckpt")
            .annotation("gpu-ckpt.io/engine-version", "another-engine 2.0")
            .annotation("gpu-ckpt.io/on-incompatible", "cold-start");
        let (cold_pod, cold_id) = try_start(&cri, &cold, &spec)
            .await?
            .map_err(anyhow::Error::msg)
            .context("cold start beside the image volume")?;
        let fresh = cri_counter_above(&cri, &cold_id, "/counter.txt", 0).await?;
        println!("cold start beside the checkpoint: counting from scratch, at {fresh}");
        ensure!(
            node.log_contains("checkpoint cannot be used: cold start"),
            "the shim did not cold-start the container"
        );
        no_checkpoint_mounts(&cri, &node, &cold_id, "the cold-started container").await?;
        cri.remove_pod(&cold_pod).await?;

        // A sidecar of the restored pod that mounts the same image volume is refused at its
        // Create: it would read the memory image.
        let sidecar = ContainerSpec::new("sidecar", workloads())
            .command(&["/bin/counter", "--interval-ms", "100"])
            .image_volume("/data", &image);
        match cri.run_container(&pod, &sidecar).await {
            Ok(sid) => {
                let ls = cri.exec_sync(&sid, &["ls", "/data/checkpoint"], 10).await?;
                anyhow::bail!(
                    "a sidecar mounting the checkpoint's image volume started (ls /data/checkpoint: exit {}, {} entries: {})",
                    ls.exit_code,
                    ls.stdout_str().lines().count(),
                    ls.stdout_str().replace('\n', " ")
                );
            }
            Err(e) => {
                let msg = format!("{e:#}").replace("\\\"", "\"");
                println!("sidecar: {msg}");
                ensure!(
                    msg.contains("holds a checkpoint") && msg.contains("/data"),
                    "the sidecar's refusal does not say why: {msg}"
                );
            }
        }
        // The restored container counts on.
        cri_counter_above(&cri, &id, "/counter.txt", later).await?;

        // Another pod's image volume, named as a hostPath: refused, as is a plain hostPath
        // directory holding the same checkpoint.
        let other = mountinfo_sources(&node)?;
        let unpacked = node.paths().dir.join("unpacked-checkpoint");
        let _ = std::fs::remove_dir_all(&unpacked);
        std::fs::create_dir_all(&unpacked)?;
        run_ok(
            std::process::Command::new("tar")
                .arg("-xf")
                .arg(&archive)
                .arg("-C")
                .arg(&unpacked),
        )?;
        for (what, host) in [
            ("another pod's image volume", other),
            ("a hostPath", unpacked),
        ] {
            let spec = counter_spec().host_path("/ckpt", &host, true);
            let msg = try_start(&cri, &restore_pod("worker", &node, "mount:/ckpt"), &spec)
                .await?
                .err()
                .with_context(|| format!("{what} at /ckpt was restored"))?;
            println!("{what}: {msg}");
            ensure!(
                msg.contains("is not an image volume of this pod"),
                "{what}: the refusal does not say why: {msg}"
            );
        }
        cri.remove_pod(&pod).await?;

        // The same checkpoint with one byte of a page image changed, as a registry or anyone
        // on the way could serve it: pulled and mounted like the first, refused at Start.
        let tampered = node.paths().dir.join("tampered.tar");
        rewrite_archive(&archive, &tampered, |name, mut data| {
            if name.starts_with("checkpoint/pages-") && data.len() > 600 {
                data[600] ^= 1;
            }
            Ok(Some(data))
        })?;
        let reference = format!(
            "{}/ckpt/tampered:{}",
            registry.addr,
            test_containers::cri::new_uid()
        );
        // `build` verifies its input and refuses this one; --no-verify packages it as it is.
        build_push(&tampered, &reference, &["--no-verify"], &hosts, &auth)?;
        let image = cri
            .pull_image_with_auth(&reference, registry.user(), registry.password())
            .await?;
        let spec = counter_spec().image_volume("/ckpt", &image);
        let msg = try_start(&cri, &restore_pod("worker", &node, "mount:/ckpt"), &spec)
            .await?
            .err()
            .context("a tampered checkpoint image restored")?;
        println!("tampered: {msg}");
        ensure!(
            msg.contains("pages-"),
            "the refusal does not name the page image: {msg}"
        );
        Ok(())
    })
}

/// Checks that container `id` (`what`) has no mount at /ckpt nor at /also (the two mounts of
/// the checkpoint's image volume its spec asked for), cannot list the checkpoint through
/// either, and sees no image volume at all.
async fn no_checkpoint_mounts(cri: &Cri, node: &Node, id: &str, what: &str) -> Result<()> {
    let pid = host_pid(node, id)?;
    let path = format!("/proc/{pid}/mountinfo");
    let mountinfo = std::fs::read_to_string(&path)?;
    let table = image_format::mountinfo::parse(&mountinfo, &path)?;
    for at in ["/ckpt", "/also"] {
        let mounted: Vec<_> = table.iter().filter(|m| m.mountpoint == at).collect();
        ensure!(
            mounted.is_empty(),
            "{what} (pid {pid}) has a mount at {at}: {mounted:?}"
        );
        let ls = cri
            .exec_sync(id, &["ls", &format!("{at}/checkpoint")], 10)
            .await?;
        ensure!(
            ls.exit_code != 0,
            "{what} lists its checkpoint at {at}: {}",
            ls.stdout_str().replace('\n', " ")
        );
    }
    ensure!(
        !mountinfo.contains("image-volumes"),
        "{what} (pid {pid}) sees an image volume:\n{mountinfo}"
    );
    Ok(())
}

/// The host directory of an image volume that containerd mounted for some pod of `node`.
fn mountinfo_sources(node: &Node) -> Result<PathBuf> {
    let state = node
        .paths()
        .state
        .join("io.containerd.grpc.v1.cri/image-volumes");
    let path = "/proc/self/mountinfo";
    let mounts = std::fs::read_to_string(path)?;
    image_format::mountinfo::parse(&mounts, path)?
        .into_iter()
        .map(|m| PathBuf::from(m.mountpoint))
        .find(|p| p.starts_with(&state))
        .with_context(|| format!("no image volume mounted below {}", state.display()))
}

#[test]
fn a_mount_path_not_in_the_spec_is_refused() -> Result<()> {
    let node = mount_node("rmount-b")?;
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        cri.pull_image(workloads()).await?;
        for (source, needle) in [
            ("mount:/ckpt", "the container has no mount at /ckpt"),
            ("mount:ckpt", "absolute container path"),
            ("mount:/ckpt/../etc", "without . or .."),
        ] {
            let msg = try_start(&cri, &restore_pod("worker", &node, source), &counter_spec())
                .await?
                .err()
                .with_context(|| format!("{source}: the container started"))?;
            println!("{source}: {msg}");
            ensure!(msg.contains(needle), "{source}: {msg}");
        }
        Ok(())
    })
}
