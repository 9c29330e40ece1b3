//! A fleet set up only through the chart: one values file (a cluster signing key from a Secret,
//! the TLS registry as a restore source with its CA, and a registry login from a
//! dockerconfigjson Secret) is rendered once with Helm's engine (runtime-class/tools/chart.py);
//! the installer's arguments, environment and mounted Secret/ConfigMap files are taken from the
//! rendered DaemonSet, and the real installer sets up scratch node roots, each with a private
//! containerd on the configuration it wrote. Then:
//!
//! - both handlers are registered runc-typed: CRI reports runc's features for them, and a pod
//!   with a recursive read-only mount runs on the installed gpu-ckpt handler;
//! - a checkpoint of node A pushed to the TLS registry restores on B through the restore
//!   handler, and B's on A; a node C installed later from the same rendering restores A's;
//! - the cluster key rotated (a new Secret, the former public key in `trust.trustedKeys`):
//!   re-installing C rewrites only the side files, restarts nothing, and A's checkpoint still
//!   restores; with the former key in `trust.revokedKeys` it is refused with the shim's trust
//!   error, and its trusted file is gone.
//!
//! Needs root, the stack from `make deps`, `registry.sh start`, and the workspace built; fails
//! (never skips) when something is missing.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;
use crate::k8s_manifests::{
    installer_container, is_installer_daemonset, object, render, strings, valid_documents,
};
use crate::node_installer::{installer_bin, make_payload, scratch_root};
use crate::registry::cli_push;
use anyhow::{bail, ensure, Context, Result};
use image_format::sign::{key_id, NodeKey};
use serde_json::{json, Value};
use test_containers::cri::Cri;
use test_containers::registry::TlsRegistry;
use test_containers::stack::{Node, Stack, GPU_CKPT_HANDLER};

const REPO: &str = "gpuckpt-fleet";
/// The Secrets the values name, as `kubectl create secret` would hold them.
const KEY_SECRET: &str = "fleet-cluster-key";
const NEW_KEY_SECRET: &str = "fleet-cluster-key-2";
const LOGIN_SECRET: &str = "fleet-registry-login";

/// Secret data by Secret name, then key.
type Secrets = BTreeMap<String, BTreeMap<String, Vec<u8>>>;

/// A cluster signing key made as `gpu-ckpt key` makes one: the Secret's content (the seed in
/// hex) and the key id.
fn cluster_key(dir: &Path) -> Result<(Vec<u8>, String)> {
    let path = dir.join("node.key");
    let key = NodeKey::load_or_create(&path)?;
    Ok((fs::read(&path)?, key_id(&key.public_key())))
}

/// The installer pod's volume mounts, each mapped to a local directory holding what the volume
/// holds: the host's `/` is the scratch root, a Secret's items come from `secrets`, a
/// ConfigMap's data from the rendering. (mount path, local directory), the longest path first.
fn mounted_files(
    docs: &[Value],
    ds: &Value,
    root: &Path,
    secrets: &Secrets,
    local_dir: &Path,
) -> Result<Vec<(String, PathBuf)>> {
    let volumes = ds["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .context("no volumes")?;
    let mut mapped: Vec<(String, PathBuf)> = Vec::new();
    for m in installer_container(ds)?["volumeMounts"]
        .as_array()
        .context("no volumeMounts")?
    {
        let name = m["name"].as_str().unwrap_or_default();
        let at = m["mountPath"].as_str().unwrap_or_default().to_string();
        let v = volumes
            .iter()
            .find(|v| v["name"] == name)
            .with_context(|| format!("no volume {name}"))?;
        if v["hostPath"]["path"] == "/" {
            mapped.push((at, root.to_path_buf()));
            continue;
        }
        let local = local_dir.join(name);
        let mut items: Vec<(String, Vec<u8>)> = Vec::new();
        if let Some(secret) = v["secret"]["secretName"].as_str() {
            let data = secrets.get(secret).with_context(|| {
                format!("the rendering mounts Secret {secret}, the test has none")
            })?;
            for item in v["secret"]["items"].as_array().context("secret items")? {
                let key = item["key"].as_str().unwrap_or_default();
                let bytes = data
                    .get(key)
                    .with_context(|| format!("Secret {secret} has no key {key}"))?;
                items.push((
                    item["path"].as_str().unwrap_or_default().into(),
                    bytes.clone(),
                ));
            }
        } else if let Some(cm) = v["configMap"]["name"].as_str() {
            let cm = object(docs, "ConfigMap", cm)?;
            for (k, data) in cm["data"].as_object().context("ConfigMap data")? {
                items.push((k.clone(), data.as_str().unwrap_or_default().into()));
            }
        } else {
            bail!("volume {name} is neither the host's / nor a Secret nor a ConfigMap: {v}");
        }
        fs::create_dir_all(&local)?;
        for (file, data) in items {
            fs::write(local.join(&file), data)?;
            fs::set_permissions(local.join(&file), fs::Permissions::from_mode(0o400))?;
        }
        mapped.push((at, local));
    }
    mapped.sort_by_key(|(at, _)| std::cmp::Reverse(at.len()));
    Ok(mapped)
}

/// The installer's arguments and environment.
struct Invocation {
    args: Vec<String>,
    env: Vec<(String, String)>,
}

/// One rendering's installer as the kubelet would run it on `node`: the DaemonSet container's
/// arguments with `$(NODE_NAME)` expanded and each mount path mapped ([`mounted_files`]), the
/// payload directory mapped to `payload`, and `--host-root` for the private containerd; and its
/// environment (each `fieldRef: spec.nodeName` is `node`, the pod's `pod-template-generation` 1).
fn installer_invocation(
    docs: &[Value],
    node: &str,
    root: &Path,
    payload: &Path,
    secrets: &Secrets,
    files: &Path,
) -> Result<Invocation> {
    let ds = docs
        .iter()
        .find(|d| is_installer_daemonset(d))
        .context("no DaemonSet in the rendering")?;
    let c = installer_container(ds)?;
    let mapped = mounted_files(docs, ds, root, secrets, &files.join(node))?;
    let map = |arg: &str| -> String {
        for (at, local) in &mapped {
            let local = local.display().to_string();
            if arg == at {
                return local;
            }
            if let Some(rest) = arg.strip_prefix(&format!("{at}/")) {
                return format!("{local}/{rest}");
            }
            if let Some((k, v)) = arg.split_once('=') {
                if let Some(rest) = v.strip_prefix(&format!("{at}/")) {
                    return format!("{k}={local}/{rest}");
                }
            }
        }
        arg.to_string()
    };
    let mut args: Vec<String> = strings(&c["args"])
        .iter()
        .map(|a| map(&a.replace("$(NODE_NAME)", node)))
        .collect();
    let i = args
        .iter()
        .position(|a| a == "--payload")
        .context("no --payload")?;
    args[i + 1] = payload.display().to_string();
    // The ready marker is a path in the pod's own filesystem: one per node here.
    let i = args
        .iter()
        .position(|a| a == "--ready-file")
        .context("no --ready-file")?;
    args[i + 1] = files.join(node).join("ready").display().to_string();
    args.extend(["--host-root".to_string(), root.display().to_string()]);
    let mut env = Vec::new();
    for e in c["env"].as_array().context("no env")? {
        let name = e["name"].as_str().unwrap_or_default().to_string();
        let value = match (&e["value"], &e["valueFrom"]["fieldRef"]["fieldPath"]) {
            (Value::String(v), _) => v.clone(),
            (_, f) if f == "spec.nodeName" => node.to_string(),
            // A pod of the DaemonSet's first template.
            (_, f) if f == "metadata.labels['pod-template-generation']" => "1".to_string(),
            _ => bail!("env {name}: not one this test fills in: {e}"),
        };
        env.push((name, value));
    }
    Ok(Invocation { args, env })
}

/// A scratch node: its root, the payload, and its containerd once started.
struct FleetNode {
    name: String,
    root: PathBuf,
    payload: PathBuf,
    node: Option<Node>,
}

impl FleetNode {
    fn new(stack: &Stack, scratch: &Path, name: &str) -> Result<FleetNode> {
        let dir = scratch.join(name);
        let root = dir.join("node");
        fs::create_dir_all(&root)?;
        let payload = dir.join("payload");
        make_payload(stack, &payload)?;
        Ok(FleetNode {
            name: name.to_string(),
            root,
            payload,
            node: None,
        })
    }

    /// The rendered installer's `install` on this node; its JSON summary.
    fn install(&self, docs: &[Value], secrets: &Secrets, files: &Path) -> Result<Value> {
        let stack = Stack::discover()?;
        let i = installer_invocation(docs, &self.name, &self.root, &self.payload, secrets, files)?;
        let out = run_ok(
            Command::new(installer_bin(&stack)?)
                .arg("install")
                .args(&i.args)
                .envs(i.env),
        )?;
        let line = out.lines().last().unwrap_or_default();
        serde_json::from_str(line).with_context(|| format!("install printed {out:?}"))
    }

    /// The rendered DaemonSet's readiness probe on this node: its exec command must be
    /// `status` with the container's own arguments (site options included, or the probe
    /// would judge a node with site files as changed), run here with them mapped as for
    /// `install`. Whether it passed, and its output.
    fn probe(&self, docs: &[Value], secrets: &Secrets, files: &Path) -> Result<(bool, String)> {
        let stack = Stack::discover()?;
        let ds = docs
            .iter()
            .find(|d| is_installer_daemonset(d))
            .context("no DaemonSet in the rendering")?;
        let c = installer_container(ds)?;
        let cmd = strings(&c["readinessProbe"]["exec"]["command"]);
        ensure!(
            cmd.get(1).map(String::as_str) == Some("status") && cmd[2..] == strings(&c["args"])[..],
            "the probe is not `status` with the container's arguments: {cmd:?}"
        );
        let i = installer_invocation(docs, &self.name, &self.root, &self.payload, secrets, files)?;
        let out = Command::new(installer_bin(&stack)?)
            .arg("status")
            .args(&i.args)
            .envs(i.env)
            .output()?;
        Ok(crate::installer_pod::passed(&out))
    }

    /// Starts a private containerd on the configuration the installer wrote (the node's
    /// configuration before it: the stack's, without gpu-ckpt), only the installed shim and
    /// CRIU in its PATH.
    fn start(&mut self, stack: &Stack) -> Result<&Node> {
        let path_env = format!(
            "{}:{}:/usr/sbin:/usr/bin:/sbin:/bin",
            self.root.join("usr/local/bin").display(),
            stack.prefix().join("root/usr/bin").display()
        );
        let builder = Node::builder_on(stack, &self.name)
            .without_gpu_ckpt_handler()
            .env("PATH", &path_env);
        let config = self.root.join("etc/containerd/config.toml");
        self.node = Some(node_with(builder.config_file(&config))?);
        self.node.as_ref().context("started")
    }

    /// The node's containerd configuration before the installer ran.
    fn prepare(&self, stack: &Stack) -> Result<()> {
        let builder = Node::builder_on(stack, &self.name).without_gpu_ckpt_handler();
        scratch_root(&builder, &self.root).map(|_| ())
    }

    fn node(&self) -> Result<&Node> {
        self.node
            .as_ref()
            .context("the node's containerd is not started")
    }
}

/// The values file of the fleet: the cluster key's Secret, the registry as restore source with
/// its CA, the login's Secret; containerd's restart recorded per node instead of systemd's.
fn values(reg: &TlsRegistry, restarts: &Path) -> Result<Value> {
    Ok(json!({
        "trust": {
            "mode": "cluster",
            "clusterKey": { "secretName": KEY_SECRET, "secretKey": "signing.key" },
        },
        "restoreSources": [format!("{}/{REPO}/", reg.addr)],
        "registry": {
            "authSecretName": LOGIN_SECRET,
            "caBundles": { reg.addr.clone(): fs::read_to_string(reg.ca())? },
        },
        "nodeInstaller": {
            "labelNode": false,
            "restartCommand": format!("echo restart >> '{}'-\"$NODE_NAME\"", restarts.display()),
        },
    }))
}

fn restarts(restarts: &Path, node: &str) -> usize {
    fs::read_to_string(format!("{}-{node}", restarts.display()))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

/// Renders the chart with the values files `files` (layered in order); its documents.
fn rendered(files: &[&Path]) -> Result<Vec<Value>> {
    let mut args = Vec::new();
    for f in files {
        args.push("--values");
        args.push(f.to_str().context("a UTF-8 path")?);
    }
    valid_documents(&render(&args)?)
}

fn write_yaml(path: &Path, v: &Value) -> Result<PathBuf> {
    fs::write(path, serde_yaml::to_string(v)?)?;
    Ok(path.to_path_buf())
}

/// A checkpoint of a counter on `node` through CRI, built into an image and pushed to the TLS
/// registry as `reference` with the pipeline's own login; the counter's value before it.
async fn checkpoint_and_push(
    node: &Node,
    reference: &str,
    hosts: &Path,
    auth: &Path,
) -> Result<u64> {
    let cri = Cri::connect(node.socket()).await?;
    let (pod, id) = cri_counter_pod(&cri, node, "worker").await?;
    let before = cri_counter_above(&cri, &id, "/counter.txt", 5).await?;
    let archive = node.paths().dir.join("checkpoint-fleet.tar");
    let _ = fs::remove_file(&archive);
    cri.checkpoint_container(&id, &archive, 120).await?;
    cri.remove_pod(&pod).await?;
    let out = cli_push(&archive, reference, hosts, auth)?;
    let out = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.contains(&format!("pushed {reference}@sha256:")),
        "{out}"
    );
    let _ = fs::remove_file(&archive);
    Ok(before)
}

/// Restores `reference` on `node` through the restore handler: the first count, after `before`.
async fn restores(node: &Node, reference: &str, before: u64) -> Result<()> {
    let cri = Cri::connect(node.socket()).await?;
    cri.pull_image(workloads()).await?;
    let first = try_restore(&cri, node, RESTORE_HANDLER, "default", reference)
        .await?
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("restore of {reference} on {}", node.name()))?;
    ensure!(
        first >= before,
        "{}: restored at {first}, checkpointed after {before}",
        node.name()
    );
    Ok(())
}

/// The Secrets the values name: the cluster key, a second one to rotate to, the registry login
/// (a dockerconfigjson); and the first key's id.
fn fleet_secrets(s: &Path, reg: &TlsRegistry) -> Result<(Secrets, String)> {
    let (key1, id1) = cluster_key(&s.join("key1"))?;
    let (key2, _) = cluster_key(&s.join("key2"))?;
    let login = fs::read(reg.auth_file(&s.join("login/config.json"), Some(reg.password()))?)?;
    let mut secrets = Secrets::new();
    for (name, key, data) in [
        (KEY_SECRET, "signing.key", key1),
        (NEW_KEY_SECRET, "signing.key", key2),
        (LOGIN_SECRET, ".dockerconfigjson", login),
    ] {
        secrets.insert(name.into(), BTreeMap::from([(key.to_string(), data)]));
    }
    Ok((secrets, id1))
}

/// What each install reads: the scratch directory, the fleet's values file, the Secrets, where
/// the mounted files go.
struct Fleet<'a> {
    dir: &'a Path,
    values: &'a Path,
    secrets: &'a Secrets,
    files: &'a Path,
}

/// On node `c`, which restores `ref_a` (signed by the cluster key `id1`): the cluster key rotated
/// (a new Secret, the former key trusted by name) changes only the site's files and the
/// checkpoint still restores; the former key revoked, it is refused with the shim's trust error.
async fn rotate_then_revoke(
    fleet: &Fleet<'_>,
    c: &FleetNode,
    ref_a: &str,
    before_a: u64,
    id1: &str,
) -> Result<()> {
    let (s, values_file, secrets, files) = (fleet.dir, fleet.values, fleet.secrets, fleet.files);
    // The cluster key rotated: a new Secret, the former key trusted by name.
    let former_key = fs::read_to_string(s.join("key1/node.pub"))?;
    let rotated = write_yaml(
        &s.join("rotated.yaml"),
        &json!({
            "trust": {
                "clusterKey": { "secretName": NEW_KEY_SECRET },
                "trustedKeys": { "former-cluster-key": former_key.trim() },
            },
        }),
    )?;
    let docs2 = rendered(&[values_file, &rotated])?;
    let out = c.install(&docs2, secrets, files)?;
    ensure!(
        out["config_changed"] == false && out["restarted"] == false,
        "the site's files changed, not containerd's: {out}"
    );
    let former = c.root.join("etc/gpu-ckpt/trusted/former-cluster-key.pub");
    ensure!(former.is_file(), "{} not written", former.display());
    restores(c.node()?, ref_a, before_a).await?;

    // The former key revoked: refused with the shim's trust error; not trusted any more.
    let revoked = write_yaml(
        &s.join("revoked.yaml"),
        &json!({ "trust": { "revokedKeys": [id1] } }),
    )?;
    let docs3 = rendered(&[values_file, &rotated, &revoked])?;
    let out = c.install(&docs3, secrets, files)?;
    ensure!(out["restarted"] == false, "{out}");
    ensure!(!former.exists(), "a revoked key is still in TrustedKeysDir");
    let cri = Cri::connect(c.node()?.socket()).await?;
    let msg = try_restore(&cri, c.node()?, RESTORE_HANDLER, "default", ref_a)
        .await?
        .err()
        .context("a checkpoint signed by a revoked key restored")?;
    refusal_text(&msg, ref_a)?;
    ensure!(
        refusal_logged(
            c.node()?,
            ref_a,
            &[&format!("signed by key {id1}, which is revoked")]
        ),
        "no refusal naming the revoked key in {}'s log",
        c.name
    );
    Ok(())
}

#[test]
fn a_fleet_set_up_by_the_chart_restores_across_nodes_and_refuses_a_revoked_key() -> Result<()> {
    let stack = Stack::discover()?;
    let reg = TlsRegistry::discover()?;
    let scratch = tempfile::Builder::new().prefix("fleet-").tempdir()?;
    let s = scratch.path();
    let files = s.join("mounted");
    let restart_log = s.join("restarts");

    let (secrets, id1) = fleet_secrets(s, &reg)?;
    // The pipeline's own pushes.
    let hosts = reg.hosts_dir(&s.join("pipeline/certs.d"), true)?;
    let auth = reg.auth_file(&s.join("pipeline/auth.json"), Some(reg.password()))?;

    let values_file = write_yaml(&s.join("values.yaml"), &values(&reg, &restart_log)?)?;
    let docs = rendered(&[&values_file])?;

    let mut a = FleetNode::new(&stack, s, "fleet-a")?;
    let mut b = FleetNode::new(&stack, s, "fleet-b")?;
    let mut c = FleetNode::new(&stack, s, "fleet-c")?;
    for n in [&a, &b] {
        n.prepare(&stack)?;
        let out = n.install(&docs, &secrets, &files)?;
        ensure!(out["restarted"] == true, "{}: {out}", n.name);
    }
    // Ready, as the DaemonSet's probe sees it, with the site's files in place.
    let (ready, out) = a.probe(&docs, &secrets, &files)?;
    ensure!(
        ready,
        "the readiness probe fails on an installed node: {out}"
    );
    // Root-only, and the trust the values give.
    let side = a
        .root
        .join("usr/local/bin/containerd-shim-gpu-ckpt-restore-v1.toml");
    ensure!(fs::metadata(&side)?.permissions().mode() & 0o777 == 0o600);
    let side = fs::read_to_string(&side)?;
    for want in ["Mode = \"restore\"", "SigningKey", "RegistryAuthFile", REPO] {
        ensure!(side.contains(want), "{want} not in the side file:\n{side}");
    }
    a.start(&stack)?;
    b.start(&stack)?;

    let tag = std::process::id();
    let ref_a = format!("{}/{REPO}/counter-a:{tag}", reg.addr);
    let ref_b = format!("{}/{REPO}/counter-b:{tag}", reg.addr);
    let rt = rt();
    rt.block_on(async {
        // Both handlers advertise runc's features, and a pod with a recursive read-only mount
        // runs on the installed gpu-ckpt handler, read-only all the way down (what critest's
        // recursive read-only specs check).
        let cri_a = Cri::connect(a.node()?.socket()).await?;
        expect_runc_features(&cri_a, &[GPU_CKPT_HANDLER, RESTORE_HANDLER]).await?;
        let host = NestedMount::new()?;
        expect_rro_counter(&cri_a, a.node()?, GPU_CKPT_HANDLER, host.path()).await?;
        let before_a = checkpoint_and_push(a.node()?, &ref_a, &hosts, &auth).await?;
        // B's push goes through B's own certs.d, as the installer wrote it: the site's CA
        // serves pushes too, not only the restore handler's pulls.
        let b_hosts = b.root.join("etc/gpu-ckpt/certs.d");
        let before_b = checkpoint_and_push(b.node()?, &ref_b, &b_hosts, &auth).await?;
        restores(b.node()?, &ref_a, before_a).await?;
        restores(a.node()?, &ref_b, before_b).await?;

        // A node that joins later, from the same rendering, with no other step.
        c.prepare(&stack)?;
        c.install(&docs, &secrets, &files)?;
        c.start(&stack)?;
        restores(c.node()?, &ref_a, before_a).await?;
        ensure!(restarts(&restart_log, "fleet-c") == 1);

        let fleet = Fleet {
            dir: s,
            values: &values_file,
            secrets: &secrets,
            files: &files,
        };
        rotate_then_revoke(&fleet, &c, &ref_a, before_a, &id1).await?;
        ensure!(restarts(&restart_log, "fleet-c") == 1, "C was restarted");
        Ok(())
    })
}
