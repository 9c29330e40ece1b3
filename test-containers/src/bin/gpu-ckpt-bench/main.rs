//! Benchmarks gpu-ckpt's shim side by side with containerd's own `containerd-shim-runc-v2`, in
//! one run on one private containerd node, and prints the figures as Markdown.
//!
//! - `lifecycle`: create-start-wait-delete of a trivial container (`ctr run --rm … /bin/true`),
//!   N times per runtime, interleaved so both see the same machine; ratio of medians.
//! - `memory`: N pods (sandbox plus one container) per handler through CRI; resident memory
//!   (RSS and PSS) of the shim processes per pod.
//! - `checkpoint`: checkpoint and restore of a memhog through gpu-ckpt, through runc-v2, and
//!   with runc alone on a bundle with containerd's spec for the same container (network
//!   namespace included) over the same image, and with runc alone plus the hashing gpu-ckpt
//!   does (what integrity costs without the shim); the first path rotates per round, and dirty
//!   pages are written back before each timed step.
//! - `freeze`: how long a CRI CheckpointContainer keeps the application from running (the
//!   longest gap between its log ticks), next to CRIU's own frozen time.
//! - `gpu`: lock + checkpoint + restore + unlock of a gpu-fill's device memory on a simulated
//!   node (the gpu crate's `CudaDriver`, in this process), next to copying the same bytes out
//!   and back through a pipe. Needs no containerd: it starts only the simulated node.
//! - `device-container`: on a node with one simulated GPU, checkpoint and restore through the
//!   shim (ctr and the containerd API) of a container holding N GiB of device memory (gpu-fill)
//!   against one holding N GiB of host memory (memhog), and the CRI freeze of each, next to
//!   runc-v2's freeze of the host-memory one; with where the time went, from the shim's spans.
//! - `freeze-resume`: the CRI freeze of a GPU pod with `gpu-ckpt.io/resume-after-dump` and
//!   without it, each over the sum of its device steps and CRIU's dump (`freeze_resume.rs`).
//! - `host-memory` (host_memory.rs): gpu-ckpt's synced checkpoint of a memhog against
//!   runc-v2's, and the restore of the same images through each, read from the disk.
//! - `device-storage` (device_storage.rs): device checkpoint and restore through the shim at
//!   each size, by custom storage and by the staged path, and of 1, 2, 4 GPU processes, against
//!   the storage's own O_DIRECT speed in the same directory.
//! - `nccl` (nccl.rs): the checkpoint and restore of a 4-rank NCCL job under gpu-ckpt's
//!   communicator layer: what its quiesce, release and rebuild take against the same run's
//!   device steps.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

mod freeze_resume;
use clap::{Parser, Subcommand};

mod device_storage;
mod host_memory;
mod nccl;
use test_containers::{
    containerd::{Containerd, EventStream},
    cri::{ContainerSpec, Cri, PodSpec},
    stack::{
        read_images_json, Node, NodeBuilder, Registry, Stack, GPU_CKPT_HANDLER,
        GPU_WORKLOADS_IMAGE, RUNC_HANDLER, WORKLOADS_IMAGE,
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
    /// Checkpoint and restore of a memory workload: gpu-ckpt vs runc-v2 vs raw runc.
    Checkpoint {
        #[arg(long, default_value_t = 1024)]
        mib: u64,
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
    /// What signing and the restore checks cost: gpu-ckpt's checkpoint and restore signed and
    /// checked vs unsigned (`SignCheckpoints = false`, `AllowUnsigned = true`), side by side.
    Trust {
        #[arg(long, default_value_t = 1024)]
        mib: u64,
        #[arg(long, default_value_t = 5)]
        runs: usize,
    },
    /// What crash safety costs: gpu-ckpt's `--image-path` checkpoint synced (the default) vs
    /// `SyncCheckpoint = false`, side by side.
    Sync {
        #[arg(long, default_value_t = 1024)]
        mib: u64,
        #[arg(long, default_value_t = 5)]
        runs: usize,
    },
    /// How long a CRI CheckpointContainer freezes the application, gpu-ckpt vs runc-v2.
    Freeze {
        #[arg(long, default_value_t = 512)]
        mib: u64,
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
    /// Host memory: gpu-ckpt's synced checkpoint vs runc-v2's, and the restore of gpu-ckpt's
    /// images through each, read from the disk; with a runc-v2 control pair.
    HostMemory {
        #[arg(long, default_value_t = 1024)]
        mib: u64,
        #[arg(long, default_value_t = 5)]
        runs: usize,
    },
    /// Device memory through the simulated driver's checkpoint and restore vs a pipe.
    Gpu {
        #[arg(long, default_value_t = 1)]
        gib: u64,
        #[arg(long, default_value_t = 12)]
        rounds: usize,
        /// The pipe's capacity in KiB (F_SETPIPE_SZ); 0: the system's default (64 KiB).
        #[arg(long, default_value_t = 0)]
        pipe_kib: usize,
    },
    /// A container holding device memory (gpu-fill on a simulated GPU) against one holding as
    /// much host memory (memhog), through gpu-ckpt: checkpoint, restore and CRI freeze.
    DeviceContainer {
        #[arg(long, default_value_t = 1)]
        gib: u64,
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
    /// The CRI freeze of a GPU pod with `gpu-ckpt.io/resume-after-dump` and without it, each
    /// against the sum of its device steps and CRIU's dump.
    FreezeResume {
        #[arg(long, default_value_t = 1024)]
        mib: u64,
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
    /// Device checkpoint and restore through gpu-ckpt at each size and simulated CUDA version
    /// (custom storage, staged), and of several GPU processes in one container, against the
    /// same bytes written and read with O_DIRECT in the same directory.
    DeviceStorage {
        /// GiB of device memory of the one-process cases.
        #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
        gib: Vec<u64>,
        /// GPU processes (one GPU each) of the parallel cases.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
        procs: Vec<usize>,
        /// GiB per process of the parallel cases.
        #[arg(long, default_value_t = 1)]
        proc_gib: u64,
        /// Simulated CUDA versions: 13050 has custom storage, 13000 the staged path.
        #[arg(long, value_delimiter = ',', default_value = "13050,13000")]
        cuda: Vec<i32>,
        #[arg(long, default_value_t = 1)]
        runs: usize,
    },
    /// The checkpoint and restore of 4 NCCL ranks (nccl_allreduce on 4 simulated GPUs) under
    /// the communicator layer: the NCCL steps (quiesce, release, rebuild) against the same
    /// run's device steps.
    Nccl {
        /// u32 elements of each buffer of each rank (three buffers per rank).
        #[arg(long, default_value_t = 1 << 20)]
        elements: u64,
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// What the layer's Release does (`NcclRelease`): destroy or suspend.
        #[arg(long, default_value = "destroy")]
        release: String,
    },
}

fn main() -> Result<()> {
    let args = Args::parse();
    match args.what {
        What::Gpu {
            gib,
            rounds,
            pipe_kib,
        } => return device_bench::bench(gib, rounds, pipe_kib),
        What::DeviceContainer { gib, runs } => return device_container(gib, runs),
        What::FreezeResume { mib, runs } => return freeze_resume::bench(mib, runs),
        What::Nccl {
            elements,
            runs,
            release,
        } => return nccl::bench(elements, runs, &release),
        What::DeviceStorage {
            gib,
            procs,
            proc_gib,
            cuda,
            runs,
        } => {
            return device_storage::bench(device_storage::Opts {
                sizes: gib,
                procs,
                proc_gib,
                cuda,
                runs,
            })
        }
        _ => {}
    }
    let stack = Stack::discover()?;
    let node = start_node(&stack, Node::builder_on(&stack, "bench").log_level("info"))?;
    match args.what {
        What::Lifecycle { n } => lifecycle(&node, n),
        What::Memory { pods } => tokio::runtime::Runtime::new()?.block_on(memory(&node, pods)),
        What::Checkpoint { mib, runs } => {
            tokio::runtime::Runtime::new()?.block_on(checkpoint(&node, mib, runs))
        }
        What::Trust { mib, runs } => {
            tokio::runtime::Runtime::new()?.block_on(trust(&node, mib, runs))
        }
        What::Freeze { mib, runs } => {
            tokio::runtime::Runtime::new()?.block_on(freeze(&node, mib, runs))
        }
        What::Sync { mib, runs } => sync_cost(&node, mib, runs),
        What::HostMemory { mib, runs } => {
            tokio::runtime::Runtime::new()?.block_on(host_memory::bench(&node, mib, runs))
        }
        What::Gpu { .. }
        | What::DeviceContainer { .. }
        | What::FreezeResume { .. }
        | What::DeviceStorage { .. }
        | What::Nccl { .. } => {
            unreachable!("run before the node is started")
        }
    }
}

/// Starts the node `builder` describes, with the registry running and the test images pushed
/// and imported into the "default" namespace.
fn start_node(stack: &Stack, builder: NodeBuilder) -> Result<Node> {
    let registry = Registry::ensure_running(stack)?;
    let node = builder.start()?;
    registry.push_images(&node)?;
    for img in read_images_json(&stack.images_dir())? {
        node.import_image(&img.tar, "default")?;
    }
    Ok(node)
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

fn median(v: impl IntoIterator<Item = Duration>) -> Duration {
    let mut v: Vec<Duration> = v.into_iter().collect();
    v.sort();
    v[v.len() / 2]
}

/// The median of `v` (the upper one for an even count); NaN when empty.
fn median_f64(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// A 95% interval for the median of `v`: the 2.5th and 97.5th percentiles of the medians of
/// 4000 resamples of `v` with replacement (percentile bootstrap). The generator has a fixed
/// seed, so the interval is a function of the figures alone.
fn median_interval(v: &[f64]) -> (f64, f64) {
    const RESAMPLES: usize = 4000;
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    // splitmix64: small, and good enough to pick indices.
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut medians: Vec<f64> = (0..RESAMPLES)
        .map(|_| {
            median_f64(
                (0..v.len())
                    .map(|_| v[(next() % v.len() as u64) as usize])
                    .collect(),
            )
        })
        .collect();
    medians.sort_by(f64::total_cmp);
    (
        medians[RESAMPLES * 25 / 1000],
        medians[RESAMPLES * 975 / 1000 - 1],
    )
}

/// How path `a` compares with path `b`, their figures paired by round (or run).
struct Paired {
    /// The ratio of the medians.
    of_medians: f64,
    /// The median of the per-round ratios a/b, and its 95% interval.
    per_round: f64,
    interval: (f64, f64),
}

fn paired(a: &[f64], b: &[f64]) -> Paired {
    let ratios: Vec<f64> = a.iter().zip(b).map(|(x, y)| x / y).collect();
    Paired {
        of_medians: median_f64(a.to_vec()) / median_f64(b.to_vec()),
        interval: median_interval(&ratios),
        per_round: median_f64(ratios),
    }
}

/// The order in which `n` paths run in round `round`: the rows of a Williams design, a Latin
/// square in which every path runs right after every other path equally often (for an even
/// `n`, once in every `n` rounds; for an odd `n`, twice in every `2n`, the second `n`
/// reversed), and takes each place in the round equally often. A rotation (path
/// `(round + k) % n` in place `k`) gives every path the same predecessor within every round;
/// on the benchmark machine the place alone moved the CRI freeze by 0.08 s (the first of a
/// pair against the second), more than the differences being measured.
fn round_order(round: usize, n: usize) -> Vec<usize> {
    let r = round % n;
    let mut order: Vec<usize> = (0..n)
        .map(|j| {
            // Offsets 0, 1, n-1, 2, n-2, ...
            let offset = if j % 2 == 1 { j.div_ceil(2) } else { n - j / 2 };
            (r + offset) % n
        })
        .collect();
    if n % 2 == 1 && (round / n) % 2 == 1 {
        order.reverse();
    }
    order
}

/// `ctr run` flags for runc-v2 and for gpu-ckpt. runc-v2 gets its private runc root and binary
/// from ctr's runc flags (ctr sends them only to the runc shim); ours picks its defaults.
fn runtime_flags(node: &Node) -> (Vec<String>, Vec<String>) {
    let mut runc = vec!["--runtime".to_string(), "io.containerd.runc.v2".to_string()];
    runc.extend(node.ctr_run_flags());
    let ours = vec![
        "--runtime".to_string(),
        "io.containerd.gpu-ckpt.v1".to_string(),
        "--fifo-dir".to_string(),
        node.paths().fifo_dir.display().to_string(),
    ];
    (runc, ours)
}

fn lifecycle(node: &Node, n: usize) -> Result<()> {
    let (runc_flags, ours) = runtime_flags(node);
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
    let (ma, mb) = (median(a.iter().copied()), median(b.iter().copied()));
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
    let rollup = procfs::process::Process::new(pid)
        .and_then(|p| p.smaps_rollup())
        .with_context(|| format!("smaps_rollup of {pid}"))?;
    let map = rollup.memory_map_rollup.0.first().map(|m| &m.extension.map);
    let field = |name: &str| map.and_then(|m| m.get(name)).map_or(0, |b| b >> 10);
    Ok((field("Rss"), field("Pss")))
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
        let pids = node.shim_processes(binary);
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

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Gets the machine into the same state before every timed step, whichever path takes it:
/// - writes back every dirty page, so that no path pays for the writeback of what an earlier
///   round wrote (each round writes its whole checkpoint into the page cache);
/// - then fills `mib` MiB of page cache in `dir` and frees it at once, so that the step's own
///   allocations (CRIU's images at a checkpoint, the process's memory at a restore) reuse
///   memory that was just in use. On a VM whose balloon device reports free pages to the
///   host, memory that has been free for a few seconds goes back to the host, and taking it
///   again costs the guest kernel several times the work: 1 GiB written into the page cache
///   took 0.96–2.8 s after 5–20 s idle on the benchmark machine, 0.18–0.26 s right
///   after such a fill. Which path met cold memory was chance, and it moved single rounds by 2x.
fn settle(dir: &Path, mib: u64) -> Result<()> {
    nix::unistd::sync();
    let path = dir.join("bench-warm-memory");
    let chunk = vec![0u8; 1 << 20];
    let fill = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&path)?;
        for _ in 0..mib {
            std::io::Write::write_all(&mut f, &chunk)?;
        }
        Ok(())
    })();
    // Unlinked before writeback: the dirty pages are dropped, not written.
    let _ = std::fs::remove_file(&path);
    fill.with_context(|| format!("fill {}", path.display()))
}

/// How much memory to warm before a step that handles `mib` MiB of process memory.
fn warm_mib(mib: u64) -> u64 {
    mib + mib / 2
}

/// Waits until a memhog has filled its memory and verified it once.
fn wait_filled(status: &Path) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if std::fs::read_to_string(status).is_ok_and(|s| s.contains("verified pass")) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("memhog did not fill its memory ({})", status.display());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A workload of a ctr checkpoint and restore ([`shim_round`]): how ctr runs it, when it is
/// ready for the checkpoint, and how a restored one shows that its memory is intact.
struct CtrApp {
    /// `ctr run` flags after the runtime's: devices, mounts.
    flags: Vec<String>,
    image: &'static str,
    args: Vec<String>,
    /// MiB of memory to warm before each timed step ([`settle`]).
    warm_mib: u64,
    kind: AppKind,
    /// Whether a restored one is checked ([`CtrApp::check`]) before it is removed.
    check_restored: bool,
}

#[derive(Clone, Copy)]
enum AppKind {
    /// A memhog with `--status-file /status.txt` ([`memhog_args`]).
    Memhog,
    /// A gpu-fill of `bytes` writing its output to [`APP_LOG`] (on [`OUT_TMPFS`]), its GPU a
    /// CDI device: ctr runs through [`Node::ctr_cdi`].
    GpuFill { bytes: u64 },
}

/// A tmpfs at /out for a ctr container's output: ctr's `--log-uri file://` does not survive a
/// gpu-ckpt checkpoint, a tmpfs's files travel with the process (CRIU dumps them).
const OUT_TMPFS: &str = "type=tmpfs,src=tmpfs,dst=/out,options=rw:size=16m";
/// Where a ctr container's workload logs, below its root.
const APP_LOG: &str = "out/app.log";

impl CtrApp {
    /// The checkpoint bench's memhog of `mib` MiB.
    fn memhog(mib: u64) -> CtrApp {
        CtrApp {
            flags: Vec::new(),
            image: WORKLOADS_IMAGE,
            args: memhog_args(mib),
            warm_mib: warm_mib(mib),
            kind: AppKind::Memhog,
            check_restored: false,
        }
    }

    /// A gpu-fill of `gib` GiB on simulated GPU 0, checked after the restore. Its steps put
    /// twice its device memory into fresh host memory: at a checkpoint the staged copy in the
    /// process and CRIU's images of it, at a restore the process's pages and the device's.
    fn gpu_fill(gib: u64) -> CtrApp {
        CtrApp {
            flags: [
                "--device",
                &format!("{}=0", simgpu::cdi::KIND),
                "--mount",
                OUT_TMPFS,
            ]
            .map(String::from)
            .to_vec(),
            image: GPU_WORKLOADS_IMAGE,
            args: [
                "/bin/sh",
                "-c",
                &format!(
                    "exec {} > /{APP_LOG} 2>&1",
                    gpu_fill_args(gib, None).join(" ")
                ),
            ]
            .map(String::from)
            .to_vec(),
            warm_mib: warm_mib(2 * gib * 1024),
            kind: AppKind::GpuFill { bytes: gib << 30 },
            check_restored: true,
        }
    }

    /// `ctr <args>` on `node`, through [`Node::ctr_cdi`] when the workload has a CDI device.
    fn ctr(&self, node: &Node, args: &[&str]) -> Result<()> {
        if matches!(self.kind, AppKind::Memhog) {
            return node.ctr_ok(args).map(drop);
        }
        let out = node.ctr_cdi("default", args)?;
        if !out.status.success() {
            bail!(
                "ctr {}: {}{}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr),
                String::from_utf8_lossy(&out.stdout)
            );
        }
        Ok(())
    }

    /// Waits until the workload in host process `pid` has filled its memory (a memhog: and
    /// verified it once).
    fn ready(&self, pid: i32) -> Result<()> {
        match self.kind {
            AppKind::Memhog => wait_filled(&memhog_status(pid)),
            AppKind::GpuFill { .. } => wait_text(&app_log(pid), "gpu-fill to fill", |log| {
                gpu_fill_failed(log)?;
                Ok(log.lines().any(|l| l.starts_with("filled ")).then_some(()))
            }),
        }
    }

    /// Where the workload is before the checkpoint: a memhog's last verification pass, the
    /// number of gpu-fill's verifications.
    fn mark(&self, pid: i32) -> Result<u64> {
        match self.kind {
            AppKind::Memhog => Ok(memhog_pass(&std::fs::read_to_string(memhog_status(pid))?)),
            AppKind::GpuFill { .. } => {
                Ok(gpu_fill_verified(&std::fs::read_to_string(app_log(pid))?).count() as u64)
            }
        }
    }

    /// Checks the restored workload in host process `pid` (`mark` from before the checkpoint):
    /// a memhog verifies all its memory in a pass that began after the restore (the second
    /// after `mark`: the first may have begun before the checkpoint); gpu-fill is asked
    /// (SIGUSR1) and verifies every byte of its device memory. Returns its verdict.
    fn check(&self, pid: i32, mark: u64) -> Result<String> {
        match self.kind {
            AppKind::Memhog => wait_text(&memhog_status(pid), "memhog to verify", |s| {
                if s.contains("CORRUPT") {
                    bail!("restored memhog: {}", s.trim());
                }
                Ok((memhog_pass(s) >= mark + 2).then(|| s.trim().to_string()))
            }),
            AppKind::GpuFill { bytes } => {
                // SAFETY: a signal to the restored workload's process.
                if unsafe { libc::kill(pid, libc::SIGUSR1) } != 0 {
                    bail!("kill -USR1 {pid}: {}", std::io::Error::last_os_error());
                }
                let want = format!("verified {bytes} bytes");
                wait_text(&app_log(pid), "gpu-fill to verify", |log| {
                    gpu_fill_failed(log)?;
                    let done: Vec<&str> = gpu_fill_verified(log).collect();
                    match done.get(mark as usize) {
                        Some(l) if *l == want => Ok(Some(l.to_string())),
                        Some(l) => bail!("restored gpu-fill: {l}"),
                        None => Ok(None),
                    }
                })
            }
        }
    }
}

/// gpu-fill's arguments: `gib` GiB on GPU 0, a fixed seed, ticks every `tick_ms`.
fn gpu_fill_args(gib: u64, tick_ms: Option<u64>) -> Vec<String> {
    let mut v: Vec<String> = [
        "/usr/bin/gpu-fill",
        "--gib",
        &gib.to_string(),
        "--devices",
        "0",
        "--seed",
        "7",
    ]
    .map(String::from)
    .to_vec();
    if let Some(ms) = tick_ms {
        v.extend(["--tick-ms".to_string(), ms.to_string()]);
    }
    v
}

fn memhog_status(pid: i32) -> std::path::PathBuf {
    format!("/proc/{pid}/root/status.txt").into()
}

fn app_log(pid: i32) -> std::path::PathBuf {
    format!("/proc/{pid}/root/{APP_LOG}").into()
}

/// The pass number in a memhog's status (`verified pass <k> …`); 0 before the first.
fn memhog_pass(status: &str) -> u64 {
    status
        .trim()
        .strip_prefix("verified pass ")
        .and_then(|r| r.split(' ').next()?.parse().ok())
        .unwrap_or(0)
}

/// gpu-fill's verdicts in its log, in order (`verified …` or `MISMATCH …`).
fn gpu_fill_verified(log: &str) -> impl Iterator<Item = &str> {
    log.lines()
        .filter(|l| l.starts_with("verified ") || l.starts_with("MISMATCH"))
}

/// An error line of gpu-fill's (`gpu-fill: …`: a driver error, it exited).
fn gpu_fill_failed(log: &str) -> Result<()> {
    match log.lines().find(|l| l.starts_with("gpu-fill: ")) {
        Some(l) => bail!("{l}"),
        None => Ok(()),
    }
}

/// Polls the file `path` until `done` says it holds what is awaited (or fails); 300 s at most.
fn wait_text<T>(
    path: &Path,
    what: &str,
    mut done: impl FnMut(&str) -> Result<Option<T>>,
) -> Result<T> {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if let Some(v) = done(&text)? {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out waiting for {what} ({}): {text}", path.display());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One [`shim_round`].
struct ShimRound {
    checkpoint: Duration,
    restore: Duration,
    /// The restored workload's verdict ([`CtrApp::check`]), when checked.
    intact: Option<String>,
}

/// One checkpoint (`ctr task checkpoint --exit --image-path`) and restore (containerd API,
/// `CriuImagePath`) of `app` through a shim; both timed.
async fn shim_round(
    node: &Node,
    api: &Containerd,
    flags: &[String],
    id: &str,
    app: &CtrApp,
) -> Result<ShimRound> {
    let mut args: Vec<&str> = vec!["run", "-d"];
    args.extend(flags.iter().map(String::as_str));
    args.extend(app.flags.iter().map(String::as_str));
    args.extend([app.image, id]);
    args.extend(app.args.iter().map(String::as_str));
    app.ctr(node, &args)?;
    let pid = node.task_pid(id)?;
    app.ready(pid)?;
    // An earlier round's directory goes before the writeback, not inside the timed step.
    let dir = node.paths().dir.join(format!("bench-{id}"));
    let _ = std::fs::remove_dir_all(&dir);
    settle(node.paths().dir.as_path(), app.warm_mib)?;
    let mark = app.mark(pid)?;
    let t = Instant::now();
    node.checkpoint_task_exit(id, &dir)?;
    let ckpt = t.elapsed();
    // gpu-ckpt's manifest records its steps: printed per round, to stderr.
    if let Ok(m) = image_format::manifest::Manifest::read_from(&dir) {
        let steps: Vec<String> = m
            .timings
            .iter()
            .map(|t| format!("{} {:.0} ms", t.step, t.millis))
            .collect();
        eprintln!(
            "{id}: checkpoint {:.2} s ({})",
            secs(ckpt),
            steps.join(", ")
        );
    }
    node.ctr_ok(&["task", "rm", id])?;
    settle(node.paths().dir.as_path(), app.warm_mib)?;
    let t = Instant::now();
    let restored = api.restore_from_image_path(id, &dir).await?;
    let restore = t.elapsed();
    let intact = app
        .check_restored
        .then(|| app.check(restored as i32, mark))
        .transpose();
    node.ctr(&["task", "kill", "-s", "SIGKILL", id])?;
    std::thread::sleep(Duration::from_millis(300));
    node.ctr(&["task", "rm", id])?;
    node.ctr(&["container", "rm", id])?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(ShimRound {
        checkpoint: ckpt,
        restore,
        intact: intact.with_context(|| format!("{id}: the restored workload"))?,
    })
}

/// Runs a memhog of `mib` MiB as container `id` through gpu-ckpt, whose options are `options`
/// (written to the TOML file `config`, ctr run `--runtime-config-path`), waits until it has
/// filled its memory, and times one `ctr task checkpoint --exit --image-path` of it into
/// `bench-<id>` below the node's directory. Every dirty page is written back first ([`settle`]),
/// so that each path pays for its own checkpoint only. Returns the directory and the time.
fn configured_checkpoint(
    node: &Node,
    config: &Path,
    options: &str,
    id: &str,
    mib: u64,
) -> Result<(PathBuf, Duration)> {
    std::fs::write(config, format!("{options}\n"))?;
    let (_, mut flags) = runtime_flags(node);
    flags.extend(["--runtime-config-path".into(), config.display().to_string()]);
    let memhog = memhog_args(mib);
    let mut args: Vec<&str> = vec!["run", "-d"];
    args.extend(flags.iter().map(String::as_str));
    args.extend([WORKLOADS_IMAGE, id]);
    args.extend(memhog.iter().map(String::as_str));
    node.ctr_ok(&args)?;
    let pid = node.task_pid(id)?;
    wait_filled(Path::new(&format!("/proc/{pid}/root/status.txt")))?;
    let dir = node.paths().dir.join(format!("bench-{id}"));
    let _ = std::fs::remove_dir_all(&dir);
    settle(node.paths().dir.as_path(), warm_mib(mib))?;
    let t = Instant::now();
    node.checkpoint_task_exit(id, &dir)?;
    Ok((dir, t.elapsed()))
}

/// One checkpoint (`ctr task checkpoint --exit`) and restore (containerd API) of a memhog of
/// `mib` MiB through gpu-ckpt, whose options are the TOML file `config` (ctr run
/// `--runtime-config-path`): `options` at the checkpoint, then `options` and `CriuImagePath`
/// at the restore.
async fn trust_round(
    node: &Node,
    api: &Containerd,
    config: &Path,
    options: &str,
    id: &str,
    mib: u64,
) -> Result<(Duration, Duration)> {
    let (dir, ckpt) = configured_checkpoint(node, config, options, id, mib)?;
    let signed = image_format::manifest::Manifest::read_from(&dir)
        .map(|m| m.signature.is_some())
        .unwrap_or(false);
    anyhow::ensure!(
        signed == options.is_empty(),
        "{id}: signed is {signed} with options {options:?}: the options file did not reach the shim"
    );
    node.ctr_ok(&["task", "rm", id])?;
    settle(node.paths().dir.as_path(), warm_mib(mib))?;
    std::fs::write(
        config,
        format!(
            "{options}\nCriuImagePath = {}\n",
            serde_json::to_string(&dir.display().to_string())?
        ),
    )?;
    let t = Instant::now();
    api.restore_from_image_path_with(id, None).await?;
    let restore = t.elapsed();
    eprintln!(
        "{id}: signed {signed}, checkpoint {:.2} s, restore {:.2} s",
        secs(ckpt),
        secs(restore)
    );
    node.ctr(&["task", "kill", "-s", "SIGKILL", id])?;
    std::thread::sleep(Duration::from_millis(300));
    node.ctr(&["task", "rm", id])?;
    node.ctr(&["container", "rm", id])?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok((ckpt, restore))
}

async fn trust(node: &Node, mib: u64, runs: usize) -> Result<()> {
    let api = Containerd::connect(node.socket(), "default").await?;
    let signed_conf = node.paths().dir.join("bench-signed.toml");
    let unsigned_conf = node.paths().dir.join("bench-unsigned.toml");
    // Each round writes its path's options into the path's file (trust_round).
    let paths = [
        ("signed + checked", signed_conf.as_path(), ""),
        (
            "unsigned (SignCheckpoints = false, AllowUnsigned = true)",
            unsigned_conf.as_path(),
            "SignCheckpoints = false\nAllowUnsigned = true",
        ),
    ];
    let mut times: [Vec<(Duration, Duration)>; 2] = Default::default();
    for i in 0..=runs {
        // The order alternates from round to round; round 0 warms up and is not counted.
        let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        for p in order {
            let (_, conf, toml) = paths[p];
            let round = trust_round(node, &api, conf, toml, &format!("t{p}-{i}"), mib).await?;
            if i > 0 {
                times[p].push(round);
            }
        }
    }
    let step = |v: &[(Duration, Duration)], restore: bool| -> Vec<f64> {
        v.iter()
            .map(|x| secs(if restore { x.1 } else { x.0 }))
            .collect()
    };
    println!("| gpu-ckpt ({mib} MiB memhog, {runs} rounds) | checkpoint median | restore median |");
    println!("| --- | --- | --- |");
    for (p, (label, _, _)) in paths.iter().enumerate() {
        println!(
            "| {label} | {:.3} s | {:.3} s |",
            median_f64(step(&times[p], false)),
            median_f64(step(&times[p], true))
        );
    }
    println!("\n| signed / unsigned | of medians | per round [95% interval] |");
    println!("| --- | --- | --- |");
    for (restore, what) in [(false, "checkpoint"), (true, "restore")] {
        let p = paired(&step(&times[0], restore), &step(&times[1], restore));
        let (lo, hi) = p.interval;
        println!(
            "| {what} | {:.3} | {:.3} [{lo:.3}–{hi:.3}] |",
            p.of_medians, p.per_round
        );
    }
    Ok(())
}

/// One `ctr task checkpoint --exit --image-path` of a memhog of `mib` MiB through gpu-ckpt,
/// whose options are `options` (the TOML file `config`, ctr run `--runtime-config-path`).
/// Returns the checkpoint's wall time and how many of the checkpoint's bytes were still dirty
/// in the page cache right after it (`Dirty:` in /proc/meminfo, for the whole machine).
fn sync_round(
    node: &Node,
    config: &Path,
    options: &str,
    id: &str,
    mib: u64,
) -> Result<(Duration, u64)> {
    let (dir, ckpt) = configured_checkpoint(node, config, options, id, mib)?;
    let dirty = dirty_bytes()?;
    eprintln!(
        "{id}: {options:?}: checkpoint {:.2} s, {} MiB dirty after it",
        secs(ckpt),
        dirty >> 20
    );
    node.ctr_ok(&["task", "rm", id])?;
    node.ctr(&["container", "rm", id])?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok((ckpt, dirty))
}

/// The host's dirty page cache in bytes (`Dirty:` of /proc/meminfo).
fn dirty_bytes() -> Result<u64> {
    use procfs::Current;
    Ok(procfs::Meminfo::current()
        .context("read /proc/meminfo")?
        .dirty)
}

/// The checkpoint with and without crash safety's syncs, side by side in one run; round 0
/// warms up and is not counted, the order alternates from round to round.
fn sync_cost(node: &Node, mib: u64, runs: usize) -> Result<()> {
    let conf = [
        node.paths().dir.join("bench-synced.toml"),
        node.paths().dir.join("bench-unsynced.toml"),
    ];
    let paths = [
        ("synced (default)", ""),
        (
            "not synced (SyncCheckpoint = false)",
            "SyncCheckpoint = false",
        ),
    ];
    let mut times: [Vec<f64>; 2] = Default::default();
    let mut dirty: [Vec<f64>; 2] = Default::default();
    for i in 0..=runs {
        let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        for p in order {
            let (d, left) = sync_round(node, &conf[p], paths[p].1, &format!("s{p}-{i}"), mib)?;
            if i > 0 {
                times[p].push(secs(d));
                dirty[p].push(left as f64 / (1 << 20) as f64);
            }
        }
    }
    println!(
        "| gpu-ckpt `--image-path` checkpoint ({mib} MiB memhog, {runs} rounds) | median | fastest | dirty MiB after it (median) |"
    );
    println!("| --- | --- | --- | --- |");
    for (p, (label, _)) in paths.iter().enumerate() {
        println!(
            "| {label} | {:.3} s | {:.3} s | {:.0} |",
            median_f64(times[p].clone()),
            fastest(&times[p]),
            median_f64(dirty[p].clone())
        );
    }
    println!("\n| synced / not synced | checkpoint: medians, per round [95% interval], fastest |");
    println!("| --- | --- |");
    println!("| ratio | {} |", ratio_cell(&times[0], &times[1]));
    Ok(())
}

/// The memhog's arguments, the same for every path.
fn memhog_args(mib: u64) -> Vec<String> {
    let mib = mib.to_string();
    [
        "/bin/memhog",
        "--mib",
        &mib,
        "--interval-ms",
        "500",
        "--status-file",
        "/status.txt",
    ]
    .map(String::from)
    .to_vec()
}

/// The OCI spec containerd generates for the memhog container (`ctr container create`, then
/// `ctr container info`): what both shims hand to runc, network namespace and all.
fn containerd_spec(node: &Node, id: &str, mib: u64) -> Result<serde_json::Value> {
    let mut args = vec!["container", "create", WORKLOADS_IMAGE, id];
    let memhog = memhog_args(mib);
    args.extend(memhog.iter().map(String::as_str));
    node.ctr_ok(&args)?;
    let info = node.ctr_ok(&["container", "info", id]);
    node.ctr_ok(&["container", "rm", id])?;
    let mut info: serde_json::Value = serde_json::from_str(&info?)?;
    Ok(info["Spec"].take())
}

/// Runs `step` with the hashing gpu-ckpt does around it, in another thread: at a checkpoint
/// (`follow`), the page images followed as CRIU appends them; at a restore, the page images
/// hashed while CRIU reads them. Returns when both are done.
fn with_page_hashing(dir: &Path, follow: bool, step: impl FnOnce() -> Result<()>) -> Result<()> {
    use image_format::{digest, manifest};
    let done = manifest::WriterDone::default();
    std::thread::scope(|scope| {
        let hasher = scope.spawn(|| -> Result<()> {
            if follow {
                let pages = digest::PageDigests::default();
                manifest::AppendHasher::new(dir, manifest::is_page_image, [].into(), pages)
                    .follow_until(&done, Duration::from_millis(10))?;
                return Ok(());
            }
            for e in std::fs::read_dir(dir)? {
                let name = e?.file_name();
                let name = name.to_string_lossy();
                if manifest::is_page_image(&name) {
                    let hasher = digest::FileHasher::recording(&name, Default::default());
                    digest::digest_file(&dir.join(&*name), hasher, &mut digest::no_progress)?;
                }
            }
            Ok(())
        });
        let stepped = step();
        done.set();
        let hashed = hasher
            .join()
            .map_err(|_| anyhow::anyhow!("page hashing thread panicked"))?;
        stepped?;
        hashed.context("hashing the page images")
    })
}

/// One checkpoint and restore of a memhog with runc alone, on a bundle with containerd's spec
/// for the same container, over the image's rootfs; with `hashing`, around each step the
/// hashing gpu-ckpt does ([`with_page_hashing`]).
fn raw_round(node: &Node, id: &str, mib: u64, hashing: bool) -> Result<(Duration, Duration)> {
    let base = node.paths().dir.join(format!("raw-{id}"));
    let _ = std::fs::remove_dir_all(&base);
    let rootfs = base.join("rootfs");
    std::fs::create_dir_all(&rootfs)?;
    let rootfs_s = rootfs.display().to_string();
    let mut spec = containerd_spec(node, id, mib)?;
    spec["root"]["path"] = rootfs_s.clone().into();
    spec["linux"]["cgroupsPath"] = format!("/gpu-ckpt-bench/{id}").into();
    node.ctr_ok(&["images", "mount", "--rw", WORKLOADS_IMAGE, &rootfs_s])?;
    let result = (|| -> Result<(Duration, Duration)> {
        std::fs::write(base.join("config.json"), serde_json::to_vec(&spec)?)?;
        let root = base.join("runc-root").display().to_string();
        // runc's own errors go to a file. A detached container inherits runc's stdio, and CRIU
        // can dump a container whose stdio are pipes (runc maps them again at restore), not a
        // host file: `run` and `restore` get pipes, held open here until the round is over.
        let errors = base.join("runc.err");
        let mut held: Vec<Box<dyn std::any::Any>> = Vec::new();
        let mut runc = |args: &[&str], container_stdio: bool| -> Result<()> {
            let mut cmd = std::process::Command::new("/usr/sbin/runc");
            cmd.arg("--root")
                .arg(&root)
                .args(args)
                .current_dir(&base)
                .env("PATH", node.stack().path_env())
                .stdin(std::process::Stdio::null());
            if container_stdio {
                cmd.stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped());
            } else {
                cmd.stdout(std::process::Stdio::null())
                    .stderr(std::fs::File::create(&errors)?);
            }
            let mut child = cmd.spawn()?;
            let stdout = child.stdout.take();
            let mut stderr = child.stderr.take();
            let status = child.wait()?;
            if !status.success() {
                let mut msg = std::fs::read_to_string(&errors).unwrap_or_default();
                if let Some(e) = stderr.as_mut() {
                    let _ = std::io::Read::read_to_string(e, &mut msg);
                }
                bail!("runc {}: {msg}", args.join(" "));
            }
            held.push(Box::new((stdout, stderr)));
            Ok(())
        };
        let bundle = base.display().to_string();
        runc(&["run", "-d", "--bundle", &bundle, id], true)?;
        wait_filled(&rootfs.join("status.txt"))?;
        let image = base.join("image");
        let dir = image.display().to_string();
        let mut timed = |follow: bool, args: &[&str], container_stdio: bool| -> Result<Duration> {
            settle(&base, warm_mib(mib))?;
            let t = Instant::now();
            if hashing {
                with_page_hashing(&image, follow, || runc(args, container_stdio))?;
            } else {
                runc(args, container_stdio)?;
            }
            Ok(t.elapsed())
        };
        let ckpt = timed(true, &["checkpoint", "--image-path", &dir, id], false)?;
        let restore = timed(
            false,
            &[
                "restore",
                "-d",
                "--bundle",
                &bundle,
                "--image-path",
                &dir,
                id,
            ],
            true,
        )?;
        runc(&["delete", "--force", id], false)?;
        Ok((ckpt, restore))
    })();
    let _ = node.ctr(&["images", "unmount", &rootfs_s]);
    let _ = std::fs::remove_dir_all(&base);
    result
}

async fn checkpoint(node: &Node, mib: u64, runs: usize) -> Result<()> {
    let api = Containerd::connect(node.socket(), "default").await?;
    let (runc_flags, ours) = runtime_flags(node);
    // Per path: (checkpoint, restore) of every round. The order of the paths changes from
    // round to round ([`round_order`]), so that none always meets the machine in the same
    // state or right after the same other path; a multiple of 10 rounds balances it fully.
    // Round 0 warms every path up and is not counted: the first checkpoint after the node
    // starts has measured up to twice as slow, whichever path takes it.
    // The fifth path is raw runc once more, under other container names: the control. Its ratio
    // to raw runc should be 1, and how far it is from 1 shows what this run's noise does to a
    // ratio.
    let names = [
        "gpu-ckpt",
        "runc-v2",
        "raw runc",
        "raw runc + hashing",
        "raw runc (control)",
    ];
    let mut times: [Vec<(Duration, Duration)>; 5] = Default::default();
    for i in 0..=runs {
        for path in round_order(i.saturating_sub(1), names.len()) {
            let memhog = CtrApp::memhog(mib);
            let round = match path {
                0 => shim_round(node, &api, &ours, &format!("g{i}"), &memhog)
                    .await
                    .map(|r| (r.checkpoint, r.restore))?,
                1 => shim_round(node, &api, &runc_flags, &format!("r{i}"), &memhog)
                    .await
                    .map(|r| (r.checkpoint, r.restore))?,
                2 => raw_round(node, &format!("w{i}"), mib, false)?,
                3 => raw_round(node, &format!("h{i}"), mib, true)?,
                _ => raw_round(node, &format!("c{i}"), mib, false)?,
            };
            eprintln!(
                "round {i}{} {}: checkpoint {:.2} s, restore {:.2} s",
                if i == 0 { " (warm-up)" } else { "" },
                names[path],
                secs(round.0),
                secs(round.1)
            );
            if i > 0 {
                times[path].push(round);
            }
        }
    }
    // One figure per step: [checkpoint, restore].
    type Rounds = [(Duration, Duration)];
    let step = |v: &Rounds, restore: bool| -> Vec<f64> {
        v.iter()
            .map(|x| secs(if restore { x.1 } else { x.0 }))
            .collect()
    };
    let med = median_f64;
    let both = |f: &dyn Fn(bool) -> f64| [f(false), f(true)];
    println!(
        "| path ({mib} MiB memhog, {runs} rounds) | checkpoint median | restore median | checkpoint fastest | restore fastest |"
    );
    println!("| --- | --- | --- | --- | --- |");
    let rows = [
        (2, "raw `runc checkpoint` / `runc restore`"),
        (3, "raw runc + gpu-ckpt's page hashing"),
        (1, "containerd-shim-runc-v2 (ctr / API)"),
        (0, "containerd-shim-gpu-ckpt-v1 (ctr / API)"),
        (4, "raw runc again (control)"),
    ];
    for (p, label) in rows {
        let [mc, mr] = both(&|r| med(step(&times[p], r)));
        let [fc, fr] = both(&|r| fastest(&step(&times[p], r)));
        println!("| {label} | {mc:.2} s | {mr:.2} s | {fc:.2} s | {fr:.2} s |");
    }
    // Three views of each ratio: of the medians; the median of the ratios within each round
    // (a round's paths ran back to back, so drift of the machine between rounds cancels out),
    // with its 95% interval; of the fastest rounds (noise on a shared VM only ever adds time,
    // so each path's fastest round is the closest to its own cost).
    println!("\n| gpu-ckpt / baseline | checkpoint: medians, per round [95% interval], fastest | restore: medians, per round [95% interval], fastest |");
    println!("| --- | --- | --- |");
    let cell = |path: usize, base: usize, restore: bool| {
        ratio_cell(&step(&times[path], restore), &step(&times[base], restore))
    };
    for (p, label) in &rows[..3] {
        println!(
            "| {label} | {} | {} |",
            cell(0, *p, false),
            cell(0, *p, true)
        );
    }
    println!(
        "| control: raw runc again / raw runc | {} | {} |",
        cell(4, 2, false),
        cell(4, 2, true)
    );
    Ok(())
}

/// The fastest of `v` (noise on a shared VM only ever adds time); NaN when empty.
fn fastest(v: &[f64]) -> f64 {
    v.iter().copied().reduce(f64::min).unwrap_or(f64::NAN)
}

/// `a` against `b`, paired by round: the ratio of the medians, the median of the per-round
/// ratios with its 95% interval, and the ratio of the fastest rounds.
fn ratio_cell(a: &[f64], b: &[f64]) -> String {
    let p = paired(a, b);
    let (lo, hi) = p.interval;
    format!(
        "{:.3}, {:.3} [{lo:.3}–{hi:.3}], {:.3}",
        p.of_medians,
        p.per_round,
        fastest(a) / fastest(b)
    )
}

/// `a` against `b`, paired by run: the ratio of the medians, the median of the per-run ratios
/// with its 95% interval.
fn ratio_line(a: &[f64], b: &[f64]) -> String {
    let p = paired(a, b);
    let (lo, hi) = p.interval;
    format!(
        "medians {:.3}, per run {:.3} [95% interval {lo:.3}–{hi:.3}]",
        p.of_medians, p.per_round
    )
}

/// Timestamps of a CRI container log's lines.
fn log_times(path: &Path) -> Vec<std::time::SystemTime> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| humantime::parse_rfc3339(l.split(' ').next()?).ok())
        .collect()
}

/// The longest gap between two log lines in `[from, to]`.
fn longest_gap(
    times: &[std::time::SystemTime],
    from: std::time::SystemTime,
    to: std::time::SystemTime,
) -> Duration {
    times
        .windows(2)
        .filter(|w| w[1] >= from && w[0] <= to)
        .filter_map(|w| w[1].duration_since(w[0]).ok())
        .max()
        .unwrap_or_default()
}

async fn freeze(node: &Node, mib: u64, runs: usize) -> Result<()> {
    let cri = Cri::connect(node.socket()).await?;
    let api = Containerd::connect(node.socket(), "k8s.io").await?;
    // The third is runc-v2 once more: the control, whose ratio to runc-v2 shows what this run's
    // noise alone does to a ratio.
    let shims = [
        (RUNC_HANDLER, "containerd-shim-runc-v2"),
        (GPU_CKPT_HANDLER, "containerd-shim-gpu-ckpt-v1"),
        (RUNC_HANDLER, "containerd-shim-runc-v2 again (control)"),
    ];
    // Per shim, every run's figures. The order changes from run to run ([`round_order`]); a
    // multiple of 6 runs balances it fully.
    let mut times: [Vec<Freeze>; 3] = Default::default();
    for i in 0..runs {
        for which in round_order(i, shims.len()) {
            let (handler, name) = shims[which];
            let run = freeze_once(
                node,
                &cri,
                &api,
                handler,
                &format!("freeze-{which}-{i}"),
                &memhog_ticker(mib, 20),
                // The dump, containerd's copy into its content store and the archive.
                3 * mib,
            )
            .await?;
            eprintln!(
                "run {i} {name}: CheckpointContainer {:.2} s, app frozen {:.2} s, task paused {:.2} s, CRIU frozen {:.2} s",
                secs(run.call),
                secs(run.frozen),
                secs(run.paused),
                secs(run.criu)
            );
            times[which].push(run);
        }
    }
    println!("| shim ({mib} MiB, median of {runs}) | CheckpointContainer | app frozen | task paused | … CRIU's dump | … the rest: runc, containerd's copy, rootfs diff |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for (which, (_, name)) in shims.iter().enumerate() {
        let v = &times[which];
        let m = |f: fn(&Freeze) -> Duration| secs(median(v.iter().map(f)));
        println!(
            "| {name} | {:.2} s | {:.2} s | {:.2} s | {:.2} s | {:.2} s |",
            m(|x| x.call),
            m(|x| x.frozen),
            m(|x| x.paused),
            m(|x| x.criu),
            m(|x| x.paused.saturating_sub(x.criu))
        );
    }
    // Run i of each shim ran back to back: the per-run ratio cancels drift between runs.
    let frozen = |w: usize| times[w].iter().map(|x| secs(x.frozen)).collect::<Vec<_>>();
    let line = |which: usize| ratio_line(&frozen(which), &frozen(0));
    println!("\nfreeze ratio (gpu-ckpt / runc-v2): {}", line(1));
    println!("control (runc-v2 again / runc-v2): {}", line(2));
    Ok(())
}

/// One CRI CheckpointContainer, timed.
struct Freeze {
    /// The whole call.
    call: Duration,
    /// The longest gap between the application's ticks around the call.
    frozen: Duration,
    /// From the task's `/tasks/paused` event to its `/tasks/resumed` (both from the shim): the
    /// dump, containerd's copy of the checkpoint into its content store and the rootfs diff.
    paused: Duration,
    /// CRIU's own frozen time, from its statistics in the archive: the dump alone (the task
    /// is paused already when CRIU starts).
    criu: Duration,
    /// gpu-ckpt's device steps (the shim's spans in the node's log; zero without debug logging,
    /// or on runc-v2): Pause's lock and checkpoint of the device state, before the task is
    /// paused …
    device_pause: Duration,
    /// … and Resume's restore and unlock, after it is thawed and before `/tasks/resumed`.
    device_resume: Duration,
    /// The step timings of the gpu-ckpt manifest in the archive (none for runc-v2).
    timings: Vec<image_format::manifest::StepTiming>,
}

/// A container (CRI name `app`) that holds `mib` MiB of host memory and ticks every `tick_ms`
/// into its CRI log: a memhog and a counter, both run by sh.
fn memhog_ticker(mib: u64, tick_ms: u64) -> ContainerSpec {
    let cmd = format!("/bin/memhog --mib {mib} --interval-ms 100000 --status-file /status.txt & exec /bin/counter --interval-ms {tick_ms}");
    ContainerSpec::new("app", WORKLOADS_IMAGE).command(&["sh", "-c", &cmd])
}

/// A container (CRI name `app`) that holds `gib` GiB of device memory on simulated GPU 0 (a
/// CDI annotation) and ticks every `tick_ms`, each tick after a driver call.
fn gpu_fill_ticker(gib: u64, tick_ms: u64) -> ContainerSpec {
    ContainerSpec::new("app", GPU_WORKLOADS_IMAGE)
        .command(&gpu_fill_args(gib, Some(tick_ms)))
        .annotation(
            "cdi.k8s.io/gpu-ckpt-bench",
            &format!("{}=0", simgpu::cdi::KIND),
        )
}

/// One pod on `handler` running `app` (a container called `app` that prints `filled …` once its
/// memory is filled, and ticks into its CRI log); CRI CheckpointContainer, with the task events
/// containerd sees around it. `warm_mib` MiB of memory are warmed before it ([`settle`]).
async fn freeze_once(
    node: &Node,
    cri: &Cri,
    api: &Containerd,
    handler: &str,
    name: &str,
    app: &ContainerSpec,
    warm_mib: u64,
) -> Result<Freeze> {
    let pod = cri
        .run_pod(&PodSpec::new(name, node.pod_log_root()).handler(handler))
        .await?;
    let id = cri.run_container(&pod, app).await?;
    let log = pod.container_log("app");
    // Filled is enough: a memhog's first verification pass would come only after its interval.
    wait_text(&log, "the container to fill its memory", |text| {
        let said = |word: &str| {
            text.lines()
                .any(|l| l.split(' ').nth(3).is_some_and(|w| w == word))
        };
        if said("gpu-fill:") {
            bail!("{text}");
        }
        Ok(said("filled").then_some(()))
    })?;
    let archive = node.paths().dir.join(format!("{name}.tar"));
    let _ = std::fs::remove_file(&archive);
    settle(node.paths().dir.as_path(), warm_mib)?;
    let mut events = api.subscribe_tasks().await?;
    let log_from = log_len(node);
    let from = std::time::SystemTime::now();
    let t = Instant::now();
    cri.checkpoint_container(&id, &archive, 600).await?;
    let call = t.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let to = std::time::SystemTime::now();
    let frozen = longest_gap(&log_times(&log), from, to);
    let criu = criu_dump_time(&archive)?;
    let timings = image_format::archive::read_info(&archive, Default::default())?
        .manifest
        .map(|m| m.timings)
        .unwrap_or_default();
    let shim_log = log_since(node, log_from);
    let device_span = |rpc: &str, span: &str| {
        let path = format!("task{{rpc=\"{rpc}\" id={id}}}:{span}{{id={id}}}");
        span_time(&shim_log, |p| p == path)
    };
    let device_pause = device_span("pause", "device_quiesce");
    let device_resume = device_span("resume", "device_resume");
    let [paused, resumed] =
        event_times(&mut events, &id, ["/tasks/paused", "/tasks/resumed"]).await?;
    // The counter (pid 1) ignores SIGTERM: stop without a grace period.
    cri.stop_container(&id, 0).await?;
    cri.remove_pod(&pod).await?;
    let _ = std::fs::remove_file(&archive);
    Ok(Freeze {
        call,
        frozen,
        paused: resumed.saturating_sub(paused),
        criu,
        device_pause,
        device_resume,
        timings,
    })
}

/// When the first event of each of `topics` about container `id` happened, as its publisher
/// stamped it, since the epoch. A shim forwards its events on its own, so they may come in any
/// order.
async fn event_times<const N: usize>(
    events: &mut EventStream,
    id: &str,
    topics: [&str; N],
) -> Result<[Duration; N]> {
    let mut found: [Option<Duration>; N] = [None; N];
    let deadline = Instant::now() + Duration::from_secs(10);
    while found.iter().any(Option::is_none) {
        let left = deadline.saturating_duration_since(Instant::now());
        let Some(e) = events.next_timeout(left).await? else {
            bail!("task events of {id}: {topics:?} did not all come, got {found:?}");
        };
        let Some(k) = topics.iter().position(|t| *t == e.topic) else {
            continue;
        };
        if e.container_id() != Some(id) || found[k].is_some() {
            continue;
        }
        let ts = e
            .timestamp
            .with_context(|| format!("{} event without a time", e.topic))?;
        found[k] = Some(Duration::new(ts.seconds.try_into()?, ts.nanos.try_into()?));
    }
    Ok(found.map(Option::unwrap_or_default))
}

/// How long CRIU kept the tasks frozen for the dump, from CRIU's own statistics (`stats-dump`:
/// runc-v2's archives have it at the top level, gpu-ckpt's under `checkpoint/`); the gpu-ckpt
/// manifest's `criu-dump` step when there are none.
fn criu_dump_time(archive: &Path) -> Result<Duration> {
    let info = image_format::archive::read_info(archive, Default::default())?;
    if let Some(stats) = &info.statistics {
        return Ok(Duration::from_micros(stats.frozen_time));
    }
    if let Some(t) = info
        .manifest
        .as_ref()
        .and_then(|m| m.timings.iter().find(|t| t.step == "criu-dump"))
    {
        return Ok(Duration::from_secs_f64(t.millis / 1000.0));
    }
    bail!("{}: no CRIU dump time recorded", archive.display())
}

/// The size of the node's log, where the next line will start.
fn log_len(node: &Node) -> u64 {
    std::fs::metadata(&node.paths().log).map_or(0, |m| m.len())
}

/// The node's log from byte `from` on (lossy UTF-8).
fn log_since(node: &Node, from: u64) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let mut text = Vec::new();
    if let Ok(mut f) = std::fs::File::open(&node.paths().log) {
        let _ = f
            .seek(SeekFrom::Start(from))
            .and_then(|_| f.read_to_end(&mut text));
    }
    String::from_utf8_lossy(&text).into_owned()
}

/// A duration as `tracing` prints it (`523ns`, `6.44µs`, `1.17ms`, `1.15s`).
fn parse_span_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let (num, scale) = [
        ("ns", 1e-9),
        ("µs", 1e-6),
        ("us", 1e-6),
        ("ms", 1e-3),
        ("s", 1.0),
    ]
    .iter()
    .find_map(|(unit, scale)| Some((s.strip_suffix(unit)?, *scale)))?;
    Some(Duration::from_secs_f64(num.parse::<f64>().ok()? * scale))
}

/// The wall time (busy + idle) of the shim's spans in `log` whose path `matches` (`task{rpc="…"
/// id=…}:criu_dump{id=…}`), summed. A gpu-ckpt shim logs every span's time when it closes
/// (`<time> <LEVEL> <path>: close time.busy=… time.idle=…`) when containerd runs with debug
/// logging.
fn span_time(log: &str, matches: impl Fn(&str) -> bool) -> Duration {
    let drop_word = |s: &str| -> String {
        let s = s.trim_start();
        s.find(' ').map_or("", |i| &s[i..]).trim_start().to_string()
    };
    log.lines()
        .filter_map(|l| {
            let (head, times) = l.split_once(": close time.busy=")?;
            if !matches(&drop_word(&drop_word(head))) {
                return None;
            }
            let (busy, idle) = times.split_once(" time.idle=")?;
            let idle = idle.split_whitespace().next()?;
            Some(parse_span_duration(busy)? + parse_span_duration(idle)?)
        })
        .sum()
}

/// The number in field `key=<n>` of a log line.
fn log_field(line: &str, key: &str) -> Option<u64> {
    let at = line.find(&format!(" {key}="))? + key.len() + 2;
    let digits: String = line[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// The gpu-ckpt shim's own account of a ctr checkpoint and restore of container `id`, from its
/// log ([`span_time`]; zero where the log has none).
#[derive(Clone, Copy, Default)]
struct ShimSteps {
    /// Pause (containerd's client pauses the task before a checkpoint): the device lock and
    /// checkpoint (device memory copied into the process), then `runc pause`.
    pause: Duration,
    device_lock: Duration,
    device_checkpoint: Duration,
    /// The Checkpoint call: CRIU's dump (`runc checkpoint`), then the manifest (hashing what
    /// the dump's follower did not, signing).
    checkpoint: Duration,
    criu_dump: Duration,
    manifest: Duration,
    /// What the checkpoint wrote.
    bytes: u64,
    /// The restore's Start call: verify, `runc restore` (CRIU), the device restore and unlock.
    start: Duration,
    verify: Duration,
    runc_restore: Duration,
    device_restore: Duration,
}

fn shim_steps(log: &str, id: &str) -> ShimSteps {
    let task = |rpc: &str| format!("task{{rpc=\"{rpc}\" id={id}}}");
    let exact = |path: String| span_time(log, |p| p == path);
    // The device layer's own spans are not below the RPC's.
    let top = |name: &str| {
        let open = format!("{name}{{");
        span_time(log, |p| p.starts_with(&open) && !p.contains("}:"))
    };
    let line = |needle: String| log.lines().find(|l| l.contains(&needle));
    let restored = line(format!(" restored id={id} "));
    let ms =
        |key: &str| Duration::from_millis(restored.and_then(|l| log_field(l, key)).unwrap_or(0));
    ShimSteps {
        pause: exact(task("pause")),
        device_lock: top("device_lock"),
        device_checkpoint: top("device_checkpoint"),
        checkpoint: exact(task("checkpoint")),
        criu_dump: exact(format!("{}:criu_dump{{id={id}}}", task("checkpoint"))),
        manifest: exact(format!("{}:manifest{{id={id}}}", task("checkpoint"))),
        bytes: line(format!("checkpoint written id={id} "))
            .and_then(|l| log_field(l, "bytes"))
            .unwrap_or(0),
        start: exact(task("start")),
        verify: ms("verify_ms"),
        runc_restore: ms("runc_restore_ms"),
        device_restore: ms("device_restore_ms"),
    }
}

/// `device-container`: one node with one simulated GPU whose gpu-ckpt handlers load its driver
/// (CRI: the handler's options; ctr: the handler options file), then the ctr rounds and the CRI
/// freeze runs.
fn device_container(gib: u64, runs: usize) -> Result<()> {
    anyhow::ensure!(gib >= 1, "--gib must be at least 1");
    anyhow::ensure!(runs >= 1, "--runs must be at least 1");
    // Room for the filled memory and the driver's own, never for two fills at once.
    let memory_mib = gib * 1024 + 512;
    let (sim, node) = sim_gpu_node("bench-gpu", memory_mib)?;
    println!(
        "One containerd node (debug logging) with one simulated GPU of {memory_mib} MiB; \
         gpu-ckpt loads the simulated driver (`DriverLibraryDir`). Device: gpu-fill of {gib} GiB \
         on GPU 0 (`/usr/bin/gpu-fill --gib {gib} --devices 0`); host: memhog of {} MiB.\n",
        gib * 1024
    );
    tokio::runtime::Runtime::new()?.block_on(async {
        container_rounds(&node, &sim, gib, runs).await?;
        container_freeze(&node, gib, runs).await
    })
}

/// One containerd node `name` (debug logging, so that the shim logs each step's time) with one
/// simulated GPU of `memory_mib` MiB, whose gpu-ckpt handlers load its driver (CRI: the
/// handler's options; ctr: the handler options file).
fn sim_gpu_node(name: &str, memory_mib: u64) -> Result<(simgpu::testing::SimNode, Node)> {
    use simgpu::testing::{SimConfig, SimNode};
    let stack = Stack::discover()?;
    let sim = SimNode::start(SimConfig {
        gpus: 1,
        memory_mib,
        uuid_seed: name.into(),
        cdi: true,
        ..SimConfig::default()
    })
    .context("starting the simulated GPU (gpu-ckpt-simgpu next to this binary, and `cargo build --release -p gpu-ckpt-simcuda -p gpu-ckpt-simnvml -p gpu-ckpt-simnccl`)")?;
    let node = sim_containerd_node(&stack, name, &sim, "debug")?;
    Ok((sim, node))
}

/// A containerd node named `name` whose gpu-ckpt handlers load the simulated driver of `sim`
/// (CRI: the handler's options; ctr, which sends no runtime options: the handler options file),
/// with its CDI specs, logging at `level`. Pods may turn on `gpu-ckpt.io/resume-after-dump`
/// (`PodResumeAfterDump`), for the freeze-resume bench.
fn sim_containerd_node(
    stack: &Stack,
    name: &str,
    sim: &simgpu::testing::SimNode,
    level: &str,
) -> Result<Node> {
    let lib_dir = sim.lib_dir().display().to_string();
    let handler_file = stack.node_dir(name).join("gpu-ckpt-handler.toml");
    std::fs::create_dir_all(stack.node_dir(name))?;
    std::fs::write(
        &handler_file,
        format!(
            "DriverLibraryDir = {}\nPodResumeAfterDump = true\n",
            serde_json::to_string(&lib_dir)?
        ),
    )?;
    start_node(
        stack,
        Node::builder_on(stack, name)
            .log_level(level)
            .cdi(&[sim.cdi_dir()])
            .runtime_option("DriverLibraryDir", lib_dir.as_str())
            .runtime_option("PodResumeAfterDump", true)
            .env(
                "GPU_CKPT_HANDLER_CONFIG",
                &handler_file.display().to_string(),
            ),
    )
}

/// Waits until no process holds memory on the simulated GPU (the last round's is gone).
fn wait_gpu_free(sim: &simgpu::testing::SimNode) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = sim.processes()?;
        if left.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("processes still hold the simulated GPU: {left:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// ctr checkpoint and restore of the device-memory container against the host-memory one,
/// both through gpu-ckpt.
async fn container_rounds(
    node: &Node,
    sim: &simgpu::testing::SimNode,
    gib: u64,
    runs: usize,
) -> Result<()> {
    let api = Containerd::connect(node.socket(), "default").await?;
    let (_, ours) = runtime_flags(node);
    let mib = gib * 1024;
    // The same tmpfs in both (gpu-fill logs into it), and as much memory warmed before each
    // step: the device one's needs.
    let device = CtrApp::gpu_fill(gib);
    let host = CtrApp {
        flags: vec!["--mount".into(), OUT_TMPFS.into()],
        check_restored: true,
        warm_mib: device.warm_mib,
        ..CtrApp::memhog(mib)
    };
    let apps = [device, host];
    let labels = [
        format!("device: gpu-fill, {gib} GiB on the simulated GPU"),
        format!("host: memhog, {mib} MiB"),
    ];
    // Per container, every counted round: (round, the shim's steps). Round 0 warms up and is
    // not counted; the order alternates ([`round_order`]).
    let mut rounds: [Vec<(ShimRound, ShimSteps)>; 2] = Default::default();
    for i in 0..=runs {
        for p in round_order(i.saturating_sub(1), 2) {
            let id = format!("{}{i}", ["dev", "host"][p]);
            let from = log_len(node);
            let r = shim_round(node, &api, &ours, &id, &apps[p]).await?;
            wait_gpu_free(sim)?;
            let s = shim_steps(&log_since(node, from), &id);
            eprintln!(
                "round {i}{} {}: checkpoint {:.2} s (pause {:.3} s: device lock {:.3} s, device checkpoint {:.3} s; CRIU dump {:.2} s; manifest {:.2} s; {:.0} MiB written), restore {:.2} s (verify {:.2} s, runc restore {:.2} s, device restore {:.3} s); {}",
                if i == 0 { " (warm-up)" } else { "" },
                labels[p],
                secs(r.checkpoint),
                secs(s.pause),
                secs(s.device_lock),
                secs(s.device_checkpoint),
                secs(s.criu_dump),
                secs(s.manifest),
                s.bytes as f64 / (1 << 20) as f64,
                secs(r.restore),
                secs(s.verify),
                secs(s.runc_restore),
                secs(s.device_restore),
                r.intact.as_deref().unwrap_or("not checked"),
            );
            if i > 0 {
                rounds[p].push((r, s));
            }
        }
    }
    let step = |p: usize, restore: bool| -> Vec<f64> {
        rounds[p]
            .iter()
            .map(|(r, _)| secs(if restore { r.restore } else { r.checkpoint }))
            .collect()
    };
    println!(
        "ctr and the containerd API, through gpu-ckpt: `ctr run -d`, `ctr task checkpoint --exit \
         --image-path`, then Tasks.Create with `CriuImagePath` and Tasks.Start on the same \
         container; {runs} rounds, the order alternating, one warm-up round not counted; dirty \
         pages written back and memory warmed before each timed step. Each restored workload is \
         checked before it is removed.\n"
    );
    println!("| container ({gib} GiB, {runs} rounds) | checkpoint median | restore median | checkpoint fastest | restore fastest | written by the checkpoint (median) |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for (p, label) in labels.iter().enumerate() {
        let written = median_f64(
            rounds[p]
                .iter()
                .map(|(_, s)| s.bytes as f64 / (1u64 << 30) as f64)
                .collect(),
        );
        println!(
            "| {label} | {:.2} s | {:.2} s | {:.2} s | {:.2} s | {written:.2} GiB |",
            median_f64(step(p, false)),
            median_f64(step(p, true)),
            fastest(&step(p, false)),
            fastest(&step(p, true)),
        );
    }
    println!("\n| device / host | checkpoint: medians, per round [95% interval], fastest | restore: medians, per round [95% interval], fastest |");
    println!("| --- | --- | --- |");
    println!(
        "| gpu-fill / memhog | {} | {} |",
        ratio_cell(&step(0, false), &step(1, false)),
        ratio_cell(&step(0, true), &step(1, true))
    );
    let ms = |p: usize, f: fn(&ShimSteps) -> Duration| {
        secs(median(rounds[p].iter().map(|(_, s)| f(s)))) * 1e3
    };
    println!("\n| where the time went (medians, the shim's spans) | Pause | … device lock | … device checkpoint | Checkpoint | … CRIU dump | … manifest | restore's Start | … verify | … runc restore (CRIU) | … device restore + unlock |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for (p, label) in labels.iter().enumerate() {
        println!(
            "| {label} | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms | {:.0} ms | {:.0} ms | {:.0} ms |",
            ms(p, |s| s.pause),
            ms(p, |s| s.device_lock),
            ms(p, |s| s.device_checkpoint),
            ms(p, |s| s.checkpoint),
            ms(p, |s| s.criu_dump),
            ms(p, |s| s.manifest),
            ms(p, |s| s.start),
            ms(p, |s| s.verify),
            ms(p, |s| s.runc_restore),
            ms(p, |s| s.device_restore),
        );
    }
    println!();
    for (restore, what) in [(false, "checkpoint"), (true, "restore")] {
        let r = median_f64(step(0, restore)) / median_f64(step(1, restore));
        println!(
            "{what} ratio (device / host, medians): {r:.3} (goal ≤ 1.5: {})",
            if r <= 1.5 { "met" } else { "missed" }
        );
    }
    for (p, label) in labels.iter().enumerate() {
        let verdicts: Vec<&str> = rounds[p]
            .iter()
            .filter_map(|(r, _)| r.intact.as_deref())
            .collect();
        println!(
            "restored {label}: intact after each of {} restores (last: `{}`)",
            verdicts.len(),
            verdicts.last().copied().unwrap_or("-")
        );
    }
    Ok(())
}

/// CRI CheckpointContainer of (a) the device-memory ticker and (b) the host-memory ticker under
/// gpu-ckpt, (c) the host-memory ticker under runc-v2: how long each keeps the application from
/// running.
async fn container_freeze(node: &Node, gib: u64, runs: usize) -> Result<()> {
    const TICK_MS: u64 = 10;
    let cri = Cri::connect(node.socket()).await?;
    let api = Containerd::connect(node.socket(), "k8s.io").await?;
    let mib = gib * 1024;
    let paths = [
        (
            format!("(a) device: gpu-fill {gib} GiB, gpu-ckpt"),
            GPU_CKPT_HANDLER,
            gpu_fill_ticker(gib, TICK_MS),
        ),
        (
            format!("(b) host: memhog {mib} MiB + counter, gpu-ckpt"),
            GPU_CKPT_HANDLER,
            memhog_ticker(mib, TICK_MS),
        ),
        (
            format!("(c) host: memhog {mib} MiB + counter, runc-v2"),
            RUNC_HANDLER,
            memhog_ticker(mib, TICK_MS),
        ),
    ];
    // Run 0 warms every path up and is not counted; the order follows [`round_order`].
    let mut times: [Vec<Freeze>; 3] = Default::default();
    for i in 0..=runs {
        for w in round_order(i.saturating_sub(1), paths.len()) {
            let (label, handler, app) = &paths[w];
            let run = freeze_once(
                node,
                &cri,
                &api,
                handler,
                &format!("dfreeze-{w}-{i}"),
                app,
                // The dump, containerd's copy into its content store and the archive, and the
                // device memory's staged copy.
                4 * mib,
            )
            .await?;
            eprintln!(
                "run {i}{} {label}: CheckpointContainer {:.2} s, app frozen {:.2} s, device lock + checkpoint {:.3} s, task paused {:.2} s, CRIU frozen {:.2} s, device restore + unlock {:.3} s",
                if i == 0 { " (warm-up)" } else { "" },
                secs(run.call),
                secs(run.frozen),
                secs(run.device_pause),
                secs(run.paused),
                secs(run.criu),
                secs(run.device_resume)
            );
            if i > 0 {
                times[w].push(run);
            }
        }
    }
    println!(
        "\nCRI CheckpointContainer; the application ticks every {TICK_MS} ms into its CRI log \
         (gpu-fill: `--tick-ms {TICK_MS}`, one driver call before each tick; memhog: \
         `/bin/counter --interval-ms {TICK_MS}` beside it); frozen: the longest gap between \
         ticks across the call. {runs} runs, one warm-up run not counted.\n"
    );
    println!("| container (median of {runs}) | CheckpointContainer | app frozen | device lock + checkpoint (Pause) | task paused | … CRIU's dump | … device restore + unlock (Resume) | … the rest: runc, containerd's copy, rootfs diff |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for (w, (label, _, _)) in paths.iter().enumerate() {
        let v = &times[w];
        let m = |f: fn(&Freeze) -> Duration| secs(median(v.iter().map(f)));
        println!(
            "| {label} | {:.2} s | {:.2} s | {:.3} s | {:.2} s | {:.2} s | {:.3} s | {:.2} s |",
            m(|x| x.call),
            m(|x| x.frozen),
            m(|x| x.device_pause),
            m(|x| x.paused),
            m(|x| x.criu),
            m(|x| x.device_resume),
            m(|x| x.paused.saturating_sub(x.criu + x.device_resume))
        );
    }
    let frozen = |w: usize| times[w].iter().map(|x| secs(x.frozen)).collect::<Vec<_>>();
    println!(
        "\nfreeze ratio (a) device, gpu-ckpt / (c) host, runc-v2: {}",
        ratio_line(&frozen(0), &frozen(2))
    );
    println!(
        "freeze ratio (b) host, gpu-ckpt / (c) host, runc-v2: {}",
        ratio_line(&frozen(1), &frozen(2))
    );
    println!(
        "freeze ratio (a) device / (b) host, both gpu-ckpt: {}",
        ratio_line(&frozen(0), &frozen(1))
    );
    Ok(())
}

/// `gpu`: the simulated driver's checkpoint data path against a pipe carrying the same bytes.
mod device_bench {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::os::fd::AsRawFd;
    use std::path::{Path, PathBuf};
    use std::process::{Child, Command, Stdio};
    use std::sync::mpsc::{channel, Receiver};
    use std::time::{Duration, Instant};

    use anyhow::{anyhow, ensure, Context, Result};
    use gpu::{CudaDriver, DeviceCheckpoint, ProcessState};
    use simgpu::testing::{SimConfig, SimNode};

    use super::{median, paired, round_order, secs};

    const PATHS: [&str; 3] = [
        "simulated driver (gpu crate → libcuda → gpu-ckpt-simgpu)",
        "pipe: the same bytes out and back",
        "pipe again (control)",
    ];

    /// One round of one path: the checkpoint side (device → process memory) and the restore
    /// side (process memory → device).
    #[derive(Clone, Copy)]
    struct Round {
        out: Duration,
        back: Duration,
    }

    impl Round {
        fn total(&self) -> Duration {
            self.out + self.back
        }
    }

    /// The simulated driver's four steps of one round.
    #[derive(Clone, Copy)]
    struct Steps {
        lock: Duration,
        checkpoint: Duration,
        restore: Duration,
        unlock: Duration,
    }

    /// A gpu-fill on the node, its stdout lines on a channel.
    struct Fill {
        child: Child,
        lines: Receiver<String>,
    }

    impl Fill {
        fn start(bin: &Path, sim: &SimNode, gib: u64) -> Result<Fill> {
            let mut child = Command::new(bin)
                .args(["--gib", &gib.to_string(), "--devices", "0", "--seed", "7"])
                .envs(sim.env())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .with_context(|| format!("starting {}", bin.display()))?;
            let out = child.stdout.take().context("gpu-fill stdout")?;
            let (tx, lines) = channel();
            std::thread::spawn(move || {
                for l in BufReader::new(out).lines().map_while(Result::ok) {
                    if tx.send(l).is_err() {
                        break;
                    }
                }
            });
            Ok(Fill { child, lines })
        }

        fn pid(&self) -> i32 {
            self.child.id() as i32
        }

        fn wait_line(&self, prefix: &str, timeout: Duration) -> Result<String> {
            let deadline = Instant::now() + timeout;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                let l = self
                    .lines
                    .recv_timeout(left)
                    .map_err(|e| anyhow!("gpu-fill: no {prefix:?} line: {e}"))?;
                ensure!(!l.starts_with("MISMATCH"), "gpu-fill: {l}");
                if l.starts_with(prefix) {
                    return Ok(l);
                }
            }
        }

        /// Asks gpu-fill to check every byte (SIGUSR1) and waits for its verdict.
        fn verify(&self) -> Result<String> {
            // SAFETY: signalling our own child.
            ensure!(
                unsafe { libc::kill(self.pid(), libc::SIGUSR1) } == 0,
                "kill: {}",
                std::io::Error::last_os_error()
            );
            self.wait_line("verified ", Duration::from_secs(300))
        }
    }

    impl Drop for Fill {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    fn timed<T>(f: impl FnOnce() -> Result<T>) -> Result<(T, Duration)> {
        let t = Instant::now();
        let v = f()?;
        Ok((v, t.elapsed()))
    }

    fn sim_round(driver: &CudaDriver, pid: i32) -> Result<(Round, Steps)> {
        let ((), lock) = timed(|| Ok(driver.lock(pid, Some(Duration::from_secs(60)))?))?;
        let ((), checkpoint) = timed(|| Ok(driver.checkpoint(pid)?))?;
        let ((), restore) = timed(|| Ok(driver.restore(pid, &[])?))?;
        let ((), unlock) = timed(|| Ok(driver.unlock(pid)?))?;
        let steps = Steps {
            lock,
            checkpoint,
            restore,
            unlock,
        };
        Ok((
            Round {
                out: lock + checkpoint,
                back: restore + unlock,
            },
            steps,
        ))
    }

    /// Sets a pipe's capacity (F_SETPIPE_SZ); 0 leaves the system's default.
    fn set_pipe_size(fd: &impl AsRawFd, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: fcntl on a descriptor we own.
        let rc = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETPIPE_SZ, bytes as libc::c_int) };
        ensure!(
            rc >= 0,
            "F_SETPIPE_SZ {bytes}: {}",
            std::io::Error::last_os_error()
        );
        Ok(())
    }

    /// Moves `src` through a pipe into fresh memory, as the driver moves device memory into
    /// the process at a checkpoint and back at a restore: a writer thread writes it and frees
    /// it, this thread reads it into a new buffer.
    fn through_pipe(src: Vec<u8>, pipe_bytes: usize) -> Result<Vec<u8>> {
        let (mut r, mut w) = std::io::pipe()?;
        set_pipe_size(&w, pipe_bytes)?;
        let n = src.len();
        let writer = std::thread::spawn(move || -> std::io::Result<()> {
            w.write_all(&src)?;
            drop(w);
            drop(src);
            Ok(())
        });
        let mut dst = vec![0u8; n];
        r.read_exact(&mut dst)?;
        writer
            .join()
            .map_err(|_| anyhow!("pipe writer panicked"))??;
        Ok(dst)
    }

    fn pipe_round(held: &mut Option<Vec<u8>>, pipe_bytes: usize) -> Result<Round> {
        let dev = held.take().context("no buffer")?;
        let (host, out) = timed(|| through_pipe(dev, pipe_bytes))?;
        let (dev, back) = timed(|| through_pipe(host, pipe_bytes))?;
        *held = Some(dev);
        Ok(Round { out, back })
    }

    /// `bytes` of a non-repeating pattern, every page written.
    fn pattern(bytes: u64) -> Vec<u8> {
        let mut v = vec![0u8; bytes as usize];
        for (i, c) in v.chunks_exact_mut(8).enumerate() {
            c.copy_from_slice(&(i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
        }
        v
    }

    fn exe_dir() -> Result<PathBuf> {
        Ok(std::env::current_exe()?
            .parent()
            .context("no directory for this binary")?
            .to_path_buf())
    }

    pub fn bench(gib: u64, rounds: usize, pipe_kib: usize) -> Result<()> {
        ensure!(gib >= 1, "--gib must be at least 1");
        ensure!(rounds >= 1, "--rounds must be at least 1");
        let bytes = gib << 30;
        let pipe_bytes = pipe_kib * 1024;
        let fill_bin = exe_dir()?.join("gpu-fill");
        ensure!(
            fill_bin.is_file(),
            "{} is not built: run `cargo build --release --workspace --bins`",
            fill_bin.display()
        );
        let sim = SimNode::start(SimConfig {
            gpus: 1,
            memory_mib: (gib + 1) * 1024,
            ..SimConfig::default()
        })
        .context("starting the simulated node (gpu-ckpt-simgpu and its libraries are built with the workspace's release binaries)")?;
        let fill = Fill::start(&fill_bin, &sim, gib)?;
        let filled = fill.wait_line("filled ", Duration::from_secs(300))?;
        ensure!(
            filled == format!("filled {bytes} bytes on 1 GPUs"),
            "gpu-fill: {filled}"
        );
        let pid = fill.pid();
        let driver = CudaDriver::load_from(sim.libcuda())?;
        ensure!(
            driver.state(pid)? == ProcessState::RUNNING,
            "gpu-fill is not running"
        );

        // The pipe paths' "device memory": their own buffers, written through.
        let mut held = [Some(pattern(bytes)), Some(pattern(bytes))];
        let run =
            |path: usize, held: &mut [Option<Vec<u8>>; 2]| -> Result<(Round, Option<Steps>)> {
                match path {
                    0 => sim_round(&driver, pid).map(|(r, s)| (r, Some(s))),
                    p => pipe_round(&mut held[p - 1], pipe_bytes).map(|r| (r, None)),
                }
            };
        // One warm-up round of each path, not counted.
        for p in 0..PATHS.len() {
            run(p, &mut held)?;
        }
        let mut times: [Vec<Round>; 3] = Default::default();
        let mut steps = Vec::new();
        for i in 0..rounds {
            for p in round_order(i, PATHS.len()) {
                let (r, s) = run(p, &mut held)?;
                eprintln!(
                    "round {i} {}: out {:.3} s, back {:.3} s, total {:.3} s",
                    PATHS[p],
                    secs(r.out),
                    secs(r.back),
                    secs(r.total())
                );
                if let Some(s) = s {
                    steps.push(s);
                }
                times[p].push(r);
            }
        }
        let verified = fill.verify()?;
        ensure!(
            verified == format!("verified {bytes} bytes"),
            "gpu-fill: {verified}"
        );
        ensure!(
            driver.state(pid)? == ProcessState::RUNNING,
            "gpu-fill is not running after the rounds"
        );

        let pipe_size = if pipe_kib == 0 {
            "the system's default capacity".to_string()
        } else {
            format!("capacity {pipe_kib} KiB")
        };
        println!(
            "{gib} GiB of device memory (one gpu-fill allocation on a simulated GPU), {rounds} rounds \
             in a Williams order, one warm-up round of each path not counted; pipe: {pipe_size}, \
             fresh memory on the receiving side and the sender's copy freed, as at a checkpoint \
             and a restore.\n"
        );
        println!("| path | out (checkpoint side) median | back (restore side) median | round trip median | round trip fastest | GiB/s each way (medians) |");
        println!("| --- | --- | --- | --- | --- | --- |");
        for (p, name) in PATHS.iter().enumerate() {
            let v = &times[p];
            let out = median(v.iter().map(|r| r.out));
            let back = median(v.iter().map(|r| r.back));
            let total = median(v.iter().map(Round::total));
            let fastest = v.iter().map(Round::total).min().unwrap_or_default();
            println!(
                "| {name} | {:.3} s | {:.3} s | {:.3} s | {:.3} s | {:.2} / {:.2} |",
                secs(out),
                secs(back),
                secs(total),
                secs(fastest),
                gib as f64 / secs(out),
                gib as f64 / secs(back)
            );
        }
        let ms = |f: fn(&Steps) -> Duration| secs(median(steps.iter().map(f))) * 1e3;
        println!("\n| simulated driver, medians | lock | checkpoint | restore | unlock |");
        println!("| --- | --- | --- | --- | --- |");
        println!(
            "| {gib} GiB | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms |",
            ms(|s| s.lock),
            ms(|s| s.checkpoint),
            ms(|s| s.restore),
            ms(|s| s.unlock)
        );

        let col = |a: usize, b: usize, f: fn(&Round) -> Duration| {
            let x: Vec<f64> = times[a].iter().map(|r| secs(f(r))).collect();
            let y: Vec<f64> = times[b].iter().map(|r| secs(f(r))).collect();
            let p = paired(&x, &y);
            format!(
                "{:.3}, {:.3} [{:.3}–{:.3}]",
                p.of_medians, p.per_round, p.interval.0, p.interval.1
            )
        };
        println!("\n| ratio | out: medians, per round [95% interval] | back: medians, per round [95% interval] | round trip: medians, per round [95% interval] |");
        println!("| --- | --- | --- | --- |");
        for (label, a, b) in [
            ("simulated driver / pipe", 0, 1),
            ("control: pipe again / pipe", 2, 1),
        ] {
            println!(
                "| {label} | {} | {} | {} |",
                col(a, b, |r| r.out),
                col(a, b, |r| r.back),
                col(a, b, Round::total)
            );
        }
        let x: Vec<f64> = times[0].iter().map(|r| secs(r.total())).collect();
        let y: Vec<f64> = times[1].iter().map(|r| secs(r.total())).collect();
        let p = paired(&x, &y);
        println!(
            "\nround trip ratio (simulated driver / pipe, medians): {:.3} (goal ≤ 1.5: {}); gpu-fill after {} rounds: {verified}",
            p.of_medians,
            if p.of_medians <= 1.5 { "met" } else { "missed" },
            rounds + 1
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_order_balances_places_and_predecessors() {
        for n in [2, 3, 4, 5] {
            let cycle = if n % 2 == 0 { n } else { 2 * n };
            let rounds: Vec<Vec<usize>> = (0..cycle).map(|r| round_order(r, n)).collect();
            // After a whole cycle, every path came right after every other path equally often,
            // and each took every place equally often.
            let mut follows = std::collections::HashMap::new();
            let mut places = std::collections::HashMap::new();
            for order in &rounds {
                let mut sorted = order.clone();
                sorted.sort();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "{order:?}");
                for w in order.windows(2) {
                    *follows.entry((w[0], w[1])).or_insert(0) += 1;
                }
                for (place, path) in order.iter().enumerate() {
                    *places.entry((place, *path)).or_insert(0) += 1;
                }
            }
            assert_eq!(follows.len(), n * (n - 1), "n={n}: {follows:?}");
            let once = cycle / n;
            assert!(follows.values().all(|c| *c == once), "n={n}: {follows:?}");
            assert_eq!(places.len(), n * n);
            assert!(places.values().all(|c| *c == cycle / n), "n={n}");
        }
        assert_eq!(round_order(0, 4), [0, 1, 3, 2]);
        // The next cycle repeats the first.
        assert_eq!(round_order(4, 4), round_order(0, 4));
    }

    #[test]
    fn shim_steps_from_span_lines() {
        let log = r#"2026-12-04T10:24:10.107761Z  INFO device_lock{pid=11960}:cuda_lock{pid=11960 timeout_ms=30000}: close time.busy=822µs time.idle=38.7µs
2026-12-04T10:24:10.107795Z  INFO device_lock{pid=11960}: close time.busy=907µs time.idle=93µs
2026-12-04T10:24:10.109067Z  INFO device_checkpoint{pid=11960}: close time.busy=1.24s time.idle=5.05µs
2026-12-04T10:24:10.118001Z  INFO task{rpc="pause" id=t1}: close time.busy=2.12ms time.idle=23.9ms
2026-12-04T10:24:10.118001Z  INFO task{rpc="pause" id=t10}: close time.busy=9s time.idle=9s
2026-12-04T10:24:10.320209Z  INFO task{rpc="checkpoint" id=t1}:criu_dump{id=t1}: close time.busy=651µs time.idle=165ms
2026-12-04T10:24:10.329376Z  INFO task{rpc="checkpoint" id=t1}: checkpoint written id=t1 path=/x bytes=392355 leave_running=true
2026-12-04T10:24:12.522334Z  INFO task{rpc="start" id=t1}:restore{id=t1}: restored id=t1 verify_ms=18 page_verify_ms=0 runc_restore_ms=144 device_restore_ms=16
time="2026-12-04T10:24:06.780298931Z" level=debug msg="close time.busy=1s""#;
        let s = shim_steps(log, "t1");
        // Within a nanosecond: the figures pass through f64 seconds.
        let close = |d: Duration, ns: u64| d.as_nanos().abs_diff(ns.into()) <= 1;
        assert!(close(s.device_lock, 1_000_000), "{:?}", s.device_lock);
        assert!(close(s.device_checkpoint, 1_240_005_050));
        assert!(close(s.pause, 26_020_000), "{:?}", s.pause);
        assert!(close(s.criu_dump, 165_651_000));
        assert_eq!(s.bytes, 392_355);
        assert_eq!(
            (s.verify, s.runc_restore, s.device_restore),
            (
                Duration::from_millis(18),
                Duration::from_millis(144),
                Duration::from_millis(16)
            )
        );
        assert_eq!(s.start, Duration::ZERO);
        assert_eq!(
            parse_span_duration("523ns"),
            Some(Duration::from_nanos(523))
        );
        assert_eq!(parse_span_duration("1.5x"), None);
    }

    #[test]
    fn median_interval_brackets_the_median_and_is_repeatable() {
        assert_eq!(median_interval(&[1.02; 9]), (1.02, 1.02));
        let v = [0.91, 0.97, 1.0, 1.01, 1.03, 1.04, 1.08, 1.12, 1.4];
        let (lo, hi) = median_interval(&v);
        let m = median_f64(v.to_vec());
        assert!(lo < m && m < hi, "{lo} {m} {hi}");
        // Within the sample's range, and not the whole of it for nine points.
        assert!(lo > 0.91 && hi < 1.4, "{lo} {hi}");
        assert_eq!(median_interval(&v), (lo, hi));
        assert!(median_interval(&[]).0.is_nan());
    }
}
