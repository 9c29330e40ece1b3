//! The driver's checkpoint calls, run in a child process so that a call stuck in the driver can
//! be abandoned: [`WorkerDriver`] is a [`DeviceCheckpoint`] whose every call has a bound, past
//! which the worker is killed and the call fails naming itself, its pid and the bound.
//!
//! The worker is this binary re-executed (`/proc/self/exe device-worker <driver library dir>`,
//! dispatched in `main.rs` before the shim starts); it loads [`gpu::CudaDriver`] and serves one
//! call at a time over its stdin and stdout, a JSON document a line ([`Call`] in, [`Message`]
//! out). Before each driver call it says which one it makes ([`Message::Calling`]), so that the
//! bound is that call's own and the error names the call that did not return (a lock that reads
//! the state back can be stuck in either). A custom-storage call (`checkpoint_to`,
//! `restore_from`: the worker copies the device memory to or from the checkpoint's files itself)
//! is bounded as a whole by the checkpoint or restore bound of the process's device bytes.
//!
//! Workers form a pool per shim and driver: each serves one call at a time; a call takes an idle
//! worker, or starts one (`cuInit`) while fewer than the cap are alive, or waits for one; a
//! worker goes back to the pool when its call returns, so that calls on different processes
//! (the device steps of a container's GPU processes, run in parallel) run at once. A worker
//! killed past a bound, or by [`abandon`](DeviceCheckpoint::abandon) (which kills only the
//! workers serving calls on that process), leaves the pool; a later call starts a fresh one.
//!
//! The worker is reaped by the shim's exit monitor (the subreaper's `waitpid(-1)` loop), never
//! through `Child::wait`, which would race it (see `runc.rs`). A kernel thread cannot be
//! cancelled inside a driver call, and a thread of the shim blocked there would hold the
//! container's lock: hence a process, which SIGKILL ends whatever it is doing.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use containerd_shim::monitor::{monitor_subscribe, monitor_unsubscribe, Subject, Topic};
use gpu::{DeviceCheckpoint, DeviceMemoryFile, GpuError, GpuPair, GpuUuid, ProcessState};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::error::Result;
use crate::options::{self, RuntimeOptions};

/// The first argument that makes the shim binary a device worker.
pub const WORKER_ARG: &str = "device-worker";

const GIB: f64 = (1u64 << 30) as f64;

/// The most workers alive at once per driver (a node has up to 8 GPUs; a container a process
/// per GPU, and a pod several containers whose steps may overlap).
pub const MAX_WORKERS: usize = 16;

/// How long each driver call may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Past the lock timeout given to the driver.
    pub lock_margin: Duration,
    /// Checkpoint and restore (before the per-GiB part), unlock, and the worker's start.
    pub call: Duration,
    /// Added to `call` for a checkpoint or restore, per GiB of the process's device memory.
    pub per_gib: Duration,
    /// The state and restore-thread reads.
    pub read: Duration,
}

impl Bounds {
    /// From the handler options (`DeviceLockMargin`, `DeviceCallTimeout`,
    /// `DeviceCallTimeoutPerGiB`, `DeviceReadTimeout`), each defaulted when empty.
    pub fn from_options(o: &RuntimeOptions) -> Result<Bounds> {
        Ok(Bounds {
            lock_margin: options::duration_or(
                &o.device_lock_margin,
                "DeviceLockMargin",
                options::DEFAULT_DEVICE_LOCK_MARGIN,
            )?,
            call: options::duration_or(
                &o.device_call_timeout,
                "DeviceCallTimeout",
                options::DEFAULT_DEVICE_CALL_TIMEOUT,
            )?,
            per_gib: options::duration_or(
                &o.device_call_timeout_per_gib,
                "DeviceCallTimeoutPerGiB",
                options::DEFAULT_DEVICE_CALL_TIMEOUT_PER_GIB,
            )?,
            read: options::duration_or(
                &o.device_read_timeout,
                "DeviceReadTimeout",
                options::DEFAULT_DEVICE_READ_TIMEOUT,
            )?,
        })
    }

    /// The bound of driver call `call` on a process holding `bytes` of device memory, for a
    /// lock given `lock_timeout` (`None`: the driver waits without limit, and so the bound is
    /// the plain call bound plus the margin).
    pub fn of(&self, call: &str, lock_timeout: Option<Duration>, bytes: u64) -> Duration {
        match call {
            "cuCheckpointProcessLock" => lock_timeout.unwrap_or(self.call) + self.lock_margin,
            // Whole seconds, rounded up: messages and tests then show "12s", not "11.53s".
            "cuCheckpointProcessCheckpoint" | "cuCheckpointProcessRestore" => {
                let d = self.call + self.per_gib.mul_f64(bytes as f64 / GIB);
                Duration::from_secs(d.as_secs() + u64::from(d.subsec_nanos() > 0))
            }
            "cuCheckpointProcessGetState" | "cuCheckpointProcessGetRestoreThreadId" => self.read,
            _ => self.call,
        }
    }
}

/// A request to the worker: one trait call.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Call {
    Lock {
        pid: i32,
        timeout: Option<Duration>,
    },
    Checkpoint {
        pid: i32,
    },
    Restore {
        pid: i32,
        pairs: Vec<([u8; 16], [u8; 16])>,
    },
    Unlock {
        pid: i32,
    },
    State {
        pid: i32,
    },
    RestoreThreadId {
        pid: i32,
    },
    /// `checkpoint_to`: the worker writes the files.
    CheckpointTo {
        pid: i32,
        gpus: Vec<GpuUuid>,
        dir: PathBuf,
        prefix: String,
    },
    /// `restore_from`: the worker reads the files.
    RestoreFrom {
        pid: i32,
        pairs: Vec<([u8; 16], [u8; 16])>,
        dir: PathBuf,
        files: Vec<DeviceMemoryFile>,
    },
}

fn gpu_pairs(pairs: &[([u8; 16], [u8; 16])]) -> Vec<GpuPair> {
    pairs
        .iter()
        .map(|(o, n)| GpuPair {
            old: GpuUuid(*o),
            new: GpuUuid(*n),
        })
        .collect()
}

fn raw_pairs(pairs: &[GpuPair]) -> Vec<([u8; 16], [u8; 16])> {
    pairs.iter().map(|p| (p.old.0, p.new.0)).collect()
}

impl Call {
    /// The driver's entry point the call is.
    fn name(&self) -> &'static str {
        match self {
            Call::Lock { .. } => "cuCheckpointProcessLock",
            Call::Checkpoint { .. } | Call::CheckpointTo { .. } => "cuCheckpointProcessCheckpoint",
            Call::Restore { .. } | Call::RestoreFrom { .. } => "cuCheckpointProcessRestore",
            Call::Unlock { .. } => "cuCheckpointProcessUnlock",
            Call::State { .. } => "cuCheckpointProcessGetState",
            Call::RestoreThreadId { .. } => "cuCheckpointProcessGetRestoreThreadId",
        }
    }

    fn pid(&self) -> i32 {
        match self {
            Call::Lock { pid, .. }
            | Call::Checkpoint { pid }
            | Call::Restore { pid, .. }
            | Call::Unlock { pid }
            | Call::State { pid }
            | Call::RestoreThreadId { pid }
            | Call::CheckpointTo { pid, .. }
            | Call::RestoreFrom { pid, .. } => *pid,
        }
    }

    /// Whether the call is bounded as a whole (custom storage: many driver calls and the
    /// files' I/O between them) rather than driver call by driver call.
    fn bounded_whole(&self) -> bool {
        matches!(self, Call::CheckpointTo { .. } | Call::RestoreFrom { .. })
    }

    /// Runs the request on `driver`.
    fn run(&self, driver: &dyn DeviceCheckpoint) -> std::result::Result<Answer, GpuError> {
        Ok(match self {
            Call::Lock { pid, timeout } => driver.lock(*pid, *timeout).map(|_| Answer::Done)?,
            Call::Checkpoint { pid } => driver.checkpoint(*pid).map(|_| Answer::Done)?,
            Call::Restore { pid, pairs } => driver
                .restore(*pid, &gpu_pairs(pairs))
                .map(|_| Answer::Done)?,
            Call::Unlock { pid } => driver.unlock(*pid).map(|_| Answer::Done)?,
            Call::State { pid } => Answer::State(driver.state(*pid)?),
            Call::RestoreThreadId { pid } => Answer::Tid(driver.restore_thread_id(*pid)?),
            Call::CheckpointTo {
                pid,
                gpus,
                dir,
                prefix,
            } => Answer::Files(driver.checkpoint_to(*pid, gpus, dir, prefix)?),
            Call::RestoreFrom {
                pid,
                pairs,
                dir,
                files,
            } => driver
                .restore_from(*pid, &gpu_pairs(pairs), dir, files)
                .map(|_| Answer::Done)?,
        })
    }
}

/// What the worker writes.
#[derive(Serialize, Deserialize, Debug)]
#[serde(rename_all = "snake_case")]
pub enum Message {
    /// The library loaded and initialised: its name, `cuDriverGetVersion`, and whether it has
    /// custom storage.
    Loaded {
        library: String,
        version: i32,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        custom_storage: bool,
    },
    /// A driver call is about to be made.
    Calling { call: String, pid: Option<i32> },
    /// The answer to the request (or, at start, why the library did not load).
    Done(std::result::Result<Answer, GpuError>),
}

/// A successful answer.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Answer {
    Done,
    State(ProcessState),
    Tid(i32),
    /// The files a `checkpoint_to` wrote.
    Files(Vec<DeviceMemoryFile>),
}

// ---------------------------------------------------------------------------------------------
// The worker
// ---------------------------------------------------------------------------------------------

/// The worker's main: loads the driver from `dir` (empty: the loader's search), then answers
/// calls until its stdin closes. Returns the process's exit code.
pub fn serve(dir: &str) -> i32 {
    gpu::cuda::observe_calls(|call, pid| {
        send(&Message::Calling {
            call: call.to_string(),
            pid,
        })
    });
    send(&Message::Calling {
        call: "cuInit".into(),
        pid: None,
    });
    let lib = (!dir.is_empty()).then(|| Path::new(dir).join("libcuda.so.1"));
    let driver = match gpu::CudaDriver::open(lib.as_deref()) {
        Ok(d) => d,
        Err(e) => {
            send(&Message::Done(Err(e)));
            return 1;
        }
    };
    send(&Message::Loaded {
        library: driver.library().to_string(),
        version: driver.version(),
        custom_storage: driver.custom_storage(),
    });
    let mut line = String::new();
    let stdin = std::io::stdin();
    loop {
        line.clear();
        match std::io::BufRead::read_line(&mut stdin.lock(), &mut line) {
            Ok(0) | Err(_) => return 0,
            Ok(_) => {}
        }
        let answer = match serde_json::from_str::<Call>(&line) {
            Ok(call) => call.run(&driver),
            Err(e) => Err(GpuError::Worker(format!("not a call: {e}"))),
        };
        send(&Message::Done(answer));
    }
}

/// One line on stdout.
fn send(m: &Message) {
    let Ok(mut line) = serde_json::to_vec(m) else {
        return;
    };
    line.push(b'\n');
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(&line).and_then(|_| out.flush());
}

// ---------------------------------------------------------------------------------------------
// The shim's side
// ---------------------------------------------------------------------------------------------

/// The driver's checkpoint API through a pool of worker processes, each call bounded.
pub struct WorkerDriver {
    program: PathBuf,
    args: Vec<String>,
    bounds: Bounds,
    library: String,
    version: i32,
    custom_storage: bool,
    /// Device bytes per pid, for the checkpoint and restore bounds.
    bytes: Mutex<HashMap<i32, u64>>,
    /// The idle workers and how many are alive; `freed` is told when one goes idle or dies.
    pool: Mutex<Pool>,
    freed: Condvar,
    max_workers: usize,
    /// The calls being made: each one's target pid and the worker making it, for [`abandon`]
    /// (Kill's, which waits for no call).
    ///
    /// [`abandon`]: DeviceCheckpoint::abandon
    in_flight: Mutex<Vec<(i32, Arc<Proc>)>>,
    /// Processes whose calls were abandoned, with their start time (`/proc/PID/stat`), so that
    /// a later process given the same pid is not taken for them: every call on one fails at
    /// once.
    abandoned: Mutex<HashMap<i32, u64>>,
}

/// The workers of a [`WorkerDriver`]: those waiting for a call, and the number alive (idle,
/// serving a call, or starting).
struct Pool {
    idle: Vec<Worker>,
    alive: usize,
}

/// A worker taken from the pool for one call: back to the pool by [`Lease::keep`]; dropped
/// otherwise (the call failed in a way that leaves the worker unusable), it is killed and no
/// longer counted.
struct Lease<'a> {
    driver: &'a WorkerDriver,
    worker: Option<Worker>,
}

impl Lease<'_> {
    fn get(&mut self) -> &mut Worker {
        self.worker
            .as_mut()
            .expect("a lease holds its worker until kept")
    }

    fn keep(mut self) {
        if let Some(w) = self.worker.take() {
            let mut pool = self.driver.pool();
            pool.idle.push(w);
            self.driver.freed.notify_one();
        }
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        if let Some(w) = self.worker.take() {
            w.proc.kill();
            let mut pool = self.driver.pool();
            pool.alive = pool.alive.saturating_sub(1);
            self.driver.freed.notify_one();
        }
    }
}

/// A worker's process, signalled through a pidfd taken when it was spawned: once the exit
/// monitor has reaped it, a signal fails instead of reaching whatever process has its pid since.
struct Proc {
    pid: i32,
    fd: Option<OwnedFd>,
}

impl Proc {
    fn open(pid: i32) -> Proc {
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        let fd = if fd < 0 {
            // Already reaped: nothing left to signal.
            warn!(pid, error = %std::io::Error::last_os_error(), "pidfd of the device worker");
            None
        } else {
            // SAFETY: the kernel returned a new descriptor that nothing else owns.
            Some(unsafe { OwnedFd::from_raw_fd(fd as i32) })
        };
        Proc { pid, fd }
    }

    fn kill(&self) {
        let Some(fd) = &self.fd else { return };
        // SAFETY: pidfd_send_signal on a pidfd this process owns, no siginfo, no flags.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                fd.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                warn!(pid = self.pid, error = %e, "kill the device worker");
            }
        }
    }
}

/// Takes a call out of [`WorkerDriver::in_flight`] when it returns, whichever way.
struct InFlight<'a>(&'a Mutex<Vec<(i32, Arc<Proc>)>>, Arc<Proc>);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut f = self.0.lock().unwrap_or_else(|e| e.into_inner());
        f.retain(|(_, p)| !Arc::ptr_eq(p, &self.1));
    }
}

/// A process's start time in clock ticks since boot, `None` when it is gone.
fn start_time(pid: i32) -> Option<u64> {
    procfs::process::Process::new(pid)
        .and_then(|p| p.stat())
        .ok()
        .map(|s| s.starttime)
}

/// What a worker reports once the driver is loaded: library, version, custom storage.
type Loaded = (String, i32, bool);

/// A running worker.
struct Worker {
    proc: Arc<Proc>,
    stdin: ChildStdin,
    out: Lines,
}

impl Worker {
    /// Hands `call` to the worker, a line of JSON; a worker that does not take it is killed.
    fn send(&mut self, call: &Call) -> std::result::Result<(), GpuError> {
        let mut line = serde_json::to_vec(call)
            .map_err(|e| GpuError::Worker(format!("encode {call:?}: {e}")))?;
        line.push(b'\n');
        if let Err(e) = self.stdin.write_all(&line).and_then(|_| self.stdin.flush()) {
            self.proc.kill();
            return Err(GpuError::Worker(format!(
                "worker (pid {}) did not take {call:?}: {e}",
                self.proc.pid
            )));
        }
        Ok(())
    }
}

/// How reading the worker's next message failed.
#[derive(Debug)]
enum Broken {
    /// Nothing came before the deadline.
    Late,
    /// The worker closed its stdout (it exited) or wrote something else than a message.
    Gone(String),
}

/// The worker's stdout, a message a line, read against a deadline.
struct Lines {
    out: ChildStdout,
    buf: Vec<u8>,
}

impl Lines {
    fn next(&mut self, deadline: Instant) -> std::result::Result<Message, Broken> {
        loop {
            if let Some(i) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                return serde_json::from_slice(&line).map_err(|e| {
                    Broken::Gone(format!(
                        "wrote {:?}, not a message: {e}",
                        String::from_utf8_lossy(&line).trim_end()
                    ))
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Broken::Late);
            }
            if !readable(self.out.as_raw_fd(), left) {
                continue;
            }
            let mut chunk = [0u8; 4096];
            match self.out.read(&mut chunk) {
                Ok(0) => return Err(Broken::Gone("exited".into())),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Broken::Gone(format!("read: {e}"))),
            }
        }
    }
}

/// Whether `fd` has something to read (or its end) within `wait`.
fn readable(fd: i32, wait: Duration) -> bool {
    let ms = wait.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd over a descriptor this process owns for the call.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    n > 0
}

impl WorkerDriver {
    /// Starts a worker for the driver in `dir` (empty: the loader's search) and waits for it
    /// to load the library: its error when it cannot (no driver: [`GpuError::NoDriver`]).
    pub fn open(dir: &Path, bounds: Bounds) -> std::result::Result<WorkerDriver, GpuError> {
        Self::with_program(
            PathBuf::from("/proc/self/exe"),
            vec![WORKER_ARG.to_string(), dir.display().to_string()],
            bounds,
        )
    }

    /// [`open`](Self::open) with another worker program (tests).
    pub fn with_program(
        program: PathBuf,
        args: Vec<String>,
        bounds: Bounds,
    ) -> std::result::Result<WorkerDriver, GpuError> {
        let mut d = WorkerDriver {
            program,
            args,
            bounds,
            library: String::new(),
            version: 0,
            custom_storage: false,
            bytes: Mutex::new(HashMap::new()),
            pool: Mutex::new(Pool {
                idle: Vec::new(),
                alive: 0,
            }),
            freed: Condvar::new(),
            max_workers: MAX_WORKERS,
            in_flight: Mutex::new(Vec::new()),
            abandoned: Mutex::new(HashMap::new()),
        };
        let (w, loaded) = d.start()?;
        (d.library, d.version, d.custom_storage) = loaded;
        d.pool = Mutex::new(Pool {
            idle: vec![w],
            alive: 1,
        });
        Ok(d)
    }

    /// At most `n` (at least 1) workers alive at once; [`MAX_WORKERS`] by default.
    pub fn with_max_workers(mut self, n: usize) -> WorkerDriver {
        self.max_workers = n.max(1);
        self
    }

    fn pool(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An idle worker, else a new one while fewer than the cap are alive, else the first to
    /// come back.
    fn lease(&self) -> std::result::Result<Lease<'_>, GpuError> {
        let mut pool = self.pool();
        loop {
            if let Some(w) = pool.idle.pop() {
                return Ok(Lease {
                    driver: self,
                    worker: Some(w),
                });
            }
            if pool.alive < self.max_workers {
                pool.alive += 1;
                drop(pool);
                return match self.start() {
                    Ok((w, _)) => Ok(Lease {
                        driver: self,
                        worker: Some(w),
                    }),
                    Err(e) => {
                        let mut pool = self.pool();
                        pool.alive = pool.alive.saturating_sub(1);
                        self.freed.notify_one();
                        Err(e)
                    }
                };
            }
            pool = self.freed.wait(pool).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The library the worker loaded.
    pub fn library(&self) -> &str {
        &self.library
    }

    /// `cuDriverGetVersion`, as the first worker read it.
    pub fn version(&self) -> i32 {
        self.version
    }

    /// Spawns a worker and waits (bounded by the call bound) until it has loaded the driver:
    /// the worker, and the library's name, version and whether it has custom storage.
    fn start(&self) -> std::result::Result<(Worker, Loaded), GpuError> {
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let (pid, stdin, out) = spawn_reaped(cmd)
            .map_err(|e| GpuError::Worker(format!("start {}: {e}", self.program.display())))?;
        let proc = Arc::new(Proc::open(pid));
        let (Some(stdin), Some(out)) = (stdin, out) else {
            proc.kill();
            return Err(GpuError::Worker("started without its pipes".into()));
        };
        let mut w = Worker {
            proc: Arc::clone(&proc),
            stdin,
            out: Lines {
                out,
                buf: Vec::new(),
            },
        };
        let bound = self.bounds.call;
        let deadline = Instant::now() + bound;
        loop {
            match w.out.next(deadline) {
                Ok(Message::Loaded {
                    library,
                    version,
                    custom_storage,
                }) => {
                    info!(
                        pid,
                        library, version, custom_storage, "device worker started"
                    );
                    return Ok((w, (library, version, custom_storage)));
                }
                Ok(Message::Calling { .. }) => {}
                Ok(Message::Done(Err(e))) => {
                    proc.kill();
                    return Err(e);
                }
                Ok(m) => {
                    proc.kill();
                    return Err(GpuError::Worker(format!(
                        "worker (pid {pid}) sent {m:?} before loading the driver"
                    )));
                }
                Err(Broken::Late) => {
                    proc.kill();
                    return Err(GpuError::Worker(format!(
                        "cuInit in the device worker (pid {pid}) did not return within {}",
                        gpu::error::seconds(bound)
                    )));
                }
                Err(Broken::Gone(why)) => {
                    proc.kill();
                    return Err(GpuError::Worker(format!(
                        "worker (pid {pid}) {why} before loading the driver"
                    )));
                }
            }
        }
    }

    fn bytes_of(&self, pid: i32) -> u64 {
        let bytes = self.bytes.lock().unwrap_or_else(|e| e.into_inner());
        bytes.get(&pid).copied().unwrap_or(0)
    }

    /// Runs `call` in a worker of the pool, each driver call it makes within its bound (a
    /// custom-storage call within one bound as a whole); past it, the worker is killed and the
    /// error names the call.
    fn call(&self, call: Call) -> std::result::Result<Answer, GpuError> {
        if self.is_abandoned(call.pid()) {
            return Err(abandoned(&call));
        }
        let mut lease = self.lease()?;
        let lock_timeout = match &call {
            Call::Lock { timeout, .. } => *timeout,
            _ => None,
        };
        let target = call.pid();
        let bytes = match &call {
            Call::RestoreFrom { files, .. } => self
                .bytes_of(target)
                .max(files.iter().map(|f| f.size).sum()),
            _ => self.bytes_of(target),
        };
        let w = lease.get();
        w.send(&call)?;
        let proc = Arc::clone(&w.proc);
        self.in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((target, Arc::clone(&proc)));
        let _in_flight = InFlight(&self.in_flight, Arc::clone(&proc));
        // A Kill that came between the check above and now found nothing in flight.
        if self.is_abandoned(target) {
            return Err(abandoned(&call));
        }
        // Until the worker names its first driver call (at once: nothing comes before it but
        // decoding the request), the plain call bound; a custom-storage call has its
        // checkpoint or restore bound from the start to the end.
        let whole = call.bounded_whole();
        let (mut current, mut pid) = ("device worker".to_string(), target);
        let mut bound = if whole {
            self.bounds.of(call.name(), None, bytes)
        } else {
            self.bounds.call
        };
        let mut deadline = Instant::now() + bound;
        loop {
            match lease.get().out.next(deadline) {
                Ok(Message::Calling { call: c, pid: p }) => {
                    if !whole {
                        bound = self.bounds.of(&c, lock_timeout, bytes);
                        deadline = Instant::now() + bound;
                    }
                    (current, pid) = (c, p.unwrap_or(target));
                }
                Ok(Message::Done(answer)) => {
                    lease.keep();
                    return answer;
                }
                Ok(m) => {
                    return Err(GpuError::Worker(format!(
                        "worker (pid {}) sent {m:?} during {current}(pid {pid})",
                        proc.pid
                    )));
                }
                Err(_) if self.is_abandoned(target) => {
                    return Err(abandoned(&call));
                }
                Err(Broken::Late) => {
                    warn!(
                        worker = proc.pid,
                        call = current,
                        pid,
                        bound_ms = bound.as_millis() as u64,
                        "driver call past its bound: worker killed"
                    );
                    return Err(GpuError::Unanswered {
                        call: current,
                        pid,
                        bound,
                    });
                }
                Err(Broken::Gone(why)) => {
                    return Err(GpuError::Worker(format!(
                        "worker (pid {}) {why} during {current}(pid {pid})",
                        proc.pid
                    )));
                }
            }
        }
    }

    /// Whether the calls on `pid` were abandoned (and `pid` is still that process).
    fn is_abandoned(&self, pid: i32) -> bool {
        let mut a = self.abandoned.lock().unwrap_or_else(|e| e.into_inner());
        let Some(&start) = a.get(&pid) else {
            return false;
        };
        if start_time(pid) == Some(start) {
            return true;
        }
        a.remove(&pid);
        false
    }

    fn done(&self, call: Call) -> std::result::Result<(), GpuError> {
        match self.call(call)? {
            Answer::Done => Ok(()),
            a => Err(unexpected(a)),
        }
    }
}

fn abandoned(call: &Call) -> GpuError {
    GpuError::Worker(format!(
        "{}(pid {}) abandoned: the container is being killed",
        call.name(),
        call.pid()
    ))
}

fn unexpected(a: Answer) -> GpuError {
    GpuError::Worker(format!("unexpected answer {a:?}"))
}

impl DeviceCheckpoint for WorkerDriver {
    fn lock(&self, pid: i32, timeout: Option<Duration>) -> std::result::Result<(), GpuError> {
        self.done(Call::Lock { pid, timeout })
    }

    fn checkpoint(&self, pid: i32) -> std::result::Result<(), GpuError> {
        self.done(Call::Checkpoint { pid })
    }

    fn restore(&self, pid: i32, pairs: &[GpuPair]) -> std::result::Result<(), GpuError> {
        let pairs = raw_pairs(pairs);
        self.done(Call::Restore { pid, pairs })
    }

    fn unlock(&self, pid: i32) -> std::result::Result<(), GpuError> {
        self.done(Call::Unlock { pid })
    }

    fn state(&self, pid: i32) -> std::result::Result<ProcessState, GpuError> {
        match self.call(Call::State { pid })? {
            Answer::State(s) => Ok(s),
            a => Err(unexpected(a)),
        }
    }

    fn restore_thread_id(&self, pid: i32) -> std::result::Result<i32, GpuError> {
        match self.call(Call::RestoreThreadId { pid })? {
            Answer::Tid(t) => Ok(t),
            a => Err(unexpected(a)),
        }
    }

    fn driver_version(&self) -> std::result::Result<i32, GpuError> {
        Ok(self.version)
    }

    fn set_device_bytes(&self, pid: i32, bytes: u64) {
        let mut map = self.bytes.lock().unwrap_or_else(|e| e.into_inner());
        map.insert(pid, bytes);
    }

    fn in_flight(&self) -> Option<i32> {
        self.calls_in_flight().first().copied()
    }

    fn calls_in_flight(&self) -> Vec<i32> {
        let f = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        f.iter().map(|(pid, _)| *pid).collect()
    }

    fn abandon(&self, pid: i32) {
        let Some(start) = start_time(pid) else { return };
        self.abandoned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(pid, start);
        let f = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        for (_, proc) in f.iter().filter(|(target, _)| *target == pid) {
            warn!(
                pid,
                worker = proc.pid,
                "driver call abandoned: the container is being killed"
            );
            proc.kill();
        }
    }

    fn custom_storage(&self) -> bool {
        self.custom_storage
    }

    fn checkpoint_to(
        &self,
        pid: i32,
        gpus: &[GpuUuid],
        dir: &Path,
        prefix: &str,
    ) -> std::result::Result<Vec<DeviceMemoryFile>, GpuError> {
        let call = Call::CheckpointTo {
            pid,
            gpus: gpus.to_vec(),
            dir: dir.to_path_buf(),
            prefix: prefix.to_string(),
        };
        match self.call(call)? {
            Answer::Files(f) => Ok(f),
            a => Err(unexpected(a)),
        }
    }

    fn restore_from(
        &self,
        pid: i32,
        pairs: &[gpu::GpuPair],
        dir: &Path,
        files: &[DeviceMemoryFile],
    ) -> std::result::Result<(), GpuError> {
        self.done(Call::RestoreFrom {
            pid,
            pairs: raw_pairs(pairs),
            dir: dir.to_path_buf(),
            files: files.to_vec(),
        })
    }
}

impl Drop for WorkerDriver {
    fn drop(&mut self) {
        let pool = self.pool.get_mut().unwrap_or_else(|e| e.into_inner());
        for w in pool.idle.drain(..) {
            w.proc.kill();
        }
        let f = self.in_flight.get_mut().unwrap_or_else(|e| e.into_inner());
        for (_, proc) in f.iter() {
            proc.kill();
        }
    }
}

/// A spawned worker: its pid and pipes (its `Child` is never waited on here).
type Spawned = (i32, Option<ChildStdin>, Option<ChildStdout>);

/// Spawns `cmd`; its exit is collected by the shim's exit monitor when this runs inside the
/// shim's runtime (subscribed before the spawn, so the exit cannot be missed), else by a
/// thread of its own (a process without the shim's reaper, such as a test).
fn spawn_reaped(mut cmd: Command) -> std::io::Result<Spawned> {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        let mut child = cmd.spawn()?;
        let parts = pipes(&mut child);
        std::thread::spawn(move || child.wait());
        return Ok(parts);
    };
    let mut sub = handle
        .block_on(monitor_subscribe(Topic::Pid))
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            let _ = handle.block_on(monitor_unsubscribe(sub.id));
            return Err(e);
        }
    };
    let parts = pipes(&mut child);
    let pid = parts.0;
    handle.spawn(async move {
        while let Some(ev) = sub.rx.recv().await {
            if matches!(ev.subject, Subject::Pid(p) if p == pid) {
                info!(pid, status = ev.exit_code, "device worker exited");
                break;
            }
        }
        let _ = monitor_unsubscribe(sub.id).await;
    });
    Ok(parts)
}

fn pipes(child: &mut Child) -> Spawned {
    (child.id() as i32, child.stdin.take(), child.stdout.take())
}

#[cfg(test)]
#[path = "device_worker_sim.rs"]
mod sim_tests;

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn bounds() -> Bounds {
        Bounds {
            lock_margin: Duration::from_secs(10),
            call: Duration::from_secs(60),
            per_gib: Duration::from_secs(10),
            read: Duration::from_secs(5),
        }
    }

    #[test]
    fn bounds_scale_with_device_bytes() {
        let b = bounds();
        let s = Duration::from_secs;
        assert_eq!(b.of("cuCheckpointProcessLock", Some(s(30)), 0), s(40));
        assert_eq!(b.of("cuCheckpointProcessLock", None, 0), s(70));
        assert_eq!(b.of("cuCheckpointProcessCheckpoint", None, 0), s(60));
        assert_eq!(b.of("cuCheckpointProcessCheckpoint", None, 4 << 30), s(100));
        assert_eq!(b.of("cuCheckpointProcessRestore", None, 1536 * MIB), s(75));
        // A fraction of a second rounds up.
        assert_eq!(b.of("cuCheckpointProcessCheckpoint", None, 2 * MIB), s(61));
        assert_eq!(b.of("cuCheckpointProcessGetState", None, 4 << 30), s(5));
        assert_eq!(b.of("cuCheckpointProcessGetRestoreThreadId", None, 0), s(5));
        assert_eq!(b.of("cuCheckpointProcessUnlock", None, 4 << 30), s(60));
    }

    #[test]
    fn bounds_from_options() {
        let mut o = RuntimeOptions::default();
        let d = Bounds::from_options(&o).unwrap();
        assert_eq!(d.lock_margin, options::DEFAULT_DEVICE_LOCK_MARGIN);
        assert_eq!(d.call, options::DEFAULT_DEVICE_CALL_TIMEOUT);
        assert_eq!(d.per_gib, options::DEFAULT_DEVICE_CALL_TIMEOUT_PER_GIB);
        assert_eq!(d.read, options::DEFAULT_DEVICE_READ_TIMEOUT);
        o.device_call_timeout = "2m".into();
        o.device_read_timeout = "500ms".into();
        let b = Bounds::from_options(&o).unwrap();
        assert_eq!(b.call, Duration::from_secs(120));
        assert_eq!(b.read, Duration::from_millis(500));
        o.device_call_timeout_per_gib = "often".into();
        let err = Bounds::from_options(&o).unwrap_err().to_string();
        assert!(err.contains("DeviceCallTimeoutPerGiB"), "{err}");
    }

    #[test]
    fn the_protocol_in_json() {
        let m = Message::Done(Ok(Answer::Tid(7)));
        assert_eq!(
            serde_json::to_string(&m).unwrap(),
            r#"{"done":{"Ok":{"tid":7}}}"#
        );
        let m = Message::Loaded {
            library: "l".into(),
            version: 13000,
            custom_storage: false,
        };
        assert_eq!(
            serde_json::to_string(&m).unwrap(),
            r#"{"loaded":{"library":"l","version":13000}}"#
        );
        let c = Call::Lock {
            pid: 3,
            timeout: Some(Duration::from_millis(1500)),
        };
        let back: Call = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }

    /// A worker (a shell script) that answers the restore-thread read and hangs in the state
    /// read of any other call, as a driver stuck there would.
    fn stuck_worker(read: Duration) -> std::result::Result<WorkerDriver, GpuError> {
        let script = r#"
echo '{"loaded":{"library":"fake","version":13000}}'
while read l; do
  case "$l" in
    *restore_thread_id*) echo '{"done":{"Ok":{"tid":7}}}' ;;
    *) echo '{"calling":{"call":"cuCheckpointProcessGetState","pid":42}}'; exec sleep 60 ;;
  esac
done"#;
        WorkerDriver::with_program(
            "/bin/sh".into(),
            vec!["-c".into(), script.into()],
            Bounds { read, ..bounds() },
        )
    }

    #[test]
    fn a_call_past_its_bound_kills_the_worker_and_names_the_call() {
        let d = stuck_worker(Duration::from_millis(300)).unwrap();
        assert_eq!(d.library(), "fake");
        assert_eq!(d.restore_thread_id(42).unwrap(), 7);
        let t = Instant::now();
        let err = d.lock(42, Some(Duration::from_secs(1))).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
        assert_eq!(
            err.to_string(),
            "cuCheckpointProcessGetState(pid 42) did not return within 300ms"
        );
        assert!(matches!(err, GpuError::Unanswered { pid: 42, .. }));
        // The next call runs in a fresh worker.
        assert_eq!(d.restore_thread_id(42).unwrap(), 7);
    }

    #[test]
    fn a_worker_that_cannot_load_the_driver_says_why() {
        let script =
            r#"echo '{"done":{"Err":{"no_driver":{"library":"libcuda.so.1","reason":"gone"}}}}'"#;
        let err = WorkerDriver::with_program(
            "/bin/sh".into(),
            vec!["-c".into(), script.into()],
            bounds(),
        )
        .err()
        .unwrap();
        assert!(matches!(err, GpuError::NoDriver { .. }), "{err}");
        let err = WorkerDriver::with_program("/bin/true".into(), vec![], bounds())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("exited before loading the driver"), "{err}");
    }
}
