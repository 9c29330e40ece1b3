//! install and uninstall: the steps, each recorded before it is taken.

use std::collections::BTreeSet;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

use crate::config;
use crate::dropin::{self, SHIM_BINARY};
use crate::elf;
use crate::error::{Error, Result};
use crate::labels;
use crate::paths::{check_abs, HostFs};
use crate::record::{
    self, make_dir, sha256, sha256_file, sync_parent, temp_path, write_atomic, ConfigEntry,
    FileEntry, LabelEntry, Phase, Record, RECORD_PATH,
};
use crate::site::{self, SiteArgs};

/// The commands the payload carries into `--bin-dir`.
pub const BINARIES: [&str; 3] = [SHIM_BINARY, "gpu-ckpt", "gpu-ckpt-hook"];
/// The payload's CRIU directory (the binary `criu`, and in `lib/` every library it needs and
/// glibc's loader, found through its RPATH `$ORIGIN/lib`); installed to `<lib-dir>/criu`, with
/// `<bin-dir>/criu` a relative link to it.
pub const CRIU_DIR: &str = "criu";
/// The bundled loader in [`CRIU_DIR`]: the installed `criu`'s interpreter.
pub const CRIU_LOADER: &str = "lib/ld-linux-x86-64.so.2";

/// gpu-ckpt's NCCL layer in the payload (its soname), installed to `<lib-dir>/`: with the
/// default `--lib-dir`, the shim's default `NcclLayer`
/// (`/usr/local/lib/gpu-ckpt/libgpu-ckpt-nccl.so`), else named in the side files.
pub const NCCL_LAYER: &str = gpu_ckpt_shim::nccl::inject::LAYER_FILE_NAME;

/// containerd's restart on a node: systemd in the host's namespaces, from a privileged pod
/// with the host's PID namespace.
pub const DEFAULT_RESTART: &str =
    "nsenter --target 1 --mount --uts --ipc --net --pid -- systemctl restart containerd";

/// What `install` and `uninstall` work on.
#[derive(Debug, Clone)]
pub struct Options {
    pub fs: HostFs,
    /// Node paths (as on the host).
    pub containerd_config: PathBuf,
    pub dropin_dir: PathBuf,
    pub bin_dir: PathBuf,
    pub lib_dir: PathBuf,
    /// Local path of the payload.
    pub payload: PathBuf,
    /// A shell command line.
    pub restart_command: String,
    pub label_node: Option<String>,
    pub service_account_dir: PathBuf,
    /// The site's options (trust, restore sources, registry, runc, handler options).
    pub site: SiteArgs,
    /// The node's driver root (a node path): where NVML's library is, as the NVIDIA container
    /// toolkit (`/`) or the GPU operator's driver container (`/run/nvidia/driver`) has it.
    pub driver_root: PathBuf,
    /// The least time between two restarts of containerd by the watch (`repair`): a restart
    /// due sooner than that after the watch's last one is deferred (containerd's configuration
    /// is fixed, the restart stays pending and is reported, and the first check after the
    /// interval restarts), so that an agent that keeps rewriting the configuration does not
    /// get containerd restarted at every check. `None`: restart whenever needed (`install`,
    /// `uninstall`).
    pub min_restart_interval: Option<std::time::Duration>,
}

/// What a run changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Files and links written or removed.
    pub files_changed: Vec<PathBuf>,
    /// containerd's configuration (config.toml or a drop-in) changed.
    pub config_changed: bool,
    /// The restart command ran.
    pub restarted: bool,
    /// A restart was due but deferred ([`Options::min_restart_interval`]); why.
    pub restart_deferred: Option<String>,
    /// The node's labels were patched.
    pub labelled: bool,
}

enum Content {
    /// A payload file, its sha256.
    File {
        source: PathBuf,
        sha256: String,
    },
    Bytes(Vec<u8>),
    Link(PathBuf),
}

struct Item {
    /// Node path.
    path: PathBuf,
    content: Content,
    mode: u32,
    /// containerd reads it (a drop-in): a change needs a restart.
    config: bool,
    /// The mode of the directories made for it (root-only for the site's files).
    dir_mode: u32,
}

impl Item {
    fn entry(&self) -> FileEntry {
        let (sha, link) = match &self.content {
            Content::File { sha256, .. } => (Some(sha256.clone()), None),
            Content::Bytes(b) => (Some(sha256(b)), None),
            Content::Link(t) => (None, Some(t.clone())),
        };
        FileEntry {
            path: self.path.clone(),
            sha256: sha,
            link,
            mode: self.mode,
        }
    }
}

impl Options {
    fn check(&self) -> Result<()> {
        for (what, p) in [
            ("--containerd-config", &self.containerd_config),
            ("--dropin-dir", &self.dropin_dir),
            ("--bin-dir", &self.bin_dir),
            ("--lib-dir", &self.lib_dir),
            ("--driver-root", &self.driver_root),
        ] {
            check_abs(what, p)?;
        }
        Ok(())
    }

    fn dropin_paths(&self) -> Vec<PathBuf> {
        dropin::SOURCES
            .iter()
            .map(|s| self.dropin_dir.join(s.file))
            .collect()
    }

    /// The `imports` entries: the drop-ins as containerd reads them.
    pub(crate) fn import_entries(&self) -> Vec<String> {
        self.dropin_paths()
            .iter()
            .map(|p| self.fs.for_containerd(p).display().to_string())
            .collect()
    }

    /// The node path of the installed NCCL layer.
    fn nccl_layer(&self) -> PathBuf {
        self.lib_dir.join(NCCL_LAYER)
    }

    fn record_file(&self) -> Result<PathBuf> {
        self.fs.resolve(Path::new(RECORD_PATH))
    }

    /// Every file and link `install` puts on the node, with what it records for each.
    pub(crate) fn planned_entries(&self) -> Result<Vec<(PathBuf, FileEntry)>> {
        Ok(self
            .plan()?
            .iter()
            .map(|i| (i.path.clone(), i.entry()))
            .collect())
    }

    fn plan(&self) -> Result<Vec<Item>> {
        let _span = tracing::info_span!("plan", payload = %self.payload.display()).entered();
        let mut items = Vec::new();
        let missing = |name: &str| Error::PayloadMissing {
            payload: self.payload.clone(),
            name: name.to_string(),
        };
        for b in BINARIES {
            let source = self.payload.join(b);
            if !source.is_file() {
                return Err(missing(b));
            }
            items.push(Item {
                path: self.bin_dir.join(b),
                content: Content::File {
                    sha256: file_sha(&source)?,
                    source,
                },
                mode: 0o755,
                config: false,
                dir_mode: 0o755,
            });
        }
        let layer = self.payload.join(NCCL_LAYER);
        if !layer.is_file() {
            return Err(missing(NCCL_LAYER));
        }
        items.push(Item {
            path: self.nccl_layer(),
            content: Content::File {
                sha256: file_sha(&layer)?,
                source: layer,
            },
            mode: 0o644,
            config: false,
            dir_mode: 0o755,
        });
        self.criu_items(&mut items)?;
        items.extend(self.registration()?);
        Ok(items)
    }

    /// Both handlers' registration: the drop-ins (runc-typed, each naming its own link to the
    /// shim as `runtime_path`, runc's keys from the site options), and the site's files, the
    /// handlers' side files among them ([`site::plan`]).
    fn registration(&self) -> Result<Vec<Item>> {
        let runc = self.site.runc();
        let mut items = Vec::new();
        for src in &dropin::SOURCES {
            let shim = self.fs.for_containerd(&self.bin_dir.join(src.binary));
            items.push(Item {
                path: self.dropin_dir.join(src.file),
                content: Content::Bytes(
                    dropin::render(src, &shim.display().to_string(), &runc)?.into_bytes(),
                ),
                mode: 0o644,
                config: true,
                dir_mode: 0o755,
            });
        }
        let for_containerd = |p: &Path| self.fs.for_containerd(p);
        let layer = self.nccl_layer();
        let target = site::Target {
            bin_dir: &self.bin_dir,
            for_containerd: &for_containerd,
            nccl_layer: Some(&layer),
        };
        for f in site::plan(&self.site, &target)? {
            items.push(Item {
                path: f.path,
                content: match f.content {
                    site::Content::Bytes(b) => Content::Bytes(b),
                    site::Content::Link(l) => Content::Link(l),
                },
                mode: f.mode,
                config: false,
                dir_mode: f.dir_mode,
            });
        }
        Ok(items)
    }
}

/// Whether the installed file at node path `p` is read by containerd: a drop-in (by its name,
/// so that one under an earlier `--dropin-dir` counts too), so that writing or removing it
/// needs a restart. Nothing else the installer writes is containerd's configuration: a
/// handler's side file is read by the shim, a registry's `hosts.toml` by the shim's pulls.
fn containerd_reads(p: &Path) -> bool {
    p.file_name()
        .is_some_and(|n| dropin::SOURCES.iter().any(|s| n == s.file))
}

/// Whether what is at `at` has `e`'s bytes (or link target), whatever its mode.
fn same_content(at: &Path, e: &FileEntry) -> Result<bool> {
    let mode = match fs::symlink_metadata(at) {
        Ok(m) => m.mode() & 0o7777,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(err) => return Err(Error::io("stat", at)(err)),
    };
    matches(at, &FileEntry { mode, ..e.clone() })
}

/// Seconds since the epoch.
fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Options {
    /// The payload's CRIU tree under `<lib-dir>/criu`, its `criu` given the bundled loader as
    /// the node sees it for interpreter ([`elf`]), and `<bin-dir>/criu` a relative link to it:
    /// runc runs `criu` from PATH, and the process is CRIU itself (`/proc/PID/exe`), with the
    /// bundled libraries through its RPATH `$ORIGIN/lib` and nothing in its environment.
    fn criu_items(&self, items: &mut Vec<Item>) -> Result<()> {
        let _span = tracing::info_span!("criu", lib_dir = %self.lib_dir.display()).entered();
        let src = self.payload.join(CRIU_DIR);
        for name in ["criu", CRIU_LOADER] {
            if !src.join(name).is_file() {
                return Err(Error::PayloadMissing {
                    payload: self.payload.clone(),
                    name: format!("{CRIU_DIR}/{name}"),
                });
            }
        }
        let dest = self.lib_dir.join(CRIU_DIR);
        let first = items.len();
        walk_payload(&src, &dest, items)?;
        let bin = dest.join("criu");
        let loader = self.fs.for_containerd(&dest.join(CRIU_LOADER));
        if let Some(item) = items[first..].iter_mut().find(|i| i.path == bin) {
            let source = src.join("criu");
            let bytes = fs::read(&source).map_err(Error::io("read", &source))?;
            let patched = elf::with_interpreter(&bytes, &loader)
                .map_err(|why| Error::PayloadCriu { path: source, why })?;
            item.content = Content::Bytes(patched);
        }
        items.push(Item {
            path: self.bin_dir.join("criu"),
            content: Content::Link(relative_link(&self.bin_dir, &bin)),
            mode: 0o777,
            config: false,
            dir_mode: 0o755,
        });
        Ok(())
    }
}

fn file_sha(p: &Path) -> Result<String> {
    sha256_file(p)?.ok_or_else(|| Error::Io {
        context: format!("read {}", p.display()),
        source: std::io::ErrorKind::NotFound.into(),
    })
}

/// The payload's CRIU tree: regular files (their modes kept) and relative links that stay
/// inside it; anything else is refused.
fn walk_payload(src: &Path, dest: &Path, items: &mut Vec<Item>) -> Result<()> {
    let mut entries: Vec<_> = fs::read_dir(src)
        .map_err(Error::io("read payload directory", src))?
        .collect::<std::result::Result<_, _>>()
        .map_err(Error::io("read payload directory", src))?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let p = e.path();
        let to = dest.join(e.file_name());
        let meta = fs::symlink_metadata(&p).map_err(Error::io("stat", &p))?;
        let ft = meta.file_type();
        if ft.is_dir() {
            walk_payload(&p, &to, items)?;
        } else if ft.is_file() {
            items.push(Item {
                path: to,
                content: Content::File {
                    sha256: file_sha(&p)?,
                    source: p,
                },
                mode: meta.mode() & 0o755,
                config: false,
                dir_mode: 0o755,
            });
        } else if ft.is_symlink() {
            let target = fs::read_link(&p).map_err(Error::io("read link", &p))?;
            if target.is_absolute()
                || target
                    .components()
                    .any(|c| c == std::path::Component::ParentDir)
            {
                return Err(Error::PayloadMissing {
                    payload: p,
                    name: format!(
                        "link target inside the payload (it points to {})",
                        target.display()
                    ),
                });
            }
            items.push(Item {
                path: to,
                content: Content::Link(target),
                mode: 0o777,
                config: false,
                dir_mode: 0o755,
            });
        } else {
            return Err(Error::PayloadMissing {
                payload: p,
                name: "regular file, directory or link (it is neither)".into(),
            });
        }
    }
    Ok(())
}

/// `to` relative to the directory `from` (both absolute node paths), so that the link works
/// wherever the node's tree is mounted.
fn relative_link(from: &Path, to: &Path) -> PathBuf {
    let a: Vec<_> = from.components().collect();
    let b: Vec<_> = to.components().collect();
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let mut out = PathBuf::new();
    for _ in common..a.len() {
        out.push("..");
    }
    for c in &b[common..] {
        out.push(c.as_os_str());
    }
    out
}

/// What is at `at` now, compared with what the installer would write.
pub(crate) fn matches(at: &Path, e: &FileEntry) -> Result<bool> {
    let meta = match fs::symlink_metadata(at) {
        Ok(m) => m,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(err) => return Err(Error::io("stat", at)(err)),
    };
    if let Some(link) = &e.link {
        return Ok(meta.file_type().is_symlink()
            && fs::read_link(at).map_err(Error::io("read link", at))? == *link);
    }
    if !meta.file_type().is_file() || meta.mode() & 0o7777 != e.mode {
        return Ok(false);
    }
    Ok(sha256_file(at)? == e.sha256)
}

fn exists(at: &Path) -> bool {
    fs::symlink_metadata(at).is_ok()
}

struct Run<'a> {
    o: &'a Options,
    rec: Record,
    at: PathBuf,
    out: Outcome,
}

/// Whether the existing directory `here` (node path `host`) may hold trust files or CRIU: owned
/// by root, not writable by group or others, and (`private`, the site's) root's alone.
fn check_dir_owner(here: &Path, host: &Path, private: bool) -> Result<()> {
    let m = fs::metadata(here).map_err(Error::io("stat", here))?;
    let mode = m.mode() & 0o7777;
    let why = if m.uid() != 0 {
        format!("owned by uid {}, not root", m.uid())
    } else if private && mode & 0o077 != 0 {
        format!("mode {mode:04o}: the site's directories must be root's alone (0700)")
    } else if mode & 0o022 != 0 {
        format!("mode {mode:04o}: writable by group or others")
    } else {
        return Ok(());
    };
    Err(Error::ForeignDir {
        path: host.to_path_buf(),
        why,
    })
}

impl Run<'_> {
    fn save(&self) -> Result<()> {
        self.rec.save(&self.at)
    }

    /// Creates the missing directories of node path `dir`, recording each. Where `guarded` (the
    /// directories of trust files, side files and CRIU), an existing directory is adopted only if
    /// root owns it and neither group nor others may write to it, and one of the site's only if
    /// it is root's alone (0700): else it is refused as foreign.
    fn ensure_dir(&mut self, dir: &Path, mode: u32, guarded: bool) -> Result<()> {
        let site_dir = self.o.site.site_dir();
        let mut host = PathBuf::from("/");
        for c in dir.components().skip(1) {
            host.push(c);
            let here = self.o.fs.resolve(&host)?;
            if here.is_dir() {
                if guarded {
                    check_dir_owner(&here, &host, host.starts_with(&site_dir))?;
                }
                continue;
            }
            // Only the last one gets `mode` (the record's directory is root-only), and every
            // one in the site's directory (root's alone, as the check above wants them).
            let m = if host.as_path() == dir || (guarded && host.starts_with(&site_dir)) {
                mode
            } else {
                0o755
            };
            make_dir(&here, m)?;
            self.rec.dirs_created.push(host.clone());
        }
        Ok(())
    }

    fn write_item(&mut self, item: &Item) -> Result<()> {
        let _span = tracing::info_span!("write", path = %item.path.display()).entered();
        let site_dir = self.o.site.site_dir();
        let in_site = item.path.starts_with(&site_dir);
        if in_site {
            // The site's directory is root-only too, not only the directories below it.
            self.ensure_dir(&site_dir, item.dir_mode, true)?;
        }
        if let Some(parent) = item.path.parent() {
            // Trust (the site's files, the side files beside the shim) and CRIU: nobody but
            // root may have put or may change what is read from there.
            let guarded = in_site
                || parent == self.o.bin_dir
                || item.path.starts_with(self.o.lib_dir.join(CRIU_DIR));
            self.ensure_dir(parent, item.dir_mode, guarded)?;
        }
        self.rec.set_file(item.entry());
        self.save()?;
        let dest = self.o.fs.resolve_parent(&item.path)?;
        let tmp = temp_path(&dest);
        let _ = fs::remove_file(&tmp);
        match &item.content {
            Content::Link(target) => {
                std::os::unix::fs::symlink(target, &tmp).map_err(Error::io("create link", &tmp))?;
                fs::rename(&tmp, &dest).map_err(Error::io("rename into place", &dest))?;
                sync_parent(&dest)?;
            }
            Content::Bytes(b) => write_atomic(&dest, b, item.mode)?,
            Content::File { source, sha256 } => {
                copy_checked(source, &tmp, item.mode, sha256)?;
                fs::rename(&tmp, &dest).map_err(Error::io("rename into place", &dest))?;
                sync_parent(&dest)?;
            }
        }
        self.out.files_changed.push(item.path.clone());
        Ok(())
    }

    /// Removes a recorded file if it is still what the installer wrote; a changed one is left
    /// (someone else's now) with a warning. A trusted key is removed whatever it holds now: a
    /// key no longer in the values must not stay trusted.
    fn remove_entry(&mut self, e: &FileEntry) -> Result<bool> {
        let at = self.o.fs.resolve_parent(&e.path)?;
        let _ = fs::remove_file(temp_path(&at));
        if !exists(&at) {
            return Ok(false);
        }
        let trust = site::is_trusted_key_file(&self.o.site.site_dir(), &e.path);
        if !trust && !matches(&at, e)? {
            tracing::warn!(path = %e.path.display(), "changed since it was installed: left in place");
            return Ok(false);
        }
        fs::remove_file(&at).map_err(Error::io("remove", &at))?;
        sync_parent(&at)?;
        self.out.files_changed.push(e.path.clone());
        Ok(true)
    }

    fn restart_if_pending(&mut self) -> Result<()> {
        if !self.rec.restart_pending {
            return Ok(());
        }
        let now = now_secs();
        let min = self.o.min_restart_interval;
        if let (Some(min), Some(last)) = (min, self.rec.last_repair_restart) {
            let since = now.saturating_sub(last);
            if since < min.as_secs() {
                let why = format!(
                    "containerd was restarted {since} s ago, the least interval between restarts is {} s: the restart waits (is another agent rewriting containerd's configuration?)",
                    min.as_secs()
                );
                tracing::warn!(reason = %why, "containerd's restart deferred");
                self.out.restart_deferred = Some(why);
                return Ok(());
            }
        }
        restart(&self.o.restart_command)?;
        self.out.restarted = true;
        self.rec.restart_pending = false;
        if min.is_some() {
            self.rec.last_repair_restart = Some(now);
        }
        self.save()
    }
}

fn copy_checked(source: &Path, to: &Path, mode: u32, want: &str) -> Result<()> {
    let mut r = fs::File::open(source).map_err(Error::io("open", source))?;
    let mut w = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(to)
        .map_err(Error::io("create", to))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = r.read(&mut buf).map_err(Error::io("read", source))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        w.write_all(&buf[..n]).map_err(Error::io("write", to))?;
    }
    w.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(Error::io("chmod", to))?;
    w.sync_all().map_err(Error::io("fsync", to))?;
    let got = hex::encode(h.finalize());
    if got != want {
        let _ = fs::remove_file(to);
        return Err(Error::Io {
            context: format!("copy {}", source.display()),
            source: std::io::Error::other(format!(
                "the payload file changed while it was installed (sha256 {got}, expected {want})"
            )),
        });
    }
    Ok(())
}

/// Runs the restart command (`sh -c`).
pub fn restart(command: &str) -> Result<()> {
    let _span = tracing::info_span!("restart_containerd", command).entered();
    let out = Command::new("/bin/sh")
        .arg("-c")
        .arg(command)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| Error::Restart {
            command: command.to_string(),
            why: format!("cannot start /bin/sh with its input on /dev/null: {e}"),
        })?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last = stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        return Err(Error::Restart {
            command: command.to_string(),
            why: format!("{}: {}", out.status, last.trim()),
        });
    }
    tracing::info!("containerd restarted");
    Ok(())
}

pub(crate) fn read_opt(p: &Path) -> Result<Option<(String, u32)>> {
    match fs::read(p) {
        Ok(b) => {
            let mode = fs::metadata(p).map_err(Error::io("stat", p))?.mode() & 0o7777;
            let text = String::from_utf8(b).map_err(|_| Error::Config {
                path: p.to_path_buf(),
                why: "not UTF-8, so not TOML".into(),
            })?;
            Ok(Some((text, mode)))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io("read", p)(e)),
    }
}

/// Installs (or finishes an install, or brings an older one up to date).
pub fn install(o: &Options) -> Result<Outcome> {
    let _span = tracing::info_span!("install", root = %o.fs.root.display()).entered();
    o.check()?;
    let at = o.record_file()?;
    let rec = Record::load(&at)?.unwrap_or_default();
    let mut run = Run {
        o,
        rec,
        at: at.clone(),
        out: Outcome::default(),
    };
    run.rec.phase = Phase::Installing;
    let plan = o.plan()?;

    // Nothing is written before every target is known to be free or ours.
    for item in &plan {
        let dest = o.fs.resolve_parent(&item.path)?;
        if exists(&dest) && run.rec.file(&item.path).is_none() {
            return Err(Error::Foreign {
                path: item.path.clone(),
            });
        }
    }
    let record_dir = Path::new(RECORD_PATH).parent().unwrap_or(Path::new("/"));
    run.ensure_dir(record_dir, 0o700, false)?;
    run.save()?;

    for item in &plan {
        let dest = o.fs.resolve_parent(&item.path)?;
        let want = item.entry();
        let recorded = run.rec.file(&item.path);
        if recorded == Some(&want) && matches(&dest, &want)? {
            continue;
        }
        // containerd reads the bytes: a drop-in whose bytes are as recorded and wanted (only
        // its mode changed) is put right without a restart.
        let same_bytes = recorded.is_some_and(|r| r.sha256 == want.sha256 && r.link == want.link)
            && same_content(&dest, &want)?;
        let restart = item.config && !same_bytes;
        if restart {
            run.rec.restart_pending = true;
        }
        run.write_item(item)?;
        if restart {
            run.out.config_changed = true;
        }
    }
    // What an earlier install put where this one puts nothing (another --bin-dir, a file the
    // payload no longer has).
    let planned: BTreeSet<&Path> = plan.iter().map(|i| i.path.as_path()).collect();
    let stale: Vec<FileEntry> = run
        .rec
        .files
        .iter()
        .filter(|f| !planned.contains(f.path.as_path()))
        .cloned()
        .collect();
    for e in stale {
        if run.remove_entry(&e)? && containerd_reads(&e.path) {
            // An old drop-in that containerd may still read.
            run.rec.restart_pending = true;
        }
        run.rec.files.retain(|f| f.path != e.path);
        run.save()?;
    }

    // containerd's configuration: the imports.
    {
        let _span = tracing::info_span!("containerd_config", path = %o.containerd_config.display())
            .entered();
        let cfg = o.fs.resolve(&o.containerd_config)?;
        let current = read_opt(&cfg)?;
        let entries = o.import_entries();
        let text = current.as_ref().map(|(t, _)| t.as_str());
        if let Some(new) = config::add_imports(&o.containerd_config, text, &entries)? {
            let mode = current.as_ref().map(|(_, m)| *m).unwrap_or(0o644);
            match run.rec.config.as_mut() {
                Some(c) => {
                    c.after_sha256 = sha256(new.as_bytes());
                    for e in &entries {
                        if !c.imports_added.contains(e) {
                            c.imports_added.push(e.clone());
                        }
                    }
                }
                None => {
                    run.rec.config = Some(ConfigEntry {
                        path: o.containerd_config.clone(),
                        before: current.as_ref().map(|(t, _)| t.clone()),
                        before_mode: current.as_ref().map(|(_, m)| *m),
                        after_sha256: sha256(new.as_bytes()),
                        imports_added: entries.clone(),
                    })
                }
            }
            if let Some(parent) = o.containerd_config.parent() {
                run.ensure_dir(parent, 0o755, false)?;
            }
            run.rec.restart_pending = true;
            run.save()?;
            write_atomic(&cfg, new.as_bytes(), mode)?;
            run.out.config_changed = true;
            tracing::info!(imports = ?entries, "imports added");
        }
    }
    run.restart_if_pending()?;

    if let Some(node) = &o.label_node {
        let _span = tracing::info_span!("label_node", node).entered();
        // A node whose GPUs are unknown (a driver that does not answer) gets no GPU labels,
        // and loses those of an earlier run: its GPUs are unknown, not absent.
        let inventory = match labels::read_gpus(&o.fs, &o.driver_root) {
            labels::GpuReading::Gpus(inv) => Some(inv),
            labels::GpuReading::NoGpus | labels::GpuReading::Unknown(_) => None,
        };
        let set = labels::labels_for(inventory.as_ref());
        // Keys an earlier run set that this node no longer has (a driver removed).
        let remove: Vec<String> = run
            .rec
            .labels
            .as_ref()
            .map(|l| {
                l.keys
                    .iter()
                    .filter(|k| !set.contains_key(*k))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        run.rec.labels = Some(LabelEntry {
            node: node.clone(),
            keys: set.keys().cloned().collect(),
        });
        run.save()?;
        let api = labels::ApiServer::in_cluster(node, &o.service_account_dir)?;
        api.patch_node(node, &labels::patch_body(&set, &remove))?;
        run.out.labelled = true;
    }
    run.rec.phase = Phase::Installed;
    run.save()?;
    Ok(run.out)
}

/// Notes a failed uninstall step (what it was, and the error) and goes on with the others.
fn note_failure(failed: &mut Vec<String>, what: String, e: Error) {
    tracing::error!(step = %what, error = %e, "uninstall step failed; going on with the others");
    failed.push(format!("{what}: {e}"));
}

/// Removes everything the record lists; a node without a record has nothing to remove.
///
/// Every step is tried, whatever failed before it: a node label that cannot be removed (the
/// API server refused the service account's token, because the ServiceAccount was deleted
/// first) still leaves containerd's configuration, the drop-ins, the binaries and CRIU to be
/// removed. What failed stays in the record for the next run, and the run ends with
/// [`Error::Uninstall`], naming each failed step.
pub fn uninstall(o: &Options) -> Result<Outcome> {
    let _span = tracing::info_span!("uninstall", root = %o.fs.root.display()).entered();
    o.check()?;
    let at = o.record_file()?;
    let Some(rec) = Record::load(&at)? else {
        tracing::info!(record = %at.display(), "nothing installed here");
        return Ok(Outcome::default());
    };
    let mut run = Run {
        o,
        rec,
        at: at.clone(),
        out: Outcome::default(),
    };
    let mut failed = Vec::new();
    run.rec.phase = Phase::Uninstalling;
    run.save()?;

    // The label first: nothing new is scheduled here while the rest goes.
    if let Some(l) = run.rec.labels.clone() {
        let _span = tracing::info_span!("unlabel_node", node = %l.node).entered();
        let unlabelled =
            labels::ApiServer::in_cluster(&l.node, &o.service_account_dir).and_then(|api| {
                api.patch_node(&l.node, &labels::patch_body(&Default::default(), &l.keys))
            });
        match unlabelled {
            Ok(()) => {
                run.out.labelled = true;
                run.rec.labels = None;
                run.save()?;
            }
            Err(e) => note_failure(
                &mut failed,
                format!("remove the labels {} of node {}", l.keys.join(", "), l.node),
                e,
            ),
        }
    }

    if let Some(c) = run.rec.config.clone() {
        let _span = tracing::info_span!("containerd_config", path = %c.path.display()).entered();
        match restore_config(o, &c) {
            Ok(changed) => {
                if changed {
                    run.rec.restart_pending = true;
                    run.out.config_changed = true;
                }
                run.rec.config = None;
                run.save()?;
            }
            Err(e) => note_failure(
                &mut failed,
                format!(
                    "remove the imports from containerd's configuration {}",
                    c.path.display()
                ),
                e,
            ),
        }
    }

    let dropins = o.dropin_paths();
    let (configs, others): (Vec<FileEntry>, Vec<FileEntry>) = run
        .rec
        .files
        .clone()
        .into_iter()
        .partition(|f| dropins.contains(&f.path) || containerd_reads(&f.path));
    for e in configs {
        match run.remove_entry(&e) {
            Ok(removed) => {
                if removed {
                    run.rec.restart_pending = true;
                    run.out.config_changed = true;
                }
                run.rec.files.retain(|f| f.path != e.path);
                run.save()?;
            }
            Err(err) => note_failure(
                &mut failed,
                format!("remove the drop-in {}", e.path.display()),
                err,
            ),
        }
    }
    if let Err(e) = run.restart_if_pending() {
        note_failure(&mut failed, "restart containerd".into(), e);
    }
    for e in others {
        match run.remove_entry(&e) {
            Ok(_) => {
                run.rec.files.retain(|f| f.path != e.path);
                run.save()?;
            }
            Err(err) => note_failure(&mut failed, format!("remove {}", e.path.display()), err),
        }
    }

    // The record goes when everything else went; else it keeps what is left, for the next run,
    // with the directories it is in.
    let keep_record = !failed.is_empty();
    if !keep_record {
        fs::remove_file(&at).map_err(Error::io("remove install record", &at))?;
        let _ = fs::remove_file(temp_path(&at));
    }
    let record_dir = Path::new(RECORD_PATH).parent().unwrap_or(Path::new("/"));
    let mut kept = Vec::new();
    for d in std::mem::take(&mut run.rec.dirs_created).iter().rev() {
        if keep_record && record_dir.starts_with(d) {
            kept.push(d.clone());
            continue;
        }
        let here = o.fs.resolve(d)?;
        match fs::remove_dir(&here) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(dir = %d.display(), error = %e, "left in place");
                if keep_record {
                    kept.push(d.clone());
                }
            }
        }
    }
    if keep_record {
        kept.reverse();
        run.rec.dirs_created = kept;
        run.save()?;
        return Err(Error::Uninstall { failed });
    }
    Ok(run.out)
}

/// containerd's configuration as it was before the install: its exact bytes when nobody
/// changed it since, else only the imports entries the install added are taken out. Whether
/// the file changed.
fn restore_config(o: &Options, c: &ConfigEntry) -> Result<bool> {
    let cfg = o.fs.resolve(&c.path)?;
    let current = read_opt(&cfg)?;
    Ok(match &current {
        Some((text, mode)) if sha256(text.as_bytes()) == c.after_sha256 => {
            // Nobody changed it since: the exact bytes from before.
            match &c.before {
                Some(before) => {
                    write_atomic(&cfg, before.as_bytes(), c.before_mode.unwrap_or(*mode))?
                }
                None => {
                    fs::remove_file(&cfg).map_err(Error::io("remove", &cfg))?;
                    sync_parent(&cfg)?;
                }
            }
            true
        }
        Some((text, mode)) => match config::remove_imports(&c.path, text, &c.imports_added)? {
            Some(new) => {
                tracing::info!("the configuration was edited since the install: only the imports entries are removed");
                write_atomic(&cfg, new.as_bytes(), *mode)?;
                true
            }
            None => false,
        },
        None => false,
    })
}

/// The record's path for `fs` (for tools and tests).
pub fn record_path(fs: &HostFs) -> Result<PathBuf> {
    fs.resolve(Path::new(record::RECORD_PATH))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_are_relative() {
        assert_eq!(
            relative_link(
                Path::new("/usr/local/bin"),
                Path::new("/usr/local/lib/gpu-ckpt/criu/criu")
            ),
            PathBuf::from("../lib/gpu-ckpt/criu/criu")
        );
        assert_eq!(
            relative_link(Path::new("/opt/bin"), Path::new("/opt/bin/x")),
            PathBuf::from("x")
        );
    }
}
