//! Container metrics straight from the cgroup files, for cgroup v1 (each controller mounted on
//! its own, cpu and cpuacct possibly together) and v2, in the protobuf types containerd decodes
//! (`io.containerd.cgroups.v1.Metrics` / `io.containerd.cgroups.v2.Metrics`).

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use containerd_shim::protos::{
    cgroups::metrics as v1,
    cgroups_v2::metrics as v2,
    protobuf::{well_known_types::any::Any, MessageField},
};
use containerd_shim::util::convert_to_any;

use crate::error::{Error, Result};

/// The cgroup directories of a process: per v1 controller, or the one v2 directory.
#[derive(Debug, PartialEq)]
enum Cgroups {
    V1(HashMap<String, PathBuf>),
    V2(PathBuf),
}

impl Cgroups {
    fn of_pid(pid: i32, root: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .map_err(Error::io(format!("read cgroups of pid {pid}")))?;
        Ok(Self::parse(&text, root))
    }

    fn parse(text: &str, root: &Path) -> Self {
        let mut v1 = HashMap::new();
        let mut unified = None;
        for line in text.lines() {
            let mut parts = line.splitn(3, ':');
            let (Some(_), Some(controllers), Some(path)) =
                (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            let rel = path.trim_start_matches('/');
            if controllers.is_empty() {
                unified = Some(rel.to_string());
                continue;
            }
            // A co-mounted hierarchy ("cpu,cpuacct") is a directory of that joint name.
            let mount = root.join(controllers);
            for c in controllers.split(',') {
                let dir = if root.join(c).exists() {
                    root.join(c)
                } else {
                    mount.clone()
                };
                v1.insert(c.to_string(), dir.join(rel));
            }
        }
        if v1.contains_key("memory") || v1.contains_key("cpuacct") {
            Cgroups::V1(v1)
        } else {
            Cgroups::V2(root.join(unified.unwrap_or_default()))
        }
    }
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

fn num(path: &Path) -> u64 {
    read(path)
        .and_then(|s| {
            let s = s.trim();
            if s == "max" {
                Some(u64::MAX)
            } else {
                s.parse().ok()
            }
        })
        .unwrap_or(0)
}

/// `key value` lines into a map.
fn flat_keyed(path: &Path) -> HashMap<String, u64> {
    read(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(' ')?;
            Some((k.to_string(), v.trim().parse().ok()?))
        })
        .collect()
}

/// Metrics of the cgroups `pid` is in.
pub fn collect(pid: i32) -> Result<Any> {
    collect_at(pid, Path::new("/sys/fs/cgroup"))
}

fn collect_at(pid: i32, root: &Path) -> Result<Any> {
    Ok(match Cgroups::of_pid(pid, root)? {
        Cgroups::V1(dirs) => convert_to_any(Box::new(metrics_v1(&dirs)))?,
        Cgroups::V2(dir) => convert_to_any(Box::new(metrics_v2(&dir)))?,
    })
}

fn metrics_v1(dirs: &HashMap<String, PathBuf>) -> v1::Metrics {
    let mut m = v1::Metrics::new();
    if let Some(d) = dirs.get("memory") {
        let s = flat_keyed(&d.join("memory.stat"));
        let g = |k: &str| s.get(k).copied().unwrap_or(0);
        let entry = |prefix: &str| v1::MemoryEntry {
            usage: num(&d.join(format!("{prefix}usage_in_bytes"))),
            limit: num(&d.join(format!("{prefix}limit_in_bytes"))),
            max: num(&d.join(format!("{prefix}max_usage_in_bytes"))),
            failcnt: num(&d.join(format!("{prefix}failcnt"))),
            ..Default::default()
        };
        m.memory = MessageField::some(v1::MemoryStat {
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
            usage: MessageField::some(entry("memory.")),
            swap: MessageField::some(entry("memory.memsw.")),
            kernel: MessageField::some(entry("memory.kmem.")),
            kernel_tcp: MessageField::some(entry("memory.kmem.tcp.")),
            ..Default::default()
        });
    }
    let cpuacct = dirs.get("cpuacct");
    let cpu = dirs.get("cpu");
    if cpuacct.is_some() || cpu.is_some() {
        let mut usage = v1::CPUUsage::new();
        if let Some(d) = cpuacct {
            usage.total = num(&d.join("cpuacct.usage"));
            usage.per_cpu = read(&d.join("cpuacct.usage_percpu"))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|v| v.parse().ok())
                .collect();
            // cpuacct.stat counts USER_HZ ticks; containerd reports nanoseconds.
            let stat = flat_keyed(&d.join("cpuacct.stat"));
            let ticks_to_ns = 1_000_000_000 / clock_ticks();
            usage.user = stat.get("user").copied().unwrap_or(0) * ticks_to_ns;
            usage.kernel = stat.get("system").copied().unwrap_or(0) * ticks_to_ns;
        }
        let mut throttling = v1::Throttle::new();
        if let Some(d) = cpu {
            let s = flat_keyed(&d.join("cpu.stat"));
            throttling.periods = s.get("nr_periods").copied().unwrap_or(0);
            throttling.throttled_periods = s.get("nr_throttled").copied().unwrap_or(0);
            throttling.throttled_time = s.get("throttled_time").copied().unwrap_or(0);
        }
        m.cpu = MessageField::some(v1::CPUStat {
            usage: MessageField::some(usage),
            throttling: MessageField::some(throttling),
            ..Default::default()
        });
    }
    if let Some(d) = dirs.get("pids") {
        let limit = num(&d.join("pids.max"));
        m.pids = MessageField::some(v1::PidsStat {
            current: num(&d.join("pids.current")),
            limit: if limit == u64::MAX { 0 } else { limit },
            ..Default::default()
        });
    }
    m
}

fn metrics_v2(d: &Path) -> v2::Metrics {
    let mut m = v2::Metrics::new();
    let s = flat_keyed(&d.join("memory.stat"));
    let g = |k: &str| s.get(k).copied().unwrap_or(0);
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
        usage: num(&d.join("memory.current")),
        usage_limit: num(&d.join("memory.max")),
        swap_usage: num(&d.join("memory.swap.current")),
        swap_limit: num(&d.join("memory.swap.max")),
        max_usage: num(&d.join("memory.peak")),
        ..Default::default()
    });
    let c = flat_keyed(&d.join("cpu.stat"));
    let g = |k: &str| c.get(k).copied().unwrap_or(0);
    m.cpu = MessageField::some(v2::CPUStat {
        usage_usec: g("usage_usec"),
        user_usec: g("user_usec"),
        system_usec: g("system_usec"),
        nr_periods: g("nr_periods"),
        nr_throttled: g("nr_throttled"),
        throttled_usec: g("throttled_usec"),
        ..Default::default()
    });
    let limit = num(&d.join("pids.max"));
    m.pids = MessageField::some(v2::PidsStat {
        current: num(&d.join("pids.current")),
        limit: if limit == u64::MAX { 0 } else { limit },
        ..Default::default()
    });
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

    #[test]
    fn hybrid_hosts_are_v1_and_comounts_resolve() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("cpu,cpuacct")).unwrap();
        std::fs::create_dir_all(root.path().join("memory")).unwrap();
        let text = "4:cpu,cpuacct:/default/c1\n5:memory:/default/c1\n0::/default/c1\n";
        let Cgroups::V1(dirs) = Cgroups::parse(text, root.path()) else {
            panic!("v1 expected")
        };
        assert_eq!(dirs["memory"], root.path().join("memory/default/c1"));
        assert_eq!(dirs["cpuacct"], root.path().join("cpu,cpuacct/default/c1"));
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
        let dirs = HashMap::from([("memory".to_string(), mem), ("cpuacct".to_string(), acct)]);
        let m = metrics_v1(&dirs);
        assert_eq!(m.memory.usage.usage, 4096);
        assert_eq!(m.memory.usage.limit, 8192);
        assert_eq!(m.memory.rss, 100);
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
        let m = metrics_v2(d.path());
        assert_eq!(m.memory.usage, 5000);
        assert_eq!(m.memory.usage_limit, u64::MAX);
        assert_eq!(m.cpu.usage_usec, 77);
        assert_eq!(m.pids.current, 3);
        assert_eq!(m.pids.limit, 0);
    }
}
