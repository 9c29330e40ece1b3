//! Task events, published to containerd in the order they are sent.
//!
//! Every event goes through one channel to one forwarding task, so their order is the order in
//! which the shim sent them: TaskOOM before TaskExit, TaskStart before TaskExit.

use containerd_shim::{
    protos::{protobuf::MessageDyn, ttrpc::context::Context},
    publisher::RemotePublisher,
};
use tokio::sync::mpsc;
use tracing::warn;

/// A handle to send events with; cheap to clone.
#[derive(Clone)]
pub struct EventSender {
    tx: mpsc::UnboundedSender<(String, Box<dyn MessageDyn>)>,
}

impl EventSender {
    /// Starts the forwarder that publishes to containerd under `namespace`.
    pub fn spawn(publisher: RemotePublisher, namespace: String) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<(String, Box<dyn MessageDyn>)>();
        tokio::spawn(async move {
            while let Some((topic, event)) = rx.recv().await {
                if let Err(e) = publisher
                    .publish(Context::default(), &topic, &namespace, event)
                    .await
                {
                    warn!(%topic, error = %e, "failed to publish event");
                }
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
