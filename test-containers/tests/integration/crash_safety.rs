//! Crash-safe checkpoints (docs/architecture.md, "Crash safety"), as far as a test can go
//! without cutting the power: the order in which a real checkpoint's shim starts the writeback
//! of its page images, syncs its files and renames its manifest (seen by strace attached to
//! the shim), and a checkpoint whose page
//! image lost its tail after the manifest was written, refused at restore through the
//! containerd API (`CriuImagePath`) and through the restore handler.

use std::{
    collections::BTreeMap,
    io::Read,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use crate::common::*;
use anyhow::{bail, ensure, Context, Result};
use test_containers::{
    cri::{Cri, PodSpec},
    stack::GPU_CKPT_HANDLER,
};

const MANIFEST: &str = "gpu-ckpt-manifest.json";

/// One strace event on a path of interest, in the order strace saw the calls end (a sync) or
/// begin (a rename).
#[derive(Debug, Clone, PartialEq)]
enum Event {
    /// fsync or fdatasync of a file or directory, completed successfully.
    Sync(PathBuf),
    /// rename(at)(2) from, to.
    Rename(PathBuf, PathBuf),
    /// sync_file_range(2): the writeback of a range started (the page follower's, behind CRIU).
    Writeback(PathBuf),
}

/// strace attached to every thread of a process and the threads it starts, tracing the calls
/// crash safety orders, with file descriptors shown as paths (`-y`). A child it executes
/// (runc, and so CRIU, which must be able to ptrace itself) is let go at its execve (`-b`).
struct Trace {
    child: std::process::Child,
    out: PathBuf,
}

impl Trace {
    fn attach(pid: i32, out: &Path) -> Result<Trace> {
        let _ = std::fs::remove_file(out);
        let child = Command::new("strace")
            .args(["-f", "-b", "execve", "-qq", "-y", "-s", "4096", "-o"])
            .arg(out)
            .args([
                "-e",
                "trace=fsync,fdatasync,syncfs,rename,renameat,renameat2,sync_file_range",
                "-p",
                &pid.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting strace (the stack installs it: test-containers/stack/install.sh)")?;
        // Attached once the process's main thread shows a tracer.
        wait_until(
            Duration::from_secs(20),
            "strace to attach to the shim",
            || {
                let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
                status
                    .lines()
                    .find_map(|l| l.strip_prefix("TracerPid:"))
                    .map(str::trim)
                    .filter(|t| *t != "0")
                    .map(drop)
            },
        )?;
        Ok(Trace {
            child,
            out: out.to_path_buf(),
        })
    }

    /// Detaches (SIGINT) and returns the calls on paths below `dir`, in order.
    fn finish(mut self, dir: &Path) -> Result<Vec<Event>> {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGINT,
        )?;
        let status = self.child.wait()?;
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        let text = std::fs::read_to_string(&self.out)
            .with_context(|| format!("strace wrote no {} ({status}): {err}", self.out.display()))?;
        Ok(parse_strace(&text, dir))
    }
}

impl Drop for Trace {
    fn drop(&mut self) {
        // Still attached only when the test failed before finish: detach, never kill the shim.
        if let Ok(None) = self.child.try_wait() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.child.id() as i32),
                nix::sys::signal::Signal::SIGINT,
            );
            let _ = self.child.wait();
        }
    }
}

/// The quoted strings and `<path>` annotations of one strace call's arguments.
fn paths_in(args: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut rest = args;
    while let Some(i) = rest.find(['"', '<']) {
        let close = if rest.as_bytes()[i] == b'"' { '"' } else { '>' };
        let Some(len) = rest[i + 1..].find(close) else {
            break;
        };
        out.push(PathBuf::from(&rest[i + 1..i + 1 + len]));
        rest = &rest[i + 1 + len + 1..];
    }
    out
}

/// Events on paths below `dir` (or `dir` itself) from `strace -f -y` output. A call split by
/// another thread's (`<unfinished ...>`, then `<... fsync resumed>`) counts where it ends, so a
/// sync is placed at its completion; failed calls (`= -1`) are left out.
fn parse_strace(text: &str, dir: &Path) -> Vec<Event> {
    let mut pending: BTreeMap<String, String> = BTreeMap::new();
    let mut events = Vec::new();
    for line in text.lines() {
        let (pid, call) = line.split_once(' ').unwrap_or(("", line));
        let call = call.trim_start();
        let full = if let Some(head) = call.strip_suffix("<unfinished ...>") {
            pending.insert(pid.to_string(), head.to_string());
            continue;
        } else if let Some(rest) = call.strip_prefix("<... ") {
            let Some((_, tail)) = rest.split_once(" resumed>") else {
                continue;
            };
            match pending.remove(pid) {
                Some(head) => format!("{head}{tail}"),
                None => continue,
            }
        } else {
            call.to_string()
        };
        let Some((name, args)) = full.split_once('(') else {
            continue;
        };
        let Some((args, result)) = args.rsplit_once(") = ") else {
            continue;
        };
        if result.trim_start().starts_with('-') {
            continue;
        }
        let paths: Vec<PathBuf> = paths_in(args)
            .into_iter()
            .filter(|p| p.starts_with(dir))
            .collect();
        match name {
            "fsync" | "fdatasync" => {
                if let Some(p) = paths.into_iter().next() {
                    events.push(Event::Sync(p));
                }
            }
            "sync_file_range" => {
                if let Some(p) = paths.into_iter().next() {
                    events.push(Event::Writeback(p));
                }
            }
            "rename" | "renameat" | "renameat2" if paths.len() == 2 => {
                events.push(Event::Rename(paths[0].clone(), paths[1].clone()));
            }
            _ => {}
        }
    }
    events
}

/// The files the manifest in `dir` lists.
fn listed_files(dir: &Path) -> Result<Vec<String>> {
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join(MANIFEST))?)?;
    let files = m["files"]
        .as_object()
        .context("the manifest has no files")?;
    Ok(files.keys().cloned().collect())
}

#[test]
fn every_listed_file_is_synced_before_the_manifest_is_renamed_and_the_directory_after() -> Result<()>
{
    let node = node("crash-order")?;
    let pid = start_counter(&node, "o1", "100")?;
    let shim = *shims_of(&node).first().context("no shim")?;
    let dir = node.paths().dir.join("o1-image");
    let _ = std::fs::remove_dir_all(&dir);
    // strace records the real paths (a symlinked node directory would hide them).
    let dir = {
        std::fs::create_dir_all(&dir)?;
        let d = dir.canonicalize()?;
        std::fs::remove_dir(&d)?;
        d
    };
    let trace = Trace::attach(shim, &node.paths().dir.join("o1-strace.txt"))?;
    let dir_arg = dir.display().to_string();
    let checkpointed = node.ctr_ok(&["task", "checkpoint", "--image-path", &dir_arg, "o1"]);
    let events = trace.finish(&dir)?;
    checkpointed?;
    counter_goes_on(pid, counter_value(pid).context("counter")?)?;

    let manifest = dir.join(MANIFEST);
    let renames: Vec<(usize, &PathBuf)> = events
        .iter()
        .enumerate()
        .filter_map(|(i, e)| match e {
            Event::Rename(from, to) if to == &manifest => Some((i, from)),
            _ => None,
        })
        .collect();
    let [(rename, tmp)] = renames[..] else {
        bail!(
            "expected one rename onto {}: {events:#?}",
            manifest.display()
        );
    };
    let synced_at = |p: &Path| {
        events
            .iter()
            .position(|e| e == &Event::Sync(p.to_path_buf()))
    };
    let listed = listed_files(&dir)?;
    ensure!(
        listed.iter().any(|n| n.starts_with("pages-")),
        "the manifest lists no page image: {listed:?}"
    );
    for name in &listed {
        let at = synced_at(&dir.join(name))
            .with_context(|| format!("{name} was never synced: {events:#?}"))?;
        ensure!(
            at < rename,
            "{name} was synced after the manifest's rename: {events:#?}"
        );
        // A page image's writeback started behind CRIU, and its sync still came after.
        if name.starts_with("pages-") {
            let started = events
                .iter()
                .position(|e| e == &Event::Writeback(dir.join(name)))
                .with_context(|| format!("{name}: no writeback started: {events:#?}"))?;
            ensure!(
                started < at,
                "{name}: writeback started after its sync: {events:#?}"
            );
        }
    }
    let tmp_sync = synced_at(tmp).context("the manifest's temp file was never synced")?;
    ensure!(tmp_sync < rename, "temp manifest synced after its rename");
    let dir_sync = events
        .iter()
        .rposition(|e| e == &Event::Sync(dir.clone()))
        .with_context(|| format!("the directory was never synced: {events:#?}"))?;
    ensure!(
        dir_sync > rename,
        "the directory was not synced after the manifest's rename: {events:#?}"
    );
    println!(
        "{} files synced, then rename at event {rename}, directory sync at {dir_sync}",
        listed.len()
    );

    // containerd's own temporary directory (no --image-path): containerd copies it into its
    // content store and removes it, so the shim syncs nothing there.
    let trace = Trace::attach(shim, &node.paths().dir.join("o1-strace-store.txt"))?;
    let stored = node.ctr_ok(&[
        "container",
        "checkpoint",
        "--task",
        "o1",
        "localhost/ckpt/o1:1",
    ]);
    let events = trace.finish(Path::new("/"))?;
    stored?;
    let renamed: Vec<&PathBuf> = events
        .iter()
        .filter_map(|e| match e {
            Event::Rename(_, to) if to.file_name().is_some_and(|n| n == MANIFEST) => Some(to),
            _ => None,
        })
        .collect();
    let [to] = renamed[..] else {
        bail!("expected one manifest rename: {events:#?}");
    };
    let tmpdir = to.parent().context("manifest without a directory")?;
    let syncs: Vec<&Event> = events
        .iter()
        .filter(|e| matches!(e, Event::Sync(p) | Event::Writeback(p) if p.starts_with(tmpdir)))
        .collect();
    ensure!(
        syncs.is_empty(),
        "the shim synced containerd's temporary directory {}: {syncs:?}",
        tmpdir.display()
    );
    node.ctr_ok(&["task", "kill", "-s", "SIGKILL", "o1"])?;
    Ok(())
}

/// Cuts `path` to half its length, as a power cut that lost the tail of its data would.
fn cut_short(path: &Path) -> Result<(u64, u64)> {
    let f = std::fs::OpenOptions::new().write(true).open(path)?;
    let len = f.metadata()?.len();
    ensure!(len > 4096, "{} is only {len} bytes", path.display());
    f.set_len(len / 2)?;
    Ok((len, len / 2))
}

/// The first page image in `dir`.
fn page_image(dir: &Path) -> Result<PathBuf> {
    std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("pages-"))
        })
        .with_context(|| format!("no page image in {}", dir.display()))
}

#[test]
fn a_page_image_cut_short_after_the_manifest_is_refused_naming_it() -> Result<()> {
    let node = restore_node("crash-cut")?;

    // containerd's API with CriuImagePath, from `ctr task checkpoint --image-path`.
    start_counter(&node, "t1", "100")?;
    let dir = node.paths().dir.join("t1-image");
    node.checkpoint_task_exit("t1", &dir)?;
    node.ctr_ok(&["task", "rm", "t1"])?;
    ensure!(dir.join(MANIFEST).is_file(), "no manifest");
    let pages = page_image(&dir)?;
    let name = pages
        .file_name()
        .context("page image without a name")?
        .to_string_lossy()
        .into_owned();
    let (was, now) = cut_short(&pages)?;
    let err = restore_from_dir(&node, "t1", &dir)
        .err()
        .context("a checkpoint with a page image cut short was restored")?;
    let msg = format!("{err:#}");
    println!("API restore: {msg}");
    ensure!(
        msg.contains(&name) && msg.contains(&was.to_string()) && msg.contains(&now.to_string()),
        "the refusal does not name {name} and its sizes ({was} recorded, {now} found): {msg}"
    );
    ensure!(
        processes_of_image(&dir).is_empty(),
        "something of the refused restore still runs"
    );

    // The restore handler (`gpu-ckpt.io/restore-from`), from a CRI checkpoint archive whose
    // page image lost its tail.
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        cri.pull_image(workloads()).await?;
        let spec = counter_spec();
        let pod = cri
            .run_pod(&PodSpec::new("worker", node.pod_log_root()).handler(GPU_CKPT_HANDLER))
            .await?;
        let id = cri.run_container(&pod, &spec).await?;
        cri_counter_above(&cri, &id, "/counter.txt", 5).await?;
        let archive = node.paths().dir.join("cut-worker.tar");
        let _ = std::fs::remove_file(&archive);
        cri.checkpoint_container(&id, &archive, 120).await?;
        cri.remove_pod(&pod).await?;

        let cut = node.paths().dir.join("cut-worker-short.tar");
        let mut cut_member = None;
        rewrite_archive(&archive, &cut, |path, data| {
            let short = path
                .strip_prefix("checkpoint/")
                .is_some_and(|n| n.starts_with("pages-"))
                && cut_member.is_none();
            if short {
                cut_member = Some((path.to_string(), data.len(), data.len() / 2));
                return Ok(Some(data[..data.len() / 2].to_vec()));
            }
            Ok(Some(data))
        })?;
        let (member, was, now) = cut_member.context("the archive holds no page image")?;
        let member = member.trim_start_matches("checkpoint/").to_string();
        let pod = cri
            .run_pod(&restore_pod("restored", &node, &cut.display().to_string()))
            .await?;
        let res = cri.run_container(&pod, &spec).await;
        cri.remove_pod(&pod).await?;
        let msg = match res {
            Ok(_) => bail!("the restore handler restored a page image cut short"),
            Err(e) => format!("{e:#}").replace("\\\"", "\""),
        };
        println!("restore handler: {msg}");
        ensure!(
            msg.contains(&member)
                && msg.contains(&was.to_string())
                && msg.contains(&now.to_string()),
            "the refusal does not name {member} and its sizes ({was} recorded, {now} found): {msg}"
        );
        Ok(())
    })
}

/// Processes whose command line mentions `dir` (a restore that went on would show CRIU there).
fn processes_of_image(dir: &Path) -> Vec<i32> {
    test_containers::stack::processes_matching(&[&dir.display().to_string()])
}
