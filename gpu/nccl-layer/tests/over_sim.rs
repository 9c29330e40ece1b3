//! The layer end to end over the simulated NCCL (gpu/sim): two rank processes with
//! `libgpu-ckpt-nccl.so` preloaded run collectives on two simulated GPUs, while this test acts as
//! the shim on the control socket: quiesce, release, disconnect, reconnect, a rebuild on a fresh
//! unique id, go; the collectives still give bit-exact results on the same handles. Then a
//! release and resume in place. A rank whose peer has not contributed fails the quiesce, naming
//! the rank.
//!
//! The ranks are this test binary again (`harness = false`): with `NCCL_LAYER_TEST_RANK` set,
//! `main` is a rank. It loads `libcuda.so.1` and `libnccl.so.2` with `RTLD_GLOBAL` and calls
//! NCCL through the global scope, so the preloaded layer's definitions come first.
//!
//! Then the two workloads under the layer, each through a checkpoint cycle with a resume in
//! place and one with a rebuild, their every step verified by the program itself:
//! `nccl-train` (cudarc: `dlopen("libnccl.so")` and `dlsym` on that handle, which only the
//! layer's `dlopen` brings under it) and `nccl_allreduce` (C, linked to `libnccl.so.2`). And what
//! a `dlopen` of NCCL hands out: the layer's wrappers, NCCL's own functions for the names the
//! layer does not wrap, a handle whose `dlclose` unloads nothing.
//!
//! Needs the workspace built first (`cargo build --workspace --all-targets`): the daemon
//! `gpu-ckpt-simgpu`, its libraries, and the layer, next to the test executable.

use std::ffi::{c_int, c_void, CStr};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::Duration;

use common::layer_library;
use nccl_control::{Connection, LayerMsg, ShimMsg};
use simgpu::testing::{SimConfig, SimNode};

mod common;

const ENV_RANK: &str = "NCCL_LAYER_TEST_RANK";
const NRANKS: i32 = 2;
const COUNT: usize = 4096;
const WAIT: Duration = Duration::from_secs(30);

fn main() {
    if std::env::var_os(ENV_RANK).is_some() {
        rank::main();
        return;
    }
    let tests: [(&str, fn()); 5] = [
        (
            "checkpoint_cycle_over_the_simulated_nccl",
            checkpoint_cycle_over_the_simulated_nccl,
        ),
        (
            "init_all_rebuilt_in_one_group_over_the_simulated_nccl",
            init_all_rebuilt_in_one_group,
        ),
        (
            "dlopen_of_nccl_hands_out_the_layer",
            dlopen_of_nccl_hands_out_the_layer,
        ),
        (
            "nccl_train_through_dlopen_checkpoint_cycles",
            nccl_train_through_dlopen_checkpoint_cycles,
        ),
        (
            "linked_c_program_checkpoint_cycles",
            linked_c_program_checkpoint_cycles,
        ),
    ];
    for (name, test) in tests {
        if common::selected(name) {
            test();
            println!("test {name} ... ok");
        }
    }
}

/// The values rank `r` sends at step `s`: integers, so that every sum is exact in f32.
fn values(r: i32, s: u32) -> Vec<f32> {
    (0..COUNT)
        .map(|i| ((r + 1) * 1000 + (s as i32) * 10 + (i % 7) as i32) as f32)
        .collect()
}

/// A rank process and its output lines.
struct Rank {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    pid: i32,
}

impl Rank {
    fn say(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("write to a rank");
    }
    fn line(&self, within: Duration) -> Option<String> {
        self.lines.recv_timeout(within).ok()
    }
    fn expect(&self, want: &str) {
        match self.line(WAIT) {
            Some(l) if l == want => {}
            other => panic!("rank {}: expected {want:?}, got {other:?}", self.pid),
        }
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every rank does step `s` and checks its results.
fn step(ranks: &mut [Rank], s: u32) {
    all_ok(ranks, "step", s);
}

/// Every rank finishes its enqueued step `s` (waits for its stream) and checks its results.
fn finish(ranks: &mut [Rank], s: u32) {
    all_ok(ranks, "finish", s);
}

/// Every rank is told `<command> <s>`, then each answers `ok <s>`.
fn all_ok(ranks: &mut [Rank], command: &str, s: u32) {
    for r in ranks.iter_mut() {
        r.say(&format!("{command} {s}"));
    }
    for r in ranks.iter() {
        r.expect(&format!("ok {s}"));
    }
}

/// A simulated node of two GPUs, the layer, and the shim's control socket.
struct Setup {
    node: SimNode,
    _dir: tempfile::TempDir,
    layer: PathBuf,
    socket: PathBuf,
    listener: UnixListener,
}

fn setup() -> Setup {
    let node = SimNode::start(SimConfig {
        gpus: NRANKS as u32,
        ..SimConfig::default()
    })
    .expect("start a simulated node");
    assert!(
        node.lib_dir().join("libnccl.so.2").exists(),
        "the simulated node has no libnccl.so.2"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let layer = layer_library(dir.path());
    let socket = dir.path().join("nccl.sock");
    let listener = UnixListener::bind(&socket).expect("bind the control socket");
    Setup {
        node,
        _dir: dir,
        layer,
        socket,
        listener,
    }
}

/// A process under the layer: `which` is a rank number, or `all` for ncclCommInitAll.
fn spawn_rank(t: &Setup, which: &str, id: &str) -> Rank {
    let mut cmd = Command::new(std::env::current_exe().expect("test executable"));
    cmd.envs(t.node.env())
        .env("LD_PRELOAD", &t.layer)
        .env(nccl_control::ENV_SOCKET, &t.socket)
        .env(ENV_RANK, which)
        .env("NCCL_LAYER_TEST_ID", id)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = cmd.spawn().expect("spawn a rank");
    let stdin = child.stdin.take().expect("stdin");
    let lines = lines_of(&mut child);
    let pid = child.id() as i32;
    Rank {
        child,
        stdin,
        lines,
        pid,
    }
}

/// The shim's end of one layer's connection.
struct Session {
    conn: Connection,
    pid: i32,
    /// The key of each communicator the layer announced, by id.
    keys: std::collections::HashMap<u64, String>,
}

impl Session {
    fn recv(&mut self) -> LayerMsg {
        let m = self
            .conn
            .recv(Some(WAIT))
            .unwrap_or_else(|e| panic!("from pid {}: {e}", self.pid));
        if let LayerMsg::Comm { id, key, .. } = &m {
            self.keys.insert(*id, key.clone());
        }
        m
    }
    fn send(&mut self, m: ShimMsg) {
        self.conn.send(&m, Some(WAIT)).expect("send to the layer");
    }
}

/// Accepts one layer: Hello (checked), Welcome, then its two communicators (root, split).
/// Returns the session and the (root, split) Comm messages.
fn accept(l: &UnixListener, resumed: Option<&str>, token: &str) -> (Session, LayerMsg, LayerMsg) {
    let (mut s, r) = hello(l, |_| token.to_string());
    assert_eq!(r.as_deref(), resumed);
    let root = s.recv();
    let split = s.recv();
    (s, root, split)
}

/// The next layer to connect, within [`WAIT`] (a layer that never connects fails the test).
fn connection(l: &UnixListener) -> Connection {
    l.set_nonblocking(true).expect("nonblocking listener");
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        match l.accept() {
            Ok((c, _)) => {
                c.set_nonblocking(false).expect("blocking connection");
                return Connection::new(c);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "no layer connected to the control socket within {WAIT:?}"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("accept a layer: {e}"),
        }
    }
}

/// Accepts one layer: its Hello (checked), then Welcome with the token `token(pid)`. Returns
/// the session and the Hello's `resumed`.
fn hello(l: &UnixListener, token: impl Fn(i32) -> String) -> (Session, Option<String>) {
    let conn = connection(l);
    let mut s = Session {
        conn,
        pid: 0,
        keys: Default::default(),
    };
    match s.recv() {
        LayerMsg::Hello {
            version,
            pid,
            nccl_version,
            resumed: r,
        } => {
            assert_eq!(version, 1);
            assert!(
                nccl_version > 0,
                "the simulated NCCL's version: {nccl_version}"
            );
            s.pid = pid;
            s.send(ShimMsg::Welcome { token: token(pid) });
            (s, r)
        }
        other => panic!("expected Hello, got {other:?}"),
    }
}

/// The first round of a quiesce at every session at once: each one's `Holding` counts.
fn hold_all(sessions: &mut [Session], ms: u64) -> Vec<Vec<(u64, u64)>> {
    for s in sessions.iter_mut() {
        s.send(ShimMsg::Quiesce { deadline_ms: ms });
    }
    sessions
        .iter_mut()
        .map(|s| match s.recv() {
            LayerMsg::Holding { issued } => issued,
            other => panic!("pid {}: expected Holding, got {other:?}", s.pid),
        })
        .collect()
}

/// The second round, as the shim sends it: each communicator's target is the most any session
/// issued on a communicator of its key.
fn send_drain(sessions: &mut [Session], issued: &[Vec<(u64, u64)>], ms: u64) {
    let mut most: std::collections::HashMap<String, u64> = Default::default();
    for (s, counts) in sessions.iter().zip(issued) {
        for (id, n) in counts {
            let m = most.entry(s.keys[id].clone()).or_default();
            *m = (*m).max(*n);
        }
    }
    for s in sessions.iter_mut() {
        let targets = s
            .keys
            .iter()
            .filter_map(|(id, k)| Some((*id, *most.get(k)?)))
            .collect();
        s.send(ShimMsg::Drain {
            targets,
            deadline_ms: ms,
        });
    }
}

/// Both rounds at every session; the replies to the second.
fn quiesce_all(sessions: &mut [Session], ms: u64) -> Vec<LayerMsg> {
    let issued = hold_all(sessions, ms);
    send_drain(sessions, &issued, ms);
    sessions.iter_mut().map(Session::recv).collect()
}

fn comm_fields(m: &LayerMsg) -> (u64, String, i32, i32, i32, Option<nccl_control::Split>) {
    match m {
        LayerMsg::Comm {
            id,
            key,
            rank,
            nranks,
            cuda_dev,
            split,
        } => (*id, key.clone(), *rank, *nranks, *cuda_dev, split.clone()),
        other => panic!("expected Comm, got {other:?}"),
    }
}

fn checkpoint_cycle_over_the_simulated_nccl() {
    let t = setup();
    let (node, listener) = (&t.node, &t.listener);

    // The job's unique id, from a process of its own (as torchrun's rank 0 would make it).
    let out = common::stack::run_ok(
        Command::new(std::env::current_exe().unwrap())
            .envs(node.env())
            .env(ENV_RANK, "uid"),
    );
    let id = out.trim().to_string();
    assert_eq!(id.len(), 256, "{id}");

    let mut ranks: Vec<Rank> = (0..NRANKS)
        .map(|r| spawn_rank(&t, &r.to_string(), &id))
        .collect();
    let mut sessions = Vec::new();
    let mut keys = Vec::new();
    for _ in 0..NRANKS {
        let (s, root, split) = accept(listener, None, "first");
        let (root_id, key, rank, nranks, dev, parent) = comm_fields(&root);
        assert_eq!(parent, None);
        assert_eq!(nranks, NRANKS);
        assert_eq!(dev, rank, "rank {rank} runs on GPU {rank}");
        assert_eq!(
            key,
            blake3::hash(&hex::decode(&id).unwrap())
                .to_hex()
                .to_string()
        );
        let (_, skey, srank, snranks, sdev, sp) = comm_fields(&split);
        assert_eq!(skey, format!("{key}/0"));
        assert_eq!((srank, snranks, sdev), (NRANKS - 1 - rank, NRANKS, dev));
        assert_eq!(sp.map(|p| (p.parent, p.color)), Some((root_id, 0)));
        keys.push((rank, key));
        sessions.push((rank, s));
    }
    sessions.sort_by_key(|(r, _)| *r);
    let mut sessions: Vec<Session> = sessions.into_iter().map(|(_, s)| s).collect();
    for (r, s) in sessions.iter().enumerate() {
        assert_eq!(s.pid, ranks[r].pid, "rank {r}'s Hello names its pid");
    }
    let key = keys[0].1.clone();

    step(&mut ranks, 1);

    // Checkpoint: quiesce, release, disconnect.
    for m in quiesce_all(&mut sessions, 5000) {
        assert!(matches!(m, LayerMsg::Quiesced { comms } if comms.len() == 2));
    }
    release_and_disconnect(&mut sessions);
    // Calls made now are held: nothing comes back until Go.
    for r in ranks.iter_mut() {
        r.say("step 2");
    }
    assert_eq!(
        ranks[0].line(Duration::from_millis(500)),
        None,
        "a call passed the held gate"
    );

    // "Restore": the layers reconnect with their token; a fresh id for the key from the process
    // of rank 0; every rank rebuilds on it.
    let mut sessions: Vec<Session> = (0..NRANKS)
        .map(|_| accept(listener, Some("first"), "second").0)
        .collect();
    sessions.sort_by_key(|s| ranks.iter().position(|r| r.pid == s.pid));
    sessions[0].send(ShimMsg::NewUniqueId { key: key.clone() });
    let fresh = match sessions[0].recv() {
        LayerMsg::UniqueId { key: k, id: fresh } => {
            assert_eq!(k, key);
            fresh
        }
        other => panic!("expected UniqueId, got {other:?}"),
    };
    assert_eq!(fresh.len(), 256);
    assert_ne!(fresh, id, "the rebuild's id is a fresh one");
    for s in sessions.iter_mut() {
        s.send(ShimMsg::Rebuild {
            ids: vec![(key.clone(), fresh.clone())],
        });
    }
    for s in sessions.iter_mut() {
        assert_eq!(s.recv(), LayerMsg::Rebuilt);
    }
    assert_eq!(
        ranks[0].line(Duration::from_millis(200)),
        None,
        "a call passed before Go"
    );
    for s in sessions.iter_mut() {
        s.send(ShimMsg::Go);
    }
    for r in &ranks {
        r.expect("ok 2");
    }
    step(&mut ranks, 3);

    // A checkpoint that keeps the task on this node: release, then resume the suspended
    // communicators in place.
    // Rank 0 is a step ahead: its allreduce and broadcast of step 6 are enqueued, rank 1's
    // not. The drain lets rank 1 catch up (and no further), so both stop after the same
    // collectives and every stream completes.
    ranks[0].say("enqueue 6");
    ranks[0].expect("enqueued 6");
    let issued = hold_all(&mut sessions, 5000);
    assert_eq!(
        issued[0].iter().map(|(_, n)| n - 1).collect::<Vec<_>>(),
        issued[1].iter().map(|(_, n)| *n).collect::<Vec<_>>(),
        "rank 0 is one collective ahead on each communicator: {issued:?}"
    );
    send_drain(&mut sessions, &issued, 5000);
    ranks[1].say("enqueue 6");
    ranks[1].expect("enqueued 6");
    for s in sessions.iter_mut() {
        assert!(matches!(s.recv(), LayerMsg::Quiesced { .. }));
        s.send(ShimMsg::Release);
        assert_eq!(s.recv(), LayerMsg::Released { suspended: true });
    }
    // Nothing passes while released.
    ranks[1].say("enqueue 7");
    assert_eq!(ranks[1].line(Duration::from_millis(300)), None);
    for s in sessions.iter_mut() {
        s.send(ShimMsg::Resume);
        assert_eq!(s.recv(), LayerMsg::Rebuilt);
        s.send(ShimMsg::Go);
    }
    ranks[1].expect("enqueued 7");
    ranks[0].say("enqueue 7");
    ranks[0].expect("enqueued 7");
    finish(&mut ranks, 7);

    // Rank 0 enqueues an allreduce whose peer has not come: its stream cannot complete, and the
    // quiesce fails within its bound naming rank 0; the calls then go on.
    ranks[0].say("enqueue 4");
    ranks[0].expect("enqueued 4");
    let own = hold_all(&mut sessions[..1], 300);
    send_drain(&mut sessions[..1], &own, 300);
    match sessions[0].recv() {
        LayerMsg::Failed {
            comm,
            rank,
            message,
        } => {
            assert_eq!(rank, Some(0), "{message}");
            assert!(comm.is_some(), "{message}");
            assert!(message.contains("stream"), "{message}");
        }
        other => panic!("expected Failed, got {other:?}"),
    }
    ranks[1].say("enqueue 4");
    ranks[1].expect("enqueued 4");
    finish(&mut ranks, 4);

    // The end: each communicator gone, told to the shim.
    for r in ranks.iter_mut() {
        r.say("quit");
    }
    for s in sessions.iter_mut() {
        let a = s.recv();
        let b = s.recv();
        assert!(
            matches!(
                (&a, &b),
                (LayerMsg::CommGone { .. }, LayerMsg::CommGone { .. })
            ),
            "{a:?} {b:?}"
        );
    }
    for r in ranks.iter_mut() {
        let st = r.child.wait().expect("wait for a rank");
        assert!(st.success(), "rank {} exited {st}", r.pid);
    }
}

/// One process holding both ranks (ncclCommInitAll): the layer records them under one key and
/// makes them again in one group on the fresh id.
fn init_all_rebuilt_in_one_group() {
    let t = setup();
    let mut all = spawn_rank(&t, "all", "");
    let (mut s, a, b) = accept(&t.listener, None, "first");
    assert_eq!(s.pid, all.pid);
    let (ida, key, ra, na, da, pa) = comm_fields(&a);
    let (idb, keyb, rb, nb, db, pb) = comm_fields(&b);
    assert_eq!((ra, na, da, pa), (0, NRANKS, 0, None));
    assert_eq!((rb, nb, db, pb), (1, NRANKS, 1, None));
    assert_eq!(key, keyb);
    all.say("step 1");
    all.expect("ok 1");

    assert_eq!(
        quiesce_all(std::slice::from_mut(&mut s), 5000),
        [LayerMsg::Quiesced {
            comms: vec![ida, idb]
        }]
    );
    s.send(ShimMsg::Release);
    assert_eq!(s.recv(), LayerMsg::Released { suspended: true });
    s.send(ShimMsg::Disconnect);
    all.say("step 2");
    assert_eq!(
        all.line(Duration::from_millis(300)),
        None,
        "a call passed the held gate"
    );

    let (mut s, _, _) = accept(&t.listener, Some("first"), "second");
    s.send(ShimMsg::NewUniqueId { key: key.clone() });
    let LayerMsg::UniqueId { id: fresh, .. } = s.recv() else {
        panic!("no UniqueId");
    };
    s.send(ShimMsg::Rebuild {
        ids: vec![(key, fresh)],
    });
    assert_eq!(s.recv(), LayerMsg::Rebuilt);
    s.send(ShimMsg::Go);
    all.expect("ok 2");
    all.say("quit");
    for _ in 0..NRANKS {
        assert!(matches!(s.recv(), LayerMsg::CommGone { .. }));
    }
    let st = all.child.wait().expect("wait for the process");
    assert!(st.success(), "exited {st}");
}

/// A workspace binary (`target/debug/<name>`, next to the test executable's directory).
fn workspace_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let mut d = exe.parent();
    while let Some(p) = d {
        let bin = p.join(name);
        if bin.is_file() {
            return bin;
        }
        d = p.parent();
    }
    panic!(
        "{name} not found above {}: build the workspace first",
        exe.display()
    );
}

/// In a process under the layer that does not link NCCL: `dlopen` of NCCL gives the layer's
/// handle, on which NCCL's wrapped names are the layer's and the others NCCL's own, and which a
/// `dlclose` does not unload (rank mode `dlopen`).
fn dlopen_of_nccl_hands_out_the_layer() {
    let t = setup();
    let out = common::stack::run_ok(
        Command::new(std::env::current_exe().unwrap())
            .envs(t.node.env())
            .env("LD_PRELOAD", &t.layer)
            .env(ENV_RANK, "dlopen"),
    );
    assert_eq!(out.trim(), "dlopen ok", "{out}");
}

/// Lines a workload prints, read on a thread.
fn lines_of(child: &mut Child) -> Receiver<String> {
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines() {
            let Ok(l) = l else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

/// A workload's output so far: the last step each rank printed, and every line.
#[derive(Default)]
struct Progress {
    last: [u64; NRANKS as usize],
    all: Vec<String>,
}

impl Progress {
    /// Takes the lines that came within `within`; how many were step lines.
    fn take(&mut self, rx: &Receiver<String>, within: Duration) -> usize {
        let mut steps = 0;
        let until = std::time::Instant::now() + within;
        loop {
            let left = until.saturating_duration_since(std::time::Instant::now());
            let Ok(l) = rx.recv_timeout(left) else {
                return steps;
            };
            assert!(!l.contains("MISMATCH"), "{l}\n{}", self.all.join("\n"));
            let w: Vec<&str> = l.split_whitespace().collect();
            if let ["rank", r, "step", k, "checksum", _] = w[..] {
                let (r, k): (usize, u64) = (r.parse().unwrap(), k.parse().unwrap());
                assert_eq!(k, self.last[r] + 1, "rank {r} skipped a step: {l}");
                self.last[r] = k;
                steps += 1;
            }
            self.all.push(l);
        }
    }

    /// Waits until every rank has printed a step after `after`.
    fn past(&mut self, rx: &Receiver<String>, after: [u64; NRANKS as usize]) {
        let until = std::time::Instant::now() + WAIT;
        while self.last.iter().zip(&after).any(|(l, a)| l <= a) {
            assert!(
                std::time::Instant::now() < until,
                "no progress past {after:?}: {}",
                self.all.join("\n")
            );
            self.take(rx, Duration::from_millis(50));
        }
    }
}

/// Every session: Release (every communicator suspended), then Disconnect, after which the
/// layer closes the connection.
fn release_and_disconnect(sessions: &mut [Session]) {
    for s in sessions.iter_mut() {
        s.send(ShimMsg::Release);
        assert_eq!(s.recv(), LayerMsg::Released { suspended: true });
        s.send(ShimMsg::Disconnect);
        assert!(matches!(
            s.conn.recv::<LayerMsg>(Some(WAIT)),
            Err(nccl_control::ControlError::Closed)
        ));
    }
}

/// Every session: Quiesce, Release (every communicator suspended), Disconnect; then the layer
/// holds the ranks: no step is printed until Go.
fn checkpoint(sessions: &mut [Session], p: &mut Progress, rx: &Receiver<String>) {
    for m in quiesce_all(sessions, 10_000) {
        match m {
            LayerMsg::Quiesced { comms } => assert_eq!(comms.len(), 2),
            other => panic!("expected Quiesced, got {other:?}"),
        }
    }
    release_and_disconnect(sessions);
    // A step whose collectives were all done before the hold may still print; then nothing.
    p.take(rx, Duration::from_millis(300));
    assert_eq!(
        p.take(rx, Duration::from_millis(500)),
        0,
        "a rank went on while held: {}",
        p.all.join("\n")
    );
}

/// The ranks' layers connect again with the tokens of `before`; their sessions in the same
/// order, each with its root communicator's key.
fn reconnect(l: &UnixListener, before: &[Session], round: u32) -> Vec<(Session, String)> {
    let mut again: Vec<(Session, String)> = before
        .iter()
        .map(|_| {
            let (mut s, resumed) = hello(l, |pid| format!("round-{round}-{pid}"));
            assert!(before.iter().any(|b| b.pid == s.pid), "pid {}", s.pid);
            assert_eq!(resumed, Some(format!("round-{}-{}", round - 1, s.pid)));
            let (_, key, ..) = comm_fields(&s.recv());
            comm_fields(&s.recv());
            (s, key)
        })
        .collect();
    again.sort_by_key(|(s, _)| before.iter().position(|b| b.pid == s.pid));
    again
}

/// A workload of 2 ranks (`--ranks 2`) under the layer: its ranks announce their communicators
/// (a root and a split each); a checkpoint resumed in place, then one rebuilt on a fresh id;
/// every step verified by the program, which exits 0.
fn checkpoint_cycles(program: &Path) {
    let t = setup();
    let mut child = Command::new(program)
        .args(["--ranks", "2", "--steps", "120", "--interval-ms", "10"])
        .args(["--elements", "4099", "--seed", "7"])
        .envs(t.node.env())
        .env("LD_PRELOAD", &t.layer)
        .env(nccl_control::ENV_SOCKET, &t.socket)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the workload");
    let guard = Killer(child.id() as i32);
    let rx = lines_of(&mut child);
    let mut p = Progress::default();

    // Each rank's layer connects and announces its root communicator and its split.
    let mut sessions: Vec<(i32, Session)> = (0..NRANKS)
        .map(|_| {
            let (mut s, resumed) = hello(&t.listener, |pid| format!("round-0-{pid}"));
            assert_eq!(resumed, None);
            let (root, key, rank, nranks, dev, parent) = comm_fields(&s.recv());
            assert_eq!((nranks, dev, parent), (NRANKS, rank, None), "{key}");
            let (_, skey, _, snranks, sdev, sp) = comm_fields(&s.recv());
            assert_eq!(skey, format!("{key}/{}", rank % 2));
            assert_eq!((snranks, sdev), (1, dev));
            assert_eq!(sp.map(|p| p.parent), Some(root));
            (rank, s)
        })
        .collect();
    sessions.sort_by_key(|(r, _)| *r);
    let mut sessions: Vec<Session> = sessions.into_iter().map(|(_, s)| s).collect();
    p.past(&rx, [2; NRANKS as usize]);

    // A checkpoint that keeps the job here: resumed in place.
    checkpoint(&mut sessions, &mut p, &rx);
    let before = p.last;
    let mut again = reconnect(&t.listener, &sessions, 1);
    for (s, _) in again.iter_mut() {
        s.send(ShimMsg::Resume);
        assert_eq!(s.recv(), LayerMsg::Rebuilt);
    }
    assert_eq!(
        p.take(&rx, Duration::from_millis(200)),
        0,
        "a step before Go"
    );
    for (s, _) in again.iter_mut() {
        s.send(ShimMsg::Go);
    }
    p.past(&rx, before);

    // A checkpoint restored elsewhere: a fresh unique id from rank 0, every rank rebuilt on it.
    let mut sessions: Vec<Session> = again.into_iter().map(|(s, _)| s).collect();
    checkpoint(&mut sessions, &mut p, &rx);
    let before = p.last;
    let mut again = reconnect(&t.listener, &sessions, 2);
    let key = again[0].1.clone();
    again[0].0.send(ShimMsg::NewUniqueId { key: key.clone() });
    let fresh = match again[0].0.recv() {
        LayerMsg::UniqueId { key: k, id } => {
            assert_eq!(k, key);
            id
        }
        other => panic!("expected UniqueId, got {other:?}"),
    };
    for (s, _) in again.iter_mut() {
        s.send(ShimMsg::Rebuild {
            ids: vec![(key.clone(), fresh.clone())],
        });
    }
    for (s, _) in again.iter_mut() {
        assert_eq!(s.recv(), LayerMsg::Rebuilt);
    }
    for (s, _) in again.iter_mut() {
        s.send(ShimMsg::Go);
    }
    p.past(&rx, before);

    let st = child.wait().expect("wait for the workload");
    p.take(&rx, Duration::from_millis(500));
    drop(guard);
    assert!(
        st.success(),
        "{program:?} exited {st}: {}",
        p.all.join("\n")
    );
    assert_eq!(p.last, [120; NRANKS as usize], "{}", p.all.join("\n"));
}

/// Kills a workload's process group left behind by a failed test.
struct Killer(i32);

impl Drop for Killer {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // SAFETY: kill(2) of the workload this test started.
            unsafe { libc::kill(self.0, libc::SIGTERM) };
        }
    }
}

/// cudarc's NCCL (`dlopen` + `dlsym` on its handle): only the layer's `dlopen` brings it under
/// the layer; without it no layer ever connects.
fn nccl_train_through_dlopen_checkpoint_cycles() {
    checkpoint_cycles(&workspace_binary("nccl-train"));
}

/// The C workload linked to `libnccl.so.2` (found through `RTLD_NEXT`).
fn linked_c_program_checkpoint_cycles() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../test-containers/gpu-workloads/c/build.sh");
    common::stack::run_ok(Command::new(&script).arg(dir.path()));
    checkpoint_cycles(&dir.path().join("nccl_allreduce"));
}

/// One rank: the application side, NCCL's C API through the global scope.
mod rank {
    use super::*;

    type Res = c_int;
    type Comm = *mut c_void;
    type Fp = *mut c_void;

    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Id([u8; 128]);

    fn sym<T: Copy>(name: &CStr) -> T {
        // SAFETY: dlsym on the global scope; the caller names the C signature.
        let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
        assert!(!p.is_null(), "no symbol {name:?}");
        assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<usize>());
        unsafe { std::mem::transmute_copy(&p) }
    }

    fn open(name: &CStr) {
        // SAFETY: dlopen of a library name.
        let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        assert!(!h.is_null(), "cannot load {name:?}");
    }

    fn ok(what: &str, r: Res) {
        assert_eq!(r, 0, "{what} returned {r}");
    }

    pub fn main() {
        let which = std::env::var(ENV_RANK).unwrap();
        if which == "dlopen" {
            unsafe { probe_dlopen() };
            return;
        }
        open(c"libcuda.so.1");
        open(c"libnccl.so.2");
        unsafe {
            let cu_init: unsafe extern "C" fn(u32) -> Res = sym(c"cuInit");
            ok("cuInit", cu_init(0));
            match which.as_str() {
                "uid" => {
                    let get_id: unsafe extern "C" fn(*mut Id) -> Res = sym(c"ncclGetUniqueId");
                    let mut id = Id([0; 128]);
                    ok("ncclGetUniqueId", get_id(&mut id));
                    println!("{}", hex::encode(id.0));
                }
                "all" => run_all(),
                rank => run(rank.parse().expect("rank")),
            }
        }
    }

    /// The file name of the library that holds `p`.
    unsafe fn file_of(p: *mut c_void) -> String {
        assert!(!p.is_null());
        let mut info: libc::Dl_info = std::mem::zeroed();
        assert_ne!(libc::dladdr(p, &mut info), 0, "dladdr");
        let path = CStr::from_ptr(info.dli_fname)
            .to_string_lossy()
            .into_owned();
        path.rsplit('/').next().unwrap_or_default().to_string()
    }

    unsafe fn dlerror() -> String {
        let e = libc::dlerror();
        if e.is_null() {
            return String::new();
        }
        CStr::from_ptr(e).to_string_lossy().into_owned()
    }

    /// What `dlopen` of NCCL gives a process under the layer (as cudarc and ctypes open it).
    unsafe fn probe_dlopen() {
        let local = libc::RTLD_LAZY | libc::RTLD_LOCAL;
        let h = libc::dlopen(c"libnccl.so".as_ptr(), local);
        assert!(!h.is_null(), "dlopen libnccl.so: {}", dlerror());
        // The wrapped names are the layer's; the others NCCL's own.
        let layer = file_of(libc::dlsym(h, c"ncclAllReduce".as_ptr()));
        assert_eq!(layer, "libgpu-ckpt-nccl.so");
        assert_eq!(file_of(libc::dlsym(h, c"ncclCommSplit".as_ptr())), layer);
        let own = file_of(libc::dlsym(h, c"ncclMemAlloc".as_ptr()));
        assert!(own.starts_with("libnccl.so"), "ncclMemAlloc from {own}");
        // Every name of NCCL, and a request that only looks, give the same handle.
        let h2 = libc::dlopen(c"libnccl.so.2".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        assert_eq!(h2, h);
        let h3 = libc::dlopen(
            c"libnccl.so.2".as_ptr(),
            libc::RTLD_LAZY | libc::RTLD_NOLOAD,
        );
        assert_eq!(h3, h);
        // A name NCCL does not have stays unknown, with the loader's error.
        dlerror();
        assert!(libc::dlsym(h, c"ncclNoSuchFunction".as_ptr()).is_null());
        assert!(
            dlerror().contains("ncclNoSuchFunction"),
            "dlerror names the symbol"
        );
        // A library that is not NCCL is opened as it would be.
        let cu = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL);
        assert!(!cu.is_null(), "dlopen libcuda.so.1: {}", dlerror());
        assert_eq!(file_of(libc::dlsym(cu, c"cuInit".as_ptr())), "libcuda.so.1");
        // Closing every handle given unloads nothing needed: a new handle's functions work,
        // the unwrapped ones included.
        for c in [h, h2, h3] {
            assert_eq!(libc::dlclose(c), 0, "dlclose: {}", dlerror());
        }
        let h = libc::dlopen(c"libnccl.so".as_ptr(), local);
        assert!(!h.is_null(), "dlopen libnccl.so again: {}", dlerror());
        let get = |name: &CStr| {
            let p = libc::dlsym(h, name.as_ptr());
            assert!(!p.is_null(), "no {name:?} on the handle");
            p
        };
        let version: unsafe extern "C" fn(*mut c_int) -> Res =
            std::mem::transmute(get(c"ncclGetVersion"));
        let mut v = 0;
        ok("ncclGetVersion", version(&mut v));
        assert!(v > 0, "version {v}");
        let cu_init: unsafe extern "C" fn(u32) -> Res = sym(c"cuInit");
        ok("cuInit", cu_init(0));
        let cu = Cuda::load();
        cu.on(0);
        let alloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> Res =
            std::mem::transmute(get(c"ncclMemAlloc"));
        let free: unsafe extern "C" fn(*mut c_void) -> Res =
            std::mem::transmute(get(c"ncclMemFree"));
        let mut p = std::ptr::null_mut();
        ok("ncclMemAlloc", alloc(&mut p, 1 << 16));
        assert!(!p.is_null());
        ok("ncclMemFree", free(p));
        println!("dlopen ok");
    }

    const FLOAT32: c_int = 7;
    const SUM: c_int = 0;
    const BYTES: usize = COUNT * 4;
    // ncclAllReduce's op and ncclBroadcast's root are both an int.
    type Coll =
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Fp) -> Res;
    type Void = unsafe extern "C" fn() -> Res;
    type CommFn = unsafe extern "C" fn(Comm) -> Res;

    /// The CUDA driver calls the ranks make, and each device's primary context.
    struct Cuda {
        set_current: unsafe extern "C" fn(*mut c_void) -> Res,
        stream_create: unsafe extern "C" fn(*mut Fp, u32) -> Res,
        sync: unsafe extern "C" fn(Fp) -> Res,
        alloc: unsafe extern "C" fn(*mut u64, usize) -> Res,
        htod: unsafe extern "C" fn(u64, *const c_void, usize) -> Res,
        dtoh: unsafe extern "C" fn(*mut c_void, u64, usize) -> Res,
        ctxs: Vec<Fp>,
    }

    impl Cuda {
        unsafe fn load() -> Cuda {
            let device_get: unsafe extern "C" fn(*mut c_int, c_int) -> Res = sym(c"cuDeviceGet");
            let retain: unsafe extern "C" fn(*mut Fp, c_int) -> Res =
                sym(c"cuDevicePrimaryCtxRetain");
            let ctxs = (0..NRANKS)
                .map(|ordinal| {
                    let (mut dev, mut ctx) = (0, std::ptr::null_mut());
                    ok("cuDeviceGet", device_get(&mut dev, ordinal));
                    ok("cuDevicePrimaryCtxRetain", retain(&mut ctx, dev));
                    ctx
                })
                .collect();
            Cuda {
                set_current: sym(c"cuCtxSetCurrent"),
                stream_create: sym(c"cuStreamCreate"),
                sync: sym(c"cuStreamSynchronize"),
                alloc: sym(c"cuMemAlloc_v2"),
                htod: sym(c"cuMemcpyHtoD_v2"),
                dtoh: sym(c"cuMemcpyDtoH_v2"),
                ctxs,
            }
        }
        /// Makes device `dev` current on this thread.
        unsafe fn on(&self, dev: i32) {
            ok(
                "cuCtxSetCurrent",
                (self.set_current)(self.ctxs[dev as usize]),
            );
        }
        unsafe fn stream(&self) -> Fp {
            let mut s = std::ptr::null_mut();
            ok("cuStreamCreate", (self.stream_create)(&mut s, 0));
            s
        }
        unsafe fn buffer(&self) -> u64 {
            let mut d = 0;
            ok("cuMemAlloc", (self.alloc)(&mut d, BYTES));
            d
        }
        unsafe fn put(&self, d: u64, v: &[f32]) {
            ok("cuMemcpyHtoD", (self.htod)(d, v.as_ptr().cast(), BYTES));
        }
        unsafe fn sync(&self, stream: Fp) {
            ok("cuStreamSynchronize", (self.sync)(stream));
        }
        /// Device memory `d` as the bits of its f32s.
        unsafe fn bits(&self, d: u64) -> Vec<u32> {
            let mut got = vec![0f32; COUNT];
            ok(
                "cuMemcpyDtoH",
                (self.dtoh)(got.as_mut_ptr().cast(), d, BYTES),
            );
            got.iter().map(|x| x.to_bits()).collect()
        }
    }

    /// The bits of every rank's values at step `s` summed.
    fn sum_bits(s: u32) -> Vec<u32> {
        (0..COUNT)
            .map(|i| (0..NRANKS).map(|r| values(r, s)[i]).sum::<f32>().to_bits())
            .collect()
    }

    /// Serves the test's commands (`step S`, `enqueue S`, `finish S`) until `quit`.
    fn commands(mut enqueue: impl FnMut(u32), mut finish: impl FnMut(u32)) {
        for line in std::io::stdin().lock().lines() {
            let line = line.unwrap();
            let (cmd, arg) = line.split_once(' ').unwrap_or((line.as_str(), "0"));
            let s: u32 = arg.parse().unwrap();
            match cmd {
                "step" => {
                    enqueue(s);
                    finish(s);
                    println!("ok {s}");
                }
                "enqueue" => {
                    enqueue(s);
                    println!("enqueued {s}");
                }
                "finish" => {
                    finish(s);
                    println!("ok {s}");
                }
                "quit" => break,
                other => panic!("unknown command {other}"),
            }
        }
    }

    /// One rank of the job on GPU `rank`: a root communicator, a split, a registered buffer.
    unsafe fn run(rank: i32) {
        let init: unsafe extern "C" fn(*mut Comm, c_int, Id, c_int) -> Res =
            sym(c"ncclCommInitRank");
        let split: unsafe extern "C" fn(Comm, c_int, c_int, *mut Comm, *mut c_void) -> Res =
            sym(c"ncclCommSplit");
        let allreduce: Coll = sym(c"ncclAllReduce");
        let bcast: Coll = sym(c"ncclBroadcast");
        let register: unsafe extern "C" fn(Comm, *mut c_void, usize, *mut *mut c_void) -> Res =
            sym(c"ncclCommRegister");
        let deregister: unsafe extern "C" fn(Comm, *mut c_void) -> Res = sym(c"ncclCommDeregister");
        let destroy: CommFn = sym(c"ncclCommDestroy");

        let cu = Cuda::load();
        cu.on(rank);
        let stream = cu.stream();
        let (send, recv, bout) = (cu.buffer(), cu.buffer(), cu.buffer());

        let idhex = std::env::var("NCCL_LAYER_TEST_ID").unwrap();
        let mut id = Id([0; 128]);
        id.0.copy_from_slice(&hex::decode(idhex).unwrap());
        let mut comm: Comm = std::ptr::null_mut();
        ok("ncclCommInitRank", init(&mut comm, NRANKS, id, rank));
        // One split with every rank in it, ranks reversed by the key.
        let mut sub: Comm = std::ptr::null_mut();
        ok(
            "ncclCommSplit",
            split(comm, 0, NRANKS - 1 - rank, &mut sub, std::ptr::null_mut()),
        );
        let mut reg = std::ptr::null_mut();
        ok(
            "ncclCommRegister",
            register(comm, send as *mut c_void, BYTES, &mut reg),
        );
        // The handles the application holds never change.
        let (comm0, sub0) = (comm, sub);

        let enqueue = |s: u32| {
            cu.put(send, &values(rank, s));
            ok(
                "ncclAllReduce",
                allreduce(send as _, recv as _, COUNT, FLOAT32, SUM, comm, stream),
            );
            // On the split, root 0 is the last rank of the job.
            ok(
                "ncclBroadcast",
                bcast(send as _, bout as _, COUNT, FLOAT32, 0, sub, stream),
            );
        };
        let finish = |s: u32| {
            cu.sync(stream);
            assert_eq!(cu.bits(recv), sum_bits(s), "allreduce at step {s}");
            let last: Vec<u32> = values(NRANKS - 1, s).iter().map(|x| x.to_bits()).collect();
            assert_eq!(cu.bits(bout), last, "broadcast at step {s}");
            assert_eq!((comm, sub), (comm0, sub0));
        };
        commands(enqueue, finish);
        ok("ncclCommDeregister", deregister(comm, reg));
        ok("ncclCommDestroy", destroy(sub));
        ok("ncclCommDestroy", destroy(comm));
    }

    /// Every rank of the job in this process, one per GPU, from ncclCommInitAll; each step's
    /// allreduces in one group.
    unsafe fn run_all() {
        let init_all: unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> Res =
            sym(c"ncclCommInitAll");
        let group_start: Void = sym(c"ncclGroupStart");
        let group_end: Void = sym(c"ncclGroupEnd");
        let allreduce: Coll = sym(c"ncclAllReduce");
        let destroy: CommFn = sym(c"ncclCommDestroy");

        let cu = Cuda::load();
        let devs: Vec<c_int> = (0..NRANKS).collect();
        let mut comms: Vec<Comm> = vec![std::ptr::null_mut(); NRANKS as usize];
        ok(
            "ncclCommInitAll",
            init_all(comms.as_mut_ptr(), NRANKS, devs.as_ptr()),
        );
        let per_dev: Vec<(Fp, u64, u64)> = devs
            .iter()
            .map(|&d| {
                cu.on(d);
                (cu.stream(), cu.buffer(), cu.buffer())
            })
            .collect();
        let enqueue = |s: u32| {
            for (d, (_, send, _)) in per_dev.iter().enumerate() {
                cu.on(d as i32);
                cu.put(*send, &values(d as i32, s));
            }
            ok("ncclGroupStart", group_start());
            for (d, (stream, send, recv)) in per_dev.iter().enumerate() {
                cu.on(d as i32);
                let (c, st) = (comms[d], *stream);
                ok(
                    "ncclAllReduce",
                    allreduce(*send as _, *recv as _, COUNT, FLOAT32, SUM, c, st),
                );
            }
            ok("ncclGroupEnd", group_end());
        };
        let finish = |s: u32| {
            for (d, (stream, _, recv)) in per_dev.iter().enumerate() {
                cu.on(d as i32);
                cu.sync(*stream);
                assert_eq!(
                    cu.bits(*recv),
                    sum_bits(s),
                    "allreduce on GPU {d} at step {s}"
                );
            }
        };
        commands(enqueue, finish);
        for c in comms {
            ok("ncclCommDestroy", destroy(c));
        }
    }
}
