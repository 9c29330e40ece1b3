//! install and uninstall on a scratch root with a stand-in payload (no containerd: that is
//! test-containers/tests/integration/node_installer.rs): idempotence, refusals, and runs cut short.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use node_installer::install::{install, uninstall, Options};
use node_installer::paths::HostFs;
use node_installer::record::{Phase, Record};

fn listing(root: &Path) -> BTreeMap<PathBuf, String> {
    let mut out = BTreeMap::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let m = fs::symlink_metadata(&p).unwrap();
            let what = if m.file_type().is_symlink() {
                format!("link -> {}", fs::read_link(&p).unwrap().display())
            } else if m.is_dir() {
                todo.push(p.clone());
                format!("dir {:o}", m.mode() & 0o7777)
            } else {
                format!("file {:o} {:?}", m.mode() & 0o7777, fs::read(&p).unwrap())
            };
            out.insert(p.strip_prefix(root).unwrap().to_path_buf(), what);
        }
    }
    out
}

struct Scratch {
    _dir: tempfile::TempDir,
    root: PathBuf,
    restarts: PathBuf,
    opts: Options,
}

/// A stand-in for the payload's CRIU: an ELF header and one program header, PT_INTERP, naming a
/// placeholder of 512 bytes as runtime-class/installer/payload.sh leaves it.
fn criu_stand_in() -> Vec<u8> {
    const INTERP_LEN: u64 = 512;
    let mut e = Vec::new();
    e.extend_from_slice(b"\x7fELF\x02\x01\x01");
    e.resize(16, 0);
    e.extend_from_slice(&2u16.to_le_bytes()); // e_type: executable
    e.extend_from_slice(&62u16.to_le_bytes()); // e_machine: x86-64
    e.extend_from_slice(&1u32.to_le_bytes()); // e_version
    e.extend_from_slice(&0u64.to_le_bytes()); // e_entry
    e.extend_from_slice(&64u64.to_le_bytes()); // e_phoff
    e.extend_from_slice(&0u64.to_le_bytes()); // e_shoff
    e.extend_from_slice(&0u32.to_le_bytes()); // e_flags
    for half in [64u16, 56, 1, 64, 0, 0] {
        // e_ehsize, e_phentsize, e_phnum, e_shentsize, e_shnum, e_shstrndx
        e.extend_from_slice(&half.to_le_bytes());
    }
    e.extend_from_slice(&3u32.to_le_bytes()); // p_type: PT_INTERP
    e.extend_from_slice(&4u32.to_le_bytes()); // p_flags: R
    for word in [120u64, 120, 120, INTERP_LEN, INTERP_LEN, 1] {
        // p_offset, p_vaddr, p_paddr, p_filesz, p_memsz, p_align
        e.extend_from_slice(&word.to_le_bytes());
    }
    let mut placeholder = b"/gpu-ckpt-node-installer-sets-this-path-at-install".to_vec();
    placeholder.resize(INTERP_LEN as usize - 1, b'_');
    e.extend_from_slice(&placeholder);
    e.push(0);
    e
}

fn scratch() -> Scratch {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("node");
    let payload = dir.path().join("payload");
    fs::create_dir_all(payload.join("criu/lib")).unwrap();
    for b in [
        "containerd-shim-gpu-ckpt-v1",
        "gpu-ckpt",
        "gpu-ckpt-hook",
        "criu/criu",
    ] {
        fs::write(payload.join(b), format!("#!/bin/sh\n# {b}\n")).unwrap();
        fs::set_permissions(payload.join(b), fs::Permissions::from_mode(0o755)).unwrap();
    }
    fs::write(payload.join("criu/criu"), criu_stand_in()).unwrap();
    fs::write(payload.join("criu/lib/ld-linux-x86-64.so.2"), "loader").unwrap();
    fs::write(payload.join("criu/lib/libnet.so.1"), "lib").unwrap();
    std::os::unix::fs::symlink("libnet.so.1", payload.join("criu/lib/libnet.so")).unwrap();
    fs::create_dir_all(root.join("etc/containerd")).unwrap();
    fs::write(
        root.join("etc/containerd/config.toml"),
        "# mine\nversion = 3\n\n[grpc]\n  address = '/run/containerd/containerd.sock' # keep\n",
    )
    .unwrap();
    fs::create_dir_all(root.join("usr/local/bin")).unwrap();
    // /var/run -> /run, an absolute link as hosts have it: it must resolve inside the root.
    fs::create_dir_all(root.join("run")).unwrap();
    fs::create_dir_all(root.join("var")).unwrap();
    std::os::unix::fs::symlink("/run", root.join("var/run")).unwrap();
    let restarts = dir.path().join("restarts");
    let opts = Options {
        fs: HostFs::new(&root, Path::new("/")).unwrap(),
        containerd_config: "/etc/containerd/config.toml".into(),
        dropin_dir: "/etc/containerd/conf.d".into(),
        bin_dir: "/usr/local/bin".into(),
        lib_dir: "/usr/local/lib/gpu-ckpt".into(),
        payload,
        restart_command: format!("echo x >> '{}'", restarts.display()),
        label_node: None,
        service_account_dir: "/nonexistent".into(),
    };
    Scratch {
        _dir: dir,
        root,
        restarts,
        opts,
    }
}

fn restarts(s: &Scratch) -> usize {
    fs::read_to_string(&s.restarts)
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

#[test]
fn install_is_idempotent_and_uninstall_restores_every_byte() {
    let s = scratch();
    let before = listing(&s.root);
    let out = install(&s.opts).unwrap();
    assert!(out.config_changed && out.restarted);
    assert_eq!(restarts(&s), 1);
    let cfg = fs::read_to_string(s.root.join("etc/containerd/config.toml")).unwrap();
    assert!(cfg.contains(
        "imports = [\"/etc/containerd/conf.d/gpu-ckpt.toml\", \"/etc/containerd/conf.d/gpu-ckpt-restore.toml\"]"
    ), "{cfg}");
    assert!(cfg.contains("# keep"));
    let dropin = fs::read_to_string(s.root.join("etc/containerd/conf.d/gpu-ckpt.toml")).unwrap();
    assert!(dropin.contains("runtime_path = \"/usr/local/bin/containerd-shim-gpu-ckpt-v1\""));
    assert_eq!(
        fs::read_link(s.root.join("usr/local/bin/criu")).unwrap(),
        PathBuf::from("../lib/gpu-ckpt/criu/criu")
    );
    assert!(
        s.root.join("usr/local/bin/criu").is_file(),
        "the link resolves"
    );
    assert_eq!(
        fs::read_link(s.root.join("usr/local/lib/gpu-ckpt/criu/lib/libnet.so")).unwrap(),
        PathBuf::from("libnet.so.1")
    );
    let rec = s.root.join("var/lib/gpu-ckpt/installed.json");
    assert_eq!(fs::metadata(&rec).unwrap().mode() & 0o777, 0o600);
    assert_eq!(Record::load(&rec).unwrap().unwrap().phase, Phase::Installed);

    let installed = listing(&s.root);
    let again = install(&s.opts).unwrap();
    assert!(again.files_changed.is_empty() && !again.config_changed && !again.restarted);
    assert_eq!(restarts(&s), 1);
    assert_eq!(listing(&s.root), installed);

    let out = uninstall(&s.opts).unwrap();
    assert!(out.config_changed && out.restarted);
    assert_eq!(restarts(&s), 2);
    assert_eq!(listing(&s.root), before);
    // Nothing left to do.
    assert_eq!(uninstall(&s.opts).unwrap(), Default::default());
}

#[test]
fn a_foreign_file_is_never_overwritten() {
    let s = scratch();
    fs::write(s.root.join("usr/local/bin/criu"), "theirs").unwrap();
    let before = listing(&s.root);
    let err = install(&s.opts).unwrap_err().to_string();
    assert!(
        err.starts_with("refusing to overwrite /usr/local/bin/criu: the file is not one gpu-ckpt-node-installer installed"),
        "{err}"
    );
    assert_eq!(listing(&s.root), before, "nothing was written");
    assert_eq!(restarts(&s), 0);
}

#[test]
fn a_restart_that_failed_is_retried_by_the_next_run() {
    let mut s = scratch();
    let good = s.opts.restart_command.clone();
    s.opts.restart_command = "echo containerd.service not found >&2; exit 5".into();
    let err = install(&s.opts).unwrap_err().to_string();
    assert!(
        err.contains("restarting containerd with `echo containerd.service not found >&2; exit 5` failed: exit status: 5: containerd.service not found"),
        "{err}"
    );
    // The configuration is written, containerd not restarted: the next install restarts it
    // although nothing changes any more.
    s.opts.restart_command = good;
    let out = install(&s.opts).unwrap();
    assert!(out.files_changed.is_empty() && !out.config_changed && out.restarted);
    assert_eq!(restarts(&s), 1);
    assert!(!install(&s.opts).unwrap().restarted);
}

#[test]
fn a_half_install_is_undone_by_uninstall() {
    let mut s = scratch();
    let before = listing(&s.root);
    s.opts.restart_command = "exit 1".into();
    install(&s.opts).unwrap_err();
    let rec = s.root.join("var/lib/gpu-ckpt/installed.json");
    assert_eq!(
        Record::load(&rec).unwrap().unwrap().phase,
        Phase::Installing
    );
    // A copy cut short leaves a temporary file; it goes too.
    fs::write(s.root.join("usr/local/bin/.gpu-ckpt.gpu-ckpt-new"), "half").unwrap();
    s.opts.restart_command = "true".into();
    uninstall(&s.opts).unwrap();
    assert_eq!(listing(&s.root), before);
}

#[test]
fn a_payload_without_criu_is_named() {
    // CRIU, and the loader it is given as interpreter.
    for missing in ["criu/criu", "criu/lib/ld-linux-x86-64.so.2"] {
        let s = scratch();
        fs::remove_file(s.opts.payload.join(missing)).unwrap();
        let err = install(&s.opts).unwrap_err().to_string();
        assert!(
            err.ends_with(&format!("has no {missing}: the image must carry it")),
            "{err}"
        );
    }
}

#[test]
fn a_new_bin_dir_moves_the_files() {
    let mut s = scratch();
    let before = listing(&s.root);
    install(&s.opts).unwrap();
    s.opts.bin_dir = "/opt/gpu-ckpt/bin".into();
    let out = install(&s.opts).unwrap();
    // The drop-ins name the new shim path: containerd restarts.
    assert!(out.config_changed && out.restarted);
    assert!(!s.root.join("usr/local/bin/gpu-ckpt").exists());
    assert!(s.root.join("opt/gpu-ckpt/bin/gpu-ckpt").is_file());
    uninstall(&s.opts).unwrap();
    assert_eq!(listing(&s.root), before);
}

#[test]
fn an_uninstall_whose_label_step_fails_does_every_other_step() {
    let mut s = scratch();
    let before = listing(&s.root);
    // No API server to reach (no service account here): the install is done but for the label.
    s.opts.label_node = Some("node-a".into());
    let err = install(&s.opts).unwrap_err().to_string();
    assert!(err.starts_with("labelling node node-a: "), "{err}");
    assert_eq!(restarts(&s), 1);

    let err = uninstall(&s.opts).unwrap_err().to_string();
    assert!(
        err.starts_with("uninstall: 1 step(s) failed, every other step was done: remove the labels node-restriction.kubernetes.io/gpu-ckpt-runtime of node node-a: labelling node node-a: "),
        "{err}"
    );
    // containerd's configuration, the drop-ins, the payload: gone, containerd restarted; left
    // are only the record, which keeps the labels to remove, and its directories.
    assert_eq!(restarts(&s), 2);
    let left: Vec<PathBuf> = listing(&s.root)
        .into_iter()
        .filter(|(p, what)| before.get(p) != Some(what))
        .map(|(p, _)| p)
        .collect();
    assert_eq!(
        left,
        [
            PathBuf::from("var/lib"),
            PathBuf::from("var/lib/gpu-ckpt"),
            PathBuf::from("var/lib/gpu-ckpt/installed.json"),
        ]
    );
    let rec = Record::load(&s.root.join("var/lib/gpu-ckpt/installed.json"))
        .unwrap()
        .unwrap();
    assert_eq!(rec.labels.unwrap().node, "node-a");
    assert!(rec.files.is_empty() && rec.config.is_none());
}

#[test]
fn the_installed_criu_runs_through_the_bundled_loader() {
    let s = scratch();
    let placeholder = fs::read(s.opts.payload.join("criu/criu")).unwrap();
    assert!(node_installer::elf::interpreter(&placeholder)
        .unwrap()
        .to_string_lossy()
        .starts_with("/gpu-ckpt-node-installer-sets-this-path-at-install_"));
    install(&s.opts).unwrap();
    let installed = fs::read(s.root.join("usr/local/lib/gpu-ckpt/criu/criu")).unwrap();
    assert_eq!(
        node_installer::elf::interpreter(&installed).unwrap(),
        PathBuf::from("/usr/local/lib/gpu-ckpt/criu/lib/ld-linux-x86-64.so.2")
    );
    assert_eq!(installed.len(), placeholder.len(), "written in place");
    assert!(s
        .root
        .join("usr/local/lib/gpu-ckpt/criu/lib/ld-linux-x86-64.so.2")
        .is_file());
    // The same payload, installed again: nothing to do.
    assert!(install(&s.opts).unwrap().files_changed.is_empty());
}

#[test]
fn a_lib_dir_too_long_for_the_interpreter_is_refused_before_anything_is_written() {
    let mut s = scratch();
    let before = listing(&s.root);
    s.opts.lib_dir = PathBuf::from(format!("/{}", "d".repeat(500)));
    let err = install(&s.opts).unwrap_err().to_string();
    assert!(
        err.starts_with("payload CRIU ") && err.ends_with("(choose a shorter --lib-dir)"),
        "{err}"
    );
    assert_eq!(listing(&s.root), before, "nothing was written");
}
