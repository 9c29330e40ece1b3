//! The layer's record, gate and protocol logic against a test double of NCCL (the layer over
//! the simulated NCCL is tested end to end in tests/).

use std::collections::HashSet;
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nccl_control::{Connection, LayerMsg, ShimMsg, Split};

use crate::backend::{Backend, Cfg, Made, RealComm};
use crate::config::ConfigCopy;
use crate::ffi::*;
use crate::layer::{CommObj, Layer, NewComm, Origin};

#[derive(Default)]
struct Fake {
    /// Made communicators are ncclInProgress for this many async-error polls.
    in_progress: Mutex<u32>,
    nonblocking: bool,
    next: Mutex<usize>,
    log: Mutex<Vec<String>>,
    pending: Mutex<HashSet<usize>>,
    no_suspend: bool,
    /// Init fails with ncclUnhandledCudaError, and ncclGetLastError says this.
    init_error: Option<&'static str>,
}

impl Fake {
    fn made(&self) -> usize {
        let mut n = self.next.lock().unwrap();
        *n += 0x100;
        0x1000 + *n
    }
    fn log(&self, s: String) {
        self.log.lock().unwrap().push(s);
    }
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.log.lock().unwrap())
    }
}

fn cfg(c: Option<&ConfigCopy>) -> String {
    c.map_or("none".into(), |c| format!("blocking={}", c.raw().blocking))
}

impl Backend for Fake {
    fn version(&self) -> Result<i32, ncclResult_t> {
        Ok(23206)
    }
    fn unique_id(&self) -> Result<ncclUniqueId, ncclResult_t> {
        Ok(ncclUniqueId::from_bytes(&[0xab; NCCL_UNIQUE_ID_BYTES]))
    }
    fn init_rank(&self, nranks: i32, id: &ncclUniqueId, rank: i32, config: Cfg) -> Made {
        let c = self.made();
        self.log(format!(
            "init {nranks} {rank} id={:02x} {} -> {c:#x}",
            id.bytes()[0],
            cfg(config)
        ));
        if self.init_error.is_some() {
            return (NCCL_UNHANDLED_CUDA_ERROR, 0);
        }
        if self.nonblocking {
            *self.in_progress.lock().unwrap() = 3;
            return (NCCL_IN_PROGRESS, c);
        }
        (NCCL_SUCCESS, c)
    }
    fn split(&self, parent: RealComm, color: i32, key: i32, config: Cfg) -> Made {
        let c = if color == NCCL_SPLIT_NOCOLOR {
            0
        } else {
            self.made()
        };
        self.log(format!(
            "split {parent:#x} {color} {key} {} -> {c:#x}",
            cfg(config)
        ));
        (NCCL_SUCCESS, c)
    }
    fn group_start(&self) -> ncclResult_t {
        self.log("group_start".into());
        NCCL_SUCCESS
    }
    fn group_end(&self) -> ncclResult_t {
        self.log("group_end".into());
        NCCL_SUCCESS
    }
    fn has_suspend(&self) -> bool {
        !self.no_suspend
    }
    fn suspend(&self, comm: RealComm) -> ncclResult_t {
        self.log(format!("suspend {comm:#x}"));
        NCCL_SUCCESS
    }
    fn resume(&self, comm: RealComm) -> ncclResult_t {
        self.log(format!("resume {comm:#x}"));
        NCCL_SUCCESS
    }
    fn destroy(&self, comm: RealComm) -> ncclResult_t {
        self.log(format!("destroy {comm:#x}"));
        NCCL_SUCCESS
    }
    fn register(&self, comm: RealComm, ptr: usize, size: usize) -> (ncclResult_t, usize) {
        self.log(format!("register {comm:#x} {ptr:#x} {size}"));
        (NCCL_SUCCESS, comm + 1)
    }
    fn deregister(&self, comm: RealComm, handle: usize) -> ncclResult_t {
        self.log(format!("deregister {comm:#x} {handle:#x}"));
        NCCL_SUCCESS
    }
    fn rank_count(&self, _comm: RealComm) -> Option<(i32, i32)> {
        Some((1, 2))
    }
    fn async_error(&self, comm: RealComm) -> ncclResult_t {
        let mut n = self.in_progress.lock().unwrap();
        self.log(format!("async {comm:#x}"));
        if *n > 0 {
            *n -= 1;
            return NCCL_IN_PROGRESS;
        }
        NCCL_SUCCESS
    }
    fn cu_device(&self, _comm: RealComm) -> Result<i32, ncclResult_t> {
        Ok(0)
    }
    fn current_device(&self) -> Option<i32> {
        None
    }
    fn use_device(&self, dev: i32) -> Result<(), String> {
        self.log(format!("device {dev}"));
        Ok(())
    }
    fn stream_done(&self, stream: usize, _dev: i32) -> Result<bool, String> {
        Ok(!self.pending.lock().unwrap().contains(&stream))
    }
    fn last_error(&self, _comm: RealComm) -> Option<String> {
        self.init_error.map(str::to_string)
    }
}

/// A job's communicators as one rank holds them: a root (rank 1 of 2 on device 1, a config
/// with blocking = 0), a split of it (color 3), a NOCOLOR split call, a registered buffer.
struct Job {
    root: &'static CommObj,
    child: &'static CommObj,
    buf: *mut std::ffi::c_void,
}

/// A Failed reply's (comm, rank, message).
fn failure(m: LayerMsg) -> (Option<u64>, Option<i32>, String) {
    match m {
        LayerMsg::Failed {
            comm,
            rank,
            message,
        } => (comm, rank, message),
        other => panic!("expected Failed, got {other:?}"),
    }
}

fn obj(c: ncclComm_t) -> &'static CommObj {
    // SAFETY: handles the layer under test made, never freed in these tests.
    unsafe { &*(c as *const CommObj) }
}

fn job(l: &Layer<Fake>) -> Job {
    let mut c = ncclConfig_t::initializer();
    c.blocking = 0;
    let config = unsafe { ConfigCopy::copy(&c) };
    let root = obj(l.adopt(NewComm {
        key: "k0".into(),
        rank: 1,
        nranks: 2,
        dev: 1,
        config,
        origin: Origin::Root,
        real: 0x10,
        group: None,
    }));
    let child = obj(l.adopt(NewComm {
        key: "k0/3".into(),
        rank: 0,
        nranks: 1,
        dev: 1,
        config: None,
        origin: Origin::Split {
            parent: root.id,
            color: 3,
            key: 0,
        },
        real: 0x20,
        group: None,
    }));
    l.adopt_nocolor(root, 5, None);
    let buf = l.add_buffer(root, 0xbeef, 4096, 0x11);
    Job { root, child, buf }
}

/// Both rounds of a quiesce of `l` alone: its own counts are the targets.
fn quiesce(l: &Layer<Fake>, within: Duration) -> LayerMsg {
    match l.quiesce(within) {
        LayerMsg::Holding { issued } => l.drain(issued, within),
        other => other,
    }
}

/// A rank one collective behind its peer on the root and two on the split: the drain lets
/// exactly those through, holds the next one and lets questions pass; a target the application
/// never reaches fails naming the communicator and rank, and lets the calls go.
#[test]
fn a_rank_behind_its_peers_catches_up_before_the_hold() {
    let l = Arc::new(Layer::new(Fake::default()));
    let j = job(&l);
    drop(l.enter("ncclAllReduce", Some(j.root), Some(1)));
    drop(l.enter("ncclSend", Some(j.root), Some(1)));
    assert_eq!(
        l.quiesce(Duration::from_secs(1)),
        LayerMsg::Holding {
            issued: vec![(j.root.id, 1), (j.child.id, 0)]
        }
    );
    let (root, child) = (j.root.id, j.child.id);
    let app = {
        let (l, root, child) = (l.clone(), j.root, j.child);
        std::thread::spawn(move || {
            for c in [root, child, child] {
                drop(l.enter("ncclAllReduce", Some(c), Some(2)));
            }
            drop(l.enter("ncclCommCount", Some(root), None));
            // Beyond every target: held until Go.
            drop(l.enter("ncclAllReduce", Some(child), Some(2)));
            l.gate.issued(child.id)
        })
    };
    assert_eq!(
        l.drain(vec![(root, 2), (child, 2)], Duration::from_secs(5)),
        LayerMsg::Quiesced {
            comms: vec![root, child]
        }
    );
    assert_eq!((l.gate.issued(root), l.gate.issued(child)), (2, 2));
    std::thread::sleep(Duration::from_millis(50));
    assert!(!app.is_finished(), "a call beyond its target passed");
    l.go();
    assert_eq!(app.join().unwrap(), 3);

    // The peer is ahead by more than the application will ever call.
    assert!(matches!(
        l.quiesce(Duration::from_secs(1)),
        LayerMsg::Holding { .. }
    ));
    let (comm, rank, message) = failure(l.drain(vec![(root, 5)], Duration::from_millis(50)));
    assert_eq!((comm, rank), (Some(root), Some(1)));
    assert!(message.contains("2 of the 5 collectives"), "{message}");
    assert!(!l.gate.is_held(), "held calls not released after Failed");
    assert!(matches!(
        l.drain(vec![], Duration::from_millis(50)),
        LayerMsg::Failed { .. }
    ));
}

#[test]
fn release_resume_and_rebuild_keep_handles_and_replay_the_record() {
    let l = Layer::new(Fake::default());
    let j = job(&l);
    assert!(
        matches!(l.release(), LayerMsg::Failed { .. }),
        "Release without Quiesce"
    );

    assert_eq!(
        quiesce(&l, Duration::from_secs(1)),
        LayerMsg::Quiesced {
            comms: vec![j.root.id, j.child.id]
        }
    );
    assert_eq!(l.release(), LayerMsg::Released { suspended: true });
    assert_eq!(
        l.backend.take().join(", "),
        "device 1, deregister 0x10 0x11, device 1, suspend 0x20, device 1, suspend 0x10"
    );
    // A second Release suspends nothing twice.
    assert_eq!(l.release(), LayerMsg::Released { suspended: true });
    assert!(l.backend.take().is_empty());
    assert_eq!(l.resume(), LayerMsg::Rebuilt);
    assert_eq!(
        l.backend.take().join(", "),
        "device 1, resume 0x10, device 1, resume 0x20, device 1, register 0x10 0xbeef 4096"
    );

    // Rebuild: a missing id names the root's rank; with it, the root is made again with the
    // same rank, size, device and config on the fresh id, then both split calls on it.
    assert_eq!(l.release(), LayerMsg::Released { suspended: true });
    l.backend.take();
    let (comm, rank, message) = failure(l.rebuild(vec![]));
    assert_eq!((comm, rank), (Some(j.root.id), Some(1)));
    assert!(message.contains("no unique id for key k0"), "{message}");
    l.backend.take();
    let id = hex::encode([0x5au8; NCCL_UNIQUE_ID_BYTES]);
    assert_eq!(l.rebuild(vec![("k0".into(), id)]), LayerMsg::Rebuilt);
    let log = l.backend.take();
    let root_real = j.root.real();
    assert_eq!(
        log,
        [
            "device 1".to_string(),
            format!("init 2 1 id=5a blocking=0 -> {root_real:#x}"),
            "device 1".into(),
            format!("split {root_real:#x} 3 0 none -> {:#x}", j.child.real()),
            "device 1".into(),
            format!("split {root_real:#x} -1 5 none -> 0x0"),
            "device 1".into(),
            format!("register {root_real:#x} 0xbeef 4096"),
        ]
    );
    assert!(![0, 0x10].contains(&root_real));
    assert!(![0, 0x20].contains(&j.child.real()));
    let b = unsafe { l.buffer(j.buf) }.unwrap();
    assert_eq!(b.real(), root_real + 1);
    assert!(matches!(
        l.rebuild(vec![("k0".into(), "00".into())]),
        LayerMsg::Failed { .. }
    ));
    l.go();
    assert!(!l.gate.is_held());
}

/// A layer over `fake` holding [`job`] (`gone_root`: the root destroyed by the application),
/// quiesced and released.
fn released(fake: Fake, gone_root: bool) -> (Layer<Fake>, Job) {
    let l = Layer::new(fake);
    let j = job(&l);
    if gone_root {
        l.gone(j.root, true);
    }
    assert!(matches!(
        quiesce(&l, Duration::from_secs(1)),
        LayerMsg::Quiesced { .. }
    ));
    assert_eq!(l.release(), LayerMsg::Released { suspended: true });
    l.backend.take();
    (l, j)
}

/// Rebuilds key k0 on an id of `byte`s; what the backend was asked.
fn rebuilt(l: &Layer<Fake>, byte: u8) -> Vec<String> {
    let id = hex::encode([byte; NCCL_UNIQUE_ID_BYTES]);
    assert_eq!(l.rebuild(vec![("k0".into(), id)]), LayerMsg::Rebuilt);
    l.backend.take()
}

#[test]
fn a_nonblocking_rebuild_waits_until_the_communicator_is_ready() {
    let fake = Fake {
        nonblocking: true,
        ..Fake::default()
    };
    let (l, j) = released(fake, false);
    let log = rebuilt(&l, 2);
    let root = format!("async {:#x}", j.root.real());
    // Three polls say ncclInProgress, the fourth ncclSuccess; then the split goes on.
    assert_eq!(log.iter().filter(|l| **l == root).count(), 4, "{log:?}");
    assert!(
        log[6] == "device 1" && log[7].starts_with("split "),
        "{log:?}"
    );
}

#[test]
fn a_failed_rebuild_says_what_nccl_said() {
    let fake = Fake {
        init_error: Some("cuDeviceGetUuid failed: CUresult 101"),
        ..Fake::default()
    };
    let (l, _) = released(fake, false);
    let id = hex::encode([4u8; NCCL_UNIQUE_ID_BYTES]);
    let (_, rank, message) = failure(l.rebuild(vec![("k0".into(), id)]));
    assert_eq!(rank, Some(1));
    assert_eq!(
        message,
        "ncclCommInitRankConfig: ncclUnhandledCudaError (1): cuDeviceGetUuid failed: CUresult 101"
    );
}

#[test]
fn without_suspend_release_destroys_and_resume_refuses() {
    let l = Layer::new(Fake {
        no_suspend: true,
        ..Fake::default()
    });
    let j = job(&l);
    quiesce(&l, Duration::from_secs(1));
    // Destroyed, not suspended: the shim must rebuild even on the same node.
    assert_eq!(l.release(), LayerMsg::Released { suspended: false });
    assert!(l.backend.take().contains(&"destroy 0x10".to_string()));
    // A second Release frees nothing more and says the same.
    assert_eq!(l.release(), LayerMsg::Released { suspended: false });
    assert!(!l.backend.take().iter().any(|c| c.starts_with("destroy")));
    assert_eq!(j.root.real(), 0);
    let (_, _, message) = failure(l.resume());
    assert!(message.contains("only a Rebuild"), "{message}");
}

#[test]
fn release_destroys_where_asked_although_suspend_is_there() {
    let mut l = Layer::new(Fake::default());
    l.destroy_at_release = true;
    let j = job(&l);
    quiesce(&l, Duration::from_secs(1));
    assert_eq!(l.release(), LayerMsg::Released { suspended: false });
    let log = l.backend.take();
    assert!(log.contains(&"destroy 0x10".to_string()), "{log:?}");
    assert!(!log.iter().any(|c| c.starts_with("suspend")), "{log:?}");
    assert_eq!((j.root.real(), j.child.real()), (0, 0));
    assert!(rebuilt(&l, 3)
        .iter()
        .any(|c| c.starts_with("init 2 1 id=03")));
    assert_ne!(j.root.real(), 0);
}

#[test]
fn a_destroyed_parent_is_made_again_for_its_live_split_then_destroyed() {
    let (l, j) = released(Fake::default(), true);
    let log = rebuilt(&l, 1);
    assert!(log[1].starts_with("init 2 1 id=01"), "{log:?}");
    assert!(log[3].starts_with("split "), "{log:?}");
    let last = log.last().unwrap();
    assert!(last.starts_with("destroy "), "{log:?}");
    assert_eq!(j.root.real(), 0);
    assert_ne!(j.child.real(), 0);
}

#[test]
fn quiesce_fails_naming_the_rank_whose_stream_is_stuck_and_lets_calls_go() {
    let l = Arc::new(Layer::new(Fake::default()));
    let j = job(&l);
    drop(l.enter("ncclAllReduce", Some(j.child), Some(0x77)));
    drop(l.enter("ncclAllReduce", Some(j.root), Some(0)));
    l.backend.pending.lock().unwrap().insert(0x77);
    let (comm, rank, message) = failure(quiesce(&l, Duration::from_millis(50)));
    assert_eq!((comm, rank), (Some(j.child.id), Some(0)));
    assert!(message.contains("stream 0x77"), "{message}");
    assert!(!l.gate.is_held(), "held calls not released after Failed");

    // A call in flight names its communicator.
    let t = l.enter("ncclBroadcast", Some(j.root), Some(0));
    let (comm, rank, message) = failure(l.quiesce(Duration::from_millis(30)));
    assert_eq!((comm, rank), (Some(j.root.id), Some(1)));
    assert!(message.starts_with("ncclBroadcast on"), "{message}");
    drop(t);

    l.backend.pending.lock().unwrap().clear();
    assert!(matches!(
        quiesce(&l, Duration::from_millis(50)),
        LayerMsg::Quiesced { .. }
    ));
    let passed = Arc::new(AtomicBool::new(false));
    let h = {
        let (l, passed) = (l.clone(), passed.clone());
        let root = j.root.id;
        std::thread::spawn(move || {
            let _ = root;
            let _t = l.enter("ncclAllReduce", None, None);
            passed.store(true, Ordering::SeqCst);
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    assert!(!passed.load(Ordering::SeqCst));
    l.go();
    h.join().unwrap();
    assert!(passed.load(Ordering::SeqCst));
}

/// Taken by the tests that count or open sockets (they run on parallel threads).
static SOCKETS: Mutex<()> = Mutex::new(());

/// The sockets this process has open.
fn sockets() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l.to_string_lossy().starts_with("socket:"))
        .count()
}

/// A shim that accepts and never answers (or a connection left from before a restore): the
/// layer gives up within its bound, and the next try finds a shim that answers.
#[test]
fn a_connection_without_welcome_is_dropped_and_tried_again() {
    let _one = SOCKETS.lock().unwrap_or_else(|e| e.into_inner());
    let l = Layer::new(Fake::default());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nccl.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let mut token = None;
    let t0 = std::time::Instant::now();
    let silent = std::thread::spawn(move || {
        let (c, _) = listener.accept().unwrap();
        let mut c = Connection::new(c);
        let hello = recv(&mut c);
        // The layer's end is closed after its bound: this end sees it.
        let end = c.recv::<ShimMsg>(Some(Duration::from_secs(5)));
        (listener, hello, end.map(|_| ()).map_err(|e| e.to_string()))
    });
    let e = crate::control::session_within(&l, &path, &mut token, Duration::from_millis(200))
        .unwrap_err();
    assert!(
        e.to_string().contains("no control message within 200 ms"),
        "{e}"
    );
    assert!(t0.elapsed() < Duration::from_secs(3));
    let (listener, hello, end) = silent.join().unwrap();
    assert!(matches!(hello, LayerMsg::Hello { resumed: None, .. }));
    assert!(end.unwrap_err().contains("closed"));
    assert_eq!(token, None);
    // The next session goes as usual.
    let th = std::thread::spawn(move || {
        let mut c = Connection::new(listener.accept().unwrap().0);
        recv(&mut c);
        c.send(&ShimMsg::Welcome { token: "t".into() }, None)
            .unwrap();
        c.send(&ShimMsg::Disconnect, None).unwrap();
    });
    crate::control::session(&l, &path, &mut token).unwrap();
    th.join().unwrap();
    assert_eq!(token.as_deref(), Some("t"));
}

fn recv(c: &mut Connection) -> LayerMsg {
    c.recv(Some(Duration::from_secs(5))).unwrap()
}

#[test]
fn protocol_over_the_socket_with_a_disconnect_and_a_resumed_hello() {
    let _one = SOCKETS.lock().unwrap_or_else(|e| e.into_inner());
    let l: &'static Layer<Fake> = Box::leak(Box::new(Layer::new(Fake::default())));
    let j = job(l);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nccl.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let before = sockets();
    let p = path.clone();
    let (again, go_on) = std::sync::mpsc::channel::<()>();
    let th = std::thread::spawn(move || {
        let mut token = None;
        let first = crate::control::session(l, &p, &mut token);
        // As the control thread pauses before it connects again.
        let _ = go_on.recv();
        let second = crate::control::session(l, &p, &mut token);
        (first.is_ok(), second.map_err(|e| e.to_string()), token)
    });
    let comm_msgs = |c: &mut Connection| {
        let a = recv(c);
        let b = recv(c);
        assert_eq!(
            a,
            LayerMsg::Comm {
                id: j.root.id,
                key: "k0".into(),
                rank: 1,
                nranks: 2,
                cuda_dev: 1,
                split: None
            }
        );
        assert_eq!(
            b,
            LayerMsg::Comm {
                id: j.child.id,
                key: "k0/3".into(),
                rank: 0,
                nranks: 1,
                cuda_dev: 1,
                split: Some(Split {
                    parent: j.root.id,
                    color: 3,
                    key: 0
                })
            }
        );
    };

    let mut c = Connection::new(listener.accept().unwrap().0);
    assert_eq!(
        recv(&mut c),
        LayerMsg::Hello {
            version: 1,
            pid: std::process::id() as i32,
            nccl_version: 23206,
            resumed: None
        }
    );
    c.send(
        &ShimMsg::Welcome {
            token: "t-1".into(),
        },
        None,
    )
    .unwrap();
    comm_msgs(&mut c);
    c.send(&ShimMsg::Quiesce { deadline_ms: 1000 }, None)
        .unwrap();
    assert_eq!(
        recv(&mut c),
        LayerMsg::Holding {
            issued: vec![(j.root.id, 0), (j.child.id, 0)]
        }
    );
    c.send(
        &ShimMsg::Drain {
            targets: vec![(j.root.id, 0)],
            deadline_ms: 1000,
        },
        None,
    )
    .unwrap();
    assert_eq!(
        recv(&mut c),
        LayerMsg::Quiesced {
            comms: vec![j.root.id, j.child.id]
        }
    );
    c.send(&ShimMsg::NewUniqueId { key: "k0".into() }, None)
        .unwrap();
    assert_eq!(
        recv(&mut c),
        LayerMsg::UniqueId {
            key: "k0".into(),
            id: "ab".repeat(128)
        }
    );
    c.send(&ShimMsg::Disconnect, None).unwrap();
    assert!(matches!(
        c.recv::<LayerMsg>(Some(Duration::from_secs(5))),
        Err(nccl_control::ControlError::Closed)
    ));
    // Once the shim sees the end, the layer holds no descriptor of the connection (only the
    // listener and the shim's end are left): nothing for a checkpoint to find.
    assert_eq!(sockets(), before + 1, "the layer still holds its end");
    again.send(()).unwrap();

    // Reconnected: the session's token comes back, and the communicators are told again.
    let mut c = Connection::new(listener.accept().unwrap().0);
    match recv(&mut c) {
        LayerMsg::Hello { resumed, .. } => assert_eq!(resumed.as_deref(), Some("t-1")),
        other => panic!("{other:?}"),
    }
    c.send(
        &ShimMsg::Welcome {
            token: "t-2".into(),
        },
        None,
    )
    .unwrap();
    comm_msgs(&mut c);
    l.gone(j.child, true);
    assert_eq!(recv(&mut c), LayerMsg::CommGone { id: j.child.id });
    c.send(&ShimMsg::Go, None).unwrap();
    // A frame over the limit ends the session.
    use std::io::Write as _;
    let mut s = c.stream();
    s.write_all(&(1u32 << 20).to_be_bytes()).unwrap();
    let (first, second, token) = th.join().unwrap();
    assert!(first);
    let e = second.unwrap_err();
    assert!(e.contains("refused"), "{e}");
    assert_eq!(token.as_deref(), Some("t-2"));
    assert!(!l.gate.is_held(), "Go did not release");
}
