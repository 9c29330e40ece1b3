//! containerd 2.1's restore-via-create on handler gpu-ckpt, as a user sees it: CRI's
//! ContainerStatus reports the restored process's pid, run after run (containerd asks the
//! shim's Connect right after Start, which answered the pid 0 of Create for a restore about
//! half of the time), and the annotations containerd takes from the archive's unsigned
//! `status.dump` are held to the checkpoint's signed record: rewritten, the restore is refused
//! naming the annotation.

use std::path::{Path, PathBuf};

use crate::common::{gpu::cri_status_pid, *};
use anyhow::{ensure, Context, Result};
use test_containers::{
    cri::{v1::ContainerState, ContainerSpec, Cri, PodSpec},
    stack::{Node, GPU_CKPT_HANDLER},
};

/// How many restores the pid is read from: the pid 0 came in about half of them.
const RUNS: usize = 5;

/// The annotation the checkpointed container runs with (passed into its spec through the
/// handler's `container_annotations`, so recorded in the signed manifest).
const MODEL: (&str, &str) = ("gpu-ckpt.io/model-version", "counter-1");

/// Runs a counter (with [`MODEL`]) in a pod on `node`, checkpoints it through CRI into
/// `name`.tar, and removes the pod.
async fn checkpoint_counter(node: &Node, cri: &Cri, name: &str) -> Result<PathBuf> {
    cri.pull_image(workloads()).await?;
    let pod = cri
        .run_pod(&PodSpec::new(name, node.pod_log_root()).handler(GPU_CKPT_HANDLER))
        .await?;
    let id = cri
        .run_container(&pod, &counter_spec().annotation(MODEL.0, MODEL.1))
        .await?;
    cri_counter_above(cri, &id, "/counter.txt", 3).await?;
    let archive = node.paths().dir.join(format!("{name}.tar"));
    let _ = std::fs::remove_file(&archive);
    cri.checkpoint_container(&id, &archive, 60).await?;
    cri.remove_pod(&pod).await?;
    Ok(archive)
}

/// The annotations of CRI container `id`'s OCI spec (ContainerStatus's verbose info).
async fn spec_annotations(cri: &Cri, id: &str) -> Result<serde_json::Value> {
    let st = cri.container_status(id).await?;
    let info = st.info.get("info").cloned().unwrap_or_default();
    let json: serde_json::Value = serde_json::from_str(&info)?;
    Ok(json
        .pointer("/runtimeSpec/annotations")
        .cloned()
        .unwrap_or_default())
}

/// Whether host process `pid` is a counter in pod `uid`'s cgroup.
fn is_counter_of_pod(pid: i32, uid: &str) -> bool {
    let read = |f: &str| std::fs::read(format!("/proc/{pid}/{f}")).unwrap_or_default();
    read("cmdline").starts_with(b"/bin/counter\0")
        && String::from_utf8_lossy(&read("cgroup")).contains(&format!("pod{uid}"))
}

#[test]
fn restore_via_create_reports_the_restored_pid_through_cri() -> Result<()> {
    let node = node("rvc-pid")?;
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let archive = checkpoint_counter(&node, &cri, "rvc-pid").await?;
        let image = archive.display().to_string();
        let mut pids = Vec::new();
        for run in 1..=RUNS {
            let pod = cri
                .run_pod(
                    &PodSpec::new(&format!("rvc-pid-{run}"), node.pod_log_root())
                        .handler(GPU_CKPT_HANDLER),
                )
                .await?;
            let id = cri
                .run_container(&pod, &ContainerSpec::new("counter", &image))
                .await
                .with_context(|| format!("restore-via-create, run {run}"))?;
            let first = cri_counter(&cri, &id, "/counter.txt").await?;
            cri_counter_above(&cri, &id, "/counter.txt", first).await?;
            let pid = cri_status_pid(&cri, &id).await?;
            println!("run {run}: CRI's ContainerStatus reports pid {pid} for {id}");
            pids.push(pid);
            ensure!(
                pid > 0,
                "run {run}: CRI's ContainerStatus reports pid {pid} for the restored container {id} (pids so far: {pids:?})"
            );
            ensure!(
                is_counter_of_pod(pid, &pod.spec.uid),
                "run {run}: CRI's pid {pid} is not the restored counter of pod {}",
                pod.spec.uid
            );
            cri.remove_pod(&pod).await?;
        }
        println!("{RUNS} restores via create, CRI pids {pids:?}");
        Ok(())
    })
}

/// `archive` with `status.dump`'s annotations changed by `edit`, written next to it as `name`.
fn with_status_annotations(
    archive: &Path,
    name: &str,
    edit: impl Fn(&mut serde_json::Map<String, serde_json::Value>),
) -> Result<PathBuf> {
    let out = archive.with_file_name(name);
    let mut seen = false;
    rewrite_archive(archive, &out, |member, bytes| {
        if member != "status.dump" {
            return Ok(Some(bytes));
        }
        seen = true;
        let mut status: serde_json::Value = serde_json::from_slice(&bytes)?;
        let map = status
            .get_mut("annotations")
            .and_then(|a| a.as_object_mut())
            .context("status.dump has no annotations")?;
        edit(map);
        Ok(Some(serde_json::to_vec(&status)?))
    })?;
    ensure!(seen, "{} has no status.dump", archive.display());
    Ok(out)
}

/// A restore-via-create of `image` in a new pod: `Ok(annotations of the running container's
/// spec)`, or `Err(the error)` with nothing of it running. The pod is removed.
async fn restore_via_create(
    cri: &Cri,
    node: &Node,
    pod_name: &str,
    image: &Path,
) -> Result<std::result::Result<serde_json::Value, String>> {
    let pod = cri
        .run_pod(&PodSpec::new(pod_name, node.pod_log_root()).handler(GPU_CKPT_HANDLER))
        .await?;
    let created = cri
        .create_container(
            &pod,
            &ContainerSpec::new("counter", &image.display().to_string()),
        )
        .await;
    let started = match &created {
        Ok(id) => cri.start_container(id).await,
        Err(e) => Err(anyhow::anyhow!("{e:#}")),
    };
    let result = match (started, &created) {
        (Ok(()), Ok(id)) => {
            let first = cri_counter(cri, id, "/counter.txt").await?;
            cri_counter_above(cri, id, "/counter.txt", first).await?;
            Ok(spec_annotations(cri, id).await?)
        }
        (e, _) => {
            let msg = format!("{:#}", e.err().unwrap_or_else(|| anyhow::anyhow!("?")));
            if let Ok(id) = &created {
                let state = cri.container_state(id).await?;
                ensure!(
                    state != ContainerState::ContainerRunning,
                    "the refused container {id} is running"
                );
            }
            // tonic writes the status message with Debug escapes.
            Err(msg.replace("\\\"", "\""))
        }
    };
    cri.remove_pod(&pod).await?;
    Ok(result)
}

#[test]
fn restore_via_create_holds_status_dump_annotations_to_the_signed_record() -> Result<()> {
    let node = node("rvc-annotations")?;
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let archive = checkpoint_counter(&node, &cri, "rvc-annotations").await?;
        let info = image_format::archive::read_info(&archive, Default::default())?;
        let manifest = info.manifest.context("no gpu-ckpt manifest")?;
        ensure!(
            manifest.container.annotations.get(MODEL.0).map(String::as_str) == Some(MODEL.1),
            "the signed manifest does not record {}: {:?}",
            MODEL.0,
            manifest.container.annotations
        );

        // The archive as it was taken restores, with the annotation it was taken with.
        let annotations = restore_via_create(&cri, &node, "rvc-genuine", &archive)
            .await?
            .map_err(|e| anyhow::anyhow!("the genuine archive was refused: {e}"))?;
        ensure!(
            annotations[MODEL.0] == MODEL.1,
            "restored spec annotations: {annotations}"
        );

        // An annotation added to status.dump: refused, naming it.
        let added = with_status_annotations(&archive, "rvc-added.tar", |a| {
            a.insert("gpu-ckpt.io/tcp".into(), "established".into());
        })?;
        match restore_via_create(&cri, &node, "rvc-added", &added).await? {
            Ok(annotations) => anyhow::bail!(
                "a restore whose status.dump adds gpu-ckpt.io/tcp ran, with spec annotations {annotations}"
            ),
            Err(msg) => {
                println!("added: {msg}");
                ensure!(
                    msg.contains("annotation gpu-ckpt.io/tcp is \"established\" in this container's spec and absent in the checkpoint's signed manifest"),
                    "the refusal does not name the added annotation: {msg}"
                );
            }
        }

        // An annotation changed in status.dump: refused, naming it and both values.
        let changed = with_status_annotations(&archive, "rvc-changed.tar", |a| {
            a.insert(MODEL.0.into(), "other-model".into());
        })?;
        match restore_via_create(&cri, &node, "rvc-changed", &changed).await? {
            Ok(annotations) => anyhow::bail!(
                "a restore whose status.dump changes {} ran, with spec annotations {annotations}",
                MODEL.0
            ),
            Err(msg) => {
                println!("changed: {msg}");
                ensure!(
                    msg.contains(&format!(
                        "annotation {} is \"other-model\" in this container's spec and \"{}\" in the checkpoint's signed manifest",
                        MODEL.0, MODEL.1
                    )),
                    "the refusal does not name the changed annotation: {msg}"
                );
            }
        }
        Ok(())
    })
}
