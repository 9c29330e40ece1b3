//! The node key's life on real nodes (docs/security.md, "Keys"): `gpu-ckpt key rotate` makes a
//! new key while checkpoints signed with the old one still restore where it is trusted, and
//! `gpu-ckpt key revoke` makes a node refuse a key's checkpoints even though it trusts the key.
//! And what a pod learns from a refusal: one text for every checkpoint it may not use (another
//! namespace's, a missing one, an unsigned one, one outside `RestoreSources`), the reason only
//! in the node's log.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;
use anyhow::{ensure, Context, Result};
use test_containers::{
    cri::{Cri, PodSpec},
    stack::{Node, OptValue, GPU_CKPT_HANDLER},
};

/// The restore handler of the restoring nodes.
const HANDLER: &str = "restore-keys";

/// A node with gpu-ckpt's handler and [`HANDLER`], both with a key of the node's own, the
/// handler trusting the keys in `trusted` (if any).
fn key_node(name: &str, trusted: Option<&Path>) -> Result<Node> {
    let keys = node_key_dir(name);
    let _ = std::fs::remove_dir_all(&keys);
    let key = keys.join("node.key").display().to_string();
    let mut h = restore_handler(name, HANDLER)?;
    h.options
        .insert("SigningKey".to_string(), OptValue::from(key.clone()));
    if let Some(dir) = trusted {
        h.options
            .insert("TrustedKeysDir".to_string(), OptValue::from(dir));
    }
    node_with(
        Node::builder(name)?
            .runtime_option("SigningKey", key)
            .extra_runtime(h),
    )
}

/// Checkpoints a counter of a new pod in `namespace` on `node` into `archive`; the pod is
/// removed. Returns the count before the checkpoint.
async fn checkpoint(cri: &Cri, node: &Node, namespace: &str, archive: &Path) -> Result<u64> {
    let pod = cri
        .run_pod(
            &PodSpec::new("worker", node.pod_log_root())
                .namespace(namespace)
                .handler(GPU_CKPT_HANDLER),
        )
        .await?;
    let id = cri.run_container(&pod, &counter_spec()).await?;
    let before = cri_counter_above(cri, &id, "/counter.txt", 3).await?;
    let _ = std::fs::remove_file(archive);
    cri.checkpoint_container(&id, archive, 60).await?;
    cri.remove_pod(&pod).await?;
    Ok(before)
}

/// The key id `gpu-ckpt inspect` reads from the signature of `archive`.
fn signer_id(archive: &Path) -> Result<String> {
    let out = run_ok(
        Command::new(gpu_ckpt_cli())
            .args(["inspect", "--json"])
            .arg(archive),
    )?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let id = v[0]["signer"]["key_id"]
        .as_str()
        .with_context(|| format!("no signer in {out}"))?;
    Ok(id.to_string())
}

/// The value after `label` on a line of `out`, up to the next space.
fn field<'a>(out: &'a str, label: &str) -> Result<&'a str> {
    out.lines()
        .find_map(|l| l.strip_prefix(label))
        .and_then(|v| v.split_whitespace().next())
        .with_context(|| format!("no {label:?} in {out}"))
}

#[test]
fn a_rotated_key_keeps_old_checkpoints_and_a_revoked_one_is_refused() -> Result<()> {
    let trusted = node_key_dir("krot-b").with_file_name("krot-b-trusted");
    let _ = std::fs::remove_dir_all(&trusted);
    std::fs::create_dir_all(&trusted)?;
    let a = key_node("krot-a", None)?;
    let b = key_node("krot-b", Some(&trusted))?;
    let cli = gpu_ckpt_cli();
    let a_key = node_key_dir("krot-a").join("node.key");
    let b_key = node_key_dir("krot-b").join("node.key");
    rt().block_on(async {
        let cri_a = Cri::connect(a.socket()).await?;
        let cri_b = Cri::connect(b.socket()).await?;
        cri_a.pull_image(workloads()).await?;
        cri_b.pull_image(workloads()).await?;

        // Checkpoint 1, signed with A's first key.
        let one: PathBuf = a.paths().dir.join("checkpoint-key-1.tar");
        let before_one = checkpoint(&cri_a, &a, "default", &one).await?;
        let id_one = signer_id(&one)?;

        // Rotation on A: a new key; the old public key kept.
        let out = run_ok(
            Command::new(&cli)
                .args(["key", "rotate", "--key"])
                .arg(&a_key),
        )?;
        println!("{out}");
        let id_two = field(&out, "new key: ")?.to_string();
        let new_pub = PathBuf::from(field(&out, "public key: ")?);
        ensure!(
            field(&out, "retired key: ")? == id_one,
            "the retired key is not checkpoint 1's signer {id_one}: {out}"
        );
        let old_pub = PathBuf::from(
            out.lines()
                .find_map(|l| l.split("(public key kept in ").nth(1))
                .and_then(|r| r.strip_suffix(')'))
                .with_context(|| format!("no retired public key file in {out}"))?,
        );
        ensure!(id_two != id_one, "rotation kept the key {id_one}");
        ensure!(new_pub == node_key_dir("krot-a").join("node.pub"), "{out}");

        // Checkpoint 2, signed with the new key; A still trusts checkpoint 1 (its retired key).
        let two: PathBuf = a.paths().dir.join("checkpoint-key-2.tar");
        checkpoint(&cri_a, &a, "default", &two).await?;
        let signer_two = signer_id(&two)?;
        ensure!(
            signer_two == id_two,
            "checkpoint 2 is signed by {signer_two}, not the new key {id_two}"
        );
        let out = run_ok(
            Command::new(&cli)
                .arg("verify")
                .arg(&one)
                .arg("--key")
                .arg(&a_key),
        )?;
        ensure!(out.contains("trusted: this node's retired key"), "{out}");

        // B trusts both public keys: both restore.
        std::fs::copy(&old_pub, trusted.join("krot-a-1.pub"))?;
        std::fs::copy(&new_pub, trusted.join("krot-a-2.pub"))?;
        let s_one = one.display().to_string();
        let s_two = two.display().to_string();
        let first = try_restore(&cri_b, &b, HANDLER, "default", &s_one)
            .await?
            .map_err(anyhow::Error::msg)
            .context("checkpoint 1 on B, both keys trusted")?;
        ensure!(
            first >= before_one,
            "restored at {first}, checkpointed after {before_one}"
        );
        try_restore(&cri_b, &b, HANDLER, "default", &s_two)
            .await?
            .map_err(anyhow::Error::msg)
            .context("checkpoint 2 on B, both keys trusted")?;

        // Key 1 revoked on B (by its public key file): checkpoint 1 refused with the one text,
        // the node's log naming the revocation; checkpoint 2 restores.
        let out = run_ok(
            Command::new(&cli)
                .args(["key", "revoke"])
                .arg(trusted.join("krot-a-1.pub"))
                .arg("--key")
                .arg(&b_key),
        )?;
        println!("{out}");
        ensure!(field(&out, "revoked: ")? == id_one, "{out}");
        let msg = try_restore(&cri_b, &b, HANDLER, "default", &s_one)
            .await?
            .err()
            .context("checkpoint 1 restored on B after its key was revoked")?;
        let text = refusal_text(&msg, &s_one)?;
        println!("revoked: {text}");
        ensure!(!msg.contains("revoked"), "the pod learns the reason: {msg}");
        ensure!(
            refusal_logged(&b, &s_one, &["revoked", &id_one]),
            "the node's log does not name the revocation of {id_one}"
        );
        try_restore(&cri_b, &b, HANDLER, "default", &s_two)
            .await?
            .map_err(anyhow::Error::msg)
            .context("checkpoint 2 on B after key 1 was revoked")?;

        // `gpu-ckpt verify` on B: revoked, non-zero; checkpoint 2 verifies.
        let verify = |archive: &Path| {
            Command::new(&cli)
                .arg("verify")
                .arg(archive)
                .arg("--key")
                .arg(&b_key)
                .arg("--trusted-keys")
                .arg(&trusted)
                .output()
        };
        let out = verify(&one)?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        println!("verify checkpoint 1: {stderr}");
        ensure!(
            !out.status.success(),
            "verify passed a revoked key's checkpoint"
        );
        ensure!(
            stderr.contains("revoked") && stderr.contains(&id_one),
            "verify does not say {id_one} is revoked: {stderr}"
        );
        let out = verify(&two)?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        ensure!(
            out.status.success() && stdout.contains(&format!("signer: {id_two} (trusted")),
            "verify of checkpoint 2: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    })
}

#[test]
fn every_checkpoint_a_pod_may_not_use_gets_one_answer() -> Result<()> {
    let n = key_node("krefuse", None)?;
    rt().block_on(async {
        let cri = Cri::connect(n.socket()).await?;
        cri.pull_image(workloads()).await?;
        let dir = n.paths().dir.clone();
        // tenant-a's checkpoint, signed by this node's key.
        let theirs = dir.join("checkpoint-tenant-a.tar");
        checkpoint(&cri, &n, "tenant-a", &theirs).await?;
        let unsigned = dir.join("checkpoint-unsigned.tar");
        rewrite_archive(&theirs, &unsigned, |name, d| {
            Ok(Some(if name == "checkpoint/gpu-ckpt-manifest.json" {
                unsigned_manifest(d, false)
            } else {
                d
            }))
        })?;
        let missing = dir.join("no-such-checkpoint.tar");
        let _ = std::fs::remove_file(&missing);
        let cases: [(&str, &str, PathBuf, &[&str]); 4] = [
            (
                "another namespace's",
                "default",
                theirs.clone(),
                &["\"tenant-a\"", "\"default\"", "NamespaceMoves"],
            ),
            ("missing", "tenant-a", missing, &["does not exist"]),
            (
                "unsigned",
                "tenant-a",
                unsigned,
                &["unsigned", "AllowUnsigned"],
            ),
            (
                "outside RestoreSources",
                "tenant-a",
                PathBuf::from("/etc/hostname"),
                &["outside RestoreSources"],
            ),
        ];
        // Every answer first (printed), then the checks.
        let mut refusals = Vec::new();
        for (what, namespace, source, reason) in cases {
            let s = source.display().to_string();
            let msg = try_restore(&cri, &n, HANDLER, namespace, &s)
                .await?
                .err()
                .with_context(|| format!("{what}: restored"))?;
            println!("{what}: {msg}");
            refusals.push((what, s, msg, reason));
        }
        let mut answers = Vec::new();
        for (what, s, msg, reason) in refusals {
            let text = refusal_text(&msg, &s)?;
            ensure!(
                !text.contains("tenant-a"),
                "{what}: the pod learns whose checkpoint it is: {msg}"
            );
            ensure!(
                refusal_logged(&n, &s, reason),
                "{what}: the node's log does not give the reason {reason:?}"
            );
            answers.push(text);
        }
        ensure!(
            answers.iter().all(|a| a == &answers[0]),
            "the answers differ: {answers:#?}"
        );
        // The same checkpoint in its own namespace restores: the refusals were for the reasons.
        try_restore(&cri, &n, HANDLER, "tenant-a", &theirs.display().to_string())
            .await?
            .map_err(anyhow::Error::msg)
            .context("tenant-a's checkpoint in tenant-a")?;
        Ok(())
    })
}
