//! Who may restore what (docs/security.md), on two real nodes: a checkpoint is bound to its
//! namespace, signed by its node's key and refused when anything in it changed, unsigned or
//! foreign checkpoints are refused unless the handler allows them, `gpu-ckpt.io/restore-from`
//! reads only from `RestoreSources` (with one answer for outside, missing and unreadable), and
//! whiteouts never climb out of the rootfs.

use std::path::{Path, PathBuf};

use crate::common;
use crate::common::*;
use anyhow::{ensure, Context, Result};
use test_containers::{
    cri::{ContainerSpec, Cri, PodSpec},
    stack::{Node, OptValue, Stack, GPU_CKPT_HANDLER},
};

/// The handlers of the restoring node, each the restore handler with other options.
const STRICT: &str = "restore-strict";
const MOVES: &str = "restore-moves";
const TRUSTING: &str = "restore-trusting";
const UNSIGNED: &str = "restore-unsigned";

fn nodes_dir() -> Result<String> {
    Ok(format!(
        "{}/",
        Stack::discover()?.prefix().join("nodes").display()
    ))
}

/// Node B: restores with a key of its own, through four restore handlers.
fn restore_node(name: &str, trusted: &Path) -> Result<Node> {
    let keys = node_key_dir(name);
    let _ = std::fs::remove_dir_all(&keys);
    let mut b = Node::builder(name)?
        .runtime_option("SigningKey", keys.join("node.key").display().to_string());
    for handler in [STRICT, MOVES, TRUSTING, UNSIGNED] {
        let mut h = restore_handler(name, handler)?;
        let options = &mut h.options;
        options.insert(
            "SigningKey".to_string(),
            OptValue::from(keys.join("node.key").display().to_string()),
        );
        options.insert(
            "RestoreSources".to_string(),
            OptValue::from(vec![nodes_dir()?]),
        );
        if handler != STRICT {
            options.insert("TrustedKeysDir".to_string(), OptValue::from(trusted));
        }
        match handler {
            MOVES => {
                options.insert(
                    "NamespaceMoves".to_string(),
                    OptValue::from(vec!["default/tenant-b".to_string()]),
                );
            }
            UNSIGNED => {
                options.insert("AllowUnsigned".to_string(), OptValue::from(true));
            }
            _ => {}
        }
        b = b.extra_runtime(h);
    }
    node_with(b)
}

async fn expect_refused(
    cri: &Cri,
    b: &Node,
    handler: &str,
    namespace: &str,
    source: &Path,
    what: &str,
    needles: &[&str],
) -> Result<String> {
    let msg = try_restore(cri, b, handler, namespace, &source.display().to_string())
        .await?
        .err()
        .with_context(|| format!("{what}: restored"))?;
    for n in needles {
        ensure!(
            msg.contains(n),
            "{what}: the refusal does not say {n:?}: {msg}"
        );
    }
    Ok(msg)
}

/// A checkpoint the pod may not use: refused with the one text whatever the reason, and the
/// reason (every one of `reason`) in the node's log.
async fn expect_unusable(
    cri: &Cri,
    b: &Node,
    handler: &str,
    namespace: &str,
    source: &Path,
    what: &str,
    reason: &[&str],
) -> Result<String> {
    let msg = expect_refused(cri, b, handler, namespace, source, what, &[]).await?;
    let s = source.display().to_string();
    let text = refusal_text(&msg, &s)?;
    ensure!(
        refusal_logged(b, &s, reason),
        "{what}: the node's log does not give the reason {reason:?} for {s}"
    );
    Ok(text)
}

/// An edit of one archive member (see [`rewrite_archive`]).
type Edit = Box<dyn Fn(&str, Vec<u8>) -> Option<Vec<u8>>>;

/// The edit that changes the members `hit` picks with `change` and keeps every other as it is.
fn edit_members(
    hit: impl Fn(&str) -> bool + 'static,
    change: impl Fn(Vec<u8>) -> Vec<u8> + 'static,
) -> Edit {
    Box::new(move |n, d| Some(if hit(n) { change(d) } else { d }))
}

fn flip(mut data: Vec<u8>, at: usize) -> Vec<u8> {
    let at = at.min(data.len().saturating_sub(1));
    data[at] ^= 0x01;
    data
}

fn replace(data: Vec<u8>, from: &str, to: &str) -> Vec<u8> {
    String::from_utf8_lossy(&data)
        .replace(from, to)
        .into_bytes()
}

/// A rootfs diff (gzip tar, as containerd writes it) of one empty file named `name`.
fn whiteout_diff(name: &str) -> Result<Vec<u8>> {
    let mut b = tar::Builder::new(flate2::write::GzEncoder::new(
        Vec::new(),
        flate2::Compression::fast(),
    ));
    let mut h = tar::Header::new_gnu();
    h.set_size(0);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Regular);
    h.as_gnu_mut().context("gnu header")?.name[..name.len()].copy_from_slice(name.as_bytes());
    h.set_cksum();
    b.append(&h, std::io::empty())?;
    Ok(b.into_inner()?.finish()?)
}

#[test]
fn checkpoints_are_bound_to_their_namespace_and_signer_and_refused_when_changed() -> Result<()> {
    let trusted = node_key_dir("trust-b").with_file_name("trust-b-trusted");
    let _ = std::fs::remove_dir_all(&trusted);
    std::fs::create_dir_all(&trusted)?;
    let a = signing_node("trust-a")?;
    let b = restore_node("trust-b", &trusted)?;
    rt().block_on(async {
        let cri_a = Cri::connect(a.socket()).await?;
        let cri_b = Cri::connect(b.socket()).await?;
        let (pod, id) = cri_counter_pod(&cri_a, &a, "worker").await?;
        let before = common::cri_counter_above(&cri_a, &id, "/counter.txt", 5).await?;
        let archive = a.paths().dir.join("checkpoint-worker_default-counter.tar");
        let _ = std::fs::remove_file(&archive);
        cri_a.checkpoint_container(&id, &archive, 60).await?;
        cri_a.remove_pod(&pod).await?;

        // `gpu-ckpt verify` and `inspect` show the signer and whether a node trusts it.
        let cli = gpu_ckpt_cli();
        let a_key = node_key_dir("trust-a").join("node.key");
        let b_key = node_key_dir("trust-b").join("node.key");
        let out = run_ok(
            std::process::Command::new(&cli)
                .arg("verify")
                .arg(&archive)
                .arg("--key")
                .arg(&a_key),
        )?;
        ensure!(
            out.contains("signer: ed25519:") && out.contains("trusted: this node's key"),
            "{out}"
        );
        let inspect = run_ok(
            std::process::Command::new(&cli)
                .args(["inspect", "--json"])
                .arg(&archive)
                .arg("--key")
                .arg(node_key_dir("trust-a").join("node.pub")),
        )?;
        let v: serde_json::Value = serde_json::from_str(&inspect)?;
        ensure!(v[0]["signer"]["trusted"] == true, "{inspect}");

        // Signed by A, and B does not trust A: refused by the strict handler; B's key is
        // made on first use.
        let msg = expect_unusable(
            &cri_b,
            &b,
            STRICT,
            "default",
            &archive,
            "A's checkpoint on B",
            &["does not trust", "TrustedKeysDir"],
        )
        .await?;
        println!("untrusted: {msg}");
        ensure!(b_key.exists(), "node B made no key at {}", b_key.display());
        // Verified with B's key: a trust failure (exit 5), never `verify ok`.
        let out = std::process::Command::new(&cli)
            .arg("verify")
            .arg(&archive)
            .arg("--key")
            .arg(&b_key)
            .output()?;
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        ensure!(
            out.status.code() == Some(5)
                && stderr.contains("NOT trusted")
                && !stdout.contains("verify ok"),
            "verify with B's key: {:?} {stdout}{stderr}",
            out.status
        );

        // containerd's restore-via-create (the image is the archive) through B's gpu-ckpt
        // handler: refused by the shim's verify step at Start.
        let untrusted = refusals_logged(&b, "", &["does not trust"]);
        let pod = cri_b
            .run_pod(&PodSpec::new("worker", b.pod_log_root()).handler(GPU_CKPT_HANDLER))
            .await?;
        let err = cri_b
            .run_container(
                &pod,
                &ContainerSpec::new("counter", &archive.display().to_string()),
            )
            .await
            .err()
            .context("restore-via-create of an untrusted checkpoint ran")?;
        let msg = format!("{err:#}").replace("\\\"", "\"");
        ensure!(msg.contains(REFUSED), "restore-via-create: {msg}");
        ensure!(
            refusals_logged(&b, "", &["does not trust"]) > untrusted,
            "restore-via-create: no reason in the node's log"
        );
        cri_b.remove_pod(&pod).await?;

        // With A's public key in TrustedKeysDir, it restores and counts on.
        std::fs::copy(
            node_key_dir("trust-a").join("node.pub"),
            trusted.join("trust-a.pub"),
        )?;
        let first = try_restore(
            &cri_b,
            &b,
            TRUSTING,
            "default",
            &archive.display().to_string(),
        )
        .await?
        .map_err(anyhow::Error::msg)
        .context("A's checkpoint on B, A trusted")?;
        ensure!(
            first >= before,
            "restored at {first}, checkpointed after {before}"
        );

        // Case 2: into another namespace, refused naming both, unless the pair is allowed.
        let msg = expect_unusable(
            &cri_b,
            &b,
            TRUSTING,
            "tenant-b",
            &archive,
            "a move to tenant-b",
            &["\"default\"", "\"tenant-b\"", "NamespaceMoves"],
        )
        .await?;
        ensure!(
            !msg.contains("\"default\""),
            "the pod learns the namespace: {msg}"
        );
        println!("namespace: {msg}");
        try_restore(
            &cri_b,
            &b,
            MOVES,
            "tenant-b",
            &archive.display().to_string(),
        )
        .await?
        .map_err(anyhow::Error::msg)
        .context("a move NamespaceMoves allows")?;
        expect_unusable(
            &cri_b,
            &b,
            MOVES,
            "tenant-c",
            &archive,
            "a move to tenant-c",
            &["\"tenant-c\""],
        )
        .await?;

        // Case 3 and every kind of change: each refused. A changed manifest no longer matches
        // its signature: a checkpoint the pod may not use (the one refusal text, the reason in
        // the node's log); a changed file behind a valid signature is named to the pod.
        let dir = b.paths().dir.clone();
        let manifest = "checkpoint/gpu-ckpt-manifest.json";
        let cases: Vec<(&str, Edit, &str, Vec<&str>, bool)> = vec![
            (
                "page-image",
                edit_members(|n| n.starts_with("checkpoint/pages-"), |d| flip(d, 600)),
                "default",
                vec!["pages-"],
                false,
            ),
            (
                "inventory",
                edit_members(|n| n == "checkpoint/inventory.img", |d| flip(d, 8)),
                "default",
                vec!["inventory.img"],
                false,
            ),
            (
                "core-image",
                edit_members(|n| n.starts_with("checkpoint/core-"), |d| flip(d, 20)),
                "default",
                vec!["core-"],
                false,
            ),
            (
                "manifest",
                edit_members(
                    move |n| n == manifest,
                    |d| replace(d, "\"default\"", "\"tenant-b\""),
                ),
                "tenant-b",
                vec!["does not match"],
                true,
            ),
            (
                "origin-rewritten",
                edit_members(
                    move |n| matches!(n, "spec.dump" | "status.dump") || n == manifest,
                    |d| replace(d, "default", "tenant-b"),
                ),
                "tenant-b",
                vec!["does not match"],
                true,
            ),
            (
                "spec-dump",
                edit_members(
                    |n| n == "spec.dump",
                    |d| replace(d, "\"default\"", "\"tenant-b\""),
                ),
                "default",
                vec!["spec.dump", "namespace"],
                false,
            ),
            (
                "rootfs-changes",
                edit_members(
                    |n| n == "checkpoint/gpu-ckpt-rootfs-changes.tar",
                    |d| flip(d, 0),
                ),
                "default",
                vec!["gpu-ckpt-rootfs-changes.tar"],
                false,
            ),
        ];
        for (what, edit, ns, needles, unusable) in cases {
            let out = dir.join(format!("tampered-{what}.tar"));
            rewrite_archive(&archive, &out, |n, d| Ok(edit(n, d)))?;
            let msg = if unusable {
                expect_unusable(&cri_b, &b, TRUSTING, ns, &out, what, &needles).await?
            } else {
                expect_refused(&cri_b, &b, TRUSTING, ns, &out, what, &needles).await?
            };
            println!("{what}: {msg}");
        }

        // Unsigned: refused by default, restored under AllowUnsigned with a warning.
        let unsigned = dir.join("unsigned.tar");
        let edit = edit_members(move |n| n == manifest, |d| unsigned_manifest(d, false));
        rewrite_archive(&archive, &unsigned, |n, d| Ok(edit(n, d)))?;
        expect_unusable(
            &cri_b,
            &b,
            TRUSTING,
            "default",
            &unsigned,
            "unsigned",
            &["unsigned", "AllowUnsigned"],
        )
        .await?;
        try_restore(
            &cri_b,
            &b,
            UNSIGNED,
            "default",
            &unsigned.display().to_string(),
        )
        .await?
        .map_err(anyhow::Error::msg)
        .context("an unsigned checkpoint under AllowUnsigned")?;
        ensure!(
            b.log_contains("UNSIGNED checkpoint"),
            "no warning in the shim log for an unsigned restore"
        );

        // Case 4: whiteouts of the rootfs or its parent in the engine's rootfs diff (an
        // unsigned checkpoint without the shim's copy): refused, naming the entry.
        for name in [".wh..", ".wh..."] {
            let out = dir.join(format!("whiteout{}.tar", name.len()));
            let diff = whiteout_diff(name)?;
            rewrite_archive(&archive, &out, |n, d| {
                Ok(match n {
                    "checkpoint/gpu-ckpt-manifest.json" => Some(unsigned_manifest(d, true)),
                    "checkpoint/gpu-ckpt-rootfs-changes.tar" => None,
                    "rootfs-diff.tar" => Some(diff.clone()),
                    _ => Some(d),
                })
            })?;
            let msg = expect_refused(
                &cri_b,
                &b,
                UNSIGNED,
                "default",
                &out,
                name,
                &[name, "whiteout"],
            )
            .await?;
            println!("{name}: {msg}");
        }
        // The node runs pods as before.
        try_restore(
            &cri_b,
            &b,
            TRUSTING,
            "default",
            &archive.display().to_string(),
        )
        .await?
        .map_err(anyhow::Error::msg)
        .context("a restore after the refused ones")?;
        Ok(())
    })
}

#[test]
fn restore_sources_outside_missing_and_unreadable_get_one_answer() -> Result<()> {
    let trusted = node_key_dir("src-b").with_file_name("src-b-trusted");
    std::fs::create_dir_all(&trusted)?;
    let b = restore_node("src-b", &trusted)?;
    rt().block_on(async {
        let cri = Cri::connect(b.socket()).await?;
        cri.pull_image(workloads()).await?;
        let dir = b.paths().dir.clone();
        let unreadable = dir.join("unreadable.tar");
        std::fs::create_dir_all(&unreadable)?;
        let link = dir.join("link.tar");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("/etc/hostname", &link)?;
        let sources = [
            PathBuf::from("/etc/hostname"),
            PathBuf::from("/etc/no-such-checkpoint.tar"),
            dir.join("missing.tar"),
            unreadable,
            link,
            dir.join("../../../../etc/hostname"),
        ];
        let mut answers = Vec::new();
        for s in &sources {
            let answer = expect_unusable(
                &cri,
                &b,
                STRICT,
                "default",
                s,
                "a source",
                &["RestoreSources"],
            )
            .await?;
            println!("{}: {answer}", s.display());
            answers.push(answer);
        }
        ensure!(
            answers.iter().all(|a| a == &answers[0]),
            "the answers differ: {answers:#?}"
        );
        Ok(())
    })
}
