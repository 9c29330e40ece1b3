//! Nothing in a restore waits forever: with the handler's `RestoreTimeout` far below what a
//! restore of 512 MiB takes, the restore fails within the bound (plus the watchdog's grace),
//! naming the step and the bound, and no runc, CRIU, action script or restored process is left.

mod common;

use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use common::*;
use test_containers::stack::{processes_matching, Node, Stack};

#[test]
fn a_restore_past_its_bound_fails_and_leaves_nothing_running() -> Result<()> {
    let dir = Stack::discover()?.node_dir("restore-bound");
    std::fs::create_dir_all(&dir)?;
    let options = dir.join("gpu-ckpt-handler.toml");
    std::fs::write(&options, "RestoreTimeout = \"200ms\"\n")?;
    let node = node_with(
        Node::builder("restore-bound")?
            .env("GPU_CKPT_HANDLER_CONFIG", &options.display().to_string()),
    )?;
    let pid = run_detached(
        &node,
        &[
            workloads(),
            "b1",
            "/bin/memhog",
            "--mib",
            "512",
            "--interval-ms",
            "200",
            "--status-file",
            "/status.txt",
        ],
    )?;
    wait_until(Duration::from_secs(60), "memhog to fill 512 MiB", || {
        rootfs_file(pid, "/status.txt").filter(|s| s.contains("verified pass"))
    })?;
    let image = node.paths().dir.join("b1-image");
    node.checkpoint_task_exit("b1", &image)?;
    node.ctr_ok(&["task", "rm", "b1"])?;

    let t = Instant::now();
    let err = match restore_from_dir(&node, "b1", &image) {
        Ok(pid) => anyhow::bail!("a 512 MiB restore finished within 200 ms (pid {pid})"),
        Err(e) => format!("{e:#}"),
    };
    let took = t.elapsed();
    println!("after {took:?}: {err}");
    ensure!(
        err.contains("step criu-restore") && err.contains("not done within 200ms"),
        "the error does not name the step and the bound: {err}"
    );
    ensure!(
        took < Duration::from_secs(15),
        "the restore failed only after {took:?}"
    );
    let bundle = "io.containerd.runtime.v2.task/default/b1";
    let left: Vec<i32> = processes_matching(&[bundle])
        .into_iter()
        .chain(processes_matching(&[
            "criu",
            "restore",
            image.to_str().unwrap_or("?"),
        ]))
        .chain(
            processes_matching(&["/bin/memhog"])
                .into_iter()
                .filter(|p| {
                    std::fs::read_to_string(format!("/proc/{p}/cgroup"))
                        .is_ok_and(|c| c.contains("/default/b1"))
                }),
        )
        .collect();
    ensure!(
        left.is_empty(),
        "a restore past its bound left processes: {:?}",
        left.iter()
            .map(|p| std::fs::read_to_string(format!("/proc/{p}/cmdline"))
                .unwrap_or_default()
                .replace('\0', " "))
            .collect::<Vec<_>>()
    );
    ensure!(
        node.task_status("b1").is_err() || node.task_status("b1")? != "RUNNING",
        "the task runs after a refused restore"
    );
    Ok(())
}
