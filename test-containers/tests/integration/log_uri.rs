//! containerd's log URIs (`ctr run --log-uri`) on the real stack, checkpointed and restored:
//!
//! - `file://`: the container writes to pipes and the shim appends to the file (creating its
//!   directories), so no host file is in the container for CRIU to trip over;
//! - `binary://`: the shim starts the logging binary (`gpu-ckpt-test-logger`) with containerd's
//!   conventions, and it sees end of file when the container is gone.
//!
//! Each is checkpointed twice over: `ctr container checkpoint --task` (left running) restored
//! from the checkpoint image, and `ctr task checkpoint --exit --image-path` restored from the
//! directory. `ctr container restore --live` cannot pass a log URI (it always gives ctr's own
//! stdio), so the restores go through the containerd API, sending the shim what that command
//! sends plus the URI, as `cio.LogURI` does: the restored counter logs on into the same file.
//! The same live flow under containerd-shim-runc-v2 shows it behaves alike.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use crate::common::*;
use anyhow::{ensure, Context, Result};
use test_containers::{
    containerd::Containerd,
    stack::{processes_matching, Node},
};

/// The logging binary built with these tests.
const LOGGER: &str = env!("CARGO_BIN_EXE_gpu-ckpt-test-logger");
/// containerd's media type of a task's CRIU checkpoint in a checkpoint image's index.
const CRIU_CHECKPOINT: &str = "application/vnd.containerd.container.criu.checkpoint.criu.tar";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Runtime {
    GpuCkpt,
    RuncV2,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    File,
    Binary,
}

/// A container's log: the URI ctr gets and the file the lines land in.
struct Log {
    kind: Kind,
    uri: String,
    path: PathBuf,
}

impl Log {
    /// A log for container `id` of `node`, in a directory that does not exist yet.
    fn new(node: &Node, kind: Kind, id: &str) -> Log {
        let dir = node.paths().dir.join("app-logs").join(id);
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("nested/app.log");
        let uri = match kind {
            Kind::File => format!("file://{}", path.display()),
            // The query's pairs become the logger's arguments: `--out <path>`.
            Kind::Binary => format!("binary://{LOGGER}?--out={}", path.display()),
        };
        if kind == Kind::Binary {
            // The logger opens its file; the directory is the test's to make.
            let _ = std::fs::create_dir_all(dir.join("nested"));
        }
        Log { kind, uri, path }
    }

    fn text(&self) -> String {
        std::fs::read_to_string(&self.path).unwrap_or_default()
    }

    /// The counter's ticks, in order: `tick <n>` lines, or the logger's
    /// `<namespace>/<id> stdout: tick <n>`.
    fn ticks(&self) -> Vec<u64> {
        self.text()
            .lines()
            .filter_map(|l| {
                l.split_once("tick ")
                    .and_then(|(_, n)| n.trim().parse().ok())
            })
            .collect()
    }

    /// Waits until the log holds at least `n` ticks; returns them.
    fn wait_ticks(&self, node: &Node, n: usize, what: &str) -> Result<Vec<u64>> {
        wait_until(Duration::from_secs(20), what, || {
            let t = self.ticks();
            (t.len() >= n).then_some(t)
        })
        .with_context(|| {
            format!(
                "log {}:\n{}\ncontainerd log:\n{}",
                self.path.display(),
                tail(&self.text(), 20),
                node.log_tail(30)
            )
        })
    }

    /// The ticks once no more arrive (the container is gone and its output drained).
    fn settled_ticks(&self) -> Result<Vec<u64>> {
        let mut last = self.ticks();
        wait_until(Duration::from_secs(10), "the log to settle", || {
            std::thread::sleep(Duration::from_millis(300));
            let now = self.ticks();
            let settled = now == last;
            last = now;
            settled.then(|| last.clone())
        })
    }

    /// How many lines say `needle`.
    fn count(&self, needle: &str) -> usize {
        self.text().lines().filter(|l| l.contains(needle)).count()
    }

    /// Running logging binaries writing this log.
    fn loggers(&self) -> Vec<i32> {
        processes_matching(&[LOGGER, &self.path.display().to_string()])
    }
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// `ctr run -d --log-uri <uri>` of the counter (a tick every 100 ms) on `runtime`.
fn run_logged(node: &Node, runtime: Runtime, id: &str, log: &Log) -> Result<i32> {
    let mut args: Vec<String> = vec!["run".into(), "-d".into(), "--log-uri".into()];
    args.push(log.uri.clone());
    args.extend(match runtime {
        Runtime::GpuCkpt => run_flags(node),
        Runtime::RuncV2 => node.ctr_run_flags(),
    });
    args.extend([workloads(), id, "/bin/counter", "--interval-ms", "100"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    node.ctr_ok(&args)?;
    node.task_pid(id)
}

/// The container's stdout and stderr are pipes, not the host's file.
fn expect_pipes(pid: i32) -> Result<()> {
    for fd in [1, 2] {
        let target = std::fs::read_link(format!("/proc/{pid}/fd/{fd}"))?;
        ensure!(
            target.to_string_lossy().starts_with("pipe:"),
            "fd {fd} of {pid} is {}",
            target.display()
        );
    }
    Ok(())
}

/// Kills task `id`, waits for it to stop and deletes it (the container stays).
fn stop_task(node: &Node, id: &str) -> Result<()> {
    let _ = node.ctr(&["task", "kill", "-s", "SIGKILL", id]);
    wait_stopped(node, id)?;
    node.ctr_ok(&["task", "rm", id])?;
    Ok(())
}

fn wait_stopped(node: &Node, id: &str) -> Result<()> {
    wait_until(Duration::from_secs(10), "the task to stop", || {
        (node.task_status(id).ok().as_deref() == Some("STOPPED")).then_some(())
    })
}

/// What a task is created from.
enum Source<'a> {
    /// Nothing: a fresh start of the container's process.
    Fresh,
    /// A checkpoint image of `ctr container checkpoint --task`: its CRIU checkpoint, as
    /// `ctr container restore --live` sends it (`WithTaskCheckpoint`).
    Image(&'a str),
    /// A CRIU image directory (runc options' `CriuImagePath`).
    Dir(&'a Path),
}

/// Restores task `id` (its container kept) from `source` with its output to `log`, through
/// the containerd API; returns the restored pid.
fn restore_logged(node: &Node, id: &str, source: Source, log: &Log) -> Result<i32> {
    create_task(node, id, source, log, false)
}

/// Creates and starts task `id` of an existing container from `source`, with its output to
/// `log` (on a terminal when `terminal`), as containerd's client does with `cio.LogURI`.
fn create_task(node: &Node, id: &str, source: Source, log: &Log, terminal: bool) -> Result<i32> {
    use containerd_client::services::v1::CreateTaskRequest;
    rt().block_on(async {
        let api = Containerd::connect(node.socket(), "default").await?;
        let (checkpoint, options) = match source {
            Source::Fresh => (None, None),
            Source::Image(image) => (Some(checkpoint_descriptor(&api, image).await?), None),
            Source::Dir(dir) => (
                None,
                Some(test_containers::containerd::criu_image_path_options(dir)),
            ),
        };
        let req = CreateTaskRequest {
            container_id: id.to_string(),
            stdout: log.uri.clone(),
            stderr: log.uri.clone(),
            terminal,
            checkpoint,
            options,
            ..Default::default()
        };
        let pid = api
            .create_and_start(req, &format!("logging to {}", log.uri))
            .await?;
        Ok(pid as i32)
    })
}

/// The CRIU checkpoint's descriptor in the index of checkpoint image `image`.
async fn checkpoint_descriptor(
    api: &Containerd,
    image: &str,
) -> Result<containerd_client::types::Descriptor> {
    use containerd_client::services::v1::{
        content_client::ContentClient, images_client::ImagesClient, GetImageRequest,
        ReadContentRequest,
    };
    let target = ImagesClient::new(api.channel())
        .get(api.request(GetImageRequest {
            name: image.to_string(),
        }))
        .await
        .with_context(|| format!("Images.Get {image}"))?
        .into_inner()
        .image
        .and_then(|i| i.target)
        .with_context(|| format!("image {image} has no target"))?;
    let mut stream = ContentClient::new(api.channel())
        .read(api.request(ReadContentRequest {
            digest: target.digest.clone(),
            offset: 0,
            size: 0,
        }))
        .await
        .with_context(|| format!("Content.Read {}", target.digest))?
        .into_inner();
    let mut index = Vec::new();
    while let Some(chunk) = stream.message().await? {
        index.extend(chunk.data);
    }
    let index: serde_json::Value = serde_json::from_slice(&index).context("the image index")?;
    let m = index["manifests"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["mediaType"] == CRIU_CHECKPOINT)
        .with_context(|| format!("no CRIU checkpoint in the index of {image}: {index}"))?;
    Ok(containerd_client::types::Descriptor {
        media_type: CRIU_CHECKPOINT.into(),
        digest: m["digest"].as_str().unwrap_or_default().into(),
        size: m["size"].as_i64().unwrap_or_default(),
        ..Default::default()
    })
}

/// Consecutive ticks: the count went on, not over.
fn expect_consecutive(ticks: &[u64], what: &str) -> Result<()> {
    for w in ticks.windows(2) {
        ensure!(w[1] == w[0] + 1, "{what}: ticks skip or restart: {ticks:?}");
    }
    Ok(())
}

/// With a logging binary: after the container's end (as many ends as `gone`), each logger
/// started saw both streams close and exited.
fn expect_loggers_told(node: &Node, id: &str, log: &Log, gone: usize) -> Result<()> {
    if log.kind != Kind::Binary {
        return Ok(());
    }
    let who = format!("default/{id}");
    wait_until(
        Duration::from_secs(10),
        "the logger to see its streams close and exit",
        || {
            (log.count(&format!("{who} stdout closed")) == gone
                && log.count(&format!("{who} stderr closed")) == gone
                && log.loggers().is_empty())
            .then_some(())
        },
    )
    .with_context(|| {
        format!(
            "log:\n{}\ncontainerd log:\n{}",
            tail(&log.text(), 10),
            node.log_tail(20)
        )
    })
}

/// Checks, with a logging binary, that `n` loggers were started for `id` and one runs now.
fn expect_logger_running(id: &str, log: &Log, n: usize) -> Result<()> {
    if log.kind != Kind::Binary {
        return Ok(());
    }
    ensure!(
        log.count(&format!("default/{id} started")) == n,
        "{n} loggers expected for {id}:\n{}",
        log.text()
    );
    ensure!(
        log.loggers().len() == 1,
        "logger processes: {:?}",
        log.loggers()
    );
    Ok(())
}

/// An exec with a log URI of its own (`ctr task exec --log-uri`): its output goes there, with
/// a logging binary run as the exec (`CONTAINER_ID` is the exec's id, as runc-v2 has it). Under
/// gpu-ckpt the logger is told at the exec's exit; runc-v2 tells it at the exec's delete.
fn exec_logged(node: &Node, runtime: Runtime, kind: Kind, id: &str) -> Result<()> {
    let exec_id = format!("{id}-exec");
    let log = Log::new(node, kind, &exec_id);
    node.ctr_ok(&[
        "task",
        "exec",
        "-d",
        "--exec-id",
        &exec_id,
        "--log-uri",
        &log.uri,
        id,
        "/bin/counter",
        "--interval-ms",
        "100",
        "--file",
        "/exec-counter.txt",
    ])?;
    let ticks = log.wait_ticks(node, 3, "the exec's ticks")?;
    expect_consecutive(&ticks, "exec")?;
    expect_logger_running(&exec_id, &log, 1)?;
    node.ctr_ok(&["task", "kill", "-s", "SIGKILL", "--exec-id", &exec_id, id])?;
    if runtime == Runtime::GpuCkpt {
        expect_loggers_told(node, &exec_id, &log, 1)?;
    }
    let mut last = String::new();
    wait_until(
        Duration::from_secs(10),
        "the killed exec to be deleted",
        || {
            let out = node
                .ctr(&["task", "delete", "--exec-id", &exec_id, id])
                .ok()?;
            last = String::from_utf8_lossy(&out.stderr).into_owned();
            // Deleted already: containerd deletes an exec ctr started detached once it exits.
            (out.status.success() || last.contains("not found")).then_some(())
        },
    )
    .with_context(|| format!("ctr task delete --exec-id: {last}"))?;
    expect_loggers_told(node, &exec_id, &log, 1)
}

/// `ctr container checkpoint --task` (the container runs on), then the task replaced by its
/// restore from the checkpoint image into the same log.
fn live_checkpoint_and_restore(node: &Node, runtime: Runtime, kind: Kind, id: &str) -> Result<()> {
    let log = Log::new(node, kind, id);
    let pid = run_logged(node, runtime, id, &log)?;
    expect_pipes(pid)?;
    let before = *log
        .wait_ticks(node, 5, "the counter's first ticks")?
        .last()
        .context("ticks")?;
    expect_logger_running(id, &log, 1)?;
    exec_logged(node, runtime, kind, id)?;
    let image = format!("localhost/log-uri/{id}:1");
    node.ctr_ok(&["container", "checkpoint", "--task", "--rw", id, &image])?;
    let after = *log.ticks().last().context("ticks")?;
    log.wait_ticks(
        node,
        log.ticks().len() + 2,
        "the original to log on after the checkpoint",
    )?;
    stop_task(node, id)?;
    expect_loggers_told(node, id, &log, 1)?;
    let old = log.settled_ticks()?.len();

    let restored = restore_logged(node, id, Source::Image(&image), &log)?;
    expect_pipes(restored)?;
    let ticks = log.wait_ticks(
        node,
        old + 4,
        "the restored counter to log into the same file",
    )?;
    let new = &ticks[old..];
    ensure!(
        new[0] >= before && new[0] <= after + 1,
        "the restored counter starts at {} (checkpoint taken between {before} and {after}): {new:?}",
        new[0]
    );
    expect_consecutive(new, "restored")?;
    expect_logger_running(id, &log, 2)?;
    stop_task(node, id)?;
    expect_loggers_told(node, id, &log, 2)?;
    node.ctr_ok(&["container", "rm", id])?;
    node.ctr_ok(&["image", "rm", &image])?;
    Ok(())
}

/// `ctr task checkpoint --exit --image-path`, the restore from the directory into the same
/// log, and once more from the restored container (whose stdio are the restore's pipes).
fn exit_checkpoint_and_restore(node: &Node, kind: Kind, id: &str) -> Result<()> {
    let log = Log::new(node, kind, id);
    let pid = run_logged(node, Runtime::GpuCkpt, id, &log)?;
    expect_pipes(pid)?;
    log.wait_ticks(node, 5, "the counter's first ticks")?;
    for round in 1..=2 {
        let dir = node.paths().dir.join(format!("{id}-image-{round}"));
        node.checkpoint_task_exit(id, &dir)?;
        wait_stopped(node, id)?;
        node.ctr_ok(&["task", "rm", id])?;
        // The logger was told the container is gone: both its streams ended, it exited.
        expect_loggers_told(node, id, &log, round)?;
        let old = log.settled_ticks()?;
        let last = *old.last().context("ticks")?;

        let restored = restore_logged(node, id, Source::Dir(&dir), &log)?;
        expect_pipes(restored)?;
        let ticks = log.wait_ticks(node, old.len() + 3, "the restored counter to log on")?;
        let new = &ticks[old.len()..];
        ensure!(
            new[0] == last + 1,
            "round {round}: the restored counter goes on at {} after {last}: {new:?}",
            new[0]
        );
        expect_consecutive(new, "restored")?;
        expect_logger_running(id, &log, round + 1)?;
        let _ = std::fs::remove_dir_all(&dir);
    }
    stop_task(node, id)?;
    expect_loggers_told(node, id, &log, 3)?;
    node.ctr_ok(&["container", "rm", id])?;
    Ok(())
}

/// The live and the exit flow under the gpu-ckpt shim on node `name`, with `kind` of log; the
/// containers' ids start with `ids`.
fn logs_on_across_checkpoint_and_restore(name: &str, kind: Kind, ids: &str) -> Result<()> {
    let node = node(name)?;
    live_checkpoint_and_restore(&node, Runtime::GpuCkpt, kind, &format!("{ids}-live"))?;
    exit_checkpoint_and_restore(&node, kind, &format!("{ids}-exit"))
}

#[test]
fn file_uri_logs_on_across_checkpoint_and_restore() -> Result<()> {
    logs_on_across_checkpoint_and_restore("log-file", Kind::File, "lf")
}

#[test]
fn binary_uri_logs_on_across_checkpoint_and_restore() -> Result<()> {
    logs_on_across_checkpoint_and_restore("log-binary", Kind::Binary, "lb")
}

/// The same live flow under containerd-shim-runc-v2, with the same logger: both shims agree.
#[test]
fn runc_v2_logs_alike() -> Result<()> {
    let node = node("log-runc")?;
    live_checkpoint_and_restore(&node, Runtime::RuncV2, Kind::File, "rf-live")?;
    live_checkpoint_and_restore(&node, Runtime::RuncV2, Kind::Binary, "rb-live")?;
    Ok(())
}

/// A terminal under `binary://` (nerdctl's `run -t` with a logging driver; ctr itself gives a
/// terminal its own console, whatever `--log-uri` says): the terminal's output is the logger's
/// stdout, under both shims. Its stderr has no writer: under gpu-ckpt it is at end of file at
/// once; runc-v2 leaves its unused end of that pipe to Go's garbage collector, so there it ends
/// whenever that runs, at the latest when the container is deleted.
#[test]
fn terminal_output_goes_to_the_logger() -> Result<()> {
    let node = node("log-tty")?;
    for (runtime, id) in [(Runtime::GpuCkpt, "lt-gpu"), (Runtime::RuncV2, "lt-runc")] {
        let log = Log::new(&node, Kind::Binary, id);
        let mut args: Vec<String> = vec!["container".into(), "create".into(), "-t".into()];
        match runtime {
            Runtime::GpuCkpt => args.extend(["--runtime".into(), RUNTIME.into()]),
            // Without --fifo-dir, which `container create` does not take.
            Runtime::RuncV2 => args.extend(
                node.ctr_run_flags()
                    .chunks(2)
                    .filter(|flag| flag[0] != "--fifo-dir")
                    .flatten()
                    .cloned(),
            ),
        }
        args.extend([workloads(), id, "/bin/counter", "--interval-ms", "100"].map(String::from));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        node.ctr_ok(&args)?;
        create_task(&node, id, Source::Fresh, &log, true)?;
        let ticks = log.wait_ticks(&node, 3, "ticks through the terminal")?;
        expect_consecutive(&ticks, "terminal")?;
        if runtime == Runtime::GpuCkpt {
            ensure!(
                log.count(&format!("default/{id} stderr closed")) == 1,
                "the logger's stderr should be at end of file at once:\n{}",
                log.text()
            );
        }
        ensure!(
            log.count(&format!("default/{id} stdout closed")) == 0,
            "{runtime:?}: the logger's stdout ended while the container runs:\n{}",
            log.text()
        );
        expect_logger_running(id, &log, 1)?;
        stop_task(&node, id)?;
        expect_loggers_told(&node, id, &log, 1)?;
        node.ctr_ok(&["container", "rm", id])?;
    }
    Ok(())
}
