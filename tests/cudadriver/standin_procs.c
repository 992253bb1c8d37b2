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

#define P(name, since, fn) extern CUresult fn();
#define S(name, since, fn) extern CUresult fn(), fn##_ptds();
#include "standin_procs.inc"
#undef P
#undef S
CUresult cuGetProcAddress(const char *, void **, int, unsigned long long);
CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);

struct proc {
    const char *name;
    int since;
    void *fn;
    void *ptds; /* the per-thread default stream variant, or NULL */
};

#define P(name, since, fn) {name, since, (void *)fn, NULL},
#define S(name, since, fn) {name, since, (void *)fn, (void *)fn##_ptds},
static const struct proc PROCS[] = {
#include "standin_procs.inc"
    P("cuGetProcAddress", 11030, cuGetProcAddress)
    P("cuGetProcAddress", 12000, cuGetProcAddress_v2)
};
#undef P
#undef S

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
    /* Per-thread mode gives the variants in which stream 0 is this thread's stream. */
    *pfn = !best ? NULL : (flags == PROC_PER_THREAD_DEFAULT_STREAM && best->ptds) ? best->ptds : best->fn;
    if (status) *status = best ? 0 : known ? 2 : 1;
    if (g_trace)
        standin_note("cuGetProcAddress(%s, %d, flags=%llu)%s", symbol, version, flags,
                     best ? "" : known ? " -> NOT FOUND for this version" : " -> NOT FOUND (not implemented)");
    return best ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
