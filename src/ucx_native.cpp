// Thin adapter from libucxx's C++ classes to Python.
//
// Policy (bounds checks, lifetimes, error classes, validation of untrusted
// input beyond the byte layout) lives in Python: gpushare/_ucx/.  This file
// converts arguments, releases the GIL around every libucxx call, and turns
// C++ exceptions and UCS status codes into NativeError(status_name,
// message), which the module's exception translator raises in Python as the
// error gpushare._errors.translate makes of it.

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unordered_map.h>
#include <nanobind/stl/vector.h>

#include <dlfcn.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <cstdint>
#include <cxxabi.h>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <unordered_set>
#include <thread>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ucp/api/ucp.h>
#include <ucs/config/global_opts.h>
#include <ucs/debug/log_def.h>
#include <ucxx/api.h>

namespace nb = nanobind;
using namespace nb::literals;

namespace {

bool pyFinalizing()
{
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// ---------------------------------------------------------------------------
// Status names and the one native exception type.

const char* statusName(ucs_status_t s)
{
  switch (s) {
    case UCS_OK: return "UCS_OK";
    case UCS_INPROGRESS: return "UCS_INPROGRESS";
    case UCS_ERR_NO_MESSAGE: return "UCS_ERR_NO_MESSAGE";
    case UCS_ERR_NO_RESOURCE: return "UCS_ERR_NO_RESOURCE";
    case UCS_ERR_IO_ERROR: return "UCS_ERR_IO_ERROR";
    case UCS_ERR_NO_MEMORY: return "UCS_ERR_NO_MEMORY";
    case UCS_ERR_INVALID_PARAM: return "UCS_ERR_INVALID_PARAM";
    case UCS_ERR_UNREACHABLE: return "UCS_ERR_UNREACHABLE";
    case UCS_ERR_INVALID_ADDR: return "UCS_ERR_INVALID_ADDR";
    case UCS_ERR_NOT_IMPLEMENTED: return "UCS_ERR_NOT_IMPLEMENTED";
    case UCS_ERR_MESSAGE_TRUNCATED: return "UCS_ERR_MESSAGE_TRUNCATED";
    case UCS_ERR_NO_PROGRESS: return "UCS_ERR_NO_PROGRESS";
    case UCS_ERR_BUFFER_TOO_SMALL: return "UCS_ERR_BUFFER_TOO_SMALL";
    case UCS_ERR_NO_ELEM: return "UCS_ERR_NO_ELEM";
    case UCS_ERR_SOME_CONNECTS_FAILED: return "UCS_ERR_SOME_CONNECTS_FAILED";
    case UCS_ERR_NO_DEVICE: return "UCS_ERR_NO_DEVICE";
    case UCS_ERR_BUSY: return "UCS_ERR_BUSY";
    case UCS_ERR_CANCELED: return "UCS_ERR_CANCELED";
    case UCS_ERR_SHMEM_SEGMENT: return "UCS_ERR_SHMEM_SEGMENT";
    case UCS_ERR_ALREADY_EXISTS: return "UCS_ERR_ALREADY_EXISTS";
    case UCS_ERR_OUT_OF_RANGE: return "UCS_ERR_OUT_OF_RANGE";
    case UCS_ERR_TIMED_OUT: return "UCS_ERR_TIMED_OUT";
    case UCS_ERR_EXCEEDS_LIMIT: return "UCS_ERR_EXCEEDS_LIMIT";
    case UCS_ERR_UNSUPPORTED: return "UCS_ERR_UNSUPPORTED";
    case UCS_ERR_REJECTED: return "UCS_ERR_REJECTED";
    case UCS_ERR_NOT_CONNECTED: return "UCS_ERR_NOT_CONNECTED";
    case UCS_ERR_CONNECTION_RESET: return "UCS_ERR_CONNECTION_RESET";
    case UCS_ERR_ENDPOINT_TIMEOUT: return "UCS_ERR_ENDPOINT_TIMEOUT";
    default:
      if (UCS_IS_LINK_ERROR(s)) return "UCS_ERR_LINK_FAILURE";
      if (UCS_IS_ENDPOINT_ERROR(s)) return "UCS_ERR_ENDPOINT_FAILURE";
      return "UCS_ERR_UNKNOWN";
  }
}

// Outcomes of a request to a region server, carried in its reply header.
enum GsStatus : uint32_t {
  GS_OK             = 0,
  GS_ACCESS_DENIED  = 1,  // no such region, or the key is not granted on it
  GS_OUT_OF_BOUNDS  = 2,  // offset/length outside the region
  GS_READ_ONLY      = 3,  // a put to a read-only region
  GS_CLOSED         = 4,  // the region was closed
  GS_BAD_REQUEST    = 5,  // a malformed request header
  GS_BAD_REPLY      = 6,  // the server answered something this client did not ask for
  GS_TRANSFER       = 7,  // the data transfer failed on the server
  GS_LAST           = 7,
};

const char* gsStatusName(uint32_t s)
{
  switch (s) {
    case GS_OK: return "GS_OK";
    case GS_ACCESS_DENIED: return "GS_ERR_ACCESS_DENIED";
    case GS_OUT_OF_BOUNDS: return "GS_ERR_OUT_OF_BOUNDS";
    case GS_READ_ONLY: return "GS_ERR_READ_ONLY";
    case GS_CLOSED: return "GS_ERR_CLOSED";
    case GS_BAD_REQUEST: return "GS_ERR_BAD_REQUEST";
    case GS_BAD_REPLY: return "GS_ERR_BAD_REPLY";
    case GS_TRANSFER: return "GS_ERR_TRANSFER";
    default: return "GS_ERR_BAD_REPLY";
  }
}

const char* gsStatusMessage(uint32_t s)
{
  switch (s) {
    case GS_ACCESS_DENIED: return "the exporter refused access: no such region, or the key is not (or no longer) granted on it";
    case GS_OUT_OF_BOUNDS: return "the exporter refused a range outside the region";
    case GS_READ_ONLY: return "the exporter refused a put: the region is read-only";
    case GS_CLOSED: return "the region was closed by its exporter";
    case GS_BAD_REQUEST: return "the exporter could not parse the request";
    case GS_BAD_REPLY: return "the exporter sent a reply that does not match the request";
    case GS_TRANSFER: return "the exporter could not complete the data transfer";
    default: return "the exporter sent an unknown status";
  }
}

struct NativeError : std::exception {
  std::string status;
  std::string message;
  NativeError(std::string s, std::string m) : status(std::move(s)), message(std::move(m)) {}
  const char* what() const noexcept override { return message.c_str(); }
};

// ucxx throws one class per status; recover the status name from the class.
const char* ucxxErrorStatus(const ucxx::Error& e)
{
#define GS_MAP(cls, st) \
  if (dynamic_cast<const ucxx::cls*>(&e) != nullptr) return statusName(st);
  GS_MAP(ConnectionResetError, UCS_ERR_CONNECTION_RESET)
  GS_MAP(NoMessageError, UCS_ERR_NO_MESSAGE)
  GS_MAP(NoResourceError, UCS_ERR_NO_RESOURCE)
  GS_MAP(IOError, UCS_ERR_IO_ERROR)
  GS_MAP(NoMemoryError, UCS_ERR_NO_MEMORY)
  GS_MAP(InvalidParamError, UCS_ERR_INVALID_PARAM)
  GS_MAP(UnreachableError, UCS_ERR_UNREACHABLE)
  GS_MAP(InvalidAddrError, UCS_ERR_INVALID_ADDR)
  GS_MAP(NotImplementedError, UCS_ERR_NOT_IMPLEMENTED)
  GS_MAP(MessageTruncatedError, UCS_ERR_MESSAGE_TRUNCATED)
  GS_MAP(BufferTooSmallError, UCS_ERR_BUFFER_TOO_SMALL)
  GS_MAP(NoDeviceError, UCS_ERR_NO_DEVICE)
  GS_MAP(BusyError, UCS_ERR_BUSY)
  GS_MAP(CanceledError, UCS_ERR_CANCELED)
  GS_MAP(OutOfRangeError, UCS_ERR_OUT_OF_RANGE)
  GS_MAP(TimedOutError, UCS_ERR_TIMED_OUT)
  GS_MAP(ExceedsLimitError, UCS_ERR_EXCEEDS_LIMIT)
  GS_MAP(UnsupportedError, UCS_ERR_UNSUPPORTED)
  GS_MAP(RejectedError, UCS_ERR_REJECTED)
  GS_MAP(NotConnectedError, UCS_ERR_NOT_CONNECTED)
#undef GS_MAP
  return "UCS_ERR_UNKNOWN";
}

// Run a libucxx call with the GIL released and every C++ exception turned
// into NativeError.
template <typename F>
auto call(const char* what, F&& f) -> decltype(f())
{
  try {
    nb::gil_scoped_release release;
    return f();
  } catch (const ucxx::Error& e) {
    throw NativeError(ucxxErrorStatus(e), std::string(what) + ": " + e.what());
  } catch (const NativeError&) {
    throw;
  } catch (const std::bad_alloc&) {
    throw NativeError("UCS_ERR_NO_MEMORY", std::string(what) + ": out of memory");
  } catch (const std::exception& e) {
    throw NativeError("UCS_ERR_INVALID_PARAM", std::string(what) + ": " + e.what());
  }
}

// Run `f` without the GIL if this thread holds it and Python is not going
// away: `f` may wait for a progress thread that is itself waiting for the
// GIL to run a callback.
template <typename F>
void withoutGil(F&& f)
{
  if (pyFinalizing() || !PyGILState_Check()) {
    f();
    return;
  }
  nb::gil_scoped_release release;
  f();
}

// Drop a shared_ptr to a libucxx object without the GIL: destructors may wait
// for the progress thread.
template <typename T>
void releaseNoGil(std::shared_ptr<T>& p)
{
  if (p) withoutGil([&] { p.reset(); });
}

// Stop a worker's progress thread, joining it without the GIL.
void stopProgressNoGil(const std::shared_ptr<ucxx::Worker>& w)
{
  withoutGil([&] { w->stopProgressThread(); });
}

// ---------------------------------------------------------------------------
// Completion state shared by a request and the callback libucxx calls.

struct Progress;
struct Completion;
// The node whose worker this thread progresses: its progress thread, or a
// waiter holding the worker (see Progress).  Callbacks of requests that
// complete here are handed to the node's progress thread, which runs them
// outside UCX's progress.
thread_local Progress* deferTo = nullptr;
// Hand a completion's Python callbacks to the node's progress thread.
void deferCallbacks(Progress* p, std::shared_ptr<Completion> c);

struct Completion : std::enable_shared_from_this<Completion> {
  std::mutex mutex;
  std::condition_variable cv;
  bool done{false};     // status is final (callbacks may still be running)
  bool settled{false};  // callbacks have run: waiters wake now
  std::thread::id callbackThread{};
  ucs_status_t status{UCS_INPROGRESS};
  // A refusal or protocol failure of the region server (GS_* codes), with
  // its message; 0 for UCX outcomes.
  uint32_t gsStatus{0};
  // Python callables to run on completion; touched only with the GIL held
  // (appended under `mutex`, taken out under `mutex`).
  std::vector<PyObject*> callbacks;

  ~Completion()
  {
    if (callbacks.empty()) return;
    if (pyFinalizing()) return;  // leak rather than touch a dying interpreter
    nb::gil_scoped_acquire gil;
    for (auto* cb : callbacks)
      Py_DECREF(cb);
  }

  // `settled` and `done`, readable without the mutex (for the spin before a wait).
  std::atomic<bool> settledFlag{false};
  std::atomic<bool> doneFlag{false};

  void settle()
  {
    {
      std::lock_guard<std::mutex> lock(mutex);
      settled = true;
      settledFlag.store(true, std::memory_order_release);
    }
    cv.notify_all();
  }

  // Called by libucxx or the node: in whichever thread progresses the
  // worker, or at once in the submitting thread (which has released the
  // GIL) when the request completes immediately.  Callbacks run before
  // waiters wake, so that a wait() that returns has seen every callback
  // registered before completion run.  Inside a node's progress they do
  // not run: UCX holds the worker's lock there (and a waiter holds the
  // worker), so a callback that blocked (on a lock its caller holds, say)
  // would stall the worker for everyone; the node's progress thread runs
  // them after its pass of progress.
  void complete(ucs_status_t s, uint32_t gs = 0)
  {
    bool runCallbacks;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (done) return;
      status         = s;
      gsStatus       = gs;
      done           = true;
      runCallbacks   = !callbacks.empty();
      // Where the callbacks run (none: the progress thread runs them later).
      if (!runCallbacks || deferTo == nullptr || pyFinalizing())
        callbackThread = std::this_thread::get_id();
      doneFlag.store(true, std::memory_order_release);
    }
    if (!runCallbacks || pyFinalizing()) {
      settle();
      return;
    }
    if (deferTo != nullptr) {
      deferCallbacks(deferTo, shared_from_this());
      return;
    }
    runCallbacks_();
  }

  // Run the Python callbacks of a completed request, then wake its waiters.
  void runCallbacks_()
  {
    {
      std::lock_guard<std::mutex> lock(mutex);
      callbackThread = std::this_thread::get_id();
    }
    if (pyFinalizing()) {
      settle();
      return;
    }
    {
      nb::gil_scoped_acquire gil;
      std::vector<PyObject*> todo;
      {
        std::lock_guard<std::mutex> lock(mutex);
        todo.swap(callbacks);
      }
      for (auto* cb : todo) {
        PyObject* r = PyObject_CallNoArgs(cb);
        if (r == nullptr)
          PyErr_WriteUnraisable(cb);  // reported through sys.unraisablehook, never lost
        else
          Py_DECREF(r);
        Py_DECREF(cb);
      }
    }
    settle();
  }
};

// How long Request::wait spins before it sleeps: kSpinMicros, plus one
// microsecond per kSpinBytesPerMicro bytes the request moves (a 1 MiB put
// takes 0.2 ms and more on loopback), at most kSpinMaxMicros.
constexpr int64_t kSpinMicros        = 100;
constexpr int64_t kSpinBytesPerMicro = 2048;
constexpr int64_t kSpinMaxMicros     = 2000;

int64_t steadyNanos()
{
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
           std::chrono::steady_clock::now().time_since_epoch())
    .count();
}

// Who progresses a node's worker.  Its progress thread does, except while a
// thread waiting for one of the node's requests has claimed the worker: that
// thread then progresses it itself, and the progress thread stands aside
// (parked), so that a synchronous caller's answer needs no hand-over
// between two threads (on a core the two share, each hand-over is a context
// switch).  Shared by the node and its requests: a waiter never progresses
// a worker that is going away.
struct Progress {
  std::shared_ptr<ucxx::Worker> worker;
  std::atomic<bool> claimed{false};
  std::atomic<bool> closed{false};
  // When the node was last active (steadyNanos), for the progress thread's
  // linger.
  std::atomic<int64_t> lastActive{0};
  std::mutex parkMutex;
  std::condition_variable parkCv;
  // Completions whose callbacks the progress thread runs (under parkMutex).
  std::vector<std::shared_ptr<Completion>> deferred;
  std::atomic<bool> hasDeferred{false};
  // Whether the progress thread is running Python callbacks (waiters then
  // drive their requests themselves).
  std::atomic<bool> callbacksRunning{false};
  // Whether the progress thread sleeps in the kernel (then a request
  // queued, or callbacks handed over, must wake it through the worker).
  std::atomic<bool> asleep{false};
  ucp_worker_h wh{nullptr};
  bool polling{false};

  // Claim the worker; false if another thread holds it or it is closing
  // (except for the node's progress thread itself, in a callback: the worker
  // lives until that thread is joined, and nobody else progresses it then).
  bool claim()
  {
    if (deferTo == this) {
      bool expected = false;
      return claimed.compare_exchange_strong(expected, true, std::memory_order_seq_cst);
    }
    if (closed.load(std::memory_order_acquire)) return false;
    bool expected = false;
    if (!claimed.compare_exchange_strong(expected, true, std::memory_order_seq_cst)) return false;
    // Stores claimed, then reads closed; shutdown stores closed, then reads
    // claimed: one of the two sees the other.
    if (closed.load(std::memory_order_seq_cst)) {
      claimed.store(false, std::memory_order_release);
      return false;
    }
    return true;
  }

  // No waiter progresses the worker from now on: refuse claims and wait
  // until the one held, if any, is given back.  (The progress thread itself
  // may still claim it, in a callback, until it is joined.)  Stores closed,
  // then reads claimed; claim() stores claimed, then reads closed: one of
  // the two sees the other.
  void close()
  {
    closed.store(true, std::memory_order_seq_cst);
    while (claimed.load(std::memory_order_seq_cst)) std::this_thread::yield();
  }

  // Give the worker back.  The progress thread is not woken here: it looks
  // again within kParkNanos (a synchronous caller's next request usually
  // claims the worker again before that, and a wake-up on a core the two
  // threads share costs two context switches per request).
  void release()
  {
    lastActive.store(steadyNanos(), std::memory_order_relaxed);
    claimed.store(false, std::memory_order_release);
  }

  // Wake the progress thread if it is parked (the worker is closing, or a
  // request needs it).
  void unpark()
  {
    { std::lock_guard<std::mutex> lock(parkMutex); }
    parkCv.notify_all();
  }

  // The first completion handed over (or `only`, if it is there); null if none.
  std::shared_ptr<Completion> takeDeferred(const Completion* only = nullptr)
  {
    std::lock_guard<std::mutex> lock(parkMutex);
    auto it = only == nullptr ? deferred.begin()
                              : std::find_if(deferred.begin(), deferred.end(),
                                             [only](const auto& d) { return d.get() == only; });
    if (it == deferred.end()) return nullptr;
    auto c = std::move(*it);
    deferred.erase(it);
    hasDeferred.store(!deferred.empty(), std::memory_order_release);
    return c;
  }

  // Run the callbacks handed over by waiters (the progress thread), one
  // completion at a time, so that a waiter may take its own meanwhile.
  void runDeferred()
  {
    if (!hasDeferred.load(std::memory_order_acquire)) return;
    struct Running {
      std::atomic<bool>& flag;
      ~Running() { flag.store(false, std::memory_order_release); }
    } running{callbacksRunning};
    callbacksRunning.store(true, std::memory_order_release);
    while (auto c = takeDeferred()) {
      try {
        c->runCallbacks_();
      } catch (abi::__forced_unwind&) {
        // The thread is being cancelled: wake every waiter left, then unwind.
        c->settle();
        while (auto rest = takeDeferred()) rest->settle();
        throw;
      } catch (...) {
        c->settle();  // its waiters wake all the same
      }
    }
  }

  // Run `c`'s callbacks here if they still wait to be run (the progress
  // thread is busy, or is this thread); whether it did.
  bool runOwn(const std::shared_ptr<Completion>& c)
  {
    auto mine = takeDeferred(c.get());
    if (!mine) return false;
    mine->runCallbacks_();
    return true;
  }
};

// Sets deferTo for a scope (a waiter holding the worker, a peer closing).
struct DeferTo {
  Progress* const outer;  // the progress thread's own, when this runs in a callback
  explicit DeferTo(Progress* p) : outer(deferTo) { deferTo = p; }
  ~DeferTo() { deferTo = outer; }
  DeferTo(const DeferTo&)            = delete;
  DeferTo& operator=(const DeferTo&) = delete;
};

void deferCallbacks(Progress* p, std::shared_ptr<Completion> c)
{
  {
    std::lock_guard<std::mutex> lock(p->parkMutex);
    p->deferred.push_back(std::move(c));
    p->hasDeferred.store(true, std::memory_order_seq_cst);
  }
  p->parkCv.notify_all();
  // Stores hasDeferred, then reads asleep; the progress thread stores
  // asleep, then reads hasDeferred: one of the two sees the other.
  if (!p->polling && p->asleep.load(std::memory_order_seq_cst)) ucp_worker_signal(p->wh);
}

// How long the progress thread stands aside while a waiter holds the
// worker, before it looks again.
constexpr int64_t kParkNanos = 200'000;
// How often a thread sleeping on a node's request looks whether the
// progress thread is held up in Python callbacks.
constexpr std::chrono::milliseconds kWaitSlice{1};

class Request {
 public:
  std::shared_ptr<Completion> completion;
  std::shared_ptr<ucxx::Request> request;
  std::string kind;
  // How long wait() spins before it sleeps.
  int64_t spinMicros{kSpinMicros};
  // For a node's requests: a waiter may progress the node's worker itself.
  std::shared_ptr<Progress> progress;

  Request(std::shared_ptr<Completion> c, std::string k)
    : completion(std::move(c)), kind(std::move(k))
  {
  }
  ~Request() { releaseNoGil(request); }

  bool done()
  {
    std::lock_guard<std::mutex> lock(completion->mutex);
    return completion->done;
  }

  // Wait for completion; timeout < 0 waits forever.  Returns whether done.
  bool wait(double timeout)
  {
    nb::gil_scoped_release release;
    auto c = completion;
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    const auto deadline =
      timeout < 0 || timeout > 1e9 ? Clock::time_point::max()
                  : start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout));
    const auto spin = std::chrono::microseconds(spinMicros);
    // (Never from inside the node's own UCX progress, which UCX forbids:
    // the node's callbacks run outside it, see Completion::complete.)
    Progress* p = progress.get();
    // Small transfers complete within tens of microseconds: drive the
    // request that long before sleeping on the condition variable, whose
    // wake-up costs more than the transfer itself.  A node's request is
    // driven by progressing the node's worker here, when no other waiter
    // holds it (the progress thread stands aside meanwhile); otherwise this
    // thread spins, yielding its core.
    auto drive = [&](Clock::time_point until) {
      while (!c->settledFlag.load(std::memory_order_acquire) && Clock::now() < until) {
        if (p != nullptr && p->claim()) {
          // One pass of UCX progress at a time (never until the worker runs
          // dry: this process's exports may keep it busy), checking the
          // request, the time and the node between passes.
          bool failed = false;
          {
            DeferTo here(p);
            struct Held {
              Progress* p;
              bool wake{false};  // the progress thread takes over now
              ~Held()
              {
                p->release();
                if (wake) p->unpark();
              }
            } held{p};
            try {
              while (!c->doneFlag.load(std::memory_order_acquire) && Clock::now() < until &&
                     (here.outer == p || !p->closed.load(std::memory_order_seq_cst)))
                p->worker->progressOnce();
            } catch (abi::__forced_unwind&) {
              held.wake = true;  // the thread is being cancelled (pthread_exit): let it unwind
              throw;
            } catch (...) {
              held.wake = true;  // UCX failed: the progress thread says so
              failed = true;
            }
          }
          if (failed) {
            p = nullptr;
            continue;
          }
          if (c->doneFlag.load(std::memory_order_acquire)) return;  // callbacks may still run elsewhere
          continue;
        }
        std::this_thread::yield();
      }
    };
    drive(std::min(deadline, start + spin));
    // Sleeping now, or done: the progress thread finishes what is left.
    if (p != nullptr && !c->doneFlag.load(std::memory_order_acquire)) p->unpark();
    std::unique_lock<std::mutex> lock(c->mutex);
    // A callback waiting on its own request: the status is final already.
    auto ready = [&] {
      return c->settled || (c->done && c->callbackThread == std::this_thread::get_id());
    };
    while (!ready()) {
      const auto now = Clock::now();
      if (now >= deadline) return false;
      // Done, its callbacks handed over to a progress thread that is this
      // thread (a callback waiting) or busy with other callbacks (maybe
      // blocked): run them here rather than wait for it.
      if (p != nullptr && c->done && !c->settled &&
          (deferTo == p || p->callbacksRunning.load(std::memory_order_acquire))) {
        lock.unlock();
        const bool ran = p->runOwn(c);
        lock.lock();
        if (ran) continue;  // else the progress thread has them in hand: wait below
      }
      if (p == nullptr) {
        if (timeout < 0)
          c->cv.wait(lock, ready);
        else
          c->cv.wait_until(lock, deadline, ready);
        continue;
      }
      // A node's progress thread may be held up in a Python callback (which
      // may wait for something this thread holds): look every kWaitSlice,
      // and drive the request again meanwhile.
      if (c->cv.wait_until(lock, std::min(deadline, now + kWaitSlice), ready)) break;
      if (p->callbacksRunning.load(std::memory_order_acquire) && !c->doneFlag.load(std::memory_order_acquire)) {
        lock.unlock();
        drive(std::min(deadline, Clock::now() + spin));
        lock.lock();
      }
    }
    return true;
  }

  // Whether it completed successfully (status() says how it did not).
  bool ok()
  {
    std::lock_guard<std::mutex> lock(completion->mutex);
    return completion->done && completion->gsStatus == 0 && completion->status == UCS_OK;
  }

  // (status_name, message) or None while in flight.
  nb::object status()
  {
    ucs_status_t s;
    uint32_t gs;
    {
      std::lock_guard<std::mutex> lock(completion->mutex);
      if (!completion->done) return nb::none();
      s  = completion->status;
      gs = completion->gsStatus;
    }
    if (gs != 0) return nb::make_tuple(gsStatusName(gs), gsStatusMessage(gs));
    return nb::make_tuple(statusName(s), ucs_status_string(s));
  }

  // Run `fn()` on completion; at once in this thread when already complete.
  // Returns True when it was queued, False when it ran here.
  bool addCallback(nb::object fn)
  {
    {
      std::lock_guard<std::mutex> lock(completion->mutex);
      if (!completion->done) {
        completion->callbacks.push_back(fn.release().ptr());
        return true;
      }
    }
    fn();
    return false;
  }
};

ucxx::RequestCallbackUserFunction completer(const std::shared_ptr<Completion>& c)
{
  // The request owns this function; capture the completion only, so that a
  // dropped Python Request does not keep libucxx objects alive in a cycle.
  return [c](ucs_status_t status, std::shared_ptr<void>) { c->complete(status); };
}

std::shared_ptr<Completion> newCompletion(nb::object callback)
{
  auto c = std::make_shared<Completion>();
  if (!callback.is_none()) c->callbacks.push_back(callback.release().ptr());
  return c;
}

// ---------------------------------------------------------------------------

class MemoryHandle {
 public:
  std::shared_ptr<ucxx::MemoryHandle> handle;
  explicit MemoryHandle(std::shared_ptr<ucxx::MemoryHandle> h) : handle(std::move(h)) {}
  ~MemoryHandle() { releaseNoGil(handle); }

  ucxx::MemoryHandle& get()
  {
    if (!handle) throw NativeError("UCS_ERR_INVALID_PARAM", "memory handle is closed");
    return *handle;
  }
  uintptr_t ucpHandle() { return reinterpret_cast<uintptr_t>(get().getHandle()); }
  size_t size() { return get().getSize(); }
  uint64_t baseAddress() { return get().getBaseAddress(); }
  int memoryType() { return static_cast<int>(get().getMemoryType()); }

  nb::bytes packRemoteKey()
  {
    get();
    auto h = handle;
    std::string blob = call("ucp_rkey_pack", [&] {
      std::shared_ptr<ucxx::RemoteKey> rk = h->remoteKeyBuilder().build();
      return std::string(rk->serialize());
    });
    return nb::bytes(blob.data(), blob.size());
  }

  void close() { releaseNoGil(handle); }
};

class RemoteKey {
 public:
  std::shared_ptr<ucxx::RemoteKey> key;
  explicit RemoteKey(std::shared_ptr<ucxx::RemoteKey> k) : key(std::move(k)) {}
  ~RemoteKey() { releaseNoGil(key); }
  ucxx::RemoteKey& get()
  {
    if (!key) throw NativeError("UCS_ERR_INVALID_PARAM", "remote key is closed");
    return *key;
  }
  uintptr_t ucpHandle() { return reinterpret_cast<uintptr_t>(get().getHandle()); }
  size_t size() { return get().getSize(); }
  uint64_t baseAddress() { return get().getBaseAddress(); }
  void close() { releaseNoGil(key); }
};

// Check the byte layout libucxx's RemoteKey::deserialize expects, before it
// reads anything: hash(8) | packed_size(8) | packed(packed_size) | base(8) | size(8).
void checkSerializedRemoteKey(const std::string& blob)
{
  const size_t hashSize  = sizeof(size_t);
  const size_t fixedSize = sizeof(size_t) + sizeof(uint64_t) + sizeof(size_t);
  if (blob.size() < hashSize + fixedSize)
    throw NativeError("UCS_ERR_INVALID_PARAM",
                      "serialized remote key is " + std::to_string(blob.size()) +
                        " bytes; at least " + std::to_string(hashSize + fixedSize) +
                        " are needed");
  size_t packedSize;
  std::memcpy(&packedSize, blob.data() + hashSize, sizeof(packedSize));
  if (packedSize != blob.size() - hashSize - fixedSize)
    throw NativeError("UCS_ERR_INVALID_PARAM",
                      "serialized remote key says its packed key is " + std::to_string(packedSize) +
                        " bytes; the blob holds " +
                        std::to_string(blob.size() - hashSize - fixedSize));
  size_t expected;
  std::memcpy(&expected, blob.data(), sizeof(expected));
  std::string data(blob.begin() + hashSize, blob.end());
  if (std::hash<std::string>{}(data) != expected)
    throw NativeError("UCS_ERR_INVALID_PARAM", "serialized remote key fails its checksum");
}

// What checkSerializedRemoteKey finds wrong with `blob`; empty when nothing is.
std::string remoteKeyProblem(nb::bytes blob)
{
  try {
    checkSerializedRemoteKey(std::string(blob.c_str(), blob.size()));
  } catch (const NativeError& e) {
    return e.message;
  }
  return {};
}

// (base_address, size) recorded in a serialized key, read without UCX.
std::tuple<uint64_t, uint64_t> serializedRemoteKeyRange(nb::bytes blob)
{
  std::string s(blob.c_str(), blob.size());
  checkSerializedRemoteKey(s);
  uint64_t base, size;
  std::memcpy(&base, s.data() + s.size() - 16, 8);
  std::memcpy(&size, s.data() + s.size() - 8, 8);
  return {base, size};
}

class Endpoint {
 public:
  std::shared_ptr<ucxx::Endpoint> ep;
  explicit Endpoint(std::shared_ptr<ucxx::Endpoint> e) : ep(std::move(e)) {}
  ~Endpoint() { releaseNoGil(ep); }

  std::shared_ptr<ucxx::Endpoint> get()
  {
    if (!ep) throw NativeError("UCS_ERR_NOT_CONNECTED", "endpoint is closed");
    return ep;
  }

  bool alive() { return ep && ep->isAlive(); }

  // A request on an endpoint whose peer has failed completes at once with
  // UCS_ERR_CONNECTION_RESET, without reaching UCX: posted on the failed
  // endpoint, it left an operation UCX never flushed (reported when the
  // worker is destroyed).
  static bool failFast(const std::shared_ptr<ucxx::Endpoint>& e, const std::shared_ptr<Completion>& c)
  {
    if (e->isAlive()) return false;
    c->complete(UCS_ERR_CONNECTION_RESET);
    return true;
  }

  // What ucp_ep_print_info says: the lanes and transports this endpoint uses.
  std::string info()
  {
    auto e = get();
    return call("ucp_ep_print_info", [&] {
      char* text = nullptr;
      size_t length = 0;
      FILE* stream = open_memstream(&text, &length);
      if (stream == nullptr) throw NativeError("UCS_ERR_NO_MEMORY", "open_memstream failed");
      ucp_ep_print_info(e->getHandle(), stream);
      fclose(stream);
      std::string out(text, length);
      free(text);
      return out;
    });
  }

  RemoteKey unpackRemoteKey(nb::bytes blob)
  {
    auto e = get();
    std::string s(blob.c_str(), blob.size());
    checkSerializedRemoteKey(s);
    auto k = call("ucp_ep_rkey_unpack",
                  [&]() -> std::shared_ptr<ucxx::RemoteKey> { return e->remoteKeyBuilder(s).build(); });
    return RemoteKey(std::move(k));
  }

  Request memPut(uintptr_t buffer, size_t length, uint64_t remoteAddress, RemoteKey& rk,
                 nb::object callback)
  {
    auto e   = get();
    auto key = rk.key;
    if (!key) throw NativeError("UCS_ERR_INVALID_PARAM", "remote key is closed");
    auto c = newCompletion(std::move(callback));
    Request r(c, "put");
    if (failFast(e, c)) return r;
    r.request = call("ucp_put_nbx", [&]() -> std::shared_ptr<ucxx::Request> {
      std::shared_ptr<ucxx::Request> req =
        e->memPutBuilder(reinterpret_cast<const void*>(buffer), length, remoteAddress, key->getHandle())
          .callbackFunction(completer(c))
          .build();
      return req;
    });
    return r;
  }

  Request memGet(uintptr_t buffer, size_t length, uint64_t remoteAddress, RemoteKey& rk,
                 nb::object callback)
  {
    auto e   = get();
    auto key = rk.key;
    if (!key) throw NativeError("UCS_ERR_INVALID_PARAM", "remote key is closed");
    auto c = newCompletion(std::move(callback));
    Request r(c, "get");
    if (failFast(e, c)) return r;
    r.request = call("ucp_get_nbx", [&]() -> std::shared_ptr<ucxx::Request> {
      std::shared_ptr<ucxx::Request> req =
        e->memGetBuilder(reinterpret_cast<void*>(buffer), length, remoteAddress, key->getHandle())
          .callbackFunction(completer(c))
          .build();
      return req;
    });
    return r;
  }

  Request flush(nb::object callback)
  {
    auto e = get();
    auto c = newCompletion(std::move(callback));
    Request r(c, "flush");
    if (failFast(e, c)) return r;
    r.request = call("ucp_ep_flush_nbx", [&]() -> std::shared_ptr<ucxx::Request> {
      std::shared_ptr<ucxx::Request> req = e->flushBuilder().callbackFunction(completer(c)).build();
      return req;
    });
    return r;
  }

  // Cancel what is in flight and disconnect; waits at most `timeout` seconds.
  void close(double timeout)
  {
    if (!ep) return;
    auto e = ep;
    uint64_t periodNs = 100'000'000;  // 100 ms per attempt
    uint64_t attempts = std::max<uint64_t>(1, static_cast<uint64_t>(timeout * 10.0));
    call("ucp_ep_close_nbx", [&] {
      e->closeBlocking(periodNs, attempts);
      return 0;
    });
    releaseNoGil(ep);
  }
};

// UCX logs to stdout unless UCX_LOG_FILE names a file: stdout belongs to the
// application, so messages go to stderr instead (UCX_LOG_LEVEL still decides
// which are printed).  Installed once, before the first context is made.
static ucs_log_func_rc_t stderrLogHandler(const char* file, unsigned line, const char* function,
                                          ucs_log_level_t level, const ucs_log_component_config_t* comp,
                                          const char* message, va_list ap)
{
  (void)function;
  (void)comp;
  const char* base = std::strrchr(file, '/');
  std::fprintf(stderr, "[UCX %s] %s:%u ", ucs_log_level_names[level], base ? base + 1 : file, line);
  std::vfprintf(stderr, message, ap);
  std::fputc('\n', stderr);
  return UCS_LOG_FUNC_RC_STOP;
}

static void logToStderr()
{
  static std::once_flag once;
  std::call_once(once, [] {
    const char* file = ucs_global_opts.log_file;
    if (file == nullptr || file[0] == '\0') {
      ucs_log_push_handler(stderrLogHandler);
    }
  });
}

// UCX's memory hooks (libucm) look up the C library's mmap, munmap, mremap
// and madvise lazily, with dlopen and dlsym, the first time each is needed.
// In "reloc" hook mode the first need arises while ucp_init patches every
// loaded library from inside dl_iterate_phdr, which holds the loader's
// write lock; dlsym then waits for the loader's main lock.  A dlopen in
// another thread at that moment (a Python extension module being imported,
// say) holds the main lock and waits for the write lock: the process hangs
// for good.  Calling each lookup once beforehand, with arguments that
// change nothing, leaves nothing for ucp_init to look up there.  Where
// libucm has no such functions, there is nothing to do.
static void resolveUcmOriginals()
{
  static std::once_flag once;
  std::call_once(once, [] {
    void* ucm = dlopen("libucm.so.0", RTLD_LAZY | RTLD_NOLOAD);
    if (ucm == nullptr) return;
    const int saved = errno;
    using Mmap    = void* (*)(void*, size_t, int, int, int, off_t);
    using Munmap  = int (*)(void*, size_t);
    using Mremap  = void* (*)(void*, size_t, size_t, int, void*);
    using Madvise = int (*)(void*, size_t, int);
    // Each fails with EINVAL (length 0) or does nothing (madvise of no pages).
    if (auto f = reinterpret_cast<Mmap>(dlsym(ucm, "ucm_orig_mmap_dlsym")))
      (void)f(nullptr, 0, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (auto f = reinterpret_cast<Munmap>(dlsym(ucm, "ucm_orig_munmap_dlsym"))) (void)f(nullptr, 0);
    if (auto f = reinterpret_cast<Mremap>(dlsym(ucm, "ucm_orig_mremap_dlsym"))) (void)f(nullptr, 0, 0, 0, nullptr);
    if (auto f = reinterpret_cast<Madvise>(dlsym(ucm, "ucm_orig_madvise_dlsym"))) (void)f(nullptr, 0, MADV_NORMAL);
    errno = saved;
    dlclose(ucm);
  });
}

// Before any ucp_init in this process.
static void beforeUcpInit()
{
  logToStderr();
  resolveUcmOriginals();
}

class Agent {
 public:
  std::shared_ptr<ucxx::Context> context;
  std::shared_ptr<ucxx::Worker> worker;
  bool errorHandling;
  bool polling;

  Agent(const std::unordered_map<std::string, std::string>& config, bool polling_, bool errorHandling_,
        int wakeTimeoutMs)
    : errorHandling(errorHandling_), polling(polling_)
  {
    beforeUcpInit();
    ucxx::ConfigMap cfg(config.begin(), config.end());
    call("ucp_init", [&] {
      context = ucxx::contextBuilder(UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP | UCP_FEATURE_AM)
                  .configMap(cfg)
                  .build();
      worker = context->workerBuilder().build();
      // -1: sleep until an event (every transport wakes the worker); else
      // the bound on how late a shared-memory arrival is noticed.
      worker->startProgressThread(polling, wakeTimeoutMs);
      return 0;
    });
  }
  ~Agent() { shutdown(); }

  std::shared_ptr<ucxx::Worker> getWorker()
  {
    if (!worker) throw NativeError("UCS_ERR_INVALID_PARAM", "agent is closed");
    return worker;
  }

  nb::bytes address()
  {
    auto w    = getWorker();
    auto addr = call("ucp_worker_get_address", [&] {
      std::shared_ptr<ucxx::Address> a = ucxx::AddressBuilder(w).build();
      return std::string(a->getStringView());
    });
    return nb::bytes(addr.data(), addr.size());
  }

  std::string info()
  {
    auto w = getWorker();
    return call("ucp_worker_print_info", [&] { return w->getInfo(); });
  }

  Endpoint connect(nb::bytes peer)
  {
    auto w = getWorker();
    std::string s(peer.c_str(), peer.size());
    auto e = call("ucp_ep_create", [&]() -> std::shared_ptr<ucxx::Endpoint> {
      std::shared_ptr<ucxx::Address> a = ucxx::AddressBuilder(std::string_view(s)).build();
      return ucxx::endpointBuilder(w, a).endpointErrorHandling(errorHandling).build();
    });
    return Endpoint(std::move(e));
  }

  MemoryHandle createMemoryHandle(size_t size, uintptr_t buffer, int memoryType)
  {
    auto w   = getWorker();
    auto ctx = context;
    auto h   = call("ucp_mem_map", [&]() -> std::shared_ptr<ucxx::MemoryHandle> {
      auto b = ctx->memoryHandleBuilder(size);
      if (buffer != 0) b.buffer(reinterpret_cast<void*>(buffer));
      b.memoryType(static_cast<ucs_memory_type_t>(memoryType));
      return b.build();
    });
    return MemoryHandle(std::move(h));
  }

  void shutdown()
  {
    if (!worker) return;
    stopProgressNoGil(worker);
    releaseNoGil(worker);
    releaseNoGil(context);
  }

  bool closed() const { return !worker; }
};

// Replace [addr, addr + length) with fresh zero pages, keeping the range
// reserved: what a stale remote key writes afterwards lands nowhere useful and
// what it reads is zeros.
void quarantine(uintptr_t addr, size_t length)
{
  void* p = mmap(reinterpret_cast<void*>(addr), length, PROT_READ | PROT_WRITE,
                 MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw NativeError("UCS_ERR_NO_MEMORY", "mmap(MAP_FIXED) failed");
}

// A Python buffer-protocol object (C-contiguous; writable when asked) held
// until release() or this object goes: while held, its owner cannot resize
// or free it.  For the region server's requests, what LocalBuffer does for
// any buffer, for the common host case at a fraction of the cost.
class PinnedBuffer {
 public:
  Py_buffer view{};
  bool held{false};
  PinnedBuffer(const PinnedBuffer&)            = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  PinnedBuffer(nb::handle obj, bool writable)
  {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &view, flags) != 0) throw nb::python_error();
    held = true;
  }
  ~PinnedBuffer() { release(); }
  void release()
  {
    if (held) {
      held = false;
      PyBuffer_Release(&view);
    }
  }
  uintptr_t address() const { return held ? reinterpret_cast<uintptr_t>(view.buf) : 0; }
  size_t nbytes() const { return held ? static_cast<size_t>(view.len) : 0; }
  bool readonly() const { return held && view.readonly != 0; }
};

// ---------------------------------------------------------------------------
// The region server and its client: one UCX worker per process.
//
// Transfers are active messages (UCP AM).  An importer sends a request header
// (region id, 128-bit key, offset, length); the exporter's handler looks the
// region and key up in `regions`, checks the range and, for puts, that the
// region is writable, before any byte moves.  Data travels as the AM payload:
// eager messages are copied, rendezvous ones land in (or are read from) the
// region's registered memory with ucp_am_recv_data_nbx / ucp_am_send_nbx.
// Handlers run in whichever thread progresses the worker (the progress
// thread, or a thread waiting for its request) and never take the GIL.
//
// Wire format (little-endian, both headers fixed size):
//   request  (importer -> exporter, AM id kAmRequest or kAmRequestKeep,
//            payload: put data)
//   reply    (exporter -> importer, AM id kAmReply or kAmReplyKeep, payload:
//            get data)
//   trailer  (exporter -> importer, kAmReply, kind kTrailer): after the data
//            of a get of kTrailerMin bytes or more, saying whether the region
//            was still open when the data had left.
//
// Two AM ids each way, because UCX copies every eager payload that arrives
// without a descriptor of the transport's own (TCP's) into one of its own
// before a handler registered with UCP_AM_FLAG_PERSISTENT_DATA sees it: a
// second copy of all the data.  kAmRequest and kAmReply are registered
// without that flag, and their handlers copy eager payloads straight out of
// the transport's receive buffer; that works for host memory only.  Eager
// payloads bound for other memory (a put to a CUDA region, a get into a
// CUDA buffer) travel on the *Keep ids, whose handlers hand UCX's
// descriptor to ucp_am_recv_data_nbx, which copies it to the device.  An
// importer asks for a kAmReplyKeep answer with kReqReplyKeep; it sends a
// put on kAmRequest only to a region that the exporter has said is host
// memory (kReplyHostRegion), else on kAmRequestKeep.  A put on kAmRequest to
// any other region is refused.

constexpr unsigned kAmRequest     = 0x4753;  // "GS"
constexpr unsigned kAmReply       = 0x4754;
constexpr unsigned kAmRequestKeep = 0x4755;
constexpr unsigned kAmReplyKeep   = 0x4756;
// RequestHeader.flags: answer a get's data on kAmReplyKeep.
constexpr uint8_t kReqReplyKeep   = 1;
// ReplyHeader.flags: the request's region is host memory.
constexpr uint32_t kReplyHostRegion = 1;
constexpr uint32_t kWireMagic   = 0x32585347;  // "GSX2": the AM ids and flags of this version
constexpr uint8_t kOpGet        = 1;
constexpr uint8_t kOpPut        = 2;
// Several gets in one request message: the header's requestId is the first
// item's, its length the item count; the payload is that many BatchItems.
// Each item is answered like a get of its own (requestId + index).
constexpr uint8_t kOpGetBatch   = 3;
// Several puts to host-memory regions in one message: requestId and length
// as for kOpGetBatch; the payload is that many BatchItems followed by each
// item's data in order.  Sent eagerly (the exporter copies every item out
// of the message), at most kPutEagerMax bytes of data per message.
constexpr uint8_t kOpPutBatch   = 4;
// One part of a put sent in several messages: a PartHeader, whose request
// header names the whole put's range (checked as a whole by every part, so
// that a put refused for its range, key or region writes nothing), then
// where this part's payload lies in it.
constexpr uint8_t kOpPutPart    = 5;
constexpr uint64_t kMaxBatchItems = 4096;
constexpr uint32_t kReplyData   = 1;
constexpr uint32_t kReplyTrailer = 2;
constexpr uint64_t kTrailerMin  = 64 * 1024;
constexpr size_t kMaxTombstones = 4096;
constexpr size_t kMaxHostRegions = 65536;
// Payloads up to this size go eagerly (one message) rather than by
// rendezvous (three legs across the network, each a thread wake-up on a
// sleeping peer); above it rendezvous saves the receiver a copy.
constexpr uint64_t kEagerMax    = 256 * 1024;
// Puts go eagerly up to this size: the exporter then copies the payload
// into the region itself, which took 0.2 ms for 1 MiB on loopback against
// 0.3 to 0.4 ms by rendezvous.  (A get's reply above kEagerMax gained
// nothing from it.)  Each put in flight may hold that much at the exporter.
constexpr uint64_t kPutEagerMax = 1024 * 1024;

struct RequestHeader {
  uint32_t magic;
  uint8_t op;
  uint8_t flags;  // kReqReplyKeep
  uint8_t reserved[2];
  uint64_t requestId;
  uint64_t regionId;
  uint64_t key[2];
  uint64_t offset;
  uint64_t length;
};

struct PartHeader {
  RequestHeader whole;
  uint64_t partOffset;
};

struct BatchItem {
  uint64_t regionId;
  uint64_t key[2];
  uint64_t offset;
  uint64_t length;
};

struct ReplyHeader {
  uint32_t magic;
  uint32_t status;
  uint64_t requestId;
  uint64_t length;
  uint32_t kind;
  uint32_t flags;  // kReplyHostRegion
};

struct Key128 {
  uint64_t lo, hi;
  bool operator==(const Key128& o) const { return lo == o.lo && hi == o.hi; }
};
struct Key128Hash {
  size_t operator()(const Key128& k) const { return std::hash<uint64_t>{}(k.lo ^ (k.hi * 0x9E3779B97F4A7C15ull)); }
};

Key128 keyFromBytes(const std::string& b)
{
  if (b.size() != 16) throw NativeError("UCS_ERR_INVALID_PARAM", "a region key is 16 bytes");
  Key128 k;
  std::memcpy(&k.lo, b.data(), 8);
  std::memcpy(&k.hi, b.data() + 8, 8);
  return k;
}

// One importer's capability on a region, and its transfers under way.
struct Grant {
  std::atomic<int64_t> inflight{0};
  bool revoked{false};  // under Node::tableMutex
};

struct Region {
  uint64_t id;
  uintptr_t base;
  uint64_t length;
  bool readonly;
  ucs_memory_type_t memoryType;
  std::shared_ptr<ucxx::MemoryHandle> memh;  // reset once closed and drained
  ucp_mem_h ucpMemh{nullptr};
  bool closed{false};                         // under Node::tableMutex
  std::unordered_map<Key128, std::shared_ptr<Grant>, Key128Hash> keys;  // under Node::tableMutex
  std::atomic<int64_t> inflight{0};
};

class Node;

// One transfer the exporter carries out: a get's data send or a put's receive.
struct ServerOp {
  Node* node;
  std::shared_ptr<Region> region;
  std::shared_ptr<Grant> grant;
  ucp_ep_h replyEp;
  uint64_t requestId;
  uint64_t length;
};

// Parts of a client operation still awaited.
constexpr uint32_t kWaitSend    = 1;  // our request message left (UCX local completion)
constexpr uint32_t kWaitReply   = 2;  // the exporter's reply arrived
constexpr uint32_t kWaitRecv    = 4;  // a rendezvous receive of get data completed
constexpr uint32_t kWaitTrailer = 8;  // the trailer of a large get arrived

struct Batch {
  std::shared_ptr<Completion> completion;
  size_t left;
  ucs_status_t status{UCS_OK};
  uint32_t gs{GS_OK};
};

struct ClientOp {
  uint64_t id;
  uint64_t peerId;
  ucp_ep_h ep;
  uint8_t op;
  uint64_t regionId;
  void* buffer;
  uint64_t length;
  ucs_memory_type_t memoryType;
  uint32_t waiting;
  ucs_status_t status{UCS_OK};
  uint32_t gs{GS_OK};
  std::shared_ptr<Batch> batch;

  void fail(ucs_status_t s, uint32_t g)
  {
    if (status == UCS_OK && gs == GS_OK) {
      status = s;
      gs     = g;
    }
  }
};

void freeRequest(void* request, ucs_status_t, void*)
{
  ucp_request_free(request);
}

// How long the node's progress thread keeps polling after the last thing
// it did (serving a request, completing an answer, any UCX event) or the
// last request this process posted, before it sleeps in the kernel again.
// An importer's next request usually follows its last reply within tens of
// microseconds, and a reply within tens of microseconds of its request;
// waking a sleeping thread costs about as much again (more on a virtual
// machine).
constexpr int64_t kLingerNanos = 150'000;

class Node {
 public:
  std::shared_ptr<ucxx::Context> context;
  std::shared_ptr<ucxx::Worker> worker;
  ucp_worker_h wh{nullptr};
  bool errorHandling;
  bool polling;
  int wakeTimeout;
  // Puts from host memory of more than this many bytes, up to kPutEagerMax,
  // travel in parts of this size (0: whole).
  uint64_t putPart;
  std::thread progressThread;
  std::atomic<bool> stopping{false};
  std::atomic<bool> progressFailed{false};
  // Shared with the node's requests: who progresses the worker.
  std::shared_ptr<Progress> prog;

  std::shared_mutex tableMutex;
  std::unordered_map<uint64_t, std::shared_ptr<Region>> regions;
  std::deque<uint64_t> tombstones;
  uint64_t nextRegion{1};

  std::mutex opsMutex;
  std::unordered_map<uint64_t, std::unique_ptr<ClientOp>> ops;
  // (peer, region) pairs whose exporter said the region is host memory
  // (kReplyHostRegion): puts to them travel on kAmRequest.  Region ids are
  // never reused by a node; at most kMaxHostRegions, then forgotten.
  struct PairHash {
    size_t operator()(const std::pair<uint64_t, uint64_t>& p) const
    {
      return std::hash<uint64_t>()(p.first * 0x9E3779B97F4A7C15ull ^ p.second);
    }
  };
  std::unordered_set<std::pair<uint64_t, uint64_t>, PairHash> hostRegions;
  uint64_t nextOp{1};
  uint64_t nextPeer{1};

  // kept: request messages received on kAmRequestKeep.
  std::atomic<uint64_t> served{0}, refused{0}, messages{0}, kept{0};

  Node(const std::unordered_map<std::string, std::string>& config, bool polling_, bool errorHandling_,
       int wakeTimeoutMs, uint64_t putPart_)
    : errorHandling(errorHandling_), polling(polling_), wakeTimeout(wakeTimeoutMs), putPart(putPart_)
  {
    beforeUcpInit();
    ucxx::ConfigMap cfg(config.begin(), config.end());
    call("ucp_init", [&] {
      context = ucxx::contextBuilder(UCP_FEATURE_AM | UCP_FEATURE_WAKEUP).configMap(cfg).build();
      worker  = context->workerBuilder().build();
      wh      = worker->getHandle();
      prog    = std::make_shared<Progress>();
      prog->worker  = worker;
      prog->wh      = wh;
      prog->polling = polling;
      setHandler(kAmRequest, &Node::onRequest, false);
      setHandler(kAmReply, &Node::onReply, false);
      setHandler(kAmRequestKeep, &Node::onRequestKeep, true);
      setHandler(kAmReplyKeep, &Node::onReply, true);
      // Blocking mode sleeps in epoll_wait, with no timeout (-1) when every
      // transport wakes the worker's event fd; stopping signals it.
      if (!polling) worker->initBlockingProgressMode();
      progressThread = std::thread([this] { progressLoop(); });
      return 0;
    });
  }
  ~Node() { shutdown(); }

  // The node's one progress thread, the only thread that progresses the
  // worker.  Unlike libucxx's, it keeps polling for kLingerNanos after it
  // last did something or this process last posted a request, so that a
  // peer's next request, or the answer to ours, finds it awake; it then
  // sleeps in the kernel until an event (blocking mode), or never sleeps
  // (polling mode).  Idle, it costs nothing.
  void progressLoop()
  {
    deferTo = prog.get();
    while (!stopping.load(std::memory_order_acquire)) {
      try {
        prog->runDeferred();
        if (prog->claimed.load(std::memory_order_acquire)) {
          // A waiter progresses the worker: stand aside, running the
          // callbacks it hands over.
          std::unique_lock<std::mutex> lock(prog->parkMutex);
          prog->parkCv.wait_for(lock, std::chrono::nanoseconds(kParkNanos), [this] {
            return prog->hasDeferred.load(std::memory_order_acquire) ||
                   !prog->claimed.load(std::memory_order_acquire) || stopping.load(std::memory_order_acquire);
          });
          continue;
        }
        if (worker->progress()) {
          prog->lastActive.store(steadyNanos(), std::memory_order_relaxed);
          continue;
        }
        if (polling || steadyNanos() - prog->lastActive.load(std::memory_order_relaxed) < kLingerNanos) {
          std::this_thread::yield();
          continue;
        }
        // About to sleep: a request posted from now on wakes it (post()
        // stores lastActive, then reads asleep; this stores asleep, then
        // reads lastActive: one of the two sees the other).
        prog->asleep.store(true, std::memory_order_seq_cst);
        if (steadyNanos() - prog->lastActive.load(std::memory_order_seq_cst) < kLingerNanos ||
            prog->claimed.load(std::memory_order_seq_cst) || prog->hasDeferred.load(std::memory_order_seq_cst)) {
          prog->asleep.store(false, std::memory_order_relaxed);
          continue;
        }
        worker->progressWorkerEvent(wakeTimeout);
        prog->asleep.store(false, std::memory_order_relaxed);
      } catch (const std::exception& e) {
        prog->asleep.store(false, std::memory_order_relaxed);
        // UCX failed to arm or wait: say so once, and poll slowly rather than spin.
        if (!progressFailed.exchange(true))
          std::fprintf(stderr, "[gpushare] UCX progress failed, polling every millisecond: %s\n", e.what());
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  }

  // Stop and join the progress thread, without the GIL (it may be waiting
  // for the GIL to run a Python callback) unless Python is going away.
  void stopProgress()
  {
    if (!progressThread.joinable()) return;
    if (deferTo == prog.get())
      throw NativeError("UCS_ERR_INVALID_PARAM", "the UCX node cannot be closed from inside its own progress");
    stopping.store(true, std::memory_order_release);
    withoutGil([this] {
      prog->close();
      prog->unpark();
      if (!polling) ucp_worker_signal(wh);
      progressThread.join();
      // Callbacks a waiter handed over after the thread's last look.
      prog->runDeferred();
    });
  }

  // `keep`: UCX hands eager payloads over in descriptors of its own, which
  // the handler may keep (UCP_AM_FLAG_PERSISTENT_DATA; copied once more).
  void setHandler(unsigned id, ucp_am_recv_callback_t cb, bool keep)
  {
    ucp_am_handler_param_t p{};
    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                   UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    p.id    = id;
    p.cb    = cb;
    p.arg   = this;
    p.flags = keep ? UCP_AM_FLAG_PERSISTENT_DATA : 0;
    ucs_status_t s = ucp_worker_set_am_recv_handler(wh, &p);
    if (s != UCS_OK) throw NativeError(statusName(s), "ucp_worker_set_am_recv_handler failed");
  }

  void checkOpen()
  {
    if (!worker || stopping.load(std::memory_order_acquire))
      throw NativeError("UCS_ERR_INVALID_PARAM", "the UCX node is closed");
  }

  nb::bytes address()
  {
    checkOpen();
    auto w    = worker;
    auto addr = call("ucp_worker_get_address", [&] {
      std::shared_ptr<ucxx::Address> a = ucxx::AddressBuilder(w).build();
      return std::string(a->getStringView());
    });
    return nb::bytes(addr.data(), addr.size());
  }

  std::string info()
  {
    checkOpen();
    auto w = worker;
    return call("ucp_worker_print_info", [&] { return w->getInfo(); });
  }

  // ---- exporter side -------------------------------------------------------

  uint64_t addRegion(uintptr_t base, uint64_t length, bool readonly, int memoryType)
  {
    checkOpen();
    if (base == 0 || length == 0) throw NativeError("UCS_ERR_INVALID_PARAM", "a region needs memory");
    auto r        = std::make_shared<Region>();
    r->base       = base;
    r->length     = length;
    r->readonly   = readonly;
    r->memoryType = static_cast<ucs_memory_type_t>(memoryType);
    auto ctx      = context;
    r->memh       = call("ucp_mem_map", [&]() -> std::shared_ptr<ucxx::MemoryHandle> {
      return ctx->memoryHandleBuilder(length)
        .buffer(reinterpret_cast<void*>(base))
        .memoryType(r->memoryType)
        .build();
    });
    r->ucpMemh = r->memh->getHandle();
    std::unique_lock<std::shared_mutex> lock(tableMutex);
    r->id = nextRegion++;
    regions.emplace(r->id, r);
    return r->id;
  }

  std::shared_ptr<Region> findOpen(uint64_t id)
  {
    auto it = regions.find(id);
    if (it == regions.end() || it->second->closed)
      throw NativeError("UCS_ERR_INVALID_PARAM", "no open region " + std::to_string(id));
    return it->second;
  }

  void grant(uint64_t id, nb::bytes key)
  {
    Key128 k = keyFromBytes(std::string(key.c_str(), key.size()));
    std::unique_lock<std::shared_mutex> lock(tableMutex);
    findOpen(id)->keys.emplace(k, std::make_shared<Grant>());
  }

  // Refuse the key's requests from now on, then wait (at most `timeout` s)
  // for its transfers under way.  0: it was not granted; 1: revoked, nothing
  // of it in flight any more; 2: revoked, but transfers were still going.
  int revoke(uint64_t id, nb::bytes key, double timeout)
  {
    Key128 k = keyFromBytes(std::string(key.c_str(), key.size()));
    std::shared_ptr<Grant> g;
    {
      std::unique_lock<std::shared_mutex> lock(tableMutex);
      auto it = regions.find(id);
      if (it == regions.end() || it->second->closed) return 0;
      auto kit = it->second->keys.find(k);
      if (kit == it->second->keys.end()) return 0;
      g = kit->second;
      g->revoked = true;
      it->second->keys.erase(kit);
    }
    nb::gil_scoped_release release;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout);
    while (g->inflight.load(std::memory_order_acquire) > 0) {
      if (std::chrono::steady_clock::now() > deadline) return 2;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return 1;
  }

  // Refuse new requests, wait (at most `timeout` s) for transfers under way,
  // then unregister.  Returns whether the memory is free of UCX; on false it
  // stays registered and the caller must keep it alive.
  bool closeRegion(uint64_t id, double timeout)
  {
    std::shared_ptr<Region> r;
    {
      std::unique_lock<std::shared_mutex> lock(tableMutex);
      auto it = regions.find(id);
      if (it == regions.end()) return true;
      r = it->second;
      if (!r->closed) {
        r->closed = true;
        tombstones.push_back(id);
        while (tombstones.size() > kMaxTombstones) {
          regions.erase(tombstones.front());
          tombstones.pop_front();
        }
      }
    }
    {
      nb::gil_scoped_release release;
      auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout);
      while (r->inflight.load(std::memory_order_acquire) > 0) {
        if (std::chrono::steady_clock::now() > deadline) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      r->ucpMemh = nullptr;
      r->memh.reset();
    }
    return true;
  }

  // (open regions, granted keys, refused requests, served requests, request messages)
  std::tuple<size_t, size_t, uint64_t, uint64_t, uint64_t, uint64_t> stats()
  {
    std::shared_lock<std::shared_mutex> lock(tableMutex);
    size_t open = 0, keys = 0;
    for (auto& [id, r] : regions)
      if (!r->closed) {
        ++open;
        keys += r->keys.size();
      }
    return {open, keys, refused.load(), served.load(), messages.load(), kept.load()};
  }

  // The access check: every request passes here before any byte moves.
  uint32_t admit(const RequestHeader& h, size_t dataLength, std::shared_ptr<Region>& out,
                 std::shared_ptr<Grant>& grantOut)
  {
    std::shared_lock<std::shared_mutex> lock(tableMutex);
    auto it = regions.find(h.regionId);
    if (it == regions.end()) return GS_ACCESS_DENIED;
    Region& r = *it->second;
    auto kit  = r.keys.find(Key128{h.key[0], h.key[1]});
    if (kit == r.keys.end()) return GS_ACCESS_DENIED;
    if (r.closed) return GS_CLOSED;
    if (h.op == kOpPut && r.readonly) return GS_READ_ONLY;
    if (h.length == 0 || h.offset > r.length || h.length > r.length - h.offset) return GS_OUT_OF_BOUNDS;
    if (h.op == kOpPut ? dataLength != h.length : dataLength != 0) return GS_BAD_REQUEST;
    r.inflight.fetch_add(1, std::memory_order_acq_rel);
    kit->second->inflight.fetch_add(1, std::memory_order_acq_rel);
    out      = it->second;
    grantOut = kit->second;
    return GS_OK;
  }

  void reply(ucp_ep_h ep, uint64_t requestId, uint32_t status, uint32_t kind, uint32_t flags = 0)
  {
    ReplyHeader rh{kWireMagic, status, requestId, 0, kind, flags};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK;
    p.flags        = UCP_AM_SEND_FLAG_COPY_HEADER | UCP_AM_SEND_FLAG_REPLY;
    p.cb.send      = freeRequest;
    ucs_status_ptr_t sp = ucp_am_send_nbx(ep, kAmReply, &rh, sizeof(rh), nullptr, 0, &p);
    (void)sp;  // NULL, an error (the importer is gone), or freed on completion
  }

  // Whether a failed transfer left the connection usable for an answer; on
  // a failed connection the importer learns of it from its own endpoint.
  static bool connectionAlive(ucs_status_t s)
  {
    return !UCS_IS_LINK_ERROR(s) && !UCS_IS_ENDPOINT_ERROR(s) && s != UCS_ERR_CONNECTION_RESET &&
           s != UCS_ERR_CANCELED && s != UCS_ERR_UNREACHABLE && s != UCS_ERR_NOT_CONNECTED;
  }

  // What a transfer admitted earlier reports once its data has moved.
  static uint32_t verdictAfter(ServerOp* op)
  {
    std::shared_lock<std::shared_mutex> lock(op->node->tableMutex);
    if (op->region->closed) return GS_CLOSED;
    if (op->grant->revoked) return GS_ACCESS_DENIED;
    return GS_OK;
  }

  // A transfer admitted on `region` with `grant` lets go of the memory.
  static void letGo(Region& region, Grant& grant)
  {
    grant.inflight.fetch_sub(1, std::memory_order_acq_rel);
    region.inflight.fetch_sub(1, std::memory_order_acq_rel);
  }

  static void release(ServerOp* op)
  {
    letGo(*op->region, *op->grant);
    delete op;
  }

  static void finishGet(ServerOp* op, ucs_status_t status)
  {
    Node* n = op->node;
    if (status == UCS_OK) {
      if (op->length >= kTrailerMin) n->reply(op->replyEp, op->requestId, verdictAfter(op), kReplyTrailer);
    } else if (connectionAlive(status)) {
      // The importer may have the reply header already: a trailer (large
      // gets) or a second reply (ignored if so) carries the failure.
      n->reply(op->replyEp, op->requestId, GS_TRANSFER, op->length >= kTrailerMin ? kReplyTrailer : kReplyData);
    }
    release(op);
  }

  static void onGetSent(void* request, ucs_status_t status, void* user)
  {
    ucp_request_free(request);
    finishGet(static_cast<ServerOp*>(user), status);
  }

  static void finishPut(ServerOp* op, ucs_status_t status)
  {
    Node* n = op->node;
    if (status == UCS_OK) {
      n->reply(op->replyEp, op->requestId, verdictAfter(op), kReplyData,
               op->region->memoryType == UCS_MEMORY_TYPE_HOST ? kReplyHostRegion : 0);
    } else if (connectionAlive(status)) {
      n->reply(op->replyEp, op->requestId, GS_TRANSFER, kReplyData);
    }
    release(op);
  }

  static void onPutReceived(void* request, ucs_status_t status, size_t, void* user)
  {
    ucp_request_free(request);
    finishPut(static_cast<ServerOp*>(user), status);
  }

  // Check one get and send its data (or the refusal) back.
  void serveGet(ucp_ep_h ep, const RequestHeader& h, size_t dataLength)
  {
    std::shared_ptr<Region> region;
    std::shared_ptr<Grant> grant;
    uint32_t verdict = admit(h, dataLength, region, grant);
    if (verdict != GS_OK) {
      refused.fetch_add(1, std::memory_order_relaxed);
      reply(ep, h.requestId, verdict, kReplyData);
      return;
    }
    served.fetch_add(1, std::memory_order_relaxed);
    void* at = reinterpret_cast<void*>(region->base + h.offset);
    auto* op = new ServerOp{this, region, grant, ep, h.requestId, h.length};
    ReplyHeader rh{kWireMagic, GS_OK, h.requestId, h.length, kReplyData,
                   region->memoryType == UCS_MEMORY_TYPE_HOST ? kReplyHostRegion : 0u};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_MEMORY_TYPE | UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FIELD_FLAGS;
    p.user_data   = op;
    p.memory_type = region->memoryType;
    p.memh        = region->ucpMemh;
    p.flags       = UCP_AM_SEND_FLAG_COPY_HEADER | UCP_AM_SEND_FLAG_REPLY |
              (h.length <= kEagerMax ? UCP_AM_SEND_FLAG_EAGER : 0);
    p.cb.send     = &Node::onGetSent;
    ucs_status_ptr_t sp = ucp_am_send_nbx(ep, (h.flags & kReqReplyKeep) ? kAmReplyKeep : kAmReply, &rh, sizeof(rh),
                                          at, h.length, &p);
    if (!UCS_PTR_IS_PTR(sp)) finishGet(op, UCS_PTR_STATUS(sp));
  }

  // A batch of gets in one message: each item is checked and answered alone.
  void serveGetBatch(ucp_ep_h ep, const RequestHeader& h, const void* data, size_t length, uint64_t recvAttr)
  {
    const uint64_t count = h.length;
    const bool valid = count >= 1 && count <= kMaxBatchItems && length == count * sizeof(BatchItem) &&
                       !(recvAttr & UCP_AM_RECV_ATTR_FLAG_RNDV) && h.requestId <= UINT64_MAX - count;
    if (!valid) {
      refuseBatch(ep, h);
      return;
    }
    for (uint64_t i = 0; i < count; ++i) serveGet(ep, batchItem(h, kOpGet, data, i), 0);
  }

  // Refuse every item a malformed batch's header claims, as far as it can be trusted.
  void refuseBatch(ucp_ep_h ep, const RequestHeader& h)
  {
    const uint64_t n = std::min<uint64_t>(h.length, kMaxBatchItems);
    refused.fetch_add(1, std::memory_order_relaxed);
    for (uint64_t i = 0; i < n && h.requestId <= UINT64_MAX - i; ++i)
      reply(ep, h.requestId + i, GS_BAD_REQUEST, kReplyData);
  }

  // Item `i` of a (validated) batch as the request header of a single `op`.
  static RequestHeader batchItem(const RequestHeader& h, uint8_t op, const void* items, uint64_t i)
  {
    BatchItem item;
    std::memcpy(&item, static_cast<const char*>(items) + i * sizeof(BatchItem), sizeof(item));
    RequestHeader one{};
    one.magic     = kWireMagic;
    one.op        = op;
    one.flags     = h.flags;
    one.requestId = h.requestId + i;
    one.regionId  = item.regionId;
    one.key[0]    = item.key[0];
    one.key[1]    = item.key[1];
    one.offset    = item.offset;
    one.length    = item.length;
    return one;
  }

  // A batch of puts in one eager message: each item is checked, copied into
  // its region and answered alone.  Only host-memory regions take part (the
  // importer gathers puts for regions it knows to be host memory); an item
  // for any other region is refused.
  void servePutBatch(ucp_ep_h ep, const RequestHeader& h, const void* data, size_t length, uint64_t recvAttr)
  {
    const uint64_t count = h.length;
    bool valid = count >= 1 && count <= kMaxBatchItems && length >= count * sizeof(BatchItem) &&
                 !(recvAttr & UCP_AM_RECV_ATTR_FLAG_RNDV) && h.requestId <= UINT64_MAX - count;
    const char* items = static_cast<const char*>(data);
    if (valid) {
      // The items' lengths must add up to the data that follows them.
      uint64_t left = length - count * sizeof(BatchItem);
      for (uint64_t i = 0; i < count && valid; ++i) {
        BatchItem item;
        std::memcpy(&item, items + i * sizeof(BatchItem), sizeof(item));
        valid = item.length <= left;
        left -= valid ? item.length : 0;
      }
      valid = valid && left == 0;
    }
    if (!valid) {
      refuseBatch(ep, h);
      return;
    }
    const char* payload = items + count * sizeof(BatchItem);
    for (uint64_t i = 0; i < count; ++i) {
      const RequestHeader one = batchItem(h, kOpPut, items, i);
      // The item's bytes are part of the message, not a UCX data descriptor.
      servePut(ep, one, 0, const_cast<char*>(payload), one.length, 0, true);
      payload += one.length;
    }
  }

  static ucs_status_t onRequestKeep(void* arg, const void* header, size_t headerLength, void* data,
                                    size_t length, const ucp_am_recv_param_t* param)
  {
    static_cast<Node*>(arg)->kept.fetch_add(1, std::memory_order_relaxed);
    return onRequest(arg, header, headerLength, data, length, param);
  }

  static ucs_status_t onRequest(void* arg, const void* header, size_t headerLength, void* data,
                                size_t length, const ucp_am_recv_param_t* param)
  {
    Node* n = static_cast<Node*>(arg);
    n->prog->lastActive.store(steadyNanos(), std::memory_order_relaxed);
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) || param->reply_ep == nullptr)
      return UCS_OK;  // nobody to answer: drop
    ucp_ep_h ep = param->reply_ep;
    n->messages.fetch_add(1, std::memory_order_relaxed);
    RequestHeader h;
    if (headerLength != sizeof(h) && headerLength != sizeof(PartHeader)) {
      n->refused.fetch_add(1, std::memory_order_relaxed);
      n->reply(ep, 0, GS_BAD_REQUEST, kReplyData);
      return UCS_OK;
    }
    std::memcpy(&h, header, sizeof(h));
    // A part header for a part, a plain one for anything else.
    const bool part = h.op == kOpPutPart;
    if (h.magic != kWireMagic || part != (headerLength == sizeof(PartHeader)) ||
        (h.op != kOpGet && h.op != kOpPut && h.op != kOpGetBatch && h.op != kOpPutBatch && !part)) {
      n->refused.fetch_add(1, std::memory_order_relaxed);
      n->reply(ep, h.requestId, GS_BAD_REQUEST, kReplyData);
      return UCS_OK;
    }
    if (h.op == kOpGetBatch) {
      n->serveGetBatch(ep, h, data, length, param->recv_attr);
      return UCS_OK;
    }
    if (h.op == kOpPutBatch) {
      n->servePutBatch(ep, h, data, length, param->recv_attr);
      return UCS_OK;
    }
    if (h.op == kOpGet) {
      n->serveGet(ep, h, length);
      return UCS_OK;
    }
    uint64_t partOffset = 0;
    if (part) std::memcpy(&partOffset, static_cast<const char*>(header) + sizeof(h), sizeof(partOffset));
    return n->servePut(ep, h, partOffset, data, length, param->recv_attr);
  }

  // Check one put, or one part of one, and land its data (or refuse it).
  // `hostOnly`: `data` is plain bytes (an item of a gathered put, or an
  // eager payload on kAmRequest), which only
  // a host-memory region can take (copied); any other region refuses it.
  ucs_status_t servePut(ucp_ep_h ep, const RequestHeader& h, uint64_t partOffset, void* data, size_t length,
                        uint64_t recvAttr, bool hostOnly = false)
  {
    const bool part = h.op == kOpPutPart;
    // An eager payload UCX did not keep can be copied to host memory only.
    hostOnly = hostOnly || !(recvAttr & (UCP_AM_RECV_ATTR_FLAG_RNDV | UCP_AM_RECV_ATTR_FLAG_DATA));
    RequestHeader whole = h;
    whole.op            = kOpPut;
    std::shared_ptr<Region> region;
    std::shared_ptr<Grant> grant;
    uint32_t verdict = admit(whole, part ? h.length : length, region, grant);
    if (verdict == GS_OK && ((part && (length == 0 || partOffset > h.length || length > h.length - partOffset)) ||
                             (hostOnly && region->memoryType != UCS_MEMORY_TYPE_HOST))) {
      letGo(*region, *grant);
      verdict = GS_BAD_REQUEST;
    }
    if (verdict != GS_OK) {
      refused.fetch_add(1, std::memory_order_relaxed);
      reply(ep, h.requestId, verdict, kReplyData);
      return UCS_OK;  // a rendezvous payload is dropped unread
    }
    served.fetch_add(1, std::memory_order_relaxed);
    void* at = reinterpret_cast<void*>(region->base + h.offset + partOffset);
    auto* op = new ServerOp{this, region, grant, ep, h.requestId, length};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_MEMORY_TYPE | UCP_OP_ATTR_FIELD_MEMH;
    p.user_data   = op;
    p.memory_type = region->memoryType;
    p.memh        = region->ucpMemh;
    const bool rndv = (recvAttr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    if (!rndv && region->memoryType == UCS_MEMORY_TYPE_HOST) {
      std::memcpy(at, data, length);
      finishPut(op, UCS_OK);
      return UCS_OK;
    }
    p.cb.recv_am        = &Node::onPutReceived;
    ucs_status_ptr_t sp = ucp_am_recv_data_nbx(wh, data, at, length, &p);
    if (!UCS_PTR_IS_PTR(sp)) finishPut(op, UCS_PTR_STATUS(sp));
    return UCS_INPROGRESS;  // UCX owns the descriptor now
  }

  // ---- importer side -------------------------------------------------------

  // Clear `parts` of op `id`; complete it (and its batch) when nothing is
  // awaited.  Called with opsMutex held; completions to run are appended to
  // `done` and run after the lock is dropped.
  void clearParts(ClientOp* op, uint32_t parts, std::vector<std::shared_ptr<Batch>>& done)
  {
    op->waiting &= ~parts;
    if (op->waiting != 0) return;
    auto b = op->batch;
    if (b->status == UCS_OK && b->gs == GS_OK) {
      b->status = op->status;
      b->gs     = op->gs;
    }
    ops.erase(op->id);  // frees op
    if (--b->left == 0) done.push_back(std::move(b));
  }

  static void runDone(std::vector<std::shared_ptr<Batch>>& done)
  {
    for (auto& b : done)
      b->completion->complete(b->status, b->gs);
  }

  // partDone for ops first .. first + count - 1.
  void partDone(uint64_t first, uint32_t parts, ucs_status_t status, uint64_t count = 1)
  {
    std::vector<std::shared_ptr<Batch>> done;
    {
      std::lock_guard<std::mutex> lock(opsMutex);
      for (uint64_t id = first; id < first + count; ++id) {
        auto it = ops.find(id);
        if (it == ops.end()) continue;
        ClientOp* op = it->second.get();
        uint32_t these = parts;
        if (status != UCS_OK) {
          op->fail(status, GS_OK);
          // The request never reached the exporter: no answer will come.
          if (these & kWaitSend) these |= kWaitReply | kWaitTrailer;
        }
        clearParts(op, these, done);
      }
    }
    runDone(done);
  }

  // What a request message's send completion needs: the ops it carries, and
  // the batch items it points UCX at until then.
  struct SendCtx {
    Node* node;
    uint64_t first;
    uint64_t count;
    std::vector<BatchItem> items;
    std::vector<ucp_dt_iov_t> iov;  // a put batch's payload: the items, then each item's data
  };

  static void onRequestSent(void* request, ucs_status_t status, void* user)
  {
    ucp_request_free(request);
    auto* ctx = static_cast<SendCtx*>(user);
    ctx->node->partDone(ctx->first, kWaitSend, status, ctx->count);
    delete ctx;
  }

  static void onGetReceived(void* request, ucs_status_t status, size_t, void* user)
  {
    ucp_request_free(request);
    auto* ctx = static_cast<std::pair<Node*, uint64_t>*>(user);
    ctx->first->partDone(ctx->second, kWaitRecv, status);
    delete ctx;
  }

  static ucs_status_t onReply(void* arg, const void* header, size_t headerLength, void* data,
                              size_t length, const ucp_am_recv_param_t* param)
  {
    Node* n = static_cast<Node*>(arg);
    ReplyHeader rh;
    if (headerLength != sizeof(rh)) return UCS_OK;
    std::memcpy(&rh, header, sizeof(rh));
    if (rh.magic != kWireMagic) return UCS_OK;
    ucp_ep_h from = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
    std::vector<std::shared_ptr<Batch>> done;
    std::unique_lock<std::mutex> lock(n->opsMutex);
    auto it = n->ops.find(rh.requestId);
    // Unknown (already failed) or from another exporter than asked: ignore.
    if (it == n->ops.end() || it->second->ep != from) return UCS_OK;
    ClientOp* op = it->second.get();
    if ((rh.flags & kReplyHostRegion) && rh.status == GS_OK && (op->op == kOpPut || op->op == kOpGet)) {
      if (n->hostRegions.size() >= kMaxHostRegions) n->hostRegions.clear();
      n->hostRegions.emplace(op->peerId, op->regionId);
    }
    if (rh.kind == kReplyTrailer) {
      if (!(op->waiting & kWaitTrailer)) return UCS_OK;
      if (rh.status != GS_OK) op->fail(UCS_OK, rh.status > GS_LAST ? GS_BAD_REPLY : rh.status);
      n->clearParts(op, kWaitTrailer, done);
      lock.unlock();
      runDone(done);
      return UCS_OK;
    }
    if (rh.kind != kReplyData || !(op->waiting & kWaitReply)) return UCS_OK;
    uint32_t parts = kWaitReply;
    if (rh.status != GS_OK || op->op == kOpPut || length != op->length || rh.length != op->length) {
      if (rh.status != GS_OK)
        op->fail(UCS_OK, rh.status > GS_LAST ? GS_BAD_REPLY : rh.status);
      else if (op->op == kOpPut ? length != 0 : true)
        op->fail(UCS_OK, GS_BAD_REPLY);
      parts |= kWaitTrailer;  // no trailer follows a refusal
      if (op->op == kOpPut && rh.status == GS_OK && length == 0) parts = kWaitReply;
      n->clearParts(op, parts, done);
      lock.unlock();
      runDone(done);
      return UCS_OK;  // any payload is dropped
    }
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    if (!rndv && op->memoryType == UCS_MEMORY_TYPE_HOST) {
      std::memcpy(op->buffer, data, length);
      n->clearParts(op, kWaitReply, done);
      lock.unlock();
      runDone(done);
      return UCS_OK;
    }
    if (!rndv && !(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA)) {
      // Eager data for device memory on kAmReply, which we did not ask for.
      op->fail(UCS_OK, GS_BAD_REPLY);
      n->clearParts(op, kWaitReply | kWaitTrailer, done);
      lock.unlock();
      runDone(done);
      return UCS_OK;
    }
    // Receive into the caller's buffer; the op stays until this completes.
    op->waiting = (op->waiting & ~kWaitReply) | kWaitRecv;
    void* buffer = op->buffer;
    ucs_memory_type_t mt = op->memoryType;
    uint64_t id = op->id;
    lock.unlock();
    auto* ctx = new std::pair<Node*, uint64_t>(n, id);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    p.cb.recv_am   = &Node::onGetReceived;
    p.user_data    = ctx;
    p.memory_type  = mt;
    ucs_status_ptr_t sp = ucp_am_recv_data_nbx(n->wh, data, buffer, length, &p);
    if (!UCS_PTR_IS_PTR(sp)) {
      delete ctx;
      n->partDone(id, kWaitRecv, UCS_PTR_STATUS(sp));
    }
    return UCS_INPROGRESS;
  }

  // Every op toward a failed or closed peer stops waiting for its answers.
  void failPeer(uint64_t peerId, ucs_status_t status)
  {
    std::vector<std::shared_ptr<Batch>> done;
    {
      std::lock_guard<std::mutex> lock(opsMutex);
      std::vector<ClientOp*> hit;
      for (auto& [id, op] : ops)
        if (op->peerId == peerId) hit.push_back(op.get());
      for (auto* op : hit) {
        op->fail(status, GS_OK);
        clearParts(op, kWaitReply | kWaitTrailer, done);
      }
    }
    runDone(done);
  }

  struct Item {
    uint64_t regionId;
    Key128 key;
    uint64_t offset;
    uintptr_t buffer;
    uint64_t length;
    int memoryType;
  };

  // Post one op per item; the request completes once all have.  Gets of
  // several items travel as kOpGetBatch messages; with `gather` (the caller
  // knows every region to be host memory), consecutive small puts from host
  // buffers travel as kOpPutBatch messages.
  Request post(uint64_t peerId, ucp_ep_h ep, uint8_t opCode, const std::vector<Item>& asked,
               const std::string& kind, bool gather = false)
  {
    checkOpen();
    // A put of more than putPart bytes (up to kPutEagerMax) travels in
    // parts, each an op of its own: each part is one eager message that
    // UCX sends from the buffer itself and the exporter copies straight
    // from its receive buffer (a whole 1 MiB message is copied on both
    // sides and reassembled), and the parts' copies overlap.
    struct Part {
      uint64_t wholeOffset, wholeLength, partOffset;  // wholeLength 0: not a part
    };
    std::vector<Item> items;
    std::vector<Part> parts;
    items.reserve(asked.size());
    parts.reserve(asked.size());
    for (auto& it : asked) {
      if (opCode == kOpPut && putPart > 0 && it.memoryType == UCS_MEMORY_TYPE_HOST && it.length > putPart &&
          it.length <= kPutEagerMax) {
        for (uint64_t o = 0; o < it.length; o += putPart) {
          Item x   = it;
          x.buffer = it.buffer + o;
          x.length = std::min(putPart, it.length - o);
          items.push_back(x);
          parts.push_back({it.offset, it.length, o});
        }
      } else {
        items.push_back(it);
        parts.push_back({0, 0, 0});
      }
    }
    auto c     = std::make_shared<Completion>();
    auto b     = std::make_shared<Batch>();
    b->completion = c;
    b->left       = items.size();
    Request r(c, kind);
    r.progress = prog;
    uint64_t bytes = 0;
    for (auto& it : items) bytes += it.length;
    r.spinMicros = std::min<int64_t>(kSpinMaxMicros, kSpinMicros + static_cast<int64_t>(bytes / kSpinBytesPerMicro));
    if (items.empty()) {
      c->complete(UCS_OK);
      return r;
    }
    std::vector<uint64_t> ids;
    ids.reserve(items.size());
    // Puts to regions known to be host memory travel on kAmRequest.
    std::vector<char> hostRegion(items.size(), 0);
    {
      std::lock_guard<std::mutex> lock(opsMutex);
      if (opCode == kOpPut)
        for (size_t i = 0; i < items.size(); ++i)
          hostRegion[i] = hostRegions.count({peerId, items[i].regionId}) != 0;
      for (auto& it : items) {
        auto op        = std::make_unique<ClientOp>();
        op->id         = nextOp++;
        op->peerId     = peerId;
        op->ep         = ep;
        op->op         = opCode;
        op->regionId   = it.regionId;
        op->buffer     = reinterpret_cast<void*>(it.buffer);
        op->length     = it.length;
        op->memoryType = static_cast<ucs_memory_type_t>(it.memoryType);
        op->waiting    = kWaitSend | kWaitReply |
                      (opCode == kOpGet && it.length >= kTrailerMin ? kWaitTrailer : 0);
        op->batch      = b;
        ids.push_back(op->id);
        ops.emplace(op->id, std::move(op));
      }
    }
    nb::gil_scoped_release release;
    bool signal = false;
    auto send = [&](unsigned amId, SendCtx* ctx, const void* header, size_t headerLength, const void* payload,
                    size_t count, int memoryType, uint32_t flags, bool iov = false) {
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_MEMORY_TYPE |
                       (iov ? UCP_OP_ATTR_FIELD_DATATYPE : 0);
      if (iov) p.datatype = ucp_dt_make_iov();
      p.flags       = UCP_AM_SEND_FLAG_COPY_HEADER | UCP_AM_SEND_FLAG_REPLY | flags;
      p.cb.send     = &Node::onRequestSent;
      p.user_data   = ctx;
      p.memory_type = static_cast<ucs_memory_type_t>(memoryType);
      ucs_status_ptr_t sp = ucp_am_send_nbx(ep, amId, header, headerLength, payload, count, &p);
      if (UCS_PTR_IS_PTR(sp)) {
        signal = true;
      } else {
        partDone(ctx->first, kWaitSend, UCS_PTR_STATUS(sp), ctx->count);
        delete ctx;
      }
    };
    for (size_t i = 0; i < items.size();) {
      RequestHeader h{};
      h.magic     = kWireMagic;
      h.requestId = ids[i];
      if (opCode == kOpGet && items.size() - i > 1) {
        // Gets travel as one request message per up to kMaxBatchItems items.
        const size_t k = std::min<size_t>(items.size() - i, kMaxBatchItems);
        auto* ctx      = new SendCtx{this, ids[i], k, std::vector<BatchItem>(k)};
        for (size_t j = 0; j < k; ++j) {
          const Item& it   = items[i + j];
          ctx->items[j]    = BatchItem{it.regionId, {it.key.lo, it.key.hi}, it.offset, it.length};
          if (it.memoryType != UCS_MEMORY_TYPE_HOST) h.flags = kReqReplyKeep;
        }
        h.op     = kOpGetBatch;
        h.length = k;
        send(kAmRequest, ctx, &h, sizeof(h), ctx->items.data(), k * sizeof(BatchItem), UCS_MEMORY_TYPE_HOST,
             UCP_AM_SEND_FLAG_EAGER);
        i += k;
        continue;
      }
      if (opCode == kOpPut && gather) {
        // The run of puts that fits one message.
        size_t k = 0;
        uint64_t bytes = 0;
        while (i + k < items.size() && k < kMaxBatchItems) {
          const Item& it = items[i + k];
          if (it.memoryType != UCS_MEMORY_TYPE_HOST || it.length > kEagerMax || bytes + it.length > kPutEagerMax ||
              parts[i + k].wholeLength != 0)
            break;
          bytes += it.length;
          ++k;
        }
        if (k > 1) {
          auto* ctx = new SendCtx{this, ids[i], k, std::vector<BatchItem>(k), {}};
          ctx->iov.reserve(k + 1);
          ctx->iov.push_back({ctx->items.data(), k * sizeof(BatchItem)});
          for (size_t j = 0; j < k; ++j) {
            const Item& it = items[i + j];
            ctx->items[j]  = BatchItem{it.regionId, {it.key.lo, it.key.hi}, it.offset, it.length};
            ctx->iov.push_back({reinterpret_cast<void*>(it.buffer), it.length});
          }
          h.op     = kOpPutBatch;
          h.length = k;
          send(kAmRequest, ctx, &h, sizeof(h), ctx->iov.data(), ctx->iov.size(), UCS_MEMORY_TYPE_HOST,
               UCP_AM_SEND_FLAG_EAGER, true);
          i += k;
          continue;
        }
      }
      const Item& it = items[i];
      h.op           = opCode;
      h.regionId     = it.regionId;
      h.key[0]       = it.key.lo;
      h.key[1]       = it.key.hi;
      h.offset       = it.offset;
      h.length       = it.length;
      const bool put = opCode == kOpPut;
      if (!put && it.memoryType != UCS_MEMORY_TYPE_HOST) h.flags = kReqReplyKeep;
      const unsigned amId = put && !hostRegion[i] ? kAmRequestKeep : kAmRequest;
      const void* src = put ? reinterpret_cast<const void*>(it.buffer) : nullptr;
      const uint32_t eager = put && it.length <= kPutEagerMax ? UCP_AM_SEND_FLAG_EAGER : 0;
      if (parts[i].wholeLength != 0) {
        PartHeader ph{h, parts[i].partOffset};
        ph.whole.op     = kOpPutPart;
        ph.whole.offset = parts[i].wholeOffset;
        ph.whole.length = parts[i].wholeLength;
        send(amId, new SendCtx{this, ids[i], 1, {}}, &ph, sizeof(ph), src, it.length, it.memoryType, eager);
      } else {
        send(amId, new SendCtx{this, ids[i], 1, {}}, &h, sizeof(h), src, put ? it.length : 0, it.memoryType, eager);
      }
      ++i;
    }
    // A request UCX queued is finished by the progress thread: keep it
    // polling for the answer (wake it if it sleeps).
    prog->lastActive.store(steadyNanos(), std::memory_order_seq_cst);
    if (signal && !polling && prog->asleep.load(std::memory_order_seq_cst)) ucp_worker_signal(wh);
    return r;
  }

  void shutdown()
  {
    if (!worker) return;
    stopProgress();
    {
      std::unique_lock<std::shared_mutex> lock(tableMutex);
      for (auto& [id, r] : regions) {
        r->closed  = true;
        r->ucpMemh = nullptr;
        releaseNoGil(r->memh);
      }
    }
    // Whatever is still awaited will not come.
    std::vector<std::shared_ptr<Batch>> done;
    {
      std::lock_guard<std::mutex> lock(opsMutex);
      std::vector<ClientOp*> all;
      for (auto& [id, op] : ops) all.push_back(op.get());
      for (auto* op : all) {
        op->fail(UCS_ERR_CANCELED, GS_OK);
        clearParts(op, ~0u, done);
      }
    }
    if (!pyFinalizing()) runDone(done);
    if (prog) {
      prog->close();  // done by stopProgress() unless its thread never started
      prog->worker.reset();
    }
    releaseNoGil(worker);
    releaseNoGil(context);
  }

  bool closed() const { return !worker; }
};

// A connection from this process's node to another process's node.
class Peer : public Endpoint {
 public:
  Node* node;
  uint64_t id;
  ucp_ep_h handle;

  Peer(Node* n, std::shared_ptr<ucxx::Endpoint> e, uint64_t id_)
    : Endpoint(std::move(e)), node(n), id(id_), handle(ep->getHandle())
  {
  }

  static Peer* connect(Node& n, nb::bytes address)
  {
    n.checkOpen();
    auto w = n.worker;
    std::string s(address.c_str(), address.size());
    uint64_t id;
    {
      std::lock_guard<std::mutex> lock(n.opsMutex);
      id = n.nextPeer++;
    }
    Node* np = &n;
    auto e = call("ucp_ep_create", [&]() -> std::shared_ptr<ucxx::Endpoint> {
      std::shared_ptr<ucxx::Address> a = ucxx::AddressBuilder(std::string_view(s)).build();
      auto ep = ucxx::endpointBuilder(w, a).endpointErrorHandling(n.errorHandling).build();
      ep->setCloseCallback(
        [np, id](ucs_status_t status, std::shared_ptr<void>) {
          np->failPeer(id, status == UCS_OK ? UCS_ERR_CONNECTION_RESET : status);
        },
        nullptr);
      return ep;
    });
    return new Peer(np, std::move(e), id);
  }

  Request post(uint8_t opCode, const std::vector<std::tuple<uint64_t, nb::bytes, uint64_t, uintptr_t, uint64_t, int>>& items,
               const std::string& kind, bool gather)
  {
    get();
    std::vector<Node::Item> v;
    v.reserve(items.size());
    for (auto& [region, key, offset, buffer, length, mt] : items)
      v.push_back(Node::Item{region, keyFromBytes(std::string(key.c_str(), key.size())), offset, buffer,
                             length, mt});
    return node->post(id, handle, opCode, v, kind, gather);
  }

  Request get1(uint64_t region, nb::bytes key, uint64_t offset, uintptr_t buffer, uint64_t length, int mt)
  {
    get();
    std::vector<Node::Item> v{Node::Item{region, keyFromBytes(std::string(key.c_str(), key.size())), offset,
                                         buffer, length, mt}};
    return node->post(id, handle, kOpGet, v, "get");
  }

  Request put1(uint64_t region, nb::bytes key, uint64_t offset, uintptr_t buffer, uint64_t length, int mt)
  {
    get();
    std::vector<Node::Item> v{Node::Item{region, keyFromBytes(std::string(key.c_str(), key.size())), offset,
                                         buffer, length, mt}};
    return node->post(id, handle, kOpPut, v, "put");
  }

  // Send arbitrary bytes as a request message (tests of the exporter's
  // parsing); the request completes when UCX has sent them.
  Request sendRaw(nb::bytes header, nb::bytes payload, bool keep)
  {
    get();
    auto c  = std::make_shared<Completion>();
    Request r(c, "raw");
    auto* h = new std::pair<std::string, std::string>(std::string(header.c_str(), header.size()),
                                                      std::string(payload.c_str(), payload.size()));
    struct Ctx {
      std::shared_ptr<Completion> c;
      std::pair<std::string, std::string>* bytes;
    };
    auto* ctx = new Ctx{c, h};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.flags        = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    p.user_data    = ctx;
    p.cb.send      = [](void* request, ucs_status_t status, void* user) {
      ucp_request_free(request);
      auto* x = static_cast<Ctx*>(user);
      x->c->complete(status);
      delete x->bytes;
      delete x;
    };
    ucs_status_ptr_t sp;
    {
      nb::gil_scoped_release release;
      sp = ucp_am_send_nbx(handle, keep ? kAmRequestKeep : kAmRequest, h->first.data(), h->first.size(), h->second.data(),
                           h->second.size(), &p);
      if (UCS_PTR_IS_PTR(sp)) ucp_worker_signal(node->wh);
    }
    if (!UCS_PTR_IS_PTR(sp)) {
      c->complete(UCS_PTR_STATUS(sp));
      delete h;
      delete ctx;
    }
    return r;
  }

  void closePeer(double timeout)
  {
    // Closing progresses the worker in this thread: requests completed
    // there hand their callbacks to the progress thread, as in a waiter.
    DeferTo here(node->prog ? node->prog.get() : deferTo);
    Endpoint::close(timeout);
    node->failPeer(id, UCS_ERR_CANCELED);
  }
};

}  // namespace

NB_MODULE(_native, m)
{
  m.doc() = "gpushare's thin binding of libucxx (MemoryHandle, RemoteKey, RequestMem).";

  // A forked child keeps its parent's native objects alive on purpose (their
  // destructors would join threads the child does not have): no report of them.
  m.def("quiet_leaks", []() { nb::set_leak_warnings(false); },
        "Do not report native objects still alive at exit (a forked child keeps its parent's).");

  // Every C++ failure reaches Python as the gpushare error that
  // gpushare._errors.translate(status, message) makes of it: Python code
  // never sees, or catches, a native exception type.  Both references live
  // as long as the process (never released: the translator may run until
  // the interpreter is gone).
  static PyObject* translate = nb::object(nb::module_::import_("gpushare._errors").attr("translate")).release().ptr();
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const NativeError& e) {
      nb::object exc = nb::steal(PyObject_CallFunction(translate, "ss", e.status.c_str(), e.message.c_str()));
      if (!exc.is_valid()) return;  // translate itself failed: its error stands
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  m.attr("UCS_MEMORY_TYPE_HOST")         = static_cast<int>(UCS_MEMORY_TYPE_HOST);
  m.attr("UCS_MEMORY_TYPE_CUDA")         = static_cast<int>(UCS_MEMORY_TYPE_CUDA);
  m.attr("UCS_MEMORY_TYPE_CUDA_MANAGED") = static_cast<int>(UCS_MEMORY_TYPE_CUDA_MANAGED);
  m.attr("UCS_MEMORY_TYPE_UNKNOWN")      = static_cast<int>(UCS_MEMORY_TYPE_UNKNOWN);

  m.def("ucx_version", [] {
    unsigned major, minor, release;
    ucp_get_version(&major, &minor, &release);
    return nb::make_tuple(major, minor, release);
  });
  m.def("serialized_remote_key_range", &serializedRemoteKeyRange, "blob"_a);
  m.def("remote_key_problem", &remoteKeyProblem, "blob"_a,
        "What is wrong with the layout of a serialized remote key; empty when nothing is.");
  m.def("quarantine", &quarantine, "address"_a, "length"_a);

  nb::class_<PinnedBuffer>(m, "PinnedBuffer")
    .def(nb::init<nb::handle, bool>(), "obj"_a, "writable"_a)
    .def_prop_ro("address", &PinnedBuffer::address)
    .def_prop_ro("nbytes", &PinnedBuffer::nbytes)
    .def_prop_ro("readonly", &PinnedBuffer::readonly)
    .def("release", &PinnedBuffer::release);

  nb::class_<Request>(m, "Request")
    .def_ro("kind", &Request::kind)
    .def("done", &Request::done)
    .def("wait", &Request::wait, "timeout"_a)
    .def("ok", &Request::ok)
    .def("status", &Request::status)
    .def("add_callback", &Request::addCallback, "fn"_a);

  nb::class_<MemoryHandle>(m, "MemoryHandle")
    .def_prop_ro("handle", &MemoryHandle::ucpHandle)
    .def_prop_ro("size", &MemoryHandle::size)
    .def_prop_ro("base_address", &MemoryHandle::baseAddress)
    .def_prop_ro("memory_type", &MemoryHandle::memoryType)
    .def("pack_remote_key", &MemoryHandle::packRemoteKey)
    .def("close", &MemoryHandle::close);

  nb::class_<RemoteKey>(m, "RemoteKey")
    .def_prop_ro("handle", &RemoteKey::ucpHandle)
    .def_prop_ro("size", &RemoteKey::size)
    .def_prop_ro("base_address", &RemoteKey::baseAddress)
    .def("close", &RemoteKey::close);

  nb::class_<Endpoint>(m, "Endpoint")
    .def("alive", &Endpoint::alive)
    .def("info", &Endpoint::info)
    .def("unpack_remote_key", &Endpoint::unpackRemoteKey, "blob"_a)
    .def("mem_put", &Endpoint::memPut, "buffer"_a, "length"_a, "remote_address"_a, "rkey"_a,
         "callback"_a.none())
    .def("mem_get", &Endpoint::memGet, "buffer"_a, "length"_a, "remote_address"_a, "rkey"_a,
         "callback"_a.none())
    .def("flush", &Endpoint::flush, "callback"_a.none())
    .def("close", &Endpoint::close, "timeout"_a);

  nb::class_<Agent>(m, "Agent")
    .def(nb::init<const std::unordered_map<std::string, std::string>&, bool, bool, int>(),
         "config"_a, "polling"_a, "error_handling"_a, "wake_timeout_ms"_a)
    .def("address", &Agent::address)
    .def("info", &Agent::info)
    .def("connect", &Agent::connect, "peer_address"_a)
    .def("create_memory_handle", &Agent::createMemoryHandle, "size"_a, "buffer"_a, "memory_type"_a)
    .def("close", &Agent::shutdown)
    .def_prop_ro("closed", &Agent::closed);

  nb::class_<Node>(m, "Node")
    .def(nb::init<const std::unordered_map<std::string, std::string>&, bool, bool, int, uint64_t>(),
         "config"_a, "polling"_a, "error_handling"_a, "wake_timeout_ms"_a, "put_part"_a = 0)
    .def("address", &Node::address)
    .def("info", &Node::info)
    .def("connect", &Peer::connect, "address"_a, nb::rv_policy::take_ownership)
    .def("add_region", &Node::addRegion, "base"_a, "length"_a, "readonly"_a, "memory_type"_a)
    .def("grant", &Node::grant, "region_id"_a, "key"_a)
    .def("revoke", &Node::revoke, "region_id"_a, "key"_a, "timeout"_a)
    .def("close_region", &Node::closeRegion, "region_id"_a, "timeout"_a)
    .def("stats", &Node::stats)
    .def("close", &Node::shutdown)
    .def_prop_ro("closed", &Node::closed);

  nb::class_<Peer, Endpoint>(m, "Peer")
    .def("get", &Peer::get1, "region_id"_a, "key"_a, "offset"_a, "buffer"_a, "length"_a, "memory_type"_a)
    .def("put", &Peer::put1, "region_id"_a, "key"_a, "offset"_a, "buffer"_a, "length"_a, "memory_type"_a)
    .def("post", &Peer::post, "op"_a, "items"_a, "kind"_a, "gather"_a = false)
    .def("_send_raw", &Peer::sendRaw, "header"_a, "payload"_a, "keep"_a = false)
    .def("close", &Peer::closePeer, "timeout"_a);
}
