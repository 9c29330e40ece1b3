//! A root-only directory per container, `<base>/<namespace>/<container id>`, made afresh: the
//! restore handler's staging directory (`restore.rs`) and custom storage's device-memory files
//! (`device_storage.rs`).

use std::path::{Path, PathBuf};

use image_format::safe::SafeRoot;

use crate::error::{Error, Result};

/// `<base>/<namespace>/<id>`, each name one path component (`what` names the directory for
/// the refusal).
pub fn container_dir(base: &Path, namespace: &str, id: &str, what: &str) -> Result<PathBuf> {
    for (kind, name) in [("namespace", namespace), ("container id", id)] {
        if name.is_empty() || name == "." || name == ".." || name.contains('/') {
            return Err(Error::InvalidArgument(format!(
                "{kind} {name:?} cannot name {what}"
            )));
        }
    }
    Ok(base.join(namespace).join(id))
}

/// Makes `<base>/<namespace>/<id>` ([`container_dir`]) afresh: the base directory and the
/// namespace's made root-only (0700) where missing, the container's made new, every
/// component below the base opened without following a link; what an earlier shim of the
/// same container left there is removed first (then true). An error says what failed.
pub fn make_fresh_dir(dir: &Path) -> std::result::Result<bool, (&'static str, std::io::Error)> {
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
