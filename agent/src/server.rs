//! `GET /metrics` and `GET /healthz` over HTTP/1 (hyper), on the caller's runtime.
//!
//! `/metrics` answers in OpenMetrics' text format when the scraper accepts it (Prometheus
//! asks for `application/openmetrics-text`), else in Prometheus' text format 0.0.4 (curl, older
//! scrapers). `/healthz` answers 200 `ok` while the journal can be read (or there is none yet),
//! else 503 with the reason in the log.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{ACCEPT, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::{Agent, Error};

pub const OPENMETRICS_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
pub const PROMETHEUS_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// How long a connection may take to send its request head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

pub type Shared = Arc<Mutex<Agent>>;

fn reply(status: StatusCode, ctype: &'static str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, hyper::header::HeaderValue::from_static(ctype));
    r
}

/// The answer to one request.
pub fn handle(agent: &Shared, req: &Request<impl Sized>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return reply(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "GET only\n");
    }
    let Ok(mut a) = agent.lock() else {
        return reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            "text/plain",
            "the agent's state is poisoned\n",
        );
    };
    match req.uri().path() {
        "/metrics" => {
            let om = req
                .headers()
                .get_all(ACCEPT)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .any(|v| v.contains("application/openmetrics-text"));
            match a.scrape(om) {
                Ok(body) => reply(
                    StatusCode::OK,
                    if om {
                        OPENMETRICS_TYPE
                    } else {
                        PROMETHEUS_TYPE
                    },
                    body,
                ),
                Err(e) => {
                    tracing::error!(error = %e, "scrape failed");
                    reply(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "text/plain",
                        format!("{e}\n"),
                    )
                }
            }
        }
        "/healthz" => {
            a.poll();
            if a.healthy() {
                reply(StatusCode::OK, "text/plain", "ok\n")
            } else {
                reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    "the event journal cannot be read (see the agent's log)\n",
                )
            }
        }
        _ => reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found: /metrics, /healthz\n",
        ),
    }
}

/// Binds `addr`.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, Error> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Listen { addr, source })
}

/// Serves connections on `listener` until the task is dropped, and polls the journal every
/// `poll_every`.
pub async fn serve(listener: TcpListener, agent: Shared, poll_every: Duration) {
    let poller = agent.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(poll_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Ok(mut a) = poller.lock() {
                a.poll();
            }
        }
    });
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let agent = agent.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let resp = handle(&agent, &req);
                async move { Ok::<_, Infallible>(resp) }
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT);
            if let Err(e) = builder.serve_connection(TokioIo::new(stream), svc).await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
}
