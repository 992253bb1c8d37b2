/* CUDA driver stand-in: streams, events, queued copies (tests only; see README.md).
 *
 * Every stream holds a FIFO of operations that run only at a synchronisation
 * point, in the thread that synchronises.  The legacy stream of a context waits
 * for earlier work of the context's blocking streams and they wait for its
 * earlier work, by a global sequence number.
 */
#include "standin.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define STREAM_MAGIC 0x53545231u
#define EVENT_MAGIC 0x45564e31u

static unsigned long long g_seq = 1;
static int g_exiting;
static struct sevent *g_events;

struct ptlist {
    struct sctx *ctx;
    struct sstream *s;
    struct ptlist *next;
};
static __thread struct ptlist *t_pt;

/* Copies n bytes as the kernel would for another process: a source that
   cannot be read or a destination that cannot be written (a read-only host
   buffer, memory unmapped meanwhile) gives -1 instead of a crash.  Overlapping
   ranges are not handled: source and destination are distinct allocations. */
static int safe_copy(uintptr_t dst, uintptr_t src, size_t n) {
    static int unavailable;
    while (n && !unavailable) {
        struct iovec local = {(void *)src, n}, remote = {(void *)dst, n};
        ssize_t k = process_vm_writev(getpid(), &local, 1, &remote, 1, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == ENOSYS || errno == EPERM)) {
            unavailable = 1; /* a sandbox without the call: plain copies */
            break;
        }
        if (k <= 0) return -1;
        dst += (size_t)k;
        src += (size_t)k;
        n -= (size_t)k;
    }
    if (n) memmove((void *)dst, (void *)src, n);
    return 0;
}

/* A copy of n bytes between device or host addresses, through the stand-in's
   aliases of device memory (the device addresses themselves are PROT_NONE),
   in pieces that are contiguous on both sides; a staged source is `staging`.
   -1 when a piece faults. */
static int alias_copy(uintptr_t dst, uintptr_t src, const void *staging, size_t n) {
    while (n) {
        size_t rd, rs = n, k;
        uintptr_t d = alias_of(dst, &rd);
        uintptr_t s = staging ? (uintptr_t)staging : alias_of(src, &rs);
        if (!d || !s) return -1;
        k = n < rd ? n : rd;
        if (rs < k) k = rs;
        if (safe_copy(d, s, k) != 0) return -1;
        dst += k;
        n -= k;
        if (staging)
            staging = (const char *)staging + k;
        else
            src += k;
    }
    return 0;
}

/* cuMemsetD8/16/32's pattern into n elements of `width` bytes at dst, through
   the aliases, copied from a buffer of the pattern like any copy (pinned host
   memory unmapped meanwhile gives -1 instead of a crash).  Pieces end at
   allocation boundaries, which are page-aligned, so no element is split. */
static int alias_set(uintptr_t dst, unsigned v, size_t n, int width) {
    static unsigned char pattern[1 << 16];
    for (size_t i = 0; i < sizeof pattern; i += (size_t)width) {
        if (width == 1) pattern[i] = (unsigned char)v;
        else if (width == 2) { unsigned short x = (unsigned short)v; memcpy(pattern + i, &x, 2); }
        else memcpy(pattern + i, &v, 4);
    }
    size_t left = n * (size_t)width;
    while (left) {
        size_t run;
        uintptr_t d = alias_of(dst, &run);
        size_t k = left < run ? left : run;
        if (k > sizeof pattern) k = sizeof pattern;
        if (!d || safe_copy(d, (uintptr_t)pattern, k) != 0) return -1;
        dst += k;
        left -= k;
    }
    return 0;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

double standin_now_ms(void) { return now_ms(); }

/* Timed-copy mode: a stream's work runs one operation after another, each
   from when it was queued or when the one before will have run, whichever is
   later, and takes its cost (a copy: its bytes at GPUSHARE_STANDIN_COPY_GBPS). */
static void time_op(struct sstream *s, struct op *o) {
    if (g_copy_gbps <= 0) return;
    double t = now_ms();
    if (s->busy_until_ms > t) t = s->busy_until_ms;
    o->ready_ms = t + o->cost_ms;
    s->busy_until_ms = o->ready_ms;
}

/* Timed-copy mode: whether `o` will have run by now on a GPU (a copy ran
   when queued: it is ready when its time has passed). */
static int op_ready(const struct op *o) { return g_copy_gbps <= 0 || !o || o->ready_ms <= now_ms(); }

/* Timed-copy mode: block until `t_ms`, without the lock (other threads'
   calls go on, as with a driver).  Only from a call that took the lock once
   (GUARD, not nested). */
static void sleep_unlocked_until(double t_ms) {
    double ms = t_ms - now_ms();
    if (ms <= 0) return;
    pthread_mutex_unlock(&g_lock);
    struct timespec ts = {(time_t)(ms / 1e3), (long)((ms - (double)(time_t)(ms / 1e3) * 1e3) * 1e6)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
    pthread_mutex_lock(&g_lock);
}

/* Timed-copy mode: block until `o` will have run on a GPU. */
static void wait_ready(struct op *o) {
    if (op_ready(o)) return;
    o->refs++;
    sleep_unlocked_until(o->ready_ms);
    op_unref(o);
}

static struct sstream *stream_new(struct sctx *c, int kind, unsigned flags, int prio) {
    struct sstream *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->magic = STREAM_MAGIC;
    s->ctx = c;
    s->kind = kind;
    s->flags = flags;
    s->prio = prio;
    s->id = next_id();
    s->next = c->streams;
    c->streams = s;
    return s;
}

static int stream_valid(struct sstream *s) {
    for (struct sctx *c = g_ctxs; c; c = c->next)
        for (struct sstream *x = c->streams; x; x = x->next)
            if (x == s) return !x->dead && x->magic == STREAM_MAGIC;
    return 0;
}

static int in_ctx(struct sctx *c, struct sstream *s) {
    for (struct sstream *x = c->streams; x; x = x->next)
        if (x == s) return 1;
    return 0;
}

static struct sstream *per_thread(struct sctx *c) {
    for (struct ptlist *p = t_pt; p; p = p->next)
        if (p->ctx == c) {
            if (!p->s || !in_ctx(c, p->s)) p->s = stream_new(c, SK_PER_THREAD, 0, 0); /* context was reset */
            if (p->s) p->s->owner = pthread_self();
            return p->s;
        }
    struct ptlist *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->ctx = c;
    p->s = stream_new(c, SK_PER_THREAD, 0, 0);
    if (!p->s) {
        free(p);
        return NULL;
    }
    p->s->owner = pthread_self();
    p->next = t_pt;
    t_pt = p;
    return p->s;
}

/* A stream handle (0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD or a created one)
   for work issued with `c` current; created streams carry their own context. */
CUresult resolve_stream(struct sctx *c, CUstream h, struct sstream **out) {
    if (!h) h = t_ptds ? STREAM_PER_THREAD : STREAM_LEGACY;
    if (h == STREAM_LEGACY || h == STREAM_PER_THREAD) {
        if (!c) return CUDA_ERROR_INVALID_CONTEXT;
        CUresult r = ctx_usable(c);
        if (r) return r;
        *out = h == STREAM_LEGACY ? c->legacy : per_thread(c);
        return *out ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (!stream_valid(h)) return CUDA_ERROR_INVALID_HANDLE;
    CUresult r = ctx_usable(h->ctx);
    if (r) return r;
    *out = h;
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- operations */

struct op *op_new(int kind) {
    struct op *o = calloc(1, sizeof *o);
    if (!o) return NULL;
    o->kind = kind;
    o->refs = 1;
    o->seq = g_seq++;
    return o;
}

void op_unref(struct op *o) {
    if (!o || --o->refs > 0) return;
    if (o->wait_for) op_unref(o->wait_for);
    free(o->staging);
    free(o);
}

void enqueue(struct sstream *s, struct op *o) {
    o->s = s;
    time_op(s, o);
    if (s->tail)
        s->tail->next = o;
    else
        s->head = o;
    s->tail = o;
}

static void run_head(struct sstream *s);

/* Runs `s` up to and including the operation numbered `seq`. */
static void run_stream_to(struct sstream *s, unsigned long long seq) {
    while (s->head && s->head->seq <= seq) run_head(s);
}

void run_until(struct op *o) {
    if (!o || o->done) return;
    o->refs++;
    while (!o->done && o->s && o->s->head) run_head(o->s);
    op_unref(o);
}

/* Legacy-stream semantics: work on the legacy stream waits for earlier work on
   the context's blocking streams, and theirs waits for earlier legacy work. */
static void run_dependencies(struct op *o) {
    struct sstream *s = o->s;
    struct sctx *c = s->ctx;
    if (s->kind == SK_LEGACY) {
        for (struct sstream *t = c->streams; t; t = t->next)
            if (t != s && !(t->flags & STREAM_NON_BLOCKING)) run_stream_to(t, o->seq - 1);
    } else if (!(s->flags & STREAM_NON_BLOCKING) && c->legacy) {
        run_stream_to(c->legacy, o->seq - 1);
    }
}

/* Work of a poisoned context is dropped: it never runs. */
static void discard_ctx(struct sctx *c) {
    for (struct sstream *s = c->streams; s; s = s->next) {
        while (s->head) {
            struct op *o = s->head;
            s->head = o->next;
            if (!s->head) s->tail = NULL;
            o->done = 1;
            op_unref(o);
        }
    }
}

/* A sticky error: every context of the device, present and future, returns
   it from then on, and their queued work never runs (a GPU's process must be
   restarted to use the device again). */
void poison_device(int phys, CUresult r) {
    if (!g_dev_sticky[phys]) g_dev_sticky[phys] = r;
    for (struct sctx *c = g_ctxs; c; c = c->next)
        if (c->phys == phys && !c->sticky) {
            c->sticky = g_dev_sticky[phys];
            discard_ctx(c);
        }
}

static CUresult exec_op(struct op *o) {
    int dev = o->s->ctx->phys;
    CUresult r;
    switch (o->kind) {
    case OP_COPY:
        if (o->n == 0) return CUDA_SUCCESS;
        r = check_span(dev, o->dst, o->n, 1);
        if (!r && !o->staging) r = check_span(dev, o->src, o->n, 0);
        if (r) {
            standin_note("illegal address: queued copy of %zu bytes 0x%lx <- 0x%lx on device %d; the device is "
                         "poisoned", o->n, (unsigned long)o->dst, (unsigned long)(o->staging ? 0 : o->src), dev);
            return r;
        }
        if (alias_copy(o->dst, o->src, o->staging, o->n) != 0) {
            standin_note("illegal address: queued copy of %zu bytes into 0x%lx faulted on device %d; the device "
                         "is poisoned", o->n, (unsigned long)o->dst, dev);
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        }
        return CUDA_SUCCESS;
    case OP_SET:
        r = check_span(dev, o->dst, o->n * (size_t)o->setwidth, 1);
        if (r) {
            standin_note("illegal address: queued memset at 0x%lx on device %d; the device is poisoned",
                         (unsigned long)o->dst, dev);
            return r;
        }
        if (alias_set(o->dst, o->setval, o->n, o->setwidth) != 0) {
            standin_note("illegal address: queued memset at 0x%lx faulted on device %d; the device is poisoned",
                         (unsigned long)o->dst, dev);
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        }
        return CUDA_SUCCESS;
    case OP_RECORD:
        o->t_ms = now_ms();
        return CUDA_SUCCESS;
    case OP_WAIT:
        run_until(o->wait_for);
        return CUDA_SUCCESS;
    case OP_HOSTFN: /* CUDA calls from inside answer CUDA_ERROR_NOT_PERMITTED */
        t_in_hostfn++;
        if (!g_exiting) o->fn(o->ud);
        t_in_hostfn--;
        return CUDA_SUCCESS;
    case OP_CALLBACK:
        t_in_hostfn++;
        if (!g_exiting) o->cb(o->s->dead ? NULL : o->s, CUDA_SUCCESS, o->ud);
        t_in_hostfn--;
        return CUDA_SUCCESS;
    case OP_POOLFREE: {
        struct range *rg = find_range(o->dst);
        if (rg && rg->kind == RK_POOL) pool_block_free(rg->pool, o->dst);
        return CUDA_SUCCESS;
    }
    }
    return CUDA_ERROR_UNKNOWN;
}

static void run_head(struct sstream *s) {
    struct op *o = s->head;
    o->refs++;
    run_dependencies(o);
    if (s->head != o || o->done) {
        op_unref(o);
        return;
    }
    s->head = o->next;
    if (!s->head) s->tail = NULL;
    struct sctx *c = s->ctx;
    CUresult r = c->sticky ? c->sticky : exec_op(o);
    o->done = 1;
    if (r && !c->sticky) poison_device(c->phys, r);
    op_unref(o); /* the queue's reference */
    op_unref(o);
}

void drain_stream(struct sstream *s) {
    while (s->head) run_head(s);
}

void drain_ctx(struct sctx *c) {
    int again = 1;
    while (again) {
        again = 0;
        for (struct sstream *s = c->streams; s; s = s->next)
            if (s->head) {
                drain_stream(s);
                again = 1;
            }
    }
}

/* Frees the streams of a context whose work has all run. */
void stream_free_all(struct sctx *c) {
    struct sstream *s = c->streams;
    while (s) {
        struct sstream *n = s->next;
        s->magic = 0;
        free(s);
        s = n;
    }
    c->streams = NULL;
}

/* At process exit the GPU would still finish the work it was given: queued
   copies and memsets land (visible to other processes sharing the memory);
   host functions no longer run, the interpreter that owns them is gone. */
__attribute__((destructor)) static void finish_at_exit(void) {
    /* A thread still inside a call (a daemon thread in a host function) keeps
       the lock: give up after a second rather than hang the exit. */
    if (g_forked) return; /* the parent's work, not this process's */
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 1;
    if (pthread_mutex_timedlock(&g_lock, &until) != 0) return;
    g_exiting = 1;
    for (struct sctx *c = g_ctxs; c; c = c->next)
        if (c->active) drain_ctx(c);
    pthread_mutex_unlock(&g_lock);
}

/* ---------------------------------------------------------------- streams */

EXPORT CUresult cuStreamCreate(CUstream *ph, unsigned int flags) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    if (!ph || (flags & ~STREAM_NON_BLOCKING)) RET(CUDA_ERROR_INVALID_VALUE);
    *ph = stream_new(c, SK_USER, flags, 0);
    RET(*ph ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY);
}

EXPORT CUresult cuStreamCreateWithPriority(CUstream *ph, unsigned int flags, int prio) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    if (!ph || (flags & ~STREAM_NON_BLOCKING)) RET(CUDA_ERROR_INVALID_VALUE);
    if (prio > 0) prio = 0;
    if (prio < -5) prio = -5;
    *ph = stream_new(c, SK_USER, flags, prio);
    RET(*ph ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY);
}

EXPORT CUresult cuStreamDestroy_v2(CUstream h) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    if (!stream_valid(h) || h->kind != SK_USER) RET(CUDA_ERROR_INVALID_HANDLE);
    h->dead = 1; /* queued work still runs at the context's next synchronisation */
    RET(CUDA_SUCCESS);
}

static CUresult stream_for(CUstream h, struct sstream **out) {
    CUresult r = need_init();
    if (r) return r;
    return resolve_stream(cur_ctx(), h, out);
}

EXPORT CUresult cuStreamSynchronize(CUstream h) {
    GUARD;
    struct sstream *s;
    CUresult r = stream_for(h, &s);
    if (r) RET(r);
    if (g_copy_gbps > 0) sleep_unlocked_until(s->busy_until_ms);
    drain_stream(s);
    RET(s->ctx->sticky);
}

EXPORT CUresult cuStreamQuery(CUstream h) {
    GUARD;
    struct sstream *s;
    CUresult r = stream_for(h, &s);
    if (r) RET(r);
    if (g_copy_gbps > 0) { /* timed: pending until its work will have run, then complete */
        if (s->busy_until_ms > now_ms()) RET(CUDA_ERROR_NOT_READY);
        drain_stream(s);
    } else if (s->head) {
        /* Report the pending work, then let it complete, as a GPU would. */
        drain_stream(s);
        RET(CUDA_ERROR_NOT_READY);
    }
    RET(s->ctx->sticky);
}

EXPORT CUresult cuStreamGetFlags(CUstream h, unsigned int *flags) {
    GUARD;
    struct sstream *s;
    CUresult r = stream_for(h, &s);
    if (r) RET(r);
    if (!flags) RET(CUDA_ERROR_INVALID_VALUE);
    *flags = s->flags;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamGetPriority(CUstream h, int *prio) {
    GUARD;
    struct sstream *s;
    CUresult r = stream_for(h, &s);
    if (r) RET(r);
    if (!prio) RET(CUDA_ERROR_INVALID_VALUE);
    *prio = s->prio;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamGetId(CUstream h, unsigned long long *id) {
    GUARD;
    struct sstream *s;
    CUresult r = stream_for(h, &s);
    if (r) RET(r);
    if (!id) RET(CUDA_ERROR_INVALID_VALUE);
    *id = s->id;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamGetCtx(CUstream h, CUcontext *pctx) {
    GUARD;
    struct sstream *s;
    CUresult r = stream_for(h, &s);
    if (r) RET(r);
    if (!pctx) RET(CUDA_ERROR_INVALID_VALUE);
    *pctx = s->ctx;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamGetCtx_v2(CUstream h, CUcontext *pctx, void **pgreen) {
    GUARD;
    struct sstream *s;
    CUresult r = stream_for(h, &s);
    if (r) RET(r);
    if (!pctx || !pgreen) RET(CUDA_ERROR_INVALID_VALUE);
    *pctx = s->ctx;
    *pgreen = NULL;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamGetDevice(CUstream h, CUdevice *dev) {
    GUARD;
    struct sstream *s;
    CUresult r = stream_for(h, &s);
    if (r) RET(r);
    if (!dev) RET(CUDA_ERROR_INVALID_VALUE);
    *dev = g_phys2ord[s->ctx->phys];
    RET(CUDA_SUCCESS);
}

static int event_valid(struct sevent *e) {
    for (struct sevent *x = g_events; x; x = x->next)
        if (x == e) return x->magic == EVENT_MAGIC;
    return 0;
}

EXPORT CUresult cuStreamWaitEvent(CUstream h, CUevent ev, unsigned int flags) {
    GUARD;
    struct sstream *s;
    CUresult r = stream_for(h, &s);
    if (r) RET(r);
    if (!event_valid(ev)) RET(CUDA_ERROR_INVALID_HANDLE);
    if (flags > 1) RET(CUDA_ERROR_INVALID_VALUE);
    if (!ev->rec || ev->rec->done) RET(CUDA_SUCCESS);
    struct op *o = op_new(OP_WAIT);
    if (!o) RET(CUDA_ERROR_OUT_OF_MEMORY);
    o->wait_for = ev->rec;
    ev->rec->refs++;
    enqueue(s, o);
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuLaunchHostFunc(CUstream h, CUhostFn fn, void *ud) {
    GUARD;
    struct sstream *s;
    CUresult r = stream_for(h, &s);
    if (r) RET(r);
    if (!fn) RET(CUDA_ERROR_INVALID_VALUE);
    struct op *o = op_new(OP_HOSTFN);
    if (!o) RET(CUDA_ERROR_OUT_OF_MEMORY);
    o->fn = fn;
    o->ud = ud;
    enqueue(s, o);
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuLaunchHostFunc_v2(CUstream h, CUhostFn fn, void *ud, unsigned int mode) {
    (void)mode;
    return cuLaunchHostFunc(h, fn, ud);
}

EXPORT CUresult cuStreamAddCallback(CUstream h, CUstreamCallback cb, void *ud, unsigned int flags) {
    GUARD;
    struct sstream *s;
    CUresult r = stream_for(h, &s);
    if (r) RET(r);
    if (!cb || flags) RET(CUDA_ERROR_INVALID_VALUE);
    struct op *o = op_new(OP_CALLBACK);
    if (!o) RET(CUDA_ERROR_OUT_OF_MEMORY);
    o->cb = cb;
    o->ud = ud;
    enqueue(s, o);
    RET(CUDA_SUCCESS);
}

/* ---------------------------------------------------------------- events */

EXPORT CUresult cuEventCreate(CUevent *ph, unsigned int flags) {
    GUARD;
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) RET(r);
    if (!ph || (flags & ~7u)) RET(CUDA_ERROR_INVALID_VALUE);
    if ((flags & 4u) && !(flags & EVENT_DISABLE_TIMING)) RET(CUDA_ERROR_INVALID_VALUE);
    struct sevent *e = calloc(1, sizeof *e);
    if (!e) RET(CUDA_ERROR_OUT_OF_MEMORY);
    e->magic = EVENT_MAGIC;
    e->ctx = c;
    e->flags = flags;
    e->next = g_events;
    g_events = e;
    *ph = e;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuEventRecordWithFlags(CUevent ev, CUstream h, unsigned int flags) {
    GUARD;
    struct sstream *s;
    CUresult r = need_init();
    if (r) RET(r);
    if (!event_valid(ev)) RET(CUDA_ERROR_INVALID_HANDLE);
    if (flags > 1) RET(CUDA_ERROR_INVALID_VALUE);
    r = resolve_stream(cur_ctx() ? cur_ctx() : ev->ctx, h, &s);
    if (r) RET(r);
    if (s->ctx != ev->ctx) RET(CUDA_ERROR_INVALID_HANDLE);
    struct op *o = op_new(OP_RECORD);
    if (!o) RET(CUDA_ERROR_OUT_OF_MEMORY);
    enqueue(s, o);
    o->refs++;
    op_unref(ev->rec);
    ev->rec = o;
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuEventRecord(CUevent ev, CUstream h) { return cuEventRecordWithFlags(ev, h, 0); }

EXPORT CUresult cuEventQuery(CUevent ev) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    if (!event_valid(ev)) RET(CUDA_ERROR_INVALID_HANDLE);
    if (ev->rec && !ev->rec->done) {
        if (g_copy_gbps > 0) { /* timed: pending until it will have run, then complete */
            if (!op_ready(ev->rec)) RET(CUDA_ERROR_NOT_READY);
            run_until(ev->rec);
            RET(ev->ctx->sticky);
        }
        run_until(ev->rec); /* reported as pending, then completed */
        RET(CUDA_ERROR_NOT_READY);
    }
    RET(ev->ctx->sticky);
}

EXPORT CUresult cuEventSynchronize(CUevent ev) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    if (!event_valid(ev)) RET(CUDA_ERROR_INVALID_HANDLE);
    if (ev->rec) wait_ready(ev->rec);
    run_until(ev->rec);
    RET(ev->ctx->sticky);
}

EXPORT CUresult cuEventDestroy_v2(CUevent ev) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    if (!event_valid(ev)) RET(CUDA_ERROR_INVALID_HANDLE);
    for (struct sevent **pp = &g_events; *pp; pp = &(*pp)->next)
        if (*pp == ev) {
            *pp = ev->next;
            break;
        }
    op_unref(ev->rec);
    ev->magic = 0;
    free(ev);
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    if (!ms) RET(CUDA_ERROR_INVALID_VALUE);
    if (!event_valid(a) || !event_valid(b)) RET(CUDA_ERROR_INVALID_HANDLE);
    if ((a->flags | b->flags) & EVENT_DISABLE_TIMING) RET(CUDA_ERROR_INVALID_HANDLE);
    if (!a->rec || !b->rec) RET(CUDA_ERROR_INVALID_HANDLE);
    if (!a->rec->done || !b->rec->done) RET(CUDA_ERROR_NOT_READY);
    *ms = (float)(b->rec->t_ms - a->rec->t_ms);
    RET(CUDA_SUCCESS);
}

EXPORT CUresult cuEventElapsedTime_v2(float *ms, CUevent a, CUevent b) { return cuEventElapsedTime(ms, a, b); }

EXPORT CUresult cuCtxRecordEvent(CUcontext ctx, CUevent ev) {
    GUARD;
    CUresult r = need_init();
    if (r) RET(r);
    if (!ctx_valid(ctx)) RET(CUDA_ERROR_INVALID_CONTEXT);
    RET(cuEventRecordWithFlags(ev, STREAM_LEGACY, 0));
}

/* ---------------------------------------------------------------- copies */

/* Queues a copy of n bytes on stream h (current context c).
 * sync: the blocking cuMemcpy* forms, which return as the real driver does:
 * after the copy for a host destination or a pinned source, once staged for a
 * pageable source, at once for device to device. */
CUresult copy_submit(struct sctx *c, CUstream h, uintptr_t dst, uintptr_t src, size_t n, int sync, int dir) {
    struct sstream *s;
    CUresult r = resolve_stream(c, h, &s);
    if (r) return r;
    if (n == 0) return CUDA_SUCCESS;
    if (!dst || !src || dst + n < dst || src + n < src) return CUDA_ERROR_INVALID_VALUE;
    int dst_dev = is_device_addr(dst), src_dev = is_device_addr(src);
    if ((dir == DIR_HTOD || dir == DIR_DTOD) && !dst_dev) return CUDA_ERROR_INVALID_VALUE;
    if ((dir == DIR_DTOH || dir == DIR_DTOD) && !src_dev) return CUDA_ERROR_INVALID_VALUE;
    int src_pageable = !src_dev && !is_pinned_addr(src);
    int dst_pageable = !dst_dev && !is_pinned_addr(dst);
    if (src_pageable && !host_span_ok(src, n)) return CUDA_ERROR_INVALID_VALUE;
    if (dst_pageable && !host_span_ok(dst, n)) return CUDA_ERROR_INVALID_VALUE;
    struct op *o = op_new(OP_COPY);
    if (!o) return CUDA_ERROR_OUT_OF_MEMORY;
    o->dst = dst;
    o->src = src;
    o->n = n;
    if (g_copy_gbps > 0) o->cost_ms = (double)n / (g_copy_gbps * 1e6);
    if (src_pageable) {
        if (sync && s->tail) run_until(s->tail); /* "a stream sync is performed before the copy" */
        if (s->ctx->sticky) {
            op_unref(o);
            return s->ctx->sticky;
        }
        o->staging = malloc(n);
        if (!o->staging) {
            op_unref(o);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        if (safe_copy((uintptr_t)o->staging, src, n) != 0) {
            op_unref(o);
            return CUDA_ERROR_INVALID_VALUE; /* the source cannot be read */
        }
    }
    enqueue(s, o);
    int host_only = !dst_dev && !src_dev;
    if (host_only || (sync && (!dst_dev || (!src_dev && !src_pageable)))) {
        if (sync) wait_ready(o);
        run_until(o);
        return s->ctx->sticky;
    }
    /* Timed: the bytes move now, within the time the copy is given (so that
       what a caller measures beyond it is its own); done when that has passed. */
    if (g_copy_gbps > 0) run_until(o);
    return CUDA_SUCCESS;
}

static CUresult copy_api(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h, int sync, int dir) {
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) return r;
    return copy_submit(c, h, (uintptr_t)dst, (uintptr_t)src, n, sync, dir);
}

EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    GUARD;
    RET(copy_api(dst, src, n, NULL, 1, DIR_ANY));
}
EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h) {
    GUARD;
    RET(copy_api(dst, src, n, h, 0, DIR_ANY));
}
EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    GUARD;
    RET(copy_api(dst, (CUdeviceptr)(uintptr_t)src, n, NULL, 1, DIR_HTOD));
}
EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    GUARD;
    RET(copy_api((CUdeviceptr)(uintptr_t)dst, src, n, NULL, 1, DIR_DTOH));
}
EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    GUARD;
    RET(copy_api(dst, src, n, NULL, 1, DIR_DTOD));
}
EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream h) {
    GUARD;
    RET(copy_api(dst, (CUdeviceptr)(uintptr_t)src, n, h, 0, DIR_HTOD));
}
EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream h) {
    GUARD;
    RET(copy_api((CUdeviceptr)(uintptr_t)dst, src, n, h, 0, DIR_DTOH));
}
EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h) {
    GUARD;
    RET(copy_api(dst, src, n, h, 0, DIR_DTOD));
}

static CUresult peer_copy(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx, size_t n, CUstream h,
                          int sync) {
    struct sctx *c;
    CUresult r = need_ctx(&c);
    if (r) return r;
    if (!ctx_valid(dctx) || !ctx_valid(sctx)) return CUDA_ERROR_INVALID_CONTEXT;
    if ((r = ctx_usable(dctx)) || (r = ctx_usable(sctx))) return r;
    return copy_submit(c, h, (uintptr_t)dst, (uintptr_t)src, n, sync, DIR_DTOD);
}

EXPORT CUresult cuMemcpyPeer(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx, size_t n) {
    GUARD;
    RET(peer_copy(dst, dctx, src, sctx, n, NULL, 1));
}
EXPORT CUresult cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx, size_t n,
                                  CUstream h) {
    GUARD;
    RET(peer_copy(dst, dctx, src, sctx, n, h, 0));
}

/* ---------------------------------------------------------------- memset */

static CUresult set_api(CUdeviceptr dst, unsigned v, size_t n, int width, CUstream h, int sync) {
    struct sctx *c;
    struct sstream *s;
    CUresult r = need_ctx(&c);
    if (r) return r;
    r = resolve_stream(c, h, &s);
    if (r) return r;
    if (n == 0) return CUDA_SUCCESS;
    if ((dst % (unsigned)width) != 0) return CUDA_ERROR_INVALID_VALUE;
    int dev = is_device_addr((uintptr_t)dst);
    if (!dev && !is_pinned_addr((uintptr_t)dst)) return CUDA_ERROR_INVALID_VALUE;
    struct op *o = op_new(OP_SET);
    if (!o) return CUDA_ERROR_OUT_OF_MEMORY;
    o->dst = (uintptr_t)dst;
    o->setval = v;
    o->n = n;
    o->setwidth = width;
    enqueue(s, o);
    if (!dev && sync) { /* pinned host target: synchronous */
        run_until(o);
        return s->ctx->sticky;
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) {
    GUARD;
    RET(set_api(d, v, n, 1, NULL, 1));
}
EXPORT CUresult cuMemsetD16_v2(CUdeviceptr d, unsigned short v, size_t n) {
    GUARD;
    RET(set_api(d, v, n, 2, NULL, 1));
}
EXPORT CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned int v, size_t n) {
    GUARD;
    RET(set_api(d, v, n, 4, NULL, 1));
}
EXPORT CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream h) {
    GUARD;
    RET(set_api(d, v, n, 1, h, 0));
}
EXPORT CUresult cuMemsetD16Async(CUdeviceptr d, unsigned short v, size_t n, CUstream h) {
    GUARD;
    RET(set_api(d, v, n, 2, h, 0));
}
EXPORT CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, CUstream h) {
    GUARD;
    RET(set_api(d, v, n, 4, h, 0));
}

/* ---------------------------------------------------------------- capture (never active) */

EXPORT CUresult cuStreamIsCapturing(CUstream h, int *status) {
    GUARD;
    struct sstream *s;
    CUresult r = stream_for(h, &s);
    if (r) RET(r);
    if (!status) RET(CUDA_ERROR_INVALID_VALUE);
    *status = 0; /* CU_STREAM_CAPTURE_STATUS_NONE: the stand-in has no graphs */
    RET(CUDA_SUCCESS);
}

/* ---------------------------------------------------------------- per-thread default stream variants */

typedef CUdeviceptr DP;
PTDS(cuMemcpy, (DP d, DP s, size_t n), (d, s, n))
PTDS(cuMemcpyAsync, (DP d, DP s, size_t n, CUstream h), (d, s, n, h))
PTDS(cuMemcpyPeer, (DP d, CUcontext dc, DP s, CUcontext sc, size_t n), (d, dc, s, sc, n))
PTDS(cuMemcpyPeerAsync, (DP d, CUcontext dc, DP s, CUcontext sc, size_t n, CUstream h), (d, dc, s, sc, n, h))
PTDS(cuMemcpyHtoD_v2, (DP d, const void *s, size_t n), (d, s, n))
PTDS(cuMemcpyDtoH_v2, (void *d, DP s, size_t n), (d, s, n))
PTDS(cuMemcpyDtoD_v2, (DP d, DP s, size_t n), (d, s, n))
PTDS(cuMemcpyHtoDAsync_v2, (DP d, const void *s, size_t n, CUstream h), (d, s, n, h))
PTDS(cuMemcpyDtoHAsync_v2, (void *d, DP s, size_t n, CUstream h), (d, s, n, h))
PTDS(cuMemcpyDtoDAsync_v2, (DP d, DP s, size_t n, CUstream h), (d, s, n, h))
PTDS(cuMemsetD8_v2, (DP d, unsigned char v, size_t n), (d, v, n))
PTDS(cuMemsetD16_v2, (DP d, unsigned short v, size_t n), (d, v, n))
PTDS(cuMemsetD32_v2, (DP d, unsigned int v, size_t n), (d, v, n))
PTDS(cuMemsetD8Async, (DP d, unsigned char v, size_t n, CUstream h), (d, v, n, h))
PTDS(cuMemsetD16Async, (DP d, unsigned short v, size_t n, CUstream h), (d, v, n, h))
PTDS(cuMemsetD32Async, (DP d, unsigned int v, size_t n, CUstream h), (d, v, n, h))
PTDS(cuStreamSynchronize, (CUstream h), (h))
PTDS(cuStreamQuery, (CUstream h), (h))
PTDS(cuStreamGetFlags, (CUstream h, unsigned int *f), (h, f))
PTDS(cuStreamGetPriority, (CUstream h, int *p), (h, p))
PTDS(cuStreamGetId, (CUstream h, unsigned long long *id), (h, id))
PTDS(cuStreamGetCtx, (CUstream h, CUcontext *c), (h, c))
PTDS(cuStreamGetCtx_v2, (CUstream h, CUcontext *c, void **g), (h, c, g))
PTDS(cuStreamGetDevice, (CUstream h, CUdevice *d), (h, d))
PTDS(cuStreamWaitEvent, (CUstream h, CUevent e, unsigned int f), (h, e, f))
PTDS(cuStreamIsCapturing, (CUstream h, int *st), (h, st))
PTDS(cuStreamAddCallback, (CUstream h, CUstreamCallback cb, void *ud, unsigned int f), (h, cb, ud, f))
PTDS(cuLaunchHostFunc, (CUstream h, CUhostFn fn, void *ud), (h, fn, ud))
PTDS(cuLaunchHostFunc_v2, (CUstream h, CUhostFn fn, void *ud, unsigned int m), (h, fn, ud, m))
PTDS(cuEventRecord, (CUevent e, CUstream h), (e, h))
PTDS(cuEventRecordWithFlags, (CUevent e, CUstream h, unsigned int f), (e, h, f))
