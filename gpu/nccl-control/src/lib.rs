//! Control protocol v1 between the NCCL communicator layer (preloaded into an application) and
//! the shim that checkpoints it.
//!
//! A Unix stream socket; each message is one frame: a 4-byte big-endian length, then that many
//! bytes of JSON (serde's externally tagged enums). Either side refuses a frame over
//! [`MAX_FRAME`] bytes and closes the connection. Everything here is blocking `std` I/O with
//! optional timeouts, usable from a plain thread and from async code through `spawn_blocking`.
//!
//! The layer speaks first ([`LayerMsg::Hello`]); the shim answers [`ShimMsg::Welcome`]. After a
//! `Welcome` the layer announces every communicator it holds ([`LayerMsg::Comm`], in the order they
//! were made), then one `Comm` per communicator made later and a [`LayerMsg::CommGone`] per one
//! finalized, destroyed or aborted. Every other shim message gets exactly one reply, in order.
//!
//! A checkpoint quiesces in two rounds, so that every rank of a communicator stops after the
//! same collective (a rank held before its k-th allreduce while a peer already enqueued its
//! k-th would leave the peer's stream waiting forever): [`ShimMsg::Quiesce`] to every process
//! at once, answered by [`LayerMsg::Holding`] with how many collectives each communicator has
//! issued; then [`ShimMsg::Drain`] to every process at once with, for each communicator, the
//! largest count among the ranks of its key, answered by [`LayerMsg::Quiesced`]. Collectives
//! are counted per communicator (`ncclCommSplit` counts on its parent); point-to-point calls
//! are not (their counts differ between ranks by design).

mod error;
mod frame;

pub use error::ControlError;
pub use frame::{read_frame, write_frame, Connection};

use serde::{Deserialize, Serialize};

/// The protocol version this crate speaks.
pub const VERSION: u32 = 1;

/// The largest frame body either side accepts, in bytes.
pub const MAX_FRAME: usize = 64 * 1024;

/// The environment variable that names the shim's socket inside the application.
pub const ENV_SOCKET: &str = "GPU_CKPT_NCCL_SOCKET";

/// The environment variable that chooses what the layer's Release does: `destroy` destroys
/// every real communicator (a Rebuild brings them back, on this node too); `suspend` suspends
/// them where the NCCL under the layer has `ncclCommSuspend` (2.29.7 and later), else destroys
/// them. The shim sets it from its handler option `NcclRelease`.
pub const ENV_RELEASE: &str = "GPU_CKPT_NCCL_RELEASE";

/// How a communicator came from a split of another one.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Split {
    /// The parent communicator's id.
    pub parent: u64,
    pub color: i32,
    pub key: i32,
}

/// Messages from the layer to the shim.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum LayerMsg {
    /// First message on every connection. `resumed`: the token of the session the layer had
    /// before a `Disconnect`.
    Hello {
        version: u32,
        pid: i32,
        nccl_version: i32,
        resumed: Option<String>,
    },
    /// A communicator the application holds. `key`: BLAKE3 (hex) of the unique id it was made
    /// from, or `<parent key>/<color>` for a split.
    Comm {
        id: u64,
        key: String,
        rank: i32,
        nranks: i32,
        cuda_dev: i32,
        split: Option<Split>,
    },
    /// The application finalized, destroyed or aborted communicator `id`.
    CommGone { id: u64 },
    /// Answer to `Quiesce`: new calls are held and none is in the layer. `issued`: for each
    /// live communicator id, the collectives issued on it since it was made.
    Holding { issued: Vec<(u64, u64)> },
    /// Answer to `Drain`: every communicator reached its target, no call is in the layer, every
    /// stream used is complete. `comms`: the live communicator ids.
    Quiesced { comms: Vec<u64> },
    /// Answer to `Release`. `suspended`: every live communicator was suspended
    /// (`ncclCommSuspend`), so that a `Resume` on the same node brings them back; false when
    /// some were destroyed (an NCCL without `ncclCommSuspend`): then even a same-node resume
    /// needs `NewUniqueId` and `Rebuild`.
    Released { suspended: bool },
    /// Answer to `NewUniqueId`: a fresh unique id for `key`, hex of its 128 bytes.
    UniqueId { key: String, id: String },
    /// Answer to `Rebuild` and `Resume`.
    Rebuilt,
    /// Answer to any request that could not be done. `comm` and `rank` name the communicator
    /// concerned where there is one (for `Quiesce` and `Drain`: the one whose call stayed in the
    /// layer, whose target was not reached, or whose stream did not complete). After a failed
    /// `Quiesce` or `Drain` the layer lets its held calls go by itself.
    Failed {
        comm: Option<u64>,
        rank: Option<i32>,
        message: String,
    },
}

/// Messages from the shim to the layer.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum ShimMsg {
    /// Answer to `Hello`: the session's token, which the layer sends back as `resumed`.
    Welcome { token: String },
    /// Hold new calls, wait (until the deadline) for the calls in the layer; answered by
    /// `Holding`.
    Quiesce { deadline_ms: u64 },
    /// After `Holding`: let held collectives on communicator `id` pass until `target` of them
    /// were issued (for each `(id, target)`; the largest `issued` among the ranks of its key),
    /// then wait (until the deadline) for the calls in the layer and every stream used;
    /// answered by `Quiesced`.
    Drain {
        targets: Vec<(u64, u64)>,
        deadline_ms: u64,
    },
    /// Suspend (or destroy) every real communicator and deregister buffers; answered by
    /// `Released` (or `Failed`).
    Release,
    /// Close the connection; the layer reconnects every 50 ms.
    Disconnect,
    /// Resume every suspended communicator (same node, nothing moved; only after a
    /// `Released { suspended: true }`).
    Resume,
    /// Re-create every communicator: key -> fresh unique id (hex) for each root key.
    Rebuild { ids: Vec<(String, String)> },
    /// Release the held calls.
    Go,
    /// Make a fresh unique id for root key `key` (sent to the process holding its rank 0).
    NewUniqueId { key: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn externally_tagged_json() {
        let m = ShimMsg::Quiesce { deadline_ms: 500 };
        assert_eq!(
            serde_json::to_string(&m).unwrap(),
            r#"{"Quiesce":{"deadline_ms":500}}"#
        );
        assert_eq!(serde_json::to_string(&ShimMsg::Go).unwrap(), r#""Go""#);
        assert_eq!(
            serde_json::to_string(&LayerMsg::Released { suspended: false }).unwrap(),
            r#"{"Released":{"suspended":false}}"#
        );
        let r = ShimMsg::Rebuild {
            ids: vec![("k".into(), "00ff".into())],
        };
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"Rebuild":{"ids":[["k","00ff"]]}}"#
        );
        let h: LayerMsg = serde_json::from_str(
            r#"{"Hello":{"version":1,"pid":7,"nccl_version":23206,"resumed":null}}"#,
        )
        .unwrap();
        assert_eq!(
            h,
            LayerMsg::Hello {
                version: 1,
                pid: 7,
                nccl_version: 23206,
                resumed: None
            }
        );
    }
}
