// Status names, the one native exception type, calls into libucxx without
// the GIL, and the pinned Python buffer: what every part of the module uses.

#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unordered_map.h>
#include <nanobind/stl/vector.h>

#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cctype>
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

namespace gpushare::native {

inline bool pyFinalizing()
{
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// ---------------------------------------------------------------------------
// Status names and the one native exception type.

inline const char* statusName(ucs_status_t s)
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
  GS_BUSY           = 8,  // the importer has kMaxPeerReplyBytes of replies unsent already
  GS_LAST           = 8,
};

inline const char* gsStatusName(uint32_t s)
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
    case GS_BUSY: return "GS_ERR_BUSY";
    default: return "GS_ERR_BAD_REPLY";
  }
}

inline const char* gsStatusMessage(uint32_t s)
{
  switch (s) {
    case GS_ACCESS_DENIED: return "the exporter refused access: no such region, or the key is not (or no longer) granted on it";
    case GS_OUT_OF_BOUNDS: return "the exporter refused a range outside the region";
    case GS_READ_ONLY: return "the exporter refused a put: the region is read-only";
    case GS_CLOSED: return "the region was closed by its exporter";
    case GS_BAD_REQUEST: return "the exporter could not parse the request";
    case GS_BAD_REPLY: return "the exporter sent a reply that does not match the request";
    case GS_TRANSFER: return "the exporter could not complete the data transfer";
    case GS_BUSY:
      return "the exporter refused the request: this process has 64 MiB of replies from it unsent already, the most "
             "one importer may have (gpushare's region server, kMaxPeerReplyBytes): wait for the requests under way "
             "before asking for more";
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
inline const char* ucxxErrorStatus(const ucxx::Error& e)
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

// Replace [addr, addr + length) with fresh zero pages, keeping the range
// reserved: what a stale remote key writes afterwards lands nowhere useful and
// what it reads is zeros.
inline void quarantine(uintptr_t addr, size_t length)
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

// Before any ucp_init in this process: refuse in a process forked from one
// that started UCX (see rma.cpp), send UCX's log to stderr and resolve
// libucm's lookups.  Called by the Agent and the Node.
void beforeUcpInit();

// Why UCX cannot start in this process (it was forked from one that had
// started UCX), or an empty string.
std::string ucxRefusal();

}  // namespace gpushare::native
