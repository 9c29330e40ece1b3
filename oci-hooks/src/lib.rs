//! gpu-ckpt's OCI hooks, run by runc with the container's state on stdin:
//!
//! - createRuntime ([`create_runtime`]): which GPUs the container was given, resolved through the
//!   node's NVML inventory, recorded in its bundle ([`BUNDLE_GPUS_FILE`]) for the shim;
//! - prestart ([`prestart`]): during a restore (the shim wrote [`BUNDLE_RESTORE_DEVICES_FILE`]),
//!   the checkpoint's GPUs held against the container's; a misfit fails the hook and so the
//!   restore, before any restored process runs.
//!
//! [`base_spec`] writes containerd's `base_runtime_spec` that installs both. The functions here
//! take the node's inventory from a loader, so everything but [`inventory`] and
//! [`inventory_if_driver`] runs without a driver.

pub mod base_spec;
mod error;

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use gpu::assign::Assigned;
use gpu::{GpuError, Inventory, NodeInventory, NvmlInventory};
use image_format::compat::{self, Profile, Verdict};
use image_format::manifest::Devices;
use serde::Deserialize;
use serde_json::Value;

pub use error::{join_differences, HookError};
pub use image_format::compat::{BUNDLE_GPUS_FILE, BUNDLE_RESTORE_DEVICES_FILE};

/// The binary's name, `args[0]` of every hook entry.
pub const BIN_NAME: &str = "gpu-ckpt-hook";
/// The subcommand run at createRuntime.
pub const CREATE_RUNTIME: &str = "create-runtime";
/// The subcommand run at prestart.
pub const PRESTART: &str = "prestart";
/// The bundle's spec.
pub const CONFIG_FILE: &str = "config.json";

/// The container state the runtime passes on stdin (OCI runtime spec, "State").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct State {
    pub oci_version: String,
    pub id: String,
    pub status: String,
    pub pid: Option<i32>,
    /// The bundle directory, holding `config.json`.
    pub bundle: PathBuf,
    pub annotations: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct RawState {
    #[serde(rename = "ociVersion", default)]
    oci_version: String,
    #[serde(default)]
    id: String,
    #[serde(default)]
    status: String,
    #[serde(default)]
    pid: Option<i32>,
    #[serde(default)]
    bundle: Option<PathBuf>,
    #[serde(default)]
    annotations: Option<BTreeMap<String, String>>,
}

/// Parses the state JSON. A missing or empty `bundle` is an error.
pub fn parse_state(input: &[u8]) -> Result<State, HookError> {
    let raw: RawState = serde_json::from_slice(input).map_err(HookError::StateJson)?;
    let bundle = raw
        .bundle
        .filter(|b| !b.as_os_str().is_empty())
        .ok_or(HookError::NoBundle)?;
    Ok(State {
        oci_version: raw.oci_version,
        id: raw.id,
        status: raw.status,
        pid: raw.pid,
        bundle,
        annotations: raw.annotations.unwrap_or_default(),
    })
}

/// Reads the state from `input` (stdin) to its end and parses it.
pub fn read_state(mut input: impl Read) -> Result<State, HookError> {
    let mut buf = Vec::new();
    input.read_to_end(&mut buf).map_err(HookError::StateRead)?;
    parse_state(&buf)
}

/// The bundle's `config.json`, parsed.
pub fn read_spec(bundle: &Path) -> Result<Value, HookError> {
    read_json(&bundle.join(CONFIG_FILE))
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, HookError> {
    let bytes = fs::read(path).map_err(|error| HookError::Read {
        path: path.to_path_buf(),
        error,
    })?;
    serde_json::from_slice(&bytes).map_err(|error| HookError::Json {
        path: path.to_path_buf(),
        error,
    })
}

/// Whether the spec gives the container any GPU, decided without the node's inventory: the
/// resolution against a node with no GPU gives nothing only when the spec names none (a named
/// GPU is then unknown, an error; `NVIDIA_VISIBLE_DEVICES=all` gives an empty list).
pub fn names_gpus(spec: &Value) -> bool {
    let empty = NodeInventory {
        driver_version: String::new(),
        cuda_driver_version: 0,
        gpus: Vec::new(),
    };
    !matches!(gpu::assign::from_spec(spec, &empty), Ok(None))
}

/// The container's GPUs on the node `inv`, in its order; `None` when it was given none.
pub fn resolve(
    bundle: &Path,
    spec: &Value,
    inv: &NodeInventory,
) -> Result<Option<Assigned>, HookError> {
    let assigned = gpu::assign::from_spec(spec, inv).map_err(|error| HookError::Spec {
        path: bundle.join(CONFIG_FILE),
        error,
    })?;
    Ok(assigned.filter(|a| !a.gpus.is_empty()))
}

/// Loads NVML (`libnvml`, else `libnvidia-ml.so.1` through the loader's search) and reads the
/// node's inventory.
pub fn inventory(libnvml: Option<&Path>) -> Result<NodeInventory, HookError> {
    let nvml = NvmlInventory::open(libnvml).map_err(HookError::Inventory)?;
    nvml.node().map_err(HookError::Inventory)
}

/// [`inventory`], but `None` when no library was named and the node has no NVIDIA driver.
pub fn inventory_if_driver(libnvml: Option<&Path>) -> Result<Option<NodeInventory>, HookError> {
    match inventory(libnvml) {
        Ok(inv) => Ok(Some(inv)),
        Err(HookError::Inventory(GpuError::NoDriver { .. })) if libnvml.is_none() => Ok(None),
        Err(e) => Err(e),
    }
}

/// What the createRuntime hook did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Created {
    /// The spec gives the container no GPU: nothing written, NVML not loaded.
    NoGpus,
    /// The spec names GPUs but the node has no NVIDIA driver: nothing written.
    NoDriver,
    /// The record, written at `path`.
    Recorded { path: PathBuf, assigned: Assigned },
}

/// The createRuntime hook: resolves the container's GPUs through the inventory `load` gives
/// (`None`: no driver on the node) and writes them to `<bundle>/`[`BUNDLE_GPUS_FILE`].
pub fn create_runtime(
    state: &State,
    load: impl FnOnce() -> Result<Option<NodeInventory>, HookError>,
) -> Result<Created, HookError> {
    let spec = read_spec(&state.bundle)?;
    if !names_gpus(&spec) {
        return Ok(Created::NoGpus);
    }
    let Some(inv) = load()? else {
        return Ok(Created::NoDriver);
    };
    match resolve(&state.bundle, &spec, &inv)? {
        None => Ok(Created::NoGpus),
        Some(assigned) => {
            let path = write_record(&state.bundle, &assigned)?;
            Ok(Created::Recorded { path, assigned })
        }
    }
}

/// Writes `assigned` to `<bundle>/`[`BUNDLE_GPUS_FILE`]: a temporary file (mode 0600, synced)
/// renamed over it.
pub fn write_record(bundle: &Path, assigned: &Assigned) -> Result<PathBuf, HookError> {
    let path = bundle.join(BUNDLE_GPUS_FILE);
    let tmp = bundle.join(format!(".{BUNDLE_GPUS_FILE}.{}.tmp", std::process::id()));
    let mut body = serde_json::to_vec_pretty(assigned).map_err(|error| HookError::Json {
        path: path.clone(),
        error,
    })?;
    body.push(b'\n');
    let write = || -> std::io::Result<()> {
        match fs::remove_file(&tmp) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.set_permissions(fs::Permissions::from_mode(0o600))?;
        f.write_all(&body)?;
        f.sync_all()?;
        fs::rename(&tmp, &path)
    };
    write().map_err(|error| {
        let _ = fs::remove_file(&tmp);
        HookError::Write {
            path: path.clone(),
            error,
        }
    })?;
    Ok(path)
}

/// The checkpoint's devices the shim wrote for a restore; `None` when there is no such file (the
/// container is not being restored).
pub fn read_restore_devices(bundle: &Path) -> Result<Option<Devices>, HookError> {
    let path = bundle.join(BUNDLE_RESTORE_DEVICES_FILE);
    match fs::symlink_metadata(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(error) => Err(HookError::Read { path, error }),
        Ok(_) => read_json(&path).map(Some),
    }
}

/// Holds the checkpoint's GPUs (`recorded`) against the container's (from `spec`, on the node
/// `inv`): same count and models, the driver branch and CUDA version, room on each GPU.
pub fn verdict(
    bundle: &Path,
    recorded: Devices,
    spec: &Value,
    inv: &NodeInventory,
) -> Result<Verdict, HookError> {
    let gpus = resolve(bundle, spec, inv)?
        .map(|a| a.gpus)
        .unwrap_or_default();
    let node = Profile::from_inventory(inv, &gpus, Default::default());
    let ckpt = Profile {
        devices: recorded,
        workload: Default::default(),
    };
    Ok(compat::check(&ckpt, &node))
}

/// What the prestart hook decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prestart {
    /// No restore-devices file: not a restore.
    NotARestore,
    /// A restore whose checkpoint held no GPU: nothing to hold.
    NoGpusRecorded,
    /// The container's GPUs fit the checkpoint.
    Fits(Verdict),
}

/// The prestart hook: during a restore, [`verdict`] on the inventory `load` gives;
/// [`HookError::Incompatible`] when the container's GPUs do not fit.
pub fn prestart(
    state: &State,
    load: impl FnOnce() -> Result<NodeInventory, HookError>,
) -> Result<Prestart, HookError> {
    let Some(recorded) = read_restore_devices(&state.bundle)? else {
        return Ok(Prestart::NotARestore);
    };
    if recorded.gpus.is_empty() {
        return Ok(Prestart::NoGpusRecorded);
    }
    let spec = read_spec(&state.bundle)?;
    let gpus = recorded.gpus.len();
    let inv = load().map_err(|e| match e {
        HookError::Inventory(GpuError::NoDriver { library, reason }) => HookError::NoDriver {
            gpus,
            reason: format!("this node has no NVIDIA driver: cannot load {library}: {reason}"),
        },
        other => other,
    })?;
    let v = verdict(&state.bundle, recorded, &spec, &inv)?;
    if v.compatible {
        Ok(Prestart::Fits(v))
    } else {
        Err(HookError::Incompatible(v.differences))
    }
}

#[cfg(test)]
mod tests;
