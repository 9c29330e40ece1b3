//! The metric families and how a journal record and the node's state move them.
//!
//! Names and units follow Prometheus' conventions: base units (seconds, bytes), counters end in
//! `_total` (the encoder adds it), the unit is a suffix of the name (`register_with_unit`), and a
//! label's value is one of a small, bounded set (operation, outcome, step, error class, memory
//! kind) except `key_id` on the info gauge, which has one series at a time. A record's string
//! becomes a label value only when it looks like a step name or class ([`label_value`]), else
//! `other`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use journal::Record;

/// Upper bounds of the operation and step duration buckets, in seconds: from a step that takes
/// tens of milliseconds (a device lock of an idle GPU, a signature) to a checkpoint of a large
/// GPU job (ten minutes).
pub const DURATION_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// Upper bounds of the frozen-time buckets, in seconds: the time an application does not run
/// during a checkpoint, which `ResumeAfterDump` brings down to well under a second.
pub const FROZEN_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// The value a label takes from a record's string (`operation`, `outcome`, `failed_step`,
/// `step`, `error_class`): the string itself when it matches `^[a-z0-9][a-z0-9-]{0,47}$` (every
/// step name and error class the shim writes), else `other`, so that a record of a future or
/// foreign writer cannot multiply the series or put odd text in a label.
pub fn label_value(s: &str) -> String {
    let b = s.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 48
        && matches!(b[0], b'a'..=b'z' | b'0'..=b'9')
        && b.iter()
            .all(|c| matches!(c, b'a'..=b'z' | b'0'..=b'9' | b'-'));
    if ok {
        s.to_string()
    } else {
        OTHER.to_string()
    }
}

/// The label value of a record's string that is not one (see [`label_value`]).
pub const OTHER: &str = "other";

/// `gpu_ckpt_operations_total`'s labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabels {
    /// `checkpoint` | `restore`.
    pub operation: String,
    /// `succeeded` | `failed` | `refused`.
    pub outcome: String,
    /// The step that failed (or the check that refused); empty when none did.
    pub failed_step: String,
    /// The error's class (`step`, `refused`, `io`, ...); empty when none.
    pub error_class: String,
}

/// `gpu_ckpt_operation_duration_seconds`' labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub operation: String,
    pub outcome: String,
}

/// `gpu_ckpt_step_duration_seconds`' labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepLabels {
    pub operation: String,
    pub step: String,
}

/// `gpu_ckpt_frozen_seconds`' labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationOnly {
    pub operation: String,
}

/// `gpu_ckpt_moved_bytes_total`'s labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MovedLabels {
    pub operation: String,
    /// `host` | `device`.
    pub memory: String,
}

/// `gpu_ckpt_signing_key_info`'s label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KeyLabels {
    pub key_id: String,
}

fn duration_histogram() -> Histogram {
    Histogram::new(DURATION_BUCKETS.iter().copied())
}

fn frozen_histogram() -> Histogram {
    Histogram::new(FROZEN_BUCKETS.iter().copied())
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// The node's state as one scrape finds it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeState {
    /// Checkpoints under the checkpoint directories, and their bytes.
    pub checkpoints: u64,
    pub checkpoint_bytes: u64,
    /// The key id of the node's signing key, when its public key could be read.
    pub key_id: Option<String>,
}

/// Every metric the agent serves, in one registry.
pub struct Metrics {
    registry: Registry,
    operations: Family<OperationLabels, Counter>,
    operation_duration: HistogramFamily<OutcomeLabels>,
    step_duration: HistogramFamily<StepLabels>,
    frozen: HistogramFamily<OperationOnly>,
    moved: Family<MovedLabels, Counter>,
    on_disk: Gauge,
    on_disk_bytes: Gauge,
    signing_key: Family<KeyLabels, Gauge>,
    skipped: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// A counter or gauge value from a byte count: gauges and counters here hold `i64`/`u64`;
/// a count beyond `i64::MAX` is held at it.
fn gauge_value(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let operations = Family::<OperationLabels, Counter>::default();
        registry.register(
            "gpu_ckpt_operations",
            "Checkpoints and restores the node's shims ran (refusals included), by outcome and, for a failure or refusal, the failing step and the error's class",
            operations.clone(),
        );
        let operation_duration: HistogramFamily<OutcomeLabels> =
            Family::new_with_constructor(duration_histogram as fn() -> Histogram);
        registry.register_with_unit(
            "gpu_ckpt_operation_duration",
            "How long a whole checkpoint or restore took, by outcome",
            Unit::Seconds,
            operation_duration.clone(),
        );
        let step_duration: HistogramFamily<StepLabels> =
            Family::new_with_constructor(duration_histogram as fn() -> Histogram);
        registry.register_with_unit(
            "gpu_ckpt_step_duration",
            "How long each step of a checkpoint or restore took (device-lock, device-checkpoint, criu-dump, manifest-hash, verify, criu-restore, device-restore, ...)",
            Unit::Seconds,
            step_duration.clone(),
        );
        let frozen: HistogramFamily<OperationOnly> =
            Family::new_with_constructor(frozen_histogram as fn() -> Histogram);
        registry.register_with_unit(
            "gpu_ckpt_frozen",
            "How long the application did not run during a checkpoint (from its first stop until it runs again)",
            Unit::Seconds,
            frozen.clone(),
        );
        let moved = Family::<MovedLabels, Counter>::default();
        registry.register_with_unit(
            "gpu_ckpt_moved",
            "Bytes a checkpoint wrote or a restore read: host (CRIU's images and the rootfs changes) and device (GPU memory)",
            Unit::Bytes,
            moved.clone(),
        );
        let on_disk = Gauge::default();
        registry.register(
            "gpu_ckpt_checkpoints_on_disk",
            "Checkpoints under the agent's checkpoint directories (directories with a gpu-ckpt manifest, and checkpoint archives)",
            on_disk.clone(),
        );
        let on_disk_bytes = Gauge::default();
        registry.register_with_unit(
            "gpu_ckpt_checkpoints_on_disk",
            "Bytes of the checkpoints under the agent's checkpoint directories",
            Unit::Bytes,
            on_disk_bytes.clone(),
        );
        let signing_key = Family::<KeyLabels, Gauge>::default();
        registry.register(
            "gpu_ckpt_signing_key_info",
            "The node's signing key in use: 1 with its key id (ed25519:<32 hex digits>); no series while the node has none",
            signing_key.clone(),
        );
        let skipped = Counter::default();
        registry.register(
            "gpu_ckpt_journal_records_skipped",
            "Journal lines the agent skipped: torn (a writer killed mid-write), not JSON, or a checksum that differs",
            skipped.clone(),
        );
        Metrics {
            registry,
            operations,
            operation_duration,
            step_duration,
            frozen,
            moved,
            on_disk,
            on_disk_bytes,
            signing_key,
            skipped,
        }
    }

    /// One journal record.
    pub fn observe(&self, rec: &Record) {
        let operation = label_value(rec.operation.as_str());
        let outcome = label_value(rec.outcome.as_str());
        // Empty (no error) stays empty; an error's step and class are checked.
        let (failed_step, error_class) = match &rec.error {
            Some(e) => (label_value(&e.step), label_value(&e.class)),
            None => (String::new(), String::new()),
        };
        self.operations
            .get_or_create(&OperationLabels {
                operation: operation.clone(),
                outcome: outcome.clone(),
                failed_step,
                error_class,
            })
            .inc();
        if rec.duration_seconds.is_finite() && rec.duration_seconds >= 0.0 {
            self.operation_duration
                .get_or_create(&OutcomeLabels {
                    operation: operation.clone(),
                    outcome,
                })
                .observe(rec.duration_seconds);
        }
        for s in &rec.steps {
            if s.seconds.is_finite() && s.seconds >= 0.0 {
                self.step_duration
                    .get_or_create(&StepLabels {
                        operation: operation.clone(),
                        step: label_value(&s.name),
                    })
                    .observe(s.seconds);
            }
        }
        if let Some(f) = rec.frozen_seconds.filter(|f| f.is_finite() && *f >= 0.0) {
            self.frozen
                .get_or_create(&OperationOnly {
                    operation: operation.clone(),
                })
                .observe(f);
        }
        for (memory, bytes) in [("host", rec.host_bytes), ("device", rec.device_bytes)] {
            self.moved
                .get_or_create(&MovedLabels {
                    operation: operation.clone(),
                    memory: memory.to_string(),
                })
                .inc_by(bytes);
        }
    }

    /// Lines the journal's reader skipped.
    pub fn skipped(&self, n: u64) {
        self.skipped.inc_by(n);
    }

    /// The node's state at this scrape.
    pub fn set_node_state(&self, s: &NodeState) {
        self.on_disk.set(gauge_value(s.checkpoints));
        self.on_disk_bytes.set(gauge_value(s.checkpoint_bytes));
        self.signing_key.clear();
        if let Some(id) = &s.key_id {
            self.signing_key
                .get_or_create(&KeyLabels { key_id: id.clone() })
                .set(1);
        }
    }

    /// The registry in OpenMetrics' text format (`application/openmetrics-text; version=1.0.0`).
    pub fn openmetrics(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }

    /// The registry in Prometheus' text format (`text/plain; version=0.0.4`).
    pub fn prometheus_text(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use journal::{Operation, Outcome, RecordError, StepTime};

    fn checkpoint_ok() -> Record {
        let mut r = Record::new(Operation::Checkpoint, "k8s.io", "c1");
        r.steps = vec![
            StepTime {
                name: "device-lock".into(),
                seconds: 0.07,
            },
            StepTime {
                name: "criu-dump".into(),
                seconds: 3.0,
            },
        ];
        r.duration_seconds = 3.2;
        r.frozen_seconds = Some(0.3);
        r.host_bytes = 1000;
        r.device_bytes = 5000;
        r
    }

    fn failed(op: Operation, outcome: Outcome, step: &str, class: &str) -> Record {
        let mut r = Record::new(op, "k8s.io", "c2");
        r.outcome = outcome;
        r.error = Some(RecordError {
            step: step.into(),
            class: class.into(),
            message: "boom".into(),
        });
        r.steps = vec![StepTime {
            name: step.into(),
            seconds: 0.5,
        }];
        r.duration_seconds = 0.6;
        r
    }

    /// The exposition's sample lines, by name with labels.
    fn samples(text: &str) -> Vec<(String, f64)> {
        text.lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .map(|l| {
                let (k, v) = l.rsplit_once(' ').unwrap();
                (k.to_string(), v.parse::<f64>().unwrap())
            })
            .collect()
    }

    fn value(text: &str, key: &str) -> Option<f64> {
        samples(text)
            .into_iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
    }

    #[test]
    fn families_have_prometheus_names_types_and_units() {
        let m = Metrics::new();
        m.observe(&checkpoint_ok());
        m.set_node_state(&NodeState {
            checkpoints: 2,
            checkpoint_bytes: 12345,
            key_id: Some("ed25519:00112233445566778899aabbccddeeff".into()),
        });
        let om = m.openmetrics().unwrap();
        for (name, kind, unit) in [
            ("gpu_ckpt_operations", "counter", None),
            (
                "gpu_ckpt_operation_duration_seconds",
                "histogram",
                Some("seconds"),
            ),
            (
                "gpu_ckpt_step_duration_seconds",
                "histogram",
                Some("seconds"),
            ),
            ("gpu_ckpt_frozen_seconds", "histogram", Some("seconds")),
            ("gpu_ckpt_moved_bytes", "counter", Some("bytes")),
            ("gpu_ckpt_checkpoints_on_disk", "gauge", None),
            ("gpu_ckpt_checkpoints_on_disk_bytes", "gauge", Some("bytes")),
            ("gpu_ckpt_signing_key_info", "gauge", None),
            ("gpu_ckpt_journal_records_skipped", "counter", None),
        ] {
            assert!(
                om.contains(&format!("# TYPE {name} {kind}\n")),
                "no {kind} {name} in:\n{om}"
            );
            assert!(om.contains(&format!("# HELP {name} ")), "{name}: no HELP");
            if let Some(u) = unit {
                assert!(
                    om.contains(&format!("# UNIT {name} {u}\n")),
                    "{name}: no UNIT {u}"
                );
            }
        }
        assert!(om.ends_with("# EOF\n"));
        // Counters' samples end in _total; nothing is named _total_total.
        assert!(!om.contains("_total_total"), "{om}");
        let key = r#"gpu_ckpt_operations_total{operation="checkpoint",outcome="succeeded",failed_step="",error_class=""}"#;
        assert_eq!(value(&om, key), Some(1.0), "{om}");
        assert_eq!(
            value(
                &om,
                r#"gpu_ckpt_moved_bytes_total{operation="checkpoint",memory="host"}"#
            ),
            Some(1000.0)
        );
        assert_eq!(
            value(
                &om,
                r#"gpu_ckpt_moved_bytes_total{operation="checkpoint",memory="device"}"#
            ),
            Some(5000.0)
        );
        assert_eq!(value(&om, "gpu_ckpt_checkpoints_on_disk"), Some(2.0));
        assert_eq!(
            value(&om, "gpu_ckpt_checkpoints_on_disk_bytes"),
            Some(12345.0)
        );
        assert_eq!(
            value(
                &om,
                r#"gpu_ckpt_signing_key_info{key_id="ed25519:00112233445566778899aabbccddeeff"}"#
            ),
            Some(1.0)
        );
        assert_eq!(
            value(&om, "gpu_ckpt_journal_records_skipped_total"),
            Some(0.0)
        );
        // Prometheus' own text format has the same samples.
        let text = m.prometheus_text().unwrap();
        assert_eq!(value(&text, key), Some(1.0), "{text}");
        assert!(
            text.contains("# TYPE gpu_ckpt_operations_total counter")
                || text.contains("# TYPE gpu_ckpt_operations counter"),
            "{text}"
        );
    }

    #[test]
    fn failures_and_refusals_carry_the_step_and_class() {
        let m = Metrics::new();
        m.observe(&checkpoint_ok());
        m.observe(&failed(
            Operation::Checkpoint,
            Outcome::Failed,
            "criu-dump",
            "step",
        ));
        m.observe(&failed(
            Operation::Checkpoint,
            Outcome::Failed,
            "criu-dump",
            "step",
        ));
        m.observe(&failed(
            Operation::Restore,
            Outcome::Refused,
            "trust",
            "refused",
        ));
        let om = m.openmetrics().unwrap();
        assert_eq!(
            value(
                &om,
                r#"gpu_ckpt_operations_total{operation="checkpoint",outcome="failed",failed_step="criu-dump",error_class="step"}"#
            ),
            Some(2.0),
            "{om}"
        );
        assert_eq!(
            value(
                &om,
                r#"gpu_ckpt_operations_total{operation="restore",outcome="refused",failed_step="trust",error_class="refused"}"#
            ),
            Some(1.0),
            "{om}"
        );
        // Durations by outcome; the steps of every outcome, by operation and step.
        assert_eq!(
            value(
                &om,
                r#"gpu_ckpt_operation_duration_seconds_count{operation="checkpoint",outcome="failed"}"#
            ),
            Some(2.0)
        );
        assert_eq!(
            value(
                &om,
                r#"gpu_ckpt_step_duration_seconds_count{operation="checkpoint",step="criu-dump"}"#
            ),
            Some(3.0)
        );
        assert_eq!(
            value(
                &om,
                r#"gpu_ckpt_step_duration_seconds_sum{operation="checkpoint",step="criu-dump"}"#
            ),
            Some(4.0)
        );
        assert_eq!(
            value(
                &om,
                r#"gpu_ckpt_step_duration_seconds_count{operation="restore",step="trust"}"#
            ),
            Some(1.0)
        );
        // No frozen time on a record without one.
        assert_eq!(
            value(
                &om,
                r#"gpu_ckpt_frozen_seconds_count{operation="checkpoint"}"#
            ),
            Some(1.0)
        );
        assert_eq!(
            value(&om, r#"gpu_ckpt_frozen_seconds_count{operation="restore"}"#),
            None
        );
    }

    #[test]
    fn label_values_are_checked() {
        for ok in [
            "criu-dump",
            "trust",
            "refused",
            "a",
            "0",
            "device-restore",
            &"a".repeat(48),
        ] {
            assert_eq!(label_value(ok), ok);
        }
        for bad in [
            "",
            "-step",
            "Criu-dump",
            "criu_dump",
            "criu dump",
            "step\"} 1",
            "é",
            "step\n",
            &"a".repeat(49),
        ] {
            assert_eq!(label_value(bad), "other", "{bad:?}");
        }
        // In the families: the odd step, class and step names become `other`, one series.
        let m = Metrics::new();
        for i in 0..100 {
            let mut r = failed(
                Operation::Checkpoint,
                Outcome::Failed,
                &format!("Step {i}"),
                &format!("class_{i}"),
            );
            r.steps.push(StepTime {
                name: format!("{}{i}", "x".repeat(60)),
                seconds: 0.1,
            });
            m.observe(&r);
        }
        let om = m.openmetrics().unwrap();
        assert_eq!(
            value(
                &om,
                r#"gpu_ckpt_operations_total{operation="checkpoint",outcome="failed",failed_step="other",error_class="other"}"#
            ),
            Some(100.0),
            "{om}"
        );
        assert_eq!(
            value(
                &om,
                r#"gpu_ckpt_step_duration_seconds_count{operation="checkpoint",step="other"}"#
            ),
            Some(200.0),
            "{om}"
        );
        assert!(!om.contains("Step ") && !om.contains("class_"), "{om}");
        // A success keeps its empty failed_step and error_class.
        m.observe(&checkpoint_ok());
        let om = m.openmetrics().unwrap();
        assert!(
            om.contains(r#"gpu_ckpt_operations_total{operation="checkpoint",outcome="succeeded",failed_step="",error_class=""} 1"#),
            "{om}"
        );
    }

    #[test]
    fn histogram_buckets_span_checkpoint_times() {
        let m = Metrics::new();
        m.observe(&checkpoint_ok());
        let om = m.openmetrics().unwrap();
        // The `le` of each bucket of `name` whose labels include `pairs`, in order.
        let les = |name: &str, pairs: &[&str]| -> Vec<String> {
            samples(&om)
                .into_iter()
                .filter(|(k, _)| {
                    k.starts_with(&format!("{name}{{")) && pairs.iter().all(|p| k.contains(p))
                })
                .map(|(k, _)| {
                    let i = k.find("le=\"").unwrap() + 4;
                    k[i..k[i..].find('"').unwrap() + i].to_string()
                })
                .collect()
        };
        let want = |b: &[f64]| -> Vec<String> {
            b.iter()
                .map(|v| format!("{v:?}"))
                .chain(["+Inf".to_string()])
                .collect()
        };
        let step = les(
            "gpu_ckpt_step_duration_seconds_bucket",
            &[r#"operation="checkpoint""#, r#"step="criu-dump""#],
        );
        assert_eq!(step, want(DURATION_BUCKETS), "{om}");
        let op = les(
            "gpu_ckpt_operation_duration_seconds_bucket",
            &[r#"operation="checkpoint""#, r#"outcome="succeeded""#],
        );
        assert_eq!(op, want(DURATION_BUCKETS));
        let fr = les(
            "gpu_ckpt_frozen_seconds_bucket",
            &[r#"operation="checkpoint""#],
        );
        assert_eq!(fr, want(FROZEN_BUCKETS));
        assert_eq!(DURATION_BUCKETS.first(), Some(&0.05));
        assert_eq!(DURATION_BUCKETS.last(), Some(&600.0));
        assert!(FROZEN_BUCKETS.first().is_some_and(|f| *f <= 0.05));
        assert_eq!(FROZEN_BUCKETS.last(), Some(&600.0));
        for b in [DURATION_BUCKETS, FROZEN_BUCKETS] {
            assert!(b.windows(2).all(|w| w[0] < w[1]));
        }
        // 3.0 s of criu-dump: in le=5 and above, not in le=2.5.
        assert_eq!(
            value(
                &om,
                r#"gpu_ckpt_step_duration_seconds_bucket{le="2.5",operation="checkpoint",step="criu-dump"}"#
            ),
            Some(0.0)
        );
        assert_eq!(
            value(
                &om,
                r#"gpu_ckpt_step_duration_seconds_bucket{le="5.0",operation="checkpoint",step="criu-dump"}"#
            ),
            Some(1.0)
        );
    }

    #[test]
    fn the_key_series_follows_a_rotation_and_goes_with_the_key() {
        let m = Metrics::new();
        let mut s = NodeState {
            key_id: Some("ed25519:aa".into()),
            ..NodeState::default()
        };
        m.set_node_state(&s);
        s.key_id = Some("ed25519:bb".into());
        m.set_node_state(&s);
        let om = m.openmetrics().unwrap();
        assert!(!om.contains("ed25519:aa"), "{om}");
        assert_eq!(
            value(&om, r#"gpu_ckpt_signing_key_info{key_id="ed25519:bb"}"#),
            Some(1.0)
        );
        s.key_id = None;
        m.set_node_state(&s);
        assert!(!m.openmetrics().unwrap().contains("key_id="));
    }
}
