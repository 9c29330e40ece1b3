//! The shim's own copy of a container's rootfs changes, kept in the checkpoint directory
//! (`gpu-ckpt-rootfs-changes.tar`) so that the manifest, and so its signature, covers it:
//! containerd writes its `rootfs-diff.tar` only after the shim returns, where nothing of ours
//! can sign it.
//!
//! The copy is a tar of the overlay upper directory in the overlay's own terms, so that no
//! file name can be read as anything but a file (docs/image-format.md): an overlay whiteout is
//! a character device 0/0 entry of its own name, an opaque directory carries the PAX record
//! `SCHILY.xattr.trusted.overlay.opaque=y`, and a regular file named `.wh.<name>` is a
//! regular file. Regular files, directories and symlinks keep their mode, owner (as the
//! container sees it, through the spec's user namespace mappings) and modification time;
//! device nodes, fifos and sockets are left out (a restore refuses them anyway).
//!
//! The upper directory is written by the container and, while the shim copies it, reachable
//! by every other container of the pod (`/proc/PID/root`), which is not frozen. So nothing in
//! it is opened by path: the upper directory is opened once, every entry below it relative to
//! its parent's handle with `O_NOFOLLOW` (a symlink put in place of a directory is copied as
//! the symlink it is), and what is recorded (type, mode, owner, size, content, the opaque
//! marker) comes from the handle actually opened.

use std::{
    ffi::{CStr, OsStr},
    fs::{self, File},
    io::{self, BufWriter, Read, Write},
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
};

use nix::{
    errno::Errno,
    fcntl::{OFlag, AT_FDCWD},
    sys::stat::{FileStat, Mode, SFlag},
};
use tracing::{debug, warn};

use crate::{
    error::{Error, Result},
    spec_check::Policy,
};

/// The PAX record that marks an opaque directory in the shim's copy.
pub const OPAQUE_PAX_KEY: &str = "SCHILY.xattr.trusted.overlay.opaque";

/// The upper directory of an overlay rootfs mount (`upperdir=` in its options).
pub fn upperdir_of(mount_type: &str, options: &[String]) -> Option<PathBuf> {
    if mount_type != "overlay" {
        return None;
    }
    options
        .iter()
        .find_map(|o| o.strip_prefix("upperdir="))
        .map(PathBuf::from)
}

/// Writes the changes in `upper` to the tar `out` (0600), the owners mapped to what the
/// container sees under `ids` (the checkpointed container's spec). Returns the number of
/// entries.
pub fn write(upper: &Path, out: &Path, ids: &Policy) -> Result<u64> {
    // The upper directory itself is containerd's path; opened once, never through a link.
    let root = open_dir_at(AT_FDCWD, upper.as_os_str())
        .map_err(|e| Error::io(format!("open {}", upper.display()))(e.into()))?;
    let file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode_0600()
        .open(out)
        .map_err(Error::io(format!("create {}", out.display())))?;
    let mut w = Walk {
        b: tar::Builder::new(BufWriter::new(file)),
        ids,
        upper,
        count: 0,
    };
    w.dir(&root, Path::new(""))?;
    let Walk { b, count, .. } = w;
    let w = b
        .into_inner()
        .map_err(Error::io(format!("write {}", out.display())))?;
    // Flushed here; synced with every other file the manifest lists, before the manifest is
    // written (image-format's `durable`).
    w.into_inner()
        .map_err(|e| Error::io(format!("write {}", out.display()))(e.into_error()))?;
    Ok(count)
}

trait Mode0600 {
    fn mode_0600(&mut self) -> &mut Self;
}

impl Mode0600 for fs::OpenOptions {
    fn mode_0600(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.mode(0o600)
    }
}

/// Opens the directory `name` below `dir` without following a symlink at `name` (`dir` may be
/// [`AT_FDCWD`] for a path the shim chose). `name` is one component for every directory of a
/// container's tree.
pub(crate) fn open_dir_at<Fd: AsFd>(dir: Fd, name: &OsStr) -> nix::Result<OwnedFd> {
    nix::fcntl::openat(
        dir,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
}

/// The names in the directory `dir` (without `.` and `..`), sorted: read through the
/// handle's own `/proc/self/fd` link, which is the directory it holds, not a path.
pub(crate) fn list(dir: BorrowedFd<'_>) -> io::Result<Vec<Vec<u8>>> {
    let mut names = fs::read_dir(fd_path(dir))?
        .map(|e| e.map(|e| e.file_name().as_bytes().to_vec()))
        .collect::<io::Result<Vec<_>>>()?;
    names.sort();
    Ok(names)
}

/// The `/proc/self/fd` link of an open handle: opening it opens the same file, whatever its
/// name points at by now.
fn fd_path(fd: BorrowedFd<'_>) -> String {
    format!("/proc/self/fd/{}", fd.as_raw_fd())
}

/// The file type bits of a stat.
pub(crate) fn kind(st: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits())
}

struct Walk<'a, W: Write> {
    b: tar::Builder<W>,
    ids: &'a Policy,
    upper: &'a Path,
    count: u64,
}

impl<W: Write> Walk<'_, W> {
    fn err(&self, what: &str, rel: &Path) -> impl FnOnce(io::Error) -> Error {
        Error::io(format!(
            "{what} {} in {}",
            rel.display(),
            self.upper.display()
        ))
    }

    /// Copies the entries of the directory `dir` (at `rel` in the upper directory).
    fn dir(&mut self, dir: &OwnedFd, rel: &Path) -> Result<()> {
        let names = list(dir.as_fd()).map_err(self.err("list", rel))?;
        for name in names {
            let name = OsStr::from_bytes(&name);
            let path = rel.join(name);
            // The entry itself, never what a link there points at, and without opening a
            // device for reading.
            let fd = match nix::fcntl::openat(
                dir,
                name,
                OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            ) {
                Ok(fd) => fd,
                Err(Errno::ENOENT) => {
                    debug!(path = %path.display(), "rootfs change gone while copied");
                    continue;
                }
                Err(e) => return Err(self.err("open", &path)(e.into())),
            };
            let st = nix::sys::stat::fstat(&fd).map_err(|e| self.err("stat", &path)(e.into()))?;
            let k = kind(&st);
            if k == SFlag::S_IFREG {
                self.file(&fd, &st, &path)?;
            } else if k == SFlag::S_IFDIR {
                let sub = open_dir_at(&fd, OsStr::new("."))
                    .map_err(|e| self.err("open", &path)(e.into()))?;
                if is_opaque(&sub) {
                    self.opaque_marker(&path)?;
                }
                let mut h = self.header(&st, tar::EntryType::Directory);
                self.b
                    .append_data(&mut h, &path, io::empty())
                    .map_err(self.err("add", &path))?;
                self.count += 1;
                self.dir(&sub, &path)?;
                continue;
            } else if k == SFlag::S_IFLNK {
                let target = nix::fcntl::readlinkat(&fd, c"")
                    .map_err(|e| self.err("read link", &path)(e.into()))?;
                let mut h = self.header(&st, tar::EntryType::Symlink);
                self.b
                    .append_link(&mut h, &path, target)
                    .map_err(self.err("add", &path))?;
            } else if k == SFlag::S_IFCHR && st.st_rdev == 0 {
                // An overlay whiteout, recorded as what it is.
                let mut h = self.header(&st, tar::EntryType::Char);
                h.set_device_major(0)
                    .and_then(|_| h.set_device_minor(0))
                    .map_err(self.err("add", &path))?;
                self.b
                    .append_data(&mut h, &path, io::empty())
                    .map_err(self.err("add", &path))?;
            } else {
                warn!(path = %path.display(), "rootfs change left out of the checkpoint's copy: not a file, directory or symlink");
                continue;
            }
            self.count += 1;
        }
        Ok(())
    }

    /// A regular file: read through the handle opened (`fd`, an `O_PATH` handle on the file
    /// itself), exactly the size its stat gave.
    fn file(&mut self, fd: &OwnedFd, st: &FileStat, path: &Path) -> Result<()> {
        // Reopened for reading through the handle: the same inode, whatever the name points
        // at by now. `O_NONBLOCK`: no open can wait on the container.
        let file: File = nix::fcntl::open(
            fd_path(fd.as_fd()).as_str(),
            OFlag::O_RDONLY | OFlag::O_NOCTTY | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map(File::from)
        .map_err(|e| self.err("open", path)(e.into()))?;
        let size = u64::try_from(st.st_size).unwrap_or(0);
        let mut h = self.header(st, tar::EntryType::Regular);
        h.set_size(size);
        let data = Exact {
            inner: file.take(size),
            left: size,
        };
        self.b
            .append_data(&mut h, path, data)
            .map_err(self.err("add", path))
    }

    /// A PAX header marking the next entry (a directory) opaque.
    fn opaque_marker(&mut self, path: &Path) -> Result<()> {
        let record = pax_record(OPAQUE_PAX_KEY, "y");
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(tar::EntryType::XHeader);
        h.set_mode(0o600);
        h.set_size(record.len() as u64);
        self.b
            .append_data(&mut h, "././@PaxHeader", record.as_slice())
            .map_err(self.err("add", path))
    }

    /// The header of an entry from the stat of its handle: the owner as the container sees
    /// it; where the upper directory holds an owner outside the container's mappings, the
    /// overflow id and no setuid/setgid bit.
    fn header(&self, st: &FileStat, kind: tar::EntryType) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        let mut mode = st.st_mode & 0o7777;
        let (uid, gid) = match self.ids.container_owner(st.st_uid, st.st_gid) {
            Some(owner) => owner,
            None => {
                mode &= !0o6000;
                (OVERFLOW_ID, OVERFLOW_ID)
            }
        };
        h.set_mode(mode);
        h.set_uid(uid.into());
        h.set_gid(gid.into());
        h.set_mtime(st.st_mtime.max(0) as u64);
        h.set_size(0);
        h
    }
}

/// The id the kernel shows for an unmapped owner.
pub(crate) const OVERFLOW_ID: u32 = 65534;

/// One PAX record: `<length> <key>=<value>\n`, the length counting itself.
fn pax_record(key: &str, value: &str) -> Vec<u8> {
    let rest = format!(" {key}={value}\n");
    let mut len = rest.len();
    while (len.to_string().len() + rest.len()) != len {
        len = len.to_string().len() + rest.len();
    }
    format!("{len}{rest}").into_bytes()
}

/// Reads exactly `left` bytes from a file whose stat said so: more are not read (the header
/// holds the size), fewer fail the copy (the file shrank while copied).
struct Exact<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Read for Exact<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            return Ok(0);
        }
        let n = self.inner.read(buf)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "the file ended {} bytes before the size its stat gave: it changed while copied",
                    self.left
                ),
            ));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// Whether the directory open at `dir` is an opaque overlay directory.
fn is_opaque(dir: &OwnedFd) -> bool {
    [c"trusted.overlay.opaque", c"user.overlay.opaque"]
        .iter()
        .any(|attr| xattr_is_y(dir, attr))
}

fn xattr_is_y(fd: &OwnedFd, attr: &CStr) -> bool {
    let mut value = [0u8; 4];
    // SAFETY: `attr` is NUL-terminated, `fd` an open descriptor and `value` a writable
    // buffer of its length.
    let n = unsafe {
        libc::fgetxattr(
            fd.as_raw_fd(),
            attr.as_ptr(),
            value.as_mut_ptr().cast(),
            value.len(),
        )
    };
    n == 1 && value[0] == b'y'
}

/// Opens the copy for the restore to lay over the rootfs (`restore::apply_rootfs_diff`).
pub fn exists(dir: &Path) -> Option<PathBuf> {
    let p = dir.join(image_format::manifest::ROOTFS_CHANGES_FILE);
    File::open(&p).ok().map(|_| p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::restore::DiffFormat;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn no_userns() -> Policy {
        Policy::from_spec(&serde_json::json!({})).unwrap()
    }

    fn entries(tar_path: &Path) -> Vec<(String, tar::EntryType, u64, u64, u32, bool)> {
        let mut out = Vec::new();
        let mut ar = tar::Archive::new(File::open(tar_path).unwrap());
        for e in ar.entries().unwrap() {
            let mut e = e.unwrap();
            let opaque = e
                .pax_extensions()
                .unwrap()
                .into_iter()
                .flatten()
                .any(|x| x.unwrap().key() == Ok(OPAQUE_PAX_KEY));
            let h = e.header().clone();
            out.push((
                e.path().unwrap().display().to_string(),
                h.entry_type(),
                h.uid().unwrap(),
                h.gid().unwrap(),
                h.mode().unwrap(),
                opaque,
            ));
        }
        out
    }

    #[test]
    fn upper_directory_becomes_a_tar_in_the_overlays_terms() {
        let upper = tempfile::tempdir().unwrap();
        let u = upper.path();
        fs::create_dir_all(u.join("etc")).unwrap();
        fs::write(u.join("etc/new.conf"), "x").unwrap();
        fs::write(u.join("counter.txt"), "42").unwrap();
        // A regular file with a whiteout's name is a file.
        fs::write(u.join(".wh.notes"), "mine").unwrap();
        std::os::unix::fs::symlink("counter.txt", u.join("link")).unwrap();
        fs::write(u.join("suid"), "#!").unwrap();
        nix::unistd::chown(
            &u.join("suid"),
            Some(nix::unistd::Uid::from_raw(1000)),
            Some(nix::unistd::Gid::from_raw(1000)),
        )
        .unwrap();
        fs::set_permissions(u.join("suid"), fs::Permissions::from_mode(0o4755)).unwrap();
        // An overlay whiteout and an opaque directory (the tests run as root).
        nix::sys::stat::mknod(
            &u.join("gone"),
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0),
            0,
        )
        .unwrap();
        fs::create_dir(u.join("opaque")).unwrap();
        fs::write(u.join("opaque/new"), "n").unwrap();
        let c = std::ffi::CString::new(u.join("opaque").as_os_str().as_bytes()).unwrap();
        // SAFETY: NUL-terminated strings and a value of the given length.
        let r = unsafe {
            libc::setxattr(
                c.as_ptr(),
                c"trusted.overlay.opaque".as_ptr(),
                b"y".as_ptr().cast(),
                1,
                0,
            )
        };
        assert_eq!(r, 0, "{}", io::Error::last_os_error());
        let out = tempfile::tempdir().unwrap();
        let tar_path = out.path().join("c.tar");
        assert_eq!(write(u, &tar_path, &no_userns()).unwrap(), 9);
        let got = entries(&tar_path);
        let names: Vec<_> = got.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(
            names,
            [
                ".wh.notes",
                "counter.txt",
                "etc",
                "etc/new.conf",
                "gone",
                "link",
                "opaque",
                "opaque/new",
                "suid"
            ]
        );
        let by = |n: &str| got.iter().find(|e| e.0 == n).unwrap().clone();
        assert_eq!(by(".wh.notes").1, tar::EntryType::Regular);
        assert_eq!(by("gone").1, tar::EntryType::Char);
        assert!(by("opaque").5 && !by("etc").5);
        assert_eq!(
            (by("suid").2, by("suid").3, by("suid").4),
            (1000, 1000, 0o4755)
        );

        // Applied to a rootfs, it reproduces the changes, owners and all.
        let rootfs = tempfile::tempdir().unwrap();
        let r = rootfs.path();
        fs::write(r.join("gone"), "old").unwrap();
        fs::create_dir_all(r.join("opaque/old")).unwrap();
        crate::restore::apply_rootfs_diff(&tar_path, r, DiffFormat::Own, &no_userns()).unwrap();
        assert_eq!(fs::read_to_string(r.join("etc/new.conf")).unwrap(), "x");
        assert_eq!(fs::read_to_string(r.join(".wh.notes")).unwrap(), "mine");
        assert!(!r.join("gone").exists());
        assert!(!r.join("opaque/old").exists());
        assert!(r.join("opaque/new").exists());
        let m = fs::symlink_metadata(r.join("suid")).unwrap();
        assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777), (1000, 1000, 0o4755));
        assert_eq!(
            fs::read_link(r.join("link")).unwrap(),
            Path::new("counter.txt")
        );
    }

    #[test]
    fn a_directory_swapped_for_a_link_is_copied_as_the_link() {
        let host = tempfile::tempdir().unwrap();
        fs::create_dir(host.path().join("keys")).unwrap();
        fs::write(host.path().join("keys/node.key"), "SECRET").unwrap();
        let upper = tempfile::tempdir().unwrap();
        let u = upper.path();
        // What a sidecar leaves: `x` a link to a host directory that has `keys`.
        std::os::unix::fs::symlink(host.path(), u.join("x")).unwrap();
        let out = tempfile::tempdir().unwrap();
        let tar_path = out.path().join("c.tar");
        write(u, &tar_path, &no_userns()).unwrap();
        let got = entries(&tar_path);
        assert_eq!(got.len(), 1);
        assert_eq!(
            (got[0].0.as_str(), got[0].1),
            ("x", tar::EntryType::Symlink)
        );
        let bytes = fs::read(&tar_path).unwrap();
        assert!(!bytes.windows(6).any(|w| w == b"SECRET"));
        // The upper directory itself is never reached through a link either.
        let link = out.path().join("upper-link");
        std::os::unix::fs::symlink(u, &link).unwrap();
        let err = write(&link, &out.path().join("d.tar"), &no_userns())
            .unwrap_err()
            .to_string();
        assert!(err.contains("upper-link"), "{err}");
    }

    #[test]
    fn a_file_that_shrinks_while_copied_fails_the_copy() {
        let mut r = Exact {
            inner: &b"abc"[..],
            left: 5,
        };
        let err = io::copy(&mut r, &mut io::sink()).unwrap_err().to_string();
        assert!(err.contains("2 bytes before"), "{err}");
        // One that grows is cut at the size of its stat.
        let mut r = Exact {
            inner: (&b"abcdef"[..]).take(3),
            left: 3,
        };
        let mut v = Vec::new();
        r.read_to_end(&mut v).unwrap();
        assert_eq!(v, b"abc");
    }

    #[test]
    fn owners_are_recorded_as_the_container_sees_them() {
        let spec = serde_json::json!({"linux": {
            "uidMappings": [{"containerID": 0, "hostID": 100000, "size": 65536}],
            "gidMappings": [{"containerID": 0, "hostID": 200000, "size": 65536}]}});
        let ids = Policy::from_spec(&spec).unwrap();
        assert_eq!(ids.container_owner(101000, 201000), Some((1000, 1000)));
        assert_eq!(ids.host_owner(1000, 1000), Some((101000, 201000)));
        assert_eq!(ids.container_owner(1000, 201000), None);
        assert_eq!(ids.host_owner(70000, 0), None);
        assert_eq!(no_userns().host_owner(7, 8), Some((7, 8)));
        assert_eq!(pax_record("k", "y"), b"6 k=y\n");
        let long = pax_record(OPAQUE_PAX_KEY, "y");
        let (len, _) = std::str::from_utf8(&long).unwrap().split_once(' ').unwrap();
        assert_eq!(len.parse::<usize>().unwrap(), long.len());
    }

    #[test]
    fn only_overlay_mounts_have_an_upper_directory() {
        let opts = vec!["lowerdir=/l".to_string(), "upperdir=/u".to_string()];
        assert_eq!(upperdir_of("overlay", &opts), Some(PathBuf::from("/u")));
        assert_eq!(upperdir_of("bind", &opts), None);
    }
}
