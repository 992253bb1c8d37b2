// The Node's worker, and the exporter side of the region
// server: regions, grants, and the handlers that check every request on the
// progress thread, without the GIL, before any byte moves.

#include "region.hpp"

namespace gpushare::native {

Node::Node(const std::unordered_map<std::string, std::string>& config, bool polling, bool errorHandling_,
     int wakeTimeoutMs, uint64_t putPart_)
  : errorHandling(errorHandling_), putPart(putPart_)
{
  beforeUcpInit();
  ucxx::ConfigMap cfg(config.begin(), config.end());
  call("ucp_init", [&] {
    context = ucxx::contextBuilder(UCP_FEATURE_AM | UCP_FEATURE_WAKEUP).configMap(cfg).build();
    worker  = context->workerBuilder().build();
    wh      = worker->getHandle();
    setHandler(kAmRequest, &Node::onRequest, false);
    setHandler(kAmReply, &Node::onReply, false);
    setHandler(kAmRequestKeep, &Node::onRequestKeep, true);
    setHandler(kAmReplyKeep, &Node::onReply, true);
    engine.start(worker, polling, wakeTimeoutMs);
    return 0;
  });
}

void Node::setHandler(unsigned id, ucp_am_recv_callback_t cb, bool keep)
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

void Node::checkOpen()
{
  if (!worker || engine.stopping())
    throw NativeError("UCS_ERR_INVALID_PARAM", "the UCX node is closed");
}

nb::bytes Node::address()
{
  checkOpen();
  auto w    = worker;
  auto addr = call("ucp_worker_get_address", [&] {
    std::shared_ptr<ucxx::Address> a = ucxx::AddressBuilder(w).build();
    return std::string(a->getStringView());
  });
  return nb::bytes(addr.data(), addr.size());
}

std::string Node::info()
{
  checkOpen();
  auto w = worker;
  return call("ucp_worker_print_info", [&] { return w->getInfo(); });
}

uint64_t Node::addRegion(uintptr_t base, uint64_t length, bool readonly, int memoryType)
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

std::shared_ptr<Region> Node::findOpen(uint64_t id)
{
  auto it = regions.find(id);
  if (it == regions.end() || it->second->closed)
    throw NativeError("UCS_ERR_INVALID_PARAM", "no open region " + std::to_string(id));
  return it->second;
}

void Node::grant(uint64_t id, nb::bytes key)
{
  Key128 k = keyFromBytes(std::string(key.c_str(), key.size()));
  std::unique_lock<std::shared_mutex> lock(tableMutex);
  findOpen(id)->keys.emplace(k, std::make_shared<Grant>());
}

int Node::revoke(uint64_t id, nb::bytes key, double timeout)
{
  Key128 k = keyFromBytes(std::string(key.c_str(), key.size()));
  std::shared_ptr<Grant> g;
  {
    std::unique_lock<std::shared_mutex> lock(tableMutex);
    auto it = regions.find(id);
    if (it == regions.end()) return 0;
    if (it->second->closed) {
      // Its key holders were told it closed; the last lease gone, it goes.
      it->second->keys.erase(k);
      if (it->second->keys.empty()) forgetClosed(id);
      return 0;
    }
    auto kit = it->second->keys.find(k);
    if (kit == it->second->keys.end()) return 0;
    g = kit->second;
    g->revoked = true;
    it->second->keys.erase(kit);
  }
  // Nothing in flight (the common case): no GIL hand-over, which costs the
  // caller up to a switch interval (5 ms) when another thread wants the GIL:
  // a bundle's lease ends with one revocation per allocation.
  if (g->inflight.load(std::memory_order_acquire) == 0) return 1;
  nb::gil_scoped_release release;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout);
  while (g->inflight.load(std::memory_order_acquire) > 0) {
    if (std::chrono::steady_clock::now() > deadline) return 2;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return 1;
}

std::vector<bool> Node::closeRegions(const std::vector<uint64_t>& ids, double timeout)
{
  std::vector<std::shared_ptr<Region>> closing(ids.size());
  {
    std::unique_lock<std::shared_mutex> lock(tableMutex);
    for (size_t i = 0; i < ids.size(); ++i) {
      auto it = regions.find(ids[i]);
      if (it == regions.end()) continue;
      auto r = it->second;
      closing[i] = r;
      if (r->closed) continue;
      r->closed = true;
      if (r->keys.empty()) {
        regions.erase(it);  // nobody holds a key to be told it closed
      } else {
        tombstones.push_back(ids[i]);
        while (tombstones.size() > kMaxTombstones) {
          regions.erase(tombstones.front());
          tombstones.pop_front();
        }
      }
    }
  }
  std::vector<bool> drained(ids.size(), true);
  {
    // One GIL hand-over for them all (a bundle's allocations close together):
    // each costs up to a switch interval where another thread wants the GIL.
    nb::gil_scoped_release release;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout);
    for (size_t i = 0; i < ids.size(); ++i) {
      auto& r = closing[i];
      if (!r) continue;
      while (r->inflight.load(std::memory_order_acquire) > 0) {
        if (std::chrono::steady_clock::now() > deadline) break;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      if (r->inflight.load(std::memory_order_acquire) > 0) {
        drained[i] = false;
        continue;
      }
      r->ucpMemh = nullptr;
      r->memh.reset();
    }
  }
  return drained;
}

void Node::forgetClosed(uint64_t id)
{
  regions.erase(id);
  auto t = std::find(tombstones.begin(), tombstones.end(), id);
  if (t != tombstones.end()) tombstones.erase(t);
}

std::tuple<size_t, size_t, size_t> Node::tables()
{
  size_t closed;
  {
    std::shared_lock<std::shared_mutex> lock(tableMutex);
    closed = tombstones.size();
  }
  std::lock_guard<std::mutex> lock(opsMutex);
  return {closed, hostRegions.size(), ops.size()};
}

std::tuple<size_t, size_t, uint64_t, uint64_t, uint64_t, uint64_t> Node::stats()
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

uint32_t Node::admit(const RequestHeader& h, size_t dataLength, std::shared_ptr<Region>& out,
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

// A status reply under way: whose load it counts on.
struct ReplyTicket {
  Node* node;
  ucp_ep_h ep;
  ReplyHeader header;  // sent from here until UCX completes the send (not copied)
};

void Node::reply(ucp_ep_h ep, uint64_t requestId, uint32_t status, uint32_t kind, uint32_t flags, bool followUp)
{
  sendStatus(ep, ReplyHeader{kWireMagic, status, requestId, 0, kind, flags}, followUp);
}

void Node::sendStatus(ucp_ep_h ep, const ReplyHeader& rh, bool followUp)
{
  if (!charge(ep, kReplyCost, followUp ? 0 : kMaxPeerReplyBytes + kBusyReplyBytes)) {
    dropped.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  auto* ticket = new ReplyTicket{this, ep, rh};
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.flags        = UCP_AM_SEND_FLAG_REPLY;
  p.cb.send      = &Node::onReplySent;
  p.user_data    = ticket;
  ucs_status_ptr_t sp = ucp_am_send_nbx(ep, kAmReply, &ticket->header, sizeof(ticket->header), nullptr, 0, &p);
  if (!UCS_PTR_IS_PTR(sp)) {  // sent already, or an error (the importer is gone)
    discharge(ep, kReplyCost);
    delete ticket;
  }
}

void Node::onReplySent(void* request, ucs_status_t, void* user)
{
  ucp_request_free(request);
  auto* ticket = static_cast<ReplyTicket*>(user);
  ticket->node->discharge(ticket->ep, kReplyCost);
  delete ticket;
}

bool Node::charge(ucp_ep_h ep, uint64_t cost, uint64_t limit)
{
  std::lock_guard<std::mutex> lock(loadMutex);
  auto it = load.find(ep);
  const uint64_t now = it == load.end() ? 0 : it->second;
  if (limit != 0 && now >= limit) return false;
  if (it == load.end()) it = load.emplace(ep, 0).first;
  it->second += cost;
  loadTotal += cost;
  return true;
}

void Node::discharge(ucp_ep_h ep, uint64_t cost)
{
  std::lock_guard<std::mutex> lock(loadMutex);
  auto it = load.find(ep);
  if (it == load.end()) return;
  const uint64_t c = std::min(cost, it->second);
  it->second -= c;
  loadTotal -= c;
  if (it->second == 0) load.erase(it);
}

bool Node::atBound(ucp_ep_h ep)
{
  std::lock_guard<std::mutex> lock(loadMutex);
  auto it = load.find(ep);
  return it != load.end() && it->second >= kMaxPeerReplyBytes;
}

bool Node::overloaded(ucp_ep_h ep, uint64_t requestId)
{
  if (!atBound(ep)) return false;
  busy.fetch_add(1, std::memory_order_relaxed);
  refused.fetch_add(1, std::memory_order_relaxed);
  reply(ep, requestId, GS_BUSY, kReplyData);
  return true;
}

std::tuple<uint64_t, size_t, uint64_t, uint64_t> Node::replyLoad()
{
  std::lock_guard<std::mutex> lock(loadMutex);
  return {loadTotal, load.size(), busy.load(), dropped.load()};
}

bool Node::connectionAlive(ucs_status_t s)
{
  return !UCS_IS_LINK_ERROR(s) && !UCS_IS_ENDPOINT_ERROR(s) && s != UCS_ERR_CONNECTION_RESET &&
         s != UCS_ERR_CANCELED && s != UCS_ERR_UNREACHABLE && s != UCS_ERR_NOT_CONNECTED;
}

uint32_t Node::verdictAfter(ServerOp* op)
{
  std::shared_lock<std::shared_mutex> lock(op->node->tableMutex);
  if (op->region->closed) return GS_CLOSED;
  if (op->grant->revoked) return GS_ACCESS_DENIED;
  return GS_OK;
}

void Node::letGo(Region& region, Grant& grant)
{
  grant.inflight.fetch_sub(1, std::memory_order_acq_rel);
  region.inflight.fetch_sub(1, std::memory_order_acq_rel);
}

void Node::release(ServerOp* op)
{
  if (op->cost != 0) op->node->discharge(op->replyEp, op->cost);
  letGo(*op->region, *op->grant);
  delete op;
}

void Node::finishGet(ServerOp* op, ucs_status_t status)
{
  Node* n = op->node;
  if (status == UCS_OK) {
    if (op->length >= kTrailerMin) n->reply(op->replyEp, op->requestId, verdictAfter(op), kReplyTrailer, 0, true);
  } else if (connectionAlive(status)) {
    // The importer may have the reply header already: a trailer (large
    // gets) or a second reply (ignored if so) carries the failure.
    n->reply(op->replyEp, op->requestId, GS_TRANSFER, op->length >= kTrailerMin ? kReplyTrailer : kReplyData, 0,
             true);
  }
  release(op);
}

void Node::onGetSent(void* request, ucs_status_t status, void* user)
{
  ucp_request_free(request);
  finishGet(static_cast<ServerOp*>(user), status);
}

void Node::finishPut(ServerOp* op, ucs_status_t status)
{
  Node* n = op->node;
  if (status == UCS_OK) {
    n->reply(op->replyEp, op->requestId, verdictAfter(op), kReplyData,
             op->region->memoryType == UCS_MEMORY_TYPE_HOST ? kReplyHostRegion : 0, true);
  } else if (connectionAlive(status)) {
    n->reply(op->replyEp, op->requestId, GS_TRANSFER, kReplyData, 0, true);
  }
  release(op);
}

void Node::onPutReceived(void* request, ucs_status_t status, size_t, void* user)
{
  ucp_request_free(request);
  finishPut(static_cast<ServerOp*>(user), status);
}

void Node::serveGet(ucp_ep_h ep, const RequestHeader& h, size_t dataLength)
{
  if (overloaded(ep, h.requestId)) return;
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
  op->cost = kReplyCost + (h.length <= kEagerMax ? h.length : 0);
  charge(ep, op->cost, 0);
  op->header = ReplyHeader{kWireMagic, GS_OK, h.requestId, h.length, kReplyData,
                           region->memoryType == UCS_MEMORY_TYPE_HOST ? kReplyHostRegion : 0u};
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                   UCP_OP_ATTR_FIELD_MEMORY_TYPE | UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FIELD_FLAGS;
  p.user_data   = op;
  p.memory_type = region->memoryType;
  p.memh        = region->ucpMemh;
  p.flags       = UCP_AM_SEND_FLAG_REPLY | (h.length <= kEagerMax ? UCP_AM_SEND_FLAG_EAGER : 0);
  p.cb.send     = &Node::onGetSent;
  ucs_status_ptr_t sp = ucp_am_send_nbx(ep, (h.flags & kReqReplyKeep) ? kAmReplyKeep : kAmReply, &op->header,
                                        sizeof(op->header), at, h.length, &p);
  if (!UCS_PTR_IS_PTR(sp)) finishGet(op, UCS_PTR_STATUS(sp));
}

void Node::serveGetBatch(ucp_ep_h ep, const RequestHeader& h, const void* data, size_t length, uint64_t recvAttr)
{
  const uint64_t count = h.length;
  const bool valid = count >= 1 && count <= kMaxBatchItems && length == count * sizeof(BatchItem) &&
                     !(recvAttr & UCP_AM_RECV_ATTR_FLAG_RNDV) && h.requestId <= UINT64_MAX - count;
  if (!valid) {
    refuseBatch(ep, h);
    return;
  }
  for (uint64_t i = 0; i < count; ++i) {
    if (atBound(ep)) {
      // The rest of the batch is refused in one reply.
      busy.fetch_add(count - i, std::memory_order_relaxed);
      refused.fetch_add(count - i, std::memory_order_relaxed);
      sendStatus(ep, ReplyHeader{kWireMagic, GS_BUSY, h.requestId + i, count - i, kReplyRefusedRange, 0}, false);
      return;
    }
    serveGet(ep, batchItem(h, kOpGet, data, i), 0);
  }
}

void Node::refuseBatch(ucp_ep_h ep, const RequestHeader& h)
{
  const uint64_t n = std::min<uint64_t>(h.length, kMaxBatchItems);
  refused.fetch_add(1, std::memory_order_relaxed);
  for (uint64_t i = 0; i < n && h.requestId <= UINT64_MAX - i; ++i)
    reply(ep, h.requestId + i, GS_BAD_REQUEST, kReplyData);
}

RequestHeader Node::batchItem(const RequestHeader& h, uint8_t op, const void* items, uint64_t i)
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

void Node::servePutBatch(ucp_ep_h ep, const RequestHeader& h, const void* data, size_t length, uint64_t recvAttr)
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

ucs_status_t Node::onRequestKeep(void* arg, const void* header, size_t headerLength, void* data,
                                  size_t length, const ucp_am_recv_param_t* param)
{
  static_cast<Node*>(arg)->kept.fetch_add(1, std::memory_order_relaxed);
  return onRequest(arg, header, headerLength, data, length, param);
}

ucs_status_t Node::onRequest(void* arg, const void* header, size_t headerLength, void* data,
                              size_t length, const ucp_am_recv_param_t* param)
{
  Node* n = static_cast<Node*>(arg);
  n->engine.touch();
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

ucs_status_t Node::servePut(ucp_ep_h ep, const RequestHeader& h, uint64_t partOffset, void* data, size_t length,
                      uint64_t recvAttr, bool hostOnly)
{
  if (overloaded(ep, h.requestId)) return UCS_OK;  // a rendezvous payload is dropped unread
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

void Node::shutdown()
{
  if (!worker) return;
  engine.stop();
  // The table's lock is taken, and every region unregistered, without the
  // GIL, which is taken back only after the lock is let go: a thread that
  // holds the GIL while it waits for the lock (a lease ending on the
  // service thread revokes its keys) would otherwise wait for this one while
  // this one waits for the GIL.  One hand-over for every region.
  withoutGil([&] {
    std::unique_lock<std::shared_mutex> lock(tableMutex);
    for (auto& [id, r] : regions) {
      r->closed  = true;
      r->ucpMemh = nullptr;
      r->memh.reset();
    }
  });
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
  if (engine.prog) engine.prog->worker.reset();
  engine.worker.reset();
  releaseNoGil(worker);
  releaseNoGil(context);
}

}  // namespace gpushare::native
