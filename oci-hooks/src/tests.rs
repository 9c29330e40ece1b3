use std::cell::Cell;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use gpu::assign::Source;
use gpu::{GpuInfo, GpuUuid, NodeInventory};
use serde_json::{json, Value};

use super::*;

fn gpu(i: u32, name: &str) -> GpuInfo {
    GpuInfo {
        index: i,
        uuid: GpuUuid([i as u8 + 0x10; 16]),
        name: name.into(),
        architecture: Some("Hopper".into()),
        compute_capability: Some((9, 0)),
        memory_total_bytes: 80 << 30,
        memory_free_bytes: Some(79 << 30),
        minor_number: Some(i),
        pci_bus_id: format!("00000000:{:02X}:00.0", 0x10 + i),
        persistence_mode: Some(true),
        mig_enabled: None,
    }
}

fn node(models: &[&str]) -> NodeInventory {
    NodeInventory {
        driver_version: "580.65.06".into(),
        cuda_driver_version: 13000,
        gpus: models
            .iter()
            .enumerate()
            .map(|(i, m)| gpu(i as u32, m))
            .collect(),
    }
}

const H100: &str = "NVIDIA H100 80GB HBM3";

/// The minor number of test GPU `u` (see [`gpu`]); a UUID no test node has gets one no test
/// node has either.
fn minor(u: &GpuUuid) -> u8 {
    u.0[0].wrapping_sub(0x10)
}

/// A spec given GPUs `gpus` as a CDI spec gives them: `/dev/nvidia<minor>` each, in order,
/// after `/dev/nvidiactl`.
fn gpu_spec(gpus: &[GpuUuid]) -> Value {
    let mut devices =
        vec![json!({"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255})];
    for u in gpus {
        let m = minor(u);
        devices.push(
            json!({"path": format!("/dev/nvidia{m}"), "type": "c", "major": 195, "minor": m}),
        );
    }
    json!({
        "ociVersion": "1.2.1",
        "process": {"args": ["sh"]},
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
        "linux": {"devices": devices},
    })
}

/// A bundle directory with `spec` as its config.json, and the state that names it.
fn bundle(spec: &Value) -> (tempfile::TempDir, State) {
    let dir = tempfile::tempdir().unwrap();
    fs::write(
        dir.path().join(CONFIG_FILE),
        serde_json::to_vec(spec).unwrap(),
    )
    .unwrap();
    let state = State {
        oci_version: "1.2.1".into(),
        id: "c1".into(),
        status: "creating".into(),
        pid: Some(4242),
        bundle: dir.path().to_path_buf(),
        annotations: BTreeMap::new(),
    };
    (dir, state)
}

#[test]
fn state_parsing() {
    let s = parse_state(
        br#"{"ociVersion": "1.2.1", "id": "abc", "status": "creating", "pid": 4242,
             "bundle": "/run/containerd/io.containerd.runtime.v2.task/k8s.io/abc",
             "annotations": {"io.kubernetes.cri.container-type": "container"}}"#,
    )
    .unwrap();
    assert_eq!(s.oci_version, "1.2.1");
    assert_eq!(s.id, "abc");
    assert_eq!(s.status, "creating");
    assert_eq!(s.pid, Some(4242));
    assert_eq!(
        s.bundle,
        Path::new("/run/containerd/io.containerd.runtime.v2.task/k8s.io/abc")
    );
    assert_eq!(
        s.annotations["io.kubernetes.cri.container-type"],
        "container"
    );

    // pid and annotations are optional; unknown fields are ignored.
    let s = parse_state(
        br#"{"ociVersion": "1.0.2", "id": "x", "status": "created", "bundle": "/b", "extra": 1}"#,
    )
    .unwrap();
    assert_eq!(s.pid, None);
    assert!(s.annotations.is_empty());

    for bad in [
        &br#"{"ociVersion": "1.2.1", "id": "x", "status": "creating"}"#[..],
        br#"{"ociVersion": "1.2.1", "id": "x", "status": "creating", "bundle": ""}"#,
        br#"{"ociVersion": "1.2.1", "id": "x", "status": "creating", "bundle": null}"#,
    ] {
        let e = parse_state(bad).unwrap_err();
        assert!(matches!(e, HookError::NoBundle), "{e}");
        assert_eq!(e.to_string(), "the container state on stdin has no bundle");
    }
    let e = parse_state(b"not json").unwrap_err();
    assert!(matches!(e, HookError::StateJson(_)), "{e}");
    assert!(e
        .to_string()
        .starts_with("the container state on stdin is not valid: "));
    let e = parse_state(br#"{"bundle": 7}"#).unwrap_err();
    assert!(matches!(e, HookError::StateJson(_)), "{e}");

    let s = read_state(&br#"{"bundle": "/b"}"#[..]).unwrap();
    assert_eq!(s.bundle, Path::new("/b"));
}

#[test]
fn names_gpus_without_an_inventory() {
    let u = GpuUuid([1; 16]);
    assert!(names_gpus(&gpu_spec(&[u])));
    assert!(!names_gpus(&gpu_spec(&[])));
    assert!(!names_gpus(&json!({})));
    assert!(names_gpus(
        &json!({"linux": {"devices": [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia0"}]}})
    ));
    assert!(!names_gpus(
        &json!({"linux": {"devices": [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia-uvm"}]}})
    ));
    let env = |v: &str| json!({"process": {"env": [format!("NVIDIA_VISIBLE_DEVICES={v}")]}});
    for v in ["all", "0", "0,1", &u.to_string()] {
        assert!(names_gpus(&env(v)), "{v}");
    }
    for v in ["", "none", "void", " , "] {
        assert!(!names_gpus(&env(v)), "{v:?}");
    }
}

#[test]
fn create_runtime_records_the_containers_gpus() {
    let inv = node(&[H100, H100, H100]);
    let (a, b) = (inv.gpus[2].uuid, inv.gpus[0].uuid);
    let (dir, state) = bundle(&gpu_spec(&[a, b]));
    let got = create_runtime(&state, || Ok(Some(inv.clone()))).unwrap();
    let path = dir.path().join(BUNDLE_GPUS_FILE);
    let Created::Recorded {
        path: written,
        assigned,
    } = got
    else {
        panic!("expected a record, got {got:?}");
    };
    assert_eq!(written, path);
    assert_eq!(assigned.source, Source::DeviceNodes);
    assert_eq!(assigned.gpus, vec![a, b]);
    let meta = fs::metadata(&path).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let on_disk: Assigned = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    assert_eq!(on_disk, assigned);
    // Only the record and config.json: the temporary file was renamed.
    let mut names: Vec<String> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, vec![CONFIG_FILE, BUNDLE_GPUS_FILE]);

    // Run again (runc runs createRuntime again during a restore): replaced, same content.
    let again = create_runtime(&state, || Ok(Some(inv.clone()))).unwrap();
    assert!(matches!(again, Created::Recorded { .. }));
    let on_disk: Assigned = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    assert_eq!(on_disk.gpus, vec![a, b]);
}

#[test]
fn create_runtime_device_nodes_and_visible_devices() {
    let inv = node(&[H100, H100]);
    let spec =
        json!({"linux": {"devices": [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia1"}]}});
    let (_dir, state) = bundle(&spec);
    let Created::Recorded { assigned, .. } =
        create_runtime(&state, || Ok(Some(inv.clone()))).unwrap()
    else {
        panic!("expected a record");
    };
    assert_eq!(assigned.source, Source::DeviceNodes);
    assert_eq!(assigned.gpus, vec![inv.gpus[1].uuid]);

    // `all` on a node without GPUs: nothing given, nothing written.
    let spec = json!({"process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]}});
    let (dir, state) = bundle(&spec);
    let got = create_runtime(&state, || Ok(Some(node(&[])))).unwrap();
    assert_eq!(got, Created::NoGpus);
    assert!(!dir.path().join(BUNDLE_GPUS_FILE).exists());
}

#[test]
fn create_runtime_without_gpus_or_driver_writes_nothing() {
    // No GPU in the spec: NVML is not even loaded.
    let (dir, state) = bundle(&gpu_spec(&[]));
    let loaded = Cell::new(false);
    let got = create_runtime(&state, || {
        loaded.set(true);
        Ok(Some(node(&[H100])))
    })
    .unwrap();
    assert_eq!(got, Created::NoGpus);
    assert!(!loaded.get());
    assert!(!dir.path().join(BUNDLE_GPUS_FILE).exists());

    // GPUs named, but the node has no driver.
    let (dir, state) = bundle(&gpu_spec(&[GpuUuid([0x10; 16])]));
    let got = create_runtime(&state, || Ok(None)).unwrap();
    assert_eq!(got, Created::NoDriver);
    assert!(!dir.path().join(BUNDLE_GPUS_FILE).exists());

    // A GPU the node does not have: an error naming the spec and the GPU.
    let other = GpuUuid([0xee; 16]);
    let (dir, state) = bundle(&gpu_spec(&[other]));
    let e = create_runtime(&state, || Ok(Some(node(&[H100])))).unwrap_err();
    let msg = e.to_string();
    let path = format!("/dev/nvidia{}", minor(&other));
    assert!(msg.contains(CONFIG_FILE) && msg.contains(&path), "{msg}");
    assert!(msg.contains("no GPU on this node"), "{msg}");
    assert!(!dir.path().join(BUNDLE_GPUS_FILE).exists());

    // A loader error other than "no driver" is the hook's error.
    let (_dir, state) = bundle(&gpu_spec(&[GpuUuid([0x10; 16])]));
    let e = create_runtime(&state, || {
        Err(HookError::Inventory(GpuError::Nvml {
            call: "nvmlDeviceGetCount_v2",
            message: "Unknown Error".into(),
        }))
    })
    .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("reading the node's GPUs: NVML nvmlDeviceGetCount_v2"),
        "{e}"
    );
}

#[test]
fn create_runtime_bad_bundle() {
    let dir = tempfile::tempdir().unwrap();
    let state = State {
        oci_version: String::new(),
        id: String::new(),
        status: String::new(),
        pid: None,
        bundle: dir.path().to_path_buf(),
        annotations: BTreeMap::new(),
    };
    let e = create_runtime(&state, || Ok(None)).unwrap_err();
    assert!(matches!(e, HookError::Read { .. }), "{e}");
    assert!(e.to_string().contains("config.json"), "{e}");
    fs::write(dir.path().join(CONFIG_FILE), "{").unwrap();
    let e = create_runtime(&state, || Ok(None)).unwrap_err();
    assert!(matches!(e, HookError::Json { .. }), "{e}");
    assert!(!e.to_string().contains('\n'), "{e}");
}

/// The checkpoint's devices as the shim records them, for the GPUs `gpus` of `inv`.
fn recorded(inv: &NodeInventory, gpus: &[GpuUuid]) -> Devices {
    Profile::from_inventory(inv, gpus, Default::default()).devices
}

#[test]
fn prestart_fits() {
    let inv = node(&[H100, H100]);
    let (a, b) = (inv.gpus[0].uuid, inv.gpus[1].uuid);
    let (dir, state) = bundle(&gpu_spec(&[b, a]));
    // Checkpointed on another node with other UUIDs, same models and driver branch.
    let mut other = node(&[H100, H100]);
    other.driver_version = "580.82.07".into();
    for g in &mut other.gpus {
        g.uuid.0[0] = 0xaa;
    }
    let ckpt = recorded(&other, &[other.gpus[0].uuid, other.gpus[1].uuid]);
    fs::write(
        dir.path().join(BUNDLE_RESTORE_DEVICES_FILE),
        serde_json::to_vec(&ckpt).unwrap(),
    )
    .unwrap();
    let Prestart::Fits(v) = prestart(&state, || Ok(inv.clone())).unwrap() else {
        panic!("expected a fit");
    };
    assert!(v.compatible);
    // Checkpoint GPU i goes to the container's GPU i.
    assert_eq!(v.gpu_map.len(), 2);
    assert_eq!(v.gpu_map[0].old_uuid, other.gpus[0].uuid.to_string());
    assert_eq!(v.gpu_map[0].new_uuid, b.to_string());
    assert_eq!(v.gpu_map[1].new_uuid, a.to_string());
}

#[test]
fn prestart_model_differs() {
    let inv = node(&[H100, H100]);
    let (_dir, state) = bundle(&gpu_spec(&[inv.gpus[0].uuid, inv.gpus[1].uuid]));
    let a100 = node(&["NVIDIA A100-SXM4-80GB", H100]);
    let ckpt = recorded(&a100, &[a100.gpus[0].uuid, a100.gpus[1].uuid]);
    let v = verdict(
        &state.bundle,
        ckpt.clone(),
        &read_spec(&state.bundle).unwrap(),
        &inv,
    )
    .unwrap();
    assert!(!v.compatible);
    assert_eq!(v.differences.len(), 1, "{:?}", v.differences);
    assert_eq!(v.differences[0].field, "gpu_model");
    assert_eq!(v.differences[0].gpu, Some(0));

    fs::write(
        state.bundle.join(BUNDLE_RESTORE_DEVICES_FILE),
        serde_json::to_vec(&ckpt).unwrap(),
    )
    .unwrap();
    let e = prestart(&state, || Ok(inv.clone())).unwrap_err();
    assert!(matches!(e, HookError::Incompatible(_)), "{e}");
    assert_eq!(
        e.to_string(),
        format!(
            "the restored container's GPUs do not fit its checkpoint: gpu_model (gpu 0): \
             checkpoint \"NVIDIA A100-SXM4-80GB\", node \"{H100}\""
        )
    );
}

#[test]
fn prestart_count_differs() {
    let inv = node(&[H100, H100]);
    // The container is given one GPU; the checkpoint held two.
    let (_dir, state) = bundle(&gpu_spec(&[inv.gpus[1].uuid]));
    let ckpt = recorded(&inv, &[inv.gpus[0].uuid, inv.gpus[1].uuid]);
    fs::write(
        state.bundle.join(BUNDLE_RESTORE_DEVICES_FILE),
        serde_json::to_vec(&ckpt).unwrap(),
    )
    .unwrap();
    let e = prestart(&state, || Ok(inv.clone())).unwrap_err();
    let HookError::Incompatible(d) = &e else {
        panic!("expected a misfit, got {e}");
    };
    assert_eq!(d[0].field, "gpu_count");
    assert_eq!((d[0].checkpoint.as_str(), d[0].node.as_str()), ("2", "1"));
    assert!(
        e.to_string()
            .contains("gpu_count: checkpoint \"2\", node \"1\""),
        "{e}"
    );

    // The container given no GPU at all: count 0.
    let (_dir, state) = bundle(&gpu_spec(&[]));
    fs::write(
        state.bundle.join(BUNDLE_RESTORE_DEVICES_FILE),
        serde_json::to_vec(&ckpt).unwrap(),
    )
    .unwrap();
    let e = prestart(&state, || Ok(inv.clone())).unwrap_err();
    assert!(
        e.to_string()
            .contains("gpu_count: checkpoint \"2\", node \"0\""),
        "{e}"
    );

    // Several differences are joined by "; ".
    let mut old = node(&["NVIDIA A100-SXM4-80GB", H100]);
    old.driver_version = "570.1.2".into();
    let ckpt = recorded(&old, &[old.gpus[0].uuid]);
    let (_dir, state) = bundle(&gpu_spec(&[inv.gpus[0].uuid]));
    fs::write(
        state.bundle.join(BUNDLE_RESTORE_DEVICES_FILE),
        serde_json::to_vec(&ckpt).unwrap(),
    )
    .unwrap();
    let msg = prestart(&state, || Ok(inv.clone()))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("gpu_model (gpu 0): checkpoint \"NVIDIA A100-SXM4-80GB\""),
        "{msg}"
    );
    assert!(
        msg.contains("; driver_version: checkpoint \"570.1.2\", node \"580.65.06\""),
        "{msg}"
    );
}

#[test]
fn prestart_not_a_restore_and_nothing_to_hold() {
    let (dir, state) = bundle(&gpu_spec(&[GpuUuid([0x10; 16])]));
    let loaded = Cell::new(false);
    let load = || {
        loaded.set(true);
        Ok(node(&[H100]))
    };
    assert_eq!(prestart(&state, load).unwrap(), Prestart::NotARestore);
    assert!(!loaded.get());

    // A checkpoint without GPUs: nothing to hold, NVML not loaded.
    fs::write(dir.path().join(BUNDLE_RESTORE_DEVICES_FILE), "{}").unwrap();
    assert_eq!(prestart(&state, load).unwrap(), Prestart::NoGpusRecorded);
    assert!(!loaded.get());

    // A damaged file is an error, not "not a restore".
    fs::write(dir.path().join(BUNDLE_RESTORE_DEVICES_FILE), "[").unwrap();
    let e = prestart(&state, load).unwrap_err();
    assert!(e.to_string().contains(BUNDLE_RESTORE_DEVICES_FILE), "{e}");
}

#[test]
fn prestart_without_a_driver() {
    let inv = node(&[H100]);
    let (dir, state) = bundle(&gpu_spec(&[inv.gpus[0].uuid]));
    fs::write(
        dir.path().join(BUNDLE_RESTORE_DEVICES_FILE),
        serde_json::to_vec(&recorded(&inv, &[inv.gpus[0].uuid])).unwrap(),
    )
    .unwrap();
    let e = prestart(&state, || {
        Err(HookError::Inventory(GpuError::NoDriver {
            library: "libnvidia-ml.so.1".into(),
            reason: "cannot open shared object file".into(),
        }))
    })
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "the checkpoint holds device state of 1 GPU(s), but this node has no NVIDIA driver: \
         cannot load libnvidia-ml.so.1: cannot open shared object file"
    );
}

#[test]
fn base_spec_default_and_hooks() {
    let hook = Path::new("/usr/local/bin/gpu-ckpt-hook");
    let base = base_spec::default_spec().unwrap();
    assert_eq!(base["ociVersion"], "1.2.1");
    assert_eq!(base["root"]["path"], "rootfs");
    assert!(base["linux"].get("cgroupsPath").is_none());
    assert!(base.get("hooks").is_none());

    let spec = base_spec::with_hooks(base.clone(), hook, None).unwrap();
    for (stage, sub) in [("createRuntime", CREATE_RUNTIME), ("prestart", PRESTART)] {
        assert_eq!(
            spec["hooks"][stage],
            json!([{"path": "/usr/local/bin/gpu-ckpt-hook", "args": [BIN_NAME, sub]}]),
            "{stage}"
        );
    }
    // Everything else is the base's.
    let mut rest = spec.clone();
    rest.as_object_mut().unwrap().remove("hooks");
    assert_eq!(rest, base);

    // With --libnvml; existing hooks kept; applying twice adds nothing.
    let lib = Path::new("/opt/nvidia/lib/libnvidia-ml.so.1");
    let mut from = base.clone();
    from["hooks"] = json!({
        "createRuntime": [{"path": "/usr/bin/other", "args": ["other"]}],
        "poststop": [{"path": "/usr/bin/cleanup"}],
    });
    let spec = base_spec::with_hooks(from, hook, Some(lib)).unwrap();
    let spec = base_spec::with_hooks(spec, hook, Some(lib)).unwrap();
    assert_eq!(
        spec["hooks"]["createRuntime"],
        json!([
            {"path": "/usr/bin/other", "args": ["other"]},
            {"path": "/usr/local/bin/gpu-ckpt-hook",
             "args": [BIN_NAME, CREATE_RUNTIME, "--libnvml", "/opt/nvidia/lib/libnvidia-ml.so.1"]},
        ])
    );
    assert_eq!(spec["hooks"]["prestart"].as_array().unwrap().len(), 1);
    assert_eq!(
        spec["hooks"]["poststop"],
        json!([{"path": "/usr/bin/cleanup"}])
    );

    // A null hooks object or stage list is taken as empty.
    let mut nulls = base.clone();
    nulls["hooks"] = json!({"prestart": null});
    let spec = base_spec::with_hooks(nulls, hook, None).unwrap();
    assert_eq!(spec["hooks"]["prestart"].as_array().unwrap().len(), 1);
}

#[test]
fn base_spec_refusals() {
    let hook = Path::new("/usr/local/bin/gpu-ckpt-hook");
    let base = base_spec::default_spec().unwrap();
    let e = base_spec::with_hooks(base.clone(), Path::new("gpu-ckpt-hook"), None).unwrap_err();
    assert!(
        e.to_string()
            .contains("--hook-path gpu-ckpt-hook is not an absolute path"),
        "{e}"
    );
    let e = base_spec::with_hooks(base.clone(), hook, Some(Path::new("lib/x.so"))).unwrap_err();
    assert!(
        e.to_string()
            .contains("--libnvml lib/x.so is not an absolute path"),
        "{e}"
    );
    let e = base_spec::with_hooks(json!([]), hook, None).unwrap_err();
    assert!(e.to_string().contains("not a JSON object"), "{e}");
    let e = base_spec::with_hooks(json!({"hooks": {}}), hook, None).unwrap_err();
    assert!(e.to_string().contains("ociVersion"), "{e}");
    let mut bad = base.clone();
    bad["hooks"] = json!([]);
    let e = base_spec::with_hooks(bad, hook, None).unwrap_err();
    assert!(e.to_string().contains("\"hooks\" is not an object"), "{e}");
    let mut bad = base;
    bad["hooks"] = json!({"prestart": {}});
    let e = base_spec::with_hooks(bad, hook, None).unwrap_err();
    assert!(
        e.to_string().contains("\"hooks.prestart\" is not an array"),
        "{e}"
    );
}

/// An oci-hooks(5) 1.0.0 hook definition (containers/common pkg/hooks/1.0.0).
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct HookDefinition {
    version: String,
    hook: HookEntry,
    when: When,
    stages: Vec<String>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct HookEntry {
    path: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    env: Vec<String>,
    #[serde(default)]
    timeout: Option<u32>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct When {
    always: Option<bool>,
    annotations: Option<BTreeMap<String, String>>,
    commands: Option<Vec<String>>,
    #[serde(rename = "hasBindMounts")]
    has_bind_mounts: Option<bool>,
}

#[test]
fn hooks_d_definitions() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("hooks.d");
    for (file, stage, sub) in [
        (
            "gpu-ckpt-create-runtime.json",
            "createRuntime",
            CREATE_RUNTIME,
        ),
        ("gpu-ckpt-prestart.json", "prestart", PRESTART),
    ] {
        let text = fs::read_to_string(dir.join(file)).unwrap();
        let h: HookDefinition =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(h.version, "1.0.0", "{file}");
        assert_eq!(h.stages, vec![stage.to_string()], "{file}");
        // At least one condition, and it matches every container.
        assert_eq!(h.when.always, Some(true), "{file}");
        assert!(
            h.when.annotations.is_none() && h.when.commands.is_none(),
            "{file}"
        );
        assert!(h.when.has_bind_mounts.is_none(), "{file}");
        assert!(Path::new(&h.hook.path).is_absolute(), "{file}");
        assert!(h.hook.path.ends_with(&format!("/{BIN_NAME}")), "{file}");
        assert_eq!(
            h.hook.args,
            vec![BIN_NAME.to_string(), sub.to_string()],
            "{file}"
        );
        assert!(h.hook.env.is_empty() && h.hook.timeout.is_none(), "{file}");
        // The entry is the one base-spec writes for the same binary.
        let entry = base_spec::hook_entry(Path::new(&h.hook.path), sub, None).unwrap();
        assert_eq!(entry["args"], json!(h.hook.args), "{file}");
        // The stage is one runc runs, and the one base-spec installs the subcommand at.
        assert!(base_spec::STAGES.contains(&(stage, sub)), "{file}");
    }
}
