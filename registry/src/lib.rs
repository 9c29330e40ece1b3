//! The one registry client: pushes checkpoint images and pulls their archives over the OCI
//! distribution API, on reqwest and rustls, with every read bounded.
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
//!   `auths`, `credHelpers` and `credsStore` work. A login goes to the host it names and to no
//!   other: each endpoint (mirror or server) gets the login the file has for its own
//!   `host[:port]`, or none; a basic login goes over plain HTTP only to a loopback host; a
//!   bearer token service gets credentials only over HTTPS and only the login the file names
//!   for the token service's own host (the registry's, when it serves its own tokens).
//! - References: parsed by [`image_format::reference::ImageRef`] (the distribution grammar); a digest
//!   reference is fetched by digest and the manifest verified against it.
//! - Bounds: `/v2/`, token and error bodies are read up to 64 KiB, a manifest up to 4 MiB (a
//!   larger one is refused by its declared length or as soon as the bytes pass the limit,
//!   never buffered), the layer up to its declared size, and a whole pull ends at its deadline
//!   ([`RegistryOptions::pull_deadline`], default one hour); each error names the limit.
//! - Errors name the registry and the cause ([`Error::Registry`]).
//!
//! The HTTP client is async; the functions here are synchronous and run it on a private
//! current-thread runtime in a thread of their own, so they may be called from any thread,
//! a tokio runtime's included, without nesting runtimes.

use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tracing::{debug, info_span, warn};

use image_format::digest::{Progress, COPY_BUF};
use image_format::error::{Error, Result};
use image_format::oci::{self, ImageManifest, MEDIA_LAYER_TAR, MEDIA_MANIFEST};
use image_format::reference::ImageRef;
use image_format::safe::Limits;

/// containerd's default host directory, the CLI's default `--hosts-dir`.
pub const DEFAULT_HOSTS_DIR: &str = "/etc/containerd/certs.d";

/// Largest image manifest a pull accepts.
const MAX_MANIFEST_DOC: usize = 4 << 20;

/// Where the client finds its TLS settings and logins, and how long a pull may take.
#[derive(Debug, Clone, Default)]
pub struct RegistryOptions {
    /// containerd's host directory (`certs.d` layout). `None`: no per-registry settings.
    pub hosts_dir: Option<PathBuf>,
    /// The docker-style auth file. `None`: the first of `$REGISTRY_AUTH_FILE`,
    /// `$DOCKER_CONFIG/config.json`, `~/.docker/config.json` that exists, else anonymous.
    pub auth_file: Option<PathBuf>,
    /// How long a whole pull may take, every host tried included. `None`:
    /// [`DEFAULT_PULL_DEADLINE`].
    pub pull_deadline: Option<Duration>,
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

/// A login: a user name and password, or none.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Credential {
    Anonymous,
    Basic(String, String),
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

    /// The login the file names for exactly `host` (`host[:port]`, as containerd looks one up
    /// for the host it is about to contact), anonymous when it has none.
    fn login(&self, host: &str) -> Result<Credential> {
        let Some(path) = &self.path else {
            return Ok(Credential::Anonymous);
        };
        let f = File::open(path)
            .map_err(|e| reg_err(host, format!("auth file {}: {e}", path.display())))?;
        use docker_credential::{CredentialRetrievalError as C, DockerCredential as D};
        match docker_credential::get_credential_from_reader(std::io::BufReader::new(f), host) {
            Ok(D::UsernamePassword(u, p)) => Ok(Credential::Basic(u, p)),
            Ok(D::IdentityToken(_)) => Err(reg_err(
                host,
                format!(
                    "auth file {}: holds an identity token for {host}, which this client cannot exchange; log in with a user name and password or a credential helper",
                    path.display()
                ),
            )),
            Err(C::NoCredentialConfigured) => Ok(Credential::Anonymous),
            Err(e) => Err(reg_err(
                host,
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

/// What the client reads from a registry besides manifests and blobs (`/v2/` answers, token
/// answers, error bodies): at most this much of each.
const MAX_SMALL_BODY: usize = 64 << 10;

/// How long a whole pull may take, all hosts tried together, unless
/// [`RegistryOptions::pull_deadline`] says otherwise.
pub const DEFAULT_PULL_DEADLINE: Duration = Duration::from_secs(3600);

/// Why a request failed, before it is told in words by [`Session::explain`].
#[derive(Debug)]
enum Fail {
    /// The server (or its token service) answered with this status.
    Status { code: u16, said: String },
    /// No answer: the connection, TLS, a timeout.
    Transport(reqwest::Error),
    /// Anything else, said in full.
    Other(String),
}

/// The registry's operation, for the token's scope.
#[derive(Debug, Clone, Copy)]
enum Op {
    Pull,
    Push,
}

/// A `WWW-Authenticate` challenge.
#[derive(Debug, PartialEq, Eq)]
enum Challenge {
    Basic,
    Bearer {
        realm: String,
        service: Option<String>,
    },
}

/// Parses a `WWW-Authenticate` value: `Basic realm="…"` or `Bearer realm="…",service="…",…`.
fn parse_challenge(v: &str) -> Option<Challenge> {
    let v = v.trim();
    let (scheme, rest) = v.split_once(' ').unwrap_or((v, ""));
    if scheme.eq_ignore_ascii_case("basic") {
        return Some(Challenge::Basic);
    }
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let mut params = std::collections::BTreeMap::new();
    let mut rest = rest.trim();
    while !rest.is_empty() {
        let (key, after) = rest.split_once('=')?;
        let key = key.trim().to_ascii_lowercase();
        let after = after.trim_start();
        let (value, next) = if let Some(q) = after.strip_prefix('"') {
            let end = q.find('"')?;
            (&q[..end], &q[end + 1..])
        } else {
            let end = after.find(',').unwrap_or(after.len());
            (after[..end].trim(), &after[end..])
        };
        params.insert(key, value.to_string());
        rest = next.trim_start().trim_start_matches(',').trim_start();
    }
    Some(Challenge::Bearer {
        realm: params.remove("realm")?,
        service: params.remove("service"),
    })
}

/// `host[:port]` of a URL, the port only where the URL writes one (how auth files name hosts).
fn url_host(u: &reqwest::Url) -> String {
    let host = u.host_str().unwrap_or_default();
    match u.port() {
        Some(p) => format!("{host}:{p}"),
        None => host.to_string(),
    }
}

/// Reads a body of at most `limit` bytes: refused before reading when the declared length is
/// larger, and as soon as the bytes read pass the limit (the connection is dropped then, the
/// rest never read). `None` when the body is larger than `limit`.
async fn read_upto(
    mut res: reqwest::Response,
    limit: usize,
) -> std::result::Result<Option<Vec<u8>>, reqwest::Error> {
    if res.content_length().is_some_and(|n| n > limit as u64) {
        return Ok(None);
    }
    let mut body = Vec::new();
    while let Some(chunk) = res.chunk().await? {
        if body.len() + chunk.len() > limit {
            return Ok(None);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Some(body))
}

/// A failed answer's status and what its body says (the distribution error codes and
/// messages, else the text), read up to [`MAX_SMALL_BODY`].
async fn status_fail(res: reqwest::Response) -> Fail {
    let code = res.status().as_u16();
    let said = match read_upto(res, MAX_SMALL_BODY).await {
        Ok(Some(body)) => describe_error_body(&body),
        Ok(None) => format!("an error body larger than {MAX_SMALL_BODY} bytes, not read"),
        Err(e) => format!("the error body could not be read: {}", chain(&e)),
    };
    Fail::Status { code, said }
}

/// The distribution error envelope's codes and messages, or the body's text, on one line.
fn describe_error_body(body: &[u8]) -> String {
    #[derive(serde::Deserialize)]
    struct Envelope {
        errors: Vec<Item>,
    }
    #[derive(serde::Deserialize)]
    struct Item {
        #[serde(default)]
        code: String,
        #[serde(default)]
        message: String,
    }
    let text = match serde_json::from_slice::<Envelope>(body) {
        Ok(e) if !e.errors.is_empty() => e
            .errors
            .iter()
            .map(|i| format!("{} {}", i.code, i.message).trim().to_string())
            .collect::<Vec<_>>()
            .join("; "),
        _ => String::from_utf8_lossy(body).into_owned(),
    };
    let one_line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(300)
        .collect();
    one_line.trim().to_string()
}

/// The credentials that go to the token service at `realm` for the endpoint `host` whose own
/// login is `login`: none over plain HTTP; `login` where the token service is the endpoint's
/// own host and port; else the login the auth file names for the token service's host, or none.
/// With why the endpoint's login was withheld, where it was.
fn token_credentials(
    realm: &reqwest::Url,
    host: &str,
    login: &Credential,
    auth_file: &AuthFile,
) -> Result<(Credential, Option<String>)> {
    let realm_host = url_host(realm);
    let creds = if realm.scheme() != "https" {
        Credential::Anonymous
    } else if realm_host == host {
        login.clone()
    } else {
        auth_file.login(&realm_host)?
    };
    let withheld = (creds == Credential::Anonymous && *login != Credential::Anonymous).then(|| {
        let base = format!("the login for {host} was not sent to the token service {realm}");
        if realm.scheme() != "https" {
            format!("{base}: plain HTTP")
        } else {
            format!("{base}: another host, and the auth file has no login for {realm_host}")
        }
    });
    Ok((creds, withheld))
}

/// What a session sends in `Authorization` to its endpoint.
#[derive(Debug, Clone)]
enum Authorization {
    Basic(String, String),
    Bearer(String),
}

/// One session with one host of a registry: the endpoint, its login and the client.
struct Session {
    reference: ImageRef,
    registry: String,
    endpoint: Endpoint,
    /// A localhost registry without host settings: HTTPS first, plain HTTP when it answers in
    /// plain HTTP (containerd's fallback for localhost).
    http_fallback: bool,
    auth_file: AuthFile,
    /// The login the auth file names for this endpoint's host (never another host's).
    login: Credential,
    client: reqwest::Client,
    /// What goes in `Authorization` to this endpoint, once the login is done.
    authorization: Option<Authorization>,
    /// Set when credentials were not given to a token service (why), for the error if the
    /// registry then refuses.
    withheld: Option<String>,
}

impl Session {
    /// A session with `endpoint`, one of the endpoints [`resolve`] gives for the registry of
    /// `reference`, with the login the auth file names for the endpoint's own host.
    fn open(reference: &ImageRef, endpoint: Endpoint, auth_file: &AuthFile) -> Result<Session> {
        let registry = reference.registry().to_string();
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
            let bad = |e: String| {
                reg_err(
                    &registry,
                    format!("CA {} from {}: {e}", ca.display(), endpoint.origin),
                )
            };
            let data = fs::read(ca).map_err(|e| bad(e.to_string()))?;
            if data.starts_with(b"-----") {
                roots.extend(
                    reqwest::Certificate::from_pem_bundle(&data).map_err(|e| bad(chain(&e)))?,
                );
            } else {
                roots.push(reqwest::Certificate::from_der(&data).map_err(|e| bad(chain(&e)))?);
            }
        }
        // reqwest is built without a default crypto provider; rustls's ring is it, for the
        // whole process (a second install is refused and changes nothing).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .danger_accept_invalid_certs(endpoint.skip_verify)
            .tls_certs_merge(roots)
            .connect_timeout(Duration::from_secs(30))
            .read_timeout(Duration::from_secs(300))
            .user_agent(concat!("gpu-ckpt/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| reg_err(&registry, format!("making the client: {}", chain(&e))))?;
        let login = auth_file.login(&endpoint.host)?;
        let http_fallback = endpoint.origin == "default" && is_localhost(&registry);
        debug!(%registry, endpoint = %format!("{}://{}", endpoint.scheme, endpoint.host), origin = %endpoint.origin, login = !matches!(login, Credential::Anonymous), "registry endpoint");
        Ok(Session {
            reference: reference.clone(),
            registry,
            endpoint,
            http_fallback,
            auth_file: auth_file.clone(),
            login,
            client,
            authorization: None,
            withheld: None,
        })
    }

    /// `scheme://host[:port]` of the endpoint.
    fn base(&self) -> String {
        format!("{}://{}", self.endpoint.scheme, self.endpoint.host)
    }

    /// The URL of `rest` (`manifests/TAG`, `blobs/DIGEST`, …) in the repository; on a mirror
    /// with `?ns=<registry>`, as containerd sends it.
    fn url(&self, rest: &str) -> String {
        let ns = if self.endpoint.host == self.registry {
            String::new()
        } else {
            format!("?ns={}", self.registry)
        };
        format!(
            "{}/v2/{}/{rest}{ns}",
            self.base(),
            self.reference.repository()
        )
    }

    /// A request to `url`, with the endpoint's authorization only where `url` is the
    /// endpoint's own scheme, host and port (an upload location elsewhere gets none; reqwest
    /// drops it on redirects to another host too).
    fn request(&self, method: http::Method, url: &str) -> reqwest::RequestBuilder {
        let b = self.client.request(method, url);
        let ours = reqwest::Url::parse(url).is_ok_and(|u| {
            u.scheme() == self.endpoint.scheme && url_host(&u) == self.endpoint.host
        });
        match &self.authorization {
            Some(Authorization::Basic(u, p)) if ours => b.basic_auth(u, Some(p)),
            Some(Authorization::Bearer(t)) if ours => b.bearer_auth(t),
            _ => b,
        }
    }

    /// Sends `b`; an answer other than one of `ok` is a [`Fail::Status`].
    async fn send(
        &self,
        b: reqwest::RequestBuilder,
        ok: &[u16],
    ) -> std::result::Result<reqwest::Response, Fail> {
        let res = b.send().await.map_err(Fail::Transport)?;
        if ok.contains(&res.status().as_u16()) {
            Ok(res)
        } else {
            Err(status_fail(res).await)
        }
    }

    /// Turns a failure into one line naming the registry (and the mirror) and the cause.
    fn explain(&self, what: &str, f: Fail) -> Error {
        let reason = match f {
            // The registry's own words add nothing here (and may be long).
            Fail::Status {
                code: 401 | 403, ..
            } => {
                let base = match &self.login {
                    Credential::Anonymous => format!(
                        "{what}: the registry asks for a login and there are no credentials for {} ({})",
                        self.endpoint.host,
                        self.auth_file.describe()
                    ),
                    Credential::Basic(u, _) => format!(
                        "{what}: credentials refused for user {u:?} ({})",
                        self.auth_file.describe()
                    ),
                };
                match &self.withheld {
                    Some(w) => format!("{base} ({w})"),
                    None => base,
                }
            }
            Fail::Status { code: 404, .. } => {
                format!("{what}: {} not found", self.reference)
            }
            Fail::Status { code, said } => format!("{what}: HTTP {code}: {said}"),
            Fail::Transport(e) => {
                if let Some(why) = certificate_problem(&e) {
                    let trust = if self.endpoint.ca.is_empty() {
                        "the system's trust store; no CA for this host in the host directory"
                            .to_string()
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
                    format!(
                        "{what}: the server certificate does not verify ({why}) against {trust}"
                    )
                } else {
                    format!("{what}: {}", chain(&e))
                }
            }
            Fail::Other(s) => format!("{what}: {s}"),
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

    /// The first request (`GET /v2/` and the login it asks for). A localhost registry that
    /// answers HTTPS with plain HTTP is spoken to over plain HTTP from then on.
    async fn login(&mut self, op: Op) -> Result<()> {
        match self.try_login(op).await {
            Ok(()) => Ok(()),
            Err(Fail::Transport(e)) if self.http_fallback && plain_http_answer(&e) => {
                debug!(registry = %self.registry, "localhost registry answers plain HTTP");
                self.endpoint.scheme = "http".into();
                self.http_fallback = false;
                self.try_login(op)
                    .await
                    .map_err(|f| self.explain("login", f))
            }
            Err(f) => Err(self.explain("login", f)),
        }
    }

    async fn try_login(&mut self, op: Op) -> std::result::Result<(), Fail> {
        self.authorization = None;
        let url = format!("{}/v2/", self.base());
        let res = self
            .client
            .get(&url)
            .send()
            .await
            .map_err(Fail::Transport)?;
        if res.status().is_success() {
            return Ok(());
        }
        if res.status().as_u16() != 401 {
            return Err(status_fail(res).await);
        }
        let challenge = res
            .headers()
            .get(http::header::WWW_AUTHENTICATE)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_challenge);
        let refused = status_fail(res).await;
        match challenge {
            Some(Challenge::Basic) => {
                let basic = self.basic()?.ok_or(refused)?;
                self.authorization = Some(basic);
                // Checked here, so that a wrong password is told as the login's failure.
                self.send(self.request(http::Method::GET, &url), &[200])
                    .await
                    .map(drop)
            }
            Some(Challenge::Bearer { realm, service }) => {
                let token = self.token(&realm, service.as_deref(), op).await?;
                if http::HeaderValue::from_str(&token).is_err() {
                    return Err(Fail::Other(format!(
                        "the token service {realm} answered a token that is no header value"
                    )));
                }
                self.authorization = Some(Authorization::Bearer(token));
                Ok(())
            }
            None => Err(refused),
        }
    }

    /// This endpoint's own login for a basic challenge; `None` without one. Credentials go over
    /// plain HTTP only to a loopback host.
    fn basic(&self) -> std::result::Result<Option<Authorization>, Fail> {
        let Credential::Basic(u, p) = &self.login else {
            return Ok(None);
        };
        if self.endpoint.scheme != "https" && !is_localhost(&self.endpoint.host) {
            return Err(Fail::Other(format!(
                "{} asks for a login over plain HTTP; credentials are sent only over HTTPS (or to a loopback host)",
                self.endpoint.host
            )));
        }
        Ok(Some(Authorization::Basic(u.clone(), p.clone())))
    }

    /// A token from the token service `realm` for the repository and `op`. Credentials go with
    /// the request only over HTTPS and only where the auth file names the token service's own
    /// host (the registry's host, for a registry that serves its own tokens): never this host's
    /// login to another host, never over plain HTTP. The answer is read up to
    /// [`MAX_SMALL_BODY`].
    async fn token(
        &mut self,
        realm: &str,
        service: Option<&str>,
        op: Op,
    ) -> std::result::Result<String, Fail> {
        let mut url = reqwest::Url::parse(realm)
            .map_err(|e| Fail::Other(format!("the token service {realm:?} is not a URL ({e})")))?;
        if !matches!(url.scheme(), "http" | "https")
            || !url.username().is_empty()
            || url.password().is_some()
        {
            return Err(Fail::Other(format!(
                "the token service {realm:?} is not an http:// or https:// URL without a user"
            )));
        }
        let (creds, withheld) =
            token_credentials(&url, &self.endpoint.host, &self.login, &self.auth_file)
                .map_err(|e| Fail::Other(e.to_string()))?;
        if let Some(why) = withheld {
            warn!(registry = %self.registry, %realm, "{why}");
            self.withheld = Some(why);
        }
        let scope = match op {
            Op::Pull => format!("repository:{}:pull", self.reference.repository()),
            Op::Push => format!("repository:{}:pull,push", self.reference.repository()),
        };
        {
            let mut q = url.query_pairs_mut();
            q.append_pair("scope", &scope);
            if let Some(s) = service {
                q.append_pair("service", s);
            }
        }
        let mut b = self.client.get(url);
        if let Credential::Basic(u, p) = &creds {
            b = b.basic_auth(u, Some(p));
        }
        let res = b.send().await.map_err(Fail::Transport)?;
        if !res.status().is_success() {
            return Err(match status_fail(res).await {
                Fail::Status { code, said } => Fail::Status {
                    code,
                    said: format!("token service {realm}: {said}"),
                },
                f => f,
            });
        }
        let body = read_upto(res, MAX_SMALL_BODY)
            .await
            .map_err(Fail::Transport)?
            .ok_or_else(|| {
                Fail::Other(format!(
                    "the token service {realm} answered more than the limit of {MAX_SMALL_BODY} bytes"
                ))
            })?;
        #[derive(serde::Deserialize)]
        struct Token {
            #[serde(default)]
            token: String,
            #[serde(default)]
            access_token: String,
        }
        let t: Token = serde_json::from_slice(&body).map_err(|e| {
            Fail::Other(format!("the token service {realm} answered no token ({e})"))
        })?;
        let token = if t.token.is_empty() {
            t.access_token
        } else {
            t.token
        };
        if token.is_empty() {
            return Err(Fail::Other(format!(
                "the token service {realm} answered no token"
            )));
        }
        Ok(token)
    }

    /// The image manifest the reference names, read up to [`MAX_MANIFEST_DOC`] bytes (a larger
    /// one is refused before or while it is read, never buffered), and its digest: verified
    /// against the reference's digest where it names one, and against the registry's
    /// `Docker-Content-Digest` where it sends one.
    async fn manifest(&self) -> std::result::Result<(Vec<u8>, String), Fail> {
        let url = self.url(&format!(
            "manifests/{}",
            self.reference.manifest_reference()
        ));
        let res = self
            .send(
                self.request(http::Method::GET, &url)
                    .header(http::header::ACCEPT, MEDIA_MANIFEST),
                &[200],
            )
            .await?;
        let header = res
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = read_upto(res, MAX_MANIFEST_DOC)
            .await
            .map_err(Fail::Transport)?
            .ok_or_else(|| {
                Fail::Other(format!(
                    "its manifest is larger than the limit of {MAX_MANIFEST_DOC} bytes"
                ))
            })?;
        let got = format!("sha256:{}", hex::encode(Sha256::digest(&body)));
        if let Some(want) = self.reference.digest() {
            if got != want {
                return Err(Fail::Other(format!(
                    "the registry answered {} with manifest {got}, not {want}",
                    self.reference
                )));
            }
        } else if let Some(h) = header.filter(|h| h.starts_with("sha256:")) {
            if h != got {
                return Err(Fail::Other(format!(
                    "the manifest's digest is {got}, the registry's Docker-Content-Digest says {h}"
                )));
            }
        }
        Ok((body, got))
    }

    async fn blob_exists(&self, digest: &str) -> std::result::Result<bool, Fail> {
        let url = self.url(&format!("blobs/{digest}"));
        let res = self
            .send(self.request(http::Method::HEAD, &url), &[200, 404])
            .await?;
        Ok(res.status().as_u16() == 200)
    }

    /// Uploads a blob in one `PUT` (a monolithic upload after the `POST`).
    async fn push_blob<S>(&self, digest: &str, size: u64, data: S) -> std::result::Result<(), Fail>
    where
        S: futures_util::Stream<Item = std::io::Result<bytes::Bytes>> + Send + 'static,
    {
        let start = self.url("blobs/uploads/");
        let res = self
            .send(self.request(http::Method::POST, &start), &[202])
            .await?;
        let location = res
            .headers()
            .get(http::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| Fail::Other("the upload's answer has no Location".into()))?;
        let mut url = reqwest::Url::parse(&start)
            .and_then(|s| s.join(location))
            .map_err(|e| Fail::Other(format!("upload location {location:?}: {e}")))?;
        drop(res);
        url.query_pairs_mut().append_pair("digest", digest);
        self.send(
            self.request(http::Method::PUT, url.as_str())
                .header(http::header::CONTENT_TYPE, "application/octet-stream")
                .header(http::header::CONTENT_LENGTH, size)
                .body(reqwest::Body::wrap_stream(data)),
            &[201],
        )
        .await
        .map(drop)
    }

    async fn push_manifest(&self, doc: Vec<u8>) -> std::result::Result<(), Fail> {
        let url = self.url(&format!(
            "manifests/{}",
            self.reference.manifest_reference()
        ));
        self.send(
            self.request(http::Method::PUT, &url)
                .header(http::header::CONTENT_TYPE, MEDIA_MANIFEST)
                .body(doc),
            &[201],
        )
        .await
        .map(drop)
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
/// the bytes `f` counts in `done` (of `total`) about ten times a second meanwhile. With a
/// `deadline`, `f` is stopped there and `late` is the error.
fn run_async<T, F>(
    done: Arc<AtomicU64>,
    total: &AtomicU64,
    progress: Progress<'_>,
    deadline: Option<(Instant, Error)>,
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
            match deadline {
                None => rt.block_on(f),
                Some((at, late)) => rt.block_on(async move {
                    tokio::time::timeout_at(at.into(), f)
                        .await
                        .unwrap_or(Err(late))
                }),
            }
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
) -> Result<impl futures_util::Stream<Item = std::io::Result<bytes::Bytes>> + Send + 'static> {
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
                Err(e) => Some((Err(e), r)),
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
    let reference = ImageRef::parse(reference)?;
    let (m, mdigest) = oci::read_image_manifest(image)?;
    if let Some(d) = reference.digest().filter(|d| *d != mdigest) {
        return Err(reg_err(
            reference.registry(),
            format!("{reference} names manifest {d}, the image's is {mdigest}"),
        ));
    }
    let manifest_json =
        oci::read_image_blob(image, &mdigest, image_format::archive::MAX_METADATA_BYTES)?;
    let mut blobs = vec![m.config.clone()];
    blobs.extend(m.layers.iter().cloned());
    let mut located = Vec::new();
    for b in &blobs {
        let (path, offset) = oci::blob_location(image, &b.digest)?;
        located.push((b.clone(), path, offset));
    }
    // The first host that may push, and only that one, as containerd's pusher does.
    let registry = reference.registry();
    let endpoint = resolve(opts.hosts_dir.as_deref(), registry, Need::Push)?
        .into_iter()
        .next()
        .ok_or_else(|| reg_err(registry, "no host may push"))?;
    let auth_file = AuthFile::find(opts.auth_file.as_deref());
    let mut session = Session::open(&reference, endpoint, &auth_file)?;
    let done = Arc::new(AtomicU64::new(0));
    let total = AtomicU64::new(blobs.iter().map(|b| b.size).sum());
    let d2 = done.clone();
    let s = &mut session;
    run_async(done, &total, progress, None, async move {
        s.login(Op::Push).await?;
        for (b, path, offset) in located {
            let exists = s
                .blob_exists(&b.digest)
                .await
                .map_err(|e| s.explain("checking for a blob", e))?;
            if exists {
                d2.fetch_add(b.size, Ordering::Relaxed);
                continue;
            }
            let stream = blob_stream(path, offset, b.size, d2.clone())?;
            s.push_blob(&b.digest, b.size, stream)
                .await
                .map_err(|e| s.explain(&format!("uploading blob {}", b.digest), e))?;
        }
        s.push_manifest(manifest_json)
            .await
            .map_err(|e| s.explain("putting the manifest", e))?;
        Ok(mdigest)
    })
}

/// Pulls a checkpoint image from a registry and writes its archive, the image's single layer,
/// to `out` (created new, mode 0600). The manifest must be a checkpoint image's (one
/// uncompressed layer, the checkpoint annotation), at most 4 MiB, and the one a digest
/// reference names; the layer must fit `limits` and is hashed while it streams, refused unless
/// it matches its digest and size. The registry's endpoints (mirrors, then the server) are
/// tried in turn, each with a session of its own and its own login, until one serves the
/// image; `out` is emptied before each next try. The whole pull ends at
/// [`RegistryOptions::pull_deadline`]. A refused pull leaves no file. Returns the manifest
/// digest.
pub fn pull_archive(
    reference: &str,
    out: &Path,
    limits: Limits,
    opts: &RegistryOptions,
    progress: Progress<'_>,
) -> Result<String> {
    let _span = info_span!("registry_pull", %reference).entered();
    let reference = ImageRef::parse(reference)?;
    let registry = reference.registry();
    let endpoints = resolve(opts.hosts_dir.as_deref(), registry, Need::Pull)?;
    let auth_file = AuthFile::find(opts.auth_file.as_deref());
    let limit = opts.pull_deadline.unwrap_or(DEFAULT_PULL_DEADLINE);
    let deadline = Instant::now() + limit;
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
        let late = reg_err(
            registry,
            format!(
                "the pull of {reference} did not finish within its deadline of {} s (at {at})",
                limit.as_secs()
            ),
        );
        if Instant::now() >= deadline {
            res = Some(Err(late));
            break;
        }
        let emptied = if i == 0 { Ok(()) } else { empty(&mut f, out) };
        let attempt = emptied.and_then(|()| {
            let session = Session::open(&reference, endpoint, &auth_file)?;
            pull_from(session, &mut f, out, limits, (deadline, late), progress)
        });
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
    let res = res.unwrap_or_else(|| Err(all_failed(registry, failed)));
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

/// One try of [`pull_archive`]: the image from the session's endpoint, its layer written to
/// `f` (empty), by `deadline`.
fn pull_from(
    mut session: Session,
    f: &mut File,
    out: &Path,
    limits: Limits,
    deadline: (Instant, Error),
    progress: Progress<'_>,
) -> Result<String> {
    let done = Arc::new(AtomicU64::new(0));
    let total = AtomicU64::new(0);
    let d2 = done.clone();
    let s = &mut session;
    let t = &total;
    let fr = f;
    run_async(done, &total, progress, Some(deadline), async move {
        s.login(Op::Pull).await?;
        let (doc, mdigest) = s
            .manifest()
            .await
            .map_err(|e| s.explain("getting the manifest", e))?;
        let name = s.reference.to_string();
        let not_ckpt = |why: String| {
            reg_err(
                &s.registry,
                format!("{name} is not a checkpoint image: {why}"),
            )
        };
        let m: ImageManifest = serde_json::from_slice(&doc)
            .map_err(|e| not_ckpt(format!("not an OCI image manifest ({e})")))?;
        check_checkpoint_manifest(&m, limits).map_err(not_ckpt)?;
        let layer = &m.layers[0];
        t.store(layer.size, Ordering::Relaxed);
        let url = s.url(&format!("blobs/{}", layer.digest));
        let mut res = s
            .send(s.request(http::Method::GET, &url), &[200])
            .await
            .map_err(|e| s.explain(&format!("getting blob {}", layer.digest), e))?;
        let mut hasher = Sha256::new();
        let mut n = 0u64;
        let blob_err = |why: String| reg_err(&s.registry, format!("blob {}: {why}", layer.digest));
        if let Some(declared) = res.content_length().filter(|&c| c > layer.size) {
            return Err(blob_err(format!(
                "the registry sends {declared} bytes, larger than its {} bytes",
                layer.size
            )));
        }
        while let Some(chunk) = res.chunk().await.map_err(|e| blob_err(chain(&e)))? {
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
        .is_some_and(image_format::manifest::is_sha256_hex)
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
        let registry = ImageRef::parse(reference).unwrap().registry().to_string();
        let t = dir_with(&registry, &[("hosts.toml", hosts_toml)]);
        let out = t.path().join("out.tar");
        let opts = RegistryOptions {
            hosts_dir: Some(t.path().to_path_buf()),
            auth_file: Some(t.path().join("no-auth.json")),
            ..Default::default()
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
    fn a_token_service_gets_only_its_own_hosts_login_and_only_over_https() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("auth.json");
        // "u:p" and "t:q" in base64.
        fs::write(
            &p,
            r#"{"auths":{"reg.example:5443":{"auth":"dTpw"},"auth.example":{"auth":"dDpx"}}}"#,
        )
        .unwrap();
        let file = AuthFile::find(Some(&p));
        let login = file.login("reg.example:5443").unwrap();
        let url = |u: &str| reqwest::Url::parse(u).unwrap();
        let creds = |realm: &str| {
            token_credentials(&url(realm), "reg.example:5443", &login, &file).unwrap()
        };
        // The registry's own token service, over HTTPS: its login.
        assert_eq!(
            creds("https://reg.example:5443/token"),
            (login.clone(), None)
        );
        // The same host over plain HTTP, or on another port: none of it.
        let (c, why) = creds("http://reg.example:5443/token");
        assert_eq!(c, Credential::Anonymous);
        assert!(why.unwrap().ends_with(": plain HTTP"));
        let (c, why) = creds("https://reg.example:9999/token");
        assert_eq!(c, Credential::Anonymous);
        assert!(why
            .unwrap()
            .ends_with("another host, and the auth file has no login for reg.example:9999"));
        // Another host with a login of its own: that login, never the registry's.
        assert_eq!(
            creds("https://auth.example/token"),
            (Credential::Basic("t".into(), "q".into()), None)
        );
        assert_eq!(creds("http://auth.example/token").0, Credential::Anonymous);
        // An anonymous endpoint withholds nothing.
        let (c, why) = token_credentials(
            &url("https://evil.example/t"),
            "mirror.example",
            &Credential::Anonymous,
            &file,
        )
        .unwrap();
        assert_eq!((c, why), (Credential::Anonymous, None));
    }

    #[test]
    fn challenges_are_parsed() {
        assert_eq!(
            parse_challenge("Basic realm=\"Registry Realm\""),
            Some(Challenge::Basic)
        );
        assert_eq!(
            parse_challenge(
                "Bearer realm=\"https://auth.example/token\",service=\"reg.example\",scope=\"repository:a/b:pull\""
            ),
            Some(Challenge::Bearer {
                realm: "https://auth.example/token".into(),
                service: Some("reg.example".into()),
            })
        );
        assert_eq!(
            parse_challenge("bearer realm=https://t.example/x, service=s"),
            Some(Challenge::Bearer {
                realm: "https://t.example/x".into(),
                service: Some("s".into()),
            })
        );
        assert_eq!(parse_challenge("Bearer service=\"s\""), None);
        assert_eq!(parse_challenge("Negotiate abc"), None);
        assert_eq!(
            url_host(&reqwest::Url::parse("https://auth.example:8443/t").unwrap()),
            "auth.example:8443"
        );
        assert_eq!(
            url_host(&reqwest::Url::parse("https://auth.example/t").unwrap()),
            "auth.example"
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
            Credential::Basic("u".into(), "p".into())
        );
        assert_eq!(a.login("other.example").unwrap(), Credential::Anonymous);
        // A login names one host and port: not the same host on another port.
        assert_eq!(a.login("reg.example").unwrap(), Credential::Anonymous);
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
