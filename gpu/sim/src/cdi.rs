//! The CDI spec that injects simulated GPUs into containers, as nvidia-container-toolkit's specs
//! inject real ones: the two libraries and the daemon's socket for every device, and one file per
//! GPU (under /run/gpu-ckpt-simgpu/devices) that selects it.

use std::path::Path;

use serde_json::{json, Value};

use crate::node::{format_uuid, NodeDesc};
use crate::proto::{CONTAINER_DEVICES_DIR, CONTAINER_SOCKET, ENV_SOCKET, SOCKET_NAME};

/// CDI kind of the simulated GPUs (`sim.gpu-ckpt.io/gpu=0`, `=all`).
pub const KIND: &str = "sim.gpu-ckpt.io/gpu";
/// File name of the spec in the CDI directory.
pub const SPEC_FILE: &str = "sim.gpu-ckpt.io-gpu.json";
/// Where the libraries appear in a container (Debian's multiarch directory, as the NVIDIA
/// toolkit mounts them).
pub const CONTAINER_LIB_DIR: &str = "/usr/lib/x86_64-linux-gnu";

fn bind(host: &Path, container: &str) -> Value {
    json!({
        "hostPath": host.to_string_lossy(),
        "containerPath": container,
        "options": ["ro", "nosuid", "nodev", "bind"],
    })
}

/// The spec for the node whose daemon lives in `dir`.
pub fn spec(dir: &Path, node: &NodeDesc) -> Value {
    let device_mount = |g: &crate::node::GpuDesc| {
        let name = format_uuid(&g.uuid);
        bind(
            &dir.join("devices").join(&name),
            &format!("{CONTAINER_DEVICES_DIR}/{name}"),
        )
    };
    let mut devices: Vec<Value> = node
        .gpus
        .iter()
        .map(|g| {
            json!({
                "name": g.index.to_string(),
                "containerEdits": { "mounts": [device_mount(g)] },
            })
        })
        .collect();
    devices.push(json!({
        "name": "all",
        "containerEdits": { "mounts": node.gpus.iter().map(device_mount).collect::<Vec<_>>() },
    }));
    let lib = dir.join("lib");
    let mut socket = bind(&dir.join(SOCKET_NAME), CONTAINER_SOCKET);
    // The socket must be writable to connect to it.
    socket["options"] = json!(["nosuid", "nodev", "bind"]);
    json!({
        "cdiVersion": "0.6.0",
        "kind": KIND,
        "devices": devices,
        "containerEdits": {
            "env": [format!("{ENV_SOCKET}={CONTAINER_SOCKET}")],
            "mounts": [
                bind(&lib.join("libcuda.so.1"), &format!("{CONTAINER_LIB_DIR}/libcuda.so.1")),
                bind(&lib.join("libnvidia-ml.so.1"), &format!("{CONTAINER_LIB_DIR}/libnvidia-ml.so.1")),
                socket,
            ],
        },
    })
}
