//! Checkpoint and restore as Kubernetes drives them: CRI CheckpointContainer (kubelet's
//! checkpoint endpoint), checkpointctl on the archive, and restore on a second, independent
//! containerd through containerd's restore-via-create and through the gpu-ckpt-restore
//! RuntimeClass, from the archive and from an OCI checkpoint image in the registry.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use crate::common;
use crate::common::*;
use anyhow::{ensure, Context, Result};
use test_containers::{
    cri::{ContainerSpec, Cri, Pod, PodSpec},
    stack::{Node, GPU_CKPT_HANDLER},
};

/// Checkpoints a running counter through CRI on `node`; returns the archive and the counter
/// values read just before and just after the checkpoint.
async fn checkpoint_counter(node: &Node, cri: &Cri) -> Result<(PathBuf, u64, u64, Pod, String)> {
    let (pod, id) = cri_counter_pod(cri, node, "worker").await?;
    let before = common::cri_counter_above(cri, &id, "/counter.txt", 5).await?;
    let archive = node
        .paths()
        .dir
        .join("checkpoint-worker_default-counter.tar");
    let _ = std::fs::remove_file(&archive);
    cri.checkpoint_container(&id, &archive, 60).await?;
    let after = common::cri_counter(cri, &id, "/counter.txt").await?;
    Ok((archive, before, after, pod, id))
}

/// Runs `spec` in a new pod `pod` on `cri` (a restore of the counter checkpointed between the
/// values `before` and `after`) and checks that it continues: its first value lies in that
/// range and it counts on. Removes the pod.
async fn expect_restored_counter(
    cri: &Cri,
    pod: &PodSpec,
    spec: &ContainerSpec,
    (before, after): (u64, u64),
    what: &str,
) -> Result<()> {
    let pod = cri.run_pod(pod).await?;
    let id = cri.run_container(&pod, spec).await?;
    let first = common::cri_counter(cri, &id, "/counter.txt").await?;
    ensure!(
        first >= before && first <= after + 2,
        "{what} started at {first}, checkpoint was between {before} and {after}"
    );
    common::cri_counter_above(cri, &id, "/counter.txt", first).await?;
    cri.remove_pod(&pod).await
}

fn checkpointctl(node: &Node, args: &[&str]) -> Result<String> {
    run_ok(std::process::Command::new(node.stack().checkpointctl_bin()).args(args))
}

#[test]
fn cri_checkpoint_keeps_running_and_checkpointctl_reads_it() -> Result<()> {
    let node = node("cri-ck")?;
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let (archive, _before, after, pod, id) = checkpoint_counter(&node, &cri).await?;
        // The container keeps running after the checkpoint.
        common::cri_counter_above(&cri, &id, "/counter.txt", after).await?;
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&archive)?.permissions().mode() & 0o777;
        ensure!(mode & 0o077 == 0, "archive mode {mode:o}");

        let text = checkpointctl(&node, &["inspect", &archive.display().to_string()])?;
        ensure!(
            text.contains("counter"),
            "checkpointctl does not show the container:\n{text}"
        );
        ensure!(
            text.contains(workloads()),
            "checkpointctl does not show the image:\n{text}"
        );
        let json = checkpointctl(
            &node,
            &["inspect", "--format=json", &archive.display().to_string()],
        )?;
        let v: serde_json::Value = serde_json::from_str(&json).context("checkpointctl json")?;
        let first = v
            .as_array()
            .and_then(|a| a.first())
            .cloned()
            .unwrap_or(v.clone());
        let size = &first["checkpoint_size"];
        ensure!(
            size["memory_pages_size"].as_u64().unwrap_or(0) > 0,
            "no memory pages size in {first}"
        );
        ensure!(
            size["total_size"].as_u64().unwrap_or(0) > 0,
            "no total size in {first}"
        );
        // The archive carries the gpu-ckpt manifest, and `gpu-ckpt verify` accepts it.
        let info = image_format::archive::read_info(&archive, Default::default())?;
        let manifest = info
            .manifest
            .context("no gpu-ckpt manifest in the archive")?;
        ensure!(
            manifest.container.name == "counter",
            "manifest: {:?}",
            manifest.container
        );
        ensure!(manifest.criu.leave_running);
        // By default the page images are recorded with BLAKE3 alone, the rest with both.
        page_digests_are(&manifest, &archive, false)?;
        image_format::archive::verify(&archive).context("verify the archive")?;
        cri.remove_pod(&pod).await?;
        Ok(())
    })
}

/// Checks the manifest's digests of the page images against the archive's bytes: BLAKE3
/// always, sha256 only when `sha256` (the handler's `Sha256PageImages`), and both for every
/// other file.
fn page_digests_are(
    manifest: &image_format::manifest::Manifest,
    archive: &Path,
    sha256: bool,
) -> Result<()> {
    let out = tempfile::tempdir()?;
    let opts = image_format::archive::ExtractOptions {
        limits: Default::default(),
        verify: true,
    };
    image_format::archive::extract_archive(archive, out.path(), opts, &mut |_, _| {})?;
    let mut pages = 0;
    for (name, d) in &manifest.files {
        use image_format::digest::{digest_file, FileHasher};
        let path = out.path().join("checkpoint").join(name);
        let got = digest_file(&path, FileHasher::every(), &mut |_, _| {})?;
        ensure!(d.blake3 == got.blake3, "{name}: {d:?}, bytes {got:?}");
        let page = image_format::manifest::is_page_image(name);
        pages += usize::from(page);
        if page && !sha256 {
            ensure!(d.sha256.is_empty(), "{name} has a sha256: {d:?}");
        } else {
            ensure!(d.sha256 == got.sha256, "{name}: {d:?}, bytes {got:?}");
        }
    }
    ensure!(pages > 0, "no page images in {:?}", manifest.files.keys());
    Ok(())
}

#[test]
fn sha256_page_images_option_records_sha256_of_the_page_images() -> Result<()> {
    let node = node_with(Node::builder("cri-sha")?.runtime_option("Sha256PageImages", true))?;
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let (archive, _, after, pod, id) = checkpoint_counter(&node, &cri).await?;
        common::cri_counter_above(&cri, &id, "/counter.txt", after).await?;
        let info = image_format::archive::read_info(&archive, Default::default())?;
        let manifest = info.manifest.context("no gpu-ckpt manifest")?;
        page_digests_are(&manifest, &archive, true)?;
        image_format::archive::verify(&archive).context("verify the archive")?;
        cri.remove_pod(&pod).await?;
        Ok(())
    })
}

#[test]
fn restore_on_a_second_node_through_both_paths() -> Result<()> {
    let a = node("cri-a")?;
    let b = restore_node("cri-b")?;
    rt().block_on(async {
        let cri_a = Cri::connect(a.socket()).await?;
        let cri_b = Cri::connect(b.socket()).await?;
        let (archive, before, after, pod_a, _id) = checkpoint_counter(&a, &cri_a).await?;

        // 1. containerd's own restore-via-create: the image is the archive path. The original
        //    still runs on node A (a fork).
        expect_restored_counter(
            &cri_b,
            &PodSpec::new("worker", b.pod_log_root()).handler(GPU_CKPT_HANDLER),
            &ContainerSpec::new("counter", &archive.display().to_string()),
            (before, after),
            "restore-via-create",
        )
        .await?;

        // 2. The gpu-ckpt-restore RuntimeClass: an ordinary container spec, the pod names the
        //    checkpoint; the original is gone by now.
        cri_a.remove_pod(&pod_a).await?;
        expect_restored_counter(
            &cri_b,
            &restore_pod("worker", &b, &archive.display().to_string()),
            &counter_spec(),
            (before, after),
            "the restore handler",
        )
        .await?;
        Ok(())
    })
}

#[test]
fn restore_handler_checks_the_checkpoint_belongs_here() -> Result<()> {
    let a = node("cri-own")?;
    let b = restore_node("cri-own-b")?;
    rt().block_on(async {
        let cri_a = Cri::connect(a.socket()).await?;
        let cri_b = Cri::connect(b.socket()).await?;
        let (archive, _before, _after, pod_a, _) = checkpoint_counter(&a, &cri_a).await?;
        cri_a.remove_pod(&pod_a).await?;
        let archive_s = archive.display().to_string();

        // A container of another name: refused, naming the field.
        let pod = cri_b.run_pod(&restore_pod("other", &b, &archive_s)).await?;
        let spec = ContainerSpec::new("sidecar", workloads()).command(&["/bin/counter"]);
        let err = cri_b
            .run_container(&pod, &spec)
            .await
            .err()
            .context("a checkpoint of another container was restored")?;
        let msg = format!("{err:#}");
        ensure!(
            msg.contains("container name"),
            "error does not name the field: {msg}"
        );
        cri_b.remove_pod(&pod).await?;

        // The same with on-incompatible: cold-start starts it fresh.
        let pod = cri_b
            .run_pod(
                &restore_pod("cold", &b, &archive_s)
                    .annotation("gpu-ckpt.io/model-version", "other-model")
                    .annotation("gpu-ckpt.io/on-incompatible", "cold-start"),
            )
            .await?;
        let id = cri_b.run_container(&pod, &counter_spec()).await?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let v = common::cri_counter(&cri_b, &id, "/counter.txt").await?;
        ensure!(v <= 5, "a cold start should count from zero, found {v}");
        cri_b.remove_pod(&pod).await?;

        // A tampered archive: refused at restore, nothing starts.
        let tampered = b.paths().dir.join("tampered.tar");
        let mut bytes = std::fs::read(&archive)?;
        // The tar header of checkpoint/pages-1.img (its name, NUL-padded, opens the header).
        let header =
            find(&bytes, b"checkpoint/pages-1.img\0").context("pages-1.img in the archive")?;
        ensure!(header % 512 == 0, "pages-1.img header at {header}");
        let at = header + 512 + 600; // inside the file's data
        bytes[at] ^= 0xff;
        std::fs::write(&tampered, &bytes)?;
        let pod = cri_b
            .run_pod(&restore_pod("worker", &b, &tampered.display().to_string()))
            .await?;
        let err = cri_b
            .run_container(&pod, &counter_spec())
            .await
            .err()
            .context("a tampered checkpoint was restored")?;
        let msg = format!("{err:#}");
        ensure!(
            msg.contains("pages-1.img"),
            "error does not name the file: {msg}"
        );
        cri_b.remove_pod(&pod).await?;
        Ok(())
    })
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[test]
fn oci_checkpoint_image_round_trip_through_the_registry() -> Result<()> {
    let a = node("oci-a")?;
    let b = restore_node("oci-b")?;
    rt().block_on(async {
        let cri_a = Cri::connect(a.socket()).await?;
        let cri_b = Cri::connect(b.socket()).await?;
        let (archive, before, after, pod_a, _) = checkpoint_counter(&a, &cri_a).await?;
        cri_a.remove_pod(&pod_a).await?;
        let reference = format!("localhost:5000/ckpt/counter:{}", std::process::id());
        let gpu_ckpt = gpu_ckpt_cli();
        run_ok(
            std::process::Command::new(&gpu_ckpt)
                .arg("build")
                .arg(&archive)
                .args(["--ref", &reference, "--push"]),
        )?;

        // The restore handler pulls it by reference.
        expect_restored_counter(
            &cri_b,
            &restore_pod("worker", &b, &reference),
            &counter_spec(),
            (before, after),
            "the restore handler, from the image,",
        )
        .await?;

        // containerd's restore-via-create from the same image, pulled onto node B.
        b.ctr_ns_ok("k8s.io", &["images", "pull", "--plain-http", &reference])?;
        expect_restored_counter(
            &cri_b,
            &PodSpec::new("worker", b.pod_log_root()).handler(GPU_CKPT_HANDLER),
            &ContainerSpec::new("counter", &reference),
            (before, after),
            "restore-via-create from the image",
        )
        .await?;
        Ok(())
    })
}

/// checkpointctl's and gpu-ckpt's `inspect` of `archive`, as JSON (checkpointctl with
/// `--stats` when asked).
fn inspect_both(
    node: &Node,
    archive: &str,
    stats: bool,
) -> Result<(serde_json::Value, serde_json::Value)> {
    let mut args = vec!["inspect", "--format=json"];
    if stats {
        args.push("--stats");
    }
    args.push(archive);
    let theirs = serde_json::from_str(&checkpointctl(node, &args)?)?;
    let ours = serde_json::from_str(&run_ok(
        std::process::Command::new(gpu_ckpt_cli()).args(["inspect", "--json", archive]),
    )?)?;
    Ok((theirs, ours))
}

/// checkpointctl (`t`) and gpu-ckpt (`o`) show the same container, image and sizes.
fn ensure_inspect_agrees(t: &serde_json::Value, o: &serde_json::Value, label: &str) -> Result<()> {
    for key in ["container_name", "image"] {
        ensure!(
            t[key] == o[key],
            "{label}: {key}: checkpointctl {} vs gpu-ckpt {}",
            t[key],
            o[key]
        );
    }
    for key in ["total_size", "memory_pages_size", "root_fs_diff_size"] {
        let (tv, ov) = (&t["checkpoint_size"][key], &o["checkpoint_size"][key]);
        ensure!(
            tv == ov,
            "{label}: checkpoint_size.{key}: checkpointctl {tv} vs gpu-ckpt {ov}"
        );
    }
    Ok(())
}

/// `gpu-ckpt inspect --json` against checkpointctl on real archives: gpu-ckpt's own, and
/// containerd-shim-runc-v2's; both carry CRIU's statistics where checkpointctl reads them (the
/// top-level `stats-dump`), gpu-ckpt's covered by its manifest.
#[test]
fn inspect_agrees_with_checkpointctl() -> Result<()> {
    let node = node("cri-inspect")?;
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        cri.pull_image(workloads()).await?;
        for handler in [GPU_CKPT_HANDLER, test_containers::stack::RUNC_HANDLER] {
            let pod = cri
                .run_pod(
                    &PodSpec::new(&format!("inspect-{handler}"), node.pod_log_root())
                        .handler(handler),
                )
                .await?;
            let id = cri.run_container(&pod, &counter_spec()).await?;
            common::cri_counter_above(&cri, &id, "/counter.txt", 3).await?;
            let archive = node.paths().dir.join(format!("inspect-{handler}.tar"));
            let _ = std::fs::remove_file(&archive);
            cri.checkpoint_container(&id, &archive, 60).await?;
            let a = archive.display().to_string();
            // checkpointctl's --stats reads a top-level stats-dump: containerd's CRI copies it
            // from the container's CRI directory, where runc-v2's CRIU writes it and gpu-ckpt's
            // shim puts a copy of checkpoint/stats-dump.
            let runc = handler == test_containers::stack::RUNC_HANDLER;
            let (theirs, ours) = inspect_both(&node, &a, true)?;
            let (t, o) = (&theirs[0], &ours[0]);
            ensure_inspect_agrees(t, o, handler)?;
            if !runc {
                // The same checkpoint as CRI-O writes it: CRI-O's annotations in spec.dump and a
                // plain-tar rootfs diff.
                let crio = node.paths().dir.join("inspect-crio.tar");
                crio_variant(&archive, &crio)?;
                let (theirs, ours) = inspect_both(&node, &crio.display().to_string(), false)?;
                ensure!(
                    ours[0]["engine"] == "CRI-O",
                    "gpu-ckpt sees engine {}",
                    ours[0]["engine"]
                );
                ensure_inspect_agrees(&theirs[0], &ours[0], "CRI-O")?;
            }
            {
                let ts = &t["statistics"];
                ensure!(
                    ts.is_object(),
                    "checkpointctl shows no statistics for {handler}: {t}"
                );
                for key in [
                    "freezing_time",
                    "frozen_time",
                    "memdump_time",
                    "memwrite_time",
                    "pages_scanned",
                    "pages_written",
                ] {
                    ensure!(
                        ts[key] == o["statistics"][key],
                        "statistics.{key}: checkpointctl {} vs gpu-ckpt {}",
                        ts[key],
                        o["statistics"][key]
                    );
                }
            }
            if !runc {
                // gpu-ckpt keeps CRIU's statistics beside the images.
                ensure!(
                    o["statistics"]["frozen_time"].as_u64().unwrap_or(0) > 0,
                    "no CRIU statistics: {o}"
                );
                stats_dump_is_where_checkpointctl_reads_it(&node, &archive)?;
            }
            cri.remove_pod(&pod).await?;
        }
        Ok(())
    })
}

/// gpu-ckpt's archive carries CRIU's statistics at its top level, the same bytes as
/// `checkpoint/stats-dump`: `checkpointctl inspect --stats` prints them (exit 0), verify checks
/// the copy against the manifest, and refuses the archive when the copy was changed.
fn stats_dump_is_where_checkpointctl_reads_it(node: &Node, archive: &Path) -> Result<()> {
    use image_format::archive::names::{CHECKPOINT_STATS_DUMP, STATS_DUMP};
    let mut members = std::collections::BTreeMap::new();
    rewrite_archive(
        archive,
        &node.paths().dir.join("stats-scan.tar"),
        |name, data| {
            if name == STATS_DUMP || name == CHECKPOINT_STATS_DUMP {
                members.insert(name.to_string(), data.clone());
            }
            Ok(Some(data))
        },
    )?;
    let (top, inner) = (members.get(STATS_DUMP), members.get(CHECKPOINT_STATS_DUMP));
    ensure!(
        top.is_some() && top == inner,
        "the archive's top-level stats-dump ({:?} bytes) is not checkpoint/stats-dump ({:?} bytes)",
        top.map(Vec::len),
        inner.map(Vec::len)
    );
    let text = checkpointctl(
        node,
        &["inspect", "--stats", &archive.display().to_string()],
    )?;
    for want in ["CRIU dump statistics", "Freezing time", "Pages written"] {
        ensure!(
            text.contains(want),
            "checkpointctl inspect --stats does not show {want:?}:\n{text}"
        );
    }
    let report = image_format::archive::verify(archive).context("verify the archive")?;
    ensure!(
        !report.uncovered.contains_key(STATS_DUMP),
        "the top-level stats-dump is not covered by the manifest: {:?}",
        report.uncovered.keys().collect::<Vec<_>>()
    );
    let changed = node.paths().dir.join("stats-changed.tar");
    rewrite_archive(archive, &changed, |name, mut data| {
        if name == STATS_DUMP {
            if let Some(b) = data.last_mut() {
                *b ^= 1;
            }
        }
        Ok(Some(data))
    })?;
    let err = match image_format::archive::verify(&changed) {
        Ok(_) => anyhow::bail!("verify accepts an archive whose top-level stats-dump was changed"),
        Err(e) => e.to_string(),
    };
    ensure!(
        err.contains("top-level copy of checkpoint/stats-dump") && err.contains("mismatch"),
        "verify of a changed stats-dump: {err}"
    );
    let out = std::process::Command::new(gpu_ckpt_cli())
        .args(["verify", &changed.display().to_string()])
        .output()?;
    ensure!(
        !out.status.success(),
        "gpu-ckpt verify accepts a changed stats-dump: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(())
}

/// Rewrites a containerd archive as CRI-O lays it out: `io.container.manager: cri-o` and CRI-O's
/// identity annotations in spec.dump, and the rootfs diff as a plain tar.
fn crio_variant(src: &Path, dst: &Path) -> Result<()> {
    use std::io::Read;
    rewrite_archive(src, dst, |name, mut data| {
        if name == "spec.dump" {
            let mut spec: serde_json::Value = serde_json::from_slice(&data)?;
            let a = spec["annotations"]
                .as_object_mut()
                .context("spec.dump annotations")?;
            let get = |k: &str| {
                a.get(k)
                    .and_then(|v| v.as_str())
                    .unwrap_or_default()
                    .to_string()
            };
            let (cname, pod, ns) = (
                get("io.kubernetes.cri.container-name"),
                get("io.kubernetes.cri.sandbox-name"),
                get("io.kubernetes.cri.sandbox-namespace"),
            );
            a.insert("io.container.manager".into(), "cri-o".into());
            a.insert(
                "io.kubernetes.cri-o.Metadata".into(),
                serde_json::json!({"name": cname}).to_string().into(),
            );
            a.insert("io.kubernetes.container.name".into(), cname.into());
            a.insert("io.kubernetes.pod.name".into(), pod.into());
            a.insert("io.kubernetes.pod.namespace".into(), ns.into());
            data = serde_json::to_vec(&spec)?;
        } else if name == "rootfs-diff.tar" {
            let mut plain = Vec::new();
            flate2::read::GzDecoder::new(&data[..]).read_to_end(&mut plain)?;
            data = plain;
        }
        Ok(Some(data))
    })
}
