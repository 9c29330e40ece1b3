//! Checkpoint images in a registry as users run theirs: the stack's TLS registry (HTTPS with a
//! CA of its own, trusted through a containerd host directory, and htpasswd logins).
//!
//! - `gpu-ckpt build --push` with an auth file pushes there; without credentials, with a wrong
//!   password and without the CA the push fails, naming the registry and the cause.
//! - `gpu-ckpt pull` gets the archive back byte for byte; a missing reference is named.
//! - The restore handler restores from it with `RegistryHostsDir` and `RegistryAuthFile`, and the
//!   count goes on; a handler whose `RestoreSources` lack the registry refuses, and one without
//!   the login says so.
//!
//! - Mirrors fall back as containerd's do: with a dead mirror listed first in `hosts.toml`, the
//!   pull goes on to the registry and gets the archive byte for byte; when every host is dead it
//!   fails with `every host failed:`, naming each, and leaves no file.
//!
//! Needs root, the stack from `make deps` and `registry.sh start`; fails (never skips) when
//! something is missing.

use std::path::Path;
use std::process::{Command, Output};

use crate::common::*;
use anyhow::{ensure, Context, Result};
use test_containers::{
    cri::Cri,
    registry::TlsRegistry,
    stack::{ExtraRuntime, Node, OptValue},
};

/// Restores from the TLS registry with its CA and the login.
const FROM_REGISTRY: &str = "restore-registry";
/// Same CA and login, but RestoreSources without the TLS registry.
const ELSEWHERE: &str = "restore-elsewhere";
/// The CA, an auth file without a login for the registry.
const NO_LOGIN: &str = "restore-nologin";

const REPO: &str = "gpuckpt-test";

/// Runs the CLI and returns its output, whatever its exit status.
fn run_cli(args: &[&str]) -> Result<Output> {
    Command::new(gpu_ckpt_cli())
        .args(args)
        .output()
        .context("run gpu-ckpt")
}

/// `Ok(stdout)` when the CLI succeeded, `Err(stderr)` when it failed.
fn outcome(out: &Output) -> std::result::Result<String, String> {
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// `gpu-ckpt build ARCHIVE --ref REFERENCE --push`, through the host directory `hosts` with the
/// logins of `auth`.
pub(crate) fn cli_push(
    archive: &Path,
    reference: &str,
    hosts: &Path,
    auth: &Path,
) -> Result<Output> {
    run_cli(&[
        "build",
        &archive.display().to_string(),
        "--ref",
        reference,
        "--push",
        "--hosts-dir",
        &hosts.display().to_string(),
        "--authfile",
        &auth.display().to_string(),
    ])
}

/// `gpu-ckpt pull REFERENCE OUT`, through the host directory `hosts` with the logins of `auth`.
fn cli_pull(reference: &str, out: &Path, hosts: &Path, auth: &Path) -> Result<Output> {
    run_cli(&[
        "pull",
        reference,
        &out.display().to_string(),
        "--hosts-dir",
        &hosts.display().to_string(),
        "--authfile",
        &auth.display().to_string(),
    ])
}

fn handler(
    node: &str,
    name: &str,
    sources: Vec<String>,
    hosts: &Path,
    auth: &Path,
) -> Result<ExtraRuntime> {
    let mut h = restore_handler(node, name)?;
    h.options
        .insert("RestoreSources".into(), OptValue::from(sources));
    h.options.insert(
        "RegistryHostsDir".into(),
        OptValue::from(hosts.display().to_string()),
    );
    h.options.insert(
        "RegistryAuthFile".into(),
        OptValue::from(auth.display().to_string()),
    );
    Ok(h)
}

fn expect_failure(
    what: &str,
    r: std::result::Result<String, String>,
    needles: &[&str],
) -> Result<String> {
    let msg = r
        .err()
        .with_context(|| format!("{what}: succeeded, expected a failure"))?;
    for n in needles {
        ensure!(
            msg.contains(n),
            "{what}: the error does not say {n:?}: {msg}"
        );
    }
    println!("{what}: {}", msg.trim());
    Ok(msg)
}

/// A pulled archive is the pushed one byte for byte, and root-only (it holds process memory).
fn ensure_pulled_copy(pulled: &Path, pushed: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    ensure!(
        std::fs::read(pulled)? == std::fs::read(pushed)?,
        "the pulled archive {} differs from the one pushed",
        pulled.display()
    );
    let mode = std::fs::metadata(pulled)?.permissions().mode() & 0o777;
    ensure!(mode == 0o600, "pulled archive mode {mode:o}");
    Ok(())
}

#[test]
fn checkpoint_images_go_through_a_tls_registry_with_logins() -> Result<()> {
    let reg = TlsRegistry::discover()?;
    let name = "registry-tls";
    let work = Path::new(test_containers::stack::RUN_BASE).join(format!("{name}-files"));
    let _ = std::fs::remove_dir_all(&work);
    let hosts = reg.hosts_dir(&work.join("certs.d"), true)?;
    let no_ca = reg.hosts_dir(&work.join("certs-no-ca.d"), false)?;
    let auth = reg.auth_file(&work.join("auth.json"), Some(reg.password()))?;
    let wrong = reg.auth_file(&work.join("wrong.json"), Some("not-the-password"))?;
    let none = reg.auth_file(&work.join("none.json"), None)?;
    let prefix = format!("{}/{REPO}/", reg.addr);

    let node = node_with(
        Node::builder(name)?
            .extra_runtime(handler(
                name,
                FROM_REGISTRY,
                vec![prefix.clone()],
                &hosts,
                &auth,
            )?)
            .extra_runtime(handler(
                name,
                ELSEWHERE,
                vec!["localhost:5000/ckpt/".into()],
                &hosts,
                &auth,
            )?)
            .extra_runtime(handler(
                name,
                NO_LOGIN,
                vec![prefix.clone()],
                &hosts,
                &none,
            )?),
    )?;
    let tag = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs()
    );
    let reference = format!("{prefix}counter:{tag}");

    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        let (pod, id) = cri_counter_pod(&cri, &node, "worker").await?;
        let before = cri_counter_above(&cri, &id, "/counter.txt", 5).await?;
        let archive = node
            .paths()
            .dir
            .join("checkpoint-worker_default-counter.tar");
        let _ = std::fs::remove_file(&archive);
        cri.checkpoint_container(&id, &archive, 120).await?;
        cri.remove_pod(&pod).await?;

        // Pushes that fail, each naming the registry and the cause; nothing is pushed.
        let push = |hosts: &Path, auth: &Path| {
            cli_push(&archive, &reference, hosts, auth).map(|out| outcome(&out))
        };
        let registry = format!("registry https://{}", reg.addr);
        expect_failure(
            "push without credentials",
            push(&hosts, &none)?,
            &[
                &registry,
                "asks for a login",
                &format!("no credentials for {}", reg.addr),
            ],
        )?;
        expect_failure(
            "push with a wrong password",
            push(&hosts, &wrong)?,
            &[
                &registry,
                &format!("credentials refused for user \"{}\"", reg.user()),
                "wrong.json",
            ],
        )?;
        expect_failure(
            "push without the CA",
            push(&no_ca, &auth)?,
            &[
                &registry,
                "certificate does not verify",
                "UnknownIssuer: signed by a CA that is not trusted",
                "no CA for this host",
            ],
        )?;
        let missing = expect_failure(
            "pull before the push",
            outcome(&cli_pull(
                &reference,
                &work.join("early.tar"),
                &hosts,
                &auth,
            )?),
            &[&registry, "not found"],
        )?;
        ensure!(
            !work.join("early.tar").exists(),
            "a failed pull left a file: {missing}"
        );

        // The push with the login and the CA.
        let out = push(&hosts, &auth)?
            .map_err(anyhow::Error::msg)
            .context("push with the login")?;
        ensure!(
            out.contains(&format!("pushed {reference}@sha256:")),
            "{out}"
        );

        // Pulled back byte for byte, root-only.
        let back = work.join("pulled.tar");
        let out = outcome(&cli_pull(&reference, &back, &hosts, &auth)?)
            .map_err(anyhow::Error::msg)
            .context("pull")?;
        ensure!(
            out.contains(&format!("pulled {reference}@sha256:")),
            "{out}"
        );
        ensure_pulled_copy(&back, &archive)?;

        // The restore handler pulls it with its options, and the count goes on.
        let first = try_restore(&cri, &node, FROM_REGISTRY, "default", &reference)
            .await?
            .map_err(anyhow::Error::msg)
            .context("restore from the TLS registry")?;
        ensure!(
            first >= before,
            "restored at {first}, checkpointed after {before}"
        );

        // Still subject to RestoreSources.
        let msg = try_restore(&cri, &node, ELSEWHERE, "default", &reference)
            .await?
            .err()
            .context("a handler whose RestoreSources lack the registry restored from it")?;
        refusal_text(&msg, &reference)?;
        ensure!(
            refusal_logged(&node, &reference, &["outside RestoreSources"]),
            "outside RestoreSources: no reason in the node's log"
        );
        println!("outside RestoreSources: {msg}");

        // Without the login the pod gets the one refusal (it learns nothing of what the
        // registry holds); the node's log says why.
        let msg = try_restore(&cri, &node, NO_LOGIN, "default", &reference)
            .await?
            .err()
            .context("a handler without the login restored")?;
        refusal_text(&msg, &reference)?;
        ensure!(
            refusal_logged(&node, &reference, &["no credentials for", &reg.addr]),
            "restore without the login: no reason in the node's log"
        );
        println!("without the login: {msg}");
        Ok(())
    })
}

/// A host nothing listens on (connection refused at once).
const DEAD_MIRROR: &str = "127.0.0.1:1";
/// Another one, for the server of the all-dead `hosts.toml`.
const DEAD_SERVER: &str = "127.0.0.1:2";

/// Writes a small checkpoint archive (what `gpu-ckpt build` needs: `config.dump`, `spec.dump`,
/// and a `checkpoint/` image of some size) at `path`.
fn write_checkpoint_archive(path: &Path, name: &str) -> Result<()> {
    let mut pages = Vec::with_capacity(1 << 20);
    let mut x: u32 = 0x9e37_79b9;
    while pages.len() < 1 << 20 {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        pages.extend_from_slice(&x.to_le_bytes());
    }
    let config = serde_json::to_vec(&serde_json::json!({ "id": name, "name": name }))?;
    let spec = serde_json::to_vec(&serde_json::json!({ "ociVersion": "1.0.2" }))?;
    let mut ar = tar::Builder::new(std::fs::File::create(path)?);
    let mut add = |entry: &str, data: &[u8], kind: tar::EntryType| -> Result<()> {
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(kind);
        h.set_mode(if data.is_empty() { 0o700 } else { 0o600 });
        h.set_size(data.len() as u64);
        h.set_mtime(0);
        ar.append_data(&mut h, entry, data)
            .with_context(|| format!("{}: {entry}", path.display()))
    };
    add("config.dump", &config, tar::EntryType::Regular)?;
    add("spec.dump", &spec, tar::EntryType::Regular)?;
    add("checkpoint/", &[], tar::EntryType::Directory)?;
    add("checkpoint/pages-1.img", &pages, tar::EntryType::Regular)?;
    ar.into_inner()?.sync_all()?;
    Ok(())
}

/// Writes `body` as the `hosts.toml` of the registry's host directory under `root`, beside the
/// CA that [`TlsRegistry::hosts_dir`] copies there (`test-ca.pem`). Returns `root`.
fn hosts_toml(reg: &TlsRegistry, root: &Path, body: &str) -> Result<std::path::PathBuf> {
    let root = reg.hosts_dir(root, true)?;
    let file = root.join(&reg.addr).join("hosts.toml");
    std::fs::write(&file, body).with_context(|| format!("write {}", file.display()))?;
    Ok(root)
}

#[test]
fn a_pull_falls_back_past_a_dead_mirror_as_containerd_does() -> Result<()> {
    let reg = TlsRegistry::discover()?;
    let work = Path::new(test_containers::stack::RUN_BASE).join("registry-mirrors-files");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let hosts = reg.hosts_dir(&work.join("certs.d"), true)?;
    let auth = reg.auth_file(&work.join("auth.json"), Some(reg.password()))?;
    let archive = work.join("checkpoint.tar");
    write_checkpoint_archive(&archive, "mirrored")?;
    let reference = format!(
        "{}/{REPO}/mirrored:{}-{}",
        reg.addr,
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs()
    );

    // Pushed the way users push (straight to the registry).
    let out = outcome(&cli_push(&archive, &reference, &hosts, &auth)?)
        .map_err(anyhow::Error::msg)
        .context("push")?;
    ensure!(
        out.contains(&format!("pushed {reference}@sha256:")),
        "{out}"
    );

    // A dead mirror first, then the registry with its CA (also the server: tried once).
    let mirrored = hosts_toml(
        &reg,
        &work.join("certs-mirror.d"),
        &format!(
            r#"server = "https://{a}"

[host."https://{DEAD_MIRROR}"]
  capabilities = ["pull", "resolve"]

[host."https://{a}"]
  capabilities = ["pull", "resolve"]
  ca = "test-ca.pem"
"#,
            a = reg.addr
        ),
    )?;
    let back = work.join("pulled.tar");
    let pulled = cli_pull(&reference, &back, &mirrored, &auth)?;
    let stdout = String::from_utf8_lossy(&pulled.stdout);
    let stderr = String::from_utf8_lossy(&pulled.stderr);
    ensure!(
        pulled.status.success(),
        "pull past a dead mirror failed ({}): {stderr}",
        pulled.status
    );
    ensure!(
        stdout.contains(&format!("pulled {reference}@sha256:")),
        "{stdout}"
    );
    let lower = stderr.to_lowercase();
    for bad in ["error", "failed", "panicked", "every host"] {
        ensure!(
            !lower.contains(bad),
            "a pull that succeeded says {bad:?} on stderr: {stderr}"
        );
    }
    ensure_pulled_copy(&back, &archive)?;
    println!("pull past the dead mirror: {}", stdout.trim());

    // Every host dead: one error naming each, and no file.
    let dead = hosts_toml(
        &reg,
        &work.join("certs-dead.d"),
        &format!(
            r#"server = "https://{DEAD_SERVER}"

[host."https://{DEAD_MIRROR}"]
  capabilities = ["pull", "resolve"]
"#
        ),
    )?;
    let nothing = work.join("nothing.tar");
    let msg = expect_failure(
        "pull with every host dead",
        outcome(&cli_pull(&reference, &nothing, &dead, &auth)?),
        &[
            &format!("registry {}: every host failed: ", reg.addr),
            &format!("https://{DEAD_MIRROR}: login: "),
            &format!("; https://{DEAD_SERVER}: login: "),
        ],
    )?;
    ensure!(
        msg.trim().lines().count() == 1,
        "the all-failed error is not one line: {msg}"
    );
    ensure!(
        msg.find(DEAD_MIRROR) < msg.find(DEAD_SERVER),
        "the hosts are not named in the order tried: {msg}"
    );
    ensure!(
        !nothing.exists(),
        "a pull where every host failed left a file: {msg}"
    );
    Ok(())
}
