//! `gpu-ckpt inspect`: what a checkpoint archive, image or directory holds (like
//! `checkpointctl inspect`), with the GPU section, the signer and the compatibility verdict for
//! this node. A truncated or hostile archive, or a directory that is no checkpoint, fails.

use std::path::PathBuf;

use anyhow::Result;
use image_format::archive::{self, ArchiveInfo};
use image_format::compat::{self, Profile, RestoreCheck};
use image_format::manifest::Manifest;
use image_format::oci;
use image_format::safe::Limits;

use super::input::Input;
use super::node::{self, NodeArgs, NodeSide};
use super::trust::{self, TrustArgs};
use crate::output::{OutputArgs, Report, Text};
use crate::progress::human;

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// Archive (.tar), OCI image (layout dir or tarball), or checkpoint directory.
    pub path: PathBuf,
    #[command(flatten)]
    pub out: OutputArgs,
    /// List every entry.
    #[arg(long)]
    pub files: bool,
    #[command(flatten)]
    pub node: NodeArgs,
    #[command(flatten)]
    pub trust: TrustArgs,
}

pub fn run(a: &InspectArgs) -> Result<Report> {
    let verdict = |ckpt: &Profile| -> Result<RestoreCheck> {
        Ok(NodeSide::read(&a.node, ckpt.devices.gpus.len())?.check(ckpt))
    };
    let input = Input::of(&a.path)?;
    if input == Input::Image {
        let (m, digest) = oci::read_image_manifest(&a.path)?;
        let prof = compat::profile_from_annotations(&m.annotations);
        let verdict = prof.as_ref().map(verdict).transpose()?;
        let mut t = Text::default();
        t.line(format!(
            "\nDisplaying checkpoint image {}\n",
            a.path.display()
        ));
        t.line(format!("Manifest: {digest}"));
        for (k, v) in &m.annotations {
            t.line(format!("├── {k}: {v}"));
        }
        for l in &m.layers {
            t.line(format!(
                "└── layer {} ({}, {})",
                l.digest,
                l.media_type,
                human(l.size)
            ));
        }
        match &verdict {
            Some(v) => node::verdict_text(v, &mut t),
            None => t.line("compatible: unknown (no gpu-ckpt annotations)"),
        }
        let data = serde_json::json!({
            "image": a.path, "manifest_digest": digest, "annotations": m.annotations,
            "layers": m.layers, "gpu_profile": prof, "compat": verdict,
        });
        return Ok(Report::new(t.0, data));
    }
    let info = if matches!(input, Input::Dir { .. }) {
        archive::read_info_dir(&a.path)?
    } else {
        archive::read_info(&a.path, Limits::default())?
    };
    let signer = trust::signer_report(info.manifest_json.as_deref(), &a.trust);
    let verdict = info
        .manifest
        .as_ref()
        .map(|m| verdict(&Profile::from_manifest(m)))
        .transpose()?;
    let data = json_of(&info, a.files, &signer, &verdict);
    let mut t = Text::default();
    tree(&info, &signer, &a.path, &mut t);
    if a.files {
        t.line("\nEntries:");
        for e in &info.entries {
            t.line(format!("  {:>12}  {}", e.size, e.path));
        }
    }
    match &verdict {
        Some(v) => node::verdict_text(v, &mut t),
        None => t.line("compatible: unknown (no manifest)"),
    }
    Ok(Report::new(t.0, data))
}

/// checkpointctl's field names, plus "gpu", "compat" and "signer".
fn json_of(
    info: &ArchiveInfo,
    files: bool,
    signer: &serde_json::Value,
    verdict: &Option<RestoreCheck>,
) -> serde_json::Value {
    let (_, pod, ns) = info.identity();
    let cfg = info.config_dump.clone().unwrap_or_default();
    let entries_json: Option<Vec<serde_json::Value>> = files.then(|| {
        info.entries
            .iter()
            .map(|e| serde_json::json!({"path": e.path, "size": e.size}))
            .collect()
    });
    serde_json::json!([{
        "container_name": info.container_name(),
        "image": cfg.rootfs_image_name,
        "id": cfg.id,
        "runtime": cfg.runtime,
        "created": cfg.created_time,
        "checkpointed": cfg.checkpointed_time,
        "engine": info.engine().to_string(),
        "checkpoint_size": {
            "total_size": info.sizes.checkpoint_size,
            "memory_pages_size": info.sizes.memory_pages_size,
            "amd_gpu_memory_pages_size": info.sizes.amd_gpu_memory_pages_size,
            "root_fs_diff_size": info.sizes.root_fs_diff_size,
        },
        "metadata": {"pod_name": pod, "kubernetes_namespace": ns, "annotations": info.annotations()},
        "statistics": info.statistics,
        "gpu": info.manifest,
        "compat": verdict,
        "signer": signer,
        "files": entries_json,
    }])
}

/// The tree view: the container, its sizes, CRIU's statistics and the GPU section.
fn tree(info: &ArchiveInfo, signer: &serde_json::Value, path: &std::path::Path, t: &mut Text) {
    let (name, pod, ns) = info.identity();
    let cfg = info.config_dump.clone().unwrap_or_default();
    t.line(format!(
        "\nDisplaying container checkpoint tree view from {}\n",
        path.display()
    ));
    t.line(if name.is_empty() {
        info.container_name()
    } else {
        name
    });
    t.line(format!("├── Image: {}", cfg.rootfs_image_name));
    t.line(format!("├── ID: {}", cfg.id));
    t.line(format!("├── Runtime: {}", cfg.runtime));
    t.line(format!("├── Created: {}", cfg.created_time));
    if !cfg.checkpointed_time.is_empty() {
        t.line(format!("├── Checkpointed: {}", cfg.checkpointed_time));
    }
    t.line(format!("├── Engine: {}", info.engine()));
    t.line(format!(
        "├── Signer: {}",
        signer["summary"].as_str().unwrap_or_default()
    ));
    if !pod.is_empty() {
        t.line(format!("├── Pod: {pod} (namespace {ns})"));
    }
    t.line(format!(
        "├── Checkpoint size: {}",
        human(info.sizes.checkpoint_size)
    ));
    t.line(format!(
        "│   └── Memory pages size: {}",
        human(info.sizes.memory_pages_size)
    ));
    if info.sizes.root_fs_diff_size > 0 {
        t.line(format!(
            "├── Root FS diff size: {}",
            human(info.sizes.root_fs_diff_size)
        ));
    }
    if let Some(s) = &info.statistics {
        t.line("├── CRIU dump statistics");
        t.line(format!("│   ├── Freezing time: {} us", s.freezing_time));
        t.line(format!("│   ├── Frozen time: {} us", s.frozen_time));
        t.line(format!("│   ├── Memdump time: {} us", s.memdump_time));
        t.line(format!("│   ├── Memwrite time: {} us", s.memwrite_time));
        t.line(format!("│   ├── Pages scanned: {}", s.pages_scanned));
        t.line(format!("│   └── Pages written: {}", s.pages_written));
    }
    match &info.manifest {
        None => t.line("└── GPU: no gpu-ckpt manifest (not taken by gpu-ckpt)"),
        Some(m) => gpu_section(m, t),
    }
}

fn gpu_section(m: &Manifest, t: &mut Text) {
    t.line(format!(
        "└── GPU (manifest schema {}, taken {})",
        m.schema_version, m.created
    ));
    t.line(format!(
        "    ├── Node: kernel {}, CRIU {}, runc {}, shim {}",
        m.node.kernel, m.node.criu, m.node.runc, m.node.shim
    ));
    t.line(format!(
        "    ├── Driver {}, CUDA {}",
        m.devices.driver_version, m.devices.cuda_driver_version
    ));
    let held = m.devices.bytes_per_gpu();
    for (i, g) in m.devices.gpus.iter().enumerate() {
        t.line(format!(
            "    ├── GPU {i}: {} ({}, {}, {}) {}, device memory held: {}",
            g.model,
            g.architecture,
            human(g.memory_bytes),
            g.pci_address,
            g.uuid,
            human(held[i])
        ));
    }
    for p in &m.devices.processes {
        let on: Vec<String> = p
            .gpus
            .iter()
            .map(|g| format!("{} on {}", human(g.bytes), g.uuid))
            .collect();
        t.line(format!("    ├── Process {}: {}", p.pid, on.join(", ")));
    }
    for f in &m.devices.driver_files {
        let id = if f.build_id.is_empty() {
            "none"
        } else {
            &f.build_id
        };
        t.line(format!(
            "    ├── Driver file: {} ({}, build id {id})",
            f.path,
            human(f.size)
        ));
    }
    if m.devices.custom_storage() {
        t.line(format!(
            "    ├── Device bytes (custom storage, in device-memory files): {}",
            human(m.devices.device_bytes())
        ));
        for d in m.device_state.iter().filter(|d| !d.blake3.is_empty()) {
            let pid = d.pid.map(|p| p.to_string()).unwrap_or_default();
            t.line(format!(
                "    ├── Device-memory file: {} ({}, process {pid}, GPU {}, blake3 {})",
                d.name,
                human(d.size),
                d.gpu_uuid,
                d.blake3
            ));
        }
    } else if !m.devices.processes.is_empty() {
        t.line(format!(
            "    ├── Device bytes (staged in host memory): {}",
            human(m.devices.device_bytes())
        ));
    }
    if !m.devices.storage.is_empty() {
        t.line(format!("    ├── Device storage: {}", m.devices.storage));
    }
    t.line(format!(
        "    ├── Engine version: {}, model version: {}",
        m.workload.engine_version, m.workload.model_version
    ));
    t.line(format!(
        "    ├── Device state: {} blobs, {}",
        m.device_state.len(),
        human(m.device_state_bytes())
    ));
    for s in &m.timings {
        t.line(format!("    ├── {}: {:.1} ms", s.step, s.millis));
    }
    t.line(format!("    └── Files: {} listed", m.files.len()));
}
