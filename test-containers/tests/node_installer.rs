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
//! Labelling needs an API server, which the test stack has none of: `--label-node` is not given
//! here; the patch body is unit-tested in the installer crate.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};
use common::*;
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
/// and the stack's CRIU with the shared libraries it needs (all but glibc's), found through
/// the RUNPATH `$ORIGIN/lib` that patchelf writes (DT_RPATH, so that the libraries' own
/// dependencies are found there too).
fn make_payload(stack: &Stack, dir: &Path) -> Result<()> {
    fs::create_dir_all(dir.join("criu/lib"))?;
    for b in [SHIM, "gpu-ckpt", "gpu-ckpt-hook"] {
        let from = stack.shim_dir().join(b);
        fs::copy(&from, dir.join(b)).with_context(|| {
            format!(
                "copy {} (build it: cargo build -p gpu-ckpt-shim -p gpu-ckpt-image-format -p gpu-ckpt-oci-hooks)",
                from.display()
            )
        })?;
    }
    let criu = dir.join("criu/criu");
    fs::copy(stack.criu_bin(), &criu)?;
    let ldd = run_ok(Command::new("ldd").arg(stack.criu_bin()))?;
    for line in ldd.lines() {
        // "libfoo.so.1 => /lib/x86_64-linux-gnu/libfoo.so.1 (0x...)"
        let Some((name, rest)) = line.trim().split_once(" => ") else {
            continue;
        };
        let Some(path) = rest.split_whitespace().next() else {
            continue;
        };
        let glibc = [
            "libc.so",
            "libm.so",
            "libdl.so",
            "libpthread.so",
            "librt.so",
            "ld-linux",
        ];
        if glibc.iter().any(|g| name.starts_with(g)) || !path.starts_with('/') {
            continue;
        }
        fs::copy(path, dir.join("criu/lib").join(name))
            .with_context(|| format!("copy CRIU's library {path}"))?;
    }
    run_ok(
        Command::new("patchelf")
            .args(["--force-rpath", "--set-rpath", "$ORIGIN/lib"])
            .arg(&criu),
    )?;
    // It runs from the payload with its own libraries.
    let v = run_ok(Command::new(&criu).arg("--version"))?;
    ensure!(v.contains("Version"), "criu --version: {v}");
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
fn scratch_root(builder: &NodeBuilder, root: &Path) -> Result<PathBuf> {
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

fn installer_bin(stack: &Stack) -> Result<PathBuf> {
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
