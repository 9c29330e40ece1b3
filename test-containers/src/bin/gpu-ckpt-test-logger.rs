//! `gpu-ckpt-test-logger --out PATH`: a logging binary for containerd's `binary://` log URIs,
//! as the tests use it (`binary:///path/to/gpu-ckpt-test-logger?--out=/path/to/log`).
//!
//! It follows containerd's logging convention (`core/runtime/v2/logging`): the container's
//! stdout on fd 3, its stderr on fd 4, and fd 5 to signal ready on (one byte written, then
//! closed); `CONTAINER_ID` and `CONTAINER_NAMESPACE` in the environment. Each line it reads is
//! appended to PATH as `<namespace>/<id> <stream>: <line>`; it notes its start
//! (`<namespace>/<id> started <pid>`) and each stream's end (`<namespace>/<id> <stream> closed`),
//! and exits once both streams are at end of file. SIGTERM (the shim's at delete) is ignored:
//! like containerd's example journal logger, it drains both streams to their end.

use std::{
    fs::File,
    io::{BufRead, BufReader, Write},
    os::fd::{FromRawFd, OwnedFd, RawFd},
    path::PathBuf,
    sync::{Arc, Mutex},
};

use anyhow::{bail, Context, Result};

const USAGE: &str = "gpu-ckpt-test-logger --out PATH";

fn main() {
    if let Err(e) = run() {
        eprintln!("gpu-ckpt-test-logger: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let mut args = std::env::args_os().skip(1);
    let out = match (args.next(), args.next(), args.next()) {
        (Some(flag), Some(path), None) if flag == "--out" => PathBuf::from(path),
        _ => bail!("usage: {USAGE}"),
    };
    let who = format!(
        "{}/{}",
        std::env::var("CONTAINER_NAMESPACE").unwrap_or_default(),
        std::env::var("CONTAINER_ID").unwrap_or_default()
    );
    // SAFETY: setting a signal's disposition to "ignore" runs no code of ours.
    unsafe { libc::signal(libc::SIGTERM, libc::SIG_IGN) };
    let stdout = inherited(3, "CONTAINER_STDOUT")?;
    let stderr = inherited(4, "CONTAINER_STDERR")?;
    let wait = inherited(5, "CONTAINER_WAIT")?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&out)
        .with_context(|| format!("open {}", out.display()))?;
    let log = Arc::new(Mutex::new(log));
    write_line(&log, &format!("{who} started {}", std::process::id()))?;

    let copies: Vec<_> = [("stdout", stdout), ("stderr", stderr)]
        .into_iter()
        .map(|(stream, fd)| {
            let log = log.clone();
            let who = who.clone();
            std::thread::spawn(move || copy_lines(&who, stream, fd, &log))
        })
        .collect();
    // Ready: a byte, then the descriptor closed (what binary-v2 requires; binary takes either).
    File::from(wait)
        .write_all(&[0])
        .context("signal ready on fd 5")?;

    for copy in copies {
        match copy.join() {
            Ok(result) => result?,
            Err(_) => bail!("a copy thread panicked"),
        }
    }
    Ok(())
}

/// Descriptor `fd`, which the shim must have passed.
fn inherited(fd: RawFd, name: &str) -> Result<OwnedFd> {
    // SAFETY: F_GETFD only asks whether the descriptor is open.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        bail!("fd {fd} ({name}) is not open: start me as containerd's logging binary");
    }
    // SAFETY: the descriptor is open, inherited for this process, and owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Appends each line of `fd` to the log, then notes the stream's end.
fn copy_lines(who: &str, stream: &str, fd: OwnedFd, log: &Mutex<File>) -> Result<()> {
    for line in BufReader::new(File::from(fd)).split(b'\n') {
        let line = line.with_context(|| format!("read {stream}"))?;
        write_line(
            log,
            &format!("{who} {stream}: {}", String::from_utf8_lossy(&line)),
        )?;
    }
    write_line(log, &format!("{who} {stream} closed"))
}

/// One line, in one write, so lines of the two streams never interleave.
fn write_line(log: &Mutex<File>, line: &str) -> Result<()> {
    let mut file = log.lock().unwrap_or_else(|p| p.into_inner());
    file.write_all(format!("{line}\n").as_bytes())
        .context("write the log")
}
