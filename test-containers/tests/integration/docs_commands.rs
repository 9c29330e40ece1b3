//! docs/usage.md, "Try it on the local stack", run as written: every fenced `sh` block marked
//! `<!-- doc-test: local-stack -->` is taken from the doc in order and run, verbatim, in one
//! `bash -euo pipefail` as root from the repository's root, against the real stack (its
//! containerd, runc, CRIU, registry), with `TMPDIR` pointing at a scratch directory. The output
//! must say what the doc says it prints: the counter going on after the restore, `verify ok`,
//! the demo training on, the push, and the pulled archive identical. Whatever the commands left
//! (a private containerd, its containers and mounts, files) is removed afterwards, even on
//! failure. A missing tool or stack fails the test; nothing is skipped.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, ensure, Context, Result};

const MARKER: &str = "<!-- doc-test: local-stack -->";
/// The whole walkthrough, `make` included, on a loaded 2-core machine.
const TIMEOUT_S: u64 = 3600;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// The marked blocks of `md`, in order. A marker must be followed (after blank lines) by a
/// fenced `sh` block that is closed.
fn marked_blocks(md: &str) -> Result<Vec<String>> {
    let lines: Vec<&str> = md.lines().collect();
    let mut blocks = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim() != MARKER {
            i += 1;
            continue;
        }
        let marker_line = i + 1;
        i += 1;
        while i < lines.len() && lines[i].trim().is_empty() {
            i += 1;
        }
        if i >= lines.len() || lines[i].trim() != "```sh" {
            bail!("docs/usage.md line {marker_line}: the doc-test marker is not followed by a ```sh block");
        }
        i += 1;
        let start = i;
        while i < lines.len() && lines[i].trim() != "```" {
            i += 1;
        }
        if i >= lines.len() {
            bail!("docs/usage.md line {marker_line}: the ```sh block after the doc-test marker is not closed");
        }
        blocks.push(lines[start..i].join("\n"));
        i += 1;
    }
    Ok(blocks)
}

#[test]
fn the_marker_takes_exactly_the_fenced_sh_blocks() -> Result<()> {
    let md = format!(
        "text\n{MARKER}\n\n```sh\necho one\necho two\n```\n```sh\necho not-marked\n```\n{MARKER}\n```sh\necho three\n```\n"
    );
    let blocks = marked_blocks(&md)?;
    ensure!(
        blocks == vec!["echo one\necho two".to_string(), "echo three".to_string()],
        "wrong blocks: {blocks:?}"
    );
    let err = marked_blocks(&format!("{MARKER}\n```console\n$ ls\n```\n"))
        .err()
        .context("a marker before a non-sh block was accepted")?;
    ensure!(err.to_string().contains("line 1"), "{err}");
    ensure!(
        marked_blocks(&format!("{MARKER}\n```sh\nls\n")).is_err(),
        "an unclosed block was accepted"
    );
    Ok(())
}

/// The number after `prefix` on the line that starts with it.
fn number_after(out: &str, prefix: &str) -> Result<u64> {
    let line = out
        .lines()
        .find(|l| l.starts_with(prefix))
        .with_context(|| format!("the output has no line `{prefix} N`"))?;
    line[prefix.len()..]
        .trim()
        .parse()
        .with_context(|| format!("`{line}`: not a number after `{prefix}`"))
}

/// Removes what the commands may have left under `tmp` (their `mktemp -d` directories): a
/// private containerd (through the same helper the doc uses), its shims and mounts, the files.
struct Cleanup {
    scratch: PathBuf,
    tmp: PathBuf,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let helper = repo().join("test-containers/stack/local-containerd.sh");
        if let Ok(entries) = std::fs::read_dir(&self.tmp) {
            for e in entries.flatten() {
                let node = e.path().join("node");
                if node.join("containerd.pid").exists() {
                    eprintln!(
                        "cleanup: stopping the private containerd in {}",
                        node.display()
                    );
                    let _ = Command::new(&helper)
                        .arg("stop")
                        .arg(&node)
                        .env("PATH", stack_path())
                        .status();
                }
            }
        }
        let needle = format!(" {}/", self.scratch.display());
        if let Ok(mounts) = std::fs::read_to_string("/proc/mounts") {
            let mut points: Vec<&str> = mounts
                .lines()
                .filter(|l| l.contains(&needle))
                .filter_map(|l| l.split(' ').nth(1))
                .collect();
            points.sort_unstable_by(|a, b| b.cmp(a));
            for p in points {
                let _ = Command::new("umount").arg("-l").arg(p).status();
            }
        }
        let _ = std::fs::remove_dir_all(&self.scratch);
    }
}

fn stack_path() -> String {
    let stack = repo().join(".stack");
    format!(
        "{}/bin:{}/root/usr/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        stack.display(),
        stack.display()
    )
}

#[test]
fn usage_local_stack_walkthrough_runs_as_documented() -> Result<()> {
    let uid = Command::new("id")
        .arg("-u")
        .output()
        .context("running id -u")?;
    ensure!(
        String::from_utf8_lossy(&uid.stdout).trim() == "0",
        "docs/usage.md's local-stack walkthrough needs root; run the test as root"
    );
    let repo = repo();
    let doc = repo.join("docs/usage.md");
    let md = std::fs::read_to_string(&doc).with_context(|| format!("reading {}", doc.display()))?;
    let blocks = marked_blocks(&md)?;
    ensure!(
        blocks.len() >= 5,
        "docs/usage.md has {} blocks marked {MARKER}; the walkthrough has at least 5",
        blocks.len()
    );

    let scratch = tempfile::Builder::new()
        .prefix("gpu-ckpt-docs.")
        .tempdir_in("/tmp")?
        .keep();
    std::fs::set_permissions(&scratch, std::fs::Permissions::from_mode(0o700))?;
    let tmp = scratch.join("tmp");
    std::fs::create_dir(&tmp)?;
    let guard = Cleanup {
        scratch: scratch.clone(),
        tmp: tmp.clone(),
    };

    // The blocks as they stand, each preceded by a comment naming it, so that a failure says
    // which block failed (bash -x shows the command).
    let mut script = String::new();
    for (n, b) in blocks.iter().enumerate() {
        script.push_str(&format!(
            "echo '### docs/usage.md doc-test block {}' >&2\n{b}\n",
            n + 1
        ));
    }
    let script_path = scratch.join("walkthrough.sh");
    std::fs::File::create(&script_path)?.write_all(script.as_bytes())?;
    println!(
        "running {} blocks from docs/usage.md:\n{script}",
        blocks.len()
    );

    let started = std::time::Instant::now();
    let out = Command::new("timeout")
        .args([
            "--kill-after=30",
            &TIMEOUT_S.to_string(),
            "bash",
            "-euo",
            "pipefail",
            "-x",
        ])
        .arg(&script_path)
        .current_dir(&repo)
        // A new user's shell: none of the test harness's stack variables.
        .env_remove("GPU_CKPT_SHIM_DIR")
        .env_remove("GPU_CKPT_STACK")
        .env_remove("STACK")
        .env_remove("CONTAINERD_ADDRESS")
        .env_remove("CONTAINERD_NAMESPACE")
        .env("TMPDIR", &tmp)
        .stdin(Stdio::null())
        .output()
        .context("running bash")?;
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    println!("--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}");
    println!(
        "the walkthrough took {:.0} s, exit status {:?}",
        started.elapsed().as_secs_f64(),
        out.status.code()
    );
    ensure!(
        out.status.success(),
        "the documented commands failed ({}); see the last `### docs/usage.md doc-test block N` above",
        out.status
    );

    // What the doc says they print.
    let before = number_after(&stdout, "counter before the checkpoint:")?;
    let after = number_after(&stdout, "counter after the restore:")?;
    ensure!(
        before >= 5,
        "the counter did not count before the checkpoint: {before}"
    );
    ensure!(
        after > before,
        "the restored counter did not go on from the checkpoint: {before} before, {after} after"
    );
    ensure!(
        after < before + 100,
        "the restored counter is too far ahead to be the checkpointed one: {before} before, {after} after"
    );
    let verified = stdout
        .lines()
        .filter(|l| l.starts_with("verify ok: ") && l.contains("files match the manifest"))
        .count();
    ensure!(
        verified == 2,
        "expected 2 `verify ok` lines, got {verified}"
    );
    ensure!(
        stdout
            .lines()
            .any(|l| l.starts_with("signer: ") && l.contains("trusted: this node's key")),
        "verify did not name this node's key as the signer"
    );
    ensure!(
        stdout.contains("and it trains on: step") && stdout.lines().any(|l| l == "done"),
        "the demo did not restore the training pod and train on"
    );
    ensure!(
        stdout.contains("GPU (manifest schema"),
        "gpu-ckpt inspect printed no GPU section"
    );
    ensure!(
        stdout
            .lines()
            .any(|l| l.starts_with("pushed localhost:5000/ckpt/trainer:1@sha256:")),
        "gpu-ckpt build --push did not say it pushed"
    );
    ensure!(
        stdout.lines().any(|l| l == "pulled archive is identical"),
        "the pulled archive differs from the one built"
    );
    // The doc's own last commands stop its containerd and remove its directory.
    let left: Vec<_> = std::fs::read_dir(&tmp)?
        .flatten()
        .map(|e| e.path())
        .collect();
    ensure!(
        left.is_empty(),
        "the documented commands left files behind: {left:?}"
    );
    drop(guard);
    Ok(())
}
