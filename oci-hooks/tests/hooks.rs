//! The built `gpu-ckpt-hook` run as runc runs it (the state JSON on stdin) against the simulated
//! NVIDIA driver. Build the simulator first:
//! `cargo build -p gpu-ckpt-simcuda -p gpu-ckpt-simnvml -p gpu-ckpt-simnccl -p gpu-ckpt-simgpu`.

use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use gpu::assign::{Assigned, Source};
use gpu::{GpuUuid, Inventory, NodeInventory, NvmlInventory};
use image_format::compat::{Profile, BUNDLE_GPUS_FILE, BUNDLE_RESTORE_DEVICES_FILE};
use image_format::manifest::Devices;
use serde_json::{json, Value};
use simgpu::testing::{SimConfig, SimNode};

const HOOK: &str = env!("CARGO_BIN_EXE_gpu-ckpt-hook");

fn sim(cfg: SimConfig) -> SimNode {
    SimNode::start(cfg).expect(
        "start the simulated node (build it first: cargo build -p gpu-ckpt-simcuda \
         -p gpu-ckpt-simnvml -p gpu-ckpt-simnccl -p gpu-ckpt-simgpu)",
    )
}

fn two_gpus(seed: &str) -> SimNode {
    sim(SimConfig {
        gpus: 2,
        cdi: true,
        uuid_seed: seed.to_string(),
        ..Default::default()
    })
}

fn uuids(n: &SimNode) -> Vec<GpuUuid> {
    n.uuids().iter().map(|u| u.parse().unwrap()).collect()
}

fn inventory(n: &SimNode) -> NodeInventory {
    NvmlInventory::load_from(n.libnvml())
        .expect("load the node's NVML")
        .node()
        .unwrap()
}

/// containerd's default spec with the CDI edits of the simulated devices `devices` (by name, in
/// order) applied, as containerd's CDI injection does: the spec-wide edits, then each device's.
fn cdi_spec(n: &SimNode, devices: &[&str]) -> Value {
    let cdi: Value = serde_json::from_slice(
        &std::fs::read(n.cdi_dir().join("sim.gpu-ckpt.io-gpu.json")).expect("the sim's CDI spec"),
    )
    .unwrap();
    let mut spec = oci_hooks::base_spec::default_spec().unwrap();
    spec["process"]["args"] = json!(["sh"]);
    let mut edits = vec![&cdi["containerEdits"]];
    for name in devices {
        let dev = cdi["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["name"] == *name)
            .unwrap_or_else(|| panic!("no CDI device {name}"));
        edits.push(&dev["containerEdits"]);
    }
    let mut mounts = spec["mounts"].as_array().unwrap().clone();
    let mut env: Vec<Value> = Vec::new();
    let mut devices: Vec<Value> = Vec::new();
    for e in edits {
        // As containerd's CDI does: the node's type and numbers from its host path.
        for d in e["deviceNodes"].as_array().into_iter().flatten() {
            let host = d["hostPath"].as_str().or(d["path"].as_str()).unwrap();
            let rdev = std::fs::symlink_metadata(host)
                .expect("the node's host path")
                .rdev();
            devices.push(json!({
                "path": d["path"],
                "type": "c",
                "major": ((rdev >> 8) & 0xfff) | ((rdev >> 32) & !0xfff),
                "minor": (rdev & 0xff) | ((rdev >> 12) & !0xff),
            }));
        }
        for m in e["mounts"].as_array().into_iter().flatten() {
            mounts.push(json!({
                "destination": m["containerPath"],
                "type": "bind",
                "source": m["hostPath"],
                "options": m["options"],
            }));
        }
        env.extend(e["env"].as_array().into_iter().flatten().cloned());
    }
    spec["mounts"] = json!(mounts);
    spec["process"]["env"] = json!(env);
    let mut all = spec["linux"]["devices"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    all.extend(devices);
    spec["linux"]["devices"] = json!(all);
    spec
}

struct Bundle {
    dir: tempfile::TempDir,
}

impl Bundle {
    fn new(spec: &Value) -> Bundle {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            serde_json::to_vec_pretty(spec).unwrap(),
        )
        .unwrap();
        Bundle { dir }
    }
    fn path(&self) -> &Path {
        self.dir.path()
    }
    fn state(&self, status: &str) -> Value {
        json!({
            "ociVersion": "1.2.1",
            "id": "c1",
            "status": status,
            "pid": 4242,
            "bundle": self.path(),
            "annotations": {"io.kubernetes.cri.container-type": "container"},
        })
    }
    fn record(&self) -> PathBuf {
        self.path().join(BUNDLE_GPUS_FILE)
    }
    fn restore_from(&self, d: &Devices) {
        std::fs::write(
            self.path().join(BUNDLE_RESTORE_DEVICES_FILE),
            serde_json::to_vec(d).unwrap(),
        )
        .unwrap();
    }
}

/// Runs the hook with `args` and `stdin`.
fn hook(args: &[&str], stdin: &[u8]) -> Output {
    let mut child = Command::new(HOOK)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run gpu-ckpt-hook");
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    child.wait_with_output().unwrap()
}

fn run_stage(stage: &str, lib: &Path, b: &Bundle, status: &str) -> Output {
    let state = serde_json::to_vec(&b.state(status)).unwrap();
    hook(&[stage, "--libnvml", lib.to_str().unwrap()], &state)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[track_caller]
fn ok(o: &Output) {
    assert!(o.status.success(), "{:?}: {}", o.status, stderr(o));
    assert!(o.stderr.is_empty(), "{}", stderr(o));
}

/// Exit status 1 and one line on stderr, which is returned.
#[track_caller]
fn fails(o: &Output) -> String {
    assert_eq!(o.status.code(), Some(1), "{}", stderr(o));
    let err = stderr(o);
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.starts_with("gpu-ckpt-hook: "), "{err}");
    err.trim_end().to_string()
}

#[test]
fn create_runtime_records_the_sim_gpus() {
    let n = two_gpus("oci-hooks-a");
    let u = uuids(&n);
    // GPU 1 then GPU 0: the record keeps the container's order.
    let b = Bundle::new(&cdi_spec(&n, &["1", "0"]));
    ok(&run_stage("create-runtime", &n.libnvml(), &b, "creating"));

    let meta = std::fs::metadata(b.record()).expect("the record");
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let raw: Value = serde_json::from_slice(&std::fs::read(b.record()).unwrap()).unwrap();
    assert_eq!(raw["source"], "device-nodes");
    let rec: Assigned = serde_json::from_value(raw).unwrap();
    assert_eq!(rec.source, Source::DeviceNodes);
    assert_eq!(rec.gpus, vec![u[1], u[0]]);

    // The `all` device: both, in the node's order.
    let b = Bundle::new(&cdi_spec(&n, &["all"]));
    ok(&run_stage("create-runtime", &n.libnvml(), &b, "creating"));
    let rec: Assigned = serde_json::from_slice(&std::fs::read(b.record()).unwrap()).unwrap();
    assert_eq!(rec.gpus, u);
}

#[test]
fn create_runtime_skips_and_refusals() {
    let n = two_gpus("oci-hooks-b");
    // No GPU given: nothing written, quiet, NVML not even loaded (the library named is absent).
    let b = Bundle::new(&cdi_spec(&n, &[]));
    let missing = n.dir().join("no-such-lib.so.1");
    ok(&run_stage("create-runtime", &missing, &b, "creating"));
    assert!(!b.record().exists());

    // GPUs given, and the library named cannot be loaded: an error.
    let b = Bundle::new(&cdi_spec(&n, &["0"]));
    let err = fails(&run_stage("create-runtime", &missing, &b, "creating"));
    assert!(
        err.starts_with("gpu-ckpt-hook: reading the node's GPUs: no NVIDIA driver: cannot load"),
        "{err}"
    );
    assert!(err.contains("no-such-lib.so.1"), "{err}");
    assert!(!b.record().exists());

    // A GPU of another node in the spec: named by UUID (NVIDIA_VISIBLE_DEVICES), and as a
    // device node of a minor number this node has no GPU for.
    let other = sim(SimConfig {
        gpus: 3,
        cdi: true,
        uuid_seed: "oci-hooks-other".into(),
        ..Default::default()
    });
    let mut spec = cdi_spec(&n, &[]);
    spec["process"]["env"] = json!([format!("NVIDIA_VISIBLE_DEVICES={}", other.uuids()[0])]);
    let b = Bundle::new(&spec);
    let err = fails(&run_stage("create-runtime", &n.libnvml(), &b, "creating"));
    assert!(err.contains("which is not on this node"), "{err}");
    assert!(err.contains(&other.uuids()[0]), "{err}");
    let b = Bundle::new(&cdi_spec(&other, &["2"]));
    let err = fails(&run_stage("create-runtime", &n.libnvml(), &b, "creating"));
    assert!(
        err.contains("/dev/nvidia2") && err.contains("no GPU on this node"),
        "{err}"
    );

    // A state without a bundle.
    let err = fails(&hook(
        &["create-runtime"],
        br#"{"ociVersion": "1.2.1", "id": "c1", "status": "creating", "pid": 1}"#,
    ));
    assert_eq!(
        err,
        "gpu-ckpt-hook: the container state on stdin has no bundle"
    );
    // Not a state at all.
    let err = fails(&hook(&["prestart"], b"hello"));
    assert!(
        err.starts_with("gpu-ckpt-hook: the container state on stdin is not valid"),
        "{err}"
    );
    // A usage error is one line too.
    let err = fails(&hook(&["create-runtime", "--no-such-flag"], b""));
    assert!(err.contains("--no-such-flag"), "{err}");
}

#[test]
fn prestart_holds_the_checkpoint_to_the_containers_gpus() {
    let n = two_gpus("oci-hooks-c");
    let u = uuids(&n);
    let inv = inventory(&n);
    let b = Bundle::new(&cdi_spec(&n, &["1", "0"]));
    let lib = n.libnvml();

    // Not a restore.
    ok(&run_stage("prestart", &lib, &b, "created"));

    // Checkpointed on these very GPUs, in this order: fits.
    let same = Profile::from_inventory(&inv, &[u[1], u[0]], Default::default()).devices;
    b.restore_from(&same);
    ok(&run_stage("prestart", &lib, &b, "creating"));

    // Checkpointed on another node's GPUs of the same model and driver: fits (remapped).
    let other = two_gpus("oci-hooks-d");
    let other_inv = inventory(&other);
    let ou = uuids(&other);
    assert_ne!(ou, u);
    let moved = Profile::from_inventory(&other_inv, &ou, Default::default()).devices;
    b.restore_from(&moved);
    ok(&run_stage("prestart", &lib, &b, "creating"));

    // Another model on the checkpoint's GPU 1.
    let mut model = same.clone();
    model.gpus[1].model = "NVIDIA A100-SXM4-80GB".to_string();
    b.restore_from(&model);
    let err = fails(&run_stage("prestart", &lib, &b, "creating"));
    assert_eq!(
        err,
        format!(
            "gpu-ckpt-hook: the restored container's GPUs do not fit its checkpoint: gpu_model \
             (gpu 1): checkpoint \"NVIDIA A100-SXM4-80GB\", node \"{}\"",
            inv.gpus[0].name
        )
    );

    // One GPU checkpointed, two given.
    let mut count = same.clone();
    count.gpus.truncate(1);
    b.restore_from(&count);
    let err = fails(&run_stage("prestart", &lib, &b, "creating"));
    assert!(
        err.starts_with("gpu-ckpt-hook: the restored container's GPUs do not fit its checkpoint: "),
        "{err}"
    );
    assert!(
        err.contains("gpu_count: checkpoint \"1\", node \"2\""),
        "{err}"
    );

    // Both at once, joined by "; ".
    let mut both = model.clone();
    both.driver_version = "570.86.15".to_string();
    b.restore_from(&both);
    let err = fails(&run_stage("prestart", &lib, &b, "creating"));
    assert!(err.contains("gpu_model (gpu 1)"), "{err}");
    assert!(
        err.contains(&format!(
            "; driver_version: checkpoint \"570.86.15\", node \"{}\"",
            inv.driver_version
        )),
        "{err}"
    );

    // A checkpoint with GPUs, restored into a container given one of them.
    let one = Bundle::new(&cdi_spec(&n, &["0"]));
    one.restore_from(&same);
    let err = fails(&run_stage("prestart", &lib, &one, "creating"));
    assert!(
        err.contains("gpu_count: checkpoint \"2\", node \"1\""),
        "{err}"
    );
}

#[test]
fn base_spec_output() {
    let out = hook(
        &[
            "base-spec",
            "--hook-path",
            "/usr/local/bin/gpu-ckpt-hook",
            "--libnvml",
            "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        ],
        b"",
    );
    ok(&out);
    let spec: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        spec["hooks"],
        json!({
            "createRuntime": [{"path": "/usr/local/bin/gpu-ckpt-hook",
                "args": ["gpu-ckpt-hook", "create-runtime", "--libnvml",
                         "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"]}],
            "prestart": [{"path": "/usr/local/bin/gpu-ckpt-hook",
                "args": ["gpu-ckpt-hook", "prestart", "--libnvml",
                         "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"]}],
        })
    );
    assert!(spec["process"]["capabilities"]["bounding"].is_array());
    assert!(spec["linux"]["namespaces"].is_array());

    // --from its own output: unchanged (nothing added twice).
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("base.json");
    std::fs::write(&file, &out.stdout).unwrap();
    let again = hook(
        &[
            "base-spec",
            "--hook-path",
            "/usr/local/bin/gpu-ckpt-hook",
            "--libnvml",
            "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
            "--from",
            file.to_str().unwrap(),
        ],
        b"",
    );
    ok(&again);
    assert_eq!(again.stdout, out.stdout);

    // A --from that is not JSON, or absent.
    std::fs::write(&file, "ociVersion: 1").unwrap();
    let err = fails(&hook(
        &[
            "base-spec",
            "--hook-path",
            "/h",
            "--from",
            file.to_str().unwrap(),
        ],
        b"",
    ));
    assert!(err.contains("base.json is not valid JSON"), "{err}");
    let err = fails(&hook(
        &[
            "base-spec",
            "--hook-path",
            "/h",
            "--from",
            "/no/such/spec.json",
        ],
        b"",
    ));
    assert!(err.contains("reading /no/such/spec.json"), "{err}");
}

/// The built-in default is what the test stack's `ctr oci spec` prints, less cgroupsPath.
#[test]
fn default_spec_is_containerds() {
    let stack = std::env::var_os("GPU_CKPT_STACK")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.stack"));
    let ctr = stack.join("root/usr/bin/ctr");
    assert!(
        ctr.is_file(),
        "no {}: the test stack is not installed (make deps)",
        ctr.display()
    );
    let out = Command::new(&ctr).args(["oci", "spec"]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let mut theirs: Value = serde_json::from_slice(&out.stdout).unwrap();
    let cgroups = theirs["linux"]
        .as_object_mut()
        .unwrap()
        .remove("cgroupsPath");
    assert_eq!(cgroups, Some(json!("/default")));
    assert_eq!(oci_hooks::base_spec::default_spec().unwrap(), theirs);
}
