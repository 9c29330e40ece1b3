//! OOM-kill detection for a container's memory cgroup, on cgroup v1 (eventfd on
//! `memory.oom_control`) and v2 (inotify on `memory.events`).
//!
//! Both only wake the watcher; what counts is the kernel's `oom_kill` counter, compared with the
//! last value reported, so an OOM kill is reported once whichever path sees it first. The exit
//! handler checks the counter before it reports the init process's exit, so TaskOOM always
//! comes before TaskExit.
//!
//! cgroups-rs finds the cgroup ([`crate::stats::TaskCgroup`]); the wake-up and the counter stay
//! here: its OOM notification registers `memory.oom_control` on v2 too (a v1-only file) and
//! blocks a thread per cgroup, and it has no reader of v2's `memory.events`.

use std::{
    fs::File,
    io::Write,
    os::fd::{AsFd, AsRawFd, OwnedFd},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use containerd_shim::protos::{events::task::TaskOOM, topics::TASK_OOM_EVENT_TOPIC};
use tokio::io::unix::AsyncFd;
use tracing::{debug, warn};

use crate::events::EventSender;
use crate::stats::{dir_of, TaskCgroup};

/// Where a container's memory cgroup keeps its OOM-kill counter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemoryCgroup {
    /// cgroup v1: the memory controller's directory.
    V1(PathBuf),
    /// cgroup v2: the unified directory.
    V2(PathBuf),
}

impl MemoryCgroup {
    /// The memory cgroup of `pid` (found by cgroups-rs from `/proc/<pid>/cgroup`).
    pub fn of_pid(pid: i32) -> Option<Self> {
        let cgroup = TaskCgroup::of_pid(pid).ok()?;
        Self::at(&dir_of(cgroup.memory.as_ref()?), cgroup.v2)
    }

    /// The memory cgroup at `dir`; on v2 only where it has `memory.events`.
    fn at(dir: &Path, v2: bool) -> Option<Self> {
        if !v2 {
            return Some(MemoryCgroup::V1(dir.into()));
        }
        dir.join("memory.events")
            .exists()
            .then(|| MemoryCgroup::V2(dir.into()))
    }

    /// The kernel's count of OOM kills in this cgroup.
    pub fn oom_kills(&self) -> Option<u64> {
        let (file, key) = match self {
            MemoryCgroup::V1(dir) => (dir.join("memory.oom_control"), "oom_kill"),
            MemoryCgroup::V2(dir) => (dir.join("memory.events"), "oom_kill"),
        };
        let text = std::fs::read_to_string(file).ok()?;
        text.lines().find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == key).then(|| v.trim().parse().ok()).flatten()
        })
    }
}

/// The OOM state of one container, shared by its watcher and the exit handler.
pub struct OomMonitor {
    container_id: String,
    cgroup: MemoryCgroup,
    reported: Mutex<u64>,
    events: EventSender,
}

impl OomMonitor {
    /// Starts watching `cgroup`. Kills that happened before now are not reported.
    pub fn start(container_id: &str, cgroup: MemoryCgroup, events: EventSender) -> Arc<Self> {
        let monitor = Arc::new(Self {
            container_id: container_id.to_string(),
            reported: Mutex::new(cgroup.oom_kills().unwrap_or(0)),
            cgroup,
            events,
        });
        let watcher = Arc::downgrade(&monitor);
        let cgroup = monitor.cgroup.clone();
        tokio::spawn(async move {
            let wake = match Wakeup::new(&cgroup) {
                Ok(w) => w,
                Err(e) => {
                    warn!(?cgroup, error = %e, "cannot watch for OOM kills; they are reported at exit only");
                    return;
                }
            };
            // A kill between start and the registration above woke nobody: look once now.
            if let Some(m) = watcher.upgrade() {
                m.check();
            }
            while wake.wait().await.is_ok() {
                // cgroup v1 signals when the cgroup enters OOM, before the kernel has killed
                // anything and counted it: look again for a while.
                for _ in 0..40 {
                    let Some(m) = watcher.upgrade() else {
                        return;
                    };
                    if m.check() {
                        break;
                    }
                    drop(m);
                    tokio::time::sleep(std::time::Duration::from_millis(25)).await;
                }
            }
            debug!(?cgroup, "OOM watcher stopped");
        });
        monitor
    }

    /// Publishes TaskOOM if the kernel counted a kill since the last report; says whether it did.
    pub fn check(&self) -> bool {
        let Ok(mut reported) = self.reported.lock() else {
            return false;
        };
        if let Some(now) = self.cgroup.oom_kills() {
            if now > *reported {
                *reported = now;
                // Sent while holding the lock: no other check can report in between.
                self.events.send(
                    TASK_OOM_EVENT_TOPIC,
                    TaskOOM {
                        container_id: self.container_id.clone(),
                        ..Default::default()
                    },
                );
                return true;
            }
        }
        false
    }
}

/// What wakes the watcher: an eventfd registered with `cgroup.event_control` (v1) or an
/// inotify watch on `memory.events` (v2). Either ends when the cgroup goes away.
struct Wakeup {
    fd: AsyncFd<OwnedFd>,
    _oom_control: Option<File>,
}

impl Wakeup {
    fn new(cgroup: &MemoryCgroup) -> std::io::Result<Self> {
        match cgroup {
            MemoryCgroup::V1(dir) => {
                let efd = nix::sys::eventfd::EventFd::from_flags(
                    nix::sys::eventfd::EfdFlags::EFD_CLOEXEC
                        | nix::sys::eventfd::EfdFlags::EFD_NONBLOCK,
                )?;
                let oom_control = File::open(dir.join("memory.oom_control"))?;
                let mut control = std::fs::OpenOptions::new()
                    .write(true)
                    .open(dir.join("cgroup.event_control"))?;
                // One write: the kernel parses each write to event_control on its own.
                let line = format!("{} {}", efd.as_fd().as_raw_fd(), oom_control.as_raw_fd());
                control.write_all(line.as_bytes())?;
                let fd: OwnedFd = efd.into();
                Ok(Self {
                    fd: register(fd)?,
                    _oom_control: Some(oom_control),
                })
            }
            MemoryCgroup::V2(dir) => {
                use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
                let inotify = Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK)?;
                inotify.add_watch(&dir.join("memory.events"), AddWatchFlags::IN_MODIFY)?;
                let fd: OwnedFd = inotify.into();
                Ok(Self {
                    fd: register(fd)?,
                    _oom_control: None,
                })
            }
        }
    }

    async fn wait(&self) -> std::io::Result<()> {
        loop {
            let mut guard = self.fd.readable().await?;
            let mut buf = [0u8; 4096];
            match guard.try_io(|fd| {
                nix::unistd::read(fd.get_ref(), &mut buf).map_err(std::io::Error::from)
            }) {
                Ok(Ok(0)) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }
}

fn register(fd: OwnedFd) -> std::io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: the AsyncFd owns the descriptor, so it stays open and the same while registered.
    unsafe { AsyncFd::register(fd) }.map_err(std::io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test process's own memory cgroup: on v1 the memory line's cgroup below the memory
    /// hierarchy (cgroups-rs finds its mount), on v2 the unified one.
    #[test]
    fn own_memory_cgroup_is_found() {
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let cgroup = MemoryCgroup::of_pid(std::process::id() as i32);
        match own.lines().find_map(|l| l.split_once(":memory:")) {
            Some((_, rel)) => {
                let Some(MemoryCgroup::V1(dir)) = &cgroup else {
                    panic!("v1 expected: {cgroup:?}")
                };
                assert!(dir.ends_with(rel.trim_start_matches('/')), "{dir:?} {rel}");
                assert!(dir.join("memory.oom_control").exists(), "{dir:?}");
            }
            None => assert!(
                matches!(&cgroup, None | Some(MemoryCgroup::V2(_))),
                "{cgroup:?}"
            ),
        }
        if let Some(cg) = cgroup {
            assert!(cg.oom_kills().is_some(), "{cg:?}");
        }
    }

    #[test]
    fn v2_needs_memory_events() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("kubepods/pod1/c1");
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(MemoryCgroup::at(&dir, true), None);
        std::fs::write(dir.join("memory.events"), "low 0\noom 1\noom_kill 2\n").unwrap();
        let cg = MemoryCgroup::at(&dir, true).unwrap();
        assert_eq!(cg, MemoryCgroup::V2(dir.clone()));
        assert_eq!(cg.oom_kills(), Some(2));
    }

    #[test]
    fn v1_counter_is_read_from_oom_control() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n",
        )
        .unwrap();
        assert_eq!(MemoryCgroup::V1(dir.path().into()).oom_kills(), Some(3));
    }
}
