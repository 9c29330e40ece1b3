//! This node's GPUs (or the ones a file describes) and the checkpoint's, for the compatibility
//! verdict of `compat` and `inspect`: the shim's restore rule
//! ([`image_format::compat::restore_check`]) plus the workload versions the restoring pod
//! declares.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use image_format::archive;
use image_format::compat::{self, NodeGpus, Profile, RestoreCheck};
use image_format::manifest::{Devices, Manifest, Workload, MANIFEST_FILE};
use image_format::oci;
use image_format::safe::Limits;

use super::input::Input;
use crate::exit::CliError;
use crate::output::Text;

#[derive(clap::Args, Clone, Debug, Default)]
pub struct NodeArgs {
    /// Node GPU inventory, JSON: what `gpu-ckpt device --list -o json` prints, or
    /// {"driver_version","cuda_driver_version","gpus":[{uuid,model,...}]} (or
    /// {"devices":{...},"workload":{...}}). Default: $GPU_CKPT_NODE_INVENTORY, else NVML.
    #[arg(long, value_name = "FILE")]
    pub node: Option<PathBuf>,
    /// The NVML library to read the node from (default libnvidia-ml.so.1).
    #[arg(long, value_name = "PATH")]
    pub libnvml: Option<PathBuf>,
    /// The GPUs the restored container would get, in its order (default: the node's first
    /// GPUs, as many as the checkpoint had).
    #[arg(long, value_name = "UUID,...")]
    pub gpus: Option<String>,
    /// Engine version the restoring pod declares (gpu-ckpt.io/engine-version).
    #[arg(long)]
    pub engine_version: Option<String>,
    /// Model version the restoring pod declares (gpu-ckpt.io/model-version).
    #[arg(long)]
    pub model_version: Option<String>,
}

/// The GPUs a restored container would get, as known.
enum Gpus {
    NoDriver,
    /// The node's inventory (NVML's, or `device --list`'s JSON) and the GPUs given.
    Inventory(gpu::NodeInventory, Vec<gpu::GpuUuid>),
    /// A profile of the GPUs given.
    Profile(Devices),
}

/// The restoring side: the GPUs, and the workload versions the pod declares.
pub struct NodeSide {
    gpus: Gpus,
    workload: Workload,
}

impl NodeSide {
    /// The node `args` name (`--node`, `$GPU_CKPT_NODE_INVENTORY`, else NVML), for a
    /// checkpoint of `count` GPUs.
    pub fn read(args: &NodeArgs, count: usize) -> Result<NodeSide> {
        let path = args
            .node
            .clone()
            .or_else(|| std::env::var_os("GPU_CKPT_NODE_INVENTORY").map(PathBuf::from));
        let mut side = match path {
            Some(path) => from_file(&path, args, count)?,
            None => from_nvml(args, count)?,
        };
        if let Some(e) = &args.engine_version {
            side.workload.engine_version = e.clone();
        }
        if let Some(m) = &args.model_version {
            side.workload.model_version = m.clone();
        }
        Ok(side)
    }

    /// Can `ckpt` restore here: the restore rule on the GPUs, and the workload versions.
    pub fn check(&self, ckpt: &Profile) -> RestoreCheck {
        let gpus = match &self.gpus {
            Gpus::NoDriver => NodeGpus::NoDriver,
            Gpus::Inventory(inv, given) => NodeGpus::Given(inv, given),
            Gpus::Profile(d) => NodeGpus::Profile(d),
        };
        let mut r = compat::restore_check(&ckpt.devices, gpus);
        let workload = compat::workload_differences(&ckpt.workload, &self.workload);
        if !workload.is_empty() {
            r.verdict.compatible = false;
            r.verdict.gpu_map.clear();
            r.verdict.differences.extend(workload);
        }
        r
    }
}

fn from_file(path: &Path, args: &NodeArgs, count: usize) -> Result<NodeSide> {
    let data = std::fs::read(path).map_err(|e| image_format::Error::io("reading", path, e))?;
    let parsing = || format!("parsing {}", path.display());
    let v: serde_json::Value = serde_json::from_slice(&data).with_context(parsing)?;
    if v.get("devices").is_some() {
        let p: Profile = serde_json::from_value(v).with_context(parsing)?;
        return Ok(NodeSide {
            gpus: Gpus::Profile(p.devices),
            workload: p.workload,
        });
    }
    // `device --list`'s inventory: the CUDA version as cuDriverGetVersion gives it (13000).
    if v.get("cuda_driver_version").is_some_and(|c| c.is_number()) {
        let inv: gpu::NodeInventory = serde_json::from_value(v).with_context(parsing)?;
        let given = given_gpus(args, &inv, count)?;
        return Ok(NodeSide {
            gpus: Gpus::Inventory(inv, given),
            workload: Workload::default(),
        });
    }
    Ok(NodeSide {
        gpus: Gpus::Profile(serde_json::from_value(v).with_context(parsing)?),
        workload: Workload::default(),
    })
}

/// The node from NVML (`--libnvml`, else `libnvidia-ml.so.1`); no driver where there is none
/// and no library was named.
fn from_nvml(args: &NodeArgs, count: usize) -> Result<NodeSide> {
    use gpu::Inventory;
    let gpus = match gpu::NvmlInventory::open(args.libnvml.as_deref()) {
        Ok(nvml) => {
            let inv = nvml.node()?;
            let given = given_gpus(args, &inv, count)?;
            Gpus::Inventory(inv, given)
        }
        Err(gpu::GpuError::NoDriver { .. }) if args.libnvml.is_none() => Gpus::NoDriver,
        Err(e) => return Err(e.into()),
    };
    Ok(NodeSide {
        gpus,
        workload: Workload::default(),
    })
}

/// The GPUs a restore would be given: `--gpus`, else the node's first `count`.
fn given_gpus(
    args: &NodeArgs,
    inv: &gpu::NodeInventory,
    count: usize,
) -> Result<Vec<gpu::GpuUuid>> {
    let gpus: Vec<gpu::GpuUuid> = match &args.gpus {
        Some(list) => list
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| s.parse::<gpu::GpuUuid>())
            .collect::<Result<_, _>>()?,
        None => inv.gpus.iter().take(count).map(|g| g.uuid).collect(),
    };
    if let Some(u) = gpus
        .iter()
        .find(|u| !inv.gpus.iter().any(|g| g.uuid == **u))
    {
        return Err(CliError::Usage(format!("--gpus names {u}, which is not on this node")).into());
    }
    Ok(gpus)
}

/// The checkpoint's profile (and manifest when there is one) from any kind of input.
pub fn checkpoint_profile(path: &Path) -> Result<(Profile, Option<Manifest>)> {
    match Input::of(path)? {
        Input::Dir { manifest: true } => {
            let m = Manifest::read_from(path)?;
            Ok((Profile::from_manifest(&m), Some(m)))
        }
        Input::Dir { manifest: false } => Err(no_manifest(path)),
        Input::Image => match oci::image_profile(path)? {
            Some(p) => Ok((p, None)),
            None => Err(CliError::NotACheckpoint {
                path: path.to_path_buf(),
                why: "the image carries no gpu-ckpt.io/ annotations".into(),
            }
            .into()),
        },
        Input::File => {
            // A manifest JSON file, or an archive.
            let head = {
                let mut f = std::fs::File::open(path)
                    .map_err(|e| image_format::Error::io("opening", path, e))?;
                let mut b = [0u8; 1];
                let n = std::io::Read::read(&mut f, &mut b)
                    .map_err(|e| image_format::Error::io("reading", path, e))?;
                (n == 1).then_some(b[0])
            };
            if head == Some(b'{') {
                let data =
                    std::fs::read(path).map_err(|e| image_format::Error::io("reading", path, e))?;
                let m = Manifest::from_json(&data, &path.display().to_string())?;
                return Ok((Profile::from_manifest(&m), Some(m)));
            }
            let info = archive::read_info(path, Limits::default())?;
            let m = info.manifest.ok_or_else(|| no_manifest(path))?;
            Ok((Profile::from_manifest(&m), Some(m)))
        }
    }
}

/// A checkpoint without gpu-ckpt's manifest: nothing to hold it to.
pub fn no_manifest(path: &Path) -> anyhow::Error {
    CliError::NotACheckpoint {
        path: path.to_path_buf(),
        why: format!(
            "it has no gpu-ckpt manifest ({} in an archive, {MANIFEST_FILE} in a directory)",
            archive::names::MANIFEST_PATH
        ),
    }
    .into()
}

/// `compatible: yes` and the remapped GPUs, or `compatible: no` and each reason.
pub fn verdict_text(r: &RestoreCheck, t: &mut Text) {
    if r.compatible() {
        t.line("compatible: yes");
        for p in r.verdict.remapped() {
            t.line(format!("  remap {} -> {}", p.old_uuid, p.new_uuid));
        }
    } else {
        t.line("compatible: no");
        for d in r.reasons() {
            t.line(format!("  {d}"));
        }
    }
}
