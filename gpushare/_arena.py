"""An allocator over shareable memory: :class:`Arena`.

Many tensors' memory carved out of few :func:`gpushare.allocate` buffers
(*chunks*), so that every array it hands out is shareable the fast way
(host-fd on host memory; posix-fd and fabric on CUDA memory) and a bundle of
a model's tensors needs one offer per chunk, not one per tensor.  A freed
block goes back to its chunk's free list (first fit, neighbours merged);
chunks are kept until :meth:`Arena.close`.  For CuPy, :meth:`Arena.cupy_malloc`
is an allocator for ``cupy.cuda.set_allocator`` (or ``cupy.cuda.MemoryPool``);
for torch, :meth:`Arena.torch_mem_pool` is a ``torch.cuda.MemPool`` over the
arena (:mod:`gpushare._torch_alloc`).
"""

from __future__ import annotations

import bisect
import ctypes
import sys
import threading
import weakref
from typing import Any

import numpy as np

from . import _torch_alloc, _types
from ._arrays import CudaArray, check_shape, nbytes_of, portable_typestr
from ._errors import ClosedError, InvalidInputError
from ._by_descriptor import allocate

__all__ = ["Arena"]

#: Where blocks start: enough for every dtype and for vectorised kernels.
ALIGNMENT = 256


class _Chunk:
    __slots__ = ("buffer", "address", "size", "free")

    def __init__(self, buffer: Any, address: int, size: int) -> None:
        self.buffer, self.address, self.size = buffer, address, size
        self.free: list[tuple[int, int]] = [(0, size)]  # (offset, size), sorted by offset

    def take(self, n: int) -> int | None:
        """Offset of ``n`` free bytes (first fit), or None."""
        for i, (offset, size) in enumerate(self.free):
            if size >= n:
                if size == n:
                    del self.free[i]
                else:
                    self.free[i] = (offset + n, size - n)
                return offset
        return None

    def give(self, offset: int, n: int) -> None:
        """Return ``n`` bytes at ``offset``, merged with free neighbours."""
        i = bisect.bisect(self.free, (offset, n))
        if i < len(self.free) and offset + n == self.free[i][0]:
            n += self.free[i][1]
            del self.free[i]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == offset:
            offset, n = self.free[i - 1][0], self.free[i - 1][1] + n
            i -= 1
            del self.free[i]
        self.free.insert(i, (offset, n))


class Block:
    """``nbytes`` bytes of an arena's chunk at ``address``: given back when
    the block object is gone (or at :meth:`release`)."""

    __slots__ = ("address", "nbytes", "chunk", "_finalizer", "__weakref__")

    def __init__(self, arena: Arena, chunk: _Chunk, offset: int, nbytes: int, size: int) -> None:
        self.address = chunk.address + offset
        self.nbytes = nbytes
        self.chunk = chunk.buffer  # the memory lives while a block of it does
        self._finalizer = weakref.finalize(self, arena._give, chunk, offset, size)

    def release(self) -> None:
        self._finalizer()


class Arena:
    """Shareable memory for many arrays, in few :func:`gpushare.allocate`
    buffers.

    Arrays from :meth:`empty` (CuPy arrays, with :meth:`cupy_malloc` as
    CuPy's allocator, and torch tensors made under
    ``torch.cuda.use_mem_pool(arena.torch_mem_pool())``) lie in the arena's
    chunks: :func:`gpushare.export` offers each on every path of its chunk
    (posix-fd and fabric for CUDA memory) with its offset, and a bundle of
    them has one offer per chunk.  A block goes back to the arena when its
    array is gone (a torch segment, when torch gives it back).

    Parameters
    ----------
    device : "host" or int, default "host"
        Host memory (memfds), or CUDA virtual memory of that device.
    chunk_size : int, default 64 MiB
        Bytes of each buffer the arena allocates; a larger request gets a
        buffer of its own size.
    """

    def __init__(self, device: _types.Device = "host", *, chunk_size: int = 64 << 20) -> None:
        if _types.is_host(device):
            device = "host"
        elif isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise InvalidInputError(f"device is {device!r}; expected 'host' (or 'cpu') or a CUDA device ordinal")
        self.device: int | str = device
        self.chunk_size = _types.in_range(chunk_size, "chunk_size", 1, 1 << 48)
        self._chunks: list[_Chunk] = []
        self._lock = threading.Lock()
        self._closed = False
        self.in_use = 0  # bytes handed out and not given back
        self._torch_allocator: Any = None  # torch_allocator()'s, made once

    # -- blocks -------------------------------------------------------------
    def allocate(self, nbytes: int) -> Block:
        """A block of at least ``nbytes`` bytes (``ALIGNMENT``-aligned)."""
        nbytes = _types.in_range(nbytes, "nbytes", 0, 1 << 56)
        size = max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)
        with self._lock:
            if self._closed:
                raise ClosedError("the arena is closed")
            for chunk in self._chunks:
                offset = chunk.take(size)
                if offset is not None:
                    break
            else:
                chunk = self._new_chunk(max(size, self.chunk_size))
                offset = chunk.take(size)
                if offset is None:  # a new chunk of at least ``size`` bytes always has room
                    raise RuntimeError(f"a new chunk of {chunk.size} bytes has no room for {size}")
            self.in_use += size
        return Block(self, chunk, offset, nbytes, size)

    def _new_chunk(self, size: int) -> _Chunk:
        buffer = allocate(size, device=self.device)
        address = buffer.ptr if self.device == "host" else int(buffer.handle)
        chunk = _Chunk(buffer, address, size)
        self._chunks.append(chunk)
        return chunk

    def _give(self, chunk: _Chunk, offset: int, size: int) -> None:
        with self._lock:
            chunk.give(offset, size)
            self.in_use -= size

    # -- arrays -------------------------------------------------------------
    def empty(self, shape: Any, dtype: Any = "float64") -> Any:
        """An uninitialised array in the arena: NumPy for host memory, a
        :class:`gpushare.CudaArray` for CUDA memory (``cupy.asarray`` and
        ``torch.from_dlpack`` take it without a copy)."""
        dims = check_shape(shape)
        typestr = portable_typestr(dtype)
        block = self.allocate(nbytes_of(dims, typestr))
        if self.device == "host":
            raw = (ctypes.c_uint8 * max(block.nbytes, 1)).from_address(block.address)
            raw._block = block  # type: ignore[attr-defined]  # the block lives while an array over it does
            return np.ctypeslib.as_array(raw)[:block.nbytes].view(np.dtype(typestr)).reshape(dims)
        return CudaArray._make(block, block.address, dims, typestr, int(self.device))

    def cupy_malloc(self, nbytes: int) -> Any:
        """An allocator for CuPy: ``cupy.cuda.set_allocator(arena.cupy_malloc)``
        (CUDA arenas, on the device CuPy allocates on)."""
        cupy = sys.modules.get("cupy")
        if cupy is None:
            raise InvalidInputError("cupy_malloc is CuPy's allocator: import cupy first")
        if self.device == "host":
            raise InvalidInputError("cupy_malloc needs an arena of CUDA memory (Arena(device=N))")
        block = self.allocate(nbytes)
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(block.address, max(nbytes, 1), block,
                                                               int(self.device)), 0)

    def torch_allocator(self) -> Any:
        """torch's pluggable allocator over this arena (CUDA arenas): a
        ``torch.cuda.memory.CUDAPluggableAllocator`` whose segments come out
        of the arena's chunks, for :meth:`torch_mem_pool` (or
        ``torch.cuda.memory.change_current_allocator``, before torch's first
        CUDA allocation, for every tensor of the process).  One arena serves
        torch on each device: a request for another device, or one the arena
        cannot serve (closed, out of memory), is NULL to torch, which raises
        its out-of-memory error, and is logged on ``gpushare.torch``.  Import
        torch first (before gpushare, for ucx-rma: docs/ucx.md)."""
        torch = sys.modules.get("torch")
        if torch is None:
            raise InvalidInputError("torch_allocator and torch_mem_pool are torch's: import torch first")
        if self.device == "host":
            raise InvalidInputError("torch_allocator and torch_mem_pool need an arena of CUDA memory "
                                    "(Arena(device=N))")
        if self._closed:
            raise ClosedError("the arena is closed")
        if self._torch_allocator is None:
            self._torch_allocator = _torch_alloc.allocator(self, torch)
        return self._torch_allocator

    def torch_mem_pool(self, **options: Any) -> Any:
        """A ``torch.cuda.MemPool`` whose memory comes from this arena (CUDA
        arenas): tensors made under ``torch.cuda.use_mem_pool(pool)`` lie in
        the arena's chunks, so :func:`gpushare.export` offers them on
        posix-fd and fabric with their offsets, and a bundle of a model's
        tensors has one offer per chunk.  torch's caching allocator takes
        segments from the arena (:meth:`torch_allocator`) and hands out
        tensors inside them; ``options`` go to ``MemPool`` (``use_on_oom``,
        ``no_split``).  Keep the pool and the arena while tensors of it live."""
        allocator = self.torch_allocator()
        return sys.modules["torch"].cuda.MemPool(allocator.allocator(), **options)

    # -- state --------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def stats(self) -> dict[str, int]:
        """Chunks, their bytes, and the bytes handed out."""
        with self._lock:
            return {"chunks": len(self._chunks), "bytes": sum(c.size for c in self._chunks),
                    "in_use": self.in_use}

    def close(self) -> None:
        """Let go of the chunks (a chunk stays while an array of it lives);
        torch's requests to the arena are NULL from now on."""
        with self._lock:
            self._closed = True
            self._chunks = []

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats()
        return f"<gpushare.Arena {self.device}: {s['chunks']} chunks, {s['in_use']} of {s['bytes']} bytes in use>"
