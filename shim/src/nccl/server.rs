//! The control server of one container: a listener at the socket the container sees as
//! `/run/gpu-ckpt-nccl/control.sock`, and one thread per connection that authenticates it (the
//! peer must be a process of the container: its cgroup is the init's, and the pid it says in
//! `Hello` is its own in the container) and then reads the layer's messages into the session.
//!
//! Hostile peers are bounded: frames over `MAX_FRAME` and anything but a `Hello` first close
//! the connection; `Hello` must come within [`HELLO_TIMEOUT`], and a frame that began must
//! go on arriving; at most [`MAX_CONNECTIONS`] connections at once.

use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nccl_control::{Connection, ControlError, LayerMsg, ShimMsg};
use tracing::{debug, info, warn};

use super::session::{Session, Shared, MAX_COMMS, MAX_KEY, SEND_TIMEOUT};

/// Connections of one container at once; more are closed as they come.
pub const MAX_CONNECTIONS: usize = 256;
/// How long a new connection has to say Hello.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the accept and read loops look whether they should end.
const POLL: Duration = Duration::from_millis(100);

/// Who may connect: a process of the container.
pub trait Membership: Send + Sync {
    /// The pid in the container of host process `pid`, when it is a process of the container
    /// whose init is host process `init`; why not otherwise.
    fn check(&self, init: i32, pid: i32) -> Result<i32, String>;
}

/// A process of the container: in the init's cgroup (`/proc/<pid>/cgroup`); its pid in the
/// container is the last of its `NSpid`.
pub struct Cgroup;

impl Membership for Cgroup {
    fn check(&self, init: i32, pid: i32) -> Result<i32, String> {
        let read = |p: i32| {
            std::fs::read_to_string(format!("/proc/{p}/cgroup")).map_err(|e| format!("{e}"))
        };
        let theirs = read(pid).map_err(|e| format!("cgroup of pid {pid}: {e}"))?;
        let ours = read(init).map_err(|e| format!("cgroup of the container's init {init}: {e}"))?;
        if theirs != ours {
            return Err(format!(
                "pid {pid} is not a process of the container (its cgroup is {}, the container's {})",
                theirs.trim(),
                ours.trim()
            ));
        }
        crate::device::ns_pid(pid)
            .map(|p| p as i32)
            .ok_or_else(|| format!("pid {pid}: no NSpid"))
    }
}

/// One container's server: its state, who may connect, and its bound.
pub struct Server {
    pub id: String,
    pub shared: Shared,
    pub members: Box<dyn Membership>,
    /// `NcclTimeout`: every wait of the steps.
    pub timeout: Duration,
}

/// The listening socket and its accept thread.
pub struct Listener {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Listener {
    /// Binds `path` (mode 0666, so that ranks that are not root connect) and accepts in a
    /// thread.
    pub fn open(path: &Path, server: Arc<Server>) -> std::io::Result<Listener> {
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_dir() => {
                return Err(std::io::Error::other(format!(
                    "{} is a directory",
                    path.display()
                )))
            }
            Ok(_) => std::fs::remove_file(path)?,
            Err(_) => {}
        }
        let listener = UnixListener::bind(path)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::Builder::new()
            .name(format!("nccl-accept-{}", short(&server.id)))
            .spawn({
                let stop = stop.clone();
                move || accept_loop(&listener, &server, &stop)
            })?;
        debug!(path = %path.display(), "NCCL control listener open");
        Ok(Listener {
            path: path.to_path_buf(),
            stop,
            thread: Some(thread),
        })
    }

    /// Stops accepting and removes the socket: no process connects until it is opened again.
    pub fn close(mut self) {
        self.end();
    }

    fn end(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.end();
    }
}

fn short(id: &str) -> &str {
    &id[..id.len().min(8)]
}

fn accept_loop(listener: &UnixListener, server: &Arc<Server>, stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        let mut pfd = libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, POLL.as_millis() as i32) };
        if n <= 0 {
            continue;
        }
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                warn!(id = %server.id, error = %e, "NCCL control accept");
                std::thread::sleep(POLL);
                continue;
            }
        };
        {
            let mut st = server.shared.lock();
            if st.connections >= MAX_CONNECTIONS {
                warn!(id = %server.id, "NCCL control: {MAX_CONNECTIONS} connections already; one more closed");
                continue;
            }
            st.connections += 1;
        }
        let spawned = std::thread::Builder::new()
            .name(format!("nccl-conn-{}", short(&server.id)))
            .spawn({
                let server = server.clone();
                move || {
                    serve(&server, stream);
                    server.shared.lock().connections -= 1;
                    server.shared.notify();
                }
            });
        if let Err(e) = spawned {
            server.shared.lock().connections -= 1;
            warn!(id = %server.id, error = %e, "NCCL control connection thread");
        }
    }
}

/// The host pid of the peer (`SO_PEERCRED`).
fn peer_pid(stream: &UnixStream) -> Result<i32, String> {
    nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials)
        .map(|c| c.pid())
        .map_err(|e| format!("SO_PEERCRED: {e}"))
}

/// A pidfd of the peer as it connected (`SO_PEERPIDFD`); none where the kernel has none.
fn peer_pidfd(stream: &UnixStream) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    const SO_PEERPIDFD: libc::c_int = 77;
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt into an int of the size given.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    // SAFETY: a new descriptor the kernel returned, owned by nothing else.
    (r == 0 && fd >= 0).then(|| unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// 16 random bytes, hex.
fn new_token() -> Result<String, String> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).map_err(|e| format!("random bytes: {e}"))?;
    Ok(hex::encode(b))
}

/// One connection, from Hello to its end.
fn serve(server: &Server, stream: UnixStream) {
    let _ = stream.set_nonblocking(false);
    let peer = match peer_pid(&stream) {
        Ok(p) => p,
        Err(e) => {
            warn!(id = %server.id, error = %e, "NCCL control connection refused");
            return;
        }
    };
    // The peer itself (Linux 6.5 and later): its pid cannot be another process's while
    // its membership is checked.
    let peer_fd = peer_pidfd(&stream);
    let mut conn = Connection::new(stream);
    // Before a byte is read: a process of another cgroup is refused at once.
    let checked = member(server, peer).and_then(|ns| match &peer_fd {
        Some(fd) if super::session::pidfd_signal(fd, 0).is_err() => Err(format!(
            "pid {peer} exited while it was checked (its pid may be another process's now)"
        )),
        _ => Ok(ns),
    });
    let session = match checked.and_then(|ns| admit(server, &mut conn, peer, ns)) {
        Ok(s) => s,
        Err(why) => {
            warn!(id = %server.id, pid = peer, "NCCL control connection refused: {why}");
            conn.shutdown();
            return;
        }
    };
    read_loop(server, &mut conn, session);
}

/// The pid in the container of host process `peer`, when it is a process of the container.
fn member(server: &Server, peer: i32) -> Result<i32, String> {
    // The init is known once runc has started (or restored) it.
    let deadline = Instant::now() + server.timeout;
    let (st, known) = server
        .shared
        .wait_until(server.shared.lock(), deadline, |st| st.init.is_some());
    let init = st.init.filter(|_| known);
    drop(st);
    let init = init.ok_or("the container's init is not known")?;
    server.members.check(init, peer)
}

/// Hello, whole within [`HELLO_TIMEOUT`] and with pid `ns_pid` (the peer's in the
/// container), then Welcome: the session's id.
fn admit(server: &Server, conn: &mut Connection, peer: i32, ns_pid: i32) -> Result<u64, String> {
    let hello = conn
        .recv_by::<LayerMsg>(Instant::now() + HELLO_TIMEOUT)
        .map_err(|e| format!("no Hello: {e}"))?;
    let LayerMsg::Hello {
        version,
        pid,
        nccl_version,
        resumed,
    } = hello
    else {
        return Err(format!(
            "first message {} is not Hello",
            super::steps::shown(&format!("{hello:?}"))
        ));
    };
    if resumed.as_ref().is_some_and(|t| t.len() > 64) {
        return Err("it presents a token longer than any this shim gives".into());
    }
    if version != nccl_control::VERSION {
        return Err(format!(
            "protocol version {version}; this shim speaks {}",
            nccl_control::VERSION
        ));
    }
    if ns_pid != pid {
        return Err(format!(
            "Hello says pid {pid}, but host pid {peer} is pid {ns_pid} in the container"
        ));
    }
    let token = new_token()?;
    let writer = conn.try_clone().map_err(|e| e.to_string())?;
    let mut st = server.shared.lock();
    if let Some(t) = &resumed {
        if let Some(h) = st.held.iter().find(|h| &h.record.token == t) {
            if h.record.pid != ns_pid || (h.host_pid != 0 && h.host_pid != peer) {
                return Err(format!(
                    "it presents the token of {}, which is not this process",
                    h.describe()
                ));
            }
        }
    }
    conn.send(
        &ShimMsg::Welcome {
            token: token.clone(),
        },
        Some(SEND_TIMEOUT),
    )
    .map_err(|e| format!("Welcome: {e}"))?;
    let id = st.next_session;
    st.next_session += 1;
    st.sessions.insert(
        id,
        Session::new(peer, ns_pid, token, (nccl_version, resumed), writer),
    );
    drop(st);
    server.shared.notify();
    info!(id = %server.id, pid = peer, ns_pid, "NCCL layer connected");
    Ok(id)
}

/// Reads the layer's messages into session `id` until the connection ends.
fn read_loop(server: &Server, conn: &mut Connection, id: u64) {
    let why = loop {
        let msg = match conn.recv::<LayerMsg>(Some(POLL)) {
            Ok(m) => m,
            Err(ControlError::Timeout { .. }) => {
                let st = server.shared.lock();
                match st.sessions.get(&id) {
                    Some(s) if s.closed.is_none() && !st.closed => continue,
                    _ => break None,
                }
            }
            Err(ControlError::Closed) => break Some("it closed its control connection".into()),
            Err(e) => break Some(format!("its control connection failed: {e}")),
        };
        let mut st = server.shared.lock();
        let Some(s) = st.sessions.get_mut(&id) else {
            break None;
        };
        match msg {
            LayerMsg::Comm {
                id: comm,
                key,
                rank,
                nranks,
                cuda_dev,
                split,
            } => {
                if key.len() > MAX_KEY {
                    s.shut(&format!(
                        "it announced a communicator key of {} bytes (at most {MAX_KEY})",
                        key.len()
                    ));
                    break None;
                }
                if s.comms.len() >= MAX_COMMS && !s.comms.contains_key(&comm) {
                    s.shut(&format!("it announced more than {MAX_COMMS} communicators"));
                    break None;
                }
                s.comms.insert(
                    comm,
                    image_format::manifest::NcclComm {
                        id: comm,
                        key,
                        rank,
                        nranks,
                        cuda_dev,
                        split: split.map(|p| (p.parent, p.color, p.key)),
                    },
                );
            }
            LayerMsg::CommGone { id: comm } => {
                s.comms.remove(&comm);
            }
            LayerMsg::Hello { .. } => {
                s.shut("it said Hello twice");
                break None;
            }
            other => {
                if !s.queue(other) {
                    break None;
                }
            }
        }
        drop(st);
        server.shared.notify();
    };
    conn.shutdown();
    server.shared.lock().ended(id, why);
    server.shared.notify();
}
