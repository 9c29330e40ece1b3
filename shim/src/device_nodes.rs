//! After CRIU restored a container: its `/dev` holds the device nodes of this container's spec.
//!
//! runc makes the spec's `linux.devices` in the container's `/dev` (a tmpfs) when it creates a
//! container; CRIU restores that tmpfs as it was at the checkpoint. Restored onto other GPUs
//! (another minor number: `/dev/nvidia1` where the checkpoint had `/dev/nvidia0`), the
//! container would keep the checkpoint's GPU nodes and lack its own, and the driver, which
//! opens the nodes of the GPUs a restore gives it, would fail. So before the device restore,
//! in the restored container's mount namespace: each device node of the spec that its `/dev`
//! lacks is made as runc makes it (type, numbers, mode, owner), and each GPU node
//! (`nvidia<N>`) the spec does not give is removed. The device cgroup (the spec's, which runc
//! applied at restore) already allows the new nodes and not the old ones.
//!
//! Every path is resolved from the container's root without following a link
//! (`openat2(RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS)`), and each node made is checked through
//! a handle on it before its mode and owner are set.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{fstat, fstatat, makedev, mknodat, Mode, SFlag};
use nix::unistd::{fchownat, unlinkat, Gid, Uid, UnlinkatFlags};
use oci_spec::runtime::{LinuxDevice, LinuxDeviceType, Spec};
use tracing::info;

use crate::error::{Error, Result};
use crate::mount_check::{open_in_root, open_root};

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

/// A GPU's device node name: `nvidia` and a minor number.
fn is_gpu_node(name: &str) -> bool {
    name.strip_prefix("nvidia")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Makes the restored container whose task is `pid` hold the device nodes of `spec` in its
/// `/dev`, and no GPU node the spec does not give. Returns what it changed, for the log.
pub fn present(pid: i32, spec: &Spec) -> Result<Vec<String>> {
    let nodes = spec_nodes(spec);
    if !nodes.iter().any(|n| is_gpu_node(&n.name)) {
        return Ok(Vec::new());
    }
    let root = open_root(pid)?;
    let dev = open_in_root(root.as_fd(), "/dev")
        .map_err(|e| Error::io(format!("open /dev of restored process {pid}"))(e.into()))?;
    let mut changed = Vec::new();
    for n in &nodes {
        if fstatat(&dev, n.name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW).is_ok() {
            continue;
        }
        make(&dev, n).map_err(|e| {
            Error::io(format!(
                "make /dev/{} in restored process {pid}'s root",
                n.name
            ))(e.into())
        })?;
        changed.push(format!("made /dev/{}", n.name));
    }
    for name in stale_gpu_nodes(&dev, &nodes)? {
        unlinkat(&dev, name.as_str(), UnlinkatFlags::NoRemoveDir).map_err(|e| {
            Error::io(format!(
                "remove /dev/{name} in restored process {pid}'s root"
            ))(e.into())
        })?;
        changed.push(format!("removed /dev/{name}"));
    }
    if !changed.is_empty() {
        info!(pid, changed = ?changed, "restored container's device nodes set to its spec's");
    }
    Ok(changed)
}

/// [`present`] in each mount namespace of the restored tasks `pids`.
pub fn present_all(pids: &[i32], spec: &Spec) -> Result<Vec<String>> {
    let mut seen = Vec::new();
    let mut changed = Vec::new();
    for &pid in pids {
        let Ok(ns) = std::fs::read_link(format!("/proc/{pid}/ns/mnt")) else {
            continue;
        };
        if !seen.contains(&ns) {
            seen.push(ns);
            changed.extend(present(pid, spec)?);
        }
    }
    Ok(changed)
}

/// The GPU nodes (character devices named `nvidia<N>`) in `dev` that `nodes` does not hold.
fn stale_gpu_nodes(dev: &OwnedFd, nodes: &[Node]) -> Result<Vec<String>> {
    // An O_PATH handle cannot be listed: the directory it names, through its magic link.
    let link = format!("/proc/self/fd/{}", dev.as_raw_fd());
    let mut stale = Vec::new();
    for entry in std::fs::read_dir(&link).map_err(Error::io("list the restored /dev"))? {
        let entry = entry.map_err(Error::io("list the restored /dev"))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            continue;
        };
        if !is_gpu_node(name) || nodes.iter().any(|n| n.name == name) {
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
        assert!(is_gpu_node("nvidia1") && is_gpu_node("nvidia12"));
        assert!(!is_gpu_node("nvidiactl") && !is_gpu_node("nvidia-uvm") && !is_gpu_node("nvidia"));
    }

    #[test]
    fn a_spec_without_gpu_nodes_changes_nothing() {
        // No GPU node: not even the process is looked at.
        let s = spec(r#"[{"path":"/dev/fuse","type":"c","major":10,"minor":229}]"#);
        assert!(present(i32::MAX, &s).unwrap().is_empty());
    }
}
