//! The record, its line (JSON with a trailing `"crc"`), and how a line is checked.

use serde::{Deserialize, Serialize};

use crate::{Result, MAX_MESSAGE_BYTES, MAX_RECORD_BYTES, MAX_STEPS, VERSION};

/// What was run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Operation {
    Checkpoint,
    Restore,
}

/// How it ended: `refused` is a restore that trust or admission refused, or a checkpoint
/// refused before any lock (unsupported MIG, MPS, NCCL).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Succeeded,
    Failed,
    Refused,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Checkpoint => "checkpoint",
            Operation::Restore => "restore",
        }
    }
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Succeeded => "succeeded",
            Outcome::Failed => "failed",
            Outcome::Refused => "refused",
        }
    }
}

impl std::fmt::Display for Operation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why an operation failed or was refused.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub struct RecordError {
    /// The failed step as in the manifest's timings (`criu-dump`, `device-lock`, ...) or, for a
    /// refusal, the check's name (`trust`, `admission`, `compat`, `unsupported`, ...).
    pub step: String,
    /// `step`, `refused`, `invalid`, `precondition`, `runc`, `io`, `image` or `internal`.
    pub class: String,
    pub message: String,
}

/// One step's duration, in the order the steps ran.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub struct StepTime {
    pub name: String,
    pub seconds: f64,
}

/// One checkpoint or restore on this node. The field names are the JSON keys.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub struct Record {
    /// The format's version: 1.
    pub v: u32,
    /// 16 hex digits, random ([`crate::new_id`]).
    pub id: String,
    /// RFC 3339 UTC with milliseconds, when the operation ended ([`crate::now_rfc3339`]).
    pub time: String,
    /// The node's host name.
    pub node: String,
    pub operation: Operation,
    pub outcome: Outcome,
    /// The containerd namespace (k8s.io, default, ...).
    pub namespace: String,
    pub container_id: String,
    /// The CRI names, when known.
    pub pod: Option<String>,
    pub pod_namespace: Option<String>,
    pub container: Option<String>,
    /// The checkpoint's image path, reference or archive (never a secret).
    pub checkpoint: Option<String>,
    pub error: Option<RecordError>,
    #[serde(default)]
    pub steps: Vec<StepTime>,
    /// The whole operation.
    pub duration_seconds: f64,
    /// A checkpoint's freeze: from the application's first stop until it runs again (or the end,
    /// for `--exit`).
    pub frozen_seconds: Option<f64>,
    /// CRIU's image and the rootfs changes written (checkpoint) or read (restore).
    #[serde(default)]
    pub host_bytes: u64,
    /// Device memory moved.
    #[serde(default)]
    pub device_bytes: u64,
    /// GPU UUIDs.
    #[serde(default)]
    pub gpus: Vec<String>,
    /// The driver version / CUDA driver version, as the manifest says.
    pub driver: Option<String>,
    /// The id of the key that signed (checkpoint) or verified (restore).
    pub signing_key: Option<String>,
    /// 32 hex digits, when the operation was traced.
    pub trace_id: Option<String>,
    /// BLAKE3 (first 16 hex digits) of the line without `crc`; filled by [`crate::Journal::append`]
    /// and checked by the readers.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub crc: String,
}

impl Record {
    /// A record of `operation` on `container_id` in containerd's `namespace`, ended now on this
    /// node, succeeded, everything else empty: fill in the rest.
    pub fn new(operation: Operation, namespace: &str, container_id: &str) -> Record {
        Record {
            v: VERSION,
            id: crate::new_id(),
            time: crate::now_rfc3339(),
            node: crate::hostname(),
            operation,
            outcome: Outcome::Succeeded,
            namespace: namespace.to_string(),
            container_id: container_id.to_string(),
            pod: None,
            pod_namespace: None,
            container: None,
            checkpoint: None,
            error: None,
            steps: Vec::new(),
            duration_seconds: 0.0,
            frozen_seconds: None,
            host_bytes: 0,
            device_bytes: 0,
            gpus: Vec::new(),
            driver: None,
            signing_key: None,
            trace_id: None,
            crc: String::new(),
        }
    }

    /// The failed step's name, if any.
    pub fn failed_step(&self) -> Option<&str> {
        self.error.as_ref().map(|e| e.step.as_str())
    }
}

/// `,"crc":"` + 16 hex + `"}`: how every line ends (before its `\n`).
const CRC_KEY: &[u8] = b",\"crc\":\"";
const CRC_HEX: usize = 16;
const CRC_SUFFIX: usize = CRC_KEY.len() + CRC_HEX + 2;

fn crc_of(body: &[u8]) -> String {
    blake3::hash(body).to_hex()[..CRC_HEX].to_string()
}

/// The longest `checkpoint` a record keeps: the restore-from annotation a tenant sets lands
/// there, so a refusal's record must not grow with it.
pub const MAX_CHECKPOINT_BYTES: usize = 1024;
/// The longest Kubernetes name a record keeps (pod, pod namespace, container, containerd
/// namespace), and the longest node name: a DNS subdomain's 253.
pub const MAX_NAME_BYTES: usize = 253;
/// The longest container id, driver version, key id and trace id a record keeps.
pub const MAX_ID_BYTES: usize = 128;
/// The longest step name (a failed step's, or a timing's) and error class a record keeps.
pub const MAX_STEP_NAME_BYTES: usize = 64;
/// The most GPU UUIDs a record keeps, and the longest of each.
pub const MAX_GPUS: usize = 64;
pub const MAX_GPU_BYTES: usize = 64;

/// Every free-form field of `r` cut to its cap (on a character boundary, ending in `…`), the
/// steps and GPUs to their counts: whatever a tenant puts in an annotation, a record's strings
/// hold at most about 12 KiB before JSON escaping (a refusal's, about 3 KiB).
fn cap_fields(r: &mut Record) {
    cut(&mut r.node, MAX_NAME_BYTES);
    cut(&mut r.namespace, MAX_NAME_BYTES);
    cut(&mut r.container_id, MAX_ID_BYTES);
    for s in [&mut r.pod, &mut r.pod_namespace, &mut r.container]
        .into_iter()
        .flatten()
    {
        cut(s, MAX_NAME_BYTES);
    }
    if let Some(c) = &mut r.checkpoint {
        cut(c, MAX_CHECKPOINT_BYTES);
    }
    for s in [&mut r.driver, &mut r.signing_key, &mut r.trace_id]
        .into_iter()
        .flatten()
    {
        cut(s, MAX_ID_BYTES);
    }
    if let Some(e) = &mut r.error {
        cut(&mut e.step, MAX_STEP_NAME_BYTES);
        cut(&mut e.class, MAX_STEP_NAME_BYTES);
        cut(&mut e.message, MAX_MESSAGE_BYTES);
    }
    r.steps.truncate(MAX_STEPS);
    for s in &mut r.steps {
        cut(&mut s.name, MAX_STEP_NAME_BYTES);
    }
    r.gpus.truncate(MAX_GPUS);
    for g in &mut r.gpus {
        cut(g, MAX_GPU_BYTES);
    }
}

/// The line of `rec` (its `crc` ignored and computed), `\n` included, at most
/// [`MAX_RECORD_BYTES`]: every free-form field cut to its cap ([`MAX_CHECKPOINT_BYTES`],
/// [`MAX_NAME_BYTES`], [`MAX_ID_BYTES`], [`MAX_STEP_NAME_BYTES`], [`MAX_MESSAGE_BYTES`]), the
/// steps at [`MAX_STEPS`] and the GPUs at [`MAX_GPUS`]; a record still too long (strings that
/// JSON escapes six-fold) has its strings and lists cut further, by halves.
pub(crate) fn encode(rec: &Record) -> Result<Vec<u8>> {
    let mut r = rec.clone();
    r.crc.clear();
    cap_fields(&mut r);
    let mut line = line_of(&r)?;
    let (mut bytes, mut items) = (MAX_MESSAGE_BYTES, MAX_STEPS);
    while line.len() > MAX_RECORD_BYTES && (bytes > 0 || items > 0) {
        bytes /= 2;
        items /= 2;
        shrink(&mut r, bytes, items);
        line = line_of(&r)?;
    }
    Ok(line)
}

/// Every string of `r` cut to `bytes`, every list to `items`.
fn shrink(r: &mut Record, bytes: usize, items: usize) {
    for s in [
        &mut r.id,
        &mut r.time,
        &mut r.node,
        &mut r.namespace,
        &mut r.container_id,
    ] {
        cut(s, bytes);
    }
    for s in [
        &mut r.pod,
        &mut r.pod_namespace,
        &mut r.container,
        &mut r.checkpoint,
        &mut r.driver,
        &mut r.signing_key,
        &mut r.trace_id,
    ]
    .into_iter()
    .flatten()
    {
        cut(s, bytes);
    }
    if let Some(e) = &mut r.error {
        cut(&mut e.step, bytes);
        cut(&mut e.class, bytes);
        cut(&mut e.message, bytes);
    }
    r.steps.truncate(items);
    for s in &mut r.steps {
        cut(&mut s.name, bytes);
    }
    r.gpus.truncate(items);
    for g in &mut r.gpus {
        cut(g, bytes);
    }
}

/// `s` cut to at most `max` bytes on a character boundary, ending in `…` when there is room
/// (what the record does to its free-form fields; the shim does it to the text of a span's error).
pub fn cut(s: &mut String, max: usize) {
    if s.len() <= max {
        return;
    }
    const MARK: &str = "…";
    let room = if max > MARK.len() * 4 {
        max - MARK.len()
    } else {
        max
    };
    let mut end = room;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.truncate(end);
    if room < max {
        s.push_str(MARK);
    }
}

fn line_of(r: &Record) -> Result<Vec<u8>> {
    let mut body = serde_json::to_vec(r)?;
    let crc = crc_of(&body);
    // `body` is an object: its last byte is `}`.
    body.pop();
    body.extend_from_slice(CRC_KEY);
    body.extend_from_slice(crc.as_bytes());
    body.extend_from_slice(b"\"}\n");
    Ok(body)
}

/// Why a line was not taken for a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bad {
    /// Not a whole line of ours: a writer killed mid-write, or not JSON.
    Torn,
    /// A whole line whose crc differs or that is no record.
    Corrupt,
}

/// The record of one line (without its `\n`), if its crc holds.
pub(crate) fn decode(line: &[u8]) -> Result<Record, Bad> {
    let n = line.len();
    if n <= CRC_SUFFIX || line[0] != b'{' || !line.ends_with(b"\"}") {
        return Err(Bad::Torn);
    }
    let key_at = n - CRC_SUFFIX;
    if &line[key_at..key_at + CRC_KEY.len()] != CRC_KEY {
        return Err(Bad::Torn);
    }
    let crc = &line[key_at + CRC_KEY.len()..n - 2];
    if !crc.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')) {
        return Err(Bad::Torn);
    }
    let mut body = Vec::with_capacity(key_at + 1);
    body.extend_from_slice(&line[..key_at]);
    body.push(b'}');
    if crc_of(&body).as_bytes() != crc {
        return Err(Bad::Corrupt);
    }
    serde_json::from_slice::<Record>(line).map_err(|_| Bad::Corrupt)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn sample() -> Record {
        let mut r = Record::new(Operation::Checkpoint, "k8s.io", "abc");
        r.pod = Some("p".into());
        r.error = Some(RecordError {
            step: "criu-dump".into(),
            class: "step".into(),
            message: "boom".into(),
        });
        r.steps = vec![StepTime {
            name: "device-lock".into(),
            seconds: 0.25,
        }];
        r
    }

    #[test]
    fn a_line_decodes_to_its_record_with_its_crc() {
        let r = sample();
        let line = encode(&r).unwrap();
        assert_eq!(*line.last().unwrap(), b'\n');
        assert_eq!(line.iter().filter(|&&b| b == b'\n').count(), 1);
        let back = decode(&line[..line.len() - 1]).unwrap();
        assert_eq!(back.crc.len(), 16);
        assert_eq!(
            Record {
                crc: String::new(),
                ..back
            },
            r
        );
    }

    #[test]
    fn a_changed_byte_or_a_prefix_is_no_record() {
        let line = encode(&sample()).unwrap();
        let line = &line[..line.len() - 1];
        let s = String::from_utf8(line.to_vec()).unwrap();
        // Still JSON, another value: the crc tells.
        let changed = s.replace("\"boom\"", "\"bood\"");
        assert_ne!(changed, s);
        assert!(serde_json::from_str::<Record>(&changed).is_ok());
        assert_eq!(decode(changed.as_bytes()), Err(Bad::Corrupt));
        for n in [0, 1, line.len() / 2, line.len() - 1] {
            assert_eq!(decode(&line[..n]), Err(Bad::Torn), "prefix of {n}");
        }
    }

    #[test]
    fn a_long_record_is_shrunk_to_the_cap() {
        let mut r = sample();
        let msg = "é".repeat(3000);
        r.error.as_mut().unwrap().message = msg;
        r.steps = (0..200)
            .map(|i| StepTime {
                name: format!("step-{i}"),
                seconds: 1.0,
            })
            .collect();
        let line = encode(&r).unwrap();
        let back = decode(&line[..line.len() - 1]).unwrap();
        let m = &back.error.unwrap().message;
        assert!(
            m.len() <= MAX_MESSAGE_BYTES && m.len() > MAX_MESSAGE_BYTES - 8,
            "{}",
            m.len()
        );
        assert!(m.ends_with('…'));
        assert_eq!(back.steps.len(), MAX_STEPS);
        assert_eq!(back.steps[63].name, "step-63");

        // Strings past any message: cut until the line fits.
        r.checkpoint = Some("\u{1}".repeat(100_000));
        r.gpus = vec!["GPU-x".repeat(1000); 100];
        let line = encode(&r).unwrap();
        assert!(line.len() <= MAX_RECORD_BYTES, "{}", line.len());
        assert!(decode(&line[..line.len() - 1]).is_ok());
    }

    /// A refused restore as the shim records it when a tenant's restore-from annotation is
    /// 62 KiB: the annotation in `checkpoint` and, quoted, in the message.
    pub(crate) fn flood_record(annotation: &str) -> Record {
        let mut r = Record::new(Operation::Restore, "k8s.io", &"c".repeat(64));
        r.outcome = Outcome::Refused;
        r.pod = Some("tenant-pod".into());
        r.pod_namespace = Some("tenant".into());
        r.container = Some("main".into());
        r.checkpoint = Some(annotation.to_string());
        r.error = Some(RecordError {
            step: "trust".into(),
            class: "refused".into(),
            message: format!("restore refused: checkpoint {annotation:?}"),
        });
        r
    }

    #[test]
    fn a_62_kib_annotation_makes_a_record_under_8_kib() {
        let annotation = format!("/var/lib/kubelet/checkpoints/{}", "a".repeat(62 << 10));
        let line = encode(&flood_record(&annotation)).unwrap();
        assert!(line.len() < 8 << 10, "{} bytes", line.len());
        let back = decode(&line[..line.len() - 1]).unwrap();
        let c = back.checkpoint.unwrap();
        assert!(
            c.len() <= MAX_CHECKPOINT_BYTES && c.len() > MAX_CHECKPOINT_BYTES - 8,
            "{}",
            c.len()
        );
        assert!(c.starts_with("/var/lib/kubelet/checkpoints/aaa"), "{c}");
        assert!(c.ends_with('…'), "{c}");
    }

    #[test]
    fn every_free_form_field_is_capped_and_marked() {
        let long = |n: usize| "é".repeat(n);
        let mut r = sample();
        r.node = long(1000);
        r.namespace = long(1000);
        r.container_id = long(1000);
        r.pod = Some(long(1000));
        r.pod_namespace = Some(long(1000));
        r.container = Some(long(1000));
        r.checkpoint = Some(long(5000));
        r.driver = Some(long(1000));
        r.signing_key = Some(long(1000));
        r.trace_id = Some(long(1000));
        r.error = Some(RecordError {
            step: long(1000),
            class: long(1000),
            message: long(5000),
        });
        r.steps = (0..100)
            .map(|_| StepTime {
                name: long(1000),
                seconds: 1.0,
            })
            .collect();
        r.gpus = vec![long(1000); 100];
        let line = encode(&r).unwrap();
        let b = decode(&line[..line.len() - 1]).unwrap();
        let e = b.error.as_ref().unwrap();
        let mut fields: Vec<(&str, &str, usize)> = vec![
            ("node", &b.node, MAX_NAME_BYTES),
            ("namespace", &b.namespace, MAX_NAME_BYTES),
            ("container_id", &b.container_id, MAX_ID_BYTES),
            ("pod", b.pod.as_deref().unwrap(), MAX_NAME_BYTES),
            (
                "pod_namespace",
                b.pod_namespace.as_deref().unwrap(),
                MAX_NAME_BYTES,
            ),
            ("container", b.container.as_deref().unwrap(), MAX_NAME_BYTES),
            (
                "checkpoint",
                b.checkpoint.as_deref().unwrap(),
                MAX_CHECKPOINT_BYTES,
            ),
            ("driver", b.driver.as_deref().unwrap(), MAX_ID_BYTES),
            (
                "signing_key",
                b.signing_key.as_deref().unwrap(),
                MAX_ID_BYTES,
            ),
            ("trace_id", b.trace_id.as_deref().unwrap(), MAX_ID_BYTES),
            ("error.step", &e.step, MAX_STEP_NAME_BYTES),
            ("error.class", &e.class, MAX_STEP_NAME_BYTES),
            ("error.message", &e.message, MAX_MESSAGE_BYTES),
        ];
        fields.extend(
            b.steps
                .iter()
                .map(|s| ("step", s.name.as_str(), MAX_STEP_NAME_BYTES)),
        );
        fields.extend(b.gpus.iter().map(|g| ("gpu", g.as_str(), MAX_GPU_BYTES)));
        for (name, v, cap) in fields {
            // Cut on a character boundary, within 2 bytes + the mark of the cap, marked.
            assert!(
                v.len() <= cap && v.len() + 5 >= cap,
                "{name}: {} > {cap}",
                v.len()
            );
            assert!(v.ends_with('…'), "{name}: {v}");
        }
        assert_eq!(b.steps.len(), MAX_STEPS);
        assert_eq!(b.gpus.len(), MAX_GPUS);
        // A record with every field at its cap is a few KiB (two-byte characters: no escaping).
        assert!(line.len() < 16 << 10, "{}", line.len());
        // Short values are kept as they are.
        let r = sample();
        let line = encode(&r).unwrap();
        let b = decode(&line[..line.len() - 1]).unwrap();
        assert_eq!(
            Record {
                crc: String::new(),
                ..b
            },
            r
        );
    }

    #[test]
    fn cut_keeps_characters_whole() {
        let mut s = "aé".repeat(10);
        cut(&mut s, 5);
        assert_eq!(s, "aéa");
        let mut s = "ab".repeat(100);
        cut(&mut s, 20);
        assert_eq!(s.len(), 20);
        assert!(s.ends_with('…'));
    }
}
