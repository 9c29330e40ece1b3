//! A small, deterministic OCI image builder for the test images.
//!
//! [`ImageBuilder`] collects files, directories and symlinks and writes a single-layer image as
//! an OCI image layout directory and/or an OCI layout tarball that `ctr images import` names
//! by itself:
//!
//! - `oci-layout`, `index.json` (one manifest, annotated with `io.containerd.image.name=<full
//!   reference>` and `org.opencontainers.image.ref.name=<tag>`), `blobs/sha256/`;
//! - the layer is an uncompressed tar (`application/vnd.oci.image.layer.v1.tar`), so its digest
//!   is also its diff ID;
//! - the config (`application/vnd.oci.image.config.v1+json`) says amd64/linux and lists the
//!   diff ID; the manifest is `application/vnd.oci.image.manifest.v1+json`.
//!
//! Output is a pure function of the inputs: every entry has mtime 0 and uid/gid 0, entries are
//! sorted by path with every parent directory emitted before its children, JSON is written
//! compactly with a fixed key order, and the layout tarball is built the same way. Building the
//! same image twice gives the same manifest digest and byte-identical files.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// Media type of the uncompressed layer.
pub const MEDIA_LAYER: &str = "application/vnd.oci.image.layer.v1.tar";
/// Media type of the image config.
pub const MEDIA_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
/// Media type of the image manifest.
pub const MEDIA_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// Media type of the image index.
pub const MEDIA_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// Annotation containerd's importer takes the image name from.
pub const ANNOTATION_CONTAINERD_NAME: &str = "io.containerd.image.name";
/// OCI annotation for the tag of a manifest in an image layout.
pub const ANNOTATION_REF_NAME: &str = "org.opencontainers.image.ref.name";
/// The `created` time written into configs unless [`ImageBuilder::created`] says otherwise.
pub const EPOCH: &str = "1970-01-01T00:00:00Z";

/// Errors of the image builder; each names the path (in the image or on disk) at fault.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The image reference cannot be used.
    #[error("invalid image reference {reference:?}: {reason}")]
    InvalidReference {
        /// The reference.
        reference: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A path in the image is not an absolute, normal path.
    #[error("invalid path {path:?} in the image: {reason}")]
    InvalidPath {
        /// The path as given.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The same path was added twice (other than the same directory again).
    #[error("{path} is added twice to the image (as {first} and as {second})")]
    Duplicate {
        /// The path in the image.
        path: String,
        /// Kind of the first entry.
        first: &'static str,
        /// Kind of the second entry.
        second: &'static str,
    },
    /// A path's parent is a file or a symlink in the image.
    #[error("{path}: its parent {parent} is a {kind} in the image, not a directory")]
    ParentNotDirectory {
        /// The path in the image.
        path: String,
        /// The parent at fault.
        parent: String,
        /// What the parent is.
        kind: &'static str,
    },
    /// A symlink has an empty target.
    #[error("symlink {path} has an empty target")]
    EmptySymlinkTarget {
        /// The path in the image.
        path: String,
    },
    /// A file's content could not be read from disk.
    #[error("reading {source_path} for {path} in the image: {source}")]
    ReadSource {
        /// The path in the image.
        path: String,
        /// The file on disk.
        source_path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Building the layer or the layout tarball failed.
    #[error("writing the tar entry {path}: {source}")]
    Tar {
        /// The entry.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Writing an output file failed.
    #[error("writing {path}: {source}")]
    Write {
        /// The file or directory on disk.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Serialising JSON failed (not expected for the values written here).
    #[error("encoding {what}: {source}")]
    Json {
        /// Which document.
        what: &'static str,
        /// The serde error.
        #[source]
        source: serde_json::Error,
    },
    /// An executable or library whose shared libraries were asked for could not be read.
    #[error("reading the ELF file {path}: {source}")]
    ElfRead {
        /// The file on disk.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A file whose shared libraries were asked for is not a 64-bit little-endian ELF file.
    #[error("{path} is not a 64-bit little-endian ELF file (or its dynamic section is damaged)")]
    NotElf {
        /// The file on disk.
        path: PathBuf,
    },
    /// A shared library is in none of the searched directories.
    #[error("shared library {name} (needed by {needed_by}) is in none of {searched}")]
    LibraryNotFound {
        /// The library's name (`DT_NEEDED`).
        name: String,
        /// The file that needs it.
        needed_by: String,
        /// The directories searched, comma-separated.
        searched: String,
    },
}

/// Result type of this module.
pub type Result<T, E = ImageError> = std::result::Result<T, E>;

/// Where a file's content comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// These bytes.
    Bytes(Vec<u8>),
    /// The content of this file on disk, read when the image is built.
    Path(PathBuf),
}

impl From<Vec<u8>> for Source {
    fn from(v: Vec<u8>) -> Self {
        Source::Bytes(v)
    }
}

impl From<&[u8]> for Source {
    fn from(v: &[u8]) -> Self {
        Source::Bytes(v.to_vec())
    }
}

impl<const N: usize> From<&[u8; N]> for Source {
    fn from(v: &[u8; N]) -> Self {
        Source::Bytes(v.to_vec())
    }
}

impl From<String> for Source {
    /// The string's bytes (not a path: use `PathBuf`/`&Path` for that).
    fn from(v: String) -> Self {
        Source::Bytes(v.into_bytes())
    }
}

impl From<PathBuf> for Source {
    fn from(v: PathBuf) -> Self {
        Source::Path(v)
    }
}

impl From<&Path> for Source {
    fn from(v: &Path) -> Self {
        Source::Path(v.to_path_buf())
    }
}

#[derive(Debug, Clone)]
enum Entry {
    File { source: Source, mode: u32 },
    Dir { mode: u32 },
    Symlink { target: String },
}

impl Entry {
    fn kind(&self) -> &'static str {
        match self {
            Entry::File { .. } => "file",
            Entry::Dir { .. } => "directory",
            Entry::Symlink { .. } => "symlink",
        }
    }
}

/// The parts of an image reference that the layout needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// The full reference with its tag, for example `localhost:5000/pause:1`.
    pub full: String,
    /// Everything before the tag, for example `localhost:5000/pause`.
    pub repository: String,
    /// The tag, `latest` when the reference has none.
    pub tag: String,
}

impl Reference {
    /// Parses `name[:tag]`. Digest references (`@sha256:…`) and empty parts are refused.
    pub fn parse(reference: &str) -> Result<Reference> {
        let bad = |reason: &str| ImageError::InvalidReference {
            reference: reference.to_string(),
            reason: reason.to_string(),
        };
        if reference.is_empty() {
            return Err(bad("empty"));
        }
        if reference.contains('@') {
            return Err(bad("digest references cannot name a built image"));
        }
        if reference
            .chars()
            .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(bad("contains whitespace or control characters"));
        }
        let last_slash = reference.rfind('/').map_or(0, |i| i + 1);
        let (repository, tag) = match reference[last_slash..].rfind(':') {
            Some(i) => {
                let at = last_slash + i;
                (&reference[..at], &reference[at + 1..])
            }
            None => (reference, "latest"),
        };
        if repository.is_empty() || repository.ends_with('/') || repository.starts_with('/') {
            return Err(bad("empty repository name"));
        }
        if tag.is_empty() {
            return Err(bad("empty tag"));
        }
        if tag.len() > 128
            || !tag
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
        {
            return Err(bad("a tag is up to 128 characters of [A-Za-z0-9_.-]"));
        }
        Ok(Reference {
            full: format!("{repository}:{tag}"),
            repository: repository.to_string(),
            tag: tag.to_string(),
        })
    }
}

/// Builds a single-layer OCI image.
#[derive(Debug, Clone)]
pub struct ImageBuilder {
    reference: String,
    entries: Vec<(String, Entry)>,
    cmd: Option<Vec<String>>,
    entrypoint: Option<Vec<String>>,
    env: Vec<String>,
    workdir: Option<String>,
    labels: BTreeMap<String, String>,
    created: String,
}

/// A built image held in memory.
#[derive(Debug, Clone)]
pub struct ImageBlobs {
    /// The parsed reference.
    pub reference: Reference,
    /// The layer tar.
    pub layer: Vec<u8>,
    /// The config JSON.
    pub config: Vec<u8>,
    /// The manifest JSON.
    pub manifest: Vec<u8>,
    /// `index.json`.
    pub index: Vec<u8>,
    /// `oci-layout`.
    pub oci_layout: Vec<u8>,
}

/// What was written, with the digests (`sha256:<hex>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuiltImage {
    /// The full reference, with its tag.
    pub reference: String,
    /// The tag.
    pub tag: String,
    /// Digest of the manifest (the image's digest).
    pub manifest_digest: String,
    /// Digest of the config (containerd's and CRI's image ID).
    pub config_digest: String,
    /// Digest of the layer, which is also its diff ID (the layer is uncompressed).
    pub layer_digest: String,
    /// Size of the layer in bytes.
    pub layer_size: u64,
    /// The OCI layout directory, when one was written.
    pub layout_dir: Option<PathBuf>,
    /// The OCI layout tarball, when one was written.
    pub tarball: Option<PathBuf>,
}

/// `sha256:<hex>` of `data`.
pub fn sha256_digest(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

fn descriptor(media_type: &str, data: &[u8]) -> Value {
    json!({
        "mediaType": media_type,
        "digest": sha256_digest(data),
        "size": data.len(),
    })
}

fn to_json(what: &'static str, v: &Value) -> Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(|source| ImageError::Json { what, source })
}

/// Normalises an absolute path in the image to its relative form (`/bin//x` -> `bin/x`).
fn normalize(path: &str) -> Result<String> {
    let bad = |reason: &str| ImageError::InvalidPath {
        path: path.to_string(),
        reason: reason.to_string(),
    };
    if !path.starts_with('/') {
        return Err(bad("paths in the image must be absolute"));
    }
    if path.contains('\0') {
        return Err(bad("contains a NUL byte"));
    }
    let mut parts = Vec::new();
    for c in path.split('/') {
        match c {
            "" => {}
            "." | ".." => return Err(bad("`.` and `..` components are not allowed")),
            c => parts.push(c),
        }
    }
    if parts.is_empty() {
        return Err(bad("the root directory itself cannot be an entry"));
    }
    Ok(parts.join("/"))
}

impl ImageBuilder {
    /// A new, empty image named `reference` (`registry/name:tag`; the tag defaults to `latest`).
    pub fn new(reference: impl Into<String>) -> ImageBuilder {
        ImageBuilder {
            reference: reference.into(),
            entries: Vec::new(),
            cmd: None,
            entrypoint: None,
            env: Vec::new(),
            workdir: None,
            labels: BTreeMap::new(),
            created: EPOCH.to_string(),
        }
    }

    /// Adds a regular file at the absolute `path`, with `content` (bytes, or a path on disk read
    /// at build time) and permission `mode` (for example `0o755`).
    pub fn file(mut self, path: impl Into<String>, content: impl Into<Source>, mode: u32) -> Self {
        self.entries.push((
            path.into(),
            Entry::File {
                source: content.into(),
                mode: mode & 0o7777,
            },
        ));
        self
    }

    /// Adds a directory (mode 0755). Parents of every entry are added by themselves; this is
    /// for empty directories.
    pub fn dir(self, path: impl Into<String>) -> Self {
        self.dir_mode(path, 0o755)
    }

    /// Adds a directory with `mode` (for example `0o1777` for /tmp).
    pub fn dir_mode(mut self, path: impl Into<String>, mode: u32) -> Self {
        self.entries.push((
            path.into(),
            Entry::Dir {
                mode: mode & 0o7777,
            },
        ));
        self
    }

    /// Adds a symlink at `path` pointing at `target` (taken literally).
    pub fn symlink(mut self, path: impl Into<String>, target: impl Into<String>) -> Self {
        self.entries.push((
            path.into(),
            Entry::Symlink {
                target: target.into(),
            },
        ));
        self
    }

    /// The default command (`Cmd`).
    pub fn cmd<I, S>(mut self, cmd: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.cmd = Some(cmd.into_iter().map(Into::into).collect());
        self
    }

    /// The entrypoint (`Entrypoint`).
    pub fn entrypoint<I, S>(mut self, entrypoint: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.entrypoint = Some(entrypoint.into_iter().map(Into::into).collect());
        self
    }

    /// Adds one environment variable; a later value for the same name replaces the earlier.
    pub fn env(mut self, name: impl AsRef<str>, value: impl AsRef<str>) -> Self {
        let name = name.as_ref();
        let prefix = format!("{name}=");
        self.env.retain(|e| !e.starts_with(&prefix));
        self.env.push(format!("{name}={}", value.as_ref()));
        self
    }

    /// The working directory.
    pub fn workdir(mut self, dir: impl Into<String>) -> Self {
        self.workdir = Some(dir.into());
        self
    }

    /// Adds a config label.
    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// The config's `created` time (RFC 3339); defaults to [`EPOCH`].
    pub fn created(mut self, created: impl Into<String>) -> Self {
        self.created = created.into();
        self
    }

    /// Checks the entries and returns them by normalised path, with every missing parent
    /// directory added (mode 0755).
    fn tree(&self) -> Result<BTreeMap<String, Entry>> {
        let mut tree: BTreeMap<String, Entry> = BTreeMap::new();
        for (raw, entry) in &self.entries {
            let path = normalize(raw)?;
            if let Entry::Symlink { target } = entry {
                if target.is_empty() {
                    return Err(ImageError::EmptySymlinkTarget { path: raw.clone() });
                }
            }
            match (tree.get(&path), entry) {
                (None, _) => {
                    tree.insert(path, entry.clone());
                }
                (Some(Entry::Dir { .. }), Entry::Dir { .. }) => {
                    tree.insert(path, entry.clone());
                }
                (Some(first), second) => {
                    return Err(ImageError::Duplicate {
                        path: format!("/{path}"),
                        first: first.kind(),
                        second: second.kind(),
                    })
                }
            }
        }
        // Parents: must be directories; missing ones are added.
        let paths: Vec<String> = tree.keys().cloned().collect();
        for path in paths {
            let mut end = 0;
            while let Some(i) = path[end..].find('/') {
                let parent = &path[..end + i];
                match tree.get(parent) {
                    None => {
                        tree.insert(parent.to_string(), Entry::Dir { mode: 0o755 });
                    }
                    Some(Entry::Dir { .. }) => {}
                    Some(other) => {
                        return Err(ImageError::ParentNotDirectory {
                            path: format!("/{path}"),
                            parent: format!("/{parent}"),
                            kind: other.kind(),
                        })
                    }
                }
                end += i + 1;
            }
        }
        Ok(tree)
    }

    /// Builds the layer tar (deterministic; see the module docs).
    pub fn layer(&self) -> Result<Vec<u8>> {
        let tree = self.tree()?;
        // Sort by components so that a directory's children follow it directly.
        let mut sorted: Vec<(&String, &Entry)> = tree.iter().collect();
        sorted.sort_by(|a, b| a.0.split('/').cmp(b.0.split('/')));
        let mut ar = tar::Builder::new(Vec::new());
        for (path, entry) in sorted {
            let image_path = format!("/{path}");
            let tar_err = |source| ImageError::Tar {
                path: image_path.clone(),
                source,
            };
            let mut h = tar::Header::new_gnu();
            h.set_mtime(0);
            h.set_uid(0);
            h.set_gid(0);
            h.set_username("root").map_err(tar_err)?;
            h.set_groupname("root").map_err(tar_err)?;
            match entry {
                Entry::Dir { mode } => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_mode(*mode);
                    h.set_size(0);
                    ar.append_data(&mut h, format!("{path}/"), std::io::empty())
                        .map_err(tar_err)?;
                }
                Entry::Symlink { target } => {
                    h.set_entry_type(tar::EntryType::Symlink);
                    h.set_mode(0o777);
                    h.set_size(0);
                    ar.append_link(&mut h, path, target).map_err(tar_err)?;
                }
                Entry::File { source, mode } => {
                    let owned;
                    let data: &[u8] = match source {
                        Source::Bytes(b) => b,
                        Source::Path(p) => {
                            owned = fs::read(p).map_err(|source| ImageError::ReadSource {
                                path: image_path.clone(),
                                source_path: p.clone(),
                                source,
                            })?;
                            &owned
                        }
                    };
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_mode(*mode);
                    h.set_size(data.len() as u64);
                    ar.append_data(&mut h, path, data).map_err(tar_err)?;
                }
            }
        }
        ar.into_inner().map_err(|source| ImageError::Tar {
            path: "(end of archive)".into(),
            source,
        })
    }

    /// Builds every blob in memory.
    pub fn build(&self) -> Result<ImageBlobs> {
        let reference = Reference::parse(&self.reference)?;
        if let Some(w) = &self.workdir {
            if !w.starts_with('/') {
                return Err(ImageError::InvalidPath {
                    path: w.clone(),
                    reason: "the working directory must be absolute".into(),
                });
            }
        }
        let layer = self.layer()?;
        let diff_id = sha256_digest(&layer);

        let mut cfg = serde_json::Map::new();
        if !self.env.is_empty() {
            cfg.insert("Env".into(), json!(self.env));
        }
        if let Some(e) = &self.entrypoint {
            cfg.insert("Entrypoint".into(), json!(e));
        }
        if let Some(c) = &self.cmd {
            cfg.insert("Cmd".into(), json!(c));
        }
        if let Some(w) = &self.workdir {
            cfg.insert("WorkingDir".into(), json!(w));
        }
        if !self.labels.is_empty() {
            cfg.insert("Labels".into(), json!(self.labels));
        }
        let config = to_json(
            "image config",
            &json!({
                "created": self.created,
                "architecture": "amd64",
                "os": "linux",
                "config": Value::Object(cfg),
                "rootfs": { "type": "layers", "diff_ids": [diff_id] },
                "history": [{ "created": self.created, "created_by": "gpu-ckpt image builder" }],
            }),
        )?;
        let manifest = to_json(
            "image manifest",
            &json!({
                "schemaVersion": 2,
                "mediaType": MEDIA_MANIFEST,
                "config": descriptor(MEDIA_CONFIG, &config),
                "layers": [descriptor(MEDIA_LAYER, &layer)],
            }),
        )?;
        let mut mdesc = descriptor(MEDIA_MANIFEST, &manifest);
        mdesc["annotations"] = json!({
            ANNOTATION_CONTAINERD_NAME: reference.full,
            ANNOTATION_REF_NAME: reference.tag,
        });
        mdesc["platform"] = json!({ "architecture": "amd64", "os": "linux" });
        let index = to_json(
            "index.json",
            &json!({
                "schemaVersion": 2,
                "mediaType": MEDIA_INDEX,
                "manifests": [mdesc],
            }),
        )?;
        let oci_layout = to_json("oci-layout", &json!({ "imageLayoutVersion": "1.0.0" }))?;
        Ok(ImageBlobs {
            reference,
            layer,
            config,
            manifest,
            index,
            oci_layout,
        })
    }

    /// Writes the image as an OCI layout directory at `dir` (created if needed).
    pub fn write_layout(&self, dir: &Path) -> Result<BuiltImage> {
        self.write(Some(dir), None)
    }

    /// Writes the image as an OCI layout tarball at `path`.
    pub fn write_tarball(&self, path: &Path) -> Result<BuiltImage> {
        self.write(None, Some(path))
    }

    /// Writes a layout directory and/or a layout tarball from one build.
    pub fn write(&self, layout_dir: Option<&Path>, tarball: Option<&Path>) -> Result<BuiltImage> {
        let blobs = self.build()?;
        if let Some(dir) = layout_dir {
            blobs.write_layout(dir)?;
        }
        if let Some(path) = tarball {
            blobs.write_tarball(path)?;
        }
        let mut built = blobs.summary();
        built.layout_dir = layout_dir.map(Path::to_path_buf);
        built.tarball = tarball.map(Path::to_path_buf);
        Ok(built)
    }
}

impl ImageBlobs {
    /// Digests and names (no output paths).
    pub fn summary(&self) -> BuiltImage {
        BuiltImage {
            reference: self.reference.full.clone(),
            tag: self.reference.tag.clone(),
            manifest_digest: sha256_digest(&self.manifest),
            config_digest: sha256_digest(&self.config),
            layer_digest: sha256_digest(&self.layer),
            layer_size: self.layer.len() as u64,
            layout_dir: None,
            tarball: None,
        }
    }

    /// The layout's files as (relative path, content), sorted, without directories.
    pub fn layout_files(&self) -> Vec<(String, &[u8])> {
        let blob = |d: &[u8]| {
            let digest = sha256_digest(d);
            format!("blobs/sha256/{}", &digest["sha256:".len()..])
        };
        let mut files: Vec<(String, &[u8])> = vec![
            ("oci-layout".into(), &self.oci_layout[..]),
            ("index.json".into(), &self.index[..]),
            (blob(&self.layer), &self.layer[..]),
            (blob(&self.config), &self.config[..]),
            (blob(&self.manifest), &self.manifest[..]),
        ];
        files.sort_by(|a, b| a.0.cmp(&b.0));
        files.dedup_by(|a, b| a.0 == b.0);
        files
    }

    /// Writes the OCI layout directory.
    pub fn write_layout(&self, dir: &Path) -> Result<()> {
        let blobs = dir.join("blobs").join("sha256");
        fs::create_dir_all(&blobs).map_err(|source| ImageError::Write {
            path: blobs.clone(),
            source,
        })?;
        for (rel, data) in self.layout_files() {
            let path = dir.join(&rel);
            write_atomic(&path, data)?;
        }
        Ok(())
    }

    /// The OCI layout as a tarball (deterministic, like the layer).
    pub fn layout_tarball(&self) -> Result<Vec<u8>> {
        let mut ar = tar::Builder::new(Vec::new());
        let header = |kind: tar::EntryType, mode: u32, size: u64| {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(kind);
            h.set_mode(mode);
            h.set_size(size);
            h.set_mtime(0);
            h.set_uid(0);
            h.set_gid(0);
            h
        };
        let tar_err = |path: &str| {
            let path = path.to_string();
            move |source| ImageError::Tar { path, source }
        };
        for d in ["blobs/", "blobs/sha256/"] {
            let mut h = header(tar::EntryType::Directory, 0o755, 0);
            ar.append_data(&mut h, d, std::io::empty())
                .map_err(tar_err(d))?;
        }
        // Blobs first, then index.json and oci-layout: the same order every time.
        let mut files = self.layout_files();
        files.sort_by_key(|(p, _)| (!p.starts_with("blobs/"), p.clone()));
        for (rel, data) in files {
            let mut h = header(tar::EntryType::Regular, 0o644, data.len() as u64);
            ar.append_data(&mut h, &rel, data).map_err(tar_err(&rel))?;
        }
        ar.into_inner().map_err(tar_err("(end of archive)"))
    }

    /// Writes the OCI layout tarball to `path` (through a temporary file and a rename).
    pub fn write_tarball(&self, path: &Path) -> Result<()> {
        let data = self.layout_tarball()?;
        write_atomic(path, &data)
    }
}

fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    let err = |source| ImageError::Write {
        path: path.to_path_buf(),
        source,
    };
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).map_err(err)?;
    }
    let mut tmp_name = path.as_os_str().to_owned();
    tmp_name.push(format!(".tmp{}", std::process::id()));
    let tmp = PathBuf::from(tmp_name);
    let res = (|| {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if let Err(e) = res {
        let _ = fs::remove_file(&tmp);
        return Err(err(e));
    }
    Ok(())
}

/// True when the ELF file at `path` has no program interpreter (statically linked). `None` when
/// it is not a 64-bit little-endian ELF file.
pub fn elf_is_static(path: &Path) -> std::io::Result<Option<bool>> {
    let data = fs::read(path)?;
    Ok(elf_is_static_bytes(&data))
}

/// [`elf_is_static`] on bytes.
pub fn elf_is_static_bytes(data: &[u8]) -> Option<bool> {
    const PT_INTERP: u32 = 3;
    if data.len() < 64 || &data[..4] != b"\x7fELF" || data[4] != 2 || data[5] != 1 {
        return None;
    }
    let u16_at = |o: usize| Some(u16::from_le_bytes(data.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(data.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(data.get(o..o + 8)?.try_into().ok()?));
    let phoff = usize::try_from(u64_at(0x20)?).ok()?;
    let phentsize = usize::from(u16_at(0x36)?);
    let phnum = usize::from(u16_at(0x38)?);
    if phentsize < 4 {
        return None;
    }
    for i in 0..phnum {
        let off = phoff.checked_add(i.checked_mul(phentsize)?)?;
        if u32_at(off)? == PT_INTERP {
            return Some(false);
        }
    }
    Some(true)
}

/// What the dynamic loader needs to start an ELF file: its program interpreter (`PT_INTERP`) and
/// the shared libraries it names (`DT_NEEDED`, in order).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ElfDynamic {
    /// The program interpreter, for example `/lib64/ld-linux-x86-64.so.2`; `None` for shared
    /// libraries and static executables.
    pub interpreter: Option<String>,
    /// The `DT_NEEDED` names, for example `libc.so.6`.
    pub needed: Vec<String>,
}

/// [`ElfDynamic`] of the file at `path`.
pub fn elf_dynamic(path: &Path) -> Result<ElfDynamic> {
    let data = fs::read(path).map_err(|source| ImageError::ElfRead {
        path: path.to_path_buf(),
        source,
    })?;
    elf_dynamic_bytes(&data).ok_or_else(|| ImageError::NotElf {
        path: path.to_path_buf(),
    })
}

/// [`elf_dynamic`] on bytes: `None` when they are not a 64-bit little-endian ELF file or its
/// dynamic section points outside the file.
pub fn elf_dynamic_bytes(data: &[u8]) -> Option<ElfDynamic> {
    const PT_LOAD: u32 = 1;
    const PT_DYNAMIC: u32 = 2;
    const PT_INTERP: u32 = 3;
    const DT_NULL: u64 = 0;
    const DT_NEEDED: u64 = 1;
    const DT_STRTAB: u64 = 5;
    if data.len() < 64 || &data[..4] != b"\x7fELF" || data[4] != 2 || data[5] != 1 {
        return None;
    }
    let u16_at = |o: usize| Some(u16::from_le_bytes(data.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(data.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(data.get(o..o + 8)?.try_into().ok()?));
    let to_usize = |v: u64| usize::try_from(v).ok();
    let phoff = to_usize(u64_at(0x20)?)?;
    let phentsize = usize::from(u16_at(0x36)?);
    let phnum = usize::from(u16_at(0x38)?);
    if phentsize < 56 {
        return None;
    }
    // (offset, vaddr, filesz) of the PT_LOAD segments; the dynamic section's file range.
    let mut loads = Vec::new();
    let mut dynamic = None;
    let mut out = ElfDynamic::default();
    for i in 0..phnum {
        let ph = phoff.checked_add(i.checked_mul(phentsize)?)?;
        let (offset, vaddr, filesz) = (u64_at(ph + 8)?, u64_at(ph + 16)?, u64_at(ph + 32)?);
        match u32_at(ph)? {
            PT_LOAD => loads.push((offset, vaddr, filesz)),
            PT_DYNAMIC => dynamic = Some((to_usize(offset)?, to_usize(filesz)?)),
            PT_INTERP => {
                let start = to_usize(offset)?;
                let raw = data.get(start..start.checked_add(to_usize(filesz)?)?)?;
                let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
                out.interpreter = Some(String::from_utf8_lossy(&raw[..end]).into_owned());
            }
            _ => {}
        }
    }
    let Some((dyn_off, dyn_size)) = dynamic else {
        return Some(out);
    };
    // The dynamic entries: (tag, value), up to DT_NULL.
    let mut strtab = None;
    let mut needed_offsets = Vec::new();
    let mut o = dyn_off;
    while o + 16 <= dyn_off.checked_add(dyn_size)? {
        let (tag, val) = (u64_at(o)?, u64_at(o + 8)?);
        match tag {
            DT_NULL => break,
            DT_NEEDED => needed_offsets.push(val),
            DT_STRTAB => strtab = Some(val),
            _ => {}
        }
        o += 16;
    }
    if needed_offsets.is_empty() {
        return Some(out);
    }
    // DT_STRTAB is an address: map it to a file offset through the PT_LOAD segment holding it.
    let addr = strtab?;
    let (seg_off, seg_vaddr, _) = loads
        .iter()
        .find(|(_, vaddr, filesz)| addr >= *vaddr && addr - vaddr < *filesz)?;
    let strtab_off = to_usize(seg_off.checked_add(addr - seg_vaddr)?)?;
    for n in needed_offsets {
        let start = strtab_off.checked_add(to_usize(n)?)?;
        let rest = data.get(start..)?;
        let end = rest.iter().position(|&b| b == 0)?;
        out.needed
            .push(String::from_utf8_lossy(&rest[..end]).into_owned());
    }
    Some(out)
}

/// The directories [`HostLibraries::resolve`] searches by default: the loader's system search
/// path on Debian's multiarch layout, then the other usual places.
pub const HOST_LIB_DIRS: &[&str] = &[
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
];

/// Where [`ImageBuilder::merged_usr_libraries`] puts shared libraries in an image (Debian's
/// multiarch directory, which the loader searches without an `ld.so.cache`).
pub const IMAGE_LIB_DIR: &str = "/usr/lib/x86_64-linux-gnu";

/// The host's shared libraries that some executables need, found by following `DT_NEEDED` from
/// them (the way the loader does, without running anything).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostLibraries {
    /// Library name (`DT_NEEDED`, for example `libc.so.6`) -> the file on the host.
    pub libs: BTreeMap<String, PathBuf>,
    /// The program interpreters of the executables (for example `/lib64/ld-linux-x86-64.so.2`).
    pub interpreters: BTreeSet<String>,
}

impl HostLibraries {
    /// The closure of `DT_NEEDED` over `elfs` (executables or libraries) and the library names in
    /// `extra`, each name looked up in `dirs` in order (the first file of that name wins). The
    /// interpreters of `elfs` are recorded, and each one's file is added under its file name.
    pub fn resolve<P: AsRef<Path>>(
        elfs: &[P],
        extra: &[&str],
        dirs: &[P],
    ) -> Result<HostLibraries> {
        Self::resolve_except(elfs, extra, dirs, &[])
    }

    /// [`HostLibraries::resolve`], leaving out the libraries named in `provided` (and what only
    /// they need): the ones that the runtime puts into a container, as the CDI spec of a driver
    /// does.
    pub fn resolve_except<P: AsRef<Path>>(
        elfs: &[P],
        extra: &[&str],
        dirs: &[P],
        provided: &[&str],
    ) -> Result<HostLibraries> {
        let mut out = HostLibraries::default();
        // (name, who needs it)
        let mut todo: Vec<(String, String)> = Vec::new();
        for elf in elfs {
            let elf = elf.as_ref();
            let d = elf_dynamic(elf)?;
            if let Some(interp) = d.interpreter {
                let name = Path::new(&interp)
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                if name.is_empty() || !Path::new(&interp).is_file() {
                    return Err(ImageError::LibraryNotFound {
                        name: interp,
                        needed_by: format!("{} as its interpreter", elf.display()),
                        searched: "the host".into(),
                    });
                }
                out.libs
                    .entry(name.clone())
                    .or_insert_with(|| PathBuf::from(&interp));
                todo.push((name, elf.display().to_string()));
                out.interpreters.insert(interp);
            }
            todo.extend(d.needed.into_iter().map(|n| (n, elf.display().to_string())));
        }
        todo.extend(
            extra
                .iter()
                .map(|n| (n.to_string(), "the image".to_string())),
        );
        let mut seen = BTreeSet::new();
        while let Some((name, needed_by)) = todo.pop() {
            if !seen.insert(name.clone()) || provided.contains(&name.as_str()) {
                continue;
            }
            let path = match out.libs.get(&name) {
                Some(p) => p.clone(),
                None => {
                    let found = if name.contains('/') {
                        Some(PathBuf::from(&name)).filter(|p| p.is_file())
                    } else {
                        dirs.iter()
                            .map(|d| d.as_ref().join(&name))
                            .find(|p| p.is_file())
                    };
                    let Some(p) = found else {
                        return Err(ImageError::LibraryNotFound {
                            name,
                            needed_by,
                            searched: dirs
                                .iter()
                                .map(|d| d.as_ref().display().to_string())
                                .collect::<Vec<_>>()
                                .join(", "),
                        });
                    };
                    let key = if name.contains('/') {
                        Path::new(&name)
                            .file_name()
                            .map(|n| n.to_string_lossy().into_owned())
                            .unwrap_or_else(|| name.clone())
                    } else {
                        name.clone()
                    };
                    out.libs.insert(key, p.clone());
                    p
                }
            };
            let d = elf_dynamic(&path)?;
            todo.extend(
                d.needed
                    .into_iter()
                    .map(|n| (n, path.display().to_string())),
            );
        }
        Ok(out)
    }
}

impl ImageBuilder {
    /// Adds `libs` in a merged-/usr layout like Debian 12's: every library as a regular file
    /// `IMAGE_LIB_DIR/<name>` (mode 0755, the content of the host's file, symlinks followed),
    /// `/lib -> usr/lib` and `/lib64 -> usr/lib64`, and each interpreter's path (below /usr, for
    /// example `/usr/lib64/ld-linux-x86-64.so.2`) as a symlink to its file in `IMAGE_LIB_DIR`. The
    /// loader finds the libraries there without an `ld.so.cache`, and so does `dlopen` of a
    /// library mounted there at run time (the CDI spec mounts `libcuda.so.1` there).
    pub fn merged_usr_libraries(mut self, libs: &HostLibraries) -> Self {
        self = self
            .symlink("/lib", "usr/lib")
            .symlink("/lib64", "usr/lib64");
        for (name, path) in &libs.libs {
            self = self.file(format!("{IMAGE_LIB_DIR}/{name}"), path.as_path(), 0o755);
        }
        for interp in &libs.interpreters {
            let Some(name) = Path::new(interp).file_name() else {
                continue;
            };
            let target = format!("{IMAGE_LIB_DIR}/{}", name.to_string_lossy());
            let at = match interp.strip_prefix("/usr/") {
                Some(_) => interp.clone(),
                None => format!("/usr{interp}"),
            };
            if at != target {
                self = self.symlink(at, target);
            }
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ImageBuilder {
        ImageBuilder::new("localhost:5000/test/sample:7")
            .file("/bin/tool", b"#!/bin/sh\necho hi\n", 0o755)
            .file(
                "/etc/passwd",
                "root:x:0:0:root:/root:/bin/sh\n".to_string(),
                0o644,
            )
            .dir_mode("/tmp", 0o1777)
            .symlink("/bin/sh", "busybox")
            .file("/usr/share/deep/nested/file", b"x", 0o600)
            .cmd(["/bin/tool", "--flag"])
            .env("PATH", "/bin")
            .workdir("/")
            .label("a", "b")
    }

    fn read_json(data: &[u8]) -> Value {
        serde_json::from_slice(data).unwrap()
    }

    #[test]
    fn deterministic() {
        let a = sample().build().unwrap();
        let b = sample().build().unwrap();
        assert_eq!(a.summary(), b.summary());
        assert_eq!(a.layer, b.layer);
        assert_eq!(a.layout_tarball().unwrap(), b.layout_tarball().unwrap());
        // Insertion order does not matter.
        let c = ImageBuilder::new("localhost:5000/test/sample:7")
            .label("a", "b")
            .workdir("/")
            .env("PATH", "/bin")
            .cmd(["/bin/tool", "--flag"])
            .file("/usr/share/deep/nested/file", b"x", 0o600)
            .symlink("/bin/sh", "busybox")
            .dir_mode("/tmp", 0o1777)
            .file(
                "/etc/passwd",
                "root:x:0:0:root:/root:/bin/sh\n".to_string(),
                0o644,
            )
            .file("/bin/tool", b"#!/bin/sh\necho hi\n", 0o755)
            .build()
            .unwrap();
        assert_eq!(c.summary().manifest_digest, a.summary().manifest_digest);
        // Different content, different digest.
        let d = sample().file("/extra", b"1", 0o644).build().unwrap();
        assert_ne!(d.summary().manifest_digest, a.summary().manifest_digest);

        // Written twice to disk: the same tarball bytes and the same digest.
        let tmp = tempfile::tempdir().unwrap();
        let t1 = tmp.path().join("one.tar");
        let t2 = tmp.path().join("two.tar");
        let b1 = sample().write_tarball(&t1).unwrap();
        let b2 = sample().write_tarball(&t2).unwrap();
        assert_eq!(b1.manifest_digest, b2.manifest_digest);
        assert_eq!(fs::read(&t1).unwrap(), fs::read(&t2).unwrap());
        assert_eq!(b1.tarball.as_deref(), Some(t1.as_path()));
    }

    #[test]
    fn blob_digests_match_content() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("layout");
        let built = sample().write_layout(&dir).unwrap();
        assert_eq!(
            read_json(&fs::read(dir.join("oci-layout")).unwrap()),
            json!({"imageLayoutVersion": "1.0.0"})
        );
        let blob = |digest: &str| {
            let hex = digest.strip_prefix("sha256:").unwrap();
            let data = fs::read(dir.join("blobs/sha256").join(hex)).unwrap();
            assert_eq!(sha256_digest(&data), digest, "blob {digest}");
            data
        };
        // Every file under blobs/ is named by its digest.
        for e in fs::read_dir(dir.join("blobs/sha256")).unwrap() {
            let e = e.unwrap();
            let data = fs::read(e.path()).unwrap();
            assert_eq!(
                sha256_digest(&data),
                format!("sha256:{}", e.file_name().to_string_lossy())
            );
        }
        let index = read_json(&fs::read(dir.join("index.json")).unwrap());
        assert_eq!(index["schemaVersion"], 2);
        let m = &index["manifests"][0];
        assert_eq!(index["manifests"].as_array().unwrap().len(), 1);
        assert_eq!(m["mediaType"], MEDIA_MANIFEST);
        assert_eq!(m["digest"], built.manifest_digest.as_str());
        assert_eq!(
            m["annotations"][ANNOTATION_CONTAINERD_NAME],
            "localhost:5000/test/sample:7"
        );
        assert_eq!(m["annotations"][ANNOTATION_REF_NAME], "7");
        let manifest_bytes = blob(m["digest"].as_str().unwrap());
        assert_eq!(m["size"], manifest_bytes.len());
        let manifest = read_json(&manifest_bytes);
        assert_eq!(manifest["mediaType"], MEDIA_MANIFEST);
        assert_eq!(manifest["config"]["mediaType"], MEDIA_CONFIG);
        let config_bytes = blob(manifest["config"]["digest"].as_str().unwrap());
        assert_eq!(manifest["config"]["size"], config_bytes.len());
        assert_eq!(manifest["config"]["digest"], built.config_digest.as_str());
        let l = &manifest["layers"][0];
        assert_eq!(l["mediaType"], MEDIA_LAYER);
        let layer = blob(l["digest"].as_str().unwrap());
        assert_eq!(l["size"], layer.len());
        assert_eq!(built.layer_size, layer.len() as u64);
        let config = read_json(&config_bytes);
        assert_eq!(config["architecture"], "amd64");
        assert_eq!(config["os"], "linux");
        assert_eq!(config["rootfs"]["type"], "layers");
        // Uncompressed layer: the diff ID is the layer digest.
        assert_eq!(config["rootfs"]["diff_ids"][0], l["digest"]);
        assert_eq!(config["config"]["Cmd"], json!(["/bin/tool", "--flag"]));
        assert_eq!(config["config"]["Env"], json!(["PATH=/bin"]));
        assert_eq!(config["config"]["WorkingDir"], "/");
        assert_eq!(config["config"]["Labels"]["a"], "b");
    }

    #[test]
    fn layer_has_expected_entries_and_modes() {
        let layer = sample().layer().unwrap();
        let mut ar = tar::Archive::new(&layer[..]);
        let mut got = Vec::new();
        for e in ar.entries().unwrap() {
            let mut e = e.unwrap();
            let h = e.header().clone();
            assert_eq!(h.mtime().unwrap(), 0);
            assert_eq!(h.uid().unwrap(), 0);
            assert_eq!(h.gid().unwrap(), 0);
            let path = e.path().unwrap().to_string_lossy().into_owned();
            let link = e
                .link_name()
                .unwrap()
                .map(|l| l.to_string_lossy().into_owned());
            let mut content = Vec::new();
            std::io::Read::read_to_end(&mut e, &mut content).unwrap();
            got.push((
                path.trim_end_matches('/').to_string(),
                h.entry_type(),
                h.mode().unwrap(),
                link,
                content,
            ));
        }
        use tar::EntryType::{Directory as D, Regular as F, Symlink as L};
        type Want<'a> = (&'a str, tar::EntryType, u32, Option<&'a str>, &'a [u8]);
        let want: Vec<Want> = vec![
            ("bin", D, 0o755, None, b""),
            ("bin/sh", L, 0o777, Some("busybox"), b""),
            ("bin/tool", F, 0o755, None, b"#!/bin/sh\necho hi\n"),
            ("etc", D, 0o755, None, b""),
            (
                "etc/passwd",
                F,
                0o644,
                None,
                b"root:x:0:0:root:/root:/bin/sh\n",
            ),
            ("tmp", D, 0o1777, None, b""),
            ("usr", D, 0o755, None, b""),
            ("usr/share", D, 0o755, None, b""),
            ("usr/share/deep", D, 0o755, None, b""),
            ("usr/share/deep/nested", D, 0o755, None, b""),
            ("usr/share/deep/nested/file", F, 0o600, None, b"x"),
        ];
        assert_eq!(got.len(), want.len(), "{got:?}");
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.0, w.0);
            assert_eq!(g.1, w.1, "{}", w.0);
            assert_eq!(g.2, w.2, "{}: mode {:o}", w.0, g.2);
            assert_eq!(g.3.as_deref(), w.3, "{}", w.0);
            assert_eq!(g.4, w.4, "{}", w.0);
        }
    }

    #[test]
    fn layout_tarball_entries() {
        let blobs = sample().build().unwrap();
        let data = blobs.layout_tarball().unwrap();
        let mut ar = tar::Archive::new(&data[..]);
        let names: Vec<String> = ar
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 7, "{names:?}");
        assert_eq!(names[0].trim_end_matches('/'), "blobs");
        assert_eq!(names[1].trim_end_matches('/'), "blobs/sha256");
        assert!(names[2..5].iter().all(|n| n.starts_with("blobs/sha256/")));
        assert_eq!(names[5], "index.json");
        assert_eq!(names[6], "oci-layout");
    }

    #[test]
    fn errors_name_the_path() {
        let e = ImageBuilder::new("x:1")
            .file("bin/rel", b"", 0o644)
            .build()
            .unwrap_err();
        assert!(e.to_string().contains("bin/rel"), "{e}");
        let e = ImageBuilder::new("x:1")
            .file("/a/../b", b"", 0o644)
            .build()
            .unwrap_err();
        assert!(e.to_string().contains("/a/../b"), "{e}");
        let e = ImageBuilder::new("x:1")
            .file("/bin/sh", b"", 0o755)
            .symlink("/bin/sh", "busybox")
            .build()
            .unwrap_err();
        assert!(
            matches!(&e, ImageError::Duplicate { path, .. } if path == "/bin/sh"),
            "{e}"
        );
        let e = ImageBuilder::new("x:1")
            .file("/etc", b"", 0o644)
            .file("/etc/passwd", b"", 0o644)
            .build()
            .unwrap_err();
        assert!(
            matches!(&e, ImageError::ParentNotDirectory { path, parent, .. }
                if path == "/etc/passwd" && parent == "/etc"),
            "{e}"
        );
        let e = ImageBuilder::new("x:1")
            .file(
                "/bin/missing",
                Path::new("/nonexistent/gpu-ckpt/src"),
                0o755,
            )
            .build()
            .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("/bin/missing") && msg.contains("/nonexistent/gpu-ckpt/src"),
            "{msg}"
        );
        // The same directory twice is fine; the last mode wins.
        let layer = ImageBuilder::new("x:1")
            .dir("/tmp")
            .dir_mode("/tmp", 0o1777)
            .layer()
            .unwrap();
        let mut ar = tar::Archive::new(&layer[..]);
        let e = ar.entries().unwrap().next().unwrap().unwrap();
        assert_eq!(e.header().mode().unwrap(), 0o1777);
    }

    #[test]
    fn references() {
        let r = Reference::parse("localhost:5000/gpu-ckpt/workloads:1").unwrap();
        assert_eq!(r.repository, "localhost:5000/gpu-ckpt/workloads");
        assert_eq!(r.tag, "1");
        assert_eq!(r.full, "localhost:5000/gpu-ckpt/workloads:1");
        let r = Reference::parse("localhost:5000/pause").unwrap();
        assert_eq!(r.tag, "latest");
        assert_eq!(r.full, "localhost:5000/pause:latest");
        for bad in ["", "x@sha256:00", "x:", "/x:1", "x y:1", "x:a+b"] {
            assert!(Reference::parse(bad).is_err(), "{bad:?}");
        }
    }

    /// A minimal ELF64 file: one PT_LOAD at vaddr 0x400000 covering the file, a PT_INTERP, and a
    /// PT_DYNAMIC with two DT_NEEDED entries and DT_STRTAB pointing into the load segment.
    fn tiny_elf() -> Vec<u8> {
        let mut f = vec![0u8; 64];
        f[..4].copy_from_slice(b"\x7fELF");
        f[4] = 2;
        f[5] = 1;
        let phoff = 64u64;
        let phnum = 3u16;
        f[0x20..0x28].copy_from_slice(&phoff.to_le_bytes());
        f[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        f[0x38..0x3a].copy_from_slice(&phnum.to_le_bytes());
        let interp_off = 64 + 3 * 56;
        let interp = b"/lib64/ld-test.so.2\0";
        let strtab_off = interp_off + interp.len();
        let strtab = b"\0libfoo.so.1\0libbar.so.2\0";
        let dyn_off = strtab_off + strtab.len();
        let vaddr = 0x40_0000u64;
        let dyns: [(u64, u64); 4] = [(1, 1), (5, vaddr + strtab_off as u64), (1, 13), (0, 0)];
        let total = dyn_off + dyns.len() * 16;
        let ph = |t: u32, off: u64, va: u64, size: u64| {
            let mut h = vec![0u8; 56];
            h[..4].copy_from_slice(&t.to_le_bytes());
            h[8..16].copy_from_slice(&off.to_le_bytes());
            h[16..24].copy_from_slice(&va.to_le_bytes());
            h[32..40].copy_from_slice(&size.to_le_bytes());
            h
        };
        f.extend(ph(1, 0, vaddr, total as u64));
        f.extend(ph(
            3,
            interp_off as u64,
            vaddr + interp_off as u64,
            interp.len() as u64,
        ));
        f.extend(ph(
            2,
            dyn_off as u64,
            vaddr + dyn_off as u64,
            (dyns.len() * 16) as u64,
        ));
        f.extend_from_slice(interp);
        f.extend_from_slice(strtab);
        for (t, v) in dyns {
            f.extend_from_slice(&t.to_le_bytes());
            f.extend_from_slice(&v.to_le_bytes());
        }
        f
    }

    #[test]
    fn elf_dynamic_reads_interpreter_and_needed() {
        let d = elf_dynamic_bytes(&tiny_elf()).unwrap();
        assert_eq!(d.interpreter.as_deref(), Some("/lib64/ld-test.so.2"));
        assert_eq!(d.needed, vec!["libfoo.so.1", "libbar.so.2"]);
        assert_eq!(elf_dynamic_bytes(b"not an elf"), None);
        // Truncated inside the dynamic section.
        let t = tiny_elf();
        assert_eq!(elf_dynamic_bytes(&t[..t.len() - 20]), None);

        // This test binary is dynamically linked against libc, with an interpreter.
        let me = std::env::current_exe().unwrap();
        let d = elf_dynamic(&me).unwrap();
        assert!(d.interpreter.is_some(), "{d:?}");
        assert!(d.needed.iter().any(|n| n.starts_with("libc.so")), "{d:?}");
    }

    #[test]
    fn host_libraries_follow_needed() {
        let me = std::env::current_exe().unwrap();
        let dirs: Vec<PathBuf> = HOST_LIB_DIRS.iter().map(PathBuf::from).collect();
        let libs = HostLibraries::resolve(std::slice::from_ref(&me), &[], &dirs).unwrap();
        assert!(libs.libs.contains_key("libc.so.6"), "{libs:?}");
        let interp = libs.interpreters.iter().next().unwrap();
        let interp_name = Path::new(interp).file_name().unwrap().to_string_lossy();
        assert!(libs.libs.contains_key(interp_name.as_ref()), "{libs:?}");
        let provided = HostLibraries::resolve_except(
            std::slice::from_ref(&me),
            &["libgpu-ckpt-nonexistent.so.9"],
            &dirs,
            &["libgpu-ckpt-nonexistent.so.9", "libc.so.6"],
        )
        .unwrap();
        assert!(!provided.libs.contains_key("libc.so.6"), "{provided:?}");
        let e =
            HostLibraries::resolve(&[me], &["libgpu-ckpt-nonexistent.so.9"], &dirs).unwrap_err();
        assert!(
            matches!(&e, ImageError::LibraryNotFound { name, .. }
                if name == "libgpu-ckpt-nonexistent.so.9"),
            "{e}"
        );
    }

    #[test]
    fn merged_usr_layout() {
        let tmp = tempfile::tempdir().unwrap();
        let lib = tmp.path().join("libx.so.1");
        fs::write(&lib, b"lib").unwrap();
        let ld = tmp.path().join("ld-test.so.2");
        fs::write(&ld, b"ld").unwrap();
        let libs = HostLibraries {
            libs: [
                ("libx.so.1".to_string(), lib),
                ("ld-test.so.2".to_string(), ld),
            ]
            .into_iter()
            .collect(),
            interpreters: ["/lib64/ld-test.so.2".to_string()].into_iter().collect(),
        };
        let layer = ImageBuilder::new("x:1")
            .merged_usr_libraries(&libs)
            .layer()
            .unwrap();
        let mut ar = tar::Archive::new(&layer[..]);
        let mut got = BTreeMap::new();
        for e in ar.entries().unwrap() {
            let e = e.unwrap();
            let path = e
                .path()
                .unwrap()
                .to_string_lossy()
                .trim_end_matches('/')
                .to_string();
            let link = e
                .link_name()
                .unwrap()
                .map(|l| l.to_string_lossy().into_owned());
            got.insert(path, (e.header().entry_type(), link));
        }
        use tar::EntryType::{Regular as F, Symlink as L};
        assert_eq!(got["lib"], (L, Some("usr/lib".into())));
        assert_eq!(got["lib64"], (L, Some("usr/lib64".into())));
        assert_eq!(got["usr/lib/x86_64-linux-gnu/libx.so.1"], (F, None));
        assert_eq!(got["usr/lib/x86_64-linux-gnu/ld-test.so.2"], (F, None));
        assert_eq!(
            got["usr/lib64/ld-test.so.2"],
            (L, Some("/usr/lib/x86_64-linux-gnu/ld-test.so.2".into()))
        );
    }

    #[test]
    fn elf_static_detection() {
        assert_eq!(elf_is_static_bytes(b"not an elf"), None);
        // This test binary is dynamically linked in an ordinary build.
        let me = std::env::current_exe().unwrap();
        let data = fs::read(me).unwrap();
        assert!(elf_is_static_bytes(&data).is_some());
    }
}
