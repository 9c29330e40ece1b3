//! The writer: one record, one line, one `write(2)`, under the lock.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

use crate::record::encode;
use crate::{
    fsutil, Error, Record, Result, CURRENT_FILE, LOCK_WAIT, MIN_SEGMENT_BYTES, PREVIOUS_FILE,
};

/// The journal of a node, for appending. Cheap to keep: it holds the directory's descriptor;
/// each [`append`](Journal::append) opens the current file anew (a lock per open file, so that
/// threads of one process exclude each other as processes do).
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    dirfd: File,
    segment_bytes: u64,
    lock_wait: Duration,
}

impl Journal {
    /// The journal in `dir` (made 0700 when missing, its parents 0755), segments of
    /// `segment_bytes` (at least [`MIN_SEGMENT_BYTES`]): the journal holds at most twice that.
    /// A `dir` that is a symbolic link, not a directory, or owned by another user is refused.
    pub fn open(dir: &Path, segment_bytes: u64) -> Result<Journal> {
        let dirfd = fsutil::open_dir(dir, true)?.ok_or_else(|| Error::NotA {
            path: dir.into(),
            want: "directory",
        })?;
        Ok(Journal {
            dir: dir.to_path_buf(),
            dirfd,
            segment_bytes: segment_bytes.max(MIN_SEGMENT_BYTES),
            lock_wait: LOCK_WAIT,
        })
    }

    /// The same journal, waiting at most `wait` for the lock (default [`LOCK_WAIT`]).
    pub fn with_lock_wait(mut self, wait: Duration) -> Journal {
        self.lock_wait = wait;
        self
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The segment size in effect (the bound is twice it).
    pub fn segment_bytes(&self) -> u64 {
        self.segment_bytes
    }

    /// Appends `rec` (its `crc` computed; its message and steps capped) as one line, synced.
    /// Under the lock: a torn last line is ended first; a full segment is rotated. When the
    /// lock is not free within the wait, the record is dropped ([`Error::LockTimeout`], logged).
    pub fn append(&self, rec: &Record) -> Result<()> {
        let line = encode(rec)?;
        let span = tracing::debug_span!("journal_append", id = %rec.id, bytes = line.len());
        let _g = span.enter();
        let path = self.dir.join(CURRENT_FILE);
        let deadline = Instant::now() + self.lock_wait;
        // Each turn ends in the line written, or another try after a rotation or after the
        // current file was replaced under us (by another writer's rotation).
        for _ in 0..64 {
            let f = fsutil::open_append(&self.dirfd, &self.dir, CURRENT_FILE)?;
            let f = match lock(f, deadline) {
                Ok(f) => f,
                Err(Errno::EWOULDBLOCK) => {
                    tracing::warn!(path = %path.display(), waited = ?self.lock_wait, id = %rec.id,
                        "the journal's lock was not free in time: record dropped");
                    return Err(Error::LockTimeout {
                        path,
                        waited: self.lock_wait,
                    });
                }
                Err(e) => return Err(Error::io("locking", &path, e)),
            };
            let id = fsutil::id_of(&f, &path)?;
            if fsutil::id_at(&self.dirfd, &self.dir, CURRENT_FILE)? != Some(id) {
                continue;
            }
            let size = f
                .metadata()
                .map_err(|e| Error::io("reading", &path, e))?
                .len();
            // A writer killed mid-write left a line without its end: end it, so that it stays
            // a line of its own (which readers skip) and ours is whole.
            let mut last = [0u8; 1];
            let torn = size > 0 && {
                f.read_exact_at(&mut last, size - 1)
                    .map_err(|e| Error::io("reading", &path, e))?;
                last[0] != b'\n'
            };
            let need = size + u64::from(torn) + line.len() as u64;
            if size > 0 && need > self.segment_bytes {
                self.rotate(&path)?;
                continue;
            }
            let mut buf = Vec::with_capacity(line.len() + 1);
            if torn {
                tracing::info!(path = %path.display(), "ending a torn last line");
                buf.push(b'\n');
            }
            buf.extend_from_slice(&line);
            write_all(&f, &buf).map_err(|e| Error::io("writing", &path, e))?;
            nix::unistd::fdatasync(&*f).map_err(|e| Error::io("syncing", &path, e))?;
            if size == 0 {
                // A new file: its name too.
                nix::unistd::fsync(&self.dirfd).map_err(|e| Error::io("syncing", &self.dir, e))?;
            }
            return Ok(());
        }
        Err(Error::Unstable { path })
    }

    /// The current file becomes the previous one (replacing it); the next open makes a new one.
    fn rotate(&self, path: &Path) -> Result<()> {
        tracing::debug!(path = %path.display(), "rotating the journal");
        nix::fcntl::renameat(&self.dirfd, CURRENT_FILE, &self.dirfd, PREVIOUS_FILE)
            .map_err(|e| Error::io("rotating", path, e))?;
        nix::unistd::fsync(&self.dirfd).map_err(|e| Error::io("syncing", &self.dir, e))
    }
}

/// `f` locked exclusively, waiting until `deadline` at most (`EWOULDBLOCK` past it).
fn lock(mut f: File, deadline: Instant) -> std::result::Result<Flock<File>, Errno> {
    loop {
        match Flock::lock(f, FlockArg::LockExclusiveNonblock) {
            Ok(l) => return Ok(l),
            Err((back, Errno::EWOULDBLOCK)) | Err((back, Errno::EINTR)) => {
                let now = Instant::now();
                if now >= deadline {
                    return Err(Errno::EWOULDBLOCK);
                }
                std::thread::sleep((deadline - now).min(Duration::from_millis(2)));
                f = back;
            }
            Err((_, e)) => return Err(e),
        }
    }
}

/// One `write(2)` of `buf`; only a short write (a full disk, a signal) takes another.
fn write_all(mut f: &File, buf: &[u8]) -> std::io::Result<()> {
    f.write_all(buf)
}
