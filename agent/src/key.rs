//! The node's signing key in use: its key id.
//!
//! The agent the chart deploys mounts no key directory (the private key is beside `node.pub`,
//! and root reads it whatever the file's mode): it takes the id from the newest checkpoint
//! record's `signing_key`, which the shim writes as `image_format::sign::key_id` of the key it
//! signed with ([`well_formed`] checks it before it becomes a label). Outside the chart,
//! `--key-dir` names the directory of `SigningKey` (default `/var/lib/gpu-ckpt/keys/node.key`),
//! whose `node.pub` [`key_id`] reads (never the private key) and derives the id as
//! `gpu-ckpt key` and the shim do.

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

/// Whether `id` is a key id as `image_format::sign::key_id` writes it:
/// `ed25519:` and 32 lowercase hex digits.
pub fn well_formed(id: &str) -> bool {
    id.strip_prefix(sign::ALGORITHM)
        .and_then(|r| r.strip_prefix(':'))
        .is_some_and(|h| h.len() == 32 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_id_is_well_formed() {
        let t = tempfile::tempdir().unwrap();
        let key = sign::NodeKey::load_or_create(&t.path().join("keys").join(sign::NODE_KEY_FILE))
            .unwrap();
        assert!(well_formed(&sign::key_id(&key.public_key())));
        for bad in [
            "",
            "ed25519:",
            "ed25519:00112233445566778899aabbccddeef",
            "ed25519:00112233445566778899aabbccddeeff0",
            "ed25519:00112233445566778899AABBCCDDEEFF",
            "rsa:00112233445566778899aabbccddeeff",
            "ed25519:0011223344556677\"} 1\n8899aabbcc",
        ] {
            assert!(!well_formed(bad), "{bad}");
        }
    }

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
