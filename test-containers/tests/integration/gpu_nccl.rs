//! The simulated NCCL (`gpu/sim/libnccl`, `libnccl.so.2` of a simulated node) against NVIDIA's
//! real `libnccl.so.2` and nccl.h from the pinned `nvidia-nccl-cu13` wheel in the stack's venv:
//! its exports are a subset of the real library's; `ncclConfig_t`'s size and field offsets,
//! `ncclUniqueId`'s size, the enums and the version arithmetic agree with a C program compiled
//! against the wheel's nccl.h (`nccl_abi.c`, built here with the system's `cc`); both libraries
//! answer `ncclGetVersion`, `ncclGetErrorString` and `ncclGetLastError` alike.
//!
//! And NCCL at work: four ranks as four processes (`gpu-ckpt-nccl-ranks`), each on a simulated
//! GPU of its own, move real bytes between their device memory: allreduce of several types and
//! operators, broadcast, reduce, allgather, reducescatter, alltoall, sends and receives in a
//! group, a split, and two communicators of two unique ids that never mix; a rank that holds
//! back leaves the others' streams and events not ready until it comes.
//!
//! Needs the workspace built (`cargo build --workspace`) and the venv that `make deps` creates;
//! a missing one fails the test, it never skips it.

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use crate::common::gpu::{exports, nccl_wheel_file, stdout_lines, workspace_bin};
use serde_json::{json, Value};
use simgpu::nccl::{config_layout, enum_values, version_code, UNIQUE_ID_BYTES, VERSION};
use simgpu::testing::{SimConfig, SimNode};

/// How long a rank may take for its next line.
const LINE_WAIT: Duration = Duration::from_secs(90);

fn node(gpus: u32) -> SimNode {
    SimNode::start(SimConfig {
        gpus,
        memory_mib: 256,
        ..SimConfig::default()
    })
    .unwrap_or_else(|e| panic!("simulated node: {e:#}"))
}

/// nccl_abi.c built against the wheel's nccl.h, with stub CUDA headers in `dir`.
fn abi_program(dir: &Path) -> PathBuf {
    let header = nccl_wheel_file("include/nccl.h").unwrap_or_else(|e| panic!("{e:#}"));
    let stubs = dir.join("cuda-stubs");
    std::fs::create_dir_all(&stubs).unwrap();
    // nccl.h takes cudaStream_t and cudaEvent_t from the CUDA runtime's headers, opaque pointers.
    std::fs::write(
        stubs.join("cuda_runtime.h"),
        "typedef struct CUstream_st *cudaStream_t;\ntypedef struct CUevent_st *cudaEvent_t;\n",
    )
    .unwrap();
    std::fs::write(stubs.join("cuda_fp16.h"), "").unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/integration/nccl_abi.c");
    let bin = dir.join("nccl_abi");
    let out = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-O2", "-Wall", "-Werror", "-I"])
        .arg(&stubs)
        .arg("-I")
        .arg(header.parent().unwrap())
        .arg("-o")
        .arg(&bin)
        .arg(&src)
        .arg("-ldl")
        .output()
        .unwrap_or_else(|e| panic!("cc: {e}"));
    assert!(
        out.status.success(),
        "building nccl_abi.c against {} failed:\n{}",
        header.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    bin
}

/// The JSON lines of `bin args`, merged into one object.
fn json_of(bin: &Path, args: &[&Path]) -> Value {
    let out = Command::new(bin).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{} {args:?}: {}",
        bin.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let mut all = serde_json::Map::new();
    for l in String::from_utf8_lossy(&out.stdout).lines() {
        let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
        all.extend(v.as_object().unwrap().clone());
    }
    Value::Object(all)
}

#[test]
fn abi_agrees_with_nvidias_libnccl() {
    let sim = node(1);
    let real = nccl_wheel_file("lib/libnccl.so.2").unwrap_or_else(|e| panic!("{e:#}"));
    // Every export of the simulated library is an export of NVIDIA's, by the same name.
    let real_exports: HashSet<String> = exports(&real, "nccl").into_iter().collect();
    let sim_exports = exports(&sim.libnccl(), "nccl");
    let foreign: Vec<&String> = sim_exports
        .iter()
        .filter(|s| !real_exports.contains(*s))
        .collect();
    assert!(
        foreign.is_empty(),
        "exported by the simulated libnccl.so.2, not by NVIDIA's: {foreign:?}"
    );
    let needed = "ncclGetVersion ncclGetUniqueId ncclCommInitRank ncclCommInitRankConfig \
        ncclCommInitAll ncclCommSplit ncclCommFinalize ncclCommDestroy ncclCommAbort ncclCommCount \
        ncclCommCuDevice ncclCommUserRank ncclCommGetAsyncError ncclGetErrorString ncclGetLastError \
        ncclAllReduce ncclBroadcast ncclBcast ncclReduce ncclAllGather ncclReduceScatter ncclSend \
        ncclRecv ncclGroupStart ncclGroupEnd ncclCommRegister ncclCommDeregister ncclCommSuspend \
        ncclCommResume";
    for needed in needed.split_whitespace() {
        assert!(
            sim_exports.iter().any(|s| s == needed),
            "the simulated libnccl.so.2 does not export {needed}"
        );
    }

    let dir = tempfile::tempdir().unwrap();
    let abi = abi_program(dir.path());
    let h = json_of(&abi, &[]);
    // ncclConfig_t, field by field; ncclUniqueId; the enums' size.
    let (size, fields) = config_layout();
    assert_eq!(h["sizeof"]["ncclConfig_t"], size, "{h}");
    assert_eq!(h["initializer"]["size"], size, "{h}");
    let offsets = h["offsetof"].as_object().unwrap();
    assert_eq!(
        offsets.len(),
        fields.len(),
        "fields of ncclConfig_t: {offsets:?}"
    );
    for (name, off) in &fields {
        assert_eq!(offsets[*name], *off, "offsetof(ncclConfig_t, {name})");
    }
    assert_eq!(h["sizeof"]["ncclUniqueId"], UNIQUE_ID_BYTES);
    assert_eq!(
        h["sizeof"]["ncclUniqueId"],
        std::mem::size_of::<simgpu::nccl::UniqueId>()
    );
    for t in ["ncclResult_t", "ncclDataType_t", "ncclRedOp_t"] {
        assert_eq!(h["sizeof"][t], 4, "{t}");
    }
    for (name, v) in enum_values() {
        assert_eq!(h["enum"][name], v, "{name}");
    }
    // The version arithmetic (NCCL_VERSION) and the version the simulator has.
    let v = &h["version"];
    assert_eq!(v["v2_32_6"], version_code(2, 32, 6));
    assert_eq!(v["v2_8_4"], version_code(2, 8, 4));
    assert_eq!(v["v2_9_0"], version_code(2, 9, 0));
    assert_eq!(v["v3_0_1"], version_code(3, 0, 1));
    assert_eq!(
        (v["major"].clone(), v["minor"].clone(), v["patch"].clone()),
        (json!(VERSION.0), json!(VERSION.1), json!(VERSION.2))
    );
    assert_eq!(v["code"], version_code(VERSION.0, VERSION.1, VERSION.2));
    assert_eq!(h["initializer"]["magic"], simgpu::nccl::API_MAGIC);
    assert_eq!(h["initializer"]["version"], v["code"]);

    // Both libraries, without a GPU: the same version in the same form, the same strings.
    let real_lib = json_of(&abi, &[&real])["library"].clone();
    let sim_lib = json_of(&abi, &[&sim.libnccl()])["library"].clone();
    assert_eq!(real_lib["rc"], 0, "{real_lib}");
    assert_eq!(
        real_lib["version"], v["code"],
        "NVIDIA's ncclGetVersion: {real_lib}"
    );
    assert_eq!(sim_lib["rc"], 0, "{sim_lib}");
    assert_eq!(sim_lib["version"], real_lib["version"], "{sim_lib}");
    assert_eq!(
        sim_lib["null_rc"], real_lib["null_rc"],
        "ncclGetVersion(NULL)"
    );
    assert_eq!(sim_lib["errors"], real_lib["errors"], "ncclGetErrorString");
    for k in [
        "last_error",
        "after_version_null",
        "count_rc",
        "after_count_null",
        "group_end_rc",
        "after_group_end",
    ] {
        assert_eq!(sim_lib[k], real_lib[k], "{k}: {sim_lib} / {real_lib}");
    }
    assert_eq!(real_lib["count_rc"], 4, "ncclCommCount(NULL): {real_lib}");
}

/// One rank's process and its stdout lines.
struct Rank {
    child: Child,
    lines: Receiver<String>,
    seen: Vec<Value>,
}

impl Rank {
    fn start(sim: &SimNode, rank: usize, args: &[String]) -> Rank {
        let uuid = &sim.uuids()[rank];
        let mut cmd = ranks_cmd(sim);
        cmd.arg("rank")
            .args(args)
            .args(["--rank", &rank.to_string()]);
        // Each process sees its own GPU only, as device 0; stdin lets a test release it.
        cmd.env(simgpu::proto::ENV_VISIBLE, uuid);
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn gpu-ckpt-nccl-ranks");
        let rx = stdout_lines(&mut child);
        Rank {
            child,
            lines: rx,
            seen: Vec::new(),
        }
    }

    /// The next line whose `step` is `step` (earlier lines are kept in `seen`).
    fn step(&mut self, step: &str) -> Value {
        let deadline = Instant::now() + LINE_WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let l = self.lines.recv_timeout(left).unwrap_or_else(|e| {
                panic!(
                    "no {step:?} line from a rank ({e}); so far: {:?}",
                    self.seen
                )
            });
            let v: Value = serde_json::from_str(&l).unwrap_or_else(|e| panic!("{e}: {l}"));
            self.seen.push(v.clone());
            if v["step"] == step || (step == "done" && v["done"] == true) {
                return v;
            }
        }
    }

    fn stdin(&mut self) -> ChildStdin {
        self.child.stdin.take().expect("stdin")
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// gpu-ckpt-nccl-ranks on `sim`'s GPUs.
fn ranks_cmd(sim: &SimNode) -> Command {
    let mut c = Command::new(workspace_bin("gpu-ckpt-nccl-ranks"));
    c.envs(sim.env()).stdin(Stdio::null());
    c
}

/// What `gpu-ckpt-nccl-ranks <args>` printed, once it succeeded.
fn ranks_output(sim: &SimNode, args: &[&str]) -> String {
    let out = ranks_cmd(sim).args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?}: {stdout}\n{stderr}");
    stdout
}

fn unique_ids(sim: &SimNode, count: usize) -> Vec<String> {
    let ids: Vec<String> = ranks_output(sim, &["uid", "--count", &count.to_string()])
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(ids.len(), count);
    for id in &ids {
        assert_eq!(id.len(), 2 * UNIQUE_ID_BYTES, "{id}");
    }
    ids
}

/// The arguments of the `stuck` scenario for `n` ranks on a fresh unique id.
fn stuck_args(sim: &SimNode, n: usize) -> Vec<String> {
    let id = unique_ids(sim, 1).remove(0);
    [
        "--scenario",
        "stuck",
        "--nranks",
        &n.to_string(),
        "--id",
        &id,
    ]
    .map(str::to_string)
    .to_vec()
}

fn out_of(v: &Value) -> Vec<f64> {
    v["out"]
        .as_array()
        .unwrap_or_else(|| panic!("no out in {v}"))
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn floats(v: impl IntoIterator<Item = i64>) -> Vec<f64> {
    v.into_iter().map(|x| x as f64).collect()
}

#[test]
fn four_ranks_on_four_gpus_move_real_bytes() {
    const N: i64 = 4;
    let sim = node(N as u32);
    // Unique ids: never the same twice, within a call or across calls.
    let ids = unique_ids(&sim, 2);
    let more = unique_ids(&sim, 1);
    assert_ne!(ids[0], ids[1]);
    assert!(!ids.contains(&more[0]));
    let args: Vec<String> = [
        "--scenario",
        "all",
        "--nranks",
        "4",
        "--id",
        &ids[0],
        "--id2",
        &ids[1],
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut ranks: Vec<Rank> = (0..N as usize)
        .map(|r| Rank::start(&sim, r, &args))
        .collect();
    let inits: Vec<Value> = ranks.iter_mut().map(|r| r.step("init")).collect();
    for (r, (rank, init)) in ranks.iter_mut().zip(inits).enumerate() {
        let r = r as i64;
        assert_eq!(init["count"], N, "{init}");
        assert_eq!(init["rank"], r, "{init}");
        assert_eq!(init["device"], 0, "{init}");
        // A non-blocking communicator: ncclSuccess or ncclInProgress, then ready.
        assert!(init["init_rc"] == 0 || init["init_rc"] == 7, "{init}");
        let mut types = BTreeMap::new();
        for _ in 0..7 {
            let l = rank.step("allreduce");
            assert_eq!(l["op"], "sum", "{l}");
            types.insert(l["dtype"].as_str().unwrap().to_string(), out_of(&l));
        }
        // x[i] = rank + i + 1 on each rank: the sum over 4 ranks is 4 i + 10.
        let sum = floats((0..5).map(|i| 4 * i + 10));
        for t in [
            "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64",
        ] {
            assert_eq!(types.get(t), Some(&sum), "allreduce sum of {t} on rank {r}");
        }
        let l = rank.step("allreduce");
        assert_eq!(
            (l["op"].as_str(), out_of(&l)),
            (Some("max"), floats((0..4).map(|i| 6 - i)))
        );
        let l = rank.step("allreduce");
        assert_eq!(l["op"], "avg");
        assert_eq!(out_of(&l), vec![1.5, 2.5, 3.5, 4.5]);
        let l = rank.step("allreduce_inplace");
        assert_eq!(out_of(&l), floats((0..4).map(|i| 18 + 4 * i)), "{l}");
        let l = rank.step("broadcast");
        assert_eq!(out_of(&l), floats((0..4).map(|i| 200 + i)), "{l}");
        let l = rank.step("reduce");
        if r == 1 {
            assert_eq!(out_of(&l), floats((0..4).map(|i| 42 + 4 * i)), "{l}");
        } else {
            assert_eq!(l["out"], Value::Null);
        }
        let l = rank.step("allgather");
        let want = (0..N).flat_map(|s| (0..3).map(move |i| 10 * s + i));
        assert_eq!(out_of(&l), floats(want), "{l}");
        let l = rank.step("reducescatter");
        // Sum over ranks s of 8 s + j is 48 + 4 j; rank r gets j = 2r, 2r + 1.
        assert_eq!(out_of(&l), floats([48 + 8 * r, 52 + 8 * r]), "{l}");
        let l = rank.step("alltoall");
        assert_eq!(out_of(&l), floats((0..N).map(|j| 10 * j + r)), "{l}");
        let l = rank.step("sendrecv");
        let prev = (r + N - 1) % N;
        assert_eq!(l["from"], prev);
        assert_eq!(out_of(&l), floats((0..4).map(|i| 1000 * prev + i)), "{l}");
        // Split by parity, keys -rank: {0, 2} and {1, 3}, the higher rank first.
        let l = rank.step("split");
        assert_eq!(l["count"], 2, "{l}");
        assert_eq!(l["rank"], i64::from(r < 2), "{l}");
        let color = r % 2;
        assert_eq!(out_of(&l), floats([2 * color + 2]), "{l}");
        // Two communicators, called in opposite orders: each sums only its own values.
        let l = rank.step("two_comms");
        assert_eq!(l["a"], json!([10.0, 10.0, 10.0]), "{l}");
        assert_eq!(l["b"], json!([1000.0, 1000.0, 1000.0]), "{l}");
        let l = rank.step("async_error");
        assert_eq!(l["error"], 0, "{l}");
        rank.step("done");
    }
    for mut r in ranks {
        let st = r.child.wait().unwrap();
        assert!(st.success(), "a rank exited {st}");
    }
}

#[test]
fn a_rank_that_holds_back_leaves_the_others_streams_incomplete() {
    let sim = node(4);
    let args = stuck_args(&sim, 4);
    let mut ranks: Vec<Rank> = (0..4).map(|r| Rank::start(&sim, r, &args)).collect();
    ranks[3].step("holding");
    // Each rank holds its own GPU: the daemon lists the four processes, one per GPU.
    let procs = sim.processes().unwrap();
    let gpus: HashSet<[u8; 16]> = procs
        .iter()
        .filter(|p| ranks.iter().any(|r| r.child.id() == p.pid))
        .map(|p| p.gpu)
        .collect();
    assert_eq!(gpus.len(), 4, "{procs:?}");
    // The others enqueued their allreduce and returned; their streams and the events recorded
    // behind it are not ready (CUDA_ERROR_NOT_READY) while rank 3 has not contributed.
    for rank in &mut ranks[..3] {
        let l = rank.step("pending");
        assert_eq!(l["stream_query"], 600, "{l}");
        assert_eq!(l["event_query"], 600, "{l}");
    }
    std::thread::sleep(Duration::from_millis(500));
    for rank in &ranks[..3] {
        assert!(
            rank.lines.try_recv().is_err(),
            "a rank finished its allreduce without rank 3"
        );
    }
    writeln!(ranks[3].stdin(), "go").unwrap();
    for rank in &mut ranks {
        let l = rank.step("allreduce");
        assert_eq!(out_of(&l), vec![10.0; 4], "{l}");
        rank.step("done");
    }
}

#[test]
fn one_process_drives_two_gpus_through_init_all_groups_and_abort() {
    let sim = node(2);
    let stdout = ranks_output(&sim, &["single"]);
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let steps =
        |name: &str| -> Vec<&Value> { lines.iter().filter(|l| l["step"] == name).collect() };
    // ncclCommInitAll: one communicator of two ranks, rank i on device i.
    let all = steps("init_all");
    assert_eq!(all.len(), 2, "{stdout}");
    for (i, l) in all.iter().enumerate() {
        assert_eq!(
            (l["count"].clone(), l["rank"].clone(), l["device"].clone()),
            (json!(2), json!(i), json!(i)),
            "{l}"
        );
    }
    // One group of an allreduce per rank: 1 + 2 on both devices.
    for l in steps("group_allreduce") {
        assert_eq!(out_of(l), vec![3.0; 4], "{l}");
    }
    // Two ranks made in one group by one thread; a broadcast of rank 1's values (2).
    let inits = steps("group_init");
    assert_eq!(inits.len(), 2, "{stdout}");
    for l in inits {
        assert_eq!(l["rank"], l["index"], "{l}");
        assert_eq!(l["device"], l["index"], "{l}");
    }
    let bc = steps("group_broadcast");
    assert_eq!(bc.len(), 2, "{stdout}");
    for l in bc {
        assert_eq!(out_of(l), vec![2.0; 4], "{l}");
    }
    // The stream waited for rank 1 (CUDA_ERROR_NOT_READY) until ncclCommAbort released it.
    let a = steps("abort");
    assert_eq!(a.len(), 1, "{stdout}");
    assert_eq!(
        (a[0]["before"].clone(), a[0]["after"].clone()),
        (json!(600), json!(0)),
        "{}",
        a[0]
    );
    assert_eq!(lines.last().map(|l| l["done"].clone()), Some(json!(true)));
}

#[test]
fn two_ranks_on_one_gpu_are_refused() {
    let sim = node(2);
    let args = stuck_args(&sim, 2);
    // Both ranks on GPU 0: NCCL refuses the communicator on each (ncclInvalidUsage).
    let outs: Vec<std::process::Output> = std::thread::scope(|sc| {
        let runs: Vec<_> = (0..2)
            .map(|r| {
                let mut cmd = ranks_cmd(&sim);
                cmd.arg("rank").args(&args).args(["--rank", &r.to_string()]);
                cmd.env(simgpu::proto::ENV_VISIBLE, &sim.uuids()[0]);
                sc.spawn(move || cmd.output().unwrap())
            })
            .collect();
        runs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for out in outs {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "a rank on a shared GPU ran: {stderr}"
        );
        assert!(
            stderr.contains("ncclCommInitRank: ncclResult 5"),
            "not refused as invalid usage: {stderr}"
        );
    }
}

#[test]
fn docs_list_every_simulated_nccl_call() {
    let sim = node(1);
    let doc =
        std::fs::read_to_string(test_containers::stack::repo_root().join("docs/gpu-sim-api.md"))
            .expect("docs/gpu-sim-api.md");
    let missing: Vec<String> = exports(&sim.libnccl(), "nccl")
        .into_iter()
        .filter(|n| !doc.contains(&format!("`{n}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/gpu-sim-api.md does not list these exports: {missing:?}"
    );
}

#[test]
fn a_container_on_simulated_gpus_gets_the_simulated_libnccl() {
    use crate::common::gpu::{cdi_node, remove, run_gpu, sim_node, Runtime, KIND};
    let sim = sim_node(SimConfig {
        gpus: 1,
        memory_mib: 256,
        ..SimConfig::default()
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
    let node = cdi_node("gpu-nccl-cdi", &sim).unwrap_or_else(|e| panic!("{e:#}"));
    let log = node.paths().dir.join("nccl-lib.log");
    let id = "nccl-lib";
    let pid = run_gpu(
        &node,
        Runtime::GpuCkpt,
        &format!("{KIND}=0"),
        id,
        &log,
        &["sleep", "1000"],
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    // The loader's name links to the versioned file the CDI spec mounted, whose bytes are the
    // node's libnccl.so.2.
    let root = PathBuf::from(format!("/proc/{pid}/root/usr/lib/x86_64-linux-gnu"));
    let link = std::fs::read_link(root.join("libnccl.so.2"));
    let inside = std::fs::read(root.join("libnccl.so.2"));
    remove(&node, id);
    assert_eq!(
        link.expect("libnccl.so.2 in the container"),
        Path::new(&format!("libnccl.so.{}", simgpu::nccl::VERSION_STRING))
    );
    assert!(
        inside.expect("reading it") == std::fs::read(sim.libnccl()).unwrap(),
        "the container's libnccl.so.2 is not the node's"
    );
}
