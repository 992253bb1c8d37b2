/* Shared declarations of the CUDA driver stand-in (tests only; see README.md). */
#ifndef GPUSHARE_STANDIN_H
#define GPUSHARE_STANDIN_H

#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define EXPORT __attribute__((visibility("default")))
#define MAXDEV 16

/* ---- the driver's types, laid out as cuda.h lays them out ---- */
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct sctx *CUcontext;
typedef struct sstream *CUstream;
typedef struct sevent *CUevent;
typedef struct spool *CUmemoryPool;
typedef void (*CUhostFn)(void *userData);
typedef void (*CUstreamCallback)(CUstream hStream, CUresult status, void *userData);

typedef struct { int type; int id; } CUmemLocation; /* id shares its union with `localized` */
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;
typedef struct {
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
} CUmemAllocationProp;
typedef struct {
    int allocType;
    int handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char gpuDirectRDMACapable;
    unsigned char reserved[53];
} CUmemPoolProps;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char reserved[64]; } CUipcEventHandle;
typedef struct { unsigned char reserved[64]; } CUmemPoolPtrExportData;
typedef struct { unsigned char data[64]; } CUmemFabricHandle;
typedef struct { char bytes[16]; } CUuuid;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_ALREADY_MAPPED = 208,
    CUDA_ERROR_NOT_MAPPED = 211,
    CUDA_ERROR_PEER_ACCESS_UNSUPPORTED = 217,
    CUDA_ERROR_OPERATING_SYSTEM = 304,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
    CUDA_ERROR_PEER_ACCESS_NOT_ENABLED = 705,
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999,
};

enum { HT_POSIX_FD = 1, HT_WIN32 = 2, HT_WIN32_KMT = 4, HT_FABRIC = 8 };
enum { LOC_DEVICE = 1 };
enum { ACC_NONE = 0, ACC_READ = 1, ACC_RW = 3 };
#define STREAM_LEGACY ((CUstream)(uintptr_t)1)
#define STREAM_PER_THREAD ((CUstream)(uintptr_t)2)
#define STREAM_NON_BLOCKING 1u
#define EVENT_DISABLE_TIMING 2u
#define GRANULARITY ((size_t)2 << 20)

/* ---- the stand-in's own objects ---- */
struct op;

struct sctx {
    unsigned magic;
    int phys;            /* physical device index */
    int primary;
    int refs;            /* primary: retain count; others: 1 while alive */
    int active;
    unsigned flags;
    unsigned long long id;
    CUresult sticky;     /* an error of executed work: poisons every context of the device */
    struct sstream *legacy;
    struct sstream *streams; /* all streams of the context, legacy and dead ones included */
    struct sctx *next;
};

enum { SK_USER, SK_LEGACY, SK_PER_THREAD };

struct sstream {
    unsigned magic;
    struct sctx *ctx;
    unsigned flags;
    int prio;
    int kind;
    int dead;            /* destroyed by the caller; its queued work still runs */
    pthread_t owner;     /* SK_PER_THREAD */
    unsigned long long id;
    struct op *head, *tail;
    double busy_until_ms; /* timed-copy mode: when its queued work will have run */
    struct sstream *next;
};

struct sevent {
    unsigned magic;
    struct sctx *ctx;
    unsigned flags;
    struct op *rec;      /* the latest record, NULL before the first */
    struct sevent *next;
};

enum { OP_COPY, OP_SET, OP_RECORD, OP_WAIT, OP_HOSTFN, OP_CALLBACK, OP_POOLFREE };

struct op {
    int kind;
    int done;
    int refs;
    unsigned long long seq;
    struct sstream *s;
    struct op *next;
    uintptr_t dst, src;
    size_t n;
    void *staging;          /* owned copy of a pageable host source */
    unsigned setval;
    int setwidth;
    struct op *wait_for;    /* OP_WAIT */
    CUhostFn fn;
    CUstreamCallback cb;
    void *ud;
    double t_ms;            /* OP_RECORD: when it executed */
    double cost_ms;         /* timed-copy mode: how long the work takes (set before enqueue) */
    double ready_ms;        /* timed-copy mode: when it will have run on a GPU */
};

enum { RK_LEGACY = 1, RK_IPC, RK_HOST, RK_HOSTREG, RK_VMM, RK_POOL };

struct phys;
struct spool;

struct vmap {
    uintptr_t va;
    size_t size;
    size_t off;
    struct phys *p;
    unsigned char acc[MAXDEV];
    uintptr_t alias;        /* where the stand-in itself reaches the memory (never handed out) */
    struct vmap *next;
};

struct range {
    int kind;
    uintptr_t base;
    size_t size;
    int phys;               /* owning device, -1 for host memory */
    struct sctx *ctx;
    int fd;
    char nonce[33];
    int refs;
    unsigned flags;
    struct vmap *maps;      /* RK_VMM: mappings inside the reservation */
    struct spool *pool;     /* RK_POOL: the pool whose region this is */
    uintptr_t alias;        /* RK_LEGACY, RK_IPC: the private read-write mapping of fd */
    unsigned long long id;
    struct range *next;
};

struct phys {
    unsigned magic;
    size_t size;
    int fd;
    int htypes;
    int dev;                /* physical device index */
    int rdma;
    int hrefs;              /* allocation handles */
    int mrefs;              /* mappings */
    char shm[64];           /* fabric-capable: POSIX shared-memory name */
    int owns_shm;           /* created here: unlinked when released */
    unsigned long long id;
    struct phys *next;
};

struct pblock {
    size_t off, size;
    unsigned long long id;
    struct pblock *next;
};

struct spool {
    unsigned magic;
    int dev;
    int htypes;
    int imported;
    int is_default;
    int dying;
    int fd;
    uintptr_t base;         /* the device addresses: PROT_NONE */
    uintptr_t alias;        /* the private read-write mapping of fd */
    size_t cap;
    char nonce[33];
    struct pblock *blocks;  /* live allocations (imported pointers in an imported pool) */
    size_t used, used_high, reserved_high;
    unsigned long long threshold;
    int reuse[4];
    unsigned char acc[MAXDEV];
    struct range *region;
    struct spool *next;
};

/* ---- shared state and helpers (standin_core.c) ---- */
extern pthread_mutex_t g_lock;
extern int g_inited, g_nphys, g_nvis, g_vis[MAXDEV], g_phys2ord[MAXDEV];
extern int g_trace, g_fabric;
/* GPUSHARE_STANDIN_COPY_GBPS: timed-copy mode (0: off), see README.md */
extern double g_copy_gbps;
double standin_now_ms(void);
extern int g_forked; /* this process forked from one that had called cuInit */
extern __thread int t_ptds; /* inside a per-thread-default-stream variant */
extern __thread int t_in_hostfn; /* inside a host function or stream callback */
extern struct sctx *g_ctxs;
extern struct sctx *g_primary[MAXDEV];
extern CUresult g_dev_sticky[MAXDEV]; /* a sticky error of a device: for the rest of the process */

int standin_lock(void);
void standin_unlock(int *unused);
#define GUARD __attribute__((cleanup(standin_unlock))) int guard_ = standin_lock(); (void)guard_
CUresult standin_ret(const char *fn, CUresult r);
#define RET(x) return standin_ret(__func__, (x))
void standin_note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
unsigned long long next_id(void);
CUresult need_init(void);
CUresult ordinal_to_phys(CUdevice ord, int *phys);
int ctx_valid(struct sctx *c);
struct sctx *cur_ctx(void);
CUresult need_ctx(struct sctx **out);
CUresult ctx_usable(struct sctx *c);
struct sctx *primary_of(int phys);
void random_hex(char *out, size_t nbytes);
uint64_t fnv1a(const void *data, size_t n);

/* A per-thread default stream variant of an entry point: stream 0 (and the
   blocking forms' implicit stream) is CU_STREAM_PER_THREAD while it runs. */
#define PTDS(fn, params, args)                                                                               \
    EXPORT CUresult fn##_ptds params {                                                                       \
        t_ptds++;                                                                                            \
        CUresult r_ = fn args;                                                                               \
        t_ptds--;                                                                                            \
        return r_;                                                                                           \
    }

/* streams (standin_stream.c) */
CUresult resolve_stream(struct sctx *c, CUstream h, struct sstream **out);
struct op *op_new(int kind);
void op_unref(struct op *o);
void enqueue(struct sstream *s, struct op *o);
void run_until(struct op *o);
void drain_stream(struct sstream *s);
void drain_ctx(struct sctx *c);
void stream_free_all(struct sctx *c);
void poison_device(int phys, CUresult r);
CUresult copy_submit(struct sctx *c, CUstream h, uintptr_t dst, uintptr_t src, size_t n, int sync, int dir);
enum { DIR_ANY, DIR_HTOD, DIR_DTOH, DIR_DTOD };

/* memory (standin_mem.c) */
struct range *find_range(uintptr_t a);
struct range *range_add(int kind, uintptr_t base, size_t size, int phys);
void range_remove(struct range *r);
int make_memfd(const char *name, size_t size);
int fd_target(int fd, char *buf, size_t len);
struct vmap *find_map(struct range *r, uintptr_t a);
struct pblock *find_block(struct spool *p, uintptr_t a);
int is_device_addr(uintptr_t a);
int is_pinned_addr(uintptr_t a);
int host_span_ok(uintptr_t a, size_t n);
CUresult check_span(int phys, uintptr_t a, size_t n, int write);
uintptr_t alias_of(uintptr_t a, size_t *run);
void *reserve_none(size_t len);
void *map_alias(int fd, size_t len, off_t off);

/* pools (standin_pool.c) */
void pool_block_free(struct spool *p, uintptr_t a);
struct spool *default_pool(int phys);

#endif
