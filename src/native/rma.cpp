#include "rma.hpp"

namespace gpushare::native {

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

std::string remoteKeyProblem(nb::bytes blob)
{
  try {
    checkSerializedRemoteKey(std::string(blob.c_str(), blob.size()));
  } catch (const NativeError& e) {
    return e.message;
  }
  return {};
}

std::tuple<uint64_t, uint64_t> serializedRemoteKeyRange(nb::bytes blob)
{
  std::string s(blob.c_str(), blob.size());
  checkSerializedRemoteKey(s);
  uint64_t base, size;
  std::memcpy(&base, s.data() + s.size() - 16, 8);
  std::memcpy(&size, s.data() + s.size() - 8, 8);
  return {base, size};
}

nb::bytes MemoryHandle::packRemoteKey()
{
  get();
  auto h = handle;
  std::string blob = call("ucp_rkey_pack", [&] {
    std::shared_ptr<ucxx::RemoteKey> rk = h->remoteKeyBuilder().build();
    return std::string(rk->serialize());
  });
  return nb::bytes(blob.data(), blob.size());
}

bool Endpoint::failFast(const std::shared_ptr<ucxx::Endpoint>& e, const std::shared_ptr<Completion>& c)
{
  if (e->isAlive()) return false;
  c->complete(UCS_ERR_CONNECTION_RESET);
  return true;
}

std::string Endpoint::info()
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

RemoteKey Endpoint::unpackRemoteKey(nb::bytes blob)
{
  auto e = get();
  std::string s(blob.c_str(), blob.size());
  checkSerializedRemoteKey(s);
  auto k = call("ucp_ep_rkey_unpack",
                [&]() -> std::shared_ptr<ucxx::RemoteKey> { return e->remoteKeyBuilder(s).build(); });
  return RemoteKey(std::move(k));
}

namespace {

// The parts of one batch request: its completion, once the last part and
// the poster are done (the poster holds one count until it has posted every
// part), with the first failure of a part.
struct BatchState {
  std::shared_ptr<Completion> completion;
  std::atomic<size_t> left{1};
  std::atomic<int> status{UCS_OK};

  void fail(ucs_status_t s)
  {
    int ok = UCS_OK;
    status.compare_exchange_strong(ok, static_cast<int>(s));
  }

  void finishOne()
  {
    if (left.fetch_sub(1, std::memory_order_acq_rel) == 1)
      completion->complete(static_cast<ucs_status_t>(status.load(std::memory_order_acquire)));
  }
};

// What a put or get posted with ucp_put_nbx/ucp_get_nbx needs until UCX
// calls back: its completion (or its batch's), and the local memory handle,
// the caller's (kept registered until then, even if the caller closes it)
// or one made for it.
struct RmaCtx {
  std::shared_ptr<Completion> completion;
  std::shared_ptr<BatchState> batch;
  std::shared_ptr<ucxx::MemoryHandle> userMemh;
  std::unique_ptr<OwnMemh> memh;

  // The handle UCX is to use for the buffer: the caller's, else, where the
  // context runs without UCX's registration cache (`own`: its handle), one of
  // ours, since every buffer UCX may move by zero-copy must come with a
  // handle UCX did not register itself (OwnMemh); else none.  Sets `failed`
  // where ours cannot be made.
  ucp_mem_h local(ucp_context_h own, uintptr_t buffer, size_t length, ucs_memory_type_t mtype, ucs_status_t& failed)
  {
    if (userMemh) return userMemh->getHandle();
    if (own == nullptr || length == 0) return nullptr;
    memh = std::make_unique<OwnMemh>(own, reinterpret_cast<void*>(buffer), length, mtype);
    if (memh->memh == nullptr) failed = memh->status;
    return memh->memh;
  }
};

void onRmaDone(void* request, ucs_status_t status, void* user)
{
  auto* ctx = static_cast<RmaCtx*>(user);
  auto c    = std::move(ctx->completion);
  auto b    = std::move(ctx->batch);
  delete ctx;  // unmaps our own handle: UCX is done with the buffer
  ucp_request_free(request);
  if (b) {
    if (status != UCS_OK) b->fail(status);
    b->finishOne();
  } else {
    c->complete(status);
  }
}

// Post one put or get whose callback gets `ctx`.
ucs_status_ptr_t postRma(bool put, ucp_ep_h eh, uintptr_t buffer, size_t length, uint64_t remoteAddress,
                         ucp_rkey_h kh, ucs_memory_type_t mtype, ucp_mem_h local, RmaCtx* ctx)
{
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  p.cb.send      = &onRmaDone;
  p.user_data    = ctx;
  p.memory_type  = mtype;
  if (local != nullptr) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    p.memh = local;
  }
  return put ? ucp_put_nbx(eh, reinterpret_cast<const void*>(buffer), length, remoteAddress, kh, &p)
             : ucp_get_nbx(eh, reinterpret_cast<void*>(buffer), length, remoteAddress, kh, &p);
}

// Post a flush of the endpoint whose callback gets `ctx`.
ucs_status_ptr_t postFlush(ucp_ep_h eh, RmaCtx* ctx)
{
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send      = &onRmaDone;
  p.user_data    = ctx;
  return ucp_ep_flush_nbx(eh, &p);
}

}  // namespace

ucp_context_h Endpoint::ownContext(const std::shared_ptr<ucxx::Endpoint>& e)
{
  return ownMemh ? std::dynamic_pointer_cast<ucxx::Context>(e->getWorker()->getParent())->getHandle() : nullptr;
}

Request Endpoint::rma(bool put, uintptr_t buffer, size_t length, uint64_t remoteAddress, RemoteKey& rk,
                      int memoryType, MemoryHandle* memh, nb::object callback)
{
  auto e   = get();
  auto key = rk.key;
  if (!key) throw NativeError("UCS_ERR_INVALID_PARAM", "remote key is closed");
  auto c = newCompletion(std::move(callback));
  Request r(c, put ? "put" : "get");
  if (failFast(e, c)) return r;
  auto* ctx         = new RmaCtx{c, nullptr, memh != nullptr ? memh->forTransfer() : nullptr, nullptr};
  auto mtype        = static_cast<ucs_memory_type_t>(memoryType);
  ucs_status_t fail = UCS_OK;
  ucp_mem_h local   = ctx->local(ownContext(e), buffer, length, mtype, fail);
  if (fail != UCS_OK) {
    delete ctx;
    throw NativeError(statusName(fail), std::string("ucp_mem_map of the local buffer failed: ") +
                                          ucs_status_string(fail));
  }
  ucp_ep_h eh   = e->getHandle();
  ucp_rkey_h kh = key->getHandle();
  ucs_status_ptr_t sp;
  {
    nb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> posting(gate->mutex);
    sp = gate->closed ? UCS_STATUS_PTR(UCS_ERR_CANCELED)
                      : postRma(put, eh, buffer, length, remoteAddress, kh, mtype, local, ctx);
  }
  if (!UCS_PTR_IS_PTR(sp)) {
    delete ctx;
    c->complete(UCS_PTR_STATUS(sp));
    return r;
  }
  posted(r, length);
  return r;
}

Request Endpoint::memPut(uintptr_t buffer, size_t length, uint64_t remoteAddress, RemoteKey& rk, int memoryType,
                         MemoryHandle* memh, nb::object callback)
{
  return rma(true, buffer, length, remoteAddress, rk, memoryType, memh, std::move(callback));
}

Request Endpoint::memGet(uintptr_t buffer, size_t length, uint64_t remoteAddress, RemoteKey& rk, int memoryType,
                         MemoryHandle* memh, nb::object callback)
{
  return rma(false, buffer, length, remoteAddress, rk, memoryType, memh, std::move(callback));
}

Request Endpoint::rmaBatch(bool put, const std::vector<uintptr_t>& buffers, const std::vector<size_t>& lengths,
                           const std::vector<uint64_t>& remoteAddresses, RemoteKey& rk, int memoryType,
                           nb::list memhs, bool flush, nb::object callback)
{
  const size_t n = buffers.size();
  if (lengths.size() != n || remoteAddresses.size() != n || nb::len(memhs) != n)
    throw NativeError("UCS_ERR_INVALID_PARAM", "a batch needs as many lengths, remote addresses and handles as buffers");
  auto e   = get();
  auto key = rk.key;
  if (!key) throw NativeError("UCS_ERR_INVALID_PARAM", "remote key is closed");
  // The caller's handles, held until UCX is done with each part (a closed one gives none).
  std::vector<std::shared_ptr<ucxx::MemoryHandle>> userMemh(n);
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    nb::handle h = memhs[i];
    if (!h.is_none()) userMemh[i] = nb::cast<MemoryHandle*>(h)->forTransfer();
    total += lengths[i];
  }
  auto c = newCompletion(std::move(callback));
  Request r(c, put ? "put" : "get");
  if (failFast(e, c)) return r;
  auto batch        = std::make_shared<BatchState>();
  batch->completion = c;
  auto mtype        = static_cast<ucs_memory_type_t>(memoryType);
  ucp_ep_h eh       = e->getHandle();
  ucp_rkey_h kh     = key->getHandle();
  ucp_context_h own = ownContext(e);
  {
    nb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> posting(gate->mutex);
    if (gate->closed) batch->fail(UCS_ERR_CANCELED);
    for (size_t i = 0; i < n && !gate->closed; ++i) {
      // A peer that failed meanwhile gets no more (see failFast).
      if ((i & 63) == 63 && !e->isAlive()) {
        batch->fail(UCS_ERR_CONNECTION_RESET);
        break;
      }
      RmaCtx* ctx       = nullptr;
      ucs_status_t fail = UCS_OK;
      ucp_mem_h local   = nullptr;
      try {
        ctx   = new RmaCtx{nullptr, batch, std::move(userMemh[i]), nullptr};
        local = ctx->local(own, buffers[i], lengths[i], mtype, fail);
      } catch (const std::bad_alloc&) {
        fail = UCS_ERR_NO_MEMORY;
      }
      if (fail != UCS_OK) {
        batch->fail(fail);
        delete ctx;
        break;  // the parts posted so far run to completion
      }
      batch->left.fetch_add(1, std::memory_order_acq_rel);
      ucs_status_ptr_t sp = postRma(put, eh, buffers[i], lengths[i], remoteAddresses[i], kh, mtype, local, ctx);
      if (!UCS_PTR_IS_PTR(sp)) {
        delete ctx;
        batch->left.fetch_sub(1, std::memory_order_acq_rel);  // never the last count: the poster holds one
        if (UCS_PTR_STATUS(sp) != UCS_OK) {
          batch->fail(UCS_PTR_STATUS(sp));
          break;
        }
      }
    }
    // Remote completion: a flush of the endpoint posted behind the parts, one
    // more count of the batch, so that the request ends when the peer has
    // them all (as a flush request of its own would, without its round of
    // calls from Python).
    if (flush && !gate->closed && batch->status.load(std::memory_order_acquire) == UCS_OK) {
      RmaCtx* ctx = nullptr;
      try {
        if (e->isAlive())  // a failed peer gets no flush (see failFast)
          ctx = new RmaCtx{nullptr, batch, nullptr, nullptr};
        else
          batch->fail(UCS_ERR_CONNECTION_RESET);
      } catch (const std::bad_alloc&) {
        batch->fail(UCS_ERR_NO_MEMORY);
      }
      if (ctx != nullptr) {
        batch->left.fetch_add(1, std::memory_order_acq_rel);
        ucs_status_ptr_t sp = postFlush(eh, ctx);
        if (!UCS_PTR_IS_PTR(sp)) {
          delete ctx;
          batch->left.fetch_sub(1, std::memory_order_acq_rel);  // the poster still holds one
          if (UCS_PTR_STATUS(sp) != UCS_OK) batch->fail(UCS_PTR_STATUS(sp));
        }
      }
    }
  }
  batch->finishOne();  // the poster's count
  posted(r, total);
  return r;
}

Request Endpoint::flush(nb::object callback)
{
  auto e = get();
  auto c = newCompletion(std::move(callback));
  Request r(c, "flush");
  if (failFast(e, c)) return r;
  r.request = call("ucp_ep_flush_nbx", [&]() -> std::shared_ptr<ucxx::Request> {
    std::shared_ptr<ucxx::Request> req = e->flushBuilder().callbackFunction(completer(c)).build();
    return req;
  });
  posted(r, 0);
  return r;
}

void Endpoint::posted(Request& r, uint64_t bytes)
{
  if (!progress) return;
  driveBy(r, progress, bytes);
  progress->posted(!r.completion->doneFlag.load(std::memory_order_acquire));
}

void Endpoint::close(double timeout)
{
  if (!ep) return;
  // Closing progresses the worker in this thread (libucxx does, with no
  // progress thread of its own): requests completed there, canceled ones
  // among them, hand their callbacks to the progress thread, as in a waiter.
  DeferTo here(progress && !progress->closed.load(std::memory_order_acquire) ? progress.get() : deferTo);
  auto g = gate;
  withoutGil([&g] {
    std::lock_guard<std::mutex> posting(g->mutex);
    g->closed = true;
  });
  auto e = ep;
  uint64_t periodNs = 100'000'000;  // 100 ms per attempt
  uint64_t attempts = std::max<uint64_t>(1, static_cast<uint64_t>(timeout * 10.0));
  call("ucp_ep_close_nbx", [&] {
    e->closeBlocking(periodNs, attempts);
    return 0;
  });
  releaseNoGil(ep);
}

Agent::Agent(const std::unordered_map<std::string, std::string>& config, bool polling, bool errorHandling_,
      int wakeTimeoutMs, bool withoutRcache)
  : errorHandling(errorHandling_), ownMemh(withoutRcache)
{
  beforeUcpInit();
  ucxx::ConfigMap cfg(config.begin(), config.end());
  call("ucp_init", [&] {
    context = ucxx::contextBuilder(UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP | UCP_FEATURE_AM)
                .configMap(cfg)
                .build();
    worker = context->workerBuilder().build();
    engine.start(worker, polling, wakeTimeoutMs);
    return 0;
  });
}

nb::bytes Agent::address()
{
  auto w    = getWorker();
  auto addr = call("ucp_worker_get_address", [&] {
    std::shared_ptr<ucxx::Address> a = ucxx::AddressBuilder(w).build();
    return std::string(a->getStringView());
  });
  return nb::bytes(addr.data(), addr.size());
}

std::string Agent::info()
{
  auto w = getWorker();
  return call("ucp_worker_print_info", [&] { return w->getInfo(); });
}

Endpoint Agent::connect(nb::bytes peer)
{
  auto w = getWorker();
  std::string s(peer.c_str(), peer.size());
  auto e = call("ucp_ep_create", [&]() -> std::shared_ptr<ucxx::Endpoint> {
    std::shared_ptr<ucxx::Address> a = ucxx::AddressBuilder(std::string_view(s)).build();
    return ucxx::endpointBuilder(w, a).endpointErrorHandling(errorHandling).build();
  });
  return Endpoint(std::move(e), engine.prog, ownMemh);
}

MemoryHandle Agent::createMemoryHandle(size_t size, uintptr_t buffer, int memoryType)
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

void Agent::shutdown()
{
  if (!worker) return;
  engine.stop();
  // The worker goes once the last endpoint holding it does.
  if (engine.prog) engine.prog->worker.reset();
  engine.worker.reset();
  releaseNoGil(worker);
  releaseNoGil(context);
}

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

// UCX keeps state of the whole process that fork does not reset: one
// asynchronous-event thread serves every worker, found through a global
// counter and pointer, with its epoll set and its lock.  A forked child
// inherits the counter, the pointer and the epoll set but not the thread: a
// context made there adds its sockets to the parent's epoll set, whose
// events the parent's thread then handles with the parent's descriptors,
// and the child's own events are never handled (connections stall for
// good), or it waits for ever on a lock a parent's thread held at the fork.
// So a process forked after its parent (or an ancestor) started UCX never
// starts it; the process that did is remembered here, and fork copies it.
static std::atomic<pid_t> ucxStartedBy{0};

std::string ucxRefusal()
{
  pid_t by = ucxStartedBy.load(std::memory_order_relaxed);
  if (by == 0 || by == getpid()) return {};
  // Short enough to travel whole in an exporter's refusal of a ucx-rma open.
  return "UCX cannot start in this process: it was forked from process " + std::to_string(by) +
         " after that one started UCX, which does not survive fork (use the 'spawn' or 'forkserver' "
         "start method, or fork first)";
}

void beforeUcpInit()
{
  std::string refusal = ucxRefusal();
  if (!refusal.empty()) throw NativeError("GS_ERR_FORKED", refusal);
  ucxStartedBy.store(getpid(), std::memory_order_relaxed);
  logToStderr();
  resolveUcmOriginals();
}

}  // namespace gpushare::native
