//! The journal's files as a writer leaves them and as readers take them.

use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use crate::*;

fn rec(i: u64) -> Record {
    let mut r = Record::new(Operation::Checkpoint, "k8s.io", &format!("c{i}"));
    r.host_bytes = i;
    r.pod = Some(format!("pod-{i}"));
    r.steps = vec![StepTime {
        name: "criu-dump".into(),
        seconds: 1.5,
    }];
    r
}

fn size(dir: &Path) -> u64 {
    [CURRENT_FILE, PREVIOUS_FILE]
        .iter()
        .filter_map(|n| std::fs::metadata(dir.join(n)).ok())
        .map(|m| m.len())
        .sum()
}

#[test]
fn records_round_trip_oldest_first_in_private_files() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("a/events");
    let j = Journal::open(&dir, DEFAULT_SEGMENT_BYTES).unwrap();
    let mut r = rec(1);
    r.outcome = Outcome::Failed;
    r.error = Some(RecordError {
        step: "criu-dump".into(),
        class: "step".into(),
        message: "CRIU said no".into(),
    });
    r.frozen_seconds = Some(0.5);
    r.gpus = vec!["GPU-1".into()];
    r.crc = "ignored".into();
    j.append(&r).unwrap();
    j.append(&rec(2)).unwrap();
    let (got, skipped) = read_all(&dir).unwrap();
    assert_eq!(skipped, Skipped::default());
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].crc.len(), 16);
    assert_eq!(
        Record {
            crc: "ignored".into(),
            ..got[0].clone()
        },
        r
    );
    assert_eq!(got[1].host_bytes, 2);
    // The JSON keys are the field names.
    let text = std::fs::read_to_string(dir.join(CURRENT_FILE)).unwrap();
    let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(first["operation"], "checkpoint");
    assert_eq!(first["outcome"], "failed");
    assert_eq!(first["error"]["step"], "criu-dump");
    assert_eq!(first["steps"][0]["seconds"], 1.5);
    assert_eq!(first["v"], 1);

    let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&dir.join(CURRENT_FILE)), 0o600);
}

#[test]
fn a_journal_with_loose_modes_is_made_private() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("events");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(dir.join(CURRENT_FILE), "").unwrap();
    std::fs::set_permissions(
        dir.join(CURRENT_FILE),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    let j = Journal::open(&dir, DEFAULT_SEGMENT_BYTES).unwrap();
    j.append(&rec(1)).unwrap();
    assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
    assert_eq!(
        std::fs::metadata(dir.join(CURRENT_FILE)).unwrap().mode() & 0o777,
        0o600
    );
}

#[test]
fn a_line_whose_crc_differs_is_skipped_and_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let j = Journal::open(tmp.path(), DEFAULT_SEGMENT_BYTES).unwrap();
    for i in 0..3 {
        j.append(&rec(i)).unwrap();
    }
    let path = tmp.path().join(CURRENT_FILE);
    let text = std::fs::read_to_string(&path).unwrap();
    // The second record's host_bytes changed on disk: still JSON, still a record, not ours.
    let lines: Vec<&str> = text.lines().collect();
    let changed = lines[1].replace("\"host_bytes\":1,", "\"host_bytes\":7,");
    assert_ne!(changed, lines[1]);
    std::fs::write(
        &path,
        format!("{}\n{changed}\n{}\nnot json\n", lines[0], lines[2]),
    )
    .unwrap();
    let (got, skipped) = read_all(tmp.path()).unwrap();
    let hb: Vec<u64> = got.iter().map(|r| r.host_bytes).collect();
    assert_eq!(hb, [0, 2]);
    assert_eq!(
        skipped,
        Skipped {
            torn: 1,
            corrupt: 1
        }
    );
}

#[test]
fn a_torn_tail_stays_a_line_of_its_own_and_the_next_record_is_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let j = Journal::open(tmp.path(), DEFAULT_SEGMENT_BYTES).unwrap();
    j.append(&rec(0)).unwrap();
    let path = tmp.path().join(CURRENT_FILE);
    // A writer killed mid-write: half a line, no `\n`.
    let whole = crate::record::encode(&rec(1)).unwrap();
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(&whole[..whole.len() / 2]).unwrap();
    drop(f);
    let (got, skipped) = read_all(tmp.path()).unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(skipped.torn, 1);

    j.append(&rec(2)).unwrap();
    let (got, skipped) = read_all(tmp.path()).unwrap();
    let hb: Vec<u64> = got.iter().map(|r| r.host_bytes).collect();
    assert_eq!(hb, [0, 2]);
    assert_eq!(
        skipped,
        Skipped {
            torn: 1,
            corrupt: 0
        }
    );
    let text = std::fs::read(&path).unwrap();
    assert_eq!(text.iter().filter(|&&b| b == b'\n').count(), 3);
    assert!(text.ends_with(b"}\n"));
}

#[test]
fn rotation_keeps_two_segments_and_the_newest_records() {
    let tmp = tempfile::tempdir().unwrap();
    let seg = MIN_SEGMENT_BYTES;
    let j = Journal::open(tmp.path(), 1).unwrap();
    assert_eq!(
        j.segment_bytes(),
        seg,
        "a segment below the minimum is raised"
    );
    let mut last_prev = None;
    let mut rotations = 0;
    for i in 0..600 {
        let mut r = rec(i);
        r.checkpoint = Some("x".repeat((i as usize * 37) % 6000));
        j.append(&r).unwrap();
        assert!(size(tmp.path()) <= 2 * seg, "after record {i}");
        let prev = std::fs::metadata(tmp.path().join(PREVIOUS_FILE))
            .ok()
            .map(|m| m.ino());
        if prev != last_prev {
            rotations += 1;
            last_prev = prev;
        }
    }
    assert!(rotations > 5, "{rotations} rotations");
    let names: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    let (got, skipped) = read_all(tmp.path()).unwrap();
    assert_eq!(skipped.total(), 0);
    // The newest records, in order, none missing since the oldest kept.
    let hb: Vec<u64> = got.iter().map(|r| r.host_bytes).collect();
    assert_eq!(*hb.last().unwrap(), 599);
    let first = hb[0];
    assert_eq!(hb, (first..600).collect::<Vec<_>>());
    assert!(
        size(tmp.path()) > seg,
        "more than one segment's worth is kept"
    );
}

/// A tenant floods the journal with refused restores whose restore-from annotation is 62 KiB:
/// each record is capped to a few KiB, so 1000 of them take at most 1000 × 8 KiB and, within
/// the default two segments, evict none of the records written before them (uncapped, the same
/// flood is 64 MB: sixteen times both segments, every other record gone).
#[test]
fn a_flood_of_huge_annotations_evicts_no_more_than_its_share() {
    let tmp = tempfile::tempdir().unwrap();
    let j = Journal::open(tmp.path(), DEFAULT_SEGMENT_BYTES).unwrap();
    for i in 0..100 {
        j.append(&rec(i)).unwrap();
    }
    let before = size(tmp.path());
    let annotation = format!("/var/lib/kubelet/checkpoints/{}", "a".repeat(62 << 10));
    let flood = crate::record::tests::flood_record(&annotation);
    const FLOOD: u64 = 1000;
    let line = crate::record::encode(&flood).unwrap().len() as u64;
    assert!(line < 8 << 10, "{line}");
    for _ in 0..FLOOD {
        j.append(&flood).unwrap();
    }
    // The flood's share: its records' bytes, no more.
    let written = size(tmp.path());
    assert!(
        written <= before + FLOOD * line,
        "{written} > {before} + {FLOOD} × {line}"
    );
    // Rotation keeps at least the last segment's worth (segment − one line) of records: the
    // flood fits in it, so every earlier record is still there.
    assert!(FLOOD * line + before <= DEFAULT_SEGMENT_BYTES * 2 - line);
    let (got, skipped) = read_all(tmp.path()).unwrap();
    assert_eq!(skipped.total(), 0);
    let kept: Vec<u64> = got
        .iter()
        .filter(|r| r.outcome == Outcome::Succeeded)
        .map(|r| r.host_bytes)
        .collect();
    assert_eq!(kept, (0..100).collect::<Vec<_>>());
    assert_eq!(
        got.iter().filter(|r| r.outcome == Outcome::Refused).count() as u64,
        FLOOD
    );
}

/// A record whose every string JSON escapes six-fold (control characters), each at its cap:
/// still cut to [`MAX_RECORD_BYTES`], kept whole within the bound.
#[test]
fn a_record_near_the_cap_is_kept_whole_within_the_bound() {
    let tmp = tempfile::tempdir().unwrap();
    let j = Journal::open(tmp.path(), MIN_SEGMENT_BYTES).unwrap();
    let esc = |n: usize| "\u{1}".repeat(n);
    for i in 0..20 {
        let mut r = rec(i);
        r.checkpoint = Some(esc(MAX_RECORD_BYTES * 2));
        r.error = Some(RecordError {
            step: esc(100),
            class: esc(100),
            message: esc(MAX_MESSAGE_BYTES),
        });
        r.steps = (0..MAX_STEPS)
            .map(|_| StepTime {
                name: esc(100),
                seconds: 1.0,
            })
            .collect();
        r.gpus = vec![esc(100); 100];
        let line = crate::record::encode(&r).unwrap().len();
        assert!(line > MAX_RECORD_BYTES / 2, "{line}");
        j.append(&r).unwrap();
        assert!(size(tmp.path()) <= 2 * MIN_SEGMENT_BYTES);
    }
    let (got, skipped) = read_all(tmp.path()).unwrap();
    assert_eq!(skipped.total(), 0);
    assert!(got.len() >= 2);
    assert_eq!(got.last().unwrap().host_bytes, 19);
}

#[test]
fn symbolic_links_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let real = tmp.path().join("real");
    std::fs::create_dir(&real).unwrap();
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    assert!(matches!(
        Journal::open(&link, DEFAULT_SEGMENT_BYTES),
        Err(Error::Symlink { .. })
    ));
    assert!(matches!(read_all(&link), Err(Error::Symlink { .. })));
    assert!(matches!(
        Tailer::new(&link, true),
        Err(Error::Symlink { .. })
    ));

    // A file planted as a link to somewhere else: the writer refuses it, the target untouched.
    let dir = tmp.path().join("events");
    let j = Journal::open(&dir, DEFAULT_SEGMENT_BYTES).unwrap();
    let target = tmp.path().join("passwd");
    std::fs::write(&target, "root:x:0:0\n").unwrap();
    std::os::unix::fs::symlink(&target, dir.join(CURRENT_FILE)).unwrap();
    assert!(matches!(j.append(&rec(1)), Err(Error::Symlink { .. })));
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "root:x:0:0\n");
    assert!(matches!(read_all(&dir), Err(Error::Symlink { .. })));

    // A hard link to another file.
    std::fs::remove_file(dir.join(CURRENT_FILE)).unwrap();
    std::fs::hard_link(&target, dir.join(CURRENT_FILE)).unwrap();
    assert!(matches!(j.append(&rec(1)), Err(Error::Links { .. })));
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "root:x:0:0\n");

    // Not a directory.
    assert!(matches!(
        Journal::open(&target, DEFAULT_SEGMENT_BYTES),
        Err(Error::NotA { .. })
    ));
}

#[test]
fn a_directory_of_another_user_is_refused_by_root() {
    if !nix::unistd::geteuid().is_root() {
        // The check compares the owner with this process's user; only root can make a
        // directory that another user owns.
        let tmp = tempfile::tempdir().unwrap();
        assert!(Journal::open(tmp.path(), DEFAULT_SEGMENT_BYTES).is_ok());
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("events");
    std::fs::create_dir(&dir).unwrap();
    std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
    assert!(matches!(
        Journal::open(&dir, DEFAULT_SEGMENT_BYTES),
        Err(Error::Owner {
            uid: 65534,
            want: 0,
            ..
        })
    ));
    assert!(matches!(read_all(&dir), Err(Error::Owner { .. })));
}

#[test]
fn a_tailer_follows_appends_and_rotations() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("events");
    // Before the directory exists.
    let mut from_end = Tailer::new(&dir, true).unwrap();
    assert!(from_end.poll().unwrap().is_empty());
    let j = Journal::open(&dir, MIN_SEGMENT_BYTES).unwrap();
    j.append(&rec(0)).unwrap();
    j.append(&rec(1)).unwrap();
    let hb = |v: Vec<Record>| v.iter().map(|r| r.host_bytes).collect::<Vec<_>>();
    assert_eq!(hb(from_end.poll().unwrap()), [0, 1]);
    // A tail started now sees only what comes next; one from the start sees everything.
    let mut later = Tailer::new(&dir, true).unwrap();
    let mut all = Tailer::new(&dir, false).unwrap();
    assert!(later.poll().unwrap().is_empty());
    assert_eq!(hb(all.poll().unwrap()), [0, 1]);
    j.append(&rec(2)).unwrap();
    assert_eq!(hb(later.poll().unwrap()), [2]);
    assert_eq!(hb(from_end.poll().unwrap()), [2]);
    assert!(from_end.poll().unwrap().is_empty());

    // Past a rotation (and, for `all`, past two between its polls).
    let mut seen_later = Vec::new();
    let mut i = 3;
    let mut rotations = 0;
    let mut ino = std::fs::metadata(dir.join(CURRENT_FILE)).unwrap().ino();
    while rotations < 2 {
        let mut r = rec(i);
        r.checkpoint = Some("z".repeat(20_000));
        j.append(&r).unwrap();
        let now = std::fs::metadata(dir.join(CURRENT_FILE)).unwrap().ino();
        if now != ino {
            rotations += 1;
            ino = now;
        }
        seen_later.extend(hb(later.poll().unwrap()));
        i += 1;
    }
    assert_eq!(seen_later, (3..i).collect::<Vec<_>>());
    assert_eq!(hb(all.poll().unwrap()), (2..i).collect::<Vec<_>>());
    assert_eq!(later.skipped().total() + all.skipped().total(), 0);

    // A torn line: skipped once the next writer ends it, counted.
    let whole = crate::record::encode(&rec(99)).unwrap();
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(dir.join(CURRENT_FILE))
        .unwrap();
    f.write_all(&whole[..100]).unwrap();
    assert!(later.poll().unwrap().is_empty());
    j.append(&rec(100)).unwrap();
    assert_eq!(hb(later.poll().unwrap()), [100]);
    assert_eq!(
        later.skipped(),
        Skipped {
            torn: 1,
            corrupt: 0
        }
    );
    // A tail that starts in the middle of that torn line does not count it.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(dir.join(CURRENT_FILE))
        .unwrap();
    f.write_all(&whole[..100]).unwrap();
    let mut mid = Tailer::new(&dir, true).unwrap();
    j.append(&rec(101)).unwrap();
    assert_eq!(hb(mid.poll().unwrap()), [101]);
    assert_eq!(mid.skipped().total(), 0);
}

#[test]
fn threads_appending_at_once_never_interleave() {
    let tmp = tempfile::tempdir().unwrap();
    let j = std::sync::Arc::new(Journal::open(tmp.path(), DEFAULT_SEGMENT_BYTES).unwrap());
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let j = j.clone();
            std::thread::spawn(move || {
                for i in 0..50u64 {
                    let mut r = rec(t * 1000 + i);
                    // Past a page, so that one write is several.
                    r.checkpoint = Some(format!("{t}").repeat(10_000 + (i as usize % 7) * 3000));
                    j.append(&r).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let (got, skipped) = read_all(tmp.path()).unwrap();
    assert_eq!(skipped.total(), 0);
    assert_eq!(got.len(), 400);
    for t in 0..8u64 {
        let mine: Vec<u64> = got
            .iter()
            .filter(|r| r.host_bytes / 1000 == t)
            .map(|r| r.host_bytes % 1000)
            .collect();
        assert_eq!(mine, (0..50).collect::<Vec<_>>(), "thread {t}'s in order");
    }
}

#[test]
fn a_held_lock_drops_the_record_after_the_wait() {
    use nix::fcntl::{Flock, FlockArg};
    let tmp = tempfile::tempdir().unwrap();
    let j = Journal::open(tmp.path(), DEFAULT_SEGMENT_BYTES)
        .unwrap()
        .with_lock_wait(std::time::Duration::from_millis(100));
    j.append(&rec(0)).unwrap();
    let f = std::fs::File::open(tmp.path().join(CURRENT_FILE)).unwrap();
    let held = Flock::lock(f, FlockArg::LockExclusive).unwrap();
    let t0 = std::time::Instant::now();
    assert!(matches!(j.append(&rec(1)), Err(Error::LockTimeout { .. })));
    assert!(t0.elapsed() >= std::time::Duration::from_millis(100));
    drop(held);
    j.append(&rec(2)).unwrap();
    let (got, _) = read_all(tmp.path()).unwrap();
    assert_eq!(got.iter().map(|r| r.host_bytes).collect::<Vec<_>>(), [0, 2]);
}
