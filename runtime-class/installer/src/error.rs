//! The installer's errors: each names what failed, on which file or object, and why.

use std::path::{Path, PathBuf};

use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    /// A command-line path that cannot be used (not absolute, `..`).
    #[error("{what} {path:?} is not usable: {why}")]
    BadPath {
        what: &'static str,
        path: PathBuf,
        why: &'static str,
    },
    /// A file the installer would write is there and is not one it installed.
    #[error("refusing to overwrite {path}: the file is not one gpu-ckpt-node-installer installed (remove or move it, then run again)")]
    Foreign { path: PathBuf },
    /// A directory the installer would write trust files or CRIU into is there and is not
    /// root's alone to write.
    #[error("refusing to use directory {path}: {why} (trust files and CRIU go only into directories that root owns and nobody else may write to; fix or remove it, then run again)")]
    ForeignDir { path: PathBuf, why: String },
    /// The payload lacks something the node needs.
    #[error("payload {payload} has no {name}: the image must carry it")]
    PayloadMissing { payload: PathBuf, name: String },
    /// The payload's CRIU cannot be given the bundled loader as its interpreter.
    #[error("payload CRIU {path}: {why}")]
    PayloadCriu { path: PathBuf, why: String },
    /// containerd's configuration could not be read or changed.
    #[error("containerd config {path}: {why}")]
    Config { path: PathBuf, why: String },
    /// A drop-in source from runtime-class/containerd/ that does not have the shape expected.
    #[error("drop-in {name}: {why}")]
    DropIn { name: String, why: String },
    /// A site option (trust, restore sources, registry, handler options) that cannot be used.
    #[error("site option {what}: {why}")]
    Site { what: String, why: String },
    /// The install record is unreadable or of another version.
    #[error("install record {path}: {why}")]
    Record { path: PathBuf, why: String },
    /// The restart command failed.
    #[error("restarting containerd with `{command}` failed: {why}")]
    Restart { command: String, why: String },
    /// The API server was not reachable, refused the request, or is unknown.
    #[error("labelling node {node}: {why}")]
    Label { node: String, why: String },
    /// Steps of an uninstall failed; every other step was done. Each entry names the step and
    /// why it failed.
    #[error("uninstall: {} step(s) failed, every other step was done: {}; what is left stays in the install record, run uninstall again once the cause is fixed", .failed.len(), .failed.join("; "))]
    Uninstall { failed: Vec<String> },
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// A closure for `map_err` that wraps an I/O error with `what` done to `path`.
    pub fn io(what: &str, path: &Path) -> impl FnOnce(std::io::Error) -> Error {
        let context = format!("{what} {}", path.display());
        move |source| Error::Io { context, source }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
