//! The layer's C types against NVIDIA's nccl.h (the wheel's, in the test stack): a C program
//! compiled against it prints sizes, offsets and constants, and they must equal this crate's.

use std::mem::{offset_of, size_of};
use std::process::Command;

use crate::ffi::*;

#[path = "../tests/common/stack.rs"]
mod stack;

macro_rules! fields {
    ($($f:ident),*) => {
        vec![$((stringify!($f), offset_of!(ncclConfig_t, $f))),*]
    };
}

#[test]
fn types_and_constants_match_nccl_h() {
    #[rustfmt::skip]
    let fields = fields!(
        size, magic, version, blocking, cgaClusterSize, minCTAs, maxCTAs, netName, splitShare,
        trafficClass, commName, collnetEnable, CTAPolicy, shrinkShare, nvlsCTAs,
        nChannelsPerNetPeer, nvlinkCentricSched, graphUsageMode, numRmaCtx, maxP2pPeers,
        graphStreamOrdering, launchOrderImplicit, numRmaSig, rmaEagerInit, hostCftMode,
        nvlsHostMode
    );
    let mut ours = vec![
        format!("sizeof(ncclConfig_t) {}", size_of::<ncclConfig_t>()),
        format!("sizeof(ncclUniqueId) {}", size_of::<ncclUniqueId>()),
        format!("sizeof(ncclResult_t) {}", size_of::<ncclResult_t>()),
        format!("sizeof(ncclDataType_t) {}", size_of::<ncclDataType_t>()),
        format!("sizeof(ncclRedOp_t) {}", size_of::<ncclRedOp_t>()),
        format!("NCCL_VERSION_CODE {NCCL_VERSION_CODE}"),
        format!("NCCL_API_MAGIC {NCCL_API_MAGIC}"),
        format!("NCCL_SPLIT_NOCOLOR {NCCL_SPLIT_NOCOLOR}"),
        format!("NCCL_SUSPEND_MEM {NCCL_SUSPEND_MEM}"),
        format!("NCCL_CONFIG_UNDEF_INT {NCCL_CONFIG_UNDEF_INT}"),
    ];
    for (name, code) in [
        ("ncclSuccess", NCCL_SUCCESS),
        ("ncclUnhandledCudaError", NCCL_UNHANDLED_CUDA_ERROR),
        ("ncclSystemError", NCCL_SYSTEM_ERROR),
        ("ncclInternalError", NCCL_INTERNAL_ERROR),
        ("ncclInvalidArgument", NCCL_INVALID_ARGUMENT),
        ("ncclInvalidUsage", NCCL_INVALID_USAGE),
        ("ncclRemoteError", NCCL_REMOTE_ERROR),
        ("ncclInProgress", NCCL_IN_PROGRESS),
        ("ncclTimeout", NCCL_TIMEOUT),
    ] {
        assert_eq!(result_name(code), name);
        ours.push(format!("{name} {code}"));
    }
    ours.extend(fields.iter().map(|(f, o)| format!("offsetof({f}) {o}")));

    let mut c = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <nccl.h>\nint main(void) {\n",
    );
    for line in &ours {
        let (expr, _) = line.rsplit_once(' ').unwrap();
        let expr = match expr.strip_prefix("offsetof(") {
            Some(f) => format!("offsetof(ncclConfig_t, {}", f),
            None => expr.to_string(),
        };
        let fmt = if expr.starts_with("sizeof") || expr.starts_with("offsetof") {
            "%zu"
        } else if expr == "NCCL_API_MAGIC" || expr == "NCCL_VERSION_CODE" {
            "%u"
        } else {
            "%d"
        };
        let cast = if fmt == "%u" { "(unsigned)" } else { "" };
        c.push_str(&format!(
            "  printf(\"{} {fmt}\\n\", {cast}({expr}));\n",
            line.rsplit_once(' ').unwrap().0
        ));
    }
    c.push_str("  return 0;\n}\n");

    let dir = tempfile::tempdir().unwrap();
    // nccl.h includes the CUDA runtime's headers for cudaStream_t and cudaEvent_t only.
    let stub = dir.path().join("stub");
    std::fs::create_dir(&stub).unwrap();
    let runtime = "#define CUDART_VERSION 10000\n\
                   typedef struct CUstream_st *cudaStream_t;\n\
                   typedef struct CUevent_st *cudaEvent_t;\n";
    for (header, text) in [("cuda_runtime.h", runtime), ("cuda_fp16.h", "")] {
        std::fs::write(stub.join(header), text).unwrap();
    }
    let src = dir.path().join("abi.c");
    std::fs::write(&src, c).unwrap();
    let exe = dir.path().join("abi");
    stack::run_ok(
        Command::new("cc")
            .arg("-I")
            .arg(&stub)
            .arg("-I")
            .arg(stack::wheel_dir("include", "nccl.h"))
            .arg(&src)
            .arg("-o")
            .arg(&exe),
    );
    let theirs: Vec<String> = stack::run_ok(&mut Command::new(&exe))
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(ours, theirs);
}
