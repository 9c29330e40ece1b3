//! `gpu-ckpt-journal-stress DIR SEGMENT_BYTES WRITER [COUNT [tear]]`: appends records to the
//! journal in DIR through `Journal::append` (the shim's), in a loop (COUNT records, or until
//! killed), and prints each record's sequence number on stdout once `append` returned. The crash
//! test (tests/crash.rs) kills it at random moments and checks what is left.
//!
//! With `tear`, the kernel cuts one of its writes short and then kills it: before each append, its
//! file size limit (RLIMIT_FSIZE) is set a random number of bytes past the current file's end, so
//! that a write crossing it writes up to the limit only and the next `write(2)` (`append` writing the rest)
//! raises SIGXFSZ, which ends the process. A SIGKILL lands inside a `write(2)` of a few dozen
//! microseconds only now and then; this makes the torn line every time the write crosses it.
//!
//! Record `seq` of writer `W`: `container_id` W, `pod` `seq-<seq>`, `host_bytes` seq,
//! `device_bytes` [`stamp`]`(W, seq)`, a `checkpoint` starting with `W/<seq>/`, and a size by
//! seq: small, a few KiB, close to the 64 KiB cap, or past it (shrunk by `append`) (a tearing
//! writer's: all close to the cap); see [`fill`].

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use journal::{Journal, Operation, Outcome, Record, RecordError, StepTime};

/// What `device_bytes` of writer `w`'s record `seq` holds.
fn stamp(w: &str, seq: u64) -> u64 {
    let h = blake3::hash(format!("{w}/{seq}").as_bytes());
    u64::from_le_bytes(h.as_bytes()[..8].try_into().unwrap_or([0; 8])) >> 1
}

fn record(w: &str, seq: u64, tear: bool) -> Record {
    let mut r = Record::new(
        if seq.is_multiple_of(2) {
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
    let prefix = format!("{w}/{seq}/");
    r.steps = (0..(seq % 80))
        .map(|i| StepTime {
            name: format!("step-{i}"),
            seconds: i as f64 / 10.0,
        })
        .collect();
    if seq.is_multiple_of(3) {
        r.outcome = Outcome::Failed;
        r.error = Some(RecordError {
            step: "criu-dump".into(),
            class: "step".into(),
            message: "ü".repeat(900),
        });
    }
    // A tearing writer's records are all close to the cap: each write crosses its limit.
    let level = if tear { 2 } else { seq % 4 };
    fill(&mut r, &prefix, level);
    r
}

/// `prefix` and then `U+0001` (which JSON escapes as six bytes) up to `len` bytes.
fn escaped(prefix: &str, len: usize) -> String {
    let mut s = prefix.to_string();
    s.extend(std::iter::repeat_n(
        '\u{1}',
        len.saturating_sub(prefix.len()),
    ));
    s
}

/// Record sizes: 0 small; 1 a few KiB; 2 close to the 64 KiB line cap; 3 past it (shrunk by
/// `append`). Every field stays within its own cap (journal::MAX_CHECKPOINT_BYTES, ...), so the
/// large ones are made of characters JSON escapes six-fold, in every capped field.
fn fill(r: &mut Record, prefix: &str, level: u64) {
    let mut ck = prefix.to_string();
    match level {
        0 => {
            ck.extend(std::iter::repeat_n('x', 100));
            r.checkpoint = Some(ck);
        }
        1 => {
            ck.extend(std::iter::repeat_n('x', 900));
            r.checkpoint = Some(ck);
            r.gpus = (0..12).map(|i| escaped(&format!("GPU-{i}-"), 60)).collect();
        }
        _ => {
            r.checkpoint = Some(escaped(prefix, journal::MAX_CHECKPOINT_BYTES));
            r.gpus = (0..journal::MAX_GPUS)
                .map(|i| escaped(&format!("GPU-{i}-"), journal::MAX_GPU_BYTES))
                .collect();
            r.steps = (0..journal::MAX_STEPS)
                .map(|i| StepTime {
                    name: escaped(&format!("step-{i}-"), journal::MAX_STEP_NAME_BYTES),
                    seconds: i as f64 / 10.0,
                })
                .collect();
            if level > 2 {
                for s in [&mut r.driver, &mut r.signing_key, &mut r.trace_id] {
                    *s = Some(escaped("", journal::MAX_ID_BYTES));
                }
                r.node = escaped("", journal::MAX_NAME_BYTES);
                r.pod_namespace = Some(escaped("", journal::MAX_NAME_BYTES));
                r.container = Some(escaped("", journal::MAX_NAME_BYTES));
                r.outcome = Outcome::Failed;
                r.error = Some(RecordError {
                    step: "criu-dump".into(),
                    class: "step".into(),
                    message: escaped("", journal::MAX_MESSAGE_BYTES),
                });
            }
        }
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (dir, segment, writer) = match args.as_slice() {
        [d, s, w] | [d, s, w, _] | [d, s, w, _, _] => match s.parse::<u64>() {
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
    let tear = match args.get(4).map(String::as_str) {
        None => false,
        Some("tear") => true,
        Some(_) => return usage(),
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
        if tear {
            if let Err(e) = tear_past_the_end(&dir.join(journal::CURRENT_FILE)) {
                eprintln!("gpu-ckpt-journal-stress: setting the file size limit: {e}");
                return ExitCode::from(1);
            }
        }
        match j.append(&record(&writer, seq, tear)) {
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

/// This process's file size limit (the soft one) set 1 to 48 KiB past the end of `file`, no core
/// dump at SIGXFSZ.
fn tear_past_the_end(file: &std::path::Path) -> std::io::Result<()> {
    let size = std::fs::metadata(file).map(|m| m.len()).unwrap_or(0);
    let past = 1 + getrandom::u64().map_err(std::io::Error::other)? % (48 << 10);
    let set = |what, soft: u64, hard: Option<u64>| {
        let mut l = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit and setrlimit read and write the struct they are given only.
        unsafe {
            if libc::getrlimit(what, &mut l) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            l.rlim_cur = soft.min(l.rlim_max);
            l.rlim_max = hard.unwrap_or(l.rlim_max);
            if libc::setrlimit(what, &l) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    };
    set(libc::RLIMIT_CORE, 0, Some(0))?;
    set(libc::RLIMIT_FSIZE, size + past, None)?;
    Ok(())
}

fn usage() -> ExitCode {
    eprintln!("usage: gpu-ckpt-journal-stress DIR SEGMENT_BYTES WRITER [COUNT [tear]]");
    ExitCode::from(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_levels_have_their_sizes() {
        let len = |seq: u64, tear: bool| serde_json::to_vec(&record("w", seq, tear)).unwrap().len();
        let cap = journal::MAX_RECORD_BYTES;
        assert!(len(0, false) < 3 << 10, "{}", len(0, false));
        assert!(
            (4 << 10..10 << 10).contains(&len(1, false)),
            "{}",
            len(1, false)
        );
        for (seq, tear) in [(2, false), (3, true), (6, false)] {
            let n = len(seq, tear);
            assert!((cap * 3 / 4..cap).contains(&n), "{seq} {tear}: {n}");
        }
        assert!(len(3, false) > cap, "{}", len(3, false));
    }
}
