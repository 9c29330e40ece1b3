//! The CDI spec that injects simulated GPUs into containers the way nvidia-container-toolkit's
//! spec injects real ones: one device node `/dev/nvidia<minor>` per GPU, the common nodes
//! (`nvidiactl`, `nvidia-uvm`, `nvidia-uvm-tools`), the two libraries, and the daemon's socket.
//!
//! The nodes' host paths are the ones the daemon makes in its directory (`dev/`). A real node's
//! are NVIDIA's character devices (195:N per GPU, 195:255 for `nvidiactl`, the `nvidia-uvm`
//! major for the other two); the simulator's are the character device of `/dev/zero` (1:5),
//! which opens on a host without NVIDIA's kernel module and which runc's default device rules
//! already allow. The library tells the GPUs apart by the node's name, as the driver tells
//! them apart by its minor number.

use std::path::Path;

use serde_json::{json, Value};

use crate::node::NodeDesc;
use crate::proto::{COMMON_NODES, CONTAINER_SOCKET, DEV_DIR_NAME, ENV_SOCKET, SOCKET_NAME};

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

/// A device node `/dev/<name>`, backed by the daemon's node of that name.
fn node(dev: &Path, name: &str) -> Value {
    json!({
        "path": format!("/dev/{name}"),
        "hostPath": dev.join(name).to_string_lossy(),
    })
}

/// The spec for the node whose daemon lives in `dir`.
pub fn spec(dir: &Path, node_desc: &NodeDesc) -> Value {
    let dev = dir.join(DEV_DIR_NAME);
    let gpu_node = |g: &crate::node::GpuDesc| node(&dev, &format!("nvidia{}", g.index));
    let mut devices: Vec<Value> = node_desc
        .gpus
        .iter()
        .map(|g| {
            json!({
                "name": g.index.to_string(),
                "containerEdits": { "deviceNodes": [gpu_node(g)] },
            })
        })
        .collect();
    devices.extend(mig_devices(&dev, node_desc));
    devices.push(json!({
        "name": "all",
        "containerEdits": {
            "deviceNodes": node_desc.gpus.iter().map(gpu_node).collect::<Vec<_>>(),
        },
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
            "deviceNodes": COMMON_NODES.iter().map(|n| node(&dev, n)).collect::<Vec<_>>(),
            "mounts": [
                bind(&lib.join("libcuda.so.1"), &format!("{CONTAINER_LIB_DIR}/libcuda.so.1")),
                bind(&lib.join("libnvidia-ml.so.1"), &format!("{CONTAINER_LIB_DIR}/libnvidia-ml.so.1")),
                socket,
            ],
        },
    })
}

/// Where a MIG instance's capability nodes are, under `dev/` in the node directory and in a
/// container.
pub const MIG_CAPS_DIR: &str = "nvidia-caps";

/// The capability minors of GPU `index`'s GPU instance 0 and of its compute instance 0, as the
/// driver numbers them in `/proc/driver/nvidia-caps/mig-minors` (`config` 1, `monitor` 2, then
/// per GPU 15 GPU instances of 9 minors each: the instance's `access`, then one per compute
/// instance).
pub fn mig_cap_minors(index: u32) -> [u32; 2] {
    let gi = 3 + 135 * index;
    [gi, gi + 1]
}

/// One MIG device per GPU in MIG mode, as nvidia-container-toolkit's spec presents a MIG
/// instance (named `<gpu index>:<mig index>`): the parent GPU's node and the instance's two
/// capability nodes. The simulator has one instance per MIG-mode GPU.
pub fn mig_devices(dev: &Path, node_desc: &NodeDesc) -> Vec<Value> {
    node_desc
        .gpus
        .iter()
        .filter(|g| g.mig)
        .map(|g| {
            let mut nodes = vec![node(dev, &format!("nvidia{}", g.index))];
            nodes.extend(
                mig_cap_minors(g.index)
                    .map(|m| node(dev, &format!("{MIG_CAPS_DIR}/nvidia-cap{m}"))),
            );
            json!({
                "name": format!("{}:0", g.index),
                "containerEdits": { "deviceNodes": nodes },
            })
        })
        .collect()
}
