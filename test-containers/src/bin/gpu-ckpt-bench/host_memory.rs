//! `host-memory`: the host-memory checkpoint and restore of a memhog through gpu-ckpt against
//! upstream runc and CRIU through containerd-shim-runc-v2, in one run.
//!
//! - Checkpoint: `ctr task checkpoint --exit --image-path` through gpu-ckpt (synced: every file
//!   written back and `fsync`ed before the manifest, its default for `--image-path`) and through
//!   runc-v2 (no sync), and runc-v2 once more under other names: the control pair.
//! - Restore of the same images: gpu-ckpt's checkpoint of the round restored (containerd API,
//!   `CriuImagePath`) through gpu-ckpt (signature, digests, page images hashed while CRIU
//!   reads them) and through runc-v2 (CRIU alone), and through runc-v2 again (the control).
//!   Before each restore the images are written back and dropped from the page cache, so that
//!   every path reads them from the disk: the case where a second read of the pages would cost
//!   a second trip to the disk.
//!
//! The paths run in a Williams order within each round ([`super::round_order`]), round 0 is a
//! warm-up, and every timed step starts from [`super::settle`].

use std::{
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use test_containers::{containerd::Containerd, stack::Node};

use super::{
    dirty_bytes, fastest, median_f64, ratio_cell, round_order, runtime_flags, secs, settle, CtrApp,
};

/// The three paths of each step.
const PATHS: [&str; 3] = ["gpu-ckpt", "runc-v2", "runc-v2 again (control)"];

/// The container names of path `p` in round `i`.
fn name(p: usize, i: usize) -> String {
    format!("hm{}-{i}", ["g", "r", "c"][p])
}

pub async fn bench(node: &Node, mib: u64, runs: usize) -> Result<()> {
    let api = Containerd::connect(node.socket(), "default").await?;
    let (runc_flags, ours) = runtime_flags(node);
    let flags = [&ours, &runc_flags, &runc_flags];
    let app = CtrApp::memhog(mib);
    let mut ckpt: [Vec<f64>; 3] = Default::default();
    let mut restore: [Vec<f64>; 3] = Default::default();
    for i in 0..=runs {
        let order = round_order(i.saturating_sub(1), PATHS.len());
        let mut dirs: Vec<PathBuf> = Vec::new();
        for &p in &order {
            let (dir, took) = checkpoint(node, flags[p], &name(p, i), &app)?;
            if i > 0 {
                ckpt[p].push(secs(took));
            }
            dirs.push(dir);
        }
        // gpu-ckpt's images, restored by each path in turn.
        let images = node.paths().dir.join(format!("bench-{}", name(0, i)));
        for &p in &order {
            let took = restore_same(node, &api, &name(p, i), &images, &app).await?;
            eprintln!(
                "round {i}{}: {} restore of gpu-ckpt's images (cold) {:.2} s",
                if i == 0 { " (warm-up)" } else { "" },
                PATHS[p],
                secs(took)
            );
            if i > 0 {
                restore[p].push(secs(took));
            }
        }
        for p in 0..PATHS.len() {
            node.ctr(&["container", "rm", &name(p, i)])?;
        }
        for dir in dirs {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
    report(mib, runs, &ckpt, &restore);
    Ok(())
}

/// Runs the memhog as `id` through the shim `flags` name and times its checkpoint (`ctr task
/// checkpoint --exit --image-path`); leaves the container record, its task removed.
fn checkpoint(
    node: &Node,
    flags: &[String],
    id: &str,
    app: &CtrApp,
) -> Result<(PathBuf, Duration)> {
    let mut args: Vec<&str> = vec!["run", "-d"];
    args.extend(flags.iter().map(String::as_str));
    args.extend([app.image, id]);
    args.extend(app.args.iter().map(String::as_str));
    node.ctr_ok(&args)?;
    app.ready(node.task_pid(id)?)?;
    let dir = node.paths().dir.join(format!("bench-{id}"));
    let _ = std::fs::remove_dir_all(&dir);
    settle(node.paths().dir.as_path(), app.warm_mib)?;
    let t = Instant::now();
    node.checkpoint_task_exit(id, &dir)?;
    let took = t.elapsed();
    let dirty = dirty_bytes()? >> 20;
    // gpu-ckpt's manifest records its steps; what is left of the time is the syncs and the
    // client's round trips.
    let steps = image_format::manifest::Manifest::read_from(&dir)
        .map(|m| {
            m.timings
                .iter()
                .map(|t| format!("{} {:.0} ms", t.step, t.millis))
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default();
    eprintln!(
        "{id}: checkpoint {:.2} s, {dirty} MiB dirty after it ({steps})",
        secs(took)
    );
    node.ctr_ok(&["task", "rm", id])?;
    Ok((dir, took))
}

/// Restores `images` as the task of container `id` (containerd API, `CriuImagePath`) with the
/// images read from the disk, times it, and removes the task again.
async fn restore_same(
    node: &Node,
    api: &Containerd,
    id: &str,
    images: &Path,
    app: &CtrApp,
) -> Result<Duration> {
    settle(node.paths().dir.as_path(), app.warm_mib)?;
    drop_cached(images)?;
    let t = Instant::now();
    api.restore_from_image_path(id, images)
        .await
        .with_context(|| format!("{id}: restore of {}", images.display()))?;
    let took = t.elapsed();
    node.ctr(&["task", "kill", "-s", "SIGKILL", id])?;
    std::thread::sleep(Duration::from_millis(300));
    node.ctr(&["task", "rm", id])?;
    // runc writes its restore log into the image directory (runc-v2 names no work path): not
    // part of the checkpoint, whose verify would find it unlisted.
    let _ = std::fs::remove_file(images.join("restore.log"));
    Ok(took)
}

/// Drops the (written back) pages of every file of `dir` from the page cache.
fn drop_cached(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("list {}", dir.display()))? {
        let path = entry?.path();
        if !path.is_file() {
            continue;
        }
        let f = std::fs::File::open(&path).with_context(|| format!("open {}", path.display()))?;
        f.sync_all()?;
        // SAFETY: a valid descriptor; advice only.
        let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        anyhow::ensure!(rc == 0, "posix_fadvise {}: error {rc}", path.display());
    }
    Ok(())
}

fn report(mib: u64, runs: usize, ckpt: &[Vec<f64>; 3], restore: &[Vec<f64>; 3]) {
    println!(
        "| path ({mib} MiB memhog, {runs} rounds) | checkpoint median | checkpoint fastest | restore of gpu-ckpt's images median | restore fastest |"
    );
    println!("| --- | --- | --- | --- | --- |");
    let labels = [
        "containerd-shim-gpu-ckpt-v1 (synced, verified)",
        "containerd-shim-runc-v2",
        "containerd-shim-runc-v2 again (control)",
    ];
    for (p, label) in labels.iter().enumerate() {
        println!(
            "| {label} | {:.2} s | {:.2} s | {:.2} s | {:.2} s |",
            median_f64(ckpt[p].clone()),
            fastest(&ckpt[p]),
            median_f64(restore[p].clone()),
            fastest(&restore[p])
        );
    }
    println!("\n| ratio | checkpoint: medians, per round [95% interval], fastest | restore: medians, per round [95% interval], fastest |");
    println!("| --- | --- | --- |");
    println!(
        "| gpu-ckpt / runc-v2 | {} | {} |",
        ratio_cell(&ckpt[0], &ckpt[1]),
        ratio_cell(&restore[0], &restore[1])
    );
    println!(
        "| control: runc-v2 again / runc-v2 | {} | {} |",
        ratio_cell(&ckpt[2], &ckpt[1]),
        ratio_cell(&restore[2], &restore[1])
    );
}
