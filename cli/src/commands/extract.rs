//! `gpu-ckpt extract`: an archive into a directory (checked, verified, root-only), or an image
//! back to its archive.

use std::path::PathBuf;

use anyhow::Result;
use image_format::archive::{self, ExtractOptions};
use image_format::oci;
use image_format::safe::Limits;

use crate::exit::CliError;
use crate::output::{OutputArgs, Report, Text};
use crate::progress::Bar;

#[derive(clap::Args, Debug)]
pub struct ExtractArgs {
    /// Archive or OCI image.
    pub src: PathBuf,
    /// Extract the archive's contents into this directory.
    #[arg(long, value_name = "DIR")]
    pub to: Option<PathBuf>,
    /// From an image: write the checkpoint archive to this file.
    #[arg(long, value_name = "FILE")]
    pub archive: Option<PathBuf>,
    /// Do not verify checkpoint/ against the manifest while extracting.
    #[arg(long)]
    pub no_verify: bool,
    #[command(flatten)]
    pub out: OutputArgs,
}

pub fn run(a: &ExtractArgs) -> Result<Report> {
    if a.to.is_none() && a.archive.is_none() {
        return Err(
            CliError::Usage("nothing to do: give --to DIR and/or --archive FILE".into()).into(),
        );
    }
    let mut t = Text::default();
    let mut data = serde_json::json!({});
    let mut archive_path = a.src.clone();
    // The archive of an image extracted with --to only: in a fresh private directory, removed
    // when done.
    let mut tmp = None;
    if oci::is_image(&a.src) {
        let dst = match &a.archive {
            Some(o) => o.clone(),
            None => {
                let dir = oci::private_temp_dir("gpu-ckpt-extract-")?;
                let t = dir.path().join("archive.tar");
                tmp = Some(dir);
                t
            }
        };
        let mut bar = Bar::new("image -> archive");
        let res = oci::extract_archive_from_image(&a.src, &dst, Limits::default(), &mut |d, t| {
            bar.update(d, t)
        });
        bar.finish();
        res?;
        if a.archive.is_some() {
            t.line(format!("wrote archive {}", dst.display()));
            data["archive"] = serde_json::json!(dst);
        }
        archive_path = dst;
    } else if a.archive.is_some() {
        return Err(CliError::Usage(format!(
            "--archive applies to an OCI image; {} is an archive already",
            a.src.display()
        ))
        .into());
    }
    let res = (|| -> Result<()> {
        if let Some(dir) = &a.to {
            let mut bar = Bar::new("extract");
            let opts = ExtractOptions {
                limits: Limits::default(),
                verify: !a.no_verify,
            };
            let entries =
                archive::extract_archive(&archive_path, dir, opts, &mut |d, t| bar.update(d, t));
            bar.finish();
            let entries = entries?;
            t.line(format!(
                "extracted {} entries into {}",
                entries.len(),
                dir.display()
            ));
            data["to"] = serde_json::json!(dir);
            data["entries"] = serde_json::json!(entries.len());
        }
        Ok(())
    })();
    drop(tmp);
    res?;
    Ok(Report::new(t.0, data))
}
