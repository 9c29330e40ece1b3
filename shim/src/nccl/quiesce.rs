//! nccl-quiesce, in two rounds to every session at once, across every container of a cut
//! (their servers asked in parallel), both rounds within `NcclTimeout`:
//!
//! 1. Quiesce: each layer holds new calls, waits for those in flight, and answers how many
//!    collectives it has issued on each of its communicators (`Holding`);
//! 2. Drain: the target of each communicator key is the most any of its ranks issued (a rank
//!    held before its k-th collective while a peer already issued it would wait forever on
//!    that peer's stream); each layer lets its held collectives pass up to the targets, waits
//!    for its streams, and answers `Quiesced`.
//!
//! On failure, Go to all (the layers that failed let their held calls go themselves):
//! everything runs on as before.

use std::collections::BTreeMap;
use std::time::Instant;

use nccl_control::{LayerMsg, ShimMsg};
use tracing::info_span;

use super::server::Server;
use super::steps::{failure, first_of, go, step_error, within, ANSWER_GRACE};
use crate::error::Error;

/// The sessions `ids` of each server (a container of the cut).
pub type Parts<'a> = [(&'a Server, Vec<u64>)];

/// One answer: the part, the session, the reply.
type Answer = (usize, u64, Result<LayerMsg, String>);

/// Asks every part at once (a thread per part), `msg` for each (part, session).
pub(super) fn ask_all(
    parts: &Parts<'_>,
    msg: &(dyn Fn(usize, u64) -> ShimMsg + Sync),
    deadline: Instant,
) -> Vec<Answer> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = parts
            .iter()
            .enumerate()
            .map(|(p, (server, ids))| {
                scope.spawn(move || {
                    server
                        .shared
                        .ask(ids, |id| msg(p, id), deadline)
                        .into_iter()
                        .map(|(id, a)| (p, id, a))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    })
}

fn go_all(parts: &Parts<'_>) {
    for (server, ids) in parts {
        go(server, ids);
    }
}

/// Quiesces every session of `parts` (see the module's documentation).
pub fn quiesce(parts: &Parts<'_>) -> Result<(), Error> {
    let (first, _) = match parts.first() {
        Some(p) => p,
        None => return Ok(()),
    };
    let n: usize = parts.iter().map(|(_, ids)| ids.len()).sum();
    let _span = info_span!("nccl_quiesce", id = %first.id, containers = parts.len(), processes = n)
        .entered();
    let t = first.timeout;
    let until = Instant::now() + t;
    let left_ms = || until.saturating_duration_since(Instant::now()).as_millis() as u64;
    let fail = |p: usize, id: u64, a| {
        let (who, why) = failure(parts[p].0, id, a);
        // A Kill ends the wait before its bound: say so rather than the bound.
        if parts[p].0.shared.lock().closed {
            format!("{who} was not quiesced: {why}")
        } else {
            format!("{who} did not quiesce within {}: {why}", within(t))
        }
    };
    check_keys(parts).map_err(|m| step_error("checkpoint", "nccl-quiesce", m))?;
    let deadline_ms = left_ms();
    let answers = ask_all(
        parts,
        &|_, _| ShimMsg::Quiesce { deadline_ms },
        until + ANSWER_GRACE,
    );
    let mut issued: BTreeMap<(usize, u64), Vec<(u64, u64)>> = BTreeMap::new();
    let mut failures = Vec::new();
    for (p, id, a) in answers {
        match a {
            Ok(LayerMsg::Holding { issued: i }) => {
                issued.insert((p, id), i);
            }
            a => failures.push(fail(p, id, a)),
        }
    }
    if let Some(m) = first_of(failures) {
        go_all(parts);
        return Err(step_error("checkpoint", "nccl-quiesce", m));
    }
    let (targets, most) = drain_targets(parts, &issued);
    let deadline_ms = left_ms();
    let answers = ask_all(
        parts,
        &|p, id| ShimMsg::Drain {
            targets: targets.get(&(p, id)).cloned().unwrap_or_default(),
            deadline_ms,
        },
        until + ANSWER_GRACE,
    );
    let failures: Vec<String> = answers
        .into_iter()
        .filter(|(_, _, a)| !matches!(a, Ok(LayerMsg::Quiesced { .. })))
        .map(|(p, id, a)| {
            let m = fail(p, id, a);
            match set_by_another(parts, &issued, &targets, &most, (p, id)) {
                Some(by) => format!("{m} ({by})"),
                None => m,
            }
        })
        .collect();
    match first_of(failures) {
        None => Ok(()),
        Some(m) => {
            go_all(parts);
            Err(step_error("checkpoint", "nccl-quiesce", m))
        }
    }
}

type Targets = BTreeMap<(usize, u64), Vec<(u64, u64)>>;
/// Per key, the most issued and the (part, session) that said so.
type Most = BTreeMap<String, (u64, (usize, u64))>;

/// Who session `of` is.
fn who(parts: &Parts<'_>, of: (usize, u64)) -> String {
    failure(parts[of.0].0, of.1, Err(String::new())).0
}

/// Where session `of`'s drain target of a communicator is above its own count and another
/// session reported that count: which, so that a count no rank can reach names its source.
fn set_by_another(
    parts: &Parts<'_>,
    issued: &BTreeMap<(usize, u64), Vec<(u64, u64)>>,
    targets: &Targets,
    most: &Most,
    of: (usize, u64),
) -> Option<String> {
    let mine = issued.get(&of)?;
    let st = parts[of.0].0.shared.lock();
    let comms: Vec<(u64, String)> = st
        .sessions
        .get(&of.1)?
        .comms
        .values()
        .map(|c| (c.id, c.key.clone()))
        .collect();
    drop(st);
    for (comm, target) in targets.get(&of)? {
        let own = mine.iter().find(|(c, _)| c == comm).map(|(_, n)| *n);
        let Some((_, key)) = comms.iter().find(|(c, _)| c == comm) else {
            continue;
        };
        match (own, most.get(key)) {
            (Some(n), Some((m, by))) if *target > n && *m == *target && *by != of => {
                return Some(format!(
                    "its drain target {target} on key {} was reported by {}",
                    super::steps::shown(key),
                    who(parts, *by)
                ));
            }
            _ => {}
        }
    }
    None
}

/// Each communicator key of the sessions of `parts` is one communicator's: one number of
/// ranks, each rank in range and claimed by one process only. Else which key and who claim
/// it.
pub(super) fn check_keys(parts: &Parts<'_>) -> Result<(), String> {
    // Per key: its number of ranks and who claimed it; per rank, who claims it.
    type Claims = (i32, (usize, u64), BTreeMap<i32, (usize, u64)>);
    let mut keys: BTreeMap<String, Claims> = BTreeMap::new();
    for (p, (server, ids)) in parts.iter().enumerate() {
        let comms: Vec<(u64, String, i32, i32)> = {
            let st = server.shared.lock();
            ids.iter()
                .filter_map(|id| st.sessions.get(id).map(|s| (id, s)))
                .flat_map(|(id, s)| {
                    s.comms
                        .values()
                        .map(|c| (*id, c.key.clone(), c.rank, c.nranks))
                })
                .collect()
        };
        for (id, key, rank, nranks) in comms {
            let me = (p, id);
            let k = super::steps::shown(&key);
            if nranks < 1 || rank < 0 || rank >= nranks {
                return Err(format!(
                    "{} claims rank {rank} of {nranks} on communicator key {k}, which is no rank",
                    who(parts, me)
                ));
            }
            let e = keys
                .entry(key)
                .or_insert_with(|| (nranks, me, BTreeMap::new()));
            if e.0 != nranks {
                return Err(format!(
                    "{} says communicator key {k} has {nranks} ranks, {} says {}",
                    who(parts, me),
                    who(parts, e.1),
                    e.0
                ));
            }
            match e.2.get(&rank) {
                Some(other) if *other != me => {
                    return Err(format!(
                        "{} and {} both claim rank {rank} of {nranks} on communicator key {k}",
                        who(parts, *other),
                        who(parts, me)
                    ));
                }
                Some(_) => {}
                None => {
                    e.2.insert(rank, me);
                }
            }
        }
    }
    Ok(())
}

/// Each session's drain targets: for each of its communicators, the most collectives any
/// communicator of the same key issued, in any session of any part; and per key, who
/// reported the most.
fn drain_targets(
    parts: &Parts<'_>,
    issued: &BTreeMap<(usize, u64), Vec<(u64, u64)>>,
) -> (Targets, Most) {
    // Each (part, session, comm)'s key.
    let mut keys: BTreeMap<(usize, u64, u64), String> = BTreeMap::new();
    for (p, (server, ids)) in parts.iter().enumerate() {
        let st = server.shared.lock();
        for id in ids {
            if let Some(s) = st.sessions.get(id) {
                for (comm, c) in &s.comms {
                    keys.insert((p, *id, *comm), c.key.clone());
                }
            }
        }
    }
    let mut most: Most = BTreeMap::new();
    for ((p, session), counts) in issued {
        for (comm, n) in counts {
            if let Some(key) = keys.get(&(*p, *session, *comm)) {
                let m = most.entry(key.clone()).or_insert((0, (*p, *session)));
                if *n > m.0 {
                    *m = (*n, (*p, *session));
                }
            }
        }
    }
    let targets = issued
        .iter()
        .map(|((p, session), counts)| {
            let targets = counts
                .iter()
                .map(|(comm, n)| {
                    let target = keys
                        .get(&(*p, *session, *comm))
                        .and_then(|k| most.get(k.as_str()).map(|m| m.0))
                        .unwrap_or(*n);
                    (*comm, target.max(*n))
                })
                .collect();
            ((*p, *session), targets)
        })
        .collect();
    (targets, most)
}
