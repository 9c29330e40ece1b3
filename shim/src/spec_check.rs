//! Holds a restore to the new container's spec.
//!
//! CRIU restores every task's credentials (uids, gids, groups, capability sets, secure bits,
//! no_new_privs), its LSM label and its seccomp filters from the checkpoint's images, never from
//! the spec of the container it restores into. Without a check, a checkpoint of a root,
//! unconfined container with added capabilities restores as exactly that into a container whose
//! spec runs as uid 1000 with no capabilities, `noNewPrivileges` and a seccomp profile.
//!
//! Two checks hold the restored tree to the new spec (`config.json`'s `process` and
//! `linux.seccomp`):
//!
//! 1. Before CRIU starts ([`check_checkpoint`]): every task's record in the checkpoint
//!    (`core-<pid>.img`: creds and seccomp mode; `seccomp.img`: the filter chains) and the
//!    manifest's record of the seccomp profile the checkpointed container ran under. The usual
//!    mismatch fails here, at once, with nothing restored.
//! 2. After CRIU has restored every task, before any of them runs ([`check_tree`]): the
//!    kernel's view of every thread of every process of the restored tree, read from
//!    `/proc/<pid>/task/<tid>/status` and `attr/current`. This check is the authoritative one:
//!    images can be forged (until they are signed), the kernel's view cannot. The gate
//!    (`verify_gate.rs`) runs it at CRIU's `pre-resume` step, where CRIU has restored every
//!    task's credentials and seccomp filters and holds every thread ptrace-stopped before its
//!    final `rt_sigreturn`; a refusal kills the tree there, so no restored instruction runs.
//!    (At `post-restore`, where the page verification waits, the tasks still have CRIU's own
//!    credentials: CRIU restores creds and seccomp only after that step.)
//!
//! What is checked, per thread (ids as the kernel shows them to the shim, so mapped through
//! the spec's user namespace mappings when it has them):
//! - uids (real, effective, saved, fs) are the spec's `user.uid`, gids the spec's `user.gid`,
//!   supplementary groups within `additionalGids` and the gid, unless the spec grants
//!   CAP_SETUID (CAP_SETGID for gids and groups): a process the spec lets change ids may
//!   legitimately have changed them. "Grants" means what a cold start holds after its exec:
//!   for uid 0 the bounding, permitted, inheritable and ambient sets, else the ambient set.
//! - every capability set within the spec's set of the same name; for uid 0, permitted and
//!   effective may also reach the bounding, inheritable and ambient sets, as the kernel gives
//!   root at exec; for any other uid, permitted and effective hold at most the ambient set
//!   (what the kernel leaves a non-root exec), whatever the spec's permitted and effective
//!   lists name.
//! - NoNewPrivs set where the spec sets `noNewPrivileges`.
//! - seccomp: where the spec has a profile, mode 2 (filter) with at least one filter. The
//!   filter is the spec's when (a) the manifest records that the checkpointed container ran
//!   under a profile whose canonical JSON digest equals the new spec's (so the filter CRIU
//!   dumped is what runc compiled from this very profile), (b) CRIU restores exactly the filters
//!   of `seccomp.img`, which the manifest's digests cover, and (c) the kernel shows each thread
//!   with as many filters as its chain in `seccomp.img` holds. What this does not prove: that
//!   the bytes of `seccomp.img` are what runc compiled. A checkpoint crafted with a permissive
//!   filter and a manifest claiming the spec's profile passes (a) to (c); only the manifest's
//!   signature, made by the dumping node, rules that out. The filter cannot be read back from
//!   the restored task here: PTRACE_SECCOMP_GET_FILTER needs the caller to be the tracer, and
//!   CRIU is.
//! - the LSM label where the node has AppArmor or SELinux and the spec names a profile or label.
//!
//! A task that is more restricted than the spec (fewer capabilities, more filters) passes.
//! A task that changed its ids through a setuid binary, where the spec allows that (no
//! `noNewPrivileges`) but grants no CAP_SETUID, is refused: the check errs on the safe side.

use std::{
    collections::{BTreeSet, HashMap, HashSet, VecDeque},
    fmt,
    panic::AssertUnwindSafe,
    path::Path,
};

use image_format::{
    criu_creds::{self, TaskRecord, SECCOMP_MODE_FILTER},
    manifest::{seccomp_profile_digest, SecurityRecord},
};
use serde_json::Value;
use tracing::info;

use crate::{
    bundle::Bundle,
    error::{first_of, Error, Result},
    verify_gate::VerifyGate,
};

/// Capability names by bit (`linux/capability.h`).
const CAP_NAMES: [&str; 41] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
];
const CAP_SETGID: u64 = 1 << 6;
const CAP_SETUID: u64 = 1 << 7;
/// The most processes and threads one check walks.
const MAX_TASKS: usize = 1 << 16;
/// The most violations one error lists.
const MAX_REPORTED: usize = 12;

/// The five capability sets, as bit masks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CapSets {
    pub bnd: u64,
    pub prm: u64,
    pub eff: u64,
    pub inh: u64,
    pub amb: u64,
}

/// An LSM the node enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lsm {
    AppArmor,
    SeLinux,
}

/// One `linux.uidMappings` / `gidMappings` entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct IdMap {
    container: u32,
    host: u32,
    size: u32,
}

/// What the new container's spec allows.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    uid: u32,
    gid: u32,
    groups: BTreeSet<u32>,
    caps: CapSets,
    no_new_privs: bool,
    /// `sha256:` of the spec's seccomp profile; `None` without one.
    seccomp: Option<String>,
    apparmor: Option<String>,
    selinux: Option<String>,
    uid_map: Vec<IdMap>,
    gid_map: Vec<IdMap>,
    /// The LSM the node enforces, if any.
    node_lsm: Option<Lsm>,
}

impl Policy {
    /// The policy of the spec in `bundle`.
    pub fn from_bundle(bundle: &Bundle) -> Result<Policy> {
        let mut policy = Policy::from_spec(bundle.json()).map_err(|e| {
            Error::InvalidArgument(format!(
                "bundle config {}: {e}",
                bundle.config_path().display()
            ))
        })?;
        policy.node_lsm = node_lsm();
        Ok(policy)
    }

    /// The policy of an OCI spec (config.json as JSON); the node's LSM is not looked up.
    pub fn from_spec(spec: &Value) -> std::result::Result<Policy, String> {
        let process = spec.get("process").unwrap_or(&Value::Null);
        let (uid, gid, groups) = user_ids(process.get("user").unwrap_or(&Value::Null))?;
        let digest = seccomp_profile_digest(spec);
        Ok(Policy {
            uid,
            gid,
            groups,
            caps: cap_sets(process.get("capabilities").unwrap_or(&Value::Null)),
            no_new_privs: process
                .get("noNewPrivileges")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            seccomp: (!digest.is_empty()).then_some(digest),
            apparmor: non_empty_text(process.get("apparmorProfile")),
            selinux: non_empty_text(process.get("selinuxLabel")),
            uid_map: id_maps(spec, "uidMappings"),
            gid_map: id_maps(spec, "gidMappings"),
            node_lsm: None,
        })
    }

    /// The host owner of a file the container sees owned by `uid`:`gid`, under the spec's
    /// user namespace mappings (the same ids without mappings); `None` where either is
    /// unmapped.
    pub fn host_owner(&self, uid: u32, gid: u32) -> Option<(u32, u32)> {
        Some((to_host(&self.uid_map, uid)?, to_host(&self.gid_map, gid)?))
    }

    /// The owner the container sees of a file the host sees owned by `uid`:`gid`, the inverse
    /// of [`Policy::host_owner`].
    pub fn container_owner(&self, uid: u32, gid: u32) -> Option<(u32, u32)> {
        Some((
            to_container(&self.uid_map, uid)?,
            to_container(&self.gid_map, gid)?,
        ))
    }

    /// With the node's LSM set to `lsm` (tests).
    pub fn with_node_lsm(mut self, lsm: Option<Lsm>) -> Policy {
        self.node_lsm = lsm;
        self
    }

    /// The capabilities a cold start of the spec holds after its exec: for uid 0 the kernel
    /// fills permitted (and effective) from the bounding, inheritable and ambient sets; any
    /// other uid keeps the ambient set only (P' = E' = ambient, with no file capabilities,
    /// which a container's exec is not granted here), and a capability is ambient only while
    /// it is permitted and inheritable too.
    fn granted(&self) -> u64 {
        if self.uid == 0 {
            self.caps.bnd | self.caps.prm | self.caps.inh | self.caps.amb
        } else {
            self.caps.amb & self.caps.prm & self.caps.inh
        }
    }

    /// Whether this policy's seccomp profile is the one the checkpoint recorded.
    fn seccomp_violation(&self, record: Option<&SecurityRecord>) -> Option<Violation> {
        let want = self.seccomp.as_ref()?;
        let found = match record {
            None => "not recorded".to_string(),
            Some(r) if r.seccomp_profile.is_empty() => "none (unconfined)".to_string(),
            Some(r) if &r.seccomp_profile == want => return None,
            Some(r) => r.seccomp_profile.clone(),
        };
        Some(Violation {
            task: "the checkpoint".into(),
            field: "seccomp profile",
            found,
            allowed: want.clone(),
            note: String::new(),
        })
    }
}

/// `process.user`'s uid, gid and groups (the gid with `additionalGids`); an absent id is 0.
fn user_ids(user: &Value) -> std::result::Result<(u32, u32, BTreeSet<u32>), String> {
    let uid = spec_id(user.get("uid").unwrap_or(&Value::Null), "process.user.uid")?;
    let gid = spec_id(user.get("gid").unwrap_or(&Value::Null), "process.user.gid")?;
    let mut groups = BTreeSet::from([gid]);
    if let Some(extra) = user.get("additionalGids").and_then(Value::as_array) {
        for g in extra {
            groups.insert(spec_id(g, "process.user.additionalGids")?);
        }
    }
    Ok((uid, gid, groups))
}

/// One id of the spec (0 when absent); `what` names it in the error.
fn spec_id(v: &Value, what: &str) -> std::result::Result<u32, String> {
    match v {
        Value::Null => Ok(0),
        v => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| format!("{what}: not a 32-bit id: {v}")),
    }
}

/// `process.capabilities`' five sets; names the shim does not know are left out.
fn cap_sets(caps: &Value) -> CapSets {
    let set = |name: &str| -> u64 {
        caps.get(name)
            .and_then(Value::as_array)
            .map(|names| {
                names
                    .iter()
                    .filter_map(Value::as_str)
                    .filter_map(cap_bit)
                    .fold(0, |acc, bit| acc | (1u64 << bit))
            })
            .unwrap_or(0)
    };
    CapSets {
        bnd: set("bounding"),
        prm: set("permitted"),
        eff: set("effective"),
        inh: set("inheritable"),
        amb: set("ambient"),
    }
}

/// A string of the spec, `None` where absent or empty.
fn non_empty_text(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
}

/// `linux.<key>` (`uidMappings`, `gidMappings`); entries missing a field are left out.
fn id_maps(spec: &Value, key: &str) -> Vec<IdMap> {
    let entry = |m: &Value| {
        let f = |k: &str| m.get(k)?.as_u64().and_then(|n| u32::try_from(n).ok());
        Some(IdMap {
            container: f("containerID")?,
            host: f("hostID")?,
            size: f("size")?,
        })
    };
    spec.pointer(&format!("/linux/{key}"))
        .and_then(Value::as_array)
        .map(|entries| entries.iter().filter_map(entry).collect())
        .unwrap_or_default()
}

/// One thread's security state, from the kernel or from the checkpoint's record.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskView {
    /// "restored task 1234 (counter)" or "checkpointed task 1 (counter)".
    pub task: String,
    /// Real, effective, saved, filesystem.
    pub uids: [u32; 4],
    pub gids: [u32; 4],
    pub groups: Vec<u32>,
    pub caps: CapSets,
    pub no_new_privs: bool,
    /// `SECCOMP_MODE_*`.
    pub seccomp_mode: u32,
    /// How many filters the thread has, when known.
    pub seccomp_filters: Option<u32>,
    /// How many filters it must have (its chain in the checkpoint), when known.
    pub expected_filters: Option<u32>,
    /// The LSM label (`attr/current`, or CRIU's record of it).
    pub lsm: Option<String>,
}

/// One field of one task beyond the spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub task: String,
    pub field: &'static str,
    pub found: String,
    pub allowed: String,
    /// What is beyond, when the values alone do not say (capability names).
    pub note: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} {} is beyond the spec's {}",
            self.task, self.field, self.found, self.allowed
        )?;
        if !self.note.is_empty() {
            write!(f, " ({})", self.note)?;
        }
        Ok(())
    }
}

/// The violations of `view` against `policy`. `kernel`: the view is the kernel's, whose ids
/// are host ids (mapped through the spec's user namespace mappings).
pub fn check_task(policy: &Policy, view: &TaskView, kernel: bool) -> Vec<Violation> {
    let (uid_map, gid_map): (&[IdMap], &[IdMap]) = if kernel {
        (&policy.uid_map, &policy.gid_map)
    } else {
        (&[], &[])
    };
    let mut out = id_violations(policy, view, uid_map, gid_map);
    out.extend(cap_violations(policy, view));
    if policy.no_new_privs && !view.no_new_privs {
        out.push(view.violation("NoNewPrivs", "0".into(), "1".into(), String::new()));
    }
    out.extend(seccomp_violation(policy, view));
    out.extend(lsm_violation(policy, view));
    out
}

impl TaskView {
    fn violation(
        &self,
        field: &'static str,
        found: String,
        allowed: String,
        note: String,
    ) -> Violation {
        Violation {
            task: self.task.clone(),
            field,
            found,
            allowed,
            note,
        }
    }
}

/// Ids separated by spaces.
fn id_list(v: &[u32]) -> String {
    v.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
}

/// The uids, gids and groups: the spec's (mapped), unless it grants `CAP_SETUID` (uids) or
/// `CAP_SETGID` (gids and groups), with which a task may change them.
fn id_violations(
    policy: &Policy,
    view: &TaskView,
    uid_map: &[IdMap],
    gid_map: &[IdMap],
) -> Vec<Violation> {
    let granted = policy.granted();
    let mut out = Vec::new();
    if granted & CAP_SETUID == 0 {
        let note = "real, effective, saved, fs; the spec grants no CAP_SETUID";
        let want = map_id(uid_map, policy.uid);
        out.extend(all_ids(view, "Uid", &view.uids, want, note));
    }
    if granted & CAP_SETGID == 0 {
        let note = "real, effective, saved, fs; the spec grants no CAP_SETGID";
        let want = map_id(gid_map, policy.gid);
        out.extend(all_ids(view, "Gid", &view.gids, want, note));
        let allowed: BTreeSet<u32> = policy.groups.iter().map(|&g| map_id(gid_map, g)).collect();
        if view.groups.iter().any(|g| !allowed.contains(g)) {
            out.push(view.violation(
                "Groups",
                format!("[{}]", id_list(&view.groups)),
                format!("[{}]", id_list(&allowed.into_iter().collect::<Vec<_>>())),
                String::new(),
            ));
        }
    }
    out
}

/// The four ids of `field` (real, effective, saved, fs) all `want`.
fn all_ids(
    view: &TaskView,
    field: &'static str,
    have: &[u32; 4],
    want: u32,
    note: &str,
) -> Option<Violation> {
    have.iter()
        .any(|&id| id != want)
        .then(|| view.violation(field, id_list(have), want.to_string(), note.into()))
}

/// The five capability sets, each within what a cold start of the spec holds.
fn cap_violations(policy: &Policy, view: &TaskView) -> Vec<Violation> {
    let c = &policy.caps;
    let granted = policy.granted();
    // Permitted and effective: what a cold start of the spec holds. For uid 0 the kernel
    // gives root the spec's sets and the bounding, inheritable and ambient ones; any other
    // uid holds only the ambient set after its exec, whatever the spec's permitted and
    // effective lists say (containerd lists its 14 defaults for uid 1000 too), so a task that
    // kept capabilities across a setresuid does not restore with them.
    let (prm, eff) = if policy.uid == 0 {
        let root_extra = c.bnd | c.inh | c.amb;
        (c.prm | root_extra, c.eff | root_extra)
    } else {
        (granted, granted)
    };
    [
        ("CapInh", view.caps.inh, c.inh),
        ("CapPrm", view.caps.prm, prm),
        ("CapEff", view.caps.eff, eff),
        ("CapBnd", view.caps.bnd, c.bnd),
        ("CapAmb", view.caps.amb, c.amb),
    ]
    .into_iter()
    .filter(|(_, have, allowed)| have & !allowed != 0)
    .map(|(field, have, allowed)| {
        view.violation(
            field,
            format!("{have:016x}"),
            format!("{allowed:016x}"),
            cap_names(have & !allowed),
        )
    })
    .collect()
}

/// With a seccomp profile in the spec: a filter, as many as the checkpoint recorded.
fn seccomp_violation(policy: &Policy, view: &TaskView) -> Option<Violation> {
    let profile = policy.seccomp.as_ref()?;
    if view.seccomp_mode != SECCOMP_MODE_FILTER {
        return Some(view.violation(
            "Seccomp",
            view.seccomp_mode.to_string(),
            "2".into(),
            format!("the spec's profile {profile} needs a filter"),
        ));
    }
    if view.seccomp_filters == Some(0) {
        return Some(view.violation(
            "Seccomp_filters",
            "0".into(),
            "1".into(),
            format!("the spec's profile {profile} needs a filter"),
        ));
    }
    let (have, want) = (view.seccomp_filters?, view.expected_filters?);
    (have != want).then(|| {
        view.violation(
            "Seccomp_filters",
            have.to_string(),
            want.to_string(),
            "not the filters the checkpoint recorded under the spec's profile".into(),
        )
    })
}

/// The LSM label the node enforces: the spec's AppArmor profile or SELinux label.
fn lsm_violation(policy: &Policy, view: &TaskView) -> Option<Violation> {
    let label = view.lsm.as_ref()?;
    match policy.node_lsm? {
        Lsm::AppArmor => {
            let want = policy.apparmor.as_deref().filter(|p| *p != "unconfined")?;
            let have = apparmor_name(label);
            (have != want).then(|| {
                view.violation(
                    "AppArmor profile",
                    have.to_string(),
                    want.to_string(),
                    String::new(),
                )
            })
        }
        Lsm::SeLinux => {
            let want = policy.selinux.as_ref()?;
            (label != want).then(|| {
                view.violation("SELinux label", label.clone(), want.clone(), String::new())
            })
        }
    }
}

/// What the pre-check learnt for the kernel check: each checkpointed thread's filter count, by
/// its pid in the container.
#[derive(Debug, Clone, Default)]
pub struct Expected {
    pub filters: HashMap<u32, u32>,
}

/// Checks the checkpoint's own record (CRIU's `core-*.img` and `seccomp.img`, and the
/// manifest's security record) against `policy`, before CRIU starts.
pub fn check_checkpoint(
    dir: &Path,
    policy: &Policy,
    record: Option<&SecurityRecord>,
) -> Result<Expected> {
    let tasks = criu_creds::read_tasks(dir)?;
    let seccomp = criu_creds::read_seccomp(dir)?;
    let mut violations: Vec<Violation> = policy.seccomp_violation(record).into_iter().collect();
    let mut expected = Expected::default();
    for t in &tasks {
        let Some(view) = record_view(t, &seccomp) else {
            continue;
        };
        if let Some(n) = view.expected_filters {
            expected.filters.insert(t.pid, n);
        }
        violations.extend(check_task(policy, &view, false));
    }
    refuse_if_any(violations, "the checkpoint's record")?;
    Ok(expected)
}

/// The view of one checkpointed thread; `None` for one CRIU restores without creds (a zombie).
fn record_view(t: &TaskRecord, seccomp: &criu_creds::SeccompFilters) -> Option<TaskView> {
    let c = t.creds.as_ref()?;
    let chain = match (t.seccomp_mode, t.seccomp_filter) {
        (SECCOMP_MODE_FILTER, Some(i)) => seccomp
            .chain(i)
            .map(|c| u32::try_from(c.len()).unwrap_or(u32::MAX)),
        _ => None,
    };
    Some(
        TaskView {
            task: format!("checkpointed task {} ({})", t.pid, t.comm),
            uids: c.uids,
            gids: c.gids,
            groups: c.groups.clone(),
            caps: CapSets {
                bnd: c.cap_bnd,
                prm: c.cap_prm,
                eff: c.cap_eff,
                inh: c.cap_inh,
                amb: c.cap_amb,
            },
            no_new_privs: c.no_new_privs,
            seccomp_mode: t.seccomp_mode,
            seccomp_filters: chain,
            expected_filters: None,
            lsm: c.lsm_profile.clone(),
        }
        .with_expected(chain),
    )
}

impl TaskView {
    fn with_expected(mut self, n: Option<u32>) -> TaskView {
        self.expected_filters = n;
        self
    }
}

/// Checks every thread of every process of the restored tree below (and with) `root`, a host
/// pid, against `policy`. On a violation the error names the task, the field and both values.
pub fn check_tree(root: i32, policy: &Policy, expected: &Expected) -> Result<()> {
    let tree = walk_tree(root)?;
    let mut violations = Vec::new();
    for (pid, tids) in &tree {
        for tid in tids {
            let view = read_kernel_view(*pid, *tid, expected)?;
            violations.extend(check_task(policy, &view, true));
        }
    }
    refuse_if_any(violations, "the restored tree")
}

fn refuse_if_any(violations: Vec<Violation>, what: &str) -> Result<()> {
    if violations.is_empty() {
        return Ok(());
    }
    Err(Error::FailedPrecondition(format!(
        "restore refused: {what} is beyond this container's spec: {}",
        first_of(&violations, MAX_REPORTED)
    )))
}

/// Every process of the tree below (and with) `root`, each with its threads, root first.
/// `/proc/<pid>/task/<tid>/children` per thread: a child belongs to the thread that forked it.
pub fn walk_tree(root: i32) -> Result<Vec<(i32, Vec<i32>)>> {
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    let mut queue = VecDeque::from([root]);
    let mut count = 0usize;
    while let Some(pid) = queue.pop_front() {
        if !seen.insert(pid) {
            continue;
        }
        let task_dir = format!("/proc/{pid}/task");
        let mut tids: Vec<i32> = std::fs::read_dir(&task_dir)
            .map_err(Error::io(format!("list {task_dir} of the restored tree")))?
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect();
        tids.sort_unstable();
        for tid in &tids {
            let path = format!("/proc/{pid}/task/{tid}/children");
            let children = std::fs::read_to_string(&path)
                .map_err(Error::io(format!("read {path} of the restored tree")))?;
            queue.extend(
                children
                    .split_whitespace()
                    .filter_map(|c| c.parse::<i32>().ok()),
            );
        }
        count += tids.len();
        if count > MAX_TASKS {
            return Err(Error::FailedPrecondition(format!(
                "restore refused: the restored tree has more than {MAX_TASKS} threads"
            )));
        }
        out.push((pid, tids));
    }
    Ok(out)
}

/// At the gate's `pre-resume`: waits for CRIU's restored root, checks the tree and holds its
/// mounts to the spec (`mount_check.rs`), kills it when it is beyond the spec, and gives the
/// gate its verdict. `None` when the restore ended
/// without reaching `pre-resume` (the gate was released with [`VerifyGate::no_root`]).
pub fn hold_at_gate(
    gate: &VerifyGate,
    policy: &Policy,
    expected: &Expected,
    mounts: &crate::mount_check::Mounts,
) -> Option<Result<()>> {
    let root = match gate.wait_root() {
        Ok(None) => return None,
        Ok(Some(pid)) => pid,
        Err(e) => {
            let _ = gate.allow(false);
            return Some(Err(e));
        }
    };
    let t = std::time::Instant::now();
    let mut verdict = std::panic::catch_unwind(AssertUnwindSafe(|| {
        check_tree(root, policy, expected).and_then(|()| mounts.hold(root))
    }))
    .unwrap_or_else(|_| {
        Err(Error::FailedPrecondition(
            "restore refused: the check of the restored tree panicked".into(),
        ))
    });
    if verdict.is_err() {
        // Killed before the verdict: whatever CRIU does next, no restored task runs.
        kill_restored(root);
    }
    if let Err(e) = gate.allow(verdict.is_ok()) {
        kill_restored(root);
        verdict = verdict.and(Err(e));
    }
    info!(
        root,
        allowed = verdict.is_ok(),
        check_ms = t.elapsed().as_millis() as u64,
        "restored tree held to the spec"
    );
    Some(verdict)
}

/// Kills the restored tree below (and with) `root`.
pub fn kill_restored(root: i32) {
    match walk_tree(root) {
        Ok(tree) => kill_tree(&tree),
        Err(_) => kill_tree(&[(root, Vec::new())]),
    }
}

/// A refusal with what became of the restored tasks.
pub fn with_note(e: Error, note: &str) -> Error {
    match e {
        Error::FailedPrecondition(m) => Error::FailedPrecondition(format!("{m}; {note}")),
        other => Error::FailedPrecondition(format!("restore refused: {other}; {note}")),
    }
}

/// The security record of the container whose bundle is `bundle`, for its checkpoint's
/// manifest.
pub fn security_record(bundle: &Bundle) -> SecurityRecord {
    SecurityRecord::from_spec(bundle.json())
}

/// SIGKILLs every process of `tree` (best effort: each may be gone already).
pub fn kill_tree(tree: &[(i32, Vec<i32>)]) {
    for (pid, _) in tree {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// The kernel's view of thread `tid` of process `pid`.
fn read_kernel_view(pid: i32, tid: i32, expected: &Expected) -> Result<TaskView> {
    let path = format!("/proc/{pid}/task/{tid}/status");
    let status = std::fs::read_to_string(&path)
        .map_err(Error::io(format!("read {path} of the restored tree")))?;
    let lsm = std::fs::read(format!("/proc/{pid}/task/{tid}/attr/current"))
        .ok()
        .map(|b| {
            String::from_utf8_lossy(&b)
                .trim_end_matches(['\0', '\n'])
                .to_string()
        })
        .filter(|s| !s.is_empty());
    parse_status(&status, lsm, expected)
        .map_err(|e| Error::FailedPrecondition(format!("restore refused: {path}: {e}")))
}

/// A `/proc/<pid>/status` as a [`TaskView`].
pub fn parse_status(
    status: &str,
    lsm: Option<String>,
    expected: &Expected,
) -> std::result::Result<TaskView, String> {
    let mut fields = HashMap::new();
    for line in status.lines() {
        if let Some((k, v)) = line.split_once(':') {
            fields.insert(k.trim(), v.trim());
        }
    }
    let get = |k: &str| fields.get(k).copied().ok_or_else(|| format!("no {k} line"));
    let four = |k: &str| -> std::result::Result<[u32; 4], String> {
        let v: Vec<u32> = get(k)?
            .split_whitespace()
            .map(|x| x.parse().map_err(|_| format!("{k}: {x:?}")))
            .collect::<std::result::Result<_, _>>()?;
        v.try_into().map_err(|_| format!("{k}: not four ids"))
    };
    let hex = |k: &str| -> std::result::Result<u64, String> {
        u64::from_str_radix(get(k)?, 16).map_err(|_| format!("{k}: not hex"))
    };
    let num = |k: &str| -> std::result::Result<u32, String> {
        get(k)?.parse().map_err(|_| format!("{k}: not a number"))
    };
    let groups = get("Groups")?
        .split_whitespace()
        .map(|x| x.parse().map_err(|_| format!("Groups: {x:?}")))
        .collect::<std::result::Result<Vec<u32>, _>>()?;
    let pid: u32 = num("Pid")?;
    // The pid in the container's own namespace names the checkpoint's record of the thread.
    let vpid = get("NSpid")
        .ok()
        .and_then(|v| v.split_whitespace().last())
        .and_then(|v| v.parse::<u32>().ok());
    let name = get("Name").unwrap_or("?");
    let task = match vpid {
        Some(v) if v != pid => format!("restored task {pid} ({name}, pid {v} in the container)"),
        _ => format!("restored task {pid} ({name})"),
    };
    Ok(TaskView {
        task,
        uids: four("Uid")?,
        gids: four("Gid")?,
        groups,
        caps: CapSets {
            bnd: hex("CapBnd")?,
            prm: hex("CapPrm")?,
            eff: hex("CapEff")?,
            inh: hex("CapInh")?,
            amb: hex("CapAmb")?,
        },
        no_new_privs: num("NoNewPrivs")? != 0,
        seccomp_mode: num("Seccomp")?,
        seccomp_filters: get("Seccomp_filters").ok().and_then(|v| v.parse().ok()),
        expected_filters: vpid.and_then(|v| expected.filters.get(&v).copied()),
        lsm,
    })
}

/// The LSM the node enforces on tasks: the first of AppArmor and SELinux in
/// `/sys/kernel/security/lsm` that is switched on.
pub fn node_lsm() -> Option<Lsm> {
    let list = std::fs::read_to_string("/sys/kernel/security/lsm").unwrap_or_default();
    for name in list.trim().split(',') {
        match name {
            "apparmor"
                if std::fs::read_to_string("/sys/module/apparmor/parameters/enabled")
                    .is_ok_and(|v| v.trim() == "Y") =>
            {
                return Some(Lsm::AppArmor)
            }
            "selinux" if Path::new("/sys/fs/selinux/enforce").exists() => {
                return Some(Lsm::SeLinux)
            }
            _ => {}
        }
    }
    None
}

/// The profile name of an AppArmor label (`name (enforce)`).
fn apparmor_name(label: &str) -> &str {
    match label.rsplit_once(" (") {
        Some((name, mode)) if mode.ends_with(')') => name,
        _ => label,
    }
}

fn map_id(maps: &[IdMap], id: u32) -> u32 {
    // Unmapped ids show as the overflow id.
    to_host(maps, id).unwrap_or(65534)
}

/// The host id of the container's `id` under `maps` (the same id without mappings); `None`
/// where no mapping covers it.
fn to_host(maps: &[IdMap], id: u32) -> Option<u32> {
    through(maps, id, |m| m.container, |m| m.host)
}

/// The container's id of the host's `id` under `maps`, the inverse of [`to_host`].
fn to_container(maps: &[IdMap], id: u32) -> Option<u32> {
    through(maps, id, |m| m.host, |m| m.container)
}

/// `id` from the side `from` of the first of `maps` that covers it to its side `to` (the same
/// id without mappings).
fn through(maps: &[IdMap], id: u32, from: fn(&IdMap) -> u32, to: fn(&IdMap) -> u32) -> Option<u32> {
    if maps.is_empty() {
        return Some(id);
    }
    maps.iter()
        .find(|m| id >= from(m) && id - from(m) < m.size)
        .map(|m| to(m) + (id - from(m)))
}

fn cap_bit(name: &str) -> Option<u32> {
    let upper = name.to_ascii_uppercase();
    let full = if upper.starts_with("CAP_") {
        upper
    } else {
        format!("CAP_{upper}")
    };
    CAP_NAMES.iter().position(|n| *n == full).map(|i| i as u32)
}

/// `cap_sys_admin, cap_sys_module` for the bits of `mask`.
fn cap_names(mask: u64) -> String {
    (0..64)
        .filter(|b| mask & (1u64 << b) != 0)
        .map(|b| {
            CAP_NAMES
                .get(b as usize)
                .map(|n| n.to_ascii_lowercase())
                .unwrap_or_else(|| format!("cap_{b}"))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// containerd's default capabilities (CapBnd 00000000a80425fb).
    const DEFAULT_CAPS: [&str; 14] = [
        "CAP_CHOWN",
        "CAP_DAC_OVERRIDE",
        "CAP_FSETID",
        "CAP_FOWNER",
        "CAP_MKNOD",
        "CAP_NET_RAW",
        "CAP_SETGID",
        "CAP_SETUID",
        "CAP_SETFCAP",
        "CAP_SETPCAP",
        "CAP_NET_BIND_SERVICE",
        "CAP_SYS_CHROOT",
        "CAP_KILL",
        "CAP_AUDIT_WRITE",
    ];

    fn spec(uid: u32, extra_caps: &[&str], nnp: bool, seccomp: bool) -> Value {
        let caps: Vec<&str> = DEFAULT_CAPS.iter().chain(extra_caps).copied().collect();
        let mut s = json!({
            "process": {
                "user": {"uid": uid, "gid": uid, "additionalGids": [uid, 10]},
                "capabilities": {
                    "bounding": caps, "permitted": caps, "effective": caps
                },
                "noNewPrivileges": nnp,
                "apparmorProfile": "cri-containerd.apparmor.d"
            },
            "linux": {}
        });
        if seccomp {
            s["linux"]["seccomp"] = json!({
                "defaultAction": "SCMP_ACT_ERRNO",
                "architectures": ["SCMP_ARCH_X86_64"],
                "syscalls": [{"names": ["read", "write"], "action": "SCMP_ACT_ALLOW"}]
            });
        }
        s
    }

    /// The issue's case: what a restored root, unconfined task with SYS_ADMIN and SYS_MODULE
    /// shows in /proc/<pid>/status.
    const ATTACKER_STATUS: &str = "Name:\tcounter\nUmask:\t0022\nState:\tt (tracing stop)\n\
        Tgid:\t4242\nNgid:\t0\nPid:\t4242\nPPid:\t4200\nTracerPid:\t4100\n\
        Uid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\nFDSize:\t64\nGroups:\t0 10 \nNStgid:\t4242\t1\n\
        NSpid:\t4242\t1\nNSpgid:\t4242\t1\nNSsid:\t4242\t1\nThreads:\t1\n\
        CapInh:\t0000000000000000\nCapPrm:\t00000000a82525fb\nCapEff:\t00000000a82525fb\n\
        CapBnd:\t00000000a82525fb\nCapAmb:\t0000000000000000\nNoNewPrivs:\t0\nSeccomp:\t0\n\
        Seccomp_filters:\t0\nSpeculation_Store_Bypass:\tthread vulnerable\n";

    /// What a cold start of the restricted spec shows.
    const COLD_STATUS: &str = "Name:\tcounter\nPid:\t5000\nNSpid:\t5000\t1\n\
        Uid:\t1000\t1000\t1000\t1000\nGid:\t1000\t1000\t1000\t1000\nGroups:\t10 1000 \n\
        CapInh:\t0000000000000000\nCapPrm:\t0000000000000000\nCapEff:\t0000000000000000\n\
        CapBnd:\t00000000a80425fb\nCapAmb:\t0000000000000000\nNoNewPrivs:\t1\nSeccomp:\t2\n\
        Seccomp_filters:\t1\n";

    fn restricted() -> Policy {
        Policy::from_spec(&spec(1000, &[], true, true)).unwrap()
    }

    #[test]
    fn the_default_capabilities_are_the_issues_mask() {
        let p = restricted();
        assert_eq!(p.caps.bnd, 0xa804_25fb);
        let attacker = Policy::from_spec(&spec(0, &["CAP_SYS_ADMIN", "SYS_MODULE"], false, false));
        assert_eq!(attacker.unwrap().caps.bnd, 0xa825_25fb);
    }

    #[test]
    fn the_issues_case_is_refused_naming_every_field() {
        let view = parse_status(ATTACKER_STATUS, None, &Expected::default()).unwrap();
        let v = check_task(&restricted(), &view, true);
        let fields: Vec<&str> = v.iter().map(|v| v.field).collect();
        for f in [
            "Uid",
            "Gid",
            "CapPrm",
            "CapEff",
            "CapBnd",
            "NoNewPrivs",
            "Seccomp",
        ] {
            assert!(fields.contains(&f), "{f} missing from {fields:?}");
        }
        let bnd = v.iter().find(|v| v.field == "CapBnd").unwrap().to_string();
        assert_eq!(
            bnd,
            "restored task 4242 (counter, pid 1 in the container): CapBnd 00000000a82525fb \
             is beyond the spec's 00000000a80425fb (cap_sys_module, cap_sys_admin)"
        );
        let uid = v.iter().find(|v| v.field == "Uid").unwrap().to_string();
        assert!(
            uid.contains("Uid 0 0 0 0 is beyond the spec's 1000"),
            "{uid}"
        );
    }

    #[test]
    fn a_cold_start_of_the_same_spec_passes() {
        let view = parse_status(COLD_STATUS, None, &Expected::default()).unwrap();
        assert_eq!(check_task(&restricted(), &view, true), vec![]);
        // And a root container restored into its own spec.
        let root = Policy::from_spec(&spec(0, &["CAP_SYS_ADMIN"], false, false)).unwrap();
        let mut view = parse_status(ATTACKER_STATUS, None, &Expected::default()).unwrap();
        view.caps.bnd &= !(1 << 16);
        view.caps.prm = view.caps.bnd;
        view.caps.eff = view.caps.bnd;
        assert_eq!(check_task(&root, &view, true), vec![]);
        // ... but not with CAP_SYS_MODULE, which its spec does not add.
        let view = parse_status(ATTACKER_STATUS, None, &Expected::default()).unwrap();
        let v = check_task(&root, &view, true);
        assert_eq!(v.len(), 3, "{v:?}");
        assert!(v.iter().all(|v| v.note == "cap_sys_module"), "{v:?}");
    }

    #[test]
    fn ids_are_free_only_with_setuid_and_setgid_granted() {
        // uid 1000 with CAP_SETUID in the spec's sets, but not ambient: not granted.
        let p = restricted();
        let mut view = parse_status(COLD_STATUS, None, &Expected::default()).unwrap();
        view.uids[1] = 0;
        view.groups.push(0);
        let v = check_task(&p, &view, true);
        assert_eq!(
            v.iter().map(|v| v.field).collect::<Vec<_>>(),
            vec!["Uid", "Groups"]
        );
        // A root spec grants CAP_SETUID and CAP_SETGID: a task that switched ids passes.
        let root = Policy::from_spec(&spec(0, &[], false, false)).unwrap();
        let mut view = parse_status(COLD_STATUS, None, &Expected::default()).unwrap();
        view.groups = vec![4, 5, 6];
        assert_eq!(check_task(&root, &view, true), vec![]);
    }

    #[test]
    fn seccomp_needs_the_spec_filter() {
        let p = restricted();
        let expected = Expected {
            filters: HashMap::from([(1, 2)]),
        };
        // One filter where the checkpoint recorded two under the spec's profile.
        let view = parse_status(COLD_STATUS, None, &expected).unwrap();
        let v = check_task(&p, &view, true);
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(v[0].field, "Seccomp_filters");
        let view = parse_status(
            &COLD_STATUS.replace("Seccomp:\t2", "Seccomp:\t0"),
            None,
            &expected,
        );
        let v = check_task(&p, &view.unwrap(), true);
        assert_eq!(v[0].field, "Seccomp");
        assert!(
            v[0].to_string()
                .contains("Seccomp 0 is beyond the spec's 2"),
            "{}",
            v[0]
        );

        // The profile record: the same profile passes, another or none is refused.
        let digest = seccomp_profile_digest(&spec(1000, &[], true, true));
        assert!(digest.starts_with("sha256:"));
        let same = SecurityRecord {
            seccomp_profile: digest.clone(),
        };
        assert!(p.seccomp_violation(Some(&same)).is_none());
        let none = SecurityRecord::default();
        let v = p.seccomp_violation(Some(&none)).unwrap().to_string();
        assert!(
            v.contains("seccomp profile none (unconfined) is beyond"),
            "{v}"
        );
        assert!(p.seccomp_violation(None).is_some());
        // Key order does not change the digest; a changed rule does.
        let mut other = spec(1000, &[], true, true);
        let reordered: Value =
            serde_json::from_str(&serde_json::to_string(&other).unwrap()).unwrap();
        assert_eq!(seccomp_profile_digest(&reordered), digest);
        other["linux"]["seccomp"]["syscalls"][0]["names"] = json!(["read", "write", "mount"]);
        assert_ne!(seccomp_profile_digest(&other), digest);
        // A spec without a profile asks nothing of seccomp.
        let open = Policy::from_spec(&spec(1000, &[], true, false)).unwrap();
        assert!(open.seccomp_violation(None).is_none());
    }

    #[test]
    fn user_namespace_ids_are_mapped_for_the_kernel_view() {
        let mut s = spec(1000, &[], true, false);
        s["linux"]["uidMappings"] = json!([{"containerID": 0, "hostID": 100000, "size": 65536}]);
        s["linux"]["gidMappings"] = json!([{"containerID": 0, "hostID": 100000, "size": 65536}]);
        let p = Policy::from_spec(&s).unwrap();
        let host = COLD_STATUS
            .replace("\t1000", "\t101000")
            .replace("10 1000", "100010 101000");
        let view = parse_status(&host, None, &Expected::default()).unwrap();
        assert_eq!(check_task(&p, &view, true), vec![]);
        // The checkpoint's record holds the ids inside the namespace.
        let view = parse_status(COLD_STATUS, None, &Expected::default()).unwrap();
        assert_eq!(check_task(&p, &view, false), vec![]);
    }

    #[test]
    fn lsm_labels_are_checked_where_the_node_has_the_lsm() {
        let p = restricted().with_node_lsm(Some(Lsm::AppArmor));
        let ok = parse_status(
            COLD_STATUS,
            Some("cri-containerd.apparmor.d (enforce)".into()),
            &Expected::default(),
        );
        assert_eq!(check_task(&p, &ok.unwrap(), true), vec![]);
        let bad = parse_status(COLD_STATUS, Some("unconfined".into()), &Expected::default());
        let v = check_task(&p, &bad.unwrap(), true);
        assert_eq!(v[0].field, "AppArmor profile");
        // Without the LSM on the node, the label is not checked.
        let p = restricted();
        let bad = parse_status(COLD_STATUS, Some("unconfined".into()), &Expected::default());
        assert_eq!(check_task(&p, &bad.unwrap(), true), vec![]);
    }

    #[test]
    fn the_checkpoints_record_is_checked_before_criu() {
        use image_format::criu_creds::test_images::{
            core_image, core_image_with_caps, seccomp_image,
        };
        let dir = tempfile::tempdir().unwrap();
        // A root, unconfined task with SYS_ADMIN and SYS_MODULE.
        std::fs::write(
            dir.path().join("core-1.img"),
            core_image(0, 0xa825_25fb, false, None),
        )
        .unwrap();
        let err = check_checkpoint(dir.path(), &restricted(), Some(&SecurityRecord::default()))
            .unwrap_err()
            .to_string();
        for part in [
            "the checkpoint: seccomp profile none (unconfined) is beyond the spec's sha256:",
            "checkpointed task 1 (counter): Uid 0 0 0 0 is beyond the spec's 1000",
            "CapBnd 00000000a82525fb is beyond the spec's 00000000a80425fb (cap_sys_module, cap_sys_admin)",
        ] {
            assert!(err.contains(part), "{part:?} not in {err}");
        }
        // The restricted container's own checkpoint passes, and yields its filter count: a
        // non-root task holds no permitted or effective capability (its spec has no ambient).
        let s = spec(1000, &[], true, true);
        let p = Policy::from_spec(&s).unwrap();
        std::fs::write(
            dir.path().join("core-1.img"),
            core_image_with_caps(1000, 0, 0xa804_25fb, &[10, 1000], true, Some(0)),
        )
        .unwrap();
        std::fs::write(
            dir.path().join("seccomp.img"),
            seccomp_image(&[(b"bpf", None)]),
        )
        .unwrap();
        let record = SecurityRecord::from_spec(&s);
        let expected = check_checkpoint(dir.path(), &p, Some(&record)).unwrap();
        assert_eq!(expected.filters.get(&1), Some(&1));
    }

    /// The spec's permitted and effective lists do not bound a non-root task: a cold start
    /// holds only the ambient set after its exec.
    #[test]
    fn a_non_root_task_holds_at_most_the_ambient_set() {
        let p = restricted();
        // What a root task that kept its capabilities across setresuid(1000) shows: the
        // spec's 14 default capabilities permitted and effective.
        let kept = COLD_STATUS
            .replace("CapPrm:\t0000000000000000", "CapPrm:\t00000000a80425fb")
            .replace("CapEff:\t0000000000000000", "CapEff:\t00000000a80425fb");
        let view = parse_status(&kept, None, &Expected::default()).unwrap();
        let v = check_task(&p, &view, true);
        assert_eq!(
            v.iter().map(|v| v.field).collect::<Vec<_>>(),
            vec!["CapPrm", "CapEff"],
            "{v:?}"
        );
        assert!(
            v[0].to_string()
                .contains("CapPrm 00000000a80425fb is beyond the spec's 0000000000000000"),
            "{}",
            v[0]
        );
        // A spec with NET_BIND_SERVICE ambient (and inheritable, as the kernel needs): a task
        // holding just that passes, one holding more does not.
        let mut s = spec(1000, &[], true, true);
        s["process"]["capabilities"]["ambient"] = json!(["CAP_NET_BIND_SERVICE"]);
        s["process"]["capabilities"]["inheritable"] = json!(["CAP_NET_BIND_SERVICE"]);
        let p = Policy::from_spec(&s).unwrap();
        let ambient = COLD_STATUS
            .replace("CapInh:\t0000000000000000", "CapInh:\t0000000000000400")
            .replace("CapPrm:\t0000000000000000", "CapPrm:\t0000000000000400")
            .replace("CapEff:\t0000000000000000", "CapEff:\t0000000000000400")
            .replace("CapAmb:\t0000000000000000", "CapAmb:\t0000000000000400");
        let view = parse_status(&ambient, None, &Expected::default()).unwrap();
        assert_eq!(check_task(&p, &view, true), vec![]);
        let more = ambient.replace("CapPrm:\t0000000000000400", "CapPrm:\t0000000000000401");
        let view = parse_status(&more, None, &Expected::default()).unwrap();
        let v = check_task(&p, &view, true);
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!((v[0].field, v[0].note.as_str()), ("CapPrm", "cap_chown"));
        // Ambient without inheritable is not held by a cold start either.
        s["process"]["capabilities"]["inheritable"] = json!([]);
        let p = Policy::from_spec(&s).unwrap();
        let view = parse_status(&ambient, None, &Expected::default()).unwrap();
        let fields: Vec<&str> = check_task(&p, &view, true)
            .iter()
            .map(|v| v.field)
            .collect();
        assert!(
            fields.contains(&"CapPrm") && fields.contains(&"CapEff"),
            "{fields:?}"
        );
    }

    /// The same rule through the pre-CRIU check of the checkpoint's own record.
    #[test]
    fn a_non_root_checkpoint_with_the_spec_lists_permitted_is_refused_before_criu() {
        use image_format::criu_creds::test_images::{core_image_with_caps, seccomp_image};
        let dir = tempfile::tempdir().unwrap();
        let s = spec(1000, &[], true, true);
        let p = Policy::from_spec(&s).unwrap();
        std::fs::write(
            dir.path().join("seccomp.img"),
            seccomp_image(&[(b"bpf", None)]),
        )
        .unwrap();
        let record = SecurityRecord::from_spec(&s);
        std::fs::write(
            dir.path().join("core-1.img"),
            core_image_with_caps(1000, 0xa804_25fb, 0xa804_25fb, &[10, 1000], true, Some(0)),
        )
        .unwrap();
        let err = check_checkpoint(dir.path(), &p, Some(&record))
            .unwrap_err()
            .to_string();
        for part in [
            "checkpointed task 1 (counter): CapPrm 00000000a80425fb is beyond the spec's 0000000000000000",
            "CapEff 00000000a80425fb is beyond the spec's 0000000000000000",
        ] {
            assert!(err.contains(part), "{part:?} not in {err}");
        }
        std::fs::write(
            dir.path().join("core-1.img"),
            core_image_with_caps(1000, 0, 0xa804_25fb, &[10, 1000], true, Some(0)),
        )
        .unwrap();
        assert!(check_checkpoint(dir.path(), &p, Some(&record)).is_ok());
    }

    #[test]
    fn a_tree_is_walked_with_every_thread() {
        // A tree that holds still, as a restored tree does at pre-resume: a shell with two
        // sleeping children (the test harness's own threads come and go).
        let mut sh = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & sleep 30 & wait"])
            .spawn()
            .unwrap();
        let root = sh.id() as i32;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let tree = loop {
            let tree = walk_tree(root).unwrap();
            if tree.len() == 3 || std::time::Instant::now() > deadline {
                break tree;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let _ = std::process::Command::new("pkill")
            .args(["-P", &root.to_string()])
            .status();
        let _ = sh.kill();
        let _ = sh.wait();
        assert_eq!(tree.len(), 3, "{tree:?}");
        assert_eq!(tree[0], (root, vec![root]));
        for (pid, tids) in &tree[1..] {
            assert_eq!(tids, &vec![*pid], "a sleep has one thread: {tree:?}");
        }
    }
}
