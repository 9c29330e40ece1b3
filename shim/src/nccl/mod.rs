//! NCCL communicators in a checkpoint: the control server the layer (`libgpu-ckpt-nccl.so`,
//! preloaded into the container's processes, `inject.rs`) connects to, and the steps a
//! checkpoint, a resume and a restore run on it.
//!
//! One server per container of this shim, each with a listener at the container's socket
//! (`server.rs`) and one session per connected process (`session.rs`); the steps
//! (`steps.rs`) are what [`CommLayer`] runs, in this order:
//!
//! - before the device steps of a Pause or of a checkpoint of a running task: the listener
//!   closed (no process connects while CRIU dumps), nccl-quiesce, nccl-release, Disconnect
//!   ([`CommLayer::quiesce`]; on failure everything runs on as before);
//! - after the device resume (Resume, a leave-running checkpoint's end, ResumeAfterDump, and the
//!   undo of a failed step after the release): the listener open again, every released
//!   process back with its token, Resume (all suspended) or a rebuild on fresh unique ids, Go
//!   ([`CommLayer::resume`]);
//! - a restore: the processes the manifest records expected ([`CommLayer::expect`]) before
//!   `runc restore`, then after the device restore their return, a rebuild on fresh unique ids
//!   and Go ([`CommLayer::restored`]); a failure fails the restore.
//!
//! A container without the layer gets a [`CommLayer`] that does nothing.

mod cut;
mod detect;
pub mod inject;
mod quiesce;
mod rebuild;
mod server;
mod session;
mod steps;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use image_format::manifest::{NcclCut, NcclProcess, NcclRecord};
use tracing::{info, warn};

pub use server::{Cgroup, Membership, HELLO_TIMEOUT, MAX_CONNECTIONS};
use server::{Listener, Server};
use session::{Held, Shared};

use crate::error::{Error, Result};
use crate::options::RuntimeOptions;

/// The handler's `NcclTimeout`.
pub fn timeout(options: &RuntimeOptions) -> Result<Duration> {
    options.nccl_timeout()
}

/// What the steps of a checkpoint, resume and restore call; a container without the NCCL
/// layer has one that does nothing.
#[async_trait]
pub trait CommLayer: Send + Sync {
    /// nccl-quiesce, nccl-release and Disconnect of every process of the container (host
    /// pids `pids`), the listener closed; first, a process among `pids` that holds a GPU and
    /// maps NCCL and the layer without a session is refused. On failure every process runs on
    /// as before.
    async fn quiesce(&self, pids: Vec<i32>) -> Result<()>;
    /// After the device resume: the listener open again, every released process back, its
    /// communicators resumed or rebuilt, Go. `operation` names it in errors.
    async fn resume(&self, operation: &'static str) -> Result<()>;
    /// What the last quiesce released, for the manifest.
    fn record(&self) -> Option<NcclRecord>;
    /// The last quiesce's and resume's step timings.
    fn timings(&self) -> Vec<(&'static str, Duration)>;
    /// The checkpoint ended its processes (`--exit`): no one comes back.
    fn forget(&self);
    /// Before `runc restore`: the processes `record` lists are expected back.
    fn expect(&self, record: &NcclRecord);
    /// After the device restore of the container whose init is `init`: every expected process
    /// back, a rebuild on fresh unique ids, Go.
    async fn restored(&self, init: i32) -> Result<()>;
}

/// The [`CommLayer`] of a container without the NCCL layer.
pub struct NoComms;

#[async_trait]
impl CommLayer for NoComms {
    async fn quiesce(&self, _pids: Vec<i32>) -> Result<()> {
        Ok(())
    }
    async fn resume(&self, _operation: &'static str) -> Result<()> {
        Ok(())
    }
    fn record(&self) -> Option<NcclRecord> {
        None
    }
    fn timings(&self) -> Vec<(&'static str, Duration)> {
        Vec::new()
    }
    fn forget(&self) {}
    fn expect(&self, _record: &NcclRecord) {}
    async fn restored(&self, _init: i32) -> Result<()> {
        Ok(())
    }
}

/// The control server of one container with the layer.
pub struct ContainerComms {
    server: Arc<Server>,
    /// The container's name (CRI's), for a cut's record.
    name: String,
    socket: PathBuf,
    layer_blake3: String,
    listener: Mutex<Option<Listener>>,
    last: Mutex<Last>,
}

/// What the last steps left.
#[derive(Default)]
struct Last {
    released: Option<Vec<NcclProcess>>,
    /// The pod-wide cut the last quiesce (or the checkpoint restored) belongs to.
    cut: Option<NcclCut>,
    timings: Vec<(&'static str, Duration)>,
}

impl ContainerComms {
    /// A server for container `id` (named `name`) listening at `socket`.
    pub fn open(
        id: &str,
        name: &str,
        socket: &Path,
        layer_blake3: &str,
        timeout: Duration,
        members: Box<dyn Membership>,
    ) -> Result<Arc<ContainerComms>> {
        let server = Arc::new(Server {
            id: id.to_string(),
            shared: Shared::default(),
            members,
            timeout,
        });
        let c = Arc::new(ContainerComms {
            server,
            name: name.to_string(),
            socket: socket.to_path_buf(),
            layer_blake3: layer_blake3.to_string(),
            listener: Mutex::new(None),
            last: Mutex::new(Last::default()),
        });
        c.listen()?;
        Ok(c)
    }

    /// The container's init is host pid `pid`: connections are held to its cgroup.
    pub fn started(&self, pid: i32) {
        let fd = session::pidfd_open(pid);
        let mut st = self.server.shared.lock();
        st.init = Some(pid);
        st.init_fd = fd;
        drop(st);
        self.server.shared.notify();
    }

    fn listen(&self) -> Result<()> {
        let mut l = self.listener.lock().unwrap_or_else(|e| e.into_inner());
        if l.is_none() {
            *l = Some(
                Listener::open(&self.socket, self.server.clone()).map_err(Error::io(format!(
                    "NCCL control socket {}",
                    self.socket.display()
                )))?,
            );
        }
        Ok(())
    }

    fn unlisten(&self) {
        if let Some(l) = self
            .listener
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            l.close();
        }
    }

    fn last(&self) -> std::sync::MutexGuard<'_, Last> {
        self.last.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Closes the listener and every session; every wait ends.
    pub fn close(&self) {
        self.unlisten();
        let mut st = self.server.shared.lock();
        st.closed = true;
        for s in st.sessions.values_mut() {
            s.shut("the container is gone");
        }
        drop(st);
        self.server.shared.notify();
    }

    /// Whether host process `pid` has a session, or was released by a checkpoint.
    fn knows(&self, pid: i32) -> bool {
        let st = self.server.shared.lock();
        st.sessions
            .values()
            .any(|s| s.host_pid == pid && s.closed.is_none())
            || st.held.iter().any(|h| h.host_pid == pid)
    }

    fn quiesce_blocking(self: &Arc<Self>, pids: &[i32]) -> Result<()> {
        if let Some(m) = detect::refuse_unconnected(pids, |p| self.knows(p)) {
            return Err(steps::step_error("checkpoint", "nccl-quiesce", m));
        }
        self.unlisten();
        let ids = self.server.shared.open_sessions();
        let mut timings = Vec::new();
        let mut in_cut = None;
        let released = cut::quiesce(self, &ids).and_then(|(c, took)| {
            in_cut = c;
            timings.push(("nccl-quiesce", took));
            let t = Instant::now();
            let r = steps::release(&self.server, &ids).inspect_err(|_| cut::abandon(self))?;
            timings.push(("nccl-release", t.elapsed()));
            Ok(r)
        });
        let released = match released {
            Ok(r) => r,
            Err(e) => {
                if let Err(le) = self.listen() {
                    warn!(id = %self.server.id, error = %le, "undo of a failed NCCL quiesce: listener");
                }
                return Err(e);
            }
        };
        steps::disconnect(&self.server, &released);
        let records = self.server.shared.lock().held_records();
        info!(id = %self.server.id, processes = records.len(), "NCCL communicators released");
        let mut last = self.last();
        last.released = Some(records);
        last.timings = timings;
        last.cut = in_cut;
        Ok(())
    }

    fn resume_blocking(&self, operation: &'static str) -> Result<()> {
        self.listen()?;
        if self.server.shared.lock().held.is_empty() {
            return Ok(());
        }
        let back = steps::reconnect(&self.server, operation, "nccl-resume")?;
        let t = Instant::now();
        if cut::resume(self, back.clone())? {
            return Ok(());
        }
        steps::bring_back(&self.server, &back, operation)?;
        let rebuilt = !back.iter().all(|(_, p)| p.suspended);
        self.last().timings.push((
            if rebuilt {
                "nccl-rebuild"
            } else {
                "nccl-resume"
            },
            t.elapsed(),
        ));
        Ok(())
    }

    fn restored_blocking(self: &Arc<Self>, init: i32) -> Result<()> {
        self.started(init);
        if self.server.shared.lock().held.is_empty() {
            return Ok(());
        }
        let in_cut = self.last().cut.clone();
        if cut::restored(self, in_cut.as_ref()) {
            return Ok(());
        }
        let back = steps::reconnect(&self.server, "restore", "nccl-rebuild")?;
        let ids: Vec<u64> = back.iter().map(|(id, _)| *id).collect();
        let t = Instant::now();
        steps::rebuild(&self.server, &ids, "restore")?;
        steps::go(&self.server, &ids);
        info!(id = %self.server.id, processes = ids.len(), nccl_rebuild_ms = t.elapsed().as_millis() as u64, "NCCL communicators rebuilt after the restore");
        self.last().timings = vec![("nccl-rebuild", t.elapsed())];
        Ok(())
    }
}

#[async_trait]
impl CommLayer for Arc<ContainerComms> {
    async fn quiesce(&self, pids: Vec<i32>) -> Result<()> {
        let c = self.clone();
        tokio::task::spawn_blocking(move || c.quiesce_blocking(&pids))
            .await
            .map_err(|e| Error::FailedPrecondition(format!("NCCL quiesce: {e}")))?
    }

    async fn resume(&self, operation: &'static str) -> Result<()> {
        let c = self.clone();
        tokio::task::spawn_blocking(move || c.resume_blocking(operation))
            .await
            .map_err(|e| Error::FailedPrecondition(format!("NCCL resume: {e}")))?
    }

    fn record(&self) -> Option<NcclRecord> {
        let last = self.last();
        Some(NcclRecord {
            layer_blake3: self.layer_blake3.clone(),
            processes: last.released.clone().unwrap_or_default(),
            cut: last.cut.clone(),
        })
    }

    fn timings(&self) -> Vec<(&'static str, Duration)> {
        self.last().timings.clone()
    }

    fn forget(&self) {
        self.server.shared.lock().held.clear();
        self.last().released = None;
    }

    fn expect(&self, record: &NcclRecord) {
        self.last().cut = record.cut.clone();
        let mut st = self.server.shared.lock();
        st.held = record
            .processes
            .iter()
            .map(|p| Held {
                host_pid: 0,
                record: p.clone(),
            })
            .collect();
    }

    async fn restored(&self, init: i32) -> Result<()> {
        let c = self.clone();
        tokio::task::spawn_blocking(move || c.restored_blocking(init))
            .await
            .map_err(|e| Error::FailedPrecondition(format!("NCCL rebuild: {e}")))?
    }
}

/// The servers of this shim's containers.
static CONTAINERS: Mutex<BTreeMap<String, Arc<ContainerComms>>> = Mutex::new(BTreeMap::new());

fn containers() -> std::sync::MutexGuard<'static, BTreeMap<String, Arc<ContainerComms>>> {
    CONTAINERS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Opens the control server of container `id` (idempotent), whose processes connect at
/// `setup.socket`; the init, where already known, is `init`.
pub fn open(
    id: &str,
    name: &str,
    setup: &inject::NcclSetup,
    options: &RuntimeOptions,
    init: i32,
) -> Result<()> {
    if containers().contains_key(id) {
        return Ok(());
    }
    let c = ContainerComms::open(
        id,
        name,
        &setup.socket,
        &setup.layer_blake3,
        timeout(options)?,
        Box::new(Cgroup),
    )?;
    if init > 0 {
        c.started(init);
    }
    containers().insert(id.to_string(), c);
    Ok(())
}

/// The [`CommLayer`] of container `id`.
pub fn of(id: &str) -> Arc<dyn CommLayer> {
    match containers().get(id) {
        Some(c) => Arc::new(c.clone()),
        None => Arc::new(NoComms),
    }
}

/// The container's init is host pid `pid`.
pub fn started(id: &str, pid: i32) {
    if let Some(c) = containers().get(id) {
        c.started(pid);
    }
}

/// Closes container `id`'s server (at Delete).
pub fn close(id: &str) {
    if let Some(c) = containers().remove(id) {
        c.close();
    }
}

/// SIGKILL of container `id`: every session ends and every wait of a step on them ends now,
/// so that a checkpoint holding the container's lock gives it up at once.
pub fn abort(id: &str) {
    if let Some(c) = containers().get(id).cloned() {
        c.server.shared.abort();
    }
}

/// Whether host process `pid` is known to the control server of its container: connected, or
/// released by the checkpoint under way. A process that maps the layer and is not known holds
/// communicators the checkpoint cannot quiesce (it is refused before any device lock).
pub fn known(pid: i32) -> bool {
    containers().values().any(|c| c.knows(pid))
}

/// Refuses a checkpoint whose NCCL record does not fit this container: its layer is not the
/// one the checkpoint was taken with, or it has none.
pub fn check_layer(record: Option<&NcclRecord>, setup: Option<&inject::NcclSetup>) -> Result<()> {
    let Some(record) = record else {
        return Ok(());
    };
    let fail = |m: String| steps::step_error("restore", "nccl-layer", m);
    match setup {
        None => Err(fail(format!(
            "the checkpoint was taken with gpu-ckpt's NCCL layer ({} processes with communicators), and this container has none: set the annotation gpu-ckpt.io/nccl: managed (or the handler option Nccl = \"managed\")",
            record.processes.len()
        ))),
        Some(s) if s.layer_blake3 != record.layer_blake3 => Err(fail(format!(
            "the NCCL layer on this node ({}) is not the one the checkpoint was taken with ({})",
            s.layer_blake3, record.layer_blake3
        ))),
        Some(_) => {
            check_record(record).map_err(fail)?;
            cut::check_restore(record.cut.as_ref(), &record.processes)
        }
    }
}

/// Containers one cut may name.
const MAX_CUT: usize = 1024;

/// The record holds what a checkpoint of this shim writes, within the bounds the server keeps:
/// at most [`MAX_CONNECTIONS`] processes, each with a pid of its own, a token as the server
/// gives them, at most [`session::MAX_COMMS`] communicators, each with a key of at most
/// [`session::MAX_KEY`] bytes and a rank within its number of ranks; a cut of at most
/// [`MAX_CUT`] containers.
fn check_record(record: &NcclRecord) -> std::result::Result<(), String> {
    let shown = steps::shown;
    if record.processes.len() > MAX_CONNECTIONS {
        return Err(format!(
            "the checkpoint's NCCL record lists {} processes (at most {MAX_CONNECTIONS})",
            record.processes.len()
        ));
    }
    let mut pids = std::collections::BTreeSet::new();
    for p in &record.processes {
        if p.pid <= 0 || !pids.insert(p.pid) {
            return Err(format!(
                "the checkpoint's NCCL record lists pid {} {}",
                p.pid,
                if p.pid <= 0 { "(not a pid)" } else { "twice" }
            ));
        }
        if p.token.len() != 32 || !p.token.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!(
                "the checkpoint's NCCL record gives pid {} the token {}, not one this shim gives",
                p.pid,
                shown(&p.token)
            ));
        }
        if p.comms.len() > session::MAX_COMMS {
            return Err(format!(
                "the checkpoint's NCCL record gives pid {} {} communicators (at most {})",
                p.pid,
                p.comms.len(),
                session::MAX_COMMS
            ));
        }
        for c in &p.comms {
            if c.key.len() > session::MAX_KEY || c.nranks < 1 || c.rank < 0 || c.rank >= c.nranks {
                return Err(format!(
                    "the checkpoint's NCCL record gives pid {} communicator {} rank {} of {} on key {}: not one the layer announces",
                    p.pid,
                    c.id,
                    c.rank,
                    c.nranks,
                    shown(&c.key)
                ));
            }
        }
    }
    if let Some(cut) = &record.cut {
        if cut.containers.len() > MAX_CUT {
            return Err(format!(
                "the checkpoint's NCCL cut names {} containers (at most {MAX_CUT})",
                cut.containers.len()
            ));
        }
    }
    Ok(())
}
