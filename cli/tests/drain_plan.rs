//! `gpu-ckpt drain-plan` on recorded `kubectl get pods -o json` / `kubectl get nodes -o json`
//! lists (tests/fixtures/drain-plan/): a mixed node, a node whose workloads have nowhere to go, a
//! driver upgrade across three node pools, malformed input, nodes whose GPU labels are unknown,
//! and pods with ReadWriteOnce / ReadWriteMany claims (`kubectl get pods,pvc -A -o json`).

mod command;

use std::path::{Path, PathBuf};

use gpu_ckpt_cli::drain_plan::{
    self, kube, Disposition, NodePlan, Options, Plan, PodClass, PodPlan, SkippedNode, StepKind,
    Upgrade,
};
use serde_json::Value;

const REGISTRY: &str = "registry.example.com/gpu-ckpt";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/drain-plan")
        .join(name)
}

fn load(pods: &str, nodes: &str) -> (Vec<kube::PodEntry>, Vec<kube::NodeEntry>) {
    let p = std::fs::read(fixture(pods)).unwrap();
    let n = std::fs::read(fixture(nodes)).unwrap();
    (
        kube::parse_pods(pods, &p).unwrap(),
        kube::parse_nodes(nodes, &n).unwrap(),
    )
}

fn plan_for(pods: &str, nodes: &str, opts: Options) -> Plan {
    let (p, n) = load(pods, nodes);
    drain_plan::plan(&p, &n, &opts).unwrap()
}

/// The plan of draining one node.
fn plan_node(pods: &str, nodes: &str, node: &str) -> Plan {
    plan_for(
        pods,
        nodes,
        Options {
            nodes: vec![node.into()],
            ..opts()
        },
    )
}

/// `(node, why)` of a list of nodes and reasons.
fn whys(nodes: &[SkippedNode]) -> Vec<(&str, &str)> {
    nodes
        .iter()
        .map(|s| (s.node.as_str(), s.why.as_str()))
        .collect()
}

fn opts() -> Options {
    Options {
        registry: REGISTRY.into(),
        ..Options::default()
    }
}

fn upgrade(spec: &str) -> Option<Upgrade> {
    let mut u = Upgrade::default();
    u.add(spec).unwrap();
    Some(u)
}

fn pod<'a>(n: &'a NodePlan, name: &str) -> &'a PodPlan {
    n.pods
        .iter()
        .find(|p| p.name == name)
        .unwrap_or_else(|| panic!("no pod {name} in the plan of {}", n.node))
}

fn kinds(n: &NodePlan) -> Vec<(StepKind, Option<String>, Option<String>)> {
    n.steps
        .iter()
        .map(|s| (s.kind, s.pod.clone(), s.container.clone()))
        .collect()
}

/// `gpu-ckpt drain-plan --pods PODS --nodes NODES --node NODE --registry REGISTRY EXTRA…`, the
/// lists being fixtures.
fn drain_plan_cli(pods: &str, nodes: &str, node: &str, extra: &[&str]) -> (i32, String, String) {
    let (pods, nodes) = (fixture(pods), fixture(nodes));
    let mut args = vec![
        "drain-plan",
        "--pods",
        pods.to_str().unwrap(),
        "--nodes",
        nodes.to_str().unwrap(),
        "--node",
        node,
        "--registry",
        REGISTRY,
    ];
    args.extend_from_slice(extra);
    gpu_ckpt(&args)
}

/// The plan as JSON (`--output json` after `extra`), the command having exited `code`.
fn json_plan(pods: &str, nodes: &str, node: &str, extra: &[&str], code: i32) -> Value {
    let mut args = extra.to_vec();
    args.extend(["--output", "json"]);
    let (got, out, err) = drain_plan_cli(pods, nodes, node, &args);
    assert_eq!(got, code, "{err}");
    serde_json::from_str(&out).unwrap()
}

fn gpu_ckpt(args: &[&str]) -> (i32, String, String) {
    command::run(args, &[])
}

#[test]
fn a_mixed_node_gets_ordered_steps_and_every_pod_a_fate() {
    let plan = plan_node("mixed-pods.json", "mixed-nodes.json", "gpu-a");
    assert!(plan.complete, "{:?}", plan.without_destination);
    assert_eq!(plan.groups.len(), 1);
    let n = &plan.groups[0].nodes[0];
    assert_eq!(n.node, "gpu-a");
    assert_eq!(n.kubelet, "10.128.0.11");
    assert_eq!(n.before, n.after);
    // Only gpu-a's pods, in the list's order.
    let names: Vec<&str> = n.pods.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "nvidia-device-plugin-daemonset-x7k2p",
            "gpu-ckpt-node-installer-x7k2p",
            "llm-server-7d9f8b6c5d-x2x4k",
            "trainer-0",
            "notebook-alice",
            "render-job-29118400-q8wzd",
            "frontend-5f7c9d8b6-lq4mn",
            "report-29118340-7tq2c",
        ]
    );

    // DaemonSet pods stay.
    for ds in [
        "nvidia-device-plugin-daemonset-x7k2p",
        "gpu-ckpt-node-installer-x7k2p",
    ] {
        let p = pod(n, ds);
        assert_eq!(p.class, PodClass::DaemonSet);
        assert!(
            matches!(&p.disposition, Disposition::Stays { why } if why.contains("--ignore-daemonsets"))
        );
    }
    // gpu-ckpt pods move: the 2-GPU server to the fullest node that fits (gpu-d has 3 free,
    // gpu-b 6), the 4-GPU trainer to the only node left with room. gpu-c (driver 580) never.
    let llm = pod(n, "llm-server-7d9f8b6c5d-x2x4k");
    assert_eq!(llm.class, PodClass::GpuCkpt);
    assert_eq!(llm.gpus, 2);
    assert_eq!(
        llm.disposition,
        Disposition::Migrate {
            destination: "gpu-d".into(),
            candidates: vec!["gpu-b".into(), "gpu-d".into()],
        }
    );
    assert_eq!(
        llm.images["server"],
        "registry.example.com/gpu-ckpt/ml/llm-server-7d9f8b6c5d-x2x4k-server:drain-gpu-a"
    );
    let trainer = pod(n, "trainer-0");
    assert_eq!(
        trainer.disposition,
        Disposition::Migrate {
            destination: "gpu-b".into(),
            candidates: vec!["gpu-b".into()],
        }
    );
    assert!(trainer
        .notes
        .iter()
        .any(|x| x.contains("\"scratch\" is an emptyDir")));
    // A gpu-ckpt pod whose container crash-loops cannot be checkpointed.
    let nb = pod(n, "notebook-alice");
    match &nb.disposition {
        Disposition::CannotCheckpoint { why, then } => {
            assert_eq!(
                why,
                "container \"jupyter\" is not running: waiting (CrashLoopBackOff)"
            );
            assert!(then.contains("no controller"), "{then}");
        }
        other => panic!("notebook: {other:?}"),
    }
    // Plain pods are evicted; a GPU one is told it restarts from scratch.
    let job = pod(n, "render-job-29118400-q8wzd");
    assert_eq!(job.class, PodClass::Plain);
    assert!(
        matches!(&job.disposition, Disposition::Evicted { then } if then.contains("Job/render-job-29118400 starts a new pod"))
    );
    assert!(job
        .notes
        .iter()
        .any(|x| x.contains("not on a gpu-ckpt RuntimeClass")));
    assert_eq!(pod(n, "frontend-5f7c9d8b6-lq4mn").class, PodClass::Plain);
    assert_eq!(
        pod(n, "report-29118340-7tq2c").disposition,
        Disposition::Finished
    );

    // The steps, in order.
    let s = |k: StepKind, p: Option<&str>, c: Option<&str>| {
        (k, p.map(String::from), c.map(String::from))
    };
    let llm_id = Some("ml/llm-server-7d9f8b6c5d-x2x4k");
    let tr = Some("ml/trainer-0");
    assert_eq!(
        kinds(n),
        [
            s(StepKind::Cordon, None, None),
            s(StepKind::Checkpoint, llm_id, Some("server")),
            s(StepKind::BuildPush, llm_id, Some("server")),
            s(StepKind::CreateRestorePod, llm_id, None),
            s(StepKind::WaitReady, llm_id, None),
            s(StepKind::Checkpoint, tr, Some("trainer")),
            s(StepKind::BuildPush, tr, Some("trainer")),
            s(StepKind::Checkpoint, tr, Some("metrics")),
            s(StepKind::BuildPush, tr, Some("metrics")),
            s(StepKind::CreateRestorePod, tr, None),
            s(StepKind::WaitReady, tr, None),
            s(StepKind::Drain, None, None),
            s(StepKind::Maintenance, None, None),
            s(StepKind::Uncordon, None, None),
        ]
    );
    let call = n.steps[1].kubelet.as_ref().unwrap();
    assert_eq!(call.method, "POST");
    assert_eq!(
        call.url,
        "https://10.128.0.11:10250/checkpoint/ml/llm-server-7d9f8b6c5d-x2x4k/server?timeout=600"
    );
    assert_eq!(
        n.steps[2].command.as_deref().unwrap(),
        [
            "gpu-ckpt",
            "build",
            "ARCHIVE",
            "--ref",
            "registry.example.com/gpu-ckpt/ml/llm-server-7d9f8b6c5d-x2x4k-server:drain-gpu-a",
            "--push"
        ]
    );
    // The drain: a bare pod needs --force, the trainer's emptyDir --delete-emptydir-data.
    assert_eq!(
        n.steps[11].command.as_deref().unwrap(),
        [
            "kubectl",
            "drain",
            "gpu-a",
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--force",
            "--timeout=900s"
        ]
    );

    // The restore pods.
    let m = n.steps[3].manifest.as_ref().unwrap();
    assert_eq!(m["metadata"]["name"], "llm-server-7d9f8b6c5d-x2x4k-restore");
    assert_eq!(m["metadata"]["namespace"], "ml");
    assert_eq!(m["spec"]["runtimeClassName"], "gpu-ckpt-restore");
    assert_eq!(
        m["metadata"]["annotations"]["gpu-ckpt.io/restore-from"],
        "registry.example.com/gpu-ckpt/ml/llm-server-7d9f8b6c5d-x2x4k-server:drain-gpu-a"
    );
    // The pod's own declarations go with it; what the API server and controllers set does not.
    assert_eq!(
        m["metadata"]["annotations"]["gpu-ckpt.io/engine-version"],
        "vllm 0.11.0"
    );
    assert_eq!(m["metadata"]["labels"]["app"], "llm-server");
    assert!(m["metadata"]["labels"].get("pod-template-hash").is_none());
    assert!(m["metadata"].get("ownerReferences").is_none());
    assert!(m["metadata"].get("uid").is_none());
    assert!(m["spec"].get("nodeName").is_none());
    assert!(m.get("status").is_none());
    assert_eq!(
        m["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "2"
    );
    let term = &m["spec"]["affinity"]["nodeAffinity"]
        ["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
        ["matchExpressions"][0];
    assert_eq!(term["key"], "kubernetes.io/hostname");
    assert_eq!(term["values"], serde_json::json!(["gpu-d"]));
    // Two containers: one restore-from per container.
    let m = n.steps[9].manifest.as_ref().unwrap();
    let a = &m["metadata"]["annotations"];
    assert_eq!(
        a["gpu-ckpt.io/restore-from.trainer"],
        "registry.example.com/gpu-ckpt/ml/trainer-0-trainer:drain-gpu-a"
    );
    assert_eq!(
        a["gpu-ckpt.io/restore-from.metrics"],
        "registry.example.com/gpu-ckpt/ml/trainer-0-metrics:drain-gpu-a"
    );
    assert!(a.get("gpu-ckpt.io/restore-from").is_none());
    assert!(m["metadata"]["labels"]
        .get("statefulset.kubernetes.io/pod-name")
        .is_none());
}

#[test]
fn workloads_without_a_compatible_destination_are_named_with_the_field_that_differs() {
    let plan = plan_for(
        "nodest-pods.json",
        "nodest-nodes.json",
        Options {
            nodes: vec!["a100-1".into()],
            upgrade: upgrade("driver=580.65.06,cuda=13.0"),
            ..opts()
        },
    );
    assert!(!plan.complete);
    assert_eq!(
        plan.without_destination,
        [
            "research/llm-finetune-0 on a100-1",
            "research/sim-worker on a100-1"
        ]
    );
    let n = &plan.groups[0].nodes[0];
    for (name, gpus) in [("llm-finetune-0", 2), ("sim-worker", 1)] {
        let p = pod(n, name);
        let Disposition::NoDestination { rejected, then } = &p.disposition else {
            panic!("{name}: {:?}", p.disposition)
        };
        assert!(
            then.starts_with("not checkpointed: no node can restore it."),
            "{then}"
        );
        let why = |node: &str| -> Vec<String> {
            rejected
                .iter()
                .find(|r| r.node == node)
                .unwrap_or_else(|| panic!("{name}: no rejection for {node}: {rejected:?}"))
                .reasons
                .clone()
        };
        assert_eq!(
            why("h100-1"),
            [r#"gpu_model: checkpoint "NVIDIA-A100-SXM4-80GB", node "NVIDIA-H100-80GB-HBM3""#]
        );
        assert_eq!(
            why("a100-2"),
            [
                r#"driver_version: checkpoint "570.86.15", node "580.65.06""#,
                r#"cuda_driver_version: checkpoint "12.8", node "13.0""#
            ]
        );
        assert_eq!(
            why("a100-3"),
            [format!(
                "free GPUs: the workload needs {gpus}, the node has 0 free"
            )]
        );
        assert_eq!(why("a100-4"), ["cordoned (spec.unschedulable)"]);
        assert_eq!(
            why("a100-5"),
            [
                r#"gpu-ckpt is not installed (label node-restriction.kubernetes.io/gpu-ckpt-runtime is not "installed")"#
            ]
        );
        // The node itself after its upgrade does not fit either.
        assert_eq!(
            why("a100-1 (after the maintenance)"),
            [
                r#"driver_version: checkpoint "570.86.15", node "580.65.06""#,
                r#"cuda_driver_version: checkpoint "12.8", node "13.0""#
            ]
        );
        assert!(p.images.is_empty() && p.restore_pod.is_none());
    }
    // Nothing to checkpoint, nothing to restore: cordon, drain, upgrade, relabel, uncordon.
    assert_eq!(
        n.steps.iter().map(|s| s.kind).collect::<Vec<_>>(),
        [
            StepKind::Cordon,
            StepKind::Drain,
            StepKind::Maintenance,
            StepKind::Relabel,
            StepKind::Uncordon
        ]
    );
    assert_eq!(
        n.steps[3].command.as_deref().unwrap(),
        [
            "kubectl",
            "label",
            "node",
            "a100-1",
            "--overwrite",
            "node-restriction.kubernetes.io/gpu-ckpt-driver-version=580.65.06",
            "node-restriction.kubernetes.io/gpu-ckpt-cuda-version=13.0"
        ]
    );

    // The text says so per workload, and the command exits 1.
    let (code, out, err) = drain_plan_cli(
        "nodest-pods.json",
        "nodest-nodes.json",
        "a100-1",
        &["--upgrade", "driver=580.65.06,cuda=13.0"],
    );
    assert_eq!(code, 1, "{err}");
    assert!(out.contains("    research/llm-finetune-0 [gpu-ckpt, 2 GPU(s), StatefulSet/llm-finetune]\n      NO COMPATIBLE DESTINATION: "), "{out}");
    assert!(out.contains(
        "        h100-1: gpu_model: checkpoint \"NVIDIA-A100-SXM4-80GB\", node \"NVIDIA-H100-80GB-HBM3\"\n"
    ));
    assert!(out.contains("2 gpu-ckpt workload(s) have no compatible destination:\n  research/llm-finetune-0 on a100-1\n  research/sim-worker on a100-1\n"), "{out}");
}

#[test]
fn a_kernel_patch_with_nowhere_else_to_go_restores_on_the_node_after_uncordon() {
    // Same cluster, no upgrade: the node keeps its versions, so it takes its workloads back.
    let plan = plan_node("nodest-pods.json", "nodest-nodes.json", "a100-1");
    assert!(plan.complete);
    let n = &plan.groups[0].nodes[0];
    let p = pod(n, "llm-finetune-0");
    assert!(
        matches!(&p.disposition, Disposition::RestoreAfterMaintenance { rejected } if rejected.len() == 5)
    );
    let k: Vec<StepKind> = n.steps.iter().map(|s| s.kind).collect();
    let uncordon = k.iter().position(|s| *s == StepKind::Uncordon).unwrap();
    let create = k
        .iter()
        .position(|s| *s == StepKind::CreateRestorePod)
        .unwrap();
    assert!(create > uncordon, "restore pods before uncordon: {k:?}");
    assert!(k[..uncordon].contains(&StepKind::Checkpoint));
    let m = n.steps[create].manifest.as_ref().unwrap();
    assert_eq!(m["metadata"]["name"], "llm-finetune-0-restore");
    assert_eq!(
        m["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"][0]["matchExpressions"][0]["values"],
        serde_json::json!(["a100-1"])
    );
}

#[test]
fn a_driver_upgrade_across_three_node_groups() {
    let plan = plan_for(
        "fleet-pods.json",
        "fleet-nodes.json",
        Options {
            upgrade: upgrade("driver=580.65.06,cuda=13.0"),
            group_by: Some("cloud.google.com/gke-nodepool".into()),
            ..opts()
        },
    );
    // gpu-n1 already runs the target, cpu-1 is no gpu-ckpt node.
    let skipped = whys(&plan.skipped_nodes);
    assert_eq!(
        skipped,
        [
            ("gpu-n1", "already runs driver 580.65.06, CUDA 13.0"),
            (
                "cpu-1",
                "not a gpu-ckpt node (label node-restriction.kubernetes.io/gpu-ckpt-runtime is not \"installed\")"
            )
        ]
    );
    // The groups, in order: pool-a first (4 GPUs to move, and pools b and c on 570 to take
    // them), then pool-b, whose workloads still find 570 nodes in pool-c; pool-c last.
    let groups: Vec<(String, Vec<&str>)> = plan
        .groups
        .iter()
        .map(|g| {
            (
                g.label_value.clone().unwrap_or_default(),
                g.nodes.iter().map(|n| n.node.as_str()).collect(),
            )
        })
        .collect();
    assert_eq!(
        groups,
        [
            ("pool-a".to_string(), vec!["gpu-a1", "gpu-a2"]),
            ("pool-b".to_string(), vec!["gpu-b1", "gpu-b2"]),
            ("pool-c".to_string(), vec!["gpu-c1", "gpu-c2"]),
        ]
    );
    let node = |g: usize, name: &str| -> &NodePlan {
        plan.groups[g]
            .nodes
            .iter()
            .find(|n| n.node == name)
            .unwrap()
    };
    for g in &plan.groups {
        for n in &g.nodes {
            assert_eq!(n.before.driver_version, "570.86.15");
            assert_eq!(n.after.driver_version, "580.65.06");
            assert_eq!(n.after.cuda_version, "13.0");
        }
    }
    // Group 1: chat-0 may go to any node still on 570 outside its group; the fullest that fits.
    assert_eq!(
        pod(node(0, "gpu-a1"), "chat-0").disposition,
        Disposition::Migrate {
            destination: "gpu-c1".into(),
            candidates: vec![
                "gpu-b1".into(),
                "gpu-b2".into(),
                "gpu-c1".into(),
                "gpu-c2".into()
            ],
        }
    );
    // Group 2: pool-a runs 580 now, so only pool-c can take them; gpu-c1 is full.
    for (n, p) in [("gpu-b1", "vision-0"), ("gpu-b2", "speech-0")] {
        assert_eq!(
            pod(node(1, n), p).disposition,
            Disposition::Migrate {
                destination: "gpu-c2".into(),
                candidates: vec!["gpu-c2".into()],
            }
        );
    }
    // Group 3: no node on 570 is left; each workload, restored ones included, is named with
    // the field that differs.
    let last: Vec<(&str, &str)> = plan.groups[2]
        .nodes
        .iter()
        .flat_map(|n| {
            n.pods
                .iter()
                .filter(|p| p.class == PodClass::GpuCkpt)
                .map(move |p| (n.node.as_str(), p.name.as_str()))
        })
        .collect();
    assert_eq!(
        last,
        [
            ("gpu-c1", "chat-0-restore"),
            ("gpu-c1", "train-0"),
            ("gpu-c2", "vision-0-restore"),
            ("gpu-c2", "speech-0-restore"),
            ("gpu-c2", "search-0"),
        ]
    );
    for n in &plan.groups[2].nodes {
        for p in n.pods.iter().filter(|p| p.class == PodClass::GpuCkpt) {
            let Disposition::NoDestination { rejected, .. } = &p.disposition else {
                panic!("{}: {:?}", p.name, p.disposition)
            };
            let a1 = rejected.iter().find(|r| r.node == "gpu-a1").unwrap();
            assert_eq!(
                a1.reasons,
                [
                    r#"driver_version: checkpoint "570.86.15", node "580.65.06""#,
                    r#"cuda_driver_version: checkpoint "12.8", node "13.0""#
                ]
            );
        }
    }
    assert_eq!(plan.without_destination.len(), 5);
    assert!(plan.notes[0].contains("driver branch from 570 to 580"));
    // A restored pod is checkpointed under its new name, and its next restore counts up.
    let chat = pod(node(2, "gpu-c1"), "chat-0-restore");
    assert_eq!(chat.owner, None);

    // Within the branch (570.86.15 -> 570.195.03) a GPU checkpoint restores only on its exact
    // driver version too (its processes map libcuda.so.570.86.15, which an upgraded node no
    // longer has): workloads move only to nodes not yet upgraded, those of the last group have
    // nowhere to go, each upgraded node rejected naming the versions, and a note says why.
    let plan = plan_for(
        "fleet-pods.json",
        "fleet-nodes.json",
        Options {
            nodes: ["gpu-a1", "gpu-a2", "gpu-b1", "gpu-b2", "gpu-c1", "gpu-c2"]
                .map(String::from)
                .to_vec(),
            upgrade: upgrade("driver=570.195.03"),
            group_by: Some("cloud.google.com/gke-nodepool".into()),
            ..opts()
        },
    );
    assert!(!plan.complete);
    assert!(
        plan.notes
            .iter()
            .any(|n| n.contains("from 570.86.15 to 570.195.03 within its branch")),
        "{:?}",
        plan.notes
    );
    let b1 = plan
        .groups
        .iter()
        .flat_map(|g| g.nodes.iter())
        .find(|n| n.node == "gpu-b1")
        .unwrap();
    assert_eq!(b1.after.cuda_version, "12.8", "same branch keeps CUDA");
    let mut upgraded: Vec<String> = Vec::new();
    let (mut moved, mut stranded) = (0, 0);
    for g in &plan.groups {
        for n in &g.nodes {
            for p in &n.pods {
                match &p.disposition {
                    Disposition::Migrate {
                        destination,
                        candidates,
                    } => {
                        moved += 1;
                        for c in candidates.iter().chain([destination]) {
                            assert!(!upgraded.contains(c), "{}: {c} is upgraded", p.name);
                        }
                    }
                    Disposition::NoDestination { rejected, .. } => {
                        stranded += 1;
                        assert!(
                            plan.without_destination
                                .contains(&format!("{}/{} on {}", p.namespace, p.name, n.node)),
                            "{:?}",
                            plan.without_destination
                        );
                        for r in rejected.iter().filter(|r| upgraded.contains(&r.node)) {
                            assert!(
                                r.reasons.contains(
                                    &r#"driver_version: checkpoint "570.86.15", node "570.195.03""#
                                        .to_string()
                                ),
                                "{}: {:?}",
                                p.name,
                                r.reasons
                            );
                        }
                    }
                    _ => {}
                }
            }
        }
        upgraded.extend(g.nodes.iter().map(|n| n.node.clone()));
    }
    assert!(
        moved > 0 && stranded > 0,
        "moved {moved}, stranded {stranded}"
    );
    assert_eq!(plan.without_destination.len(), stranded);
    // gpu-n1 (driver 580) takes nothing: another branch.
    for g in &plan.groups {
        for n in &g.nodes {
            for p in &n.pods {
                if let Disposition::Migrate { candidates, .. } = &p.disposition {
                    assert!(!candidates.contains(&"gpu-n1".to_string()));
                }
            }
        }
    }
}

#[test]
fn group_size_forms_groups_without_a_label() {
    let plan = plan_for(
        "fleet-pods.json",
        "fleet-nodes.json",
        Options {
            upgrade: upgrade("driver=580.65.06,cuda=13.0"),
            group_size: 2,
            ..opts()
        },
    );
    assert!(plan.groups.iter().all(|g| g.nodes.len() <= 2));
    let all: usize = plan.groups.iter().map(|g| g.nodes.len()).sum();
    assert_eq!(all, 6);
    // The empty node goes first: nothing to move.
    assert!(plan.groups[0].nodes.iter().any(|n| n.node == "gpu-a2"));
}

#[test]
fn malformed_input_gets_an_error_naming_the_field() {
    let bytes = std::fs::read(fixture("malformed-pods.json")).unwrap();
    let err = kube::parse_pods("pods.json", &bytes)
        .unwrap_err()
        .to_string();
    assert_eq!(err, "pods.json: items[3].spec.containers: missing");

    let bad = |doc: Value| {
        kube::parse_pods("pods.json", doc.to_string().as_bytes())
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        bad(serde_json::json!({"kind": "List", "items": [{"metadata": {"name": "x"}, "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "two"}}}]}}]})),
        "pods.json: items[0].spec.containers[0].resources.limits[\"nvidia.com/gpu\"]: \"two\" is not a whole number of GPUs"
    );
    assert_eq!(
        bad(
            serde_json::json!({"kind": "List", "items": [{"metadata": {}, "spec": {"containers": []}}]})
        ),
        "pods.json: items[0].metadata.name: missing"
    );
    assert_eq!(
        bad(
            serde_json::json!({"kind": "List", "items": [{"metadata": {"name": "x"}, "spec": {"containers": "c"}}]})
        ),
        "pods.json: items[0].spec.containers: invalid type: string \"c\", expected a sequence"
    );
    assert_eq!(
        bad(serde_json::json!({"kind": "NodeList", "items": []})),
        "pods.json: kind: \"NodeList\": expected \"List\" or \"PodList\" (the output of `kubectl get pods -o json`)"
    );
    let err = kube::parse_pods("pods.json", b"{\"kind\": \"List\", \"items\": [").unwrap_err();
    assert!(
        err.to_string().starts_with("pods.json: not JSON: "),
        "{err}"
    );
    let err = kube::parse_nodes(
        "nodes.json",
        br#"{"kind":"List","items":[{"metadata":{"name":"n"},"status":{"allocatable":{"nvidia.com/gpu":-1}}}]}"#,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "nodes.json: items[0].status.allocatable[\"nvidia.com/gpu\"]: -1 is not a whole number of GPUs"
    );

    // The command: exit 2, the error on stderr, nothing on stdout.
    let (code, out, err) = drain_plan_cli("malformed-pods.json", "mixed-nodes.json", "gpu-a", &[]);
    assert_eq!(code, 2);
    assert!(out.is_empty(), "{out}");
    assert!(
        err.contains("malformed-pods.json: items[3].spec.containers: missing"),
        "{err}"
    );
    // Flags: an unknown node, an unknown upgrade key.
    let (code, _, err) = drain_plan_cli("mixed-pods.json", "mixed-nodes.json", "gpu-zz", &[]);
    assert_eq!(code, 2);
    assert!(
        err.contains("--node gpu-zz: no such node in the node list"),
        "{err}"
    );
}

#[test]
fn the_json_output_is_the_plan() {
    let v = json_plan(
        "mixed-pods.json",
        "mixed-nodes.json",
        "gpu-a",
        &["--checkpoint-timeout", "1200"],
        0,
    );
    assert_eq!(v["complete"], true);
    let steps = v["groups"][0]["nodes"][0]["steps"].as_array().unwrap();
    assert_eq!(steps[0]["kind"], "cordon");
    assert_eq!(steps[1]["kind"], "checkpoint");
    assert_eq!(steps[1]["kubelet"]["timeout_s"], 1200);
    assert!(steps[1]["kubelet"]["url"]
        .as_str()
        .unwrap()
        .ends_with("/checkpoint/ml/llm-server-7d9f8b6c5d-x2x4k/server?timeout=1200"));
    assert_eq!(steps[3]["kind"], "create-restore-pod");
    assert_eq!(
        steps[3]["manifest"]["spec"]["runtimeClassName"],
        "gpu-ckpt-restore"
    );
    let pods = v["groups"][0]["nodes"][0]["pods"].as_array().unwrap();
    let llm = pods
        .iter()
        .find(|p| p["name"] == "llm-server-7d9f8b6c5d-x2x4k")
        .unwrap();
    assert_eq!(llm["action"], "migrate");
    assert_eq!(llm["destination"], "gpu-d");
    assert_eq!(llm["class"], "gpu-ckpt");
}

#[test]
fn a_renamed_restore_runtime_class_is_the_restore_pods() {
    // The chart renamed the restore class (runtimeClasses.restore.name): the restore pods get
    // that name, and pods already on it are gpu-ckpt pods.
    let v = json_plan(
        "mixed-pods.json",
        "mixed-nodes.json",
        "gpu-a",
        &["--restore-runtime-class", "ml-restore"],
        0,
    );
    let steps = v["groups"][0]["nodes"][0]["steps"].as_array().unwrap();
    let creates: Vec<&Value> = steps
        .iter()
        .filter(|s| s["kind"] == "create-restore-pod")
        .collect();
    assert!(!creates.is_empty(), "no restore pod in {v}");
    for s in creates {
        assert_eq!(
            s["manifest"]["spec"]["runtimeClassName"], "ml-restore",
            "{s}"
        );
        assert!(
            s["text"]
                .as_str()
                .unwrap()
                .contains("(RuntimeClass ml-restore,"),
            "{}",
            s["text"]
        );
    }
    let (code, _, err) = drain_plan_cli(
        "mixed-pods.json",
        "mixed-nodes.json",
        "gpu-a",
        &["--restore-runtime-class", ""],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--restore-runtime-class is empty"), "{err}");
}

/// The labels the node installer sets from NVML, as `unknown-nodes.json` misses them: gpu-x has
/// only the runtime label (the installer could not read its GPUs), gpu-z has them empty.
const UNKNOWN_GPU_X: &str = "GPU labels unknown: node-restriction.kubernetes.io/gpu-ckpt-gpu-model, node-restriction.kubernetes.io/gpu-ckpt-driver-version, node-restriction.kubernetes.io/gpu-ckpt-cuda-version missing or empty on a node with GPUs (8 nvidia.com/gpu); the node installer could not read its GPUs";

#[test]
fn a_gpu_node_with_unknown_labels_is_never_a_destination_and_its_gpu_workloads_have_none() {
    // Draining the node whose labels are unknown: its GPU workload's checkpoint would carry
    // unknown versions, so it has no destination (gpu-z, whose labels are as empty as gpu-x's,
    // is not offered); a workload without GPUs moves, but not to an unknown node.
    let plan = plan_node("unknown-pods.json", "unknown-nodes.json", "gpu-x");
    assert!(!plan.complete);
    assert_eq!(plan.without_destination, ["ml/llm-0 on gpu-x"]);
    let unknown = whys(&plan.unknown_nodes);
    assert_eq!(
        unknown,
        [("gpu-x", UNKNOWN_GPU_X), ("gpu-z", UNKNOWN_GPU_X)]
    );
    let n = &plan.groups[0].nodes[0];
    assert_eq!(n.gpu_labels_unknown.as_deref(), Some(UNKNOWN_GPU_X));
    let llm = pod(n, "llm-0");
    let Disposition::NoDestination { rejected, then } = &llm.disposition else {
        panic!("llm-0: {:?}", llm.disposition)
    };
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert_eq!(rejected[0].node, "gpu-x (the pod's node)");
    assert_eq!(
        rejected[0].reasons,
        [format!("{UNKNOWN_GPU_X}: the GPU model, driver and CUDA versions its checkpoint would carry are unknown, so no node can be judged able to restore it")]
    );
    assert!(
        then.starts_with("not checkpointed: its GPU versions are unknown. evicted by the drain"),
        "{then}"
    );
    assert!(llm.images.is_empty() && llm.restore_pod.is_none());
    assert_eq!(
        pod(n, "tokenizer").disposition,
        Disposition::Migrate {
            destination: "cpu-1".into(),
            candidates: vec!["cpu-1".into(), "gpu-w".into(), "gpu-y".into()],
        }
    );
    // Only the workload that moves is checkpointed.
    assert_eq!(
        kinds(n)
            .iter()
            .filter(|(k, _, _)| *k == StepKind::Checkpoint)
            .map(|(_, p, _)| p.clone())
            .collect::<Vec<_>>(),
        [Some("ml/tokenizer".to_string())]
    );

    // Draining a node with known labels: the unknown nodes are rejected with the reason, the
    // workload waits for its own node.
    let plan = plan_node("unknown-pods.json", "unknown-nodes.json", "gpu-y");
    let n = &plan.groups[0].nodes[0];
    assert_eq!(n.gpu_labels_unknown, None);
    let Disposition::RestoreAfterMaintenance { rejected } = &pod(n, "embed-0").disposition else {
        panic!("embed-0: {:?}", pod(n, "embed-0").disposition)
    };
    let why: Vec<(&str, Vec<&str>)> = rejected
        .iter()
        .map(|r| {
            (
                r.node.as_str(),
                r.reasons.iter().map(String::as_str).collect(),
            )
        })
        .collect();
    assert_eq!(
        why,
        [
            ("cpu-1", vec!["no GPUs (nvidia.com/gpu)"]),
            (
                "gpu-w",
                vec!["free GPUs: the workload needs 1, the node has 0 free"]
            ),
            ("gpu-x", vec![UNKNOWN_GPU_X]),
            ("gpu-z", vec![UNKNOWN_GPU_X]),
        ]
    );

    // The command: the text names the unknown nodes and the reason, and exits 1 as for any
    // workload without a destination.
    let (code, out, err) = drain_plan_cli("unknown-pods.json", "unknown-nodes.json", "gpu-x", &[]);
    assert_eq!(code, 1, "{err}");
    assert!(out.contains(&format!(
        "Nodes whose GPU labels are unknown (never a destination):\n  gpu-x: {UNKNOWN_GPU_X}\n  gpu-z: {UNKNOWN_GPU_X}\n"
    )), "{out}");
    assert!(
        out.contains(&format!(
            "\nNode gpu-x (kubelet 10.128.0.31): {UNKNOWN_GPU_X}\n"
        )),
        "{out}"
    );
    assert!(!out.contains("no GPUs, driver , CUDA "), "{out}");
    assert!(out.contains("    ml/llm-0 [gpu-ckpt, 2 GPU(s), StatefulSet/llm]\n      NO COMPATIBLE DESTINATION: not checkpointed: its GPU versions are unknown."), "{out}");
    assert!(
        out.contains(&format!(
            "\n        gpu-x (the pod's node): {UNKNOWN_GPU_X}: the GPU model"
        )),
        "{out}"
    );
    assert!(
        out.contains(
            "1 gpu-ckpt workload(s) have no compatible destination:\n  ml/llm-0 on gpu-x\n"
        ),
        "{out}"
    );
    // JSON: the same, and the same exit code.
    let v = json_plan("unknown-pods.json", "unknown-nodes.json", "gpu-x", &[], 1);
    assert_eq!(v["complete"], false);
    assert_eq!(
        v["without_destination"],
        serde_json::json!(["ml/llm-0 on gpu-x"])
    );
    assert_eq!(v["unknown_nodes"][0]["node"], "gpu-x");
    assert_eq!(v["unknown_nodes"][0]["why"], UNKNOWN_GPU_X);
    assert_eq!(v["unknown_nodes"][1]["node"], "gpu-z");
    let node = &v["groups"][0]["nodes"][0];
    assert_eq!(node["gpu_labels_unknown"], UNKNOWN_GPU_X);
    let llm = node["pods"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "llm-0")
        .unwrap();
    assert_eq!(llm["action"], "no-destination");
    assert_eq!(llm["rejected"][0]["node"], "gpu-x (the pod's node)");
    assert!(llm["rejected"][0]["reasons"][0]
        .as_str()
        .unwrap()
        .starts_with(UNKNOWN_GPU_X));
    // A node with known labels carries no such field.
    let v = json_plan("unknown-pods.json", "unknown-nodes.json", "gpu-y", &[], 0);
    assert!(v["groups"][0]["nodes"][0]
        .get("gpu_labels_unknown")
        .is_none());
}

#[test]
fn a_read_write_once_claim_is_moved_by_deleting_the_original_before_the_restore() {
    // `kubectl get pods,pvc -A -o json`: db-0 mounts a ReadWriteOnce claim, trainer-1 a
    // ReadWriteMany and a ReadOnlyMany one (read-only), legacy-0 one the list does not hold.
    let plan = plan_node("rwo-pods.json", "mixed-nodes.json", "gpu-a");
    assert!(plan.complete, "{:?}", plan.without_destination);
    let n = &plan.groups[0].nodes[0];
    let names: Vec<&str> = n.pods.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["db-0", "trainer-1", "legacy-0"]);
    let db = pod(n, "db-0");
    assert!(
        matches!(&db.disposition, Disposition::Migrate { destination, .. } if destination == "gpu-b")
    );
    assert_eq!(db.single_node_claims, ["data-db-0"]);
    assert_eq!(
        db.downtime.as_deref(),
        Some("from the deletion of ml/db-0 until ml/db-0-restore is Ready on gpu-b: claim(s) \"data-db-0\" attach to one node at a time, so the original is deleted after its checkpoint and its volumes detach from gpu-a; then the images are built and pushed, and the restore pod attaches the volumes on gpu-b and restores")
    );
    assert_eq!(
        db.notes,
        [
            "volume \"data\" is PersistentVolumeClaim \"data-db-0\" (ReadWriteOnce): it attaches to one node at a time, so a move to another node deletes the original after its checkpoint, before the restore pod is created",
            "owned by StatefulSet/db: deleting the original makes StatefulSet/db start a replacement, which may attach claim(s) \"data-db-0\" before the restore pod does, and the restore pod has no owner: scale StatefulSet/db down by one before the deletion",
        ]
    );
    let tr = pod(n, "trainer-1");
    assert!(tr.single_node_claims.is_empty() && tr.downtime.is_none());
    assert_eq!(
        tr.notes,
        [
            "volume \"datasets\" is PersistentVolumeClaim \"datasets\" (ReadWriteMany): it must be attachable on the destination; the restore pod mounts it there while the original still runs, until the drain",
            "volume \"models\" is PersistentVolumeClaim \"models\" (ReadOnlyMany): it must be attachable on the destination; the restore pod mounts it there while the original still runs, until the drain",
        ]
    );
    let legacy = pod(n, "legacy-0");
    assert_eq!(legacy.single_node_claims, ["legacy-state"]);
    assert!(legacy.downtime.is_some());
    assert_eq!(
        legacy.notes,
        ["volume \"state\" is PersistentVolumeClaim \"legacy-state\", which is not in the pod list: its access modes are unknown, so it is planned as ReadWriteOnce (give `kubectl get pods,pvc -A -o json` for its modes)"]
    );

    // The order: a single-node claim's pod is checkpointed (every container), deleted, and only
    // then restored; the shared claims' pod keeps the order that restores before the drain.
    let s = |k: StepKind, p: &str, c: Option<&str>| (k, Some(p.to_string()), c.map(String::from));
    let none = |k: StepKind| (k, None, None);
    assert_eq!(
        kinds(n),
        [
            none(StepKind::Cordon),
            s(StepKind::Checkpoint, "ml/db-0", Some("db")),
            s(StepKind::Checkpoint, "ml/db-0", Some("backup")),
            s(StepKind::DeleteOriginal, "ml/db-0", None),
            s(StepKind::BuildPush, "ml/db-0", Some("db")),
            s(StepKind::BuildPush, "ml/db-0", Some("backup")),
            s(StepKind::CreateRestorePod, "ml/db-0", None),
            s(StepKind::WaitReady, "ml/db-0", None),
            s(StepKind::Checkpoint, "ml/trainer-1", Some("main")),
            s(StepKind::BuildPush, "ml/trainer-1", Some("main")),
            s(StepKind::CreateRestorePod, "ml/trainer-1", None),
            s(StepKind::WaitReady, "ml/trainer-1", None),
            s(StepKind::Checkpoint, "ml/legacy-0", Some("main")),
            s(StepKind::DeleteOriginal, "ml/legacy-0", None),
            s(StepKind::BuildPush, "ml/legacy-0", Some("main")),
            s(StepKind::CreateRestorePod, "ml/legacy-0", None),
            s(StepKind::WaitReady, "ml/legacy-0", None),
            none(StepKind::Drain),
            none(StepKind::Maintenance),
            none(StepKind::Uncordon),
        ]
    );
    let delete = &n.steps[3];
    assert_eq!(
        delete.text,
        "delete ml/db-0 so that claim(s) \"data-db-0\" detach from gpu-a: its checkpoint is taken; the workload is down from here until ml/db-0-restore is Ready"
    );
    assert_eq!(
        delete.command.as_deref().unwrap(),
        [
            "kubectl",
            "delete",
            "pod",
            "-n",
            "ml",
            "db-0",
            "--wait=true",
            "--timeout=900s"
        ]
    );
    // The restore pod mounts the claim.
    let m = n.steps[6].manifest.as_ref().unwrap();
    assert_eq!(
        m["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"],
        "data-db-0"
    );
    // The drain evicts only what is still there: trainer-1, which has no controller.
    let drain = &n.steps[17];
    assert!(
        drain.text.starts_with("drain gpu-a: evicts its 1 pod(s)"),
        "{}",
        drain.text
    );
    assert_eq!(
        drain.command.as_deref().unwrap(),
        [
            "kubectl",
            "drain",
            "gpu-a",
            "--ignore-daemonsets",
            "--force",
            "--timeout=900s"
        ]
    );

    // Text and JSON; a complete plan exits 0.
    let (code, out, err) = drain_plan_cli("rwo-pods.json", "mixed-nodes.json", "gpu-a", &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("    ml/db-0 [gpu-ckpt, 1 GPU(s), StatefulSet/db]\n      checkpoint, delete the original, restore as db-0-restore on gpu-b (nodes that can take it: gpu-b, gpu-d)\n      downtime: from the deletion of ml/db-0 until ml/db-0-restore is Ready on gpu-b: "), "{out}");
    assert!(out.contains("    ml/trainer-1 [gpu-ckpt, 2 GPU(s)]\n      checkpoint, restore as trainer-1-restore on gpu-b"), "{out}");
    assert!(out.contains("    4. delete ml/db-0 so that claim(s) \"data-db-0\" detach from gpu-a: its checkpoint is taken; the workload is down from here until ml/db-0-restore is Ready\n       $ kubectl delete pod -n ml db-0 --wait=true --timeout=900s\n    5. on gpu-a, as root: gpu-ckpt build"), "{out}");
    let v = json_plan("rwo-pods.json", "mixed-nodes.json", "gpu-a", &[], 0);
    let node = &v["groups"][0]["nodes"][0];
    let steps: Vec<(String, String)> = node["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["kind"].as_str().unwrap().to_string(),
                s["pod"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    let at = |kind: &str, pod: &str| {
        steps
            .iter()
            .position(|(k, p)| k == kind && p == pod)
            .unwrap_or_else(|| panic!("no {kind} of {pod} in {steps:?}"))
    };
    assert!(at("checkpoint", "ml/db-0") < at("delete-original", "ml/db-0"));
    assert!(at("delete-original", "ml/db-0") < at("create-restore-pod", "ml/db-0"));
    assert!(at("create-restore-pod", "ml/db-0") < at("wait-ready", "ml/db-0"));
    assert!(at("wait-ready", "ml/trainer-1") < at("drain", ""));
    assert!(!steps
        .iter()
        .any(|(k, p)| k == "delete-original" && p == "ml/trainer-1"));
    let pods = node["pods"].as_array().unwrap();
    let db = pods.iter().find(|p| p["name"] == "db-0").unwrap();
    assert_eq!(db["action"], "migrate");
    assert_eq!(db["single_node_claims"], serde_json::json!(["data-db-0"]));
    assert!(db["downtime"]
        .as_str()
        .unwrap()
        .starts_with("from the deletion of ml/db-0 until ml/db-0-restore is Ready on gpu-b"));
    let tr = pods.iter().find(|p| p["name"] == "trainer-1").unwrap();
    assert!(tr.get("single_node_claims").is_none() && tr.get("downtime").is_none());

    // A list with another kind of object is refused, naming it.
    let err = kube::parse_pods(
        "pods.json",
        br#"{"kind":"List","items":[{"kind":"Service","metadata":{"name":"s"}}]}"#,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "pods.json: items[0].kind: \"Service\": expected \"Pod\" or \"PersistentVolumeClaim\" (the output of `kubectl get pods,pvc -o json`)"
    );
}
