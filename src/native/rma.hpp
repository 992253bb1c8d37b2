// The Agent's RMA binding (the seed API): MemoryHandle, RemoteKey, Endpoint
// and Agent, each a thin adapter of its libucxx class.

#pragma once

#include "progress.hpp"

namespace gpushare::native {

class MemoryHandle {
 public:
  // Read and swapped with std::atomic_load/exchange: a transfer copies it
  // while another thread may close it.
  std::shared_ptr<ucxx::MemoryHandle> handle;
  // The handle after close: held on only by transfers still using it.
  std::weak_ptr<ucxx::MemoryHandle> closedRef;
  explicit MemoryHandle(std::shared_ptr<ucxx::MemoryHandle> h) : handle(std::move(h)) {}
  ~MemoryHandle() { releaseNoGil(handle); }

  ucxx::MemoryHandle& get()
  {
    if (!handle) throw NativeError("UCS_ERR_INVALID_PARAM", "memory handle is closed");
    return *handle;
  }

  // The handle for a transfer to hold until UCX is done with it; null once closed.
  std::shared_ptr<ucxx::MemoryHandle> forTransfer() { return std::atomic_load(&handle); }
  uintptr_t ucpHandle() { return reinterpret_cast<uintptr_t>(get().getHandle()); }
  size_t size() { return get().getSize(); }
  uint64_t baseAddress() { return get().getBaseAddress(); }
  int memoryType() { return static_cast<int>(get().getMemoryType()); }

  nb::bytes packRemoteKey();

  // After close: whether a transfer of this process still holds the handle
  // (each holds it until UCX is done with its local buffer).
  bool inUse() { return !closedRef.expired(); }

  // No transfer takes the handle from now on; it is unregistered once the
  // last one still holding it is done.
  void close()
  {
    std::shared_ptr<ucxx::MemoryHandle> h = std::atomic_exchange(&handle, std::shared_ptr<ucxx::MemoryHandle>());
    if (h) closedRef = h;
    releaseNoGil(h);
  }
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
void checkSerializedRemoteKey(const std::string& blob);

// What checkSerializedRemoteKey finds wrong with `blob`; empty when nothing is.
std::string remoteKeyProblem(nb::bytes blob);

// (base_address, size) recorded in a serialized key, read without UCX.
std::tuple<uint64_t, uint64_t> serializedRemoteKeyRange(nb::bytes blob);

class Endpoint {
 public:
  std::shared_ptr<ucxx::Endpoint> ep;
  // The worker's engine: its waiters drive this endpoint's requests.
  std::shared_ptr<Progress> progress;
  // Its context runs without UCX's registration cache (the agent's settings
  // or the environment's): every zero-copy buffer comes with a handle of ours.
  bool ownMemh{false};
  // Posting and closing take turns: close() waits for a post under way (a
  // batch posts many without the GIL) and no post starts after it.
  struct PostGate {
    std::mutex mutex;
    bool closed{false};
  };
  std::shared_ptr<PostGate> gate{std::make_shared<PostGate>()};
  Endpoint(std::shared_ptr<ucxx::Endpoint> e, std::shared_ptr<Progress> p, bool own = false)
    : ep(std::move(e)), progress(std::move(p)), ownMemh(own)
  {
  }
  Endpoint(Endpoint&&) noexcept            = default;
  Endpoint(const Endpoint&)                = delete;
  Endpoint& operator=(const Endpoint&)     = delete;
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
  static bool failFast(const std::shared_ptr<ucxx::Endpoint>& e, const std::shared_ptr<Completion>& c);

  // What ucp_ep_print_info says: the lanes and transports this endpoint uses.
  std::string info();

  RemoteKey unpackRemoteKey(nb::bytes blob);

  // A put or get of `length` bytes at `buffer` (memory type `memoryType`),
  // with the local memory handle `memh` where the caller registered the
  // buffer (null: one of our own for this request, see OwnMemh).
  Request memPut(uintptr_t buffer, size_t length, uint64_t remoteAddress, RemoteKey& rk, int memoryType,
                 MemoryHandle* memh, nb::object callback);

  Request memGet(uintptr_t buffer, size_t length, uint64_t remoteAddress, RemoteKey& rk, int memoryType,
                 MemoryHandle* memh, nb::object callback);

  // Puts or gets of many buffers against one key as one request, posted in
  // one call without the GIL: done when every part is, failed with the first
  // failure of a part (a part that cannot start stops the posting; those
  // posted before it still run to completion).  `memhs[i]`: the caller's
  // MemoryHandle registering part i, or None.  `flush`: a flush of the
  // endpoint posted behind the parts as one more part, so that the request
  // completes at the peer (none after a failed part or on a failed peer; an
  // empty batch with it is a flush of everything posted on the endpoint).
  Request rmaBatch(bool put, const std::vector<uintptr_t>& buffers, const std::vector<size_t>& lengths,
                   const std::vector<uint64_t>& remoteAddresses, RemoteKey& rk, int memoryType, nb::list memhs,
                   bool flush, nb::object callback);

  Request flush(nb::object callback);

 private:
  // The context's handle where it runs without UCX's registration cache, else null.
  ucp_context_h ownContext(const std::shared_ptr<ucxx::Endpoint>& e);

  Request rma(bool put, uintptr_t buffer, size_t length, uint64_t remoteAddress, RemoteKey& rk, int memoryType,
              MemoryHandle* memh, nb::object callback);

 public:

  // `r` was submitted: the engine's waiters drive it, and the progress
  // thread finishes it if nobody waits (woken if it sleeps and UCX holds
  // the request).
  void posted(Request& r, uint64_t bytes);

  // Cancel what is in flight and disconnect; waits at most `timeout` seconds.
  void close(double timeout);
};

// One context and worker, progressed by an Engine (as the region server's
// Node is): no libucxx progress thread.
class Agent {
 public:
  std::shared_ptr<ucxx::Context> context;
  std::shared_ptr<ucxx::Worker> worker;
  Engine engine;
  bool errorHandling;
  bool ownMemh{false};  // see Endpoint::ownMemh

  // `withoutRcache`: the caller's word that these settings leave UCX without
  // its registration cache (Python reads UCX's yes/no values).
  Agent(const std::unordered_map<std::string, std::string>& config, bool polling_, bool errorHandling_,
        int wakeTimeoutMs, bool withoutRcache);
  ~Agent() { shutdown(); }

  std::shared_ptr<ucxx::Worker> getWorker()
  {
    if (!worker || engine.stopping()) throw NativeError("UCS_ERR_INVALID_PARAM", "agent is closed");
    return worker;
  }

  nb::bytes address();

  std::string info();

  Endpoint connect(nb::bytes peer);

  MemoryHandle createMemoryHandle(size_t size, uintptr_t buffer, int memoryType);

  void shutdown();

  bool closed() const { return !worker; }
};

}  // namespace gpushare::native
