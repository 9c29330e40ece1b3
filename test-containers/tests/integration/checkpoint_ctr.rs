//! Checkpoint and restore through containerd's task API (ctr and the API itself) with real
//! runc and CRIU: continuity, memory integrity, and nothing lost when something fails.

use std::{path::Path, time::Duration};

use crate::common::*;
use anyhow::{ensure, Context, Result};
use test_containers::stack::{processes_matching, Node};

/// Waits until containerd reports task `id` stopped; `what` names it in the timeout.
fn wait_stopped(node: &Node, id: &str, what: &str) -> Result<()> {
    wait_until(Duration::from_secs(10), what, || {
        (node.task_status(id).ok().as_deref() == Some("STOPPED")).then_some(())
    })
}

/// Kills and deletes a container; its exit must be seen (a restored task's too).
fn remove(node: &Node, id: &str) -> Result<()> {
    // It may have exited already (killed by the test).
    let _ = node.ctr(&["task", "kill", "-s", "SIGKILL", id]);
    wait_stopped(node, id, "the killed task to stop")?;
    node.ctr_ok(&["task", "rm", id])?;
    node.ctr_ok(&["container", "rm", id])?;
    Ok(())
}

/// The values the counter writes from now on, until `n` distinct ones were seen.
fn next_values(pid: i32, n: usize) -> Result<Vec<u64>> {
    let mut seen: Vec<u64> = Vec::new();
    wait_until(
        Duration::from_secs(20),
        "the restored counter to tick",
        || {
            if let Some(v) = counter_value(pid) {
                if seen.last() != Some(&v) {
                    seen.push(v);
                }
            }
            (seen.len() >= n).then_some(())
        },
    )?;
    Ok(seen)
}

#[test]
fn container_checkpoint_and_live_restore_continue_counting() -> Result<()> {
    let node = node("ck-ctr")?;
    let pid = start_counter(&node, "c1", "100")?;
    let before = counter_value(pid).context("counter")?;
    node.ctr_ok(&[
        "container",
        "checkpoint",
        "--task",
        "--rw",
        "c1",
        "localhost/ckpt/c1:1",
    ])?;
    let after = counter_value(pid).context("counter")?;
    // The original keeps running after the checkpoint.
    wait_until(
        Duration::from_secs(5),
        "the original to keep counting",
        || counter_value(pid).filter(|v| *v > after),
    )?;
    remove(&node, "c1")?;

    node.ctr_ok(&[
        "container",
        "restore",
        "--live",
        "--rw",
        "c1",
        "localhost/ckpt/c1:1",
    ])?;
    let restored = node.task_pid("c1")?;
    // containerd extracted the checkpoint (process memory) into its TMPDIR and never removes
    // it; the shim does once it has restored.
    let left: Vec<_> = std::fs::read_dir(&node.paths().tmp)?
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n.to_string_lossy().starts_with("ctrd-checkpoint"))
        .collect();
    ensure!(
        left.is_empty(),
        "extracted checkpoints left in containerd's TMPDIR: {left:?}"
    );
    let seen = next_values(restored, 4)?;
    // It goes on from the checkpoint, not from zero: the file from the rootfs diff and the
    // value in memory agree, so consecutive values step by one.
    ensure!(
        seen[0] >= before && seen[0] <= after + 1,
        "restored counter starts at {} (checkpoint taken between {before} and {after}): {seen:?}",
        seen[0]
    );
    for w in seen.windows(2) {
        ensure!(
            w[1] == w[0] + 1,
            "restored counter skipped or reset: {seen:?}"
        );
    }
    remove(&node, "c1")?;
    Ok(())
}

#[test]
fn task_checkpoint_exit_then_restore() -> Result<()> {
    let node = node("ck-exit")?;
    let pid = start_counter(&node, "c2", "100")?;
    // Checkpointed while running (not paused), it could open a connection any moment: CRIU's
    // network lock stays, and the container runs on.
    let running = node.paths().dir.join("c2-running");
    let _ = std::fs::remove_dir_all(&running);
    rt().block_on(async {
        let api =
            test_containers::containerd::Containerd::connect(node.socket(), "default").await?;
        api.checkpoint_unpaused("c2", &running).await
    })?;
    ensure!(
        inventory_network_lock(&running)? == 0,
        "the dump of a running container skipped CRIU's network lock"
    );
    next_values(pid, 2)?;
    let dir = node.paths().dir.join("c2-image");
    node.checkpoint_task_exit("c2", &dir)?;
    wait_stopped(&node, "c2", "the task to stop")?;
    ensure!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "the counter still runs after --exit"
    );
    let at_exit = std::fs::read_to_string(dir.join("gpu-ckpt-manifest.json"))
        .context("the checkpoint has no manifest")?;
    ensure!(
        at_exit.contains("\"leave_running\": false"),
        "manifest: {at_exit}"
    );
    // Checkpoints hold process memory: root-only.
    use std::os::unix::fs::PermissionsExt;
    for e in std::fs::read_dir(&dir)? {
        let e = e?;
        let mode = e.metadata()?.permissions().mode() & 0o777;
        ensure!(
            mode & 0o077 == 0,
            "{} has mode {mode:o}",
            e.path().display()
        );
    }
    // containerd's client paused the counter for the dump, and its network namespace has only
    // loopback and no TCP socket: CRIU's network lock had nothing to hold and was skipped. CRIU
    // 4.1 has no `skip` (it crashed on it), so there the lock stays.
    let lock = inventory_network_lock(&dir)?;
    if oldest_criu() {
        ensure!(lock != 2, "CRIU 4.1 was asked to skip its network lock");
    } else {
        ensure!(
            lock == 2,
            "the dump of a paused, unconnected container used CRIU's network lock"
        );
    }
    node.ctr_ok(&["task", "rm", "c2"])?;

    // Restored through the API with no stdio: the streams that were pipes at the dump must not
    // become the host's /dev/null, which CRIU cannot dump again (its mount is not the
    // container's), so the restored container can be checkpointed and restored once more.
    let restored = restore_from_dir(&node, "c2", &dir)?;
    let seen = next_values(restored, 3)?;
    ensure!(seen[0] >= 5, "the restored counter started over: {seen:?}");
    for fd in 0..3 {
        let target = std::fs::read_link(format!("/proc/{restored}/fd/{fd}"))?;
        ensure!(
            target.to_string_lossy().starts_with("pipe:"),
            "the restored counter's fd {fd} is {}",
            target.display()
        );
    }
    let again = node.paths().dir.join("c2-again");
    node.checkpoint_task_exit("c2", &again)
        .context("a second checkpoint of the restored counter")?;
    wait_stopped(&node, "c2", "the restored task to stop")?;
    node.ctr_ok(&["task", "rm", "c2"])?;
    let twice = restore_from_dir(&node, "c2", &again)?;
    let later = next_values(twice, 2)?;
    // The second dump may catch the counter before its next tick: then it resumes at the value
    // last seen, which is not going back.
    ensure!(
        later[0] >= *seen.last().unwrap_or(&0),
        "the counter restored twice went back: {later:?} after {seen:?}"
    );

    // containerd logs at debug level here, so the shim logs how long each step took.
    let log = node.log();
    for step in [
        "criu_dump{id=c2}: close time.busy=",
        "restore{id=c2}: close time.busy=",
    ] {
        ensure!(
            log.contains(step),
            "no {step:?} in containerd's log:\n{}",
            node.log_tail(40)
        );
    }
    remove(&node, "c2")?;
    Ok(())
}

#[test]
fn one_gib_of_memory_survives() -> Result<()> {
    let node = node("ck-mem")?;
    let pid = run_memhog(
        &node,
        "m1",
        &["--mib", "1024", "--seed", "42", "--interval-ms", "200"],
    )?;
    memhog_verified(
        pid,
        Duration::from_secs(120),
        "memhog to fill 1 GiB and verify it",
    )?;
    let dir = node.paths().dir.join("m1-image");
    node.checkpoint_task_exit("m1", &dir)?;
    let pages: u64 = std::fs::read_dir(&dir)?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("pages-"))
        .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
        .sum();
    ensure!(
        pages >= 1 << 30,
        "pages images hold {pages} bytes, less than 1 GiB"
    );
    node.ctr_ok(&["task", "rm", "m1"])?;
    let restored = restore_from_dir(&node, "m1", &dir)?;
    // The restored process re-verifies every page: a later pass means all 1 GiB matched.
    let first = rootfs_file(restored, "/status.txt").unwrap_or_default();
    wait_until(
        Duration::from_secs(120),
        "a verification pass after the restore",
        || {
            rootfs_file(restored, "/status.txt")
                .filter(|s| s != &first && s.contains("verified pass"))
        },
    )?;
    ensure!(
        Path::new(&format!("/proc/{restored}")).exists(),
        "memhog died after the restore"
    );
    remove(&node, "m1")?;
    Ok(())
}

fn checkpoint_error(node: &Node, id: &str, dir: &Path) -> String {
    let out = node
        .ctr(&[
            "task",
            "checkpoint",
            "--image-path",
            &dir.display().to_string(),
            id,
        ])
        .expect("run ctr");
    assert!(
        !out.status.success(),
        "the checkpoint of {id} should have failed"
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn assert_no_complete_checkpoint(dir: &Path) -> Result<()> {
    ensure!(
        !dir.join("gpu-ckpt-manifest.json").exists(),
        "a failed checkpoint left a manifest in {}",
        dir.display()
    );
    let left: Vec<_> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    ensure!(left.is_empty(), "a failed checkpoint left files: {left:?}");
    Ok(())
}

#[test]
fn criu_failure_mid_dump_leaves_the_container_running() -> Result<()> {
    let node = node("ck-fail")?;
    // An established TCP connection without tcp-established: CRIU refuses it mid-dump, after
    // it has frozen the tree.
    let pid = run_detached(&node, &["--net-host", workloads(), "t1", "sh", "-c",
            "/bin/echo-server --listen 127.0.0.1:17801 & sleep 0.3; exec /bin/echo-client --connect 127.0.0.1:17801 --interval-ms 100 > /client.log",
        ])?;
    let echoes = || {
        rootfs_file(pid, "/client.log")
            .map(|s| s.lines().filter(|l| l.starts_with("echo ")).count())
    };
    wait_until(Duration::from_secs(10), "echoes", || {
        echoes().filter(|n| *n >= 3)
    })?;
    let dir = node.paths().dir.join("t1-image");
    let err = checkpoint_error(&node, "t1", &dir);
    ensure!(
        err.contains("criu-dump"),
        "the error does not name the step: {err}"
    );
    ensure!(
        err.to_lowercase().contains("tcp") || err.contains("established"),
        "the error does not carry CRIU's cause: {err}"
    );
    assert_no_complete_checkpoint(&dir)?;
    // Unharmed: still running, still echoing on the same connection.
    ensure!(node.task_status("t1")? == "RUNNING");
    let n = echoes().unwrap_or(0);
    wait_until(
        Duration::from_secs(5),
        "echoes after the failed dump",
        || echoes().filter(|m| *m > n + 2),
    )?;
    let log = rootfs_file(pid, "/client.log").unwrap_or_default();
    ensure!(
        !log.contains("reconnect"),
        "the client lost its connection:\n{log}"
    );
    remove(&node, "t1")?;
    Ok(())
}

#[test]
fn full_disk_leaves_the_container_running() -> Result<()> {
    let node = node("ck-full")?;
    let pid = run_memhog(&node, "f1", &["--mib", "64", "--interval-ms", "100"])?;
    memhog_verified(pid, Duration::from_secs(30), "memhog to verify")?;
    let dir = node.paths().dir.join("full");
    std::fs::create_dir_all(&dir)?;
    run_ok(
        std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"])
            .arg(&dir),
    )?;
    let result = (|| -> Result<()> {
        let err = checkpoint_error(&node, "f1", &dir);
        ensure!(
            err.contains("criu-dump"),
            "the error does not name the step: {err}"
        );
        ensure!(
            err.contains("No space left") || err.contains("ENOSPC") || err.contains("space"),
            "the error does not name the full disk: {err}"
        );
        assert_no_complete_checkpoint(&dir)?;
        ensure!(node.task_status("f1")? == "RUNNING");
        let s = rootfs_file(pid, "/status.txt").unwrap_or_default();
        wait_until(Duration::from_secs(10), "memhog to verify again", || {
            rootfs_file(pid, "/status.txt").filter(|t| t != &s && t.contains("verified pass"))
        })?;
        Ok(())
    })();
    let _ = std::process::Command::new("umount").arg(&dir).status();
    result?;
    remove(&node, "f1")?;
    Ok(())
}

#[test]
fn container_exiting_during_the_dump_fails_cleanly() -> Result<()> {
    let node = node("ck-gone")?;
    let pid = run_memhog(&node, "g1", &["--mib", "768"])?;
    memhog_verified(pid, Duration::from_secs(60), "memhog to fill")?;
    let dir = node.paths().dir.join("g1-image");
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(250));
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    });
    let out = node.ctr(&[
        "task",
        "checkpoint",
        "--image-path",
        &dir.display().to_string(),
        "g1",
    ])?;
    killer.join().expect("killer");
    if out.status.success() {
        // The dump won the race: then it must be a complete, verifiable checkpoint.
        image_format::verify_dir(&dir).context("a checkpoint that succeeded must verify")?;
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(
            err.contains("checkpoint failed at step"),
            "unclear error: {err}"
        );
        assert_no_complete_checkpoint(&dir)?;
    }
    remove(&node, "g1")?;
    Ok(())
}

#[test]
fn truncated_or_tampered_checkpoints_are_refused() -> Result<()> {
    let node = node("ck-tamper")?;
    start_counter(&node, "x1", "100")?;
    let dir = node.paths().dir.join("x1-image");
    node.checkpoint_task_exit("x1", &dir)?;
    node.ctr_ok(&["task", "rm", "x1"])?;
    let pages = std::fs::read_dir(&dir)?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("pages-"))
        })
        .context("no pages image")?;
    let original = std::fs::read(&pages)?;
    let cases: [(&str, Vec<u8>); 2] = [
        ("truncated", original[..original.len() / 2].to_vec()),
        ("tampered", {
            let mut v = original.clone();
            v[original.len() / 3] ^= 0x5a;
            v
        }),
    ];
    for (what, bytes) in cases {
        std::fs::write(&pages, &bytes)?;
        let err = restore_from_dir(&node, "x1", &dir)
            .err()
            .with_context(|| format!("a {what} checkpoint was restored"))?;
        let msg = format!("{err:#}");
        ensure!(
            msg.contains("verify"),
            "{what}: the error does not name the verification: {msg}"
        );
        // The tampered file has the right size: CRIU restores it while the shim hashes it,
        // and the shim's gate makes CRIU abort before the tasks run again.
        ensure!(
            what == "truncated"
                || msg.contains("CRIU aborted the restore before the restored tasks ran"),
            "{what}: the restore was not stopped at the gate: {msg}"
        );
        // The shim recorded the page image's BLAKE3 at checkpoint and verifies with it.
        ensure!(
            what == "truncated" || msg.contains("blake3 mismatch"),
            "{what}: not refused on its BLAKE3: {msg}"
        );
        ensure!(
            msg.contains(
                &pages
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .to_string()
            ),
            "{what}: the error does not name the file: {msg}"
        );
        // Nothing started.
        let ps = processes_matching(&["/bin/counter"]);
        let ours: Vec<_> = ps
            .iter()
            .filter(|p| {
                std::fs::read_link(format!("/proc/{p}/root"))
                    .is_ok_and(|r| r.display().to_string().contains("x1"))
            })
            .collect();
        ensure!(ours.is_empty(), "{what}: a counter runs: {ours:?}");
        let _ = node.ctr(&["task", "rm", "x1"]);
    }
    Ok(())
}
