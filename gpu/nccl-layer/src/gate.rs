//! The gate every wrapped call passes: held while the shim holds the process, calls in flight
//! counted, streams used since the last quiesce remembered, collectives counted per
//! communicator (so that a quiesce lets a rank that is behind catch up with its peers: see
//! [`Gate::set_targets`]).

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

thread_local! {
    /// How deep the calling thread is in ncclGroupStart/ncclGroupEnd.
    static GROUP_DEPTH: Cell<u32> = const { Cell::new(0) };
    /// The in-flight slot of the calling thread's open group.
    static GROUP_SLOT: Cell<Option<u64>> = const { Cell::new(None) };
    /// The tag of the calling thread's open group, for communicators made inside it.
    static GROUP_TAG: Cell<Option<u64>> = const { Cell::new(None) };
}

/// A call in the layer: its NCCL name and the communicator (id, rank) it works on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flight {
    pub call: &'static str,
    pub comm: Option<(u64, i32)>,
}

/// What a call is to the quiesce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A collective on its communicator (every rank calls them in the same order): counted.
    Collective,
    /// An outermost ncclGroupStart: the calls of the group pass with it.
    Group,
    /// A question about a communicator that enqueues nothing (ncclCommCount, ...): passes while
    /// a rank catches up with its peers.
    Query,
    /// Anything else.
    Other,
}

/// Why the calls did not reach their targets in time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stuck {
    /// A call stayed in the layer.
    Call(Flight),
    /// Communicator `comm` had `issued` collectives of the `target`.
    Short { comm: u64, issued: u64, target: u64 },
}

/// A stream a call enqueued work on: the communicator (id, rank) and its device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamUse {
    pub stream: usize,
    pub comm: u64,
    pub rank: i32,
    pub dev: i32,
}

#[derive(Default)]
struct State {
    held: bool,
    next_seq: u64,
    next_tag: u64,
    in_flight: BTreeMap<u64, Flight>,
    /// By (stream, communicator id).
    streams: BTreeMap<(usize, u64), StreamUse>,
    /// Collectives issued, by communicator id.
    issued: BTreeMap<u64, u64>,
    /// While held: how many collectives each communicator may reach (see [`Gate::set_targets`]).
    targets: Option<BTreeMap<u64, u64>>,
}

impl State {
    fn issued(&self, comm: u64) -> u64 {
        self.issued.get(&comm).copied().unwrap_or(0)
    }

    /// Whether a held call of `kind` on `comm` may pass: a collective on a communicator below
    /// its target, a group while some communicator is.
    fn admits(&self, comm: Option<(u64, i32)>, kind: Kind) -> bool {
        let Some(t) = &self.targets else {
            return false;
        };
        match kind {
            Kind::Collective => {
                comm.is_some_and(|(id, _)| self.issued(id) < t.get(&id).copied().unwrap_or(0))
            }
            Kind::Group => t.iter().any(|(id, n)| self.issued(*id) < *n),
            Kind::Query => true,
            Kind::Other => false,
        }
    }

    fn count(&mut self, comm: Option<(u64, i32)>, kind: Kind) {
        if let (Kind::Collective, Some((id, _))) = (kind, comm) {
            *self.issued.entry(id).or_default() += 1;
        }
    }
}

#[derive(Default)]
pub struct Gate {
    state: Mutex<State>,
    cv: Condvar,
}

/// A call's place in the gate; dropping it ends the call.
pub struct Ticket<'a> {
    gate: &'a Gate,
    seq: Option<u64>,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if let Some(seq) = self.seq {
            self.gate.lock().in_flight.remove(&seq);
            self.gate.cv.notify_all();
        }
    }
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data; go on with it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Enters a call: waits while the gate is held (unless the thread is inside a group, whose
    /// ncclGroupStart already entered, or the hold admits it), then counts the call in flight
    /// until the ticket drops.
    pub fn enter(&self, call: &'static str, comm: Option<(u64, i32)>, kind: Kind) -> Ticket<'_> {
        let mut g = self.lock();
        if GROUP_DEPTH.get() > 0 {
            g.count(comm, kind);
            if let Some(slot) = GROUP_SLOT.get() {
                if let Some(f) = g.in_flight.get_mut(&slot) {
                    if f.comm.is_none() {
                        f.comm = comm;
                    }
                }
            }
            return Ticket {
                gate: self,
                seq: None,
            };
        }
        while g.held && !g.admits(comm, kind) {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        g.count(comm, kind);
        let seq = g.next_seq;
        g.next_seq += 1;
        g.in_flight.insert(seq, Flight { call, comm });
        Ticket {
            gate: self,
            seq: Some(seq),
        }
    }

    /// ncclGroupStart: the outermost one enters the gate and stays in flight until its
    /// ncclGroupEnd. Returns the group's tag.
    pub fn group_start(&self) -> u64 {
        let depth = GROUP_DEPTH.get();
        if depth == 0 {
            let mut t = self.enter("ncclGroupStart", None, Kind::Group);
            GROUP_SLOT.set(t.seq.take());
            GROUP_TAG.set(Some(self.new_tag()));
        }
        GROUP_DEPTH.set(depth + 1);
        GROUP_TAG.get().unwrap_or(0)
    }

    /// ncclGroupEnd (or a failed ncclGroupStart): the outermost one leaves the gate.
    pub fn group_end(&self) {
        let depth = GROUP_DEPTH.get();
        if depth == 0 {
            return;
        }
        GROUP_DEPTH.set(depth - 1);
        if depth == 1 {
            GROUP_TAG.set(None);
            if let Some(seq) = GROUP_SLOT.take() {
                drop(Ticket {
                    gate: self,
                    seq: Some(seq),
                });
            }
        }
    }

    /// A fresh group tag (for communicators NCCL makes in a group of its own).
    pub fn new_tag(&self) -> u64 {
        let mut g = self.lock();
        g.next_tag += 1;
        g.next_tag
    }

    /// The tag of the calling thread's open group, if any.
    pub fn group_tag(&self) -> Option<u64> {
        GROUP_TAG.get()
    }

    pub fn record_stream(&self, u: StreamUse) {
        self.lock().streams.insert((u.stream, u.comm), u);
    }

    /// Forgets the streams and the count of a communicator that is gone.
    pub fn forget_comm(&self, comm: u64) {
        let mut g = self.lock();
        g.streams.retain(|k, _| k.1 != comm);
        g.issued.remove(&comm);
    }

    /// The collectives issued on communicator `comm`.
    pub fn issued(&self, comm: u64) -> u64 {
        self.lock().issued(comm)
    }

    /// While held: lets collectives on each communicator pass until `targets` of them were
    /// issued (the most any rank of it issued), so that every rank stops after the same one
    /// (`None`: hold everything again).
    pub fn set_targets(&self, targets: Option<BTreeMap<u64, u64>>) {
        self.lock().targets = targets;
        self.cv.notify_all();
    }

    /// Waits until every target is reached and no call is in flight, or until `deadline`.
    pub fn reach(&self, deadline: Instant) -> Result<(), Stuck> {
        let mut g = self.lock();
        loop {
            let short = g.targets.as_ref().and_then(|t| {
                t.iter()
                    .find(|(id, n)| g.issued(**id) < **n)
                    .map(|(id, n)| (*id, *n))
            });
            let first = g.in_flight.values().next().cloned();
            if short.is_none() && first.is_none() {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                if let Some((comm, target)) = short {
                    return Err(Stuck::Short {
                        comm,
                        issued: g.issued(comm),
                        target,
                    });
                }
                let named = g.in_flight.values().find(|f| f.comm.is_some()).cloned();
                return Err(Stuck::Call(named.or(first).expect("a call in flight")));
            }
            g = self
                .cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    pub fn is_held(&self) -> bool {
        self.lock().held
    }

    /// Holds new calls.
    pub fn hold(&self) {
        self.lock().held = true;
    }

    /// Lets the held calls go.
    pub fn release(&self) {
        let mut g = self.lock();
        g.held = false;
        g.targets = None;
        drop(g);
        self.cv.notify_all();
    }

    /// Waits until no call is in flight, or until `deadline`: then the first call still in
    /// flight.
    pub fn drain(&self, deadline: Instant) -> Result<(), Flight> {
        let mut g = self.lock();
        loop {
            let Some(first) = g.in_flight.values().next() else {
                return Ok(());
            };
            let now = Instant::now();
            if now >= deadline {
                // The call that names a communicator says more than a group start.
                let named = g.in_flight.values().find(|f| f.comm.is_some());
                return Err(named.unwrap_or(first).clone());
            }
            g = self
                .cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The streams used since the last [`Gate::clear_streams`].
    pub fn streams(&self) -> Vec<StreamUse> {
        self.lock().streams.values().copied().collect()
    }

    pub fn clear_streams(&self) {
        self.lock().streams.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn held_calls_wait_and_drain_names_the_call_in_flight() {
        let gate = Arc::new(Gate::default());
        let t = gate.enter("ncclAllReduce", Some((3, 1)), Kind::Collective);
        gate.hold();
        let err = gate
            .drain(Instant::now() + Duration::from_millis(30))
            .unwrap_err();
        assert_eq!(
            err,
            Flight {
                call: "ncclAllReduce",
                comm: Some((3, 1))
            }
        );
        // A new call waits while held.
        let passed = Arc::new(AtomicBool::new(false));
        let h = {
            let (gate, passed) = (gate.clone(), passed.clone());
            std::thread::spawn(move || {
                let _t = gate.enter("ncclBroadcast", None, Kind::Other);
                passed.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!passed.load(Ordering::SeqCst), "a held call went through");
        drop(t);
        gate.drain(Instant::now() + Duration::from_secs(5)).unwrap();
        gate.release();
        h.join().unwrap();
        assert!(passed.load(Ordering::SeqCst));
    }

    #[test]
    fn a_group_is_one_call_in_flight_and_its_calls_pass_while_held() {
        let gate = Gate::default();
        let tag = gate.group_start();
        assert_eq!(gate.group_tag(), Some(tag));
        gate.group_start();
        gate.hold();
        // Inside the group: passes although held, and names its communicator for the group.
        drop(gate.enter("ncclSend", Some((7, 0)), Kind::Other));
        let err = gate.drain(Instant::now()).unwrap_err();
        assert_eq!(
            err,
            Flight {
                call: "ncclGroupStart",
                comm: Some((7, 0))
            }
        );
        gate.group_end();
        assert!(gate.drain(Instant::now()).is_err(), "inner end left");
        gate.group_end();
        assert_eq!(gate.group_tag(), None);
        gate.drain(Instant::now()).unwrap();
        // Unbalanced ends do nothing.
        gate.group_end();
        gate.release();
    }

    #[test]
    fn streams_are_remembered_per_communicator() {
        let gate = Gate::default();
        let u = |stream, comm| StreamUse {
            stream,
            comm,
            rank: 0,
            dev: 0,
        };
        gate.record_stream(u(1, 1));
        gate.record_stream(u(1, 1));
        gate.record_stream(u(1, 2));
        gate.record_stream(u(0, 2));
        assert_eq!(gate.streams().len(), 3);
        gate.forget_comm(2);
        assert_eq!(gate.streams(), vec![u(1, 1)]);
        gate.clear_streams();
        assert!(gate.streams().is_empty());
    }
}
