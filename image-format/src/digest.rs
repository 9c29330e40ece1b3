//! Hashing while data streams through: sha256 for archives and OCI blobs, [`FileHasher`] for the
//! per-file digests of a manifest, and a progress hook for long copies.

use std::io::{self, Read, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// Buffer size for streaming copies: large enough that syscalls are not the bottleneck.
pub const COPY_BUF: usize = 1 << 20;

/// Called with (bytes done, bytes expected in total, 0 if unknown) as a long operation advances.
pub type Progress<'a> = &'a mut dyn FnMut(u64, u64);

/// A progress hook that does nothing.
pub fn no_progress(_: u64, _: u64) {}

/// Lower-case hex sha256 of a byte slice.
pub fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// Size and digests of one file: at least one of the two (see [`FileHasher::recording`] for
/// which a checkpoint lists).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigest {
    pub size: u64,
    /// sha256, lower-case hex, no prefix. Empty (left out of the JSON) for CRIU's page images
    /// from schema version 2 on.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sha256: String,
    /// BLAKE3 (256 bits), lower-case hex, no prefix. When present, it is the digest gpu-ckpt
    /// verifies the file with. Empty in manifests from before it was recorded.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub blake3: String,
}

/// CRIU's page images, `pages-<n>.img`: the one kind of file a restore may read before its
/// digest is checked, because CRIU copies their bytes into the restored memory without parsing
/// them, at the places the (already verified) pagemap images say. The restored tasks must not
/// run until `manifest::DeferredDigests::verify` has passed.
pub fn is_page_image(name: &str) -> bool {
    name.strip_prefix("pages-")
        .and_then(|r| r.strip_suffix(".img"))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// A reader that hashes (and counts) everything read through it.
pub struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
    count: u64,
}

impl<R: Read> HashingReader<R> {
    pub fn new(inner: R) -> Self {
        HashingReader {
            inner,
            hasher: Sha256::new(),
            count: 0,
        }
    }

    /// Bytes read so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Finish: (hex sha256, byte count, inner reader).
    pub fn finish(self) -> (String, u64, R) {
        (hex::encode(self.hasher.finalize()), self.count, self.inner)
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }
}

/// Copy `r` to `w` while hashing; returns (hex sha256, bytes copied). Reports progress.
pub fn copy_hashing(
    r: &mut dyn Read,
    w: &mut dyn Write,
    total: u64,
    progress: Progress<'_>,
) -> io::Result<(String, u64)> {
    let mut hasher = Sha256::new();
    let done = stream(r, w, total, progress, &mut |b| hasher.update(b))?;
    Ok((hex::encode(hasher.finalize()), done))
}

/// Copy `r` to `w`, handing every chunk to `each` first; returns the bytes copied. Reports
/// progress.
fn stream(
    r: &mut dyn Read,
    w: &mut dyn Write,
    total: u64,
    progress: Progress<'_>,
    each: &mut dyn FnMut(&[u8]),
) -> io::Result<u64> {
    let mut buf = vec![0u8; COPY_BUF];
    let mut done = 0u64;
    loop {
        let n = match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        each(&buf[..n]);
        w.write_all(&buf[..n])?;
        done += n as u64;
        progress(done, total);
    }
    Ok(done)
}

/// Which digests a manifest records for CRIU's page images (every other file gets both).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PageDigests {
    /// BLAKE3 alone: fast enough to follow CRIU as it writes them.
    #[default]
    Blake3,
    /// sha256 as well, for readers that know only sha256. Costs checkpoint time: sha256 of
    /// 1 GiB takes longer than CRIU's dump of it on the development machine.
    Sha256AndBlake3,
}

/// Hashes one file's bytes for its manifest entry. Recording computes the digests the manifest
/// lists for the file (see [`FileHasher::recording`]); checking computes only the digest to
/// compare: BLAKE3 when the manifest entry has one, else sha256.
pub struct FileHasher {
    sha256: Option<Sha256>,
    blake3: Option<Box<blake3::Hasher>>,
    size: u64,
}

impl FileHasher {
    /// The digests a manifest lists for the file `name`. CRIU's page images (the bulk of a
    /// checkpoint, hashed while CRIU writes them) get what `pages` says, by default BLAKE3
    /// only: sha256 of 1 GiB takes longer than CRIU takes to dump it, BLAKE3 a third of that.
    /// Every other file gets both, so that a reader that knows only sha256 can still check the
    /// small images CRIU parses.
    pub fn recording(name: &str, pages: PageDigests) -> Self {
        let sha256 = pages == PageDigests::Sha256AndBlake3 || !is_page_image(name);
        FileHasher {
            sha256: sha256.then(Sha256::new),
            blake3: Some(Box::default()),
            size: 0,
        }
    }

    /// Both digests: for a file read before its manifest entry is known (an archive whose
    /// manifest comes later), which may list either.
    pub fn every() -> Self {
        FileHasher {
            sha256: Some(Sha256::new()),
            blake3: Some(Box::default()),
            size: 0,
        }
    }

    /// The one digest that verifies against `want`.
    pub fn checking(want: &FileDigest) -> Self {
        if want.blake3.is_empty() {
            Self::sha256()
        } else {
            FileHasher {
                sha256: None,
                blake3: Some(Box::default()),
                size: 0,
            }
        }
    }

    /// sha256 only: for [`hash_file`], and for archive members no manifest covers.
    pub fn sha256() -> Self {
        FileHasher {
            sha256: Some(Sha256::new()),
            blake3: None,
            size: 0,
        }
    }

    pub fn update(&mut self, data: &[u8]) {
        if let Some(h) = self.sha256.as_mut() {
            h.update(data);
        }
        if let Some(h) = self.blake3.as_mut() {
            h.update(data);
        }
        self.size += data.len() as u64;
    }

    /// Bytes hashed so far.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The digests computed (the others empty).
    pub fn finish(self) -> FileDigest {
        FileDigest {
            size: self.size,
            sha256: self
                .sha256
                .map(|h| hex::encode(h.finalize()))
                .unwrap_or_default(),
            blake3: self
                .blake3
                .map(|h| h.finalize().to_hex().to_string())
                .unwrap_or_default(),
        }
    }
}

/// Hash a whole file into `hasher`, streaming.
pub fn digest_file(
    path: &Path,
    mut hasher: FileHasher,
    progress: Progress<'_>,
) -> Result<FileDigest> {
    let mut f = std::fs::File::open(path).map_err(|e| Error::io("opening", path, e))?;
    let total = f.metadata().map(|m| m.len()).unwrap_or(0);
    stream(&mut f, &mut io::sink(), total, progress, &mut |b| {
        hasher.update(b)
    })
    .map_err(|e| Error::io("reading", path, e))?;
    Ok(hasher.finish())
}

/// Like [`digest_file`] on the open `file` (`path` names it), but stops between reads (every
/// [`COPY_BUF`] bytes) once `cancel` is set, with [`Error::Cancelled`] naming `name`.
///
/// For a file another reader takes next (a page image that CRIU restores from while it is
/// hashed, or right after): the kernel is asked to read [`READ_AHEAD`] bytes ahead of the hash
/// (`POSIX_FADV_WILLNEED`), and what is read stays in the page cache (no direct I/O, nothing
/// dropped), so the file comes from the disk once and the other reader finds it in memory.
pub fn digest_open_cancellable(
    file: std::fs::File,
    path: &Path,
    name: &str,
    mut hasher: FileHasher,
    cancel: &AtomicBool,
) -> Result<FileDigest> {
    struct Stoppable<'a> {
        inner: std::fs::File,
        cancel: &'a AtomicBool,
        /// Bytes read, and how far the kernel has been asked to read ahead.
        at: u64,
        advised: u64,
    }
    impl Read for Stoppable<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.cancel.load(Ordering::Relaxed) {
                return Err(io::Error::other(CANCELLED));
            }
            if self.at + READ_AHEAD / 2 >= self.advised {
                // Advice only: a failure changes nothing the hash relies on.
                advise(
                    &self.inner,
                    self.advised,
                    READ_AHEAD,
                    libc::POSIX_FADV_WILLNEED,
                );
                self.advised += READ_AHEAD;
            }
            let n = self.inner.read(buf)?;
            self.at += n as u64;
            Ok(n)
        }
    }
    const CANCELLED: &str = "verification cancelled";
    let total = file.metadata().map(|m| m.len()).unwrap_or(0);
    advise(&file, 0, 0, libc::POSIX_FADV_SEQUENTIAL);
    let mut r = Stoppable {
        inner: file,
        cancel,
        at: 0,
        advised: 0,
    };
    match stream(&mut r, &mut io::sink(), total, &mut no_progress, &mut |b| {
        hasher.update(b)
    }) {
        Ok(_) => Ok(hasher.finish()),
        Err(_) if cancel.load(Ordering::Relaxed) => Err(Error::Cancelled {
            name: name.to_string(),
        }),
        Err(e) => Err(Error::io("reading", path, e)),
    }
}

/// How far [`digest_open_cancellable`] has the kernel read ahead of the hash.
pub const READ_AHEAD: u64 = 64 << 20;

/// `posix_fadvise` of `len` bytes from `offset` (0: to the end); the result is ignored.
fn advise(file: &std::fs::File, offset: u64, len: u64, advice: libc::c_int) {
    use std::os::fd::AsRawFd;
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return;
    };
    // SAFETY: a valid open descriptor and plain integers; advice never changes the file.
    unsafe {
        libc::posix_fadvise(file.as_raw_fd(), offset, len, advice);
    }
}

/// Hash a whole file, streaming. Returns (hex sha256, size).
pub fn hash_file(path: &Path, progress: Progress<'_>) -> Result<(String, u64)> {
    digest_file(path, FileHasher::sha256(), progress).map(|d| (d.sha256, d.size))
}
