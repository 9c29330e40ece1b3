"""cuda-bindings on the simulated driver: cuInit, the devices, a primary context, memory.

Prints `{"cuda_version": ...}`, one `{"device": i, ...}` per GPU, then `{"memory": ...}` and
`{"done": true}`."""

import os

from cuda.bindings import driver as cu

from common import emit, fail, name, ok, uuid_str

ok(cu.cuInit(0), "cuInit")
version = ok(cu.cuDriverGetVersion(), "cuDriverGetVersion")
count = ok(cu.cuDeviceGetCount(), "cuDeviceGetCount")
emit(cuda_version=version, count=count, bindings=__import__("cuda.bindings").bindings.__version__)

for i in range(count):
    dev = ok(cu.cuDeviceGet(i), "cuDeviceGet")
    raw_name = ok(cu.cuDeviceGetName(256, dev), "cuDeviceGetName")
    uuid = ok(cu.cuDeviceGetUuid(dev), "cuDeviceGetUuid")
    total = ok(cu.cuDeviceTotalMem(dev), "cuDeviceTotalMem")
    pci = ok(cu.cuDeviceGetPCIBusId(64, dev), "cuDeviceGetPCIBusId")
    major = ok(
        cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
        "cuDeviceGetAttribute",
    )
    emit(
        device=i,
        name=raw_name.split(b"\0", 1)[0].decode(),
        uuid=uuid_str(uuid.bytes),
        total=total,
        pci=pci.split(b"\0", 1)[0].decode(),
        cc_major=major,
    )

# A primary context on GPU 0, current on this thread.
dev = ok(cu.cuDeviceGet(0), "cuDeviceGet")
ctx = ok(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
flags, active = ok(cu.cuDevicePrimaryCtxGetState(dev), "cuDevicePrimaryCtxGetState")
if active != 1:
    fail(f"primary context not active: {active}")

free0, total0 = ok(cu.cuMemGetInfo(), "cuMemGetInfo")
size = 3 << 20
ptr = ok(cu.cuMemAlloc(size), "cuMemAlloc")
free1, total1 = ok(cu.cuMemGetInfo(), "cuMemGetInfo")

# Host to device and back.
data = os.urandom(size)
ok(cu.cuMemcpyHtoD(ptr, data, size), "cuMemcpyHtoD")
back = bytearray(size)
ok(cu.cuMemcpyDtoH(back, ptr, size), "cuMemcpyDtoH")
if bytes(back) != data:
    fail("cuMemcpyDtoH did not return what cuMemcpyHtoD wrote")

# Device to device, and a memset over part of the copy.
ptr2 = ok(cu.cuMemAlloc(size), "cuMemAlloc")
ok(cu.cuMemcpyDtoD(ptr2, ptr, size), "cuMemcpyDtoD")
ok(cu.cuMemsetD8(ptr2, 0xAB, 4096), "cuMemsetD8")
ok(cu.cuMemsetD32(int(ptr2) + 4096, 0x01020304, 1024), "cuMemsetD32")
back2 = bytearray(size)
ok(cu.cuMemcpyDtoH(back2, ptr2, size), "cuMemcpyDtoH")
want = b"\xab" * 4096 + bytes.fromhex("04030201") * 1024 + data[8192:]
if bytes(back2) != want:
    fail("cuMemcpyDtoD/cuMemsetD8/cuMemsetD32 gave the wrong bytes")

# The same through a stream.
stream = ok(cu.cuStreamCreate(0), "cuStreamCreate")
ok(cu.cuMemsetD8Async(ptr, 0x5A, size, stream), "cuMemsetD8Async")
back3 = bytearray(size)
ok(cu.cuMemcpyDtoHAsync(back3, ptr, size, stream), "cuMemcpyDtoHAsync")
ok(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
if bytes(back3) != b"\x5a" * size:
    fail("cuMemsetD8Async/cuMemcpyDtoHAsync gave the wrong bytes")
ok(cu.cuStreamDestroy(stream), "cuStreamDestroy")

# The simulator runs no kernels, and says so.
err, _ = cu.cuModuleLoadData(b"\0" * 16)
emit(module_load=name(err))

ok(cu.cuMemFree(ptr), "cuMemFree")
ok(cu.cuMemFree(ptr2), "cuMemFree")
free2, total2 = ok(cu.cuMemGetInfo(), "cuMemGetInfo")
emit(memory=dict(total=total0, free_before=free0, free_allocated=free1, free_after=free2, copied=size))
ok(cu.cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease")
emit(done=True)
