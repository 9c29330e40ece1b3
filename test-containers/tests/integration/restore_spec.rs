//! A restore is held to the new container's spec (issue 20, part 1): a checkpoint of a root,
//! unconfined container with SYS_ADMIN and SYS_MODULE is refused when restored into a spec
//! that Pod Security "restricted" admits (uid 1000, no added capability, no_new_privs, seccomp
//! RuntimeDefault), through the restore handler and through containerd's restore-via-create,
//! and nothing of it keeps running; restores into the spec the checkpoint came from still work,
//! for non-root and root containers, and the kernel shows the spec's credentials.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use crate::common;
use crate::common::*;
use anyhow::{ensure, Context, Result};
use test_containers::{
    cri::{v1::security_profile::ProfileType, ContainerSpec, Cri, Pod, PodSpec},
    stack::{Node, GPU_CKPT_HANDLER},
};

/// The counter's file, in a directory any uid may write.
const COUNTER_FILE: &str = "/tmp/counter.txt";

/// The counter, told apart from every other test's by its interval.
fn counter(interval_ms: u32) -> ContainerSpec {
    ContainerSpec::new("counter", workloads()).command(&[
        "/bin/counter".to_string(),
        "--interval-ms".into(),
        interval_ms.to_string(),
        "--file".into(),
        COUNTER_FILE.into(),
    ])
}

/// What Pod Security "restricted" admits.
fn restricted(spec: ContainerSpec) -> ContainerSpec {
    spec.run_as(1000, 1000)
        .no_new_privs()
        .seccomp(ProfileType::RuntimeDefault)
}

/// The attacker: root, unconfined, SYS_ADMIN and SYS_MODULE added.
fn attacker(spec: ContainerSpec) -> ContainerSpec {
    spec.run_as(0, 0)
        .seccomp(ProfileType::Unconfined)
        .add_capabilities(&["SYS_ADMIN", "SYS_MODULE"])
}

/// Host pids of the counters running with `interval_ms`.
fn counters(interval_ms: u32) -> Vec<i32> {
    let want = interval_ms.to_string();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        if args.first() == Some(&&b"/bin/counter"[..])
            && args.get(2) == Some(&want.as_bytes())
            && args.get(4) == Some(&COUNTER_FILE.as_bytes())
        {
            out.push(pid);
        }
    }
    out
}

/// The fields of `/proc/<pid>/status` the spec governs.
const STATUS_FIELDS: [&str; 11] = [
    "Uid",
    "Gid",
    "Groups",
    "CapInh",
    "CapPrm",
    "CapEff",
    "CapBnd",
    "CapAmb",
    "NoNewPrivs",
    "Seccomp",
    "Seccomp_filters",
];

/// [`STATUS_FIELDS`] of process `pid`.
fn kernel_view(pid: i32) -> Result<BTreeMap<String, String>> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    Ok(status
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| {
            (
                k.to_string(),
                v.split_whitespace().collect::<Vec<_>>().join(" "),
            )
        })
        .filter(|(k, _)| STATUS_FIELDS.contains(&k.as_str()))
        .collect())
}

/// [`STATUS_FIELDS`] but `left_out`, in their order.
fn status_fields_but(left_out: &[&str]) -> Vec<&'static str> {
    STATUS_FIELDS
        .into_iter()
        .filter(|f| !left_out.contains(f))
        .collect()
}

/// The one counter with `interval_ms` on this host, and its kernel view.
fn the_counter(interval_ms: u32) -> Result<(i32, BTreeMap<String, String>)> {
    let pids = counters(interval_ms);
    ensure!(
        pids.len() == 1,
        "counters with interval {interval_ms}: {pids:?}"
    );
    Ok((pids[0], kernel_view(pids[0])?))
}

/// Runs `spec` in a pod on `node`, checkpoints it through CRI, and removes the pod; returns
/// the archive, the counter just before the checkpoint, and the running counter's kernel view.
async fn checkpoint(
    node: &Node,
    cri: &Cri,
    spec: &ContainerSpec,
    interval_ms: u32,
) -> Result<(PathBuf, u64, BTreeMap<String, String>)> {
    cri.pull_image(workloads()).await?;
    let pod = cri
        .run_pod(&PodSpec::new("worker", node.pod_log_root()).handler(GPU_CKPT_HANDLER))
        .await?;
    let id = cri.run_container(&pod, spec).await?;
    let before = common::cri_counter_above(cri, &id, COUNTER_FILE, 3).await?;
    let (_, view) = the_counter(interval_ms)?;
    let archive = node
        .paths()
        .dir
        .join(format!("checkpoint-{interval_ms}.tar"));
    let _ = std::fs::remove_file(&archive);
    cri.checkpoint_container(&id, &archive, 60).await?;
    cri.remove_pod(&pod).await?;
    ensure!(
        counters(interval_ms).is_empty(),
        "the checkpointed counter still runs after its pod was removed"
    );
    Ok((archive, before, view))
}

/// Node B, where the counter of `interval_ms`, checkpointed into `archive` at `before`, is
/// restored.
struct OnB<'a> {
    cri: &'a Cri,
    node: &'a Node,
    archive: &'a str,
    before: u64,
    interval_ms: u32,
}

impl<'a> OnB<'a> {
    fn new(cri: &'a Cri, node: &'a Node, archive: &'a str, before: u64, interval_ms: u32) -> Self {
        OnB {
            cri,
            node,
            archive,
            before,
            interval_ms,
        }
    }

    /// A pod of the restore handler that restores the archive.
    fn handler_pod(&self) -> PodSpec {
        PodSpec::new("worker", self.node.pod_log_root())
            .handler(RESTORE_HANDLER)
            .annotation("gpu-ckpt.io/restore-from", self.archive)
    }

    /// A pod of the gpu-ckpt handler, for containerd's restore-via-create.
    fn create_pod(&self) -> PodSpec {
        PodSpec::new("worker", self.node.pod_log_root()).handler(GPU_CKPT_HANDLER)
    }

    /// The counter for containerd's restore-via-create: its image is the archive.
    fn archive_container(&self) -> ContainerSpec {
        ContainerSpec::new("counter", self.archive)
    }

    /// Restores `spec` in a new pod (`pod`) and expects a refusal that names a field, and
    /// nothing left running.
    async fn refused(&self, pod: &PodSpec, spec: &ContainerSpec, what: &str) -> Result<String> {
        let (cri, interval_ms) = (self.cri, self.interval_ms);
        let pod = cri.run_pod(pod).await?;
        let created = cri.create_container(&pod, spec).await;
        let result = match &created {
            Ok(id) => cri.start_container(id).await,
            Err(e) => Err(anyhow::anyhow!("{e:#}")),
        };
        let msg = match result {
            Ok(()) => {
                let view = the_counter(interval_ms).map(|(_, v)| v);
                cri.remove_pod(&pod).await?;
                anyhow::bail!(
                    "{what}: the restore was not refused; the restored counter: {view:?}"
                );
            }
            Err(e) => format!("{e:#}"),
        };
        // Nothing of the restore runs: the container is not running, and no process of it is
        // left.
        if let Ok(id) = &created {
            let state = cri.container_state(id).await?;
            ensure!(
                state != test_containers::cri::v1::ContainerState::ContainerRunning,
                "{what}: the refused container is {state:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let left = counters(interval_ms);
        ensure!(
            left.is_empty(),
            "{what}: restored processes left running: {left:?} ({:?})",
            left.first().map(|p| kernel_view(*p))
        );
        cri.remove_pod(&pod).await?;
        Ok(msg)
    }

    /// Restores `spec` in a new pod (`pod`), expects the counter to go on from `before`, and
    /// returns the restored counter's kernel view. Removes the pod.
    async fn restored(
        &self,
        pod: &PodSpec,
        spec: &ContainerSpec,
        what: &str,
    ) -> Result<BTreeMap<String, String>> {
        let (cri, before) = (self.cri, self.before);
        let pod: Pod = cri.run_pod(pod).await?;
        let id = cri
            .run_container(&pod, spec)
            .await
            .with_context(|| format!("{what}: restore"))?;
        let first = common::cri_counter(cri, &id, COUNTER_FILE).await?;
        ensure!(
            first >= before,
            "{what}: restored at {first}, checkpointed after {before}"
        );
        common::cri_counter_above(cri, &id, COUNTER_FILE, first).await?;
        let (_, view) = the_counter(self.interval_ms)?;
        cri.remove_pod(&pod).await?;
        Ok(view)
    }

    /// Restores the archive through the restore handler into `spec` and holds the restored
    /// task to the cold start's `keys` of /proc/PID/status, and to the pre-resume check in the
    /// node's log. `label` opens each error.
    async fn handler_as_cold_start(
        &self,
        spec: &ContainerSpec,
        cold: &BTreeMap<String, String>,
        keys: &[&str],
        label: &str,
    ) -> Result<()> {
        let restored = self
            .restored(&self.handler_pod(), spec, "the restore handler")
            .await?;
        for key in keys {
            ensure!(
                restored.get(*key) == cold.get(*key),
                "{label}: {key}: restored {:?}, cold start {:?}",
                restored.get(*key),
                cold.get(*key)
            );
        }
        // The tree was held to the spec at pre-resume (the kernel's view), not only checked in
        // the checkpoint's record.
        let b = self.node;
        ensure!(
            log_mentions(b, "restored tree held to the spec"),
            "no pre-resume check in {}",
            b.paths().log.display()
        );
        Ok(())
    }
}

/// Runs `body` on nodes `<name>-a`, which checkpoints, and `<name>-b`, which restores (it has
/// the restore handler), each with its CRI client.
fn on_two_nodes<F, Fut>(name: &str, body: F) -> Result<()>
where
    F: FnOnce(Node, Node, Cri, Cri) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let a = node(&format!("{name}-a"))?;
    let b = restore_node(&format!("{name}-b"))?;
    rt().block_on(async {
        let cri_a = Cri::connect(a.socket()).await?;
        let cri_b = Cri::connect(b.socket()).await?;
        body(a, b, cri_a, cri_b).await
    })
}

fn log_mentions(node: &Node, needle: &str) -> bool {
    std::fs::read_to_string(&node.paths().log)
        .map(|l| l.contains(needle))
        .unwrap_or(false)
}

#[test]
fn case_1_is_refused_through_the_restore_handler_and_restore_via_create() -> Result<()> {
    const INTERVAL: u32 = 101;
    on_two_nodes("spec", |a, b, cri_a, cri_b| async move {
        let (archive, _, view) =
            checkpoint(&a, &cri_a, &attacker(counter(INTERVAL)), INTERVAL).await?;
        // The checkpointed container is what the issue describes.
        ensure!(view["Uid"] == "0 0 0 0", "attacker: {view:?}");
        ensure!(view["CapBnd"] == "00000000a82525fb", "attacker: {view:?}");
        ensure!(
            view["Seccomp"] == "0" && view["NoNewPrivs"] == "0",
            "attacker: {view:?}"
        );
        let archive_s = archive.display().to_string();
        let on_b = OnB::new(&cri_b, &b, &archive_s, 0, INTERVAL);

        // 1. The restore handler, into the restricted spec.
        let spec = restricted(counter(INTERVAL));
        let msg = on_b
            .refused(&on_b.handler_pod(), &spec, "the restore handler")
            .await?;
        for part in [
            "beyond this container's spec",
            "Uid 0 0 0 0 is beyond the spec's 1000",
            "CapBnd 00000000a82525fb is beyond the spec's 00000000a80425fb (cap_sys_module, cap_sys_admin)",
        ] {
            ensure!(msg.contains(part), "restore handler: {part:?} not in: {msg}");
        }

        // 2. containerd's restore-via-create, the image being the archive, into the same spec.
        let spec = restricted(on_b.archive_container());
        let msg = on_b
            .refused(&on_b.create_pod(), &spec, "restore-via-create")
            .await?;
        ensure!(
            msg.contains("beyond this container's spec") && msg.contains("CapBnd"),
            "restore-via-create: {msg}"
        );
        Ok(())
    })
}

#[test]
fn a_non_root_container_restores_into_its_own_spec() -> Result<()> {
    const INTERVAL: u32 = 103;
    on_two_nodes("spec-nr", |a, b, cri_a, cri_b| async move {
        let spec = restricted(counter(INTERVAL));
        if !root_has_cap_sys_resource() {
            // CRIU reads every task's rlimits with prlimit(2), which for a task of another uid
            // needs CAP_SYS_RESOURCE (stack.md P5): on such a host no non-root container can
            // be checkpointed, with any shim. Show that this is the reason.
            let err = checkpoint(&a, &cri_a, &spec, INTERVAL)
                .await
                .err()
                .context("a non-root checkpoint worked without CAP_SYS_RESOURCE")?;
            not_run_without_cap_sys_resource(&err, "the non-root round trip")?;
            return Ok(());
        }
        let (archive, before, cold) = checkpoint(&a, &cri_a, &spec, INTERVAL).await?;
        // A cold start of the restricted spec, as the issue reports it.
        ensure!(cold["Uid"] == "1000 1000 1000 1000", "cold start: {cold:?}");
        ensure!(cold["CapEff"] == "0000000000000000", "cold start: {cold:?}");
        ensure!(
            cold["NoNewPrivs"] == "1" && cold["Seccomp"] == "2",
            "cold start: {cold:?}"
        );
        let archive_s = archive.display().to_string();

        // The kernel shows the spec's credentials and filter, as at the cold start.
        let keys = status_fields_but(&["Groups"]);
        let on_b = OnB::new(&cri_b, &b, &archive_s, before, INTERVAL);
        on_b.handler_as_cold_start(&spec, &cold, &keys, "restore handler")
            .await?;

        let spec = restricted(on_b.archive_container());
        let restored = on_b
            .restored(&on_b.create_pod(), &spec, "restore-via-create")
            .await?;
        ensure!(
            restored["Uid"] == "1000 1000 1000 1000"
                && restored["NoNewPrivs"] == "1"
                && restored["Seccomp"] == "2"
                && restored["CapEff"] == "0000000000000000",
            "restore-via-create: {restored:?}"
        );
        Ok(())
    })
}

#[test]
fn a_root_container_restores_into_its_own_spec() -> Result<()> {
    const INTERVAL: u32 = 107;
    on_two_nodes("spec-root", |a, b, cri_a, cri_b| async move {
        // Root, with no_new_privs and RuntimeDefault: every field the check holds a restore to.
        let spec = counter(INTERVAL)
            .no_new_privs()
            .seccomp(ProfileType::RuntimeDefault);
        let (archive, before, cold) = checkpoint(&a, &cri_a, &spec, INTERVAL).await?;
        ensure!(
            cold["Uid"] == "0 0 0 0" && cold["Seccomp"] == "2" && cold["NoNewPrivs"] == "1",
            "cold start: {cold:?}"
        );
        let archive_s = archive.display().to_string();
        let keys = status_fields_but(&["Groups", "CapInh", "CapAmb"]);
        let on_b = OnB::new(&cri_b, &b, &archive_s, before, INTERVAL);
        on_b.handler_as_cold_start(&spec, &cold, &keys, "root")
            .await?;
        // And through containerd's restore-via-create.
        let spec = on_b
            .archive_container()
            .no_new_privs()
            .seccomp(ProfileType::RuntimeDefault);
        let restored = on_b
            .restored(&on_b.create_pod(), &spec, "restore-via-create")
            .await?;
        ensure!(
            restored["Seccomp"] == "2" && restored["NoNewPrivs"] == "1",
            "restore-via-create: {restored:?}"
        );
        Ok(())
    })
}
