//! Who signed a checkpoint's manifest, whether the signature holds, and whether this node
//! trusts the signer or revoked it: the signer lines of `inspect` and `verify`, and `verify`'s
//! trust failures.

use std::path::{Path, PathBuf};

use image_format::sign::{self, KeyStatus};

use crate::exit::CliError;

/// Which keys this node trusts, for the signer lines of `inspect` and `verify`.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct TrustArgs {
    /// The node's key: its private key (node.key) or public key (node.pub). Default
    /// /var/lib/gpu-ckpt/keys/node.pub (the shim's default SigningKey, beside it).
    #[arg(long, value_name = "FILE")]
    pub key: Option<PathBuf>,
    /// A directory of more trusted public keys (the handler option TrustedKeysDir).
    #[arg(long, value_name = "DIR")]
    pub trusted_keys: Option<PathBuf>,
    /// The revoked-keys list (the handler option RevokedKeysFile). Default: `revoked` beside
    /// the node's key.
    #[arg(long, value_name = "FILE")]
    pub revoked: Option<PathBuf>,
}

impl TrustArgs {
    /// Whether the keys were named: then the question is what a node with them would do.
    pub fn named(&self) -> bool {
        self.key.is_some() || self.trusted_keys.is_some()
    }
}

/// Who signed the manifest document `json`, whether the signature holds, and whether this node
/// trusts the signer or revoked it.
pub fn signer_report(json: Option<&[u8]>, trust: &TrustArgs) -> serde_json::Value {
    let Some(json) = json else {
        return serde_json::json!({"signed": false, "summary": "no gpu-ckpt manifest"});
    };
    let signer = match sign::verify_json(json) {
        Ok(Some(s)) => s,
        Ok(None) => {
            return serde_json::json!({"signed": false, "valid": false,
                "summary": "unsigned (restored only where AllowUnsigned = true)"})
        }
        Err(e) => {
            return serde_json::json!({"signed": true, "valid": false,
                "summary": format!("INVALID: {e}")})
        }
    };
    let mut keys = sign::TrustedKeys::default();
    let mut problems = Vec::new();
    let key_path = trust
        .key
        .clone()
        .unwrap_or_else(|| Path::new(sign::DEFAULT_KEY_DIR).join(sign::NODE_PUB_FILE));
    // The public key only: node.pub, also when --key names the private key beside it.
    let pub_path = if key_path.extension().is_some_and(|x| x == "pub") {
        key_path.clone()
    } else {
        sign::public_key_path(&key_path)
    };
    if let Err(e) = sign::read_public_key(&pub_path).and_then(|k| keys.add_node_keys(&key_path, k))
    {
        problems.push(e.to_string());
    }
    if let Some(dir) = &trust.trusted_keys {
        if let Err(e) = keys.add_dir(dir) {
            problems.push(e.to_string());
        }
    }
    let revoked = trust
        .revoked
        .clone()
        .unwrap_or_else(|| key_path.with_file_name(sign::REVOKED_FILE));
    if let Err(e) = keys.add_revoked(&revoked) {
        problems.push(e.to_string());
    }
    let (trusted, revoked_at, summary) = match keys.status(&signer) {
        KeyStatus::Trusted(how) => (
            Some(how.to_string()),
            None,
            format!("{} (trusted: {how})", signer.key_id()),
        ),
        KeyStatus::Revoked(at) => (
            None,
            Some(at.to_string()),
            format!("{} (REVOKED: listed in {at})", signer.key_id()),
        ),
        KeyStatus::Untrusted => (
            None,
            None,
            format!("{} (NOT trusted by this node)", signer.key_id()),
        ),
    };
    serde_json::json!({"signed": true, "valid": true, "key_id": signer.key_id(),
        "public_key": signer.public_key_hex(), "trusted": trusted.is_some(),
        "trusted_as": trusted, "revoked": revoked_at.is_some(), "revoked_in": revoked_at,
        "key_problems": problems, "summary": summary})
}

/// Why a node with these keys would refuse the checkpoint `signer` describes, if it would: a
/// signature that does not hold, a revoked or untrusted key, or (where the keys were named and
/// `allow_unsigned` is not given) no signature.
pub fn refusal(
    signer: &serde_json::Value,
    trust: &TrustArgs,
    allow_unsigned: bool,
) -> Option<CliError> {
    let text = |k: &str| signer[k].as_str().unwrap_or_default().to_string();
    if signer["signed"] == true && signer["valid"] == false {
        return Some(CliError::Trust(text("summary")));
    }
    if signer["revoked"] == true {
        return Some(CliError::Trust(format!(
            "the checkpoint is signed by key {}, which is revoked (listed in {}): a node refuses to restore it",
            text("key_id"),
            text("revoked_in")
        )));
    }
    if signer["signed"] == true && signer["trusted"] == false {
        let problems: Vec<&str> = signer["key_problems"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p.as_str())
            .collect();
        let problems = if problems.is_empty() {
            String::new()
        } else {
            format!(" ({})", problems.join("; "))
        };
        return Some(CliError::Trust(format!(
            "{}: a node with these keys{problems} refuses to restore it (give the signer's public key with --trusted-keys DIR, or put it in the node's TrustedKeysDir)",
            text("summary")
        )));
    }
    if signer["signed"] == false && signer["valid"] == false && trust.named() && !allow_unsigned {
        return Some(CliError::Trust(
            "the checkpoint is unsigned: a node restores it only where AllowUnsigned = true (--allow-unsigned accepts it here)".into(),
        ));
    }
    None
}
