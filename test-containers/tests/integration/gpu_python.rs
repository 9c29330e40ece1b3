//! NVIDIA's own Python clients on the simulated driver: cuda-bindings (the driver API through
//! cuGetProcAddress_v2, the whole checkpoint API, CUDA 13.4 custom storage) and nvidia-ml-py,
//! plus cuGetProcAddress itself through ctypes. The scripts live in
//! `test-containers/gpu-workloads/python/`; they print one JSON object per line, asserted on here.
//!
//! Needs the workspace built (`cargo build --workspace`) and the Python venv that `make deps`
//! creates under the stack prefix (`$GPU_CKPT_STACK/py`, pinned versions in
//! test-containers/stack/install.sh). A missing venv fails the test; it never skips it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::gpu::{exports, stdout_lines, workspace_bin};
use serde_json::Value;
use simgpu::testing::{SimConfig, SimNode};

fn repo() -> PathBuf {
    test_containers::stack::repo_root()
}

fn scripts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("gpu-workloads/python")
}

/// The venv's python: `$GPU_CKPT_STACK/py/bin/python`, else `<repo>/.stack/py/bin/python`.
fn python() -> PathBuf {
    test_containers::stack::venv_python("cuda-bindings and nvidia-ml-py")
        .unwrap_or_else(|e| panic!("{e}"))
}

fn node(gpus: u32, cuda_version: i32) -> SimNode {
    SimNode::start(SimConfig {
        gpus,
        memory_mib: 1024,
        cuda_version,
        ..SimConfig::default()
    })
    .unwrap_or_else(|e| panic!("simulated node: {e:#}"))
}

/// Runs a script with the venv's python on `sim`; its JSON lines, or a panic with its output.
fn run_py(sim: &SimNode, script: &str, args: &[String]) -> Vec<Value> {
    let out = Command::new(python())
        .arg(scripts().join(script))
        .args(args)
        .envs(sim.env())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .current_dir(scripts())
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running {script}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{script} {args:?} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{script}: {e}: {l}")))
        .collect();
    assert!(
        lines.last().is_some_and(|l| l["done"] == true),
        "{script} did not finish: {stdout}\n{stderr}"
    );
    lines
}

fn find<'a>(lines: &'a [Value], key: &str, value: impl Into<Value>) -> &'a Value {
    let value = value.into();
    lines
        .iter()
        .find(|l| l[key] == value)
        .unwrap_or_else(|| panic!("no line with {key} = {value} in {lines:#?}"))
}

/// gpu-fill on every GPU of `sim`, once it printed `filled`.
struct Fill {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Fill {
    fn start(sim: &SimNode, mib: u64) -> Fill {
        let mut child = Command::new(workspace_bin("gpu-fill"))
            .args(["--mib", &mib.to_string(), "--devices", "all"])
            .envs(sim.env())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn gpu-fill");
        let rx = stdout_lines(&mut child);
        let mut f = Fill { child, lines: rx };
        let l = f.line();
        assert!(l.starts_with("filled "), "gpu-fill: {l}");
        f
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Runs checkpoint.py against this process in `mode`, onto swapped GPUs if `swap`.
    fn checkpoint_py(&self, sim: &SimNode, mode: &str, swap: bool) -> Vec<Value> {
        let mut args = vec![
            "--pid".to_string(),
            self.pid().to_string(),
            "--mode".into(),
            mode.into(),
        ];
        if swap {
            args.push("--swap".into());
        }
        run_py(sim, "checkpoint.py", &args)
    }

    fn line(&mut self) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        self.lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .unwrap_or_else(|e| panic!("gpu-fill printed nothing ({e})"))
    }

    /// SIGUSR1: gpu-fill checks every byte of its pattern.
    fn verify(&mut self) -> String {
        // SAFETY: kill(2) on our own child.
        assert_eq!(unsafe { libc::kill(self.pid(), libc::SIGUSR1) }, 0);
        self.line()
    }
}

impl Drop for Fill {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The steps of checkpoint.py as (step, result, state).
fn steps(lines: &[Value]) -> Vec<(String, String, String)> {
    lines
        .iter()
        .filter(|l| l["result"].is_string())
        .map(|l| {
            (
                l["step"].as_str().unwrap_or_default().to_string(),
                l["result"].as_str().unwrap_or_default().to_string(),
                l["state"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

fn owned(v: &[(&str, &str, &str)]) -> Vec<(String, String, String)> {
    v.iter()
        .map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string()))
        .collect()
}

/// The steps of a plain round trip, each succeeding (lock, checkpoint, restore, unlock), with
/// `between` after the lock.
fn round_trip(between: &[(&str, &str, &str)]) -> Vec<(String, String, String)> {
    let mut all = vec![("lock", "CUDA_SUCCESS", "CU_PROCESS_STATE_LOCKED")];
    all.extend_from_slice(between);
    all.extend_from_slice(&[
        (
            "checkpoint",
            "CUDA_SUCCESS",
            "CU_PROCESS_STATE_CHECKPOINTED",
        ),
        ("restore", "CUDA_SUCCESS", "CU_PROCESS_STATE_LOCKED"),
        ("unlock", "CUDA_SUCCESS", "CU_PROCESS_STATE_RUNNING"),
    ]);
    owned(&all)
}

#[test]
fn cuda_bindings_runs_on_the_simulated_driver() {
    let sim = node(2, 13000);
    let lines = run_py(&sim, "cuda_basics.py", &[]);
    let head = &lines[0];
    assert_eq!(head["cuda_version"], 13000, "{head}");
    assert_eq!(head["count"], 2, "{head}");
    assert_eq!(head["bindings"], "13.5.0", "{head}");
    for (i, g) in sim.node().gpus.iter().enumerate() {
        let d = find(&lines, "device", i);
        assert_eq!(d["name"], g.name.as_str(), "{d}");
        assert_eq!(d["uuid"], sim.uuids()[i].as_str(), "{d}");
        assert_eq!(d["total"], g.memory_bytes, "{d}");
        assert_eq!(d["pci"], &g.pci_bus_id[4..], "{d}");
        assert_eq!(d["cc_major"], g.cc.0, "{d}");
    }
    let m = &lines
        .iter()
        .find(|l| l["memory"].is_object())
        .expect("memory")["memory"];
    let total = sim.node().gpus[0].memory_bytes;
    assert_eq!(m["total"], total, "{m}");
    assert_eq!(m["free_before"], total, "{m}");
    // Two 3 MiB allocations in 2 MiB granules.
    assert_eq!(m["free_allocated"], total - (4 << 20), "{m}");
    assert_eq!(m["free_after"], total, "{m}");
    let k = lines
        .iter()
        .find(|l| l["module_load"].is_string())
        .expect("module_load");
    assert_eq!(k["module_load"], "CUDA_ERROR_NOT_SUPPORTED");
}

#[test]
fn nvidia_ml_py_runs_and_lists_a_process_that_uses_the_device() {
    let sim = node(2, 13000);
    let fill = Fill::start(&sim, 8);
    let lines = run_py(&sim, "nvml_basics.py", &[]);
    let head = &lines[0];
    assert_eq!(head["driver_version"], sim.node().driver_version.as_str());
    assert_eq!(head["cuda_version"], 13000);
    assert_eq!(head["cuda_version_v2"], 13000);
    assert_eq!(head["count"], 2);
    assert_eq!(head["pynvml"], "13.615.71");
    for (i, g) in sim.node().gpus.iter().enumerate() {
        let d = find(&lines, "device", i);
        assert_eq!(d["uuid"], sim.uuids()[i].as_str(), "{d}");
        assert_eq!(d["name"], g.name.as_str(), "{d}");
        assert_eq!(d["total"], g.memory_bytes, "{d}");
        assert_eq!(d["total_v2"], g.memory_bytes, "{d}");
        assert_eq!(d["used"], 8u64 << 20, "{d}");
        assert_eq!(d["pci"], g.pci_bus_id.as_str(), "{d}");
        assert_eq!(d["index_by_uuid"], i, "{d}");
        assert_eq!(d["index_by_pci"], i, "{d}");
        let procs = d["processes"].as_array().expect("processes");
        assert!(
            procs
                .iter()
                .any(|p| p["pid"] == fill.pid() && p["used"] == 8u64 << 20),
            "gpu-fill (pid {}) is not listed on GPU {i}: {procs:?}",
            fill.pid()
        );
    }
}

#[test]
fn cuda_and_nvml_agree_on_uuids_names_and_the_cuda_version() {
    let sim = node(3, 12090);
    let cuda = run_py(&sim, "cuda_basics.py", &[]);
    let nvml = run_py(&sim, "nvml_basics.py", &[]);
    assert_eq!(cuda[0]["cuda_version"], nvml[0]["cuda_version"]);
    assert_eq!(cuda[0]["cuda_version"], 12090);
    assert_eq!(cuda[0]["count"], nvml[0]["count"]);
    for i in 0..3 {
        let c = find(&cuda, "device", i);
        let n = find(&nvml, "device", i);
        assert_eq!(c["uuid"], n["uuid"], "GPU {i}: {c} / {n}");
        assert_eq!(c["name"], n["name"], "GPU {i}: {c} / {n}");
        assert_eq!(c["total"], n["total"], "GPU {i}: {c} / {n}");
        // CUDA prints a 4-digit PCI domain, NVML 8.
        let (cp, np) = (c["pci"].as_str().unwrap(), n["pci"].as_str().unwrap());
        assert_eq!(cp, &np[4..], "GPU {i}");
    }
}

#[test]
fn checkpoint_api_through_cuda_bindings() {
    // CUDA 12.8/12.9: no GPU pairs; 13.0: restore onto swapped GPUs.
    for (version, swap) in [(12080, false), (13000, true)] {
        let sim = node(2, version);
        let mut fill = Fill::start(&sim, 8);
        let lines = fill.checkpoint_py(&sim, "plain", swap);
        let t = find(&lines, "step", "restore_thread");
        assert_eq!(t["in_target"], true, "{t}");
        assert_eq!(
            find(&lines, "step", "initial")["state"],
            "CU_PROCESS_STATE_RUNNING"
        );
        assert_eq!(steps(&lines), round_trip(&[]), "CUDA {version}");
        assert_eq!(
            fill.verify(),
            format!("verified {} bytes", 2 * (8 << 20)),
            "CUDA {version}"
        );
    }
}

#[test]
fn custom_storage_checkpoint_and_restore_keep_every_byte() {
    // cuda-bindings 13.5 asks for cuCheckpointOperationComplete at 13041, so the node must be
    // newer than that (a 13040 node answers CUDA_ERROR_INVALID_VALUE, as NVIDIA documents).
    let sim = node(2, 13050);
    let mut fill = Fill::start(&sim, 8);
    let per_gpu = 8u64 << 20;
    let lines = fill.checkpoint_py(&sim, "custom", true);
    assert_eq!(
        steps(&lines),
        owned(&[
            ("lock", "CUDA_SUCCESS", "CU_PROCESS_STATE_LOCKED"),
            (
                "checkpoint_without_context",
                "CUDA_ERROR_INVALID_CONTEXT",
                "CU_PROCESS_STATE_LOCKED"
            ),
            (
                "checkpoint_self",
                "CUDA_ERROR_INVALID_VALUE",
                "CU_PROCESS_STATE_LOCKED"
            ),
            (
                "checkpoint",
                "CUDA_SUCCESS",
                "CU_PROCESS_STATE_CHECKPOINTING"
            ),
            (
                "complete_checkpoint",
                "CUDA_SUCCESS",
                "CU_PROCESS_STATE_CHECKPOINTED"
            ),
            ("range_after_complete", "CUDA_ERROR_INVALID_VALUE", ""),
            ("complete_twice", "CUDA_ERROR_INVALID_HANDLE", ""),
            (
                "restore_plain",
                "CUDA_ERROR_INVALID_VALUE",
                "CU_PROCESS_STATE_CHECKPOINTED"
            ),
            ("restore", "CUDA_SUCCESS", "CU_PROCESS_STATE_RESTORING"),
            (
                "complete_restore",
                "CUDA_SUCCESS",
                "CU_PROCESS_STATE_LOCKED"
            ),
            ("unlock", "CUDA_SUCCESS", "CU_PROCESS_STATE_RUNNING"),
        ])
    );
    // One contiguous range per GPU, holding all of the target's memory there.
    let out = find(&lines, "step", "copy_out");
    let ranges = out["ranges"].as_array().expect("ranges");
    assert_eq!(ranges.len(), 2, "{out}");
    assert!(ranges.iter().all(|r| r["size"] == per_gpu), "{out}");
    assert_eq!(out["bytes"], 2 * per_gpu);
    assert_eq!(find(&lines, "step", "copy_in")["bytes"], 2 * per_gpu);
    // The target, restored onto swapped GPUs from this process's copy, has every byte.
    assert_eq!(fill.verify(), format!("verified {} bytes", 2 * per_gpu));
    // The mappings are gone: only the target's own memory is counted.
    for i in 0..2 {
        assert_eq!(
            sim.free_bytes(i).expect("free"),
            sim.node().gpus[i].memory_bytes - per_gpu
        );
    }
}

#[test]
fn custom_storage_is_refused_before_cuda_13_4() {
    let sim = node(1, 13000);
    let mut fill = Fill::start(&sim, 4);
    let lines = fill.checkpoint_py(&sim, "refused", false);
    assert_eq!(
        steps(&lines),
        round_trip(&[
            (
                "checkpoint_custom",
                "CUDA_ERROR_INVALID_VALUE",
                "CU_PROCESS_STATE_LOCKED"
            ),
            ("proc_address_complete", "CUDA_SUCCESS", ""),
        ])
    );
    let p = find(&lines, "step", "proc_address_complete");
    assert_eq!(p["status"], "CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT");
    assert_eq!(p["found"], false);
    assert_eq!(fill.verify(), format!("verified {} bytes", 4 << 20));
}

#[test]
fn cu_get_proc_address_abis_statuses_and_every_export() {
    let sim = node(1, 13040);
    let names = exports(&sim.libcuda(), "cu").join(",");
    let lines = run_py(&sim, "procaddr.py", &["--exports".into(), names]);
    // The checks the script made, each with what it got.
    for check in [
        "cuDeviceGetUuid@9020",
        "cuDeviceGetUuid@11040",
        "cuDeviceTotalMem@3020",
        "cuMemcpyHtoD@7000 per-thread",
        "unknown symbol",
        "older than the symbol",
        "beyond the driver",
        "cuCheckpointOperationComplete@13040",
    ] {
        let l = find(&lines, "check", check);
        assert_eq!(l["got"], l["want"], "{l}");
    }
    assert_eq!(find(&lines, "check", "unknown symbol")["got"][2], 1);
    assert_eq!(find(&lines, "check", "beyond the driver")["got"][0], 1);
    assert_eq!(find(&lines, "check", "beyond the driver")["got"][2], 2);
    let all = find(&lines, "check", "every export reachable");
    assert_eq!(all["unreachable"], serde_json::json!([]), "{all}");
}

#[test]
fn docs_list_every_simulated_call() {
    let sim = node(1, 13000);
    let doc =
        std::fs::read_to_string(repo().join("docs/gpu-sim-api.md")).expect("docs/gpu-sim-api.md");
    let mut missing = Vec::new();
    for (lib, prefix) in [(sim.libcuda(), "cu"), (sim.libnvml(), "nvml")] {
        for name in exports(&lib, prefix) {
            if !doc.contains(&format!("`{name}`")) {
                missing.push(name);
            }
        }
    }
    assert!(
        missing.is_empty(),
        "docs/gpu-sim-api.md does not list these exports: {missing:?}"
    );
}
