//! Communicators: the objects behind `ncclComm_t`, their lifecycle, and the daemon calls that
//! make, split and end them.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

use simgpu::client::{CallError, Client};
use simgpu::nccl::{result, Answer, Call};
use simgpu::proto::{Reply, Request, Role};

use crate::{fail, Fail, R};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where the daemon is: `$GPU_CKPT_SIM_SOCKET`, else beside this library's node directory, else
/// the container path (as libcuda.so.1 finds it).
fn socket() -> &'static std::path::Path {
    static SOCKET: OnceLock<std::path::PathBuf> = OnceLock::new();
    SOCKET.get_or_init(|| {
        let lib = simgpu::library_file_of(socket as *const () as usize);
        simgpu::socket_path(lib.as_deref())
    })
}

/// One call to the daemon on a connection of its own (the library holds no connection between
/// calls, so a process with no NCCL work in flight has no socket to the daemon).
pub fn daemon(call: Call) -> R<Answer> {
    let mut c = Client::connect(socket(), Role::Nccl).map_err(|e| {
        fail(
            result::SYSTEM_ERROR,
            format!(
                "cannot reach gpu-ckpt-simgpu at {}: {e}",
                socket().display()
            ),
        )
    })?;
    match c.call(&Request::Nccl(call)) {
        Ok(Reply::Nccl(a)) => Ok(a),
        Ok(r) => Err(fail(
            result::INTERNAL_ERROR,
            format!("unexpected reply from gpu-ckpt-simgpu: {r:?}"),
        )),
        Err(CallError::Driver { code, msg }) => Err(fail(code, msg)),
        Err(e) => Err(fail(result::SYSTEM_ERROR, e.to_string())),
    }
}

/// What a communicator is and does; changes under its lock.
pub struct State {
    /// The daemon's communicator, once made.
    pub daemon: Option<u64>,
    pub rank: i32,
    pub nranks: i32,
    /// `ncclCommGetAsyncError`: ncclInProgress while it is being made, then the first error.
    pub async_error: u32,
    /// Made inside a group: its creation runs at `ncclGroupEnd` of this group.
    pub deferred: bool,
    pub coll_seq: u64,
    pub sends: HashMap<i32, u64>,
    pub recvs: HashMap<i32, u64>,
    pub split_seq: u64,
    /// Operations enqueued and not completed.
    pub pending: u64,
    pub finalized: bool,
    pub suspended: bool,
    /// Registered buffers: handle → (pointer, size).
    pub registered: HashMap<usize, (usize, usize)>,
    pub last_error: String,
}

pub struct Comm {
    pub dev: i32,
    state: Mutex<State>,
    cv: Condvar,
}

impl Comm {
    pub fn new(dev: i32, rank: i32, nranks: i32) -> Arc<Comm> {
        Arc::new(Comm {
            dev,
            state: Mutex::new(State {
                daemon: None,
                rank,
                nranks,
                async_error: result::IN_PROGRESS,
                deferred: false,
                coll_seq: 0,
                sends: HashMap::new(),
                recvs: HashMap::new(),
                split_seq: 0,
                pending: 0,
                finalized: false,
                suspended: false,
                registered: HashMap::new(),
                last_error: String::new(),
            }),
            cv: Condvar::new(),
        })
    }

    pub fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Records the outcome of the communicator's creation.
    pub fn made(&self, r: &R<(u64, i32, i32)>) {
        let mut st = self.state();
        st.deferred = false;
        match r {
            Ok((id, rank, nranks)) => {
                st.daemon = Some(*id);
                st.rank = *rank;
                st.nranks = *nranks;
                st.async_error = result::SUCCESS;
            }
            Err(e) => {
                st.async_error = e.code;
                st.last_error = e.msg.clone();
            }
        }
        self.cv.notify_all();
    }

    /// The daemon's communicator, where this one is ready for operations.
    pub fn ready(&self) -> R<u64> {
        let st = self.state();
        if st.suspended {
            return Err(fail(result::INVALID_USAGE, "the communicator is suspended"));
        }
        if st.finalized {
            return Err(fail(result::INVALID_USAGE, "the communicator is finalized"));
        }
        match (st.daemon, st.async_error) {
            (Some(id), result::SUCCESS) => Ok(id),
            (_, result::IN_PROGRESS) => Err(fail(
                result::INVALID_USAGE,
                "the communicator is still being initialized",
            )),
            (_, code) => Err(fail(
                code,
                format!("the communicator has failed: {}", st.last_error),
            )),
        }
    }

    /// `n` operations completed with `r` (the first error becomes the asynchronous error).
    pub fn complete(&self, n: u64, r: &R<()>) {
        let mut st = self.state();
        st.pending = st.pending.saturating_sub(n);
        if let Err(e) = r {
            if st.async_error == result::SUCCESS {
                st.async_error = e.code;
            }
            st.last_error = e.msg.clone();
        }
        self.cv.notify_all();
    }

    /// Waits until every enqueued operation completed (`ncclCommFinalize`).
    pub fn flush(&self) {
        let mut st = self.state();
        while st.pending > 0 {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// The live communicators by handle (the address of the `Comm`), so that a stale or foreign
/// handle is refused instead of followed.
fn live() -> MutexGuard<'static, HashMap<usize, Arc<Comm>>> {
    static LIVE: OnceLock<Mutex<HashMap<usize, Arc<Comm>>>> = OnceLock::new();
    lock(LIVE.get_or_init(Default::default))
}

/// Gives `comm` a handle.
pub fn publish(comm: &Arc<Comm>) -> *mut c_void {
    let h = Arc::as_ptr(comm) as usize;
    live().insert(h, Arc::clone(comm));
    h as *mut c_void
}

/// The communicator behind handle `h`.
pub fn get(h: *mut c_void) -> R<Arc<Comm>> {
    if h.is_null() {
        return Err(fail(result::INVALID_ARGUMENT, "comm argument is NULL"));
    }
    live()
        .get(&(h as usize))
        .cloned()
        .ok_or_else(|| fail(result::INVALID_ARGUMENT, "invalid communicator handle"))
}

/// Takes handle `h` out of use.
pub fn unpublish(h: *mut c_void) -> Option<Arc<Comm>> {
    live().remove(&(h as usize))
}

/// Joins unique id `id` as `rank` of `nranks` on device `dev`: returns when every rank joined.
pub fn join(id: &[u8], nranks: i32, rank: i32, dev: i32) -> R<(u64, i32, i32)> {
    let gpu = crate::cuda::cuda()?.uuid(dev)?;
    match daemon(Call::Init {
        id: id.to_vec(),
        nranks,
        rank,
        gpu,
    })? {
        Answer::Comm { comm } => Ok((comm, rank, nranks)),
        a => Err(unexpected(a)),
    }
}

/// The `seq`-th split of `parent` (daemon id) by this rank: the new communicator, or None.
pub fn split(parent: u64, rank: i32, seq: u64, color: i32, key: i32) -> R<Option<(u64, i32, i32)>> {
    match daemon(Call::Split {
        comm: parent,
        rank,
        seq,
        color,
        key,
    })? {
        Answer::Split(s) => Ok(s),
        a => Err(unexpected(a)),
    }
}

fn unexpected(a: Answer) -> Fail {
    fail(
        result::INTERNAL_ERROR,
        format!("unexpected answer from gpu-ckpt-simgpu: {a:?}"),
    )
}
