//! The driver's checkpoint calls, run in a child process so that a call stuck in the driver can
//! be abandoned: [`WorkerDriver`] is a [`DeviceCheckpoint`] whose every call has a bound, past
//! which the worker is killed and the call fails naming itself, its pid and the bound.
//!
//! The worker is this binary re-executed (`/proc/self/exe device-worker <driver library dir>`,
//! dispatched in `main.rs` before the shim starts); it loads [`gpu::CudaDriver`] and serves one
//! call at a time over its stdin and stdout, a JSON document a line ([`Call`] in, [`Message`]
//! out). Before each driver call it says which one it makes ([`Message::Calling`]), so that the
//! bound is that call's own and the error names the call that did not return (a lock that reads
//! the state back can be stuck in either). One worker per shim and driver, started on first
//! need and reused (its calls one at a time, the containers of the pod in turn); after a kill
//! the next call starts a fresh one (`cuInit` again).
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
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use containerd_shim::monitor::{monitor_subscribe, monitor_unsubscribe, Subject, Topic};
use gpu::{DeviceCheckpoint, GpuError, GpuPair, GpuUuid, ProcessState};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::error::Result;
use crate::options::{self, RuntimeOptions};

/// The first argument that makes the shim binary a device worker.
pub const WORKER_ARG: &str = "device-worker";

const GIB: f64 = (1u64 << 30) as f64;

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
}

impl Call {
    /// The driver's entry point the call is.
    fn name(&self) -> &'static str {
        match self {
            Call::Lock { .. } => "cuCheckpointProcessLock",
            Call::Checkpoint { .. } => "cuCheckpointProcessCheckpoint",
            Call::Restore { .. } => "cuCheckpointProcessRestore",
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
            | Call::RestoreThreadId { pid } => *pid,
        }
    }

    /// Runs the request on `driver`.
    fn run(&self, driver: &dyn DeviceCheckpoint) -> std::result::Result<Answer, GpuError> {
        Ok(match self {
            Call::Lock { pid, timeout } => driver.lock(*pid, *timeout).map(|_| Answer::Done)?,
            Call::Checkpoint { pid } => driver.checkpoint(*pid).map(|_| Answer::Done)?,
            Call::Restore { pid, pairs } => {
                let pairs: Vec<GpuPair> = pairs
                    .iter()
                    .map(|(o, n)| GpuPair {
                        old: GpuUuid(*o),
                        new: GpuUuid(*n),
                    })
                    .collect();
                driver.restore(*pid, &pairs).map(|_| Answer::Done)?
            }
            Call::Unlock { pid } => driver.unlock(*pid).map(|_| Answer::Done)?,
            Call::State { pid } => Answer::State(driver.state(*pid)?),
            Call::RestoreThreadId { pid } => Answer::Tid(driver.restore_thread_id(*pid)?),
        })
    }
}

/// What the worker writes.
#[derive(Serialize, Deserialize, Debug)]
#[serde(rename_all = "snake_case")]
pub enum Message {
    /// The library loaded and initialised: its name and `cuDriverGetVersion`.
    Loaded { library: String, version: i32 },
    /// A driver call is about to be made.
    Calling { call: String, pid: Option<i32> },
    /// The answer to the request (or, at start, why the library did not load).
    Done(std::result::Result<Answer, GpuError>),
}

/// A successful answer.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Answer {
    Done,
    State(ProcessState),
    Tid(i32),
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

/// The driver's checkpoint API through a worker process, each call bounded.
pub struct WorkerDriver {
    program: PathBuf,
    args: Vec<String>,
    bounds: Bounds,
    library: String,
    version: i32,
    /// Device bytes per pid, for the checkpoint and restore bounds.
    bytes: Mutex<HashMap<i32, u64>>,
    worker: Mutex<Option<Worker>>,
    /// The call being made: its target pid and the worker making it, for [`abandon`]
    /// (Kill's, which does not wait for `worker`'s lock).
    ///
    /// [`abandon`]: DeviceCheckpoint::abandon
    in_flight: Mutex<Option<(i32, Arc<Proc>)>>,
    /// Processes whose calls were abandoned, with their start time (`/proc/PID/stat`), so that
    /// a later process given the same pid is not taken for them: every call on one fails at
    /// once.
    abandoned: Mutex<HashMap<i32, u64>>,
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

/// Clears [`WorkerDriver::in_flight`] when a call returns, whichever way.
struct InFlight<'a>(&'a Mutex<Option<(i32, Arc<Proc>)>>);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// A process's start time in clock ticks since boot, `None` when it is gone.
fn start_time(pid: i32) -> Option<u64> {
    procfs::process::Process::new(pid)
        .and_then(|p| p.stat())
        .ok()
        .map(|s| s.starttime)
}

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
            bytes: Mutex::new(HashMap::new()),
            worker: Mutex::new(None),
            in_flight: Mutex::new(None),
            abandoned: Mutex::new(HashMap::new()),
        };
        let (w, library, version) = d.start()?;
        d.library = library;
        d.version = version;
        d.worker = Mutex::new(Some(w));
        Ok(d)
    }

    /// The library the worker loaded.
    pub fn library(&self) -> &str {
        &self.library
    }

    /// `cuDriverGetVersion`, as the first worker read it.
    pub fn version(&self) -> i32 {
        self.version
    }

    /// Spawns a worker and waits (bounded by the call bound) until it has loaded the driver.
    fn start(&self) -> std::result::Result<(Worker, String, i32), GpuError> {
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
                Ok(Message::Loaded { library, version }) => {
                    info!(pid, library, version, "device worker started");
                    return Ok((w, library, version));
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

    /// Runs `call` in the worker (started when there is none), each driver call it makes
    /// within its bound; past one, the worker is killed and the error names the call.
    fn call(&self, call: Call) -> std::result::Result<Answer, GpuError> {
        if self.is_abandoned(call.pid()) {
            return Err(abandoned(&call));
        }
        let mut slot = self.worker.lock().unwrap_or_else(|e| e.into_inner());
        let mut w = match slot.take() {
            Some(w) => w,
            None => self.start()?.0,
        };
        let lock_timeout = match &call {
            Call::Lock { timeout, .. } => *timeout,
            _ => None,
        };
        let target = call.pid();
        let bytes = self.bytes_of(target);
        w.send(&call)?;
        *self.in_flight.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((target, Arc::clone(&w.proc)));
        let _in_flight = InFlight(&self.in_flight);
        // A Kill that came between the check above and now found nothing in flight.
        if self.is_abandoned(target) {
            w.proc.kill();
            return Err(abandoned(&call));
        }
        // Until the worker names its first driver call (at once: nothing comes before it but
        // decoding the request), the plain call bound.
        let (mut current, mut pid) = ("device worker".to_string(), target);
        let mut bound = self.bounds.call;
        let mut deadline = Instant::now() + bound;
        loop {
            match w.out.next(deadline) {
                Ok(Message::Calling { call: c, pid: p }) => {
                    bound = self.bounds.of(&c, lock_timeout, bytes);
                    deadline = Instant::now() + bound;
                    (current, pid) = (c, p.unwrap_or(target));
                }
                Ok(Message::Done(answer)) => {
                    *slot = Some(w);
                    return answer;
                }
                Ok(m) => {
                    w.proc.kill();
                    return Err(GpuError::Worker(format!(
                        "worker (pid {}) sent {m:?} during {current}(pid {pid})",
                        w.proc.pid
                    )));
                }
                Err(_) if self.is_abandoned(target) => {
                    w.proc.kill();
                    return Err(abandoned(&call));
                }
                Err(Broken::Late) => {
                    warn!(
                        worker = w.proc.pid,
                        call = current,
                        pid,
                        bound_ms = bound.as_millis() as u64,
                        "driver call past its bound: worker killed"
                    );
                    w.proc.kill();
                    return Err(GpuError::Unanswered {
                        call: current,
                        pid,
                        bound,
                    });
                }
                Err(Broken::Gone(why)) => {
                    w.proc.kill();
                    return Err(GpuError::Worker(format!(
                        "worker (pid {}) {why} during {current}(pid {pid})",
                        w.proc.pid
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
        let pairs = pairs.iter().map(|p| (p.old.0, p.new.0)).collect();
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
        let f = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        f.as_ref().map(|(pid, _)| *pid)
    }

    fn abandon(&self, pid: i32) {
        let Some(start) = start_time(pid) else { return };
        self.abandoned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(pid, start);
        let f = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((target, proc)) = f.as_ref() {
            if *target == pid {
                warn!(
                    pid,
                    worker = proc.pid,
                    "driver call abandoned: the container is being killed"
                );
                proc.kill();
            }
        }
    }
}

impl Drop for WorkerDriver {
    fn drop(&mut self) {
        let slot = self.worker.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = slot.take() {
            w.proc.kill();
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
