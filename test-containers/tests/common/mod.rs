//! Shared setup of the integration tests: a private containerd node with the test images.
#![allow(dead_code)]

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use test_containers::stack::{
    read_images_json, Node, NodeBuilder, Registry, Stack, WORKLOADS_IMAGE,
};

pub const RUNTIME: &str = "io.containerd.gpu-ckpt.v1";

/// A started node whose `default` namespace has the test images (for ctr) and whose images are
/// in the registry (for CRI). Fails, never skips, when the stack is not installed.
pub fn node(name: &str) -> Result<Node> {
    node_with(Node::builder(name)?)
}

pub fn node_with(builder: NodeBuilder) -> Result<Node> {
    let stack = Stack::discover()?;
    let registry = Registry::ensure_running(&stack)?;
    let node = builder.start()?;
    registry.push_images(&node)?;
    for img in read_images_json(&stack.images_dir())? {
        node.import_image(&img.tar, "default")?;
    }
    Ok(node)
}

/// `ctr run` flags for this runtime, keeping fifos under the node.
pub fn run_flags(node: &Node) -> Vec<String> {
    vec![
        "--runtime".into(),
        RUNTIME.into(),
        "--fifo-dir".into(),
        node.paths().fifo_dir.display().to_string(),
    ]
}

/// Runs ctr with `args`, after `run <run_flags>` when `run` is set.
pub fn ctr_run(node: &Node, extra: &[&str]) -> Result<std::process::Output> {
    let flags = run_flags(node);
    let mut args: Vec<&str> = vec!["run"];
    args.extend(flags.iter().map(String::as_str));
    args.extend_from_slice(extra);
    node.ctr(&args)
}

pub fn workloads() -> &'static str {
    WORKLOADS_IMAGE
}

/// Polls `f` until it returns `Some`, or fails after `timeout` with `what`.
pub fn wait_until<T>(timeout: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The counter value a counter workload wrote to its file, read through its rootfs. The counter
/// rewrites the file every tick, so a read can meet it empty: such reads are retried.
pub fn counter_value(pid: i32) -> Option<u64> {
    for _ in 0..50 {
        let text = std::fs::read_to_string(format!("/proc/{pid}/root/counter.txt")).ok()?;
        if let Ok(v) = text.trim().parse() {
            return Some(v);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    None
}

/// Lines of /proc/self/mountinfo that mention `needle`.
pub fn mounts_mentioning(needle: &str) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_string)
        .collect()
}

/// The shim processes serving `node`.
pub fn shims_of(node: &Node) -> Vec<i32> {
    node.shim_processes("containerd-shim-gpu-ckpt-v1")
}

/// Files below `dir` whose name contains `needle`.
pub fn files_named(dir: &Path, needle: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if e.file_name().to_string_lossy().contains(needle) {
                out.push(p.clone());
            }
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                stack.push(p);
            }
        }
    }
    out
}

/// The cgroup v1 memory directory of a process, or its v2 directory.
pub fn memory_cgroup_dir(pid: i32) -> Result<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    for line in text.lines() {
        let parts: Vec<&str> = line.splitn(3, ':').collect();
        if parts.len() == 3 && parts[1].split(',').any(|c| c == "memory") {
            return Ok(
                PathBuf::from("/sys/fs/cgroup/memory").join(parts[2].trim_start_matches('/'))
            );
        }
    }
    for line in text.lines() {
        if let Some(p) = line.strip_prefix("0::") {
            return Ok(PathBuf::from("/sys/fs/cgroup").join(p.trim_start_matches('/')));
        }
    }
    bail!("no memory cgroup for pid {pid}")
}

pub fn read_u64(path: &Path) -> Result<u64> {
    let s = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let s = s.trim();
    if s == "max" {
        return Ok(u64::MAX);
    }
    s.parse()
        .with_context(|| format!("parse {} ({s:?})", path.display()))
}

/// A status file a workload writes, read through its rootfs.
pub fn rootfs_file(pid: i32, path: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/root{path}")).ok()
}

/// Runs a command and returns its output, failing with its stderr when it fails.
pub fn run_ok(cmd: &mut std::process::Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("run {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Restores task `id` from the CRIU image directory `dir` through the containerd API
/// (Tasks.Create with `CriuImagePath`, then Start); returns the restored pid.
pub fn restore_from_dir(node: &Node, id: &str, dir: &Path) -> Result<i32> {
    rt().block_on(async {
        let api =
            test_containers::containerd::Containerd::connect(node.socket(), "default").await?;
        Ok(api.restore_from_image_path(id, dir).await? as i32)
    })
}

/// A single-threaded runtime for a test's async part.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// `ctr run -d` on this runtime with `extra` (flags, image, id, command); returns the task's pid.
pub fn run_detached(node: &Node, extra: &[&str]) -> Result<i32> {
    let mut args = vec!["-d"];
    args.extend_from_slice(extra);
    let out = ctr_run(node, &args)?;
    if !out.status.success() {
        bail!(
            "ctr run -d {}: {}",
            extra.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let id = extra
        .iter()
        .skip_while(|a| **a != workloads())
        .nth(1)
        .context("no container id after the image")?;
    node.task_pid(id)
}

/// CRIU's network lock method as its dump recorded it in `inventory.img` (CRIU's own values:
/// 0 iptables, 1 nftables, 2 skip); the restore uses the same.
pub fn inventory_network_lock(dir: &Path) -> Result<u64> {
    let path = dir.join("inventory.img");
    let b = std::fs::read(&path).with_context(|| format!("read {}", path.display()))?;
    // The inventory carries its own magic only, not CRIU's common one.
    let entry = image_format::criu_stats::first_entry(&b, 1)
        .map_err(|why| anyhow::anyhow!("{}: {why}", path.display()))?;
    let fields = image_format::protowire::fields(entry).context("inventory entry")?;
    // InventoryEntry.network_lock_method = 11.
    image_format::protowire::varint_field(&fields, 11)
        .context("inventory.img records no network lock method")
}

/// The counter workload's value, read in the container through CRI exec from `file` (the
/// counter's `--file`). The counter rewrites its file every tick, so a read can meet it empty:
/// such reads are retried.
pub async fn cri_counter(cri: &test_containers::cri::Cri, id: &str, file: &str) -> Result<u64> {
    let mut last = String::new();
    for _ in 0..50 {
        let r = cri.exec_sync(id, &["cat", file], 10).await?;
        last = r.stdout_str();
        if let Ok(v) = last.trim().parse() {
            return Ok(v);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    bail!("counter of {id}: {last:?}")
}

/// Waits (20 s at most) until the counter read from `file` has passed `above`.
pub async fn cri_counter_above(
    cri: &test_containers::cri::Cri,
    id: &str,
    file: &str,
    above: u64,
) -> Result<u64> {
    for _ in 0..200 {
        if let Ok(v) = cri_counter(cri, id, file).await {
            if v > above {
                return Ok(v);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("the counter of {id} did not pass {above}")
}
