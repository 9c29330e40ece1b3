//! Host memory for the device memory a GPU checkpoint stages, before any device lock.
//!
//! `cuCheckpointProcessCheckpoint` moves a process's device memory into the process's own host
//! memory, which the kernel charges to the container's memory cgroup; a restore brings that
//! copy back with the process's other pages before the driver reads it onto the GPU. A cgroup
//! without that much room OOM-kills the container the checkpoint was meant to save. So, before
//! the lock (and before CRIU at a restore), the bytes the driver will stage are held to the room
//! of the container's memory cgroup and of every cgroup above it (limit less use), and to the
//! node's `MemAvailable`. Where they do not fit the step is refused, naming the container, the
//! limit, the use and the bytes needed, and nothing is touched; or, with the handler option
//! `RaiseMemoryLimit`, each short limit is raised by what is needed for the length of the
//! device steps and put back after them ([`HostMemory::put_back`]), never below what the
//! cgroup then holds that the kernel cannot reclaim (on cgroup v2 a `memory.max` below that
//! OOM-kills).
//!
//! cgroups-rs finds the cgroup ([`TaskCgroup`]) and writes the limits; the arithmetic and the
//! walk up the hierarchy are here.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cgroups_rs::fs::{memory::MemController, parse_max_value, MaxValue};
use image_format::manifest::{self, Manifest};
use procfs::Current;
use tracing::{info, info_span, warn};

use crate::bundle::Bundle;
use crate::device::Holder;
use crate::error::{Error, Result};
use crate::options::RuntimeOptions;
use crate::stats::{dir_of, TaskCgroup};

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
/// lowers the limit again.
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

    /// The memory cgroup of `pid` and every one above it that has a limit file, innermost
    /// first (none without a memory controller: then only the node counts).
    fn chain_of(pid: i32) -> Result<Vec<Cgroup>> {
        let task = TaskCgroup::of_pid(pid)?;
        let Some(mem) = task.memory.as_ref() else {
            return Ok(Vec::new());
        };
        let mut dir = dir_of(mem);
        let mut chain = Vec::new();
        loop {
            let c = Cgroup::at(&dir, task.v2);
            if !dir.join(c.limit_file()).exists() {
                break;
            }
            chain.push(c);
            match dir.parent() {
                Some(p) => dir = p.to_path_buf(),
                None => break,
            }
        }
        Ok(chain)
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

/// A limit raised for a checkpoint or restore, and what to put back.
struct Raised {
    cgroup: Cgroup,
    limit: Option<u64>,
    memsw: Option<u64>,
}

/// The host-memory side of one container's checkpoints and restores: the handler's choice
/// (refuse or raise), and the limits raised until the device steps are over.
#[derive(Clone)]
pub struct HostMemory {
    id: String,
    raise: bool,
    raised: Arc<Mutex<Vec<Raised>>>,
}

/// A checkpoint's check, handed to the device layer to run between finding the GPU processes
/// and locking them ([`crate::device::ContainerDevices::quiesce`]).
pub struct Room {
    memory: HostMemory,
    /// The container's init (its memory cgroup is the container's).
    pid: i32,
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
        let chain = Cgroup::chain_of(self.pid)?;
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
            raised: Arc::default(),
        }
    }

    /// The check of a checkpoint of the container whose init is `pid`.
    pub fn room(&self, pid: i32) -> Room {
        Room {
            memory: self.clone(),
            pid,
        }
    }

    /// `needed` against `levels` (of `chain`) and the node: refused, or each short limit raised.
    fn fit(
        &self,
        operation: &'static str,
        needed: u64,
        what: &str,
        chain: Vec<Cgroup>,
        levels: &[Level],
        available: Option<u64>,
    ) -> Result<()> {
        let short = self.judge(operation, needed, what, levels, available)?;
        let mut chain: Vec<Option<Cgroup>> = chain.into_iter().map(Some).collect();
        let mut raised = self.lock();
        // Outermost first, so that no level's room is capped by one not yet raised.
        for &(i, to) in short.iter().rev() {
            let Some(cgroup) = chain.get_mut(i).and_then(Option::take) else {
                continue;
            };
            let memsw = cgroup.memsw();
            let from = levels[i].limit;
            let new_memsw = memsw.map(|sw| sw + to.saturating_sub(from.unwrap_or(to)));
            if let Err(e) = cgroup.set_limit(Some(to), new_memsw) {
                drop(raised);
                self.put_back_now();
                return Err(self.refusal(operation, format!("{what}; raising the limit: {e}")));
            }
            info!(id = %self.id, cgroup = %cgroup.dir.display(), from = ?from, to, "memory limit raised for the {operation}");
            raised.push(Raised {
                cgroup,
                limit: from,
                memsw,
            });
        }
        Ok(())
    }

    /// The levels that are short of `needed` (index, the limit that makes room; empty: it
    /// fits), or the refusal where the handler does not raise limits or the node is short.
    fn judge(
        &self,
        operation: &'static str,
        needed: u64,
        what: &str,
        levels: &[Level],
        available: Option<u64>,
    ) -> Result<Vec<(usize, u64)>> {
        let untouched = if operation == "checkpoint" {
            "the container runs on untouched"
        } else {
            "nothing was restored"
        };
        let short = match verdict(needed, levels, available) {
            Verdict::Fits => return Ok(Vec::new()),
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
        if self.raise {
            return Ok(short);
        }
        let (i, _) = short[0];
        let l = &levels[i];
        let whose = if i == 0 { "its" } else { "the parent" };
        Err(self.refusal(
            operation,
            format!(
                "{what}, more than the {} free under {whose} memory cgroup {}: limit {}, use {}; {untouched} (the handler option RaiseMemoryLimit raises the limit for the {operation} instead)",
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
    /// process are held to the spec's memory limit (the new cgroup is empty) and the node.
    /// Refused, or with `RaiseMemoryLimit` the limit raised in `config.json` for runc restore;
    /// what to put back after the device restore ([`HostMemory::after_restore`]).
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
        let device = manifest.devices.device_bytes();
        let pages: u64 = manifest
            .files
            .iter()
            .filter(|(n, _)| manifest::is_page_image(n))
            .map(|(_, f)| f.size)
            .sum();
        let needed = pages
            .max(device)
            .saturating_add(CONTEXT_BYTES.saturating_mul(processes as u64));
        let json = bundle.json().clone();
        let memory = &json["linux"]["resources"]["memory"];
        let limit = memory["limit"]
            .as_i64()
            .filter(|l| *l > 0)
            .map(|l| l as u64);
        let swap = memory["swap"].as_i64().filter(|s| *s > 0).map(|s| s as u64);
        let cgroup = json["linux"]["cgroupsPath"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let levels = [Level {
            dir: PathBuf::from(&cgroup),
            limit,
            usage: 0,
        }];
        let what = format!(
            "its checkpoint brings back {} of process memory for {processes} GPU processes holding {} of device memory (staged in it), {} with their contexts",
            bytes(pages),
            bytes(device),
            bytes(needed)
        );
        let short = self.judge("restore", needed, &what, &levels, mem_available())?;
        let (Some(&(_, to)), Some(from)) = (short.first(), limit) else {
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

    /// After the restore's device steps (or its failure): `config.json` back to the spec, and
    /// the restored container's cgroup (init `pid`, 0 when none runs) back to the spec's limit
    /// once the staged copy has left it ([`HostMemory::put_back`] tries again at exit where it
    /// has not).
    pub async fn after_restore(&self, bundle: &mut Bundle, spec: Option<SpecLimit>, pid: i32) {
        let Some(spec) = spec else {
            return;
        };
        if let Err(e) = bundle.rewrite(spec.json) {
            warn!(id = %self.id, error = %e, "the spec's memory limit back in config.json");
        }
        if pid <= 0 {
            return;
        }
        match Cgroup::chain_of(pid) {
            Ok(mut chain) if !chain.is_empty() => {
                let cgroup = chain.swap_remove(0);
                let memsw = spec.swap.filter(|_| cgroup.memsw().is_some());
                self.lock().push(Raised {
                    cgroup,
                    limit: Some(spec.limit),
                    memsw,
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

    /// After the device steps (Resume's device restore, a failed quiesce, the container's
    /// exit): every limit raised for them back, innermost first, once what the cgroup holds
    /// beyond reclaimable cache fits under it again. A limit that still does not fit after a
    /// wait stays raised (lowering it would OOM-kill) and is tried again at the next call.
    pub async fn put_back(&self) {
        if self.lock().is_empty() {
            return;
        }
        let me = self.clone();
        let _ = tokio::task::spawn_blocking(move || me.put_back_now()).await;
    }

    fn put_back_now(&self) {
        let mut raised = self.lock();
        let mut kept = Vec::new();
        while let Some(r) = raised.pop() {
            match put_back_one(&r) {
                Ok(()) => {
                    info!(id = %self.id, cgroup = %r.cgroup.dir.display(), limit = ?r.limit, "memory limit put back")
                }
                Err(e) if r.cgroup.dir.exists() => {
                    warn!(id = %self.id, error = %e, "memory limit left raised");
                    kept.push(r);
                }
                // The container's cgroup went with it.
                Err(_) => {}
            }
        }
        kept.reverse();
        *raised = kept;
    }
}

/// `r`'s limit back, once the cgroup's unreclaimable use fits under it (waits up to
/// [`PUT_BACK_WAIT`] for the staged copy to go).
fn put_back_one(r: &Raised) -> Result<()> {
    let deadline = Instant::now() + PUT_BACK_WAIT;
    loop {
        let usage = r.cgroup.usage()?;
        let held = usage.saturating_sub(r.cgroup.reclaimable());
        if r.limit.is_none_or(|l| held <= l) {
            return r.cgroup.set_limit(r.limit, r.memsw);
        }
        if Instant::now() >= deadline {
            return Err(Error::FailedPrecondition(format!(
                "{} still holds {} beyond reclaimable cache, above its limit {}: lowering it now would OOM-kill",
                r.cgroup.dir.display(),
                bytes(held),
                bytes(r.limit.unwrap_or(0))
            )));
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

    #[test]
    fn a_raised_limit_is_put_back_once_the_use_fits() {
        let d = tempfile::tempdir().unwrap();
        let mib = 1u64 << 20;
        std::fs::write(d.path().join("memory.max"), format!("{}\n", 400 * mib)).unwrap();
        std::fs::write(d.path().join("memory.current"), format!("{}\n", 300 * mib)).unwrap();
        let options = RuntimeOptions {
            raise_memory_limit: true,
            ..Default::default()
        };
        let m = HostMemory::new("c1", &options);
        let levels = [Cgroup::at(d.path(), true).level().unwrap()];
        m.fit(
            "checkpoint",
            200 * mib,
            "",
            vec![Cgroup::at(d.path(), true)],
            &levels,
            Some(1 << 40),
        )
        .unwrap();
        let max = || std::fs::read_to_string(d.path().join("memory.max")).unwrap();
        assert_eq!(max(), (500 * mib).to_string());
        // The staged copy is gone: the limit goes back.
        std::fs::write(d.path().join("memory.current"), format!("{}\n", 350 * mib)).unwrap();
        m.put_back_now();
        assert_eq!(max(), (400 * mib).to_string());
        assert!(m.lock().is_empty());
    }
}
