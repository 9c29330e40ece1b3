//! The `gpu-ckpt` command's library part: [`drain_plan`], a node's or a fleet's maintenance plan
//! from pod and node lists, with the compatibility rules of [`image_format::compat`]. The command
//! itself is src/bin/gpu-ckpt.rs.

pub mod drain_plan;
