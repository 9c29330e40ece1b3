//! What the restore handler unpacks (docs/security.md, "What a restore unpacks"): only the
//! members the checkpoint's manifest lists, bounded by the sizes it lists, in a root-only
//! staging directory under the node's state (never the bundle, which lives in /run), removed
//! when the restore is done, restored or refused. A signed CRI checkpoint gets members nothing
//! signs (a large file beside `checkpoint/`, an unlisted file and a symlink in `checkpoint/`,
//! a listed file grown past its listed size); each restore either refuses, naming the member,
//! or restores, and in every case no file of that member is left anywhere on the node.

use std::{
    io::Read,
    path::{Path, PathBuf},
};

use crate::common::*;
use anyhow::{ensure, Context, Result};
use test_containers::{
    cri::Cri,
    stack::{Node, OptValue, RUN_BASE},
};

const NODE: &str = "unsigned-members";
/// The unsigned member beside `checkpoint/`: 64 MiB and an odd tail, a size no other file of
/// the node has.
const PAYLOAD: u64 = (64 << 20) + 4099;
/// The unlisted file in `checkpoint/`.
const SMALL_PAYLOAD: u64 = (1 << 20) + 4111;
/// What a listed file grows by.
const GROWTH: u64 = (1 << 20) + 4127;

fn key() -> PathBuf {
    Path::new(RUN_BASE)
        .join(format!("{NODE}-keys"))
        .join("node.key")
}

/// One node: its gpu-ckpt handler checkpoints and signs with the node key, its restore handler
/// restores with the same key.
fn start_node() -> Result<Node> {
    let _ = std::fs::remove_dir_all(key().parent().context("key dir")?);
    let key = key().display().to_string();
    let mut h = restore_handler(NODE, RESTORE_HANDLER)?;
    h.options
        .insert("SigningKey".to_string(), OptValue::from(key.clone()));
    node_with(
        Node::builder(NODE)?
            .runtime_option("SigningKey", key)
            .extra_runtime(h),
    )
}

/// What goes into the archive besides its own members.
enum Extra {
    File {
        name: &'static str,
        size: u64,
    },
    Symlink {
        name: &'static str,
        target: &'static str,
    },
}

/// Copies the archive `src` to `dst` with `extra` appended, every member of `src` as it was
/// (the signed manifest untouched).
fn with_extra(src: &Path, dst: &Path, extra: &[Extra]) -> Result<()> {
    let mut ar = tar::Archive::new(std::fs::File::open(src)?);
    let mut out = tar::Builder::new(std::fs::File::create(dst)?);
    for e in ar.entries()? {
        let mut e = e?;
        let mut header = e.header().clone();
        let path = e.path()?.into_owned();
        out.append_data(&mut header, &path, &mut e)?;
    }
    for x in extra {
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o600);
        match x {
            Extra::File { name, size } => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(*size);
                out.append_data(&mut h, name, std::io::repeat(0x5a).take(*size))?;
            }
            Extra::Symlink { name, target } => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_size(0);
                out.append_link(&mut h, name, target)?;
            }
        }
    }
    out.finish()?;
    Ok(())
}

/// Files below `roots` (no link followed, `skip` left out) named with `needle` or of `size`
/// bytes.
fn leftovers(roots: &[PathBuf], skip: &[PathBuf], needle: &str, size: u64) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack: Vec<PathBuf> = roots.to_vec();
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if skip.contains(&p) {
                continue;
            }
            let Ok(t) = e.file_type() else { continue };
            let len = e.metadata().map(|m| m.len()).unwrap_or(0);
            if e.file_name().to_string_lossy().contains(needle) || (t.is_file() && len == size) {
                found.push(format!("{} ({len} bytes)", p.display()));
            }
            if t.is_dir() {
                stack.push(p);
            }
        }
    }
    found
}

/// Every entry below the staging directory's namespace directories (`<dir>/<ns>/...`): what a
/// restore left there.
fn staged(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for ns in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if !ns.file_type().is_ok_and(|t| t.is_dir()) {
            out.push(ns.path().display().to_string());
            continue;
        }
        for e in std::fs::read_dir(ns.path()).into_iter().flatten().flatten() {
            out.push(e.path().display().to_string());
        }
    }
    out
}

/// What a restore left in the container's bundle (its rootfs aside): CRIU images, a manifest,
/// an unpacked or fetched checkpoint.
fn checkpoint_in_bundle(bundle: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![bundle.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if d == bundle && name == "rootfs" {
                continue;
            }
            let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
            if name.ends_with(".img")
                || name == "gpu-ckpt-manifest.json"
                || name == "checkpoint"
                || name.starts_with("gpu-ckpt-restore")
                    && !name.starts_with("gpu-ckpt-restore-gate")
                    && !name.starts_with("gpu-ckpt-restore-devices")
            {
                out.push(p.display().to_string());
            }
            if is_dir {
                stack.push(p);
            }
        }
    }
    out
}

struct Case {
    what: &'static str,
    source: PathBuf,
    /// A name part and a size that only the member's files have.
    needle: &'static str,
    size: u64,
    /// Must be refused (naming `needle`); else it may restore or be refused naming it.
    refused: bool,
}

/// Restores `case` on the restore handler, checking while the restored container runs that its
/// bundle holds no checkpoint and the staging directory is empty, and after the pod is gone that
/// no file of the member is anywhere on the node.
async fn check(cri: &Cri, node: &Node, staging: &Path, case: &Case) -> Result<Vec<String>> {
    let mut problems = Vec::new();
    let source = case.source.display().to_string();
    let pod = cri.run_pod(&restore_pod("worker", node, &source)).await?;
    let roots = vec![
        node.paths().dir.clone(),
        node.paths().run.clone(),
        PathBuf::from("/var/lib/gpu-ckpt/restore"),
    ];
    let sources = node.paths().dir.join("unsigned-sources");
    let skip = vec![sources];
    let outcome = match cri.create_container(&pod, &counter_spec()).await {
        Ok(id) => match cri.start_container(&id).await {
            Ok(()) => {
                let first = cri_counter(cri, &id, "/counter.txt").await?;
                cri_counter_above(cri, &id, "/counter.txt", first).await?;
                let bundle = node
                    .paths()
                    .state
                    .join("io.containerd.runtime.v2.task/k8s.io")
                    .join(&id);
                ensure!(bundle.is_dir(), "no bundle at {}", bundle.display());
                let copy = checkpoint_in_bundle(&bundle);
                if !copy.is_empty() {
                    problems.push(format!(
                        "{}: restored; the bundle (in /run) holds a checkpoint: {copy:?}",
                        case.what
                    ));
                }
                let left = staged(staging);
                if !left.is_empty() {
                    problems.push(format!(
                        "{}: restored; the staging directory still holds {left:?}",
                        case.what
                    ));
                }
                let running = leftovers(&roots, &skip, case.needle, case.size);
                if !running.is_empty() {
                    problems.push(format!(
                        "{}: restored; while the container runs the member's files are at {running:?}",
                        case.what
                    ));
                }
                Ok(first)
            }
            Err(e) => Err(format!("{e:#}")),
        },
        Err(e) => Err(format!("{e:#}")),
    };
    cri.remove_pod(&pod).await?;
    let outcome = outcome.map_err(|m| m.replace("\\\"", "\""));
    println!("{}: {outcome:?}", case.what);
    match &outcome {
        Err(msg) if !msg.contains(case.needle) => problems.push(format!(
            "{}: refused without naming {:?}: {msg}",
            case.what, case.needle
        )),
        Ok(_) if case.refused => problems.push(format!(
            "{}: restored, though nothing signs {:?}",
            case.what, case.needle
        )),
        _ => {}
    }
    let left = staged(staging);
    if !left.is_empty() {
        problems.push(format!(
            "{}: after the restore the staging directory still holds {left:?}",
            case.what
        ));
    }
    let after = leftovers(&roots, &skip, case.needle, case.size);
    if !after.is_empty() {
        problems.push(format!(
            "{}: after the restore the member's files are at {after:?}",
            case.what
        ));
    }
    Ok(problems)
}

#[test]
fn a_restore_unpacks_only_what_the_manifest_lists_outside_run_and_removes_it() -> Result<()> {
    let node = start_node()?;
    let staging = restore_staging_dir(NODE)?;
    let sources = node.paths().dir.join("unsigned-sources");
    let _ = std::fs::remove_dir_all(&sources);
    std::fs::create_dir_all(&sources)?;
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let (pod, id) = cri_counter_pod(&cri, &node, "worker").await?;
        cri_counter_above(&cri, &id, "/counter.txt", 5).await?;
        let archive = sources.join("signed.tar");
        cri.checkpoint_container(&id, &archive, 60).await?;
        cri.remove_pod(&pod).await?;

        let extra = |name: &str, extra: &[Extra]| -> Result<PathBuf> {
            let out = sources.join(name);
            with_extra(&archive, &out, extra)?;
            Ok(out)
        };
        let grown = sources.join("grown.tar");
        rewrite_archive(&archive, &grown, |n, mut d| {
            if n == "checkpoint/inventory.img" {
                d.resize(d.len() + GROWTH as usize, 0x5a);
            }
            Ok(Some(d))
        })?;
        let inventory = {
            let mut ar = tar::Archive::new(std::fs::File::open(&archive)?);
            let mut size = None;
            for e in ar.entries()? {
                let e = e?;
                if e.path()?.as_os_str() == "checkpoint/inventory.img" {
                    size = Some(e.size());
                }
            }
            size.context("the checkpoint has no inventory.img")?
        };
        let cases = [
            Case {
                what: "signed, as taken",
                source: archive.clone(),
                needle: "unsigned-payload",
                size: PAYLOAD,
                refused: false,
            },
            Case {
                what: "a 64 MiB member beside checkpoint/",
                source: extra(
                    "extra-member.tar",
                    &[Extra::File {
                        name: "unsigned-payload.bin",
                        size: PAYLOAD,
                    }],
                )?,
                needle: "unsigned-payload",
                size: PAYLOAD,
                refused: false,
            },
            Case {
                what: "an unlisted file in checkpoint/",
                source: extra(
                    "unlisted-file.tar",
                    &[Extra::File {
                        name: "checkpoint/unsigned-payload.img",
                        size: SMALL_PAYLOAD,
                    }],
                )?,
                needle: "unsigned-payload",
                size: SMALL_PAYLOAD,
                refused: true,
            },
            Case {
                what: "a symlink in checkpoint/",
                source: extra(
                    "symlink.tar",
                    &[Extra::Symlink {
                        name: "checkpoint/unsigned-payload-link",
                        target: "../spec.dump",
                    }],
                )?,
                needle: "unsigned-payload",
                size: u64::MAX,
                refused: true,
            },
            Case {
                what: "a listed file grown past its listed size",
                source: grown,
                needle: "inventory.img",
                size: inventory + GROWTH,
                refused: true,
            },
        ];
        let mut problems = Vec::new();
        for case in &cases {
            problems.extend(check(&cri, &node, &staging, case).await?);
        }
        // The restores ran through the staging directory under the node.
        if !node.log_contains(&staging.display().to_string()) {
            problems.push(format!(
                "the node's log never names the staging directory {}",
                staging.display()
            ));
        }
        // Root-only, and not in /run.
        ensure!(
            !staging.starts_with("/run"),
            "the staging directory {} is in /run",
            staging.display()
        );
        {
            use std::os::unix::fs::PermissionsExt;
            match std::fs::symlink_metadata(&staging) {
                Ok(meta) if meta.is_dir() && meta.permissions().mode() & 0o7777 == 0o700 => {}
                Ok(meta) => problems.push(format!(
                    "{} is not a directory of mode 0700 ({:o})",
                    staging.display(),
                    meta.permissions().mode() & 0o7777
                )),
                Err(e) => problems.push(format!("no staging directory {}: {e}", staging.display())),
            }
        }
        ensure!(problems.is_empty(), "{}", problems.join("\n"));
        Ok(())
    })
}
