//! What a gpu-ckpt checkpoint is: archive layout, manifest, OCI image, compatibility.
//!
//! - [`archive`]: the kubelet checkpoint archive (containerd 2.1+ layout, CRI-O's variant for reading),
//!   read safely, written, verified and extracted.
//! - [`manifest`]: the versioned gpu-ckpt manifest the shim writes next to the CRIU images.
//! - [`compat`]: can a checkpoint restore on a node, and which field differs if not.
//! - [`oci`]: the archive as an OCI image (layout directory or tarball), and back.
//! - [`registry`]: the registry client: push an image, pull a checkpoint archive, with
//!   containerd's host directory and docker-style logins, each login to its own host.
//! - [`reference`]: image references and `RestoreSources` registry prefixes, parsed strictly.
//! - [`protowire`]: a minimal protobuf reader for CRIU's statistics images.
//! - [`criu_creds`]: the credentials and seccomp state CRIU recorded for each task.
//! - [`mountinfo`]: mount tables, the kernel's (`/proc/<pid>/mountinfo`) and CRIU's.
//! - [`sign`]: Ed25519 signatures over the manifest, node keys, trusted keys.
//! - [`safe`]: the checks every untrusted tar entry passes, and `openat`-style extraction.
//! - [`durable`]: crash safety; the syncs and renames every checkpoint writer goes through.
//! - [`drain_plan`]: `gpu-ckpt drain-plan`, a node's or a fleet's maintenance plan from pod and
//!   node lists, with the compatibility rules of [`compat`].
//!
//! The format is specified in docs/image-format.md.

pub mod archive;
pub mod compat;
pub mod criu_creds;
pub mod criu_stats;
pub mod digest;
pub mod drain_plan;
pub mod durable;
pub mod error;
pub mod fuzzing;
pub mod manifest;
pub mod mountinfo;
pub mod oci;
pub mod protowire;
pub mod reference;
pub mod registry;
pub mod safe;
pub mod sign;

pub use error::{Error, Result};
pub use manifest::{hash_dir_flat, verify_dir, Manifest, MANIFEST_FILE};
