// Completion state, who progresses a worker (its progress thread or a
// waiter), and the Request Python waits on.  Shared by the Agent and the
// region server.

#pragma once

#include "common.hpp"

namespace gpushare::native {

// ---------------------------------------------------------------------------
// Completion state shared by a request and the callback libucxx calls.

struct Progress;
struct Completion;
// The node whose worker this thread progresses: its progress thread, or a
// waiter holding the worker (see Progress).  Callbacks of requests that
// complete here are handed to the node's progress thread, which runs them
// outside UCX's progress.
inline thread_local Progress* deferTo = nullptr;
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
  void complete(ucs_status_t s, uint32_t gs = 0);

  // Run the Python callbacks of a completed request, then wake its waiters.
  void runCallbacks_();
};

// How long Request::wait spins before it sleeps: kSpinMicros, plus one
// microsecond per kSpinBytesPerMicro bytes the request moves (a 1 MiB put
// takes 0.2 ms and more on loopback), at most kSpinMaxMicros.
constexpr int64_t kSpinMicros        = 100;
constexpr int64_t kSpinBytesPerMicro = 2048;
constexpr int64_t kSpinMaxMicros     = 2000;

inline int64_t steadyNanos()
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

  // A request was posted: keep the progress thread polling for its answer,
  // and wake it if it sleeps and UCX queued the request (`queued`).
  // Stores lastActive, then reads asleep; the thread stores asleep, then
  // reads lastActive: one of the two sees the other.
  void posted(bool queued)
  {
    lastActive.store(steadyNanos(), std::memory_order_seq_cst);
    if (queued && !polling && asleep.load(std::memory_order_seq_cst)) ucp_worker_signal(wh);
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
  void runDeferred();

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

// How long the progress thread stands aside while a waiter holds the
// worker, before it looks again.
constexpr int64_t kParkNanos = 200'000;

// How long the progress thread keeps polling after the last thing it did
// (serving a request, completing an answer, any UCX event) or the last
// request this process posted, before it sleeps in the kernel again.  A
// peer's next request usually follows its last answer within tens of
// microseconds, and an answer within tens of microseconds of its request;
// waking a sleeping thread costs about as much again (more on a virtual
// machine).
constexpr int64_t kLingerNanos = 150'000;

// The name of every progress thread (what /proc/<pid>/task/<tid>/comm says).
constexpr const char* kProgressThreadName = "gpushare-ucx";

// The progress engine of one worker, under the Agent and the region
// server's Node alike: its one progress thread, and the Progress its
// requests' waiters share (a waiter progresses the worker itself while the
// thread stands aside).  The thread runs the Python callbacks that waiters
// and UCX's progress hand over, outside UCX's progress; unlike libucxx's
// progress thread it keeps polling for kLingerNanos after it last did
// something or this process last posted a request, so that a peer's next
// request, or the answer to ours, finds it awake; it then sleeps in the
// kernel until an event (blocking mode), or never sleeps (polling mode).
// Idle, it costs nothing.
class Engine {
 public:
  std::shared_ptr<ucxx::Worker> worker;
  std::shared_ptr<Progress> prog;

  // Take over `w` (made with UCP_FEATURE_WAKEUP), set it up for `polling`
  // or blocking progress, and start the progress thread.  `wakeTimeoutMs`:
  // -1 sleeps until an event; else the bound on how late an arrival no
  // event announces (shared memory) is noticed.
  void start(std::shared_ptr<ucxx::Worker> w, bool polling, int wakeTimeoutMs);

  // Stop and join the progress thread, without the GIL (it may be waiting
  // for the GIL to run a Python callback) unless Python is going away, then
  // run the callbacks handed over after its last look.  From then on no
  // waiter progresses the worker.  Refused from inside the engine's own
  // progress (a callback).
  void stop();

  // Whether stop() has begun.
  bool stopping() const { return stopping_.load(std::memory_order_acquire); }

  // One pass of the thread's loop happened to do something (a handler ran).
  void touch() const { prog->lastActive.store(steadyNanos(), std::memory_order_relaxed); }

 private:
  void loop();
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> failed_{false};
  bool polling_{false};
  int wakeTimeout_{-1};
};
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
  bool wait(double timeout);

  // Whether it completed successfully (status() says how it did not).
  bool ok()
  {
    std::lock_guard<std::mutex> lock(completion->mutex);
    return completion->done && completion->gsStatus == 0 && completion->status == UCS_OK;
  }

  // (status_name, message) or None while in flight.
  nb::object status();

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

// Let `p`'s waiters drive `r`, spinning longer the more `bytes` it moves.
inline void driveBy(Request& r, const std::shared_ptr<Progress>& p, uint64_t bytes)
{
  r.progress   = p;
  r.spinMicros = std::min<int64_t>(kSpinMaxMicros, kSpinMicros + static_cast<int64_t>(bytes / kSpinBytesPerMicro));
}

inline ucxx::RequestCallbackUserFunction completer(const std::shared_ptr<Completion>& c)
{
  // The request owns this function; capture the completion only, so that a
  // dropped Python Request does not keep libucxx objects alive in a cycle.
  return [c](ucs_status_t status, std::shared_ptr<void>) { c->complete(status); };
}

// A memory handle of our own for a buffer that a transfer may move by
// zero-copy or rendezvous, passed with UCP_OP_ATTR_FIELD_MEMH.  Where gpushare
// turns UCX's memory events off (no InfiniBand: docs/ucx.md, "Memory
// hooks"), UCX has no registration cache, and UCX 1.21 then crashes when a
// peer fails while a rendezvous request holds a memory handle UCX
// registered itself (ucp_request_memh_invalidate reaches for the missing
// cache; openucx/ucx issue 11467).  It skips a user's handle, so every
// buffer a rendezvous may move comes with one: the region's on the
// exporter's side, one of these on the importer's.  Unmapped when the
// request that used it has completed.
class OwnMemh {
 public:
  // Whether transfers need handles of our own: UCX has no registration
  // cache in this process, its memory events or the cache itself being
  // turned off (UCX_MEM_EVENTS, UCX_RCACHE_ENABLE; read once).  With the
  // cache, UCX's own registrations are cached and safe, and one of ours
  // would cost a registration per transfer (InfiniBand).
  static bool needed()
  {
    static const bool value = [] {
      auto off = [](const char* name) {
        const char* v = std::getenv(name);
        if (v == nullptr) return false;
        std::string s(v);
        std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return std::tolower(ch); });
        return s == "n" || s == "no" || s == "off" || s == "0" || s == "false";
      };
      return off("UCX_MEM_EVENTS") || off("UCX_RCACHE_ENABLE");
    }();
    return value;
  }

  // OwnMemh made in this process so far (for tests).
  static inline std::atomic<uint64_t> made{0};

  OwnMemh(ucp_context_h ctx_, void* address, size_t length, ucs_memory_type_t memoryType) : ctx(ctx_)
  {
    ucp_mem_map_params_t p{};
    p.field_mask  = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                   UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    p.address     = address;
    p.length      = length;
    p.memory_type = memoryType;
    status        = ucp_mem_map(ctx, &p, &memh);
    if (status != UCS_OK) memh = nullptr;
    made.fetch_add(1, std::memory_order_relaxed);
  }
  ~OwnMemh()
  {
    if (memh != nullptr) ucp_mem_unmap(ctx, memh);
  }
  OwnMemh(const OwnMemh&)            = delete;
  OwnMemh& operator=(const OwnMemh&) = delete;

  ucp_context_h ctx;
  ucp_mem_h memh{nullptr};
  ucs_status_t status;
};

inline std::shared_ptr<Completion> newCompletion(nb::object callback)
{
  auto c = std::make_shared<Completion>();
  if (!callback.is_none()) c->callbacks.push_back(callback.release().ptr());
  return c;
}

}  // namespace gpushare::native
