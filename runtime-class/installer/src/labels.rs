//! The node's labels: `node-restriction.kubernetes.io/gpu-ckpt-runtime=installed` and, where an NVIDIA driver answers, the
//! GPU model, driver and CUDA versions (read through NVML with the gpu crate, from the
//! node's driver root: the library its loader cache or usual directories hold, loaded by that
//! path). Set and removed with a JSON merge patch of the Node through the API server, with the
//! pod's service account.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpu::Inventory;
use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::ldcache;
use crate::paths::HostFs;

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

/// The name NVML's library has in a driver root.
pub const NVML_LIBRARY: &str = gpu::nvml::DEFAULT_LIBRARY;

/// Where a driver root keeps its libraries when its loader cache does not say: the
/// directories NVIDIA's container toolkit searches (the multiarch ones of Debian and Ubuntu,
/// Debian's `nvidia/current`, and the 64-bit ones of RHEL and Amazon Linux).
pub const LIBRARY_DIRS: [&str; 10] = [
    "/usr/lib64",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu/nvidia/current",
    "/usr/lib/aarch64-linux-gnu/nvidia/current",
    "/usr/lib",
    "/lib64",
    "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/lib",
];

/// What the node's driver said about its GPUs.
#[derive(Debug)]
pub enum GpuReading {
    /// NVML answered.
    Gpus(gpu::NodeInventory),
    /// No driver, and nothing of one on the node (no `/dev/nvidia*`, no
    /// `/proc/driver/nvidia`): a node without NVIDIA GPUs.
    NoGpus,
    /// The node has NVIDIA device nodes or a loaded driver, but no driver answered: what the
    /// GPUs are is unknown. Why, in words.
    Unknown(String),
}

/// `libnvidia-ml.so.1` in the driver root `driver` (its `/` as reachable here, symlinks
/// resolved inside it): where its loader cache (`/etc/ld.so.cache`) puts it, else the first
/// of [`LIBRARY_DIRS`] that has it. `None`: neither has it.
pub fn find_nvml(driver: &HostFs) -> Result<Option<PathBuf>> {
    let _span = tracing::info_span!("find_nvml", driver_root = %driver.root.display()).entered();
    let cache = driver.resolve(Path::new("/etc/ld.so.cache"))?;
    let mut candidates: Vec<PathBuf> = match std::fs::read(&cache) {
        Ok(data) => ldcache::lookup(&data, NVML_LIBRARY)
            .into_iter()
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(Error::io("read the loader cache", &cache)(e)),
    };
    candidates.extend(LIBRARY_DIRS.iter().map(|d| Path::new(d).join(NVML_LIBRARY)));
    for c in candidates {
        let here = driver.resolve(&c)?;
        if here.is_file() {
            tracing::info!(library = %c.display(), at = %here.display(), "found NVML");
            return Ok(Some(here));
        }
    }
    Ok(None)
}

/// What on the node (`fs`) shows an NVIDIA driver or GPU: `/proc/driver/nvidia`, or a
/// `/dev/nvidiactl` or `/dev/nvidia<N>` device node. `None`: nothing does.
pub fn driver_traces(fs: &HostFs) -> Result<Option<String>> {
    let proc_dir = fs.resolve(Path::new("/proc/driver/nvidia"))?;
    if proc_dir.exists() {
        return Ok(Some("/proc/driver/nvidia exists".into()));
    }
    let dev = fs.resolve(Path::new("/dev"))?;
    let Ok(entries) = std::fs::read_dir(&dev) else {
        return Ok(None);
    };
    let mut nodes: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| {
            n == "nvidiactl"
                || n.strip_prefix("nvidia")
                    .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        })
        .collect();
    nodes.sort();
    Ok((!nodes.is_empty()).then(|| format!("the node has /dev/{}", nodes.join(", /dev/"))))
}

/// The node's GPUs through the NVML library of the driver root `driver_root` (a node path,
/// reached under `fs`), loaded by its path. A node without a driver that shows no trace of
/// one has no GPUs; one with traces of a driver that does not answer is [`GpuReading::Unknown`],
/// logged with the reason.
pub fn read_gpus(fs: &HostFs, driver_root: &Path) -> GpuReading {
    let _span =
        tracing::info_span!("read_gpu_inventory", driver_root = %driver_root.display()).entered();
    let why = match fs
        .resolve(driver_root)
        .and_then(|r| HostFs::new(&r, Path::new("/")))
        .and_then(|d| find_nvml(&d))
    {
        Ok(Some(lib)) => match gpu::NvmlInventory::load_from(&lib).and_then(|n| n.node()) {
            Ok(inv) => return GpuReading::Gpus(inv),
            Err(e) => format!("NVML at {} did not answer: {e}", lib.display()),
        },
        Ok(None) => format!(
            "no {NVML_LIBRARY} under the driver root {} (neither in its /etc/ld.so.cache nor in {})",
            driver_root.display(),
            LIBRARY_DIRS.join(", ")
        ),
        Err(e) => format!("cannot look for {NVML_LIBRARY} under the driver root {}: {e}", driver_root.display()),
    };
    match driver_traces(fs) {
        Ok(Some(trace)) => {
            let why = format!("{trace}, but {why}");
            tracing::warn!(
                reason = %why,
                "the node's GPUs are unknown: the GPU labels are left off (set nodeInstaller.driverRoot to where the driver is)"
            );
            GpuReading::Unknown(why)
        }
        Ok(None) => {
            tracing::info!(reason = %why, "no NVIDIA driver or GPU on this node: labelling without GPU versions");
            GpuReading::NoGpus
        }
        Err(e) => {
            let why = format!("cannot tell whether the node has GPUs ({e}), and {why}");
            tracing::warn!(reason = %why, "the node's GPUs are unknown: the GPU labels are left off");
            GpuReading::Unknown(why)
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
        let (status, message) = self
            .send(
                reqwest::Method::PATCH,
                &format!("/api/v1/nodes/{node}"),
                Some(body),
            )
            .map_err(|why| Error::Label {
                node: node.to_string(),
                why,
            })?;
        if !status.is_success() {
            return Err(Error::Label {
                node: node.to_string(),
                why: self.answered(status, &message),
            });
        }
        Ok(())
    }

    /// `the API server at URL answered STATUS: MESSAGE`.
    pub fn answered(&self, status: reqwest::StatusCode, body: &str) -> String {
        let message = serde_json::from_str::<Value>(body)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_string))
            .unwrap_or_else(|| body.to_string());
        format!(
            "the API server at {} answered {status}: {}",
            self.url,
            message.trim()
        )
    }

    /// One request to `path` (a JSON merge patch when `body` is given); the status and the
    /// body of the answer, or why there was none.
    pub fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> std::result::Result<(reqwest::StatusCode, String), String> {
        // reqwest is built without a default crypto provider; ring is the workspace's.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let ca = reqwest::Certificate::from_pem(&self.ca_pem)
            .map_err(|e| format!("the service account's CA is not a PEM certificate: {e}"))?;
        let client = reqwest::blocking::Client::builder()
            .tls_certs_only([ca])
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
        let mut req = client
            .request(method, format!("{}{path}", self.url))
            .header("Accept", "application/json")
            .bearer_auth(&self.token);
        if let Some(body) = body {
            req = req
                .header("Content-Type", "application/merge-patch+json")
                .body(body.to_string());
        }
        let resp = req.send().map_err(|e| {
            // `{:#}`: the error and its causes, `a: b: c`.
            format!(
                "the API server at {} is not reachable: {:#}",
                self.url,
                anyhow::Error::from(e)
            )
        })?;
        let status = resp.status();
        Ok((status, resp.text().unwrap_or_default()))
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
    fn nvml_is_found_in_the_driver_roots_library_dirs_through_its_links() {
        let d = tempfile::tempdir().unwrap();
        let driver = d.path().join("run/nvidia/driver");
        let lib = driver.join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&lib).unwrap();
        let fs = HostFs::new(&driver, Path::new("/")).unwrap();
        assert_eq!(find_nvml(&fs).unwrap(), None);
        std::fs::write(lib.join("libnvidia-ml.so.580.65.06"), "elf").unwrap();
        std::os::unix::fs::symlink("libnvidia-ml.so.580.65.06", lib.join("libnvidia-ml.so.1"))
            .unwrap();
        assert_eq!(
            find_nvml(&fs).unwrap(),
            Some(lib.join("libnvidia-ml.so.580.65.06"))
        );
        // /usr/lib64 comes first.
        std::fs::create_dir_all(driver.join("usr/lib64")).unwrap();
        std::fs::write(driver.join("usr/lib64/libnvidia-ml.so.1"), "elf").unwrap();
        assert_eq!(
            find_nvml(&fs).unwrap(),
            Some(driver.join("usr/lib64/libnvidia-ml.so.1"))
        );
    }

    #[test]
    fn a_node_with_device_nodes_and_no_driver_is_unknown() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        std::fs::create_dir_all(root.join("dev")).unwrap();
        std::fs::write(root.join("dev/null"), "").unwrap();
        let fs = HostFs::new(root, Path::new("/")).unwrap();
        assert!(matches!(read_gpus(&fs, Path::new("/")), GpuReading::NoGpus));
        std::fs::write(root.join("dev/nvidia0"), "").unwrap();
        std::fs::write(root.join("dev/nvidiactl"), "").unwrap();
        match read_gpus(&fs, Path::new("/run/nvidia/driver")) {
            GpuReading::Unknown(why) => assert!(
                why.starts_with("the node has /dev/nvidia0, /dev/nvidiactl, but no libnvidia-ml.so.1 under the driver root /run/nvidia/driver"),
                "{why}"
            ),
            r => panic!("{r:?}"),
        }
        std::fs::remove_file(root.join("dev/nvidia0")).unwrap();
        std::fs::remove_file(root.join("dev/nvidiactl")).unwrap();
        std::fs::create_dir_all(root.join("proc/driver/nvidia")).unwrap();
        assert!(matches!(
            read_gpus(&fs, Path::new("/")),
            GpuReading::Unknown(_)
        ));
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
