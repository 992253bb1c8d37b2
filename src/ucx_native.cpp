// Thin adapter from libucxx's C++ classes to Python.
//
// Policy (bounds checks, lifetimes, error classes, validation of untrusted
// input beyond the byte layout) lives in Python: gpushare/_ucx/.  This file
// converts arguments, releases the GIL around every libucxx call, and turns
// C++ exceptions and UCS status codes into one Python exception type,
// NativeError(status_name, message), which gpushare._errors translates.

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unordered_map.h>

#include <sys/mman.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
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

// Drop a shared_ptr to a libucxx object without the GIL: destructors may wait
// for the progress thread, which may itself be waiting for the GIL.
template <typename T>
void releaseNoGil(std::shared_ptr<T>& p)
{
  if (!p) return;
  if (pyFinalizing() || !PyGILState_Check()) {
    p.reset();
    return;
  }
  nb::gil_scoped_release release;
  p.reset();
}

// ---------------------------------------------------------------------------
// Completion state shared by a request and the callback libucxx calls.

struct Completion {
  std::mutex mutex;
  std::condition_variable cv;
  bool done{false};     // status is final (callbacks may still be running)
  bool settled{false};  // callbacks have run: waiters wake now
  std::thread::id callbackThread{};
  ucs_status_t status{UCS_INPROGRESS};
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

  void settle()
  {
    {
      std::lock_guard<std::mutex> lock(mutex);
      settled = true;
    }
    cv.notify_all();
  }

  // Called by libucxx: in the progress thread, or at once in the submitting
  // thread (which has released the GIL) when the request completes
  // immediately.  Callbacks run before waiters wake, so that a wait() that
  // returns has seen every callback registered before completion run.
  void complete(ucs_status_t s)
  {
    bool runCallbacks;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (done) return;
      status         = s;
      done           = true;
      callbackThread = std::this_thread::get_id();
      runCallbacks   = !callbacks.empty();
    }
    if (!runCallbacks || pyFinalizing()) {
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

class Request {
 public:
  std::shared_ptr<Completion> completion;
  std::shared_ptr<ucxx::Request> request;
  std::string kind;

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
    std::unique_lock<std::mutex> lock(c->mutex);
    // A callback waiting on its own request: the status is final already.
    auto ready = [&] {
      return c->settled || (c->done && c->callbackThread == std::this_thread::get_id());
    };
    if (timeout < 0) {
      c->cv.wait(lock, ready);
      return true;
    }
    return c->cv.wait_for(lock, std::chrono::duration<double>(timeout), ready);
  }

  // (status_name, message) or None while in flight.
  nb::object status()
  {
    ucs_status_t s;
    {
      std::lock_guard<std::mutex> lock(completion->mutex);
      if (!completion->done) return nb::none();
      s = completion->status;
    }
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

class Agent {
 public:
  std::shared_ptr<ucxx::Context> context;
  std::shared_ptr<ucxx::Worker> worker;
  bool errorHandling;
  bool polling;

  Agent(const std::unordered_map<std::string, std::string>& config, bool polling_, bool errorHandling_)
    : errorHandling(errorHandling_), polling(polling_)
  {
    logToStderr();
    ucxx::ConfigMap cfg(config.begin(), config.end());
    call("ucp_init", [&] {
      context = ucxx::contextBuilder(UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP | UCP_FEATURE_AM)
                  .configMap(cfg)
                  .build();
      worker = context->workerBuilder().build();
      worker->startProgressThread(polling, /* epollTimeout ms */ 1);
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
    auto w = worker;
    if (pyFinalizing() || !PyGILState_Check()) {
      w->stopProgressThread();
    } else {
      nb::gil_scoped_release release;
      w->stopProgressThread();
    }
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

// Pin a Python buffer-protocol object for as long as this object lives.
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
  uintptr_t address() const { return reinterpret_cast<uintptr_t>(view.buf); }
  size_t nbytes() const { return static_cast<size_t>(view.len); }
  bool readonly() const { return view.readonly != 0; }
};

}  // namespace

NB_MODULE(_native, m)
{
  m.doc() = "gpushare's thin binding of libucxx (MemoryHandle, RemoteKey, RequestMem).";

  static nb::object nativeErrorType;
  nativeErrorType = nb::steal(PyErr_NewExceptionWithDoc(
    "gpushare._ucx._native.NativeError",
    "A UCX failure: args are (status_name, message). Translated by gpushare._errors.",
    nullptr,
    nullptr));
  m.attr("NativeError") = nativeErrorType;
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const NativeError& e) {
      nb::object args = nb::make_tuple(e.status, e.message);
      PyErr_SetObject(nativeErrorType.ptr(), args.ptr());
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
    .def(nb::init<const std::unordered_map<std::string, std::string>&, bool, bool>(),
         "config"_a, "polling"_a, "error_handling"_a)
    .def("address", &Agent::address)
    .def("info", &Agent::info)
    .def("connect", &Agent::connect, "peer_address"_a)
    .def("create_memory_handle", &Agent::createMemoryHandle, "size"_a, "buffer"_a, "memory_type"_a)
    .def("close", &Agent::shutdown)
    .def_prop_ro("closed", &Agent::closed);
}
