//! Group semantics and stream order. Between `ncclGroupStart` and `ncclGroupEnd` (per thread, as
//! NCCL's groups are) operations and communicator creations are collected; at the outermost
//! `ncclGroupEnd` the creations run together, then the operations are launched as one fused
//! batch. A call outside a group is a group of its own.
//!
//! A batch is launched as one host function (`cuLaunchHostFunc`) on each stream it uses and
//! returns at once. When the last of those streams reaches its host function (everything before
//! it on every stream is done), that function contributes the whole batch to the daemon and
//! waits until every operation of it completed on every rank; the others wait for it. So each
//! stream is complete only when the batch is, and work after it on the stream waits for it.

use std::cell::RefCell;
use std::ffi::c_void;
use std::sync::{Arc, Condvar, Mutex};

use simgpu::nccl::{result, Call, Op};

use crate::comm::{daemon, Comm};
use crate::{fail, Fail, R};

/// An operation as called: its communicator's daemon id and sequence are taken at launch.
pub struct Pending {
    pub comm: Arc<Comm>,
    pub stream: usize,
    pub op: Op,
}

type Creation = Box<dyn FnOnce() -> R<()> + Send>;

#[derive(Default)]
struct Group {
    depth: u32,
    ops: Vec<Pending>,
    creations: Vec<Creation>,
}

thread_local! {
    static GROUP: RefCell<Group> = RefCell::new(Group::default());
}

pub fn start() {
    GROUP.with(|g| g.borrow_mut().depth += 1);
}

/// Whether this thread is inside a group.
pub fn inside() -> bool {
    GROUP.with(|g| g.borrow().depth > 0)
}

/// Runs `create` now, or at the end of this thread's group.
pub fn create(create: Creation) -> R<()> {
    if inside() {
        GROUP.with(|g| g.borrow_mut().creations.push(create));
        Ok(())
    } else {
        create()
    }
}

/// Enqueues `p` now, or with the rest of this thread's group.
pub fn submit(p: Pending) -> R<()> {
    if inside() {
        GROUP.with(|g| g.borrow_mut().ops.push(p));
        Ok(())
    } else {
        launch(vec![p])
    }
}

pub fn end() -> R<()> {
    let (creations, ops) = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Err(fail(
                result::INVALID_USAGE,
                "ncclGroupEnd: not in a group call.",
            ));
        }
        g.depth -= 1;
        if g.depth > 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        Ok((std::mem::take(&mut g.creations), std::mem::take(&mut g.ops)))
    })?;
    // Creations block until every rank joins, and the ranks of one process may all be in
    // this group: they run side by side.
    let handles: Vec<_> = creations.into_iter().map(std::thread::spawn).collect();
    let mut first: R<()> = Ok(());
    for h in handles {
        let r = h.join().unwrap_or_else(|_| {
            Err(fail(
                result::INTERNAL_ERROR,
                "communicator creation panicked",
            ))
        });
        if first.is_ok() {
            first = r;
        }
    }
    first?;
    if ops.is_empty() {
        Ok(())
    } else {
        launch(ops)
    }
}

/// One launched batch, shared by the host functions of its streams.
struct Batch {
    ops: Vec<Op>,
    /// Each operation's communicator (for completion).
    comms: Vec<Arc<Comm>>,
    streams: usize,
    sync: Mutex<(usize, Option<R<()>>)>,
    cv: Condvar,
}

fn launch(ps: Vec<Pending>) -> R<()> {
    let cuda = crate::cuda::cuda()?;
    let mut streams: Vec<usize> = Vec::new();
    let mut ops = Vec::with_capacity(ps.len());
    let mut comms = Vec::with_capacity(ps.len());
    for p in &ps {
        let mut op = p.op.clone();
        op.comm = p.comm.ready()?;
        ops.push(op);
        comms.push(Arc::clone(&p.comm));
        if !streams.contains(&p.stream) {
            cuda.check_stream(p.stream as *mut c_void)?;
            streams.push(p.stream);
        }
    }
    // Sequence numbers are taken in call order, once every check passed.
    for (op, p) in ops.iter_mut().zip(&ps) {
        let mut st = p.comm.state();
        op.seq = match op.kind {
            simgpu::nccl::Kind::Send => next(st.sends.entry(op.peer).or_default()),
            simgpu::nccl::Kind::Recv => next(st.recvs.entry(op.peer).or_default()),
            _ => next(&mut st.coll_seq),
        };
        st.pending += 1;
    }
    let batch = Arc::new(Batch {
        ops,
        comms,
        streams: streams.len(),
        sync: Mutex::new((0, None)),
        cv: Condvar::new(),
    });
    let mut launched = Ok(());
    for s in streams {
        let data = Box::into_raw(Box::new(Arc::clone(&batch))) as *mut c_void;
        if let Err(e) = cuda.launch_host_func(s as *mut c_void, run_on_stream, data) {
            // SAFETY: not launched: the box is still ours.
            drop(unsafe { Box::from_raw(data as *mut Arc<Batch>) });
            batch.arrive_failed(e.clone());
            launched = Err(e);
        }
    }
    launched
}

fn next(n: &mut u64) -> u64 {
    let v = *n;
    *n += 1;
    v
}

impl Batch {
    fn finish(&self, r: R<()>) {
        for c in &self.comms {
            c.complete(1, &r);
        }
        let mut s = self.sync.lock().unwrap_or_else(|p| p.into_inner());
        s.1 = Some(r);
        self.cv.notify_all();
    }

    /// A stream whose host function could not be launched: the batch fails.
    fn arrive_failed(&self, e: Fail) {
        let done = self
            .sync
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .is_some();
        if !done {
            self.finish(Err(e));
        }
    }

    /// One of the batch's streams reached it.
    fn arrive(&self) {
        let last = {
            let mut s = self.sync.lock().unwrap_or_else(|p| p.into_inner());
            s.0 += 1;
            s.0 == self.streams && s.1.is_none()
        };
        if last {
            let r = daemon(Call::Run {
                ops: self.ops.clone(),
            })
            .map(|_| ());
            if let Err(e) = &r {
                crate::warn(&format!("{}: {}", self.ops[0].kind.name(), e.msg));
            }
            self.finish(r);
            return;
        }
        let mut s = self.sync.lock().unwrap_or_else(|p| p.into_inner());
        while s.1.is_none() {
            s = self.cv.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// The host function on each of a batch's streams.
unsafe extern "C" fn run_on_stream(data: *mut c_void) {
    // SAFETY: `data` is the box `launch` leaked for this stream, taken back once here.
    let batch = unsafe { Box::from_raw(data as *mut Arc<Batch>) };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| batch.arrive()));
}
