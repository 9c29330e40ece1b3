//! Archive round trip, CRI-O reading, manifest round trip and versions, compat, OCI image and back.

mod common;

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;

use common::*;
use image_format::archive::{self, Engine, ExtractOptions};
use image_format::compat::{self, Profile};
use image_format::digest::{no_progress, PageDigests};
use image_format::manifest::{self, Manifest, MANIFEST_FILE};
use image_format::oci::{self, BuildOptions};
use image_format::safe::Limits;
use image_format::Error;

fn entries_of(path: &std::path::Path) -> BTreeMap<String, Vec<u8>> {
    let mut ar = tar::Archive::new(std::fs::File::open(path).unwrap());
    let mut out = BTreeMap::new();
    for e in ar.entries().unwrap() {
        let mut e = e.unwrap();
        let name = String::from_utf8(e.path_bytes().into_owned()).unwrap();
        let mut d = Vec::new();
        e.read_to_end(&mut d).unwrap();
        out.insert(name, d);
    }
    out
}

#[test]
fn archive_round_trip() {
    let tmp = tempfile::tempdir().unwrap();
    let a = make_archive(tmp.path());
    let mode = std::fs::metadata(&a).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "archive must be root-only");
    let names: Vec<String> = entries_of(&a).into_keys().collect();
    for want in [
        "checkpoint/",
        "checkpoint/gpu-ckpt-manifest.json",
        "checkpoint/pages-1.img",
        "config.dump",
        "spec.dump",
        "status.dump",
        "status",
        "container.log",
        "dump.log",
        "stats-dump",
        "rootfs-diff.tar",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "missing {want} in {names:?}"
        );
    }
    let info = archive::read_info(&a, Limits::default()).unwrap();
    assert_eq!(info.engine(), Engine::Containerd);
    assert_eq!(
        info.identity(),
        ("counter".into(), "counter-pod".into(), "default".into())
    );
    assert_eq!(info.config_dump.as_ref().unwrap(), &config_dump());
    assert_eq!(info.sizes.memory_pages_size, 300_000);
    assert_eq!(info.sizes.root_fs_diff_size, 5000);
    let m = info.manifest.unwrap();
    assert_eq!(m.devices.gpus.len(), 2);
    assert!(!m.files.contains_key(MANIFEST_FILE));

    // Extract and compare byte for byte with the source directory.
    let t = tmp.path().join("x");
    let ents = archive::extract_archive(
        &a,
        &t,
        ExtractOptions {
            limits: Limits::default(),
            verify: true,
        },
        &mut no_progress,
    )
    .unwrap();
    assert_eq!(ents.len(), names.len());
    for name in ["pages-1.img", "gpu-state-0.bin", MANIFEST_FILE] {
        assert_eq!(
            std::fs::read(t.join("checkpoint").join(name)).unwrap(),
            std::fs::read(tmp.path().join("ckdir").join(name)).unwrap()
        );
    }
    manifest::verify_dir(&t.join("checkpoint")).unwrap();
    let r = archive::verify_archive(&a, Limits::default(), &mut no_progress).unwrap();
    assert_eq!(r.files_verified, 5);
    // Members the manifest does not cover are reported with their sha256 only.
    let diff = &r.uncovered["rootfs-diff.tar"];
    let bytes = std::fs::read(tmp.path().join("rootfs-diff.tar")).unwrap();
    assert_eq!(diff.sha256, image_format::digest::sha256_hex(&bytes));
    assert_eq!((diff.size, diff.blake3.as_str()), (5000, ""));
}

/// CRIU's statistics at the archive's top level (where containerd's CRI puts them and
/// checkpointctl's `inspect --stats` reads them) are checked against `checkpoint/stats-dump`'s
/// manifest entry: the copy verifies, a changed copy is refused by verify and by a verifying
/// extract.
#[test]
fn the_top_level_stats_dump_is_covered_by_the_manifest() {
    let tmp = tempfile::tempdir().unwrap();
    let stats = b"\x6b\x5e\x30\x51 criu dump statistics".to_vec();
    let ck = tmp.path().join("ckdir");
    std::fs::create_dir_all(&ck).unwrap();
    std::fs::write(ck.join("stats-dump"), &stats).unwrap();
    let m = make_checkpoint_dir(&ck);
    assert!(m.files.contains_key("stats-dump"));
    let write = |copy: &[u8], name: &str| {
        let mut members = BTreeMap::new();
        members.insert(
            "stats-dump".to_string(),
            archive::Member::Bytes(copy.to_vec()),
        );
        let spec = archive::ArchiveSpec {
            checkpoint_dir: Some(ck.clone()),
            config_dump: Some(config_dump()),
            spec_dump: Some(spec_dump_containerd()),
            members,
            mtime: 1_788_000_000,
            ..Default::default()
        };
        let out = tmp.path().join(name);
        archive::write_archive(&spec, &out).unwrap();
        out
    };
    let good = write(&stats, "good.tar");
    let r = archive::verify_archive(&good, Limits::default(), &mut no_progress).unwrap();
    assert_eq!(r.files_verified, m.files.len() + 1);
    assert!(!r.uncovered.contains_key("stats-dump"), "{:?}", r.uncovered);
    assert!(r.uncovered.contains_key("spec.dump"));

    let mut changed = stats.clone();
    changed[5] ^= 1;
    let bad = write(&changed, "bad.tar");
    let err = archive::verify_archive(&bad, Limits::default(), &mut no_progress).unwrap_err();
    assert!(
        matches!(&err, Error::DigestMismatch { name, .. } if name == "stats-dump (the archive's top-level copy of checkpoint/stats-dump)"),
        "{err}"
    );
    let err = archive::extract_archive(
        &bad,
        &tmp.path().join("x"),
        ExtractOptions {
            limits: Limits::default(),
            verify: true,
        },
        &mut no_progress,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("top-level copy of checkpoint/stats-dump"),
        "{err}"
    );
    let longer = write(&[&stats[..], b"!"].concat(), "longer.tar");
    let err = archive::verify_archive(&longer, Limits::default(), &mut no_progress).unwrap_err();
    assert!(matches!(err, Error::SizeMismatch { .. }), "{err}");
}

#[test]
fn reads_a_crio_archive() {
    let spec = serde_json::json!({
        "ociVersion": "1.0.2",
        "annotations": {
            "io.container.manager": "cri-o",
            "io.kubernetes.cri-o.Metadata": "{\"name\":\"counter\",\"attempt\":0}",
            "io.kubernetes.pod.name": "counters",
            "io.kubernetes.pod.namespace": "default",
            "io.kubernetes.cri-o.Created": "2026-09-01T11:00:00Z"
        }
    });
    let config = serde_json::json!({
        "id": "f11d11844af0", "name": "k8s_counter_counters_default_0", "rootfsImageName": "quay.io/x/counter:latest",
        "runtime": "crun", "createdTime": "2026-09-01T11:00:00.123456789Z", "checkpointedTime": "2026-09-01T12:00:00Z",
        "restoreLabel": "x"
    });
    let data = RawTar::new()
        .entry(b"checkpoint/", tar::EntryType::Directory, b"", None)
        .file("checkpoint/inventory.img", b"inv")
        .file("checkpoint/pages-1.img", &[1u8; 4096])
        .file(
            "config.dump",
            serde_json::to_string(&config).unwrap().as_bytes(),
        )
        .file(
            "spec.dump",
            serde_json::to_string(&spec).unwrap().as_bytes(),
        )
        .file("bind.mounts", b"[]")
        .file("deleted.files", b"[\"/tmp/x\"]")
        .file("rootfs-diff.tar", &[0u8; 1024])
        .finish();
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("crio.tar");
    std::fs::write(&p, data).unwrap();
    let info = archive::read_info(&p, Limits::default()).unwrap();
    assert_eq!(info.engine(), Engine::CriO);
    assert_eq!(
        info.identity(),
        ("counter".into(), "counters".into(), "default".into())
    );
    let c = info.config_dump.as_ref().unwrap();
    assert_eq!(c.runtime, "crun");
    assert!(c.extra.contains_key("restoreLabel"));
    assert!(info.manifest.is_none());
    assert!(info.status_dump.is_none());
    assert_eq!(info.sizes.memory_pages_size, 4096);
    // Not taken by gpu-ckpt: verify says the manifest is missing.
    let e = archive::verify_archive(&p, Limits::default(), &mut no_progress).unwrap_err();
    assert_eq!(
        e.to_string(),
        "archive has no \"checkpoint/gpu-ckpt-manifest.json\""
    );
}

#[test]
fn manifest_round_trip_and_versions() {
    let tmp = tempfile::tempdir().unwrap();
    let m = make_checkpoint_dir(tmp.path());
    let path = tmp.path().join(MANIFEST_FILE);
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let back = Manifest::read_from(tmp.path()).unwrap();
    assert_eq!(back, m);
    assert_eq!(back.schema_version, manifest::SCHEMA_VERSION);
    assert!(back.schema.ends_with("/v2.json"), "{}", back.schema);
    assert_eq!(back.kind, manifest::MANIFEST_KIND);
    assert_eq!(back.files.len(), 5);
    assert!(!back.files.contains_key(MANIFEST_FILE));
    assert_eq!(back.device_state[0].size, 70_000);
    assert_eq!(manifest::hash_dir_flat(tmp.path()).unwrap(), back.files);
    assert_eq!(manifest::verify_dir(tmp.path()).unwrap(), m);

    let mut v: serde_json::Value = serde_json::from_slice(&m.to_json()).unwrap();
    v["schema_version"] = 3.into();
    let e = Manifest::from_json(&serde_json::to_vec(&v).unwrap(), "m.json").unwrap_err();
    assert!(matches!(e, Error::UnsupportedSchema { .. }));
    assert_eq!(
        e.to_string(),
        "manifest m.json: unsupported schema_version 3 (this build reads major versions 1 to 2)"
    );
    for bad in [
        serde_json::json!(0),
        serde_json::json!("2"),
        serde_json::json!(2.5),
    ] {
        v["schema_version"] = bad.clone();
        assert!(
            matches!(
                Manifest::from_json(&serde_json::to_vec(&v).unwrap(), "m.json").unwrap_err(),
                Error::UnsupportedSchema { .. }
            ),
            "{bad}"
        );
    }
    v["schema_version"] = 2.into();
    v["kind"] = "something-else".into();
    let e = Manifest::from_json(&serde_json::to_vec(&v).unwrap(), "m.json").unwrap_err();
    assert!(e.to_string().contains("field \"kind\""), "{e}");
    // Unknown fields within a major version are ignored (minor additions).
    v["kind"] = manifest::MANIFEST_KIND.into();
    v["future_field"] = 1.into();
    assert!(Manifest::from_json(&serde_json::to_vec(&v).unwrap(), "m.json").is_ok());
    // A manifest that lists a path-like name is refused.
    v["files"]["../x"] = serde_json::json!({"size": 1, "sha256": "00".repeat(32)});
    let e = Manifest::from_json(&serde_json::to_vec(&v).unwrap(), "m.json").unwrap_err();
    assert!(e.to_string().contains("\"../x\""), "{e}");
}

#[test]
fn verify_dir_names_the_first_mismatch_and_flatness_is_enforced() {
    let tmp = tempfile::tempdir().unwrap();
    make_checkpoint_dir(tmp.path());
    std::fs::write(tmp.path().join("pages-1.img"), vec![8u8; 300_000]).unwrap();
    let e = manifest::verify_dir(tmp.path()).unwrap_err();
    assert!(
        matches!(&e, Error::DigestMismatch { name, .. } if name == "pages-1.img"),
        "{e}"
    );
    std::fs::remove_file(tmp.path().join("core-1.img")).unwrap();
    let e = manifest::verify_dir(tmp.path()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "file \"core-1.img\": listed in the manifest but missing"
    );
    std::fs::create_dir(tmp.path().join("sub")).unwrap();
    let e = manifest::hash_dir_flat(tmp.path()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "checkpoint directory entry \"sub\": subdirectories are not allowed"
    );
    std::fs::remove_dir(tmp.path().join("sub")).unwrap();
    std::fs::hard_link(tmp.path().join("inventory.img"), tmp.path().join("hl.img")).unwrap();
    let e = manifest::hash_dir_flat(tmp.path()).unwrap_err();
    assert!(e.to_string().contains("hard links are not allowed"), "{e}");
}

fn node_like_checkpoint() -> Profile {
    Profile::from_manifest(&sample_manifest())
}

#[test]
fn compat_identical_node_and_each_single_difference() {
    let ck = node_like_checkpoint();
    let v = compat::check(&ck, &ck.clone());
    assert!(v.compatible && v.differences.is_empty());
    assert_eq!(v.gpu_map.len(), 2);
    assert_eq!(v.remapped().count(), 0);

    let one = |f: &dyn Fn(&mut Profile), field: &str| {
        let mut n = ck.clone();
        f(&mut n);
        let v = compat::check(&ck, &n);
        assert!(!v.compatible, "{field}: should be incompatible");
        let fields: Vec<&str> = v.differences.iter().map(|d| d.field.as_str()).collect();
        assert_eq!(fields, vec![field], "{field}");
        assert!(v.gpu_map.is_empty());
        v
    };
    let v = one(
        &|n| n.devices.gpus[1].model = "NVIDIA A100-SXM4-80GB".into(),
        "gpu_model",
    );
    assert_eq!(v.differences[0].gpu, Some(1));
    assert!(v.differences[0]
        .to_string()
        .contains("NVIDIA A100-SXM4-80GB"));
    one(
        &|n| n.devices.gpus.push(gpu(2, "NVIDIA H100 80GB HBM3")),
        "gpu_count",
    );
    one(
        &|n| {
            n.devices.gpus.pop();
        },
        "gpu_count",
    );
    one(
        &|n| n.devices.driver_version = "590.44.01".into(),
        "driver_version",
    );
    one(
        &|n| n.devices.cuda_driver_version = "13.1".into(),
        "cuda_driver_version",
    );
    one(
        &|n| n.workload.engine_version = "vllm 0.12.0".into(),
        "engine_version",
    );
    one(
        &|n| n.workload.model_version = "Qwen3-8B@rev2".into(),
        "model_version",
    );
    one(&|n| n.workload.model_version.clear(), "model_version");
    one(&|n| n.devices.gpus[0].memory_bytes = 40 << 30, "gpu_memory");
    // A patch release of the same driver branch is compatible.
    let mut n = ck.clone();
    n.devices.driver_version = "580.95.05".into();
    assert!(compat::check(&ck, &n).compatible);
    // The checkpoint's processes need room on the node's GPUs.
    let mut held = ck.clone();
    held.devices.processes = vec![image_format::manifest::DeviceProcess {
        pid: 7,
        gpus: vec![image_format::manifest::ProcessGpu {
            uuid: held.devices.gpus[1].uuid.clone(),
            bytes: 3 << 30,
        }],
    }];
    let mut n = ck.clone();
    n.devices.gpus[1].free_bytes = Some(2 << 30);
    let v = compat::check(&held, &n);
    let fields: Vec<&str> = v.differences.iter().map(|d| d.field.as_str()).collect();
    assert_eq!(fields, vec!["gpu_free_memory"]);
    assert_eq!(v.differences[0].gpu, Some(1));
    n.devices.gpus[1].free_bytes = Some(4 << 30);
    assert!(compat::check(&held, &n).compatible);

    // Different UUIDs (and PCI addresses) are fine and yield a remap.
    let mut n = ck.clone();
    for (i, g) in n.devices.gpus.iter_mut().enumerate() {
        g.uuid = format!("GPU-ffffffff-0000-0000-0000-00000000000{i}");
        g.pci_address = format!("00000000:9{i}:00.0");
    }
    let v = compat::check(&ck, &n);
    assert!(v.compatible);
    let pairs: Vec<_> = v.remapped().collect();
    assert_eq!(pairs.len(), 2);
    assert_eq!(pairs[0].old_uuid, ck.devices.gpus[0].uuid);
    assert_eq!(
        pairs[0].new_uuid,
        "GPU-ffffffff-0000-0000-0000-000000000000"
    );
}

#[test]
fn oci_image_from_archive_and_back() {
    let tmp = tempfile::tempdir().unwrap();
    let a = make_archive(tmp.path());
    let opts = BuildOptions {
        reference: "localhost:5000/ckpt/counter:1".into(),
        limits: Limits::default(),
    };
    let layout = tmp.path().join("layout");
    let b1 = oci::build_layout(&a, &layout, &opts, &mut no_progress).unwrap();
    let tarball = tmp.path().join("image.tar");
    let b2 = oci::build_tarball(&a, &tarball, &opts, &mut no_progress).unwrap();
    assert_eq!(
        b1.manifest_digest, b2.manifest_digest,
        "layout and tarball hold the same image"
    );
    let archive_sha = image_format::digest::hash_file(&a, &mut no_progress)
        .unwrap()
        .0;
    assert_eq!(b1.layer.digest, format!("sha256:{archive_sha}"));
    assert_eq!(b1.layer.media_type, oci::MEDIA_LAYER_TAR);
    let ann = &b1.manifest.annotations;
    assert_eq!(ann[oci::ANN_CONTAINERD_NAME], "counter");
    assert_eq!(ann[oci::ANN_CRIO_NAME], "counter");
    assert_eq!(ann["gpu-ckpt.io/engine-version"], "vllm 0.11.0");
    assert_eq!(ann["gpu-ckpt.io/model-version"], "Qwen3-8B@rev1");
    assert_eq!(ann["gpu-ckpt.io/driver-version"], "580.65.06");
    assert_eq!(ann["gpu-ckpt.io/cuda-driver-version"], "13.0");
    assert_eq!(ann["gpu-ckpt.io/gpu-count"], "2");
    for f in ["oci-layout", "index.json"] {
        assert_eq!(
            std::fs::metadata(layout.join(f))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o600
        );
    }
    assert_eq!(
        std::fs::metadata(&tarball).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let idx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    assert_eq!(
        idx["manifests"][0]["annotations"]["io.containerd.image.name"],
        "localhost:5000/ckpt/counter:1"
    );
    assert_eq!(
        idx["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"],
        "1"
    );

    // The tarball is a valid tar whose members are exactly the layout's files.
    let t = entries_of(&tarball);
    assert!(t.contains_key("oci-layout") && t.contains_key("index.json"));
    assert_eq!(
        t[&format!("blobs/sha256/{archive_sha}")],
        std::fs::read(&a).unwrap()
    );

    // Compatibility from the manifest alone.
    for img in [&layout, &tarball] {
        assert!(oci::is_image(img));
        let p = oci::image_profile(img).unwrap().unwrap();
        assert_eq!(p, node_like_checkpoint());
        assert!(compat::check(&p, &node_like_checkpoint()).compatible);
    }
    assert!(!oci::is_image(&a));

    // And back: byte-identical archive.
    for (i, img) in [&layout, &tarball].iter().enumerate() {
        let out = tmp.path().join(format!("back{i}.tar"));
        oci::extract_archive_from_image(img, &out, Limits::default(), &mut no_progress).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&a).unwrap());
    }

    // A corrupted layer blob is caught by digest.
    let blob = layout.join("blobs/sha256").join(&archive_sha);
    let mut d = std::fs::read(&blob).unwrap();
    d[600] ^= 1;
    std::fs::write(&blob, d).unwrap();
    let e = oci::extract_archive_from_image(
        &layout,
        &tmp.path().join("bad.tar"),
        Limits::default(),
        &mut no_progress,
    )
    .unwrap_err();
    assert!(matches!(e, Error::DigestMismatch { .. }), "{e}");
    assert!(!tmp.path().join("bad.tar").exists());
}

#[test]
fn build_refuses_a_hostile_archive() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("h.tar");
    std::fs::write(&p, RawTar::new().file("../x", b"1").finish()).unwrap();
    let opts = BuildOptions {
        reference: "localhost:5000/x:1".into(),
        limits: Limits::default(),
    };
    let e = oci::build_tarball(&p, &tmp.path().join("o.tar"), &opts, &mut no_progress).unwrap_err();
    assert!(matches!(e, Error::PathTraversal { .. }));
    assert!(!tmp.path().join("o.tar").exists());
}

#[test]
fn references_split() {
    use image_format::reference::ImageRef;
    let r = ImageRef::parse("localhost:5000/ckpt/counter:1").unwrap();
    assert_eq!(
        (r.registry(), r.repository(), r.tag()),
        ("localhost:5000", "ckpt/counter", Some("1"))
    );
    assert_eq!(
        ImageRef::parse("localhost:5000/c")
            .unwrap()
            .manifest_reference(),
        "latest"
    );
    assert!(ImageRef::parse("nohost").is_err());
}

#[test]
fn page_images_are_named_pages_n_img() {
    for yes in ["pages-1.img", "pages-12.img"] {
        assert!(manifest::is_page_image(yes), "{yes}");
    }
    for no in [
        "pages-.img",
        "pages-1.img.tmp",
        "pagemap-1.img",
        "pages-a.img",
        "core-1.img",
    ] {
        assert!(!manifest::is_page_image(no), "{no}");
    }
}

#[test]
fn staged_verify_defers_page_digests_but_checks_sizes_first() {
    use std::sync::atomic::AtomicBool;
    let tmp = tempfile::tempdir().unwrap();
    let m = make_checkpoint_dir(tmp.path());
    let defer = |n: &str| manifest::is_page_image(n);
    let (back, deferred) =
        manifest::verify_dir_staged(tmp.path(), &defer, &mut no_progress).unwrap();
    assert_eq!(back, m);
    assert_eq!(deferred.bytes(), m.files["pages-1.img"].size);
    deferred.verify(&AtomicBool::new(false)).unwrap();

    // Same size, other bytes: the first stage passes, the deferred one names the file.
    let pages = tmp.path().join("pages-1.img");
    let size = std::fs::metadata(&pages).unwrap().len() as usize;
    std::fs::write(&pages, vec![0x5au8; size]).unwrap();
    let (_, deferred) = manifest::verify_dir_staged(tmp.path(), &defer, &mut no_progress).unwrap();
    let e = deferred.verify(&AtomicBool::new(false)).unwrap_err();
    assert!(
        matches!(&e, Error::DigestMismatch { name, .. } if name == "pages-1.img"),
        "{e}"
    );
    let e = deferred.verify(&AtomicBool::new(true)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "file \"pages-1.img\": verification cancelled"
    );
    // A truncated page image never gets past the first stage.
    std::fs::write(&pages, vec![0x5au8; size - 1]).unwrap();
    let e = manifest::verify_dir_staged(tmp.path(), &defer, &mut no_progress).unwrap_err();
    assert!(
        matches!(&e, Error::SizeMismatch { name, .. } if name == "pages-1.img"),
        "{e}"
    );
    // Nor does a tampered file that is not deferred.
    std::fs::write(&pages, vec![0x5au8; size]).unwrap();
    let core = tmp.path().join("core-1.img");
    let core_len = std::fs::metadata(&core).unwrap().len() as usize;
    std::fs::write(&core, vec![1u8; core_len]).unwrap();
    let e = manifest::verify_dir_staged(tmp.path(), &defer, &mut no_progress).unwrap_err();
    assert!(
        matches!(&e, Error::DigestMismatch { name, .. } if name == "core-1.img"),
        "{e}"
    );
}

#[test]
fn append_hasher_follows_a_file_while_it_is_written() {
    use std::io::Write;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    // Present before: never followed, even though it matches.
    std::fs::write(dir.join("pages-9.img"), b"old").unwrap();
    let skip = [String::from("pages-9.img")].into_iter().collect();
    let mut h =
        manifest::AppendHasher::new(&dir, manifest::is_page_image, skip, PageDigests::Blake3);
    let writer = std::thread::spawn({
        let dir = dir.clone();
        move || {
            let mut f = std::fs::File::create(dir.join("pages-1.img")).unwrap();
            std::fs::write(dir.join("core-1.img"), b"not followed").unwrap();
            for i in 0..64u32 {
                f.write_all(&vec![(i % 251) as u8; 64 * 1024 + i as usize])
                    .unwrap();
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    });
    let mut while_writing = 0;
    while !writer.is_finished() {
        while_writing += h.poll().unwrap();
    }
    writer.join().unwrap();
    // A file that appears and is then truncated is not trusted.
    std::fs::write(dir.join("pages-2.img"), vec![7u8; 1000]).unwrap();
    h.poll().unwrap();
    std::fs::write(dir.join("pages-2.img"), vec![7u8; 10]).unwrap();
    let followed = h.finish().unwrap();
    assert!(while_writing > 0, "nothing was hashed while the file grew");
    assert_eq!(
        followed.keys().collect::<Vec<_>>(),
        vec!["pages-1.img"],
        "only the grown page image is trusted"
    );
    let full = manifest::hash_dir_flat(&dir).unwrap();
    assert_eq!(followed["pages-1.img"], full["pages-1.img"]);
    let merged =
        manifest::hash_dir_flat_with(&dir, followed, PageDigests::Blake3, &mut no_progress)
            .unwrap();
    assert_eq!(merged, full);
    // A digest whose size no longer matches is hashed again.
    let stale = [(
        "core-1.img".to_string(),
        manifest::FileDigest {
            size: 1,
            sha256: "00".repeat(32),
            blake3: "00".repeat(32),
        },
    )]
    .into_iter()
    .collect();
    assert_eq!(
        manifest::hash_dir_flat_with(&dir, stale, PageDigests::Blake3, &mut no_progress).unwrap(),
        full
    );
}

#[test]
fn follow_until_ends_when_the_writer_is_done_not_at_the_next_poll() {
    use std::io::Write;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let done = std::sync::Arc::new(manifest::WriterDone::default());
    // A poll interval far longer than the test: only the wake-up can end the follow in time.
    let idle = std::time::Duration::from_secs(600);
    let follower = std::thread::spawn({
        let (dir, done) = (dir.clone(), done.clone());
        move || {
            manifest::AppendHasher::new(
                &dir,
                manifest::is_page_image,
                [].into(),
                Default::default(),
            )
            .follow_until(&done, idle)
        }
    });
    let mut f = std::fs::File::create(dir.join("pages-1.img")).unwrap();
    f.write_all(&[5u8; 100_000]).unwrap();
    // Let the follower find nothing new and start waiting.
    std::thread::sleep(std::time::Duration::from_millis(200));
    f.write_all(&[6u8; 1000]).unwrap();
    let t = std::time::Instant::now();
    done.set();
    let followed = follower.join().unwrap().unwrap();
    assert!(
        t.elapsed() < std::time::Duration::from_secs(60),
        "{:?}",
        t.elapsed()
    );
    // What was written after the follower began waiting is hashed too.
    let full = manifest::hash_dir_flat(&dir).unwrap();
    assert_eq!(followed["pages-1.img"], full["pages-1.img"]);
    assert_eq!(followed["pages-1.img"].size, 101_000);
}

#[test]
fn files_are_recorded_with_blake3_and_sha256_but_page_images_with_blake3_only() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let m = make_checkpoint_dir(dir);
    for (name, d) in &m.files {
        let bytes = std::fs::read(dir.join(name)).unwrap();
        assert_eq!(d.blake3, blake3::hash(&bytes).to_hex().as_str(), "{name}");
        if manifest::is_page_image(name) {
            assert_eq!(d.sha256, "", "{name}");
        } else {
            assert_eq!(d.sha256, image_format::digest::sha256_hex(&bytes), "{name}");
        }
    }
    // Asked for (the shim's Sha256PageImages), the page images get a sha256 as well, whether
    // hashed in full or followed.
    let pages = std::fs::read(dir.join("pages-1.img")).unwrap();
    let both = PageDigests::Sha256AndBlake3;
    let full = manifest::hash_dir_flat_with(dir, BTreeMap::new(), both, &mut no_progress).unwrap();
    let mut follow = manifest::AppendHasher::new(dir, manifest::is_page_image, [].into(), both);
    follow.poll().unwrap();
    let followed = follow.finish().unwrap();
    for d in [&full["pages-1.img"], &followed["pages-1.img"]] {
        assert_eq!(d.sha256, image_format::digest::sha256_hex(&pages));
        assert_eq!(d.blake3, m.files["pages-1.img"].blake3);
    }
    assert_eq!(full["core-1.img"], m.files["core-1.img"]);
    let text = String::from_utf8(m.to_json()).unwrap();
    let pages: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        pages["files"]["pages-1.img"]
            .as_object()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        ["blake3", "size"],
        "{text}"
    );
    // A wrong BLAKE3 next to a right sha256 is refused: BLAKE3 is the digest checked, now and
    // deferred.
    let mut wrong = m.clone();
    wrong.files.get_mut("pages-1.img").unwrap().blake3 = "ab".repeat(32);
    wrong.files.get_mut("core-1.img").unwrap().blake3 = "cd".repeat(32);
    wrong.write_to(dir).unwrap();
    let e = manifest::verify_dir(dir).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("file \"core-1.img\": blake3 mismatch: manifest says cdcd"),
        "{e}"
    );
    wrong.files.get_mut("core-1.img").unwrap().blake3 = m.files["core-1.img"].blake3.clone();
    wrong.write_to(dir).unwrap();
    let (_, deferred) =
        manifest::verify_dir_staged(dir, &manifest::is_page_image, &mut no_progress).unwrap();
    let e = deferred
        .verify(&std::sync::atomic::AtomicBool::new(false))
        .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("file \"pages-1.img\": blake3 mismatch"),
        "{e}"
    );
    // A version 1 manifest without BLAKE3 (as written before gpu-ckpt recorded it) is verified
    // with sha256, and a changed byte is still found.
    let mut old = m.clone();
    old.schema_version = 1;
    for (name, d) in old.files.iter_mut() {
        d.sha256 = image_format::digest::sha256_hex(&std::fs::read(dir.join(name)).unwrap());
        d.blake3.clear();
    }
    old.write_to(dir).unwrap();
    let text = std::fs::read_to_string(dir.join(MANIFEST_FILE)).unwrap();
    assert!(!text.contains("blake3"), "{text}");
    manifest::verify_dir(dir).unwrap();
    let mut pages = std::fs::read(dir.join("pages-1.img")).unwrap();
    pages[1000] ^= 1;
    std::fs::write(dir.join("pages-1.img"), &pages).unwrap();
    let e = manifest::verify_dir(dir).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("file \"pages-1.img\": sha256 mismatch"),
        "{e}"
    );
    // A BLAKE3 field that is not a digest is refused when the manifest is read.
    let mut json: serde_json::Value = serde_json::from_slice(&m.to_json()).unwrap();
    json["files"]["pages-1.img"]["blake3"] = "XYZ".into();
    let e = Manifest::from_json(&serde_json::to_vec(&json).unwrap(), "m.json").unwrap_err();
    assert!(e.to_string().contains("files.pages-1.img.blake3"), "{e}");
    // An entry with no digest at all is refused, and so is one without sha256 in version 1,
    // which lists one for every file.
    let obj = json["files"]["pages-1.img"].as_object_mut().unwrap();
    obj.remove("blake3");
    let e = Manifest::from_json(&serde_json::to_vec(&json).unwrap(), "m.json").unwrap_err();
    assert!(
        e.to_string().contains("files.pages-1.img.sha256") && e.to_string().contains("missing"),
        "{e}"
    );
    json["files"]["pages-1.img"]["blake3"] = m.files["pages-1.img"].blake3.clone().into();
    Manifest::from_json(&serde_json::to_vec(&json).unwrap(), "m.json").unwrap();
    json["schema_version"] = 1.into();
    let e = Manifest::from_json(&serde_json::to_vec(&json).unwrap(), "m.json").unwrap_err();
    assert!(
        e.to_string().contains("files.pages-1.img.sha256") && e.to_string().contains("missing"),
        "{e}"
    );
    // A device state blob may not take a page image's name (it would have no sha256).
    let mut m2 = m.clone();
    let e = m2
        .add_device_state(dir, "pages-1.img", "GPU-0", None)
        .unwrap_err();
    assert!(e.to_string().contains("CRIU page image"), "{e}");
}
