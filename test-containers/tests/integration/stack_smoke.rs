//! Smoke tests of the test harness against the real stack with the plain runc shim
//! (io.containerd.runc.v2): they prove the harness independently of the project's shim.
//!
//! Needs root and the stack from `make deps`; fails (never skips) when it is missing.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use test_containers::containerd::{Containerd, TaskEvent};
use test_containers::cri::{ContainerSpec, Cri, Network, PodSpec};
use test_containers::stack::{
    read_images_json, Node, Registry, Stack, K8S_NAMESPACE, RUNC_HANDLER, WORKLOADS_IMAGE,
};

const MIB: i64 = 1 << 20;

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// Lines of `text` that carry a number.
fn ticks(text: &str) -> usize {
    text.lines()
        .filter(|l| l.chars().any(|c| c.is_ascii_digit()))
        .count()
}

fn workloads_tar(stack: &Stack) -> Result<PathBuf> {
    read_images_json(&stack.images_dir())?
        .into_iter()
        .find(|i| i.name == WORKLOADS_IMAGE)
        .map(|i| i.tar)
        .with_context(|| format!("{WORKLOADS_IMAGE} is not in images.json"))
}

/// `ctr run` of the counter in namespace "default", observed through the containerd API:
/// Tasks.Get, Tasks.Metrics, Tasks.Update (memory limit as runtime-spec JSON), Tasks.Wait and
/// the /tasks/* events.
#[test]
fn ctr_run_counter_and_task_api() -> Result<()> {
    let stack = Stack::discover()?;
    let node = Node::builder_on(&stack, "smoke-ctr").cni(false).start()?;
    node.import_image(&workloads_tar(&stack)?, "default")?;

    let rt = runtime()?;
    rt.block_on(async {
        let ctd = Containerd::connect(node.socket(), "default").await?;
        let mut events = ctd.subscribe_tasks().await?;

        let id = "smoke-counter";
        let log = node.paths().dir.join("smoke-counter.log");
        let _ = std::fs::remove_file(&log);
        let log_uri = format!("file://{}", log.display());
        let mut args: Vec<String> = vec!["run".into(), "-d".into(), "--log-uri".into(), log_uri];
        args.extend(node.ctr_run_flags());
        args.extend([WORKLOADS_IMAGE.to_string(), id.to_string()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        node.ctr_ok(&args)?;

        let (start, _) = events
            .wait_for(
                Duration::from_secs(10),
                |e| matches!(&e.event, TaskEvent::Start(s) if s.container_id == id),
            )
            .await?;
        println!("event {} for {:?}", start.topic, start.container_id());

        tokio::time::sleep(Duration::from_millis(2500)).await;
        let out = std::fs::read_to_string(&log).unwrap_or_default();
        println!("counter output after 2.5 s:\n{out}");
        ensure!(
            ticks(&out) >= 2,
            "counter printed {} ticks in 2.5 s; log:\n{out}\ncontainerd log:\n{}",
            ticks(&out),
            node.log_tail(40)
        );

        let p = ctd.get(id).await?;
        println!("Tasks.Get: pid {} status {:?}", p.pid, p.status());
        ensure!(p.pid > 0, "no pid");

        let mem = ctd.memory(id).await?;
        println!("Tasks.Metrics: {mem:?}");
        ensure!(mem.usage > 0, "memory usage 0");

        ctd.update_memory_limit(id, 64 * MIB).await?;
        let mem = ctd.memory(id).await?;
        println!("after Tasks.Update 64 MiB: {mem:?}");
        ensure!(
            mem.limit == 64 * MIB as u64,
            "limit {} after update",
            mem.limit
        );

        node.ctr_ok(&["tasks", "kill", "-s", "SIGKILL", id])?;
        let status = ctd.wait_timeout(id, Duration::from_secs(10)).await?;
        println!("Tasks.Wait: {status:?}");
        ensure!(status.code == 137, "exit status {}", status.code);

        let (exit, _) = events
            .wait_for(
                Duration::from_secs(10),
                |e| matches!(&e.event, TaskEvent::Exit(x) if x.container_id == id),
            )
            .await?;
        if let TaskEvent::Exit(x) = &exit.event {
            println!("event {}: exit_status {}", exit.topic, x.exit_status);
            ensure!(x.exit_status == 137);
        }

        node.ctr_ok(&["tasks", "rm", id])?;
        node.ctr_ok(&["containers", "rm", id])?;
        Ok::<_, anyhow::Error>(())
    })?;
    drop(rt);
    let mut node = node;
    node.stop()?;
    ensure!(!node.paths().run.exists(), "run dir left behind");
    ensure!(node.paths().log.exists(), "containerd.log removed");
    Ok(())
}

/// The runc shim reports an OOM kill as /tasks/oom before /tasks/exit (the order the project's
/// shim must keep too).
#[test]
fn ctr_oom_event_before_exit() -> Result<()> {
    let stack = Stack::discover()?;
    let node = Node::builder_on(&stack, "smoke-oom").cni(false).start()?;
    node.import_image(&workloads_tar(&stack)?, "default")?;
    let rt = runtime()?;
    rt.block_on(async {
        let ctd = Containerd::connect(node.socket(), "default").await?;
        let mut events = ctd.subscribe_tasks().await?;
        let id = "smoke-oom";
        let limit = (32 * MIB).to_string();
        let mut args: Vec<String> = vec!["run".into(), "-d".into(), "--memory-limit".into(), limit];
        args.extend(node.ctr_run_flags());
        args.extend([
            WORKLOADS_IMAGE.to_string(),
            id.to_string(),
            "/bin/oom-eater".to_string(),
        ]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        node.ctr_ok(&args)?;
        let (exit, before) = events
            .wait_for(
                Duration::from_secs(30),
                |e| matches!(&e.event, TaskEvent::Exit(x) if x.container_id == id),
            )
            .await?;
        let topics: Vec<&str> = before.iter().map(|e| e.topic.as_str()).collect();
        println!("events before {}: {topics:?}", exit.topic);
        ensure!(
            before
                .iter()
                .any(|e| matches!(&e.event, TaskEvent::Oom(o) if o.container_id == id)),
            "no /tasks/oom before /tasks/exit: {topics:?}"
        );
        let status = ctd.wait(id).await?;
        println!("exit status {}", status.code);
        ensure!(status.code == 137, "exit status {}", status.code);
        node.ctr_ok(&["tasks", "rm", id])?;
        node.ctr_ok(&["containers", "rm", id])?;
        Ok::<_, anyhow::Error>(())
    })
}

/// A kubelet-like CRI pod on handler `runc` (hostNetwork) with two containers.
#[test]
fn cri_pod_two_containers_runc() -> Result<()> {
    let stack = Stack::discover()?;
    let registry = Registry::ensure_running(&stack)?;
    let node = Node::builder_on(&stack, "smoke-cri").cni(false).start()?;
    let pushed = registry.push_images(&node)?;
    println!("pushed {pushed:?}");

    let rt = runtime()?;
    rt.block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let v = cri.version().await?;
        println!(
            "CRI runtime {} {} (api {})",
            v.runtime_name, v.runtime_version, v.runtime_api_version
        );
        let image_ref = cri.pull_image(WORKLOADS_IMAGE).await?;
        let img = cri
            .image_status(WORKLOADS_IMAGE)
            .await?
            .context("image absent after pull")?;
        println!("pulled {image_ref}: repo_digests {:?}", img.repo_digests);
        ensure!(!img.repo_digests.is_empty(), "no RepoDigest after CRI pull");

        let spec = PodSpec::new("smoke", node.pod_log_root())
            .handler(RUNC_HANDLER)
            .network(Network::Node)
            .annotation("gpu-ckpt.io/test", "smoke");
        let pod = cri.run_pod(&spec).await?;
        println!("pod {}", pod.id);

        let counter = cri
            .run_container(&pod, &ContainerSpec::new("counter", WORKLOADS_IMAGE))
            .await?;
        let sleeper = cri
            .run_container(
                &pod,
                &ContainerSpec::new("sleeper", WORKLOADS_IMAGE)
                    .command(&["/bin/sh", "-c", "echo sleeper-up; exec sleep 3600"])
                    .memory_limit(256 * MIB),
            )
            .await?;

        let listed = cri.list_containers(Some(&pod.id)).await?;
        ensure!(listed.len() == 2, "{} containers listed", listed.len());

        let r = cri
            .exec_sync(&sleeper, &["/bin/sh", "-c", "echo exec-ok; id -u"], 10)
            .await?;
        println!(
            "ExecSync: exit {} stdout {:?} stderr {:?}",
            r.exit_code,
            r.stdout_str(),
            r.stderr_str()
        );
        ensure!(r.exit_code == 0 && r.stdout_str().contains("exec-ok"));

        let r = cri
            .exec_sync(&sleeper, &["/bin/sh", "-c", "exit 3"], 10)
            .await?;
        ensure!(r.exit_code == 3, "exit code {}", r.exit_code);

        tokio::time::sleep(Duration::from_millis(2500)).await;
        let log = std::fs::read_to_string(pod.container_log("counter")).unwrap_or_default();
        println!("counter CRI log:\n{log}");
        ensure!(ticks(&log) >= 2, "counter log has {} ticks", ticks(&log));

        let st = cri.container_status(&counter).await?;
        let status = st.status.context("no status")?;
        ensure!(
            status.state == test_containers::cri::v1::ContainerState::ContainerRunning as i32,
            "counter state {}",
            status.state
        );

        // CheckpointContainer (runc + CRIU): the archive appears and the container keeps running.
        let archive = node.paths().dir.join("smoke-counter-ckpt.tar");
        let _ = std::fs::remove_file(&archive);
        let t0 = std::time::Instant::now();
        cri.checkpoint_container(&counter, &archive, 60).await?;
        let size = std::fs::metadata(&archive)
            .with_context(|| format!("no archive at {}", archive.display()))?
            .len();
        println!("CheckpointContainer: {} bytes in {:?}", size, t0.elapsed());
        ensure!(size > 0, "empty checkpoint archive");
        cri.wait_container_state(
            &counter,
            test_containers::cri::v1::ContainerState::ContainerRunning,
            Duration::from_secs(5),
        )
        .await?;
        let _ = std::fs::remove_file(&archive);

        // UpdateContainerResources, observed through the containerd task API.
        cri.update_container_resources(
            &sleeper,
            test_containers::cri::v1::LinuxContainerResources {
                memory_limit_in_bytes: 128 * MIB,
                ..Default::default()
            },
            Default::default(),
        )
        .await?;
        let ctd = Containerd::connect(node.socket(), K8S_NAMESPACE).await?;
        let mem = ctd.memory(&sleeper).await?;
        println!("sleeper memory after UpdateContainerResources: {mem:?}");
        ensure!(mem.limit == 128 * MIB as u64, "limit {}", mem.limit);

        for id in [&counter, &sleeper] {
            cri.stop_container(id, 5).await?;
            cri.remove_container(id).await?;
        }
        cri.stop_pod_sandbox(&pod.id).await?;
        cri.remove_pod_sandbox(&pod.id).await?;
        test_containers::cri::remove_pod_cgroups(&pod.spec.uid);
        let left = cri.list_pod_sandboxes().await?;
        ensure!(left.is_empty(), "{} pods left", left.len());
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(())
}

/// Two CNI nodes at once, each with a pod on its own bridge and subnet.
#[test]
fn cri_pod_network_two_nodes() -> Result<()> {
    let stack = Stack::discover()?;
    let registry = Registry::ensure_running(&stack)?;
    let a = Node::builder_on(&stack, "smoke-net-a").start()?;
    let b = Node::builder_on(&stack, "smoke-net-b").start()?;
    ensure!(a.cni().unwrap().bridge != b.cni().unwrap().bridge);

    let rt = runtime()?;
    for node in [&a, &b] {
        registry.push_images(node)?;
        let net = node.cni().context("CNI is off")?.clone();
        rt.block_on(async {
            let cri = Cri::connect(node.socket()).await?;
            cri.pull_image(WORKLOADS_IMAGE).await?;
            let spec = PodSpec::new("net", node.pod_log_root())
                .handler(RUNC_HANDLER)
                .network(Network::Pod);
            let pod = cri.run_pod(&spec).await?;
            let st = cri.pod_sandbox_status(&pod.id).await?;
            let ip = st
                .status
                .and_then(|s| s.network)
                .map(|n| n.ip)
                .unwrap_or_default();
            println!("node {} pod ip {ip} (subnet {})", node.name(), net.subnet);
            let prefix = net.subnet.trim_end_matches("0/24");
            if !ip.starts_with(prefix) {
                bail!("pod ip {ip:?} not in {}", net.subnet);
            }
            let c = cri
                .run_container(
                    &pod,
                    &ContainerSpec::new("c", WORKLOADS_IMAGE).command(&[
                        "/bin/sh",
                        "-c",
                        "exec sleep 3600",
                    ]),
                )
                .await?;
            let r = cri
                .exec_sync(&c, &["/bin/sh", "-c", "ip -4 addr"], 10)
                .await?;
            ensure!(
                r.stdout_str().contains(&ip),
                "ip addr in the pod: {}",
                r.stdout_str()
            );
            cri.remove_pod(&pod).await?;
            Ok::<_, anyhow::Error>(())
        })?;
    }
    Ok(())
}
