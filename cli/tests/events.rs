//! `gpu-ckpt events` end to end: records written by the journal (as the shim writes them), read
//! back by the command, filtered, as text, JSON and YAML; a torn line skipped with a warning.

mod command;

use std::io::Write;

use journal::{Journal, Operation, Outcome, Record, RecordError, StepTime};

fn run(args: &[&str]) -> (i32, String, String) {
    command::run(args, &[])
}

fn record(op: Operation, outcome: Outcome, pod: &str, secs_ago: u64) -> Record {
    let mut r = Record::new(op, "k8s.io", &format!("{pod}-0123456789"));
    r.time =
        journal::rfc3339(std::time::SystemTime::now() - std::time::Duration::from_secs(secs_ago));
    r.outcome = outcome;
    r.pod = Some(pod.into());
    r.pod_namespace = Some("ml".into());
    r.container = Some("server".into());
    r.duration_seconds = 2.25;
    r.steps = vec![StepTime {
        name: "criu-dump".into(),
        seconds: 1.0,
    }];
    r
}

#[test]
fn events_reads_filters_and_prints_the_records() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("events");
    let d = dir.to_str().unwrap();

    // No journal yet: nothing, and no failure.
    let (rc, out, err) = run(&["events", "--events-dir", d]);
    assert_eq!((rc, out.as_str()), (0, ""), "{err}");
    let (rc, out, _) = run(&["events", "--events-dir", d, "-o", "json"]);
    assert_eq!(rc, 0);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&out).unwrap(),
        serde_json::json!([])
    );

    let j = Journal::open(&dir, journal::DEFAULT_SEGMENT_BYTES).unwrap();
    j.append(&record(
        Operation::Checkpoint,
        Outcome::Succeeded,
        "llm",
        7200,
    ))
    .unwrap();
    let mut refused = record(Operation::Restore, Outcome::Refused, "llm", 60);
    refused.error = Some(RecordError {
        step: "trust".into(),
        class: "refused".into(),
        message: "signed by key k1, which this node does not trust".into(),
    });
    j.append(&refused).unwrap();
    // A writer killed mid-write.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(dir.join(journal::CURRENT_FILE))
        .unwrap();
    f.write_all(b"{\"v\":1,\"id\":\"dead").unwrap();
    drop(f);
    let mut failed = record(Operation::Checkpoint, Outcome::Failed, "web", 30);
    failed.error = Some(RecordError {
        step: "criu-dump".into(),
        class: "step".into(),
        message: "CRIU exited with 1".into(),
    });
    j.append(&failed).unwrap();

    let (rc, out, err) = run(&["events", "--events-dir", d]);
    assert_eq!(rc, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert!(
        lines[0].contains("checkpoint  succeeded  ml/llm/server  2.25s"),
        "{out}"
    );
    assert!(
        lines[1].contains(
            "restore     refused    ml/llm/server  2.25s  trust (refused): signed by key k1"
        ),
        "{out}"
    );
    assert!(
        lines[2].contains("failed     ml/web/server")
            && lines[2].contains("criu-dump (step): CRIU exited with 1"),
        "{out}"
    );
    assert!(err.contains("1 damaged or torn line(s)"), "{err}");

    let (rc, out, _) = run(&["events", "--events-dir", d, "-o", "json"]);
    assert_eq!(rc, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 3);
    assert_eq!(v[1]["outcome"], "refused");
    assert_eq!(v[1]["error"]["step"], "trust");
    assert_eq!(v[2]["steps"][0]["name"], "criu-dump");
    assert_eq!(v[0]["crc"].as_str().unwrap().len(), 16);

    let pods = |args: &[&str]| -> Vec<String> {
        let mut all = vec!["events", "--events-dir", d, "--json"];
        all.extend_from_slice(args);
        let (rc, out, err) = run(&all);
        assert_eq!(rc, 0, "{args:?}: {err}");
        let v: Vec<Record> = serde_json::from_str(&out).unwrap();
        v.into_iter()
            .map(|r| format!("{}/{}", r.pod.unwrap(), r.outcome))
            .collect()
    };
    assert_eq!(pods(&["--outcome", "failed"]), ["web/failed"]);
    assert_eq!(pods(&["--operation", "restore"]), ["llm/refused"]);
    assert_eq!(pods(&["--pod", "llm"]), ["llm/succeeded", "llm/refused"]);
    assert_eq!(
        pods(&["--pod-namespace", "ml", "--limit", "2"]),
        ["llm/refused", "web/failed"]
    );
    assert_eq!(pods(&["--container", "web-0123"]), ["web/failed"]);
    assert_eq!(pods(&["--namespace", "default"]), Vec::<String>::new());
    assert_eq!(pods(&["--since", "1h"]), ["llm/refused", "web/failed"]);
    assert_eq!(pods(&["--since", "45s"]), ["web/failed"]);

    let (rc, out, _) = run(&[
        "events",
        "--events-dir",
        d,
        "-o",
        "yaml",
        "--outcome",
        "failed",
    ]);
    assert_eq!(rc, 0);
    assert!(out.contains("step: criu-dump"), "{out}");

    // Usage errors exit 2, with the error as JSON where asked.
    let (rc, out, _) = run(&[
        "events",
        "--events-dir",
        d,
        "--since",
        "a while",
        "-o",
        "json",
    ]);
    assert_eq!(rc, 2, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["class"], "usage");
    let (rc, _, _) = run(&["events", "--events-dir", d, "--outcome", "maybe"]);
    assert_eq!(rc, 2);

    // A journal directory that is a symbolic link is refused (I/O class).
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&dir, &link).unwrap();
    let (rc, _, err) = run(&["events", "--events-dir", link.to_str().unwrap()]);
    assert_eq!(rc, 3, "{err}");
    assert!(err.contains("symbolic link"), "{err}");
}
