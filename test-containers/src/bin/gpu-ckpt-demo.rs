//! The README's demo: a private containerd node running a container on gpu-ckpt, then the main
//! job: a GPU training pod checkpointed through CRI (as kubelet takes it) on one node, restored
//! on a second, independent node with other GPUs through the restore RuntimeClass, where it
//! trains on from the checkpointed step with the same results. It runs on this machine's
//! NVIDIA GPU when there is one with a CDI spec, else on the simulated driver, and says which.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{bail, Context, Result};
use simgpu::testing::{SimConfig, SimNode};
use test_containers::{
    cri::{ContainerSpec, Cri, PodSpec},
    stack::{
        read_images_json, ExtraRuntime, Node, OptValue, Registry, Stack, GPU_CKPT_HANDLER,
        GPU_WORKLOADS_IMAGE, WORKLOADS_IMAGE,
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

/// The last `step <k>` gpu-train logged in CRI log `log`.
fn last_step(log: &Path) -> Option<u64> {
    std::fs::read_to_string(log)
        .ok()?
        .lines()
        .rev()
        .find_map(|l| {
            l.split("step ")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
}

/// The checksum gpu-train printed for step `k` in `log`.
fn checksum(log: &Path, k: u64) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    let prefix = format!("step {k} checksum ");
    text.lines()
        .find_map(|l| Some(l.split(&prefix).nth(1)?.trim().to_string()))
}

async fn wait_step_above(log: &Path, above: u64) -> Result<u64> {
    for _ in 0..300 {
        if let Ok(text) = std::fs::read_to_string(log) {
            if text.contains("MISMATCH") {
                bail!("gpu-train found a wrong result:\n{text}");
            }
        }
        if let Some(k) = last_step(log).filter(|k| *k > above) {
            return Ok(k);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("gpu-train in {} did not pass step {above}", log.display())
}

/// The GPUs of the demo's two nodes: this machine's NVIDIA GPU (both nodes share it: a
/// restore on "another node" is a second containerd on the same machine) when there is one
/// with a CDI spec, else a simulated driver per node with other UUIDs.
enum Gpus {
    Real {
        cdi_dir: PathBuf,
        uuids: Vec<String>,
    },
    Simulated([SimNode; 2]),
}

impl Gpus {
    fn find(stack: &Stack) -> Result<Gpus> {
        use gpu::Inventory;
        let _ = stack;
        if let Ok(nvml) = gpu::NvmlInventory::load() {
            let spec_dirs = ["/etc/cdi", "/var/run/cdi"];
            let cdi = spec_dirs.iter().map(PathBuf::from).find(|d| {
                std::fs::read_dir(d).is_ok_and(|e| {
                    e.flatten().any(|f| {
                        std::fs::read_to_string(f.path())
                            .is_ok_and(|t| t.contains("nvidia.com/gpu"))
                    })
                })
            });
            if let (Ok(node), Some(cdi_dir)) = (nvml.node(), cdi) {
                if !node.gpus.is_empty() {
                    let uuids = node.gpus.iter().map(|g| g.uuid.to_string()).collect();
                    return Ok(Gpus::Real { cdi_dir, uuids });
                }
            }
        }
        let sim = |seed: &str| {
            SimNode::start(SimConfig {
                gpus: 1,
                memory_mib: 1024,
                uuid_seed: seed.into(),
                cdi: true,
                ..SimConfig::default()
            })
        };
        Ok(Gpus::Simulated([sim("demo-a")?, sim("demo-b")?]))
    }

    fn describe(&self) -> String {
        match self {
            Gpus::Real { uuids, .. } => format!(
                "a real NVIDIA GPU: {} (CDI nvidia.com/gpu); both nodes use this machine's driver",
                uuids.join(", ")
            ),
            Gpus::Simulated(s) => format!(
                "no NVIDIA GPU here: the simulated driver (gpu-ckpt-simgpu), node A's GPU {} and node B's GPU {}",
                s[0].uuids()[0],
                s[1].uuids()[0]
            ),
        }
    }

    fn device(&self, index: usize) -> String {
        match self {
            Gpus::Real { .. } => format!("nvidia.com/gpu={index}"),
            Gpus::Simulated(_) => format!("{}=0", simgpu::cdi::KIND),
        }
    }

    fn uuid(&self, node: usize, gpu: usize) -> String {
        match self {
            Gpus::Real { uuids, .. } => uuids.get(gpu).cloned().unwrap_or_default(),
            Gpus::Simulated(s) => s[node].uuids()[gpu].clone(),
        }
    }

    /// Node `n` (0: A, 1: B) with its GPUs' CDI spec, the restore RuntimeClass's handler, and,
    /// on the simulated driver, the shim loading that driver's libraries.
    fn node(&self, stack: &Stack, n: usize, name: &str) -> Result<Node> {
        let mut restore = std::collections::BTreeMap::new();
        restore.insert("Mode".to_string(), OptValue::from("restore"));
        restore.insert(
            "Root".to_string(),
            OptValue::from(format!("/run/gpu-ckpt-test/{name}/gpu-ckpt-restore-runc")),
        );
        restore.insert(
            "RestoreSources".to_string(),
            OptValue::from(vec![format!("{}/", stack.prefix().join("demo").display())]),
        );
        restore.insert(
            "RestoreStagingDir".to_string(),
            OptValue::from(stack.node_dir(name).join("restore-staging").as_path()),
        );
        let mut b = Node::builder_on(stack, name).log_level("info");
        match self {
            Gpus::Real { cdi_dir, .. } => b = b.cdi(&[cdi_dir]),
            Gpus::Simulated(s) => {
                let lib = s[n].lib_dir().display().to_string();
                b = b
                    .cdi(&[s[n].cdi_dir()])
                    .runtime_option("DriverLibraryDir", lib.as_str());
                restore.insert("DriverLibraryDir".to_string(), OptValue::from(lib));
            }
        }
        b.extra_runtime(ExtraRuntime {
            name: "gpu-ckpt-restore".into(),
            runtime_type: "io.containerd.gpu-ckpt.v1".into(),
            pod_annotations: vec!["gpu-ckpt.io/*".into()],
            container_annotations: vec!["gpu-ckpt.io/*".into()],
            options: restore,
        })
        .start()
    }
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

    say("GPUs: a simulated NVIDIA driver per node, or this machine's real one");
    let gpus = Gpus::find(&stack)?;
    println!("{}", gpus.describe());

    say("Kubernetes-style: a training pod on RuntimeClass gpu-ckpt on node A, one GPU through CDI");
    drop(a);
    let a = gpus.node(&stack, 0, "demo-a")?;
    registry.push_images(&a)?;
    let cri_a = Cri::connect(a.socket()).await?;
    // Pulled through CRI (a RepoDigest): a restore pulls the base image by its digest.
    cri_a.pull_image(GPU_WORKLOADS_IMAGE).await?;
    let pod_a = cri_a
        .run_pod(&PodSpec::new("trainer", a.pod_log_root()).handler(GPU_CKPT_HANDLER))
        .await?;
    let spec = ContainerSpec::new("train", GPU_WORKLOADS_IMAGE)
        .command(&["/usr/bin/gpu-train"])
        .args(&["--elements", "65536", "--interval-ms", "200"])
        .annotation("cdi.k8s.io/demo", &gpus.device(0));
    let c_a = cri_a.run_container(&pod_a, &spec).await?;
    let log_a = pod_a.container_log("train");
    let before = wait_step_above(&log_a, 5).await?;
    println!(
        "gpu-train on node A's GPU {} (its state lives in device memory; every step is checked): step {before}",
        gpus.uuid(0, 0)
    );

    say("CheckpointContainer, as kubelet's POST /checkpoint/{ns}/{pod}/{container} does");
    let dir = stack.prefix().join("demo");
    std::fs::create_dir_all(&dir)?;
    let archive: PathBuf = dir.join("checkpoint-trainer_default-train.tar");
    let _ = std::fs::remove_file(&archive);
    let t = std::time::Instant::now();
    cri_a.checkpoint_container(&c_a, &archive, 0).await?;
    let size = std::fs::metadata(&archive).context("archive")?.len();
    println!(
        "archive {} ({} KiB) in {:.2} s; the pod keeps training",
        archive.display(),
        size / 1024,
        t.elapsed().as_secs_f64()
    );
    let info = image_format::archive::read_info(&archive, Default::default())?;
    if let Some(m) = &info.manifest {
        for g in &m.devices.gpus {
            println!("checkpointed GPU: {} ({})", g.uuid, g.model);
        }
        println!(
            "device memory staged into the checkpoint: {} bytes, driver {}, CUDA {}",
            m.devices.device_bytes(),
            m.devices.driver_version,
            m.devices.cuda_driver_version
        );
    }
    let at_checkpoint = wait_step_above(&log_a, before).await?;
    println!("node A after the checkpoint: step {at_checkpoint}");

    say("node B: a second, independent containerd with other GPUs; restore into a new pod on the restore RuntimeClass");
    let b = gpus.node(&stack, 1, "demo-b")?;
    registry.push_images(&b)?;
    let cri_b = Cri::connect(b.socket()).await?;
    let pod_b = cri_b
        .run_pod(
            &PodSpec::new("trainer", b.pod_log_root())
                .handler("gpu-ckpt-restore")
                .annotation("gpu-ckpt.io/restore-from", &archive.display().to_string()),
        )
        .await?;
    println!(
        "pod annotation gpu-ckpt.io/restore-from: {}",
        archive.display()
    );
    let c_b = cri_b.run_container(&pod_b, &spec).await?;
    let log_b = pod_b.container_log("train");
    let first = wait_step_above(&log_b, 0).await?;
    println!(
        "node B, on its GPU {}: the first step after the restore is {first} (node A was at {before}..{at_checkpoint} around the checkpoint)",
        gpus.uuid(1, 0)
    );
    let later = wait_step_above(&log_b, first + 2).await?;
    let (sum_a, sum_b) = (checksum(&log_a, later), checksum(&log_b, later));
    println!("and it trains on: step {later}, checksum {sum_b:?} on node B, {sum_a:?} on node A");
    if first <= 1 {
        bail!("the restored training started over (step {first})");
    }
    if sum_a.is_some() && sum_a != sum_b {
        bail!("node B's step {later} differs from node A's");
    }
    let _ = c_b;

    say("cleaning up");
    cri_a.remove_pod(&pod_a).await?;
    cri_b.remove_pod(&pod_b).await?;
    drop(b);
    drop(a);
    drop(gpus);
    println!("done");
    Ok(())
}
