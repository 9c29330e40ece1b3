//! A checkpoint's copy of the container's rootfs changes (`gpu-ckpt-rootfs-changes.tar`) on
//! the real stack (docs/security.md, "Rootfs changes"):
//!
//! - no host file gets into it when another container of the pod (not frozen, reaching the
//!   rootfs through `/proc/PID/root`) swaps a directory for a symlink to a host directory
//!   while the shim copies: the test plays that sidecar, as root on the host, and swaps at the
//!   moment the shim opens the large file it copies first;
//! - a restore brings the files back with their owners and modes (setuid included), and a
//!   regular file named like an OCI whiteout (`.wh.notes`) stays a file.

use std::{
    io::Read,
    os::unix::fs::{MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use crate::common;
use crate::common::*;
use anyhow::{ensure, Context, Result};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use test_containers::{
    cri::{Cri, PodSpec},
    stack::GPU_CKPT_HANDLER,
};

/// Attempts of the race: on the code before the fix, every one of them put the host file
/// into the checkpoint.
const ATTEMPTS: usize = 3;

/// The large file the container writes, copied before `x/keys` (names are copied in order).
const BIG_MIB: u32 = 128;

/// The overlay upper directory of the rootfs of process `pid` (its `/` in its mountinfo).
fn upperdir(pid: i32) -> Result<PathBuf> {
    let path = format!("/proc/{pid}/mountinfo");
    let info = std::fs::read_to_string(&path)?;
    image_format::mountinfo::parse(&info, &path)?
        .iter()
        .filter(|m| m.mountpoint == "/" && m.fstype == "overlay")
        .find_map(|m| {
            m.super_options
                .iter()
                .find_map(|o| o.strip_prefix("upperdir="))
        })
        .map(PathBuf::from)
        .with_context(|| format!("no overlay root with an upperdir in {path}:\n{info}"))
}

/// Whether `needle` is anywhere in the CRI archive `archive`: in any member, and in the
/// members that are archives themselves (the rootfs diffs, gzip or plain). Returns the members
/// it is in, and the names of the shim's copy's entries below `x/`.
fn find_in_archive(archive: &Path, needle: &[u8]) -> Result<(Vec<String>, Vec<String>)> {
    let has = |data: &[u8]| data.windows(needle.len()).any(|w| w == needle);
    let mut found = Vec::new();
    let mut copy_names = Vec::new();
    let mut ar = tar::Archive::new(std::fs::File::open(archive)?);
    for e in ar.entries()? {
        let mut e = e?;
        let name = e.path()?.display().to_string();
        let mut data = Vec::new();
        e.read_to_end(&mut data)?;
        if has(&data) || has(name.as_bytes()) {
            found.push(name.clone());
        }
        if data.starts_with(&[0x1f, 0x8b]) {
            let mut plain = Vec::new();
            flate2::read::GzDecoder::new(&data[..]).read_to_end(&mut plain)?;
            if has(&plain) {
                found.push(format!("{name} (uncompressed)"));
            }
        }
        if name.ends_with("gpu-ckpt-rootfs-changes.tar") {
            let mut inner = tar::Archive::new(&data[..]);
            for ie in inner.entries()? {
                let ie = ie?;
                let n = ie.path()?.display().to_string();
                if n.starts_with("x") {
                    copy_names.push(format!("{n} ({:?})", ie.header().entry_type()));
                }
            }
        }
    }
    Ok((found, copy_names))
}

/// The sidecar: waits (up to `timeout`) for the shim to open or read `watched`, then swaps
/// `dir` for a symlink to `host` through `root` (the container's `/proc/PID/root`). Returns
/// when it swapped, or `None` when nothing opened the file before `stop` or the timeout.
fn swap_when_opened(
    watched: PathBuf,
    root: PathBuf,
    host: PathBuf,
    stop: Arc<AtomicBool>,
    timeout: Duration,
) -> Result<std::thread::JoinHandle<Result<Option<Instant>>>> {
    let inotify = Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK)?;
    inotify
        .add_watch(&watched, AddWatchFlags::IN_OPEN | AddWatchFlags::IN_ACCESS)
        .with_context(|| format!("watch {}", watched.display()))?;
    Ok(std::thread::spawn(move || {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline && !stop.load(Ordering::SeqCst) {
            match inotify.read_events() {
                Ok(events) if !events.is_empty() => {
                    std::fs::rename(root.join("x"), root.join("x.moved")).context("move x away")?;
                    std::os::unix::fs::symlink(&host, root.join("x"))
                        .context("put the link in x's place")?;
                    return Ok(Some(Instant::now()));
                }
                Ok(_) | Err(nix::errno::Errno::EAGAIN) => {}
                Err(e) => return Err(e.into()),
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(None)
    }))
}

#[test]
fn a_directory_swapped_for_a_host_link_during_the_copy_brings_no_host_file() -> Result<()> {
    let node = node("rootfs-race")?;
    // The host directory the sidecar links to: root-only, with `keys/` like the node's key
    // directory, and a secret no checkpoint may hold.
    let marker = format!(
        "host-secret-{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos()
    );
    let host = tempfile::Builder::new()
        .prefix("rootfs-race-host-")
        .tempdir()?;
    std::fs::set_permissions(host.path(), std::fs::Permissions::from_mode(0o700))?;
    std::fs::create_dir(host.path().join("keys"))?;
    let secret = host.path().join(format!("keys/{marker}.key"));
    std::fs::write(&secret, format!("{marker}\n"))?;
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600))?;
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        cri.pull_image(workloads()).await?;
        let mut leaked = Vec::new();
        for attempt in 1..=ATTEMPTS {
            let pod = cri
                .run_pod(
                    &PodSpec::new(&format!("race-{attempt}"), node.pod_log_root())
                        .handler(GPU_CKPT_HANDLER),
                )
                .await?;
            let id = cri.run_container(&pod, &counter_spec()).await?;
            let r = cri
                .exec_sync(
                    &id,
                    &[
                        "sh",
                        "-c",
                        &format!(
                            "mkdir -p /x/keys && echo container-key > /x/keys/node.key && \
                             dd if=/dev/zero of=/x/big bs=1M count={BIG_MIB} 2>/dev/null"
                        ),
                    ],
                    120,
                )
                .await?;
            ensure!(r.exit_code == 0, "writing the files: {}", r.stderr_str());
            let pid = common::gpu::cri_pid(&cri, &id).await?;
            let upper = upperdir(pid)?;
            ensure!(
                upper.join("x/big").metadata()?.len() == u64::from(BIG_MIB) << 20,
                "x/big is not in the upper directory {}",
                upper.display()
            );
            let before = common::cri_counter(&cri, &id, "/counter.txt").await?;
            let stop = Arc::new(AtomicBool::new(false));
            let sidecar = swap_when_opened(
                upper.join("x/big"),
                PathBuf::from(format!("/proc/{pid}/root")),
                host.path().to_path_buf(),
                stop.clone(),
                Duration::from_secs(120),
            )?;
            let archive = node.paths().dir.join(format!("race-{attempt}.tar"));
            let _ = std::fs::remove_file(&archive);
            let started = Instant::now();
            let result = cri.checkpoint_container(&id, &archive, 120).await;
            let took = started.elapsed();
            stop.store(true, Ordering::SeqCst);
            let swapped = sidecar
                .join()
                .map_err(|_| anyhow::anyhow!("the sidecar thread panicked"))??
                .context("nothing opened x/big during the checkpoint: the race was not run")?;
            ensure!(
                swapped <= started + took,
                "the swap came after the checkpoint returned"
            );
            // What the product does: the checkpoint succeeds, with the container's own
            // `x` (opened before the swap) and no host file; the container runs on.
            result.with_context(|| format!("attempt {attempt}: the checkpoint"))?;
            let (found, copy_names) = find_in_archive(&archive, marker.as_bytes())?;
            println!(
                "attempt {attempt}: checkpoint in {took:?}, swap {:?} after it started; the copy's x: {copy_names:?}; host secret in: {found:?}",
                swapped.duration_since(started)
            );
            if !found.is_empty() {
                leaked.push((attempt, found));
            }
            // The copy holds the container's own `x`, whose handle it had opened.
            ensure!(
                copy_names.iter().any(|n| n.starts_with("x/keys/node.key ")),
                "attempt {attempt}: the copy lacks the container's x/keys/node.key: {copy_names:?}"
            );
            ensure!(
                cri.container_state(&id).await?
                    == test_containers::cri::v1::ContainerState::ContainerRunning,
                "attempt {attempt}: the container does not run after the checkpoint"
            );
            common::cri_counter_above(&cri, &id, "/counter.txt", before).await?;
            cri.remove_pod(&pod).await?;
            let _ = std::fs::remove_file(&archive);
        }
        ensure!(
            leaked.is_empty(),
            "the host secret {} got into the checkpoint in {} of {ATTEMPTS} attempts: {leaked:?}",
            secret.display(),
            leaked.len()
        );
        Ok(())
    })
}

/// Owner, group, mode (with setuid/setgid, in octal) and file type of `path`, not following
/// a link.
fn stat(path: &Path) -> Result<(u32, u32, String, bool)> {
    let m = std::fs::symlink_metadata(path).with_context(|| format!("stat {}", path.display()))?;
    Ok((
        m.uid(),
        m.gid(),
        format!("{:o}", m.mode() & 0o7777),
        m.is_file(),
    ))
}

#[test]
fn owners_modes_and_files_named_like_whiteouts_come_back_on_restore() -> Result<()> {
    let node = restore_node("rootfs-owners")?;
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let (pod, id) = cri_counter_pod(&cri, &node, "owners").await?;
        // As root in the container: a setuid file of uid 1000, a directory of 1000:1000, and
        // regular files named like OCI whiteouts.
        let r = cri
            .exec_sync(
                &id,
                &[
                    "sh",
                    "-c",
                    "cp /bin/sh /suid-tool && chown 1000:1000 /suid-tool && chmod 4755 /suid-tool \
                     && mkdir /owned && chown 1000:1000 /owned && chmod 750 /owned \
                     && echo mine > /owned/file && chown 1000:2000 /owned/file && chmod 2640 /owned/file \
                     && echo notes > /.wh.notes && echo opq > /owned/.wh..wh..opq",
                ],
                30,
            )
            .await?;
        ensure!(r.exit_code == 0, "writing the files: {}", r.stderr_str());
        let files = [
            "suid-tool",
            "owned",
            "owned/file",
            ".wh.notes",
            "owned/.wh..wh..opq",
        ];
        let pid = common::gpu::cri_pid(&cri, &id).await?;
        let root = PathBuf::from(format!("/proc/{pid}/root"));
        let source: Vec<_> = files
            .iter()
            .map(|f| stat(&root.join(f)))
            .collect::<Result<_>>()?;
        ensure!(
            source[0] == (1000, 1000, "4755".into(), true)
                && source[1] == (1000, 1000, "750".into(), false),
            "the source's files: {source:?}"
        );
        let archive = node.paths().dir.join("owners.tar");
        let _ = std::fs::remove_file(&archive);
        cri.checkpoint_container(&id, &archive, 60).await?;
        cri.remove_pod(&pod).await?;

        let pod = cri
            .run_pod(&restore_pod(
                "owners-restored",
                &node,
                &archive.display().to_string(),
            ))
            .await?;
        let id = cri.run_container(&pod, &counter_spec()).await?;
        let pid = common::gpu::cri_pid(&cri, &id).await?;
        ensure!(pid > 0, "CRI reports pid {pid} for the restored container");
        let root = PathBuf::from(format!("/proc/{pid}/root"));
        let mut wrong = Vec::new();
        for (f, want) in files.iter().zip(&source) {
            let got = stat(&root.join(f)).map_err(|e| format!("{e:#}"));
            println!("/{f}: source {want:?}, restored {got:?} (uid, gid, mode, file)");
            if got.as_ref() != Ok(want) {
                wrong.push(format!("/{f}: {got:?}, the source had {want:?}"));
            }
        }
        for (f, want) in [
            (".wh.notes", "notes\n"),
            ("owned/.wh..wh..opq", "opq\n"),
            ("owned/file", "mine\n"),
        ] {
            let got = std::fs::read_to_string(root.join(f)).map_err(|e| e.to_string());
            if got.as_deref() != Ok(want) {
                wrong.push(format!("/{f} holds {got:?}, not {want:?}"));
            }
        }
        ensure!(
            wrong.is_empty(),
            "restored files differ from the source's (uid, gid, mode, file):\n{}",
            wrong.join("\n")
        );
        common::cri_counter_above(&cri, &id, "/counter.txt", 0).await?;
        cri.remove_pod(&pod).await?;
        Ok(())
    })
}
