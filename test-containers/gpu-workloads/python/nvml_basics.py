"""nvidia-ml-py (pynvml) on the simulated libnvidia-ml.so.1: the inventory's calls.

Prints `{"driver_version": ...}`, one `{"device": i, ...}` per GPU (with its running compute
processes), then `{"done": true}`."""

import pynvml as nv

from common import emit

nv.nvmlInit()
emit(
    driver_version=nv.nvmlSystemGetDriverVersion(),
    cuda_version=nv.nvmlSystemGetCudaDriverVersion(),
    cuda_version_v2=nv.nvmlSystemGetCudaDriverVersion_v2(),
    nvml_version=nv.nvmlSystemGetNVMLVersion(),
    count=nv.nvmlDeviceGetCount(),
    pynvml=__import__("importlib.metadata").metadata.version("nvidia-ml-py"),
)
for i in range(nv.nvmlDeviceGetCount()):
    h = nv.nvmlDeviceGetHandleByIndex(i)
    uuid = nv.nvmlDeviceGetUUID(h)
    mem = nv.nvmlDeviceGetMemoryInfo(h)
    mem2 = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
    pci = nv.nvmlDeviceGetPciInfo(h)
    procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
    by_uuid = nv.nvmlDeviceGetIndex(nv.nvmlDeviceGetHandleByUUID(uuid))
    by_pci = nv.nvmlDeviceGetIndex(nv.nvmlDeviceGetHandleByPciBusId(pci.busId))
    emit(
        device=i,
        uuid=uuid,
        name=nv.nvmlDeviceGetName(h),
        total=mem.total,
        free=mem.free,
        used=mem.used,
        total_v2=mem2.total,
        pci=pci.busId,
        pci_bus=pci.bus,
        index_by_uuid=by_uuid,
        index_by_pci=by_pci,
        cc=list(nv.nvmlDeviceGetCudaComputeCapability(h)),
        persistence=nv.nvmlDeviceGetPersistenceMode(h),
        processes=[{"pid": p.pid, "used": p.usedGpuMemory} for p in procs],
    )
nv.nvmlShutdown()
emit(done=True)
