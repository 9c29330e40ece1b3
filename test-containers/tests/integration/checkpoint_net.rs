//! Network state across checkpoint and restore: an established TCP connection survives a
//! restore on the same address (tcp-established); restored into a pod with a new address
//! (tcp-close), the client sees its connection closed and reconnects.

use std::time::Duration;

use crate::common::*;
use anyhow::{ensure, Context, Result};
use test_containers::{
    cri::{ContainerSpec, Cri, Network, Pod, PodSpec},
    stack::{Node, GPU_CKPT_HANDLER},
};

fn echoes(log: &str) -> usize {
    log.lines().filter(|l| l.starts_with("echo ")).count()
}

/// CRIU before 4.2 cannot dump a TCP socket on Linux 6.16 and later (the kernel refuses the
/// socket options it reads; criu #2705): with the oldest CRIU there, a checkpoint with a
/// connection must fail saying so.
fn criu_cannot_dump_tcp() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release
        .trim()
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    oldest_criu() && (major, minor) >= (6, 16)
}

/// The checkpoint of CRIU 4.1 on a kernel from 6.16 on: `checkpoint` must have failed with one
/// line that names the CRIU, the kernel and the fix.
fn names_the_old_criu<T>(checkpoint: Result<T>) -> Result<()> {
    let err = match checkpoint {
        Ok(_) => anyhow::bail!("CRIU 4.1 dumped a TCP connection on Linux 6.16 or later"),
        Err(e) => format!("{e:#}"),
    };
    ensure!(
        err.contains("CRIU 4.1.1 cannot dump TCP and other inet sockets on Linux 6.")
            && err.contains("install CRIU 4.2.0 or newer"),
        "the error does not say that CRIU 4.1.1 cannot dump TCP sockets here: {err}"
    );
    println!("{err}");
    Ok(())
}

#[test]
fn established_connection_survives_restore_on_the_same_address() -> Result<()> {
    let node = node("net-same")?;
    let port = "17901";
    run_detached(
        &node,
        &[
            "--net-host",
            workloads(),
            "srv",
            "/bin/echo-server",
            "--listen",
            &format!("127.0.0.1:{port}"),
        ],
    )?;
    std::thread::sleep(Duration::from_millis(300));
    let pid = run_detached(
        &node,
        &[
            "--net-host",
            "--annotation",
            "gpu-ckpt.io/tcp=established",
            workloads(),
            "cli",
            "sh",
            "-c",
            &format!(
                "exec /bin/echo-client --connect 127.0.0.1:{port} --interval-ms 100 > /client.log"
            ),
        ],
    )?;
    wait_until(Duration::from_secs(10), "echoes", || {
        rootfs_file(pid, "/client.log").filter(|s| echoes(s) >= 5)
    })?;
    let dir = node.paths().dir.join("cli-image");
    if criu_cannot_dump_tcp() {
        names_the_old_criu(node.checkpoint_task_exit("cli", &dir))?;
        // Nothing lost: the client runs on, and no checkpoint looks complete.
        let now = echoes(&rootfs_file(pid, "/client.log").unwrap_or_default());
        wait_until(
            Duration::from_secs(10),
            "echoes after the failed checkpoint",
            || rootfs_file(pid, "/client.log").filter(|s| echoes(s) >= now + 3),
        )?;
        ensure!(
            !dir.join("gpu-ckpt-manifest.json").exists(),
            "a failed checkpoint left a manifest"
        );
        let _ = node.ctr(&["task", "kill", "-s", "SIGKILL", "cli"]);
        let _ = node.ctr(&["task", "kill", "-s", "SIGKILL", "srv"]);
        return Ok(());
    }
    node.checkpoint_task_exit("cli", &dir)?;
    let manifest = std::fs::read_to_string(dir.join("gpu-ckpt-manifest.json"))?;
    ensure!(
        manifest.contains("\"tcp\": \"established\""),
        "manifest: {manifest}"
    );
    node.ctr_ok(&["task", "rm", "cli"])?;
    let restored = restore_from_dir(&node, "cli", &dir)?;
    let before = echoes(&rootfs_file(restored, "/client.log").unwrap_or_default());
    let log = wait_until(Duration::from_secs(15), "echoes after the restore", || {
        rootfs_file(restored, "/client.log").filter(|s| echoes(s) >= before + 5)
    })?;
    ensure!(
        !log.contains("reconnect"),
        "the connection did not survive:\n{log}"
    );
    let _ = node.ctr(&["task", "kill", "-s", "SIGKILL", "cli"]);
    let _ = node.ctr(&["task", "kill", "-s", "SIGKILL", "srv"]);
    Ok(())
}

#[test]
fn new_address_with_tcp_close_reconnects() -> Result<()> {
    let node = restore_node("net-new")?;
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let (server_pod, ip) = echo_server(&cri, &node, "server", 7777).await?;
        let client = |handler: &str| {
            PodSpec::new("client", node.pod_log_root())
                .handler(handler)
                .network(Network::Pod)
                .annotation("gpu-ckpt.io/tcp", "close")
        };
        let client_spec = echo_client(&ip, 7777);
        let log_of = |id: String| {
            let cri = cri.clone();
            async move { client_log(&cri, &id).await }
        };
        let pod_a = cri.run_pod(&client(GPU_CKPT_HANDLER)).await?;
        let c_a = cri.run_container(&pod_a, &client_spec).await?;
        wait_for_echoes(&cri, &c_a).await?;
        let archive = node.paths().dir.join("client.tar");
        let _ = std::fs::remove_file(&archive);
        if criu_cannot_dump_tcp() {
            names_the_old_criu(cri.checkpoint_container(&c_a, &archive, 60).await)?;
            let now = echoes(&log_of(c_a.clone()).await);
            for _ in 0..100 {
                if echoes(&log_of(c_a.clone()).await) >= now + 3 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            ensure!(
                echoes(&log_of(c_a.clone()).await) >= now + 3,
                "the client stopped after the failed checkpoint"
            );
            ensure!(!archive.exists(), "a failed checkpoint left an archive");
            cri.remove_pod(&pod_a).await?;
            cri.remove_pod(&server_pod).await?;
            return Ok(());
        }
        cri.checkpoint_container(&c_a, &archive, 60).await?;
        cri.remove_pod(&pod_a).await?;

        // Restored into a new pod: a new address.
        let pod_b = cri
            .run_pod(
                &client("gpu-ckpt-restore")
                    .annotation("gpu-ckpt.io/restore-from", &archive.display().to_string()),
            )
            .await?;
        let c_b = cri.run_container(&pod_b, &client_spec).await?;
        let mut log = String::new();
        for _ in 0..150 {
            log = log_of(c_b.clone()).await;
            if let Some(after) = log.split("reconnect").nth(1) {
                if echoes(after) >= 3 {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let after = log.split("reconnect").nth(1).context(format!(
            "the client never saw its connection closed:\n{log}"
        ))?;
        ensure!(after.contains("connected"), "no reconnect:\n{log}");
        ensure!(echoes(after) >= 3, "no echoes after reconnecting:\n{log}");
        cri.remove_pod(&pod_b).await?;
        cri.remove_pod(&server_pod).await?;
        Ok(())
    })
}

/// A pod `name` on `node` (handler gpu-ckpt, its own network) running the echo server on
/// `port`, and the pod's IP.
async fn echo_server(cri: &Cri, node: &Node, name: &str, port: u16) -> Result<(Pod, String)> {
    let pod = cri
        .run_pod(
            &PodSpec::new(name, node.pod_log_root())
                .handler(GPU_CKPT_HANDLER)
                .network(Network::Pod),
        )
        .await?;
    cri.run_container(
        &pod,
        &ContainerSpec::new("server", workloads()).command(&[
            "/bin/echo-server",
            "--listen",
            &format!("0.0.0.0:{port}"),
        ]),
    )
    .await?;
    let ip = pod_ip(cri, &pod.id).await?;
    Ok((pod, ip))
}

/// The echo client of `ip:port`, logging what it sees to /client.log.
fn echo_client(ip: &str, port: u16) -> ContainerSpec {
    ContainerSpec::new("client", workloads()).command(&[
        "sh",
        "-c",
        &format!("exec /bin/echo-client --connect {ip}:{port} --interval-ms 100 > /client.log"),
    ])
}

/// The echo client's log in container `id` (empty while it cannot be read).
async fn client_log(cri: &Cri, id: &str) -> String {
    cri.exec_sync(id, &["cat", "/client.log"], 10)
        .await
        .map(|r| r.stdout_str())
        .unwrap_or_default()
}

/// Waits up to 10 s for 5 echoes in the client `id`'s log.
async fn wait_for_echoes(cri: &Cri, id: &str) -> Result<()> {
    for _ in 0..100 {
        if echoes(&client_log(cri, id).await) >= 5 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("no echoes before the checkpoint")
}

/// The IP CRI reports for pod `id`.
async fn pod_ip(cri: &Cri, id: &str) -> Result<String> {
    cri.pod_sandbox_status(id)
        .await?
        .status
        .and_then(|s| s.network)
        .map(|n| n.ip)
        .filter(|ip| !ip.is_empty())
        .with_context(|| format!("pod {id} has no IP"))
}

/// An established connection (`gpu-ckpt.io/tcp: established`) is bound to the pod's IP: its
/// checkpoint records the IP (signed), and a restore into a pod with another IP is refused
/// naming both; the same checkpoint restored with `gpu-ckpt.io/tcp: close` runs and
/// reconnects.
#[test]
fn established_connections_restore_only_on_the_recorded_ip() -> Result<()> {
    let node = restore_node("net-addr")?;
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let (server_pod, server_ip) = echo_server(&cri, &node, "addr-server", 7778).await?;
        let client = |handler: &str, tcp: &str| {
            PodSpec::new("addr-client", node.pod_log_root())
                .handler(handler)
                .network(Network::Pod)
                .annotation("gpu-ckpt.io/tcp", tcp)
        };
        let client_spec = echo_client(&server_ip, 7778);
        let log_of = |id: String| {
            let cri = cri.clone();
            async move { client_log(&cri, &id).await }
        };
        let pod_a = cri
            .run_pod(&client(GPU_CKPT_HANDLER, "established"))
            .await?;
        let ip_a = pod_ip(&cri, &pod_a.id).await?;
        let c_a = cri.run_container(&pod_a, &client_spec).await?;
        wait_for_echoes(&cri, &c_a).await?;
        let archive = node.paths().dir.join("addr-client.tar");
        let _ = std::fs::remove_file(&archive);
        if criu_cannot_dump_tcp() {
            names_the_old_criu(cri.checkpoint_container(&c_a, &archive, 60).await)?;
            cri.remove_pod(&pod_a).await?;
            cri.remove_pod(&server_pod).await?;
            return Ok(());
        }
        cri.checkpoint_container(&c_a, &archive, 60).await?;
        cri.remove_pod(&pod_a).await?;
        let manifest = image_format::archive::read_info(&archive, Default::default())?
            .manifest
            .context("no gpu-ckpt manifest")?;
        ensure!(
            manifest.criu.tcp == "established"
                && manifest.container.addresses.as_ref() == Some(&vec![ip_a.clone()]),
            "the manifest records tcp {:?} and addresses {:?}, the pod had {ip_a}",
            manifest.criu.tcp,
            manifest.container.addresses
        );
        let source = archive.display().to_string();

        // Restored with its connections into a new pod, which has another IP: refused, naming
        // both, and nothing of it runs.
        let pod_b = cri
            .run_pod(
                &client(RESTORE_HANDLER, "established")
                    .annotation("gpu-ckpt.io/restore-from", &source),
            )
            .await?;
        let ip_b = pod_ip(&cri, &pod_b.id).await?;
        ensure!(ip_a != ip_b, "the new pod has the old pod's IP {ip_a}");
        let msg = match cri.run_container(&pod_b, &client_spec).await {
            Ok(id) => {
                let log = log_of(id).await;
                anyhow::bail!(
                    "a restore of connections bound to {ip_a} ran in a pod with IP {ip_b}:\n{log}"
                )
            }
            Err(e) => format!("{e:#}"),
        };
        println!("refused: {msg}");
        ensure!(
            msg.contains(&format!(
                "on the pod's addresses {ip_a}, and network namespace"
            )) && msg.contains(&format!(" has {ip_b} ({ip_a} missing)")),
            "the refusal does not name both IPs ({ip_a}, {ip_b}): {msg}"
        );
        cri.remove_pod(&pod_b).await?;

        // The same checkpoint with tcp close: restored, the client sees its connection closed
        // and reconnects.
        let pod_c = cri
            .run_pod(
                &client(RESTORE_HANDLER, "close").annotation("gpu-ckpt.io/restore-from", &source),
            )
            .await?;
        let c_c = cri.run_container(&pod_c, &client_spec).await?;
        let mut log = String::new();
        for _ in 0..150 {
            log = log_of(c_c.clone()).await;
            if log
                .split("reconnect")
                .nth(1)
                .is_some_and(|after| echoes(after) >= 3)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let after = log
            .split("reconnect")
            .nth(1)
            .with_context(|| format!("the client never saw its connection closed:\n{log}"))?;
        ensure!(echoes(after) >= 3, "no echoes after reconnecting:\n{log}");
        cri.remove_pod(&pod_c).await?;
        cri.remove_pod(&server_pod).await?;
        Ok(())
    })
}
