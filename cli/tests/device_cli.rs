//! `gpu-ckpt device`: usage and driver errors, and every action against the simulated driver.
//!
//! The simulated-driver test needs the workspace built first (`cargo build --workspace`): the
//! daemon, the simulated libraries and `gpu-fill` are found next to the test executable.

mod command;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use simgpu::proto::FaultOp;
use simgpu::testing::{SimConfig, SimNode};

fn run(args: &[&str]) -> (i32, String, String) {
    let args: Vec<&str> = std::iter::once("device")
        .chain(args.iter().copied())
        .collect();
    command::run(&args, &["GPU_CKPT_SIM_SOCKET"])
}

#[test]
fn usage_and_missing_driver() {
    for args in [
        &["--pid", "1"][..],
        &["--get-state"],
        &["--pid", "1", "--get-state", "--toggle"],
        &["--pid", "1", "--get-state", "--timeout", "10"],
        &[
            "--pid",
            "1",
            "--action",
            "lock",
            "--device-map",
            "GPU-x=GPU-y",
        ],
        &[
            "--pid",
            "1",
            "--action",
            "restore",
            "--device-map",
            "nonsense",
        ],
        &["--pid", "1", "--action", "freeze"],
        &["--pid", "0", "--get-state"],
        &["--pid", "1", "--get-state", "--json"],
    ] {
        let (rc, _, err) = run(args);
        assert_eq!(rc, 2, "{args:?}: {err}");
    }
    let (rc, out, err) = run(&[
        "--pid",
        "1",
        "--get-state",
        "--libcuda",
        "/nonexistent/gpu-ckpt/libcuda.so.1",
    ]);
    assert_eq!(rc, 1, "{err}");
    assert!(out.is_empty());
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("gpu-ckpt device: load pid 1 failed: no NVIDIA driver"),
        "{err}"
    );
    let (rc, _, err) = run(&[
        "--list",
        "--libnvml",
        "/nonexistent/gpu-ckpt/libnvidia-ml.so.1",
    ]);
    assert_eq!(rc, 1, "{err}");
    assert!(err.contains("no NVIDIA driver"), "{err}");
}

fn gpu_fill_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("GPU_CKPT_GPU_FILL") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap();
    let mut dir = exe.parent();
    for _ in 0..2 {
        let Some(d) = dir else { break };
        if d.join("gpu-fill").is_file() {
            return d.join("gpu-fill");
        }
        dir = d.parent();
    }
    panic!(
        "gpu-fill not found next to {}: build the workspace first",
        exe.display()
    )
}

struct Fill(Child);

impl Fill {
    fn start(n: &SimNode) -> Fill {
        let mut child = Command::new(gpu_fill_binary())
            .args(["--mib", "4", "--devices", "0"])
            .envs(n.env())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert!(line.starts_with("filled "), "gpu-fill printed {line:?}");
        Fill(child)
    }
    fn pid(&self) -> String {
        self.0.id().to_string()
    }
}

impl Drop for Fill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn every_action_against_the_simulated_driver() {
    let n = SimNode::start(SimConfig {
        gpus: 2,
        ..SimConfig::default()
    })
    .expect("start the simulated node (build the workspace first)");
    let lib = n.libcuda().display().to_string();
    let nvml = n.libnvml().display().to_string();
    let w = Fill::start(&n);
    let pid = w.pid();
    let dev = |extra: &[&str]| {
        let mut a = vec!["--libcuda", lib.as_str(), "--pid", pid.as_str()];
        a.extend_from_slice(extra);
        run(&a)
    };
    let state = |want: &str| {
        let (rc, out, err) = dev(&["--get-state"]);
        assert_eq!(
            (rc, out.as_str()),
            (0, format!("{want}\n").as_str()),
            "{err}"
        );
    };

    // --list, text and JSON.
    let (rc, out, err) = run(&["--list", "--libnvml", &nvml]);
    assert_eq!(rc, 0, "{err}");
    assert!(
        out.contains("580.95.05") && out.contains("CUDA 13.0"),
        "{out}"
    );
    for u in n.uuids() {
        assert!(out.contains(&u), "{out}");
    }
    let (rc, out, err) = run(&["--list", "--json", "--libnvml", &nvml]);
    assert_eq!(rc, 0, "{err}");
    let inv: gpu::NodeInventory = serde_json::from_str(&out).unwrap();
    assert_eq!(inv.gpus.len(), 2);
    assert_eq!(inv.cuda_driver_version, 13000);

    state("running");
    let (rc, out, err) = dev(&["--get-restore-tid"]);
    assert_eq!(rc, 0, "{err}");
    assert!(out.trim().parse::<i32>().unwrap() > 0, "{out}");

    // Wrong state: one line naming the step, the pid and the driver's error.
    let (rc, _, err) = dev(&["--action", "unlock"]);
    assert_eq!(rc, 1);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("unlock") && err.contains(&format!("pid {pid}")),
        "{err}"
    );
    assert!(err.contains("CUDA_ERROR_ILLEGAL_STATE"), "{err}");

    // Lock timeout.
    n.fault(Some(w.0.id() as i32), FaultOp::LockTimeout, true)
        .unwrap();
    let (rc, _, err) = dev(&["--action", "lock", "-t", "200"]);
    assert_eq!(rc, 1);
    assert!(
        err.contains("lock") && err.contains("CUDA_ERROR_TIMEOUT"),
        "{err}"
    );
    n.fault(Some(w.0.id() as i32), FaultOp::LockTimeout, false)
        .unwrap();
    state("running");

    // Toggle there and back.
    let (rc, _, err) = dev(&["--toggle", "--timeout", "10000"]);
    assert_eq!(rc, 0, "{err}");
    state("checkpointed");
    let (rc, _, err) = dev(&["--toggle"]);
    assert_eq!(rc, 0, "{err}");
    state("running");

    // Step by step, onto GPU 1.
    let u = n.uuids();
    for (a, want) in [("lock", "locked"), ("checkpoint", "checkpointed")] {
        let (rc, _, err) = dev(&["--action", a]);
        assert_eq!(rc, 0, "{a}: {err}");
        state(want);
    }
    let map = format!("{}={}", u[0], u[1]);
    let (rc, _, err) = dev(&["--action", "restore", "--device-map", &map]);
    assert_eq!(rc, 0, "{err}");
    state("locked");
    // Locked: --toggle refuses.
    let (rc, _, err) = dev(&["--toggle"]);
    assert_eq!(rc, 1);
    assert!(err.contains("locked"), "{err}");
    let (rc, _, err) = dev(&["--action", "unlock"]);
    assert_eq!(rc, 0, "{err}");
    state("running");
}

#[test]
fn remap_refused_on_cuda_12_8() {
    let n = SimNode::start(SimConfig {
        gpus: 2,
        driver_version: "570.86.10".into(),
        cuda_version: 12080,
        uuid_seed: "cli-12-8".into(),
        ..SimConfig::default()
    })
    .expect("start the simulated node (build the workspace first)");
    let lib = n.libcuda().display().to_string();
    let w = Fill::start(&n);
    let pid = w.pid();
    let (rc, _, err) = run(&["--libcuda", &lib, "-p", &pid, "--toggle"]);
    assert_eq!(rc, 0, "{err}");
    let u = n.uuids();
    let map = format!("{}={}", u[0], u[1]);
    let (rc, _, err) = run(&[
        "--libcuda",
        &lib,
        "-p",
        &pid,
        "--toggle",
        "--device-map",
        &map,
    ]);
    assert_eq!(rc, 1);
    assert!(
        err.contains("12.8") && err.contains("no GPU remapping"),
        "{err}"
    );
    let (rc, out, _) = run(&["--libcuda", &lib, "-p", &pid, "--get-state"]);
    assert_eq!((rc, out.as_str()), (0, "checkpointed\n"));
}
