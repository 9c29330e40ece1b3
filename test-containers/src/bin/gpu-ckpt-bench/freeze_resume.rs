//! `freeze-resume`: how long a CRI CheckpointContainer keeps a GPU pod's application from
//! running with `gpu-ckpt.io/resume-after-dump: "true"` (the shim resumes it once CRIU's dump
//! and its copy of the rootfs changes are done) and without it (containerd's Resume after its
//! copy and rootfs diff), each over the sum of the device steps and CRIU's dump of the same
//! run: the Pause's device lock and checkpoint (`device-quiesce`), `criu-dump`, and the device
//! restore and unlock (`resume-after-dump`, thaw included; without the option, the shim's
//! `device_resume` span under containerd's Resume, as the manifest is written before it).

use std::time::Duration;

use anyhow::{ensure, Result};
use test_containers::{
    containerd::Containerd,
    cri::{ContainerSpec, Cri},
    stack::{GPU_CKPT_HANDLER, GPU_WORKLOADS_IMAGE},
};

use crate::{
    freeze_once, median, median_f64, ratio_line, round_order, secs, sim_gpu_node, wait_gpu_free,
    Freeze,
};

/// The application ticks this often (one driver call before each tick).
const TICK_MS: u64 = 10;

/// gpu-fill of `mib` MiB on simulated GPU 0, ticking every [`TICK_MS`]; with `resume`, the
/// annotation.
fn ticker(mib: u64, resume: bool) -> ContainerSpec {
    let mib = mib.to_string();
    let tick = TICK_MS.to_string();
    let args = [
        "/usr/bin/gpu-fill",
        "--mib",
        &mib,
        "--devices",
        "0",
        "--seed",
        "7",
        "--tick-ms",
        &tick,
    ];
    let spec = ContainerSpec::new("app", GPU_WORKLOADS_IMAGE)
        .command(&args)
        .annotation(
            "cdi.k8s.io/gpu-ckpt-bench",
            &format!("{}=0", simgpu::cdi::KIND),
        );
    if resume {
        spec.annotation("gpu-ckpt.io/resume-after-dump", "true")
    } else {
        spec
    }
}

/// The manifest's timing of `step` in run `f`.
fn step(f: &Freeze, step: &str) -> Duration {
    f.timings
        .iter()
        .filter(|t| t.step == step)
        .map(|t| Duration::from_secs_f64(t.millis / 1000.0))
        .sum()
}

/// The device restore and unlock of run `f`: the manifest's `resume-after-dump`, else the
/// shim's span under containerd's Resume.
fn device_back(f: &Freeze) -> Duration {
    let early = step(f, "resume-after-dump");
    if early.is_zero() {
        f.device_resume
    } else {
        early
    }
}

/// The device steps and CRIU's dump of run `f`.
fn steps_sum(f: &Freeze) -> Duration {
    step(f, "device-quiesce") + step(f, "criu-dump") + device_back(f)
}

pub fn bench(mib: u64, runs: usize) -> Result<()> {
    ensure!(mib >= 1, "--mib must be at least 1");
    ensure!(runs >= 1, "--runs must be at least 1");
    let memory_mib = mib + 512;
    let (sim, node) = sim_gpu_node("bench-freeze-resume", memory_mib)?;
    println!(
        "One containerd node (debug logging) with one simulated GPU of {memory_mib} MiB; a pod \
         under gpu-ckpt runs `gpu-fill --mib {mib} --tick-ms {TICK_MS}` on GPU 0, with and \
         without `gpu-ckpt.io/resume-after-dump: \"true\"`; CRI CheckpointContainer; frozen: \
         the longest gap between ticks across the call. {runs} runs each, the order \
         alternating, one warm-up run not counted.\n"
    );
    let paths = [
        ("with resume-after-dump", true),
        ("without (containerd's Resume)", false),
    ];
    tokio::runtime::Runtime::new()?.block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let api = Containerd::connect(node.socket(), "k8s.io").await?;
        let mut times: [Vec<Freeze>; 2] = Default::default();
        for i in 0..=runs {
            for w in round_order(i.saturating_sub(1), paths.len()) {
                let (label, resume) = paths[w];
                let run = freeze_once(
                    &node,
                    &cri,
                    &api,
                    GPU_CKPT_HANDLER,
                    &format!("fresume-{w}-{i}"),
                    &ticker(mib, resume),
                    // The staged device memory, the dump, containerd's copy and the archive.
                    4 * mib,
                )
                .await?;
                wait_gpu_free(&sim)?;
                eprintln!(
                    "run {i}{} {label}: CheckpointContainer {:.2} s, app frozen {:.3} s, task paused {:.3} s; device-quiesce {:.3} s, criu-dump {:.3} s, device restore + unlock {:.3} s",
                    if i == 0 { " (warm-up)" } else { "" },
                    secs(run.call),
                    secs(run.frozen),
                    secs(run.paused),
                    secs(step(&run, "device-quiesce")),
                    secs(step(&run, "criu-dump")),
                    secs(device_back(&run)),
                );
                if i > 0 {
                    times[w].push(run);
                }
            }
        }
        println!("| GPU pod, {mib} MiB (median of {runs}) | CheckpointContainer | app frozen | task paused | device lock + checkpoint (`device-quiesce`) | CRIU's dump (`criu-dump`) | device restore + unlock | sum of the steps | frozen / sum |");
        println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
        for (w, (label, _)) in paths.iter().enumerate() {
            let v = &times[w];
            let m = |f: &dyn Fn(&Freeze) -> Duration| secs(median(v.iter().map(f)));
            let ratio = median_f64(
                v.iter()
                    .map(|x| secs(x.frozen) / secs(steps_sum(x)))
                    .collect(),
            );
            println!(
                "| {label} | {:.2} s | {:.3} s | {:.3} s | {:.3} s | {:.3} s | {:.3} s | {:.3} s | {ratio:.2} |",
                m(&|x| x.call),
                m(&|x| x.frozen),
                m(&|x| x.paused),
                m(&|x| step(x, "device-quiesce")),
                m(&|x| step(x, "criu-dump")),
                m(&|x| device_back(x)),
                m(&|x| steps_sum(x)),
            );
        }
        let frozen = |w: usize| times[w].iter().map(|x| secs(x.frozen)).collect::<Vec<_>>();
        let sums = |w: usize| {
            times[w]
                .iter()
                .map(|x| secs(steps_sum(x)))
                .collect::<Vec<_>>()
        };
        let goal = median_f64(frozen(0)) / median_f64(sums(0));
        let verdict = if goal <= 1.2 { "met" } else { "missed" };
        let lines = [
            (
                "\nfreeze / (device steps + CRIU's dump), with resume-after-dump",
                frozen(0),
                sums(0),
                format!(" (goal ≤ 1.2: {verdict})"),
            ),
            (
                "freeze / (device steps + CRIU's dump), without",
                frozen(1),
                sums(1),
                String::new(),
            ),
            (
                "freeze with / without resume-after-dump",
                frozen(0),
                frozen(1),
                String::new(),
            ),
        ];
        for (what, a, b, after) in lines {
            println!("{what}: {}{after}", ratio_line(&a, &b));
        }
        Ok(())
    })
}
