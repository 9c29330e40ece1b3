//! The steps on a container's sessions, each bounded by `NcclTimeout`: quiesce, release and
//! disconnect before the device steps; the wait for the released processes to connect again,
//! then resume (every communicator suspended, nothing moved) or rebuild on fresh unique ids,
//! then Go, after them.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use image_format::manifest::NcclProcess;
use nccl_control::{LayerMsg, ShimMsg};
use tracing::{info, info_span, warn};

use super::server::Server;
use super::session::{describe, Held};
use crate::error::Error;

/// Beyond the layer's own deadline, for its answer to arrive.
const ANSWER_GRACE: Duration = Duration::from_secs(2);

fn step_error(operation: &'static str, step: &'static str, message: String) -> Error {
    Error::Step {
        operation,
        step,
        message,
    }
}

fn within(t: Duration) -> String {
    humantime::format_duration(t).to_string()
}

/// The first failure, and how many more there were.
fn first_of(mut failures: Vec<String>) -> Option<String> {
    if failures.is_empty() {
        return None;
    }
    let more = failures.len() - 1;
    let mut m = failures.remove(0);
    if more > 0 {
        m.push_str(&format!(" (and {more} more)"));
    }
    Some(m)
}

/// Who session `id` is, with the rank the layer named where it named one.
fn who(server: &Server, id: u64, rank: Option<(u64, i32)>) -> String {
    let st = server.shared.lock();
    match st.sessions.get(&id) {
        Some(s) => describe(s.host_pid, s.ns_pid, s.comms.values(), rank),
        None => format!("session {id}"),
    }
}

/// What a reply other than the one expected says.
fn failure(server: &Server, id: u64, answer: Result<LayerMsg, String>) -> (String, String) {
    match answer {
        Ok(LayerMsg::Failed {
            comm,
            rank,
            message,
        }) => (who(server, id, comm.zip(rank)), message),
        Ok(other) => (who(server, id, None), format!("answered {other:?}")),
        Err(why) => (who(server, id, None), why),
    }
}

/// nccl-quiesce, in two phases to every session at once, both within `NcclTimeout`:
///
/// 1. Quiesce: each layer holds new calls, waits for those in flight, and answers how many
///    collectives it has issued on each of its communicators (`Holding`);
/// 2. Drain: the target of each communicator key is the most any of its ranks issued (a rank
///    held before its k-th collective while a peer already issued it would wait forever on
///    that peer's stream); each layer lets its held collectives pass up to the targets, waits
///    for its streams, and answers `Quiesced`.
///
/// On failure, Go to all (the layers that failed let their held calls go themselves):
/// everything runs on as before.
pub fn quiesce(server: &Server, ids: &[u64]) -> Result<(), Error> {
    let _span = info_span!("nccl_quiesce", id = %server.id, processes = ids.len()).entered();
    let t = server.timeout;
    let until = Instant::now() + t;
    let left_ms = || until.saturating_duration_since(Instant::now()).as_millis() as u64;
    let deadline_ms = left_ms();
    let answers = server.shared.ask(
        ids,
        |_| ShimMsg::Quiesce { deadline_ms },
        until + ANSWER_GRACE,
    );
    let mut issued: BTreeMap<u64, Vec<(u64, u64)>> = BTreeMap::new();
    let mut failures = Vec::new();
    for (id, a) in answers {
        match a {
            Ok(LayerMsg::Holding { issued: i }) => {
                issued.insert(id, i);
            }
            a => {
                let (who, why) = failure(server, id, a);
                failures.push(format!("{who} did not quiesce within {}: {why}", within(t)));
            }
        }
    }
    if let Some(m) = first_of(failures) {
        go(server, ids);
        return Err(step_error("checkpoint", "nccl-quiesce", m));
    }
    let targets = drain_targets(server, &issued);
    let deadline_ms = left_ms();
    let answers = server.shared.ask(
        ids,
        |id| ShimMsg::Drain {
            targets: targets.get(&id).cloned().unwrap_or_default(),
            deadline_ms,
        },
        until + ANSWER_GRACE,
    );
    let failures: Vec<String> = answers
        .into_iter()
        .filter(|(_, a)| !matches!(a, Ok(LayerMsg::Quiesced { .. })))
        .map(|(id, a)| {
            let (who, why) = failure(server, id, a);
            format!("{who} did not quiesce within {}: {why}", within(t))
        })
        .collect();
    match first_of(failures) {
        None => Ok(()),
        Some(m) => {
            go(server, ids);
            Err(step_error("checkpoint", "nccl-quiesce", m))
        }
    }
}

/// Each session's drain targets: for each of its communicators, the most collectives any
/// communicator of the same key issued, in any session.
fn drain_targets(
    server: &Server,
    issued: &BTreeMap<u64, Vec<(u64, u64)>>,
) -> BTreeMap<u64, Vec<(u64, u64)>> {
    let st = server.shared.lock();
    let key_of = |session: u64, comm: u64| {
        st.sessions
            .get(&session)
            .and_then(|s| s.comms.get(&comm))
            .map(|c| c.key.clone())
    };
    let mut most: BTreeMap<String, u64> = BTreeMap::new();
    for (session, counts) in issued {
        for (comm, n) in counts {
            if let Some(key) = key_of(*session, *comm) {
                let m = most.entry(key).or_default();
                *m = (*m).max(*n);
            }
        }
    }
    issued
        .iter()
        .map(|(session, counts)| {
            let targets = counts
                .iter()
                .map(|(comm, n)| {
                    let target = key_of(*session, *comm)
                        .and_then(|k| most.get(&k).copied())
                        .unwrap_or(*n);
                    (*comm, target.max(*n))
                })
                .collect();
            (*session, targets)
        })
        .collect()
}

/// nccl-release: Release to every session at once; whether each suspended every communicator
/// (rather than destroyed them). On failure, every session brought back (resume or rebuild)
/// and Go.
pub fn release(server: &Server, ids: &[u64]) -> Result<BTreeMap<u64, bool>, Error> {
    let _span = info_span!("nccl_release", id = %server.id, processes = ids.len()).entered();
    let answers = server.shared.ask(
        ids,
        |_| ShimMsg::Release,
        Instant::now() + server.timeout + ANSWER_GRACE,
    );
    let mut suspended = BTreeMap::new();
    let mut failures = Vec::new();
    for (id, a) in answers {
        match a {
            Ok(LayerMsg::Released { suspended: s }) => {
                suspended.insert(id, s);
            }
            a => {
                let (who, why) = failure(server, id, a);
                failures.push(format!("{who} did not release its communicators: {why}"));
            }
        }
    }
    match first_of(failures) {
        None => Ok(suspended),
        Some(m) => {
            // Some released, some not: a rebuild on fresh ids brings every one back alike.
            let undo = rebuild(server, ids, "checkpoint").map(|()| go(server, ids));
            Err(step_error(
                "checkpoint",
                "nccl-release",
                match undo {
                    Ok(()) => m,
                    Err(e) => format!("{m}; and its undo failed: {e}"),
                },
            ))
        }
    }
}

/// Disconnect to every released session, whose record is kept for its return; the sessions
/// end.
pub fn disconnect(server: &Server, released: &BTreeMap<u64, bool>) {
    let mut st = server.shared.lock();
    for (id, suspended) in released {
        if let Some(mut s) = st.sessions.remove(id) {
            let record = s.record(*suspended);
            let _ = s.send(&ShimMsg::Disconnect);
            s.shut("disconnected for the checkpoint");
            st.held.push(Held {
                host_pid: s.host_pid,
                record,
            });
        }
    }
    drop(st);
    server.shared.notify();
}

/// Go to every session of `ids` (no reply); failures are logged: a layer that lost its
/// connection lets its calls go when it connects again and is told.
pub fn go(server: &Server, ids: &[u64]) {
    for (id, why) in server.shared.tell(ids, &ShimMsg::Go) {
        warn!(id = %server.id, session = id, "Go not sent: {why}");
    }
}

/// Waits (bounded) for every held process to connect again with its token: the session of
/// each, in the order they were held. On success nothing is held any more.
pub fn reconnect(
    server: &Server,
    operation: &'static str,
    step: &'static str,
) -> Result<Vec<(u64, NcclProcess)>, Error> {
    let t = server.timeout;
    let st = server.shared.lock();
    let (mut st, all) = server.shared.wait_until(st, Instant::now() + t, |st| {
        st.held.iter().all(|h| session_of(st, h).is_some())
    });
    if !all {
        let missing: Vec<String> = st
            .held
            .iter()
            .filter(|h| session_of(&st, h).is_none())
            .map(|h| {
                format!(
                    "{} did not connect again within {}",
                    h.describe(),
                    within(t)
                )
            })
            .collect();
        return Err(step_error(
            operation,
            step,
            first_of(missing).unwrap_or_default(),
        ));
    }
    let held = std::mem::take(&mut st.held);
    let mut back = Vec::new();
    for h in held {
        let Some(id) = session_of(&st, &h) else {
            continue;
        };
        // Its communicators as recorded: the layer announces them again after Welcome, but
        // the rebuild must not wait on those messages.
        if let Some(s) = st.sessions.get_mut(&id) {
            for c in &h.record.comms {
                s.comms.entry(c.id).or_insert_with(|| c.clone());
            }
        }
        back.push((id, h.record));
    }
    Ok(back)
}

fn session_of(st: &super::session::State, h: &Held) -> Option<u64> {
    st.sessions
        .iter()
        .find(|(_, s)| s.closed.is_none() && s.resumed.as_deref() == Some(&h.record.token))
        .map(|(id, _)| *id)
}

/// After a resume without restore: Resume where every communicator was suspended, else a
/// rebuild on fresh unique ids; then Go.
pub fn bring_back(
    server: &Server,
    back: &[(u64, NcclProcess)],
    operation: &'static str,
) -> Result<(), Error> {
    let ids: Vec<u64> = back.iter().map(|(id, _)| *id).collect();
    if back.iter().all(|(_, p)| p.suspended) {
        let _span = info_span!("nccl_resume", id = %server.id, processes = ids.len()).entered();
        let answers = server.shared.ask(
            &ids,
            |_| ShimMsg::Resume,
            Instant::now() + server.timeout + ANSWER_GRACE,
        );
        let failures: Vec<String> = answers
            .into_iter()
            .filter(|(_, a)| !matches!(a, Ok(LayerMsg::Rebuilt)))
            .map(|(id, a)| {
                let (who, why) = failure(server, id, a);
                format!("{who} did not resume its communicators: {why}")
            })
            .collect();
        if let Some(m) = first_of(failures) {
            return Err(step_error(operation, "nccl-resume", m));
        }
    } else {
        rebuild(server, &ids, operation)?;
    }
    go(server, &ids);
    Ok(())
}

/// nccl-rebuild: NewUniqueId for every root key to the process holding its rank 0 (else the
/// first holding a communicator under it), then Rebuild with every fresh id to all sessions
/// at once, then every Rebuilt awaited (bounded).
pub fn rebuild(server: &Server, ids: &[u64], operation: &'static str) -> Result<(), Error> {
    let _span = info_span!("nccl_rebuild", id = %server.id, processes = ids.len()).entered();
    let fail = |m: String| step_error(operation, "nccl-rebuild", m);
    let roots = root_holders(server, ids);
    let asks: Vec<(u64, ShimMsg)> = roots
        .iter()
        .map(|(key, id)| (*id, ShimMsg::NewUniqueId { key: key.clone() }))
        .collect();
    let answers = server
        .shared
        .ask_many(asks, Instant::now() + server.timeout + ANSWER_GRACE);
    let mut fresh = Vec::new();
    let mut failures = Vec::new();
    for ((key, _), (id, a)) in roots.iter().zip(answers) {
        match a {
            Ok(LayerMsg::UniqueId { key: k, id: uid }) if &k == key => fresh.push((k, uid)),
            a => {
                let (who, why) = failure(server, id, a);
                failures.push(format!("{who} made no unique id for {key}: {why}"));
            }
        }
    }
    if let Some(m) = first_of(failures) {
        return Err(fail(m));
    }
    let answers = server.shared.ask(
        ids,
        |_| ShimMsg::Rebuild { ids: fresh.clone() },
        Instant::now() + server.timeout + ANSWER_GRACE,
    );
    let failures: Vec<String> = answers
        .into_iter()
        .filter(|(_, a)| !matches!(a, Ok(LayerMsg::Rebuilt)))
        .map(|(id, a)| {
            let (who, why) = failure(server, id, a);
            format!(
                "{who} did not rebuild its communicators within {}: {why}",
                within(server.timeout)
            )
        })
        .collect();
    match first_of(failures) {
        Some(m) => Err(fail(m)),
        None => {
            info!(id = %server.id, keys = fresh.len(), "NCCL communicators rebuilt on fresh unique ids");
            Ok(())
        }
    }
}

/// The root keys (a communicator's key up to its first `/`) of the sessions' communicators,
/// each with the session that makes its unique id: the one holding rank 0 of the root
/// communicator, else the first holding any communicator under it.
fn root_holders(server: &Server, ids: &[u64]) -> Vec<(String, u64)> {
    let st = server.shared.lock();
    let mut roots: BTreeMap<String, (u64, bool)> = BTreeMap::new();
    for id in ids {
        let Some(s) = st.sessions.get(id) else {
            continue;
        };
        for c in s.comms.values() {
            let root = c.key.split('/').next().unwrap_or_default().to_string();
            let zero = c.key == root && c.rank == 0;
            match roots.get(&root) {
                Some((_, true)) => {}
                Some((_, false)) if !zero => {}
                _ => {
                    roots.insert(root, (*id, zero));
                }
            }
        }
    }
    roots.into_iter().map(|(k, (id, _))| (k, id)).collect()
}
