//! The node's record of checkpoints and restores (`EventsDir`, the `journal` crate): on one GPU
//! node with the simulated driver, through CRI as the kubelet drives it, a checkpoint that
//! succeeds, one whose device checkpoint fails (the simulator's fault), a restore the restore
//! handler refuses at Create and one it completes each leave exactly one record, read back with
//! `journal::read_all`, with the outcome, the steps in the order they ran, the error's step and
//! class, the bytes moved, the application's frozen time and the GPUs. The journal starts with
//! the half line a writer killed mid-write leaves: the shim's first append ends that line, which
//! stays the one line read as no record, and every record after it is whole.

use std::path::Path;

use crate::common::{gpu::*, *};
use crate::gpu_shim::{archive_manifest, checkpoint_train, keeps_training, train_spec};
use anyhow::{ensure, Context, Result};
use journal::{Operation, Outcome, Record};
use simgpu::proto::FaultOp;
use test_containers::cri::Cri;

/// The records of `dir` appended after the first `seen`, all of them well-formed: the one torn
/// line planted before the test is the only line that is no record.
fn records_after(dir: &Path, seen: usize) -> Result<Vec<Record>> {
    let (all, skipped) =
        journal::read_all(dir).with_context(|| format!("read the records in {}", dir.display()))?;
    ensure!(
        skipped.torn == 1 && skipped.corrupt == 0,
        "want the planted torn line as the only line that is no record: {skipped:?}"
    );
    Ok(all.into_iter().skip(seen).collect())
}

/// The one record of `operation` among `new`.
fn only<'a>(new: &'a [Record], operation: Operation, what: &str) -> Result<&'a Record> {
    let found: Vec<&Record> = new.iter().filter(|r| r.operation == operation).collect();
    ensure!(
        found.len() == 1,
        "{what}: want one {operation:?} record, got {}: {new:#?}",
        found.len()
    );
    Ok(found[0])
}

fn step_names(r: &Record) -> Vec<&str> {
    r.steps.iter().map(|s| s.name.as_str()).collect()
}

/// What a writer killed inside its `write(2)` leaves: the first half of a record's line, no end.
/// (journal/tests/crash.rs kills writers there; this is the shim's append after one.)
fn plant_torn_line(events: &Path) -> Result<()> {
    let j = journal::Journal::open(events, journal::DEFAULT_SEGMENT_BYTES)?;
    j.append(&Record::new(
        Operation::Checkpoint,
        "k8s.io",
        "killed-mid-write",
    ))?;
    let current = events.join(journal::CURRENT_FILE);
    let len = std::fs::metadata(&current)?.len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&current)?
        .set_len(len / 2)?;
    let (all, skipped) = journal::read_all(events)?;
    ensure!(
        all.is_empty() && skipped.torn == 1,
        "the planted half line: {all:?} {skipped:?}"
    );
    Ok(())
}

#[test]
fn checkpoints_and_restores_leave_one_record_each() -> Result<()> {
    let sim = sim_gpus(1, 256, "records")?;
    let name = "records-gpu";
    let events = test_containers::stack::Stack::discover()?
        .node_dir(name)
        .join("events");
    let _ = std::fs::remove_dir_all(&events);
    let events_opt = events.display().to_string();
    plant_torn_line(&events)?;
    let node = gpu_node(name, &sim, &[("EventsDir", events_opt.as_str())])?;
    let gpu = sim.uuids()[0].clone();
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;

        // 1. A checkpoint through CRI (pause, checkpoint, resume): succeeded, its steps those of
        //    the manifest in their order, its bytes and GPU, a frozen time within its duration.
        let (archive, pod, id, _) = checkpoint_train(&node, &cri, "records", "0").await?;
        let log = pod.container_log("train");
        let new = records_after(&events, 0)?;
        let r = only(&new, Operation::Checkpoint, "a successful checkpoint")?;
        ensure!(
            r.outcome == Outcome::Succeeded && r.error.is_none(),
            "{r:#?}"
        );
        let manifest = archive_manifest(&archive)?;
        let want: Vec<&str> = manifest.timings.iter().map(|t| t.step.as_str()).collect();
        ensure!(
            step_names(r) == want,
            "the record's steps {:?} are not the manifest's {want:?}",
            step_names(r)
        );
        for step in ["device-lock", "device-checkpoint", "criu-dump"] {
            ensure!(step_names(r).contains(&step), "no {step} in {r:#?}");
        }
        ensure!(r.host_bytes > 0, "no host bytes: {r:#?}");
        ensure!(r.device_bytes > 0, "no device bytes: {r:#?}");
        let frozen = r.frozen_seconds.context("no frozen time")?;
        ensure!(
            frozen > 0.0 && frozen <= r.duration_seconds,
            "frozen {frozen} s of a {} s checkpoint",
            r.duration_seconds
        );
        ensure!(r.gpus == vec![gpu.clone()], "GPUs {:?}, want {gpu}", r.gpus);
        ensure!(r.driver.is_some() && r.signing_key.is_some(), "{r:#?}");
        ensure!(
            r.container_id == id
                && r.namespace == "k8s.io"
                && r.pod.as_deref() == Some("records")
                && r.container.as_deref() == Some("train"),
            "the record does not name the pod's container: {r:#?}"
        );
        keeps_training(&log, 2, "after the checkpoint")?;

        // 2. The device checkpoint fails (CUDA_ERROR_OPERATING_SYSTEM): failed at step
        //    device-checkpoint, class step, after the lock it completed; the training goes on.
        let seen = journal::read_all(&events)?.0.len();
        let pid = cri_pid(&cri, &id).await?;
        sim.fault(Some(pid), FaultOp::CheckpointFail, true)?;
        let failed_archive = node.paths().dir.join("records-failed.tar");
        let failed = cri.checkpoint_container(&id, &failed_archive, 60).await;
        sim.fault(Some(pid), FaultOp::CheckpointFail, false)?;
        ensure!(failed.is_err(), "the checkpoint succeeded under the fault");
        let new = records_after(&events, seen)?;
        let r = only(&new, Operation::Checkpoint, "a failed checkpoint")?;
        let error = r
            .error
            .as_ref()
            .context("a failed record without its error")?;
        ensure!(
            r.outcome == Outcome::Failed
                && error.step == "device-checkpoint"
                && error.class == "step",
            "{r:#?}"
        );
        ensure!(
            step_names(r).last() == Some(&"device-checkpoint")
                && step_names(r).contains(&"device-lock"),
            "steps {:?}: the lock, then the failing step",
            step_names(r)
        );
        keeps_training(&log, 3, "after the failed checkpoint")?;
        cri.remove_pod(&pod).await?;

        // 3. The restore handler refuses a checkpoint that is not there at Create: refused,
        //    step trust.
        let seen = journal::read_all(&events)?.0.len();
        let missing = node.paths().dir.join("records-missing.tar");
        let refused_pod = cri
            .run_pod(&restore_pod(
                "records-r",
                &node,
                &missing.display().to_string(),
            ))
            .await?;
        let created = cri
            .run_container(&refused_pod, &train_spec("train", "0"))
            .await;
        ensure!(created.is_err(), "a missing checkpoint was restored");
        cri.remove_pod(&refused_pod).await?;
        let new = records_after(&events, seen)?;
        let r = only(&new, Operation::Restore, "a refused restore")?;
        let error = r
            .error
            .as_ref()
            .context("a refused record without its error")?;
        ensure!(
            r.outcome == Outcome::Refused && error.class == "refused" && error.step == "trust",
            "{r:#?}"
        );

        // 4. The restore handler restores the good checkpoint: succeeded, with the device bytes
        //    it put back, its verify and device restore steps, and its GPU.
        let seen = journal::read_all(&events)?.0.len();
        let pod_r = cri
            .run_pod(&restore_pod(
                "records-ok",
                &node,
                &archive.display().to_string(),
            ))
            .await?;
        cri.run_container(&pod_r, &train_spec("train", "0")).await?;
        keeps_training(&pod_r.container_log("train"), 2, "the restored training")?;
        let new = records_after(&events, seen)?;
        let r = only(&new, Operation::Restore, "a successful restore")?;
        ensure!(
            r.outcome == Outcome::Succeeded && r.error.is_none(),
            "{r:#?}"
        );
        ensure!(
            r.device_bytes == manifest.devices.device_bytes() && r.device_bytes > 0,
            "device bytes {} of a checkpoint holding {}",
            r.device_bytes,
            manifest.devices.device_bytes()
        );
        ensure!(r.host_bytes > 0 && r.gpus == vec![gpu.clone()], "{r:#?}");
        let steps = step_names(r);
        let at = |s: &str| steps.iter().position(|n| *n == s);
        ensure!(
            ["verify", "criu-restore", "device-restore"]
                .iter()
                .all(|s| at(s).is_some())
                && at("verify") < at("criu-restore")
                && at("criu-restore") < at("device-restore"),
            "restore steps out of order or missing: {steps:?}"
        );
        cri.remove_pod(&pod_r).await
    })
}
