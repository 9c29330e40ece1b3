//! The CDI spec that injects simulated GPUs into containers the way nvidia-container-toolkit's
//! spec injects real ones: one device node `/dev/nvidia<minor>` per GPU, the common nodes
//! (`nvidiactl`, `nvidia-uvm`, `nvidia-uvm-tools`), the two libraries, and the daemon's socket;
//! and the simulated NCCL (`libnccl.so.<NCCL version>`, linked as `libnccl.so.2`), which a real
//! node's spec does not carry, so that NCCL programs in containers on simulated GPUs find the
//! NCCL that runs on them.
//!
//! The libraries are mounted as the toolkit mounts the driver's: the versioned file
//! (`libcuda.so.<driver version>`) at the same name in the container, and a `createContainer`
//! hook ([`create_symlinks`], the binary's `hook create-symlinks`, as `nvidia-ctk hook
//! create-symlinks`) makes the loader's link `libcuda.so.1 -> libcuda.so.<version>` in the
//! container's root. A process that loads `libcuda.so.1` then maps, and `/proc/<pid>/maps`
//! shows, `libcuda.so.<version>`, as on a real node.
//!
//! The nodes' host paths are the ones the daemon makes in its directory (`dev/`). A real node's
//! are NVIDIA's character devices (195:N per GPU, 195:255 for `nvidiactl`, the `nvidia-uvm`
//! major for the other two); the simulator's are the character device of `/dev/zero` (1:5),
//! which opens on a host without NVIDIA's kernel module and which runc's default device rules
//! already allow. The library tells the GPUs apart by the node's name, as the driver tells
//! them apart by its minor number.

use std::ffi::CString;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::node::{library_files, NodeDesc};
use crate::proto::{COMMON_NODES, CONTAINER_SOCKET, DEV_DIR_NAME, ENV_SOCKET, SOCKET_NAME};

/// CDI kind of the simulated GPUs (`sim.gpu-ckpt.io/gpu=0`, `=all`).
pub const KIND: &str = "sim.gpu-ckpt.io/gpu";
/// File name of the spec in the CDI directory.
pub const SPEC_FILE: &str = "sim.gpu-ckpt.io-gpu.json";
/// Where the libraries appear in a container (Debian's multiarch directory, as the NVIDIA
/// toolkit mounts them).
pub const CONTAINER_LIB_DIR: &str = "/usr/lib/x86_64-linux-gnu";

fn bind(host: &Path, container: &str) -> Value {
    json!({
        "hostPath": host.to_string_lossy(),
        "containerPath": container,
        "options": ["ro", "nosuid", "nodev", "bind"],
    })
}

/// A device node `/dev/<name>`, backed by the daemon's node of that name.
fn node(dev: &Path, name: &str) -> Value {
    json!({
        "path": format!("/dev/{name}"),
        "hostPath": dev.join(name).to_string_lossy(),
    })
}

/// The spec for the node whose daemon lives in `dir`; `hook` is this simulator's binary, which
/// makes the libraries' links in each container ([`create_symlinks`]).
pub fn spec(dir: &Path, node_desc: &NodeDesc, hook: &Path) -> Value {
    let dev = dir.join(DEV_DIR_NAME);
    let gpu_node = |g: &crate::node::GpuDesc| node(&dev, &format!("nvidia{}", g.index));
    let mut devices: Vec<Value> = node_desc
        .gpus
        .iter()
        .map(|g| {
            json!({
                "name": g.index.to_string(),
                "containerEdits": { "deviceNodes": [gpu_node(g)] },
            })
        })
        .collect();
    devices.extend(mig_devices(&dev, node_desc));
    devices.push(json!({
        "name": "all",
        "containerEdits": {
            "deviceNodes": node_desc.gpus.iter().map(gpu_node).collect::<Vec<_>>(),
        },
    }));
    let lib = dir.join("lib");
    let mut mounts = Vec::new();
    let mut hook_args = vec![
        "gpu-ckpt-simgpu".to_string(),
        "hook".into(),
        "create-symlinks".into(),
    ];
    for l in library_files(&node_desc.driver_version) {
        mounts.push(bind(
            &lib.join(&l.file),
            &format!("{CONTAINER_LIB_DIR}/{}", l.file),
        ));
        hook_args.push("--link".into());
        hook_args.push(format!("{}::{CONTAINER_LIB_DIR}/{}", l.file, l.soname));
    }
    let mut socket = bind(&dir.join(SOCKET_NAME), CONTAINER_SOCKET);
    // The socket must be writable to connect to it.
    socket["options"] = json!(["nosuid", "nodev", "bind"]);
    json!({
        "cdiVersion": "0.6.0",
        "kind": KIND,
        "devices": devices,
        "containerEdits": {
            "env": [format!("{ENV_SOCKET}={CONTAINER_SOCKET}")],
            "deviceNodes": COMMON_NODES.iter().map(|n| node(&dev, n)).collect::<Vec<_>>(),
            "mounts": mounts.into_iter().chain([socket]).collect::<Vec<_>>(),
            "hooks": [{
                "hookName": "createContainer",
                "path": hook.to_string_lossy(),
                "args": hook_args,
            }],
        },
    })
}

/// Where a MIG instance's capability nodes are, under `dev/` in the node directory and in a
/// container.
pub const MIG_CAPS_DIR: &str = "nvidia-caps";

/// The capability minors of GPU `index`'s GPU instance 0 and of its compute instance 0, as the
/// driver numbers them in `/proc/driver/nvidia-caps/mig-minors` (`config` 1, `monitor` 2, then
/// per GPU 15 GPU instances of 9 minors each: the instance's `access`, then one per compute
/// instance).
pub fn mig_cap_minors(index: u32) -> [u32; 2] {
    let gi = 3 + 135 * index;
    [gi, gi + 1]
}

/// One MIG device per GPU in MIG mode, as nvidia-container-toolkit's spec presents a MIG
/// instance (named `<gpu index>:<mig index>`): the parent GPU's node and the instance's two
/// capability nodes. The simulator has one instance per MIG-mode GPU.
pub fn mig_devices(dev: &Path, node_desc: &NodeDesc) -> Vec<Value> {
    node_desc
        .gpus
        .iter()
        .filter(|g| g.mig)
        .map(|g| {
            let mut nodes = vec![node(dev, &format!("nvidia{}", g.index))];
            nodes.extend(
                mig_cap_minors(g.index)
                    .map(|m| node(dev, &format!("{MIG_CAPS_DIR}/nvidia-cap{m}"))),
            );
            json!({
                "name": format!("{}:0", g.index),
                "containerEdits": { "deviceNodes": nodes },
            })
        })
        .collect()
}

/// The `createContainer` hook: for each `target::link` of `links`, the symbolic link `link` (an
/// absolute path in the container) to `target`, made in the root of the container whose OCI
/// state is read from `state` (the runtime writes it to the hook's stdin). The link's directory
/// is resolved inside the root (`openat2` with `RESOLVE_IN_ROOT`, so no link in the image leads
/// out of it); a link already there is replaced, anything else there is left alone.
pub fn create_symlinks(state: impl Read, links: &[String]) -> io::Result<()> {
    let state: Value = serde_json::from_reader(state).map_err(io::Error::other)?;
    let bundle = PathBuf::from(
        state["bundle"]
            .as_str()
            .ok_or_else(|| invalid("the container state has no bundle"))?,
    );
    let config: Value = serde_json::from_slice(&std::fs::read(bundle.join("config.json"))?)
        .map_err(io::Error::other)?;
    let root = config["root"]["path"]
        .as_str()
        .ok_or_else(|| invalid("the container's config has no root.path"))?;
    let root = bundle.join(root);
    let root = open_dir(libc::AT_FDCWD, &root, 0)?;
    for spec in links {
        let (target, link) = spec
            .split_once("::")
            .ok_or_else(|| invalid(&format!("{spec:?} is not TARGET::LINK")))?;
        let link = Path::new(link);
        let (Some(parent), Some(name)) = (link.parent(), link.file_name()) else {
            return Err(invalid(&format!("{spec:?}: no directory and name")));
        };
        let parent = open_dir(root.as_raw_fd(), parent, libc::RESOLVE_IN_ROOT)?;
        let name = CString::new(name.as_encoded_bytes()).map_err(io::Error::other)?;
        let target = CString::new(target).map_err(io::Error::other)?;
        // SAFETY: a stat buffer for fstatat to fill; name is NUL-terminated.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        let found = unsafe {
            libc::fstatat(
                parent.as_raw_fd(),
                name.as_ptr(),
                &mut st,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        } == 0;
        if found {
            if st.st_mode & libc::S_IFMT != libc::S_IFLNK {
                eprintln!(
                    "gpu-ckpt-simgpu hook: {} exists and is not a link: left alone",
                    link.display()
                );
                continue;
            }
            // SAFETY: name is NUL-terminated; parent is an open directory.
            if unsafe { libc::unlinkat(parent.as_raw_fd(), name.as_ptr(), 0) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        // SAFETY: both strings are NUL-terminated; parent is an open directory.
        if unsafe { libc::symlinkat(target.as_ptr(), parent.as_raw_fd(), name.as_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what.to_string())
}

/// `path` opened as a directory (`O_PATH`) below `dirfd` with `resolve`'s `RESOLVE_*` flags.
fn open_dir(dirfd: libc::c_int, path: &Path, resolve: u64) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(io::Error::other)?;
    // SAFETY: open_how is plain data; every field not set here is zero.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) as u64;
    how.resolve = resolve;
    // SAFETY: c is NUL-terminated, how is a valid open_how of the size passed.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dirfd,
            c.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::new(
            io::Error::last_os_error().kind(),
            format!("{}: {}", path.display(), io::Error::last_os_error()),
        ));
    }
    // SAFETY: the kernel returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hook_links_inside_the_containers_root() {
        let bundle = tempfile::tempdir().unwrap();
        let config = r#"{"root": {"path": "rootfs"}}"#;
        std::fs::write(bundle.path().join("config.json"), config).unwrap();
        let (root, lib) = (bundle.path().join("rootfs"), "usr/lib/x86_64-linux-gnu");
        let lib = root.join(lib);
        std::fs::create_dir_all(&lib).unwrap();
        // A link already there is replaced; a file there is left alone.
        std::os::unix::fs::symlink("old", lib.join("libnvidia-ml.so.1")).unwrap();
        std::fs::write(root.join("usr/lib/keep.so.1"), b"x").unwrap();
        // A directory link in the image that points out of the root resolves inside it.
        std::os::unix::fs::symlink("/usr/lib", root.join("escape")).unwrap();
        let state = format!(r#"{{"bundle": {:?}}}"#, bundle.path());
        create_symlinks(
            state.as_bytes(),
            &[
                "libcuda.so.580.95.05::/usr/lib/x86_64-linux-gnu/libcuda.so.1".into(),
                "libnvidia-ml.so.580.95.05::/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1".into(),
                "other::/usr/lib/keep.so.1".into(),
                "inside::/escape/made.so.1".into(),
            ],
        )
        .unwrap();
        let link = |p: &Path| std::fs::read_link(p).unwrap();
        assert_eq!(
            link(&lib.join("libcuda.so.1")),
            Path::new("libcuda.so.580.95.05")
        );
        assert_eq!(
            link(&lib.join("libnvidia-ml.so.1")),
            Path::new("libnvidia-ml.so.580.95.05")
        );
        assert_eq!(std::fs::read(root.join("usr/lib/keep.so.1")).unwrap(), b"x");
        assert_eq!(link(&root.join("usr/lib/made.so.1")), Path::new("inside"));
    }

    #[test]
    fn the_spec_mounts_the_versioned_files_and_links_them() {
        let node = crate::node::NodeConfig::default().describe();
        let s = spec(Path::new("/sim"), &node, Path::new("/bin/sim"));
        let mounts = s["containerEdits"]["mounts"].as_array().unwrap();
        let dests: Vec<&str> = mounts
            .iter()
            .map(|m| m["containerPath"].as_str().unwrap())
            .collect();
        // The driver's libraries under the driver's version, the simulated NCCL under its own.
        for file in [
            "libcuda.so.580.95.05",
            "libnvidia-ml.so.580.95.05",
            "libnccl.so.2.32.6",
        ] {
            let dest = format!("/usr/lib/x86_64-linux-gnu/{file}");
            assert!(dests.contains(&dest.as_str()), "{dests:?}");
        }
        let hook = &s["containerEdits"]["hooks"][0];
        assert_eq!(hook["hookName"], "createContainer");
        assert_eq!(hook["path"], "/bin/sim");
        let args: Vec<&str> = hook["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        // Each linked by its soname.
        for link in [
            "libcuda.so.580.95.05::/usr/lib/x86_64-linux-gnu/libcuda.so.1",
            "libnccl.so.2.32.6::/usr/lib/x86_64-linux-gnu/libnccl.so.2",
        ] {
            assert!(args.contains(&link), "{args:?}");
        }
    }
}
