//! The steps on a container's sessions, each bounded by `NcclTimeout`: quiesce, release and
//! disconnect before the device steps; the wait for the released processes to connect again,
//! then resume (every communicator suspended, nothing moved) or rebuild on fresh unique ids,
//! then Go, after them.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use image_format::manifest::NcclProcess;
use nccl_control::{LayerMsg, ShimMsg};
use tracing::{info_span, warn};

use super::server::Server;
use super::session::{describe, Held, SEND_TIMEOUT};
use crate::error::Error;

/// Beyond the layer's own deadline, for its answer to arrive.
pub(super) const ANSWER_GRACE: Duration = Duration::from_secs(2);

pub(super) fn step_error(operation: &'static str, step: &'static str, message: String) -> Error {
    Error::Step {
        operation,
        step,
        message,
    }
}

pub(super) fn within(t: Duration) -> String {
    humantime::format_duration(t).to_string()
}

/// The first failure, and how many more there were.
pub(super) fn first_of(mut failures: Vec<String>) -> Option<String> {
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

/// Text a process sent, for an error or a log: at most 256 bytes, escaped.
pub(super) fn shown(text: &str) -> String {
    const MAX: usize = 256;
    let mut end = text.len().min(MAX);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut s: String = text[..end].escape_debug().collect();
    if end < text.len() {
        s.push_str(&format!("... ({} bytes)", text.len()));
    }
    s
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
pub(super) fn failure(
    server: &Server,
    id: u64,
    answer: Result<LayerMsg, String>,
) -> (String, String) {
    match answer {
        Ok(LayerMsg::Failed {
            comm,
            rank,
            message,
        }) => (who(server, id, comm.zip(rank)), shown(&message)),
        Ok(other) => (
            who(server, id, None),
            format!("answered {}", shown(&format!("{other:?}"))),
        ),
        Err(why) => (who(server, id, None), why),
    }
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
    let mut writers = Vec::new();
    for (id, suspended) in released {
        if let Some(s) = st.sessions.remove(id) {
            let record = s.record(*suspended);
            writers.extend(s.writer_clone().ok());
            st.held.push(Held {
                host_pid: s.host_pid,
                record,
            });
        }
    }
    drop(st);
    server.shared.notify();
    // Outside the lock: a process that does not read holds no one else up.
    for mut w in writers {
        if server.shared.lock().closed {
            w.shutdown();
            continue;
        }
        let _ = w.send(&ShimMsg::Disconnect, Some(SEND_TIMEOUT));
        w.shutdown();
    }
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
    reconnect_until(
        server,
        Instant::now() + server.timeout,
        server.timeout,
        operation,
        step,
    )
}

/// [`reconnect`] until `deadline` (`t` after the wait began, for the message).
pub fn reconnect_until(
    server: &Server,
    deadline: Instant,
    t: Duration,
    operation: &'static str,
    step: &'static str,
) -> Result<Vec<(u64, NcclProcess)>, Error> {
    let st = server.shared.lock();
    let (mut st, all) = server.shared.wait_until(st, deadline, |st| {
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

/// nccl-rebuild of the sessions `ids` of one container ([`super::rebuild::rebuild`]).
pub fn rebuild(server: &Server, ids: &[u64], operation: &'static str) -> Result<(), Error> {
    super::rebuild::rebuild(&[(server, ids.to_vec())], operation)
}
