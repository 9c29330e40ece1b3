//! `gpu-ckpt events`: the node's records of checkpoints and restores (the journal the shims
//! write, crate `journal`), filtered, oldest first: one line each, or the records as JSON/YAML.

use std::path::PathBuf;
use std::time::SystemTime;

use anyhow::{Context, Result};
use journal::{Operation, Outcome, Record};

use crate::exit::CliError;
use crate::output::{OutputArgs, Report, Text};

#[derive(clap::Args, Debug)]
pub struct EventsArgs {
    /// The journal's directory (the handler option EventsDir).
    #[arg(long, value_name = "DIR", default_value = journal::DEFAULT_DIR)]
    pub events_dir: PathBuf,
    /// Only checkpoints or only restores.
    #[arg(long, value_enum)]
    pub operation: Option<OperationArg>,
    /// Only operations that ended so.
    #[arg(long, value_enum)]
    pub outcome: Option<OutcomeArg>,
    /// Only containers of this containerd namespace (k8s.io for pods, default for ctr).
    #[arg(long, value_name = "NS")]
    pub namespace: Option<String>,
    /// Only this pod's containers.
    #[arg(long)]
    pub pod: Option<String>,
    /// Only pods of this Kubernetes namespace.
    #[arg(long, value_name = "NS")]
    pub pod_namespace: Option<String>,
    /// Only this container: its name in the pod, its id, or the start of its id.
    #[arg(long)]
    pub container: Option<String>,
    /// Only records since then: a duration back from now (10m, 2h, 3d) or an RFC 3339 time
    /// (2026-01-02T03:04:05Z, or with an offset).
    #[arg(long, value_name = "WHEN")]
    pub since: Option<String>,
    /// Only the newest N records (of those that match).
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    #[command(flatten)]
    pub out: OutputArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OperationArg {
    Checkpoint,
    Restore,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OutcomeArg {
    Succeeded,
    Failed,
    Refused,
}

impl From<OperationArg> for Operation {
    fn from(o: OperationArg) -> Operation {
        match o {
            OperationArg::Checkpoint => Operation::Checkpoint,
            OperationArg::Restore => Operation::Restore,
        }
    }
}

impl From<OutcomeArg> for Outcome {
    fn from(o: OutcomeArg) -> Outcome {
        match o {
            OutcomeArg::Succeeded => Outcome::Succeeded,
            OutcomeArg::Failed => Outcome::Failed,
            OutcomeArg::Refused => Outcome::Refused,
        }
    }
}

/// `--since` as a time: a duration back from `now`, or an RFC 3339 time.
pub fn since(s: &str, now: SystemTime) -> Result<SystemTime, CliError> {
    if let Ok(d) = humantime::parse_duration(s) {
        return Ok(now.checked_sub(d).unwrap_or(SystemTime::UNIX_EPOCH));
    }
    journal::parse_time(s).ok_or_else(|| {
        CliError::Usage(format!(
            "--since {s:?}: neither a duration (10m, 2h) nor an RFC 3339 time (2026-01-02T03:04:05Z)"
        ))
    })
}

/// Whether `r` passes the filters of `a` (`since` already parsed).
fn matches(a: &EventsArgs, since: Option<SystemTime>, r: &Record) -> bool {
    let eq =
        |want: &Option<String>, have: Option<&str>| want.as_deref().is_none_or(|w| have == Some(w));
    a.operation
        .is_none_or(|o| Operation::from(o) == r.operation)
        && a.outcome.is_none_or(|o| Outcome::from(o) == r.outcome)
        && eq(&a.namespace, Some(&r.namespace))
        && eq(&a.pod, r.pod.as_deref())
        && eq(&a.pod_namespace, r.pod_namespace.as_deref())
        && a.container.as_deref().is_none_or(|c| {
            r.container.as_deref() == Some(c) || (!c.is_empty() && r.container_id.starts_with(c))
        })
        && since.is_none_or(|s| journal::parse_time(&r.time).is_some_and(|t| t >= s))
}

/// The records of `all` that pass the filters, oldest first, the newest `--limit` of them.
pub fn select(a: &EventsArgs, all: Vec<Record>, now: SystemTime) -> Result<Vec<Record>, CliError> {
    let since = a.since.as_deref().map(|s| since(s, now)).transpose()?;
    let mut picked: Vec<Record> = all.into_iter().filter(|r| matches(a, since, r)).collect();
    if let Some(n) = a.limit {
        let drop = picked.len().saturating_sub(n);
        picked.drain(..drop);
    }
    Ok(picked)
}

/// Who the record is about: `pod-namespace/pod/container` when the CRI names are known, else
/// `namespace/container-id` (containerd's).
fn who(r: &Record) -> String {
    match &r.pod {
        Some(pod) => format!(
            "{}/{}/{}",
            sanitize(r.pod_namespace.as_deref().unwrap_or("-")),
            sanitize(pod),
            sanitize(r.container.as_deref().unwrap_or(&r.container_id))
        ),
        None => format!("{}/{}", sanitize(&r.namespace), sanitize(&r.container_id)),
    }
}

/// Whether `c` must not reach a terminal as it is: a control character (C0, DEL, C1), a format
/// character (Unicode's Cf: bidi embeddings, overrides and isolates, zero-width characters, the
/// soft hyphen, tags, ...), or a line or paragraph separator (Zl, Zp).
fn unprintable(c: char) -> bool {
    c.is_control()
        || matches!(
            c as u32,
            0xad | 0x600..=0x605
                | 0x61c
                | 0x6dd
                | 0x70f
                | 0x890..=0x891
                | 0x8e2
                | 0x180e
                | 0x200b..=0x200f
                | 0x2028..=0x202e
                | 0x2060..=0x2064
                | 0x2066..=0x206f
                | 0xfeff
                | 0xfff9..=0xfffb
                | 0x110bd
                | 0x110cd
                | 0x13430..=0x1343f
                | 0x1bca0..=0x1bca3
                | 0x1d173..=0x1d17a
                | 0xe0001
                | 0xe0020..=0xe007f
        )
}

/// `s` safe to print on a terminal: a line break or tab as a space, every other unprintable
/// character escaped as `\u{XX}` (so an ESC sequence, a bidi override or a second line in a
/// record's field can neither change the terminal nor disguise what the line says).
pub fn sanitize(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\n' | '\r' | '\t' => out.push(' '),
            c if unprintable(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// One record's line: time, operation, outcome, who, duration, and the failed step, its class
/// and message.
pub fn line(r: &Record) -> String {
    let mut s = format!(
        "{}  {:<10}  {:<9}  {}  {}",
        sanitize(&r.time),
        r.operation.as_str(),
        r.outcome.as_str(),
        who(r),
        seconds(r.duration_seconds)
    );
    if let Some(e) = &r.error {
        s.push_str(&format!(
            "  {} ({}): {}",
            sanitize(&e.step),
            sanitize(&e.class),
            sanitize(&e.message)
        ));
    }
    s
}

fn seconds(s: f64) -> String {
    if s >= 1.0 || s == 0.0 {
        format!("{s:.2}s")
    } else {
        format!("{:.0}ms", s * 1000.0)
    }
}

pub fn run(a: &EventsArgs) -> Result<Report> {
    let span = tracing::info_span!("events", dir = %a.events_dir.display());
    let _g = span.enter();
    let (all, skipped) = journal::read_all(&a.events_dir)
        .with_context(|| format!("reading the records in {}", a.events_dir.display()))?;
    if skipped.total() > 0 {
        eprintln!(
            "gpu-ckpt: warning: {} damaged or torn line(s) in {} skipped",
            skipped.total(),
            a.events_dir.display()
        );
    }
    let picked = select(a, all, SystemTime::now())?;
    let mut t = Text::default();
    for r in &picked {
        t.line(line(r));
    }
    let data = serde_json::to_value(&picked)?;
    Ok(Report::new(t.0, data))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use journal::RecordError;
    use std::time::Duration;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: EventsArgs,
    }

    fn args(v: &[&str]) -> EventsArgs {
        let mut all = vec!["events"];
        all.extend_from_slice(v);
        Cli::try_parse_from(all).unwrap().a
    }

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_767_323_045 + secs)
    }

    fn rec(i: u64, op: Operation, outcome: Outcome, pod: Option<&str>) -> Record {
        let mut r = Record::new(op, "k8s.io", &format!("{i:02}cafe{i}"));
        r.time = journal::rfc3339(at(i * 60));
        r.outcome = outcome;
        r.pod = pod.map(str::to_string);
        r.pod_namespace = pod.map(|_| "ml".to_string());
        r.container = pod.map(|_| "server".to_string());
        r.duration_seconds = 1.5;
        r
    }

    fn sample() -> Vec<Record> {
        let mut ctr = rec(3, Operation::Checkpoint, Outcome::Failed, None);
        ctr.namespace = "default".into();
        ctr.error = Some(RecordError {
            step: "criu-dump".into(),
            class: "step".into(),
            message: "CRIU failed:\nsee the log".into(),
        });
        vec![
            rec(0, Operation::Checkpoint, Outcome::Succeeded, Some("llm")),
            rec(1, Operation::Restore, Outcome::Refused, Some("llm")),
            rec(2, Operation::Restore, Outcome::Succeeded, Some("web")),
            ctr,
        ]
    }

    fn pick(v: &[&str]) -> Vec<String> {
        select(&args(v), sample(), at(4 * 60))
            .unwrap()
            .into_iter()
            .map(|r| r.container_id)
            .collect()
    }

    #[test]
    fn filters_pick_the_records() {
        assert_eq!(pick(&[]), ["00cafe0", "01cafe1", "02cafe2", "03cafe3"]);
        assert_eq!(pick(&["--operation", "restore"]), ["01cafe1", "02cafe2"]);
        assert_eq!(pick(&["--outcome", "refused"]), ["01cafe1"]);
        assert_eq!(pick(&["--outcome", "failed"]), ["03cafe3"]);
        assert_eq!(pick(&["--namespace", "default"]), ["03cafe3"]);
        assert_eq!(pick(&["--pod", "llm"]), ["00cafe0", "01cafe1"]);
        assert_eq!(
            pick(&["--pod", "llm", "--operation", "checkpoint"]),
            ["00cafe0"]
        );
        assert_eq!(pick(&["--pod-namespace", "ml"]).len(), 3);
        assert_eq!(pick(&["--pod-namespace", "other"]).len(), 0);
        assert_eq!(pick(&["--container", "server"]).len(), 3);
        assert_eq!(pick(&["--container", "03caf"]), ["03cafe3"]);
        assert_eq!(pick(&["--limit", "2"]), ["02cafe2", "03cafe3"]);
        assert_eq!(pick(&["--limit", "0"]).len(), 0);
        assert_eq!(pick(&["--pod", "llm", "--limit", "1"]), ["01cafe1"]);
        // Now is 4 minutes after the first: 150s back keeps those of minutes 2 and 3.
        assert_eq!(pick(&["--since", "150s"]), ["02cafe2", "03cafe3"]);
        assert_eq!(pick(&["--since", "2m"]), ["02cafe2", "03cafe3"]);
        let t = journal::rfc3339(at(60));
        assert_eq!(pick(&["--since", &t]), ["01cafe1", "02cafe2", "03cafe3"]);
        assert_eq!(
            pick(&["--since", "2026-01-02T05:06:05+02:00"]),
            ["02cafe2", "03cafe3"]
        );
    }

    #[test]
    fn a_bad_since_is_a_usage_error() {
        let e = select(&args(&["--since", "last tuesday"]), sample(), at(0)).unwrap_err();
        assert!(matches!(e, CliError::Usage(_)), "{e}");
        assert!(e.to_string().contains("last tuesday"));
    }

    #[test]
    fn a_record_is_one_line() {
        let all = sample();
        assert_eq!(
            line(&all[0]),
            "2026-01-02T03:04:05.000Z  checkpoint  succeeded  ml/llm/server  1.50s"
        );
        assert_eq!(
            line(&all[3]),
            "2026-01-02T03:07:05.000Z  checkpoint  failed     default/03cafe3  1.50s  \
             criu-dump (step): CRIU failed: see the log"
        );
        let mut r = all[1].clone();
        r.duration_seconds = 0.0123;
        assert!(line(&r).contains("  12ms"), "{}", line(&r));
    }

    /// Every field printed is escaped: ESC sequences, C1 controls, bidi overrides, zero-width
    /// and line-separator characters in the names, the step, the class and the message.
    #[test]
    fn every_field_printed_is_escaped() {
        let evil = "\u{1b}]0;owned\u{7}\u{1b}[2J\u{9b}31m\u{202e}gpj.exe\u{200b}\u{2028}x\u{85}";
        let mut r = rec(1, Operation::Restore, Outcome::Failed, Some(evil));
        r.pod_namespace = Some(format!("ns{evil}"));
        r.container = Some(format!("ctr{evil}"));
        r.time = format!("2026-01-02T03:05:05.000Z{evil}");
        r.error = Some(RecordError {
            step: format!("step{evil}"),
            class: format!("class{evil}"),
            message: format!("msg{evil}\nnext"),
        });
        let mut ctr = r.clone();
        ctr.pod = None;
        ctr.namespace = format!("default{evil}");
        ctr.container_id = format!("id{evil}");
        for r in [r, ctr] {
            let l = line(&r);
            assert!(
                l.chars().all(|c| !unprintable(c)),
                "an unprintable character in {l:?}"
            );
            assert!(!l.contains('\n'), "{l:?}");
            assert!(l.contains("\\u{1b}]0;owned\\u{7}"), "{l}");
            assert!(
                l.contains("\\u{202e}gpj.exe\\u{200b}\\u{2028}x\\u{85}"),
                "{l}"
            );
        }
        let l = line(&rec(1, Operation::Restore, Outcome::Failed, Some(evil)));
        assert!(l.contains("ml/\\u{1b}]0;owned"), "{l}");
        // Printable text, accents and all, is kept.
        assert_eq!(sanitize("café/naïve-ü"), "café/naïve-ü");
        assert_eq!(sanitize("a\tb\r\nc"), "a b  c");
    }
}
