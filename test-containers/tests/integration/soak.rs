//! The soak (docs/benchmarks.md, "Soak"): one counter checkpointed through CRI (it keeps
//! running) and restored into its pod, cycle after cycle, under one shim whose open fds and
//! resident memory must stay flat; and many pods on one node checkpointed all at once.
//!
//! The test command runs a short soak; `make soak` the full one, sized by
//! `GPU_CKPT_SOAK_CYCLES` (16 here), `GPU_CKPT_SOAK_PODS` (4) and `GPU_CKPT_SOAK_ROUNDS` (2).

use std::{
    path::Path,
    time::{Duration, Instant},
};

use crate::common::soak::{sample_shim, shim_with_id, slope, slopes, soak_size, ShimSample};
use crate::common::*;
use anyhow::{bail, ensure, Context, Result};
use test_containers::{
    cri::{ContainerSpec, Cri, Pod, PodSpec},
    stack::GPU_CKPT_HANDLER,
};

/// Samples taken before the shim is warm (its thread pools and allocator arenas grown to
/// their working size: about 10 MiB, in steps of 1 to 3 MiB, over the first five cycles in
/// every run so far) are left out of the slopes.
const WARM_UP: usize = 6;
/// Growth bounds after the warm-up: a leak of one fd per cycle, or of 200 KiB per cycle,
/// breaks them over a long run (the debug shim grows by about 5 to 50 KiB a cycle there).
const MAX_FD_SLOPE: f64 = 0.5;
const MAX_RSS_SLOPE_KIB: f64 = 180.0;
/// The RSS bound of a short run (under [`LONG_RUN`] samples after the warm-up): two more 1 MiB
/// steps of the allocator inside its ten samples give about 210 KiB a step (seen in the test
/// command), so a short run catches only leaks of 500 KiB a step or more; `make soak` holds
/// the shim to [`MAX_RSS_SLOPE_KIB`].
const MAX_RSS_SLOPE_KIB_SHORT: f64 = 500.0;
const LONG_RUN: usize = 40;
/// Quiet time before a sample.
const SETTLE: Duration = Duration::from_millis(300);

fn counter_spec() -> ContainerSpec {
    ContainerSpec::new("counter", workloads()).command(&["/bin/counter", "--interval-ms", "100"])
}

/// The counter value in container `id`.
async fn counter(cri: &Cri, id: &str) -> Result<u64> {
    cri_counter(cri, id, "/counter.txt").await
}

/// One checkpoint and restore of the counter `id` in `pod` through `archive`: CRI
/// CheckpointContainer (the container keeps running), then the container replaced by one
/// created from the archive (containerd's restore-via-create). Checks that the restored counter
/// goes on from the checkpoint's value; returns the new container's id and its first value.
async fn cycle(cri: &Cri, pod: &Pod, id: &str, archive: &Path, n: usize) -> Result<(String, u64)> {
    let before = counter(cri, id).await?;
    let _ = std::fs::remove_file(archive);
    cri.checkpoint_container(id, archive, 120)
        .await
        .with_context(|| format!("cycle {n}: checkpoint"))?;
    let after = counter(cri, id).await?;
    let at = Instant::now();
    cri.stop_container(id, 10).await?;
    cri.remove_container(id).await?;
    let restored = cri
        .run_container(
            pod,
            &ContainerSpec::new("counter", &archive.display().to_string()),
        )
        .await
        .with_context(|| format!("cycle {n}: restore from {}", archive.display()))?;
    let first = counter(cri, &restored).await?;
    // The restored counter starts where the checkpoint left it and ticks every 100 ms from
    // its restore on: never below the value before the checkpoint, never past the value after
    // it plus the ticks since.
    let ticks = at.elapsed().as_millis() as u64 / 100 + 2;
    ensure!(
        first >= before && first <= after + ticks,
        "cycle {n}: the restored counter started at {first}; the checkpoint was taken between {before} and {after}, {ticks} ticks ago"
    );
    cri_counter_above(cri, &restored, "/counter.txt", first).await?;
    Ok((restored, first))
}

fn print_samples(what: &str, samples: &[ShimSample]) {
    println!("{what}: step fds rss_kib threads");
    for (i, s) in samples.iter().enumerate() {
        println!("{what}: {i} {} {} {}", s.fds, s.rss_kib, s.threads);
    }
}

/// Fails when the samples after the warm-up grow faster than the bounds.
fn expect_flat(what: &str, samples: &[ShimSample]) -> Result<(f64, f64)> {
    let warm = &samples[WARM_UP.min(samples.len().saturating_sub(2))..];
    let (fd_slope, rss_slope) = slopes(warm);
    println!(
        "{what}: slope over {} samples after the warm-up: {fd_slope:.3} fds/step, {rss_slope:.1} KiB/step",
        warm.len()
    );
    ensure!(
        fd_slope < MAX_FD_SLOPE,
        "{what}: the shim's open fds grow by {fd_slope:.2} a step (bound {MAX_FD_SLOPE}): {warm:?}"
    );
    let bound = if warm.len() >= LONG_RUN {
        MAX_RSS_SLOPE_KIB
    } else {
        MAX_RSS_SLOPE_KIB_SHORT
    };
    ensure!(
        rss_slope < bound,
        "{what}: the shim's RSS grows by {rss_slope:.1} KiB a step (bound {bound}): {warm:?}"
    );
    Ok((fd_slope, rss_slope))
}

/// One counter checkpointed (it keeps running) and restored `GPU_CKPT_SOAK_CYCLES` times in a
/// row in one pod, so under one shim, whose fds and RSS stay flat; every restore goes on from
/// its checkpoint.
#[test]
fn checkpoint_and_restore_in_a_row_keep_the_shim_flat() -> Result<()> {
    let cycles = soak_size("GPU_CKPT_SOAK_CYCLES", 16)?;
    ensure!(
        cycles > WARM_UP + 2,
        "GPU_CKPT_SOAK_CYCLES must be above {}",
        WARM_UP + 2
    );
    let node = node("soak-cycles")?;
    let archive = node.paths().dir.join("soak-counter.tar");
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        cri.pull_image(workloads()).await?;
        let pod = cri
            .run_pod(&PodSpec::new("soak", node.pod_log_root()).handler(GPU_CKPT_HANDLER))
            .await?;
        let mut id = cri.run_container(&pod, &counter_spec()).await?;
        // Well past the first values, so that a restore that started over shows.
        let mut last = cri_counter_above(&cri, &id, "/counter.txt", 20).await?;
        let shim = shim_with_id(node.socket(), &pod.id)
            .with_context(|| format!("no gpu-ckpt shim serves pod {}", pod.id))?;
        let started = Instant::now();
        let mut samples = vec![sample_shim(shim, SETTLE)?];
        for n in 1..=cycles {
            let t = Instant::now();
            let (restored, first) = cycle(&cri, &pod, &id, &archive, n).await?;
            ensure!(
                first >= last,
                "cycle {n}: the counter went back from {last} to {first}"
            );
            (id, last) = (restored, first);
            ensure!(
                shim_with_id(node.socket(), &pod.id) == Some(shim),
                "cycle {n}: the pod's shim changed"
            );
            samples.push(sample_shim(shim, SETTLE)?);
            println!(
                "cycle {n}: counter {first}, {:.2} s, shim fds {} rss {} KiB",
                t.elapsed().as_secs_f64(),
                samples[n].fds,
                samples[n].rss_kib
            );
        }
        println!(
            "{cycles} cycles in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        print_samples("cycles", &samples);
        let all = slopes(&samples);
        println!(
            "cycles: slope over all {} samples: {:.3} fds/cycle, {:.1} KiB/cycle",
            samples.len(),
            all.0,
            all.1
        );
        expect_flat("cycles", &samples)?;
        cri.remove_pod(&pod).await
    })
}

/// `GPU_CKPT_SOAK_PODS` pods on one node, each with a counter, all checkpointed through CRI at
/// once, `GPU_CKPT_SOAK_ROUNDS` times: every checkpoint succeeds, is root-only, and its
/// container runs on; the shims' fds and RSS are sampled each round; one archive of the last
/// round is restored into a new pod and goes on from its checkpoint.
#[test]
fn many_pods_checkpointed_at_once() -> Result<()> {
    let pods = soak_size("GPU_CKPT_SOAK_PODS", 4)?;
    let rounds = soak_size("GPU_CKPT_SOAK_ROUNDS", 2)?;
    ensure!(pods > 0 && rounds > 0, "no pods or no rounds");
    let node = node("soak-pods")?;
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        cri.pull_image(workloads()).await?;
        let mut running = Vec::new();
        for i in 0..pods {
            let pod = cri
                .run_pod(
                    &PodSpec::new(&format!("soak-{i}"), node.pod_log_root())
                        .handler(GPU_CKPT_HANDLER),
                )
                .await?;
            let id = cri.run_container(&pod, &counter_spec()).await?;
            let shim = shim_with_id(node.socket(), &pod.id)
                .with_context(|| format!("no gpu-ckpt shim serves pod {}", pod.id))?;
            running.push((pod, id, shim));
        }
        for (_, id, _) in &running {
            cri_counter_above(&cri, id, "/counter.txt", 5).await?;
        }
        let mut per_round: Vec<Vec<ShimSample>> = Vec::new();
        let mut last_archives = Vec::new();
        for round in 1..=rounds {
            let mut set = tokio::task::JoinSet::new();
            let t = Instant::now();
            for (i, (_, id, _)) in running.iter().enumerate() {
                let archive = node.paths().dir.join(format!("soak-pod-{i}.tar"));
                let _ = std::fs::remove_file(&archive);
                let before = counter(&cri, id).await?;
                let (cri, id) = (cri.clone(), id.clone());
                set.spawn(async move {
                    let r = cri.checkpoint_container(&id, &archive, 300).await;
                    (i, before, archive, r)
                });
            }
            let mut archives = vec![None; running.len()];
            while let Some(done) = set.join_next().await {
                let (i, before, archive, r) = done.context("a checkpoint task panicked")?;
                r.with_context(|| format!("round {round}: checkpoint of pod {i}"))?;
                archives[i] = Some((archive, before));
            }
            println!(
                "round {round}: {} pods checkpointed at once in {:.2} s",
                running.len(),
                t.elapsed().as_secs_f64()
            );
            for (i, (_, id, _)) in running.iter().enumerate() {
                let (archive, _) = archives[i].as_ref().context("a checkpoint is missing")?;
                use std::os::unix::fs::PermissionsExt;
                let mode = std::fs::metadata(archive)
                    .with_context(|| format!("round {round}: archive of pod {i}"))?
                    .permissions()
                    .mode();
                ensure!(
                    mode & 0o077 == 0,
                    "round {round}: archive {} has mode {mode:o}",
                    archive.display()
                );
                let now = counter(&cri, id).await?;
                cri_counter_above(&cri, id, "/counter.txt", now).await?;
            }
            std::thread::sleep(SETTLE);
            let mut samples = Vec::new();
            for (_, _, shim) in &running {
                samples.push(sample_shim(*shim, Duration::ZERO)?);
            }
            let (fds, rss): (u64, u64) = samples
                .iter()
                .fold((0, 0), |(f, r), s| (f + s.fds, r + s.rss_kib));
            println!(
                "round {round}: shims' fds {fds} in all, rss {rss} KiB in all ({} shims)",
                samples.len()
            );
            per_round.push(samples);
            last_archives = archives;
        }
        if rounds > 1 {
            let fds: Vec<f64> = per_round
                .iter()
                .map(|r| r.iter().map(|s| s.fds as f64).sum::<f64>() / r.len() as f64)
                .collect();
            let rss: Vec<f64> = per_round
                .iter()
                .map(|r| r.iter().map(|s| s.rss_kib as f64).sum::<f64>() / r.len() as f64)
                .collect();
            println!(
                "pods: slope per shim over {rounds} rounds: {:.3} fds/round, {:.1} KiB/round",
                slope(&fds),
                slope(&rss)
            );
            ensure!(
                slope(&fds) < MAX_FD_SLOPE,
                "pods: the shims' fds grow by {:.2} a round: {fds:?}",
                slope(&fds)
            );
        }

        // One archive of the last round, restored into a pod of its own, goes on from it.
        let Some(Some((archive, before))) = last_archives.first().cloned() else {
            bail!("no archive of the last round");
        };
        let pod = cri
            .run_pod(&PodSpec::new("soak-restored", node.pod_log_root()).handler(GPU_CKPT_HANDLER))
            .await?;
        let restored = cri
            .run_container(
                &pod,
                &ContainerSpec::new("counter", &archive.display().to_string()),
            )
            .await?;
        let first = counter(&cri, &restored).await?;
        ensure!(
            first >= before,
            "the restored counter started at {first}, below {before} before its checkpoint"
        );
        cri_counter_above(&cri, &restored, "/counter.txt", first).await?;
        cri.remove_pod(&pod).await?;
        for (pod, _, _) in &running {
            cri.remove_pod(pod).await?;
        }
        Ok(())
    })
}

#[test]
fn slope_is_least_squares() {
    assert!((slope(&[3.0, 5.0, 7.0, 9.0]) - 2.0).abs() < 1e-9);
    assert_eq!(slope(&[4.0, 4.0, 4.0]), 0.0);
    assert_eq!(slope(&[1.0]), 0.0);
    assert!((slope(&[0.0, 1.0, 0.0, 1.0]) - 0.2).abs() < 1e-9);
}
