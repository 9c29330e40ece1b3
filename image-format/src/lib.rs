//! What a gpu-ckpt checkpoint is: archive layout, manifest, OCI image, compatibility.
//! The registry client is the crate `gpu-ckpt-registry`, the `gpu-ckpt` command `gpu-ckpt-cli`.
//!
//! - [`archive`]: the kubelet checkpoint archive (containerd 2.1+ layout, CRI-O's variant for reading),
//!   read safely, written, verified and extracted.
//! - [`manifest`]: the versioned gpu-ckpt manifest the shim writes next to the CRIU images.
//! - [`compat`]: can a checkpoint restore on a node, and which field differs if not.
//! - [`driver_files`]: the driver's user-space files a GPU process maps, and their build ids.
//! - [`oci`]: the archive as an OCI image (layout directory or tarball), and back.
//! - [`reference`]: image references and `RestoreSources` registry prefixes, parsed strictly (the
//!   tag an OCI image is built under; the registry client, crate `gpu-ckpt-registry`, and the
//!   shim's source checks use it too).
//! - [`protowire`]: a minimal protobuf reader for CRIU's statistics images.
//! - [`cri`]: the CRI annotation keys (`io.kubernetes.cri.*`) a container's spec carries.
//! - [`criu_creds`]: the credentials and seccomp state CRIU recorded for each task.
//! - [`mountinfo`]: mount tables, the kernel's (`/proc/<pid>/mountinfo`) and CRIU's.
//! - [`sign`]: Ed25519 signatures over the manifest, node keys, trusted keys.
//! - [`safe`]: the checks every untrusted tar entry passes, and `openat`-style extraction.
//! - [`durable`]: crash safety; the syncs and renames every checkpoint writer goes through.
//!
//! The format is specified in docs/image-format.md.

pub mod archive;
pub mod compat;
pub mod cri;
pub mod criu_creds;
pub mod criu_stats;
pub mod digest;
pub mod driver_files;
pub mod durable;
pub mod error;
pub mod fuzzing;
pub mod manifest;
pub mod mountinfo;
pub mod oci;
pub mod protowire;
pub mod reference;
pub mod safe;
pub mod sign;

pub use error::{Error, Result};
pub use manifest::{hash_dir_flat, verify_dir, Manifest, MANIFEST_FILE};
