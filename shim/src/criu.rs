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

/// Socket options on Linux 6.16 and later, which refuses `SO_PASSCRED` and `SO_PASSSEC` with
/// EOPNOTSUPP on sockets other than Unix, netlink and Bluetooth ones: CRIU before 4.2 reads
/// both for every socket, so it cannot dump a TCP socket there (criu issues #2705 and #2718,
/// fixed in 4.2).
pub const SOCKOPTS_LINUX_6_16: Version = Version(4, 2, 0);

/// The one-line cause of a failed CRIU run, when its log shows a known limit of the release
/// that ran (`version`): said instead of CRIU's bare error.
pub fn known_limit(version: Option<Version>, log: &str) -> Option<String> {
    let v = version?;
    let refused_sockopt = ["Can't get 1:16 opt", "Can't get 1:34 opt"]
        .iter()
        .any(|m| log.contains(m) && log.contains("Operation not supported"));
    if v < SOCKOPTS_LINUX_6_16 && refused_sockopt {
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|r| r.trim().to_string())
            .unwrap_or_else(|_| "?".into());
        return Some(format!(
            "CRIU {v} cannot dump TCP and other inet sockets on Linux {kernel}: from 6.16 the kernel refuses SO_PASSCRED and SO_PASSSEC on them, which CRIU before {SOCKOPTS_LINUX_6_16} reads for every socket (criu #2705); install CRIU {SOCKOPTS_LINUX_6_16} or newer, or checkpoint the container without open TCP connections"
        ));
    }
    None
}

/// The CRIU version [`version`] found, if it has run in this process and found one.
pub fn found() -> Option<Version> {
    FOUND.get().and_then(|r| r.clone().ok())
}

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

    #[test]
    fn refused_socket_options_are_named_for_criu_before_4_2_only() {
        let log = "(00.038833) Error (criu/sockets.c:628): sockets: Can't get 1:16 opt: Operation not supported\n";
        let why = known_limit(Some(Version(4, 1, 1)), log).expect("4.1.1 is named");
        assert!(
            why.starts_with("CRIU 4.1.1 cannot dump TCP") && why.contains("4.2.0 or newer"),
            "{why}"
        );
        assert_eq!(known_limit(Some(Version(4, 2, 1)), log), None);
        assert_eq!(known_limit(None, log), None);
        assert_eq!(known_limit(Some(Version(4, 1, 1)), "Error: other"), None);
    }
}
