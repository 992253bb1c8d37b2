#include "progress.hpp"

namespace gpushare::native {

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

void Completion::complete(ucs_status_t s, uint32_t gs)
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

void Completion::runCallbacks_()
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

void Progress::runDeferred()
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

bool Request::wait(double timeout)
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

nb::object Request::status()
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

}  // namespace gpushare::native

namespace gpushare::native {

void Engine::start(std::shared_ptr<ucxx::Worker> w, bool polling, int wakeTimeoutMs)
{
  worker       = std::move(w);
  polling_     = polling;
  wakeTimeout_ = wakeTimeoutMs;
  prog         = std::make_shared<Progress>();
  prog->worker  = worker;
  prog->wh      = worker->getHandle();
  prog->polling = polling;
  // Blocking mode sleeps in epoll_wait, with no timeout (-1) when every
  // transport wakes the worker's event fd; stopping signals it.
  if (!polling) worker->initBlockingProgressMode();
  thread_ = std::thread([this] { loop(); });
  pthread_setname_np(thread_.native_handle(), kProgressThreadName);
}

void Engine::loop()
{
  Progress* p = prog.get();
  deferTo     = p;
  while (!stopping_.load(std::memory_order_acquire)) {
    try {
      p->runDeferred();
      if (p->claimed.load(std::memory_order_acquire)) {
        // A waiter progresses the worker: stand aside, running the
        // callbacks it hands over.
        std::unique_lock<std::mutex> lock(p->parkMutex);
        p->parkCv.wait_for(lock, std::chrono::nanoseconds(kParkNanos), [this, p] {
          return p->hasDeferred.load(std::memory_order_acquire) || !p->claimed.load(std::memory_order_acquire) ||
                 stopping_.load(std::memory_order_acquire);
        });
        continue;
      }
      // (libucxx's progress: UCX's, then the cancellations it scheduled,
      // such as those of a failed endpoint's requests.)
      if (worker->progress()) {
        touch();
        continue;
      }
      if (polling_ || steadyNanos() - p->lastActive.load(std::memory_order_relaxed) < kLingerNanos) {
        std::this_thread::yield();
        continue;
      }
      // About to sleep: a request posted from now on wakes it (posted()
      // stores lastActive, then reads asleep; this stores asleep, then
      // reads lastActive: one of the two sees the other).
      p->asleep.store(true, std::memory_order_seq_cst);
      if (steadyNanos() - p->lastActive.load(std::memory_order_seq_cst) < kLingerNanos ||
          p->claimed.load(std::memory_order_seq_cst) || p->hasDeferred.load(std::memory_order_seq_cst)) {
        p->asleep.store(false, std::memory_order_relaxed);
        continue;
      }
      worker->progressWorkerEvent(wakeTimeout_);
      p->asleep.store(false, std::memory_order_relaxed);
    } catch (const std::exception& e) {
      p->asleep.store(false, std::memory_order_relaxed);
      // UCX failed to arm or wait: say so once, and poll slowly rather than spin.
      if (!failed_.exchange(true))
        std::fprintf(stderr, "[gpushare] UCX progress failed, polling every millisecond: %s\n", e.what());
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
}

void Engine::stop()
{
  if (!prog) return;
  if (!thread_.joinable()) {
    prog->close();
    return;
  }
  if (deferTo == prog.get())
    throw NativeError("UCS_ERR_INVALID_PARAM", "a UCX worker cannot be closed from inside its own progress");
  stopping_.store(true, std::memory_order_release);
  withoutGil([this] {
    prog->close();
    prog->unpark();
    if (!polling_) ucp_worker_signal(prog->wh);
    thread_.join();
    // Callbacks a waiter handed over after the thread's last look.
    prog->runDeferred();
  });
}

}  // namespace gpushare::native
