//! The pod and container annotations under `gpu-ckpt.io/` that the shim reads. containerd copies
//! them into every container's OCI spec through the handler's `pod_annotations` and
//! `container_annotations`; an unknown key under the prefix is an error that names it.

use std::collections::HashMap;

use crate::error::{Error, Result};

pub const PREFIX: &str = "gpu-ckpt.io/";
/// Archive path, image reference, or `mount:/PATH` (the container path of an image volume of
/// the pod that holds the checkpoint image) of the checkpoint to restore (restore handler).
pub const RESTORE_FROM: &str = "gpu-ckpt.io/restore-from";
/// `fail` (default) or `cold-start` when a checkpoint cannot be used.
pub const ON_INCOMPATIBLE: &str = "gpu-ckpt.io/on-incompatible";
/// `established` or `close`: how established TCP connections are checkpointed and restored.
pub const TCP: &str = "gpu-ckpt.io/tcp";
/// `true`/`false`: dump file locks.
pub const FILE_LOCKS: &str = "gpu-ckpt.io/file-locks";
/// `true`/`false`: dump external unix sockets.
pub const EXT_UNIX_SK: &str = "gpu-ckpt.io/ext-unix-sk";
pub const ENGINE_VERSION: &str = "gpu-ckpt.io/engine-version";
pub const MODEL_VERSION: &str = "gpu-ckpt.io/model-version";
/// Device lock timeout (GPU checkpoints).
pub const LOCK_TIMEOUT: &str = "gpu-ckpt.io/lock-timeout";
/// `true`/`false`: resume the container as soon as its checkpoint is written, before
/// containerd's copy (the runtime option `ResumeAfterDump`, overridden per pod).
pub const RESUME_AFTER_DUMP: &str = "gpu-ckpt.io/resume-after-dump";
/// `managed` or `off`: the container gets gpu-ckpt's NCCL layer (injected at Create, its
/// communicators quiesced at a checkpoint and rebuilt after a restore) or not. Where absent,
/// the runtime option `Nccl` decides.
pub const NCCL: &str = "gpu-ckpt.io/nccl";

const KNOWN: [&str; 10] = [
    RESTORE_FROM,
    ON_INCOMPATIBLE,
    TCP,
    FILE_LOCKS,
    EXT_UNIX_SK,
    ENGINE_VERSION,
    MODEL_VERSION,
    LOCK_TIMEOUT,
    RESUME_AFTER_DUMP,
    NCCL,
];

/// The gpu-ckpt annotations of a container, checked.
#[derive(Clone, Debug, Default)]
pub struct Annotations(HashMap<String, String>);

impl Annotations {
    /// Keeps the `gpu-ckpt.io/` keys of `all`; an unknown one, or a bad value, is an error.
    pub fn from_spec(all: &HashMap<String, String>) -> Result<Self> {
        let mut ours = HashMap::new();
        for (k, v) in all {
            let Some(rest) = k.strip_prefix(PREFIX) else {
                continue;
            };
            let known = KNOWN.contains(&k.as_str())
                // Per-container restore source: gpu-ckpt.io/restore-from.<container name>.
                || rest.strip_prefix("restore-from.").is_some_and(|n| !n.is_empty());
            if !known {
                return Err(Error::InvalidArgument(format!(
                    "unknown annotation {k:?}: gpu-ckpt knows {}",
                    KNOWN.join(", ")
                )));
            }
            ours.insert(k.clone(), v.clone());
        }
        let a = Annotations(ours);
        if let Some(v) = a.get(TCP) {
            if !matches!(v, "established" | "close") {
                return Err(Error::InvalidArgument(format!(
                    "annotation {TCP} is {v:?}: expected \"established\" or \"close\""
                )));
            }
        }
        if let Some(v) = a.get(ON_INCOMPATIBLE) {
            if !matches!(v, "fail" | "cold-start") {
                return Err(Error::InvalidArgument(format!(
                    "annotation {ON_INCOMPATIBLE} is {v:?}: expected \"fail\" or \"cold-start\""
                )));
            }
        }
        if let Some(v) = a.get(NCCL) {
            if !matches!(v, "managed" | "off") {
                return Err(Error::InvalidArgument(format!(
                    "annotation {NCCL} is {v:?}: expected \"managed\" or \"off\""
                )));
            }
        }
        for key in [FILE_LOCKS, EXT_UNIX_SK, RESUME_AFTER_DUMP] {
            a.flag(key)?;
        }
        Ok(a)
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    /// A `true`/`false` annotation; `None` when absent.
    pub fn flag(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some("true") => Ok(Some(true)),
            Some("false") => Ok(Some(false)),
            Some(v) => Err(Error::InvalidArgument(format!(
                "annotation {key} is {v:?}: expected \"true\" or \"false\""
            ))),
        }
    }

    /// The checkpoint to restore `container` from: `restore-from.<container>` first, then the
    /// pod-wide `restore-from`.
    pub fn restore_from(&self, container: &str) -> Option<&str> {
        self.get(&format!("{RESTORE_FROM}.{container}"))
            .or_else(|| self.get(RESTORE_FROM))
            .filter(|v| !v.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(pairs: &[(&str, &str)]) -> Result<Annotations> {
        Annotations::from_spec(
            &pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    #[test]
    fn unknown_keys_are_named() {
        let err = of(&[("gpu-ckpt.io/tcp-mode", "close")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("gpu-ckpt.io/tcp-mode"), "{err}");
        assert!(of(&[("io.kubernetes.cri.container-name", "x")]).is_ok());
    }

    #[test]
    fn values_are_checked() {
        assert!(of(&[(TCP, "close")]).is_ok());
        assert!(of(&[(TCP, "open")]).unwrap_err().to_string().contains(TCP));
        assert!(of(&[(FILE_LOCKS, "yes")]).is_err());
        assert!(of(&[(ON_INCOMPATIBLE, "cold-start")]).is_ok());
        assert!(of(&[(RESUME_AFTER_DUMP, "true")]).is_ok());
        let err = of(&[(RESUME_AFTER_DUMP, "yes")]).unwrap_err().to_string();
        assert!(
            err.contains("annotation gpu-ckpt.io/resume-after-dump is \"yes\": expected \"true\" or \"false\""),
            "{err}"
        );
    }

    #[test]
    fn nccl_is_managed_or_off() {
        assert_eq!(of(&[(NCCL, "managed")]).unwrap().get(NCCL), Some("managed"));
        assert_eq!(of(&[(NCCL, "off")]).unwrap().get(NCCL), Some("off"));
        for bad in ["on", "true", "Managed", ""] {
            let err = of(&[(NCCL, bad)]).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
            let err = err.to_string();
            assert!(
                err.contains(&format!(
                    "annotation gpu-ckpt.io/nccl is {bad:?}: expected \"managed\" or \"off\""
                )),
                "{err}"
            );
        }
        // A misspelt key is named, with the known ones.
        let err = of(&[("gpu-ckpt.io/nccl-mode", "managed")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"gpu-ckpt.io/nccl-mode\"") && err.ends_with(", gpu-ckpt.io/nccl"),
            "{err}"
        );
    }

    #[test]
    fn per_container_restore_source_wins() {
        let a = of(&[
            (RESTORE_FROM, "/ckpt/pod.tar"),
            ("gpu-ckpt.io/restore-from.worker", "/ckpt/worker.tar"),
        ])
        .unwrap();
        assert_eq!(a.restore_from("worker"), Some("/ckpt/worker.tar"));
        assert_eq!(a.restore_from("sidecar"), Some("/ckpt/pod.tar"));
    }
}
