//! The `gpu-ckpt` command's library part: one module per subcommand ([`commands`]), how results
//! and errors are printed ([`output`], `-o text|json|yaml`), the exit codes and the one map from
//! an error to its code ([`exit`]); and [`drain_plan`], a node's or a fleet's maintenance plan
//! from pod and node lists, with the compatibility rules of [`image_format::compat`]. The
//! command's main (src/bin/gpu-ckpt.rs) parses the flags and dispatches.

pub mod commands;
pub mod drain_plan;
pub mod exit;
pub mod output;
pub mod progress;
