//! The runc driver: every runc invocation the shim makes, built from the runtime options.
//!
//! Each runc child is awaited through the shim's exit monitor (the subreaper's global
//! `waitpid(-1)` loop), never through `Child::wait`, which would race the reaper for the status.

use std::{
    io::Read,
    os::fd::OwnedFd,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use containerd_shim::monitor::{monitor_subscribe, monitor_unsubscribe, Subject, Topic};
use serde::Deserialize;
use tracing::debug;

use crate::{
    error::{Error, Result},
    options::RuntimeOptions,
};

/// Name of runc's JSON log in the bundle.
pub const LOG_FILE: &str = "log.json";

/// What a runc child's stdio is connected to.
#[derive(Default)]
pub enum ChildIo {
    /// `/dev/null` in, captured out (runc's own output).
    #[default]
    Captured,
    /// The container process's stdio: runc hands these fds through to it.
    PassThrough {
        stdin: Option<OwnedFd>,
        stdout: Option<OwnedFd>,
        stderr: Option<OwnedFd>,
    },
}

/// How to reach runc for one container.
#[derive(Clone, Debug)]
pub struct Runc {
    binary: String,
    root: String,
    systemd_cgroup: bool,
    log: PathBuf,
}

/// Options of `runc create` and `runc exec`.
pub struct CreateOpts<'a> {
    pub pid_file: &'a Path,
    pub console_socket: Option<&'a Path>,
    pub no_pivot: bool,
    pub no_new_keyring: bool,
}

/// What `runc state` reports.
#[derive(Debug, Deserialize)]
pub struct RuncState {
    pub status: String,
    #[serde(default)]
    pub pid: i32,
}

impl Runc {
    pub fn new(options: &RuntimeOptions, namespace: &str, bundle: &Path) -> Self {
        Self {
            binary: options.runc_binary().to_string(),
            root: options.runc_root(namespace, bundle),
            systemd_cgroup: options.systemd_cgroup,
            log: bundle.join(LOG_FILE),
        }
    }

    pub fn binary(&self) -> &str {
        &self.binary
    }

    fn global_args(&self) -> Vec<String> {
        let mut args = vec![
            "--root".to_string(),
            self.root.clone(),
            "--log".to_string(),
            self.log.display().to_string(),
            "--log-format".to_string(),
            "json".to_string(),
        ];
        if self.systemd_cgroup {
            args.push("--systemd-cgroup".to_string());
        }
        args
    }

    pub async fn create(
        &self,
        id: &str,
        bundle: &Path,
        opts: &CreateOpts<'_>,
        io: ChildIo,
    ) -> Result<()> {
        let mut args = vec![
            "create".to_string(),
            "--bundle".to_string(),
            bundle.display().to_string(),
            "--pid-file".to_string(),
            opts.pid_file.display().to_string(),
        ];
        push_console(&mut args, opts.console_socket);
        if opts.no_pivot {
            args.push("--no-pivot".to_string());
        }
        if opts.no_new_keyring {
            args.push("--no-new-keyring".to_string());
        }
        args.push(id.to_string());
        self.run(&args, io, None).await.map(drop)
    }

    pub async fn start(&self, id: &str) -> Result<()> {
        self.run(&["start".into(), id.into()], ChildIo::Captured, None)
            .await
            .map(drop)
    }

    /// `runc exec --detach` of the process described by the JSON file `process`.
    pub async fn exec(
        &self,
        id: &str,
        process: &Path,
        opts: &CreateOpts<'_>,
        io: ChildIo,
    ) -> Result<()> {
        let mut args = vec![
            "exec".to_string(),
            "--detach".to_string(),
            "--process".to_string(),
            process.display().to_string(),
            "--pid-file".to_string(),
            opts.pid_file.display().to_string(),
        ];
        push_console(&mut args, opts.console_socket);
        args.push(id.to_string());
        self.run(&args, io, None).await.map(drop)
    }

    pub async fn kill(&self, id: &str, signal: u32, all: bool) -> Result<()> {
        let mut args = vec!["kill".to_string()];
        if all {
            args.push("--all".to_string());
        }
        args.push(id.to_string());
        args.push(signal.to_string());
        self.run(&args, ChildIo::Captured, None).await.map(drop)
    }

    pub async fn delete(&self, id: &str, force: bool) -> Result<()> {
        let mut args = vec!["delete".to_string()];
        if force {
            args.push("--force".to_string());
        }
        args.push(id.to_string());
        self.run(&args, ChildIo::Captured, None).await.map(drop)
    }

    pub async fn pause(&self, id: &str) -> Result<()> {
        self.run(&["pause".into(), id.into()], ChildIo::Captured, None)
            .await
            .map(drop)
    }

    pub async fn resume(&self, id: &str) -> Result<()> {
        self.run(&["resume".into(), id.into()], ChildIo::Captured, None)
            .await
            .map(drop)
    }

    pub async fn state(&self, id: &str) -> Result<RuncState> {
        let out = self
            .run(&["state".into(), id.into()], ChildIo::Captured, None)
            .await?;
        serde_json::from_slice(&out).map_err(Error::json("decode runc state"))
    }

    /// Pids of every process in the container.
    pub async fn ps(&self, id: &str) -> Result<Vec<i32>> {
        let out = self
            .run(
                &["ps".into(), "--format".into(), "json".into(), id.into()],
                ChildIo::Captured,
                None,
            )
            .await?;
        serde_json::from_slice(&out).map_err(Error::json("decode runc ps"))
    }

    /// `runc update --resources -` with the OCI LinuxResources JSON on stdin.
    pub async fn update(&self, id: &str, resources_json: &[u8]) -> Result<()> {
        self.run(
            &["update".into(), "--resources".into(), "-".into(), id.into()],
            ChildIo::Captured,
            Some(resources_json.to_vec()),
        )
        .await
        .map(drop)
    }

    /// `runc checkpoint` into `image` (CRIU's work files and log in `work`).
    pub async fn checkpoint(
        &self,
        id: &str,
        image: &Path,
        work: &Path,
        args: &[String],
    ) -> Result<()> {
        let mut all = vec![
            "checkpoint".to_string(),
            "--image-path".to_string(),
            image.display().to_string(),
            "--work-path".to_string(),
            work.display().to_string(),
        ];
        all.extend_from_slice(args);
        all.push(id.to_string());
        self.run(&all, ChildIo::Captured, None).await.map(drop)
    }

    /// `runc restore --detach --no-subreaper` of `image` into the container `id` of `bundle`:
    /// the shim is the subreaper already and gets the restored process.
    #[allow(clippy::too_many_arguments)]
    pub async fn restore(
        &self,
        id: &str,
        bundle: &Path,
        image: &Path,
        work: &Path,
        opts: &CreateOpts<'_>,
        args: &[String],
        io: ChildIo,
    ) -> Result<()> {
        let mut all = vec![
            "restore".to_string(),
            "--detach".to_string(),
            "--no-subreaper".to_string(),
            "--bundle".to_string(),
            bundle.display().to_string(),
            "--pid-file".to_string(),
            opts.pid_file.display().to_string(),
            "--image-path".to_string(),
            image.display().to_string(),
            "--work-path".to_string(),
            work.display().to_string(),
        ];
        push_console(&mut all, opts.console_socket);
        if opts.no_pivot {
            all.push("--no-pivot".to_string());
        }
        all.extend_from_slice(args);
        all.push(id.to_string());
        self.run(&all, io, None).await.map(drop)
    }

    /// `runc --version`, first line.
    pub async fn version(&self) -> String {
        tool_output(&self.binary, &["--version"])
            .await
            .lines()
            .next()
            .unwrap_or_default()
            .to_string()
    }

    /// Runs runc with `args` after the global flags, awaits its exit through the monitor and
    /// returns its stdout. A non-zero exit becomes [`Error::Runc`] with runc's own message.
    async fn run(&self, args: &[String], io: ChildIo, stdin: Option<Vec<u8>>) -> Result<Vec<u8>> {
        let command_name = args.first().cloned().unwrap_or_default();
        let mut cmd = Command::new(&self.binary);
        cmd.args(self.global_args()).args(args);
        let capture = matches!(io, ChildIo::Captured);
        match io {
            ChildIo::Captured => {
                cmd.stdin(if stdin.is_some() {
                    Stdio::piped()
                } else {
                    Stdio::null()
                })
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            }
            ChildIo::PassThrough {
                stdin: i,
                stdout: o,
                stderr: e,
            } => {
                cmd.stdin(i.map(Stdio::from).unwrap_or_else(Stdio::null))
                    .stdout(o.map(Stdio::from).unwrap_or_else(Stdio::null))
                    .stderr(e.map(Stdio::from).unwrap_or_else(Stdio::null));
            }
        }
        debug!(runc = %self.binary, ?args, "running runc");

        // Only what this invocation logs counts as its error.
        let log_offset = std::fs::metadata(&self.log).map(|m| m.len()).unwrap_or(0);
        let (code, stdout, stderr) = match spawn_monitored(cmd, stdin).await {
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::InvalidArgument(format!(
                    "runc binary {:?} not found (set BinaryName in the runtime options, or put runc in PATH)",
                    self.binary
                )))
            }
            other => other?,
        };
        if code != 0 {
            let message = last_runc_error(&self.log, log_offset)
                .or_else(|| {
                    let s = String::from_utf8_lossy(&stderr).trim().to_string();
                    (!s.is_empty()).then_some(s)
                })
                .unwrap_or_else(|| format!("exit status {code}"));
            // runc's own messages often begin with "runc <command> failed: " already.
            let prefix = format!("runc {command_name} failed: ");
            let message = message
                .strip_prefix(&prefix)
                .map(str::to_string)
                .unwrap_or(message);
            return Err(Error::Runc {
                command: command_name,
                message,
            });
        }
        if !capture {
            return Ok(Vec::new());
        }
        Ok(stdout)
    }
}

/// Spawns `cmd` and waits for its exit through the shim's exit monitor (subscribed before the
/// child exists, so the exit cannot be missed). Returns the exit code, stdout and stderr (empty
/// unless piped).
async fn spawn_monitored(
    mut cmd: Command,
    stdin: Option<Vec<u8>>,
) -> Result<(i32, Vec<u8>, Vec<u8>)> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let mut sub = monitor_subscribe(Topic::Pid).await?;
    let spawned = cmd.spawn();
    // The parent's copies of pass-through fds close here.
    drop(cmd);
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            let _ = monitor_unsubscribe(sub.id).await;
            return Err(Error::io(format!("start {program:?}"))(e));
        }
    };
    let pid = child.id() as i32;
    if let (Some(mut input), Some(data)) = (child.stdin.take(), stdin) {
        tokio::task::spawn_blocking(move || std::io::Write::write_all(&mut input, &data));
    }
    let stdout = child.stdout.take().map(read_all);
    let stderr = child.stderr.take().map(read_all);
    // `child` is dropped without waiting: the reaper collects it.
    drop(child);
    let code = loop {
        match sub.rx.recv().await {
            Some(ev) => {
                if matches!(ev.subject, Subject::Pid(p) if p == pid) {
                    break ev.exit_code;
                }
            }
            None => {
                let _ = monitor_unsubscribe(sub.id).await;
                return Err(Error::FailedPrecondition(format!(
                    "exit monitor closed while {program} was running"
                )));
            }
        }
    };
    let _ = monitor_unsubscribe(sub.id).await;
    let stdout = match stdout {
        Some(h) => h.await.unwrap_or_default(),
        None => Vec::new(),
    };
    let stderr = match stderr {
        Some(h) => h.await.unwrap_or_default(),
        None => Vec::new(),
    };
    Ok((code, stdout, stderr))
}

/// The first line a tool prints for `args` (a version), or an empty string when it fails.
pub async fn tool_output(binary: &str, args: &[&str]) -> String {
    let mut cmd = Command::new(binary);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    match spawn_monitored(cmd, None).await {
        Ok((0, out, _)) => String::from_utf8_lossy(&out).trim().to_string(),
        _ => String::new(),
    }
}

fn push_console(args: &mut Vec<String>, console: Option<&Path>) {
    if let Some(socket) = console {
        args.push("--console-socket".to_string());
        args.push(socket.display().to_string());
    }
}

fn read_all<R: Read + Send + 'static>(mut r: R) -> tokio::task::JoinHandle<Vec<u8>> {
    tokio::task::spawn_blocking(move || {
        let mut buf = Vec::new();
        let _ = r.read_to_end(&mut buf);
        buf
    })
}

/// The last error runc wrote to its JSON log, the way containerd's runc shim reports it.
/// Only the part of the log after `offset` bytes is read.
pub fn last_runc_error(log: &Path, offset: u64) -> Option<String> {
    #[derive(Deserialize)]
    struct Line {
        level: String,
        msg: String,
    }
    let bytes = std::fs::read(log).ok()?;
    let start = usize::try_from(offset).ok()?.min(bytes.len());
    String::from_utf8_lossy(&bytes[start..])
        .lines()
        .rev()
        .filter_map(|l| serde_json::from_str::<Line>(l).ok())
        .find(|l| l.level == "error")
        .map(|l| l.msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_error_is_taken_from_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join(LOG_FILE);
        std::fs::write(
            &log,
            concat!(
                "{\"level\":\"error\",\"msg\":\"first\",\"time\":\"t\"}\n",
                "{\"level\":\"warning\",\"msg\":\"w\",\"time\":\"t\"}\n",
                "{\"level\":\"error\",\"msg\":\"container_linux.go: starting container process caused\",\"time\":\"t\"}\n",
                "{\"level\":\"info\",\"msg\":\"later\",\"time\":\"t\"}\n"
            ),
        )
        .unwrap();
        assert_eq!(
            last_runc_error(&log, 0).as_deref(),
            Some("container_linux.go: starting container process caused")
        );
        let len = std::fs::metadata(&log).unwrap().len();
        assert_eq!(
            last_runc_error(&log, len),
            None,
            "older errors do not count"
        );
        assert_eq!(last_runc_error(&dir.path().join("missing"), 0), None);
    }

    #[test]
    fn global_flags_come_from_the_options() {
        let o = RuntimeOptions {
            binary_name: "/usr/sbin/runc".into(),
            systemd_cgroup: true,
            ..Default::default()
        };
        let r = Runc::new(&o, "k8s.io", Path::new("/b"));
        assert_eq!(r.binary(), "/usr/sbin/runc");
        assert_eq!(
            r.global_args(),
            [
                "--root",
                "/run/containerd/gpu-ckpt/k8s.io",
                "--log",
                "/b/log.json",
                "--log-format",
                "json",
                "--systemd-cgroup"
            ]
        );
    }
}
