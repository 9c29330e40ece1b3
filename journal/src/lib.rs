//! The node-local journal of gpu-ckpt: one [`Record`] per checkpoint and restore the shims run
//! (and per refusal), as one line of JSON in `DIR/events.jsonl`, the previous segment in
//! `DIR/events.jsonl.1`.
//!
//! - **Append-only, one write per record**: [`Journal::append`] writes the whole line with one
//!   `write(2)` on an `O_APPEND` descriptor, under `flock(LOCK_EX)` on the current file (waited
//!   for at most [`LOCK_WAIT`]; past it the record is dropped with a warning, so that a
//!   checkpoint never blocks on its record), then `fdatasync`.
//! - **Crash-safe**: a writer killed mid-write leaves a line without its `\n`; the next writer,
//!   under the lock, ends it with a `\n` before its own line, so the torn line stays one line of
//!   its own. Every line carries `"crc"` (BLAKE3 of the line without it); readers skip and count
//!   ([`Skipped`]) lines that do not parse or whose crc differs.
//! - **Bounded**: when the current file would pass the segment size, the writer renames it to
//!   `.1` (replacing the older one) under the lock: the journal holds at most two segments. A line
//!   is at most [`MAX_RECORD_BYTES`], and every free-form field is capped whatever its source (a
//!   tenant's annotation lands in `checkpoint`): `checkpoint` at [`MAX_CHECKPOINT_BYTES`], names
//!   at [`MAX_NAME_BYTES`], ids at [`MAX_ID_BYTES`], step names and classes at
//!   [`MAX_STEP_NAME_BYTES`], messages at [`MAX_MESSAGE_BYTES`], steps at [`MAX_STEPS`], GPUs at
//!   [`MAX_GPUS`] of [`MAX_GPU_BYTES`], so a record is a few KiB and a flood of them evicts no
//!   more history than its count times that.
//! - **Root-only**: the directory is 0700 and the files 0600, owned by the writer (root on a
//!   node); files are opened through the directory's descriptor with `O_NOFOLLOW`, and a
//!   directory that is a symbolic link or owned by another user is refused.
//!
//! Readers: [`read_all`] (every record on the node, oldest first) and [`Tailer`] (the records
//! appended since the last poll, following a rotation).

mod fsutil;
mod read;
mod record;
#[cfg(test)]
mod tests;
mod util;
mod write;

use std::path::PathBuf;
use std::time::Duration;

pub use read::{read_all, scan, Skipped, Tailer};
pub use record::{
    cut, Operation, Outcome, Record, RecordError, StepTime, MAX_CHECKPOINT_BYTES, MAX_GPUS,
    MAX_GPU_BYTES, MAX_ID_BYTES, MAX_NAME_BYTES, MAX_STEP_NAME_BYTES,
};
pub use util::{hostname, new_id, now_rfc3339, parse_time, rfc3339};
pub use write::Journal;

/// Where the shim writes its records unless its options say otherwise.
pub const DEFAULT_DIR: &str = "/var/lib/gpu-ckpt/events";
/// The size of one segment unless the options say otherwise: the journal holds at most two.
pub const DEFAULT_SEGMENT_BYTES: u64 = 4 << 20;
/// The smallest segment [`Journal::open`] takes (a smaller one is raised to it), so that any
/// record fits in one.
pub const MIN_SEGMENT_BYTES: u64 = 2 * MAX_RECORD_BYTES as u64;
/// The current file's name in the journal's directory.
pub const CURRENT_FILE: &str = "events.jsonl";
/// The previous segment's name.
pub const PREVIOUS_FILE: &str = "events.jsonl.1";
/// The longest line a record takes, its `\n` included.
pub const MAX_RECORD_BYTES: usize = 64 << 10;
/// The longest error message a record keeps (cut on a character boundary, ending in `…`).
pub const MAX_MESSAGE_BYTES: usize = 1024;
/// The most steps a record keeps (the first ones).
pub const MAX_STEPS: usize = 64;
/// How long [`Journal::append`] waits for the lock before it drops the record.
pub const LOCK_WAIT: Duration = Duration::from_secs(2);
/// The record format's version (`v`).
pub const VERSION: u32 = 1;

/// The journal's errors.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is a symbolic link: the journal refuses it")]
    Symlink { path: PathBuf },
    #[error("{path} is not a {want}")]
    NotA { path: PathBuf, want: &'static str },
    #[error("{path} is owned by uid {uid}, not by uid {want}: the journal refuses it")]
    Owner { path: PathBuf, uid: u32, want: u32 },
    #[error("{path} has {links} hard links: the journal refuses it")]
    Links { path: PathBuf, links: u64 },
    #[error("{path}: the lock was not free within {waited:?}; the record is dropped")]
    LockTimeout { path: PathBuf, waited: Duration },
    #[error("{path}: the current file kept changing under the writer; the record is dropped")]
    Unstable { path: PathBuf },
    #[error("serialising a record: {0}")]
    Serialize(#[from] serde_json::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(
        op: &'static str,
        path: impl Into<PathBuf>,
        e: impl Into<std::io::Error>,
    ) -> Error {
        Error::Io {
            op,
            path: path.into(),
            source: e.into(),
        }
    }
}
