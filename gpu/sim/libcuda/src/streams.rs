//! Stream order. Work on an idle stream runs when it is called, as before; work on a stream that
//! has work pending (a host function that has not returned, or work queued behind one) is queued
//! and run in order by that stream's worker thread, so that `cuStreamQuery` answers
//! CUDA_ERROR_NOT_READY and `cuStreamSynchronize` waits until everything before it is done.
//! Host functions (`cuLaunchHostFunc`) always run on the worker, as the driver runs them on a
//! thread of its own. Events recorded behind pending work complete when the stream reaches them.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Condvar, Mutex, MutexGuard};

type Job = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// The worker is running a job.
    busy: bool,
}

impl Queue {
    fn idle(&self) -> bool {
        self.jobs.is_empty() && !self.busy
    }
}

#[derive(Default)]
struct State {
    queues: HashMap<usize, Queue>,
    /// Streams made with CU_STREAM_NON_BLOCKING: the legacy default stream does not wait for them.
    non_blocking: HashSet<usize>,
    /// Events recorded behind pending work, not reached yet.
    pending_events: HashSet<usize>,
}

#[derive(Default)]
pub(crate) struct Streams {
    state: Mutex<State>,
    cv: Condvar,
}

/// `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`.
const LEGACY: usize = 1;
const PER_THREAD: usize = 2;

/// The queue a stream handle names: NULL and `CU_STREAM_LEGACY` are the legacy default stream.
pub(crate) fn key(stream: *mut std::ffi::c_void) -> usize {
    match stream as usize {
        0 | LEGACY => 0,
        PER_THREAD => PER_THREAD,
        s => s,
    }
}

impl Streams {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait_until(&self, mut done: impl FnMut(&State) -> bool) {
        let mut st = self.lock();
        while !done(&st) {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    pub(crate) fn set_non_blocking(&self, stream: usize) {
        self.lock().non_blocking.insert(stream);
    }

    /// Whether stream `key` has work that has not completed.
    pub(crate) fn pending(&self, key: usize) -> bool {
        self.lock().queues.get(&key).is_some_and(|q| !q.idle())
    }

    /// Runs `job` now when stream `key` is idle (its result is the call's), else queues it
    /// behind the pending work (the call succeeds; the work's own error is not reported).
    pub(crate) fn order<E: Send + 'static>(
        &'static self,
        key: usize,
        job: impl FnOnce() -> Result<(), E> + Send + 'static,
    ) -> Result<(), E> {
        {
            let mut st = self.lock();
            if st.queues.get(&key).is_some_and(|q| !q.idle()) {
                self.push(&mut st, key, Box::new(move || drop(job())));
                return Ok(());
            }
        }
        job()
    }

    /// Queues `job` on stream `key`'s worker (started if it is not running).
    pub(crate) fn enqueue(&'static self, key: usize, job: Job) {
        let mut st = self.lock();
        self.push(&mut st, key, job);
    }

    fn push(&'static self, st: &mut State, key: usize, job: Job) {
        let q = st.queues.entry(key).or_default();
        q.jobs.push_back(job);
        if !q.busy {
            q.busy = true;
            let spawned = std::thread::Builder::new()
                .name("cuda-stream".into())
                .spawn(move || self.worker(key));
            if spawned.is_err() {
                // No thread for the stream: its work is lost, as a launch that failed.
                q.busy = false;
                q.jobs.clear();
                eprintln!("gpu-ckpt simulated libcuda: no thread for a stream's work");
            }
        }
    }

    fn worker(&self, key: usize) {
        loop {
            let job = {
                let mut st = self.lock();
                let Some(q) = st.queues.get_mut(&key) else {
                    return;
                };
                match q.jobs.pop_front() {
                    Some(j) => j,
                    None => {
                        q.busy = false;
                        st.queues.remove(&key);
                        self.cv.notify_all();
                        return;
                    }
                }
            };
            job();
            self.cv.notify_all();
        }
    }

    /// Waits until stream `key` has completed everything queued on it.
    pub(crate) fn wait_idle(&self, key: usize) {
        self.wait_until(|st| st.queues.get(&key).is_none_or(Queue::idle));
    }

    /// The legacy default stream's implicit wait: every stream but the non-blocking ones.
    pub(crate) fn wait_legacy(&self) {
        self.wait_until(|st| {
            st.queues
                .iter()
                .all(|(k, q)| q.idle() || st.non_blocking.contains(k))
        });
    }

    /// Waits until every stream is idle (`cuCtxSynchronize`).
    pub(crate) fn wait_all(&self) {
        self.wait_until(|st| st.queues.values().all(Queue::idle));
    }

    /// Records `event` on stream `key`: `Ok(true)` when the stream is idle (the event completes
    /// now, `set` is not called), else the event is pending until the stream reaches it and
    /// `set` runs there.
    pub(crate) fn record(
        &'static self,
        key: usize,
        event: usize,
        set: impl FnOnce() + Send + 'static,
    ) -> bool {
        let mut st = self.lock();
        if st.queues.get(&key).is_none_or(Queue::idle) {
            st.pending_events.remove(&event);
            return true;
        }
        st.pending_events.insert(event);
        let job = Box::new(move || {
            set();
            self.lock().pending_events.remove(&event);
        });
        self.push(&mut st, key, job);
        false
    }

    pub(crate) fn event_pending(&self, event: usize) -> bool {
        self.lock().pending_events.contains(&event)
    }

    pub(crate) fn wait_event(&self, event: usize) {
        self.wait_until(|st| !st.pending_events.contains(&event));
    }

    /// `cuStreamWaitEvent`: work on stream `key` after this waits for `event`.
    pub(crate) fn stream_wait_event(&'static self, key: usize, event: usize) {
        if self.event_pending(event) {
            self.enqueue(key, Box::new(move || self.wait_event(event)));
        }
    }
}
