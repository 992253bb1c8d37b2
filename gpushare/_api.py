"""The sharing API: :func:`export`, :func:`open` and :class:`View`."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterable
from typing import Any, Literal, NoReturn

from . import _arrays, _buffers, _types
from ._errors import (
    AccessDeniedError,
    ClosedError,
    ExporterUnreachableError,
    GpuShareError,
    InvalidInputError,
    OutOfBoundsError,
    SlowPathWarning,
    UCXConnectionError,
    UnsupportedError,
    WaitTimeoutError,
)
from ._exporter import Export, get_exporter, new_ids, registered, track_auto, weak_or_none
from ._paths import _cuda
from ._paths.broker import release_registrations
from ._process import await_alive
from ._share import LIFETIMES, PATHS, SHARE_FORMAT, Share, node_key
from ._types import Lifetime, PathName
from ._ucx import _device

#: What ``paths=``, ``prefer=`` and ``exclude=`` take: path names, or one comma-separated str.
PathList = Iterable[PathName] | str

__all__ = ["export", "open", "View"]

log = logging.getLogger("gpushare.api")

_MAPPED_CUDA = ("fabric", "posix-fd", "cuda-ipc")
_HANDLE_TYPE = {"fabric": "fabric", "posix-fd": "posix-fd", "cuda-ipc": "cuda-ipc", "host-fd": "posix-fd"}


# ---------------------------------------------------------------- exporting


def _parse_lifetime(lifetime: Any) -> tuple[Any, str]:
    if isinstance(lifetime, bool):
        raise InvalidInputError("lifetime must be 'auto', 'closed', 'revoked', 'none' or a positive int")
    if isinstance(lifetime, int):
        if not 1 <= lifetime <= 999_999_999:
            raise InvalidInputError(f"lifetime={lifetime}: a number of imports must be between 1 and 999999999")
        return lifetime, f"imports={lifetime}"
    if lifetime in LIFETIMES:
        return lifetime, lifetime
    raise InvalidInputError(f"lifetime must be 'auto', 'closed', 'revoked', 'none' or a positive int, not {lifetime!r}")


def _own_fd_registration(fds: list[int], desc: Any, readonly: bool = False) -> tuple[Any, tuple[int, list[int]]]:
    """Serve duplicates of ``fds`` under a token of this share's own.

    The share's registration is independent of the buffer's: revoking or
    retiring the share revokes it (and closes the duplicates) without
    touching other exports of the same buffer.  For a read-only share the
    duplicates are the memfds opened again read-only: an importer can map
    them only read-only, and cannot make its mapping writable.
    """
    from ._paths.broker import publish

    dups: list[int] = []
    try:
        for fd in fds:
            dups.append(os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC) if readonly else os.dup(fd))
        broker, own = publish(dups, device=desc.device, sizes=desc.sizes, size=desc.size,
                              owner_uuid=desc.owner_uuid)
    except BaseException:
        for fd in dups:
            os.close(fd)
        raise
    return own, (own.export_id, dups)


def _mapped_offers(obj: Any, memory_type: str, wanted: list[str] | None,
                   span: tuple[int, int] = (0, 0), readonly: bool = False) -> tuple[dict[str, Any], list, int]:
    """Descriptors for the mapped paths this memory supports (and wants), the
    share's own fd registrations, and the offset of ``span`` (address,
    nbytes) in the buffer the host-fd path maps."""
    from . import _same_node
    from ._paths.host_fd import HostBuffer, containing

    descs: dict[str, Any] = {}
    regs: list = []
    offset = 0

    def want(path: str) -> bool:
        return wanted is None or path in wanted

    if isinstance(obj, _arrays.CudaArray) and obj.ptr == int(getattr(obj.base, "handle", -1)):
        obj = obj.base  # a gpushare.empty array: its buffer goes every way, typed as the array
    if memory_type == "cuda" and span[1]:
        from ._paths import cuda_vmm

        if not cuda_vmm.is_vmm_buffer(obj):
            # A CuPy or torch array (a slice, a typed view) over gpushare.allocate
            # memory: the importer maps the whole buffer and views its part.
            found = cuda_vmm.containing(*span)
            if found is not None:
                obj, offset = found
    if memory_type == "host" and not isinstance(obj, HostBuffer):
        # An array over gpushare.allocate memory (a typed view, a slice):
        # the importer maps the whole buffer and views its part of it.
        found = containing(*span)
        if found is not None:
            obj, offset = found
    try:
        if isinstance(obj, HostBuffer):
            # A sealed buffer maps only read-only: shared writable, it goes by copies (cma).
            if want("host-fd") and (readonly or not obj.sealed):
                desc = _same_node.export_buffer(obj)
                with obj._res.lock:
                    fds = list(obj._res.fds)
                descs["host-fd"], reg = _own_fd_registration(fds, desc, readonly)
                regs.append(reg)
            return descs, regs, offset
        if memory_type != "cuda":
            return descs, regs, offset
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
                descs["cuda-ipc"] = _same_node.export_buffer(obj, handle_type="cuda-ipc")
            except GpuShareError:
                pass
    except BaseException:
        release_registrations(regs)
        raise
    return descs, regs, offset


def export(obj: Any, *, lifetime: Lifetime = "auto", paths: PathList | None = None,
           readonly: bool | None = None) -> Share:
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
    lifetime : {"auto", "closed", "revoked", "none"} or int
        How long the exporter keeps ``obj`` alive and openable.  ``"auto"``
        (the default): while this process holds the returned :class:`Share`
        (it keeps ``obj`` alive, like a reference), while any import is
        open, until the first import of a share that was pickled or sent as
        bytes, and after that while ``obj`` itself is still alive here; so a
        share handed to N Pool workers stays openable until the last one has
        opened it.  ``"closed"``: until every importer has closed it
        (counted from the first import).  ``N``: until ``N`` imports have
        been made and closed.  ``"revoked"``: until :meth:`Share.revoke`.
        ``"none"``: the exporter holds only a weak reference, and opens fail
        once ``obj`` is gone.  See docs/lifetimes.md.
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
    # A strided array is served as the memory it spans, with its strides.
    memory, strides = _arrays.span_of(obj)
    local = _buffers.resolve(memory, writable=False)
    try:
        nbytes, memory_type, device = local.nbytes, local.memory_type, local.device
        readonly = bool(readonly) or local.readonly
    finally:
        local.release()
    if nbytes < 1:
        raise InvalidInputError("cannot export an empty buffer")
    device = _device_ordinal(local.address, device) if memory_type == "cuda" else "host"
    descs, regs, offset = _mapped_offers(memory, memory_type, wanted, (local.address, nbytes), readonly)
    if strides is not None and "host-fd" not in descs:
        release_registrations(regs)
        raise InvalidInputError(
            f"array is not C-contiguous; {_buffers._CONTIGUOUS_FIX} (strided arrays are shared as they are "
            "only over gpushare.allocate host memory, such as gpushare.empty arrays)"
        )
    # get/put move bytes, which a strided array's are not: it goes only where it is mapped.
    offers = ["same-process"] + [p for p in PATHS if p in descs]
    if not strides:
        # Host memory the mapped paths cannot serve goes by cross-memory attach on its node.
        offers += (["cma"] if memory_type == "host" and "host-fd" not in descs else []) + ["ucx-rma"]
    if wanted is not None:
        offers = [p for p in offers if p in wanted]
        if not offers:
            release_registrations(regs)
            raise InvalidInputError(f"none of the paths {sorted(wanted)} can serve this memory" + (
                " (a strided array goes only where it is mapped: same-process, and host-fd for "
                "gpushare.allocate memory; share numpy.ascontiguousarray(a) for the others)" if strides else ""))
    try:
        shape, typestr, dtype_name, dlpack_dtype = _arrays.describe(obj, nbytes, strided=strides is not None)
    except InvalidInputError:
        release_registrations(regs)
        raise
    share_id, token = new_ids()
    exporter = get_exporter()
    record = Export(share_id=share_id, token=token, nbytes=nbytes, device=device, memory_type=memory_type,
                    offers=tuple(offers), descriptors=descs, policy=policy, readonly=readonly,
                    registrations=regs)
    try:
        if policy == "none":
            record.obj_ref = weak_or_none(obj, record)
        else:
            record.obj = memory  # for a strided array, its span, which holds the array
    except BaseException:
        release_registrations(regs)
        raise
    exporter.add(record)
    fabric = None
    if "fabric" in offers:
        fabric = _fabric_cliques()[0].get(device)
    log.info("exported share %s: %d bytes of %s memory%s, offered on %s, lifetime %s%s", share_id[:8], nbytes,
             "host" if device == "host" else "CUDA", "" if device == "host" else f" on device {device}",
             ", ".join(offers), lifetime_name, ", read-only" if readonly else "")
    share = Share._make(SHARE_FORMAT, share_id, token, os.getpid(), node_key(), exporter.addresses, nbytes,
                        device, shape, typestr, tuple(offers), lifetime_name, fabric, readonly, offset, dtype_name,
                        dlpack_dtype, strides)
    if policy == "auto":
        track_auto(obj, share, record)
    return share


def _device_ordinal(address: int, hint: Any) -> int:
    """The CUDA device that owns ``address`` (asked of the driver)."""
    from ._paths import _cuda

    return _cuda.pointer_ordinal(address, hint if isinstance(hint, int) and hint >= 0 else None)


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
            if path in _types.COPIED_PATHS and share.strides is not None:
                left_out.append(f"not {path}: the share is a strided array, which goes only where it is mapped")
            elif share.device == "host" and path == "host-fd":
                left_out.append("not host-fd: not offered, the memory is not from gpushare.allocate(device='host')")
            elif share.device != "host" and path == "posix-fd":
                left_out.append("not posix-fd/fabric: not offered, the memory is not from gpushare.allocate(device=N)")
            elif share.device != "host" and path == "cuda-ipc" and "posix-fd" not in share.offers:
                left_out.append("not cuda-ipc: not offered; legacy CUDA IPC cannot export memory from a "
                                "stream-ordered pool (cudaMallocAsync, cuda.core Device.allocate) or VMM")
            continue
        why_not = None
        if path == "same-process" and (share.exporter_pid != here or not same_node or registered(share) is None):
            why_not = f"exporter is process {share.exporter_pid}" + ("" if same_node else " on another node")
        elif path in ("posix-fd", "cuda-ipc", "host-fd", "cma") and not same_node:
            why_not = "exporter is on another node (or network namespace)"
        elif path == "cma":
            from ._paths import cma

            why_not = cma.available()
        elif path == "fabric":
            why_not = _fabric_mismatch(share.fabric)
        elif path == "cuda-ipc" and share.readonly:
            why_not = "legacy CUDA IPC maps memory writable only, and this share is read-only"
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

def _raise_refusal(reply: dict) -> None:
    code, message = reply.get("code"), str(reply.get("message", ""))[:300]
    if code == "denied":
        raise AccessDeniedError(f"exporter refused: {message}")
    if code in ("revoked", "retired", "exhausted", "unknown"):
        raise ClosedError(f"cannot open share: {message}")
    raise InvalidInputError(f"exporter answered: {message}")


def open(share: Share, *, prefer: PathList | None = None, exclude: PathList | None = None,  # noqa: A001
         timeout: float = 10.0, device: _types.Device | None = None, prefault: bool = False) -> View:
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
    device : int or "host", optional
        For shares of CUDA memory: the device (an ordinal of this process) to
        map it on (``"host"``/``"cpu"`` are accepted for host shares only).  By default the calling thread's current device, where it
        can reach the memory; else the memory's own device, matched by UUID.
        The calling thread's current device is left as it was.
    prefault : bool, default False
        For host memory mapped into this process (host-fd): fault in every
        page during the open (``MADV_POPULATE_READ``), so that the first
        copy or store pays no page faults.  Ignored on other paths.

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
    if not isinstance(prefault, bool):
        raise InvalidInputError("prefault must be a bool")
    if _types.is_host(device):
        if share.device != "host":
            raise InvalidInputError(
                f"device={device!r}: this share is CUDA memory, which cannot be mapped on the host; "
                "open it on a CUDA device (or device=None) and copy out with view.get()"
            )
        device = None
    if device is not None:
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise InvalidInputError(f"device must be a CUDA device ordinal (an int >= 0) or 'host', not {device!r}")
        if share.device == "host":
            raise InvalidInputError(f"device={device} given for a share of host memory")
        from ._paths import _cuda

        if _cuda.unavailable_reason() is None:
            _cuda.valid_ordinal(device)  # a wrong device is the caller's error, not a path's
    order, left_out, natural = _candidates(share, prefer, exclude)
    log.debug("opening share %s: candidates %s; %s", share.share_id[:8], order or "none",
              "; ".join(left_out) or "nothing left out")
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
            from ._exporter import refusal_text

            raise ClosedError(f"cannot open share: {refusal_text(refusal, export.policy)}")
        why = "same-process: this process exported it; the original object is handed back"
        log.info("opened share %s over %s", share.share_id[:8], why)
        return View._make(share, "same-process", why, target=target)
    deadline = time.monotonic() + timeout
    if order[0] == "ucx-rma":
        from ._ucx import _server

        _server.warm()  # load UCX here while the exporter prepares its offer

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
            try:
                reply, lease, fds = importer.open(share, addresses, request, deadline)
            except ExporterUnreachableError as exc:
                raise ExporterUnreachableError(_unreachable(share, str(exc))) from None
            if lease is None:
                if reply.get("code") == "path":
                    failures.append(f"{path} failed: {str(reply.get('message'))[:200]}")
                    log.info("share %s: %s; trying the next path", share.share_id[:8], failures[-1])
                    continue
                _raise_refusal(reply)
            try:
                view = _import(share, path, reply.get("payload"), left(), fds, device, lease, prefault)
            except AccessDeniedError:
                lease.failed()
                raise  # a refusal is final: no other path may grant what this one refused
            except GpuShareError as exc:
                failures.append(f"{path} failed: {exc}")
                log.info("share %s: %s; trying the next path", share.share_id[:8], failures[-1])
                lease.failed()
                continue
            except BaseException:
                lease.failed()
                raise
            why = _explain(path, share, left_out, failures)
            log.info("opened share %s over %s", share.share_id[:8], why)
            view._attach_lease(lease, why)
            slow = None
            if failures and natural and natural.index(path) > 0:
                slow = f"gpushare fell back to {path}: {'; '.join(failures)}"
            elif path == "ucx-rma" and share.node == node_key() and prefer is None and exclude is None and not (
                    os.environ.get("GPUSHARE_PATHS") or os.environ.get("GPUSHARE_EXCLUDE_PATHS")):
                slow = ("gpushare serves this same-node peer over ucx-rma, a network transport: "
                        + "; ".join(left_out or ["no same-node path is offered for this memory"]))
            if slow is not None:
                try:
                    warnings.warn(SlowPathWarning(slow), stacklevel=2)
                except BaseException:
                    view.close()  # the warning was turned into an error: leave nothing open
                    raise
            return view
    except GpuShareError:
        raise
    except (EOFError, OSError, TimeoutError) as exc:
        raise ExporterUnreachableError(_unreachable(share, f"it stopped answering: {exc}")) from None
    raise GpuShareError("every path failed: " + "; ".join(failures))


def _exporter_exited(share: Share) -> bool | None:
    """True when the exporting process is gone (checked on its node only), False
    when it runs, None when this process cannot tell (another node)."""
    if share.node != node_key():
        return None
    from ._process import process_state

    state = process_state(share.exporter_pid)
    return state is None or state in ("Z", "X")  # gone, or exited and not yet reaped by its parent


def _unreachable(share: Share, detail: str) -> str:
    """The message of an :class:`ExporterUnreachableError` for ``share``: what
    happened to the exporter, and what to do."""
    pid = share.exporter_pid
    exited = _exporter_exited(share)
    if exited:
        return (f"the exporter (pid {pid}) has exited, and its shares went with it: export the buffer again "
                f"from a running process and open the new share ({detail})")
    if exited is None:
        return (f"cannot reach the exporter (pid {pid} on another node): {detail}; check that it is still "
                "running and that this node can reach its control addresses "
                f"{', '.join(f'{h}:{p}' for h, p in share.control)} (see GPUSHARE_CONTROL_HOST)")
    return (f"the exporter (pid {pid}) is running on this node but did not answer: {detail}; it may be "
            "stuck, or its control channel bound to an address this process cannot reach (GPUSHARE_CONTROL_HOST)")


def _raise_rma_error(share: Share, exc: UCXConnectionError | ClosedError) -> NoReturn:
    """Raise ``exc`` (caught from a ucx-rma transfer), saying what a broken
    connection means: the exporter's side went away."""
    if isinstance(exc, UCXConnectionError):
        pid = share.exporter_pid
        what = ("has exited" if _exporter_exited(share) else
                "closed its side: the share was revoked or its lifetime ended, or the process exited")
        raise type(exc)(exc.status, f"{exc.message}: the exporter (pid {pid}) {what}; this view cannot be used "
                                    "any more: close it, and open a share from a running exporter") from exc
    if "exporter" in str(exc):
        raise ClosedError(f"{exc}: the share was revoked or its lifetime ended; this view cannot be used any "
                          "more: close it (and open the share again if it is still exported)") from None
    raise exc


def _addresses_for(share: Share) -> tuple[tuple[str, int], ...]:
    if share.node == node_key():
        return tuple(a for a in share.control if a[0] == "127.0.0.1") + tuple(
            a for a in share.control if a[0] != "127.0.0.1")
    return tuple(a for a in share.control if not a[0].startswith("127.")) or share.control


def _explain(path: str, share: Share, left_out: list[str], failures: list[str]) -> str:
    reason = {
        "fabric": "same fabric clique with an IMEX channel",
        "posix-fd": "same node; CUDA virtual memory mapped through POSIX fds",
        "cuda-ipc": ("same node; CUDA memory not from gpushare.allocate, mapped through CUDA IPC "
                     "(a legacy handle, or its pool's export)"),
        "host-fd": "same node; host memory mapped through memfds",
        "cma": ("same node; the exporter copies with the kernel's cross-memory attach (process_vm_readv/writev), "
                "checking each transfer; copies with get/put"),
        "ucx-rma": "remote memory access through UCX, each transfer checked by the exporter; copies with get/put",
    }[path]
    parts = [f"{path}: {reason}"] + failures + left_out
    return "; ".join(parts)


def _import(share: Share, path: str, payload: Any, timeout: float, fds: list[int],
            device: int | None = None, lease: Any = None, prefault: bool = False) -> View:
    """Turn an exporter's offer into a view; ``fds`` (owned, closed here)
    came with the offer over a same-node control connection.  ``prefault``:
    fault in a host mapping before the view is made."""
    if fds and path != "host-fd":
        for fd in fds:
            os.close(fd)
        raise InvalidInputError(f"exporter sent file descriptors with a {path} offer")
    try:
        return _import_offer(share, path, payload, timeout, fds, device, lease, prefault)
    finally:
        for fd in fds:
            os.close(fd)


def _import_offer(share: Share, path: str, payload: Any, timeout: float, fds: list[int],
                  device: int | None, lease: Any = None, prefault: bool = False) -> View:
    if not isinstance(payload, dict):
        raise InvalidInputError("exporter sent a malformed offer")
    if path == "cma":
        if payload or lease is None or share.device != "host":
            raise InvalidInputError("exporter sent a malformed cma offer")
        return View._make(share, path, "", peer=lease)  # the exporter copies, over the lease
    if path == "ucx-rma":
        from ._ucx import _server

        address, region_id, key = payload.get("address"), payload.get("region"), payload.get("key")
        if (not isinstance(address, bytes) or isinstance(region_id, bool) or not isinstance(region_id, int)
                or not 0 <= region_id < 1 << 64 or not isinstance(key, bytes) or len(key) != _server.KEY_BYTES):
            raise InvalidInputError("exporter sent a malformed ucx-rma offer")
        # One connection per exporter, shared by every view of its shares;
        # the exporter checks this view's key on every transfer.
        peer = _server.client().connect(address, timeout=timeout)
        return View._make(share, path, "", peer=peer, region=(region_id, key))
    from . import _same_node
    from ._descriptors import _rebuild

    fields = payload.get("descriptor")
    if not isinstance(fields, tuple) or not fields:
        raise InvalidInputError("exporter sent a malformed descriptor")
    desc = _rebuild(*fields)
    size = getattr(desc, "size", None)
    # A share of part of a buffer maps the whole buffer and views its part.
    if not isinstance(size, int) or size < share.offset + share.nbytes:
        raise InvalidInputError(f"descriptor is {size if size is not None else '?'} bytes; the share says "
                                f"{share.nbytes} at offset {share.offset}")
    if fds:
        from ._paths import host_fd

        if not isinstance(desc, host_fd.PosixFdBufferDescriptor) or desc.device != "host":
            raise InvalidInputError("exporter sent file descriptors with an offer that is not host memory")
        given = list(fds)
        fds.clear()  # import_host owns them now
        mapped = host_fd.import_host(desc, fds=given)
    else:
        cuda = share.device != "host"
        mapped = _same_node.import_buffer(desc, device=device if cuda else None, readonly=share.readonly and cuda,
                                          timeout=timeout)
    if prefault and share.device == "host":
        from ._paths import host_fd

        try:
            host_fd.prefault(mapped)
        except BaseException:
            mapped.close()
            raise
    return View._make(share, path, "", mapped=mapped)


# ---------------------------------------------------------------- views


class _MappingUse:
    """Who still uses a view's mapping: the view itself and every DLPack
    tensor made from it.  The mapping is unmapped when the last of them lets
    go, never under a live array."""

    __slots__ = ("mapped", "users", "lock")

    def __init__(self, mapped: Any) -> None:
        self.mapped = mapped
        self.users = 1  # the view
        self.lock = threading.Lock()

    def acquire(self) -> None:
        with self.lock:
            if self.mapped is None:
                raise ClosedError("view is closed")
            self.users += 1

    def drop(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users > 0 or self.mapped is None:
                return
            mapped, self.mapped = self.mapped, None
        try:
            mapped.close()
        except BufferError:
            pass  # host arrays still use the mapping: it goes with the last of them
        except GpuShareError as exc:
            warnings.warn(f"unmapping a view failed; leaking it: {exc}", ResourceWarning, 2)


def _dtype_note(share: Share) -> str:
    """What ``view.why`` adds about a dtype the typestr could not carry."""
    if share.dtype_name is None:
        return ""
    if share.dlpack_dtype is not None:
        return (f"; dtype {share.dtype_name} travels as DLPack {share.dlpack_dtype} "
                f"(DLPack consumers see it; NumPy sees {share.typestr} items)")
    return f"; exported as bytes: dtype {share.dtype_name} has no portable form"


class _Pin:
    """Held by a DLPack tensor made from a view: the mapping lives while it does."""

    __slots__ = ("__weakref__",)


def _end_lease(lease: list) -> None:
    """End the view's lease: the exporter revokes what it granted (a ucx-rma
    view's key stops working at once)."""
    for held in lease:
        held.close()
    lease.clear()


def _release_view(use: _MappingUse | None, lease: list) -> None:
    _end_lease(lease)
    if use is not None:
        use.drop()


class View:
    """An open share: made by :func:`gpushare.open`.

    Mapped views (every path but cma and ucx-rma) are zero-copy: host ones expose
    ``__array_interface__`` (``numpy.asarray(view)``), :meth:`memoryview`
    and ``__dlpack__``; CUDA ones ``__cuda_array_interface__`` and
    ``__dlpack__``; all with the exporter's dtype, shape and strides, and
    read-only where the share is.  A cma or ucx-rma view is not mapped: use
    :meth:`get` and :meth:`put`.  Views are context managers, also
    asynchronous ones (``async with``).

    :meth:`close` ends the lease at once, but never unmaps memory that arrays
    made from the view still use: a DLPack tensor keeps the mapping until it
    is released, and an array made through ``__cuda_array_interface__`` (which
    keeps the view object alive) until the view object is gone.

    Attributes
    ----------
    path : str
        The path taken: ``"same-process"``, ``"fabric"``, ``"posix-fd"``,
        ``"cuda-ipc"``, ``"host-fd"``, ``"cma"`` or ``"ucx-rma"``.
    why : str
        One line: why this path, and why not the better ones.
    nbytes : int
        Size of the shared buffer in bytes.
    device : "host" or int
        ``"host"``, or the CUDA device the memory is mapped on in this process
        (an ordinal of this process; for ucx-rma, the exporter's).
    shape : tuple of int
        Array shape as exported.
    typestr : str
        ``__array_interface__`` type string as exported.
    strides : tuple of int or None
        Byte strides of a strided array (``nbytes`` is the span it covers),
        else ``None``.
    share : Share
        The share this view opened.
    """

    share: Share
    path: PathName
    why: str
    nbytes: int
    device: int | Literal["host"]
    shape: tuple[int, ...]
    typestr: str
    strides: tuple[int, ...] | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("View objects are made by gpushare.open")

    @classmethod
    def _make(cls, share: Share, path: str, why: str, *, target: Any = None, mapped: Any = None,
              peer: Any = None, region: tuple[int, bytes] | None = None) -> View:
        self = object.__new__(cls)
        self.share = share
        self.path = path
        self.why = why + _dtype_note(share) if why else why
        self.nbytes = share.nbytes
        self.device = share.device
        if mapped is not None and share.device != "host":
            self.device = int(mapped.memory_resource.device_id)  # this process's ordinal
        self.shape = share.shape
        self.typestr = share.typestr
        self.strides = share.strides
        self._target = target
        self._mapped = mapped
        self._peer = peer
        self._region = region
        self._lease: list = []
        self._closed = False
        self._cai_taken = False
        self._use = _MappingUse(mapped) if mapped is not None else None
        # Mapped host memory: get/put of NumPy arrays take a short path (see _fast_array).
        self._fast_ok = mapped is not None and self.device == "host" and share.strides is None
        self._fast: Any = None
        self._finalizer = weakref.finalize(self, _release_view, self._use, self._lease)
        return self

    def _attach_lease(self, lease: Any, why: str) -> None:
        self._lease.append(lease)
        self.why = why + _dtype_note(self.share)

    # -- state -----------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed or not self._finalizer.alive

    def _check(self) -> None:
        if self.closed:
            raise ClosedError("view is closed")

    def close(self) -> None:
        """End the lease with the exporter, and unmap or disconnect (idempotent).

        Memory that arrays made from the view still use stays mapped until
        the last of them is gone (see the class notes); the view refuses any
        further use at once.
        """
        self._target = None
        self._fast_ok = False
        self._fast = None
        if self._finalizer.alive and not self._closed:
            log.debug("closing the %s view of share %s", self.path, self.share.share_id[:8])
        self._closed = True
        if self._cai_taken and self._finalizer.alive:
            # An array made through __cuda_array_interface__ holds this view,
            # not a count we can see: unmap when the view object goes.
            _end_lease(self._lease)
            return
        self._finalizer()

    def __enter__(self) -> View:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> View:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()  # ends the lease and unmaps: no waiting on anything

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.path
        return f"<gpushare.View {self.nbytes} bytes on {self.device} via {state}>"

    # -- memory ------------------------------------------------------------
    def _local(self) -> _buffers.LocalBuffer:
        """The mapped memory as a local buffer (not for ucx-rma)."""
        self._check()
        if self.path in _types.COPIED_PATHS:
            raise UnsupportedError(f"a {self.path} view is not mapped in this process: use view.get() and view.put()")
        if self._target is not None:
            return _buffers.resolve(_arrays.span_of(self._target)[0], writable=False)
        mapped = self._mapped
        if self.device == "host":
            return _buffers.LocalBuffer(mapped.ptr + self.share.offset, self.nbytes, "host", False, mapped)
        return _buffers.LocalBuffer(int(mapped.handle) + self.share.offset, self.nbytes, "cuda", False, mapped,
                                    device=self.device)

    def memoryview(self) -> memoryview:
        """A writable byte view of mapped host memory."""
        self._check()
        if self.device != "host":
            raise UnsupportedError("memoryview() needs host memory; this view is CUDA memory")
        if self.path in _types.COPIED_PATHS:
            self._local()
        if self._target is not None:
            lb = _buffers.resolve(_arrays.span_of(self._target)[0], writable=False)
            raw = (ctypes.c_char * self.nbytes).from_address(lb.address)
            raw._owner = (self._target, lb)  # the memory lives as long as the view of it
            view = memoryview(raw).cast("B")
        else:
            view = self._mapped.memoryview()[self.share.offset:self.share.offset + self.nbytes]
        return view.toreadonly() if self._read_only() else view

    def __buffer__(self, flags: int) -> memoryview:  # the buffer protocol on Python 3.12+
        return self.memoryview()

    @property
    def __array_interface__(self) -> dict:
        if self.device != "host":
            raise AttributeError("__array_interface__ (this view is CUDA memory; use __cuda_array_interface__)")
        return {"shape": self.shape, "typestr": self.typestr, "data": self.memoryview(), "strides": self.strides,
                "version": 3}

    @property
    def __cuda_array_interface__(self) -> dict:
        if self.device == "host":
            raise AttributeError("__cuda_array_interface__ (this view is host memory)")
        lb = self._local()
        if self._target is None:
            self._cai_taken = True
        # gpushare leaves no work pending on the memory (its copies complete
        # before they return), so consumers need no stream to wait on.
        return {"shape": self.shape, "typestr": self.typestr, "data": (lb.address, self._read_only()),
                "version": 3, "strides": None, "stream": None}

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        """A DLPack capsule of the mapped memory (host or CUDA), with the
        share's dtype and shape; read-only (DLPack 1.0) for a read-only share.
        The mapping stays until the consumer releases the tensor, even past
        :meth:`close`.  ``stream`` needs no ordering: gpushare leaves no work
        pending.  ``numpy.from_dlpack(view)`` and ``torch.from_dlpack(view)``
        take it without a copy."""
        from . import _dlpack

        self._check()
        if self.path in _types.COPIED_PATHS:
            raise UnsupportedError(f"a {self.path} view is not mapped in this process: use view.get() and view.put()")
        if copy is True:
            raise BufferError("a view exports its memory without copying (copy=True is not supported)")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"the memory is on {self.__dlpack_device__()}, not {tuple(dl_device)}")
        lb = self._local()
        if self._target is not None:
            if self.device != "host":
                return self._target.__dlpack__(stream=stream, max_version=max_version)
            owner: Any = (self._target, lb)  # the exporter's own object keeps the memory
        else:
            owner = _Pin()
            self._use.acquire()
            weakref.finalize(owner, self._use.drop)
        return _dlpack.capsule(lb.address, self.shape, self.typestr, self.__dlpack_device__(),
                               readonly=self._read_only(), owner=owner, max_version=max_version,
                               dl_dtype=self.share.dlpack_dtype, strides=self.strides)

    def __dlpack_device__(self) -> tuple[int, int]:
        if self.device == "host":
            return (1, 0)
        return (2, int(self.device))

    # -- copies ------------------------------------------------------------
    def _read_only(self) -> bool:
        """Read-only here: the share is, or the mapping is (a sealed buffer)."""
        return self.share.readonly or bool(getattr(self._mapped, "readonly", False))

    def _check_writable(self) -> None:
        if self.share.readonly:
            raise InvalidInputError("this share is read-only: its exporter allows get, not put")
        if getattr(self._mapped, "readonly", False):
            raise InvalidInputError("this view's memory is mapped read-only (the exporter sealed the buffer)")

    def _span(self, buf: Any, offset: Any, writable: bool, stream: Any = None) -> tuple[_buffers.LocalBuffer, int]:
        """``buf`` resolved and checked against the view (its state, the
        bounds at ``offset``, the memory a path can copy to and from)."""
        self._check()
        if self.strides is not None:
            raise UnsupportedError(f"this share is a strided array (strides {self.strides}): its bytes are not "
                                   "its elements, so get/put refuse it; use numpy.asarray(view) or DLPack")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise InvalidInputError(f"offset must be a non-negative int, not {offset!r}")
        local = _buffers.resolve(buf, writable=writable, stream=stream)
        if self.path == "cma" and local.memory_type != "host":
            local.release()
            raise UnsupportedError("a cma view copies to and from host memory only; stage CUDA memory on the host")
        if offset + local.nbytes > self.nbytes:
            local.release()
            raise OutOfBoundsError(
                f"{local.nbytes} bytes at offset {offset} run past the shared {self.nbytes} bytes"
            )
        return local, offset

    def _host_span(self, buf: Any, offset: Any) -> bool:
        """What :meth:`_span` checks for a NumPy array or a byte buffer
        within bounds, without resolving it (the ucx-rma path pins it
        itself, and says what is wrong with one it cannot use).  False for
        anything else: :meth:`_span` checks it."""
        n = _buffers.plain_host_nbytes(buf)
        if n is None or self._closed or self.strides is not None or type(offset) is not int or not 0 <= offset <= self.nbytes - n:
            return False
        return True

    def _fast_copy(self, buf: Any, offset: Any, get: bool) -> bool:
        """Copy between a mapped host view and a C-contiguous NumPy array
        within bounds with ``numpy.copyto``: a few microseconds a call less
        than the general path, and faster than libc's memmove for large
        copies.  False (nothing done) for anything else: the general path
        checks it and says what is wrong."""
        np_ = sys.modules.get("numpy")
        if (not self._fast_ok or self._closed or np_ is None or type(buf) is not np_.ndarray
                or type(offset) is not int):
            return False
        flags = buf.flags
        n = buf.nbytes
        if not flags.c_contiguous or (get and not flags.writeable) or not 0 <= offset <= self.nbytes - n:
            return False
        shared = self._fast
        if shared is None:
            raw = (ctypes.c_uint8 * self.nbytes).from_address(self._mapped.ptr + self.share.offset)
            shared = self._fast = np_.ctypeslib.as_array(raw)
        mine = buf if buf.dtype == np_.uint8 and buf.ndim == 1 else buf.reshape(-1).view(np_.uint8)
        if get:
            np_.copyto(mine, shared[offset:offset + n])
        else:
            np_.copyto(shared[offset:offset + n], mine)
        return True

    def _cma(self, buf: Any, offset: int, direction: str) -> Any:
        """Ask the exporter to copy between ``buf`` and the share (cma path):
        a request (``buf`` stays pinned until the copy ends), or ``None`` when
        there is nothing to copy, as for :meth:`_copy`."""
        local, offset = self._span(buf, offset, direction == "get")
        if local.nbytes == 0:
            local.release()
            return None
        return self._peer.copy(direction, offset, local)

    def _copy(self, buf: Any, offset: int, direction: str, stream: Any) -> Any:
        """Start a copy between ``buf`` and the mapped memory; a request for
        CUDA copies, ``None`` when the copy is already done."""
        from ._paths import _cuda

        handle = _cuda.stream_handle(stream)
        # A DLPack producer orders its pending work before the copy's stream.
        consumer = handle if handle is not None else _cuda.LEGACY_STREAM
        local, offset = self._span(buf, offset, direction == "get", consumer)
        try:
            shared = self._local()
            if direction == "get":
                src, dst = shared.address + offset, local.address
            else:
                src, dst = local.address, shared.address + offset
            if local.nbytes == 0:
                local.release()
                return None
            if local.memory_type == "host" and shared.memory_type == "host":
                ctypes.memmove(dst, src, local.nbytes)
                local.release()
                return None
            return self._cuda_copy(local, shared, src, dst, handle, direction)
        except BaseException:
            local.release()
            raise

    def _cuda_copy(self, local: _buffers.LocalBuffer, shared: _buffers.LocalBuffer, src: int, dst: int,
                   stream: int | None, direction: str) -> Any:
        from ._paths import _cuda

        ordinal = _cuda.stream_ordinal(stream) if stream is not None else None
        if ordinal is None:
            ordinal = local.device if local.memory_type == "cuda" and local.device is not None else shared.device
        if ordinal is None:
            ordinal = _cuda.pointer_ordinal(local.address)
        grant = getattr(getattr(self._mapped, "memory_resource", None), "grant", None)
        if grant is not None and ordinal != self.device:
            grant(ordinal)  # the copy runs on another device: it needs access too
        what = f"copy {'from' if direction == 'get' else 'to'} the shared CUDA memory"
        return _cuda.copy_async(dst, src, local.nbytes, ordinal=ordinal, stream=stream,
                                producer=local.stream, keep=local, what=what)

    def get(self, dst: Any, offset: int = 0, *, stream: Any = None, timeout: float | None = 60.0) -> None:
        """Copy ``len(dst)`` bytes from the shared memory at ``offset`` into ``dst``.

        Parameters
        ----------
        dst
            Host or CUDA memory (any buffer :func:`gpushare.export` takes),
            C-contiguous and writable.
        offset : int
            Byte offset into the shared memory.
        stream : optional
            For CUDA memory: the stream to order the copy on (a cuda.core
            ``Stream``, a CuPy or torch stream, or a raw handle).  By default
            the stream ``dst`` names (``__cuda_array_interface__``'s
            ``stream``, or DLPack's), else the legacy default stream; either
            way the copy runs after the work already queued there.
        timeout : float or None
            Seconds to wait; :class:`WaitTimeoutError` when they pass (the
            copy stays in flight and ``dst`` in use until it completes).
            Whatever the timeout, a copy the exporter serves (cma, ucx-rma)
            ends with :class:`ExporterUnreachableError` once the exporter
            has left a sign-of-life request unanswered for
            ``GPUSHARE_PEER_TIMEOUT`` seconds (default 3; about 4 s after it
            stopped, froze or was cut off).

        The bytes are in ``dst`` when this returns.
        """
        self._move(dst, offset, "get", stream, timeout)

    def put(self, src: Any, offset: int = 0, *, stream: Any = None, timeout: float | None = 60.0) -> None:
        """Copy ``src`` into the shared memory at ``offset``.

        Arguments as for :meth:`get`.  When this returns the bytes are in the
        shared memory and visible to every process that maps it (CUDA copies
        are synchronised; a ucx-rma put completes once the exporter has the
        bytes in its memory).
        """
        self._check_writable()
        self._move(src, offset, "put", stream, timeout)

    def _move(self, buf: Any, offset: int, direction: str, stream: Any, timeout: float | None) -> None:
        """One get or put on this view's path, waited for."""
        get = direction == "get"
        if stream is None and self._fast_copy(buf, offset, get):
            return
        if self.path == "ucx-rma":
            if not self._host_span(buf, offset):
                self._span(buf, offset, get)[0].release()  # checks bounds and the buffer
            try:
                # CUDA memory: after the work queued on ``stream`` or the
                # buffer's own stream (the legacy one when none is named).
                (self._peer.get if get else self._peer.put)(
                    *self._region, offset, buf, timeout, alive=self._lease[0] if self._lease else None,
                    stream=stream)
            except (UCXConnectionError, ClosedError) as exc:
                _raise_rma_error(self.share, exc)
            return
        if self.path == "cma":
            request = self._cma(buf, offset, direction)
        else:
            request = self._copy(buf, offset, direction, stream)
        if request is not None:
            request.wait(timeout)

    async def get_async(self, dst: Any, offset: int = 0, *, stream: Any = None,
                        timeout: float | None = None) -> None:
        """:meth:`get` for asyncio: awaits the transfer without blocking the
        loop.  CUDA copies are queued on the stream and their completion
        awaited (no thread); host copies run in a worker thread.
        :class:`WaitTimeoutError` after ``timeout`` seconds."""
        await _with_timeout(self._transfer(dst, offset, "get", stream), timeout)

    async def put_async(self, src: Any, offset: int = 0, *, stream: Any = None,
                        timeout: float | None = None) -> None:
        """:meth:`put` for asyncio; done when the bytes are visible to every
        process that maps the memory (remote puts are flushed)."""
        self._check_writable()
        await _with_timeout(self._transfer(src, offset, "put", stream), timeout)

    async def _transfer(self, buf: Any, offset: int, direction: str, stream: Any) -> None:
        if self.path == "ucx-rma":
            handle = _device.consumer_stream(stream)
            local, _ = self._span(buf, offset, direction == "get", _cuda.LEGACY_STREAM if handle is None else handle)
            try:
                # CUDA memory: the producer's work drains first without
                # blocking the loop (the post below then waits for nothing).
                await _device.order_before_async(local, handle)
            finally:
                local.release()
            post = self._peer.get_async if direction == "get" else self._peer.put_async
            try:
                # Liveness as for the blocking calls: a frozen exporter ends the wait.
                await await_alive(post(*self._region, offset, buf, stream=stream),
                                  self._lease[0] if self._lease else None)
            except (UCXConnectionError, ClosedError) as exc:
                _raise_rma_error(self.share, exc)
            return
        if self.path == "cma":
            request = self._cma(buf, offset, direction)
            if request is not None:
                await request
            return
        if self.device == "host" and stream is None:
            request = await asyncio.to_thread(self._copy, buf, offset, direction, None)
        else:
            request = self._copy(buf, offset, direction, stream)
        if request is not None:
            await request


async def _with_timeout(transfer: Any, timeout: float | None) -> None:
    if timeout is None:
        await transfer
        return
    try:
        await asyncio.wait_for(transfer, timeout)
    except TimeoutError:
        raise WaitTimeoutError(f"the transfer did not complete within {timeout} s; it stays in flight") from None
