//! A process's stdio: pipes the shim owns between the container and containerd's fifos, a log
//! file or a logging binary (containerd's `file://` and `binary://` log URIs), or a terminal
//! whose master runc sends over a console socket.
//!
//! A container never holds a host file: whatever containerd names, the process writes to pipes,
//! so CRIU dumps pipes and `runc restore` hands the new task's pipes in their place.

use std::{
    ffi::OsString,
    fs::File,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::{ffi::OsStringExt, net::UnixListener as StdUnixListener},
    },
    path::{Path, PathBuf},
    sync::{Arc, OnceLock},
    time::Duration,
};

use containerd_shim::{
    asynchronous::io::{IoTasks, Pty, Stdio},
    monitor::{monitor_subscribe, monitor_unsubscribe, Subject, Subscription, Topic},
};
use nix::{
    fcntl::{fcntl, FcntlArg},
    sys::{
        signal::{kill, Signal},
        socket::{recvmsg, ControlMessageOwned, MsgFlags},
    },
    unistd::{fchown, pipe2, Gid, Pid, Uid},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{unix::pipe, UnixListener},
    sync::watch,
};
use tracing::{debug, info, warn};

use crate::{
    error::{Error, Result},
    runc::ChildIo,
};

/// How long runc may take to send a terminal's master after it started.
const CONSOLE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a logging binary may take to signal that it is ready. containerd-shim-runc-v2 waits
/// without a limit; a logger that hangs would hold the create (and the container lock) forever.
const LOGGER_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a logging binary gets to exit after SIGTERM before it is killed, as with runc-v2.
const LOGGER_TERM_TIMEOUT: Duration = Duration::from_secs(12);

/// The live IO of a process: the copy tasks, its terminal if it has one, and its logging binary
/// if containerd named one.
#[derive(Clone, Default)]
pub struct ProcessIo {
    pub tasks: IoTasks,
    pub pty: Option<Pty>,
    /// Terminated (SIGTERM, then SIGKILL) once the last copy of this IO is dropped — the
    /// process deleted, or its start failed — unless it exited first, at the end of file the
    /// process's exit gives it.
    logger: Option<Arc<Logger>>,
}

/// IO being prepared for a runc create, exec or restore.
pub struct PreparedIo {
    pub child: ChildIo,
    pub console: Option<ConsoleSocket>,
    pub io: ProcessIo,
}

/// What a process gets for a stream containerd sent no fifo for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Absent {
    /// The host's `/dev/null`, as runc-v2 gives it: `runc create` reopens it as the
    /// container's own `/dev/null` before the process starts.
    DevNull,
    /// A pipe: input at end of file, output read and dropped by the shim. For `runc restore`,
    /// which hands its own stdio to each stream that was a pipe at the dump. The host's
    /// `/dev/null` would stay the host's there, on a mount outside the container, and CRIU
    /// refuses to dump it again ("Can't lookup mount=.. for fd=0 path=/dev/null").
    Pipe,
}

/// Where a process's output goes. As in containerd-shim-runc-v2, the stdout string decides for
/// both streams; stderr only says whether there is one.
#[derive(Debug, PartialEq, Eq)]
enum Sink {
    /// A fifo path (no scheme, or `fifo:`): each stream copied into its own fifo.
    Fifo,
    /// `file:///path`: both streams appended to the file by the shim.
    File(PathBuf),
    /// `binary:///path?key=value` or `binary-v2://…`: both streams read by a logging binary.
    Binary(LoggerCommand),
}

/// A logging binary as a `binary://` URI names it.
#[derive(Debug, PartialEq, Eq)]
struct LoggerCommand {
    program: PathBuf,
    /// The query's pairs, each as two arguments `key value` (runc-v2's `NewBinaryCmd`): the
    /// first value of each key, keys in the order they first appear.
    args: Vec<OsString>,
    /// `binary-v2://`: the binary must write a byte before it closes its ready descriptor;
    /// under `binary://` end of file counts as ready too.
    strict_ready: bool,
}

/// Connects `stdio` for a process about to be created, exec'd or restored. Output copies start
/// at once and stay parked until the process writes; input copies start when containerd opens
/// the fifo. Streams without a fifo get what `absent` says. A `binary://` logger is started
/// here, as the container `id` (the exec's id for an exec, as runc-v2 does), and has signalled
/// ready when this returns.
pub async fn prepare(
    stdio: &Stdio,
    id: &str,
    io_uid: u32,
    io_gid: u32,
    absent: Absent,
) -> Result<PreparedIo> {
    let sink = sink_of(stdio)?;
    let mut io = ProcessIo::default();
    if stdio.terminal {
        let log = terminal_log(&sink, stdio, id, &mut io).await?;
        return Ok(PreparedIo {
            child: ChildIo::PassThrough {
                stdin: None,
                stdout: None,
                stderr: None,
            },
            console: Some(ConsoleSocket::new(log)?),
            io,
        });
    }
    let streams = Streams {
        stdio,
        uid: io_uid,
        gid: io_gid,
        absent,
    };
    let (stdout, stderr) = match &sink {
        Sink::Fifo => (
            streams.to_fifo(&stdio.stdout, &mut io)?,
            streams.to_fifo(&stdio.stderr, &mut io)?,
        ),
        Sink::File(path) => streams.to_file(path)?,
        Sink::Binary(command) => streams.to_logger(command, id, &mut io).await?,
    };
    // Input last: a failed output (a logger that does not start) leaves no fifo copy behind.
    let stdin = streams.input(&mut io)?;
    Ok(PreparedIo {
        child: ChildIo::PassThrough {
            stdin,
            stdout,
            stderr,
        },
        console: None,
        io,
    })
}

/// Where the output of `stdio` goes: its stdout's sink, which a log URI in stderr alone
/// cannot change.
fn sink_of(stdio: &Stdio) -> Result<Sink> {
    let sink = parse_sink(&stdio.stdout)?;
    if sink == Sink::Fifo && parse_sink(&stdio.stderr)? != Sink::Fifo {
        return Err(Error::InvalidArgument(format!(
            "stderr {:?} is a log URI but stdout {:?} is not: a log URI names both streams",
            stdio.stderr, stdio.stdout
        )));
    }
    Ok(sink)
}

/// Where a terminal's output is copied besides containerd's fifo: a logging binary's stdout
/// (started here), or nowhere.
async fn terminal_log(
    sink: &Sink,
    stdio: &Stdio,
    id: &str,
    io: &mut ProcessIo,
) -> Result<Option<OwnedFd>> {
    match sink {
        Sink::Fifo => Ok(None),
        // runc-v2 fails the same way: it opens the URI as the terminal's output fifo.
        Sink::File(_) => Err(Error::InvalidArgument(format!(
            "a terminal cannot write to the log URI {:?}: file:// takes no terminal",
            stdio.stdout
        ))),
        Sink::Binary(command) => {
            let (out_r, out_w) = new_pipe()?;
            // A terminal has one output: the logger's stderr is at end of file at once.
            let (err_r, _) = new_pipe()?;
            let logger = Logger::start(command, id, out_r, err_r, &stdio.stdout).await?;
            io.logger = Some(Arc::new(logger));
            Ok(Some(out_w))
        }
    }
}

/// A process's stdout and stderr, as the process gets them.
type Outputs = (Option<OwnedFd>, Option<OwnedFd>);

/// The streams of a process without a terminal being prepared: containerd's names for them,
/// the owner of the pipe ends the process gets, and what a stream without a fifo gets.
struct Streams<'a> {
    stdio: &'a Stdio,
    uid: u32,
    gid: u32,
    absent: Absent,
}

impl Streams<'_> {
    /// Gives the process's end `fd` of a pipe to the IO owner, where it is not root.
    fn own(&self, fd: &OwnedFd) -> Result<()> {
        if self.uid != 0 || self.gid != 0 {
            fchown(
                fd,
                Some(Uid::from_raw(self.uid)),
                Some(Gid::from_raw(self.gid)),
            )
            .map_err(|e| Error::io("chown stdio pipe")(e.into()))?;
        }
        Ok(())
    }

    /// A pipe for an output: the read end, and the write end (owned) that the process gets.
    fn output_pipe(&self) -> Result<(OwnedFd, OwnedFd)> {
        let (r, w) = new_pipe()?;
        self.own(&w)?;
        Ok((r, w))
    }

    /// An output without a fifo: nothing (the host's /dev/null), or a pipe that is drained.
    fn absent_output(&self) -> Result<Option<OwnedFd>> {
        match self.absent {
            Absent::DevNull => Ok(None),
            Absent::Pipe => {
                let (r, w) = self.output_pipe()?;
                discard(r)?;
                Ok(Some(w))
            }
        }
    }

    /// An output copied into containerd's fifo `path` (none: [`Streams::absent_output`]).
    fn to_fifo(&self, path: &str, io: &mut ProcessIo) -> Result<Option<OwnedFd>> {
        if path.is_empty() {
            return self.absent_output();
        }
        let (r, w) = self.output_pipe()?;
        let receiver = pipe::Receiver::from_owned_fd(r).map_err(Error::io("output pipe"))?;
        io.tasks.copy_to_fifo(receiver, path)?;
        Ok(Some(w))
    }

    /// Both outputs appended to the log file `path` of a `file://` URI.
    fn to_file(&self, path: &Path) -> Result<Outputs> {
        let file = open_log_file(path, &self.stdio.stdout)?;
        let to_file = |file: File| -> Result<Option<OwnedFd>> {
            let (r, w) = self.output_pipe()?;
            copy_to_file(r, file, path)?;
            Ok(Some(w))
        };
        let stdout = to_file(
            file.try_clone()
                .map_err(Error::io(format!("log file {}", path.display())))?,
        )?;
        let stderr = if self.stdio.stderr.is_empty() {
            self.absent_output()?
        } else {
            to_file(file)?
        };
        Ok((stdout, stderr))
    }

    /// Both outputs read by the logging binary `command`, started here.
    async fn to_logger(
        &self,
        command: &LoggerCommand,
        id: &str,
        io: &mut ProcessIo,
    ) -> Result<Outputs> {
        let (out_r, out_w) = self.output_pipe()?;
        let (err_r, err_w) = self.output_pipe()?;
        let logger = Logger::start(command, id, out_r, err_r, &self.stdio.stdout).await?;
        io.logger = Some(Arc::new(logger));
        Ok((Some(out_w), Some(err_w)))
    }

    /// The input: copied from containerd's fifo, else what `absent` says.
    fn input(&self, io: &mut ProcessIo) -> Result<Option<OwnedFd>> {
        if self.stdio.stdin.is_empty() {
            return match self.absent {
                Absent::DevNull => Ok(None),
                Absent::Pipe => {
                    // The write end closes here: the process reads end of file.
                    let (r, _) = new_pipe()?;
                    self.own(&r)?;
                    Ok(Some(r))
                }
            };
        }
        let (r, w) = new_pipe()?;
        self.own(&r)?;
        let sender = pipe::Sender::from_owned_fd(w).map_err(Error::io("stdin pipe"))?;
        io.tasks.copy_from_fifo(&self.stdio.stdin, sender)?;
        Ok(Some(r))
    }
}

/// What `uri` (a stdout or stderr string from containerd) asks for. Parsed as Go's `url.Parse`
/// does for these schemes: the scheme is case-insensitive, a host (`file://host/path`) is
/// ignored, path and query are percent-decoded. Malformed URIs are refused, naming the URI.
fn parse_sink(uri: &str) -> Result<Sink> {
    let Some((scheme, rest)) = split_scheme(uri) else {
        return Ok(Sink::Fifo);
    };
    let scheme = scheme.to_ascii_lowercase();
    let bad = |why: String| Error::InvalidArgument(format!("stdio URI {uri:?}: {why}"));
    let rest = rest.split_once('#').map_or(rest, |(r, _)| r);
    let (hier, query) = match rest.split_once('?') {
        Some((h, q)) => (h, q),
        None => (rest, ""),
    };
    let path = match hier.strip_prefix("//") {
        Some(authority_and_path) => authority_and_path
            .find('/')
            .map_or("", |i| &authority_and_path[i..]),
        // `scheme:/path` has a path; `scheme:name` is opaque and has none.
        None if hier.starts_with('/') => hier,
        None => "",
    };
    let path = || -> Result<PathBuf> {
        let decoded = percent_decode(path, false).map_err(&bad)?;
        if decoded.is_empty() {
            return Err(bad("it names no path".into()));
        }
        Ok(PathBuf::from(OsString::from_vec(decoded)))
    };
    match scheme.as_str() {
        "fifo" => Ok(Sink::Fifo),
        "file" => Ok(Sink::File(path()?)),
        "binary" | "binary-v2" => Ok(Sink::Binary(LoggerCommand {
            program: path()?,
            args: query_args(query).map_err(&bad)?,
            strict_ready: scheme == "binary-v2",
        })),
        other => Err(Error::InvalidArgument(format!(
            "unsupported stdio URI scheme {other:?} in {uri:?}: use a fifo path, file://, \
             binary:// or binary-v2://"
        ))),
    }
}

/// The scheme of `s` and what follows its colon, if `s` starts with one (RFC 3986: a letter,
/// then letters, digits, `+`, `-` or `.`). A path has none.
fn split_scheme(s: &str) -> Option<(&str, &str)> {
    let (scheme, rest) = s.split_once(':')?;
    let mut chars = scheme.chars();
    let first = chars.next()?;
    (first.is_ascii_alphabetic()
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
    .then_some((scheme, rest))
}

/// A logging binary's arguments from a URI's query: `key value` for each key, its first value
/// (an absent value is an empty argument), as runc-v2's `NewBinaryCmd` builds them.
fn query_args(query: &str) -> std::result::Result<Vec<OsString>, String> {
    let mut keys: Vec<Vec<u8>> = Vec::new();
    let mut args = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        if pair.contains(';') {
            return Err(format!(
                "invalid semicolon separator in query pair {pair:?}"
            ));
        }
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let key = percent_decode(key, true)?;
        let value = percent_decode(value, true)?;
        if keys.contains(&key) {
            continue;
        }
        keys.push(key.clone());
        args.push(OsString::from_vec(key));
        args.push(OsString::from_vec(value));
    }
    Ok(args)
}

/// `s` with its `%XX` escapes decoded (and `+` as a space in a query).
fn percent_decode(s: &str, query: bool) -> std::result::Result<Vec<u8>, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| format!("invalid escape {:?}", &s[i..s.len().min(i + 3)]))?;
                out.push(hex);
                i += 3;
            }
            b'+' if query => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    Ok(out)
}

/// Opens the log file of a `file://` URI for appending, creating it (0644) and its directories
/// (0755) as runc-v2 does, so a bad path fails the create rather than the first write.
fn open_log_file(path: &Path, uri: &str) -> Result<File> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(Error::io(format!(
                "create the directory {} of log URI {uri:?}",
                dir.display()
            )))?;
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o644)
        .open(path)
        .map_err(Error::io(format!(
            "open the log file {} of log URI {uri:?}",
            path.display()
        )))
}

/// Appends what comes through `pipe` to `file` until the pipe's last writer (the process and
/// whatever inherited it) closes it. A failed write drops that output and is logged once; the
/// pipe is drained on, so a full disk neither blocks nor kills the process.
fn copy_to_file(pipe: OwnedFd, file: File, path: &Path) -> Result<()> {
    let mut from = pipe::Receiver::from_owned_fd(pipe).map_err(Error::io("output pipe"))?;
    let mut to = tokio::fs::File::from_std(file);
    let path = path.to_path_buf();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        let mut failing = false;
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) => {
                    warn!(path = %path.display(), error = %e, "reading output for the log file");
                    break;
                }
            };
            let written = match to.write_all(&buf[..n]).await {
                Ok(()) => to.flush().await,
                Err(e) => Err(e),
            };
            match written {
                Ok(()) if failing => {
                    info!(path = %path.display(), "log file writable again");
                    failing = false;
                }
                Ok(()) => {}
                Err(e) if !failing => {
                    warn!(path = %path.display(), error = %e, "log file write failed, output dropped");
                    failing = true;
                }
                Err(_) => {}
            }
        }
    });
    Ok(())
}

/// The namespace this shim serves (its `-namespace` flag, else containerd's `NAMESPACE`), which
/// a logging binary gets as `CONTAINER_NAMESPACE`. A shim serves one namespace all its life.
fn shim_namespace() -> &'static str {
    static NAMESPACE: OnceLock<String> = OnceLock::new();
    NAMESPACE.get_or_init(|| {
        let args: Vec<OsString> = std::env::args_os().skip(1).collect();
        containerd_shim::parse(&args)
            .ok()
            .map(|flags| flags.namespace)
            .filter(|ns| !ns.is_empty())
            .or_else(|| std::env::var("NAMESPACE").ok())
            .unwrap_or_default()
    })
}

/// A logging binary of a `binary://` URI, started with containerd's conventions
/// (`runtime/v2/logging`): fd 3 the process's stdout, fd 4 its stderr, fd 5 the ready pipe,
/// `CONTAINER_ID` and `CONTAINER_NAMESPACE` its only environment. It sees end of file on fds 3
/// and 4 when the process (with everything that inherited its output) is gone; it is never
/// restarted. Dropping the handle terminates it if it is still running.
struct Logger {
    /// Dropped: SIGTERM, then SIGKILL after [`LOGGER_TERM_TIMEOUT`]; set: SIGKILL at once.
    stop: watch::Sender<bool>,
}

impl Logger {
    async fn start(
        command: &LoggerCommand,
        id: &str,
        stdout: OwnedFd,
        stderr: OwnedFd,
        uri: &str,
    ) -> Result<Logger> {
        // A clear error for the common mistake; runc-v2 fails at exec with "no such file".
        std::fs::metadata(&command.program).map_err(Error::io(format!(
            "logging binary {} of log URI {uri:?}",
            command.program.display()
        )))?;
        let (ready_r, ready_w) = new_pipe()?;
        // Above the descriptors the child gets, so that no dup2 in it overwrites another's
        // source; close-on-exec, so only the dup2'd copies reach the logger.
        let fds = [
            above_stdio(stdout)?,
            above_stdio(stderr)?,
            above_stdio(ready_w)?,
        ];
        let cmd = logger_command(command, id, &fds);
        let (pid, sub) = spawn_logger(cmd, fds, command, uri).await?;
        let (stop, stopped) = watch::channel(false);
        tokio::spawn(watch_logger(pid, sub, stopped));
        let logger = Logger { stop };
        debug!(pid, id, uri, "logging binary started");
        logger.ready(ready_r, command, uri).await
    }

    /// This logger once it has signalled ready on `ready_r`; else, killed, why not.
    async fn ready(self, ready_r: OwnedFd, command: &LoggerCommand, uri: &str) -> Result<Logger> {
        let mut ready = pipe::Receiver::from_owned_fd(ready_r).map_err(Error::io("ready pipe"))?;
        let mut byte = [0u8; 1];
        let failure = match tokio::time::timeout(LOGGER_READY_TIMEOUT, ready.read(&mut byte)).await
        {
            Ok(Ok(1)) => return Ok(self),
            Ok(Ok(_)) if !command.strict_ready => return Ok(self),
            Ok(Ok(_)) => "closed its ready descriptor without signalling ready (it may have \
                          exited)"
                .to_string(),
            Ok(Err(e)) => format!("its ready descriptor failed: {e}"),
            Err(_) => format!("it did not signal ready within {LOGGER_READY_TIMEOUT:?}"),
        };
        self.kill();
        Err(Error::FailedPrecondition(format!(
            "logging binary {} of log URI {uri:?}: {failure}",
            command.program.display()
        )))
    }

    /// Kills the logger at once (a failed start), as runc-v2 does.
    fn kill(&self) {
        let _ = self.stop.send(true);
    }

    /// Ends when the logger is told to stop (the handle dropped or killed), for the copy of a
    /// terminal into it.
    fn stopped(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }
}

/// The command that runs the logging binary `command` for container `id`, with `fds` (its
/// stdout, stderr and ready pipe) as its fds 3, 4 and 5, and nothing else of the shim's.
fn logger_command(command: &LoggerCommand, id: &str, fds: &[OwnedFd; 3]) -> std::process::Command {
    let raw = fds.each_ref().map(|fd| fd.as_raw_fd());
    let mut cmd = std::process::Command::new(&command.program);
    cmd.args(&command.args)
        .env_clear()
        .env("CONTAINER_ID", id)
        .env("CONTAINER_NAMESPACE", shim_namespace())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    // SAFETY: between fork and exec the closure only calls dup2, which is
    // async-signal-safe, on descriptors that stay open until after the spawn.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(move || {
            for (target, fd) in (3..).zip(raw) {
                if libc::dup2(fd, target) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    cmd
}

/// Starts `cmd` ([`logger_command`] of `fds`), subscribed to its exit; its pid and the
/// subscription.
async fn spawn_logger(
    mut cmd: std::process::Command,
    fds: [OwnedFd; 3],
    command: &LoggerCommand,
    uri: &str,
) -> Result<(i32, Subscription)> {
    // Subscribed before the child exists, so its exit cannot be missed.
    let sub = monitor_subscribe(Topic::Pid).await?;
    let spawned = cmd.spawn();
    // The shim's copies of the logger's descriptors: its ready pipe must close here.
    drop(cmd);
    drop(fds);
    let child = match spawned {
        Ok(child) => child,
        Err(e) => {
            let _ = monitor_unsubscribe(sub.id).await;
            return Err(Error::io(format!(
                "start the logging binary {} of log URI {uri:?}",
                command.program.display()
            ))(e));
        }
    };
    let pid = child.id() as i32;
    // Not waited for here: the shim's reaper collects it, and the watcher sees its exit.
    drop(child);
    Ok((pid, sub))
}

/// Waits for the logger `pid` to exit, or to be told to stop: then signals it, if it has not
/// exited, and waits out [`LOGGER_TERM_TIMEOUT`] before SIGKILL.
async fn watch_logger(pid: i32, mut sub: Subscription, mut stop: watch::Receiver<bool>) {
    let sub_id = sub.id;
    let exited = async {
        while let Some(ev) = sub.rx.recv().await {
            if matches!(ev.subject, Subject::Pid(p) if p == pid) {
                return Some(ev.exit_code);
            }
        }
        None
    };
    tokio::pin!(exited);
    let kill_now = tokio::select! {
        code = &mut exited => {
            debug!(pid, ?code, "logging binary exited");
            let _ = monitor_unsubscribe(sub_id).await;
            return;
        }
        changed = stop.changed() => changed.is_ok() && *stop.borrow(),
    };
    let target = Pid::from_raw(pid);
    if kill_now {
        let _ = kill(target, Signal::SIGKILL);
    } else {
        debug!(pid, "process io released, terminating its logging binary");
        let _ = kill(target, Signal::SIGTERM);
        if tokio::time::timeout(LOGGER_TERM_TIMEOUT, &mut exited)
            .await
            .is_err()
        {
            warn!(pid, timeout = ?LOGGER_TERM_TIMEOUT, "logging binary ignored SIGTERM, killing it");
            let _ = kill(target, Signal::SIGKILL);
        }
    }
    let _ = monitor_unsubscribe(sub_id).await;
}

/// `fd` moved to a descriptor number above 9, close-on-exec.
fn above_stdio(fd: OwnedFd) -> Result<OwnedFd> {
    let raw = fcntl(&fd, FcntlArg::F_DUPFD_CLOEXEC(10))
        .map_err(|e| Error::io("duplicate a logging pipe")(e.into()))?;
    // SAFETY: fcntl just returned this new descriptor, which nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Reads `pipe` and drops what comes, until its last writer closes it.
fn discard(pipe: OwnedFd) -> Result<()> {
    let mut receiver = pipe::Receiver::from_owned_fd(pipe).map_err(Error::io("output pipe"))?;
    tokio::spawn(async move {
        let _ = tokio::io::copy(&mut receiver, &mut tokio::io::sink()).await;
    });
    Ok(())
}

fn new_pipe() -> Result<(OwnedFd, OwnedFd)> {
    pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| Error::io("create pipe")(e.into()))
}

/// A Unix socket runc connects to (`--console-socket`) to hand over a terminal's master.
pub struct ConsoleSocket {
    path: PathBuf,
    listener: UnixListener,
    _dir: tempfile::TempDir,
    /// The logging binary's stdout pipe, for a terminal under a `binary://` URI.
    log: Option<OwnedFd>,
}

impl ConsoleSocket {
    fn new(log: Option<OwnedFd>) -> Result<Self> {
        // A short path: socket paths are limited to 108 bytes, bundle paths can be longer.
        let dir = tempfile::Builder::new()
            .prefix("gpu-ckpt-pty")
            .tempdir_in("/tmp")
            .map_err(Error::io("create console socket directory"))?;
        let path = dir.path().join("pty.sock");
        let std_listener =
            StdUnixListener::bind(&path).map_err(Error::io("bind console socket"))?;
        std_listener
            .set_nonblocking(true)
            .map_err(Error::io("console socket"))?;
        let listener = UnixListener::from_std(std_listener).map_err(Error::io("console socket"))?;
        Ok(Self {
            path,
            listener,
            _dir: dir,
            log,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Receives the terminal master runc sends, and connects it to the fifos of `stdio`, or its
    /// output to the logging binary of a `binary://` URI.
    pub async fn receive(mut self, stdio: &Stdio, io: &mut ProcessIo) -> Result<()> {
        let (stream, _) = tokio::time::timeout(CONSOLE_TIMEOUT, self.listener.accept())
            .await
            .map_err(|_| Error::FailedPrecondition("runc sent no terminal in time".into()))?
            .map_err(Error::io("accept on console socket"))?;
        let std_stream = stream
            .into_std()
            .map_err(Error::io("console socket stream"))?;
        std_stream
            .set_nonblocking(false)
            .map_err(Error::io("console socket stream"))?;
        let master = tokio::task::spawn_blocking(move || receive_fd(&std_stream))
            .await
            .map_err(|e| Error::FailedPrecondition(format!("receive terminal: {e}")))??;
        let pty = Pty::new(File::from(master))?;
        if !stdio.stdin.is_empty() {
            io.tasks.copy_from_fifo(&stdio.stdin, pty.clone())?;
        }
        match (self.log.take(), &io.logger) {
            (Some(log), Some(logger)) => copy_to_logger(pty.clone(), log, logger.stopped())?,
            _ if !stdio.stdout.is_empty() => io.tasks.copy_to_fifo(pty.clone(), &stdio.stdout)?,
            _ => {}
        }
        io.pty = Some(pty);
        Ok(())
    }
}

fn receive_fd(stream: &std::os::unix::net::UnixStream) -> Result<OwnedFd> {
    let mut buf = [0u8; 4096];
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let msg = recvmsg::<()>(
        stream.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(|e| Error::io("receive terminal from runc")(e.into()))?;
    for cmsg in msg
        .cmsgs()
        .map_err(|e| Error::io("receive terminal from runc")(e.into()))?
    {
        if let ControlMessageOwned::ScmRights(fds) = cmsg {
            if let Some(&fd) = fds.first() {
                // SAFETY: the kernel just installed this descriptor for us and nothing else owns it.
                return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    Err(Error::FailedPrecondition(
        "runc sent no terminal over the console socket".into(),
    ))
}

/// Sets a terminal's window size.
pub fn resize(pty: &Pty, width: u32, height: u32) -> Result<()> {
    use std::os::fd::AsFd;
    let ws = libc::winsize {
        ws_row: u16::try_from(height).unwrap_or(u16::MAX),
        ws_col: u16::try_from(width).unwrap_or(u16::MAX),
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a winsize struct that lives for the call.
    let rc = unsafe { libc::ioctl(pty.as_fd().as_raw_fd(), libc::TIOCSWINSZ, &ws) };
    if rc < 0 {
        return Err(Error::io("resize terminal")(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Copies a terminal's output into its logging binary's stdout pipe until the terminal hangs
/// up (the process is gone), the logger goes away, or its handle is dropped.
fn copy_to_logger(mut pty: Pty, log: OwnedFd, mut stopped: watch::Receiver<bool>) -> Result<()> {
    let mut to = pipe::Sender::from_owned_fd(log).map_err(Error::io("logging pipe"))?;
    tokio::spawn(async move {
        tokio::select! {
            copied = tokio::io::copy(&mut pty, &mut to) => {
                if let Err(e) = copied {
                    debug!(error = %e, "terminal copy to the logging binary ended");
                }
            }
            _ = stopped.changed() => {}
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use super::*;

    fn streams(child: ChildIo) -> [Option<OwnedFd>; 3] {
        match child {
            ChildIo::PassThrough {
                stdin,
                stdout,
                stderr,
            } => [stdin, stdout, stderr],
            ChildIo::Captured => panic!("no pass-through io"),
        }
    }

    fn is_pipe(fd: &OwnedFd) -> bool {
        nix::sys::stat::fstat(fd)
            .map(|st| st.st_mode & libc::S_IFMT == libc::S_IFIFO)
            .unwrap_or(false)
    }

    /// Polls until `path` holds text that satisfies `done`; returns the text.
    async fn wait_for_text(path: &Path, done: impl Fn(&str) -> bool) -> String {
        for _ in 0..500 {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            if done(&text) {
                return text;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "{} never got the expected text: {:?}",
            path.display(),
            std::fs::read_to_string(path)
        );
    }

    fn write_all(fd: Option<OwnedFd>, text: &str) {
        File::from(fd.expect("an output pipe"))
            .write_all(text.as_bytes())
            .unwrap();
    }

    #[tokio::test]
    async fn absent_streams_at_restore_are_pipes_at_eof_and_drained() {
        let none = Stdio::new("", "", "", false);
        let dev_null = prepare(&none, "c1", 0, 0, Absent::DevNull).await.unwrap();
        assert!(streams(dev_null.child).iter().all(Option::is_none));

        let pipes = prepare(&none, "c1", 0, 0, Absent::Pipe).await.unwrap();
        let [stdin, stdout, stderr] = streams(pipes.child);
        let mut input = File::from(stdin.expect("a stdin pipe"));
        let mut buf = [0u8; 8];
        assert_eq!(input.read(&mut buf).unwrap(), 0, "stdin is not at EOF");
        // More than a pipe holds: it only completes if the shim reads and drops the output.
        let chunk = vec![b'x'; 1 << 20];
        for out in [stdout, stderr] {
            let mut out = File::from(out.expect("an output pipe"));
            let chunk = chunk.clone();
            tokio::time::timeout(
                Duration::from_secs(10),
                tokio::task::spawn_blocking(move || out.write_all(&chunk)),
            )
            .await
            .expect("the output pipe is not drained")
            .unwrap()
            .unwrap();
        }
    }

    #[test]
    fn log_uris_are_read_as_runc_v2_reads_them() {
        for fifo in ["/run/containerd/fifo/1/c1-stdout", "", "fifo:///run/x"] {
            assert_eq!(parse_sink(fifo).unwrap(), Sink::Fifo, "{fifo}");
        }
        for (uri, path) in [
            ("file:///var/log/app.log", "/var/log/app.log"),
            ("file:///var/log/app%20one.log", "/var/log/app one.log"),
            ("FILE://host/var/log/a+b.log", "/var/log/a+b.log"),
            ("file:/var/log/a.log", "/var/log/a.log"),
        ] {
            assert_eq!(parse_sink(uri).unwrap(), Sink::File(path.into()), "{uri}");
        }
        let uri = "binary:///usr/bin/logger?--out=%2Fvar%2Flog%2Fa+b&mode=x&--out=/again&flag#f";
        let Sink::Binary(command) = parse_sink(uri).unwrap() else {
            panic!("not a binary sink");
        };
        assert_eq!(command.program, Path::new("/usr/bin/logger"));
        assert_eq!(
            command.args,
            ["--out", "/var/log/a b", "mode", "x", "flag", ""].map(OsString::from)
        );
        assert!(!command.strict_ready);
        let Sink::Binary(v2) = parse_sink("binary-v2:///usr/bin/logger").unwrap() else {
            panic!("not a binary sink");
        };
        assert!(v2.strict_ready && v2.args.is_empty());
    }

    #[test]
    fn bad_log_uris_are_refused_naming_them() {
        for (uri, why) in [
            ("syslog://host/x", "unsupported stdio URI scheme \"syslog\""),
            ("binary://", "names no path"),
            ("binary:logger", "names no path"),
            ("file://host", "names no path"),
            ("file:///var/log/a%zz.log", "invalid escape"),
            ("binary:///l?a=1;b=2", "semicolon"),
        ] {
            let err = parse_sink(uri).unwrap_err().to_string();
            assert!(err.contains(why), "{uri}: {err}");
            assert!(err.contains(&format!("{uri:?}")), "{uri}: {err}");
        }
    }

    #[tokio::test]
    async fn file_uris_give_pipes_the_shim_appends_to_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("logs/deeper/c1.log");
        let uri = format!("file://{}", path.display());
        let stdio = Stdio::new("", &uri, &uri, false);
        let prepared = prepare(&stdio, "c1", 0, 0, Absent::DevNull).await.unwrap();
        let [stdin, stdout, stderr] = streams(prepared.child);
        assert!(stdin.is_none());
        // The container gets pipes, never the host's file (which CRIU cannot dump).
        assert!(stdout.as_ref().is_some_and(is_pipe));
        assert!(stderr.as_ref().is_some_and(is_pipe));
        write_all(stdout, "out 1\n");
        write_all(stderr, "err 1\n");
        wait_for_text(&path, |t| t.contains("out 1\n") && t.contains("err 1\n")).await;

        // A restore into the same file appends to it.
        let restored = prepare(&stdio, "c1", 0, 0, Absent::Pipe).await.unwrap();
        let [_, stdout, _] = streams(restored.child);
        write_all(stdout, "out 2\n");
        let text = wait_for_text(&path, |t| t.contains("out 2\n")).await;
        assert!(text.ends_with("out 2\n"), "{text:?}");
        assert_eq!(text.len(), "out 1\nerr 1\nout 2\n".len(), "{text:?}");
    }

    #[tokio::test]
    async fn a_terminal_takes_no_file_uri() {
        let uri = "file:///var/log/gpu-ckpt-never.log";
        let stdio = Stdio::new("", uri, uri, true);
        let err = match prepare(&stdio, "c1", 0, 0, Absent::DevNull).await {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a terminal with a file:// URI was accepted"),
        };
        assert!(err.contains("terminal") && err.contains(uri), "{err}");
    }

    /// A logging binary in the shape of containerd's `logging.Run`: it records its arguments
    /// and environment, signals ready on fd 5, copies fds 3 and 4 and says when both ended.
    fn logger_script(dir: &Path, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join("logger.sh");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    const COPYING_LOGGER: &str = r#"out="$2"
echo "args=$*" > "$out.env"
/usr/bin/tr '\0' '\n' < /proc/$$/environ >> "$out.env"
printf r >&5
exec 5>&-
/bin/cat <&3 > "$out.stdout" &
/bin/cat <&4 > "$out.stderr"
wait
echo done > "$out.done""#;

    #[tokio::test]
    async fn binary_uris_start_the_logger_with_containerds_conventions() {
        let dir = tempfile::tempdir().unwrap();
        let script = logger_script(dir.path(), COPYING_LOGGER);
        let out = dir.path().join("log");
        let uri = format!("binary://{}?--out={}", script.display(), out.display());
        let stdio = Stdio::new("", &uri, &uri, false);
        let prepared = prepare(&stdio, "c1", 0, 0, Absent::DevNull).await.unwrap();
        assert!(prepared.io.logger.is_some());
        // Ready came after the environment was written.
        let env = std::fs::read_to_string(out.with_extension("env")).unwrap();
        let mut lines = env.lines();
        assert_eq!(
            lines.next(),
            Some(&*format!("args=--out {}", out.display()))
        );
        // Its environment is these two and nothing of the shim's.
        let mut vars: Vec<&str> = lines.collect();
        vars.sort();
        assert_eq!(vars.len(), 2, "{vars:?}");
        assert_eq!(vars[0], "CONTAINER_ID=c1");
        assert!(vars[1].starts_with("CONTAINER_NAMESPACE="), "{vars:?}");
        // The process's IO holds the logger: dropped, it would terminate it.
        let PreparedIo { child, io, .. } = prepared;
        let [_, stdout, stderr] = streams(child);
        assert!(stdout.as_ref().is_some_and(is_pipe));
        write_all(stdout, "hello\n");
        write_all(stderr, "oops\n");
        // Both streams closed (the process gone): the logger reads to the end and exits.
        wait_for_text(&out.with_extension("done"), |t| t == "done\n").await;
        assert_eq!(
            std::fs::read_to_string(out.with_extension("stdout")).unwrap(),
            "hello\n"
        );
        assert_eq!(
            std::fs::read_to_string(out.with_extension("stderr")).unwrap(),
            "oops\n"
        );
        drop(io);
    }

    #[tokio::test]
    async fn binary_v2_requires_the_ready_byte() {
        let dir = tempfile::tempdir().unwrap();
        let script = logger_script(dir.path(), "exit 0");
        let plain = format!("binary://{}", script.display());
        let stdio = Stdio::new("", &plain, &plain, false);
        assert!(prepare(&stdio, "c1", 0, 0, Absent::DevNull).await.is_ok());

        let strict = format!("binary-v2://{}", script.display());
        let stdio = Stdio::new("", &strict, &strict, false);
        let err = match prepare(&stdio, "c1", 0, 0, Absent::DevNull).await {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a binary-v2 logger that never signalled ready was accepted"),
        };
        assert!(err.contains("ready") && err.contains(&strict), "{err}");

        let missing = "binary:///nonexistent/gpu-ckpt-logger?x=1";
        let stdio = Stdio::new("", missing, missing, false);
        let err = match prepare(&stdio, "c1", 0, 0, Absent::DevNull).await {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a missing logging binary was accepted"),
        };
        assert!(err.contains(missing), "{err}");
    }

    #[tokio::test]
    async fn a_logger_still_running_when_its_io_is_dropped_is_terminated() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("pid");
        let script = logger_script(
            dir.path(),
            &format!(
                "echo $$ > {}\nprintf r >&5\nexec 5>&- 3>&- 4>&-\nexec /bin/sleep 600",
                pid_file.display()
            ),
        );
        let uri = format!("binary://{}", script.display());
        let stdio = Stdio::new("", &uri, &uri, true);
        let prepared = prepare(&stdio, "c1", 0, 0, Absent::DevNull).await.unwrap();
        // A terminal under binary:// is runc-v2's too: its output goes to the logger.
        assert!(prepared.console.as_ref().is_some_and(|c| c.log.is_some()));
        let pid: i32 = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        drop(prepared);
        // No reaper runs in this test: the logger is this process's child to wait for.
        let status = tokio::time::timeout(
            Duration::from_secs(10),
            tokio::task::spawn_blocking(move || {
                nix::sys::wait::waitpid(Pid::from_raw(pid), None).unwrap()
            }),
        )
        .await
        .expect("the logger was not terminated")
        .unwrap();
        assert!(
            matches!(
                status,
                nix::sys::wait::WaitStatus::Signaled(_, Signal::SIGTERM, _)
            ),
            "{status:?}"
        );
    }
}
