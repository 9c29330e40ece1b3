//! The plan as text for a person.

use std::fmt::Write as _;

use super::{Disposition, NodePlan, Plan, PodClass, PodPlan};

/// Renders the plan.
pub fn render(plan: &Plan) -> String {
    let mut out = String::new();
    let nodes: usize = plan.groups.iter().map(|g| g.nodes.len()).sum();
    match &plan.upgrade {
        Some(u) => {
            let _ = writeln!(
                out,
                "Drain plan: upgrade to {} on {nodes} node(s) in {} group(s)",
                u.describe(),
                plan.groups.len()
            );
        }
        None => {
            let _ = writeln!(
                out,
                "Drain plan: maintenance of {nodes} node(s) in {} group(s)",
                plan.groups.len()
            );
        }
    }
    if plan.groups.len() > 1 {
        let _ = writeln!(out, "\nUpgrade groups, in order:");
        for g in &plan.groups {
            let names: Vec<&str> = g.nodes.iter().map(|n| n.node.as_str()).collect();
            let label = g
                .label_value
                .as_ref()
                .map(|v| format!(" ({v})"))
                .unwrap_or_default();
            let _ = writeln!(out, "  {}.{label} {}", g.number, names.join(", "));
        }
    }
    if !plan.unknown_nodes.is_empty() {
        let _ = writeln!(
            out,
            "\nNodes whose GPU labels are unknown (never a destination):"
        );
        for s in &plan.unknown_nodes {
            let _ = writeln!(out, "  {}: {}", s.node, s.why);
        }
    }
    if !plan.skipped_nodes.is_empty() {
        let _ = writeln!(out, "\nNodes not maintained:");
        for s in &plan.skipped_nodes {
            let _ = writeln!(out, "  {}: {}", s.node, s.why);
        }
    }
    for g in &plan.groups {
        let label = g
            .label_value
            .as_ref()
            .map(|v| format!(" ({v})"))
            .unwrap_or_default();
        let _ = writeln!(out, "\n=== Group {}{label} ===", g.number);
        for n in &g.nodes {
            node(&mut out, n);
        }
    }
    let _ = writeln!(out);
    for n in &plan.notes {
        let _ = writeln!(out, "Note: {n}");
    }
    if plan.complete {
        let _ = writeln!(out, "Every gpu-ckpt workload has somewhere to resume.");
    } else {
        let _ = writeln!(
            out,
            "{} gpu-ckpt workload(s) have no compatible destination:",
            plan.without_destination.len()
        );
        for w in &plan.without_destination {
            let _ = writeln!(out, "  {w}");
        }
    }
    out
}

fn node(out: &mut String, n: &NodePlan) {
    match &n.gpu_labels_unknown {
        Some(why) => {
            let _ = writeln!(out, "\nNode {} (kubelet {}): {why}", n.node, n.kubelet);
        }
        None => {
            let _ = writeln!(
                out,
                "\nNode {} (kubelet {}): {} GPUs, driver {}, CUDA {}",
                n.node,
                n.kubelet,
                n.before.gpu_model_or_none(),
                n.before.driver_version,
                n.before.cuda_version
            );
        }
    }
    if n.after != n.before {
        let _ = writeln!(
            out,
            "  after the maintenance: driver {}, CUDA {}",
            n.after.driver_version, n.after.cuda_version
        );
    }
    let _ = writeln!(out, "\n  Pods:");
    if n.pods.is_empty() {
        let _ = writeln!(out, "    (none)");
    }
    for p in &n.pods {
        pod(out, p);
    }
    let _ = writeln!(out, "\n  Steps:");
    for s in &n.steps {
        let _ = writeln!(out, "  {:>3}. {}", s.number, s.text);
        if let Some(c) = &s.command {
            if s.kubelet.is_none()
                && s.manifest.is_none()
                && !matches!(s.kind, super::StepKind::BuildPush)
            {
                let _ = writeln!(out, "       $ {}", c.join(" "));
            }
        }
    }
}

fn pod(out: &mut String, p: &PodPlan) {
    let class = match p.class {
        PodClass::GpuCkpt => "gpu-ckpt",
        PodClass::Plain => "plain",
        PodClass::DaemonSet => "DaemonSet",
        PodClass::Static => "static",
        PodClass::Finished => "finished",
    };
    let owner = p
        .owner
        .as_ref()
        .map(|o| format!(", {o}"))
        .unwrap_or_default();
    let _ = writeln!(
        out,
        "    {}/{} [{class}, {} GPU(s){owner}]",
        p.namespace, p.name, p.gpus
    );
    match &p.disposition {
        Disposition::Migrate {
            destination,
            candidates,
        } => {
            let _ = writeln!(
                out,
                "      checkpoint, {}restore as {} on {destination} (nodes that can take it: {})",
                if p.single_node_claims.is_empty() {
                    ""
                } else {
                    "delete the original, "
                },
                p.restore_pod.as_deref().unwrap_or(""),
                candidates.join(", ")
            );
        }
        Disposition::RestoreAfterMaintenance { rejected } => {
            let _ = writeln!(
                out,
                "      checkpoint, restore as {} on this node after its maintenance: no other node can take it",
                p.restore_pod.as_deref().unwrap_or("")
            );
            for r in rejected {
                let _ = writeln!(out, "        {}: {}", r.node, r.reasons.join("; "));
            }
        }
        Disposition::NoDestination { rejected, then } => {
            let _ = writeln!(out, "      NO COMPATIBLE DESTINATION: {then}");
            for r in rejected {
                let _ = writeln!(out, "        {}: {}", r.node, r.reasons.join("; "));
            }
        }
        Disposition::CannotCheckpoint { why, then } => {
            let _ = writeln!(out, "      cannot be checkpointed: {why}; {then}");
        }
        Disposition::Evicted { then } => {
            let _ = writeln!(out, "      {then}");
        }
        Disposition::Stays { why } => {
            let _ = writeln!(out, "      stays: {why}");
        }
        Disposition::Finished => {
            let _ = writeln!(out, "      finished: the drain deletes it");
        }
    }
    if let Some(d) = &p.downtime {
        let _ = writeln!(out, "      downtime: {d}");
    }
    for note in &p.notes {
        let _ = writeln!(out, "      note: {note}");
    }
}

impl super::Versions {
    fn gpu_model_or_none(&self) -> &str {
        if self.gpu_model.is_empty() {
            "no"
        } else {
            &self.gpu_model
        }
    }
}
