//! The OCI checkpoint image: the kubelet archive as one uncompressed layer (the same as
//! `buildah add ckpt.tar /`), a config, and a manifest annotated so that containerd
//! (`org.criu.checkpoint.container.name`) and CRI-O (`io.kubernetes.cri-o.annotations.checkpoint.name`)
//! see a checkpoint, plus `gpu-ckpt.io/` keys carrying the GPU profile and versions, so compatibility is
//! decided from the manifest alone, without pulling the layer.
//!
//! Written as an OCI layout directory or as a layout tarball (what `ctr images import` takes), reading
//! the archive exactly once and hashing while copying.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::archive::{names, ArchiveInfo, ConfigDump, MAX_METADATA_BYTES};
use crate::compat::{self, keys, Profile};
use crate::digest::{sha256_hex, Progress, COPY_BUF};
use crate::error::{Error, Result};
use crate::manifest::{Manifest, SCHEMA_VERSION};
use crate::reference::ImageRef;
use crate::safe::{for_each_checked, EntryKind, Limits};

pub const MEDIA_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
pub const MEDIA_LAYER_TAR_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const MEDIA_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const MEDIA_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const MEDIA_INDEX: &str = "application/vnd.oci.image.index.v1+json";

/// containerd's key: an image whose manifest has it is restored as a checkpoint.
pub const ANN_CONTAINERD_NAME: &str = "org.criu.checkpoint.container.name";
/// CRI-O's key.
pub const ANN_CRIO_NAME: &str = "io.kubernetes.cri-o.annotations.checkpoint.name";
pub const ANN_ENGINE: &str = "org.criu.checkpoint.engine.name";
pub const ANN_POD: &str = "org.criu.checkpoint.pod.name";
pub const ANN_NAMESPACE: &str = "org.criu.checkpoint.pod.namespace";
pub const ANN_ROOTFS_IMAGE_NAME: &str = "org.criu.checkpoint.rootfsImageName";
pub const ANN_RUNTIME: &str = "org.criu.checkpoint.runtime.name";
pub const ANN_REF_NAME: &str = "org.opencontainers.image.ref.name";
pub const ANN_CONTAINERD_IMAGE_NAME: &str = "io.containerd.image.name";
pub const ANN_CREATED: &str = "org.opencontainers.image.created";

/// An OCI descriptor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Descriptor {
    #[serde(rename = "mediaType")]
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Platform {
    pub architecture: String,
    pub os: String,
}

/// An OCI image manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageManifest {
    #[serde(rename = "schemaVersion")]
    pub schema_version: u32,
    #[serde(rename = "mediaType", default)]
    pub media_type: String,
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// An OCI index (`index.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Index {
    #[serde(rename = "schemaVersion")]
    pub schema_version: u32,
    #[serde(
        rename = "mediaType",
        default,
        skip_serializing_if = "String::is_empty"
    )]
    pub media_type: String,
    pub manifests: Vec<Descriptor>,
}

/// What to build.
#[derive(Debug, Clone)]
pub struct BuildOptions {
    /// Full reference, e.g. `localhost:5000/ckpt/counter:1`. Its tag becomes
    /// `org.opencontainers.image.ref.name`; the whole becomes `io.containerd.image.name`.
    pub reference: String,
    pub limits: Limits,
}

/// What was built.
#[derive(Debug, Clone)]
pub struct Built {
    pub manifest: ImageManifest,
    pub manifest_json: Vec<u8>,
    pub manifest_digest: String,
    pub config_json: Vec<u8>,
    pub index_json: Vec<u8>,
    pub layer: Descriptor,
    /// The gpu-ckpt manifest found in the archive, if any.
    pub gpu_manifest: Option<Manifest>,
    pub container_name: String,
}

fn go_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "powerpc64" => "ppc64le",
        a => a,
    }
}

/// The tag an image is built under: the reference's, parsed by [`ImageRef`], or "latest". A
/// digest names what is built, so a build's reference has none.
fn build_tag(opts: &BuildOptions) -> Result<String> {
    let r = ImageRef::parse(&opts.reference)?;
    if let Some(d) = r.digest() {
        return Err(Error::InvalidField {
            what: format!("reference {:?}", opts.reference),
            field: "reference".into(),
            reason: format!("a build names a tag, not a digest ({d})"),
        });
    }
    Ok(r.tag().unwrap_or("latest").to_string())
}

/// A reader that copies everything read through it to `out`, hashing and counting.
struct Tee<'a, R> {
    inner: R,
    out: &'a mut dyn Write,
    hasher: Sha256,
    n: u64,
    total: u64,
    progress: Progress<'a>,
    last_report: u64,
}

impl<R: Read> Read for Tee<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let k = self.inner.read(buf)?;
        self.hasher.update(&buf[..k]);
        self.out.write_all(&buf[..k])?;
        self.n += k as u64;
        if self.n - self.last_report >= (8 << 20) || k == 0 {
            self.last_report = self.n;
            (self.progress)(self.n, self.total);
        }
        Ok(k)
    }
}

/// Collected while the archive streams through.
struct Collected {
    info: ArchiveInfo,
}

/// Stream the archive from `src` into `out`, checking every header and collecting metadata; returns
/// the layer digest (hex), size and metadata. Reads `src` once.
fn stream_layer(
    src: &Path,
    out: &mut dyn Write,
    limits: Limits,
    progress: Progress<'_>,
) -> Result<(String, u64, Collected)> {
    let f = File::open(src).map_err(|e| Error::io("opening", src, e))?;
    let total = f.metadata().map(|m| m.len()).unwrap_or(0);
    let tee = Tee {
        inner: io::BufReader::with_capacity(COPY_BUF, f),
        out,
        hasher: Sha256::new(),
        n: 0,
        total,
        progress,
        last_report: 0,
    };
    let mut ar = tar::Archive::new(tee);
    let mut info = ArchiveInfo::default();
    {
        let entries = ar.entries().map_err(|e| Error::Tar {
            entry: None,
            source: e,
        })?;
        for_each_checked(entries, limits, |ent, e| {
            if e.kind == EntryKind::File {
                info.sizes.total_size += e.size;
                if e.path.starts_with("checkpoint/") {
                    info.sizes.checkpoint_size += e.size;
                }
                if e.path == names::ROOTFS_DIFF_TAR {
                    info.sizes.root_fs_diff_size = e.size;
                }
                let small = matches!(
                    e.path.as_str(),
                    names::CONFIG_DUMP | names::SPEC_DUMP | names::MANIFEST_PATH
                );
                if small {
                    if e.size > MAX_METADATA_BYTES {
                        return Err(Error::EntryTooLarge {
                            entry: e.path.clone(),
                            size: e.size,
                            limit: MAX_METADATA_BYTES,
                        });
                    }
                    let mut d = Vec::new();
                    ent.read_to_end(&mut d).map_err(|x| Error::Tar {
                        entry: Some(e.path.clone()),
                        source: x,
                    })?;
                    match e.path.as_str() {
                        names::CONFIG_DUMP => {
                            info.config_dump = Some(
                                serde_json::from_slice::<ConfigDump>(&d)
                                    .map_err(|x| Error::json(&e.path, x))?,
                            )
                        }
                        names::SPEC_DUMP => {
                            info.spec_dump = Some(
                                serde_json::from_slice(&d).map_err(|x| Error::json(&e.path, x))?,
                            )
                        }
                        _ => info.manifest = Some(Manifest::from_json(&d, &e.path)?),
                    }
                }
            }
            info.entries.push(e);
            Ok(())
        })?;
    }
    let mut tee = ar.into_inner();
    // Whatever follows the end-of-archive blocks is part of the file and of the layer.
    io::copy(&mut tee, &mut io::sink()).map_err(|e| Error::io("reading", src, e))?;
    (tee.progress)(tee.n, tee.total);
    if info.config_dump.is_none() {
        return Err(Error::MissingEntry {
            name: names::CONFIG_DUMP.into(),
        });
    }
    if info.spec_dump.is_none() {
        return Err(Error::MissingEntry {
            name: names::SPEC_DUMP.into(),
        });
    }
    let digest = hex::encode(tee.hasher.finalize());
    Ok((digest, tee.n, Collected { info }))
}

/// Build the config, manifest and index for a layer.
fn assemble(
    layer_hex: &str,
    layer_size: u64,
    c: Collected,
    opts: &BuildOptions,
    tag: &str,
) -> Result<Built> {
    let info = c.info;
    let name = info.container_name();
    let (_, pod, ns) = info.identity();
    let cfg = info.config_dump.clone().unwrap_or_default();
    let created = info
        .manifest
        .as_ref()
        .map(|m| m.created.clone())
        .filter(|s| !s.is_empty())
        .or_else(|| Some(cfg.checkpointed_time.clone()).filter(|s| !s.is_empty()))
        .unwrap_or_else(|| cfg.created_time.clone());
    let layer_digest = format!("sha256:{layer_hex}");
    // The config is unique per checkpoint (layer digest in diff_ids, created time), so CRI never mixes
    // two checkpoint images up (it keys images by config digest).
    let config = serde_json::json!({
        "created": created,
        "architecture": go_arch(),
        "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "config": {"Labels": {ANN_CONTAINERD_NAME: name}},
        "history": [{"created": created, "created_by": "gpu-ckpt build", "comment": "checkpoint archive"}],
    });
    let config_json = serde_json::to_vec(&config).map_err(|e| Error::json("image config", e))?;
    let mut ann = BTreeMap::new();
    ann.insert(ANN_CONTAINERD_NAME.to_string(), name.clone());
    ann.insert(ANN_CRIO_NAME.to_string(), name.clone());
    ann.insert(ANN_ENGINE.to_string(), info.engine().to_string());
    if !pod.is_empty() {
        ann.insert(ANN_POD.to_string(), pod);
    }
    if !ns.is_empty() {
        ann.insert(ANN_NAMESPACE.to_string(), ns);
    }
    if !cfg.rootfs_image_name.is_empty() {
        ann.insert(
            ANN_ROOTFS_IMAGE_NAME.to_string(),
            cfg.rootfs_image_name.clone(),
        );
    }
    if !cfg.runtime.is_empty() {
        ann.insert(ANN_RUNTIME.to_string(), cfg.runtime.clone());
    }
    if !created.is_empty() {
        ann.insert(ANN_CREATED.to_string(), created.clone());
    }
    if let Some(m) = &info.manifest {
        ann.extend(compat::profile_annotations(&Profile::from_manifest(m)));
        ann.insert(keys::SCHEMA_VERSION.to_string(), SCHEMA_VERSION.to_string());
        ann.insert(
            keys::MANIFEST_DIGEST.to_string(),
            format!("sha256:{}", sha256_hex(&m.to_json())),
        );
    }
    let layer = Descriptor {
        media_type: MEDIA_LAYER_TAR.into(),
        digest: layer_digest,
        size: layer_size,
        annotations: BTreeMap::new(),
        platform: None,
    };
    let manifest = ImageManifest {
        schema_version: 2,
        media_type: MEDIA_MANIFEST.into(),
        config: Descriptor {
            media_type: MEDIA_CONFIG.into(),
            digest: format!("sha256:{}", sha256_hex(&config_json)),
            size: config_json.len() as u64,
            annotations: BTreeMap::new(),
            platform: None,
        },
        layers: vec![layer.clone()],
        annotations: ann.clone(),
    };
    let manifest_json =
        serde_json::to_vec(&manifest).map_err(|e| Error::json("image manifest", e))?;
    let manifest_digest = format!("sha256:{}", sha256_hex(&manifest_json));
    let mut idx_ann = ann;
    idx_ann.insert(ANN_REF_NAME.into(), tag.to_string());
    idx_ann.insert(ANN_CONTAINERD_IMAGE_NAME.into(), opts.reference.clone());
    let index = Index {
        schema_version: 2,
        media_type: MEDIA_INDEX.into(),
        manifests: vec![Descriptor {
            media_type: MEDIA_MANIFEST.into(),
            digest: manifest_digest.clone(),
            size: manifest_json.len() as u64,
            annotations: idx_ann,
            platform: Some(Platform {
                architecture: go_arch().into(),
                os: "linux".into(),
            }),
        }],
    };
    let index_json = serde_json::to_vec(&index).map_err(|e| Error::json("image index", e))?;
    Ok(Built {
        manifest,
        manifest_json,
        manifest_digest,
        config_json,
        index_json,
        layer,
        gpu_manifest: info.manifest,
        container_name: name,
    })
}

/// Creates or truncates `path`, mode 0600, never through a symlink.
fn private_create(path: &Path) -> Result<File> {
    fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| Error::io("creating", path, e))
}

fn write_private(path: &Path, data: &[u8]) -> Result<()> {
    let mut f = private_create(path)?;
    f.write_all(data).map_err(|e| Error::io("writing", path, e))
}

fn mkdir_private(path: &Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
        .map_err(|e| Error::io("creating", path, e))
}

/// A fresh private directory for staging an image under the temporary directory: a new random
/// name made by `mkdir` itself (never an existing directory, never through a link), mode 0700,
/// removed with everything in it when dropped.
pub fn private_temp_dir(prefix: &str) -> Result<tempfile::TempDir> {
    use std::os::unix::fs::PermissionsExt;
    let base = std::env::temp_dir();
    tempfile::Builder::new()
        .prefix(prefix)
        .permissions(fs::Permissions::from_mode(0o700))
        .tempdir_in(&base)
        .map_err(|e| Error::io("creating a private directory in", base, e))
}

/// Build an OCI layout directory at `dir` from the archive `src`.
pub fn build_layout(
    src: &Path,
    dir: &Path,
    opts: &BuildOptions,
    progress: Progress<'_>,
) -> Result<Built> {
    let tag = build_tag(opts)?;
    let blobs = dir.join("blobs").join("sha256");
    mkdir_private(&blobs)?;
    let tmp = blobs.join(format!(".layer.tmp-{}", std::process::id()));
    let res = (|| {
        let f = private_create(&tmp)?;
        let mut w = io::BufWriter::with_capacity(COPY_BUF, f);
        let (hexd, size, c) = stream_layer(src, &mut w, opts.limits, progress)?;
        w.flush().map_err(|e| Error::io("writing", &tmp, e))?;
        let built = assemble(&hexd, size, c, opts, &tag)?;
        fs::rename(&tmp, blobs.join(&hexd)).map_err(|e| Error::io("renaming", &tmp, e))?;
        write_private(
            &blobs.join(hex_of(&built.manifest.config.digest)),
            &built.config_json,
        )?;
        write_private(
            &blobs.join(hex_of(&built.manifest_digest)),
            &built.manifest_json,
        )?;
        write_private(
            &dir.join("oci-layout"),
            br#"{"imageLayoutVersion":"1.0.0"}"#,
        )?;
        write_private(&dir.join("index.json"), &built.index_json)?;
        Ok(built)
    })();
    if res.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    res
}

fn hex_of(digest: &str) -> &str {
    digest.strip_prefix("sha256:").unwrap_or(digest)
}

fn tar_header(name: &str, size: u64, dir: bool) -> Result<tar::Header> {
    let mut h = tar::Header::new_ustar();
    h.set_path(name)
        .map_err(|e| Error::io("naming tar entry", PathBuf::from(name), e))?;
    h.set_size(size);
    h.set_mode(if dir { 0o700 } else { 0o600 });
    h.set_entry_type(if dir {
        tar::EntryType::Directory
    } else {
        tar::EntryType::Regular
    });
    h.set_mtime(0);
    h.set_cksum();
    Ok(h)
}

fn pad(w: &mut dyn Write, size: u64) -> io::Result<()> {
    let rem = (size % 512) as usize;
    if rem != 0 {
        w.write_all(&[0u8; 512][..512 - rem])?;
    }
    Ok(())
}

/// Build an OCI layout tarball at `out` (what `ctr images import` takes) from the archive `src`, in one
/// pass: the layer is streamed behind a placeholder header, which is rewritten with the digest name once
/// the hash is known.
pub fn build_tarball(
    src: &Path,
    out: &Path,
    opts: &BuildOptions,
    progress: Progress<'_>,
) -> Result<Built> {
    let tag = build_tag(opts)?;
    crate::safe::write_atomically(out, |w, tmp| {
        let werr = |e: io::Error| Error::io("writing", tmp, e);
        for (d, name) in [(true, "blobs/"), (true, "blobs/sha256/")] {
            w.write_all(tar_header(name, 0, d)?.as_bytes())
                .map_err(werr)?;
        }
        let placeholder = format!("blobs/sha256/{}", "0".repeat(64));
        let expected = fs::metadata(src)
            .map_err(|e| Error::io("reading", src, e))?
            .len();
        let layer_header_at = w.stream_position().map_err(werr)?;
        w.write_all(tar_header(&placeholder, expected, false)?.as_bytes())
            .map_err(werr)?;
        let (hexd, size, c) = stream_layer(src, w, opts.limits, progress)?;
        if size != expected {
            return Err(Error::io(
                "reading",
                src,
                io::Error::other(format!(
                    "file changed size while reading ({expected} -> {size} bytes)"
                )),
            ));
        }
        pad(w, size).map_err(werr)?;
        let built = assemble(&hexd, size, c, opts, &tag)?;
        let end = w.stream_position().map_err(werr)?;
        w.seek(SeekFrom::Start(layer_header_at)).map_err(werr)?;
        w.write_all(tar_header(&format!("blobs/sha256/{hexd}"), size, false)?.as_bytes())
            .map_err(werr)?;
        w.seek(SeekFrom::Start(end)).map_err(werr)?;
        let small: [(String, &[u8]); 4] = [
            (
                format!("blobs/sha256/{}", hex_of(&built.manifest.config.digest)),
                &built.config_json,
            ),
            (
                format!("blobs/sha256/{}", hex_of(&built.manifest_digest)),
                &built.manifest_json,
            ),
            ("oci-layout".into(), br#"{"imageLayoutVersion":"1.0.0"}"#),
            ("index.json".into(), &built.index_json),
        ];
        for (name, data) in small.iter() {
            w.write_all(tar_header(name, data.len() as u64, false)?.as_bytes())
                .map_err(werr)?;
            w.write_all(data).map_err(werr)?;
            pad(w, data.len() as u64).map_err(werr)?;
        }
        w.write_all(&[0u8; 1024]).map_err(werr)?;
        Ok(built)
    })
}

/// Where an image lives: an OCI layout directory or a layout tarball.
#[derive(Debug)]
enum Source {
    Dir(PathBuf),
    Tarball(PathBuf),
}

fn source_of(path: &Path) -> Result<Source> {
    let m = fs::metadata(path).map_err(|e| Error::io("reading", path, e))?;
    Ok(if m.is_dir() {
        Source::Dir(path.to_path_buf())
    } else {
        Source::Tarball(path.to_path_buf())
    })
}

/// Calls `f` with the member `name` of the OCI layout tarball `t`; "no NAME" when it has none.
fn with_tarball_member<T>(
    t: &Path,
    name: &str,
    f: impl FnOnce(tar::Entry<'_, File>) -> Result<T>,
) -> Result<T> {
    let tar_err = |e| Error::Tar {
        entry: None,
        source: e,
    };
    let file = File::open(t).map_err(|e| Error::io("opening", t, e))?;
    let mut ar = tar::Archive::new(file);
    for ent in ar.entries_with_seek().map_err(tar_err)? {
        let ent = ent.map_err(tar_err)?;
        if crate::safe::normalize_name(&ent.path_bytes())? == name {
            return f(ent);
        }
    }
    Err(Error::oci(t.display().to_string(), format!("no {name}")))
}

/// Read a small blob (JSON) by path inside the image.
fn read_small_member(src: &Source, name: &str) -> Result<Vec<u8>> {
    match src {
        Source::Dir(d) => {
            let p = d.join(name);
            let m = fs::symlink_metadata(&p).map_err(|e| Error::io("reading", &p, e))?;
            if !m.is_file() || m.len() > MAX_METADATA_BYTES {
                return Err(Error::oci(name, "not a regular file of reasonable size"));
            }
            fs::read(&p).map_err(|e| Error::io("reading", &p, e))
        }
        Source::Tarball(t) => with_tarball_member(t, name, |ent| {
            if ent.size() > MAX_METADATA_BYTES {
                return Err(Error::EntryTooLarge {
                    entry: name.to_string(),
                    size: ent.size(),
                    limit: MAX_METADATA_BYTES,
                });
            }
            let mut v = Vec::new();
            ent.take(MAX_METADATA_BYTES)
                .read_to_end(&mut v)
                .map_err(|e| Error::Tar {
                    entry: Some(name.to_string()),
                    source: e,
                })?;
            Ok(v)
        }),
    }
}

fn blob_name(digest: &str) -> Result<String> {
    let hex = digest
        .strip_prefix("sha256:")
        .filter(|h| crate::manifest::is_sha256_hex(h))
        .ok_or_else(|| Error::oci(digest, "not a sha256 digest"))?;
    Ok(format!("blobs/sha256/{hex}"))
}

/// Read `index.json` and the (single, or first checkpoint) image manifest, verifying its digest.
pub fn read_image_manifest(image: &Path) -> Result<(ImageManifest, String)> {
    let src = source_of(image)?;
    let idx: Index = serde_json::from_slice(&read_small_member(&src, "index.json")?)
        .map_err(|e| Error::json("index.json", e))?;
    let d = idx
        .manifests
        .iter()
        .find(|d| d.media_type == MEDIA_MANIFEST || d.media_type.is_empty())
        .ok_or_else(|| Error::oci("index.json", "lists no image manifest"))?;
    let data = read_small_member(&src, &blob_name(&d.digest)?)?;
    let got = format!("sha256:{}", sha256_hex(&data));
    if got != d.digest {
        return Err(Error::DigestMismatch {
            name: blob_name(&d.digest)?,
            algorithm: "sha256",
            expected: d.digest.clone(),
            actual: got,
        });
    }
    let m: ImageManifest =
        serde_json::from_slice(&data).map_err(|e| Error::json("image manifest", e))?;
    Ok((m, d.digest.clone()))
}

/// Compatibility profile from an image's manifest annotations, without reading the layer.
pub fn image_profile(image: &Path) -> Result<Option<Profile>> {
    let (m, _) = read_image_manifest(image)?;
    Ok(compat::profile_from_annotations(&m.annotations))
}

/// Write the checkpoint archive held in an image back to `out` (mode 0600), verifying the layer digest
/// while copying. For our images (uncompressed layer) the result is byte-identical to the archive the
/// image was built from.
pub fn extract_archive_from_image(
    image: &Path,
    out: &Path,
    limits: Limits,
    progress: Progress<'_>,
) -> Result<u64> {
    crate::safe::write_atomically(out, |w, _| write_layer(image, w, limits, progress))
}

/// Stream the checkpoint archive held in an image into `w`, verifying the layer digest (and size)
/// while copying. The layer is read no further than the size its manifest declares, and a
/// compressed layer is decompressed to at most `limits.max_total_bytes`: a larger one is refused
/// naming the limit. Returns the bytes written.
pub fn write_layer(
    image: &Path,
    w: &mut dyn Write,
    limits: Limits,
    progress: Progress<'_>,
) -> Result<u64> {
    let src = source_of(image)?;
    let (m, _) = read_image_manifest(image)?;
    if !m.annotations.contains_key(ANN_CONTAINERD_NAME)
        && !m.annotations.contains_key(ANN_CRIO_NAME)
    {
        return Err(Error::oci(
            image.display().to_string(),
            "manifest has no checkpoint annotation (not a checkpoint image)",
        ));
    }
    let [layer] = &m.layers[..] else {
        return Err(Error::oci(
            image.display().to_string(),
            format!("expected one layer, found {}", m.layers.len()),
        ));
    };
    let gz = match layer.media_type.as_str() {
        MEDIA_LAYER_TAR | "application/vnd.docker.image.rootfs.diff.tar" => false,
        MEDIA_LAYER_TAR_GZIP | "application/vnd.docker.image.rootfs.diff.tar.gzip" => true,
        other => {
            return Err(Error::oci(
                "layer",
                format!("unsupported media type {other}"),
            ))
        }
    };
    let name = blob_name(&layer.digest)?;
    let copy = |r: &mut dyn Read, w: &mut dyn Write, progress: Progress<'_>| -> Result<u64> {
        // Hash the blob as stored (compressed or not), write the tar. One byte past the declared
        // size is read, to see that there is more.
        let mut hr = crate::digest::HashingReader::new(r.take(layer.size.saturating_add(1)));
        let n = if gz {
            let limit = limits.max_total_bytes;
            let mut dec = flate2::read::GzDecoder::new(&mut hr).take(limit.saturating_add(1));
            let n = crate::digest::copy_hashing(&mut dec, w, 0, progress)
                .map_err(|e| Error::io("decompressing layer of", image, e))?
                .1;
            if n > limit {
                return Err(Error::oci(
                    name.clone(),
                    format!(
                        "gzip layer of {} bytes decompresses to more than the limit of {limit} bytes",
                        layer.size
                    ),
                ));
            }
            n
        } else {
            crate::digest::copy_hashing(&mut hr, w, layer.size, progress)
                .map_err(|e| Error::io("copying layer of", image, e))?
                .1
        };
        io::copy(&mut hr, &mut io::sink()).map_err(|e| Error::io("reading layer of", image, e))?;
        let (hexd, size, _) = hr.finish();
        let got = format!("sha256:{hexd}");
        if got != layer.digest || size != layer.size {
            return Err(Error::DigestMismatch {
                name: name.clone(),
                algorithm: "sha256",
                expected: format!("{} ({} bytes)", layer.digest, layer.size),
                actual: format!("{got} ({size} bytes)"),
            });
        }
        Ok(n)
    };
    let n = match &src {
        Source::Dir(d) => {
            let p = d.join(&name);
            let mut f = File::open(&p).map_err(|e| Error::io("opening", &p, e))?;
            copy(&mut f, w, progress)?
        }
        Source::Tarball(t) => {
            let f = File::open(t).map_err(|e| Error::io("opening", t, e))?;
            let mut ar = tar::Archive::new(f);
            let mut found = None;
            for ent in ar.entries_with_seek().map_err(|e| Error::Tar {
                entry: None,
                source: e,
            })? {
                let mut ent = ent.map_err(|e| Error::Tar {
                    entry: None,
                    source: e,
                })?;
                if crate::safe::normalize_name(&ent.path_bytes())? == name {
                    found = Some(copy(&mut ent, w, progress)?);
                    break;
                }
            }
            found.ok_or_else(|| Error::oci(t.display().to_string(), format!("no {name}")))?
        }
    };
    Ok(n)
}

/// Verify an image's layer against its digest without writing anything.
pub fn verify_image(image: &Path, limits: Limits, progress: Progress<'_>) -> Result<u64> {
    write_layer(image, &mut io::sink(), limits, progress)
}

/// Reads the blob `digest` of an image (layout directory or tarball), at most `limit` bytes,
/// and checks it against its digest.
pub fn read_image_blob(image: &Path, digest: &str, limit: u64) -> Result<Vec<u8>> {
    let src = source_of(image)?;
    let name = blob_name(digest)?;
    let data = read_small_member(&src, &name)?;
    if data.len() as u64 > limit {
        return Err(Error::EntryTooLarge {
            entry: name,
            size: data.len() as u64,
            limit,
        });
    }
    let got = format!("sha256:{}", sha256_hex(&data));
    if got != digest {
        return Err(Error::DigestMismatch {
            name,
            algorithm: "sha256",
            expected: digest.to_string(),
            actual: got,
        });
    }
    Ok(data)
}

/// Where the blob `digest` of an image lies: a file and the offset of the blob in it (a layout
/// directory's blob file at 0, or the member's data inside a layout tarball).
pub fn blob_location(image: &Path, digest: &str) -> Result<(PathBuf, u64)> {
    let name = blob_name(digest)?;
    match source_of(image)? {
        Source::Dir(d) => {
            let p = d.join(&name);
            let m = fs::symlink_metadata(&p).map_err(|e| Error::io("reading", &p, e))?;
            if !m.is_file() {
                return Err(Error::oci(name, "not a regular file"));
            }
            Ok((p, 0))
        }
        Source::Tarball(t) => {
            let at = with_tarball_member(&t, &name, |ent| Ok(ent.raw_file_position()))?;
            Ok((t, at))
        }
    }
}

/// Is `path` an OCI image (a layout directory, or a tarball holding `oci-layout` and `index.json`)
/// rather than a checkpoint archive?
pub fn is_image(path: &Path) -> bool {
    match fs::metadata(path) {
        Ok(m) if m.is_dir() => path.join("index.json").is_file(),
        Ok(_) => {
            let Ok(f) = File::open(path) else {
                return false;
            };
            let mut ar = tar::Archive::new(f);
            let Ok(entries) = ar.entries_with_seek() else {
                return false;
            };
            let mut seen = 0;
            for ent in entries.take(64) {
                let Ok(ent) = ent else { return false };
                match crate::safe::normalize_name(&ent.path_bytes()).as_deref() {
                    Ok("oci-layout") | Ok("index.json") => seen += 1,
                    Ok("config.dump") | Ok("spec.dump") => return false,
                    _ => {}
                }
                if seen == 2 {
                    return true;
                }
            }
            false
        }
        Err(_) => false,
    }
}
