//! Which checkpoints this node restores: signed by a key it trusts (or unsigned under
//! `AllowUnsigned`), taken in the same namespace (or a move `NamespaceMoves` allows), and, for the
//! restore handler, read from a source `RestoreSources` lists. The signing itself is
//! `image_format::sign`; docs/security.md gives the threat model. Every refusal of a checkpoint
//! a pod may not use reads the same to the pod ([`refused`]); the reason goes to the node's log.

use std::path::{Component, Path, PathBuf};

use image_format::reference::{ImageRef, RegistryPrefix};
use image_format::{
    manifest::{self, Manifest},
    sign::{self, KeyStatus, NodeKey, TrustedKeys},
};
use tracing::{info, warn};

use crate::{
    bundle::cri::SANDBOX_ID,
    error::{Error, Result},
    options::RuntimeOptions,
};

/// What the signature check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Signed by `key_id`, a key this node trusts (`trusted_as` says which).
    Signed { key_id: String, trusted_as: String },
    /// Unsigned, and `AllowUnsigned` lets it restore.
    Unsigned,
}

/// The node's signing key, made on first use. Only the checkpoint's signing step reads it;
/// checking a signature reads the public key ([`trusted_keys`]).
pub fn node_key(options: &RuntimeOptions) -> Result<NodeKey> {
    Ok(NodeKey::load_or_create(&options.signing_key_path())?)
}

/// The keys this node trusts: its own and its retired ones (from their public key files beside
/// the signing key), and every key in `TrustedKeysDir`; and the keys it revoked (the union of
/// `RevokedKeysFile` and the node's own list beside the signing key), which are refused even so.
pub fn trusted_keys(options: &RuntimeOptions) -> Result<TrustedKeys> {
    let key_path = options.signing_key_path();
    let mut keys = TrustedKeys::default();
    keys.add_node_keys(&key_path, sign::node_public_key(&key_path)?)?;
    if !options.trusted_keys_dir.is_empty() {
        keys.add_dir(Path::new(&options.trusted_keys_dir))?;
    }
    for list in options.revoked_keys_paths() {
        keys.add_revoked(&list)?;
    }
    Ok(keys)
}

/// The refusal of the checkpoint `source` for `reason`: what the pod sees does not depend on
/// the reason ([`Error::Refused`]); [`log_refused`] writes the reason to the node's log.
pub fn refused(source: &str, reason: impl std::fmt::Display) -> Error {
    Error::Refused {
        checkpoint: source.to_string(),
        reason: reason.to_string(),
    }
}

/// Logs why a checkpoint was refused, if `err` is a refusal, for a pod in `namespace`.
pub fn log_refused(err: &Error, namespace: &str) {
    if let Error::Refused { checkpoint, reason } = err {
        warn!(source = %checkpoint, %reason, %namespace, "checkpoint refused");
    }
}

/// Checks the signature of the manifest document `json` of the checkpoint `source`, and that
/// this node trusts its signer and has not revoked it. An unsigned one is refused unless
/// `AllowUnsigned`, and then a warning is logged when `log_unsigned`.
pub fn check_signature(
    json: &[u8],
    options: &RuntimeOptions,
    source: &str,
    log_unsigned: bool,
) -> Result<Verdict> {
    let signer = sign::verify_json(json).map_err(|e| refused(source, e))?;
    let Some(signer) = signer else {
        if options.allow_unsigned {
            if log_unsigned {
                warn!(%source, "restoring an UNSIGNED checkpoint (AllowUnsigned = true): its origin and content are not authenticated");
            }
            return Ok(Verdict::Unsigned);
        }
        return Err(refused(
            source,
            "it is unsigned: this node restores only checkpoints signed by a key it trusts (set the handler option AllowUnsigned = true to allow unsigned ones)",
        ));
    };
    let keys = trusted_keys(options)?;
    match keys.status(&signer) {
        KeyStatus::Trusted(how) => {
            info!(%source, key = %signer.key_id(), trusted_as = %how, "checkpoint signature verified");
            Ok(Verdict::Signed {
                key_id: signer.key_id(),
                trusted_as: how.to_string(),
            })
        }
        KeyStatus::Revoked(at) => Err(refused(
            source,
            format!(
                "it is signed by key {}, which is revoked ({at})",
                signer.key_id()
            ),
        )),
        KeyStatus::Untrusted => Err(refused(
            source,
            format!(
                "it is signed by key {}, which this node does not trust (put its public key, {}, in the directory named by the handler option TrustedKeysDir{})",
                signer.key_id(),
                signer.public_key_hex(),
                if options.trusted_keys_dir.is_empty() {
                    String::new()
                } else {
                    format!(", now {}", options.trusted_keys_dir)
                }
            ),
        )),
    }
}

/// Refuses a checkpoint of namespace `from` restored into namespace `to`, unless the pair is
/// in `NamespaceMoves`. The reason names both.
pub fn check_namespace(from: &str, to: &str, options: &RuntimeOptions, source: &str) -> Result<()> {
    if from == to {
        return Ok(());
    }
    if options.namespace_move_allowed(from, to) {
        info!(%source, %from, %to, "checkpoint moves between namespaces (NamespaceMoves)");
        return Ok(());
    }
    Err(refused(
        source,
        format!(
            "it was taken in namespace {from:?} and may not be restored into namespace {to:?} (add \"{from}/{to}\" to the handler option NamespaceMoves to allow this move)"
        ),
    ))
}

/// The checks at Start, for every way a restore arrives (the restore handler's own unpacked
/// checkpoint, containerd's restore-via-create, ctr restore, `CriuImagePath`): the signature
/// and its signer, and the namespace. Returns the manifest document that was checked, which
/// the caller compares with the one it verifies the files against. A refusal is logged here.
pub fn check_dir(
    dir: &Path,
    options: &RuntimeOptions,
    namespace: &str,
    log_unsigned: bool,
) -> Result<(Verdict, Manifest)> {
    let path = dir.join(manifest::MANIFEST_FILE);
    let json = std::fs::read(&path).map_err(|e| {
        Error::FailedPrecondition(format!(
            "{} has no readable gpu-ckpt manifest ({e}): it is not a complete gpu-ckpt checkpoint",
            dir.display()
        ))
    })?;
    let source = dir.display().to_string();
    let checked = (|| {
        let verdict = check_signature(&json, options, &source, log_unsigned)?;
        let m = Manifest::from_json(&json, &path.display().to_string())?;
        check_namespace(&m.container.pod_namespace, namespace, options, &source)?;
        Ok((verdict, m))
    })();
    if let Err(e) = &checked {
        log_refused(e, namespace);
    }
    checked
}

/// The refusal of the restore source `source` for `why`, the reason naming `RestoreSources`
/// (`sources`).
pub fn source_refused(source: &str, sources: &[String], why: impl std::fmt::Display) -> Error {
    refused(source, format!("{why} (RestoreSources: {sources:?})"))
}

/// Where `source` may be read from, checked against `RestoreSources` before anything is
/// opened: a path lexically under one of the directories (no `.` or `..`), or a reference
/// (parsed by [`ImageRef`]) whose registry host, port and first repository components are a
/// registry prefix's. `Ok(Some(dir))` for a path (the directory it must stay
/// in once links are resolved), `Ok(None)` for a reference.
pub fn check_source(source: &str, sources: &[String]) -> Result<Option<PathBuf>> {
    let refused = |why: &str| source_refused(source, sources, why);
    if source.starts_with('/') {
        let path = Path::new(source);
        if path
            .components()
            .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
            || source.contains("/./")
        {
            return Err(refused("a path with . or .. components"));
        }
        for dir in sources.iter().filter(|s| s.starts_with('/')) {
            let d = Path::new(dir);
            if path.starts_with(d) && path != d {
                return Ok(Some(d.to_path_buf()));
            }
        }
        return Err(refused("a path outside RestoreSources"));
    }
    // A reference: parsed (the distribution grammar: no percent-encoding, no `..`, no
    // user@host), then compared with each registry prefix by host, port and repository
    // components. A prefix that does not parse matches nothing.
    let reference =
        ImageRef::parse(source).map_err(|e| refused(&format!("not an image reference: {e}")))?;
    let allowed = sources
        .iter()
        .filter(|s| !s.starts_with('/'))
        .filter_map(|p| {
            RegistryPrefix::parse(p)
                .inspect_err(|e| warn!(prefix = %p, error = %e, "RestoreSources prefix ignored"))
                .ok()
        })
        .any(|p| reference.is_under(&p));
    if allowed {
        Ok(None)
    } else {
        Err(refused("a reference outside RestoreSources"))
    }
}

/// Resolves the path `source`, allowed under `dir`, to what it names once links are followed;
/// it must still be under `dir` (resolved too), and be a regular file or a directory.
pub fn resolve_source(source: &str, dir: &Path, sources: &[String]) -> Result<PathBuf> {
    let refused = |why: String| source_refused(source, sources, why);
    let real = Path::new(source)
        .canonicalize()
        .map_err(|e| refused(format!("it does not exist or cannot be resolved: {e}")))?;
    let real_dir = dir.canonicalize().map_err(|e| {
        refused(format!(
            "its directory {} cannot be resolved: {e}",
            dir.display()
        ))
    })?;
    if !real.starts_with(&real_dir) {
        return Err(refused(format!(
            "it resolves to {}, outside its directory {}",
            real.display(),
            real_dir.display()
        )));
    }
    let meta =
        std::fs::metadata(&real).map_err(|e| refused(format!("stat {}: {e}", real.display())))?;
    if !(meta.is_file() || meta.is_dir()) {
        return Err(refused(
            "it is neither a regular file nor a directory".into(),
        ));
    }
    Ok(real)
}

/// The prefix of a `gpu-ckpt.io/restore-from` source that names an image volume of the pod.
pub const MOUNT_SOURCE: &str = "mount:";
/// Where containerd's CRI (2.1+) mounts a pod's image volumes, below its state directory:
/// `image-volumes/<sandbox id>/<one directory per image>`.
pub const IMAGE_VOLUMES: &str = "io.containerd.grpc.v1.cri/image-volumes";
/// The task directory below containerd's state directory that holds the bundles:
/// `io.containerd.runtime.v2.task/<namespace>/<container id>`.
const TASK_DIR: &str = "io.containerd.runtime.v2.task";

/// The container path `mount:/PATH` names, checked: absolute, with no `.`, `..` or empty
/// component. `None` when `source` is not a `mount:` source.
pub fn mount_destination(source: &str) -> Option<Result<String>> {
    let path = source.strip_prefix(MOUNT_SOURCE)?;
    let clean = path.trim_end_matches('/');
    let ok = path.starts_with('/')
        && !clean.is_empty()
        && clean[1..]
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..");
    Some(if ok {
        Ok(clean.to_string())
    } else {
        Err(Error::InvalidArgument(format!(
            "restore source {source:?}: {MOUNT_SOURCE} takes the absolute container path of an image volume (mount:/PATH, the volumeMount's mountPath), without . or .. components"
        )))
    })
}

/// containerd's directory of the image volumes of sandbox `sandbox_id`
/// (`<state>/io.containerd.grpc.v1.cri/image-volumes/<sandbox id>`), from the bundle's place in
/// containerd's state directory; why not, when the bundle is elsewhere or the id is not one.
pub fn image_volumes_dir(bundle: &Path, sandbox_id: &str) -> std::result::Result<PathBuf, String> {
    let tasks = bundle.parent().and_then(Path::parent);
    let state = match tasks {
        Some(t) if t.file_name().is_some_and(|n| n == TASK_DIR) => t.parent(),
        _ => None,
    }
    .ok_or_else(|| {
        format!(
            "the bundle {} is not in containerd's {TASK_DIR} directory, so containerd's image-volume directory is unknown",
            bundle.display()
        )
    })?;
    let valid_id = !sandbox_id.is_empty()
        && sandbox_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if !valid_id {
        return Err(format!(
            "the container has no valid {SANDBOX_ID} annotation ({sandbox_id:?})"
        ));
    }
    Ok(state.join(IMAGE_VOLUMES).join(sandbox_id))
}

/// The image volume of this pod that the host path `source` (a mount's source in a
/// container's spec) is, or lies beneath, when that volume holds a checkpoint (a
/// `checkpoint/` directory at its top, what a `mount:` restore reads): its host directory.
/// `volumes` is [`image_volumes_dir`]. Nothing is followed: the volume's top and its
/// `checkpoint/` are looked at with lstat, below containerd's own directory.
pub fn checkpoint_volume(volumes: &Path, source: &str) -> Option<PathBuf> {
    let rest = Path::new(source).strip_prefix(volumes).ok()?;
    let Some(Component::Normal(name)) = rest.components().next() else {
        return None;
    };
    let volume = volumes.join(name);
    let holds_checkpoint =
        std::fs::symlink_metadata(volume.join(image_format::archive::names::CHECKPOINT_DIRECTORY))
            .is_ok_and(|m| m.is_dir());
    holds_checkpoint.then_some(volume)
}

/// The host directory of the image volume that the container of `bundle` has at
/// `destination` (its spec's mount there), checked to be an image volume of this very pod: a
/// read-only bind of a mount point that containerd made in its own image-volume directory for
/// the sandbox `sandbox_id`. A path not in the spec, a hostPath or any other volume, another
/// pod's image volume, and a source reached through a link are refused, naming the mount.
pub fn image_volume(
    bundle: &Path,
    spec: &serde_json::Value,
    destination: &str,
    sandbox_id: &str,
    source: &str,
) -> Result<PathBuf> {
    let mount = the_mount_at(spec, destination, source)?;
    let host = mount
        .get("source")
        .and_then(|s| s.as_str())
        .unwrap_or_default();
    let not_image_volume = |why: String| {
        warn!(%source, host, %why, "restore source refused: not an image volume of this pod");
        Error::PermissionDenied(format!(
            "restore source {source:?}: the mount at {destination} (host path {host:?}) is not an image volume of this pod: {why}; gpu-ckpt restores a mount: source only from an image volume (volumes[].image) that the kubelet pulled for this pod, never from a hostPath or any other volume"
        ))
    };
    let expected = image_volumes_dir(bundle, sandbox_id).map_err(not_image_volume)?;
    let host_path = Path::new(host);
    directory_of(host_path, &expected).map_err(not_image_volume)?;
    read_only_bind(mount).map_err(not_image_volume)?;
    let real = own_mount_point(host_path, &expected).map_err(not_image_volume)?;
    info!(%source, host, "restore source: image volume of this pod");
    Ok(real)
}

/// The one mount of `spec` at `destination` (the restore `source` names it).
fn the_mount_at<'a>(
    spec: &'a serde_json::Value,
    destination: &str,
    source: &str,
) -> Result<&'a serde_json::Value> {
    let mounts: Vec<&serde_json::Value> = spec
        .get("mounts")
        .and_then(|m| m.as_array())
        .map(|m| {
            m.iter()
                .filter(|m| {
                    m.get("destination")
                        .and_then(|d| d.as_str())
                        .is_some_and(|d| d.trim_end_matches('/') == destination)
                })
                .collect()
        })
        .unwrap_or_default();
    match mounts.as_slice() {
        [one] => Ok(one),
        [] => Err(Error::InvalidArgument(format!(
            "restore source {source:?}: the container has no mount at {destination} (give the mountPath of the pod's image volume that holds the checkpoint)"
        ))),
        _ => Err(Error::InvalidArgument(format!(
            "restore source {source:?}: the container has {} mounts at {destination}; expected one image volume",
            mounts.len()
        ))),
    }
}

/// `host` is a directory right in `expected` (the pod's image-volume directory), by its
/// clean absolute path; why not.
fn directory_of(host: &Path, expected: &Path) -> std::result::Result<(), String> {
    let lexical_ok = host.is_absolute()
        && host
            .components()
            .skip(1)
            .all(|c| matches!(c, Component::Normal(_)));
    if !lexical_ok || host.parent() != Some(expected) {
        return Err(format!(
            "its source is not a directory of {}",
            expected.display()
        ));
    }
    Ok(())
}

/// The spec's `mount` is a read-only bind; why not.
fn read_only_bind(mount: &serde_json::Value) -> std::result::Result<(), String> {
    let kind = mount.get("type").and_then(|t| t.as_str()).unwrap_or("bind");
    let options: Vec<&str> = mount
        .get("options")
        .and_then(|o| o.as_array())
        .map(|o| o.iter().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    if kind != "bind" || !options.contains(&"ro") {
        return Err(format!(
            "it is a {kind} mount with options {options:?}, not a read-only bind"
        ));
    }
    Ok(())
}

/// `host` reached with no link anywhere on the way, and a mount point of its own (the image's
/// snapshot), not a directory someone made in `expected`: its real path; why not.
fn own_mount_point(host: &Path, expected: &Path) -> std::result::Result<PathBuf, String> {
    use std::os::unix::fs::MetadataExt;
    let real = host
        .canonicalize()
        .map_err(|e| format!("its source cannot be resolved: {e}"))?;
    if real != host {
        return Err(format!(
            "its source resolves through a link to {}",
            real.display()
        ));
    }
    let meta =
        std::fs::symlink_metadata(host).map_err(|e| format!("its source cannot be read: {e}"))?;
    let parent = std::fs::symlink_metadata(expected)
        .map_err(|e| format!("{} cannot be read: {e}", expected.display()))?;
    if !meta.is_dir() || meta.dev() == parent.dev() {
        return Err(
            "its source is not a mount point of its own (containerd mounts each image volume's snapshot there)".into(),
        );
    }
    Ok(real)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reason of a refusal, after checking that the pod's text does not depend on it.
    fn reason(e: Error) -> String {
        let Error::Refused { checkpoint, reason } = &e else {
            panic!("not a refusal: {e}");
        };
        let shown = e.to_string().replace(&format!("{checkpoint:?}"), "SOURCE");
        let other = refused("x", "another reason")
            .to_string()
            .replace("\"x\"", "SOURCE");
        assert_eq!(shown, other);
        assert!(!shown.contains(reason.as_str()));
        assert_eq!(
            e.code(),
            containerd_shim::protos::ttrpc::Code::PERMISSION_DENIED
        );
        reason.clone()
    }

    fn sources() -> Vec<String> {
        vec![
            "/var/lib/kubelet/checkpoints/".into(),
            "registry.example.com/ckpt/".into(),
        ]
    }

    #[test]
    fn sources_outside_the_list_are_refused_before_anything_is_opened() {
        let s = sources();
        assert!(check_source("/var/lib/kubelet/checkpoints/a.tar", &s)
            .unwrap()
            .is_some());
        assert!(check_source("registry.example.com/ckpt/c:1", &s)
            .unwrap()
            .is_none());
        for bad in [
            "/etc/shadow",
            "/var/lib/kubelet/checkpoints",
            "/var/lib/kubelet/checkpoints/../../../etc/shadow",
            "/var/lib/kubelet/checkpoints/./a.tar",
            "/var/lib/kubelet/checkpointsX/a.tar",
            "registry.example.com/ckptx/c:1",
            "registry.example.com/ckpt/../other/c:1",
            "evil.example.com/ckpt/c:1",
        ] {
            let err = check_source(bad, &s).unwrap_err();
            assert!(err.to_string().contains(bad), "{err}");
            let why = reason(err);
            assert!(why.contains("RestoreSources"), "{why}");
        }
    }

    #[test]
    fn references_are_parsed_and_compared_component_by_component() {
        let d = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        let s = sources();
        for good in [
            "registry.example.com/ckpt/c:1".to_string(),
            "registry.example.com/ckpt/team/c:1".to_string(),
            format!("registry.example.com/ckpt/c@{d}"),
        ] {
            assert!(check_source(&good, &s).unwrap().is_none(), "{good}");
        }
        // Walked out of the prefix by percent-encoding, to another host by userinfo, another
        // port, a longer host name.
        for bad in [
            "registry.example.com/ckpt/%2e%2e/other/app:1",
            "registry.example.com/ckpt/%2E%2E/other/app:1",
            "registry.example.com/ckpt/.%2e/other/app:1",
            "registry.example.com@evil:443/x",
            "registry.example.com@evil.example:443/ckpt/c:1",
            "registry.example.com:444/ckpt/c:1",
            "registry.example.com.evil.example/ckpt/c:1",
            "registry.example.com/ckpt",
        ] {
            // The one refusal; the reason (for the node's log) names RestoreSources.
            let err = check_source(bad, &s).unwrap_err();
            assert!(
                matches!(&err, Error::Refused { reason, .. } if reason.contains("RestoreSources")),
                "{bad}: {err:?}"
            );
        }
        // A host-only prefix: that host and port, any repository; nothing else.
        let host = vec!["registry.example.com/".to_string()];
        assert!(check_source("registry.example.com/any/c:1", &host).is_ok());
        for bad in [
            "registry.example.com@evil:443/x",
            "registry.example.com:443/x:1",
        ] {
            assert!(check_source(bad, &host).is_err(), "{bad}");
        }
    }

    #[test]
    fn links_out_of_a_source_directory_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("ckpt");
        std::fs::create_dir(&d).unwrap();
        std::fs::write(d.join("a.tar"), "x").unwrap();
        std::os::unix::fs::symlink("/etc/hostname", d.join("l.tar")).unwrap();
        let s = vec![format!("{}/", d.display())];
        let ok = format!("{}/a.tar", d.display());
        assert!(resolve_source(&ok, &d, &s).is_ok());
        let msg = |src: &str| {
            resolve_source(src, &d, &s)
                .unwrap_err()
                .to_string()
                .replace(src, "SOURCE")
        };
        let link = format!("{}/l.tar", d.display());
        let missing = format!("{}/missing.tar", d.display());
        assert_eq!(msg(&link), msg(&missing));
        let why = |src: &str| reason(resolve_source(src, &d, &s).unwrap_err());
        assert!(
            why(&link).contains("outside its directory"),
            "{}",
            why(&link)
        );
        assert!(
            why(&missing).contains("does not exist"),
            "{}",
            why(&missing)
        );
    }

    #[test]
    fn namespace_moves_need_the_pair() {
        let mut o = RuntimeOptions::default();
        let err = reason(check_namespace("default", "tenant-b", &o, "x.tar").unwrap_err());
        assert!(
            err.contains("\"default\"") && err.contains("\"tenant-b\""),
            "{err}"
        );
        assert!(err.contains("NamespaceMoves"), "{err}");
        o.namespace_moves = vec!["default/tenant-b".into()];
        assert!(check_namespace("default", "tenant-b", &o, "x.tar").is_ok());
        assert!(check_namespace("tenant-b", "default", &o, "x.tar").is_err());
    }

    #[test]
    fn unsigned_and_untrusted_are_refused_by_default() {
        let dir = tempfile::tempdir().unwrap();
        let mut o = RuntimeOptions {
            signing_key: dir.path().join("a/node.key").display().to_string(),
            ..Default::default()
        };
        let mut m = Manifest::new(
            "2025-01-01T00:00:00Z",
            Default::default(),
            Default::default(),
            Default::default(),
            Default::default(),
        );
        let unsigned = m.to_json();
        let err = reason(check_signature(&unsigned, &o, "s", true).unwrap_err());
        assert!(
            err.contains("unsigned") && err.contains("AllowUnsigned"),
            "{err}"
        );
        // Signed by this node's key.
        node_key(&o).unwrap().sign_manifest(&mut m).unwrap();
        assert!(matches!(
            check_signature(&m.to_json(), &o, "s", true).unwrap(),
            Verdict::Signed { .. }
        ));
        // Signed by another node's key: refused, then trusted through TrustedKeysDir.
        let other = NodeKey::load_or_create(&dir.path().join("b/node.key")).unwrap();
        other.sign_manifest(&mut m).unwrap();
        let err = reason(check_signature(&m.to_json(), &o, "s", true).unwrap_err());
        assert!(err.contains("does not trust"), "{err}");
        o.trusted_keys_dir = dir.path().join("b").display().to_string();
        assert!(check_signature(&m.to_json(), &o, "s", true).is_ok());
        // Revoked on this node (in the default list, beside its key): refused though trusted.
        let (id, _) =
            sign::revoke(&o.revoked_keys_path(), &sign::key_id(&other.public_key())).unwrap();
        let err = reason(check_signature(&m.to_json(), &o, "s", true).unwrap_err());
        assert!(err.contains("revoked") && err.contains(&id), "{err}");
        // With a RevokedKeysFile (installer-managed) that does not name it, the node's own
        // revocation still holds: the lists add up.
        let site = dir.path().join("site-revoked");
        std::fs::write(&site, "# none\n").unwrap();
        o.revoked_keys_file = site.display().to_string();
        let err = reason(check_signature(&m.to_json(), &o, "s", true).unwrap_err());
        assert!(err.contains("revoked") && err.contains(&id), "{err}");
        // A changed manifest: refused the same way.
        let changed =
            String::from_utf8(m.to_json())
                .unwrap()
                .replacen("2025-01-01", "2025-01-02", 1);
        assert_ne!(changed.as_bytes(), m.to_json());
        let err = reason(check_signature(changed.as_bytes(), &o, "s", true).unwrap_err());
        assert!(err.contains("does not match"), "{err}");
        o.allow_unsigned = true;
        assert_eq!(
            check_signature(&unsigned, &o, "s", true).unwrap(),
            Verdict::Unsigned
        );
    }
}
