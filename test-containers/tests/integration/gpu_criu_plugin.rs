//! CRIU's own cuda plugin on a GPU node: CRIU finds `cuda_plugin.so` (built by the stack
//! installer from the stack's CRIU source into `$STACK/lib/criu`, named to CRIU by
//! `CRIU_LIBS_DIR` as a distribution's CRIU finds it in its plugin directory) and a
//! `cuda-checkpoint` on its PATH (gpu-ckpt-cuda-checkpoint over the node's simulated libcuda, the
//! part of NVIDIA's command line the plugin runs). There is no NVIDIA kernel module here, so
//! `CRIU_FAULT=138` (CRIU's FI_PLUGIN_CUDA_FORCE_ENABLE) keeps the plugin on where it would find
//! no `/proc/driver/nvidia/gpus`.
//!
//! containerd's runc shim names no plugin directory: there the plugin locks and checkpoints the
//! GPU process itself, as CRIU's log shows, so the plugin acts on these nodes. The gpu-ckpt
//! shim's dumps and restores load no plugin: a container checkpointed on GPU 0 of one node
//! restores onto GPU 1 of another (the shim's device map, which the plugin has no way to give)
//! and goes on from its step.

use std::path::{Path, PathBuf};
use std::process::Output;

use crate::common::{gpu::*, *};
use anyhow::{ensure, Context, Result};
use simgpu::testing::SimNode;
use test_containers::stack::{Node, Stack, GPU_WORKLOADS_IMAGE};

/// gpu-train logging into a tmpfs at /out, which CRIU carries with the process.
const TRAIN: &str =
    "exec /usr/bin/gpu-train --elements 4096 --interval-ms 100 > /out/train.log 2>&1";

/// A GPU node on `sim` whose CRIU loads the cuda plugin unless told otherwise, with a
/// `cuda-checkpoint` first in its PATH, and CRIU 4.1.1 before 4.2.1 there when `oldest`.
fn plugin_node(name: &str, sim: &SimNode, oldest: bool) -> Result<Node> {
    let stack = Stack::discover()?;
    let plugins = stack.prefix().join("lib/criu");
    ensure!(
        plugins.join("cuda_plugin.so").is_file(),
        "{} has no cuda_plugin.so: run test-containers/stack/install.sh",
        plugins.display()
    );
    let tools = stack.node_dir(name).join("cuda-tools");
    std::fs::create_dir_all(&tools)?;
    let tool = tools.join("cuda-checkpoint");
    // The node's libcuda.so.1 stands where the loader finds a real node's.
    std::fs::write(
        &tool,
        format!(
            "#!/bin/sh\nLD_LIBRARY_PATH={} exec {} \"$@\"\n",
            sim.lib_dir().display(),
            stack.shim_dir().join("gpu-ckpt-cuda-checkpoint").display()
        ),
    )?;
    std::fs::set_permissions(&tool, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let mut path = format!("{}:", tools.display());
    if oldest {
        path.push_str(&format!("{}:", stack.criu_oldest_dir().display()));
    }
    path.push_str(&stack.path_env());
    let builder = Node::builder(name)?
        .env("PATH", &path)
        .env("CRIU_LIBS_DIR", &plugins.display().to_string())
        .env("CRIU_FAULT", "138");
    gpu_node_with(builder, name, sim, &[])
}

/// `out`'s stdout when `what` exited 0, else an error with all it printed.
fn succeeded(what: &str, out: Output) -> Result<String> {
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.success(), "{what}: {}: {text}{err}", out.status);
    Ok(text)
}

/// Two such nodes, `gpu-<name>-a` and `gpu-<name>-b`, with two simulated GPUs each (other UUIDs
/// on each node).
fn plugin_nodes(name: &str, oldest: bool) -> Result<(SimNode, SimNode, Node, Node)> {
    let sim_a = sim_gpus(2, 256, &format!("{name}-a"))?;
    let sim_b = sim_gpus(2, 256, &format!("{name}-b"))?;
    let a = plugin_node(&format!("gpu-{name}-a"), &sim_a, oldest)?;
    let b = plugin_node(&format!("gpu-{name}-b"), &sim_b, oldest)?;
    Ok((sim_a, sim_b, a, b))
}

/// What the node's `cuda-checkpoint` prints for `args`, failing on a nonzero exit.
fn cuda_checkpoint(node: &str, args: &[&str]) -> Result<String> {
    let tool = Stack::discover()?
        .node_dir(node)
        .join("cuda-tools/cuda-checkpoint");
    let out = std::process::Command::new(&tool).args(args).output()?;
    succeeded(&format!("cuda-checkpoint {args:?}"), out)
}

/// `ctr task checkpoint` of `id` (with `--exit` when `exit`) into `<id>-images`, CRIU's work
/// directory (and so its log) kept in `<id>-work`: those two and what ctr said.
fn dump_keeping_log(node: &Node, id: &str, exit: bool) -> Result<(PathBuf, PathBuf, Output)> {
    let images = node.paths().dir.join(format!("{id}-images"));
    let work = node.paths().dir.join(format!("{id}-work"));
    for d in [&images, &work] {
        let _ = std::fs::remove_dir_all(d);
    }
    let paths = [images.display().to_string(), work.display().to_string()];
    let exit = if exit { &["--exit"][..] } else { &[] };
    let args = [
        &["task", "checkpoint"][..],
        exit,
        &["--image-path", &paths[0], "--work-path", &paths[1], id],
    ]
    .concat();
    let out = node.ctr(&args)?;
    Ok((images, work, out))
}

/// `ctr` with `verb` (`run -d` or `container create`) of gpu-train on simulated GPU `gpu`, with
/// the tmpfs /out and `runtime` flags.
fn train(node: &Node, verb: &[&str], runtime: &[String], gpu: u32, id: &str) -> Result<()> {
    let device = format!("{KIND}={gpu}");
    let tmpfs = "type=tmpfs,src=tmpfs,dst=/out,options=rw:size=16m";
    let runtime: Vec<&str> = runtime.iter().map(String::as_str).collect();
    let args = [
        verb,
        &["--device", &device, "--mount", tmpfs],
        &runtime,
        &[GPU_WORKLOADS_IMAGE, id, "/bin/sh", "-c", TRAIN],
    ]
    .concat();
    succeeded(&format!("ctr {args:?}"), node.ctr_cdi("default", &args)?)?;
    Ok(())
}

fn train_log(pid: i32) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/root/out/train.log"))
}

/// CRIU's log `file` in `work`, which must show CRIU finishing and no plugin loaded.
fn no_plugin_in(work: &Path, file: &str, finished: &str) -> Result<()> {
    let path = work.join(file);
    let log = std::fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
    let plugin: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("cuda_plugin") || l.contains("Plugin \""))
        .collect();
    ensure!(
        plugin.is_empty(),
        "CRIU loaded a plugin ({}): {plugin:#?}",
        path.display()
    );
    ensure!(
        log.contains(finished),
        "{} does not say {finished:?}; it ends:\n{}",
        path.display(),
        log.lines().rev().take(15).collect::<Vec<_>>().join("\n")
    );
    Ok(())
}

/// Restores task `id` on `node` from the CRIU images in `images` through the containerd API,
/// with CRIU's work directory (and so its log) kept in `work`; returns the pid.
fn restore_keeping_log(node: &Node, id: &str, images: &Path, work: &Path) -> Result<i32> {
    let mut options = test_containers::containerd::criu_image_path_options(images);
    // containerd.runc.v1.Options.criu_work_path.
    prost::encoding::string::encode(11, &work.display().to_string(), &mut options.value);
    rt().block_on(async {
        let api =
            test_containers::containerd::Containerd::connect(node.socket(), "default").await?;
        let req = test_containers::containerd::containerd_client::services::v1::CreateTaskRequest {
            container_id: id.to_string(),
            options: Some(options),
            ..Default::default()
        };
        Ok(api
            .create_and_start(req, "with CRIU's work directory kept")
            .await? as i32)
    })
}

#[test]
fn with_criu_cuda_plugin_installed_gpu_checkpoint_and_restore_are_the_shims() -> Result<()> {
    let (sim_a, sim_b, a, b) = plugin_nodes("plugin", false)?;
    let help = cuda_checkpoint("gpu-plugin-a", &["-h"])?;
    ensure!(help.contains("--action"), "cuda-checkpoint -h: {help}");

    // containerd's runc shim: CRIU loads the plugin, which locks the GPU process through
    // cuda-checkpoint and checkpoints it.
    let mut runc_v2 = vec!["--runtime".to_string(), RUNC_V2.to_string()];
    runc_v2.extend(a.ctr_run_flags());
    train(&a, &["run", "-d"], &runc_v2, 0, "plain")?;
    let pid = a.task_pid("plain")?;
    wait_steps(&train_log(pid), 3)?;
    let state = cuda_checkpoint("gpu-plugin-a", &["--get-state", "--pid", &pid.to_string()])?;
    ensure!(
        state.trim() == "running",
        "cuda-checkpoint --get-state: {state:?}"
    );
    let (_, work, out) = dump_keeping_log(&a, "plain", false)?;
    let log = std::fs::read_to_string(work.join("dump.log")).with_context(|| {
        format!(
            "no CRIU log of runc's dump ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    for line in [
        format!("cuda_plugin: pausing devices on pid {pid}"),
        format!("cuda_plugin: Checkpointing CUDA devices on pid {pid}"),
    ] {
        ensure!(
            log.contains(&line),
            "CRIU's cuda plugin did not act under runc ({}): no {line:?} in {}",
            out.status,
            work.join("dump.log").display()
        );
    }
    println!("under runc, CRIU's cuda plugin locked and checkpointed pid {pid}");
    remove(&a, "plain");

    checkpoint_on_gpu0_restore_on_gpu1(&sim_a, &sim_b, &a, &b, "4.2.1")
}

/// The same with CRIU 4.1.1, which reads the plugin directory from the shim's configuration file
/// too (the plugin here, built for 4.2, is one 4.1.1 would refuse to load, failing the dump).
#[test]
fn with_criu_cuda_plugin_installed_the_oldest_criu_loads_no_plugin_either() -> Result<()> {
    let (sim_a, sim_b, a, b) = plugin_nodes("plugin-old", true)?;
    checkpoint_on_gpu0_restore_on_gpu1(&sim_a, &sim_b, &a, &b, "4.1.1")
}

/// The gpu-ckpt shim: the dump on node A's GPU 0 and the restore onto node B's GPU 1 run
/// without a plugin, the device steps are the shim's, and the workload goes on from its step.
/// `criu`: the CRIU release the nodes run.
fn checkpoint_on_gpu0_restore_on_gpu1(
    sim_a: &SimNode,
    sim_b: &SimNode,
    a: &Node,
    b: &Node,
    criu: &str,
) -> Result<()> {
    let shim = run_flags(a);
    train(a, &["run", "-d"], &shim, 0, "t")?;
    let pid = a.task_pid("t")?;
    wait_steps(&train_log(pid), 3)?;
    let (images, dump_work, out) = dump_keeping_log(a, "t", true)?;
    succeeded("ctr task checkpoint --exit", out)?;
    no_plugin_in(&dump_work, "dump.log", "Dumping finished successfully")?;
    let before = image_format::manifest::Manifest::read_from(&images)?;
    ensure!(
        before.node.criu == criu,
        "the checkpoint ran CRIU {}",
        before.node.criu
    );
    ensure!(
        before.devices.gpus.len() == 1 && before.devices.gpus[0].uuid == sim_a.uuids()[0],
        "the checkpoint records {:?}",
        before.devices
    );
    remove(a, "t");

    train(
        b,
        &["container", "create"],
        &["--runtime".into(), RUNTIME.into()],
        1,
        "t",
    )?;
    let restore_work = b.paths().dir.join("t-restore-work");
    let _ = std::fs::remove_dir_all(&restore_work);
    let restored = restore_keeping_log(b, "t", &images, &restore_work)?;
    no_plugin_in(
        &restore_work,
        "restore.log",
        "Restore finished successfully",
    )?;
    let text = std::fs::read_to_string(train_log(restored)).unwrap_or_default();
    let last = steps(&text).last().map(|s| s.0).unwrap_or(0);
    let went_on = wait_steps_after(&train_log(restored), last, 3)?;
    ensure!(
        gpus_of(sim_b, restored)? == vec![sim_b.node().gpus[1].uuid],
        "the restore on node B does not run on its GPU 1"
    );
    let state = cuda_checkpoint(b.name(), &["--get-state", "--pid", &restored.to_string()])?;
    ensure!(state.trim() == "running", "after the restore: {state:?}");
    println!("restored pid {restored} on node B's GPU 1 goes on after step {last}: {went_on:?}");
    remove(b, "t");
    Ok(())
}
