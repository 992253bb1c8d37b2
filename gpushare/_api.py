"""The sharing API: :func:`export`, :func:`open` and :class:`View`."""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
import time
import warnings
import weakref
from typing import Any

from . import _buffers
from ._errors import (
    AccessDeniedError,
    ClosedError,
    ExporterUnreachableError,
    GpuShareError,
    InvalidInputError,
    OutOfBoundsError,
    SlowPathWarning,
    UnsupportedError,
)
from ._exporter import Export, get_exporter, new_ids, registered, weak_or_none
from ._share import LIFETIMES, PATHS, SHARE_FORMAT, Share, node_key

__all__ = ["export", "open", "View"]

_MAPPED_CUDA = ("fabric", "posix-fd", "cuda-ipc")
_HANDLE_TYPE = {"fabric": "fabric", "posix-fd": "posix_fd", "cuda-ipc": "cuda_ipc", "host-fd": "posix_fd"}


# ---------------------------------------------------------------- exporting


def _describe(obj: Any) -> tuple[tuple[int, ...], str]:
    """Shape and typestr of an array-like, else (nbytes,) of bytes."""
    if (not hasattr(obj, "__array_interface__") and not hasattr(obj, "__cuda_array_interface__")
            and hasattr(obj, "__dlpack_device__")):
        try:
            if obj.__dlpack_device__()[0] == 1:  # CPU: let NumPy read the dtype
                import numpy

                obj = numpy.from_dlpack(obj)
        except Exception:  # noqa: BLE001 - only a description: fall back to bytes
            return (), ""
    for attr in ("__cuda_array_interface__", "__array_interface__"):
        ai = getattr(obj, attr, None)
        if isinstance(ai, dict) and "shape" in ai and "typestr" in ai:
            typestr = ai["typestr"]
            if typestr[0] not in "<>|=":
                break
            return tuple(int(d) for d in ai["shape"]), typestr
    return (), ""


def _parse_lifetime(lifetime: Any) -> tuple[Any, str]:
    if isinstance(lifetime, bool):
        raise InvalidInputError("lifetime must be 'closed', 'revoked', 'none' or a positive int")
    if isinstance(lifetime, int):
        if not 1 <= lifetime <= 999_999_999:
            raise InvalidInputError(f"lifetime={lifetime}: a number of imports must be between 1 and 999999999")
        return lifetime, f"imports={lifetime}"
    if lifetime in LIFETIMES:
        return lifetime, lifetime
    raise InvalidInputError(f"lifetime must be 'closed', 'revoked', 'none' or a positive int, not {lifetime!r}")


def _own_fd_registration(fds: list[int], desc: Any) -> tuple[Any, tuple[int, list[int]]]:
    """Serve duplicates of ``fds`` under a token of this share's own.

    The share's registration is independent of the buffer's: revoking or
    retiring the share revokes it (and closes the duplicates) without
    touching other exports of the same buffer.
    """
    from ._paths.broker import publish

    dups: list[int] = []
    try:
        for fd in fds:
            dups.append(os.dup(fd))
        broker, own = publish(dups, device=desc.device, sizes=desc.sizes, size=desc.size,
                              owner_uuid=desc.owner_uuid)
    except BaseException:
        for fd in dups:
            os.close(fd)
        raise
    return own, (own.export_id, dups)


def _mapped_offers(obj: Any, memory_type: str, wanted: list[str] | None) -> tuple[dict[str, Any], list]:
    """Descriptors for the mapped paths this memory supports (and wants), and
    the share's own fd registrations."""
    from . import _same_node
    from ._paths.host_fd import HostBuffer

    descs: dict[str, Any] = {}
    regs: list = []

    def want(path: str) -> bool:
        return wanted is None or path in wanted

    try:
        if isinstance(obj, HostBuffer):
            if want("host-fd"):
                desc = _same_node.export_buffer(obj)
                with obj._res.lock:
                    fds = list(obj._res.fds)
                descs["host-fd"], reg = _own_fd_registration(fds, desc)
                regs.append(reg)
            return descs, regs
        if memory_type != "cuda":
            return descs, regs
        from ._paths import cuda_vmm

        if cuda_vmm.is_vmm_buffer(obj):
            for path in ("fabric", "posix-fd"):
                if not want(path):
                    continue
                try:
                    desc = _same_node.export_buffer(obj, handle_type=_HANDLE_TYPE[path])
                except GpuShareError:
                    continue  # not supported here (no fabric): not offered
                if path == "posix-fd":
                    mr = obj.memory_resource
                    with mr.lock:
                        fds = list(mr.posix_export[2])
                    desc, reg = _own_fd_registration(fds, desc)
                    regs.append(reg)
                descs[path] = desc
        elif want("cuda-ipc"):
            try:
                descs["cuda-ipc"] = _same_node.export_buffer(obj, handle_type="cuda_ipc")
            except GpuShareError:
                pass
    except BaseException:
        _release_registrations(regs)
        raise
    return descs, regs


def _release_registrations(regs: list) -> None:
    from ._paths.broker import get_broker

    broker = get_broker()
    for export_id, fds in regs:
        broker.revoke(export_id)
        for fd in fds:
            os.close(fd)
    regs.clear()


def export(obj: Any, *, lifetime: Any = "closed", paths: Any = None, readonly: bool | None = None) -> Share:
    """Offer ``obj``'s memory to other processes; return the :class:`Share` to send them.

    Parameters
    ----------
    obj
        A buffer from :func:`gpushare.allocate` (every path), a cuda.core
        ``Buffer``, a CuPy array, a torch tensor, a NumPy array, or anything
        with DLPack, ``__cuda_array_interface__`` or the buffer protocol.
        Memory gpushare did not allocate is offered only where it can be
        served: other CUDA memory on cuda-ipc and ucx-rma, other host memory
        on ucx-rma.  It must be C-contiguous.
    lifetime : {"closed", "revoked", "none"} or int
        How long the exporter keeps ``obj`` alive and openable: until every
        importer has closed it (``"closed"``, the default; counted from the
        first import), until ``N`` imports have been made and closed, until
        :meth:`Share.revoke`, or not at all (``"none"``: the exporter holds
        only a weak reference, and opens fail once ``obj`` is gone).
    paths : iterable of str, optional
        Offer only these paths (``"ucx-rma"`` and ``"same-process"`` are
        always possible).
    readonly : bool, optional
        Importers may only read (``View.put`` is refused, mapped views are
        read-only).  Read-only memory (``bytes``, a non-writeable array) is
        always shared read-only.  UCX does not enforce this against a
        malicious peer on TCP and shared memory (see docs/security.md).

    Returns
    -------
    Share
        Plain data; pickle it and send it over any transport.
    """
    policy, lifetime_name = _parse_lifetime(lifetime)
    wanted = None
    if paths is not None:
        wanted = _path_list(paths, "paths")
    if readonly is not None and not isinstance(readonly, bool):
        raise InvalidInputError("readonly must be a bool or None")
    local = _buffers.resolve(obj, writable=False)
    try:
        nbytes, memory_type, device = local.nbytes, local.memory_type, local.device
        readonly = bool(readonly) or local.readonly
    finally:
        local.release()
    if nbytes < 1:
        raise InvalidInputError("cannot export an empty buffer")
    device = _device_ordinal(local.address) if memory_type == "cuda" else "host"
    descs, regs = _mapped_offers(obj, memory_type, wanted)
    offers = ["same-process"] + [p for p in PATHS if p in descs] + ["ucx-rma"]
    if wanted is not None:
        offers = [p for p in offers if p in wanted]
        if not offers:
            _release_registrations(regs)
            raise InvalidInputError(f"none of the paths {sorted(wanted)} can serve this memory")
    shape, typestr = _describe(obj)
    if not typestr or _prod(shape) * int(typestr[2:]) != nbytes:
        shape, typestr = (nbytes,), "|u1"
    share_id, token = new_ids()
    exporter = get_exporter()
    record = Export(share_id=share_id, token=token, nbytes=nbytes, device=device, memory_type=memory_type,
                    offers=tuple(offers), descriptors=descs, policy=policy, readonly=readonly,
                    registrations=regs)
    try:
        if policy == "none":
            record.obj_ref = weak_or_none(obj, record)
        else:
            record.obj = obj
    except BaseException:
        _release_registrations(regs)
        raise
    exporter.add(record)
    fabric = None
    if "fabric" in offers:
        fabric = _fabric_cliques()[0].get(device)
    return Share._make(SHARE_FORMAT, share_id, token, os.getpid(), node_key(), exporter.addresses, nbytes,
                       device, shape, typestr, tuple(offers), lifetime_name, fabric, readonly)


def _device_ordinal(address: int) -> int:
    """The CUDA device that owns ``address`` (asked of the driver)."""
    from ._paths import _cuda

    drv = _cuda.driver()
    attr = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    return int(_cuda.check(drv.cuPointerGetAttribute(attr, address), "cuPointerGetAttribute(DEVICE_ORDINAL)"))


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------- choosing


def _path_list(value: Any, what: str) -> list[str]:
    if isinstance(value, str):
        value = [p.strip() for p in value.split(",") if p.strip()]
    try:
        items = list(value)
    except TypeError:
        raise InvalidInputError(f"{what} must be a list of path names or a comma-separated str") from None
    for p in items:
        if p not in PATHS:
            raise InvalidInputError(f"{what} names unknown path {p!r}; paths are {', '.join(PATHS)}")
    return items


def _candidates(share: Share, prefer: Any, exclude: Any) -> tuple[list[str], list[str], list[str]]:
    """(ordered candidates, reasons for the paths left out, the natural best order)."""
    env_prefer = os.environ.get("GPUSHARE_PATHS")
    env_exclude = os.environ.get("GPUSHARE_EXCLUDE_PATHS")
    prefer_l = _path_list(prefer, "prefer") if prefer is not None else (
        _path_list(env_prefer, "GPUSHARE_PATHS") if env_prefer else [])
    exclude_l = _path_list(exclude, "exclude") if exclude is not None else []
    if env_exclude:
        exclude_l += _path_list(env_exclude, "GPUSHARE_EXCLUDE_PATHS")
    same_node = share.node == node_key()
    here = os.getpid()
    left_out: list[str] = []
    natural: list[str] = []
    for path in PATHS:
        if path not in share.offers:
            if share.device == "host" and path == "host-fd":
                left_out.append("not host-fd: not offered, the memory is not from gpushare.allocate(device='host')")
            elif share.device != "host" and path == "posix-fd":
                left_out.append("not posix-fd/fabric: not offered, the memory is not from gpushare.allocate(device=N)")
            elif share.device != "host" and path == "cuda-ipc" and "posix-fd" not in share.offers:
                left_out.append("not cuda-ipc: not offered by the exporter")
            continue
        why_not = None
        if path == "same-process" and (share.exporter_pid != here or not same_node or registered(share) is None):
            why_not = f"exporter is process {share.exporter_pid}" + ("" if same_node else " on another node")
        elif path in ("posix-fd", "cuda-ipc", "host-fd") and not same_node:
            why_not = "exporter is on another node (or network namespace)"
        elif path == "fabric":
            why_not = _fabric_mismatch(share.fabric)
        if why_not is None and path in _MAPPED_CUDA:
            from ._paths import _cuda

            reason = _cuda.unavailable_reason()
            if reason is not None:
                why_not = f"this process cannot map CUDA memory ({reason.split(' (')[0]})"
        if why_not is not None:
            left_out.append(f"not {path}: {why_not}")
            continue
        natural.append(path)
    order = [p for p in prefer_l if p in natural] + [p for p in natural if p not in prefer_l]
    if order and natural and order[0] != natural[0]:
        left_out.append(f"{order[0]} preferred by the caller over {natural[0]}")
    for p in exclude_l:
        if p in order:
            order.remove(p)
            left_out.append(f"not {p}: excluded by the caller")
    return order, left_out, natural


def _fabric_cliques() -> tuple[dict[int, str], str | None]:
    """This node's fabric clique per device ("cluster:clique"), or why there is none."""
    from ._capabilities import capabilities

    caps = capabilities()
    if not caps["cuda"]["available"]:
        return {}, f"no CUDA here ({caps['cuda']['reason']})"
    if not caps["imex"]["present"]:
        return {}, f"no IMEX channel ({caps['imex']['reason']})"
    cliques = {}
    for dev in caps["cuda"]["devices"]:
        fab = dev.get("fabric") or {}
        if fab.get("cluster_uuid"):
            cliques[dev["ordinal"]] = f"{fab['cluster_uuid']}:{fab['clique_id']}"
    return cliques, None if cliques else "no device reports an NVLink fabric clique"


def _fabric_mismatch(exporter_clique: str | None) -> str | None:
    """None when this process can import the exporter's fabric handles, else why not."""
    if exporter_clique is None:
        return "the exporter did not report a fabric clique"
    cliques, why = _fabric_cliques()
    if why is not None:
        return why
    if exporter_clique not in cliques.values():
        return "not in the exporter's fabric clique"
    return None


# ---------------------------------------------------------------- importing

_importer_lock = threading.Lock()
_importer_agent: Any = None
_importer_pid = 0


def _agent() -> Any:
    """This process's importer-side UCX agent (made again after a fork)."""
    global _importer_agent, _importer_pid
    from . import ucx

    with _importer_lock:
        if _importer_agent is None or _importer_pid != os.getpid() or _importer_agent.closed:
            _importer_agent = ucx.Agent()
            _importer_pid = os.getpid()
        return _importer_agent


def _raise_refusal(reply: dict) -> None:
    code, message = reply.get("code"), str(reply.get("message", ""))[:300]
    if code == "denied":
        raise AccessDeniedError(f"exporter refused: {message}")
    if code in ("revoked", "retired", "exhausted", "unknown"):
        raise ClosedError(f"cannot open share: {message}")
    raise InvalidInputError(f"exporter answered: {message}")


def open(share: Share, *, prefer: Any = None, exclude: Any = None, timeout: float = 10.0) -> View:  # noqa: A001
    """Open a share from any process that can reach the exporter.

    The best path for this pair is tried first, then the next ones if a
    probe fails (within ``timeout`` in all); a fallback to a slower path than
    the pair could use emits :class:`SlowPathWarning` and ``view.why`` says
    what failed.

    Parameters
    ----------
    share : Share
        From :func:`export`, probably unpickled: it is validated.
    prefer, exclude : list of str or comma-separated str, optional
        Paths to try first / never.  The environment variables
        ``GPUSHARE_PATHS`` (prefer) and ``GPUSHARE_EXCLUDE_PATHS`` do the same
        for a whole job; ``prefer=`` replaces ``GPUSHARE_PATHS``,
        ``exclude=`` adds to ``GPUSHARE_EXCLUDE_PATHS``.
    timeout : float
        Seconds for the whole open: reaching the exporter and every probe.

    Raises
    ------
    ClosedError
        The share was revoked, its lifetime ended, or it is unknown to the exporter.
    AccessDeniedError
        Its token is wrong (forged).
    ExporterUnreachableError
        The exporter is gone or unreachable.
    GpuShareError
        Every candidate path failed; the message lists why.
    """
    if not isinstance(share, Share):
        raise InvalidInputError(f"open expects a gpushare.Share, not {type(share).__name__}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidInputError("timeout must be a positive number of seconds")
    order, left_out, natural = _candidates(share, prefer, exclude)
    if not order:
        raise UnsupportedError("no path can serve this share here: " + "; ".join(left_out))
    failures: list[str] = []
    if order[0] == "same-process":
        export = registered(share)
        if export is None:  # it ended since the paths were chosen
            raise ClosedError("cannot open share: its lifetime ended or it was revoked")
        with export.lock:
            refusal = export.refusal()
            target = export.target()
        if refusal is not None:
            from ._exporter import _REFUSALS

            raise ClosedError(f"cannot open share: {_REFUSALS[refusal]}")
        why = "same-process: this process exported it; the original object is handed back"
        return View._make(share, "same-process", why, target=target)
    deadline = time.monotonic() + timeout

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ExporterUnreachableError(
                f"open did not finish within {timeout} s" + (f" ({'; '.join(failures)})" if failures else "")
            )
        return remaining

    from ._importer import get_importer

    importer = get_importer()
    addresses = _addresses_for(share)
    try:
        for path in order:
            request = {"op": "open", "share": share.share_id, "token": share.token, "path": path}
            reply, lease, fds = importer.open(share, addresses, request, deadline)
            if lease is None:
                if reply.get("code") == "path":
                    failures.append(f"{path} failed: {str(reply.get('message'))[:200]}")
                    continue
                _raise_refusal(reply)
            try:
                view = _import(share, path, reply.get("payload"), left(), fds)
            except GpuShareError as exc:
                failures.append(f"{path} failed: {exc}")
                lease.failed()
                continue
            except BaseException:
                lease.failed()
                raise
            why = _explain(path, share, left_out, failures)
            view._attach_lease(lease, why)
            if failures and natural and natural.index(path) > 0:
                try:
                    warnings.warn(SlowPathWarning(f"gpushare fell back to {path}: {'; '.join(failures)}"),
                                  stacklevel=2)
                except BaseException:
                    view.close()  # the warning was turned into an error: leave nothing open
                    raise
            return view
    except GpuShareError:
        raise
    except (EOFError, OSError, TimeoutError) as exc:
        raise ExporterUnreachableError(f"the exporter (pid {share.exporter_pid}) stopped answering: {exc}") from None
    raise GpuShareError("every path failed: " + "; ".join(failures))


def _addresses_for(share: Share) -> tuple[tuple[str, int], ...]:
    if share.node == node_key():
        return tuple(a for a in share.control if a[0] == "127.0.0.1") + tuple(
            a for a in share.control if a[0] != "127.0.0.1")
    return tuple(a for a in share.control if not a[0].startswith("127.")) or share.control


def _explain(path: str, share: Share, left_out: list[str], failures: list[str]) -> str:
    reason = {
        "fabric": "same fabric clique with an IMEX channel",
        "posix-fd": "same node; CUDA virtual memory mapped through POSIX fds",
        "cuda-ipc": "same node; CUDA memory not from gpushare.allocate, mapped through legacy CUDA IPC",
        "host-fd": "same node; host memory mapped through memfds",
        "ucx-rma": "remote memory access through UCX; copies with get/put",
    }[path]
    parts = [f"{path}: {reason}"] + failures + left_out
    return "; ".join(parts)


def _import(share: Share, path: str, payload: Any, timeout: float, fds: list[int]) -> View:
    """Turn an exporter's offer into a view; ``fds`` (owned, closed here)
    came with the offer over a same-node control connection."""
    if fds and path != "host-fd":
        for fd in fds:
            os.close(fd)
        raise InvalidInputError(f"exporter sent file descriptors with a {path} offer")
    try:
        return _import_offer(share, path, payload, timeout, fds)
    finally:
        for fd in fds:
            os.close(fd)


def _import_offer(share: Share, path: str, payload: Any, timeout: float, fds: list[int]) -> View:
    if not isinstance(payload, dict):
        raise InvalidInputError("exporter sent a malformed offer")
    if path == "ucx-rma":
        address, key = payload.get("address"), payload.get("key")
        if not isinstance(address, bytes) or not isinstance(key, bytes):
            raise InvalidInputError("exporter sent a malformed ucx-rma offer")
        ep = _agent().connect(address, timeout=timeout)
        try:
            rk = ep.unpack_remote_key(key)
            if rk.size < share.nbytes:
                raise InvalidInputError(f"remote key covers {rk.size} bytes; the share says {share.nbytes}")
        except BaseException:
            ep.close()
            raise
        return View._make(share, path, "", endpoint=ep, rkey=rk)
    from . import _same_node
    from ._descriptors import _rebuild

    fields = payload.get("descriptor")
    if not isinstance(fields, tuple) or not fields:
        raise InvalidInputError("exporter sent a malformed descriptor")
    desc = _rebuild(*fields)
    if getattr(desc, "size", None) != share.nbytes:
        raise InvalidInputError(f"descriptor is {getattr(desc, 'size', '?')} bytes; the share says {share.nbytes}")
    if fds:
        from ._paths import host_fd

        if not isinstance(desc, host_fd.PosixFdBufferDescriptor) or desc.device != "host":
            raise InvalidInputError("exporter sent file descriptors with an offer that is not host memory")
        given = list(fds)
        fds.clear()  # import_host owns them now
        mapped = host_fd.import_host(desc, fds=given)
    else:
        mapped = _same_node.import_buffer(desc)
    return View._make(share, path, "", mapped=mapped)


# ---------------------------------------------------------------- views


def _release_view(mapped: Any, endpoint: Any, lease: list) -> None:
    for held in lease:
        held.close()
    lease.clear()
    if endpoint is not None:
        try:
            endpoint.close()
        except GpuShareError:
            pass
    if mapped is not None:
        try:
            mapped.close()
        except BufferError:
            pass  # arrays still use the mapping: it goes with the last of them
        except GpuShareError:
            pass


class View:
    """An open share: made by :func:`gpushare.open`.

    Attributes
    ----------
    path : str
        The path taken: ``"same-process"``, ``"fabric"``, ``"posix-fd"``,
        ``"cuda-ipc"``, ``"host-fd"`` or ``"ucx-rma"``.
    why : str
        One line: why this path, and why not the better ones.
    nbytes : int
    device : "host" or int
    shape, typestr :
        As exported, for array views.

    Mapped views (every path but ucx-rma) are zero-copy: host ones expose
    ``__array_interface__`` (``numpy.asarray(view)``) and :meth:`memoryview`;
    CUDA ones ``__cuda_array_interface__`` and ``__dlpack__``.  A ucx-rma view
    is not mapped: use :meth:`get` and :meth:`put`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("View objects are made by gpushare.open")

    @classmethod
    def _make(cls, share: Share, path: str, why: str, *, target: Any = None, mapped: Any = None,
              endpoint: Any = None, rkey: Any = None) -> View:
        self = object.__new__(cls)
        self.share = share
        self.path = path
        self.why = why
        self.nbytes = share.nbytes
        self.device = share.device
        self.shape = share.shape
        self.typestr = share.typestr
        self._target = target
        self._mapped = mapped
        self._ep = endpoint
        self._rkey = rkey
        self._lease: list = []
        self._finalizer = weakref.finalize(self, _release_view, mapped, endpoint, self._lease)
        return self

    def _attach_lease(self, lease: Any, why: str) -> None:
        self._lease.append(lease)
        self.why = why

    # -- state -----------------------------------------------------------
    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def _check(self) -> None:
        if self.closed:
            raise ClosedError("view is closed")

    def close(self) -> None:
        """Unmap or disconnect, and end the lease with the exporter (idempotent)."""
        self._target = None
        self._finalizer()

    def __enter__(self) -> View:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.path
        return f"<gpushare.View {self.nbytes} bytes on {self.device} via {state}>"

    # -- memory ------------------------------------------------------------
    def _local(self) -> _buffers.LocalBuffer:
        """The mapped memory as a local buffer (not for ucx-rma)."""
        self._check()
        if self.path == "ucx-rma":
            raise UnsupportedError("a ucx-rma view is not mapped in this process: use view.get() and view.put()")
        if self._target is not None:
            return _buffers.resolve(self._target, writable=False)
        mapped = self._mapped
        if self.device == "host":
            return _buffers.LocalBuffer(mapped.ptr, self.nbytes, "host", False, mapped)
        return _buffers.LocalBuffer(int(mapped.handle), self.nbytes, "cuda", False, mapped, device=self.device)

    def memoryview(self) -> memoryview:
        """A writable byte view of mapped host memory."""
        self._check()
        if self.device != "host":
            raise UnsupportedError("memoryview() needs host memory; this view is CUDA memory")
        if self.path == "ucx-rma":
            self._local()
        if self._target is not None:
            lb = _buffers.resolve(self._target, writable=False)
            raw = (ctypes.c_char * self.nbytes).from_address(lb.address)
            raw._owner = (self._target, lb)  # the memory lives as long as the view of it
            view = memoryview(raw).cast("B")
        else:
            view = self._mapped.memoryview()
        return view.toreadonly() if self.share.readonly else view

    def __buffer__(self, flags: int) -> memoryview:  # the buffer protocol on Python 3.12+
        return self.memoryview()

    @property
    def __array_interface__(self) -> dict:
        if self.device != "host":
            raise AttributeError("__array_interface__ (this view is CUDA memory; use __cuda_array_interface__)")
        return {"shape": self.shape, "typestr": self.typestr, "data": self.memoryview(), "version": 3}

    @property
    def __cuda_array_interface__(self) -> dict:
        if self.device == "host":
            raise AttributeError("__cuda_array_interface__ (this view is host memory)")
        lb = self._local()
        return {"shape": self.shape, "typestr": self.typestr, "data": (lb.address, self.share.readonly),
                "version": 3, "strides": None, "stream": None}

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        self._check()
        if self.device == "host" or self.path == "ucx-rma":
            raise UnsupportedError("__dlpack__ is offered for mapped CUDA views; use numpy.asarray for host")
        target = self._target if self._target is not None else self._mapped
        return target.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        if self.device == "host":
            return (1, 0)
        return (2, int(self.device))

    # -- copies ------------------------------------------------------------
    def _check_writable(self) -> None:
        if self.share.readonly:
            raise InvalidInputError("this share is read-only: its exporter allows get, not put")

    def _span(self, buf: Any, offset: Any, writable: bool) -> tuple[_buffers.LocalBuffer, int]:
        self._check()
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise InvalidInputError(f"offset must be a non-negative int, not {offset!r}")
        local = _buffers.resolve(buf, writable=writable)
        if offset + local.nbytes > self.nbytes:
            local.release()
            raise OutOfBoundsError(
                f"{local.nbytes} bytes at offset {offset} run past the shared {self.nbytes} bytes"
            )
        return local, offset

    def get(self, dst: Any, offset: int = 0, *, timeout: float | None = 60.0) -> None:
        """Copy ``len(dst)`` bytes from the shared memory at ``offset`` into ``dst``.

        ``timeout`` bounds a remote (ucx-rma) transfer; when it passes,
        :class:`WaitTimeoutError` is raised and ``dst`` stays in use by the
        transfer until it completes or fails.
        """
        local, offset = self._span(dst, offset, True)
        if self.path == "ucx-rma":
            # The request owns the pinned buffer until it completes.
            self._ep.mem_get(local, self._rkey.base_address + offset, self._rkey).wait(timeout)
            return
        try:
            src = self._local()
            _copy(local, src.address + offset, local.address, local.nbytes, src.memory_type, "from")
        finally:
            local.release()

    def put(self, src: Any, offset: int = 0, *, timeout: float | None = 60.0) -> None:
        """Copy ``src`` into the shared memory at ``offset``; remote puts are flushed before this returns."""
        self._check_writable()
        local, offset = self._span(src, offset, False)
        if self.path == "ucx-rma":
            self._ep.mem_put(local, self._rkey.base_address + offset, self._rkey).wait(timeout)
            self._ep.flush().wait(timeout)
            return
        try:
            dst = self._local()
            _copy(local, local.address, dst.address + offset, local.nbytes, dst.memory_type, "to")
        finally:
            local.release()

    async def get_async(self, dst: Any, offset: int = 0) -> None:
        """:meth:`get` for asyncio: awaits the transfer without blocking the loop."""
        if self.path != "ucx-rma":
            await asyncio.to_thread(self.get, dst, offset)
            return
        local, offset = self._span(dst, offset, True)
        await self._ep.mem_get(local, self._rkey.base_address + offset, self._rkey)

    async def put_async(self, src: Any, offset: int = 0) -> None:
        """:meth:`put` for asyncio; remote puts are flushed before it completes."""
        self._check_writable()
        if self.path != "ucx-rma":
            await asyncio.to_thread(self.put, src, offset)
            return
        local, offset = self._span(src, offset, False)
        await self._ep.mem_put(local, self._rkey.base_address + offset, self._rkey)
        await self._ep.flush()


def _copy(local: _buffers.LocalBuffer, src: int, dst: int, n: int, shared_type: str, direction: str) -> None:
    if n == 0:
        return
    if local.memory_type == "host" and shared_type == "host":
        ctypes.memmove(dst, src, n)
        return
    from ._paths import _cuda

    drv = _cuda.driver()
    _cuda.check(drv.cuMemcpy(dst, src, n), f"copy {direction} the shared CUDA memory")
