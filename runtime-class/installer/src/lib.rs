//! gpu-ckpt's node installer: what the node-installer DaemonSet runs on every node of a GPU
//! pool. `install` copies the payload (the shim, `gpu-ckpt`, the OCI hook, CRIU with its
//! libraries) onto the node, writes the containerd drop-ins of both RuntimeClass handlers,
//! adds them to containerd's `imports`, writes the site's options (trust, restore sources,
//! registry, runc, handler options; [`site`]), restarts containerd when its configuration changed,
//! and labels the node; `uninstall` undoes all of it. Every step is recorded in
//! `/var/lib/gpu-ckpt/installed.json` before it is taken (see [`record`]).

pub mod config;
pub mod dropin;
pub mod elf;
pub mod error;
pub mod install;
pub mod labels;
pub mod ldcache;
pub mod lifecycle;
pub mod paths;
pub mod record;
pub mod site;
pub mod status;

pub use error::{Error, Result};
pub use install::{install, uninstall, Options, Outcome};
