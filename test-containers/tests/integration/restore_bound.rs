//! Nothing in a restore waits forever: with the handler's `RestoreTimeout` far below what a
//! restore of 512 MiB takes, the restore fails within the bound (plus the watchdog's grace),
//! naming the step and the bound, and no runc, CRIU, action script or restored process is left.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::common::*;
use anyhow::{ensure, Context, Result};
use test_containers::stack::{processes_matching, Node, Stack};

/// A restore of `id` from `image` that must fail: its error, and how long it took to fail;
/// `started` says what it means when it does not.
fn refused_after(node: &Node, id: &str, image: &Path, started: &str) -> Result<(String, Duration)> {
    let t = Instant::now();
    let err = match restore_from_dir(node, id, image) {
        Ok(pid) => anyhow::bail!("{started} (pid {pid})"),
        Err(e) => format!("{e:#}"),
    };
    let took = t.elapsed();
    println!("after {took:?}: {err}");
    Ok((err, took))
}

#[test]
fn a_restore_past_its_bound_fails_and_leaves_nothing_running() -> Result<()> {
    let dir = Stack::discover()?.node_dir("restore-bound");
    std::fs::create_dir_all(&dir)?;
    let options = dir.join("gpu-ckpt-handler.toml");
    std::fs::write(&options, "RestoreTimeout = \"200ms\"\n")?;
    let node = node_with(
        Node::builder("restore-bound")?
            .env("GPU_CKPT_HANDLER_CONFIG", &options.display().to_string()),
    )?;
    let pid = run_memhog(&node, "b1", &["--mib", "512", "--interval-ms", "200"])?;
    memhog_verified(pid, Duration::from_secs(60), "memhog to fill 512 MiB")?;
    let image = node.paths().dir.join("b1-image");
    node.checkpoint_task_exit("b1", &image)?;
    node.ctr_ok(&["task", "rm", "b1"])?;

    let (err, took) = refused_after(
        &node,
        "b1",
        &image,
        "a 512 MiB restore finished within 200 ms",
    )?;
    ensure!(
        err.contains("step criu-restore") && err.contains("not done within 200ms"),
        "the error does not name the step and the bound: {err}"
    );
    ensure!(
        took < Duration::from_secs(15),
        "the restore failed only after {took:?}"
    );
    nothing_left(&node, "b1", &image, "/bin/memhog")
}

/// After a restore past its bound: no runc, CRIU or action script of container `id`'s bundle
/// and image, no `program` in its cgroup, and no running task.
fn nothing_left(node: &Node, id: &str, image: &Path, program: &str) -> Result<()> {
    let bundle = format!("io.containerd.runtime.v2.task/default/{id}");
    let cgroup = format!("/default/{id}");
    let left: Vec<i32> = processes_matching(&[&bundle])
        .into_iter()
        .chain(processes_matching(&[
            "criu",
            "restore",
            image.to_str().unwrap_or("?"),
        ]))
        .chain(processes_matching(&[program]).into_iter().filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/cgroup")).is_ok_and(|c| c.contains(&cgroup))
        }))
        .collect();
    ensure!(
        left.is_empty(),
        "a restore past its bound left processes: {:?}",
        left.iter()
            .map(|p| std::fs::read_to_string(format!("/proc/{p}/cmdline"))
                .unwrap_or_default()
                .replace('\0', " "))
            .collect::<Vec<_>>()
    );
    ensure!(
        node.task_status(id).is_err() || node.task_status(id)? != "RUNNING",
        "the task runs after a refused restore"
    );
    Ok(())
}

/// The page verification stalls (a page image that takes far longer to hash than the bound):
/// CRIU has restored the tasks and waits at its post-restore gate for a verdict that does not
/// come in time. The restore fails at the bound naming step `verify`, the hashing stops, and
/// nothing is left running.
#[test]
fn a_verdict_that_never_comes_fails_at_the_bound_naming_verify() -> Result<()> {
    let dir = Stack::discover()?.node_dir("verify-bound");
    std::fs::create_dir_all(&dir)?;
    let options = dir.join("gpu-ckpt-handler.toml");
    // The node's own key directory (a key's directory must be root's and 0700).
    let keys = node_key_dir("verify-bound");
    let _ = std::fs::remove_dir_all(&keys);
    let key = keys.join("node.key");
    std::fs::write(
        &options,
        format!(
            "RestoreTimeout = \"5s\"\nSigningKey = \"{}\"\n",
            key.display()
        ),
    )?;
    let node = node_with(
        Node::builder("verify-bound")?
            .env("GPU_CKPT_HANDLER_CONFIG", &options.display().to_string()),
    )?;
    start_counter(&node, "v1", "100")?;
    let image = node.paths().dir.join("v1-image");
    node.checkpoint_task_exit("v1", &image)?;
    node.ctr_ok(&["task", "rm", "v1"])?;

    // The largest page image grows by a 64 GiB hole after its pages, and the manifest, signed
    // again with the node's key, says so: CRIU reads only the pages its pagemap names, while
    // the verification hashes every byte the manifest lists (and would then find the digest
    // wrong).
    let pages = std::fs::read_dir(&image)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(image_format::manifest::is_page_image)
        })
        .max_by_key(|p| p.metadata().map(|m| m.len()).unwrap_or(0))
        .context("no page image in the checkpoint")?;
    let name = pages
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("?")
        .to_string();
    let grown = pages.metadata()?.len() + (64 << 30);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&pages)?
        .set_len(grown)?;
    let mut manifest = image_format::Manifest::read_from(&image)?;
    manifest
        .files
        .get_mut(&name)
        .with_context(|| format!("{name} is not in the manifest"))?
        .size = grown;
    image_format::sign::NodeKey::load(&key)?.sign_manifest(&mut manifest)?;
    manifest.write_to(&image)?;

    let (err, took) = refused_after(
        &node,
        "v1",
        &image,
        "a restore whose page verification stalls started",
    )?;
    ensure!(
        err.contains("step verify")
            && err.contains("not done within 5s")
            && err.contains("no verdict"),
        "the error does not name the verification and the bound: {err}"
    );
    ensure!(
        took < Duration::from_secs(25),
        "the restore failed only after {took:?}"
    );
    nothing_left(&node, "v1", &image, "/bin/counter")
}
