//! The NCCL workloads (`c/nccl_allreduce.c`, `nccl-train`) on the simulated driver and NCCL:
//! 4 ranks on 4 simulated GPUs, forked by one launcher and as 4 separate processes meeting in a
//! rendezvous directory (and as 2 launchers of 2 ranks, the shape of 2 containers of one pod);
//! every step verified, the two programs giving the same digests; a corrupted element makes the
//! job fail naming the rank, step and element. Needs the workspace build (`make build`: the
//! daemon, libcuda.so.1 and libnccl.so.2) and the stack's NCCL wheel (c/build.sh).

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use simgpu::testing::{SimConfig, SimNode};

const WORLD: u32 = 4;
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
    c.args(["--elements", ELEMENTS, "--interval-ms", "0", "--seed", "7"])
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

/// Every rank did steps 1..=STEPS in order, verified; ranks of one parity agree on the digests,
/// the two parities (different split communicators) do not. Returns rank 0's and rank 1's.
fn check_job(out: &str) -> [Vec<(u64, String)>; 2] {
    assert!(!out.contains("MISMATCH"), "{out}");
    let m = steps(out);
    assert_eq!(
        m.keys().copied().collect::<Vec<_>>(),
        (0..WORLD).collect::<Vec<_>>(),
        "{out}"
    );
    for (r, s) in &m {
        let ks: Vec<u64> = s.iter().map(|(k, _)| *k).collect();
        assert_eq!(ks, (1..=STEPS).collect::<Vec<_>>(), "rank {r}: {out}");
        assert_eq!(s, &m[&(r % 2)], "rank {r} against rank {}: {out}", r % 2);
        assert!(
            out.lines()
                .any(|l| l.starts_with(&format!("rank {r} ready world {WORLD} "))),
            "{out}"
        );
    }
    for ((_, a), (_, b)) in m[&0].iter().zip(&m[&1]) {
        assert_ne!(a, b, "{out}");
    }
    [m[&0].clone(), m[&1].clone()]
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

#[test]
fn four_ranks_forked_in_c_and_in_rust() {
    let j = job();
    let mut digests = Vec::new();
    for prog in [j.c.as_path(), Path::new(RUST)] {
        let args = ["--ranks", "4", "--steps", &j.steps];
        let (code, out) = run(cmd(prog, &args), &j.env, LIMIT);
        assert_eq!(code, Some(0), "{out}");
        digests.push(check_job(&out));
    }
    assert_eq!(digests[0], digests[1], "nccl_allreduce against nccl-train");
}

/// One rank per process (RANK, WORLD_SIZE, LOCAL_RANK, a shared rendezvous directory): C ranks
/// and Rust ranks, each job on its own directory; then 2 launchers of 2 ranks (2 containers of
/// 2 ranks in one pod).
#[test]
fn one_rank_per_process_and_two_launchers() {
    let j = job();
    let (sim, bin, e, s) = (&j.sim, &j.c, &j.env, &j.steps);
    let mut digests = Vec::new();
    for (name, prog) in [("c", bin.as_path()), ("rust", Path::new(RUST))] {
        eprintln!("{name}: one rank per process");
        let dir = sim.dir().join(format!("rendezvous-{name}"));
        std::fs::create_dir(&dir).unwrap();
        let cmds = (0..WORLD)
            .map(|r| {
                let extra = vec![
                    ("RANK".to_string(), r.to_string()),
                    ("WORLD_SIZE".to_string(), WORLD.to_string()),
                    ("LOCAL_RANK".to_string(), r.to_string()),
                    ("NCCL_RENDEZVOUS_DIR".to_string(), dir.display().to_string()),
                ];
                (cmd(prog, &["--steps", s]), extra)
            })
            .collect();
        digests.push(check_job(&succeeded(run_all(cmds, e))));
    }
    assert_eq!(digests[0], digests[1]);

    // Two launchers: ranks 0-1 on GPUs 0-1, ranks 2-3 on GPUs 2-3.
    let dir = sim.dir().join("rendezvous-pod");
    std::fs::create_dir(&dir).unwrap();
    let d = dir.display().to_string();
    let half = |first: &str, device: &str| {
        let args = [
            "--ranks",
            "2",
            "--rank",
            first,
            "--device",
            device,
            "--world-size",
            "4",
            "--rendezvous",
            &d,
            "--steps",
            s,
        ];
        (cmd(bin, &args), vec![])
    };
    let all = succeeded(run_all(vec![half("0", "0"), half("2", "2")], e));
    assert_eq!(check_job(&all), digests[0]);
}

/// A flipped element of rank 2's reduced gradient at step 3: that rank names it, the others stop
/// at the same step, and the job exits 1, in both programs.
#[test]
fn a_corrupted_element_fails_the_job_naming_rank_step_element() {
    let j = job();
    for prog in [j.c.as_path(), Path::new(RUST)] {
        let args = ["--ranks", "4", "--steps", "10", "--corrupt", "2:3:1234"];
        let (code, out) = run(cmd(prog, &args), &j.env, LIMIT);
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
}
