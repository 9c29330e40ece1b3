//! The control server and steps against clients speaking the protocol (`nccl_control`) from
//! threads of this process: authentication, hostile frames, the bounds naming the rank, and
//! the order of a rebuild.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use image_format::manifest::{NcclComm, NcclProcess, NcclRecord};
use nccl_control::{Connection, ControlError, LayerMsg, ShimMsg};

use super::session::{MAX_COMMS, MAX_ENDED, MAX_KEY, MAX_UNASKED};
use super::*;

const WAIT: Duration = Duration::from_secs(10);

/// Every peer is a process of the container, with `ns` as its pid in it (or refused).
struct Members(std::result::Result<i32, String>);

impl Membership for Members {
    fn check(&self, _init: i32, _pid: i32) -> std::result::Result<i32, String> {
        self.0.clone()
    }
}

fn me() -> i32 {
    std::process::id() as i32
}

fn server(dir: &Path, timeout: Duration, members: Members) -> Arc<ContainerComms> {
    let c = ContainerComms::open(
        "c1",
        "c1",
        &dir.join("control.sock"),
        "layerhash",
        timeout,
        Box::new(members),
    )
    .unwrap();
    c.started(1);
    c
}

fn ours() -> Members {
    Members(Ok(me()))
}

/// A server (bound `timeout`) whose peers are all ours, in a fresh directory: the directory,
/// the control socket's path and the server.
fn our_server(timeout: Duration) -> (tempfile::TempDir, PathBuf, Arc<ContainerComms>) {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("control.sock");
    let c = server(d.path(), timeout, ours());
    (d, path, c)
}

/// A client as the layer is one: Hello, Welcome, then messages.
struct Client {
    conn: Connection,
    token: String,
}

impl Client {
    fn try_connect(
        path: &Path,
        pid: i32,
        resumed: Option<String>,
    ) -> std::result::Result<Client, ControlError> {
        let mut conn = Connection::connect(path)?;
        conn.send(
            &LayerMsg::Hello {
                version: nccl_control::VERSION,
                pid,
                nccl_version: 23206,
                resumed,
            },
            Some(WAIT),
        )?;
        match conn.recv::<ShimMsg>(Some(WAIT))? {
            ShimMsg::Welcome { token } => Ok(Client { conn, token }),
            other => panic!("no Welcome: {other:?}"),
        }
    }

    fn connect(path: &Path, resumed: Option<String>) -> Client {
        Client::try_connect(path, me(), resumed).expect("connect")
    }

    /// Connects again (every 20 ms, as the layer does every 50) until the listener is back.
    fn reconnect(path: &Path, token: &str) -> Client {
        let until = Instant::now() + WAIT;
        loop {
            match Client::try_connect(path, me(), Some(token.to_string())) {
                Ok(c) => return c,
                Err(_) if Instant::now() < until => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => panic!("reconnect: {e}"),
            }
        }
    }

    fn comm(&mut self, id: u64, key: &str, rank: i32, nranks: i32) {
        self.send(LayerMsg::Comm {
            id,
            key: key.into(),
            rank,
            nranks,
            cuda_dev: rank,
            split: None,
        });
    }

    fn send(&mut self, m: LayerMsg) {
        self.conn.send(&m, Some(WAIT)).unwrap();
    }

    fn recv(&mut self) -> ShimMsg {
        self.conn.recv(Some(WAIT)).unwrap()
    }
}

/// The layer's side of a whole checkpoint cycle, in a thread: quiesced, released (`suspended`),
/// disconnected, back with its token; then what it is asked, answered, until Go. Each message
/// it gets after coming back is sent on `seen` (with `rank`).
fn layer_cycle(
    path: std::path::PathBuf,
    rank: i32,
    suspended: bool,
    seen: Sender<(i32, ShimMsg)>,
    before_reply: impl Fn(&ShimMsg) + Send + 'static,
) -> std::thread::JoinHandle<()> {
    let mut c = Client::connect(&path, None);
    c.comm(1, "rootkey", rank, 2);
    std::thread::spawn(move || {
        assert!(matches!(c.recv(), ShimMsg::Quiesce { .. }));
        // Rank 1 is one collective ahead: both drain to its count.
        c.send(LayerMsg::Holding {
            issued: vec![(1, 5 + rank as u64)],
        });
        match c.recv() {
            ShimMsg::Drain { targets, .. } => assert_eq!(targets, vec![(1, 6)]),
            other => panic!("no Drain: {other:?}"),
        }
        c.send(LayerMsg::Quiesced { comms: vec![1] });
        assert_eq!(c.recv(), ShimMsg::Release);
        c.send(LayerMsg::Released { suspended });
        assert_eq!(c.recv(), ShimMsg::Disconnect);
        let token = c.token.clone();
        drop(c);
        let mut c = Client::reconnect(&path, &token);
        c.comm(1, "rootkey", rank, 2);
        loop {
            let m = c.recv();
            seen.send((rank, m.clone())).unwrap();
            before_reply(&m);
            match m {
                ShimMsg::Go => return,
                ShimMsg::NewUniqueId { key } => c.send(LayerMsg::UniqueId {
                    key,
                    id: "ab".repeat(128),
                }),
                ShimMsg::Rebuild { .. } | ShimMsg::Resume => c.send(LayerMsg::Rebuilt),
                other => panic!("unexpected {other:?}"),
            }
        }
    })
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn sessions(c: &ContainerComms) -> usize {
    c.server
        .shared
        .lock()
        .sessions
        .values()
        .filter(|s| s.closed.is_none())
        .count()
}

/// Whether every session of `c` (ended ones too) passes `f`.
fn sessions_all(c: &ContainerComms, f: impl FnMut(&super::session::Session) -> bool) -> bool {
    c.server.shared.lock().sessions.values().all(f)
}

/// Whether a session of `c` (ended ones too) passes `f`.
fn sessions_any(c: &ContainerComms, f: impl FnMut(&super::session::Session) -> bool) -> bool {
    c.server.shared.lock().sessions.values().any(f)
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let until = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < until, "{what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_process_outside_the_container_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let c = server(
        d.path(),
        WAIT,
        Members(Err("pid 1 is not a process of the container".into())),
    );
    // Refused before its Hello is read: the Hello's write may fail too.
    let r = Client::try_connect(&d.path().join("control.sock"), me(), None);
    assert!(r.is_err(), "no Welcome for a stranger");
    assert_eq!(sessions(&c), 0);
    c.close();
}

#[test]
fn a_hello_with_another_pid_than_the_peers_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let c = server(d.path(), WAIT, ours());
    let path = d.path().join("control.sock");
    assert!(Client::try_connect(&path, me() + 1, None).is_err());
    assert_eq!(sessions(&c), 0);
    // Its own pid: admitted.
    let _ok = Client::connect(&path, None);
    wait_for("one session", || sessions(&c) == 1);
    assert!(c.knows(me()));
    c.close();
}

#[test]
fn a_token_presented_by_another_process_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let c = server(d.path(), WAIT, ours());
    c.expect(&NcclRecord {
        layer_blake3: "layerhash".into(),
        processes: vec![NcclProcess {
            pid: me() + 5,
            token: "t0".into(),
            ..Default::default()
        }],
        cut: None,
    });
    let path = d.path().join("control.sock");
    assert!(Client::try_connect(&path, me(), Some("t0".into())).is_err());
    assert_eq!(sessions(&c), 0);
    c.close();
}

#[test]
fn hostile_frames_close_the_connection_and_the_server_serves_on() {
    let (_d, path, c) = our_server(WAIT);
    let closed = |bytes: &[u8]| {
        let mut s = UnixStream::connect(&path).unwrap();
        let _ = s.write_all(bytes);
        let mut conn = Connection::new(s);
        let r = conn.recv::<ShimMsg>(Some(WAIT));
        assert!(
            matches!(r, Err(ControlError::Closed) | Err(ControlError::Io { .. })),
            "{r:?}"
        );
    };
    // A frame over the limit: refused from its length, its body never read.
    closed(&((nccl_control::MAX_FRAME as u32 + 1).to_be_bytes()));
    closed(&(u32::MAX.to_be_bytes()));
    // Garbage.
    let mut garbage = 9u32.to_be_bytes().to_vec();
    garbage.extend_from_slice(b"\xff{not js");
    closed(&garbage);
    // Anything but a Hello first.
    let mut q = Vec::new();
    nccl_control::write_frame(&mut q, &LayerMsg::Quiesced { comms: vec![] }).unwrap();
    closed(&q);
    // A frame cut short, then silence: closed within the Hello bound.
    let t = Instant::now();
    closed(&[0, 0, 0, 50, b'{']);
    assert!(t.elapsed() < HELLO_TIMEOUT + Duration::from_secs(3));
    assert_eq!(sessions(&c), 0);
    // A well-behaved one is still admitted; a garbage frame after Hello ends its session.
    let ok = Client::connect(&path, None);
    wait_for("one session", || sessions(&c) == 1);
    ok.conn
        .stream()
        .try_clone()
        .unwrap()
        .write_all(&garbage)
        .unwrap();
    wait_for("its session closed", || sessions(&c) == 0);
    c.close();
}

#[test]
fn connections_beyond_the_bound_are_closed() {
    let (_d, path, c) = our_server(WAIT);
    let mut held = Vec::new();
    for _ in 0..MAX_CONNECTIONS + 20 {
        if let Ok(s) = UnixStream::connect(&path) {
            held.push(s);
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    assert!(c.server.shared.lock().connections <= MAX_CONNECTIONS);
    drop(held);
    wait_for("connections ended", || {
        c.server.shared.lock().connections == 0
    });
    c.close();
}

#[test]
fn a_rank_that_does_not_quiesce_fails_the_checkpoint_naming_it_and_the_others_go_on() {
    let (_d, path, c) = our_server(Duration::from_millis(300));
    let mut good = Client::connect(&path, None);
    good.comm(1, "k", 0, 4);
    let mut stuck = Client::connect(&path, None);
    stuck.comm(1, "k", 3, 4);
    wait_for("comms announced", || {
        sessions_all(&c, |s| !s.comms.is_empty())
    });
    let answer = std::thread::spawn(move || {
        assert!(matches!(good.recv(), ShimMsg::Quiesce { deadline_ms } if deadline_ms <= 300));
        good.send(LayerMsg::Holding {
            issued: vec![(1, 3)],
        });
        assert_eq!(good.recv(), ShimMsg::Go);
    });
    let t = Instant::now();
    let e = rt()
        .block_on(c.quiesce(Vec::new()))
        .unwrap_err()
        .to_string();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let want = format!(
        "checkpoint failed at step nccl-quiesce: pid {} (rank 3 of 4, pid {} in the container) did not quiesce within 300ms",
        me(),
        me()
    );
    assert!(e.starts_with(&want), "{e}");
    answer.join().unwrap();
    // The listener is back: the container runs on as before.
    assert!(path.exists());
    drop(stuck);
    c.close();
}

#[test]
fn a_layer_failure_names_the_rank_it_gives() {
    let (_d, path, c) = our_server(WAIT);
    let mut a = Client::connect(&path, None);
    a.comm(1, "k", 0, 2);
    a.comm(2, "k/1", 1, 3);
    wait_for("comms announced", || {
        sessions_any(&c, |s| s.comms.len() == 2)
    });
    let t = std::thread::spawn(move || {
        assert!(matches!(a.recv(), ShimMsg::Quiesce { .. }));
        a.send(LayerMsg::Failed {
            comm: Some(2),
            rank: Some(1),
            message: "ncclAllReduce on communicator 2 (rank 1) still in the layer".into(),
        });
        assert_eq!(a.recv(), ShimMsg::Go);
    });
    let e = rt()
        .block_on(c.quiesce(Vec::new()))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("(rank 1 of 3, pid") && e.contains("still in the layer"),
        "{e}"
    );
    t.join().unwrap();
    c.close();
}

/// A rebuild: NewUniqueId to the rank-0 holder only; Rebuild to every rank before any Rebuilt
/// is awaited (rank 0 answers only once rank 1 has its Rebuild: a server that awaited rank 0
/// first would time out); Go to all after.
#[test]
fn a_rebuild_asks_rank_0_for_the_id_and_sends_rebuild_to_all_before_awaiting() {
    let (_d, path, c) = our_server(Duration::from_secs(3));
    let (seen, log) = channel();
    let (rank1_rebuild, wait_rank1) = channel::<()>();
    let wait_rank1 = std::sync::Mutex::new(wait_rank1);
    let r0 = layer_cycle(path.clone(), 0, false, seen.clone(), move |m| {
        if matches!(m, ShimMsg::Rebuild { .. }) {
            let got = wait_rank1.lock().unwrap().recv_timeout(WAIT);
            assert!(got.is_ok(), "rank 1 never got its Rebuild");
        }
    });
    let r1 = layer_cycle(path.clone(), 1, false, seen, move |m| {
        if matches!(m, ShimMsg::Rebuild { .. }) {
            let _ = rank1_rebuild.send(());
        }
    });
    wait_for("comms announced", || {
        sessions_all(&c, |s| !s.comms.is_empty()) && sessions(&c) == 2
    });
    rt().block_on(c.quiesce(Vec::new())).unwrap();
    assert!(
        !path.exists(),
        "no listener while the devices are checkpointed"
    );
    let record = c.record().unwrap();
    assert_eq!(record.processes.len(), 2);
    assert!(record.processes.iter().all(|p| !p.suspended));
    assert_eq!(record.processes[1].comms[0].rank, 1);
    rt().block_on(c.resume("resume")).unwrap();
    r0.join().unwrap();
    r1.join().unwrap();
    let log: Vec<(i32, ShimMsg)> = log.try_iter().collect();
    let of = |r: i32| -> Vec<ShimMsg> {
        log.iter()
            .filter(|(x, _)| *x == r)
            .map(|(_, m)| m.clone())
            .collect()
    };
    let id = "ab".repeat(128);
    assert_eq!(
        of(0),
        vec![
            ShimMsg::NewUniqueId {
                key: "rootkey".into()
            },
            ShimMsg::Rebuild {
                ids: vec![("rootkey".into(), id.clone())]
            },
            ShimMsg::Go
        ]
    );
    assert_eq!(
        of(1),
        vec![
            ShimMsg::Rebuild {
                ids: vec![("rootkey".into(), id)]
            },
            ShimMsg::Go
        ]
    );
    let steps: Vec<&str> = c.timings().iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, vec!["nccl-quiesce", "nccl-release", "nccl-rebuild"]);
    c.close();
}

#[test]
fn suspended_communicators_are_resumed_in_place() {
    let (_d, path, c) = our_server(Duration::from_secs(3));
    let (seen, log) = channel();
    let r0 = layer_cycle(path.clone(), 0, true, seen.clone(), |_| {});
    let r1 = layer_cycle(path.clone(), 1, true, seen, |_| {});
    wait_for("two sessions", || sessions(&c) == 2);
    rt().block_on(c.quiesce(Vec::new())).unwrap();
    rt().block_on(c.resume("resume")).unwrap();
    r0.join().unwrap();
    r1.join().unwrap();
    let msgs: Vec<ShimMsg> = log.try_iter().map(|(_, m)| m).collect();
    assert_eq!(msgs.iter().filter(|m| **m == ShimMsg::Resume).count(), 2);
    assert_eq!(msgs.iter().filter(|m| **m == ShimMsg::Go).count(), 2);
    assert!(!msgs.iter().any(|m| matches!(m, ShimMsg::Rebuild { .. })));
    c.close();
}

#[test]
fn a_process_that_does_not_come_back_fails_the_resume_naming_it() {
    let (_d, path, c) = our_server(Duration::from_millis(300));
    let mut a = Client::connect(&path, None);
    a.comm(1, "k", 2, 4);
    wait_for("comm", || sessions_any(&c, |s| !s.comms.is_empty()));
    let t = std::thread::spawn(move || {
        assert!(matches!(a.recv(), ShimMsg::Quiesce { .. }));
        a.send(LayerMsg::Holding {
            issued: vec![(1, 0)],
        });
        assert!(matches!(a.recv(), ShimMsg::Drain { .. }));
        a.send(LayerMsg::Quiesced { comms: vec![1] });
        assert_eq!(a.recv(), ShimMsg::Release);
        a.send(LayerMsg::Released { suspended: true });
        assert_eq!(a.recv(), ShimMsg::Disconnect);
    });
    rt().block_on(c.quiesce(Vec::new())).unwrap();
    t.join().unwrap();
    let e = rt().block_on(c.resume("resume")).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!(
            "resume failed at step nccl-resume: pid {} (rank 2 of 4, pid {} in the container) did not connect again within 300ms",
            me(),
            me()
        )),
        "{e}"
    );
    c.close();
}

/// After a restore: the recorded processes back with their tokens (new host pids), fresh ids
/// from rank 0, Rebuild to all, Go; the restore fails naming a process that does not answer.
#[test]
fn a_restore_rebuilds_the_recorded_processes_on_fresh_ids() {
    let (_d, path, c) = our_server(Duration::from_secs(3));
    let proc = |rank: i32, token: &str| NcclProcess {
        pid: me(),
        token: token.into(),
        nccl_version: 23206,
        suspended: true,
        comms: vec![NcclComm {
            id: 1,
            key: "root".into(),
            rank,
            nranks: 2,
            cuda_dev: rank,
            split: None,
        }],
    };
    c.expect(&NcclRecord {
        layer_blake3: "layerhash".into(),
        processes: vec![proc(0, "t0"), proc(1, "t1")],
        cut: None,
    });
    let mut threads = Vec::new();
    let (seen, log) = channel();
    for (rank, token) in [(0, "t0"), (1, "t1")] {
        let (path, seen) = (path.clone(), seen.clone());
        threads.push(std::thread::spawn(move || {
            // Announcements may come late: the rebuild goes by the record.
            let mut c = Client::connect(&path, Some(token.into()));
            loop {
                let m = c.recv();
                seen.send((rank, m.clone())).unwrap();
                match m {
                    ShimMsg::Go => return,
                    ShimMsg::NewUniqueId { key } => c.send(LayerMsg::UniqueId {
                        key,
                        id: "cd".repeat(128),
                    }),
                    ShimMsg::Rebuild { .. } => c.send(LayerMsg::Rebuilt),
                    other => panic!("{other:?}"),
                }
            }
        }));
    }
    rt().block_on(c.restored(1)).unwrap();
    for t in threads {
        t.join().unwrap();
    }
    let log: Vec<(i32, ShimMsg)> = log.try_iter().collect();
    let asked: Vec<i32> = log
        .iter()
        .filter(|(_, m)| matches!(m, ShimMsg::NewUniqueId { .. }))
        .map(|(r, _)| *r)
        .collect();
    assert_eq!(asked, vec![0]);
    assert_eq!(
        log.iter()
            .filter(|(_, m)| matches!(m, ShimMsg::Rebuild { .. }))
            .count(),
        2
    );
    c.close();
}

#[test]
fn the_layer_must_be_the_checkpoints() {
    let record = NcclRecord {
        layer_blake3: "aaaa".into(),
        ..Default::default()
    };
    let setup = |h: &str| inject::NcclSetup {
        host_dir: "/nonexistent".into(),
        socket: "/nonexistent/control.sock".into(),
        layer_blake3: h.into(),
    };
    assert!(check_layer(None, None).is_ok());
    assert!(check_layer(Some(&record), Some(&setup("aaaa"))).is_ok());
    let e = check_layer(Some(&record), Some(&setup("bbbb")))
        .unwrap_err()
        .to_string();
    assert!(e.contains("the NCCL layer on this node (bbbb) is not the one the checkpoint was taken with (aaaa)"), "{e}");
    let e = check_layer(Some(&record), None).unwrap_err().to_string();
    assert!(e.contains("gpu-ckpt.io/nccl: managed"), "{e}");
}

/// The drain targets go by key across processes (each has its own ids for its communicators);
/// a rank that cannot reach its target fails the quiesce naming it, and every other rank gets
/// Go.
#[test]
fn drain_targets_are_the_most_issued_per_key_and_a_failed_drain_names_the_rank() {
    let (_d, path, c) = our_server(Duration::from_secs(3));
    let mut a = Client::connect(&path, None);
    a.comm(1, "k", 0, 2);
    a.comm(2, "k/0", 0, 2);
    let mut b = Client::connect(&path, None);
    b.comm(7, "k", 1, 2);
    b.comm(9, "k/0", 1, 2);
    wait_for("comms announced", || {
        sessions_all(&c, |s| s.comms.len() == 2)
    });
    let ta = std::thread::spawn(move || {
        assert!(matches!(a.recv(), ShimMsg::Quiesce { .. }));
        a.send(LayerMsg::Holding {
            issued: vec![(1, 10), (2, 4)],
        });
        match a.recv() {
            ShimMsg::Drain { mut targets, .. } => {
                targets.sort();
                assert_eq!(targets, vec![(1, 11), (2, 4)]);
            }
            other => panic!("{other:?}"),
        }
        a.send(LayerMsg::Failed {
            comm: Some(1),
            rank: Some(0),
            message: "communicator 1 (rank 0): 10 of 11 collectives issued".into(),
        });
    });
    let tb = std::thread::spawn(move || {
        assert!(matches!(b.recv(), ShimMsg::Quiesce { .. }));
        b.send(LayerMsg::Holding {
            issued: vec![(7, 11), (9, 3)],
        });
        match b.recv() {
            ShimMsg::Drain { mut targets, .. } => {
                targets.sort();
                assert_eq!(targets, vec![(7, 11), (9, 4)]);
            }
            other => panic!("{other:?}"),
        }
        b.send(LayerMsg::Quiesced { comms: vec![7, 9] });
        assert_eq!(b.recv(), ShimMsg::Go);
    });
    let e = c_quiesce(&c);
    assert!(
        e.starts_with(&format!(
            "checkpoint failed at step nccl-quiesce: pid {} (rank 0 of 2, pid {} in the container) did not quiesce within 3s: communicator 1 (rank 0): 10 of 11",
            me(),
            me()
        )),
        "{e}"
    );
    ta.join().unwrap();
    tb.join().unwrap();
    c.close();
}

fn c_quiesce(c: &Arc<ContainerComms>) -> String {
    rt().block_on(c.quiesce(Vec::new()))
        .unwrap_err()
        .to_string()
}

/// Two containers of one pod with the ranks of one communicator: the first one's checkpoint
/// quiesces both (one cut) and releases its own; its resume waits; the second one's
/// checkpoint releases its ranks without a second quiesce; its resume ends the cut: Resume
/// to both, then Go to both.
#[test]
fn a_pod_wide_cut_holds_every_rank_until_every_container_is_checkpointed() {
    let d = tempfile::tempdir().unwrap();
    let mk = |id: &str| {
        let dir = d.path().join(id);
        std::fs::create_dir(&dir).unwrap();
        let c = ContainerComms::open(
            id,
            &format!("name-{id}"),
            &dir.join("control.sock"),
            "layerhash",
            Duration::from_secs(5),
            Box::new(ours()),
        )
        .unwrap();
        c.started(1);
        containers().insert(id.to_string(), c.clone());
        (c, dir.join("control.sock"))
    };
    let (c1, p1) = mk("cut-test-1");
    let (c2, p2) = mk("cut-test-2");
    let (seen, log) = channel();
    let client = |path: std::path::PathBuf, rank: i32, seen: Sender<(i32, ShimMsg)>| {
        let mut c = Client::connect(&path, None);
        c.comm(1, "podkey", rank, 2);
        std::thread::spawn(move || {
            let next = |c: &mut Client| {
                let m = c.recv();
                seen.send((rank, m.clone())).unwrap();
                m
            };
            assert!(matches!(next(&mut c), ShimMsg::Quiesce { .. }));
            c.send(LayerMsg::Holding {
                issued: vec![(1, 4)],
            });
            assert!(matches!(next(&mut c), ShimMsg::Drain { .. }));
            c.send(LayerMsg::Quiesced { comms: vec![1] });
            assert_eq!(next(&mut c), ShimMsg::Release);
            c.send(LayerMsg::Released { suspended: true });
            assert_eq!(next(&mut c), ShimMsg::Disconnect);
            let token = c.token.clone();
            drop(c);
            let mut c = Client::reconnect(&path, &token);
            assert_eq!(next(&mut c), ShimMsg::Resume);
            c.send(LayerMsg::Rebuilt);
            assert_eq!(next(&mut c), ShimMsg::Go);
        })
    };
    let t1 = client(p1, 0, seen.clone());
    let t2 = client(p2, 1, seen);
    wait_for("both announced", || {
        [&c1, &c2]
            .iter()
            .all(|c| sessions_any(c, |s| !s.comms.is_empty()))
    });
    rt().block_on(c1.quiesce(Vec::new())).unwrap();
    let r1 = c1.record().unwrap();
    let cut = r1.cut.clone().expect("a cut");
    assert_eq!(cut.containers, vec!["name-cut-test-1", "name-cut-test-2"]);
    // Both were quiesced; only the first released.
    let got: Vec<(i32, ShimMsg)> = log.try_iter().collect();
    assert_eq!(
        got.iter()
            .filter(|(_, m)| matches!(m, ShimMsg::Drain { .. }))
            .count(),
        2
    );
    assert!(got.iter().all(|(r, m)| *r == 0 || *m != ShimMsg::Release));
    rt().block_on(c1.resume("resume")).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !log.try_iter()
            .any(|(_, m)| m == ShimMsg::Go || m == ShimMsg::Resume),
        "nothing goes on before every container of the cut is checkpointed"
    );
    rt().block_on(c2.quiesce(Vec::new())).unwrap();
    assert_eq!(c2.record().unwrap().cut, Some(cut));
    rt().block_on(c2.resume("resume")).unwrap();
    t1.join().unwrap();
    t2.join().unwrap();
    let got: Vec<(i32, ShimMsg)> = log.try_iter().collect();
    for r in [0, 1] {
        assert_eq!(
            got.iter()
                .filter(|(x, m)| *x == r && *m == ShimMsg::Go)
                .count(),
            1,
            "{got:?}"
        );
    }
    for c in [&c1, &c2] {
        close(&c.server.id);
    }
}

/// A cut restored container by container: the first Start returns with its ranks held; once the
/// second is restored and every recorded rank is back, all are rebuilt on fresh ids and go.
#[test]
fn a_restored_cut_is_rebuilt_once_every_container_is_back() {
    let d = tempfile::tempdir().unwrap();
    let cut = image_format::manifest::NcclCut {
        id: "cutr".into(),
        containers: vec!["name-r1".into(), "name-r2".into()],
    };
    let mut clients = Vec::new();
    let (seen, log) = channel();
    let mut servers = Vec::new();
    for (i, id) in ["restore-cut-1", "restore-cut-2"].iter().enumerate() {
        let dir = d.path().join(id);
        std::fs::create_dir(&dir).unwrap();
        let c = ContainerComms::open(
            id,
            &format!("name-r{}", i + 1),
            &dir.join("control.sock"),
            "layerhash",
            Duration::from_secs(5),
            Box::new(ours()),
        )
        .unwrap();
        let token = format!("tok{i}");
        c.expect(&NcclRecord {
            layer_blake3: "layerhash".into(),
            processes: vec![NcclProcess {
                pid: me(),
                token: token.clone(),
                nccl_version: 23206,
                suspended: true,
                comms: vec![NcclComm {
                    id: 1,
                    key: "rk".into(),
                    rank: i as i32,
                    nranks: 2,
                    cuda_dev: 0,
                    split: None,
                }],
            }],
            cut: Some(cut.clone()),
        });
        // The restore of the first one returns at once; the rebuild waits for the second.
        rt().block_on(c.restored(1)).unwrap();
        let (path, seen) = (dir.join("control.sock"), seen.clone());
        clients.push(std::thread::spawn(move || {
            let mut c = Client::connect(&path, Some(token));
            loop {
                let m = c.recv();
                seen.send((i, m.clone())).unwrap();
                match m {
                    ShimMsg::Go => return,
                    ShimMsg::NewUniqueId { key } => c.send(LayerMsg::UniqueId {
                        key,
                        id: "ef".repeat(128),
                    }),
                    ShimMsg::Rebuild { .. } => c.send(LayerMsg::Rebuilt),
                    other => panic!("{other:?}"),
                }
            }
        }));
        if i == 0 {
            std::thread::sleep(Duration::from_millis(300));
            assert!(
                log.try_iter().next().is_none(),
                "nothing before the second is back"
            );
            // A checkpoint of another cut with the same communicators is refused meanwhile.
            let e = check_restore_cut_of("othercut");
            assert!(
                e.contains("restore every container of the pod from checkpoints of one cut"),
                "{e}"
            );
        }
        servers.push(c);
    }
    for t in clients {
        t.join().unwrap();
    }
    let got: Vec<(usize, ShimMsg)> = log.try_iter().collect();
    assert_eq!(
        got.iter()
            .filter(|(_, m)| matches!(m, ShimMsg::NewUniqueId { .. }))
            .map(|(i, _)| *i)
            .collect::<Vec<_>>(),
        vec![0]
    );
    assert_eq!(got.iter().filter(|(_, m)| *m == ShimMsg::Go).count(), 2);
    for c in servers {
        c.close();
    }
}

fn check_restore_cut_of(id: &str) -> String {
    let record = NcclRecord {
        layer_blake3: "h".into(),
        processes: vec![NcclProcess {
            pid: 7,
            token: "0".repeat(32),
            comms: vec![NcclComm {
                key: "rk/1".into(),
                rank: 1,
                nranks: 2,
                ..Default::default()
            }],
            ..Default::default()
        }],
        cut: Some(image_format::manifest::NcclCut {
            id: id.into(),
            containers: vec!["a".into(), "b".into()],
        }),
    };
    let setup = inject::NcclSetup {
        host_dir: "/nonexistent".into(),
        socket: "/nonexistent/control.sock".into(),
        layer_blake3: "h".into(),
    };
    check_layer(Some(&record), Some(&setup))
        .unwrap_err()
        .to_string()
}

fn kept(c: &ContainerComms) -> usize {
    c.server.shared.lock().sessions.len()
}

/// Waits for the one open session to end and says why it ended.
fn ended_why(c: &ContainerComms) -> String {
    let mut why = String::new();
    wait_for("the session closed", || {
        let st = c.server.shared.lock();
        match st.sessions.values().find_map(|s| s.closed.clone()) {
            Some(w) => {
                why = w;
                true
            }
            None => false,
        }
    });
    why
}

#[test]
fn connections_that_come_and_go_leave_no_session_behind() {
    let (_d, path, c) = our_server(WAIT);
    for i in 0..MAX_ENDED as u64 + 40 {
        let mut cl = Client::connect(&path, None);
        cl.comm(i, &format!("k{i}"), 0, 1);
        drop(cl);
    }
    wait_for("every connection ended", || {
        c.server.shared.lock().connections == 0
    });
    assert!(kept(&c) <= MAX_ENDED, "{} sessions kept", kept(&c));
    // The ended ones hold no descriptor and no replies.
    let st = c.server.shared.lock();
    assert!(st
        .sessions
        .values()
        .all(|s| s.closed.is_some() && s.comms.len() <= 1));
    drop(st);
    c.close();
}

#[test]
fn a_session_announcing_too_many_or_too_long_communicators_is_closed() {
    let (_d, path, c) = our_server(WAIT);
    let mut cl = Client::connect(&path, None);
    cl.comm(1, &"k".repeat(MAX_KEY + 1), 0, 1);
    assert!(ended_why(&c).contains("key of"), "closed for its key");
    drop(cl);
    wait_for("ended", || c.server.shared.lock().connections == 0);
    c.server.shared.lock().sessions.clear();

    let cl = Client::connect(&path, None);
    let msgs: Vec<u8> = (0..MAX_COMMS as u64 + 1)
        .flat_map(|i| {
            let mut b = Vec::new();
            nccl_control::write_frame(
                &mut b,
                &LayerMsg::Comm {
                    id: i,
                    key: "k".into(),
                    rank: 0,
                    nranks: 1,
                    cuda_dev: 0,
                    split: None,
                },
            )
            .unwrap();
            b
        })
        .collect();
    let _ = cl.conn.stream().try_clone().unwrap().write_all(&msgs);
    let why = ended_why(&c);
    assert!(why.contains(&format!("more than {MAX_COMMS}")), "{why}");
    drop(cl);
    c.close();
}

#[test]
fn a_session_queueing_replies_nobody_asked_for_is_closed() {
    let (_d, path, c) = our_server(WAIT);
    let mut cl = Client::connect(&path, None);
    for _ in 0..MAX_UNASKED + 1 {
        let _ = cl.conn.send(&LayerMsg::Rebuilt, Some(WAIT));
    }
    let why = ended_why(&c);
    assert!(why.contains("nobody asked for"), "{why}");
    assert!(kept(&c) <= 1);
    assert!(c
        .server
        .shared
        .lock()
        .sessions
        .values()
        .all(|s| s.replies.is_empty()));
    c.close();
}

/// Two sessions connected, with their comms announced; their ids.
fn two(
    c: &ContainerComms,
    path: &Path,
    a: &[(u64, &str, i32, i32)],
    b: &[(u64, &str, i32, i32)],
) -> (Client, Client) {
    let mut ca = Client::connect(path, None);
    for (id, k, r, n) in a {
        ca.comm(*id, k, *r, *n);
    }
    let mut cb = Client::connect(path, None);
    for (id, k, r, n) in b {
        cb.comm(*id, k, *r, *n);
    }
    let want = a.len() + b.len();
    wait_for("comms announced", || {
        c.server
            .shared
            .lock()
            .sessions
            .values()
            .map(|s| s.comms.len())
            .sum::<usize>()
            == want
    });
    (ca, cb)
}

#[test]
fn a_second_claim_of_a_rank_fails_the_quiesce_before_any_layer_is_asked() {
    let (_d, path, c) = our_server(Duration::from_secs(3));
    let (mut a, mut b) = two(&c, &path, &[(1, "k", 0, 2)], &[(5, "k", 0, 2)]);
    let e = c_quiesce(&c);
    assert!(
        e.contains("both claim rank 0 of 2 on communicator key k"),
        "{e}"
    );
    assert_eq!(
        e.matches(&format!("pid {} (rank 0 of 2", me())).count(),
        2,
        "{e}"
    );
    for cl in [&mut a, &mut b] {
        let r = cl.conn.recv::<ShimMsg>(Some(Duration::from_millis(200)));
        assert!(matches!(r, Err(ControlError::Timeout { .. })), "{r:?}");
    }
    c.close();

    // Another number of ranks, or a rank out of range: refused alike.
    let (_d, path, c) = our_server(Duration::from_secs(3));
    let _ab = two(&c, &path, &[(1, "k", 0, 2)], &[(5, "k", 1, 4)]);
    let e = c_quiesce(&c);
    assert!(e.contains("says communicator key k has"), "{e}");
    c.close();
    let (_d, path, c) = our_server(Duration::from_secs(3));
    let _ab = two(&c, &path, &[(1, "k", 0, 2)], &[(5, "k", 2, 2)]);
    let e = c_quiesce(&c);
    assert!(e.contains("claims rank 2 of 2"), "{e}");
    c.close();
}

/// Answers NewUniqueId with `id` and then the Rebuild it gets (sent on `seen`) with Rebuilt.
fn answer_rebuild(
    mut cl: Client,
    id: String,
    seen: Sender<ShimMsg>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || loop {
        let Ok(m) = cl.conn.recv::<ShimMsg>(Some(WAIT)) else {
            return;
        };
        match m {
            ShimMsg::NewUniqueId { key } => cl.send(LayerMsg::UniqueId {
                key,
                id: id.clone(),
            }),
            m @ ShimMsg::Rebuild { .. } => {
                let _ = seen.send(m);
                cl.send(LayerMsg::Rebuilt);
                return;
            }
            _ => {}
        }
    })
}

#[test]
fn a_rebuild_sends_each_process_only_the_ids_of_its_keys() {
    let (_d, path, c) = our_server(Duration::from_secs(3));
    let (a, b) = two(
        &c,
        &path,
        &[(1, "ka", 0, 1)],
        &[(5, "kb", 0, 1), (6, "kb/3", 0, 1)],
    );
    let ids = c.server.shared.open_sessions();
    let (seen, log) = channel();
    let ta = answer_rebuild(a, "ab".repeat(128), seen.clone());
    let tb = answer_rebuild(b, "cd".repeat(128), seen);
    steps::rebuild(&c.server, &ids, "checkpoint").unwrap();
    ta.join().unwrap();
    tb.join().unwrap();
    let mut got: Vec<ShimMsg> = log.try_iter().collect();
    got.sort_by_key(|m| format!("{m:?}"));
    assert_eq!(
        got,
        vec![
            ShimMsg::Rebuild {
                ids: vec![("ka".into(), "ab".repeat(128))]
            },
            ShimMsg::Rebuild {
                ids: vec![("kb".into(), "cd".repeat(128))]
            },
        ]
    );
    c.close();
}

#[test]
fn a_unique_id_that_is_not_128_bytes_of_hex_fails_the_rebuild() {
    let (_d, path, c) = our_server(Duration::from_secs(3));
    let (a, b) = two(&c, &path, &[(1, "k", 0, 2)], &[(5, "k", 1, 2)]);
    let ids = c.server.shared.open_sessions();
    let (seen, log) = channel();
    let ta = answer_rebuild(a, "attacker-chosen\n".into(), seen.clone());
    let tb = answer_rebuild(b, "ab".repeat(128), seen);
    let e = steps::rebuild(&c.server, &ids, "checkpoint")
        .unwrap_err()
        .to_string();
    assert!(e.contains("made no unique id for k"), "{e}");
    assert!(e.contains("\\n"), "the reply is escaped: {e}");
    assert_eq!(log.try_iter().count(), 0, "no Rebuild sent");
    c.close();
    let _ = ta.join();
    let _ = tb.join();
}

#[test]
fn a_drain_target_no_rank_reaches_names_who_reported_it() {
    let (_d, path, c) = our_server(Duration::from_secs(3));
    let (mut a, mut b) = two(&c, &path, &[(1, "k", 0, 2)], &[(5, "k", 1, 2)]);
    let ta = std::thread::spawn(move || {
        assert!(matches!(a.recv(), ShimMsg::Quiesce { .. }));
        a.send(LayerMsg::Holding {
            issued: vec![(1, 1_000_000)],
        });
        assert!(matches!(a.recv(), ShimMsg::Drain { .. }));
        a.send(LayerMsg::Quiesced { comms: vec![1] });
        assert_eq!(a.recv(), ShimMsg::Go);
    });
    let tb = std::thread::spawn(move || {
        assert!(matches!(b.recv(), ShimMsg::Quiesce { .. }));
        b.send(LayerMsg::Holding {
            issued: vec![(5, 3)],
        });
        assert!(matches!(b.recv(), ShimMsg::Drain { .. }));
        b.send(LayerMsg::Failed {
            comm: Some(5),
            rank: Some(1),
            message: "communicator 5 (rank 1): 3 of 1000000 collectives issued".into(),
        });
        assert_eq!(b.recv(), ShimMsg::Go);
    });
    let e = c_quiesce(&c);
    assert!(e.contains("did not quiesce within 3s"), "{e}");
    assert!(
        e.contains(&format!(
            "its drain target 1000000 on key k was reported by pid {} (rank 0 of 2",
            me()
        )),
        "{e}"
    );
    ta.join().unwrap();
    tb.join().unwrap();
    c.close();
}

#[test]
fn what_a_layer_says_reaches_errors_bounded_and_escaped() {
    let (_d, path, c) = our_server(Duration::from_secs(3));
    let mut a = Client::connect(&path, None);
    a.comm(1, "k", 0, 1);
    wait_for("comm announced", || {
        sessions_all(&c, |s| !s.comms.is_empty())
    });
    let t = std::thread::spawn(move || {
        assert!(matches!(a.recv(), ShimMsg::Quiesce { .. }));
        a.send(LayerMsg::Failed {
            comm: None,
            rank: None,
            message: "x\n\u{1b}[2Jy".repeat(2000),
        });
        assert_eq!(a.recv(), ShimMsg::Go);
    });
    let e = c_quiesce(&c);
    assert!(e.contains("x\\n\\u{1b}[2Jy"), "{e}");
    assert!(!e.contains('\n') && !e.contains('\u{1b}'), "{e}");
    assert!(e.len() < 2000, "{} bytes", e.len());
    t.join().unwrap();
    c.close();
}

#[test]
fn a_kill_ends_a_quiesce_waiting_on_a_rank_at_once() {
    let (_d, path, c) = our_server(Duration::from_secs(60));
    let mut a = Client::connect(&path, None);
    a.comm(1, "k", 0, 1);
    wait_for("comm announced", || {
        sessions_all(&c, |s| !s.comms.is_empty())
    });
    let q = {
        let c = c.clone();
        std::thread::spawn(move || {
            let t = Instant::now();
            (c_quiesce(&c), t.elapsed())
        })
    };
    // It gets Quiesce and never answers.
    assert!(matches!(a.recv(), ShimMsg::Quiesce { .. }));
    c.server.shared.abort();
    let (e, took) = q.join().unwrap();
    assert!(took < Duration::from_secs(5), "{took:?}: {e}");
    assert!(e.contains("nccl-quiesce"), "{e}");
    c.close();
}

#[test]
fn a_process_that_does_not_read_holds_neither_the_state_nor_a_kill() {
    let (_d, path, c) = our_server(Duration::from_secs(60));
    let _a = Client::connect(&path, None);
    wait_for("one session", || sessions(&c) == 1);
    let ids = c.server.shared.open_sessions();
    // Messages until its socket is full and a write blocks.
    let big = ShimMsg::Rebuild {
        ids: (0..200)
            .map(|i| (format!("k{i}"), "ab".repeat(128)))
            .collect(),
    };
    let teller = {
        let c = c.clone();
        std::thread::spawn(move || {
            for _ in 0..1000 {
                if !c.server.shared.tell(&ids, &big).is_empty() {
                    return;
                }
            }
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    // The state is not held by the blocked write.
    let t = Instant::now();
    drop(c.server.shared.lock());
    assert!(
        t.elapsed() < Duration::from_millis(200),
        "{:?}",
        t.elapsed()
    );
    c.server.shared.abort();
    teller.join().unwrap();
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    c.close();
}

#[test]
fn a_stranger_is_refused_before_it_says_anything() {
    let d = tempfile::tempdir().unwrap();
    let c = server(
        d.path(),
        WAIT,
        Members(Err("pid 1 is not a process of the container".into())),
    );
    let s = UnixStream::connect(d.path().join("control.sock")).unwrap();
    let mut conn = Connection::new(s);
    let t = Instant::now();
    let r = conn.recv::<ShimMsg>(Some(WAIT));
    assert!(
        matches!(r, Err(ControlError::Closed) | Err(ControlError::Io { .. })),
        "{r:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    wait_for("its slot is free", || {
        c.server.shared.lock().connections == 0
    });
    c.close();
}

#[test]
fn a_hello_trickled_in_is_closed_at_the_hello_bound() {
    let d = tempfile::tempdir().unwrap();
    let c = server(d.path(), WAIT, ours());
    let mut s = UnixStream::connect(d.path().join("control.sock")).unwrap();
    let t = Instant::now();
    s.write_all(&[0, 0, 1, 0]).unwrap();
    // A byte every 200 ms: each read is quick, the frame never ends.
    let mut closed = false;
    while t.elapsed() < HELLO_TIMEOUT + Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(200));
        if s.write_all(b" ").is_err() {
            closed = true;
            break;
        }
    }
    assert!(closed, "still open after {:?}", t.elapsed());
    assert!(t.elapsed() < HELLO_TIMEOUT + Duration::from_secs(1));
    c.close();
}

#[test]
fn a_record_beyond_what_the_server_keeps_is_refused_at_restore() {
    let setup = inject::NcclSetup {
        host_dir: "/nonexistent".into(),
        socket: "/nonexistent/control.sock".into(),
        layer_blake3: "h".into(),
    };
    let process = |pid: i32| NcclProcess {
        pid,
        token: format!("{pid:032x}"),
        comms: vec![NcclComm {
            key: "k".into(),
            rank: 0,
            nranks: 1,
            ..Default::default()
        }],
        ..Default::default()
    };
    let check = |edit: &dyn Fn(&mut NcclRecord)| {
        let mut r = NcclRecord {
            layer_blake3: "h".into(),
            processes: vec![process(7), process(8)],
            cut: None,
        };
        edit(&mut r);
        check_layer(Some(&r), Some(&setup)).map_err(|e| e.to_string())
    };
    assert!(check(&|_| {}).is_ok());
    let refused = |edit: &dyn Fn(&mut NcclRecord), why: &str| {
        let e = check(edit).unwrap_err();
        assert!(e.contains("nccl-layer") && e.contains(why), "{e}");
    };
    refused(&|r| r.processes[1].pid = 7, "pid 7 twice");
    refused(&|r| r.processes[1].pid = 0, "not a pid");
    refused(&|r| r.processes[0].token = "../x".into(), "token ../x");
    refused(
        &|r| r.processes = (1..=MAX_CONNECTIONS as i32 + 1).map(process).collect(),
        "processes (at most",
    );
    refused(
        &|r| r.processes[0].comms = vec![NcclComm::default(); MAX_COMMS + 1],
        "communicators (at most",
    );
    refused(
        &|r| r.processes[0].comms[0].key = "k".repeat(MAX_KEY + 1),
        "not one the layer announces",
    );
    refused(&|r| r.processes[0].comms[0].rank = 1, "rank 1 of 1");
    refused(
        &|r| {
            r.cut = Some(image_format::manifest::NcclCut {
                id: "c".into(),
                containers: vec![String::new(); 5000],
            })
        },
        "names 5000 containers",
    );
}

#[test]
fn a_failed_cut_restore_kills_the_init_through_its_pidfd() {
    let d = tempfile::tempdir().unwrap();
    let c = server(d.path(), WAIT, ours());
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    c.started(child.id() as i32);
    assert!(
        c.server.shared.lock().init_fd.is_some(),
        "a pidfd of the init"
    );
    c.server.shared.lock().kill_init().unwrap();
    let status = child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL));
    // Reaped: its pid may be another process's now; the pidfd reaches nothing.
    let e = c.server.shared.lock().kill_init().unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ESRCH));
    c.close();
}
