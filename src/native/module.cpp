// gpushare._ucx._native: the module definition, what Python sees of the
// classes in this folder.
//
// Most of the binding is thin.  For the Agent (rma.hpp: MemoryHandle,
// RemoteKey, Endpoint, Agent) it adapts libucxx's C++ classes: policy
// (bounds checks, lifetimes, validation of untrusted input beyond the byte
// layout) lives in Python, gpushare/_ucx/_agent.py; this code converts
// arguments and releases the GIL around every libucxx call.
//
// The region server (region.hpp, region_server.cpp, region_client.cpp: Node
// and Peer) is not thin, on purpose: an exporter checks every request (region,
// key, range, read-only) in its active-message handlers on the progress
// thread, without the GIL, before any byte moves, so that a transfer costs
// no Python and no hand-over between threads.  Python (gpushare/_ucx/_server.py)
// adds regions, grants and revokes keys, and validates what it hands down.
//
// Every C++ failure becomes NativeError(status_name, message) (common.hpp);
// the exception translator below raises it in Python as the error
// gpushare._errors.translate returns, so Python never catches a native
// exception of its own.
//
// The other files: common.hpp (status names, NativeError, call(),
// withoutGil, PinnedBuffer), progress.hpp/.cpp (Completion, who progresses a
// worker, Request), rma.cpp (the Agent's calls, UCX log and libucm setup).

#include "region.hpp"

using namespace gpushare::native;

namespace {

// What both engines hand to Python: a pinned buffer and a request.
void bindCommon(nb::module_& m)
{
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
}

// The Agent's RMA objects (rma.hpp).
void bindAgent(nb::module_& m)
{
  nb::class_<MemoryHandle>(m, "MemoryHandle")
    .def_prop_ro("handle", &MemoryHandle::ucpHandle)
    .def_prop_ro("size", &MemoryHandle::size)
    .def_prop_ro("base_address", &MemoryHandle::baseAddress)
    .def_prop_ro("memory_type", &MemoryHandle::memoryType)
    .def("pack_remote_key", &MemoryHandle::packRemoteKey)
    .def("in_use", &MemoryHandle::inUse)
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
         "memory_type"_a, "memh"_a.none(), "callback"_a.none())
    .def("mem_get", &Endpoint::memGet, "buffer"_a, "length"_a, "remote_address"_a, "rkey"_a,
         "memory_type"_a, "memh"_a.none(), "callback"_a.none())
    .def("rma_batch", &Endpoint::rmaBatch, "put"_a, "buffers"_a, "lengths"_a, "remote_addresses"_a, "rkey"_a,
         "memory_type"_a, "memhs"_a, "flush"_a, "callback"_a.none())
    .def("flush", &Endpoint::flush, "callback"_a.none())
    .def_ro("own_memh", &Endpoint::ownMemh)
    .def("close", &Endpoint::close, "timeout"_a);

  nb::class_<Agent>(m, "Agent")
    .def(nb::init<const std::unordered_map<std::string, std::string>&, bool, bool, int, bool>(),
         "config"_a, "polling"_a, "error_handling"_a, "wake_timeout_ms"_a, "without_rcache"_a)
    .def("address", &Agent::address)
    .def("info", &Agent::info)
    .def("connect", &Agent::connect, "peer_address"_a)
    .def("create_memory_handle", &Agent::createMemoryHandle, "size"_a, "buffer"_a, "memory_type"_a)
    .def("close", &Agent::shutdown)
    .def_prop_ro("closed", &Agent::closed);
}

// The region server's Node and its connections, Peer (region.hpp).
void bindRegion(nb::module_& m)
{
  nb::class_<Node>(m, "Node")
    .def(nb::init<const std::unordered_map<std::string, std::string>&, bool, bool, int, uint64_t>(),
         "config"_a, "polling"_a, "error_handling"_a, "wake_timeout_ms"_a, "put_part"_a = 0)
    .def("address", &Node::address)
    .def("info", &Node::info)
    .def("tables", &Node::tables)
    .def("connect", &Peer::connect, "address"_a, nb::rv_policy::take_ownership)
    .def("add_region", &Node::addRegion, "base"_a, "length"_a, "readonly"_a, "memory_type"_a)
    .def("grant", &Node::grant, "region_id"_a, "key"_a)
    .def("revoke", &Node::revoke, "region_id"_a, "key"_a, "timeout"_a)
    .def("close_regions", &Node::closeRegions, "region_ids"_a, "timeout"_a)
    .def("stats", &Node::stats)
    .def("reply_load", &Node::replyLoad)
    .def("close", &Node::shutdown)
    .def_prop_ro("closed", &Node::closed);

  nb::class_<Peer, Endpoint>(m, "Peer")
    .def("get", &Peer::get1, "region_id"_a, "key"_a, "offset"_a, "buffer"_a, "length"_a, "memory_type"_a)
    .def("put", &Peer::put1, "region_id"_a, "key"_a, "offset"_a, "buffer"_a, "length"_a, "memory_type"_a)
    .def("post", &Peer::post, "op"_a, "items"_a, "kind"_a, "gather"_a = false)
    .def("_send_raw", &Peer::sendRaw, "header"_a, "payload"_a, "keep"_a = false)
    .def("forget_region", &Peer::forgetRegion, "region_id"_a)
    .def("close", &Peer::closePeer, "timeout"_a);
}

}  // namespace

NB_MODULE(_native, m)
{
  m.doc() = "gpushare's binding of libucxx: the Agent's RMA objects and the region server (Node, Peer).";

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
  m.def("own_memh_made", [] { return OwnMemh::made.load(std::memory_order_relaxed); },
        "How many memory handles of its own a transfer has made in this process (OwnMemh).");
  m.def("ucx_built_version", [] { return nb::make_tuple(UCP_API_MAJOR, UCP_API_MINOR); },
        "The UCX (major, minor) this module was compiled against.");
  m.def("serialized_remote_key_range", &serializedRemoteKeyRange, "blob"_a);
  m.def("remote_key_problem", &remoteKeyProblem, "blob"_a,
        "What is wrong with the layout of a serialized remote key; empty when nothing is.");
  m.def("quarantine", &quarantine, "address"_a, "length"_a);
  m.def("ucx_refusal", &ucxRefusal,
        "Why UCX cannot start in this process (forked after its parent started UCX); empty when it can.");

  bindCommon(m);
  bindAgent(m);
  bindRegion(m);
}
