//! The one error type of the control protocol.

use std::io;

/// What reading or writing a frame can fail with. After any error but [`ControlError::Timeout`]
/// the connection is out of step and must be closed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The peer closed the connection between frames.
    #[error("the control connection was closed by its peer")]
    Closed,
    /// No frame began before the timeout; the connection is still usable.
    #[error("no control message within {ms} ms")]
    Timeout { ms: u64 },
    /// A frame over the limit: announced by the peer (`sending` false; nothing of its body was
    /// read) or about to be sent (nothing was written).
    #[error(
        "control {} of {len} bytes refused: the limit is {max} bytes",
        if *.sending { "message to send" } else { "frame" }
    )]
    TooLarge {
        len: usize,
        max: usize,
        sending: bool,
    },
    /// The connection ended or stalled inside a frame.
    #[error("control frame cut short after {got} of {want} bytes: {source}")]
    Truncated {
        got: usize,
        want: usize,
        #[source]
        source: io::Error,
    },
    /// The frame's body is not a message of this protocol.
    #[error("malformed control message: {0}")]
    Malformed(#[source] serde_json::Error),
    /// A message could not be encoded.
    #[error("cannot encode control message: {0}")]
    Encode(#[source] serde_json::Error),
    /// The socket failed.
    #[error("control socket {op}: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: io::Error,
    },
}

impl ControlError {
    pub(crate) fn io(op: &'static str) -> impl FnOnce(io::Error) -> ControlError {
        move |source| ControlError::Io { op, source }
    }
}
