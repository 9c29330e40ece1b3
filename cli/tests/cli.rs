//! The `gpu-ckpt` command end to end.

mod command;
// The format tests' archive builders.
#[path = "../../image-format/tests/common/mod.rs"]
mod common;

use image_format::compat::Profile;

fn run(args: &[&str]) -> (i32, String, String) {
    command::run(args, &["GPU_CKPT_NODE_INVENTORY"])
}

#[test]
fn inspect_verify_compat_build_extract() {
    let tmp = tempfile::tempdir().unwrap();
    let a = common::make_archive(tmp.path());
    let a_s = a.to_str().unwrap();
    let node = tmp.path().join("node.json");
    let prof = Profile {
        devices: common::devices(2),
        workload: common::workload(),
    };
    std::fs::write(&node, serde_json::to_vec(&prof).unwrap()).unwrap();
    let node_s = node.to_str().unwrap();

    let (rc, out, err) = run(&["inspect", a_s, "--node", node_s]);
    assert_eq!(rc, 0, "{err}");
    for want in [
        "counter",
        "Engine: containerd",
        "NVIDIA H100 80GB HBM3",
        "Driver 580.65.06",
        "compatible: yes",
    ] {
        assert!(out.contains(want), "inspect output lacks {want:?}:\n{out}");
    }
    let (rc, out, _) = run(&["inspect", a_s, "--json", "--node", node_s]);
    assert_eq!(rc, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[0]["container_name"], "counter");
    assert_eq!(v[0]["metadata"]["pod_name"], "counter-pod");
    assert_eq!(v[0]["checkpoint_size"]["memory_pages_size"], 300000);
    assert_eq!(
        v[0]["gpu"]["devices"]["gpus"][1]["model"],
        "NVIDIA H100 80GB HBM3"
    );
    assert_eq!(v[0]["compat"]["compatible"], true);

    let (rc, out, err) = run(&["verify", a_s]);
    assert_eq!(rc, 0, "{err}");
    assert!(
        out.contains("verify ok: 5 checkpoint files match the manifest"),
        "{out}"
    );

    let (rc, out, _) = run(&["compat", a_s, "--node", node_s]);
    assert_eq!((rc, out.trim()), (0, "compatible: yes"));
    let (rc, out, _) = run(&[
        "compat",
        a_s,
        "--node",
        node_s,
        "--model-version",
        "Qwen3-8B@rev2",
    ]);
    assert_eq!(rc, 1);
    assert!(
        out.contains("model_version: checkpoint \"Qwen3-8B@rev1\", node \"Qwen3-8B@rev2\""),
        "{out}"
    );
    let (rc, _, err) = run(&["compat", a_s]);
    if rc == 2 {
        assert!(err.contains("no node inventory"), "{err}");
    }

    let layout = tmp.path().join("layout");
    let tarball = tmp.path().join("img.tar");
    let (rc, out, err) = run(&[
        "build",
        a_s,
        "--ref",
        "localhost:5000/ckpt/counter:1",
        "--layout",
        layout.to_str().unwrap(),
        "--tarball",
        tarball.to_str().unwrap(),
    ]);
    assert_eq!(rc, 0, "{err}");
    assert!(
        out.contains("built localhost:5000/ckpt/counter:1 (sha256:"),
        "{out}"
    );
    let (rc, out, _) = run(&[
        "compat",
        tarball.to_str().unwrap(),
        "--node",
        node_s,
        "--json",
    ]);
    assert_eq!(rc, 0);
    assert!(out.contains("\"compatible\": true"));
    let (rc, out, _) = run(&["inspect", layout.to_str().unwrap()]);
    assert_eq!(rc, 0);
    assert!(
        out.contains("org.criu.checkpoint.container.name: counter"),
        "{out}"
    );
    let (rc, out, err) = run(&["verify", tarball.to_str().unwrap()]);
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains("image layer digest ok"), "{out}");

    let back = tmp.path().join("back.tar");
    let (rc, _, err) = run(&[
        "extract",
        tarball.to_str().unwrap(),
        "--archive",
        back.to_str().unwrap(),
    ]);
    assert_eq!(rc, 0, "{err}");
    assert_eq!(std::fs::read(&back).unwrap(), std::fs::read(&a).unwrap());
    let dir = tmp.path().join("x");
    let (rc, out, err) = run(&["extract", a_s, "--to", dir.to_str().unwrap()]);
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains("extracted 15 entries"), "{out}");
    let (rc, out, _) = run(&["verify", dir.join("checkpoint").to_str().unwrap()]);
    assert_eq!(
        (rc, out.trim()),
        (
            0,
            "verify ok: 5 files match the manifest\nsigner: unsigned (restored only where AllowUnsigned = true)"
        )
    );
    // A checkpoint directory (what `ctr task checkpoint --image-path` leaves) inspects too: its
    // GPU section, sizes and verdict, from the manifest and the files.
    let ck = dir.join("checkpoint");
    let (rc, out, err) = run(&["inspect", ck.to_str().unwrap(), "--node", node_s]);
    assert_eq!(rc, 0, "{err}");
    for want in [
        "NVIDIA H100 80GB HBM3",
        "Driver 580.65.06",
        "compatible: yes",
        "Signer: unsigned",
    ] {
        assert!(out.contains(want), "inspect DIR lacks {want:?}:\n{out}");
    }
    let (rc, out, _) = run(&["inspect", ck.to_str().unwrap(), "--json", "--files"]);
    assert_eq!(rc, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[0]["checkpoint_size"]["memory_pages_size"], 300000);
    assert!(v[0]["files"]
        .as_array()
        .unwrap()
        .iter()
        .any(|f| f["path"] == "checkpoint/gpu-ckpt-manifest.json"));

    // Errors exit with their class's code (a hostile archive: integrity, 4) and name the
    // problem.
    let bad = tmp.path().join("bad.tar");
    std::fs::write(&bad, common::RawTar::new().file("../evil", b"x").finish()).unwrap();
    let (rc, _, err) = run(&["verify", bad.to_str().unwrap()]);
    assert_eq!(rc, 4);
    assert!(err.contains("entry \"../evil\": path traversal"), "{err}");
}

// Pushes and pulls run against real registries (the test stack's plain and TLS docker-registry):
// test-containers/tests/registry.rs and checkpoint_cri.rs.
