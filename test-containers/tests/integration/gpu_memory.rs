//! GPU containers whose memory limit is below what a checkpoint stages in host memory (the
//! driver moves device memory into the process, charged to its memory cgroup): the checkpoint is
//! refused before any lock, naming the container, its limit, its use and the bytes needed, and
//! the container computes on; with the handler option `RaiseMemoryLimit` the checkpoint and a
//! restore on another node succeed, and each container ends with its spec's limit. No OOM kill
//! in any of them (the cgroup's own counter: v2's `memory.events`, v1's `memory.oom_control`).
//!
//! The training holds 64 MiB on its GPU (two arrays of 8 Mi elements) and about 100 MiB of host
//! memory: under a 150 MiB limit it runs, and the staged copy would take it over.

use std::path::{Path, PathBuf};

use crate::common::{gpu::*, *};
use crate::gpu_shim::{checkpoint_fails, expect_continues, keeps_training, train_spec};
use anyhow::{ensure, Context, Result};
use test_containers::{
    cri::{ContainerSpec, Cri, Pod, PodSpec},
    stack::{Node, GPU_CKPT_HANDLER, GPU_WORKLOADS_IMAGE},
};

const MIB: u64 = 1 << 20;
/// The container's memory limit.
const LIMIT: u64 = 150 * MIB;
/// Per GPU process, the host memory a context's checkpoint needs beyond its device bytes, and
/// the share of staged bytes per device byte (3/2), as docs/gpu.md states the rule.
const CONTEXT: u64 = 64 * MIB;

/// gpu-train with 8 Mi elements on simulated GPU `device` under [`LIMIT`].
fn big_train(device: &str) -> ContainerSpec {
    train_spec("train", device)
        .args(&["--elements", "8388608", "--interval-ms", "100"])
        .memory_limit(LIMIT as i64)
}

/// A pod `name` on `node` running [`big_train`] on GPU 0, three steps done: the pod, the
/// container's id, its host pid and its memory cgroup.
async fn run_big(cri: &Cri, node: &Node, name: &str) -> Result<(Pod, String, i32, PathBuf)> {
    cri.pull_image(GPU_WORKLOADS_IMAGE).await?;
    let spec = PodSpec::new(name, node.pod_log_root()).handler(GPU_CKPT_HANDLER);
    let pod = cri.run_pod(&spec).await?;
    let id = cri.run_container(&pod, &big_train("0")).await?;
    wait_steps(&pod.container_log("train"), 3)?;
    let pid = cri_pid(cri, &id).await?;
    let cgroup = memory_cgroup(pid)?;
    Ok((pod, id, pid, cgroup))
}

/// The memory cgroup of host process `pid`: v1's memory hierarchy, else v2's unified one.
fn memory_cgroup(pid: i32) -> Result<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    let v1 = text
        .lines()
        .find_map(|l| l.split_once(":memory:").map(|(_, r)| r.to_string()));
    if let Some(rel) = v1 {
        return Ok(Path::new("/sys/fs/cgroup/memory").join(rel.trim_start_matches('/')));
    }
    let rel = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .with_context(|| format!("no memory cgroup for pid {pid}: {text}"))?;
    Ok(Path::new("/sys/fs/cgroup").join(rel.trim_start_matches('/')))
}

/// What a memory cgroup says about itself.
#[derive(Debug)]
struct Memory {
    limit: u64,
    usage: u64,
    oom_kills: u64,
    /// The highest use (v1's `memory.max_usage_in_bytes`, v2's `memory.peak`), where kept.
    peak: Option<u64>,
}

fn memory(dir: &Path) -> Result<Memory> {
    let read = |f: &str| {
        std::fs::read_to_string(dir.join(f)).with_context(|| format!("{}", dir.join(f).display()))
    };
    let num = |f: &str| -> Result<u64> { Ok(read(f)?.trim().parse()?) };
    let key = |f: &str, k: &str| -> Result<u64> {
        read(f)?
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{k} ")))
            .with_context(|| format!("no {k} in {f}"))?
            .trim()
            .parse()
            .map_err(Into::into)
    };
    if dir.join("memory.limit_in_bytes").exists() {
        Ok(Memory {
            limit: num("memory.limit_in_bytes")?,
            usage: num("memory.usage_in_bytes")?,
            oom_kills: key("memory.oom_control", "oom_kill")?,
            peak: num("memory.max_usage_in_bytes").ok(),
        })
    } else {
        Ok(Memory {
            limit: num("memory.max")?,
            usage: num("memory.current")?,
            oom_kills: key("memory.events", "oom_kill")?,
            peak: num("memory.peak").ok(),
        })
    }
}

/// The device bytes the simulated driver lists for `pid`.
fn device_bytes(sim: &simgpu::testing::SimNode, pid: i32) -> Result<u64> {
    gpus_of(sim, pid)?;
    Ok(sim
        .processes()?
        .iter()
        .filter(|p| p.pid == pid as u32)
        .map(|p| p.used_bytes)
        .sum())
}

/// The limit is the spec's and no OOM kill happened.
fn limit_kept(dir: &Path, what: &str) -> Result<Memory> {
    let m = memory(dir)?;
    println!("{what}: {m:?}");
    ensure!(
        m.limit == LIMIT,
        "{what}: memory limit {} in {}, the spec says {LIMIT}",
        m.limit,
        dir.display()
    );
    ensure!(m.oom_kills == 0, "{what}: {} OOM kills", m.oom_kills);
    Ok(m)
}

#[test]
fn a_checkpoint_beyond_the_memory_limit_is_refused_and_the_container_computes_on() -> Result<()> {
    let sim = sim_gpus(1, 256, "mem-refuse")?;
    let node = gpu_node("gpu-mem-refuse", &sim, &[])?;
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let (pod, id, pid, cgroup) = run_big(&cri, &node, "memrefuse").await?;
        let log = pod.container_log("train");
        let before = limit_kept(&cgroup, "before the checkpoint")?;
        let device = device_bytes(&sim, pid)?;
        // The setup: the staged copy alone would take the container over its limit.
        ensure!(
            before.usage + device > LIMIT,
            "the container uses {} and holds {device} device bytes: a staged copy fits under {LIMIT}",
            before.usage
        );
        let needed = device + device.div_ceil(2) + CONTEXT;
        let archive = node.paths().dir.join("memrefuse.tar");
        checkpoint_fails(
            &cri,
            &id,
            &archive,
            &[
                "checkpoint failed at step host-memory",
                &format!("container {id} would be OOM-killed"),
                &format!("limit {LIMIT} bytes"),
                "use ",
                &format!("{device} bytes"),
                &format!("{needed} bytes"),
                "RaiseMemoryLimit",
            ],
            "checkpoint beyond the memory limit",
        )
        .await?;
        keeps_training(&log, 3, "after the refused checkpoint")?;
        limit_kept(&cgroup, "after the refused checkpoint")?;
        cri.remove_pod(&pod).await
    })?;

    // The same through ctr (Pause, where containerd's client runs the device steps).
    let log = node.paths().dir.join("memrefuse-ctr.log");
    let _ = std::fs::remove_file(&log);
    let (uri, device, limit) = (
        format!("file://{}", log.display()),
        format!("{KIND}=0"),
        LIMIT.to_string(),
    );
    let flags = run_flags(&node);
    let mut args = vec!["run", "-d", "--log-uri", &uri, "--device", &device];
    args.extend(["--memory-limit", &limit]);
    args.extend(flags.iter().map(String::as_str));
    args.extend([GPU_WORKLOADS_IMAGE, "m1", "/usr/bin/gpu-train"]);
    args.extend(["--elements", "8388608", "--interval-ms", "100"]);
    let out = node.ctr_cdi("default", &args)?;
    ensure!(out.status.success(), "ctr run: {out:?}");
    wait_steps(&log, 3)?;
    let cgroup = memory_cgroup(node.task_pid("m1")?)?;
    let out = node.ctr(&["task", "checkpoint", "m1"])?;
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    println!("ctr task checkpoint: {err}");
    ensure!(
        !out.status.success()
            && err.contains("step host-memory")
            && err.contains("container m1 would be OOM-killed")
            && err.contains(&format!("limit {LIMIT} bytes")),
        "ctr task checkpoint beyond the memory limit: {out:?}"
    );
    keeps_training(&log, 3, "ctr, after the refused checkpoint")?;
    limit_kept(&cgroup, "ctr, after the refused checkpoint")?;
    remove(&node, "m1");
    Ok(())
}

#[test]
fn with_raise_memory_limit_the_checkpoint_and_a_restore_elsewhere_succeed() -> Result<()> {
    let raise = [("RaiseMemoryLimit", "true")];
    let sim_a = sim_gpus(1, 256, "mem-raise-a")?;
    let sim_b = sim_gpus(1, 256, "mem-raise-b")?;
    let sim_c = sim_gpus(1, 256, "mem-raise-c")?;
    let a = gpu_node("gpu-mem-raise-a", &sim_a, &raise)?;
    let b = gpu_node("gpu-mem-raise-b", &sim_b, &raise)?;
    let c = gpu_node("gpu-mem-raise-c", &sim_c, &[])?;
    rt().block_on(async {
        let (cri_a, cri_b, cri_c) = (
            Cri::connect(a.socket()).await?,
            Cri::connect(b.socket()).await?,
            Cri::connect(c.socket()).await?,
        );
        let (pod, id, _, cgroup) = run_big(&cri_a, &a, "memraise").await?;
        let log = pod.container_log("train");
        limit_kept(&cgroup, "node A, before the checkpoint")?;
        let before = last_step(&log).map(|s| s.0).unwrap_or_default();
        let archive = a.paths().dir.join("memraise.tar");
        let _ = std::fs::remove_file(&archive);
        cri_a.checkpoint_container(&id, &archive, 60).await?;
        keeps_training(&log, 3, "node A, after the checkpoint")?;
        let after = limit_kept(&cgroup, "node A, after the checkpoint")?;
        if let Some(peak) = after.peak {
            ensure!(
                peak > LIMIT,
                "node A: the cgroup's use never went above {LIMIT} (peak {peak}): the checkpoint did not need the raised limit"
            );
        }

        // A node that does not raise limits refuses the restore, naming the numbers.
        let source = archive.display().to_string();
        let pod_c = cri_c.run_pod(&restore_pod("memraise", &c, &source)).await?;
        let err = match cri_c.run_container(&pod_c, &big_train("0")).await {
            Ok(id) => anyhow::bail!("node C restored {id} beyond its memory limit"),
            Err(e) => format!("{e:#}"),
        };
        println!("node C: {err}");
        for n in [
            "restore failed at step host-memory",
            &format!("limit {LIMIT} bytes"),
            "nothing was restored",
        ] {
            ensure!(err.contains(n), "node C's refusal does not name {n:?}: {err}");
        }
        ensure!(
            sim_c.processes()?.is_empty(),
            "node C's refused restore left a GPU process"
        );
        cri_c.remove_pod(&pod_c).await?;

        // Node B raises the limit for the restore and puts the spec's back.
        let pod_b = cri_b.run_pod(&restore_pod("memraise", &b, &source)).await?;
        let since = std::time::SystemTime::now();
        let id_b = cri_b.run_container(&pod_b, &big_train("0")).await?;
        expect_continues(
            &pod_b.container_log("train"),
            since,
            before,
            &log,
            "node B, restored",
        )?;
        let pid_b = cri_pid(&cri_b, &id_b).await?;
        let restored = limit_kept(&memory_cgroup(pid_b)?, "node B, restored")?;
        if let Some(peak) = restored.peak {
            ensure!(
                peak > LIMIT,
                "node B: the cgroup's use never went above {LIMIT} (peak {peak}): the restore did not need the raised limit"
            );
        }
        keeps_training(&log, 2, "node A, at the end")?;
        limit_kept(&cgroup, "node A, at the end")?;
        cri_b.remove_pod(&pod_b).await?;
        cri_a.remove_pod(&pod).await
    })
}
