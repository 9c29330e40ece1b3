//! NCCL's C types as nccl.h (2.32) declares them, for the exported functions' signatures.

#![allow(non_camel_case_types, non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `ncclResult_t`. An `int` on the wire; kept as one so that a code this crate does not know
/// passes through unchanged.
pub type ncclResult_t = c_int;
pub const NCCL_SUCCESS: ncclResult_t = 0;
pub const NCCL_UNHANDLED_CUDA_ERROR: ncclResult_t = 1;
pub const NCCL_SYSTEM_ERROR: ncclResult_t = 2;
pub const NCCL_INTERNAL_ERROR: ncclResult_t = 3;
pub const NCCL_INVALID_ARGUMENT: ncclResult_t = 4;
pub const NCCL_INVALID_USAGE: ncclResult_t = 5;
pub const NCCL_REMOTE_ERROR: ncclResult_t = 6;
pub const NCCL_IN_PROGRESS: ncclResult_t = 7;
pub const NCCL_TIMEOUT: ncclResult_t = 8;

/// nccl.h's names of the result codes, by code.
const RESULT_NAMES: [&str; 9] = [
    "ncclSuccess",
    "ncclUnhandledCudaError",
    "ncclSystemError",
    "ncclInternalError",
    "ncclInvalidArgument",
    "ncclInvalidUsage",
    "ncclRemoteError",
    "ncclInProgress",
    "ncclTimeout",
];

/// nccl.h's name of a result code.
pub fn result_name(r: ncclResult_t) -> &'static str {
    usize::try_from(r)
        .ok()
        .and_then(|i| RESULT_NAMES.get(i).copied())
        .unwrap_or("unknown ncclResult_t")
}

/// `ncclComm_t`: a pointer to an opaque struct.
pub type ncclComm_t = *mut c_void;
/// `ncclDataType_t` and `ncclRedOp_t`: C enums, `int`-sized.
pub type ncclDataType_t = c_int;
pub type ncclRedOp_t = c_int;
/// `cudaStream_t` (= `CUstream`).
pub type cudaStream_t = *mut c_void;

pub const NCCL_UNIQUE_ID_BYTES: usize = 128;
pub const NCCL_SPLIT_NOCOLOR: c_int = -1;
pub const NCCL_API_MAGIC: c_uint = 0xcafe_beef;
pub const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// `NCCL_SUSPEND_MEM`: ncclCommSuspend releases the communicator's dynamic allocations.
pub const NCCL_SUSPEND_MEM: c_int = 0x01;

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    pub internal: [c_char; NCCL_UNIQUE_ID_BYTES],
}

impl ncclUniqueId {
    pub fn from_bytes(b: &[u8; NCCL_UNIQUE_ID_BYTES]) -> ncclUniqueId {
        ncclUniqueId {
            internal: b.map(|x| x as c_char),
        }
    }
    pub fn bytes(&self) -> [u8; NCCL_UNIQUE_ID_BYTES] {
        self.internal.map(|x| x as u8)
    }
}

/// `ncclConfig_t` (`struct ncclConfig_v23100`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclConfig_t {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub blocking: c_int,
    pub cgaClusterSize: c_int,
    pub minCTAs: c_int,
    pub maxCTAs: c_int,
    pub netName: *const c_char,
    pub splitShare: c_int,
    pub trafficClass: c_int,
    pub commName: *const c_char,
    pub collnetEnable: c_int,
    pub CTAPolicy: c_int,
    pub shrinkShare: c_int,
    pub nvlsCTAs: c_int,
    pub nChannelsPerNetPeer: c_int,
    pub nvlinkCentricSched: c_int,
    pub graphUsageMode: c_int,
    pub numRmaCtx: c_int,
    pub maxP2pPeers: c_int,
    pub graphStreamOrdering: c_int,
    pub launchOrderImplicit: c_int,
    pub numRmaSig: c_int,
    pub rmaEagerInit: c_int,
    pub hostCftMode: c_int,
    pub nvlsHostMode: c_int,
}

/// `NCCL_VERSION_CODE` of the nccl.h this crate follows (2.32.6).
pub const NCCL_VERSION_CODE: c_uint = 23206;

impl ncclConfig_t {
    /// `NCCL_CONFIG_INITIALIZER`.
    pub fn initializer() -> ncclConfig_t {
        let u = NCCL_CONFIG_UNDEF_INT;
        ncclConfig_t {
            size: std::mem::size_of::<ncclConfig_t>(),
            magic: NCCL_API_MAGIC,
            version: NCCL_VERSION_CODE,
            blocking: u,
            cgaClusterSize: u,
            minCTAs: u,
            maxCTAs: u,
            netName: std::ptr::null(),
            splitShare: u,
            trafficClass: u,
            commName: std::ptr::null(),
            collnetEnable: u,
            CTAPolicy: u,
            shrinkShare: u,
            nvlsCTAs: u,
            nChannelsPerNetPeer: u,
            nvlinkCentricSched: u,
            graphUsageMode: u,
            numRmaCtx: u,
            maxP2pPeers: u,
            graphStreamOrdering: u,
            launchOrderImplicit: u,
            numRmaSig: u,
            rmaEagerInit: u,
            hostCftMode: u,
            nvlsHostMode: u,
        }
    }
}

/// `ncclCommInitRankConfig`.
pub type InitRankConfigFn = unsafe extern "C" fn(
    *mut ncclComm_t,
    c_int,
    ncclUniqueId,
    c_int,
    *mut ncclConfig_t,
) -> ncclResult_t;
/// `ncclCommInitRank`.
pub type InitRankFn =
    unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> ncclResult_t;
/// `ncclCommSplit`.
pub type SplitFn = unsafe extern "C" fn(
    ncclComm_t,
    c_int,
    c_int,
    *mut ncclComm_t,
    *mut ncclConfig_t,
) -> ncclResult_t;
/// `ncclCommDestroy`, `ncclCommResume` and the others of one communicator.
pub type CommFn = unsafe extern "C" fn(ncclComm_t) -> ncclResult_t;
