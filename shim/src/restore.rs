//! The restore handler's own restore (RuntimeClass `gpu-ckpt-restore`): a container whose pod
//! names a checkpoint in `gpu-ckpt.io/restore-from` is restored by the shim at Start, without
//! containerd's restore-via-create (off by default from containerd 2.2.7/2.3.4, gone in 2.4).
//!
//! At Create: fetch the checkpoint (an archive path, an OCI checkpoint image on disk, or an image
//! reference in a registry), check that it belongs to this container and can run here, unpack
//! it (every entry checked, every digest verified), and lay its rootfs diff over the rootfs.
//! Start then restores from the unpacked `checkpoint/` directory like any other restore.
//!
//! `mount:/PATH` names an image volume of the pod (Kubernetes `volumes[].image`, which the
//! kubelet pulled with the pod's own credentials): the checkpoint image's layer, unpacked by
//! containerd and mounted read-only. Nothing is copied: its files are checked where they lie
//! (no links, no special files, limits), the metadata read, the same admission checks run, and
//! Start verifies every digest in place before and while CRIU reads it. The mount is removed
//! from the spec of the container that is started, so the restored processes never see it.

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
    /// The id of the container's pod sandbox (CRI), which owns its image volumes.
    pub sandbox_id: &'a str,
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
    if !matches!(result, Ok(Plan::Restore(_) | Plan::RestoreInPlace(_))) {
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
    if let Some(destination) = trust::mount_destination(source) {
        return prepare_from_mount(bundle, rootfs, source, &destination?, me, ann, options);
    }
    // Step 1: fetch, from a source RestoreSources lists (checked before anything is opened).
    let archive = fetch(bundle, source, limits, options)?;
    // Step 2: read every header (hostile entries are refused here) and the metadata.
    let info = archive::read_info(&archive, limits)
        .map_err(|e| step("check")(format!("{source}: {e}")))?;
    let signed = match admit(bundle, &info, source, me, ann, options)? {
        Admitted::Fits { signed } => signed,
        Admitted::ColdStart(why) => return Ok(Plan::ColdStart(why)),
    };
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
    apply_changes(&own, &engine, rootfs, source, signed)?;
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
fn admit(
    bundle: &Path,
    info: &ArchiveInfo,
    source: &str,
    me: &Identity<'_>,
    ann: &Annotations,
    options: &RuntimeOptions,
) -> Result<Admitted> {
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
    }
    if !differences.is_empty() {
        let why = differences.join("; ");
        return match ann.get(annotations::ON_INCOMPATIBLE) {
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

/// Lays the container's own changes to its filesystem over `rootfs`: the signed copy `own`
/// in checkpoint/ (already verified against the manifest), or, for an unsigned checkpoint
/// without one, the engine's rootfs-diff.tar `engine`.
fn apply_changes(
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
        apply_rootfs_diff(diff, rootfs).map_err(|e| step("rootfs-diff")(e.to_string()))?;
    }
    Ok(())
}

/// The restore from the image volume at `destination` (`mount:/PATH`): checked and read in
/// place, the rootfs changes applied, and the mount removed from the container's spec.
fn prepare_from_mount(
    bundle: &Path,
    rootfs: &Path,
    source: &str,
    destination: &str,
    me: &Identity<'_>,
    ann: &Annotations,
    options: &RuntimeOptions,
) -> Result<Plan> {
    let limits = Limits::default();
    // Step 1: the mount, which must be an image volume of this pod (trust::image_volume).
    let spec = read_spec(bundle)?;
    let root = trust::image_volume(bundle, &spec, destination, me.sandbox_id, source)?;
    // Step 2: every entry checked where it lies (a hostile image's layer), the metadata read.
    let info = read_dir_info(&root, limits).map_err(|e| step("check")(format!("{source}: {e}")))?;
    // Steps 3 to 5: the same admission as any other source.
    let signed = match admit(bundle, &info, source, me, ann, options)? {
        Admitted::Fits { signed } => signed,
        Admitted::ColdStart(why) => {
            remove_mount(bundle, destination)?;
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
    apply_changes(&own, &engine, rootfs, source, signed)?;
    // Step 7: the restored processes do not get their own checkpoint.
    remove_mount(bundle, destination)?;
    info!(%source, signed, host = %root.display(), "checkpoint read in place from an image volume");
    Ok(Plan::RestoreInPlace(checkpoint))
}

fn read_spec(bundle: &Path) -> Result<serde_json::Value> {
    let path = bundle.join("config.json");
    let text = std::fs::read(&path).map_err(Error::io(format!("read {}", path.display())))?;
    serde_json::from_slice(&text).map_err(|e| {
        Error::InvalidArgument(format!("malformed bundle config {}: {e}", path.display()))
    })
}

/// Removes the mount at `destination` from the bundle's spec (written whole, then renamed).
pub fn remove_mount(bundle: &Path, destination: &str) -> Result<()> {
    let mut spec = read_spec(bundle)?;
    if let Some(mounts) = spec.get_mut("mounts").and_then(|m| m.as_array_mut()) {
        mounts.retain(|m| {
            m.get("destination")
                .and_then(|d| d.as_str())
                .is_none_or(|d| d.trim_end_matches('/') != destination)
        });
    }
    let path = bundle.join("config.json");
    let tmp = bundle.join(".config.json.gpu-ckpt");
    let data = serde_json::to_vec(&spec)
        .map_err(|e| Error::InvalidArgument(format!("bundle config {}: {e}", path.display())))?;
    let mode = std::fs::metadata(&path)
        .map(|m| m.permissions())
        .map_err(Error::io(format!("stat {}", path.display())))?;
    std::fs::write(&tmp, data).map_err(Error::io(format!("write {}", tmp.display())))?;
    std::fs::set_permissions(&tmp, mode).map_err(Error::io(format!("chmod {}", tmp.display())))?;
    std::fs::rename(&tmp, &path).map_err(Error::io(format!("replace {}", path.display())))?;
    info!(
        destination,
        "mount of the checkpoint removed from the container's spec"
    );
    Ok(())
}

/// The metadata of a checkpoint laid out as a directory (an image volume: the checkpoint
/// image's layer, unpacked by containerd), checked like an archive's entries: only
/// directories and regular files (no links, devices, fifos or sockets, nothing followed),
/// within `limits`, `checkpoint/` flat, and the small JSON members read with the archive
/// reader's size bound.
pub fn read_dir_info(root: &Path, limits: Limits) -> image_format::Result<ArchiveInfo> {
    use image_format::Error as E;
    use std::os::unix::fs::FileTypeExt;
    let io = |what: &'static str, p: &Path| {
        let path = p.to_path_buf();
        move |source| E::Io { what, path, source }
    };
    let mut info = ArchiveInfo::default();
    let (mut entries, mut total) = (0u64, 0u64);
    let mut stack = vec![(root.to_path_buf(), String::new())];
    while let Some((dir, rel)) = stack.pop() {
        for entry in std::fs::read_dir(&dir).map_err(io("reading", &dir))? {
            let entry = entry.map_err(io("reading", &dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = if rel.is_empty() {
                name.clone()
            } else {
                format!("{rel}/{name}")
            };
            entries += 1;
            if entries > limits.max_entries {
                return Err(E::TooManyEntries {
                    entry: path,
                    limit: limits.max_entries,
                });
            }
            // lstat: a link is seen as a link, never followed.
            let meta =
                std::fs::symlink_metadata(entry.path()).map_err(io("reading", &entry.path()))?;
            let kind = meta.file_type();
            if kind.is_dir() {
                if rel == archive::names::CHECKPOINT_DIRECTORY {
                    return Err(E::ForbiddenType {
                        entry: path,
                        kind: "subdirectory (checkpoint/ holds only CRIU images)",
                    });
                }
                stack.push((entry.path(), path));
                continue;
            }
            if !kind.is_file() {
                let kind = if kind.is_symlink() {
                    "symbolic link"
                } else if kind.is_block_device() || kind.is_char_device() {
                    "device node"
                } else if kind.is_fifo() {
                    "fifo"
                } else {
                    "socket"
                };
                return Err(E::ForbiddenType { entry: path, kind });
            }
            let size = meta.len();
            if size > limits.max_entry_bytes {
                return Err(E::EntryTooLarge {
                    entry: path,
                    size,
                    limit: limits.max_entry_bytes,
                });
            }
            total += size;
            if total > limits.max_total_bytes {
                return Err(E::ArchiveTooLarge {
                    entry: path,
                    total,
                    limit: limits.max_total_bytes,
                });
            }
            info.take_member(&path, || {
                if size > archive::MAX_METADATA_BYTES {
                    return Err(E::EntryTooLarge {
                        entry: path.clone(),
                        size,
                        limit: archive::MAX_METADATA_BYTES,
                    });
                }
                let f = open_no_follow(&entry.path()).map_err(io("opening", &entry.path()))?;
                let mut v = Vec::new();
                f.take(archive::MAX_METADATA_BYTES)
                    .read_to_end(&mut v)
                    .map_err(io("reading", &entry.path()))?;
                Ok(v)
            })?;
        }
    }
    Ok(info)
}

fn open_no_follow(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
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
        oci::extract_archive_from_image(&path, &out, limits, &mut |_, _| {})
            .map_err(|e| step("fetch")(format!("{source}: {e}")))?;
        return Ok(out);
    }
    let out = bundle.join(FETCHED_ARCHIVE);
    let _ = std::fs::remove_file(&out);
    // The reference passed RestoreSources above, so the cause (a certificate, a login, a
    // missing reference) is told in full, as for an image on disk.
    image_format::registry::pull_archive(
        source,
        &out,
        limits,
        &options.registry_options(),
        &mut |_, _| {},
    )
    .map_err(|e| step("fetch")(format!("{source}: {e}")))?;
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

    #[test]
    fn a_checkpoint_directory_with_links_or_special_files_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = dir.path().join("checkpoint");
        std::fs::create_dir(&ckpt).unwrap();
        std::fs::write(ckpt.join("inventory.img"), b"x").unwrap();
        std::fs::write(dir.path().join("spec.dump"), b"{}").unwrap();
        let info = read_dir_info(dir.path(), Limits::default()).unwrap();
        assert!(info.spec_dump.is_some());
        assert!(info.manifest.is_none());

        std::os::unix::fs::symlink("/etc/shadow", ckpt.join("pages-1.img")).unwrap();
        let err = read_dir_info(dir.path(), Limits::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("checkpoint/pages-1.img") && err.contains("symbolic link"),
            "{err}"
        );
        std::fs::remove_file(ckpt.join("pages-1.img")).unwrap();

        nix::unistd::mkfifo(&ckpt.join("fifo"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let err = read_dir_info(dir.path(), Limits::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("checkpoint/fifo") && err.contains("fifo"),
            "{err}"
        );
        std::fs::remove_file(ckpt.join("fifo")).unwrap();

        std::fs::create_dir(ckpt.join("sub")).unwrap();
        let err = read_dir_info(dir.path(), Limits::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("checkpoint/sub"), "{err}");
        std::fs::remove_dir(ckpt.join("sub")).unwrap();

        let small = Limits {
            max_entry_bytes: 1,
            ..Limits::default()
        };
        let err = read_dir_info(dir.path(), small).unwrap_err().to_string();
        assert!(err.contains("exceeds the limit"), "{err}");
    }

    #[test]
    fn only_a_mount_point_in_the_pods_image_volume_directory_is_an_image_volume() {
        let state = tempfile::tempdir().unwrap();
        let bundle = state.path().join("io.containerd.runtime.v2.task/k8s.io/c1");
        std::fs::create_dir_all(&bundle).unwrap();
        let volumes = state.path().join(trust::IMAGE_VOLUMES);
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
