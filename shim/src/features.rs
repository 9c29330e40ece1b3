//! The OCI runtime features of the runc a handler drives, reported by `-info` as
//! containerd-shim-runc-v2 reports them: containerd's CRI derives what a handler can do
//! (recursive read-only mounts, user namespaces) from them.
//!
//! runc-v2 resolves the handler's `BinaryName` (else `runc`) on PATH, runs `<runc> features`, and
//! passes the JSON on as an Any of type [`FEATURES_TYPE_URL`]. A runc without the `features`
//! command (before 1.1), or one whose answer is not JSON, gives no features and no error; a
//! binary that is not found at all is an error.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tracing::debug;

/// The type URL containerd registers for the runtime-spec's `features.Features`.
pub const FEATURES_TYPE_URL: &str =
    "types.containerd.io/opencontainers/runtime-spec/1/features/Features";

/// How long `runc features` may take before it counts as not answering.
const FEATURES_TIMEOUT: Duration = Duration::from_secs(10);

/// `binary` as exec.LookPath resolves it: a name with a slash as it is, else the first
/// executable file of that name on PATH.
pub fn look_path(binary: &str) -> Option<PathBuf> {
    let executable = |p: &Path| {
        std::fs::metadata(p)
            .map(|m| {
                m.is_file()
                    && std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0
            })
            .unwrap_or(false)
    };
    if binary.contains('/') {
        let p = PathBuf::from(binary);
        return executable(&p).then_some(p);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(binary))
        .find(|p| executable(p))
}

/// The JSON `binary features` prints, or None where it has no such command (or prints no JSON).
/// Err only when the binary cannot be found.
pub fn runc_features(binary: &str) -> Result<Option<Vec<u8>>, String> {
    let abs = look_path(binary)
        .ok_or_else(|| format!("failed to look up the path of {binary:?}: not found on PATH"))?;
    let spawn = || {
        Command::new(&abs)
            .arg("features")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
    };
    // A binary that was just written (an upgrade in progress, or a test's script) can be
    // briefly busy: another process forked while its writer still held it open.
    let mut attempt = spawn();
    for _ in 0..20 {
        match &attempt {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => {
                std::thread::sleep(Duration::from_millis(10));
                attempt = spawn();
            }
            _ => break,
        }
    }
    let mut child = match attempt {
        Ok(c) => c,
        Err(e) => {
            debug!(binary = %abs.display(), error = %e, "cannot run `features`");
            return Ok(None);
        }
    };
    let mut stdout = Vec::new();
    if let Some(mut out) = child.stdout.take() {
        // The features JSON is a few KiB: the pipe never fills before the process exits.
        let _ = out.read_to_end(&mut stdout);
    }
    let deadline = Instant::now() + FEATURES_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    match status {
        Some(s) if s.success() => {}
        other => {
            debug!(binary = %abs.display(), status = ?other, "no runtime features: does this runc implement `features`?");
            return Ok(None);
        }
    }
    if !serde_json::from_slice::<serde_json::Value>(&stdout).is_ok_and(|v| v.is_object()) {
        debug!(binary = %abs.display(), "no runtime features: `features` printed no JSON object");
        return Ok(None);
    }
    Ok(Some(stdout))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// [`runc_features`] of a runc that is the shell script `body`, written as `dir/name`.
    fn features_of(dir: &Path, name: &str, body: &str) -> Result<Option<Vec<u8>>, String> {
        let p = dir.join(name);
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        runc_features(p.to_str().unwrap())
    }

    #[test]
    fn features_json_is_passed_on() {
        let dir = tempfile::tempdir().unwrap();
        let prints = r#"echo '{"ociVersionMin":"1.0.0","mountOptions":["rro"]}'"#;
        let json = features_of(dir.path(), "runc", prints).unwrap().unwrap();
        let v: serde_json::Value = serde_json::from_slice(&json).unwrap();
        assert_eq!(v["mountOptions"][0], "rro");
    }

    #[test]
    fn a_runc_without_features_gives_none() {
        let dir = tempfile::tempdir().unwrap();
        // runc 1.0 answers an unknown command with a usage error.
        let usage_error = "echo 'No help topic for features' >&2; exit 1";
        assert_eq!(features_of(dir.path(), "old-runc", usage_error), Ok(None));
        assert_eq!(
            features_of(dir.path(), "odd-runc", "echo not json"),
            Ok(None)
        );
    }

    #[test]
    fn a_missing_binary_is_an_error() {
        let err = runc_features("/nonexistent/runc").unwrap_err();
        assert!(err.contains("/nonexistent/runc"), "{err}");
        assert!(look_path("surely-no-such-binary-on-path").is_none());
        assert!(look_path("sh").is_some());
    }
}
