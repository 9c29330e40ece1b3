//! The README's demo: a private containerd node running a container on gpu-ckpt, then the main
//! job: a checkpoint through CRI (as kubelet takes it) on one node, restored on a second,
//! independent node, where it continues counting from where it was.

use std::{path::PathBuf, time::Duration};

use anyhow::{bail, Context, Result};
use test_containers::{
    cri::{ContainerSpec, Cri, PodSpec},
    stack::{
        read_images_json, ExtraRuntime, Node, OptValue, Registry, Stack, GPU_CKPT_HANDLER,
        WORKLOADS_IMAGE,
    },
};

const RUNTIME: &str = "io.containerd.gpu-ckpt.v1";

fn say(s: &str) {
    println!("\n==> {s}");
}

fn counter_from_log(log: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(log)
        .ok()?
        .lines()
        .rev()
        .find_map(|l| l.rsplit("tick ").next()?.trim().parse().ok())
}

async fn wait_counter_above(cri: &Cri, id: &str, above: u64) -> Result<u64> {
    for _ in 0..100 {
        let r = cri.exec_sync(id, &["cat", "/counter.txt"], 5).await?;
        if let Ok(v) = r.stdout_str().trim().parse::<u64>() {
            if v > above {
                return Ok(v);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("the counter in {id} did not pass {above}")
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let stack = Stack::discover()?;
    let registry = Registry::ensure_running(&stack)?;

    say("starting a private containerd (node A) with the gpu-ckpt runtime");
    let a = Node::builder_on(&stack, "demo-a")
        .log_level("info")
        .start()?;
    registry.push_images(&a)?;
    for img in read_images_json(&stack.images_dir())? {
        a.import_image(&img.tar, "default")?;
    }
    println!("containerd socket: {}", a.socket().display());

    say(&format!("ctr run --runtime {RUNTIME}: a counter"));
    let log = a.paths().dir.join("demo-counter.log");
    let _ = std::fs::remove_file(&log);
    let log_uri = format!("file://{}", log.display());
    let fifo = a.paths().fifo_dir.display().to_string();
    a.ctr_ok(&[
        "run",
        "-d",
        "--runtime",
        RUNTIME,
        "--fifo-dir",
        &fifo,
        "--log-uri",
        &log_uri,
        WORKLOADS_IMAGE,
        "demo",
        "/bin/counter",
        "--interval-ms",
        "250",
    ])?;
    std::thread::sleep(Duration::from_millis(1500));
    println!("{}", a.ctr_ok(&["task", "ls"])?.trim_end());
    println!(
        "counter output so far: tick {}",
        counter_from_log(&log).unwrap_or(0)
    );
    let exec = a.ctr_ok(&["task", "exec", "--exec-id", "ps", "demo", "ps"])?;
    println!("ctr task exec demo ps:\n{}", exec.trim_end());
    a.ctr_ok(&["task", "kill", "-s", "SIGKILL", "demo"])?;
    std::thread::sleep(Duration::from_millis(300));
    a.ctr_ok(&["task", "rm", "demo"])?;
    a.ctr_ok(&["container", "rm", "demo"])?;
    println!(
        "deleted; containerd log mentions the shim: {}",
        a.log_contains(RUNTIME)
    );

    say("Kubernetes-style: a pod on RuntimeClass gpu-ckpt on node A");
    let cri_a = Cri::connect(a.socket()).await?;
    // Pulled through CRI (a RepoDigest): a restore pulls the base image by its digest.
    cri_a.pull_image(WORKLOADS_IMAGE).await?;
    let pod_a = cri_a
        .run_pod(&PodSpec::new("worker", a.pod_log_root()).handler(GPU_CKPT_HANDLER))
        .await?;
    let spec = ContainerSpec::new("counter", WORKLOADS_IMAGE).command(&[
        "/bin/counter",
        "--interval-ms",
        "200",
    ]);
    let c_a = cri_a.run_container(&pod_a, &spec).await?;
    let before = wait_counter_above(&cri_a, &c_a, 5).await?;
    println!("counter on node A: {before}");

    say("CheckpointContainer, as kubelet's POST /checkpoint/{ns}/{pod}/{container} does");
    let dir = stack.prefix().join("demo");
    std::fs::create_dir_all(&dir)?;
    let archive: PathBuf = dir.join("checkpoint-worker_default-counter.tar");
    let _ = std::fs::remove_file(&archive);
    let t = std::time::Instant::now();
    cri_a.checkpoint_container(&c_a, &archive, 0).await?;
    let size = std::fs::metadata(&archive).context("archive")?.len();
    println!(
        "archive {} ({} KiB) in {:.2} s; the container keeps running",
        archive.display(),
        size / 1024,
        t.elapsed().as_secs_f64()
    );
    let at_checkpoint = wait_counter_above(&cri_a, &c_a, before).await?;
    println!("counter on node A after the checkpoint: {at_checkpoint}");

    say("node B: a second, independent containerd; restore the archive into a new pod on the restore RuntimeClass");
    let mut options = std::collections::BTreeMap::new();
    options.insert("Mode".to_string(), OptValue::from("restore"));
    options.insert(
        "Root".to_string(),
        OptValue::from("/run/gpu-ckpt-test/demo-b/gpu-ckpt-restore-runc"),
    );
    let b = Node::builder_on(&stack, "demo-b")
        .log_level("info")
        .extra_runtime(ExtraRuntime {
            name: "gpu-ckpt-restore".into(),
            runtime_type: "io.containerd.gpu-ckpt.v1".into(),
            pod_annotations: vec!["gpu-ckpt.io/*".into()],
            container_annotations: vec!["gpu-ckpt.io/*".into()],
            options,
        })
        .start()?;
    registry.push_images(&b)?;
    let cri_b = Cri::connect(b.socket()).await?;
    let pod_b = cri_b
        .run_pod(
            &PodSpec::new("worker", b.pod_log_root())
                .handler("gpu-ckpt-restore")
                .annotation("gpu-ckpt.io/restore-from", &archive.display().to_string()),
        )
        .await?;
    println!(
        "pod annotation gpu-ckpt.io/restore-from: {}",
        archive.display()
    );
    let c_b = cri_b.run_container(&pod_b, &spec).await?;
    let after = wait_counter_above(&cri_b, &c_b, 0).await?;
    println!("counter on node B right after the restore: {after} (it was {before}..{at_checkpoint} around the checkpoint)");
    let later = wait_counter_above(&cri_b, &c_b, after).await?;
    println!("and it keeps counting on node B: {later}");
    if after < before {
        bail!("the restored counter started over ({after} < {before})");
    }

    say("cleaning up");
    cri_a.remove_pod(&pod_a).await?;
    cri_b.remove_pod(&pod_b).await?;
    drop(b);
    drop(a);
    println!("done");
    Ok(())
}
