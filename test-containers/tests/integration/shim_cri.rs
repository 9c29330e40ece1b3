//! The shim under CRI, driven like kubelet: pods on handler gpu-ckpt, one shim per pod, OOM
//! events, and bad input that must fail clearly and leave nothing behind.

use std::time::Duration;

use crate::common::*;
use anyhow::{ensure, Context, Result};
use test_containers::{
    containerd::{Containerd, Event, TaskEvent},
    cri::{v1 as cri, ContainerSpec, Cri, Network, Pod, PodSpec},
    stack::{processes_matching, Node, GPU_CKPT_HANDLER, K8S_NAMESPACE},
};

#[test]
fn pod_of_two_containers_runs_on_one_shim() -> Result<()> {
    let node = node("cri-pod")?;
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        for network in [Network::Node, Network::Pod] {
            let name = match network {
                Network::Node => "hostnet",
                Network::Pod => "podnet",
            };
            let spec = PodSpec::new(name, node.pod_log_root())
                .handler(GPU_CKPT_HANDLER)
                .network(network);
            let pod = cri.run_pod(&spec).await?;
            let counter = ContainerSpec::new("counter", workloads()).command(&[
                "/bin/counter",
                "--interval-ms",
                "100",
            ]);
            let echo = ContainerSpec::new("echo", workloads()).command(&[
                "/bin/echo-server",
                "--listen",
                "127.0.0.1:7777",
            ]);
            let c1 = cri.run_container(&pod, &counter).await?;
            let c2 = cri.run_container(&pod, &echo).await?;
            for id in [&c1, &c2] {
                cri.wait_container_state(
                    id,
                    cri::ContainerState::ContainerRunning,
                    Duration::from_secs(10),
                )
                .await?;
            }

            // Sandbox and both containers are served by a single shim process.
            let shims = shims_of(&node);
            ensure!(
                shims.len() == 1,
                "{name}: expected one shim for the pod, found {shims:?}"
            );

            // ExecSync runs in the container and returns output and exit code.
            let r = cri
                .exec_sync(
                    &c1,
                    &["sh", "-c", "cat /counter.txt; echo err >&2; exit 4"],
                    10,
                )
                .await?;
            ensure!(r.exit_code == 4, "{name}: exec exit code {}", r.exit_code);
            ensure!(
                r.stdout_str().trim().parse::<u64>().is_ok(),
                "{name}: exec stdout {:?}",
                r.stdout_str()
            );
            ensure!(
                r.stderr_str().contains("err"),
                "{name}: exec stderr {:?}",
                r.stderr_str()
            );

            // Containers share the pod's network: the counter's container reaches the echo server.
            let r = cri
                .exec_sync(
                    &c1,
                    &[
                        "/bin/echo-client",
                        "--connect",
                        "127.0.0.1:7777",
                        "--count",
                        "2",
                    ],
                    10,
                )
                .await;
            if let Ok(r) = &r {
                ensure!(
                    r.stdout_str().contains("echo 1"),
                    "{name}: echo over the pod network: {:?}",
                    r.stdout_str()
                );
            }

            // The container log (CRI format) has the counter's ticks.
            let log = pod.container_log("counter");
            wait_until(
                Duration::from_secs(10),
                "counter ticks in the CRI log",
                || {
                    std::fs::read_to_string(&log)
                        .ok()
                        .filter(|s| s.contains("stdout F tick"))
                },
            )?;

            let pids: Vec<i32> = {
                let mut v = Vec::new();
                for id in [&c1, &c2] {
                    let st = cri.container_status(id).await?;
                    let info = st.info.get("info").cloned().unwrap_or_default();
                    let json: serde_json::Value = serde_json::from_str(&info).unwrap_or_default();
                    if let Some(p) = json.get("pid").and_then(|p| p.as_i64()) {
                        v.push(p as i32);
                    }
                }
                v
            };
            ensure!(pids.len() == 2, "{name}: pids of the containers: {pids:?}");

            for id in [&c1, &c2] {
                cri.stop_container(id, 5).await?;
                cri.remove_container(id).await?;
            }
            cri.stop_pod_sandbox(&pod.id).await?;
            cri.remove_pod_sandbox(&pod.id).await?;

            // Nothing left: processes, shim, mounts.
            for pid in &pids {
                wait_until(
                    Duration::from_secs(10),
                    "container processes to be gone",
                    || (!std::path::Path::new(&format!("/proc/{pid}")).exists()).then_some(()),
                )?;
            }
            wait_until(Duration::from_secs(10), "the pod's shim to exit", || {
                shims_of(&node).is_empty().then_some(())
            })?;
            for id in [&c1, &c2, &pod.id] {
                let mounts = mounts_mentioning(id);
                ensure!(
                    mounts.is_empty(),
                    "{name}: mounts left for {id}: {mounts:?}"
                );
            }
        }
        Ok(())
    })
}

/// Runs `spec` in a pod `pod_name` on the gpu-ckpt handler of `node`, with the node's task
/// events subscribed to first, and waits up to a minute for the container's first task event
/// that `want` accepts: the CRI client, the pod, the container's id, that event and the events
/// before it.
async fn run_until_event(
    node: &Node,
    pod_name: &str,
    spec: &ContainerSpec,
    want: fn(&TaskEvent) -> bool,
) -> Result<(Cri, Pod, String, Event, Vec<Event>)> {
    let cri = Cri::connect(node.socket()).await?;
    let api = Containerd::connect(node.socket(), K8S_NAMESPACE).await?;
    let mut events = api.subscribe_tasks().await?;
    let pod = cri
        .run_pod(&PodSpec::new(pod_name, node.pod_log_root()).handler(GPU_CKPT_HANDLER))
        .await?;
    let id = cri.run_container(&pod, spec).await?;
    let (event, before) = events
        .wait_for(Duration::from_secs(60), |e| {
            e.container_id() == Some(id.as_str()) && want(&e.event)
        })
        .await?;
    Ok((cri, pod, id, event, before))
}

#[test]
fn oom_kill_reports_task_oom_before_task_exit() -> Result<()> {
    let node = node("cri-oom")?;
    rt().block_on(async {
        let spec = ContainerSpec::new("eater", workloads())
            .command(&["/bin/oom-eater", "--step-mib", "8"])
            .memory_limit(48 * 1024 * 1024);
        let (cri, pod, id, exit, before) =
            run_until_event(&node, "oom", &spec, |e| matches!(e, TaskEvent::Exit(_))).await?;
        let TaskEvent::Exit(exit) = exit.event else {
            unreachable!("matched an exit")
        };
        ensure!(
            exit.exit_status == 137,
            "OOM-killed container exit status {}",
            exit.exit_status
        );
        let oom_before_exit = before
            .iter()
            .any(|e| e.container_id() == Some(id.as_str()) && matches!(e.event, TaskEvent::Oom(_)));
        ensure!(
            oom_before_exit,
            "no TaskOOM before TaskExit; saw {:?}",
            before.iter().map(|e| &e.topic).collect::<Vec<_>>()
        );
        // As kubelet does: remove it once CRI reports it exited.
        let st = cri
            .wait_container_state(
                &id,
                cri::ContainerState::ContainerExited,
                Duration::from_secs(10),
            )
            .await?;
        ensure!(st.reason == "OOMKilled", "CRI reason {:?}", st.reason);
        cri.remove_container(&id).await?;
        cri.remove_pod(&pod).await?;
        Ok(())
    })
}

/// Runs a pod on a node whose gpu-ckpt handler has `option = value`; returns the error.
fn pod_error_with_option(name: &str, key: &str, value: &str) -> Result<(Node, String)> {
    let node = node_with(Node::builder(name)?.runtime_option(key, value))?;
    let err = rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let spec = PodSpec::new("bad", node.pod_log_root()).handler(GPU_CKPT_HANDLER);
        match cri.run_pod(&spec).await {
            Ok(pod) => anyhow::bail!("pod {} started despite {key} = {value:?}", pod.id),
            Err(e) => Ok(format!("{e:#}")),
        }
    })?;
    Ok((node, err))
}

fn assert_clean(node: &Node) -> Result<()> {
    wait_until(Duration::from_secs(10), "no shim left", || {
        shims_of(node).is_empty().then_some(())
    })?;
    // runc state, in the handler's root and in the default one, one directory per namespace.
    for root in [
        node.paths().gpu_ckpt_runc_root.clone(),
        node.paths().state.join("gpu-ckpt"),
    ] {
        let left: Vec<_> = std::fs::read_dir(&root)
            .into_iter()
            .flatten()
            .flatten()
            .flat_map(|ns| std::fs::read_dir(ns.path()).into_iter().flatten().flatten())
            .map(|c| c.path())
            .collect();
        ensure!(
            left.is_empty(),
            "runc state left in {}: {left:?}",
            root.display()
        );
    }
    let mounts = mounts_mentioning(&node.paths().state.display().to_string());
    let rootfs: Vec<_> = mounts.iter().filter(|m| m.contains("/rootfs")).collect();
    ensure!(rootfs.is_empty(), "rootfs mounts left: {rootfs:?}");
    Ok(())
}

/// A pod whose runtime option `key` is `value` fails with an error that names `named` (the
/// `what`), and leaves nothing behind.
fn option_error_names(name: &str, key: &str, value: &str, named: &str, what: &str) -> Result<()> {
    let (node, err) = pod_error_with_option(name, key, value)?;
    ensure!(err.contains(named), "error does not name the {what}: {err}");
    assert_clean(&node)
}

#[test]
fn unknown_runtime_option_is_named() -> Result<()> {
    option_error_names("bad-opt", "Frobnicate", "yes", "Frobnicate", "key")
}

#[test]
fn missing_runc_binary_is_named() -> Result<()> {
    let runc = "/nonexistent/runc";
    option_error_names("bad-runc", "BinaryName", runc, runc, "binary")
}

#[test]
fn missing_rootfs_is_refused() -> Result<()> {
    use containerd_client::services::v1::{
        containers_client::ContainersClient, tasks_client::TasksClient, Container,
        CreateContainerRequest, CreateTaskRequest,
    };
    let node = node("bad-rootfs")?;
    rt().block_on(async {
        let api = Containerd::connect(node.socket(), "default").await?;
        let spec = serde_json::to_vec(&serde_json::json!({
            "ociVersion": "1.0.2",
            "process": {"args": ["/bin/counter"], "cwd": "/", "user": {"uid": 0, "gid": 0}},
            "root": {"path": "/nonexistent-rootfs-gpu-ckpt"},
            "linux": {"namespaces": [{"type": "pid"}, {"type": "mount"}]}
        }))?;
        let container = Container {
            id: "norootfs".to_string(),
            runtime: Some(containerd_client::services::v1::container::Runtime {
                name: RUNTIME.to_string(),
                options: None,
            }),
            spec: Some(prost_types::Any {
                type_url: "types.containerd.io/opencontainers/runtime-spec/1/Spec".into(),
                value: spec,
            }),
            ..Default::default()
        };
        ContainersClient::new(api.channel())
            .create(api.request(CreateContainerRequest {
                container: Some(container),
            }))
            .await
            .context("create container")?;
        let err = TasksClient::new(api.channel())
            .create(api.request(CreateTaskRequest {
                container_id: "norootfs".to_string(),
                ..Default::default()
            }))
            .await
            .err()
            .context("a task without a rootfs was created")?;
        ensure!(
            err.message().contains("/nonexistent-rootfs-gpu-ckpt")
                && err.message().contains("does not exist"),
            "error does not name the missing rootfs: {:?}",
            err.message()
        );
        Ok(())
    })?;
    assert_clean(&node)
}

/// containerd refuses a malformed spec before any shim sees it, so this drives the shim binary
/// the way containerd does (`start`, Task API over ttrpc, `delete`) on a bundle whose
/// config.json is malformed.
#[test]
fn malformed_bundle_config_is_refused() -> Result<()> {
    use containerd_shim_protos::{
        api::{CreateTaskRequest, ShutdownRequest},
        shim_async::TaskClient,
        ttrpc::{asynchronous::Client, context},
    };
    let node = node("bad-config")?;
    let bundle = node.paths().dir.join("bundles/bad1");
    std::fs::create_dir_all(bundle.join("rootfs"))?;
    std::fs::write(
        bundle.join("config.json"),
        b"{\"ociVersion\": \"1.0.2\", \"process\": ",
    )?;
    let shim = node.stack().shim_dir().join("containerd-shim-gpu-ckpt-v1");
    let socket = node.socket().display().to_string();
    let ttrpc_address = format!("{socket}.ttrpc");
    // The shim run as containerd runs it: `action`, after the usual flags and `extra`.
    let shim_action = |extra: &[&std::ffi::OsStr], action: &str| -> Result<std::process::Output> {
        let out = std::process::Command::new(&shim)
            .args(["-namespace", "default", "-id", "bad1", "-address", &socket])
            .args(extra)
            .arg(action)
            .current_dir(&bundle)
            .env("TTRPC_ADDRESS", &ttrpc_address)
            .stdin(std::process::Stdio::null())
            .output()
            .with_context(|| format!("run the shim's {action} action"))?;
        ensure!(
            out.status.success(),
            "shim {action}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(out)
    };
    let out = shim_action(&[], "start")?;
    let reply: serde_json::Value = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "shim start reply {:?}",
            String::from_utf8_lossy(&out.stdout)
        )
    })?;
    let address = reply["address"]
        .as_str()
        .context("no address in the start reply")?
        .to_string();
    rt().block_on(async {
        let client = Client::connect(&address)
            .await
            .context("connect to the shim")?;
        let tasks = TaskClient::new(client);
        let err = tasks
            .create(
                context::with_timeout(10_000_000_000),
                &CreateTaskRequest {
                    id: "bad1".into(),
                    bundle: bundle.display().to_string(),
                    ..Default::default()
                },
            )
            .await
            .err()
            .context("a task with a malformed config.json was created")?;
        let msg = err.to_string();
        ensure!(
            msg.contains("malformed bundle config"),
            "unclear error: {msg}"
        );
        ensure!(
            msg.contains("config.json"),
            "error does not name the file: {msg}"
        );
        let _ = tasks
            .shutdown(
                context::with_timeout(5_000_000_000),
                &ShutdownRequest {
                    id: "bad1".into(),
                    now: true,
                    ..Default::default()
                },
            )
            .await;
        Ok::<_, anyhow::Error>(())
    })?;
    shim_action(&["-bundle".as_ref(), bundle.as_os_str()], "delete")?;
    wait_until(Duration::from_secs(10), "the shim to exit", || {
        processes_matching(&["containerd-shim-gpu-ckpt-v1", "-id bad1"])
            .is_empty()
            .then_some(())
    })?;
    let sock_path = address.trim_start_matches("unix://");
    ensure!(
        !std::path::Path::new(sock_path).exists(),
        "shim socket {sock_path} left behind"
    );
    ensure!(
        mounts_mentioning(&bundle.display().to_string()).is_empty(),
        "mounts left in the bundle"
    );
    ensure!(
        !std::path::Path::new("/run/containerd/gpu-ckpt/default/bad1").exists(),
        "runc state left for bad1"
    );
    Ok(())
}

/// An OOM kill of a process other than init is reported as it happens, while the container
/// runs on (the live watch on the memory cgroup, not the check at exit). One allocation larger
/// than the limit makes the kill immediate: smaller steps can leave the cgroup thrashing on the
/// binaries' page cache for a long time before the kernel gives up.
#[test]
fn oom_kill_of_a_child_is_reported_live() -> Result<()> {
    let node = node("cri-oom-live")?;
    rt().block_on(async {
        let spec = ContainerSpec::new("app", workloads())
            .command(&[
                "sh",
                "-c",
                "/bin/oom-eater --step-mib 64 & exec /bin/counter --interval-ms 100",
            ])
            .memory_limit(48 * 1024 * 1024);
        let (cri, pod, id, oom, _) =
            run_until_event(&node, "oomlive", &spec, |e| matches!(e, TaskEvent::Oom(_))).await?;
        ensure!(oom.topic == "/tasks/oom", "topic {}", oom.topic);
        let st = cri.container_state(&id).await?;
        ensure!(
            st == cri::ContainerState::ContainerRunning,
            "the container stopped: {st:?}"
        );
        cri.remove_pod(&pod).await?;
        Ok(())
    })
}
