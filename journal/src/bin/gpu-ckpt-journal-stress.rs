//! `gpu-ckpt-journal-stress DIR SEGMENT_BYTES WRITER [COUNT]`: appends records to the journal in
//! DIR through `Journal::append` (the shim's), in a loop (COUNT records, or until killed), and
//! prints each record's sequence number on stdout once `append` returned. The crash test
//! (tests/crash.rs) kills it at random moments and checks what is left.
//!
//! Record `seq` of writer `W`: `container_id` W, `pod` `seq-<seq>`, `host_bytes` seq,
//! `device_bytes` [`stamp`]`(W, seq)`, and a `checkpoint` of a size by seq: small, a few KiB,
//! close to the 64 KiB cap, or past it (shrunk by `append`), starting with `W/<seq>/`.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use journal::{Journal, Operation, Outcome, Record, RecordError, StepTime};

/// What `device_bytes` of writer `w`'s record `seq` holds.
fn stamp(w: &str, seq: u64) -> u64 {
    let h = blake3::hash(format!("{w}/{seq}").as_bytes());
    u64::from_le_bytes(h.as_bytes()[..8].try_into().unwrap_or([0; 8])) >> 1
}

fn record(w: &str, seq: u64) -> Record {
    let mut r = Record::new(
        if seq % 2 == 0 {
            Operation::Checkpoint
        } else {
            Operation::Restore
        },
        "k8s.io",
        w,
    );
    r.pod = Some(format!("seq-{seq}"));
    r.host_bytes = seq;
    r.device_bytes = stamp(w, seq);
    let pad = match seq % 4 {
        0 => 100,
        1 => 6_000,
        2 => 62_000,
        _ => 120_000,
    };
    let mut ck = format!("{w}/{seq}/");
    ck.extend(std::iter::repeat_n('x', pad));
    r.checkpoint = Some(ck);
    r.steps = (0..(seq % 80))
        .map(|i| StepTime {
            name: format!("step-{i}"),
            seconds: i as f64 / 10.0,
        })
        .collect();
    if seq % 3 == 0 {
        r.outcome = Outcome::Failed;
        r.error = Some(RecordError {
            step: "criu-dump".into(),
            class: "step".into(),
            message: "ü".repeat(900),
        });
    }
    r
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (dir, segment, writer) = match args.as_slice() {
        [d, s, w] | [d, s, w, _] => match s.parse::<u64>() {
            Ok(s) => (PathBuf::from(d), s, w.clone()),
            Err(_) => return usage(),
        },
        _ => return usage(),
    };
    let count = match args.get(3).map(|c| c.parse::<u64>()) {
        None => u64::MAX,
        Some(Ok(c)) => c,
        Some(Err(_)) => return usage(),
    };
    let j = match Journal::open(&dir, segment) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("gpu-ckpt-journal-stress: {e}");
            return ExitCode::from(1);
        }
    };
    let mut out = std::io::stdout().lock();
    for seq in 0..count {
        match j.append(&record(&writer, seq)) {
            Ok(()) => {
                if writeln!(out, "{seq}").and_then(|_| out.flush()).is_err() {
                    return ExitCode::from(1);
                }
            }
            // A record dropped (the lock not free in time) is not acknowledged.
            Err(journal::Error::LockTimeout { .. }) => {}
            Err(e) => {
                eprintln!("gpu-ckpt-journal-stress: {e}");
                return ExitCode::from(1);
            }
        }
    }
    ExitCode::SUCCESS
}

fn usage() -> ExitCode {
    eprintln!("usage: gpu-ckpt-journal-stress DIR SEGMENT_BYTES WRITER [COUNT]");
    ExitCode::from(2)
}
