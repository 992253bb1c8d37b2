/* CUDA driver stand-in: memory kinds, VMM, legacy IPC (tests only; see README.md).
 *
 * Device memory is memfds (POSIX shared memory for fabric-capable VMM
 * allocations) that the CPU cannot reach at their device addresses: those are
 * PROT_NONE reservations, so a CPU load or store there is a SIGSEGV, as on a
 * GPU.  The stand-in's own copies and memsets reach the bytes through a
 * private alias, a read-write mapping of the same memfd elsewhere, which it
 * never hands out (alias_of translates).  A table of ranges classifies every
 * pointer; unknown ones are pageable host.  Pools are in standin_pool.c.
 */
#include "standin.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define PHYS_MAGIC 0x50485931u

static struct range *g_ranges;
static struct phys *g_phys;

static const char IPC_MAGIC[8] = "GSIPCv1";
static const char FAB_MAGIC[8] = "GSFABv1";

static size_t page_round(size_t n) {
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    return (n + pg - 1) / pg * pg;
}

/* ---------------------------------------------------------------- range table */

struct range *find_range(uintptr_t a) {
    for (struct range *r = g_ranges; r; r = r->next)
        if (a >= r->base && a - r->base < r->size) return r;
    return NULL;
}

struct range *range_add(int kind, uintptr_t base, size_t size, int phys) {
    struct range *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->kind = kind;
    r->base = base;
    r->size = size;
    r->phys = phys;
    r->fd = -1;
    r->refs = 1;
    r->id = next_id();
    r->next = g_ranges;
    g_ranges = r;
    return r;
}

void range_remove(struct range *r) {
    for (struct range **pp = &g_ranges; *pp; pp = &(*pp)->next)
        if (*pp == r) {
            *pp = r->next;
            break;
        }
    free(r);
}

static int overlaps_any(uintptr_t a, size_t n) {
    for (struct range *r = g_ranges; r; r = r->next)
        if (a < r->base + r->size && r->base < a + n) return 1;
    return 0;
}

struct vmap *find_map(struct range *r, uintptr_t a) {
    for (struct vmap *m = r->maps; m; m = m->next)
        if (a >= m->va && a - m->va < m->size) return m;
    return NULL;
}

struct pblock *find_block(struct spool *p, uintptr_t a) {
    size_t off = a - p->base;
    for (struct pblock *b = p->blocks; b; b = b->next)
        if (off >= b->off && off - b->off < b->size) return b;
    return NULL;
}

int is_device_addr(uintptr_t a) {
    struct range *r = find_range(a);
    return r && r->kind != RK_HOST && r->kind != RK_HOSTREG;
}

int is_pinned_addr(uintptr_t a) {
    struct range *r = find_range(a);
    return r && (r->kind == RK_HOST || r->kind == RK_HOSTREG);
}

/* Whether [a, a+n) is mapped host memory (checked before it is read or written). */
int host_span_ok(uintptr_t a, size_t n) {
    static unsigned char vec[4096];
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    uintptr_t start = a / pg * pg, end = a + n;
    while (start < end) {
        size_t len = end - start;
        if (len > sizeof vec * pg) len = sizeof vec * pg;
        if (mincore((void *)start, len, vec) != 0) return 0;
        start += len;
    }
    return 1;
}

static int next_range_start(uintptr_t a, uintptr_t end, uintptr_t *out) {
    uintptr_t best = end;
    for (struct range *r = g_ranges; r; r = r->next)
        if (r->base > a && r->base < best) best = r->base;
    *out = best;
    return best < end;
}

/* Whether device `phys` may read (write=0) or write [a, a+n): the check a GPU's
   page tables make, done before any byte moves. */
CUresult check_span(int phys, uintptr_t a, size_t n, int write) {
    uintptr_t end = a + n;
    while (a < end) {
        struct range *r = find_range(a);
        if (!r) { /* host memory: it must still be mapped */
            uintptr_t nx;
            int more = next_range_start(a, end, &nx);
            if (!host_span_ok(a, nx - a)) return CUDA_ERROR_ILLEGAL_ADDRESS;
            if (!more) return CUDA_SUCCESS;
            a = nx;
            continue;
        }
        uintptr_t stop = r->base + r->size;
        if (r->kind == RK_VMM) {
            struct vmap *m = find_map(r, a);
            if (!m) return CUDA_ERROR_ILLEGAL_ADDRESS;
            int need = write ? ACC_RW : ACC_READ;
            if ((m->acc[phys] & need) != need) return CUDA_ERROR_ILLEGAL_ADDRESS;
            stop = m->va + m->size;
        } else if (r->kind == RK_POOL) {
            struct pblock *b = find_block(r->pool, a);
            if (!b) return CUDA_ERROR_ILLEGAL_ADDRESS;
            int need = write ? ACC_RW : ACC_READ; /* as granted by cuMemPoolSetAccess in this process */
            if ((r->pool->acc[phys] & need) != need) return CUDA_ERROR_ILLEGAL_ADDRESS;
            stop = r->pool->base + b->off + b->size;
        }
        a = stop < end ? stop : end;
    }
    return CUDA_SUCCESS;
}

/* Where the stand-in itself reads or writes the byte at `a` (device memory:
   its alias; host memory: `a`), and in *run how many bytes from there on are
   contiguous in the same way.  0 for a part of a reservation that is not
   mapped (check_span refuses those first). */
uintptr_t alias_of(uintptr_t a, size_t *run) {
    struct range *r = find_range(a);
    if (!r) {
        uintptr_t nx;
        *run = next_range_start(a, UINTPTR_MAX, &nx) ? nx - a : SIZE_MAX - a;
        return a;
    }
    *run = r->base + r->size - a;
    switch (r->kind) {
    case RK_LEGACY:
    case RK_IPC:
        return r->alias + (a - r->base);
    case RK_POOL:
        return r->pool->alias + (a - r->pool->base);
    case RK_VMM: {
        struct vmap *m = find_map(r, a);
        if (!m) return 0;
        *run = m->va + m->size - a;
        return m->alias + (a - m->va);
    }
    default: /* pinned host memory */
        return a;
    }
}

/* Device addresses: reserved, never accessible to the CPU. */
void *reserve_none(size_t len) {
    void *p = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

/* The stand-in's own read-write view of [off, off+len) of a memfd. */
void *map_alias(int fd, size_t len, off_t off) {
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, off);
    return p == MAP_FAILED ? NULL : p;
}

int make_memfd(const char *name, size_t size) {
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0) return -1;
    if (ftruncate(fd, (off_t)size) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* The name an fd refers to, as /proc shows it ("/memfd:NAME (deleted)"). */
int fd_target(int fd, char *buf, size_t len) {
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ssize_t k = readlink(path, buf, len - 1);
    if (k < 0) return -1;
    buf[k] = 0;
    return 0;
}

/* ---------------------------------------------------------------- legacy allocations */

/* Gives memfd `fd` (size bytes) device addresses (PROT_NONE) and an alias
   as a range of `kind`, which owns the fd from then on; NULL, with the fd
   closed, when it fails. */
static struct range *map_fd_range(int kind, int fd, size_t size, int phys, struct sctx *c, const char *nonce) {
    size_t len = page_round(size);
    void *p = reserve_none(len);
    void *al = p ? map_alias(fd, len, 0) : NULL;
    struct range *rg = al ? range_add(kind, (uintptr_t)p, size, phys) : NULL;
    if (!rg) {
        if (al) munmap(al, len);
        if (p) munmap(p, len);
        close(fd);
        return NULL;
    }
    rg->alias = (uintptr_t)al;
    rg->fd = fd;
    rg->ctx = c;
    snprintf(rg->nonce, sizeof rg->nonce, "%s", nonce);
    return rg;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    if (!dptr || size == 0) RET(CUDA_ERROR_INVALID_VALUE);
    char nonce[33], name[96];
    random_hex(nonce, 16);
    snprintf(name, sizeof name, "gs-standin-ipc-d%d-%s", c->phys, nonce);
    int fd = make_memfd(name, page_round(size));
    if (fd < 0) RET(CUDA_ERROR_OUT_OF_MEMORY);
    struct range *rg = map_fd_range(RK_LEGACY, fd, size, c->phys, c, nonce);
    if (!rg) RET(CUDA_ERROR_OUT_OF_MEMORY);
    *dptr = (CUdeviceptr)rg->base;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    struct range *rg = find_range((uintptr_t)dptr);
    if (rg && rg->kind == RK_POOL) {
        struct pblock *b = find_block(rg->pool, (uintptr_t)dptr);
        if (!b || rg->pool->base + b->off != (uintptr_t)dptr) RET(CUDA_ERROR_INVALID_VALUE);
        drain_ctx(c);
        pool_block_free(rg->pool, (uintptr_t)dptr);
        RET(c->sticky);
    }
    if (!rg || rg->kind != RK_LEGACY || rg->base != (uintptr_t)dptr) RET(CUDA_ERROR_INVALID_VALUE);
    drain_ctx(c); /* cuMemFree synchronises */
    munmap((void *)rg->base, page_round(rg->size));
    munmap((void *)rg->alias, page_round(rg->size));
    close(rg->fd);
    range_remove(rg);
    RET(c->sticky);
}

EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                   unsigned int elem) {
    if (!pitch || (elem != 4 && elem != 8 && elem != 16)) return CUDA_ERROR_INVALID_VALUE;
    *pitch = (width + 511) / 512 * 512;
    return cuMemAlloc_v2(dptr, *pitch * height);
}

/* ---------------------------------------------------------------- pinned host memory */

static CUresult host_alloc(void **pp, size_t size, unsigned flags) {
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) return r;
    if (!pp || size == 0) return CUDA_ERROR_INVALID_VALUE;
    void *p = mmap(NULL, page_round(size), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    struct range *rg = range_add(RK_HOST, (uintptr_t)p, size, -1);
    if (!rg) {
        munmap(p, page_round(size));
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    rg->ctx = c;
    rg->flags = flags;
    *pp = p;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAllocHost_v2(void **pp, size_t size) {
    GUARD;
    RET(host_alloc(pp, size, 0));
}

EXPORT CUresult cuMemHostAlloc(void **pp, size_t size, unsigned int flags) {
    GUARD;
    if (flags & ~0xfu) RET(CUDA_ERROR_INVALID_VALUE);
    RET(host_alloc(pp, size, flags));
}

static void drain_all(void) {
    for (struct sctx *c = g_ctxs; c; c = c->next) drain_ctx(c);
}

EXPORT CUresult cuMemFreeHost(void *p) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    struct range *rg = find_range((uintptr_t)p);
    if (!rg || rg->kind != RK_HOST || rg->base != (uintptr_t)p) RET(CUDA_ERROR_INVALID_VALUE);
    drain_all();
    munmap(p, page_round(rg->size));
    range_remove(rg);
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemHostRegister_v2(void *p, size_t size, unsigned int flags) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    if (!p || size == 0 || (flags & ~0xfu)) RET(CUDA_ERROR_INVALID_VALUE);
    if (overlaps_any((uintptr_t)p, size)) RET(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    if (!host_span_ok((uintptr_t)p, size)) RET(CUDA_ERROR_INVALID_VALUE);
    struct range *rg = range_add(RK_HOSTREG, (uintptr_t)p, size, -1);
    if (!rg) RET(CUDA_ERROR_OUT_OF_MEMORY);
    rg->ctx = c;
    rg->flags = flags;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemHostUnregister(void *p) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    struct range *rg = find_range((uintptr_t)p);
    if (!rg || rg->kind != RK_HOSTREG || rg->base != (uintptr_t)p) RET(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
    drain_all();
    range_remove(rg);
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pd, void *p, unsigned int flags) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    if (!pd || flags) RET(CUDA_ERROR_INVALID_VALUE);
    if (!is_pinned_addr((uintptr_t)p)) RET(CUDA_ERROR_INVALID_VALUE);
    *pd = (CUdeviceptr)(uintptr_t)p;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemHostGetFlags(unsigned int *flags, void *p) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    struct range *rg = find_range((uintptr_t)p);
    if (!flags || !rg || (rg->kind != RK_HOST && rg->kind != RK_HOSTREG)) RET(CUDA_ERROR_INVALID_VALUE);
    *flags = rg->flags;
    RET(CUDA_SUCCESS);
}

/* ---------------------------------------------------------------- VMM */

static struct phys *phys_lookup(CUmemGenericAllocationHandle h) {
    for (struct phys *p = g_phys; p; p = p->next)
        if ((CUmemGenericAllocationHandle)(uintptr_t)p == h && p->magic == PHYS_MAGIC && p->hrefs > 0) return p;
    return NULL;
}

static void phys_maybe_free(struct phys *p) {
    if (p->hrefs > 0 || p->mrefs > 0) return;
    for (struct phys **pp = &g_phys; *pp; pp = &(*pp)->next)
        if (*pp == p) {
            *pp = p->next;
            break;
        }
    close(p->fd);
    if (p->owns_shm) shm_unlink(p->shm);
    p->magic = 0;
    free(p);
}

/* Names of fabric-capable allocations this process created go with it, even
   when it exits without releasing them (a killed process still leaves them). */
__attribute__((destructor)) static void unlink_fabric_names(void) {
    if (g_forked) return; /* the parent's names */
    for (struct phys *p = g_phys; p; p = p->next)
        if (p->owns_shm) shm_unlink(p->shm);
}

static struct phys *phys_new(int fd, size_t size, int htypes, int dev, int rdma) {
    struct phys *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->magic = PHYS_MAGIC;
    p->fd = fd;
    p->size = size;
    p->htypes = htypes;
    p->dev = dev;
    p->rdma = rdma;
    p->hrefs = 1;
    p->id = next_id();
    p->next = g_phys;
    g_phys = p;
    return p;
}

static CUresult check_prop(const CUmemAllocationProp *prop, int *phys) {
    if (!prop || prop->type != 1 || prop->location.type != LOC_DEVICE) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = ordinal_to_phys(prop->location.id, phys);
    return r == CUDA_ERROR_INVALID_DEVICE ? CUDA_ERROR_INVALID_DEVICE : r;
}

EXPORT CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop, int option) {
    GUARD;
    int phys;
    CUresult r = need_init();
    if (r) RET(r);
    if (!g || option < 0 || option > 1) RET(CUDA_ERROR_INVALID_VALUE);
    if ((r = check_prop(prop, &phys))) RET(r);
    *g = GRANULARITY;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags) {
    GUARD;
    int phys;
    CUresult r = need_init();
    if (r) RET(r);
    if (!handle || flags || size == 0 || size % GRANULARITY) RET(CUDA_ERROR_INVALID_VALUE);
    if ((r = check_prop(prop, &phys))) RET(r);
    int ht = prop->requestedHandleTypes;
    if (ht & ~(HT_POSIX_FD | HT_WIN32 | HT_WIN32_KMT | HT_FABRIC)) RET(CUDA_ERROR_INVALID_VALUE);
    if (ht & (HT_WIN32 | HT_WIN32_KMT)) RET(CUDA_ERROR_NOT_SUPPORTED);
    if ((ht & HT_FABRIC) && !g_fabric) RET(CUDA_ERROR_NOT_PERMITTED); /* no IMEX channel on this node */
    int rdma = prop->gpuDirectRDMACapable != 0;
    int fd;
    char shm[64] = "";
    if (ht & HT_FABRIC) {
        char hex[9];
        random_hex(hex, 4);
        snprintf(shm, sizeof shm, "/gsf-%d-d%d-h%d-r%d-%s", (int)getpid(), phys, ht, rdma, hex);
        fd = shm_open(shm, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd >= 0 && ftruncate(fd, (off_t)size) != 0) {
            close(fd);
            shm_unlink(shm);
            fd = -1;
        }
    } else {
        char name[64];
        snprintf(name, sizeof name, "gs-standin-vmm-d%d-h%d-r%d", phys, ht, rdma);
        fd = make_memfd(name, size);
    }
    if (fd < 0) RET(CUDA_ERROR_OUT_OF_MEMORY);
    struct phys *p = phys_new(fd, size, ht, phys, rdma);
    if (!p) {
        close(fd);
        if (shm[0]) shm_unlink(shm);
        RET(CUDA_ERROR_OUT_OF_MEMORY);
    }
    if (shm[0]) {
        snprintf(p->shm, sizeof p->shm, "%s", shm);
        p->owns_shm = 1;
    }
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)p;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    struct phys *p = phys_lookup(h);
    if (!p) RET(CUDA_ERROR_INVALID_VALUE);
    p->hrefs--;
    phys_maybe_free(p);
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                                    unsigned long long flags) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    if (!ptr || size == 0 || size % GRANULARITY || (flags & ~1ull)) RET(CUDA_ERROR_INVALID_VALUE);
    if (align == 0) align = GRANULARITY;
    if (align & (align - 1)) RET(CUDA_ERROR_INVALID_VALUE);
    if (align < GRANULARITY) align = GRANULARITY;
    size_t len = size + align;
    void *hint = addr ? (void *)(uintptr_t)addr : NULL;
    char *p = mmap(hint, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) RET(CUDA_ERROR_OUT_OF_MEMORY);
    uintptr_t base = ((uintptr_t)p + align - 1) / align * align;
    if (base > (uintptr_t)p) munmap(p, base - (uintptr_t)p);
    uintptr_t tail = (uintptr_t)p + len, end = base + size;
    if (tail > end) munmap((void *)end, tail - end);
    if (!range_add(RK_VMM, base, size, -1)) {
        munmap((void *)base, size);
        RET(CUDA_ERROR_OUT_OF_MEMORY);
    }
    *ptr = (CUdeviceptr)base;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    struct range *rg = find_range((uintptr_t)ptr);
    if (!rg || rg->kind != RK_VMM || rg->base != (uintptr_t)ptr || rg->size != size) RET(CUDA_ERROR_INVALID_VALUE);
    while (rg->maps) { /* still mapped: the driver unmaps it (queued work touching it then fails) */
        struct vmap *m = rg->maps;
        rg->maps = m->next;
        munmap((void *)m->alias, m->size);
        m->p->mrefs--;
        phys_maybe_free(m->p);
        free(m);
    }
    munmap((void *)rg->base, rg->size);
    range_remove(rg);
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                         unsigned long long flags) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    struct phys *p = phys_lookup(h);
    if (!p || flags) RET(CUDA_ERROR_INVALID_VALUE);
    uintptr_t a = (uintptr_t)ptr;
    struct range *rg = find_range(a);
    if (!rg || rg->kind != RK_VMM || size == 0 || a + size > rg->base + rg->size) RET(CUDA_ERROR_INVALID_VALUE);
    if (a % GRANULARITY || size % GRANULARITY || offset % GRANULARITY || offset + size > p->size)
        RET(CUDA_ERROR_INVALID_VALUE);
    for (struct vmap *m = rg->maps; m; m = m->next)
        if (a < m->va + m->size && m->va < a + size) RET(CUDA_ERROR_INVALID_VALUE);
    struct vmap *m = calloc(1, sizeof *m);
    if (!m) RET(CUDA_ERROR_OUT_OF_MEMORY);
    void *al = map_alias(p->fd, size, (off_t)offset); /* the reservation itself stays PROT_NONE */
    if (!al) {
        free(m);
        RET(CUDA_ERROR_OUT_OF_MEMORY);
    }
    m->alias = (uintptr_t)al;
    m->va = a;
    m->size = size;
    m->off = offset;
    m->p = p;
    m->next = rg->maps;
    rg->maps = m;
    p->mrefs++;
    RET(CUDA_SUCCESS);
}

/* The mappings of reservation rg that cover [a, a+size) without gaps, or 0. */
static int covered(struct range *rg, uintptr_t a, size_t size, int whole) {
    uintptr_t end = a + size;
    while (a < end) {
        struct vmap *m = find_map(rg, a);
        if (!m || (whole && m->va != a)) return 0;
        if (whole && m->va + m->size > end) return 0;
        a = m->va + m->size;
    }
    return 1;
}

EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    uintptr_t a = (uintptr_t)ptr;
    struct range *rg = find_range(a);
    if (!rg || rg->kind != RK_VMM || size == 0 || a + size > rg->base + rg->size) RET(CUDA_ERROR_INVALID_VALUE);
    if (!covered(rg, a, size, 1)) RET(CUDA_ERROR_INVALID_VALUE);
    for (struct vmap **pp = &rg->maps; *pp;) {
        struct vmap *m = *pp;
        if (m->va >= a && m->va < a + size) {
            munmap((void *)m->alias, m->size);
            *pp = m->next;
            m->p->mrefs--;
            phys_maybe_free(m->p);
            free(m);
        } else {
            pp = &m->next;
        }
    }
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    uintptr_t a = (uintptr_t)ptr;
    struct range *rg = find_range(a);
    if (!desc || count == 0 || !rg || rg->kind != RK_VMM || size == 0 || a + size > rg->base + rg->size)
        RET(CUDA_ERROR_INVALID_VALUE);
    if (!covered(rg, a, size, 0)) RET(CUDA_ERROR_INVALID_VALUE);
    int phys[64];
    if (count > 64) RET(CUDA_ERROR_INVALID_VALUE);
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != LOC_DEVICE) RET(CUDA_ERROR_INVALID_VALUE);
        if ((r = ordinal_to_phys(desc[i].location.id, &phys[i]))) RET(r);
        int f = desc[i].flags;
        if (f != ACC_NONE && f != ACC_READ && f != ACC_RW) RET(CUDA_ERROR_INVALID_VALUE);
    }
    for (struct vmap *m = rg->maps; m; m = m->next) {
        if (!(a < m->va + m->size && m->va < a + size)) continue;
        for (size_t i = 0; i < count; i++) m->acc[phys[i]] = (unsigned char)desc[i].flags; /* the CPU: never */
    }
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemGetAccess(unsigned long long *flags, const CUmemLocation *loc, CUdeviceptr ptr) {
    GUARD;
    int phys;
    CUresult r = need_init();
    if (r) RET(r);
    if (!flags || !loc || loc->type != LOC_DEVICE) RET(CUDA_ERROR_INVALID_VALUE);
    if ((r = ordinal_to_phys(loc->id, &phys))) RET(r);
    struct range *rg = find_range((uintptr_t)ptr);
    struct vmap *m = rg && rg->kind == RK_VMM ? find_map(rg, (uintptr_t)ptr) : NULL;
    if (!m) RET(CUDA_ERROR_INVALID_VALUE);
    *flags = m->acc[phys];
    RET(CUDA_SUCCESS);
}

struct fabric_token {
    char magic[8];
    uint64_t size;
    int32_t dev;
    int32_t flags; /* rdma | handle types << 8 */
    char name[32];
    uint64_t check;
};
_Static_assert(sizeof(struct fabric_token) == 64, "fabric token is 64 bytes");

EXPORT CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type,
                                             unsigned long long flags) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    struct phys *p = phys_lookup(h);
    if (!p || !out || flags) RET(CUDA_ERROR_INVALID_VALUE);
    if (type != HT_POSIX_FD && type != HT_FABRIC) RET(CUDA_ERROR_NOT_SUPPORTED);
    if (!(p->htypes & type)) RET(CUDA_ERROR_INVALID_VALUE); /* not requested at cuMemCreate */
    if (type == HT_POSIX_FD) {
        int fd = fcntl(p->fd, F_DUPFD_CLOEXEC, 0);
        if (fd < 0) RET(CUDA_ERROR_OPERATING_SYSTEM);
        *(int *)out = fd;
        RET(CUDA_SUCCESS);
    }
    if (!p->shm[0]) RET(CUDA_ERROR_INVALID_VALUE);
    struct fabric_token t;
    memset(&t, 0, sizeof t);
    memcpy(t.magic, FAB_MAGIC, 8);
    t.size = p->size;
    t.dev = p->dev;
    t.flags = p->rdma | (p->htypes << 8);
    memcpy(t.name, p->shm, sizeof t.name - 1); /* names are under 32 bytes */
    t.check = fnv1a(&t, offsetof(struct fabric_token, check));
    memcpy(out, &t, sizeof t);
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *os, int type) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    if (!handle) RET(CUDA_ERROR_INVALID_VALUE);
    int dev, ht, rdma, fd;
    size_t size;
    char shmname[64] = "";
    if (type == HT_POSIX_FD) {
        int src = (int)(intptr_t)os;
        char target[256];
        struct stat st;
        if (src < 0 || fcntl(src, F_GETFD) < 0 || fd_target(src, target, sizeof target) != 0)
            RET(CUDA_ERROR_INVALID_VALUE);
        if (sscanf(target, "/memfd:gs-standin-vmm-d%d-h%d-r%d", &dev, &ht, &rdma) != 3 &&
            sscanf(target, "/dev/shm/gsf-%*d-d%d-h%d-r%d-", &dev, &ht, &rdma) != 3)
            RET(CUDA_ERROR_INVALID_VALUE); /* not memory a cuMemExportToShareableHandle made */
        if (fstat(src, &st) != 0 || st.st_size <= 0) RET(CUDA_ERROR_INVALID_VALUE);
        size = (size_t)st.st_size;
        fd = fcntl(src, F_DUPFD_CLOEXEC, 0);
        if (fd < 0) RET(CUDA_ERROR_OPERATING_SYSTEM);
    } else if (type == HT_FABRIC) {
        if (!g_fabric) RET(CUDA_ERROR_NOT_PERMITTED);
        struct fabric_token t;
        if (!os) RET(CUDA_ERROR_INVALID_VALUE);
        memcpy(&t, os, sizeof t);
        if (memcmp(t.magic, FAB_MAGIC, 8) != 0 || t.check != fnv1a(&t, offsetof(struct fabric_token, check)))
            RET(CUDA_ERROR_INVALID_VALUE);
        if (memchr(t.name, 0, sizeof t.name) == NULL || strncmp(t.name, "/gsf-", 5) != 0 ||
            strchr(t.name + 1, '/'))
            RET(CUDA_ERROR_INVALID_VALUE);
        fd = shm_open(t.name, O_RDWR | O_CLOEXEC, 0);
        if (fd < 0) RET(CUDA_ERROR_INVALID_VALUE); /* released by its exporter, or never existed */
        struct stat st;
        if (fstat(fd, &st) != 0 || (uint64_t)st.st_size != t.size || t.size == 0) {
            close(fd);
            RET(CUDA_ERROR_INVALID_VALUE);
        }
        size = (size_t)t.size;
        dev = t.dev;
        rdma = t.flags & 1;
        ht = t.flags >> 8;
        snprintf(shmname, sizeof shmname, "%s", t.name);
    } else {
        RET(CUDA_ERROR_NOT_SUPPORTED);
    }
    if (dev < 0 || dev >= g_nphys || g_phys2ord[dev] < 0) {
        close(fd);
        RET(CUDA_ERROR_INVALID_DEVICE); /* its device is not visible in this process */
    }
    struct phys *p = phys_new(fd, size, ht, dev, rdma);
    if (!p) {
        close(fd);
        RET(CUDA_ERROR_OUT_OF_MEMORY);
    }
    snprintf(p->shm, sizeof p->shm, "%s", shmname);
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)p;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    struct phys *p = phys_lookup(h);
    if (!p || !prop) RET(CUDA_ERROR_INVALID_VALUE);
    memset(prop, 0, sizeof *prop);
    prop->type = 1;
    prop->requestedHandleTypes = p->htypes;
    prop->location.type = LOC_DEVICE;
    prop->location.id = g_phys2ord[p->dev];
    prop->gpuDirectRDMACapable = (unsigned char)p->rdma;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    struct range *rg = find_range((uintptr_t)addr);
    struct vmap *m = rg && rg->kind == RK_VMM ? find_map(rg, (uintptr_t)addr) : NULL;
    if (!h || !m) RET(CUDA_ERROR_INVALID_VALUE);
    m->p->hrefs++;
    *h = (CUmemGenericAllocationHandle)(uintptr_t)m->p;
    RET(CUDA_SUCCESS);
}

/* ---------------------------------------------------------------- legacy IPC */

struct ipc_handle {
    char magic[8];
    int32_t pid;
    int32_t fd;
    uint64_t size;
    unsigned char nonce[16]; /* the nonce that is also in the memfd's name, as bytes */
    int32_t dev;
    int32_t pad;
    uint64_t reserved;
    uint64_t check;
};
_Static_assert(sizeof(struct ipc_handle) == 64, "IPC handle is 64 bytes");

static void hex_to_bytes(const char *hex, unsigned char *out, size_t n) {
    for (size_t i = 0; i < n; i++) {
        unsigned v = 0;
        sscanf(hex + 2 * i, "%2x", &v);
        out[i] = (unsigned char)v;
    }
}

EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *out, CUdeviceptr dptr) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    struct range *rg = find_range((uintptr_t)dptr);
    if (!out || !rg || rg->kind != RK_LEGACY) RET(CUDA_ERROR_INVALID_VALUE); /* pool, VMM, host: not IPC-capable */
    struct ipc_handle h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, IPC_MAGIC, 8);
    h.pid = (int32_t)getpid();
    h.fd = rg->fd;
    h.size = rg->size;
    hex_to_bytes(rg->nonce, h.nonce, 16);
    h.dev = rg->phys;
    h.check = fnv1a(&h, offsetof(struct ipc_handle, check));
    memcpy(out, &h, sizeof h);
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pd, CUipcMemHandle handle, unsigned int flags) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    if (!pd || (flags & ~1u)) RET(CUDA_ERROR_INVALID_VALUE);
    struct ipc_handle h;
    memcpy(&h, &handle, sizeof h);
    if (memcmp(h.magic, IPC_MAGIC, 8) != 0 || h.check != fnv1a(&h, offsetof(struct ipc_handle, check)))
        RET(CUDA_ERROR_INVALID_VALUE);
    if (h.pid == (int32_t)getpid()) RET(CUDA_ERROR_INVALID_CONTEXT); /* as the driver: not in the exporter */
    if (h.dev < 0 || h.dev >= g_nphys || h.size == 0) RET(CUDA_ERROR_INVALID_VALUE);
    char nonce[33];
    for (int i = 0; i < 16; i++) sprintf(nonce + 2 * i, "%02x", h.nonce[i]);
    for (struct range *x = g_ranges; x; x = x->next)
        if (x->kind == RK_IPC && strcmp(x->nonce, nonce) == 0) {
            x->refs++;
            *pd = (CUdeviceptr)x->base;
            RET(CUDA_SUCCESS);
        }
    char path[64], target[256], want[96];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)h.pid, (int)h.fd);
    snprintf(want, sizeof want, "/memfd:gs-standin-ipc-d%d-%s", (int)h.dev, nonce);
    ssize_t k = readlink(path, target, sizeof target - 1); /* look before opening anything */
    if (k < 0) RET(CUDA_ERROR_INVALID_VALUE);              /* the exporter is gone or freed it */
    target[k] = 0;
    if (strncmp(target, want, strlen(want)) != 0) RET(CUDA_ERROR_INVALID_VALUE);
    int fd = open(path, O_RDWR | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) RET(CUDA_ERROR_INVALID_VALUE);
    struct stat st;
    if (fd_target(fd, target, sizeof target) != 0 || strncmp(target, want, strlen(want)) != 0 ||
        fstat(fd, &st) != 0 || (uint64_t)st.st_size < h.size) {
        close(fd);
        RET(CUDA_ERROR_INVALID_VALUE); /* the fd number now names something else */
    }
    struct range *rg = map_fd_range(RK_IPC, fd, h.size, h.dev, c, nonce);
    if (!rg) RET(CUDA_ERROR_OUT_OF_MEMORY);
    *pd = (CUdeviceptr)rg->base;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    struct range *rg = find_range((uintptr_t)dptr);
    if (!rg || rg->kind != RK_IPC || rg->base != (uintptr_t)dptr) RET(CUDA_ERROR_INVALID_VALUE);
    if (--rg->refs > 0) RET(CUDA_SUCCESS);
    drain_all();
    munmap((void *)rg->base, page_round(rg->size));
    munmap((void *)rg->alias, page_round(rg->size));
    close(rg->fd);
    range_remove(rg);
    RET(CUDA_SUCCESS);
}

/* ---------------------------------------------------------------- pointer queries */

EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    uintptr_t a = (uintptr_t)dptr, base;
    size_t size;
    struct range *rg = find_range(a);
    if (!rg) RET(CUDA_ERROR_NOT_FOUND);
    if (rg->kind == RK_VMM) {
        struct vmap *m = find_map(rg, a);
        if (!m) RET(CUDA_ERROR_NOT_FOUND);
        base = m->va;
        size = m->size;
    } else if (rg->kind == RK_POOL) {
        struct pblock *b = find_block(rg->pool, a);
        if (!b) RET(CUDA_ERROR_NOT_FOUND);
        base = rg->pool->base + b->off;
        size = b->size;
    } else {
        base = rg->base;
        size = rg->size;
    }
    if (pbase) *pbase = (CUdeviceptr)base;
    if (psize) *psize = size;
    RET(CUDA_SUCCESS);
}

static void put(void *data, const void *v, size_t n) { memcpy(data, v, n); }

/* One attribute of a known pointer; `r` is its range (never NULL). */
static CUresult pointer_attr(int attr, uintptr_t a, struct range *r, void *data) {
    struct vmap *m = r->kind == RK_VMM ? find_map(r, a) : NULL;
    struct pblock *b = r->kind == RK_POOL ? find_block(r->pool, a) : NULL;
    if ((r->kind == RK_VMM && !m) || (r->kind == RK_POOL && !b)) return CUDA_ERROR_INVALID_VALUE;
    int host = r->kind == RK_HOST || r->kind == RK_HOSTREG;
    uintptr_t base = m ? m->va : b ? r->pool->base + b->off : r->base;
    size_t size = m ? m->size : b ? b->size : r->size;
    int dev = m ? m->p->dev : r->kind == RK_IPC ? r->ctx->phys : r->phys; /* IPC: the context it was opened in */
    struct sctx *cc = cur_ctx();
    unsigned char yes = 1, no = 0;
    switch (attr) {
    case 1: { /* CONTEXT */
        CUcontext c = (r->kind == RK_VMM || r->kind == RK_POOL) ? NULL : r->ctx;
        put(data, &c, sizeof c);
        return CUDA_SUCCESS;
    }
    case 2: { unsigned t = host ? 1 : 2; put(data, &t, 4); return CUDA_SUCCESS; }
    case 3: { CUdeviceptr d = a; put(data, &d, 8); return CUDA_SUCCESS; }
    case 4: {
        if (!host) return CUDA_ERROR_INVALID_VALUE;
        void *p = (void *)a;
        put(data, &p, sizeof p);
        return CUDA_SUCCESS;
    }
    case 6: put(data, &no, 1); return CUDA_SUCCESS;
    case 7: case 20: { unsigned long long id = b ? b->id : m ? m->p->id : r->id; put(data, &id, 8); return CUDA_SUCCESS; }
    case 8: put(data, &no, 1); return CUDA_SUCCESS;
    case 9: {
        int o = host ? (cc ? g_phys2ord[cc->phys] : 0) : (dev >= 0 ? g_phys2ord[dev] : -1);
        put(data, &o, 4);
        return CUDA_SUCCESS;
    }
    case 10: put(data, r->kind == RK_LEGACY ? &yes : &no, 1); return CUDA_SUCCESS;
    case 11: { CUdeviceptr d = base; put(data, &d, 8); return CUDA_SUCCESS; }
    case 12: put(data, &size, sizeof size); return CUDA_SUCCESS;
    case 13: put(data, &yes, 1); return CUDA_SUCCESS;
    case 14: {
        unsigned t = m ? (unsigned)m->p->htypes : r->kind == RK_POOL ? (unsigned)r->pool->htypes : 0;
        put(data, &t, 4);
        return CUDA_SUCCESS;
    }
    case 15: put(data, (m ? m->p->rdma : !host) ? &yes : &no, 1); return CUDA_SUCCESS;
    case 16: {
        unsigned f = ACC_RW;
        if (m) f = cc ? m->acc[cc->phys] : ACC_NONE;
        if (r->kind == RK_POOL) f = cc ? r->pool->acc[cc->phys] : ACC_NONE;
        put(data, &f, 4);
        return CUDA_SUCCESS;
    }
    case 17: { CUmemoryPool p = r->kind == RK_POOL ? r->pool : NULL; put(data, &p, sizeof p); return CUDA_SUCCESS; }
    case 18: put(data, &size, sizeof size); return CUDA_SUCCESS;
    case 19: { CUdeviceptr d = base; put(data, &d, 8); return CUDA_SUCCESS; }
    case 21: put(data, &no, 1); return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

/* Pointer queries need no current context: the driver finds a pointer's
   context through unified addressing (UCX asks from threads without one). */
static CUresult pointer_ctx(struct range *r) {
    (void)r;
    return need_init();
}

EXPORT CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr ptr) {
    GUARD;
    struct range *r = find_range((uintptr_t)ptr);
    CUresult e = pointer_ctx(r);
    if (e) RET(e);
    if (!data || !r) RET(CUDA_ERROR_INVALID_VALUE);
    RET(pointer_attr(attr, (uintptr_t)ptr, r, data));
}

EXPORT CUresult cuPointerGetAttributes(unsigned int n, int *attrs, void **data, CUdeviceptr ptr) {
    GUARD;
    struct range *r = find_range((uintptr_t)ptr);
    CUresult e = pointer_ctx(r);
    if (e) RET(e);
    if (!attrs || !data) RET(CUDA_ERROR_INVALID_VALUE);
    for (unsigned i = 0; i < n; i++) {
        if (!data[i]) RET(CUDA_ERROR_INVALID_VALUE);
        if (attrs[i] < 1 || attrs[i] > 21 || attrs[i] == 5) RET(CUDA_ERROR_INVALID_VALUE);
        if (r && pointer_attr(attrs[i], (uintptr_t)ptr, r, data[i]) == CUDA_SUCCESS) continue;
        /* Not a CUDA pointer: default values, as the driver does here. */
        static const size_t sizes[22] = {0, 8, 4, 8, 8, 0, 1, 8, 1, 4, 1, 8, 8, 1, 4, 1, 4, 8, 8, 8, 8, 1};
        memset(data[i], 0, sizes[attrs[i]]);
        if (attrs[i] == 9) *(int *)data[i] = -2;
    }
    RET(CUDA_SUCCESS);
}

/* ---------------------------------------------------------------- managed memory (absent) and the rest UCX links */

EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned int flags) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    if (!dptr || size == 0 || (flags != 1 && flags != 2)) RET(CUDA_ERROR_INVALID_VALUE);
    RET(CUDA_ERROR_NOT_SUPPORTED); /* the devices say MANAGED_MEMORY = 0 */
}

EXPORT CUresult cuMemRangeGetAttribute(void *data, size_t size, int attr, CUdeviceptr ptr, size_t count) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    RET(CUDA_ERROR_INVALID_VALUE); /* only managed memory has range attributes, and there is none */
}

/* Only CU_POINTER_ATTRIBUTE_SYNC_MEMOPS can be set; every copy here is synchronous with respect to others anyway. */
EXPORT CUresult cuPointerSetAttribute(const void *value, int attr, CUdeviceptr ptr) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    if (!value || attr != 6 || !is_device_addr((uintptr_t)ptr)) RET(CUDA_ERROR_INVALID_VALUE);
    RET(CUDA_SUCCESS);
}
