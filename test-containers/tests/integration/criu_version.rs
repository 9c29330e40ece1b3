//! The CRIU the shim drives is checked once per shim process: one older than the minimum fails a
//! checkpoint at once, with one line naming the CRIU found and the minimum, and the container
//! runs on untouched.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use crate::common::*;
use anyhow::{ensure, Result};
use test_containers::stack::{Node, Stack};

#[test]
fn a_criu_older_than_the_minimum_is_named_at_once() -> Result<()> {
    // A `criu` ahead of the stack's in the node's PATH that says it is 3.17.1 (Debian
    // bookworm's release) and would fail anything else.
    let fake = tempfile::tempdir()?;
    let criu = fake.path().join("criu");
    std::fs::write(
        &criu,
        "#!/bin/sh\n[ \"$1\" = --version ] && { echo 'Version: 3.17.1'; exit 0; }\necho \"fake criu: $*\" >&2\nexit 1\n",
    )?;
    std::fs::set_permissions(&criu, std::fs::Permissions::from_mode(0o755))?;
    let path = format!(
        "{}:{}",
        fake.path().display(),
        Stack::discover()?.path_env()
    );
    let node = node_with(Node::builder("criu-old")?.env("PATH", &path))?;
    let pid = start_counter(&node, "old", "100")?;
    let dir = node.paths().dir.join("old-ckpt");
    let out = node.ctr(&[
        "task",
        "checkpoint",
        "--image-path",
        &dir.display().to_string(),
        "old",
    ])?;
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    println!("{err}");
    ensure!(
        !out.status.success(),
        "the checkpoint with CRIU 3.17.1 succeeded"
    );
    ensure!(
        err.contains("CRIU 3.17.1 is older than the oldest gpu-ckpt supports, 4.1.0"),
        "the error does not name the CRIU found and the minimum: {err}"
    );
    ensure!(
        !err.contains("fake criu"),
        "runc ran the old CRIU before the check: {err}"
    );
    ensure!(
        !dir.join(image_format::manifest::MANIFEST_FILE).exists(),
        "a failed checkpoint left a manifest"
    );
    let now = counter_value(pid).unwrap_or(0);
    wait_until(Duration::from_secs(5), "the counter to go on", || {
        counter_value(pid).filter(|v| *v > now)
    })?;
    ensure!(
        node.task_status("old")? == "RUNNING",
        "the container is {} after the refused checkpoint",
        node.task_status("old")?
    );
    Ok(())
}

/// CRIU killed in the middle of a dump: the error says CRIU died (not runc's bare `read
/// unixpacket …: EOF`) with its signal and its log's path, nothing looks complete, and the
/// container runs on.
#[test]
fn a_criu_killed_mid_dump_is_named() -> Result<()> {
    let node = node("criu-killed")?;
    let pid = run_memhog(&node, "k1", &["--mib", "1024", "--interval-ms", "200"])?;
    memhog_verified(pid, Duration::from_secs(120), "memhog to fill 1 GiB")?;
    let dir = node.paths().dir.join("k1-image");
    let _ = std::fs::remove_dir_all(&dir);
    let ctr = ctr_checkpoint_in_background(&node, "k1", &dir)?;
    let criu = criu_dumping_pages(pid, &dir, Duration::from_secs(30))?;
    // SAFETY: kill(2) of the pid just found.
    unsafe { libc::kill(criu, libc::SIGKILL) };
    let out = ctr
        .join()
        .map_err(|_| anyhow::anyhow!("the ctr thread panicked"))??;
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    println!("{err}");
    ensure!(
        !out.status.success(),
        "the checkpoint succeeded although CRIU was killed"
    );
    ensure!(
        err.contains(&format!(
            "CRIU died before it answered runc: CRIU (pid {criu}) was killed by signal 9 (SIGKILL)"
        )) && err.contains("criu-dump.log"),
        "the error does not say that CRIU died, with its signal and log: {err}"
    );
    ensure!(
        !dir.join(image_format::manifest::MANIFEST_FILE).exists(),
        "a checkpoint whose CRIU was killed has a manifest"
    );
    let before = rootfs_file(pid, "/status.txt").unwrap_or_default();
    let now = wait_until(Duration::from_secs(20), "memhog to verify again", || {
        rootfs_file(pid, "/status.txt").filter(|s| s.contains("verified pass") && *s != before)
    })?;
    ensure!(
        node.task_status("k1")? == "RUNNING",
        "the container is {} after the failed checkpoint ({now})",
        node.task_status("k1")?
    );
    Ok(())
}
