"""cuGetProcAddress of the simulated libcuda.so.1 itself, through ctypes (no bindings in between).

usage: procaddr.py --exports NAME,NAME,...   (the library's exported cu* symbols, from nm -D)

Checks, on the node the environment names (its CUDA version must be 13040 or later):
  - one symbol at two versions gives the two ABIs (cuDeviceGetUuid at 9020 and 11040, ...);
  - the per-thread-default-stream flag gives the _ptds/_ptsz variant, the legacy flag the plain one;
  - an unknown symbol: CUDA_SUCCESS, pfn NULL, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  - a version older than the symbol: CUDA_SUCCESS, pfn NULL, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
  - a version beyond the driver's: CUDA_ERROR_INVALID_VALUE, pfn NULL, VERSION_NOT_SUFFICIENT;
  - every exported cu* symbol is what cuGetProcAddress gives for its base name at some version.
Prints one JSON object per check and {"done": true}; exits 1 on the first failure.
"""

import argparse
import ctypes
import re

from common import emit, fail

SUCCESS, NOT_FOUND, NOT_SUFFICIENT = 0, 1, 2
DEFAULT, LEGACY, PER_THREAD = 0, 1, 2
CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE = 0, 1

lib = ctypes.CDLL("libcuda.so.1")
gpa2 = lib.cuGetProcAddress_v2
gpa2.restype = ctypes.c_int
gpa2.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
gpa1 = lib.cuGetProcAddress
gpa1.restype = ctypes.c_int
gpa1.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64]


def addr(export):
    return ctypes.cast(getattr(lib, export), ctypes.c_void_p).value


def query(symbol, version, flags=DEFAULT):
    pfn = ctypes.c_void_p(0xDEAD)
    status = ctypes.c_int(-1)
    rc = gpa2(symbol.encode(), ctypes.byref(pfn), version, flags, ctypes.byref(status))
    return rc, pfn.value, status.value


def expect(label, got, want):
    emit(check=label, got=list(got), want=list(want))
    if tuple(got) != tuple(want):
        fail(f"{label}: got {got}, expected {want}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--exports", required=True)
    a = ap.parse_args()
    exports = [e for e in a.exports.split(",") if e]

    # Before cuInit, as the real driver allows.
    expect("before cuInit", query("cuInit", 2000), (CUDA_SUCCESS, addr("cuInit"), SUCCESS))

    if lib.cuInit(0) != 0:
        fail("cuInit failed")
    v = ctypes.c_int(0)
    lib.cuDriverGetVersion(ctypes.byref(v))
    driver = v.value
    emit(driver_version=driver)
    if driver < 13040:
        fail("procaddr.py needs a node configured with CUDA 13.4 or later")

    # One symbol, two versions, two ABIs.
    u1, u2 = query("cuDeviceGetUuid", 9020), query("cuDeviceGetUuid", 11040)
    expect("cuDeviceGetUuid@9020", u1, (CUDA_SUCCESS, addr("cuDeviceGetUuid"), SUCCESS))
    expect("cuDeviceGetUuid@11040", u2, (CUDA_SUCCESS, addr("cuDeviceGetUuid_v2"), SUCCESS))
    if u1[1] == u2[1]:
        fail("cuDeviceGetUuid at 9020 and 11040 gave the same entry point")
    expect("cuDeviceTotalMem@3020", query("cuDeviceTotalMem", 3020), (CUDA_SUCCESS, addr("cuDeviceTotalMem_v2"), SUCCESS))
    expect("cuDevicePrimaryCtxRelease@7000", query("cuDevicePrimaryCtxRelease", 7000), (CUDA_SUCCESS, addr("cuDevicePrimaryCtxRelease"), SUCCESS))
    expect("cuDevicePrimaryCtxRelease@11000", query("cuDevicePrimaryCtxRelease", 11000), (CUDA_SUCCESS, addr("cuDevicePrimaryCtxRelease_v2"), SUCCESS))
    expect("cuCtxCreate@3020", query("cuCtxCreate", 3020), (CUDA_SUCCESS, addr("cuCtxCreate_v2"), SUCCESS))
    expect("cuCtxCreate@11040", query("cuCtxCreate", 11040), (CUDA_SUCCESS, addr("cuCtxCreate_v3"), SUCCESS))
    expect("cuCtxCreate@12050", query("cuCtxCreate", 12050), (CUDA_SUCCESS, addr("cuCtxCreate_v4"), SUCCESS))
    expect("cuGetProcAddress@12000", query("cuGetProcAddress", 12000), (CUDA_SUCCESS, addr("cuGetProcAddress_v2"), SUCCESS))

    # Stream flavours.
    expect("cuMemcpyHtoD@3020 default", query("cuMemcpyHtoD", 3020, DEFAULT), (CUDA_SUCCESS, addr("cuMemcpyHtoD_v2"), SUCCESS))
    expect("cuMemcpyHtoD@3020 legacy", query("cuMemcpyHtoD", 3020, LEGACY), (CUDA_SUCCESS, addr("cuMemcpyHtoD_v2"), SUCCESS))
    expect("cuMemcpyHtoD@7000 per-thread", query("cuMemcpyHtoD", 7000, PER_THREAD), (CUDA_SUCCESS, addr("cuMemcpyHtoD_v2_ptds"), SUCCESS))
    expect("cuLaunchKernel@7000 per-thread", query("cuLaunchKernel", 7000, PER_THREAD), (CUDA_SUCCESS, addr("cuLaunchKernel_ptsz"), SUCCESS))
    expect("cuInit per-thread", query("cuInit", 2000, PER_THREAD), (CUDA_SUCCESS, addr("cuInit"), SUCCESS))
    expect("unknown flags", query("cuInit", 2000, 4)[:1], (CUDA_ERROR_INVALID_VALUE,))

    # Not found, too old, too new.
    expect("unknown symbol", query("cuNoSuchEntryPoint", 12000), (CUDA_SUCCESS, None, NOT_FOUND))
    expect("not simulated", query("cuGraphCreate", 12000), (CUDA_SUCCESS, None, NOT_FOUND))
    expect("older than the symbol", query("cuCheckpointProcessLock", 12000), (CUDA_SUCCESS, None, NOT_SUFFICIENT))
    expect("cuCheckpointOperationComplete@13040", query("cuCheckpointOperationComplete", 13040), (CUDA_SUCCESS, addr("cuCheckpointOperationComplete"), SUCCESS))
    expect("older than custom storage", query("cuCheckpointOperationComplete", 13030), (CUDA_SUCCESS, None, NOT_SUFFICIENT))
    expect("beyond the driver", query("cuInit", driver + 10), (CUDA_ERROR_INVALID_VALUE, None, NOT_SUFFICIENT))

    # cuGetProcAddress (v1, without symbolStatus).
    pfn = ctypes.c_void_p(0)
    rc = gpa1(b"cuDeviceGetUuid", ctypes.byref(pfn), 11040, DEFAULT)
    expect("cuGetProcAddress v1", (rc, pfn.value), (CUDA_SUCCESS, addr("cuDeviceGetUuid_v2")))

    # Everything exported is reachable.
    versions = sorted({1000 * major + 10 * minor for major in range(2, 14) for minor in range(10)} | {driver})
    versions = [x for x in versions if x <= driver]
    unreachable = []
    for e in exports:
        flags = PER_THREAD if re.search(r"_pt(ds|sz)$", e) else DEFAULT
        base = re.sub(r"(_v\d+)?(_pt(ds|sz))?$", "", e)
        want = addr(e)
        if not any(query(base, ver, flags)[1] == want for ver in versions):
            unreachable.append(e)
    emit(check="every export reachable", exports=len(exports), unreachable=unreachable)
    if unreachable:
        fail(f"exported but not reachable through cuGetProcAddress: {unreachable}")
    emit(done=True)


if __name__ == "__main__":
    main()
