//! Shared setup of the simulated-GPU tests: a simulated driver per node, a containerd node that
//! reads its CDI spec and whose gpu-ckpt handlers load its libraries, and the workloads' output.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use simgpu::testing::{SimConfig, SimNode};
use test_containers::{
    cri::Cri,
    stack::{Node, NodeBuilder, GPU_WORKLOADS_IMAGE},
};

use super::{node_with, restore_handler, run_flags, wait_until, RESTORE_HANDLER, RUNTIME};

/// containerd's runc shim.
pub const RUNC_V2: &str = "io.containerd.runc.v2";
/// CDI kind of the simulated GPUs.
pub const KIND: &str = simgpu::cdi::KIND;

/// A simulated driver as `cfg` describes it, with its CDI spec. Two nodes with different
/// `uuid_seed`s have different GPUs.
pub fn sim_node(cfg: SimConfig) -> Result<SimNode> {
    let sim = SimNode::start(SimConfig { cdi: true, ..cfg })?;
    let spec = sim.cdi_dir().join(simgpu::cdi::SPEC_FILE);
    ensure!(spec.is_file(), "no CDI spec at {}", spec.display());
    Ok(sim)
}

/// `gpus` simulated GPUs of `memory_mib` each, UUIDs from `seed`.
pub fn sim_gpus(gpus: u32, memory_mib: u64, seed: &str) -> Result<SimNode> {
    sim_node(gpus_config(gpus, memory_mib, seed))
}

/// The configuration of [`sim_gpus`], for a node that differs from it in another field.
pub fn gpus_config(gpus: u32, memory_mib: u64, seed: &str) -> SimConfig {
    SimConfig {
        gpus,
        memory_mib,
        uuid_seed: seed.to_string(),
        ..SimConfig::default()
    }
}

/// Two GPU nodes `gpu-<name>-a` and `gpu-<name>-b` ([`gpu_node`]), each with its own simulated
/// driver of `gpus` GPUs (256 MiB each) and other UUIDs.
pub fn two_gpu_nodes(name: &str, gpus: u32) -> Result<(SimNode, SimNode, Node, Node)> {
    let sim_a = sim_gpus(gpus, 256, &format!("{name}-a"))?;
    let sim_b = sim_gpus(gpus, 256, &format!("{name}-b"))?;
    let a = gpu_node(&format!("gpu-{name}-a"), &sim_a, &[])?;
    let b = gpu_node(&format!("gpu-{name}-b"), &sim_b, &[])?;
    Ok((sim_a, sim_b, a, b))
}

/// A node whose CRI reads the simulated node's CDI spec, with the test images.
pub fn cdi_node(name: &str, sim: &SimNode) -> Result<Node> {
    node_with(Node::builder(name)?.cni(false).cdi(&[sim.cdi_dir()]))
}

/// A GPU node on `sim`: CDI from its spec, and the shim loading its libcuda.so.1 and
/// libnvidia-ml.so.1 (`DriverLibraryDir`) under every way a container reaches it: the gpu-ckpt
/// handler (CRI), the restore handler, and ctr (the handler options file named by
/// `GPU_CKPT_HANDLER_CONFIG`), with the workspace's NCCL layer (`NcclLayer`: the build's
/// `libgpu_ckpt_nccl.so`) for containers that opt in. `options` go to all three (a key of
/// theirs in place of the default's).
pub fn gpu_node(name: &str, sim: &SimNode, options: &[(&str, &str)]) -> Result<Node> {
    gpu_node_with(Node::builder(name)?, name, sim, options)
}

/// [`gpu_node`] on a builder the caller has set up.
pub fn gpu_node_with(
    builder: NodeBuilder,
    name: &str,
    sim: &SimNode,
    options: &[(&str, &str)],
) -> Result<Node> {
    let lib_dir = sim.lib_dir().display().to_string();
    let layer = nccl_layer()?.display().to_string();
    let mut all: Vec<(&str, &str)> = vec![
        ("DriverLibraryDir", lib_dir.as_str()),
        ("NcclLayer", layer.as_str()),
    ];
    // A caller's own value of one of these goes in its place.
    all.retain(|(k, _)| !options.iter().any(|(o, _)| o == k));
    all.extend_from_slice(options);
    let file = handler_file(name, &all)?;
    let mut restore = restore_handler(name, RESTORE_HANDLER)?;
    let mut b = builder
        .cdi(&[sim.cdi_dir()])
        .env("GPU_CKPT_HANDLER_CONFIG", &file.display().to_string());
    for (k, v) in &all {
        b = b.runtime_option(k, opt_value(v));
        restore.options.insert(k.to_string(), opt_value(v));
    }
    node_with(b.extra_runtime(restore))
}

/// The workspace's build of gpu-ckpt's NCCL layer (`gpu/nccl-layer`), which test nodes name as
/// `NcclLayer`.
pub fn nccl_layer() -> Result<PathBuf> {
    test_containers::gpuproc::binary(
        &test_containers::stack::Stack::discover()?,
        "libgpu_ckpt_nccl.so",
    )
}

/// The handler options file for ctr's containers on node `name` (ctr sends no options).
fn handler_file(name: &str, options: &[(&str, &str)]) -> Result<PathBuf> {
    let dir = test_containers::stack::Stack::discover()?.node_dir(name);
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("gpu-ckpt-handler.toml");
    let body: String = options
        .iter()
        .map(|(k, v)| format!("{k} = {}\n", toml_quote(v)))
        .collect();
    std::fs::write(&path, body)?;
    Ok(path)
}

/// `true`/`false` as TOML booleans, anything else as a string.
fn opt_value(v: &str) -> test_containers::stack::OptValue {
    match v {
        "true" => true.into(),
        "false" => false.into(),
        _ => v.into(),
    }
}

fn toml_quote(v: &str) -> String {
    match v {
        "true" | "false" => v.to_string(),
        _ => format!("{v:?}"),
    }
}

/// The last step gpu-train logged in `log`.
pub fn last_step(log: &Path) -> Option<(u64, String)> {
    steps(&std::fs::read_to_string(log).ok()?).last().cloned()
}

/// Waits until `log` shows a step after `after`, and checks that the steps logged since go on
/// one by one from there (a restore continues, never restarts); returns the new steps.
pub fn wait_steps_after(log: &Path, after: u64, n: u64) -> Result<Vec<(u64, String)>> {
    let want = after + n;
    wait_log_line(log, &format!("gpu-train step {want}"), |l| {
        steps(l).first().is_some_and(|(k, _)| *k >= want)
    })?;
    let all = steps(&std::fs::read_to_string(log)?);
    let tail: Vec<(u64, String)> = all.iter().filter(|(k, _)| *k > after).cloned().collect();
    ensure!(
        tail.first().map(|(k, _)| *k) == Some(after + 1),
        "after step {after} the log goes on with {:?}: not continuing from the checkpoint; log: {all:?}",
        tail.first()
    );
    for w in tail.windows(2) {
        ensure!(w[1].0 == w[0].0 + 1, "steps out of order: {all:?}");
    }
    Ok(tail)
}

/// How `ctr run` picks the runtime.
#[derive(Clone, Copy, Debug)]
pub enum Runtime {
    /// The project's shim (`io.containerd.gpu-ckpt.v1`).
    GpuCkpt,
    /// containerd's runc shim (`io.containerd.runc.v2`) with the node's runc and root.
    RuncV2,
}

/// `ctr run -d` of the GPU workloads image with `--device <device>`, its output in `log`;
/// returns the task's pid.
pub fn run_gpu(
    node: &Node,
    runtime: Runtime,
    device: &str,
    id: &str,
    log: &Path,
    cmd: &[&str],
) -> Result<i32> {
    run_gpu_with(node, runtime, device, &[], id, log, cmd)
}

/// [`run_gpu`] with `extra` ctr flags (`--env`, `--mount`).
pub fn run_gpu_with(
    node: &Node,
    runtime: Runtime,
    device: &str,
    extra: &[&str],
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
    args.extend_from_slice(extra);
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
pub fn remove(node: &Node, id: &str) {
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
pub fn wait_log_line(log: &Path, what: &str, pick: impl Fn(&str) -> bool) -> Result<String> {
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
pub fn steps(text: &str) -> Vec<(u64, String)> {
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
pub fn wait_steps(log: &Path, n: u64) -> Result<Vec<(u64, String)>> {
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
pub fn gpus_of(sim: &SimNode, pid: i32) -> Result<Vec<[u8; 16]>> {
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

/// The GPU device nodes (`/dev/nvidia<N>`) process `pid` holds open, and the GPU nodes in the
/// `/dev` of its root (`nvidia<N>`), each sorted: what a real driver's process holds and sees.
pub fn gpu_nodes(pid: i32) -> Result<(Vec<String>, Vec<String>)> {
    let is_gpu = |name: &str| {
        name.strip_prefix("nvidia")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    let mut held: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))?
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|l| l.to_str().map(str::to_string))
        .filter(|l| l.strip_prefix("/dev/").is_some_and(is_gpu))
        .collect();
    held.sort();
    held.dedup();
    let mut present: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/root/dev"))?
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| is_gpu(n))
        .collect();
    present.sort();
    Ok((held, present))
}

/// The CRI container's host pid as ContainerStatus's verbose info reports it, 0 included.
pub async fn cri_status_pid(cri: &Cri, id: &str) -> Result<i32> {
    let st = cri.container_status(id).await?;
    let info = st.info.get("info").cloned().unwrap_or_default();
    let json: serde_json::Value = serde_json::from_str(&info).unwrap_or_default();
    json.get("pid")
        .and_then(|p| p.as_i64())
        .map(|p| p as i32)
        .with_context(|| format!("no pid in the status of {id}: {info}"))
}

/// The CRI container's host pid ([`cri_status_pid`]); an error when CRI reports pid 0 for it
/// (a started container has a process).
pub async fn cri_pid(cri: &Cri, id: &str) -> Result<i32> {
    let pid = cri_status_pid(cri, id).await?;
    ensure!(
        pid > 0,
        "CRI's ContainerStatus reports pid {pid} for container {id}"
    );
    Ok(pid)
}

/// A workspace binary next to the test executable's directory (target/<profile>/).
pub fn workspace_bin(name: &str) -> PathBuf {
    simgpu::testing::workspace_binary(name)
        .unwrap_or_else(|e| panic!("{e:#} (cargo build --workspace)"))
}

/// The lines `child` prints on its stdout, as they come.
pub fn stdout_lines(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let out = child.stdout.take().expect("stdout piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

/// The library's exported symbols starting with `prefix` (nm -D --defined-only).
pub fn exports(lib: &Path, prefix: &str) -> Vec<String> {
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(lib)
        .output()
        .unwrap_or_else(|e| panic!("nm (binutils): {e}"));
    assert!(out.status.success(), "nm {}: {out:?}", lib.display());
    let v: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|s| s.starts_with(prefix))
        .map(str::to_string)
        .collect();
    assert!(
        !v.is_empty(),
        "{} exports no {prefix}* symbol",
        lib.display()
    );
    v
}

/// A file of the pinned NCCL wheel in the stack's venv (test-containers/stack/install.sh), by its
/// path under `nvidia/nccl/` (`lib/libnccl.so.2`, `include/nccl.h`).
pub fn nccl_wheel_file(rel: &str) -> Result<PathBuf> {
    let py = test_containers::stack::venv_python("nvidia-nccl-cu13")?;
    let out = Command::new(&py)
        .args([
            "-c",
            &format!("import importlib.metadata as m; print(m.distribution('nvidia-nccl-cu13').locate_file('nvidia/nccl/{rel}'))"),
        ])
        .output()?;
    ensure!(
        out.status.success(),
        "{} has no nvidia-nccl-cu13 (run `make deps`): {}",
        py.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let file = PathBuf::from(String::from_utf8(out.stdout)?.trim());
    ensure!(file.is_file(), "{} is missing", file.display());
    Ok(file)
}
