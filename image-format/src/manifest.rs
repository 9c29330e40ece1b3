//! The gpu-ckpt manifest: a versioned JSON document, `gpu-ckpt-manifest.json`, that the shim writes next
//! to the CRIU images (so it ends up as `checkpoint/gpu-ckpt-manifest.json` in the kubelet archive).
//!
//! It records who was checkpointed, on what node, with which GPUs and versions, and the size and
//! digests of every file in the checkpoint directory (except itself): BLAKE3 for CRIU's page
//! images, sha256 and BLAKE3 for the rest. The schema is documented
//! field by field in docs/image-format.md.

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use serde::{Deserialize, Serialize};

// The file digests and the page-image rule live with the hashing; they stay reachable here,
// where the manifest's users have always found them.
use crate::digest::{
    digest_file, digest_open_cancellable, no_progress, FileHasher, PageDigests, Progress, COPY_BUF,
};
pub use crate::digest::{is_page_image, FileDigest};
use crate::durable::{Durability, RealFs, SyncFs, Writeback};
use crate::error::{Error, Findings, Result};

/// File name of the manifest inside the checkpoint directory.
pub const MANIFEST_FILE: &str = "gpu-ckpt-manifest.json";
/// The shim's own copy of the container's rootfs changes (a tar with OCI whiteouts), kept in the
/// checkpoint directory so that the manifest, and so the signature, covers it.
pub const ROOTFS_CHANGES_FILE: &str = "gpu-ckpt-rootfs-changes.tar";
/// The value of the `kind` field.
pub const MANIFEST_KIND: &str = "gpu-ckpt.io/CheckpointManifest";
/// The value of the `$schema` field for schema major version 2.
pub const MANIFEST_SCHEMA_ID: &str = "https://gpu-ckpt.io/schemas/checkpoint-manifest/v2.json";
/// The schema major version this build writes (and the newest it reads).
pub const SCHEMA_VERSION: u32 = 2;
/// The oldest schema major version this build reads. Version 1 lists a sha256 for every file;
/// version 2 lets an entry carry BLAKE3 alone (CRIU's page images).
pub const OLDEST_SCHEMA_VERSION: u32 = 1;
/// Largest manifest we agree to parse (it is metadata; megabytes would be an attack).
pub const MAX_MANIFEST_BYTES: u64 = 16 << 20;

/// The pod annotation that declares the engine version (e.g. "vllm 0.11.0").
pub const ANNOTATION_ENGINE_VERSION: &str = "gpu-ckpt.io/engine-version";
/// The pod annotation that declares the model version (e.g. "Qwen3-8B@abc123").
pub const ANNOTATION_MODEL_VERSION: &str = "gpu-ckpt.io/model-version";

/// The whole manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Schema id (URL-like), fixed per major version.
    #[serde(rename = "$schema")]
    pub schema: String,
    /// Always [`MANIFEST_KIND`].
    pub kind: String,
    /// Schema major version; readers refuse majors they do not know.
    pub schema_version: u32,
    /// When the checkpoint was taken, RFC 3339 UTC.
    pub created: String,
    pub container: Container,
    pub node: Node,
    pub devices: Devices,
    pub workload: Workload,
    /// How CRIU dumped the process tree; restore passes the matching options.
    #[serde(default)]
    pub criu: CriuOptions,
    /// Device state blobs (files in the checkpoint directory that hold GPU state).
    #[serde(default)]
    pub device_state: Vec<DeviceState>,
    /// Every file of the checkpoint directory except the manifest: name -> size and digests.
    #[serde(default)]
    pub files: BTreeMap<String, FileDigest>,
    /// Step timings in milliseconds, in the order the steps ran.
    #[serde(default)]
    pub timings: Vec<StepTiming>,
    /// The security context the checkpointed container ran under (what a restore holds the
    /// new spec to). Absent in older manifests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub security: Option<SecurityRecord>,
    /// The NCCL communicators of the container's processes, for the rebuild after a restore.
    /// Absent for a container without the NCCL layer (and in older manifests).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nccl: Option<NcclRecord>,
    /// The node key's Ed25519 signature over the rest of the manifest ([`crate::sign`]).
    /// Absent in unsigned manifests (older ones, other tools').
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<crate::sign::Signature>,
}

/// The checkpointed container.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Container {
    /// containerd container id.
    pub id: String,
    /// Container name (the Kubernetes container name when run through CRI).
    #[serde(default)]
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pod_name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pod_namespace: String,
    /// The pod's uid (Kubernetes `metadata.uid`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pod_uid: String,
    /// Base image reference as the container was created from it.
    #[serde(default)]
    pub image: String,
    /// Base image digest, `sha256:<hex>` (manifest digest, as in `repo@sha256:...`).
    #[serde(default)]
    pub image_digest: String,
    /// The container's `gpu-ckpt.io/` (but `restore-from`) and `cdi.k8s.io/` annotations:
    /// a container that containerd restores from its own checkpoint gets its annotations from
    /// the archive's unsigned `status.dump`, and is held to these.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// The addresses of the container's network namespace at the checkpoint, loopback and
    /// link-local left out (the pod's IPs): established TCP connections restore only where
    /// they all are. Absent in older manifests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addresses: Option<Vec<String>>,
}

/// The node the checkpoint was taken on.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Node {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub hostname: String,
    /// `uname -r`.
    pub kernel: String,
    /// CRIU version, e.g. "4.1.1".
    pub criu: String,
    /// runc version, e.g. "1.3.6".
    pub runc: String,
    /// gpu-ckpt shim version.
    pub shim: String,
}

/// The GPUs and their driver.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Devices {
    /// NVIDIA driver version, e.g. "580.65.06". Empty when the container held no GPU.
    #[serde(default)]
    pub driver_version: String,
    /// CUDA driver API version, e.g. "13.0" (from cuDriverGetVersion).
    #[serde(default)]
    pub cuda_driver_version: String,
    /// The container's GPUs, in the order the container saw them.
    #[serde(default)]
    pub gpus: Vec<Gpu>,
    /// Every process of the container that held device state at the checkpoint, with the
    /// device memory the driver staged into its host memory (inside CRIU's page images).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processes: Vec<DeviceProcess>,
    /// Every GPU of the node the checkpoint was taken on, in NVML's order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub node_gpus: Vec<Gpu>,
    /// The driver's user-space files the processes of [`Devices::processes`] mapped (CRIU
    /// restores those mappings by path, so a restore needs the same files). Absent in older
    /// manifests, which are held to the driver branch only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub driver_files: Vec<DriverFile>,
    /// Where the processes' device memory went: [`STORAGE_CUSTOM`] (the driver's custom
    /// storage, into the device-memory files [`Manifest::device_state`] lists) or
    /// [`STORAGE_STAGED`] (staged in each process's host memory, inside CRIU's page images).
    /// Empty where no process held device state, and in older manifests (staged).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub storage: String,
}

/// [`Devices::storage`] of a checkpoint whose device memory went into device-memory files.
pub const STORAGE_CUSTOM: &str = "custom";
/// [`Devices::storage`] of a checkpoint whose device memory was staged in host memory.
pub const STORAGE_STAGED: &str = "staged";

/// One of the driver's user-space files (`libcuda.so.580.65.06`, ...) as a checkpointed process
/// mapped it (see the `driver_files` module).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverFile {
    /// Its path in the container, as `/proc/<pid>/maps` showed it.
    pub path: String,
    /// Its size in bytes.
    pub size: u64,
    /// Its GNU build id, lower-case hex; empty for a file without one.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub build_id: String,
}

impl Devices {
    /// Device bytes the checkpoint's processes held on each of [`Devices::gpus`], in order.
    pub fn bytes_per_gpu(&self) -> Vec<u64> {
        self.gpus
            .iter()
            .map(|g| {
                self.processes
                    .iter()
                    .flat_map(|p| &p.gpus)
                    .filter(|pg| pg.uuid == g.uuid)
                    .map(|pg| pg.bytes)
                    .sum()
            })
            .collect()
    }

    /// Whether the device memory is in device-memory files (custom storage), not in CRIU's
    /// page images.
    pub fn custom_storage(&self) -> bool {
        self.storage == STORAGE_CUSTOM
    }

    /// All device bytes the checkpoint's processes held.
    pub fn device_bytes(&self) -> u64 {
        self.processes
            .iter()
            .flat_map(|p| &p.gpus)
            .map(|g| g.bytes)
            .sum()
    }
}

/// A process that held device state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceProcess {
    /// Its pid inside the container's pid namespace (what CRIU restores).
    pub pid: u32,
    /// The GPUs it had a context on, and the device memory it held on each.
    pub gpus: Vec<ProcessGpu>,
}

/// Device memory one process held on one GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessGpu {
    pub uuid: String,
    pub bytes: u64,
}

/// One GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    /// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".
    pub uuid: String,
    /// Model name as NVML reports it, e.g. "NVIDIA H100 80GB HBM3".
    pub model: String,
    /// Architecture, e.g. "hopper".
    #[serde(default)]
    pub architecture: String,
    /// Total device memory in bytes.
    #[serde(default)]
    pub memory_bytes: u64,
    /// PCI bus id, e.g. "00000000:3B:00.0".
    #[serde(default)]
    pub pci_address: String,
    /// Device memory free on a restoring node (only in a node's profile, never in a manifest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free_bytes: Option<u64>,
}

/// The security context of the checkpointed container, from its OCI spec.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecurityRecord {
    /// `sha256:<hex>` of the spec's `linux.seccomp` in canonical JSON (keys sorted, no
    /// whitespace); empty when the container ran without a seccomp profile.
    #[serde(default)]
    pub seccomp_profile: String,
}

impl SecurityRecord {
    /// The record of an OCI spec (config.json as JSON).
    pub fn from_spec(spec: &serde_json::Value) -> SecurityRecord {
        SecurityRecord {
            seccomp_profile: seccomp_profile_digest(spec),
        }
    }
}

/// `sha256:<hex>` of an OCI spec's `linux.seccomp` in canonical JSON (object keys sorted, no
/// whitespace), or an empty string when the spec has no seccomp profile.
pub fn seccomp_profile_digest(spec: &serde_json::Value) -> String {
    match spec.pointer("/linux/seccomp") {
        None | Some(serde_json::Value::Null) => String::new(),
        Some(profile) => {
            let mut text = String::new();
            canonical_json(profile, &mut text);
            format!(
                "sha256:{}",
                hex::encode(<sha2::Sha256 as sha2::Digest>::digest(text.as_bytes()))
            )
        }
    }
}

fn canonical_json(v: &serde_json::Value, out: &mut String) {
    match v {
        serde_json::Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&serde_json::Value::String(k.clone()).to_string());
                out.push(':');
                canonical_json(&map[k], out);
            }
            out.push('}');
        }
        serde_json::Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical_json(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// The versions that the pod declares through annotations.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    /// `gpu-ckpt.io/engine-version`; empty when not declared.
    #[serde(default)]
    pub engine_version: String,
    /// `gpu-ckpt.io/model-version`; empty when not declared.
    #[serde(default)]
    pub model_version: String,
}

/// The CRIU options a checkpoint was dumped with.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CriuOptions {
    /// The container kept running after the dump.
    #[serde(default)]
    pub leave_running: bool,
    /// Established TCP connections: "" (none allowed), "established" (dumped, restored on the
    /// same address) or "close" (not dumped, restored closed).
    #[serde(default)]
    pub tcp: String,
    #[serde(default)]
    pub external_unix_sockets: bool,
    /// The init process had a terminal.
    #[serde(default)]
    pub shell_job: bool,
    #[serde(default)]
    pub file_locks: bool,
    /// CRIU's cgroups mode (soft, full, strict, ignore); empty for runc's default.
    #[serde(default)]
    pub cgroups_mode: String,
    #[serde(default)]
    pub empty_namespaces: Vec<String>,
}

/// A device state blob: with custom storage, one process's device memory on one GPU (a
/// device-memory file, written by the shim from the driver's mapped range).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceState {
    /// File name in the checkpoint directory.
    pub name: String,
    /// The GPU the state came from, if it is per GPU.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub gpu_uuid: String,
    /// The process it belongs to (pid inside the container), if per process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    pub size: u64,
    /// sha256, lower-case hex; empty for a device-memory file (BLAKE3 only, as it was hashed
    /// while written).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sha256: String,
    /// BLAKE3, lower-case hex, the digest the file is verified with where present.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub blake3: String,
}

/// The NCCL layer's state at the checkpoint: what the restore waits for and rebuilds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NcclRecord {
    /// BLAKE3 (hex) of the layer library the processes mapped; a restore refuses another.
    pub layer_blake3: String,
    /// Every process that held a control session, in the order they connected.
    #[serde(default)]
    pub processes: Vec<NcclProcess>,
    /// The pod-wide cut this checkpoint belongs to, where its communicators span containers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut: Option<NcclCut>,
}

/// One process of the container with NCCL communicators.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NcclProcess {
    /// Its pid in the container (CRIU restores it under the same one).
    pub pid: i32,
    /// The session token the layer presents again (`Hello.resumed`) after the restore.
    pub token: String,
    /// `ncclGetVersion` of the NCCL it ran on.
    pub nccl_version: i32,
    /// Every communicator was suspended (rather than destroyed) at the release.
    pub suspended: bool,
    #[serde(default)]
    pub comms: Vec<NcclComm>,
}

/// One communicator a process held.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NcclComm {
    /// The layer's id of the communicator in that process.
    pub id: u64,
    /// BLAKE3 (hex) of the unique id it was made from, or `<parent key>/<color>` for a split.
    pub key: String,
    pub rank: i32,
    pub nranks: i32,
    pub cuda_dev: i32,
    /// `(parent id, color, key)` of the split that made it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<(u64, i32, i32)>,
}

/// A checkpoint taken as one cut across several containers of a pod.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NcclCut {
    pub id: String,
    /// The names of the containers of the cut.
    pub containers: Vec<String>,
}

/// How long one step took.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTiming {
    /// e.g. "device-lock", "device-checkpoint", "criu-dump", "device-restore", "manifest".
    pub step: String,
    pub millis: f64,
}

impl Manifest {
    /// A new manifest with the schema fields filled in and no files yet.
    pub fn new(
        created: impl Into<String>,
        container: Container,
        node: Node,
        devices: Devices,
        workload: Workload,
    ) -> Self {
        Manifest {
            schema: MANIFEST_SCHEMA_ID.to_string(),
            kind: MANIFEST_KIND.to_string(),
            schema_version: SCHEMA_VERSION,
            created: created.into(),
            container,
            node,
            devices,
            workload,
            criu: CriuOptions::default(),
            device_state: Vec::new(),
            files: BTreeMap::new(),
            timings: Vec::new(),
            security: None,
            nccl: None,
            signature: None,
        }
    }

    /// Hash `dir/name` and record it in `files`. The name must be a flat file name.
    pub fn add_file(&mut self, dir: &Path, name: &str) -> Result<&FileDigest> {
        check_flat_name(name)?;
        if name == MANIFEST_FILE {
            return Err(Error::BadFileName {
                name: name.to_string(),
                reason: "the manifest does not list itself",
            });
        }
        let path = dir.join(name);
        let meta = fs::symlink_metadata(&path).map_err(|e| Error::io("reading", &path, e))?;
        if !meta.file_type().is_file() {
            return Err(Error::NotFlat {
                name: name.to_string(),
                reason: "not a regular file",
            });
        }
        let d = digest_file(
            &path,
            FileHasher::recording(name, PageDigests::default()),
            &mut no_progress,
        )?;
        self.files.insert(name.to_string(), d);
        Ok(&self.files[name])
    }

    /// Record a device state blob (hashing it) and list it in `files` too.
    pub fn add_device_state(
        &mut self,
        dir: &Path,
        name: &str,
        gpu_uuid: &str,
        pid: Option<u32>,
    ) -> Result<()> {
        if is_page_image(name) {
            return Err(Error::BadFileName {
                name: name.to_string(),
                reason: "the name of a CRIU page image",
            });
        }
        let d = self.add_file(dir, name)?.clone();
        self.device_state.push(DeviceState {
            name: name.to_string(),
            gpu_uuid: gpu_uuid.to_string(),
            pid,
            size: d.size,
            sha256: d.sha256,
            // Listed by sha256, as such blobs always were (`files` has both digests).
            blake3: String::new(),
        });
        Ok(())
    }

    /// Record a device-memory file (custom storage) whose size and BLAKE3 were taken while it
    /// was written, without reading it again: listed in `device_state` and in `files`.
    pub fn add_device_memory(
        &mut self,
        name: &str,
        gpu_uuid: &str,
        pid: u32,
        size: u64,
        blake3: &str,
    ) -> Result<()> {
        check_flat_name(name)?;
        if is_page_image(name) || is_manifest_or_temp(name) {
            return Err(Error::BadFileName {
                name: name.to_string(),
                reason: "the name of a CRIU page image or of the manifest",
            });
        }
        self.files.insert(
            name.to_string(),
            FileDigest {
                size,
                sha256: String::new(),
                blake3: blake3.to_string(),
            },
        );
        self.device_state.push(DeviceState {
            name: name.to_string(),
            gpu_uuid: gpu_uuid.to_string(),
            pid: Some(pid),
            size,
            sha256: String::new(),
            blake3: blake3.to_string(),
        });
        Ok(())
    }

    /// The device-memory files of the process that was pid `pid` in the container.
    pub fn device_memory_of(&self, pid: u32) -> impl Iterator<Item = &DeviceState> {
        self.device_state
            .iter()
            .filter(move |d| d.pid == Some(pid) && !d.blake3.is_empty())
    }

    /// Record a step timing.
    pub fn add_timing(&mut self, step: impl Into<String>, millis: f64) {
        self.timings.push(StepTiming {
            step: step.into(),
            millis,
        });
    }

    /// Replace `files` with the size and digests of every regular file in `dir` except the manifest.
    pub fn hash_dir(&mut self, dir: &Path) -> Result<()> {
        self.files = hash_dir_flat(dir)?;
        Ok(())
    }

    /// Serialize to pretty JSON (with a trailing newline).
    pub fn to_json(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec_pretty(self).unwrap_or_default();
        v.push(b'\n');
        v
    }

    /// Parse a manifest, checking `kind` and the schema major version before the fields, so that a
    /// manifest from a newer major version gets a version error rather than a field error.
    pub fn from_json(data: &[u8], what: &str) -> Result<Manifest> {
        if data.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(Error::InvalidField {
                what: what.to_string(),
                field: "(document)".into(),
                reason: format!("larger than {MAX_MANIFEST_BYTES} bytes"),
            });
        }
        let v: serde_json::Value =
            serde_json::from_slice(data).map_err(|e| Error::json(what, e))?;
        let obj = v.as_object().ok_or_else(|| Error::InvalidField {
            what: what.to_string(),
            field: "(document)".into(),
            reason: "not a json object".into(),
        })?;
        let kind = obj.get("kind").and_then(|k| k.as_str()).unwrap_or("");
        if kind != MANIFEST_KIND {
            return Err(Error::WrongKind {
                path: what.to_string(),
                found: kind.to_string(),
                expected: MANIFEST_KIND,
            });
        }
        match obj.get("schema_version") {
            Some(serde_json::Value::Number(n))
                if n.as_u64().is_some_and(|n| {
                    (OLDEST_SCHEMA_VERSION as u64..=SCHEMA_VERSION as u64).contains(&n)
                }) => {}
            Some(other) => {
                return Err(Error::UnsupportedSchema {
                    path: what.to_string(),
                    found: other.to_string(),
                    oldest: OLDEST_SCHEMA_VERSION,
                    newest: SCHEMA_VERSION,
                })
            }
            None => {
                return Err(Error::InvalidField {
                    what: what.to_string(),
                    field: "schema_version".into(),
                    reason: "missing".into(),
                })
            }
        }
        let m: Manifest = serde_json::from_value(v).map_err(|e| Error::json(what, e))?;
        for name in m.files.keys() {
            check_flat_name(name)?;
            if name == MANIFEST_FILE {
                return Err(Error::BadFileName {
                    name: name.clone(),
                    reason: "the manifest does not list itself",
                });
            }
        }
        for (name, d) in &m.files {
            // Version 1 lists a sha256 for every file; version 2 at least one digest.
            let required = if m.schema_version == 1 || d.blake3.is_empty() {
                "sha256"
            } else {
                "blake3"
            };
            for (field, hex) in [("sha256", &d.sha256), ("blake3", &d.blake3)] {
                if hex.is_empty() && field != required {
                    continue;
                }
                if !is_sha256_hex(hex) {
                    return Err(Error::InvalidField {
                        what: what.to_string(),
                        field: format!("files.{name}.{field}"),
                        reason: if hex.is_empty() {
                            "missing".into()
                        } else {
                            "not 64 lower-case hex digits".into()
                        },
                    });
                }
            }
        }
        if ![String::new(), STORAGE_CUSTOM.into(), STORAGE_STAGED.into()]
            .contains(&m.devices.storage)
        {
            return Err(Error::InvalidField {
                what: what.to_string(),
                field: "devices.storage".into(),
                reason: format!(
                    "{:?}: expected \"{STORAGE_CUSTOM}\" or \"{STORAGE_STAGED}\"",
                    m.devices.storage
                ),
            });
        }
        for (i, d) in m.device_state.iter().enumerate() {
            check_flat_name(&d.name)?;
            // At least one digest; every one given well formed.
            let required = if d.blake3.is_empty() {
                "sha256"
            } else {
                "blake3"
            };
            for (field, hex) in [("sha256", &d.sha256), ("blake3", &d.blake3)] {
                if (hex.is_empty() && field != required) || is_sha256_hex(hex) {
                    continue;
                }
                return Err(Error::InvalidField {
                    what: what.to_string(),
                    field: format!("device_state[{i}].{field}"),
                    reason: "not 64 lower-case hex digits".into(),
                });
            }
            // A device-memory file is one of the checkpoint's files, so that the listing, the
            // digests and the signature cover it like every other.
            if !d.blake3.is_empty() && m.files.get(&d.name).map(|f| &f.blake3) != Some(&d.blake3) {
                return Err(Error::InvalidField {
                    what: what.to_string(),
                    field: format!("device_state[{i}].blake3"),
                    reason: format!("{} is not listed in files with this digest", d.name),
                });
            }
        }
        Ok(m)
    }

    /// Write `dir/gpu-ckpt-manifest.json` durably, mode 0600: every file the manifest lists is
    /// synced, then the manifest goes to a temp file that is synced and renamed into place, then
    /// the directory is synced ([`crate::durable`]). A checkpoint the manifest calls complete
    /// survives a power cut.
    pub fn write_to(&self, dir: &Path) -> Result<()> {
        self.write_durable(dir, Durability::Sync)
    }

    /// [`Manifest::write_to`], syncing only with [`Durability::Sync`] (the rename stays atomic
    /// either way).
    pub fn write_durable(&self, dir: &Path, durability: Durability) -> Result<()> {
        self.write_with(&RealFs, dir, durability)
    }

    /// [`Manifest::write_durable`] through a given file system (tests record the order).
    pub fn write_with(&self, fs: &dyn SyncFs, dir: &Path, durability: Durability) -> Result<()> {
        crate::durable::write_index(
            fs,
            dir,
            self.files.keys().map(String::as_str),
            MANIFEST_FILE,
            &self.to_json(),
            durability,
        )
    }

    /// Read and parse `dir/gpu-ckpt-manifest.json`.
    pub fn read_from(dir: &Path) -> Result<Manifest> {
        let path = dir.join(MANIFEST_FILE);
        let meta = fs::symlink_metadata(&path).map_err(|e| Error::io("reading", &path, e))?;
        if !meta.file_type().is_file() {
            return Err(Error::NotFlat {
                name: MANIFEST_FILE.into(),
                reason: "not a regular file",
            });
        }
        if meta.len() > MAX_MANIFEST_BYTES {
            return Err(Error::InvalidField {
                what: path.display().to_string(),
                field: "(document)".into(),
                reason: format!("larger than {MAX_MANIFEST_BYTES} bytes"),
            });
        }
        let data = fs::read(&path).map_err(|e| Error::io("reading", &path, e))?;
        Manifest::from_json(&data, &path.display().to_string())
    }

    /// Total bytes of device state.
    pub fn device_state_bytes(&self) -> u64 {
        self.device_state.iter().map(|d| d.size).sum()
    }
}

/// Is `s` 64 lower-case hex digits (a 256-bit digest: sha256, or BLAKE3 in a manifest)?
pub fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A flat file name: not empty, no '/', not "." or "..", no NUL.
pub fn check_flat_name(name: &str) -> Result<()> {
    let reason = if name.is_empty() {
        "empty"
    } else if name.contains('/') {
        "contains '/'"
    } else if name == "." || name == ".." {
        "is a relative directory"
    } else if name.contains('\0') {
        "contains NUL"
    } else {
        return Ok(());
    };
    Err(Error::BadFileName {
        name: name.to_string(),
        reason,
    })
}

/// Size and digests of every regular file in `dir` (flat: a subdirectory, symlink or other special file is
/// an error naming it; so is a file with more than one link), except the manifest and its temp files.
pub fn hash_dir_flat(dir: &Path) -> Result<BTreeMap<String, FileDigest>> {
    hash_dir_flat_progress(dir, &mut no_progress)
}

/// [`hash_dir_flat`] with a progress hook (bytes hashed, total bytes).
pub fn hash_dir_flat_progress(
    dir: &Path,
    progress: Progress<'_>,
) -> Result<BTreeMap<String, FileDigest>> {
    hash_dir_flat_with(dir, BTreeMap::new(), PageDigests::default(), progress)
}

/// The entries of a flat checkpoint directory, each with its name, which must be UTF-8.
pub(crate) fn flat_entries(dir: &Path) -> Result<Vec<(String, fs::DirEntry)>> {
    let mut out = Vec::new();
    for ent in fs::read_dir(dir).map_err(|e| Error::io("listing", dir, e))? {
        let ent = ent.map_err(|e| Error::io("listing", dir, e))?;
        let name = ent.file_name().into_string().map_err(|n| Error::NotFlat {
            name: n.to_string_lossy().into_owned(),
            reason: "name is not utf-8",
        })?;
        out.push((name, ent));
    }
    Ok(out)
}

/// [`hash_dir_flat`], taking the digests in `known` (from an [`AppendHasher`] that followed the
/// files as they were written) for files whose size still matches, and hashing the rest, page
/// images with the digests `pages` says.
pub fn hash_dir_flat_with(
    dir: &Path,
    mut known: BTreeMap<String, FileDigest>,
    pages: PageDigests,
    progress: Progress<'_>,
) -> Result<BTreeMap<String, FileDigest>> {
    let mut names = Vec::new();
    let mut total = 0u64;
    for (name, ent) in flat_entries(dir)? {
        if is_manifest_or_temp(&name) {
            continue;
        }
        let meta = ent
            .metadata()
            .map_err(|e| Error::io("reading", ent.path(), e))?;
        let ft = meta.file_type();
        if ft.is_dir() {
            return Err(Error::NotFlat {
                name,
                reason: "subdirectories are not allowed",
            });
        }
        if !ft.is_file() {
            return Err(Error::NotFlat {
                name,
                reason: "only regular files are allowed",
            });
        }
        if meta.nlink() > 1 {
            return Err(Error::NotFlat {
                name,
                reason: "hard links are not allowed",
            });
        }
        if known.get(&name).is_some_and(|d| d.size != meta.len()) {
            known.remove(&name);
        }
        if !known.contains_key(&name) {
            total += meta.len();
        }
        names.push(name);
    }
    names.sort();
    let mut out = BTreeMap::new();
    let mut base = 0u64;
    for name in names {
        if let Some(d) = known.remove(&name) {
            out.insert(name, d);
            continue;
        }
        let path = dir.join(&name);
        let d = digest_file(&path, FileHasher::recording(&name, pages), &mut |d, _| {
            progress(base + d, total)
        })?;
        base += d.size;
        out.insert(name, d);
    }
    Ok(out)
}

/// Hashes files of a directory while another process is still appending to them (CRIU writing
/// its page images during a dump), so that little is left to hash once the writer is done.
///
/// Only files that `select` picks and that were not in the directory before (`skip`) are
/// followed. A file is only ever read up to its current end, which is safe against a
/// concurrent append. [`AppendHasher::finish`] returns a digest only for a file still of the
/// size that was hashed and still at the same inode; anything else (a file truncated,
/// rewritten or replaced) is left out, for [`hash_dir_flat_with`] to hash in full.
///
/// With [`AppendHasher::writing_back`], what it has hashed is also handed to the disk as it
/// goes ([`crate::durable::Writeback`]), so that the syncs before the manifest find little left.
pub struct AppendHasher {
    dir: PathBuf,
    select: fn(&str) -> bool,
    skip: HashSet<String>,
    pages: PageDigests,
    files: BTreeMap<String, Followed>,
    buf: Vec<u8>,
    /// Where the writeback of hashed bytes starts; `None`: no writeback.
    writeback: Option<Arc<dyn SyncFs + Send>>,
}

struct Followed {
    file: fs::File,
    hasher: FileHasher,
    written_back: Writeback,
}

impl AppendHasher {
    /// Follows the files of `dir` that `select` picks, except those in `skip`; page images are
    /// hashed with the digests `pages` says.
    pub fn new(
        dir: &Path,
        select: fn(&str) -> bool,
        skip: HashSet<String>,
        pages: PageDigests,
    ) -> Self {
        AppendHasher {
            dir: dir.to_path_buf(),
            select,
            skip,
            pages,
            files: BTreeMap::new(),
            buf: vec![0u8; COPY_BUF],
            writeback: None,
        }
    }

    /// Starts the writeback of what is hashed when the files will be synced (`durability`):
    /// what a follower reads is what the writer has written, and will not change.
    pub fn writing_back(self, durability: Durability) -> Self {
        if durability.syncs() {
            self.writing_back_through(Arc::new(RealFs))
        } else {
            self
        }
    }

    /// [`AppendHasher::writing_back`] through a given file system (tests record the calls).
    pub fn writing_back_through(mut self, fs: Arc<dyn SyncFs + Send>) -> Self {
        self.writeback = Some(fs);
        self
    }

    /// Picks up new files and hashes what was appended since the last call; returns the number
    /// of bytes hashed (0: nothing new yet).
    pub fn poll(&mut self) -> Result<u64> {
        let entries = match fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(Error::io("listing", &self.dir, e)),
        };
        for ent in entries {
            let ent = ent.map_err(|e| Error::io("listing", &self.dir, e))?;
            let Ok(name) = ent.file_name().into_string() else {
                continue;
            };
            if self.files.contains_key(&name) || self.skip.contains(&name) || !(self.select)(&name)
            {
                continue;
            }
            let path = self.dir.join(&name);
            let file = match fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path)
            {
                Ok(f) => f,
                // Not there any more, or not a regular file: the full hash deals with it.
                Err(_) => {
                    self.skip.insert(name);
                    continue;
                }
            };
            let hasher = FileHasher::recording(&name, self.pages);
            let written_back = Writeback::default();
            self.files.insert(
                name,
                Followed {
                    file,
                    hasher,
                    written_back,
                },
            );
        }
        let mut hashed = 0u64;
        for (name, f) in self.files.iter_mut() {
            loop {
                let n = f
                    .file
                    .read_at(&mut self.buf, f.hasher.size())
                    .map_err(|e| Error::io("reading", self.dir.join(name), e))?;
                if n == 0 {
                    break;
                }
                f.hasher.update(&self.buf[..n]);
                hashed += n as u64;
                if let Some(fs) = &self.writeback {
                    let path = self.dir.join(name);
                    let started =
                        f.written_back
                            .advance(&**fs, &f.file, &path, f.hasher.size(), false);
                    if let Err(e) = started {
                        self.writeback = writeback_failed(&path, e);
                    }
                }
            }
        }
        Ok(hashed)
    }

    /// Polls until `done` is set (waiting up to `idle` whenever nothing new was written), then
    /// [`AppendHasher::finish`]es: the whole follow, for a thread beside the writer. Setting
    /// `done` wakes the wait at once, so the follow ends as soon as the writer does.
    pub fn follow_until(
        mut self,
        done: &WriterDone,
        idle: std::time::Duration,
    ) -> Result<BTreeMap<String, FileDigest>> {
        while !done.is_set() {
            if self.poll()? == 0 {
                done.wait(idle);
            }
        }
        self.finish()
    }

    /// The writer is done: hashes the rest of every followed file and returns the digests of
    /// those still whole (same inode, same size as hashed).
    pub fn finish(mut self) -> Result<BTreeMap<String, FileDigest>> {
        self.poll()?;
        let mut out = BTreeMap::new();
        for (name, mut f) in self.files {
            if let Some(fs) = &self.writeback {
                let path = self.dir.join(&name);
                let size = f.hasher.size();
                if let Err(e) = f.written_back.advance(&**fs, &f.file, &path, size, true) {
                    self.writeback = writeback_failed(&path, e);
                }
            }
            let held = f
                .file
                .metadata()
                .map_err(|e| Error::io("reading", self.dir.join(&name), e))?;
            let now = fs::symlink_metadata(self.dir.join(&name));
            let same = now.is_ok_and(|m| m.ino() == held.ino() && m.dev() == held.dev());
            if same && held.len() == f.hasher.size() {
                out.insert(name, f.hasher.finish());
            }
        }
        Ok(out)
    }
}

/// A writeback that could not start stops for the rest of the follow (the syncs before the
/// manifest do all the work, and report a real I/O error).
fn writeback_failed(path: &Path, e: std::io::Error) -> Option<Arc<dyn SyncFs + Send>> {
    tracing::warn!(file = %path.display(), error = %e, "starting the writeback of hashed bytes; left to the syncs");
    None
}

/// The writer's side of [`AppendHasher::follow_until`]: set once the writer is done.
#[derive(Debug, Default)]
pub struct WriterDone {
    done: Mutex<bool>,
    changed: Condvar,
}

impl WriterDone {
    /// The writer is done (or gone): wakes the follower.
    pub fn set(&self) {
        *self.lock() = true;
        self.changed.notify_all();
    }

    pub fn is_set(&self) -> bool {
        *self.lock()
    }

    /// Waits until set, at most `timeout`.
    fn wait(&self, timeout: std::time::Duration) {
        let guard = self.lock();
        if !*guard {
            // A poisoned lock still holds a valid bool.
            let _ = self.changed.wait_timeout(guard, timeout);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, bool> {
        self.done.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn is_manifest_or_temp(name: &str) -> bool {
    name == MANIFEST_FILE || name.starts_with(&format!(".{MANIFEST_FILE}.tmp-"))
}

/// Verify a checkpoint directory against its manifest: every listed file present with the recorded size
/// and digest, and no unlisted file. Returns the manifest, or the first mismatch (in name order).
pub fn verify_dir(dir: &Path) -> Result<Manifest> {
    verify_dir_progress(dir, &mut no_progress)
}

/// [`verify_dir`] with a progress hook.
pub fn verify_dir_progress(dir: &Path, progress: Progress<'_>) -> Result<Manifest> {
    let (m, deferred) = verify_dir_staged(dir, &|_| false, progress)?;
    debug_assert!(deferred.files.is_empty());
    Ok(m)
}

/// What [`verify_dir_staged`] left for later: the digests of the deferred files, whose presence,
/// type and size it did check.
#[derive(Debug, Default)]
pub struct DeferredDigests {
    dir: PathBuf,
    files: Vec<(String, FileDigest)>,
}

impl DeferredDigests {
    /// Bytes still to hash.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|(_, d)| d.size).sum()
    }

    /// Hashes the deferred files and compares them with the manifest. Stops with
    /// [`Error::Cancelled`] when `cancel` is set.
    ///
    /// The files are read ahead of the hash and left in the page cache
    /// ([`crate::digest::digest_open_cancellable`]): CRIU, which reads them during or right
    /// after the hash, finds them in memory. A file written, truncated or replaced while it
    /// was hashed is refused ([`Error::ChangedWhileVerified`]).
    pub fn verify(&self, cancel: &AtomicBool) -> Result<()> {
        for (name, want) in &self.files {
            if cancel.load(Ordering::Relaxed) {
                return Err(Error::Cancelled { name: name.clone() });
            }
            let path = self.dir.join(name);
            let file = fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&path)
                .map_err(|e| Error::io("opening", &path, e))?;
            let before = Identity::of(&file, &path)?;
            let held = file
                .try_clone()
                .map_err(|e| Error::io("opening", &path, e))?;
            let got =
                digest_open_cancellable(file, &path, name, FileHasher::checking(want), cancel)?;
            let after = Identity::of(&held, &path)?;
            let named = fs::symlink_metadata(&path).map_err(|e| Error::io("reading", &path, e))?;
            if before != after || (named.dev(), named.ino()) != (after.dev, after.ino) {
                return Err(Error::ChangedWhileVerified { name: name.clone() });
            }
            check_digest(name, want, &got)?;
        }
        Ok(())
    }
}

/// What changes when a file is written, truncated or replaced: its inode, size, and change
/// time (which a write sets and no caller can set back).
#[derive(Debug, PartialEq, Eq)]
struct Identity {
    dev: u64,
    ino: u64,
    size: u64,
    ctime: (i64, i64),
}

impl Identity {
    fn of(file: &fs::File, path: &Path) -> Result<Identity> {
        let m = file.metadata().map_err(|e| Error::io("reading", path, e))?;
        Ok(Identity {
            dev: m.dev(),
            ino: m.ino(),
            size: m.len(),
            ctime: (m.ctime(), m.ctime_nsec()),
        })
    }
}

/// Verify a checkpoint directory in two stages: now, the manifest, the listing (no unlisted
/// file), the type and size of every file, and the digest of every file but those `defer`
/// picks; later, [`DeferredDigests::verify`] for those. `verify_dir` defers nothing.
pub fn verify_dir_staged(
    dir: &Path,
    defer: &dyn Fn(&str) -> bool,
    progress: Progress<'_>,
) -> Result<(Manifest, DeferredDigests)> {
    let mut f = Findings::new(false);
    let r = verify_dir_into(dir, defer, progress, &mut f)?;
    f.finish()?;
    Ok(r)
}

/// [`verify_dir`], naming every file that differs from the manifest, not only the first
/// ([`Error::FilesDiffer`] when several do).
pub fn verify_dir_every(dir: &Path, progress: Progress<'_>) -> Result<Manifest> {
    let mut f = Findings::new(true);
    let (m, _) = verify_dir_into(dir, &|_| false, progress, &mut f)?;
    f.finish()?;
    Ok(m)
}

fn verify_dir_into(
    dir: &Path,
    defer: &dyn Fn(&str) -> bool,
    progress: Progress<'_>,
    found: &mut Findings,
) -> Result<(Manifest, DeferredDigests)> {
    let m = Manifest::read_from(dir)?;
    // Unlisted files first: cheap, and a stray file is as much a mismatch as a bad digest.
    for ent in fs::read_dir(dir).map_err(|e| Error::io("listing", dir, e))? {
        let ent = ent.map_err(|e| Error::io("listing", dir, e))?;
        let name = ent.file_name().to_string_lossy().into_owned();
        if !is_manifest_or_temp(&name) && !m.files.contains_key(&name) {
            found.add(Error::UnlistedFile { name })?;
        }
    }
    let mut deferred = DeferredDigests {
        dir: dir.to_path_buf(),
        files: Vec::new(),
    };
    let mut now = Vec::new();
    for (name, want) in &m.files {
        let path = dir.join(name);
        let meta = match fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                found.add(Error::MissingFile { name: name.clone() })?;
                continue;
            }
            Err(e) => return Err(Error::io("reading", &path, e)),
        };
        if !meta.file_type().is_file() {
            found.add(Error::NotFlat {
                name: name.clone(),
                reason: "not a regular file",
            })?;
            continue;
        }
        if meta.len() != want.size {
            found.add(Error::SizeMismatch {
                name: name.clone(),
                expected: want.size,
                actual: meta.len(),
            })?;
            continue;
        }
        if defer(name) {
            deferred.files.push((name.clone(), want.clone()));
        } else {
            now.push((name, want));
        }
    }
    let total: u64 = now.iter().map(|(_, f)| f.size).sum();
    let mut base = 0u64;
    for (name, want) in now {
        let got = digest_file(&dir.join(name), FileHasher::checking(want), &mut |d, _| {
            progress(base + d, total)
        })?;
        base += got.size;
        if let Err(e) = check_digest(name, want, &got) {
            found.add(e)?;
        }
    }
    Ok((m, deferred))
}

/// Compares a file as read with its manifest entry: the size, then BLAKE3 where the entry has
/// it, else sha256. A digest that the entry lacks never passes, nor one `got` did not compute.
pub(crate) fn check_digest(name: &str, want: &FileDigest, got: &FileDigest) -> Result<()> {
    if got.size != want.size {
        return Err(Error::SizeMismatch {
            name: name.to_string(),
            expected: want.size,
            actual: got.size,
        });
    }
    let (algorithm, expected, actual) = if !want.blake3.is_empty() {
        ("blake3", &want.blake3, &got.blake3)
    } else {
        ("sha256", &want.sha256, &got.sha256)
    };
    if expected.is_empty() || actual != expected {
        return Err(Error::DigestMismatch {
            name: name.to_string(),
            algorithm,
            expected: expected.clone(),
            actual: actual.clone(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::durable::{Op, Recording};

    /// A manifest with nothing but its date, for the files to be added.
    fn empty_manifest() -> Manifest {
        Manifest::new(
            "2026-01-01T00:00:00Z",
            Container::default(),
            Node::default(),
            Devices::default(),
            Workload::default(),
        )
    }

    /// The NCCL record is written only when there is one (an older manifest reads as before),
    /// and reads back as written.
    #[test]
    fn the_nccl_record_is_optional_and_round_trips() {
        let m = empty_manifest();
        let json = serde_json::to_value(&m).unwrap();
        assert!(json.get("nccl").is_none());
        let mut m = m;
        m.nccl = Some(NcclRecord {
            layer_blake3: "ab".repeat(32),
            processes: vec![NcclProcess {
                pid: 7,
                token: "t".into(),
                nccl_version: 23206,
                suspended: false,
                comms: vec![NcclComm {
                    id: 2,
                    key: "k/1".into(),
                    rank: 1,
                    nranks: 2,
                    cuda_dev: 1,
                    split: Some((1, 1, -1)),
                }],
            }],
            cut: Some(NcclCut {
                id: "cut1".into(),
                containers: vec!["a".into(), "b".into()],
            }),
        });
        let back: Manifest = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(back, m);
    }

    /// A checkpoint directory with one page image of `size` bytes, its manifest written, and
    /// the page image deferred by a staged verify.
    fn staged_page_image(dir: &Path, size: usize) -> DeferredDigests {
        fs::write(dir.join("core-1.img"), "core").unwrap();
        let body: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        fs::write(dir.join("pages-1.img"), body).unwrap();
        let mut m = empty_manifest();
        m.hash_dir(dir).unwrap();
        m.write_to(dir).unwrap();
        let (_, deferred) = verify_dir_staged(dir, &is_page_image, &mut no_progress).unwrap();
        assert_eq!(deferred.bytes(), size as u64);
        deferred
    }

    /// Pages of `path` in the page cache, and its page count (`mincore` of a mapping).
    fn resident_pages(path: &Path) -> (usize, usize) {
        use std::os::fd::AsRawFd;
        let f = fs::File::open(path).unwrap();
        let len = f.metadata().unwrap().len() as usize;
        let pages = len.div_ceil(4096);
        let mut vec = vec![0u8; pages];
        // SAFETY: a read-only shared mapping of an open file, unmapped before return; mincore
        // fills one byte per page of it.
        unsafe {
            let at = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            );
            assert_ne!(at, libc::MAP_FAILED);
            assert_eq!(libc::mincore(at, len, vec.as_mut_ptr()), 0);
            libc::munmap(at, len);
        }
        (vec.iter().filter(|b| **b & 1 == 1).count(), pages)
    }

    /// The deferred verify reads a page image from the disk into the page cache and leaves it
    /// there, for CRIU to read from memory: no direct I/O, nothing dropped behind the hash.
    #[test]
    fn the_deferred_verify_leaves_the_page_images_in_the_page_cache() {
        use std::os::fd::AsRawFd;
        let d = tempfile::tempdir().unwrap();
        let deferred = staged_page_image(d.path(), 8 << 20);
        let path = d.path().join("pages-1.img");
        // Out of the page cache first (written back, then dropped).
        let f = fs::File::open(&path).unwrap();
        f.sync_all().unwrap();
        // SAFETY: a valid descriptor; advice only.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let (cold, pages) = resident_pages(&path);
        assert!(
            cold < pages / 2,
            "{cold} of {pages} pages still cached: not a cold start"
        );
        deferred.verify(&AtomicBool::new(false)).unwrap();
        let (warm, _) = resident_pages(&path);
        assert_eq!(
            warm, pages,
            "{warm} of {pages} pages cached after the verify ({cold} before)"
        );
    }

    /// A page image written while it is hashed is refused, even when the bytes written are the
    /// ones it held (a writer could put them back after the hash read them otherwise).
    #[test]
    fn a_page_image_written_while_it_is_hashed_is_refused() {
        use std::sync::atomic::AtomicBool;
        let d = tempfile::tempdir().unwrap();
        let deferred = staged_page_image(d.path(), 32 << 20);
        let path = d.path().join("pages-1.img");
        let stop = Arc::new(AtomicBool::new(false));
        let (started, writing) = std::sync::mpsc::channel();
        let writer = std::thread::spawn({
            let (path, stop) = (path.clone(), stop.clone());
            move || {
                let f = fs::OpenOptions::new().write(true).open(&path).unwrap();
                let same: Vec<u8> = (0..4096).map(|i| (i % 251) as u8).collect();
                f.write_at(&same, 0).unwrap();
                started.send(()).unwrap();
                while !stop.load(Ordering::Relaxed) {
                    f.write_at(&same, 0).unwrap();
                }
            }
        });
        writing.recv().unwrap();
        let e = deferred.verify(&AtomicBool::new(false)).unwrap_err();
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
        assert!(
            matches!(&e, Error::ChangedWhileVerified { name } if name == "pages-1.img"),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            "file \"pages-1.img\": changed while it was verified"
        );
        // Left alone, the same file passes.
        deferred.verify(&AtomicBool::new(false)).unwrap();
    }

    /// The follower starts the writeback of what it hashed, in the order written; the syncs
    /// before the manifest still cover every listed file, each after its last writeback and
    /// before the manifest's rename. A follower without a synced durability starts none.
    #[test]
    fn the_follower_writes_back_what_it_hashed_and_every_file_is_still_synced_first() {
        use std::io::Write;
        let d = tempfile::tempdir().unwrap();
        let dir = d.path();
        let rec = Arc::new(Recording::default());
        let step = Writeback::STEP as usize;
        let mut follower =
            AppendHasher::new(dir, is_page_image, HashSet::new(), PageDigests::default())
                .writing_back_through(rec.clone());
        let mut idle =
            AppendHasher::new(dir, is_page_image, HashSet::new(), PageDigests::default())
                .writing_back(Durability::None);
        let mut pages = fs::File::create(dir.join("pages-1.img")).unwrap();
        // Appended in three parts, polled in between, as CRIU writes and the follower reads.
        for part in [step + 100, step, 12345] {
            pages.write_all(&vec![3u8; part]).unwrap();
            follower.poll().unwrap();
            idle.poll().unwrap();
        }
        fs::write(dir.join("core-1.img"), "core").unwrap();
        let total = (2 * step + 100 + 12345) as u64;
        let page = dir.join("pages-1.img");
        let followed = follower.finish().unwrap();
        assert_eq!(followed["pages-1.img"].size, total);
        assert_eq!(
            idle.finish().unwrap()["pages-1.img"],
            followed["pages-1.img"]
        );
        let started: Vec<(u64, u64)> = rec
            .ops()
            .into_iter()
            .map(|op| match op {
                Op::StartWriteback(p, off, len) if p == page => (off, len),
                other => panic!("only the page image's writeback so far: {other:?}"),
            })
            .collect();
        // Contiguous from 0 to the end, at least two ranges before the end.
        assert!(started.len() >= 3, "{started:?}");
        let mut at = 0;
        for (off, len) in &started {
            assert_eq!(*off, at, "{started:?}");
            at += len;
        }
        assert_eq!(at, total);
        let mut m = empty_manifest();
        m.files =
            hash_dir_flat_with(dir, followed, PageDigests::default(), &mut no_progress).unwrap();
        m.write_with(&*rec, dir, Durability::Sync).unwrap();
        let ops = rec.ops();
        let manifest = dir.join(MANIFEST_FILE);
        let rename = ops
            .iter()
            .position(|o| matches!(o, Op::Rename(_, to) if to == &manifest))
            .unwrap();
        let last_writeback = ops
            .iter()
            .rposition(|o| matches!(o, Op::StartWriteback(..)))
            .unwrap();
        for n in m.files.keys() {
            let at = ops
                .iter()
                .position(|o| o == &Op::SyncFile(dir.join(n)))
                .unwrap_or_else(|| panic!("{n} not synced: {ops:?}"));
            assert!(at > last_writeback && at < rename, "{n}: {ops:?}");
        }
        verify_dir(dir).unwrap();
    }

    /// A device-memory file is listed in `device_state` and `files` with the BLAKE3 taken as it
    /// was written (no sha256); `verify` holds it to that digest; a manifest whose
    /// `device_state` digest is not the one `files` lists is refused.
    #[test]
    fn device_memory_files_are_listed_verified_and_held_to_files() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path();
        let data = vec![0x5au8; 4096];
        fs::write(dir.join("device-memory-1-0.bin"), &data).unwrap();
        let blake3 = blake3::hash(&data).to_hex().to_string();
        let mut m = Manifest::new(
            "2026-01-01T00:00:00Z",
            Container::default(),
            Node::default(),
            Devices {
                storage: STORAGE_CUSTOM.into(),
                ..Devices::default()
            },
            Workload::default(),
        );
        m.add_device_memory("device-memory-1-0.bin", "GPU-x", 1, 4096, &blake3)
            .unwrap();
        assert!(m
            .add_device_memory("pages-1.img", "GPU-x", 1, 1, &blake3)
            .is_err());
        assert!(m.devices.custom_storage());
        assert_eq!(m.device_memory_of(1).count(), 1);
        assert!(m.files["device-memory-1-0.bin"].sha256.is_empty());
        m.write_to(dir).unwrap();
        assert_eq!(verify_dir(dir).unwrap(), m);
        let json = String::from_utf8(m.to_json()).unwrap();
        assert!(json.contains("\"storage\": \"custom\""), "{json}");
        // One changed byte: refused.
        let mut changed = data.clone();
        changed[100] ^= 1;
        fs::write(dir.join("device-memory-1-0.bin"), &changed).unwrap();
        let err = verify_dir(dir).unwrap_err().to_string();
        assert!(err.contains("device-memory-1-0.bin"), "{err}");
        // A storage path this build does not know: refused.
        let mut odd: serde_json::Value = serde_json::from_slice(&m.to_json()).unwrap();
        odd["devices"]["storage"] = "tape".into();
        let err = Manifest::from_json(&serde_json::to_vec(&odd).unwrap(), "t")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("devices.storage") && err.contains("tape"),
            "{err}"
        );
        // A device_state digest that files does not list: refused.
        let mut v: serde_json::Value = serde_json::from_slice(&m.to_json()).unwrap();
        v["device_state"][0]["blake3"] = "0".repeat(64).into();
        let err = Manifest::from_json(&serde_json::to_vec(&v).unwrap(), "t")
            .unwrap_err()
            .to_string();
        assert!(err.contains("device_state[0].blake3"), "{err}");
    }

    #[test]
    fn every_listed_file_is_synced_before_the_manifest_and_the_directory_after_its_rename() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path();
        for (n, body) in [("core-1.img", "core"), ("pages-1.img", "pages")] {
            fs::write(dir.join(n), body).unwrap();
        }
        let mut m = empty_manifest();
        m.hash_dir(dir).unwrap();
        let rec = Recording::default();
        m.write_with(&rec, dir, Durability::Sync).unwrap();
        let ops = rec.ops();
        let pos = |want: &Op| ops.iter().position(|o| o == want);
        let manifest = dir.join(MANIFEST_FILE);
        let rename = ops
            .iter()
            .position(|o| matches!(o, Op::Rename(_, to) if to == &manifest))
            .expect("the manifest is renamed into place");
        let Op::Rename(tmp, _) = &ops[rename] else {
            unreachable!()
        };
        for n in m.files.keys() {
            let at = pos(&Op::SyncFile(dir.join(n))).unwrap_or_else(|| panic!("{n} not synced"));
            assert!(at < rename, "{n} synced after the rename: {ops:?}");
        }
        let tmp_sync = pos(&Op::SyncFile(tmp.clone())).expect("temp manifest synced");
        assert!(tmp_sync < rename, "{ops:?}");
        let dir_sync = pos(&Op::SyncDir(dir.to_path_buf())).expect("directory synced");
        assert!(dir_sync > rename, "{ops:?}");
        assert_eq!(Manifest::read_from(dir).unwrap(), m);
    }
}
