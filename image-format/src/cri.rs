//! The annotations containerd's CRI puts on a container's spec (`io.kubernetes.cri.*`), which
//! a CRI checkpoint's `config.dump` keeps and the shim reads from a bundle.

/// `sandbox` for a pod's sandbox container, `container` for one of its containers.
pub const CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";
/// The container's name in its pod.
pub const CONTAINER_NAME: &str = "io.kubernetes.cri.container-name";
/// The image the container runs, as the pod names it.
pub const IMAGE_NAME: &str = "io.kubernetes.cri.image-name";
/// The id of the container's pod sandbox, which owns its image volumes and groups the
/// pod's containers into one shim.
pub const SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";
/// The namespace of the container's pod.
pub const SANDBOX_NAMESPACE: &str = "io.kubernetes.cri.sandbox-namespace";
/// The name of the container's pod.
pub const SANDBOX_NAME: &str = "io.kubernetes.cri.sandbox-name";
/// The uid of the container's pod.
pub const SANDBOX_UID: &str = "io.kubernetes.cri.sandbox-uid";
