//! `gpu-ckpt-agent-bench AGENT [--seconds N] [--records K]` (`make bench-agent`; not shipped):
//! the node agent's cost, side by side with a baseline.
//!
//! 1. The agent starts on an empty journal; K records (checkpoints and restores with five steps
//!    each, as the shim writes them) are appended through `Journal::append`, then it is left
//!    idle N seconds (it polls the journal every second), then scraped once a second for N
//!    seconds (HTTP GET /metrics, as Prometheus would).
//! 2. The baseline: Python's `http.server` (one thread, as the agent) serving a static copy of the agent's last /metrics
//!    body (a trivial exporter), idle N seconds, then scraped the same way.
//!
//! For each: CPU (the threads' schedstat run time, in ms per second of wall time) and memory
//! (VmRSS at the end of the phase, VmHWM), printed as a table with the agent / baseline ratios.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use journal::{Journal, Operation, Outcome, Record, RecordError, StepTime};

struct Args {
    agent: PathBuf,
    seconds: u64,
    records: u64,
}

fn args() -> Result<Args> {
    let mut it = std::env::args().skip(1);
    let mut a = Args {
        agent: PathBuf::new(),
        seconds: 30,
        records: 10_000,
    };
    while let Some(x) = it.next() {
        match x.as_str() {
            "--seconds" => a.seconds = it.next().context("--seconds N")?.parse()?,
            "--records" => a.records = it.next().context("--records K")?.parse()?,
            _ if a.agent.as_os_str().is_empty() => a.agent = PathBuf::from(x),
            _ => bail!("usage: gpu-ckpt-agent-bench AGENT [--seconds N] [--records K]"),
        }
    }
    if a.agent.as_os_str().is_empty() {
        bail!("usage: gpu-ckpt-agent-bench AGENT [--seconds N] [--records K]");
    }
    Ok(a)
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn get(port: u16, path: &str) -> Result<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").context("no HTTP head")?;
    if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
        bail!("GET {path}: {head}");
    }
    Ok(body.to_string())
}

fn wait_up(port: u16, path: &str) -> Result<()> {
    let end = Instant::now() + Duration::from_secs(20);
    while Instant::now() < end {
        if get(port, path).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("nothing answers on 127.0.0.1:{port}{path}")
}

/// CPU time of `pid`'s threads, in ns: the first field of each `/proc/PID/task/TID/schedstat`
/// (nanoseconds on the CPU), summed. `/proc/PID/stat`'s utime and stime count 10 ms ticks, too
/// coarse for a process that runs a few milliseconds a minute. A thread that exited within a phase
/// takes its time with it; the agent's threads (the runtime's, the blocking pool's) live on.
fn cpu_ns(pid: u32) -> Result<u64> {
    let mut total = 0u64;
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let t = t?;
        let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) else {
            continue;
        };
        let ns: u64 = s.split_whitespace().next().context("schedstat")?.parse()?;
        total += ns;
    }
    Ok(total)
}

/// VmRSS and VmHWM of `pid`, in KiB.
fn mem_kib(pid: u32) -> Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Ok((field("VmRSS:"), field("VmHWM:")))
}

#[derive(Clone, Copy, Debug)]
struct Phase {
    cpu_ms_per_s: f64,
    rss_kib: u64,
    hwm_kib: u64,
}

/// Runs `n` seconds, with a GET of `path` every second when `scraped`.
fn phase(pid: u32, port: u16, path: &str, n: u64, scraped: bool) -> Result<Phase> {
    let c0 = cpu_ns(pid)?;
    let t0 = Instant::now();
    for i in 1..=n {
        if scraped {
            get(port, path)?;
        }
        let next = t0 + Duration::from_secs(i);
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
    let c1 = cpu_ns(pid)?;
    let (rss, hwm) = mem_kib(pid)?;
    Ok(Phase {
        cpu_ms_per_s: c1.saturating_sub(c0) as f64 / 1e6 / t0.elapsed().as_secs_f64(),
        rss_kib: rss,
        hwm_kib: hwm,
    })
}

fn record(i: u64) -> Record {
    let op = if i.is_multiple_of(2) {
        Operation::Checkpoint
    } else {
        Operation::Restore
    };
    let mut r = Record::new(op, "k8s.io", &format!("{i:064x}"));
    r.pod = Some(format!("trainer-{}", i % 50));
    r.pod_namespace = Some("ml".into());
    r.container = Some("trainer".into());
    let names: &[&str] = if i.is_multiple_of(2) {
        &[
            "device-lock",
            "device-checkpoint",
            "criu-dump",
            "manifest",
            "sign",
        ]
    } else {
        &[
            "verify",
            "runc-restore",
            "device-restore",
            "device-unlock",
            "resume",
        ]
    };
    r.steps = names
        .iter()
        .enumerate()
        .map(|(k, n)| StepTime {
            name: (*n).into(),
            seconds: 0.01 * (1 + k as u64 + i % 7) as f64,
        })
        .collect();
    r.duration_seconds = r.steps.iter().map(|s| s.seconds).sum();
    r.frozen_seconds = (i.is_multiple_of(2)).then_some(0.2);
    r.host_bytes = 1 << 30;
    r.device_bytes = 4 << 30;
    r.gpus = vec!["GPU-00000000-0000-0000-0000-000000000000".into()];
    if i % 100 == 99 {
        r.outcome = Outcome::Failed;
        r.error = Some(RecordError {
            step: names[2].into(),
            class: "step".into(),
            message: "injected".into(),
        });
    }
    r
}

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn main() -> Result<()> {
    let a = args()?;
    let tmp = tempfile::tempdir()?;
    let events = tmp.path().join("events");
    let ckpts = tmp.path().join("checkpoints");
    std::fs::create_dir_all(&ckpts)?;
    for i in 0..20 {
        std::fs::write(
            ckpts.join(format!("checkpoint-p{i}_ns-c-0.tar")),
            vec![0u8; 4096],
        )?;
    }

    let port = free_port()?;
    let agent = Kill(
        Command::new(&a.agent)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--events-dir")
            .arg(&events)
            .arg("--checkpoint-dir")
            .arg(&ckpts)
            .arg("--key-dir")
            .arg(tmp.path().join("keys"))
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", a.agent.display()))?,
    );
    let pid = agent.0.id();
    wait_up(port, "/healthz")?;
    let j = Journal::open(&events, journal::DEFAULT_SEGMENT_BYTES)?;
    let t = Instant::now();
    let c0 = cpu_ns(pid)?;
    for i in 0..a.records {
        j.append(&record(i))?;
    }
    let appended = t.elapsed();
    // Counted: the last scrape shows every record.
    let body = loop {
        let body = get(port, "/metrics")?;
        let n: f64 = body
            .lines()
            .filter(|l| l.starts_with("gpu_ckpt_operations_total{"))
            .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
            .sum();
        if n as u64 >= a.records {
            break body;
        }
        if t.elapsed() > Duration::from_secs(120) {
            bail!("the agent counted {n} of {} records", a.records);
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let ingest_ms = cpu_ns(pid)?.saturating_sub(c0) / 1_000_000;
    let idle = phase(pid, port, "/metrics", a.seconds, false)?;
    let scraped = phase(pid, port, "/metrics", a.seconds, true)?;
    drop(agent);

    // The baseline: a trivial exporter serving the same body.
    let www = tmp.path().join("www");
    std::fs::create_dir_all(&www)?;
    std::fs::write(www.join("metrics"), &body)?;
    let bport = free_port()?;
    let base = Kill(
        Command::new("python3")
            // One thread, as the agent has: `python3 -m http.server` starts a thread per
            // request, whose CPU time would leave with it.
            .args([
                "-c",
                "import http.server as h, sys; h.HTTPServer(('127.0.0.1', int(sys.argv[1])), h.SimpleHTTPRequestHandler).serve_forever()",
                &bport.to_string(),
            ])
            .current_dir(&www)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting python3's http.server")?,
    );
    let bpid = base.0.id();
    wait_up(bport, "/metrics")?;
    let bidle = phase(bpid, bport, "/metrics", a.seconds, false)?;
    let bscraped = phase(bpid, bport, "/metrics", a.seconds, true)?;
    drop(base);

    println!(
        "gpu-ckpt-agent {} ({} records appended in {:.2} s, counted with {ingest_ms} ms of the agent's CPU; /metrics body {} bytes; {} s per phase)",
        a.agent.display(),
        a.records,
        appended.as_secs_f64(),
        body.len(),
        a.seconds
    );
    println!(
        "{:<28} {:>14} {:>12} {:>12}",
        "", "CPU ms/s", "VmRSS KiB", "VmHWM KiB"
    );
    let row = |name: &str, p: &Phase| {
        println!(
            "{name:<28} {:>14.3} {:>12} {:>12}",
            p.cpu_ms_per_s, p.rss_kib, p.hwm_kib
        )
    };
    row("agent idle", &idle);
    row("agent scraped 1/s", &scraped);
    row("baseline idle", &bidle);
    row("baseline scraped 1/s", &bscraped);
    let ratio = |x: f64, y: f64| {
        if y > 0.0 {
            format!("{:.2}", x / y)
        } else {
            "-".into()
        }
    };
    println!(
        "agent / baseline: idle CPU {}, scraped CPU {}, scraped RSS {}",
        ratio(idle.cpu_ms_per_s, bidle.cpu_ms_per_s),
        ratio(scraped.cpu_ms_per_s, bscraped.cpu_ms_per_s),
        ratio(scraped.rss_kib as f64, bscraped.rss_kib as f64)
    );
    Ok(())
}
