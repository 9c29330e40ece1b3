//! The one error type of the library. Messages are lower-case and name the entry, file or field
//! they are about, so that an operator can act on them without reading the source.

use std::path::PathBuf;

/// Everything that can go wrong while reading, writing, verifying or converting a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O error, with what was being done and to which path.
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The tar stream itself could not be read (truncated, bad header checksum, ...).
    #[error("reading archive{}: {source}", entry_suffix(.entry))]
    Tar {
        entry: Option<String>,
        #[source]
        source: std::io::Error,
    },

    /// An entry name contains `..`, which could climb out of the target directory.
    #[error("entry {entry:?}: path traversal (\"..\") is not allowed")]
    PathTraversal { entry: String },

    /// An entry name is absolute.
    #[error("entry {entry:?}: absolute paths are not allowed")]
    AbsolutePath { entry: String },

    /// An entry name is empty, not UTF-8, or contains a NUL byte.
    #[error("entry {entry:?}: invalid name ({reason})")]
    InvalidName { entry: String, reason: &'static str },

    /// A symbolic link whose target leaves the archive's tree.
    #[error("entry {entry:?}: symlink to {target:?} leaves the archive")]
    SymlinkEscape { entry: String, target: String },

    /// A hard link whose target leaves the tree or names no earlier regular file.
    #[error("entry {entry:?}: hard link to {target:?} {reason}")]
    HardlinkEscape {
        entry: String,
        target: String,
        reason: &'static str,
    },

    /// An entry lies below a symlink of the same archive (writing it would follow the link).
    #[error("entry {entry:?}: lies below symlink {link:?}")]
    BelowSymlink { entry: String, link: String },

    /// Device nodes, fifos, sparse files and other special entries are refused.
    #[error("entry {entry:?}: {kind} entries are not allowed")]
    ForbiddenType { entry: String, kind: &'static str },

    /// The same path appears twice.
    #[error("entry {entry:?}: duplicate entry")]
    DuplicateEntry { entry: String },

    /// One entry declares more bytes than the per-entry limit.
    #[error("entry {entry:?}: declared size {size} bytes exceeds the limit of {limit} bytes")]
    EntryTooLarge {
        entry: String,
        size: u64,
        limit: u64,
    },

    /// The archive declares more bytes in total than the limit.
    #[error(
        "entry {entry:?}: total size would reach {total} bytes, over the limit of {limit} bytes"
    )]
    ArchiveTooLarge {
        entry: String,
        total: u64,
        limit: u64,
    },

    /// The archive holds more entries than the limit.
    #[error("entry {entry:?}: more than {limit} entries")]
    TooManyEntries { entry: String, limit: u64 },

    /// The content of a file does not match the size recorded in the manifest.
    #[error("file {name:?}: size mismatch: manifest says {expected} bytes, found {actual} bytes")]
    SizeMismatch {
        name: String,
        expected: u64,
        actual: u64,
    },

    /// The content of a file does not match the digest recorded for it (`algorithm`: "sha256"
    /// or "blake3").
    #[error("file {name:?}: {algorithm} mismatch: manifest says {expected}, found {actual}")]
    DigestMismatch {
        name: String,
        algorithm: &'static str,
        expected: String,
        actual: String,
    },

    /// A file listed in the manifest is missing.
    #[error("file {name:?}: listed in the manifest but missing")]
    MissingFile { name: String },

    /// A verification was stopped before it reached a verdict.
    #[error("file {name:?}: verification cancelled")]
    Cancelled { name: String },

    /// A file was written, truncated or replaced while it was hashed: what a later reader
    /// finds may not be what was verified.
    #[error("file {name:?}: changed while it was verified")]
    ChangedWhileVerified { name: String },

    /// A file is present but not listed in the manifest.
    #[error("file {name:?}: present but not listed in the manifest")]
    UnlistedFile { name: String },

    /// More than one file differs from the manifest: each difference, in the order found.
    #[error("{} files differ from the manifest: {}", .0.len(), joined(.0))]
    FilesDiffer(Vec<Error>),

    /// A member read a second time is not what the first read found (the archive was changed
    /// in between).
    #[error("entry {entry:?}: changed since it was checked ({reason})")]
    ChangedSinceChecked { entry: String, reason: String },

    /// A required archive member is missing.
    #[error("archive has no {name:?}")]
    MissingEntry { name: String },

    /// The manifest names a schema version this build does not understand.
    #[error("manifest {path}: unsupported schema_version {found} (this build reads major versions {oldest} to {newest})")]
    UnsupportedSchema {
        path: String,
        found: String,
        oldest: u32,
        newest: u32,
    },

    /// The manifest is not one of ours (wrong or missing `kind`).
    #[error("manifest {path}: field \"kind\" is {found:?}, expected {expected:?}")]
    WrongKind {
        path: String,
        found: String,
        expected: &'static str,
    },

    /// JSON that could not be parsed (manifest, config.dump, OCI index, ...).
    #[error("{what}: invalid json: {source}")]
    Json {
        what: String,
        #[source]
        source: serde_json::Error,
    },

    /// A field holds a value we cannot use.
    #[error("{what}: field {field:?}: {reason}")]
    InvalidField {
        what: String,
        field: String,
        reason: String,
    },

    /// A manifest's name for a file that is not a plain flat file name.
    #[error("manifest file name {name:?}: {reason}")]
    BadFileName { name: String, reason: &'static str },

    /// Something in a checkpoint directory that the flat layout does not allow.
    #[error("checkpoint directory entry {name:?}: {reason}")]
    NotFlat { name: String, reason: &'static str },

    /// An OCI image that does not have the shape we need.
    #[error("oci image {what}: {reason}")]
    Oci { what: String, reason: String },

    /// A registry request failed.
    #[error("registry {url}: {reason}")]
    Registry { url: String, reason: String },

    /// The target directory of an extraction already holds the named entry.
    #[error("entry {entry:?}: already exists in the target directory")]
    Exists { entry: String },

    /// A manifest signature that is missing, malformed, or does not match.
    #[error("signature: {reason}")]
    Signature { reason: String },

    /// A key file (the node's private or public key, a trusted public key, the revoked-keys
    /// list) that cannot be read, made or parsed, or is open to others than its owner.
    #[error("key file {path}: {reason}")]
    Key { path: PathBuf, reason: String },
}

fn joined(errors: &[Error]) -> String {
    errors
        .iter()
        .map(Error::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// The differences a verification finds: the first only (`every` false: it stops there), or
/// every one, given back as one error ([`Error::FilesDiffer`] when there are several).
pub(crate) struct Findings {
    every: bool,
    errors: Vec<Error>,
}

impl Findings {
    pub(crate) fn new(every: bool) -> Findings {
        Findings {
            every,
            errors: Vec::new(),
        }
    }

    /// Notes a difference: `Err` at once when only the first is wanted.
    pub(crate) fn add(&mut self, e: Error) -> Result<()> {
        if self.every {
            self.errors.push(e);
            Ok(())
        } else {
            Err(e)
        }
    }

    pub(crate) fn finish(mut self) -> Result<()> {
        match self.errors.len() {
            0 => Ok(()),
            1 => Err(self.errors.remove(0)),
            _ => Err(Error::FilesDiffer(self.errors)),
        }
    }
}

fn entry_suffix(e: &Option<String>) -> String {
    match e {
        Some(e) => format!(" at entry {e:?}"),
        None => String::new(),
    }
}

impl Error {
    /// An I/O error: what was being done, to which path.
    pub fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            what,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn json(what: impl Into<String>, source: serde_json::Error) -> Self {
        Error::Json {
            what: what.into(),
            source,
        }
    }

    pub(crate) fn oci(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Oci {
            what: what.into(),
            reason: reason.into(),
        }
    }
}

/// The library's result type.
pub type Result<T> = std::result::Result<T, Error>;
