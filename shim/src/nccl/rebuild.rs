//! nccl-rebuild across the sessions of one or more containers (a cut): NewUniqueId for every
//! root key to the process holding its rank 0 (else the first holding a communicator under
//! it), then Rebuild with every fresh id to all sessions at once, then every Rebuilt awaited,
//! within `NcclTimeout`. Fresh ids every time: two restores of one checkpoint never share one.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use nccl_control::{LayerMsg, ShimMsg};
use tracing::{info, info_span};

use super::quiesce::{ask_all, check_keys, Parts};
use super::steps::{failure, first_of, shown, step_error, within, ANSWER_GRACE};
use crate::error::Error;

/// Rebuilds every session of `parts`; `operation` names it in errors.
pub fn rebuild(parts: &Parts<'_>, operation: &'static str) -> Result<(), Error> {
    let Some((first, _)) = parts.first() else {
        return Ok(());
    };
    let n: usize = parts.iter().map(|(_, ids)| ids.len()).sum();
    let _span = info_span!("nccl_rebuild", id = %first.id, containers = parts.len(), processes = n)
        .entered();
    let t = first.timeout;
    let fail = |m: String| step_error(operation, "nccl-rebuild", m);
    check_keys(parts).map_err(fail)?;
    let roots = root_holders(parts);
    let mut fresh = Vec::new();
    let mut failures = Vec::new();
    for (p, (server, _)) in parts.iter().enumerate() {
        let mine: Vec<&(String, usize, u64)> = roots.iter().filter(|(_, rp, _)| *rp == p).collect();
        let asks = mine
            .iter()
            .map(|(key, _, id)| (*id, ShimMsg::NewUniqueId { key: key.clone() }))
            .collect();
        let answers = server
            .shared
            .ask_many(asks, Instant::now() + t + ANSWER_GRACE);
        for ((key, _, _), (id, a)) in mine.into_iter().zip(answers) {
            match a {
                Ok(LayerMsg::UniqueId { key: k, id: uid }) if &k == key && unique_id(&uid) => {
                    fresh.push((k, uid))
                }
                a => {
                    let (who, why) = failure(server, id, a);
                    failures.push(format!("{who} made no unique id for {}: {why}", shown(key)));
                }
            }
        }
    }
    if let Some(m) = first_of(failures) {
        return Err(fail(m));
    }
    // Each session gets the ids of the root keys it holds a communicator under, no other.
    let mut held: BTreeMap<(usize, u64), BTreeSet<String>> = BTreeMap::new();
    for (p, (server, ids)) in parts.iter().enumerate() {
        let st = server.shared.lock();
        for id in ids {
            if let Some(s) = st.sessions.get(id) {
                held.insert(
                    (p, *id),
                    s.comms.values().map(|c| root_of(&c.key)).collect(),
                );
            }
        }
    }
    let answers = ask_all(
        parts,
        &|p, id| ShimMsg::Rebuild {
            ids: fresh
                .iter()
                .filter(|(k, _)| held.get(&(p, id)).is_some_and(|h| h.contains(k)))
                .cloned()
                .collect(),
        },
        Instant::now() + t + ANSWER_GRACE,
    );
    let failures: Vec<String> = answers
        .into_iter()
        .filter(|(_, _, a)| !matches!(a, Ok(LayerMsg::Rebuilt)))
        .map(|(p, id, a)| {
            let (who, why) = failure(parts[p].0, id, a);
            format!(
                "{who} did not rebuild its communicators within {}: {why}",
                within(t)
            )
        })
        .collect();
    match first_of(failures) {
        Some(m) => Err(fail(m)),
        None => {
            info!(id = %first.id, keys = fresh.len(), processes = n, "NCCL communicators rebuilt on fresh unique ids");
            Ok(())
        }
    }
}

/// A unique id as NCCL makes one: `NCCL_UNIQUE_ID_BYTES` (128) bytes, in hex.
fn unique_id(id: &str) -> bool {
    id.len() == 256 && id.bytes().all(|b| b.is_ascii_hexdigit())
}

fn root_of(key: &str) -> String {
    key.split('/').next().unwrap_or_default().to_string()
}

/// The root keys (a communicator's key up to its first `/`) of the sessions' communicators,
/// each with the part and session that makes its unique id.
fn root_holders(parts: &Parts<'_>) -> Vec<(String, usize, u64)> {
    let mut roots: BTreeMap<String, (usize, u64, bool)> = BTreeMap::new();
    for (p, (server, ids)) in parts.iter().enumerate() {
        let st = server.shared.lock();
        for id in ids {
            let Some(s) = st.sessions.get(id) else {
                continue;
            };
            for c in s.comms.values() {
                let root = root_of(&c.key);
                let zero = c.key == root && c.rank == 0;
                match roots.get(&root) {
                    Some((_, _, true)) => {}
                    Some((_, _, false)) if !zero => {}
                    _ => {
                        roots.insert(root, (p, *id, zero));
                    }
                }
            }
        }
    }
    roots
        .into_iter()
        .map(|(k, (p, id, _))| (k, p, id))
        .collect()
}
