//! Mounts below a bind mount of the spec (a tmpfs mounted on the host below the bind's source,
//! carried into the container by an `rbind` or a recursive read-only mount): runc maps only the
//! spec's own mounts for CRIU (`--ext-mount-map`), so the shim marks these external at the dump
//! and maps them to the new spec's host paths at the restore, through its CRIU configuration
//! file (`checkpoint::CriuConf`).
//!
//! The list travels in the image directory ([`SUB_MOUNTS_FILE`], hashed into the manifest like
//! every checkpoint file).
//!
//! The host path of a sub-mount lies below the source of a bind mount, a directory the
//! container (or a sidecar through `/proc/<pid>/root`) may change while the restore runs. The
//! restore resolves it beneath the source without following any symlink ([`hold`]: `openat2`
//! with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`), keeps an `O_PATH` handle on what it found,
//! and hands CRIU the path it resolved. CRIU mounts by path later; at `pre-resume` the restore
//! checks that the mount CRIU made at the sub-mount's mountpoint is the very directory held
//! (device and inode, `mount_check.rs`), so a swap in between fails the restore instead of
//! redirecting it. (A `/proc/<shim>/fd/N` path cannot be handed to CRIU instead: CRIU binds
//! from its own mount namespace, and the kernel refuses to bind a mount of another one.)

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};

use image_format::mountinfo;
use nix::fcntl::{openat2, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;
use oci_spec::runtime::Spec;
use serde::{Deserialize, Serialize};

/// The list of sub-mounts in a checkpoint's image directory.
pub const SUB_MOUNTS_FILE: &str = "gpu-ckpt-ext-mounts.json";
/// The prefix of the keys the dump records for sub-mounts instead of their host paths.
const KEY_PREFIX: &str = "gpu-ckpt-sub-";

#[derive(Debug, thiserror::Error)]
pub enum SubMountError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error("{context}: {source}")]
    Json {
        context: String,
        source: serde_json::Error,
    },
    #[error("{0}")]
    Mountinfo(String),
    /// A sub-mount the restore cannot map to a host path of the new spec.
    #[error("sub-mount {mountpoint} (below {under}): {reason}")]
    Unresolved {
        mountpoint: String,
        under: String,
        reason: String,
    },
}

type Result<T> = std::result::Result<T, SubMountError>;

/// One sub-mount: its mountpoint in the container, the key CRIU records for it, the spec mount
/// (destination) it lies below, and its path relative to that destination.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubMount {
    pub mountpoint: String,
    pub key: String,
    pub under: String,
    pub relative: String,
}

/// A mount of the spec, as far as sub-mounts care.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecMount {
    pub destination: String,
    pub source: Option<PathBuf>,
    pub bind: bool,
}

/// The spec's mounts, destinations normalized.
pub fn spec_mounts(spec: &Spec) -> Vec<SpecMount> {
    spec.mounts()
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|m| {
            let bind = m.typ().as_deref() == Some("bind")
                || m.options()
                    .as_deref()
                    .unwrap_or_default()
                    .iter()
                    .any(|o| o == "bind" || o == "rbind");
            SpecMount {
                destination: normalize(&m.destination().display().to_string()),
                source: m.source().clone(),
                bind,
            }
        })
        .collect()
}

/// `/a//b/` → `/a/b`.
fn normalize(path: &str) -> String {
    mountinfo::normalize(path)
}

/// The mountpoints of a mountinfo text (field 5, relative to the process's root), in order.
pub fn mountpoints(text: &str) -> Result<Vec<String>> {
    mountinfo::parse(text, "mountinfo")
        .map(|table| table.into_iter().map(|m| m.mountpoint).collect())
        .map_err(|e| SubMountError::Mountinfo(e.to_string()))
}

/// The mounts that lie strictly below a bind-mount destination of the spec and are not spec
/// mounts themselves, each under the deepest such destination, keyed in order.
pub fn select(mountpoints: &[String], spec: &[SpecMount]) -> Vec<SubMount> {
    let mut out: Vec<SubMount> = Vec::new();
    for mp in mountpoints {
        if spec.iter().any(|m| &m.destination == mp) || out.iter().any(|s| &s.mountpoint == mp) {
            continue;
        }
        let under = spec
            .iter()
            .filter(|m| m.bind && m.destination != "/")
            .filter_map(|m| {
                mp.strip_prefix(m.destination.as_str())
                    .and_then(|rest| rest.strip_prefix('/'))
                    .filter(|rest| !rest.is_empty())
                    .map(|rest| (m.destination.as_str(), rest))
            })
            .max_by_key(|(d, _)| d.len());
        if let Some((under, relative)) = under {
            out.push(SubMount {
                mountpoint: mp.clone(),
                key: format!("{KEY_PREFIX}{}", out.len()),
                under: under.to_string(),
                relative: relative.to_string(),
            });
        }
    }
    out
}

/// The sub-mounts of the mount namespace of process `pid` (its mountinfo read from the host).
pub fn of_process(pid: i32, spec: &Spec) -> Result<Vec<SubMount>> {
    let path = format!("/proc/{pid}/mountinfo");
    let text = std::fs::read_to_string(&path).map_err(|source| SubMountError::Io {
        context: format!("read {path}"),
        source,
    })?;
    Ok(select(&mountpoints(&text)?, &spec_mounts(spec)))
}

/// Writes the list into the image directory, root-only.
pub fn write_list(dir: &Path, list: &[SubMount]) -> Result<()> {
    let path = dir.join(SUB_MOUNTS_FILE);
    let body = serde_json::to_vec_pretty(list).map_err(|source| SubMountError::Json {
        context: "encode the sub-mount list".into(),
        source,
    })?;
    let io = |source| SubMountError::Io {
        context: format!("write {}", path.display()),
        source,
    };
    let _ = std::fs::remove_file(&path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(io)?;
    f.write_all(&body).map_err(io)
}

/// The list a checkpoint recorded; empty when it recorded none.
pub fn read_list(dir: &Path) -> Result<Vec<SubMount>> {
    let path = dir.join(SUB_MOUNTS_FILE);
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(SubMountError::Io {
                context: format!("read {}", path.display()),
                source,
            })
        }
    };
    serde_json::from_slice(&text).map_err(|source| SubMountError::Json {
        context: format!("decode {}", path.display()),
        source,
    })
}

/// A sub-mount's host directory under the new spec, held open.
#[derive(Debug)]
pub struct Held {
    pub sub: SubMount,
    /// The path handed to CRIU.
    pub host: PathBuf,
    /// `O_PATH` handle on what `host` named when it was resolved.
    pub fd: OwnedFd,
}

/// The host directory for `sub` under the new spec: the source of the spec's mount at the same
/// destination joined with the relative path, resolved beneath that source without following
/// a symlink, and held open.
pub fn hold(sub: &SubMount, spec: &[SpecMount]) -> Result<Held> {
    let refuse = |reason: String| SubMountError::Unresolved {
        mountpoint: sub.mountpoint.clone(),
        under: sub.under.clone(),
        reason,
    };
    let rel = Path::new(&sub.relative);
    if sub.relative.is_empty() || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(refuse(format!(
            "relative path {:?} is not a plain path below the mount",
            sub.relative
        )));
    }
    let Some(source) = spec
        .iter()
        .rev()
        .find(|m| m.destination == normalize(&sub.under))
        .and_then(|m| m.source.clone())
    else {
        return Err(refuse(format!(
            "the new container has no mount with a source at {}",
            sub.under
        )));
    };
    // The source itself is the host path the spec names (kubelet's choice, outside the
    // container): symlinks in it are the node's own.
    let root = source
        .canonicalize()
        .map_err(|e| refuse(format!("mount source {}: {e}", source.display())))?;
    let root_fd = nix::fcntl::open(
        &root,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| refuse(format!("mount source {}: {e}", root.display())))?;
    let joined = root.join(rel);
    let fd = openat2(
        root_fd.as_fd(),
        rel,
        OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
            .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS),
    )
    .map_err(|e| {
        refuse(match e {
            nix::errno::Errno::ELOOP => format!(
                "host path {} has a symlink on the way below the mount source {} (refused: it could be swapped before CRIU mounts it)",
                joined.display(),
                root.display()
            ),
            nix::errno::Errno::EXDEV => format!(
                "host path {} leads out of the mount source {}",
                joined.display(),
                root.display()
            ),
            e => format!("host path {}: {e}", joined.display()),
        })
    })?;
    Ok(Held {
        sub: sub.clone(),
        host: joined,
        fd,
    })
}

/// Every sub-mount of `list` held under `spec` ([`hold`]).
pub fn hold_all(list: &[SubMount], spec: &Spec) -> Result<Vec<Held>> {
    let mounts = spec_mounts(spec);
    list.iter().map(|s| hold(s, &mounts)).collect()
}

/// The dump's `ext-mount-map` pairs: mountpoint → key.
pub fn dump_map(list: &[SubMount]) -> Vec<(String, String)> {
    list.iter()
        .map(|s| (s.mountpoint.clone(), s.key.clone()))
        .collect()
}

/// The restore's `ext-mount-map` pairs: key → host path.
pub fn restore_map(held: &[Held]) -> Vec<(String, String)> {
    held.iter()
        .map(|h| (h.sub.key.clone(), h.host.display().to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bind(dest: &str, source: &Path) -> SpecMount {
        SpecMount {
            destination: dest.into(),
            source: Some(source.to_path_buf()),
            bind: true,
        }
    }

    fn other(dest: &str) -> SpecMount {
        SpecMount {
            destination: dest.into(),
            source: None,
            bind: false,
        }
    }

    const MOUNTINFO: &str = "\
600 500 0:50 / / rw,relatime - overlay overlay rw,lowerdir=/l
601 600 0:51 / /proc rw,nosuid - proc proc rw
602 601 0:5 /null /proc/kcore rw - devtmpfs udev rw
603 600 0:52 / /dev rw - tmpfs tmpfs rw
604 603 0:53 / /dev/pts rw - devpts devpts rw
605 600 8:1 /tmp/rro-x /data ro - ext4 /dev/sda1 rw
606 605 0:54 / /data/sub ro - tmpfs rro-sub rw
607 606 0:55 / /data/sub/deeper ro - tmpfs t rw
608 600 8:1 /tmp/other /data/sub/spec ro - ext4 /dev/sda1 rw
609 605 0:56 / /data/with\\040space ro - tmpfs t rw
610 600 8:1 /etc/hosts /etc/hosts rw - ext4 /dev/sda1 rw
611 605 0:54 / /data/sub ro - tmpfs rro-sub rw
";

    #[test]
    fn selects_mounts_below_bind_destinations_only() {
        let d = Path::new("/host/d");
        let spec = vec![
            other("/proc"),
            other("/dev"),
            other("/dev/pts"),
            bind("/data/", d),
            bind("/data/sub/spec", Path::new("/host/o")),
            bind("/etc/hosts", Path::new("/host/hosts")),
        ];
        let mps = mountpoints(MOUNTINFO).unwrap();
        assert_eq!(mps[9], "/data/with space");
        let subs = select(&mps, &spec_mounts_of(&spec));
        let got: Vec<_> = subs
            .iter()
            .map(|s| {
                (
                    s.mountpoint.as_str(),
                    s.key.as_str(),
                    s.under.as_str(),
                    s.relative.as_str(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("/data/sub", "gpu-ckpt-sub-0", "/data", "sub"),
                ("/data/sub/deeper", "gpu-ckpt-sub-1", "/data", "sub/deeper"),
                ("/data/with space", "gpu-ckpt-sub-2", "/data", "with space"),
            ]
        );
        // Nothing below a bind mount: nothing selected.
        assert!(select(&mps, &[other("/proc"), other("/dev")]).is_empty());
        assert!(mountpoints("600 500 0:50").is_err());
    }

    /// Normalizes destinations as `spec_mounts` does.
    fn spec_mounts_of(m: &[SpecMount]) -> Vec<SpecMount> {
        m.iter()
            .map(|m| SpecMount {
                destination: normalize(&m.destination),
                ..m.clone()
            })
            .collect()
    }

    #[test]
    fn spec_mounts_know_binds() {
        let spec: Spec = serde_json::from_str(
            r#"{"ociVersion":"1.0.2","mounts":[
                {"destination":"/proc","type":"proc","source":"proc"},
                {"destination":"/data/","type":"bind","source":"/d","options":["rbind","rro"]},
                {"destination":"/x","source":"/x","options":["bind"]}]}"#,
        )
        .unwrap();
        let m = spec_mounts(&spec);
        assert_eq!(
            m.iter()
                .map(|m| (m.destination.as_str(), m.bind))
                .collect::<Vec<_>>(),
            [("/proc", false), ("/data", true), ("/x", true)]
        );
    }

    fn sub(relative: &str) -> SubMount {
        SubMount {
            mountpoint: format!("/data/{relative}"),
            key: "gpu-ckpt-sub-0".into(),
            under: "/data".into(),
            relative: relative.into(),
        }
    }

    #[test]
    fn resolves_host_paths_inside_the_new_source_only() {
        let t = tempfile::tempdir().unwrap();
        let src = t.path().join("src");
        std::fs::create_dir_all(src.join("sub/deeper")).unwrap();
        std::fs::create_dir_all(t.path().join("outside")).unwrap();
        std::os::unix::fs::symlink("sub", src.join("inside-link")).unwrap();
        std::os::unix::fs::symlink(t.path().join("outside"), src.join("out-link")).unwrap();
        std::os::unix::fs::symlink("../outside", src.join("up-link")).unwrap();
        let spec = [other("/proc"), bind("/data", &src)];
        let root = src.canonicalize().unwrap();

        let host = |rel: &str| hold(&sub(rel), &spec).map(|h| h.host);
        assert_eq!(host("sub").unwrap(), root.join("sub"));
        assert_eq!(host("sub/deeper").unwrap(), root.join("sub/deeper"));
        // What is held is what the path named.
        let held = hold(&sub("sub/deeper"), &spec).unwrap();
        let (a, b) = (
            nix::sys::stat::fstat(held.fd.as_fd()).unwrap(),
            nix::sys::stat::stat(&root.join("sub/deeper")).unwrap(),
        );
        assert_eq!((a.st_dev, a.st_ino), (b.st_dev, b.st_ino));
        for (rel, why) in [
            ("missing", "host path"),
            ("inside-link", "symlink on the way"),
            ("out-link", "symlink on the way"),
            ("up-link", "symlink on the way"),
            ("../outside", "not a plain path"),
            ("sub/../../outside", "not a plain path"),
            ("/etc", "not a plain path"),
            ("", "not a plain path"),
        ] {
            let e = hold(&sub(rel), &spec).unwrap_err().to_string();
            assert!(e.contains(why), "{rel}: {e}");
            assert!(
                e.contains("sub-mount /data/"),
                "{rel}: names the mountpoint: {e}"
            );
        }
        // The new spec has no mount there.
        let e = hold(&sub("sub"), &[bind("/elsewhere", &src)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("no mount") && e.contains("/data/sub"), "{e}");
    }

    #[test]
    fn the_list_round_trips_root_only() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        assert!(read_list(t.path()).unwrap().is_empty());
        let list = vec![sub("sub")];
        write_list(t.path(), &list).unwrap();
        write_list(t.path(), &list).unwrap();
        assert_eq!(read_list(t.path()).unwrap(), list);
        let mode = std::fs::metadata(t.path().join(SUB_MOUNTS_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(
            dump_map(&list),
            [("/data/sub".to_string(), "gpu-ckpt-sub-0".to_string())]
        );
    }
}
