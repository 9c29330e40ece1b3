//! An OTLP trace receiver for the tests, on the OpenTelemetry protocol's own definitions (the
//! `opentelemetry-proto` crate, generated from the official `.proto` files): `TraceService/Export`
//! over gRPC and `POST /v1/traces` of a protobuf `ExportTraceServiceRequest` over HTTP, each on
//! its own port of 127.0.0.1. It keeps every span it is sent; a test waits for the spans it
//! expects, within a bound.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

use http_body_util::{BodyExt, Full};
use hyper::{body::Bytes, service::service_fn, Method, Request, Response, StatusCode};
use opentelemetry_proto::tonic::{
    collector::trace::v1::{
        trace_service_server::{TraceService, TraceServiceServer},
        ExportTraceServiceRequest, ExportTraceServiceResponse,
    },
    common::v1::{any_value::Value, AnyValue, KeyValue},
    trace::v1::status::StatusCode as OtlpStatusCode,
};
use prost::Message;

/// What went wrong starting the receiver or waiting for spans.
#[derive(Debug, thiserror::Error)]
pub enum OtlpError {
    #[error("OTLP receiver: {0}")]
    Io(#[from] std::io::Error),
    #[error("OTLP receiver: {0}")]
    Server(String),
    #[error("waited {waited:?} for {what}; the receiver holds {held} spans: {spans}")]
    Timeout {
        waited: Duration,
        what: String,
        held: usize,
        spans: String,
    },
}

/// A span's status as received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanStatus {
    Unset,
    Ok,
    Error,
}

/// One received span, its ids in lowercase hex as W3C trace context writes them.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedSpan {
    /// The resource's `service.name`.
    pub service: Option<String>,
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    /// None for a root.
    pub parent_span_id: Option<String>,
    pub start_unix_nano: u64,
    pub end_unix_nano: u64,
    pub status: SpanStatus,
    pub status_message: String,
    /// Attributes, each value as text (strings as they are, others as their protobuf value).
    pub attributes: BTreeMap<String, String>,
    /// `grpc` or `http/protobuf`: how the span came.
    pub protocol: &'static str,
}

impl ReceivedSpan {
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

#[derive(Default)]
struct Store {
    spans: Mutex<Vec<ReceivedSpan>>,
    arrived: Condvar,
}

impl Store {
    fn add(&self, request: ExportTraceServiceRequest, protocol: &'static str) {
        let mut received = Vec::new();
        for rs in request.resource_spans {
            let service = rs.resource.as_ref().and_then(|r| {
                r.attributes
                    .iter()
                    .find(|kv| kv.key == "service.name")
                    .map(|kv| text(kv.value.as_ref()))
            });
            for ss in rs.scope_spans {
                for s in ss.spans {
                    let (status, status_message) = match s.status {
                        Some(st) => (
                            match OtlpStatusCode::try_from(st.code) {
                                Ok(OtlpStatusCode::Ok) => SpanStatus::Ok,
                                Ok(OtlpStatusCode::Error) => SpanStatus::Error,
                                _ => SpanStatus::Unset,
                            },
                            st.message,
                        ),
                        None => (SpanStatus::Unset, String::new()),
                    };
                    received.push(ReceivedSpan {
                        service: service.clone(),
                        name: s.name,
                        trace_id: hex::encode(&s.trace_id),
                        span_id: hex::encode(&s.span_id),
                        parent_span_id: (!s.parent_span_id.is_empty()
                            && s.parent_span_id.iter().any(|b| *b != 0))
                        .then(|| hex::encode(&s.parent_span_id)),
                        start_unix_nano: s.start_time_unix_nano,
                        end_unix_nano: s.end_time_unix_nano,
                        status,
                        status_message,
                        attributes: attributes(&s.attributes),
                        protocol,
                    });
                }
            }
        }
        if let Ok(mut spans) = self.spans.lock() {
            spans.extend(received);
        }
        self.arrived.notify_all();
    }
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
        .collect()
}

fn text(v: Option<&AnyValue>) -> String {
    match v.and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

struct Grpc(Arc<Store>);

#[tonic::async_trait]
impl TraceService for Grpc {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.add(request.into_inner(), "grpc");
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// `POST /v1/traces`, `Content-Type: application/x-protobuf`: the request decoded, the empty
/// response encoded; anything else 404 / 415 / 400.
async fn http_export(
    store: Arc<Store>,
    req: Request<hyper::body::Incoming>,
) -> Result<Response<Full<Bytes>>, hyper::Error> {
    let reply = |code: StatusCode, body: Vec<u8>| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = code;
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/x-protobuf"),
        );
        r
    };
    if req.method() != Method::POST || req.uri().path() != "/v1/traces" {
        return Ok(reply(StatusCode::NOT_FOUND, Vec::new()));
    }
    let protobuf = req
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/x-protobuf"));
    if !protobuf {
        return Ok(reply(StatusCode::UNSUPPORTED_MEDIA_TYPE, Vec::new()));
    }
    let body = req.into_body().collect().await?.to_bytes();
    match ExportTraceServiceRequest::decode(body) {
        Ok(request) => {
            store.add(request, "http/protobuf");
            let response = ExportTraceServiceResponse {
                partial_success: None,
            };
            Ok(reply(StatusCode::OK, response.encode_to_vec()))
        }
        Err(_) => Ok(reply(StatusCode::BAD_REQUEST, Vec::new())),
    }
}

/// The receiver: its servers run on a runtime of their own until it is dropped.
pub struct OtlpReceiver {
    http: SocketAddr,
    grpc: SocketAddr,
    store: Arc<Store>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl OtlpReceiver {
    /// Starts both servers on 127.0.0.1, on ports the system picks.
    pub fn start() -> Result<OtlpReceiver, OtlpError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("otlp-receiver")
            .enable_all()
            .build()?;
        let store = Arc::new(Store::default());
        let (http, grpc) = runtime.block_on(async {
            let http = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            Ok::<_, std::io::Error>((http, grpc))
        })?;
        let (http_addr, grpc_addr) = (http.local_addr()?, grpc.local_addr()?);

        let s = store.clone();
        runtime.spawn(async move {
            loop {
                let Ok((stream, _)) = http.accept().await else {
                    continue;
                };
                let s = s.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| http_export(s.clone(), req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        let incoming = tokio_stream_of(grpc);
        let service = TraceServiceServer::new(Grpc(store.clone()));
        runtime.spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming)
                .await;
        });
        Ok(OtlpReceiver {
            http: http_addr,
            grpc: grpc_addr,
            store,
            runtime: Some(runtime),
        })
    }

    /// The base URL for http/protobuf (`OTEL_EXPORTER_OTLP_ENDPOINT`, the handler's
    /// `OtlpEndpoint`): `http://127.0.0.1:PORT`; spans go to `<it>/v1/traces`.
    pub fn http_endpoint(&self) -> String {
        format!("http://{}", self.http)
    }

    /// The URL for grpc: `http://127.0.0.1:PORT`.
    pub fn grpc_endpoint(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// Every span received so far, in the order they came.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.store
            .spans
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default()
    }

    /// Waits, at most `timeout`, until `done` holds for the spans received; returns them. On
    /// timeout the error lists what arrived (`what` says what was awaited).
    pub fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> Result<Vec<ReceivedSpan>, OtlpError> {
        let start = Instant::now();
        let mut spans = self
            .store
            .spans
            .lock()
            .map_err(|_| OtlpError::Server("store poisoned".into()))?;
        loop {
            if done(&spans) {
                return Ok(spans.clone());
            }
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(OtlpError::Timeout {
                    waited: timeout,
                    what: what.to_string(),
                    held: spans.len(),
                    spans: spans
                        .iter()
                        .map(|s| {
                            format!(
                                "{}/{} {} parent {:?}",
                                s.service.as_deref().unwrap_or("?"),
                                s.name,
                                s.span_id,
                                s.parent_span_id
                            )
                        })
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
            spans = self
                .store
                .arrived
                .wait_timeout(spans, left)
                .map_err(|_| OtlpError::Server("store poisoned".into()))?
                .0;
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// The listener as the stream of connections tonic serves.
fn tokio_stream_of(
    listener: tokio::net::TcpListener,
) -> impl futures_core::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    futures_util::stream::unfold(listener, |l| async move {
        let next = l.accept().await.map(|(s, _)| s);
        Some((next, l))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{Span as _, Status, TraceContextExt, Tracer, TracerProvider};
    use opentelemetry::KeyValue as OtelKeyValue;
    use opentelemetry_otlp::{Protocol, WithExportConfig};
    use opentelemetry_sdk::{trace::SdkTracerProvider, Resource};

    /// The SDK's exporter (as the shim uses it) sends a parent and a failed child; the receiver
    /// returns them as sent.
    fn round_trip(receiver: &OtlpReceiver, exporter: opentelemetry_otlp::SpanExporter) {
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter)
            .with_resource(
                Resource::builder()
                    .with_service_name("svc-under-test")
                    .build(),
            )
            .build();
        let tracer = provider.tracer("t");
        let (trace_id, root_id, child_id) = {
            let root = tracer.start("checkpoint");
            let cx = opentelemetry::Context::current_with_span(root);
            let mut child = tracer.start_with_context("criu-dump", &cx);
            child.set_attribute(OtelKeyValue::new("container.id", "c1"));
            child.set_status(Status::error("dump failed"));
            let child_id = child.span_context().span_id().to_string();
            child.end();
            let root = cx.span();
            let ids = (
                root.span_context().trace_id().to_string(),
                root.span_context().span_id().to_string(),
            );
            root.end();
            (ids.0, ids.1, child_id)
        };
        let spans = receiver
            .wait_for("two spans", Duration::from_secs(10), |s| s.len() >= 2)
            .expect("spans");
        let child = spans.iter().find(|s| s.name == "criu-dump").expect("child");
        let root = spans.iter().find(|s| s.name == "checkpoint").expect("root");
        assert_eq!(root.service.as_deref(), Some("svc-under-test"));
        assert_eq!(root.trace_id, trace_id);
        assert_eq!(root.span_id, root_id);
        assert_eq!(root.parent_span_id, None);
        assert_eq!(child.span_id, child_id);
        assert_eq!(child.parent_span_id.as_deref(), Some(root_id.as_str()));
        assert_eq!(child.trace_id, trace_id);
        assert_eq!(child.status, SpanStatus::Error);
        assert_eq!(child.status_message, "dump failed");
        assert_eq!(child.attribute("container.id"), Some("c1"));
        assert_eq!(root.status, SpanStatus::Unset);
        assert!(root.start_unix_nano <= child.start_unix_nano);
        assert!(child.end_unix_nano <= root.end_unix_nano);
        let _ = provider.shutdown();
    }

    #[test]
    fn receives_the_sdk_exporters_spans_over_http_protobuf() {
        let receiver = OtlpReceiver::start().expect("receiver");
        let _ = rustls::crypto::ring::default_provider().install_default();
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(format!("{}/v1/traces", receiver.http_endpoint()))
            .build()
            .expect("exporter");
        round_trip(&receiver, exporter);
        assert!(receiver
            .spans()
            .iter()
            .all(|s| s.protocol == "http/protobuf"));
    }

    #[test]
    fn receives_the_sdk_exporters_spans_over_grpc() {
        let receiver = OtlpReceiver::start().expect("receiver");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let exporter = {
            let _e = rt.enter();
            opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_protocol(Protocol::Grpc)
                .with_endpoint(receiver.grpc_endpoint())
                .build()
                .expect("exporter")
        };
        // The simple processor blocks on each export: off the runtime's threads.
        std::thread::spawn({
            let handle = rt.handle().clone();
            move || {
                let _e = handle.enter();
                round_trip(&receiver, exporter);
                assert!(receiver.spans().iter().all(|s| s.protocol == "grpc"));
            }
        })
        .join()
        .expect("grpc round trip");
    }

    #[test]
    fn wait_for_is_bounded_and_says_what_it_holds() {
        let receiver = OtlpReceiver::start().expect("receiver");
        let t = Instant::now();
        let err = receiver
            .wait_for("a span", Duration::from_millis(300), |s| !s.is_empty())
            .unwrap_err();
        assert!(t.elapsed() >= Duration::from_millis(300));
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(err.to_string().contains("holds 0 spans"), "{err}");
    }

    #[test]
    fn http_refuses_what_is_not_an_export() {
        let receiver = OtlpReceiver::start().expect("receiver");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let status = |path: &'static str, ctype: &'static str, body: Vec<u8>| {
            let addr = receiver.http;
            rt.block_on(async move {
                let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
                let (mut send, conn) =
                    hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                        .await
                        .unwrap();
                tokio::spawn(conn);
                let req = Request::post(path)
                    .header("content-type", ctype)
                    .header("host", "x")
                    .body(Full::new(Bytes::from(body)))
                    .unwrap();
                send.send_request(req).await.unwrap().status()
            })
        };
        assert_eq!(
            status("/v1/metrics", "application/x-protobuf", vec![]),
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            status("/v1/traces", "application/json", b"{}".to_vec()),
            StatusCode::UNSUPPORTED_MEDIA_TYPE
        );
        assert_eq!(
            status("/v1/traces", "application/x-protobuf", vec![0xff, 0xff]),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            status(
                "/v1/traces",
                "application/x-protobuf",
                ExportTraceServiceRequest::default().encode_to_vec()
            ),
            StatusCode::OK
        );
        assert!(receiver.spans().is_empty());
    }
}
