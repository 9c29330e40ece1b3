//! Holds a restore's mounts to the new container's spec.
//!
//! CRIU restores the container's mount table, and every mount's flags, from the checkpoint's
//! `mountpoints-<id>.img`, not from the spec of the container it restores into; runc hands it
//! only the host paths of the spec's bind mounts (`--ext-mount-map`). Without a check, a
//! checkpoint of a container that had `/data` read-write restores into a spec that mounts a
//! host directory read-only at `/data`, with a read-only root, as read-write on both; and a
//! bind the new spec adds but the checkpoint did not have comes up as an empty directory.
//!
//! Three steps:
//!
//! 1. Before CRIU starts ([`refuse_new_mounts`]): every mount of the spec must have a mount at
//!    the same destination in the checkpoint's mount images. CRIU cannot add one (it would
//!    leave the empty directory runc made for it), so the restore is refused naming them.
//! 2. At the gate's `pre-resume`, where CRIU has restored every mount and no restored task has
//!    run ([`hold`]): the spec's flags are applied to each restored mount (`mount_setattr`:
//!    `ro`, `nosuid`, `nodev`, `noexec` set, `rw`, `suid`, `dev`, `exec` cleared, `rro`
//!    recursively), to each of `readonlyPaths`, and `root.readonly` to the root. The kernel
//!    allows `mount_setattr` only on mounts of the caller's mount namespace, so a thread of the
//!    shim made for it unshares its filesystem context, joins the restored init's mount
//!    namespace and exits when done; every path is resolved from the init's root with
//!    `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)`, so nothing the
//!    container (or a sidecar) put there redirects it, and nothing of the container runs in it.
//!    A mount that a restored task holds a file open for writing on cannot be made read-only
//!    (`EBUSY`): that refuses the restore too, as a writable handle on a read-only mount would
//!    be a way around it.
//! 3. Then the kernel's mount table of the restored init (`/proc/<pid>/mountinfo`) is checked
//!    against the spec ([`check`]): each spec mount present at its destination, with the
//!    flags the spec sets, a bind's mount the same directory (device and inode) as the spec's
//!    source, each existing `maskedPaths` entry masked (`/dev/null` or a read-only tmpfs),
//!    each existing `readonlyPaths` entry a read-only mount, the root read-only where
//!    `root.readonly`, and each sub-mount (`sub_mounts.rs`) the very host directory the shim
//!    resolved and held. Any difference fails the restore naming the mount and both values;
//!    the gate then kills the restored tree before it runs.
//!
//! Flags the spec does not set are not required absent: a bind inherits `nosuid`/`nodev` from
//! its source's mount, as in a cold start, and a mount more restricted than the spec is no
//! way around it.

use std::{
    fmt,
    os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
    path::{Path, PathBuf},
};

use image_format::mountinfo::{self, MountInfo};
use nix::{
    errno::Errno,
    fcntl::{openat2, OFlag, OpenHow, ResolveFlag},
    sched::CloneFlags,
    sys::stat::{FileStat, Mode, SFlag},
};
use oci_spec::runtime::Spec;
use tracing::{debug, info, warn};

use crate::{
    device_nodes::{self, DevPolicy},
    error::{Error, Result},
    restored_root::{open_in_root, open_root},
    sub_mounts,
};

/// The most differences named in one refusal.
const MAX_REPORTED: usize = 8;

/// The flags a spec mount's options set and clear (`MOUNT_ATTR_*`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MountRule {
    pub destination: String,
    /// The host path of a bind mount.
    pub source: Option<PathBuf>,
    pub bind: bool,
    pub typ: String,
    pub set: u64,
    pub clear: u64,
    /// `rro`: read-only with every mount below it.
    pub recursive_ro: bool,
}

/// What the new container's spec says of its mounts.
#[derive(Debug, Clone, Default)]
pub struct MountPolicy {
    pub mounts: Vec<MountRule>,
    pub masked: Vec<String>,
    pub readonly: Vec<String>,
    pub root_readonly: bool,
}

const FLAGS: [(&str, &str, u64); 4] = [
    ("ro", "rw", libc::MOUNT_ATTR_RDONLY),
    ("nosuid", "suid", libc::MOUNT_ATTR_NOSUID),
    ("nodev", "dev", libc::MOUNT_ATTR_NODEV),
    ("noexec", "exec", libc::MOUNT_ATTR_NOEXEC),
];

/// `ro,nosuid` for a set of `MOUNT_ATTR_*` flags.
fn flag_names(flags: u64) -> String {
    let names: Vec<&str> = FLAGS
        .iter()
        .filter(|(_, _, f)| flags & f != 0)
        .map(|(n, _, _)| *n)
        .collect();
    names.join(",")
}

/// The `MOUNT_ATTR_*` flags a mountinfo entry has.
fn flags_of(m: &MountInfo) -> u64 {
    FLAGS
        .iter()
        .filter(|(n, _, _)| m.has(n))
        .fold(0, |acc, (_, _, f)| acc | f)
}

impl MountPolicy {
    /// The policy of an OCI spec.
    pub fn from_spec(spec: &Spec) -> MountPolicy {
        let mounts = spec
            .mounts()
            .as_deref()
            .unwrap_or_default()
            .iter()
            .map(|m| {
                let options = m.options().as_deref().unwrap_or_default();
                let typ = m.typ().clone().unwrap_or_default();
                let mut rule = MountRule {
                    destination: mountinfo::normalize(&m.destination().display().to_string()),
                    source: None,
                    bind: typ == "bind" || options.iter().any(|o| o == "bind" || o == "rbind"),
                    typ,
                    ..Default::default()
                };
                if rule.bind {
                    rule.source = m.source().clone();
                }
                // In order: the last of `ro`/`rw` wins, as for mount(8).
                for o in options {
                    if o == "rro" {
                        rule.recursive_ro = true;
                        rule.set |= libc::MOUNT_ATTR_RDONLY;
                        rule.clear &= !libc::MOUNT_ATTR_RDONLY;
                        continue;
                    }
                    for (on, off, f) in FLAGS {
                        if o == on {
                            rule.set |= f;
                            rule.clear &= !f;
                        } else if o == off {
                            rule.clear |= f;
                            rule.set &= !f;
                        }
                    }
                }
                rule
            })
            .collect();
        let linux = spec.linux().as_ref();
        let paths = |v: Option<&Vec<String>>| -> Vec<String> {
            v.map(|v| v.iter().map(|p| mountinfo::normalize(p)).collect())
                .unwrap_or_default()
        };
        MountPolicy {
            mounts,
            masked: paths(linux.and_then(|l| l.masked_paths().as_ref())),
            readonly: paths(linux.and_then(|l| l.readonly_paths().as_ref())),
            root_readonly: spec
                .root()
                .as_ref()
                .and_then(|r| r.readonly())
                .unwrap_or(false),
        }
    }
}

/// Before CRIU starts: refuses a spec with mounts at destinations the checkpoint in `dir` has
/// no mount at (CRIU would leave them empty directories). A directory without mount images
/// (not a CRIU checkpoint of a container) is left to CRIU.
///
/// A destination with a symlink on the way is looked up where it resolves in `rootfs` (the new
/// container's root filesystem, which nothing runs in yet).
pub fn refuse_new_mounts(dir: &Path, rootfs: &Path, policy: &MountPolicy) -> Result<()> {
    let recorded = mountinfo::read_criu_mounts(dir)?;
    if recorded.is_empty() {
        debug!(dir = %dir.display(), "no mount images: the spec's mounts are checked at pre-resume only");
        return Ok(());
    }
    let root = nix::fcntl::open(
        rootfs,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .ok();
    let has = |dest: &str| recorded.iter().any(|r| r.mountpoint == dest);
    let missing: Vec<String> = policy
        .mounts
        .iter()
        .filter(|m| {
            !has(&m.destination)
                && !root
                    .as_ref()
                    .and_then(|r| destination_in(r.as_fd(), &m.destination, None))
                    .is_some_and(|d| has(&d))
        })
        .map(|m| match &m.source {
            Some(s) => format!("{} (bind of {})", m.destination, s.display()),
            None => format!("{} ({})", m.destination, m.typ),
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(Error::FailedPrecondition(format!(
        "restore refused: this container's spec mounts {}, where the checkpoint has no mount; CRIU restores only the checkpoint's mounts and would leave an empty directory there",
        missing.join(", ")
    )))
}

/// One way the restored mounts differ from the spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    /// `mount /data`, `root /`, `masked path /proc/kcore`, ...
    pub mount: String,
    pub found: String,
    pub spec: String,
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: found {}, the spec's {}",
            self.mount, self.found, self.spec
        )
    }
}

/// Where runc put the mount for `dest`: `dest` itself when it has a mount or no symlink on the
/// way, else `dest` with its symlinks resolved inside `root` (runc resolves a destination
/// such as `/var/run/secrets` inside the rootfs, to `/run/secrets` where `/var/run` is a
/// symlink to `/run`). `None` when it does not resolve.
fn destination_in(root: BorrowedFd<'_>, dest: &str, table: Option<&[MountInfo]>) -> Option<String> {
    if table.is_some_and(|t| top(t, dest).is_some()) || open_in_root(root, dest).is_ok() {
        return Some(dest.to_string());
    }
    let rel = dest.trim_start_matches('/');
    let fd = openat2(
        root,
        if rel.is_empty() { "." } else { rel },
        OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
            .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS),
    )
    .ok()?;
    let path_of = |fd: i32| std::fs::read_link(format!("/proc/self/fd/{fd}")).ok();
    let (base, found) = (path_of(root.as_raw_fd())?, path_of(fd.as_raw_fd())?);
    let rest = found.strip_prefix(&base).ok()?;
    Some(mountinfo::normalize(&rest.display().to_string()))
}

fn read_table(pid: i32) -> Result<Vec<MountInfo>> {
    let path = format!("/proc/{pid}/mountinfo");
    let text = std::fs::read_to_string(&path)
        .map_err(Error::io(format!("read {path} of the restored init")))?;
    Ok(mountinfo::parse(&text, &path)?)
}

/// The topmost mount at `mountpoint`.
fn top<'a>(table: &'a [MountInfo], mountpoint: &str) -> Option<&'a MountInfo> {
    table.iter().rev().find(|m| m.mountpoint == mountpoint)
}

/// `mount_setattr(fd, "", AT_EMPTY_PATH [| AT_RECURSIVE], {set, clear})`.
fn mount_setattr(fd: BorrowedFd<'_>, set: u64, clear: u64, recursive: bool) -> nix::Result<()> {
    let mut attr = libc::mount_attr {
        attr_set: set,
        attr_clr: clear,
        propagation: 0,
        userns_fd: 0,
    };
    let flags = libc::AT_EMPTY_PATH | if recursive { libc::AT_RECURSIVE } else { 0 };
    // SAFETY: a valid fd, a NUL-terminated empty path, and an attr struct of the size passed.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            fd.as_raw_fd(),
            c"".as_ptr(),
            flags as libc::c_uint,
            &mut attr as *mut libc::mount_attr,
            std::mem::size_of::<libc::mount_attr>(),
        )
    };
    Errno::result(r).map(drop)
}

/// One mount to set flags on: where, what to set and clear, recursively or not.
struct Change {
    what: String,
    path: String,
    set: u64,
    clear: u64,
    recursive: bool,
}

/// The changes the spec asks of the restored table; `places[i]` is where the mount of
/// `policy.mounts[i]` is ([`destination_in`]).
fn changes(policy: &MountPolicy, places: &[Option<String>], table: &[MountInfo]) -> Vec<Change> {
    let mut out: Vec<Change> = policy
        .mounts
        .iter()
        .zip(places)
        .filter_map(|(m, p)| Some((m, p.as_ref()?)))
        .filter(|(m, p)| {
            p.as_str() != "/" && top(table, p).is_some() && (m.set != 0 || m.clear != 0)
        })
        .map(|(m, p)| Change {
            what: format!("mount {}", m.destination),
            path: p.clone(),
            set: m.set,
            clear: m.clear,
            recursive: m.recursive_ro,
        })
        .collect();
    out.extend(
        policy
            .readonly
            .iter()
            .filter(|p| top(table, p).is_some())
            .map(|p| Change {
                what: format!("read-only path {p}"),
                path: p.clone(),
                set: libc::MOUNT_ATTR_RDONLY,
                clear: 0,
                recursive: false,
            }),
    );
    if policy.root_readonly {
        out.push(Change {
            what: "root /".into(),
            path: "/".into(),
            set: libc::MOUNT_ATTR_RDONLY,
            clear: 0,
            recursive: false,
        });
    }
    out
}

/// Applies `changes` to the mounts of the restored init `pid`, from a thread of its own that
/// joins the init's mount namespace (and only that) and ends with the work.
fn apply(pid: i32, changes: &[Change]) -> Result<()> {
    if changes.is_empty() {
        return Ok(());
    }
    let root = open_root(pid)?;
    let ns_path = format!("/proc/{pid}/ns/mnt");
    let ns = nix::fcntl::open(
        ns_path.as_str(),
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| Error::io(format!("open {ns_path} of the restored init"))(e.into()))?;
    std::thread::scope(|s| {
        s.spawn(|| -> Result<()> {
            // A thread that shares its filesystem context cannot join a mount namespace; this
            // one is never reused, so what it joins dies with it.
            nix::sched::unshare(CloneFlags::CLONE_FS).map_err(|e| {
                Error::io("unshare the filesystem context to hold the restored mounts")(e.into())
            })?;
            nix::sched::setns(ns.as_fd(), CloneFlags::CLONE_NEWNS)
                .map_err(|e| Error::io(format!("join {ns_path}"))(e.into()))?;
            for c in changes {
                let fd = if c.path == "/" {
                    None
                } else {
                    Some(open_in_root(root.as_fd(), &c.path).map_err(|e| {
                        Error::FailedPrecondition(format!(
                            "restore refused: {}: cannot open it in the restored container without following a symlink: {e}",
                            c.what
                        ))
                    })?)
                };
                let fd = fd.as_ref().map(|f| f.as_fd()).unwrap_or(root.as_fd());
                match mount_setattr(fd, c.set, c.clear, c.recursive) {
                    Ok(()) => {}
                    // A flag the kernel keeps locked (a mount from a more privileged namespace)
                    // cannot be cleared: only what the spec sets must hold.
                    Err(Errno::EPERM) if c.clear != 0 => {
                        warn!(mount = %c.path, clear = %flag_names(c.clear), "cannot clear flags the kernel keeps locked");
                        mount_setattr(fd, c.set, 0, c.recursive).map_err(|e| refusal(c, e))?;
                    }
                    Err(e) => return Err(refusal(c, e)),
                }
            }
            Ok(())
        })
        .join()
        .unwrap_or_else(|_| {
            Err(Error::FailedPrecondition(
                "restore refused: setting the spec's mount flags panicked".into(),
            ))
        })
    })
}

fn refusal(c: &Change, e: Errno) -> Error {
    let why = match e {
        Errno::EBUSY => " (a restored task holds a file open for writing on it)".to_string(),
        _ => String::new(),
    };
    Error::FailedPrecondition(format!(
        "restore refused: {}: cannot set {} as the spec says: {e}{why}",
        c.what,
        flag_names(c.set)
    ))
}

fn describe(st: &FileStat) -> String {
    format!(
        "device {}:{} inode {}",
        libc::major(st.st_dev),
        libc::minor(st.st_dev),
        st.st_ino
    )
}

fn same(a: &FileStat, b: &FileStat) -> bool {
    (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
}

/// `/dev/null`'s device number.
const DEV_NULL: (u32, u32) = (1, 3);

/// Checks the restored init `pid`'s mounts against `policy` and the held sub-mounts.
pub fn check(pid: i32, policy: &MountPolicy, held: &[sub_mounts::Held]) -> Result<Vec<Difference>> {
    let table = read_table(pid)?;
    let root = open_root(pid)?;
    let places = places(root.as_fd(), policy, &table);
    let restored = Restored { table, root };
    let mut out = Vec::new();
    if policy.root_readonly {
        out.extend(restored.root_difference());
    }
    for (rule, place) in policy.mounts.iter().zip(&places) {
        out.extend(restored.mount_differences(rule, place.as_deref()));
    }
    for path in &policy.masked {
        out.extend(restored.masked_difference(path));
    }
    for path in &policy.readonly {
        out.extend(restored.readonly_difference(path));
    }
    for h in held {
        out.extend(restored.held_difference(h));
    }
    Ok(out)
}

impl Difference {
    fn new(mount: String, found: String, spec: impl Into<String>) -> Difference {
        Difference {
            mount,
            found,
            spec: spec.into(),
        }
    }
}

/// What [`check`] reads of the restored init: its mount table and its root.
struct Restored {
    table: Vec<MountInfo>,
    root: OwnedFd,
}

impl Restored {
    /// The stat of `path` in the restored container, opened without a symlink.
    fn stat_in(&self, path: &str) -> std::result::Result<FileStat, Errno> {
        let fd = open_in_root(self.root.as_fd(), path)?;
        nix::sys::stat::fstat(fd.as_fd())
    }

    /// `root.readonly`: the root a read-only mount.
    fn root_difference(&self) -> Option<Difference> {
        let found = match top(&self.table, "/") {
            Some(m) if m.has("ro") => return None,
            Some(m) => m.options.join(","),
            None => "no mount".into(),
        };
        Some(Difference::new(
            "root /".into(),
            found,
            "ro (root.readonly)",
        ))
    }

    /// One spec mount: there at its place, with the flags the spec sets, every mount below an
    /// `rro` one read-only, and a bind the very directory of its source.
    fn mount_differences(&self, rule: &MountRule, place: Option<&str>) -> Vec<Difference> {
        let name = match place {
            Some(p) if p != rule.destination => format!("mount {} (at {p})", rule.destination),
            _ => format!("mount {}", rule.destination),
        };
        let Some(m) = place.and_then(|p| top(&self.table, p)) else {
            let spec = match &rule.source {
                Some(s) => format!("bind of {}", s.display()),
                None => format!("{} mount", rule.typ),
            };
            return vec![Difference::new(name, "no mount".into(), spec)];
        };
        let mut out = Vec::new();
        if rule.set & !flags_of(m) != 0 {
            out.push(Difference::new(
                name.clone(),
                m.options.join(","),
                flag_names(rule.set),
            ));
        }
        let place = m.mountpoint.as_str();
        if rule.recursive_ro {
            out.extend(self.writable_below(place, &rule.destination));
        }
        if let Some(source) = &rule.source {
            out.extend(self.source_difference(name, source, place));
        }
        out
    }

    /// The mounts below `place` (the mount of `destination`, an `rro` one) that are not
    /// read-only.
    fn writable_below(&self, place: &str, destination: &str) -> Vec<Difference> {
        let below = format!("{}/", place.trim_end_matches('/'));
        self.table
            .iter()
            .filter(|s| s.mountpoint.starts_with(&below) && !s.has("ro"))
            .map(|sub| {
                Difference::new(
                    format!("mount {} (below {destination})", sub.mountpoint),
                    sub.options.join(","),
                    "ro (rro)",
                )
            })
            .collect()
    }

    /// A bind mount at `place`: the same directory (device and inode) as its `source`.
    fn source_difference(&self, name: String, source: &Path, place: &str) -> Option<Difference> {
        match (nix::sys::stat::stat(source), self.stat_in(place)) {
            (Ok(w), Ok(f)) => not_same(&w, &f).map(|(found, want)| {
                Difference::new(name, found, format!("source {} ({want})", source.display()))
            }),
            (Err(e), _) => Some(Difference::new(
                name,
                "a source the shim cannot stat".into(),
                format!("source {} ({e})", source.display()),
            )),
            (_, Err(e)) => Some(Difference::new(
                name,
                format!("a destination that cannot be opened without a symlink ({e})"),
                format!("source {}", source.display()),
            )),
        }
    }

    /// A `maskedPaths` entry: `/dev/null` or a read-only tmpfs where it exists.
    fn masked_difference(&self, path: &str) -> Option<Difference> {
        let name = format!("masked path {path}");
        let st = match self.stat_in(path) {
            Ok(st) => st,
            // runc skips a masked path that does not exist.
            Err(Errno::ENOENT) => return None,
            Err(e) => {
                let found = format!("an error opening it ({e})");
                return Some(Difference::new(name, found, "masked"));
            }
        };
        let kind = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT;
        if self.is_masked(path, &st, kind) {
            return None;
        }
        let found = match top(&self.table, path) {
            Some(m) => format!("a {} mount ({})", m.fstype, m.options.join(",")),
            None if kind == SFlag::S_IFDIR => "an unmasked directory".into(),
            None => "an unmasked file".into(),
        };
        Some(Difference::new(
            name,
            found,
            "masked (/dev/null or a read-only tmpfs)",
        ))
    }

    /// Whether `path` (stat `st`, of file type `kind`) is masked as runc masks: a file by
    /// `/dev/null`, a directory by a read-only tmpfs.
    fn is_masked(&self, path: &str, st: &FileStat, kind: SFlag) -> bool {
        if kind == SFlag::S_IFCHR {
            return (libc::major(st.st_rdev), libc::minor(st.st_rdev)) == DEV_NULL;
        }
        if kind != SFlag::S_IFDIR {
            return false;
        }
        let tmpfs = open_in_root(self.root.as_fd(), path)
            .and_then(|fd| nix::sys::statfs::fstatfs(fd.as_fd()))
            .map(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
            .unwrap_or(false);
        tmpfs && top(&self.table, path).is_some_and(|m| m.has("ro"))
    }

    /// A `readonlyPaths` entry: a read-only mount where it exists.
    fn readonly_difference(&self, path: &str) -> Option<Difference> {
        let name = format!("read-only path {path}");
        let found = match top(&self.table, path) {
            Some(m) if m.has("ro") => return None,
            Some(m) => m.options.join(","),
            None => match self.stat_in(path) {
                Err(Errno::ENOENT) => return None,
                _ => "no read-only mount".into(),
            },
        };
        Some(Difference::new(name, found, "ro"))
    }

    /// A sub-mount: the very host directory the shim resolved and held.
    fn held_difference(&self, h: &sub_mounts::Held) -> Option<Difference> {
        let name = format!("sub-mount {}", h.sub.mountpoint);
        let held = |want: String| format!("held host directory {} ({want})", h.host.display());
        match (
            nix::sys::stat::fstat(h.fd.as_fd()),
            self.stat_in(&h.sub.mountpoint),
        ) {
            (Ok(w), Ok(f)) => {
                not_same(&w, &f).map(|(found, want)| Difference::new(name, found, held(want)))
            }
            (w, f) => Some(Difference::new(
                name,
                format!("{:?}", f.map(|s| describe(&s))),
                held(format!("{:?}", w.map(|s| describe(&s)))),
            )),
        }
    }
}

/// `None` where `want` and `found` are the same file, else how each is described.
fn not_same(want: &FileStat, found: &FileStat) -> Option<(String, String)> {
    (!same(want, found)).then(|| (describe(found), describe(want)))
}

/// Where each of the spec's mounts is in the restored container ([`destination_in`]).
fn places(root: BorrowedFd<'_>, policy: &MountPolicy, table: &[MountInfo]) -> Vec<Option<String>> {
    policy
        .mounts
        .iter()
        .map(|m| destination_in(root, &m.destination, Some(table)))
        .collect()
}

/// What a restore holds its mounts to: the spec's policy and the sub-mounts resolved for CRIU
/// (their handles kept open until the check is done).
#[derive(Debug, Default)]
pub struct Mounts {
    pub policy: MountPolicy,
    pub held: Vec<sub_mounts::Held>,
    /// The device nodes its `/dev` must hold (`device_nodes.rs`).
    pub dev: DevPolicy,
}

impl Mounts {
    /// [`hold`] of the restored init `pid`, then its `/dev` set to the spec's device nodes.
    pub fn hold(&self, pid: i32) -> Result<()> {
        hold(pid, &self.policy, &self.held)?;
        device_nodes::present(pid, &self.dev).map(drop)
    }
}

/// At the gate's `pre-resume`: applies the spec's flags to the restored init `pid`'s mounts,
/// then checks its mount table against the spec; an error names every difference.
pub fn hold(pid: i32, policy: &MountPolicy, held: &[sub_mounts::Held]) -> Result<()> {
    let t = std::time::Instant::now();
    let table = read_table(pid)?;
    let places = places(open_root(pid)?.as_fd(), policy, &table);
    let changes = changes(policy, &places, &table);
    apply(pid, &changes)?;
    let differences = check(pid, policy, held)?;
    info!(
        pid,
        applied = changes.len(),
        differences = differences.len(),
        check_ms = t.elapsed().as_millis() as u64,
        "restored mounts held to the spec"
    );
    if differences.is_empty() {
        return Ok(());
    }
    Err(Error::FailedPrecondition(format!(
        "restore refused: the restored mounts differ from this container's spec: {}",
        crate::error::first_of(&differences, MAX_REPORTED)
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: &str) -> Spec {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn the_policy_reads_flags_masks_and_the_root() {
        let p = MountPolicy::from_spec(&spec(
            r#"{"ociVersion":"1.0.2","root":{"path":"rootfs","readonly":true},
            "mounts":[
              {"destination":"/proc","type":"proc","source":"proc","options":["nosuid","noexec","nodev"]},
              {"destination":"/data/","type":"bind","source":"/h/d","options":["rbind","rprivate","ro"]},
              {"destination":"/w","type":"bind","source":"/h/w","options":["rbind","ro","rw"]},
              {"destination":"/r","source":"/h/r","options":["rbind","rro"]}],
            "linux":{"maskedPaths":["/proc/kcore","/sys/firmware/"],"readonlyPaths":["/proc/sys"]}}"#,
        ));
        assert!(p.root_readonly);
        let m: Vec<_> = p
            .mounts
            .iter()
            .map(|m| {
                (
                    m.destination.as_str(),
                    m.bind,
                    m.source.clone(),
                    flag_names(m.set),
                    flag_names(m.clear),
                    m.recursive_ro,
                )
            })
            .collect();
        assert_eq!(
            m,
            [
                (
                    "/proc",
                    false,
                    None,
                    "nosuid,nodev,noexec".into(),
                    "".into(),
                    false
                ),
                (
                    "/data",
                    true,
                    Some("/h/d".into()),
                    "ro".into(),
                    "".into(),
                    false
                ),
                (
                    "/w",
                    true,
                    Some("/h/w".into()),
                    "".into(),
                    "ro".into(),
                    false
                ),
                (
                    "/r",
                    true,
                    Some("/h/r".into()),
                    "ro".into(),
                    "".into(),
                    true
                ),
            ]
        );
        assert_eq!(p.masked, ["/proc/kcore", "/sys/firmware"]);
        assert_eq!(p.readonly, ["/proc/sys"]);
    }

    #[test]
    fn changes_are_asked_only_of_mounts_that_are_there() {
        let p = MountPolicy::from_spec(&spec(
            r#"{"ociVersion":"1.0.2","root":{"path":"rootfs","readonly":true},
            "mounts":[
              {"destination":"/data","type":"bind","source":"/h/d","options":["rbind","ro"]},
              {"destination":"/srv","type":"bind","source":"/h/s","options":["rbind","ro"]}],
            "linux":{"readonlyPaths":["/proc/sys","/proc/bus"]}}"#,
        ));
        let table = mountinfo::parse(
            "1 0 0:1 / / rw - overlay o rw\n2 1 8:1 /d /data rw - ext4 /dev/sda rw\n3 1 0:5 /sys /proc/sys rw - proc proc rw\n",
            "t",
        )
        .unwrap();
        let places = vec![Some("/data".to_string()), None];
        let c: Vec<_> = changes(&p, &places, &table)
            .iter()
            .map(|c| (c.what.clone(), flag_names(c.set)))
            .collect();
        assert_eq!(
            c,
            [
                ("mount /data".to_string(), "ro".to_string()),
                ("read-only path /proc/sys".into(), "ro".into()),
                ("root /".into(), "ro".into()),
            ]
        );
    }

    #[test]
    fn new_mounts_are_refused_before_criu_naming_them() {
        let p = MountPolicy::from_spec(&spec(
            r#"{"ociVersion":"1.0.2","mounts":[
              {"destination":"/proc","type":"proc","source":"proc"},
              {"destination":"/data","type":"bind","source":"/h/d","options":["rbind"]},
              {"destination":"/srv","type":"bind","source":"/h/s","options":["rbind"]},
              {"destination":"/var/run/secrets","type":"bind","source":"/h/t","options":["rbind"]}]}"#,
        ));
        let t = tempfile::tempdir().unwrap();
        // No mount images: left to the pre-resume check.
        refuse_new_mounts(t.path(), t.path(), &p).unwrap();
        // The checkpoint has /run/secrets, where runc put /var/run/secrets: /var/run is a
        // symlink to /run in the image.
        let image = image_format::mountinfo::test_images::mounts_image(&[
            ("./", 0),
            ("./proc", 14),
            ("./data", 0),
            ("./run/secrets", 0),
        ]);
        std::fs::write(t.path().join("mountpoints-12.img"), image).unwrap();
        let rootfs = t.path().join("rootfs");
        std::fs::create_dir_all(rootfs.join("run/secrets")).unwrap();
        std::fs::create_dir_all(rootfs.join("var")).unwrap();
        std::os::unix::fs::symlink("/run", rootfs.join("var/run")).unwrap();
        let e = refuse_new_mounts(t.path(), &rootfs, &p)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/srv (bind of /h/s)")
                && !e.contains("/data")
                && !e.contains("secrets")
                && e.contains("empty directory"),
            "{e}"
        );
    }

    #[test]
    fn the_check_sees_this_process_mounts() {
        // This process's own table: its root is not read-only (a test host), /proc is there.
        let pid = std::process::id() as i32;
        let p = MountPolicy::from_spec(&spec(
            r#"{"ociVersion":"1.0.2","root":{"path":"rootfs","readonly":true},
            "mounts":[{"destination":"/proc","type":"proc","source":"proc"},
                      {"destination":"/no-such-mount","type":"tmpfs","source":"tmpfs"}],
            "linux":{"maskedPaths":["/no/such/path"]}}"#,
        ));
        let d = check(pid, &p, &[]).unwrap();
        let names: Vec<_> = d.iter().map(|d| d.mount.as_str()).collect();
        assert!(names.contains(&"mount /no-such-mount"), "{d:?}");
        assert!(!names.contains(&"mount /proc"), "{d:?}");
        assert!(!names.iter().any(|n| n.starts_with("masked")), "{d:?}");
        let text = d
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join("; ");
        assert!(
            text.contains("mount /no-such-mount: found no mount, the spec's tmpfs mount"),
            "{text}"
        );
    }
}
