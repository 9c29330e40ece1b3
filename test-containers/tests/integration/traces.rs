//! Traces of checkpoints and restores (docs/tracing.md): on a GPU node with the simulated driver,
//! driven through CRI as the kubelet drives it, containerd exports its own traces (the standard
//! `OTEL_EXPORTER_OTLP_*` variables in its environment) to one OTLP receiver and the shim,
//! through the handler's `OtlpEndpoint`, to another (the option wins over the variables the shim
//! inherits from containerd). A checkpoint that succeeds is a `checkpoint` span of service
//! gpu-ckpt-shim whose children are its steps, in the order they ran, named as the manifest's
//! timings. CRI and ctr pause a task before they checkpoint it and the device steps run in that
//! Pause: the root opens there, so its parent is containerd's span of the Pause ttrpc call
//! (otelttrpc, W3C `traceparent` in the ttrpc metadata), in containerd's trace, and the Pause's
//! device steps and the Checkpoint's steps are its children. A device checkpoint that fails (in
//! the Pause) marks its step and the root Error, with the message; a restore is a `restore` span
//! with its steps. A Pause that no checkpoint follows is a `pause` span, ended at the Resume.

use std::time::Duration;

use crate::common::{gpu::*, *};
use crate::gpu_shim::{archive_manifest, checkpoint_train, keeps_training, train_spec};
use anyhow::{ensure, Context, Result};
use simgpu::proto::FaultOp;
use test_containers::{
    cri::Cri,
    otlp::{OtlpReceiver, ReceivedSpan, SpanStatus},
    stack::Node,
};

/// How long spans may take to arrive: the shim flushes before it replies; containerd's batch
/// goes every 200 ms (`OTEL_BSP_SCHEDULE_DELAY` below).
const ARRIVE: Duration = Duration::from_secs(30);

const SHIM: &str = "gpu-ckpt-shim";

/// The shim's operation roots named `name`, in the order they came.
fn roots<'a>(spans: &'a [ReceivedSpan], name: &str) -> Vec<&'a ReceivedSpan> {
    spans
        .iter()
        .filter(|s| s.service.as_deref() == Some(SHIM) && s.name == name)
        .collect()
}

/// The children of `root`, in the order they started.
fn children<'a>(spans: &'a [ReceivedSpan], root: &ReceivedSpan) -> Vec<&'a ReceivedSpan> {
    let mut c: Vec<&ReceivedSpan> = spans
        .iter()
        .filter(|s| s.parent_span_id.as_deref() == Some(root.span_id.as_str()))
        .collect();
    c.sort_by_key(|s| s.start_unix_nano);
    c
}

/// The spans, one a line: service, name, ids, parent, status.
fn summary(spans: &[ReceivedSpan]) -> String {
    spans
        .iter()
        .map(|s| {
            format!(
                "\n  {}/{} trace {} span {} parent {:?} {:?} {:?}",
                s.service.as_deref().unwrap_or("?"),
                s.name,
                s.trace_id,
                s.span_id,
                s.parent_span_id,
                s.status,
                s.status_message
            )
        })
        .collect()
}

fn names<'a>(spans: &[&'a ReceivedSpan]) -> Vec<&'a str> {
    spans.iter().map(|s| s.name.as_str()).collect()
}

/// Manifest timings that are no step of their own: `device-quiesce` is a Pause's whole device
/// quiesce (its NCCL and device steps), `nccl-release` is timed within `nccl-quiesce`.
const AGGREGATE_TIMINGS: [&str; 2] = ["device-quiesce", "nccl-release"];

/// Steps with a span that the manifest's timings do not list (a failure there is in the record).
const UNTIMED_STEPS: [&str; 1] = ["prepare"];

/// The root's children `steps` (in the order they started) are the manifest's steps in the
/// order they ran: the timings that are steps, in the manifest's order, and no other span but
/// an untimed step.
fn steps_are_the_manifests(
    steps: &[&ReceivedSpan],
    manifest: &image_format::Manifest,
    spans: &[ReceivedSpan],
) -> Result<()> {
    let want: Vec<&str> = manifest
        .timings
        .iter()
        .map(|t| t.step.as_str())
        .filter(|s| !AGGREGATE_TIMINGS.contains(s))
        .collect();
    let got: Vec<&str> = names(steps)
        .into_iter()
        .filter(|s| !UNTIMED_STEPS.contains(s))
        .collect();
    ensure!(
        got == want,
        "the checkpoint's child spans {:?} are not the manifest's steps {want:?} (timings {:?}); all spans: {}",
        names(steps),
        manifest.timings,
        summary(spans)
    );
    Ok(())
}

/// The position of step `name` among `steps`.
fn at(steps: &[&ReceivedSpan], name: &str) -> Result<usize> {
    steps
        .iter()
        .position(|s| s.name == name)
        .with_context(|| format!("no step {name} in {:?}", names(steps)))
}

/// Every span of the shim's trace of `root` (root, steps) is in one trace, from the shim, ends
/// after it starts, and the steps lie within the root.
fn well_formed(root: &ReceivedSpan, steps: &[&ReceivedSpan]) -> Result<()> {
    ensure!(
        root.end_unix_nano >= root.start_unix_nano,
        "root ends before it starts: {root:?}"
    );
    for s in steps {
        ensure!(
            s.trace_id == root.trace_id && s.service.as_deref() == Some(SHIM),
            "step {s:?} is not in the root's trace {}",
            root.trace_id
        );
        ensure!(
            s.start_unix_nano >= root.start_unix_nano && s.end_unix_nano <= root.end_unix_nano,
            "step {} is not within {}: {s:?} / {root:?}",
            s.name,
            root.name
        );
    }
    Ok(())
}

/// The root's parent is a span containerd exported, of the same trace: the ttrpc client call of
/// `method` (otelttrpc names it `containerd.task.v3.Task/<Method>` in containerd 2.x).
fn joins_containerd(
    containerd: &OtlpReceiver,
    root: &ReceivedSpan,
    method: &str,
) -> Result<ReceivedSpan> {
    let parent = root
        .parent_span_id
        .clone()
        .with_context(|| format!("the shim's {} has no parent: {root:?}", root.name))?;
    let spans = containerd.wait_for(&format!("containerd's span {parent}"), ARRIVE, |s| {
        s.iter().any(|c| c.span_id == parent)
    })?;
    let p = spans
        .iter()
        .find(|c| c.span_id == parent)
        .cloned()
        .context("parent")?;
    ensure!(
        p.trace_id == root.trace_id,
        "containerd's span {p:?} is in another trace than the shim's {root:?}"
    );
    ensure!(
        p.service.as_deref() == Some("containerd"),
        "the parent is not containerd's: {p:?}"
    );
    ensure!(
        p.name.starts_with("containerd.task.v") && p.name.ends_with(&format!(".Task/{method}")),
        "the parent is {:?}, not the ttrpc call {method}",
        p.name
    );
    Ok(p)
}

#[test]
fn checkpoint_and_restore_spans_join_containerds_trace() -> Result<()> {
    let containerd_rx = OtlpReceiver::start()?;
    let shim_rx = OtlpReceiver::start()?;
    let sim = sim_gpus(1, 256, "traces")?;
    let name = "traces-gpu";
    let builder = Node::builder(name)?
        .env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            &containerd_rx.http_endpoint(),
        )
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        .env("OTEL_BSP_SCHEDULE_DELAY", "200");
    let endpoint = shim_rx.http_endpoint();
    let node = gpu_node_with(
        builder,
        name,
        &sim,
        &[
            ("OtlpEndpoint", endpoint.as_str()),
            ("OtlpProtocol", "http/protobuf"),
        ],
    )?;
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;

        // 1. A checkpoint: a root `checkpoint` whose children are the manifest's steps, in
        //    order, and whose parent is containerd's ttrpc call in containerd's trace.
        let (archive, pod, id, _) = checkpoint_train(&node, &cri, "traces", "0").await?;
        let log = pod.container_log("train");
        let spans = shim_rx.wait_for("a checkpoint span", ARRIVE, |s| {
            !roots(s, "checkpoint").is_empty()
        })?;
        let root = roots(&spans, "checkpoint");
        ensure!(root.len() == 1, "one checkpoint, roots {root:?}");
        let root = root[0];
        let steps = children(&spans, root);
        let manifest = archive_manifest(&archive)?;
        steps_are_the_manifests(&steps, &manifest, &spans)?;
        // The Pause's device steps, then the Checkpoint's.
        ensure!(
            at(&steps, "device-lock")? < at(&steps, "device-checkpoint")?
                && at(&steps, "device-checkpoint")? < at(&steps, "prepare")?
                && at(&steps, "prepare")? < at(&steps, "criu-dump")?,
            "steps out of the order they ran: {:?}",
            names(&steps)
        );
        well_formed(root, &steps)?;
        ensure!(
            root.status != SpanStatus::Error && steps.iter().all(|s| s.status != SpanStatus::Error),
            "a successful checkpoint with an error: {root:?} {steps:?}"
        );
        ensure!(
            root.attribute("container.id") == Some(id.as_str())
                && root.attribute("k8s.pod.name") == Some("traces")
                && root.attribute("k8s.container.name") == Some("train")
                && root.attribute("gpu_ckpt.outcome") == Some("succeeded"),
            "the root's attributes: {:?}",
            root.attributes
        );
        let pause = joins_containerd(&containerd_rx, root, "Pause")?;
        // containerd's Checkpoint call is of the same trace (CRI's CheckpointContainer).
        let call = containerd_rx.wait_for("containerd's Checkpoint call", ARRIVE, |s| {
            s.iter().any(|c| c.name.ends_with(".Task/Checkpoint"))
        })?;
        ensure!(
            call.iter()
                .any(|c| c.name.ends_with(".Task/Checkpoint") && c.trace_id == root.trace_id),
            "containerd's Checkpoint call is not in the trace of its Pause {pause:?}: {}",
            summary(&call)
        );
        // The option, not the inherited OTEL_EXPORTER_OTLP_ENDPOINT, says where the shim's go.
        ensure!(
            containerd_rx
                .spans()
                .iter()
                .all(|s| s.service.as_deref() != Some(SHIM)),
            "the shim's spans went to containerd's endpoint too"
        );
        keeps_training(&log, 2, "after the checkpoint")?;

        // 2. The device checkpoint fails: its span and the root are Error, with the message.
        let pid = cri_pid(&cri, &id).await?;
        sim.fault(Some(pid), FaultOp::CheckpointFail, true)?;
        let failed_archive = node.paths().dir.join("traces-failed.tar");
        let failed = cri.checkpoint_container(&id, &failed_archive, 60).await;
        sim.fault(Some(pid), FaultOp::CheckpointFail, false)?;
        let failed = match failed {
            Ok(_) => anyhow::bail!("the checkpoint succeeded under the fault"),
            Err(e) => format!("{e:#}"),
        };
        let spans = shim_rx.wait_for("a second checkpoint span", ARRIVE, |s| {
            roots(s, "checkpoint").len() >= 2
        })?;
        let root = *roots(&spans, "checkpoint").last().context("root")?;
        let steps = children(&spans, root);
        well_formed(root, &steps)?;
        ensure!(
            names(&steps) == ["device-lock", "device-checkpoint"],
            "the failed Pause's steps: {:?}",
            names(&steps)
        );
        let last = *steps.last().context("the failed checkpoint has no step")?;
        ensure!(
            last.name == "device-checkpoint"
                && last.status == SpanStatus::Error
                && !last.status_message.is_empty(),
            "the failing step's span: {last:?} (steps {:?})",
            names(&steps)
        );
        ensure!(
            steps[..steps.len() - 1]
                .iter()
                .all(|s| s.status != SpanStatus::Error)
                && names(&steps).contains(&"device-lock"),
            "steps before the failure: {steps:?}"
        );
        ensure!(
            root.status == SpanStatus::Error
                && !root.status_message.is_empty()
                && root.attribute("gpu_ckpt.outcome") == Some("failed"),
            "the failed checkpoint's root: {root:?}"
        );
        ensure!(
            failed.contains(&last.status_message) || last.status_message.contains("CUDA_ERROR"),
            "the step's message {:?} is not the error CRI got: {failed}",
            last.status_message
        );
        // The failure is in the Pause: its root ends there.
        joins_containerd(&containerd_rx, root, "Pause")?;
        keeps_training(&log, 3, "after the failed checkpoint")?;
        cri.remove_pod(&pod).await?;

        // 3. A restore by the restore handler: a root `restore` with its steps in order.
        let pod_r = cri
            .run_pod(&restore_pod(
                "traces-r",
                &node,
                &archive.display().to_string(),
            ))
            .await?;
        cri.run_container(&pod_r, &train_spec("train", "0")).await?;
        keeps_training(&pod_r.container_log("train"), 2, "the restored training")?;
        let spans = shim_rx.wait_for("a restore span", ARRIVE, |s| {
            !roots(s, "restore").is_empty()
        })?;
        let root = roots(&spans, "restore");
        ensure!(root.len() == 1, "one restore, roots {root:?}");
        let root = root[0];
        let steps = children(&spans, root);
        well_formed(root, &steps)?;
        let got = names(&steps);
        let at = |s: &str| got.iter().position(|n| *n == s);
        ensure!(
            ["verify", "criu-restore", "device-restore"]
                .iter()
                .all(|s| at(s).is_some())
                && at("verify") < at("criu-restore")
                && at("criu-restore") < at("device-restore"),
            "restore steps out of order or missing: {got:?}"
        );
        ensure!(
            root.status != SpanStatus::Error
                && root.attribute("gpu_ckpt.outcome") == Some("succeeded"),
            "the restore's root: {root:?}"
        );
        // The restore runs at Start (the restore handler's Create stages it).
        joins_containerd(&containerd_rx, root, "Start")?;
        cri.remove_pod(&pod_r).await?;
        // Every Pause was a checkpoint's: none ended as a `pause`.
        let pauses = roots(&shim_rx.spans(), "pause").len();
        ensure!(
            pauses == 0,
            "{pauses} `pause` roots: {}",
            summary(&shim_rx.spans())
        );
        Ok(())
    })
}

/// A checkpoint through ctr on a node whose containerd does not trace (it sends no trace
/// context): the shim, its handler's `OtlpProtocol` grpc, exports a `checkpoint` span that
/// starts its own trace, over gRPC, its children the manifest's steps in order. A `ctr task
/// pause` and `resume` before it is a `pause` span, succeeded, and no record.
#[test]
fn ctr_checkpoint_over_grpc_stands_alone_without_containerds_context() -> Result<()> {
    let rx = OtlpReceiver::start()?;
    let name = "traces-grpc";
    // ctr sends no runtime options: the shim reads them from the handler's file.
    let dir = test_containers::stack::Stack::discover()?.node_dir(name);
    std::fs::create_dir_all(&dir)?;
    let options = dir.join("gpu-ckpt-handler.toml");
    std::fs::write(
        &options,
        format!(
            "OtlpEndpoint = \"{}\"\nOtlpProtocol = \"grpc\"\n",
            rx.grpc_endpoint()
        ),
    )?;
    let node = node_with(
        Node::builder(name)?.env("GPU_CKPT_HANDLER_CONFIG", &options.display().to_string()),
    )?;
    start_counter(&node, "t1", "100")?;
    node.ctr_ok(&["task", "pause", "t1"])?;
    node.ctr_ok(&["task", "resume", "t1"])?;
    let spans = rx.wait_for("a pause span", ARRIVE, |s| !roots(s, "pause").is_empty())?;
    let pause = roots(&spans, "pause");
    ensure!(
        pause.len() == 1
            && pause[0].attribute("gpu_ckpt.outcome") == Some("succeeded")
            && pause[0].attribute("container.id") == Some("t1")
            && pause[0].status != SpanStatus::Error
            && roots(&spans, "checkpoint").is_empty(),
        "a Pause and Resume: {}",
        summary(&spans)
    );
    let dir = node.paths().dir.join("traces-t1");
    node.checkpoint_task_exit("t1", &dir)?;
    let spans = rx.wait_for("a checkpoint span", ARRIVE, |s| {
        !roots(s, "checkpoint").is_empty()
    })?;
    let root = roots(&spans, "checkpoint");
    ensure!(root.len() == 1, "one checkpoint, roots {root:?}");
    let root = root[0];
    ensure!(
        root.parent_span_id.is_none(),
        "containerd sent no trace context, yet the root has a parent: {root:?}"
    );
    ensure!(
        spans.iter().all(|s| s.protocol == "grpc"),
        "spans not over gRPC: {}",
        summary(&spans)
    );
    let steps = children(&spans, root);
    let manifest = image_format::Manifest::read_from(&dir)?;
    steps_are_the_manifests(&steps, &manifest, &spans)?;
    ensure!(
        at(&steps, "prepare")? < at(&steps, "criu-dump")?,
        "steps out of the order they ran: {:?}",
        names(&steps)
    );
    well_formed(root, &steps)?;
    ensure!(
        root.attribute("container.id") == Some("t1")
            && root.attribute("gpu_ckpt.outcome") == Some("succeeded"),
        "the root's attributes: {:?}",
        root.attributes
    );
    node.ctr_ok(&["task", "rm", "t1"])?;
    node.ctr_ok(&["container", "rm", "t1"])?;
    Ok(())
}
