//! Safe reading of untrusted tar streams: every header is checked before anything is written, names
//! are normalized, and files are created below an open directory handle with `openat` and
//! `O_NOFOLLOW`, so no symlink (planted by the archive or by someone racing us) is ever followed.

use std::collections::HashSet;
use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use crate::error::{Error, Result};

/// Limits against size bombs. A header that declares more than these is refused before its data is
/// read.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest single entry, in bytes.
    pub max_entry_bytes: u64,
    /// Largest sum of all entries, in bytes.
    pub max_total_bytes: u64,
    /// Most entries.
    pub max_entries: u64,
}

impl Default for Limits {
    /// 1 TiB per entry and in total, one million entries: far above any real checkpoint (GPU memory of
    /// a full 8-GPU node is under 2 TiB only on the largest machines; raise it there).
    fn default() -> Self {
        Limits {
            max_entry_bytes: 1 << 40,
            max_total_bytes: 1 << 40,
            max_entries: 1_000_000,
        }
    }
}

/// What an entry is, once it has passed the checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryKind {
    File,
    Dir,
    /// Target as written in the archive (relative, checked to stay inside).
    Symlink(String),
    /// Normalized path of an earlier regular file.
    Hardlink(String),
}

/// One checked entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryInfo {
    /// Normalized path: relative, '/'-separated, no "." or ".." components, no trailing '/'.
    pub path: String,
    pub kind: EntryKind,
    /// Data bytes (0 for everything but files).
    pub size: u64,
    pub mode: u32,
}

/// Running state of the checks over one archive.
#[derive(Debug, Default)]
pub struct Checker {
    limits: Limits,
    seen: HashSet<String>,
    dirs: HashSet<String>,
    files: HashSet<String>,
    symlinks: HashSet<String>,
    total: u64,
    count: u64,
}

/// Normalize an entry name: refuse absolute paths, `..`, NUL and non-UTF-8; drop "." components and
/// a trailing '/'. Returns "" for the root itself ("./").
pub fn normalize_name(raw: &[u8]) -> Result<String> {
    let lossy = String::from_utf8_lossy(raw).into_owned();
    let s = std::str::from_utf8(raw).map_err(|_| Error::InvalidName {
        entry: lossy.clone(),
        reason: "not utf-8",
    })?;
    if s.contains('\0') {
        return Err(Error::InvalidName {
            entry: lossy,
            reason: "contains NUL",
        });
    }
    if s.is_empty() {
        return Err(Error::InvalidName {
            entry: lossy,
            reason: "empty",
        });
    }
    if s.starts_with('/') {
        return Err(Error::AbsolutePath { entry: lossy });
    }
    let mut parts = Vec::new();
    for c in s.split('/') {
        match c {
            "" | "." => {}
            ".." => return Err(Error::PathTraversal { entry: lossy }),
            c => parts.push(c),
        }
    }
    Ok(parts.join("/"))
}

fn parent_of(path: &str) -> &str {
    path.rfind('/').map(|i| &path[..i]).unwrap_or("")
}

/// Every entry of a tar stream, each checked by one [`Checker`] before `each` sees it (with the
/// entry, to read its data, and what the check found); the archive root ("./") is skipped. A
/// stream that cannot be read names the last entry that could.
pub fn for_each_checked<'a, R: io::Read + 'a>(
    entries: tar::Entries<'a, R>,
    limits: Limits,
    mut each: impl FnMut(&mut tar::Entry<'a, R>, EntryInfo) -> Result<()>,
) -> Result<()> {
    let mut checker = Checker::new(limits);
    let mut last: Option<String> = None;
    for ent in entries {
        let mut ent = ent.map_err(|source| Error::Tar {
            entry: last.clone(),
            source,
        })?;
        let Some(e) = checker.check(&ent)? else {
            continue;
        };
        last = Some(e.path.clone());
        each(&mut ent, e)?;
    }
    Ok(())
}

impl Checker {
    pub fn new(limits: Limits) -> Self {
        Checker {
            limits,
            ..Default::default()
        }
    }

    /// Check one header. `Ok(None)` means the entry is the archive root ("./") and can be ignored.
    pub fn check<R: io::Read>(&mut self, entry: &tar::Entry<'_, R>) -> Result<Option<EntryInfo>> {
        let raw = entry.path_bytes();
        let display = String::from_utf8_lossy(&raw).into_owned();
        let path = normalize_name(&raw)?;
        let header = entry.header();
        let et = header.entry_type();
        self.count += 1;
        if self.count > self.limits.max_entries {
            return Err(Error::TooManyEntries {
                entry: display,
                limit: self.limits.max_entries,
            });
        }
        let forbidden = |kind: &'static str| Error::ForbiddenType {
            entry: display.clone(),
            kind,
        };
        let kind = match et {
            tar::EntryType::Regular => EntryKind::File,
            tar::EntryType::Directory => EntryKind::Dir,
            tar::EntryType::Symlink => {
                let target = link_name(entry, &display)?;
                if !symlink_target_stays_inside(&path, &target) {
                    return Err(Error::SymlinkEscape {
                        entry: display,
                        target,
                    });
                }
                EntryKind::Symlink(target)
            }
            tar::EntryType::Link => {
                let target = link_name(entry, &display)?;
                let norm =
                    normalize_name(target.as_bytes()).map_err(|_| Error::HardlinkEscape {
                        entry: display.clone(),
                        target: target.clone(),
                        reason: "leaves the archive",
                    })?;
                if !self.files.contains(&norm) {
                    return Err(Error::HardlinkEscape {
                        entry: display,
                        target,
                        reason: "names no earlier regular file of the archive",
                    });
                }
                EntryKind::Hardlink(norm)
            }
            tar::EntryType::Char => return Err(forbidden("character device")),
            tar::EntryType::Block => return Err(forbidden("block device")),
            tar::EntryType::Fifo => return Err(forbidden("fifo")),
            tar::EntryType::GNUSparse => return Err(forbidden("sparse file")),
            tar::EntryType::Continuous => return Err(forbidden("contiguous file")),
            _ => return Err(forbidden("unknown-type")),
        };
        if path.is_empty() {
            return if kind == EntryKind::Dir {
                Ok(None)
            } else {
                Err(Error::InvalidName {
                    entry: display,
                    reason: "names the archive root",
                })
            };
        }
        let size = if kind == EntryKind::File {
            entry.size()
        } else {
            0
        };
        if size > self.limits.max_entry_bytes {
            return Err(Error::EntryTooLarge {
                entry: display,
                size,
                limit: self.limits.max_entry_bytes,
            });
        }
        let total = self.total.saturating_add(size);
        if total > self.limits.max_total_bytes {
            return Err(Error::ArchiveTooLarge {
                entry: display,
                total,
                limit: self.limits.max_total_bytes,
            });
        }
        self.total = total;
        // Duplicates, and a name already used as a directory by an earlier entry below it.
        if self.seen.contains(&path) || (kind != EntryKind::Dir && self.dirs.contains(&path)) {
            return Err(Error::DuplicateEntry { entry: display });
        }
        // Parents must be (explicit or implicit) directories, never symlinks or files.
        let mut p = parent_of(&path);
        while !p.is_empty() {
            if self.symlinks.contains(p) {
                return Err(Error::BelowSymlink {
                    entry: display,
                    link: p.to_string(),
                });
            }
            if self.files.contains(p) {
                return Err(Error::InvalidName {
                    entry: display,
                    reason: "parent is a file",
                });
            }
            p = parent_of(p);
        }
        let mut p = parent_of(&path);
        while !p.is_empty() && self.dirs.insert(p.to_string()) {
            p = parent_of(p);
        }
        self.seen.insert(path.clone());
        match &kind {
            EntryKind::File | EntryKind::Hardlink(_) => {
                self.files.insert(path.clone());
            }
            EntryKind::Dir => {
                self.dirs.insert(path.clone());
            }
            EntryKind::Symlink(_) => {
                self.symlinks.insert(path.clone());
            }
        }
        Ok(Some(EntryInfo {
            path,
            kind,
            size,
            mode: header.mode().unwrap_or(0o600),
        }))
    }
}

fn link_name<R: io::Read>(entry: &tar::Entry<'_, R>, display: &str) -> Result<String> {
    let t = entry
        .link_name_bytes()
        .ok_or_else(|| Error::InvalidName {
            entry: display.to_string(),
            reason: "link without a target",
        })?
        .into_owned();
    let s = String::from_utf8(t).map_err(|_| Error::InvalidName {
        entry: display.to_string(),
        reason: "link target is not utf-8",
    })?;
    if s.is_empty() || s.contains('\0') {
        return Err(Error::InvalidName {
            entry: display.to_string(),
            reason: "empty or NUL link target",
        });
    }
    Ok(s)
}

/// A symlink target is accepted when it is relative, its ".." components all come first, and the
/// leading ".."s do not climb above the archive root from the link's directory. Then it resolves
/// inside the tree whatever the other links are, since none of them can climb either.
pub fn symlink_target_stays_inside(link_path: &str, target: &str) -> bool {
    if target.starts_with('/') {
        return false;
    }
    let depth = if parent_of(link_path).is_empty() {
        0
    } else {
        parent_of(link_path).split('/').count()
    };
    let mut ups = 0;
    let mut seen_normal = false;
    for c in target.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                if seen_normal {
                    return false;
                }
                ups += 1;
            }
            _ => seen_normal = true,
        }
    }
    if ups > depth {
        return false;
    }
    true
}

/// A directory handle below which entries are created without following symlinks.
pub struct SafeRoot {
    fd: OwnedFd,
}

fn cstr(name: &str) -> io::Result<CString> {
    CString::new(name).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in name"))
}

fn openat_dir(dirfd: i32, name: &str) -> io::Result<OwnedFd> {
    let c = cstr(name)?;
    // SAFETY: c is a valid NUL-terminated string; the returned fd is checked and owned.
    let fd = unsafe {
        libc::openat(
            dirfd,
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, valid descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl SafeRoot {
    /// Open (creating with mode 0700 if absent) the target directory. The target itself may be reached
    /// through symlinks the caller chose; nothing below it will be.
    pub fn open(target: &Path) -> Result<SafeRoot> {
        match std::fs::create_dir(target) {
            Ok(()) => {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(target, std::fs::Permissions::from_mode(0o700))
                    .map_err(|e| Error::io("setting mode 0700 on", target, e))?;
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(Error::io("creating", target, e)),
        }
        let c = CString::new(target.as_os_str().as_encoded_bytes()).map_err(|_| {
            Error::io(
                "opening",
                target,
                io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"),
            )
        })?;
        // SAFETY: valid C string; result checked.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(Error::io("opening", target, io::Error::last_os_error()));
        }
        // SAFETY: fresh descriptor.
        Ok(SafeRoot {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// Open the existing directory `dir` without following a symlink at its last component
    /// (`O_NOFOLLOW | O_DIRECTORY`); nothing is created.
    pub fn open_existing(dir: &Path) -> io::Result<SafeRoot> {
        let c = CString::new(dir.as_os_str().as_encoded_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))?;
        // SAFETY: valid C string; result checked.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fresh descriptor.
        Ok(SafeRoot {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// Remove the entry `name` of the root directory (a link itself, never what it points to);
    /// absent is no error.
    pub fn remove_file(&self, name: &str) -> io::Result<()> {
        let c = cstr(name)?;
        // SAFETY: valid C string and dir fd.
        if unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), 0) } < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::NotFound {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Rename the entry `from` of the root directory to `to` there (replacing what `to` is,
    /// a link included, without following it).
    pub fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let (f, t) = (cstr(from)?, cstr(to)?);
        let fd = self.fd.as_raw_fd();
        // SAFETY: valid strings and dir fd.
        if unsafe { libc::renameat(fd, f.as_ptr(), fd, t.as_ptr()) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Open the directory `rel` ('/'-separated, normalized), creating missing components with mode
    /// 0700; never follows a symlink.
    fn dir(&self, rel: &str) -> io::Result<Option<OwnedFd>> {
        let mut cur: Option<OwnedFd> = None;
        for comp in rel.split('/').filter(|c| !c.is_empty()) {
            let base = cur
                .as_ref()
                .map(|f| f.as_raw_fd())
                .unwrap_or(self.fd.as_raw_fd());
            let c = cstr(comp)?;
            // SAFETY: valid C string and dir fd.
            let r = unsafe { libc::mkdirat(base, c.as_ptr(), 0o700) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::AlreadyExists {
                    return Err(e);
                }
            }
            cur = Some(openat_dir(base, comp)?);
        }
        Ok(cur)
    }

    /// Create directory `rel` (mode 0700).
    pub fn create_dir(&self, rel: &str) -> io::Result<()> {
        self.dir(rel).map(|_| ())
    }

    /// Create a new regular file `rel` with mode 0600; fails if anything exists there.
    pub fn create_file(&self, rel: &str) -> io::Result<File> {
        let (parent, name) = split(rel);
        let pfd = self.dir(parent)?;
        let base = pfd
            .as_ref()
            .map(|f| f.as_raw_fd())
            .unwrap_or(self.fd.as_raw_fd());
        let c = cstr(name)?;
        // SAFETY: valid C string and dir fd; result checked.
        let fd = unsafe {
            libc::openat(
                base,
                c.as_ptr(),
                libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                0o600 as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fresh descriptor.
        Ok(unsafe { File::from_raw_fd(fd) })
    }

    /// Hard link `rel` to the earlier file `target` (both relative to the root).
    pub fn hard_link(&self, target: &str, rel: &str) -> io::Result<()> {
        let (tp, tn) = split(target);
        let (lp, ln) = split(rel);
        let tfd = self.dir(tp)?;
        let lfd = self.dir(lp)?;
        let tb = tfd
            .as_ref()
            .map(|f| f.as_raw_fd())
            .unwrap_or(self.fd.as_raw_fd());
        let lb = lfd
            .as_ref()
            .map(|f| f.as_raw_fd())
            .unwrap_or(self.fd.as_raw_fd());
        let (tc, lc) = (cstr(tn)?, cstr(ln)?);
        // SAFETY: valid strings and fds; flags 0 = do not follow a symlink at target.
        let r = unsafe { libc::linkat(tb, tc.as_ptr(), lb, lc.as_ptr(), 0) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Create symlink `rel` -> `target`.
    pub fn symlink(&self, target: &str, rel: &str) -> io::Result<()> {
        let (lp, ln) = split(rel);
        let lfd = self.dir(lp)?;
        let lb = lfd
            .as_ref()
            .map(|f| f.as_raw_fd())
            .unwrap_or(self.fd.as_raw_fd());
        let (tc, lc) = (cstr(target)?, cstr(ln)?);
        // SAFETY: valid strings and fd.
        let r = unsafe { libc::symlinkat(tc.as_ptr(), lb, lc.as_ptr()) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

fn split(rel: &str) -> (&str, &str) {
    match rel.rfind('/') {
        Some(i) => (&rel[..i], &rel[i + 1..]),
        None => ("", rel),
    }
}

/// Writes `out` atomically and root-only (mode 0600): `body` fills a buffered temp file beside
/// it (and may seek in it), which is synced, renamed into place, and its directory synced
/// ([`crate::durable::write_atomically`]). On any error the temp file is removed and `out` is
/// untouched.
pub fn write_atomically<T>(
    out: &std::path::Path,
    body: impl FnOnce(&mut std::io::BufWriter<std::fs::File>, &std::path::Path) -> crate::Result<T>,
) -> crate::Result<T> {
    crate::durable::write_atomically(
        &crate::durable::RealFs,
        out,
        crate::durable::Durability::Sync,
        body,
    )
}
