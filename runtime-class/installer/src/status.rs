//! Whether the node is as the installer left it, for the DaemonSet's readiness probe
//! (`gpu-ckpt-node-installer status`) and its watch (`repair`, every
//! `nodeInstaller.checkIntervalSeconds`): the ready marker, written by a pod's install once the
//! node is installed and labelled, and the node compared with the payload and the record (every
//! file, containerd's imports).

use std::path::{Path, PathBuf};

use crate::config;
use crate::error::{Error, Result};
use crate::install::{self, read_opt, Options};
use crate::record::{write_atomic, FileEntry, Phase, Record};
use crate::site;

/// The ready marker's default path, in the installer container's own filesystem: a new
/// container (a new pod, a restarted one) starts without it.
pub const READY_FILE: &str = "/run/gpu-ckpt-node-installer/ready";

/// Writes the marker `ready` (`summary`: what the install did), creating its directory.
pub fn mark_ready(ready: &Path, summary: &str) -> Result<()> {
    if let Some(dir) = ready.parent() {
        std::fs::create_dir_all(dir).map_err(Error::io("create directory", dir))?;
    }
    write_atomic(ready, format!("{summary}\n").as_bytes(), 0o644)
}

/// Removes the marker `ready` (there or not).
pub fn clear_ready(ready: &Path) -> Result<()> {
    match std::fs::remove_file(ready) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("remove the ready marker", ready)(e)),
    }
}

/// What differs between the node and what `install` would leave there, each in words: empty
/// when everything is in place. Reads only; a drift is repaired by `install`.
pub fn drift(o: &Options) -> Result<Vec<String>> {
    let _span = tracing::info_span!("check", root = %o.fs.root.display()).entered();
    let at = install::record_path(&o.fs)?;
    let Some(rec) = Record::load(&at)? else {
        return Ok(vec![format!(
            "nothing is installed: there is no install record {}",
            at.display()
        )]);
    };
    let mut found = Vec::new();
    if rec.phase != Phase::Installed {
        found.push(format!("the install record is in phase {:?}", rec.phase));
    }
    if rec.restart_pending {
        found.push("containerd has not been restarted since its configuration changed".into());
    }
    let planned = o.planned_entries()?;
    found.extend(unknown_trusted_keys(o, &planned)?);
    for (path, want) in planned {
        if rec.file(&path) != Some(&want) {
            found.push(format!(
                "{} is not the payload's: the payload changed since the install",
                path.display()
            ));
        } else if !install::matches(&o.fs.resolve_parent(&path)?, &want)? {
            found.push(format!(
                "{} is missing or changed since the install",
                path.display()
            ));
        }
    }
    let cfg = o.fs.resolve(&o.containerd_config)?;
    match read_opt(&cfg)? {
        None => found.push(format!(
            "containerd's configuration {} is gone",
            o.containerd_config.display()
        )),
        Some((text, _)) => {
            for entry in o.import_entries() {
                if !config::imports(&o.containerd_config, &text, &entry)? {
                    found.push(format!(
                        "containerd's configuration {} does not import {entry}",
                        o.containerd_config.display()
                    ));
                }
            }
        }
    }
    Ok(found)
}

/// Each `*.pub` in the installer's trusted-keys directory that the values do not give: the
/// shim trusts every key there, so one put there by hand is trust nobody set through the chart.
fn unknown_trusted_keys(o: &Options, planned: &[(PathBuf, FileEntry)]) -> Result<Vec<String>> {
    let dir = site::trusted_dir(&o.site.site_dir());
    let at = o.fs.resolve(&dir)?;
    let entries = match std::fs::read_dir(&at) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("read directory", &at)(e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let name = entry.map_err(Error::io("read directory", &at))?.file_name();
        let path = dir.join(&name);
        if site::is_trusted_key_file(&o.site.site_dir(), &path)
            && !planned.iter().any(|(p, _)| *p == path)
        {
            found.push(format!(
                "{} is a trusted key the values do not give (trust.trustedKeys): the restore handler trusts it",
                path.display()
            ));
        }
    }
    found.sort();
    Ok(found)
}

/// The readiness probe: the marker `ready` is there (this container's install finished,
/// labels included) and the node has not drifted. Each problem, in words; empty: ready.
pub fn status(o: &Options, ready: &Path) -> Result<Vec<String>> {
    let mut problems = Vec::new();
    if !ready.is_file() {
        problems.push(format!(
            "no ready marker {}: this container's install has not finished",
            ready.display()
        ));
    }
    problems.extend(drift(o)?);
    Ok(problems)
}

/// The readiness probe of the uninstall action (`status --uninstalled`): the marker `ready` is
/// there (this container's uninstall finished) and nothing of gpu-ckpt is left on the node: no
/// install record, none of the files as the installer writes them, no imports entry of a
/// drop-in in containerd's configuration. Each problem, in words; empty: ready.
pub fn uninstalled(o: &Options, ready: &Path) -> Result<Vec<String>> {
    let _span = tracing::info_span!("check_uninstalled", root = %o.fs.root.display()).entered();
    let mut problems = Vec::new();
    if !ready.is_file() {
        problems.push(format!(
            "no ready marker {}: this container's uninstall has not finished",
            ready.display()
        ));
    }
    let at = install::record_path(&o.fs)?;
    if at.exists() {
        problems.push(format!(
            "the install record {} is still there",
            at.display()
        ));
    }
    for (path, want) in o.planned_entries()? {
        if install::matches(&o.fs.resolve_parent(&path)?, &want)? {
            problems.push(format!("{} is still installed", path.display()));
        }
    }
    let cfg = o.fs.resolve(&o.containerd_config)?;
    if let Some((text, _)) = read_opt(&cfg)? {
        for entry in o.import_entries() {
            if config::imports(&o.containerd_config, &text, &entry)? {
                problems.push(format!(
                    "containerd's configuration {} still imports {entry}",
                    o.containerd_config.display()
                ));
            }
        }
    }
    Ok(problems)
}
