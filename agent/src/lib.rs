//! gpu-ckpt's node agent: Prometheus metrics of the node's checkpoints and restores.
//!
//! [`Agent`] counts the records the shims append to the node's event journal (crate `journal`)
//! after it started (a [`journal::Tailer`] from the end, so a restart never counts old records
//! twice), polled every second and at each scrape, and reads the node's state at each scrape:
//! the checkpoints on disk ([`disk`]) and the signing key in use ([`key`]). [`server`] serves
//! `/metrics` and `/healthz`.

pub mod disk;
pub mod key;
pub mod metrics;
pub mod server;

use std::path::PathBuf;

pub use metrics::{Metrics, NodeState};

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
    /// The directory of the node's signing key (`node.pub` in it).
    pub key_dir: Option<PathBuf>,
}

/// The journal's tail and the metrics it moves.
pub struct Agent {
    config: Config,
    metrics: Metrics,
    tailer: Option<journal::Tailer>,
    /// Whether the last poll of the journal succeeded (or there is no journal yet).
    journal_ok: bool,
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
        };
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
    pub fn node_state(&self) -> NodeState {
        let usage = disk::scan(&self.config.checkpoint_dirs);
        if usage.truncated {
            tracing::warn!(limit = disk::MAX_ENTRIES, "the checkpoint directories hold more entries than one scan reads; the figures are a lower bound");
        }
        NodeState {
            checkpoints: usage.checkpoints,
            checkpoint_bytes: usage.bytes,
            key_id: self.config.key_dir.as_deref().and_then(key::key_id),
        }
    }

    /// A scrape: the journal polled, the node's state read, the registry encoded.
    pub fn scrape(&mut self, openmetrics: bool) -> Result<String, Error> {
        self.poll();
        let state = self.node_state();
        self.metrics.set_node_state(&state);
        Ok(if openmetrics {
            self.metrics.openmetrics()?
        } else {
            self.metrics.prometheus_text()?
        })
    }

    /// Whether the journal could be read at the last poll.
    pub fn healthy(&self) -> bool {
        self.journal_ok
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
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
