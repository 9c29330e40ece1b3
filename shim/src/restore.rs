//! The restore handler's own restore (RuntimeClass `gpu-ckpt-restore`): a container whose pod
//! names a checkpoint in `gpu-ckpt.io/restore-from` is restored by the shim at Start, without
//! containerd's restore-via-create (off by default from containerd 2.2.7/2.3.4, gone in 2.4).
//!
//! At Create: fetch the checkpoint (an archive path, an OCI checkpoint image on disk, or an image
//! reference in a registry), check that it belongs to this container and can run here, unpack
//! it (every entry checked, every digest verified), and lay its rootfs diff over the rootfs.
//! Start then restores from the unpacked `checkpoint/` directory like any other restore.

use std::{
    fs::File,
    io::Read,
    path::{Component, Path, PathBuf},
};

use image_format::{
    archive::{self, ExtractOptions},
    oci,
    safe::Limits,
};
use tracing::{info, warn};

use crate::{
    annotations::{self, Annotations},
    error::{Error, Result},
};

/// Where the checkpoint is unpacked, in the bundle.
pub const RESTORE_DIR: &str = "gpu-ckpt-restore";
const FETCHED_ARCHIVE: &str = "gpu-ckpt-restore.tar";

/// What this container is, to check a checkpoint against.
pub struct Identity<'a> {
    pub name: &'a str,
    pub image: &'a str,
}

/// What to do with the container.
#[derive(Debug, PartialEq)]
pub enum Plan {
    /// Restore from this CRIU image directory.
    Restore(PathBuf),
    /// The checkpoint cannot be used and the pod asked for a cold start: why.
    ColdStart(String),
}

/// Fetches, checks and unpacks the checkpoint `source` for the container in `bundle`, and lays
/// its rootfs diff over `rootfs`. On an error, what it wrote in the bundle is removed (the
/// rootfs is the caller's to unmount).
pub fn prepare(
    bundle: &Path,
    rootfs: &Path,
    source: &str,
    me: &Identity<'_>,
    ann: &Annotations,
) -> Result<Plan> {
    let result = prepare_inner(bundle, rootfs, source, me, ann);
    let _ = std::fs::remove_file(bundle.join(FETCHED_ARCHIVE));
    if !matches!(result, Ok(Plan::Restore(_))) {
        let _ = std::fs::remove_dir_all(bundle.join(RESTORE_DIR));
    }
    result
}

/// Wraps a message as the failure of one restore step.
pub(crate) fn step(step: &'static str) -> impl Fn(String) -> Error {
    move |message| Error::Step {
        operation: "restore",
        step,
        message,
    }
}

fn prepare_inner(
    bundle: &Path,
    rootfs: &Path,
    source: &str,
    me: &Identity<'_>,
    ann: &Annotations,
) -> Result<Plan> {
    let limits = Limits::default();
    // Step 1: fetch.
    let archive = fetch(bundle, source, limits).map_err(step("fetch"))?;
    // Step 2: read every header (hostile entries are refused here) and the metadata.
    let info = archive::read_info(&archive, limits)
        .map_err(|e| step("check")(format!("{source}: {e}")))?;
    let Some(manifest) = &info.manifest else {
        return Err(step("check")(format!(
            "{source} has no gpu-ckpt manifest: it is not a complete gpu-ckpt checkpoint"
        )));
    };
    // Step 3: does it belong here?
    let mut differences = Vec::new();
    let name = info.container_name();
    if name != me.name {
        differences.push(format!(
            "container name: the checkpoint is of {name:?}, this container is {:?}",
            me.name
        ));
    }
    let image = info
        .config_dump
        .as_ref()
        .map(|c| {
            if c.rootfs_image_name.is_empty() {
                c.rootfs_image.clone()
            } else {
                c.rootfs_image_name.clone()
            }
        })
        .filter(|i| !i.is_empty())
        .unwrap_or_else(|| manifest.container.image.clone());
    if !image.is_empty() && !me.image.is_empty() && image != me.image {
        differences.push(format!(
            "image: the checkpoint was taken from {image:?}, this container runs {:?}",
            me.image
        ));
    }
    for (key, field, theirs) in [
        (
            annotations::ENGINE_VERSION,
            "engine version",
            &manifest.workload.engine_version,
        ),
        (
            annotations::MODEL_VERSION,
            "model version",
            &manifest.workload.model_version,
        ),
    ] {
        let mine = ann.get(key).unwrap_or_default();
        if mine != theirs.as_str() {
            differences.push(format!(
                "{field}: the checkpoint has {theirs:?}, this pod declares {mine:?}"
            ));
        }
    }
    if !differences.is_empty() {
        let why = differences.join("; ");
        return match ann.get(annotations::ON_INCOMPATIBLE) {
            Some("cold-start") => {
                warn!(%source, %why, "checkpoint cannot be used: cold start");
                Ok(Plan::ColdStart(why))
            }
            _ => Err(Error::FailedPrecondition(format!(
                "checkpoint {source} cannot be restored into this container: {why} (set {}: cold-start to start it fresh instead)",
                annotations::ON_INCOMPATIBLE
            ))),
        };
    }
    // Step 4: unpack, verifying the CRIU images against the manifest while writing.
    let dir = bundle.join(RESTORE_DIR);
    let _ = std::fs::remove_dir_all(&dir);
    archive::extract_archive(
        &archive,
        &dir,
        ExtractOptions {
            limits,
            verify: true,
        },
        &mut |_, _| {},
    )
    .map_err(|e| step("unpack")(format!("{source}: {e}")))?;
    // Step 5: the container's own changes to its filesystem.
    let diff = dir.join(archive::names::ROOTFS_DIFF_TAR);
    if diff.exists() {
        apply_rootfs_diff(&diff, rootfs).map_err(|e| step("rootfs-diff")(e.to_string()))?;
    }
    info!(%source, "checkpoint unpacked for restore");
    Ok(Plan::Restore(
        dir.join(archive::names::CHECKPOINT_DIRECTORY),
    ))
}

/// The archive for `source`: an absolute path to an archive or an OCI checkpoint image on
/// disk, or else an image reference pulled from its registry.
fn fetch(bundle: &Path, source: &str, limits: Limits) -> std::result::Result<PathBuf, String> {
    let path = Path::new(source);
    if path.is_absolute() {
        if !path.exists() {
            return Err(format!("{source}: no such checkpoint archive or image"));
        }
        if !oci::is_image(path) {
            return Ok(path.to_path_buf());
        }
        let out = bundle.join(FETCHED_ARCHIVE);
        oci::extract_archive_from_image(path, &out, &mut |_, _| {})
            .map_err(|e| format!("{source}: {e}"))?;
        return Ok(out);
    }
    let out = bundle.join(FETCHED_ARCHIVE);
    let _ = std::fs::remove_file(&out);
    oci::pull_archive(source, &out, limits).map_err(|e| format!("pull {source}: {e}"))?;
    Ok(out)
}

/// Lays a container's filesystem changes (containerd's gzip tar or CRI-O's plain tar, with OCI
/// whiteouts) over `rootfs`. Entries that would leave the rootfs, and device nodes, are refused.
pub fn apply_rootfs_diff(diff: &Path, rootfs: &Path) -> Result<()> {
    let mut magic = [0u8; 2];
    let gzip = File::open(diff)
        .and_then(|mut f| f.read_exact(&mut magic))
        .map(|_| magic == [0x1f, 0x8b])
        .unwrap_or(false);
    let file = File::open(diff).map_err(Error::io(format!("open {}", diff.display())))?;
    let reader: Box<dyn Read> = if gzip {
        Box::new(flate2::read::GzDecoder::new(file))
    } else {
        Box::new(file)
    };
    let mut ar = tar::Archive::new(reader);
    ar.set_preserve_permissions(true);
    ar.set_overwrite(true);
    let root = rootfs
        .canonicalize()
        .map_err(Error::io(format!("rootfs {}", rootfs.display())))?;
    let bad = |entry: &Path, why: &str| {
        Error::InvalidArgument(format!(
            "rootfs diff entry {:?}: {why}",
            entry.display().to_string()
        ))
    };
    let entries = ar
        .entries()
        .map_err(Error::io(format!("read {}", diff.display())))?;
    for entry in entries {
        let mut e = entry.map_err(Error::io(format!("read {}", diff.display())))?;
        let path = e
            .path()
            .map_err(Error::io("rootfs diff entry name"))?
            .into_owned();
        if path.is_absolute() || path.components().any(|c| c == Component::ParentDir) {
            return Err(bad(&path, "leaves the rootfs"));
        }
        let kind = e.header().entry_type();
        if kind.is_character_special() || kind.is_block_special() || kind.is_fifo() {
            return Err(bad(&path, "device nodes and fifos are not allowed"));
        }
        if kind.is_hard_link() {
            let target = e
                .link_name()
                .map_err(Error::io("rootfs diff link"))?
                .unwrap_or_default();
            if target.is_absolute() || target.components().any(|c| c == Component::ParentDir) {
                return Err(bad(&path, "hard link leaves the rootfs"));
            }
        }
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if let Some(hidden) = name.strip_prefix(".wh.") {
            let parent = root.join(path.parent().unwrap_or(Path::new("")));
            // Never follow a symlink out of the rootfs to delete something.
            match parent.canonicalize() {
                Ok(p) if p.starts_with(&root) => {}
                Ok(_) => return Err(bad(&path, "whiteout below a link that leaves the rootfs")),
                Err(_) => continue,
            }
            if hidden == ".wh..opq" {
                for child in std::fs::read_dir(&parent).into_iter().flatten().flatten() {
                    remove_any(&child.path())?;
                }
            } else {
                remove_any(&parent.join(hidden))?;
            }
            continue;
        }
        let unpacked = e
            .unpack_in(&root)
            .map_err(|err| bad(&path, &err.to_string()))?;
        if !unpacked {
            return Err(bad(&path, "leaves the rootfs"));
        }
    }
    Ok(())
}

fn remove_any(path: &Path) -> Result<()> {
    let result = match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(_) => return Ok(()),
    };
    result.map_err(Error::io(format!("remove {}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn diff(entries: &[(&str, &[u8])], gzip: bool) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rootfs-diff.tar");
        let file = File::create(&path).unwrap();
        let w: Box<dyn std::io::Write> = if gzip {
            Box::new(flate2::write::GzEncoder::new(
                file,
                flate2::Compression::fast(),
            ))
        } else {
            Box::new(file)
        };
        let mut b = tar::Builder::new(w);
        for (name, data) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_entry_type(tar::EntryType::Regular);
            h.as_gnu_mut().unwrap().name[..name.len()].copy_from_slice(name.as_bytes());
            h.set_cksum();
            b.append(&h, *data).unwrap();
        }
        b.into_inner().unwrap().flush().unwrap();
        (dir, path)
    }

    use std::io::Write as _;

    #[test]
    fn files_and_whiteouts_are_applied() {
        let rootfs = tempfile::tempdir().unwrap();
        std::fs::write(rootfs.path().join("gone.txt"), "x").unwrap();
        std::fs::create_dir_all(rootfs.path().join("opaque/sub")).unwrap();
        std::fs::write(rootfs.path().join("opaque/old"), "x").unwrap();
        let (_d, path) = diff(
            &[
                ("counter.txt", b"42\n"),
                (".wh.gone.txt", b""),
                ("opaque/.wh..wh..opq", b""),
                ("opaque/new", b"n"),
            ],
            true,
        );
        apply_rootfs_diff(&path, rootfs.path()).unwrap();
        assert_eq!(
            std::fs::read_to_string(rootfs.path().join("counter.txt")).unwrap(),
            "42\n"
        );
        assert!(!rootfs.path().join("gone.txt").exists());
        assert!(!rootfs.path().join("opaque/old").exists());
        assert!(!rootfs.path().join("opaque/sub").exists());
        assert!(rootfs.path().join("opaque/new").exists());
    }

    #[test]
    fn escapes_are_refused() {
        let rootfs = tempfile::tempdir().unwrap();
        let (_d, path) = diff(&[("../escape", b"x")], false);
        let err = apply_rootfs_diff(&path, rootfs.path())
            .unwrap_err()
            .to_string();
        assert!(err.contains("../escape"), "{err}");
        assert!(!rootfs.path().parent().unwrap().join("escape").exists());
    }
}
