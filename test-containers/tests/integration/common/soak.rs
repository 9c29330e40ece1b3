//! What a soak measures of a shim: its open file descriptors and resident memory, sampled
//! once a cycle, and the least-squares slope of each over the cycles.

use std::time::Duration;

use anyhow::{Context, Result};

/// One sample of a shim process.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShimSample {
    /// Entries of `/proc/<pid>/fd`.
    pub fds: u64,
    /// `VmRSS` of `/proc/<pid>/status`, KiB.
    pub rss_kib: u64,
    /// `Threads` of `/proc/<pid>/status`.
    pub threads: u64,
}

/// Samples process `pid` (a shim) once it has been left alone for `settle`: the least of five
/// readings 100 ms apart, so that work the last request left running in the background (an
/// exec's output copy, a blocking thread about to end) does not count, while a leak shows in
/// every reading.
pub fn sample_shim(pid: i32, settle: Duration) -> Result<ShimSample> {
    std::thread::sleep(settle);
    let mut least: Option<ShimSample> = None;
    for i in 0..5 {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(100));
        }
        let s = read_shim(pid)?;
        least = Some(match least {
            None => s,
            Some(l) => ShimSample {
                fds: l.fds.min(s.fds),
                rss_kib: l.rss_kib.min(s.rss_kib),
                threads: l.threads.min(s.threads),
            },
        });
    }
    least.context("no reading")
}

fn read_shim(pid: i32) -> Result<ShimSample> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .with_context(|| format!("the fds of shim {pid}"))?
        .count() as u64;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("the status of shim {pid}"))?;
    let field = |name: &str| -> Result<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("no {name} in /proc/{pid}/status"))
    };
    Ok(ShimSample {
        fds,
        rss_kib: field("VmRSS:")?,
        threads: field("Threads:")?,
    })
}

/// The least-squares slope of `ys` over their indices (units per step); 0 for fewer than two.
pub fn slope(ys: &[f64]) -> f64 {
    let n = ys.len() as f64;
    if ys.len() < 2 {
        return 0.0;
    }
    let mean_x = (n - 1.0) / 2.0;
    let mean_y = ys.iter().sum::<f64>() / n;
    let (mut num, mut den) = (0.0, 0.0);
    for (i, y) in ys.iter().enumerate() {
        let dx = i as f64 - mean_x;
        num += dx * (y - mean_y);
        den += dx * dx;
    }
    num / den
}

/// The slopes of a run of samples: (fds per step, KiB of RSS per step).
pub fn slopes(samples: &[ShimSample]) -> (f64, f64) {
    let fds: Vec<f64> = samples.iter().map(|s| s.fds as f64).collect();
    let rss: Vec<f64> = samples.iter().map(|s| s.rss_kib as f64).collect();
    (slope(&fds), slope(&rss))
}

/// A size of the soak from the environment variable `var`, else `default`.
pub fn soak_size(var: &str, default: usize) -> Result<usize> {
    match std::env::var(var) {
        Ok(v) => v
            .parse()
            .with_context(|| format!("{var}={v:?} is not a count")),
        Err(_) => Ok(default),
    }
}

/// The serving shim process whose command line names `id` (`-id <id>`) on the node with
/// containerd socket `socket`.
pub fn shim_with_id(socket: &std::path::Path, id: &str) -> Option<i32> {
    let socket = socket.display().to_string();
    let id_arg = format!("-id {id} ");
    test_containers::stack::processes_matching(&[
        "containerd-shim-gpu-ckpt-v1",
        "-address",
        &socket,
        &id_arg,
    ])
    .into_iter()
    .find(|pid| {
        std::fs::read(format!("/proc/{pid}/cmdline"))
            .map(|c| {
                !String::from_utf8_lossy(&c)
                    .replace('\0', " ")
                    .ends_with(" start ")
            })
            .unwrap_or(false)
    })
}
