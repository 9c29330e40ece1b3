//! A kubelet-like CRI client over a node's containerd socket (CRI v1, k8s-cri 0.11).
//!
//! Pods and containers are configured the way kubelet configures them (stack.md §3.9): pod
//! metadata, `log_directory` `<logs>/<ns>_<pod>_<uid>`, `cgroup_parent`
//! `/kubepods/besteffort/pod<uid>` (cgroupfs), namespace options network NODE or POD, pid
//! CONTAINER, ipc POD, and the `io.kubernetes.*` labels.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use hyper_util::rt::TokioIo;
use k8s_cri::v1 as cri;
use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use tonic::transport::{Channel, Endpoint, Uri};

pub use k8s_cri::v1;

/// Largest gRPC message accepted (ExecSync output, statuses).
const MAX_MESSAGE: usize = 64 << 20;

/// Connects a tonic channel to a unix socket.
pub async fn unix_channel(socket: &Path) -> Result<Channel> {
    let path = socket.to_path_buf();
    let channel = Endpoint::try_from("http://[::]:50051")?
        .connect_timeout(Duration::from_secs(10))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(&path).await?;
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        }))
        .await
        .with_context(|| format!("connect to {}", socket.display()))?;
    Ok(channel)
}

/// Pod network mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Network {
    /// hostNetwork: the node's network namespace (no CNI needed).
    Node,
    /// A pod network namespace set up by CNI.
    Pod,
}

/// The `annotation` and `label` setters of a spec with `annotations` and `labels` maps.
macro_rules! annotation_and_label {
    () => {
        pub fn annotation(mut self, key: &str, value: &str) -> Self {
            self.annotations.insert(key.to_string(), value.to_string());
            self
        }

        pub fn label(mut self, key: &str, value: &str) -> Self {
            self.labels.insert(key.to_string(), value.to_string());
            self
        }
    };
}

/// What a pod looks like; `PodSpec::new(name)` gives kubelet-like defaults.
#[derive(Debug, Clone)]
pub struct PodSpec {
    pub name: String,
    pub namespace: String,
    pub uid: String,
    pub attempt: u32,
    /// CRI runtime handler (`gpu-ckpt` for the project, `runc` for the baseline).
    pub handler: String,
    pub network: Network,
    pub hostname: Option<String>,
    pub labels: HashMap<String, String>,
    pub annotations: HashMap<String, String>,
    /// Directory below which `<ns>_<pod>_<uid>` is created as the pod's `log_directory`.
    pub log_root: PathBuf,
}

impl PodSpec {
    /// A pod `name` in namespace `default` with a fresh uid, handler `runc`, hostNetwork, and its
    /// log directory below `log_root` (use [`crate::stack::Node::pod_log_root`]).
    pub fn new(name: &str, log_root: &Path) -> PodSpec {
        PodSpec {
            name: name.to_string(),
            namespace: "default".to_string(),
            uid: new_uid(),
            attempt: 0,
            handler: "runc".to_string(),
            network: Network::Node,
            hostname: None,
            labels: HashMap::new(),
            annotations: HashMap::new(),
            log_root: log_root.to_path_buf(),
        }
    }

    pub fn handler(mut self, handler: &str) -> Self {
        self.handler = handler.to_string();
        self
    }

    pub fn namespace(mut self, ns: &str) -> Self {
        self.namespace = ns.to_string();
        self
    }

    pub fn uid(mut self, uid: &str) -> Self {
        self.uid = uid.to_string();
        self
    }

    pub fn network(mut self, network: Network) -> Self {
        self.network = network;
        self
    }

    annotation_and_label!();

    /// `<log_root>/<ns>_<pod>_<uid>`.
    pub fn log_directory(&self) -> PathBuf {
        self.log_root
            .join(format!("{}_{}_{}", self.namespace, self.name, self.uid))
    }

    /// `labels` and the labels kubelet gives everything of this pod (name, namespace, uid).
    fn with_pod_labels(&self, labels: &HashMap<String, String>) -> HashMap<String, String> {
        let mut labels = labels.clone();
        labels.insert("io.kubernetes.pod.name".into(), self.name.clone());
        labels.insert("io.kubernetes.pod.namespace".into(), self.namespace.clone());
        labels.insert("io.kubernetes.pod.uid".into(), self.uid.clone());
        labels
    }

    /// The kubelet-like `PodSandboxConfig`.
    pub fn to_config(&self) -> cri::PodSandboxConfig {
        let labels = self.with_pod_labels(&self.labels);
        let mut annotations = self.annotations.clone();
        annotations
            .entry("kubernetes.io/config.source".into())
            .or_insert_with(|| "api".into());
        let network = match self.network {
            Network::Node => cri::NamespaceMode::Node,
            Network::Pod => cri::NamespaceMode::Pod,
        };
        cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name: self.name.clone(),
                uid: self.uid.clone(),
                namespace: self.namespace.clone(),
                attempt: self.attempt,
            }),
            hostname: self.hostname.clone().unwrap_or_else(|| {
                if self.network == Network::Node {
                    String::new()
                } else {
                    self.name.clone()
                }
            }),
            log_directory: self.log_directory().display().to_string(),
            dns_config: None,
            port_mappings: vec![],
            labels,
            annotations,
            linux: Some(cri::LinuxPodSandboxConfig {
                cgroup_parent: format!("/kubepods/besteffort/pod{}", self.uid),
                security_context: Some(cri::LinuxSandboxSecurityContext {
                    namespace_options: Some(cri::NamespaceOption {
                        network: network as i32,
                        pid: cri::NamespaceMode::Container as i32,
                        ipc: cri::NamespaceMode::Pod as i32,
                        target_id: String::new(),
                        userns_options: None,
                    }),
                    ..Default::default()
                }),
                sysctls: HashMap::new(),
                overhead: None,
                resources: None,
            }),
            windows: None,
        }
    }
}

/// A fresh uid in UUID form (unique within the machine: time, pid and a counter).
pub fn new_uid() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let a = (nanos as u64) ^ (u64::from(std::process::id()) << 40);
    let b =
        (nanos >> 64) as u64 ^ n.wrapping_mul(0x9e3779b97f4a7c15) ^ u64::from(std::process::id());
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        (a >> 32) as u32,
        (a >> 16) as u16,
        (a & 0xfff) as u16,
        (b >> 48) as u16 & 0xfff,
        b & 0xffff_ffff_ffff
    )
}

/// Removes the (empty) pod cgroup `kubepods/besteffort/pod<uid>` in every hierarchy, as kubelet
/// does after the pod is gone. Best effort.
pub fn remove_pod_cgroups(uid: &str) {
    let Ok(hierarchies) = std::fs::read_dir("/sys/fs/cgroup") else {
        return;
    };
    for h in hierarchies.flatten() {
        let base = h.path();
        for dir in [
            base.join(format!("kubepods/besteffort/pod{uid}")),
            base.join(format!("kubepods.slice/kubepods-besteffort.slice/pod{uid}")),
        ] {
            if dir.is_dir() {
                let _ = std::fs::remove_dir(&dir);
            }
        }
    }
}

/// One container of a pod.
#[derive(Debug, Clone, Default)]
pub struct ContainerSpec {
    pub name: String,
    pub image: String,
    pub command: Vec<String>,
    pub args: Vec<String>,
    pub envs: Vec<(String, String)>,
    pub working_dir: String,
    pub labels: HashMap<String, String>,
    pub annotations: HashMap<String, String>,
    pub resources: Option<cri::LinuxContainerResources>,
    pub mounts: Vec<cri::Mount>,
    pub attempt: u32,
    /// `securityContext.runAsUser` and `runAsGroup`.
    pub run_as_user: Option<i64>,
    pub run_as_group: Option<i64>,
    /// `securityContext.capabilities.add` (`SYS_ADMIN`, ...).
    pub add_capabilities: Vec<String>,
    /// `securityContext.allowPrivilegeEscalation: false`.
    pub no_new_privs: bool,
    /// `securityContext.seccompProfile.type`; `None` sends no profile (containerd runs the
    /// container unconfined).
    pub seccomp: Option<cri::security_profile::ProfileType>,
    /// `securityContext.readOnlyRootFilesystem`.
    pub readonly_rootfs: bool,
    /// The masked and read-only paths kubelet sends (containerd's spec has none without them).
    pub masked_paths: Vec<String>,
    pub readonly_paths: Vec<String>,
}

impl ContainerSpec {
    pub fn new(name: &str, image: &str) -> ContainerSpec {
        ContainerSpec {
            name: name.to_string(),
            image: image.to_string(),
            ..Default::default()
        }
    }

    pub fn command<S: AsRef<str>>(mut self, cmd: &[S]) -> Self {
        self.command = cmd.iter().map(|s| s.as_ref().to_string()).collect();
        self
    }

    pub fn args<S: AsRef<str>>(mut self, args: &[S]) -> Self {
        self.args = args.iter().map(|s| s.as_ref().to_string()).collect();
        self
    }

    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.envs.push((key.to_string(), value.to_string()));
        self
    }

    annotation_and_label!();

    /// Sets the memory limit (bytes).
    pub fn memory_limit(mut self, bytes: i64) -> Self {
        let r = self.resources.get_or_insert_with(Default::default);
        r.memory_limit_in_bytes = bytes;
        self
    }

    pub fn resources(mut self, resources: cri::LinuxContainerResources) -> Self {
        self.resources = Some(resources);
        self
    }

    /// Runs as `uid`:`gid`.
    pub fn run_as(mut self, uid: i64, gid: i64) -> Self {
        self.run_as_user = Some(uid);
        self.run_as_group = Some(gid);
        self
    }

    /// Adds capabilities to the runtime's default set.
    pub fn add_capabilities<S: AsRef<str>>(mut self, caps: &[S]) -> Self {
        self.add_capabilities = caps.iter().map(|c| c.as_ref().to_string()).collect();
        self
    }

    /// `securityContext.readOnlyRootFilesystem: true`.
    pub fn readonly_rootfs(mut self) -> Self {
        self.readonly_rootfs = true;
        self
    }

    /// The masked and read-only paths kubelet sends for `procMount: Default`.
    pub fn kubelet_proc_paths(mut self) -> Self {
        self.masked_paths = [
            "/proc/asound",
            "/proc/acpi",
            "/proc/kcore",
            "/proc/keys",
            "/proc/latency_stats",
            "/proc/timer_list",
            "/proc/timer_stats",
            "/proc/sched_debug",
            "/proc/scsi",
            "/sys/firmware",
            "/sys/devices/virtual/powercap",
        ]
        .map(String::from)
        .to_vec();
        self.readonly_paths = [
            "/proc/bus",
            "/proc/fs",
            "/proc/irq",
            "/proc/sys",
            "/proc/sysrq-trigger",
        ]
        .map(String::from)
        .to_vec();
        self
    }

    /// Sets `no_new_privs`.
    pub fn no_new_privs(mut self) -> Self {
        self.no_new_privs = true;
        self
    }

    /// The seccomp profile type (RuntimeDefault, Unconfined).
    pub fn seccomp(mut self, profile: cri::security_profile::ProfileType) -> Self {
        self.seccomp = Some(profile);
        self
    }

    /// An image volume (`volumes[].image` in a pod spec, KEP-4639): the image `image` (what
    /// PullImage returned, as the kubelet passes it) mounted read-only at `container_path`.
    pub fn image_volume(mut self, container_path: &str, image: &str) -> Self {
        self.mounts.push(cri::Mount {
            container_path: container_path.to_string(),
            readonly: true,
            image: Some(cri::ImageSpec {
                image: image.to_string(),
                user_specified_image: image.to_string(),
                ..Default::default()
            }),
            ..Default::default()
        });
        self
    }

    /// A hostPath volume: `host_path` bind-mounted at `container_path`.
    pub fn host_path(mut self, container_path: &str, host_path: &Path, readonly: bool) -> Self {
        self.mounts.push(cri::Mount {
            container_path: container_path.to_string(),
            host_path: host_path.display().to_string(),
            readonly,
            ..Default::default()
        });
        self
    }

    /// The kubelet-like `ContainerConfig` for a container of `pod`.
    pub fn to_config(&self, pod: &PodSpec) -> cri::ContainerConfig {
        let mut labels = pod.with_pod_labels(&self.labels);
        labels.insert("io.kubernetes.container.name".into(), self.name.clone());
        let mut annotations = self.annotations.clone();
        annotations
            .entry("io.kubernetes.container.restartCount".into())
            .or_insert_with(|| self.attempt.to_string());
        annotations
            .entry("io.kubernetes.container.terminationMessagePath".into())
            .or_insert_with(|| "/dev/termination-log".into());
        annotations
            .entry("io.kubernetes.container.terminationMessagePolicy".into())
            .or_insert_with(|| "File".into());
        annotations
            .entry("io.kubernetes.pod.terminationGracePeriod".into())
            .or_insert_with(|| "30".into());
        cri::ContainerConfig {
            metadata: Some(cri::ContainerMetadata {
                name: self.name.clone(),
                attempt: self.attempt,
            }),
            image: Some(cri::ImageSpec {
                image: self.image.clone(),
                user_specified_image: self.image.clone(),
                ..Default::default()
            }),
            command: self.command.clone(),
            args: self.args.clone(),
            working_dir: self.working_dir.clone(),
            envs: self
                .envs
                .iter()
                .map(|(k, v)| cri::KeyValue {
                    key: k.clone(),
                    value: v.clone(),
                })
                .collect(),
            mounts: self.mounts.clone(),
            labels,
            annotations,
            // Relative to the pod's log_directory, like kubelet's `<name>/<attempt>.log`.
            log_path: format!("{}/{}.log", self.name, self.attempt),
            linux: Some(cri::LinuxContainerConfig {
                resources: Some(self.resources.clone().unwrap_or_default()),
                security_context: Some(cri::LinuxContainerSecurityContext {
                    namespace_options: Some(cri::NamespaceOption {
                        network: match pod.network {
                            Network::Node => cri::NamespaceMode::Node as i32,
                            Network::Pod => cri::NamespaceMode::Pod as i32,
                        },
                        pid: cri::NamespaceMode::Container as i32,
                        ipc: cri::NamespaceMode::Pod as i32,
                        target_id: String::new(),
                        userns_options: None,
                    }),
                    run_as_user: self.run_as_user.map(|value| cri::Int64Value { value }),
                    run_as_group: self.run_as_group.map(|value| cri::Int64Value { value }),
                    capabilities: (!self.add_capabilities.is_empty()).then(|| cri::Capability {
                        add_capabilities: self.add_capabilities.clone(),
                        ..Default::default()
                    }),
                    no_new_privs: self.no_new_privs,
                    readonly_rootfs: self.readonly_rootfs,
                    masked_paths: self.masked_paths.clone(),
                    readonly_paths: self.readonly_paths.clone(),
                    seccomp: self.seccomp.map(|t| cri::SecurityProfile {
                        profile_type: t as i32,
                        localhost_ref: String::new(),
                    }),
                    ..Default::default()
                }),
            }),
            ..Default::default()
        }
    }
}

/// A running pod sandbox.
#[derive(Debug, Clone)]
pub struct Pod {
    pub id: String,
    pub spec: PodSpec,
    pub config: cri::PodSandboxConfig,
}

impl Pod {
    /// The container log file of `container` (attempt 0) on the host.
    pub fn container_log(&self, container: &str) -> PathBuf {
        self.spec.log_directory().join(format!("{container}/0.log"))
    }
}

/// Result of ExecSync.
#[derive(Debug, Clone)]
pub struct ExecResult {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub exit_code: i32,
}

impl ExecResult {
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
    pub fn stderr_str(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}

/// The CRI client (RuntimeService + ImageService). Cheap to clone.
#[derive(Debug, Clone)]
pub struct Cri {
    runtime: RuntimeServiceClient<Channel>,
    image: ImageServiceClient<Channel>,
    timeout: Duration,
}

/// A `Cri` method for a RuntimeService call whose request is one id: `name`, the request type
/// with its id field, and the call's name for the error. Without `-> Response` the tests do not
/// read the answer; with it, the call is verbose and returns the answer.
macro_rules! id_call {
    ($(#[$doc:meta])* $name:ident, $req:ident { $field:ident }, $call:literal) => {
        $(#[$doc])*
        pub async fn $name(&self, id: &str) -> Result<()> {
            self.runtime()
                .$name(self.req(cri::$req {
                    $field: id.to_string(),
                }))
                .await
                .with_context(|| format!(concat!("CRI ", $call, " {}"), id))?;
            Ok(())
        }
    };
    ($(#[$doc:meta])* $name:ident, $req:ident { $field:ident } -> $resp:ident, $call:literal) => {
        $(#[$doc])*
        pub async fn $name(&self, id: &str) -> Result<cri::$resp> {
            let request = cri::$req {
                $field: id.to_string(),
                verbose: true,
            };
            let r = self.runtime().$name(self.req(request)).await;
            Ok(r.with_context(|| format!(concat!("CRI ", $call, " {}"), id))?.into_inner())
        }
    };
}

impl Cri {
    /// Connects to the CRI service on containerd's socket.
    pub async fn connect(socket: &Path) -> Result<Cri> {
        let ch = unix_channel(socket).await?;
        Ok(Cri {
            runtime: RuntimeServiceClient::new(ch.clone())
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
            image: ImageServiceClient::new(ch)
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
            timeout: Duration::from_secs(180),
        })
    }

    /// Per-call deadline (default 180 s).
    pub fn with_timeout(mut self, timeout: Duration) -> Cri {
        self.timeout = timeout;
        self
    }

    fn req<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        r.set_timeout(self.timeout);
        r
    }

    /// Raw RuntimeService client.
    pub fn runtime(&self) -> RuntimeServiceClient<Channel> {
        self.runtime.clone()
    }

    /// Raw ImageService client.
    pub fn images(&self) -> ImageServiceClient<Channel> {
        self.image.clone()
    }

    /// CRI Version.
    pub async fn version(&self) -> Result<cri::VersionResponse> {
        let r = self
            .runtime()
            .version(self.req(cri::VersionRequest {
                version: "v1".into(),
            }))
            .await
            .context("CRI Version")?;
        Ok(r.into_inner())
    }

    /// CRI Status (verbose).
    pub async fn status(&self) -> Result<cri::StatusResponse> {
        let r = self
            .runtime()
            .status(self.req(cri::StatusRequest { verbose: true }))
            .await
            .context("CRI Status")?;
        Ok(r.into_inner())
    }

    /// PullImage with a login, as the kubelet sends a pod's imagePullSecrets; returns the image
    /// ref (image id).
    pub async fn pull_image_with_auth(
        &self,
        image: &str,
        username: &str,
        password: &str,
    ) -> Result<String> {
        // As a dockerconfigjson key: containerd parses it as a URL.
        let server = format!("https://{}", image.split('/').next().unwrap_or_default());
        let auth = cri::AuthConfig {
            username: username.to_string(),
            password: password.to_string(),
            server_address: server,
            ..Default::default()
        };
        self.pull(image, Some(auth))
            .await
            .with_context(|| format!("PullImage {image} with a login"))
    }

    /// PullImage; returns the image ref (image id).
    pub async fn pull_image(&self, image: &str) -> Result<String> {
        self.pull(image, None)
            .await
            .with_context(|| format!("CRI PullImage {image}"))
    }

    /// PullImage of `image` with the login `auth`, if any; the image ref (image id).
    async fn pull(
        &self,
        image: &str,
        auth: Option<cri::AuthConfig>,
    ) -> std::result::Result<String, tonic::Status> {
        let r = self
            .images()
            .pull_image(self.req(cri::PullImageRequest {
                image: Some(cri::ImageSpec {
                    image: image.to_string(),
                    user_specified_image: image.to_string(),
                    ..Default::default()
                }),
                auth,
                sandbox_config: None,
            }))
            .await?;
        Ok(r.into_inner().image_ref)
    }

    /// ImageStatus (None when the image is absent).
    pub async fn image_status(&self, image: &str) -> Result<Option<cri::Image>> {
        let r = self
            .images()
            .image_status(self.req(cri::ImageStatusRequest {
                image: Some(cri::ImageSpec {
                    image: image.to_string(),
                    ..Default::default()
                }),
                verbose: false,
            }))
            .await
            .with_context(|| format!("CRI ImageStatus {image}"))?;
        Ok(r.into_inner().image)
    }

    /// RunPodSandbox with a raw config; returns the sandbox id.
    pub async fn run_pod_sandbox(
        &self,
        config: cri::PodSandboxConfig,
        handler: &str,
    ) -> Result<String> {
        let name = config.metadata.clone().unwrap_or_default().name;
        let r = self
            .runtime()
            .run_pod_sandbox(self.req(cri::RunPodSandboxRequest {
                config: Some(config),
                runtime_handler: handler.to_string(),
            }))
            .await
            .with_context(|| format!("CRI RunPodSandbox {name} (handler {handler:?})"))?;
        Ok(r.into_inner().pod_sandbox_id)
    }

    /// Creates the pod's log directory (kubelet does) and runs the sandbox.
    pub async fn run_pod(&self, spec: &PodSpec) -> Result<Pod> {
        let dir = spec.log_directory();
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        let config = spec.to_config();
        let id = self.run_pod_sandbox(config.clone(), &spec.handler).await?;
        Ok(Pod {
            id,
            spec: spec.clone(),
            config,
        })
    }

    /// CreateContainer with a raw config.
    pub async fn create_container_raw(
        &self,
        pod_id: &str,
        config: cri::ContainerConfig,
        sandbox_config: cri::PodSandboxConfig,
    ) -> Result<String> {
        let name = config.metadata.clone().unwrap_or_default().name;
        let r = self
            .runtime()
            .create_container(self.req(cri::CreateContainerRequest {
                pod_sandbox_id: pod_id.to_string(),
                config: Some(config),
                sandbox_config: Some(sandbox_config),
            }))
            .await
            .with_context(|| format!("CRI CreateContainer {name} in pod {pod_id}"))?;
        Ok(r.into_inner().container_id)
    }

    /// CreateContainer for `spec` in `pod`; returns the container id.
    pub async fn create_container(&self, pod: &Pod, spec: &ContainerSpec) -> Result<String> {
        let dir = pod.spec.log_directory().join(&spec.name);
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        self.create_container_raw(&pod.id, spec.to_config(&pod.spec), pod.config.clone())
            .await
    }

    id_call!(
        /// StartContainer.
        start_container, StartContainerRequest { container_id }, "StartContainer"
    );

    /// CreateContainer + StartContainer.
    pub async fn run_container(&self, pod: &Pod, spec: &ContainerSpec) -> Result<String> {
        let id = self.create_container(pod, spec).await?;
        self.start_container(&id).await?;
        Ok(id)
    }

    /// ExecSync (timeout in seconds; 0 = none).
    pub async fn exec_sync(&self, id: &str, cmd: &[&str], timeout_s: i64) -> Result<ExecResult> {
        let r = self
            .runtime()
            .exec_sync(self.req(cri::ExecSyncRequest {
                container_id: id.to_string(),
                cmd: cmd.iter().map(|s| s.to_string()).collect(),
                timeout: timeout_s,
            }))
            .await
            .with_context(|| format!("CRI ExecSync {id} {cmd:?}"))?
            .into_inner();
        Ok(ExecResult {
            stdout: r.stdout,
            stderr: r.stderr,
            exit_code: r.exit_code,
        })
    }

    /// StopContainer (grace period in seconds).
    pub async fn stop_container(&self, id: &str, timeout_s: i64) -> Result<()> {
        self.runtime()
            .stop_container(self.req(cri::StopContainerRequest {
                container_id: id.to_string(),
                timeout: timeout_s,
            }))
            .await
            .with_context(|| format!("CRI StopContainer {id}"))?;
        Ok(())
    }

    id_call!(
        /// RemoveContainer.
        remove_container, RemoveContainerRequest { container_id }, "RemoveContainer"
    );
    id_call!(
        /// StopPodSandbox.
        stop_pod_sandbox, StopPodSandboxRequest { pod_sandbox_id }, "StopPodSandbox"
    );
    id_call!(
        /// RemovePodSandbox.
        remove_pod_sandbox, RemovePodSandboxRequest { pod_sandbox_id }, "RemovePodSandbox"
    );

    /// Stops and removes every container of the pod, then the pod (kubelet's order).
    pub async fn remove_pod(&self, pod: &Pod) -> Result<()> {
        for c in self.list_containers(Some(&pod.id)).await? {
            self.stop_container(&c.id, 10).await?;
            self.remove_container(&c.id).await?;
        }
        self.stop_pod_sandbox(&pod.id).await?;
        self.remove_pod_sandbox(&pod.id).await?;
        remove_pod_cgroups(&pod.spec.uid);
        Ok(())
    }

    id_call!(
        /// PodSandboxStatus.
        pod_sandbox_status,
        PodSandboxStatusRequest { pod_sandbox_id } -> PodSandboxStatusResponse,
        "PodSandboxStatus"
    );
    id_call!(
        /// ContainerStatus (verbose: `info` holds containerd's JSON with pid, runtime, spec).
        container_status,
        ContainerStatusRequest { container_id } -> ContainerStatusResponse,
        "ContainerStatus"
    );

    /// The container's state (CONTAINER_CREATED/RUNNING/EXITED/UNKNOWN).
    pub async fn container_state(&self, id: &str) -> Result<cri::ContainerState> {
        let st = self
            .container_status(id)
            .await?
            .status
            .with_context(|| format!("CRI ContainerStatus {id}: no status"))?;
        Ok(
            cri::ContainerState::try_from(st.state)
                .unwrap_or(cri::ContainerState::ContainerUnknown),
        )
    }

    /// ListContainers, optionally of one pod.
    pub async fn list_containers(&self, pod_id: Option<&str>) -> Result<Vec<cri::Container>> {
        let filter = pod_id.map(|p| cri::ContainerFilter {
            pod_sandbox_id: p.to_string(),
            ..Default::default()
        });
        let r = self
            .runtime()
            .list_containers(self.req(cri::ListContainersRequest { filter }))
            .await
            .context("CRI ListContainers")?;
        Ok(r.into_inner().containers)
    }

    /// ListPodSandbox.
    pub async fn list_pod_sandboxes(&self) -> Result<Vec<cri::PodSandbox>> {
        let r = self
            .runtime()
            .list_pod_sandbox(self.req(cri::ListPodSandboxRequest { filter: None }))
            .await
            .context("CRI ListPodSandbox")?;
        Ok(r.into_inner().items)
    }

    /// UpdateContainerResources.
    pub async fn update_container_resources(
        &self,
        id: &str,
        linux: cri::LinuxContainerResources,
        annotations: HashMap<String, String>,
    ) -> Result<()> {
        self.runtime()
            .update_container_resources(self.req(cri::UpdateContainerResourcesRequest {
                container_id: id.to_string(),
                linux: Some(linux),
                windows: None,
                annotations,
            }))
            .await
            .with_context(|| format!("CRI UpdateContainerResources {id}"))?;
        Ok(())
    }

    /// CheckpointContainer into the archive `location` (timeout in seconds; 0 = default).
    pub async fn checkpoint_container(
        &self,
        id: &str,
        location: &Path,
        timeout_s: i64,
    ) -> Result<()> {
        let mut req = self.req(cri::CheckpointContainerRequest {
            container_id: id.to_string(),
            location: location.display().to_string(),
            timeout: timeout_s,
        });
        if timeout_s > 0 {
            req.set_timeout(Duration::from_secs(timeout_s as u64 + 30).max(self.timeout));
        }
        self.runtime()
            .checkpoint_container(req)
            .await
            .with_context(|| format!("CRI CheckpointContainer {id} -> {}", location.display()))?;
        Ok(())
    }

    /// Polls ContainerStatus until the state is `want` or `timeout` passes.
    pub async fn wait_container_state(
        &self,
        id: &str,
        want: cri::ContainerState,
        timeout: Duration,
    ) -> Result<cri::ContainerStatus> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let st = self
                .container_status(id)
                .await?
                .status
                .with_context(|| format!("CRI ContainerStatus {id}: no status"))?;
            if st.state == want as i32 {
                return Ok(st);
            }
            if tokio::time::Instant::now() >= deadline {
                anyhow::bail!(
                    "container {id} is in state {:?}, not {want:?}, after {timeout:?} (reason {:?}, message {:?})",
                    cri::ContainerState::try_from(st.state),
                    st.reason,
                    st.message
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
