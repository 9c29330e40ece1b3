//! A container's OCI bundle, read once at Create: the typed spec (oci-spec's `Spec`), the same
//! `config.json` as a JSON tree (for the readers and edits that must keep every field, known
//! or not), and the CRI identity its annotations carry. Nothing else in the shim opens
//! `config.json`; the two edits the shim makes to it (runc pointed at the shim's CRIU
//! configuration, a checkpoint's image volume taken out of a restoring container's mounts) go
//! through [`Bundle::rewrite`], which keeps this copy and the file the same.

use std::{
    collections::HashMap,
    io::Write,
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
};

use oci_spec::runtime::Spec;
use serde_json::Value;

use crate::error::{Error, Result};

/// The annotations containerd's CRI puts on a container's spec (`io.kubernetes.cri.*`).
pub use image_format::cri;

/// The bundle's config file.
const CONFIG: &str = "config.json";

/// A container's bundle directory and its spec.
#[derive(Debug, Clone)]
pub struct Bundle {
    path: PathBuf,
    spec: Spec,
    json: Value,
    annotations: HashMap<String, String>,
}

/// Who a container is to Kubernetes (its spec's CRI annotations; empty outside Kubernetes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CriIdentity {
    /// [`cri::CONTAINER_TYPE`].
    pub container_type: String,
    /// [`cri::CONTAINER_NAME`], or the container's id where the spec has none.
    pub name: String,
    pub image: String,
    pub sandbox_id: String,
    pub sandbox_name: String,
    pub namespace: String,
    pub pod_uid: String,
}

impl Bundle {
    /// Reads and checks `bundle/config.json`, with an error that names the file.
    pub fn load(bundle: &Path) -> Result<Bundle> {
        let path = bundle.join(CONFIG);
        let text = std::fs::read_to_string(&path).map_err(|e| {
            Error::InvalidArgument(format!("cannot read bundle config {}: {e}", path.display()))
        })?;
        Bundle::parse(bundle, &text)
    }

    fn parse(bundle: &Path, text: &str) -> Result<Bundle> {
        let path = bundle.join(CONFIG);
        let malformed = |e: serde_json::Error| {
            Error::InvalidArgument(format!("malformed bundle config {}: {e}", path.display()))
        };
        let spec = serde_json::from_str::<Spec>(text).map_err(malformed)?;
        let json = serde_json::from_str::<Value>(text).map_err(malformed)?;
        let annotations = spec.annotations().clone().unwrap_or_default();
        Ok(Bundle {
            path: bundle.to_path_buf(),
            spec,
            json,
            annotations,
        })
    }

    /// The bundle directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A path in the bundle directory.
    pub fn join(&self, name: impl AsRef<Path>) -> PathBuf {
        self.path.join(name)
    }

    /// `config.json`'s path, for messages.
    pub fn config_path(&self) -> PathBuf {
        self.path.join(CONFIG)
    }

    /// The typed spec.
    pub fn spec(&self) -> &Spec {
        &self.spec
    }

    /// The spec as JSON, every field kept (known to oci-spec or not).
    pub fn json(&self) -> &Value {
        &self.json
    }

    /// The spec's annotations.
    pub fn annotations(&self) -> &HashMap<String, String> {
        &self.annotations
    }

    /// One annotation, empty when the spec has none.
    fn annotation(&self, key: &str) -> String {
        self.annotations.get(key).cloned().unwrap_or_default()
    }

    /// The container's CRI identity; `id` names it where the spec gives no container name.
    pub fn cri(&self, id: &str) -> CriIdentity {
        CriIdentity {
            container_type: self.annotation(cri::CONTAINER_TYPE),
            name: self
                .annotations
                .get(cri::CONTAINER_NAME)
                .cloned()
                .unwrap_or_else(|| id.to_string()),
            image: self.annotation(cri::IMAGE_NAME),
            sandbox_id: self.annotation(cri::SANDBOX_ID),
            sandbox_name: self.annotation(cri::SANDBOX_NAME),
            namespace: self.annotation(cri::SANDBOX_NAMESPACE),
            pod_uid: self.annotation(cri::SANDBOX_UID),
        }
    }

    /// That `config.json` still holds the spec read at Create: a restore's checks at Start use
    /// that copy, and runc reads the file again.
    pub fn unchanged(&self) -> Result<()> {
        let now = Bundle::load(&self.path)?;
        if now.json != self.json {
            return Err(Error::FailedPrecondition(format!(
                "restore refused: {} changed after the container was created",
                self.config_path().display()
            )));
        }
        Ok(())
    }

    /// Replaces `config.json` with `json` (written whole beside it with the file's mode, then
    /// renamed over it), and this bundle's copy with it. `json` must still be a valid spec.
    pub fn rewrite(&mut self, json: Value) -> Result<()> {
        let path = self.config_path();
        let tmp = self.path.join(".config.json.gpu-ckpt");
        let data = serde_json::to_string(&json).map_err(|e| {
            Error::InvalidArgument(format!("bundle config {}: {e}", path.display()))
        })?;
        let updated = Bundle::parse(&self.path, &data)?;
        let mode = std::fs::metadata(&path)
            .map(|m| m.permissions())
            .map_err(Error::io(format!("stat {}", path.display())))?;
        // A name left from an earlier write (or put there) is removed, never followed.
        match std::fs::remove_file(&tmp) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(Error::io(format!("remove {}", tmp.display()))(e));
            }
            _ => {}
        }
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)
            .map_err(Error::io(format!("create {}", tmp.display())))?;
        file.write_all(data.as_bytes())
            .and_then(|()| file.set_permissions(mode))
            .map_err(Error::io(format!("write {}", tmp.display())))?;
        std::fs::rename(&tmp, &path).map_err(Error::io(format!("replace {}", path.display())))?;
        *self = updated;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_changed_after_create_is_refused_and_a_rewrite_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        std::fs::write(&path, r#"{"ociVersion":"1.0.2"}"#).unwrap();
        let mut bundle = Bundle::load(dir.path()).unwrap();
        bundle.unchanged().unwrap();
        // The shim's own edit keeps the copy and the file the same.
        let mut json = bundle.json().clone();
        json["annotations"] = serde_json::json!({"a": "b"});
        bundle.rewrite(json).unwrap();
        bundle.unchanged().unwrap();
        // A planted link where the edit is written beside the file is replaced, not followed.
        let outside = dir.path().join("outside");
        std::fs::write(&outside, "keep").unwrap();
        std::os::unix::fs::symlink(&outside, dir.path().join(".config.json.gpu-ckpt")).unwrap();
        bundle.rewrite(bundle.json().clone()).unwrap();
        assert_eq!(std::fs::read_to_string(&outside).unwrap(), "keep");
        // Anyone else's edit is refused, naming the file.
        std::fs::write(&path, r#"{"ociVersion":"1.0.2","hostname":"x"}"#).unwrap();
        let err = bundle.unchanged().unwrap_err().to_string();
        assert!(
            err.contains("changed after the container was created"),
            "{err}"
        );
        assert!(err.contains("config.json"), "{err}");
    }

    #[test]
    fn malformed_config_is_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), "{\"ociVersion\": ").unwrap();
        let err = Bundle::load(dir.path()).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)));
        assert!(err.to_string().contains("malformed bundle config"), "{err}");
        assert!(err.to_string().contains("config.json"), "{err}");
    }

    #[test]
    fn missing_config_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = Bundle::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("cannot read bundle config"), "{err}");
    }

    #[test]
    fn a_rewrite_changes_the_file_and_the_copy() {
        let dir = tempfile::tempdir().unwrap();
        let spec = r#"{"ociVersion":"1.0.2","x-unknown":1,"annotations":{"io.kubernetes.cri.container-name":"app"}}"#;
        std::fs::write(dir.path().join("config.json"), spec).unwrap();
        let mut bundle = Bundle::load(dir.path()).unwrap();
        assert_eq!(bundle.cri("c1").name, "app");
        assert_eq!(bundle.cri("c1").namespace, "");
        let mut json = bundle.json().clone();
        json["annotations"]["a"] = "b".into();
        bundle.rewrite(json).unwrap();
        assert_eq!(bundle.annotations()["a"], "b");
        let again = Bundle::load(dir.path()).unwrap();
        assert_eq!(again.json(), bundle.json());
        assert_eq!(again.json()["x-unknown"], 1);
    }
}
