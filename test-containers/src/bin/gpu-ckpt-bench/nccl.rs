//! `nccl`: what gpu-ckpt's NCCL steps add to the checkpoint and the restore of a 4-rank job,
//! against the same run's device steps. One node with 4 simulated GPUs whose handler injects
//! the communicator layer (`Nccl = "managed"`, `NcclLayer` next to this binary, `NcclRelease`
//! from `--release`: destroy, the default, or suspend); the job is
//! `nccl_allreduce --ranks 4` (one container, one rank per GPU). Each run: `ctr task checkpoint
//! --exit --image-path`, then Tasks.Create with `CriuImagePath` and Tasks.Start on the same
//! container (the restore rebuilds every communicator on a fresh unique id), and the job must
//! go on from its step with every element verified.
//!
//! The checkpoint's figures come from its manifest's step timings: `nccl-quiesce` and
//! `nccl-release` (the layer's quiesce of every rank, then the release of its communicators)
//! against `device-lock` and `device-checkpoint`; the restore's from the shim's log (debug
//! logging): its NCCL step (`nccl_rebuild_ms` of its `restored` line: every rank connected
//! again, fresh unique ids, the rebuild and the held calls released) against the device restore
//! and unlock (`device_restore_ms` of the same line).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use test_containers::{
    containerd::Containerd,
    stack::{Node, Stack, GPU_WORKLOADS_IMAGE},
};

use crate::{
    log_field, log_len, log_since, median, median_f64, ratio_line, runtime_flags, secs, shim_steps,
    span_time, start_node, wait_gpu_free, OUT_TMPFS,
};

/// The job's ranks, one per simulated GPU.
const RANKS: u32 = 4;
/// Where the job logs, below its container's root (a tmpfs: it travels with the checkpoint).
const JOB_LOG: &str = "out/job.log";

/// One run's figures.
#[derive(Clone, Copy, Default)]
struct Run {
    /// `ctr task checkpoint --exit` and the restore (Tasks.Create + Start), whole.
    checkpoint: Duration,
    restore: Duration,
    /// The manifest's step timings.
    quiesce: Duration,
    release: Duration,
    device_lock: Duration,
    device_checkpoint: Duration,
    criu_dump: Duration,
    /// The shim's log of the restore.
    rebuild: Duration,
    device_restore: Duration,
    runc_restore: Duration,
}

impl Run {
    fn nccl_checkpoint(&self) -> Duration {
        self.quiesce + self.release
    }

    fn device_steps(&self) -> Duration {
        self.device_lock + self.device_checkpoint
    }
}

/// The layer the handler injects: `libgpu_ckpt_nccl.so` of the build this binary is from.
fn layer() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let lib = exe
        .parent()
        .context("the benchmark's directory")?
        .join("libgpu_ckpt_nccl.so");
    ensure!(
        lib.is_file(),
        "{} is missing: build the layer with `cargo build --release -p gpu-ckpt-nccl-layer`",
        lib.display()
    );
    Ok(lib)
}

/// A node `name` (debug logging, so that the shim logs its spans' times) on `sim`'s GPUs whose
/// handlers (CRI: the handler's options; ctr: the handler options file) load the simulated
/// driver and inject the NCCL layer into every container, whose Release does `release`
/// (`NcclRelease`: destroy or suspend the communicators).
fn nccl_node(
    stack: &Stack,
    name: &str,
    sim: &simgpu::testing::SimNode,
    release: &str,
) -> Result<Node> {
    let lib_dir = sim.lib_dir().display().to_string();
    let layer = layer()?.display().to_string();
    let options = [
        ("DriverLibraryDir", lib_dir.as_str()),
        ("Nccl", "managed"),
        ("NcclLayer", layer.as_str()),
        ("NcclTimeout", "60s"),
        ("NcclRelease", release),
    ];
    let handler_file = stack.node_dir(name).join("gpu-ckpt-handler.toml");
    std::fs::create_dir_all(stack.node_dir(name))?;
    let mut body = String::new();
    for (k, v) in options {
        body.push_str(&format!("{k} = {}\n", serde_json::to_string(v)?));
    }
    std::fs::write(&handler_file, body)?;
    let mut builder = Node::builder_on(stack, name)
        .log_level("debug")
        .cdi(&[sim.cdi_dir()])
        .env(
            "GPU_CKPT_HANDLER_CONFIG",
            &handler_file.display().to_string(),
        );
    for (k, v) in options {
        builder = builder.runtime_option(k, v);
    }
    start_node(stack, builder)
}

/// Each rank's last step in the job's log (`rank <r> step <k> checksum …`); fails on a line
/// that says the job failed.
fn last_steps(log: &str) -> Result<Vec<u64>> {
    let mut last = vec![0; RANKS as usize];
    for l in log.lines() {
        if l.contains("MISMATCH") || l.contains("nccl_allreduce: ") {
            bail!("the job failed: {l}");
        }
        let w: Vec<&str> = l.split_whitespace().collect();
        if let ["rank", r, "step", k, "checksum", _] = w[..] {
            if let (Ok(r), Ok(k)) = (r.parse::<usize>(), k.parse::<u64>()) {
                if let Some(s) = last.get_mut(r) {
                    *s = (*s).max(k);
                }
            }
        }
    }
    Ok(last)
}

/// Waits (120 s at most) until every rank of the job in host process `pid` is past step
/// `past(rank)`; returns the ranks' last steps.
fn wait_steps(pid: i32, past: impl Fn(usize) -> u64, what: &str) -> Result<Vec<u64>> {
    let path = format!("/proc/{pid}/root/{JOB_LOG}");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let log = std::fs::read_to_string(&path).unwrap_or_default();
        let last = last_steps(&log).with_context(|| what.to_string())?;
        if last.iter().enumerate().all(|(r, k)| *k > past(r)) {
            return Ok(last);
        }
        if Instant::now() > deadline {
            bail!("{what}: timed out; the job's log:\n{log}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The manifest's timing of `step`.
fn timing(m: &image_format::manifest::Manifest, step: &str) -> Duration {
    m.timings
        .iter()
        .filter(|t| t.step == step)
        .map(|t| Duration::from_secs_f64(t.millis / 1000.0))
        .sum()
}

/// One run: the job as container `id`, its checkpoint and its restore.
async fn run_once(node: &Node, api: &Containerd, id: &str, job: &str) -> Result<Run> {
    let (_, ours) = runtime_flags(node);
    let device = format!("{}=all", simgpu::cdi::KIND);
    let mut args: Vec<&str> = vec!["run", "-d", "--device", &device, "--mount", OUT_TMPFS];
    args.extend(ours.iter().map(String::as_str));
    args.extend([GPU_WORKLOADS_IMAGE, id, "/bin/sh", "-c", job]);
    let out = node.ctr_cdi("default", &args)?;
    ensure!(
        out.status.success(),
        "ctr {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    let pid = node.task_pid(id)?;
    wait_steps(pid, |_| 2, "the job before its checkpoint")?;
    let dir = node.paths().dir.join(format!("bench-{id}"));
    let _ = std::fs::remove_dir_all(&dir);
    let from = log_len(node);
    let t = Instant::now();
    node.checkpoint_task_exit(id, &dir)?;
    let checkpoint = t.elapsed();
    let m = image_format::manifest::Manifest::read_from(&dir)?;
    ensure!(
        timing(&m, "nccl-quiesce") > Duration::ZERO,
        "the manifest records no nccl-quiesce: {:?}",
        m.timings
    );
    node.ctr_ok(&["task", "rm", id])?;
    let t = Instant::now();
    let restored = api.restore_from_image_path(id, &dir).await? as i32;
    let restore = t.elapsed();
    // The job goes on: every rank past the step it was checkpointed at, every element checked.
    let at = last_steps(&std::fs::read_to_string(format!(
        "/proc/{restored}/root/{JOB_LOG}"
    ))?)?;
    wait_steps(restored, |r| at[r] + 1, "the restored job")?;
    let log = log_since(node, from);
    let steps = shim_steps(&log, id);
    // The restore's NCCL step (`nccl_rebuild_ms` of its `restored` line), else its span.
    let rebuild = log
        .lines()
        .find(|l| l.contains(&format!(" restored id={id} ")))
        .and_then(|l| log_field(l, "nccl_rebuild_ms"))
        .map(Duration::from_millis)
        .unwrap_or_else(|| {
            span_time(&log, |path| {
                path.rsplit(':')
                    .next()
                    .is_some_and(|s| s.starts_with("nccl_restore{"))
            })
        });
    node.ctr(&["task", "kill", "-s", "SIGKILL", id])?;
    std::thread::sleep(Duration::from_millis(300));
    node.ctr(&["task", "rm", id])?;
    node.ctr(&["container", "rm", id])?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Run {
        checkpoint,
        restore,
        quiesce: timing(&m, "nccl-quiesce"),
        release: timing(&m, "nccl-release"),
        device_lock: timing(&m, "device-lock"),
        device_checkpoint: timing(&m, "device-checkpoint"),
        criu_dump: timing(&m, "criu-dump"),
        rebuild,
        device_restore: steps.device_restore,
        runc_restore: steps.runc_restore,
    })
}

pub fn bench(elements: u64, runs: usize, release: &str) -> Result<()> {
    ensure!(elements >= 1, "--elements must be at least 1");
    ensure!(
        matches!(release, "destroy" | "suspend"),
        "--release must be destroy or suspend"
    );
    ensure!(runs >= 1, "--runs must be at least 1");
    let stack = Stack::discover()?;
    // Three buffers of `elements` u32 per rank, and room for the driver's own.
    let memory_mib = ((12 * elements) >> 20) + 256;
    let sim = simgpu::testing::SimNode::start(simgpu::testing::SimConfig {
        gpus: RANKS,
        memory_mib,
        uuid_seed: "bench-nccl".into(),
        cdi: true,
        ..Default::default()
    })
    .context("starting the simulated GPUs (gpu-ckpt-simgpu next to this binary, and `cargo build --release -p gpu-ckpt-simcuda -p gpu-ckpt-simnvml -p gpu-ckpt-simnccl`)")?;
    let node = nccl_node(&stack, "bench-nccl", &sim, release)?;
    let job = format!(
        "exec /usr/bin/nccl_allreduce --ranks {RANKS} --elements {elements} --interval-ms 10 \
         --seed 3 > /{JOB_LOG} 2>&1"
    );
    println!(
        "One containerd node (debug logging) with {RANKS} simulated GPUs of {memory_mib} MiB; \
         gpu-ckpt injects its NCCL layer into every container (`Nccl = \"managed\"`, \
         `NcclRelease = \"{release}\"`). The job: \
         `nccl_allreduce --ranks {RANKS} --elements {elements}` (allreduce, broadcast and a split \
         communicator's allreduce of {elements} u32 per step, {RANKS} ranks in one container, \
         one per GPU). `ctr task checkpoint --exit --image-path`, then Tasks.Create with \
         `CriuImagePath` and Tasks.Start on the same container; the restored job must go on \
         with every element verified. {runs} runs, one warm-up run not counted.\n"
    );
    tokio::runtime::Runtime::new()?.block_on(async {
        let api = Containerd::connect(node.socket(), "default").await?;
        let mut done: Vec<Run> = Vec::new();
        for i in 0..=runs {
            {
                let r = run_once(&node, &api, &format!("nccl{i}"), &job).await?;
                wait_gpu_free(&sim)?;
                eprintln!(
                    "run {i}{}: checkpoint {:.2} s (nccl-quiesce {:.1} ms, nccl-release {:.1} ms, device-lock {:.1} ms, device-checkpoint {:.1} ms, criu-dump {:.0} ms), restore {:.2} s (runc restore {:.0} ms, device restore {:.1} ms, nccl rebuild {:.1} ms)",
                    if i == 0 { " (warm-up)" } else { "" },
                    secs(r.checkpoint),
                    secs(r.quiesce) * 1e3,
                    secs(r.release) * 1e3,
                    secs(r.device_lock) * 1e3,
                    secs(r.device_checkpoint) * 1e3,
                    secs(r.criu_dump) * 1e3,
                    secs(r.restore),
                    secs(r.runc_restore) * 1e3,
                    secs(r.device_restore) * 1e3,
                    secs(r.rebuild) * 1e3,
                );
                if i > 0 {
                    done.push(r);
                }
            }
        }
        ensure!(
            done.iter().all(|r| !r.rebuild.is_zero()),
            "the shim's log gives no NCCL rebuild time for some restore"
        );
        let ms = |f: fn(&Run) -> Duration| secs(median(done.iter().map(f))) * 1e3;
        let v = |f: fn(&Run) -> Duration| done.iter().map(|r| secs(f(r))).collect::<Vec<_>>();
        println!("| {RANKS} ranks, {elements} elements (median of {runs}) | NCCL steps | device steps | NCCL / device | whole call |");
        println!("| --- | --- | --- | --- | --- |");
        println!(
            "| checkpoint: `nccl-quiesce` + `nccl-release` vs `device-lock` + `device-checkpoint` | {:.1} ms ({:.1} + {:.1}) | {:.1} ms ({:.1} + {:.1}) | {:.2} | {:.0} ms (CRIU's dump {:.0} ms) |",
            ms(Run::nccl_checkpoint),
            ms(|r| r.quiesce),
            ms(|r| r.release),
            ms(Run::device_steps),
            ms(|r| r.device_lock),
            ms(|r| r.device_checkpoint),
            median_f64(v(Run::nccl_checkpoint)) / median_f64(v(Run::device_steps)),
            ms(|r| r.checkpoint),
            ms(|r| r.criu_dump),
        );
        println!(
            "| restore: NCCL rebuild (`nccl_rebuild_ms`) vs device restore + unlock (`device_restore_ms`) | {:.1} ms | {:.1} ms | {:.2} | {:.0} ms (runc restore {:.0} ms) |",
            ms(|r| r.rebuild),
            ms(|r| r.device_restore),
            median_f64(v(|r| r.rebuild)) / median_f64(v(|r| r.device_restore)),
            ms(|r| r.restore),
            ms(|r| r.runc_restore),
        );
        println!();
        let lines = [
            (
                "checkpoint: NCCL steps / device steps",
                v(Run::nccl_checkpoint),
                v(Run::device_steps),
            ),
            (
                "restore: NCCL rebuild / device restore",
                v(|r| r.rebuild),
                v(|r| r.device_restore),
            ),
            (
                "checkpoint: NCCL steps / whole checkpoint",
                v(Run::nccl_checkpoint),
                v(|r| r.checkpoint),
            ),
            (
                "restore: NCCL rebuild / whole restore",
                v(|r| r.rebuild),
                v(|r| r.restore),
            ),
        ];
        for (what, a, b) in lines {
            println!("{what}: {}", ratio_line(&a, &b));
        }
        Ok(())
    })
}
