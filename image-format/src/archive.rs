//! The checkpoint archive as containerd 2.1+ writes it for kubelet (and CRI-O's variant, for reading):
//! an uncompressed tar holding `checkpoint/` (CRIU images plus our manifest), `config.dump`,
//! `spec.dump`, `status.dump`, `status`, `container.log`, `dump.log`, `stats-dump` and
//! `rootfs-diff.tar`. Entry names are the ones checkpointctl uses.
//!
//! Reading is always checked (see [`crate::safe`]): hostile names, links, special files, duplicates and
//! size bombs are refused with an error naming the entry.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Read, Seek, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::digest::{no_progress, FileHasher, Progress, COPY_BUF};
use crate::error::{Error, Findings, Result};
use crate::manifest::{FileDigest, Manifest, MANIFEST_FILE};
use crate::safe::{for_each_checked, EntryInfo, EntryKind, Limits, SafeRoot};

/// checkpointctl's names for archive members.
pub mod names {
    pub const CHECKPOINT_DIRECTORY: &str = "checkpoint";
    pub const CONFIG_DUMP: &str = "config.dump";
    pub const SPEC_DUMP: &str = "spec.dump";
    pub const STATUS_DUMP: &str = "status.dump";
    pub const STATUS: &str = "status";
    pub const CONTAINER_LOG: &str = "container.log";
    pub const DUMP_LOG: &str = "dump.log";
    pub const RESTORE_LOG: &str = "restore.log";
    pub const STATS_DUMP: &str = "stats-dump";
    pub const STATS_RESTORE: &str = "stats-restore";
    pub const ROOTFS_DIFF_TAR: &str = "rootfs-diff.tar";
    pub const NETWORK_STATUS: &str = "network.status";
    pub const DELETED_FILES: &str = "deleted.files";
    pub const BIND_MOUNTS: &str = "bind.mounts";
    pub const DEVSHM_CHECKPOINT: &str = "devshm-checkpoint.tar";
    pub const VOLUMES: &str = "volumes";
    pub const POD_OPTIONS: &str = "pod.options";
    pub const POD_DUMP: &str = "pod.dump";
    /// CRIU memory pages files start with this, inside `checkpoint/`.
    pub const PAGES_PREFIX: &str = "pages-";
    pub const AMDGPU_PAGES_PREFIX: &str = "amdgpu-pages-";
    /// Where the gpu-ckpt manifest lives in the archive.
    pub const MANIFEST_PATH: &str = "checkpoint/gpu-ckpt-manifest.json";
    /// CRIU's statistics as the shim keeps them, beside its images.
    pub const CHECKPOINT_STATS_DUMP: &str = "checkpoint/stats-dump";
}

/// Small JSON members are read into memory up to this size; bigger ones are an error.
pub const MAX_METADATA_BYTES: u64 = 16 << 20;

/// `config.dump` as containerd's CRI writes it (CRI-O and Podman write a superset; unknown fields are
/// kept in `extra`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ConfigDump {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub name: String,
    #[serde(
        rename = "rootfsImage",
        default,
        skip_serializing_if = "String::is_empty"
    )]
    pub rootfs_image: String,
    #[serde(
        rename = "rootfsImageRef",
        default,
        skip_serializing_if = "String::is_empty"
    )]
    pub rootfs_image_ref: String,
    #[serde(
        rename = "rootfsImageName",
        default,
        skip_serializing_if = "String::is_empty"
    )]
    pub rootfs_image_name: String,
    #[serde(rename = "runtime", default, skip_serializing_if = "String::is_empty")]
    pub runtime: String,
    /// RFC 3339.
    #[serde(rename = "createdTime", default)]
    pub created_time: String,
    /// RFC 3339.
    #[serde(
        rename = "checkpointedTime",
        default,
        skip_serializing_if = "String::is_empty"
    )]
    pub checkpointed_time: String,
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// Which engine wrote the archive, by checkpointctl's rule on `spec.dump`'s `io.container.manager`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    Containerd,
    #[serde(rename = "cri-o")]
    CriO,
    Podman,
}

impl std::fmt::Display for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Engine::Containerd => "containerd",
            Engine::CriO => "CRI-O",
            Engine::Podman => "Podman",
        })
    }
}

/// Sizes as checkpointctl reports them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Sizes {
    /// All regular files under `checkpoint/`.
    pub checkpoint_size: u64,
    pub memory_pages_size: u64,
    pub amd_gpu_memory_pages_size: u64,
    pub root_fs_diff_size: u64,
    /// Every regular file of the archive.
    pub total_size: u64,
}

/// Everything `inspect` needs, read in one pass over the headers (data skipped by seeking).
#[derive(Debug, Clone, Default)]
pub struct ArchiveInfo {
    pub entries: Vec<EntryInfo>,
    pub config_dump: Option<ConfigDump>,
    pub spec_dump: Option<serde_json::Value>,
    pub status_dump: Option<serde_json::Value>,
    pub manifest: Option<Manifest>,
    /// The manifest's bytes as found, for its signature ([`crate::sign::verify_json`]).
    pub manifest_json: Option<Vec<u8>>,
    pub sizes: Sizes,
    /// CRIU's dump statistics, from `stats-dump` (containerd's runc path) or
    /// `checkpoint/stats-dump` (what gpu-ckpt's shim keeps).
    pub statistics: Option<crate::criu_stats::DumpStats>,
}

impl ArchiveInfo {
    /// Whether `path` (an archive member's name) is metadata that [`ArchiveInfo::take_member`]
    /// reads.
    pub fn is_metadata(path: &str) -> bool {
        matches!(
            path,
            names::CONFIG_DUMP
                | names::SPEC_DUMP
                | names::STATUS_DUMP
                | names::MANIFEST_PATH
                | names::STATS_DUMP
                | names::CHECKPOINT_STATS_DUMP
        )
    }

    /// Takes the metadata member `path` into its field: the engine's dumps, the manifest (with
    /// its bytes, for the signature) and CRIU's statistics. `data` is the member's content,
    /// read only for a member [`ArchiveInfo::is_metadata`] names. Every reader of a checkpoint's
    /// listing (an archive, a checkpoint directory, an image volume) takes its members here.
    pub fn take_member(
        &mut self,
        path: &str,
        data: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<()> {
        if !Self::is_metadata(path) {
            return Ok(());
        }
        let d = data()?;
        match path {
            names::CONFIG_DUMP => {
                self.config_dump =
                    Some(serde_json::from_slice(&d).map_err(|x| Error::json(path, x))?);
            }
            names::SPEC_DUMP => {
                self.spec_dump =
                    Some(serde_json::from_slice(&d).map_err(|x| Error::json(path, x))?);
            }
            names::STATUS_DUMP => {
                self.status_dump =
                    Some(serde_json::from_slice(&d).map_err(|x| Error::json(path, x))?);
            }
            names::MANIFEST_PATH => {
                self.manifest = Some(Manifest::from_json(&d, path)?);
                self.manifest_json = Some(d);
            }
            _ => {
                // Informational: statistics CRIU did not write are left out, not an error.
                // The top-level file is what checkpointctl reads: it wins.
                if let Ok(s) = crate::criu_stats::parse_dump_stats(&d, path) {
                    if path == names::STATS_DUMP || self.statistics.is_none() {
                        self.statistics = Some(s);
                    }
                }
            }
        }
        Ok(())
    }

    /// The `spec.dump` annotations.
    pub fn annotations(&self) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        if let Some(a) = self
            .spec_dump
            .as_ref()
            .and_then(|s| s.get("annotations"))
            .and_then(|a| a.as_object())
        {
            for (k, v) in a {
                if let Some(v) = v.as_str() {
                    out.insert(k.clone(), v.to_string());
                }
            }
        }
        out
    }

    pub fn engine(&self) -> Engine {
        match self
            .annotations()
            .get("io.container.manager")
            .map(String::as_str)
        {
            Some("libpod") => Engine::Podman,
            Some("cri-o") => Engine::CriO,
            _ => Engine::Containerd,
        }
    }

    /// Container name, pod name, pod namespace, as the engine recorded them.
    pub fn identity(&self) -> (String, String, String) {
        let a = self.annotations();
        let get = |k: &str| a.get(k).cloned().unwrap_or_default();
        match self.engine() {
            Engine::Containerd => (
                get(crate::cri::CONTAINER_NAME),
                get(crate::cri::SANDBOX_NAME),
                get(crate::cri::SANDBOX_NAMESPACE),
            ),
            Engine::CriO => {
                let name = a
                    .get("io.kubernetes.cri-o.Metadata")
                    .and_then(|m| serde_json::from_str::<serde_json::Value>(m).ok())
                    .and_then(|m| m.get("name").and_then(|n| n.as_str()).map(str::to_string))
                    .unwrap_or_else(|| get("io.kubernetes.container.name"));
                (
                    name,
                    get("io.kubernetes.pod.name"),
                    get("io.kubernetes.pod.namespace"),
                )
            }
            Engine::Podman => (
                self.config_dump
                    .as_ref()
                    .map(|c| c.name.clone())
                    .unwrap_or_default(),
                String::new(),
                String::new(),
            ),
        }
    }

    /// The best name for the container: engine's name, else config.dump's, else the manifest's.
    pub fn container_name(&self) -> String {
        let (n, _, _) = self.identity();
        if !n.is_empty() {
            return n;
        }
        if let Some(c) = &self.config_dump {
            if !c.name.is_empty() {
                return c.name.clone();
            }
        }
        self.manifest
            .as_ref()
            .map(|m| m.container.name.clone())
            .unwrap_or_default()
    }
}

fn tar_err(entry: Option<&str>, source: io::Error) -> Error {
    Error::Tar {
        entry: entry.map(str::to_string),
        source,
    }
}

fn read_small<R: Read>(r: &mut R, entry: &str, size: u64) -> Result<Vec<u8>> {
    if size > MAX_METADATA_BYTES {
        return Err(Error::EntryTooLarge {
            entry: entry.to_string(),
            size,
            limit: MAX_METADATA_BYTES,
        });
    }
    let mut v = Vec::with_capacity(size as usize);
    r.take(MAX_METADATA_BYTES)
        .read_to_end(&mut v)
        .map_err(|e| tar_err(Some(entry), e))?;
    Ok(v)
}

fn add_sizes(sizes: &mut Sizes, info: &EntryInfo) {
    if info.kind != EntryKind::File {
        return;
    }
    sizes.total_size += info.size;
    if let Some(rest) = info.path.strip_prefix("checkpoint/") {
        sizes.checkpoint_size += info.size;
        if rest.starts_with(names::PAGES_PREFIX) {
            sizes.memory_pages_size += info.size;
        } else if rest.starts_with(names::AMDGPU_PAGES_PREFIX) {
            sizes.amd_gpu_memory_pages_size += info.size;
        }
    } else if info.path == names::ROOTFS_DIFF_TAR {
        sizes.root_fs_diff_size = info.size;
    }
}

/// Read the metadata of an archive file: every header is checked, data of big members is skipped by
/// seeking, the small JSON members are parsed.
pub fn read_info(path: &Path, limits: Limits) -> Result<ArchiveInfo> {
    let f = File::open(path).map_err(|e| Error::io("opening", path, e))?;
    read_info_from(io::BufReader::with_capacity(64 << 10, f), limits)
}

/// [`read_info`] over any seekable reader.
///
/// Data skipped by seeking is not read, so an archive cut short inside a member's data is found
/// by its length: the stream must reach the end of every member's data.
pub fn read_info_from<R: Read + Seek>(r: R, limits: Limits) -> Result<ArchiveInfo> {
    let mut ar = tar::Archive::new(r);
    let mut info = ArchiveInfo::default();
    // The member whose data ends last, and where.
    let mut data_end: Option<(String, u64)> = None;
    let entries = ar.entries_with_seek().map_err(|e| tar_err(None, e))?;
    for_each_checked(entries, limits, |ent, e| {
        add_sizes(&mut info.sizes, &e);
        let end = ent.raw_file_position() + ent.size();
        if data_end.as_ref().is_none_or(|(_, at)| end > *at) {
            data_end = Some((e.path.clone(), end));
        }
        if e.kind == EntryKind::File {
            info.take_member(&e.path, || read_small(ent, &e.path, e.size))?;
        }
        info.entries.push(e);
        Ok(())
    })?;
    if let Some((entry, end)) = data_end {
        let len = ar
            .into_inner()
            .seek(io::SeekFrom::End(0))
            .map_err(|e| tar_err(None, e))?;
        if len < end {
            return Err(tar_err(
                Some(&entry),
                io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "the archive ends at byte {len}, inside this member's data, which ends at byte {end}: it is truncated"
                    ),
                ),
            ));
        }
    }
    Ok(info)
}

/// [`read_info`] for a checkpoint directory (`ctr task checkpoint --image-path`, the runc
/// option `CriuImagePath`): its files as the archive's `checkpoint/` members, its manifest and
/// CRIU's `stats-dump`. Such a directory holds no container metadata (`config.dump`,
/// `spec.dump`), so those stay empty. Symlinks are listed, never followed.
pub fn read_info_dir(dir: &Path) -> Result<ArchiveInfo> {
    read_dir_members(dir, names::CHECKPOINT_DIRECTORY, None)
}

/// [`read_info`] for a whole archive laid out as a directory tree (an image volume: the
/// checkpoint image's layer, unpacked by containerd), checked like an archive's entries: only
/// directories and regular files (no links, devices, fifos or sockets, nothing followed),
/// within `limits`, `checkpoint/` flat, and the small JSON members read with the archive
/// reader's size bound.
pub fn read_info_tree(root: &Path, limits: Limits) -> Result<ArchiveInfo> {
    read_dir_members(root, "", Some(limits))
}

/// The one reader of a directory as archive members: `root`'s entries named under `prefix`.
/// With `strict` limits, the tree is walked and anything but directories and regular files is
/// refused ([`read_info_tree`]); without, only `root` itself is listed, links and
/// subdirectories as such, other special files left out ([`read_info_dir`]).
fn read_dir_members(root: &Path, prefix: &str, strict: Option<Limits>) -> Result<ArchiveInfo> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let listing = if strict.is_some() {
        "reading"
    } else {
        "listing"
    };
    let mut info = ArchiveInfo::default();
    let (mut count, mut total) = (0u64, 0u64);
    let mut stack = vec![(root.to_path_buf(), prefix.to_string())];
    while let Some((dir, rel)) = stack.pop() {
        let mut ents = Vec::new();
        for ent in fs::read_dir(&dir).map_err(|e| Error::io(listing, &dir, e))? {
            ents.push(ent.map_err(|e| Error::io(listing, &dir, e))?);
        }
        ents.sort_by_key(|e| e.file_name());
        for ent in ents {
            let name = ent.file_name().to_string_lossy().into_owned();
            let path = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            let file = ent.path();
            if let Some(limits) = strict {
                count += 1;
                if count > limits.max_entries {
                    return Err(Error::TooManyEntries {
                        entry: path,
                        limit: limits.max_entries,
                    });
                }
            }
            // DirEntry::metadata is an lstat: a link is seen as a link, never followed.
            let meta = ent.metadata().map_err(|e| Error::io("reading", &file, e))?;
            let ft = meta.file_type();
            let kind = match strict {
                _ if ft.is_file() => EntryKind::File,
                Some(_) if ft.is_dir() && rel == names::CHECKPOINT_DIRECTORY => {
                    return Err(Error::ForbiddenType {
                        entry: path,
                        kind: "subdirectory (checkpoint/ holds only CRIU images)",
                    });
                }
                Some(_) if ft.is_dir() => {
                    stack.push((file, path));
                    continue;
                }
                Some(_) => {
                    let kind = if ft.is_symlink() {
                        "symbolic link"
                    } else if ft.is_block_device() || ft.is_char_device() {
                        "device node"
                    } else if ft.is_fifo() {
                        "fifo"
                    } else {
                        "socket"
                    };
                    return Err(Error::ForbiddenType { entry: path, kind });
                }
                None if ft.is_dir() => EntryKind::Dir,
                None if ft.is_symlink() => {
                    let target =
                        fs::read_link(&file).map_err(|e| Error::io("reading", &file, e))?;
                    EntryKind::Symlink(target.to_string_lossy().into_owned())
                }
                None => continue,
            };
            let size = if kind == EntryKind::File {
                meta.len()
            } else {
                0
            };
            if let Some(limits) = strict {
                if size > limits.max_entry_bytes {
                    return Err(Error::EntryTooLarge {
                        entry: path,
                        size,
                        limit: limits.max_entry_bytes,
                    });
                }
                total += size;
                if total > limits.max_total_bytes {
                    return Err(Error::ArchiveTooLarge {
                        entry: path,
                        total,
                        limit: limits.max_total_bytes,
                    });
                }
            }
            let e = EntryInfo {
                path,
                size,
                kind,
                mode: meta.permissions().mode() & 0o7777,
            };
            add_sizes(&mut info.sizes, &e);
            if e.kind == EntryKind::File {
                info.take_member(&e.path, || read_small_file(&file, &e.path, e.size))?;
            }
            info.entries.push(e);
        }
    }
    Ok(info)
}

/// A small member of a directory (see [`read_small`]), opened without following a link.
fn read_small_file(file: &Path, entry: &str, size: u64) -> Result<Vec<u8>> {
    use std::os::unix::fs::OpenOptionsExt;
    if size > MAX_METADATA_BYTES {
        return Err(Error::EntryTooLarge {
            entry: entry.to_string(),
            size,
            limit: MAX_METADATA_BYTES,
        });
    }
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(file)
        .map_err(|e| Error::io("opening", file, e))?;
    let mut v = Vec::with_capacity(size as usize);
    f.take(MAX_METADATA_BYTES)
        .read_to_end(&mut v)
        .map_err(|e| Error::io("reading", file, e))?;
    Ok(v)
}

/// What a full streaming verification found.
#[derive(Debug, Clone)]
pub struct VerifyReport {
    pub manifest: Manifest,
    /// Files under `checkpoint/` checked against the manifest.
    pub files_verified: usize,
    /// Bytes hashed.
    pub bytes: u64,
    /// Archive members outside `checkpoint/` that the manifest does not cover (written by the
    /// container engine after the shim): name -> size and sha256 as found (no BLAKE3).
    pub uncovered: BTreeMap<String, FileDigest>,
}

/// Verify an archive in one streaming pass: check every header, hash every file, and compare the files
/// of `checkpoint/` with the manifest found there (missing, unlisted, size and digest mismatches are
/// errors naming the file).
pub fn verify_archive(path: &Path, limits: Limits, progress: Progress<'_>) -> Result<VerifyReport> {
    let f = File::open(path).map_err(|e| Error::io("opening", path, e))?;
    let total = f.metadata().map(|m| m.len()).unwrap_or(0);
    verify_stream(f, total, limits, progress)
}

/// [`verify_archive`], naming every file of `checkpoint/` that differs from the manifest, not
/// only the first ([`Error::FilesDiffer`] when several do).
pub fn verify_archive_every(
    path: &Path,
    limits: Limits,
    progress: Progress<'_>,
) -> Result<VerifyReport> {
    let f = File::open(path).map_err(|e| Error::io("opening", path, e))?;
    let total = f.metadata().map(|m| m.len()).unwrap_or(0);
    let r = hash_stream(f, total, limits, progress)?;
    compare_every_file(&r.manifest, &r.found)?;
    Ok(r.report())
}

/// [`verify_archive`] over any reader (`total` only feeds progress).
pub fn verify_stream<R: Read>(
    r: R,
    total: u64,
    limits: Limits,
    progress: Progress<'_>,
) -> Result<VerifyReport> {
    let r = hash_stream(r, total, limits, progress)?;
    compare_files(&r.manifest, &r.found)?;
    Ok(r.report())
}

/// What one pass over an archive found: its manifest, and the digests of `checkpoint/`'s files
/// and of the other members.
struct Hashed {
    manifest: Manifest,
    found: BTreeMap<String, FileDigest>,
    /// Verified copies of `checkpoint/` files elsewhere (the top-level `stats-dump`).
    copies: usize,
    uncovered: BTreeMap<String, FileDigest>,
    bytes: u64,
}

impl Hashed {
    fn report(self) -> VerifyReport {
        VerifyReport {
            files_verified: self.found.len() + self.copies,
            manifest: self.manifest,
            bytes: self.bytes,
            uncovered: self.uncovered,
        }
    }
}

fn hash_stream<R: Read>(
    r: R,
    total: u64,
    limits: Limits,
    progress: Progress<'_>,
) -> Result<Hashed> {
    let mut ar = tar::Archive::new(r);
    let mut found: BTreeMap<String, FileDigest> = BTreeMap::new();
    let mut uncovered = BTreeMap::new();
    let mut stats_copy = None;
    let mut manifest = None;
    let mut buf = vec![0u8; COPY_BUF];
    let mut bytes = 0u64;
    let entries = ar.entries().map_err(|e| tar_err(None, e))?;
    for_each_checked(entries, limits, |ent, e| {
        if e.kind != EntryKind::File {
            return Ok(());
        }
        if e.path == names::MANIFEST_PATH {
            let d = read_small(ent, &e.path, e.size)?;
            manifest = Some(Manifest::from_json(&d, &e.path)?);
            return Ok(());
        }
        let mut hasher = hasher_for(manifest.as_ref(), &e.path);
        loop {
            let k = ent.read(&mut buf).map_err(|x| tar_err(Some(&e.path), x))?;
            if k == 0 {
                break;
            }
            hasher.update(&buf[..k]);
            bytes += k as u64;
            progress(ent.raw_file_position() + hasher.size(), total);
        }
        let d = hasher.finish();
        match e.path.strip_prefix("checkpoint/") {
            Some(name) if !name.contains('/') => {
                found.insert(name.to_string(), d);
            }
            _ if e.path == names::STATS_DUMP => stats_copy = Some(d),
            _ => {
                uncovered.insert(e.path.clone(), d);
            }
        }
        Ok(())
    })?;
    progress(total, total);
    let manifest = manifest.ok_or_else(|| Error::MissingEntry {
        name: names::MANIFEST_PATH.into(),
    })?;
    // The top-level copy of checkpoint/stats-dump is checked here, against the manifest's entry.
    let copies = check_stats_copy(&manifest, stats_copy, &mut uncovered)?;
    Ok(Hashed {
        copies,
        manifest,
        found,
        uncovered,
        bytes,
    })
}

/// How to hash archive member `path` as it streams by: a file of `checkpoint/` against its
/// manifest entry when the manifest came first (gpu-ckpt's archives and containerd's list it
/// before the page images), else with both digests, since the entry may list either; a member
/// the manifest does not cover with sha256, for the report.
fn hasher_for(manifest: Option<&Manifest>, path: &str) -> FileHasher {
    let listed = match path.strip_prefix("checkpoint/") {
        Some(name) if !name.contains('/') => name,
        _ if path == names::STATS_DUMP => names::STATS_DUMP,
        _ => return FileHasher::sha256(),
    };
    manifest
        .and_then(|m| m.files.get(listed))
        .map_or_else(FileHasher::every, FileHasher::checking)
}

/// The archive's top-level `stats-dump` (where containerd's CRI puts CRIU's statistics and
/// checkpointctl reads them) is a copy of `checkpoint/stats-dump`: where the manifest lists
/// that file, the copy is checked against its entry and counts as verified; otherwise it is
/// reported as uncovered.
fn check_stats_copy(
    m: &Manifest,
    copy: Option<FileDigest>,
    uncovered: &mut BTreeMap<String, FileDigest>,
) -> Result<usize> {
    let Some(got) = copy else { return Ok(0) };
    match m.files.get(names::STATS_DUMP) {
        Some(want) => {
            crate::manifest::check_digest(STATS_COPY, want, &got)?;
            Ok(1)
        }
        None => {
            uncovered.insert(names::STATS_DUMP.to_string(), got);
            Ok(0)
        }
    }
}

/// How errors name the top-level `stats-dump` (the manifest's names are those of `checkpoint/`).
const STATS_COPY: &str = "stats-dump (the archive's top-level copy of checkpoint/stats-dump)";

/// Compare what was found under `checkpoint/` with the manifest; first mismatch in name order.
pub fn compare_files(m: &Manifest, found: &BTreeMap<String, FileDigest>) -> Result<()> {
    let mut f = Findings::new(false);
    compare_into(m, found, &mut f)?;
    f.finish()
}

/// [`compare_files`], naming every file that differs ([`Error::FilesDiffer`] when several do).
pub fn compare_every_file(m: &Manifest, found: &BTreeMap<String, FileDigest>) -> Result<()> {
    let mut f = Findings::new(true);
    compare_into(m, found, &mut f)?;
    f.finish()
}

fn compare_into(
    m: &Manifest,
    found: &BTreeMap<String, FileDigest>,
    f: &mut Findings,
) -> Result<()> {
    for (name, want) in &m.files {
        match found.get(name) {
            None => f.add(Error::MissingFile { name: name.clone() })?,
            Some(got) => {
                if let Err(e) = crate::manifest::check_digest(name, want, got) {
                    f.add(e)?;
                }
            }
        }
    }
    for name in found.keys() {
        if !m.files.contains_key(name) {
            f.add(Error::UnlistedFile { name: name.clone() })?;
        }
    }
    Ok(())
}

/// Options for [`extract_archive`].
#[derive(Debug, Clone, Copy, Default)]
pub struct ExtractOptions {
    pub limits: Limits,
    /// Verify `checkpoint/` against the manifest while writing (and remove what was written on a
    /// mismatch). An archive without a manifest is then an error.
    pub verify: bool,
}

/// Extract an archive file into `target` (created with mode 0700 if absent). All headers are checked
/// in a first pass before anything is written; files are created 0600 and directories 0700 below an
/// open handle of `target`, never through a symlink. `checkpoint/` holds regular files only: a
/// link, a directory or anything nested there is refused. On any error, what was written is
/// removed.
pub fn extract_archive(
    src: &Path,
    target: &Path,
    opts: ExtractOptions,
    progress: Progress<'_>,
) -> Result<Vec<EntryInfo>> {
    // Pass 1: headers only.
    let info = read_info(src, opts.limits)?;
    for e in &info.entries {
        Select::All.take(e)?;
    }
    let f = File::open(src).map_err(|e| Error::io("opening", src, e))?;
    let total = f.metadata().map(|m| m.len()).unwrap_or(0);
    extract_stream(f, target, opts, total, progress)
}

/// Extract from a stream in a single pass (each header is checked before its entry is written).
pub fn extract_stream<R: Read>(
    r: R,
    target: &Path,
    opts: ExtractOptions,
    total: u64,
    progress: Progress<'_>,
) -> Result<Vec<EntryInfo>> {
    extract_selected(r, target, opts, Select::All, total, progress)
}

/// What [`extract_listed`] writes: the members of `checkpoint/` that the admitted manifest
/// lists, each exactly its listed size, the manifest itself (which must be the bytes that were
/// admitted), and the members outside `checkpoint/` named in `also`. Nothing else is written:
/// the engine's metadata members are read into memory by [`read_info`], every other member is
/// skipped.
#[derive(Debug, Clone, Copy)]
pub struct Listed<'a> {
    /// The manifest's bytes as they were admitted (its signature checked on them).
    pub manifest_json: &'a [u8],
    /// The manifest parsed from those bytes.
    pub manifest: &'a Manifest,
    /// Members outside `checkpoint/` to write too (flat names), within the limits only.
    pub also: &'a [&'a str],
}

impl Listed<'_> {
    /// Whether the member `e` of `checkpoint/` (`name` in it, already known to be a regular
    /// file) may be written: listed, and of its listed size.
    fn check(&self, e: &EntryInfo, name: &str) -> Result<()> {
        if e.path == names::MANIFEST_PATH {
            let admitted = self.manifest_json.len() as u64;
            if e.size != admitted {
                return Err(Error::ChangedSinceChecked {
                    entry: e.path.clone(),
                    reason: format!("{} bytes now, {admitted} when it was checked", e.size),
                });
            }
            return Ok(());
        }
        let Some(want) = self.manifest.files.get(name) else {
            return Err(Error::UnlistedFile {
                name: name.to_string(),
            });
        };
        if e.size != want.size {
            return Err(Error::SizeMismatch {
                name: name.to_string(),
                expected: want.size,
                actual: e.size,
            });
        }
        Ok(())
    }
}

/// Which members an extraction writes.
#[derive(Clone, Copy)]
enum Select<'a> {
    /// Every member ([`extract_archive`]).
    All,
    /// Only what the admitted manifest lists ([`extract_listed`]).
    Listed(&'a Listed<'a>),
}

impl Select<'_> {
    /// Whether the member `e` is written; an error refuses the whole archive.
    fn take(&self, e: &EntryInfo) -> Result<bool> {
        let in_checkpoint = e.path.strip_prefix("checkpoint/");
        if let Some(name) = in_checkpoint {
            let kind = match &e.kind {
                _ if name.contains('/') => Some("nested checkpoint/"),
                EntryKind::File => None,
                EntryKind::Dir => Some("checkpoint/ directory"),
                EntryKind::Symlink(_) => Some("checkpoint/ symbolic link"),
                EntryKind::Hardlink(_) => Some("checkpoint/ hard link"),
            };
            if let Some(kind) = kind {
                return Err(Error::ForbiddenType {
                    entry: e.path.clone(),
                    kind,
                });
            }
        }
        let Select::Listed(listed) = self else {
            return Ok(true);
        };
        Ok(match in_checkpoint {
            Some(name) => {
                listed.check(e, name)?;
                true
            }
            // The directory itself, never a link or a file of that name.
            None if e.path == names::CHECKPOINT_DIRECTORY => e.kind == EntryKind::Dir,
            None => e.kind == EntryKind::File && listed.also.contains(&e.path.as_str()),
        })
    }
}

/// Extract from the archive `src` into `target` (created with mode 0700 if absent) only what
/// [`Listed`] allows, every file verified against the manifest while it is written. The headers
/// are read first (`src` is read from its start twice, through the one open file): an unlisted
/// member of `checkpoint/`, one of another size than listed, a link or a directory there are
/// refused before anything is written. On any error, what was written is removed.
pub fn extract_listed(
    src: &File,
    target: &Path,
    limits: Limits,
    listed: &Listed<'_>,
    progress: Progress<'_>,
) -> Result<Vec<EntryInfo>> {
    let rewind = |mut f: &File| {
        f.seek(io::SeekFrom::Start(0))
            .map_err(|e| tar_err(None, e))
            .map(drop)
    };
    rewind(src)?;
    let info = read_info_from(io::BufReader::with_capacity(64 << 10, src), limits)?;
    let select = Select::Listed(listed);
    for e in &info.entries {
        select.take(e)?;
    }
    rewind(src)?;
    let total = src.metadata().map(|m| m.len()).unwrap_or(0);
    let opts = ExtractOptions {
        limits,
        verify: true,
    };
    extract_selected(src, target, opts, select, total, progress)
}

fn extract_selected<R: Read>(
    r: R,
    target: &Path,
    opts: ExtractOptions,
    select: Select<'_>,
    total: u64,
    progress: Progress<'_>,
) -> Result<Vec<EntryInfo>> {
    let root = SafeRoot::open(target)?;
    let mut created: Vec<String> = Vec::new();
    let res = extract_inner(
        r,
        &root,
        target,
        opts,
        select,
        total,
        progress,
        &mut created,
    );
    if res.is_err() {
        cleanup(target, &created);
    }
    res
}

fn cleanup(target: &Path, created: &[String]) {
    for rel in created.iter().rev() {
        let p = target.join(rel);
        match fs::symlink_metadata(&p) {
            Ok(m) if m.is_dir() => {
                let _ = fs::remove_dir(&p);
            }
            Ok(_) => {
                let _ = fs::remove_file(&p);
            }
            Err(_) => {}
        }
    }
}

fn note_dirs(created: &mut Vec<String>, made: &mut std::collections::HashSet<String>, path: &str) {
    let mut acc = String::new();
    let comps: Vec<&str> = path.split('/').collect();
    for c in &comps[..comps.len().saturating_sub(1)] {
        if !acc.is_empty() {
            acc.push('/');
        }
        acc.push_str(c);
        if made.insert(acc.clone()) {
            created.push(acc.clone());
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn extract_inner<R: Read>(
    r: R,
    root: &SafeRoot,
    target: &Path,
    opts: ExtractOptions,
    select: Select<'_>,
    total: u64,
    progress: Progress<'_>,
    created: &mut Vec<String>,
) -> Result<Vec<EntryInfo>> {
    let mut ar = tar::Archive::new(r);
    let mut out = Vec::new();
    let mut symlinks = Vec::new();
    let mut found: BTreeMap<String, FileDigest> = BTreeMap::new();
    let mut stats_copy = None;
    // Listed: the admitted manifest decides from the first member on.
    let mut manifest = match select {
        Select::Listed(l) => Some(l.manifest.clone()),
        Select::All => None,
    };
    let mut made = std::collections::HashSet::new();
    let mut buf = vec![0u8; COPY_BUF];
    let entries = ar.entries().map_err(|e| tar_err(None, e))?;
    for_each_checked(entries, opts.limits, |ent, e| {
        if !select.take(&e)? {
            return Ok(());
        }
        let wrap = |x: io::Error| Error::io("extracting", target.join(&e.path), x);
        let exists = |x: io::Error| {
            if x.kind() == io::ErrorKind::AlreadyExists {
                Error::Exists {
                    entry: e.path.clone(),
                }
            } else {
                Error::io("extracting", target.join(&e.path), x)
            }
        };
        note_dirs(created, &mut made, &e.path);
        match &e.kind {
            EntryKind::Dir => {
                root.create_dir(&e.path).map_err(wrap)?;
                if made.insert(e.path.clone()) {
                    created.push(e.path.clone());
                }
            }
            EntryKind::File => {
                let mut f = root.create_file(&e.path).map_err(exists)?;
                created.push(e.path.clone());
                let is_manifest = e.path == names::MANIFEST_PATH;
                let mut small = Vec::new();
                let mut hasher = hasher_for(manifest.as_ref(), &e.path);
                let mut n = 0u64;
                loop {
                    let k = ent.read(&mut buf).map_err(|x| tar_err(Some(&e.path), x))?;
                    if k == 0 {
                        break;
                    }
                    if opts.verify {
                        hasher.update(&buf[..k]);
                    }
                    if is_manifest {
                        small.extend_from_slice(&buf[..k]);
                    }
                    f.write_all(&buf[..k]).map_err(wrap)?;
                    n += k as u64;
                    progress(ent.raw_file_position() + n, total);
                }
                if is_manifest {
                    match select {
                        Select::Listed(l) if small != l.manifest_json => {
                            return Err(Error::ChangedSinceChecked {
                                entry: e.path.clone(),
                                reason: "other bytes than the manifest that was admitted".into(),
                            });
                        }
                        Select::Listed(_) => {}
                        Select::All => manifest = Some(Manifest::from_json(&small, &e.path)?),
                    }
                } else if let Some(name) = e.path.strip_prefix("checkpoint/") {
                    if opts.verify && !name.contains('/') {
                        found.insert(name.to_string(), hasher.finish());
                    }
                } else if opts.verify && e.path == names::STATS_DUMP {
                    stats_copy = Some(hasher.finish());
                }
            }
            EntryKind::Hardlink(t) => {
                root.hard_link(t, &e.path).map_err(exists)?;
                created.push(e.path.clone());
            }
            EntryKind::Symlink(t) => symlinks.push((t.clone(), e.path.clone())),
        }
        out.push(e);
        Ok(())
    })?;
    // Links last, so no later entry can be written through one.
    for (t, p) in symlinks {
        root.symlink(&t, &p).map_err(|x| {
            if x.kind() == io::ErrorKind::AlreadyExists {
                Error::Exists { entry: p.clone() }
            } else {
                Error::io("extracting", target.join(&p), x)
            }
        })?;
        created.push(p);
    }
    if opts.verify {
        let m = manifest.ok_or_else(|| Error::MissingEntry {
            name: names::MANIFEST_PATH.into(),
        })?;
        compare_files(&m, &found)?;
        check_stats_copy(&m, stats_copy, &mut BTreeMap::new())?;
    }
    progress(total, total);
    Ok(out)
}

/// One member to put into an archive.
#[derive(Debug, Clone)]
pub enum Member {
    /// Bytes held in memory.
    Bytes(Vec<u8>),
    /// A file on disk, streamed.
    File(PathBuf),
}

/// What goes into a kubelet-style archive (containerd 2.1+ layout).
#[derive(Debug, Clone, Default)]
pub struct ArchiveSpec {
    /// The checkpoint directory: flat, regular files only (CRIU images and the gpu-ckpt manifest).
    pub checkpoint_dir: Option<PathBuf>,
    pub config_dump: Option<ConfigDump>,
    /// The OCI spec JSON.
    pub spec_dump: Option<serde_json::Value>,
    /// CRI ContainerStatus JSON.
    pub status_dump: Option<serde_json::Value>,
    /// Other members by name (`status`, `container.log`, `dump.log`, `stats-dump`,
    /// `rootfs-diff.tar`, ...). Names must be flat.
    pub members: BTreeMap<String, Member>,
    /// mtime of every header (seconds since the epoch).
    pub mtime: u64,
}

/// Write an archive at `out` (temp file then rename; mode 0600). Members are written in name order,
/// as a directory walk would; files 0600, directories 0700, owner root.
pub fn write_archive(spec: &ArchiveSpec, out: &Path) -> Result<()> {
    crate::safe::write_atomically(out, |w, _| write_archive_to(spec, w).map(drop))
}

fn header(kind: tar::EntryType, size: u64, mtime: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(if kind == tar::EntryType::Directory {
        0o700
    } else {
        0o600
    });
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(mtime);
    h
}

/// Write an archive to any writer; returns the writer.
pub fn write_archive_to<W: Write>(spec: &ArchiveSpec, w: W) -> Result<W> {
    let mut b = tar::Builder::new(w);
    let mut all: BTreeMap<String, Member> = spec.members.clone();
    for name in all.keys() {
        crate::manifest::check_flat_name(name)?;
    }
    let json = |v: &dyn erased::Ser| -> Result<Vec<u8>> { v.to_json() };
    if let Some(c) = &spec.config_dump {
        all.insert(names::CONFIG_DUMP.into(), Member::Bytes(json(c)?));
    }
    if let Some(s) = &spec.spec_dump {
        all.insert(names::SPEC_DUMP.into(), Member::Bytes(json(s)?));
    }
    if let Some(s) = &spec.status_dump {
        all.insert(names::STATUS_DUMP.into(), Member::Bytes(json(s)?));
    }
    let werr =
        |name: &str, e: io::Error| Error::io("writing archive member", PathBuf::from(name), e);
    // "checkpoint" sorts before every other checkpointctl name.
    if let Some(dir) = &spec.checkpoint_dir {
        let mut h = header(tar::EntryType::Directory, 0, spec.mtime);
        b.append_data(&mut h, "checkpoint/", io::empty())
            .map_err(|e| werr("checkpoint/", e))?;
        let mut files: Vec<String> = Vec::new();
        for (name, ent) in crate::manifest::flat_entries(dir)? {
            let ft = ent
                .file_type()
                .map_err(|e| Error::io("reading", ent.path(), e))?;
            if !ft.is_file() {
                return Err(Error::NotFlat {
                    name,
                    reason: "only regular files are allowed",
                });
            }
            if name.starts_with(&format!(".{MANIFEST_FILE}.tmp-")) {
                continue;
            }
            files.push(name);
        }
        files.sort();
        for name in files {
            append_file(
                &mut b,
                &dir.join(&name),
                &format!("checkpoint/{name}"),
                spec.mtime,
            )?;
        }
    }
    for (name, m) in &all {
        match m {
            Member::Bytes(d) => {
                let mut h = header(tar::EntryType::Regular, d.len() as u64, spec.mtime);
                b.append_data(&mut h, name, &d[..])
                    .map_err(|e| werr(name, e))?;
            }
            Member::File(p) => append_file(&mut b, p, name, spec.mtime)?,
        }
    }
    b.into_inner().map_err(|e| werr("(end of archive)", e))
}

fn append_file<W: Write>(
    b: &mut tar::Builder<W>,
    path: &Path,
    name: &str,
    mtime: u64,
) -> Result<()> {
    let f = File::open(path).map_err(|e| Error::io("opening", path, e))?;
    let len = f
        .metadata()
        .map_err(|e| Error::io("reading", path, e))?
        .len();
    let mut h = header(tar::EntryType::Regular, len, mtime);
    // Take exactly `len` bytes: a file that grows while we copy must not corrupt the stream.
    let mut r = f.take(len);
    b.append_data(&mut h, name, &mut r)
        .map_err(|e| Error::io("writing archive member", path, e))
}

mod erased {
    use crate::error::{Error, Result};
    pub trait Ser {
        fn to_json(&self) -> Result<Vec<u8>>;
    }
    impl<T: serde::Serialize> Ser for T {
        fn to_json(&self) -> Result<Vec<u8>> {
            serde_json::to_vec_pretty(self).map_err(|e| Error::json("archive member", e))
        }
    }
}

/// The manifest entry of an in-memory archive member, for callers building manifests of small
/// files.
pub fn digest_bytes(d: &[u8]) -> FileDigest {
    let mut h = FileHasher::every();
    h.update(d);
    h.finish()
}

/// Convenience: list a whole archive without extracting it.
pub fn list(path: &Path) -> Result<Vec<EntryInfo>> {
    Ok(read_info(path, Limits::default())?.entries)
}

/// Convenience: verify with no progress and default limits.
pub fn verify(path: &Path) -> Result<VerifyReport> {
    verify_archive(path, Limits::default(), &mut no_progress)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unpacked_archive_with_links_or_special_files_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = dir.path().join("checkpoint");
        std::fs::create_dir(&ckpt).unwrap();
        std::fs::write(ckpt.join("inventory.img"), b"x").unwrap();
        std::fs::write(dir.path().join("spec.dump"), b"{}").unwrap();
        let info = read_info_tree(dir.path(), Limits::default()).unwrap();
        assert!(info.spec_dump.is_some());
        assert!(info.manifest.is_none());
        let refused = |limits| read_info_tree(dir.path(), limits).unwrap_err().to_string();

        std::os::unix::fs::symlink("/etc/shadow", ckpt.join("pages-1.img")).unwrap();
        let err = refused(Limits::default());
        assert!(
            err.contains("checkpoint/pages-1.img") && err.contains("symbolic link"),
            "{err}"
        );
        std::fs::remove_file(ckpt.join("pages-1.img")).unwrap();

        let fifo = std::ffi::CString::new(ckpt.join("fifo").into_os_string().into_encoded_bytes())
            .unwrap();
        // SAFETY: a NUL-terminated path, as mkfifo(3) takes.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o700) }, 0);
        let err = refused(Limits::default());
        assert!(
            err.contains("checkpoint/fifo") && err.contains("fifo"),
            "{err}"
        );
        std::fs::remove_file(ckpt.join("fifo")).unwrap();

        std::fs::create_dir(ckpt.join("sub")).unwrap();
        let err = refused(Limits::default());
        assert!(err.contains("checkpoint/sub"), "{err}");
        std::fs::remove_dir(ckpt.join("sub")).unwrap();

        let small = Limits {
            max_entry_bytes: 1,
            ..Limits::default()
        };
        let err = refused(small);
        assert!(err.contains("exceeds the limit"), "{err}");
    }
}
