//! The journal's directory and files, opened without following a symbolic link: the directory
//! with `O_DIRECTORY|O_NOFOLLOW`, its files through its descriptor (`openat`) with `O_NOFOLLOW`.

use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::Mode;

use crate::{Error, Result};

/// The uid the journal's directory and files must have: the writer's (root on a node).
fn owner() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// The directory `dir`, made (0700) when `create` and missing; `None` when missing and not
/// `create`. A symbolic link, or a directory owned by another user than this process's (a reader
/// also takes root's), is refused. A writer takes group and other permissions off.
pub(crate) fn open_dir(dir: &Path, create: bool) -> Result<Option<File>> {
    if create {
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(parent)
                .map_err(|e| Error::io("creating", parent, e))?;
        }
        match std::fs::DirBuilder::new().mode(0o700).create(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(Error::io("creating", dir, e)),
        }
    }
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let fd = match nix::fcntl::open(dir, flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) if !create => return Ok(None),
        Err(Errno::ELOOP) => return Err(Error::Symlink { path: dir.into() }),
        Err(Errno::ENOTDIR) => {
            return Err(match std::fs::symlink_metadata(dir) {
                Ok(m) if m.file_type().is_symlink() => Error::Symlink { path: dir.into() },
                _ => Error::NotA {
                    path: dir.into(),
                    want: "directory",
                },
            })
        }
        Err(e) => return Err(Error::io("opening", dir, e)),
    };
    let f = File::from(fd);
    let m = f.metadata().map_err(|e| Error::io("reading", dir, e))?;
    let want = owner();
    if m.uid() != want && (create || m.uid() != 0) {
        return Err(Error::Owner {
            path: dir.into(),
            uid: m.uid(),
            want,
        });
    }
    if create && m.mode() & 0o077 != 0 {
        f.set_permissions(std::fs::Permissions::from_mode(0o700))
            .map_err(|e| Error::io("restricting", dir, e))?;
    }
    Ok(Some(f))
}

/// `name` in `dirfd` for appending (made 0600 when missing), checked: a regular file of this
/// process's user with one link; group and other permissions taken off.
pub(crate) fn open_append(dirfd: &File, dir: &Path, name: &str) -> Result<File> {
    let flags = OFlag::O_RDWR
        | OFlag::O_APPEND
        | OFlag::O_CREAT
        | OFlag::O_NOFOLLOW
        | OFlag::O_CLOEXEC
        | OFlag::O_NONBLOCK;
    let path = dir.join(name);
    let fd = nix::fcntl::openat(dirfd, name, flags, Mode::from_bits_truncate(0o600))
        .map_err(|e| open_error(&path, e))?;
    let f = File::from(fd);
    let m = f.metadata().map_err(|e| Error::io("reading", &path, e))?;
    check_file(&path, &m, true)?;
    if m.mode() & 0o077 != 0 {
        f.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(|e| Error::io("restricting", &path, e))?;
    }
    Ok(f)
}

/// `name` in `dirfd` for reading, `None` when missing; a regular file (a reader takes root's
/// files and its own).
pub(crate) fn open_read(dirfd: &File, dir: &Path, name: &str) -> Result<Option<File>> {
    let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK;
    let path = dir.join(name);
    let fd: OwnedFd = match nix::fcntl::openat(dirfd, name, flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return Ok(None),
        Err(e) => return Err(open_error(&path, e)),
    };
    let f = File::from(fd);
    let m = f.metadata().map_err(|e| Error::io("reading", &path, e))?;
    check_file(&path, &m, false)?;
    Ok(Some(f))
}

fn open_error(path: &Path, e: Errno) -> Error {
    match e {
        Errno::ELOOP => Error::Symlink { path: path.into() },
        e => Error::io("opening", path, e),
    }
}

fn check_file(path: &Path, m: &std::fs::Metadata, writer: bool) -> Result<()> {
    if !m.file_type().is_file() {
        return Err(Error::NotA {
            path: path.into(),
            want: "regular file",
        });
    }
    let want = owner();
    if m.uid() != want && (writer || m.uid() != 0) {
        return Err(Error::Owner {
            path: path.into(),
            uid: m.uid(),
            want,
        });
    }
    if writer && m.nlink() > 1 {
        return Err(Error::Links {
            path: path.into(),
            links: m.nlink(),
        });
    }
    Ok(())
}

/// The (device, inode) of `name` in `dirfd`, not following a link; `None` when missing.
pub(crate) fn id_at(dirfd: &File, dir: &Path, name: &str) -> Result<Option<(u64, u64)>> {
    match nix::sys::stat::fstatat(dirfd, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some((st.st_dev, st.st_ino))),
        Err(Errno::ENOENT) => Ok(None),
        Err(e) => Err(Error::io("reading", dir.join(name), e)),
    }
}

/// The (device, inode) of an open file.
pub(crate) fn id_of(f: &File, path: &Path) -> Result<(u64, u64)> {
    let m = f.metadata().map_err(|e| Error::io("reading", path, e))?;
    Ok((m.dev(), m.ino()))
}
