//! NCCL communicators in the daemon: the rendezvous of ranks by unique id, splits, and the
//! collectives and sends/receives between the ranks' device memory.
//!
//! Ranks are processes, each with its own libcuda connection; a libnccl.so.2 reaches the daemon
//! on short connections of its own, and its device pointers are looked up in the memory of the
//! process it runs in. An operation is contributed when the rank's stream reaches it (the
//! library's host function on that stream makes the `Run` call): its input is read then, and the
//! call returns when every rank has contributed and the results are written, so the stream is
//! complete only then. A rank that never contributes leaves its peers' calls, and so their
//! streams, waiting until their process goes away or a rank aborts the communicator.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use super::{lock, peer_closed, Alloc, Daemon};
use crate::nccl::{
    finish_avg, reduce_into, result, Answer, Call, Kind, Op, RedOp, ID_MAGIC, SPLIT_NOCOLOR,
    UNIQUE_ID_BYTES,
};
use crate::node::format_uuid;
use crate::proto::{Reply, Role};

type Fail = (u32, String);

/// How often a waiting call checks that its caller is still there.
const POLL: Duration = Duration::from_millis(100);

/// The daemon's communicators.
pub(super) struct Comms {
    state: Mutex<State>,
    cv: Condvar,
    /// Random per daemon: ids of two daemons never collide.
    nonce: [u8; 16],
    next_id: AtomicU64,
}

#[derive(Default)]
struct State {
    /// Ranks gathering under a unique id.
    joins: HashMap<Vec<u8>, Join>,
    comms: HashMap<u64, CommRec>,
    /// Splits gathering: (parent, the parent's n-th split).
    splits: HashMap<(u64, u64), SplitJoin>,
    slots: HashMap<SlotKey, Slot>,
    next_comm: u64,
}

/// What a gathering of ranks came to, and how many of them have not read it yet.
struct Outcome<T> {
    result: Option<Result<T, Fail>>,
    unread: usize,
}

impl<T: Clone> Outcome<T> {
    /// The result for one more reader, and whether it was the last.
    fn read(&mut self) -> Option<(Result<T, Fail>, bool)> {
        let r = self.result.clone()?;
        self.unread = self.unread.saturating_sub(1);
        Some((r, self.unread == 0))
    }
}

/// Reads the outcome of gathering `key` in `map` once, removing it after its last reader.
fn read_once<K: std::hash::Hash + Eq, V, T: Clone>(
    map: &mut HashMap<K, V>,
    key: &K,
    outcome: impl Fn(&mut V) -> &mut Outcome<T>,
) -> Option<Result<T, Fail>> {
    let (r, last) = outcome(map.get_mut(key)?).read()?;
    if last {
        map.remove(key);
    }
    Some(r)
}

struct Join {
    nranks: i32,
    members: BTreeMap<i32, [u8; 16]>,
    outcome: Outcome<u64>,
}

struct CommRec {
    /// Each rank's GPU.
    gpus: Vec<[u8; 16]>,
    /// Ranks that have not left.
    live: BTreeSet<i32>,
    /// Why the communicator is aborted.
    aborted: Option<String>,
}

type SplitResult = HashMap<i32, Option<(u64, i32, i32)>>;

struct SplitJoin {
    entries: BTreeMap<i32, (i32, i32)>,
    outcome: Outcome<SplitResult>,
}

#[derive(Hash, PartialEq, Eq, Clone, Copy, Debug)]
enum SlotKey {
    Coll {
        comm: u64,
        seq: u64,
    },
    P2p {
        comm: u64,
        src: i32,
        dst: i32,
        seq: u64,
    },
}

impl SlotKey {
    fn comm(&self) -> u64 {
        match self {
            SlotKey::Coll { comm, .. } | SlotKey::P2p { comm, .. } => *comm,
        }
    }
}

/// One rank's contribution: its input, read when it arrived, and where its output goes.
struct Part {
    op: Op,
    input: Vec<u8>,
    out: Option<(Arc<Alloc>, usize)>,
}

struct Slot {
    need: usize,
    nranks: usize,
    parts: Vec<Part>,
    running: bool,
    done: Option<Result<(), Fail>>,
    unread: usize,
}

fn fail(code: u32, msg: impl Into<String>) -> Fail {
    (code, msg.into())
}

impl Comms {
    pub(super) fn new() -> Comms {
        let mut nonce = [0u8; 16];
        if getrandom::fill(&mut nonce).is_err() {
            // No entropy source: the time still tells two daemons apart.
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default();
            nonce = t.to_le_bytes();
        }
        Comms {
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            nonce,
            next_id: AtomicU64::new(1),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Waits until `check` gives an answer, or the caller on `fd` is gone (None).
    fn wait<T>(&self, fd: RawFd, mut check: impl FnMut(&mut State) -> Option<T>) -> Option<T> {
        let mut st = self.state();
        loop {
            if let Some(v) = check(&mut st) {
                return Some(v);
            }
            st = self
                .cv
                .wait_timeout(st, POLL)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            if peer_closed(fd, Duration::ZERO) {
                return None;
            }
        }
    }

    /// A fresh unique id: the magic, this daemon's nonce, a counter, and random bytes.
    fn unique_id(&self) -> Vec<u8> {
        let mut id = vec![0u8; UNIQUE_ID_BYTES];
        id[..8].copy_from_slice(ID_MAGIC);
        id[8..24].copy_from_slice(&self.nonce);
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        id[24..32].copy_from_slice(&n.to_le_bytes());
        let _ = getrandom::fill(&mut id[32..48]);
        id
    }
}

impl State {
    fn new_comm(&mut self, gpus: Vec<[u8; 16]>) -> u64 {
        self.next_comm += 1;
        let live = (0..gpus.len() as i32).collect();
        self.comms.insert(
            self.next_comm,
            CommRec {
                gpus,
                live,
                aborted: None,
            },
        );
        self.next_comm
    }

    /// The communicator `comm` where `rank` is a live rank of it, not aborted.
    fn member(&self, comm: u64, rank: i32) -> Result<&CommRec, Fail> {
        let c = self.comms.get(&comm).ok_or_else(|| {
            fail(
                result::INVALID_ARGUMENT,
                format!("no communicator {comm} on this node"),
            )
        })?;
        if let Some(why) = &c.aborted {
            return Err(fail(result::REMOTE_ERROR, why.clone()));
        }
        if !c.live.contains(&rank) {
            return Err(fail(
                result::INVALID_USAGE,
                format!("rank {rank} is not a member of communicator {comm}"),
            ));
        }
        Ok(c)
    }
}

impl Daemon {
    pub(super) fn nccl(&self, id: u64, fd: RawFd, call: Call) -> Reply {
        let r = match call {
            Call::UniqueId => Ok(Answer::UniqueId(self.comms.unique_id())),
            Call::Init {
                id: uid,
                nranks,
                rank,
                gpu,
            } => self.comm_init(fd, uid, nranks, rank, gpu),
            Call::Split {
                comm,
                rank,
                seq,
                color,
                key,
            } => self.comm_split(fd, comm, rank, seq, color, key),
            Call::Run { ops } => self.run(id, fd, ops),
            Call::Abort { comm, rank } => {
                self.abort(comm, rank);
                Ok(Answer::Done)
            }
            Call::Leave { comm, rank } => {
                self.leave(comm, rank);
                Ok(Answer::Done)
            }
        };
        match r {
            Ok(a) => Reply::Nccl(a),
            Err((code, msg)) => Reply::err(code, msg),
        }
    }

    fn comm_init(
        &self,
        fd: RawFd,
        uid: Vec<u8>,
        nranks: i32,
        rank: i32,
        gpu: [u8; 16],
    ) -> Result<Answer, Fail> {
        if uid.len() != UNIQUE_ID_BYTES || &uid[..8] != ID_MAGIC {
            return Err(fail(
                result::INVALID_ARGUMENT,
                "the unique id was not made by ncclGetUniqueId on this node",
            ));
        }
        if nranks < 1 || rank < 0 || rank >= nranks {
            return Err(fail(
                result::INVALID_ARGUMENT,
                format!("rank {rank} of {nranks} ranks"),
            ));
        }
        if self.gpu_index(&gpu).is_none() {
            return Err(fail(
                result::INVALID_ARGUMENT,
                format!("GPU {} is not on this node", format_uuid(&gpu)),
            ));
        }
        {
            let mut st = self.comms.state();
            let j = st.joins.entry(uid.clone()).or_insert_with(|| Join {
                nranks,
                members: BTreeMap::new(),
                outcome: Outcome {
                    result: None,
                    unread: 0,
                },
            });
            if j.outcome.result.is_none() {
                if j.nranks != nranks {
                    return Err(fail(
                        result::INVALID_USAGE,
                        format!(
                            "rank {rank} gave nranks {nranks}, the ranks before it {}",
                            j.nranks
                        ),
                    ));
                }
                if j.members.contains_key(&rank) {
                    return Err(fail(
                        result::INVALID_USAGE,
                        format!("rank {rank} joined this unique id twice"),
                    ));
                }
                if let Some((other, _)) = j.members.iter().find(|(_, g)| **g == gpu) {
                    j.outcome.result = Some(Err(fail(
                        result::INVALID_USAGE,
                        format!(
                            "Duplicate GPU detected: rank {rank} and rank {other} both on GPU {}",
                            format_uuid(&gpu)
                        ),
                    )));
                }
                j.members.insert(rank, gpu);
                j.outcome.unread = j.members.len();
                if j.outcome.result.is_none() && j.members.len() == nranks as usize {
                    let gpus = j.members.values().copied().collect();
                    let comm = st.new_comm(gpus);
                    if let Some(j) = st.joins.get_mut(&uid) {
                        j.outcome.result = Some(Ok(comm));
                    }
                }
                self.comms.cv.notify_all();
            } else if matches!(j.outcome.result, Some(Ok(_))) {
                return Err(fail(
                    result::INVALID_USAGE,
                    format!(
                        "rank {rank} joined a unique id whose {} ranks are all there",
                        j.nranks
                    ),
                ));
            } else {
                // The id already failed (two ranks on one GPU): a late rank reads that too.
                j.outcome.unread += 1;
            }
        }
        let got = self
            .comms
            .wait(fd, |st| read_once(&mut st.joins, &uid, |j| &mut j.outcome));
        match got {
            Some(r) => r.map(|comm| Answer::Comm { comm }),
            None => {
                // The caller is gone: its rank may join again from another process.
                let mut st = self.comms.state();
                if let Some(j) = st.joins.get_mut(&uid) {
                    if j.outcome.result.is_none() {
                        j.members.remove(&rank);
                    }
                }
                Err(fail(result::SYSTEM_ERROR, "the caller is gone"))
            }
        }
    }

    fn comm_split(
        &self,
        fd: RawFd,
        comm: u64,
        rank: i32,
        seq: u64,
        color: i32,
        key: i32,
    ) -> Result<Answer, Fail> {
        let key_of = (comm, seq);
        {
            let mut st = self.comms.state();
            let nranks = st.member(comm, rank)?.gpus.len();
            let parent_gpus = st
                .comms
                .get(&comm)
                .map(|c| c.gpus.clone())
                .unwrap_or_default();
            let sj = st.splits.entry(key_of).or_insert_with(|| SplitJoin {
                entries: BTreeMap::new(),
                outcome: Outcome {
                    result: None,
                    unread: nranks,
                },
            });
            if sj.entries.insert(rank, (color, key)).is_some() {
                return Err(fail(
                    result::INVALID_USAGE,
                    format!("rank {rank} called split {seq} twice"),
                ));
            }
            if sj.entries.len() == nranks {
                let entries = std::mem::take(&mut sj.entries);
                let mut colors: BTreeMap<i32, Vec<(i32, i32)>> = BTreeMap::new();
                let mut out: SplitResult = HashMap::new();
                for (r, (c, k)) in entries {
                    if c == SPLIT_NOCOLOR {
                        out.insert(r, None);
                    } else {
                        colors.entry(c).or_default().push((k, r));
                    }
                }
                for (_, mut members) in colors {
                    members.sort();
                    let gpus = members
                        .iter()
                        .map(|(_, r)| parent_gpus[*r as usize])
                        .collect();
                    let new = st.new_comm(gpus);
                    let n = members.len() as i32;
                    for (i, (_, r)) in members.iter().enumerate() {
                        out.insert(*r, Some((new, i as i32, n)));
                    }
                }
                if let Some(sj) = st.splits.get_mut(&key_of) {
                    sj.outcome.result = Some(Ok(out));
                }
                self.comms.cv.notify_all();
            }
        }
        let got = self.comms.wait(fd, |st| {
            read_once(&mut st.splits, &key_of, |s| &mut s.outcome)
        });
        let r = got.ok_or_else(|| fail(result::SYSTEM_ERROR, "the caller is gone"))??;
        Ok(Answer::Split(r.get(&rank).copied().flatten()))
    }

    /// The device memory `[addr, addr + len)` of process `pid` (any of its libcuda connections):
    /// the allocation, the offset in it, and the allocation's GPU.
    fn pid_range(&self, pid: i32, addr: u64, len: u64) -> Option<(Arc<Alloc>, usize, [u8; 16])> {
        let reg = lock(&self.reg);
        reg.conns
            .values()
            .filter(|c| c.pid == pid && c.role == Role::Cuda)
            .find_map(|c| {
                let (start, a) = c.allocs.range(..=addr).next_back()?;
                let off = addr - start;
                let resident = lock(&a.data).len() as u64 == a.size;
                (resident && off.checked_add(len)? <= a.size && !a.mapped)
                    .then(|| (Arc::clone(a), off as usize, self.node.gpus[a.gpu].uuid))
            })
    }

    /// Reads an operation's input and finds its output, in the memory of process `pid` on the
    /// rank's GPU.
    fn part(&self, pid: i32, op: Op, gpu: [u8; 16], nranks: usize) -> Result<Part, Fail> {
        let size = op.dtype.size() as u64;
        let (in_len, out_len) = op
            .kind
            .extents(op.count, size, nranks as u64, op.rank, op.peer);
        let name = op.kind.name();
        let find = |what: &str, ptr: u64, len: u64| match self.pid_range(pid, ptr, len) {
            Some((a, off, g)) if g == gpu => Ok((a, off)),
            Some((_, _, g)) => Err(fail(
                result::INVALID_ARGUMENT,
                format!(
                    "{name}: {what} {ptr:#x} is on GPU {}, the communicator's rank {} on GPU {}",
                    format_uuid(&g),
                    op.rank,
                    format_uuid(&gpu)
                ),
            )),
            None => Err(fail(
                result::INVALID_ARGUMENT,
                format!("{name}: {what} {ptr:#x}+{len} is not device memory of process {pid}"),
            )),
        };
        let input = if in_len > 0 {
            let (a, off) = find("sendbuff", op.send, in_len)?;
            let data = lock(&a.data);
            data.get(off..off + in_len as usize)
                .map(<[u8]>::to_vec)
                .ok_or_else(|| fail(result::INVALID_ARGUMENT, "sendbuff out of range"))?
        } else {
            Vec::new()
        };
        let out = if out_len > 0 {
            Some(find("recvbuff", op.recv, out_len)?)
        } else {
            None
        };
        Ok(Part { op, input, out })
    }

    /// A group of operations of one process: contributes each, runs those that are complete,
    /// and returns when all of them are done.
    fn run(&self, id: u64, fd: RawFd, ops: Vec<Op>) -> Result<Answer, Fail> {
        let pid = self.peer_pid(id);
        let mut parts = Vec::with_capacity(ops.len());
        for op in ops {
            let (gpu, nranks) = {
                let st = self.comms.state();
                let c = st.member(op.comm, op.rank)?;
                (c.gpus[op.rank as usize], c.gpus.len())
            };
            if (op.kind.rooted() || op.kind.is_p2p()) && (op.peer < 0 || op.peer as usize >= nranks)
            {
                return Err(fail(
                    result::INVALID_ARGUMENT,
                    format!(
                        "{}: rank {} is not in a communicator of {nranks}",
                        op.kind.name(),
                        op.peer
                    ),
                ));
            }
            parts.push((self.part(pid, op, gpu, nranks)?, nranks));
        }
        let keys = self.contribute(parts)?;
        self.wait_slots(fd, keys)
    }

    /// Puts each part into its slot, and runs the slots it completes: the slots' keys, one per
    /// part.
    fn contribute(&self, parts: Vec<(Part, usize)>) -> Result<Vec<SlotKey>, Fail> {
        let mut keys = Vec::new();
        let mut ready = Vec::new();
        {
            let mut st = self.comms.state();
            for (part, nranks) in parts {
                st.member(part.op.comm, part.op.rank)?;
                let key = slot_key(&part.op);
                let need = if part.op.kind.is_p2p() { 2 } else { nranks };
                let slot = st.slots.entry(key).or_insert_with(|| Slot {
                    need,
                    nranks,
                    parts: Vec::new(),
                    running: false,
                    done: None,
                    unread: need,
                });
                slot.parts.push(part);
                if slot.parts.len() == slot.need && !slot.running && slot.done.is_none() {
                    slot.running = true;
                    ready.push(key);
                }
                keys.push(key);
            }
        }
        for key in ready {
            self.execute(key);
        }
        Ok(keys)
    }

    /// Waits until every slot of `keys` is done: the first error among them, if any.
    fn wait_slots(&self, fd: RawFd, keys: Vec<SlotKey>) -> Result<Answer, Fail> {
        let got = self.comms.wait(fd, |st| {
            if keys
                .iter()
                .any(|k| st.slots.get(k).is_none_or(|s| s.done.is_none()))
            {
                return None;
            }
            let mut first_err = None;
            for k in &keys {
                if let Some(s) = st.slots.get_mut(k) {
                    if let Some(Err(e)) = &s.done {
                        first_err.get_or_insert_with(|| e.clone());
                    }
                    s.unread = s.unread.saturating_sub(1);
                    if s.unread == 0 {
                        st.slots.remove(k);
                    }
                }
            }
            Some(first_err)
        });
        match got {
            Some(None) => Ok(Answer::Done),
            Some(Some(e)) => Err(e),
            None => Err(fail(result::SYSTEM_ERROR, "the caller is gone")),
        }
    }

    /// Moves the bytes of a complete slot, then marks it done.
    fn execute(&self, key: SlotKey) {
        let (mut parts, nranks) = {
            let mut st = self.comms.state();
            let Some(s) = st.slots.get_mut(&key) else {
                return;
            };
            (std::mem::take(&mut s.parts), s.nranks)
        };
        parts.sort_by_key(|p| (p.op.rank, p.op.kind == Kind::Recv));
        let r = outputs(&parts, nranks).map(|writes| {
            for (a, off, bytes) in writes {
                let mut data = lock(&a.data);
                if let Some(d) = data.get_mut(off..off + bytes.len()) {
                    d.copy_from_slice(&bytes);
                }
            }
        });
        let mut st = self.comms.state();
        if let Some(s) = st.slots.get_mut(&key) {
            if s.done.is_none() {
                s.done = Some(r);
            }
        }
        self.comms.cv.notify_all();
    }

    fn abort(&self, comm: u64, rank: i32) {
        let mut st = self.comms.state();
        let why = format!("communicator {comm} was aborted by rank {rank}");
        if let Some(c) = st.comms.get_mut(&comm) {
            c.aborted.get_or_insert(why.clone());
        }
        for (k, s) in st.slots.iter_mut() {
            if k.comm() == comm && s.done.is_none() {
                s.done = Some(Err(fail(result::REMOTE_ERROR, why.clone())));
            }
        }
        for ((parent, _), sj) in st.splits.iter_mut() {
            if *parent == comm && sj.outcome.result.is_none() {
                sj.outcome.result = Some(Err(fail(result::REMOTE_ERROR, why.clone())));
            }
        }
        self.comms.cv.notify_all();
    }

    fn leave(&self, comm: u64, rank: i32) {
        let mut st = self.comms.state();
        let gone = match st.comms.get_mut(&comm) {
            Some(c) => {
                c.live.remove(&rank);
                c.live.is_empty()
            }
            None => false,
        };
        if gone {
            st.comms.remove(&comm);
            st.slots.retain(|k, _| k.comm() != comm);
            st.splits.retain(|(p, _), _| *p != comm);
        }
    }
}

/// Where an operation meets its peers: a collective by the communicator's sequence, a send and
/// its receive by (sender, receiver, sequence).
fn slot_key(op: &Op) -> SlotKey {
    match op.kind {
        Kind::Send => SlotKey::P2p {
            comm: op.comm,
            src: op.rank,
            dst: op.peer,
            seq: op.seq,
        },
        Kind::Recv => SlotKey::P2p {
            comm: op.comm,
            src: op.peer,
            dst: op.rank,
            seq: op.seq,
        },
        _ => SlotKey::Coll {
            comm: op.comm,
            seq: op.seq,
        },
    }
}

/// Whether the ranks' calls of one slot agree (kind, count, type, operator, root), and its type
/// is one the simulator reduces where it reduces.
fn agree(parts: &[Part]) -> Result<(), Fail> {
    let first = &parts[0].op;
    let name = first.kind.name();
    for p in parts {
        let o = &p.op;
        let same = if first.kind.is_p2p() {
            o.count == first.count && o.dtype == first.dtype
        } else {
            o.kind == first.kind
                && o.count == first.count
                && o.dtype == first.dtype
                && (!o.kind.reduces() || o.op == first.op)
                && (!o.kind.rooted() || o.peer == first.peer)
        };
        if !same {
            return Err(fail(
                result::INVALID_USAGE,
                format!(
                    "the ranks disagree: rank {} called {name} of {} {:?} (op {:?}, root/peer {}), rank {} {} of {} {:?} (op {:?}, root/peer {})",
                    first.rank, first.count, first.dtype, first.op, first.peer,
                    o.rank, o.kind.name(), o.count, o.dtype, o.op, o.peer
                ),
            ));
        }
    }
    if first.kind.reduces() && !first.dtype.reducible() {
        return Err(fail(
            result::INVALID_ARGUMENT,
            format!("{name}: reductions of {:?} are not simulated", first.dtype),
        ));
    }
    Ok(())
}

/// Bytes for an output: (allocation, offset, bytes).
type Write = (Arc<Alloc>, usize, Vec<u8>);

/// The bytes each rank's output receives.
fn outputs(parts: &[Part], nranks: usize) -> Result<Vec<Write>, Fail> {
    agree(parts)?;
    let first = &parts[0].op;
    let one = (first.count as usize) * first.dtype.size();
    let reduce_all = |parts: &[Part]| {
        let mut acc = parts[0].input.clone();
        for p in &parts[1..] {
            reduce_into(first.dtype, first.op, &mut acc, &p.input);
        }
        if first.op == RedOp::Avg {
            finish_avg(first.dtype, &mut acc, parts.len() as u64);
        }
        acc
    };
    let root = first.peer as usize;
    let chunk = |v: &[u8], i: usize| v[i * one..(i + 1) * one].to_vec();
    let mut writes = Vec::new();
    let mut put = |p: &Part, bytes: Vec<u8>| {
        if let Some((a, off)) = &p.out {
            writes.push((Arc::clone(a), *off, bytes));
        }
    };
    match first.kind {
        Kind::AllReduce => {
            let acc = reduce_all(parts);
            parts.iter().for_each(|p| put(p, acc.clone()));
        }
        Kind::Reduce => put(&parts[root], reduce_all(parts)),
        Kind::Broadcast => {
            let src = parts[root].input.clone();
            parts.iter().for_each(|p| put(p, src.clone()));
        }
        Kind::AllGather => {
            let all: Vec<u8> = parts.iter().flat_map(|p| p.input.iter().copied()).collect();
            parts.iter().for_each(|p| put(p, all.clone()));
        }
        Kind::Gather => {
            let all: Vec<u8> = parts.iter().flat_map(|p| p.input.iter().copied()).collect();
            put(&parts[root], all);
        }
        Kind::ReduceScatter => {
            let acc = reduce_all(parts);
            parts
                .iter()
                .enumerate()
                .for_each(|(i, p)| put(p, chunk(&acc, i)));
        }
        Kind::Scatter => {
            let src = parts[root].input.clone();
            parts
                .iter()
                .enumerate()
                .for_each(|(i, p)| put(p, chunk(&src, i)));
        }
        Kind::AlltoAll => {
            for (r, p) in parts.iter().enumerate() {
                let bytes = (0..nranks)
                    .flat_map(|s| chunk(&parts[s].input, r))
                    .collect();
                put(p, bytes);
            }
        }
        Kind::Send | Kind::Recv => {
            let send = parts.iter().find(|p| p.op.kind == Kind::Send);
            let recv = parts.iter().find(|p| p.op.kind == Kind::Recv);
            match (send, recv) {
                (Some(s), Some(r)) => put(r, s.input.clone()),
                _ => {
                    return Err(fail(
                        result::INVALID_USAGE,
                        "a send met a send (or a receive a receive)",
                    ))
                }
            }
        }
    }
    Ok(writes)
}
