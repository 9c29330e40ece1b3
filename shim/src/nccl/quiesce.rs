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
        format!("{who} did not quiesce within {}: {why}", within(t))
    };
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
    let targets = drain_targets(parts, &issued);
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
        .map(|(p, id, a)| fail(p, id, a))
        .collect();
    match first_of(failures) {
        None => Ok(()),
        Some(m) => {
            go_all(parts);
            Err(step_error("checkpoint", "nccl-quiesce", m))
        }
    }
}

/// Each session's drain targets: for each of its communicators, the most collectives any
/// communicator of the same key issued, in any session of any part.
fn drain_targets(
    parts: &Parts<'_>,
    issued: &BTreeMap<(usize, u64), Vec<(u64, u64)>>,
) -> BTreeMap<(usize, u64), Vec<(u64, u64)>> {
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
    let mut most: BTreeMap<&str, u64> = BTreeMap::new();
    for ((p, session), counts) in issued {
        for (comm, n) in counts {
            if let Some(key) = keys.get(&(*p, *session, *comm)) {
                let m = most.entry(key).or_default();
                *m = (*m).max(*n);
            }
        }
    }
    issued
        .iter()
        .map(|((p, session), counts)| {
            let targets = counts
                .iter()
                .map(|(comm, n)| {
                    let target = keys
                        .get(&(*p, *session, *comm))
                        .and_then(|k| most.get(k.as_str()).copied())
                        .unwrap_or(*n);
                    (*comm, target.max(*n))
                })
                .collect();
            ((*p, *session), targets)
        })
        .collect()
}
