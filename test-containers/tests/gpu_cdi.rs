//! Simulated GPUs in containers through CDI, on a private containerd node: the simulated driver's
//! CDI spec (`sim.gpu-ckpt.io/gpu=<index>|all`) puts libcuda.so.1, libnvidia-ml.so.1, the daemon's
//! socket and one file per selected GPU into the container, and the CUDA workloads of the image
//! `gpu-ckpt/gpu-workloads:1` (glibc, no driver) then run on exactly the selected GPU.
//!
//! - ctr (`run --device sim.gpu-ckpt.io/gpu=N`) under the gpu-ckpt runtime and under runc-v2, so
//!   that the spec is shown to work without the project's shim too;
//! - CRI, under the gpu-ckpt handler, with the device asked for both ways kubelet can: a
//!   `cdi.k8s.io/*` annotation and the `CDI_devices` field.
//!
//! The daemon's process list (host pids, from SO_PEERCRED) shows which GPUs each container's
//! process holds a context on.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use common::*;
use simgpu::testing::{SimConfig, SimNode};
use test_containers::{
    cri::{v1 as cri, ContainerSpec, Cri, PodSpec},
    stack::{Node, GPU_CKPT_HANDLER, GPU_WORKLOADS_IMAGE},
};

/// containerd's runc shim.
const RUNC_V2: &str = "io.containerd.runc.v2";
/// CDI kind of the simulated GPUs.
const KIND: &str = simgpu::cdi::KIND;

/// A simulated node with two GPUs and its CDI spec.
fn sim() -> Result<SimNode> {
    let sim = SimNode::start(SimConfig {
        gpus: 2,
        memory_mib: 512,
        cdi: true,
        ..SimConfig::default()
    })?;
    let spec = sim.cdi_dir().join(simgpu::cdi::SPEC_FILE);
    ensure!(spec.is_file(), "no CDI spec at {}", spec.display());
    Ok(sim)
}

/// A node whose CRI reads the simulated node's CDI spec, with the test images.
fn cdi_node(name: &str, sim: &SimNode) -> Result<Node> {
    node_with(Node::builder(name)?.cni(false).cdi(&[sim.cdi_dir()]))
}

/// How `ctr run` picks the runtime.
#[derive(Clone, Copy, Debug)]
enum Runtime {
    /// The project's shim (`io.containerd.gpu-ckpt.v1`).
    GpuCkpt,
    /// containerd's runc shim (`io.containerd.runc.v2`) with the node's runc and root.
    RuncV2,
}

/// `ctr run -d` of the GPU workloads image with `--device <device>`, its output in `log`;
/// returns the task's pid.
fn run_gpu(
    node: &Node,
    runtime: Runtime,
    device: &str,
    id: &str,
    log: &Path,
    cmd: &[&str],
) -> Result<i32> {
    let _ = std::fs::remove_file(log);
    let log_uri = format!("file://{}", log.display());
    let (flags, runtime_name) = match runtime {
        Runtime::GpuCkpt => (run_flags(node), RUNTIME),
        Runtime::RuncV2 => {
            let mut f = vec!["--runtime".to_string(), RUNC_V2.to_string()];
            f.extend(node.ctr_run_flags());
            (f, RUNC_V2)
        }
    };
    let mut args: Vec<&str> = vec!["run", "-d", "--log-uri", &log_uri, "--device", device];
    args.extend(flags.iter().map(String::as_str));
    args.extend([GPU_WORKLOADS_IMAGE, id]);
    args.extend_from_slice(cmd);
    let out = node.ctr_cdi("default", &args)?;
    if !out.status.success() {
        bail!(
            "ctr {} failed ({}): {}{}\ncontainerd log:\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout),
            node.log_tail(30)
        );
    }
    let info: serde_json::Value =
        serde_json::from_str(&node.ctr_ok(&["container", "info", id])?)?;
    ensure!(
        info["Runtime"]["Name"] == runtime_name,
        "container {id} runs on {}, not {runtime_name}",
        info["Runtime"]["Name"]
    );
    node.task_pid(id)
}

/// Kills and deletes task and container `id`.
fn remove(node: &Node, id: &str) {
    let _ = node.ctr(&["task", "kill", "-s", "SIGKILL", id]);
    for _ in 0..100 {
        if node
            .ctr(&["task", "delete", id])
            .map(|o| o.status.success())
            .unwrap_or(false)
            || node.task_status(id).is_err()
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = node.ctr(&["container", "delete", id]);
}

/// Waits until `log` has a line that `pick` accepts; fails at once on a MISMATCH or a
/// workload's error line (`gpu-train: …`, `gpu-fill: …`).
fn wait_log_line(log: &Path, what: &str, pick: impl Fn(&str) -> bool) -> Result<String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.lines().any(|l| {
            l.contains("MISMATCH") || l.contains("gpu-train: ") || l.contains("gpu-fill: ")
        }) {
            bail!("workload failed while waiting for {what}; output:\n{text}");
        }
        if let Some(l) = text.lines().find(|l| pick(l)) {
            return Ok(l.to_string());
        }
        if Instant::now() > deadline {
            bail!("timed out waiting for {what}; output so far:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `step <k> checksum <16 hex>` lines of gpu-train's output.
fn steps(text: &str) -> Vec<(u64, String)> {
    text.lines()
        .filter_map(|l| {
            // CRI log lines carry a prefix: `<time> stdout F step ...`.
            let l = &l[l.find("step ")?..];
            let mut w = l.split_whitespace();
            match (w.next(), w.next(), w.next(), w.next()) {
                (Some("step"), Some(k), Some("checksum"), Some(sum))
                    if sum.len() == 16 && sum.chars().all(|c| c.is_ascii_hexdigit()) =>
                {
                    Some((k.parse().ok()?, sum.to_string()))
                }
                _ => None,
            }
        })
        .collect()
}

/// Waits until gpu-train in `log` has done `n` steps with checksums, in order from 1 (or 0).
fn wait_steps(log: &Path, n: u64) -> Result<Vec<(u64, String)>> {
    wait_log_line(log, &format!("gpu-train step {n}"), |l| {
        steps(l).first().is_some_and(|(k, _)| *k >= n)
    })?;
    let all = steps(&std::fs::read_to_string(log)?);
    for w in all.windows(2) {
        ensure!(w[1].0 == w[0].0 + 1, "steps out of order: {all:?}");
    }
    Ok(all)
}

/// The UUIDs of the GPUs that the daemon lists for host process `pid`, waiting until it lists
/// at least one.
fn gpus_of(sim: &SimNode, pid: i32) -> Result<Vec<[u8; 16]>> {
    let mut seen = Vec::new();
    wait_until(
        Duration::from_secs(20),
        &format!("the simulated driver to list pid {pid}"),
        || {
            seen = sim.processes().ok()?;
            let mine: Vec<[u8; 16]> = seen
                .iter()
                .filter(|p| p.pid == pid as u32)
                .map(|p| p.gpu)
                .collect();
            (!mine.is_empty()).then_some(mine)
        },
    )
    .with_context(|| format!("processes the daemon lists: {seen:?}"))
}

/// The `device <i> uuid <uuid>` lines of gpu-fill --show-uuids, as UUIDs.
fn shown_uuids(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| {
            let l = &l[l.find("device ")?..];
            let mut w = l.split_whitespace();
            match (w.next(), w.next(), w.next(), w.next()) {
                (Some("device"), Some(_), Some("uuid"), Some(u)) => Some(u.to_string()),
                _ => None,
            }
        })
        .collect()
}

/// The ctr cases on one runtime: gpu-train on GPU 0, gpu-fill on GPU 1 and on all GPUs.
fn ctr_cases(node: &Node, sim: &SimNode, runtime: Runtime, prefix: &str) -> Result<()> {
    let uuids = sim.uuids();
    let raw: Vec<[u8; 16]> = sim.node().gpus.iter().map(|g| g.uuid).collect();
    ensure!(uuids.len() == 2, "expected two simulated GPUs: {uuids:?}");
    let dir = node.paths().dir.clone();

    // gpu-train on GPU 0: steps with checksums, and the daemon sees its process on GPU 0 only.
    let id = format!("{prefix}-train0");
    let log = dir.join(format!("{id}.log"));
    let pid = run_gpu(
        node,
        runtime,
        &format!("{KIND}=0"),
        &id,
        &log,
        &[
            "/usr/bin/gpu-train",
            "--elements",
            "4096",
            "--interval-ms",
            "50",
        ],
    )?;
    let r = (|| {
        let s = wait_steps(&log, 3)?;
        println!("{runtime:?} gpu-train on {KIND}=0: pid {pid}, steps {s:?}");
        let gpus = gpus_of(sim, pid)?;
        ensure!(
            gpus == vec![raw[0]],
            "{runtime:?}: gpu-train with {KIND}=0 uses {gpus:?}, not only GPU 0 {}",
            uuids[0]
        );
        Ok(())
    })();
    remove(node, &id);
    r?;

    // gpu-fill on GPU 1 sees exactly GPU 1's UUID, and the daemon sees it there only.
    for (device, want) in [("1", vec![uuids[1].clone()]), ("all", uuids.clone())] {
        let id = format!("{prefix}-fill-{device}");
        let log = dir.join(format!("{id}.log"));
        let pid = run_gpu(
            node,
            runtime,
            &format!("{KIND}={device}"),
            &id,
            &log,
            &["/usr/bin/gpu-fill", "--mib", "8", "--show-uuids"],
        )?;
        let r = (|| {
            let filled = wait_log_line(&log, "gpu-fill filled", |l| l.contains("filled "))?;
            let n = want.len();
            wait_log_line(&log, &format!("gpu-fill's UUID line {n}"), |l| {
                l.starts_with(&format!("device {} uuid ", n - 1))
            })?;
            let seen = shown_uuids(&std::fs::read_to_string(&log)?);
            println!("{runtime:?} gpu-fill on {KIND}={device}: {filled}; sees {seen:?}");
            ensure!(
                filled.contains(&format!("on {n} GPUs")),
                "{runtime:?} {KIND}={device}: {filled:?}"
            );
            ensure!(
                seen == want,
                "{runtime:?} {KIND}={device}: gpu-fill sees {seen:?}, want {want:?}"
            );
            let gpus = gpus_of(sim, pid)?;
            let want_raw: Vec<[u8; 16]> = match device {
                "1" => vec![raw[1]],
                _ => raw.clone(),
            };
            let mut sorted = gpus.clone();
            sorted.sort();
            let mut want_sorted = want_raw.clone();
            want_sorted.sort();
            ensure!(
                sorted == want_sorted,
                "{runtime:?} {KIND}={device}: the daemon lists pid {pid} on {gpus:?}, want {want_raw:?}"
            );
            Ok(())
        })();
        remove(node, &id);
        r?;
    }
    Ok(())
}

#[test]
fn ctr_device_under_gpu_ckpt_runtime() -> Result<()> {
    let sim = sim()?;
    let node = cdi_node("gpu-cdi-ctr", &sim)?;
    ctr_cases(&node, &sim, Runtime::GpuCkpt, "gck")?;
    ensure!(
        node.log_contains(RUNTIME),
        "containerd's log does not mention {RUNTIME}: the tasks did not run on the shim"
    );
    Ok(())
}

#[test]
fn ctr_device_under_runc_v2() -> Result<()> {
    let sim = sim()?;
    let node = cdi_node("gpu-cdi-runc", &sim)?;
    ctr_cases(&node, &sim, Runtime::RuncV2, "runc")
}

/// Without the spec, ctr refuses the device by name instead of running without a GPU.
#[test]
fn ctr_device_unknown_without_spec() -> Result<()> {
    let empty = tempfile::tempdir()?;
    let node = node_with(
        Node::builder("gpu-cdi-none")?
            .cni(false)
            .cdi(&[empty.path()]),
    )?;
    let log = node.paths().dir.join("none.log");
    let err = run_gpu(
        &node,
        Runtime::GpuCkpt,
        &format!("{KIND}=0"),
        "none",
        &log,
        &["/usr/bin/gpu-train", "--steps", "1"],
    )
    .expect_err("a CDI device without a spec must be refused");
    let msg = format!("{err:#}");
    ensure!(
        msg.contains("unresolvable CDI devices") && msg.contains(&format!("{KIND}=0")),
        "unexpected error: {msg}"
    );
    Ok(())
}

/// The CRI container's host pid (from ContainerStatus's verbose info).
async fn cri_pid(cri: &Cri, id: &str) -> Result<i32> {
    let st = cri.container_status(id).await?;
    let info = st.info.get("info").cloned().unwrap_or_default();
    let json: serde_json::Value = serde_json::from_str(&info).unwrap_or_default();
    json.get("pid")
        .and_then(|p| p.as_i64())
        .map(|p| p as i32)
        .with_context(|| format!("no pid in the status of {id}: {info}"))
}

#[test]
fn cri_pod_gets_gpus_by_annotation_and_cdi_devices() -> Result<()> {
    let sim = sim()?;
    let node = cdi_node("gpu-cdi-cri", &sim)?;
    let uuids = sim.uuids();
    let raw: Vec<[u8; 16]> = sim.node().gpus.iter().map(|g| g.uuid).collect();
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let spec = PodSpec::new("gpu-pod", node.pod_log_root()).handler(GPU_CKPT_HANDLER);
        let pod = cri.run_pod(&spec).await?;

        // GPU 0 through the annotation kubelet's device manager writes for a CDI device plugin.
        let train = ContainerSpec::new("train", GPU_WORKLOADS_IMAGE)
            .command(&["/usr/bin/gpu-train"])
            .args(&["--elements", "4096", "--interval-ms", "50"])
            .annotation("cdi.k8s.io/gpu-ckpt-sim_train", &format!("{KIND}=0"));
        let train_id = cri.run_container(&pod, &train).await?;

        // GPU 1 through ContainerConfig.CDI_devices (the DRA / device plugin field).
        let fill = ContainerSpec::new("fill", GPU_WORKLOADS_IMAGE)
            .command(&["/usr/bin/gpu-fill"])
            .args(&["--mib", "8", "--show-uuids"]);
        let mut config = fill.to_config(&pod.spec);
        config.cdi_devices = vec![cri::CdiDevice {
            name: format!("{KIND}=1"),
        }];
        let dir = pod.spec.log_directory().join("fill");
        std::fs::create_dir_all(&dir)?;
        let fill_id = cri
            .create_container_raw(&pod.id, config, pod.config.clone())
            .await?;
        cri.start_container(&fill_id).await?;

        for id in [&train_id, &fill_id] {
            cri.wait_container_state(
                id,
                cri::ContainerState::ContainerRunning,
                Duration::from_secs(20),
            )
            .await?;
        }

        let s = wait_steps(&pod.container_log("train"), 3)?;
        println!("CRI gpu-train on {KIND}=0 (annotation): steps {s:?}");
        let fill_log = pod.container_log("fill");
        wait_log_line(&fill_log, "gpu-fill's UUID", |l| l.contains(" uuid "))?;
        let seen = shown_uuids(&std::fs::read_to_string(&fill_log)?);
        println!("CRI gpu-fill on {KIND}=1 (CDI_devices): sees {seen:?}");
        ensure!(
            seen == vec![uuids[1].clone()],
            "gpu-fill with CDI_devices {KIND}=1 sees {seen:?}, want only {}",
            uuids[1]
        );

        let train_pid = cri_pid(&cri, &train_id).await?;
        let fill_pid = cri_pid(&cri, &fill_id).await?;
        let train_gpus = gpus_of(&sim, train_pid)?;
        let fill_gpus = gpus_of(&sim, fill_pid)?;
        ensure!(
            train_gpus == vec![raw[0]],
            "CRI gpu-train (pid {train_pid}) uses {train_gpus:?}, not only GPU 0"
        );
        ensure!(
            fill_gpus == vec![raw[1]],
            "CRI gpu-fill (pid {fill_pid}) uses {fill_gpus:?}, not only GPU 1"
        );

        // The containers ran on the project's shim.
        ensure!(
            !shims_of(&node).is_empty(),
            "no containerd-shim-gpu-ckpt-v1 serves the pod"
        );
        cri.remove_pod(&pod).await?;
        Ok(())
    })
}
