//! What the simulated `libnccl.so.2` and the daemon share: NCCL's result codes, data types and
//! reduction operators (the values of nccl.h), the requests a library makes for communicators
//! and collectives, and the reductions themselves (the daemon moves and reduces the bytes between
//! the ranks' device memory).

use serde::{Deserialize, Serialize};

/// The NCCL version the simulated library reports and whose ABI it has (nccl.h 2.32.6).
pub const VERSION: (i32, i32, i32) = (2, 32, 6);
/// Its file's version suffix: `libnccl.so.2.32.6`.
pub const VERSION_STRING: &str = "2.32.6";

/// `NCCL_VERSION(X, Y, Z)` of nccl.h: X*1000 + Y*100 + Z up to 2.8, X*10000 + Y*100 + Z after.
pub const fn version_code(x: i32, y: i32, z: i32) -> i32 {
    if x <= 2 && y <= 8 {
        x * 1000 + y * 100 + z
    } else {
        x * 10000 + y * 100 + z
    }
}

/// `NCCL_UNIQUE_ID_BYTES`.
pub const UNIQUE_ID_BYTES: usize = 128;
/// `NCCL_SPLIT_NOCOLOR`.
pub const SPLIT_NOCOLOR: i32 = -1;
/// `NCCL_API_MAGIC`, the first check on an `ncclConfig_t`.
pub const API_MAGIC: u32 = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT`.
pub const CONFIG_UNDEF_INT: i32 = i32::MIN;
/// The first bytes of a simulated unique id (the rest: the daemon's nonce and a counter).
pub const ID_MAGIC: &[u8; 8] = b"simnccl1";

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [std::ffi::c_char; UNIQUE_ID_BYTES],
}

/// `ncclConfig_t` (`struct ncclConfig_v23100` of nccl.h 2.32): the caller's `size`, `magic`
/// and `version` tell which fields it has.
#[repr(C)]
#[derive(Clone, Copy)]
#[allow(non_snake_case)] // nccl.h's field names, compared with the C struct's by name
pub struct Config {
    pub size: usize,
    pub magic: std::ffi::c_uint,
    pub version: std::ffi::c_uint,
    pub blocking: i32,
    pub cgaClusterSize: i32,
    pub minCTAs: i32,
    pub maxCTAs: i32,
    pub netName: *const std::ffi::c_char,
    pub splitShare: i32,
    pub trafficClass: i32,
    pub commName: *const std::ffi::c_char,
    pub collnetEnable: i32,
    pub CTAPolicy: i32,
    pub shrinkShare: i32,
    pub nvlsCTAs: i32,
    pub nChannelsPerNetPeer: i32,
    pub nvlinkCentricSched: i32,
    pub graphUsageMode: i32,
    pub numRmaCtx: i32,
    pub maxP2pPeers: i32,
    pub graphStreamOrdering: i32,
    pub launchOrderImplicit: i32,
    pub numRmaSig: i32,
    pub rmaEagerInit: i32,
    pub hostCftMode: i32,
    pub nvlsHostMode: i32,
}

/// The size and the field offsets of [`Config`], by nccl.h's field names (the ABI check compares
/// them with a C program's `sizeof`/`offsetof` against NVIDIA's nccl.h).
pub fn config_layout() -> (usize, Vec<(&'static str, usize)>) {
    use std::mem::offset_of;
    macro_rules! fields {
        ($($f:ident),*) => { vec![$((stringify!($f), offset_of!(Config, $f))),*] };
    }
    let f = fields!(
        size,
        magic,
        version,
        blocking,
        cgaClusterSize,
        minCTAs,
        maxCTAs,
        netName,
        splitShare,
        trafficClass,
        commName,
        collnetEnable,
        CTAPolicy,
        shrinkShare,
        nvlsCTAs,
        nChannelsPerNetPeer,
        nvlinkCentricSched,
        graphUsageMode,
        numRmaCtx,
        maxP2pPeers,
        graphStreamOrdering,
        launchOrderImplicit,
        numRmaSig,
        rmaEagerInit,
        hostCftMode,
        nvlsHostMode
    );
    (std::mem::size_of::<Config>(), f)
}

/// The enum values of nccl.h the simulated library implements, by their C names (the ABI
/// check compares them with the values a C program prints).
pub fn enum_values() -> Vec<(&'static str, i64)> {
    let results = [
        ("ncclSuccess", result::SUCCESS),
        ("ncclUnhandledCudaError", result::UNHANDLED_CUDA_ERROR),
        ("ncclSystemError", result::SYSTEM_ERROR),
        ("ncclInternalError", result::INTERNAL_ERROR),
        ("ncclInvalidArgument", result::INVALID_ARGUMENT),
        ("ncclInvalidUsage", result::INVALID_USAGE),
        ("ncclRemoteError", result::REMOTE_ERROR),
        ("ncclInProgress", result::IN_PROGRESS),
        ("ncclTimeout", result::TIMEOUT),
        ("ncclNumResults", result::NUM_RESULTS),
    ];
    let mut v: Vec<(&'static str, i64)> =
        results.iter().map(|(n, c)| (*n, i64::from(*c))).collect();
    let types = DataType::C_NAMES.iter().zip(DataType::ALL);
    v.extend(types.map(|(n, t)| (*n, *t as i64)));
    v.push(("ncclNumTypes", i64::from(NUM_TYPES)));
    let ops = RedOp::C_NAMES.iter().zip(RedOp::ALL);
    v.extend(ops.map(|(n, o)| (*n, *o as i64)));
    v.push(("ncclNumOps", i64::from(NUM_OPS)));
    v.push(("NCCL_SPLIT_NOCOLOR", i64::from(SPLIT_NOCOLOR)));
    v.push(("NCCL_API_MAGIC", i64::from(API_MAGIC)));
    v.push(("NCCL_CONFIG_UNDEF_INT", i64::from(CONFIG_UNDEF_INT)));
    v.push(("NCCL_UNIQUE_ID_BYTES", UNIQUE_ID_BYTES as i64));
    v
}

/// `ncclResult_t`.
#[rustfmt::skip]
pub mod result {
    pub const SUCCESS: u32 = 0; pub const UNHANDLED_CUDA_ERROR: u32 = 1;
    pub const SYSTEM_ERROR: u32 = 2; pub const INTERNAL_ERROR: u32 = 3;
    pub const INVALID_ARGUMENT: u32 = 4; pub const INVALID_USAGE: u32 = 5;
    pub const REMOTE_ERROR: u32 = 6; pub const IN_PROGRESS: u32 = 7; pub const TIMEOUT: u32 = 8;
    pub const NUM_RESULTS: u32 = 9;
}

/// `ncclGetErrorString`'s text for each `ncclResult_t`, as NVIDIA's library words it.
pub fn error_string(code: u32) -> &'static str {
    match code {
        result::SUCCESS => "no error",
        result::UNHANDLED_CUDA_ERROR => {
            "unhandled cuda error (run with NCCL_DEBUG=INFO for details)"
        }
        result::SYSTEM_ERROR => "unhandled system error (run with NCCL_DEBUG=INFO for details)",
        result::INTERNAL_ERROR => {
            "internal error - please report this issue to the NCCL developers"
        }
        result::INVALID_ARGUMENT => "invalid argument (run with NCCL_DEBUG=WARN for details)",
        result::INVALID_USAGE => "invalid usage (run with NCCL_DEBUG=WARN for details)",
        result::REMOTE_ERROR => "remote process exited or there was a network error",
        result::IN_PROGRESS => "NCCL operation in progress",
        result::TIMEOUT => "timeout",
        _ => "unknown result code",
    }
}

/// A C enum of nccl.h: the Rust enum, its values in order (`ALL`), their C names (`C_NAMES`),
/// and the value of a raw `int`.
macro_rules! c_enum {
    ($(#[$m:meta])* $name:ident { $($v:ident = $n:literal => $c:literal),* $(,)? }) => {
        $(#[$m])*
        #[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
        #[repr(i32)]
        pub enum $name {
            $($v = $n),*
        }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$v),*];
            pub const C_NAMES: &'static [&'static str] = &[$($c),*];

            pub fn from_raw(v: i32) -> Option<$name> {
                Self::ALL.iter().copied().find(|x| *x as i32 == v)
            }
        }
    };
}

c_enum!(
    /// `ncclDataType_t`.
    DataType {
        Int8 = 0 => "ncclInt8", Uint8 = 1 => "ncclUint8", Int32 = 2 => "ncclInt32",
        Uint32 = 3 => "ncclUint32", Int64 = 4 => "ncclInt64", Uint64 = 5 => "ncclUint64",
        Float16 = 6 => "ncclFloat16", Float32 = 7 => "ncclFloat32", Float64 = 8 => "ncclFloat64",
        Bfloat16 = 9 => "ncclBfloat16", Float8e4m3 = 10 => "ncclFloat8e4m3",
        Float8e5m2 = 11 => "ncclFloat8e5m2",
    }
);

/// `ncclNumTypes`.
pub const NUM_TYPES: i32 = 12;

impl DataType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::Int8 | DataType::Uint8 | DataType::Float8e4m3 | DataType::Float8e5m2 => 1,
            DataType::Float16 | DataType::Bfloat16 => 2,
            DataType::Int32 | DataType::Uint32 | DataType::Float32 => 4,
            DataType::Int64 | DataType::Uint64 | DataType::Float64 => 8,
        }
    }

    /// Whether the simulator reduces this type (every type moves; FP8 is not reduced).
    pub fn reducible(self) -> bool {
        !matches!(self, DataType::Float8e4m3 | DataType::Float8e5m2)
    }
}

c_enum!(
    /// `ncclRedOp_t`'s built-in operators.
    RedOp {
        Sum = 0 => "ncclSum", Prod = 1 => "ncclProd", Max = 2 => "ncclMax", Min = 3 => "ncclMin",
        Avg = 4 => "ncclAvg",
    }
);

/// `ncclNumOps`.
pub const NUM_OPS: i32 = 5;

/// What a collective or point-to-point call does.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    AlltoAll,
    Gather,
    Scatter,
    Send,
    Recv,
}

impl Kind {
    /// nccl.h's name of the call.
    pub fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "ncclAllReduce",
            Kind::Broadcast => "ncclBroadcast",
            Kind::Reduce => "ncclReduce",
            Kind::AllGather => "ncclAllGather",
            Kind::ReduceScatter => "ncclReduceScatter",
            Kind::AlltoAll => "ncclAlltoAll",
            Kind::Gather => "ncclGather",
            Kind::Scatter => "ncclScatter",
            Kind::Send => "ncclSend",
            Kind::Recv => "ncclRecv",
        }
    }

    pub fn is_p2p(self) -> bool {
        matches!(self, Kind::Send | Kind::Recv)
    }

    /// Whether it reduces (and so takes a `RedOp`).
    pub fn reduces(self) -> bool {
        matches!(self, Kind::AllReduce | Kind::Reduce | Kind::ReduceScatter)
    }

    /// Whether it has a root rank.
    pub fn rooted(self) -> bool {
        matches!(
            self,
            Kind::Broadcast | Kind::Reduce | Kind::Gather | Kind::Scatter
        )
    }

    /// (bytes read from `sendbuff`, bytes written to `recvbuff`) on rank `rank` of `nranks`
    /// for `count` elements of `size` bytes, as nccl.h defines each call's counts.
    pub fn extents(self, count: u64, size: u64, nranks: u64, rank: i32, root: i32) -> (u64, u64) {
        let one = count * size;
        let all = one * nranks;
        let at_root = |n: u64| if rank == root { n } else { 0 };
        match self {
            Kind::AllReduce => (one, one),
            Kind::Broadcast => (at_root(one), one),
            Kind::Reduce => (one, at_root(one)),
            Kind::AllGather => (one, all),
            Kind::ReduceScatter => (all, one),
            Kind::AlltoAll => (all, all),
            Kind::Gather => (one, at_root(all)),
            Kind::Scatter => (at_root(all), one),
            Kind::Send => (one, 0),
            Kind::Recv => (0, one),
        }
    }
}

/// One rank's part of a collective, or one side of a send/receive, as a library contributes it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Op {
    /// The daemon's communicator.
    pub comm: u64,
    /// The caller's rank in it.
    pub rank: i32,
    /// Collectives: the communicator's n-th collective of this rank. Send/receive: the n-th
    /// send from `rank` to `peer` (a receive: from `peer` to `rank`).
    pub seq: u64,
    pub kind: Kind,
    pub send: u64,
    pub recv: u64,
    pub count: u64,
    pub dtype: DataType,
    pub op: RedOp,
    /// The root of a rooted collective, the peer of a send or receive; 0 otherwise.
    pub peer: i32,
}

/// A library's request about communicators (`proto::Request::Nccl`).
#[derive(Serialize, Deserialize, Debug, Clone)]
pub enum Call {
    /// `ncclGetUniqueId`: answered `Answer::UniqueId`.
    UniqueId,
    /// `ncclCommInitRank`: returns when all `nranks` ranks joined id `id` (`Answer::Comm`).
    Init {
        id: Vec<u8>,
        nranks: i32,
        rank: i32,
        gpu: [u8; 16],
    },
    /// `ncclCommSplit`: returns when every rank of `comm` called its `seq`-th split
    /// (`Answer::Split`).
    Split {
        comm: u64,
        rank: i32,
        seq: u64,
        color: i32,
        key: i32,
    },
    /// A group of operations, contributed when the caller's streams reached them: returns
    /// when every one of them completed (`Answer::Done`).
    Run { ops: Vec<Op> },
    /// `ncclCommAbort`: the communicator's pending operations fail on every rank.
    Abort { comm: u64, rank: i32 },
    /// `ncclCommDestroy`: the rank leaves.
    Leave { comm: u64, rank: i32 },
}

/// The daemon's answer to a [`Call`] (`proto::Reply::Nccl`).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    UniqueId(Vec<u8>),
    Comm {
        comm: u64,
    },
    /// The new communicator, the caller's rank and the count of ranks in it; `None` for a rank
    /// that gave `NCCL_SPLIT_NOCOLOR`.
    Split(Option<(u64, i32, i32)>),
    Done,
}

/// Runs `$int!(T)` for an integer type and `$float!(T, to_f64, from_f64)` for a floating-point
/// one (FP8 is not reduced: nothing happens).
macro_rules! by_type {
    ($dtype:expr, $int:ident, $float:ident) => {
        match $dtype {
            DataType::Int8 => $int!(i8),
            DataType::Uint8 => $int!(u8),
            DataType::Int32 => $int!(i32),
            DataType::Uint32 => $int!(u32),
            DataType::Int64 => $int!(i64),
            DataType::Uint64 => $int!(u64),
            DataType::Float32 => $float!(f32, f64::from, |v: f64| v as f32),
            DataType::Float64 => $float!(f64, |v: f64| v, |v: f64| v),
            DataType::Float16 => $float!(u16, |v| half::f16::from_bits(v).to_f64(), |v| {
                half::f16::from_f64(v).to_bits()
            }),
            DataType::Bfloat16 => $float!(u16, |v| half::bf16::from_bits(v).to_f64(), |v| {
                half::bf16::from_f64(v).to_bits()
            }),
            DataType::Float8e4m3 | DataType::Float8e5m2 => {}
        }
    };
}

/// Element-wise `acc = acc (op) x` for `dtype` (Avg sums; [`finish_avg`] divides). Floating-point
/// values are combined in f64 and rounded once to their type.
pub fn reduce_into(dtype: DataType, op: RedOp, acc: &mut [u8], x: &[u8]) {
    macro_rules! ints {
        ($t:ty) => {{
            const N: usize = std::mem::size_of::<$t>();
            for (a, b) in acc.chunks_exact_mut(N).zip(x.chunks_exact(N)) {
                let l = <$t>::from_le_bytes(a.try_into().unwrap_or([0; N]));
                let r = <$t>::from_le_bytes(b.try_into().unwrap_or([0; N]));
                let v = match op {
                    RedOp::Sum | RedOp::Avg => l.wrapping_add(r),
                    RedOp::Prod => l.wrapping_mul(r),
                    RedOp::Max => l.max(r),
                    RedOp::Min => l.min(r),
                };
                a.copy_from_slice(&v.to_le_bytes());
            }
        }};
    }
    macro_rules! floats {
        ($t:ty, $to:expr, $from:expr) => {{
            const N: usize = std::mem::size_of::<$t>();
            for (a, b) in acc.chunks_exact_mut(N).zip(x.chunks_exact(N)) {
                let l = $to(<$t>::from_le_bytes(a.try_into().unwrap_or([0; N])));
                let r = $to(<$t>::from_le_bytes(b.try_into().unwrap_or([0; N])));
                let v = match op {
                    RedOp::Sum | RedOp::Avg => l + r,
                    RedOp::Prod => l * r,
                    RedOp::Max => l.max(r),
                    RedOp::Min => l.min(r),
                };
                a.copy_from_slice(&$from(v).to_le_bytes());
            }
        }};
    }
    by_type!(dtype, ints, floats)
}

/// `ncclAvg`'s last step: the sum of `n` ranks divided by `n`.
pub fn finish_avg(dtype: DataType, acc: &mut [u8], n: u64) {
    macro_rules! ints {
        ($t:ty) => {{
            const N: usize = std::mem::size_of::<$t>();
            let d = <$t>::try_from(n).unwrap_or(<$t>::MAX);
            for a in acc.chunks_exact_mut(N) {
                let v = <$t>::from_le_bytes(a.try_into().unwrap_or([0; N]));
                a.copy_from_slice(&(v / d).to_le_bytes());
            }
        }};
    }
    macro_rules! floats {
        ($t:ty, $to:expr, $from:expr) => {{
            const N: usize = std::mem::size_of::<$t>();
            for a in acc.chunks_exact_mut(N) {
                let v = $to(<$t>::from_le_bytes(a.try_into().unwrap_or([0; N])));
                a.copy_from_slice(&$from(v / n as f64).to_le_bytes());
            }
        }};
    }
    by_type!(dtype, ints, floats)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
        v.iter().flat_map(|x| f(*x)).collect()
    }

    #[test]
    fn version_code_follows_nccl_h() {
        assert_eq!(version_code(2, 32, 6), 23206);
        assert_eq!(version_code(2, 8, 4), 2804);
        assert_eq!(version_code(2, 9, 6), 20906);
    }

    #[test]
    fn reductions_of_each_kind_of_type() {
        let mut a = bytes(&[1i32, -5, 7], i32::to_le_bytes);
        reduce_into(
            DataType::Int32,
            RedOp::Sum,
            &mut a,
            &bytes(&[2i32, 5, -9], i32::to_le_bytes),
        );
        assert_eq!(a, bytes(&[3i32, 0, -2], i32::to_le_bytes));
        let mut f = bytes(&[1.5f32, 2.0], f32::to_le_bytes);
        reduce_into(
            DataType::Float32,
            RedOp::Max,
            &mut f,
            &bytes(&[0.5f32, 4.0], f32::to_le_bytes),
        );
        assert_eq!(f, bytes(&[1.5f32, 4.0], f32::to_le_bytes));
        let h = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
        let mut x = [h(1.0), h(3.0)].concat();
        reduce_into(
            DataType::Float16,
            RedOp::Prod,
            &mut x,
            &[h(2.0), h(0.5)].concat(),
        );
        assert_eq!(x, [h(2.0), h(1.5)].concat());
        let mut avg = bytes(&[6u64, 9], u64::to_le_bytes);
        finish_avg(DataType::Uint64, &mut avg, 3);
        assert_eq!(avg, bytes(&[2u64, 3], u64::to_le_bytes));
    }

    #[test]
    fn extents_follow_the_counts_of_nccl_h() {
        assert_eq!(Kind::AllGather.extents(4, 4, 3, 1, 0), (16, 48));
        assert_eq!(Kind::ReduceScatter.extents(4, 4, 3, 1, 0), (48, 16));
        assert_eq!(Kind::Broadcast.extents(4, 2, 3, 1, 0), (0, 8));
        assert_eq!(Kind::Broadcast.extents(4, 2, 3, 0, 0), (8, 8));
        assert_eq!(Kind::Reduce.extents(4, 2, 3, 1, 0), (8, 0));
    }
}
