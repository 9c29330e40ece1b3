//! Custom storage's device-memory files on the shim's side (the driver writes and reads them:
//! `DeviceCheckpoint::checkpoint_to`, `restore_from`).
//!
//! The device steps run at Pause, before the checkpoint's image directory is known, so the
//! files are written to a directory of the shim's own, `<DeviceStorageDir>/<namespace>/<id>`
//! (root-only, made afresh, on the node's disk: not /run, RAM on most nodes), once the disk
//! there has room for them ([`prepare`]). At the checkpoint they go into the image directory
//! under flat names ([`place`]): renamed where it is on the same file system; copied and the
//! copy verified against the BLAKE3 taken as they were written otherwise, and always where the
//! container runs on (leave-running, or a Pause that a Resume ends: containerd may remove its
//! image directory before it resumes the task, and the Resume reads the files back from here).
//! They are removed here once their checkpoint is done with them ([`remove`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use gpu::DeviceMemoryFile;
use image_format::digest::{digest_file, no_progress, FileDigest, FileHasher};
use image_format::manifest::Manifest;
use tracing::{info, warn};

use crate::error::{Error, Result};
use crate::options::RuntimeOptions;

/// Disk kept free beyond the device bytes: the driver's files may round each range up, and
/// a node's disk full to the last byte fails more than this checkpoint.
const DISK_MARGIN: u64 = 64 << 20;

/// Device-memory files where they are: each with the pid, in the container, of the process
/// whose memory it holds.
#[derive(Clone, Debug)]
pub struct Stored {
    pub dir: PathBuf,
    pub files: Vec<(u32, DeviceMemoryFile)>,
}

/// The directory of container `id` of containerd namespace `namespace`'s device-memory files:
/// `<DeviceStorageDir>/<namespace>/<id>`.
pub fn dir_for(options: &RuntimeOptions, namespace: &str, id: &str) -> Result<PathBuf> {
    crate::private_dir::container_dir(
        &options.device_storage_dir(),
        namespace,
        id,
        "a device storage directory",
    )
}

fn fail(message: String) -> Error {
    Error::Step {
        operation: "checkpoint",
        step: "device-storage",
        message,
    }
}

/// Before the driver is touched: the disk of `dir` (its base directory, made root-only where
/// missing) must have room for `device_bytes`, else the checkpoint is refused; then `dir` is
/// made afresh, root-only.
pub fn prepare(dir: &Path, device_bytes: u64) -> Result<()> {
    let base = dir
        .parent()
        .and_then(Path::parent)
        .ok_or_else(|| fail(format!("{}: no parent directory", dir.display())))?;
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(base)
            .map_err(|e| fail(format!("create {}: {e}", base.display())))?;
    }
    let st = nix::sys::statvfs::statvfs(base)
        .map_err(|e| fail(format!("free space of {}: {e}", base.display())))?;
    let free = (st.blocks_available() as u64).saturating_mul(st.fragment_size() as u64);
    let needed = device_bytes
        .saturating_add(device_bytes / 64)
        .saturating_add(DISK_MARGIN);
    if needed > free {
        return Err(fail(format!(
            "the GPU processes' {} of device memory need {} on the disk of {} (DeviceStorageDir), which has {} free; nothing was touched, the container runs on",
            bytes(device_bytes),
            bytes(needed),
            base.display(),
            bytes(free)
        )));
    }
    crate::private_dir::make_fresh_dir(dir)
        .map_err(|(what, e)| fail(format!("{what} {}: {e}", dir.display())))?;
    Ok(())
}

/// `123456789 bytes (0.11 GiB)`.
fn bytes(b: u64) -> String {
    format!("{b} bytes ({:.2} GiB)", b as f64 / (1u64 << 30) as f64)
}

/// Removes `dir` and what is left in it. Its namespace's directory stays: another
/// container's shim may be making its own directory in it at this moment.
pub fn remove(dir: &Path) {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => info!(dir = %dir.display(), "device-memory files removed"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => warn!(dir = %dir.display(), error = %e, "remove the device-memory files"),
    }
}

/// The files [`place`] renamed into an image directory, to rename back if the checkpoint
/// fails after (what it copied goes with the image directory's undo).
#[derive(Debug, Default)]
pub struct Placed {
    from: PathBuf,
    renamed: Vec<String>,
}

impl Placed {
    /// Undo of [`place`]: the renamed files back where they came from, so that the device
    /// resume of the failed checkpoint finds them.
    pub fn undo(&self, image: &Path) {
        for name in &self.renamed {
            if let Err(e) = std::fs::rename(image.join(name), self.from.join(name)) {
                warn!(name, error = %e, "undo of a failed checkpoint: a device-memory file back");
            }
        }
    }
}

/// Puts `stored`'s files into the image directory `image` under their flat names: renamed
/// where `keep` is false and it is on the same file system, else copied and the copy verified
/// against its BLAKE3. A name already in `image` is refused. Returns what was renamed.
pub fn place(stored: &Stored, image: &Path, keep: bool) -> Result<Placed> {
    let mut placed = Placed {
        from: stored.dir.clone(),
        renamed: Vec::new(),
    };
    let result = (|| -> Result<()> {
        for (_, f) in &stored.files {
            image_format::manifest::check_flat_name(&f.name).map_err(|e| fail(e.to_string()))?;
            let (from, to) = (stored.dir.join(&f.name), image.join(&f.name));
            if std::fs::symlink_metadata(&to).is_ok() {
                return Err(fail(format!(
                    "{} is already in the image directory",
                    f.name
                )));
            }
            if !keep && std::fs::rename(&from, &to).is_ok() {
                placed.renamed.push(f.name.clone());
                continue;
            }
            copy_verified(&from, &to, f)?;
        }
        Ok(())
    })();
    match result {
        Ok(()) => Ok(placed),
        Err(e) => {
            placed.undo(image);
            Err(e)
        }
    }
}

/// Copies `from` to `to` (made new, 0600), then reads the copy back and holds it to `f`'s
/// size and BLAKE3.
fn copy_verified(from: &Path, to: &Path, f: &DeviceMemoryFile) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let copied = (|| -> std::io::Result<u64> {
        let mut src = std::fs::File::open(from)?;
        let mut dst = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(to)?;
        let n = std::io::copy(&mut src, &mut dst)?;
        dst.sync_all()?;
        Ok(n)
    })()
    .map_err(|e| fail(format!("copy {} into the image directory: {e}", f.name)))?;
    let want = FileDigest {
        size: f.size,
        sha256: String::new(),
        blake3: f.blake3.clone(),
    };
    let got = digest_file(to, FileHasher::checking(&want), &mut no_progress)
        .map_err(|e| fail(e.to_string()))?;
    if copied != f.size || got.blake3 != f.blake3 {
        let _ = std::fs::remove_file(to);
        return Err(fail(format!(
            "the copy of {} differs from what the driver wrote ({} bytes, BLAKE3 {}; want {} bytes, {})",
            f.name, got.size, got.blake3, f.size, f.blake3
        )));
    }
    Ok(())
}

/// The device-memory files `manifest` lists, by the pid in the container of the process
/// whose memory each holds.
pub fn recorded_files(manifest: &Manifest) -> Result<HashMap<u32, Vec<DeviceMemoryFile>>> {
    let mut out: HashMap<u32, Vec<DeviceMemoryFile>> = HashMap::new();
    for d in manifest
        .device_state
        .iter()
        .filter(|d| !d.blake3.is_empty())
    {
        let bad = |why: String| Error::Step {
            operation: "restore",
            step: "device-restore",
            message: format!("device-memory file {}: {why}", d.name),
        };
        let pid = d.pid.ok_or_else(|| bad("no process recorded".into()))?;
        let gpu = d
            .gpu_uuid
            .parse()
            .map_err(|e: gpu::GpuError| bad(e.to_string()))?;
        out.entry(pid).or_default().push(DeviceMemoryFile {
            gpu,
            name: d.name.clone(),
            size: d.size,
            blake3: d.blake3.clone(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(dir: &Path, names: &[(&str, &[u8])]) -> Stored {
        let files = names
            .iter()
            .map(|(name, data)| {
                std::fs::write(dir.join(name), data).unwrap();
                (
                    1,
                    DeviceMemoryFile {
                        gpu: gpu::GpuUuid([7; 16]),
                        name: name.to_string(),
                        size: data.len() as u64,
                        blake3: blake3_hex(data),
                    },
                )
            })
            .collect();
        Stored {
            dir: dir.to_path_buf(),
            files,
        }
    }

    fn blake3_hex(data: &[u8]) -> String {
        let mut h = FileHasher::checking(&FileDigest {
            size: 0,
            sha256: String::new(),
            blake3: "x".into(),
        });
        h.update(data);
        h.finish().blake3
    }

    /// A temporary directory with `from` and `image` made in it.
    fn two_dirs() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let (from, image) = (tmp.path().join("from"), tmp.path().join("image"));
        std::fs::create_dir_all(&from).unwrap();
        std::fs::create_dir_all(&image).unwrap();
        (tmp, from, image)
    }

    #[test]
    fn files_are_renamed_or_copied_verified_and_a_rename_undone() {
        let (_tmp, from, image) = two_dirs();
        let s = stored(&from, &[("device-memory-1-0.bin", b"abc")]);
        // Kept: copied, the original stays for the resume.
        let p = place(&s, &image, true).unwrap();
        assert!(p.renamed.is_empty());
        assert!(from.join("device-memory-1-0.bin").exists());
        assert_eq!(
            std::fs::read(image.join("device-memory-1-0.bin")).unwrap(),
            b"abc"
        );
        // A name already there is refused.
        assert!(place(&s, &image, false).is_err());
        std::fs::remove_file(image.join("device-memory-1-0.bin")).unwrap();
        // Not kept: renamed, and back on undo.
        let p = place(&s, &image, false).unwrap();
        assert_eq!(p.renamed, ["device-memory-1-0.bin"]);
        assert!(!from.join("device-memory-1-0.bin").exists());
        p.undo(&image);
        assert!(from.join("device-memory-1-0.bin").exists());
        assert!(!image.join("device-memory-1-0.bin").exists());
    }

    #[test]
    fn a_copy_that_differs_from_the_digest_is_refused_and_removed() {
        let (_tmp, from, image) = two_dirs();
        let mut s = stored(&from, &[("device-memory-1-0.bin", b"abc")]);
        s.files[0].1.blake3 = blake3_hex(b"abd");
        let err = place(&s, &image, true).unwrap_err().to_string();
        assert!(
            err.contains("differs") && err.contains("device-storage"),
            "{err}"
        );
        assert!(!image.join("device-memory-1-0.bin").exists());
    }

    #[test]
    fn the_disk_must_have_room_before_anything_is_touched() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("dev/k8s.io/c1");
        let err = prepare(&dir, u64::MAX / 2).unwrap_err().to_string();
        assert!(
            err.contains("free") && err.contains("DeviceStorageDir") && err.contains("runs on"),
            "{err}"
        );
        assert!(!dir.exists());
        prepare(&dir, 1 << 20).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        remove(&dir);
        // The namespace's directory stays, for the other containers of the namespace.
        assert!(!dir.exists() && dir.parent().unwrap().is_dir());
    }
}
