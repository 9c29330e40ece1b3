//! Traces: the spans of a checkpoint and a restore, exported over OTLP.
//!
//! The shim writes `tracing` spans; this module turns two kinds of them into OpenTelemetry spans
//! and nothing else:
//!
//! - an operation's root, target [`OP_TARGET`] (`checkpoint`, `restore`);
//! - each step of it, target [`STEP_TARGET`] (`device-lock`, `criu-dump`, ...).
//!
//! Every other span (an RPC's, a helper's) stays in the logs only. A step's OpenTelemetry parent
//! is its nearest operation or step ancestor in the span tree, whatever spans lie in between and
//! across `tokio::spawn` when the spawned future is instrumented with (or runs in) a span of that
//! tree; the root's parent is containerd's span when the RPC carried W3C trace context
//! ([`adopt_parent`]). The span's name is its `otel.name` field; `otel.status_code = "ERROR"` and
//! `otel.status_message` set its status; its other fields become attributes.
//!
//! The export layer sits in the subscriber from the start ([`layer`], added by `logging::init`);
//! nothing leaves the shim until [`configure`] found an endpoint (the handler's `OtlpEndpoint` or
//! the standard `OTEL_EXPORTER_OTLP_*` variables). Spans are batched and exported from a thread of
//! their own, each export bounded by [`EXPORT_TIMEOUT`]; [`flush`] sends them, bounded too, beside
//! (never before) a checkpoint's or a restore's reply, and [`shutdown`] at exit.

use std::{
    collections::HashMap,
    fmt,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, OnceLock,
    },
    time::Duration,
};

use opentelemetry::{
    propagation::{Extractor, TextMapPropagator},
    trace::{Link, SpanKind, Status, TraceContextExt, TraceId, TracerProvider as _},
    Context as OtelContext, KeyValue,
};
use opentelemetry_otlp::{Protocol as OtlpProtocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::{
    error::OTelSdkResult,
    propagation::TraceContextPropagator,
    trace::{
        BatchConfigBuilder, BatchSpanProcessor, Sampler, SamplingDecision, SamplingResult,
        SdkTracer, SdkTracerProvider, ShouldSample, SpanData, SpanExporter, SpanProcessor,
    },
    Resource,
};
use tracing::{
    span::{Attributes, Id, Record},
    Event, Metadata, Subscriber,
};
use tracing_opentelemetry::{OpenTelemetryLayer, OpenTelemetrySpanExt};
use tracing_subscriber::{
    filter::{filter_fn, Filtered},
    layer::{Context, Layer},
    registry::LookupSpan,
};

/// The target of an operation's root span (`checkpoint`, `restore`).
pub const OP_TARGET: &str = "gpu_ckpt::op";
/// The target of a step's span.
pub const STEP_TARGET: &str = "gpu_ckpt::step";
/// `service.name` of the shim's spans.
pub const SERVICE_NAME: &str = "gpu-ckpt-shim";
/// The longest one export (one HTTP request or gRPC call, retries included) may take.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a batch waits for more spans before it is exported unasked.
const SCHEDULE_DELAY: Duration = Duration::from_secs(1);

/// What went wrong turning the configuration into an exporter.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("OTLP protocol {0:?} is not supported (http/protobuf or grpc)")]
    Protocol(String),
    #[error("OTLP endpoint {0:?} is not an http:// or https:// URL")]
    Endpoint(String),
    #[error("OTLP endpoint {0:?} over grpc: the shim's gRPC exporter has no TLS (use http:// or http/protobuf)")]
    GrpcTls(String),
    #[error("OTLP exporter: {0}")]
    Exporter(String),
}

/// The OTLP transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// `http/protobuf`: POST of `ExportTraceServiceRequest` to `<endpoint>/v1/traces`.
    HttpProtobuf,
    /// `grpc`: `TraceService/Export` at the endpoint.
    Grpc,
}

impl Protocol {
    /// Reads the protocol as the OTLP specification spells it.
    pub fn parse(s: &str) -> Result<Self, TelemetryError> {
        match s.trim() {
            "http/protobuf" | "http" => Ok(Protocol::HttpProtobuf),
            "grpc" => Ok(Protocol::Grpc),
            other => Err(TelemetryError::Protocol(other.to_string())),
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::HttpProtobuf => "http/protobuf",
            Protocol::Grpc => "grpc",
        })
    }
}

/// Where the spans go: the URL the exporter sends to and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    pub endpoint: String,
    pub protocol: Protocol,
}

/// Resolves the destination from the handler's options and the environment (`env` reads a
/// variable; empty counts as unset). The endpoint: the option (a base URL, like
/// `OTEL_EXPORTER_OTLP_ENDPOINT`), else `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (used as it is),
/// else `OTEL_EXPORTER_OTLP_ENDPOINT`; none of them: `Ok(None)`, nothing is exported. For
/// http/protobuf a base URL gets `/v1/traces` appended (unless it already ends so). The
/// protocol: the option, else `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, else
/// `OTEL_EXPORTER_OTLP_PROTOCOL`, else http/protobuf.
pub fn resolve(
    endpoint: Option<&str>,
    protocol: &str,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<Destination>, TelemetryError> {
    let env = |name: &str| env(name).filter(|v| !v.trim().is_empty());
    let protocol = match Some(protocol.trim())
        .filter(|p| !p.is_empty())
        .map(str::to_string)
        .or_else(|| env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"))
        .or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"))
    {
        Some(p) => Protocol::parse(&p)?,
        None => Protocol::HttpProtobuf,
    };
    let (url, base) = match endpoint.map(str::trim).filter(|e| !e.is_empty()) {
        Some(e) => (e.to_string(), true),
        None => match env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
            Some(e) => (e, false),
            None => match env("OTEL_EXPORTER_OTLP_ENDPOINT") {
                Some(e) => (e, true),
                None => return Ok(None),
            },
        },
    };
    let url = url.trim().to_string();
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(TelemetryError::Endpoint(url));
    }
    // The gRPC exporter is built without TLS: an https:// collector over gRPC would take
    // nothing, silently.
    if protocol == Protocol::Grpc && url.starts_with("https://") {
        return Err(TelemetryError::GrpcTls(url));
    }
    let endpoint = if base && protocol == Protocol::HttpProtobuf {
        let trimmed = url.trim_end_matches('/');
        if trimmed.ends_with("/v1/traces") {
            trimmed.to_string()
        } else {
            format!("{trimmed}/v1/traces")
        }
    } else {
        url
    };
    Ok(Some(Destination { endpoint, protocol }))
}

/// The process's tracer provider, built at first use; it exports nothing until [`configure`].
struct State {
    provider: SdkTracerProvider,
    export: Arc<LazyExport>,
    on: Arc<AtomicBool>,
}

fn state() -> &'static State {
    static STATE: OnceLock<State> = OnceLock::new();
    STATE.get_or_init(|| {
        let export = Arc::new(LazyExport::default());
        let on = Arc::new(AtomicBool::new(false));
        // Not OTEL_SERVICE_NAME: the shim inherits containerd's environment, and containerd
        // (pkg/tracing/plugin/otlp.go, newTracer) sets it to "containerd" for itself.
        let service = SERVICE_NAME;
        let provider = SdkTracerProvider::builder()
            .with_sampler(Gate {
                on: on.clone(),
                inner: Sampler::ParentBased(Box::new(Sampler::AlwaysOn)),
            })
            .with_span_processor(StatusMessage(SharedExport(export.clone())))
            .with_resource(
                Resource::builder()
                    .with_service_name(service)
                    .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
                    .build(),
            )
            .build();
        State {
            provider,
            export,
            on,
        }
    })
}

/// The export layer for `logging::init`: the process's tracer, its spans exported once
/// [`configure`] found an endpoint.
pub fn layer<S>() -> Filtered<OpLayer<S>, impl tracing_subscriber::layer::Filter<S>, S>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    layer_with(state().provider.tracer("gpu-ckpt-shim"))
}

/// The export layer over a given tracer (tests give one with an exporter of their own): only
/// spans of [`OP_TARGET`] and [`STEP_TARGET`] pass its filter.
pub fn layer_with<S>(
    tracer: SdkTracer,
) -> Filtered<OpLayer<S>, impl tracing_subscriber::layer::Filter<S>, S>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    OpLayer {
        inner: tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_location(false)
            .with_threads(false)
            .with_level(false)
            .with_target(false)
            .with_tracked_inactivity(false),
    }
    .with_filter(filter_fn(|meta: &Metadata<'_>| is_exported(meta.target())))
}

fn is_exported(target: &str) -> bool {
    target == OP_TARGET || target == STEP_TARGET
}

/// Configures the export, once: the first call wins (the first Create of the shim, with its
/// handler's options); later calls change nothing. `endpoint` is the handler's `OtlpEndpoint`
/// (None or empty: the environment's), `protocol` its `OtlpProtocol` (empty: the
/// environment's, else http/protobuf). A bad configuration is logged and exports nothing.
pub fn configure(endpoint: Option<&str>, protocol: &str) {
    static DONE: OnceLock<()> = OnceLock::new();
    if DONE.set(()).is_err() {
        return;
    }
    let destination = match resolve(endpoint, protocol, |name| std::env::var(name).ok()) {
        Ok(Some(d)) => d,
        Ok(None) => {
            tracing::debug!("no OTLP endpoint: traces are not exported");
            return;
        }
        Err(e) => {
            tracing::warn!(error = %e, "traces are not exported");
            return;
        }
    };
    let state = state();
    match exporter_processor(&destination) {
        Ok(batch) => {
            state.export.install(batch);
            state.on.store(true, Ordering::SeqCst);
            tracing::info!(endpoint = %destination.endpoint, protocol = %destination.protocol, "exporting traces over OTLP");
        }
        Err(e) => {
            tracing::warn!(endpoint = %destination.endpoint, error = %e, "traces are not exported")
        }
    }
}

/// Whether [`configure`] found a destination and spans are exported.
pub fn enabled() -> bool {
    state().on.load(Ordering::SeqCst)
}

fn exporter_processor(d: &Destination) -> Result<BatchSpanProcessor, TelemetryError> {
    let config = BatchConfigBuilder::default()
        .with_scheduled_delay(SCHEDULE_DELAY)
        .build();
    let processor = match d.protocol {
        Protocol::HttpProtobuf => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_http_client(http_client()?)
                .with_endpoint(d.endpoint.clone())
                .with_protocol(OtlpProtocol::HttpBinary)
                .with_timeout(EXPORT_TIMEOUT)
                .build()
                .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
            BatchSpanProcessor::builder(exporter)
                .with_batch_config(config)
                .build()
        }
        Protocol::Grpc => {
            let runtime = grpc_runtime()?;
            let exporter = {
                // The channel spawns its connection task here: on the exporter's runtime, never
                // on the shim's (one thread, blocked while a reply waits for a flush).
                let _entered = runtime.enter();
                opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_endpoint(d.endpoint.clone())
                    .with_protocol(OtlpProtocol::Grpc)
                    .with_timeout(EXPORT_TIMEOUT)
                    .build()
                    .map_err(|e| TelemetryError::Exporter(e.to_string()))?
            };
            BatchSpanProcessor::builder(OnRuntime {
                inner: exporter,
                runtime: runtime.handle().clone(),
            })
            .with_batch_config(config)
            .build()
        }
    };
    Ok(processor)
}

/// reqwest's blocking client (rustls over ring, as the registry client), built on a thread of its
/// own: it may be neither built nor dropped inside the shim's runtime.
fn http_client() -> Result<reqwest::blocking::Client, TelemetryError> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    std::thread::Builder::new()
        .name("otlp-client".into())
        .spawn(|| {
            reqwest::blocking::Client::builder()
                .timeout(EXPORT_TIMEOUT)
                .connect_timeout(EXPORT_TIMEOUT)
                .user_agent(concat!("gpu-ckpt-shim/", env!("CARGO_PKG_VERSION")))
                .build()
        })
        .map_err(|e| TelemetryError::Exporter(format!("client thread: {e}")))?
        .join()
        .map_err(|_| TelemetryError::Exporter("client thread panicked".into()))?
        .map_err(|e| TelemetryError::Exporter(format!("HTTP client: {e}")))
}

/// The gRPC exporter's runtime: one worker thread of its own.
fn grpc_runtime() -> Result<&'static tokio::runtime::Runtime, TelemetryError> {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    if let Some(rt) = RUNTIME.get() {
        return Ok(rt);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("otlp-grpc")
        .enable_all()
        .build()
        .map_err(|e| TelemetryError::Exporter(format!("gRPC runtime: {e}")))?;
    Ok(RUNTIME.get_or_init(|| rt))
}

/// Runs a tonic exporter's calls on its runtime (the batch processor's thread has none).
#[derive(Debug)]
struct OnRuntime<E> {
    inner: E,
    runtime: tokio::runtime::Handle,
}

impl<E: SpanExporter> SpanExporter for OnRuntime<E> {
    fn export(
        &self,
        batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        // Called from the batch processor's own thread, outside any runtime.
        let result = self.runtime.block_on(self.inner.export(batch));
        std::future::ready(result)
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource)
    }
}

/// The processor the provider is built with: it forwards to the batch processor once
/// [`configure`] installed one, and drops spans until then.
#[derive(Debug, Default)]
struct LazyExport {
    batch: OnceLock<BatchSpanProcessor>,
    resource: Mutex<Option<Resource>>,
}

impl LazyExport {
    fn install(&self, mut batch: BatchSpanProcessor) {
        if let Some(resource) = self.resource.lock().ok().and_then(|r| r.clone()) {
            batch.set_resource(&resource);
        }
        let _ = self.batch.set(batch);
    }
}

#[derive(Debug)]
struct SharedExport(Arc<LazyExport>);

impl SpanProcessor for SharedExport {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &OtelContext) {
        if let Some(b) = self.0.batch.get() {
            b.on_start(span, cx);
        }
    }

    fn on_end(&self, span: SpanData) {
        if let Some(b) = self.0.batch.get() {
            b.on_end(span);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        match self.0.batch.get() {
            Some(b) => b.force_flush(),
            None => Ok(()),
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        match self.0.batch.get() {
            Some(b) => b.shutdown_with_timeout(timeout),
            None => Ok(()),
        }
    }

    fn set_resource(&mut self, resource: &Resource) {
        if let Ok(mut r) = self.0.resource.lock() {
            *r = Some(resource.clone());
        }
    }
}

/// The span conventions' `otel.status_message` (tracing-opentelemetry itself reads
/// `otel.status_description`): the message of an Error status, not an attribute.
#[derive(Debug)]
pub struct StatusMessage<P>(pub P);

const STATUS_MESSAGE_FIELD: &str = "otel.status_message";

fn status_message(span: &mut SpanData) {
    let Some(at) = span
        .attributes
        .iter()
        .position(|kv| kv.key.as_str() == STATUS_MESSAGE_FIELD)
    else {
        return;
    };
    let message = span.attributes.remove(at).value.as_str().into_owned();
    if matches!(span.status, Status::Error { .. }) {
        span.status = Status::error(message);
    }
}

impl<P: SpanProcessor> SpanProcessor for StatusMessage<P> {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &OtelContext) {
        self.0.on_start(span, cx)
    }

    fn on_end(&self, mut span: SpanData) {
        status_message(&mut span);
        self.0.on_end(span)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.0.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.0.set_resource(resource)
    }
}

/// Samples nothing until an export is configured (no ids handed out, [`trace_id`] is None);
/// then follows the parent's decision (containerd's sampling), and samples roots.
#[derive(Debug, Clone)]
struct Gate {
    on: Arc<AtomicBool>,
    inner: Sampler,
}

impl ShouldSample for Gate {
    fn should_sample(
        &self,
        parent_context: Option<&OtelContext>,
        trace_id: TraceId,
        name: &str,
        span_kind: &SpanKind,
        attributes: &[KeyValue],
        links: &[Link],
    ) -> SamplingResult {
        if self.on.load(Ordering::Relaxed) {
            return self.inner.should_sample(
                parent_context,
                trace_id,
                name,
                span_kind,
                attributes,
                links,
            );
        }
        SamplingResult {
            decision: SamplingDecision::Drop,
            attributes: Vec::new(),
            trace_state: parent_context
                .map(|cx| cx.span().span_context().trace_state().clone())
                .unwrap_or_default(),
        }
    }
}

/// tracing-opentelemetry's layer, with a step's parent resolved through the spans its filter
/// drops: a step's OpenTelemetry parent is its nearest operation or step ancestor in the span
/// tree (the registry's parents, followed across spans of other targets), never "no parent"
/// because the span between them was not exported or the step runs in a spawned task.
pub struct OpLayer<S> {
    inner: OpenTelemetryLayer<S, SdkTracer>,
}

impl<S> Layer<S> for OpLayer<S>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_register_dispatch(&self, subscriber: &tracing::Dispatch) {
        self.inner.on_register_dispatch(subscriber)
    }

    fn on_layer(&mut self, subscriber: &mut S) {
        self.inner.on_layer(subscriber)
    }

    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if attrs.metadata().target() == STEP_TARGET && !attrs.is_root() {
            // The context is this layer's (filtered): a span's parent() skips the spans the
            // filter drops and walks the registry's tree, not the thread's stack.
            let ancestor = ctx.span(id).and_then(|s| s.parent()).map(|p| p.id());
            if let Some(parent) = ancestor {
                let attrs = Attributes::child_of(parent, attrs.metadata(), attrs.values());
                return self.inner.on_new_span(&attrs, id, ctx);
            }
        }
        if attrs.metadata().target() == OP_TARGET && !attrs.is_root() {
            // An operation starts its own trace (or joins containerd's through adopt_parent),
            // whatever span it was created in.
            let attrs = Attributes::new_root(attrs.metadata(), attrs.values());
            return self.inner.on_new_span(&attrs, id, ctx);
        }
        self.inner.on_new_span(attrs, id, ctx)
    }

    fn on_record(&self, span: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        self.inner.on_record(span, values, ctx)
    }

    fn on_follows_from(&self, span: &Id, follows: &Id, ctx: Context<'_, S>) {
        self.inner.on_follows_from(span, follows, ctx)
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        self.inner.on_event(event, ctx)
    }

    fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
        self.inner.on_enter(id, ctx)
    }

    fn on_exit(&self, id: &Id, ctx: Context<'_, S>) {
        self.inner.on_exit(id, ctx)
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        self.inner.on_close(id, ctx)
    }

    fn on_id_change(&self, old: &Id, new: &Id, ctx: Context<'_, S>) {
        self.inner.on_id_change(old, new, ctx)
    }

    // SAFETY: the pointers come from the inner layer, valid as long as `self`.
    unsafe fn downcast_raw(&self, id: std::any::TypeId) -> Option<*const ()> {
        if id == std::any::TypeId::of::<Self>() {
            return Some(self as *const Self as *const ());
        }
        // SAFETY: forwarded as is; the inner layer lives as long as `self`.
        unsafe { self.inner.downcast_raw(id) }
    }
}

/// Reads the W3C trace context of a ttrpc request's metadata (keys `traceparent`,
/// `tracestate`, any case; the first value of each).
struct MetadataCarrier<'a>(&'a HashMap<String, Vec<String>>);

impl Extractor for MetadataCarrier<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .and_then(|(_, v)| v.first())
            .map(String::as_str)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

/// The remote parent a request's metadata carries: containerd's span, when its `traceparent` is
/// valid.
pub fn remote_parent(metadata: &HashMap<String, Vec<String>>) -> Option<OtelContext> {
    if !well_formed(MetadataCarrier(metadata).get("traceparent")?) {
        return None;
    }
    let cx = TraceContextPropagator::new().extract(&MetadataCarrier(metadata));
    let sc = cx.span().span_context().clone();
    (sc.is_valid() && sc.is_remote()).then_some(cx)
}

/// W3C trace context's `traceparent`: `version-trace_id-parent_id-flags`, lowercase hex of 2,
/// 32, 16 and 2 digits (a later version may add fields after them; version ff is invalid).
fn well_formed(traceparent: &str) -> bool {
    let parts: Vec<&str> = traceparent.trim().split('-').collect();
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    parts.len() >= 4
        && hex(parts[0], 2)
        && parts[0] != "ff"
        && (parts[0] != "00" || parts.len() == 4)
        && hex(parts[1], 32)
        && hex(parts[2], 16)
        && hex(parts[3], 2)
}

/// Makes containerd's span, when the RPC's ttrpc metadata carries W3C `traceparent` (and
/// `tracestate`), the parent of `span` (an operation's root). Call it right after creating the
/// span, before any step under it and before [`trace_id`]; without a valid `traceparent` the
/// span starts a trace of its own.
pub fn adopt_parent(span: &tracing::Span, metadata: &HashMap<String, Vec<String>>) {
    if let Some(cx) = remote_parent(metadata) {
        if let Err(e) = span.set_parent(cx) {
            tracing::debug!(error = %e, "trace context not adopted");
        }
    }
}

/// The trace id (32 hex) of `span` when it is exported; None when it is not (no endpoint
/// configured, a span outside the export layer, or one containerd's sampling dropped).
pub fn trace_id(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    (sc.is_valid() && sc.is_sampled()).then(|| sc.trace_id().to_string())
}

/// Exports the spans that ended, waiting at most `timeout` (an unreachable collector never
/// holds a reply longer). Spans not exported in time are exported later, or dropped.
pub fn flush(timeout: Duration) {
    if !enabled() {
        return;
    }
    let provider = state().provider.clone();
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let spawned = std::thread::Builder::new()
        .name("otlp-flush".into())
        .spawn(move || {
            let _ = tx.send(provider.force_flush());
        });
    if spawned.is_err() {
        return;
    }
    match rx.recv_timeout(timeout) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "trace export failed"),
        Err(_) => tracing::debug!(?timeout, "trace export did not finish in time"),
    }
}

/// Exports what is left and stops the exporter, bounded by `timeout`: at shim exit.
pub fn shutdown(timeout: Duration) {
    if !enabled() {
        return;
    }
    if let Err(e) = state().provider.shutdown_with_timeout(timeout) {
        tracing::debug!(error = %e, "trace exporter shutdown");
    }
}

/// What the shim's tests of exported spans share: an exporter that keeps what it is given, and
/// the spans a closure's operations export through the shim's export layer.
#[cfg(test)]
pub(crate) mod testing {
    use std::sync::{Arc, Mutex};

    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::{
        error::OTelSdkResult,
        trace::{SdkTracerProvider, SimpleSpanProcessor, SpanData, SpanExporter},
    };
    use tracing_subscriber::layer::SubscriberExt;

    /// An exporter that keeps what it is given.
    #[derive(Debug, Clone, Default)]
    pub struct Collect(pub Arc<Mutex<Vec<SpanData>>>);

    impl SpanExporter for Collect {
        fn export(
            &self,
            batch: Vec<SpanData>,
        ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
            self.0.lock().expect("collect").extend(batch);
            std::future::ready(Ok(()))
        }
    }

    /// Runs `f` under a subscriber with the shim's export layer, and returns the spans it
    /// exported.
    pub fn traced<T>(f: impl FnOnce() -> T) -> (T, Vec<SpanData>) {
        let collect = Collect::default();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(super::StatusMessage(SimpleSpanProcessor::new(
                collect.clone(),
            )))
            .build();
        let sub = tracing_subscriber::registry().with(super::layer_with(provider.tracer("test")));
        let out = tracing::subscriber::with_default(sub, f);
        let spans = collect.0.lock().expect("collect").clone();
        (out, spans)
    }

    /// The span named `name` among `spans`.
    pub fn named<'a>(spans: &'a [SpanData], name: &str) -> &'a SpanData {
        spans.iter().find(|s| s.name == name).unwrap_or_else(|| {
            let names: Vec<&str> = spans.iter().map(|s| s.name.as_ref()).collect();
            panic!("no span {name}: {names:?}")
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::SpanId;
    use opentelemetry_sdk::trace::SimpleSpanProcessor;
    use tracing::{info_span, Instrument};
    use tracing_subscriber::layer::SubscriberExt;

    use testing::Collect;

    /// A subscriber like the shim's (a log layer with its own level, the export layer), the
    /// export going to a [`Collect`].
    fn subscriber() -> (tracing::Dispatch, Collect, SdkTracerProvider) {
        let collect = Collect::default();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(StatusMessage(SimpleSpanProcessor::new(collect.clone())))
            .build();
        let fmt = tracing_subscriber::fmt::layer()
            .with_test_writer()
            .with_filter(tracing_subscriber::EnvFilter::new("debug"));
        let sub = tracing_subscriber::registry()
            .with(fmt)
            .with(layer_with(provider.tracer("test")));
        (tracing::Dispatch::new(sub), collect, provider)
    }

    fn spans(c: &Collect) -> Vec<SpanData> {
        c.0.lock().expect("collect").clone()
    }

    use testing::named;

    fn names(spans: &[SpanData]) -> Vec<String> {
        spans.iter().map(|s| s.name.to_string()).collect()
    }

    fn root() -> tracing::Span {
        info_span!(target: "gpu_ckpt::op", "checkpoint", otel.name = "checkpoint",
            otel.status_code = tracing::field::Empty, otel.status_message = tracing::field::Empty,
            container.id = "c1", gpu_ckpt.outcome = tracing::field::Empty)
    }

    fn step(name: &'static str) -> tracing::Span {
        info_span!(target: "gpu_ckpt::step", "step", otel.name = name,
            otel.status_code = tracing::field::Empty, otel.status_message = tracing::field::Empty)
    }

    fn env(vars: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn resolve_takes_the_option_then_the_environment() {
        let none = env(&[]);
        assert_eq!(resolve(None, "", &none).unwrap(), None);
        assert_eq!(resolve(Some(""), "", &none).unwrap(), None);
        let d = resolve(Some("http://c:4318"), "", &none).unwrap().unwrap();
        assert_eq!(d.endpoint, "http://c:4318/v1/traces");
        assert_eq!(d.protocol, Protocol::HttpProtobuf);
        let d = resolve(Some("http://c:4318/v1/traces/"), "", &none)
            .unwrap()
            .unwrap();
        assert_eq!(d.endpoint, "http://c:4318/v1/traces");
        let d = resolve(Some("http://c:4317"), "grpc", &none)
            .unwrap()
            .unwrap();
        assert_eq!(
            (d.endpoint.as_str(), d.protocol),
            ("http://c:4317", Protocol::Grpc)
        );

        let both = env(&[
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://t:1/custom"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://e:2"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ]);
        // The option first; the traces variable as it is; the base one with the path.
        let d = resolve(Some("http://o:3"), "", &both).unwrap().unwrap();
        assert_eq!(d.endpoint, "http://o:3/v1/traces");
        let d = resolve(None, "", &both).unwrap().unwrap();
        assert_eq!(d.endpoint, "http://t:1/custom");
        let base = env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://e:2/"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
        ]);
        let d = resolve(None, "", &base).unwrap().unwrap();
        assert_eq!(d.endpoint, "http://e:2/v1/traces");
        assert_eq!(d.protocol, Protocol::HttpProtobuf);
        // The option's protocol wins over the environment's.
        let d = resolve(None, "grpc", &base).unwrap().unwrap();
        assert_eq!(
            (d.endpoint.as_str(), d.protocol),
            ("http://e:2/", Protocol::Grpc)
        );

        assert!(matches!(
            resolve(Some("http://c"), "http/json", &none),
            Err(TelemetryError::Protocol(_))
        ));
        assert!(matches!(
            resolve(Some("c:4318"), "", &none),
            Err(TelemetryError::Endpoint(_))
        ));
        assert!(matches!(
            resolve(Some("https://c:4317"), "grpc", &none),
            Err(TelemetryError::GrpcTls(_))
        ));
    }

    /// A handler without `OtlpProtocol` takes the protocol of the environment containerd gave
    /// the shim (its default left the variable unread, and a gRPC collector got nothing).
    #[test]
    fn no_protocol_option_leaves_it_to_the_environment() {
        let grpc = env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://e:4317"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ]);
        let options = crate::options::RuntimeOptions::default();
        let d = resolve(options.otlp_endpoint(), options.otlp_protocol(), &grpc)
            .unwrap()
            .unwrap();
        assert_eq!(
            (d.endpoint.as_str(), d.protocol),
            ("http://e:4317", Protocol::Grpc)
        );
    }

    fn md(pairs: &[(&str, &str)]) -> HashMap<String, Vec<String>> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), vec![v.to_string()]))
            .collect()
    }

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn traceparent_is_read_from_the_metadata() {
        let cx = remote_parent(&md(&[("traceparent", PARENT), ("tracestate", "k=v")]))
            .expect("a valid traceparent");
        let sc = cx.span().span_context().clone();
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        assert!(sc.is_sampled() && sc.is_remote());
        assert_eq!(sc.trace_state().get("k"), Some("v"));
        // Any case of the key.
        assert!(remote_parent(&md(&[("Traceparent", PARENT)])).is_some());
        // A later version's extra fields.
        assert!(remote_parent(&md(&[(
            "traceparent",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-later"
        )]))
        .is_some());
    }

    #[test]
    fn bad_or_absent_traceparent_gives_no_parent() {
        for bad in [
            "",
            "garbage",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert!(
                remote_parent(&md(&[("traceparent", bad)])).is_none(),
                "{bad:?} taken"
            );
        }
        assert!(remote_parent(&HashMap::new()).is_none());
        assert!(remote_parent(&md(&[("containerd-namespace", "k8s.io")])).is_none());
    }

    #[test]
    fn only_operations_and_steps_are_exported_and_steps_hang_from_the_root() {
        let (dispatch, collect, _p) = subscriber();
        tracing::dispatcher::with_default(&dispatch, || {
            let _rpc = info_span!("rpc_checkpoint").entered();
            let root = root();
            let _r = root.clone().entered();
            step("device-lock").in_scope(|| {});
            let helper = info_span!("checkpoint_work");
            helper.in_scope(|| {
                let _inner = tracing::debug_span!("criu").entered();
                step("criu-dump").in_scope(|| {});
            });
            // An explicit parent that the export filter drops.
            tracing::info_span!(target: "gpu_ckpt::step", parent: &helper, "step", otel.name = "sign")
                .in_scope(|| {});
            root.record("gpu_ckpt.outcome", "succeeded");
        });
        let spans = spans(&collect);
        assert_eq!(
            names(&spans),
            ["device-lock", "criu-dump", "sign", "checkpoint"],
            "exported spans"
        );
        let root = named(&spans, "checkpoint");
        assert_eq!(root.parent_span_id, SpanId::INVALID);
        assert!(root
            .attributes
            .iter()
            .any(|kv| kv.key.as_str() == "container.id" && kv.value.as_str() == "c1"));
        assert!(root
            .attributes
            .iter()
            .any(|kv| kv.key.as_str() == "gpu_ckpt.outcome" && kv.value.as_str() == "succeeded"));
        for s in ["device-lock", "criu-dump", "sign"] {
            let s = named(&spans, s);
            assert_eq!(s.parent_span_id, root.span_context.span_id(), "{}", s.name);
            assert_eq!(s.span_context.trace_id(), root.span_context.trace_id());
        }
        let starts: Vec<_> = ["device-lock", "criu-dump", "sign"]
            .iter()
            .map(|n| named(&spans, n).start_time)
            .collect();
        assert!(starts.windows(2).all(|w| w[0] <= w[1]), "{starts:?}");
    }

    #[test]
    fn a_step_in_a_spawned_task_hangs_from_the_root() {
        use tracing::instrument::WithSubscriber;
        let (dispatch, collect, _p) = subscriber();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .build()
            .unwrap();
        let d = dispatch.clone();
        rt.block_on(
            async move {
                let root = root();
                // Spawned from inside the root, instrumented with a span the filter drops.
                let span = root.in_scope(|| info_span!("checkpoint_work"));
                let work = async {
                    tokio::task::yield_now().await;
                    let s = step("criu-dump");
                    async { tokio::task::yield_now().await }.instrument(s).await;
                }
                .instrument(span);
                // (The dispatcher is the test's, not the process's: the span ends inside it.)
                let task = tokio::spawn(
                    async move {
                        work.await;
                    }
                    .with_subscriber(d),
                );
                task.await.unwrap();
                drop(root);
            }
            .with_subscriber(dispatch.clone()),
        );
        let spans = spans(&collect);
        let root = named(&spans, "checkpoint");
        let step = named(&spans, "criu-dump");
        assert_eq!(step.parent_span_id, root.span_context.span_id());
        assert_eq!(step.span_context.trace_id(), root.span_context.trace_id());
    }

    #[test]
    fn the_root_joins_containerds_trace_and_trace_id_says_so() {
        let (dispatch, collect, _p) = subscriber();
        let (id, plain) = tracing::dispatcher::with_default(&dispatch, || {
            let root = root();
            adopt_parent(&root, &md(&[("traceparent", PARENT)]));
            let id = trace_id(&root);
            root.in_scope(|| step("criu-dump").in_scope(|| {}));
            (id, trace_id(&info_span!("not_exported")))
        });
        assert_eq!(id.as_deref(), Some("4bf92f3577b34da6a3ce929d0e0e4736"));
        assert_eq!(plain, None);
        let spans = spans(&collect);
        let root = named(&spans, "checkpoint");
        assert_eq!(root.parent_span_id.to_string(), "00f067aa0ba902b7");
        assert_eq!(
            root.span_context.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(
            named(&spans, "criu-dump").parent_span_id,
            root.span_context.span_id()
        );
    }

    #[test]
    fn without_traceparent_the_root_starts_a_trace() {
        let (dispatch, collect, _p) = subscriber();
        let id = tracing::dispatcher::with_default(&dispatch, || {
            let root = root();
            adopt_parent(&root, &md(&[("traceparent", "00-bad")]));
            trace_id(&root)
        });
        let spans = spans(&collect);
        let root = named(&spans, "checkpoint");
        assert_eq!(root.parent_span_id, SpanId::INVALID);
        assert_eq!(id, Some(root.span_context.trace_id().to_string()));
        assert_ne!(id.as_deref(), Some("4bf92f3577b34da6a3ce929d0e0e4736"));
    }

    #[test]
    fn a_failed_step_and_its_root_have_status_error() {
        let (dispatch, collect, _p) = subscriber();
        tracing::dispatcher::with_default(&dispatch, || {
            let root = root();
            root.in_scope(|| {
                step("device-lock").in_scope(|| {});
                let s = step("device-checkpoint");
                s.record("otel.status_code", "ERROR");
                s.record(
                    "otel.status_message",
                    "cuCheckpointProcessCheckpoint failed",
                );
            });
            root.record("otel.status_code", "ERROR");
            root.record("otel.status_message", "device-checkpoint: failed");
        });
        let spans = spans(&collect);
        assert_eq!(named(&spans, "device-lock").status, Status::Unset);
        assert_eq!(
            named(&spans, "device-checkpoint").status,
            Status::error("cuCheckpointProcessCheckpoint failed")
        );
        assert_eq!(
            named(&spans, "checkpoint").status,
            Status::error("device-checkpoint: failed")
        );
    }

    #[test]
    fn nothing_is_sampled_before_configure() {
        // The process's provider, before any configure: spans are dropped, no trace id.
        let sub = tracing_subscriber::registry().with(layer());
        let id = tracing::subscriber::with_default(sub, || trace_id(&root()));
        assert_eq!(id, None);
        assert!(!enabled());
    }
}
