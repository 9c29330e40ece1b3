//! The driver's user-space files (`libcuda.so.<version>`, `libnvidia-*.so.<version>`, ...) a
//! container's GPU processes map: recorded at the checkpoint, held at a restore to the files the
//! new container's spec gives it, before CRIU starts (CRIU restores a file mapping by its path
//! and checks the file it finds there; a restore across driver releases would otherwise die in
//! CRIU).
//!
//! - [`capture`]: for each process holding device state, its mappings (`/proc/<pid>/maps`)
//!   whose file names are the driver's; each file opened through the process's own mapping
//!   (`/proc/<pid>/map_files/<range>`), never by path in the container's root, then its size
//!   and GNU build id.
//! - [`differences`]: each recorded file against what the spec's mounts (where CDI puts the
//!   driver's files) give at its path: the bind source (the host path the spec names) opened
//!   without following a link at it, the path below it resolved without following any symlink
//!   or leaving its mount (`openat2`), and only a regular file reopened for reading; its size and
//!   build id compared by `image_format::compat`'s rule. A spec that mounts no driver file at
//!   all (the toolkit's legacy hook mounts them at start) is held to the driver's full version
//!   only, by `compat::check`.
//!
//! Limits: at most [`MAX_DRIVER_FILES`] files recorded and read (more is refused, a manifest's
//! entries checked against the driver's file names first), each file read once per inode and
//! at most `image_format::driver_files::MAX_READ_BYTES` of it, and a restore's check run off
//! the runtime's thread within [`CHECK_BOUND`].

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use image_format::compat;
use image_format::driver_files::{is_driver_file, read_build_id};
use image_format::manifest::{Devices, DriverFile};
use nix::errno::Errno;
use nix::fcntl::{openat2, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{Mode, SFlag};
use tracing::{info, info_span};

use crate::bundle::Bundle;
use crate::error::{Error, Result};

/// Most driver files one checkpoint records, and one restore reads. A driver has a few dozen
/// libraries and a CUDA process maps a handful of them; a checkpoint whose processes map more
/// is refused (recording only some would let a restore pass unchecked), and so is a manifest
/// that records more, or a spec that mounts more, before any file is opened.
pub const MAX_DRIVER_FILES: usize = 64;

/// Longest a restore waits on the driver files' check. It opens and reads host files (the
/// bind sources of the new spec); one on a hung network filesystem or a stuck FUSE volume would
/// otherwise hold the restore, and the shim with it, for ever. Past the bound the restore fails
/// and the thread reading is left to finish or hang on its own.
pub const CHECK_BOUND: Duration = Duration::from_secs(30);

/// Size and build id of the files already read, by (device, inode): a file mapped or mounted
/// under several names is read once.
#[derive(Default)]
struct Seen(HashMap<(u64, u64), (u64, String)>);

/// The driver files the processes `holders` map, each path once. Each holder is its host pid
/// and how messages name it. More than [`MAX_DRIVER_FILES`] is an error.
pub fn capture(holders: &[(i32, String)]) -> Result<Vec<DriverFile>> {
    let _span = info_span!("driver_files").entered();
    let mut files: BTreeMap<String, DriverFile> = BTreeMap::new();
    let mut seen = Seen::default();
    for (pid, who) in holders {
        let maps = format!("/proc/{pid}/maps");
        let text = std::fs::read_to_string(&maps)
            .map_err(|e| capture_error(format!("{who}: read {maps}: {e}")))?;
        for (range, path) in mapped_files(&text) {
            if !is_driver_file(path) || files.contains_key(path) {
                continue;
            }
            if files.len() == MAX_DRIVER_FILES {
                return Err(capture_error(format!(
                    "{who} maps {path}, one driver file more than the {MAX_DRIVER_FILES} a checkpoint records (a driver has a few dozen): refused"
                )));
            }
            let through = format!("/proc/{pid}/map_files/{range}");
            // The mapped file itself, not opened for reading until it is known to be a
            // regular file (a device node at a driver file's name is never opened).
            let opened = nix::fcntl::open(
                through.as_str(),
                OFlag::O_PATH | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .map_err(std::io::Error::from)
            .and_then(reopen);
            let file = read_file(path, opened, &through, &mut seen)
                .map_err(|e| capture_error(format!("{who}: {e}")))?;
            files.insert(path.to_string(), file);
        }
    }
    Ok(files.into_values().collect())
}

/// The `(address range, path)` of each file mapping in a `/proc/<pid>/maps` text; a deleted
/// file's path without its ` (deleted)`.
fn mapped_files(maps: &str) -> impl Iterator<Item = (&str, &str)> {
    file_mappings(maps)
        .map(|(range, path)| (range, path.strip_suffix(" (deleted)").unwrap_or(path)))
}

/// The `(address range, path)` of each file mapping in a `/proc/<pid>/maps` text, the path as
/// the kernel prints it (spaces kept, ` (deleted)` after a deleted file's).
pub(crate) fn file_mappings(maps: &str) -> impl Iterator<Item = (&str, &str)> {
    maps.lines().filter_map(|line| {
        let mut rest = line;
        let mut fields = Vec::with_capacity(5);
        for _ in 0..5 {
            let t = rest.trim_start();
            let end = t.find(char::is_whitespace)?;
            fields.push(&t[..end]);
            rest = &t[end..];
        }
        let path = rest.trim_start();
        path.starts_with('/').then_some((fields[0], path))
    })
}

/// The regular file an `O_PATH` handle `fd` holds, opened for reading through the handle's own
/// `/proc/self/fd` link (the same inode, whatever its name points at by now); anything else
/// (a device node, a FIFO, a directory) is refused without being opened. `O_NONBLOCK` and
/// `O_NOCTTY`: no open waits or takes a terminal.
fn reopen(fd: OwnedFd) -> std::io::Result<File> {
    let st = nix::sys::stat::fstat(&fd)?;
    if crate::rootfs_changes::kind(&st) != SFlag::S_IFREG {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    let link = format!("/proc/self/fd/{}", fd.as_fd().as_raw_fd());
    nix::fcntl::open(
        link.as_str(),
        OFlag::O_RDONLY | OFlag::O_NOCTTY | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map(File::from)
    .map_err(std::io::Error::from)
}

/// `path`'s record from the opened file: its size and build id (read once per inode).
fn read_file(
    path: &str,
    opened: std::io::Result<File>,
    shown: &str,
    seen: &mut Seen,
) -> std::result::Result<DriverFile, String> {
    let mut f = opened.map_err(|e| format!("open {shown} ({path}): {e}"))?;
    let meta = f
        .metadata()
        .map_err(|e| format!("stat {shown} ({path}): {e}"))?;
    if !meta.is_file() {
        return Err(format!("{shown} ({path}) is not a regular file"));
    }
    let (size, build_id) = match seen.0.get(&(meta.dev(), meta.ino())) {
        Some(known) => known.clone(),
        None => {
            let id = read_build_id(&mut f)
                .map_err(|e| format!("build id of {shown} ({path}): {e}"))?
                .unwrap_or_default();
            let known = (meta.len(), id);
            seen.0.insert((meta.dev(), meta.ino()), known.clone());
            known
        }
    };
    Ok(DriverFile {
        path: path.to_string(),
        size,
        build_id,
    })
}

/// The driver files the container of `bundle` gets, for the paths `recorded` names and every
/// driver file its spec mounts: host source, size and build id of each. Each recorded path must
/// be a driver file's name, and neither list may hold more than [`MAX_DRIVER_FILES`]: both are
/// checked before any file is opened.
fn container_files(bundle: &Bundle, recorded: &[DriverFile]) -> Result<Vec<DriverFile>> {
    if let Some(r) = recorded.iter().find(|r| !is_driver_file(&r.path)) {
        return Err(restore_error(format!(
            "the manifest records {:?} among the driver files, which is not a driver library's name: refused",
            r.path
        )));
    }
    if recorded.len() > MAX_DRIVER_FILES {
        return Err(restore_error(format!(
            "the manifest records {} driver files, more than the {MAX_DRIVER_FILES} a checkpoint may: refused",
            recorded.len()
        )));
    }
    let binds = spec_binds(bundle.json());
    let mounted: Vec<&str> = binds
        .iter()
        .map(|(dest, _)| dest.as_str())
        .filter(|d| is_driver_file(d))
        .collect();
    if mounted.len() > MAX_DRIVER_FILES {
        return Err(restore_error(format!(
            "this container's spec mounts {} driver files, more than the {MAX_DRIVER_FILES} a restore reads: refused",
            mounted.len()
        )));
    }
    let mut wanted: Vec<&str> = recorded.iter().map(|r| r.path.as_str()).collect();
    wanted.extend(mounted);
    wanted.sort_unstable();
    wanted.dedup();
    let mut seen = Seen::default();
    let mut out = Vec::new();
    for path in wanted {
        let Some((source, rel)) = bind_of(&binds, path) else {
            continue;
        };
        let shown = if rel.as_os_str().is_empty() {
            source.display().to_string()
        } else {
            source.join(&rel).display().to_string()
        };
        let opened = open_beneath(source, &rel);
        match read_file(path, opened, &shown, &mut seen) {
            Ok(f) => out.push(f),
            Err(e) => return Err(restore_error(format!("this container's driver file {e}"))),
        }
    }
    Ok(out)
}

/// The regular file at `rel` below the bind source `source`, opened for reading: the source
/// (the host path the spec names) without following a link at it, `rel` beneath it without
/// following any symlink or crossing a mount (a tenant's volume decides what lies there), and
/// the file reopened through its handle only once it is known to be a regular file.
fn open_beneath(source: &Path, rel: &Path) -> std::io::Result<File> {
    let src = nix::fcntl::open(
        source,
        OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    if rel.as_os_str().is_empty() {
        return reopen(src);
    }
    if crate::rootfs_changes::kind(&nix::sys::stat::fstat(&src)?) == SFlag::S_IFLNK {
        return Err(std::io::Error::other(format!(
            "the bind source {} is a symlink (not followed)",
            source.display()
        )));
    }
    let fd = openat2(
        src.as_fd(),
        rel,
        OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
            .resolve(
                ResolveFlag::RESOLVE_BENEATH
                    | ResolveFlag::RESOLVE_NO_SYMLINKS
                    | ResolveFlag::RESOLVE_NO_XDEV,
            ),
    )
    .map_err(|e| match e {
        Errno::ELOOP => std::io::Error::other(format!(
            "a symlink on the way below the bind source {} (not followed)",
            source.display()
        )),
        Errno::EXDEV => std::io::Error::other(format!(
            "leads out of the bind source {} (another mount, or outside it)",
            source.display()
        )),
        e => e.into(),
    })?;
    reopen(fd)
}

/// The spec's bind mounts: (destination, source).
fn spec_binds(spec: &serde_json::Value) -> Vec<(String, PathBuf)> {
    let Some(mounts) = spec.get("mounts").and_then(|m| m.as_array()) else {
        return Vec::new();
    };
    mounts
        .iter()
        .filter(|m| {
            let options = m.get("options").and_then(|o| o.as_array());
            m.get("type").and_then(|t| t.as_str()) == Some("bind")
                || options.is_some_and(|o| {
                    o.iter()
                        .any(|v| matches!(v.as_str(), Some("bind" | "rbind")))
                })
        })
        .filter_map(|m| {
            let dest = m.get("destination")?.as_str()?;
            let source = m.get("source")?.as_str()?;
            Some((dest.to_string(), PathBuf::from(source)))
        })
        .collect()
}

/// Where on the host the container's `path` comes from: the last bind mount at `path` or at a
/// directory above it (later mounts cover earlier ones), as its source and the path below it
/// (empty for a mount at `path` itself).
fn bind_of<'a>(binds: &'a [(String, PathBuf)], path: &str) -> Option<(&'a Path, PathBuf)> {
    binds.iter().rev().find_map(|(dest, source)| {
        if dest == path {
            return Some((source.as_path(), PathBuf::new()));
        }
        let rel = Path::new(path).strip_prefix(dest).ok()?;
        (!rel.as_os_str().is_empty()
            && rel
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_))))
        .then(|| (source.as_path(), rel.to_path_buf()))
    })
}

/// The recorded driver files the container of `bundle` does not get alike, one message each:
/// `the checkpoint maps …; this container gets …`. Empty when the checkpoint recorded none.
/// Opens host files: run it where a hung one cannot hold anything else ([`check_restore`],
/// [`differences_within`]).
pub fn differences(bundle: &Bundle, recorded: &Devices) -> Result<Vec<String>> {
    if recorded.driver_files.is_empty() {
        return Ok(Vec::new());
    }
    let _span = info_span!("driver_files_check").entered();
    let files = container_files(bundle, &recorded.driver_files)?;
    if files.is_empty() {
        // The spec mounts no driver file: a runtime hook injects them at start (the toolkit's
        // legacy mode), so the spec cannot say which; the inventory's exact driver version
        // (`compat::check`, run before) is all there is to hold the checkpoint to.
        info!("the spec mounts no driver file: held to the driver version only");
        return Ok(Vec::new());
    }
    Ok(compat::driver_file_differences(recorded, "", Some(&files))
        .into_iter()
        .map(|d| {
            format!(
                "the checkpoint maps {}; this container gets {}",
                d.checkpoint, d.node
            )
        })
        .collect())
}

/// [`differences`] from a blocking context (the restore handler's admission), on a thread of
/// its own waited on for at most `bound`: past it an error, the thread left behind.
pub fn differences_within(
    bundle: &Bundle,
    recorded: &Devices,
    bound: Duration,
) -> Result<Vec<String>> {
    if recorded.driver_files.is_empty() {
        return Ok(Vec::new());
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let (b, r) = (bundle.clone(), recorded.clone());
    std::thread::Builder::new()
        .name("driver-files".into())
        .spawn(move || {
            let _ = tx.send(differences(&b, &r));
        })
        .map_err(|e| restore_error(format!("start the driver files' check: {e}")))?;
    rx.recv_timeout(bound).map_err(|_| past_bound(bound))?
}

/// Before CRIU restores: [`differences`] as an error naming each file, on a thread of its own
/// waited on for at most [`CHECK_BOUND`] (the runtime's thread never reads a host file).
pub async fn check_restore(bundle: &Bundle, recorded: &Devices) -> Result<()> {
    if recorded.driver_files.is_empty() {
        return Ok(());
    }
    let (b, r) = (bundle.clone(), recorded.clone());
    let d = bounded(CHECK_BOUND, move || differences(&b, &r)).await?;
    if d.is_empty() {
        return Ok(());
    }
    Err(restore_error(format!(
        "the checkpoint's driver files are not this container's (CRIU restores them by path): {}",
        d.join("; ")
    )))
}

/// `f` on a thread of its own, waited on for at most `bound` without holding the runtime's
/// thread; past it an error naming the step, and `f` is abandoned (its thread finishes, or
/// hangs, on its own). A detached thread rather than tokio's blocking pool: the runtime waits
/// for its blocking tasks when it shuts down, so a read stuck for good would hold the shim's
/// exit too.
async fn bounded<T: Send + 'static>(
    bound: Duration,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("driver-files".into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| restore_error(format!("start the driver files' check: {e}")))?;
    match tokio::time::timeout(bound, rx).await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => Err(restore_error(
            "the driver files' check ended without an answer".into(),
        )),
        Err(_) => Err(past_bound(bound)),
    }
}

fn past_bound(bound: Duration) -> Error {
    Error::Step {
        operation: "restore",
        step: "driver-files",
        message: format!(
            "the host files this container's spec mounts at the checkpoint's driver files were not read within {bound:?} (a hung filesystem at a bind source?): refused, the read left behind"
        ),
    }
}

fn capture_error(message: String) -> Error {
    Error::Step {
        operation: "checkpoint",
        step: "driver-files",
        message,
    }
}

fn restore_error(message: String) -> Error {
    Error::Step {
        operation: "restore",
        step: "compat",
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::OpenOptionsExt;

    #[test]
    fn mapped_files_of_a_maps_text() {
        let maps = "\
7f0000000000-7f0000100000 r--p 00000000 08:01 1234   /usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06
7f0000100000-7f0000200000 r-xp 00100000 08:01 1234   /usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06
7f0000300000-7f0000301000 rw-p 00000000 00:00 0 
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0      [stack]
7f0000400000-7f0000401000 r--p 00000000 08:01 99     /opt/a dir/libnvidia-ml.so.580.65.06 (deleted)
";
        let got: Vec<(&str, &str)> = mapped_files(maps).collect();
        assert_eq!(
            got,
            [
                (
                    "7f0000000000-7f0000100000",
                    "/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06"
                ),
                (
                    "7f0000100000-7f0000200000",
                    "/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06"
                ),
                (
                    "7f0000400000-7f0000401000",
                    "/opt/a dir/libnvidia-ml.so.580.65.06"
                ),
            ]
        );
    }

    #[test]
    fn the_host_source_of_a_container_path() {
        let spec = serde_json::json!({"mounts": [
            {"destination": "/usr/lib/x86_64-linux-gnu", "type": "bind", "source": "/host/libs", "options": ["rbind"]},
            {"destination": "/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06", "source": "/host/libcuda.so.580.65.06", "options": ["ro", "bind"]},
            {"destination": "/proc", "type": "proc", "source": "proc"},
        ]});
        let binds = spec_binds(&spec);
        assert_eq!(binds.len(), 2);
        let at = |p: &str| {
            bind_of(&binds, p).map(|(s, r)| {
                if r.as_os_str().is_empty() {
                    s.to_path_buf()
                } else {
                    s.join(r)
                }
            })
        };
        assert_eq!(
            at("/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06"),
            Some(PathBuf::from("/host/libcuda.so.580.65.06"))
        );
        assert_eq!(
            at("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.65.06"),
            Some(PathBuf::from("/host/libs/libnvidia-ml.so.580.65.06"))
        );
        assert_eq!(at("/usr/lib/x86_64-linux-gnu/../../etc/x"), None);
        assert_eq!(at("/opt/libcuda.so.580.65.06"), None);
    }

    #[test]
    fn a_link_at_the_host_source_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("libcuda.so.580.65.06");
        std::fs::copy(std::env::current_exe().unwrap(), &real).unwrap();
        let link = dir.path().join("libcuda.so.1");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let open = |p: &Path| {
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(p)
        };
        let f = read_file(
            "/c/libcuda.so.580.65.06",
            open(&real),
            "real",
            &mut Seen::default(),
        )
        .unwrap();
        assert_eq!(f.size, std::fs::metadata(&real).unwrap().len());
        let err =
            read_file("/c/libcuda.so.1", open(&link), "link", &mut Seen::default()).unwrap_err();
        assert!(err.contains("open link"), "{err}");
    }

    /// A bundle whose spec bind-mounts `mounts` (destination, host source).
    fn bundle(dir: &Path, mounts: &[(&str, &Path)]) -> Bundle {
        let mounts: Vec<serde_json::Value> = mounts
            .iter()
            .map(|(d, s)| serde_json::json!({"destination": d, "source": s, "type": "bind", "options": ["ro", "bind"]}))
            .collect();
        let spec = serde_json::json!({"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "mounts": mounts});
        std::fs::write(dir.join("config.json"), spec.to_string()).unwrap();
        Bundle::load(dir).unwrap()
    }

    #[tokio::test]
    async fn the_restore_holds_the_recorded_files_to_the_specs_mounts() {
        let dir = tempfile::tempdir().unwrap();
        let host = dir.path().join("libcuda.so.580.65.06");
        std::fs::copy(std::env::current_exe().unwrap(), &host).unwrap();
        let dest = "/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06";
        let f = read_file(dest, File::open(&host), "host", &mut Seen::default()).unwrap();
        let recorded = Devices {
            driver_version: "580.65.06".into(),
            driver_files: vec![f.clone()],
            ..Devices::default()
        };
        let same = bundle(dir.path(), &[(dest, &host)]);
        assert_eq!(differences(&same, &recorded).unwrap(), Vec::<String>::new());
        // Another file at the same path: size and build id named.
        let other = Devices {
            driver_files: vec![DriverFile {
                size: f.size + 1,
                build_id: "00".into(),
                ..f.clone()
            }],
            ..recorded.clone()
        };
        let d = differences(&same, &other).unwrap();
        assert_eq!(d.len(), 1);
        assert!(
            d[0].starts_with(&format!(
                "the checkpoint maps {dest} ({} bytes, build id 00)",
                f.size + 1
            )),
            "{d:?}"
        );
        // Another release: the file and both versions named, as the error says it.
        let newer = dir.path().join("libcuda.so.580.65.07");
        std::fs::copy(&host, &newer).unwrap();
        let b = bundle(
            dir.path(),
            &[("/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.07", &newer)],
        );
        let err = check_restore(&b, &recorded).await.unwrap_err().to_string();
        assert!(
            err.contains(&format!("the checkpoint maps {dest} (driver 580.65.06); this container gets driver 580.65.07 (libcuda.so.580.65.07)"))
                && err.contains("restore failed at step compat"),
            "{err}"
        );
        // A spec that mounts no driver file: the driver version decides (elsewhere).
        let legacy = bundle(dir.path(), &[("/data", dir.path())]);
        assert!(differences(&legacy, &recorded).unwrap().is_empty());
    }

    /// A 64-byte ELF64 header without program headers: an ELF file without a build id.
    fn tiny_elf() -> Vec<u8> {
        let mut f = vec![0u8; 64];
        f[..4].copy_from_slice(b"\x7fELF");
        f[4] = 2;
        f[5] = 1;
        f[54..56].copy_from_slice(&56u16.to_le_bytes());
        f
    }

    #[test]
    fn a_checkpoint_records_at_most_the_cap_and_reads_an_inode_once() {
        let dir = tempfile::tempdir().unwrap();
        let one = dir.path().join("elf");
        std::fs::write(&one, tiny_elf()).unwrap();
        // Hard links to one file, each mapped by this process under its own driver name.
        let mut maps = Vec::new();
        let mut map = |n: usize| {
            let link = dir.path().join(format!("libnvidia-{n}.so.1"));
            std::fs::hard_link(&one, &link).unwrap();
            let f = File::open(&link).unwrap();
            // SAFETY: a private read-only mapping of a file this test made, unmapped below.
            let at = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    64,
                    libc::PROT_READ,
                    libc::MAP_PRIVATE,
                    f.as_raw_fd(),
                    0,
                )
            };
            assert_ne!(at, libc::MAP_FAILED);
            maps.push(at);
        };
        for n in 0..10 {
            map(n);
        }
        let me = [(std::process::id() as i32, "this test".to_string())];
        let files = capture(&me).unwrap();
        let ours: Vec<&DriverFile> = files
            .iter()
            .filter(|f| f.path.starts_with(dir.path().to_str().unwrap()))
            .collect();
        assert_eq!(ours.len(), 10, "{files:?}");
        assert!(ours.iter().all(|f| f.size == 64 && f.build_id.is_empty()));
        for n in 10..=MAX_DRIVER_FILES {
            map(n);
        }
        let err = capture(&me).unwrap_err().to_string();
        assert!(
            err.contains("checkpoint failed at step driver-files")
                && err.contains("one driver file more than the 64 a checkpoint records"),
            "{err}"
        );
        for at in maps {
            // SAFETY: mapped above, 64 bytes.
            unsafe { libc::munmap(at, 64) };
        }
        // A file already read (same device and inode) is not read again: the record comes from
        // the first read, even where the file would no longer parse.
        std::fs::write(&one, b"no longer an ELF file").unwrap();
        let meta = std::fs::metadata(&one).unwrap();
        let mut seen = Seen::default();
        seen.0
            .insert((meta.dev(), meta.ino()), (64, "c04d".to_string()));
        let f = read_file("/c/libnvidia-1.so.1", File::open(&one), "one", &mut seen).unwrap();
        assert_eq!((f.size, f.build_id.as_str()), (64, "c04d"));
        let err = read_file(
            "/c/libnvidia-1.so.1",
            File::open(&one),
            "one",
            &mut Seen::default(),
        )
        .unwrap_err();
        assert!(err.contains("not an ELF file"), "{err}");
    }

    fn recorded(paths: &[&str]) -> Devices {
        Devices {
            driver_version: "580.65.06".into(),
            driver_files: paths
                .iter()
                .map(|p| DriverFile {
                    path: p.to_string(),
                    size: 1,
                    build_id: "00".into(),
                })
                .collect(),
            ..Devices::default()
        }
    }

    #[test]
    fn a_manifest_names_only_driver_files_and_at_most_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        // The bind sources do not exist: each refusal comes before anything is opened.
        let missing = dir.path().join("missing");
        let b = bundle(dir.path(), &[("/etc", &missing)]);
        let err = differences(&b, &recorded(&["/etc/shadow"]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("the manifest records \"/etc/shadow\" among the driver files, which is not a driver library's name"),
            "{err}"
        );
        let many: Vec<String> = (0..=MAX_DRIVER_FILES)
            .map(|n| format!("/usr/lib/libnvidia-{n}.so.580.65.06"))
            .collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let b = bundle(dir.path(), &[("/usr/lib", &missing)]);
        let err = differences(&b, &recorded(&many)).unwrap_err().to_string();
        assert!(
            err.contains("the manifest records 65 driver files, more than the 64 a checkpoint may"),
            "{err}"
        );
        let mounts: Vec<(&str, &Path)> = many.iter().map(|p| (*p, missing.as_path())).collect();
        let b = bundle(dir.path(), &mounts);
        let err = differences(&b, &recorded(&many[..1]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "this container's spec mounts 65 driver files, more than the 64 a restore reads"
            ),
            "{err}"
        );
    }

    #[test]
    fn a_restore_opens_only_regular_files_beneath_the_bind_source() {
        let dir = tempfile::tempdir().unwrap();
        let lib = "/usr/lib/x86_64-linux-gnu";
        let path = format!("{lib}/libcuda.so.580.65.06");
        let want = recorded(&[&path]);
        let err_of = |mounts: &[(&str, &Path)]| {
            let b = bundle(dir.path(), mounts);
            differences(&b, &want).unwrap_err().to_string()
        };
        // A tenant's volume with a symlink on the way: not followed.
        let volume = dir.path().join("volume");
        std::fs::create_dir_all(volume.join("real")).unwrap();
        std::fs::write(volume.join("real/libcuda.so.580.65.06"), tiny_elf()).unwrap();
        std::os::unix::fs::symlink("real", volume.join("x86_64-linux-gnu")).unwrap();
        let err = err_of(&[("/usr/lib", volume.as_path())]);
        assert!(
            err.contains("a symlink on the way below the bind source"),
            "{err}"
        );
        // A symlink at the file itself: not followed either.
        std::fs::remove_file(volume.join("x86_64-linux-gnu")).unwrap();
        std::fs::create_dir(volume.join("x86_64-linux-gnu")).unwrap();
        let file = volume.join("x86_64-linux-gnu/libcuda.so.580.65.06");
        std::os::unix::fs::symlink("../real/libcuda.so.580.65.06", &file).unwrap();
        let err = err_of(&[("/usr/lib", volume.as_path())]);
        assert!(err.contains("not a regular file"), "{err}");
        // A bind source that is itself a link: not followed, for a directory or a file.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(volume.join("x86_64-linux-gnu"), &link).unwrap();
        let err = err_of(&[(lib, &link)]);
        assert!(
            err.contains(&format!("the bind source {} is a symlink", link.display())),
            "{err}"
        );
        // A mount crossed below the source.
        let crossing = format!("{lib}/proc/libcuda.so.580.65.06");
        let b = bundle(dir.path(), &[(lib, Path::new("/"))]);
        let err2 = differences(&b, &recorded(&[&crossing]))
            .unwrap_err()
            .to_string();
        assert!(err2.contains("leads out of the bind source /"), "{err2}");
        // A device node (or anything not a regular file) is never opened.
        let err = err_of(&[(&path, Path::new("/dev/null"))]);
        assert!(
            err.contains("/dev/null") && err.contains("not a regular file"),
            "{err}"
        );
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, Mode::from_bits_truncate(0o600)).unwrap();
        let err = err_of(&[(&path, &fifo)]);
        assert!(err.contains("not a regular file"), "{err}");
        let err = err_of(&[(&path, &link)]);
        assert!(err.contains("not a regular file"), "{err}");
        // The regular file beneath the source is read.
        std::fs::remove_file(&file).unwrap();
        std::fs::write(&file, tiny_elf()).unwrap();
        let b = bundle(dir.path(), &[("/usr/lib", volume.as_path())]);
        let d = differences(&b, &want).unwrap();
        assert_eq!(d.len(), 1, "{d:?}");
        assert!(
            d[0].contains(&format!("this container gets {path} (64 bytes")),
            "{d:?}"
        );
        assert_eq!(
            differences_within(&b, &want, CHECK_BOUND).unwrap(),
            d,
            "the bounded check gives the same answer"
        );
    }

    #[tokio::test]
    async fn a_hung_check_fails_at_its_bound_and_the_runtime_runs_on() {
        use std::sync::atomic::{AtomicU32, Ordering};
        use std::sync::Arc;
        let ticks = Arc::new(AtomicU32::new(0));
        let ticker = tokio::spawn({
            let ticks = ticks.clone();
            async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    ticks.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        let t = std::time::Instant::now();
        // A read that hangs (a host file on a hung NFS server), on this current-thread runtime.
        let err = bounded(Duration::from_millis(300), || {
            std::thread::sleep(Duration::from_secs(5));
            Ok(())
        })
        .await
        .unwrap_err()
        .to_string();
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        // (The test ends before the hung read does: nothing waits for it.)
        assert!(
            err.contains("restore failed at step driver-files")
                && err.contains("were not read within 300ms"),
            "{err}"
        );
        // The runtime's one thread kept serving other tasks while the read hung.
        assert!(ticks.load(Ordering::Relaxed) >= 10, "{ticks:?}");
        ticker.abort();
        // The blocking form bounds its wait the same way.
        let dir = tempfile::tempdir().unwrap();
        let b = bundle(dir.path(), &[]);
        let want = recorded(&["/usr/lib/libcuda.so.580.65.06"]);
        assert!(differences_within(&b, &want, Duration::from_secs(5))
            .unwrap()
            .is_empty());
    }
}
