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
//!   driver's files) give at its path: the host source opened without following a link at its
//!   last component, its size and build id compared by `image_format::compat`'s rule. A spec
//!   that mounts no driver file at all (the toolkit's legacy hook mounts them at start) is held
//!   to the driver's full version only, by `compat::check`.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use image_format::compat;
use image_format::driver_files::{is_driver_file, read_build_id};
use image_format::manifest::{Devices, DriverFile};
use tracing::{info, info_span};

use crate::bundle::Bundle;
use crate::error::{Error, Result};

/// The driver files the processes `holders` map, each once, by path. Each holder is its host
/// pid and how messages name it.
pub fn capture(holders: &[(i32, String)]) -> Result<Vec<DriverFile>> {
    let _span = info_span!("driver_files").entered();
    let mut files: BTreeMap<String, DriverFile> = BTreeMap::new();
    for (pid, who) in holders {
        let maps = format!("/proc/{pid}/maps");
        let text = std::fs::read_to_string(&maps)
            .map_err(|e| capture_error(format!("{who}: read {maps}: {e}")))?;
        for (range, path) in mapped_files(&text) {
            if !is_driver_file(path) || files.contains_key(path) {
                continue;
            }
            let through = format!("/proc/{pid}/map_files/{range}");
            let file = read_file(path, File::open(&through), &through)
                .map_err(|e| capture_error(format!("{who}: {e}")))?;
            files.insert(path.to_string(), file);
        }
    }
    Ok(files.into_values().collect())
}

/// The `(address range, path)` of each file mapping in a `/proc/<pid>/maps` text; a deleted
/// file's path without its ` (deleted)`.
fn mapped_files(maps: &str) -> impl Iterator<Item = (&str, &str)> {
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
        let path = path.strip_suffix(" (deleted)").unwrap_or(path);
        path.starts_with('/').then_some((fields[0], path))
    })
}

/// `path`'s record from the opened file: its size and build id.
fn read_file(
    path: &str,
    opened: std::io::Result<File>,
    shown: &str,
) -> std::result::Result<DriverFile, String> {
    let mut f = opened.map_err(|e| format!("open {shown} ({path}): {e}"))?;
    let meta = f
        .metadata()
        .map_err(|e| format!("stat {shown} ({path}): {e}"))?;
    if !meta.is_file() {
        return Err(format!("{shown} ({path}) is not a regular file"));
    }
    let build_id = read_build_id(&mut f)
        .map_err(|e| format!("build id of {shown} ({path}): {e}"))?
        .unwrap_or_default();
    Ok(DriverFile {
        path: path.to_string(),
        size: meta.len(),
        build_id,
    })
}

/// The driver files the container of `bundle` gets, for the paths `recorded` names and every
/// driver file its spec mounts: host source, size and build id of each.
fn container_files(bundle: &Bundle, recorded: &[DriverFile]) -> Result<Vec<DriverFile>> {
    let binds = spec_binds(bundle.json());
    let mut wanted: Vec<&str> = recorded.iter().map(|r| r.path.as_str()).collect();
    wanted.extend(
        binds
            .iter()
            .map(|(dest, _)| dest.as_str())
            .filter(|d| is_driver_file(d)),
    );
    wanted.sort_unstable();
    wanted.dedup();
    let mut out = Vec::new();
    for path in wanted {
        let Some(host) = host_source(&binds, path) else {
            continue;
        };
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
            .open(&host);
        let shown = host.display().to_string();
        match read_file(path, opened, &shown) {
            Ok(f) => out.push(f),
            Err(e) => return Err(restore_error(format!("this container's driver file {e}"))),
        }
    }
    Ok(out)
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
/// directory above it (later mounts cover earlier ones).
fn host_source(binds: &[(String, PathBuf)], path: &str) -> Option<PathBuf> {
    binds.iter().rev().find_map(|(dest, source)| {
        if dest == path {
            return Some(source.clone());
        }
        let rel = Path::new(path).strip_prefix(dest).ok()?;
        (!rel.as_os_str().is_empty()
            && rel
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_))))
        .then(|| source.join(rel))
    })
}

/// The recorded driver files the container of `bundle` does not get alike, one message each:
/// `the checkpoint maps …; this container gets …`. Empty when the checkpoint recorded none.
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

/// Before CRIU restores: [`differences`] as an error naming each file.
pub fn check_restore(bundle: &Bundle, recorded: &Devices) -> Result<()> {
    let d = differences(bundle, recorded)?;
    if d.is_empty() {
        return Ok(());
    }
    Err(restore_error(format!(
        "the checkpoint's driver files are not this container's (CRIU restores them by path): {}",
        d.join("; ")
    )))
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
        let at = |p: &str| host_source(&binds, p);
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
        let f = read_file("/c/libcuda.so.580.65.06", open(&real), "real").unwrap();
        assert_eq!(f.size, std::fs::metadata(&real).unwrap().len());
        let err = read_file("/c/libcuda.so.1", open(&link), "link").unwrap_err();
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

    #[test]
    fn the_restore_holds_the_recorded_files_to_the_specs_mounts() {
        let dir = tempfile::tempdir().unwrap();
        let host = dir.path().join("libcuda.so.580.65.06");
        std::fs::copy(std::env::current_exe().unwrap(), &host).unwrap();
        let dest = "/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06";
        let f = read_file(dest, File::open(&host), "host").unwrap();
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
        let err = check_restore(&b, &recorded).unwrap_err().to_string();
        assert!(
            err.contains(&format!("the checkpoint maps {dest} (driver 580.65.06); this container gets driver 580.65.07 (libcuda.so.580.65.07)"))
                && err.contains("restore failed at step compat"),
            "{err}"
        );
        // A spec that mounts no driver file: the driver version decides (elsewhere).
        let legacy = bundle(dir.path(), &[("/data", dir.path())]);
        assert!(differences(&legacy, &recorded).unwrap().is_empty());
    }
}
