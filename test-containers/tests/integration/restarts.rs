//! containerd restarts under running gpu-ckpt containers, and a shim killed outright: the
//! containers run on across a restart (one of them restarted in the middle of a checkpoint),
//! containerd reconnects to their shim, the shim's events reach the new containerd, and the next
//! checkpoint and restore work; an interrupted checkpoint leaves nothing a restore accepts; a
//! killed shim is cleaned up by containerd through the shim's delete action, leaving no runc
//! state or mount behind.

use std::time::Duration;

use crate::common::*;
use anyhow::{ensure, Context, Result};

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

/// The pass number of a memhog status line (`verified pass <k> …`).
fn memhog_pass(status: &str) -> Option<u64> {
    status
        .trim()
        .strip_prefix("verified pass ")?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The freezer state of process `pid`'s cgroup (v1 `freezer.state`, v2 `cgroup.freeze`) and
/// its scheduler state, for a failure's message.
fn frozen_state(pid: i32) -> String {
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let freezer = cgroups.lines().find_map(|l| {
        let parts: Vec<&str> = l.splitn(3, ':').collect();
        match parts.as_slice() {
            [_, c, p] if c.split(',').any(|c| c == "freezer") => {
                std::fs::read_to_string(format!("/sys/fs/cgroup/freezer{p}/freezer.state")).ok()
            }
            ["0", "", p] => std::fs::read_to_string(format!("/sys/fs/cgroup{p}/cgroup.freeze"))
                .ok()
                .map(|v| format!("cgroup.freeze {v}")),
            _ => None,
        }
    });
    let state = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("State:"))
        .unwrap_or_default()
        .to_string();
    format!(
        "freezer {}, {state}",
        freezer.as_deref().map(str::trim).unwrap_or("unknown")
    )
}

/// Waits until memhog `pid` reports a verified pass after `after`; returns it.
fn memhog_verifies_after(pid: i32, after: u64, timeout: Duration) -> Result<u64> {
    let mut last = String::new();
    wait_until(timeout, "memhog to verify its memory again", || {
        let s = rootfs_file(pid, "/status.txt")?;
        last.clone_from(&s);
        memhog_pass(&s).filter(|p| *p > after)
    })
    .with_context(|| format!("memhog's last status: {last:?}"))
}

/// containerd restarted while CRIU dumps a container (`ctr task checkpoint --image-path`,
/// leave-running) of a few hundred MiB: the checkpoint fails for its caller, the container runs
/// on unfrozen under the same shim, the interrupted image directory holds nothing a restore
/// accepts, and the next checkpoint and its restore work through the reconnected shim.
#[test]
fn a_containerd_restart_mid_checkpoint_leaves_the_container_running() -> Result<()> {
    let mut node = node("restart-mid-ckpt")?;
    let pid = run_memhog(&node, "m1", &["--mib", "512", "--interval-ms", "200"])?;
    let pass = memhog_verifies_after(pid, 0, Duration::from_secs(180))?;
    let shims = shims_of(&node);
    ensure!(shims.len() == 1, "shims of m1: {shims:?}");

    let dir = node.paths().dir.join("m1-interrupted");
    let _ = std::fs::remove_dir_all(&dir);
    let ctr = ctr_checkpoint_in_background(&node, "m1", &dir)?;
    let criu = criu_dumping_pages(pid, &dir, Duration::from_secs(60))?;
    // CRIU is held stopped across the restart, so that containerd goes away in the middle of
    // the dump however fast the dump would be.
    let criu_pid = nix::unistd::Pid::from_raw(criu);
    nix::sys::signal::kill(criu_pid, nix::sys::signal::Signal::SIGSTOP)?;
    let restarted = node.restart_containerd();
    let dumping = std::path::Path::new(&format!("/proc/{criu}")).exists();
    nix::sys::signal::kill(criu_pid, nix::sys::signal::Signal::SIGCONT)?;
    restarted?;
    ensure!(dumping, "CRIU was gone before containerd restarted");
    let out = ctr
        .join()
        .map_err(|_| anyhow::anyhow!("the ctr thread panicked"))??;
    println!(
        "ctr task checkpoint across the restart ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    ensure!(
        !out.status.success(),
        "the checkpoint finished before containerd went down: nothing was interrupted"
    );

    // The shim's side of the interrupted checkpoint ends (CRIU and runc are gone).
    wait_until(
        Duration::from_secs(120),
        "the interrupted dump to end",
        || {
            let criu =
                test_containers::stack::processes_matching(&["criu: dump", &format!("-t {pid}")]);
            let runc = test_containers::stack::processes_matching(&["runc", "checkpoint", "m1"]);
            (criu.is_empty() && runc.is_empty()).then_some(())
        },
    )?;
    // The container runs on, unfrozen, under the same shim, and containerd knows it again
    // (its state is read under the container's lock, which the checkpoint holds to its end) …
    let status = wait_until(Duration::from_secs(30), "m1 to run again", || {
        node.task_status("m1").ok().filter(|s| s == "RUNNING")
    })
    .with_context(|| {
        format!(
            "m1 is {:?} after containerd restarted during its checkpoint",
            node.task_status("m1")
        )
    })?;
    // … and the checkpoint leaves nothing that looks complete: no manifest anywhere below
    // the directory.
    let manifests = files_named(&dir, image_format::manifest::MANIFEST_FILE);
    ensure!(
        manifests.is_empty() && !dir.join(image_format::manifest::MANIFEST_FILE).exists(),
        "the interrupted checkpoint left a manifest: {manifests:?}"
    );

    println!("m1 after the interrupted checkpoint: {status}");
    for line in node.log().lines().filter(|l| l.contains("abandoned")) {
        println!("shim: {line}");
    }
    let pass = memhog_verifies_after(pid, pass, Duration::from_secs(60)).with_context(|| {
        format!(
            "m1 is stuck after the interrupted checkpoint: {}; shim log:\n{}",
            frozen_state(pid),
            node.log_tail(40)
        )
    })?;
    ensure!(
        node.task_pid("m1")? == pid,
        "containerd reports another pid for m1"
    );
    ensure!(
        shims_of(&node) == shims,
        "the shim changed across the restart: {shims:?} then {:?}",
        shims_of(&node)
    );

    // The next checkpoint and restore work through the reconnected shim; the interrupted
    // directory is refused by the restore.
    let good = node.paths().dir.join("m1-after");
    node.checkpoint_task_exit("m1", &good)?;
    node.ctr_ok(&["task", "rm", "m1"])?;
    let refused = restore_from_dir(&node, "m1", &dir);
    ensure!(
        refused.is_err(),
        "a restore accepted the interrupted checkpoint"
    );
    println!(
        "restore from the interrupted checkpoint: {:#}",
        refused.err().map(|e| format!("{e:#}")).unwrap_or_default()
    );
    let _ = node.ctr(&["task", "rm", "-f", "m1"]);
    let restored = restore_from_dir(&node, "m1", &good)?;
    let again = memhog_verifies_after(restored, pass, Duration::from_secs(60))?;
    println!("memhog restored: pass {again} after pass {pass} before the checkpoint");
    let status = rootfs_file(restored, "/status.txt").unwrap_or_default();
    ensure!(
        !status.contains("CORRUPT"),
        "the restored memhog found corrupt pages: {status}"
    );
    Ok(())
}

/// The shim's events reach the containerd that started after a restart: a container that
/// exits after the restart shows up as `/tasks/exit` in containerd's event stream (CRI learns
/// of exits this way only).
#[test]
fn events_reach_containerd_after_a_restart() -> Result<()> {
    let mut node = node("restart-events")?;
    let pid = start_counter(&node, "e1", "100")?;
    node.restart_containerd()?;
    counter_goes_on(pid, counter_value(pid).unwrap_or(0))?;
    let mut events = std::process::Command::new(node.stack().ctr_bin())
        .arg("--address")
        .arg(node.socket())
        .args(["events"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("ctr events")?;
    let stdout = events.stdout.take().context("ctr events' stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    // ctr events subscribes before it prints anything; give it a moment.
    std::thread::sleep(Duration::from_secs(1));
    // SAFETY: kill(2) of the counter's pid, just read.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    let found = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains("/tasks/exit") && line.contains("e1") => break true,
            Ok(line) => seen.push(line),
            Err(_) => break false,
        }
    };
    let _ = events.kill();
    let _ = events.wait();
    ensure!(
        found,
        "no /tasks/exit for e1 reached the restarted containerd within 30 s; events seen: {seen:?}"
    );
    Ok(())
}
