//! A process's stdio: pipes the shim owns between the container and containerd's fifos, or a
//! terminal whose master runc sends over a console socket.

use std::{
    fs::File,
    os::{
        fd::{AsRawFd, OwnedFd},
        unix::net::UnixListener as StdUnixListener,
    },
    path::{Path, PathBuf},
    time::Duration,
};

use containerd_shim::asynchronous::io::{IoTasks, Pty, Stdio};
use nix::{
    sys::socket::{recvmsg, ControlMessageOwned, MsgFlags},
    unistd::{fchown, pipe2, Gid, Uid},
};
use tokio::net::{unix::pipe, UnixListener};

use crate::{
    error::{Error, Result},
    runc::ChildIo,
};

/// How long runc may take to send a terminal's master after it started.
const CONSOLE_TIMEOUT: Duration = Duration::from_secs(10);

/// The live IO of a process: the copy tasks, and its terminal if it has one.
#[derive(Clone, Default)]
pub struct ProcessIo {
    pub tasks: IoTasks,
    pub pty: Option<Pty>,
}

/// IO being prepared for a runc create or exec.
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

/// Connects `stdio` for a process about to be created. Output copies start at once and stay
/// parked until the process writes; input copies start when containerd opens the fifo.
/// Streams without a fifo get what `absent` says.
pub fn prepare(stdio: &Stdio, io_uid: u32, io_gid: u32, absent: Absent) -> Result<PreparedIo> {
    let io = ProcessIo::default();
    if stdio.terminal {
        if log_file(&stdio.stdout)?.is_some() {
            return Err(Error::InvalidArgument(
                "a terminal cannot write to a file:// log URI".into(),
            ));
        }
        return Ok(PreparedIo {
            child: ChildIo::PassThrough {
                stdin: None,
                stdout: None,
                stderr: None,
            },
            console: Some(ConsoleSocket::new()?),
            io,
        });
    }
    let owner = |fd: &OwnedFd| -> Result<()> {
        if io_uid != 0 || io_gid != 0 {
            fchown(fd, Some(Uid::from_raw(io_uid)), Some(Gid::from_raw(io_gid)))
                .map_err(|e| Error::io("chown stdio pipe")(e.into()))?;
        }
        Ok(())
    };
    let stdin = if stdio.stdin.is_empty() {
        match absent {
            Absent::DevNull => None,
            Absent::Pipe => {
                // The write end closes here: the process reads end of file.
                let (r, _) = new_pipe()?;
                owner(&r)?;
                Some(r)
            }
        }
    } else {
        let (r, w) = new_pipe()?;
        owner(&r)?;
        let sender = pipe::Sender::from_owned_fd(w).map_err(Error::io("stdin pipe"))?;
        io.tasks.copy_from_fifo(&stdio.stdin, sender)?;
        Some(r)
    };
    let output = |path: &str| -> Result<Option<OwnedFd>> {
        if path.is_empty() {
            return match absent {
                Absent::DevNull => Ok(None),
                Absent::Pipe => {
                    let (r, w) = new_pipe()?;
                    owner(&w)?;
                    discard(r)?;
                    Ok(Some(w))
                }
            };
        }
        if let Some(file) = log_file(path)? {
            // A file:// log URI: the process writes to the file itself, as with runc-v2.
            owner(&file)?;
            return Ok(Some(file));
        }
        let (r, w) = new_pipe()?;
        owner(&w)?;
        let receiver = pipe::Receiver::from_owned_fd(r).map_err(Error::io("output pipe"))?;
        io.tasks.copy_to_fifo(receiver, path)?;
        Ok(Some(w))
    };
    let stdout = output(&stdio.stdout)?;
    let stderr = output(&stdio.stderr)?;
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

/// Opens the file a `file://` log URI names (created, appended to). `None` for a fifo path.
fn log_file(uri: &str) -> Result<Option<OwnedFd>> {
    let Some((scheme, rest)) = uri.split_once("://") else {
        return Ok(None);
    };
    match scheme {
        "file" => {
            use std::os::unix::fs::OpenOptionsExt;
            let path = Path::new(rest);
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)
                    .map_err(Error::io(format!("create log directory {}", dir.display())))?;
            }
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o640)
                .open(path)
                .map_err(Error::io(format!("open log file {}", path.display())))?;
            Ok(Some(file.into()))
        }
        "fifo" => Ok(None),
        other => Err(Error::InvalidArgument(format!(
            "unsupported stdio URI scheme {other:?} in {uri:?}: use a fifo path or file://"
        ))),
    }
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
}

impl ConsoleSocket {
    fn new() -> Result<Self> {
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
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Receives the terminal master runc sends, and connects it to the fifos of `stdio`.
    pub async fn receive(self, stdio: &Stdio, io: &mut ProcessIo) -> Result<()> {
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
        if !stdio.stdout.is_empty() {
            io.tasks.copy_to_fifo(pty.clone(), &stdio.stdout)?;
        }
        io.pty = Some(pty);
        Ok(())
    }
}

fn receive_fd(stream: &std::os::unix::net::UnixStream) -> Result<OwnedFd> {
    use std::os::fd::FromRawFd;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn absent_streams_at_restore_are_pipes_at_eof_and_drained() {
        use std::io::{Read, Write};
        let none = Stdio::new("", "", "", false);
        let streams = |absent| match prepare(&none, 0, 0, absent).unwrap().child {
            ChildIo::PassThrough {
                stdin,
                stdout,
                stderr,
            } => [stdin, stdout, stderr],
            ChildIo::Captured => panic!("no pass-through io"),
        };
        assert!(streams(Absent::DevNull).iter().all(Option::is_none));

        let [stdin, stdout, stderr] = streams(Absent::Pipe);
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
    fn file_uris_open_the_file_and_others_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("logs/c1.log");
        let uri = format!("file://{}", path.display());
        assert!(log_file(&uri).unwrap().is_some());
        assert!(path.exists());
        assert!(log_file("/run/containerd/fifo/1/c1-stdout")
            .unwrap()
            .is_none());
        let err = log_file("binary:///usr/bin/logger?x=1")
            .unwrap_err()
            .to_string();
        assert!(err.contains("binary"), "{err}");
    }
}
