//! The shim's own copy of a container's rootfs changes, kept in the checkpoint directory
//! (`gpu-ckpt-rootfs-changes.tar`) so that the manifest, and so its signature, covers it:
//! containerd writes its `rootfs-diff.tar` only after the shim returns, where nothing of ours
//! can sign it.
//!
//! The copy is a plain tar of the overlay upper directory with OCI whiteouts: an overlay
//! whiteout (a character device 0/0) becomes `.wh.<name>`, an opaque directory
//! (`trusted.overlay.opaque = y`) gets `.wh..wh..opq` right after its own entry. Regular files,
//! directories and symlinks keep their mode, owner and times; device nodes, fifos and sockets
//! are left out (a restore refuses them anyway).

use std::{
    fs::{self, File},
    io::{BufWriter, Write},
    os::unix::fs::{FileTypeExt, MetadataExt},
    path::{Path, PathBuf},
};

use tracing::warn;

use crate::error::{Error, Result};

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

/// Writes the changes in `upper` to the tar `out` (0600). Returns the number of entries.
pub fn write(upper: &Path, out: &Path) -> Result<u64> {
    let file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode_0600()
        .open(out)
        .map_err(Error::io(format!("create {}", out.display())))?;
    let mut b = tar::Builder::new(BufWriter::new(file));
    b.follow_symlinks(false);
    let mut count = 0;
    walk(&mut b, upper, Path::new(""), &mut count)?;
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

fn walk<W: Write>(b: &mut tar::Builder<W>, dir: &Path, rel: &Path, count: &mut u64) -> Result<()> {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .map_err(Error::io(format!("list {}", dir.display())))?
        .collect::<std::io::Result<_>>()
        .map_err(Error::io(format!("list {}", dir.display())))?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let path = e.path();
        let name = rel.join(e.file_name());
        let meta =
            fs::symlink_metadata(&path).map_err(Error::io(format!("stat {}", path.display())))?;
        let ft = meta.file_type();
        let add = |b: &mut tar::Builder<W>| {
            b.append_path_with_name(&path, &name)
                .map_err(Error::io(format!("add {}", path.display())))
        };
        if ft.is_char_device() && meta.rdev() == 0 {
            let wh = rel.join(format!(".wh.{}", e.file_name().to_string_lossy()));
            empty_file(b, &wh, &meta)?;
        } else if ft.is_dir() {
            add(b)?;
            if is_opaque(&path) {
                empty_file(b, &name.join(".wh..wh..opq"), &meta)?;
            }
            walk(b, &path, &name, count)?;
        } else if ft.is_file() || ft.is_symlink() {
            add(b)?;
        } else {
            warn!(path = %name.display(), "rootfs change left out of the checkpoint's copy: not a file, directory or symlink");
            continue;
        }
        *count += 1;
    }
    Ok(())
}

fn empty_file<W: Write>(b: &mut tar::Builder<W>, name: &Path, meta: &fs::Metadata) -> Result<()> {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_size(0);
    h.set_mode(0o600);
    h.set_mtime(meta.mtime().max(0) as u64);
    b.append_data(&mut h, name, std::io::empty())
        .map_err(Error::io(format!("add {}", name.display())))
}

fn is_opaque(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    let mut value = [0u8; 4];
    for attr in [c"trusted.overlay.opaque", c"user.overlay.opaque"] {
        // SAFETY: both strings are NUL-terminated and `value` is a writable buffer of its length.
        let n = unsafe {
            libc::lgetxattr(
                c.as_ptr(),
                attr.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        if n == 1 && value[0] == b'y' {
            return true;
        }
    }
    false
}

/// Opens the copy for [`crate::restore::apply_rootfs_diff`].
pub fn exists(dir: &Path) -> Option<PathBuf> {
    let p = dir.join(image_format::manifest::ROOTFS_CHANGES_FILE);
    File::open(&p).ok().map(|_| p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upper_directory_becomes_a_tar_with_whiteouts() {
        let upper = tempfile::tempdir().unwrap();
        let u = upper.path();
        fs::create_dir_all(u.join("etc")).unwrap();
        fs::write(u.join("etc/new.conf"), "x").unwrap();
        fs::write(u.join("counter.txt"), "42").unwrap();
        std::os::unix::fs::symlink("counter.txt", u.join("link")).unwrap();
        // An overlay whiteout, where the test may make one (root).
        let wh = nix::sys::stat::mknod(
            &u.join("gone"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o600),
            0,
        )
        .is_ok();
        let out = tempfile::tempdir().unwrap();
        let tar_path = out.path().join("c.tar");
        write(u, &tar_path).unwrap();
        let mut names = Vec::new();
        let mut ar = tar::Archive::new(File::open(&tar_path).unwrap());
        for e in ar.entries().unwrap() {
            names.push(e.unwrap().path().unwrap().display().to_string());
        }
        let mut want = vec!["counter.txt", "etc", "etc/new.conf", "link"];
        if wh {
            want.insert(3, ".wh.gone");
        }
        assert_eq!(names, want);
        // Applied to a rootfs, it reproduces the changes.
        let rootfs = tempfile::tempdir().unwrap();
        fs::write(rootfs.path().join("gone"), "old").unwrap();
        crate::restore::apply_rootfs_diff(&tar_path, rootfs.path()).unwrap();
        assert_eq!(
            fs::read_to_string(rootfs.path().join("etc/new.conf")).unwrap(),
            "x"
        );
        assert_eq!(!rootfs.path().join("gone").exists(), wh);
    }

    #[test]
    fn only_overlay_mounts_have_an_upper_directory() {
        let opts = vec!["lowerdir=/l".to_string(), "upperdir=/u".to_string()];
        assert_eq!(upperdir_of("overlay", &opts), Some(PathBuf::from("/u")));
        assert_eq!(upperdir_of("bind", &opts), None);
    }
}
