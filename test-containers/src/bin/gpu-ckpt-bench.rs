//! Benchmarks gpu-ckpt's shim side by side with containerd's own `containerd-shim-runc-v2`, in
//! one run on one private containerd node, and prints the figures as Markdown.
//!
//! - `lifecycle`: create-start-wait-delete of a trivial container (`ctr run --rm … /bin/true`),
//!   N times per runtime, interleaved so both see the same machine; ratio of medians.
//! - `memory`: N pods (sandbox plus one container) per handler through CRI; resident memory
//!   (RSS and PSS) of the shim processes per pod.

use std::{
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use test_containers::{
    cri::{ContainerSpec, Cri, PodSpec},
    stack::{
        read_images_json, Node, Registry, Stack, GPU_CKPT_HANDLER, RUNC_HANDLER, WORKLOADS_IMAGE,
    },
};

#[derive(Parser)]
#[command(about = "gpu-ckpt benchmarks against containerd-shim-runc-v2")]
struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(Subcommand)]
enum What {
    /// Container lifecycle latency through ctr.
    Lifecycle {
        #[arg(long, default_value_t = 50)]
        n: usize,
    },
    /// Shim resident memory per pod through CRI.
    Memory {
        #[arg(long, default_value_t = 5)]
        pods: usize,
    },
}

fn main() -> Result<()> {
    let args = Args::parse();
    let stack = Stack::discover()?;
    let registry = Registry::ensure_running(&stack)?;
    let node = Node::builder_on(&stack, "bench")
        .log_level("info")
        .start()?;
    registry.push_images(&node)?;
    for img in read_images_json(&stack.images_dir())? {
        node.import_image(&img.tar, "default")?;
    }
    match args.what {
        What::Lifecycle { n } => lifecycle(&node, n),
        What::Memory { pods } => tokio::runtime::Runtime::new()?.block_on(memory(&node, pods)),
    }
}

fn run_once(node: &Node, flags: &[String], id: &str) -> Result<Duration> {
    let mut args: Vec<&str> = vec!["run", "--rm"];
    args.extend(flags.iter().map(String::as_str));
    args.extend([WORKLOADS_IMAGE, id, "/bin/true"]);
    let t = Instant::now();
    let out = node.ctr(&args)?;
    let took = t.elapsed();
    if !out.status.success() {
        bail!(
            "ctr {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(took)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn lifecycle(node: &Node, n: usize) -> Result<()> {
    // runc-v2 gets its private runc root and binary from ctr's runc flags (ctr sends them
    // only to the runc shim); ours picks its defaults.
    let mut runc_flags = vec!["--runtime".to_string(), "io.containerd.runc.v2".to_string()];
    runc_flags.extend(node.ctr_run_flags());
    let ours = vec![
        "--runtime".to_string(),
        "io.containerd.gpu-ckpt.v1".to_string(),
        "--fifo-dir".to_string(),
        node.paths().fifo_dir.display().to_string(),
    ];
    // One warm-up each: image unpack and page cache are then the same for both.
    run_once(node, &runc_flags, "warm-runc")?;
    run_once(node, &ours, "warm-ours")?;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for i in 0..n {
        // Alternate which goes first so drift affects both alike.
        if i % 2 == 0 {
            a.push(run_once(node, &runc_flags, &format!("r{i}"))?);
            b.push(run_once(node, &ours, &format!("g{i}"))?);
        } else {
            b.push(run_once(node, &ours, &format!("g{i}"))?);
            a.push(run_once(node, &runc_flags, &format!("r{i}"))?);
        }
    }
    let (ma, mb) = (median(a.clone()), median(b.clone()));
    println!("| runtime | median | min | max |");
    println!("| --- | --- | --- | --- |");
    for (name, v, m) in [
        ("containerd-shim-runc-v2", &a, ma),
        ("containerd-shim-gpu-ckpt-v1", &b, mb),
    ] {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "| {name} | {:.1} ms | {:.1} ms | {:.1} ms |",
            ms(m),
            ms(v.iter().min().copied().unwrap_or_default()),
            ms(v.iter().max().copied().unwrap_or_default())
        );
    }
    println!(
        "\nlatency ratio (gpu-ckpt / runc-v2, medians of {n} create-start-wait-delete each): {:.3}",
        mb.as_secs_f64() / ma.as_secs_f64()
    );
    Ok(())
}

/// RSS and PSS of a process, in KiB.
fn rss_pss(pid: i32) -> Result<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .with_context(|| format!("smaps_rollup of {pid}"))?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    Ok((field("Rss:"), field("Pss:")))
}

/// Shim servers (not `start` helpers) of `binary` that serve the containerd at `socket`.
fn shims(binary: &str, socket: &Path) -> Vec<i32> {
    let socket = socket.display().to_string();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains(binary) && cmd.contains(&socket) && !cmd.ends_with(" start ") {
            out.push(pid);
        }
    }
    out
}

async fn memory(node: &Node, pods: usize) -> Result<()> {
    let cri = Cri::connect(node.socket()).await?;
    println!("| shim | pods | shim processes | RSS per pod | PSS per pod |");
    println!("| --- | --- | --- | --- | --- |");
    let mut per_pod = Vec::new();
    for (handler, binary) in [
        (RUNC_HANDLER, "containerd-shim-runc-v2"),
        (GPU_CKPT_HANDLER, "containerd-shim-gpu-ckpt-v1"),
    ] {
        let mut running = Vec::new();
        for i in 0..pods {
            let spec =
                PodSpec::new(&format!("mem-{handler}-{i}"), node.pod_log_root()).handler(handler);
            let pod = cri.run_pod(&spec).await?;
            let c = ContainerSpec::new("counter", WORKLOADS_IMAGE).command(&[
                "/bin/counter",
                "--interval-ms",
                "1000",
            ]);
            cri.run_container(&pod, &c).await?;
            running.push(pod);
        }
        // Let the shims settle after their start-up allocations.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let pids = shims(binary, node.socket());
        let (mut rss, mut pss) = (0, 0);
        for p in &pids {
            let (r, s) = rss_pss(*p)?;
            rss += r;
            pss += s;
        }
        let per = |kib: u64| kib as f64 / pods as f64 / 1024.0;
        println!(
            "| {binary} | {pods} | {} | {:.2} MiB | {:.2} MiB |",
            pids.len(),
            per(rss),
            per(pss)
        );
        per_pod.push((per(rss), per(pss)));
        for pod in &running {
            cri.remove_pod(pod).await?;
        }
    }
    println!(
        "\nmemory ratio (gpu-ckpt / runc-v2): RSS {:.3}, PSS {:.3}",
        per_pod[1].0 / per_pod[0].0,
        per_pod[1].1 / per_pod[0].1
    );
    Ok(())
}
