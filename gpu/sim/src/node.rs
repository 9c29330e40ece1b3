//! What a simulated node's GPUs are: count, model, memory, UUIDs, PCI bus ids, versions; and
//! its driver's library files, named by the driver version as NVIDIA's are.

use std::io;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// The driver's libraries the simulator provides: (file the build makes, library name). On the
/// node they are `lib/<name>.so.<driver version>`, with the loader's links `<name>.so.1` and
/// `<name>.so` beside them, as NVIDIA's installer and ldconfig leave a real driver.
pub const LIBRARIES: [(&str, &str); 2] = [
    ("libcuda.so", "libcuda"),
    ("libnvidia_ml.so", "libnvidia-ml"),
];

/// The simulated NCCL: (file the build makes, library name). On the node it is
/// `lib/libnccl.so.<NCCL version>` with the links `libnccl.so.2` and `libnccl.so`, as NCCL's
/// packages install it, and the CDI spec gives it to containers beside the driver's libraries.
pub const NCCL_LIBRARY: (&str, &str) = ("libnccl.so", "libnccl");

/// The driver's file of library `name` under `driver_version`: `libcuda.so.580.95.05`.
pub fn versioned_name(name: &str, driver_version: &str) -> String {
    format!("{name}.so.{driver_version}")
}

/// One library of a node's `lib/`: the file the build makes, the file on the node, and the
/// loader's name for it (its soname).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibFile {
    pub src: &'static str,
    pub name: &'static str,
    pub file: String,
    pub soname: String,
}

/// The libraries of a node whose driver is `driver_version`: the driver's ([`LIBRARIES`]) and
/// NCCL ([`NCCL_LIBRARY`]).
pub fn library_files(driver_version: &str) -> Vec<LibFile> {
    let driver = LIBRARIES.iter().map(|(src, name)| LibFile {
        src,
        name,
        file: versioned_name(name, driver_version),
        soname: format!("{name}.so.1"),
    });
    let (src, name) = NCCL_LIBRARY;
    let nccl = LibFile {
        src,
        name,
        file: versioned_name(name, crate::nccl::VERSION_STRING),
        soname: format!("{name}.so.{}", crate::nccl::VERSION.0),
    };
    driver.chain([nccl]).collect()
}

/// Lays out `lib` for a node of `driver_version`: each of [`library_files`] copied from
/// `lib_src` as its versioned file (a rename into place, so that running processes keep the file
/// they mapped), then the links `<soname> -> <versioned file>` and `<name>.so -> <soname>`.
pub fn lay_out_libraries(lib: &Path, lib_src: &Path, driver_version: &str) -> io::Result<()> {
    if driver_version.is_empty() || driver_version.contains('/') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("driver version {driver_version:?} cannot name a file"),
        ));
    }
    std::fs::create_dir_all(lib)?;
    for l in library_files(driver_version) {
        let from = lib_src.join(l.src);
        let tmp = lib.join(format!(".{}.tmp", l.file));
        std::fs::copy(&from, &tmp)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", from.display())))?;
        std::fs::rename(&tmp, lib.join(&l.file))?;
        for (link, target) in [
            (l.soname.clone(), l.file),
            (format!("{}.so", l.name), l.soname),
        ] {
            let path = lib.join(&link);
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
            std::os::unix::fs::symlink(target, &path)?;
        }
    }
    Ok(())
}

/// One simulated GPU as the daemon describes it to its libraries.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct GpuDesc {
    pub index: u32,
    pub uuid: [u8; 16],
    pub name: String,
    pub memory_bytes: u64,
    pub pci_bus_id: String,
    /// Compute capability (major, minor).
    pub cc: (i32, i32),
    /// NVML architecture number (nvmlDeviceArchitecture_t).
    pub arch: u32,
    pub persistence: bool,
    /// MIG mode on (`nvmlDeviceGetMigMode`).
    #[serde(default)]
    pub mig: bool,
}

/// The node: its GPUs and the versions its driver reports.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct NodeDesc {
    /// `nvmlSystemGetDriverVersion`, e.g. "580.95.05".
    pub driver_version: String,
    /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
    pub cuda_version: i32,
    pub gpus: Vec<GpuDesc>,
}

/// How a node is configured: the `gpu-ckpt-simgpu serve` flags, whose defaults are
/// [`NodeConfig::default`]'s.
#[derive(Debug, Clone, clap::Args)]
pub struct NodeConfig {
    #[arg(long, default_value_t = 1)]
    pub gpus: u32,
    #[arg(long, default_value = DEFAULT_MODEL)]
    pub model: String,
    #[arg(long, default_value_t = 4096)]
    pub memory_mib: u64,
    #[arg(long, default_value = "580.95.05")]
    pub driver_version: String,
    /// cuDriverGetVersion's answer: 1000 × major + 10 × minor (12080, 13000, 13040).
    #[arg(long, default_value_t = 13000)]
    pub cuda_version: i32,
    #[arg(long, default_value = "gpu-ckpt-sim")]
    pub uuid_seed: String,
    /// Indices of the GPUs in MIG mode (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub mig_gpus: Vec<u32>,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            gpus: 1,
            model: DEFAULT_MODEL.to_string(),
            memory_mib: 4096,
            driver_version: "580.95.05".to_string(),
            cuda_version: 13000,
            uuid_seed: "gpu-ckpt-sim".to_string(),
            mig_gpus: Vec::new(),
        }
    }
}

pub const DEFAULT_MODEL: &str = "NVIDIA H100 80GB HBM3";

/// Compute capability and NVML architecture (7 Ampere, 8 Ada, 9 Hopper, 10 Blackwell) of the
/// models the simulator knows; anything else is reported as Hopper.
pub fn model_traits(model: &str) -> ((i32, i32), u32) {
    let m = model.to_ascii_uppercase();
    if m.contains("B200") || m.contains("GB200") || m.contains("B100") {
        ((10, 0), 10)
    } else if m.contains("L4") || m.contains("L40") || m.contains("4090") {
        ((8, 9), 8)
    } else if m.contains("A100") || m.contains("A30") {
        ((8, 0), 7)
    } else if m.contains("A10") || m.contains("A40") || m.contains("3090") {
        ((8, 6), 7)
    } else {
        ((9, 0), 9)
    }
}

/// A GPU UUID as NVML and nvidia-smi print it: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn format_uuid(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Parses `GPU-…` (or the bare 32 hex digits with or without dashes).
pub fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let s = s.trim();
    let s = s.strip_prefix("GPU-").unwrap_or(s);
    let hex: String = s.chars().filter(|c| *c != '-').collect();
    if hex.len() != 32 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// FNV-1a, then splitmix64: a stable UUID per (seed, index).
fn uuid_for(seed: &str, index: u32) -> [u8; 16] {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in seed.bytes().chain(index.to_le_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    let mut next = || {
        h = h.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = h;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut u = [0u8; 16];
    u[..8].copy_from_slice(&next().to_be_bytes());
    u[8..].copy_from_slice(&next().to_be_bytes());
    // RFC 4122 version 4 / variant bits, as real GPU UUIDs are formed.
    u[6] = (u[6] & 0x0f) | 0x40;
    u[8] = (u[8] & 0x3f) | 0x80;
    u
}

impl NodeConfig {
    /// The node this configuration describes.
    pub fn describe(&self) -> NodeDesc {
        let (cc, arch) = model_traits(&self.model);
        let gpus = (0..self.gpus)
            .map(|i| GpuDesc {
                index: i,
                uuid: uuid_for(&self.uuid_seed, i),
                name: self.model.clone(),
                memory_bytes: self.memory_mib * 1024 * 1024,
                pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + i * 0x10),
                cc,
                arch,
                persistence: true,
                mig: self.mig_gpus.contains(&i),
            })
            .collect();
        NodeDesc {
            driver_version: self.driver_version.clone(),
            cuda_version: self.cuda_version,
            gpus,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_stable_distinct_and_round_trip() {
        let a = NodeConfig {
            gpus: 2,
            ..Default::default()
        }
        .describe();
        let b = NodeConfig {
            gpus: 2,
            ..Default::default()
        }
        .describe();
        let c = NodeConfig {
            gpus: 2,
            uuid_seed: "other".into(),
            ..Default::default()
        }
        .describe();
        assert_eq!(a.gpus[0].uuid, b.gpus[0].uuid);
        assert_ne!(a.gpus[0].uuid, a.gpus[1].uuid);
        assert_ne!(a.gpus[0].uuid, c.gpus[0].uuid);
        let s = format_uuid(&a.gpus[1].uuid);
        assert!(s.starts_with("GPU-") && s.len() == 40, "{s}");
        assert_eq!(parse_uuid(&s), Some(a.gpus[1].uuid));
        assert_eq!(parse_uuid("GPU-xyz"), None);
    }
}
