//! gpu-ckpt's NCCL layer injected at Create into a container that opts in
//! (`gpu-ckpt.io/nccl: managed`), on a simulated GPU node whose handlers name the workspace's
//! build of the layer (`NcclLayer`): the layer bind-mounted read-only and first in
//! `LD_PRELOAD`, the control socket's directory made on the node and bind-mounted read-only,
//! `nosuid,nodev,noexec`, with `GPU_CKPT_NCCL_SOCKET`; a container without the annotation
//! untouched; a bad value and a missing layer refused at Create. A managed GPU container (that
//! maps the layer but no NCCL) checkpoints, and its checkpoint restores: the restore's mount
//! checks accept both mounts (the socket directory made afresh), and training goes on from its
//! step.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::{gpu::*, restore_from_dir, wait_until};
use crate::gpu_shim::{ctr_log, ctr_sh_with};
use anyhow::{bail, ensure, Context, Result};
use test_containers::stack::Node;

/// gpu-train, its log on a tmpfs that travels with a checkpoint.
const TRAIN: &str =
    "exec /usr/bin/gpu-train --elements 4096 --interval-ms 50 > /out/train.log 2>&1";
const MANAGED: &str = "gpu-ckpt.io/nccl=managed";
const LAYER: &str = "/usr/lib/gpu-ckpt/libgpu-ckpt-nccl.so";
const SOCKET_DIR: &str = "/run/gpu-ckpt-nccl";

/// `ctr <verb> --device <GPU 0> <extra> … <image> <id> sh -c TRAIN`, `verb` being `run -d` or
/// `container create`.
fn ctr_train(node: &Node, verb: &[&str], extra: &[&str], id: &str) -> Result<()> {
    ctr_sh_with(node, verb, &format!("{KIND}=0"), extra, id, TRAIN)
}

/// gpu-train run with `extra` ctr flags, up to its third step; its pid.
fn train(node: &Node, extra: &[&str], id: &str) -> Result<i32> {
    ctr_train(node, &["run", "-d"], extra, id)?;
    let pid = node.task_pid(id)?;
    wait_steps(&ctr_log(pid), 3).with_context(|| format!("{id} before its checkpoint"))?;
    Ok(pid)
}

/// Process `pid`'s environment.
fn environ(pid: i32) -> Result<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/environ"))?;
    Ok(raw
        .split(|b| *b == 0)
        .filter(|e| !e.is_empty())
        .map(|e| String::from_utf8_lossy(e).into_owned())
        .collect())
}

/// The options of the mount at `mountpoint` in process `pid`'s mount table (its per-mount
/// options, field 6 of mountinfo), if there is one.
fn mount_options(pid: i32, mountpoint: &str) -> Result<Option<Vec<String>>> {
    let table = std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))?;
    Ok(table.lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        (f.get(4) == Some(&mountpoint)).then(|| f[5].split(',').map(str::to_string).collect())
    }))
}

/// The node's socket directory of container `id` (namespace `default`).
fn host_dir(id: &str) -> PathBuf {
    Path::new("/run/gpu-ckpt/nccl/default").join(id)
}

/// Process `pid` runs under the layer, and the node holds the container's socket directory.
fn check_managed(pid: i32, id: &str) -> Result<()> {
    let env = environ(pid)?;
    ensure!(
        env.iter().any(|e| e == &format!("LD_PRELOAD={LAYER}")
            || e.starts_with(&format!("LD_PRELOAD={LAYER}:"))),
        "{id}: no LD_PRELOAD with the layer first: {env:?}"
    );
    ensure!(
        env.contains(&format!("GPU_CKPT_NCCL_SOCKET={SOCKET_DIR}/control.sock")),
        "{id}: no GPU_CKPT_NCCL_SOCKET: {env:?}"
    );
    // The handler's NcclRelease (unset: destroy).
    ensure!(
        env.contains(&"GPU_CKPT_NCCL_RELEASE=destroy".to_string()),
        "{id}: no GPU_CKPT_NCCL_RELEASE=destroy: {env:?}"
    );
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    ensure!(
        maps.contains(LAYER),
        "{id}: gpu-train does not map the layer"
    );
    let layer = mount_options(pid, LAYER)?.with_context(|| format!("{id}: no mount at {LAYER}"))?;
    ensure!(
        layer.contains(&"ro".to_string()),
        "{id}: {LAYER} is {layer:?}"
    );
    let dir = mount_options(pid, SOCKET_DIR)?
        .with_context(|| format!("{id}: no mount at {SOCKET_DIR}"))?;
    for flag in ["ro", "nosuid", "nodev", "noexec"] {
        ensure!(
            dir.iter().any(|o| o == flag),
            "{id}: {SOCKET_DIR} is {dir:?}"
        );
    }
    let m = std::fs::symlink_metadata(host_dir(id))
        .with_context(|| format!("{id}: the node's socket directory"))?;
    ensure!(
        m.is_dir() && m.permissions().mode() & 0o7777 == 0o755,
        "{id}: {} is {m:?}",
        host_dir(id).display()
    );
    Ok(())
}

/// `ctr run` of `id` with `extra` flags fails, naming each of `needles`.
fn refused_at_create(node: &Node, extra: &[&str], id: &str, needles: &[&str]) -> Result<()> {
    let err = match ctr_train(node, &["run", "-d"], extra, id) {
        Ok(()) => bail!("{id}: created and running"),
        Err(e) => format!("{e:#}"),
    };
    remove(node, id);
    for n in needles {
        ensure!(
            err.contains(n),
            "{id}: the refusal does not name {n:?}: {err}"
        );
    }
    Ok(())
}

#[test]
fn a_container_that_opts_in_gets_the_layer_and_keeps_it_through_a_restore() -> Result<()> {
    let sim = sim_gpus(1, 256, "nccl-inject")?;
    let node = gpu_node("gpu-nccl-inject", &sim, &[])?;
    let ids = ["plain", "managed", "bad", "nolayer"];
    let r = (|| {
        // Without the annotation (and the handler's default off): untouched.
        let pid = train(&node, &[], "plain")?;
        let env = environ(pid)?;
        ensure!(
            !env.iter()
                .any(|e| e.starts_with("GPU_CKPT_NCCL_SOCKET=") || e.starts_with("LD_PRELOAD=")),
            "plain: {env:?}"
        );
        ensure!(mount_options(pid, SOCKET_DIR)?.is_none() && mount_options(pid, LAYER)?.is_none());
        ensure!(!host_dir("plain").exists(), "plain has a socket directory");
        remove(&node, "plain");

        // With it: the layer, the directory, the environment.
        let pid = train(&node, &["--annotation", MANAGED], "managed")?;
        check_managed(pid, "managed")?;
        // An exec'd process gets the same environment (a rank started by `kubectl exec`).
        let out = node.ctr(&["task", "exec", "--exec-id", "env", "managed", "/bin/env"])?;
        let exec_env = String::from_utf8_lossy(&out.stdout).to_string();
        ensure!(
            out.status.success(),
            "ctr task exec: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        for want in [
            format!("LD_PRELOAD={LAYER}"),
            format!("GPU_CKPT_NCCL_SOCKET={SOCKET_DIR}/control.sock"),
            "GPU_CKPT_NCCL_RELEASE=destroy".to_string(),
        ] {
            ensure!(
                exec_env.lines().any(|l| l == want),
                "the exec's environment has no {want}: {exec_env}"
            );
        }
        // It maps the layer but no NCCL: checkpointed, and training on.
        let out = node.ctr(&["task", "checkpoint", "managed"])?;
        ensure!(
            out.status.success(),
            "the managed container's checkpoint failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let now = last_step(&ctr_log(pid)).map(|s| s.0).unwrap_or_default();
        wait_steps_after(&ctr_log(pid), now, 3)?;
        // ctr names a checkpoint's image by the second: the next one must not share it.
        std::thread::sleep(Duration::from_millis(1100));
        let dir = node.paths().dir.join("managed-exit");
        node.checkpoint_task_exit("managed", &dir)?;
        wait_until(
            Duration::from_secs(10),
            "the checkpointed task to stop",
            || (!Path::new(&format!("/proc/{pid}")).exists()).then_some(()),
        )?;
        remove(&node, "managed");
        // Restored (containerd's restore from the image directory): the layer and a socket
        // directory made afresh for the restored container, which the restore's mount checks
        // hold it to.
        ctr_train(
            &node,
            &["container", "create"],
            &["--annotation", MANAGED],
            "managed",
        )?;
        let pid = restore_from_dir(&node, "managed", &dir)?;
        check_managed(pid, "managed")?;
        let log = std::fs::read_to_string(ctr_log(pid)).unwrap_or_default();
        let at = steps(&log).last().map(|s| s.0).unwrap_or(0);
        wait_steps_after(&ctr_log(pid), at, 3).context("the restored training")?;
        remove(&node, "managed");

        // A value other than managed or off: refused at Create, naming it.
        refused_at_create(
            &node,
            &["--annotation", "gpu-ckpt.io/nccl=on"],
            "bad",
            &["annotation gpu-ckpt.io/nccl is \"on\": expected \"managed\" or \"off\""],
        )?;
        // The layer missing where the handler's options say: refused at Create, naming it.
        let file = test_containers::stack::Stack::discover()?
            .node_dir("gpu-nccl-inject")
            .join("gpu-ckpt-handler.toml");
        let options = std::fs::read_to_string(&file)?;
        let layer = nccl_layer()?.display().to_string();
        std::fs::write(
            &file,
            options.replace(&layer, "/nonexistent/libgpu-ckpt-nccl.so"),
        )?;
        let r = refused_at_create(
            &node,
            &["--annotation", MANAGED],
            "nolayer",
            &[
                "the NCCL layer /nonexistent/libgpu-ckpt-nccl.so (the handler option NcclLayer",
                "does not exist",
            ],
        );
        std::fs::write(&file, options)?;
        r?;
        ensure!(
            !host_dir("nolayer").exists(),
            "a refused Create left a socket directory"
        );
        Ok(())
    })();
    for id in ids {
        remove(&node, id);
        let _ = std::fs::remove_dir_all(host_dir(id));
    }
    r
}
