// The region server and its client: the Node (one UCX worker per process),
// its wire format and tables, and Peer, a connection to another process's
// Node.

#pragma once

#include "rma.hpp"

namespace gpushare::native {

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
// of the message), at most kPutBatchMax bytes of data per message.
constexpr uint8_t kOpPutBatch   = 4;
// One part of a put sent in several messages: a PartHeader, whose request
// header names the whole put's range (checked as a whole by every part, so
// that a put refused for its range, key or region writes nothing), then
// where this part's payload lies in it.
constexpr uint8_t kOpPutPart    = 5;
constexpr uint64_t kMaxBatchItems = 4096;
constexpr uint32_t kReplyData   = 1;
constexpr uint32_t kReplyTrailer = 2;
// One refusal for the items requestId .. requestId + length - 1 of a batch
// (the exporter refuses the rest of a batch at once when the importer is at
// kMaxPeerReplyBytes): one reply instead of one per item.
constexpr uint32_t kReplyRefusedRange = 3;
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
// A gathered put (kOpPutBatch) carries at most this many bytes of data per
// message.  Over TCP with gpushare's segments (512 KiB sent at a time) such
// a message arrives whole in one segment, and the exporter copies its items
// straight out of the receive buffer; a message of 1 MiB arrived in several
// segments, which UCX first reassembled into a buffer of its own: one more
// copy of every byte, and no overlap between the messages of a put.  The
// quickest 64 x 64 KiB gathered put on loopback took 2.1-2.4 ms in 16
// messages against 2.8-3.3 ms in 4.
constexpr uint64_t kPutBatchMax = 256 * 1024;
// What the replies the exporter has posted to one importer (one reply
// endpoint) and UCX has not yet completed may cost it: each counts
// kReplyCost (UCX's request, the header and the server's record: counted
// at 1 KiB, replies queued to an importer that read nothing grew the
// exporter by 150 MiB against 64 MiB counted; at 4 KiB, by 68 MiB) plus its
// payload when eager.  A request that finds the importer at
// kMaxPeerReplyBytes is refused (GS_BUSY) without touching its region; past
// kMaxPeerReplyBytes + kBusyReplyBytes (refusals cost too) requests from it
// go unanswered.  An importer that reads its replies never comes near it.
constexpr uint64_t kMaxPeerReplyBytes = 64ull * 1024 * 1024;
constexpr uint64_t kBusyReplyBytes    = 4ull * 1024 * 1024;
constexpr uint64_t kReplyCost         = 4096;

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

inline Key128 keyFromBytes(const std::string& b)
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
  uint64_t cost{0};  // charged to replyEp's load while the data send is under way
  ReplyHeader header{};  // a get's reply header, sent from here (not copied into a UCX buffer)
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
  std::unique_ptr<OwnMemh> recvMemh;  // a rendezvous receive's (see OwnMemh)

  void fail(ucs_status_t s, uint32_t g)
  {
    if (status == UCS_OK && gs == GS_OK) {
      status = s;
      gs     = g;
    }
  }
};

inline void freeRequest(void* request, ucs_status_t, void*)
{
  ucp_request_free(request);
}

class Node {
 public:
  std::shared_ptr<ucxx::Context> context;
  std::shared_ptr<ucxx::Worker> worker;
  ucp_worker_h wh{nullptr};
  bool errorHandling;
  // Puts from host memory of more than this many bytes, up to kPutEagerMax,
  // travel in parts of this size (0: whole).
  uint64_t putPart;
  // Its progress thread and the waiters of its requests (see Engine).
  Engine engine;

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

  // The cost of the replies posted to each importer (by reply endpoint) that
  // UCX has not completed yet (see kMaxPeerReplyBytes); an endpoint with
  // none is not listed.  busy: requests refused with GS_BUSY; dropped:
  // answers not sent, the importer being past the bound and its allowance
  // of refusals.  A failed endpoint's sends complete with an error, and what
  // they cost comes off.
  std::mutex loadMutex;
  std::unordered_map<ucp_ep_h, uint64_t> load;
  uint64_t loadTotal{0};  // under loadMutex
  std::atomic<uint64_t> busy{0}, dropped{0};

  Node(const std::unordered_map<std::string, std::string>& config, bool polling_, bool errorHandling_,
       int wakeTimeoutMs, uint64_t putPart_);
  ~Node() { shutdown(); }

  // `keep`: UCX hands eager payloads over in descriptors of its own, which
  // the handler may keep (UCP_AM_FLAG_PERSISTENT_DATA; copied once more).
  void setHandler(unsigned id, ucp_am_recv_callback_t cb, bool keep);

  void checkOpen();

  nb::bytes address();

  std::string info();

  // ---- exporter side -------------------------------------------------------

  uint64_t addRegion(uintptr_t base, uint64_t length, bool readonly, int memoryType);

  std::shared_ptr<Region> findOpen(uint64_t id);

  void grant(uint64_t id, nb::bytes key);

  // Refuse the key's requests from now on, then wait (at most `timeout` s)
  // for its transfers under way.  0: it was not granted; 1: revoked, nothing
  // of it in flight any more; 2: revoked, but transfers were still going.
  // On a closed region (every key refused already) it forgets the key, and
  // the region once no key is left (0).
  int revoke(uint64_t id, nb::bytes key, double timeout);

  // For each region of `ids` (a bundle's close together): refuse new
  // requests, wait (at most `timeout` s in all) for transfers under way, then
  // unregister.  Returns whether each one's memory is free of UCX; on false it
  // stays registered and the caller must keep it alive.  A closed region
  // is remembered (a tombstone: its key holders are told it closed) while
  // keys to it are left, at most kMaxTombstones of them; one closed with no
  // key left is forgotten at once.
  std::vector<bool> closeRegions(const std::vector<uint64_t>& ids, double timeout);

  // Forget closed region `id`'s entry in the table (tableMutex held).
  void forgetClosed(uint64_t id);

  // What the node's tables hold: (closed regions remembered, (peer, region)
  // pairs known to be host memory, client transfers in flight).
  std::tuple<size_t, size_t, size_t> tables();

  // (open regions, granted keys, refused requests, served requests, request messages)
  std::tuple<size_t, size_t, uint64_t, uint64_t, uint64_t, uint64_t> stats();

  // The access check: every request passes here before any byte moves.
  uint32_t admit(const RequestHeader& h, size_t dataLength, std::shared_ptr<Region>& out,
                 std::shared_ptr<Grant>& grantOut);

  // `followUp`: the answer to a transfer admitted earlier (a trailer, a
  // put's verdict), sent whatever the importer's load; any other answer is
  // dropped once the importer is past kMaxPeerReplyBytes + kBusyReplyBytes.
  void reply(ucp_ep_h ep, uint64_t requestId, uint32_t status, uint32_t kind, uint32_t flags = 0,
             bool followUp = false);

  // Send a status reply (no payload) unless the importer is past its allowance.
  void sendStatus(ucp_ep_h ep, const ReplyHeader& rh, bool followUp);

  static void onReplySent(void* request, ucs_status_t status, void* user);

  // Add `cost` to `ep`'s load unless it is at `limit` already (0: no limit).
  bool charge(ucp_ep_h ep, uint64_t cost, uint64_t limit);

  void discharge(ucp_ep_h ep, uint64_t cost);

  // Whether a new request from `ep` finds it at kMaxPeerReplyBytes; it is
  // then refused with GS_BUSY (or dropped) here.
  bool overloaded(ucp_ep_h ep, uint64_t requestId);

  bool atBound(ucp_ep_h ep);

  // (reply bytes outstanding, importers with replies outstanding, busy, dropped)
  std::tuple<uint64_t, size_t, uint64_t, uint64_t> replyLoad();

  // Whether a failed transfer left the connection usable for an answer; on
  // a failed connection the importer learns of it from its own endpoint.
  static bool connectionAlive(ucs_status_t s);

  // What a transfer admitted earlier reports once its data has moved.
  static uint32_t verdictAfter(ServerOp* op);

  // A transfer admitted on `region` with `grant` lets go of the memory.
  static void letGo(Region& region, Grant& grant);

  static void release(ServerOp* op);

  static void finishGet(ServerOp* op, ucs_status_t status);

  static void onGetSent(void* request, ucs_status_t status, void* user);

  static void finishPut(ServerOp* op, ucs_status_t status);

  static void onPutReceived(void* request, ucs_status_t status, size_t, void* user);

  // Check one get and send its data (or the refusal) back.
  void serveGet(ucp_ep_h ep, const RequestHeader& h, size_t dataLength);

  // A batch of gets in one message: each item is checked and answered alone.
  void serveGetBatch(ucp_ep_h ep, const RequestHeader& h, const void* data, size_t length, uint64_t recvAttr);

  // Refuse every item a malformed batch's header claims, as far as it can be trusted.
  void refuseBatch(ucp_ep_h ep, const RequestHeader& h);

  // Item `i` of a (validated) batch as the request header of a single `op`.
  static RequestHeader batchItem(const RequestHeader& h, uint8_t op, const void* items, uint64_t i);

  // A batch of puts in one eager message: each item is checked, copied into
  // its region and answered alone.  Only host-memory regions take part (the
  // importer gathers puts for regions it knows to be host memory); an item
  // for any other region is refused.
  void servePutBatch(ucp_ep_h ep, const RequestHeader& h, const void* data, size_t length, uint64_t recvAttr);

  static ucs_status_t onRequestKeep(void* arg, const void* header, size_t headerLength, void* data,
                                    size_t length, const ucp_am_recv_param_t* param);

  static ucs_status_t onRequest(void* arg, const void* header, size_t headerLength, void* data,
                                size_t length, const ucp_am_recv_param_t* param);

  // Check one put, or one part of one, and land its data (or refuse it).
  // `hostOnly`: `data` is plain bytes (an item of a gathered put, or an
  // eager payload on kAmRequest), which only
  // a host-memory region can take (copied); any other region refuses it.
  ucs_status_t servePut(ucp_ep_h ep, const RequestHeader& h, uint64_t partOffset, void* data, size_t length,
                        uint64_t recvAttr, bool hostOnly = false);

  // ---- importer side -------------------------------------------------------

  // Clear `parts` of op `id`; complete it (and its batch) when nothing is
  // awaited.  Called with opsMutex held; completions to run are appended to
  // `done` and run after the lock is dropped.
  void clearParts(ClientOp* op, uint32_t parts, std::vector<std::shared_ptr<Batch>>& done);

  static void runDone(std::vector<std::shared_ptr<Batch>>& done);

  // partDone for ops first .. first + count - 1.
  void partDone(uint64_t first, uint32_t parts, ucs_status_t status, uint64_t count = 1);

  // What a request message's send completion needs: the ops it carries, and
  // the batch items it points UCX at until then.
  struct SendCtx {
    Node* node;
    uint64_t first;
    uint64_t count;
    std::vector<BatchItem> items;
    std::vector<ucp_dt_iov_t> iov;  // a put batch's payload: the items, then each item's data
    std::unique_ptr<OwnMemh> memh;  // a payload that may go by rendezvous (see OwnMemh)
  };

  static void onRequestSent(void* request, ucs_status_t status, void* user);

  static void onGetReceived(void* request, ucs_status_t status, size_t, void* user);

  static ucs_status_t onReply(void* arg, const void* header, size_t headerLength, void* data,
                              size_t length, const ucp_am_recv_param_t* param);

  // Every op toward a failed or closed peer stops waiting for its answers.
  void failPeer(uint64_t peerId, ucs_status_t status);

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
               const std::string& kind, bool gather = false);

  // What post does, step by step:
  //
  // A put of more than putPart bytes (up to kPutEagerMax) travels in parts,
  // each an op of its own: each part is one eager message that UCX sends from
  // the buffer itself and the exporter copies straight from its receive buffer
  // (a whole 1 MiB message is copied on both sides and reassembled), and the
  // parts' copies overlap.  wholeLength 0: not a part.
  struct PostPart {
    uint64_t wholeOffset, wholeLength, partOffset;
  };
  void splitParts(uint8_t opCode, const std::vector<Item>& asked, std::vector<Item>& items,
                  std::vector<PostPart>& parts) const;
  // One ClientOp per item, in `ops`, of batch `b`; their ids.  hostRegion[i]:
  // the item's region is known to be host memory.
  std::vector<uint64_t> addOps(uint64_t peerId, ucp_ep_h ep, uint8_t opCode, const std::vector<Item>& items,
                               const std::shared_ptr<Batch>& b, std::vector<char>& hostRegion);
  // Send one request message (the GIL released); true when UCX queued it
  // (its completion comes later), false when it ended at once (its ops are
  // told, `ctx` freed).
  bool sendRequest(ucp_ep_h ep, unsigned amId, SendCtx* ctx, const void* header, size_t headerLength,
                   const void* payload, size_t count, int memoryType, uint32_t flags, bool iov = false);
  // The kOpGetBatch message for items i.. (up to kMaxBatchItems); how many it carries.
  size_t sendGetBatch(ucp_ep_h ep, const std::vector<Item>& items, const std::vector<uint64_t>& ids, size_t i,
                      bool& queued);
  // The kOpPutBatch message for the run of small host puts from item i; how
  // many it carries (0: fewer than two fit, send item i alone).
  size_t sendPutBatch(ucp_ep_h ep, const std::vector<Item>& items, const std::vector<PostPart>& parts,
                      const std::vector<uint64_t>& ids, size_t i, bool& queued);
  // The message of one item (a part of a put: its PartHeader).
  void sendOne(ucp_ep_h ep, uint8_t opCode, const Item& it, const PostPart& part, uint64_t id, bool hostRegion,
               bool& queued);

  void shutdown();

  bool closed() const { return !worker; }
};

// A connection from this process's node to another process's node.
class Peer : public Endpoint {
 public:
  Node* node;
  uint64_t id;
  ucp_ep_h handle;

  Peer(Node* n, std::shared_ptr<ucxx::Endpoint> e, uint64_t id_);

  static Peer* connect(Node& n, nb::bytes address);

  Request post(uint8_t opCode, const std::vector<std::tuple<uint64_t, nb::bytes, uint64_t, uintptr_t, uint64_t, int>>& items,
               const std::string& kind, bool gather);

  Request get1(uint64_t region, nb::bytes key, uint64_t offset, uintptr_t buffer, uint64_t length, int mt);

  Request put1(uint64_t region, nb::bytes key, uint64_t offset, uintptr_t buffer, uint64_t length, int mt);

  // Send arbitrary bytes as a request message (tests of the exporter's
  // parsing); the request completes when UCX has sent them.
  Request sendRaw(nb::bytes header, nb::bytes payload, bool keep);

  // Forget that region `regionId` of this peer is host memory (no view uses
  // it any more; a later reply says it again).
  void forgetRegion(uint64_t regionId);

  void closePeer(double timeout);
};

}  // namespace gpushare::native
