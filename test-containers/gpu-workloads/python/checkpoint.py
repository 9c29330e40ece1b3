"""The whole checkpoint API through cuda-bindings, on another process that uses the device.

usage: checkpoint.py --pid PID [--mode plain|custom|refused] [--swap]

  plain    lock, checkpoint, restore (onto swapped GPUs with --swap), unlock; the state after
           each step.
  custom   CUDA 13.4 custom storage: the target's device memory is mapped into this process, copied
           out to host storage here, cuCheckpointOperationComplete; then a custom-storage restore
           copies it back in, cuCheckpointOperationComplete, unlock. The refusals on the way: no
           primary context (CUDA_ERROR_INVALID_CONTEXT), this process itself, a plain restore of a
           custom checkpoint (CUDA_ERROR_INVALID_VALUE).
  refused  a CUDA version without custom storage: a non-NULL customStorageInfo_out is refused
           (CUDA_ERROR_INVALID_VALUE), cuCheckpointOperationComplete is not reachable; then plain.

Prints one JSON object per step: {"step", "result", "state", ...}; exits 1 on anything unexpected.
"""

import argparse
import ctypes
import hashlib
import os

from cuda.bindings import driver as cu

from common import emit, fail, name, ok

S = cu.CUprocessState
R = cu.CUresult


def state(pid):
    return name(ok(cu.cuCheckpointProcessGetState(pid), "cuCheckpointProcessGetState"))


def step(label, result, pid, want_result="CUDA_SUCCESS", want_state=None, **extra):
    err = result[0] if isinstance(result, tuple) else result
    st = state(pid)
    emit(step=label, result=name(err), state=st, **extra)
    if name(err) != want_result:
        fail(f"{label}: {name(err)}, expected {want_result}")
    if want_state is not None and st != want_state:
        fail(f"{label}: state {st}, expected {want_state}")
    return result


def lock_args(timeout_ms):
    a = cu.CUcheckpointLockArgs()
    a.timeoutMs = timeout_ms
    return a


def put_uuid(dst, raw):
    ctypes.memmove(dst.getPtr(), bytes(raw), 16)


def restore_args(pairs=None):
    a = cu.CUcheckpointRestoreArgs()
    if pairs:
        objs = []
        for old, new in pairs:
            p = cu.CUcheckpointGpuPair()
            put_uuid(p.oldUuid, old)
            put_uuid(p.newUuid, new)
            objs.append(p)
        a.gpuPairs = objs
        a.gpuPairsCount = len(objs)
    return a


class Out:
    """The `CUcheckpointCustomStorageInfo *` slot that customStorageInfo_out points at."""

    def __init__(self):
        self.slot = ctypes.c_uint64(0)

    @property
    def addr(self):
        return ctypes.addressof(self.slot)

    def info(self):
        """The driver's struct, read twice: raw (handle @0, perDeviceData @8, deviceCount @16,
        each entry {devPtr @0, size @8, stream @16}, 24 bytes) and through cuda-bindings."""
        p = self.slot.value
        if not p:
            fail("customStorageInfo_out was not set")
        handle, per, count = ctypes.c_uint64.from_address(p).value, ctypes.c_uint64.from_address(p + 8).value, ctypes.c_uint32.from_address(p + 16).value
        raw = []
        for i in range(count):
            e = per + 24 * i
            raw.append(
                (ctypes.c_uint64.from_address(e).value, ctypes.c_uint64.from_address(e + 8).value, ctypes.c_uint64.from_address(e + 16).value)
            )
        b = cu.CUcheckpointCustomStorageInfo(_ptr=p)
        # cuda-bindings 13.5 lists perDeviceData only for arrays assigned from Python (a
        # driver-filled struct shows []), so each entry is viewed through its own struct.
        entries = [cu.CUcheckpointCustomStoragePerDeviceData(_ptr=per + 24 * i) for i in range(count)]
        seen = [(int(d.devPtr), int(d.size), int(d.stream)) for d in entries]
        if int(b.deviceCount) != count or int(b.handle) != handle or seen != raw:
            fail("cuda-bindings reads CUcheckpointCustomStorageInfo differently", raw=raw, bindings=seen)
        return b.handle, raw


def gpus():
    out = []
    for i in range(ok(cu.cuDeviceGetCount(), "cuDeviceGetCount")):
        dev = ok(cu.cuDeviceGet(i), "cuDeviceGet")
        out.append((dev, ok(cu.cuDeviceGetUuid(dev), "cuDeviceGetUuid").bytes))
    return out


def plain_cycle(pid, swap):
    step("lock", cu.cuCheckpointProcessLock(pid, lock_args(10000)), pid, want_state="CU_PROCESS_STATE_LOCKED")
    step("checkpoint", cu.cuCheckpointProcessCheckpoint(pid, cu.CUcheckpointCheckpointArgs()), pid, want_state="CU_PROCESS_STATE_CHECKPOINTED")
    pairs = None
    if swap:
        u = [g[1] for g in gpus()]
        pairs = [(u[0], u[1]), (u[1], u[0])]
    step("restore", cu.cuCheckpointProcessRestore(pid, restore_args(pairs)), pid, want_state="CU_PROCESS_STATE_LOCKED", swapped=bool(pairs))
    step("unlock", cu.cuCheckpointProcessUnlock(pid, cu.CUcheckpointUnlockArgs()), pid, want_state="CU_PROCESS_STATE_RUNNING")


def custom_cycle(pid, swap):
    devs = gpus()
    step("lock", cu.cuCheckpointProcessLock(pid, lock_args(10000)), pid, want_state="CU_PROCESS_STATE_LOCKED")

    # Without a retained primary context on the target's GPUs: refused.
    out = Out()
    args = cu.CUcheckpointCheckpointArgs()
    args.customStorageInfo_out = out.addr
    step("checkpoint_without_context", cu.cuCheckpointProcessCheckpoint(pid, args), pid, "CUDA_ERROR_INVALID_CONTEXT", "CU_PROCESS_STATE_LOCKED")

    ctxs = [ok(cu.cuDevicePrimaryCtxRetain(d), "cuDevicePrimaryCtxRetain") for d, _ in devs]
    ok(cu.cuCtxSetCurrent(ctxs[0]), "cuCtxSetCurrent")

    # A process cannot custom-store itself.
    step("checkpoint_self", cu.cuCheckpointProcessCheckpoint(os.getpid(), args), pid, "CUDA_ERROR_INVALID_VALUE", "CU_PROCESS_STATE_LOCKED")

    step("checkpoint", cu.cuCheckpointProcessCheckpoint(pid, args), pid, want_state="CU_PROCESS_STATE_CHECKPOINTING")
    handle, ranges = out.info()
    storage = []
    for devptr, size, stream in ranges:
        buf = bytearray(size)
        ok(cu.cuMemcpyDtoHAsync(buf, devptr, size, cu.CUstream(stream)), "cuMemcpyDtoHAsync")
        storage.append(bytes(buf))
    emit(step="copy_out", ranges=[{"size": s, "sha256": hashlib.sha256(b).hexdigest()} for (_, s, _), b in zip(ranges, storage)], bytes=sum(map(len, storage)))
    step("complete_checkpoint", cu.cuCheckpointOperationComplete(handle), pid, want_state="CU_PROCESS_STATE_CHECKPOINTED")
    # The ranges are gone with the operation.
    err = cu.cuMemcpyDtoH(bytearray(16), ranges[0][0], 16)[0] if ranges else R.CUDA_ERROR_INVALID_VALUE
    emit(step="range_after_complete", result=name(err))
    if name(err) == "CUDA_SUCCESS":
        fail("a checkpoint range is still mapped after cuCheckpointOperationComplete")
    err = cu.cuCheckpointOperationComplete(handle)[0]
    emit(step="complete_twice", result=name(err))
    if name(err) == "CUDA_SUCCESS":
        fail("cuCheckpointOperationComplete accepted a completed handle")

    pairs = None
    if swap:
        u = [g[1] for g in devs]
        pairs = [(u[0], u[1]), (u[1], u[0])]
    # A plain restore of a custom-storage checkpoint: the process holds no copy.
    step("restore_plain", cu.cuCheckpointProcessRestore(pid, restore_args(pairs)), pid, "CUDA_ERROR_INVALID_VALUE", "CU_PROCESS_STATE_CHECKPOINTED")

    rout = Out()
    rargs = restore_args(pairs)
    rargs.customStorageInfo_out = rout.addr
    step("restore", cu.cuCheckpointProcessRestore(pid, rargs), pid, want_state="CU_PROCESS_STATE_RESTORING", swapped=bool(pairs))
    rhandle, rranges = rout.info()
    if [r[1] for r in rranges] != [r[1] for r in ranges]:
        fail("the restore ranges differ from the checkpoint's", checkpoint=[r[1] for r in ranges], restore=[r[1] for r in rranges])
    for (devptr, size, stream), data in zip(rranges, storage):
        ok(cu.cuMemcpyHtoDAsync(devptr, data, size, cu.CUstream(stream)), "cuMemcpyHtoDAsync")
    # Read back what this process wrote into the mapping.
    for (devptr, size, _), data in zip(rranges, storage):
        back = bytearray(size)
        ok(cu.cuMemcpyDtoH(back, devptr, size), "cuMemcpyDtoH")
        if bytes(back) != data:
            fail("the restore mapping does not hold what was copied in")
    emit(step="copy_in", bytes=sum(map(len, storage)))
    step("complete_restore", cu.cuCheckpointOperationComplete(rhandle), pid, want_state="CU_PROCESS_STATE_LOCKED")
    step("unlock", cu.cuCheckpointProcessUnlock(pid, cu.CUcheckpointUnlockArgs()), pid, want_state="CU_PROCESS_STATE_RUNNING")
    for d, _ in devs:
        ok(cu.cuDevicePrimaryCtxRelease(d), "cuDevicePrimaryCtxRelease")


def refused_cycle(pid, version):
    step("lock", cu.cuCheckpointProcessLock(pid, lock_args(10000)), pid, want_state="CU_PROCESS_STATE_LOCKED")
    out = Out()
    args = cu.CUcheckpointCheckpointArgs()
    args.customStorageInfo_out = out.addr
    step("checkpoint_custom", cu.cuCheckpointProcessCheckpoint(pid, args), pid, "CUDA_ERROR_INVALID_VALUE", "CU_PROCESS_STATE_LOCKED")
    if out.slot.value:
        fail("customStorageInfo_out was written although refused")
    err, fn, status = cu.cuGetProcAddress(b"cuCheckpointOperationComplete", version, 0)
    emit(step="proc_address_complete", result=name(err), status=name(status), found=int(fn) != 0)
    if int(fn) != 0 or name(status) == "CU_GET_PROC_ADDRESS_SUCCESS":
        fail("cuCheckpointOperationComplete is reachable on a CUDA version without custom storage")
    step("checkpoint", cu.cuCheckpointProcessCheckpoint(pid, cu.CUcheckpointCheckpointArgs()), pid, want_state="CU_PROCESS_STATE_CHECKPOINTED")
    step("restore", cu.cuCheckpointProcessRestore(pid, restore_args()), pid, want_state="CU_PROCESS_STATE_LOCKED")
    step("unlock", cu.cuCheckpointProcessUnlock(pid, cu.CUcheckpointUnlockArgs()), pid, want_state="CU_PROCESS_STATE_RUNNING")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--mode", choices=["plain", "custom", "refused"], default="plain")
    ap.add_argument("--swap", action="store_true")
    a = ap.parse_args()
    ok(cu.cuInit(0), "cuInit")
    version = ok(cu.cuDriverGetVersion(), "cuDriverGetVersion")
    tid = ok(cu.cuCheckpointProcessGetRestoreThreadId(a.pid), "cuCheckpointProcessGetRestoreThreadId")
    emit(step="restore_thread", tid=tid, in_target=os.path.isdir(f"/proc/{a.pid}/task/{tid}"), version=version)
    if not os.path.isdir(f"/proc/{a.pid}/task/{tid}"):
        fail(f"restore thread {tid} is not a thread of process {a.pid}")
    st = state(a.pid)
    emit(step="initial", state=st)
    if st != "CU_PROCESS_STATE_RUNNING":
        fail(f"initial state {st}")
    if a.mode == "plain":
        plain_cycle(a.pid, a.swap)
    elif a.mode == "custom":
        custom_cycle(a.pid, a.swap)
    else:
        refused_cycle(a.pid, version)
    emit(done=True)


if __name__ == "__main__":
    main()
