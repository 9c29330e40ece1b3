//! checkpointctl (the reference reader of checkpoint archives) inspects an archive our writer produces.
//! Needs the test stack's checkpointctl (`make deps` installs it in .stack/bin) or
//! $GPU_CKPT_CHECKPOINTCTL; fails, not skips, when it is missing.

mod common;

use std::process::Command;

#[test]
fn checkpointctl_inspects_our_archive() {
    let bin = common::checkpointctl();
    let tmp = tempfile::tempdir().unwrap();
    let a = common::make_archive(tmp.path());

    let o = Command::new(&bin).arg("inspect").arg(&a).output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "checkpointctl inspect failed:\n{out}\n{err}"
    );
    eprintln!("{out}");
    for want in [
        "counter",
        "containerd",
        "localhost:5000/counter:1",
        "io.containerd.gpu-ckpt.v1",
    ] {
        assert!(
            out.contains(want),
            "checkpointctl inspect output lacks {want:?}:\n{out}"
        );
    }

    let o = Command::new(&bin)
        .args(["inspect", "--format=json"])
        .arg(&a)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "checkpointctl inspect --format=json failed:\n{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("not json ({e}):\n{out}"));
    let c = if v.is_array() { &v[0] } else { &v };
    assert_eq!(c["container_name"], "counter", "{out}");
    assert_eq!(c["engine"], "containerd", "{out}");
    assert_eq!(c["checkpoint_size"]["memory_pages_size"], 300000, "{out}");
    assert_eq!(c["checkpoint_size"]["root_fs_diff_size"], 5000, "{out}");

    // --all reads dump stats too; our fixture's stats-dump is not real CRIU protobuf, so only the
    // metadata view is checked there.
    let o = Command::new(&bin)
        .args(["inspect", "--metadata"])
        .arg(&a)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("counter-pod"),
        "checkpointctl inspect --metadata:\n{out}"
    );
}
