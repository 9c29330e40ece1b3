//! Task events, published to containerd in the order they are sent.
//!
//! Every event goes through one channel to one forwarding task, so their order is the order in
//! which the shim sent them: TaskOOM before TaskExit, TaskStart before TaskExit.
//!
//! The forwarder keeps its own ttrpc connection to containerd's events service and connects
//! again whenever a forward fails: containerd restarts under running shims, and the shim
//! crate's `RemotePublisher` reconnects only on the errors ttrpc 0.8 gave for a closed
//! connection (ttrpc 0.10 reports one as `Others("… channel closed")`), so after a restart it
//! would drop every event, TaskExit included, for the rest of the shim's life.

use std::time::{Duration, Instant};

use containerd_shim::{
    protos::{
        protobuf::MessageDyn,
        shim::{event::Envelope, events::ForwardRequest},
        shim_async::{Client, EventsClient},
        ttrpc::context,
    },
    publisher::RemotePublisher,
    util::{convert_to_any, timestamp},
};
use tokio::sync::mpsc;
use tracing::{info, warn};

/// How long one event is retried while containerd cannot be reached (a restart takes seconds).
const RETRY_FOR: Duration = Duration::from_secs(120);
/// The deadline of one forward.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(10);

/// A handle to send events with; cheap to clone.
#[derive(Clone)]
pub struct EventSender {
    tx: mpsc::UnboundedSender<(String, Box<dyn MessageDyn>)>,
}

impl EventSender {
    /// Starts the forwarder that publishes to containerd's events service, at the address
    /// `publisher` was made for, under `namespace`.
    pub fn spawn(publisher: RemotePublisher, namespace: String) -> Self {
        let address = publisher.address.clone();
        // Its own queue and connection are left unused.
        drop(publisher);
        let (tx, mut rx) = mpsc::unbounded_channel::<(String, Box<dyn MessageDyn>)>();
        tokio::spawn(async move {
            let mut client: Option<EventsClient> = None;
            while let Some((topic, event)) = rx.recv().await {
                let envelope = match envelope(&topic, &namespace, event) {
                    Ok(e) => e,
                    Err(e) => {
                        warn!(%topic, error = %e, "event dropped: it cannot be encoded");
                        continue;
                    }
                };
                forward(&address, &mut client, &topic, envelope).await;
            }
        });
        Self { tx }
    }

    /// Queues an event; publishing happens in order on the forwarder.
    pub fn send(&self, topic: &str, event: impl MessageDyn) {
        if self.tx.send((topic.to_string(), Box::new(event))).is_err() {
            warn!(%topic, "event forwarder is gone, event dropped");
        }
    }
}

fn envelope(
    topic: &str,
    namespace: &str,
    event: Box<dyn MessageDyn>,
) -> containerd_shim::Result<Envelope> {
    let mut envelope = Envelope::new();
    envelope.set_topic(topic.to_owned());
    envelope.set_namespace(namespace.to_owned());
    envelope.set_timestamp(timestamp()?);
    envelope.set_event(convert_to_any(event)?);
    Ok(envelope)
}

/// Forwards one event, connecting (again) to containerd at `address` as needed; retries for
/// [`RETRY_FOR`], then drops the event with a warning.
async fn forward(
    address: &str,
    client: &mut Option<EventsClient>,
    topic: &str,
    envelope: Envelope,
) {
    let mut req = ForwardRequest::new();
    req.set_envelope(envelope);
    let started = Instant::now();
    let mut wait = Duration::from_millis(50);
    let mut failed = false;
    loop {
        if client.is_none() {
            let sockaddr = if address.starts_with("unix://") {
                address.to_string()
            } else {
                format!("unix://{address}")
            };
            match Client::connect(&sockaddr).await {
                Ok(c) => *client = Some(EventsClient::new(c)),
                Err(e) => {
                    failed = true;
                    warn!(%address, error = %e, "connect to containerd's events service");
                }
            }
        }
        if let Some(c) = client.as_ref() {
            let ctx = context::with_timeout(FORWARD_TIMEOUT.as_nanos() as i64);
            match c.forward(ctx, &req).await {
                Ok(_) => {
                    if failed {
                        info!(%address, %topic, "events reach containerd again");
                    }
                    return;
                }
                Err(e) => {
                    warn!(%topic, error = %e, "publish event; connecting again");
                    failed = true;
                    *client = None;
                }
            }
        }
        if started.elapsed() > RETRY_FOR {
            warn!(%topic, "event dropped: containerd's events service did not answer for {RETRY_FOR:?}");
            return;
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(2));
    }
}
