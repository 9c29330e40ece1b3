//! NCCL jobs checkpointed and restored through the shim, on simulated GPUs and the simulated
//! NCCL, with gpu-ckpt's communicator layer (`gpu-ckpt.io/nccl: managed`, or the handler option
//! `Nccl = "managed"`; `NcclLayer` names the workspace's `libgpu_ckpt_nccl.so`).
//!
//! The job is `nccl_allreduce` (test-containers/gpu-workloads/c): every rank checks every element
//! of every collective against its closed form and prints `rank <r> step <k> checksum <hex>`, a
//! digest of the verified buffers. The same digests come from `collective::Sums` here, so every
//! step line of a restored rank is checked against what an uninterrupted run prints for that
//! step, and each rank's steps must go on one by one from the checkpointed step (a restart
//! prints `ready` and step 1 again; a lost or repeated step breaks the sequence).
//!
//! - 4 ranks of one container: CRI checkpoint on node A, restored through the restore
//!   RuntimeClass on node B onto 4 other GPUs;
//! - 2 containers of 2 ranks in one pod (a pod-wide cut), the same way;
//! - ctr's checkpoint that leaves the task running (communicators suspended, not destroyed):
//!   the job runs on without a restart, and the checkpoint restores on node B;
//! - one checkpoint restored into two pods at once on one node of 8 GPUs: both jobs complete on
//!   their own (the simulated NCCL refuses a rank that joins a unique id twice, so two restores
//!   sharing one would fail);
//! - a rank stuck in a collective whose peer died: the checkpoint fails within `NcclTimeout`,
//!   naming the rank and pid, and the other ranks are left running, not frozen;
//! - a restore onto a node with one GPU too few is refused before anything runs;
//! - a job that maps NCCL without the layer (no annotation) is refused at checkpoint, naming the
//!   annotation, and runs on.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use crate::common::{gpu::*, *};
use crate::gpu_shim::{archive_manifest, ctr_sh, pod_processes};
use anyhow::{bail, ensure, Context, Result};
use gpu_ckpt_gpu_workloads::collective::Sums;
use image_format::manifest::{Manifest, MANIFEST_FILE};
use simgpu::testing::SimNode;
use test_containers::{
    cri::{ContainerSpec, Cri, Pod, PodSpec},
    stack::{Node, Stack, GPU_CKPT_HANDLER, GPU_WORKLOADS_IMAGE},
};

/// The annotation that opts a pod or container into the layer.
const ANNOTATION: &str = "gpu-ckpt.io/nccl";
/// The job's parameters: small buffers, a step every 100 ms or so.
const SEED: u64 = 11;
const ELEMENTS: usize = 4096;
const INTERVAL_MS: u64 = 100;
/// `NcclTimeout` of the nodes of the stuck-rank test.
const STUCK_TIMEOUT_S: u64 = 5;
/// `NcclTimeout` of the other nodes: the bound of a quiesce, of the reconnects and of a rebuild.
const NCCL_TIMEOUT: &str = "20s";
/// How long a rank may take for the steps a test waits for.
const STEP_WAIT: Duration = Duration::from_secs(60);

/// A GPU node ([`gpu_node`], whose handlers name the workspace's layer as `NcclLayer`) with
/// `NcclTimeout` `timeout`; `managed`: `Nccl = "managed"` (every container opts in, as ctr's
/// cannot carry an annotation), else the annotation decides. The layer's Release destroys the
/// communicators (`NcclRelease`'s default), so that every resume rebuilds them on fresh ids.
fn nccl_node(name: &str, sim: &SimNode, managed: bool, timeout: &str) -> Result<Node> {
    nccl_node_with(name, sim, managed, timeout, &[])
}

/// [`nccl_node`] with `extra` handler options (`NcclRelease = "suspend"`).
fn nccl_node_with(
    name: &str,
    sim: &SimNode,
    managed: bool,
    timeout: &str,
    extra: &[(&str, &str)],
) -> Result<Node> {
    let mut options = vec![("NcclTimeout", timeout)];
    if managed {
        options.push(("Nccl", "managed"));
    }
    options.extend_from_slice(extra);
    gpu_node(name, sim, &options)
}

/// `gpus` simulated GPUs (256 MiB each) of a node of their own, UUIDs from `seed`.
fn sim(gpus: u32, seed: &str) -> Result<SimNode> {
    sim_gpus(gpus, 256, seed)
}

/// nccl_allreduce's arguments: the job's parameters and `extra` (`--ranks`, `--rank`, …).
fn job_args(extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    v.extend(
        [
            "--elements",
            &ELEMENTS.to_string(),
            "--interval-ms",
            &INTERVAL_MS.to_string(),
            "--seed",
            &SEED.to_string(),
        ]
        .map(str::to_string),
    );
    v
}

/// The CDI annotation's value for simulated GPUs `gpus` (`all`, or indices).
fn cdi_devices(gpus: &[&str]) -> String {
    gpus.iter()
        .map(|g| format!("{KIND}={g}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The CRI spec of container `name` running nccl_allreduce with `extra` on simulated GPUs
/// `gpus`, opted into the layer by its own annotation when `annotate`.
fn job_spec(name: &str, gpus: &[&str], extra: &[&str], annotate: bool) -> ContainerSpec {
    let spec = ContainerSpec::new(name, GPU_WORKLOADS_IMAGE)
        .command(&["/usr/bin/nccl_allreduce"])
        .args(&job_args(extra))
        .annotation(
            &format!("cdi.k8s.io/gpu-ckpt-sim_{name}"),
            &cdi_devices(gpus),
        );
    if annotate {
        spec.annotation(ANNOTATION, "managed")
    } else {
        spec
    }
}

/// The 4 ranks of one container on all of its node's GPUs.
fn four_ranks(annotate: bool) -> ContainerSpec {
    job_spec("job", &["all"], &["--ranks", "4"], annotate)
}

/// Each rank's `(step, checksum)` lines in `text` (CRI log lines carry a prefix), in order.
fn rank_steps(text: &str) -> BTreeMap<u32, Vec<(u64, String)>> {
    let mut m: BTreeMap<u32, Vec<(u64, String)>> = BTreeMap::new();
    for l in text.lines() {
        let Some(at) = l.find("rank ") else { continue };
        let w: Vec<&str> = l[at..].split_whitespace().collect();
        if let ["rank", r, "step", k, "checksum", sum, ..] = w[..] {
            if let (Ok(r), Ok(k)) = (r.parse(), k.parse()) {
                m.entry(r).or_default().push((k, sum.to_string()));
            }
        }
    }
    m
}

/// A line of `text` that says the job failed: a MISMATCH, or one of nccl_allreduce's error
/// lines (`nccl_allreduce: …`).
fn failure(text: &str) -> Option<&str> {
    text.lines()
        .find(|l| l.contains("MISMATCH") || l.contains("nccl_allreduce: "))
}

/// How many ranks said `ready` in `text` (each does once, after its communicators are made).
fn readies(text: &str) -> usize {
    text.lines().filter(|l| l.contains(" ready world ")).count()
}

/// The checksums an uninterrupted run prints, from the closed forms (`collective::Sums`).
struct Expected {
    world: u32,
    sums: Vec<Sums>,
}

impl Expected {
    fn new(world: u32) -> Expected {
        Expected {
            world,
            sums: (0..world)
                .map(|r| Sums::new(SEED, r, world, ELEMENTS))
                .collect(),
        }
    }

    fn checksum(&self, rank: u32, k: u64) -> String {
        format!("{:016x}", self.sums[rank as usize].digest(k))
    }

    /// Every step line of `steps` carries the checksum an uninterrupted run prints for that
    /// rank and step, and each rank's steps go on one by one; the ranks are `ranks`.
    fn check(
        &self,
        steps: &BTreeMap<u32, Vec<(u64, String)>>,
        ranks: &[u32],
        what: &str,
    ) -> Result<()> {
        let got: Vec<u32> = steps.keys().copied().collect();
        ensure!(
            got == ranks,
            "{what}: step lines of ranks {got:?}, want {ranks:?}"
        );
        for (r, s) in steps {
            ensure!(
                *r < self.world,
                "{what}: rank {r} in a world of {}",
                self.world
            );
            for w in s.windows(2) {
                ensure!(
                    w[1].0 == w[0].0 + 1,
                    "{what}: rank {r} goes from step {} to step {}: {s:?}",
                    w[0].0,
                    w[1].0
                );
            }
            for (k, sum) in s {
                let want = self.checksum(*r, *k);
                ensure!(
                    *sum == want,
                    "{what}: rank {r} step {k} prints checksum {sum}, an uninterrupted run {want}"
                );
            }
        }
        Ok(())
    }
}

/// Waits until `read()` shows every rank of `ranks` at a step of at least `at_least(rank)`;
/// fails at once when the job fails. Returns the text.
fn wait_ranks(
    read: impl Fn() -> String,
    ranks: &[u32],
    at_least: impl Fn(u32) -> u64,
    what: &str,
) -> Result<String> {
    let deadline = Instant::now() + STEP_WAIT;
    loop {
        let text = read();
        if let Some(l) = failure(&text) {
            bail!("{what}: the job failed ({l}); output:\n{text}");
        }
        let steps = rank_steps(&text);
        let last = |r: u32| steps.get(&r).and_then(|s| s.last()).map_or(0, |s| s.0);
        if ranks.iter().all(|r| last(*r) >= at_least(*r)) {
            return Ok(text);
        }
        if Instant::now() > deadline {
            bail!("{what}: timed out after {STEP_WAIT:?} waiting for the ranks' steps; output:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Each rank's last step in `text` (0 for a rank without one).
fn last_steps(text: &str, ranks: &[u32]) -> BTreeMap<u32, u64> {
    let steps = rank_steps(text);
    ranks
        .iter()
        .map(|r| {
            let last = steps.get(r).and_then(|s| s.last()).map_or(0, |s| s.0);
            (*r, last)
        })
        .collect()
}

/// The lines of CRI log `log` written at or after `since`.
fn cri_log_since(log: &Path, since: SystemTime) -> String {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .and_then(|t| humantime::parse_rfc3339(t).ok())
                .is_some_and(|t| t >= since)
        })
        .map(|l| format!("{l}\n"))
        .collect()
}

/// A restored job's output `text` (its lines since the restore) goes on from the checkpoint:
/// no rank made its communicators again (`ready`), each rank's first step follows the step it
/// had printed when the checkpoint was taken (between `before` and `after`, its last steps when
/// the checkpoint began and ended; the line of the checkpointed step itself may come again,
/// copied from the pipe after the restore), then one by one with the checksums of an
/// uninterrupted run, at least `n` steps.
fn expect_resumed(
    text: &str,
    expected: &Expected,
    ranks: &[u32],
    before: &BTreeMap<u32, u64>,
    after: &BTreeMap<u32, u64>,
    what: &str,
) -> Result<BTreeMap<u32, u64>> {
    ensure!(
        readies(text) == 0,
        "{what}: a rank started afresh after the restore:\n{text}"
    );
    let steps = rank_steps(text);
    expected.check(&steps, ranks, what)?;
    let mut first = BTreeMap::new();
    for r in ranks {
        let f = steps[r][0].0;
        let (b, a) = (before[r], after[r]);
        ensure!(
            f > 1 && f >= b && f <= a + 1,
            "{what}: rank {r} goes on at step {f}; at the checkpoint it had printed steps {b} to {a}: not where it was checkpointed"
        );
        first.insert(*r, f);
    }
    let (lo, hi) = (
        first.values().min().copied().unwrap_or(0),
        first.values().max().copied().unwrap_or(0),
    );
    ensure!(
        hi - lo <= 1,
        "{what}: the ranks go on at steps {first:?}: not one cut through the job"
    );
    println!("{what}: ranks go on at steps {first:?}");
    Ok(first)
}

/// The host pids of the nccl_allreduce ranks below `init` (the launcher of `--ranks`, itself an
/// nccl_allreduce, or a shell), once there are `n`.
fn rank_pids(init: i32, n: usize) -> Result<Vec<i32>> {
    wait_until(Duration::from_secs(20), &format!("{n} ranks"), || {
        let children = std::fs::read_to_string(format!("/proc/{init}/task/{init}/children"))
            .unwrap_or_default();
        let p: Vec<i32> = children
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .filter(|p| {
                std::fs::read_to_string(format!("/proc/{p}/comm"))
                    .is_ok_and(|c| c.trim() == "nccl_allreduce")
            })
            .collect();
        (p.len() == n).then_some(p)
    })
    .map(|mut p| {
        p.sort();
        p
    })
}

/// The ranks' pids run one on each of `sim`'s GPUs `want` (by index), and nowhere else.
fn expect_on_gpus(sim: &SimNode, pids: &[i32], want: &[usize], what: &str) -> Result<()> {
    let mut on = BTreeSet::new();
    for p in pids {
        let g = gpus_of(sim, *p)?;
        ensure!(
            g.len() == 1,
            "{what}: rank pid {p} holds {} GPUs, want one",
            g.len()
        );
        on.insert(g[0]);
    }
    let want: BTreeSet<[u8; 16]> = want.iter().map(|i| sim.node().gpus[*i].uuid).collect();
    ensure!(
        on == want,
        "{what}: the ranks run on {on:?}, want the node's GPUs {want:?}"
    );
    Ok(())
}

/// The `nccl` record of a checkpoint's manifest (JSON): the layer's hash, and one process per
/// rank of `ranks` (world ranks of a world of 4), each with its world communicator (a root key,
/// its rank of 4) and its split one (`<root key>/<color>`, 2 ranks of its parity), all the
/// processes on one world key, each recorded as `suspended` (`NcclRelease = "suspend"`) or not
/// (destroyed, the default); the step timings of the quiesce and the release.
fn expect_nccl_record(
    manifest: &serde_json::Value,
    ranks: &[i64],
    suspended: bool,
    what: &str,
) -> Result<()> {
    let rec = &manifest["nccl"];
    let procs = rec["processes"]
        .as_array()
        .with_context(|| format!("{what}: the manifest has no nccl record: {rec}"))?;
    ensure!(
        procs.len() == ranks.len(),
        "{what}: the nccl record holds {} processes, want {}: {rec}",
        procs.len(),
        ranks.len()
    );
    ensure!(
        rec["layer_blake3"].as_str().is_some_and(|h| h.len() == 64),
        "{what}: the nccl record names no layer hash: {rec}"
    );
    let mut world_ranks = BTreeSet::new();
    let mut world_keys = BTreeSet::new();
    for p in procs {
        let comms = p["comms"].as_array().cloned().unwrap_or_default();
        let world: Vec<&serde_json::Value> = comms
            .iter()
            .filter(|c| c["key"].as_str().is_some_and(|k| !k.contains('/')))
            .collect();
        let split: Vec<&serde_json::Value> = comms
            .iter()
            .filter(|c| c["key"].as_str().is_some_and(|k| k.contains('/')))
            .collect();
        ensure!(
            comms.len() == 2 && world.len() == 1 && split.len() == 1,
            "{what}: process {} records communicators {comms:?}, want its world and its split one",
            p["pid"]
        );
        let (w, sp) = (world[0], split[0]);
        let rank = w["rank"].as_i64().unwrap_or(-1);
        ensure!(
            w["nranks"] == 4 && sp["nranks"] == 2 && sp["rank"].as_i64() == Some(rank / 2),
            "{what}: process {} records world {w} and split {sp}",
            p["pid"]
        );
        ensure!(
            p["suspended"] == suspended,
            "{what}: process {} recorded with suspended {}, want {suspended} (NcclRelease)",
            p["pid"],
            p["suspended"]
        );
        world_ranks.insert(rank);
        world_keys.insert(w["key"].as_str().unwrap_or_default().to_string());
    }
    let want: BTreeSet<i64> = ranks.iter().copied().collect();
    ensure!(
        world_ranks == want && world_keys.len() == 1,
        "{what}: the record's world ranks {world_ranks:?} on keys {world_keys:?}, want ranks {want:?} on one key"
    );
    let timings: Vec<&str> = manifest["timings"]
        .as_array()
        .map(|t| t.iter().filter_map(|t| t["step"].as_str()).collect())
        .unwrap_or_default();
    for step in ["nccl-quiesce", "nccl-release"] {
        ensure!(
            timings.contains(&step),
            "{what}: the manifest's step timings {timings:?} have no {step}"
        );
    }
    Ok(())
}

/// The manifest of the CRI checkpoint archive `archive`, as JSON.
fn archive_manifest_json(archive: &Path) -> Result<serde_json::Value> {
    Ok(serde_json::to_value(archive_manifest(archive)?)?)
}

/// A 4-rank job in a pod `name` on node A, checkpointed through CRI: the archive, the pod, the
/// job's log, and each rank's last step when the checkpoint began and when it returned.
struct Checkpointed {
    archive: PathBuf,
    pod: Pod,
    log: PathBuf,
    before: BTreeMap<u32, u64>,
    after: BTreeMap<u32, u64>,
}

async fn checkpoint_four_ranks(
    node: &Node,
    cri: &Cri,
    name: &str,
    spec: &ContainerSpec,
) -> Result<Checkpointed> {
    let ranks = [0, 1, 2, 3];
    cri.pull_image(GPU_WORKLOADS_IMAGE).await?;
    let pod = cri
        .run_pod(&PodSpec::new(name, node.pod_log_root()).handler(GPU_CKPT_HANDLER))
        .await?;
    let id = cri.run_container(&pod, spec).await?;
    let log = pod.container_log("job");
    let read = || std::fs::read_to_string(&log).unwrap_or_default();
    wait_ranks(
        read,
        &ranks,
        |_| 3,
        &format!("{name} before the checkpoint"),
    )?;
    let before = last_steps(&read(), &ranks);
    let archive = node.paths().dir.join(format!("checkpoint-{name}-job.tar"));
    let _ = std::fs::remove_file(&archive);
    cri.checkpoint_container(&id, &archive, 120).await?;
    let after = last_steps(&read(), &ranks);
    println!("{name}: checkpointed between steps {before:?} and {after:?}");
    // The original runs on, its numbers right.
    let text = wait_ranks(
        read,
        &ranks,
        |r| after[&r] + 3,
        &format!("{name}, the original after the checkpoint"),
    )?;
    Expected::new(4).check(&rank_steps(&text), &ranks, &format!("{name}, the original"))?;
    ensure!(
        readies(&text) == 4,
        "{name}: the original started afresh:\n{text}"
    );
    Ok(Checkpointed {
        archive,
        pod,
        log,
        before,
        after,
    })
}

/// Restores `c` through the restore RuntimeClass into pod `name` on `node` (container `spec`),
/// and checks that every rank goes on from the checkpoint; returns the pod and the ranks' pids.
async fn restore_four_ranks(
    node: &Node,
    cri: &Cri,
    name: &str,
    c: &Checkpointed,
    spec: &ContainerSpec,
) -> Result<(Pod, Vec<i32>)> {
    let ranks = [0, 1, 2, 3];
    let pod = cri
        .run_pod(&restore_pod(name, node, &c.archive.display().to_string()))
        .await?;
    let since = SystemTime::now();
    let id = cri.run_container(&pod, spec).await?;
    let log = pod.container_log("job");
    let text = wait_ranks(
        || cri_log_since(&log, since),
        &ranks,
        |r| c.after[&r] + 3,
        &format!("{name}, restored"),
    )?;
    expect_resumed(&text, &Expected::new(4), &ranks, &c.before, &c.after, name)?;
    let pids = rank_pids(cri_pid(cri, &id).await?, 4)?;
    Ok((pod, pids))
}

/// 4 ranks in one container on node A's 4 GPUs (the container's annotation opts in),
/// checkpointed through CRI and restored through the restore RuntimeClass on node B's 4 other
/// GPUs: every rank goes on from its checkpointed step with the numbers of an uninterrupted run.
#[test]
fn four_ranks_checkpointed_through_cri_restore_on_other_gpus() -> Result<()> {
    let (sim_a, sim_b) = (sim(4, "nccl-cri-a")?, sim(4, "nccl-cri-b")?);
    ensure!(
        sim_a.uuids() != sim_b.uuids(),
        "the nodes' GPUs must differ"
    );
    let a = nccl_node("gpu-nccl-cri-a", &sim_a, false, NCCL_TIMEOUT)?;
    let b = nccl_node("gpu-nccl-cri-b", &sim_b, false, NCCL_TIMEOUT)?;
    rt().block_on(async {
        let cri_a = Cri::connect(a.socket()).await?;
        let cri_b = Cri::connect(b.socket()).await?;
        let c = checkpoint_four_ranks(&a, &cri_a, "ranks", &four_ranks(true)).await?;
        expect_nccl_record(
            &archive_manifest_json(&c.archive)?,
            &[0, 1, 2, 3],
            false,
            "CRI",
        )?;
        cri_a.remove_pod(&c.pod).await?;
        let (pod, pids) = restore_four_ranks(&b, &cri_b, "ranks", &c, &four_ranks(true)).await?;
        expect_on_gpus(&sim_b, &pids, &[0, 1, 2, 3], "restored on node B")?;
        cri_b.remove_pod(&pod).await
    })
}

/// A pod of 2 containers of 2 ranks each (ranks 0-1 on GPUs 0-1, ranks 2-3 on GPUs 2-3, the
/// unique id through a shared directory; the pod's annotation opts in): each container
/// checkpointed through CRI, one after the other, both in one cut recorded in their manifests;
/// restored through the restore RuntimeClass on node B into one pod, every rank goes on from
/// the cut.
#[test]
fn two_containers_of_two_ranks_restore_as_one_job() -> Result<()> {
    let (sim_a, sim_b) = (sim(4, "nccl-pod-a")?, sim(4, "nccl-pod-b")?);
    let a = nccl_node("gpu-nccl-pod-a", &sim_a, false, NCCL_TIMEOUT)?;
    let b = nccl_node("gpu-nccl-pod-b", &sim_b, false, NCCL_TIMEOUT)?;
    let rendezvous = Stack::discover()?
        .node_dir("gpu-nccl-pod-a")
        .join("rendezvous");
    let _ = std::fs::remove_dir_all(&rendezvous);
    std::fs::create_dir_all(&rendezvous)?;
    let spec = |name: &str, gpus: &[&str], first: &str| {
        job_spec(
            name,
            gpus,
            &[
                "--ranks",
                "2",
                "--rank",
                first,
                "--world-size",
                "4",
                "--rendezvous",
                "/rendezvous",
            ],
            false,
        )
        .host_path("/rendezvous", &rendezvous, false)
    };
    let c0 = spec("c0", &["0", "1"], "0");
    let c1 = spec("c1", &["2", "3"], "2");
    let parts: [(&str, [u32; 2]); 2] = [("c0", [0, 1]), ("c1", [2, 3])];
    let expected = Expected::new(4);
    rt().block_on(async {
        let cri_a = Cri::connect(a.socket()).await?;
        let cri_b = Cri::connect(b.socket()).await?;
        cri_a.pull_image(GPU_WORKLOADS_IMAGE).await?;
        let pod = cri_a
            .run_pod(
                &PodSpec::new("pair", a.pod_log_root())
                    .handler(GPU_CKPT_HANDLER)
                    .annotation(ANNOTATION, "managed"),
            )
            .await?;
        let ids = [
            cri_a.run_container(&pod, &c0).await?,
            cri_a.run_container(&pod, &c1).await?,
        ];
        let read =
            |name: &str| std::fs::read_to_string(pod.container_log(name)).unwrap_or_default();
        for (name, ranks) in &parts {
            wait_ranks(
                || read(name),
                ranks,
                |_| 3,
                &format!("{name} before the checkpoint"),
            )?;
        }
        let mut before = BTreeMap::new();
        for (name, ranks) in &parts {
            before.extend(last_steps(&read(name), ranks));
        }
        let mut archives = Vec::new();
        for ((name, _), id) in parts.iter().zip(&ids) {
            let archive = a.paths().dir.join(format!("checkpoint-pair-{name}.tar"));
            let _ = std::fs::remove_file(&archive);
            cri_a.checkpoint_container(id, &archive, 120).await?;
            archives.push(archive);
        }
        let mut after = BTreeMap::new();
        for (name, ranks) in &parts {
            after.extend(last_steps(&read(name), ranks));
        }
        println!("pair: checkpointed between steps {before:?} and {after:?}");
        // Both containers recorded their two ranks, in one cut of both.
        let mut cuts = Vec::new();
        let names = BTreeSet::from(["c0", "c1"]);
        let id_set: BTreeSet<&str> = ids.iter().map(String::as_str).collect();
        for ((name, ranks), archive) in parts.iter().zip(&archives) {
            let m = archive_manifest_json(archive)?;
            let ranks: Vec<i64> = ranks.iter().map(|r| i64::from(*r)).collect();
            expect_nccl_record(&m, &ranks, false, name)?;
            let cut = &m["nccl"]["cut"];
            let members: BTreeSet<&str> = cut["containers"]
                .as_array()
                .map(|c| c.iter().filter_map(|n| n.as_str()).collect())
                .unwrap_or_default();
            ensure!(
                (members == names || members == id_set) && cut["id"].is_string(),
                "{name}: the manifest's cut is {cut}, want one of both containers"
            );
            cuts.push(cut["id"].clone());
        }
        ensure!(
            cuts[0] == cuts[1],
            "the two containers were checkpointed in different cuts: {cuts:?}"
        );
        // The original runs on.
        for (name, ranks) in &parts {
            let text = wait_ranks(
                || read(name),
                ranks,
                |r| after[&r] + 3,
                &format!("{name}, the original after the checkpoints"),
            )?;
            expected.check(&rank_steps(&text), ranks, &format!("{name}, the original"))?;
        }
        cri_a.remove_pod(&pod).await?;

        let pod_r = cri_b
            .run_pod(
                &PodSpec::new("pair", b.pod_log_root())
                    .handler(RESTORE_HANDLER)
                    .annotation(ANNOTATION, "managed")
                    .annotation(
                        "gpu-ckpt.io/restore-from.c0",
                        &archives[0].display().to_string(),
                    )
                    .annotation(
                        "gpu-ckpt.io/restore-from.c1",
                        &archives[1].display().to_string(),
                    ),
            )
            .await?;
        let since = SystemTime::now();
        let r0 = cri_b.run_container(&pod_r, &c0).await?;
        let r1 = cri_b.run_container(&pod_r, &c1).await?;
        let mut pids = Vec::new();
        let mut first = BTreeMap::new();
        for (name, ranks) in &parts {
            let log = pod_r.container_log(name);
            let text = wait_ranks(
                || cri_log_since(&log, since),
                ranks,
                |r| after[&r] + 3,
                &format!("{name}, restored"),
            )?;
            let steps = rank_steps(&text);
            expected.check(&steps, ranks, name)?;
            ensure!(
                readies(&text) == 0,
                "{name}: a rank started afresh:\n{text}"
            );
            for r in ranks {
                let f = steps[r][0].0;
                ensure!(
                    f > 1 && f >= before[r] && f <= after[r] + 1,
                    "{name}: rank {r} goes on at step {f}; checkpointed between steps {} and {}",
                    before[r],
                    after[r]
                );
                first.insert(*r, f);
            }
        }
        let spread = first.values().max().unwrap_or(&0) - first.values().min().unwrap_or(&0);
        ensure!(
            spread <= 1,
            "the ranks of the two containers go on at steps {first:?}: not one cut through the job"
        );
        println!("pair: ranks go on at steps {first:?}");
        for id in [&r0, &r1] {
            pids.extend(rank_pids(cri_pid(&cri_b, id).await?, 2)?);
        }
        expect_on_gpus(&sim_b, &pids, &[0, 1, 2, 3], "the pair restored on node B")?;
        cri_b.remove_pod(&pod_r).await
    })
}

/// The job's log in a ctr container whose init is host pid `init` (a tmpfs at /out, which
/// travels with the checkpoint).
fn ctr_log(init: i32) -> String {
    std::fs::read_to_string(format!("/proc/{init}/root/out/job.log")).unwrap_or_default()
}

/// nccl_allreduce `--ranks 4` under ctr, logging into /out/job.log.
fn ctr_job(node: &Node, verb: &[&str], id: &str) -> Result<()> {
    let cmd = format!(
        "exec /usr/bin/nccl_allreduce {} > /out/job.log 2>&1",
        job_args(&["--ranks", "4"]).join(" ")
    );
    ctr_sh(node, verb, &format!("{KIND}=all"), id, &cmd)
}

/// `ctr task checkpoint --image-path` (the task keeps running) of 4 ranks on node A (the
/// handler options `Nccl = "managed"` and `NcclRelease = "suspend"`: the communicators are
/// suspended, recorded so, and resumed in place; the other tests take the default, destroyed and
/// rebuilt on fresh ids, through the resume after a CRI checkpoint): the same processes go on,
/// no rank starts afresh, with the numbers of an uninterrupted run; the checkpoint restores on
/// node B's GPUs, where every rank goes on from it.
#[test]
fn ctr_checkpoint_leaves_the_job_running_and_restores_on_another_node() -> Result<()> {
    let ranks = [0, 1, 2, 3];
    let expected = Expected::new(4);
    let (sim_a, sim_b) = (sim(4, "nccl-ctr-a")?, sim(4, "nccl-ctr-b")?);
    let suspend = [("NcclRelease", "suspend")];
    let a = nccl_node_with("gpu-nccl-ctr-a", &sim_a, true, NCCL_TIMEOUT, &suspend)?;
    let b = nccl_node_with("gpu-nccl-ctr-b", &sim_b, true, NCCL_TIMEOUT, &suspend)?;
    ctr_job(&a, &["run", "-d"], "job")?;
    let init = a.task_pid("job")?;
    let pids = rank_pids(init, 4)?;
    wait_ranks(|| ctr_log(init), &ranks, |_| 3, "before the checkpoint")?;
    let before = last_steps(&ctr_log(init), &ranks);
    let dir = a.paths().dir.join("nccl-leave-running");
    let _ = std::fs::remove_dir_all(&dir);
    a.ctr_ok(&[
        "task",
        "checkpoint",
        "--image-path",
        &dir.display().to_string(),
        "job",
    ])?;
    let after = last_steps(&ctr_log(init), &ranks);
    println!("leave-running: checkpointed between steps {before:?} and {after:?}");

    // The job runs on in the same processes, without a restart.
    let text = wait_ranks(
        || ctr_log(init),
        &ranks,
        |r| after[&r] + 5,
        "the original after the checkpoint",
    )?;
    expected.check(&rank_steps(&text), &ranks, "the original")?;
    ensure!(
        readies(&text) == 4,
        "the original started afresh after the checkpoint:\n{text}"
    );
    ensure!(
        a.task_status("job")?.contains("RUNNING") && rank_pids(init, 4)? == pids,
        "the original's ranks are not the processes checkpointed"
    );
    let manifest: serde_json::Value = serde_json::to_value(Manifest::read_from(&dir)?)?;
    expect_nccl_record(&manifest, &[0, 1, 2, 3], true, "leave-running")?;

    // On node B: the log came with the checkpoint, and goes on from it one step at a time.
    ctr_job(&b, &["container", "create"], "job")?;
    let restored = restore_from_dir(&b, "job", &dir)?;
    let text = wait_ranks(
        || ctr_log(restored),
        &ranks,
        |r| after[&r] + 3,
        "restored on node B",
    )?;
    let steps = rank_steps(&text);
    expected.check(&steps, &ranks, "restored on node B")?;
    ensure!(
        readies(&text) == 4,
        "a rank started afresh after the restore on node B:\n{text}"
    );
    for r in &ranks {
        ensure!(
            steps[r][0].0 == 1,
            "restored on node B: rank {r}'s log starts at step {}",
            steps[r][0].0
        );
    }
    expect_on_gpus(
        &sim_b,
        &rank_pids(restored, 4)?,
        &[0, 1, 2, 3],
        "restored on node B",
    )?;
    remove(&b, "job");
    remove(&a, "job");
    Ok(())
}

/// One checkpoint of 4 ranks restored at once into two pods on one node of 8 GPUs (GPUs 0-3
/// and 4-7): each job runs to its last step and exits 0 on its own, with the numbers of an
/// uninterrupted run. Two restores that shared a unique id would meet in the simulated NCCL's
/// rendezvous, which refuses a rank joining an id twice, and their rebuild would fail.
#[test]
fn one_checkpoint_restored_into_two_pods_at_once() -> Result<()> {
    const STEPS: u64 = 120;
    let ranks = [0, 1, 2, 3];
    let (sim_a, sim_b) = (sim(4, "nccl-twice-a")?, sim(8, "nccl-twice-b")?);
    let a = nccl_node("gpu-nccl-twice-a", &sim_a, false, NCCL_TIMEOUT)?;
    let b = nccl_node("gpu-nccl-twice-b", &sim_b, false, NCCL_TIMEOUT)?;
    let steps = STEPS.to_string();
    let spec = |gpus: &[&str]| job_spec("job", gpus, &["--ranks", "4", "--steps", &steps], true);
    rt().block_on(async {
        let cri_a = Cri::connect(a.socket()).await?;
        let cri_b = Cri::connect(b.socket()).await?;
        let c = checkpoint_four_ranks(&a, &cri_a, "twice", &spec(&["all"])).await?;
        cri_a.remove_pod(&c.pod).await?;
        let source = c.archive.display().to_string();
        let halves = [["0", "1", "2", "3"], ["4", "5", "6", "7"]];
        let pods = [
            cri_b.run_pod(&restore_pod("first", &b, &source)).await?,
            cri_b.run_pod(&restore_pod("second", &b, &source)).await?,
        ];
        let since = SystemTime::now();
        let (s0, s1) = (spec(&halves[0]), spec(&halves[1]));
        let (r0, r1) = tokio::join!(
            cri_b.run_container(&pods[0], &s0),
            cri_b.run_container(&pods[1], &s1)
        );
        let ids = [
            r0.context("the first restore")?,
            r1.context("the second restore")?,
        ];
        // Both run at once, each on its own 4 GPUs.
        for (i, id) in ids.iter().enumerate() {
            let pids = rank_pids(cri_pid(&cri_b, id).await?, 4)?;
            let on: Vec<usize> = (4 * i..4 * i + 4).collect();
            expect_on_gpus(&sim_b, &pids, &on, &format!("restore {i}"))?;
        }
        for (i, (pod, id)) in pods.iter().zip(&ids).enumerate() {
            let what = format!("restore {i}");
            let log = pod.container_log("job");
            let text = wait_ranks(|| cri_log_since(&log, since), &ranks, |_| STEPS, &what)?;
            expect_resumed(&text, &Expected::new(4), &ranks, &c.before, &c.after, &what)?;
            let st = cri_b
                .wait_container_state(
                    id,
                    test_containers::cri::v1::ContainerState::ContainerExited,
                    Duration::from_secs(30),
                )
                .await?;
            ensure!(
                st.exit_code == 0,
                "{what}: the job exited {} after its last step:\n{text}",
                st.exit_code
            );
        }
        for pod in &pods {
            cri_b.remove_pod(pod).await?;
        }
        Ok(())
    })
}

/// The host pid of the rank whose `RANK` is `rank` among `pids`.
fn pid_of_rank(pids: &[i32], rank: u32) -> Result<i32> {
    let want = format!("RANK={rank}");
    pids.iter()
        .copied()
        .find(|p| {
            std::fs::read(format!("/proc/{p}/environ"))
                .is_ok_and(|e| e.split(|b| *b == 0).any(|v| v == want.as_bytes()))
        })
        .with_context(|| format!("no process of rank {rank} among {pids:?}"))
}

/// The state letter of `/proc/<pid>/stat` (R, S, D, T, …).
fn proc_state(pid: i32) -> Result<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = stat.rsplit_once(')').context("/proc/<pid>/stat")?.1;
    after
        .split_whitespace()
        .next()
        .and_then(|s| s.chars().next())
        .with_context(|| format!("no state in /proc/{pid}/stat"))
}

/// Whether the cgroup freezer holds `pid`: cgroup v1's `freezer.state`, else v2's
/// `cgroup.events`.
fn frozen(pid: i32) -> Result<bool> {
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    for l in cgroups.lines() {
        let parts: Vec<&str> = l.splitn(3, ':').collect();
        if parts.len() == 3 && parts[1].split(',').any(|c| c == "freezer") {
            let f = Path::new("/sys/fs/cgroup/freezer")
                .join(parts[2].trim_start_matches('/'))
                .join("freezer.state");
            return Ok(std::fs::read_to_string(&f)?.trim() != "THAWED");
        }
    }
    let path = cgroups
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .with_context(|| format!("no cgroup of pid {pid}: {cgroups}"))?;
    let events = Path::new("/sys/fs/cgroup")
        .join(path.trim_start_matches('/'))
        .join("cgroup.events");
    Ok(std::fs::read_to_string(&events)?
        .lines()
        .any(|l| l.trim() == "frozen 1"))
}

/// 4 ranks as 4 processes of one container (a shell starts them with a rendezvous directory);
/// rank 3 is killed, so the others wait in a collective that never completes. The checkpoint
/// fails within `NcclTimeout` (5 s here) and a margin, naming a waiting rank and its pid; the
/// others are left as they were: running (not frozen), the container running, the task
/// answering.
#[test]
fn a_rank_stuck_on_a_dead_peer_fails_the_checkpoint_within_its_bound() -> Result<()> {
    let sim_a = sim(4, "nccl-stuck")?;
    let node = nccl_node(
        "gpu-nccl-stuck",
        &sim_a,
        true,
        &format!("{STUCK_TIMEOUT_S}s"),
    )?;
    let (_, survivors) = stuck_job(&node, "stuck")?;
    println!("rank 3 killed; ranks 0 to 2 {survivors:?} wait for it");

    let dir = node.paths().dir.join("nccl-stuck");
    let _ = std::fs::remove_dir_all(&dir);
    let t = Instant::now();
    let out = node.ctr(&[
        "task",
        "checkpoint",
        "--image-path",
        &dir.display().to_string(),
        "stuck",
    ])?;
    let took = t.elapsed();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    println!("the checkpoint failed after {took:?}: {}", err.trim());
    ensure!(
        !out.status.success(),
        "the checkpoint of a stuck job succeeded"
    );
    let bound = Duration::from_secs(STUCK_TIMEOUT_S + 15);
    ensure!(
        took < bound,
        "the checkpoint took {took:?} to fail, past NcclTimeout ({STUCK_TIMEOUT_S} s) and a margin"
    );
    ensure!(
        err.contains("nccl-quiesce") && err.contains(&format!("within {STUCK_TIMEOUT_S}s")),
        "the error does not say that the quiesce passed its bound of {STUCK_TIMEOUT_S}s: {err}"
    );
    // It names a waiting rank with its pid: `pid <host pid> (rank <r> of 4, …` (or of its
    // split communicator, 2 ranks).
    let named = survivors.iter().any(|(r, p)| {
        err.contains(&format!("pid {p} (rank {r} of 4"))
            || err.contains(&format!("pid {p} (rank {} of 2", r / 2))
    });
    ensure!(
        named,
        "the error names none of the waiting ranks {survivors:?} with its pid: {err}"
    );
    ensure!(
        !dir.join(MANIFEST_FILE).exists(),
        "the failed checkpoint left a manifest in {}",
        dir.display()
    );

    // Nothing is left frozen: the container runs, the task answers, the ranks are not frozen.
    ensure!(
        node.task_status("stuck")?.contains("RUNNING"),
        "the container is not running after the failed checkpoint"
    );
    let t = Instant::now();
    let ps = node.ctr_ok(&["task", "ps", "stuck"])?;
    ensure!(
        t.elapsed() < Duration::from_secs(5),
        "the task took {:?} to answer",
        t.elapsed()
    );
    for (r, p) in &survivors {
        ensure!(
            ps.contains(&p.to_string()),
            "the task lists no rank {r} (pid {p}):\n{ps}"
        );
        let state = proc_state(*p)?;
        ensure!(
            matches!(state, 'S' | 'R'),
            "rank {r} (pid {p}) is in state {state} after the failed checkpoint"
        );
        ensure!(!frozen(*p)?, "rank {r} (pid {p}) is still frozen");
    }
    remove(&node, "stuck");
    Ok(())
}

/// Four single-rank processes on `node` (one per GPU, meeting through a rendezvous directory),
/// container `id`, with rank 3 killed and the others stopped in the collective it never joins:
/// the container's init and the host pids of ranks 0 to 2.
fn stuck_job(node: &Node, id: &str) -> Result<(i32, Vec<(u32, i32)>)> {
    let ranks = [0, 1, 2, 3];
    let one = job_args(&["--rendezvous", "/tmp/rendezvous"]).join(" ");
    let cmd = format!(
        "mkdir -p /tmp/rendezvous; for r in 0 1 2 3; do \
         RANK=$r WORLD_SIZE=4 LOCAL_RANK=$r /usr/bin/nccl_allreduce {one} > /out/rank-$r.log 2>&1 & \
         done; wait; sleep 100000"
    );
    ctr_sh(node, &["run", "-d"], &format!("{KIND}=all"), id, &cmd)?;
    let init = node.task_pid(id)?;
    let log = |r: u32| {
        std::fs::read_to_string(format!("/proc/{init}/root/out/rank-{r}.log")).unwrap_or_default()
    };
    let all = || (0..4).map(log).collect::<String>();
    let pids = rank_pids(init, 4)?;
    wait_ranks(all, &ranks, |_| 3, "the 4 ranks")?;
    let dead = pid_of_rank(&pids, 3)?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(dead),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    wait_until(Duration::from_secs(10), "rank 3 to die", || {
        (!Path::new(&format!("/proc/{dead}")).exists() || proc_state(dead).is_ok_and(|s| s == 'Z'))
            .then_some(())
    })?;
    let mut stuck = None;
    for _ in 0..20 {
        let now = last_steps(&all(), &ranks[..3]);
        std::thread::sleep(Duration::from_millis(4 * INTERVAL_MS + 500));
        if last_steps(&all(), &ranks[..3]) == now {
            stuck = Some(now);
            break;
        }
    }
    stuck.context("the other ranks go on stepping without rank 3")?;
    let survivors = (0..3)
        .map(|r| Ok((r, pid_of_rank(&pids, r)?)))
        .collect::<Result<_>>()?;
    Ok((init, survivors))
}

/// A Kill while the checkpoint's quiesce waits for ranks stuck on a dead peer, with a bound of
/// 300 s: the kill, not the bound, ends the quiesce, and the task stops at once (the quiesce
/// holds the container's lock, which Kill needs).
#[test]
fn a_kill_during_an_nccl_quiesce_ends_it_at_once() -> Result<()> {
    let sim_a = sim(4, "nccl-kill")?;
    let node = nccl_node("gpu-nccl-kill", &sim_a, true, "300s")?;
    let (init, survivors) = stuck_job(&node, "victim")?;
    println!("ranks 0 to 2 {survivors:?} wait for rank 3, which is dead");
    let image = node.paths().dir.join("nccl-kill").display().to_string();
    let start = Instant::now();
    let (out, took, killed) = std::thread::scope(|s| -> Result<_> {
        let ckpt = s.spawn(|| {
            let out = node.ctr(&["task", "checkpoint", "--image-path", &image, "victim"]);
            (out, start.elapsed())
        });
        // The checkpoint's Pause quiesces first; give it time to be waiting on the ranks.
        std::thread::sleep(Duration::from_secs(2));
        let t = Instant::now();
        node.ctr_ok(&["task", "kill", "-s", "SIGKILL", "victim"])?;
        wait_until(Duration::from_secs(60), "the killed init to go", || {
            (!Path::new(&format!("/proc/{init}")).exists()
                || proc_state(init).is_ok_and(|s| s == 'Z'))
            .then_some(())
        })?;
        let killed = t.elapsed();
        let (out, took) = ckpt
            .join()
            .map_err(|_| anyhow::anyhow!("the checkpoint thread panicked"))?;
        Ok((out, took, killed))
    })?;
    let out = out?;
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    println!("kill during the NCCL quiesce: init gone in {killed:?}; checkpoint failed after {took:?}: {err}");
    ensure!(
        !out.status.success(),
        "the checkpoint succeeded though its task was killed"
    );
    ensure!(
        err.contains("nccl-quiesce")
            && err.contains("was not quiesced: the container is being killed"),
        "the checkpoint's error does not say the kill ended its quiesce: {err}"
    );
    ensure!(killed < Duration::from_secs(10), "the kill took {killed:?}");
    ensure!(
        took < Duration::from_secs(60),
        "the checkpoint took {took:?} (its quiesce's bound is 300 s)"
    );
    remove(&node, "victim");
    Ok(())
}

/// A restore of 4 ranks onto a node with 3 GPUs: refused before anything runs (no process of
/// the pod, none on the node's GPUs, no line of the job), naming the GPU count.
#[test]
fn a_restore_with_a_gpu_missing_is_refused_before_anything_runs() -> Result<()> {
    let (sim_a, sim_b) = (sim(4, "nccl-missing-a")?, sim(3, "nccl-missing-b")?);
    let a = nccl_node("gpu-nccl-missing-a", &sim_a, false, NCCL_TIMEOUT)?;
    let b = nccl_node("gpu-nccl-missing-b", &sim_b, false, NCCL_TIMEOUT)?;
    rt().block_on(async {
        let cri_a = Cri::connect(a.socket()).await?;
        let cri_b = Cri::connect(b.socket()).await?;
        let c = checkpoint_four_ranks(&a, &cri_a, "missing", &four_ranks(true)).await?;
        cri_a.remove_pod(&c.pod).await?;
        let pod = cri_b
            .run_pod(&restore_pod(
                "missing",
                &b,
                &c.archive.display().to_string(),
            ))
            .await?;
        let err = match cri_b.run_container(&pod, &four_ranks(true)).await {
            Ok(id) => bail!("a restore of 4 ranks onto 3 GPUs started container {id}"),
            // tonic writes the status message with Debug escapes.
            Err(e) => format!("{e:#}").replace("\\\"", "\""),
        };
        println!("3 GPUs: {err}");
        ensure!(
            err.contains("gpu_count: checkpoint \"4\", node \"3\"")
                && err.contains("failed to create"),
            "the refusal is not the Create's, naming the GPU count 4 against 3: {err}"
        );
        let left = pod_processes(&pod.spec.uid);
        ensure!(
            left.is_empty(),
            "the refused restore left processes {left:?}"
        );
        let on_gpus = sim_b.processes()?;
        ensure!(
            on_gpus.is_empty(),
            "the refused restore left processes on node B's GPUs: {on_gpus:?}"
        );
        let text = std::fs::read_to_string(pod.container_log("job")).unwrap_or_default();
        ensure!(
            rank_steps(&text).is_empty(),
            "a rank of the refused restore ran:\n{text}"
        );
        cri_b.remove_pod(&pod).await?;
        // The original job's log was not touched by the refusal.
        ensure!(c.log.exists(), "the original's log is gone");
        Ok(())
    })
}

/// 2 ranks on a node whose handler injects no layer (`Nccl` off, no annotation): the
/// checkpoint is refused naming the annotation that enables the layer, and the job runs on in
/// the same processes, its numbers right.
#[test]
fn nccl_without_the_layer_is_refused_naming_the_annotation() -> Result<()> {
    let ranks = [0, 1];
    let sim_a = sim(2, "nccl-nolayer")?;
    let node = nccl_node("gpu-nccl-nolayer", &sim_a, false, NCCL_TIMEOUT)?;
    let cmd = format!(
        "exec /usr/bin/nccl_allreduce {} > /out/job.log 2>&1",
        job_args(&["--ranks", "2"]).join(" ")
    );
    ctr_sh(&node, &["run", "-d"], &format!("{KIND}=all"), "plain", &cmd)?;
    let init = node.task_pid("plain")?;
    let pids = rank_pids(init, 2)?;
    wait_ranks(|| ctr_log(init), &ranks, |_| 3, "before the checkpoint")?;
    for p in &pids {
        let maps = std::fs::read_to_string(format!("/proc/{p}/maps"))?;
        ensure!(
            maps.contains("libnccl.so") && !maps.contains("libgpu-ckpt-nccl"),
            "rank pid {p} should map NCCL and not the layer"
        );
    }
    let out = node.ctr(&["task", "checkpoint", "plain"])?;
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    println!("refused: {}", err.trim());
    ensure!(!out.status.success(), "NCCL without the layer checkpointed");
    ensure!(
        err.contains(ANNOTATION) && err.contains("maps NCCL"),
        "the refusal does not name {ANNOTATION}: {err}"
    );
    ensure!(
        pids.iter().any(|p| err.contains(&format!("pid {p} ("))),
        "the refusal names no rank pid of {pids:?}: {err}"
    );
    let now = last_steps(&ctr_log(init), &ranks);
    let text = wait_ranks(
        || ctr_log(init),
        &ranks,
        |r| now[&r] + 3,
        "after the refusal",
    )?;
    Expected::new(2).check(&rank_steps(&text), &ranks, "after the refusal")?;
    ensure!(
        readies(&text) == 2 && rank_pids(init, 2)? == pids,
        "the job started afresh after the refusal"
    );
    ensure!(
        node.task_status("plain")?.contains("RUNNING"),
        "the job is not running after the refusal"
    );
    remove(&node, "plain");
    Ok(())
}
