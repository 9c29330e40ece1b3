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
//! `ed25519:`.

use std::{
    fs,
    io::Write,
    os::unix::fs::{OpenOptionsExt, PermissionsExt},
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

impl NodeKey {
    /// Reads the key at `path`, or makes one there if there is none: its directory 0700, the
    /// key 0600 (written whole under a temporary name and linked into place, so two shims that
    /// start at once end with one key), and the public key beside it as [`NODE_PUB_FILE`].
    pub fn load_or_create(path: &Path) -> Result<NodeKey> {
        match Self::load(path) {
            Ok(k) => return Ok(k),
            Err(Error::Key { .. }) if !path.exists() => {}
            Err(e) => return Err(e),
        }
        let dir = path
            .parent()
            .ok_or_else(|| key_err(path, "has no directory"))?;
        fs::create_dir_all(dir).map_err(|e| key_err(path, format!("create directory: {e}")))?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(|e| key_err(path, format!("chmod directory: {e}")))?;
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed).map_err(|e| key_err(path, format!("random bytes: {e}")))?;
        let tmp = dir.join(format!(".node.key.tmp-{}", std::process::id()));
        let written = (|| -> std::io::Result<()> {
            let _ = fs::remove_file(&tmp);
            let mut f = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&tmp)?;
            f.write_all(format!("{}\n", hex::encode(seed)).as_bytes())?;
            f.sync_all()?;
            match fs::hard_link(&tmp, path) {
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
                other => other,
            }
        })();
        let _ = fs::remove_file(&tmp);
        written.map_err(|e| key_err(path, format!("create: {e}")))?;
        let key = Self::load(path)?;
        let pub_path = dir.join(NODE_PUB_FILE);
        let body = format!("{}\n", hex::encode(key.public_key()));
        fs::write(&pub_path, body).map_err(|e| key_err(&pub_path, format!("write: {e}")))?;
        Ok(key)
    }

    /// Reads an existing key; one that others than its owner may read is refused.
    pub fn load(path: &Path) -> Result<NodeKey> {
        let meta = fs::symlink_metadata(path).map_err(|e| key_err(path, e))?;
        if !meta.file_type().is_file() {
            return Err(key_err(path, "not a regular file"));
        }
        if meta.permissions().mode() & 0o077 != 0 {
            return Err(key_err(
                path,
                format!(
                    "mode {:o}: a private key must be readable by its owner only (0600)",
                    meta.permissions().mode() & 0o777
                ),
            ));
        }
        let text = fs::read_to_string(path).map_err(|e| key_err(path, e))?;
        let seed = parse_hex32(text.trim())
            .ok_or_else(|| key_err(path, "not 64 hex digits (an Ed25519 seed)"))?;
        Ok(NodeKey {
            key: SigningKey::from_bytes(&seed),
            path: path.to_path_buf(),
        })
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

/// Reads a public key file: 64 hex digits, optionally after `ed25519:`.
pub fn read_public_key(path: &Path) -> Result<[u8; 32]> {
    let text = fs::read_to_string(path).map_err(|e| key_err(path, e))?;
    let t = text.trim();
    let t = t.strip_prefix("ed25519:").unwrap_or(t);
    let key =
        parse_hex32(t).ok_or_else(|| key_err(path, "not an Ed25519 public key (64 hex digits)"))?;
    VerifyingKey::from_bytes(&key).map_err(|_| key_err(path, "not an Ed25519 public key"))?;
    Ok(key)
}

/// The public keys a node trusts, each with where it came from.
#[derive(Debug, Clone, Default)]
pub struct TrustedKeys {
    keys: Vec<([u8; 32], String)>,
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
        let entries =
            fs::read_dir(dir).map_err(|e| key_err(dir, format!("read directory: {e}")))?;
        let mut paths: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "pub"))
            .collect();
        paths.sort();
        for p in paths {
            let key = read_public_key(&p)?;
            self.add(key, p.display().to_string());
        }
        Ok(())
    }

    /// Where the key of `signer` is trusted from, or `None`.
    pub fn trusts(&self, signer: &Signer) -> Option<&str> {
        self.keys
            .iter()
            .find(|(k, _)| *k == signer.public_key)
            .map(|(_, s)| s.as_str())
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(trusted.trusts(&signer).is_none());
        let tdir = dir.path().join("trusted");
        fs::create_dir(&tdir).unwrap();
        fs::write(
            tdir.join("other.pub"),
            format!("ed25519:{}\n", hex::encode(o.public_key())),
        )
        .unwrap();
        fs::write(tdir.join("README"), "not a key").unwrap();
        trusted.add_dir(&tdir).unwrap();
        assert!(trusted.trusts(&signer).unwrap().ends_with("other.pub"));
        fs::write(tdir.join("bad.pub"), "xyz").unwrap();
        let err = TrustedKeys::default()
            .add_dir(&tdir)
            .unwrap_err()
            .to_string();
        assert!(err.contains("bad.pub"), "{err}");
    }
}
