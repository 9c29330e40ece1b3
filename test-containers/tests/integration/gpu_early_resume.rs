//! `gpu-ckpt.io/resume-after-dump` (the runtime option `ResumeAfterDump` per pod): a CRI
//! CheckpointContainer of a GPU pod resumes it once CRIU's dump and the shim's signed copy of
//! the rootfs changes are done, while containerd still copies the checkpoint and takes its
//! rootfs diff. The workload shows it with its own timestamps (its CRI log lines); the archive
//! restores on another node through the restore handler with the rootfs of the dump's moment
//! and the training going on from its checkpointed step; containerd's own restore-via-create
//! of it is refused (its rootfs-diff.tar was taken after the resume). Without the annotation
//! the same pod stays frozen through containerd's copy; a value other than true or false is
//! refused at Create.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use crate::common::{gpu::*, *};
use crate::gpu_shim::{archive_manifest, create_from_archive, expect_continues, keeps_training};
use anyhow::{bail, ensure, Context, Result};
use test_containers::{
    containerd::{Containerd, EventStream},
    cri::{ContainerSpec, Cri, Pod, PodSpec},
    stack::{Node, GPU_CKPT_HANDLER, GPU_WORKLOADS_IMAGE},
};

const ANNOTATION: &str = "gpu-ckpt.io/resume-after-dump";

/// What the shim logs when containerd's Resume arrives, and when it has nothing to do after a
/// resume right after the dump.
const RESUME_REQUESTED: &str = "resume requested";
const NO_OP_RESUME: &str = "resume: already resumed right after the checkpoint's dump";

/// gpu-train on simulated GPU `device` with a shell beside it that writes `/before-dump.txt`
/// first, then every 20 ms or so a file `/marks/<n>-<uptime>` (the workload's own clock:
/// `/proc/uptime`, CLOCK_BOOTTIME in hundredths of a second, read just before the file is
/// written; the node's until a restore, which goes on from the dump's) and the line
/// `mark <name>`; `resume` sets the annotation.
fn spec(device: &str, resume: Option<&str>) -> ContainerSpec {
    let script = "mkdir -p /marks; echo before > /before-dump.txt; \
        /usr/bin/gpu-train --elements 4194304 --interval-ms 100 & \
        i=0; while :; do i=$((i+1)); n=$i-$(cut -d' ' -f1 /proc/uptime); echo $n > /marks/$n; echo \"mark $n\"; sleep 0.02; done";
    let s = ContainerSpec::new("train", GPU_WORKLOADS_IMAGE)
        .command(&["/bin/sh", "-c", script])
        .annotation(
            &format!("cdi.k8s.io/gpu-ckpt-sim_train-{device}"),
            &format!("{KIND}={device}"),
        );
    match resume {
        Some(v) => s.annotation(ANNOTATION, v),
        None => s,
    }
}

/// When the node booted, on the wall clock (`/proc/uptime` is CLOCK_BOOTTIME).
fn boot_time() -> Result<SystemTime> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `ts`, which lives through the call.
    if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    let up = Duration::new(ts.tv_sec.try_into()?, ts.tv_nsec.try_into()?);
    Ok(SystemTime::now() - up)
}

/// The marks of CRI log `log`: (when the workload wrote it, by its own clock read before the
/// write and cut to 10 ms, so never later than the write; name), in order.
fn marks(log: &Path, boot: SystemTime) -> Vec<(SystemTime, String)> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let name = l.split("mark ").nth(1)?.trim().to_string();
            let uptime: f64 = name.split('-').nth(1)?.parse().ok()?;
            Some((boot + Duration::from_secs_f64(uptime), name))
        })
        .collect()
}

/// The time of the first line of the node's log (from byte `from`) that contains `needle` and
/// names container `id` (the shim's lines start with their RFC 3339 time).
fn node_log_time(node: &Node, from: u64, needle: &str, id: &str) -> Option<SystemTime> {
    let text = std::fs::read(&node.paths().log).ok()?;
    let text = String::from_utf8_lossy(text.get(from as usize..)?).into_owned();
    text.lines()
        .filter(|l| l.contains(needle) && l.contains(&format!("id={id}")))
        .find_map(|l| humantime::parse_rfc3339(l.split_whitespace().next()?).ok())
}

/// The publish time of the first `topic` event about container `id`.
async fn event_time(events: &mut EventStream, id: &str, topic: &str) -> Result<SystemTime> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let Some(e) = events.next_timeout(left).await? else {
            bail!("no {topic} event of {id}");
        };
        if e.topic != topic || e.container_id() != Some(id) {
            continue;
        }
        let ts = e.timestamp.context("event without a time")?;
        return Ok(
            SystemTime::UNIX_EPOCH + Duration::new(ts.seconds.try_into()?, ts.nanos.try_into()?)
        );
    }
}

/// One CRI checkpoint of a running pod, with the moments that place its marks.
struct Checkpointed {
    archive: PathBuf,
    pod: Pod,
    id: String,
    /// The last training step logged before the checkpoint.
    step: u64,
    /// When the task was paused (`/tasks/paused`, published once it is frozen).
    paused: SystemTime,
    /// When the shim said the task was resumed (`/tasks/resumed`: with the option, as its
    /// Checkpoint returns, just after the resume; without it, at containerd's Resume).
    resumed: SystemTime,
    /// When containerd's Resume came, after its copy and rootfs diff (the shim's log).
    containerd_resume: SystemTime,
    /// When CheckpointContainer returned.
    returned: SystemTime,
}

impl Checkpointed {
    /// Marks written after the task was frozen for the checkpoint and (their clock 10 ms on)
    /// before containerd's Resume arrived, that is while containerd still copied the checkpoint.
    fn during_copy(&self, log: &Path, boot: SystemTime) -> Vec<(SystemTime, String)> {
        marks(log, boot)
            .into_iter()
            .filter(|(t, _)| {
                *t > self.paused && *t + Duration::from_millis(10) < self.containerd_resume
            })
            .collect()
    }

    /// Marks written (their clock 10 ms on) before the task was frozen.
    fn before_pause(&self, log: &Path, boot: SystemTime) -> Vec<String> {
        marks(log, boot)
            .into_iter()
            .filter(|(t, _)| *t + Duration::from_millis(10) < self.paused)
            .map(|m| m.1)
            .collect()
    }
}

/// Runs the pod `name` on `node` (`resume`: the annotation's value) and checkpoints it
/// through CRI.
async fn checkpoint(
    node: &Node,
    cri: &Cri,
    api: &Containerd,
    name: &str,
    resume: Option<&str>,
) -> Result<Checkpointed> {
    cri.pull_image(GPU_WORKLOADS_IMAGE).await?;
    let pod = cri
        .run_pod(&PodSpec::new(name, node.pod_log_root()).handler(GPU_CKPT_HANDLER))
        .await?;
    let id = cri.run_container(&pod, &spec("0", resume)).await?;
    let log = pod.container_log("train");
    wait_steps(&log, 3)?;
    let archive = node.paths().dir.join(format!("{name}.tar"));
    let _ = std::fs::remove_file(&archive);
    let mut events = api.subscribe_tasks().await?;
    let from = std::fs::metadata(&node.paths().log).map_or(0, |m| m.len());
    cri.checkpoint_container(&id, &archive, 120).await?;
    let returned = SystemTime::now();
    let paused = event_time(&mut events, &id, "/tasks/paused").await?;
    let resumed = event_time(&mut events, &id, "/tasks/resumed").await?;
    let containerd_resume = wait_until(Duration::from_secs(10), "the Resume's log line", || {
        node_log_time(node, from, RESUME_REQUESTED, &id)
    })?;
    // With the option the shim's Resume has nothing to do, and says so.
    let no_op = wait_until(
        Duration::from_secs(2),
        "the no-op Resume's log line",
        || node_log_time(node, from, NO_OP_RESUME, &id),
    )
    .is_ok();
    ensure!(
        no_op == (resume == Some("true")),
        "containerd's Resume after the copy was answered as a no-op: {no_op}"
    );
    let step = last_step(&log).map(|s| s.0).unwrap_or_default();
    Ok(Checkpointed {
        archive,
        pod,
        id,
        step,
        paused,
        resumed,
        containerd_resume,
        returned,
    })
}

/// Whether `path` exists in CRI container `id`.
async fn exists_in(cri: &Cri, id: &str, path: &str) -> Result<bool> {
    let r = cri.exec_sync(id, &["test", "-e", path], 10).await?;
    Ok(r.exit_code == 0)
}

#[test]
fn cri_checkpoint_resumes_a_gpu_pod_before_containerds_copy_and_restores_the_dumps_moment(
) -> Result<()> {
    // Pods may choose (PodResumeAfterDump); the handler's own default stays off.
    let (_sim_a, sim_b) = (sim_gpus(1, 256, "early-a")?, sim_gpus(1, 256, "early-b")?);
    let pods = [("PodResumeAfterDump", "true")];
    let a = gpu_node("gpu-early-a", &_sim_a, &pods)?;
    let b = gpu_node("gpu-early-b", &sim_b, &pods)?;
    rt().block_on(async {
        let cri_a = Cri::connect(a.socket()).await?;
        let cri_b = Cri::connect(b.socket()).await?;
        let api = Containerd::connect(a.socket(), "k8s.io").await?;
        let boot = boot_time()?;

        // A value other than true or false is refused at Create, naming it.
        let bad = cri_a
            .run_pod(&PodSpec::new("early-bad", a.pod_log_root()).handler(GPU_CKPT_HANDLER))
            .await?;
        let created = cri_a
            .run_container(&bad, &counter_spec().annotation(ANNOTATION, "yes"))
            .await;
        cri_a.remove_pod(&bad).await?;
        let msg = match created {
            Ok(id) => bail!("a container with {ANNOTATION}: \"yes\" ran ({id})"),
            Err(e) => format!("{e:#}").replace("\\\"", "\""),
        };
        ensure!(
            msg.contains("annotation gpu-ckpt.io/resume-after-dump is \"yes\": expected \"true\" or \"false\""),
            "the refusal does not name the annotation and its value: {msg}"
        );

        // With the annotation: the workload runs on while containerd copies.
        let on = checkpoint(&a, &cri_a, &api, "early-on", Some("true")).await?;
        let log_on = on.pod.container_log("train");
        let m = archive_manifest(&on.archive)?;
        let steps: Vec<&str> = m.timings.iter().map(|t| t.step.as_str()).collect();
        ensure!(
            steps.contains(&"resume-after-dump") && steps.contains(&"device-quiesce"),
            "the manifest's timings {steps:?} do not record the resume after the dump and the Pause's device steps"
        );
        let during = on.during_copy(&log_on, boot);
        println!(
            "with the option: resumed {:?} before containerd's Resume, {} marks logged in between (first {:?}), CheckpointContainer returned {:?} after containerd's Resume",
            on.containerd_resume.duration_since(on.resumed).unwrap_or_default(),
            during.len(),
            during.first().map(|m| &m.1),
            on.returned.duration_since(on.containerd_resume).unwrap_or_default(),
        );
        ensure!(
            on.resumed < on.containerd_resume && !during.is_empty(),
            "with {ANNOTATION}: no mark was written while containerd copied the checkpoint (resumed at {:?}, containerd's Resume at {:?}); marks: {:?}",
            on.resumed,
            on.containerd_resume,
            marks(&log_on, boot)
        );
        // Some after the shim's Checkpoint returned (its `/tasks/resumed` comes then), that
        // is while containerd copied.
        ensure!(
            during.iter().any(|(t, _)| *t > on.resumed),
            "no mark written after the Checkpoint returned and before containerd's Resume: {during:?} (returned at {:?})",
            on.resumed
        );
        // The original trains on with correct results; containerd sees it running.
        keeps_training(&log_on, 3, "the checkpointed original")?;
        ensure!(
            cri_a.container_state(&on.id).await?
                == test_containers::cri::v1::ContainerState::ContainerRunning,
            "CRI does not show the checkpointed container running"
        );

        // containerd's own restore-via-create reads its rootfs-diff.tar, taken after the
        // resume: refused, saying why and what to use instead.
        let pod_v = cri_b
            .run_pod(&PodSpec::new("early-rvc", b.pod_log_root()).handler(GPU_CKPT_HANDLER))
            .await?;
        cri_b.pull_image(GPU_WORKLOADS_IMAGE).await?;
        let refused = match create_from_archive(&cri_b, &pod_v, &on.archive, "0").await {
            Ok(id) => cri_b.start_container(&id).await.err(),
            Err(e) => Some(e),
        };
        let msg = format!("{:#}", refused.context("restore-via-create of a checkpoint resumed after its dump ran")?);
        ensure!(
            msg.contains("resumed right after the dump") && msg.contains("gpu-ckpt-restore"),
            "the refusal does not say why: {msg}"
        );
        cri_b.remove_pod(&pod_v).await?;

        // The restore handler on node B: the rootfs of the dump's moment, the training on
        // from its checkpointed step.
        cri_a.remove_pod(&on.pod).await?;
        let pod_r = cri_b
            .run_pod(&restore_pod("early-on", &b, &on.archive.display().to_string()))
            .await?;
        let since = SystemTime::now();
        let id_r = cri_b.run_container(&pod_r, &spec("0", Some("true"))).await?;
        expect_continues(
            &pod_r.container_log("train"),
            since,
            on.step,
            &log_on,
            "restore handler",
        )?;
        ensure!(
            exists_in(&cri_b, &id_r, "/before-dump.txt").await?,
            "/before-dump.txt, written before the dump, is missing from the restored container"
        );
        let before = on.before_pause(&log_on, boot);
        ensure!(!before.is_empty(), "no mark before the checkpoint");
        for name in before.iter().rev().take(3) {
            ensure!(
                exists_in(&cri_b, &id_r, &format!("/marks/{name}")).await?,
                "mark {name}, written before the dump, is missing from the restored container"
            );
        }
        // CRIU restores the tasks into a time namespace whose CLOCK_BOOTTIME goes on from the
        // dump's moment, so the restored shell names its own marks with the same numbers and
        // nearly the same uptimes as the original's after the resume: a name both wrote is the
        // restored shell's own when its log says so.
        let mut present = Vec::new();
        for (_, name) in &during {
            if exists_in(&cri_b, &id_r, &format!("/marks/{name}")).await? {
                present.push(name.clone());
            }
        }
        if !present.is_empty() {
            std::thread::sleep(Duration::from_secs(1));
            let own: Vec<String> = marks(&pod_r.container_log("train"), boot)
                .into_iter()
                .map(|m| m.1)
                .collect();
            let leaked: Vec<&String> = present.iter().filter(|n| !own.contains(n)).collect();
            println!(
                "{} of the marks written while containerd copied have a name the restored shell also wrote: {present:?}",
                present.len()
            );
            ensure!(
                leaked.is_empty(),
                "marks {leaked:?}, written after the resume while containerd copied, are in the restored container (the restored shell's own marks: {:?})",
                own.iter().take(20).collect::<Vec<_>>()
            );
        }
        // gpu-train (the shell's child) holds node B's GPU.
        let held = wait_until(Duration::from_secs(20), "node B's GPU to be held", || {
            sim_b.processes().ok().filter(|p| !p.is_empty())
        })?;
        ensure!(
            held.iter().all(|p| p.gpu == sim_b.node().gpus[0].uuid),
            "the restored training does not run on node B's GPU: {held:?}"
        );
        cri_b.remove_pod(&pod_r).await?;

        // The same pod without the annotation stays frozen through containerd's copy: no
        // mark between the pause and containerd's Resume.
        let off = checkpoint(&a, &cri_a, &api, "early-off", None).await?;
        let log_off = off.pod.container_log("train");
        let m = archive_manifest(&off.archive)?;
        ensure!(
            !m.timings.iter().any(|t| t.step == "resume-after-dump"),
            "without the option the manifest records a resume after the dump: {:?}",
            m.timings
        );
        let during = off.during_copy(&log_off, boot);
        println!(
            "without the option: {} marks before containerd's Resume after the pause",
            during.len()
        );
        let after = |t: &SystemTime| t.duration_since(off.paused).unwrap_or_default();
        ensure!(
            during.is_empty(),
            "without {ANNOTATION} the workload ran while containerd copied: {:?} after the pause; resumed {:?} after it; timings {:?}",
            during.iter().map(|(t, n)| (after(t), n)).collect::<Vec<_>>(),
            after(&off.resumed),
            m.timings
        );
        cri_a.remove_pod(&off.pod).await?;
        Ok(())
    })
}
