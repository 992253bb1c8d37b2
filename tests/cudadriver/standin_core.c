/* CUDA driver stand-in: init, errors, devices, contexts (tests only; see README.md). */
#include "standin.h"
#include "standin_uuid.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <unistd.h>

#define CTX_MAGIC 0x43545831u

pthread_mutex_t g_lock;
int g_inited, g_nphys = 2, g_nvis, g_vis[MAXDEV], g_phys2ord[MAXDEV];
int g_trace, g_fabric;
double g_copy_gbps;
__thread int t_ptds;
__thread int t_in_hostfn;
struct sctx *g_ctxs;
struct sctx *g_primary[MAXDEV];
CUresult g_dev_sticky[MAXDEV];
static int g_driver_version = 13050;
static unsigned long long g_next_id = 1;

static __thread struct sctx *t_stack[64];
static __thread int t_depth;

int g_forked;

static void lock_init(void) {
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&g_lock, &a);
    pthread_mutexattr_destroy(&a);
}

static void atfork_prepare(void) { pthread_mutex_lock(&g_lock); }
static void atfork_parent(void) { pthread_mutex_unlock(&g_lock); }
/* The driver does not support a fork after cuInit: in such a child every
   call, cuInit included, returns CUDA_ERROR_NOT_INITIALIZED (the state the
   child inherited is the parent's and is never used, not even at exit).
   The lock is made anew: the child's thread is not the owner the recursive
   mutex recorded, so it could not unlock it. */
static void atfork_child(void) {
    if (g_inited) {
        g_inited = 0;
        g_forked = 1;
    }
    lock_init();
}

__attribute__((constructor)) static void standin_setup(void) {
    lock_init();
    /* A fork while another thread holds the lock must not leave it held. */
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
    const char *t = getenv("GPUSHARE_STANDIN_TRACE");
    g_trace = t && *t && strcmp(t, "0") != 0;
    const char *v = getenv("GPUSHARE_STANDIN_DRIVER_VERSION");
    if (v && *v) g_driver_version = atoi(v);
    const char *bw = getenv("GPUSHARE_STANDIN_COPY_GBPS");
    if (bw && *bw) g_copy_gbps = atof(bw);
}

int standin_lock(void) {
    pthread_mutex_lock(&g_lock);
    return 1;
}

void standin_unlock(int *unused) {
    (void)unused;
    pthread_mutex_unlock(&g_lock);
}

void standin_note(const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "gpushare-standin[%d]: %s\n", (int)getpid(), buf);
}

unsigned long long next_id(void) { return g_next_id++; }

/* ---------------------------------------------------------------- errors */

static const struct { int code; const char *name, *text; } ERRORS[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {4, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {208, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
    {211, "CUDA_ERROR_NOT_MAPPED", "resource not mapped"},
    {217, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", "peer access is not supported between these two devices"},
    {304, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {704, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", "peer access is already enabled"},
    {705, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED", "peer access has not been enabled"},
    {709, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", "part or all of the requested memory range is already mapped"},
    {713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "pointer does not correspond to a registered memory region"},
    {800, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static const char *err_name(int code) {
    for (size_t i = 0; i < sizeof ERRORS / sizeof ERRORS[0]; i++)
        if (ERRORS[i].code == code) return ERRORS[i].name;
    return NULL;
}

EXPORT CUresult cuGetErrorName(CUresult error, const char **pStr) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    *pStr = err_name(error);
    return *pStr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult error, const char **pStr) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof ERRORS / sizeof ERRORS[0]; i++)
        if (ERRORS[i].code == error) {
            *pStr = ERRORS[i].text;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult standin_ret(const char *fn, CUresult r) {
    if (g_trace) {
        const char *n = err_name(r);
        standin_note("%s -> %s", fn, n ? n : "?");
    }
    return r;
}

/* ---------------------------------------------------------------- helpers */

void random_hex(char *out, size_t nbytes) {
    unsigned char b[32];
    if (nbytes > sizeof b) nbytes = sizeof b;
    size_t got = 0;
    while (got < nbytes) {
        ssize_t k = getrandom(b + got, nbytes - got, 0);
        if (k <= 0) {
            if (k < 0 && errno == EINTR) continue;
            for (; got < nbytes; got++) b[got] = (unsigned char)rand();
            break;
        }
        got += (size_t)k;
    }
    for (size_t i = 0; i < nbytes; i++) sprintf(out + 2 * i, "%02x", b[i]);
    out[2 * nbytes] = 0;
}

uint64_t fnv1a(const void *data, size_t n) {
    const unsigned char *p = data;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* CUDA_VISIBLE_DEVICES as the driver reads it: indices or GPU-<uuid prefix>,
   the list ends at the first invalid entry (unknown, ambiguous or repeated). */
static void parse_visible(void) {
    for (int i = 0; i < MAXDEV; i++) g_phys2ord[i] = -1;
    g_nvis = 0;
    const char *v = getenv("CUDA_VISIBLE_DEVICES");
    if (!v) {
        for (int i = 0; i < g_nphys; i++) {
            g_vis[i] = i;
            g_phys2ord[i] = i;
        }
        g_nvis = g_nphys;
        return;
    }
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", v);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (isspace((unsigned char)*tok)) tok++;
        size_t len = strlen(tok);
        while (len && isspace((unsigned char)tok[len - 1])) tok[--len] = 0;
        int phys = -1;
        if (len == 0) break;
        if (strncasecmp(tok, "GPU-", 4) == 0) {
            int matches = 0;
            for (int i = 0; i < g_nphys; i++) {
                char u[64];
                standin_uuid_text(i, u);
                if (len <= strlen(u) && strncasecmp(u, tok, len) == 0) {
                    matches++;
                    phys = i;
                }
            }
            if (matches != 1) break;
        } else {
            int ok = 1;
            for (size_t i = 0; i < len; i++) ok &= isdigit((unsigned char)tok[i]) != 0;
            if (!ok || len > 4) break;
            phys = atoi(tok);
            if (phys >= g_nphys) break;
        }
        if (g_phys2ord[phys] != -1) break;
        g_phys2ord[phys] = g_nvis;
        g_vis[g_nvis++] = phys;
    }
}

/* Every call but cuDriverGetVersion, cuGetErrorName/String and
   cuGetProcAddress passes here (directly or through ordinal_to_phys and
   need_ctx). */
CUresult need_init(void) {
    if (t_in_hostfn) return CUDA_ERROR_NOT_PERMITTED; /* "must not make any CUDA API calls" */
    return g_inited ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult ordinal_to_phys(CUdevice ord, int *phys) {
    CUresult r0 = need_init();
    if (r0) return r0;
    if (ord < 0 || ord >= g_nvis) return CUDA_ERROR_INVALID_DEVICE;
    *phys = g_vis[ord];
    return CUDA_SUCCESS;
}

int ctx_valid(struct sctx *c) {
    if (!c) return 0;
    for (struct sctx *x = g_ctxs; x; x = x->next)
        if (x == c) return x->magic == CTX_MAGIC;
    return 0;
}

struct sctx *cur_ctx(void) { return t_depth ? t_stack[t_depth - 1] : NULL; }

CUresult ctx_usable(struct sctx *c) {
    if (!ctx_valid(c)) return CUDA_ERROR_INVALID_CONTEXT;
    if (!c->active) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    return c->sticky;
}

/* The calling thread's current context, usable, or why not. */
CUresult need_ctx(struct sctx **out) {
    CUresult r0 = need_init();
    if (r0) return r0;
    struct sctx *c = cur_ctx();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    CUresult r = ctx_usable(c);
    if (r) return r;
    *out = c;
    return CUDA_SUCCESS;
}

static struct sctx *ctx_new(int phys, int primary, unsigned flags);

struct sctx *primary_of(int phys) {
    if (!g_primary[phys]) g_primary[phys] = ctx_new(phys, 1, 0);
    return g_primary[phys];
}

/* ---------------------------------------------------------------- init, version */

EXPORT CUresult cuInit(unsigned int flags) {
    GUARD;
    if (t_in_hostfn) RET(CUDA_ERROR_NOT_PERMITTED);
    if (flags != 0) RET(CUDA_ERROR_INVALID_VALUE);
    if (g_forked) RET(CUDA_ERROR_NOT_INITIALIZED); /* forked after the parent's cuInit */
    if (!g_inited) {
        const char *n = getenv("GPUSHARE_STANDIN_DEVICES");
        if (n && *n) {
            g_nphys = atoi(n);
            if (g_nphys < 0) g_nphys = 0;
            if (g_nphys > MAXDEV) g_nphys = MAXDEV;
        }
        const char *f = getenv("GPUSHARE_STANDIN_FABRIC");
        g_fabric = f && strcmp(f, "1") == 0;
        parse_visible();
        g_inited = 1;
    }
    RET(g_nvis ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE);
}

EXPORT CUresult cuDriverGetVersion(int *v) {
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = g_driver_version;
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- devices */

EXPORT CUresult cuDeviceGetCount(int *count) {
    GUARD;
    if (!count) RET(CUDA_ERROR_INVALID_VALUE);
    if (need_init()) RET(need_init());
    *count = g_nvis;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    GUARD;
    int phys;
    if (!dev) RET(CUDA_ERROR_INVALID_VALUE);
    CUresult r = ordinal_to_phys(ordinal, &phys);
    if (r) RET(r);
    *dev = ordinal;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    GUARD;
    int phys;
    CUresult r = ordinal_to_phys(dev, &phys);
    if (r) RET(r);
    if (!name || len <= 0) RET(CUDA_ERROR_INVALID_VALUE);
    snprintf(name, (size_t)len, "gpushare CUDA driver stand-in");
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
    GUARD;
    int phys;
    CUresult r = ordinal_to_phys(dev, &phys);
    if (r) RET(r);
    if (!uuid) RET(CUDA_ERROR_INVALID_VALUE);
    standin_uuid(phys, (unsigned char *)uuid->bytes);
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) { return cuDeviceGetUuid(uuid, dev); }

static const size_t TOTAL_MEM = (size_t)80 << 30;

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    GUARD;
    int phys;
    CUresult r = ordinal_to_phys(dev, &phys);
    if (r) RET(r);
    if (!bytes) RET(CUDA_ERROR_INVALID_VALUE);
    *bytes = TOTAL_MEM;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceGetPCIBusId(char *bus, int len, CUdevice dev) {
    GUARD;
    int phys;
    CUresult r = ordinal_to_phys(dev, &phys);
    if (r) RET(r);
    if (!bus || len < 13) RET(CUDA_ERROR_INVALID_VALUE);
    snprintf(bus, (size_t)len, "0000:%02x:00.0", 0x40 + phys);
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev) {
    GUARD;
    int phys;
    CUresult r = ordinal_to_phys(dev, &phys);
    if (r) RET(r);
    if (!major || !minor) RET(CUDA_ERROR_INVALID_VALUE);
    *major = 9;
    *minor = 0;
    RET(CUDA_SUCCESS);
}

static int attribute_value(int attr, int phys, int *known) {
    *known = 1;
    switch (attr) {
    case 1: return 1024;                 /* MAX_THREADS_PER_BLOCK */
    case 2: case 3: return 1024;         /* MAX_BLOCK_DIM_X/Y */
    case 4: return 64;
    case 5: return 2147483647;           /* MAX_GRID_DIM_X */
    case 6: case 7: return 65535;
    case 8: return 49152;                /* MAX_SHARED_MEMORY_PER_BLOCK */
    case 9: return 65536;
    case 10: return 32;                  /* WARP_SIZE */
    case 11: return 2147483647;
    case 12: return 65536;
    case 13: return 1980000;             /* CLOCK_RATE */
    case 14: return 512;
    case 15: return 1;
    case 16: return 132;                 /* MULTIPROCESSOR_COUNT */
    case 19: return 1;                   /* CAN_MAP_HOST_MEMORY */
    case 31: return 1;                   /* CONCURRENT_KERNELS */
    case 33: return 0x40 + phys;         /* PCI_BUS_ID */
    case 34: return 0;
    case 36: return 2619000;
    case 37: return 5120;
    case 38: return 52428800;
    case 39: return 2048;
    case 40: return 3;                   /* ASYNC_ENGINE_COUNT */
    case 41: return 1;                   /* UNIFIED_ADDRESSING */
    case 50: return 0;                   /* PCI_DOMAIN_ID */
    case 75: return 9;                   /* COMPUTE_CAPABILITY_MAJOR */
    case 76: return 0;
    case 78: return 1;                   /* STREAM_PRIORITIES_SUPPORTED */
    case 81: return 233472;
    case 82: return 65536;
    case 83: return 0;                   /* MANAGED_MEMORY: not implemented */
    case 86: return 0;
    case 89: return 0;                   /* CONCURRENT_MANAGED_ACCESS */
    case 91: return 1;
    case 95: return 1;
    case 97: return 232448;
    case 99: return 1;                   /* HOST_REGISTER_SUPPORTED */
    case 102: return 1;                  /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    case 103: return 1;                  /* HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED */
    case 106: return 32;
    case 110: return 1;                  /* GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED */
    case 113: return 1;
    case 115: return 1;                  /* MEMORY_POOLS_SUPPORTED */
    case 116: return 1;                  /* GPU_DIRECT_RDMA_SUPPORTED */
    case 117: return 1;
    case 118: return 100;
    case 119: return HT_POSIX_FD | (g_fabric ? HT_FABRIC : 0); /* MEMPOOL_SUPPORTED_HANDLE_TYPES */
    case 120: return 1;
    case 124: return 1;                  /* DMA_BUF_SUPPORTED */
    case 125: return 1;                  /* IPC_EVENT_SUPPORTED */
    case 126: return 4;
    case 128: return g_fabric;           /* HANDLE_TYPE_FABRIC_SUPPORTED */
    case 130: return 0;
    case 131: return -1;
    case 134: return -1;
    default: break;
    }
    *known = 0;
    return 0;
}

EXPORT CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev) {
    GUARD;
    int phys, known;
    CUresult r = ordinal_to_phys(dev, &phys);
    if (r) RET(r);
    if (!pi || attrib <= 0 || attrib >= 162) RET(CUDA_ERROR_INVALID_VALUE);
    *pi = attribute_value(attrib, phys, &known);
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer) {
    GUARD;
    int a, b;
    CUresult r = ordinal_to_phys(dev, &a);
    if (!r) r = ordinal_to_phys(peer, &b);
    if (r) RET(r);
    if (!can) RET(CUDA_ERROR_INVALID_VALUE);
    *can = a != b;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *bus) {
    GUARD;
    if (need_init()) RET(need_init());
    if (!dev || !bus) RET(CUDA_ERROR_INVALID_VALUE);
    for (int o = 0; o < g_nvis; o++) {
        char want[32];
        snprintf(want, sizeof want, "0000:%02x:00.0", 0x40 + g_vis[o]);
        if (strcasecmp(want, bus) == 0 || strcasecmp(want + 5, bus) == 0) {
            *dev = o;
            RET(CUDA_SUCCESS);
        }
    }
    RET(CUDA_ERROR_INVALID_DEVICE);
}

/* ---------------------------------------------------------------- contexts */

static struct sctx *ctx_new(int phys, int primary, unsigned flags) {
    struct sctx *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->magic = CTX_MAGIC;
    c->phys = phys;
    c->primary = primary;
    c->flags = flags;
    c->sticky = g_dev_sticky[phys];
    c->id = next_id();
    c->next = g_ctxs;
    g_ctxs = c;
    return c;
}

static void ctx_activate(struct sctx *c) {
    c->active = 1;
    c->sticky = g_dev_sticky[c->phys]; /* a reset or a new context does not clear a sticky error */
    if (!c->legacy) {
        struct sstream *s = calloc(1, sizeof *s);
        s->magic = 0x53545231u;
        s->ctx = c;
        s->kind = SK_LEGACY;
        s->id = next_id();
        s->next = c->streams;
        c->streams = s;
        c->legacy = s;
    }
}

/* Ends a context's life: its queued work runs first (errors included). */
static void ctx_deactivate(struct sctx *c) {
    drain_ctx(c);
    stream_free_all(c);
    c->legacy = NULL;
    c->active = 0;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    GUARD;
    int phys;
    CUresult r = ordinal_to_phys(dev, &phys);
    if (r) RET(r);
    if (!pctx) RET(CUDA_ERROR_INVALID_VALUE);
    struct sctx *c = primary_of(phys);
    if (!c) RET(CUDA_ERROR_OUT_OF_MEMORY);
    if (c->refs++ == 0) ctx_activate(c);
    *pctx = c;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    GUARD;
    int phys;
    CUresult r = ordinal_to_phys(dev, &phys);
    if (r) RET(r);
    struct sctx *c = g_primary[phys];
    if (!c || c->refs == 0) RET(CUDA_ERROR_INVALID_CONTEXT);
    if (--c->refs == 0) ctx_deactivate(c);
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    GUARD;
    int phys;
    CUresult r = ordinal_to_phys(dev, &phys);
    if (r) RET(r);
    struct sctx *c = g_primary[phys];
    if (c && c->active) {
        ctx_deactivate(c);
        c->refs = 0;
    }
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    GUARD;
    int phys;
    CUresult r = ordinal_to_phys(dev, &phys);
    if (r) RET(r);
    if (!flags || !active) RET(CUDA_ERROR_INVALID_VALUE);
    struct sctx *c = g_primary[phys];
    *flags = c ? c->flags : 0;
    *active = c ? c->active : 0;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags) {
    GUARD;
    int phys;
    CUresult r = ordinal_to_phys(dev, &phys);
    if (r) RET(r);
    if (flags & ~0xffu) RET(CUDA_ERROR_INVALID_VALUE);
    struct sctx *c = primary_of(phys);
    c->flags = flags;
    RET(CUDA_SUCCESS);
}

static CUresult ctx_create(CUcontext *pctx, unsigned flags, CUdevice dev) {
    int phys;
    CUresult r = ordinal_to_phys(dev, &phys);
    if (r) return r;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    struct sctx *c = ctx_new(phys, 0, flags);
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    c->refs = 1;
    ctx_activate(c);
    if (t_depth >= 64) return CUDA_ERROR_OUT_OF_MEMORY;
    t_stack[t_depth++] = c;
    *pctx = c;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    GUARD;
    RET(ctx_create(pctx, flags, dev));
}

EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, void *params, int nparams, unsigned int flags, CUdevice dev) {
    GUARD;
    if (nparams > 0 || params) RET(CUDA_ERROR_NOT_SUPPORTED);
    RET(ctx_create(pctx, flags, dev));
}

EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, void *createParams, unsigned int flags, CUdevice dev) {
    GUARD;
    if (createParams) RET(CUDA_ERROR_NOT_SUPPORTED);
    RET(ctx_create(pctx, flags, dev));
}

EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
    GUARD;
    if (need_init()) RET(need_init());
    if (!ctx_valid(ctx) || ctx->primary || !ctx->active) RET(CUDA_ERROR_INVALID_CONTEXT);
    ctx_deactivate(ctx);
    for (int i = 0; i < t_depth; i++)
        if (t_stack[i] == ctx) t_stack[i] = NULL;
    if (t_depth && !t_stack[t_depth - 1]) t_depth--;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    GUARD;
    if (need_init()) RET(need_init());
    if (!ctx_valid(ctx)) RET(CUDA_ERROR_INVALID_CONTEXT);
    if (t_depth >= 64) RET(CUDA_ERROR_OUT_OF_MEMORY);
    t_stack[t_depth++] = ctx;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx) {
    GUARD;
    if (need_init()) RET(need_init());
    if (!t_depth) RET(CUDA_ERROR_INVALID_CONTEXT);
    struct sctx *c = t_stack[--t_depth];
    if (pctx) *pctx = c;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    GUARD;
    if (need_init()) RET(need_init());
    if (ctx && !ctx_valid(ctx)) RET(CUDA_ERROR_INVALID_CONTEXT);
    if (!ctx) {
        if (t_depth) t_depth--;
    } else if (t_depth) {
        t_stack[t_depth - 1] = ctx;
    } else {
        t_stack[t_depth++] = ctx;
    }
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx) {
    GUARD;
    if (need_init()) RET(need_init());
    if (!pctx) RET(CUDA_ERROR_INVALID_VALUE);
    *pctx = cur_ctx();
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxGetDevice(CUdevice *dev) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    if (!dev) RET(CUDA_ERROR_INVALID_VALUE);
    if (g_phys2ord[c->phys] < 0) RET(CUDA_ERROR_INVALID_DEVICE);
    *dev = g_phys2ord[c->phys];
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxGetDevice_v2(CUdevice *dev, CUcontext ctx) {
    GUARD;
    if (!ctx) RET(cuCtxGetDevice(dev));
    if (need_init()) RET(need_init());
    CUresult r = ctx_usable(ctx);
    if (r) RET(r);
    if (!dev) RET(CUDA_ERROR_INVALID_VALUE);
    *dev = g_phys2ord[ctx->phys];
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxGetFlags(unsigned int *flags) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    if (!flags) RET(CUDA_ERROR_INVALID_VALUE);
    *flags = c->flags;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxSetFlags(unsigned int flags) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    c->flags = flags;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxGetId(CUcontext ctx, unsigned long long *id) {
    GUARD;
    if (need_init()) RET(need_init());
    if (!ctx) ctx = cur_ctx();
    if (!ctx_valid(ctx)) RET(CUDA_ERROR_INVALID_CONTEXT);
    if (!id) RET(CUDA_ERROR_INVALID_VALUE);
    *id = ctx->id;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version) {
    GUARD;
    if (need_init()) RET(need_init());
    if (!ctx) ctx = cur_ctx();
    if (!ctx_valid(ctx)) RET(CUDA_ERROR_INVALID_CONTEXT);
    if (!version) RET(CUDA_ERROR_INVALID_VALUE);
    *version = 3020;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxSynchronize(void) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    drain_ctx(c);
    RET(c->sticky);
}

EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx) {
    GUARD;
    if (!ctx) RET(cuCtxSynchronize());
    if (need_init()) RET(need_init());
    CUresult r = ctx_usable(ctx);
    if (r) RET(r);
    drain_ctx(ctx);
    RET(ctx->sticky);
}

EXPORT CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned int flags) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    if (flags || !ctx_valid(peer)) RET(flags ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_INVALID_HANDLE);
    if (peer->phys == c->phys) RET(CUDA_ERROR_INVALID_DEVICE);
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxDisablePeerAccess(CUcontext peer) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    if (!ctx_valid(peer)) RET(CUDA_ERROR_INVALID_HANDLE);
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    if (!free_b || !total) RET(CUDA_ERROR_INVALID_VALUE);
    *total = TOTAL_MEM;
    *free_b = TOTAL_MEM - ((size_t)1 << 30);
    RET(CUDA_SUCCESS);
}
