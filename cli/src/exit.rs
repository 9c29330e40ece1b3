//! The exit codes of `gpu-ckpt`, and the one place that maps an error to its code
//! ([`classify`]). docs/usage.md ("Exit codes") lists them; a test holds the doc to
//! [`ExitClass::ALL`].

use std::path::PathBuf;
use std::process::ExitCode;

use crate::drain_plan::DrainPlanError;

/// What a command's end means, each with its own exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitClass {
    /// 0: done; the answer is yes.
    Ok,
    /// 1: the answer is no: `compat` not compatible, `drain-plan` leaves a workload with
    /// nowhere to go, a `device` step the driver or the process refused.
    No,
    /// 2: the command was called wrongly: a flag (clap's own usage errors exit 2 too), flags
    /// that contradict, input it cannot parse (JSON that is not what the flag takes).
    Usage,
    /// 3: a file missing or unreadable, a directory to write that exists, the node's GPUs not
    /// readable.
    Io,
    /// 4: the checkpoint is damaged or no checkpoint: a digest or size mismatch, a file missing
    /// or unlisted, a truncated or hostile archive, no manifest.
    Integrity,
    /// 5: the signature does not hold, or its key is not trusted or is revoked, or the
    /// checkpoint is unsigned where trust was asked for; a key file that cannot be used.
    Trust,
    /// 6: the registry: refused connection, TLS, authentication, not found.
    Registry,
}

impl ExitClass {
    pub const ALL: [ExitClass; 7] = [
        ExitClass::Ok,
        ExitClass::No,
        ExitClass::Usage,
        ExitClass::Io,
        ExitClass::Integrity,
        ExitClass::Trust,
        ExitClass::Registry,
    ];

    pub fn code(self) -> u8 {
        match self {
            ExitClass::Ok => 0,
            ExitClass::No => 1,
            ExitClass::Usage => 2,
            ExitClass::Io => 3,
            ExitClass::Integrity => 4,
            ExitClass::Trust => 5,
            ExitClass::Registry => 6,
        }
    }

    /// The name printed as "class" in `-o json|yaml` errors.
    pub fn name(self) -> &'static str {
        match self {
            ExitClass::Ok => "ok",
            ExitClass::No => "no",
            ExitClass::Usage => "usage",
            ExitClass::Io => "io",
            ExitClass::Integrity => "integrity",
            ExitClass::Trust => "trust",
            ExitClass::Registry => "registry",
        }
    }

    pub fn exit_code(self) -> ExitCode {
        ExitCode::from(self.code())
    }
}

/// The command's own errors, each of its class.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Flags that do not fit together, or a value a flag cannot take.
    #[error("{0}")]
    Usage(String),
    /// An input that is no checkpoint, archive, image or manifest.
    #[error("{path}: not a checkpoint: {why}")]
    NotACheckpoint { path: PathBuf, why: String },
    /// A signature or signer a node would refuse.
    #[error("{0}")]
    Trust(String),
    /// A `device` step that failed: `{step} pid {pid} failed: {error}`.
    #[error("{what} failed: {error}")]
    Device { what: String, error: String },
}

impl CliError {
    pub fn class(&self) -> ExitClass {
        match self {
            CliError::Usage(_) => ExitClass::Usage,
            CliError::NotACheckpoint { .. } => ExitClass::Integrity,
            CliError::Trust(_) => ExitClass::Trust,
            CliError::Device { .. } => ExitClass::No,
        }
    }
}

/// The class of the error: the first error in its chain whose type tells.
pub fn classify(e: &anyhow::Error) -> ExitClass {
    for cause in e.chain() {
        if let Some(c) = cause.downcast_ref::<CliError>() {
            return c.class();
        }
        if let Some(f) = cause.downcast_ref::<image_format::Error>() {
            return format_class(f);
        }
        if let Some(d) = cause.downcast_ref::<DrainPlanError>() {
            return match d {
                DrainPlanError::Read { .. } | DrainPlanError::Write(_) => ExitClass::Io,
                _ => ExitClass::Usage,
            };
        }
        if let Some(g) = cause.downcast_ref::<gpu::GpuError>() {
            return match g {
                gpu::GpuError::InvalidUuid { .. } | gpu::GpuError::InvalidArgument(_) => {
                    ExitClass::Usage
                }
                _ => ExitClass::Io,
            };
        }
        if cause.is::<clap::Error>() || cause.is::<serde_json::Error>() {
            return ExitClass::Usage;
        }
        if cause.is::<std::io::Error>() {
            return ExitClass::Io;
        }
    }
    ExitClass::Io
}

fn format_class(e: &image_format::Error) -> ExitClass {
    use image_format::Error as E;
    match e {
        E::Io { .. } | E::Exists { .. } | E::Cancelled { .. } => ExitClass::Io,
        E::Registry { .. } => ExitClass::Registry,
        E::Signature { .. } | E::Key { .. } => ExitClass::Trust,
        _ => ExitClass::Integrity,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_error_kind_maps_to_its_class() {
        let class = |e: anyhow::Error| classify(&e.context("doing it"));
        let io = || std::io::Error::from(std::io::ErrorKind::NotFound);
        assert_eq!(
            class(image_format::Error::io("opening", "/x", io()).into()),
            ExitClass::Io
        );
        assert_eq!(class(io().into()), ExitClass::Io);
        assert_eq!(
            class(
                image_format::Error::MissingFile {
                    name: "core-1.img".into()
                }
                .into()
            ),
            ExitClass::Integrity
        );
        assert_eq!(
            class(
                image_format::Error::Signature {
                    reason: "does not match".into()
                }
                .into()
            ),
            ExitClass::Trust
        );
        assert_eq!(
            class(
                image_format::Error::Registry {
                    url: "https://r".into(),
                    reason: "refused".into()
                }
                .into()
            ),
            ExitClass::Registry
        );
        assert_eq!(
            class(CliError::Usage("nothing to do".into()).into()),
            ExitClass::Usage
        );
        let codes: Vec<u8> = ExitClass::ALL.iter().map(|c| c.code()).collect();
        assert_eq!(codes, [0, 1, 2, 3, 4, 5, 6]);
    }
}
