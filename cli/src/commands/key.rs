//! `gpu-ckpt key rotate` and `gpu-ckpt key revoke`: the node's signing key.

use std::path::{Path, PathBuf};

use anyhow::Result;
use image_format::sign;

use crate::output::{Format, OutputArgs, Report, Text};

/// Where the node's key is, for `gpu-ckpt key`.
#[derive(clap::Args, Clone, Debug)]
pub struct KeyArgs {
    /// The node's private key (the handler option SigningKey).
    #[arg(long, value_name = "FILE", default_value_os_t = Path::new(sign::DEFAULT_KEY_DIR).join(sign::NODE_KEY_FILE))]
    pub key: PathBuf,
    #[command(flatten)]
    pub out: OutputArgs,
}

#[derive(clap::Subcommand, Debug)]
pub enum KeyCmd {
    /// Replace the node's key with a new one. The former public key stays in the key directory
    /// as retired-<id>.pub: this node still trusts it until it is revoked, and other nodes
    /// where that file is in their TrustedKeysDir. Prints the new key id and public key file.
    Rotate {
        #[command(flatten)]
        key: KeyArgs,
        /// Also revoke the former key on this node (a key that may have leaked).
        #[arg(long)]
        revoke: bool,
    },
    /// Add a key to this node's revoked-keys list: checkpoints it signed are refused by the
    /// restore and by `verify`, even where the key is trusted.
    Revoke {
        /// A key id (ed25519:<32 hex digits>, as `verify` prints it), a public key (64 hex
        /// digits), or a public key file.
        key_ref: String,
        #[command(flatten)]
        key: KeyArgs,
        /// The revoked-keys list (the handler option RevokedKeysFile). Default: `revoked`
        /// beside --key.
        #[arg(long, value_name = "FILE")]
        revoked: Option<PathBuf>,
    },
}

impl KeyCmd {
    pub fn format(&self) -> Format {
        match self {
            KeyCmd::Rotate { key, .. } | KeyCmd::Revoke { key, .. } => key.out.format(),
        }
    }
}

pub fn run(cmd: &KeyCmd) -> Result<Report> {
    let mut t = Text::default();
    let data = match cmd {
        KeyCmd::Rotate { key, revoke } => {
            let r = sign::rotate(&key.key)?;
            let new_id = sign::key_id(&r.key.public_key());
            t.line(format!("new key: {new_id}"));
            t.line(format!("public key: {}", r.public_path.display()));
            let mut data = serde_json::json!({"new_key": new_id, "public_key": r.public_path});
            match &r.retired {
                Some((old, path)) => {
                    t.line(format!(
                        "retired key: {} (public key kept in {})",
                        sign::key_id(old),
                        path.display()
                    ));
                    data["retired_key"] = sign::key_id(old).into();
                    data["retired_public_key"] = serde_json::json!(path);
                    if *revoke {
                        let list = key.key.with_file_name(sign::REVOKED_FILE);
                        let (id, _) = sign::revoke(&list, &sign::key_id(old))?;
                        t.line(format!("revoked: {id} (in {})", list.display()));
                        data["revoked"] = id.into();
                        data["revoked_in"] = serde_json::json!(list);
                    }
                }
                None => t.line("retired key: none (the directory had no key)"),
            }
            t.line(format!(
                "copy {} into the TrustedKeysDir of the nodes that restore this node's checkpoints",
                r.public_path.display()
            ));
            data
        }
        KeyCmd::Revoke {
            key_ref,
            key,
            revoked,
        } => {
            let list = revoked
                .clone()
                .unwrap_or_else(|| key.key.with_file_name(sign::REVOKED_FILE));
            let (id, already) = sign::revoke(&list, key_ref)?;
            if already {
                t.line(format!("revoked already: {id} (in {})", list.display()));
            } else {
                t.line(format!("revoked: {id} (in {})", list.display()));
            }
            serde_json::json!({"revoked": id, "revoked_in": list, "already": already})
        }
    };
    Ok(Report::new(t.0, data))
}
