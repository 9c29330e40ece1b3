//! The bound on a restore's waits: CRIU's restore, the gate's verdicts, the page verification.
//! Nothing in a restore may wait forever; past the bound the watchdog refuses at the gate (the
//! script stops waiting and CRIU aborts, killing what it restored), stops the hashing, and
//! after a short grace kills `runc restore` and everything under it (CRIU, its action script,
//! restored tasks). The restore then fails, naming the step and the bound, and its undo (`runc
//! delete --force`) removes what is left.

use std::ffi::OsStr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use procfs::process::Process;
use tracing::warn;

use crate::error::{Error, Result};
use crate::options::RuntimeOptions;
use crate::verify_gate::VerifyGate;

/// A restore's bound when the handler names none: a minute, plus 10 s per GiB of checkpoint
/// (upstream CRIU restores about 1 GiB/s, and the page verification runs beside it).
pub fn bound(options: &RuntimeOptions, checkpoint_bytes: u64) -> Result<Duration> {
    if !options.restore_timeout.is_empty() {
        return crate::options::parse_timeout(&options.restore_timeout, "RestoreTimeout");
    }
    let gib = checkpoint_bytes.div_ceil(1 << 30);
    Ok(Duration::from_secs(60 + 10 * gib))
}

/// A running restore's watchdog; [`Watchdog::stop`] it when CRIU's part of the restore is over.
pub struct Watchdog {
    /// The wait the restore was stuck in when the bound passed (`None` while within it).
    expired: Arc<Mutex<Option<Stalled>>>,
    task: tokio::task::JoinHandle<()>,
    bound: Duration,
    deadline: Instant,
}

/// Which wait a restore was stuck in when its bound passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stalled {
    /// CRIU waited at its post-restore gate for the page verification's verdict.
    Verify,
    /// CRIU itself: restoring, or in an action script with its verdict given.
    Criu,
}

impl Stalled {
    fn step(self) -> &'static str {
        match self {
            Stalled::Verify => "verify",
            Stalled::Criu => "criu-restore",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Stalled::Verify => {
                "the page verification gave no verdict, while CRIU waited for it at its post-restore gate"
            }
            Stalled::Criu => "CRIU did not finish restoring",
        }
    }
}

/// After refusing at the gate, how long CRIU gets to abort by itself before it is killed.
const GRACE: Duration = Duration::from_secs(3);

impl Watchdog {
    /// Starts the clock for the restore of the container in `bundle`, whose gate is `gate`
    /// and whose page hashing stops when `cancel` is set.
    pub fn start(
        bound: Duration,
        bundle: &Path,
        gate: Arc<VerifyGate>,
        cancel: Arc<AtomicBool>,
    ) -> Watchdog {
        let expired = Arc::new(Mutex::new(None));
        let bundle = bundle.to_path_buf();
        let task = tokio::spawn({
            let expired = expired.clone();
            async move {
                tokio::time::sleep(bound).await;
                let stalled = stalled(&bundle, &gate);
                if let Ok(mut e) = expired.lock() {
                    *e = Some(stalled);
                }
                warn!(bundle = %bundle.display(), ?bound, ?stalled, "restore past its bound: refused at the gate");
                cancel.store(true, Ordering::SeqCst);
                let _ = gate.open(false);
                let _ = gate.allow(false);
                let _ = gate.no_root();
                tokio::time::sleep(GRACE).await;
                let killed = kill_restore(&bundle);
                if !killed.is_empty() {
                    warn!(bundle = %bundle.display(), ?killed, "restore past its bound: killed runc restore and its processes");
                }
            }
        });
        Watchdog {
            expired,
            task,
            bound,
            deadline: Instant::now() + bound,
        }
    }

    /// When the bound passes; the device steps after CRIU's restore share it.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// The whole bound.
    pub fn bound(&self) -> Duration {
        self.bound
    }

    /// Stops the clock; `Err` when the bound had passed, naming the step that was waited for
    /// and the bound.
    pub fn stop(self) -> Result<()> {
        self.task.abort();
        let stalled = self.expired.lock().ok().and_then(|e| *e);
        if let Some(stalled) = stalled {
            return Err(Error::Step {
                operation: "restore",
                step: stalled.step(),
                message: format!(
                    "not done within {}: {}; the restored tasks were refused at the gate, and runc restore, CRIU and their processes killed if still there",
                    describe(self.bound),
                    stalled.what()
                ),
            });
        }
        Ok(())
    }
}

/// The bound, and where it comes from, for an error message.
pub fn describe(bound: Duration) -> String {
    format!("{bound:?} (the handler option RestoreTimeout, by default a minute plus 10 s per GiB of checkpoint)")
}

/// What the restore of `bundle` is waiting for: the page verification when CRIU's action script
/// sits at `post-restore` (in `runc restore`'s tree) and the gate has no verdict yet, else CRIU.
fn stalled(bundle: &Path, gate: &VerifyGate) -> Stalled {
    if gate.has_verdict() {
        return Stalled::Criu;
    }
    let script = gate.script().as_os_str().as_encoded_bytes().to_vec();
    let procs = processes();
    let at_post_restore = restore_roots(&procs, bundle)
        .into_iter()
        .flat_map(|root| descendants(&procs, root))
        .any(|pid| {
            let environ = Process::new(pid)
                .and_then(|p| p.environ())
                .unwrap_or_default();
            cmdline(pid)
                .iter()
                .any(|a| a.as_bytes() == script.as_slice())
                && environ
                    .get(OsStr::new("CRTOOLS_SCRIPT_ACTION"))
                    .is_some_and(|v| v == "post-restore")
        });
    if at_post_restore {
        Stalled::Verify
    } else {
        Stalled::Criu
    }
}

/// The `runc restore` processes of `bundle` that this process started.
fn restore_roots(procs: &[(i32, i32)], bundle: &Path) -> Vec<i32> {
    let me = std::process::id() as i32;
    let bundle = bundle.as_os_str().as_encoded_bytes();
    procs
        .iter()
        .filter(|&&(_, ppid)| ppid == me)
        .filter(|&&(pid, _)| {
            let args = cmdline(pid);
            args.iter().any(|a| a == "restore")
                && args
                    .windows(2)
                    .any(|w| w[0] == "--bundle" && w[1].as_bytes() == bundle)
        })
        .map(|&(pid, _)| pid)
        .collect()
}

/// SIGKILLs every `runc restore` of `bundle` that this process started, and every process
/// under it (CRIU, its action scripts, the tasks it restored), children first. Returns the pids.
fn kill_restore(bundle: &Path) -> Vec<i32> {
    let procs = processes();
    let mut killed = Vec::new();
    for pid in restore_roots(&procs, bundle) {
        let mut tree = descendants(&procs, pid);
        tree.reverse();
        tree.push(pid);
        for p in tree {
            // SAFETY: kill(2) with a pid we just read; a pid that exited meanwhile gets ESRCH.
            if unsafe { libc::kill(p, libc::SIGKILL) } == 0 {
                killed.push(p);
            }
        }
    }
    killed
}

/// The arguments of process `pid` (none once it is gone).
fn cmdline(pid: i32) -> Vec<String> {
    Process::new(pid)
        .and_then(|p| p.cmdline())
        .unwrap_or_default()
}

/// (pid, parent pid) of every process.
fn processes() -> Vec<(i32, i32)> {
    let Ok(all) = procfs::process::all_processes() else {
        return Vec::new();
    };
    all.flatten()
        .filter_map(|p| Some((p.pid, p.stat().ok()?.ppid)))
        .collect()
}

/// Every process under `root`, parents before their children.
fn descendants(procs: &[(i32, i32)], root: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for &(child, parent) in procs {
            if parent == p && !out.contains(&child) {
                out.push(child);
                frontier.push(child);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_scale_with_the_checkpoint_or_follow_the_option() {
        let mut o = RuntimeOptions::default();
        assert_eq!(bound(&o, 0).unwrap(), Duration::from_secs(60));
        assert_eq!(bound(&o, 1).unwrap(), Duration::from_secs(70));
        assert_eq!(bound(&o, 3 << 30).unwrap(), Duration::from_secs(90));
        o.restore_timeout = "5s".into();
        assert_eq!(bound(&o, 100 << 30).unwrap(), Duration::from_secs(5));
    }

    #[test]
    fn descendants_come_parents_first() {
        let procs = [(10, 1), (11, 10), (12, 11), (13, 10), (20, 1)];
        assert_eq!(descendants(&procs, 10), vec![11, 13, 12]);
        assert!(descendants(&procs, 20).is_empty());
    }
}
