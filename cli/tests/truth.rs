//! `gpu-ckpt` tells the truth: each failure exits with its class's code (docs/usage.md, "Exit
//! codes"), says its error once, prints it as JSON or YAML where asked; `verify` names every
//! differing file and refuses a signer a node would refuse; `inspect` fails on a truncated
//! archive (as checkpointctl does) and on a directory that is no checkpoint; `build` refuses a
//! tampered archive; `compat` holds a checkpoint without GPUs to nothing, and reads what
//! `device --list -o json` prints; completions name every subcommand.
//!
//! The archives are the format tests' (image-format/tests/common), signed with real node keys;
//! the node inventory is the simulated driver's NVML (build the workspace first).

mod command;
// The format tests' archive builders.
#[path = "../../image-format/tests/common/mod.rs"]
mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use gpu_ckpt_cli::exit::ExitClass;
use image_format::sign::NodeKey;
use simgpu::testing::{SimConfig, SimNode};

fn run(args: &[&str]) -> (i32, String, String) {
    command::run(args, &["GPU_CKPT_NODE_INVENTORY"])
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The JSON error object a failing command prints on stdout with `-o json`.
fn json_error(out: &str, class: &str, code: i32) -> serde_json::Value {
    let v: serde_json::Value =
        serde_json::from_str(out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"));
    assert_eq!(v["class"], class, "{out}");
    assert_eq!(v["exit_code"], code, "{out}");
    assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{out}");
    v
}

/// `data` with each of `from` (found exactly once) replaced by the same-length `to`.
fn tamper(path: &Path, edits: &[(&[u8], &[u8])]) {
    let mut data = std::fs::read(path).unwrap();
    for (from, to) in edits {
        assert_eq!(from.len(), to.len());
        let at: Vec<usize> = data
            .windows(from.len())
            .enumerate()
            .filter(|(_, w)| w == from)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(
            at.len(),
            1,
            "{:?} in {}",
            String::from_utf8_lossy(from),
            path.display()
        );
        data[at[0]..at[0] + to.len()].copy_from_slice(to);
    }
    std::fs::write(path, data).unwrap();
}

/// A scratch directory with the format tests' archive in it.
fn scratch_archive() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let a = common::make_archive(tmp.path());
    (tmp, a)
}

const CORE: (&[u8], &[u8]) = (b"core of pid 1", b"CORE of pid 1");
const INVENTORY: (&[u8], &[u8]) = (b"criu inventory", b"CRIU inventory");

#[test]
fn each_failure_exits_with_its_class_and_says_its_error_once() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("missing.tar");

    // I/O: the error once, not `…: No such file or directory (os error 2): No such file …`.
    let (rc, out, err) = run(&["verify", s(&missing)]);
    assert_eq!(rc, 3, "{err}");
    assert!(out.is_empty(), "{out}");
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    assert!(err.starts_with("gpu-ckpt: error: "), "{err}");
    // With -o json (and its alias --json), the error is JSON on stdout, with the same code.
    for flag in [&["-o", "json"][..], &["--json"]] {
        let mut args = vec!["verify", s(&missing)];
        args.extend_from_slice(flag);
        let (rc, out, err) = run(&args);
        assert_eq!(rc, 3, "{err}");
        assert!(err.is_empty(), "{err}");
        let v = json_error(&out, "io", 3);
        assert!(v["error"].as_str().unwrap().contains(s(&missing)), "{out}");
    }
    // And YAML.
    let (rc, out, _) = run(&["inspect", s(&missing), "-o", "yaml"]);
    assert_eq!(rc, 3);
    let v: serde_json::Value = serde_norway::from_str(&out).unwrap();
    assert_eq!(
        (v["class"].as_str(), v["exit_code"].as_i64()),
        (Some("io"), Some(3))
    );

    // Usage: clap's own errors keep code 2, as JSON too where asked; the command's own
    // contradictions are usage errors.
    let (rc, _, err) = run(&["verify"]);
    assert_eq!(rc, 2, "{err}");
    let (rc, out, _) = run(&["verify", "-o", "json"]);
    assert_eq!(rc, 2);
    json_error(&out, "usage", 2);
    let (rc, _, err) = run(&["verify", s(&missing), "-o", "xml"]);
    assert_eq!(rc, 2, "{err}");
    let a = common::make_archive(tmp.path());
    let (rc, _, err) = run(&["build", s(&a), "--ref", "localhost:5000/x:1"]);
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("nothing to do"), "{err}");

    // Registry: a refused connection.
    let hosts = tmp.path().join("certs.d");
    std::fs::create_dir(&hosts).unwrap();
    let (rc, out, err) = run(&[
        "pull",
        "localhost:1/ckpt/x:1",
        s(&tmp.path().join("pulled.tar")),
        "--hosts-dir",
        s(&hosts),
        "-o",
        "json",
    ]);
    assert_eq!(rc, 6, "{out}{err}");
    json_error(&out, "registry", 6);

    // A good archive verifies as JSON on stdout.
    let (rc, out, err) = run(&["verify", s(&a), "-o", "json"]);
    assert_eq!(rc, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["ok"], true);
}

#[test]
fn verify_names_every_differing_file() {
    let (tmp, a) = scratch_archive();
    let dir = tmp.path().join("x");
    let (rc, _, err) = run(&["extract", s(&a), "--to", s(&dir)]);
    assert_eq!(rc, 0, "{err}");

    // Two files of the archive changed: both named, integrity.
    tamper(&a, &[CORE, INVENTORY]);
    let (rc, out, err) = run(&["verify", s(&a)]);
    assert_eq!(rc, 4, "{err}");
    assert!(!out.contains("verify ok"), "{out}");
    for name in ["core-1.img", "inventory.img"] {
        assert!(err.contains(&format!("file \"{name}\": ")), "{name}: {err}");
    }
    assert!(err.contains("2 files differ from the manifest"), "{err}");

    // A checkpoint directory: a changed file, a missing one and a stray one, all named.
    let ck = dir.join("checkpoint");
    std::fs::write(ck.join("core-1.img"), b"CORE of pid 1").unwrap();
    std::fs::remove_file(ck.join("pagemap-1.img")).unwrap();
    std::fs::write(ck.join("stray.img"), b"x").unwrap();
    let (rc, out, _) = run(&["verify", s(&ck), "-o", "json"]);
    assert_eq!(rc, 4);
    let v = json_error(&out, "integrity", 4);
    let e = v["error"].as_str().unwrap();
    for want in [
        "file \"core-1.img\": ",
        "file \"pagemap-1.img\": listed in the manifest but missing",
        "file \"stray.img\": present but not listed in the manifest",
    ] {
        assert!(e.contains(want), "{want}: {e}");
    }
}

/// A node key in a directory of its own under `tmp`.
fn node_key(tmp: &Path, name: &str) -> (NodeKey, PathBuf) {
    let dir = tmp.join(name);
    let key = NodeKey::load_or_create(&dir.join("node.key")).unwrap();
    (key, dir)
}

/// `gpu-ckpt key revoke KEYFILE --key KEY EXTRA...`, which succeeds.
fn key_revoke(key_ref: &Path, key: &Path, extra: &[&str]) {
    let mut args = vec!["key", "revoke", s(key_ref), "--key", s(key)];
    args.extend_from_slice(extra);
    let (rc, _, err) = run(&args);
    assert_eq!(rc, 0, "{err}");
}

/// Node keys A and B in a scratch directory, and an archive A signed.
fn signed_by_a() -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let (a_key, a_dir) = node_key(tmp.path(), "keys-a");
    let (_, b_dir) = node_key(tmp.path(), "keys-b");
    let work = tmp.path().join("signed");
    std::fs::create_dir(&work).unwrap();
    let signed = common::make_archive_signed(&work, Some(&a_key));
    (tmp, a_dir, b_dir, signed)
}

#[test]
fn verify_refuses_a_signer_a_node_would_refuse() {
    let (tmp, a_dir, b_dir, signed) = signed_by_a();

    // Signed by A: trusted with A's key.
    let (rc, out, err) = run(&["verify", s(&signed), "--key", s(&a_dir.join("node.pub"))]);
    assert_eq!(rc, 0, "{err}");
    assert!(
        out.contains("verify ok: ") && out.contains("(trusted: "),
        "{out}"
    );
    // B does not trust A: a trust failure, and never `verify ok`.
    let b_pub = b_dir.join("node.pub");
    let (rc, out, err) = run(&["verify", s(&signed), "--key", s(&b_pub)]);
    assert_eq!(rc, 5, "{out}{err}");
    assert!(!out.contains("verify ok"), "{out}");
    assert!(err.contains("NOT trusted"), "{err}");
    let (rc, out, _) = run(&["verify", s(&signed), "--key", s(&b_pub), "-o", "json"]);
    assert_eq!(rc, 5);
    json_error(&out, "trust", 5);
    // B trusts A's key from a directory, and then revokes it: revoked wins.
    let trusted = tmp.path().join("trusted");
    std::fs::create_dir(&trusted).unwrap();
    std::fs::copy(a_dir.join("node.pub"), trusted.join("a.pub")).unwrap();
    let with_b = |extra: &[&str]| {
        let mut args = vec!["verify", s(&signed)];
        args.extend_from_slice(&["--key", s(&b_pub), "--trusted-keys", s(&trusted)]);
        args.extend_from_slice(extra);
        run(&args)
    };
    let (rc, out, err) = with_b(&[]);
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains("verify ok: "), "{out}");
    let b_key = b_dir.join("node.key");
    key_revoke(&trusted.join("a.pub"), &b_key, &[]);
    let (rc, out, err) = with_b(&[]);
    assert_eq!(rc, 5, "{out}");
    assert!(err.contains("revoked"), "{err}");

    // Unsigned, where keys are named: refused unless --allow-unsigned.
    let unsigned = common::make_archive(tmp.path());
    let (rc, _, err) = run(&["verify", s(&unsigned), "--key", s(&b_pub)]);
    assert_eq!(rc, 5, "{err}");
    assert!(err.contains("unsigned"), "{err}");
    let (rc, out, err) = run(&[
        "verify",
        s(&unsigned),
        "--key",
        s(&b_pub),
        "--allow-unsigned",
    ]);
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains("signer: unsigned"), "{out}");

    // A manifest changed after signing: the signature does not hold.
    tamper(&signed, &[(b"6.18.0", b"6.18.1")]);
    let (rc, _, err) = run(&["verify", s(&signed), "--key", s(&a_dir.join("node.pub"))]);
    assert_eq!(rc, 5, "{err}");
    assert!(err.contains("INVALID"), "{err}");
}

/// `verify` and `inspect` with no key flags take the trust of a handler options file
/// (`--handler-config`, on a node the restore handler's), as the shim reads it: its SigningKey,
/// its TrustedKeysDir, and both revoked-keys lists (RevokedKeysFile and the node's own beside
/// the signing key).
#[test]
fn verify_takes_the_handlers_trust_from_its_options_file() {
    let (tmp, a_dir, b_dir, signed) = signed_by_a();
    let trusted = tmp.path().join("trusted");
    std::fs::create_dir(&trusted).unwrap();
    let site_revoked = tmp.path().join("site-revoked");
    std::fs::write(&site_revoked, "# none\n").unwrap();
    let side = tmp.path().join("containerd-shim-gpu-ckpt-restore-v1.toml");
    let b_key = b_dir.join("node.key");
    std::fs::write(
        &side,
        format!(
            "Mode = \"restore\"\nSigningKey = \"{}\"\nTrustedKeysDir = \"{}\"\nRevokedKeysFile = \"{}\"\n",
            b_key.display(),
            trusted.display(),
            site_revoked.display()
        ),
    )
    .unwrap();
    let verify = || run(&["verify", s(&signed), "--handler-config", s(&side)]);
    // B's handler does not trust A yet: refused as the shim would.
    let (rc, out, err) = verify();
    assert_eq!(rc, 5, "{out}{err}");
    assert!(err.contains("NOT trusted"), "{err}");
    // A's key in the handler's TrustedKeysDir: trusted, by that file.
    std::fs::copy(a_dir.join("node.pub"), trusted.join("a.pub")).unwrap();
    let (rc, out, err) = verify();
    assert_eq!(rc, 0, "{err}");
    assert!(
        out.contains("verify ok: ") && out.contains("a.pub"),
        "{out}"
    );
    let (rc, out, err) = run(&["inspect", s(&signed), "--handler-config", s(&side)]);
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains("trusted: ") && out.contains("a.pub"), "{out}");
    // Revoked in the node's own list beside SigningKey (where `key revoke` writes by default),
    // which RevokedKeysFile does not name: refused all the same.
    key_revoke(&trusted.join("a.pub"), &b_key, &[]);
    let (rc, out, err) = verify();
    assert_eq!(rc, 5, "{out}");
    assert!(
        err.contains("revoked") && err.contains(s(&b_dir.join("revoked"))),
        "{err}"
    );
    // Revoked in RevokedKeysFile only: refused too.
    std::fs::remove_file(b_dir.join("revoked")).unwrap();
    assert_eq!(verify().0, 0);
    std::fs::copy(a_dir.join("node.pub"), tmp.path().join("a.pub")).unwrap();
    key_revoke(
        &tmp.path().join("a.pub"),
        &b_key,
        &["--revoked", s(&site_revoked)],
    );
    let (rc, out, err) = verify();
    assert_eq!(rc, 5, "{out}");
    assert!(err.contains(s(&site_revoked)), "{err}");
    // A key flag overrides the file: A's own key trusts A.
    let (rc, _, err) = run(&[
        "verify",
        s(&signed),
        "--handler-config",
        s(&side),
        "--key",
        s(&a_dir.join("node.pub")),
    ]);
    assert_eq!(rc, 0, "{err}");
    // Unsigned: refused, as the handler has no AllowUnsigned.
    let unsigned = common::make_archive(tmp.path());
    let (rc, _, err) = run(&["verify", s(&unsigned), "--handler-config", s(&side)]);
    assert_eq!(rc, 5, "{err}");
    assert!(err.contains("unsigned"), "{err}");
    // A handler file that cannot be read allows no unsigned checkpoint either.
    let broken = tmp.path().join("broken.toml");
    std::fs::write(&broken, "NoSuchOption = 1\n").unwrap();
    let (rc, _, err) = run(&["verify", s(&unsigned), "--handler-config", s(&broken)]);
    assert_eq!(rc, 5, "{err}");
    assert!(err.contains("unsigned"), "{err}");
    // A trusted signer while a revoked list cannot be read (others may write it): the shim
    // refuses every signed restore, and so does verify.
    std::fs::write(&site_revoked, "# none\n").unwrap();
    assert_eq!(verify().0, 0);
    std::fs::set_permissions(&site_revoked, std::fs::Permissions::from_mode(0o666)).unwrap();
    let (rc, out, err) = verify();
    assert_eq!(rc, 5, "{out}");
    assert!(
        err.contains("cannot be read in full") && err.contains(s(&site_revoked)),
        "{err}"
    );
}

#[test]
fn inspect_fails_on_a_truncated_archive_and_on_no_checkpoint() {
    let (tmp, a) = scratch_archive();
    let (rc, _, err) = run(&["inspect", s(&a)]);
    assert_eq!(rc, 0, "{err}");

    // Cut inside the page image's data: checkpointctl fails, and so does inspect (integrity),
    // without calling anything trusted.
    let cut = tmp.path().join("cut.tar");
    let data = std::fs::read(&a).unwrap();
    let pages = data
        .windows(8)
        .position(|w| w == [7u8; 8])
        .expect("the page image's data");
    std::fs::write(&cut, &data[..pages + 1000]).unwrap();
    let o = std::process::Command::new(common::checkpointctl())
        .arg("inspect")
        .arg(&cut)
        .output()
        .unwrap();
    assert!(
        !o.status.success(),
        "checkpointctl read a truncated archive"
    );
    let (rc, out, err) = run(&["inspect", s(&cut)]);
    assert_eq!(rc, 4, "{out}{err}");
    assert!(out.is_empty(), "{out}");
    assert!(err.contains("truncated"), "{err}");
    let (rc, out, _) = run(&["inspect", s(&cut), "--json"]);
    assert_eq!(rc, 4);
    json_error(&out, "integrity", 4);

    // A directory that is no checkpoint (like /tmp).
    let plain = tmp.path().join("plain");
    std::fs::create_dir(&plain).unwrap();
    std::fs::write(plain.join("notes.txt"), b"hello").unwrap();
    for cmd in ["inspect", "verify", "compat"] {
        let (rc, out, err) = run(&[cmd, s(&plain)]);
        assert_eq!(rc, 4, "{cmd}: {out}{err}");
        assert!(err.contains("not a checkpoint"), "{cmd}: {err}");
    }
}

#[test]
fn build_verifies_its_input() {
    let (tmp, a) = scratch_archive();
    let build = |to: &[&str]| {
        let mut args = vec!["build", s(&a), "--ref", "localhost:5000/x:1"];
        args.extend_from_slice(to);
        run(&args)
    };
    let good = tmp.path().join("good.tar");
    let (rc, _, err) = build(&["--tarball", s(&good)]);
    assert_eq!(rc, 0, "{err}");
    // `verify` of the image checks the archive inside as well as the layer's digest.
    let (rc, out, err) = run(&["verify", s(&good)]);
    assert_eq!(rc, 0, "{err}");
    assert!(
        out.contains("image layer digest ok")
            && out.contains("the archive in it: 5 checkpoint files match the manifest"),
        "{out}"
    );

    // Another engine's checkpoint (no gpu-ckpt manifest): nothing to hold its files to, so its
    // headers are checked and it is built, saying so.
    let plain = tmp.path().join("plain.tar");
    let config = serde_json::to_vec(&common::config_dump()).unwrap();
    let spec = serde_json::to_vec(&common::spec_dump_containerd()).unwrap();
    let raw = common::RawTar::new()
        .file("config.dump", &config)
        .file("spec.dump", &spec)
        .file("checkpoint/pages-1.img", &[7u8; 4096])
        .finish();
    std::fs::write(&plain, raw).unwrap();
    let plain_image = tmp.path().join("plain-image.tar");
    let mut args = vec!["build", s(&plain), "--ref", "localhost:5000/x:2"];
    args.extend_from_slice(&["--tarball", s(&plain_image)]);
    let (rc, out, err) = run(&args);
    assert_eq!(rc, 0, "{err}");
    assert!(
        out.contains("not verified: the archive has no gpu-ckpt manifest"),
        "{out}"
    );

    tamper(&a, &[CORE]);
    let bad = tmp.path().join("bad.tar");
    let layout = tmp.path().join("layout");
    let (rc, out, err) = build(&["--tarball", s(&bad), "--layout", s(&layout)]);
    assert_eq!(rc, 4, "{out}{err}");
    assert!(err.contains("file \"core-1.img\": "), "{err}");
    assert!(!bad.exists() && !layout.exists(), "an image was written");
    // Packaged as it is on request, the image still does not verify: the archive inside is
    // checked.
    let (rc, _, err) = build(&["--tarball", s(&bad), "--no-verify"]);
    assert_eq!(rc, 0, "{err}");
    let (rc, out, err) = run(&["verify", s(&bad)]);
    assert_eq!(rc, 4, "{out}{err}");
    assert!(err.contains("file \"core-1.img\": "), "{err}");
}

fn write_json(path: &Path, v: &impl serde::Serialize) {
    std::fs::write(path, serde_json::to_vec_pretty(v).unwrap()).unwrap();
}

#[test]
fn compat_applies_the_restore_rule_to_device_lists_inventory() {
    let tmp = tempfile::tempdir().unwrap();
    let n = SimNode::start(SimConfig {
        gpus: 2,
        uuid_seed: "cli-compat".into(),
        ..SimConfig::default()
    })
    .expect("start the simulated node (build the workspace first)");
    let nvml = n.libnvml().display().to_string();

    // `device --list -o json` is the inventory `compat --node` reads.
    let (rc, listed, err) = run(&["device", "--list", "--libnvml", &nvml, "-o", "json"]);
    assert_eq!(rc, 0, "{err}");
    let inventory = tmp.path().join("node.json");
    std::fs::write(&inventory, &listed).unwrap();
    let inv: gpu::NodeInventory = serde_json::from_str(&listed).unwrap();

    // A checkpoint taken on one of these GPUs fits; one of another model does not.
    let mut m = common::sample_manifest();
    m.workload = Default::default();
    let node = image_format::compat::Profile::from_inventory(
        &inv,
        &[inv.gpus[0].uuid],
        Default::default(),
    );
    m.devices = node.devices.clone();
    m.devices.node_gpus.clear();
    let fits = tmp.path().join("fits.json");
    write_json(&fits, &m);
    let (rc, out, err) = run(&["compat", s(&fits), "--node", s(&inventory)]);
    assert_eq!((rc, out.as_str()), (0, "compatible: yes\n"), "{err}");
    m.devices.gpus[0].model = "NVIDIA B200".into();
    let other = tmp.path().join("other.json");
    write_json(&other, &m);
    let (rc, out, err) = run(&["compat", s(&other), "--node", s(&inventory), "-o", "json"]);
    assert_eq!(rc, 1, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["compatible"], false);
    assert_eq!(v["differences"][0]["field"], "gpu_model");

    // A checkpoint without GPUs restores on a node without any, as the shim restores it.
    m.devices = Default::default();
    let cpu = tmp.path().join("cpu.json");
    write_json(&cpu, &m);
    let bare = tmp.path().join("bare.json");
    write_json(
        &bare,
        &gpu::NodeInventory {
            driver_version: String::new(),
            cuda_driver_version: 0,
            gpus: Vec::new(),
        },
    );
    let (rc, out, err) = run(&["compat", s(&cpu), "--node", s(&bare)]);
    assert_eq!((rc, out.as_str()), (0, "compatible: yes\n"), "{err}");
    let (rc, out, err) = run(&["compat", s(&cpu), "--node", s(&inventory)]);
    assert_eq!((rc, out.as_str()), (0, "compatible: yes\n"), "{err}");
    // And a GPU checkpoint does not: the node has no GPU to give.
    let (rc, out, _) = run(&["compat", s(&fits), "--node", s(&bare)]);
    assert_eq!(rc, 1, "{out}");
    assert!(out.contains("gpu_count"), "{out}");
}

#[test]
fn drain_plan_takes_the_same_output_flag() {
    let fixture = |f: &str| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/drain-plan")
            .join(f)
    };
    let (pods, nodes) = (fixture("mixed-pods.json"), fixture("mixed-nodes.json"));
    let args = |format: &'static str| {
        vec![
            "drain-plan".to_string(),
            "--pods".into(),
            pods.display().to_string(),
            "--nodes".into(),
            nodes.display().to_string(),
            "--node".into(),
            "gpu-a".into(),
            "--registry".into(),
            "registry.example.com/ckpt".into(),
            "-o".into(),
            format.into(),
        ]
    };
    let run_owned = |v: &[String]| run(&v.iter().map(String::as_str).collect::<Vec<_>>());
    let (rc, json, err) = run_owned(&args("json"));
    assert_eq!(rc, 0, "{err}");
    let (rc, yaml, err) = run_owned(&args("yaml"));
    assert_eq!(rc, 0, "{err}");
    let from_json: serde_json::Value = serde_json::from_str(&json).unwrap();
    let from_yaml: serde_json::Value = serde_norway::from_str(&yaml).unwrap();
    assert_eq!(from_json, from_yaml);
    assert_eq!(from_yaml["complete"], true);
    // A missing input, as JSON.
    let mut missing = args("json");
    missing[2] = "/nonexistent/pods.json".into();
    let (rc, out, _) = run_owned(&missing);
    assert_eq!(rc, 3, "{out}");
    json_error(&out, "io", 3);
}

#[test]
fn completions_name_every_subcommand() {
    let (rc, out, err) = run(&["completion", "bash"]);
    assert_eq!(rc, 0, "{err}");
    for sub in [
        "inspect",
        "verify",
        "compat",
        "build",
        "pull",
        "key",
        "device",
        "drain-plan",
        "extract",
        "events",
        "completion",
    ] {
        assert!(out.contains(sub), "the bash completion lacks {sub}");
    }
    for shell in ["zsh", "fish"] {
        let (rc, out, err) = run(&["completion", shell]);
        assert_eq!(rc, 0, "{shell}: {err}");
        assert!(out.contains("drain-plan"), "{shell}: {out}");
    }
    let (rc, _, _) = run(&["completion", "tcsh"]);
    assert_eq!(rc, 2);
}

#[test]
fn the_exit_code_table_in_the_docs_is_the_codes() {
    let doc =
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/usage.md"))
            .unwrap();
    let table = doc
        .split("## Exit codes")
        .nth(1)
        .expect("docs/usage.md has an \"Exit codes\" section");
    let rows: Vec<(u8, String)> = table
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            Some((
                cells.get(1)?.parse().ok()?,
                cells.get(2)?.trim_matches('`').to_string(),
            ))
        })
        .collect();
    let want: Vec<(u8, String)> = ExitClass::ALL
        .iter()
        .map(|c| (c.code(), c.name().to_string()))
        .collect();
    assert_eq!(rows, want);
}
