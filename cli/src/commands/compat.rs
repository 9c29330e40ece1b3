//! `gpu-ckpt compat`: can this checkpoint restore on this node, by the shim's own rule.

use std::path::PathBuf;

use anyhow::Result;

use super::node::{self, NodeArgs, NodeSide};
use crate::output::{OutputArgs, Report, Text};

#[derive(clap::Args, Debug)]
pub struct CompatArgs {
    /// Archive, OCI image, checkpoint directory, or manifest JSON file.
    pub path: PathBuf,
    #[command(flatten)]
    pub out: OutputArgs,
    #[command(flatten)]
    pub node: NodeArgs,
}

pub fn run(a: &CompatArgs) -> Result<Report> {
    let (ckpt, _) = node::checkpoint_profile(&a.path)?;
    let side = NodeSide::read(&a.node, ckpt.devices.gpus.len())?;
    let r = side.check(&ckpt);
    let mut t = Text::default();
    node::verdict_text(&r, &mut t);
    let yes = r.compatible();
    Ok(Report::new(t.0, serde_json::to_value(&r)?).yes_if(yes))
}
