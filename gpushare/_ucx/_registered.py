"""Memory registered with UCX (:class:`MemoryHandle`) and a peer's remote
key to its memory (:class:`RemoteKey`), for the Agent API of
:mod:`gpushare.ucx`."""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

from .. import _buffers
from .._cuda import _driver as _cuda
from .._errors import ClosedError, GpuShareError, InvalidInputError
from . import _device
from ._common import KEY_MAGIC, MEMORY_TYPE_CODES, pack, report_callback_error
from ._loader import native

if TYPE_CHECKING:
    from ._agent import Agent, Endpoint

__all__ = ["MemoryHandle", "RemoteKey"]


def _free_allocated(nmh: Any, ordinal: int | None) -> None:
    """Unregister memory UCX allocated, which frees it: CUDA memory under its
    device's primary context (``cuMemFree`` needs a current context; the
    finalizer may run in any thread)."""
    if ordinal is None:
        nmh.close()
        return
    try:
        with _device.on_memory_device(None, ordinal):
            nmh.close()
    except GpuShareError:  # the driver refused the context: free what can be freed
        report_callback_error("memory handle close")
        nmh.close()


def _alloc_ordinal() -> int:
    """The device UCX allocates CUDA memory on: the calling thread's current
    one, else device 0."""
    current = _cuda.current_ordinal()
    return 0 if current is None else current


class RemoteKey:
    """A remote key: the capability to read and write one registered region.

    Two kinds exist.  A *local* key comes from
    :meth:`MemoryHandle.create_remote_key` and is serialized with
    :meth:`serialize` to be sent to a peer.  A *remote* key comes from
    :meth:`Endpoint.unpack_remote_key` and is used in puts and gets on that
    endpoint.  Both report the region: :attr:`base_address` and :attr:`size`.
    """

    __slots__ = ("_native", "_blob", "_base", "_size", "_memory_type", "_endpoint", "_closed", "__weakref__")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "RemoteKey objects are made by MemoryHandle.create_remote_key and Endpoint.unpack_remote_key"
        )

    @classmethod
    def _make(cls, *, native_key: Any, blob: bytes | None, base: int, size: int, memory_type: str,
              endpoint: Endpoint | None) -> RemoteKey:
        self = object.__new__(cls)
        self._native = native_key
        self._blob = blob
        self._base = base
        self._size = size
        self._memory_type = memory_type
        self._endpoint = endpoint
        self._closed = False
        return self

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("remote key is closed")

    @property
    def is_remote(self) -> bool:
        """Whether this key was unpacked for an endpoint (usable in put/get)."""
        return self._endpoint is not None

    @property
    def handle(self) -> int:
        """The ``ucp_rkey_h`` as an integer (0 for a local, packed key)."""
        self._check_open()
        if self._native is None:
            return 0
        return self._native.handle

    @property
    def size(self) -> int:
        """Size in bytes of the region the key covers."""
        self._check_open()
        return self._size

    @property
    def base_address(self) -> int:
        """Address, in the exporter's process, of the region's first byte."""
        self._check_open()
        return self._base

    @property
    def memory_type(self) -> str:
        """``"host"`` or ``"cuda"``: where the region lives in the exporter."""
        return self._memory_type

    def serialize(self) -> bytes:
        """Return the key as bytes to send to a peer over any transport."""
        self._check_open()
        if self._blob is None:
            raise InvalidInputError("a remote key unpacked for an endpoint cannot be serialized again")
        return self._blob

    def close(self) -> None:
        """Release the key (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._native is not None:
            self._native.close()

    def __enter__(self) -> RemoteKey:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "remote" if self.is_remote else "local"
        return f"<gpushare.ucx.RemoteKey {kind} base=0x{self._base:x} size={self._size}>"


def zero_unused(lock: threading.Lock, zero_later: list) -> None:
    """Replace by zero pages the memory of closed handles that this
    process's transfers no longer use (see :func:`_park`)."""
    with lock:
        ready = [item for item in zero_later if not item[0].in_use()]
        for item in ready:
            zero_later.remove(item)
    for _, addr, length in ready:
        native().quarantine(addr, length)


def _park(pid: int, quarantine: list, zero_later: list, lock: threading.Lock, nmh: Any, resources: tuple) -> None:
    """Unregister a memory handle, keeping its memory reserved until agent close.

    UCX does not stop a peer that still holds a key from writing into the
    region after it is unregistered (on TCP and shared memory nothing checks).
    So the memory is never handed back to the allocator while the worker can
    still receive: host memory gpushare allocated is replaced by fresh zero
    pages (a stale write lands nowhere useful, a stale read sees zeros), a
    user's buffer stays referenced, and memory UCX allocated stays registered.
    This process's own transfers still using the memory keep the handle
    registered and its bytes in place until they are done: its zero pages
    then come at the agent's next transfer or handle close (``zero_later``),
    never under a transfer, and nothing here waits.
    """
    if os.getpid() != pid:
        return  # a forked child: the parent's UCX state is not ours to touch
    addr, length, mm, local, ordinal = resources
    if mm is None and local is None:
        # Memory UCX allocated (CUDA): unregistering would free it, so the
        # whole handle waits for the agent's close.
        with lock:
            quarantine.append((None, None, nmh, ordinal))
        return
    try:
        nmh.close()  # no new transfer takes it
    except Exception:  # noqa: BLE001
        report_callback_error("memory handle close")
    with lock:
        quarantine.append((mm, local, None, None))
        if mm is not None:
            zero_later.append((nmh, addr, length))
    zero_unused(lock, zero_later)


class MemoryHandle:
    """A registered memory region other processes can access with a remote key.

    Made by :meth:`Agent.create_memory_handle`; mirrors ``ucxx::MemoryHandle``.
    """

    __slots__ = ("_native", "_agent", "_local", "_mm", "_finalizer", "_memory_type", "_ordinal", "_range",
                 "__weakref__")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("MemoryHandle objects are made by Agent.create_memory_handle")

    @classmethod
    def _make(cls, agent: Agent, nmh: Any, local: _buffers.LocalBuffer | None, mm: mmap.mmap | None,
              memory_type: str, ordinal: int | None) -> MemoryHandle:
        self = object.__new__(cls)
        self._native = nmh
        self._agent = agent
        self._local = local
        self._mm = mm
        self._memory_type = memory_type
        self._ordinal = ordinal  # the device of CUDA memory
        addr = nmh.base_address
        length = len(mm) if mm is not None else nmh.size
        self._range = (addr, addr + nmh.size)
        self._finalizer = weakref.finalize(
            self, _park, agent._pid, agent._quarantine, agent._zero_later, agent._lock, nmh,
            (addr, length, mm, local, ordinal)
        )
        return self

    def _covering(self, address: int, nbytes: int, memory_type: str) -> Any:
        """The native handle, if this open handle registers all of
        ``[address, address + nbytes)`` as ``memory_type`` memory; else None."""
        lo, hi = self._range
        if lo <= address and address + nbytes <= hi and memory_type == self._memory_type and self._finalizer.alive:
            return self._native
        return None

    def _check_open(self) -> Any:
        if not self._finalizer.alive:
            raise ClosedError("memory handle is closed")
        self._agent._check_usable()
        return self._native

    @property
    def handle(self) -> int:
        """The ``ucp_mem_h`` as an integer."""
        n = self._check_open()
        return n.handle

    @property
    def size(self) -> int:
        """Registered size in bytes (at least what was asked for)."""
        n = self._check_open()
        return n.size

    @property
    def base_address(self) -> int:
        """Address of the region's first byte; remote puts/gets target it."""
        n = self._check_open()
        return n.base_address

    @property
    def memory_type(self) -> str:
        """``"host"`` or ``"cuda"``."""
        self._check_open()
        return self._memory_type

    @property
    def buffer(self) -> Any:
        """The memory: the object passed in, or a writable ``memoryview`` of
        host memory gpushare allocated (``None`` for UCX-allocated CUDA memory)."""
        self._check_open()
        if self._mm is not None:
            return memoryview(self._mm)[: self.size]
        return self._local.owner if self._local is not None else None

    def create_remote_key(self) -> RemoteKey:
        """Pack a remote key for this region; send ``key.serialize()`` to peers."""
        n = self._check_open()
        # Packing for a CUDA transport (cuda_ipc, where asked for) asks the
        # driver about the memory under its device's context.
        with _device.on_memory_device(None, self._ordinal):
            blob = n.pack_remote_key()
            base, size = native().serialized_remote_key_range(blob)
        packed = pack(KEY_MAGIC, MEMORY_TYPE_CODES[self._memory_type], blob)
        return RemoteKey._make(native_key=None, blob=packed, base=base, size=size,
                               memory_type=self._memory_type, endpoint=None)

    def close(self) -> None:
        """Unregister the region (idempotent).

        Peers lose access from gpushare's point of view; the memory itself is
        kept reserved until the agent closes (see the class notes in
        ``docs/ucx.md``), so a stale key can never corrupt reused memory.
        Host memory gpushare allocated reads as zeros from then on, except
        under this process's own puts and gets still using it: those keep
        the registration and the bytes until they are done (the zeros come
        at the agent's next transfer or handle close after that).  Never
        waits.
        """
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> MemoryHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<gpushare.ucx.MemoryHandle closed>"
        return f"<gpushare.ucx.MemoryHandle {self._memory_type} base=0x{self._native.base_address:x} size={self._native.size}>"
