//! The site's options, set once for a fleet (the chart's values, passed as flags and mounted
//! Secret/ConfigMap files): the trust model (a cluster signing key, trusted and revoked public
//! keys), the restore sources, the registry's login and CA, runc's path and the other handler
//! options. [`plan`] turns them into the files the installer keeps on the node, all root-only
//! (files 0600 in 0700 directories):
//!
//! - the handlers' side files `<bin-dir>/containerd-shim-gpu-ckpt-v1.toml` and
//!   `<bin-dir>/containerd-shim-gpu-ckpt-restore-v1.toml` (gpu-ckpt's own keys: under the
//!   runc-typed registration CRI sends only runc's, and the shim reads the rest from
//!   `<runtime_path>.toml` at each container's Create, so a change needs no containerd restart),
//!   and the restore handler's link `<bin-dir>/containerd-shim-gpu-ckpt-restore-v1` to the shim;
//! - under `--site-dir` (default `/etc/gpu-ckpt`): `cluster-key/node.key` and `node.pub` (the
//!   cluster signing key), `trusted/<name>.pub` (`TrustedKeysDir`), `revoked`
//!   (`RevokedKeysFile`), `registry/auth.json` (`RegistryAuthFile`) and
//!   `certs.d/<host>/{ca.crt,hosts.toml}` (`RegistryHostsDir`).
//!
//! runc's own keys (`BinaryName`, `SystemdCgroup`) go into the drop-ins ([`crate::dropin`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

// Key ids as `gpu-ckpt verify` prints them and the shim compares them.
use image_format::sign::key_id;
use toml_edit::{Array, DocumentMut, Value};

use crate::dropin::{self, Runc, SHIM_BINARY};
use crate::error::{Error, Result};

/// Where the site's files go on the node when `--site-dir` names no other directory.
pub const DEFAULT_SITE_DIR: &str = "/etc/gpu-ckpt";

/// Keys the installer sets itself from the dedicated options; `--handler-options` may not
/// (nor `RegistryHostsDir` with `--registry-ca`).
const RESERVED: [&str; 6] = [
    "Mode",
    "SigningKey",
    "TrustedKeysDir",
    "RevokedKeysFile",
    "RestoreSources",
    "RegistryAuthFile",
];
/// runc's keys: under the runc-typed registration they are in the drop-in's options, which CRI
/// sends over the side file's.
const RUNC_KEYS: [&str; 10] = [
    "BinaryName",
    "Root",
    "SystemdCgroup",
    "NoPivotRoot",
    "NoNewKeyring",
    "ShimCgroup",
    "IoUid",
    "IoGid",
    "CriuImagePath",
    "CriuWorkPath",
];

/// The site options, as the command line gives them. Files named here (`--signing-key`,
/// `--registry-auth`, `--registry-ca`) are read where the installer runs (mounted Secrets);
/// they are read at install only.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SiteArgs {
    /// The node directory for the site's files (trusted keys, revocation list, registry login
    /// and CAs, the cluster key). Default: /etc/gpu-ckpt.
    #[arg(long, value_name = "PATH")]
    pub site_dir: Option<PathBuf>,
    /// The cluster signing key (a file holding the 64-hex-digit Ed25519 seed, as `gpu-ckpt key`
    /// writes it): every node signs with it and trusts its public key.
    #[arg(long, value_name = "FILE")]
    pub signing_key: Option<PathBuf>,
    /// A public key every node trusts, as NAME=KEY (64 hex digits, optionally after `ed25519:`);
    /// repeatable.
    #[arg(long = "trusted-key", value_name = "NAME=KEY")]
    pub trusted_keys: Vec<String>,
    /// A key every node refuses even where it is trusted: a key id (`ed25519:` and 32 hex
    /// digits) or a public key; repeatable.
    #[arg(long = "revoked-key", value_name = "KEY")]
    pub revoked_keys: Vec<String>,
    /// Where the restore handler may read checkpoints (`RestoreSources`): absolute directories
    /// and registry prefixes; repeatable. None given: the shim's default (the kubelet's
    /// checkpoint directory).
    #[arg(long = "restore-source", value_name = "SOURCE")]
    pub restore_sources: Vec<String>,
    /// The registry logins for the restore handler's pulls: a docker config.json
    /// (`.dockerconfigjson` of a kubernetes.io/dockerconfigjson Secret).
    #[arg(long, value_name = "FILE")]
    pub registry_auth: Option<PathBuf>,
    /// A registry's CA bundle, as HOST[:PORT]=FILE (PEM); repeatable.
    #[arg(long = "registry-ca", value_name = "HOST=FILE")]
    pub registry_cas: Vec<String>,
    /// runc for both handlers (the drop-ins' `BinaryName`). Empty: the drop-ins' own.
    #[arg(long, value_name = "PATH")]
    pub runc_path: Option<PathBuf>,
    /// runc manages cgroups through systemd (the drop-ins' `SystemdCgroup`), as the kubelet's
    /// cgroup driver `systemd` needs.
    #[arg(long)]
    pub runc_systemd_cgroup: bool,
    /// More handler options for both handlers, as a JSON object of the shim's keys (e.g.
    /// `{"DeviceLockTimeout":"45s"}`).
    #[arg(long, value_name = "JSON")]
    pub handler_options: Option<String>,
}

/// What a file the site plan puts on the node holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Content {
    Bytes(Vec<u8>),
    /// A symlink with this target.
    Link(PathBuf),
}

/// One file of the site plan: its node path, content, mode, and the mode of the directories
/// made for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SiteFile {
    pub path: PathBuf,
    pub content: Content,
    pub mode: u32,
    pub dir_mode: u32,
}

impl SiteFile {
    fn private(path: PathBuf, bytes: impl Into<Vec<u8>>) -> SiteFile {
        SiteFile {
            path,
            content: Content::Bytes(bytes.into()),
            mode: 0o600,
            dir_mode: 0o700,
        }
    }
}

fn bad(what: impl Into<String>, why: impl Into<String>) -> Error {
    Error::Site {
        what: what.into(),
        why: why.into(),
    }
}

/// 64 hex digits, optionally after `ed25519:`: 32 bytes.
fn parse_key(s: &str) -> Option<[u8; 32]> {
    let s = s.trim();
    let s = s.strip_prefix("ed25519:").unwrap_or(s);
    let mut out = [0u8; 32];
    (s.len() == 64)
        .then(|| hex::decode_to_slice(s, &mut out).ok())
        .flatten()
        .map(|_| out)
}

/// The key id a revocation entry names: itself when it is a key id, else its public key's.
fn revoked_id(entry: &str) -> Result<String> {
    let e = entry.trim();
    if let Some(key) = parse_key(e) {
        return Ok(key_id(&key));
    }
    let hexpart = e.strip_prefix("ed25519:").unwrap_or("");
    if hexpart.len() == 32 && hexpart.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Ok(format!("ed25519:{}", hexpart.to_ascii_lowercase()));
    }
    Err(bad(
        format!("--revoked-key {entry:?}"),
        "expected a key id (ed25519: and 32 hex digits) or a public key (64 hex digits)",
    ))
}

/// A file name part: letters, digits, `.`, `_`, `-`, not starting with `.`.
fn check_name(what: &str, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-:".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(bad(
            format!("{what} {name:?}"),
            "expected letters, digits, `.`, `_`, `-` (and `:` before a port), not starting with `.`",
        ))
    }
}

fn read_local(what: &str, p: &Path) -> Result<Vec<u8>> {
    std::fs::read(p).map_err(|e| bad(format!("{what} {}", p.display()), e.to_string()))
}

/// A JSON value of `--handler-options` as TOML.
fn toml_value(key: &str, v: &serde_json::Value) -> Result<Value> {
    use serde_json::Value as J;
    Ok(match v {
        J::String(s) => Value::from(s.as_str()),
        J::Bool(b) => Value::from(*b),
        J::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => Value::from(i),
            (None, Some(f)) => Value::from(f),
            _ => {
                return Err(bad(
                    format!("handler option {key}"),
                    "a number out of range",
                ))
            }
        },
        J::Array(items) => {
            let mut a = Array::new();
            for i in items {
                a.push(toml_value(key, i)?);
            }
            Value::Array(a)
        }
        J::Null | J::Object(_) => {
            return Err(bad(
                format!("handler option {key}"),
                "expected a string, number, boolean or list",
            ))
        }
    })
}

/// The node paths of the site's files.
struct Layout {
    site: PathBuf,
}

impl Layout {
    fn cluster_key(&self) -> PathBuf {
        self.site.join("cluster-key/node.key")
    }
    fn trusted(&self) -> PathBuf {
        self.site.join("trusted")
    }
    fn revoked(&self) -> PathBuf {
        self.site.join("revoked")
    }
    fn auth(&self) -> PathBuf {
        self.site.join("registry/auth.json")
    }
    fn certs(&self) -> PathBuf {
        self.site.join("certs.d")
    }
}

/// What [`plan`] needs of the installer's options.
pub struct Target<'a> {
    pub bin_dir: &'a Path,
    /// A node path as containerd (and so the shim) sees it (`--host-root` joined).
    pub for_containerd: &'a dyn Fn(&Path) -> PathBuf,
    /// The node path the NCCL layer is installed at: named in the side files (`NcclLayer`) where
    /// the shim sees it elsewhere than at its default, `--handler-options` going over it.
    pub nccl_layer: Option<&'a Path>,
}

impl SiteArgs {
    /// `--site-dir`, or [`DEFAULT_SITE_DIR`].
    pub fn site_dir(&self) -> PathBuf {
        self.site_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_SITE_DIR))
    }

    /// runc's keys for the drop-ins.
    pub fn runc(&self) -> Runc {
        Runc {
            binary_name: self.runc_path.as_ref().map(|p| p.display().to_string()),
            systemd_cgroup: self.runc_systemd_cgroup,
        }
    }

    fn handler_options(&self) -> Result<BTreeMap<String, serde_json::Value>> {
        let Some(text) = self
            .handler_options
            .as_deref()
            .filter(|t| !t.trim().is_empty())
        else {
            return Ok(BTreeMap::new());
        };
        let map: BTreeMap<String, serde_json::Value> = serde_json::from_str(text)
            .map_err(|e| bad("--handler-options", format!("not a JSON object: {e}")))?;
        for k in map.keys() {
            if RESERVED.contains(&k.as_str()) {
                return Err(bad(
                    format!("handler option {k}"),
                    "set by the installer from its own option (trust, restore sources, registry)",
                ));
            }
            if RUNC_KEYS.contains(&k.as_str()) {
                return Err(bad(
                    format!("handler option {k}"),
                    "a runc option, set in the drop-ins (--runc-path, --runc-systemd-cgroup)",
                ));
            }
        }
        Ok(map)
    }
}

/// The site's files for the node, the side files of both handlers and the restore handler's
/// link among them. Every input is checked before anything is planned; an error names it.
pub fn plan(args: &SiteArgs, t: &Target) -> Result<Vec<SiteFile>> {
    let l = Layout {
        site: args.site_dir(),
    };
    let _span = tracing::info_span!("site_plan", site_dir = %l.site.display()).entered();
    crate::paths::check_abs("--site-dir", &l.site)?;
    // The free-form options, for both handlers: checked before any file is read.
    let mut extra = Vec::new();
    for (k, v) in &args.handler_options()? {
        if k == "RegistryHostsDir" && !args.registry_cas.is_empty() {
            return Err(bad(
                format!("handler option {k}"),
                "set by the installer from --registry-ca (the chart's registry.caBundles)",
            ));
        }
        extra.push((k.clone(), toml_value(k, v)?));
    }
    let mut p = Planner {
        l,
        t,
        files: Vec::new(),
        common: Vec::new(),
        restore: Vec::new(),
    };
    p.cluster_key(args)?;
    p.trusted_and_revoked(args)?;
    p.registry(args)?;
    p.nccl_layer();
    // After the installer's own keys: a handler option of the same name goes over them.
    p.common.extend(extra);
    p.side_files()
}

/// The files planned so far, and the side files' keys: `common` for both handlers, `restore`
/// for the restore handler only.
struct Planner<'a> {
    l: Layout,
    t: &'a Target<'a>,
    files: Vec<SiteFile>,
    common: Vec<(String, Value)>,
    restore: Vec<(String, Value)>,
}

impl Planner<'_> {
    /// A node path as the shim sees it, for a side file.
    fn shown(&self, p: &Path) -> Value {
        Value::from((self.t.for_containerd)(p).display().to_string())
    }

    /// The cluster signing key and its public key (`SigningKey`).
    fn cluster_key(&mut self, args: &SiteArgs) -> Result<()> {
        let Some(src) = &args.signing_key else {
            return Ok(());
        };
        let what = || format!("--signing-key {}", src.display());
        let text = String::from_utf8(read_local("--signing-key", src)?)
            .map_err(|_| bad(what(), "not text"))?;
        let seed = parse_key(&text).ok_or_else(|| {
            bad(
                what(),
                "expected the 64 hex digits of an Ed25519 seed (`gpu-ckpt key` writes one)",
            )
        })?;
        let public = ed25519_dalek::SigningKey::from_bytes(&seed)
            .verifying_key()
            .to_bytes();
        // Every node would sign with a key every node refuses.
        for r in &args.revoked_keys {
            if revoked_id(r)? == key_id(&public) {
                return Err(bad(
                    what(),
                    format!(
                        "the cluster signing key {} is listed in --revoked-key (the chart's trust.revokedKeys): give a new signing key, or take it off the list",
                        key_id(&public)
                    ),
                ));
            }
        }
        let key = self.l.cluster_key();
        self.files.push(SiteFile::private(
            key.clone(),
            format!("{}\n", hex::encode(seed)),
        ));
        self.files.push(SiteFile::private(
            key.with_file_name("node.pub"),
            format!("{}\n", hex::encode(public)),
        ));
        let v = self.shown(&key);
        self.common.push(("SigningKey".into(), v));
        Ok(())
    }

    /// The trusted keys (`TrustedKeysDir`), but the revoked ones, and the revoked-keys list
    /// (`RevokedKeysFile`).
    fn trusted_and_revoked(&mut self, args: &SiteArgs) -> Result<()> {
        let revoked: Vec<String> = args
            .revoked_keys
            .iter()
            .map(|r| revoked_id(r))
            .collect::<Result<_>>()?;
        let mut trusted = BTreeMap::new();
        for entry in &args.trusted_keys {
            let (name, key) = entry
                .split_once('=')
                .ok_or_else(|| bad(format!("--trusted-key {entry:?}"), "expected NAME=KEY"))?;
            check_name("--trusted-key name", name)?;
            let key = parse_key(key).ok_or_else(|| {
                bad(
                    format!("--trusted-key {name}"),
                    "expected 64 hex digits, optionally after ed25519:",
                )
            })?;
            if trusted.insert(name.to_string(), key).is_some() {
                return Err(bad(format!("--trusted-key {name}"), "given twice"));
            }
        }
        let mut written = 0;
        for (name, key) in &trusted {
            // A revoked key is never written as trusted (and a file an earlier run wrote for
            // it goes, as every file no longer planned).
            if revoked.contains(&key_id(key)) {
                tracing::info!(name, key = %key_id(key), "revoked: not written as trusted");
                continue;
            }
            self.files.push(SiteFile::private(
                self.l.trusted().join(format!("{name}.pub")),
                format!("{}\n", hex::encode(key)),
            ));
            written += 1;
        }
        // Only a directory that holds a key: with every trusted key revoked there is none.
        if written > 0 {
            let v = self.shown(&self.l.trusted());
            self.common.push(("TrustedKeysDir".into(), v));
        }
        if !revoked.is_empty() {
            let mut body = String::from(
                "# Revoked keys, from the chart's trust.revokedKeys (gpu-ckpt-node-installer).\n",
            );
            for id in &revoked {
                body.push_str(id);
                body.push('\n');
            }
            self.files.push(SiteFile::private(self.l.revoked(), body));
            let v = self.shown(&self.l.revoked());
            self.common.push(("RevokedKeysFile".into(), v));
        }
        Ok(())
    }

    /// `NcclLayer`, where the installed layer is not where the shim looks by default.
    fn nccl_layer(&mut self) {
        let Some(layer) = self.t.nccl_layer else {
            return;
        };
        if (self.t.for_containerd)(layer) != Path::new(gpu_ckpt_shim::options::DEFAULT_NCCL_LAYER) {
            let v = self.shown(layer);
            self.common.push(("NcclLayer".into(), v));
        }
    }

    /// The restore handler's sources, registry login and CAs.
    fn registry(&mut self, args: &SiteArgs) -> Result<()> {
        if !args.restore_sources.is_empty() {
            let mut a = Array::new();
            for s in &args.restore_sources {
                if s.trim().is_empty() {
                    return Err(bad("--restore-source", "empty"));
                }
                a.push(s.as_str());
            }
            self.restore
                .push(("RestoreSources".into(), Value::Array(a)));
        }
        if let Some(src) = &args.registry_auth {
            let body = read_local("--registry-auth", src)?;
            let what = || format!("--registry-auth {}", src.display());
            let v: serde_json::Value = serde_json::from_slice(&body)
                .map_err(|e| bad(what(), format!("not a docker config.json: {e}")))?;
            if !v.is_object() {
                return Err(bad(
                    what(),
                    "not a docker config.json (a JSON object with `auths`)",
                ));
            }
            self.files.push(SiteFile::private(self.l.auth(), body));
            let v = self.shown(&self.l.auth());
            self.restore.push(("RegistryAuthFile".into(), v));
        }
        for entry in &args.registry_cas {
            let (host, src) = entry
                .split_once('=')
                .ok_or_else(|| bad(format!("--registry-ca {entry:?}"), "expected HOST=FILE"))?;
            check_name("--registry-ca host", host)?;
            let pem = read_local("--registry-ca", Path::new(src))?;
            if !String::from_utf8_lossy(&pem).contains("-----BEGIN CERTIFICATE-----") {
                return Err(bad(format!("--registry-ca {host}"), "no PEM certificate"));
            }
            let dir = self.l.certs().join(host);
            self.files.push(SiteFile::private(dir.join("ca.crt"), pem));
            self.files.push(SiteFile::private(
                dir.join("hosts.toml"),
                format!(
                    "# gpu-ckpt-node-installer: the chart's registry.caBundles.\nserver = \"https://{host}\"\nca = \"ca.crt\"\n\n[host.\"https://{host}\"]\n  capabilities = [\"pull\", \"resolve\", \"push\"]\n  ca = \"ca.crt\"\n"
                ),
            ));
        }
        if !args.registry_cas.is_empty() {
            let v = self.shown(&self.l.certs());
            self.restore.push(("RegistryHostsDir".into(), v));
        }
        Ok(())
    }

    /// The planned files with each handler's side file, and the restore handler's link (the
    /// shim by another name). Each side file is read back by the shim's own options type, as
    /// the shim reads it at Create: a key it does not know (they are case-sensitive) or a value
    /// it refuses fails the install here instead of every container's start.
    fn side_files(mut self) -> Result<Vec<SiteFile>> {
        for src in &dropin::SOURCES {
            let mut doc = DocumentMut::new();
            if src.mode_restore {
                doc.insert("Mode", toml_edit::value("restore"));
            }
            let own: &[(String, Value)] = if src.mode_restore { &self.restore } else { &[] };
            for (k, v) in self.common.iter().chain(own) {
                doc.insert(k, toml_edit::Item::Value(v.clone()));
            }
            gpu_ckpt_shim::options::RuntimeOptions::from_toml(&doc.to_string(), src.handler)
                .map_err(|e| bad("--handler-options", e.to_string()))?;
            self.files.push(SiteFile {
                path: self.t.bin_dir.join(format!("{}.toml", src.binary)),
                content: Content::Bytes(format!("{}{doc}", side_header(src.handler)).into_bytes()),
                mode: 0o600,
                dir_mode: 0o755,
            });
            if src.binary != SHIM_BINARY {
                self.files.push(SiteFile {
                    path: self.t.bin_dir.join(src.binary),
                    content: Content::Link(PathBuf::from(SHIM_BINARY)),
                    mode: 0o777,
                    dir_mode: 0o755,
                });
            }
        }
        Ok(self.files)
    }
}

/// Whether the node path `path` is a trusted key the installer writes (`<site>/trusted/*.pub`).
pub fn is_trusted_key_file(site_dir: &Path, path: &Path) -> bool {
    path.parent() == Some(trusted_dir(site_dir).as_path())
        && path.extension().is_some_and(|x| x == "pub")
}

/// The installer's trusted-keys directory under `site_dir`.
pub fn trusted_dir(site_dir: &Path) -> PathBuf {
    Layout {
        site: site_dir.to_path_buf(),
    }
    .trusted()
}

fn side_header(handler: &str) -> String {
    format!(
        "# The {handler} handler's gpu-ckpt options (the shim reads this file, `<runtime_path>.toml`, at each\n# container's Create). Written by gpu-ckpt-node-installer from the chart's values; it is rewritten\n# at each install and removed at uninstall.\n"
    )
}

/// Whether `path` is a side file (a handler's options beside its shim link), which the shim
/// reads at each Create: unlike a drop-in, changing it needs no containerd restart.
pub fn is_side_file(path: &Path) -> bool {
    path.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
        dropin::SOURCES
            .iter()
            .any(|s| n == format!("{}.toml", s.binary))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> (PathBuf, impl Fn(&Path) -> PathBuf) {
        (PathBuf::from("/usr/local/bin"), |p: &Path| {
            Path::new("/host").join(p.strip_prefix("/").unwrap())
        })
    }

    /// [`plan`] for the test target.
    fn plan_here(args: &SiteArgs) -> Result<Vec<SiteFile>> {
        let (bin, f) = target();
        plan(
            args,
            &Target {
                bin_dir: &bin,
                for_containerd: &f,
                nccl_layer: None,
            },
        )
    }

    fn text(files: &[SiteFile], path: &str) -> String {
        let f = files
            .iter()
            .find(|f| f.path == Path::new(path))
            .unwrap_or_else(|| panic!("no {path} in {files:?}"));
        match &f.content {
            Content::Bytes(b) => String::from_utf8(b.clone()).unwrap(),
            Content::Link(l) => format!("-> {}", l.display()),
        }
    }

    #[test]
    fn no_site_options_give_the_two_side_files_and_the_restore_link() {
        let (bin, f) = target();
        let files = plan(
            &SiteArgs::default(),
            &Target {
                bin_dir: &bin,
                for_containerd: &f,
                nccl_layer: None,
            },
        )
        .unwrap();
        assert_eq!(files.len(), 3, "{files:?}");
        let restore = text(
            &files,
            "/usr/local/bin/containerd-shim-gpu-ckpt-restore-v1.toml",
        );
        assert!(restore.ends_with("Mode = \"restore\"\n"), "{restore}");
        let main = text(&files, "/usr/local/bin/containerd-shim-gpu-ckpt-v1.toml");
        assert!(!main.contains('='), "{main}");
        assert_eq!(
            text(&files, "/usr/local/bin/containerd-shim-gpu-ckpt-restore-v1"),
            "-> containerd-shim-gpu-ckpt-v1"
        );
        assert!(is_side_file(Path::new(
            "/x/containerd-shim-gpu-ckpt-v1.toml"
        )));
        assert!(!is_side_file(Path::new(
            "/etc/containerd/conf.d/gpu-ckpt.toml"
        )));
    }

    #[test]
    fn every_option_lands_in_its_file_and_a_revoked_key_is_never_trusted() {
        let d = tempfile::tempdir().unwrap();
        let seed = [7u8; 32];
        let key_file = d.path().join("signing.key");
        std::fs::write(&key_file, format!("{}\n", hex::encode(seed))).unwrap();
        let auth = d.path().join(".dockerconfigjson");
        std::fs::write(&auth, r#"{"auths":{"reg:5443":{"auth":"eDp5"}}}"#).unwrap();
        let ca = d.path().join("ca.pem");
        std::fs::write(
            &ca,
            "-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let a = [1u8; 32];
        let b = [2u8; 32];
        let args = SiteArgs {
            site_dir: None,
            signing_key: Some(key_file),
            trusted_keys: vec![
                format!("node-a={}", hex::encode(a)),
                format!("node-b=ed25519:{}", hex::encode(b)),
            ],
            revoked_keys: vec![key_id(&b)],
            restore_sources: vec![
                "/var/lib/kubelet/checkpoints/".into(),
                "reg:5443/ckpt/".into(),
            ],
            registry_auth: Some(auth),
            registry_cas: vec![format!("reg:5443={}", ca.display())],
            runc_path: Some("/usr/bin/runc".into()),
            runc_systemd_cgroup: true,
            handler_options: Some(
                r#"{"DeviceLockTimeout":"45s","AllowUnsigned":false,"NamespaceMoves":["a/b"]}"#
                    .into(),
            ),
        };
        let (bin, f) = target();
        let files = plan(
            &args,
            &Target {
                bin_dir: &bin,
                for_containerd: &f,
                nccl_layer: None,
            },
        )
        .unwrap();
        for f in &files {
            if matches!(f.content, Content::Bytes(_)) {
                assert_eq!(f.mode, 0o600, "{}", f.path.display());
            }
        }
        let public = ed25519_dalek::SigningKey::from_bytes(&seed)
            .verifying_key()
            .to_bytes();
        assert_eq!(
            text(&files, "/etc/gpu-ckpt/cluster-key/node.pub"),
            format!("{}\n", hex::encode(public))
        );
        assert_eq!(
            text(&files, "/etc/gpu-ckpt/trusted/node-a.pub"),
            format!("{}\n", hex::encode(a))
        );
        assert!(
            !files.iter().any(|f| f.path.ends_with("node-b.pub")),
            "a revoked key is written as trusted"
        );
        assert!(text(&files, "/etc/gpu-ckpt/revoked").contains(&key_id(&b)));
        let side = |binary: &str| -> DocumentMut {
            text(&files, &format!("/usr/local/bin/{binary}.toml"))
                .parse()
                .unwrap()
        };
        let main = side("containerd-shim-gpu-ckpt-v1");
        let restore = side("containerd-shim-gpu-ckpt-restore-v1");
        for (doc, key, want) in [
            (
                &main,
                "SigningKey",
                "/host/etc/gpu-ckpt/cluster-key/node.key",
            ),
            (&main, "TrustedKeysDir", "/host/etc/gpu-ckpt/trusted"),
            (&main, "RevokedKeysFile", "/host/etc/gpu-ckpt/revoked"),
            (&main, "DeviceLockTimeout", "45s"),
            (&restore, "Mode", "restore"),
            (
                &restore,
                "RegistryAuthFile",
                "/host/etc/gpu-ckpt/registry/auth.json",
            ),
            (&restore, "RegistryHostsDir", "/host/etc/gpu-ckpt/certs.d"),
        ] {
            assert_eq!(doc[key].as_str(), Some(want), "{key}");
        }
        assert!(main.get("RestoreSources").is_none() && main.get("Mode").is_none());
        assert_eq!(restore["RestoreSources"].as_array().unwrap().len(), 2);
        assert_eq!(restore["NamespaceMoves"].as_array().unwrap().len(), 1);
        assert!(
            text(&files, "/etc/gpu-ckpt/certs.d/reg:5443/hosts.toml").contains("ca = \"ca.crt\"")
        );
        assert_eq!(
            args.runc(),
            Runc {
                binary_name: Some("/usr/bin/runc".into()),
                systemd_cgroup: true
            }
        );
    }

    /// What the shim would refuse at every Create is refused at install: a key it does not know
    /// (case-sensitively, as it reads them), a value it refuses.
    #[test]
    fn handler_options_the_shim_refuses_are_refused_at_install() {
        for (opts, needle) in [
            (r#"{"mode":"restore"}"#, "unknown field `mode`"),
            (r#"{"Bogus":1}"#, "unknown field `Bogus`"),
            (r#"{"TcpMode":"sometimes"}"#, "invalid TcpMode"),
            (r#"{"RestoreStagingDir":"rel"}"#, "RestoreStagingDir"),
        ] {
            let args = SiteArgs {
                handler_options: Some(opts.into()),
                ..Default::default()
            };
            let err = plan_here(&args).unwrap_err().to_string();
            assert!(err.contains(needle), "{opts}: {err}");
        }
    }

    /// A cluster signing key that the values also revoke: every node would sign with a key
    /// every node refuses.
    #[test]
    fn a_revoked_cluster_key_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let seed = [9u8; 32];
        let key_file = d.path().join("signing.key");
        std::fs::write(&key_file, format!("{}\n", hex::encode(seed))).unwrap();
        let public = ed25519_dalek::SigningKey::from_bytes(&seed)
            .verifying_key()
            .to_bytes();
        let args = SiteArgs {
            signing_key: Some(key_file),
            revoked_keys: vec![hex::encode(public)],
            ..Default::default()
        };
        let err = plan_here(&args).unwrap_err().to_string();
        assert!(
            err.contains("cluster signing key") && err.contains(&key_id(&public)),
            "{err}"
        );
    }

    /// With every trusted key revoked no key file is written, and no side file names the
    /// trusted-keys directory.
    #[test]
    fn no_trusted_keys_dir_without_a_trusted_key() {
        let b = [2u8; 32];
        let args = SiteArgs {
            trusted_keys: vec![format!("node-b={}", hex::encode(b))],
            revoked_keys: vec![key_id(&b)],
            ..Default::default()
        };
        let files = plan_here(&args).unwrap();
        assert!(!files
            .iter()
            .any(|f| f.path.starts_with("/etc/gpu-ckpt/trusted")));
        for binary in [SHIM_BINARY, "containerd-shim-gpu-ckpt-restore-v1"] {
            let side = text(&files, &format!("/usr/local/bin/{binary}.toml"));
            assert!(!side.contains("TrustedKeysDir"), "{side}");
            assert!(side.contains("RevokedKeysFile"), "{side}");
        }
    }

    /// The site's `hosts.toml` serves pushes through the site's CA too: the host may push, and
    /// the `server` (where containerd's and gpu-ckpt's push falls back) carries the CA.
    #[test]
    fn the_sites_hosts_toml_lets_push_use_the_ca() {
        let d = tempfile::tempdir().unwrap();
        let ca = d.path().join("ca.pem");
        std::fs::write(
            &ca,
            "-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let args = SiteArgs {
            registry_cas: vec![format!("reg:5443={}", ca.display())],
            ..Default::default()
        };
        let files = plan_here(&args).unwrap();
        let doc: DocumentMut = text(&files, "/etc/gpu-ckpt/certs.d/reg:5443/hosts.toml")
            .parse()
            .unwrap();
        assert_eq!(doc["ca"].as_str(), Some("ca.crt"));
        let host = &doc["host"]["https://reg:5443"];
        assert_eq!(host["ca"].as_str(), Some("ca.crt"));
        let caps: Vec<&str> = host["capabilities"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|c| c.as_str())
            .collect();
        assert_eq!(caps, ["pull", "resolve", "push"]);
    }

    #[test]
    fn bad_inputs_are_named() {
        let (bin, f) = target();
        let t = Target {
            bin_dir: &bin,
            for_containerd: &f,
            nccl_layer: None,
        };
        let base = SiteArgs::default();
        for (args, needle) in [
            (
                SiteArgs {
                    trusted_keys: vec!["a=xyz".into()],
                    ..base.clone()
                },
                "--trusted-key a",
            ),
            (
                SiteArgs {
                    trusted_keys: vec!["../a=".to_string() + &"0".repeat(64)],
                    ..base.clone()
                },
                "name",
            ),
            (
                SiteArgs {
                    revoked_keys: vec!["nope".into()],
                    ..base.clone()
                },
                "--revoked-key \"nope\"",
            ),
            (
                SiteArgs {
                    handler_options: Some(r#"{"Mode":"x"}"#.into()),
                    ..base.clone()
                },
                "handler option Mode",
            ),
            (
                SiteArgs {
                    handler_options: Some(r#"{"BinaryName":"x"}"#.into()),
                    ..base.clone()
                },
                "runc option",
            ),
            (
                SiteArgs {
                    handler_options: Some(r#"{"RegistryHostsDir":"/x"}"#.into()),
                    registry_cas: vec!["reg=/nonexistent".into()],
                    ..base.clone()
                },
                "handler option RegistryHostsDir: set by the installer from --registry-ca",
            ),
            (
                SiteArgs {
                    handler_options: Some("[1]".into()),
                    ..base.clone()
                },
                "not a JSON object",
            ),
            (
                SiteArgs {
                    signing_key: Some("/nonexistent/k".into()),
                    ..base.clone()
                },
                "--signing-key /nonexistent/k",
            ),
        ] {
            let err = plan(&args, &t).unwrap_err().to_string();
            assert!(err.contains(needle), "{needle}: {err}");
        }
    }
}
