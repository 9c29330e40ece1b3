//! Container metrics of the cgroups a task is in, for cgroup v1 (each controller mounted on its
//! own, cpu and cpuacct possibly together) and v2, in the protobuf types containerd decodes
//! (`io.containerd.cgroups.v1.Metrics` / `io.containerd.cgroups.v2.Metrics`).
//!
//! `cgroups-rs` (the crate containerd's Rust shim crate uses) finds the hierarchy, the task's
//! cgroup (v1 controllers from the mount table, co-mounted ones included) and reads the memory,
//! cpuacct and pids files. Kept here: splitting what it hands over as text (`cpu.stat`,
//! `cpuacct.stat`, `cpuacct.usage_percpu`), and v2's `memory.max` and `memory.swap.max`, whose
//! `max` it reads as -1 and 0 where containerd reports the largest value.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use cgroups_rs::fs::{
    cgroup::get_cgroups_relative_paths_by_pid, cpu::CpuController, cpuacct::CpuAcctController,
    hierarchies, memory::MemController, parse_max_value, pid::PidController, Cgroup, Controller,
    MaxValue, Subsystem,
};
use containerd_shim::protos::{
    cgroups::metrics as v1,
    cgroups_v2::metrics as v2,
    protobuf::{well_known_types::any::Any, MessageField},
};
use containerd_shim::util::convert_to_any;

use crate::error::{Error, Result};

/// The controllers of a task's cgroup that its metrics and OOM watch read.
#[derive(Debug, Default)]
pub struct TaskCgroup {
    pub v2: bool,
    pub memory: Option<MemController>,
    cpu: Option<CpuController>,
    cpuacct: Option<CpuAcctController>,
    pids: Option<PidController>,
}

impl TaskCgroup {
    /// The cgroup `pid` is in (on v1, each controller's own), from `/proc/<pid>/cgroup`.
    pub fn of_pid(pid: i32) -> Result<Self> {
        let context = format!("read cgroups of pid {pid}");
        let pid = u32::try_from(pid).map_err(|_| Error::InvalidArgument(format!("pid {pid}")))?;
        let paths = get_cgroups_relative_paths_by_pid(pid).map_err(io_error(context))?;
        let hier = hierarchies::auto();
        if hier.v2() {
            // Every v2 file is read in the one directory, whichever controllers the root offers.
            let rel = paths.get("").map(String::as_str).unwrap_or_default();
            return Ok(Self::v2_at(&hier.root().join(rel.trim_start_matches('/'))));
        }
        let cgroup = Cgroup::load_with_relative_paths(hier, Path::new("."), paths);
        let mut c = Self::default();
        for s in cgroup.subsystems() {
            match s {
                Subsystem::Mem(m) => c.memory = Some(m.clone()),
                Subsystem::Cpu(m) => c.cpu = Some(m.clone()),
                Subsystem::CpuAcct(m) => c.cpuacct = Some(m.clone()),
                Subsystem::Pid(m) => c.pids = Some(m.clone()),
                _ => {}
            }
        }
        Ok(c)
    }

    /// The v2 cgroup at `dir`.
    fn v2_at(dir: &Path) -> Self {
        Self {
            v2: true,
            memory: Some(MemController::new(dir.into(), PathBuf::new(), true)),
            cpu: Some(CpuController::new(dir.into(), PathBuf::new(), true)),
            cpuacct: None,
            pids: Some(PidController::new(dir.into(), PathBuf::new(), true)),
        }
    }
}

/// A cgroups-rs error as the I/O error under it, whose kind gives containerd its code (a task
/// that has gone: not found).
fn io_error(context: String) -> impl FnOnce(cgroups_rs::fs::error::Error) -> Error {
    move |e| {
        let io = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<std::io::Error>());
        let source = match io {
            Some(io) => io.raw_os_error().map_or_else(
                || std::io::Error::new(io.kind(), io.to_string()),
                std::io::Error::from_raw_os_error,
            ),
            None => std::io::Error::other(e.to_string()),
        };
        Error::Io { context, source }
    }
}

/// The directory of a controller (`…/c1/.` as cgroups-rs joins it becomes `…/c1`).
pub fn dir_of(controller: &impl Controller) -> PathBuf {
    controller.path().components().collect()
}

/// `key value` lines into a map.
fn flat_keyed(text: &str) -> HashMap<&str, u64> {
    text.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(' ')?;
            Some((k, v.trim().parse().ok()?))
        })
        .collect()
}

/// Metrics of the cgroups `pid` is in.
pub fn collect(pid: i32) -> Result<Any> {
    let cgroup = TaskCgroup::of_pid(pid)?;
    Ok(if cgroup.v2 {
        convert_to_any(Box::new(metrics_v2(&cgroup)))?
    } else {
        convert_to_any(Box::new(metrics_v1(&cgroup)))?
    })
}

/// A v1 limit (never negative in the files; cgroups-rs gives -1 for a missing kmem one).
fn limit_v1(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

/// The current and maximum pid counts (`max`: 0), 0 for what cannot be read.
fn pids(p: &PidController) -> (u64, u64) {
    let limit = match p.get_pid_max() {
        Ok(MaxValue::Value(v)) => u64::try_from(v).unwrap_or(0),
        _ => 0,
    };
    (p.get_pid_current().unwrap_or(0), limit)
}

fn metrics_v1(c: &TaskCgroup) -> v1::Metrics {
    let mut m = v1::Metrics::new();
    if let Some(mem) = &c.memory {
        m.memory = MessageField::some(memory_v1(mem));
    }
    if c.cpuacct.is_some() || c.cpu.is_some() {
        m.cpu = MessageField::some(cpu_v1(c));
    }
    if let Some((current, limit)) = c.pids.as_ref().map(pids) {
        let p = m.pids.mut_or_insert_default();
        (p.current, p.limit) = (current, limit);
    }
    m
}

/// v1's memory controller: `memory.stat` and the usage, swap, kernel and TCP counters.
fn memory_v1(mem: &MemController) -> v1::MemoryStat {
    let stat = mem.memory_stat();
    let g = |k: &str| stat.stat.raw.get(k).copied().unwrap_or(0);
    // cgroups-rs's Memory, MemSwap, Kmem and Tcp: the same four counters.
    macro_rules! entry {
        ($e:expr) => {{
            let e = $e;
            MessageField::some(v1::MemoryEntry {
                usage: e.usage_in_bytes,
                limit: limit_v1(e.limit_in_bytes),
                max: e.max_usage_in_bytes,
                failcnt: e.fail_cnt,
                ..Default::default()
            })
        }};
    }
    v1::MemoryStat {
        cache: g("cache"),
        rss: g("rss"),
        rss_huge: g("rss_huge"),
        mapped_file: g("mapped_file"),
        dirty: g("dirty"),
        writeback: g("writeback"),
        pg_pg_in: g("pgpgin"),
        pg_pg_out: g("pgpgout"),
        pg_fault: g("pgfault"),
        pg_maj_fault: g("pgmajfault"),
        inactive_anon: g("inactive_anon"),
        active_anon: g("active_anon"),
        inactive_file: g("inactive_file"),
        active_file: g("active_file"),
        unevictable: g("unevictable"),
        hierarchical_memory_limit: g("hierarchical_memory_limit"),
        hierarchical_swap_limit: g("hierarchical_memsw_limit"),
        total_cache: g("total_cache"),
        total_rss: g("total_rss"),
        total_rss_huge: g("total_rss_huge"),
        total_mapped_file: g("total_mapped_file"),
        total_dirty: g("total_dirty"),
        total_writeback: g("total_writeback"),
        total_pg_pg_in: g("total_pgpgin"),
        total_pg_pg_out: g("total_pgpgout"),
        total_pg_fault: g("total_pgfault"),
        total_pg_maj_fault: g("total_pgmajfault"),
        total_inactive_anon: g("total_inactive_anon"),
        total_active_anon: g("total_active_anon"),
        total_inactive_file: g("total_inactive_file"),
        total_active_file: g("total_active_file"),
        total_unevictable: g("total_unevictable"),
        usage: entry!(&stat),
        swap: entry!(mem.memswap()),
        kernel: entry!(mem.kmem_stat()),
        kernel_tcp: entry!(mem.kmem_tcp_stat()),
        ..Default::default()
    }
}

/// v1's cpuacct (usage, per CPU, user and system time) and cpu (throttling) controllers.
fn cpu_v1(c: &TaskCgroup) -> v1::CPUStat {
    let mut usage = v1::CPUUsage::new();
    if let Some(acct) = &c.cpuacct {
        let a = acct.cpuacct();
        usage.total = a.usage;
        usage.per_cpu = a
            .usage_percpu
            .split_whitespace()
            .filter_map(|v| v.parse().ok())
            .collect();
        // cpuacct.stat counts USER_HZ ticks; containerd reports nanoseconds.
        let stat = flat_keyed(&a.stat);
        let ticks_to_ns = 1_000_000_000 / clock_ticks();
        usage.user = stat.get("user").copied().unwrap_or(0) * ticks_to_ns;
        usage.kernel = stat.get("system").copied().unwrap_or(0) * ticks_to_ns;
    }
    let mut throttling = v1::Throttle::new();
    if let Some(cpu) = &c.cpu {
        let text = cpu.cpu().stat;
        let s = flat_keyed(&text);
        throttling.periods = s.get("nr_periods").copied().unwrap_or(0);
        throttling.throttled_periods = s.get("nr_throttled").copied().unwrap_or(0);
        throttling.throttled_time = s.get("throttled_time").copied().unwrap_or(0);
    }
    v1::CPUStat {
        usage: MessageField::some(usage),
        throttling: MessageField::some(throttling),
        ..Default::default()
    }
}

/// A v2 limit file: `max` the largest value, 0 when missing or unreadable.
fn limit_v2(mem: &MemController, file: &str) -> u64 {
    let text = std::fs::read_to_string(mem.path().join(file)).unwrap_or_default();
    match parse_max_value(&text) {
        Ok(MaxValue::Max) => u64::MAX,
        Ok(MaxValue::Value(v)) => u64::try_from(v).unwrap_or(0),
        Err(_) => 0,
    }
}

fn metrics_v2(c: &TaskCgroup) -> v2::Metrics {
    let mut m = v2::Metrics::new();
    if let Some(mem) = &c.memory {
        let stat = mem.memory_stat();
        let g = |k: &str| stat.stat.raw.get(k).copied().unwrap_or(0);
        m.memory = MessageField::some(v2::MemoryStat {
            anon: g("anon"),
            file: g("file"),
            kernel_stack: g("kernel_stack"),
            slab: g("slab"),
            sock: g("sock"),
            shmem: g("shmem"),
            file_mapped: g("file_mapped"),
            file_dirty: g("file_dirty"),
            file_writeback: g("file_writeback"),
            anon_thp: g("anon_thp"),
            inactive_anon: g("inactive_anon"),
            active_anon: g("active_anon"),
            inactive_file: g("inactive_file"),
            active_file: g("active_file"),
            unevictable: g("unevictable"),
            slab_reclaimable: g("slab_reclaimable"),
            slab_unreclaimable: g("slab_unreclaimable"),
            pgfault: g("pgfault"),
            pgmajfault: g("pgmajfault"),
            usage: stat.usage_in_bytes,
            usage_limit: limit_v2(mem, "memory.max"),
            swap_usage: mem.memswap().usage_in_bytes,
            swap_limit: limit_v2(mem, "memory.swap.max"),
            max_usage: stat.max_usage_in_bytes,
            ..Default::default()
        });
    }
    if let Some(cpu) = &c.cpu {
        let text = cpu.cpu().stat;
        let s = flat_keyed(&text);
        let stat = m.cpu.mut_or_insert_default();
        for (key, field) in [
            ("usage_usec", &mut stat.usage_usec),
            ("user_usec", &mut stat.user_usec),
            ("system_usec", &mut stat.system_usec),
            ("nr_periods", &mut stat.nr_periods),
            ("nr_throttled", &mut stat.nr_throttled),
            ("throttled_usec", &mut stat.throttled_usec),
        ] {
            *field = s.get(key).copied().unwrap_or(0);
        }
    }
    if let Some((current, limit)) = c.pids.as_ref().map(pids) {
        let p = m.pids.mut_or_insert_default();
        (p.current, p.limit) = (current, limit);
    }
    m
}

fn clock_ticks() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as u64
    } else {
        100
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use containerd_shim::protos::{protobuf::Message, ttrpc::Code};

    /// The test process's own cgroup, through the crate's hierarchy and `/proc/self/cgroup`:
    /// the metrics type of the host's cgroup version, with the memory it uses.
    #[test]
    fn own_cgroup_is_found_and_read() {
        let any = collect(std::process::id() as i32).unwrap();
        if hierarchies::auto().v2() {
            assert_eq!(any.type_url, "io.containerd.cgroups.v2.Metrics");
            let m = v2::Metrics::parse_from_bytes(&any.value).unwrap();
            assert!(m.cpu.usage_usec > 0, "{m:?}");
        } else {
            assert_eq!(any.type_url, "io.containerd.cgroups.v1.Metrics");
            let m = v1::Metrics::parse_from_bytes(&any.value).unwrap();
            assert!(m.memory.usage.usage > 0, "{m:?}");
            assert!(m.cpu.usage.total > 0, "{m:?}");
            let mem = TaskCgroup::of_pid(std::process::id() as i32)
                .unwrap()
                .memory
                .unwrap();
            let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
            let rel = own
                .lines()
                .find_map(|l| l.split_once(":memory:").map(|(_, p)| p.to_string()))
                .unwrap();
            assert!(dir_of(&mem).ends_with(rel.trim_start_matches('/')));
        }
    }

    /// A task that has gone: not found, as containerd expects for it.
    #[test]
    fn a_gone_task_is_not_found() {
        let e = collect(i32::MAX).unwrap_err();
        assert_eq!(e.code(), Code::NOT_FOUND, "{e}");
        assert!(e.to_string().starts_with("read cgroups of pid"), "{e}");
    }

    #[test]
    fn v1_values_are_read() {
        let root = tempfile::tempdir().unwrap();
        let mem = root.path().join("memory/c");
        let acct = root.path().join("cpuacct/c");
        std::fs::create_dir_all(&mem).unwrap();
        std::fs::create_dir_all(&acct).unwrap();
        std::fs::write(mem.join("memory.usage_in_bytes"), "4096\n").unwrap();
        std::fs::write(mem.join("memory.limit_in_bytes"), "8192\n").unwrap();
        std::fs::write(mem.join("memory.stat"), "rss 100\ncache 7\n").unwrap();
        std::fs::write(acct.join("cpuacct.usage"), "123456\n").unwrap();
        std::fs::write(acct.join("cpuacct.usage_percpu"), "100000 23456 \n").unwrap();
        let cgroup = TaskCgroup {
            memory: Some(MemController::new(mem, PathBuf::new(), false)),
            cpuacct: Some(CpuAcctController::new(acct, PathBuf::new())),
            ..Default::default()
        };
        let m = metrics_v1(&cgroup);
        assert_eq!(m.memory.usage.usage, 4096);
        assert_eq!(m.memory.usage.limit, 8192);
        assert_eq!(m.memory.rss, 100);
        assert_eq!(m.memory.kernel.limit, 0);
        assert_eq!(m.cpu.usage.total, 123456);
        assert_eq!(m.cpu.usage.per_cpu, vec![100000, 23456]);
    }

    #[test]
    fn v2_values_are_read() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("memory.current"), "5000\n").unwrap();
        std::fs::write(d.path().join("memory.max"), "max\n").unwrap();
        std::fs::write(d.path().join("cpu.stat"), "usage_usec 77\nuser_usec 50\n").unwrap();
        std::fs::write(d.path().join("pids.current"), "3\n").unwrap();
        std::fs::write(d.path().join("pids.max"), "max\n").unwrap();
        let m = metrics_v2(&TaskCgroup::v2_at(d.path()));
        assert_eq!(m.memory.usage, 5000);
        assert_eq!(m.memory.usage_limit, u64::MAX);
        assert_eq!(m.memory.swap_limit, 0);
        assert_eq!(m.cpu.usage_usec, 77);
        assert_eq!(m.pids.current, 3);
        assert_eq!(m.pids.limit, 0);
    }
}
