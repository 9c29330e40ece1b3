//! A pod-wide cut: communicators whose ranks live in several containers of the pod (this
//! shim serves the whole pod).
//!
//! At a checkpoint: when the quiesce of container c1 finds communicator keys shared with
//! sibling containers, their ranks are quiesced with c1's, all at once, and held (not
//! released). c1's ranks are released and its checkpoint goes on; after it, c1 is resumed but
//! no rank gets Go until every container of the cut has been checkpointed (each releases its
//! ranks at its own checkpoint, the quiesce already done), or `NcclTimeout` has passed since
//! the first was done. Then, all at once: Resume where every released rank suspended its
//! communicators, else a rebuild of every rank of the cut on fresh ids; Go to all. A later
//! checkpoint starts a new cut. Each manifest records the cut's id and containers.
//!
//! At a restore: the containers of a cut are restored one by one (the pod's next container is
//! created after this one's Start returned), so the rebuild of a cut runs after Start returns,
//! once every recorded rank of every container of the cut is back, bounded by `NcclTimeout`
//! from the first restore; on failure the restored containers of the cut are killed.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use image_format::manifest::{NcclCut, NcclProcess};
use nccl_control::{LayerMsg, ShimMsg};
use tracing::{error, info, warn};

use super::quiesce::{self, ask_all};
use super::steps::{self, failure, first_of, step_error, ANSWER_GRACE};
use super::{containers, ContainerComms};
use crate::error::Error;

/// The cut under way at a checkpoint.
struct Cut {
    id: String,
    members: Vec<Arc<ContainerComms>>,
    /// Members whose own checkpoint released their ranks.
    released: BTreeSet<String>,
    /// Members whose checkpoint is over, with their sessions back.
    done: BTreeMap<String, Vec<(u64, NcclProcess)>>,
    quiesced_in: Duration,
    /// When it ends at the latest (set when the first member is done).
    deadline: Option<Instant>,
}

impl Cut {
    fn has(&self, id: &str) -> bool {
        self.members.iter().any(|m| m.server.id == id)
    }
    fn record(&self) -> NcclCut {
        NcclCut {
            id: self.id.clone(),
            containers: self.members.iter().map(|m| m.name.clone()).collect(),
        }
    }
}

static CUT: Mutex<Option<Cut>> = Mutex::new(None);

fn cut() -> MutexGuard<'static, Option<Cut>> {
    CUT.lock().unwrap_or_else(|e| e.into_inner())
}

fn new_id() -> String {
    let mut b = [0u8; 8];
    let _ = getrandom::fill(&mut b);
    hex::encode(b)
}

/// The root keys of the communicators of `ids` in `c`.
fn root_keys(c: &ContainerComms, ids: &[u64]) -> BTreeSet<String> {
    let st = c.server.shared.lock();
    ids.iter()
        .filter_map(|id| st.sessions.get(id))
        .flat_map(|s| s.comms.values())
        .map(|c| c.key.split('/').next().unwrap_or_default().to_string())
        .collect()
}

/// The other containers of this shim with ranks of the keys `keys`.
fn siblings(me: &ContainerComms, keys: &BTreeSet<String>) -> Vec<Arc<ContainerComms>> {
    let all: Vec<Arc<ContainerComms>> = containers()
        .values()
        .filter(|c| c.server.id != me.server.id)
        .cloned()
        .collect();
    all.into_iter()
        .filter(|c| {
            let ids = c.server.shared.open_sessions();
            !root_keys(c, &ids).is_disjoint(keys)
        })
        .collect()
}

/// nccl-quiesce of container `me` (its sessions `ids`): alone, or with the siblings that share
/// communicators with it (a new cut), or nothing where a cut under way already holds its
/// ranks. The cut it belongs to, and how long the quiesce took.
pub fn quiesce(
    me: &Arc<ContainerComms>,
    ids: &[u64],
) -> Result<(Option<NcclCut>, Duration), Error> {
    let mut guard = cut();
    if let Some(c) = guard.as_mut() {
        if c.has(&me.server.id) && !c.released.contains(&me.server.id) {
            c.released.insert(me.server.id.clone());
            info!(id = %me.server.id, cut = %c.id, "NCCL ranks already quiesced by the pod's cut");
            return Ok((Some(c.record()), c.quiesced_in));
        }
    }
    let t = Instant::now();
    let keys = root_keys(me, ids);
    let sibs = if keys.is_empty() {
        Vec::new()
    } else {
        siblings(me, &keys)
    };
    if sibs.is_empty() {
        quiesce::quiesce(&[(&*me.server, ids.to_vec())])?;
        return Ok((None, t.elapsed()));
    }
    // One cut at a time: one still under way ends now.
    if let Some(old) = guard.take() {
        warn!(cut = %old.id, "a new NCCL cut begins: the one under way ends");
        if let Err(e) = finish(old, "checkpoint") {
            error!(error = %e, "the end of the NCCL cut under way");
        }
    }
    let mut parts = vec![(&*me.server, ids.to_vec())];
    for s in &sibs {
        parts.push((&*s.server, s.server.shared.open_sessions()));
    }
    quiesce::quiesce(&parts)?;
    let mut members = vec![me.clone()];
    members.extend(sibs);
    let c = Cut {
        id: new_id(),
        released: BTreeSet::from([me.server.id.clone()]),
        done: BTreeMap::new(),
        quiesced_in: t.elapsed(),
        deadline: None,
        members,
    };
    info!(id = %me.server.id, cut = %c.id, containers = ?c.record().containers, "NCCL ranks of the pod quiesced as one cut");
    let record = c.record();
    *guard = Some(c);
    Ok((Some(record), t.elapsed()))
}

/// Container `me`'s checkpoint failed before its ranks were released: the cut is over, every
/// rank of it gets Go.
pub fn abandon(me: &ContainerComms) {
    let mut guard = cut();
    if guard.as_ref().is_some_and(|c| c.has(&me.server.id)) {
        if let Some(c) = guard.take() {
            for m in &c.members {
                steps::go(&m.server, &m.server.shared.open_sessions());
            }
        }
    }
}

/// After container `me`'s checkpoint, its sessions `back` again: kept for the cut's end when
/// `me` is of the cut under way (true), or nothing to do with a cut (false).
pub fn resume(me: &ContainerComms, back: Vec<(u64, NcclProcess)>) -> Result<bool, Error> {
    let mut guard = cut();
    let Some(c) = guard.as_mut().filter(|c| c.has(&me.server.id)) else {
        return Ok(false);
    };
    c.done.insert(me.server.id.clone(), back);
    if c.members.iter().all(|m| c.done.contains_key(&m.server.id)) {
        let c = guard.take().expect("the cut is there");
        drop(guard);
        return finish(c, "resume").map(|()| true);
    }
    if c.deadline.is_none() {
        let deadline = Instant::now() + me.server.timeout;
        c.deadline = Some(deadline);
        let id = c.id.clone();
        let _ = std::thread::Builder::new()
            .name("nccl-cut".into())
            .spawn(move || {
                std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
                let mut guard = cut();
                if guard.as_ref().is_some_and(|c| c.id == id) {
                    let c = guard.take().expect("the cut is there");
                    drop(guard);
                    warn!(cut = %id, "not every container of the NCCL cut was checkpointed within NcclTimeout: the cut ends");
                    if let Err(e) = finish(c, "checkpoint") {
                        error!(cut = %id, error = %e, "the end of the NCCL cut");
                    }
                }
            });
    }
    info!(id = %me.server.id, "NCCL ranks wait for the other containers of the pod's cut");
    Ok(true)
}

/// The end of a cut: Resume (all released ranks suspended) or a rebuild of every rank of the
/// cut, then Go to all.
fn finish(c: Cut, operation: &'static str) -> Result<(), Error> {
    let parts: Vec<(&super::server::Server, Vec<u64>)> = c
        .members
        .iter()
        .map(|m| {
            let ids = match c.done.get(&m.server.id) {
                Some(back) => back.iter().map(|(id, _)| *id).collect(),
                None => m.server.shared.open_sessions(),
            };
            (&*m.server, ids)
        })
        .collect();
    let suspended = c.done.values().flatten().all(|(_, p)| p.suspended);
    let result = if suspended {
        let back: BTreeSet<(usize, u64)> = c
            .members
            .iter()
            .enumerate()
            .flat_map(|(p, m)| {
                c.done
                    .get(&m.server.id)
                    .into_iter()
                    .flatten()
                    .map(move |(id, _)| (p, *id))
            })
            .collect();
        let resumed: Vec<(&super::server::Server, Vec<u64>)> = parts
            .iter()
            .enumerate()
            .map(|(p, (s, ids))| {
                (
                    *s,
                    ids.iter()
                        .copied()
                        .filter(|id| back.contains(&(p, *id)))
                        .collect(),
                )
            })
            .collect();
        let t = c.members[0].server.timeout;
        let failures: Vec<String> = ask_all(
            &resumed,
            &|_, _| ShimMsg::Resume,
            Instant::now() + t + ANSWER_GRACE,
        )
        .into_iter()
        .filter(|(_, _, a)| !matches!(a, Ok(LayerMsg::Rebuilt)))
        .map(|(p, id, a)| {
            let (who, why) = failure(resumed[p].0, id, a);
            format!("{who} did not resume its communicators: {why}")
        })
        .collect();
        match first_of(failures) {
            Some(m) => Err(step_error(operation, "nccl-resume", m)),
            None => Ok(()),
        }
    } else {
        super::rebuild::rebuild(&parts, operation)
    };
    for (s, ids) in &parts {
        steps::go(s, ids);
    }
    info!(cut = %c.id, "the pod's NCCL cut is over: every rank goes on");
    result
}

/// A cut being restored: its containers as each is restored.
struct Restoring {
    names: BTreeSet<String>,
    keys: BTreeSet<String>,
    members: Vec<Arc<ContainerComms>>,
    deadline: Instant,
}

static RESTORING: Mutex<BTreeMap<String, Restoring>> = Mutex::new(BTreeMap::new());

fn restoring() -> MutexGuard<'static, BTreeMap<String, Restoring>> {
    RESTORING.lock().unwrap_or_else(|e| e.into_inner())
}

/// The root keys of a record's processes.
fn record_keys(processes: &[NcclProcess]) -> BTreeSet<String> {
    processes
        .iter()
        .flat_map(|p| &p.comms)
        .map(|c| c.key.split('/').next().unwrap_or_default().to_string())
        .collect()
}

/// Refuses a checkpoint of cut `cut` whose communicators are those of a cut of another id
/// being restored in this pod: their ranks would never meet.
pub fn check_restore(cut: Option<&NcclCut>, processes: &[NcclProcess]) -> Result<(), Error> {
    let keys = record_keys(processes);
    let id = cut.map(|c| c.id.as_str()).unwrap_or("");
    for (other, r) in restoring().iter() {
        if other != id && !r.keys.is_disjoint(&keys) {
            return Err(step_error(
                "restore",
                "nccl-cut",
                format!(
                    "this checkpoint is of NCCL cut {}, and the pod's containers restored before it are of cut {other} with the same communicators: restore every container of the pod from checkpoints of one cut",
                    if id.is_empty() { "(none)" } else { id }
                ),
            ));
        }
    }
    Ok(())
}

/// Whether the restore of `me` (its expected processes `processes`, of cut `cut`) waits for
/// other containers of the cut: then it is registered, the rebuild runs once all are back
/// (after this Start returns), and true.
pub fn restored(me: &Arc<ContainerComms>, cut: Option<&NcclCut>) -> bool {
    let Some(cut) = cut.filter(|c| c.containers.len() > 1) else {
        return false;
    };
    let mut all = restoring();
    let first = !all.contains_key(&cut.id);
    let r = all.entry(cut.id.clone()).or_insert_with(|| Restoring {
        names: cut.containers.iter().cloned().collect(),
        keys: BTreeSet::new(),
        members: Vec::new(),
        deadline: Instant::now() + me.server.timeout,
    });
    let held = me.server.shared.lock().held_records();
    r.keys.extend(record_keys(&held));
    r.members.push(me.clone());
    info!(id = %me.server.id, cut = %cut.id, "restored: NCCL ranks wait for the other containers of the cut");
    if first {
        let id = cut.id.clone();
        let _ = std::thread::Builder::new()
            .name("nccl-restore-cut".into())
            .spawn(move || rebuild_restored(&id));
    }
    true
}

/// Waits for every container of restored cut `id`, then for every recorded rank, rebuilds
/// them all on fresh ids and lets them go; on failure kills the restored containers.
fn rebuild_restored(id: &str) {
    let t0 = Instant::now();
    let (members, deadline) = loop {
        let all = restoring();
        let Some(r) = all.get(id) else { return };
        let here: BTreeSet<&str> = r.members.iter().map(|m| m.name.as_str()).collect();
        if r.names.iter().all(|n| here.contains(n.as_str())) {
            break (r.members.clone(), r.deadline);
        }
        if Instant::now() >= r.deadline {
            let missing: Vec<String> = r
                .names
                .iter()
                .filter(|n| !here.contains(n.as_str()))
                .cloned()
                .collect();
            let members = r.members.clone();
            drop(all);
            fail_restore(
                id,
                &members,
                format!(
                    "the containers {missing:?} of the cut were not restored within NcclTimeout"
                ),
            );
            return;
        }
        drop(all);
        std::thread::sleep(Duration::from_millis(50));
    };
    let timeout = members[0].server.timeout;
    let mut parts = Vec::new();
    for m in &members {
        match steps::reconnect_until(&m.server, deadline, timeout, "restore", "nccl-rebuild") {
            Ok(back) => parts.push((&*m.server, back.into_iter().map(|(id, _)| id).collect())),
            Err(e) => {
                fail_restore(id, &members, e.to_string());
                return;
            }
        }
    }
    match super::rebuild::rebuild(&parts, "restore") {
        Ok(()) => {
            for (s, ids) in &parts {
                steps::go(s, ids);
            }
            for m in &members {
                m.last().timings = vec![("nccl-rebuild", t0.elapsed())];
            }
            info!(cut = %id, ms = t0.elapsed().as_millis() as u64, "the pod's NCCL cut restored: every rank goes on");
            restoring().remove(id);
        }
        Err(e) => fail_restore(id, &members, e.to_string()),
    }
}

/// Kills every restored container of cut `id`: nothing of it half-running.
fn fail_restore(id: &str, members: &[Arc<ContainerComms>], why: String) {
    error!(cut = %id, "the restore of the pod's NCCL cut failed, its restored containers are killed: {why}");
    for m in members {
        let _ = m.server.shared.lock().kill_init();
    }
    restoring().remove(id);
}
