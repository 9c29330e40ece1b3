//! The node's labels: `node-restriction.kubernetes.io/gpu-ckpt-runtime=installed` and, where an NVIDIA driver answers, the
//! GPU model, driver and CUDA versions (read through NVML with the gpu crate). Set and removed
//! with a JSON merge patch of the Node through the API server, with the pod's service account.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpu::Inventory;
use serde_json::{json, Value};

use crate::error::{Error, Result};

pub const RUNTIME_LABEL: &str = "node-restriction.kubernetes.io/gpu-ckpt-runtime";
pub const RUNTIME_INSTALLED: &str = "installed";
pub const GPU_MODEL_LABEL: &str = "node-restriction.kubernetes.io/gpu-ckpt-gpu-model";
pub const DRIVER_LABEL: &str = "node-restriction.kubernetes.io/gpu-ckpt-driver-version";
pub const CUDA_LABEL: &str = "node-restriction.kubernetes.io/gpu-ckpt-cuda-version";

/// Where a pod finds its service account.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// A Kubernetes label value from free text: at most 63 of `[A-Za-z0-9._-]`, starting and ending
/// with an alphanumeric; anything else becomes `-` ("NVIDIA H100 80GB HBM3" →
/// "NVIDIA-H100-80GB-HBM3").
pub fn label_value(s: &str) -> String {
    let mapped: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect();
    let trimmed = mapped.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    let mut out: String = trimmed.chars().take(63).collect();
    while out.ends_with(|c: char| !c.is_ascii_alphanumeric()) {
        out.pop();
    }
    out
}

/// `cuDriverGetVersion`'s number as "major.minor" (13000 → "13.0").
pub fn cuda_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// The labels for this node: the runtime's, plus the GPU's when `inventory` is given. A node
/// whose GPUs are of several models gets the models joined with `_`.
pub fn labels_for(inventory: Option<&gpu::NodeInventory>) -> BTreeMap<String, String> {
    let mut l = BTreeMap::new();
    l.insert(RUNTIME_LABEL.to_string(), RUNTIME_INSTALLED.to_string());
    if let Some(inv) = inventory {
        let mut models: Vec<String> = inv.gpus.iter().map(|g| g.name.clone()).collect();
        models.dedup();
        if !models.is_empty() {
            l.insert(GPU_MODEL_LABEL.to_string(), label_value(&models.join("_")));
        }
        if !inv.driver_version.is_empty() {
            l.insert(DRIVER_LABEL.to_string(), label_value(&inv.driver_version));
        }
        if inv.cuda_driver_version > 0 {
            l.insert(
                CUDA_LABEL.to_string(),
                cuda_version(inv.cuda_driver_version),
            );
        }
    }
    l
}

/// The node's GPUs through NVML, `None` when no driver is there (a GPU-less node gets only
/// the runtime label). Any other NVML failure is logged and treated the same way: labels are
/// a scheduling hint, and the runtime works without them.
pub fn read_inventory() -> Option<gpu::NodeInventory> {
    let _span = tracing::info_span!("read_gpu_inventory").entered();
    match gpu::NvmlInventory::load().and_then(|n| n.node()) {
        Ok(inv) => Some(inv),
        Err(gpu::GpuError::NoDriver { .. }) => {
            tracing::info!("no NVIDIA driver on this node: labelling without GPU versions");
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the GPUs through NVML: labelling without GPU versions");
            None
        }
    }
}

/// The JSON merge patch (RFC 7386) that sets `set` and removes `remove` among the node's labels.
pub fn patch_body(set: &BTreeMap<String, String>, remove: &[String]) -> Value {
    let mut labels = serde_json::Map::new();
    for k in remove {
        labels.insert(k.clone(), Value::Null);
    }
    for (k, v) in set {
        labels.insert(k.clone(), Value::String(v.clone()));
    }
    json!({ "metadata": { "labels": labels } })
}

/// The API server and the credentials of the pod's service account.
#[derive(Debug, Clone)]
pub struct ApiServer {
    /// `https://host:port`.
    pub url: String,
    pub token: String,
    /// The cluster's CA (PEM).
    pub ca_pem: Vec<u8>,
}

impl ApiServer {
    /// From the pod's environment (`KUBERNETES_SERVICE_HOST`, `KUBERNETES_SERVICE_PORT`) and its
    /// service account directory.
    pub fn in_cluster(node: &str, sa_dir: &Path) -> Result<ApiServer> {
        let err = |why: String| Error::Label {
            node: node.to_string(),
            why,
        };
        let host = std::env::var("KUBERNETES_SERVICE_HOST")
            .ok()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| {
                err("the Kubernetes API server is unknown: KUBERNETES_SERVICE_HOST is not set (the installer labels nodes only when it runs in a pod)".into())
            })?;
        let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host
        };
        let read = |name: &str| -> Result<Vec<u8>> {
            let p: PathBuf = sa_dir.join(name);
            std::fs::read(&p).map_err(|e| {
                err(format!(
                    "cannot read the service account's {name} at {}: {e}",
                    p.display()
                ))
            })
        };
        let token = String::from_utf8_lossy(&read("token")?).trim().to_string();
        let ca_pem = read("ca.crt")?;
        Ok(ApiServer {
            url: format!("https://{host}:{port}"),
            token,
            ca_pem,
        })
    }

    /// Sends `body` as a JSON merge patch of node `node`.
    pub fn patch_node(&self, node: &str, body: &Value) -> Result<()> {
        let _span = tracing::info_span!("patch_node", node, api = %self.url).entered();
        let err = |why: String| Error::Label {
            node: node.to_string(),
            why,
        };
        // reqwest is built without a default crypto provider; ring is the workspace's.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let ca = reqwest::Certificate::from_pem(&self.ca_pem).map_err(|e| {
            err(format!(
                "the service account's CA is not a PEM certificate: {e}"
            ))
        })?;
        let client = reqwest::blocking::Client::builder()
            .tls_certs_only([ca])
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| err(format!("cannot build the HTTP client: {e}")))?;
        let url = format!("{}/api/v1/nodes/{node}", self.url);
        let resp = client
            .patch(&url)
            .header("Content-Type", "application/merge-patch+json")
            .header("Accept", "application/json")
            .bearer_auth(&self.token)
            .body(body.to_string())
            .send()
            .map_err(|e| {
                // `{:#}`: the error and its causes, `a: b: c`.
                err(format!(
                    "the API server at {} is not reachable: {:#}",
                    self.url,
                    anyhow::Error::from(e)
                ))
            })?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().unwrap_or_default();
            let message = serde_json::from_str::<Value>(&text)
                .ok()
                .and_then(|v| v["message"].as_str().map(str::to_string))
                .unwrap_or(text);
            return Err(err(format!(
                "the API server at {} answered {status}: {}",
                self.url,
                message.trim()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inventory(names: &[&str]) -> gpu::NodeInventory {
        gpu::NodeInventory {
            driver_version: "580.65.06".into(),
            cuda_driver_version: 13000,
            gpus: names
                .iter()
                .enumerate()
                .map(|(i, n)| gpu::GpuInfo {
                    index: i as u32,
                    uuid: gpu::GpuUuid([i as u8; 16]),
                    name: n.to_string(),
                    architecture: None,
                    compute_capability: None,
                    memory_total_bytes: 1,
                    memory_free_bytes: None,
                    minor_number: None,
                    pci_bus_id: String::new(),
                    persistence_mode: None,
                    mig_enabled: None,
                })
                .collect(),
        }
    }

    #[test]
    fn the_patch_sets_the_runtime_and_gpu_labels() {
        let l = labels_for(Some(&inventory(&[
            "NVIDIA H100 80GB HBM3",
            "NVIDIA H100 80GB HBM3",
        ])));
        let body = patch_body(&l, &[]);
        assert_eq!(
            body,
            json!({"metadata": {"labels": {
                "node-restriction.kubernetes.io/gpu-ckpt-runtime": "installed",
                "node-restriction.kubernetes.io/gpu-ckpt-gpu-model": "NVIDIA-H100-80GB-HBM3",
                "node-restriction.kubernetes.io/gpu-ckpt-driver-version": "580.65.06",
                "node-restriction.kubernetes.io/gpu-ckpt-cuda-version": "13.0",
            }}})
        );
        // No driver: the runtime label only.
        assert_eq!(
            patch_body(&labels_for(None), &[]),
            json!({"metadata": {"labels": {"node-restriction.kubernetes.io/gpu-ckpt-runtime": "installed"}}})
        );
    }

    #[test]
    fn the_uninstall_patch_removes_with_nulls() {
        let keys = vec![RUNTIME_LABEL.to_string(), CUDA_LABEL.to_string()];
        assert_eq!(
            patch_body(&BTreeMap::new(), &keys),
            json!({"metadata": {"labels": {
                "node-restriction.kubernetes.io/gpu-ckpt-runtime": null,
                "node-restriction.kubernetes.io/gpu-ckpt-cuda-version": null,
            }}})
        );
    }

    #[test]
    fn label_values_are_valid() {
        assert_eq!(label_value(" Tesla T4 "), "Tesla-T4");
        assert_eq!(label_value("(x)"), "x");
        let long = "a".repeat(70) + "-";
        assert_eq!(label_value(&long).len(), 63);
        assert_eq!(cuda_version(12080), "12.8");
        let mixed = labels_for(Some(&inventory(&["A10", "L4"])));
        assert_eq!(mixed[GPU_MODEL_LABEL], "A10_L4");
    }

    #[test]
    fn an_unreachable_api_server_is_named() {
        // A port nothing listens on.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let api = ApiServer {
            url: format!("https://127.0.0.1:{port}"),
            token: "t".into(),
            ca_pem: TEST_CA.as_bytes().to_vec(),
        };
        let err = api
            .patch_node("node-a", &patch_body(&labels_for(None), &[]))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(&format!(
                "labelling node node-a: the API server at https://127.0.0.1:{port} is not reachable: "
            )),
            "{err}"
        );
    }

    #[test]
    fn outside_a_pod_the_error_says_so() {
        if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
            return;
        }
        let err = ApiServer::in_cluster("n1", Path::new("/nonexistent"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("KUBERNETES_SERVICE_HOST is not set"), "{err}");
    }

    /// A self-signed certificate (any valid one does: the connection fails before TLS).
    const TEST_CA: &str = "-----BEGIN CERTIFICATE-----
MIIBfzCCASWgAwIBAgIUVTA3Cf+P1D/xfrXikF2nUKwCcaYwCgYIKoZIzj0EAwIw
FTETMBEGA1UEAwwKa3ViZXJuZXRlczAeFw0yNjEyMDQxMzEzMDNaFw0zNjEyMDEx
MzEzMDNaMBUxEzARBgNVBAMMCmt1YmVybmV0ZXMwWTATBgcqhkjOPQIBBggqhkjO
PQMBBwNCAARsz2EIn0KM4XpVYEDMXQfUEIufU2cc7gaSwySZx3bQIAfk+MZpj2iT
sPaqz36phtni9YtmJBVH+0zVG+LT2fh3o1MwUTAdBgNVHQ4EFgQU/EeF+N2gj8Gn
1cytQ8w7URRxCvYwHwYDVR0jBBgwFoAU/EeF+N2gj8Gn1cytQ8w7URRxCvYwDwYD
VR0TAQH/BAUwAwEB/zAKBggqhkjOPQQDAgNIADBFAiEAqnVbgGS3s1kJv3SyFCo+
Kylvqs1v64DBP3Lq4zWba/QCIEEz1My3CBNudIQE0tcO6ILKX4UAe/BjPlnxn2bL
ry1g
-----END CERTIFICATE-----
";
}
