//! What a path given to `inspect`, `verify` or `compat` holds.

use std::path::Path;

use anyhow::Result;
use image_format::manifest::MANIFEST_FILE;
use image_format::oci;

use crate::exit::CliError;

/// CRIU's first image, in every checkpoint directory it writes.
const CRIU_INVENTORY: &str = "inventory.img";

/// The kinds of input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    /// A checkpoint directory (`ctr task checkpoint --image-path`): CRIU's images, and
    /// gpu-ckpt's manifest where gpu-ckpt took it.
    Dir { manifest: bool },
    /// An OCI checkpoint image: a layout directory or tarball.
    Image,
    /// Any other file: a checkpoint archive (or, for `compat`, a manifest JSON file).
    File,
}

impl Input {
    /// What `path` is: a missing path is an I/O error, a directory that is no checkpoint
    /// directory nor image an integrity error.
    pub fn of(path: &Path) -> Result<Input> {
        let meta =
            std::fs::metadata(path).map_err(|e| image_format::Error::io("reading", path, e))?;
        if oci::is_image(path) {
            return Ok(Input::Image);
        }
        if !meta.is_dir() {
            return Ok(Input::File);
        }
        let manifest = path.join(MANIFEST_FILE).is_file();
        if !manifest && !path.join(CRIU_INVENTORY).is_file() {
            return Err(CliError::NotACheckpoint {
                path: path.to_path_buf(),
                why: format!(
                    "a directory without gpu-ckpt's manifest ({MANIFEST_FILE}) or CRIU's {CRIU_INVENTORY}, and no OCI image layout"
                ),
            }
            .into());
        }
        Ok(Input::Dir { manifest })
    }
}
