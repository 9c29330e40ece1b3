//! docs/metrics.md's alert rules and queries, held to Prometheus' own tools: the rules block
//! (marked `<!-- promtool: rules -->`) through the stack's `promtool check rules` and
//! `promtool test rules` with the unit tests below (a node's first checkpoint failure, a
//! series that appears at 1, must fire; a refused restore; a failure on an older series; a slow
//! freeze; an agent not scraped; and a fleet where nothing fails, where nothing fires); the
//! PrometheusRule block (marked `<!-- promtool: prometheusrule -->`) must carry the same
//! `groups`; each `promql` block of the "Queries" section is checked as a recording rule, and
//! its `gpu_ckpt_*` names against the families the agent (target/debug/gpu-ckpt-agent, on a
//! temporary journal) serves. No containerd node; root only to write the journal as the shim
//! does.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use journal::{Journal, Operation, Outcome, Record, RecordError, StepTime};
use serde_yaml::Value;

use crate::metrics::{agent_bin, prometheus_tool};

const RULES_MARKER: &str = "<!-- promtool: rules -->";
const OPERATOR_MARKER: &str = "<!-- promtool: prometheusrule -->";

fn doc() -> Result<String> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/metrics.md");
    std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))
}

/// The fenced block right after the line `marker` (blank lines between allowed).
fn block_after(md: &str, marker: &str) -> Result<String> {
    let mut lines = md.lines().skip_while(|l| l.trim() != marker);
    ensure!(lines.next().is_some(), "docs/metrics.md has no {marker}");
    let mut lines = lines.skip_while(|l| l.trim().is_empty());
    let open = lines.next().unwrap_or_default();
    ensure!(
        open.starts_with("```"),
        "{marker} is not followed by a fenced block"
    );
    let mut body = String::new();
    for l in lines {
        if l.starts_with("```") {
            return Ok(body);
        }
        body.push_str(l);
        body.push('\n');
    }
    bail!("the block after {marker} is not closed")
}

/// The `promql` blocks of the section "## Queries".
fn queries(md: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_section = false;
    let mut cur: Option<String> = None;
    for l in md.lines() {
        if let Some(c) = cur.as_mut() {
            if l.starts_with("```") {
                out.push(cur.take().unwrap());
            } else {
                c.push_str(l);
                c.push('\n');
            }
            continue;
        }
        if l.starts_with("## ") {
            in_section = l.trim() == "## Queries";
        } else if in_section && l.trim() == "```promql" {
            cur = Some(String::new());
        }
    }
    out
}

fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(out.status.success(), "{cmd:?} failed:\n{text}");
    Ok(text)
}

fn alert_names(rules: &Value) -> Vec<String> {
    rules["groups"]
        .as_sequence()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_sequence().into_iter().flatten())
        .filter_map(|r| r["alert"].as_str().map(String::from))
        .collect()
}

/// The unit tests of the rules (rule file `bare.yml`: the doc's rules without annotations,
/// whose texts these tests do not repeat; `promtool check rules` has parsed their templates).
/// Series are scraped every minute, as Prometheus would, with the agent's labels and the
/// `node` the ServiceMonitor adds.
fn unit_tests(alerts: &[String]) -> String {
    const A: &str = r#"job="gpu-ckpt-agent",instance="10.0.0.1:9402",node="n1""#;
    const B: &str = r#"job="gpu-ckpt-agent",instance="10.0.0.2:9402",node="n2""#;
    let healthy = |minutes: u32| {
        format!(
            r#"      - series: 'up{{{A}}}'
        values: '1x{minutes}'
      - series: 'gpu_ckpt_journal_records_skipped_total{{{A}}}'
        values: '0x{minutes}'
      - series: 'gpu_ckpt_journal_records_skipped_total{{{B}}}'
        values: '0x{minutes}'
      - series: 'kube_daemonset_status_number_unavailable{{job="kube-state-metrics",namespace="gpu-ckpt-system",daemonset="gpu-ckpt-agent"}}'
        values: '0x{minutes}'
      - series: 'gpu_ckpt_operations_total{{{A},operation="checkpoint",outcome="succeeded",failed_step="",error_class=""}}'
        values: '1+1x{minutes}'
      - series: 'gpu_ckpt_operations_total{{{B},operation="restore",outcome="succeeded",failed_step="",error_class=""}}'
        values: '_x5 1+1x{minutes}'
      - series: 'gpu_ckpt_frozen_seconds_bucket{{{A},operation="checkpoint",le="1"}}'
        values: '1+1x{minutes}'
      - series: 'gpu_ckpt_frozen_seconds_bucket{{{A},operation="checkpoint",le="30"}}'
        values: '1+1x{minutes}'
      - series: 'gpu_ckpt_frozen_seconds_bucket{{{A},operation="checkpoint",le="+Inf"}}'
        values: '1+1x{minutes}'
"#
        )
    };
    let mut t = String::from("rule_files: [bare.yml]\nevaluation_interval: 1m\ntests:\n");
    // 1. Failures. Node n1's first checkpoint failure: its series appears at 1 at 20m (no
    // `increase()` sees it). n2: a first refused restore at 20m; a restore failure on a series
    // that has held 1 since the start, rising to 2 at 20m (`increase()` sees that one); from
    // 30m its checkpoints freeze 30-60 s (p95 > 30 s); from 40m it is not scraped.
    t.push_str("  - interval: 1m\n    input_series:\n");
    t.push_str(&healthy(70));
    t.push_str(&format!(
        r#"      - series: 'up{{{B}}}'
        values: '1x40 0x30'
      - series: 'gpu_ckpt_operations_total{{{A},operation="checkpoint",outcome="failed",failed_step="criu-dump",error_class="step"}}'
        values: '_x20 1x50'
      - series: 'gpu_ckpt_operations_total{{{B},operation="restore",outcome="refused",failed_step="trust",error_class="refused"}}'
        values: '_x20 1x50'
      - series: 'gpu_ckpt_operations_total{{{B},operation="restore",outcome="failed",failed_step="criu-restore",error_class="step"}}'
        values: '1x20 2x50'
      - series: 'gpu_ckpt_frozen_seconds_bucket{{{B},operation="checkpoint",le="30"}}'
        values: '_x30 0x40'
      - series: 'gpu_ckpt_frozen_seconds_bucket{{{B},operation="checkpoint",le="60"}}'
        values: '_x30 1+1x40'
      - series: 'gpu_ckpt_frozen_seconds_bucket{{{B},operation="checkpoint",le="+Inf"}}'
        values: '_x30 1+1x40'
    alert_rule_test:
      - eval_time: 19m
        alertname: GpuCkptCheckpointFailures
      - eval_time: 20m
        alertname: GpuCkptCheckpointFailures
        exp_alerts:
          - exp_labels: {{ severity: warning, node: n1, failed_step: criu-dump, error_class: step }}
      - eval_time: 34m
        alertname: GpuCkptCheckpointFailures
        exp_alerts:
          - exp_labels: {{ severity: warning, node: n1, failed_step: criu-dump, error_class: step }}
      - eval_time: 40m
        alertname: GpuCkptCheckpointFailures
      - eval_time: 20m
        alertname: GpuCkptRestoresRefused
        exp_alerts:
          - exp_labels: {{ severity: warning, node: n2, failed_step: trust }}
      - eval_time: 18m
        alertname: GpuCkptRestoreFailures
      - eval_time: 21m
        alertname: GpuCkptRestoreFailures
        exp_alerts:
          - exp_labels: {{ severity: critical, node: n2, failed_step: criu-restore, error_class: step }}
      - eval_time: 30m
        alertname: GpuCkptSlowFreeze
      - eval_time: 50m
        alertname: GpuCkptSlowFreeze
        exp_alerts:
          - exp_labels: {{ severity: warning, node: n2 }}
      - eval_time: 45m
        alertname: GpuCkptAgentDown
      - eval_time: 55m
        alertname: GpuCkptAgentDown
        exp_alerts:
          - exp_labels: {{ severity: warning, job: gpu-ckpt-agent, instance: "10.0.0.2:9402", node: n2 }}
"#
    ));
    // 2. Nothing fails: no rule fires, at any time.
    t.push_str("  - interval: 1m\n    input_series:\n");
    t.push_str(&format!(
        "{}      - series: 'up{{{B}}}'\n        values: '1x70'\n",
        healthy(70)
    ));
    t.push_str("    alert_rule_test:\n");
    for at in ["1m", "20m", "40m", "70m"] {
        for a in alerts {
            t.push_str(&format!(
                "      - eval_time: {at}\n        alertname: {a}\n"
            ));
        }
    }
    t
}

#[test]
fn the_documented_alert_rules_load_and_fire_on_the_first_failure() -> Result<()> {
    let md = doc()?;
    let rules_text = block_after(&md, RULES_MARKER)?;
    let rules: Value = serde_yaml::from_str(&rules_text).context("the rules block")?;
    let operator: Value = serde_yaml::from_str(&block_after(&md, OPERATOR_MARKER)?)
        .context("the PrometheusRule block")?;
    ensure!(
        operator["kind"] == "PrometheusRule"
            && operator["apiVersion"] == "monitoring.coreos.com/v1",
        "the block after {OPERATOR_MARKER} is no PrometheusRule"
    );
    ensure!(
        operator["spec"]["groups"] == rules["groups"],
        "the PrometheusRule's spec.groups differ from the rules block's groups"
    );
    let alerts = alert_names(&rules);
    for a in [
        "GpuCkptCheckpointFailures",
        "GpuCkptRestoreFailures",
        "GpuCkptRestoresRefused",
        "GpuCkptSlowFreeze",
        "GpuCkptAgentDown",
    ] {
        ensure!(alerts.iter().any(|x| x == a), "no alert {a} in {alerts:?}");
    }

    let work = tempfile::tempdir()?;
    let promtool = prometheus_tool("promtool")?;
    std::fs::write(work.path().join("rules.yml"), &rules_text)?;
    let out = run(Command::new(&promtool)
        .args(["check", "rules", "rules.yml"])
        .current_dir(work.path()))?;
    eprintln!("{out}");

    let mut bare = rules.clone();
    for g in bare["groups"].as_sequence_mut().context("groups")? {
        for r in g["rules"].as_sequence_mut().context("rules")? {
            r.as_mapping_mut().context("a rule")?.remove("annotations");
        }
    }
    std::fs::write(work.path().join("bare.yml"), serde_yaml::to_string(&bare)?)?;
    let tests = unit_tests(&alerts);
    std::fs::write(work.path().join("tests.yml"), &tests)?;
    let out = run(Command::new(&promtool)
        .args(["test", "rules", "tests.yml"])
        .current_dir(work.path()))
    .with_context(|| format!("the unit tests:\n{tests}"))?;
    eprintln!("{out}");
    Ok(())
}

/// A child process killed (and reaped) when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `GET /metrics` as Prometheus asks for it (OpenMetrics).
fn scrape(port: u16) -> Result<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\nAccept: application/openmetrics-text; version=1.0.0\r\n\r\n"
    )?;
    let mut buf = String::new();
    s.read_to_string(&mut buf)?;
    let (_, body) = buf.split_once("\r\n\r\n").context("no HTTP head")?;
    Ok(body.to_string())
}

/// The sample names the agent serves once each family has a series: it runs on an empty
/// journal, a checkpoint, a failure and a refusal are appended, and its `# TYPE` lines give
/// each family's samples (`_total` of a counter, `_bucket`/`_sum`/`_count` of a histogram).
fn agent_samples() -> Result<BTreeSet<String>> {
    let work = tempfile::tempdir()?;
    let events = work.path().join("events");
    std::fs::create_dir(&events)?;
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let _agent = Proc(
        Command::new(agent_bin())
            .args(["--listen", &format!("127.0.0.1:{port}"), "--events-dir"])
            .arg(&events)
            .args(["--poll-interval-ms", "50"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", agent_bin().display()))?,
    );
    let end = Instant::now() + Duration::from_secs(30);
    while scrape(port).is_err() {
        ensure!(Instant::now() < end, "the agent does not answer on {port}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let j = Journal::open(&events, journal::DEFAULT_SEGMENT_BYTES)?;
    let mut ok = Record::new(Operation::Checkpoint, "k8s.io", "c1");
    ok.steps = vec![StepTime {
        name: "criu-dump".into(),
        seconds: 1.0,
    }];
    ok.duration_seconds = 1.2;
    ok.frozen_seconds = Some(1.0);
    ok.host_bytes = 1000;
    ok.device_bytes = 500;
    ok.signing_key = Some(format!("ed25519:{}", "0".repeat(32)));
    j.append(&ok)?;
    for (op, outcome, step) in [
        (Operation::Checkpoint, Outcome::Failed, "criu-dump"),
        (Operation::Restore, Outcome::Refused, "trust"),
    ] {
        let mut r = Record::new(op, "k8s.io", "c2");
        r.outcome = outcome;
        r.error = Some(RecordError {
            step: step.into(),
            class: "step".into(),
            message: "boom".into(),
        });
        r.steps = vec![StepTime {
            name: step.into(),
            seconds: 0.5,
        }];
        j.append(&r)?;
    }
    loop {
        let text = scrape(port)?;
        let mut names = BTreeSet::new();
        for l in text.lines() {
            let Some(rest) = l.strip_prefix("# TYPE ") else {
                continue;
            };
            let (name, kind) = rest.split_once(' ').context("a TYPE line")?;
            match kind {
                "counter" => {
                    names.insert(format!("{}_total", name.trim_end_matches("_total")));
                }
                "histogram" => {
                    for s in ["_bucket", "_sum", "_count"] {
                        names.insert(format!("{name}{s}"));
                    }
                }
                _ => {
                    names.insert(name.to_string());
                }
            }
        }
        if names.contains("gpu_ckpt_frozen_seconds_bucket")
            && names.contains("gpu_ckpt_signing_key_info")
        {
            return Ok(names);
        }
        ensure!(
            Instant::now() < end,
            "the agent did not count the records:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn the_documented_queries_parse_and_name_the_agents_metrics() -> Result<()> {
    let md = doc()?;
    let qs = queries(&md);
    ensure!(
        qs.len() >= 5,
        "the Queries section has {} promql blocks",
        qs.len()
    );
    let served = agent_samples()?;
    let mut file = String::from("groups:\n  - name: docs-queries\n    rules:\n");
    for (i, q) in qs.iter().enumerate() {
        let q = q.trim();
        for word in q.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if word.starts_with("gpu_ckpt_") {
                ensure!(
                    served.contains(word),
                    "query {q:?} names {word}, which the agent does not serve ({served:?})"
                );
            }
        }
        file.push_str(&format!(
            "      - record: docs_query_{i}\n        expr: {}\n",
            serde_yaml::to_string(q)?
                .trim_end()
                .replace('\n', "\n          ")
        ));
    }
    let work = tempfile::tempdir()?;
    std::fs::write(work.path().join("queries.yml"), &file)?;
    run(Command::new(prometheus_tool("promtool")?)
        .args(["check", "rules", "queries.yml"])
        .current_dir(work.path()))
    .with_context(|| format!("the queries as recording rules:\n{file}"))?;
    Ok(())
}
