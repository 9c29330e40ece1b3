//! The restored container's `/dev` holds the device nodes of this container's spec, as a cold
//! start of the spec would.
//!
//! runc makes the spec's `linux.devices` in the container's `/dev` (a tmpfs) when it creates a
//! container; CRIU restores that tmpfs as it was at the checkpoint. Restored onto other GPUs
//! (another minor number: `/dev/nvidia1` where the checkpoint had `/dev/nvidia0`), the
//! container would keep the checkpoint's GPU nodes and lack its own, and the driver, which
//! opens the nodes of the GPUs a restore gives it, would fail. So at the gate's pre-resume,
//! where CRIU has restored every task and mount and none has run, in the restored init's mount
//! namespace: each device node of the spec is made as runc makes it (type, numbers, mode,
//! owner) where `/dev` lacks it or holds another type or device under its name, and, where
//! the spec gives NVIDIA nodes itself (CDI), each NVIDIA node (`nvidia*`) it does not give is
//! removed. The device cgroup (the spec's, which runc
//! applied at restore) already allows the new nodes and not the old ones.
//!
//! Only the held init is looked at (it cannot exit or be replaced while CRIU holds it), and
//! only when its root is the bundle's rootfs and its `/dev` a tmpfs: a root the checkpoint
//! chrooted elsewhere, or a `/dev` bound from the host, is refused, never written. A spec with
//! a `/dev` that is not a tmpfs gets nothing (runc makes no node there either); a user
//! namespace (where runc binds the host's nodes) is refused when a node would have to change.
//! Every path is resolved from the container's root without following a link
//! (`openat2(RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS)`), and each node made is checked through
//! a handle on it before its mode and owner are set.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{fstat, fstatat, makedev, mknodat, stat, Mode, SFlag};
use nix::sys::statfs::{fstatfs, TMPFS_MAGIC};
use nix::unistd::{fchownat, unlinkat, Gid, Uid, UnlinkatFlags};
use oci_spec::runtime::{LinuxDevice, LinuxDeviceType, LinuxNamespaceType, Spec};
use tracing::info;

use crate::error::{Error, Result};
use crate::restored_root::{open_in_root, open_root};

/// One device node of the spec directly in `/dev`: its name there and what to make.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Node {
    name: String,
    kind: SFlag,
    major: u64,
    minor: u64,
    mode: u32,
    uid: u32,
    gid: u32,
}

impl Node {
    fn of(d: &LinuxDevice) -> Option<Node> {
        let name = d.path().to_str()?.strip_prefix("/dev/")?;
        if name.is_empty() || name.contains('/') {
            return None;
        }
        let kind = match d.typ() {
            LinuxDeviceType::C | LinuxDeviceType::U => SFlag::S_IFCHR,
            LinuxDeviceType::B => SFlag::S_IFBLK,
            LinuxDeviceType::P => SFlag::S_IFIFO,
            LinuxDeviceType::A => return None,
        };
        Some(Node {
            name: name.to_string(),
            kind,
            major: u64::try_from(d.major()).ok()?,
            minor: u64::try_from(d.minor()).ok()?,
            mode: d.file_mode().unwrap_or(0o666) & 0o7777,
            uid: d.uid().unwrap_or(0),
            gid: d.gid().unwrap_or(0),
        })
    }
}

/// The spec's device nodes directly in `/dev` (runc makes nested ones too; GPUs have none).
fn spec_nodes(spec: &Spec) -> Vec<Node> {
    spec.linux()
        .as_ref()
        .and_then(|l| l.devices().as_ref())
        .into_iter()
        .flatten()
        .filter_map(Node::of)
        .collect()
}

/// An NVIDIA device node name (`nvidia0`, `nvidiactl`, `nvidia-uvm`, `nvidia-uvm-tools`, …).
fn is_nvidia_node(name: &str) -> bool {
    name.starts_with("nvidia")
}

/// What the restored `/dev` must hold: the spec's nodes, where the spec's runc makes them.
#[derive(Debug, Clone, Default)]
pub struct DevPolicy {
    nodes: Vec<Node>,
    /// The spec's `/dev` is a tmpfs runc fills (else nothing is made or removed).
    runc_fills_dev: bool,
    user_namespace: bool,
    /// `(st_dev, st_ino)` of the bundle's rootfs: the restored init's root must be it.
    rootfs: Option<(u64, u64)>,
}

impl DevPolicy {
    /// The policy of `spec`, whose rootfs is mounted at `rootfs` on the host.
    pub fn of(spec: &Spec, rootfs: &std::path::Path) -> Result<DevPolicy> {
        let dev_mount = spec
            .mounts()
            .iter()
            .flatten()
            .rev()
            .find(|m| m.destination().as_os_str() == "/dev");
        let runc_fills_dev =
            dev_mount.is_none_or(|m| m.typ().as_deref().is_none_or(|t| t == "tmpfs"));
        let user_namespace = spec
            .linux()
            .as_ref()
            .and_then(|l| l.namespaces().as_ref())
            .is_some_and(|ns| ns.iter().any(|n| n.typ() == LinuxNamespaceType::User));
        let st =
            stat(rootfs).map_err(|e| Error::io(format!("stat {}", rootfs.display()))(e.into()))?;
        Ok(DevPolicy {
            nodes: spec_nodes(spec),
            runc_fills_dev,
            user_namespace,
            rootfs: Some((st.st_dev, st.st_ino)),
        })
    }
}

/// A refusal of the restored `/dev` (`why`), naming the restored init `pid`.
fn refused(pid: i32, why: &str) -> Error {
    Error::FailedPrecondition(format!(
        "restore refused: the restored container's /dev (init pid {pid}) cannot be set to its spec's device nodes: {why}"
    ))
}

/// Makes the `/dev` of the restored init `pid` (held at the gate) hold the device nodes of
/// `policy`, and no NVIDIA node the spec does not give. Returns what it changed, for the log.
pub fn present(pid: i32, policy: &DevPolicy) -> Result<Vec<String>> {
    // Nodes that the spec does not list (a runtime hook's, NVIDIA_VISIBLE_DEVICES) are left as
    // they are: only a spec that gives NVIDIA nodes itself (CDI) says which ones must go.
    if !policy.runc_fills_dev || !policy.nodes.iter().any(|n| is_nvidia_node(&n.name)) {
        return Ok(Vec::new());
    }
    let root = open_root(pid)?;
    let dev = open_in_root(root.as_fd(), "/dev")
        .map_err(|e| Error::io(format!("open /dev of restored process {pid}"))(e.into()))?;
    let wrong = wrong_nodes(&dev, &policy.nodes);
    let stale = stale_nodes(&dev, &policy.nodes)?;
    if wrong.is_empty() && stale.is_empty() {
        return Ok(Vec::new());
    }
    let st = fstat(&root).map_err(|e| Error::io(format!("stat the root of {pid}"))(e.into()))?;
    if policy.rootfs.is_some_and(|r| r != (st.st_dev, st.st_ino)) {
        return Err(refused(pid, "its root is not the container's rootfs"));
    }
    let fs = fstatfs(&dev).map_err(|e| Error::io(format!("statfs /dev of {pid}"))(e.into()))?;
    if fs.filesystem_type() != TMPFS_MAGIC {
        return Err(refused(pid, "its /dev is not a tmpfs"));
    }
    if policy.user_namespace {
        return Err(refused(
            pid,
            "it runs in a user namespace, where runc binds the host's device nodes; restore it onto the GPUs it was checkpointed on",
        ));
    }
    let mut changed = Vec::new();
    for name in stale.iter().chain(wrong.iter().map(|n| &n.name)) {
        match unlinkat(&dev, name.as_str(), UnlinkatFlags::NoRemoveDir) {
            Ok(()) => changed.push(format!("removed /dev/{name}")),
            Err(nix::Error::ENOENT) => {}
            Err(e) => {
                return Err(Error::io(format!(
                    "remove /dev/{name} in restored process {pid}'s root"
                ))(e.into()))
            }
        }
    }
    for n in wrong {
        make(&dev, n).map_err(|e| {
            Error::io(format!(
                "make /dev/{} in restored process {pid}'s root",
                n.name
            ))(e.into())
        })?;
        changed.push(format!("made /dev/{}", n.name));
    }
    info!(pid, changed = ?changed, "restored container's device nodes set to its spec's");
    Ok(changed)
}

/// The spec's nodes that `dev` lacks or holds as something else (another type or numbers).
fn wrong_nodes<'a>(dev: &OwnedFd, nodes: &'a [Node]) -> Vec<&'a Node> {
    nodes
        .iter()
        .filter(
            |n| match fstatat(dev, n.name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(st) => {
                    SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != n.kind
                        || st.st_rdev != makedev(n.major, n.minor)
                }
                Err(_) => true,
            },
        )
        .collect()
}

/// The NVIDIA nodes (character devices named `nvidia*`) in `dev` that `nodes` does not hold.
fn stale_nodes(dev: &OwnedFd, nodes: &[Node]) -> Result<Vec<String>> {
    // An O_PATH handle cannot be listed: the directory it names, through its magic link.
    let link = format!("/proc/self/fd/{}", dev.as_raw_fd());
    let mut stale = Vec::new();
    for entry in std::fs::read_dir(&link).map_err(Error::io("list the restored /dev"))? {
        let entry = entry.map_err(Error::io("list the restored /dev"))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            continue;
        };
        if !is_nvidia_node(name) || nodes.iter().any(|n| n.name == name) {
            continue;
        }
        let st = fstatat(dev, name, AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(|e| Error::io(format!("stat /dev/{name}"))(e.into()))?;
        if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFCHR {
            stale.push(name.to_string());
        }
    }
    Ok(stale)
}

/// Makes node `n` in `dev`, then sets its mode and owner through a handle on what was made,
/// checked to be that node.
fn make(dev: &OwnedFd, n: &Node) -> nix::Result<()> {
    let rdev = makedev(n.major, n.minor);
    mknodat(
        dev,
        n.name.as_str(),
        n.kind,
        Mode::from_bits_truncate(n.mode),
        rdev,
    )?;
    let fd = nix::fcntl::openat(
        dev,
        n.name.as_str(),
        OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let st = fstat(&fd)?;
    if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != n.kind || st.st_rdev != rdev {
        return Err(nix::Error::EEXIST);
    }
    fchownat(
        &fd,
        "",
        Some(Uid::from_raw(n.uid)),
        Some(Gid::from_raw(n.gid)),
        AtFlags::AT_EMPTY_PATH,
    )?;
    // The umask narrowed the mode; through the handle's magic link, which names the node made.
    use std::os::unix::fs::PermissionsExt;
    let link = format!("/proc/self/fd/{}", fd.as_raw_fd());
    std::fs::set_permissions(&link, std::fs::Permissions::from_mode(n.mode))
        .map_err(|e| nix::Error::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(devices: &str) -> Spec {
        serde_json::from_str(&format!(
            r#"{{"ociVersion":"1.0.2","linux":{{"devices":{devices}}}}}"#
        ))
        .unwrap()
    }

    #[test]
    fn the_spec_nodes_in_dev_and_which_are_gpus() {
        let s = spec(
            r#"[{"path":"/dev/nvidia1","type":"c","major":195,"minor":1,"fileMode":438},
                {"path":"/dev/nvidiactl","type":"c","major":195,"minor":255},
                {"path":"/dev/dri/card0","type":"c","major":226,"minor":0}]"#,
        );
        let nodes = spec_nodes(&s);
        let names: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, ["nvidia1", "nvidiactl"]);
        assert_eq!(
            (nodes[0].major, nodes[0].minor, nodes[0].mode),
            (195, 1, 0o666)
        );
        assert!(is_nvidia_node("nvidia1") && is_nvidia_node("nvidia-uvm-tools"));
        assert!(!is_nvidia_node("fuse") && !is_nvidia_node("dri"));
    }

    #[test]
    fn a_spec_without_nvidia_nodes_changes_nothing() {
        // No NVIDIA node: not even the process is looked at.
        let s = spec(r#"[{"path":"/dev/fuse","type":"c","major":10,"minor":229}]"#);
        let policy = DevPolicy::of(&s, std::path::Path::new("/")).unwrap();
        assert!(present(i32::MAX, &policy).unwrap().is_empty());
    }

    #[test]
    fn a_dev_runc_does_not_fill_and_a_user_namespace_are_seen() {
        let s: Spec = serde_json::from_str(
            r#"{"ociVersion":"1.0.2","mounts":[{"destination":"/dev","type":"bind","source":"/dev","options":["rbind"]}],
                "linux":{"namespaces":[{"type":"user"}],"devices":[{"path":"/dev/nvidia0","type":"c","major":195,"minor":0}]}}"#,
        )
        .unwrap();
        let policy = DevPolicy::of(&s, std::path::Path::new("/")).unwrap();
        assert!(!policy.runc_fills_dev && policy.user_namespace);
        // A bound /dev: nothing is opened, made or removed (runc makes no node there either).
        assert!(present(i32::MAX, &policy).unwrap().is_empty());
    }
}
