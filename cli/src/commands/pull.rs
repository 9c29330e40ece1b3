//! `gpu-ckpt pull`: a checkpoint image's archive from a registry.

use std::path::PathBuf;

use anyhow::Result;
use image_format::safe::Limits;

use super::build::RegistryArgs;
use crate::output::{OutputArgs, Report, Text};
use crate::progress::{human, Bar};

#[derive(clap::Args, Debug)]
pub struct PullArgs {
    /// Image reference, e.g. registry.example.com/ckpt/counter:1.
    pub reference: String,
    /// Where to write the archive.
    pub archive: PathBuf,
    #[command(flatten)]
    pub registry: RegistryArgs,
    #[command(flatten)]
    pub out: OutputArgs,
}

pub fn run(a: &PullArgs) -> Result<Report> {
    let mut bar = Bar::new("pull");
    let d = registry::pull_archive(
        &a.reference,
        &a.archive,
        Limits::default(),
        &a.registry.options(),
        &mut |d, t| bar.update(d, t),
    );
    bar.finish();
    let d = d?;
    let size = std::fs::metadata(&a.archive)
        .map_err(|e| image_format::Error::io("reading", &a.archive, e))?
        .len();
    let mut t = Text::default();
    // A digest reference names its digest already (and was verified against it).
    if a.reference.contains('@') {
        t.line(format!("pulled {}", a.reference));
    } else {
        t.line(format!("pulled {}@{d}", a.reference));
    }
    t.line(format!(
        "  archive {} ({})",
        a.archive.display(),
        human(size)
    ));
    let data = serde_json::json!({"reference": a.reference, "digest": d,
        "archive": a.archive, "bytes": size});
    Ok(Report::new(t.0, data))
}
