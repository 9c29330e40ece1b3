//! What the installer did, in `<root>/var/lib/gpu-ckpt/installed.json` (root-only): every
//! file with its digest, the directories it made, containerd's configuration bytes before,
//! the imports entries it added, the labels it set. Written before each change (write-ahead),
//! so that a run that was cut short is finished or undone by the next one.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// The record's path on the node.
pub const RECORD_PATH: &str = "/var/lib/gpu-ckpt/installed.json";
/// The version of the record's layout.
pub const RECORD_VERSION: u32 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// An install has begun and not finished.
    Installing,
    /// Everything is in place.
    Installed,
    /// An uninstall has begun and not finished.
    Uninstalling,
}

/// One file or symlink the installer put on the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// The node's path (as on the host, without `--root`).
    pub path: PathBuf,
    /// sha256 of the content written (files).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// The link's target (symlinks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<PathBuf>,
    pub mode: u32,
}

/// containerd's configuration as the installer found and left it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigEntry {
    pub path: PathBuf,
    /// The bytes before the install; `None`: there was no file.
    pub before: Option<String>,
    /// The mode of the file before (kept for the restored file).
    #[serde(default)]
    pub before_mode: Option<u32>,
    /// sha256 of the bytes the installer wrote.
    pub after_sha256: String,
    /// The `imports` entries added.
    pub imports_added: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabelEntry {
    pub node: String,
    pub keys: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub version: u32,
    pub phase: Phase,
    pub files: Vec<FileEntry>,
    /// Directories the installer created (parents first), removed again when empty.
    pub dirs_created: Vec<PathBuf>,
    #[serde(default)]
    pub config: Option<ConfigEntry>,
    /// containerd has not been restarted since its configuration changed.
    #[serde(default)]
    pub restart_pending: bool,
    #[serde(default)]
    pub labels: Option<LabelEntry>,
    /// When the watch (`repair`) last restarted containerd (seconds since the epoch), for its
    /// least interval between restarts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_repair_restart: Option<u64>,
}

impl Record {
    pub fn new() -> Record {
        Record {
            version: RECORD_VERSION,
            phase: Phase::Installing,
            files: Vec::new(),
            dirs_created: Vec::new(),
            config: None,
            restart_pending: false,
            labels: None,
            last_repair_restart: None,
        }
    }

    pub fn file(&self, path: &Path) -> Option<&FileEntry> {
        self.files.iter().find(|f| f.path == path)
    }

    /// Adds or replaces the entry of `e.path`.
    pub fn set_file(&mut self, e: FileEntry) {
        match self.files.iter_mut().find(|f| f.path == e.path) {
            Some(f) => *f = e,
            None => self.files.push(e),
        }
    }

    /// Reads the record at `at` (the resolved path); `None` when there is none.
    pub fn load(at: &Path) -> Result<Option<Record>> {
        let bytes = match fs::read(at) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io("read install record", at)(e)),
        };
        let r: Record = serde_json::from_slice(&bytes).map_err(|e| Error::Record {
            path: at.to_path_buf(),
            why: format!("not a record of this installer: {e}"),
        })?;
        if r.version != RECORD_VERSION {
            return Err(Error::Record {
                path: at.to_path_buf(),
                why: format!(
                    "version {} (this installer writes {RECORD_VERSION})",
                    r.version
                ),
            });
        }
        Ok(Some(r))
    }

    /// Writes the record at `at` (temp file, fsync, rename), mode 0600.
    pub fn save(&self, at: &Path) -> Result<()> {
        let body = serde_json::to_vec_pretty(self).map_err(|e| Error::Record {
            path: at.to_path_buf(),
            why: format!("cannot serialise: {e}"),
        })?;
        write_atomic(at, &body, 0o600)
    }
}

impl Default for Record {
    fn default() -> Self {
        Record::new()
    }
}

/// sha256 of `bytes`, in hex.
pub fn sha256(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// sha256 of the file at `p`, or `None` when it does not exist.
pub fn sha256_file(p: &Path) -> Result<Option<String>> {
    let mut f = match fs::File::open(p) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("open", p)(e)),
    };
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).map_err(Error::io("read", p))?;
    Ok(Some(hex::encode(h.finalize())))
}

/// The temporary name a write to `p` goes through.
pub fn temp_path(p: &Path) -> PathBuf {
    let name = p
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    p.with_file_name(format!(".{name}.gpu-ckpt-new"))
}

/// Writes `bytes` to `p` through a temporary file in the same directory (fsync, rename,
/// directory fsync), with `mode`: a reader sees the old file or the new one, never half.
pub fn write_atomic(p: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    let tmp = temp_path(p);
    let _ = fs::remove_file(&tmp);
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(Error::io("create", &tmp))?;
    f.write_all(bytes).map_err(Error::io("write", &tmp))?;
    // The umask may have taken bits off.
    f.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(Error::io("chmod", &tmp))?;
    f.sync_all().map_err(Error::io("fsync", &tmp))?;
    drop(f);
    fs::rename(&tmp, p).map_err(Error::io("rename into place", p))?;
    sync_parent(p)
}

/// fsync of `p`'s directory, so that a rename or removal survives a crash.
pub fn sync_parent(p: &Path) -> Result<()> {
    if let Some(dir) = p.parent() {
        let d = fs::File::open(dir).map_err(Error::io("open directory", dir))?;
        d.sync_all().map_err(Error::io("fsync directory", dir))?;
    }
    Ok(())
}

/// Creates `dir` with `mode` (one level: its parent must exist).
pub fn make_dir(dir: &Path, mode: u32) -> Result<()> {
    fs::DirBuilder::new()
        .mode(mode)
        .create(dir)
        .map_err(Error::io("create directory", dir))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(mode)).map_err(Error::io("chmod", dir))
}
