//! The shim under `ctr` against a real containerd 2.x and runc: run, stdout, exec, kill, pause,
//! resume, metrics, update, ps, delete, terminals.

use std::time::Duration;

use crate::common::*;
use anyhow::{ensure, Context, Result};
use test_containers::{
    containerd::Containerd,
    stack::{processes_matching, Node},
};

#[test]
fn stdout_reaches_ctr_and_exit_status_comes_back() -> Result<()> {
    let node = node("ctr-stdout")?;
    let out = ctr_run(
        &node,
        &[
            "--rm",
            workloads(),
            "echo1",
            "sh",
            "-c",
            "echo hello-from-gpu-ckpt; exit 7",
        ],
    )?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        stdout.contains("hello-from-gpu-ckpt"),
        "stdout did not reach ctr: {stdout:?} / {}",
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        out.status.code() == Some(7),
        "ctr run exit status {:?}",
        out.status
    );
    // The shim served the container, and its own logs (tracing) reached containerd's log.
    ensure!(
        node.log_contains(RUNTIME),
        "containerd log does not mention {RUNTIME}"
    );
    ensure!(
        node.log_contains("task service starting"),
        "the shim's log lines are not in containerd's log"
    );
    Ok(())
}

#[test]
fn lifecycle_exec_pause_metrics_update_kill_delete() -> Result<()> {
    let node = node("ctr-life")?;
    let log = node.paths().dir.join("counter.log");
    let log_uri = format!("file://{}", log.display());
    let pid = run_detached(
        &node,
        &[
            "--log-uri",
            &log_uri,
            workloads(),
            "c1",
            "/bin/counter",
            "--interval-ms",
            "100",
        ],
    )?;
    wait_until(Duration::from_secs(10), "counter ticks in its log", || {
        std::fs::read_to_string(&log)
            .ok()
            .filter(|s| s.contains("tick 3"))
    })?;

    // exec: the exit status of a second process comes back.
    let out = node.ctr(&[
        "task",
        "exec",
        "--exec-id",
        "e1",
        "c1",
        "sh",
        "-c",
        "echo from-exec; exit 3",
    ])?;
    ensure!(
        out.status.code() == Some(3),
        "exec exit status {:?}",
        out.status
    );
    ensure!(String::from_utf8_lossy(&out.stdout).contains("from-exec"));

    // ps lists init and a running exec.
    node.ctr_ok(&[
        "task",
        "exec",
        "--detach",
        "--exec-id",
        "sleeper",
        "c1",
        "sleep",
        "1000",
    ])?;
    let sleeper = wait_until(Duration::from_secs(5), "the sleeper exec", || {
        processes_matching(&["sleep", "1000"])
            .into_iter()
            .find(|p| {
                std::fs::read_link(format!("/proc/{p}/root")).ok()
                    == std::fs::read_link(format!("/proc/{pid}/root")).ok()
            })
    })?;
    let ps = node.ctr_ok(&["task", "ps", "c1"])?;
    ensure!(ps.contains(&pid.to_string()), "ps lacks init {pid}:\n{ps}");
    ensure!(
        ps.contains(&sleeper.to_string()),
        "ps lacks exec {sleeper}:\n{ps}"
    );
    ensure!(ps.contains("sleeper"), "ps does not name the exec:\n{ps}");
    node.ctr_ok(&[
        "task",
        "kill",
        "--exec-id",
        "sleeper",
        "-s",
        "SIGKILL",
        "c1",
    ])?;

    // pause stops the counter, resume restarts it.
    node.ctr_ok(&["task", "pause", "c1"])?;
    ensure!(node.task_status("c1")? == "PAUSED");
    let frozen = counter_value(pid).context("counter file")?;
    std::thread::sleep(Duration::from_millis(600));
    ensure!(
        counter_value(pid) == Some(frozen),
        "counter moved while paused"
    );
    node.ctr_ok(&["task", "resume", "c1"])?;
    ensure!(node.task_status("c1")? == "RUNNING");
    wait_until(
        Duration::from_secs(5),
        "counter to move after resume",
        || counter_value(pid).filter(|v| *v > frozen),
    )?;

    // metrics report memory and CPU.
    let metrics = node.ctr_ok(&["task", "metrics", "c1"])?;
    ensure!(
        metrics.contains("memory.usage_in_bytes") || metrics.contains("memory.usage"),
        "no memory in metrics:\n{metrics}"
    );
    ensure!(metrics.contains("cpu"), "no cpu in metrics:\n{metrics}");

    // update of the memory limit through the containerd API takes effect in the cgroup.
    let cgroup = memory_cgroup_dir(pid)?;
    let limit = 96 * 1024 * 1024;
    rt().block_on(async {
        let api = Containerd::connect(node.socket(), "default").await?;
        api.update_memory_limit("c1", limit).await
    })?;
    let file = if cgroup.join("memory.limit_in_bytes").exists() {
        cgroup.join("memory.limit_in_bytes")
    } else {
        cgroup.join("memory.max")
    };
    ensure!(
        read_u64(&file)? == limit as u64,
        "{} is not {limit}",
        file.display()
    );

    // SIGTERM: the counter dies by the signal, 128 + 15, seen through the API's Wait.
    let status = rt().block_on(async {
        let api = Containerd::connect(node.socket(), "default").await?;
        let waiter = {
            let api = api.clone();
            tokio::spawn(async move { api.wait("c1").await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        let out = node.ctr(&["task", "kill", "-s", "SIGTERM", "c1"])?;
        ensure!(
            out.status.success(),
            "kill: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        waiter.await?
    })?;
    ensure!(
        status.code == 143,
        "exit status after SIGTERM: {}",
        status.code
    );
    ensure!(node.task_status("c1")? == "STOPPED");
    let rm = node.ctr(&["task", "rm", "c1"])?;
    let rm_text = format!(
        "{}{}",
        String::from_utf8_lossy(&rm.stdout),
        String::from_utf8_lossy(&rm.stderr)
    );
    ensure!(
        rm_text.contains("143") || rm.status.code() == Some(143),
        "ctr task rm did not report 143: {rm_text} {:?}",
        rm.status
    );
    node.ctr_ok(&["container", "rm", "c1"])?;
    assert_nothing_left(&node, "c1", pid)?;
    Ok(())
}

#[test]
fn sigkill_gives_137() -> Result<()> {
    let node = node("ctr-kill")?;
    let pid = run_detached(&node, &[workloads(), "k1", "/bin/counter"])?;
    node.ctr_ok(&["task", "kill", "-s", "SIGKILL", "k1"])?;
    let status = rt().block_on(async {
        let api = Containerd::connect(node.socket(), "default").await?;
        api.wait_timeout("k1", Duration::from_secs(10)).await
    })?;
    ensure!(
        status.code == 137,
        "exit status after SIGKILL: {}",
        status.code
    );
    node.ctr(&["task", "rm", "k1"])?;
    node.ctr_ok(&["container", "rm", "k1"])?;
    assert_nothing_left(&node, "k1", pid)?;

    // `ctr run` itself reports the status of a container killed while it is attached.
    let killer = {
        let socket = node.socket().to_path_buf();
        let ctr = node.stack().ctr_bin();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(800));
            std::process::Command::new(ctr)
                .arg("--address")
                .arg(socket)
                .args(["task", "kill", "-s", "SIGKILL", "k2"])
                .output()
        })
    };
    let out = ctr_run(&node, &["--rm", workloads(), "k2", "/bin/counter"])?;
    killer.join().expect("killer thread")?;
    ensure!(
        out.status.code() == Some(137),
        "ctr run reported {:?}",
        out.status
    );
    Ok(())
}

/// After delete: no mount, cgroup, fifo, process or shim of the container is left.
fn assert_nothing_left(node: &Node, id: &str, pid: i32) -> Result<()> {
    wait_until(
        Duration::from_secs(10),
        "the init process to be gone",
        || (!std::path::Path::new(&format!("/proc/{pid}")).exists()).then_some(()),
    )?;
    let mounts = mounts_mentioning(&format!("/{id}/rootfs"));
    ensure!(mounts.is_empty(), "mounts left: {mounts:?}");
    let fifos = files_named(&node.paths().fifo_dir, id);
    ensure!(fifos.is_empty(), "fifos left: {fifos:?}");
    for controller in ["memory", "cpu", "pids"] {
        let dir = std::path::Path::new("/sys/fs/cgroup")
            .join(controller)
            .join("default")
            .join(id);
        ensure!(!dir.exists(), "cgroup left: {}", dir.display());
    }
    wait_until(Duration::from_secs(10), "the shim to exit", || {
        shims_of(node).is_empty().then_some(())
    })?;
    Ok(())
}

#[test]
fn terminal_and_resize() -> Result<()> {
    use std::{io::Read, os::fd::AsRawFd};

    use nix::pty::{openpty, Winsize};
    let node = node("ctr-tty")?;
    let ws = Winsize {
        ws_row: 37,
        ws_col: 91,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    let pty = openpty(Some(&ws), None)?;
    let flags = run_flags(&node);
    // ctr sends its terminal's size (ResizePty) right after the task starts; the container
    // reads it a moment later.
    let mut cmd = std::process::Command::new(node.stack().ctr_bin());
    cmd.arg("--address")
        .arg(node.socket())
        .arg("run")
        .args(&flags)
        .args([
            "-t",
            "--rm",
            workloads(),
            "tty1",
            "sh",
            "-c",
            "sleep 1; stty size; tty; exit 5",
        ])
        .env("PATH", node.stack().path_env())
        .stdin(std::process::Stdio::from(pty.slave.try_clone()?))
        .stdout(std::process::Stdio::from(pty.slave.try_clone()?))
        .stderr(std::process::Stdio::from(pty.slave.try_clone()?));
    let slave_fd = pty.slave.as_raw_fd();
    // SAFETY: setsid and ioctl are async-signal-safe; the slave fd stays open in the child.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(move || {
            nix::unistd::setsid().map_err(std::io::Error::from)?;
            if libc::ioctl(slave_fd, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("spawn ctr run -t")?;
    // Only ctr may hold the terminal's slave side, or reading the master never ends.
    drop(cmd);
    drop(pty.slave);
    let mut master = std::fs::File::from(pty.master);
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = master.read(&mut buf) {
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        out
    });
    let status = wait_until(Duration::from_secs(30), "ctr run -t to finish", || {
        child.try_wait().ok().flatten()
    })?;
    let out = String::from_utf8_lossy(&reader.join().expect("reader")).into_owned();
    ensure!(
        out.contains("37 91"),
        "the terminal was not resized to 37x91: {out:?}"
    );
    ensure!(
        out.contains("/dev/pts/"),
        "the container has no terminal: {out:?}"
    );
    ensure!(
        status.code() == Some(5),
        "ctr run -t exit status {status:?}: {out:?}"
    );
    Ok(())
}
