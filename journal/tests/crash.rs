//! Records survive a writer killed mid-write (no torn record taken for one, no record lost or
//! glued to a torn one) and stay within their bound: writers of `gpu-ckpt-journal-stress`
//! (appending through `Journal::append`, as the shim does) killed with SIGKILL at random moments,
//! many times, several at once.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use journal::{read_all, Journal, Record, CURRENT_FILE, MIN_SEGMENT_BYTES, PREVIOUS_FILE};

const STRESS: &str = env!("CARGO_BIN_EXE_gpu-ckpt-journal-stress");

/// `device_bytes` of writer `w`'s record `seq`, as the stress writer stamps it.
fn stamp(w: &str, seq: u64) -> u64 {
    let h = blake3::hash(format!("{w}/{seq}").as_bytes());
    u64::from_le_bytes(h.as_bytes()[..8].try_into().unwrap()) >> 1
}

/// xorshift64*, seeded from the clock (the seed is printed, and `JOURNAL_CRASH_SEED` replays it).
struct Rng(u64);

impl Rng {
    fn new() -> Rng {
        let seed = std::env::var("JOURNAL_CRASH_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
                    | 1
            });
        eprintln!("journal crash test: JOURNAL_CRASH_SEED={seed}");
        Rng(seed)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// A running writer and the sequence numbers it acknowledged (printed after `append` returned).
struct Writer {
    name: String,
    child: Child,
    acks: JoinHandle<Vec<u64>>,
}

impl Writer {
    /// A writer; with `tear`, one that the kernel kills in the middle of a write (SIGXFSZ, its
    /// file size limit set a little past the journal's end).
    fn start(dir: &Path, segment: u64, name: String, tear: bool) -> Writer {
        let mut c = Command::new(STRESS);
        c.arg(dir).arg(segment.to_string()).arg(&name);
        if tear {
            c.arg(u64::MAX.to_string()).arg("tear");
        }
        let mut child = c.stdout(Stdio::piped()).spawn().unwrap();
        let out = child.stdout.take().unwrap();
        let acks = std::thread::spawn(move || {
            BufReader::new(out)
                .lines()
                .map_while(Result::ok)
                .filter_map(|l| l.parse().ok())
                .collect()
        });
        Writer { name, child, acks }
    }

    /// SIGKILL, and what it acknowledged before.
    fn kill(mut self) -> (String, Vec<u64>) {
        // Killing one that already died (SIGXFSZ) is no error.
        let _ = self.child.kill();
        self.end()
    }

    /// Its end (by a signal: SIGKILL, or SIGXFSZ for a tearing writer), and what it acknowledged.
    fn end(mut self) -> (String, Vec<u64>) {
        let status = self.child.wait().unwrap();
        let sig = status.signal();
        assert!(
            sig == Some(libc::SIGKILL) || sig == Some(libc::SIGXFSZ),
            "{} ended by itself: {status}",
            self.name
        );
        (self.name, self.acks.join().unwrap())
    }

    fn has_ended(&mut self) -> bool {
        self.child.try_wait().unwrap().is_some()
    }
}

fn journal_bytes(dir: &Path) -> u64 {
    [CURRENT_FILE, PREVIOUS_FILE]
        .iter()
        .filter_map(|n| std::fs::metadata(dir.join(n)).ok())
        .map(|m| m.len())
        .sum()
}

/// What [`kill_many`] did: each writer's acknowledgements, and how many were killed, by us
/// (SIGKILL) and by the kernel in a write (SIGXFSZ).
struct Kills {
    acked: HashMap<String, Vec<u64>>,
    sigkill: usize,
    sigxfsz: usize,
}

impl Kills {
    fn total(&self) -> usize {
        self.sigkill + self.sigxfsz
    }
}

/// `writers` writers at once: the first one a tearing writer (replaced whenever the kernel
/// killed it), `kills` of the others killed with SIGKILL at random moments (each replaced by a
/// new one); then the rest killed.
fn kill_many(dir: &Path, segment: u64, writers: usize, kills: usize, rng: &mut Rng) -> Kills {
    let mut next = 0;
    let mut start = |slot: usize| {
        next += 1;
        Writer::start(dir, segment, format!("w{slot}-{next}"), slot == 0)
    };
    // The journal's directory, before the tearing writer looks at its file.
    Journal::open(dir, segment).unwrap();
    let mut running: Vec<Writer> = (0..writers).map(&mut start).collect();
    let mut k = Kills {
        acked: HashMap::new(),
        sigkill: 0,
        sigxfsz: 0,
    };
    let record = |k: &mut Kills, (name, acks): (String, Vec<u64>), by_us: bool| {
        k.acked.insert(name, acks);
        if by_us {
            k.sigkill += 1;
        } else {
            k.sigxfsz += 1;
        }
        let bytes = journal_bytes(dir);
        assert!(
            bytes <= 2 * segment,
            "{bytes} bytes past the bound of {}",
            2 * segment
        );
    };
    std::thread::sleep(Duration::from_millis(20));
    while k.sigkill < kills {
        std::thread::sleep(Duration::from_micros(rng.below(6000)));
        if running[0].has_ended() {
            let w = std::mem::replace(&mut running[0], start(0));
            record(&mut k, w.end(), false);
        }
        // The tearing writer ends by itself, in a write.
        let slot = 1 + rng.below(writers as u64 - 1) as usize;
        let w = std::mem::replace(&mut running[slot], start(slot));
        record(&mut k, w.kill(), true);
    }
    std::thread::sleep(Duration::from_millis(20));
    for w in running {
        record(&mut k, w.kill(), true);
    }
    k
}

/// What every record must be; the per-writer order; every acknowledged record present from the
/// writer's oldest one kept (`all_kept`: none rotated out, so every one). Returns the records.
fn check(dir: &Path, kills: &Kills, all_kept: bool) -> Vec<Record> {
    let acked = &kills.acked;
    let kills = kills.total();
    let (records, skipped) = read_all(dir).unwrap();
    eprintln!(
        "journal crash test: {} records, {} acknowledged, {kills} kills, skipped {skipped:?}, {} bytes",
        records.len(),
        acked.values().map(Vec::len).sum::<usize>(),
        journal_bytes(dir)
    );
    assert_eq!(skipped.corrupt, 0, "a kill only cuts a line short");
    assert!(
        skipped.torn as usize <= kills,
        "{} torn lines for {kills} kills",
        skipped.torn
    );
    let mut seen: HashMap<&str, Vec<u64>> = HashMap::new();
    for r in &records {
        let w = r.container_id.as_str();
        let seq = r.host_bytes;
        assert!(acked.contains_key(w), "a record of no writer: {w}");
        assert_eq!(r.pod.as_deref(), Some(format!("seq-{seq}").as_str()));
        assert_eq!(r.device_bytes, stamp(w, seq), "{w} {seq}");
        let ck = r.checkpoint.as_deref().unwrap_or("");
        assert!(
            ck.starts_with(&format!("{w}/{seq}/")),
            "{w} {seq}: {ck:.40}"
        );
        let mine = seen.entry(w).or_default();
        assert!(
            mine.last().is_none_or(|&l| l < seq),
            "{w}: record {seq} after {mine:?}"
        );
        mine.push(seq);
    }
    for (w, acks) in acked {
        let kept = seen.get(w.as_str()).cloned().unwrap_or_default();
        let from = if all_kept {
            0
        } else {
            match kept.first() {
                Some(&f) => f,
                None => continue,
            }
        };
        let lost: Vec<u64> = acks
            .iter()
            .copied()
            .filter(|s| *s >= from && kept.binary_search(s).is_err())
            .collect();
        assert!(
            lost.is_empty(),
            "{w}: acknowledged records missing: {lost:?}"
        );
    }
    records
}

#[test]
fn records_survive_writers_killed_mid_write() {
    let mut rng = Rng::new();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("events");
    // No rotation: every acknowledged record must be there.
    let segment = 1 << 30;
    let kills = kill_many(&dir, segment, 4, 100, &mut rng);
    let records = check(&dir, &kills, true);
    assert!(records.len() > 100, "{} records", records.len());
    let (_, skipped) = read_all(&dir).unwrap();
    // The kernel cut writes short: the torn lines were there, and were skipped.
    assert!(
        skipped.torn > 0,
        "no torn line in {} kills ({} in a write)",
        kills.total(),
        kills.sigxfsz
    );
    // A later append is whole and read back.
    let j = Journal::open(&dir, segment).unwrap();
    let mut last = records[0].clone();
    last.container_id = "after".into();
    last.host_bytes = 424242;
    j.append(&last).unwrap();
    let (after, skipped_after) = read_all(&dir).unwrap();
    assert_eq!(skipped_after, skipped);
    assert_eq!(after.len(), records.len() + 1);
    assert_eq!(after.last().unwrap().host_bytes, 424242);

    // A record changed on disk (a flipped bit: still JSON, still a record) is not taken.
    let path = dir.join(CURRENT_FILE);
    let mut bytes = std::fs::read(&path).unwrap();
    let key = b"\"host_bytes\":424242";
    let at = bytes.windows(key.len()).rposition(|w| w == key).unwrap() + key.len() - 1;
    bytes[at] = b'3';
    std::fs::write(&path, &bytes).unwrap();
    let (changed, skipped_changed) = read_all(&dir).unwrap();
    assert_eq!(
        changed.len(),
        records.len(),
        "the changed record was taken for one"
    );
    assert!(changed.iter().all(|r| r.host_bytes != 424243));
    assert_eq!(skipped_changed.corrupt, 1);
}

#[test]
fn records_stay_within_their_bound_through_kills_and_rotations() {
    let mut rng = Rng::new();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("events");
    let segment = MIN_SEGMENT_BYTES;
    let t0 = Instant::now();
    let kills = kill_many(&dir, segment, 3, 60, &mut rng);
    let records = check(&dir, &kills, false);
    assert!(journal_bytes(&dir) <= 2 * segment);
    assert!(!records.is_empty());
    // The writers wrote far more than the bound keeps: rotation happened, many times.
    let written: u64 = kills.acked.values().map(|a| a.len() as u64).sum();
    assert!(
        written > records.len() as u64 * 3,
        "{written} written, {} kept, in {:?}",
        records.len(),
        t0.elapsed()
    );
    let j = Journal::open(&dir, segment).unwrap();
    let mut last = records[0].clone();
    last.container_id = "after".into();
    j.append(&last).unwrap();
    let (after, _) = read_all(&dir).unwrap();
    assert_eq!(after.last().unwrap().container_id, "after");
    assert!(journal_bytes(&dir) <= 2 * segment);
}

#[test]
fn processes_appending_at_once_never_interleave() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("events");
    let n = 40u64;
    let children: Vec<(String, Child)> = (0..4)
        .map(|i| {
            let name = format!("p{i}");
            let c = Command::new(STRESS)
                .arg(&dir)
                .arg((64u64 << 20).to_string())
                .arg(&name)
                .arg(n.to_string())
                .stdout(Stdio::null())
                .spawn()
                .unwrap();
            (name, c)
        })
        .collect();
    for (name, mut c) in children {
        assert!(c.wait().unwrap().success(), "{name}");
    }
    let (records, skipped) = read_all(&dir).unwrap();
    assert_eq!(skipped.total(), 0);
    assert_eq!(records.len() as u64, 4 * n);
    for i in 0..4 {
        let name = format!("p{i}");
        let mine: Vec<u64> = records
            .iter()
            .filter(|r| r.container_id == name)
            .map(|r| r.host_bytes)
            .collect();
        assert_eq!(
            mine,
            (0..n).collect::<Vec<_>>(),
            "{name}'s records in order"
        );
        assert!(records
            .iter()
            .filter(|r| r.container_id == name)
            .all(|r| r.device_bytes == stamp(&name, r.host_bytes)));
    }
}
