//! `gpu-ckpt`: inspect, verify, check compatibility of, build and extract gpu-ckpt checkpoints.
//!
//! Exit codes: 0 success (compat: compatible), 1 compat: not compatible, 2 any error.
//! `device`: 0 success, 1 the driver or the process failed, 2 usage.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use image_format::archive::{self, ExtractOptions};
use image_format::compat::{self, Profile, Verdict};
use image_format::manifest::{Devices, Manifest, Workload, MANIFEST_FILE};
use image_format::oci::{self, BuildOptions};
use image_format::safe::Limits;
use registry::RegistryOptions;

use device::DeviceArgs;

#[derive(Parser)]
#[command(
    name = "gpu-ckpt",
    version,
    about = "Inspect, verify, check and package gpu-ckpt checkpoints"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Clone, Default)]
struct NodeArgs {
    /// Node GPU inventory, JSON: {"driver_version","cuda_driver_version","gpus":[{uuid,model,...}]}
    /// (or {"devices":{...},"workload":{...}}). Default: $GPU_CKPT_NODE_INVENTORY, else NVML.
    #[arg(long, value_name = "FILE")]
    node: Option<PathBuf>,
    /// The NVML library to read the node from (default libnvidia-ml.so.1).
    #[arg(long, value_name = "PATH")]
    libnvml: Option<PathBuf>,
    /// The GPUs the restored container would get, in its order (default: the node's first
    /// GPUs, as many as the checkpoint had).
    #[arg(long, value_name = "UUID,...")]
    gpus: Option<String>,
    /// Engine version the restoring pod declares (gpu-ckpt.io/engine-version).
    #[arg(long)]
    engine_version: Option<String>,
    /// Model version the restoring pod declares (gpu-ckpt.io/model-version).
    #[arg(long)]
    model_version: Option<String>,
}

/// Which keys this node trusts, for the signer lines of `inspect` and `verify`.
#[derive(clap::Args, Clone, Default)]
struct TrustArgs {
    /// The node's key: its private key (node.key) or public key (node.pub). Default
    /// /var/lib/gpu-ckpt/keys/node.pub (the shim's default SigningKey, beside it).
    #[arg(long, value_name = "FILE")]
    key: Option<PathBuf>,
    /// A directory of more trusted public keys (the handler option TrustedKeysDir).
    #[arg(long, value_name = "DIR")]
    trusted_keys: Option<PathBuf>,
    /// The revoked-keys list (the handler option RevokedKeysFile). Default: `revoked` beside
    /// the node's key.
    #[arg(long, value_name = "FILE")]
    revoked: Option<PathBuf>,
}

/// Where the node's key is, for `gpu-ckpt key`.
#[derive(clap::Args, Clone)]
struct KeyArgs {
    /// The node's private key (the handler option SigningKey).
    #[arg(long, value_name = "FILE", default_value_os_t = Path::new(image_format::sign::DEFAULT_KEY_DIR).join(image_format::sign::NODE_KEY_FILE))]
    key: PathBuf,
}

#[derive(Subcommand)]
enum KeyCmd {
    /// Replace the node's key with a new one. The former public key stays in the key directory
    /// as retired-<id>.pub: this node still trusts it until it is revoked, and other nodes
    /// where that file is in their TrustedKeysDir. Prints the new key id and public key file.
    Rotate {
        #[command(flatten)]
        key: KeyArgs,
        /// Also revoke the former key on this node (a key that may have leaked).
        #[arg(long)]
        revoke: bool,
    },
    /// Add a key to this node's revoked-keys list: checkpoints it signed are refused by the
    /// restore and by `verify`, even where the key is trusted.
    Revoke {
        /// A key id (ed25519:<32 hex digits>, as `verify` prints it), a public key (64 hex
        /// digits), or a public key file.
        key_ref: String,
        #[command(flatten)]
        key: KeyArgs,
        /// The revoked-keys list (the handler option RevokedKeysFile). Default: `revoked`
        /// beside --key.
        #[arg(long, value_name = "FILE")]
        revoked: Option<PathBuf>,
    },
}

/// Where the registry client finds TLS settings and logins.
#[derive(clap::Args, Clone)]
struct RegistryArgs {
    /// containerd's per-registry host directory (certs.d layout: HOST[:PORT]/hosts.toml,
    /// ca.crt). Plain HTTP only for localhost without a hosts.toml, or where hosts.toml says
    /// http://.
    #[arg(long, value_name = "DIR", default_value = registry::DEFAULT_HOSTS_DIR)]
    hosts_dir: PathBuf,
    /// Docker-style auth file (config.json / auth.json, credHelpers and credsStore included).
    /// Default: $REGISTRY_AUTH_FILE, else $DOCKER_CONFIG/config.json, else ~/.docker/config.json.
    #[arg(long, value_name = "FILE")]
    authfile: Option<PathBuf>,
}

impl RegistryArgs {
    fn options(&self) -> RegistryOptions {
        RegistryOptions {
            hosts_dir: Some(self.hosts_dir.clone()),
            auth_file: self.authfile.clone(),
            ..Default::default()
        }
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Show what a checkpoint archive or image holds (like `checkpointctl inspect`), with the GPU
    /// section and the compatibility verdict for this node.
    Inspect {
        /// Archive (.tar), OCI image (layout dir or tarball), or checkpoint directory.
        path: PathBuf,
        /// Print JSON instead of a tree.
        #[arg(long)]
        json: bool,
        /// List every entry.
        #[arg(long)]
        files: bool,
        #[command(flatten)]
        node: NodeArgs,
        #[command(flatten)]
        trust: TrustArgs,
    },
    /// Verify every digest: archive members against the manifest, image blobs against their digests,
    /// or a checkpoint directory against its manifest.
    Verify {
        path: PathBuf,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        trust: TrustArgs,
    },
    /// Can this checkpoint restore on this node? Exit 0 yes, 1 no (the differing fields are printed).
    Compat {
        /// Archive, OCI image, checkpoint directory, or manifest JSON file.
        path: PathBuf,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        node: NodeArgs,
    },
    /// Turn a checkpoint archive into an OCI image (layout directory and/or tarball), optionally pushed.
    Build {
        archive: PathBuf,
        /// Image reference, e.g. localhost:5000/ckpt/counter:1.
        #[arg(long = "ref", value_name = "REF")]
        reference: String,
        /// Write an OCI layout directory here.
        #[arg(long, value_name = "DIR")]
        layout: Option<PathBuf>,
        /// Write an OCI layout tarball here (for `ctr images import`).
        #[arg(long, value_name = "FILE")]
        tarball: Option<PathBuf>,
        /// Push to the registry named in --ref.
        #[arg(long)]
        push: bool,
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// Pull a checkpoint image from a registry and write its checkpoint archive (the image's
    /// layer, verified against its digest) to ARCHIVE (a new file, mode 0600).
    Pull {
        /// Image reference, e.g. registry.example.com/ckpt/counter:1.
        reference: String,
        /// Where to write the archive.
        archive: PathBuf,
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// Manage the node's signing key: rotate it, revoke a key.
    #[command(subcommand)]
    Key(KeyCmd),
    /// Drive the CUDA driver's checkpoint API for one process, like NVIDIA's cuda-checkpoint, or
    /// list the node's GPUs (--list). Exit 1 when the driver or the process fails, 2 on usage.
    Device(DeviceArgs),
    /// Plan a node's drain or a fleet's driver upgrade from `kubectl get pods/nodes -o json`:
    /// the ordered steps and kubelet checkpoint calls. Exit 1 when a workload has nowhere to go.
    DrainPlan(gpu_ckpt_cli::drain_plan::cli::DrainPlanArgs),
    /// Extract: an archive into a directory (checked, verified, root-only), or an image back to its
    /// archive (--archive).
    Extract {
        /// Archive or OCI image.
        src: PathBuf,
        /// Extract the archive's contents into this directory.
        #[arg(long, value_name = "DIR")]
        to: Option<PathBuf>,
        /// From an image: write the checkpoint archive to this file.
        #[arg(long, value_name = "FILE")]
        archive: Option<PathBuf>,
        /// Do not verify checkpoint/ against the manifest while extracting.
        #[arg(long)]
        no_verify: bool,
    },
}

/// Progress on stderr when it is a terminal, at most ten updates a second; nothing otherwise.
struct Bar(ProgressBar);

impl Bar {
    fn new(label: &'static str) -> Bar {
        let target = if std::io::stderr().is_terminal() {
            ProgressDrawTarget::stderr_with_hz(10)
        } else {
            ProgressDrawTarget::hidden()
        };
        let style = ProgressStyle::with_template(
            "{prefix}: {binary_bytes}/{binary_total_bytes} {percent:>3}% {binary_bytes_per_sec} [{bar:30}] {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
        Bar(ProgressBar::with_draw_target(None, target)
            .with_style(style)
            .with_prefix(label))
    }
    fn update(&mut self, done: u64, total: u64) {
        if total > 0 {
            self.0.set_length(total);
        }
        self.0.set_position(done);
    }
    fn finish(&self) {
        self.0.finish();
        // The last state stays on screen; what the command prints next starts a line of its own.
        if !self.0.is_hidden() {
            eprintln!();
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("gpu-ckpt: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.cmd {
        Cmd::Inspect {
            path,
            json,
            files,
            node,
            trust,
        } => inspect(&path, json, files, &node, &trust),
        Cmd::Verify { path, json, trust } => verify(&path, json, &trust),
        Cmd::Compat { path, json, node } => compat_cmd(&path, json, &node),
        Cmd::Build {
            archive,
            reference,
            layout,
            tarball,
            push,
            registry,
        } => build(&archive, &reference, layout, tarball, push, &registry),
        Cmd::Pull {
            reference,
            archive,
            registry,
        } => pull(&reference, &archive, &registry),
        Cmd::Extract {
            src,
            to,
            archive,
            no_verify,
        } => extract(&src, to, archive, no_verify),
        Cmd::Key(cmd) => key_cmd(cmd),
        Cmd::Device(args) => Ok(device::run(&args)),
        Cmd::DrainPlan(args) => Ok(ExitCode::from(
            match gpu_ckpt_cli::drain_plan::cli::run(&args, &mut std::io::stdout().lock())? {
                true => 0,
                false => 1,
            },
        )),
    }
}

/// The node's inventory plus the pod's declared versions, or None when no inventory can be had.
fn node_profile(args: &NodeArgs, count: usize) -> Result<Option<Profile>> {
    let path = args
        .node
        .clone()
        .or_else(|| std::env::var_os("GPU_CKPT_NODE_INVENTORY").map(PathBuf::from));
    let mut p = if let Some(path) = path {
        let data = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        let v: serde_json::Value =
            serde_json::from_slice(&data).with_context(|| format!("parsing {}", path.display()))?;
        if v.get("devices").is_some() {
            serde_json::from_value::<Profile>(v)
                .with_context(|| format!("parsing {}", path.display()))?
        } else {
            Profile {
                devices: serde_json::from_value::<Devices>(v)
                    .with_context(|| format!("parsing {}", path.display()))?,
                workload: Workload::default(),
            }
        }
    } else {
        match nvml_profile(args, count)? {
            Some(p) => p,
            None => return Ok(None),
        }
    };
    if let Some(e) = &args.engine_version {
        p.workload.engine_version = e.clone();
    }
    if let Some(m) = &args.model_version {
        p.workload.model_version = m.clone();
    }
    Ok(Some(p))
}

/// The node's profile from NVML (`--libnvml`, else `libnvidia-ml.so.1`): the GPUs a restore
/// would be given (`--gpus`, else the node's first `count`), with their free memory; `None`
/// when there is no NVIDIA driver.
fn nvml_profile(args: &NodeArgs, count: usize) -> Result<Option<Profile>> {
    use gpu::Inventory;
    let nvml = match gpu::NvmlInventory::open(args.libnvml.as_deref()) {
        Ok(n) => n,
        Err(gpu::GpuError::NoDriver { .. }) if args.libnvml.is_none() => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let inv = nvml.node()?;
    let gpus: Vec<gpu::GpuUuid> = match &args.gpus {
        Some(list) => list
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| s.parse::<gpu::GpuUuid>())
            .collect::<Result<_, _>>()?,
        None => inv.gpus.iter().take(count).map(|g| g.uuid).collect(),
    };
    for u in &gpus {
        if !inv.gpus.iter().any(|g| g.uuid == *u) {
            bail!("--gpus names {u}, which is not on this node");
        }
    }
    Ok(Some(Profile::from_inventory(
        &inv,
        &gpus,
        Workload::default(),
    )))
}

/// The checkpoint's profile (and manifest when there is one) from any kind of input.
fn checkpoint_profile(path: &Path) -> Result<(Profile, Option<Manifest>)> {
    if path.is_dir() && path.join(MANIFEST_FILE).is_file() {
        let m = Manifest::read_from(path)?;
        return Ok((Profile::from_manifest(&m), Some(m)));
    }
    if oci::is_image(path) {
        return match oci::image_profile(path)? {
            Some(p) => Ok((p, None)),
            None => bail!(
                "image {} carries no gpu-ckpt.io/ annotations",
                path.display()
            ),
        };
    }
    if path.is_file() {
        // A manifest JSON file, or an archive.
        let head = {
            let mut f = std::fs::File::open(path)?;
            let mut b = [0u8; 1];
            let n = std::io::Read::read(&mut f, &mut b)?;
            (n == 1).then_some(b[0])
        };
        if head == Some(b'{') {
            let data = std::fs::read(path)?;
            let m = Manifest::from_json(&data, &path.display().to_string())?;
            return Ok((Profile::from_manifest(&m), Some(m)));
        }
        let info = archive::read_info(path, Limits::default())?;
        let m = info.manifest.with_context(|| {
            format!(
                "{} has no {}",
                path.display(),
                archive::names::MANIFEST_PATH
            )
        })?;
        return Ok((Profile::from_manifest(&m), Some(m)));
    }
    bail!(
        "{}: not an archive, image, checkpoint directory or manifest",
        path.display()
    )
}

fn print_verdict(v: &Verdict) {
    if v.compatible {
        println!("compatible: yes");
        for p in v.remapped() {
            println!("  remap {} -> {}", p.old_uuid, p.new_uuid);
        }
    } else {
        println!("compatible: no");
        for d in &v.differences {
            println!("  {d}");
        }
    }
}

fn compat_cmd(path: &Path, json: bool, args: &NodeArgs) -> Result<ExitCode> {
    let (ckpt, _) = checkpoint_profile(path)?;
    let Some(node) = node_profile(args, ckpt.devices.gpus.len())? else {
        bail!("no node inventory: no NVIDIA driver here (libnvidia-ml.so.1); pass --libnvml, --node FILE, or set GPU_CKPT_NODE_INVENTORY");
    };
    let v = compat::check(&ckpt, &node);
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print_verdict(&v);
    }
    Ok(if v.compatible {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn human(b: u64) -> String {
    const U: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if b < 1024 {
        return format!("{b} B");
    }
    let mut v = b as f64 / 1024.0;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.1} {}", U[i])
}

/// Who signed the manifest document `json`, whether the signature holds, and whether this node
/// trusts the signer or revoked it.
fn signer_report(json: Option<&[u8]>, trust: &TrustArgs) -> serde_json::Value {
    use image_format::sign::{self, KeyStatus};
    let Some(json) = json else {
        return serde_json::json!({"signed": false, "summary": "no gpu-ckpt manifest"});
    };
    let signer = match sign::verify_json(json) {
        Ok(Some(s)) => s,
        Ok(None) => {
            return serde_json::json!({"signed": false, "valid": false,
                "summary": "unsigned (restored only where AllowUnsigned = true)"})
        }
        Err(e) => {
            return serde_json::json!({"signed": true, "valid": false,
                "summary": format!("INVALID: {e}")})
        }
    };
    let mut keys = sign::TrustedKeys::default();
    let mut problems = Vec::new();
    let key_path = trust
        .key
        .clone()
        .unwrap_or_else(|| Path::new(sign::DEFAULT_KEY_DIR).join(sign::NODE_PUB_FILE));
    // The public key only: node.pub, also when --key names the private key beside it.
    let pub_path = if key_path.extension().is_some_and(|x| x == "pub") {
        key_path.clone()
    } else {
        sign::public_key_path(&key_path)
    };
    if let Err(e) = sign::read_public_key(&pub_path).and_then(|k| keys.add_node_keys(&key_path, k))
    {
        problems.push(e.to_string());
    }
    if let Some(dir) = &trust.trusted_keys {
        if let Err(e) = keys.add_dir(dir) {
            problems.push(e.to_string());
        }
    }
    let revoked = trust
        .revoked
        .clone()
        .unwrap_or_else(|| key_path.with_file_name(sign::REVOKED_FILE));
    if let Err(e) = keys.add_revoked(&revoked) {
        problems.push(e.to_string());
    }
    let (trusted, revoked_at, summary) = match keys.status(&signer) {
        KeyStatus::Trusted(how) => (
            Some(how.to_string()),
            None,
            format!("{} (trusted: {how})", signer.key_id()),
        ),
        KeyStatus::Revoked(at) => (
            None,
            Some(at.to_string()),
            format!("{} (REVOKED: listed in {at})", signer.key_id()),
        ),
        KeyStatus::Untrusted => (
            None,
            None,
            format!("{} (NOT trusted by this node)", signer.key_id()),
        ),
    };
    serde_json::json!({"signed": true, "valid": true, "key_id": signer.key_id(),
        "public_key": signer.public_key_hex(), "trusted": trusted.is_some(),
        "trusted_as": trusted, "revoked": revoked_at.is_some(), "revoked_in": revoked_at,
        "key_problems": problems, "summary": summary})
}

/// `gpu-ckpt key rotate` and `gpu-ckpt key revoke`.
fn key_cmd(cmd: KeyCmd) -> Result<ExitCode> {
    use image_format::sign;
    match cmd {
        KeyCmd::Rotate { key, revoke } => {
            let r = sign::rotate(&key.key)?;
            println!("new key: {}", sign::key_id(&r.key.public_key()));
            println!("public key: {}", r.public_path.display());
            match &r.retired {
                Some((old, path)) => {
                    println!(
                        "retired key: {} (public key kept in {})",
                        sign::key_id(old),
                        path.display()
                    );
                    if revoke {
                        let list = key.key.with_file_name(sign::REVOKED_FILE);
                        let (id, _) = sign::revoke(&list, &sign::key_id(old))?;
                        println!("revoked: {id} (in {})", list.display());
                    }
                }
                None => println!("retired key: none (the directory had no key)"),
            }
            println!(
                "copy {} into the TrustedKeysDir of the nodes that restore this node's checkpoints",
                r.public_path.display()
            );
        }
        KeyCmd::Revoke {
            key_ref,
            key,
            revoked,
        } => {
            let list = revoked.unwrap_or_else(|| key.key.with_file_name(sign::REVOKED_FILE));
            let (id, already) = sign::revoke(&list, &key_ref)?;
            if already {
                println!("revoked already: {id} (in {})", list.display());
            } else {
                println!("revoked: {id} (in {})", list.display());
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn inspect(
    path: &Path,
    json: bool,
    files: bool,
    args: &NodeArgs,
    trust: &TrustArgs,
) -> Result<ExitCode> {
    let node = |ckpt: &Profile| node_profile(args, ckpt.devices.gpus.len()).unwrap_or(None);
    if oci::is_image(path) {
        let (m, digest) = oci::read_image_manifest(path)?;
        let prof = compat::profile_from_annotations(&m.annotations);
        let verdict = prof
            .as_ref()
            .and_then(|c| Some(compat::check(c, &node(c)?)));
        if json {
            let v = serde_json::json!({
                "image": path, "manifest_digest": digest, "annotations": m.annotations,
                "layers": m.layers, "gpu_profile": prof, "compat": verdict,
            });
            println!("{}", serde_json::to_string_pretty(&v)?);
        } else {
            println!("\nDisplaying checkpoint image {}\n", path.display());
            println!("Manifest: {digest}");
            for (k, v) in &m.annotations {
                println!("├── {k}: {v}");
            }
            for l in &m.layers {
                println!(
                    "└── layer {} ({}, {})",
                    l.digest,
                    l.media_type,
                    human(l.size)
                );
            }
            match &verdict {
                Some(v) => print_verdict(v),
                None => {
                    println!("compatible: unknown (no node inventory or no gpu-ckpt annotations)")
                }
            }
        }
        return Ok(ExitCode::SUCCESS);
    }
    let info = if path.is_dir() {
        archive::read_info_dir(path)?
    } else {
        archive::read_info(path, Limits::default())?
    };
    let signer = signer_report(info.manifest_json.as_deref(), trust);
    let (name, pod, ns) = info.identity();
    let cfg = info.config_dump.clone().unwrap_or_default();
    let verdict = info.manifest.as_ref().and_then(|m| {
        let c = Profile::from_manifest(m);
        Some(compat::check(&c, &node(&c)?))
    });
    if json {
        let entries_json: Option<Vec<serde_json::Value>> = files.then(|| {
            info.entries
                .iter()
                .map(|e| serde_json::json!({"path": e.path, "size": e.size}))
                .collect()
        });
        // checkpointctl's field names, plus "gpu" and "compat".
        let v = serde_json::json!([{
            "container_name": info.container_name(),
            "image": cfg.rootfs_image_name,
            "id": cfg.id,
            "runtime": cfg.runtime,
            "created": cfg.created_time,
            "checkpointed": cfg.checkpointed_time,
            "engine": info.engine().to_string(),
            "checkpoint_size": {
                "total_size": info.sizes.checkpoint_size,
                "memory_pages_size": info.sizes.memory_pages_size,
                "amd_gpu_memory_pages_size": info.sizes.amd_gpu_memory_pages_size,
                "root_fs_diff_size": info.sizes.root_fs_diff_size,
            },
            "metadata": {"pod_name": pod, "kubernetes_namespace": ns, "annotations": info.annotations()},
            "statistics": info.statistics,
            "gpu": info.manifest,
            "compat": verdict,
            "signer": signer,
            "files": entries_json,
        }]);
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "\nDisplaying container checkpoint tree view from {}\n",
        path.display()
    );
    println!(
        "{}",
        if name.is_empty() {
            info.container_name()
        } else {
            name
        }
    );
    println!("├── Image: {}", cfg.rootfs_image_name);
    println!("├── ID: {}", cfg.id);
    println!("├── Runtime: {}", cfg.runtime);
    println!("├── Created: {}", cfg.created_time);
    if !cfg.checkpointed_time.is_empty() {
        println!("├── Checkpointed: {}", cfg.checkpointed_time);
    }
    println!("├── Engine: {}", info.engine());
    println!(
        "├── Signer: {}",
        signer["summary"].as_str().unwrap_or_default()
    );
    if !pod.is_empty() {
        println!("├── Pod: {pod} (namespace {ns})");
    }
    println!("├── Checkpoint size: {}", human(info.sizes.checkpoint_size));
    println!(
        "│   └── Memory pages size: {}",
        human(info.sizes.memory_pages_size)
    );
    if info.sizes.root_fs_diff_size > 0 {
        println!(
            "├── Root FS diff size: {}",
            human(info.sizes.root_fs_diff_size)
        );
    }
    if let Some(s) = &info.statistics {
        println!("├── CRIU dump statistics");
        println!("│   ├── Freezing time: {} us", s.freezing_time);
        println!("│   ├── Frozen time: {} us", s.frozen_time);
        println!("│   ├── Memdump time: {} us", s.memdump_time);
        println!("│   ├── Memwrite time: {} us", s.memwrite_time);
        println!("│   ├── Pages scanned: {}", s.pages_scanned);
        println!("│   └── Pages written: {}", s.pages_written);
    }
    match &info.manifest {
        None => println!("└── GPU: no gpu-ckpt manifest (not taken by gpu-ckpt)"),
        Some(m) => {
            println!(
                "└── GPU (manifest schema {}, taken {})",
                m.schema_version, m.created
            );
            println!(
                "    ├── Node: kernel {}, CRIU {}, runc {}, shim {}",
                m.node.kernel, m.node.criu, m.node.runc, m.node.shim
            );
            println!(
                "    ├── Driver {}, CUDA {}",
                m.devices.driver_version, m.devices.cuda_driver_version
            );
            let held = m.devices.bytes_per_gpu();
            for (i, g) in m.devices.gpus.iter().enumerate() {
                println!(
                    "    ├── GPU {i}: {} ({}, {}, {}) {}, device memory held: {}",
                    g.model,
                    g.architecture,
                    human(g.memory_bytes),
                    g.pci_address,
                    g.uuid,
                    human(held[i])
                );
            }
            for p in &m.devices.processes {
                let on: Vec<String> = p
                    .gpus
                    .iter()
                    .map(|g| format!("{} on {}", human(g.bytes), g.uuid))
                    .collect();
                println!("    ├── Process {}: {}", p.pid, on.join(", "));
            }
            for f in &m.devices.driver_files {
                let id = if f.build_id.is_empty() {
                    "none"
                } else {
                    &f.build_id
                };
                println!(
                    "    ├── Driver file: {} ({}, build id {id})",
                    f.path,
                    human(f.size)
                );
            }
            if !m.devices.processes.is_empty() {
                println!(
                    "    ├── Device bytes (staged in host memory): {}",
                    human(m.devices.device_bytes())
                );
            }
            println!(
                "    ├── Engine version: {}, model version: {}",
                m.workload.engine_version, m.workload.model_version
            );
            println!(
                "    ├── Device state: {} blobs, {}",
                m.device_state.len(),
                human(m.device_state_bytes())
            );
            for t in &m.timings {
                println!("    ├── {}: {:.1} ms", t.step, t.millis);
            }
            println!("    └── Files: {} listed", m.files.len());
        }
    }
    if files {
        println!("\nEntries:");
        for e in &info.entries {
            println!("  {:>12}  {}", e.size, e.path);
        }
    }
    match &verdict {
        Some(v) => print_verdict(v),
        None => println!("compatible: unknown (no node inventory or no manifest)"),
    }
    Ok(ExitCode::SUCCESS)
}

fn verify(path: &Path, json: bool, trust: &TrustArgs) -> Result<ExitCode> {
    let start = Instant::now();
    // The signature first: a manifest whose signature does not hold is not verified further.
    let manifest_json = if path.is_dir() && path.join(MANIFEST_FILE).is_file() {
        Some(std::fs::read(path.join(MANIFEST_FILE))?)
    } else if oci::is_image(path) {
        None
    } else {
        archive::read_info(path, Limits::default())?.manifest_json
    };
    let signer = if oci::is_image(path) {
        serde_json::json!({"summary": "see the archive (gpu-ckpt extract IMAGE --archive OUT)"})
    } else {
        signer_report(manifest_json.as_deref(), trust)
    };
    if signer["signed"] == true && signer["valid"] == false {
        bail!("{}", signer["summary"].as_str().unwrap_or_default());
    }
    if signer["revoked"] == true {
        bail!(
            "the checkpoint is signed by key {}, which is revoked (listed in {}): a node refuses to restore it",
            signer["key_id"].as_str().unwrap_or_default(),
            signer["revoked_in"].as_str().unwrap_or_default()
        );
    }
    let mut bar = Bar::new("verify");
    let (summary, bytes) = if path.is_dir() && path.join(MANIFEST_FILE).is_file() {
        let m = image_format::manifest::verify_dir_progress(path, &mut |d, t| bar.update(d, t))?;
        let b: u64 = m.files.values().map(|f| f.size).sum();
        (format!("{} files match the manifest", m.files.len()), b)
    } else if oci::is_image(path) {
        // Blob digest: stream the layer to nowhere while hashing.
        let n = oci::verify_image(path, Limits::default(), &mut |d, t| bar.update(d, t))?;
        (format!("image layer digest ok ({})", human(n)), n)
    } else {
        let r = archive::verify_archive(path, Limits::default(), &mut |d, t| bar.update(d, t))?;
        (
            format!(
                "{} checkpoint files match the manifest; {} other members ({}) are not covered by it",
                r.files_verified,
                r.uncovered.len(),
                r.uncovered.keys().cloned().collect::<Vec<_>>().join(", ")
            ),
            r.bytes,
        )
    };
    bar.finish();
    let secs = start.elapsed().as_secs_f64();
    if json {
        println!(
            "{}",
            serde_json::json!({"ok": true, "summary": summary, "bytes": bytes, "seconds": secs, "signer": signer})
        );
    } else {
        println!("verify ok: {summary}");
        println!("signer: {}", signer["summary"].as_str().unwrap_or_default());
    }
    Ok(ExitCode::SUCCESS)
}

fn build(
    archive: &Path,
    reference: &str,
    layout: Option<PathBuf>,
    tarball: Option<PathBuf>,
    push: bool,
    registry: &RegistryArgs,
) -> Result<ExitCode> {
    if layout.is_none() && tarball.is_none() && !push {
        bail!("nothing to do: give --layout DIR, --tarball FILE and/or --push");
    }
    let opts = BuildOptions {
        reference: reference.to_string(),
        limits: Limits::default(),
    };
    let mut bar = Bar::new("build");
    let mut built = None;
    let mut pushed_from = None;
    if let Some(t) = &tarball {
        built = Some(oci::build_tarball(archive, t, &opts, &mut |d, t| {
            bar.update(d, t)
        })?);
        pushed_from = Some(t.clone());
    }
    if let Some(l) = &layout {
        let b = oci::build_layout(archive, l, &opts, &mut |d, t| bar.update(d, t))?;
        built = Some(b);
        pushed_from = Some(l.clone());
    }
    // Only a push: the layout is staged in a fresh private directory, removed when done.
    let mut staging = None;
    if pushed_from.is_none() {
        let dir = oci::private_temp_dir("gpu-ckpt-build-")?;
        built = Some(oci::build_layout(
            archive,
            dir.path(),
            &opts,
            &mut |d, t| bar.update(d, t),
        )?);
        pushed_from = Some(dir.path().to_path_buf());
        staging = Some(dir);
    }
    bar.finish();
    let built = built.context("nothing built")?;
    println!("built {} ({})", reference, built.manifest_digest);
    println!(
        "  layer {} ({})",
        built.layer.digest,
        human(built.layer.size)
    );
    println!("  container {}", built.container_name);
    if let Some(t) = &tarball {
        println!("  tarball {}", t.display());
    }
    if let Some(l) = &layout {
        println!("  layout {}", l.display());
    }
    if push {
        let from = pushed_from.context("no image to push")?;
        let mut bar = Bar::new("push");
        let d = registry::push_image(&from, reference, &registry.options(), &mut |d, t| {
            bar.update(d, t)
        });
        bar.finish();
        drop(staging);
        println!("pushed {reference}@{}", d?);
    }
    Ok(ExitCode::SUCCESS)
}

fn pull(reference: &str, archive: &Path, registry: &RegistryArgs) -> Result<ExitCode> {
    let mut bar = Bar::new("pull");
    let d = registry::pull_archive(
        reference,
        archive,
        Limits::default(),
        &registry.options(),
        &mut |d, t| bar.update(d, t),
    );
    bar.finish();
    let d = d?;
    let size = std::fs::metadata(archive)
        .with_context(|| format!("reading {}", archive.display()))?
        .len();
    // A digest reference names its digest already (and was verified against it).
    if reference.contains('@') {
        println!("pulled {reference}");
    } else {
        println!("pulled {reference}@{d}");
    }
    println!("  archive {} ({})", archive.display(), human(size));
    Ok(ExitCode::SUCCESS)
}

fn extract(
    src: &Path,
    to: Option<PathBuf>,
    out: Option<PathBuf>,
    no_verify: bool,
) -> Result<ExitCode> {
    if to.is_none() && out.is_none() {
        bail!("nothing to do: give --to DIR and/or --archive FILE");
    }
    let mut archive_path = src.to_path_buf();
    // The archive of an image extracted with --to only: in a fresh private directory, removed
    // when done.
    let mut tmp = None;
    if oci::is_image(src) {
        let dst = match &out {
            Some(o) => o.clone(),
            None => {
                let dir = oci::private_temp_dir("gpu-ckpt-extract-")?;
                let t = dir.path().join("archive.tar");
                tmp = Some(dir);
                t
            }
        };
        let mut bar = Bar::new("image -> archive");
        oci::extract_archive_from_image(src, &dst, Limits::default(), &mut |d, t| {
            bar.update(d, t)
        })?;
        bar.finish();
        if out.is_some() {
            println!("wrote archive {}", dst.display());
        }
        archive_path = dst;
    } else if out.is_some() {
        bail!(
            "--archive applies to an OCI image; {} is an archive already",
            src.display()
        );
    }
    let res = (|| -> Result<()> {
        if let Some(dir) = &to {
            let mut bar = Bar::new("extract");
            let opts = ExtractOptions {
                limits: Limits::default(),
                verify: !no_verify,
            };
            let entries =
                archive::extract_archive(&archive_path, dir, opts, &mut |d, t| bar.update(d, t))?;
            bar.finish();
            println!("extracted {} entries into {}", entries.len(), dir.display());
        }
        Ok(())
    })();
    drop(tmp);
    res?;
    Ok(ExitCode::SUCCESS)
}

/// `gpu-ckpt device`: cuda-checkpoint's options over the gpu crate's backends.
mod device {
    use std::path::PathBuf;
    use std::process::ExitCode;
    use std::time::Duration;

    use clap::{ArgGroup, ValueEnum};
    use gpu::{
        CudaDriver, DeviceCheckpoint, GpuError, GpuPair, Inventory, NodeInventory, NvmlInventory,
        ProcessState,
    };

    #[derive(clap::Args, Debug)]
    #[command(group(
        ArgGroup::new("op")
            .required(true)
            .args(["get_state", "get_restore_tid", "action", "toggle", "list"])
    ))]
    pub struct DeviceArgs {
        /// The process to act on.
        #[arg(short = 'p', long, value_name = "PID",
              value_parser = clap::value_parser!(i32).range(1..),
              required_unless_present = "list")]
        pid: Option<i32>,
        /// Print the process's state (running, locked, checkpointed, failed, ...).
        #[arg(long)]
        get_state: bool,
        /// Print the tid of the driver's restore thread in the process.
        #[arg(long)]
        get_restore_tid: bool,
        /// One step of the checkpoint API.
        #[arg(long, value_enum, value_name = "ACTION")]
        action: Option<Action>,
        /// running → lock + checkpoint; checkpointed → restore + unlock.
        #[arg(long)]
        toggle: bool,
        /// Lock timeout in milliseconds (0: none). With --action lock or --toggle.
        #[arg(short = 't', long, value_name = "MS")]
        timeout: Option<u32>,
        /// Restore onto other GPUs: OLD=NEW,... (GPU-… UUIDs). With --action restore or --toggle.
        #[arg(long, value_name = "OLD=NEW,...")]
        device_map: Option<String>,
        /// List the node's GPUs and driver versions (NVML).
        #[arg(long)]
        list: bool,
        /// With --list: print JSON.
        #[arg(long)]
        json: bool,
        /// The CUDA driver library (default: libcuda.so.1 from the loader's search path).
        #[arg(long, value_name = "PATH")]
        libcuda: Option<PathBuf>,
        /// The NVML library (default: libnvidia-ml.so.1 from the loader's search path).
        #[arg(long, value_name = "PATH")]
        libnvml: Option<PathBuf>,
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
    enum Action {
        Lock,
        Checkpoint,
        Restore,
        Unlock,
    }

    /// A failed step: printed as one line, exit 1.
    struct Failure {
        step: &'static str,
        pid: Option<i32>,
        error: String,
    }

    fn fail(step: &'static str, pid: Option<i32>) -> impl FnOnce(GpuError) -> Failure {
        move |e| Failure {
            step,
            pid,
            error: e.to_string(),
        }
    }

    fn usage(msg: &str) -> ExitCode {
        eprintln!("gpu-ckpt device: {msg}");
        ExitCode::from(2)
    }

    pub fn run(args: &DeviceArgs) -> ExitCode {
        let toggles = args.toggle;
        let action = args.action;
        if args.json && !args.list {
            return usage("--json applies to --list");
        }
        if args.timeout.is_some() && !(toggles || action == Some(Action::Lock)) {
            return usage("--timeout applies to --action lock and --toggle");
        }
        let pairs = match &args.device_map {
            None => Vec::new(),
            Some(_) if !(toggles || action == Some(Action::Restore)) => {
                return usage("--device-map applies to --action restore and --toggle")
            }
            Some(m) => match GpuPair::parse_map(m) {
                Ok(p) => p,
                Err(e) => return usage(&format!("--device-map: {e}")),
            },
        };
        let result = if args.list {
            list(args)
        } else {
            match args.pid {
                Some(pid) => on_process(args, pid, &pairs),
                None => return usage("--pid is required"),
            }
        };
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(f) => {
                let what = match f.pid {
                    Some(pid) => format!("{} pid {pid}", f.step),
                    None => f.step.to_string(),
                };
                let line = format!("gpu-ckpt device: {what} failed: {}", f.error);
                eprintln!("{}", line.replace('\n', " "));
                ExitCode::from(1)
            }
        }
    }

    fn on_process(args: &DeviceArgs, pid: i32, pairs: &[GpuPair]) -> Result<(), Failure> {
        let driver = CudaDriver::open(args.libcuda.as_deref()).map_err(fail("load", Some(pid)))?;
        let timeout = args
            .timeout
            .filter(|&ms| ms > 0)
            .map(|ms| Duration::from_millis(u64::from(ms)));
        if args.get_state {
            let s = driver.state(pid).map_err(fail("get-state", Some(pid)))?;
            println!("{s}");
        } else if args.get_restore_tid {
            let tid = driver
                .restore_thread_id(pid)
                .map_err(fail("get-restore-tid", Some(pid)))?;
            println!("{tid}");
        } else if let Some(a) = args.action {
            match a {
                Action::Lock => driver.lock(pid, timeout).map_err(fail("lock", Some(pid)))?,
                Action::Checkpoint => driver
                    .checkpoint(pid)
                    .map_err(fail("checkpoint", Some(pid)))?,
                Action::Restore => driver
                    .restore(pid, pairs)
                    .map_err(fail("restore", Some(pid)))?,
                Action::Unlock => driver.unlock(pid).map_err(fail("unlock", Some(pid)))?,
            }
        } else if args.toggle {
            toggle(&driver, pid, timeout, pairs)?;
        }
        Ok(())
    }

    /// running → lock + checkpoint (unlocked again if the checkpoint fails); checkpointed →
    /// restore + unlock; anything else is an error.
    fn toggle(
        driver: &dyn DeviceCheckpoint,
        pid: i32,
        timeout: Option<Duration>,
        pairs: &[GpuPair],
    ) -> Result<(), Failure> {
        let state = driver.state(pid).map_err(fail("get-state", Some(pid)))?;
        match state {
            ProcessState::RUNNING => {
                driver.lock(pid, timeout).map_err(fail("lock", Some(pid)))?;
                if let Err(e) = driver.checkpoint(pid) {
                    let undo = match driver.unlock(pid) {
                        Ok(()) => "the process was unlocked again".to_string(),
                        Err(u) => format!("unlocking it again failed too: {u}"),
                    };
                    return Err(Failure {
                        step: "checkpoint",
                        pid: Some(pid),
                        error: format!("{e}; {undo}"),
                    });
                }
                Ok(())
            }
            ProcessState::CHECKPOINTED => {
                driver
                    .restore(pid, pairs)
                    .map_err(fail("restore", Some(pid)))?;
                driver.unlock(pid).map_err(fail("unlock", Some(pid)))
            }
            other => Err(Failure {
                step: "toggle",
                pid: Some(pid),
                error: format!(
                    "the process is {other}; --toggle acts on running or checkpointed processes \
                     (use --action)"
                ),
            }),
        }
    }

    fn list(args: &DeviceArgs) -> Result<(), Failure> {
        let nvml = NvmlInventory::open(args.libnvml.as_deref()).map_err(fail("list", None))?;
        let node = nvml.node().map_err(fail("list", None))?;
        if args.json {
            let j = serde_json::to_string_pretty(&node).map_err(|e| Failure {
                step: "list",
                pid: None,
                error: e.to_string(),
            })?;
            println!("{j}");
        } else {
            print!("{}", list_text(&node));
        }
        Ok(())
    }

    fn list_text(node: &NodeInventory) -> String {
        let v = node.cuda_driver_version;
        let mut out = format!(
            "driver {}  CUDA {}.{}  GPU remapping: {}\n",
            node.driver_version,
            v / 1000,
            (v % 1000) / 10,
            if v >= gpu::cuda::REMAP_MIN_VERSION {
                "yes"
            } else {
                "no"
            }
        );
        for g in &node.gpus {
            let cc = g
                .compute_capability
                .map(|(a, b)| format!("sm_{a}{b}"))
                .unwrap_or_else(|| "sm_?".into());
            let persistence = match g.persistence_mode {
                Some(true) => "persistence on",
                Some(false) => "persistence off",
                None => "persistence ?",
            };
            out.push_str(&format!(
                "{}  {}  {}  {}  {}  {:.1} GiB  {}  {}\n",
                g.index,
                g.uuid,
                g.name,
                g.architecture.as_deref().unwrap_or("?"),
                cc,
                g.memory_total_bytes as f64 / (1u64 << 30) as f64,
                g.pci_bus_id,
                persistence
            ));
        }
        out
    }
}
