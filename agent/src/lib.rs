//! gpu-ckpt's node agent: Prometheus metrics of the node's checkpoints and restores.
//!
//! [`Agent`] counts the records the shims append to the node's event journal (crate `journal`)
//! after it started (a [`journal::Tailer`] from the end, so a restart never counts old records
//! twice), polled every second and at each scrape, and reads the node's state: the checkpoints
//! on disk ([`disk`], walked at most once per [`DISK_CACHE_TTL`] whatever the scrape rate) and
//! the signing key in use ([`key`]: the newest checkpoint record's `signing_key`, or `node.pub`
//! of `--key-dir` when given). [`server`] serves `/metrics` and `/healthz`.

pub mod disk;
pub mod key;
pub mod metrics;
pub mod server;

use std::path::PathBuf;
use std::time::{Duration, Instant};

pub use metrics::{Metrics, NodeState};

/// How long the on-disk figures of one walk of the checkpoint directories are served: scrapes
/// in between (any number of them, from anyone on the pod network) walk nothing.
pub const DISK_CACHE_TTL: Duration = Duration::from_secs(10);

/// The agent's errors.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("encoding the metrics: {0}")]
    Encode(#[from] std::fmt::Error),
    #[error("listening on {addr}: {source}")]
    Listen {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
}

/// Where the agent looks.
#[derive(Clone, Debug, Default)]
pub struct Config {
    /// The event journal's directory (`EventsDir`).
    pub events_dir: PathBuf,
    /// Directories checkpoints are kept under.
    pub checkpoint_dirs: Vec<PathBuf>,
    /// The directory of the node's signing key (`node.pub` in it), when the agent may read it
    /// (not in the chart, which mounts no key directory): its key id then wins over the records'.
    pub key_dir: Option<PathBuf>,
}

/// The journal's tail and the metrics it moves.
pub struct Agent {
    config: Config,
    metrics: Metrics,
    tailer: Option<journal::Tailer>,
    /// Whether the last poll of the journal succeeded (or there is no journal yet).
    journal_ok: bool,
    /// The key id of the newest checkpoint record that carries one.
    record_key: Option<String>,
    /// The last walk of the checkpoint directories, and when it ran.
    disk: Option<(Instant, disk::DiskUsage)>,
    /// How many walks ran (for the tests: at most one per [`DISK_CACHE_TTL`]).
    disk_walks: u64,
}

impl Agent {
    /// An agent that counts from the journal's current end (a journal directory that is not
    /// there yet, before the node's first record, counts every record from its start). A
    /// journal that cannot be opened (a directory of another user) is tried again at each poll,
    /// from its end then.
    pub fn new(config: Config) -> Agent {
        let mut a = Agent {
            config,
            metrics: Metrics::new(),
            tailer: None,
            journal_ok: true,
            record_key: None,
            disk: None,
            disk_walks: 0,
        };
        // The key in use survives a restart: the newest record that names one, among those
        // already written (which are not counted again).
        // One record at a time: a journal of two large segments never sits in memory whole.
        let mut key = None;
        match journal::scan(&a.config.events_dir, |r| note_key(&mut key, &r)) {
            Ok(_) => a.record_key = key,
            Err(e) => {
                tracing::debug!(dir = %a.config.events_dir.display(), error = %e, "no journal to take the signing key from yet");
            }
        }
        a.open_tailer(true);
        a
    }

    fn open_tailer(&mut self, from_end: bool) {
        if self.tailer.is_some() {
            return;
        }
        match journal::Tailer::new(&self.config.events_dir, from_end) {
            Ok(t) => {
                tracing::info!(dir = %self.config.events_dir.display(), from_end, "following the event journal");
                self.tailer = Some(t);
                self.journal_ok = true;
            }
            Err(e) => {
                self.journal_ok = false;
                tracing::warn!(dir = %self.config.events_dir.display(), error = %e, "cannot open the event journal");
            }
        }
    }

    /// Counts the records appended since the last poll.
    pub fn poll(&mut self) {
        self.open_tailer(true);
        let Some(t) = self.tailer.as_mut() else {
            return;
        };
        let before = t.skipped().total();
        match t.poll() {
            Ok(records) => {
                self.journal_ok = true;
                for r in &records {
                    self.metrics.observe(r);
                    note_key(&mut self.record_key, r);
                }
                if !records.is_empty() {
                    tracing::debug!(records = records.len(), "counted journal records");
                }
            }
            Err(e) => {
                self.journal_ok = false;
                tracing::warn!(dir = %self.config.events_dir.display(), error = %e, "cannot read the event journal");
            }
        }
        let skipped = t.skipped().total().saturating_sub(before);
        if skipped > 0 {
            tracing::warn!(
                skipped,
                "skipped journal lines (torn, not JSON, or a wrong checksum)"
            );
            self.metrics.skipped(skipped);
        }
    }

    /// The node's state now.
    pub fn node_state(&mut self) -> NodeState {
        self.node_state_at(Instant::now())
    }

    /// The node's state at `now`: the checkpoint directories walked again only when the last
    /// walk is [`DISK_CACHE_TTL`] old.
    pub fn node_state_at(&mut self, now: Instant) -> NodeState {
        let fresh = self
            .disk
            .as_ref()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) < DISK_CACHE_TTL);
        if !fresh {
            let usage = disk::scan(&self.config.checkpoint_dirs);
            self.disk_walks += 1;
            if usage.truncated {
                tracing::warn!(limit = disk::MAX_ENTRIES, "the checkpoint directories hold more entries than one scan reads; the figures are a lower bound");
            }
            self.disk = Some((now, usage));
        }
        let usage = self
            .disk
            .as_ref()
            .map(|(_, u)| u.clone())
            .unwrap_or_default();
        let key_id = self
            .config
            .key_dir
            .as_deref()
            .and_then(key::key_id)
            .or_else(|| self.record_key.clone());
        NodeState {
            checkpoints: usage.checkpoints,
            checkpoint_bytes: usage.bytes,
            key_id,
        }
    }

    /// A scrape: the journal polled, the node's state read, the registry encoded.
    pub fn scrape(&mut self, openmetrics: bool) -> Result<String, Error> {
        self.scrape_at(openmetrics, Instant::now())
    }

    /// [`Agent::scrape`] at `now`.
    pub fn scrape_at(&mut self, openmetrics: bool, now: Instant) -> Result<String, Error> {
        self.poll();
        let state = self.node_state_at(now);
        self.metrics.set_node_state(&state);
        Ok(if openmetrics {
            self.metrics.openmetrics()?
        } else {
            self.metrics.prometheus_text()?
        })
    }

    /// How many times the checkpoint directories were walked.
    pub fn disk_walks(&self) -> u64 {
        self.disk_walks
    }

    /// Whether the journal could be read at the last poll.
    pub fn healthy(&self) -> bool {
        self.journal_ok
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

/// `r`'s signing key into `key` when `r` is a checkpoint's record (the key the node signed
/// with; a restore's is the key that verified the checkpoint, possibly another node's) and the id
/// is well formed.
fn note_key(key: &mut Option<String>, r: &journal::Record) {
    if r.operation != journal::Operation::Checkpoint {
        return;
    }
    if let Some(k) = r.signing_key.as_deref().filter(|k| key::well_formed(k)) {
        *key = Some(k.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use journal::{Journal, Operation, Outcome, Record, RecordError};

    fn count(text: &str, key: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(key).and_then(|v| v.trim().parse().ok()))
    }

    #[test]
    fn counts_only_records_appended_after_it_started_and_skips_torn_lines() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("events");
        let j = Journal::open(&dir, journal::DEFAULT_SEGMENT_BYTES).unwrap();
        j.append(&Record::new(Operation::Checkpoint, "k8s.io", "before"))
            .unwrap();
        let mut a = Agent::new(Config {
            events_dir: dir.clone(),
            checkpoint_dirs: vec![],
            key_dir: None,
        });
        let ok = r#"gpu_ckpt_operations_total{operation="checkpoint",outcome="succeeded",failed_step="",error_class=""} "#;
        let refused = r#"gpu_ckpt_operations_total{operation="restore",outcome="refused",failed_step="trust",error_class="refused"} "#;
        let text = a.scrape(false).unwrap();
        assert_eq!(count(&text, ok), None, "{text}");
        j.append(&Record::new(Operation::Checkpoint, "k8s.io", "after"))
            .unwrap();
        let mut r = Record::new(Operation::Restore, "k8s.io", "r");
        r.outcome = Outcome::Refused;
        r.error = Some(RecordError {
            step: "trust".into(),
            class: "refused".into(),
            message: "unsigned".into(),
        });
        j.append(&r).unwrap();
        // A line that is no record (a torn or corrupt one), then a good record after it.
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(dir.join(journal::CURRENT_FILE))
            .unwrap();
        f.write_all(b"{\"v\":1,\"id\":\"torn\n").unwrap();
        j.append(&Record::new(Operation::Checkpoint, "k8s.io", "after2"))
            .unwrap();
        let text = a.scrape(true).unwrap();
        assert_eq!(count(&text, ok), Some(2.0), "{text}");
        assert_eq!(count(&text, refused), Some(1.0), "{text}");
        assert_eq!(
            count(&text, "gpu_ckpt_journal_records_skipped_total "),
            Some(1.0),
            "{text}"
        );
        assert!(a.healthy());
        // A scrape without new records counts nothing again.
        let again = a.scrape(true).unwrap();
        assert_eq!(count(&again, ok), Some(2.0));
        // A new agent (a restart) starts from the end: nothing is counted twice.
        let mut b = Agent::new(Config {
            events_dir: dir,
            checkpoint_dirs: vec![],
            key_dir: None,
        });
        assert_eq!(count(&b.scrape(true).unwrap(), ok), None);
    }

    /// Scrapes at any rate walk the checkpoint directories at most once per 10 s: the figures
    /// in between are the last walk's.
    #[test]
    fn the_disk_is_walked_at_most_once_per_ttl() {
        let t = tempfile::tempdir().unwrap();
        let ckpts = t.path().join("checkpoints");
        std::fs::create_dir(&ckpts).unwrap();
        std::fs::write(ckpts.join("checkpoint-a.tar"), vec![0u8; 100]).unwrap();
        let mut a = Agent::new(Config {
            events_dir: t.path().join("events"),
            checkpoint_dirs: vec![ckpts.clone()],
            key_dir: None,
        });
        let t0 = Instant::now();
        let on_disk = |text: &str| count(text, "gpu_ckpt_checkpoints_on_disk ");
        assert_eq!(on_disk(&a.scrape_at(false, t0).unwrap()), Some(1.0));
        assert_eq!(a.disk_walks(), 1);
        std::fs::write(ckpts.join("checkpoint-b.tar"), vec![0u8; 100]).unwrap();
        // A thousand scrapes within the 10 s: no walk, the cached figures.
        for i in 0..1000u64 {
            let now = t0 + DISK_CACHE_TTL.mul_f64(i as f64 / 1000.0);
            assert_eq!(on_disk(&a.scrape_at(false, now).unwrap()), Some(1.0));
        }
        assert_eq!(a.disk_walks(), 1);
        // 10 s on: one walk, the new figures, cached again.
        let t1 = t0 + DISK_CACHE_TTL;
        assert_eq!(on_disk(&a.scrape_at(false, t1).unwrap()), Some(2.0));
        assert_eq!(a.disk_walks(), 2);
        a.scrape_at(false, t1 + Duration::from_secs(9)).unwrap();
        assert_eq!(a.disk_walks(), 2);
    }

    /// Without a key directory (the chart's agent), the key id is the newest checkpoint record's
    /// `signing_key`, also after a restart; a restore's (the key that verified) or a malformed one
    /// is not taken. With `--key-dir`, its node.pub wins.
    #[test]
    fn the_key_comes_from_the_newest_checkpoint_record_or_the_key_dir() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("events");
        let key_a = "ed25519:00112233445566778899aabbccddeeff";
        let key_b = "ed25519:ffeeddccbbaa99887766554433221100";
        let info = |k: &str| format!("gpu_ckpt_signing_key_info{{key_id=\"{k}\"}} ");
        let cfg = |key_dir: Option<std::path::PathBuf>| Config {
            events_dir: dir.clone(),
            checkpoint_dirs: vec![],
            key_dir,
        };
        let mut a = Agent::new(cfg(None));
        assert!(!a.scrape(false).unwrap().contains("key_id="));
        let j = Journal::open(&dir, journal::DEFAULT_SEGMENT_BYTES).unwrap();
        let signed = |op, k: &str| {
            let mut r = Record::new(op, "k8s.io", "c");
            r.signing_key = Some(k.into());
            r
        };
        j.append(&signed(Operation::Checkpoint, key_a)).unwrap();
        j.append(&Record::new(Operation::Checkpoint, "k8s.io", "unsigned"))
            .unwrap();
        let text = a.scrape(false).unwrap();
        assert_eq!(count(&text, &info(key_a)), Some(1.0), "{text}");
        // A restore verified with another key, and a malformed id: still key a.
        j.append(&signed(Operation::Restore, key_b)).unwrap();
        j.append(&signed(Operation::Checkpoint, "ed25519:x\"} 1\nevil"))
            .unwrap();
        let text = a.scrape(false).unwrap();
        assert_eq!(count(&text, &info(key_a)), Some(1.0), "{text}");
        assert!(!text.contains(key_b) && !text.contains("evil"), "{text}");
        // A rotation: the newest checkpoint's key, alone.
        j.append(&signed(Operation::Checkpoint, key_b)).unwrap();
        let text = a.scrape(false).unwrap();
        assert_eq!(count(&text, &info(key_b)), Some(1.0), "{text}");
        assert!(!text.contains(key_a), "{text}");
        // A restarted agent finds it among the records written before it started.
        let mut b = Agent::new(cfg(None));
        let text = b.scrape(false).unwrap();
        assert_eq!(count(&text, &info(key_b)), Some(1.0), "{text}");
        // --key-dir: node.pub's id wins over the records'.
        let keys = t.path().join("keys");
        let node = image_format::sign::NodeKey::load_or_create(
            &keys.join(image_format::sign::NODE_KEY_FILE),
        )
        .unwrap();
        let mut c = Agent::new(cfg(Some(keys)));
        let text = c.scrape(false).unwrap();
        let id = image_format::sign::key_id(&node.public_key());
        assert_eq!(count(&text, &info(&id)), Some(1.0), "{text}");
        assert!(!text.contains(key_b), "{text}");
    }

    #[test]
    fn a_journal_made_after_the_start_is_counted_from_its_first_record() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("events");
        let mut a = Agent::new(Config {
            events_dir: dir.clone(),
            checkpoint_dirs: vec![],
            key_dir: None,
        });
        a.poll();
        assert!(a.healthy());
        let j = Journal::open(&dir, journal::DEFAULT_SEGMENT_BYTES).unwrap();
        j.append(&Record::new(Operation::Checkpoint, "k8s.io", "first"))
            .unwrap();
        let text = a.scrape(false).unwrap();
        assert_eq!(
            count(
                &text,
                r#"gpu_ckpt_operations_total{operation="checkpoint",outcome="succeeded",failed_step="",error_class=""} "#
            ),
            Some(1.0),
            "{text}"
        );
    }
}
