//! The registry client against hostile registries: small HTTP servers on loopback that record
//! every request (and every header) they get and answer what an attacker would.
//!
//! - A login goes to the host it names only: a plain-HTTP mirror that asks for a basic login,
//!   a mirror whose token service is on another port, and that token service never see the
//!   server's password; the server does, and serves the pull.
//! - References are parsed, not matched: percent-encoded `..` and `host@other` never reach a
//!   server; a digest reference is fetched by digest, and a registry that answers with another
//!   manifest is refused, naming both digests.
//! - Every read is bounded: a 400 MB manifest (declared, or streamed without a length) is
//!   refused at 4 MiB without being read; token and error bodies stop at 64 KiB; a gzip bomb
//!   layer stops at the limit; a registry that stalls ends at the pull's deadline.
//! - The staging directory of `build --push` is a fresh private one, never a planted path.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use image_format::oci::{self, MEDIA_LAYER_TAR, MEDIA_LAYER_TAR_GZIP, MEDIA_MANIFEST};
use image_format::safe::Limits;
use registry::RegistryOptions;
use sha2::{Digest, Sha256};

/// One request as the fake server read it.
#[derive(Debug, Clone)]
struct Req {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
}

impl Req {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// What the fake answers.
enum Body {
    Bytes(Vec<u8>),
    /// `len` zero bytes, with a `Content-Length` or (false) delimited by closing the connection.
    Zeros {
        len: u64,
        declared: bool,
    },
    /// A `Content-Length` of `len`, then nothing for `wait`.
    Stall {
        len: u64,
        wait: Duration,
    },
}

struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Body,
}

fn resp(status: u16, headers: &[(&str, &str)], body: Body) -> Resp {
    Resp {
        status,
        headers: headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        body,
    }
}

fn json(status: u16, body: &[u8]) -> Resp {
    resp(
        status,
        &[("Content-Type", "application/json")],
        Body::Bytes(body.to_vec()),
    )
}

type Handler = Arc<dyn Fn(&Req) -> Resp + Send + Sync>;

/// A fake registry (or token service) on a loopback port, one request per connection.
struct Fake {
    port: u16,
    log: Arc<Mutex<Vec<Req>>>,
    /// Body bytes written, all requests together.
    sent: Arc<AtomicU64>,
}

impl Fake {
    fn start(handler: impl Fn(&Req) -> Resp + Send + Sync + 'static) -> Fake {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let log = Arc::new(Mutex::new(Vec::new()));
        let sent = Arc::new(AtomicU64::new(0));
        let handler: Handler = Arc::new(handler);
        let (log2, sent2) = (log.clone(), sent.clone());
        std::thread::spawn(move || {
            for c in l.incoming().flatten() {
                let (h, log, sent) = (handler.clone(), log2.clone(), sent2.clone());
                std::thread::spawn(move || serve(c, &*h, &log, &sent));
            }
        });
        Fake { port, log, sent }
    }

    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn requests(&self) -> Vec<Req> {
        self.log.lock().unwrap().clone()
    }

    fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }
}

fn serve(
    c: TcpStream,
    h: &(dyn Fn(&Req) -> Resp + Send + Sync),
    log: &Mutex<Vec<Req>>,
    sent: &AtomicU64,
) {
    let mut r = BufReader::new(c.try_clone().unwrap());
    let mut line = String::new();
    if r.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_string();
    let path = parts.next().unwrap_or_default().to_string();
    let mut headers = Vec::new();
    loop {
        let mut l = String::new();
        if r.read_line(&mut l).unwrap_or(0) == 0 || l.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    let req = Req {
        method,
        path,
        headers,
    };
    log.lock().unwrap().push(req.clone());
    let answer = h(&req);
    let mut w = c;
    let mut head = format!("HTTP/1.1 {} X\r\nConnection: close\r\n", answer.status);
    for (k, v) in &answer.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    match &answer.body {
        Body::Bytes(b) => head.push_str(&format!("Content-Length: {}\r\n", b.len())),
        Body::Zeros {
            len,
            declared: true,
        }
        | Body::Stall { len, .. } => head.push_str(&format!("Content-Length: {len}\r\n")),
        Body::Zeros { .. } => {}
    }
    head.push_str("\r\n");
    if w.write_all(head.as_bytes()).is_err() {
        return;
    }
    match answer.body {
        Body::Bytes(b) => {
            if req.method != "HEAD" && w.write_all(&b).is_ok() {
                sent.fetch_add(b.len() as u64, Ordering::Relaxed);
            }
        }
        Body::Zeros { len, .. } => {
            let chunk = vec![0u8; 64 << 10];
            let mut left = len;
            while left > 0 {
                let k = left.min(chunk.len() as u64) as usize;
                if w.write_all(&chunk[..k]).is_err() {
                    break;
                }
                sent.fetch_add(k as u64, Ordering::Relaxed);
                left -= k as u64;
            }
        }
        Body::Stall { wait, .. } => std::thread::sleep(wait),
    }
}

/// Where a test's files go.
fn scratch() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// A host directory for `registry` with `hosts.toml` = `body`, and an auth file with `auths`.
fn opts(dir: &Path, registry: &str, hosts_toml: &str, auths: &str) -> RegistryOptions {
    let d = dir.join("certs.d").join(registry);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("hosts.toml"), hosts_toml).unwrap();
    let auth = dir.join("auth.json");
    std::fs::write(&auth, format!(r#"{{"auths":{{{auths}}}}}"#)).unwrap();
    RegistryOptions {
        hosts_dir: Some(dir.join("certs.d")),
        auth_file: Some(auth),
        ..Default::default()
    }
}

/// A plain-HTTP server and no login.
fn plain(dir: &Path, fake: &Fake) -> RegistryOptions {
    opts(
        dir,
        &fake.addr(),
        &format!("server = \"http://{}\"\n", fake.addr()),
        "",
    )
}

fn sha256(b: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(b)))
}

const LAYER: &[u8] = b"the checkpoint archive of a fake registry";

/// A checkpoint image's manifest for [`LAYER`].
fn checkpoint_manifest(layer: &[u8], layer_size: u64) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": oci::MEDIA_CONFIG, "digest": sha256(b"{}"), "size": 2},
        "layers": [{"mediaType": MEDIA_LAYER_TAR, "digest": sha256(layer), "size": layer_size}],
        "annotations": {oci::ANN_CONTAINERD_NAME: "c"},
    }))
    .unwrap()
}

/// A registry that serves the checkpoint image under every name, without a login.
fn serving(req: &Req) -> Resp {
    if req.path == "/v2/" {
        json(200, b"{}")
    } else if req.path.contains("/manifests/") {
        resp(
            200,
            &[("Content-Type", MEDIA_MANIFEST)],
            Body::Bytes(checkpoint_manifest(LAYER, LAYER.len() as u64)),
        )
    } else if req.path.contains("/blobs/") {
        resp(200, &[], Body::Bytes(LAYER.to_vec()))
    } else {
        json(404, b"{}")
    }
}

/// A pull of `app:1` from `server` that must fail: its error, once the server's writer has had
/// time to see the hang-up.
fn refused_pull(server: &Fake) -> String {
    let t = scratch();
    let e = pull(
        &format!("{}/app:1", server.addr()),
        &t.path().join("o"),
        &plain(t.path(), server),
    )
    .unwrap_err();
    std::thread::sleep(Duration::from_millis(300));
    e
}

fn pull(reference: &str, out: &Path, o: &RegistryOptions) -> Result<String, String> {
    registry::pull_archive(reference, out, Limits::default(), o, &mut |_, _| {})
        .map_err(|e| e.to_string())
}

const PASSWORD: &str = "s3cret";
/// base64 of `alice:s3cret`.
const ALICE: &str = "YWxpY2U6czNjcmV0";

#[test]
fn the_login_goes_to_its_own_host_only() {
    // The server: asks for a basic login, and serves the image with alice's.
    let server = Fake::start(|req| {
        if req.header("authorization") != Some(&format!("Basic {ALICE}")) {
            return resp(
                401,
                &[("WWW-Authenticate", "Basic realm=\"r\"")],
                Body::Bytes(vec![]),
            );
        }
        serving(req)
    });
    // A plain-HTTP mirror that asks for a basic login.
    let basic_mirror = Fake::start(|_| {
        resp(
            401,
            &[("WWW-Authenticate", "Basic realm=\"mirror\"")],
            Body::Bytes(vec![]),
        )
    });
    // A token service on another port, and a mirror that sends clients there.
    let tokens = Fake::start(|_| json(200, br#"{"token":"t0k3n"}"#));
    let realm = format!("http://{}/token", tokens.addr());
    let token_mirror = Fake::start(move |req| {
        if req.header("authorization") == Some("Bearer t0k3n") {
            return json(
                404,
                br#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"no"}]}"#,
            );
        }
        resp(
            401,
            &[(
                "WWW-Authenticate",
                &format!("Bearer realm=\"{realm}\",service=\"fake\""),
            )],
            Body::Bytes(vec![]),
        )
    });
    let t = scratch();
    let o = opts(
        t.path(),
        &server.addr(),
        &format!(
            "server = \"http://{s}\"\n\n[host.\"http://{m1}\"]\n  capabilities = [\"pull\", \"resolve\"]\n\n[host.\"http://{m2}\"]\n  capabilities = [\"pull\", \"resolve\"]\n",
            s = server.addr(),
            m1 = basic_mirror.addr(),
            m2 = token_mirror.addr()
        ),
        &format!(r#""{}":{{"auth":"{ALICE}"}}"#, server.addr()),
    );
    let out = t.path().join("out.tar");
    let reference = format!("{}/ckpt/app:1", server.addr());
    let got = pull(&reference, &out, &o);
    assert!(got.is_ok(), "{got:?}");
    assert_eq!(std::fs::read(&out).unwrap(), LAYER);
    // Each mirror and the token service were asked, and none saw the password.
    for (who, fake) in [
        ("the basic mirror", &basic_mirror),
        ("the token mirror", &token_mirror),
        ("the token service", &tokens),
    ] {
        let reqs = fake.requests();
        assert!(!reqs.is_empty(), "{who} was never asked");
        for r in &reqs {
            for (k, v) in &r.headers {
                assert!(
                    !v.contains(ALICE) && !v.contains(PASSWORD),
                    "{who} got the login: {} {}: {k}: {v}",
                    r.method,
                    r.path
                );
            }
        }
        println!("{who}: {} requests, no login", reqs.len());
    }
    // The server, the host the login names, got it (over plain HTTP: a loopback host).
    assert!(server
        .requests()
        .iter()
        .any(|r| r.header("authorization") == Some(&format!("Basic {ALICE}"))));
}

#[test]
fn a_mirror_without_a_login_of_its_own_is_told_so() {
    let mirror = Fake::start(|_| {
        resp(
            401,
            &[("WWW-Authenticate", "Basic realm=\"mirror\"")],
            Body::Bytes(vec![]),
        )
    });
    let t = scratch();
    // The login names the registry; only the mirror serves it.
    let o = opts(
        t.path(),
        "registry.invalid",
        &format!(
            "server = \"http://registry.invalid\"\ncapabilities = [\"push\"]\n\n[host.\"http://{}\"]\n  capabilities = [\"pull\"]\n",
            mirror.addr()
        ),
        &format!(r#""registry.invalid":{{"auth":"{ALICE}"}}"#),
    );
    let e = pull("registry.invalid/ckpt/app:1", &t.path().join("o"), &o).unwrap_err();
    assert!(
        e.contains(&format!("no credentials for {}", mirror.addr())),
        "{e}"
    );
    assert!(mirror
        .requests()
        .iter()
        .all(|r| r.header("authorization").is_none()));
}

#[test]
fn references_with_encoded_dots_or_userinfo_reach_no_server() {
    let server = Fake::start(serving);
    let other = Fake::start(serving);
    let t = scratch();
    let o = plain(t.path(), &server);
    for (i, reference) in [
        format!("{}/ckpt/%2e%2e/other/app:1", server.addr()),
        format!("{}/ckpt/..%2fother/app:1", server.addr()),
        format!("{}@{}/ckpt/app:1", server.addr(), other.addr()),
        format!("{}/app@sha256:{}", server.addr(), "0".repeat(12)),
    ]
    .iter()
    .enumerate()
    {
        let e = pull(reference, &t.path().join(format!("o{i}")), &o).unwrap_err();
        assert!(e.contains("reference"), "{reference}: {e}");
        // The CLI's parser is the same.
        let cli = Command::new(env!("CARGO_BIN_EXE_gpu-ckpt"))
            .args(["pull", reference])
            .arg(t.path().join("cli.tar"))
            .arg("--hosts-dir")
            .arg(t.path().join("certs.d"))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&cli.stderr);
        assert!(!cli.status.success(), "{reference}");
        assert!(stderr.contains("reference"), "{reference}: {stderr}");
    }
    assert!(server.requests().is_empty(), "{:?}", server.requests());
    assert!(other.requests().is_empty(), "{:?}", other.requests());
}

#[test]
fn a_digest_reference_is_fetched_by_digest_and_verified() {
    let server = Fake::start(serving);
    let t = scratch();
    let o = plain(t.path(), &server);
    let real = sha256(&checkpoint_manifest(LAYER, LAYER.len() as u64));
    let zeros = format!("sha256:{}", "0".repeat(64));
    let out = t.path().join("o.tar");
    let e = pull(&format!("{}/app@{zeros}", server.addr()), &out, &o).unwrap_err();
    assert!(e.contains(&zeros) && e.contains(&real), "{e}");
    assert!(!out.exists());
    assert!(
        server
            .requests()
            .iter()
            .any(|r| r.path == format!("/v2/app/manifests/{zeros}")),
        "{:?}",
        server.requests()
    );
    // The right digest: pulled, by digest.
    let got = pull(&format!("{}/app@{real}", server.addr()), &out, &o).unwrap();
    assert_eq!(got, real);
    assert_eq!(std::fs::read(&out).unwrap(), LAYER);
}

/// The process's peak resident memory, in KiB.
fn peak_rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// What the server may have written before a client that stopped reading hung up: the
/// sockets' buffers, far below what the server offered.
const SLACK: u64 = 32 << 20;

#[test]
fn a_huge_manifest_is_refused_at_4_mib_without_being_read() {
    const HUGE: u64 = 400 << 20;
    for declared in [true, false] {
        let server = Fake::start(move |req| {
            if req.path == "/v2/" {
                return json(200, b"{}");
            }
            resp(
                200,
                &[("Content-Type", MEDIA_MANIFEST)],
                Body::Zeros {
                    len: HUGE,
                    declared,
                },
            )
        });
        let t = scratch();
        let o = plain(t.path(), &server);
        let before = peak_rss_kib();
        let e = pull(&format!("{}/app:1", server.addr()), &t.path().join("o"), &o).unwrap_err();
        let grew = peak_rss_kib().saturating_sub(before);
        // Let the server's writer see the hang-up.
        std::thread::sleep(Duration::from_millis(300));
        println!(
            "declared {declared}: {e}; server sent {} bytes; peak RSS grew {grew} KiB",
            server.sent()
        );
        assert!(e.contains("limit of 4194304 bytes"), "{e}");
        assert!(server.sent() < (4 << 20) + SLACK, "{}", server.sent());
        assert!(grew < 64 << 10, "peak RSS grew {grew} KiB");
    }
}

#[test]
fn token_and_error_bodies_are_read_up_to_64_kib() {
    const BIG: u64 = 200 << 20;
    let tokens = Fake::start(|_| {
        resp(
            200,
            &[],
            Body::Zeros {
                len: BIG,
                declared: false,
            },
        )
    });
    let realm = format!("http://{}/token", tokens.addr());
    let server = Fake::start(move |req| {
        if req.path == "/v2/" {
            return resp(
                401,
                &[("WWW-Authenticate", &format!("Bearer realm=\"{realm}\""))],
                Body::Bytes(vec![]),
            );
        }
        json(500, b"{}")
    });
    let e = refused_pull(&server);
    println!("token: {e}; sent {}", tokens.sent());
    assert!(e.contains("limit of 65536 bytes"), "{e}");
    assert!(tokens.sent() < SLACK, "{}", tokens.sent());

    // An error answer with a huge body, streamed.
    let server = Fake::start(|req| {
        if req.path == "/v2/" {
            return json(200, b"{}");
        }
        resp(
            404,
            &[],
            Body::Zeros {
                len: BIG,
                declared: false,
            },
        )
    });
    let e = refused_pull(&server);
    println!("error body: {e}; sent {}", server.sent());
    assert!(e.contains("not found"), "{e}");
    assert!(server.sent() < SLACK, "{}", server.sent());
}

#[test]
fn a_stalled_pull_ends_at_its_deadline() {
    let server = Fake::start(|req| {
        if req.path == "/v2/" {
            return json(200, b"{}");
        }
        if req.path.contains("/manifests/") {
            return resp(
                200,
                &[("Content-Type", MEDIA_MANIFEST)],
                Body::Bytes(checkpoint_manifest(LAYER, LAYER.len() as u64)),
            );
        }
        resp(
            200,
            &[],
            Body::Stall {
                len: LAYER.len() as u64,
                wait: Duration::from_secs(120),
            },
        )
    });
    let t = scratch();
    let mut o = plain(t.path(), &server);
    o.pull_deadline = Some(Duration::from_secs(2));
    let out = t.path().join("o.tar");
    let start = Instant::now();
    let e = pull(&format!("{}/app:1", server.addr()), &out, &o).unwrap_err();
    let took = start.elapsed();
    println!("{e} after {took:?}");
    assert!(e.contains("deadline of 2 s"), "{e}");
    assert!(took < Duration::from_secs(20), "{took:?}");
    assert!(!out.exists());
}

/// An OCI layout whose one layer is `blob` with `media_type`, declared `size` bytes.
fn layout_with_layer(dir: &Path, blob: &[u8], media_type: &str, size: u64) -> PathBuf {
    let l = dir.join("layout");
    let blobs = l.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let put = |data: &[u8]| {
        let d = sha256(data);
        std::fs::write(blobs.join(d.trim_start_matches("sha256:")), data).unwrap();
        d
    };
    let config = put(b"{}");
    let layer = put(blob);
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": oci::MEDIA_CONFIG, "digest": config, "size": 2},
        "layers": [{"mediaType": media_type, "digest": layer, "size": size}],
        "annotations": {oci::ANN_CONTAINERD_NAME: "c"},
    }))
    .unwrap();
    let m = put(&manifest);
    std::fs::write(
        l.join("index.json"),
        serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "manifests": [{"mediaType": MEDIA_MANIFEST, "digest": m, "size": manifest.len()}],
        }))
        .unwrap(),
    )
    .unwrap();
    std::fs::write(l.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    l
}

#[test]
fn a_gzip_bomb_layer_stops_at_the_limit() {
    // 256 MiB of zeros, a few hundred KiB compressed.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..256 {
        gz.write_all(&zeros).unwrap();
    }
    let bomb = gz.finish().unwrap();
    println!("bomb: {} bytes compressed", bomb.len());
    let t = scratch();
    let image = layout_with_layer(t.path(), &bomb, MEDIA_LAYER_TAR_GZIP, bomb.len() as u64);
    let limits = Limits {
        max_total_bytes: 8 << 20,
        ..Limits::default()
    };
    let out = t.path().join("back.tar");
    let e = oci::extract_archive_from_image(&image, &out, limits, &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("limit of 8388608 bytes"), "{e}");
    assert!(!out.exists());
    let e = oci::verify_image(&image, limits, &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("limit of 8388608 bytes"), "{e}");
    // A layer blob larger than its manifest says is read no further than that (and refused).
    let t = scratch();
    let image = layout_with_layer(t.path(), &[7u8; 10240], MEDIA_LAYER_TAR, 1000);
    let e = oci::verify_image(&image, Limits::default(), &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("(1000 bytes)") && e.contains("(1001 bytes)"),
        "{e}"
    );
}

#[test]
fn the_build_staging_directory_is_fresh_and_private() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    // What an attacker plants where the old name was: a link to a victim directory, and a
    // directory of their own.
    let victim = scratch();
    let tmp = std::env::temp_dir();
    let planted = tmp.join(format!("gpu-ckpt-build-{}", std::process::id()));
    let _ = std::fs::remove_file(&planted);
    std::os::unix::fs::symlink(victim.path(), &planted).unwrap();
    let dirs: Vec<_> = (0..3)
        .map(|_| oci::private_temp_dir("gpu-ckpt-build-").unwrap())
        .collect();
    for d in &dirs {
        let m = std::fs::symlink_metadata(d.path()).unwrap();
        assert!(m.is_dir() && !m.file_type().is_symlink());
        assert_eq!(
            m.permissions().mode() & 0o777,
            0o700,
            "{}",
            d.path().display()
        );
        assert_eq!(m.uid(), std::fs::metadata("/proc/self").unwrap().uid());
        assert_ne!(d.path(), planted);
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
        assert!(d.path().starts_with(&tmp));
    }
    assert_ne!(dirs[0].path(), dirs[1].path());
    assert_eq!(std::fs::read_dir(victim.path()).unwrap().count(), 0);
    std::fs::remove_file(&planted).unwrap();
}
