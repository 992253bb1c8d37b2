"""gpushare as a tensor transport for Ray (Ray Direct Transport, RDT).

::

    import gpushare.ray                  # imports ray and torch
    import ray

    gpushare.ray.register()              # in the driver, before the actors are created

    @ray.remote
    class Trainer:
        @ray.method(tensor_transport="gpushare")
        def weights(self):
            return {"w": self.w, "b": self.b}   # torch tensors, CPU or CUDA

    ref = trainer.weights.remote()
    inference.load.remote(ref)           # the tensors travel through gpushare, not the object store

The source process exports the tensors of one Ray object as one bundle
(:func:`gpushare.export` of their list, ``lifetime="revoked"``); the share
travels in the object's transport metadata; the destination opens it once
and copies every tensor out as one batch (or, with ``zero_copy=True``, maps
what can be mapped); when Ray frees the object, the source revokes the share.
Paths are gpushare's: host-fd or posix-fd for memory from
:func:`gpushare.allocate` (and tensors over it), cma for other host memory
on the node, cuda-ipc for other CUDA memory, ucx-rma across nodes.

This module is optional and never imported by ``import gpushare``: it needs
``ray`` (2.60 or later, the RDT interface) and ``torch``.  See docs/ray.md.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import secrets
import threading
from typing import Any

try:
    import ray
    import torch
except ImportError as exc:  # an optional extra: say which
    raise ImportError(f"gpushare.ray needs Ray and torch ({exc.name} is missing): pip install 'gpushare[ray]' "
                      "torch") from exc
from ray._private import ray_constants
from ray.experimental.rdt import util as _rdt
from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    TensorTransportManager,
    TensorTransportMetadata,
)

from . import _auth
from . import _paths as _paths_mod
from ._batch import get_batch
from ._errors import ClosedError, InvalidInputError
from ._export import export
from ._open import open as _open
from ._share import BundleShare

__all__ = ["DEFAULT_NAME", "ZERO_COPY_PATHS", "GpushareCommunicatorMetadata", "GpushareTransport",
           "GpushareTransportMetadata", "exported", "register", "runtime_env", "stats"]

#: The transport's name unless :func:`register` is given another.
DEFAULT_NAME = "gpushare"

#: The names of the paths whose mapping holds the memory itself (each path's
#: ``holds_memory``): a zero-copy tensor over them stays valid after the
#: source freed or lost its tensor.  cuda-ipc is not one (legacy CUDA IPC
#: memory goes when the source frees it), cma and ucx-rma map nothing; their
#: tensors are always copied.
ZERO_COPY_PATHS = frozenset(p.name for p in _paths_mod.PATHS if p.holds_memory)

_KEY_BYTES = 32

_lock = threading.Lock()
#: Ray object id -> the metadata of the share this process exported for it, until Ray frees it.
_live: dict[str, GpushareTransportMetadata] = {}
_counts: collections.Counter[str] = collections.Counter()
_paths: collections.Counter[str] = collections.Counter()
#: The key of this process's gpushare transports (one per process: gpushare's key is the process's).
_job_key: bytes | None = None


@dataclasses.dataclass
class GpushareCommunicatorMetadata(CommunicatorMetadata):
    """Nothing: the share in the transport metadata is all a receiver needs."""


@dataclasses.dataclass
class GpushareTransportMetadata(TensorTransportMetadata):
    """What Ray carries from the source to every receiver of one object:
    ``tensor_meta`` (shape and dtype of each tensor), ``tensor_device``
    (``"cpu"`` or ``"cuda"``) and ``share``, the bundle of all of them (None
    for an object without tensors).  The share is a capability: whoever holds
    it and the job's key can open it until Ray frees the object."""

    share: BundleShare | None = None
    #: the index in ``tensor_meta`` of each tensor of the share, in order (those with elements)
    carried: tuple[int, ...] = ()

    # compared by identity, as Ray's own transports' metadata (a share per object)
    __eq__ = object.__eq__
    __hash__ = object.__hash__


class GpushareTransport(TensorTransportManager):
    """The one-sided RDT transport over gpushare.

    :func:`register` makes a subclass of it with the job's key, the name and
    the zero-copy choice as class attributes, and registers that with Ray;
    Ray pickles the subclass by value to every actor created afterwards (with
    ``enable_tensor_transport``), and makes one instance per process on first
    use, which sets the key there (:func:`gpushare.set_authkey`).
    """

    _key: bytes | None = None
    _name: str = DEFAULT_NAME.upper()
    _zero_copy: bool = False

    def __init__(self) -> None:
        if self._key is not None:
            _auth.set_authkey(self._key)
        self._aborted: set[str] = set()
        self._has: set[str] = set()  # actors known to have gpushare
        self._lock = threading.Lock()

    def tensor_transport_backend(self) -> str:
        return self._name

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        # A receive never blocks without end: every open and copy has a
        # deadline (RDT's fetch timeout) and fails when the source is gone,
        # so an abort need only stop receives that have not started.
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        """Whether ``gpushare.ray`` imports in ``actor`` (asked once per actor:
        Ray asks before every call of a method that returns through it)."""
        actor_id = actor._actor_id.hex()
        with self._lock:
            if actor_id in self._has:
                return True

        # A local function: pickled by value, so an actor without gpushare
        # can run it (and say so) rather than fail to unpickle it.
        def __ray_actor_has_gpushare__(self: Any) -> bool:
            import importlib

            try:
                importlib.import_module("gpushare.ray")
            except Exception:  # noqa: BLE001 - any failure to import: the transport is not there
                return False
            return True

        has = bool(ray.get(actor.__ray_call__.options(concurrency_group="_ray_system").remote(
            __ray_actor_has_gpushare__), timeout=ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS))
        if has:
            with self._lock:
                self._has.add(actor_id)
        return has

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: list[Any]) -> GpushareTransportMetadata:
        """On the source: export the object's tensors as one bundle."""
        with _lock:
            known = _live.get(obj_id)
        if known is not None:  # a retried task that already stored this object: the same share
            return known
        tensors = list(rdt_object)
        if not tensors:
            return GpushareTransportMetadata(tensor_meta=[], tensor_device=None, share=None)
        kind = tensors[0].device.type
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise InvalidInputError(f"the {self._name} transport carries torch tensors, not {type(t).__name__}")
            if t.device.type != kind:
                raise ValueError("All tensors in an RDT object must have the same device type.")
        if kind == "cuda":
            # The receiver copies on its own streams: the producer's pending work must be done first.
            for index in sorted({t.device.index for t in tensors}):
                torch.cuda.synchronize(index)
        # Each tensor travels flat, in C order: a contiguous one as a view of
        # its own memory (its storage is the allocation), another as a
        # contiguous copy, which the share keeps.  Tensors without elements
        # carry no bytes: receivers make them from their shape.
        carried = tuple(i for i, t in enumerate(tensors) if t.numel())
        share: BundleShare | None = None
        if carried:
            flat = [tensors[i].detach().contiguous().view(-1) for i in carried]
            # Read-only unless receivers map it: torch ignores DLPack's read-only
            # flag, and a write into a read-only mapping kills the process.
            made = export(flat, lifetime="revoked", readonly=not self._zero_copy)
            if not isinstance(made, BundleShare):  # export of a list is always a bundle
                raise TypeError(f"gpushare.export of a list gave a {type(made).__name__}, not a BundleShare")
            share = made
        meta = GpushareTransportMetadata(tensor_meta=[(t.shape, t.dtype) for t in tensors], tensor_device=kind,
                                         share=share, carried=carried)
        with _lock:
            _live[obj_id] = meta
            _counts["exported"] += 1
        return meta

    def get_communicator_metadata(self, src_actor: Any, dst_actor: Any,
                                  backend: str | None = None) -> GpushareCommunicatorMetadata:
        return GpushareCommunicatorMetadata()

    def recv_multiple_tensors(self, obj_id: str, tensor_transport_metadata: TensorTransportMetadata,
                              communicator_metadata: CommunicatorMetadata,
                              target_buffers: list[Any] | None = None) -> list[Any]:
        """On a receiver: open the bundle once, copy every tensor out in one
        batch (into ``target_buffers`` where given) or, with zero-copy, map
        those whose path allows it; the bundle's lease ends before it returns."""
        meta = tensor_transport_metadata
        if not isinstance(meta, GpushareTransportMetadata):
            raise InvalidInputError(f"the {self._name} transport got {type(meta).__name__} metadata")
        with self._lock:
            if obj_id in self._aborted:
                self._aborted.discard(obj_id)
                raise RuntimeError(f"the {self._name} transfer of object {obj_id} was aborted")
        specs: list[Any] = list(meta.tensor_meta)  # (torch.Size, torch.dtype) each
        if not specs:
            return []
        share, carried = meta.share, meta.carried
        if (share is None) != (not carried) or (share is not None and share.count != len(carried)) or any(
                not 0 <= i < len(specs) for i in carried):
            raise InvalidInputError(f"object {obj_id}: the metadata's {len(specs)} tensors do not match its share")
        if target_buffers is not None and len(target_buffers) != len(specs):
            raise ValueError(f"{len(target_buffers)} target buffers for {len(specs)} tensors")
        out: list[Any] = list(target_buffers) if target_buffers is not None else [None] * len(specs)
        mapped = copied = 0
        if share is not None:
            with _open(share) as bundle:  # one open, one lease, for every tensor
                copies: list[tuple[Any, int, Any]] = []
                for j, i in enumerate(carried):
                    shape, dtype = specs[i]
                    view = bundle[j]
                    with _lock:
                        _paths[view.path] += 1
                    if target_buffers is None and self._zero_copy and _paths_mod.by_name(view.path).holds_memory:
                        t = torch.from_dlpack(view)  # holds the mapping past the bundle's close
                        out[i] = (t if t.dtype == dtype else t.view(dtype)).view(shape)
                        mapped += 1
                        continue
                    if out[i] is None:
                        out[i] = torch.empty(shape, dtype=dtype, device=_local_device(view, meta.tensor_device))
                    copies.append((view, 0, out[i]))
                    copied += 1
                if copies:
                    get_batch(copies).wait(ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS)
        for i, (shape, dtype) in enumerate(specs):
            if out[i] is None:  # no elements: nothing travelled
                out[i] = torch.empty(shape, dtype=dtype, device="cpu" if meta.tensor_device != "cuda" else
                                     torch.device("cuda", torch.cuda.current_device()))
        with _lock:
            _counts["received"] += 1
            _counts["zero_copy"] += mapped
            _counts["copied"] += copied
        return out

    def send_multiple_tensors(self, tensors: list[Any], tensor_transport_metadata: TensorTransportMetadata,
                              communicator_metadata: CommunicatorMetadata) -> None:
        raise NotImplementedError(f"the {self._name} transport is one-sided: receivers fetch, sources never send")

    def garbage_collect(self, obj_id: str, tensor_transport_meta: TensorTransportMetadata,
                        tensors: list[Any]) -> None:
        """On the source, once Ray's references to the object are gone: revoke its share."""
        with _lock:
            meta = _live.pop(obj_id, None)
        share = getattr(meta or tensor_transport_meta, "share", None)
        if share is None:
            return
        try:
            share.revoke()
        except ClosedError:
            return  # not exported by this process: nothing of ours to end
        with _lock:
            _counts["revoked"] += 1

    def abort_transport(self, obj_id: str, communicator_metadata: CommunicatorMetadata) -> None:
        with self._lock:
            self._aborted.add(obj_id)


def _local_device(view: Any, kind: str | None) -> Any:
    """Where a copy of ``view`` lands: host memory, the CUDA device a mapped
    view is on, else this process's current CUDA device."""
    if kind != "cuda":
        return "cpu"
    if _paths_mod.by_name(view.path).mapped:
        return torch.device("cuda", int(view.device))
    return torch.device("cuda", torch.cuda.current_device())


def register(name: str = DEFAULT_NAME, key: bytes | str | None = None, *, zero_copy: bool = False) -> str:
    """Register gpushare as Ray tensor transport ``name`` (devices cpu and
    cuda, torch tensors), for ``@ray.method(tensor_transport=name)`` and
    ``ray.put(x, _tensor_transport=name)``.

    Call it in the driver after ``import ray`` and before creating the actors
    that use it (Ray ships registered transports to actors when they are
    created).  Calling it again with the same name and no ``key`` returns the
    name and changes nothing.

    Parameters
    ----------
    name : str
        The transport's name (Ray compares names in upper case).
    key : bytes or str, optional
        The gpushare key every process of the job uses (16 to 4096 bytes).
        By default a fresh one: 32 random bytes drawn here, which reach each
        actor inside the transport class Ray sends it (docs/ray.md, "The
        key").  Either way this process takes it at once
        (:func:`gpushare.set_authkey`), and each actor when it first uses
        the transport.
    zero_copy : bool
        Receivers map the tensors that lie in memory a mapping keeps alive
        (:data:`ZERO_COPY_PATHS`: ``gpushare.allocate`` memory on the node)
        instead of copying them: such a tensor *is* the source's memory, and
        shows every later write the source makes to it, and the source sees
        the receiver's (the share is then writable).  By default every tensor
        is copied, so a received tensor holds the values at the time of the
        transfer, as with Ray's object store.  Target buffers are always
        copied into.

    Returns
    -------
    str
        The name as Ray knows it (upper case).
    """
    global _job_key
    upper = name.upper()
    known = _rdt.transport_manager_info.get(upper)
    if known is not None:
        cls = known.transport_manager_class
        if issubclass(cls, GpushareTransport) and key is None and cls._zero_copy == zero_copy:
            _auth.set_authkey(cls._key)
            return upper
        raise ValueError(f"a tensor transport named {upper} is already registered in this process")
    if key is not None:
        chosen = _auth._checked(key, "key")
        if _job_key is not None and chosen != _job_key:
            raise ValueError("another gpushare transport of this process holds another key: a process has one "
                             "gpushare key, so every gpushare transport of a job must use the same")
    else:
        # one key per job: a second transport (another name, zero-copy or not) takes the first one's
        chosen = _job_key if _job_key is not None else secrets.token_bytes(_KEY_BYTES)
    _auth.set_authkey(chosen)
    _job_key = chosen
    # A class made here, not importable by name: cloudpickle sends it to the
    # actors by value, its key with it.
    cls = type("GpushareTransport", (GpushareTransport,), {
        "__module__": __name__, "__qualname__": "register.<locals>.GpushareTransport",
        "_key": chosen, "_name": upper, "_zero_copy": bool(zero_copy),
        "__doc__": f"gpushare as Ray tensor transport {upper} (made by gpushare.ray.register).",
    })
    _rdt.register_tensor_transport(upper, ["cpu", "cuda"], cls, torch.Tensor)
    return upper


def runtime_env(base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Ray ``runtime_env`` that registers this process's gpushare transports
    in every worker process before its first task: pass it to ``ray.init``.

    Ray 2.60 sends a custom transport to an actor in a task of its own, which
    runs beside the actor's methods (in its ``_ray_system`` thread) and
    imports torch and gpushare there first: an actor whose first method
    calls ``ray.put(x, _tensor_transport="gpushare")`` usually runs before it
    and fails with ``ValueError: Invalid tensor transport: GPUSHARE``.  Ray's
    worker setup hook (``worker_process_setup_hook``) runs in each worker
    process before any task: this one registers every transport
    :func:`register` made here (their classes, and the key in them, travel
    by value as for Ray's own sending), so the first ``ray.put`` finds it.

    ::

        gpushare.ray.register()
        ray.init(runtime_env=gpushare.ray.runtime_env())

    Parameters
    ----------
    base : dict, optional
        The job's other ``runtime_env`` settings, kept; a
        ``worker_process_setup_hook`` in it (a callable, or a
        ``"module.function"`` name) runs after gpushare's.

    Returns
    -------
    dict
        A new dict: ``base`` with the hook set.

    Raises
    ------
    ValueError
        No gpushare transport is registered in this process yet: call
        :func:`register` first.
    """
    transports = {name: info.transport_manager_class for name, info in _rdt.transport_manager_info.items()
                  if isinstance(info.transport_manager_class, type)
                  and issubclass(info.transport_manager_class, GpushareTransport)}
    if not transports:
        raise ValueError("no gpushare transport is registered in this process: call gpushare.ray.register() "
                         "before gpushare.ray.runtime_env()")
    env = dict(base or {})
    then = env.get("worker_process_setup_hook")
    if then is not None and not (callable(then) or isinstance(then, str)):
        raise TypeError(f"worker_process_setup_hook must be a callable or a 'module.function' name, not "
                        f"{type(then).__name__}")

    # A local function, so cloudpickle sends it by value (the classes with it).
    def gpushare_ray_worker_setup() -> None:
        _register_in_worker(transports)
        if isinstance(then, str):
            module, _, function = then.rpartition(".")
            getattr(importlib.import_module(module), function)()
        elif then is not None:
            then()

    env["worker_process_setup_hook"] = gpushare_ray_worker_setup
    return env


def _register_in_worker(transports: dict[str, type[GpushareTransport]]) -> None:
    """In a Ray worker, at its start: register the driver's gpushare
    transports (Ray's own sending, later, then finds them there)."""
    for name, cls in transports.items():
        if name not in _rdt.transport_manager_info:
            _rdt.register_tensor_transport(name, ["cpu", "cuda"], cls, torch.Tensor)


def stats() -> dict[str, Any]:
    """What the transport did in this process: objects ``exported`` and
    ``revoked`` (as a source), ``live`` (exported, not yet freed by Ray),
    objects ``received``, tensors ``copied`` and ``zero_copy`` (as a
    receiver), and ``paths``: tensors received per gpushare path."""
    with _lock:
        return {"exported": _counts["exported"], "revoked": _counts["revoked"], "live": len(_live),
                "received": _counts["received"], "copied": _counts["copied"], "zero_copy": _counts["zero_copy"],
                "paths": dict(_paths)}


def exported() -> dict[str, BundleShare]:
    """The shares this process exported for Ray objects not yet freed, by Ray object id (hex)."""
    with _lock:
        return {obj_id: meta.share for obj_id, meta in _live.items() if meta.share is not None}
