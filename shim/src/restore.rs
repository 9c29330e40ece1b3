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
    archive::{self, ArchiveInfo, ExtractOptions},
    manifest::{Manifest, ROOTFS_CHANGES_FILE},
    oci,
    safe::Limits,
};
use tracing::{info, warn};

use crate::{
    annotations::{self, Annotations},
    error::{Error, Result},
    options::RuntimeOptions,
    trust::{self, Verdict},
};

/// Where the checkpoint is unpacked, in the bundle.
pub const RESTORE_DIR: &str = "gpu-ckpt-restore";
const FETCHED_ARCHIVE: &str = "gpu-ckpt-restore.tar";

/// What this container is, to check a checkpoint against.
pub struct Identity<'a> {
    pub name: &'a str,
    pub image: &'a str,
    /// The namespace of the container's pod (empty outside Kubernetes).
    pub namespace: &'a str,
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
    options: &RuntimeOptions,
) -> Result<Plan> {
    let result = prepare_inner(bundle, rootfs, source, me, ann, options);
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
    options: &RuntimeOptions,
) -> Result<Plan> {
    let limits = Limits::default();
    // Step 1: fetch, from a source RestoreSources lists (checked before anything is opened).
    let archive = fetch(bundle, source, limits, options)?;
    // Step 2: read every header (hostile entries are refused here) and the metadata.
    let info = archive::read_info(&archive, limits)
        .map_err(|e| step("check")(format!("{source}: {e}")))?;
    let (Some(manifest), Some(json)) = (&info.manifest, &info.manifest_json) else {
        return Err(step("check")(format!(
            "{source} has no gpu-ckpt manifest: it is not a complete gpu-ckpt checkpoint"
        )));
    };
    // Step 3: who signed it, and does this node trust them (or allow unsigned ones)?
    let verdict = trust::check_signature(json, options, source, true)?;
    let signed = matches!(verdict, Verdict::Signed { .. });
    // Step 4: may it move into this namespace? The signed record decides; an unsigned
    // checkpoint's record is what it claims.
    let (spec_name, spec_pod, spec_ns) = info.identity();
    let from = if signed || !manifest.container.pod_namespace.is_empty() {
        manifest.container.pod_namespace.clone()
    } else {
        spec_ns.clone()
    };
    trust::check_namespace(&from, me.namespace, options, source)?;
    if signed {
        check_engine_record(manifest, (&spec_name, &spec_pod, &spec_ns), source)?;
    }
    // Step 5: does it belong here?
    let mut differences = Vec::new();
    let name = if signed {
        manifest.container.name.clone()
    } else {
        info.container_name()
    };
    if name != me.name {
        differences.push(format!(
            "container name: the checkpoint is of {name:?}, this container is {:?}",
            me.name
        ));
    }
    let image = checkpoint_image(&info, manifest, signed);
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
    // The checkpoint's GPUs against the ones this container was given on this node.
    if !manifest.devices.gpus.is_empty() {
        let layer = crate::device::DeviceLayer::for_options(options)?;
        let (gpus, _) = crate::device::compare(bundle, layer.as_deref(), &manifest.devices)?;
        differences.extend(gpus);
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
    // Step 6: unpack, verifying the CRIU images (and the rootfs changes' copy) against the
    // manifest while writing.
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
    let checkpoint = dir.join(archive::names::CHECKPOINT_DIRECTORY);
    // Step 7: the container's own changes to its filesystem: the signed copy in checkpoint/,
    // or, for an unsigned checkpoint without one, the engine's rootfs-diff.tar.
    let own = checkpoint.join(ROOTFS_CHANGES_FILE);
    let engine = dir.join(archive::names::ROOTFS_DIFF_TAR);
    let diff = if own.exists() {
        Some(own)
    } else if engine.exists() {
        if signed {
            return Err(Error::PermissionDenied(format!(
                "checkpoint {source}: its rootfs changes ({}) are not covered by the signature (the checkpoint has no {ROOTFS_CHANGES_FILE})",
                archive::names::ROOTFS_DIFF_TAR
            )));
        }
        Some(engine)
    } else {
        None
    };
    if let Some(diff) = diff {
        apply_rootfs_diff(&diff, rootfs).map_err(|e| step("rootfs-diff")(e.to_string()))?;
    }
    info!(%source, signed, "checkpoint unpacked for restore");
    Ok(Plan::Restore(checkpoint))
}

/// The image the checkpoint was taken from: the signed manifest's for a signed checkpoint,
/// else what the engine recorded.
fn checkpoint_image(info: &ArchiveInfo, manifest: &Manifest, signed: bool) -> String {
    if signed && !manifest.container.image.is_empty() {
        return manifest.container.image.clone();
    }
    info.config_dump
        .as_ref()
        .map(|c| {
            if c.rootfs_image_name.is_empty() {
                c.rootfs_image.clone()
            } else {
                c.rootfs_image_name.clone()
            }
        })
        .filter(|i| !i.is_empty())
        .unwrap_or_else(|| manifest.container.image.clone())
}

/// The engine's own record (spec.dump), which the signature cannot cover, must agree with the
/// signed manifest wherever both name the container, its pod and the pod's namespace.
fn check_engine_record(
    manifest: &Manifest,
    (name, pod, namespace): (&str, &str, &str),
    source: &str,
) -> Result<()> {
    let c = &manifest.container;
    for (field, engine, signed) in [
        ("container name", name, c.name.as_str()),
        ("pod name", pod, c.pod_name.as_str()),
        ("namespace", namespace, c.pod_namespace.as_str()),
    ] {
        if !engine.is_empty() && engine != signed {
            return Err(Error::PermissionDenied(format!(
                "checkpoint {source}: {} says {field} {engine:?}, the signed manifest says {signed:?}: the archive was changed after the checkpoint",
                archive::names::SPEC_DUMP
            )));
        }
    }
    Ok(())
}

/// The archive for `source`: a path to an archive or an OCI checkpoint image on disk under a
/// `RestoreSources` directory, or else an image reference under one of its registry prefixes.
/// Outside those, missing, forbidden or unreadable: one and the same error.
fn fetch(bundle: &Path, source: &str, limits: Limits, options: &RuntimeOptions) -> Result<PathBuf> {
    let sources = options.restore_sources();
    let refused = |why: String| {
        warn!(%source, %why, "restore source refused");
        trust::source_refused(source, &sources)
    };
    let allowed_dir = trust::check_source(source, &sources).inspect_err(|_| {
        warn!(%source, "restore source refused: outside RestoreSources");
    })?;
    if let Some(dir) = allowed_dir {
        let path = trust::resolve_source(source, &dir, &sources)?;
        if !oci::is_image(&path) {
            if !path.is_file() {
                return Err(refused("a directory that is not an OCI image".into()));
            }
            File::open(&path).map_err(|e| refused(e.to_string()))?;
            return Ok(path);
        }
        let out = bundle.join(FETCHED_ARCHIVE);
        let _ = std::fs::remove_file(&out);
        oci::extract_archive_from_image(&path, &out, &mut |_, _| {})
            .map_err(|e| step("fetch")(format!("{source}: {e}")))?;
        return Ok(out);
    }
    let out = bundle.join(FETCHED_ARCHIVE);
    let _ = std::fs::remove_file(&out);
    oci::pull_archive(source, &out, limits).map_err(|e| refused(format!("pull: {e}")))?;
    Ok(out)
}

/// Why a whiteout entry is refused, if it is: one whose target is empty, `.` or `..`
/// (`.wh.`, `.wh..`, `.wh...`), and special `.wh..wh.` names other than the opaque marker.
pub fn bad_whiteout(name: &str) -> Option<&'static str> {
    let hidden = name.strip_prefix(".wh.")?;
    match hidden {
        ".wh..opq" => None,
        "" | "." | ".." => Some("whiteout of the rootfs itself or of its parent"),
        h if h.starts_with(".wh.") => Some("unknown special whiteout"),
        _ => None,
    }
}

/// Lays a container's filesystem changes (the shim's own copy, containerd's gzip tar or CRI-O's
/// plain tar, with OCI whiteouts) over `rootfs`. Every entry is checked before anything is
/// changed: entries that would leave the rootfs, device nodes and fifos, and whiteouts of the
/// rootfs itself or of anything above it are refused, naming the entry.
pub fn apply_rootfs_diff(diff: &Path, rootfs: &Path) -> Result<()> {
    let root = rootfs
        .canonicalize()
        .map_err(Error::io(format!("rootfs {}", rootfs.display())))?;
    // First pass: every entry checked, nothing written.
    for_each_entry(diff, &mut |path, e| {
        check_entry(path, e)?;
        Ok(())
    })?;
    // Second pass: applied.
    for_each_entry(diff, &mut |path, e| apply_entry(path, e, &root))
}

fn open_diff(diff: &Path) -> Result<tar::Archive<Box<dyn Read>>> {
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
    Ok(ar)
}

type Entry<'a> = tar::Entry<'a, Box<dyn Read>>;

fn for_each_entry(
    diff: &Path,
    f: &mut dyn FnMut(&Path, &mut Entry<'_>) -> Result<()>,
) -> Result<()> {
    let mut ar = open_diff(diff)?;
    let entries = ar
        .entries()
        .map_err(Error::io(format!("read {}", diff.display())))?;
    for entry in entries {
        let mut e = entry.map_err(Error::io(format!("read {}", diff.display())))?;
        let path = e
            .path()
            .map_err(Error::io("rootfs diff entry name"))?
            .into_owned();
        f(&path, &mut e)?;
    }
    Ok(())
}

fn bad(entry: &Path, why: &str) -> Error {
    Error::InvalidArgument(format!(
        "rootfs diff entry {:?}: {why}",
        entry.display().to_string()
    ))
}

fn check_entry(path: &Path, e: &Entry<'_>) -> Result<()> {
    if path.is_absolute() || path.components().any(|c| c == Component::ParentDir) {
        return Err(bad(path, "leaves the rootfs"));
    }
    let kind = e.header().entry_type();
    if kind.is_character_special() || kind.is_block_special() || kind.is_fifo() {
        return Err(bad(path, "device nodes and fifos are not allowed"));
    }
    if kind.is_hard_link() {
        let target = e
            .link_name()
            .map_err(Error::io("rootfs diff link"))?
            .unwrap_or_default();
        if target.is_absolute() || target.components().any(|c| c == Component::ParentDir) {
            return Err(bad(path, "hard link leaves the rootfs"));
        }
    }
    // The name as written: `Path` drops a trailing `.`, so `.wh..` must be seen in the bytes.
    let raw = e.path_bytes();
    let raw = String::from_utf8_lossy(&raw);
    let last = raw
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or_default();
    if let Some(why) = bad_whiteout(last) {
        return Err(bad(path, why));
    }
    let name = file_name(path);
    if let Some(why) = bad_whiteout(&name) {
        return Err(bad(path, why));
    }
    Ok(())
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn apply_entry(path: &Path, e: &mut Entry<'_>, root: &Path) -> Result<()> {
    check_entry(path, e)?;
    let name = file_name(path);
    if let Some(hidden) = name.strip_prefix(".wh.") {
        let parent = root.join(path.parent().unwrap_or(Path::new("")));
        // Never follow a symlink out of the rootfs to delete something.
        let parent = match parent.canonicalize() {
            Ok(p) if p.starts_with(root) => p,
            Ok(_) => return Err(bad(path, "whiteout below a link that leaves the rootfs")),
            Err(_) => return Ok(()),
        };
        if hidden == ".wh..opq" {
            for child in std::fs::read_dir(&parent).into_iter().flatten().flatten() {
                remove_any(&child.path(), root)?;
            }
        } else {
            remove_any(&parent.join(hidden), root)?;
        }
        return Ok(());
    }
    let unpacked = e
        .unpack_in(root)
        .map_err(|err| bad(path, &err.to_string()))?;
    if !unpacked {
        return Err(bad(path, "leaves the rootfs"));
    }
    Ok(())
}

/// Removes `path`, which must lie strictly inside `root` (never the rootfs itself).
fn remove_any(path: &Path, root: &Path) -> Result<()> {
    if !path.starts_with(root)
        || path == root
        || path
            .strip_prefix(root)
            .map(|r| r.components().any(|c| !matches!(c, Component::Normal(_))))
            .unwrap_or(true)
    {
        return Err(bad(path, "whiteout target outside the rootfs"));
    }
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

    #[test]
    fn whiteouts_of_the_rootfs_or_its_parent_are_refused_before_anything_changes() {
        for bad_name in [
            ".wh..",
            ".wh...",
            "sub/.wh..",
            "sub/.wh...",
            ".wh.",
            ".wh..wh.x",
        ] {
            let bundle = tempfile::tempdir().unwrap();
            let rootfs = bundle.path().join("rootfs");
            std::fs::create_dir_all(rootfs.join("sub")).unwrap();
            std::fs::write(rootfs.join("keep.txt"), "k").unwrap();
            std::fs::write(bundle.path().join("config.json"), "{}").unwrap();
            // A legitimate whiteout first: it must not run either.
            let (_d, path) = diff(&[(".wh.keep.txt", b""), (bad_name, b"")], true);
            let err = apply_rootfs_diff(&path, &rootfs).unwrap_err().to_string();
            assert!(err.contains(bad_name), "{bad_name}: {err}");
            assert!(rootfs.join("keep.txt").exists(), "{bad_name}");
            assert!(rootfs.join("sub").exists(), "{bad_name}");
            assert!(bundle.path().join("config.json").exists(), "{bad_name}");
        }
        assert_eq!(bad_whiteout(".wh..wh..opq"), None);
        assert_eq!(bad_whiteout(".wh.x"), None);
        assert!(bad_whiteout(".wh..").is_some());
        assert!(bad_whiteout(".wh...").is_some());
    }

    #[test]
    fn whiteouts_never_follow_links_out() {
        let bundle = tempfile::tempdir().unwrap();
        let rootfs = bundle.path().join("rootfs");
        std::fs::create_dir_all(&rootfs).unwrap();
        std::fs::write(bundle.path().join("outside"), "o").unwrap();
        std::os::unix::fs::symlink("..", rootfs.join("up")).unwrap();
        let (_d, path) = diff(&[("up/.wh.outside", b"")], false);
        let err = apply_rootfs_diff(&path, &rootfs).unwrap_err().to_string();
        assert!(err.contains("up/.wh.outside"), "{err}");
        assert!(bundle.path().join("outside").exists());
    }
}
