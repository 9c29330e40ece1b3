//! The one registry client: pushes checkpoint images and pulls their archives over the OCI
//! distribution API, through the `oci-client` crate (reqwest + rustls).
//!
//! - Transport: HTTPS with the system's trust store, plus containerd's per-registry host
//!   directory (the `certs.d` layout, [`HostsDir`]): `DIR/HOST[:PORT]/hosts.toml` (`server`,
//!   `[host."URL"]` with `ca`, `skip_verify`, `capabilities`) or plain `*.crt` files. Plain HTTP
//!   only for a localhost registry without a `hosts.toml`, and for hosts that `hosts.toml` names
//!   with `http://`, as containerd does.
//! - Mirrors: a pull tries the `hosts.toml` hosts that may pull, in the order written, then
//!   `server`, moving to the next on any error of a host (refused connection, TLS, 401/403, not
//!   found, a bad manifest or blob), as containerd's resolver does; it fails only when every host
//!   failed, naming each. A push goes to the first host that may push, and only there: no
//!   fallback (containerd's pusher too takes the first push host).
//! - Logins: a docker-style auth file ([`AuthFile`]: `--authfile`, `$REGISTRY_AUTH_FILE`,
//!   `$DOCKER_CONFIG/config.json`, `~/.docker/config.json`) read with `docker_credential`, so
//!   `auths`, `credHelpers` and `credsStore` work; basic and bearer-token challenges are
//!   `oci-client`'s.
//! - Errors name the registry and the cause ([`Error::Registry`]).
//!
//! `oci-client` is async; the functions here are synchronous and run it on a private
//! current-thread runtime in a thread of their own, so they may be called from any thread,
//! a tokio runtime's included, without nesting runtimes.

use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference, RegistryOperation};
use sha2::{Digest, Sha256};
use tracing::{debug, info_span, warn};

use crate::digest::{Progress, COPY_BUF};
use crate::error::{Error, Result};
use crate::oci::{self, ImageManifest, MEDIA_LAYER_TAR, MEDIA_MANIFEST};
use crate::safe::Limits;

/// containerd's default host directory, the CLI's default `--hosts-dir`.
pub const DEFAULT_HOSTS_DIR: &str = "/etc/containerd/certs.d";

/// Largest image manifest a pull accepts.
const MAX_MANIFEST_DOC: usize = 4 << 20;

/// Where the client finds its TLS settings and logins.
#[derive(Debug, Clone, Default)]
pub struct RegistryOptions {
    /// containerd's host directory (`certs.d` layout). `None`: no per-registry settings.
    pub hosts_dir: Option<PathBuf>,
    /// The docker-style auth file. `None`: the first of `$REGISTRY_AUTH_FILE`,
    /// `$DOCKER_CONFIG/config.json`, `~/.docker/config.json` that exists, else anonymous.
    pub auth_file: Option<PathBuf>,
}

fn reg_err(registry: &str, reason: impl Into<String>) -> Error {
    Error::Registry {
        url: registry.to_string(),
        reason: reason.into(),
    }
}

/// What a host of the host directory may do (`capabilities` in `hosts.toml`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Need {
    Pull,
    Push,
}

impl Need {
    fn capability(self) -> &'static str {
        match self {
            Need::Pull => "pull",
            Need::Push => "push",
        }
    }
}

/// The endpoint a registry name resolves to through the host directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// "https" or "http".
    pub scheme: String,
    /// `host[:port]` to connect to (the registry itself, or a mirror).
    pub host: String,
    /// PEM CA files trusted on top of the system's store.
    pub ca: Vec<PathBuf>,
    pub skip_verify: bool,
    /// Client certificate and key files, if the host directory names any.
    pub client: Vec<PathBuf>,
    /// Where these settings came from (for errors), or "default".
    pub origin: String,
}

fn is_localhost(registry: &str) -> bool {
    let host = match registry.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) => h,
        _ => registry,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// A per-registry table of `hosts.toml` (the top level for `server`, or a `[host."URL"]`).
#[derive(Debug, Default, serde::Deserialize)]
struct HostTable {
    #[serde(default)]
    capabilities: Option<Vec<String>>,
    #[serde(default)]
    ca: Option<StrOrList>,
    #[serde(default)]
    client: Option<toml::Value>,
    #[serde(default)]
    skip_verify: Option<bool>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(untagged)]
enum StrOrList {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, serde::Deserialize)]
struct HostsToml {
    server: Option<String>,
    #[serde(flatten)]
    top: HostTable,
    #[serde(default)]
    host: std::collections::BTreeMap<String, HostTable>,
}

/// `client` is a path, a list of paths, or a list of `[cert, key]` pairs.
fn client_files(v: &toml::Value, dir: &Path) -> Vec<PathBuf> {
    match v {
        toml::Value::String(s) => vec![rel(dir, s)],
        toml::Value::Array(a) => a.iter().flat_map(|x| client_files(x, dir)).collect(),
        _ => Vec::new(),
    }
}

fn rel(dir: &Path, p: &str) -> PathBuf {
    let p = Path::new(p);
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        dir.join(p)
    }
}

/// Splits `scheme://host[:port][/path]` into (scheme, host).
fn split_url(url: &str) -> Option<(String, String)> {
    let (scheme, rest) = url.split_once("://")?;
    let host = rest.split('/').next().unwrap_or_default();
    if host.is_empty() || !matches!(scheme, "http" | "https") {
        return None;
    }
    Some((scheme.to_string(), host.to_string()))
}

/// The order of the `[host."URL"]` tables in the file (TOML tables carry no order once parsed;
/// containerd tries them in the order written).
fn host_order(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| {
            let l = l.trim();
            let inner = l.strip_prefix("[host.")?.strip_suffix(']')?.trim();
            Some(inner.trim_matches(|c| c == '"' || c == '\'').to_string())
        })
        .collect()
}

/// Resolves `registry` through the host directory for the operation `need`: every endpoint that
/// may serve it, in the order containerd tries them (the `[host."URL"]` tables with the capability
/// in the order written, then `server` if it has it; a URL listed twice is tried once). Never
/// empty: a `hosts.toml` where no host may is an error; without one there is one endpoint, the
/// registry itself (with the docker layout's files, if any).
fn resolve(hosts_dir: Option<&Path>, registry: &str, need: Need) -> Result<Vec<Endpoint>> {
    let default = || Endpoint {
        scheme: "https".into(),
        host: registry.to_string(),
        ca: Vec::new(),
        skip_verify: false,
        client: Vec::new(),
        origin: "default".into(),
    };
    let Some(root) = hosts_dir else {
        return Ok(vec![default()]);
    };
    // containerd's directory name for a host: `host:port` as is.
    let mut dir = root.join(registry);
    if !dir.is_dir() {
        dir = root.join("_default");
        if !dir.is_dir() {
            return Ok(vec![default()]);
        }
    }
    let toml_path = dir.join("hosts.toml");
    if toml_path.is_file() {
        let body =
            fs::read_to_string(&toml_path).map_err(|e| Error::io("reading", &toml_path, e))?;
        let parsed: HostsToml = toml::from_str(&body).map_err(|e| {
            reg_err(
                registry,
                format!("{}: {}", toml_path.display(), e.message()),
            )
        })?;
        let origin = toml_path.display().to_string();
        let make = |url: &str, t: &HostTable| -> Result<Option<Endpoint>> {
            let (scheme, host) = split_url(url).ok_or_else(|| {
                reg_err(
                    registry,
                    format!("{origin}: {url:?} is not an http:// or https:// URL"),
                )
            })?;
            let caps = t
                .capabilities
                .clone()
                .unwrap_or_else(|| vec!["pull".into(), "resolve".into(), "push".into()]);
            if !caps.iter().any(|c| c == need.capability()) {
                return Ok(None);
            }
            Ok(Some(Endpoint {
                scheme,
                host,
                ca: t
                    .ca
                    .as_ref()
                    .map(|c| match c {
                        StrOrList::One(s) => vec![rel(&dir, s)],
                        StrOrList::Many(v) => v.iter().map(|s| rel(&dir, s)).collect(),
                    })
                    .unwrap_or_default(),
                skip_verify: t.skip_verify.unwrap_or(false),
                client: t
                    .client
                    .as_ref()
                    .map(|v| client_files(v, &dir))
                    .unwrap_or_default(),
                origin: origin.clone(),
            }))
        };
        let mut found: Vec<Endpoint> = Vec::new();
        let mut add = |e: Option<Endpoint>| {
            // A URL listed twice (commonly a host that is also the `server`) is tried once, with
            // the settings of its first table.
            if let Some(e) = e.filter(|e| {
                !found
                    .iter()
                    .any(|f| f.scheme == e.scheme && f.host == e.host)
            }) {
                found.push(e);
            }
        };
        for url in host_order(&body) {
            if let Some(t) = parsed.host.get(&url) {
                add(make(&url, t)?);
            }
        }
        let server = parsed
            .server
            .clone()
            .unwrap_or_else(|| format!("https://{registry}"));
        add(make(&server, &parsed.top)?);
        if found.is_empty() {
            return Err(reg_err(
                registry,
                format!("{origin}: no host may {} (capabilities)", need.capability()),
            ));
        }
        return Ok(found);
    }
    // The docker layout: `*.crt` are CAs, `*.cert` with `*.key` a client certificate.
    let mut e = default();
    e.scheme = "https".into();
    e.origin = dir.display().to_string();
    let rd = fs::read_dir(&dir).map_err(|x| Error::io("reading", &dir, x))?;
    let mut names: Vec<PathBuf> = rd.filter_map(|d| d.ok().map(|d| d.path())).collect();
    names.sort();
    for p in names {
        match p.extension().and_then(|x| x.to_str()) {
            Some("crt") => e.ca.push(p),
            Some("cert") | Some("key") => e.client.push(p),
            _ => {}
        }
    }
    Ok(vec![e])
}

/// Where logins come from.
#[derive(Debug, Clone)]
pub struct AuthFile {
    pub path: Option<PathBuf>,
}

impl AuthFile {
    /// The explicit file, else the first of `$REGISTRY_AUTH_FILE`, `$DOCKER_CONFIG/config.json`,
    /// `~/.docker/config.json` that exists.
    pub fn find(explicit: Option<&Path>) -> AuthFile {
        if let Some(p) = explicit {
            return AuthFile {
                path: Some(p.to_path_buf()),
            };
        }
        let env = |k: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let candidates = [
            env("REGISTRY_AUTH_FILE"),
            env("DOCKER_CONFIG").map(|d| d.join("config.json")),
            env("HOME").map(|h| h.join(".docker").join("config.json")),
        ];
        AuthFile {
            path: candidates.into_iter().flatten().find(|p| p.is_file()),
        }
    }

    /// The login for `registry`, anonymous when the file has none for it.
    fn login(&self, registry: &str) -> Result<RegistryAuth> {
        let Some(path) = &self.path else {
            return Ok(RegistryAuth::Anonymous);
        };
        let f = File::open(path)
            .map_err(|e| reg_err(registry, format!("auth file {}: {e}", path.display())))?;
        use docker_credential::{CredentialRetrievalError as C, DockerCredential as D};
        match docker_credential::get_credential_from_reader(std::io::BufReader::new(f), registry) {
            Ok(D::UsernamePassword(u, p)) => Ok(RegistryAuth::Basic(u, p)),
            Ok(D::IdentityToken(_)) => Err(reg_err(
                registry,
                format!(
                    "auth file {}: holds an identity token for {registry}, which this client cannot exchange; log in with a user name and password or a credential helper",
                    path.display()
                ),
            )),
            Err(C::NoCredentialConfigured) => Ok(RegistryAuth::Anonymous),
            Err(e) => Err(reg_err(
                registry,
                format!("auth file {}: {}", path.display(), e.to_string().trim()),
            )),
        }
    }

    fn describe(&self) -> String {
        match &self.path {
            Some(p) => format!("auth file {}", p.display()),
            None => "no auth file (none given, none at $REGISTRY_AUTH_FILE, $DOCKER_CONFIG/config.json or ~/.docker/config.json)".into(),
        }
    }
}

/// The login for a registry and where it came from (for errors).
struct Login {
    auth: RegistryAuth,
    origin: String,
}

impl Login {
    /// The login for `registry` from the auth file of `opts`.
    fn find(registry: &str, opts: &RegistryOptions) -> Result<Login> {
        let file = AuthFile::find(opts.auth_file.as_deref());
        Ok(Login {
            auth: file.login(registry)?,
            origin: file.describe(),
        })
    }
}

/// One session with one registry: the endpoint, the login and the client.
struct Session {
    registry: String,
    endpoint: Endpoint,
    /// A localhost registry without host settings: HTTPS first, plain HTTP when it answers in
    /// plain HTTP (containerd's fallback for localhost).
    http_fallback: bool,
    config: ClientSettings,
    auth: RegistryAuth,
    auth_origin: String,
    client: Client,
    reference: Reference,
}

impl Session {
    /// A session with `endpoint`, one of the endpoints [`resolve`] gives for the registry of
    /// `reference`, with the registry's `login` (the same for every endpoint).
    fn open(reference: &str, endpoint: Endpoint, login: &Login) -> Result<Session> {
        let (registry, repo, tag) = oci::split_reference(reference)?;
        if !endpoint.client.is_empty() {
            return Err(reg_err(
                &registry,
                format!(
                    "{} names client certificates ({}), which this client does not support",
                    endpoint.origin,
                    endpoint
                        .client
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        let mut roots = Vec::new();
        for ca in &endpoint.ca {
            let data = fs::read(ca).map_err(|e| {
                reg_err(
                    &registry,
                    format!("CA {} from {}: {e}", ca.display(), endpoint.origin),
                )
            })?;
            roots.push(Certificate {
                encoding: if data.starts_with(b"-----") {
                    CertificateEncoding::Pem
                } else {
                    CertificateEncoding::Der
                },
                data,
            });
        }
        // reqwest is built without a default crypto provider; rustls's ring is it, for the
        // whole process (a second install is refused and changes nothing).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut mirror = None;
        if endpoint.host != registry {
            mirror = Some(endpoint.host.clone());
        }
        let settings = ClientSettings {
            skip_verify: endpoint.skip_verify,
            roots,
        };
        let http_fallback = endpoint.origin == "default" && is_localhost(&registry);
        let client = settings.client(&endpoint.scheme == "http", &registry)?;
        let mut r = Reference::with_tag(registry.clone(), repo, tag);
        if let Some(m) = mirror {
            r.set_mirror_registry(m);
        }
        debug!(%registry, endpoint = %format!("{}://{}", endpoint.scheme, endpoint.host), origin = %endpoint.origin, "registry endpoint");
        Ok(Session {
            registry,
            endpoint,
            http_fallback,
            config: settings,
            auth_origin: login.origin.clone(),
            auth: login.auth.clone(),
            client,
            reference: r,
        })
    }

    /// Turns the client's error into one line naming the registry and the cause.
    fn explain(&self, what: &str, e: OciDistributionError) -> Error {
        let status = status_of(&e);
        let reason = if status == Some(401) || status == Some(403) {
            match &self.auth {
                RegistryAuth::Anonymous => format!(
                    "{what}: the registry asks for a login and there are no credentials for {} ({})",
                    self.registry, self.auth_origin
                ),
                RegistryAuth::Basic(u, _) => format!(
                    "{what}: credentials refused for user {u:?} ({})",
                    self.auth_origin
                ),
                RegistryAuth::Bearer(_) => {
                    format!("{what}: token refused ({})", self.auth_origin)
                }
            }
        } else if status == Some(404) {
            format!("{what}: {} not found", self.reference_name())
        } else if let Some(why) = certificate_problem(&e) {
            let trust = if self.endpoint.ca.is_empty() {
                "the system's trust store; no CA for this host in the host directory".to_string()
            } else {
                format!(
                    "the system's trust store and {}",
                    self.endpoint
                        .ca
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            };
            format!("{what}: the server certificate does not verify ({why}) against {trust}")
        } else {
            format!("{what}: {}", chain(&e))
        };
        let at = if self.endpoint.host == self.registry {
            format!("{}://{}", self.endpoint.scheme, self.registry)
        } else {
            format!(
                "{} (via {}://{})",
                self.registry, self.endpoint.scheme, self.endpoint.host
            )
        };
        reg_err(&at, reason)
    }

    fn reference_name(&self) -> String {
        format!(
            "{}/{}:{}",
            self.registry,
            self.reference.repository(),
            self.reference.tag().unwrap_or("latest")
        )
    }

    /// The first request (`GET /v2/` and the login it asks for). A localhost registry that
    /// answers HTTPS with plain HTTP is spoken to over plain HTTP from then on.
    async fn login(&mut self, op: RegistryOperation) -> Result<()> {
        match self.client.auth(&self.reference, &self.auth, op).await {
            Ok(_) => Ok(()),
            Err(e) if self.http_fallback && status_of(&e).is_none() && plain_http_answer(&e) => {
                debug!(registry = %self.registry, "localhost registry answers plain HTTP");
                self.endpoint.scheme = "http".into();
                self.http_fallback = false;
                self.client = self.config.client(true, &self.registry)?;
                self.client
                    .auth(&self.reference, &self.auth, op)
                    .await
                    .map(|_| ())
                    .map_err(|e| self.explain("login", e))
            }
            Err(e) => Err(self.explain("login", e)),
        }
    }
}

/// What a client is made of besides the scheme.
struct ClientSettings {
    skip_verify: bool,
    roots: Vec<Certificate>,
}

impl ClientSettings {
    fn client(&self, http: bool, registry: &str) -> Result<Client> {
        let config = ClientConfig {
            protocol: if http {
                ClientProtocol::Http
            } else {
                ClientProtocol::Https
            },
            accept_invalid_certificates: self.skip_verify,
            use_monolithic_push: true,
            extra_root_certificates: self.roots.clone(),
            connect_timeout: Some(Duration::from_secs(30)),
            read_timeout: Some(Duration::from_secs(300)),
            max_concurrent_download: 1,
            max_concurrent_upload: 1,
            ..Default::default()
        };
        Client::try_from(config)
            .map_err(|e| reg_err(registry, format!("making the client: {}", chain(&e))))
    }
}

/// Whether a TLS handshake failed because the server answered in plain HTTP.
fn plain_http_answer(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        let inner = err
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|x| x.downcast_ref::<rustls::Error>())
            .or_else(|| err.downcast_ref::<rustls::Error>());
        if let Some(r) = inner {
            return matches!(
                r,
                rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateMessage { .. }
            );
        }
        cur = err.source();
    }
    let text = chain(e);
    text.contains("InvalidContentType") || text.contains("corrupt message")
}

/// The HTTP status behind an error, where there is one.
fn status_of(e: &OciDistributionError) -> Option<u16> {
    match e {
        OciDistributionError::UnauthorizedError { .. } => Some(401),
        OciDistributionError::AuthenticationFailure(_) => Some(401),
        OciDistributionError::ImageManifestNotFoundError(_) => Some(404),
        OciDistributionError::ServerError { code, .. } => Some(*code),
        OciDistributionError::RequestError(r) => r.status().map(|s| s.as_u16()),
        OciDistributionError::RegistryError { envelope, .. } => {
            envelope.errors.iter().find_map(|x| match x.code {
                OciErrorCode::Unauthorized => Some(401),
                OciErrorCode::Denied => Some(403),
                OciErrorCode::ManifestUnknown
                | OciErrorCode::NameUnknown
                | OciErrorCode::BlobUnknown => Some(404),
                _ => None,
            })
        }
        _ => None,
    }
}

/// Why the server's certificate was refused, if that is what happened.
fn certificate_problem(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        let found = err.downcast_ref::<rustls::Error>().or_else(|| {
            err.downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|x| x.downcast_ref::<rustls::Error>())
        });
        if let Some(rustls::Error::InvalidCertificate(c)) = found {
            return Some(describe_certificate_error(c));
        }
        cur = err.source();
    }
    // reqwest may hand the TLS error on as text only.
    let text = chain(e);
    let at = text.find("invalid peer certificate: ")?;
    let name = text[at + "invalid peer certificate: ".len()..]
        .split([' ', ':', '(', '{', ')'])
        .next()
        .unwrap_or_default();
    Some(with_words(name))
}

/// rustls's verdict on a certificate, with its name.
fn describe_certificate_error(c: &rustls::CertificateError) -> String {
    let name = format!("{c:?}");
    with_words(name.split([' ', '{', '(']).next().unwrap_or_default())
}

/// A rustls certificate error's name, with what it means in words where it is a common one.
fn with_words(name: &str) -> String {
    let words = match name {
        "UnknownIssuer" => "signed by a CA that is not trusted",
        "Expired" | "ExpiredContext" => "expired",
        "NotValidYet" | "NotValidYetContext" => "not valid yet",
        "NotValidForName" | "NotValidForNameContext" => "not issued for this host name",
        "Revoked" => "revoked",
        "BadSignature" => "bad signature",
        "InvalidPurpose" | "InvalidPurposeContext" => "not issued for TLS servers",
        _ => return name.to_string(),
    };
    format!("{name}: {words}")
}

/// An error with its causes, on one line, repeats dropped.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        let s = err.to_string().replace('\n', " ");
        if !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
        cur = err.source();
    }
    parts.join(": ")
}

/// Runs `f` on a private current-thread runtime in a thread of its own, calling `progress` with
/// the bytes `f` counts in `done` (of `total`) about ten times a second meanwhile.
fn run_async<T, F>(
    done: Arc<AtomicU64>,
    total: &AtomicU64,
    progress: Progress<'_>,
    f: F,
) -> Result<T>
where
    T: Send,
    F: std::future::Future<Output = Result<T>> + Send,
{
    std::thread::scope(|s| {
        let worker = s.spawn(move || -> Result<T> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| Error::io("starting the registry client's runtime", "", e))?;
            rt.block_on(f)
        });
        while !worker.is_finished() {
            std::thread::sleep(Duration::from_millis(100));
            progress(done.load(Ordering::Relaxed), total.load(Ordering::Relaxed));
        }
        progress(done.load(Ordering::Relaxed), total.load(Ordering::Relaxed));
        worker
            .join()
            .unwrap_or_else(|_| Err(reg_err("", "the registry client's thread panicked")))
    })
}

/// A blob of an image on disk: file, offset and size.
fn blob_stream(
    path: PathBuf,
    offset: u64,
    size: u64,
    done: Arc<AtomicU64>,
) -> Result<
    impl futures_util::Stream<Item = oci_client::errors::Result<bytes::Bytes>> + Send + 'static,
> {
    let mut f = File::open(&path).map_err(|e| Error::io("opening", &path, e))?;
    f.seek(SeekFrom::Start(offset))
        .map_err(|e| Error::io("seeking in", &path, e))?;
    let r = f.take(size);
    Ok(futures_util::stream::unfold(r, move |mut r| {
        let done = done.clone();
        async move {
            let mut buf = vec![0u8; COPY_BUF];
            match r.read(&mut buf) {
                Ok(0) => None,
                Ok(k) => {
                    buf.truncate(k);
                    done.fetch_add(k as u64, Ordering::Relaxed);
                    Some((Ok(bytes::Bytes::from(buf)), r))
                }
                Err(e) => Some((Err(OciDistributionError::IoError(e)), r)),
            }
        }
    }))
}

/// Pushes an image (OCI layout directory or layout tarball) to the registry named in
/// `reference` (`host[:port]/name[:tag]`). Blobs the registry has are skipped. Returns the
/// manifest digest.
pub fn push_image(
    image: &Path,
    reference: &str,
    opts: &RegistryOptions,
    progress: Progress<'_>,
) -> Result<String> {
    let _span = info_span!("registry_push", %reference).entered();
    let (m, mdigest) = oci::read_image_manifest(image)?;
    let manifest_json = oci::read_image_blob(image, &mdigest, crate::archive::MAX_METADATA_BYTES)?;
    let mut blobs = vec![m.config.clone()];
    blobs.extend(m.layers.iter().cloned());
    let mut located = Vec::new();
    for b in &blobs {
        let (path, offset) = oci::blob_location(image, &b.digest)?;
        located.push((b.clone(), path, offset));
    }
    // The first host that may push, and only that one, as containerd's pusher does.
    let (registry, _, _) = oci::split_reference(reference)?;
    let endpoint = resolve(opts.hosts_dir.as_deref(), &registry, Need::Push)?
        .into_iter()
        .next()
        .ok_or_else(|| reg_err(&registry, "no host may push"))?;
    let login = Login::find(&registry, opts)?;
    let mut session = Session::open(reference, endpoint, &login)?;
    let done = Arc::new(AtomicU64::new(0));
    let total = AtomicU64::new(blobs.iter().map(|b| b.size).sum());
    let d2 = done.clone();
    let s = &mut session;
    run_async(done, &total, progress, async move {
        s.login(RegistryOperation::Push).await?;
        for (b, path, offset) in located {
            let exists = s
                .client
                .blob_exists(&s.reference, &b.digest)
                .await
                .map_err(|e| s.explain("checking for a blob", e))?;
            if exists {
                d2.fetch_add(b.size, Ordering::Relaxed);
                continue;
            }
            let stream = blob_stream(path, offset, b.size, d2.clone())?;
            s.client
                .push_blob_stream(&s.reference, stream, &b.digest, Some(b.size))
                .await
                .map_err(|e| s.explain(&format!("uploading blob {}", b.digest), e))?;
        }
        s.client
            .push_manifest_raw(&s.reference, manifest_json, http_header(MEDIA_MANIFEST))
            .await
            .map_err(|e| s.explain("putting the manifest", e))?;
        Ok(mdigest)
    })
}

fn http_header(v: &'static str) -> http::HeaderValue {
    http::HeaderValue::from_static(v)
}

/// Pulls a checkpoint image from a registry and writes its archive, the image's single layer,
/// to `out` (created new, mode 0600). The manifest must be a checkpoint image's (one
/// uncompressed layer, the checkpoint annotation); the layer must fit `limits` and is hashed
/// while it streams, refused unless it matches its digest and size. The registry's endpoints
/// (mirrors, then the server) are tried in turn, each with a session of its own, until one
/// serves the image; `out` is emptied before each next try. A refused pull leaves no file.
/// Returns the manifest digest.
pub fn pull_archive(
    reference: &str,
    out: &Path,
    limits: Limits,
    opts: &RegistryOptions,
    progress: Progress<'_>,
) -> Result<String> {
    let _span = info_span!("registry_pull", %reference).entered();
    let (registry, _, _) = oci::split_reference(reference)?;
    let endpoints = resolve(opts.hosts_dir.as_deref(), &registry, Need::Pull)?;
    // The login is the registry's, whichever host serves it: read once, before any file.
    let login = Login::find(&registry, opts)?;
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(out)
        .map_err(|e| Error::io("creating", out, e))?;
    let count = endpoints.len();
    let mut failed: Vec<(String, Error)> = Vec::new();
    let mut res = None;
    for (i, endpoint) in endpoints.into_iter().enumerate() {
        let at = format!("{}://{}", endpoint.scheme, endpoint.host);
        let emptied = if i == 0 { Ok(()) } else { empty(&mut f, out) };
        let attempt = emptied
            .and_then(|()| pull_from(reference, endpoint, &login, &mut f, out, limits, progress));
        match attempt {
            Ok(digest) => {
                res = Some(Ok(digest));
                break;
            }
            // Writing `out` failed: not the host's fault, and no other host would do better.
            Err(e @ Error::Io { .. }) => {
                res = Some(Err(e));
                break;
            }
            Err(e) => {
                if i + 1 < count {
                    warn!(
                        %registry, host = %at, error = %e,
                        "registry host failed, trying the next"
                    );
                }
                failed.push((at, e));
            }
        }
    }
    drop(f);
    let res = res.unwrap_or_else(|| Err(all_failed(&registry, failed)));
    if res.is_err() {
        let _ = fs::remove_file(out);
    }
    res
}

/// Empties the output file for the next endpoint's try.
fn empty(f: &mut File, out: &Path) -> Result<()> {
    f.set_len(0)
        .and_then(|()| f.seek(SeekFrom::Start(0)))
        .map(drop)
        .map_err(|e| Error::io("truncating", out, e))
}

/// The error of a pull that no endpoint served: with one endpoint, its own error; with several,
/// one line naming each host and why it failed.
fn all_failed(registry: &str, mut failed: Vec<(String, Error)>) -> Error {
    if failed.len() == 1 {
        if let Some((_, e)) = failed.pop() {
            return e;
        }
    }
    let each: Vec<String> = failed
        .into_iter()
        .map(|(at, e)| match e {
            // `explain` and the checks name the registry (and the mirror) first: said once here.
            Error::Registry { reason, .. } => format!("{at}: {reason}"),
            e => format!("{at}: {e}"),
        })
        .collect();
    reg_err(registry, format!("every host failed: {}", each.join("; ")))
}

/// One try of [`pull_archive`]: the image from `endpoint`, its layer written to `f` (empty).
fn pull_from(
    reference: &str,
    endpoint: Endpoint,
    login: &Login,
    f: &mut File,
    out: &Path,
    limits: Limits,
    progress: Progress<'_>,
) -> Result<String> {
    let mut session = Session::open(reference, endpoint, login)?;
    let done = Arc::new(AtomicU64::new(0));
    let total = AtomicU64::new(0);
    let d2 = done.clone();
    let s = &mut session;
    let t = &total;
    let fr = f;
    run_async(done, &total, progress, async move {
        s.login(RegistryOperation::Pull).await?;
        let (doc, mdigest) = s
            .client
            .pull_manifest_raw(&s.reference, &s.auth, &[MEDIA_MANIFEST])
            .await
            .map_err(|e| s.explain("getting the manifest", e))?;
        let name = s.reference_name();
        let not_ckpt = |why: String| {
            reg_err(
                &s.registry,
                format!("{name} is not a checkpoint image: {why}"),
            )
        };
        if doc.len() > MAX_MANIFEST_DOC {
            return Err(not_ckpt(format!(
                "its manifest is larger than {MAX_MANIFEST_DOC} bytes"
            )));
        }
        let m: ImageManifest = serde_json::from_slice(&doc)
            .map_err(|e| not_ckpt(format!("not an OCI image manifest ({e})")))?;
        check_checkpoint_manifest(&m, limits).map_err(not_ckpt)?;
        let layer = &m.layers[0];
        t.store(layer.size, Ordering::Relaxed);
        let mut stream = s
            .client
            .pull_blob_stream(&s.reference, layer.digest.as_str())
            .await
            .map_err(|e| s.explain(&format!("getting blob {}", layer.digest), e))?
            .stream;
        let mut hasher = Sha256::new();
        let mut n = 0u64;
        let blob_err = |why: String| reg_err(&s.registry, format!("blob {}: {why}", layer.digest));
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| blob_err(chain(&e)))?;
            n += chunk.len() as u64;
            if n > layer.size {
                return Err(blob_err(format!("larger than its {} bytes", layer.size)));
            }
            hasher.update(&chunk);
            fr.write_all(&chunk)
                .map_err(|e| Error::io("writing", out, e))?;
            d2.store(n, Ordering::Relaxed);
        }
        let got = format!("sha256:{}", hex::encode(hasher.finalize()));
        if n != layer.size || got != layer.digest {
            return Err(blob_err(format!(
                "does not match its digest and size ({got}, {n} bytes read, {} expected)",
                layer.size
            )));
        }
        fr.sync_all().map_err(|e| Error::io("syncing", out, e))?;
        Ok(mdigest)
    })
}

/// A checkpoint image's manifest: the checkpoint annotation, one uncompressed layer within the
/// limits.
fn check_checkpoint_manifest(m: &ImageManifest, limits: Limits) -> std::result::Result<(), String> {
    if !m.annotations.contains_key(oci::ANN_CONTAINERD_NAME)
        && !m.annotations.contains_key(oci::ANN_CRIO_NAME)
    {
        return Err(format!(
            "its manifest has no {} annotation",
            oci::ANN_CONTAINERD_NAME
        ));
    }
    let [layer] = m.layers.as_slice() else {
        return Err(format!(
            "a checkpoint image has one layer, this one has {}",
            m.layers.len()
        ));
    };
    if layer.media_type != MEDIA_LAYER_TAR {
        return Err(format!(
            "layer media type {} is not {MEDIA_LAYER_TAR}",
            layer.media_type
        ));
    }
    if layer.size > limits.max_total_bytes {
        return Err(format!(
            "its layer of {} bytes exceeds the limit of {} bytes",
            layer.size, limits.max_total_bytes
        ));
    }
    if !layer
        .digest
        .strip_prefix("sha256:")
        .is_some_and(crate::manifest::is_sha256_hex)
    {
        return Err(format!("layer digest {:?} is not sha256", layer.digest));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(host: &str, files: &[(&str, &str)]) -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join(host);
        fs::create_dir_all(&d).unwrap();
        for (n, c) in files {
            fs::write(d.join(n), c).unwrap();
        }
        t
    }

    /// The one endpoint of a resolution that has one.
    fn only(mut v: Vec<Endpoint>) -> Endpoint {
        assert_eq!(v.len(), 1, "{v:?}");
        v.remove(0)
    }

    /// `scheme://host` of each endpoint, in order.
    fn urls(v: &[Endpoint]) -> Vec<String> {
        v.iter()
            .map(|e| format!("{}://{}", e.scheme, e.host))
            .collect()
    }

    #[test]
    fn https_by_default_and_localhost_recognised() {
        let e = only(resolve(None, "localhost:5000", Need::Pull).unwrap());
        assert_eq!(
            (e.scheme.as_str(), e.host.as_str()),
            ("https", "localhost:5000")
        );
        assert_eq!(e.origin, "default");
        assert_eq!(
            only(resolve(None, "registry.example.com", Need::Pull).unwrap()).scheme,
            "https"
        );
        for h in [
            "localhost:5000",
            "127.0.0.1:5000",
            "[::1]:5000",
            "localhost",
        ] {
            assert!(is_localhost(h), "{h}");
        }
        for h in [
            "10.0.0.1:5000",
            "registry.example.com",
            "localhost.example.com",
        ] {
            assert!(!is_localhost(h), "{h}");
        }
    }

    #[test]
    fn hosts_toml_server_ca_and_skip_verify() {
        let t = dir_with(
            "reg.example:5443",
            &[(
                "hosts.toml",
                "server = \"https://reg.example:5443\"\nca = \"ca.pem\"\nskip_verify = false\n",
            )],
        );
        let e = only(resolve(Some(t.path()), "reg.example:5443", Need::Push).unwrap());
        assert_eq!(e.scheme, "https");
        assert_eq!(e.ca, vec![t.path().join("reg.example:5443/ca.pem")]);
        assert!(!e.skip_verify);
    }

    #[test]
    fn hosts_toml_hosts_in_order_by_capability() {
        let t = dir_with(
            "reg.example",
            &[(
                "hosts.toml",
                "server = \"https://reg.example\"\n\n[host.\"http://mirror.local:5000\"]\n  capabilities = [\"pull\", \"resolve\"]\n\n[host.\"https://a.local\"]\n  capabilities = [\"push\"]\n  skip_verify = true\n",
            )],
        );
        let pull = resolve(Some(t.path()), "reg.example", Need::Pull).unwrap();
        assert_eq!(
            urls(&pull),
            ["http://mirror.local:5000", "https://reg.example"]
        );
        let push = resolve(Some(t.path()), "reg.example", Need::Push).unwrap();
        assert_eq!(urls(&push), ["https://a.local", "https://reg.example"]);
        assert!(push[0].skip_verify);
        assert!(!push[1].skip_verify);
    }

    #[test]
    fn pull_tries_mirrors_in_file_order_then_the_server() {
        // Written out of alphabetical order: the file's order counts, not the table's.
        let t = dir_with(
            "reg.example:5443",
            &[(
                "hosts.toml",
                r#"server = "https://reg.example:5443"
ca = "server-ca.pem"

[host."https://z-mirror.local"]
  capabilities = ["pull", "resolve"]
  ca = "z.pem"

[host."http://a-mirror.local:5000"]
  capabilities = ["pull", "resolve"]

[host."https://push.local"]
  capabilities = ["push"]
"#,
            )],
        );
        let pull = resolve(Some(t.path()), "reg.example:5443", Need::Pull).unwrap();
        assert_eq!(
            urls(&pull),
            [
                "https://z-mirror.local",
                "http://a-mirror.local:5000",
                "https://reg.example:5443"
            ]
        );
        let dir = t.path().join("reg.example:5443");
        assert_eq!(pull[0].ca, vec![dir.join("z.pem")]);
        assert!(pull[1].ca.is_empty());
        assert_eq!(pull[2].ca, vec![dir.join("server-ca.pem")]);
        // The push-only host is no pull endpoint, and the only push endpoint before the server.
        let push = resolve(Some(t.path()), "reg.example:5443", Need::Push).unwrap();
        assert_eq!(
            urls(&push),
            ["https://push.local", "https://reg.example:5443"]
        );
    }

    #[test]
    fn a_server_without_the_capability_is_left_out() {
        let t = dir_with(
            "reg.example",
            &[(
                "hosts.toml",
                r#"server = "https://reg.example"
capabilities = ["push"]

[host."https://m1.local"]
  capabilities = ["pull", "resolve"]

[host."https://m2.local"]
  capabilities = ["pull", "resolve"]
"#,
            )],
        );
        let pull = resolve(Some(t.path()), "reg.example", Need::Pull).unwrap();
        assert_eq!(urls(&pull), ["https://m1.local", "https://m2.local"]);
        let push = resolve(Some(t.path()), "reg.example", Need::Push).unwrap();
        assert_eq!(urls(&push), ["https://reg.example"]);
        // No host at all may: the error of today.
        let none = dir_with(
            "reg.example",
            &[(
                "hosts.toml",
                "server = \"https://reg.example\"\ncapabilities = [\"pull\"]\n",
            )],
        );
        let e = resolve(Some(none.path()), "reg.example", Need::Push)
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("no host may push (capabilities)"), "{e}");
    }

    #[test]
    fn a_host_that_is_also_the_server_is_tried_once() {
        let t = dir_with(
            "reg.example:5443",
            &[(
                "hosts.toml",
                r#"server = "https://reg.example:5443"

[host."https://dead.local:1"]
  capabilities = ["pull", "resolve"]

[host."https://reg.example:5443"]
  capabilities = ["pull", "resolve", "push"]
  ca = "ca.pem"
"#,
            )],
        );
        let pull = resolve(Some(t.path()), "reg.example:5443", Need::Pull).unwrap();
        assert_eq!(
            urls(&pull),
            ["https://dead.local:1", "https://reg.example:5443"]
        );
        // The host's table, with its CA, not the server's.
        assert_eq!(pull[1].ca.len(), 1);
    }

    #[test]
    fn all_failed_is_the_one_error_or_one_line_naming_each_host() {
        let one = all_failed(
            "reg.example",
            vec![(
                "https://reg.example".into(),
                reg_err("https://reg.example", "login: refused"),
            )],
        );
        assert_eq!(
            one.to_string(),
            "registry https://reg.example: login: refused"
        );
        let two = all_failed(
            "reg.example",
            vec![
                (
                    "https://m.local:1".into(),
                    reg_err("reg.example (via https://m.local:1)", "login: refused"),
                ),
                (
                    "https://reg.example".into(),
                    reg_err("https://reg.example", "getting the manifest: x not found"),
                ),
            ],
        );
        assert_eq!(
            two.to_string(),
            "registry reg.example: every host failed: https://m.local:1: login: refused; \
             https://reg.example: getting the manifest: x not found"
        );
    }

    #[test]
    fn the_output_is_emptied_between_tries() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("out.tar");
        let mut f = File::create(&p).unwrap();
        f.write_all(b"half of a blob from a stale mirror").unwrap();
        empty(&mut f, &p).unwrap();
        f.write_all(b"ok").unwrap();
        drop(f);
        assert_eq!(fs::read(&p).unwrap(), b"ok");
    }

    /// A pull from hosts nothing listens on (loopback ports 1 and 2: refused at once).
    fn pull_dead(hosts_toml: &str, reference: &str) -> (String, bool) {
        let (registry, _, _) = oci::split_reference(reference).unwrap();
        let t = dir_with(&registry, &[("hosts.toml", hosts_toml)]);
        let out = t.path().join("out.tar");
        let opts = RegistryOptions {
            hosts_dir: Some(t.path().to_path_buf()),
            auth_file: Some(t.path().join("no-auth.json")),
        };
        fs::write(t.path().join("no-auth.json"), "{}").unwrap();
        let e = pull_archive(reference, &out, Limits::default(), &opts, &mut |_, _| {})
            .unwrap_err()
            .to_string();
        (e, out.exists())
    }

    #[test]
    fn a_pull_tries_every_host_and_names_each_when_all_fail() {
        let (e, left) = pull_dead(
            r#"server = "https://127.0.0.1:2"

[host."https://127.0.0.1:1"]
  capabilities = ["pull", "resolve"]
"#,
            "127.0.0.1:2/x/y:1",
        );
        assert!(!left, "a failed pull left its file");
        assert!(
            e.starts_with("registry 127.0.0.1:2: every host failed: https://127.0.0.1:1: login: "),
            "{e}"
        );
        assert!(e.contains("; https://127.0.0.1:2: login: "), "{e}");
        assert!(!e.contains('\n'), "{e}");
        // One host: its error as ever, no "every host failed".
        let (e, left) = pull_dead("server = \"https://127.0.0.1:1\"\n", "127.0.0.1:1/x/y:1");
        assert!(!left);
        assert!(
            e.starts_with("registry https://127.0.0.1:1: login: "),
            "{e}"
        );
    }

    #[test]
    fn docker_layout_crt_files_are_cas() {
        let t = dir_with(
            "reg.example",
            &[("ca.crt", "x"), ("client.cert", "c"), ("client.key", "k")],
        );
        let e = only(resolve(Some(t.path()), "reg.example", Need::Pull).unwrap());
        assert_eq!(e.ca.len(), 1);
        assert_eq!(e.client.len(), 2);
    }

    #[test]
    fn a_missing_host_dir_entry_is_the_default() {
        let t = tempfile::tempdir().unwrap();
        let e = only(resolve(Some(t.path()), "reg.example", Need::Pull).unwrap());
        assert_eq!(e.origin, "default");
    }

    #[test]
    fn auth_file_logins() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("auth.json");
        // "u:p" in base64
        fs::write(&p, r#"{"auths":{"reg.example:5443":{"auth":"dTpw"}}}"#).unwrap();
        let a = AuthFile::find(Some(&p));
        assert_eq!(
            a.login("reg.example:5443").unwrap(),
            RegistryAuth::Basic("u".into(), "p".into())
        );
        assert_eq!(a.login("other.example").unwrap(), RegistryAuth::Anonymous);
        let missing = AuthFile::find(Some(&t.path().join("nope.json")));
        let e = missing.login("reg.example").unwrap_err().to_string();
        assert!(e.contains("nope.json"), "{e}");
    }

    #[test]
    fn checkpoint_manifest_checks() {
        let layer = oci::Descriptor {
            media_type: MEDIA_LAYER_TAR.into(),
            digest: format!("sha256:{}", "a".repeat(64)),
            size: 10,
            annotations: Default::default(),
            platform: None,
        };
        let mut m = ImageManifest {
            schema_version: 2,
            media_type: MEDIA_MANIFEST.into(),
            config: layer.clone(),
            layers: vec![layer],
            annotations: Default::default(),
        };
        assert!(check_checkpoint_manifest(&m, Limits::default())
            .unwrap_err()
            .contains("annotation"));
        m.annotations
            .insert(oci::ANN_CONTAINERD_NAME.into(), "c".into());
        assert!(check_checkpoint_manifest(&m, Limits::default()).is_ok());
        let small = Limits {
            max_total_bytes: 5,
            ..Limits::default()
        };
        assert!(check_checkpoint_manifest(&m, small)
            .unwrap_err()
            .contains("exceeds"));
    }
}
