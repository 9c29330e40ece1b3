//! gpu-ckpt-gpu-check: the real-GPU check, run from `target/gpu-check/run.sh`.
//!
//! On a machine with an NVIDIA GPU: prints the node inventory, runs cuda_smoke and a short
//! gpu-train, starts gpu-fill as a child, and takes it through lock, checkpoint, (CRIU dump and
//! restore, when CRIU is there and works), restore (swapping two GPUs of the same model) and
//! unlock through the project's gpu crate; then has the filler verify every byte. It times each
//! step, and compares the checkpoint's device-to-host and the restore's host-to-device rates with
//! a plain pinned-memory cuMemcpy of the same size on the same GPUs, measured in the same run.
//!
//! Figures are printed one per line as `name value unit`; other lines start with `# `.
//! Without a GPU (no libcuda.so.1, or no device) it prints one line with the reason and exits 0.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use gpu::{DeviceCheckpoint, GpuPair, GpuUuid, Inventory, ProcessState};
use gpu_ckpt_gpu_workloads::cli::{number, pairs, value};
use gpu_ckpt_gpu_workloads::driver::{CudaError, Driver, Gpu, CUDA_ERROR_NO_DEVICE};
use gpu_ckpt_gpu_workloads::emit;

const USAGE: &str = "usage: gpu-ckpt-gpu-check [--fill PATH] [--train PATH] [--smoke PATH] \
[--gib N | --mib M] [--criu PATH | --no-criu] [--work-dir DIR] [--deadline-s S]";

/// The filler's pid, for the watchdog to kill.
static FILLER: AtomicI32 = AtomicI32::new(0);

struct Opts {
    fill: PathBuf,
    train: PathBuf,
    smoke: PathBuf,
    bytes: u64,
    criu: Option<PathBuf>,
    no_criu: bool,
    work_dir: Option<PathBuf>,
    deadline: Duration,
}

fn parse(args: &[String]) -> Result<Opts, String> {
    let here = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("."));
    let mut o = Opts {
        fill: here.join("gpu-fill"),
        train: here.join("gpu-train"),
        smoke: here.join("cuda_smoke"),
        bytes: 4 << 30,
        criu: None,
        no_criu: false,
        work_dir: None,
        deadline: Duration::from_secs(280),
    };
    let valued = [
        "--fill",
        "--train",
        "--smoke",
        "--gib",
        "--mib",
        "--criu",
        "--work-dir",
        "--deadline-s",
    ];
    for (f, v) in pairs(args, &["--no-criu"], &valued)? {
        match f.as_str() {
            "--fill" => o.fill = value(&f, &v)?.into(),
            "--train" => o.train = value(&f, &v)?.into(),
            "--smoke" => o.smoke = value(&f, &v)?.into(),
            "--gib" => o.bytes = number::<u64>(&f, &v)? << 30,
            "--mib" => o.bytes = number::<u64>(&f, &v)? << 20,
            "--criu" => o.criu = Some(value(&f, &v)?.into()),
            "--no-criu" => o.no_criu = true,
            "--work-dir" => o.work_dir = Some(value(&f, &v)?.into()),
            "--deadline-s" => o.deadline = Duration::from_secs(number(&f, &v)?),
            _ => return Err(format!("unknown flag {f}")),
        }
    }
    if o.bytes < 1 << 20 {
        return Err("the fill size must be at least 1 MiB".into());
    }
    Ok(o)
}

fn main() {
    let Some(args) = gpu_ckpt_gpu_workloads::args_or_help(USAGE) else {
        return;
    };
    let o = match parse(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("gpu-ckpt-gpu-check: {e}\n{USAGE}");
            std::process::exit(2);
        }
    };
    let code = match run(&o) {
        Ok(Outcome::Skipped(reason)) => {
            emit(&format!("gpu-check: skipped: {reason}"));
            0
        }
        Ok(Outcome::Done { failures }) if failures.is_empty() => {
            emit("gpu-check ok");
            0
        }
        Ok(Outcome::Done { failures }) => {
            emit(&format!("gpu-check FAILED: {}", failures.join("; ")));
            1
        }
        Err(e) => {
            emit(&format!("gpu-check FAILED: {e}"));
            1
        }
    };
    kill_filler(libc::SIGKILL);
    std::process::exit(code);
}

enum Outcome {
    Skipped(String),
    Done { failures: Vec<String> },
}

fn figure(name: &str, value: f64, unit: &str) {
    emit(&format!("{name} {value:.3} {unit}"));
}

/// The figure `name`: how many times `den` fits into `num`.
fn ratio(name: &str, num: Duration, den: Duration) {
    figure(name, num.as_secs_f64() / den.as_secs_f64().max(1e-9), "x");
}

/// A whole-number figure (bytes, versions).
fn figure_n(name: &str, value: u64, unit: &str) {
    emit(&format!("{name} {value} {unit}"));
}

fn info(s: &str) {
    emit(&format!("# {s}"));
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64().max(1e-9) / 1e9
}

fn cuda(e: CudaError) -> String {
    e.to_string()
}

fn run(o: &Opts) -> Result<Outcome, String> {
    // Our own bindings first: this is the process's first cuInit, which is what is timed.
    let driver = match Driver::load() {
        Ok(d) => d,
        Err(CudaError::NoDriver(d)) => {
            return Ok(Outcome::Skipped(format!("no NVIDIA driver ({d})")))
        }
        Err(e) => return Err(e.to_string()),
    };
    let t = Instant::now();
    let init = driver.init();
    let cuinit = t.elapsed();
    match init {
        Ok(()) => {}
        Err(e) if e.code() == Some(CUDA_ERROR_NO_DEVICE) => {
            return Ok(Outcome::Skipped(format!("no CUDA device ({e})")))
        }
        Err(e) => return Err(e.to_string()),
    }
    let count = driver.device_count().map_err(cuda)?;
    if count == 0 {
        return Ok(Outcome::Skipped(
            "no CUDA device (cuDeviceGetCount = 0)".into(),
        ));
    }
    start_watchdog(o.deadline);
    // SAFETY: prctl with plain integer arguments. As a subreaper, a filler restored by
    // `criu restore -d` becomes our child again, so that we can wait for it.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };

    let mut failures = Vec::new();
    figure("cuinit", ms(cuinit), "ms");
    let version = driver.driver_version().map_err(cuda)?;
    figure_n("cuda_driver_version", version.max(0) as u64, "version");

    // The node, through NVML (the gpu crate), and what CUDA says about each device.
    let mut models = Vec::new();
    match gpu::NvmlInventory::load().and_then(|n| n.node()) {
        Ok(node) => {
            info(&format!(
                "inventory: driver {} cuda {} gpus {}",
                node.driver_version,
                node.cuda_driver_version,
                node.gpus.len()
            ));
            for g in &node.gpus {
                info(&format!(
                    "gpu {} {} {:?} {} bytes ({:?} free) cc {:?} arch {:?} pci {} persistence {:?} minor {:?}",
                    g.index,
                    g.uuid,
                    g.name,
                    g.memory_total_bytes,
                    g.memory_free_bytes,
                    g.compute_capability,
                    g.architecture,
                    g.pci_bus_id,
                    g.persistence_mode,
                    g.minor_number
                ));
                // The shim finds a container's GPUs by the minor number of /dev/nvidiaN. The
                // simulator has no device nodes (its CDI files stand for them).
                match check_device_node(g.minor_number) {
                    Err(e) if Path::new("/dev/nvidiactl").exists() => {
                        failures.push(format!("gpu {}: {e}", g.index))
                    }
                    Err(e) => info(&format!("gpu {}: no device node: {e}", g.index)),
                    Ok(()) => {}
                }
            }
        }
        Err(e) => failures.push(format!("NVML inventory: {e}")),
    }
    for ord in 0..count {
        let dev = driver.device_get(ord).map_err(cuda)?;
        let name = driver.device_name(dev).map_err(cuda)?;
        let uuid = GpuUuid(driver.device_uuid(dev).map_err(cuda)?);
        let total = driver.device_total_mem(dev).map_err(cuda)? as u64;
        info(&format!("cuda device {ord} {uuid} {name:?} {total} bytes"));
        models.push((uuid, name, total));
    }

    // Plain driver-API programs.
    let t = Instant::now();
    match run_program(&o.smoke, &[], Duration::from_secs(60)) {
        Ok(out) if out.lines().any(|l| l == "cuda_smoke ok") => {
            info("cuda_smoke ok");
            figure("cuda_smoke", ms(t.elapsed()), "ms");
        }
        Ok(out) => failures.push(format!("cuda_smoke: {}", last_line(&out))),
        Err(e) => failures.push(format!("cuda_smoke: {e}")),
    }
    let steps = 20;
    let t = Instant::now();
    let train_args = ["--devices", "all", "--steps", "20", "--interval-ms", "0"];
    match run_program(&o.train, &train_args, Duration::from_secs(60)) {
        Ok(out)
            if out
                .lines()
                .any(|l| l.starts_with(&format!("step {steps} checksum "))) =>
        {
            info(&format!("gpu-train: {}", last_line(&out)));
            figure("gpu_train_step", ms(t.elapsed()) / steps as f64, "ms");
        }
        Ok(out) => failures.push(format!("gpu-train: {}", last_line(&out))),
        Err(e) => failures.push(format!("gpu-train: {e}")),
    }

    // Size: 4 GiB per GPU unless the GPU or the host is too small for it.
    let min_total = models.iter().map(|m| m.2).min().unwrap_or(0);
    let avail = mem_available().unwrap_or(u64::MAX);
    let mut bytes = o
        .bytes
        .min(min_total / 100 * 35)
        .min(avail / 2 / count as u64);
    bytes &= !((1 << 20) - 1);
    if bytes < 1 << 20 {
        return Err(format!(
            "too little memory for the check (GPU {min_total} bytes, host available {avail})"
        ));
    }
    if bytes != o.bytes {
        info(&format!(
            "fill size reduced to {bytes} bytes per GPU to fit"
        ));
    }
    let total = bytes * count as u64;
    figure_n("fill_bytes_per_gpu", bytes, "bytes");

    // Baseline: one plain pinned-memory cuMemcpy of the same size, each way, on each GPU.
    let mut base_d2h = Duration::ZERO;
    let mut base_h2d = Duration::ZERO;
    for ord in 0..count {
        let (h2d, d2h) = pinned_copy(&driver, ord, bytes as usize).map_err(cuda)?;
        figure(&format!("pinned_h2d_gpu{ord}"), gbps(bytes, h2d), "GB/s");
        figure(&format!("pinned_d2h_gpu{ord}"), gbps(bytes, d2h), "GB/s");
        base_h2d += h2d;
        base_d2h += d2h;
    }

    // The filler, in its own session with its output in a file (so that CRIU can dump it).
    let work = match &o.work_dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("gpu-check-{}", std::process::id())),
    };
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(|e| format!("mkdir {}: {e}", work.display()))?;
    let log_path = work.join("gpu-fill.log");
    let log = File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
    let log2 = log.try_clone().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(&o.fill);
    cmd.args([
        "--mib",
        &(bytes >> 20).to_string(),
        "--devices",
        "all",
        "--show-uuids",
    ])
    .current_dir(&work)
    .stdin(Stdio::null())
    .stdout(log)
    .stderr(log2);
    // SAFETY: setsid is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let t = Instant::now();
    let child = cmd
        .spawn()
        .map_err(|e| format!("starting {}: {e}", o.fill.display()))?;
    let pid = child.id() as i32;
    drop(child); // waited for with waitpid below
    FILLER.store(pid, Ordering::SeqCst);
    let mut reader = LogReader::new(log_path.clone());
    let line = reader.wait_for(
        pid,
        &["filled ", "MISMATCH", "gpu-fill:"],
        Duration::from_secs(150),
    )?;
    if !line.starts_with("filled ") {
        return Err(format!("gpu-fill: {line}"));
    }
    figure("fill", ms(t.elapsed()), "ms");
    info(&format!("gpu-fill pid {pid}: {line}"));

    // The shim finds the processes to quiesce through NVML's compute processes.
    match gpu::NvmlInventory::load().and_then(|n| n.compute_processes()) {
        Ok(procs) => {
            let mine: Vec<_> = procs.iter().filter(|p| p.pid == pid as u32).collect();
            info(&format!("nvml compute processes: {procs:?}"));
            let held: u64 = mine.iter().filter_map(|p| p.used_bytes).sum();
            if mine.len() != count as usize || held < total {
                failures.push(format!(
                    "NVML lists pid {pid} on {} of {count} GPUs holding {held} bytes (filled {total})",
                    mine.len()
                ));
            }
        }
        Err(e) => failures.push(format!("NVML compute processes: {e}")),
    }
    let cuda_ck = gpu::CudaDriver::load().map_err(|e| e.to_string())?;
    let tid = cuda_ck.restore_thread_id(pid).map_err(|e| e.to_string())?;
    info(&format!("restore thread of pid {pid}: {tid}"));
    in_state(
        &cuda_ck,
        pid,
        ProcessState::RUNNING,
        &["checkpoint", "restore", "unlock"],
    )?;
    let plain = Command::new("sleep").arg("30").spawn();
    if let Ok(mut p) = plain {
        let ppid = p.id() as i32;
        info(&format!(
            "driver answer: restore_thread_id of a process without CUDA -> {:?}",
            cuda_ck.restore_thread_id(ppid).map_err(|e| e.to_string())
        ));
        info(&format!(
            "driver answer: state of a process without CUDA -> {:?}",
            cuda_ck.state(ppid).map_err(|e| e.to_string())
        ));
        let _ = p.kill();
        let _ = p.wait();
    }

    let mut guard = Undo {
        ck: &cuda_ck,
        pid,
        armed: true,
    };
    let t = Instant::now();
    cuda_ck
        .lock(pid, Some(Duration::from_secs(30)))
        .map_err(|e| e.to_string())?;
    let lock = t.elapsed();
    in_state(&cuda_ck, pid, ProcessState::LOCKED, &["lock", "restore"])?;
    let rss_before = rss(pid);
    let t = Instant::now();
    cuda_ck.checkpoint(pid).map_err(|e| e.to_string())?;
    let checkpoint = t.elapsed();
    in_state(
        &cuda_ck,
        pid,
        ProcessState::CHECKPOINTED,
        &["lock", "checkpoint", "unlock"],
    )?;
    if let (Some(a), Some(b)) = (rss_before, rss(pid)) {
        figure(
            "filler_rss_growth_at_checkpoint",
            b.saturating_sub(a) as f64,
            "bytes",
        );
    }

    match criu_round_trip(o, &work, pid) {
        Ok(CriuResult::Skipped(why)) => info(&format!("criu: skipped: {why}")),
        Ok(CriuResult::Done {
            dump,
            restore,
            image_bytes,
        }) => {
            info(&format!("criu: dumped and restored pid {pid}"));
            figure("criu_dump", ms(dump), "ms");
            figure("criu_restore", ms(restore), "ms");
            figure_n("criu_image", image_bytes, "bytes");
        }
        Ok(CriuResult::DumpFailed(why)) => {
            failures.push(format!("criu dump: {why}"));
        }
        Err(e) => {
            // The filler is gone (dumped but not restored): nothing left to restore.
            guard.armed = false;
            return Err(format!("criu restore: {e}"));
        }
    }

    // Restore, swapping the first two GPUs where they are the same model.
    let mut remap = Vec::new();
    let swap = count >= 2
        && models[0].1 == models[1].1
        && models[0].2 == models[1].2
        && cuda_ck.supports_remap();
    if swap {
        for (i, m) in models.iter().enumerate() {
            let new = match i {
                0 => models[1].0,
                1 => models[0].0,
                _ => m.0,
            };
            remap.push(GpuPair { old: m.0, new });
        }
        info(&format!(
            "restore remaps {} <-> {}",
            models[0].0, models[1].0
        ));
    } else if count >= 2 {
        info("restore without remapping (GPUs differ, or the driver has no remapping)");
    }
    let t = Instant::now();
    cuda_ck.restore(pid, &remap).map_err(|e| e.to_string())?;
    let restore = t.elapsed();
    expect_state(&cuda_ck, pid, ProcessState::LOCKED)?;
    let t = Instant::now();
    cuda_ck.unlock(pid).map_err(|e| e.to_string())?;
    let unlock = t.elapsed();
    guard.armed = false;
    expect_state(&cuda_ck, pid, ProcessState::RUNNING)?;

    figure("lock", ms(lock), "ms");
    figure("checkpoint", ms(checkpoint), "ms");
    figure("restore", ms(restore), "ms");
    figure("unlock", ms(unlock), "ms");
    figure_n("checkpoint_bytes", total, "bytes");
    figure("checkpoint_d2h", gbps(total, checkpoint), "GB/s");
    figure("pinned_d2h", gbps(total, base_d2h), "GB/s");
    ratio("ratio_checkpoint_vs_pinned_d2h", base_d2h, checkpoint);
    figure("restore_h2d", gbps(total, restore), "GB/s");
    figure("pinned_h2d", gbps(total, base_h2d), "GB/s");
    ratio("ratio_restore_vs_pinned_h2d", base_h2d, restore);
    ratio("ratio_cuinit_vs_restore", cuinit, restore);

    // The filler checks every byte.
    signal(pid, libc::SIGUSR1)?;
    let t = Instant::now();
    let line = reader.wait_for(
        pid,
        &["verified ", "MISMATCH", "gpu-fill:"],
        Duration::from_secs(150),
    )?;
    if line.starts_with("verified ") {
        info(&format!("gpu-fill: {line}"));
        figure("verify", ms(t.elapsed()), "ms");
    } else {
        failures.push(format!("gpu-fill after restore: {line}"));
    }
    for l in reader.lines_so_far() {
        if l.starts_with("device ") {
            info(&format!("gpu-fill: {l}"));
        }
    }
    signal(pid, libc::SIGTERM)?;
    match wait_exit(pid, Duration::from_secs(20)) {
        Some(0) => {}
        Some(c) => failures.push(format!("gpu-fill exited with status {c} on SIGTERM")),
        None => failures.push("gpu-fill did not exit on SIGTERM".into()),
    }
    FILLER.store(0, Ordering::SeqCst);
    let _ = std::fs::remove_dir_all(&work);
    Ok(Outcome::Done { failures })
}

/// On an early return between lock and unlock: put the filler back to RUNNING.
struct Undo<'a> {
    ck: &'a gpu::CudaDriver,
    pid: i32,
    armed: bool,
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if self.ck.state(self.pid).ok() == Some(ProcessState::CHECKPOINTED) {
            if let Err(e) = self.ck.restore(self.pid, &[]) {
                info(&format!("undo: restore: {e}"));
            }
        }
        if self.ck.state(self.pid).ok() == Some(ProcessState::LOCKED) {
            if let Err(e) = self.ck.unlock(self.pid) {
                info(&format!("undo: unlock: {e}"));
            }
        }
    }
}

/// `/dev/nvidiaN` for the minor number NVML reports is a character device with that minor.
fn check_device_node(minor: Option<u32>) -> Result<(), String> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let minor = minor.ok_or("NVML reports no minor number")?;
    let path = format!("/dev/nvidia{minor}");
    let md = std::fs::metadata(&path).map_err(|e| format!("{path}: {e}"))?;
    let got = libc::minor(md.rdev());
    if !md.file_type().is_char_device() || got != minor {
        return Err(format!(
            "{path} is not the character device of minor {minor} (minor {got})"
        ));
    }
    Ok(())
}

/// What the driver answers to each step called on `pid` in the wrong state, printed so that the
/// simulator's answers (gpu/tests/sim.rs) can be held to the real driver's. The process's state
/// must not change.
fn answers(ck: &gpu::CudaDriver, pid: i32, state: &str, steps: &[&str]) {
    for step in steps {
        let r = match *step {
            "lock" => ck.lock(pid, Some(Duration::from_millis(100))),
            "checkpoint" => ck.checkpoint(pid),
            "restore" => ck.restore(pid, &[]),
            _ => ck.unlock(pid),
        };
        let after = ck
            .state(pid)
            .map(|s| s.to_string())
            .unwrap_or_else(|e| e.to_string());
        info(&format!(
            "driver answer: {step} on {state} -> {:?}; state after: {after}",
            r.map_err(|e| e.to_string())
        ));
    }
}

/// [`expect_state`], then [`answers`] to `steps` in that state.
fn in_state(
    ck: &gpu::CudaDriver,
    pid: i32,
    want: ProcessState,
    steps: &[&str],
) -> Result<(), String> {
    expect_state(ck, pid, want)?;
    answers(ck, pid, &want.name().to_uppercase(), steps);
    Ok(())
}

fn expect_state(ck: &gpu::CudaDriver, pid: i32, want: ProcessState) -> Result<(), String> {
    let s = ck.state(pid).map_err(|e| e.to_string())?;
    if s != want {
        return Err(format!("pid {pid} is {s}, expected {want}"));
    }
    Ok(())
}

/// One pinned HtoD and one pinned DtoH of `bytes` on device `ord`: (h2d, d2h).
fn pinned_copy(driver: &Driver, ord: i32, bytes: usize) -> Result<(Duration, Duration), CudaError> {
    let gpu = Gpu::open(driver, ord)?;
    let dptr = driver.mem_alloc(bytes)?;
    let result = (|| {
        let mut host = driver.pinned(bytes)?;
        // Touch every page first, so that neither copy pays for faults.
        host.as_mut_slice().fill(0x5a);
        driver.memcpy_htod(dptr, host.as_slice())?; // warm-up of the path
        driver.ctx_synchronize()?;
        let t = Instant::now();
        driver.memcpy_htod(dptr, host.as_slice())?;
        driver.ctx_synchronize()?;
        let h2d = t.elapsed();
        let t = Instant::now();
        driver.memcpy_dtoh(host.as_mut_slice(), dptr)?;
        driver.ctx_synchronize()?;
        let d2h = t.elapsed();
        Ok((h2d, d2h))
    })();
    driver.mem_free(dptr)?;
    driver.primary_ctx_release(gpu.dev)?;
    result
}

enum CriuResult {
    Skipped(String),
    /// The dump failed and the filler kept running (still CHECKPOINTED).
    DumpFailed(String),
    Done {
        dump: Duration,
        restore: Duration,
        image_bytes: u64,
    },
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(name))
            .find(|c| c.is_file())
    })
}

/// Dumps the (checkpointed) filler with CRIU and restores it, where CRIU is there and works.
/// `Err` only when the filler was dumped (and so killed) but could not be restored.
fn criu_round_trip(o: &Opts, work: &Path, pid: i32) -> Result<CriuResult, String> {
    if o.no_criu {
        return Ok(CriuResult::Skipped("--no-criu".into()));
    }
    let criu = match o.criu.clone().or_else(|| find_on_path("criu")) {
        Some(c) => c,
        None => return Ok(CriuResult::Skipped("no criu on PATH".into())),
    };
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(CriuResult::Skipped(format!(
            "{} needs root",
            criu.display()
        )));
    }
    match Command::new(&criu).arg("check").output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => {
            let why = String::from_utf8_lossy(&out.stderr);
            return Ok(CriuResult::Skipped(format!(
                "`{} check` failed: {}",
                criu.display(),
                last_line(&why)
            )));
        }
        Err(e) => return Ok(CriuResult::Skipped(format!("{}: {e}", criu.display()))),
    }
    let images = work.join("criu-images");
    // An empty plugin directory: CRIU's own CUDA plugin must not act on a process that the
    // driver has already checkpointed.
    let plugins = work.join("criu-no-plugins");
    for d in [&images, &plugins] {
        std::fs::create_dir_all(d).map_err(|e| format!("mkdir {}: {e}", d.display()))?;
    }
    let t = Instant::now();
    let out = Command::new(&criu)
        .arg("dump")
        .args(["-t", &pid.to_string()])
        .arg("-D")
        .arg(&images)
        .arg("-L")
        .arg(&plugins)
        .args(["-o", "dump.log", "-v4"])
        .output()
        .map_err(|e| format!("{}: {e}", criu.display()))?;
    let dump = t.elapsed();
    if !out.status.success() {
        let log = std::fs::read_to_string(images.join("dump.log")).unwrap_or_default();
        // A failed dump leaves the task running; make sure of it.
        if !alive(pid) {
            return Err(format!(
                "criu dump failed and pid {pid} is gone: {}",
                last_line(&log)
            ));
        }
        return Ok(CriuResult::DumpFailed(format!(
            "{} ({})",
            out.status,
            last_line(&log)
        )));
    }
    // The dumped task was killed; reap it so that its pid is free for the restore.
    let _ = wait_exit(pid, Duration::from_secs(10));
    let image_bytes = dir_bytes(&images);
    let t = Instant::now();
    let out = Command::new(&criu)
        .arg("restore")
        .arg("-D")
        .arg(&images)
        .arg("-L")
        .arg(&plugins)
        .args(["-d", "-o", "restore.log", "-v4"])
        .output()
        .map_err(|e| format!("{}: {e}", criu.display()))?;
    let restore = t.elapsed();
    if !out.status.success() {
        let log = std::fs::read_to_string(images.join("restore.log")).unwrap_or_default();
        return Err(format!("{} ({})", out.status, last_line(&log)));
    }
    if !alive(pid) {
        return Err(format!("criu restore succeeded but pid {pid} is not there"));
    }
    Ok(CriuResult::Done {
        dump,
        restore,
        image_bytes,
    })
}

fn dir_bytes(d: &Path) -> u64 {
    std::fs::read_dir(d)
        .map(|it| {
            it.filter_map(|e| e.ok()?.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// Runs a program to completion (or kills it at `timeout`); its stdout and stderr.
fn run_program(path: &Path, args: &[&str], timeout: Duration) -> Result<String, String> {
    let mut child = Command::new(path)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let mut stdout = child.stdout.take();
    let mut stderr = child.stderr.take();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(o) = stdout.as_mut() {
            let _ = o.read_to_string(&mut s);
        }
        if let Some(e) = stderr.as_mut() {
            let _ = e.read_to_string(&mut s);
        }
        s
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("timed out after {timeout:?}"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(e.to_string()),
        }
    };
    let out = reader.join().unwrap_or_default();
    if !status.success() {
        return Err(format!("{status}: {}", last_line(&out)));
    }
    Ok(out)
}

fn last_line(s: &str) -> String {
    s.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("(no output)")
        .to_string()
}

/// Follows the filler's log file.
struct LogReader {
    path: PathBuf,
    pos: u64,
    partial: String,
    lines: Vec<String>,
}

impl LogReader {
    fn new(path: PathBuf) -> LogReader {
        LogReader {
            path,
            pos: 0,
            partial: String::new(),
            lines: Vec::new(),
        }
    }

    fn poll(&mut self) -> Vec<String> {
        let mut buf = Vec::new();
        if let Ok(mut f) = File::open(&self.path) {
            if f.seek(SeekFrom::Start(self.pos)).is_ok() {
                let _ = f.read_to_end(&mut buf);
            }
        }
        self.pos += buf.len() as u64;
        self.partial.push_str(&String::from_utf8_lossy(&buf));
        let mut new = Vec::new();
        while let Some(i) = self.partial.find('\n') {
            let line: String = self.partial.drain(..=i).collect();
            new.push(line.trim_end().to_string());
        }
        self.lines.extend(new.iter().cloned());
        new
    }

    fn lines_so_far(&mut self) -> Vec<String> {
        self.poll();
        self.lines.clone()
    }

    /// The first new line starting with one of `prefixes`; an error if the process exits or the
    /// time runs out first.
    fn wait_for(
        &mut self,
        pid: i32,
        prefixes: &[&str],
        timeout: Duration,
    ) -> Result<String, String> {
        let deadline = Instant::now() + timeout;
        loop {
            for l in self.poll() {
                if prefixes.iter().any(|p| l.starts_with(p)) {
                    return Ok(l);
                }
            }
            if !alive(pid) {
                self.poll();
                return Err(format!(
                    "gpu-fill (pid {pid}) exited: {}",
                    self.lines
                        .last()
                        .map(String::as_str)
                        .unwrap_or("(no output)")
                ));
            }
            if Instant::now() > deadline {
                return Err(format!("gpu-fill: no {prefixes:?} line within {timeout:?}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Whether `pid` still runs (reaping it if it is our exited child).
fn alive(pid: i32) -> bool {
    let mut status = 0;
    // SAFETY: plain waitpid on a pid; WNOHANG never blocks.
    let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    if r == pid {
        return false;
    }
    // SAFETY: signal 0 only checks for existence.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// Waits for our child `pid` to exit: its exit code (128 + signal when killed).
fn wait_exit(pid: i32, timeout: Duration) -> Option<i32> {
    let deadline = Instant::now() + timeout;
    loop {
        let mut status = 0;
        // SAFETY: as in `alive`.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            return Some(if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status)
            } else {
                128 + libc::WTERMSIG(status)
            });
        }
        if r < 0 {
            return None;
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(pid: i32, sig: i32) -> Result<(), String> {
    // SAFETY: kill with a pid and a signal number.
    if unsafe { libc::kill(pid, sig) } != 0 {
        return Err(format!(
            "kill({pid}, {sig}): {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

fn kill_filler(sig: i32) {
    let pid = FILLER.swap(0, Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: as in `signal`.
        unsafe { libc::kill(pid, sig) };
    }
}

/// The whole check must end within `deadline`, even if a driver call hangs.
fn start_watchdog(deadline: Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(deadline);
        emit(&format!(
            "gpu-check FAILED: did not finish within {deadline:?}"
        ));
        kill_filler(libc::SIGKILL);
        std::process::exit(1);
    });
}

fn rss(pid: i32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let l = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = l.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let l = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = l.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
