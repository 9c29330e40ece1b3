//! What a stopped installer pod does to its node. The pod's container is stopped for a rolling
//! update (`helm upgrade`), a node shutdown or an eviction as well as for `helm uninstall`; only
//! the last one should take gpu-ckpt off the node. So on SIGTERM the installer asks the API
//! server (with the pod's service account) about its DaemonSet: while it exists and is not being
//! deleted, the node stays installed and the next pod finds it so (an unchanged payload changes
//! and restarts nothing); when it is gone (404) or has a deletionTimestamp, it uninstalls.
//!
//! When the API server cannot be asked (not reachable, no service account, or 401/403 because
//! the release's ServiceAccount or Role went first), it uninstalls: a node is never left with a
//! runtime that nothing manages any more, and being wrong costs one reinstall of that node.

use std::path::Path;

use serde_json::Value;

use crate::error::Error;
use crate::labels::ApiServer;

/// The DaemonSet a pod belongs to, `NAMESPACE/NAME`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonSetRef {
    pub namespace: String,
    pub name: String,
}

impl std::str::FromStr for DaemonSetRef {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.split_once('/') {
            Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
                Ok(DaemonSetRef {
                    namespace: ns.to_string(),
                    name: name.to_string(),
                })
            }
            _ => Err(format!("{s:?} is not NAMESPACE/NAME")),
        }
    }
}

impl std::fmt::Display for DaemonSetRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What the API server said about the DaemonSet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owner {
    /// It exists and is not being deleted: a rolling update, a node shutdown, an eviction.
    Exists,
    /// It is being deleted (its deletionTimestamp).
    Deleting(String),
    /// 404.
    Gone,
    /// It could not be asked; why.
    Unknown(String),
}

impl Owner {
    /// Whether the stopped pod uninstalls: unless the DaemonSet exists and is not being
    /// deleted.
    pub fn uninstall(&self) -> bool {
        !matches!(self, Owner::Exists)
    }
}

/// Asks the API server about `ds` with the service account in `sa_dir`.
pub fn owner(ds: &DaemonSetRef, sa_dir: &Path) -> Owner {
    let _span = tracing::info_span!("daemonset", daemonset = %ds).entered();
    let api = match ApiServer::in_cluster(&ds.name, sa_dir) {
        Ok(api) => api,
        Err(Error::Label { why, .. }) => return Owner::Unknown(why),
        Err(e) => return Owner::Unknown(e.to_string()),
    };
    let path = format!(
        "/apis/apps/v1/namespaces/{}/daemonsets/{}",
        ds.namespace, ds.name
    );
    match api.send(reqwest::Method::GET, &path, None) {
        Err(why) => Owner::Unknown(why),
        Ok((status, _)) if status == reqwest::StatusCode::NOT_FOUND => Owner::Gone,
        Ok((status, body)) if status.is_success() => match serde_json::from_str::<Value>(&body) {
            Ok(v) => match v["metadata"]["deletionTimestamp"].as_str() {
                Some(t) => Owner::Deleting(t.to_string()),
                None if v["kind"] == "DaemonSet" => Owner::Exists,
                None => Owner::Unknown(format!(
                    "the API server at {} answered {path} with a {} object, not a DaemonSet",
                    api.url, v["kind"]
                )),
            },
            Err(e) => Owner::Unknown(format!(
                "the API server at {} answered {path} with no JSON: {e}",
                api.url
            )),
        },
        Ok((status, body)) => Owner::Unknown(api.answered(status, &body)),
    }
}

/// Whether a pod of `ds` that is being stopped uninstalls, logged with the reason.
pub fn uninstall_on_stop(ds: &DaemonSetRef, sa_dir: &Path) -> bool {
    let owner = owner(ds, sa_dir);
    match &owner {
        Owner::Exists => tracing::info!(
            daemonset = %ds,
            "the DaemonSet still exists (a rolling update, a node shutdown or an eviction): gpu-ckpt stays installed for the next pod"
        ),
        Owner::Deleting(t) => tracing::info!(
            daemonset = %ds, deletion = %t,
            "the DaemonSet is being deleted: uninstalling"
        ),
        Owner::Gone => tracing::info!(daemonset = %ds, "the DaemonSet is gone: uninstalling"),
        Owner::Unknown(why) => tracing::warn!(
            daemonset = %ds, reason = %why,
            "cannot ask the API server whether the DaemonSet still exists: uninstalling, so that no node keeps a runtime nothing manages"
        ),
    }
    owner.uninstall()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn daemonset_names_parse() {
        assert_eq!(
            "infra/gpu-ckpt-node-installer".parse::<DaemonSetRef>(),
            Ok(DaemonSetRef {
                namespace: "infra".into(),
                name: "gpu-ckpt-node-installer".into()
            })
        );
        for bad in ["x", "/x", "x/", "a/b/c"] {
            assert!(bad.parse::<DaemonSetRef>().is_err(), "{bad}");
        }
    }

    #[test]
    fn only_an_existing_daemonset_keeps_the_node_installed() {
        assert!(!Owner::Exists.uninstall());
        assert!(Owner::Gone.uninstall());
        assert!(Owner::Deleting("2026-12-05T10:00:00Z".into()).uninstall());
        assert!(Owner::Unknown("unreachable".into()).uninstall());
    }

    #[test]
    fn outside_a_pod_the_daemonset_is_unknown() {
        if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
            return;
        }
        let ds: DaemonSetRef = "ns/ds".parse().unwrap();
        match owner(&ds, Path::new("/nonexistent")) {
            Owner::Unknown(why) => assert!(why.contains("KUBERNETES_SERVICE_HOST"), "{why}"),
            o => panic!("{o:?}"),
        }
    }
}
