//! containerd restarts under running gpu-ckpt containers, and a shim killed outright: the
//! containers run on across a restart, containerd reconnects to their shim, and the next
//! checkpoint and restore work; a killed shim is cleaned up by containerd through the shim's
//! delete action, leaving no runc state or mount behind.

mod common;

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use common::*;

#[test]
fn containers_survive_a_containerd_restart_and_checkpoint_after_it() -> Result<()> {
    let mut node = node("restart-ctd")?;
    let pid = start_counter(&node, "r1", "100")?;
    let shims = shims_of(&node);
    ensure!(!shims.is_empty(), "no gpu-ckpt shim serves r1");

    node.restart_containerd()?;

    // The same process, counting on, under the same shim; containerd knows it again.
    let now = counter_value(pid).context("the counter is gone after the restart")?;
    counter_goes_on(pid, now)?;
    ensure!(
        node.task_pid("r1")? == pid,
        "containerd reports another pid for r1"
    );
    ensure!(
        node.task_status("r1")? == "RUNNING",
        "r1 is {} after the restart",
        node.task_status("r1")?
    );
    ensure!(
        shims_of(&node) == shims,
        "the shim changed across the restart"
    );

    // The next checkpoint and restore go through the reconnected shim.
    let dir = node.paths().dir.join("r1-after");
    node.checkpoint_task_exit("r1", &dir)?;
    node.ctr_ok(&["task", "rm", "r1"])?;
    let restored = restore_from_dir(&node, "r1", &dir)?;
    let first = counter_value(restored).unwrap_or(0);
    ensure!(
        first >= now,
        "the restore after the restart started over: {first}"
    );
    counter_goes_on(restored, first)?;
    Ok(())
}

#[test]
fn a_killed_shim_is_cleaned_up_by_containerd() -> Result<()> {
    let node = node("shim-kill")?;
    let pid = start_counter(&node, "k1", "100")?;
    let shims = shims_of(&node);
    ensure!(shims.len() == 1, "shims of k1: {shims:?}");
    // ctr sends no runtime options: runc's root is the shim's default, in containerd's state.
    let runc_state = node.paths().state.join("gpu-ckpt/default/k1");
    ensure!(
        runc_state.exists(),
        "no runc state at {}",
        runc_state.display()
    );
    // SAFETY: kill(2) of the shim's pid, just read.
    unsafe { libc::kill(shims[0], libc::SIGKILL) };
    // containerd sees the shim gone, runs its delete action, and publishes the exit.
    wait_until(Duration::from_secs(30), "containerd to clean up k1", || {
        let gone = !std::path::Path::new(&format!("/proc/{pid}")).exists();
        let status = node.task_status("k1").unwrap_or_else(|_| "gone".into());
        (gone && status != "RUNNING" && !runc_state.exists()).then_some(())
    })
    .with_context(|| {
        format!(
            "k1's process alive: {}, runc state left: {}, task: {:?}",
            std::path::Path::new(&format!("/proc/{pid}")).exists(),
            runc_state.exists(),
            node.task_status("k1")
        )
    })?;
    let bundle = node
        .paths()
        .state
        .join("io.containerd.runtime.v2.task/default/k1");
    let mounts = mounts_mentioning(&bundle.display().to_string());
    ensure!(mounts.is_empty(), "a killed shim left mounts: {mounts:?}");
    // The container can be removed and its id used again.
    let _ = node.ctr(&["task", "rm", "k1"]);
    node.ctr_ok(&["container", "rm", "k1"])?;
    let again = start_counter(&node, "k1", "100")?;
    ensure!(again != pid, "k1 did not start again");
    Ok(())
}
