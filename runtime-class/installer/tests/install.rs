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
    fs::write(payload.join("libgpu-ckpt-nccl.so"), "layer").unwrap();
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
        site: Default::default(),
        driver_root: "/".into(),
        min_restart_interval: None,
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
fn the_nccl_layer_goes_where_the_shim_looks_for_it() {
    let mut s = scratch();
    let before = listing(&s.root);
    install(&s.opts).unwrap();
    let layer = s.root.join("usr/local/lib/gpu-ckpt/libgpu-ckpt-nccl.so");
    assert_eq!(fs::read_to_string(&layer).unwrap(), "layer");
    assert_eq!(fs::metadata(&layer).unwrap().mode() & 0o7777, 0o644);
    // At the shim's default NcclLayer: the side files do not name it.
    let side = |s: &Scratch| {
        fs::read_to_string(
            s.root
                .join("usr/local/bin/containerd-shim-gpu-ckpt-v1.toml"),
        )
        .unwrap()
    };
    assert!(!side(&s).contains("NcclLayer"), "{}", side(&s));
    // Elsewhere: both handlers are told where.
    s.opts.lib_dir = "/opt/gpu-ckpt/lib".into();
    install(&s.opts).unwrap();
    assert!(!layer.exists());
    assert!(s
        .root
        .join("opt/gpu-ckpt/lib/libgpu-ckpt-nccl.so")
        .is_file());
    for f in [
        "usr/local/bin/containerd-shim-gpu-ckpt-v1.toml",
        "usr/local/bin/containerd-shim-gpu-ckpt-restore-v1.toml",
    ] {
        let text = fs::read_to_string(s.root.join(f)).unwrap();
        assert!(
            text.contains("NcclLayer = \"/opt/gpu-ckpt/lib/libgpu-ckpt-nccl.so\""),
            "{f}: {text}"
        );
    }
    // A handler option names another: it wins.
    s.opts.site.handler_options = Some(r#"{"NcclLayer":"/srv/layer.so"}"#.into());
    install(&s.opts).unwrap();
    assert!(
        side(&s).contains("NcclLayer = \"/srv/layer.so\""),
        "{}",
        side(&s)
    );
    assert!(
        !side(&s).contains("/opt/gpu-ckpt/lib/libgpu-ckpt-nccl.so"),
        "{}",
        side(&s)
    );
    // A copy whose bytes differ from the payload's is repaired by the next install.
    fs::write(s.root.join("opt/gpu-ckpt/lib/libgpu-ckpt-nccl.so"), "other").unwrap();
    install(&s.opts).unwrap();
    assert_eq!(
        fs::read_to_string(s.root.join("opt/gpu-ckpt/lib/libgpu-ckpt-nccl.so")).unwrap(),
        "layer"
    );
    uninstall(&s.opts).unwrap();
    assert_eq!(listing(&s.root), before);
    // A payload without the layer is named.
    let s = scratch();
    fs::remove_file(s.opts.payload.join("libgpu-ckpt-nccl.so")).unwrap();
    let err = install(&s.opts).unwrap_err().to_string();
    assert!(
        err.ends_with("has no libgpu-ckpt-nccl.so: the image must carry it"),
        "{err}"
    );
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
fn site_options_are_written_root_only_kept_current_and_removed() {
    let mut s = scratch();
    let before = listing(&s.root);
    let secrets = s._dir.path().join("secrets");
    fs::create_dir_all(&secrets).unwrap();
    fs::write(
        secrets.join("signing.key"),
        format!("{}\n", "ab".repeat(32)),
    )
    .unwrap();
    fs::write(secrets.join(".dockerconfigjson"), r#"{"auths":{}}"#).unwrap();
    let (a, b) = ("11".repeat(32), "22".repeat(32));
    s.opts.site.signing_key = Some(secrets.join("signing.key"));
    s.opts.site.trusted_keys = vec![format!("node-a={a}"), format!("node-b={b}")];
    s.opts.site.restore_sources = vec!["registry.example.com/ckpt/".into()];
    s.opts.site.registry_auth = Some(secrets.join(".dockerconfigjson"));
    s.opts.site.handler_options = Some(r#"{"DeviceLockTimeout":"45s"}"#.into());
    let out = install(&s.opts).unwrap();
    assert!(out.restarted);
    assert_eq!(restarts(&s), 1);
    let mode = |p: &str| fs::symlink_metadata(s.root.join(p)).unwrap().mode() & 0o7777;
    for f in [
        "etc/gpu-ckpt/cluster-key/node.key",
        "etc/gpu-ckpt/cluster-key/node.pub",
        "etc/gpu-ckpt/trusted/node-a.pub",
        "etc/gpu-ckpt/trusted/node-b.pub",
        "etc/gpu-ckpt/registry/auth.json",
        "usr/local/bin/containerd-shim-gpu-ckpt-v1.toml",
        "usr/local/bin/containerd-shim-gpu-ckpt-restore-v1.toml",
    ] {
        assert_eq!(mode(f), 0o600, "{f}");
    }
    for d in [
        "etc/gpu-ckpt",
        "etc/gpu-ckpt/cluster-key",
        "etc/gpu-ckpt/trusted",
        "etc/gpu-ckpt/registry",
    ] {
        assert_eq!(mode(d), 0o700, "{d}");
    }
    assert_eq!(
        fs::read_link(
            s.root
                .join("usr/local/bin/containerd-shim-gpu-ckpt-restore-v1")
        )
        .unwrap(),
        PathBuf::from("containerd-shim-gpu-ckpt-v1")
    );
    let side = fs::read_to_string(
        s.root
            .join("usr/local/bin/containerd-shim-gpu-ckpt-restore-v1.toml"),
    )
    .unwrap();
    for want in [
        "Mode = \"restore\"",
        "SigningKey = \"/etc/gpu-ckpt/cluster-key/node.key\"",
        "TrustedKeysDir = \"/etc/gpu-ckpt/trusted\"",
        "RestoreSources = [\"registry.example.com/ckpt/\"]",
        "RegistryAuthFile = \"/etc/gpu-ckpt/registry/auth.json\"",
        "DeviceLockTimeout = \"45s\"",
    ] {
        assert!(side.contains(want), "{want} not in {side}");
    }
    let dropin =
        fs::read_to_string(s.root.join("etc/containerd/conf.d/gpu-ckpt-restore.toml")).unwrap();
    assert!(
        dropin.contains("runtime_path = \"/usr/local/bin/containerd-shim-gpu-ckpt-restore-v1\"")
    );

    // Changed values: node-b revoked, another source. The side files and the trust files are
    // rewritten (node-b's file goes), the drop-ins are not: no restart, as the shim reads the
    // side files at each Create.
    s.opts.site.revoked_keys = vec![format!("ed25519:{b}")];
    s.opts
        .site
        .restore_sources
        .push("/var/lib/kubelet/checkpoints/".into());
    let out = install(&s.opts).unwrap();
    assert!(!out.config_changed && !out.restarted, "{out:?}");
    assert_eq!(restarts(&s), 1);
    assert!(!s.root.join("etc/gpu-ckpt/trusted/node-b.pub").exists());
    assert!(s.root.join("etc/gpu-ckpt/trusted/node-a.pub").exists());
    let revoked = fs::read_to_string(s.root.join("etc/gpu-ckpt/revoked")).unwrap();
    assert!(
        revoked.lines().any(|l| l.starts_with("ed25519:")),
        "{revoked}"
    );
    assert_eq!(mode("etc/gpu-ckpt/revoked"), 0o600);
    // runc's path is a drop-in key: that change restarts containerd.
    s.opts.site.runc_path = Some("/usr/bin/runc".into());
    let out = install(&s.opts).unwrap();
    assert!(out.config_changed && out.restarted, "{out:?}");
    assert_eq!(restarts(&s), 2);

    // A bad option is named, and nothing is written.
    let installed = listing(&s.root);
    s.opts.site.handler_options = Some(r#"{"TrustedKeysDir":"/x"}"#.into());
    let err = install(&s.opts).unwrap_err().to_string();
    assert!(
        err.starts_with("site option handler option TrustedKeysDir"),
        "{err}"
    );
    assert_eq!(listing(&s.root), installed);

    uninstall(&s.opts).unwrap();
    assert_eq!(listing(&s.root), before);
}

#[test]
fn status_needs_the_ready_marker_and_an_unchanged_node() {
    use node_installer::status::{clear_ready, drift, mark_ready, status};
    let s = scratch();
    let o = &s.opts;
    let ready = s.root.join("../pod/run/ready");
    let problems = status(o, &ready).unwrap();
    assert!(problems.len() == 2, "{problems:?}");
    assert!(problems[0].starts_with("no ready marker"), "{problems:?}");
    assert!(
        problems[1].starts_with("nothing is installed"),
        "{problems:?}"
    );

    install(o).unwrap();
    mark_ready(&ready, "{}").unwrap();
    assert_eq!(status(o, &ready).unwrap(), Vec::<String>::new());

    // Another agent rewrites config.toml without the imports, and changes a binary.
    let cfg = s.root.join("etc/containerd/config.toml");
    fs::write(&cfg, "version = 3\n").unwrap();
    fs::write(s.root.join("usr/local/bin/gpu-ckpt"), "changed").unwrap();
    let found = drift(o).unwrap();
    assert_eq!(
        found,
        [
            "/usr/local/bin/gpu-ckpt is missing or changed since the install",
            "containerd's configuration /etc/containerd/config.toml does not import /etc/containerd/conf.d/gpu-ckpt.toml",
            "containerd's configuration /etc/containerd/config.toml does not import /etc/containerd/conf.d/gpu-ckpt-restore.toml",
        ]
    );
    assert_eq!(status(o, &ready).unwrap(), found);
    // install repairs both, restarting containerd once.
    let before = restarts(&s);
    let out = install(o).unwrap();
    assert!(out.config_changed && out.restarted, "{out:?}");
    assert_eq!(restarts(&s), before + 1);
    assert!(drift(o).unwrap().is_empty());

    clear_ready(&ready).unwrap();
    clear_ready(&ready).unwrap();
    assert!(status(o, &ready).unwrap()[0].starts_with("no ready marker"));
}

/// A key taken off the values stops being trusted even where its file was changed on the node,
/// and a key file put into the installer's trusted directory by hand is drift.
#[test]
fn a_trusted_key_off_the_values_is_removed_and_an_unknown_one_is_drift() {
    use node_installer::status::drift;
    let mut s = scratch();
    let (a, b, c) = ("11".repeat(32), "22".repeat(32), "33".repeat(32));
    s.opts.site.trusted_keys = vec![format!("node-a={a}"), format!("node-b={b}")];
    install(&s.opts).unwrap();
    assert!(drift(&s.opts).unwrap().is_empty());
    // node-b's file rewritten on the node (another key in it), then node-b taken off the values.
    let b_file = s.root.join("etc/gpu-ckpt/trusted/node-b.pub");
    fs::write(&b_file, format!("{c}\n")).unwrap();
    s.opts.site.trusted_keys = vec![format!("node-a={a}")];
    install(&s.opts).unwrap();
    assert!(
        !b_file.exists(),
        "a key no longer in the values is still trusted"
    );
    assert!(s.root.join("etc/gpu-ckpt/trusted/node-a.pub").exists());
    // A key put there by hand: drift, named.
    fs::write(
        s.root.join("etc/gpu-ckpt/trusted/extra.pub"),
        format!("{c}\n"),
    )
    .unwrap();
    assert_eq!(
        drift(&s.opts).unwrap(),
        ["/etc/gpu-ckpt/trusted/extra.pub is a trusted key the values do not give (trust.trustedKeys): the restore handler trusts it"]
    );
}

/// An existing directory that trust files or CRIU would go into is adopted only if root's alone
/// to write (0700 for the site's); else the install refuses it, naming it.
#[test]
fn a_directory_others_may_write_is_refused_for_trust_and_criu() {
    let mut s = scratch();
    s.opts.site.trusted_keys = vec![format!("node-a={}", "11".repeat(32))];
    // A CA: its files go two levels below the site's directory (certs.d/HOST/).
    let ca = s._dir.path().join("ca.pem");
    fs::write(
        &ca,
        "-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    s.opts.site.registry_cas = vec![format!("reg:5443={}", ca.display())];
    // The site's directory, there already and readable by others.
    let site = s.root.join("etc/gpu-ckpt");
    fs::create_dir_all(&site).unwrap();
    fs::set_permissions(&site, fs::Permissions::from_mode(0o755)).unwrap();
    let err = install(&s.opts).unwrap_err().to_string();
    assert!(
        err.contains("refusing to use directory /etc/gpu-ckpt") && err.contains("0700"),
        "{err}"
    );
    assert!(!site.join("trusted").exists());
    fs::set_permissions(&site, fs::Permissions::from_mode(0o700)).unwrap();
    // The bin directory, group-writable: the side files and CRIU's link go there.
    let bin = s.root.join("usr/local/bin");
    fs::set_permissions(&bin, fs::Permissions::from_mode(0o775)).unwrap();
    let err = install(&s.opts).unwrap_err().to_string();
    assert!(
        err.contains("refusing to use directory /usr/local/bin")
            && err.contains("writable by group or others"),
        "{err}"
    );
    // Owned by another user.
    fs::set_permissions(&bin, fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::chown(&bin, Some(1000), None).unwrap();
    let err = install(&s.opts).unwrap_err().to_string();
    assert!(err.contains("owned by uid 1000"), "{err}");
    std::os::unix::fs::chown(&bin, Some(0), None).unwrap();
    install(&s.opts).unwrap();
    // Every directory the installer made in the site's is root's alone, and a second run
    // adopts them.
    for d in ["etc/gpu-ckpt/certs.d", "etc/gpu-ckpt/certs.d/reg:5443"] {
        assert_eq!(
            fs::metadata(s.root.join(d)).unwrap().mode() & 0o777,
            0o700,
            "{d}"
        );
    }
    install(&s.opts).unwrap();
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

#[test]
fn only_containerds_own_configuration_restarts_it_and_the_watch_backs_off() {
    use node_installer::status::drift;
    use std::time::Duration;
    let mut s = scratch();
    let before = listing(&s.root);
    let original = fs::read_to_string(s.root.join("etc/containerd/config.toml")).unwrap();
    let ca = s._dir.path().join("ca.pem");
    fs::write(
        &ca,
        "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    s.opts.site.registry_cas = vec![format!("reg:5443={}", ca.display())];
    install(&s.opts).unwrap();
    assert_eq!(restarts(&s), 1);
    let hosts = s.root.join("etc/gpu-ckpt/certs.d/reg:5443/hosts.toml");
    assert!(hosts.is_file());

    // Another agent's chmod of a drop-in: the mode is put right, containerd's bytes are the
    // same, so no restart.
    let dropin = s.root.join("etc/containerd/conf.d/gpu-ckpt.toml");
    fs::set_permissions(&dropin, fs::Permissions::from_mode(0o600)).unwrap();
    let out = install(&s.opts).unwrap();
    assert!(!out.config_changed && !out.restarted, "{out:?}");
    assert_eq!(
        out.files_changed,
        [PathBuf::from("/etc/containerd/conf.d/gpu-ckpt.toml")]
    );
    assert_eq!(fs::metadata(&dropin).unwrap().mode() & 0o7777, 0o644);
    assert_eq!(restarts(&s), 1);

    // The registry's CA taken out of the values: its hosts.toml goes, which containerd never
    // reads (the shim's pulls do): no restart.
    s.opts.site.registry_cas.clear();
    let out = install(&s.opts).unwrap();
    assert!(!hosts.exists());
    assert!(!out.config_changed && !out.restarted, "{out:?}");
    assert_eq!(restarts(&s), 1);

    // The watch, restarting at most once an hour: the imports removed puts them back with a
    // restart; removed again within the hour, they are put back and the restart waits,
    // reported, and still pending for the probe.
    let watch = Options {
        min_restart_interval: Some(Duration::from_secs(3600)),
        ..s.opts.clone()
    };
    let cfg = s.root.join("etc/containerd/config.toml");
    fs::write(&cfg, &original).unwrap();
    let out = install(&watch).unwrap();
    assert!(out.config_changed && out.restarted, "{out:?}");
    assert_eq!(restarts(&s), 2);
    fs::write(&cfg, &original).unwrap();
    let out = install(&watch).unwrap();
    assert!(out.config_changed && !out.restarted, "{out:?}");
    let why = out
        .restart_deferred
        .expect("the deferred restart is reported");
    assert!(
        why.contains("the least interval between restarts is 3600 s"),
        "{why}"
    );
    assert_eq!(restarts(&s), 2);
    assert_eq!(
        drift(&watch).unwrap(),
        ["containerd has not been restarted since its configuration changed"]
    );
    // The hour passed: the next check restarts.
    let at = node_installer::install::record_path(&s.opts.fs).unwrap();
    let mut rec = Record::load(&at).unwrap().unwrap();
    rec.last_repair_restart = rec.last_repair_restart.map(|t| t - 3600);
    rec.save(&at).unwrap();
    let out = install(&watch).unwrap();
    assert!(out.restarted && out.restart_deferred.is_none(), "{out:?}");
    assert_eq!(restarts(&s), 3);
    assert!(drift(&watch).unwrap().is_empty());

    uninstall(&s.opts).unwrap();
    assert_eq!(listing(&s.root), before);
}
