//! Signed manifests: an Ed25519 signature over the manifest's canonical form, the node key that
//! makes it, and the set of public keys a node trusts.
//!
//! What is signed is the manifest (`gpu-ckpt-manifest.json`) without its `signature` field, in a
//! canonical form (see [`canonical_json`]) behind a domain prefix. The manifest lists the size and
//! digests of every other file of the checkpoint directory (CRIU's images, device state, the
//! shim's copy of the container's rootfs changes), so the one signature covers all of them
//! without hashing anything twice: a file is checked against the signed digest as it is read.
//!
//! Keys: a node's key is 32 random bytes (an Ed25519 seed) in hex, in a root-only file
//! (`node.key`, 0600, in a 0700 directory) made on first use; its public key is written beside
//! it (`node.pub`). A public key file holds the 32-byte key in hex (64 digits), optionally after
//! `ed25519:`. The private key is read only to sign ([`NodeKey::load`], [`NodeKey::load_or_create`]),
//! through a directory handle and `O_NOFOLLOW`, and only if it and its directory are the
//! running user's (root's) and closed to others; checking a signature reads `node.pub`
//! ([`node_public_key`]).
//!
//! Rotation ([`rotate`]) makes a new key and keeps the former public key beside it as
//! `retired-<id>.pub`; revocation ([`revoke`], [`read_revoked`]) lists key ids in a file (by
//! default `revoked` in the key directory), and a revoked key is refused even where it is
//! trusted ([`TrustedKeys::status`]).

use std::{
    fs,
    io::Write,
    os::unix::fs::{DirBuilderExt, OpenOptionsExt},
    path::{Path, PathBuf},
};

use ed25519_dalek::{Signer as _, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// The one algorithm this version signs and accepts.
pub const ALGORITHM: &str = "ed25519";
/// Prefix of every signed payload, so a signature made here means nothing anywhere else.
pub const DOMAIN: &[u8] = b"gpu-ckpt.io/manifest-signature/v1\n";
/// Where a node keeps its key when nothing else is configured.
pub const DEFAULT_KEY_DIR: &str = "/var/lib/gpu-ckpt/keys";
/// The private key's file name in a key directory.
pub const NODE_KEY_FILE: &str = "node.key";
/// The public key's file name beside it.
pub const NODE_PUB_FILE: &str = "node.pub";
/// The prefix of a retired node key's public key file (see [`rotate`]).
pub const RETIRED_PREFIX: &str = "retired-";
/// The revoked-keys list's file name in a key directory (the shim's default
/// `RevokedKeysFile`, beside its `SigningKey`).
pub const REVOKED_FILE: &str = "revoked";
/// The manifest's field that holds the signature (left out of what is signed).
pub const SIGNATURE_FIELD: &str = "signature";

/// The `signature` field of a manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Signature {
    /// Always [`ALGORITHM`].
    pub algorithm: String,
    /// The signer's public key, 64 lower-case hex digits.
    pub public_key: String,
    /// The signature, 128 lower-case hex digits.
    pub value: String,
}

/// Who signed a manifest whose signature checked out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signer {
    pub public_key: [u8; 32],
}

impl Signer {
    /// A short, stable name for the key: `ed25519:` and the first 16 bytes of the sha256 of the
    /// public key, in hex.
    pub fn key_id(&self) -> String {
        key_id(&self.public_key)
    }

    pub fn public_key_hex(&self) -> String {
        hex::encode(self.public_key)
    }
}

/// `ed25519:<hex of the first 16 bytes of sha256(public key)>`.
pub fn key_id(public_key: &[u8; 32]) -> String {
    let d = Sha256::digest(public_key);
    format!("{ALGORITHM}:{}", hex::encode(&d[..16]))
}

/// Writes `v` in canonical form: object keys in byte order, no white space, strings and numbers
/// as serde_json writes them (one spelling each).
pub fn canonical_json(v: &serde_json::Value, out: &mut Vec<u8>) {
    use serde_json::Value;
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push(b'{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                // Serializing a string or a Value to a Vec cannot fail.
                let _ = serde_json::to_writer(&mut *out, k);
                out.push(b':');
                canonical_json(&map[k], out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                canonical_json(item, out);
            }
            out.push(b']');
        }
        other => {
            let _ = serde_json::to_writer(&mut *out, other);
        }
    }
}

/// What the signature of the manifest document `json` covers: [`DOMAIN`], then the canonical
/// form of the document without its `signature` field. Also returns that field, if any.
pub fn signed_payload(json: &[u8]) -> Result<(Vec<u8>, Option<serde_json::Value>)> {
    let mut v: serde_json::Value =
        serde_json::from_slice(json).map_err(|e| Error::json("manifest", e))?;
    let obj = v.as_object_mut().ok_or_else(|| Error::Signature {
        reason: "the manifest is not a json object".into(),
    })?;
    let sig = obj.remove(SIGNATURE_FIELD).filter(|s| !s.is_null());
    let mut out = DOMAIN.to_vec();
    canonical_json(&v, &mut out);
    Ok((out, sig))
}

/// A node's private key.
pub struct NodeKey {
    key: SigningKey,
    path: PathBuf,
}

impl std::fmt::Debug for NodeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeKey")
            .field("path", &self.path)
            .field("key_id", &key_id(&self.public_key()))
            .finish()
    }
}

fn key_err(path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::Key {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

/// The user this process runs as: root for the shim, which owns the node's key.
fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Who may touch a key file or its directory.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Access {
    /// Its owner only: the private key (0600) and its directory (0700).
    Private,
    /// Readable by all, written by its owner only: public keys, the revoked-keys list and
    /// the directory a list lies in.
    Public,
}

/// Refuses `meta` (of `path`, a `what`) unless it belongs to the user this process runs as (or,
/// for a public file, to root) and its mode keeps others out as `access` says.
fn check_owner(meta: &fs::Metadata, path: &Path, what: &str, access: Access) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    if meta.uid() != euid() && !(access == Access::Public && meta.uid() == 0) {
        return Err(key_err(
            path,
            format!(
                "{what} is owned by uid {}, not by uid {} that runs this program (root for the shim)",
                meta.uid(),
                euid()
            ),
        ));
    }
    let mode = meta.mode() & 0o7777;
    match access {
        Access::Private if mode & 0o077 != 0 => Err(key_err(
            path,
            format!(
                "mode {mode:o}: {what} must be open to its owner only (0600 for a private key, 0700 for its directory)"
            ),
        )),
        Access::Public if mode & 0o022 != 0 => Err(key_err(
            path,
            format!("mode {mode:o}: {what} must not be writable by group or others"),
        )),
        _ => Ok(()),
    }
}

/// A key's directory, opened without following a link (`O_NOFOLLOW`) and checked: a directory
/// of the user this process runs as, closed to others as its [`Access`] says. Every file in it
/// is opened relative to this handle, again without following a link, so a path swapped after
/// the check cannot redirect a read or a write.
struct KeyDir {
    fd: fs::File,
    path: PathBuf,
}

impl KeyDir {
    fn open(path: &Path, access: Access) -> Result<KeyDir> {
        let fd = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| key_err(path, format!("open directory (a link is refused): {e}")))?;
        let meta = fd
            .metadata()
            .map_err(|e| key_err(path, format!("stat directory: {e}")))?;
        check_owner(&meta, path, "the key directory", access)?;
        Ok(KeyDir {
            fd,
            path: path.to_path_buf(),
        })
    }

    /// Opens the private key directory `path`, making it (and its parents) 0700 if missing.
    fn create(path: &Path) -> Result<KeyDir> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(path)
            .map_err(|e| key_err(path, format!("create directory: {e}")))?;
        Self::open(path, Access::Private)
    }

    fn cname(&self, name: &str) -> Result<std::ffi::CString> {
        std::ffi::CString::new(name).map_err(|_| key_err(&self.path.join(name), "NUL in name"))
    }

    /// Reads the file `name` (at most `limit` bytes): `None` when there is none. A link, anything
    /// but a regular file, a file of another user or open to others as `access` says (and, for
    /// a private key, one with another name linked to it) is refused.
    fn read(&self, name: &str, access: Access, limit: u64) -> Result<Option<String>> {
        use std::io::Read;
        use std::os::fd::{AsRawFd, FromRawFd};
        use std::os::unix::fs::MetadataExt;
        let path = self.path.join(name);
        let c = self.cname(name)?;
        // SAFETY: a valid directory fd and NUL-terminated name; the result is checked.
        // O_NONBLOCK: a fifo put there does not hang the open.
        let fd = unsafe {
            libc::openat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK,
            )
        };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::NotFound {
                return Ok(None);
            }
            return Err(key_err(&path, format!("open (a link is refused): {e}")));
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let f = unsafe { fs::File::from_raw_fd(fd) };
        let meta = f.metadata().map_err(|e| key_err(&path, e))?;
        if !meta.file_type().is_file() {
            return Err(key_err(&path, "not a regular file"));
        }
        let what = match access {
            Access::Private => "a private key",
            Access::Public => "the file",
        };
        check_owner(&meta, &path, what, access)?;
        if access == Access::Private && meta.nlink() != 1 {
            return Err(key_err(
                &path,
                format!(
                    "{} names for one private key: a key must have no other link",
                    meta.nlink()
                ),
            ));
        }
        if meta.len() > limit {
            return Err(key_err(
                &path,
                format!(
                    "{} bytes, more than the {limit} a key file may have",
                    meta.len()
                ),
            ));
        }
        let mut text = String::new();
        f.take(limit)
            .read_to_string(&mut text)
            .map_err(|e| key_err(&path, e))?;
        Ok(Some(text))
    }

    /// Writes `body` as `name` (mode `mode`): whole under a temporary name, synced, then renamed
    /// into place, replacing what is there when `replace`, else only where nothing is (`false`
    /// then: another writer was first, and its file stays).
    fn write(&self, name: &str, body: &str, mode: u32, replace: bool) -> Result<bool> {
        use std::os::fd::{AsRawFd, FromRawFd};
        let path = self.path.join(name);
        // A name of this writer's own: another process or thread may write the same file.
        let mut nonce = [0u8; 8];
        getrandom::fill(&mut nonce).map_err(|e| key_err(&path, format!("random bytes: {e}")))?;
        let tmp = format!(".{name}.tmp-{}-{}", std::process::id(), hex::encode(nonce));
        let (c, ctmp) = (self.cname(name)?, self.cname(&tmp)?);
        let dir = self.fd.as_raw_fd();
        // SAFETY (all libc calls below): a valid directory fd and NUL-terminated names;
        // results are checked.
        let written = (|| -> std::io::Result<bool> {
            let fd = unsafe {
                libc::openat(
                    dir,
                    ctmp.as_ptr(),
                    libc::O_WRONLY
                        | libc::O_CREAT
                        | libc::O_EXCL
                        | libc::O_NOFOLLOW
                        | libc::O_CLOEXEC,
                    mode as libc::c_uint,
                )
            };
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // SAFETY: a fresh descriptor nothing else owns.
            let mut f = unsafe { fs::File::from_raw_fd(fd) };
            f.write_all(body.as_bytes())?;
            f.sync_all()?;
            let flags = if replace { 0 } else { libc::RENAME_NOREPLACE };
            let r = unsafe { libc::renameat2(dir, ctmp.as_ptr(), dir, c.as_ptr(), flags) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if !replace && e.kind() == std::io::ErrorKind::AlreadyExists {
                    return Ok(false);
                }
                return Err(e);
            }
            self.fd.sync_all()?;
            Ok(true)
        })();
        unsafe { libc::unlinkat(dir, ctmp.as_ptr(), 0) };
        written.map_err(|e| key_err(&path, format!("write: {e}")))
    }

    fn read_key(&self, name: &str) -> Result<Option<NodeKey>> {
        let path = self.path.join(name);
        let Some(text) = self.read(name, Access::Private, MAX_KEY_FILE_BYTES)? else {
            return Ok(None);
        };
        let seed = parse_hex32(text.trim())
            .ok_or_else(|| key_err(&path, "not 64 hex digits (an Ed25519 seed)"))?;
        Ok(Some(NodeKey {
            key: SigningKey::from_bytes(&seed),
            path,
        }))
    }

    fn read_public(&self, name: &str) -> Result<Option<[u8; 32]>> {
        self.read(name, Access::Public, MAX_KEY_FILE_BYTES)?
            .map(|text| parse_public_key(&text, &self.path.join(name)))
            .transpose()
    }
}

/// The largest key file read (a key is 65 bytes).
const MAX_KEY_FILE_BYTES: u64 = 4096;
/// The largest revoked-keys list read.
const MAX_REVOKED_BYTES: u64 = 1 << 20;

/// The directory and file name of the key file `path`.
fn split_key_path(path: &Path) -> Result<(&Path, &str)> {
    match (path.parent(), path.file_name().and_then(|n| n.to_str())) {
        (Some(dir), Some(name)) if !dir.as_os_str().is_empty() => Ok((dir, name)),
        _ => Err(key_err(path, "expected an absolute path to a file")),
    }
}

/// The public key file beside the private key `key_path` ([`NODE_PUB_FILE`]).
pub fn public_key_path(key_path: &Path) -> PathBuf {
    key_path.with_file_name(NODE_PUB_FILE)
}

/// The file name a rotation keeps a node's former public key under, in its key directory:
/// `retired-<the key id's hex>.pub`.
pub fn retired_key_name(public_key: &[u8; 32]) -> String {
    let id = key_id(public_key);
    format!(
        "{RETIRED_PREFIX}{}.pub",
        id.trim_start_matches(&format!("{ALGORITHM}:"))
    )
}

/// 32 bytes (a public key, or a private key's seed) as a key file holds them: hex, one line.
fn key_text(key: &[u8; 32]) -> String {
    format!("{}\n", hex::encode(key))
}

fn new_seed(path: &Path) -> Result<[u8; 32]> {
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed).map_err(|e| key_err(path, format!("random bytes: {e}")))?;
    Ok(seed)
}

impl NodeKey {
    /// Reads the key at `path`, or makes one there if there is none: its directory 0700, the
    /// key 0600 (written whole under a temporary name and renamed into place only where no key
    /// is, so two shims that start at once end with one key), and the public key beside it as
    /// [`NODE_PUB_FILE`].
    pub fn load_or_create(path: &Path) -> Result<NodeKey> {
        let (dir_path, name) = split_key_path(path)?;
        let dir = KeyDir::create(dir_path)?;
        if let Some(key) = dir.read_key(name)? {
            return Ok(key);
        }
        let made = dir.write(name, &key_text(&new_seed(path)?), 0o600, false)?;
        let key = dir
            .read_key(name)?
            .ok_or_else(|| key_err(path, "vanished after it was made"))?;
        if made {
            dir.write(NODE_PUB_FILE, &key_text(&key.public_key()), 0o644, true)?;
        }
        Ok(key)
    }

    /// Reads an existing key. Refused: a link (it is opened with `O_NOFOLLOW` below its
    /// directory, itself opened so), a key or directory of another user than the one this runs
    /// as (root, for the shim), a key others may read (it must be 0600 or stricter, its
    /// directory 0700), a key with a second name (hard link).
    pub fn load(path: &Path) -> Result<NodeKey> {
        let (dir, name) = split_key_path(path)?;
        KeyDir::open(dir, Access::Private)?
            .read_key(name)?
            .ok_or_else(|| key_err(path, "no such file"))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn public_key(&self) -> [u8; 32] {
        self.key.verifying_key().to_bytes()
    }

    /// Signs the manifest document `json` (its `signature` field, if any, is left out).
    pub fn sign_json(&self, json: &[u8]) -> Result<Signature> {
        let (payload, _) = signed_payload(json)?;
        let sig = self.key.sign(&payload);
        Ok(Signature {
            algorithm: ALGORITHM.into(),
            public_key: hex::encode(self.public_key()),
            value: hex::encode(sig.to_bytes()),
        })
    }

    /// Signs `m` in place: its `signature` is replaced by one over the rest of it.
    pub fn sign_manifest(&self, m: &mut crate::Manifest) -> Result<()> {
        m.signature = None;
        m.signature = Some(self.sign_json(&m.to_json())?);
        Ok(())
    }
}

/// The node's public key for the private key at `key_path`, from [`NODE_PUB_FILE`] beside it,
/// so that checking a signature never reads the private key. A node without a key makes one
/// (as at its first checkpoint); one whose public key file is missing gets it written again.
pub fn node_public_key(key_path: &Path) -> Result<[u8; 32]> {
    let (dir_path, _) = split_key_path(key_path)?;
    let dir = KeyDir::create(dir_path)?;
    if let Some(key) = dir.read_public(NODE_PUB_FILE)? {
        return Ok(key);
    }
    let key = NodeKey::load_or_create(key_path)?.public_key();
    dir.write(NODE_PUB_FILE, &key_text(&key), 0o644, false)?;
    Ok(key)
}

/// What [`rotate`] did.
#[derive(Debug)]
pub struct Rotation {
    /// The new key.
    pub key: NodeKey,
    /// Its public key file.
    pub public_path: PathBuf,
    /// The former public key and the file it is kept in, if the directory had a key.
    pub retired: Option<([u8; 32], PathBuf)>,
}

/// Replaces the node key at `key_path` with a new one. The former public key is kept in the key
/// directory as [`retired_key_name`] (so that checkpoints signed before still verify: this node
/// trusts its retired keys until they are revoked, other nodes where the operator keeps the file
/// in their `TrustedKeysDir`); the former private key is gone. In that order: the retired public
/// key, the new public key, the new private key, each renamed into place whole, so that a
/// checkpoint signed while this runs verifies on this node.
pub fn rotate(key_path: &Path) -> Result<Rotation> {
    let (dir_path, name) = split_key_path(key_path)?;
    let dir = KeyDir::create(dir_path)?;
    let old = match dir.read_public(NODE_PUB_FILE)? {
        Some(k) => Some(k),
        None => dir.read_key(name)?.map(|k| k.public_key()),
    };
    let retired = match old {
        Some(old) => {
            let retired = retired_key_name(&old);
            dir.write(&retired, &key_text(&old), 0o644, true)?;
            Some((old, dir_path.join(retired)))
        }
        None => None,
    };
    let seed = new_seed(key_path)?;
    let public = SigningKey::from_bytes(&seed).verifying_key().to_bytes();
    dir.write(NODE_PUB_FILE, &key_text(&public), 0o644, true)?;
    dir.write(name, &key_text(&seed), 0o600, true)?;
    let key = dir
        .read_key(name)?
        .ok_or_else(|| key_err(key_path, "vanished after it was made"))?;
    Ok(Rotation {
        key,
        public_path: dir_path.join(NODE_PUB_FILE),
        retired,
    })
}

fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    let bytes = hex::decode(s).ok()?;
    bytes.try_into().ok()
}

/// Checks the signature of the manifest document `json`. `Ok(None)`: the manifest is unsigned.
/// An error: it carries a signature that is malformed or does not match its content (a changed
/// byte anywhere in the manifest, including the digests of the files it lists).
pub fn verify_json(json: &[u8]) -> Result<Option<Signer>> {
    let (payload, sig) = signed_payload(json)?;
    let Some(sig) = sig else {
        return Ok(None);
    };
    let sig: Signature = serde_json::from_value(sig).map_err(|e| Error::Signature {
        reason: format!("malformed signature field: {e}"),
    })?;
    if sig.algorithm != ALGORITHM {
        return Err(Error::Signature {
            reason: format!(
                "algorithm {:?} is not supported (expected {ALGORITHM:?})",
                sig.algorithm
            ),
        });
    }
    let public_key = parse_hex32(&sig.public_key).ok_or_else(|| Error::Signature {
        reason: "public_key is not 64 hex digits".into(),
    })?;
    let value: [u8; 64] = hex::decode(&sig.value)
        .ok()
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| Error::Signature {
            reason: "value is not 128 hex digits".into(),
        })?;
    let key = VerifyingKey::from_bytes(&public_key).map_err(|_| Error::Signature {
        reason: "public_key is not an Ed25519 key".into(),
    })?;
    key.verify_strict(&payload, &ed25519_dalek::Signature::from_bytes(&value))
        .map_err(|_| Error::Signature {
            reason: format!(
                "does not match the manifest (signed by {}): the manifest, or a digest it lists, was changed after signing",
                key_id(&public_key)
            ),
        })?;
    Ok(Some(Signer { public_key }))
}

/// Parses the text of a public key file `path`: 64 hex digits, optionally after `ed25519:`.
fn parse_public_key(text: &str, path: &Path) -> Result<[u8; 32]> {
    let t = text.trim();
    let t = t.strip_prefix("ed25519:").unwrap_or(t);
    let key =
        parse_hex32(t).ok_or_else(|| key_err(path, "not an Ed25519 public key (64 hex digits)"))?;
    VerifyingKey::from_bytes(&key).map_err(|_| key_err(path, "not an Ed25519 public key"))?;
    Ok(key)
}

/// Reads a public key file: 64 hex digits, optionally after `ed25519:`.
pub fn read_public_key(path: &Path) -> Result<[u8; 32]> {
    let text = fs::read_to_string(path).map_err(|e| key_err(path, e))?;
    parse_public_key(&text, path)
}

/// The key id that `s` names: a key id itself (`ed25519:` and 32 hex digits), or a public key
/// (64 hex digits, optionally after `ed25519:`). `None` for anything else.
pub fn parse_key_ref(s: &str) -> Option<String> {
    let t = s.strip_prefix("ed25519:").unwrap_or(s);
    if t.len() == 32 && t.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Some(format!("{ALGORITHM}:{}", t.to_ascii_lowercase()));
    }
    parse_hex32(t).map(|k| key_id(&k))
}

/// Whether a node restores checkpoints signed by a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyStatus<'a> {
    /// Trusted, from where (the node's own key, a retired one, a `TrustedKeysDir` file).
    Trusted(&'a str),
    /// Revoked: where it is listed (`FILE line N`). Revocation wins over trust.
    Revoked(&'a str),
    /// Neither trusted nor revoked.
    Untrusted,
}

/// The public keys a node trusts, each with where it came from, and the key ids it revoked.
#[derive(Debug, Clone, Default)]
pub struct TrustedKeys {
    keys: Vec<([u8; 32], String)>,
    revoked: Vec<(String, String)>,
}

impl TrustedKeys {
    /// Trusts `key` (described as `source`).
    pub fn add(&mut self, key: [u8; 32], source: impl Into<String>) {
        if !self.keys.iter().any(|(k, _)| *k == key) {
            self.keys.push((key, source.into()));
        }
    }

    /// Adds every `*.pub` file of `dir`. A file that is not a public key is an error naming it.
    pub fn add_dir(&mut self, dir: &Path) -> Result<()> {
        for p in pub_files(dir, "")? {
            let key = read_public_key(&p)?;
            self.add(key, p.display().to_string());
        }
        Ok(())
    }

    /// Trusts the node key whose private key is `key_path`, given its public key `public`, and
    /// the node's retired keys (the `retired-*.pub` files [`rotate`] left in its directory).
    pub fn add_node_keys(&mut self, key_path: &Path, public: [u8; 32]) -> Result<()> {
        self.add(public, format!("this node's key {}", key_path.display()));
        let (dir, _) = split_key_path(key_path)?;
        for p in pub_files(dir, RETIRED_PREFIX)? {
            let key = read_public_key(&p)?;
            self.add(key, format!("this node's retired key {}", p.display()));
        }
        Ok(())
    }

    /// Revokes every key the list `path` names (see [`read_revoked`]); a missing file revokes
    /// nothing.
    pub fn add_revoked(&mut self, path: &Path) -> Result<()> {
        for (id, line) in read_revoked(path)? {
            let at = format!("{} line {line}", path.display());
            if !self.revoked.iter().any(|(r, _)| *r == id) {
                self.revoked.push((id, at));
            }
        }
        Ok(())
    }

    /// Whether `signer`'s key is revoked, trusted (and from where), or neither.
    pub fn status(&self, signer: &Signer) -> KeyStatus<'_> {
        let id = signer.key_id();
        if let Some((_, at)) = self.revoked.iter().find(|(r, _)| *r == id) {
            return KeyStatus::Revoked(at);
        }
        match self.keys.iter().find(|(k, _)| *k == signer.public_key) {
            Some((_, how)) => KeyStatus::Trusted(how),
            None => KeyStatus::Untrusted,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// The `*.pub` files of `dir` whose names start with `prefix`, sorted.
fn pub_files(dir: &Path, prefix: &str) -> Result<Vec<PathBuf>> {
    let entries = fs::read_dir(dir).map_err(|e| key_err(dir, format!("read directory: {e}")))?;
    let mut paths: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.extension().is_some_and(|x| x == "pub")
                && p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(prefix))
        })
        .collect();
    paths.sort();
    Ok(paths)
}

/// The revoked-keys list `path`: one key a line, as a key id (`ed25519:` and 32 hex digits, as
/// `gpu-ckpt verify` prints it) or a public key (64 hex digits, optionally after `ed25519:`);
/// `#` starts a comment, blank lines are skipped. Returns each key id with its line number. A
/// missing file is an empty list; a link, a file or directory others may write, or a line that
/// names no key is an error naming the file and line (a list that cannot be read revokes
/// nothing, so nothing is trusted: the restore fails).
pub fn read_revoked(path: &Path) -> Result<Vec<(String, usize)>> {
    let (dir, name) = split_key_path(path)?;
    let dir = match KeyDir::open(dir, Access::Public) {
        Err(_) if !dir.exists() => return Ok(Vec::new()),
        other => other?,
    };
    let Some(text) = dir.read(name, Access::Public, MAX_REVOKED_BYTES)? else {
        return Ok(Vec::new());
    };
    parse_revoked(&text, path)
}

fn parse_revoked(text: &str, path: &Path) -> Result<Vec<(String, usize)>> {
    let mut ids = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let entry = line.split('#').next().unwrap_or_default().trim();
        let Some(first) = entry.split_whitespace().next() else {
            continue;
        };
        let id = parse_key_ref(first).ok_or_else(|| {
            key_err(
                path,
                format!(
                    "line {}: {first:?} is neither a key id ({ALGORITHM}: and 32 hex digits) nor a public key (64 hex digits)",
                    i + 1
                ),
            )
        })?;
        ids.push((id, i + 1));
    }
    Ok(ids)
}

/// Adds the key `entry` names (a key id, a public key, or a public key file) to the revoked-keys
/// list `path`, with the date in a comment; the list is written whole and renamed into place,
/// its directory must exist. Returns the key id, and whether it was listed already (then the
/// file is left as it is).
pub fn revoke(path: &Path, entry: &str) -> Result<(String, bool)> {
    let (id, from) = match parse_key_ref(entry) {
        Some(id) => (id, String::new()),
        None => {
            let key = read_public_key(Path::new(entry))?;
            (key_id(&key), format!(", public key {entry}"))
        }
    };
    let (dir_path, name) = split_key_path(path)?;
    let dir = KeyDir::open(dir_path, Access::Public)?;
    let mut text = dir
        .read(name, Access::Public, MAX_REVOKED_BYTES)?
        .unwrap_or_default();
    if parse_revoked(&text, path)?.iter().any(|(r, _)| *r == id) {
        return Ok((id, true));
    }
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    let now = humantime::format_rfc3339_seconds(std::time::SystemTime::now());
    text.push_str(&format!("{id}  # revoked {now}{from}\n"));
    dir.write(name, &text, 0o644, true)?;
    Ok((id, false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn manifest() -> crate::Manifest {
        let mut m = crate::Manifest::new(
            "2025-01-01T00:00:00Z",
            crate::manifest::Container {
                id: "c1".into(),
                name: "counter".into(),
                pod_namespace: "default".into(),
                ..Default::default()
            },
            Default::default(),
            Default::default(),
            Default::default(),
        );
        m.files.insert(
            "pages-1.img".into(),
            crate::manifest::FileDigest {
                size: 4096,
                sha256: String::new(),
                blake3: "ab".repeat(32),
            },
        );
        m.add_timing("criu-dump", 1.0 / 3.0);
        m
    }

    fn key(dir: &Path) -> NodeKey {
        NodeKey::load_or_create(&dir.join("keys").join(NODE_KEY_FILE)).unwrap()
    }

    #[test]
    fn canonical_form_sorts_keys_and_drops_white_space() {
        let v: serde_json::Value =
            serde_json::from_str(r#"{ "b": [1, {"z": true, "a": null}], "a": "x\"y", "c": 1.5 }"#)
                .unwrap();
        let mut out = Vec::new();
        canonical_json(&v, &mut out);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            r#"{"a":"x\"y","b":[1,{"a":null,"z":true}],"c":1.5}"#
        );
        // The signature field is left out; the order of the document does not matter.
        let (a, sig) = signed_payload(br#"{"x":1,"y":2,"signature":{"k":1}}"#).unwrap();
        let (b, none) = signed_payload(b"{\n  \"y\": 2,\n  \"x\": 1\n}").unwrap();
        assert_eq!(a, b);
        assert!(sig.is_some() && none.is_none());
        assert!(a.starts_with(DOMAIN));
    }

    #[test]
    fn signed_manifest_verifies_and_any_change_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let k = key(dir.path());
        let mut m = manifest();
        k.sign_manifest(&mut m).unwrap();
        let json = m.to_json();
        let signer = verify_json(&json).unwrap().unwrap();
        assert_eq!(signer.public_key, k.public_key());
        // Parsed and written again, it still verifies (floats included).
        let again = crate::Manifest::from_json(&json, "m").unwrap();
        assert_eq!(again.signature, m.signature);
        assert!(verify_json(&again.to_json()).unwrap().is_some());
        // One changed byte anywhere: a value, a digest, the signature itself.
        for (from, to) in [
            ("\"default\"", "\"tenant-b\""),
            (&"ab".repeat(32)[..], &format!("ac{}", "ab".repeat(31))[..]),
            ("\"counter\"", "\"counteR\""),
        ] {
            let text = String::from_utf8(json.clone()).unwrap();
            assert!(text.contains(from), "{from}");
            let changed = text.replacen(from, to, 1);
            let err = verify_json(changed.as_bytes()).unwrap_err().to_string();
            assert!(err.contains("does not match"), "{err}");
        }
        let mut bad = m.clone();
        let sig = bad.signature.as_mut().unwrap();
        sig.value = format!("00{}", &sig.value[2..]);
        assert!(verify_json(&bad.to_json()).is_err());
        // Unsigned.
        assert!(verify_json(&manifest().to_json()).unwrap().is_none());
    }

    /// The NCCL record (the tokens and ranks a restore rebuilds from) is signed with the rest.
    #[test]
    fn the_nccl_record_is_covered_by_the_signature() {
        let dir = tempfile::tempdir().unwrap();
        let k = key(dir.path());
        let mut m = manifest();
        m.nccl = Some(crate::manifest::NcclRecord {
            layer_blake3: "cd".repeat(32),
            processes: vec![crate::manifest::NcclProcess {
                pid: 7,
                token: "tok7".into(),
                ..Default::default()
            }],
            cut: None,
        });
        k.sign_manifest(&mut m).unwrap();
        let json = String::from_utf8(m.to_json()).unwrap();
        assert!(verify_json(json.as_bytes()).unwrap().is_some());
        for (from, to) in [("\"tok7\"", "\"tok8\""), ("\"pid\":7", "\"pid\":8")] {
            let compact = json.replace(": ", ":");
            assert!(compact.contains(from), "{from}");
            let changed = compact.replacen(from, to, 1);
            assert!(verify_json(changed.as_bytes()).is_err(), "{from}");
        }
    }

    #[test]
    fn keys_are_made_once_root_only_and_trusted_by_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys").join(NODE_KEY_FILE);
        let a = NodeKey::load_or_create(&path).unwrap();
        let b = NodeKey::load_or_create(&path).unwrap();
        assert_eq!(a.public_key(), b.public_key());
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(path.parent().unwrap()), 0o700);
        let public = read_public_key(&path.with_file_name(NODE_PUB_FILE)).unwrap();
        assert_eq!(public, a.public_key());

        // A key others may read is refused.
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        let err = NodeKey::load(&path).unwrap_err().to_string();
        assert!(err.contains("0600"), "{err}");

        let other = tempfile::tempdir().unwrap();
        let o = key(other.path());
        let signer = Signer {
            public_key: o.public_key(),
        };
        let mut trusted = TrustedKeys::default();
        trusted.add(a.public_key(), "node key");
        assert_eq!(trusted.status(&signer), KeyStatus::Untrusted);
        let tdir = dir.path().join("trusted");
        fs::create_dir(&tdir).unwrap();
        fs::write(
            tdir.join("other.pub"),
            format!("ed25519:{}\n", hex::encode(o.public_key())),
        )
        .unwrap();
        fs::write(tdir.join("README"), "not a key").unwrap();
        trusted.add_dir(&tdir).unwrap();
        assert!(
            matches!(trusted.status(&signer), KeyStatus::Trusted(how) if how.ends_with("other.pub"))
        );
        fs::write(tdir.join("bad.pub"), "xyz").unwrap();
        let err = TrustedKeys::default()
            .add_dir(&tdir)
            .unwrap_err()
            .to_string();
        assert!(err.contains("bad.pub"), "{err}");
    }

    #[test]
    fn a_key_behind_a_link_or_open_to_others_is_refused() {
        use std::os::unix::fs::symlink;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys").join(NODE_KEY_FILE);
        let k = NodeKey::load_or_create(&path).unwrap();
        let err = |p: &Path| NodeKey::load(p).unwrap_err().to_string();
        // The key file as a link to the key.
        let other = dir.path().join("other");
        fs::DirBuilder::new().mode(0o700).create(&other).unwrap();
        symlink(&path, other.join(NODE_KEY_FILE)).unwrap();
        assert!(err(&other.join(NODE_KEY_FILE)).contains("link"));
        // The directory as a link to the key's directory.
        symlink(path.parent().unwrap(), dir.path().join("dirlink")).unwrap();
        let via = dir.path().join("dirlink").join(NODE_KEY_FILE);
        assert!(err(&via).contains("link"), "{}", err(&via));
        assert!(NodeKey::load_or_create(&via).is_err());
        // A second name for the key.
        fs::hard_link(&path, path.with_file_name("copy")).unwrap();
        assert!(err(&path).contains("no other link"), "{}", err(&path));
        fs::remove_file(path.with_file_name("copy")).unwrap();
        assert_eq!(NodeKey::load(&path).unwrap().public_key(), k.public_key());
        // A directory others may enter.
        fs::set_permissions(path.parent().unwrap(), fs::Permissions::from_mode(0o755)).unwrap();
        assert!(err(&path).contains("0700"), "{}", err(&path));
        fs::set_permissions(path.parent().unwrap(), fs::Permissions::from_mode(0o700)).unwrap();
        // The public key is read from node.pub, never from the private key.
        fs::write(&path, "not a key").unwrap();
        assert_eq!(node_public_key(&path).unwrap(), k.public_key());
    }

    #[test]
    fn rotation_keeps_the_old_public_key_and_revocation_wins_over_trust() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys").join(NODE_KEY_FILE);
        let old = NodeKey::load_or_create(&path).unwrap();
        let r = rotate(&path).unwrap();
        let (retired, retired_path) = r.retired.clone().unwrap();
        assert_eq!(retired, old.public_key());
        assert_ne!(r.key.public_key(), old.public_key());
        assert_eq!(r.public_path, public_key_path(&path));
        assert_eq!(read_public_key(&r.public_path).unwrap(), r.key.public_key());
        assert_eq!(
            NodeKey::load(&path).unwrap().public_key(),
            r.key.public_key()
        );
        assert_eq!(read_public_key(&retired_path).unwrap(), old.public_key());
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o600);

        // This node trusts its current and retired keys.
        let mut keys = TrustedKeys::default();
        keys.add_node_keys(&path, node_public_key(&path).unwrap())
            .unwrap();
        let old_signer = Signer {
            public_key: old.public_key(),
        };
        let new_signer = Signer {
            public_key: r.key.public_key(),
        };
        assert!(
            matches!(keys.status(&old_signer), KeyStatus::Trusted(how) if how.contains("retired"))
        );
        assert!(matches!(keys.status(&new_signer), KeyStatus::Trusted(_)));

        // Revoked by its public key file, then again by its id: listed once.
        let list = path.with_file_name(REVOKED_FILE);
        assert!(read_revoked(&list).unwrap().is_empty());
        let (id, already) = revoke(&list, &retired_path.display().to_string()).unwrap();
        assert_eq!(id, key_id(&old.public_key()));
        assert!(!already);
        assert!(revoke(&list, &id).unwrap().1);
        assert!(revoke(&list, &hex::encode(old.public_key())).unwrap().1);
        assert_eq!(read_revoked(&list).unwrap(), vec![(id.clone(), 1)]);
        keys.add_revoked(&list).unwrap();
        assert!(
            matches!(keys.status(&old_signer), KeyStatus::Revoked(at) if at.ends_with("revoked line 1"))
        );
        assert!(matches!(keys.status(&new_signer), KeyStatus::Trusted(_)));

        // A line that names no key, and a list others may write, are errors.
        fs::write(&list, format!("# comment\n\n{id} # why\nnonsense\n")).unwrap();
        let err = read_revoked(&list).unwrap_err().to_string();
        assert!(err.contains("line 4") && err.contains("nonsense"), "{err}");
        fs::write(&list, format!("{id}\n")).unwrap();
        fs::set_permissions(&list, fs::Permissions::from_mode(0o666)).unwrap();
        let err = read_revoked(&list).unwrap_err().to_string();
        assert!(err.contains("writable"), "{err}");
        assert!(revoke(&list, "not-a-key-or-file").is_err());
    }
}
