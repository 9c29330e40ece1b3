//! What operators see (docs/metrics.md): the node agent (`gpu-ckpt-agent`) on a real node's
//! event journal, scraped every second by a real Prometheus (Debian's, `$STACK/prometheus`, its
//! own TSDB in a temporary directory), while the node checkpoints and restores a pod through
//! CRI: one checkpoint and restore that succeed, one restore refused (a source outside
//! `RestoreSources`), one checkpoint that fails (an established TCP connection without
//! `gpu-ckpt.io/tcp`: CRIU's dump refuses it). Then PromQL through Prometheus' HTTP API
//! (`/api/v1/query`): the operations by outcome, the failing step's label, a duration histogram
//! per step (the p99 query of docs/metrics.md has a series per step), bytes moved, checkpoints on
//! disk and the signing key's id (from the records, as the chart runs the agent: no `--key-dir`,
//! held to node.pub's id), each held to the records the shim wrote (`journal::read_all`).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;
use test_containers::{
    cri::{ContainerSpec, Cri, PodSpec},
    stack::{Node, OptValue, Stack, GPU_CKPT_HANDLER},
};

/// A child process killed (and reaped) when dropped.
struct Proc {
    child: Child,
    what: &'static str,
    log: PathBuf,
}

impl Proc {
    fn start(what: &'static str, cmd: &mut Command, log: PathBuf) -> Result<Proc> {
        let f = std::fs::File::create(&log)?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f)
            .spawn()
            .with_context(|| format!("starting {what}: {cmd:?}"))?;
        Ok(Proc { child, what, log })
    }

    /// Fails, with its log, when the process has exited.
    fn alive(&mut self) -> Result<()> {
        if let Some(st) = self.child.try_wait()? {
            bail!(
                "{} exited ({st}):\n{}",
                self.what,
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
        Ok(())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free TCP port on 127.0.0.1.
fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// `GET path` on 127.0.0.1:port over HTTP/1.0: the status and the body.
fn http_get(port: u16, path: &str) -> Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("no HTTP head in {text:?}"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("no status in {head:?}"))?;
    Ok((status, body.to_string()))
}

/// `s` percent-encoded for a query string.
fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// An instant query: the result vector's samples as (labels, value).
fn query(port: u16, promql: &str) -> Result<Vec<(BTreeMap<String, String>, f64)>> {
    let (status, body) = http_get(port, &format!("/api/v1/query?query={}", urlencode(promql)))?;
    let v: Value = serde_json::from_str(&body)
        .with_context(|| format!("{promql}: not JSON (HTTP {status}): {body}"))?;
    ensure!(
        status == 200 && v["status"] == "success",
        "{promql}: HTTP {status}: {body}"
    );
    ensure!(v["data"]["resultType"] == "vector", "{promql}: {body}");
    let mut out = Vec::new();
    for r in v["data"]["result"].as_array().context("result")? {
        let labels = r["metric"]
            .as_object()
            .context("metric")?
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
            .collect();
        let value: f64 = r["value"][1]
            .as_str()
            .context("value")?
            .parse()
            .unwrap_or(f64::NAN);
        out.push((labels, value));
    }
    Ok(out)
}

/// Polls `promql` until `ok` holds of its result (Prometheus scrapes every second).
fn query_until(
    port: u16,
    promql: &str,
    what: &str,
    ok: impl Fn(&[(BTreeMap<String, String>, f64)]) -> bool,
) -> Result<Vec<(BTreeMap<String, String>, f64)>> {
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let r = query(port, promql)?;
        if ok(&r) {
            return Ok(r);
        }
        if Instant::now() > end {
            bail!("{what}: `{promql}` is {r:?}");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The agent binary: in the stack's shim directory (`GPU_CKPT_SHIM_DIR`), else the workspace's
/// target/debug.
pub(crate) fn agent_bin() -> PathBuf {
    let p = Stack::discover()
        .map(|s| s.shim_dir())
        .unwrap_or_else(|_| PathBuf::from("target/debug"))
        .join("gpu-ckpt-agent");
    if p.exists() {
        p
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/gpu-ckpt-agent")
    }
}

/// `tool` (`prometheus`, `promtool`) of Debian's Prometheus in the stack
/// (test-containers/stack/install.sh).
pub(crate) fn prometheus_tool(tool: &str) -> Result<PathBuf> {
    let p = Stack::discover()?
        .prefix()
        .join("prometheus/usr/bin")
        .join(tool);
    ensure!(
        p.exists(),
        "{} is missing: run test-containers/stack/install.sh (make deps)",
        p.display()
    );
    Ok(p)
}

/// A pod whose container holds an established TCP connection to itself, without
/// `gpu-ckpt.io/tcp`: CRIU's dump refuses it.
fn tcp_spec() -> ContainerSpec {
    ContainerSpec::new("client", workloads()).command(&[
        "/bin/sh",
        "-c",
        "/bin/echo-server --listen 127.0.0.1:17811 & sleep 0.3; exec /bin/echo-client --connect 127.0.0.1:17811 --interval-ms 100 > /client.log",
    ])
}

#[test]
fn prometheus_scrapes_the_agent_while_the_node_checkpoints_and_restores() -> Result<()> {
    let name = "metrics-a";
    let keys = node_key_dir(name);
    let _ = std::fs::remove_dir_all(&keys);
    let key = keys.join("node.key").display().to_string();
    let stack = Stack::discover()?;
    let events = stack.prefix().join("nodes").join(format!("{name}-events"));
    let _ = std::fs::remove_dir_all(&events);
    let mut restore = restore_handler(name, RESTORE_HANDLER)?;
    restore
        .options
        .insert("SigningKey".into(), OptValue::from(key.clone()));
    restore
        .options
        .insert("EventsDir".into(), OptValue::from(events.as_path()));
    let node = node_with(
        Node::builder(name)?
            .runtime_option("SigningKey", key.clone())
            .runtime_option("EventsDir", events.as_path())
            .extra_runtime(restore),
    )?;
    let work = tempfile::tempdir()?;
    let ckpt_dir = node.paths().dir.join("metrics-checkpoints");
    let _ = std::fs::remove_dir_all(&ckpt_dir);
    std::fs::create_dir_all(&ckpt_dir)?;

    // The agent, before any record (the journal's directory is not there yet), and Prometheus
    // scraping it every second.
    let agent_port = free_port()?;
    let mut agent = Proc::start(
        "gpu-ckpt-agent",
        Command::new(agent_bin())
            .arg("--listen")
            .arg(format!("127.0.0.1:{agent_port}"))
            .arg("--events-dir")
            .arg(&events)
            .arg("--checkpoint-dir")
            .arg(&ckpt_dir)
            // No --key-dir, as the chart runs it: the key id comes from the records.
            .env("RUST_LOG", "debug"),
        work.path().join("agent.log"),
    )?;
    let prom_port = free_port()?;
    let config = work.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: gpu-ckpt-agent\n    static_configs:\n      \
             - targets: ['127.0.0.1:{agent_port}']\n        labels:\n          node: {name}\n"
        ),
    )?;
    let mut prom = Proc::start(
        "prometheus",
        Command::new(prometheus_tool("prometheus")?)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                work.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
            .arg("--storage.tsdb.retention.time=1h"),
        work.path().join("prometheus.log"),
    )?;
    // Prometheus up and its target healthy.
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        agent.alive()?;
        prom.alive()?;
        if let Ok(r) = query(prom_port, "up{job=\"gpu-ckpt-agent\"}") {
            if r.iter().any(|(_, v)| *v == 1.0) {
                break;
            }
        }
        ensure!(Instant::now() < end, "Prometheus never scraped the agent");
        std::thread::sleep(Duration::from_millis(300));
    }
    let (status, body) = http_get(agent_port, "/healthz")?;
    ensure!(
        status == 200 && body.trim() == "ok",
        "/healthz: {status} {body}"
    );

    rt().block_on(async {
        let cri = Cri::connect(node.socket()).await?;
        // One checkpoint and restore that succeed.
        let (pod, id) = cri_counter_pod(&cri, &node, "worker").await?;
        cri_counter_above(&cri, &id, "/counter.txt", 3).await?;
        let archive = ckpt_dir.join("checkpoint-worker_default-counter.tar");
        cri.checkpoint_container(&id, &archive, 60).await?;
        cri.remove_pod(&pod).await?;
        try_restore(
            &cri,
            &node,
            RESTORE_HANDLER,
            "default",
            &archive.display().to_string(),
        )
        .await?
        .map_err(anyhow::Error::msg)
        .context("the restore of the checkpoint")?;
        // One restore refused: a source outside RestoreSources.
        let outside = work.path().join("elsewhere.tar");
        std::fs::copy(&archive, &outside)?;
        let refused = try_restore(
            &cri,
            &node,
            RESTORE_HANDLER,
            "default",
            &outside.display().to_string(),
        )
        .await?;
        ensure!(
            refused.is_err(),
            "a checkpoint outside RestoreSources was restored"
        );
        // One checkpoint that fails at CRIU's dump.
        let pod = cri
            .run_pod(&PodSpec::new("tcp", node.pod_log_root()).handler(GPU_CKPT_HANDLER))
            .await?;
        let cid = cri.run_container(&pod, &tcp_spec()).await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let failed = cri
            .checkpoint_container(
                &cid,
                &ckpt_dir.join("checkpoint-tcp_default-client.tar"),
                60,
            )
            .await;
        let err = format!(
            "{:#}",
            failed.err().context("the TCP checkpoint succeeded")?
        );
        ensure!(
            err.contains("criu-dump"),
            "the failed checkpoint's error: {err}"
        );
        cri.remove_pod(&pod).await?;
        anyhow::Ok(())
    })?;

    // What the shim wrote.
    let (records, skipped) = journal::read_all(&events)?;
    ensure!(skipped.total() == 0, "{skipped:?}");
    let mut want: BTreeMap<(String, String), f64> = BTreeMap::new();
    for r in &records {
        *want
            .entry((r.operation.as_str().into(), r.outcome.as_str().into()))
            .or_default() += 1.0;
    }
    let expected: BTreeMap<(String, String), f64> = [
        (("checkpoint", "succeeded"), 1.0),
        (("checkpoint", "failed"), 1.0),
        (("restore", "succeeded"), 1.0),
        (("restore", "refused"), 1.0),
    ]
    .into_iter()
    .map(|((o, r), n)| ((o.to_string(), r.to_string()), n))
    .collect();
    ensure!(want == expected, "the journal holds {want:?}: {records:#?}");

    // Counts by outcome.
    let by_outcome = |r: &[(BTreeMap<String, String>, f64)]| -> BTreeMap<(String, String), f64> {
        r.iter()
            .map(|(l, v)| ((l["operation"].clone(), l["outcome"].clone()), *v))
            .collect()
    };
    let got = query_until(
        prom_port,
        "sum by (operation, outcome) (gpu_ckpt_operations_total)",
        "operations by outcome",
        |r| by_outcome(r) == expected,
    )?;
    println!("operations: {:?}", by_outcome(&got));

    // The failing step's label, and the refusal's check and class.
    let failed = query(prom_port, "gpu_ckpt_operations_total{outcome=\"failed\"}")?;
    ensure!(failed.len() == 1, "{failed:?}");
    ensure!(
        failed[0].0["failed_step"] == "criu-dump" && failed[0].0["operation"] == "checkpoint",
        "{failed:?}"
    );
    ensure!(failed[0].0["node"] == name, "{failed:?}");
    let by_step = query(
        prom_port,
        "sum by (failed_step) (gpu_ckpt_operations_total{outcome=~\"failed|refused\"})",
    )?;
    let refusal = records
        .iter()
        .find(|r| r.outcome.as_str() == "refused")
        .and_then(|r| r.error.clone())
        .context("no refusal's error in the journal")?;
    let steps: BTreeMap<String, f64> = by_step
        .iter()
        .map(|(l, v)| (l.get("failed_step").cloned().unwrap_or_default(), *v))
        .collect();
    ensure!(
        steps.get("criu-dump") == Some(&1.0) && steps.get(&refusal.step) == Some(&1.0),
        "failures by step: {steps:?} (the refusal: {refusal:?})"
    );
    let refused = query(prom_port, "gpu_ckpt_operations_total{outcome=\"refused\"}")?;
    ensure!(
        refused.len() == 1
            && refused[0].0["error_class"] == refusal.class
            && !refusal.step.is_empty(),
        "{refused:?}"
    );
    // Nothing was counted twice or skipped.
    let total = query(prom_port, "sum(gpu_ckpt_operations_total)")?;
    ensure!(total.first().map(|t| t.1) == Some(4.0), "{total:?}");
    let skipped = query(prom_port, "gpu_ckpt_journal_records_skipped_total")?;
    ensure!(skipped.first().map(|t| t.1) == Some(0.0), "{skipped:?}");

    // A duration histogram per step: every step the records name, by operation.
    let mut want_steps: BTreeMap<(String, String), f64> = BTreeMap::new();
    for r in &records {
        for s in &r.steps {
            *want_steps
                .entry((r.operation.as_str().into(), s.name.clone()))
                .or_default() += 1.0;
        }
    }
    ensure!(
        want_steps
            .keys()
            .any(|(o, s)| o == "checkpoint" && s == "criu-dump"),
        "no criu-dump step in the records: {want_steps:?}"
    );
    ensure!(
        want_steps.keys().any(|(o, _)| o == "restore"),
        "no restore step in the records: {want_steps:?}"
    );
    let counts = query(
        prom_port,
        "sum by (operation, step) (gpu_ckpt_step_duration_seconds_count)",
    )?;
    let got_steps: BTreeMap<(String, String), f64> = counts
        .iter()
        .map(|(l, v)| ((l["operation"].clone(), l["step"].clone()), *v))
        .collect();
    ensure!(
        got_steps == want_steps,
        "step counts {got_steps:?}, records {want_steps:?}"
    );
    let p99 = query(
        prom_port,
        "histogram_quantile(0.99, sum by (le, step) (rate(gpu_ckpt_step_duration_seconds_bucket[5m])))",
    )?;
    let p99_steps: BTreeSet<String> = p99.iter().map(|(l, _)| l["step"].clone()).collect();
    let names: BTreeSet<String> = want_steps.keys().map(|(_, s)| s.clone()).collect();
    ensure!(
        p99_steps == names,
        "p99 by step has {p99_steps:?}, the records {names:?}"
    );
    let buckets = query(
        prom_port,
        "count by (step) (gpu_ckpt_step_duration_seconds_bucket{operation=\"checkpoint\",step=\"criu-dump\"})",
    )?;
    ensure!(
        buckets.first().map(|b| b.1) == Some(14.0),
        "criu-dump's buckets (13 bounds and +Inf): {buckets:?}"
    );
    // The p99 restore time per node (the docs' query, by the target's node label).
    let restore_p99 = query(
        prom_port,
        "histogram_quantile(0.99, sum by (le, node) (rate(gpu_ckpt_operation_duration_seconds_bucket{operation=\"restore\",outcome=\"succeeded\"}[5m])))",
    )?;
    ensure!(
        restore_p99.len() == 1 && restore_p99[0].0["node"] == name,
        "{restore_p99:?}"
    );
    let frozen = query(
        prom_port,
        "sum(gpu_ckpt_frozen_seconds_count{operation=\"checkpoint\"})",
    )?;
    let frozen_records = records
        .iter()
        .filter(|r| r.frozen_seconds.is_some())
        .count() as f64;
    ensure!(
        frozen.first().map(|f| f.1) == Some(frozen_records),
        "{frozen:?}"
    );

    // Bytes moved, as the records say.
    let host: u64 = records
        .iter()
        .filter(|r| r.operation.as_str() == "checkpoint")
        .map(|r| r.host_bytes)
        .sum();
    ensure!(host > 0, "no host bytes in the checkpoint records");
    let moved = query(
        prom_port,
        "gpu_ckpt_moved_bytes_total{operation=\"checkpoint\",memory=\"host\"}",
    )?;
    ensure!(
        moved.first().map(|m| m.1) == Some(host as f64),
        "{moved:?} != {host}"
    );

    // Checkpoints on disk (the one archive) and their bytes; the key the checkpoint was signed with.
    let size = std::fs::metadata(ckpt_dir.join("checkpoint-worker_default-counter.tar"))?.len();
    query_until(
        prom_port,
        "gpu_ckpt_checkpoints_on_disk",
        "checkpoints on disk",
        |r| r.first().map(|x| x.1) == Some(1.0),
    )?;
    // The agent walks the directories at most every 10 s: a walk made while the archive was
    // being written is served until the next.
    query_until(
        prom_port,
        "gpu_ckpt_checkpoints_on_disk_bytes",
        &format!("{size} bytes on disk"),
        |r| r.first().map(|x| x.1) == Some(size as f64),
    )?;
    // The agent has no --key-dir: the id it serves is the checkpoint record's signing_key, which
    // must be the node's key as image_format::sign computes it from node.pub.
    let signed = records
        .iter()
        .rev()
        .find(|r| r.operation.as_str() == "checkpoint" && r.signing_key.is_some())
        .and_then(|r| r.signing_key.clone())
        .context("no checkpoint record carries signing_key")?;
    let key_id = image_format::sign::key_id(&image_format::sign::read_public_key(
        &keys.join("node.pub"),
    )?);
    ensure!(
        signed == key_id,
        "the record says {signed}, the node's key is {key_id}"
    );
    let info = query(prom_port, "gpu_ckpt_signing_key_info")?;
    ensure!(
        info.len() == 1 && info[0].0["key_id"] == key_id && info[0].1 == 1.0,
        "{info:?}, the node's key {key_id}"
    );
    agent.alive()?;
    prom.alive()?;
    Ok(())
}
