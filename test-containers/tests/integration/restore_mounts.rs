//! A restored container has the new spec's mounts (issue 34, part 3), through the restore
//! handler (`gpu-ckpt.io/restore-from`) on the real stack:
//!
//! - the source mounts a host directory read-write at `/data`; the restoring spec mounts
//!   another host directory read-only there and sets a read-only root: after the restore,
//!   writing to `/data` and to `/` gives EROFS, and the read-only host directory stays
//!   unwritten (at 3a1f787 the restore left both writable, and the write landed in the host
//!   directory);
//! - a restoring spec that adds a bind (`/srv`, a host directory with a marker file) the
//!   checkpoint did not have is refused naming it (at 3a1f787: an empty `/srv` after a restore
//!   that reported success);
//! - a checkpoint whose mount table was rewritten and re-signed with the node's key (the
//!   issue's forged checkpoint: `/proc/sys` recorded read-write, the `/proc/timer_list` mask
//!   left out) restores with `/proc/sys` read-only as the spec says, and without the mask is
//!   refused naming `/proc/timer_list`.
//!
//! Needs root and the stack from `make deps`; fails (never skips) when it is missing.

use std::path::{Path, PathBuf};

use crate::common::*;
use anyhow::{bail, ensure, Context, Result};
use image_format::protowire::{fields, put_varint, Value};
use test_containers::{
    cri::{ContainerSpec, Cri, PodSpec},
    stack::{Node, OptValue, GPU_CKPT_HANDLER, RUN_BASE},
};

/// A `maskedPaths` entry of containerd's default spec that this kernel has (it has no
/// `/proc/kcore`): unmasked it reads as pages of text, masked (`/dev/null`) as nothing.
const MASKED: &str = "/proc/timer_list";

/// The counter's file: in the pod's shared memory, writable under a read-only root.
const COUNTER_FILE: &str = "/dev/shm/counter.txt";

fn key_path(node: &str) -> PathBuf {
    Path::new(RUN_BASE)
        .join(format!("{node}-keys"))
        .join("node.key")
}

/// A node that checkpoints with its own key and restores through the restore handler, which
/// trusts that key.
fn mounts_node(name: &str) -> Result<Node> {
    let key = key_path(name);
    let _ = std::fs::remove_dir_all(key.parent().context("key dir")?);
    let mut handler = restore_handler(name, RESTORE_HANDLER)?;
    handler.options.insert(
        "SigningKey".into(),
        OptValue::from(key.display().to_string()),
    );
    node_with(
        Node::builder(name)?
            .runtime_option("SigningKey", key.display().to_string())
            .extra_runtime(handler),
    )
}

/// The counter, with the masked and read-only paths kubelet asks for.
fn counter() -> ContainerSpec {
    ContainerSpec::new("counter", workloads())
        .command(&[
            "/bin/counter",
            "--interval-ms",
            "100",
            "--file",
            COUNTER_FILE,
        ])
        .kubelet_proc_paths()
}

fn bind(container_path: &str, host: &Path, readonly: bool) -> test_containers::cri::v1::Mount {
    test_containers::cri::v1::Mount {
        container_path: container_path.into(),
        host_path: host.display().to_string(),
        readonly,
        ..Default::default()
    }
}

/// Runs `spec` on `node` under gpu-ckpt, checkpoints it through CRI, removes the pod; returns
/// the archive and the counter just before the checkpoint.
async fn checkpoint(
    node: &Node,
    cri: &Cri,
    spec: &ContainerSpec,
    name: &str,
) -> Result<(PathBuf, u64)> {
    cri.pull_image(workloads()).await?;
    let pod = cri
        .run_pod(&PodSpec::new("worker", node.pod_log_root()).handler(GPU_CKPT_HANDLER))
        .await?;
    let id = cri.run_container(&pod, spec).await?;
    let before = cri_counter_above(cri, &id, COUNTER_FILE, 3).await?;
    let archive = node.paths().dir.join(format!("checkpoint-{name}.tar"));
    let _ = std::fs::remove_file(&archive);
    cri.checkpoint_container(&id, &archive, 60)
        .await
        .context("CRI checkpoint")?;
    cri.remove_pod(&pod).await?;
    Ok((archive, before))
}

/// A restore of `archive` into `spec` through the restore handler: `Ok((pod, id))` when it
/// runs, `Err(message)` when it is refused (then nothing of it runs and the pod is removed).
async fn restore(
    node: &Node,
    cri: &Cri,
    archive: &Path,
    spec: &ContainerSpec,
) -> Result<std::result::Result<(test_containers::cri::Pod, String), String>> {
    let pod = cri
        .run_pod(&restore_pod("worker", node, &archive.display().to_string()))
        .await?;
    let created = cri.create_container(&pod, spec).await;
    let started = match &created {
        Ok(id) => cri.start_container(id).await,
        Err(e) => Err(anyhow::anyhow!("{e:#}")),
    };
    match started {
        Ok(()) => Ok(Ok((pod, created?))),
        Err(e) => {
            if let Ok(id) = &created {
                let state = cri.container_state(id).await?;
                ensure!(
                    state != test_containers::cri::v1::ContainerState::ContainerRunning,
                    "the refused container is {state:?}"
                );
            }
            cri.remove_pod(&pod).await?;
            // tonic writes the status message with Debug escapes.
            Ok(Err(format!("{e:#}").replace("\\\"", "\"")))
        }
    }
}

/// The names in `dir`.
fn names(dir: &Path) -> Result<Vec<String>> {
    let mut out: Vec<String> = std::fs::read_dir(dir)?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_>>()?;
    out.sort();
    Ok(out)
}

#[test]
fn read_only_mounts_and_root_of_the_new_spec_hold_after_a_restore() -> Result<()> {
    let node = mounts_node("rmnt-ro")?;
    let source_dir = tempfile::Builder::new().prefix("rmnt-rw-").tempdir()?;
    let ro_dir = tempfile::Builder::new().prefix("rmnt-ro-").tempdir()?;
    std::fs::write(ro_dir.path().join("marker"), "read-only host dir")?;
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let mut source = counter();
        source.mounts.push(bind("/data", source_dir.path(), false));
        let (archive, before) = checkpoint(&node, &cri, &source, "ro").await?;

        // The restoring spec: another host directory, read-only, at /data; a read-only root.
        let mut spec = counter().readonly_rootfs();
        spec.mounts.push(bind("/data", ro_dir.path(), true));
        let (pod, id) = match restore(&node, &cri, &archive, &spec).await? {
            Ok(restored) => restored,
            Err(msg) => bail!("the restore into read-only mounts was refused: {msg}"),
        };
        let first = cri_counter(&cri, &id, COUNTER_FILE).await?;
        ensure!(first >= before, "restored at {first}, checkpointed after {before}");
        cri_counter_above(&cri, &id, COUNTER_FILE, first).await?;
        // /data is the new spec's host directory.
        let r = cri.exec_sync(&id, &["cat", "/data/marker"], 10).await?;
        ensure!(
            r.stdout_str() == "read-only host dir",
            "/data is not the new spec's host directory: {:?} {:?}",
            r.stdout_str(),
            r.stderr_str()
        );
        let data = can_write(&cri, &id, "/data/written-after-restore").await?;
        let root = can_write(&cri, &id, "/written-after-restore").await?;
        let host = names(ro_dir.path())?;
        eprintln!(
            "restored with a read-only /data and root: /data writable: {data}, / writable: {root}, read-only host dir holds {host:?}"
        );
        ensure!(!data, "/data, read-only in the new spec, is writable after the restore");
        ensure!(!root, "the root, read-only in the new spec, is writable after the restore");
        ensure!(
            host == ["marker"],
            "the read-only host directory was written: {host:?}"
        );
        ensure!(
            names(source_dir.path())?.is_empty(),
            "the source's host directory was written"
        );
        cri.remove_pod(&pod).await
    })
}

#[test]
fn a_bind_the_checkpoint_did_not_have_is_refused_naming_it() -> Result<()> {
    let node = mounts_node("rmnt-new")?;
    let srv = tempfile::Builder::new().prefix("rmnt-srv-").tempdir()?;
    std::fs::write(srv.path().join("marker"), "srv content")?;
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let (archive, _) = checkpoint(&node, &cri, &counter(), "new").await?;
        let mut spec = counter();
        spec.mounts.push(bind("/srv", srv.path(), true));
        match restore(&node, &cri, &archive, &spec).await? {
            Err(msg) => {
                eprintln!("a restore with a new bind at /srv: refused: {msg}");
                ensure!(
                    msg.contains(&format!("/srv (bind of {})", srv.path().display()))
                        && msg.contains("the checkpoint has no mount"),
                    "the refusal does not name /srv and its source: {msg}"
                );
                Ok(())
            }
            Ok((pod, id)) => {
                let r = cri.exec_sync(&id, &["ls", "-A", "/srv"], 10).await?;
                let listing = r.stdout_str();
                cri.remove_pod(&pod).await?;
                bail!(
                    "a restore with a bind at /srv the checkpoint did not have was not refused; /srv in the restored container holds {:?} (the host directory holds {:?})",
                    listing.split_whitespace().collect::<Vec<_>>(),
                    names(srv.path())?
                )
            }
        }
    })
}

/// `MS_RDONLY`.
const MS_RDONLY: u64 = 1;

/// A `mountpoints-*.img` with each entry passed through `edit` (mountpoint, fields) → new
/// fields, or `None` to leave it out.
fn edit_mount_image(
    data: &[u8],
    mut edit: impl for<'a> FnMut(&str, Vec<(u64, Value<'a>)>) -> Option<Vec<(u64, Value<'a>)>>,
) -> Result<Vec<u8>> {
    ensure!(data.len() >= 8, "mount image shorter than its magic");
    let mut out = data[..8].to_vec();
    let mut rest = &data[8..];
    while !rest.is_empty() {
        let len = u32::from_le_bytes(rest[..4].try_into()?) as usize;
        let entry = &rest[4..4 + len];
        rest = &rest[4 + len..];
        let f = fields(entry).context("malformed mount entry")?;
        let mountpoint = f
            .iter()
            .find_map(|(n, v)| match v {
                Value::Bytes(b) if *n == 7 => Some(String::from_utf8_lossy(b).into_owned()),
                _ => None,
            })
            .context("mount entry without a mountpoint")?;
        let mountpoint = image_format::mountinfo::normalize(&mountpoint);
        let Some(f) = edit(&mountpoint, f) else {
            continue;
        };
        let mut e = Vec::new();
        for (n, v) in f {
            match v {
                Value::Varint(x) => {
                    put_varint(&mut e, n << 3);
                    put_varint(&mut e, x);
                }
                Value::Bytes(b) => {
                    put_varint(&mut e, (n << 3) | 2);
                    put_varint(&mut e, b.len() as u64);
                    e.extend_from_slice(b);
                }
            }
        }
        out.extend_from_slice(&(e.len() as u32).to_le_bytes());
        out.extend_from_slice(&e);
    }
    Ok(out)
}

/// `archive` with its mount images edited by `edit` and its manifest re-signed with `key`:
/// the forged checkpoint of the issue, made by whoever holds the node's key.
fn forge(
    archive: &Path,
    out: &Path,
    key: &Path,
    edit: impl for<'a> Fn(&str, Vec<(u64, Value<'a>)>) -> Option<Vec<(u64, Value<'a>)>>,
) -> Result<()> {
    use std::io::Read;
    let mut images = std::collections::BTreeMap::new();
    let mut ar = tar::Archive::new(std::fs::File::open(archive)?);
    for e in ar.entries()? {
        let mut e = e?;
        let path = e.path()?.to_string_lossy().into_owned();
        if let Some(name) = path.strip_prefix("checkpoint/") {
            if name.starts_with("mountpoints-") && name.ends_with(".img") {
                let mut data = Vec::new();
                e.read_to_end(&mut data)?;
                images.insert(name.to_string(), edit_mount_image(&data, &edit)?);
            }
        }
    }
    ensure!(
        !images.is_empty(),
        "no mount image in {}",
        archive.display()
    );
    let key = image_format::sign::NodeKey::load(key)?;
    rewrite_archive(archive, out, |name, data| {
        let Some(name) = name.strip_prefix("checkpoint/") else {
            return Ok(Some(data));
        };
        if let Some(image) = images.get(name) {
            return Ok(Some(image.clone()));
        }
        if name != image_format::MANIFEST_FILE {
            return Ok(Some(data));
        }
        let mut m = image_format::Manifest::from_json(&data, "manifest")?;
        for (image_name, image) in &images {
            m.files.insert(
                image_name.clone(),
                image_format::archive::digest_bytes(image),
            );
        }
        key.sign_manifest(&mut m)?;
        Ok(Some(m.to_json()))
    })
}

#[test]
fn masked_and_read_only_paths_hold_against_a_rewritten_mount_table() -> Result<()> {
    let node = mounts_node("rmnt-mask")?;
    let key = key_path("rmnt-mask");
    ensure!(
        Path::new(MASKED).exists(),
        "this host has no {MASKED} to mask"
    );
    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let (archive, _) = checkpoint(&node, &cri, &counter(), "mask").await?;

        // 1. The mask of MASKED left out: refused naming it.
        let unmasked = node.paths().dir.join("checkpoint-mask-unmasked.tar");
        forge(&archive, &unmasked, &key, |mp, f| (mp != MASKED).then_some(f))?;
        match restore(&node, &cri, &unmasked, &counter()).await? {
            Err(msg) => {
                eprintln!("the {MASKED} mask left out: refused: {msg}");
                ensure!(
                    msg.contains(&format!("masked path {MASKED}: found"))
                        && msg.contains("the spec's masked"),
                    "the refusal does not name {MASKED}: {msg}"
                );
            }
            Ok((pod, id)) => {
                let r = cri.exec_sync(&id, &["cat", MASKED], 10).await?;
                cri.remove_pod(&pod).await?;
                bail!(
                    "the checkpoint without the {MASKED} mask restored; cat {MASKED}: exit {}, {} bytes",
                    r.exit_code,
                    r.stdout.len()
                )
            }
        };

        // 2. /proc/sys recorded read-write: restored read-only, as the spec says.
        let rw_sys = node.paths().dir.join("checkpoint-mask-rw-sys.tar");
        forge(&archive, &rw_sys, &key, |mp, f| {
            if mp != "/proc/sys" {
                return Some(f);
            }
            Some(
                f.into_iter()
                    .map(|(n, v)| match v {
                        Value::Varint(x) if n == 5 => (n, Value::Varint(x & !MS_RDONLY)),
                        v => (n, v),
                    })
                    .collect(),
            )
        })?;
        let (pod, id) = match restore(&node, &cri, &rw_sys, &counter()).await? {
            Ok(restored) => restored,
            Err(msg) => bail!("the checkpoint with /proc/sys recorded read-write was refused: {msg}"),
        };
        cri_counter(&cri, &id, COUNTER_FILE).await?;
        let sys = can_write(&cri, &id, "/proc/sys/kernel/domainname").await?;
        let r = cri.exec_sync(&id, &["cat", MASKED], 10).await?;
        eprintln!(
            "/proc/sys recorded read-write: restored, /proc/sys writable: {sys}; {MASKED}: exit {} ({} bytes, {:?})",
            r.exit_code,
            r.stdout.len(),
            r.stderr_str().trim()
        );
        ensure!(!sys, "/proc/sys, read-only in the spec, is writable after the restore");
        ensure!(
            r.exit_code == 0 && r.stdout.is_empty(),
            "{MASKED} is not masked: exit {}, {} bytes, {:?}",
            r.exit_code,
            r.stdout.len(),
            r.stderr_str()
        );
        cri.remove_pod(&pod).await
    })
}
