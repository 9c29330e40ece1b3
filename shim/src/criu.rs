//! The CRIU this shim drives (runc runs the `criu` it finds in PATH, as `criu --version` here
//! does): its version, read once per shim process, the minimum the shim supports, and the
//! options a release added, each used only from that release on.

use std::fmt;

use tokio::sync::OnceCell;

use crate::error::{Error, Result};

/// A CRIU release, as `criu --version` prints it (`Version: 4.2.1`, or `Version: 4.2`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(pub u32, pub u32, pub u32);

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// The oldest CRIU the shim supports: 4.1 (Debian trixie's 4.1.1), for its handling of
/// the options the shim writes into the container's CRIU configuration file.
pub const MINIMUM: Version = Version(4, 1, 0);

/// `network-lock skip` (CRIU 4.2, `criu/crtools.c`'s `--network-lock` parser): 4.1.1 has only
/// iptables and nftables and crashes on a configuration file naming `skip`.
pub const NETWORK_LOCK_SKIP: Version = Version(4, 2, 0);

impl Version {
    /// Parses the `Version:` line of `criu --version`.
    pub fn parse(output: &str) -> Option<Version> {
        let v = output
            .lines()
            .find_map(|l| l.trim().strip_prefix("Version:"))?
            .trim();
        let mut parts = v.split('.').map(|p| {
            let digits: String = p.chars().take_while(char::is_ascii_digit).collect();
            digits.parse::<u32>().ok()
        });
        let major = parts.next()??;
        let minor = parts.next().flatten().unwrap_or(0);
        let sub = parts.next().flatten().unwrap_or(0);
        Some(Version(major, minor, sub))
    }

    /// Whether this release understands `network-lock skip`.
    pub fn network_lock_skip(self) -> bool {
        self >= NETWORK_LOCK_SKIP
    }
}

/// What `criu --version` said, once per shim process.
static FOUND: OnceCell<std::result::Result<Version, String>> = OnceCell::const_new();

/// The CRIU in PATH, checked against [`MINIMUM`]: an error names the CRIU found (or that none
/// answered) and the minimum.
pub async fn version() -> Result<Version> {
    let found = FOUND
        .get_or_init(|| async {
            let out = crate::runc::tool_output("criu", &["--version"]).await;
            Version::parse(&out).ok_or_else(|| {
                if out.is_empty() {
                    "no criu in PATH answered `criu --version`".to_string()
                } else {
                    format!("`criu --version` printed {out:?}, not a version")
                }
            })
        })
        .await
        .clone();
    match found {
        Ok(v) if v >= MINIMUM => Ok(v),
        Ok(v) => Err(Error::FailedPrecondition(format!(
            "CRIU {v} is older than the oldest gpu-ckpt supports, {MINIMUM}: install CRIU {MINIMUM} or newer"
        ))),
        Err(why) => Err(Error::FailedPrecondition(format!(
            "{why}: gpu-ckpt needs CRIU {MINIMUM} or newer for checkpoint and restore"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_and_order() {
        assert_eq!(
            Version::parse("Version: 4.2.1\nGitID: v4.2.1\n"),
            Some(Version(4, 2, 1))
        );
        assert_eq!(Version::parse("Version: 4.1\n"), Some(Version(4, 1, 0)));
        assert_eq!(Version::parse("Version: 3.17.1"), Some(Version(3, 17, 1)));
        assert_eq!(Version::parse("criu: not found"), None);
        assert!(Version(4, 1, 1) >= MINIMUM);
        assert!(Version(3, 17, 1) < MINIMUM);
        assert!(!Version(4, 1, 1).network_lock_skip());
        assert!(Version(4, 2, 0).network_lock_skip());
        assert!(Version(5, 0, 0).network_lock_skip());
    }
}
