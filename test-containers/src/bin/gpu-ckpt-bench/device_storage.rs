//! `device-storage`: a device checkpoint and restore through the shim (ctr, then the containerd
//! API) of containers holding simulated device memory, at each CUDA version given (13050: custom
//! storage, the device memory written by the shim into the checkpoint's own files; 13000: the
//! staged path, through the process's memory and CRIU's page images), at each size for one GPU
//! process, and for 1, 2, … GPU processes (each on its own GPU) of the same per-process size.
//! Next to every case, in the same run and the same directory, the storage baseline: the same
//! bytes written (then synced) and read back with `O_DIRECT`, one writer per process as the
//! shim has one per GPU. The device steps' times come from the checkpoint's manifest
//! (`device-lock`, `device-checkpoint`, `criu-dump`) and the shim's `restored` line (the device
//! restore and unlock, CRIU's restore).

use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use simgpu::testing::{SimConfig, SimNode};
use test_containers::{
    containerd::Containerd,
    stack::{Node, Stack, GPU_WORKLOADS_IMAGE},
};

use super::{
    gpu_fill_args, gpu_fill_failed, gpu_fill_verified, log_len, log_since, median_f64,
    runtime_flags, secs, settle, shim_steps, sim_containerd_node, wait_gpu_free, wait_text,
    OUT_TMPFS,
};

/// What to measure (the subcommand's arguments).
pub struct Opts {
    /// GiB of device memory of the one-process cases.
    pub sizes: Vec<u64>,
    /// Process counts of the parallel cases.
    pub procs: Vec<usize>,
    /// GiB per process of the parallel cases.
    pub proc_gib: u64,
    /// Simulated CUDA versions, one node each.
    pub cuda: Vec<i32>,
    pub runs: usize,
}

/// One case: `procs` GPU processes of `gib` GiB each.
#[derive(Clone, Copy, PartialEq)]
struct Case {
    procs: usize,
    gib: u64,
}

impl Case {
    fn bytes(&self) -> u64 {
        self.procs as u64 * (self.gib << 30)
    }
}

/// One checkpoint and restore of a case, and the storage baseline beside it.
#[derive(Clone, Default)]
struct Run {
    /// `devices.storage` of the manifest ("custom", "staged"; "-" when it does not say).
    storage: String,
    ctr_checkpoint: Duration,
    device_lock: Duration,
    device_checkpoint: Duration,
    criu_dump: Duration,
    restore: Duration,
    device_restore: Duration,
    runc_restore: Duration,
    /// Bytes of CRIU's page images, and of every other file of the checkpoint.
    pages_bytes: u64,
    other_bytes: u64,
    /// The storage baseline: the same bytes written with O_DIRECT and synced, then read back.
    base_write: Duration,
    base_read: Duration,
    /// The restored processes' verdicts.
    verified: String,
    /// Peak RSS of the processes during the checkpoint over their RSS before it.
    rss_growth: f64,
}

pub fn bench(o: Opts) -> Result<()> {
    ensure!(o.runs >= 1, "--runs must be at least 1");
    ensure!(
        o.sizes.iter().chain([&o.proc_gib]).all(|g| *g >= 1),
        "sizes must be at least 1 GiB"
    );
    ensure!(
        o.procs.iter().all(|p| (1..=8).contains(p)),
        "--procs: from 1 to 8 processes"
    );
    let mut cases: Vec<Case> = o.sizes.iter().map(|&gib| Case { procs: 1, gib }).collect();
    for &procs in &o.procs {
        let c = Case {
            procs,
            gib: o.proc_gib,
        };
        if !cases.contains(&c) {
            cases.push(c);
        }
    }
    let stack = Stack::discover()?;
    println!(
        "Device checkpoint and restore through gpu-ckpt (ctr `task checkpoint --exit --image-path`, \
         then Tasks.Create with `CriuImagePath`), {} run(s) per case, against the same bytes \
         written (synced) and read with O_DIRECT in the checkpoint's directory, one writer per \
         process; {} CPUs, {} GiB of memory.\n",
        o.runs,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        mem_total_gib()
    );
    let mut results: Vec<(i32, Case, Vec<Run>)> = Vec::new();
    for &cuda in &o.cuda {
        let gpus = cases.iter().map(|c| c.procs).max().unwrap_or(1);
        let max_gib = cases.iter().map(|c| c.gib).max().unwrap_or(1);
        let sim = SimNode::start(SimConfig {
            gpus: gpus as u32,
            memory_mib: max_gib * 1024 + 512,
            cuda_version: cuda,
            uuid_seed: format!("bench-storage-{cuda}"),
            cdi: true,
            ..SimConfig::default()
        })
        .context("starting the simulated GPUs (gpu-ckpt-simgpu next to this binary, and `cargo build --release -p gpu-ckpt-simcuda -p gpu-ckpt-simnvml -p gpu-ckpt-simnccl`)")?;
        let node = sim_containerd_node(&stack, &format!("bench-storage-{cuda}"), &sim, "info")?;
        let api = tokio::runtime::Runtime::new()?;
        let client = api.block_on(Containerd::connect(node.socket(), "default"))?;
        for case in &cases {
            let mut runs = Vec::new();
            for r in 0..o.runs {
                let id = format!("st{cuda}-{}x{}-{r}", case.procs, case.gib);
                let run = match api.block_on(one_run(&node, &client, &sim, &id, *case)) {
                    Ok(run) => run,
                    Err(e) => {
                        // A case that cannot run here (memory) is reported, and the rest go on.
                        println!(
                            "CUDA {cuda}, {} x {} GiB: FAILED: {e:#}",
                            case.procs, case.gib
                        );
                        let _ = node.ctr(&["task", "kill", "-s", "SIGKILL", &id]);
                        std::thread::sleep(Duration::from_millis(500));
                        let _ = node.ctr(&["task", "rm", "-f", &id]);
                        let _ = node.ctr(&["container", "rm", &id]);
                        let _ = wait_gpu_free(&sim);
                        break;
                    }
                };
                eprintln!(
                    "{id}: storage {}, checkpoint {:.2} s (device lock {:.0} ms, device checkpoint {:.0} ms, CRIU dump {:.0} ms), restore {:.2} s (device restore {:.0} ms, runc restore {:.0} ms); O_DIRECT write {:.2} s, read {:.2} s; {}",
                    run.storage,
                    secs(run.ctr_checkpoint),
                    secs(run.device_lock) * 1e3,
                    secs(run.device_checkpoint) * 1e3,
                    secs(run.criu_dump) * 1e3,
                    secs(run.restore),
                    secs(run.device_restore) * 1e3,
                    secs(run.runc_restore) * 1e3,
                    secs(run.base_write),
                    secs(run.base_read),
                    run.verified
                );
                runs.push(run);
            }
            results.push((cuda, *case, runs));
        }
    }
    report(&results, &o);
    Ok(())
}

fn mem_total_gib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib >> 20)
}

/// The container of a case: `procs` gpu-fills of `gib` GiB, process `i` on GPU `i` (a CDI
/// device each), logging to `/out/app-<i>.log`, under one shell.
fn run_args(case: Case) -> (Vec<String>, Vec<String>) {
    let mut flags = Vec::new();
    for i in 0..case.procs {
        flags.extend(["--device".to_string(), format!("{}={i}", simgpu::cdi::KIND)]);
    }
    flags.extend(["--mount".to_string(), OUT_TMPFS.to_string()]);
    let fill = gpu_fill_args(case.gib, None)
        .into_iter()
        .map(|a| if a == "0" { "$i".to_string() } else { a })
        .collect::<Vec<_>>()
        .join(" ");
    let script = format!(
        "i=0; while [ $i -lt {n} ]; do {fill} > /out/app-$i.log 2>&1 & i=$((i+1)); done; wait",
        n = case.procs
    );
    (flags, vec!["/bin/sh".into(), "-c".into(), script])
}

fn app_log(pid: i32, i: usize) -> PathBuf {
    format!("/proc/{pid}/root/out/app-{i}.log").into()
}

/// The host pids of the gpu-fills under the container's shell `pid`.
fn fills(pid: i32) -> Result<Vec<i32>> {
    let kids = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .with_context(|| format!("children of {pid}"))?;
    Ok(kids
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect())
}

fn rss_bytes(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib << 10)
}

async fn one_run(
    node: &Node,
    api: &Containerd,
    sim: &SimNode,
    id: &str,
    case: Case,
) -> Result<Run> {
    let (_, ours) = runtime_flags(node);
    let (flags, args) = run_args(case);
    let mut ctr: Vec<&str> = vec!["run", "-d"];
    ctr.extend(ours.iter().map(String::as_str));
    ctr.extend(flags.iter().map(String::as_str));
    ctr.extend([GPU_WORKLOADS_IMAGE, id]);
    ctr.extend(args.iter().map(String::as_str));
    let out = node.ctr_cdi("default", &ctr)?;
    if !out.status.success() {
        bail!("ctr run: {}", String::from_utf8_lossy(&out.stderr));
    }
    let pid = node.task_pid(id)?;
    for i in 0..case.procs {
        wait_text(&app_log(pid, i), "gpu-fill to fill", |log| {
            gpu_fill_failed(log)?;
            Ok(log.lines().any(|l| l.starts_with("filled ")).then_some(()))
        })?;
    }
    let dir = node.paths().dir.join(format!("bench-{id}"));
    let _ = std::fs::remove_dir_all(&dir);
    let warm = (case.bytes() >> 20).min(4096);
    settle(&node.paths().dir, warm)?;
    // RSS of the processes before, and its peak while the checkpoint runs (sampled).
    let procs = fills(pid)?;
    let before: u64 = procs.iter().map(|p| rss_bytes(*p)).sum();
    let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let (procs, on) = (procs.clone(), sampling.clone());
        std::thread::spawn(move || {
            let mut peak = 0u64;
            while on.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(procs.iter().map(|p| rss_bytes(*p)).sum());
                std::thread::sleep(Duration::from_millis(20));
            }
            peak
        })
    };
    let t = Instant::now();
    let ckpt = node.checkpoint_task_exit(id, &dir);
    let ctr_checkpoint = t.elapsed();
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let peak = sampler.join().unwrap_or(0);
    ckpt?;
    let mut run = Run {
        ctr_checkpoint,
        rss_growth: peak as f64 / before.max(1) as f64,
        ..Run::default()
    };
    read_manifest(&dir, &mut run)?;
    node.ctr_ok(&["task", "rm", id])?;
    wait_gpu_free(sim)?;
    settle(&node.paths().dir, warm)?;
    let from = log_len(node);
    let t = Instant::now();
    let restored = api.restore_from_image_path(id, &dir).await? as i32;
    run.restore = t.elapsed();
    let steps = shim_steps(&log_since(node, from), id);
    run.device_restore = steps.device_restore;
    run.runc_restore = steps.runc_restore;
    run.verified =
        verify(restored, case).with_context(|| format!("{id}: the restored gpu-fills"))?;
    node.ctr(&["task", "kill", "-s", "SIGKILL", id])?;
    std::thread::sleep(Duration::from_millis(300));
    node.ctr(&["task", "rm", id])?;
    node.ctr(&["container", "rm", id])?;
    wait_gpu_free(sim)?;
    // The baseline, in the same directory, the checkpoint's files gone first.
    let _ = std::fs::remove_dir_all(&dir);
    settle(&node.paths().dir, warm)?;
    let (w, r) = direct_io_baseline(&node.paths().dir, case)?;
    run.base_write = w;
    run.base_read = r;
    Ok(run)
}

/// The step timings, the storage path and the image's make-up from the checkpoint in `dir`.
fn read_manifest(dir: &Path, run: &mut Run) -> Result<()> {
    let path = dir.join(image_format::manifest::MANIFEST_FILE);
    let m: serde_json::Value = serde_json::from_slice(
        &std::fs::read(&path).with_context(|| format!("read {}", path.display()))?,
    )?;
    let timing = |step: &str| {
        let ms = m["timings"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|t| t["step"] == step)
            .filter_map(|t| t["millis"].as_f64())
            .sum::<f64>();
        Duration::from_secs_f64(ms / 1e3)
    };
    run.device_lock = timing("device-lock");
    run.device_checkpoint = timing("device-checkpoint");
    run.criu_dump = timing("criu-dump");
    run.storage = m["devices"]["storage"].as_str().unwrap_or("-").to_string();
    for e in walkdir(dir)? {
        let name = e.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let len = e.metadata().map_or(0, |m| m.len());
        if name.starts_with("pages-") && name.ends_with(".img") {
            run.pages_bytes += len;
        } else {
            run.other_bytes += len;
        }
    }
    Ok(())
}

/// Every regular file below `dir`.
fn walkdir(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).with_context(|| format!("read {}", d.display()))? {
            let e = e?;
            let t = e.file_type()?;
            if t.is_dir() {
                todo.push(e.path());
            } else if t.is_file() {
                out.push(e.path());
            }
        }
    }
    Ok(out)
}

/// Asks each restored gpu-fill (SIGUSR1) to verify every byte of its device memory; their
/// verdicts.
fn verify(pid: i32, case: Case) -> Result<String> {
    let procs = fills(pid)?;
    ensure!(
        procs.len() == case.procs,
        "{} gpu-fill processes restored, not {}",
        procs.len(),
        case.procs
    );
    for p in &procs {
        // SAFETY: a signal to a restored workload's process.
        if unsafe { libc::kill(*p, libc::SIGUSR1) } != 0 {
            bail!("kill -USR1 {p}: {}", std::io::Error::last_os_error());
        }
    }
    let want = format!("verified {} bytes", case.gib << 30);
    for i in 0..case.procs {
        wait_text(&app_log(pid, i), "gpu-fill to verify", |log| {
            gpu_fill_failed(log)?;
            match gpu_fill_verified(log).next() {
                Some(l) if l == want => Ok(Some(())),
                Some(l) => bail!("restored gpu-fill {i}: {l}"),
                None => Ok(None),
            }
        })?;
    }
    Ok(format!("{} x `{want}`", case.procs))
}

/// The storage baseline of a case: its bytes written by one thread per process, each its own
/// file in `dir`, with O_DIRECT in 16 MiB blocks and synced; then read back the same way.
fn direct_io_baseline(dir: &Path, case: Case) -> Result<(Duration, Duration)> {
    const BLOCK: usize = 16 << 20;
    let files: Vec<PathBuf> = (0..case.procs)
        .map(|i| dir.join(format!("bench-direct-{i}")))
        .collect();
    let per = case.gib << 30;
    let each = |write: bool| -> Result<Duration> {
        let t = Instant::now();
        std::thread::scope(|s| -> Result<()> {
            let jobs: Vec<_> = files
                .iter()
                .map(|f| s.spawn(move || direct_file(f, per, BLOCK, write)))
                .collect();
            for j in jobs {
                j.join()
                    .map_err(|_| anyhow::anyhow!("a baseline thread panicked"))??;
            }
            Ok(())
        })?;
        Ok(t.elapsed())
    };
    let result = each(true).and_then(|w| Ok((w, each(false)?)));
    for f in &files {
        let _ = std::fs::remove_file(f);
    }
    result
}

/// A buffer of `len` bytes aligned for O_DIRECT, filled with a non-zero pattern.
struct Aligned {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Aligned {
    fn new(len: usize) -> Result<Aligned> {
        let layout = std::alloc::Layout::from_size_align(len, 4096)?;
        // SAFETY: a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        ensure!(!ptr.is_null(), "out of memory for a {len}-byte buffer");
        let mut a = Aligned { ptr, layout };
        for (i, b) in a.bytes().iter_mut().enumerate() {
            *b = (i % 251) as u8 ^ 0x5a;
        }
        Ok(a)
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` holds `layout.size()` bytes this value owns.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `new`.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

fn direct_file(path: &Path, len: u64, block: usize, write: bool) -> Result<()> {
    let mut buf = Aligned::new(block)?;
    let mut f = std::fs::OpenOptions::new()
        .read(!write)
        .write(write)
        .create(write)
        .truncate(write)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .with_context(|| format!("open {} with O_DIRECT", path.display()))?;
    let mut done = 0u64;
    while done < len {
        let n = block.min((len - done) as usize);
        if write {
            f.write_all(&buf.bytes()[..n])?;
        } else {
            f.read_exact(&mut buf.bytes()[..n])?;
        }
        done += n as u64;
    }
    if write {
        f.sync_all()?;
    }
    Ok(())
}

/// Markdown: one row per case and CUDA version, then the ratios the goals name.
fn report(results: &[(i32, Case, Vec<Run>)], o: &Opts) {
    let med = |runs: &[Run], f: fn(&Run) -> Duration| -> f64 {
        median_f64(runs.iter().map(|r| secs(f(r))).collect())
    };
    println!("| CUDA | storage | processes x GiB | ctr checkpoint | device lock | device checkpoint | CRIU dump | O_DIRECT write | device checkpoint / write | restore | device restore + unlock | runc restore | O_DIRECT read | device restore / read | page images | other files | RSS peak / before |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for (cuda, c, runs) in results.iter().filter(|r| !r.2.is_empty()) {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let dc = med(runs, |r| r.device_checkpoint);
        let dr = med(runs, |r| r.device_restore);
        let bw = med(runs, |r| r.base_write);
        let br = med(runs, |r| r.base_read);
        println!(
            "| {cuda} | {} | {} x {} | {:.2} s | {:.1} ms | {:.3} s | {:.3} s | {bw:.3} s | {:.2} | {:.2} s | {dr:.3} s | {:.3} s | {br:.3} s | {:.2} | {:.2} GiB | {:.2} GiB | {:.2} |",
            runs[0].storage,
            c.procs,
            c.gib,
            med(runs, |r| r.ctr_checkpoint),
            med(runs, |r| r.device_lock) * 1e3,
            dc,
            med(runs, |r| r.criu_dump),
            dc / bw,
            med(runs, |r| r.restore),
            med(runs, |r| r.runc_restore),
            dr / br,
            gib(runs[0].pages_bytes),
            gib(runs[0].other_bytes),
            median_f64(runs.iter().map(|r| r.rss_growth).collect()),
        );
    }
    println!();
    let find = |cuda: i32, c: Case| {
        results
            .iter()
            .find(|r| r.0 == cuda && r.1 == c && !r.2.is_empty())
            .map(|r| r.2.as_slice())
    };
    let verdict = |x: f64, goal: f64| if x <= goal { "met" } else { "missed" };
    for (cuda, c, runs) in results.iter().filter(|r| !r.2.is_empty()) {
        let dc = med(runs, |r| r.device_checkpoint) / med(runs, |r| r.base_write);
        let dr = med(runs, |r| r.device_restore) / med(runs, |r| r.base_read);
        let goal = if runs[0].storage == "custom" {
            format!(
                " (goal ≤ 1.25: checkpoint {}, restore {})",
                verdict(dc, 1.25),
                verdict(dr, 1.25)
            )
        } else {
            String::new()
        };
        println!(
            "CUDA {cuda} ({}), {} x {} GiB: device checkpoint / O_DIRECT write {dc:.3}, device restore / O_DIRECT read {dr:.3}{goal}",
            runs[0].storage, c.procs, c.gib
        );
    }
    for &cuda in &o.cuda {
        let one = Case {
            procs: 1,
            gib: o.proc_gib,
        };
        let Some(base) = find(cuda, one) else {
            continue;
        };
        for &p in o.procs.iter().filter(|p| **p > 1) {
            let Some(many) = find(cuda, Case { procs: p, ..one }) else {
                continue;
            };
            let ck = med(many, |r| r.device_checkpoint) / med(base, |r| r.device_checkpoint);
            let rs = med(many, |r| r.device_restore) / med(base, |r| r.device_restore);
            println!(
                "CUDA {cuda}: {p} processes / 1 process ({} GiB each): device checkpoint {ck:.3}, device restore {rs:.3} (goal ≤ 1.3: {}, {})",
                o.proc_gib,
                verdict(ck, 1.3),
                verdict(rs, 1.3)
            );
        }
    }
    if let [custom, staged, ..] = o.cuda[..] {
        for (_, c, runs) in results.iter().filter(|r| r.0 == custom && !r.2.is_empty()) {
            let Some(s) = find(staged, *c) else { continue };
            let total = |r: &Run| r.device_lock + r.device_checkpoint + r.criu_dump;
            println!(
                "{} x {} GiB: CUDA {staged} / CUDA {custom}: device checkpoint {:.3}, device steps + CRIU dump {:.3}, ctr checkpoint {:.3}, device restore {:.3}, restore {:.3}",
                c.procs,
                c.gib,
                med(s, |r| r.device_checkpoint) / med(runs, |r| r.device_checkpoint),
                med(s, total) / med(runs, total),
                med(s, |r| r.ctr_checkpoint) / med(runs, |r| r.ctr_checkpoint),
                med(s, |r| r.device_restore) / med(runs, |r| r.device_restore),
                med(s, |r| r.restore) / med(runs, |r| r.restore),
            );
        }
    }
    for (cuda, c, runs) in results {
        if let Some(r) = runs.last() {
            println!(
                "CUDA {cuda}, {} x {} GiB: restored intact: {}",
                c.procs, c.gib, r.verified
            );
        }
    }
}
