//! Host memory for the device memory a GPU checkpoint stages, before any device lock.
//!
//! `cuCheckpointProcessCheckpoint` moves a process's device memory into the process's own host
//! memory, which the kernel charges to the container's memory cgroup; a restore brings that
//! copy back with the process's other pages before the driver reads it onto the GPU. A cgroup
//! without that much room OOM-kills the container the checkpoint was meant to save. So, before
//! the lock (and before CRIU at a restore), the bytes the driver will stage are held to the room
//! of the container's memory cgroup and of every cgroup above it (limit less use), and to the
//! node's `MemAvailable`. Where they do not fit the step is refused, naming the container, the
//! cgroup, the limit, the use and the bytes needed, and nothing is touched; or, with the handler
//! option `RaiseMemoryLimit` and only where the container's own cgroup is the short one, its
//! limit is raised by what is needed for the length of the device steps. A cgroup above the
//! container's (pod, QoS class, node) is shared and is never written: where one of them is
//! short the step is refused with or without the option.
//!
//! The raised limit is put back after the device steps have brought the staged memory back onto
//! the GPUs, or the process has exited ([`HostMemory::put_back`]): once what the cgroup holds
//! beyond reclaimable cache fits under it, and after [`PUT_BACK_WAIT`] regardless. What is then
//! above the limit is the tenant's own (the container was not frozen while the limit was
//! raised): on cgroup v2 the kernel reclaims and, failing that, OOM-kills inside that cgroup; on
//! v1 the write fails (`EBUSY`), is logged as a warning and is tried again at every later step
//! and at the container's exit.
//!
//! The container's cgroup is found from the spec's `linux.cgroupsPath` as runc reads it
//! ([`runc_cgroup`]), never from `/proc/<pid>/cgroup` of a process of the container (which can
//! move itself into a child cgroup it made). cgroups-rs finds the hierarchy, expands systemd
//! slices and writes the limits; the arithmetic and the walk up the hierarchy are here.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cgroups_rs::fs::{
    cgroup::get_cgroups_relative_paths, hierarchies, memory::MemController, parse_max_value,
    MaxValue,
};
use image_format::manifest::{self, Manifest};
use procfs::Current;
use tracing::{info, info_span, warn};

use crate::bundle::Bundle;
use crate::device::Holder;
use crate::error::{Error, Result};
use crate::options::RuntimeOptions;
use crate::stats::dir_of;

/// Host bytes staged per device byte, as `STAGED_NUM / STAGED_DEN`: on an H200 a process's RSS
/// grew by 1.03 to 1.45 times its device bytes at the checkpoint (the copy, and the driver's
/// buffers around it); 3/2 is the worst measured, rounded up.
const STAGED_NUM: u64 = 3;
const STAGED_DEN: u64 = 2;
/// Per GPU process: the host side of its CUDA context that a checkpoint or restore grows (the
/// driver's records and pinned transfer buffers), which is most of the growth where a process
/// holds little device memory.
pub const CONTEXT_BYTES: u64 = 64 << 20;
/// How long [`HostMemory::put_back`] waits for the staged copy to leave a cgroup before it
/// lowers the limit again regardless.
const PUT_BACK_WAIT: Duration = Duration::from_secs(10);
/// v1 writes "unlimited" as the largest page-aligned i64.
const V1_UNLIMITED: u64 = i64::MAX as u64 & !4095;

/// The host bytes the driver stages for `processes` GPU processes holding `device_bytes` of
/// device memory between them.
pub fn staged_bytes(device_bytes: u64, processes: usize) -> u64 {
    (device_bytes / STAGED_DEN)
        .saturating_mul(STAGED_NUM)
        .saturating_add(((device_bytes % STAGED_DEN) * STAGED_NUM).div_ceil(STAGED_DEN))
        .saturating_add(CONTEXT_BYTES.saturating_mul(processes as u64))
}

/// One memory cgroup's limit (`None`: unlimited) and use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Level {
    pub dir: PathBuf,
    pub limit: Option<u64>,
    pub usage: u64,
}

impl Level {
    /// Limit less use (`None`: no limit).
    pub fn room(&self) -> Option<u64> {
        self.limit.map(|l| l.saturating_sub(self.usage))
    }
}

/// What holding `needed` bytes to a cgroup hierarchy and the node found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Fits,
    /// These levels (index into the list, the limit that would make room) are short.
    Short(Vec<(usize, u64)>),
    /// The node has only `available` bytes (`MemAvailable`): no limit can make room.
    Node {
        available: u64,
    },
}

/// `needed` bytes against each of `levels` and the node's `available` bytes.
pub fn verdict(needed: u64, levels: &[Level], available: Option<u64>) -> Verdict {
    if let Some(available) = available.filter(|a| needed > *a) {
        return Verdict::Node { available };
    }
    let short: Vec<(usize, u64)> = levels
        .iter()
        .enumerate()
        .filter_map(|(i, l)| {
            let room = l.room()?;
            (needed > room).then(|| (i, page_up(l.usage.saturating_add(needed))))
        })
        .collect();
    if short.is_empty() {
        Verdict::Fits
    } else {
        Verdict::Short(short)
    }
}

fn page_up(b: u64) -> u64 {
    b.saturating_add(4095) & !4095
}

/// `123456789 bytes (117.7 MiB)`.
pub fn bytes(b: u64) -> String {
    format!("{b} bytes ({:.1} MiB)", b as f64 / (1u64 << 20) as f64)
}

/// The node's `MemAvailable` (`None` where the kernel does not report it).
fn mem_available() -> Option<u64> {
    procfs::Meminfo::current().ok()?.mem_available
}

/// Where runc puts the cgroup of container `id` for the spec's `linux.cgroupsPath`: with the
/// systemd driver `slice:prefix:name` (`system.slice:runc:<id>` when empty) is the scope
/// `<slice, expanded>/<prefix>-<name>.scope` (a `name` ending in `.slice` is that slice),
/// from the hierarchy's root; otherwise the path itself (the id when empty), from the root
/// where absolute, else under the cgroup runc runs in (the shim's own).
pub fn runc_cgroup(cgroups_path: &str, id: &str, systemd: bool) -> Result<PathBuf> {
    let bad =
        |why: &str| Error::InvalidArgument(format!("linux.cgroupsPath {cgroups_path:?}: {why}"));
    if !systemd {
        let path = Path::new(if cgroups_path.is_empty() {
            id
        } else {
            cgroups_path
        });
        if path
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            return Err(bad("\"..\" in a cgroup path"));
        }
        return Ok(path.to_path_buf());
    }
    let default = format!("system.slice:runc:{id}");
    let path = if cgroups_path.is_empty() {
        &default
    } else {
        cgroups_path
    };
    let [slice, prefix, name] = path.split(':').collect::<Vec<_>>()[..] else {
        return Err(bad("the systemd driver wants slice:prefix:name"));
    };
    let slice = if slice.is_empty() {
        "system.slice"
    } else {
        slice
    };
    let slice = cgroups_rs::systemd::utils::expand_slice(slice)
        .map_err(|e| bad(&format!("slice {slice}: {e}")))?;
    let unit = if name.ends_with(".slice") {
        name.to_string()
    } else if prefix.is_empty() {
        format!("{name}.scope")
    } else {
        format!("{prefix}-{name}.scope")
    };
    if unit.contains('/') {
        return Err(bad("a unit name with \"/\""));
    }
    Ok(Path::new("/").join(slice).join(unit))
}

/// The directory of the memory cgroup runc puts container `id` in for `cgroups_path`
/// ([`runc_cgroup`]) and whether it is v2; `None` without a memory controller (then only the
/// node counts). The cgroup need not exist yet.
fn container_dir(cgroups_path: &str, id: &str, systemd: bool) -> Result<Option<(PathBuf, bool)>> {
    let path = runc_cgroup(cgroups_path, id, systemd)?;
    let hier = hierarchies::auto();
    let v2 = hier.v2();
    let path = if path.is_absolute() {
        path
    } else {
        let own = get_cgroups_relative_paths().map_err(|e| {
            Error::FailedPrecondition(format!("the shim's own cgroup (/proc/self/cgroup): {e}"))
        })?;
        let key = if v2 { "" } else { "memory" };
        let Some(own) = own.get(key) else {
            return Ok(None);
        };
        Path::new(own).join(path)
    };
    let rel = path.strip_prefix("/").unwrap_or(&path).to_path_buf();
    let cgroup = cgroups_rs::fs::Cgroup::load(hier, rel);
    Ok(cgroup
        .controller_of::<MemController>()
        .map(|m| (dir_of(m), v2)))
}

/// One memory cgroup, through cgroups-rs.
struct Cgroup {
    mem: MemController,
    dir: PathBuf,
    v2: bool,
}

impl Cgroup {
    fn at(dir: &Path, v2: bool) -> Cgroup {
        Cgroup {
            mem: MemController::new(dir.into(), PathBuf::new(), v2),
            dir: dir.into(),
            v2,
        }
    }

    fn limit_file(&self) -> &'static str {
        if self.v2 {
            "memory.max"
        } else {
            "memory.limit_in_bytes"
        }
    }

    /// The memory cgroup at `dir` and every one above it that has a limit file, innermost
    /// first. Those above are only read: they are shared with other containers and pods.
    fn chain_at(dir: &Path, v2: bool) -> Vec<Cgroup> {
        let mut chain = Vec::new();
        let mut dir = Some(dir);
        while let Some(d) = dir {
            let c = Cgroup::at(d, v2);
            if !d.join(c.limit_file()).exists() {
                break;
            }
            chain.push(c);
            dir = d.parent();
        }
        chain
    }

    fn read(&self, file: &str) -> Result<String> {
        let path = self.dir.join(file);
        std::fs::read_to_string(&path).map_err(Error::io(format!("read {}", path.display())))
    }

    fn limit(&self) -> Result<Option<u64>> {
        let text = self.read(self.limit_file())?;
        let bad = |e: String| {
            Error::FailedPrecondition(format!(
                "{}: {e}",
                self.dir.join(self.limit_file()).display()
            ))
        };
        match parse_max_value(text.trim()).map_err(|e| bad(e.to_string()))? {
            MaxValue::Max => Ok(None),
            MaxValue::Value(v) if v < 0 || v as u64 >= V1_UNLIMITED => Ok(None),
            MaxValue::Value(v) => Ok(Some(v as u64)),
        }
    }

    fn usage(&self) -> Result<u64> {
        let file = if self.v2 {
            "memory.current"
        } else {
            "memory.usage_in_bytes"
        };
        let text = self.read(file)?;
        text.trim().parse().map_err(|e| {
            Error::FailedPrecondition(format!("{}: {e}", self.dir.join(file).display()))
        })
    }

    /// Page cache the kernel can reclaim when the limit comes down.
    fn reclaimable(&self) -> u64 {
        let stat = self.mem.memory_stat();
        let g = |k: &str| stat.stat.raw.get(k).copied().unwrap_or(0);
        if self.v2 {
            g("active_file") + g("inactive_file")
        } else {
            g("total_active_file") + g("total_inactive_file")
        }
    }

    fn level(&self) -> Result<Level> {
        Ok(Level {
            dir: self.dir.clone(),
            limit: self.limit()?,
            usage: self.usage()?,
        })
    }

    /// v1's memory+swap limit, which must stay at or above the memory limit.
    fn memsw(&self) -> Option<u64> {
        if self.v2 {
            return None;
        }
        let v: u64 = self
            .read("memory.memsw.limit_in_bytes")
            .ok()?
            .trim()
            .parse()
            .ok()?;
        (v < V1_UNLIMITED).then_some(v)
    }

    fn write(
        &self,
        what: &str,
        set: impl FnOnce(&MemController) -> cgroups_rs::fs::error::Result<()>,
    ) -> Result<()> {
        set(&self.mem).map_err(|e| {
            Error::FailedPrecondition(format!("set {what} of {}: {e}", self.dir.display()))
        })
    }

    /// Sets the limit to `to` (`None`: unlimited), v1's memory+swap limit moved along by the
    /// same amount where it is set.
    fn set_limit(&self, to: Option<u64>, memsw: Option<u64>) -> Result<()> {
        let raw = |v: Option<u64>| v.map_or(-1, |v| v.min(i64::MAX as u64) as i64);
        let raising = match (to, self.limit()?) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(t), Some(now)) => t >= now,
        };
        // v1: memory.limit_in_bytes <= memory.memsw.limit_in_bytes at every moment.
        if raising {
            if let Some(sw) = memsw {
                self.write("memory+swap limit", |m| m.set_memswap_limit(raw(Some(sw))))?;
            }
            self.write("memory limit", |m| m.set_limit(raw(to)))
        } else {
            self.write("memory limit", |m| m.set_limit(raw(to)))?;
            if let Some(sw) = memsw {
                self.write("memory+swap limit", |m| m.set_memswap_limit(raw(Some(sw))))?;
            }
            Ok(())
        }
    }
}

/// The spec's memory limit, raised in `config.json` for a restore, to put back after it.
pub struct SpecLimit {
    /// The spec as it was.
    json: serde_json::Value,
    limit: u64,
    /// `linux.resources.memory.swap` (v1's memory+swap limit), where set.
    swap: Option<u64>,
}

/// What a checkpoint's GPU processes bring back at a restore.
#[derive(Clone, Copy)]
struct Held {
    /// CRIU's page images, the staged copy of the device memory among them.
    pages: u64,
    /// The device memory they held.
    device: u64,
    processes: usize,
}

/// A limit raised for a checkpoint or restore, and what to put back.
struct Raised {
    cgroup: Cgroup,
    limit: Option<u64>,
    memsw: Option<u64>,
    /// A put-back has waited for it once already: later tries write at once.
    waited: bool,
}

/// The host-memory side of one container's checkpoints and restores: the handler's choice
/// (refuse or raise), and the limit raised until the device steps are over.
#[derive(Clone)]
pub struct HostMemory {
    id: String,
    raise: bool,
    /// runc's systemd cgroup driver (`SystemdCgroup`): how `linux.cgroupsPath` reads.
    systemd: bool,
    raised: Arc<Mutex<Vec<Raised>>>,
}

/// A checkpoint's check, handed to the device layer to run between finding the GPU processes
/// and locking them ([`crate::device::ContainerDevices::quiesce`]).
pub struct Room {
    memory: HostMemory,
    /// The spec's `linux.cgroupsPath`: where the container's memory cgroup is.
    cgroups_path: String,
}

/// The spec's `linux.cgroupsPath` (empty where unset).
fn cgroups_path(spec: &serde_json::Value) -> String {
    spec["linux"]["cgroupsPath"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

impl Room {
    /// Refuses (or, with `RaiseMemoryLimit`, makes room for) what the driver will stage for
    /// `holders`. Nothing is locked yet.
    pub fn make(&self, holders: &[Holder]) -> Result<()> {
        let _span = info_span!("host_memory", id = %self.memory.id).entered();
        let device: u64 = holders
            .iter()
            .flat_map(|h| h.gpus.iter().map(|(_, b)| *b))
            .sum();
        let needed = staged_bytes(device, holders.len());
        let chain = self.memory.chain(&self.cgroups_path)?;
        let levels = chain
            .iter()
            .map(Cgroup::level)
            .collect::<Result<Vec<_>>>()?;
        let what = format!(
            "the driver stages {} in host memory for the {} GPU processes' {} of device memory",
            bytes(needed),
            holders.len(),
            bytes(device)
        );
        self.memory
            .fit("checkpoint", needed, &what, chain, &levels, mem_available())
    }
}

impl HostMemory {
    pub fn new(id: &str, options: &RuntimeOptions) -> HostMemory {
        HostMemory {
            id: id.to_string(),
            raise: options.raise_memory_limit,
            systemd: options.systemd_cgroup,
            raised: Arc::default(),
        }
    }

    /// The check of a checkpoint of the container whose spec is `spec`.
    pub fn room(&self, spec: &serde_json::Value) -> Room {
        Room {
            memory: self.clone(),
            cgroups_path: cgroups_path(spec),
        }
    }

    /// The running container's memory cgroup (from `cgroups_path`) and those above it,
    /// innermost first; empty without a memory controller or a limit file.
    fn chain(&self, cgroups_path: &str) -> Result<Vec<Cgroup>> {
        let Some((dir, v2)) = container_dir(cgroups_path, &self.id, self.systemd)? else {
            return Ok(Vec::new());
        };
        if !dir.is_dir() {
            return Err(Error::FailedPrecondition(format!(
                "container {}: its memory cgroup {} (from linux.cgroupsPath {cgroups_path:?}) does not exist",
                self.id,
                dir.display()
            )));
        }
        Ok(Cgroup::chain_at(&dir, v2))
    }

    /// `needed` against `levels` (of `chain`, the container's first) and the node: refused, or
    /// the container's own limit raised.
    fn fit(
        &self,
        operation: &'static str,
        needed: u64,
        what: &str,
        chain: Vec<Cgroup>,
        levels: &[Level],
        available: Option<u64>,
    ) -> Result<()> {
        let Some(to) = self.judge(operation, needed, what, levels, available)? else {
            return Ok(());
        };
        let Some(cgroup) = chain.into_iter().next() else {
            return Ok(());
        };
        let memsw = cgroup.memsw();
        let from = levels[0].limit;
        let new_memsw = memsw.map(|sw| sw + to.saturating_sub(from.unwrap_or(to)));
        if let Err(e) = cgroup.set_limit(Some(to), new_memsw) {
            return Err(self.refusal(operation, format!("{what}; raising the limit: {e}")));
        }
        info!(id = %self.id, cgroup = %cgroup.dir.display(), from = ?from, to, "memory limit raised for the {operation}");
        self.lock().push(Raised {
            cgroup,
            limit: from,
            memsw,
            waited: false,
        });
        Ok(())
    }

    /// The limit that makes room in the container's own cgroup (`levels[0]`; `None`: it fits),
    /// or the refusal: where a cgroup above it is short (never raised: shared with other
    /// containers and pods), where the handler does not raise limits, or where the node is
    /// short.
    fn judge(
        &self,
        operation: &'static str,
        needed: u64,
        what: &str,
        levels: &[Level],
        available: Option<u64>,
    ) -> Result<Option<u64>> {
        let untouched = if operation == "checkpoint" {
            "the container runs on untouched"
        } else {
            "nothing was restored"
        };
        let short = match verdict(needed, levels, available) {
            Verdict::Fits => return Ok(None),
            Verdict::Node { available } => {
                return Err(self.refusal(
                    operation,
                    format!(
                        "{what}, and the node has {} available (MemAvailable); {untouched}",
                        bytes(available)
                    ),
                ))
            }
            Verdict::Short(short) => short,
        };
        let parent = short.iter().find(|(i, _)| *i > 0);
        let (i, to) = *parent.unwrap_or(&short[0]);
        if parent.is_none() && self.raise {
            return Ok(Some(to));
        }
        let l = &levels[i];
        let (whose, option) = if i == 0 {
            ("its", format!("the handler option RaiseMemoryLimit raises the limit for the {operation} instead"))
        } else {
            ("the parent", "a cgroup above the container's is shared and never raised: the handler option RaiseMemoryLimit raises only the container's own".to_string())
        };
        Err(self.refusal(
            operation,
            format!(
                "{what}, more than the {} free under {whose} memory cgroup {}: limit {}, use {}; {untouched} ({option})",
                bytes(l.room().unwrap_or(0)),
                l.dir.display(),
                bytes(l.limit.unwrap_or(0)),
                bytes(l.usage),
            ),
        ))
    }

    /// Before CRIU restores `manifest`'s GPU processes into this container: CRIU brings back
    /// every page the checkpoint holds (the staged copy of the device memory among them)
    /// before the driver reads the copy onto the GPU, so the page images and a context per
    /// process are held to the spec's memory limit (the new cgroup is empty), to the cgroups
    /// above it and to the node ([`HostMemory::restore_limit`]). Refused, or with
    /// `RaiseMemoryLimit` the limit raised in `config.json` for runc restore by at most the
    /// staged copy and the contexts; returns what to put back after the device restore
    /// ([`HostMemory::after_restore`]).
    pub fn before_restore(
        &self,
        bundle: &mut Bundle,
        manifest: &Manifest,
    ) -> Result<Option<SpecLimit>> {
        let processes = manifest.devices.processes.len();
        if processes == 0 {
            return Ok(None);
        }
        let _span = info_span!("host_memory", id = %self.id).entered();
        // With custom storage the device memory is in its own files, not in the page images:
        // nothing of it comes through host memory.
        let device = if manifest.devices.custom_storage() {
            0
        } else {
            manifest.devices.device_bytes()
        };
        let pages: u64 = manifest
            .files
            .iter()
            .filter(|(n, _)| manifest::is_page_image(n))
            .map(|(_, f)| f.size)
            .sum();
        let json = bundle.json().clone();
        let memory = &json["linux"]["resources"]["memory"];
        let limit = memory["limit"]
            .as_i64()
            .filter(|l| *l > 0)
            .map(|l| l as u64);
        let swap = memory["swap"].as_i64().filter(|s| *s > 0).map(|s| s as u64);
        let held = Held {
            pages,
            device,
            processes,
        };
        let to = self.restore_limit(&held, limit, &cgroups_path(&json), mem_available())?;
        let (Some(to), Some(from)) = (to, limit) else {
            return Ok(None);
        };
        let mut raised = json.clone();
        let m = &mut raised["linux"]["resources"]["memory"];
        m["limit"] = (to as i64).into();
        // runc wants memory+swap at or above memory.
        if let Some(swap) = m["swap"].as_i64().filter(|s| *s > 0) {
            m["swap"] = (swap + (to - from) as i64).into();
        }
        bundle.rewrite(raised)?;
        info!(id = %self.id, from, to, "memory limit raised in the spec for the restore");
        Ok(Some(SpecLimit {
            json,
            limit: from,
            swap,
        }))
    }

    /// The limit `config.json` gets for a restore of `held` into the cgroup of `cgroups_path`
    /// under the spec's `limit` (`None`: it fits as it is), or the refusal. What the processes
    /// hold besides the staged copy above `limit` is refused whatever the handler's choice.
    fn restore_limit(
        &self,
        held: &Held,
        limit: Option<u64>,
        cgroups_path: &str,
        available: Option<u64>,
    ) -> Result<Option<u64>> {
        let Held {
            pages,
            device,
            processes,
        } = *held;
        let own = pages.saturating_sub(device);
        if let Some(limit) = limit.filter(|l| own > *l) {
            return Err(self.refusal(
                "restore",
                format!(
                    "its checkpoint brings back {} of process memory besides the staged copy of its {} of device memory, more than the spec's memory limit {} for its memory cgroup {cgroups_path}; nothing was restored (the handler option RaiseMemoryLimit raises the limit only by the staged device memory)",
                    bytes(own),
                    bytes(device),
                    bytes(limit)
                ),
            ));
        }
        // With `own` under the limit, the raise below is at most the staged copy and the
        // contexts.
        let needed = pages
            .max(device)
            .saturating_add(CONTEXT_BYTES.saturating_mul(processes as u64));
        let mut levels = vec![Level {
            dir: PathBuf::from(cgroups_path),
            limit,
            usage: 0,
        }];
        if let Some((dir, v2)) = container_dir(cgroups_path, &self.id, self.systemd)? {
            let above = dir.parent().map(|p| Cgroup::chain_at(p, v2));
            for c in above.unwrap_or_default() {
                levels.push(c.level()?);
            }
        }
        let what = format!(
            "its checkpoint brings back {} of process memory for {processes} GPU processes holding {} of device memory (staged in it), {} with their contexts",
            bytes(pages),
            bytes(device),
            bytes(needed)
        );
        self.judge("restore", needed, &what, &levels, available)
    }

    /// After the restore's device steps (or its failure): `config.json` back to the spec, and
    /// the restored container's cgroup (from the spec's `linux.cgroupsPath`; `running` false
    /// when no container runs) back to the spec's limit ([`HostMemory::put_back`]).
    pub async fn after_restore(&self, bundle: &mut Bundle, spec: Option<SpecLimit>, running: bool) {
        let Some(spec) = spec else {
            return;
        };
        let path = cgroups_path(&spec.json);
        if let Err(e) = bundle.rewrite(spec.json) {
            warn!(id = %self.id, error = %e, "the spec's memory limit back in config.json");
        }
        if !running {
            return;
        }
        match self.chain(&path) {
            Ok(mut chain) if !chain.is_empty() => {
                let cgroup = chain.swap_remove(0);
                let memsw = spec.swap.filter(|_| cgroup.memsw().is_some());
                self.lock().push(Raised {
                    cgroup,
                    limit: Some(spec.limit),
                    memsw,
                    waited: false,
                });
                self.put_back().await;
            }
            Ok(_) => {}
            Err(e) => warn!(id = %self.id, error = %e, "the restored container's memory cgroup"),
        }
    }

    fn refusal(&self, operation: &'static str, why: String) -> Error {
        Error::Step {
            operation,
            step: "host-memory",
            message: format!("container {} would be OOM-killed: {why}", self.id),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Raised>> {
        self.raised.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// After the device steps have brought the staged memory back onto the GPUs (Resume's
    /// device restore, a failed quiesce's undo, a restore's device restore) or the process has
    /// exited: every limit raised for them back, once what the cgroup holds beyond reclaimable
    /// cache fits under it, or after [`PUT_BACK_WAIT`] regardless (what is above it then is
    /// the tenant's own). A write the kernel refuses (v1: `EBUSY`) is logged and tried again
    /// at the next call (every later pause, checkpoint, resume and the container's exit),
    /// without waiting again.
    pub async fn put_back(&self) {
        if self.lock().is_empty() {
            return;
        }
        let me = self.clone();
        let _ = tokio::task::spawn_blocking(move || me.put_back_now(PUT_BACK_WAIT)).await;
    }

    fn put_back_now(&self, wait: Duration) {
        let mut raised = self.lock();
        let mut kept = Vec::new();
        while let Some(r) = raised.pop() {
            match put_back_one(&self.id, &r, wait) {
                Ok(()) => {
                    info!(id = %self.id, cgroup = %r.cgroup.dir.display(), limit = ?r.limit, "memory limit put back")
                }
                Err(e) if r.cgroup.dir.exists() => {
                    warn!(id = %self.id, error = %e, "memory limit left raised; tried again at the next step and at exit");
                    kept.push(Raised { waited: true, ..r });
                }
                // The container's cgroup went with it.
                Err(_) => {}
            }
        }
        kept.reverse();
        *raised = kept;
    }
}

/// `r`'s limit back once the cgroup's unreclaimable use fits under it, or after `wait`
/// regardless (on v2 the kernel then reclaims or OOM-kills inside that cgroup; on v1 the
/// write fails with `EBUSY`).
fn put_back_one(id: &str, r: &Raised, wait: Duration) -> Result<()> {
    let wait = if r.waited { Duration::ZERO } else { wait };
    let deadline = Instant::now() + wait;
    loop {
        let usage = r.cgroup.usage()?;
        let held = usage.saturating_sub(r.cgroup.reclaimable());
        let fits = r.limit.is_none_or(|l| held <= l);
        if fits || Instant::now() >= deadline {
            if !fits {
                warn!(
                    id,
                    cgroup = %r.cgroup.dir.display(),
                    held,
                    limit = ?r.limit,
                    "memory limit put back below what the container holds beyond reclaimable cache, after the device steps: the overshoot is its own"
                );
            }
            return r.cgroup.set_limit(r.limit, r.memsw);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn level(limit: Option<u64>, usage: u64) -> Level {
        Level {
            dir: PathBuf::from("/c"),
            limit,
            usage,
        }
    }

    #[test]
    fn staged_bytes_cover_the_worst_measured_growth_and_a_context_each() {
        assert_eq!(staged_bytes(0, 0), 0);
        assert_eq!(staged_bytes(0, 1), CONTEXT_BYTES);
        assert_eq!(staged_bytes(100 << 20, 1), (150 << 20) + CONTEXT_BYTES);
        // Rounded up: 4.5 bytes staged are 5.
        assert_eq!(staged_bytes(3, 2), 5 + 2 * CONTEXT_BYTES);
        // 1.45x of the H200's measurement fits under it.
        let d = 60u64 << 30;
        assert!(staged_bytes(d, 1) >= d / 100 * 145);
        assert_eq!(staged_bytes(u64::MAX, 1), u64::MAX);
    }

    #[test]
    fn a_limit_with_room_fits_and_one_without_is_short() {
        let mib = 1u64 << 20;
        // 400 MiB limit, 100 used: 300 free.
        let l = [level(Some(400 * mib), 100 * mib)];
        assert_eq!(verdict(300 * mib, &l, None), Verdict::Fits);
        assert_eq!(
            verdict(300 * mib + 1, &l, None),
            Verdict::Short(vec![(0, page_up(400 * mib + 1))])
        );
        // No limit: only the node counts.
        let free = [level(None, 100 * mib)];
        assert_eq!(verdict(u64::MAX / 2, &free, None), Verdict::Fits);
        assert_eq!(
            verdict(2 * mib, &free, Some(mib)),
            Verdict::Node { available: mib }
        );
        // A use above the limit (v1 lets that happen briefly) has no room.
        assert_eq!(
            verdict(1, &[level(Some(mib), 2 * mib)], None),
            Verdict::Short(vec![(0, page_up(2 * mib + 1))])
        );
    }

    #[test]
    fn every_short_level_is_named_with_the_limit_that_makes_room() {
        let mib = 1u64 << 20;
        let levels = [
            level(Some(512 * mib), 100 * mib),
            level(None, 300 * mib),
            level(Some(1024 * mib), 900 * mib),
        ];
        assert_eq!(
            verdict(200 * mib, &levels, Some(4096 * mib)),
            Verdict::Short(vec![(2, 1100 * mib)])
        );
        assert_eq!(
            verdict(500 * mib, &levels, Some(4096 * mib)),
            Verdict::Short(vec![(0, 600 * mib), (2, 1400 * mib)])
        );
    }

    #[test]
    fn limits_are_read_as_cgroups_write_them() {
        let d = tempfile::tempdir().unwrap();
        let v2 = Cgroup::at(d.path(), true);
        std::fs::write(d.path().join("memory.max"), "max\n").unwrap();
        std::fs::write(d.path().join("memory.current"), "4096\n").unwrap();
        assert_eq!(v2.limit().unwrap(), None);
        std::fs::write(d.path().join("memory.max"), "419430400\n").unwrap();
        assert_eq!(
            v2.level().unwrap(),
            Level {
                dir: d.path().into(),
                limit: Some(419430400),
                usage: 4096
            }
        );
        let v1 = Cgroup::at(d.path(), false);
        std::fs::write(
            d.path().join("memory.limit_in_bytes"),
            "9223372036854771712\n",
        )
        .unwrap();
        std::fs::write(d.path().join("memory.usage_in_bytes"), "8192\n").unwrap();
        assert_eq!(v1.limit().unwrap(), None);
        assert_eq!(v1.usage().unwrap(), 8192);
        std::fs::write(d.path().join("memory.memsw.limit_in_bytes"), "1048576\n").unwrap();
        assert_eq!(v1.memsw(), Some(1 << 20));
    }

    #[test]
    fn a_refusal_names_the_container_limit_use_and_bytes() {
        let d = tempfile::tempdir().unwrap();
        let mib = 1u64 << 20;
        let m = HostMemory::new("c1", &RuntimeOptions::default());
        let levels = [Level {
            dir: d.path().into(),
            limit: Some(400 * mib),
            usage: 300 * mib,
        }];
        let err = m
            .fit(
                "checkpoint",
                200 * mib,
                "the driver stages 209715200 bytes (200.0 MiB)",
                vec![Cgroup::at(d.path(), true)],
                &levels,
                None,
            )
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(
                "checkpoint failed at step host-memory: container c1 would be OOM-killed"
            ),
            "{err}"
        );
        assert!(err.contains("limit 419430400 bytes (400.0 MiB)"), "{err}");
        assert!(err.contains("use 314572800 bytes (300.0 MiB)"), "{err}");
        assert!(err.contains("209715200 bytes"), "{err}");
        assert!(err.contains("RaiseMemoryLimit"), "{err}");
    }

    /// A v2 cgroup in `d` at a 400 MiB limit, 300 used, raised by a checkpoint staging 200.
    fn raised_by_a_checkpoint(d: &Path) -> HostMemory {
        let mib = 1u64 << 20;
        std::fs::write(d.join("memory.max"), format!("{}\n", 400 * mib)).unwrap();
        std::fs::write(d.join("memory.current"), format!("{}\n", 300 * mib)).unwrap();
        let options = RuntimeOptions {
            raise_memory_limit: true,
            ..Default::default()
        };
        let m = HostMemory::new("c1", &options);
        let levels = [Cgroup::at(d, true).level().unwrap()];
        m.fit(
            "checkpoint",
            200 * mib,
            "",
            vec![Cgroup::at(d, true)],
            &levels,
            Some(1 << 40),
        )
        .unwrap();
        assert_eq!(
            std::fs::read_to_string(d.join("memory.max")).unwrap(),
            (500 * mib).to_string()
        );
        m
    }

    #[test]
    fn a_raised_limit_is_put_back_once_the_use_fits() {
        let d = tempfile::tempdir().unwrap();
        let mib = 1u64 << 20;
        let m = raised_by_a_checkpoint(d.path());
        let max = || std::fs::read_to_string(d.path().join("memory.max")).unwrap();
        // The staged copy is gone: the limit goes back.
        std::fs::write(d.path().join("memory.current"), format!("{}\n", 350 * mib)).unwrap();
        m.put_back_now(Duration::ZERO);
        assert_eq!(max(), (400 * mib).to_string());
        assert!(m.lock().is_empty());
    }

    #[test]
    fn the_container_cgroup_is_where_runc_puts_it_for_the_spec() {
        let p = |path: &str, systemd: bool| runc_cgroup(path, "c1", systemd).unwrap();
        assert_eq!(
            p("/kubepods/besteffort/pod1/c1", false),
            PathBuf::from("/kubepods/besteffort/pod1/c1")
        );
        // Relative (under runc's own cgroup); empty: the id.
        assert_eq!(p("", false), PathBuf::from("c1"));
        assert_eq!(p("a/b", false), PathBuf::from("a/b"));
        assert!(runc_cgroup("/kubepods/../../etc", "c1", false).is_err());
        assert_eq!(
            p("kubepods-besteffort-pod1.slice:cri-containerd:c1", true),
            PathBuf::from(
                "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice/cri-containerd-c1.scope"
            )
        );
        assert_eq!(p("", true), PathBuf::from("/system.slice/runc-c1.scope"));
        assert_eq!(
            p(":cri-containerd:c1", true),
            PathBuf::from("/system.slice/cri-containerd-c1.scope")
        );
        assert!(runc_cgroup("/kubepods/c1", "c1", true).is_err());
        assert!(runc_cgroup("a.slice:p:x/../y", "c1", true).is_err());
    }

    #[test]
    fn a_short_parent_is_refused_with_the_option_and_never_written() {
        let d = tempfile::tempdir().unwrap();
        let pod = d.path().to_path_buf();
        let container = pod.join("c1");
        std::fs::create_dir(&container).unwrap();
        let mib = 1u64 << 20;
        for (dir, max, current) in [
            (&pod, 450 * mib, 300 * mib),
            (&container, 400 * mib, 300 * mib),
        ] {
            std::fs::write(dir.join("memory.max"), format!("{max}\n")).unwrap();
            std::fs::write(dir.join("memory.current"), format!("{current}\n")).unwrap();
        }
        let options = RuntimeOptions {
            raise_memory_limit: true,
            ..Default::default()
        };
        let m = HostMemory::new("c1", &options);
        let chain = Cgroup::chain_at(&container, true);
        assert_eq!(chain.len(), 2);
        let levels = chain.iter().map(|c| c.level().unwrap()).collect::<Vec<_>>();
        let err = m
            .fit("checkpoint", 200 * mib, "x", chain, &levels, Some(1 << 40))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!(
                "free under the parent memory cgroup {}",
                pod.display()
            )),
            "{err}"
        );
        assert!(err.contains("limit 471859200 bytes (450.0 MiB)"), "{err}");
        assert!(err.contains("never raised"), "{err}");
        let max = |dir: &Path| std::fs::read_to_string(dir.join("memory.max")).unwrap();
        assert_eq!(max(&pod), format!("{}\n", 450 * mib));
        assert_eq!(max(&container), format!("{}\n", 400 * mib));
        assert!(m.lock().is_empty());
        // The container's own short, the parent with room: only the container's is raised.
        std::fs::write(pod.join("memory.max"), "max\n").unwrap();
        let chain = Cgroup::chain_at(&container, true);
        let levels = chain.iter().map(|c| c.level().unwrap()).collect::<Vec<_>>();
        m.fit("checkpoint", 200 * mib, "x", chain, &levels, Some(1 << 40))
            .unwrap();
        assert_eq!(max(&pod), "max\n");
        assert_eq!(max(&container), (500 * mib).to_string());
    }

    #[test]
    fn a_raised_limit_is_put_back_after_the_wait_even_above_the_use() {
        let d = tempfile::tempdir().unwrap();
        let mib = 1u64 << 20;
        let m = raised_by_a_checkpoint(d.path());
        // Something else filled the room while the limit was raised: the limit goes back all
        // the same (the kernel deals with the tenant's own overshoot).
        std::fs::write(d.path().join("memory.current"), format!("{}\n", 480 * mib)).unwrap();
        m.put_back_now(Duration::ZERO);
        let max = std::fs::read_to_string(d.path().join("memory.max")).unwrap();
        assert_eq!(max, (400 * mib).to_string());
        assert!(m.lock().is_empty());
    }

    #[test]
    fn a_restore_raises_only_by_the_staged_copy() {
        let mib = 1u64 << 20;
        let options = RuntimeOptions {
            raise_memory_limit: true,
            ..Default::default()
        };
        let m = HostMemory::new("c1", &options);
        let path = "/gpu-ckpt-unit-test-none/c1";
        let limit = Some(400 * mib);
        let refused = |m: &HostMemory, held: &Held| {
            m.restore_limit(held, limit, path, None)
                .unwrap_err()
                .to_string()
        };
        // 600 MiB of pages, 100 of them the staged copy: 500 of its own, above a 400 MiB
        // limit: refused with the option.
        let big = Held {
            pages: 600 * mib,
            device: 100 * mib,
            processes: 1,
        };
        let err = refused(&m, &big);
        assert!(
            err.contains(
                "brings back 524288000 bytes (500.0 MiB) of process memory besides the staged copy"
            ),
            "{err}"
        );
        assert!(err.contains("limit 419430400 bytes (400.0 MiB)"), "{err}");
        // 300 MiB of its own, 200 staged: raised to the pages and the context, no more than
        // the limit plus the staged copy and the context.
        let fits = Held {
            pages: 500 * mib,
            device: 200 * mib,
            processes: 1,
        };
        let to = m.restore_limit(&fits, limit, path, None).unwrap().unwrap();
        assert_eq!(to, 500 * mib + CONTEXT_BYTES);
        assert!(to <= 400 * mib + 200 * mib + CONTEXT_BYTES);
        // Without the option: refused, naming the option.
        let refuse = HostMemory::new("c1", &RuntimeOptions::default());
        let err = refused(&refuse, &fits);
        let option = "RaiseMemoryLimit raises the limit for the restore";
        assert!(err.contains(option), "{err}");
    }

    #[test]
    fn a_put_back_the_kernel_refuses_is_kept_and_tried_again_without_waiting() {
        let d = tempfile::tempdir().unwrap();
        let mib = 1u64 << 20;
        let max_file = d.path().join("memory.max");
        let m = raised_by_a_checkpoint(d.path());
        // The limit cannot be written back (as v1 answers EBUSY): kept, to try again.
        std::fs::remove_file(&max_file).unwrap();
        std::fs::create_dir(&max_file).unwrap();
        m.put_back_now(Duration::ZERO);
        assert_eq!(m.lock().len(), 1);
        std::fs::remove_dir(&max_file).unwrap();
        std::fs::write(&max_file, (500 * mib).to_string()).unwrap();
        std::fs::write(d.path().join("memory.current"), format!("{}\n", 480 * mib)).unwrap();
        // The next step writes it at once, above the use or not: it has waited already.
        let start = Instant::now();
        m.put_back_now(Duration::from_secs(60));
        assert!(start.elapsed() < Duration::from_secs(10));
        assert_eq!(
            std::fs::read_to_string(&max_file).unwrap(),
            (400 * mib).to_string()
        );
        assert!(m.lock().is_empty());
    }
}
