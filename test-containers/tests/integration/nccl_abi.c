/*
 * nccl_abi: what NVIDIA's nccl.h says of the ABI, and what a libnccl.so.2 reports.
 *
 * Compiled at test time against the nccl.h of the pinned nvidia-nccl-cu13 wheel (with stub CUDA
 * headers: nccl.h needs only cudaStream_t and cudaEvent_t of them), by tests/integration/gpu_nccl.rs:
 *
 *     cc -O2 -Wall -Werror -I STUBS -I WHEEL/include -o nccl_abi nccl_abi.c -ldl
 *
 * Without an argument it prints, as JSON lines, the sizes and field offsets of ncclConfig_t and
 * the other types, the enum values, the version macros, and NCCL_CONFIG_INITIALIZER's header.
 * With a library's path it loads that library and prints what ncclGetVersion,
 * ncclGetErrorString and ncclGetLastError answer, and what ncclCommCount(NULL) and an
 * ncclGroupEnd without ncclGroupStart return and leave as the last error (none needs a GPU).
 */
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nccl.h>

#define FIELD(f) printf("%s\"%s\": %zu", first ? "" : ", ", #f, offsetof(ncclConfig_t, f)), first = 0
#define VALUE(v) printf("%s\"%s\": %lld", first ? "" : ", ", #v, (long long)(v)), first = 0

static void header(void) {
    int first = 1;
    printf("{\"sizeof\": {");
    printf("\"ncclConfig_t\": %zu, \"ncclUniqueId\": %zu, \"ncclResult_t\": %zu, "
           "\"ncclDataType_t\": %zu, \"ncclRedOp_t\": %zu, \"ncclComm_t\": %zu",
           sizeof(ncclConfig_t), sizeof(ncclUniqueId), sizeof(ncclResult_t),
           sizeof(ncclDataType_t), sizeof(ncclRedOp_t), sizeof(ncclComm_t));
    printf("}}\n{\"offsetof\": {");
    FIELD(size); FIELD(magic); FIELD(version); FIELD(blocking); FIELD(cgaClusterSize);
    FIELD(minCTAs); FIELD(maxCTAs); FIELD(netName); FIELD(splitShare); FIELD(trafficClass);
    FIELD(commName); FIELD(collnetEnable); FIELD(CTAPolicy); FIELD(shrinkShare); FIELD(nvlsCTAs);
    FIELD(nChannelsPerNetPeer); FIELD(nvlinkCentricSched); FIELD(graphUsageMode);
    FIELD(numRmaCtx); FIELD(maxP2pPeers); FIELD(graphStreamOrdering); FIELD(launchOrderImplicit);
    FIELD(numRmaSig); FIELD(rmaEagerInit); FIELD(hostCftMode); FIELD(nvlsHostMode);
    printf("}}\n{\"enum\": {");
    first = 1;
    VALUE(ncclSuccess); VALUE(ncclUnhandledCudaError); VALUE(ncclSystemError);
    VALUE(ncclInternalError); VALUE(ncclInvalidArgument); VALUE(ncclInvalidUsage);
    VALUE(ncclRemoteError); VALUE(ncclInProgress); VALUE(ncclTimeout); VALUE(ncclNumResults);
    VALUE(ncclInt8); VALUE(ncclUint8); VALUE(ncclInt32); VALUE(ncclUint32); VALUE(ncclInt64);
    VALUE(ncclUint64); VALUE(ncclFloat16); VALUE(ncclFloat32); VALUE(ncclFloat64);
    VALUE(ncclBfloat16); VALUE(ncclFloat8e4m3); VALUE(ncclFloat8e5m2); VALUE(ncclNumTypes);
    VALUE(ncclSum); VALUE(ncclProd); VALUE(ncclMax); VALUE(ncclMin); VALUE(ncclAvg);
    VALUE(ncclNumOps); VALUE(NCCL_SPLIT_NOCOLOR); VALUE(NCCL_API_MAGIC);
    VALUE(NCCL_CONFIG_UNDEF_INT); VALUE(NCCL_UNIQUE_ID_BYTES);
    printf("}}\n");
    printf("{\"version\": {\"code\": %d, \"major\": %d, \"minor\": %d, \"patch\": %d, "
           "\"v2_32_6\": %d, \"v2_8_4\": %d, \"v2_9_0\": %d, \"v3_0_1\": %d}}\n",
           NCCL_VERSION_CODE, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH, NCCL_VERSION(2, 32, 6),
           NCCL_VERSION(2, 8, 4), NCCL_VERSION(2, 9, 0), NCCL_VERSION(3, 0, 1));
    ncclConfig_t init = NCCL_CONFIG_INITIALIZER;
    printf("{\"initializer\": {\"size\": %zu, \"magic\": %u, \"version\": %u, \"blocking\": %d}}\n",
           init.size, init.magic, init.version, init.blocking);
}

/* Prints s as a JSON string. */
static void json_string(const char *s) {
    putchar('"');
    for (; s && *s; s++) {
        if (*s == '"' || *s == '\\') putchar('\\');
        if ((unsigned char)*s < 0x20) printf("\\u%04x", *s); else putchar(*s);
    }
    putchar('"');
}

static int library(const char *path) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "dlopen %s: %s\n", path, dlerror());
        return 1;
    }
    ncclResult_t (*get_version)(int *) = (ncclResult_t (*)(int *))dlsym(h, "ncclGetVersion");
    const char *(*error_string)(ncclResult_t) =
        (const char *(*)(ncclResult_t))dlsym(h, "ncclGetErrorString");
    const char *(*last_error)(ncclComm_t) = (const char *(*)(ncclComm_t))dlsym(h, "ncclGetLastError");
    ncclResult_t (*comm_count)(ncclComm_t, int *) =
        (ncclResult_t (*)(ncclComm_t, int *))dlsym(h, "ncclCommCount");
    ncclResult_t (*group_end)(void) = (ncclResult_t (*)(void))dlsym(h, "ncclGroupEnd");
    if (!get_version || !error_string || !last_error || !comm_count || !group_end) {
        fprintf(stderr, "%s lacks one of ncclGetVersion, ncclGetErrorString, ncclGetLastError, "
                        "ncclCommCount, ncclGroupEnd\n", path);
        return 1;
    }
    char *before = strdup(last_error(NULL));
    int v = -1, n = -1;
    ncclResult_t rc = get_version(&v);
    ncclResult_t null_rc = get_version(NULL);
    char *after_null = strdup(last_error(NULL));
    ncclResult_t count_rc = comm_count(NULL, &n);
    char *after_count = strdup(last_error(NULL));
    ncclResult_t end_rc = group_end();
    char *after_end = strdup(last_error(NULL));
    printf("{\"library\": {\"rc\": %d, \"version\": %d, \"null_rc\": %d, \"count_rc\": %d, "
           "\"group_end_rc\": %d, \"last_error\": ", rc, v, null_rc, count_rc, end_rc);
    json_string(before);
    printf(", \"after_version_null\": ");
    json_string(after_null);
    printf(", \"after_count_null\": ");
    json_string(after_count);
    printf(", \"after_group_end\": ");
    json_string(after_end);
    free(before);
    free(after_null);
    free(after_count);
    free(after_end);
    printf(", \"errors\": [");
    for (int i = 0; i <= ncclNumResults + 1; i++) {
        if (i) printf(", ");
        json_string(error_string((ncclResult_t)i));
    }
    printf("]}}\n");
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1) return library(argv[1]);
    header();
    return 0;
}
