//! gpu-ckpt's NCCL layer put into a container that opts in (the annotation `gpu-ckpt.io/nccl:
//! managed`, or the handler option `Nccl = "managed"` where the container has no annotation):
//!
//! - the layer (`NcclLayer`, by default [`DEFAULT_NCCL_LAYER`]) bind-mounted read-only at
//!   [`LAYER_IN_CONTAINER`], and put first in the container's `LD_PRELOAD` (before what the spec
//!   already preloads);
//! - a directory of the host made afresh for the container, `/run/gpu-ckpt/nccl/<namespace>/<id>`
//!   (root, 0755), bind-mounted read-only, `nosuid,nodev,noexec`, at [`SOCKET_DIR_IN_CONTAINER`]:
//!   the shim listens on `control.sock` in it (the layer's control connection,
//!   `gpu_ckpt_nccl_control`), and the container finds it by `GPU_CKPT_NCCL_SOCKET`.
//!
//! Applied to `config.json` at Create, before `runc create`, and at a restore's Create (the
//! restore handler's own restore and containerd's), so that CRIU finds the layer's mapping and
//! the socket directory at the same paths and the restored container's mounts are its spec's
//! (`mount_check`). At a restore the checkpoint decides ([`opt_in_at_restore`]): CRIU can
//! neither add a mount the checkpoint lacks nor leave out one it has.
//!
//! The host directory is made from `/` one component at a time, never through a link: the
//! directories above it must be directories that only root (or the shim's user) can write, and
//! a link where the container's directory goes is refused. [`remove`] takes it away at Delete
//! and when a gone shim's bundle is cleaned up.

use std::{
    os::fd::{AsFd, OwnedFd},
    path::{Component, Path, PathBuf},
};

use image_format::digest::{digest_file, no_progress, FileHasher};
use nix::{
    errno::Errno,
    fcntl::{openat, AtFlags, OFlag, AT_FDCWD},
    sys::stat::{fchmod, fstat, fstatat, mkdirat, Mode, SFlag},
    unistd::{unlinkat, UnlinkatFlags},
};
use serde_json::{json, Value};
use tracing::{info, warn};

use crate::{
    annotations::{self, Annotations},
    error::{Error, Result},
    options::{RuntimeOptions, DEFAULT_NCCL_LAYER},
};

/// Where the layer is in a container.
pub const LAYER_IN_CONTAINER: &str = "/usr/lib/gpu-ckpt/libgpu-ckpt-nccl.so";
/// The layer's file name (its soname): how a process's mappings show that it loaded it.
pub const LAYER_FILE_NAME: &str = "libgpu-ckpt-nccl.so";
/// Where the socket directory is in a container.
pub const SOCKET_DIR_IN_CONTAINER: &str = "/run/gpu-ckpt-nccl";
/// The control socket's name in the socket directory.
pub const SOCKET_NAME: &str = "control.sock";
/// The control socket in a container.
pub const SOCKET_IN_CONTAINER: &str = "/run/gpu-ckpt-nccl/control.sock";
/// The environment variable that tells the layer where the control socket is.
pub const SOCKET_ENV: &str = "GPU_CKPT_NCCL_SOCKET";
/// The environment variable that tells the layer what Release does (`NcclRelease`).
pub const RELEASE_ENV: &str = nccl_control::ENV_RELEASE;
/// The preload list the layer goes first in.
pub const PRELOAD_ENV: &str = "LD_PRELOAD";
/// Where the containers' socket directories are made: `<base>/<namespace>/<container id>`.
pub const HOST_DIR_BASE: &str = "/run/gpu-ckpt/nccl";

/// What [`inject`] set up for a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclSetup {
    /// The container's socket directory on the host.
    pub host_dir: PathBuf,
    /// The host path of the control socket (`<host_dir>/control.sock`), for the listener.
    pub socket: PathBuf,
    /// BLAKE3 (lower-case hex) of the layer bind-mounted into the container, read at Create.
    pub layer_blake3: String,
}

/// Whether a container gets the layer: its annotation `gpu-ckpt.io/nccl` where present, else
/// the handler option `Nccl`.
pub fn opt_in(options: &RuntimeOptions, annotations: &Annotations) -> bool {
    match annotations.get(annotations::NCCL) {
        Some(v) => v == "managed",
        None => options.nccl_managed(),
    }
}

/// Whether a container restored from the CRIU image directory `checkpoint` gets the layer:
/// where the checkpoint's mount images have the layer's or the socket directory's mount, yes
/// (the restored processes map the layer and connect to the socket; CRIU cannot restore them
/// without those mounts), and where they have mount images without either, no (CRIU cannot add
/// a mount the checkpoint lacks), whatever the annotation and the option say (a warning names
/// the difference). A checkpoint without mount images: as at a cold start ([`opt_in`]).
pub fn opt_in_at_restore(
    options: &RuntimeOptions,
    annotations: &Annotations,
    checkpoint: &Path,
) -> bool {
    let asked = opt_in(options, annotations);
    let Some(had) = checkpoint_had_layer(checkpoint) else {
        return asked;
    };
    if had != asked {
        warn!(
            checkpoint = %checkpoint.display(),
            "the checkpoint was taken {} gpu-ckpt's NCCL layer and this container asks {} it ({} {}, or the handler option Nccl): restored {}, as the checkpoint was",
            if had { "with" } else { "without" },
            if asked { "for" } else { "not for" },
            annotations::NCCL,
            annotations.get(annotations::NCCL).unwrap_or("absent"),
            if had { "with it" } else { "without it" },
        );
    }
    had
}

/// Whether the mount images of the CRIU image directory `dir` have the layer's or the socket
/// directory's mount; `None` without mount images (or when they cannot be read: the restore's
/// own checks name that).
pub fn checkpoint_had_layer(dir: &Path) -> Option<bool> {
    let mounts = image_format::mountinfo::read_criu_mounts(dir).ok()?;
    if mounts.is_empty() {
        return None;
    }
    Some(
        mounts
            .iter()
            .any(|m| m.mountpoint == LAYER_IN_CONTAINER || m.mountpoint == SOCKET_DIR_IN_CONTAINER),
    )
}

/// Adds the layer's and the socket directory's mounts and the environment to `spec`
/// (`config.json` as JSON) when the container opts in ([`opt_in`]), and makes the host socket
/// directory. `None` when the container does not opt in (the spec untouched).
pub fn inject(
    spec: &mut Value,
    options: &RuntimeOptions,
    annotations: &Annotations,
    namespace: &str,
    id: &str,
) -> Result<Option<NcclSetup>> {
    inject_in(
        Path::new(HOST_DIR_BASE),
        spec,
        options,
        annotations,
        namespace,
        id,
    )
}

/// [`inject`] with the socket directories under `base`.
fn inject_in(
    base: &Path,
    spec: &mut Value,
    options: &RuntimeOptions,
    annotations: &Annotations,
    namespace: &str,
    id: &str,
) -> Result<Option<NcclSetup>> {
    if !opt_in(options, annotations) {
        return Ok(None);
    }
    inject_under(base, spec, options, namespace, id).map(Some)
}

/// [`inject`] for a container that opts in (decided by the caller: [`opt_in`] or
/// [`opt_in_at_restore`]).
pub fn inject_managed(
    spec: &mut Value,
    options: &RuntimeOptions,
    namespace: &str,
    id: &str,
) -> Result<NcclSetup> {
    inject_under(Path::new(HOST_DIR_BASE), spec, options, namespace, id)
}

/// [`inject_managed`] with the socket directories under `base`. The spec is edited first (it
/// can fail on a malformed spec), then the directory is made: on error nothing is left.
fn inject_under(
    base: &Path,
    spec: &mut Value,
    options: &RuntimeOptions,
    namespace: &str,
    id: &str,
) -> Result<NcclSetup> {
    let layer = options.nccl_layer();
    let layer_blake3 = layer_digest(&layer)?;
    let host_dir = host_dir_under(base, namespace, id)?;
    let mut edited = spec.clone();
    edit_spec(&mut edited, &layer, &host_dir, options.nccl_release())?;
    make_fresh(&host_dir, base.parent().unwrap_or(base), base)?;
    *spec = edited;
    info!(%namespace, %id, layer = %layer.display(), %layer_blake3, dir = %host_dir.display(), "NCCL layer injected");
    Ok(NcclSetup {
        socket: host_dir.join(SOCKET_NAME),
        host_dir,
        layer_blake3,
    })
}

/// Removes the socket directory of container `id` of `namespace` (at Delete, and when a gone
/// shim's bundle is cleaned up); nothing when there is none.
pub fn remove(namespace: &str, id: &str) {
    if let Ok(dir) = host_dir_under(Path::new(HOST_DIR_BASE), namespace, id) {
        remove_dir(&dir);
    }
}

/// Removes the socket directory of `setup`.
pub fn remove_setup(setup: &NcclSetup) {
    remove_dir(&setup.host_dir);
}

/// Removes `dir` (never following a link at it: a link is only unlinked) and what is in it.
fn remove_dir(dir: &Path) {
    let result = match std::fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(dir),
        Ok(_) => std::fs::remove_file(dir),
        Err(e) => Err(e),
    };
    match result {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => warn!(dir = %dir.display(), error = %e, "remove the NCCL socket directory"),
    }
}

/// BLAKE3 of the layer the options name (`NcclLayer`): what a checkpoint records and a
/// restore holds the node's layer to.
pub fn layer_blake3(options: &RuntimeOptions) -> Result<String> {
    layer_digest(&options.nccl_layer())
}

/// BLAKE3 of the layer at `path`, a regular file; a missing one is refused naming the path
/// and the option.
fn layer_digest(path: &Path) -> Result<String> {
    let refuse = |why: String| {
        Error::FailedPrecondition(format!(
            "the NCCL layer {} (the handler option NcclLayer, default {DEFAULT_NCCL_LAYER}) {why}: the container asks for gpu-ckpt's NCCL layer ({}: managed, or the handler option Nccl = \"managed\"); install it (the node installer puts it at {DEFAULT_NCCL_LAYER}) or set NcclLayer to where it is",
            path.display(),
            annotations::NCCL,
        ))
    };
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => {}
        Ok(_) => return Err(refuse("is not a regular file".into())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(refuse("does not exist".into()))
        }
        Err(e) => return Err(refuse(format!("cannot be read: {e}"))),
    }
    let digest = digest_file(path, FileHasher::every(), &mut no_progress)
        .map_err(|e| refuse(format!("cannot be read: {e}")))?;
    Ok(digest.blake3)
}

/// `<base>/<namespace>/<id>`, each a single path component.
fn host_dir_under(base: &Path, namespace: &str, id: &str) -> Result<PathBuf> {
    crate::private_dir::container_dir(base, namespace, id, "an NCCL socket directory")
}

/// The spec's edits: the two mounts (after the spec's own, so that they go over any mount of
/// `/run` or `/usr`, and in place of any at their destinations), the layer first in every
/// `LD_PRELOAD`, `GPU_CKPT_NCCL_SOCKET` and `GPU_CKPT_NCCL_RELEASE` = `release`. Idempotent.
fn edit_spec(spec: &mut Value, layer: &Path, host_dir: &Path, release: &str) -> Result<()> {
    let malformed = |what: &str| cannot_add("bundle config", what);
    let path_text = |p: &Path| {
        p.to_str()
            .map(str::to_string)
            .ok_or_else(|| malformed(&format!("{} is not UTF-8", p.display())))
    };
    let (layer, host_dir) = (path_text(layer)?, path_text(host_dir)?);
    let root = spec
        .as_object_mut()
        .ok_or_else(|| malformed("not a JSON object"))?;
    let mounts = list_entry(root, "mounts").ok_or_else(|| malformed("mounts is not a list"))?;
    let ours = [LAYER_IN_CONTAINER, SOCKET_DIR_IN_CONTAINER];
    mounts.retain(|m| {
        let dest = m["destination"]
            .as_str()
            .map(image_format::mountinfo::normalize);
        !dest.is_some_and(|d| ours.contains(&d.as_str()))
    });
    mounts.push(json!({
        "destination": LAYER_IN_CONTAINER,
        "type": "bind",
        "source": layer,
        "options": ["bind", "ro", "nosuid", "nodev"],
    }));
    mounts.push(json!({
        "destination": SOCKET_DIR_IN_CONTAINER,
        "type": "bind",
        "source": host_dir,
        "options": ["bind", "ro", "nosuid", "nodev", "noexec"],
    }));
    let process = root
        .get_mut("process")
        .and_then(Value::as_object_mut)
        .ok_or_else(|| malformed("no process"))?;
    edit_env(process, release).map_err(|what| malformed(&what))
}

/// An exec's process spec (`ExecProcessRequest.spec`, JSON) in a container that got the layer:
/// the same environment as its init (the layer first in `LD_PRELOAD`, `GPU_CKPT_NCCL_SOCKET`,
/// `GPU_CKPT_NCCL_RELEASE` = `release`), so that a rank started by `kubectl exec` runs under
/// the layer too.
pub fn exec_process(spec: &[u8], release: &str) -> Result<Vec<u8>> {
    let malformed = |what: String| cannot_add("exec process spec", &what);
    let mut process: Value = serde_json::from_slice(spec).map_err(|e| malformed(e.to_string()))?;
    let map = process
        .as_object_mut()
        .ok_or_else(|| malformed("not a JSON object".into()))?;
    edit_env(map, release).map_err(malformed)?;
    serde_json::to_vec(&process).map_err(|e| malformed(e.to_string()))
}

/// Why a spec (`spec`: which one) cannot get the layer.
fn cannot_add(spec: &str, what: &str) -> Error {
    Error::InvalidArgument(format!("{spec}: {what}: cannot add the NCCL layer"))
}

/// The list at `key` of `map` (an empty one made where it is missing or null); `None` where
/// it is something else.
fn list_entry<'a>(
    map: &'a mut serde_json::Map<String, Value>,
    key: &str,
) -> Option<&'a mut Vec<Value>> {
    let list = map.entry(key).or_insert_with(|| Value::Array(Vec::new()));
    if list.is_null() {
        *list = Value::Array(Vec::new());
    }
    list.as_array_mut()
}

/// The layer first in every `LD_PRELOAD` of `process.env` (one made where there is none), and
/// `GPU_CKPT_NCCL_SOCKET` and `GPU_CKPT_NCCL_RELEASE` (in place of any the spec has).
/// Idempotent.
fn edit_env(
    process: &mut serde_json::Map<String, Value>,
    release: &str,
) -> std::result::Result<(), String> {
    let env = list_entry(process, "env").ok_or_else(|| "process.env is not a list".to_string())?;
    let socket_prefix = format!("{SOCKET_ENV}=");
    let release_prefix = format!("{RELEASE_ENV}=");
    let preload_prefix = format!("{PRELOAD_ENV}=");
    env.retain(|e| {
        !e.as_str()
            .is_some_and(|s| s.starts_with(&socket_prefix) || s.starts_with(&release_prefix))
    });
    let mut preloads = 0;
    for e in env.iter_mut() {
        let Some(list) = e.as_str().and_then(|s| s.strip_prefix(&preload_prefix)) else {
            continue;
        };
        preloads += 1;
        // ld.so splits the list at ':' and at spaces.
        if list.split([':', ' ']).next() == Some(LAYER_IN_CONTAINER) {
            continue;
        }
        *e = Value::String(if list.trim().is_empty() {
            format!("{preload_prefix}{LAYER_IN_CONTAINER}")
        } else {
            format!("{preload_prefix}{LAYER_IN_CONTAINER}:{list}")
        });
    }
    if preloads == 0 {
        env.push(Value::String(format!(
            "{preload_prefix}{LAYER_IN_CONTAINER}"
        )));
    }
    env.push(Value::String(format!(
        "{socket_prefix}{SOCKET_IN_CONTAINER}"
    )));
    env.push(Value::String(format!("{release_prefix}{release}")));
    Ok(())
}

/// Makes `dir` afresh, mode 0755: every directory on the way from `/` opened without following
/// a link (and made 0755 where missing); those from `trusted_from` down must be directories
/// owned by root (or the shim's user) that no one else can write, and those from
/// `private_from` down are made 0700 (others cannot reach the socket); a link at `dir` is refused;
/// a directory there (an earlier shim's of the same container) is removed first.
fn make_fresh(dir: &Path, trusted_from: &Path, private_from: &Path) -> Result<()> {
    let refuse = |why: String| {
        Error::FailedPrecondition(format!(
            "cannot make the NCCL control socket's directory {}: {why}",
            dir.display()
        ))
    };
    let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) else {
        return Err(refuse("it has no parent".into()));
    };
    let ours = nix::unistd::geteuid().as_raw();
    let mut at: OwnedFd = openat(
        AT_FDCWD,
        "/",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| refuse(format!("open /: {e}")))?;
    let mut walked = PathBuf::from("/");
    for c in parent.components() {
        let c = match c {
            Component::RootDir => continue,
            Component::Normal(c) => c,
            _ => return Err(refuse("its path is not plain".into())),
        };
        walked.push(c);
        // From the base down, root's only: the container reaches its own directory through
        // the bind mount, and no one else on the host reaches the socket.
        let private = walked.starts_with(private_from);
        let mode = if private { 0o700 } else { 0o755 };
        match mkdirat(at.as_fd(), c, Mode::from_bits_truncate(mode)) {
            Ok(()) | Err(Errno::EEXIST) => {}
            Err(e) => return Err(refuse(format!("create {}: {e}", walked.display()))),
        }
        at = openat(
            at.as_fd(),
            c,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| {
            refuse(match e {
                Errno::ELOOP | Errno::ENOTDIR => {
                    format!("{} is a symlink or not a directory", walked.display())
                }
                e => format!("open {}: {e}", walked.display()),
            })
        })?;
        if walked.starts_with(trusted_from) {
            let st =
                fstat(at.as_fd()).map_err(|e| refuse(format!("stat {}: {e}", walked.display())))?;
            if st.st_uid != 0 && st.st_uid != ours {
                return Err(refuse(format!(
                    "{} is owned by uid {}, not root",
                    walked.display(),
                    st.st_uid
                )));
            }
            if st.st_mode & 0o022 != 0 {
                return Err(refuse(format!(
                    "{} has mode {:o}: others can write to it",
                    walked.display(),
                    st.st_mode & 0o7777
                )));
            }
        }
        if private {
            fchmod(at.as_fd(), Mode::from_bits_truncate(0o700))
                .map_err(|e| refuse(format!("chmod {}: {e}", walked.display())))?;
        }
    }
    match fstatat(at.as_fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Err(Errno::ENOENT) => {}
        Err(e) => return Err(refuse(format!("stat: {e}"))),
        Ok(st) => {
            let kind = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT;
            if kind == SFlag::S_IFLNK {
                return Err(refuse(
                    "a symlink is there: the shim makes the directory afresh and never follows a link".into(),
                ));
            }
            if kind == SFlag::S_IFDIR {
                // An earlier shim's: the parents are root's only, so this is still the
                // directory just looked at.
                std::fs::remove_dir_all(dir)
                    .map_err(|e| refuse(format!("remove the earlier one: {e}")))?;
            } else {
                unlinkat(at.as_fd(), name, UnlinkatFlags::NoRemoveDir)
                    .map_err(|e| refuse(format!("remove what was there: {e}")))?;
            }
        }
    }
    mkdirat(at.as_fd(), name, Mode::from_bits_truncate(0o755))
        .map_err(|e| refuse(format!("create: {e}")))?;
    let fd = openat(
        at.as_fd(),
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| refuse(format!("open: {e}")))?;
    fchmod(fd.as_fd(), Mode::from_bits_truncate(0o755))
        .map_err(|e| refuse(format!("chmod: {e}")))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::os::unix::fs::{symlink, PermissionsExt};

    use super::*;

    const LAYER_BYTES: &[u8] = b"\x7fELF not really a layer";

    /// A node: a layer file and a base for the socket directories, in a temporary directory.
    struct Node {
        tmp: tempfile::TempDir,
    }

    impl Node {
        fn new() -> Node {
            let tmp = tempfile::tempdir().unwrap();
            std::fs::write(tmp.path().join("libgpu_ckpt_nccl.so"), LAYER_BYTES).unwrap();
            Node { tmp }
        }
        fn layer(&self) -> PathBuf {
            self.tmp.path().join("libgpu_ckpt_nccl.so")
        }
        fn base(&self) -> PathBuf {
            self.tmp.path().join("nccl")
        }
        fn options(&self, nccl: &str) -> RuntimeOptions {
            RuntimeOptions {
                nccl: nccl.into(),
                nccl_layer: self.layer().display().to_string(),
                ..Default::default()
            }
        }
        fn inject(
            &self,
            spec: &mut Value,
            options: &RuntimeOptions,
            annotations: &Annotations,
        ) -> Result<Option<NcclSetup>> {
            inject_in(&self.base(), spec, options, annotations, "k8s.io", "c1")
        }
    }

    fn annotations(pairs: &[(&str, &str)]) -> Annotations {
        let all: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Annotations::from_spec(&all).unwrap()
    }

    fn spec(env: &[&str]) -> Value {
        json!({
            "ociVersion": "1.0.2",
            "process": {"args": ["nccl_allreduce"], "cwd": "/", "env": env, "user": {"uid": 0, "gid": 0}},
            "root": {"path": "rootfs"},
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/run", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid"]},
            ],
        })
    }

    fn env_of(spec: &Value) -> Vec<String> {
        spec["process"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_str().unwrap().to_string())
            .collect()
    }

    fn mount_at<'a>(spec: &'a Value, dest: &str) -> Vec<&'a Value> {
        spec["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["destination"] == dest)
            .collect()
    }

    #[test]
    fn the_spec_gets_both_mounts_and_the_environment() {
        let node = Node::new();
        let mut s = spec(&["PATH=/usr/bin", "RANK=0"]);
        let setup = node
            .inject(&mut s, &node.options("managed"), &Annotations::default())
            .unwrap()
            .unwrap();
        let dir = node.base().join("k8s.io").join("c1");
        assert_eq!(setup.host_dir, dir);
        assert_eq!(setup.socket, dir.join("control.sock"));
        assert_eq!(setup.layer_blake3.len(), 64);
        assert_eq!(
            env_of(&s),
            [
                "PATH=/usr/bin",
                "RANK=0",
                "LD_PRELOAD=/usr/lib/gpu-ckpt/libgpu-ckpt-nccl.so",
                "GPU_CKPT_NCCL_SOCKET=/run/gpu-ckpt-nccl/control.sock",
                "GPU_CKPT_NCCL_RELEASE=destroy",
            ]
        );
        let mounts = s["mounts"].as_array().unwrap();
        assert_eq!(mounts.len(), 4);
        // After the spec's own (over its /run tmpfs), in this order.
        assert_eq!(
            mounts[2],
            json!({
                "destination": "/usr/lib/gpu-ckpt/libgpu-ckpt-nccl.so",
                "type": "bind",
                "source": node.layer().display().to_string(),
                "options": ["bind", "ro", "nosuid", "nodev"],
            })
        );
        assert_eq!(
            mounts[3],
            json!({
                "destination": "/run/gpu-ckpt-nccl",
                "type": "bind",
                "source": dir.display().to_string(),
                "options": ["bind", "ro", "nosuid", "nodev", "noexec"],
            })
        );
        // The edited spec is still an OCI spec, and the mount policy sees both binds.
        let typed: oci_spec::runtime::Spec = serde_json::from_value(s.clone()).unwrap();
        let policy = crate::mount_check::MountPolicy::from_spec(&typed);
        let layer_rule = policy
            .mounts
            .iter()
            .find(|m| m.destination == LAYER_IN_CONTAINER)
            .unwrap();
        assert!(layer_rule.bind && layer_rule.source.as_deref() == Some(node.layer().as_path()));
        assert_eq!(
            layer_rule.set,
            libc::MOUNT_ATTR_RDONLY | libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV
        );
        let dir_rule = policy
            .mounts
            .iter()
            .find(|m| m.destination == SOCKET_DIR_IN_CONTAINER)
            .unwrap();
        assert_eq!(
            dir_rule.set,
            libc::MOUNT_ATTR_RDONLY
                | libc::MOUNT_ATTR_NOSUID
                | libc::MOUNT_ATTR_NODEV
                | libc::MOUNT_ATTR_NOEXEC
        );
        // The directory: made, 0755, empty.
        let m = std::fs::symlink_metadata(&dir).unwrap();
        assert!(m.is_dir());
        assert_eq!(m.permissions().mode() & 0o7777, 0o755);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        // The base and the namespace's directory: root's only.
        for d in [node.base(), node.base().join("k8s.io")] {
            let m = std::fs::symlink_metadata(&d).unwrap();
            assert_eq!(m.permissions().mode() & 0o7777, 0o700, "{}", d.display());
        }
    }

    #[test]
    fn the_layer_goes_first_in_an_existing_preload() {
        let layer = Path::new("/l.so");
        let dir = Path::new("/run/gpu-ckpt/nccl/ns/c");
        let mut s = spec(&["LD_PRELOAD=/opt/tcmalloc.so:/opt/x.so", "A=1"]);
        edit_spec(&mut s, layer, dir, "destroy").unwrap();
        assert_eq!(
            env_of(&s),
            [
                "LD_PRELOAD=/usr/lib/gpu-ckpt/libgpu-ckpt-nccl.so:/opt/tcmalloc.so:/opt/x.so",
                "A=1",
                "GPU_CKPT_NCCL_SOCKET=/run/gpu-ckpt-nccl/control.sock",
                "GPU_CKPT_NCCL_RELEASE=destroy",
            ]
        );
        // An empty one becomes the layer alone; every duplicate gets it (ld.so reads the last).
        let mut s = spec(&["LD_PRELOAD=", "LD_PRELOAD=/opt/a.so"]);
        edit_spec(&mut s, layer, dir, "destroy").unwrap();
        assert_eq!(
            &env_of(&s)[..2],
            [
                "LD_PRELOAD=/usr/lib/gpu-ckpt/libgpu-ckpt-nccl.so",
                "LD_PRELOAD=/usr/lib/gpu-ckpt/libgpu-ckpt-nccl.so:/opt/a.so",
            ]
        );
        // A spec's own GPU_CKPT_NCCL_SOCKET and GPU_CKPT_NCCL_RELEASE are replaced; no env at
        // all gets them.
        let mut s = spec(&[
            "GPU_CKPT_NCCL_SOCKET=/tmp/evil.sock",
            "GPU_CKPT_NCCL_RELEASE=suspend",
        ]);
        edit_spec(&mut s, layer, dir, "destroy").unwrap();
        assert_eq!(
            env_of(&s),
            [
                "LD_PRELOAD=/usr/lib/gpu-ckpt/libgpu-ckpt-nccl.so",
                "GPU_CKPT_NCCL_SOCKET=/run/gpu-ckpt-nccl/control.sock",
                "GPU_CKPT_NCCL_RELEASE=destroy",
            ]
        );
        let mut s = spec(&[]);
        s["process"].as_object_mut().unwrap().remove("env");
        edit_spec(&mut s, layer, dir, "destroy").unwrap();
        assert_eq!(env_of(&s).len(), 3);
    }

    #[test]
    fn an_exec_gets_the_same_environment() {
        let spec = br#"{"args":["torchrun"],"cwd":"/","user":{"uid":0,"gid":0},"env":["PATH=/bin","LD_PRELOAD=/opt/a.so"]}"#;
        let out = exec_process(spec, "suspend").unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            env_of(&json!({ "process": v })),
            [
                "PATH=/bin",
                "LD_PRELOAD=/usr/lib/gpu-ckpt/libgpu-ckpt-nccl.so:/opt/a.so",
                "GPU_CKPT_NCCL_SOCKET=/run/gpu-ckpt-nccl/control.sock",
                "GPU_CKPT_NCCL_RELEASE=suspend",
            ]
        );
        assert_eq!(v["args"], json!(["torchrun"]));
        // Still a process spec; twice is once.
        serde_json::from_slice::<oci_spec::runtime::Process>(&out).unwrap();
        assert_eq!(exec_process(&out, "suspend").unwrap(), out);
        for bad in [&b"[]"[..], b"{\"env\": 1}", b"not json"] {
            let err = exec_process(bad, "suspend").unwrap_err().to_string();
            assert!(err.starts_with("exec process spec: "), "{err}");
        }
    }

    #[test]
    fn editing_twice_is_editing_once_and_mounts_at_our_places_are_replaced() {
        let (layer, dir) = (Path::new("/l.so"), Path::new("/run/gpu-ckpt/nccl/ns/c"));
        let mut s = spec(&["LD_PRELOAD=/opt/a.so"]);
        s["mounts"]
            .as_array_mut()
            .unwrap()
            .push(json!({"destination": "/run/gpu-ckpt-nccl/", "type": "bind", "source": "/tmp", "options": ["rw"]}));
        edit_spec(&mut s, layer, dir, "destroy").unwrap();
        let once = s.clone();
        edit_spec(&mut s, layer, dir, "destroy").unwrap();
        assert_eq!(s, once);
        let at = mount_at(&s, SOCKET_DIR_IN_CONTAINER);
        assert_eq!(at.len(), 1);
        assert_eq!(at[0]["source"], "/run/gpu-ckpt/nccl/ns/c");
        assert_eq!(mount_at(&s, LAYER_IN_CONTAINER).len(), 1);
        // A restore's spec (an earlier container's socket directory) gets this container's.
        edit_spec(
            &mut s,
            layer,
            Path::new("/run/gpu-ckpt/nccl/ns/other"),
            "destroy",
        )
        .unwrap();
        assert_eq!(
            mount_at(&s, SOCKET_DIR_IN_CONTAINER)[0]["source"],
            "/run/gpu-ckpt/nccl/ns/other"
        );
    }

    #[test]
    fn a_malformed_spec_is_an_error_not_a_panic() {
        let (layer, dir) = (Path::new("/l.so"), Path::new("/d"));
        for bad in [
            json!([]),
            json!({"mounts": {}, "process": {}}),
            json!({"mounts": []}),
            json!({"mounts": [], "process": {"env": "A=1"}}),
            json!({"mounts": [], "process": 7}),
        ] {
            let mut s = bad.clone();
            let err = edit_spec(&mut s, layer, dir, "destroy").unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(_)), "{bad}: {err}");
            assert!(err.to_string().contains("NCCL layer"), "{err}");
        }
        // And inject leaves the spec and the node as they were.
        let node = Node::new();
        let mut s = json!({"mounts": []});
        node.inject(&mut s, &node.options("managed"), &Annotations::default())
            .unwrap_err();
        assert_eq!(s, json!({"mounts": []}));
        assert!(!node.base().join("k8s.io").join("c1").exists());
    }

    #[test]
    fn a_container_without_the_annotation_is_untouched_where_the_option_is_off() {
        let node = Node::new();
        let before = spec(&["LD_PRELOAD=/opt/a.so"]);
        for options in [node.options(""), node.options("off")] {
            let mut s = before.clone();
            assert_eq!(
                node.inject(&mut s, &options, &Annotations::default())
                    .unwrap(),
                None
            );
            assert_eq!(s, before);
        }
        assert!(!node.base().exists());
        // Not even the layer is read.
        let missing = RuntimeOptions {
            nccl_layer: "/nonexistent/libgpu-ckpt-nccl.so".into(),
            ..Default::default()
        };
        let mut s = before.clone();
        assert_eq!(
            node.inject(&mut s, &missing, &Annotations::default())
                .unwrap(),
            None
        );
    }

    #[test]
    fn the_annotation_wins_over_the_handlers_default() {
        let node = Node::new();
        let off = annotations(&[(annotations::NCCL, "off")]);
        let managed = annotations(&[(annotations::NCCL, "managed")]);
        let unrelated = annotations(&[(annotations::TCP, "close")]);
        // The handler's default on: a container without the annotation gets the layer...
        assert!(opt_in(&node.options("managed"), &Annotations::default()));
        assert!(opt_in(&node.options("managed"), &unrelated));
        // ...and one whose annotation says off does not.
        assert!(!opt_in(&node.options("managed"), &off));
        let mut s = spec(&[]);
        assert_eq!(
            node.inject(&mut s, &node.options("managed"), &off).unwrap(),
            None
        );
        assert_eq!(s, spec(&[]));
        // The handler's default off: the annotation turns it on.
        assert!(opt_in(&node.options("off"), &managed));
        assert!(opt_in(&node.options(""), &managed));
        assert!(!opt_in(&node.options(""), &unrelated));
        let mut s = spec(&[]);
        assert!(node
            .inject(&mut s, &node.options(""), &managed)
            .unwrap()
            .is_some());
        assert_eq!(mount_at(&s, LAYER_IN_CONTAINER).len(), 1);
    }

    #[test]
    fn a_missing_layer_is_refused_naming_the_path_and_the_option() {
        let node = Node::new();
        let mut options = node.options("managed");
        options.nccl_layer = node.tmp.path().join("absent.so").display().to_string();
        let mut s = spec(&[]);
        let err = node
            .inject(&mut s, &options, &Annotations::default())
            .unwrap_err();
        assert!(matches!(err, Error::FailedPrecondition(_)), "{err}");
        let err = err.to_string();
        assert!(
            err.contains(&format!(
                "the NCCL layer {} (the handler option NcclLayer",
                options.nccl_layer
            )) && err.contains("does not exist")
                && err.contains("gpu-ckpt.io/nccl: managed"),
            "{err}"
        );
        assert_eq!(s, spec(&[]));
        assert!(!node.base().exists());
        // A directory is no layer either.
        options.nccl_layer = node.tmp.path().display().to_string();
        let err = node
            .inject(&mut s, &options, &Annotations::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("is not a regular file"), "{err}");
    }

    #[test]
    fn the_layers_digest_is_its_contents() {
        let node = Node::new();
        let options = node.options("managed");
        let a = layer_blake3(&options).unwrap();
        assert_eq!(a.len(), 64);
        assert!(a
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(layer_blake3(&options).unwrap(), a);
        std::fs::write(node.layer(), b"another build").unwrap();
        assert_ne!(layer_blake3(&options).unwrap(), a);
        // BLAKE3 of the empty input, as the reference implementation gives it.
        std::fs::write(node.layer(), b"").unwrap();
        assert_eq!(
            layer_blake3(&options).unwrap(),
            "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
        );
    }

    #[test]
    fn the_directory_is_made_afresh_and_a_link_is_refused() {
        let node = Node::new();
        let options = node.options("managed");
        let dir = node.base().join("k8s.io").join("c1");
        // An earlier shim's directory, with its socket file: replaced by an empty one.
        let mut s = spec(&[]);
        node.inject(&mut s, &options, &Annotations::default())
            .unwrap();
        std::fs::write(dir.join("control.sock"), b"").unwrap();
        node.inject(&mut spec(&[]), &options, &Annotations::default())
            .unwrap();
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        // A link where the container's directory goes: refused, and what it points at kept.
        std::fs::remove_dir(&dir).unwrap();
        let elsewhere = node.tmp.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::fs::write(elsewhere.join("keep"), b"").unwrap();
        symlink(&elsewhere, &dir).unwrap();
        let err = node
            .inject(&mut spec(&[]), &options, &Annotations::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("a symlink is there") && err.contains(&dir.display().to_string()),
            "{err}"
        );
        assert!(elsewhere.join("keep").exists());
        assert!(std::fs::symlink_metadata(&dir)
            .unwrap()
            .file_type()
            .is_symlink());
        // A link on the way (the namespace's directory): refused.
        std::fs::remove_file(&dir).unwrap();
        std::fs::remove_dir(node.base().join("k8s.io")).unwrap();
        symlink(&elsewhere, node.base().join("k8s.io")).unwrap();
        let err = node
            .inject(&mut spec(&[]), &options, &Annotations::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("is a symlink or not a directory"), "{err}");
        assert!(!elsewhere.join("c1").exists());
        // A directory others can write to on the way: refused.
        std::fs::remove_file(node.base().join("k8s.io")).unwrap();
        std::fs::set_permissions(node.base(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = node
            .inject(&mut spec(&[]), &options, &Annotations::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("others can write to it"), "{err}");
        // Each name one path component.
        let err = inject_in(
            &node.base(),
            &mut spec(&[]),
            &options,
            &Annotations::default(),
            "k8s.io",
            "../x",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("container id"), "{err}");
    }

    #[test]
    fn removal_takes_the_directory_away() {
        let node = Node::new();
        let setup = node
            .inject(
                &mut spec(&[]),
                &node.options("managed"),
                &Annotations::default(),
            )
            .unwrap()
            .unwrap();
        std::fs::write(setup.socket.as_path(), b"").unwrap();
        remove_setup(&setup);
        assert!(!setup.host_dir.exists());
        // Twice is fine; a link is unlinked, never followed.
        remove_setup(&setup);
        let target = node.tmp.path().join("t");
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join("keep"), b"").unwrap();
        symlink(&target, &setup.host_dir).unwrap();
        remove_setup(&setup);
        assert!(target.join("keep").exists());
        assert!(std::fs::symlink_metadata(&setup.host_dir).is_err());
    }

    #[test]
    fn a_restore_follows_the_checkpoint() {
        use image_format::mountinfo::test_images::mounts_image;
        let node = Node::new();
        let dir = tempfile::tempdir().unwrap();
        let managed = annotations(&[(annotations::NCCL, "managed")]);
        let off = annotations(&[(annotations::NCCL, "off")]);
        // No mount images: as at a cold start.
        assert_eq!(checkpoint_had_layer(dir.path()), None);
        assert!(opt_in_at_restore(&node.options(""), &managed, dir.path()));
        assert!(!opt_in_at_restore(&node.options(""), &off, dir.path()));
        // A checkpoint of a container that had the layer: restored with it, whatever is asked.
        std::fs::write(
            dir.path().join("mountpoints-12.img"),
            mounts_image(&[
                ("/", 0),
                ("./usr/lib/gpu-ckpt/libgpu-ckpt-nccl.so", 1),
                ("/run/gpu-ckpt-nccl", 1),
            ]),
        )
        .unwrap();
        assert_eq!(checkpoint_had_layer(dir.path()), Some(true));
        assert!(opt_in_at_restore(&node.options(""), &off, dir.path()));
        assert!(opt_in_at_restore(
            &node.options("managed"),
            &managed,
            dir.path()
        ));
        // One without it: restored without it.
        std::fs::write(
            dir.path().join("mountpoints-12.img"),
            mounts_image(&[("/", 0), ("/proc", 0)]),
        )
        .unwrap();
        assert_eq!(checkpoint_had_layer(dir.path()), Some(false));
        assert!(!opt_in_at_restore(
            &node.options("managed"),
            &managed,
            dir.path()
        ));
        assert!(!opt_in_at_restore(&node.options(""), &off, dir.path()));
    }
}
