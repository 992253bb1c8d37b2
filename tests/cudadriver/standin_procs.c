/* CUDA driver stand-in: cuGetProcAddress, the only way cuda.bindings finds
 * entry points (tests only; see README.md).
 *
 * The bindings ask for a base name and the CUDA version whose signature they
 * expect ("cuMemAlloc", 3020 -> cuMemAlloc_v2); the table maps each base name
 * to versioned implementations, the newest not newer than the request wins.
 * Unknown names answer CUDA_ERROR_NOT_FOUND with a NULL pointer, so calling
 * them through the bindings raises.
 */
#include "standin.h"

#include <string.h>

#define P(name, since, fn, stream) extern CUresult fn();
#include "standin_procs.inc"
#undef P
CUresult cuGetProcAddress(const char *, void **, int, unsigned long long);
CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);

struct proc {
    const char *name;
    int since;
    void *fn;
    int stream; /* takes a stream or uses the default stream */
};

#define P(name, since, fn, stream) {name, since, (void *)fn, stream},
static const struct proc PROCS[] = {
#include "standin_procs.inc"
    P("cuGetProcAddress", 11030, cuGetProcAddress, 0)
    P("cuGetProcAddress", 12000, cuGetProcAddress_v2, 0)
};
#undef P

enum { PROC_DEFAULT = 0, PROC_LEGACY_STREAM = 1, PROC_PER_THREAD_DEFAULT_STREAM = 2 };

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                                    int *status) {
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    if (flags > PROC_PER_THREAD_DEFAULT_STREAM) return CUDA_ERROR_INVALID_VALUE;
    const struct proc *best = NULL;
    int known = 0;
    for (size_t i = 0; i < sizeof PROCS / sizeof PROCS[0]; i++) {
        if (strcmp(PROCS[i].name, symbol) != 0) continue;
        known = 1;
        if (PROCS[i].since <= version && (!best || PROCS[i].since > best->since)) best = &PROCS[i];
    }
    *pfn = best ? best->fn : NULL;
    if (status) *status = best ? 0 : known ? 2 : 1;
    if (best && best->stream && flags == PROC_PER_THREAD_DEFAULT_STREAM) {
        /* cuda.bindings resolves every entry point in one mode per process:
           stream 0 then means the per-thread default stream. */
        pthread_mutex_lock(&g_lock);
        g_ptds = 1;
        pthread_mutex_unlock(&g_lock);
    }
    if (g_trace)
        standin_note("cuGetProcAddress(%s, %d, flags=%llu)%s", symbol, version, flags,
                     best ? "" : known ? " -> NOT FOUND for this version" : " -> NOT FOUND (not implemented)");
    return best ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
