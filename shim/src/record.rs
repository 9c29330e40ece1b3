//! What operators see of each checkpoint and restore: one record per operation (and per
//! refusal) in the node's journal (`journal` crate, `EventsDir`), and the trace spans of its
//! steps.
//!
//! - [`OpLog`]: one operation's clock, shared by its steps: each step timed as it runs
//!   ([`OpLog::step`], which also opens the step's span under the operation's root span), the
//!   moment the application stopped and the moment it ran again.
//! - [`classify`]: the one map from the shim's [`Error`] to the record's error step and class.
//! - [`Facts`] and [`build`]: the record of one operation from what it knew and how it ended.
//! - [`append`]: the record written off the async executor, bounded; a failed write is a
//!   warning, never a failed operation.
//!
//! Span conventions (exported by `telemetry`): the root `checkpoint` or `restore` under target
//! [`OP_TARGET`], each step `step` under [`STEP_TARGET`] with `otel.name` the step's name, as
//! the manifest's timings and the record name it.

use std::{
    future::Future,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use image_format::manifest::Manifest;
use journal::{Operation, Outcome, Record, RecordError, StepTime};
use tracing::{field::Empty, warn, Instrument, Span};

use crate::{bundle::CriIdentity, error::Error, options::RuntimeOptions};

/// The target of an operation's root span.
pub const OP_TARGET: &str = "gpu_ckpt::op";
/// The target of a step's span.
pub const STEP_TARGET: &str = "gpu_ckpt::step";

/// How long a record's append may take before the operation goes on without it (the journal
/// waits at most 2 s for its lock; the rest is the write and its sync).
const APPEND_BOUND: Duration = Duration::from_secs(5);

/// The steps that stop the application as they start: the NCCL layer's quiesce, the device
/// lock, CRIU's freeze (a Pause's freeze is marked where it happens).
const STOPPING_STEPS: [&str; 3] = ["nccl-quiesce", "device-lock", "criu-dump"];

/// The record's error classes (`RecordError.class`).
pub mod class {
    pub const STEP: &str = "step";
    pub const REFUSED: &str = "refused";
    pub const INVALID: &str = "invalid";
    pub const PRECONDITION: &str = "precondition";
    pub const RUNC: &str = "runc";
    pub const IO: &str = "io";
    pub const IMAGE: &str = "image";
    pub const INTERNAL: &str = "internal";
}

/// Steps whose failure is a refusal by a check, not a step that broke: what the driver cannot
/// checkpoint (MIG, NCCL without the layer, MPS: before any lock), a checkpoint that does not
/// fit this node's GPUs or driver, the restore handler's admission and its check of what a
/// source holds.
const REFUSING_STEPS: [&str; 5] = ["unsupported", "compat", "admission", "trust", "check"];

/// The error step and class of `e`, for the record: a step's error names its step; a refusal
/// of trust (`Refused`, `PermissionDenied`) is step `trust`; any other error is charged to
/// `running`, the step that was running when it came (else `other`).
pub fn classify(e: &Error, running: Option<&str>) -> (String, &'static str) {
    let here = || running.unwrap_or("other").to_string();
    match e {
        Error::Step { step, .. } if REFUSING_STEPS.contains(step) => {
            (step.to_string(), class::REFUSED)
        }
        Error::Step { step, .. } => (step.to_string(), class::STEP),
        Error::Refused { .. } | Error::PermissionDenied(_) => ("trust".into(), class::REFUSED),
        Error::InvalidArgument(_)
        | Error::Json { .. }
        | Error::Protobuf(_)
        | Error::Unimplemented(_) => (here(), class::INVALID),
        Error::NotFound(_) | Error::AlreadyExists(_) | Error::FailedPrecondition(_) => {
            (here(), class::PRECONDITION)
        }
        Error::Runc { .. } => (here(), class::RUNC),
        Error::Io { .. } => (here(), class::IO),
        Error::Image(image_format::Error::Io { .. }) => (here(), class::IO),
        Error::Image(_) => (here(), class::IMAGE),
        Error::Shim(_) => (here(), class::INTERNAL),
    }
}

/// The outcome of an operation that failed with `e`: refused where a check refused it.
pub fn outcome_of(e: &Error) -> Outcome {
    match classify(e, None).1 {
        class::REFUSED => Outcome::Refused,
        _ => Outcome::Failed,
    }
}

/// The root span of an operation: `checkpoint` or `restore`, with the container's identity.
pub fn root_span(operation: Operation, id: &str, cri: Option<&CriIdentity>) -> Span {
    let span = match operation {
        Operation::Checkpoint => tracing::info_span!(target: "gpu_ckpt::op", "checkpoint",
            otel.name = "checkpoint", otel.status_code = Empty, otel.status_message = Empty,
            container.id = %id, k8s.pod.name = Empty, k8s.namespace.name = Empty,
            k8s.container.name = Empty, gpu_ckpt.outcome = Empty),
        Operation::Restore => tracing::info_span!(target: "gpu_ckpt::op", "restore",
            otel.name = "restore", otel.status_code = Empty, otel.status_message = Empty,
            container.id = %id, k8s.pod.name = Empty, k8s.namespace.name = Empty,
            k8s.container.name = Empty, gpu_ckpt.outcome = Empty),
    };
    if let Some(cri) = cri {
        for (field, value) in [
            ("k8s.pod.name", &cri.sandbox_name),
            ("k8s.namespace.name", &cri.namespace),
            ("k8s.container.name", &cri.name),
        ] {
            if !value.is_empty() {
                span.record(field, value.as_str());
            }
        }
    }
    span
}

/// The text of a span's error status: the error, cut as the record cuts its message (an error can
/// carry what a pod's annotation said, of any length).
fn status_text(e: &Error) -> String {
    let mut text = e.to_string();
    journal::cut(&mut text, journal::MAX_MESSAGE_BYTES);
    text
}

/// The root span's outcome, and its error status when it did not succeed.
pub fn end_root(span: &Span, outcome: Outcome, error: Option<&Error>) {
    span.record("gpu_ckpt.outcome", outcome.as_str());
    if let Some(e) = error {
        span.record("otel.status_code", "ERROR");
        span.record("otel.status_message", status_text(e).as_str());
    }
}

/// A Pause that no checkpoint followed ended (Resume, Kill, Delete; or the Pause failed
/// otherwise than at a checkpoint's step): its root, named `pause` from here, is given the
/// outcome (`error`: what ended or failed it) and closed. No record: it was no checkpoint.
/// Whether there was such a root (then its spans are to be sent).
pub fn end_pause(log: &OpLog, error: Option<&Error>) -> bool {
    let Some(root) = log.take_pause_root() else {
        return false;
    };
    rename(&root, "pause");
    end_root(&root, error.map_or(Outcome::Succeeded, outcome_of), error);
    true
}

/// `span`'s OpenTelemetry name from here on. tracing-opentelemetry takes an `otel.name`
/// recorded only while the span has not started (no child, no context asked yet); a started
/// one is renamed through its context.
fn rename(span: &Span, name: &'static str) {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    span.record("otel.name", name);
    span.context().span().update_name(name);
}

/// One operation's clock: its steps in the order they ran, the failing one, and when the
/// application stopped and ran again. Cloned handles share it (a step timed in a blocking
/// thread writes to the same log).
#[derive(Clone, Debug)]
pub struct OpLog(Arc<Mutex<State>>);

#[derive(Debug)]
struct State {
    root: Span,
    start: Instant,
    steps: Vec<(String, Duration)>,
    /// The step that failed, and how long it ran.
    failed: Option<(String, Duration)>,
    /// The step running now (the innermost), for an error that names none.
    running: Vec<&'static str>,
    last_end: Instant,
    frozen_from: Option<Instant>,
    runs_again: Option<Instant>,
    /// What the checkpoint's manifest says (a restore, once it has read it).
    manifest: Option<Facts>,
    /// The root was opened by a Pause and no checkpoint has taken it on yet
    /// ([`OpLog::continue_pause`], [`end_pause`]).
    from_pause: bool,
}

impl Default for OpLog {
    fn default() -> Self {
        OpLog::new(Span::none())
    }
}

impl OpLog {
    /// A log that starts now, its steps' spans under `root` (none: the steps' spans are not
    /// exported, as under a Pause that no checkpoint may follow).
    pub fn new(root: Span) -> Self {
        let now = Instant::now();
        OpLog(Arc::new(Mutex::new(State {
            root,
            start: now,
            steps: Vec::new(),
            failed: None,
            running: Vec::new(),
            last_end: now,
            frozen_from: None,
            runs_again: None,
            manifest: None,
            from_pause: false,
        })))
    }

    /// The log of a Pause, its root the root of the checkpoint that may follow (ctr and CRI
    /// pause a task, then checkpoint it, then resume it): the Pause's device and NCCL steps
    /// are that checkpoint's first steps.
    pub fn at_pause(root: Span) -> Self {
        let log = OpLog::new(root);
        log.state().from_pause = true;
        log
    }

    /// The root a Pause opened, for the checkpoint that goes on from it (once): None when this
    /// log is not a Pause's, or a checkpoint has already taken it.
    pub fn continue_pause(&self) -> Option<Span> {
        let mut state = self.state();
        std::mem::take(&mut state.from_pause).then(|| state.root.clone())
    }

    /// The root a Pause opened and no checkpoint took, taken out of the log.
    fn take_pause_root(&self) -> Option<Span> {
        let from_pause = std::mem::take(&mut self.state().from_pause);
        from_pause.then(|| self.take_root())
    }

    /// The root taken out of the log, to be ended: the steps from here on are not exported.
    fn take_root(&self) -> Span {
        let mut state = self.state();
        state.from_pause = false;
        std::mem::replace(&mut state.root, Span::none())
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The operation's root span.
    pub fn root(&self) -> Span {
        self.state().root.clone()
    }

    /// The steps from here on under `root` (a checkpoint that goes on from its Pause).
    pub fn set_root(&self, root: Span) {
        self.state().root = root;
    }

    /// Starts step `name`: its span opened under the root, its clock running.
    pub fn step(&self, name: &'static str) -> Step {
        let mut state = self.state();
        let span = if state.root.is_none() {
            tracing::info_span!("step", step = name)
        } else {
            tracing::info_span!(target: "gpu_ckpt::step", parent: &state.root, "step",
                otel.name = name, otel.status_code = Empty, otel.status_message = Empty)
        };
        state.running.push(name);
        let start = Instant::now();
        if STOPPING_STEPS.contains(&name) && state.frozen_from.is_none_or(|f| start < f) {
            state.frozen_from = Some(start);
        }
        Step {
            log: self.clone(),
            name,
            start,
            span,
        }
    }

    /// `fut` run as step `name`, in its span, timed.
    pub async fn timed<T>(
        &self,
        name: &'static str,
        fut: impl Future<Output = crate::error::Result<T>>,
    ) -> crate::error::Result<T> {
        let step = self.step(name);
        let result = fut.instrument(step.span().clone()).await;
        step.end(&result);
        result
    }

    /// A step timed elsewhere (the NCCL layer's, the Pause's device quiesce).
    pub fn push(&self, name: &str, took: Duration) {
        let mut state = self.state();
        state.steps.push((name.to_string(), took));
        state.last_end = Instant::now();
    }

    /// The application stopped at `at` (the earliest such moment counts).
    pub fn frozen_from(&self, at: Instant) {
        let mut state = self.state();
        if state.frozen_from.is_none_or(|f| at < f) {
            state.frozen_from = Some(at);
        }
    }

    /// What checkpoint `m` is, for the record (a restore, once it has verified it).
    pub fn note_manifest(&self, m: &Manifest) {
        self.state().manifest = Some(Facts::default().from_manifest(m));
    }

    /// The application runs again from `at`.
    pub fn runs_again(&self, at: Instant) {
        self.state().runs_again = Some(at);
    }

    /// Whether the application has stopped and not run again yet.
    pub fn frozen(&self) -> bool {
        let state = self.state();
        state.frozen_from.is_some() && state.runs_again.is_none()
    }

    /// The step running now, if any.
    pub fn running(&self) -> Option<&'static str> {
        self.state().running.last().copied()
    }

    /// The times as they stand now: the operation ends here.
    pub fn times(&self) -> Times {
        let state = self.state();
        let end = Instant::now();
        let frozen = state.frozen_from.map(|from| {
            let until = state.runs_again.filter(|r| *r >= from).unwrap_or(end);
            until.duration_since(from)
        });
        Times {
            steps: state.steps.clone(),
            failed: state.failed.clone(),
            since_last_step: end.duration_since(state.last_end),
            duration: end.duration_since(state.start),
            frozen,
        }
    }
}

/// One step in progress ([`OpLog::step`]).
pub struct Step {
    log: OpLog,
    name: &'static str,
    start: Instant,
    span: Span,
}

impl Step {
    pub fn span(&self) -> &Span {
        &self.span
    }

    /// The step ended with `result`: timed into the log, and its span marked with the error.
    pub fn end<T>(self, result: &crate::error::Result<T>) {
        match result {
            Ok(_) => self.done(),
            Err(e) => self.failed(e),
        }
    }

    /// The step succeeded.
    pub fn done(self) {
        let took = self.start.elapsed();
        let mut state = self.log.state();
        state.running.retain(|s| *s != self.name);
        state.steps.push((self.name.to_string(), took));
        state.last_end = Instant::now();
    }

    /// The step failed with `e` (the innermost failing step is kept).
    pub fn failed(self, e: &Error) {
        let took = self.start.elapsed();
        self.span.record("otel.status_code", "ERROR");
        self.span
            .record("otel.status_message", status_text(e).as_str());
        let mut state = self.log.state();
        state.running.retain(|s| *s != self.name);
        if state.failed.is_none() {
            state.failed = Some((self.name.to_string(), took));
        }
    }
}

/// An operation's times ([`OpLog::times`]).
#[derive(Debug, Clone, Default)]
pub struct Times {
    pub steps: Vec<(String, Duration)>,
    pub failed: Option<(String, Duration)>,
    /// Since the last step ended (or the start): the failing step's time where no step's
    /// clock saw it fail.
    pub since_last_step: Duration,
    pub duration: Duration,
    pub frozen: Option<Duration>,
}

/// What an operation knew of its container and checkpoint, for its record.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    pub namespace: String,
    pub container_id: String,
    pub cri: Option<CriIdentity>,
    /// Where the checkpoint is: its directory, archive path or reference (no secrets).
    pub checkpoint: Option<String>,
    pub host_bytes: u64,
    pub device_bytes: u64,
    pub gpus: Vec<String>,
    pub driver: Option<String>,
    pub signing_key: Option<String>,
    pub trace_id: Option<String>,
}

impl Facts {
    pub fn new(namespace: &str, container_id: &str, cri: Option<CriIdentity>) -> Self {
        Facts {
            namespace: namespace.to_string(),
            container_id: container_id.to_string(),
            cri,
            ..Default::default()
        }
    }

    /// What the log noted of the checkpoint's manifest ([`OpLog::note_manifest`]).
    pub fn with_noted(mut self, log: &OpLog) -> Self {
        if let Some(m) = log.state().manifest.clone() {
            self.host_bytes = m.host_bytes;
            self.device_bytes = m.device_bytes;
            self.gpus = m.gpus;
            self.driver = m.driver;
            self.signing_key = m.signing_key;
        }
        self
    }

    /// What a checkpoint's manifest says: its files' bytes (CRIU's images, the rootfs changes,
    /// the device-memory files), the device bytes its processes held, its GPUs, driver and
    /// signer.
    pub fn from_manifest(mut self, m: &Manifest) -> Self {
        // The checkpoint's files but its device-state files (custom storage's device memory):
        // those are the device bytes. Staged through host memory (the default), the device
        // memory is in CRIU's page images and so in both figures.
        let device_files: std::collections::HashSet<&str> =
            m.device_state.iter().map(|d| d.name.as_str()).collect();
        self.host_bytes = m
            .files
            .iter()
            .filter(|(name, _)| !device_files.contains(name.as_str()))
            .map(|(_, f)| f.size)
            .sum();
        self.device_bytes = m.devices.device_bytes();
        self.gpus = m.devices.gpus.iter().map(|g| g.uuid.clone()).collect();
        self.driver = driver_of(&m.devices);
        self.signing_key = m.signature.as_ref().and_then(|s| {
            let bytes: [u8; 32] = hex::decode(&s.public_key).ok()?.try_into().ok()?;
            Some(image_format::sign::key_id(&bytes))
        });
        self
    }
}

/// "580.65.06 (CUDA 13.0)", as the manifest's devices record them; none without a driver.
fn driver_of(d: &image_format::manifest::Devices) -> Option<String> {
    match (d.driver_version.as_str(), d.cuda_driver_version.as_str()) {
        ("", "") => None,
        (v, "") => Some(v.to_string()),
        ("", c) => Some(format!("CUDA {c}")),
        (v, c) => Some(format!("{v} (CUDA {c})")),
    }
}

/// The record of an operation that ended with `result`. `manifest_steps`: a checkpoint's
/// timings as its manifest holds them (the source of truth for a success); otherwise the
/// steps come from the log, the failing one last with its time.
pub fn build(
    operation: Operation,
    facts: &Facts,
    times: &Times,
    result: Result<(), &Error>,
    manifest_steps: Option<&[image_format::manifest::StepTiming]>,
    running: Option<&str>,
) -> Record {
    let mut steps: Vec<StepTime> = match manifest_steps {
        Some(timings) => timings
            .iter()
            .map(|t| StepTime {
                name: t.step.clone(),
                seconds: t.millis / 1000.0,
            })
            .collect(),
        None => times
            .steps
            .iter()
            .map(|(name, d)| StepTime {
                name: name.clone(),
                seconds: d.as_secs_f64(),
            })
            .collect(),
    };
    let (outcome, error) = match result {
        Ok(()) => (Outcome::Succeeded, None),
        Err(e) => {
            let (step, class) = classify(e, running);
            // The innermost step whose clock saw the failure, else the time since the last
            // step ended: the failing step is named by the error, timed by the log.
            let took = times
                .failed
                .as_ref()
                .map_or(times.since_last_step, |(_, d)| *d);
            steps.push(StepTime {
                name: step.clone(),
                seconds: took.as_secs_f64(),
            });
            let error = RecordError {
                step,
                class: class.to_string(),
                message: e.to_string(),
            };
            (outcome_of(e), Some(error))
        }
    };
    let cri = facts.cri.as_ref();
    let named = |v: Option<&String>| v.filter(|s| !s.is_empty()).cloned();
    let mut record = Record::new(operation, &facts.namespace, &facts.container_id);
    record.outcome = outcome;
    record.pod = named(cri.map(|c| &c.sandbox_name));
    record.pod_namespace = named(cri.map(|c| &c.namespace));
    record.container = named(cri.map(|c| &c.name));
    record.checkpoint = facts.checkpoint.clone();
    record.error = error;
    record.steps = steps;
    record.duration_seconds = times.duration.as_secs_f64();
    record.frozen_seconds = times.frozen.map(|d| d.as_secs_f64());
    record.host_bytes = facts.host_bytes;
    record.device_bytes = facts.device_bytes;
    record.gpus = facts.gpus.clone();
    record.driver = facts.driver.clone();
    record.signing_key = facts.signing_key.clone();
    record.trace_id = facts.trace_id.clone();
    record
}

/// How an operation ended, for [`finish`].
pub struct Ending<'a> {
    pub operation: Operation,
    pub facts: Facts,
    pub result: Result<(), &'a Error>,
    /// A checkpoint's manifest, when it was written: its bytes, devices, signer and timings.
    pub manifest: Option<&'a Manifest>,
}

/// The end of an operation timed by `log`: its root span given the outcome (and error) and
/// closed, its record built and appended to the node's journal (bounded, a warning at worst).
pub async fn finish(log: &OpLog, ending: Ending<'_>, options: &RuntimeOptions) {
    let root = log.take_root();
    let running = log.running();
    let times = log.times();
    let error = ending.result.err();
    let outcome = error.map_or(Outcome::Succeeded, outcome_of);
    end_root(&root, outcome, error);
    let mut facts = ending.facts;
    if let Some(m) = ending.manifest {
        facts = facts.from_manifest(m);
    }
    facts.trace_id = trace_id(&root);
    drop(root);
    let steps = ending.manifest.map(|m| m.timings.as_slice());
    let record = build(
        ending.operation,
        &facts,
        &times,
        ending.result,
        steps,
        running,
    );
    append(options, record).await;
}

/// Appends `record` to the node's journal (`EventsDir`), off the executor and bounded: a
/// record that cannot be written is a warning in the log, never a failed operation.
pub async fn append(options: &RuntimeOptions, record: Record) {
    let (dir, segment) = (options.events_dir(), options.events_segment_bytes());
    let (operation, id) = (record.operation, record.container_id.clone());
    let write = tokio::task::spawn_blocking(move || {
        journal::Journal::open(&dir, segment).and_then(|j| j.append(&record))
    });
    match tokio::time::timeout(APPEND_BOUND, write).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => {
            warn!(%id, ?operation, error = %e, "the operation's record was not written")
        }
        Ok(Err(e)) => warn!(%id, ?operation, error = %e, "the operation's record was not written"),
        Err(_) => {
            warn!(%id, ?operation, "the operation's record was not written within {APPEND_BOUND:?}")
        }
    }
}

/// The shim's traces sent where the handler options say (`OtlpEndpoint`, `OtlpProtocol`; the
/// environment's OTLP variables where they are empty): the first call wins (`telemetry`).
pub fn configure_traces(endpoint: Option<&str>, protocol: &str) {
    crate::telemetry::configure(endpoint, protocol);
}

/// `span` joined to the trace containerd sent in the request's metadata (W3C `traceparent`).
pub fn adopt_parent(span: &Span, metadata: &std::collections::HashMap<String, Vec<String>>) {
    crate::telemetry::adopt_parent(span, metadata);
}

/// The trace id of `span`, when it is traced.
pub fn trace_id(span: &Span) -> Option<String> {
    crate::telemetry::trace_id(span)
}

/// Starts sending the spans ended so far (at most `bound` of export), without holding the
/// caller: a checkpoint's reply is what lets containerd resume the paused application, so a slow
/// or unreachable collector must not lengthen the freeze. Spans still unsent at the shim's exit
/// go with `telemetry::shutdown`.
pub fn send_traces(bound: Duration) {
    if !crate::telemetry::enabled() {
        return;
    }
    drop(tokio::task::spawn_blocking(move || {
        crate::telemetry::flush(bound)
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A span's error text is cut as the record's message is: a refusal names the pod's
    /// annotation, of any length, and spans go to a collector other tenants' spans share.
    #[test]
    fn a_spans_error_text_is_bounded() {
        let e = Error::Refused {
            checkpoint: "x".repeat(200_000),
            reason: "missing".into(),
        };
        let text = status_text(&e);
        assert!(
            text.len() <= journal::MAX_MESSAGE_BYTES,
            "{} bytes",
            text.len()
        );
        assert!(
            text.starts_with("checkpoint \"xxx") && text.ends_with('…'),
            "{text}"
        );
        let short = Error::InvalidArgument("bad option".into());
        assert_eq!(status_text(&short), "bad option");
    }

    fn step_error(step: &'static str) -> Error {
        Error::Step {
            operation: "checkpoint",
            step,
            message: format!("{step} broke"),
        }
    }

    #[test]
    fn errors_map_to_their_step_and_class() {
        let cases: Vec<(Error, Option<&str>, &str, &str)> = vec![
            (step_error("device-lock"), None, "device-lock", "step"),
            (
                step_error("criu-dump"),
                Some("prepare"),
                "criu-dump",
                "step",
            ),
            (step_error("unsupported"), None, "unsupported", "refused"),
            (step_error("compat"), None, "compat", "refused"),
            (
                Error::Refused {
                    checkpoint: "c".into(),
                    reason: "unsigned".into(),
                },
                Some("verify"),
                "trust",
                "refused",
            ),
            (
                Error::PermissionDenied("x".into()),
                None,
                "trust",
                "refused",
            ),
            (
                Error::InvalidArgument("x".into()),
                Some("prepare"),
                "prepare",
                "invalid",
            ),
            (
                Error::FailedPrecondition("x".into()),
                None,
                "other",
                "precondition",
            ),
            (
                Error::Runc {
                    command: "checkpoint".into(),
                    message: "x".into(),
                },
                Some("criu-dump"),
                "criu-dump",
                "runc",
            ),
            (
                Error::io("open")(std::io::Error::other("x")),
                Some("verify"),
                "verify",
                "io",
            ),
            (
                Error::from(image_format::Error::DigestMismatch {
                    name: "pages-1.img".into(),
                    algorithm: "sha256",
                    expected: "a".into(),
                    actual: "b".into(),
                }),
                Some("verify"),
                "verify",
                "image",
            ),
        ];
        for (e, running, step, class) in cases {
            assert_eq!(classify(&e, running), (step.to_string(), class), "{e}");
        }
        assert_eq!(outcome_of(&step_error("unsupported")), Outcome::Refused);
        assert_eq!(outcome_of(&step_error("device-lock")), Outcome::Failed);
    }

    /// A failed operation lists the steps it completed, in order, then the failing one with
    /// its own time; the frozen time runs from the first stopping step.
    #[test]
    fn a_failed_operation_lists_its_steps_and_the_failing_one() {
        let log = OpLog::default();
        log.step("prepare").done();
        let lock = log.step("device-lock");
        std::thread::sleep(Duration::from_millis(20));
        lock.done();
        let failing = log.step("device-checkpoint");
        std::thread::sleep(Duration::from_millis(10));
        let e = step_error("device-checkpoint");
        failing.failed(&e);
        let times = log.times();
        let facts = Facts::new("default", "c1", None);
        let r = build(Operation::Checkpoint, &facts, &times, Err(&e), None, None);
        assert_eq!(r.outcome, Outcome::Failed);
        let names: Vec<&str> = r.steps.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["prepare", "device-lock", "device-checkpoint"]);
        assert!(r.steps[1].seconds >= 0.02, "{:?}", r.steps);
        assert!(r.steps[2].seconds >= 0.01, "{:?}", r.steps);
        let error = r.error.as_ref().unwrap();
        assert_eq!(
            (error.step.as_str(), error.class.as_str()),
            ("device-checkpoint", "step")
        );
        assert!(error.message.contains("device-checkpoint broke"));
        let frozen = r.frozen_seconds.unwrap();
        assert!(
            frozen >= 0.03 && frozen <= r.duration_seconds,
            "{frozen} {}",
            r.duration_seconds
        );
        assert_eq!(
            (r.namespace.as_str(), r.container_id.as_str()),
            ("default", "c1")
        );
    }

    /// An error no step's clock saw is charged to the step it names, timed since the last step.
    #[test]
    fn an_error_outside_a_step_is_timed_since_the_last_step() {
        let log = OpLog::default();
        log.push("nccl-quiesce", Duration::from_millis(5));
        std::thread::sleep(Duration::from_millis(15));
        let e = step_error("host-memory");
        let r = build(
            Operation::Checkpoint,
            &Facts::default(),
            &log.times(),
            Err(&e),
            None,
            None,
        );
        assert_eq!(r.steps.len(), 2);
        assert_eq!(r.steps[1].name, "host-memory");
        assert!(r.steps[1].seconds >= 0.015);
        assert_eq!(r.frozen_seconds, None, "nothing stopped the application");
    }

    /// A success takes its steps from the manifest's timings, its bytes, GPUs, driver and
    /// signer from the manifest, and its frozen time ends when the application runs again.
    #[test]
    fn a_success_reads_its_manifest() {
        let log = OpLog::default();
        let dump = log.step("criu-dump");
        std::thread::sleep(Duration::from_millis(10));
        dump.done();
        log.runs_again(Instant::now());
        std::thread::sleep(Duration::from_millis(30));
        let mut m = Manifest::new(
            "2026-01-01T00:00:00Z",
            Default::default(),
            Default::default(),
            Default::default(),
            Default::default(),
        );
        m.add_timing("device-lock", 12.0);
        m.add_timing("criu-dump", 250.0);
        m.files.insert(
            "pages-1.img".into(),
            image_format::manifest::FileDigest {
                size: 4096,
                sha256: String::new(),
                blake3: String::new(),
            },
        );
        // A device-memory file of custom storage: device bytes, not host bytes.
        m.files.insert(
            "device-memory-1-0.bin".into(),
            image_format::manifest::FileDigest {
                size: 1 << 20,
                sha256: String::new(),
                blake3: String::new(),
            },
        );
        m.device_state.push(image_format::manifest::DeviceState {
            name: "device-memory-1-0.bin".into(),
            size: 1 << 20,
            ..Default::default()
        });
        m.devices.driver_version = "580.65.06".into();
        m.devices.cuda_driver_version = "13.0".into();
        m.devices.gpus.push(image_format::manifest::Gpu {
            uuid: "GPU-1".into(),
            ..Default::default()
        });
        m.devices
            .processes
            .push(image_format::manifest::DeviceProcess {
                pid: 1,
                gpus: vec![image_format::manifest::ProcessGpu {
                    uuid: "GPU-1".into(),
                    bytes: 1 << 20,
                }],
            });
        let cri = CriIdentity {
            name: "app".into(),
            sandbox_name: "pod-1".into(),
            namespace: "ml".into(),
            ..Default::default()
        };
        let facts = Facts::new("k8s.io", "c2", Some(cri)).from_manifest(&m);
        let r = build(
            Operation::Checkpoint,
            &facts,
            &log.times(),
            Ok(()),
            Some(&m.timings),
            None,
        );
        assert_eq!(r.outcome, Outcome::Succeeded);
        assert!(r.error.is_none());
        let steps: Vec<(&str, f64)> = r
            .steps
            .iter()
            .map(|s| (s.name.as_str(), s.seconds))
            .collect();
        assert_eq!(steps, [("device-lock", 0.012), ("criu-dump", 0.25)]);
        assert_eq!((r.host_bytes, r.device_bytes), (4096, 1 << 20));
        assert_eq!(r.gpus, ["GPU-1"]);
        assert_eq!(r.driver.as_deref(), Some("580.65.06 (CUDA 13.0)"));
        assert_eq!(
            (
                r.pod.as_deref(),
                r.pod_namespace.as_deref(),
                r.container.as_deref()
            ),
            (Some("pod-1"), Some("ml"), Some("app"))
        );
        let frozen = r.frozen_seconds.unwrap();
        assert!(
            frozen >= 0.01 && frozen + 0.025 <= r.duration_seconds,
            "{frozen}: it ran again before the end"
        );
        assert!(r.duration_seconds >= 0.04);
    }
}

/// The spans of a Pause and the checkpoint that continues it, as the export layer sends them.
#[cfg(test)]
mod pause_traces {
    use std::collections::HashMap;

    use opentelemetry::trace::{SpanId, Status};
    use opentelemetry_sdk::trace::SpanData;

    use super::*;

    use crate::telemetry::testing::{named, traced};

    fn attribute(span: &SpanData, key: &str) -> Option<String> {
        span.attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| kv.value.as_str().into_owned())
    }

    /// The steps' names in the order they started, each checked to hang from `root`.
    fn children_of(spans: &[SpanData], root: &SpanData) -> Vec<String> {
        let mut children: Vec<&SpanData> = spans
            .iter()
            .filter(|s| s.parent_span_id == root.span_context.span_id())
            .collect();
        children.sort_by_key(|s| s.start_time);
        for c in &children {
            assert_eq!(c.span_context.trace_id(), root.span_context.trace_id());
        }
        children.iter().map(|s| s.name.to_string()).collect()
    }

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn paused(id: &str) -> OpLog {
        let root = root_span(Operation::Checkpoint, id, None);
        let metadata = HashMap::from([("traceparent".to_string(), vec![PARENT.to_string()])]);
        adopt_parent(&root, &metadata);
        OpLog::at_pause(root)
    }

    fn events_dir(name: &str) -> (std::path::PathBuf, RuntimeOptions) {
        let dir = std::env::temp_dir().join(format!("gpu-ckpt-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let options = RuntimeOptions {
            events_dir: dir.display().to_string(),
            ..Default::default()
        };
        (dir, options)
    }

    fn block_on<F: Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(f)
    }

    /// ctr and CRI: Pause (the device steps), then Checkpoint: one `checkpoint` root, joined to
    /// the Pause's parent, its steps from both RPCs its children in the order they ran; the
    /// record carries its trace id.
    #[test]
    fn a_checkpoint_after_its_pause_is_one_trace() {
        let (dir, options) = events_dir("pause-then-checkpoint");
        let ((), spans) = traced(|| {
            let log = paused("c1");
            log.step("device-lock").done();
            log.step("device-checkpoint").done();
            // The Checkpoint RPC.
            let root = log.continue_pause().expect("the Pause's root");
            assert!(log.continue_pause().is_none(), "taken once");
            assert!(
                !end_pause(&log, None),
                "a checkpoint took it: no pause ends"
            );
            for step in ["prepare", "criu-dump", "manifest-hash"] {
                let s = log.step(step);
                s.span().in_scope(|| {});
                s.done();
            }
            drop(root);
            let ending = Ending {
                operation: Operation::Checkpoint,
                facts: Facts::new("default", "c1", None),
                result: Ok(()),
                manifest: None,
            };
            block_on(finish(&log, ending, &options));
        });
        let root = named(&spans, "checkpoint");
        assert_eq!(root.parent_span_id.to_string(), "00f067aa0ba902b7");
        assert_eq!(
            children_of(&spans, root),
            [
                "device-lock",
                "device-checkpoint",
                "prepare",
                "criu-dump",
                "manifest-hash"
            ]
        );
        assert_eq!(
            attribute(root, "gpu_ckpt.outcome").as_deref(),
            Some("succeeded")
        );
        assert!(spans.iter().all(|s| s.name != "pause"));
        let (records, _) = journal::read_all(&dir).expect("records");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(records.len(), 1);
        assert_eq!(
            records[0].trace_id.as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        let steps: Vec<&str> = records[0].steps.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            steps,
            [
                "device-lock",
                "device-checkpoint",
                "prepare",
                "criu-dump",
                "manifest-hash"
            ]
        );
    }

    /// A Pause that a Resume ends with no checkpoint between: its root is `pause`, succeeded,
    /// its device steps under it; a Pause without steps too (its root never started before).
    #[test]
    fn a_pause_no_checkpoint_followed_is_a_pause() {
        let ((), spans) = traced(|| {
            let log = paused("c1");
            log.step("device-lock").done();
            log.step("device-checkpoint").done();
            assert!(end_pause(&log, None));
            assert!(!end_pause(&log, None), "ended once");
            assert!(log.continue_pause().is_none());
            let plain = paused("c2");
            assert!(end_pause(&plain, None));
        });
        assert!(spans.iter().all(|s| s.name != "checkpoint"), "renamed");
        let pauses: Vec<&SpanData> = spans.iter().filter(|s| s.name == "pause").collect();
        assert_eq!(pauses.len(), 2);
        for root in &pauses {
            assert_eq!(
                attribute(root, "gpu_ckpt.outcome").as_deref(),
                Some("succeeded")
            );
            assert_eq!(root.status, Status::Unset);
            assert_eq!(root.parent_span_id.to_string(), "00f067aa0ba902b7");
        }
        let with_steps = pauses
            .iter()
            .find(|r| attribute(r, "container.id").as_deref() == Some("c1"))
            .expect("c1's pause");
        assert_eq!(
            children_of(&spans, with_steps),
            ["device-lock", "device-checkpoint"]
        );
    }

    /// A Pause whose device step fails is the failed checkpoint: the step and the root have
    /// status Error, and the record names the step. One that fails otherwise (runc) is a
    /// failed `pause`, with no record.
    #[test]
    fn a_failed_pause_ends_its_root_at_once() {
        let (dir, options) = events_dir("failed-pause");
        let e = Error::Step {
            operation: "checkpoint",
            step: "device-checkpoint",
            message: "cuCheckpointProcessCheckpoint failed".into(),
        };
        let runc = Error::Runc {
            command: "pause".into(),
            message: "freezer stuck".into(),
        };
        let ((), spans) = traced(|| {
            let log = paused("c1");
            log.step("device-lock").done();
            log.step("device-checkpoint").failed(&e);
            let ending = Ending {
                operation: Operation::Checkpoint,
                facts: Facts::new("default", "c1", None),
                result: Err(&e),
                manifest: None,
            };
            block_on(finish(&log, ending, &options));
            assert!(!end_pause(&log, None), "ended by its record");
            let other = paused("c2");
            assert!(end_pause(&other, Some(&runc)));
        });
        let root = named(&spans, "checkpoint");
        assert_eq!(root.status, Status::error(e.to_string()));
        assert_eq!(
            attribute(root, "gpu_ckpt.outcome").as_deref(),
            Some("failed")
        );
        assert_eq!(
            children_of(&spans, root),
            ["device-lock", "device-checkpoint"]
        );
        assert_eq!(
            named(&spans, "device-checkpoint").status,
            Status::error(e.to_string())
        );
        assert_eq!(named(&spans, "device-lock").status, Status::Unset);
        let pause = named(&spans, "pause");
        assert_eq!(pause.status, Status::error(runc.to_string()));
        assert_eq!(
            attribute(pause, "gpu_ckpt.outcome").as_deref(),
            Some("failed")
        );
        assert_ne!(pause.parent_span_id, SpanId::INVALID);
        let (records, _) = journal::read_all(&dir).expect("records");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(records.len(), 1, "the failed pause of c2 has no record");
        let error = records[0].error.as_ref().expect("its error");
        assert_eq!(error.step, "device-checkpoint");
    }
}
