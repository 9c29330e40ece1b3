//! How CRIU ended when it ended early. runc starts CRIU (`criu swrk 3`) and reaps it itself;
//! when CRIU dies before it answers, runc reports only the broken connection (`read unixpacket
//! @->@: EOF`), never CRIU's signal or exit status. So while runc runs a dump or a restore, the
//! shim listens to the kernel's process events (the proc connector: `NETLINK_CONNECTOR`, group
//! `CN_IDX_PROC`, see the kernel's `include/uapi/linux/cn_proc.h`): the exec of a CRIU whose
//! parent is that `runc` (a child of this shim, whose last argument is the container's id), and
//! then that CRIU's exit with its wait status.
//!
//! The events need CAP_NET_ADMIN in the initial network namespace (containerd's, on a node).
//! Where they cannot be read, [`ExitWatch::start`] gives `None`, and errors say only that CRIU
//! died.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use nix::sys::socket::{setsockopt, sockopt};
use nix::sys::time::TimeVal;
use procfs::process::Process;
use tracing::debug;

const NETLINK_CONNECTOR: libc::c_int = 11;
const CN_IDX_PROC: u32 = 1;
const CN_VAL_PROC: u32 = 1;
const PROC_CN_MCAST_LISTEN: u32 = 1;
const PROC_CN_MCAST_IGNORE: u32 = 2;
const PROC_EVENT_EXEC: u32 = 0x0000_0002;
const PROC_EVENT_EXIT: u32 = 0x8000_0000;
/// `struct nlmsghdr`, `struct cn_msg` and `struct proc_event`'s header, in bytes.
const NLMSG_HDR: usize = 16;
const CN_MSG_HDR: usize = 20;
const PROC_EVENT_HDR: usize = 16;
/// How long one receive waits before the stop flag is looked at again.
const POLL: Duration = Duration::from_millis(50);

/// One CRIU that exited while it was watched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CriuExit {
    pub pid: i32,
    /// The wait status, as waitpid(2) gives it.
    pub status: i32,
}

impl CriuExit {
    /// `was killed by signal 9 (SIGKILL)`, `exited with status 1`.
    pub fn describe(&self) -> String {
        if libc::WIFSIGNALED(self.status) {
            let sig = libc::WTERMSIG(self.status);
            let name = nix::sys::signal::Signal::try_from(sig)
                .map(|s| s.as_str().to_string())
                .unwrap_or_else(|_| "unknown".into());
            let core = if libc::WCOREDUMP(self.status) {
                ", core dumped"
            } else {
                ""
            };
            format!("was killed by signal {sig} ({name}{core})")
        } else {
            format!("exited with status {}", libc::WEXITSTATUS(self.status))
        }
    }
}

/// Watches for the exit of the CRIU that one runc run starts; [`ExitWatch::finish`] it.
pub struct ExitWatch {
    stop: Arc<AtomicBool>,
    /// The pids picked at their exec so far.
    tracked: Arc<Mutex<Vec<i32>>>,
    thread: Option<JoinHandle<Vec<CriuExit>>>,
}

impl ExitWatch {
    /// Starts watching for the CRIU of the `runc … <id>` that this process is about to start.
    pub fn for_container(id: &str) -> Option<ExitWatch> {
        let me = std::process::id() as i32;
        let id = id.to_string();
        Self::start(move |pid| is_criu_of(pid, me, &id))
    }

    /// Starts watching for processes that `ours` picks when they exec. `None` when the kernel's
    /// process events cannot be read here.
    pub fn start(ours: impl Fn(i32) -> bool + Send + 'static) -> Option<ExitWatch> {
        let sock = match listen() {
            Ok(s) => s,
            Err(e) => {
                debug!(error = %e, "process events unavailable: CRIU's exit status will not be known");
                return None;
            }
        };
        let stop = Arc::new(AtomicBool::new(false));
        let tracked = Arc::new(Mutex::new(Vec::new()));
        let thread = std::thread::Builder::new()
            .name("criu-exit".into())
            .spawn({
                let (stop, tracked) = (stop.clone(), tracked.clone());
                move || watch(sock, &stop, &tracked, &ours)
            })
            .ok()?;
        Some(ExitWatch {
            stop,
            tracked,
            thread: Some(thread),
        })
    }

    /// The processes picked so far (at their exec).
    pub fn tracked(&self) -> Vec<i32> {
        self.tracked.lock().map(|t| t.clone()).unwrap_or_default()
    }

    /// Stops watching; the exits seen, after the events already queued are read.
    pub fn finish(mut self) -> Vec<CriuExit> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for ExitWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Whether `pid` runs CRIU (its executable is named `criu…`) under a `runc … <id>` that is a
/// child of `shim`.
fn is_criu_of(pid: i32, shim: i32, id: &str) -> bool {
    let exe = Process::new(pid).and_then(|p| p.exe()).unwrap_or_default();
    let is_criu = exe
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("criu"));
    if !is_criu {
        return false;
    }
    let Some(runc) = crate::process::parent_of(pid) else {
        return false;
    };
    let cmdline = Process::new(runc)
        .and_then(|p| p.cmdline())
        .unwrap_or_default();
    crate::process::parent_of(runc) == Some(shim) && cmdline.last().is_some_and(|last| last == id)
}

/// A netlink connector socket subscribed to the process events.
fn listen() -> io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments; the descriptor is owned at once.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            NETLINK_CONNECTOR,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a new descriptor that nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: an all-zero sockaddr_nl is valid; the fields are then set.
    let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    addr.nl_groups = CN_IDX_PROC;
    // SAFETY: bind(2) with a valid sockaddr_nl and its size.
    let rc = unsafe {
        libc::bind(
            sock.as_raw_fd(),
            std::ptr::addr_of!(addr).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // Receives wait at most POLL (then the stop flag is looked at); a burst of events finds room.
    let timeout = TimeVal::new(0, POLL.as_micros() as libc::suseconds_t);
    let _ = setsockopt(&sock, sockopt::ReceiveTimeout, &timeout);
    let _ = setsockopt(&sock, sockopt::RcvBuf, &(4 << 20));
    control(&sock, PROC_CN_MCAST_LISTEN)?;
    Ok(sock)
}

/// Sends `op` (listen or ignore) to the proc connector.
fn control(sock: &OwnedFd, op: u32) -> io::Result<()> {
    let mut msg = Vec::with_capacity(NLMSG_HDR + CN_MSG_HDR + 4);
    let len = (NLMSG_HDR + CN_MSG_HDR + 4) as u32;
    msg.extend_from_slice(&len.to_ne_bytes());
    msg.extend_from_slice(&(libc::NLMSG_DONE as u16).to_ne_bytes());
    msg.extend_from_slice(&0u16.to_ne_bytes()); // flags
    msg.extend_from_slice(&0u32.to_ne_bytes()); // seq
    msg.extend_from_slice(&std::process::id().to_ne_bytes());
    msg.extend_from_slice(&CN_IDX_PROC.to_ne_bytes());
    msg.extend_from_slice(&CN_VAL_PROC.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes()); // seq
    msg.extend_from_slice(&0u32.to_ne_bytes()); // ack
    msg.extend_from_slice(&4u16.to_ne_bytes()); // len
    msg.extend_from_slice(&0u16.to_ne_bytes()); // flags
    msg.extend_from_slice(&op.to_ne_bytes());
    // SAFETY: send(2) of a buffer we own, with its length.
    let n = unsafe { libc::send(sock.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Reads events until `stop` is set and the queue is empty: the exits of the processes `ours`
/// picked at their exec.
fn watch(
    sock: OwnedFd,
    stop: &AtomicBool,
    tracked: &Mutex<Vec<i32>>,
    ours: &dyn Fn(i32) -> bool,
) -> Vec<CriuExit> {
    let mut exits = Vec::new();
    let mut buf = vec![0u8; 8192];
    loop {
        // SAFETY: recv(2) into a buffer we own, with its length.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    continue;
                }
                io::ErrorKind::Interrupted => continue,
                // ENOBUFS: events were dropped; go on with the next ones.
                _ if e.raw_os_error() == Some(libc::ENOBUFS) => continue,
                _ => break,
            }
        }
        let msg = &buf[..n as usize];
        let ev = NLMSG_HDR + CN_MSG_HDR;
        let (Some(what), Some(pid), Some(tgid)) = (
            u32_at(msg, ev),
            u32_at(msg, ev + PROC_EVENT_HDR),
            u32_at(msg, ev + PROC_EVENT_HDR + 4),
        ) else {
            continue;
        };
        let (pid, tgid) = (pid as i32, tgid as i32);
        let is_tracked = |p| tracked.lock().is_ok_and(|t| t.contains(&p));
        if what == PROC_EVENT_EXEC && pid == tgid && ours(tgid) {
            if let Ok(mut t) = tracked.lock() {
                t.push(tgid);
            }
        } else if what == PROC_EVENT_EXIT && pid == tgid && is_tracked(tgid) {
            if let Some(status) = u32_at(msg, ev + PROC_EVENT_HDR + 8) {
                exits.push(CriuExit {
                    pid: tgid,
                    status: status as i32,
                });
            }
        }
    }
    let _ = control(&sock, PROC_CN_MCAST_IGNORE);
    exits
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn statuses_are_described_like_a_shell_would() {
        let killed = CriuExit {
            pid: 1,
            status: libc::SIGKILL,
        };
        assert_eq!(killed.describe(), "was killed by signal 9 (SIGKILL)");
        let segv = CriuExit {
            pid: 1,
            status: libc::SIGSEGV | 0x80,
        };
        assert_eq!(
            segv.describe(),
            "was killed by signal 11 (SIGSEGV, core dumped)"
        );
        let exited = CriuExit {
            pid: 1,
            status: 1 << 8,
        };
        assert_eq!(exited.describe(), "exited with status 1");
    }

    /// A child killed while watched is seen with its signal (root only: elsewhere the kernel's
    /// process events cannot be read, which the shim also survives).
    #[test]
    fn a_killed_child_is_seen_with_its_signal() {
        let me = std::process::id() as i32;
        let Some(watch) = ExitWatch::start(move |pid| {
            crate::process::parent_of(pid) == Some(me)
                && Process::new(pid)
                    .and_then(|p| p.exe())
                    .is_ok_and(|e| e.file_name().is_some_and(|n| n == "sleep"))
        }) else {
            assert_ne!(
                nix::unistd::geteuid().as_raw(),
                0,
                "root could not read the kernel's process events"
            );
            return;
        };
        // The subscription is in place once `start` returns; the exec event comes after. Under
        // load the watch can lag: the child is killed once the watch has picked it.
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as i32;
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !watch.tracked().contains(&pid) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        // Other tests of this binary run children of their own (which the matcher also picks).
        let exits: Vec<CriuExit> = watch
            .finish()
            .into_iter()
            .filter(|e| e.pid == pid)
            .collect();
        assert_eq!(
            exits,
            vec![CriuExit {
                pid: child.id() as i32,
                status: libc::SIGKILL
            }]
        );
    }
}
