//! The node's signing key in use: its key id, from the public key only.
//!
//! The shim signs with `SigningKey` (default `/var/lib/gpu-ckpt/keys/node.key`; the chart's
//! cluster mode: `/etc/gpu-ckpt/cluster-key/node.key`) and keeps the public key beside it as
//! `node.pub`. The agent reads that file (never the private key) and derives the id as
//! `gpu-ckpt key` and the shim do (`image_format::sign::key_id`).

use std::path::Path;

use image_format::sign;

/// The key id of `<dir>/node.pub`; `None` while there is none (a node that has not made a
/// checkpoint yet) or it is not a public key (logged).
pub fn key_id(dir: &Path) -> Option<String> {
    let path = dir.join(sign::NODE_PUB_FILE);
    match sign::read_public_key(&path) {
        Ok(k) => Some(sign::key_id(&k)),
        Err(e) => {
            if path.exists() {
                tracing::warn!(path = %path.display(), error = %e, "the node's public key cannot be read");
            }
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_id_is_the_shims() {
        let t = tempfile::tempdir().unwrap();
        assert_eq!(key_id(t.path()), None);
        let dir = t.path().join("keys");
        let key = sign::NodeKey::load_or_create(&dir.join(sign::NODE_KEY_FILE)).unwrap();
        let id = key_id(&dir).unwrap();
        assert_eq!(id, sign::key_id(&key.public_key()));
        assert!(id.starts_with("ed25519:"), "{id}");
        std::fs::write(dir.join(sign::NODE_PUB_FILE), "not a key\n").unwrap();
        assert_eq!(key_id(&dir), None);
    }
}
