//! The control server's state for one container: its sessions (one per connected process),
//! the processes released by a checkpoint and expected back, and the waits on them.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use image_format::manifest::{NcclComm, NcclProcess};
use nccl_control::{Connection, LayerMsg, ShimMsg};

/// How long a message to the layer may block.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(5);
/// Communicators one session may announce; more close it.
pub const MAX_COMMS: usize = 4096;
/// The longest communicator key a session may announce; a longer one closes it.
pub const MAX_KEY: usize = 512;
/// Replies nobody asked for that a session may have queued; more close it.
pub const MAX_UNASKED: usize = 8;
/// Ended sessions kept (for the messages of a step that was asking them); the oldest go first.
pub const MAX_ENDED: usize = 64;

/// One connected process.
pub struct Session {
    pub host_pid: i32,
    pub ns_pid: i32,
    /// The token this session was given (`Welcome`).
    pub token: String,
    /// The token it presented (`Hello.resumed`): which released process it is.
    pub resumed: Option<String>,
    pub nccl_version: i32,
    /// Its communicators (`Comm` minus `CommGone`), by the layer's id.
    pub comms: BTreeMap<u64, NcclComm>,
    /// Replies not yet taken by a step, in order.
    pub replies: VecDeque<LayerMsg>,
    /// Why the connection ended, once it has.
    pub closed: Option<String>,
    /// Requests sent that await a reply (each reply taken counts one off).
    pub asked: usize,
    /// The connection's writing end; none once the session ended (its descriptor closed).
    writer: Option<Connection>,
}

impl Session {
    pub fn new(
        host_pid: i32,
        ns_pid: i32,
        token: String,
        hello: (i32, Option<String>),
        writer: Connection,
    ) -> Session {
        Session {
            host_pid,
            ns_pid,
            token,
            resumed: hello.1,
            nccl_version: hello.0,
            comms: BTreeMap::new(),
            replies: VecDeque::new(),
            closed: None,
            asked: 0,
            writer: Some(writer),
        }
    }

    /// A second handle on the connection, to write outside the lock.
    pub(super) fn writer_clone(&self) -> Result<Connection, String> {
        self.writer
            .as_ref()
            .ok_or("its control connection is gone")?
            .try_clone()
            .map_err(|e| format!("its control connection: {e}"))
    }

    /// Ends the connection (the reader sees it closed).
    pub fn shut(&mut self, why: &str) {
        if let Some(w) = &self.writer {
            w.shutdown();
        }
        if self.closed.is_none() {
            self.closed = Some(why.to_string());
        }
    }

    /// A reply arrived: queued for the step that asked, or the session closed when it has
    /// queued more than [`MAX_UNASKED`] that nobody asked for. Whether it is still open.
    pub fn queue(&mut self, reply: LayerMsg) -> bool {
        if self.replies.len() >= self.asked + MAX_UNASKED {
            self.shut(&format!(
                "it sent more than {MAX_UNASKED} replies nobody asked for"
            ));
            return false;
        }
        self.replies.push_back(reply);
        true
    }

    /// The oldest reply, taken by the step that asked.
    pub fn take_reply(&mut self) -> Option<LayerMsg> {
        let m = self.replies.pop_front()?;
        self.asked = self.asked.saturating_sub(1);
        Some(m)
    }

    /// The connection ended: its descriptor closed, and everything it sent dropped but the
    /// replies a step asked for and the communicator that names it in messages.
    fn retire(&mut self) {
        self.writer = None;
        self.replies.truncate(self.asked);
        let keep = self
            .comms
            .values()
            .find(|c| !c.key.contains('/'))
            .or(self.comms.values().next())
            .cloned();
        self.comms = keep.into_iter().map(|c| (c.id, c)).collect();
    }

    /// What the manifest and a later reconnection know of it.
    pub fn record(&self, suspended: bool) -> NcclProcess {
        NcclProcess {
            pid: self.ns_pid,
            token: self.token.clone(),
            nccl_version: self.nccl_version,
            suspended,
            comms: self.comms.values().cloned().collect(),
        }
    }
}

/// `pid 1234 (rank 3 of 4, pid 7 in the container)`: the rank of `rank` where the layer named
/// one, else of its first communicator; a host pid of 0 (not known yet) is left out.
pub fn describe<'a>(
    host_pid: i32,
    ns_pid: i32,
    comms: impl IntoIterator<Item = &'a NcclComm>,
    rank: Option<(u64, i32)>,
) -> String {
    let comms: Vec<&NcclComm> = comms.into_iter().collect();
    let named = rank.and_then(|(id, r)| comms.iter().find(|c| c.id == id).map(|c| (r, c.nranks)));
    let first = comms
        .iter()
        .find(|c| !c.key.contains('/'))
        .or(comms.first());
    let rank = match named.or(first.map(|c| (c.rank, c.nranks))) {
        Some((r, n)) => format!("rank {r} of {n}, "),
        None => String::new(),
    };
    if host_pid > 0 {
        format!("pid {host_pid} ({rank}pid {ns_pid} in the container)")
    } else if rank.is_empty() {
        format!("pid {ns_pid} in the container")
    } else {
        format!(
            "pid {ns_pid} in the container ({})",
            rank.trim_end_matches(", ")
        )
    }
}

/// A process released by a checkpoint, expected to connect again with its token.
#[derive(Debug, Clone)]
pub struct Held {
    /// Its host pid before (0 after a restore: not known).
    pub host_pid: i32,
    pub record: NcclProcess,
}

impl Held {
    pub fn describe(&self) -> String {
        describe(self.host_pid, self.record.pid, &self.record.comms, None)
    }
}

impl State {
    /// The records of the processes held (released, not connected again yet), in order.
    pub fn held_records(&self) -> Vec<NcclProcess> {
        self.held.iter().map(|h| h.record.clone()).collect()
    }

    /// Session `id`'s connection ended (`why`, unless it was closed before): the session is
    /// retired, and the oldest ended sessions beyond [`MAX_ENDED`] are forgotten, so that
    /// connections that come and go hold neither descriptors nor memory.
    pub fn ended(&mut self, id: u64, why: Option<String>) {
        if let Some(s) = self.sessions.get_mut(&id) {
            if s.closed.is_none() {
                s.closed = Some(why.unwrap_or_else(|| "its control connection ended".into()));
            }
            if let Some(w) = &s.writer {
                w.shutdown();
            }
            s.retire();
        }
        let ended: Vec<u64> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.writer.is_none())
            .map(|(id, _)| *id)
            .collect();
        for id in ended.iter().take(ended.len().saturating_sub(MAX_ENDED)) {
            self.sessions.remove(id);
        }
    }
}

/// Everything under the lock.
#[derive(Default)]
pub struct State {
    pub sessions: BTreeMap<u64, Session>,
    pub next_session: u64,
    /// Connections accepted and not yet ended (sessions and those still saying Hello).
    pub connections: usize,
    /// The container's init (host pid), once known: connections are held to its cgroup.
    pub init: Option<i32>,
    /// A pidfd of the init, taken when it was known: a signal through it never reaches a
    /// process that has the init's pid after the init exited.
    pub init_fd: Option<std::os::fd::OwnedFd>,
    /// Released processes that have not connected again yet.
    pub held: Vec<Held>,
    /// The container is gone: every wait ends.
    pub closed: bool,
}

/// The state and its condition variable (notified on every change).
#[derive(Default)]
pub struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn notify(&self) {
        self.changed.notify_all();
    }

    /// Waits (until `deadline`) for `done` to hold, re-checked on every change; the guard and
    /// whether it held.
    pub fn wait_until<'a>(
        &'a self,
        mut guard: MutexGuard<'a, State>,
        deadline: Instant,
        mut done: impl FnMut(&mut State) -> bool,
    ) -> (MutexGuard<'a, State>, bool) {
        loop {
            if done(&mut guard) {
                return (guard, true);
            }
            let now = Instant::now();
            if now >= deadline || guard.closed {
                return (guard, false);
            }
            guard = self
                .changed
                .wait_timeout(guard, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Sends `msg` to every session of `ids` first, then waits (until `deadline`) for one reply
    /// from each: each session's reply, or why it has none.
    pub fn ask(
        &self,
        ids: &[u64],
        msg: impl Fn(u64) -> ShimMsg,
        deadline: Instant,
    ) -> Vec<(u64, Result<LayerMsg, String>)> {
        self.ask_many(ids.iter().map(|&id| (id, msg(id))).collect(), deadline)
    }

    /// Sends every request first (a session may get several), then waits (until `deadline`)
    /// for one reply to each, taken in order per session: the answers in the requests' order.
    pub fn ask_many(
        &self,
        requests: Vec<(u64, ShimMsg)>,
        deadline: Instant,
    ) -> Vec<(u64, Result<LayerMsg, String>)> {
        let mut answers: Vec<Option<Result<LayerMsg, String>>> = vec![None; requests.len()];
        let sent = self.send_each(
            requests.iter().map(|(id, m)| (*id, m)).collect(),
            deadline,
            true,
        );
        for (i, r) in sent.into_iter().enumerate() {
            if let Err(e) = r {
                answers[i] = Some(Err(e));
            }
        }
        let st = self.lock();
        let (mut st, _) = self.wait_until(st, deadline, |st| {
            for (i, (id, _)) in requests.iter().enumerate() {
                if answers[i].is_some() {
                    continue;
                }
                let Some(s) = st.sessions.get_mut(id) else {
                    answers[i] = Some(Err("its control connection is gone".into()));
                    continue;
                };
                if let Some(m) = s.take_reply() {
                    answers[i] = Some(Ok(m));
                } else if let Some(why) = &s.closed {
                    answers[i] = Some(Err(why.clone()));
                }
            }
            answers.iter().all(Option::is_some)
        });
        let gone = st.closed;
        let out = requests
            .iter()
            .zip(answers)
            .map(|((id, _), a)| {
                let a = a.unwrap_or_else(|| {
                    // A late reply would be taken for the answer to the next request.
                    if let Some(s) = st.sessions.get_mut(id) {
                        s.shut("it did not answer in time");
                    }
                    Err(if gone {
                        "the container is gone".to_string()
                    } else {
                        "no answer".to_string()
                    })
                });
                (*id, a)
            })
            .collect();
        drop(st);
        self.notify();
        out
    }

    /// Sends `msg` to every session of `ids`, expecting no reply; the failures.
    pub fn tell(&self, ids: &[u64], msg: &ShimMsg) -> Vec<(u64, String)> {
        let sent = self.send_each(
            ids.iter().map(|id| (*id, msg)).collect(),
            Instant::now() + SEND_TIMEOUT,
            false,
        );
        ids.iter()
            .zip(sent)
            .filter_map(|(id, r)| r.err().map(|e| (*id, e)))
            .collect()
    }

    /// Sends each message to its session, outside the lock (a session that does not read
    /// holds no one else up), each write bounded by [`SEND_TIMEOUT`] and `deadline`, none
    /// once the container is closed ([`Shared::abort`]); `asking`: each awaits a reply. A
    /// session whose write fails is closed. Each send's result, in order.
    fn send_each(
        &self,
        sends: Vec<(u64, &ShimMsg)>,
        deadline: Instant,
        asking: bool,
    ) -> Vec<Result<(), String>> {
        let writers: Vec<Result<Connection, String>> = {
            let mut st = self.lock();
            sends
                .iter()
                .map(|(id, _)| {
                    let s = st
                        .sessions
                        .get_mut(id)
                        .ok_or("its control connection is gone")?;
                    if let Some(why) = &s.closed {
                        return Err(why.clone());
                    }
                    let w = s.writer_clone()?;
                    if asking {
                        s.asked += 1;
                    }
                    Ok(w)
                })
                .collect()
        };
        sends
            .iter()
            .zip(writers)
            .map(|((id, msg), w)| {
                let mut w = w?;
                if self.lock().closed {
                    return Err("the container is gone".to_string());
                }
                let left = deadline.saturating_duration_since(Instant::now());
                w.send(*msg, Some(left.min(SEND_TIMEOUT))).map_err(|e| {
                    let why = format!("its control connection failed: {e}");
                    if let Some(s) = self.lock().sessions.get_mut(id) {
                        s.shut(&why);
                    }
                    why
                })
            })
            .collect()
    }

    /// The container is being killed: every session ends (a write in progress fails at
    /// once) and every wait on them ends now.
    pub fn abort(&self) {
        let mut st = self.lock();
        st.closed = true;
        for s in st.sessions.values_mut() {
            s.shut("the container is being killed");
        }
        drop(st);
        self.notify();
    }

    /// The sessions still open, in the order they connected.
    pub fn open_sessions(&self) -> Vec<u64> {
        let mut st = self.lock();
        st.sessions.retain(|_, s| s.closed.is_none());
        st.sessions.keys().copied().collect()
    }
}

/// A pidfd of process `pid`; none where it is gone or the kernel has none.
pub fn pidfd_open(pid: i32) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: a new descriptor the kernel returned, owned by nothing else.
    (fd >= 0).then(|| unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

/// Sends `signal` (0: none, whether the process is still there) through pidfd `fd`.
pub fn pidfd_signal(fd: &std::os::fd::OwnedFd, signal: i32) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: pidfd_send_signal on a pidfd we own, no siginfo, no flags.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

impl State {
    /// SIGKILL of the container's init: through its pidfd (an init that exited is not
    /// confused with a later process of the same pid), else by pid where the kernel gave none.
    pub fn kill_init(&self) -> std::io::Result<()> {
        match (&self.init_fd, self.init) {
            (Some(fd), _) => pidfd_signal(fd, libc::SIGKILL),
            (None, Some(pid)) => nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            )
            .map_err(std::io::Error::from),
            (None, None) => Ok(()),
        }
    }
}
