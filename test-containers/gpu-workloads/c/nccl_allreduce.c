/*
 * nccl_allreduce: a data-parallel training loop in plain C over NCCL's public API and the CUDA
 * driver API, N ranks on N GPUs, each step verified element by element.
 *
 * Built against the pinned NCCL wheel's nccl.h and linked with its libnccl.so.2 (DT_NEEDED, as
 * NCCL programs are); libcuda.so.1 is dlopened as c/cuda_smoke.c does. Whichever libnccl.so.2
 * and libcuda.so.1 the loader finds at run time are used (LD_LIBRARY_PATH: NVIDIA's, or the
 * simulator's). c/build.sh builds it:
 *
 *     cc -O2 -Wall -Werror -I c/cudart-types -I $WHEEL/include -o nccl_allreduce \
 *        c/nccl_allreduce.c -L $WHEEL/lib -l:libnccl.so.2 -ldl
 *
 * Ranks:
 *   --ranks N        torchrun's shape: this process forks N ranks (rank = first + i, first
 *                    --rank/RANK, on GPU D + i, D --device, default 0), waits for them, and
 *                    stops the others when one fails. Rank 0 hands the
 *                    unique id to the others through pipes, or through --rendezvous DIR when the
 *                    world has ranks outside this process (--world-size larger than N).
 *   (no --ranks)     one rank in this process: --rank/RANK, --world-size/WORLD_SIZE, the GPU
 *                    --device/LOCAL_RANK (default 0), the unique id through --rendezvous DIR
 *                    (rank 0 writes DIR/nccl-unique-id, the others wait for it), so that ranks
 *                    can run in separate containers of one pod sharing a volume.
 *
 * Each step k on rank r (u32 arithmetic modulo 2^32; every value has a closed form in
 * (seed, k, r), see hash32 and the Rust twin in src/collective.rs):
 *   1. the parameters left on the device by step k-1 are checked against their closed form;
 *   2. the gradient g(k,r,i) = a(r,i) + k*b(r) is written to the device and allreduced (sum, in
 *      place) on the world communicator; every element is checked against sum over ranks;
 *   3. rank 0 adds the reduced gradient to its parameters, the others clear theirs, and rank 0
 *      broadcasts them; every rank checks p(k,i) = p(0,i) + k*A(i) + k(k+1)/2*B;
 *   4. an allreduce on the communicator split by rank parity (even/odd) of c(r,i) + k*d(r);
 *   5. an allreduce of the number of ranks that found a mismatch, so that all ranks stop
 *      together. Prints `rank <r> step <k> checksum <16 hex>` (FNV-1a over the verified reduced
 *      gradient, parameters and split sum), or `MISMATCH rank <r> step <k> <what> element <i>
 *      got <x> want <y>` and exits 1.
 *
 * --corrupt R:K:I flips bit 0 of element I of the reduced gradient on rank R's GPU after step
 * K's allreduce (tests use it to show that the check fails).
 */
#include <dlfcn.h>
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <nccl.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef unsigned long long CUdeviceptr;

#define CUDA_SUCCESS 0
#define CU_STREAM_NON_BLOCKING 1

static struct {
    CUresult (*cuInit)(unsigned int);
    CUresult (*cuDeviceGetCount)(int *);
    CUresult (*cuDeviceGet)(CUdevice *, int);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*cuDevicePrimaryCtxRelease_v2)(CUdevice);
    CUresult (*cuCtxSetCurrent)(CUcontext);
    CUresult (*cuMemAlloc_v2)(CUdeviceptr *, size_t);
    CUresult (*cuMemFree_v2)(CUdeviceptr);
    CUresult (*cuMemcpyHtoDAsync_v2)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*cuMemcpyDtoHAsync_v2)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*cuMemsetD32Async)(CUdeviceptr, unsigned int, size_t, CUstream);
    CUresult (*cuStreamCreate)(CUstream *, unsigned int);
    CUresult (*cuStreamSynchronize)(CUstream);
    CUresult (*cuStreamDestroy_v2)(CUstream);
    CUresult (*cuGetErrorName)(CUresult, const char **);
} cu;

/* This rank's name in messages ("nccl_allreduce" before it has one). */
static char who[64] = "nccl_allreduce";

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("%s: ", who);
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    fflush(stdout);
    exit(1);
}

static void usage(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "nccl_allreduce: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr,
            "\nusage: nccl_allreduce [--ranks N] [--rank R] [--world-size W] [--device D]"
            " [--rendezvous DIR] [--elements N] [--interval-ms MS] [--steps N] [--seed S]"
            " [--corrupt RANK:STEP:ELEMENT]\n");
    va_end(ap);
    exit(2);
}

/* What a failed call returned, then exit 1. */
static void cu_ok(CUresult rc, const char *call) {
    const char *name = NULL;
    if (rc == CUDA_SUCCESS)
        return;
    if (cu.cuGetErrorName == NULL || cu.cuGetErrorName(rc, &name) != CUDA_SUCCESS)
        name = NULL;
    die("%s returned %d %s", call, rc, name ? name : "(unknown error)");
}

static void nccl_ok(ncclResult_t rc, const char *call) {
    if (rc != ncclSuccess)
        die("%s returned %d %s", call, (int)rc, ncclGetErrorString(rc));
}

#define CU(call) cu_ok((call), #call)
#define NCCL(call) nccl_ok((call), #call)

/* The driver's entry points this program calls, by name and where each goes in `cu`. */
#define ENTRY(name) {#name, &cu.name, sizeof(cu.name)}
static const struct {
    const char *name;
    void *slot;
    size_t size;
} entries[] = {
    ENTRY(cuGetErrorName),   ENTRY(cuInit),
    ENTRY(cuDeviceGetCount), ENTRY(cuDeviceGet),
    ENTRY(cuDevicePrimaryCtxRetain), ENTRY(cuDevicePrimaryCtxRelease_v2),
    ENTRY(cuCtxSetCurrent),  ENTRY(cuMemAlloc_v2),
    ENTRY(cuMemFree_v2),     ENTRY(cuMemcpyHtoDAsync_v2),
    ENTRY(cuMemcpyDtoHAsync_v2), ENTRY(cuMemsetD32Async),
    ENTRY(cuStreamCreate),   ENTRY(cuStreamSynchronize),
    ENTRY(cuStreamDestroy_v2),
};

static void load_driver(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL)
        die("no NVIDIA driver: dlopen libcuda.so.1: %s", dlerror());
    for (size_t i = 0; i < sizeof(entries) / sizeof(entries[0]); i++) {
        void *sym = dlsym(lib, entries[i].name);
        if (sym == NULL)
            die("dlsym %s: %s", entries[i].name, dlerror());
        memcpy(entries[i].slot, &sym, entries[i].size);
    }
}

/* ---- The numbers: the same functions as src/lib.rs (mix64, hash32) and src/collective.rs. ---- */

static uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint32_t hash32(uint64_t seed, uint32_t rank, uint32_t tag, uint64_t index) {
    uint64_t h = mix64(seed ^ mix64(((uint64_t)rank << 32) | tag) ^ mix64(index ^ 0x5851f42dull));
    return (uint32_t)(h >> 16);
}

enum { TAG_PARAM = 0, TAG_GRAD = 1, TAG_GRAD_STEP = 2, TAG_SPLIT = 3, TAG_SPLIT_STEP = 4 };

static uint32_t step_factor(uint64_t seed, uint32_t rank, uint32_t tag) {
    return hash32(seed, rank, tag, 0) | 1u;
}

/* k(k+1)/2 modulo 2^32. */
static uint32_t tri(uint64_t k) {
    unsigned __int128 t = (unsigned __int128)k * (k + 1) / 2;
    return (uint32_t)t;
}

typedef struct {
    uint64_t h;
} fnv_t;

static void fnv_add(fnv_t *f, const uint32_t *w, size_t n) {
    for (size_t i = 0; i < n; i++)
        f->h = (f->h ^ w[i]) * 0x00000100000001b3ull;
}

/* ---- Options. ---- */

typedef struct {
    int ranks; /* 0: this process is one rank */
    int rank, world, device;
    int have_rank, have_world, have_device;
    const char *rendezvous;
    size_t elements;
    uint64_t interval_ms, steps, seed;
    int have_steps;
    int corrupt;
    int corrupt_rank;
    uint64_t corrupt_step;
    size_t corrupt_element;
} opts_t;

static uint64_t number(const char *flag, const char *s) {
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || s[0] == '-')
        usage("%s: bad number \"%s\"", flag, s);
    return v;
}

static int small(const char *flag, const char *s) {
    uint64_t v = number(flag, s);
    if (v > 1u << 20)
        usage("%s: %s is too large", flag, s);
    return (int)v;
}

static int env_int(const char *name, int *out) {
    const char *v = getenv(name);
    if (v == NULL || *v == '\0')
        return 0;
    *out = small(name, v);
    return 1;
}

static void parse_corrupt(opts_t *o, const char *s) {
    unsigned long long r, k, i;
    char tail;
    if (sscanf(s, "%llu:%llu:%llu%c", &r, &k, &i, &tail) != 3)
        usage("--corrupt: want RANK:STEP:ELEMENT, got \"%s\"", s);
    o->corrupt = 1;
    o->corrupt_rank = (int)r;
    o->corrupt_step = k;
    o->corrupt_element = (size_t)i;
}

static opts_t parse(int argc, char **argv) {
    opts_t o;
    memset(&o, 0, sizeof(o));
    o.elements = 1u << 20;
    o.interval_ms = 100;
    o.seed = 1;
    for (int a = 1; a < argc; a++) {
        const char *f = argv[a];
        if (strcmp(f, "--help") == 0 || strcmp(f, "-h") == 0) {
            printf("usage: nccl_allreduce [--ranks N] [--rank R] [--world-size W] [--device D]"
                   " [--rendezvous DIR] [--elements N] [--interval-ms MS] [--steps N]"
                   " [--seed S] [--corrupt RANK:STEP:ELEMENT]\n");
            exit(0);
        }
        if (a + 1 >= argc)
            usage("%s needs a value", f);
        const char *v = argv[++a];
        if (strcmp(f, "--ranks") == 0)
            o.ranks = small(f, v);
        else if (strcmp(f, "--rank") == 0)
            o.rank = small(f, v), o.have_rank = 1;
        else if (strcmp(f, "--world-size") == 0)
            o.world = small(f, v), o.have_world = 1;
        else if (strcmp(f, "--device") == 0)
            o.device = small(f, v), o.have_device = 1;
        else if (strcmp(f, "--rendezvous") == 0)
            o.rendezvous = v;
        else if (strcmp(f, "--elements") == 0)
            o.elements = (size_t)number(f, v);
        else if (strcmp(f, "--interval-ms") == 0)
            o.interval_ms = number(f, v);
        else if (strcmp(f, "--steps") == 0)
            o.steps = number(f, v), o.have_steps = 1;
        else if (strcmp(f, "--seed") == 0)
            o.seed = number(f, v);
        else if (strcmp(f, "--corrupt") == 0)
            parse_corrupt(&o, v);
        else
            usage("unknown flag %s", f);
    }
    if (!o.have_rank)
        o.have_rank = env_int("RANK", &o.rank);
    if (!o.have_world)
        o.have_world = env_int("WORLD_SIZE", &o.world);
    if (!o.have_device && o.ranks == 0)
        o.have_device = env_int("LOCAL_RANK", &o.device);
    if (o.rendezvous == NULL && getenv("NCCL_RENDEZVOUS_DIR") != NULL)
        o.rendezvous = getenv("NCCL_RENDEZVOUS_DIR");
    if (o.elements == 0 || o.elements > (1ull << 32))
        usage("--elements must be between 1 and 2^32");
    if (!o.have_world)
        o.world = o.ranks > 0 ? o.ranks : 1;
    if (o.world < 1)
        usage("--world-size must be at least 1");
    int local = o.ranks > 0 ? o.ranks : 1;
    if (o.rank + local > o.world)
        usage("ranks %d..%d do not fit in a world of %d", o.rank, o.rank + local - 1, o.world);
    if (o.world > local && o.rendezvous == NULL)
        usage("a world of %d with %d rank(s) here needs --rendezvous DIR", o.world, local);
    if (o.corrupt && (o.corrupt_rank >= o.world || o.corrupt_element >= o.elements))
        usage("--corrupt: rank or element out of range");
    return o;
}

/* ---- The unique id: through pipes from the forked rank 0, or through a directory. ---- */

#define ID_FILE "nccl-unique-id"

static void write_all(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n > 0) {
        ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            die("writing the unique id: %s", strerror(errno));
        c += w;
        n -= (size_t)w;
    }
}

static int read_all(int fd, void *p, size_t n) {
    char *c = p;
    while (n > 0) {
        ssize_t r = read(fd, c, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        c += r;
        n -= (size_t)r;
    }
    return 0;
}

static void publish_id(const char *dir, const ncclUniqueId *id) {
    char tmp[4096], path[4096];
    snprintf(tmp, sizeof(tmp), "%s/.%s.%d", dir, ID_FILE, (int)getpid());
    snprintf(path, sizeof(path), "%s/%s", dir, ID_FILE);
    FILE *f = fopen(tmp, "wb");
    if (f == NULL)
        die("creating %s: %s", tmp, strerror(errno));
    if (fwrite(id, sizeof(*id), 1, f) != 1 || fclose(f) != 0)
        die("writing %s: %s", tmp, strerror(errno));
    if (rename(tmp, path) != 0)
        die("renaming %s to %s: %s", tmp, path, strerror(errno));
}

static void await_id(const char *dir, ncclUniqueId *id) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, ID_FILE);
    for (int tries = 0; tries < 20 * 600; tries++) {
        FILE *f = fopen(path, "rb");
        if (f != NULL) {
            size_t got = fread(id, sizeof(*id), 1, f);
            fclose(f);
            if (got == 1)
                return;
        }
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    die("no unique id in %s after 600 s (rank 0 writes it)", path);
}

/* ---- One rank. ---- */

typedef struct {
    const opts_t *o;
    int rank, world, device;
    size_t n;
    CUstream stream;
    ncclComm_t comm, split;
    CUdeviceptr grad, params, part, flag;
    uint32_t *host;
    /* Constants of the closed forms. */
    uint32_t *grad_sum, *split_sum, *param0; /* sum over ranks of a(r,i), of c(r,i); p(0,i) */
    uint32_t grad_step_sum, split_step_sum;   /* sum over ranks of b(r), of d(r) */
    /* The first mismatch of the step. */
    int bad;
    char bad_line[256];
} rank_t;

static void constants(rank_t *r) {
    uint64_t seed = r->o->seed;
    r->grad_sum = calloc(r->n, 4);
    r->split_sum = calloc(r->n, 4);
    r->param0 = calloc(r->n, 4);
    r->host = calloc(r->n, 4);
    if (!r->grad_sum || !r->split_sum || !r->param0 || !r->host)
        die("out of host memory for %zu elements", r->n);
    for (size_t i = 0; i < r->n; i++)
        r->param0[i] = hash32(seed, 0, TAG_PARAM, i);
    for (int q = 0; q < r->world; q++) {
        r->grad_step_sum += step_factor(seed, (uint32_t)q, TAG_GRAD_STEP);
        for (size_t i = 0; i < r->n; i++)
            r->grad_sum[i] += hash32(seed, (uint32_t)q, TAG_GRAD, i);
        if (q % 2 != r->rank % 2)
            continue;
        r->split_step_sum += step_factor(seed, (uint32_t)q, TAG_SPLIT_STEP);
        for (size_t i = 0; i < r->n; i++)
            r->split_sum[i] += hash32(seed, (uint32_t)q, TAG_SPLIT, i);
    }
}

/* Copies to and from the device, in order with the collectives on the rank's stream (never on
 * the legacy default stream, which a non-blocking stream does not wait for). */
static void to_device(rank_t *r, CUdeviceptr dst, const void *src, size_t bytes) {
    CU(cu.cuMemcpyHtoDAsync_v2(dst, src, bytes, r->stream));
}

static void to_host(rank_t *r, void *dst, CUdeviceptr src, size_t bytes) {
    CU(cu.cuMemcpyDtoHAsync_v2(dst, src, bytes, r->stream));
    CU(cu.cuStreamSynchronize(r->stream));
}

/* Copies `buf` to the host (after the stream's work) and checks it against want(i). */
static void check(rank_t *r, uint64_t k, const char *what, CUdeviceptr buf,
                  uint32_t (*want)(const rank_t *, uint64_t, size_t)) {
    memset(r->host, 0xef, r->n * 4);
    to_host(r, r->host, buf, r->n * 4);
    if (r->bad)
        return;
    for (size_t i = 0; i < r->n; i++) {
        uint32_t w = want(r, k, i);
        if (r->host[i] != w) {
            r->bad = 1;
            snprintf(r->bad_line, sizeof(r->bad_line),
                     "MISMATCH rank %d step %" PRIu64 " %s element %zu got %08x want %08x",
                     r->rank, k, what, i, r->host[i], w);
            return;
        }
    }
}

static uint32_t want_grad(const rank_t *r, uint64_t k, size_t i) {
    return r->grad_sum[i] + (uint32_t)k * r->grad_step_sum;
}

static uint32_t want_params(const rank_t *r, uint64_t k, size_t i) {
    return r->param0[i] + (uint32_t)k * r->grad_sum[i] + tri(k) * r->grad_step_sum;
}

static uint32_t want_split(const rank_t *r, uint64_t k, size_t i) {
    return r->split_sum[i] + (uint32_t)k * r->split_step_sum;
}

/* Writes this rank's contribution c(i) + k*f for `tag`, `step_tag` into `buf`. */
static void contribute(rank_t *r, uint64_t k, uint32_t tag, uint32_t step_tag, CUdeviceptr buf) {
    uint32_t f = step_factor(r->o->seed, (uint32_t)r->rank, step_tag);
    for (size_t i = 0; i < r->n; i++)
        r->host[i] = hash32(r->o->seed, (uint32_t)r->rank, tag, i) + (uint32_t)k * f;
    to_device(r, buf, r->host, r->n * 4);
}

static void corrupt(rank_t *r, uint64_t k) {
    const opts_t *o = r->o;
    if (!o->corrupt || o->corrupt_rank != r->rank || o->corrupt_step != k)
        return;
    uint32_t w;
    CUdeviceptr at = r->grad + 4 * (CUdeviceptr)o->corrupt_element;
    to_host(r, &w, at, 4);
    w ^= 1;
    to_device(r, at, &w, 4);
    CU(cu.cuStreamSynchronize(r->stream));
}

static void step(rank_t *r, uint64_t k) {
    size_t n = r->n;
    r->bad = 0;

    /* 1. What step k-1 left on the device (catches a bad restore at once). */
    check(r, k - 1, "parameters", r->params, want_params);

    /* 2. Gradients: allreduce sum in place on the world communicator. */
    contribute(r, k, TAG_GRAD, TAG_GRAD_STEP, r->grad);
    NCCL(ncclAllReduce((const void *)r->grad, (void *)r->grad, n, ncclUint32, ncclSum, r->comm,
                       r->stream));
    corrupt(r, k);
    check(r, k, "allreduce", r->grad, want_grad);

    /* 3. Rank 0 applies the update; the others' parameters come from the broadcast. */
    if (r->rank == 0) {
        uint32_t *upd = malloc(n * 4);
        if (upd == NULL)
            die("out of host memory");
        to_host(r, upd, r->params, n * 4);
        for (size_t i = 0; i < n; i++)
            upd[i] += r->host[i];
        to_device(r, r->params, upd, n * 4);
        CU(cu.cuStreamSynchronize(r->stream));
        free(upd);
    } else {
        CU(cu.cuMemsetD32Async(r->params, 0xdeadbeef, n, r->stream));
    }
    NCCL(ncclBroadcast((const void *)r->params, (void *)r->params, n, ncclUint32, 0, r->comm,
                       r->stream));
    check(r, k, "broadcast", r->params, want_params);

    /* 4. The split communicator: ranks of the same parity. */
    contribute(r, k, TAG_SPLIT, TAG_SPLIT_STEP, r->part);
    NCCL(ncclAllReduce((const void *)r->part, (void *)r->part, n, ncclUint32, ncclSum, r->split,
                       r->stream));
    check(r, k, "split-allreduce", r->part, want_split);

    /* 5. How many ranks failed: every rank stops at the same step. */
    uint32_t failed = (uint32_t)r->bad;
    to_device(r, r->flag, &failed, 4);
    NCCL(ncclAllReduce((const void *)r->flag, (void *)r->flag, 1, ncclUint32, ncclSum, r->comm,
                       r->stream));
    to_host(r, &failed, r->flag, 4);
    if (r->bad) {
        printf("%s\n", r->bad_line);
        fflush(stdout);
        exit(1);
    }
    if (failed != 0)
        die("step %" PRIu64 ": stopping: %u rank(s) failed verification", k, failed);

    /* The digest of the verified state. */
    fnv_t f = {0xcbf29ce484222325ull};
    for (size_t i = 0; i < n; i++)
        r->host[i] = want_grad(r, k, i);
    fnv_add(&f, r->host, n);
    for (size_t i = 0; i < n; i++)
        r->host[i] = want_params(r, k, i);
    fnv_add(&f, r->host, n);
    for (size_t i = 0; i < n; i++)
        r->host[i] = want_split(r, k, i);
    fnv_add(&f, r->host, n);
    printf("rank %d step %" PRIu64 " checksum %016" PRIx64 "\n", r->rank, k, f.h);
    fflush(stdout);
}

/* Runs rank `rank` on GPU `device`; `id_in` (>= 0) gives the unique id, `id_out` (n_out fds)
 * take it from rank 0. */
static int run_rank(const opts_t *o, int rank, int device, int id_in, const int *id_out,
                    int n_out) {
    snprintf(who, sizeof(who), "nccl_allreduce: rank %d", rank);
    load_driver();
    CU(cu.cuInit(0));
    int count = 0;
    CU(cu.cuDeviceGetCount(&count));
    if (device >= count)
        die("GPU %d does not exist (%d visible)", device, count);
    CUdevice dev;
    CUcontext ctx;
    CU(cu.cuDeviceGet(&dev, device));
    CU(cu.cuDevicePrimaryCtxRetain(&ctx, dev));
    CU(cu.cuCtxSetCurrent(ctx));

    ncclUniqueId id;
    if (rank == 0) {
        NCCL(ncclGetUniqueId(&id));
        for (int i = 0; i < n_out; i++) {
            write_all(id_out[i], &id, sizeof(id));
            close(id_out[i]);
        }
        if (o->rendezvous != NULL)
            publish_id(o->rendezvous, &id);
    } else if (id_in >= 0) {
        if (read_all(id_in, &id, sizeof(id)) != 0)
            die("no unique id from rank 0");
        close(id_in);
    } else {
        await_id(o->rendezvous, &id);
    }

    rank_t r;
    memset(&r, 0, sizeof(r));
    r.o = o;
    r.rank = rank;
    r.world = o->world;
    r.device = device;
    r.n = o->elements;
    constants(&r);
    CU(cu.cuStreamCreate(&r.stream, CU_STREAM_NON_BLOCKING));
    NCCL(ncclCommInitRank(&r.comm, o->world, id, rank));
    NCCL(ncclCommSplit(r.comm, rank % 2, rank, &r.split, NULL));
    int nranks = 0, user_rank = -1, split_ranks = 0, cu_dev = -1;
    NCCL(ncclCommCount(r.comm, &nranks));
    NCCL(ncclCommUserRank(r.comm, &user_rank));
    NCCL(ncclCommCuDevice(r.comm, &cu_dev));
    NCCL(ncclCommCount(r.split, &split_ranks));
    if (nranks != o->world || user_rank != rank || cu_dev != device ||
        split_ranks != (o->world + 1 - rank % 2) / 2)
        die("communicator: %d ranks, rank %d, device %d, split of %d", nranks, user_rank, cu_dev,
            split_ranks);
    CU(cu.cuMemAlloc_v2(&r.grad, r.n * 4));
    CU(cu.cuMemAlloc_v2(&r.params, r.n * 4));
    CU(cu.cuMemAlloc_v2(&r.part, r.n * 4));
    CU(cu.cuMemAlloc_v2(&r.flag, 4));
    to_device(&r, r.params, r.param0, r.n * 4);
    CU(cu.cuStreamSynchronize(r.stream));
    int version = 0;
    NCCL(ncclGetVersion(&version));
    printf("rank %d ready world %d device %d elements %zu seed %" PRIu64 " nccl %d\n", rank,
           o->world, device, r.n, o->seed, version);
    fflush(stdout);

    for (uint64_t k = 1; !o->have_steps || k <= o->steps; k++) {
        if (k > 1 && o->interval_ms > 0) {
            struct timespec ts = {(time_t)(o->interval_ms / 1000),
                                  (long)(o->interval_ms % 1000) * 1000000L};
            nanosleep(&ts, NULL);
        }
        step(&r, k);
    }
    NCCL(ncclCommFinalize(r.split));
    NCCL(ncclCommFinalize(r.comm));
    NCCL(ncclCommDestroy(r.split));
    NCCL(ncclCommDestroy(r.comm));
    CU(cu.cuMemFree_v2(r.flag));
    CU(cu.cuMemFree_v2(r.part));
    CU(cu.cuMemFree_v2(r.params));
    CU(cu.cuMemFree_v2(r.grad));
    CU(cu.cuStreamDestroy_v2(r.stream));
    CU(cu.cuDevicePrimaryCtxRelease_v2(dev));
    return 0;
}

/* ---- The launcher: forks the ranks, stops them all when one fails. ---- */

/* How long the other ranks have to stop on their own after one failed. */
#define GRACE_MS 5000

static pid_t *children;
static int n_children;

static void forward(int sig) {
    for (int i = 0; i < n_children; i++)
        if (children[i] > 0)
            kill(children[i], sig);
}

static int launch(const opts_t *o) {
    int n = o->ranks;
    children = calloc((size_t)n, sizeof(pid_t));
    int (*pipes)[2] = calloc((size_t)n, sizeof(*pipes));
    if (children == NULL || pipes == NULL)
        die("out of memory");
    /* Pipes only when rank 0 is here; else every rank reads the rendezvous directory. */
    int by_pipe = o->rank == 0;
    for (int i = 1; by_pipe && i < n; i++)
        if (pipe(pipes[i]) != 0)
            die("pipe: %s", strerror(errno));
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = forward;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    fflush(stdout);
    for (int i = 0; i < n; i++) {
        pid_t pid = fork();
        if (pid < 0)
            die("fork: %s", strerror(errno));
        if (pid == 0) {
            signal(SIGTERM, SIG_DFL);
            signal(SIGINT, SIG_DFL);
            int out[n > 1 ? n - 1 : 1], n_out = 0, in = -1;
            for (int j = 1; by_pipe && j < n; j++) {
                if (i == 0) {
                    close(pipes[j][0]);
                    out[n_out++] = pipes[j][1];
                } else {
                    close(pipes[j][1]);
                    if (j == i)
                        in = pipes[j][0];
                    else
                        close(pipes[j][0]);
                }
            }
            exit(run_rank(o, o->rank + i, o->device + i, in, out, n_out));
        }
        children[i] = pid;
        n_children = i + 1;
    }
    for (int j = 1; by_pipe && j < n; j++) {
        close(pipes[j][0]);
        close(pipes[j][1]);
    }
    /* A rank that fails stops the job: the others see it at the same step and exit on their
     * own; whoever is still there after GRACE_MS (a rank stuck in a collective whose peer
     * died) gets SIGTERM. */
    int status = 0, left = n, waited_ms = -1;
    while (left > 0) {
        int st;
        pid_t pid = waitpid(-1, &st, WNOHANG);
        if (pid < 0 && errno != EINTR)
            die("wait: %s", strerror(errno));
        if (pid <= 0) {
            struct timespec ts = {0, 20 * 1000 * 1000};
            nanosleep(&ts, NULL);
            if (waited_ms >= 0 && (waited_ms += 20) >= GRACE_MS) {
                forward(SIGTERM);
                waited_ms = -1;
            }
            continue;
        }
        for (int i = 0; i < n; i++) {
            if (children[i] != pid)
                continue;
            children[i] = 0;
            left--;
            if (WIFEXITED(st) && WEXITSTATUS(st) == 0)
                break;
            if (status == 0) {
                if (WIFEXITED(st))
                    printf("nccl_allreduce: rank %d exited with status %d\n", o->rank + i,
                           WEXITSTATUS(st));
                else
                    printf("nccl_allreduce: rank %d killed by signal %d\n", o->rank + i,
                           WTERMSIG(st));
                fflush(stdout);
                status = 1;
                waited_ms = 0;
            }
        }
    }
    return status;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    opts_t o = parse(argc, argv);
    if (o.ranks > 0)
        return launch(&o);
    return run_rank(&o, o.rank, o.device, -1, NULL, 0);
}
