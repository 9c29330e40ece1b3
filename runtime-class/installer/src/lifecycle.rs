//! What a stopped installer pod does to its node. The pod's container is stopped for a rolling
//! update (`helm upgrade`) as well as for `helm uninstall`, a node that no longer matches the
//! DaemonSet (its nodeSelector, affinity or tolerations changed, or the node's labels), an
//! eviction or a node shutdown. Only the rolling update has a next pod on this node that keeps
//! it managed; after any other stop nothing would run `repair` there any more, so later changes
//! (trust, options) would never reach it. So on SIGTERM the installer asks the API server (with
//! the pod's service account) about its DaemonSet, and keeps the node installed only when the
//! DaemonSet is not being deleted and has a newer pod template than this pod's: its
//! `metadata.generation` is above the pod's `pod-template-generation` label (which the
//! DaemonSet controller sets to the generation it created the pod from; the chart passes it
//! through the downward API). Then the next pod finds the node installed, and an unchanged
//! payload changes and restarts nothing. Gone (404), being deleted, or the same template: it
//! uninstalls (an eviction or a node shutdown costs one reinstall of that node).
//!
//! When the API server cannot be asked (not reachable, 5xx, 401/403), the installer asks again
//! with a doubling pause for at most `--owner-retry-seconds` (default 30 s, well inside the
//! chart's 120 s grace period, which the uninstall itself needs too). If it still cannot tell,
//! it uninstalls: a node is never left with a runtime that nothing manages, and being wrong
//! costs one reinstall of that node.

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
    /// It exists and is not being deleted; its `metadata.generation` (absent: none).
    Exists(Option<u64>),
    /// It is being deleted (its deletionTimestamp).
    Deleting(String),
    /// 404.
    Gone,
    /// It could not be asked; why.
    Unknown(String),
}

impl Owner {
    /// Whether a pod made from template generation `pod` (its `pod-template-generation`
    /// label; `None`: unknown) uninstalls when it stops: unless the DaemonSet exists, is not
    /// being deleted and has a newer template, so that a rolling update replaces this pod.
    pub fn uninstall(&self, pod: Option<u64>) -> bool {
        !matches!((self, pod), (Owner::Exists(Some(ds)), Some(pod)) if *ds > pod)
    }

    /// Whether asking again may answer: the API server could not be asked.
    fn retry(&self) -> bool {
        matches!(self, Owner::Unknown(_))
    }
}

/// Asks with `ask` until it answers other than [`Owner::Unknown`] or `budget` is spent, with a
/// doubling pause (from `first`, at most 8 s) passed to `sleep`; the last answer.
pub fn ask_with_retry(
    mut ask: impl FnMut() -> Owner,
    budget: std::time::Duration,
    first: std::time::Duration,
    mut sleep: impl FnMut(std::time::Duration),
) -> Owner {
    let mut spent = std::time::Duration::ZERO;
    let mut pause = first;
    loop {
        let owner = ask();
        if !owner.retry() || spent + pause > budget {
            return owner;
        }
        if let Owner::Unknown(why) = &owner {
            tracing::warn!(reason = %why, retry_in = ?pause, "cannot ask the API server about the DaemonSet: asking again");
        }
        sleep(pause);
        spent += pause;
        pause = (pause * 2).min(std::time::Duration::from_secs(8));
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
                None if v["kind"] == "DaemonSet" => {
                    Owner::Exists(v["metadata"]["generation"].as_u64())
                }
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

/// Whether a pod of `ds` made from template generation `pod` that is being stopped
/// uninstalls, logged with the reason; the API server is asked for at most `retry`.
pub fn uninstall_on_stop(
    ds: &DaemonSetRef,
    sa_dir: &Path,
    pod: Option<u64>,
    retry: std::time::Duration,
) -> bool {
    let owner = ask_with_retry(
        || owner(ds, sa_dir),
        retry,
        std::time::Duration::from_secs(1),
        std::thread::sleep,
    );
    let uninstall = owner.uninstall(pod);
    match &owner {
        Owner::Exists(generation) if !uninstall => tracing::info!(
            daemonset = %ds, generation = ?generation, pod_template_generation = ?pod,
            "the DaemonSet has a newer pod template (a rolling update): gpu-ckpt stays installed for the next pod"
        ),
        Owner::Exists(generation) => tracing::info!(
            daemonset = %ds, generation = ?generation, pod_template_generation = ?pod,
            "the DaemonSet has no newer pod template than this pod's (the node no longer matches it, an eviction, a node shutdown): uninstalling, so that no node keeps a runtime nothing manages"
        ),
        Owner::Deleting(t) => tracing::info!(
            daemonset = %ds, deletion = %t,
            "the DaemonSet is being deleted: uninstalling"
        ),
        Owner::Gone => tracing::info!(daemonset = %ds, "the DaemonSet is gone: uninstalling"),
        Owner::Unknown(why) => tracing::warn!(
            daemonset = %ds, reason = %why, asked_for = ?retry,
            "cannot ask the API server whether the DaemonSet still exists: uninstalling, so that no node keeps a runtime nothing manages"
        ),
    }
    uninstall
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
    fn only_a_rolling_update_keeps_the_node_installed() {
        // A newer template than this pod's: the rolling update's next pod takes over.
        assert!(!Owner::Exists(Some(3)).uninstall(Some(2)));
        // The same template: the pod stopped because the node no longer matches, an
        // eviction, a shutdown; nothing would manage the node.
        assert!(Owner::Exists(Some(2)).uninstall(Some(2)));
        assert!(Owner::Exists(None).uninstall(Some(2)));
        assert!(Owner::Exists(Some(3)).uninstall(None));
        assert!(Owner::Gone.uninstall(Some(1)));
        assert!(Owner::Deleting("2026-12-05T10:00:00Z".into()).uninstall(Some(1)));
        assert!(Owner::Unknown("unreachable".into()).uninstall(Some(1)));
    }

    #[test]
    fn an_unreachable_api_server_is_asked_again_within_a_bound() {
        use std::time::Duration;
        // Answers on the third try.
        let mut asked = 0;
        let mut slept = Vec::new();
        let got = ask_with_retry(
            || {
                asked += 1;
                if asked < 3 {
                    Owner::Unknown("503".into())
                } else {
                    Owner::Exists(Some(2))
                }
            },
            Duration::from_secs(30),
            Duration::from_secs(1),
            |d| slept.push(d),
        );
        assert_eq!(got, Owner::Exists(Some(2)));
        assert_eq!(asked, 3);
        assert_eq!(slept, [Duration::from_secs(1), Duration::from_secs(2)]);
        // Never answers: the pauses stay within the budget, then the last answer.
        let mut asked = 0;
        let mut slept = Duration::ZERO;
        let got = ask_with_retry(
            || {
                asked += 1;
                Owner::Unknown("401".into())
            },
            Duration::from_secs(30),
            Duration::from_secs(1),
            |d| slept += d,
        );
        assert_eq!(got, Owner::Unknown("401".into()));
        assert!(slept <= Duration::from_secs(30), "{slept:?}");
        assert_eq!(asked, 6, "1+2+4+8+8 s of pauses");
        // An answer is not asked again.
        let mut asked = 0;
        ask_with_retry(
            || {
                asked += 1;
                Owner::Gone
            },
            Duration::from_secs(30),
            Duration::from_secs(1),
            |_| panic!("slept"),
        );
        assert_eq!(asked, 1);
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
