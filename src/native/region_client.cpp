// The importer side of the region server: posting gets and puts (single,
// batched, gathered), matching replies to them, and Peer.

#include "region.hpp"

namespace gpushare::native {

void Node::clearParts(ClientOp* op, uint32_t parts, std::vector<std::shared_ptr<Batch>>& done)
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

void Node::runDone(std::vector<std::shared_ptr<Batch>>& done)
{
  for (auto& b : done)
    b->completion->complete(b->status, b->gs);
}

void Node::partDone(uint64_t first, uint32_t parts, ucs_status_t status, uint64_t count)
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

void Node::onRequestSent(void* request, ucs_status_t status, void* user)
{
  ucp_request_free(request);
  auto* ctx = static_cast<SendCtx*>(user);
  ctx->node->partDone(ctx->first, kWaitSend, status, ctx->count);
  delete ctx;
}

void Node::onGetReceived(void* request, ucs_status_t status, size_t, void* user)
{
  ucp_request_free(request);
  auto* ctx = static_cast<std::pair<Node*, uint64_t>*>(user);
  ctx->first->partDone(ctx->second, kWaitRecv, status);
  delete ctx;
}

ucs_status_t Node::onReply(void* arg, const void* header, size_t headerLength, void* data,
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
  if (rh.kind == kReplyRefusedRange) {
    // Items requestId .. requestId + length - 1 of a batch, refused alike.
    if (rh.status == GS_OK || rh.length == 0 || rh.length > kMaxBatchItems || rh.requestId > UINT64_MAX - rh.length)
      return UCS_OK;
    for (uint64_t id = rh.requestId; id < rh.requestId + rh.length; ++id) {
      auto one = n->ops.find(id);
      if (one == n->ops.end() || one->second->ep != from || !(one->second->waiting & kWaitReply)) continue;
      one->second->fail(UCS_OK, rh.status > GS_LAST ? GS_BAD_REPLY : rh.status);
      n->clearParts(one->second.get(), kWaitReply | kWaitTrailer, done);
    }
    lock.unlock();
    runDone(done);
    return UCS_OK;
  }
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
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  if (rndv && OwnMemh::needed()) {
    auto memh = std::make_unique<OwnMemh>(n->context->getHandle(), buffer, length, mt);
    if (memh->memh == nullptr) {
      n->partDone(id, kWaitRecv, memh->status);
      return UCS_OK;  // UCX drops the rendezvous data
    }
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    p.memh = memh->memh;
    lock.lock();
    auto again = n->ops.find(id);
    if (again == n->ops.end()) return UCS_OK;  // failed meanwhile (its peer went)
    again->second->recvMemh = std::move(memh);
    lock.unlock();
  }
  auto* ctx = new std::pair<Node*, uint64_t>(n, id);
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

void Node::failPeer(uint64_t peerId, ucs_status_t status)
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

void Node::splitParts(uint8_t opCode, const std::vector<Item>& asked, std::vector<Item>& items,
                      std::vector<PostPart>& parts) const
{
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
}

std::vector<uint64_t> Node::addOps(uint64_t peerId, ucp_ep_h ep, uint8_t opCode, const std::vector<Item>& items,
                                   const std::shared_ptr<Batch>& b, std::vector<char>& hostRegion)
{
  std::vector<uint64_t> ids;
  ids.reserve(items.size());
  hostRegion.assign(items.size(), 0);
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
    op->waiting    = kWaitSend | kWaitReply | (opCode == kOpGet && it.length >= kTrailerMin ? kWaitTrailer : 0);
    op->batch      = b;
    ids.push_back(op->id);
    ops.emplace(op->id, std::move(op));
  }
  return ids;
}

bool Node::sendRequest(ucp_ep_h ep, unsigned amId, SendCtx* ctx, const void* header, size_t headerLength,
                       const void* payload, size_t count, int memoryType, uint32_t flags, bool iov)
{
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS |
                   UCP_OP_ATTR_FIELD_MEMORY_TYPE | (iov ? UCP_OP_ATTR_FIELD_DATATYPE : 0);
  if (iov) p.datatype = ucp_dt_make_iov();
  p.flags       = UCP_AM_SEND_FLAG_COPY_HEADER | UCP_AM_SEND_FLAG_REPLY | flags;
  p.cb.send     = &Node::onRequestSent;
  p.user_data   = ctx;
  p.memory_type = static_cast<ucs_memory_type_t>(memoryType);
  if (!iov && count > 0 && !(flags & UCP_AM_SEND_FLAG_EAGER) && OwnMemh::needed()) {
    // A payload that may go by rendezvous comes with our own memory handle (see OwnMemh).
    ctx->memh = std::make_unique<OwnMemh>(context->getHandle(), const_cast<void*>(payload), count, p.memory_type);
    if (ctx->memh->memh == nullptr) {
      partDone(ctx->first, kWaitSend, ctx->memh->status, ctx->count);
      delete ctx;
      return false;
    }
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    p.memh = ctx->memh->memh;
  }
  ucs_status_ptr_t sp = ucp_am_send_nbx(ep, amId, header, headerLength, payload, count, &p);
  if (UCS_PTR_IS_PTR(sp)) return true;
  partDone(ctx->first, kWaitSend, UCS_PTR_STATUS(sp), ctx->count);
  delete ctx;
  return false;
}

size_t Node::sendGetBatch(ucp_ep_h ep, const std::vector<Item>& items, const std::vector<uint64_t>& ids, size_t i,
                          bool& queued)
{
  RequestHeader h{};
  h.magic        = kWireMagic;
  h.requestId    = ids[i];
  const size_t k = std::min<size_t>(items.size() - i, kMaxBatchItems);
  auto* ctx      = new SendCtx{this, ids[i], k, std::vector<BatchItem>(k)};
  for (size_t j = 0; j < k; ++j) {
    const Item& it = items[i + j];
    ctx->items[j]  = BatchItem{it.regionId, {it.key.lo, it.key.hi}, it.offset, it.length};
    if (it.memoryType != UCS_MEMORY_TYPE_HOST) h.flags = kReqReplyKeep;
  }
  h.op     = kOpGetBatch;
  h.length = k;
  queued |= sendRequest(ep, kAmRequest, ctx, &h, sizeof(h), ctx->items.data(), k * sizeof(BatchItem),
                        UCS_MEMORY_TYPE_HOST, UCP_AM_SEND_FLAG_EAGER);
  return k;
}

size_t Node::sendPutBatch(ucp_ep_h ep, const std::vector<Item>& items, const std::vector<PostPart>& parts,
                          const std::vector<uint64_t>& ids, size_t i, bool& queued)
{
  // The run of puts that fits one message.
  size_t k       = 0;
  uint64_t bytes = 0;
  while (i + k < items.size() && k < kMaxBatchItems) {
    const Item& it = items[i + k];
    if (it.memoryType != UCS_MEMORY_TYPE_HOST || it.length > kEagerMax || bytes + it.length > kPutBatchMax ||
        parts[i + k].wholeLength != 0)
      break;
    bytes += it.length;
    ++k;
  }
  if (k <= 1) return 0;
  RequestHeader h{};
  h.magic     = kWireMagic;
  h.requestId = ids[i];
  auto* ctx   = new SendCtx{this, ids[i], k, std::vector<BatchItem>(k), {}};
  ctx->iov.reserve(k + 1);
  ctx->iov.push_back({ctx->items.data(), k * sizeof(BatchItem)});
  for (size_t j = 0; j < k; ++j) {
    const Item& it = items[i + j];
    ctx->items[j]  = BatchItem{it.regionId, {it.key.lo, it.key.hi}, it.offset, it.length};
    ctx->iov.push_back({reinterpret_cast<void*>(it.buffer), it.length});
  }
  h.op     = kOpPutBatch;
  h.length = k;
  queued |= sendRequest(ep, kAmRequest, ctx, &h, sizeof(h), ctx->iov.data(), ctx->iov.size(), UCS_MEMORY_TYPE_HOST,
                        UCP_AM_SEND_FLAG_EAGER, true);
  return k;
}

void Node::sendOne(ucp_ep_h ep, uint8_t opCode, const Item& it, const PostPart& part, uint64_t id, bool hostRegion,
                   bool& queued)
{
  RequestHeader h{};
  h.magic        = kWireMagic;
  h.requestId    = id;
  h.op           = opCode;
  h.regionId     = it.regionId;
  h.key[0]       = it.key.lo;
  h.key[1]       = it.key.hi;
  h.offset       = it.offset;
  h.length       = it.length;
  const bool put = opCode == kOpPut;
  if (!put && it.memoryType != UCS_MEMORY_TYPE_HOST) h.flags = kReqReplyKeep;
  // Puts to regions known to be host memory travel on kAmRequest.
  const unsigned amId  = put && !hostRegion ? kAmRequestKeep : kAmRequest;
  const void* src      = put ? reinterpret_cast<const void*>(it.buffer) : nullptr;
  const uint32_t eager = put && it.length <= kPutEagerMax ? UCP_AM_SEND_FLAG_EAGER : 0;
  if (part.wholeLength != 0) {
    PartHeader ph{h, part.partOffset};
    ph.whole.op     = kOpPutPart;
    ph.whole.offset = part.wholeOffset;
    ph.whole.length = part.wholeLength;
    queued |= sendRequest(ep, amId, new SendCtx{this, id, 1, {}}, &ph, sizeof(ph), src, it.length, it.memoryType,
                          eager);
  } else {
    queued |= sendRequest(ep, amId, new SendCtx{this, id, 1, {}}, &h, sizeof(h), src, put ? it.length : 0,
                          it.memoryType, eager);
  }
}

Request Node::post(uint64_t peerId, ucp_ep_h ep, uint8_t opCode, const std::vector<Item>& asked,
                   const std::string& kind, bool gather)
{
  checkOpen();
  std::vector<Item> items;
  std::vector<PostPart> parts;
  splitParts(opCode, asked, items, parts);
  auto c        = std::make_shared<Completion>();
  auto b        = std::make_shared<Batch>();
  b->completion = c;
  b->left       = items.size();
  Request r(c, kind);
  uint64_t bytes = 0;
  for (auto& it : items) bytes += it.length;
  driveBy(r, engine.prog, bytes);
  if (items.empty()) {
    c->complete(UCS_OK);
    return r;
  }
  std::vector<char> hostRegion;
  std::vector<uint64_t> ids = addOps(peerId, ep, opCode, items, b, hostRegion);
  nb::gil_scoped_release release;
  bool queued = false;
  for (size_t i = 0; i < items.size();) {
    if (opCode == kOpGet && items.size() - i > 1) {
      // Gets travel as one request message per up to kMaxBatchItems items.
      i += sendGetBatch(ep, items, ids, i, queued);
      continue;
    }
    if (opCode == kOpPut && gather) {
      size_t k = sendPutBatch(ep, items, parts, ids, i, queued);
      if (k > 0) {
        i += k;
        continue;
      }
    }
    sendOne(ep, opCode, items[i], parts[i], ids[i], hostRegion[i] != 0, queued);
    ++i;
  }
  // A request UCX queued is finished by the progress thread: keep it
  // polling for the answer (wake it if it sleeps).
  engine.prog->posted(queued);
  return r;
}

Peer::Peer(Node* n, std::shared_ptr<ucxx::Endpoint> e, uint64_t id_)
  : Endpoint(std::move(e), n->engine.prog), node(n), id(id_), handle(ep->getHandle())
{
}

Peer* Peer::connect(Node& n, nb::bytes address)
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

Request Peer::post(uint8_t opCode, const std::vector<std::tuple<uint64_t, nb::bytes, uint64_t, uintptr_t, uint64_t, int>>& items,
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

Request Peer::get1(uint64_t region, nb::bytes key, uint64_t offset, uintptr_t buffer, uint64_t length, int mt)
{
  get();
  std::vector<Node::Item> v{Node::Item{region, keyFromBytes(std::string(key.c_str(), key.size())), offset,
                                       buffer, length, mt}};
  return node->post(id, handle, kOpGet, v, "get");
}

Request Peer::put1(uint64_t region, nb::bytes key, uint64_t offset, uintptr_t buffer, uint64_t length, int mt)
{
  get();
  std::vector<Node::Item> v{Node::Item{region, keyFromBytes(std::string(key.c_str(), key.size())), offset,
                                       buffer, length, mt}};
  return node->post(id, handle, kOpPut, v, "put");
}

Request Peer::sendRaw(nb::bytes header, nb::bytes payload, bool keep)
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

void Peer::forgetRegion(uint64_t regionId)
{
  nb::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(node->opsMutex);
  node->hostRegions.erase({id, regionId});
}

void Peer::closePeer(double timeout)
{
  Endpoint::close(timeout);
  node->failPeer(id, UCS_ERR_CANCELED);
  // Peer ids are never reused: what was learnt of this one's regions goes.
  nb::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(node->opsMutex);
  for (auto it = node->hostRegions.begin(); it != node->hostRegions.end();)
    it = it->first == id ? node->hostRegions.erase(it) : std::next(it);
}

}  // namespace gpushare::native
