//! The annotations of a container restored from containerd's own checkpoint (`ctr container
//! restore`, CRI's restore-via-create), held to the checkpoint's signed record.
//!
//! containerd 2.1's restore-via-create builds the restored container's annotations from the
//! archive's `status.dump` (and its image from `config.dump`), members that no signature
//! covers: the handler's `container_annotations` then copy the `gpu-ckpt.io/` ones into the
//! spec, where they choose how the shim checkpoints and restores (TCP, file locks, unix
//! sockets, the device lock's timeout, the declared versions), and CDI's `cdi.k8s.io/` ones
//! would name devices. A checkpoint records the ones its container had (`container.
//! annotations` of the manifest, signed with it); at the Create of such a restore the spec's
//! ones must be exactly those, or the restore is refused naming the first that differs.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    path::Path,
};

use crate::{
    annotations,
    error::{Error, Result},
    options::RuntimeOptions,
};

/// CDI's annotation prefix (`cdi.k8s.io/<name>`: devices to inject).
pub const CDI_PREFIX: &str = "cdi.k8s.io/";

/// Whether `key` is recorded and held: every `gpu-ckpt.io/` key but the restore handler's
/// source (read only by the restore handler, never for a container containerd restores) and
/// every CDI device annotation.
fn held(key: &str) -> bool {
    if key.starts_with(CDI_PREFIX) {
        return true;
    }
    key.starts_with(annotations::PREFIX)
        && key != annotations::RESTORE_FROM
        && !key.starts_with(&format!("{}.", annotations::RESTORE_FROM))
}

/// The record a checkpoint keeps of its container's spec annotations `all`.
pub fn record(all: &HashMap<String, String>) -> BTreeMap<String, String> {
    all.iter()
        .filter(|(k, _)| held(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Holds the annotations `spec` of a container that containerd restores from `source` to the
/// checkpoint's signed `recorded` ones: any held key whose value differs, or that only one
/// side has, refuses the restore, naming the key and both values.
pub fn check(
    spec: &HashMap<String, String>,
    recorded: &BTreeMap<String, String>,
    source: &str,
) -> Result<()> {
    let keys: BTreeSet<&String> = spec
        .keys()
        .filter(|k| held(k))
        .chain(recorded.keys())
        .collect();
    let show = |v: Option<&String>| match v {
        Some(v) => format!("{v:?}"),
        None => "absent".to_string(),
    };
    let differ: Vec<String> = keys
        .into_iter()
        .filter_map(|k| {
            let (have, want) = (spec.get(k), recorded.get(k));
            (have != want).then(|| {
                format!(
                    "annotation {k} is {} in this container's spec and {} in the checkpoint's signed manifest",
                    show(have),
                    show(want)
                )
            })
        })
        .collect();
    if differ.is_empty() {
        return Ok(());
    }
    Err(Error::PermissionDenied(format!(
        "restore of checkpoint {source} refused: {}; containerd takes a restored container's annotations from the checkpoint archive's status.dump, which no signature covers, so they must be the ones the checkpoint was taken with",
        differ.join("; ")
    )))
}

/// [`check`] for a checkpoint directory `dir` that containerd hands the Create of a restore:
/// its manifest's signature and namespace are checked first ([`crate::trust::check_dir`]).
pub fn check_dir(
    dir: &Path,
    spec: &HashMap<String, String>,
    options: &RuntimeOptions,
) -> Result<()> {
    let namespace = spec
        .get(crate::bundle::cri::SANDBOX_NAMESPACE)
        .cloned()
        .unwrap_or_default();
    let (_, manifest) = crate::trust::check_dir(dir, options, &namespace, false)?;
    crate::checkpoint::refuse_containerd_restore(&manifest, &dir.display().to_string())?;
    check(
        spec,
        &manifest.container.annotations,
        &dir.display().to_string(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn the_record_keeps_what_the_shim_and_cdi_read() {
        let spec = map(&[
            ("gpu-ckpt.io/tcp", "close"),
            ("gpu-ckpt.io/restore-from", "/a.tar"),
            ("gpu-ckpt.io/restore-from.train", "/b.tar"),
            ("cdi.k8s.io/gpu", "sim.example/gpu=0"),
            (crate::bundle::cri::SANDBOX_ID, "abc"),
        ]);
        let r = record(&spec);
        assert_eq!(
            r.keys().map(String::as_str).collect::<Vec<_>>(),
            vec!["cdi.k8s.io/gpu", "gpu-ckpt.io/tcp"]
        );
        assert!(check(&spec, &r, "c").is_ok());
    }

    #[test]
    fn a_changed_added_or_removed_annotation_is_refused_naming_it() {
        let recorded = record(&map(&[("gpu-ckpt.io/tcp", "close")]));
        let changed = map(&[("gpu-ckpt.io/tcp", "established")]);
        let e = check(&changed, &recorded, "/ck").unwrap_err().to_string();
        assert!(
            e.contains("annotation gpu-ckpt.io/tcp is \"established\" in this container's spec and \"close\" in the checkpoint's signed manifest"),
            "{e}"
        );
        let added = map(&[
            ("gpu-ckpt.io/tcp", "close"),
            ("cdi.k8s.io/x", "vendor.com/dev=1"),
        ]);
        let e = check(&added, &recorded, "/ck").unwrap_err().to_string();
        assert!(
            e.contains("annotation cdi.k8s.io/x is \"vendor.com/dev=1\" in this container's spec and absent in"),
            "{e}"
        );
        let e = check(&HashMap::new(), &recorded, "/ck")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("is absent in this container's spec and \"close\""),
            "{e}"
        );
        // Others' annotations are not held.
        let other = map(&[("gpu-ckpt.io/tcp", "close"), ("example.com/x", "1")]);
        assert!(check(&other, &recorded, "/ck").is_ok());
    }
}
