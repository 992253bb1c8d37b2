"""torch's pluggable allocator over :class:`gpushare.Arena` memory.

``torch.cuda.memory.CUDAPluggableAllocator`` loads a shared library and
calls its allocation and release functions for each segment torch's caching
allocator takes and gives back.  gpushare's library
(``libgpushare_torch_alloc.so``, built beside the native module from
``src/torch/allocator.cpp``) forwards both to the callbacks here, which
carve segments out of the arena that serves the device; so every tensor of
a ``torch.cuda.MemPool`` over it lies in a :func:`gpushare.allocate` buffer,
and :func:`gpushare.export` offers it on posix-fd and fabric with its offset.

The library has one pair of entry points for the process: one arena serves
each device.  A failure in a callback returns NULL to torch (which raises
its out-of-memory error) and is logged; it never raises into torch.  The
callbacks are kept for the life of the process, and unhooked at exit (before
the interpreter goes), after which the library answers NULL and lets frees
be: torch may give segments back while the process ends.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import logging
import os
import threading
from typing import Any

from ._errors import InvalidInputError, UnsupportedError

__all__ = ["ALLOC", "FREE", "LIBRARY", "allocator", "library_path", "serve", "served"]

log = logging.getLogger("gpushare.torch")

#: The library's file name, next to the native module.
LIBRARY = "libgpushare_torch_alloc.so"
#: Its entry points, as torch's ``CUDAPluggableAllocator`` names them.
ALLOC, FREE = "gpushare_torch_malloc", "gpushare_torch_free"

_AllocFn = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_FreeFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)


def library_path() -> str:
    """Where the library is (found without importing the native module)."""
    spec = importlib.util.find_spec("gpushare._ucx._native")
    if spec is None or spec.origin is None:
        raise UnsupportedError("gpushare's native module is not built, and the torch allocator is built with it")
    path = os.path.join(os.path.dirname(spec.origin), LIBRARY)
    if not os.path.isfile(path):
        raise UnsupportedError(f"{LIBRARY} is not beside gpushare's native module ({path}): reinstall gpushare")
    return path


class _Server:
    """The arenas that serve torch, by device, and the segments handed out."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.arenas: dict[int, Any] = {}
        self.blocks: dict[int, Any] = {}  # address -> the arena block torch holds
        self.library: ctypes.CDLL | None = None
        self.hooks: tuple[Any, ...] = ()  # the ctypes callbacks, kept alive here for the process
        self.hooked = False

    def serve(self, arena: Any) -> str:
        path = library_path()
        with self.lock:
            current = self.arenas.get(arena.device)
            if current is not None and current is not arena and not current.closed:
                raise InvalidInputError(f"another gs.Arena already serves torch on device {arena.device} "
                                        "(one arena per device): use its torch_mem_pool(), or close it first")
            self.arenas[arena.device] = arena
            if self.library is None:
                library = ctypes.CDLL(path)
                library.gpushare_torch_set_hooks.argtypes = [_AllocFn, _FreeFn]
                library.gpushare_torch_set_hooks.restype = None
                self.library, self.hooks = library, (_AllocFn(self._alloc), _FreeFn(self._free))
                atexit.register(self.unhook)
            if not self.hooked:
                self.library.gpushare_torch_set_hooks(*self.hooks)
                self.hooked = True
        return path

    def unhook(self) -> None:
        """At exit: the library answers NULL and drops frees from now on (the
        callbacks themselves stay alive, for a call already in them)."""
        with self.lock:
            if self.library is not None and self.hooked:
                self.library.gpushare_torch_set_hooks(_AllocFn(), _FreeFn())  # NULL: unhooked
                self.hooked = False

    def _alloc(self, size: int, device: int, stream: Any) -> int | None:
        try:
            arena = self.arenas.get(device)
            if arena is None:
                log.error("torch asked for %d bytes on device %d, which no gs.Arena serves", size, device)
                return None
            block = arena.allocate(size)
            with self.lock:
                self.blocks[block.address] = block
            return block.address
        except BaseException as exc:  # noqa: BLE001 - torch gets NULL, never an exception
            log.error("torch's allocation of %d bytes on device %d failed: %s", size, device, exc)
            return None

    def _free(self, ptr: int | None, size: int, device: int, stream: Any) -> None:
        try:
            with self.lock:
                block = self.blocks.pop(ptr or 0, None)
            if block is None:
                log.error("torch gave back %#x (%d bytes, device %d), which gpushare did not hand out", ptr or 0,
                          size, device)
                return
            block.release()
        except BaseException as exc:  # noqa: BLE001 - nothing may raise into torch
            log.error("giving back torch's segment %#x failed: %s", ptr or 0, exc)

    def served(self) -> int:
        with self.lock:
            return len(self.blocks)


_SERVER = _Server()


def serve(arena: Any) -> str:
    """Let ``arena`` (of CUDA memory) serve torch's allocations on its
    device; returns the library's path for ``CUDAPluggableAllocator``."""
    return _SERVER.serve(arena)


def served() -> int:
    """Segments torch holds from the arenas now."""
    return _SERVER.served()


def allocator(arena: Any, torch: Any) -> Any:
    """A ``torch.cuda.memory.CUDAPluggableAllocator`` over ``arena``."""
    if not hasattr(torch._C, "_cuda_customAllocator"):
        raise UnsupportedError(f"torch {torch.__version__} is built without CUDA: its pluggable allocator "
                               "needs the CUDA build of torch")
    path = serve(arena)
    return torch.cuda.memory.CUDAPluggableAllocator(path, ALLOC, FREE)
