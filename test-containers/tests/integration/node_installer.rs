//! The node installer (`gpu-ckpt-node-installer`, runtime-class/installer/) against a scratch
//! node root holding a real containerd configuration: install, then a private containerd on that
//! configuration (gpu-ckpt's handlers reached only through the `imports` the installer added, the
//! shim and CRIU only where it installed them) runs a pod on handler gpu-ckpt, checkpoints it
//! through CRI and restores it through the gpu-ckpt-restore handler; uninstall, and the scratch
//! root is back to where it started, byte for byte. Also: a second install restarts nothing, a
//! foreign file is never overwritten, and an administrator's edit of config.toml survives an
//! uninstall.
//!
//! The restart command records each call in a file; the test (re)starts its containerd itself.
//! Labelling (`--label-node`) goes to a stand-in for the Kubernetes API server on loopback
//! ([`FakeApi`]: TLS with a CA made for the test, answering each PATCH with the status the test
//! sets), which shows an uninstall whose label removal is refused (401: the ServiceAccount was
//! deleted first) still removing everything else.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;
use anyhow::{bail, ensure, Context, Result};
use sha2::{Digest, Sha256};
use test_containers::cri::{ContainerSpec, Cri, PodSpec};
use test_containers::stack::{Node, NodeBuilder, Stack, GPU_CKPT_HANDLER};

const INSTALLER: &str = "gpu-ckpt-node-installer";
const SHIM: &str = "containerd-shim-gpu-ckpt-v1";
/// Where the restore handler's default `RestoreSources` allows checkpoints from.
const KUBELET_CHECKPOINTS: &str = "/var/lib/kubelet/checkpoints";

/// Every entry below `root`: its kind, mode, and content digest or link target.
fn listing(root: &Path) -> Result<BTreeMap<PathBuf, String>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for e in fs::read_dir(&dir).with_context(|| format!("read {}", dir.display()))? {
            let p = e?.path();
            let m = fs::symlink_metadata(&p)?;
            let rel = p.strip_prefix(root)?.to_path_buf();
            let mode = m.mode() & 0o7777;
            let what = if m.file_type().is_symlink() {
                format!("link {mode:o} -> {}", fs::read_link(&p)?.display())
            } else if m.is_dir() {
                todo.push(p.clone());
                format!("dir {mode:o}")
            } else {
                let digest = hex::encode(Sha256::digest(fs::read(&p)?));
                format!("file {mode:o} {} sha256:{digest}", m.len())
            };
            out.insert(rel, what);
        }
    }
    Ok(out)
}

fn same_listing(
    what: &str,
    want: &BTreeMap<PathBuf, String>,
    got: &BTreeMap<PathBuf, String>,
) -> Result<()> {
    let mut diffs = Vec::new();
    for (p, w) in want {
        match got.get(p) {
            Some(g) if g == w => {}
            Some(g) => diffs.push(format!("{}: was {w}, now {g}", p.display())),
            None => diffs.push(format!("{}: gone (was {w})", p.display())),
        }
    }
    for (p, g) in got {
        if !want.contains_key(p) {
            diffs.push(format!("{}: new ({g})", p.display()));
        }
    }
    ensure!(
        diffs.is_empty(),
        "{what}: the scratch root differs:\n{}",
        diffs.join("\n")
    );
    Ok(())
}

/// The payload the installer image carries: the workspace's shim, gpu-ckpt and gpu-ckpt-hook,
/// its NCCL layer (`libgpu_ckpt_nccl.so`, shipped as `libgpu-ckpt-nccl.so`), and the stack's CRIU
/// bundled as `make payload` bundles it (runtime-class/installer/payload.sh:
/// every library it needs and glibc's loader in criu/lib, its RPATH `$ORIGIN/lib`, its
/// interpreter a placeholder the installer replaces).
pub(crate) fn make_payload(stack: &Stack, dir: &Path) -> Result<()> {
    fs::create_dir_all(dir)?;
    for b in [SHIM, "gpu-ckpt", "gpu-ckpt-hook"] {
        let from = stack.shim_dir().join(b);
        fs::copy(&from, dir.join(b)).with_context(|| {
            format!(
                "copy {} (build it: cargo build -p gpu-ckpt-shim -p gpu-ckpt-cli -p gpu-ckpt-oci-hooks)",
                from.display()
            )
        })?;
    }
    let layer = stack.shim_dir().join("libgpu_ckpt_nccl.so");
    fs::copy(&layer, dir.join("libgpu-ckpt-nccl.so")).with_context(|| {
        format!(
            "copy {} (build it: cargo build -p gpu-ckpt-nccl-layer)",
            layer.display()
        )
    })?;
    bundle_criu(stack, &dir.join("criu"))
}

/// The installed CRIU, run as runc runs it (`criu` from PATH, here `<bin>/criu`), maps only the
/// bundled loader and libraries, glibc's included, and none of the host's: `criu service` (which
/// stays up until stopped) has its /proc/PID/maps read; `criu --version` runs and `criu check`
/// says "Looks good." with them.
fn check_bundled_criu(bin_dir: &Path, criu_dir: &Path) -> Result<()> {
    let criu = bin_dir.join("criu");
    let v = run_ok(Command::new(&criu).arg("--version"))?;
    ensure!(v.contains("Version"), "criu --version: {v}");
    let check = Command::new(&criu).arg("check").output()?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    ensure!(
        check.status.success() && said.contains("Looks good."),
        "the installed criu check: {}: {said}",
        check.status
    );
    let scratch = tempfile::tempdir()?;
    let mut service = Command::new(&criu)
        .args(["service", "--address"])
        .arg(scratch.path().join("criu.sock"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let pid = service.id();
    let maps = (|| -> Result<BTreeSet<PathBuf>> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            // Up once it listens: its libraries are mapped by then.
            if scratch.path().join("criu.sock").exists() {
                let text = fs::read_to_string(format!("/proc/{pid}/maps"))?;
                return Ok(text
                    .lines()
                    .filter_map(|l| l.split_whitespace().nth(5))
                    .filter(|p| p.starts_with('/'))
                    .map(PathBuf::from)
                    .collect());
            }
            ensure!(
                std::time::Instant::now() < deadline,
                "criu service did not listen within 10 s"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    })();
    let exe = fs::read_link(format!("/proc/{pid}/exe"));
    let _ = service.kill();
    let _ = service.wait();
    let maps = maps?;
    ensure!(
        exe? == criu_dir.join("criu"),
        "the running CRIU is not the installed binary itself"
    );
    let libs = criu_dir.join("lib");
    for want in ["ld-linux-x86-64.so.2", "libc.so.6", "libnet.so.1"] {
        ensure!(
            maps.contains(&libs.join(want)),
            "criu service does not map the bundled {want}: {maps:?}"
        );
    }
    // Shared objects (a name with `.so`): only the bundled ones.
    let foreign: Vec<_> = maps
        .iter()
        .filter(|p| p.to_string_lossy().contains(".so") && !p.starts_with(&libs))
        .collect();
    ensure!(
        foreign.is_empty(),
        "criu service maps shared objects that are not the bundled ones (the host's libc?): {foreign:?}"
    );
    Ok(())
}

struct Installer {
    bin: PathBuf,
    root: PathBuf,
    payload: PathBuf,
    restarts: PathBuf,
}

impl Installer {
    /// The installer of the workspace for an empty node root `<scratch>/node`, with a payload
    /// made at `<scratch>/payload` and its restarts counted in `<scratch>/restarts`.
    fn on_scratch(stack: &Stack, scratch: &Path) -> Result<Installer> {
        let root = scratch.join("node");
        fs::create_dir(&root)?;
        let payload = scratch.join("payload");
        make_payload(stack, &payload)?;
        Ok(Installer {
            bin: installer_bin(stack)?,
            root,
            payload,
            restarts: scratch.join("restarts"),
        })
    }

    fn cmd(&self, action: &str) -> Command {
        let mut c = Command::new(&self.bin);
        c.arg(action)
            .arg("--root")
            .arg(&self.root)
            .arg("--host-root")
            .arg(&self.root)
            .arg("--payload")
            .arg(&self.payload)
            .arg("--restart-command")
            .arg(format!("echo restart >> '{}'", self.restarts.display()));
        c
    }

    /// Runs `action`; its one-line JSON summary.
    fn run(&self, action: &str) -> Result<serde_json::Value> {
        let out = run_ok(&mut self.cmd(action))?;
        let line = out.lines().last().unwrap_or_default();
        serde_json::from_str(line).with_context(|| format!("{action} printed {out:?}"))
    }

    /// Runs `action` expecting it to fail; its error output.
    fn fails(&self, action: &str) -> Result<String> {
        let out = self.cmd(action).output()?;
        ensure!(
            !out.status.success(),
            "{action} succeeded: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        Ok(String::from_utf8_lossy(&out.stderr).into_owned())
    }

    fn restarts(&self) -> usize {
        fs::read_to_string(&self.restarts)
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }
}

/// A scratch node root: the node's containerd configuration (the test stack's, without any
/// gpu-ckpt handler) with an administrator's comment, and a tool of theirs in /usr/local/bin.
pub(crate) fn scratch_root(builder: &NodeBuilder, root: &Path) -> Result<PathBuf> {
    fs::set_permissions(root, fs::Permissions::from_mode(0o755))?;
    let etc = root.join("etc/containerd");
    fs::create_dir_all(&etc)?;
    let config = etc.join("config.toml");
    let text = format!(
        "# This node's containerd configuration (kept by the administrator).\n{}",
        builder.render_config()?
    );
    ensure!(
        !text.contains("io.containerd.gpu-ckpt.v1") && !text.contains("runtimes.gpu-ckpt"),
        "the scratch configuration should not know gpu-ckpt yet:\n{text}"
    );
    fs::write(&config, text)?;
    fs::set_permissions(&config, fs::Permissions::from_mode(0o640))?;
    fs::create_dir_all(root.join("usr/local/bin"))?;
    fs::write(
        root.join("usr/local/bin/admin-tool"),
        "#!/bin/sh\necho mine\n",
    )?;
    fs::set_permissions(
        root.join("usr/local/bin/admin-tool"),
        fs::Permissions::from_mode(0o755),
    )?;
    fs::create_dir_all(root.join("var/lib"))?;
    Ok(config)
}

pub(crate) fn installer_bin(stack: &Stack) -> Result<PathBuf> {
    let bin = stack.shim_dir().join(INSTALLER);
    ensure!(
        bin.is_file(),
        "{} is not built: cargo build -p gpu-ckpt-node-installer",
        bin.display()
    );
    Ok(bin)
}

#[test]
fn install_run_checkpoint_restore_uninstall_leaves_the_node_as_it_was() -> Result<()> {
    let stack = Stack::discover()?;
    let scratch = tempfile::tempdir()?;
    let inst = Installer::on_scratch(&stack, scratch.path())?;
    let root = inst.root.clone();

    // containerd's PATH: the installed bin dir, the stack's containerd, the system's; not the
    // stack's CRIU directory nor the workspace's shim directory, so only the installed shim
    // and CRIU can serve the pods.
    let bin_dir = root.join("usr/local/bin");
    let path_env = format!(
        "{}:{}:/usr/sbin:/usr/bin:/sbin:/bin",
        bin_dir.display(),
        stack.prefix().join("root/usr/bin").display()
    );
    for d in path_env.split(':').skip(1) {
        ensure!(
            !Path::new(d).join("criu").exists(),
            "{d}/criu exists: the test could not tell it from the installed CRIU"
        );
    }
    let builder = Node::builder_on(&stack, "ni-node")
        .without_gpu_ckpt_handler()
        .env("PATH", &path_env);
    let config = scratch_root(&builder, &root)?;
    let original_config = fs::read_to_string(&config)?;
    let baseline = listing(&root)?;

    // A foreign file where the installer would write: refused, naming it, nothing changed.
    let foreign = bin_dir.join("gpu-ckpt");
    fs::write(&foreign, "someone else's gpu-ckpt\n")?;
    let err = inst.fails("install")?;
    ensure!(
        err.contains(&format!(
            "refusing to overwrite {}",
            "/usr/local/bin/gpu-ckpt"
        )),
        "the refusal does not name the file: {err}"
    );
    ensure!(
        fs::read_to_string(&foreign)? == "someone else's gpu-ckpt\n",
        "the foreign file was changed"
    );
    fs::remove_file(&foreign)?;
    same_listing("after the refused install", &baseline, &listing(&root)?)?;
    ensure!(
        inst.restarts() == 0,
        "a refused install restarted containerd"
    );

    // Install.
    let out = inst.run("install")?;
    ensure!(
        out["config_changed"] == true && out["restarted"] == true,
        "first install: {out}"
    );
    ensure!(inst.restarts() == 1, "restarts: {}", inst.restarts());
    let installed = fs::read_to_string(&config)?;
    let dropin = root.join("etc/containerd/conf.d/gpu-ckpt.toml");
    ensure!(
        installed.contains(&format!("\"{}\"", dropin.display())),
        "config.toml does not import {}:\n{installed}",
        dropin.display()
    );
    ensure!(
        installed.starts_with(&original_config[..original_config.find('\n').unwrap_or(0)]),
        "the administrator's comment is gone:\n{installed}"
    );
    let record = root.join("var/lib/gpu-ckpt/installed.json");
    let mode = |p: &Path| fs::metadata(p).map(|m| m.mode() & 0o777);
    ensure!(mode(&record)? == 0o600, "record mode {:o}", mode(&record)?);
    ensure!(
        mode(record.parent().unwrap_or(&root))? == 0o700,
        "record dir mode"
    );
    ensure!(bin_dir.join(SHIM).is_file() && bin_dir.join("criu").is_symlink());
    // The installed CRIU, run by its link as runc runs it, loads its libraries from beside it.
    let lib_dir = root.join("usr/local/lib/gpu-ckpt/criu/lib");
    let out = Command::new(bin_dir.join("criu"))
        .arg("--version")
        .env("LD_DEBUG", "libs")
        .output()?;
    let debug = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.success()
            && debug.contains(&format!("calling init: {}/libnet.so.1", lib_dir.display())),
        "the installed criu does not load libnet.so.1 from {}: {debug}",
        lib_dir.display()
    );
    // With its own glibc: the bundled libc, and no other, through the bundled loader.
    ensure!(
        debug.contains(&format!("calling init: {}/libc.so.6", lib_dir.display()))
            && !debug.contains("/lib/x86_64-linux-gnu/libc.so.6"),
        "the installed criu does not load only the bundled libc.so.6 from {}: {debug}",
        lib_dir.display()
    );
    check_bundled_criu(&bin_dir, &root.join("usr/local/lib/gpu-ckpt/criu"))?;
    // The NCCL layer, the payload's bytes, and both handlers told where it is on this node.
    let layer = root.join("usr/local/lib/gpu-ckpt/libgpu-ckpt-nccl.so");
    ensure!(
        fs::read(&layer)? == fs::read(inst.payload.join("libgpu-ckpt-nccl.so"))?,
        "{} is not the payload's layer",
        layer.display()
    );
    for side in [
        "containerd-shim-gpu-ckpt-v1.toml",
        "containerd-shim-gpu-ckpt-restore-v1.toml",
    ] {
        let text = fs::read_to_string(bin_dir.join(side))?;
        ensure!(
            text.contains(&format!("NcclLayer = \"{}\"", layer.display())),
            "{side} does not name the installed layer:\n{text}"
        );
    }

    // containerd on that configuration.
    let node = node_with(builder.config_file(&config))?;
    let archive = Path::new(KUBELET_CHECKPOINTS)
        .join(format!("checkpoint-ni-{}-counter.tar", std::process::id()));
    fs::create_dir_all(KUBELET_CHECKPOINTS)?;
    let result = rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        cri.pull_image(workloads()).await?;
        let pod = cri
            .run_pod(&PodSpec::new("ni-worker", node.pod_log_root()).handler(GPU_CKPT_HANDLER))
            .await?;
        let spec = ContainerSpec::new("counter", workloads()).command(&[
            "/bin/counter",
            "--interval-ms",
            "100",
        ]);
        let id = cri.run_container(&pod, &spec).await?;
        // The pod runs on the installed shim, found through the drop-in's runtime_path.
        let shims = node.shim_processes(SHIM);
        ensure!(!shims.is_empty(), "no {SHIM} serves the pod");
        for pid in &shims {
            let exe = fs::read_link(format!("/proc/{pid}/exe"))?;
            ensure!(
                exe == bin_dir.join(SHIM),
                "shim {pid} runs {}, not the installed one",
                exe.display()
            );
        }
        let before = cri_counter_above(&cri, &id, "/counter.txt", 5).await?;
        let _ = fs::remove_file(&archive);
        cri.checkpoint_container(&id, &archive, 120).await?;
        let after = cri_counter(&cri, &id, "/counter.txt").await?;
        cri.remove_pod(&pod).await?;

        // Restore through the restore handler.
        let pod = cri
            .run_pod(
                &restore_pod("ni-worker", &node, &archive.display().to_string()),
            )
            .await?;
        let id = cri.run_container(&pod, &spec).await?;
        let first = cri_counter(&cri, &id, "/counter.txt").await?;
        ensure!(
            first >= before && first <= after + 2,
            "the restored counter started at {first}; the checkpoint was between {before} and {after}"
        );
        cri_counter_above(&cri, &id, "/counter.txt", first).await?;

        // A second install (the DaemonSet's pod restarted) changes and restarts nothing.
        let again = inst.run("install")?;
        ensure!(
            again["files_changed"].as_array().is_some_and(|a| a.is_empty())
                && again["config_changed"] == false
                && again["restarted"] == false,
            "second install: {again}"
        );
        ensure!(inst.restarts() == 1, "restarts: {}", inst.restarts());
        cri_counter_above(&cri, &id, "/counter.txt", first + 1).await?;
        cri.remove_pod(&pod).await?;
        Ok(())
    });
    let _ = fs::remove_file(&archive);
    result?;

    // Uninstall: containerd's configuration changed, so it is restarted; then the root is
    // exactly what it was.
    let out = inst.run("uninstall")?;
    ensure!(
        out["config_changed"] == true && out["restarted"] == true,
        "uninstall: {out}"
    );
    ensure!(inst.restarts() == 2, "restarts: {}", inst.restarts());
    drop(node);
    same_listing("after uninstall", &baseline, &listing(&root)?)?;
    ensure!(fs::read_to_string(&config)? == original_config);
    Ok(())
}

#[test]
fn uninstall_keeps_an_administrators_edit_of_the_configuration() -> Result<()> {
    let stack = Stack::discover()?;
    let scratch = tempfile::tempdir()?;
    let inst = Installer::on_scratch(&stack, scratch.path())?;
    let root = inst.root.clone();
    let builder = Node::builder_on(&stack, "ni-edit").without_gpu_ckpt_handler();
    let config = scratch_root(&builder, &root)?;
    let original = fs::read_to_string(&config)?;
    let baseline = listing(&root)?;

    inst.run("install")?;
    // The administrator edits the file after the install.
    let edit = "\n# raised for the big images (admin, after gpu-ckpt was installed)\n[plugins.'io.containerd.grpc.v1.cri'.x]\n  y = 1\n";
    let mut text = fs::read_to_string(&config)?;
    text.push_str(edit);
    fs::write(&config, &text)?;

    let out = inst.run("uninstall")?;
    ensure!(
        out["restarted"] == true,
        "the config changed, containerd must restart: {out}"
    );
    let after = fs::read_to_string(&config)?;
    // Only the imports entry went: the original plus the edit, byte for byte.
    ensure!(
        after == format!("{original}{edit}"),
        "expected the original configuration plus the edit, got:\n{after}"
    );
    // Everything else is as it was.
    let mut want = baseline.clone();
    let mut got = listing(&root)?;
    want.remove(Path::new("etc/containerd/config.toml"));
    got.remove(Path::new("etc/containerd/config.toml"));
    same_listing("after uninstall", &want, &got)?;
    if got.len() != want.len() {
        bail!("listing sizes differ");
    }
    Ok(())
}

/// One request the fake API server received.
#[derive(Debug, Clone)]
pub(crate) struct ApiRequest {
    /// "PATCH /api/v1/nodes/node-a"
    pub(crate) line: String,
    pub(crate) authorization: String,
    pub(crate) content_type: String,
    pub(crate) body: serde_json::Value,
}

/// A stand-in for the Kubernetes API server on 127.0.0.1: HTTPS with a certificate of a CA made
/// for it (openssl), and the service account files (`token`, `ca.crt`) the installer reads in
/// a pod. Every request gets the status in `status`, with a Kubernetes Status body for an
/// error; each is recorded. A GET of a DaemonSet gets the object in `daemonset` (404 when there
/// is none). Stops when dropped.
pub(crate) struct FakeApi {
    port: u16,
    sa_dir: PathBuf,
    pub(crate) token: String,
    status: std::sync::Arc<std::sync::atomic::AtomicU16>,
    daemonset: std::sync::Arc<std::sync::Mutex<Option<serde_json::Value>>>,
    requests: std::sync::Arc<std::sync::Mutex<Vec<ApiRequest>>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeApi {
    pub(crate) fn start(dir: &Path) -> Result<FakeApi> {
        use rustls::pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer};
        use std::sync::atomic::{AtomicBool, AtomicU16};
        use std::sync::{Arc, Mutex};

        fs::create_dir_all(dir)?;
        let openssl = |args: &[&str]| -> Result<()> {
            run_ok(Command::new("openssl").args(args).current_dir(dir)).map(|_| ())
        };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        openssl(
            &[
                &["req", "-x509"][..],
                &ec,
                &["-days", "1", "-subj", "/CN=fake kube CA"],
                &["-keyout", "ca.key", "-out", "ca.crt"],
            ]
            .concat(),
        )?;
        openssl(
            &[
                &["req"][..],
                &ec,
                &[
                    "-subj",
                    "/CN=kubernetes",
                    "-keyout",
                    "server.key",
                    "-out",
                    "server.csr",
                ],
            ]
            .concat(),
        )?;
        fs::write(
            dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
        )?;
        openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            "server.ext",
            "-out",
            "server.crt",
        ])?;
        let sa_dir = dir.join("serviceaccount");
        fs::create_dir_all(&sa_dir)?;
        fs::copy(dir.join("ca.crt"), sa_dir.join("ca.crt"))?;
        let token = format!("fake-token-{}", test_containers::cri::new_uid());
        fs::write(sa_dir.join("token"), &token)?;

        let certs = CertificateDer::pem_file_iter(dir.join("server.crt"))?
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let key = PrivateKeyDer::from_pem_file(dir.join("server.key"))?;
        let config = Arc::new(
            rustls::ServerConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(certs, key)?,
        );
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let status = Arc::new(AtomicU16::new(200));
        let daemonset = Arc::new(Mutex::new(None));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (status, requests, stop) = (status.clone(), requests.clone(), stop.clone());
            let daemonset = daemonset.clone();
            std::thread::spawn(move || {
                // Bounded: the test drops the server when it is done, within its own time.
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(600);
                while !stop.load(std::sync::atomic::Ordering::SeqCst)
                    && std::time::Instant::now() < deadline
                {
                    match listener.accept() {
                        Ok((sock, _)) => {
                            let code = status.load(std::sync::atomic::Ordering::SeqCst);
                            let ds = daemonset.lock().unwrap_or_else(|e| e.into_inner()).clone();
                            match serve_one(sock, config.clone(), code, ds) {
                                Ok(r) => requests.lock().unwrap_or_else(|e| e.into_inner()).push(r),
                                Err(e) => eprintln!("fake API server: {e:#}"),
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(std::time::Duration::from_millis(20))
                        }
                        Err(e) => {
                            eprintln!("fake API server: accept: {e}");
                            break;
                        }
                    }
                }
            })
        };
        Ok(FakeApi {
            port,
            sa_dir,
            token,
            status,
            daemonset,
            requests,
            stop,
            thread: Some(thread),
        })
    }

    /// What a GET of a DaemonSet answers: `ds` (200), or 404 when `None`.
    pub(crate) fn set_daemonset(&self, ds: Option<serde_json::Value>) {
        *self.daemonset.lock().unwrap_or_else(|e| e.into_inner()) = ds;
    }

    /// The pod's environment for the installer: where the API server is.
    pub(crate) fn env(&self) -> [(&'static str, String); 2] {
        [
            ("KUBERNETES_SERVICE_HOST", "127.0.0.1".to_string()),
            ("KUBERNETES_SERVICE_PORT", self.port.to_string()),
        ]
    }

    /// The service account directory (token, ca.crt).
    pub(crate) fn sa_dir(&self) -> &Path {
        &self.sa_dir
    }

    fn set_status(&self, code: u16) {
        self.status.store(code, std::sync::atomic::Ordering::SeqCst);
    }

    pub(crate) fn requests(&self) -> Vec<ApiRequest> {
        self.requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Points `cmd` (the installer) at this server as a pod's environment would, and has it
    /// label `node`.
    fn label_with(&self, cmd: &mut Command, node: &str) {
        cmd.env("KUBERNETES_SERVICE_HOST", "127.0.0.1")
            .env("KUBERNETES_SERVICE_PORT", self.port.to_string())
            .arg("--label-node")
            .arg(node)
            .arg("--service-account-dir")
            .arg(&self.sa_dir);
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Reads one HTTP/1.1 request over TLS on `sock` (headers and a Content-Length body, at most
/// 1 MiB) and answers it with `code`; a GET of a DaemonSet with `daemonset` (404 when `None`).
fn serve_one(
    sock: std::net::TcpStream,
    config: std::sync::Arc<rustls::ServerConfig>,
    code: u16,
    daemonset: Option<serde_json::Value>,
) -> Result<ApiRequest> {
    use std::io::{Read, Write};
    sock.set_nonblocking(false)?;
    sock.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    let conn = rustls::ServerConnection::new(config)?;
    let mut tls = rustls::StreamOwned::new(conn, sock);
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        ensure!(buf.len() < 1 << 20, "request headers over 1 MiB");
        let n = tls.read(&mut chunk)?;
        ensure!(n > 0, "connection closed inside the request headers");
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let line = lines.next().unwrap_or_default().to_string();
    let mut headers = BTreeMap::new();
    for l in lines {
        if let Some((k, v)) = l.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let len: usize = headers
        .get("content-length")
        .map(|v| v.parse())
        .transpose()?
        .unwrap_or(0);
    ensure!(len <= 1 << 20, "request body of {len} bytes");
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < len {
        let n = tls.read(&mut chunk)?;
        ensure!(n > 0, "connection closed inside the request body");
        body.extend_from_slice(&chunk[..n]);
    }
    let code = match (
        &daemonset,
        line.starts_with("GET /apis/apps/v1/namespaces/"),
    ) {
        (None, true) => 404,
        _ => code,
    };
    let (reason, answer) = match code {
        200 if line.starts_with("GET ") => ("OK", daemonset.unwrap_or_default()),
        404 => (
            "Not Found",
            serde_json::json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": "not found", "reason": "NotFound", "code": 404}),
        ),
        200 => (
            "OK",
            serde_json::json!({"kind": "Node", "apiVersion": "v1", "metadata": {"name": "node-a"}}),
        ),
        401 => (
            "Unauthorized",
            serde_json::json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": "Unauthorized", "reason": "Unauthorized", "code": 401}),
        ),
        c => (
            "Error",
            serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": c}),
        ),
    };
    let answer = answer.to_string();
    write!(
        tls,
        "HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{answer}",
        answer.len()
    )?;
    tls.conn.send_close_notify();
    tls.flush()?;
    Ok(ApiRequest {
        line,
        authorization: headers.get("authorization").cloned().unwrap_or_default(),
        content_type: headers.get("content-type").cloned().unwrap_or_default(),
        body: serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
    })
}

#[test]
fn uninstall_does_every_other_step_when_the_label_removal_is_refused() -> Result<()> {
    let stack = Stack::discover()?;
    let scratch = tempfile::tempdir()?;
    let inst = Installer::on_scratch(&stack, scratch.path())?;
    let root = inst.root.clone();
    let builder = Node::builder_on(&stack, "ni-unauthorized").without_gpu_ckpt_handler();
    let config = scratch_root(&builder, &root)?;
    let original = fs::read_to_string(&config)?;
    let baseline = listing(&root)?;
    let api = FakeApi::start(&scratch.path().join("api"))?;

    // Install, labelling node-a: the API server takes the patch.
    let mut install = inst.cmd("install");
    api.label_with(&mut install, "node-a");
    let out = run_ok(&mut install)?;
    let summary: serde_json::Value = serde_json::from_str(out.lines().last().unwrap_or_default())?;
    ensure!(summary["labelled"] == true, "install: {summary}");
    let bin_dir = root.join("usr/local/bin");
    let dropins = [
        root.join("etc/containerd/conf.d/gpu-ckpt.toml"),
        root.join("etc/containerd/conf.d/gpu-ckpt-restore.toml"),
    ];
    for p in &dropins {
        ensure!(p.is_file(), "{} was not installed", p.display());
    }
    ensure!(bin_dir.join(SHIM).is_file());

    // The ServiceAccount is gone (deleted before the DaemonSet's pod): every request is 401.
    api.set_status(401);
    let mut uninstall = inst.cmd("uninstall");
    api.label_with(&mut uninstall, "node-a");
    let out = uninstall.output()?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    println!("uninstall against a 401: {}\n{stderr}", out.status);
    // Every other step ran: the imports, the drop-ins, containerd's restart, the binaries and
    // CRIU.
    ensure!(
        fs::read_to_string(&config)? == original,
        "containerd's configuration still imports the drop-ins:\n{}",
        fs::read_to_string(&config)?
    );
    for p in &dropins {
        ensure!(!p.exists(), "the drop-in {} is still there", p.display());
    }
    for b in [SHIM, "gpu-ckpt", "gpu-ckpt-hook", "criu"] {
        ensure!(
            fs::symlink_metadata(bin_dir.join(b)).is_err(),
            "{b} is still in the node's /usr/local/bin"
        );
    }
    ensure!(
        !root.join("usr/local/lib/gpu-ckpt").exists(),
        "CRIU is still in /usr/local/lib/gpu-ckpt"
    );
    ensure!(inst.restarts() == 2, "restarts: {}", inst.restarts());
    // And the run failed, naming the step that did not: the labels of node-a, with the 401.
    ensure!(!out.status.success(), "the uninstall reported success");
    ensure!(
        stderr.contains("1 step(s) failed")
            && stderr.contains("remove the labels")
            && stderr.contains("of node node-a")
            && stderr.contains("401 Unauthorized"),
        "the failure does not name the label step and the API server's answer: {stderr}"
    );
    // What is left (the labels) stays in the record; the rest of the node is as it was.
    let record: serde_json::Value = serde_json::from_str(&fs::read_to_string(
        root.join("var/lib/gpu-ckpt/installed.json"),
    )?)?;
    ensure!(record["labels"]["node"] == "node-a", "record: {record}");
    ensure!(
        record["files"].as_array().is_some_and(|f| f.is_empty()) && record["config"].is_null(),
        "record: {record}"
    );

    // The API server takes the token again (a new ServiceAccount): the next uninstall removes
    // the labels and the record, and the node is as it was.
    api.set_status(200);
    let mut again = inst.cmd("uninstall");
    api.label_with(&mut again, "node-a");
    let out = run_ok(&mut again)?;
    let summary: serde_json::Value = serde_json::from_str(out.lines().last().unwrap_or_default())?;
    ensure!(
        summary["labelled"] == true && summary["restarted"] == false,
        "second uninstall: {summary}"
    );
    same_listing("after the second uninstall", &baseline, &listing(&root)?)?;

    // The requests: one label patch at install, the refused removal, the removal; each a merge
    // patch of node-a with the service account's token, on labels kubelets may not set.
    let reqs = api.requests();
    ensure!(reqs.len() == 3, "{reqs:#?}");
    for r in &reqs {
        ensure!(r.line == "PATCH /api/v1/nodes/node-a HTTP/1.1", "{r:?}");
        ensure!(r.authorization == format!("Bearer {}", api.token), "{r:?}");
        ensure!(r.content_type == "application/merge-patch+json", "{r:?}");
        let labels = r.body["metadata"]["labels"]
            .as_object()
            .with_context(|| format!("no labels in {r:?}"))?;
        ensure!(!labels.is_empty(), "{r:?}");
        for k in labels.keys() {
            ensure!(
                k.starts_with("node-restriction.kubernetes.io/gpu-ckpt-"),
                "label {k} is not under node-restriction.kubernetes.io/, so a kubelet can set it"
            );
        }
    }
    ensure!(
        reqs[0].body["metadata"]["labels"]["node-restriction.kubernetes.io/gpu-ckpt-runtime"]
            == "installed",
        "{:?}",
        reqs[0]
    );
    for r in &reqs[1..] {
        ensure!(
            r.body["metadata"]["labels"]
                .as_object()
                .is_some_and(|l| l.values().all(|v| v.is_null())),
            "the removal does not null the labels: {r:?}"
        );
    }
    Ok(())
}
