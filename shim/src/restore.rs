//! The restore handler's own restore (RuntimeClass `gpu-ckpt-restore`): a container whose pod
//! names a checkpoint in `gpu-ckpt.io/restore-from` is restored by the shim at Start, without
//! containerd's restore-via-create (off by default from containerd 2.2.7/2.3.4, gone in 2.4).
//!
//! At Create: fetch the checkpoint (an archive path, an OCI checkpoint image on disk, or an image
//! reference in a registry), check that it belongs to this container and can run here, unpack
//! the members its manifest lists (every entry checked, every digest verified), and lay its
//! rootfs diff over the rootfs. Start then restores from the unpacked `checkpoint/` directory
//! like any other restore. What is fetched and unpacked lies in a root-only staging directory
//! on the node's disk (`RestoreStagingDir`, never the bundle in /run), removed when the restore
//! is done, restored or refused.
//!
//! `mount:/PATH` names an image volume of the pod (Kubernetes `volumes[].image`, which the
//! kubelet pulled with the pod's own credentials): the checkpoint image's layer, unpacked by
//! containerd and mounted read-only. Nothing is copied: its files are checked where they lie
//! (no links, no special files, limits), the metadata read, the same admission checks run, and
//! Start verifies every digest in place before and while CRIU reads it. The mount is removed
//! from the spec of the container that is started, so the restored processes never see it.

use std::{
    ffi::OsStr,
    fs::File,
    io::Read,
    os::{
        fd::{AsFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Component, Path, PathBuf},
};

use image_format::{
    archive::{self, ArchiveInfo, Listed},
    manifest::{Manifest, ROOTFS_CHANGES_FILE},
    oci,
    safe::{Limits, SafeRoot},
};
use nix::{
    errno::Errno,
    fcntl::{AtFlags, OFlag, AT_FDCWD},
    sys::{
        stat::{Mode, SFlag},
        time::TimeSpec,
    },
    unistd::{Gid, Uid, UnlinkatFlags},
};
use tracing::{info, warn};

use crate::{
    annotations::{self, Annotations},
    bundle::{cri, Bundle},
    error::{Error, Result},
    options::RuntimeOptions,
    rootfs_changes,
    spec_check::Policy,
    trust::{self, Verdict},
};

/// Where the checkpoint is unpacked, in the staging directory.
pub const RESTORE_DIR: &str = "unpacked";
/// Where a checkpoint fetched from an OCI image or a registry lies, in the staging directory.
const FETCHED_ARCHIVE: &str = "fetched.tar";

/// What this container is, to check a checkpoint against.
pub struct Identity<'a> {
    pub name: &'a str,
    pub image: &'a str,
    /// The namespace of the container's pod (empty outside Kubernetes).
    pub namespace: &'a str,
    /// The id of the container's pod sandbox (CRI), which owns its image volumes.
    pub sandbox_id: &'a str,
}

/// A restore for Create to prepare: the checkpoint `source`, for the container `me` with its
/// pod's annotations and its handler's options, staged in `staging` ([`staging_dir`]) and its
/// rootfs changes laid over `rootfs`.
pub struct Request<'a> {
    pub rootfs: &'a Path,
    pub staging: &'a Path,
    pub source: &'a str,
    pub me: &'a Identity<'a>,
    pub ann: &'a Annotations,
    pub options: &'a RuntimeOptions,
}

/// What to do with the container.
#[derive(Debug, PartialEq)]
pub enum Plan {
    /// Restore from this CRIU image directory, unpacked and verified by the shim.
    Restore(PathBuf),
    /// Restore from this CRIU image directory where it lies (an image volume), read-only;
    /// Start verifies every file of it against its manifest.
    RestoreInPlace(PathBuf),
    /// The checkpoint cannot be used and the pod asked for a cold start: why.
    ColdStart(String),
}

/// The staging directory of the restore of container `id` of containerd namespace
/// `namespace`: `<RestoreStagingDir>/<namespace>/<id>`.
pub fn staging_dir(options: &RuntimeOptions, namespace: &str, id: &str) -> Result<PathBuf> {
    container_dir(
        &options.restore_staging_dir(),
        namespace,
        id,
        "a restore staging directory",
    )
}

/// `<base>/<namespace>/<id>`, each name one path component (`what` names the directory for
/// the refusal).
pub(crate) fn container_dir(base: &Path, namespace: &str, id: &str, what: &str) -> Result<PathBuf> {
    for (kind, name) in [("namespace", namespace), ("container id", id)] {
        if name.is_empty() || name == "." || name == ".." || name.contains('/') {
            return Err(Error::InvalidArgument(format!(
                "{kind} {name:?} cannot name {what}"
            )));
        }
    }
    Ok(base.join(namespace).join(id))
}

/// Makes the staging directory `staging` ([`staging_dir`]) afresh ([`make_fresh_dir`]).
fn make_staging(staging: &Path) -> Result<()> {
    match make_fresh_dir(staging) {
        Ok(false) => Ok(()),
        Ok(true) => {
            warn!(staging = %staging.display(), "removed a restore's staging directory an earlier shim left");
            Ok(())
        }
        Err((what, e)) => Err(step("stage")(format!("{what} {}: {e}", staging.display()))),
    }
}

/// Makes `<base>/<namespace>/<id>` ([`container_dir`]) afresh: the base directory and the
/// namespace's made root-only (0700) where missing, the container's made new, every
/// component below the base opened without following a link; what an earlier shim of the
/// same container left there is removed first (then true). An error says what failed.
pub(crate) fn make_fresh_dir(
    dir: &Path,
) -> std::result::Result<bool, (&'static str, std::io::Error)> {
    use std::os::unix::fs::DirBuilderExt;
    let no_parent = || ("no parent", std::io::ErrorKind::InvalidInput.into());
    let (Some(ns_dir), Some(id)) = (dir.parent(), dir.file_name()) else {
        return Err(no_parent());
    };
    let (Some(base), Some(ns)) = (ns_dir.parent(), ns_dir.file_name()) else {
        return Err(no_parent());
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(base)
        .map_err(|e| ("create", e))?;
    let root = SafeRoot::open(base).map_err(|e| ("open", std::io::Error::other(e.to_string())))?;
    let (ns, id) = (ns.to_string_lossy(), id.to_string_lossy());
    // The namespace's directory, never through a link (an error if one is there).
    root.create_dir(&ns).map_err(|e| ("create", e))?;
    let removed = match std::fs::remove_dir_all(dir) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => return Err(("remove the earlier", e)),
    };
    root.create_dir(&format!("{ns}/{id}"))
        .map_err(|e| ("create", e))?;
    Ok(removed)
}

/// Removes the staging directory `staging` and all it holds (a restore is done with it, or a
/// container that never started is deleted), and its namespace's directory once empty; nothing
/// there is not an error.
pub fn remove_staging(staging: &Path) {
    match std::fs::remove_dir_all(staging) {
        Ok(()) => info!(staging = %staging.display(), "restore staging directory removed"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            warn!(staging = %staging.display(), error = %e, "remove the restore staging directory")
        }
    }
    // Another restore of the namespace keeps it (not empty), or makes it again.
    if let Some(namespace) = staging.parent() {
        let _ = std::fs::remove_dir(namespace);
    }
}

/// A temporary directory with the directories `names` made in it.
#[cfg(test)]
fn temp_dirs<const N: usize>(names: [&str; N]) -> (tempfile::TempDir, [PathBuf; N]) {
    let tmp = tempfile::tempdir().unwrap();
    let dirs = names.map(|n| tmp.path().join(n));
    for d in &dirs {
        std::fs::create_dir_all(d).unwrap();
    }
    (tmp, dirs)
}

#[cfg(test)]
mod staging_tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn options(base: &Path) -> RuntimeOptions {
        RuntimeOptions {
            restore_staging_dir: base.display().to_string(),
            ..Default::default()
        }
    }

    #[test]
    fn the_staging_directory_is_made_root_only_afresh_and_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().join("var/lib/gpu-ckpt/restore");
        let staging = staging_dir(&options(&base), "k8s.io", "c1").unwrap();
        assert_eq!(staging, base.join("k8s.io/c1"));
        make_staging(&staging).unwrap();
        for dir in [&base, &base.join("k8s.io"), &staging] {
            let mode = std::fs::metadata(dir).unwrap().permissions().mode() & 0o7777;
            assert_eq!(mode, 0o700, "{}", dir.display());
        }
        // What an earlier shim left is gone when the directory is made again.
        std::fs::write(staging.join("fetched.tar"), b"old").unwrap();
        make_staging(&staging).unwrap();
        assert_eq!(std::fs::read_dir(&staging).unwrap().count(), 0);
        let other = staging_dir(&options(&base), "k8s.io", "c2").unwrap();
        make_staging(&other).unwrap();
        remove_staging(&staging);
        assert!(!staging.exists());
        assert!(
            other.is_dir(),
            "another restore's staging directory was removed"
        );
        remove_staging(&other);
        assert!(!base.join("k8s.io").exists());
        assert!(base.is_dir());
        remove_staging(&staging);
    }

    #[test]
    fn a_link_in_the_staging_path_is_not_followed() {
        let (_tmp, [base, elsewhere]) = temp_dirs(["restore", "elsewhere"]);
        std::os::unix::fs::symlink(&elsewhere, base.join("k8s.io")).unwrap();
        let staging = staging_dir(&options(&base), "k8s.io", "c1").unwrap();
        let err = make_staging(&staging).unwrap_err().to_string();
        assert!(err.contains("k8s.io"), "{err}");
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
    }

    #[test]
    fn names_that_are_not_one_component_are_refused() {
        let o = options(Path::new("/var/lib/gpu-ckpt/restore"));
        for (ns, id) in [("", "c"), ("..", "c"), ("k8s.io", "a/b"), ("k8s.io", ".")] {
            assert!(staging_dir(&o, ns, id).is_err(), "{ns:?} {id:?}");
        }
    }
}

/// Fetches, checks and unpacks the checkpoint the request names for the container in `bundle`
/// into its staging directory, and lays its rootfs diff over its rootfs. The staging directory
/// is removed unless the plan is [`Plan::Restore`] (then Start removes it once the restore is
/// done); the rootfs is the caller's to unmount.
pub fn prepare(bundle: &mut Bundle, req: &Request<'_>) -> Result<Plan> {
    let result = prepare_inner(bundle, req);
    if let Err(e) = &result {
        trust::log_refused(e, req.me.namespace);
    }
    if !matches!(result, Ok(Plan::Restore(_))) {
        remove_staging(req.staging);
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

fn prepare_inner(bundle: &mut Bundle, req: &Request<'_>) -> Result<Plan> {
    let (rootfs, staging, source) = (req.rootfs, req.staging, req.source);
    let limits = Limits::default();
    if let Some(destination) = trust::mount_destination(source) {
        return prepare_from_mount(bundle, req, &destination?);
    }
    make_staging(staging)?;
    info!(%source, staging = %staging.display(), "restore staged");
    // Step 1: fetch, from a source RestoreSources lists (checked before anything is opened):
    // an archive on disk is read where it lies; an image's layer is copied into the staging
    // directory, bounded by the size its OCI manifest declares.
    let archive = fetch(staging, source, limits, req.options)?;
    // One open file for every read below: the headers, the metadata, the extraction.
    let file = File::open(&archive).map_err(|e| trust::refused(source, format!("open: {e}")))?;
    // Step 2: read every header (hostile entries are refused here) and the metadata, into
    // memory: nothing is written before the checks. Until the signer and namespace are
    // checked, a failure is the one refusal (the reason in the node's log): a file that is no
    // archive would otherwise tell the pod that it exists.
    let info = archive::read_info_from(std::io::BufReader::with_capacity(64 << 10, &file), limits)
        .map_err(|e| trust::refused(source, format!("check: {e}")))?;
    let signed = match admit(bundle, &info, req)? {
        Admitted::Fits { signed } => signed,
        Admitted::ColdStart(why) => return Ok(Plan::ColdStart(why)),
    };
    let (Some(manifest), Some(manifest_json)) = (&info.manifest, &info.manifest_json) else {
        return Err(step("check")(format!("{source} has no gpu-ckpt manifest")));
    };
    // The engine's rootfs diff, which no signature covers, is unpacked only for an unsigned
    // checkpoint that has no copy of its own; a signed one without a copy is refused here,
    // before anything is unpacked.
    let copy_listed = manifest.files.contains_key(ROOTFS_CHANGES_FILE);
    let engine_diff = info
        .entries
        .iter()
        .any(|e| e.path == archive::names::ROOTFS_DIFF_TAR);
    if signed && !copy_listed && engine_diff {
        return Err(unsigned_changes(source));
    }
    let also: &[&str] = if signed || copy_listed {
        &[]
    } else {
        &[archive::names::ROOTFS_DIFF_TAR]
    };
    // Step 6: unpack what the manifest lists, at the sizes it lists, verifying every digest
    // while writing; every other member stays in the archive.
    let dir = staging.join(RESTORE_DIR);
    let listed = Listed {
        manifest_json,
        manifest,
        also,
    };
    archive::extract_listed(&file, &dir, limits, &listed, &mut |_, _| {})
        .map_err(|e| step("unpack")(format!("{source}: {e}")))?;
    drop(file);
    // The fetched copy is no longer needed: only what was unpacked stays until Start.
    let _ = std::fs::remove_file(staging.join(FETCHED_ARCHIVE));
    let checkpoint = dir.join(archive::names::CHECKPOINT_DIRECTORY);
    // Step 7: the container's own changes to its filesystem: the signed copy in checkpoint/,
    // or, for an unsigned checkpoint without one, the engine's rootfs-diff.tar.
    let own = checkpoint.join(ROOTFS_CHANGES_FILE);
    let engine = dir.join(archive::names::ROOTFS_DIFF_TAR);
    apply_changes(bundle, &own, &engine, rootfs, source, signed)?;
    info!(%source, signed, "checkpoint unpacked for restore");
    Ok(Plan::Restore(checkpoint))
}

/// What the admission checks decided.
enum Admitted {
    /// The checkpoint belongs here and may be restored; whether it is signed.
    Fits { signed: bool },
    /// It does not fit, and the pod asked for a cold start: why.
    ColdStart(String),
}

/// The checks every source gets once its metadata is read: signature and signer, namespace,
/// the engine's record against the signed one, and whether the checkpoint belongs to this
/// container (name, image, declared versions, GPUs).
fn admit(bundle: &Bundle, info: &ArchiveInfo, req: &Request<'_>) -> Result<Admitted> {
    let (source, options) = (req.source, req.options);
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
    trust::check_namespace(&from, req.me.namespace, options, source)?;
    if signed {
        check_engine_record(manifest, (&spec_name, &spec_pod, &spec_ns), source)?;
    }
    // Step 5: does it belong here?
    let differences = differences(bundle, info, manifest, signed, req)?;
    if !differences.is_empty() {
        let why = differences.join("; ");
        return match req.ann.get(annotations::ON_INCOMPATIBLE) {
            Some("cold-start") => {
                warn!(%source, %why, "checkpoint cannot be used: cold start");
                Ok(Admitted::ColdStart(why))
            }
            _ => Err(Error::FailedPrecondition(format!(
                "checkpoint {source} cannot be restored into this container: {why} (set {}: cold-start to start it fresh instead)",
                annotations::ON_INCOMPATIBLE
            ))),
        };
    }
    Ok(Admitted::Fits { signed })
}

/// How the checkpoint (its signed record when `signed`, else what the archive claims) differs
/// from this container: name, image, declared versions, and GPUs on this node.
fn differences(
    bundle: &Bundle,
    info: &ArchiveInfo,
    manifest: &Manifest,
    signed: bool,
    req: &Request<'_>,
) -> Result<Vec<String>> {
    let (me, ann, options) = (req.me, req.ann, req.options);
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
    let image = checkpoint_image(info, manifest, signed);
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
        differences.extend(crate::driver_files::differences_within(
            bundle,
            &manifest.devices,
            crate::driver_files::CHECK_BOUND,
        )?);
    }
    Ok(differences)
}

/// Lays the container's own changes to its filesystem over `rootfs`: the signed copy `own`
/// in checkpoint/ (already verified against the manifest), or, for an unsigned checkpoint
/// without one, the engine's rootfs-diff.tar `engine`; the owners mapped through the user
/// namespace mappings of the spec in `bundle`.
fn apply_changes(
    bundle: &Bundle,
    own: &Path,
    engine: &Path,
    rootfs: &Path,
    source: &str,
    signed: bool,
) -> Result<()> {
    let diff = if own.exists() {
        Some(own)
    } else if engine.exists() {
        if signed {
            return Err(unsigned_changes(source));
        }
        Some(engine)
    } else {
        None
    };
    if let Some(diff) = diff {
        let format = if diff == own {
            DiffFormat::Own
        } else {
            DiffFormat::Oci
        };
        let ids = Policy::from_bundle(bundle)?;
        apply_rootfs_diff(diff, rootfs, format, &ids)
            .map_err(|e| step("rootfs-diff")(e.to_string()))?;
    }
    Ok(())
}

/// The refusal of a signed checkpoint whose rootfs changes are only the engine's diff.
fn unsigned_changes(source: &str) -> Error {
    Error::PermissionDenied(format!(
        "checkpoint {source}: its rootfs changes ({}) are not covered by the signature (the checkpoint has no {ROOTFS_CHANGES_FILE})",
        archive::names::ROOTFS_DIFF_TAR
    ))
}

/// The restore from the image volume at `destination` (`mount:/PATH`): checked and read in
/// place, the rootfs changes applied, and the mount removed from the container's spec.
fn prepare_from_mount(bundle: &mut Bundle, req: &Request<'_>, destination: &str) -> Result<Plan> {
    let (rootfs, source) = (req.rootfs, req.source);
    let limits = Limits::default();
    // Step 1: the mount, which must be an image volume of this pod (trust::image_volume).
    let root = trust::image_volume(
        bundle.path(),
        bundle.json(),
        destination,
        req.me.sandbox_id,
        source,
    )?;
    // Step 2: every entry checked where it lies (a hostile image's layer), the metadata read.
    let info = archive::read_info_tree(&root, limits)
        .map_err(|e| step("check")(format!("{source}: {e}")))?;
    // Steps 3 to 5: the same admission as any other source.
    let signed = match admit(bundle, &info, req)? {
        Admitted::Fits { signed } => signed,
        Admitted::ColdStart(why) => {
            remove_mounts(bundle, &root)?;
            return Ok(Plan::ColdStart(why));
        }
    };
    let manifest = info
        .manifest
        .as_ref()
        .ok_or_else(|| step("check")(format!("{source} has no gpu-ckpt manifest")))?;
    // Step 6: nothing is unpacked; the container's own changes are verified against the
    // manifest before they touch the rootfs (Start verifies the rest).
    let checkpoint = root.join(archive::names::CHECKPOINT_DIRECTORY);
    let own = checkpoint.join(ROOTFS_CHANGES_FILE);
    if own.exists() {
        let want = manifest.files.get(ROOTFS_CHANGES_FILE).ok_or_else(|| {
            step("verify")(format!(
                "{source}: checkpoint/{ROOTFS_CHANGES_FILE} is not listed in the manifest"
            ))
        })?;
        let got = image_format::digest::digest_file(
            &own,
            image_format::digest::FileHasher::checking(want),
            &mut |_, _| {},
        )
        .map_err(|e| step("verify")(format!("{source}: {e}")))?;
        let same = got.size == want.size
            && if want.blake3.is_empty() {
                got.sha256 == want.sha256
            } else {
                got.blake3 == want.blake3
            };
        if !same {
            return Err(Error::PermissionDenied(format!(
                "checkpoint {source}: checkpoint/{ROOTFS_CHANGES_FILE} does not match the manifest ({} bytes found, {} listed, or another digest): the image was changed after the checkpoint",
                got.size, want.size
            )));
        }
    }
    let engine = root.join(archive::names::ROOTFS_DIFF_TAR);
    apply_changes(bundle, &own, &engine, rootfs, source, signed)?;
    // Step 7: the restored processes do not get their own checkpoint, through this mount or
    // any other of the same volume.
    remove_mounts(bundle, &root)?;
    info!(%source, signed, host = %root.display(), "checkpoint read in place from an image volume");
    Ok(Plan::RestoreInPlace(checkpoint))
}

fn mount_source(mount: &serde_json::Value) -> Option<&str> {
    mount.get("source").and_then(|s| s.as_str())
}

/// Removes from the bundle's spec every mount of the image volume `volume` (the host
/// directory [`trust::image_volume`] checked): the one the restore names and any other mount
/// of the same volume, or of a path beneath it, so the restored processes see none of it.
/// The spec is written whole, then renamed.
pub fn remove_mounts(bundle: &mut Bundle, volume: &Path) -> Result<()> {
    let mut spec = bundle.json().clone();
    let mut removed = Vec::new();
    if let Some(mounts) = spec.get_mut("mounts").and_then(|m| m.as_array_mut()) {
        mounts.retain(|m| {
            let of_volume = mount_source(m).is_some_and(|s| Path::new(s).starts_with(volume));
            if of_volume {
                removed.push(
                    m.get("destination")
                        .and_then(|d| d.as_str())
                        .unwrap_or_default()
                        .to_string(),
                );
            }
            !of_volume
        });
    }
    bundle.rewrite(spec)?;
    info!(
        volume = %volume.display(),
        destinations = ?removed,
        "mounts of the checkpoint's image volume removed from the container's spec"
    );
    Ok(())
}

/// On the restore handler, a container of a pod (its spec's annotations `annotations`) may
/// not mount an image volume of the pod that holds a checkpoint, unless it restores from that
/// volume, whose mounts [`remove_mounts`] has then taken out of its spec already: a sidecar,
/// an init or ephemeral container, or a container restoring from another source, would
/// otherwise read the memory image. Called after the container's own restore is prepared.
pub fn refuse_checkpoint_volumes(bundle: &Bundle) -> Result<()> {
    let annotations = bundle.annotations();
    if annotations.get(cri::CONTAINER_TYPE).map(String::as_str) == Some("sandbox") {
        return Ok(());
    }
    let sandbox_id = annotations
        .get(cri::SANDBOX_ID)
        .map(String::as_str)
        .unwrap_or_default();
    // Not a CRI container of a pod (no sandbox, or a bundle outside containerd's state
    // directory): it has no image volumes.
    let Ok(volumes) = trust::image_volumes_dir(bundle.path(), sandbox_id) else {
        return Ok(());
    };
    let mounts = bundle.json().get("mounts").and_then(|m| m.as_array());
    for m in mounts.into_iter().flatten() {
        let Some(source) = mount_source(m) else {
            continue;
        };
        if let Some(volume) = trust::checkpoint_volume(&volumes, source) {
            let destination = m
                .get("destination")
                .and_then(|d| d.as_str())
                .unwrap_or_default();
            let name = annotations
                .get(cri::CONTAINER_NAME)
                .map(String::as_str)
                .unwrap_or_default();
            warn!(container = name, destination, volume = %volume.display(), "refused: a checkpoint's image volume mounted by a container that does not restore from it");
            return Err(Error::PermissionDenied(format!(
                "container {name:?} mounts the image volume {} at {destination}, which holds a checkpoint: on the restore handler only the container restoring from an image volume (gpu-ckpt.io/restore-from: mount:/PATH) may mount it, and the shim takes every mount of it out of that container's spec; remove the volumeMount from this container",
                volume.display()
            )));
        }
    }
    Ok(())
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
fn fetch(
    staging: &Path,
    source: &str,
    limits: Limits,
    options: &RuntimeOptions,
) -> Result<PathBuf> {
    let sources = options.restore_sources();
    let refused = |why: String| trust::source_refused(source, &sources, why);
    let allowed_dir = trust::check_source(source, &sources)?;
    if let Some(dir) = allowed_dir {
        let path = trust::resolve_source(source, &dir, &sources)?;
        if !oci::is_image(&path) {
            if !path.is_file() {
                return Err(refused("a directory that is not an OCI image".into()));
            }
            File::open(&path).map_err(|e| refused(e.to_string()))?;
            return Ok(path);
        }
        let out = staging.join(FETCHED_ARCHIVE);
        oci::extract_archive_from_image(&path, &out, limits, &mut |_, _| {})
            .map_err(|e| refused(format!("fetch: {e}")))?;
        return Ok(out);
    }
    let out = staging.join(FETCHED_ARCHIVE);
    // Whatever fails here (a certificate, a login, a reference that is not there) is told
    // to the node's log only: before the signer and namespace are checked, the pod learns
    // nothing of what exists (docs/security.md, "One answer for every checkpoint a pod may
    // not use").
    registry::pull_archive(
        source,
        &out,
        limits,
        &options.registry_options(),
        &mut |_, _| {},
    )
    .map_err(|e| refused(format!("fetch: {e}")))?;
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

/// How a rootfs diff records what the container removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiffFormat {
    /// The shim's own copy (`gpu-ckpt-rootfs-changes.tar`, `rootfs_changes`): a whiteout is a
    /// character device 0/0 entry, an opaque directory carries the PAX record
    /// `SCHILY.xattr.trusted.overlay.opaque=y`, and every other name is a file's name.
    Own,
    /// An engine's diff (containerd's gzip tar, CRI-O's plain tar): OCI whiteouts,
    /// `.wh.<name>` and `.wh..wh..opq`.
    Oci,
}

/// Lays a container's filesystem changes over `rootfs`, the owners mapped to the host through
/// `ids` (the new container's spec). Every entry is checked before anything is changed:
/// entries that would leave the rootfs, device nodes and fifos, and whiteouts of the rootfs
/// itself or of anything above it are refused, naming the entry.
///
/// Nothing is written by path: the rootfs is opened once, every directory below it relative
/// to its parent's handle without following a symlink (an entry below a symlink is refused),
/// owners and modes set on the handle written or with `AT_SYMLINK_NOFOLLOW`, since another
/// container of the pod may already run and reach this rootfs. Owners the new spec cannot map
/// are left to root, without setuid or setgid.
pub fn apply_rootfs_diff(
    diff: &Path,
    rootfs: &Path,
    format: DiffFormat,
    ids: &Policy,
) -> Result<()> {
    // First pass: every entry checked, nothing written.
    for_each_entry(diff, &mut |path, e| {
        check_entry(path, e, format)?;
        Ok(())
    })?;
    // The rootfs is the bundle's, the shim's own path.
    let root = rootfs_changes::open_dir_at(AT_FDCWD, rootfs.as_os_str())
        .map_err(|e| Error::io(format!("open rootfs {}", rootfs.display()))(e.into()))?;
    // Second pass: applied.
    for_each_entry(diff, &mut |path, e| {
        let action = check_entry(path, e, format)?;
        let applied = match action {
            Action::Skip => Ok(()),
            Action::Remove | Action::EmptyParent => (|| {
                let Some((parent, name)) = parent_of(&root, path, false)? else {
                    // Nothing there to remove.
                    return Ok(());
                };
                if matches!(action, Action::EmptyParent) {
                    return empty_dir(&parent);
                }
                // An OCI whiteout names `.wh.<name>`; the shim's copy names the entry itself.
                let name = match format {
                    DiffFormat::Oci => OsStr::from_bytes(&name.as_bytes()[4..]),
                    DiffFormat::Own => name,
                };
                remove_any(&parent, name)
            })(),
            Action::Write { opaque } => write_entry(path, e, &root, opaque, ids),
        };
        applied.map_err(|err| match err {
            Apply::Io(what, e) => bad(path, &format!("{what}: {e}")),
            Apply::Refused(why) => bad(path, why),
        })
    })
}

fn open_diff(diff: &Path) -> Result<tar::Archive<Box<dyn Read>>> {
    let mut magic = [0u8; 2];
    let gzip = File::open(diff)
        .and_then(|mut f| f.read_exact(&mut magic))
        .map(|_| magic == [0x1f, 0x8b])
        .unwrap_or(false);
    let file = File::open(diff).map_err(Error::io(format!("open {}", diff.display())))?;
    // Decompressed no further than the reader's limit: an unsigned engine diff is the pod's.
    let reader: Box<dyn Read> = if gzip {
        Box::new(flate2::read::GzDecoder::new(file).take(Limits::default().max_total_bytes))
    } else {
        Box::new(file)
    };
    Ok(tar::Archive::new(reader))
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

/// What an entry does to the rootfs, once checked.
enum Action {
    /// Nothing (a global PAX header).
    Skip,
    /// Remove the last component (a whiteout).
    Remove,
    /// Remove everything in the parent directory (OCI's `.wh..wh..opq`).
    EmptyParent,
    /// Write the entry; `opaque`: a directory whose old contents go (the shim's PAX record).
    Write { opaque: bool },
}

fn check_entry(path: &Path, e: &mut Entry<'_>, format: DiffFormat) -> Result<Action> {
    if leaves_root(path) {
        return Err(bad(path, "leaves the rootfs"));
    }
    let header = e.header();
    let kind = header.entry_type();
    if kind.is_pax_global_extensions() {
        return Ok(Action::Skip);
    }
    if path.file_name().is_none() {
        // `./`, as some tools write it first: the rootfs keeps its own owner and mode.
        if kind.is_dir() {
            return Ok(Action::Skip);
        }
        return Err(bad(path, "names the rootfs itself"));
    }
    if format == DiffFormat::Own && is_whiteout_device(header) {
        return Ok(Action::Remove);
    }
    check_kind(path, kind)?;
    if kind.is_hard_link() {
        check_link_target(path, e)?;
    }
    match format {
        DiffFormat::Own => Ok(Action::Write {
            opaque: kind.is_dir() && is_opaque(e)?,
        }),
        DiffFormat::Oci => oci_action(path, e),
    }
}

/// Whether `path` (an entry's name, or a hard link's target) is absolute or has a component
/// other than a name or `.`.
fn leaves_root(path: &Path) -> bool {
    path.is_absolute()
        || path
            .components()
            .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
}

/// The shim's whiteout: a character device 0/0.
fn is_whiteout_device(header: &tar::Header) -> bool {
    header.entry_type().is_character_special()
        && header.device_major().ok().flatten() == Some(0)
        && header.device_minor().ok().flatten() == Some(0)
}

/// Only files, directories, symlinks and hard links.
fn check_kind(path: &Path, kind: tar::EntryType) -> Result<()> {
    if kind.is_character_special() || kind.is_block_special() || kind.is_fifo() {
        return Err(bad(path, "device nodes and fifos are not allowed"));
    }
    if !(kind.is_file() || kind.is_dir() || kind.is_symlink() || kind.is_hard_link()) {
        return Err(bad(
            path,
            &format!("entries of type {kind:?} are not allowed"),
        ));
    }
    Ok(())
}

/// A hard link's target: a file below the rootfs.
fn check_link_target(path: &Path, e: &mut Entry<'_>) -> Result<()> {
    let target = e
        .link_name()
        .map_err(Error::io("rootfs diff link"))?
        .unwrap_or_default();
    if leaves_root(&target) || target.file_name().is_none() {
        return Err(bad(path, "hard link leaves the rootfs"));
    }
    Ok(())
}

/// Whether a directory of the shim's copy carries the opaque PAX record.
fn is_opaque(e: &mut Entry<'_>) -> Result<bool> {
    Ok(e.pax_extensions()
        .map_err(Error::io("rootfs diff PAX record"))?
        .into_iter()
        .flatten()
        .any(|x| {
            x.is_ok_and(|x| {
                x.key() == Ok(rootfs_changes::OPAQUE_PAX_KEY) && x.value_bytes() == b"y"
            })
        }))
}

/// An engine diff's entry: an OCI whiteout (checked) or an entry to write.
fn oci_action(path: &Path, e: &mut Entry<'_>) -> Result<Action> {
    // The name as written: `Path` drops a trailing `.`, so `.wh..` must be seen in the bytes.
    let raw = e.path_bytes();
    let raw = String::from_utf8_lossy(&raw);
    let last = raw
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or_default();
    let name = file_name(path);
    for n in [last, &name] {
        if let Some(why) = bad_whiteout(n) {
            return Err(bad(path, why));
        }
    }
    Ok(match name.strip_prefix(".wh.") {
        Some(".wh..opq") => Action::EmptyParent,
        Some(_) => Action::Remove,
        None => Action::Write { opaque: false },
    })
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Why applying one entry failed: the call that failed, or a refusal.
enum Apply {
    Io(&'static str, nix::Error),
    Refused(&'static str),
}

type Applied<T> = std::result::Result<T, Apply>;

fn sys(what: &'static str) -> impl FnOnce(nix::Error) -> Apply {
    move |e| Apply::Io(what, e)
}

/// The parent directory of `path` below `root` (the components of `path` but the last,
/// created with mode 0755 where missing when `create`; `None` where one is missing and not
/// `create`), and the last component.
fn parent_of<'p>(
    root: &OwnedFd,
    path: &'p Path,
    create: bool,
) -> Applied<Option<(OwnedFd, &'p OsStr)>> {
    let mut comps: Vec<&OsStr> = path
        .components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n),
            _ => None,
        })
        .collect();
    let last = comps
        .pop()
        .ok_or(Apply::Refused("names the rootfs itself"))?;
    let mut cur = nix::fcntl::openat(
        root,
        c".",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(sys("open the rootfs"))?;
    for c in comps {
        cur = match rootfs_changes::open_dir_at(&cur, c) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) if create => {
                match nix::sys::stat::mkdirat(&cur, c, Mode::from_bits_truncate(0o755)) {
                    Ok(()) | Err(Errno::EEXIST) => {}
                    Err(e) => return Err(Apply::Io("create a parent directory", e)),
                }
                rootfs_changes::open_dir_at(&cur, c).map_err(sys("open a parent directory"))?
            }
            Err(Errno::ENOENT) => return Ok(None),
            // A symlink (ELOOP) or a file (ENOTDIR) where a directory should be: the entry
            // would land wherever it points.
            Err(Errno::ELOOP | Errno::ENOTDIR) => {
                return Err(Apply::Refused("below a symlink or a file"))
            }
            Err(e) => return Err(Apply::Io("open a parent directory", e)),
        };
    }
    Ok(Some((cur, last)))
}

/// Writes one file, directory, symlink or hard link entry below `root`.
fn write_entry(
    path: &Path,
    e: &mut Entry<'_>,
    root: &OwnedFd,
    opaque: bool,
    ids: &Policy,
) -> Applied<()> {
    let (parent, name) = parent_of(root, path, true)?.ok_or(Apply::Refused("no parent"))?;
    let header = e.header().clone();
    let kind = header.entry_type();
    let meta = Meta::of(&header, ids);
    let existing = nix::sys::stat::fstatat(&parent, name, AtFlags::AT_SYMLINK_NOFOLLOW);
    if kind.is_dir() {
        let is_dir = matches!(&existing, Ok(st) if rootfs_changes::kind(st) == SFlag::S_IFDIR);
        return write_dir(&parent, name, is_dir, existing.is_ok(), opaque, &meta);
    }
    if existing.is_ok() {
        remove_any(&parent, name)?;
    }
    if kind.is_symlink() {
        return write_symlink(&parent, name, e, meta.owner);
    }
    if kind.is_hard_link() {
        return write_hard_link(root, &parent, name, e);
    }
    write_file(&parent, name, e, &meta)
}

/// What an entry's header says of its owner, mode and time, as they are written.
struct Meta {
    /// The owner through the new spec's mappings; `None` where it cannot be kept (root's).
    owner: Option<(u32, u32)>,
    mode: Mode,
    mtime: TimeSpec,
}

impl Meta {
    fn of(header: &tar::Header, ids: &Policy) -> Meta {
        let mut mode = header.mode().unwrap_or(0o600) & 0o7777;
        let uid = header.uid().ok().and_then(|u| u32::try_from(u).ok());
        let gid = header.gid().ok().and_then(|g| u32::try_from(g).ok());
        // The owner through the new spec's mappings; where it cannot be kept, root's, and no
        // setuid or setgid bit.
        let owner = uid.zip(gid).and_then(|(u, g)| ids.host_owner(u, g));
        if owner.is_none() {
            mode &= !0o6000;
        }
        Meta {
            owner,
            mode: Mode::from_bits_truncate(mode),
            mtime: TimeSpec::new(header.mtime().unwrap_or(0).min(i64::MAX as u64) as i64, 0),
        }
    }

    /// The owner first (a change of owner clears setuid), then the mode and time, on the
    /// handle `fd`.
    fn set_on<Fd: AsFd>(&self, fd: &Fd) -> Applied<()> {
        if let Some((u, g)) = self.owner {
            nix::unistd::fchown(fd, Some(Uid::from_raw(u)), Some(Gid::from_raw(g)))
                .map_err(sys("set the owner"))?;
        }
        nix::sys::stat::fchmod(fd, self.mode).map_err(sys("set the mode"))?;
        nix::sys::stat::futimens(fd, &TimeSpec::UTIME_OMIT, &self.mtime)
            .map_err(sys("set the time"))
    }
}

/// A directory entry: the directory at `name` in `parent` (made where something else, or
/// nothing, `exists` there), emptied first if `opaque`.
fn write_dir(
    parent: &OwnedFd,
    name: &OsStr,
    is_dir: bool,
    exists: bool,
    opaque: bool,
    meta: &Meta,
) -> Applied<()> {
    if !is_dir {
        if exists {
            remove_any(parent, name)?;
        }
        nix::sys::stat::mkdirat(parent, name, Mode::from_bits_truncate(0o700))
            .map_err(sys("create the directory"))?;
    }
    let dir = rootfs_changes::open_dir_at(parent, name).map_err(sys("open the directory"))?;
    if opaque {
        empty_dir(&dir)?;
    }
    meta.set_on(&dir)
}

/// A symlink entry, given `owner` through a handle on the link itself.
fn write_symlink(
    parent: &OwnedFd,
    name: &OsStr,
    e: &Entry<'_>,
    owner: Option<(u32, u32)>,
) -> Applied<()> {
    let target = e
        .link_name_bytes()
        .ok_or(Apply::Refused("a symlink without a target"))?;
    nix::unistd::symlinkat(OsStr::from_bytes(&target), parent, name)
        .map_err(sys("create the symlink"))?;
    let Some((u, g)) = owner else {
        return Ok(());
    };
    // Through a handle on the link just made, not by its name: a file renamed onto the name in
    // between would otherwise get the entry's owner.
    let link = nix::fcntl::openat(
        parent,
        name,
        OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(sys("open the symlink"))?;
    let st = nix::sys::stat::fstat(&link).map_err(sys("stat the symlink"))?;
    if rootfs_changes::kind(&st) != SFlag::S_IFLNK {
        return Err(Apply::Refused(
            "replaced by something else while it was applied",
        ));
    }
    nix::unistd::fchownat(
        &link,
        "",
        Some(Uid::from_raw(u)),
        Some(Gid::from_raw(g)),
        AtFlags::AT_EMPTY_PATH | AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .map_err(sys("set the symlink's owner"))
}

/// A hard link entry, to a file already below `root`.
fn write_hard_link(root: &OwnedFd, parent: &OwnedFd, name: &OsStr, e: &Entry<'_>) -> Applied<()> {
    let target = e
        .link_name()
        .ok()
        .flatten()
        .ok_or(Apply::Refused("a hard link without a target"))?
        .into_owned();
    let (tparent, tname) = parent_of(root, &target, false)?
        .ok_or(Apply::Refused("hard link to a file that is not there"))?;
    // Flags 0: a symlink at the target is linked itself, never followed.
    nix::unistd::linkat(&tparent, tname, parent, name, AtFlags::empty())
        .map_err(sys("create the hard link"))
}

/// A file entry: made new (nothing is there any more), its contents copied.
fn write_file(parent: &OwnedFd, name: &OsStr, e: &mut Entry<'_>, meta: &Meta) -> Applied<()> {
    let fd = nix::fcntl::openat(
        parent,
        name,
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o600),
    )
    .map_err(sys("create the file"))?;
    let mut file = File::from(fd);
    std::io::copy(e, &mut file).map_err(|err| Apply::Io("write the file", io_errno(&err)))?;
    meta.set_on(&file)
}

/// The errno of an I/O error (EIO where it has none).
fn io_errno(e: &std::io::Error) -> nix::Error {
    Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))
}

/// Removes everything in the directory `dir`, never following a symlink.
fn empty_dir(dir: &OwnedFd) -> Applied<()> {
    let names = rootfs_changes::list(dir.as_fd())
        .map_err(|e| Apply::Io("list the directory", io_errno(&e)))?;
    for name in names {
        remove_any(dir, OsStr::from_bytes(&name))?;
    }
    Ok(())
}

/// Removes `name` in the directory `parent` (a directory with everything in it), never
/// following a symlink; nothing there is not an error.
fn remove_any(parent: &OwnedFd, name: &OsStr) -> Applied<()> {
    if name.is_empty() || name == "." || name == ".." || name.as_bytes().contains(&b'/') {
        return Err(Apply::Refused("whiteout target outside the rootfs"));
    }
    match rootfs_changes::open_dir_at(parent, name) {
        Ok(dir) => {
            empty_dir(&dir)?;
            nix::unistd::unlinkat(parent, name, UnlinkatFlags::RemoveDir)
                .map_err(sys("remove the directory"))
        }
        Err(Errno::ENOENT) => Ok(()),
        // Not a directory (a symlink included): removed itself.
        Err(Errno::ENOTDIR | Errno::ELOOP) => {
            match nix::unistd::unlinkat(parent, name, UnlinkatFlags::NoRemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => Ok(()),
                Err(e) => Err(Apply::Io("remove", e)),
            }
        }
        Err(e) => Err(Apply::Io("open to remove", e)),
    }
}

/// Whether `dir` is a checkpoint containerd extracted for `ctr container restore` (its task
/// service's Create: `os.MkdirTemp(os.Getenv("XDG_RUNTIME_DIR"), "ctrd-checkpoint")`, which it
/// never removes): a `ctrd-checkpoint*` directory directly in `$XDG_RUNTIME_DIR` or, where that
/// is unset, in the temporary directory the shim inherited from containerd. CRI's restore passes
/// a directory of its own, and a caller's `CriuImagePath` is the caller's.
pub fn is_containerd_extracted_checkpoint(dir: &Path) -> bool {
    let runtime_dir = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty());
    let parent = runtime_dir
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    extracted_in(dir, &parent)
}

fn extracted_in(dir: &Path, parent: &Path) -> bool {
    dir.parent() == Some(parent)
        && dir
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("ctrd-checkpoint"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_containerds_own_extraction_counts_as_its_temp_checkpoint() {
        let tmp = Path::new("/tmp");
        assert!(extracted_in(Path::new("/tmp/ctrd-checkpoint1234"), tmp));
        // CRI's restore directory, a caller's directory, a nested one: not containerd's temp.
        assert!(!extracted_in(
            Path::new("/var/lib/containerd/c/ctrd-checkpoint"),
            tmp
        ));
        assert!(!extracted_in(Path::new("/tmp/my-checkpoint"), tmp));
        assert!(!extracted_in(Path::new("/tmp/x/ctrd-checkpoint1"), tmp));
        assert!(!extracted_in(Path::new(""), tmp));
    }

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
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn no_userns() -> Policy {
        Policy::from_spec(&serde_json::json!({})).unwrap()
    }

    /// One entry of a test's copy: name, type, uid, gid, mode, data.
    type TestEntry<'a> = (&'a str, tar::EntryType, u64, u64, u32, &'a [u8]);

    /// A tar of the given entries, as the shim's copy.
    fn own_copy(entries: &[TestEntry<'_>]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(ROOTFS_CHANGES_FILE);
        let mut b = tar::Builder::new(File::create(&path).unwrap());
        for (name, kind, uid, gid, mode, data) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(*kind);
            h.set_uid(*uid);
            h.set_gid(*gid);
            h.set_mode(*mode);
            if *kind == tar::EntryType::Symlink {
                h.set_size(0);
                b.append_link(&mut h, name, std::str::from_utf8(data).unwrap())
                    .unwrap();
            } else {
                h.set_size(data.len() as u64);
                if *kind == tar::EntryType::Char {
                    h.set_device_major(0).unwrap();
                    h.set_device_minor(0).unwrap();
                }
                b.append_data(&mut h, name, *data).unwrap();
            }
        }
        b.into_inner().unwrap().flush().unwrap();
        (dir, path)
    }

    #[test]
    fn the_shims_copy_keeps_owners_and_reads_whiteouts_only_from_devices() {
        use tar::EntryType::{Char, Directory, Regular, Symlink};
        let rootfs = tempfile::tempdir().unwrap();
        let r = rootfs.path();
        std::fs::write(r.join("gone"), "old").unwrap();
        std::fs::write(r.join("notes"), "lower").unwrap();
        std::fs::create_dir(r.join("was-dir")).unwrap();
        std::fs::write(r.join("was-dir/f"), "f").unwrap();
        let (_d, path) = own_copy(&[
            (".wh.notes", Regular, 0, 0, 0o644, b"mine"),
            (".wh..wh..opq", Regular, 0, 0, 0o644, b"also mine"),
            ("gone", Char, 0, 0, 0, b""),
            ("home", Directory, 1000, 1000, 0o750, b""),
            ("home/suid", Regular, 1000, 1000, 0o4755, b"#!"),
            ("home/sgid", Regular, 0, 2000, 0o2755, b"#!"),
            ("home/link", Symlink, 1000, 1000, 0o777, b"/etc/shadow"),
            ("was-dir", Regular, 0, 0, 0o600, b"now a file"),
        ]);
        apply_rootfs_diff(&path, r, DiffFormat::Own, &no_userns()).unwrap();
        assert_eq!(
            std::fs::read_to_string(r.join(".wh.notes")).unwrap(),
            "mine"
        );
        assert_eq!(
            std::fs::read_to_string(r.join(".wh..wh..opq")).unwrap(),
            "also mine"
        );
        assert_eq!(std::fs::read_to_string(r.join("notes")).unwrap(), "lower");
        assert!(!r.join("gone").exists());
        let stat = |p: &str| {
            let m = std::fs::symlink_metadata(r.join(p)).unwrap();
            (m.uid(), m.gid(), m.mode() & 0o7777)
        };
        assert_eq!(stat("home"), (1000, 1000, 0o750));
        assert_eq!(stat("home/suid"), (1000, 1000, 0o4755));
        assert_eq!(stat("home/sgid"), (0, 2000, 0o2755));
        assert_eq!(stat("home/link").0, 1000);
        assert_eq!(
            std::fs::read_link(r.join("home/link")).unwrap(),
            Path::new("/etc/shadow")
        );
        assert_eq!(
            std::fs::read_to_string(r.join("was-dir")).unwrap(),
            "now a file"
        );

        // Into a user namespace: owners mapped; one the mappings do not cover stays root's,
        // without its setuid bit.
        let spec = serde_json::json!({"linux": {
            "uidMappings": [{"containerID": 0, "hostID": 100000, "size": 1500}],
            "gidMappings": [{"containerID": 0, "hostID": 100000, "size": 65536}]}});
        let ids = Policy::from_spec(&spec).unwrap();
        let rootfs = tempfile::tempdir().unwrap();
        let r = rootfs.path();
        let (_d, path) = own_copy(&[
            ("mapped", Regular, 1000, 1000, 0o4755, b"#!"),
            ("unmapped", Regular, 2000, 1000, 0o6755, b"#!"),
        ]);
        apply_rootfs_diff(&path, r, DiffFormat::Own, &ids).unwrap();
        assert_eq!(stat_of(&r.join("mapped")), (101000, 101000, 0o4755));
        assert_eq!(stat_of(&r.join("unmapped")), (0, 0, 0o755));
    }

    fn stat_of(p: &Path) -> (u32, u32, u32) {
        let m = std::fs::symlink_metadata(p).unwrap();
        (m.uid(), m.gid(), m.mode() & 0o7777)
    }

    #[test]
    fn nothing_is_written_through_a_symlink_in_the_rootfs() {
        use tar::EntryType::{Char, Directory, Regular};
        let (_bundle, [rootfs, outside]) = temp_dirs(["rootfs", "outside"]);
        std::fs::write(outside.join("victim"), "v").unwrap();
        std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o700)).unwrap();
        // What a sidecar may have put in the rootfs: a link where a directory is expected.
        std::os::unix::fs::symlink(&outside, rootfs.join("x")).unwrap();
        for (name, kind) in [
            ("x/planted", Regular),
            ("x/victim", Char),
            ("x/sub", Directory),
        ] {
            let (_d, path) = own_copy(&[(name, kind, 0, 0, 0o644, b"")]);
            let err = apply_rootfs_diff(&path, &rootfs, DiffFormat::Own, &no_userns())
                .unwrap_err()
                .to_string();
            assert!(err.contains(name) && err.contains("symlink"), "{err}");
        }
        assert!(!outside.join("planted").exists() && !outside.join("sub").exists());
        assert!(outside.join("victim").exists());
        assert_eq!(stat_of(&outside).2, 0o700);
        // A link in the entry's own place is replaced, never written through.
        let (_d, path) = own_copy(&[("x", Directory, 0, 0, 0o755, b"")]);
        apply_rootfs_diff(&path, &rootfs, DiffFormat::Own, &no_userns()).unwrap();
        assert!(std::fs::symlink_metadata(rootfs.join("x"))
            .unwrap()
            .is_dir());
        assert_eq!(stat_of(&outside).2, 0o700);
        // The shim's copy refuses device nodes other than whiteouts.
        let (_d, path) = own_copy(&[("dev", Char, 0, 0, 0o644, b"")]);
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(Char);
        h.set_device_major(1).unwrap();
        h.set_device_minor(3).unwrap();
        h.set_size(0);
        let mut b = tar::Builder::new(File::create(&path).unwrap());
        b.append_data(&mut h, "dev", std::io::empty()).unwrap();
        b.into_inner().unwrap();
        let err = apply_rootfs_diff(&path, &rootfs, DiffFormat::Own, &no_userns())
            .unwrap_err()
            .to_string();
        assert!(err.contains("device nodes"), "{err}");
        // The rootfs itself: a `./` directory entry leaves it as it is, anything else there
        // is refused.
        std::fs::set_permissions(&rootfs, std::fs::Permissions::from_mode(0o711)).unwrap();
        let (_d, path) = own_copy(&[("./", Directory, 1000, 1000, 0o777, b"")]);
        apply_rootfs_diff(&path, &rootfs, DiffFormat::Own, &no_userns()).unwrap();
        assert_eq!(stat_of(&rootfs), (0, 0, 0o711));
        let (_d, path) = own_copy(&[(".", Regular, 0, 0, 0o644, b"x")]);
        let err = apply_rootfs_diff(&path, &rootfs, DiffFormat::Own, &no_userns())
            .unwrap_err()
            .to_string();
        assert!(err.contains("names the rootfs itself"), "{err}");
    }

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
        apply_rootfs_diff(&path, rootfs.path(), DiffFormat::Oci, &no_userns()).unwrap();
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
        let err = apply_rootfs_diff(&path, rootfs.path(), DiffFormat::Oci, &no_userns())
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
            let err = apply_rootfs_diff(&path, &rootfs, DiffFormat::Oci, &no_userns())
                .unwrap_err()
                .to_string();
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
    fn mount_sources_name_an_absolute_clean_path() {
        assert_eq!(
            trust::mount_destination("mount:/ckpt/").unwrap().unwrap(),
            "/ckpt"
        );
        assert!(trust::mount_destination("/var/ckpt.tar").is_none());
        for bad in [
            "mount:",
            "mount:/",
            "mount:ckpt",
            "mount:/a/../b",
            "mount:/a//b",
        ] {
            let err = trust::mount_destination(bad).unwrap().unwrap_err();
            assert!(err.to_string().contains(bad), "{err}");
        }
    }

    /// A containerd state directory with the bundle of container c1 in k8s.io: the directory,
    /// the bundle and the pods' image volume directory (not made).
    fn state_with_bundle() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let state = tempfile::tempdir().unwrap();
        let bundle = state.path().join("io.containerd.runtime.v2.task/k8s.io/c1");
        std::fs::create_dir_all(&bundle).unwrap();
        let volumes = state.path().join(trust::IMAGE_VOLUMES);
        (state, bundle, volumes)
    }

    #[test]
    fn only_a_mount_point_in_the_pods_image_volume_directory_is_an_image_volume() {
        let (_state, bundle, volumes) = state_with_bundle();
        let mine = volumes.join("sb1/img");
        let theirs = volumes.join("sb2/img");
        std::fs::create_dir_all(&mine).unwrap();
        std::fs::create_dir_all(&theirs).unwrap();
        let spec = |src: &Path, opts: &[&str]| {
            serde_json::json!({"mounts": [{"destination": "/ckpt", "type": "bind",
                "source": src, "options": opts}]})
        };
        let check = |spec: &serde_json::Value, dest: &str| {
            trust::image_volume(&bundle, spec, dest, "sb1", "mount:/ckpt")
                .unwrap_err()
                .to_string()
        };
        let err = check(&spec(&mine, &["rbind", "ro"]), "/other");
        assert!(err.contains("no mount at /other"), "{err}");
        let err = check(&spec(&theirs, &["rbind", "ro"]), "/ckpt");
        assert!(err.contains("not an image volume of this pod"), "{err}");
        let err = check(&spec(&mine.join("../img"), &["rbind", "ro"]), "/ckpt");
        assert!(err.contains("not an image volume of this pod"), "{err}");
        let err = check(&spec(&mine, &["rbind", "rw"]), "/ckpt");
        assert!(err.contains("not a read-only bind"), "{err}");
        // In the right place, but a directory, not the image's mounted snapshot.
        let err = check(&spec(&mine, &["rbind", "ro"]), "/ckpt");
        assert!(err.contains("not a mount point"), "{err}");
    }

    #[test]
    fn every_mount_of_the_checkpoint_volume_goes_and_only_the_restoring_container_may_mount_it() {
        let (_state, bundle, volumes) = state_with_bundle();
        let volumes = volumes.join("sb1");
        let ckpt = volumes.join("img");
        let weights = volumes.join("weights");
        std::fs::create_dir_all(ckpt.join("checkpoint")).unwrap();
        std::fs::create_dir_all(&weights).unwrap();
        let annotations = |kind: &str| {
            serde_json::json!({
                cri::CONTAINER_TYPE: kind,
                cri::CONTAINER_NAME: "sidecar",
                cri::SANDBOX_ID: "sb1",
            })
        };
        let write_as = |kind: &str, mounts: &[(&str, &Path)]| -> Bundle {
            let mounts: Vec<_> = mounts
                .iter()
                .map(|(d, s)| serde_json::json!({"destination": d, "type": "bind", "source": s, "options": ["rbind", "ro"]}))
                .collect();
            std::fs::write(
                bundle.join("config.json"),
                serde_json::json!({"ociVersion": "1.0.2", "mounts": mounts, "annotations": annotations(kind)}).to_string(),
            )
            .unwrap();
            Bundle::load(&bundle).unwrap()
        };
        let write = |mounts: &[(&str, &Path)]| write_as("container", mounts);
        let destinations = || -> Vec<String> {
            Bundle::load(&bundle).unwrap().json()["mounts"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["destination"].as_str().unwrap().to_string())
                .collect()
        };
        // The restoring container: the volume at /ckpt, again at /also, a subPath at /sub; a
        // sibling whose name starts the same, and another volume, stay.
        let sibling = volumes.join("img2");
        let mut restoring = write(&[
            ("/ckpt", &ckpt),
            ("/also", &ckpt),
            ("/sub", &ckpt.join("checkpoint")),
            ("/img2", &sibling),
            ("/weights", &weights),
        ]);
        remove_mounts(&mut restoring, &ckpt).unwrap();
        assert_eq!(destinations(), ["/img2", "/weights"]);
        assert_eq!(restoring.json(), Bundle::load(&bundle).unwrap().json());

        // What is left mounts no checkpoint: allowed.
        refuse_checkpoint_volumes(&restoring).unwrap();
        // A sidecar with the volume, or a subPath of it: refused, naming the mount.
        for (dest, src) in [("/data", ckpt.clone()), ("/pages", ckpt.join("checkpoint"))] {
            let sidecar = write(&[("/weights", &weights), (dest, &src)]);
            let err = refuse_checkpoint_volumes(&sidecar).unwrap_err().to_string();
            assert!(
                err.contains(&format!(
                    "mounts the image volume {} at {dest}, which holds a checkpoint",
                    ckpt.display()
                )),
                "{err}"
            );
        }
        // The pod's sandbox container is not one of its containers.
        let pages = ckpt.join("checkpoint");
        let sandbox = write_as("sandbox", &[("/weights", &weights), ("/pages", &pages)]);
        refuse_checkpoint_volumes(&sandbox).unwrap();
    }

    #[test]
    fn whiteouts_never_follow_links_out() {
        let bundle = tempfile::tempdir().unwrap();
        let rootfs = bundle.path().join("rootfs");
        std::fs::create_dir_all(&rootfs).unwrap();
        std::fs::write(bundle.path().join("outside"), "o").unwrap();
        std::os::unix::fs::symlink("..", rootfs.join("up")).unwrap();
        let (_d, path) = diff(&[("up/.wh.outside", b"")], false);
        let err = apply_rootfs_diff(&path, &rootfs, DiffFormat::Oci, &no_userns())
            .unwrap_err()
            .to_string();
        assert!(err.contains("up/.wh.outside"), "{err}");
        assert!(bundle.path().join("outside").exists());
    }
}
