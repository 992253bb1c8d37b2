// libgpushare_cuda_copy: a synchronous CUDA copy and its wait, called through
// ctypes (which releases the GIL for the call) by gpushare/_cuda/_copy.py.
//
// It links nothing: the driver's entry points come from Python once
// (cuGetProcAddress through cuda.bindings, so the same driver the rest of
// gpushare uses), and every call here is one of them.  Policy (which stream,
// which event, the expected time) stays in Python; this file queues the copy,
// records the event and waits for it:
//
//   1. until the copy's expected time, without a driver call: one sleep to
//      just before it when it is long, then a spin;
//   2. one query (of the event, or of gpushare's own stream): done in the
//      steady state (three driver calls in all on gpushare's stream: the
//      current context, the copy, the query);
//   3. otherwise (late, or the time unknown) ask again, spinning, for a
//      quarter of the expected time; then block: cuEventSynchronize (or
//      cuStreamSynchronize) without a timeout; with one, a host function
//      queued after the copy posts a semaphore that this thread waits on
//      until the deadline (never sleeping in steps: it wakes when posted).  The host function's state is shared and freed by whoever
//      lets go of it last, so a waiter that timed out leaves nothing behind.

#include <semaphore.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define GS_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define GS_PAUSE() asm volatile("yield")
#else
#define GS_PAUSE() \
  do {             \
  } while (0)
#endif

namespace {

using CUresult    = int;
using CUdeviceptr = unsigned long long;
using CUstream    = void*;
using CUevent     = void*;
using CUcontext   = void*;
using HostFn      = void (*)(void*);

constexpr CUresult kSuccess  = 0;
constexpr CUresult kNotReady = 600;
// Not a CUresult: the deadline passed first (the copy stays queued).
constexpr CUresult kTimedOut = -1;
// Not a CUresult: the entry points were never given.
constexpr CUresult kNoDriver = -2;

struct Entries {
  CUresult (*memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*memcpy_htod)(CUdeviceptr, const void*, size_t, CUstream);
  CUresult (*memcpy_dtoh)(void*, CUdeviceptr, size_t, CUstream);
  CUresult (*memcpy_dtod)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*event_record)(CUevent, CUstream);
  CUresult (*event_query)(CUevent);
  CUresult (*event_synchronize)(CUevent);
  CUresult (*launch_host_func)(CUstream, HostFn, void*);
  CUresult (*ctx_push)(CUcontext);
  CUresult (*ctx_pop)(CUcontext*);
  CUresult (*ctx_get_current)(CUcontext*);
  CUresult (*stream_query)(CUstream);
  CUresult (*stream_synchronize)(CUstream);
};
constexpr int kEntries = 13;

Entries g_fn{};
std::atomic<bool> g_ready{false};

int64_t now_ns()
{
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void sleep_until(int64_t t)
{
  timespec ts{time_t(t / 1000000000), long(t % 1000000000)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr) == EINTR) {}
}

// Kinds, as Python names them (gpushare/_cuda/_copy.py): the driver's generic
// copy or the one for the memory types both sides are known to have.
enum Kind { kAny = 0, kHtoD = 1, kDtoH = 2, kDtoD = 3 };

CUresult queue_copy(CUdeviceptr dst, CUdeviceptr src, size_t n, int kind, CUstream stream)
{
  switch (kind) {
    case kHtoD: return g_fn.memcpy_htod(dst, reinterpret_cast<const void*>(src), n, stream);
    case kDtoH: return g_fn.memcpy_dtoh(reinterpret_cast<void*>(dst), src, n, stream);
    case kDtoD: return g_fn.memcpy_dtod(dst, src, n, stream);
    default: return g_fn.memcpy_async(dst, src, n, stream);
  }
}

// What a waiter and the host function it queued share: freed by the last of
// the two to let go.
struct Signal {
  sem_t sem;
  std::atomic<int> refs{2};
  Signal() { sem_init(&sem, 0, 0); }
  ~Signal() { sem_destroy(&sem); }
  void drop()
  {
    if (refs.fetch_sub(1) == 1) delete this;
  }
};

void post_signal(void* p)
{
  auto* s = static_cast<Signal*>(p);
  sem_post(&s->sem);
  s->drop();
}

// A host function: add 1 to the eventfd whose number is `p` (a failed
// write leaves the waiter to its poll).
void post_eventfd(void* p)
{
  uint64_t const one = 1;
  ssize_t const n    = write(static_cast<int>(reinterpret_cast<intptr_t>(p)), &one, sizeof one);
  (void)n;
}

// Whether the work waited for (`event`, else all of `stream`) is complete.
CUresult query(CUevent event, CUstream stream)
{
  return event != nullptr ? g_fn.event_query(event) : g_fn.stream_query(stream);
}

// Block until `event` (recorded on `stream`; null: all of `stream`'s work)
// completes or `deadline` (ns, CLOCK_MONOTONIC, -1: none) passes.  With a
// deadline, a host function queued after it posts a semaphore; the wait on it
// looks at the work itself too every millisecond, for a driver that runs host
// functions late (a waiter woken by the semaphore is woken at once).
CUresult block_until(CUevent event, CUstream stream, int64_t deadline)
{
  if (deadline < 0) return event != nullptr ? g_fn.event_synchronize(event) : g_fn.stream_synchronize(stream);
  auto* s    = new Signal();
  CUresult r = g_fn.launch_host_func(stream, post_signal, s);
  if (r != kSuccess) {
    delete s;
    return r;
  }
  for (;;) {
    int64_t const t = std::min(deadline, now_ns() + 1000000);
    timespec ts{time_t(t / 1000000000), long(t % 1000000000)};
    int rc;
    while ((rc = sem_clockwait(&s->sem, CLOCK_MONOTONIC, &ts)) != 0 && errno == EINTR) {}
    r = query(event, stream);  // the copy's own status, or still pending
    if (r != kNotReady) break;
    if (rc == 0) continue;  // posted: the event completes at once
    if (now_ns() >= deadline) {
      r = kTimedOut;
      break;
    }
  }
  s->drop();
  return r;
}

}  // namespace}  // namespace

extern "C" {

// The driver's entry points, in the order of Entries; 0 on success.
__attribute__((visibility("default"))) int gs_copy_init(const uintptr_t* fns, int n)
{
  if (n != kEntries) return -1;
  for (int i = 0; i < n; ++i)
    if (fns[i] == 0) return i + 1;
  void** slots = reinterpret_cast<void**>(&g_fn);
  for (int i = 0; i < n; ++i) slots[i] = reinterpret_cast<void*>(fns[i]);
  g_ready.store(true);
  return 0;
}

// Wait for `event`, recorded on `stream` at `start` (ns, CLOCK_MONOTONIC), or
// with a null `event` for all the work queued on `stream` (gpushare's own):
// see the top of the file.  `expected`: the copy's expected time in ns (0:
// unknown); `deadline`: ns, CLOCK_MONOTONIC, or -1 for none (gs_wait_for
// takes a timeout in ns from the call instead).  `*late`: 0 when the event
// was complete at the expected time, 1 when at the first question asked
// again, 2 when later; `*elapsed`: ns from `start` until it was seen complete.
__attribute__((visibility("default"))) int gs_wait(CUevent event, CUstream stream, int64_t start, int64_t expected,
                                                   int64_t deadline, int* late, int64_t* elapsed)
{
  if (!g_ready.load()) return kNoDriver;
  *late = 1;
  int64_t until = start + expected;
  if (deadline >= 0 && until > deadline) until = deadline;
  if (expected > 0) {
    if (until - now_ns() > 200000) sleep_until(until - 100000);
    while (now_ns() < until) GS_PAUSE();
  }
  CUresult r = query(event, stream);
  if (r == kNotReady) {
    // A little late: spin on, asking, for a quarter of the expected time
    // (at least 20 us), then block.  Done at the first question asked again:
    // "just after" (*late 1), which says little of the copy's time (a driver
    // may even run the work when asked); later: *late 2.
    int64_t const spin = now_ns() + std::max<int64_t>(expected / 4, 20000);
    // Between questions: 1 us, doubling up to a 32nd of the expected time (a few dozen questions at most).
    int64_t const widest = std::max<int64_t>(expected / 32, 1000);
    int64_t gap          = 1000;
    int asked            = 0;
    while (r == kNotReady && now_ns() < spin && (deadline < 0 || now_ns() < deadline)) {
      int64_t const next = now_ns() + gap;
      while (now_ns() < next) GS_PAUSE();
      gap = std::min(gap * 2, widest);
      r   = query(event, stream);
      ++asked;
    }
    if (r == kNotReady) {
      if (deadline >= 0 && now_ns() >= deadline) return kTimedOut;
      r = block_until(event, stream, deadline);
      asked = 2;
    }
    *late = asked > 1 ? 2 : 1;
  } else {
    *late = 0;
  }
  *elapsed = now_ns() - start;
  return r;
}

// Queue `n` bytes from `src` to `dst` on `stream` with `ctx` current (made
// current for the call where another is: a copy needs a current context, and
// the legacy and per-thread streams are the current context's), record
// `event` after them (null: the stream is gpushare's own, all its work is
// waited for), and wait as gs_wait does.  In the steady state, on gpushare's
// stream with its context current: three driver calls (cuCtxGetCurrent, the
// copy, cuStreamQuery).  `timeout`: ns from the call, or -1 for none.  A
// failure to queue is returned as it is.
__attribute__((visibility("default"))) int gs_copy_wait(CUdeviceptr dst, CUdeviceptr src, size_t n, int kind,
                                                        CUstream stream, CUevent event, CUcontext ctx,
                                                        int64_t expected, int64_t timeout, int* late,
                                                        int64_t* elapsed)
{
  if (!g_ready.load()) return kNoDriver;
  int64_t start = now_ns();
  *late    = 1;
  *elapsed = 0;
  int64_t const deadline = timeout < 0 ? -1 : start + timeout;
  CUcontext current = nullptr;
  CUresult r        = g_fn.ctx_get_current(&current);
  if (r != kSuccess) return r;
  bool const push = current != ctx;
  if (push && (r = g_fn.ctx_push(ctx)) != kSuccess) return r;
  r = queue_copy(dst, src, n, kind, stream);
  if (r == kSuccess && event != nullptr) r = g_fn.event_record(event, stream);
  // The context stays current while waiting: a host function queued on the
  // legacy or per-thread stream goes to the current context's.
  if (r == kSuccess) r = gs_wait(event, stream, start, expected, deadline, late, elapsed);
  if (push) {
    CUcontext popped;
    g_fn.ctx_pop(&popped);
  }
  return r;
}

// gs_wait from now, for `timeout` ns at most (-1: no limit).
__attribute__((visibility("default"))) int gs_wait_for(CUevent event, CUstream stream, int64_t timeout, int* late,
                                                       int64_t* elapsed)
{
  int64_t const start = now_ns();
  return gs_wait(event, stream, start, 0, timeout < 0 ? -1 : start + timeout, late, elapsed);
}

// Queue on `stream` a host function that adds 1 to eventfd `fd` when the
// stream reaches it (gpushare/_cuda/_await.py: an event loop awaiting the
// work reads the eventfd).  `fd` stays open for the process's life.
__attribute__((visibility("default"))) int gs_notify(CUstream stream, int fd)
{
  if (!g_ready.load()) return kNoDriver;
  return g_fn.launch_host_func(stream, post_eventfd, reinterpret_cast<void*>(static_cast<intptr_t>(fd)));
}

}  // extern "C"
