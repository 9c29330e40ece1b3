//! Shared helpers: a sample checkpoint directory, a kubelet-style archive, raw tar building for
//! hostile cases.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use image_format::archive::{self, ArchiveSpec, ConfigDump, Member};
use image_format::manifest::{Container, Devices, Gpu, Manifest, Node, Workload};

pub fn gpu(i: u8, model: &str) -> Gpu {
    Gpu {
        uuid: format!("GPU-0000000{i}-1111-2222-3333-444444444444"),
        model: model.into(),
        architecture: "hopper".into(),
        memory_bytes: 80 << 30,
        pci_address: format!("00000000:{:02X}:00.0", 0x10 + i),
        free_bytes: None,
    }
}

pub fn devices(n: u8) -> Devices {
    Devices {
        driver_version: "580.65.06".into(),
        cuda_driver_version: "13.0".into(),
        gpus: (0..n).map(|i| gpu(i, "NVIDIA H100 80GB HBM3")).collect(),
        ..Devices::default()
    }
}

pub fn workload() -> Workload {
    Workload {
        engine_version: "vllm 0.11.0".into(),
        model_version: "Qwen3-8B@rev1".into(),
    }
}

pub fn sample_manifest() -> Manifest {
    Manifest::new(
        "2026-09-01T12:00:00Z",
        Container {
            id: "0123456789abcdef".into(),
            name: "counter".into(),
            pod_name: "counter-pod".into(),
            pod_namespace: "default".into(),
            pod_uid: String::new(),
            image: "localhost:5000/counter:1".into(),
            image_digest: format!("sha256:{}", "ab".repeat(32)),
            ..Default::default()
        },
        Node {
            hostname: "node-a".into(),
            kernel: "6.18.0".into(),
            criu: "4.1.1".into(),
            runc: "1.3.6".into(),
            shim: "0.1.0".into(),
        },
        devices(2),
        workload(),
    )
}

/// A flat checkpoint directory: a few CRIU-like images, a device state blob, and the manifest.
pub fn make_checkpoint_dir(dir: &Path) -> Manifest {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("inventory.img"), b"criu inventory").unwrap();
    std::fs::write(dir.join("core-1.img"), b"core of pid 1").unwrap();
    std::fs::write(dir.join("pages-1.img"), vec![7u8; 300_000]).unwrap();
    std::fs::write(dir.join("pagemap-1.img"), b"pagemap").unwrap();
    std::fs::write(dir.join("gpu-state-0.bin"), vec![0x5au8; 70_000]).unwrap();
    let mut m = sample_manifest();
    m.hash_dir(dir).unwrap();
    m.device_state.clear();
    m.add_device_state(
        dir,
        "gpu-state-0.bin",
        &m.devices.gpus[0].uuid.clone(),
        Some(1),
    )
    .unwrap();
    m.add_timing("device-lock", 1.5);
    m.add_timing("criu-dump", 120.0);
    m.write_to(dir).unwrap();
    m
}

pub fn spec_dump_containerd() -> serde_json::Value {
    serde_json::json!({
        "ociVersion": "1.2.0",
        "process": {"args": ["/bin/sh", "-c", "count"], "cwd": "/"},
        "root": {"path": "rootfs"},
        "annotations": {
            "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.container-name": "counter",
            "io.kubernetes.cri.sandbox-name": "counter-pod",
            "io.kubernetes.cri.sandbox-namespace": "default",
            "io.kubernetes.cri.image-name": "localhost:5000/counter:1"
        },
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}]
    })
}

pub fn config_dump() -> ConfigDump {
    ConfigDump {
        id: "0123456789abcdef".into(),
        name: "counter".into(),
        rootfs_image: "localhost:5000/counter:1".into(),
        rootfs_image_ref: format!("localhost:5000/counter@sha256:{}", "ab".repeat(32)),
        rootfs_image_name: "localhost:5000/counter:1".into(),
        runtime: "io.containerd.gpu-ckpt.v1".into(),
        created_time: "2026-09-01T11:00:00Z".into(),
        checkpointed_time: "2026-09-01T12:00:00Z".into(),
        extra: BTreeMap::new(),
    }
}

/// Build a complete containerd-2.1-style archive in `tmp`; returns its path.
pub fn make_archive(tmp: &Path) -> PathBuf {
    make_archive_signed(tmp, None)
}

/// [`make_archive`], its manifest signed by `key` where one is given.
pub fn make_archive_signed(tmp: &Path, key: Option<&image_format::sign::NodeKey>) -> PathBuf {
    let ck = tmp.join("ckdir");
    let mut m = make_checkpoint_dir(&ck);
    if let Some(key) = key {
        key.sign_manifest(&mut m).unwrap();
        m.write_to(&ck).unwrap();
    }
    let mut members = BTreeMap::new();
    members.insert("status".into(), Member::Bytes(b"{\"Pid\":1}".to_vec()));
    members.insert(
        "container.log".into(),
        Member::Bytes(b"2026-09-01 stdout F 1\n".to_vec()),
    );
    members.insert(
        "dump.log".into(),
        Member::Bytes(b"criu dump log\n".to_vec()),
    );
    members.insert("stats-dump".into(), Member::Bytes(vec![1, 2, 3, 4]));
    let diff = tmp.join("rootfs-diff.tar");
    std::fs::write(&diff, vec![0x1fu8; 5000]).unwrap();
    members.insert("rootfs-diff.tar".into(), Member::File(diff));
    let spec = ArchiveSpec {
        checkpoint_dir: Some(ck),
        config_dump: Some(config_dump()),
        spec_dump: Some(spec_dump_containerd()),
        status_dump: Some(
            serde_json::json!({"id": "0123456789abcdef", "state": "CONTAINER_RUNNING"}),
        ),
        members,
        mtime: 1_788_000_000,
    };
    let out = tmp.join("checkpoint-counter-pod_default-counter-2026-09-01T12:00:00Z.tar");
    archive::write_archive(&spec, &out).unwrap();
    out
}

/// Raw tar building, for archives the tar crate's safe API refuses to write.
pub struct RawTar {
    pub buf: Vec<u8>,
}

impl RawTar {
    pub fn new() -> Self {
        RawTar { buf: Vec::new() }
    }

    pub fn entry(
        &mut self,
        name: &[u8],
        kind: tar::EntryType,
        data: &[u8],
        link: Option<&[u8]>,
    ) -> &mut Self {
        self.entry_sized(name, kind, data, data.len() as u64, link)
    }

    /// An entry whose header declares `declared` bytes (data follows as given).
    pub fn entry_sized(
        &mut self,
        name: &[u8],
        kind: tar::EntryType,
        data: &[u8],
        declared: u64,
        link: Option<&[u8]>,
    ) -> &mut Self {
        let mut h = tar::Header::new_gnu();
        {
            let g = h.as_gnu_mut().unwrap();
            g.name[..name.len()].copy_from_slice(name);
            if let Some(l) = link {
                g.linkname[..l.len()].copy_from_slice(l);
            }
        }
        h.set_entry_type(kind);
        h.set_size(declared);
        h.set_mode(0o600);
        h.set_mtime(0);
        h.set_cksum();
        self.buf.extend_from_slice(h.as_bytes());
        self.buf.extend_from_slice(data);
        let pad = (512 - data.len() % 512) % 512;
        self.buf.extend(std::iter::repeat_n(0u8, pad));
        self
    }

    pub fn file(&mut self, name: &str, data: &[u8]) -> &mut Self {
        self.entry(name.as_bytes(), tar::EntryType::Regular, data, None)
    }

    pub fn finish(&mut self) -> Vec<u8> {
        let mut v = self.buf.clone();
        v.extend_from_slice(&[0u8; 1024]);
        v
    }
}

/// Every path under `root` (relative), sorted.
pub fn tree(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    fn walk(base: &Path, p: &Path, out: &mut Vec<String>) {
        if let Ok(rd) = std::fs::read_dir(p) {
            for e in rd.flatten() {
                let path = e.path();
                out.push(path.strip_prefix(base).unwrap().display().to_string());
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    walk(base, &path, out);
                }
            }
        }
    }
    walk(root, root, &mut out);
    out.sort();
    out
}

/// The test stack's checkpointctl (the reference reader of checkpoint archives; `make deps`
/// installs it in .stack/bin) or $GPU_CKPT_CHECKPOINTCTL; a test fails, not skips, without it.
pub fn checkpointctl() -> PathBuf {
    let p = std::env::var_os("GPU_CKPT_CHECKPOINTCTL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.stack/bin/checkpointctl")
        });
    assert!(
        p.is_file(),
        "checkpointctl not found at {}: run `make deps` (test-containers/stack/install.sh) or set GPU_CKPT_CHECKPOINTCTL",
        p.display()
    );
    p
}
