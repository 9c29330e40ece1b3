//! The NCCL workloads (`c/nccl_allreduce.c`, `nccl-train`) on the simulated driver and NCCL:
//! 4 ranks on 4 simulated GPUs, forked by one launcher and as 4 separate processes meeting in a
//! rendezvous directory (and as 2 launchers of 2 ranks, the shape of 2 containers of one pod);
//! every step verified, each program printing the digests of the closed forms; a corrupted
//! element makes the job fail naming the rank, step and element. Needs the workspace build (`make build`: the
//! daemon, libcuda.so.1 and libnccl.so.2) and the stack's NCCL wheel (c/build.sh).

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpu_ckpt_gpu_workloads::collective::Sums;
use simgpu::testing::{SimConfig, SimNode};

const WORLD: u32 = 4;
const SEED: u64 = 7;
const STEPS: u64 = 6;
/// Not a multiple of anything NCCL would split on.
const ELEMENTS: &str = "4099";

fn node() -> SimNode {
    let cfg = SimConfig {
        gpus: WORLD,
        memory_mib: 256,
        ..SimConfig::default()
    };
    SimNode::start(cfg).unwrap_or_else(|e| panic!("simulated node: {e:#}"))
}

/// nccl_allreduce, built by c/build.sh against the stack's NCCL wheel.
fn c_program(dir: &Path) -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("c/build.sh");
    let out = Command::new(&script).arg(dir).output().unwrap();
    assert!(
        out.status.success(),
        "c/build.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir.join("nccl_allreduce")
}

const RUST: &str = env!("CARGO_BIN_EXE_nccl-train");

/// Runs `c` in its own process group with `env`; kills the group after `limit`. Returns the exit
/// code and stdout.
fn run(mut c: Command, env: &[(String, String)], limit: Duration) -> (Option<i32>, String) {
    c.env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("LOCAL_RANK")
        .env_remove("NCCL_RENDEZVOUS_DIR")
        .envs(env.iter().cloned())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .process_group(0);
    let mut child = c.spawn().expect("spawn");
    let mut out = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            // SAFETY: kill(2) on the process group this test started.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
            panic!(
                "{c:?} did not finish in {limit:?}; output: {}",
                reader.join().unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (status.code(), reader.join().unwrap())
}

/// Runs `cmds` at once (one rank or launcher each), each with its extra environment.
fn run_all(
    cmds: Vec<(Command, Vec<(String, String)>)>,
    base: &[(String, String)],
) -> Vec<(Option<i32>, String)> {
    let handles: Vec<_> = cmds
        .into_iter()
        .map(|(c, extra)| {
            let e: Vec<(String, String)> = base.iter().cloned().chain(extra).collect();
            std::thread::spawn(move || run(c, &e, LIMIT))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// The outputs of processes that must all have exited 0, together.
fn succeeded(outs: Vec<(Option<i32>, String)>) -> String {
    for (code, out) in &outs {
        assert_eq!(*code, Some(0), "{out}");
    }
    outs.into_iter().map(|(_, o)| o).collect()
}

fn cmd(bin: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(bin);
    c.args(["--elements", ELEMENTS, "--interval-ms", "0", "--seed"])
        .arg(SEED.to_string())
        .args(args);
    c
}

/// rank -> its `(step, checksum)` lines, in order.
fn steps(out: &str) -> BTreeMap<u32, Vec<(u64, String)>> {
    let mut m: BTreeMap<u32, Vec<(u64, String)>> = BTreeMap::new();
    for l in out.lines() {
        let w: Vec<&str> = l.split_whitespace().collect();
        if let ["rank", r, "step", k, "checksum", sum] = w[..] {
            assert_eq!(sum.len(), 16, "{l}");
            m.entry(r.parse().unwrap())
                .or_default()
                .push((k.parse().unwrap(), sum.to_string()));
        }
    }
    m
}

/// Every rank did steps 1..=STEPS in order, verified, and printed the digests of the closed forms
/// (`collective::Sums`, which nccl_allreduce.c computes on its own): ranks of one parity agree,
/// the two parities (different split communicators) do not.
fn check_job(out: &str) {
    assert!(!out.contains("MISMATCH"), "{out}");
    let m = steps(out);
    assert_eq!(
        m.keys().copied().collect::<Vec<_>>(),
        (0..WORLD).collect::<Vec<_>>(),
        "{out}"
    );
    let elements: usize = ELEMENTS.parse().unwrap();
    for (r, s) in &m {
        let sums = Sums::new(SEED, *r, WORLD, elements);
        let want: Vec<(u64, String)> = (1..=STEPS)
            .map(|k| (k, format!("{:016x}", sums.digest(k))))
            .collect();
        assert_eq!(s, &want, "rank {r}: {out}");
        assert!(
            out.lines()
                .any(|l| l.starts_with(&format!("rank {r} ready world {WORLD} "))),
            "{out}"
        );
    }
    for ((_, a), (_, b)) in m[&0].iter().zip(&m[&1]) {
        assert_ne!(a, b, "{out}");
    }
}

/// A simulated node of 4 GPUs, nccl_allreduce built for it, and the environment to run on it.
struct Job {
    sim: SimNode,
    c: PathBuf,
    env: Vec<(String, String)>,
    steps: String,
}

fn job() -> Job {
    let sim = node();
    let c = c_program(sim.dir());
    // The node's lib/ has libnccl.so.2 and the link libnccl.so that cudarc loads.
    let env = sim.env();
    Job {
        sim,
        c,
        env,
        steps: STEPS.to_string(),
    }
}

const LIMIT: Duration = Duration::from_secs(240);

/// A test of `scenario` with nccl_allreduce (`c`) and one with nccl-train (`rust`).
macro_rules! both {
    ($scenario:ident, $c:ident, $rust:ident) => {
        #[test]
        fn $c() {
            $scenario(true);
        }

        #[test]
        fn $rust() {
            $scenario(false);
        }
    };
}

/// Which program: the C one (built for the node) or nccl-train.
fn program(j: &Job, c: bool) -> &Path {
    if c {
        &j.c
    } else {
        Path::new(RUST)
    }
}

/// 4 ranks forked by one launcher.
fn forked(c: bool) {
    let j = job();
    let args = ["--ranks", "4", "--steps", &j.steps];
    let (code, out) = run(cmd(program(&j, c), &args), &j.env, LIMIT);
    assert_eq!(code, Some(0), "{out}");
    check_job(&out);
}

both!(forked, c_four_ranks_forked, rust_four_ranks_forked);

/// One rank per process (RANK, WORLD_SIZE, LOCAL_RANK, a shared rendezvous directory), then 2
/// launchers of 2 ranks (the shape of 2 containers of 2 ranks in one pod): ranks 0-1 on GPUs
/// 0-1, ranks 2-3 on GPUs 2-3.
fn separate(c: bool) {
    let j = job();
    let prog = program(&j, c);
    let dir = j.sim.dir().join("rendezvous-ranks");
    std::fs::create_dir(&dir).unwrap();
    let cmds = (0..WORLD)
        .map(|r| {
            let extra = vec![
                ("RANK".to_string(), r.to_string()),
                ("WORLD_SIZE".to_string(), WORLD.to_string()),
                ("LOCAL_RANK".to_string(), r.to_string()),
                ("NCCL_RENDEZVOUS_DIR".to_string(), dir.display().to_string()),
            ];
            (cmd(prog, &["--steps", &j.steps]), extra)
        })
        .collect();
    check_job(&succeeded(run_all(cmds, &j.env)));

    let dir = j.sim.dir().join("rendezvous-pod");
    std::fs::create_dir(&dir).unwrap();
    let d = dir.display().to_string();
    let half = |first: &str| {
        let args = [
            "--ranks",
            "2",
            "--rank",
            first,
            "--device",
            first,
            "--world-size",
            "4",
            "--rendezvous",
            &d,
            "--steps",
            &j.steps,
        ];
        (cmd(prog, &args), vec![])
    };
    check_job(&succeeded(run_all(vec![half("0"), half("2")], &j.env)));
}

both!(
    separate,
    c_one_rank_per_process_and_two_launchers,
    rust_one_rank_per_process_and_two_launchers
);

/// A flipped element of rank 2's reduced gradient at step 3: that rank names it, the others stop
/// at the same step, and the job exits 1.
fn corrupted(c: bool) {
    let j = job();
    let args = ["--ranks", "4", "--steps", "10", "--corrupt", "2:3:1234"];
    let (code, out) = run(cmd(program(&j, c), &args), &j.env, LIMIT);
    assert_eq!(code, Some(1), "{out}");
    let mismatches: Vec<&str> = out.lines().filter(|l| l.contains("MISMATCH")).collect();
    assert_eq!(mismatches.len(), 1, "{out}");
    assert!(
        mismatches[0].starts_with("MISMATCH rank 2 step 3 allreduce element 1234 got "),
        "{out}"
    );
    for r in [0, 1, 3] {
        assert!(
            out.contains(&format!(
                "rank {r}: step 3: stopping: 1 rank(s) failed verification"
            )),
            "rank {r}: {out}"
        );
    }
    let m = steps(&out);
    for r in 0..WORLD {
        let ks: Vec<u64> = m[&r].iter().map(|(k, _)| *k).collect();
        assert_eq!(ks, vec![1, 2], "rank {r}: {out}");
    }
    // The launcher's line for the first rank it saw fail.
    assert!(out.contains(" exited with "), "{out}");
}

both!(
    corrupted,
    c_corrupted_element_fails_the_job_naming_rank_step_element,
    rust_corrupted_element_fails_the_job_naming_rank_step_element
);
