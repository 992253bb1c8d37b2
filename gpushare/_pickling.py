"""Arrays and tensors through multiprocessing's pickling, as gpushare shares.

:func:`install` registers reducers with ``multiprocessing.reduction.ForkingPickler``
(the pickler of every ``multiprocessing`` Queue, Pipe, Pool and of
``concurrent.futures.ProcessPoolExecutor``) for torch tensors, CuPy arrays,
:class:`gpushare.CudaArray`, cuda.core ``Buffer`` objects and NumPy arrays
over gpushare memory, and wraps ``ForkingPickler.dumps`` so that every such
object of one message travels in one bundle: one share, one open, one lease.

A message is pickled twice when it holds any of them: the first pass only
collects them, then they are exported as one bundle (torch CPU tensors first
moved into one :func:`gpushare.empty` buffer, in place, as torch's
``share_memory_()`` does), and the second pass writes each as a reference
to the bundle.  A message without them is pickled once, as before.

The receiver opens the bundle once, on the first reference, makes each
object back of its own type (zero-copy over a mapped path, a copy over cma
or ucx-rma) and keeps the bundle's lease until the last of those objects is
gone: the exporter (``lifetime="auto"``) holds the memory until then and
ends the share after it.
"""

from __future__ import annotations

import multiprocessing.context
import os
import pickle
import sys
import threading
import warnings
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ._arrays import CudaArray, empty
from ._errors import ClosedError, InvalidInputError
from ._export import export
from ._exporter.registry import is_live
from ._open import open as _open
from ._paths import by_name, holder
from ._share import BundleShare
from ._types import Regrowth

__all__ = ["Carrier", "install", "installed", "open_carrier", "outstanding", "rebuild", "revive", "uninstall"]

#: Where each moved torch storage starts in the message's buffer.
ALIGN = 64

#: The Process classes whose objects are pickled for their child (spawn, forkserver).
_SPAWNED: tuple[type, ...] = tuple(getattr(multiprocessing.context, name) for name in ("SpawnProcess", "ForkServerProcess")
                                   if hasattr(multiprocessing.context, name))

_state = threading.local()
_lock = threading.Lock()
_moving = threading.Lock()
#: share ids of the bundles this process sent, until they end (see :func:`outstanding`); those
#: that ended are dropped by :func:`outstanding`, and whenever the set has doubled since the
#: last such look (a program that never asks keeps only about twice the bundles still held)
_sent: set[str] = set()
_sent_pruning = Regrowth(64)
_original_dumps: Any = None


def _after_fork() -> None:
    """A forked child: locks that a feeder thread of the parent held are free
    here, and the parent's bundles are not this process's to count."""
    global _lock, _moving
    _lock, _moving = threading.Lock(), threading.Lock()
    _sent.clear()
    _sent_pruning.kept = 0


os.register_at_fork(after_in_child=_after_fork)


class Carrier:
    """The bundle of one message and what each of its members is: pickled
    once per message (the pickler's memo), opened once on the other side."""

    __slots__ = ("share", "kinds")

    def __init__(self, share: BundleShare, kinds: tuple[tuple, ...]) -> None:
        self.share, self.kinds = share, kinds

    def __reduce__(self) -> tuple:
        return (open_carrier, (self.share, self.kinds))


class _Collect:
    """The objects of one message, by ``id`` (held, so no id is reused while pickling)."""

    __slots__ = ("items", "kinds", "index", "carrier")

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.kinds: list[tuple] = []
        self.index: dict[int, int] = {}
        self.carrier: Carrier | None = None

    def reduce(self, obj: Any, kind: tuple) -> tuple:
        if self.carrier is None:  # first pass: collect
            if id(obj) not in self.index:
                self.index[id(obj)] = len(self.items)
                self.items.append(obj)
                self.kinds.append(kind)
            return (int, ())
        i = self.index.get(id(obj))
        if i is None:  # made while pickling (a __reduce__ of the second pass): a share of its own
            return (rebuild, (_carry([obj], [kind]), 0))
        return (rebuild, (self.carrier, i))


def _carry(items: list[Any], kinds: list[tuple]) -> Carrier:
    """Export ``items`` as one bundle for a message."""
    _move_torch([t for t, k in zip(items, kinds) if k[0] == "torch" and k[3] == "cpu"])
    flat = []
    for obj, kind in zip(items, kinds):
        if kind[0] == "torch":
            obj = obj.detach()
            if kind[5] is not None:  # strided: the span of its storage it covers, flat
                obj = obj.as_strided((kind[5],), (1,), obj.storage_offset())
            if obj.device.type == "cuda":  # the receiver reads on its own streams: the producer's work first
                sys.modules["torch"].cuda.current_stream(obj.device).synchronize()
        elif kind[0] == "cupy":
            sys.modules["cupy"].cuda.get_current_stream().synchronize()
        flat.append(obj)
    share = export(flat)
    if not isinstance(share, BundleShare):  # export of a list is always a bundle
        raise TypeError(f"gpushare.export of a list gave a {type(share).__name__}, not a BundleShare")
    with _lock:
        _sent.add(share.share_id)
        if _sent_pruning.due(len(_sent)):
            _drop_ended()
    return Carrier(share, tuple(kinds))


def _drop_ended() -> None:
    """Forget the bundles sent that have ended (under ``_lock``)."""
    for share_id in [s for s in _sent if not is_live(s)]:
        _sent.discard(share_id)
    _sent_pruning.kept = len(_sent)


def _move_torch(tensors: list[Any]) -> None:
    """Move the storages of torch CPU tensors that are not in gpushare memory
    into one :func:`gpushare.empty` buffer, in place (each tensor keeps its
    offset, sizes and strides), as ``share_memory_()`` moves them into shared memory."""
    if not tensors:
        return
    with _moving:  # one move at a time: two queues' feeder threads may pickle the same tensor at once
        _move_torch_locked(tensors)


def _move_torch_locked(tensors: list[Any]) -> None:
    torch = sys.modules["torch"]
    storages: dict[int, tuple[Any, list[Any]]] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() and not _in_gpushare_memory(st.data_ptr(), st.nbytes()):
            storages.setdefault(st.data_ptr(), (st, []))[1].append(t)
    if not storages:
        return
    offsets, total = [], 0
    for st, _ in storages.values():
        offsets.append(total)
        total += -(-st.nbytes() // ALIGN) * ALIGN
    buf = empty(total, "uint8")
    with torch.no_grad():
        for at, (st, ts) in zip(offsets, storages.values()):
            moved = torch.from_numpy(buf[at:at + st.nbytes()]).untyped_storage()
            moved.copy_(st)
            for t in ts:
                t.set_(moved, t.storage_offset(), t.size(), t.stride())


# ---------------------------------------------------------------- reducers

def _protocol() -> int:
    return getattr(_state, "protocol", None) or pickle.DEFAULT_PROTOCOL


def _through(obj: Any, kind: tuple) -> tuple:
    collect = getattr(_state, "collect", None)
    if collect is None:  # pickled outside a message (a spawned Process's arguments): a bundle of its own
        return (rebuild, (_carry([obj], [kind]), 0))
    return collect.reduce(obj, kind)


def _second_pass(obj: Any) -> tuple | None:
    """In a message's second pass, the reference to an object the first collected."""
    collect = getattr(_state, "collect", None)
    if collect is None or collect.carrier is None:
        return None
    i = collect.index.get(id(obj))
    return None if i is None else (rebuild, (collect.carrier, i))


def _reduce_torch(t: Any) -> tuple:
    known = _second_pass(t)  # checked once, in the first pass
    if known is not None:
        return known
    torch = sys.modules["torch"]
    if t.requires_grad and not t.is_leaf:
        raise RuntimeError("Cowardly refusing to serialize non-leaf tensor which requires_grad, since autograd "
                           "does not support crossing process boundaries.  If you just want to transfer the "
                           "data, call detach() on the tensor before serializing (e.g., putting it on the queue).")
    if (t.layout != torch.strided or t.device.type not in ("cpu", "cuda") or not t.numel() or t.is_conj()
            or t.is_neg() or t.is_quantized):
        return t.__reduce_ex__(_protocol())  # by value, as plain pickling does
    # A strided tensor travels as the span of its storage that it covers, and
    # its sizes and strides, which the receiver applies to it.
    span = None if t.is_contiguous() else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    kind = ("torch", str(t.dtype).removeprefix("torch."), bool(t.requires_grad), t.device.type,
            type(t) is torch.nn.Parameter, span, tuple(t.shape), tuple(t.stride()))
    return _through(t, kind)


def _in_gpushare_memory(address: int, size: int) -> bool:
    """Whether ``size`` host bytes at ``address`` lie in a gpushare.allocate buffer."""
    return holder(None, "host", (address, size)) is not None


def _reduce_numpy(a: Any) -> tuple:
    # gpushare memory, laid out as a share can say (no negative or partial-item strides)
    if (a.nbytes and not a.dtype.hasobject and all(s >= 0 and s % a.itemsize == 0 for s in a.strides)
            and _in_gpushare_memory(a.__array_interface__["data"][0], 1)):
        return _through(a, ("numpy",))
    return a.__reduce_ex__(_protocol())  # by value, as before


def _reduce_cupy(a: Any) -> tuple:
    if not a.size:
        return a.__reduce_ex__(_protocol())
    return _through(a, ("cupy",))


def _reduce_cuda_array(a: CudaArray) -> tuple:
    return _through(a, ("gpushare",))


def _reduce_buffer(b: Any) -> tuple:
    return _through(b, ("buffer",))


def _reduce_process(p: Any) -> tuple:
    """A ``spawn`` or ``forkserver`` Process, as it pickles itself for its
    child, rebuilt there through this module's public twin: the child
    imports it, and with it these reducers, before its target runs."""
    made = p.__reduce_ex__(_protocol())
    return (revive, (made[0], made[1]), *made[2:])


def revive(make: Any, args: tuple) -> Any:
    """Unpickling a Process in its child: as it was pickled."""
    return make(*args)


_REDUCERS = (_reduce_torch, _reduce_numpy, _reduce_cupy, _reduce_cuda_array, _reduce_buffer, _reduce_process)


# ---------------------------------------------------------------- the receiver

class _Received:
    """A message's open bundle and the objects made from it: the bundle
    closes (its lease ends) when the last of them is gone."""

    __slots__ = ("bundle", "kinds", "live", "lock", "__weakref__")

    def __init__(self, bundle: Any, kinds: tuple) -> None:
        self.bundle, self.kinds, self.live, self.lock = bundle, kinds, 1, threading.Lock()

    def release(self) -> None:
        with self.lock:
            self.live -= 1
            last = self.live == 0
        if not last:
            return
        # Runs in a finalizer: a failure is a warning, never an exception into the collector.
        try:
            self.bundle.close()
            share = self.bundle.share
            if share.exporter_pid == os.getpid():
                # Unpickled where it was sent (a queue within one process): the
                # same-process path counts no import, so the message ends it.
                share.revoke()
        except ClosedError:
            pass  # ended already (revoked, or the exporter stopped at exit)
        except Exception as exc:  # noqa: BLE001 - see above
            warnings.warn(f"releasing a gpushare.multiprocessing message failed: {exc}", ResourceWarning, 2)

    def hold(self, obj: Any) -> Any:
        with self.lock:
            self.live += 1
        # not at exit: the process's end ends the lease
        weakref.finalize(obj, self.release).atexit = False
        return obj


class _Owner:
    """Holds a view for an object that takes an owner rather than a weak reference."""

    __slots__ = ("view", "__weakref__")

    def __init__(self, view: Any) -> None:
        self.view = view


class _Opened:
    """What the unpickler memoizes for a carrier: drops its own hold on the
    bundle when the unpickler is done with it."""

    __slots__ = ("received", "__weakref__")

    def __init__(self, received: _Received) -> None:
        self.received = received
        weakref.finalize(self, received.release).atexit = False


def open_carrier(share: Any, kinds: Any) -> _Opened:
    """Unpickling: open a message's bundle (once per message)."""
    if not isinstance(share, BundleShare) or not isinstance(kinds, tuple) or len(kinds) != share.count:
        raise InvalidInputError(f"a gpushare message names {len(kinds) if isinstance(kinds, tuple) else '?'} "
                                "objects that its bundle does not hold")
    return _Opened(_Received(_open(share), kinds))


def rebuild(opened: Any, i: int) -> Any:
    """Unpickling: member ``i`` of a message, of the type it was sent as."""
    if not isinstance(opened, _Opened) or not isinstance(i, int) or not 0 <= i < len(opened.received.kinds):
        raise InvalidInputError(f"a gpushare message names object {i!r}, which its bundle does not hold")
    received = opened.received
    view = received.bundle[i]
    kind = received.kinds[i]
    mapped = by_name(view.path).mapped
    if kind[0] == "torch":
        return received.hold(_torch(view, kind, mapped)) if mapped else _torch(view, kind, mapped)
    if kind[0] == "numpy":
        import numpy as np

        return received.hold(np.from_dlpack(view)) if mapped else view.get()
    if kind[0] == "cupy":
        return _cupy(view, received) if mapped else _cupy_module().asarray(view.get())
    if kind[0] == "gpushare":
        if mapped:
            return received.hold(CudaArray._make(view, view.__cuda_array_interface__["data"][0], view.shape,
                                                 view.typestr, int(view.device), view.share.readonly))
        return view.get()
    if kind[0] == "buffer":
        from cuda.core import Buffer

        if not mapped:
            raise InvalidInputError(f"a cuda.core Buffer reached this process over {view.path}, which does not "
                                    "map memory; open its share with gpushare.open and copy it instead")
        # A Buffer takes no weak reference: its owner holds the view and the bundle's lease.
        return Buffer.from_handle(view.__cuda_array_interface__["data"][0], view.nbytes,
                                  owner=received.hold(_Owner(view)))
    raise InvalidInputError(f"a gpushare message names an object of kind {kind[0]!r}, which this version cannot make")


def _cupy_module() -> Any:
    import cupy

    return cupy


def _cupy(view: Any, received: _Received) -> Any:
    """A CuPy array over a mapped view, whose memory's owner holds the view
    and the bundle's lease (a CuPy array takes no weak reference)."""
    cupy = _cupy_module()
    cai = view.__cuda_array_interface__
    size = view.nbytes
    memory = cupy.cuda.UnownedMemory(cai["data"][0], size, received.hold(_Owner(view)), int(view.device))
    return cupy.ndarray(tuple(cai["shape"]), dtype=cai["typestr"], memptr=cupy.cuda.MemoryPointer(memory, 0),
                        strides=cai.get("strides"))


def _torch(view: Any, kind: tuple, mapped: bool) -> Any:
    import torch

    dtype = getattr(torch, kind[1])
    if mapped:
        t = torch.from_dlpack(view)
        if t.dtype != dtype:
            t = t.view(dtype)
    else:  # copied: a contiguous tensor of its own
        device = "cpu" if view.device == "host" else torch.device("cuda", torch.cuda.current_device())
        t = torch.empty(view.shape, dtype=dtype, device=device)
        view.get(t)
    if kind[5] is not None:
        t = t.as_strided(kind[6], kind[7], t.storage_offset())
    if kind[4]:
        return torch.nn.Parameter(t, requires_grad=kind[2])
    if kind[2]:
        t.requires_grad_(True)
    return t


# ---------------------------------------------------------------- installing

def _dumps(cls: type, obj: Any, protocol: int | None = None) -> memoryview:
    """``ForkingPickler.dumps``: one bundle for the objects of the message."""
    if getattr(_state, "collect", None) is not None:  # pickling inside a message's pickling: as it is
        return _original_dumps(cls, obj, protocol)
    _register_types()
    collect = _Collect()
    _state.collect, _state.protocol = collect, protocol
    try:
        first = _original_dumps(cls, obj, protocol)
        if not collect.items:
            return first
        collect.carrier = _carry(collect.items, collect.kinds)
        return _original_dumps(cls, obj, protocol)
    finally:
        _state.collect = _state.protocol = None


def _types() -> list[tuple[type, Any]]:
    """Each type to carry, of the array libraries imported so far, and its reducer."""
    mods = sys.modules
    out: list[tuple[type, Any]] = [(CudaArray, _reduce_cuda_array)]
    out += [(cls, _reduce_process) for cls in _SPAWNED]
    torch = mods.get("torch")
    if torch is not None and hasattr(torch, "Tensor") and hasattr(getattr(torch, "nn", None), "Parameter"):
        out += [(torch.Tensor, _reduce_torch), (torch.nn.Parameter, _reduce_torch)]
    for name, reducer in (("numpy", _reduce_numpy), ("cupy", _reduce_cupy)):
        ndarray = getattr(mods.get(name), "ndarray", None)
        if isinstance(ndarray, type):
            out.append((ndarray, reducer))
    for name in ("cuda.core", "cuda.core.experimental"):
        buffer = getattr(mods.get(name), "Buffer", None)
        if isinstance(buffer, type):
            out.append((buffer, _reduce_buffer))
    return out


def _register_types() -> None:
    """Register the reducers of the array libraries imported so far: again
    where another registration (``torch.multiprocessing``'s) replaced one."""
    global _known
    if _known[0] != len(sys.modules):  # a module was imported since: look again
        _known = (len(sys.modules), _types())
    reducers = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    for cls, reducer in _known[1]:
        if reducers.get(cls) is not reducer:
            ForkingPickler.register(cls, reducer)


#: (len(sys.modules), _types()) when last looked
_known: tuple[int, list[tuple[type, Any]]] = (-1, [])


def install() -> None:
    """Register the reducers with ``ForkingPickler`` (idempotent)."""
    global _original_dumps
    with _lock:
        if _original_dumps is None:
            _original_dumps = ForkingPickler.__dict__["dumps"].__func__
            ForkingPickler.dumps = classmethod(_dumps)  # type: ignore[method-assign,assignment]
    _register_types()


def uninstall() -> None:
    """Undo :func:`install` (for tests): ``ForkingPickler`` as it was."""
    global _original_dumps
    with _lock:
        if _original_dumps is None:
            return
        ForkingPickler.dumps = classmethod(_original_dumps)  # type: ignore[method-assign,assignment]
        _original_dumps = None
        reducers = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
        for cls, reducer in list(reducers.items()):
            if reducer in _REDUCERS:
                del reducers[cls]


def installed() -> bool:
    """Whether :func:`install` ran in this process."""
    return _original_dumps is not None


def outstanding() -> int:
    """How many bundles this process sent through pickling are still held
    for a receiver (not yet opened, or opened and still in use there)."""
    with _lock:
        _drop_ended()
        return len(_sent)

