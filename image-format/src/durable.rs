//! Crash safety: the one place where checkpoint writers make their files durable.
//!
//! A checkpoint is complete when its manifest is there. For that to survive a power cut, every
//! file the manifest lists must reach the disk before the manifest does, the manifest must
//! appear whole or not at all, and the directory entry that names it must reach the disk too:
//!
//! 1. every listed file is synced (`fsync`);
//! 2. the manifest is written to a temp file beside it, synced, and renamed into place;
//! 3. the directory is synced, which makes the rename durable.
//!
//! A single file written atomically (an archive, an OCI tarball) follows steps 2 and 3.
//! Every writer goes through [`SyncFs`], so a test can record the order of the syncs and the
//! rename ([`Recording`]) while the real file system does the work.
//!
//! Step 1 costs the disk's time to take the files. A writer that follows a file as another
//! process appends to it (the page images during a CRIU dump) can start the writeback of what
//! is final meanwhile ([`Writeback`], `sync_file_range(SYNC_FILE_RANGE_WRITE)`), so that step 1
//! finds little left to write. That only starts I/O: it makes nothing durable, and step 1 still
//! syncs every listed file.

use std::fs;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{Error, Result};

/// Whether a writer syncs what it writes. `Sync` is the default: only a caller that knows
/// another component copies the files durably (containerd's content store) may skip it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Durability {
    /// Files synced before the file that declares them complete, and the directory after.
    #[default]
    Sync,
    /// No syncs: the rename still makes the write atomic, but a power cut may lose it.
    None,
}

impl Durability {
    /// `Sync` when `sync` is true.
    pub fn from_flag(sync: bool) -> Durability {
        if sync {
            Durability::Sync
        } else {
            Durability::None
        }
    }

    pub fn syncs(self) -> bool {
        self == Durability::Sync
    }
}

/// The three operations crash safety orders: sync a file, rename, sync a directory.
pub trait SyncFs: Sync {
    /// Flush the file's data and metadata to the disk.
    fn sync_file(&self, path: &Path) -> std::io::Result<()>;
    /// [`SyncFs::sync_file`] for a file the writer holds open (`path` names it).
    fn sync_open(&self, file: &fs::File, path: &Path) -> std::io::Result<()>;
    /// Replace `to` by `from` atomically.
    fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()>;
    /// Flush the directory's entries to the disk (a rename or a new file in it).
    fn sync_dir(&self, path: &Path) -> std::io::Result<()>;
    /// Start writing the dirty pages of `file` (`path` names it) in `at..at + len` to
    /// the disk, without waiting for them: a later sync of the file has that much less to do.
    /// No substitute for [`SyncFs::sync_file`]: it flushes no metadata and waits for nothing.
    fn start_writeback(&self, file: &fs::File, path: &Path, at: u64, len: u64) -> io::Result<()>;
}

/// The real file system.
#[derive(Clone, Copy, Debug, Default)]
pub struct RealFs;

impl SyncFs for RealFs {
    fn sync_file(&self, path: &Path) -> std::io::Result<()> {
        // Opened for reading: fsync flushes the inode's dirty pages whoever wrote them.
        fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)?
            .sync_all()
    }

    fn sync_open(&self, file: &fs::File, _path: &Path) -> std::io::Result<()> {
        file.sync_all()
    }

    fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        fs::rename(from, to)
    }

    fn sync_dir(&self, path: &Path) -> std::io::Result<()> {
        fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)?
            .sync_all()
    }

    fn start_writeback(&self, file: &fs::File, _: &Path, at: u64, len: u64) -> io::Result<()> {
        let (Ok(offset), Ok(len)) = (i64::try_from(at), i64::try_from(len)) else {
            return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
        };
        // SAFETY: a valid open descriptor and plain integers. SYNC_FILE_RANGE_WRITE alone
        // submits the range's dirty pages for writeback and returns; any descriptor of the
        // file will do, a read-only one included.
        let rc = unsafe {
            libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE)
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
}

/// One operation seen by [`Recording`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    SyncFile(PathBuf),
    Rename(PathBuf, PathBuf),
    SyncDir(PathBuf),
    /// [`SyncFs::start_writeback`] of (offset, length).
    StartWriteback(PathBuf, u64, u64),
}

/// A [`SyncFs`] that does the real work and records each operation in order (for tests).
#[derive(Debug, Default)]
pub struct Recording {
    ops: Mutex<Vec<Op>>,
}

impl Recording {
    /// The operations so far, in order.
    pub fn ops(&self) -> Vec<Op> {
        self.ops.lock().map(|o| o.clone()).unwrap_or_default()
    }

    fn push(&self, op: Op) {
        if let Ok(mut o) = self.ops.lock() {
            o.push(op);
        }
    }
}

impl SyncFs for Recording {
    fn sync_file(&self, path: &Path) -> std::io::Result<()> {
        RealFs.sync_file(path)?;
        self.push(Op::SyncFile(path.to_path_buf()));
        Ok(())
    }

    fn sync_open(&self, file: &fs::File, path: &Path) -> std::io::Result<()> {
        RealFs.sync_open(file, path)?;
        self.push(Op::SyncFile(path.to_path_buf()));
        Ok(())
    }

    fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        RealFs.rename(from, to)?;
        self.push(Op::Rename(from.to_path_buf(), to.to_path_buf()));
        Ok(())
    }

    fn sync_dir(&self, path: &Path) -> std::io::Result<()> {
        RealFs.sync_dir(path)?;
        self.push(Op::SyncDir(path.to_path_buf()));
        Ok(())
    }

    fn start_writeback(&self, file: &fs::File, path: &Path, at: u64, len: u64) -> io::Result<()> {
        RealFs.start_writeback(file, path, at, len)?;
        self.push(Op::StartWriteback(path.to_path_buf(), at, len));
        Ok(())
    }
}

/// The writeback started behind a writer that appends to one file (see the module doc): each
/// time the bytes known final reach [`Writeback::STEP`] past what was started, their writeback
/// starts, in whole pages, so that a page the writer may still append to is written once.
#[derive(Debug, Default)]
pub struct Writeback {
    /// Bytes whose writeback has been started, from the file's start.
    started: u64,
}

impl Writeback {
    /// How far the final bytes run ahead before their writeback starts: large enough that the
    /// calls cost nothing next to the copy, small enough that the disk starts early.
    pub const STEP: u64 = 8 << 20;
    /// Ranges end on this boundary (the page size) but the last.
    const PAGE: u64 = 4096;

    /// The file's first `len` bytes will not change (`done`: the writer is done with it):
    /// starts the writeback of those not yet started once they make a [`Writeback::STEP`] of
    /// whole pages, or of all of them when `done`.
    pub fn advance(
        &mut self,
        fs: &dyn SyncFs,
        file: &fs::File,
        path: &Path,
        len: u64,
        done: bool,
    ) -> io::Result<()> {
        let (end, due) = if done {
            (len, len > self.started)
        } else {
            let end = len & !(Self::PAGE - 1);
            (end, end >= self.started + Self::STEP)
        };
        if due {
            fs.start_writeback(file, path, self.started, end - self.started)?;
            self.started = end;
        }
        Ok(())
    }

    /// Bytes whose writeback has been started.
    pub fn started(&self) -> u64 {
        self.started
    }
}

/// The directory a path lies in (`.` for a bare name).
pub fn parent_dir(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Sync each of `names` in `dir` (step 1), in order. The error names the file.
pub fn sync_files<'a>(
    fs: &dyn SyncFs,
    dir: &Path,
    names: impl IntoIterator<Item = &'a str>,
    durability: Durability,
) -> Result<()> {
    if !durability.syncs() {
        return Ok(());
    }
    let _span = tracing::debug_span!("sync_files", dir = %dir.display()).entered();
    for name in names {
        let path = dir.join(name);
        fs.sync_file(&path)
            .map_err(|e| Error::io("syncing checkpoint file", &path, e))?;
    }
    Ok(())
}

/// Steps 2 and 3 for the written temp file `tmp` (open as `file`): sync it, close it, rename it
/// to `out`, sync `out`'s directory. The caller removes `tmp` on error.
pub fn commit(
    fs: &dyn SyncFs,
    file: fs::File,
    tmp: &Path,
    out: &Path,
    durability: Durability,
) -> Result<()> {
    if durability.syncs() {
        fs.sync_open(&file, tmp)
            .map_err(|e| Error::io("syncing", tmp, e))?;
    }
    drop(file);
    fs.rename(tmp, out)
        .map_err(|e| Error::io("renaming into place", out, e))?;
    if durability.syncs() {
        let dir = parent_dir(out);
        fs.sync_dir(dir)
            .map_err(|e| Error::io("syncing directory", dir, e))?;
    }
    Ok(())
}

/// The temp file name beside `out` that [`write_atomically`] and [`write_bytes`] use.
pub fn temp_path(out: &Path) -> PathBuf {
    parent_dir(out).join(format!(
        ".{}.tmp-{}",
        out.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default(),
        std::process::id()
    ))
}

/// Writes `out` atomically and root-only (mode 0600): `body` fills a buffered temp file beside
/// it (and may seek in it), which is then committed ([`commit`]). On any error the temp file
/// is removed and `out` is untouched.
pub fn write_atomically<T>(
    fs: &dyn SyncFs,
    out: &Path,
    durability: Durability,
    body: impl FnOnce(&mut std::io::BufWriter<fs::File>, &Path) -> Result<T>,
) -> Result<T> {
    let tmp = temp_path(out);
    let res = (|| {
        let f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)
            .map_err(|e| Error::io("creating", &tmp, e))?;
        let mut w = std::io::BufWriter::with_capacity(crate::digest::COPY_BUF, f);
        let value = body(&mut w, &tmp)?;
        let f = w
            .into_inner()
            .map_err(|e| Error::io("writing", &tmp, e.into_error()))?;
        commit(fs, f, &tmp, out, durability)?;
        Ok(value)
    })();
    if res.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    res
}

/// [`write_atomically`] for a byte string.
pub fn write_bytes(fs: &dyn SyncFs, out: &Path, data: &[u8], durability: Durability) -> Result<()> {
    write_atomically(fs, out, durability, |w, tmp| {
        w.write_all(data).map_err(|e| Error::io("writing", tmp, e))
    })
}

/// Steps 1 to 3 for a directory whose `index` file (a manifest) lists `names`: every listed
/// file synced, then `index` written atomically with `data`, then the directory synced.
pub fn write_index<'a>(
    fs: &dyn SyncFs,
    dir: &Path,
    names: impl IntoIterator<Item = &'a str>,
    index: &str,
    data: &[u8],
    durability: Durability,
) -> Result<()> {
    let _span = tracing::info_span!(
        "durable_write",
        dir = %dir.display(),
        index,
        sync = durability.syncs()
    )
    .entered();
    sync_files(fs, dir, names, durability)?;
    write_bytes(fs, &dir.join(index), data, durability)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listed_files_are_synced_before_the_index_and_the_directory_after() {
        let d = tempfile::tempdir().unwrap();
        for n in ["a.img", "pages-1.img"] {
            fs::write(d.path().join(n), n).unwrap();
        }
        let rec = Recording::default();
        write_index(
            &rec,
            d.path(),
            ["a.img", "pages-1.img"],
            "index.json",
            b"{}",
            Durability::Sync,
        )
        .unwrap();
        let tmp = temp_path(&d.path().join("index.json"));
        assert_eq!(
            rec.ops(),
            vec![
                Op::SyncFile(d.path().join("a.img")),
                Op::SyncFile(d.path().join("pages-1.img")),
                Op::SyncFile(tmp.clone()),
                Op::Rename(tmp.clone(), d.path().join("index.json")),
                Op::SyncDir(d.path().to_path_buf()),
            ]
        );
        assert!(!tmp.exists());
        assert_eq!(fs::read(d.path().join("index.json")).unwrap(), b"{}");
    }

    #[test]
    fn writeback_starts_in_whole_pages_every_step_and_the_rest_at_the_end() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("pages-1.img");
        let step = Writeback::STEP;
        // Dirty pages for the kernel to write: a page-cache file written through.
        fs::write(&path, vec![7u8; (2 * step + 9096) as usize]).unwrap();
        let file = fs::File::open(&path).unwrap();
        let rec = Recording::default();
        let mut wb = Writeback::default();
        // Less than a step: nothing yet.
        wb.advance(&rec, &file, &path, step - 1, false).unwrap();
        assert!(rec.ops().is_empty());
        // A step and a bit more: the whole pages of it.
        wb.advance(&rec, &file, &path, step + 4096 + 100, false)
            .unwrap();
        // Not a step further: nothing.
        wb.advance(&rec, &file, &path, 2 * step, false).unwrap();
        wb.advance(&rec, &file, &path, 2 * step + 4096 + 5000, false)
            .unwrap();
        // The end: the rest, partial page included.
        wb.advance(&rec, &file, &path, 2 * step + 9096, true)
            .unwrap();
        wb.advance(&rec, &file, &path, 2 * step + 9096, true)
            .unwrap();
        assert_eq!(
            rec.ops(),
            vec![
                Op::StartWriteback(path.clone(), 0, step + 4096),
                Op::StartWriteback(path.clone(), step + 4096, step + 4096),
                Op::StartWriteback(path.clone(), 2 * step + 8192, 904),
            ]
        );
        assert_eq!(wb.started(), 2 * step + 9096);
    }

    #[test]
    fn writeback_works_through_a_read_only_descriptor() {
        // The real call, on a descriptor opened for reading as the follower opens it.
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("pages-2.img");
        fs::write(&path, vec![1u8; 1 << 20]).unwrap();
        let file = fs::File::open(&path).unwrap();
        RealFs.start_writeback(&file, &path, 0, 1 << 20).unwrap();
        // A range past the end is no error either.
        RealFs.start_writeback(&file, &path, 1 << 30, 4096).unwrap();
        // What the kernel reports for an offset it cannot take.
        assert!(RealFs.start_writeback(&file, &path, u64::MAX, 1).is_err());
    }

    #[test]
    fn without_syncs_only_the_rename_remains() {
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join("a.img"), "a").unwrap();
        let rec = Recording::default();
        write_index(&rec, d.path(), ["a.img"], "i", b"x", Durability::None).unwrap();
        let ops = rec.ops();
        assert_eq!(ops.len(), 1, "{ops:?}");
        assert!(matches!(&ops[0], Op::Rename(_, to) if to == &d.path().join("i")));
    }

    #[test]
    fn a_missing_listed_file_fails_naming_it_and_writes_no_index() {
        let d = tempfile::tempdir().unwrap();
        let err = write_index(&RealFs, d.path(), ["gone.img"], "i", b"x", Durability::Sync)
            .unwrap_err()
            .to_string();
        assert!(err.contains("gone.img"), "{err}");
        assert!(!d.path().join("i").exists());
    }

    #[test]
    fn a_failed_body_leaves_no_temp_file_and_no_output() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("x.tar");
        let r: Result<()> = write_atomically(&RealFs, &out, Durability::Sync, |_, tmp| {
            Err(Error::io(
                "writing",
                tmp,
                std::io::Error::other("disk full"),
            ))
        });
        assert!(r.is_err());
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 0);
    }
}
