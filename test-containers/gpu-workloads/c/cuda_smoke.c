/*
 * cuda_smoke: a plain C driver-API program that dlopens libcuda.so.1 and exercises the calls a
 * simple CUDA application makes. It declares the prototypes itself, as cuda.h does, so that it
 * builds with nothing but a C compiler:
 *
 *     cc -O2 -Wall -Werror -o cuda_smoke cuda_smoke.c -ldl
 *
 * Prints "cuda_smoke ok" on success; on failure, the failing call and its error name, and exits 1.
 * Uses device 0 (the loader's libcuda.so.1 decides which driver that is: LD_LIBRARY_PATH).
 */
#include <dlfcn.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef unsigned long long CUdeviceptr;
typedef struct CUuuid_st { char bytes[16]; } CUuuid;

#define CUDA_SUCCESS 0
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76
#define CU_STREAM_NON_BLOCKING 1

/* Prototypes as in cuda.h (the _v2 names are what cuda.h's macros map the plain names to). */
typedef CUresult (*cuInit_t)(unsigned int flags);
typedef CUresult (*cuDriverGetVersion_t)(int *version);
typedef CUresult (*cuDeviceGetCount_t)(int *count);
typedef CUresult (*cuDeviceGet_t)(CUdevice *device, int ordinal);
typedef CUresult (*cuDeviceGetName_t)(char *name, int len, CUdevice dev);
typedef CUresult (*cuDeviceGetUuid_t)(CUuuid *uuid, CUdevice dev);
typedef CUresult (*cuDeviceTotalMem_v2_t)(size_t *bytes, CUdevice dev);
typedef CUresult (*cuDeviceGetPCIBusId_t)(char *pciBusId, int len, CUdevice dev);
typedef CUresult (*cuDeviceGetAttribute_t)(int *pi, int attrib, CUdevice dev);
typedef CUresult (*cuCtxCreate_v2_t)(CUcontext *pctx, unsigned int flags, CUdevice dev);
typedef CUresult (*cuCtxDestroy_v2_t)(CUcontext ctx);
typedef CUresult (*cuCtxSetCurrent_t)(CUcontext ctx);
typedef CUresult (*cuCtxGetCurrent_t)(CUcontext *pctx);
typedef CUresult (*cuCtxSynchronize_t)(void);
typedef CUresult (*cuDevicePrimaryCtxRetain_t)(CUcontext *pctx, CUdevice dev);
typedef CUresult (*cuDevicePrimaryCtxRelease_v2_t)(CUdevice dev);
typedef CUresult (*cuMemAlloc_v2_t)(CUdeviceptr *dptr, size_t bytesize);
typedef CUresult (*cuMemFree_v2_t)(CUdeviceptr dptr);
typedef CUresult (*cuMemGetInfo_v2_t)(size_t *free, size_t *total);
typedef CUresult (*cuMemcpyHtoD_v2_t)(CUdeviceptr dst, const void *src, size_t n);
typedef CUresult (*cuMemcpyDtoH_v2_t)(void *dst, CUdeviceptr src, size_t n);
typedef CUresult (*cuMemcpyDtoD_v2_t)(CUdeviceptr dst, CUdeviceptr src, size_t n);
typedef CUresult (*cuMemcpyHtoDAsync_v2_t)(CUdeviceptr dst, const void *src, size_t n, CUstream s);
typedef CUresult (*cuMemcpyDtoHAsync_v2_t)(void *dst, CUdeviceptr src, size_t n, CUstream s);
typedef CUresult (*cuMemsetD8_v2_t)(CUdeviceptr dst, unsigned char uc, size_t n);
typedef CUresult (*cuMemsetD32_v2_t)(CUdeviceptr dst, unsigned int ui, size_t n);
typedef CUresult (*cuStreamCreate_t)(CUstream *ps, unsigned int flags);
typedef CUresult (*cuStreamSynchronize_t)(CUstream s);
typedef CUresult (*cuStreamDestroy_v2_t)(CUstream s);
typedef CUresult (*cuGetErrorName_t)(CUresult error, const char **pstr);
typedef CUresult (*cuGetErrorString_t)(CUresult error, const char **pstr);

static struct {
    cuInit_t cuInit;
    cuDriverGetVersion_t cuDriverGetVersion;
    cuDeviceGetCount_t cuDeviceGetCount;
    cuDeviceGet_t cuDeviceGet;
    cuDeviceGetName_t cuDeviceGetName;
    cuDeviceGetUuid_t cuDeviceGetUuid;
    cuDeviceTotalMem_v2_t cuDeviceTotalMem_v2;
    cuDeviceGetPCIBusId_t cuDeviceGetPCIBusId;
    cuDeviceGetAttribute_t cuDeviceGetAttribute;
    cuCtxCreate_v2_t cuCtxCreate_v2;
    cuCtxDestroy_v2_t cuCtxDestroy_v2;
    cuCtxSetCurrent_t cuCtxSetCurrent;
    cuCtxGetCurrent_t cuCtxGetCurrent;
    cuCtxSynchronize_t cuCtxSynchronize;
    cuDevicePrimaryCtxRetain_t cuDevicePrimaryCtxRetain;
    cuDevicePrimaryCtxRelease_v2_t cuDevicePrimaryCtxRelease_v2;
    cuMemAlloc_v2_t cuMemAlloc_v2;
    cuMemFree_v2_t cuMemFree_v2;
    cuMemGetInfo_v2_t cuMemGetInfo_v2;
    cuMemcpyHtoD_v2_t cuMemcpyHtoD_v2;
    cuMemcpyDtoH_v2_t cuMemcpyDtoH_v2;
    cuMemcpyDtoD_v2_t cuMemcpyDtoD_v2;
    cuMemcpyHtoDAsync_v2_t cuMemcpyHtoDAsync_v2;
    cuMemcpyDtoHAsync_v2_t cuMemcpyDtoHAsync_v2;
    cuMemsetD8_v2_t cuMemsetD8_v2;
    cuMemsetD32_v2_t cuMemsetD32_v2;
    cuStreamCreate_t cuStreamCreate;
    cuStreamSynchronize_t cuStreamSynchronize;
    cuStreamDestroy_v2_t cuStreamDestroy_v2;
    cuGetErrorName_t cuGetErrorName;
    cuGetErrorString_t cuGetErrorString;
} cu;

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("cuda_smoke: FAILED: ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    fflush(stdout);
    exit(1);
}

static const char *err_name(CUresult rc) {
    const char *name = NULL;
    if (cu.cuGetErrorName == NULL || cu.cuGetErrorName(rc, &name) != CUDA_SUCCESS || name == NULL)
        return "(unknown error)";
    return name;
}

static const char *err_string(CUresult rc) {
    const char *s = NULL;
    if (cu.cuGetErrorString == NULL || cu.cuGetErrorString(rc, &s) != CUDA_SUCCESS || s == NULL)
        return "";
    return s;
}

/* Runs one call; on failure names it, its error name and string, and exits 1. */
#define CHECK(call)                                                                      \
    do {                                                                                 \
        CUresult rc_ = (call);                                                           \
        if (rc_ != CUDA_SUCCESS)                                                         \
            die("%s returned %d %s (%s)", #call, rc_, err_name(rc_), err_string(rc_));   \
    } while (0)

#define LOAD(lib, name)                                                                  \
    do {                                                                                 \
        void *sym_ = dlsym(lib, #name);                                                  \
        if (sym_ == NULL)                                                                \
            die("dlsym %s: %s", #name, dlerror());                                       \
        memcpy(&cu.name, &sym_, sizeof(sym_));                                           \
    } while (0)

static void expect_bytes(const unsigned char *p, size_t n, unsigned char v, const char *what) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != v)
            die("%s: byte %zu is 0x%02x, want 0x%02x", what, i, p[i], v);
}

static uint32_t pattern(size_t i) {
    uint32_t x = (uint32_t)i * 2654435761u;
    return x ^ (x >> 15) ^ 0x5bd1e995u;
}

int main(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL)
        die("dlopen libcuda.so.1: %s", dlerror());
    LOAD(lib, cuInit);
    LOAD(lib, cuDriverGetVersion);
    LOAD(lib, cuDeviceGetCount);
    LOAD(lib, cuDeviceGet);
    LOAD(lib, cuDeviceGetName);
    LOAD(lib, cuDeviceGetUuid);
    LOAD(lib, cuDeviceTotalMem_v2);
    LOAD(lib, cuDeviceGetPCIBusId);
    LOAD(lib, cuDeviceGetAttribute);
    LOAD(lib, cuCtxCreate_v2);
    LOAD(lib, cuCtxDestroy_v2);
    LOAD(lib, cuCtxSetCurrent);
    LOAD(lib, cuCtxGetCurrent);
    LOAD(lib, cuCtxSynchronize);
    LOAD(lib, cuDevicePrimaryCtxRetain);
    LOAD(lib, cuDevicePrimaryCtxRelease_v2);
    LOAD(lib, cuMemAlloc_v2);
    LOAD(lib, cuMemFree_v2);
    LOAD(lib, cuMemGetInfo_v2);
    LOAD(lib, cuMemcpyHtoD_v2);
    LOAD(lib, cuMemcpyDtoH_v2);
    LOAD(lib, cuMemcpyDtoD_v2);
    LOAD(lib, cuMemcpyHtoDAsync_v2);
    LOAD(lib, cuMemcpyDtoHAsync_v2);
    LOAD(lib, cuMemsetD8_v2);
    LOAD(lib, cuMemsetD32_v2);
    LOAD(lib, cuStreamCreate);
    LOAD(lib, cuStreamSynchronize);
    LOAD(lib, cuStreamDestroy_v2);
    LOAD(lib, cuGetErrorName);
    LOAD(lib, cuGetErrorString);

    /* Driver and device. */
    CHECK(cu.cuInit(0));
    int version = 0, count = 0;
    CHECK(cu.cuDriverGetVersion(&version));
    CHECK(cu.cuDeviceGetCount(&count));
    if (count < 1)
        die("cuDeviceGetCount: no device");
    CUdevice dev;
    CHECK(cu.cuDeviceGet(&dev, 0));
    char name[256] = {0};
    char bus[64] = {0};
    CUuuid uuid;
    size_t total_mem = 0;
    int major = 0, minor = 0;
    CHECK(cu.cuDeviceGetName(name, (int)sizeof(name), dev));
    CHECK(cu.cuDeviceGetUuid(&uuid, dev));
    CHECK(cu.cuDeviceTotalMem_v2(&total_mem, dev));
    CHECK(cu.cuDeviceGetPCIBusId(bus, (int)sizeof(bus), dev));
    CHECK(cu.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
    CHECK(cu.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev));
    if (name[0] == 0)
        die("cuDeviceGetName: empty name");
    if (total_mem == 0)
        die("cuDeviceTotalMem_v2: 0 bytes");
    if (major < 1)
        die("cuDeviceGetAttribute: compute capability %d.%d", major, minor);
    const unsigned char *u = (const unsigned char *)uuid.bytes;
    printf("driver %d, %d device(s); device 0: %s, cc %d.%d, %zu bytes, pci %s, "
           "uuid GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x\n",
           version, count, name, major, minor, total_mem, bus, u[0], u[1], u[2], u[3], u[4],
           u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);

    /* A context of our own: create, check current, destroy. */
    CUcontext own = NULL, cur = NULL;
    CHECK(cu.cuCtxCreate_v2(&own, 0, dev));
    CHECK(cu.cuCtxGetCurrent(&cur));
    if (cur != own)
        die("cuCtxGetCurrent: %p is not the context just created (%p)", (void *)cur, (void *)own);
    CUdeviceptr tmp = 0;
    CHECK(cu.cuMemAlloc_v2(&tmp, 4096));
    CHECK(cu.cuMemsetD8_v2(tmp, 0x11, 4096));
    CHECK(cu.cuCtxSynchronize());
    CHECK(cu.cuMemFree_v2(tmp));
    CHECK(cu.cuCtxDestroy_v2(own));

    /* The primary context, as runtime-API programs use it. */
    CUcontext ctx = NULL;
    CHECK(cu.cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cu.cuCtxSetCurrent(ctx));
    CHECK(cu.cuCtxGetCurrent(&cur));
    if (cur != ctx)
        die("cuCtxGetCurrent: %p is not the primary context (%p)", (void *)cur, (void *)ctx);

    const size_t n = 4u << 20; /* 4 MiB */
    const size_t words = n / 4;
    size_t free0 = 0, total0 = 0, free1 = 0, total1 = 0;
    CHECK(cu.cuMemGetInfo_v2(&free0, &total0));
    CUdeviceptr a = 0, b = 0;
    CHECK(cu.cuMemAlloc_v2(&a, n));
    CHECK(cu.cuMemAlloc_v2(&b, n));
    CHECK(cu.cuMemGetInfo_v2(&free1, &total1));
    if (total1 != total0 || free1 > free0 || free0 - free1 < 2 * n)
        die("cuMemGetInfo_v2: free %zu -> %zu (total %zu -> %zu) after allocating %zu bytes",
            free0, free1, total0, total1, 2 * n);
    if (a == 0 || b == 0 || a == b)
        die("cuMemAlloc_v2: pointers 0x%llx 0x%llx", a, b);

    uint32_t *src = malloc(n), *dst = malloc(n);
    if (src == NULL || dst == NULL)
        die("malloc %zu bytes", n);
    for (size_t i = 0; i < words; i++)
        src[i] = pattern(i);

    /* HtoD, DtoD, DtoH. */
    CHECK(cu.cuMemcpyHtoD_v2(a, src, n));
    CHECK(cu.cuMemcpyDtoD_v2(b, a, n));
    memset(dst, 0, n);
    CHECK(cu.cuMemcpyDtoH_v2(dst, b, n));
    for (size_t i = 0; i < words; i++)
        if (dst[i] != src[i])
            die("HtoD/DtoD/DtoH: word %zu is 0x%08x, want 0x%08x", i, dst[i], src[i]);

    /* A DtoD into the middle of a buffer, at an offset. */
    CHECK(cu.cuMemsetD8_v2(b, 0, n));
    CHECK(cu.cuMemcpyDtoD_v2(b + 4096, a + 8192, 4096));
    CHECK(cu.cuMemcpyDtoH_v2(dst, b, 3 * 4096));
    expect_bytes((const unsigned char *)dst, 4096, 0, "DtoD at offset (before)");
    if (memcmp((const char *)dst + 4096, (const char *)src + 8192, 4096) != 0)
        die("DtoD at offset: data differs");
    expect_bytes((const unsigned char *)dst + 8192, 4096, 0, "DtoD at offset (after)");

    /* Memsets: D8 over everything, then D32 over the middle half. */
    CHECK(cu.cuMemsetD8_v2(a, 0xab, n));
    CHECK(cu.cuMemsetD32_v2(a + n / 4, 0x01020304u, words / 2));
    CHECK(cu.cuCtxSynchronize());
    CHECK(cu.cuMemcpyDtoH_v2(dst, a, n));
    expect_bytes((const unsigned char *)dst, n / 4, 0xab, "cuMemsetD8_v2 (head)");
    for (size_t i = words / 4; i < words / 4 + words / 2; i++)
        if (dst[i] != 0x01020304u)
            die("cuMemsetD32_v2: word %zu is 0x%08x", i, dst[i]);
    expect_bytes((const unsigned char *)dst + 3 * n / 4, n / 4, 0xab, "cuMemsetD8_v2 (tail)");

    /* Async copies on a stream. */
    CUstream s = NULL;
    CHECK(cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    for (size_t i = 0; i < words; i++)
        src[i] = ~pattern(i);
    CHECK(cu.cuMemcpyHtoDAsync_v2(a, src, n, s));
    CHECK(cu.cuStreamSynchronize(s));
    memset(dst, 0, n);
    CHECK(cu.cuMemcpyDtoHAsync_v2(dst, a, n, s));
    CHECK(cu.cuStreamSynchronize(s));
    if (memcmp(dst, src, n) != 0)
        die("HtoDAsync/DtoHAsync: data differs");
    CHECK(cu.cuStreamDestroy_v2(s));

    /* An error path: freeing a pointer that was never allocated. */
    CUdeviceptr bogus = a + n + ((CUdeviceptr)1 << 40);
    CUresult rc = cu.cuMemFree_v2(bogus);
    if (rc == CUDA_SUCCESS)
        die("cuMemFree_v2(0x%llx) of a pointer never allocated returned CUDA_SUCCESS", bogus);
    const char *ename = NULL;
    if (cu.cuGetErrorName(rc, &ename) != CUDA_SUCCESS || ename == NULL ||
        strncmp(ename, "CUDA_ERROR_", 11) != 0)
        die("cuGetErrorName(%d) gave %s", rc, ename ? ename : "NULL");
    printf("cuMemFree_v2 of a bad pointer: %s (expected)\n", ename);

    CHECK(cu.cuMemFree_v2(a));
    CHECK(cu.cuMemFree_v2(b));
    CHECK(cu.cuCtxSynchronize());
    CHECK(cu.cuDevicePrimaryCtxRelease_v2(dev));
    free(src);
    free(dst);
    printf("cuda_smoke ok\n");
    fflush(stdout);
    return 0;
}
