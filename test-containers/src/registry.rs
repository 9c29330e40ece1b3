//! The test stack's TLS registry (`test-containers/stack/registry.sh` runs it beside the plain
//! one): HTTPS with a certificate of a CA made for the stack, and htpasswd logins. Tests get its
//! CA and login here, and write the files a client reads: containerd-style host directories
//! (with or without the CA) and docker-style auth files (right, wrong or no credentials).

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use base64::Engine;

use crate::stack::Stack;

/// The TLS registry's address when `GPU_CKPT_TLS_REGISTRY_ADDR` names none.
pub const DEFAULT_TLS_ADDR: &str = "127.0.0.1:5443";

/// The running TLS registry of the stack.
#[derive(Debug, Clone)]
pub struct TlsRegistry {
    /// `host:port`, the registry part of its image references.
    pub addr: String,
    dir: PathBuf,
    user: String,
    password: String,
}

impl TlsRegistry {
    /// The stack's TLS registry: its files in `$STACK/registry-tls`, and a check that it answers
    /// (`registry.sh start` starts it).
    pub fn discover() -> Result<TlsRegistry> {
        let stack = Stack::discover()?;
        let dir = stack.prefix().join("registry-tls");
        let login_file = dir.join("login");
        let login = fs::read_to_string(&login_file).with_context(|| {
            format!(
                "the TLS registry's login {} (run test-containers/stack/registry.sh start)",
                login_file.display()
            )
        })?;
        let (user, password) = login
            .trim()
            .split_once(':')
            .with_context(|| format!("{}: expected user:password", login_file.display()))?;
        let addr = std::env::var("GPU_CKPT_TLS_REGISTRY_ADDR")
            .ok()
            .filter(|a| !a.is_empty())
            .unwrap_or_else(|| DEFAULT_TLS_ADDR.to_string());
        if std::net::TcpStream::connect(&addr).is_err() {
            bail!("the TLS registry does not answer on {addr}: run test-containers/stack/registry.sh start");
        }
        Ok(TlsRegistry {
            addr,
            dir,
            user: user.to_string(),
            password: password.to_string(),
        })
    }

    /// The CA that signed the registry's certificate (PEM).
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// The test user's name.
    pub fn user(&self) -> &str {
        &self.user
    }

    /// Writes a containerd host directory under `root` (0700) for this registry:
    /// `root/HOST:PORT/hosts.toml` naming the server, and, with `with_ca`, the CA as `ca`
    /// (a copy beside it). Returns `root`.
    pub fn hosts_dir(&self, root: &Path, with_ca: bool) -> Result<PathBuf> {
        let host_dir = root.join(&self.addr);
        private_dir(&host_dir)?;
        let mut toml = format!(
            "server = \"https://{a}\"\n\n[host.\"https://{a}\"]\n  capabilities = [\"pull\", \"resolve\", \"push\"]\n",
            a = self.addr
        );
        if with_ca {
            let ca = host_dir.join("test-ca.pem");
            let pem =
                fs::read(self.ca()).with_context(|| format!("read {}", self.ca().display()))?;
            private_file(&ca, &pem)?;
            toml.push_str("  ca = \"test-ca.pem\"\n");
        }
        private_file(&host_dir.join("hosts.toml"), toml.as_bytes())?;
        Ok(root.to_path_buf())
    }

    /// Writes a docker-style auth file (`config.json`, 0600) at `path` with this registry's
    /// login and `password` (the right one: [`TlsRegistry::password`]), or with no entry for it
    /// when `password` is `None`.
    pub fn auth_file(&self, path: &Path, password: Option<&str>) -> Result<PathBuf> {
        let body = match password {
            Some(p) => {
                let auth =
                    base64::engine::general_purpose::STANDARD.encode(format!("{}:{p}", self.user));
                serde_json::json!({ "auths": { self.addr.clone(): { "auth": auth } } })
            }
            None => serde_json::json!({ "auths": { "other.example": { "auth": "eDp5" } } }),
        };
        if let Some(parent) = path.parent() {
            private_dir(parent)?;
        }
        private_file(path, serde_json::to_string_pretty(&body)?.as_bytes())?;
        Ok(path.to_path_buf())
    }

    /// The test user's password.
    pub fn password(&self) -> &str {
        &self.password
    }
}

fn private_dir(dir: &Path) -> Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("create {}", dir.display()))
}

fn private_file(path: &Path, data: &[u8]) -> Result<()> {
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("create {}", path.display()))?;
    f.write_all(data)
        .with_context(|| format!("write {}", path.display()))
}
