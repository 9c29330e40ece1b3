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
    /// A handler options file whose trust to use when no --key, --trusted-keys or --revoked is
    /// given: its SigningKey, TrustedKeysDir, revoked-keys lists and AllowUnsigned, read as the
    /// shim reads them. Default: the restore handler's,
    /// /usr/local/bin/containerd-shim-gpu-ckpt-restore-v1.toml, where it exists.
    #[arg(long, value_name = "FILE")]
    pub handler_config: Option<PathBuf>,
}

/// The restore handler's options file where gpu-ckpt-node-installer puts it.
pub const DEFAULT_HANDLER_CONFIG: &str = "/usr/local/bin/containerd-shim-gpu-ckpt-restore-v1.toml";

/// The keys a signer is checked against.
struct Keys {
    /// The node key (private or public key file).
    key: PathBuf,
    trusted_dir: Option<PathBuf>,
    /// Every revoked-keys list read.
    revoked: Vec<PathBuf>,
    /// The handler options file they come from, and its AllowUnsigned.
    handler: Option<(PathBuf, bool)>,
}

impl TrustArgs {
    /// Whether the keys were named: then the question is what a node with them would do.
    pub fn named(&self) -> bool {
        self.key.is_some() || self.trusted_keys.is_some()
    }

    /// The handler options file to take the keys from: none where a key flag is given;
    /// --handler-config, else the restore handler's where it exists.
    fn handler_file(&self) -> Option<PathBuf> {
        if self.named() || self.revoked.is_some() {
            return None;
        }
        self.handler_config.clone().or_else(|| {
            let p = Path::new(DEFAULT_HANDLER_CONFIG);
            p.is_file().then(|| p.to_path_buf())
        })
    }

    /// The keys: from the handler options file (parsed by the shim's own options type, so that
    /// they are the shim's), else from the flags and their defaults.
    fn keys(&self) -> Result<Keys, String> {
        if let Some(file) = self.handler_file() {
            let body = std::fs::read_to_string(&file)
                .map_err(|e| format!("read handler options file {}: {e}", file.display()))?;
            let o = gpu_ckpt_shim::options::RuntimeOptions::from_toml(
                &body,
                &format!("handler options file {}", file.display()),
            )
            .map_err(|e| e.to_string())?;
            return Ok(Keys {
                key: o.signing_key_path(),
                trusted_dir: (!o.trusted_keys_dir.is_empty())
                    .then(|| PathBuf::from(&o.trusted_keys_dir)),
                revoked: o.revoked_keys_paths(),
                handler: Some((file, o.allow_unsigned)),
            });
        }
        let key = self
            .key
            .clone()
            .unwrap_or_else(|| Path::new(sign::DEFAULT_KEY_DIR).join(sign::NODE_PUB_FILE));
        let revoked = self
            .revoked
            .clone()
            .unwrap_or_else(|| key.with_file_name(sign::REVOKED_FILE));
        Ok(Keys {
            key,
            trusted_dir: self.trusted_keys.clone(),
            revoked: vec![revoked],
            handler: None,
        })
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
            // A node's handler options say whether it restores unsigned checkpoints; a file
            // that cannot be read allows nothing.
            let (handler, problems) = match trust.keys() {
                Ok(k) => (k.handler, Vec::new()),
                Err(e) => (trust.handler_file().map(|f| (f, false)), vec![e]),
            };
            return serde_json::json!({"signed": false, "valid": false,
                "summary": "unsigned (restored only where AllowUnsigned = true)",
                "handler_config": handler.as_ref().map(|h| &h.0),
                "handler_allows_unsigned": handler.is_some_and(|h| h.1),
                "key_problems": problems});
        }
        Err(e) => {
            return serde_json::json!({"signed": true, "valid": false,
                "summary": format!("INVALID: {e}")})
        }
    };
    let mut keys = sign::TrustedKeys::default();
    let mut problems = Vec::new();
    let resolved = trust.keys().unwrap_or_else(|e| {
        problems.push(e);
        Keys {
            key: PathBuf::new(),
            trusted_dir: None,
            revoked: Vec::new(),
            handler: None,
        }
    });
    let key_path = &resolved.key;
    // The public key only: node.pub, also when the key named is the private key beside it.
    let pub_path = if key_path.extension().is_some_and(|x| x == "pub") {
        key_path.clone()
    } else {
        sign::public_key_path(key_path)
    };
    if !key_path.as_os_str().is_empty() {
        if let Err(e) =
            sign::read_public_key(&pub_path).and_then(|k| keys.add_node_keys(key_path, k))
        {
            problems.push(e.to_string());
        }
    }
    if let Some(dir) = &resolved.trusted_dir {
        if let Err(e) = keys.add_dir(dir) {
            problems.push(e.to_string());
        }
    }
    for list in &resolved.revoked {
        if let Err(e) = keys.add_revoked(list) {
            problems.push(e.to_string());
        }
    }
    let (handler, node_allows_unsigned) = match &resolved.handler {
        Some((file, allow)) => (Some(file.clone()), *allow),
        None => (None, false),
    };
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
        "key_problems": problems, "summary": summary, "handler_config": handler,
        "handler_allows_unsigned": node_allows_unsigned})
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
    let problems: Vec<&str> = signer["key_problems"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p.as_str())
        .collect();
    // The shim reads every trust source or refuses: a key found while another source (a
    // revoked list, the trusted directory) could not be read is no pass here either.
    if signer["signed"] == true && signer["trusted"] == true && !problems.is_empty() {
        return Some(CliError::Trust(format!(
            "{}, but the node's trust cannot be read in full ({}): a node refuses every signed restore until it can",
            text("summary"),
            problems.join("; ")
        )));
    }
    if signer["signed"] == true && signer["trusted"] == false {
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
    let from_handler = !signer["handler_config"].is_null();
    let node_allows = signer["handler_allows_unsigned"] == true;
    if signer["signed"] == false
        && signer["valid"] == false
        && (trust.named() || from_handler)
        && !allow_unsigned
        && !node_allows
    {
        return Some(CliError::Trust(
            "the checkpoint is unsigned: a node restores it only where AllowUnsigned = true (--allow-unsigned accepts it here)".into(),
        ));
    }
    None
}
