//! The CRIU this shim drives (runc runs the `criu` it finds in PATH, as `criu --version` here
//! does): its version, read once per shim process, the minimum the shim supports, the options
//! a release added, each used only from that release on, and the plugin directory it is given.

use std::fmt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::Path;

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

/// The plugin directory the shim names to CRIU (`libdir` in the configuration file runc hands
/// it) for every dump and restore: empty, and writable by root only. Without it CRIU loads every
/// `*.so` in `$CRIU_LIBS_DIR` or its compiled-in directory (`/usr/lib/criu/` in Debian's
/// build), such as its own cuda plugin (`cuda_plugin.so`, CRIU 4), which locks, checkpoints,
/// restores and unlocks GPU processes through NVIDIA's `cuda-checkpoint` behind the shim's
/// device steps: at a restore it would put them back on the GPUs they left and let them run
/// before the shim has restored them onto the container's GPUs.
pub const NO_PLUGINS_DIR: &str = "/run/gpu-ckpt/criu-plugins";

/// [`NO_PLUGINS_DIR`], created (with its parent) when missing. An error names the directory
/// when it is not a directory, may be written by a user other than root (or the shim's own),
/// or holds anything: CRIU would load a plugin put there.
pub fn no_plugins_dir() -> Result<&'static Path> {
    let dir = Path::new(NO_PLUGINS_DIR);
    empty_and_root_only(dir)?;
    Ok(dir)
}

/// Creates `dir` (mode 0555) and its parent (0755) when missing, and checks both as
/// [`no_plugins_dir`] says.
fn empty_and_root_only(dir: &Path) -> Result<()> {
    let refuse = |d: &Path, why: String| {
        Error::FailedPrecondition(format!(
            "CRIU plugin directory {}: {why}; gpu-ckpt names {} to CRIU as its only plugin directory, so that CRIU loads no plugin (such as its cuda plugin) behind the shim's device steps, and uses it only while it is an empty directory that only root can write to",
            d.display(),
            dir.display()
        ))
    };
    let ours = nix::unistd::geteuid().as_raw();
    for (d, mode) in [(dir.parent().unwrap_or(dir), 0o755), (dir, 0o555)] {
        match std::fs::DirBuilder::new().mode(mode).create(d) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(refuse(d, format!("cannot be created: {e}"))),
        }
        let m = std::fs::symlink_metadata(d).map_err(|e| refuse(d, e.to_string()))?;
        if !m.file_type().is_dir() {
            return Err(refuse(d, "is not a directory".into()));
        }
        if m.uid() != 0 && m.uid() != ours {
            return Err(refuse(d, format!("is owned by uid {}", m.uid())));
        }
        if m.mode() & 0o022 != 0 {
            return Err(refuse(
                d,
                format!("has mode {:o}: others can write to it", m.mode() & 0o7777),
            ));
        }
    }
    let mut entries = std::fs::read_dir(dir).map_err(|e| refuse(dir, e.to_string()))?;
    if let Some(entry) = entries.next() {
        let name = entry.map_or_else(|e| e.to_string(), |e| format!("{:?}", e.file_name()));
        return Err(refuse(dir, format!("is not empty: it holds {name}")));
    }
    Ok(())
}

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
    fn the_plugin_directory_is_created_empty_and_refused_otherwise() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("gpu-ckpt/criu-plugins");
        empty_and_root_only(&dir).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o555);
        assert_eq!(mode(dir.parent().unwrap()), 0o755);
        // A second shim finds it as the first left it.
        empty_and_root_only(&dir).unwrap();

        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(dir.join("cuda_plugin.so"), b"").unwrap();
        let want = format!("CRIU plugin directory {}: is not empty", dir.display());
        let e = empty_and_root_only(&dir).unwrap_err().to_string();
        assert!(e.starts_with(&want) && e.contains("cuda_plugin.so"), "{e}");
        std::fs::remove_file(dir.join("cuda_plugin.so")).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = empty_and_root_only(&dir).unwrap_err().to_string();
        assert!(e.contains("has mode 777: others can write to it"), "{e}");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();
        let parent = dir.parent().unwrap();
        std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o775)).unwrap();
        let want = format!("CRIU plugin directory {}: has mode 775", parent.display());
        let e = empty_and_root_only(&dir).unwrap_err().to_string();
        assert!(e.starts_with(&want), "{e}");
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
