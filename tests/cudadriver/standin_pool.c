/* CUDA driver stand-in: memory pools, the stream-ordered allocator and pool
 * IPC (tests only; see README.md).
 *
 * Each pool is one sparse memfd with a first-fit allocator: its device
 * addresses are a PROT_NONE reservation, the stand-in reaches the bytes
 * through a private alias mapping (see standin_mem.c); an imported pool maps
 * the exporter's memfd the same way, and imported pointers are blocks in it
 * at the exporter's offsets.
 */
#include "standin.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define POOL_MAGIC 0x504f4f31u
#define POOL_ALIGN 512u

static struct spool *g_pools;
static struct spool *g_cur_pool[MAXDEV];
static struct spool *g_def_pool[MAXDEV];

static const char PTR_MAGIC[8] = "GSPPTv1";

static size_t default_pool_capacity(void) {
    const char *v = getenv("GPUSHARE_STANDIN_POOL_BYTES");
    size_t cap = v && *v ? (size_t)strtoull(v, NULL, 0) : ((size_t)1 << 30);
    if (cap < GRANULARITY) cap = GRANULARITY;
    return (cap + GRANULARITY - 1) / GRANULARITY * GRANULARITY;
}

static int pool_valid(struct spool *p) {
    for (struct spool *x = g_pools; x; x = x->next)
        if (x == p) return x->magic == POOL_MAGIC && !x->dying;
    return 0;
}

static struct spool *pool_map(int fd, int dev, int htypes, size_t cap, const char *nonce, int imported) {
    void *base = reserve_none(cap);
    void *al = base ? map_alias(fd, cap, 0) : NULL;
    struct spool *p = al ? calloc(1, sizeof *p) : NULL;
    struct range *rg = p ? range_add(RK_POOL, (uintptr_t)base, cap, dev) : NULL;
    if (!rg) {
        free(p);
        if (al) munmap(al, cap);
        if (base) munmap(base, cap);
        return NULL;
    }
    p->alias = (uintptr_t)al;
    p->magic = POOL_MAGIC;
    p->dev = dev;
    p->htypes = htypes;
    p->imported = imported;
    p->fd = fd;
    p->base = (uintptr_t)base;
    p->cap = cap;
    snprintf(p->nonce, sizeof p->nonce, "%s", nonce);
    p->acc[dev] = ACC_RW;
    p->region = rg;
    rg->pool = p;
    p->next = g_pools;
    g_pools = p;
    return p;
}

static struct spool *pool_create(int dev, int htypes, size_t cap) {
    char nonce[33], name[96];
    random_hex(nonce, 16);
    snprintf(name, sizeof name, "gs-standin-pool-d%d-%s", dev, nonce);
    int fd = make_memfd(name, cap);
    if (fd < 0) return NULL;
    struct spool *p = pool_map(fd, dev, htypes, cap, nonce, 0);
    if (!p) close(fd);
    return p;
}

static void pool_free(struct spool *p) {
    for (struct spool **pp = &g_pools; *pp; pp = &(*pp)->next)
        if (*pp == p) {
            *pp = p->next;
            break;
        }
    munmap((void *)p->base, p->cap);
    munmap((void *)p->alias, p->cap);
    close(p->fd);
    range_remove(p->region);
    for (int d = 0; d < MAXDEV; d++)
        if (g_cur_pool[d] == p) g_cur_pool[d] = NULL;
    p->magic = 0;
    free(p);
}

struct spool *default_pool(int phys) {
    if (!g_def_pool[phys]) {
        g_def_pool[phys] = pool_create(phys, 0, default_pool_capacity());
        if (g_def_pool[phys]) g_def_pool[phys]->is_default = 1;
    }
    return g_def_pool[phys];
}

static struct spool *current_pool(int phys) { return g_cur_pool[phys] ? g_cur_pool[phys] : default_pool(phys); }

static CUresult pool_alloc(struct spool *p, size_t size, uintptr_t *out) {
    size = (size + POOL_ALIGN - 1) / POOL_ALIGN * POOL_ALIGN;
    size_t off = 0;
    struct pblock **pp = &p->blocks;
    for (; *pp; pp = &(*pp)->next) {
        if ((*pp)->off - off >= size) break;
        off = (*pp)->off + (*pp)->size;
    }
    if (off + size > p->cap || off + size < off) return CUDA_ERROR_OUT_OF_MEMORY;
    struct pblock *b = calloc(1, sizeof *b);
    if (!b) return CUDA_ERROR_OUT_OF_MEMORY;
    b->off = off;
    b->size = size;
    b->id = next_id();
    b->next = *pp;
    *pp = b;
    p->used += size;
    if (p->used > p->used_high) p->used_high = p->used;
    if (off + size > p->reserved_high) p->reserved_high = off + size;
    *out = p->base + off;
    return CUDA_SUCCESS;
}

void pool_block_free(struct spool *p, uintptr_t a) {
    size_t off = a - p->base;
    for (struct pblock **pp = &p->blocks; *pp; pp = &(*pp)->next)
        if ((*pp)->off == off) {
            struct pblock *b = *pp;
            *pp = b->next;
            p->used -= b->size;
            if (!p->imported && b->size >= ((size_t)64 << 10))
                fallocate(p->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)b->off, (off_t)b->size);
            free(b);
            break;
        }
    if (p->dying && !p->blocks) pool_free(p);
}

static CUresult check_pool_location(const CUmemLocation *loc, int *phys) {
    if (!loc) return CUDA_ERROR_INVALID_VALUE;
    if (loc->type != LOC_DEVICE) return CUDA_ERROR_NOT_SUPPORTED;
    return ordinal_to_phys(loc->id, phys);
}

EXPORT CUresult cuMemPoolCreate(CUmemoryPool *out, const CUmemPoolProps *props) {
    GUARD;
    int phys;
    CUresult r = need_init();
    if (r) RET(r);
    if (!out || !props || props->allocType != 1) RET(CUDA_ERROR_INVALID_VALUE);
    if ((r = check_pool_location(&props->location, &phys))) RET(r);
    int ht = props->handleTypes;
    if (ht & ~(HT_POSIX_FD | HT_WIN32 | HT_WIN32_KMT | HT_FABRIC)) RET(CUDA_ERROR_INVALID_VALUE);
    if (ht & ~HT_POSIX_FD) RET(CUDA_ERROR_NOT_SUPPORTED);
    size_t cap = props->maxSize ? (props->maxSize + GRANULARITY - 1) / GRANULARITY * GRANULARITY
                                : default_pool_capacity();
    struct spool *p = pool_create(phys, ht, cap);
    if (!p) RET(CUDA_ERROR_OUT_OF_MEMORY);
    *out = p;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemPoolDestroy(CUmemoryPool p) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    if (!pool_valid(p) || p->is_default) RET(CUDA_ERROR_INVALID_VALUE);
    for (int d = 0; d < MAXDEV; d++)
        if (g_cur_pool[d] == p) g_cur_pool[d] = NULL;
    if (p->blocks)
        p->dying = 1; /* released once its last allocation is freed */
    else
        pool_free(p);
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool p, int attr, void *value) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    if (!pool_valid(p) || !value) RET(CUDA_ERROR_INVALID_VALUE);
    switch (attr) {
    case 1: case 2: case 3: p->reuse[attr] = *(int *)value; break;
    case 4: p->threshold = *(unsigned long long *)value; break;
    case 6: if (*(unsigned long long *)value) RET(CUDA_ERROR_INVALID_VALUE); p->reserved_high = 0; break;
    case 8: if (*(unsigned long long *)value) RET(CUDA_ERROR_INVALID_VALUE); p->used_high = p->used; break;
    default: RET(CUDA_ERROR_INVALID_VALUE);
    }
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool p, int attr, void *value) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    if (!pool_valid(p) || !value) RET(CUDA_ERROR_INVALID_VALUE);
    size_t reserved = 0;
    for (struct pblock *b = p->blocks; b; b = b->next)
        if (b->off + b->size > reserved) reserved = b->off + b->size;
    switch (attr) {
    case 1: case 2: case 3: *(int *)value = p->reuse[attr]; break;
    case 4: *(unsigned long long *)value = p->threshold; break;
    case 5: *(unsigned long long *)value = reserved; break;
    case 6: *(unsigned long long *)value = p->reserved_high; break;
    case 7: *(unsigned long long *)value = p->used; break;
    case 8: *(unsigned long long *)value = p->used_high; break;
    case 9: *(int *)value = 1; break;
    case 10: *(int *)value = p->htypes; break;
    case 11: *(int *)value = g_phys2ord[p->dev]; break;
    case 12: *(int *)value = LOC_DEVICE; break;
    case 13: *(unsigned long long *)value = p->cap; break;
    default: RET(CUDA_ERROR_INVALID_VALUE);
    }
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemPoolSetAccess(CUmemoryPool p, const CUmemAccessDesc *desc, size_t count) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    if (!pool_valid(p) || (!desc && count)) RET(CUDA_ERROR_INVALID_VALUE);
    for (size_t i = 0; i < count; i++) {
        int phys, f = desc[i].flags;
        if (desc[i].location.type != LOC_DEVICE) RET(CUDA_ERROR_INVALID_VALUE);
        if ((r = ordinal_to_phys(desc[i].location.id, &phys))) RET(r);
        if (f != ACC_NONE && f != ACC_READ && f != ACC_RW) RET(CUDA_ERROR_INVALID_VALUE);
        if (phys == p->dev && f != ACC_RW) RET(CUDA_ERROR_INVALID_DEVICE); /* the resident device's: never revoked */
    }
    for (size_t i = 0; i < count; i++) {
        int phys;
        ordinal_to_phys(desc[i].location.id, &phys);
        p->acc[phys] = (unsigned char)desc[i].flags;
    }
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemPoolGetAccess(int *flags, CUmemoryPool p, CUmemLocation *loc) {
    GUARD;
    int phys;
    CUresult r = need_init();
    if (r) RET(r);
    if (!pool_valid(p) || !flags || !loc || loc->type != LOC_DEVICE) RET(CUDA_ERROR_INVALID_VALUE);
    if ((r = ordinal_to_phys(loc->id, &phys))) RET(r);
    *flags = p->acc[phys];
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool p, size_t keep) {
    GUARD;
    (void)keep;
    CUresult r = need_init();
    if (r) RET(r);
    if (!pool_valid(p)) RET(CUDA_ERROR_INVALID_VALUE);
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t size, CUmemoryPool p, CUstream h) {
    GUARD;
    struct sstream *s;
    CUresult r = need_init();
    if (r) RET(r);
    if ((r = resolve_stream(cur_ctx(), h, &s))) RET(r);
    if (!dptr || size == 0 || !pool_valid(p) || p->imported) RET(CUDA_ERROR_INVALID_VALUE);
    uintptr_t a;
    if ((r = pool_alloc(p, size, &a))) RET(r);
    *dptr = (CUdeviceptr)a; /* usable in stream order from here on */
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream h) {
    GUARD;
    struct sstream *s;
    CUresult r = need_init();
    if (r) RET(r);
    if ((r = resolve_stream(cur_ctx(), h, &s))) RET(r);
    struct spool *p = current_pool(s->ctx->phys);
    if (!p) RET(CUDA_ERROR_OUT_OF_MEMORY);
    RET(cuMemAllocFromPoolAsync(dptr, size, p, h));
}

EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream h) {
    GUARD;
    struct sstream *s;
    CUresult r = need_init();
    if (r) RET(r);
    if ((r = resolve_stream(cur_ctx(), h, &s))) RET(r);
    struct range *rg = find_range((uintptr_t)dptr);
    if (!rg || rg->kind != RK_POOL) RET(CUDA_ERROR_INVALID_VALUE);
    struct pblock *b = find_block(rg->pool, (uintptr_t)dptr);
    if (!b || rg->pool->base + b->off != (uintptr_t)dptr || b->id == 0) RET(CUDA_ERROR_INVALID_VALUE);
    b->id = 0; /* a free is queued: a second one is an error */
    struct op *o = op_new(OP_POOLFREE);
    if (!o) RET(CUDA_ERROR_OUT_OF_MEMORY);
    o->dst = (uintptr_t)dptr;
    enqueue(s, o);
    RET(CUDA_SUCCESS);
}

/* The default (current=0) or current (current=1) pool of a location. */
static CUresult get_pool(CUmemoryPool *out, CUmemLocation *loc, int type, int current) {
    int phys;
    CUresult r = need_init();
    if (r) return r;
    if (!out || type != 1) return CUDA_ERROR_INVALID_VALUE;
    if ((r = check_pool_location(loc, &phys))) return r;
    *out = current ? current_pool(phys) : default_pool(phys);
    return *out ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuMemGetDefaultMemPool(CUmemoryPool *out, CUmemLocation *loc, int type) {
    GUARD;
    RET(get_pool(out, loc, type, 0));
}

EXPORT CUresult cuMemGetMemPool(CUmemoryPool *out, CUmemLocation *loc, int type) {
    GUARD;
    RET(get_pool(out, loc, type, 1));
}

EXPORT CUresult cuMemSetMemPool(CUmemLocation *loc, int type, CUmemoryPool p) {
    GUARD;
    int phys;
    CUresult r = need_init();
    if (r) RET(r);
    if (type != 1 || !pool_valid(p) || p->imported) RET(CUDA_ERROR_INVALID_VALUE);
    if ((r = check_pool_location(loc, &phys))) RET(r);
    if (p->dev != phys) RET(CUDA_ERROR_INVALID_DEVICE);
    g_cur_pool[phys] = p;
    RET(CUDA_SUCCESS);
}

/* The per-device forms are the location forms for a device location. */
EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *out, CUdevice dev) {
    CUmemLocation loc = {LOC_DEVICE, dev};
    return cuMemGetDefaultMemPool(out, &loc, 1);
}

EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *out, CUdevice dev) {
    CUmemLocation loc = {LOC_DEVICE, dev};
    return cuMemGetMemPool(out, &loc, 1);
}

EXPORT CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool p) {
    CUmemLocation loc = {LOC_DEVICE, dev};
    return cuMemSetMemPool(&loc, 1, p);
}

EXPORT CUresult cuMemPoolExportToShareableHandle(void *out, CUmemoryPool p, int type, unsigned long long flags) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    if (!out || flags || !pool_valid(p) || p->imported) RET(CUDA_ERROR_INVALID_VALUE);
    if (type != HT_POSIX_FD) RET(CUDA_ERROR_NOT_SUPPORTED);
    if (!(p->htypes & HT_POSIX_FD)) RET(CUDA_ERROR_INVALID_VALUE); /* not created with that handle type */
    int fd = fcntl(p->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) RET(CUDA_ERROR_OPERATING_SYSTEM);
    *(int *)out = fd;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemPoolImportFromShareableHandle(CUmemoryPool *out, void *handle, int type,
                                                   unsigned long long flags) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    if (!out || flags) RET(CUDA_ERROR_INVALID_VALUE);
    if (type != HT_POSIX_FD) RET(CUDA_ERROR_NOT_SUPPORTED);
    int src = (int)(intptr_t)handle, dev;
    char target[256], nonce[33];
    struct stat st;
    if (src < 0 || fcntl(src, F_GETFD) < 0 || fd_target(src, target, sizeof target) != 0 ||
        sscanf(target, "/memfd:gs-standin-pool-d%d-%32[0-9a-f]", &dev, nonce) != 2 || strlen(nonce) != 32 ||
        fstat(src, &st) != 0 || st.st_size <= 0)
        RET(CUDA_ERROR_INVALID_VALUE);
    if (dev < 0 || dev >= g_nphys || g_phys2ord[dev] < 0) RET(CUDA_ERROR_INVALID_DEVICE);
    int fd = fcntl(src, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) RET(CUDA_ERROR_OPERATING_SYSTEM);
    struct spool *p = pool_map(fd, dev, HT_POSIX_FD, (size_t)st.st_size, nonce, 1);
    if (!p) {
        close(fd);
        RET(CUDA_ERROR_OUT_OF_MEMORY);
    }
    *out = p;
    RET(CUDA_SUCCESS);
}

struct ptr_export {
    char magic[8];
    char nonce[32];
    uint64_t off;
    uint64_t size;
    uint64_t check;
};
_Static_assert(sizeof(struct ptr_export) == 64, "pointer export data is 64 bytes");

EXPORT CUresult cuMemPoolExportPointer(CUmemPoolPtrExportData *out, CUdeviceptr ptr) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    struct range *rg = find_range((uintptr_t)ptr);
    if (!out || !rg || rg->kind != RK_POOL || rg->pool->imported) RET(CUDA_ERROR_INVALID_VALUE);
    struct spool *p = rg->pool;
    struct pblock *b = find_block(p, (uintptr_t)ptr);
    if (!b || p->base + b->off != (uintptr_t)ptr) RET(CUDA_ERROR_INVALID_VALUE);
    if (!(p->htypes & HT_POSIX_FD)) RET(CUDA_ERROR_INVALID_VALUE);
    struct ptr_export e;
    memset(&e, 0, sizeof e);
    memcpy(e.magic, PTR_MAGIC, 8);
    memcpy(e.nonce, p->nonce, 32);
    e.off = b->off;
    e.size = b->size;
    e.check = fnv1a(&e, offsetof(struct ptr_export, check));
    memcpy(out, &e, sizeof e);
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemPoolImportPointer(CUdeviceptr *out, CUmemoryPool p, CUmemPoolPtrExportData *data) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    if (!out || !data || !pool_valid(p) || !p->imported) RET(CUDA_ERROR_INVALID_VALUE);
    struct ptr_export e;
    memcpy(&e, data, sizeof e);
    if (memcmp(e.magic, PTR_MAGIC, 8) != 0 || e.check != fnv1a(&e, offsetof(struct ptr_export, check)) ||
        memcmp(e.nonce, p->nonce, 32) != 0 || e.size == 0 || e.off + e.size > p->cap || e.off + e.size < e.off)
        RET(CUDA_ERROR_INVALID_VALUE);
    struct pblock **pp = &p->blocks;
    for (; *pp && (*pp)->off < e.off; pp = &(*pp)->next) {}
    if (*pp && (*pp)->off == e.off) {
        *out = (CUdeviceptr)(p->base + e.off);
        RET(CUDA_SUCCESS);
    }
    struct pblock *b = calloc(1, sizeof *b);
    if (!b) RET(CUDA_ERROR_OUT_OF_MEMORY);
    b->off = e.off;
    b->size = e.size;
    b->id = next_id();
    b->next = *pp;
    *pp = b;
    p->used += b->size;
    *out = (CUdeviceptr)(p->base + e.off);
    RET(CUDA_SUCCESS);
}

/* ---------------------------------------------------------------- per-thread default stream variants */

PTDS(cuMemAllocAsync, (CUdeviceptr *d, size_t n, CUstream h), (d, n, h))
PTDS(cuMemAllocFromPoolAsync, (CUdeviceptr *d, size_t n, CUmemoryPool p, CUstream h), (d, n, p, h))
PTDS(cuMemFreeAsync, (CUdeviceptr d, CUstream h), (d, h))
