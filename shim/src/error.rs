//! The shim's error type, and the one place where errors become ttrpc status codes.

use containerd_shim::protos::ttrpc::{self, Code};
use thiserror::Error;

/// Errors of the shim library. Messages are lower-case and name what failed.
#[derive(Debug, Error)]
pub enum Error {
    /// The caller sent something unusable: a bad option, a malformed bundle.
    #[error("{0}")]
    InvalidArgument(String),
    /// No container or process with that id.
    #[error("{0}")]
    NotFound(String),
    /// The id is taken.
    #[error("{0}")]
    AlreadyExists(String),
    /// The process is in a state where the request makes no sense.
    #[error("{0}")]
    FailedPrecondition(String),
    /// A checkpoint this node's policy refuses to restore on other grounds than those of
    /// [`Error::Refused`] (rootfs changes outside the signature, a rewritten engine record).
    #[error("{0}")]
    PermissionDenied(String),
    /// A checkpoint this pod may not use: missing, outside `RestoreSources`, unsigned, signed by
    /// a key this node does not trust or has revoked, taken in another namespace. What the pod
    /// sees is the same for every reason, so that it learns nothing about the node's files or
    /// other namespaces' checkpoints; `reason` goes to the node's log only
    /// (`trust::log_refused`).
    #[error("checkpoint {checkpoint:?} cannot be used by this pod: it is missing, outside the sources this handler allows, not signed by a key this node trusts, or of another namespace (the node's containerd log says which)")]
    Refused { checkpoint: String, reason: String },
    /// The request is valid but this shim does not do it.
    #[error("{0}")]
    Unimplemented(String),
    /// runc ran and failed; `message` is runc's own error, taken from its log.
    #[error("runc {command} failed: {message}")]
    Runc { command: String, message: String },
    /// A checkpoint or restore step failed; `message` says why (with CRIU's log tail).
    #[error("{operation} failed at step {step}: {message}")]
    Step {
        operation: &'static str,
        step: &'static str,
        message: String,
    },
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// Anything from the shim crate (mounts, cgroups, fifos).
    #[error("{0}")]
    Shim(#[from] containerd_shim::Error),
    /// Protobuf encoding or decoding.
    #[error("protobuf: {0}")]
    Protobuf(#[from] containerd_shim::protos::protobuf::Error),
    /// A checkpoint's files or manifest (hostile input, or I/O on them).
    #[error("{0}")]
    Image(#[from] image_format::Error),
    /// JSON encoding or decoding.
    #[error("{context}: {source}")]
    Json {
        context: String,
        #[source]
        source: serde_json::Error,
    },
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let context = context.into();
        move |source| Error::Io { context, source }
    }

    pub fn json(context: impl Into<String>) -> impl FnOnce(serde_json::Error) -> Error {
        let context = context.into();
        move |source| Error::Json { context, source }
    }

    /// The ttrpc status code containerd should see for this error.
    pub fn code(&self) -> Code {
        match self {
            Error::InvalidArgument(_) | Error::Json { .. } | Error::Protobuf(_) => {
                Code::INVALID_ARGUMENT
            }
            Error::NotFound(_) => Code::NOT_FOUND,
            Error::AlreadyExists(_) => Code::ALREADY_EXISTS,
            Error::FailedPrecondition(_) => Code::FAILED_PRECONDITION,
            Error::PermissionDenied(_) | Error::Refused { .. } => Code::PERMISSION_DENIED,
            Error::Unimplemented(_) => Code::UNIMPLEMENTED,
            Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                Code::NOT_FOUND
            }
            Error::Shim(containerd_shim::Error::InvalidArgument(_)) => Code::INVALID_ARGUMENT,
            Error::Shim(containerd_shim::Error::NotFoundError(_)) => Code::NOT_FOUND,
            Error::Shim(containerd_shim::Error::FailedPreconditionError(_)) => {
                Code::FAILED_PRECONDITION
            }
            Error::Image(image_format::Error::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                Code::NOT_FOUND
            }
            Error::Image(
                image_format::Error::Io { .. } | image_format::Error::Cancelled { .. },
            ) => Code::UNKNOWN,
            Error::Image(_) => Code::INVALID_ARGUMENT,
            Error::Runc { .. } | Error::Io { .. } | Error::Shim(_) | Error::Step { .. } => {
                Code::UNKNOWN
            }
        }
    }
}

impl From<Error> for ttrpc::Error {
    fn from(e: Error) -> Self {
        ttrpc::Error::RpcStatus(ttrpc::get_status(e.code(), e.to_string()))
    }
}

/// The first `max` of `items`, joined by "; ", and how many more there are: a refusal names
/// what it found without growing with a forged image's size.
pub(crate) fn first_of<T: std::fmt::Display>(items: &[T], max: usize) -> String {
    let mut text: Vec<String> = items.iter().take(max).map(T::to_string).collect();
    if items.len() > max {
        text.push(format!("and {} more", items.len() - max));
    }
    text.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_follow_the_error_kind() {
        assert_eq!(Error::NotFound("x".into()).code(), Code::NOT_FOUND);
        assert_eq!(
            Error::InvalidArgument("x".into()).code(),
            Code::INVALID_ARGUMENT
        );
        let missing = Error::io("open bundle")(std::io::Error::from(std::io::ErrorKind::NotFound));
        assert_eq!(missing.code(), Code::NOT_FOUND);
        let tampered = Error::from(image_format::Error::DigestMismatch {
            name: "pages-1.img".into(),
            algorithm: "sha256",
            expected: "a".into(),
            actual: "b".into(),
        });
        assert_eq!(tampered.code(), Code::INVALID_ARGUMENT);
        let runc = Error::Runc {
            command: "create".into(),
            message: "boom".into(),
        };
        assert_eq!(runc.code(), Code::UNKNOWN);
        match ttrpc::Error::from(runc) {
            ttrpc::Error::RpcStatus(s) => assert_eq!(s.message, "runc create failed: boom"),
            other => panic!("unexpected {other:?}"),
        }
    }
}
