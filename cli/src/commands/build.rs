//! `gpu-ckpt build`: a checkpoint archive, verified, into an OCI image (layout directory and/or
//! tarball), optionally pushed.

use std::path::PathBuf;

use anyhow::{Context, Result};
use image_format::archive;
use image_format::oci::{self, BuildOptions};
use image_format::safe::Limits;
use image_format::sign;
use registry::RegistryOptions;

use crate::exit::CliError;
use crate::output::{OutputArgs, Report, Text};
use crate::progress::{human, Bar};

/// Where the registry client finds TLS settings and logins.
#[derive(clap::Args, Clone, Debug)]
pub struct RegistryArgs {
    /// containerd's per-registry host directory (certs.d layout: HOST[:PORT]/hosts.toml,
    /// ca.crt). Plain HTTP only for localhost without a hosts.toml, or where hosts.toml says
    /// http://.
    #[arg(long, value_name = "DIR", default_value = registry::DEFAULT_HOSTS_DIR)]
    pub hosts_dir: PathBuf,
    /// Docker-style auth file (config.json / auth.json, credHelpers and credsStore included).
    /// Default: $REGISTRY_AUTH_FILE, else $DOCKER_CONFIG/config.json, else ~/.docker/config.json.
    #[arg(long, value_name = "FILE")]
    pub authfile: Option<PathBuf>,
}

impl RegistryArgs {
    pub fn options(&self) -> RegistryOptions {
        RegistryOptions {
            hosts_dir: Some(self.hosts_dir.clone()),
            auth_file: self.authfile.clone(),
            ..Default::default()
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct BuildArgs {
    pub archive: PathBuf,
    /// Image reference, e.g. localhost:5000/ckpt/counter:1.
    #[arg(long = "ref", value_name = "REF")]
    pub reference: String,
    /// Write an OCI layout directory here.
    #[arg(long, value_name = "DIR")]
    pub layout: Option<PathBuf>,
    /// Write an OCI layout tarball here (for `ctr images import`).
    #[arg(long, value_name = "FILE")]
    pub tarball: Option<PathBuf>,
    /// Push to the registry named in --ref.
    #[arg(long)]
    pub push: bool,
    /// Do not verify the archive first: package it as it is (a restore, and `verify` of the
    /// image, still check it).
    #[arg(long)]
    pub no_verify: bool,
    #[command(flatten)]
    pub registry: RegistryArgs,
    #[command(flatten)]
    pub out: OutputArgs,
}

/// The archive is whole and as its manifest says: every header (a truncated or hostile archive
/// is refused), and, where it has gpu-ckpt's manifest, the manifest's signature where it has
/// one and every file of `checkpoint/` against it (all differences named). An image is never
/// built from a checkpoint that `verify` would refuse for its content. Returns the files
/// verified, none for an archive without the manifest (another engine's checkpoint: nothing to
/// hold its files to).
fn check_input(a: &BuildArgs) -> Result<Option<usize>> {
    let info = archive::read_info(&a.archive, Limits::default())?;
    let Some(json) = info.manifest_json else {
        return Ok(None);
    };
    sign::verify_json(&json)?;
    let mut bar = Bar::new("verify");
    let r =
        archive::verify_archive_every(&a.archive, Limits::default(), &mut |d, t| bar.update(d, t));
    bar.finish();
    Ok(Some(r?.files_verified))
}

pub fn run(a: &BuildArgs) -> Result<Report> {
    if a.layout.is_none() && a.tarball.is_none() && !a.push {
        return Err(CliError::Usage(
            "nothing to do: give --layout DIR, --tarball FILE and/or --push".into(),
        )
        .into());
    }
    let verified = match a.no_verify {
        true => None,
        false => check_input(a).with_context(|| {
            format!("{}: refused as the input of an image", a.archive.display())
        })?,
    };
    let opts = BuildOptions {
        reference: a.reference.clone(),
        limits: Limits::default(),
    };
    let mut bar = Bar::new("build");
    let mut built = None;
    let mut pushed_from = None;
    if let Some(t) = &a.tarball {
        built = Some(oci::build_tarball(&a.archive, t, &opts, &mut |d, t| {
            bar.update(d, t)
        })?);
        pushed_from = Some(t.clone());
    }
    if let Some(l) = &a.layout {
        let b = oci::build_layout(&a.archive, l, &opts, &mut |d, t| bar.update(d, t))?;
        built = Some(b);
        pushed_from = Some(l.clone());
    }
    // Only a push: the layout is staged in a fresh private directory, removed when done.
    let mut staging = None;
    if pushed_from.is_none() {
        let dir = oci::private_temp_dir("gpu-ckpt-build-")?;
        built = Some(oci::build_layout(
            &a.archive,
            dir.path(),
            &opts,
            &mut |d, t| bar.update(d, t),
        )?);
        pushed_from = Some(dir.path().to_path_buf());
        staging = Some(dir);
    }
    bar.finish();
    let built = built.context("nothing built")?;
    let mut t = Text::default();
    t.line(format!("built {} ({})", a.reference, built.manifest_digest));
    t.line(format!(
        "  layer {} ({})",
        built.layer.digest,
        human(built.layer.size)
    ));
    t.line(format!("  container {}", built.container_name));
    match verified {
        Some(n) => t.line(format!(
            "  verified: {n} checkpoint files match the manifest"
        )),
        None if a.no_verify => t.line("  not verified (--no-verify)"),
        None => t.line("  not verified: the archive has no gpu-ckpt manifest"),
    }
    if let Some(p) = &a.tarball {
        t.line(format!("  tarball {}", p.display()));
    }
    if let Some(l) = &a.layout {
        t.line(format!("  layout {}", l.display()));
    }
    let mut data = serde_json::json!({"reference": a.reference,
        "manifest_digest": built.manifest_digest, "layer": built.layer,
        "container": built.container_name, "files_verified": verified,
        "tarball": a.tarball, "layout": a.layout});
    if a.push {
        let from = pushed_from.context("no image to push")?;
        let mut bar = Bar::new("push");
        let d = registry::push_image(&from, &a.reference, &a.registry.options(), &mut |d, t| {
            bar.update(d, t)
        });
        bar.finish();
        drop(staging);
        let d = d?;
        t.line(format!("pushed {}@{d}", a.reference));
        data["pushed"] = serde_json::json!(format!("{}@{d}", a.reference));
    }
    Ok(Report::new(t.0, data))
}
