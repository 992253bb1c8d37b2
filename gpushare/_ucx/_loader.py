"""Load the native module once, after the UCX libraries it links to."""

from __future__ import annotations

import ctypes
import functools
import os
import types
from typing import Any

__all__ = ["native", "keep_forever", "infiniband_present", "choose_hook_mode"]


def infiniband_present() -> bool:
    """Whether this node has InfiniBand or RoCE devices."""
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def choose_hook_mode() -> None:
    """Pick how UCX hooks mmap/munmap, before its libraries load.

    UCX's default (``bistro``) rewrites the first bytes of eight libc
    functions while the process runs, and waits 50 ms after each so that a
    thread inside them can leave: 0.4 s per process, and a thread preempted
    there for longer would run half-rewritten code.  ``reloc`` patches the
    functions' entries in every library's relocation table instead: an
    atomic pointer write, no wait.  Its one weakness is that calls that do
    not go through the relocation table (libc calling its own ``munmap``)
    raise no event, and only a registration cache of host memory consumes
    those events: on this UCX that is InfiniBand/RoCE's.  TCP registers
    nothing and ``cuda_copy`` caches no host registrations.  So without such
    devices gpushare asks for ``reloc``; with them it keeps UCX's default.
    ``UCX_MEM_MMAP_HOOK_MODE`` in the environment wins.  Set in the
    environment, the choice is inherited by child processes on this node,
    which would make the same one."""
    if "UCX_MEM_MMAP_HOOK_MODE" not in os.environ and not infiniband_present():
        os.environ["UCX_MEM_MMAP_HOOK_MODE"] = "reloc"


@functools.cache
def native() -> types.ModuleType:
    """Return ``gpushare._ucx._native``, loading libucx/libucxx from their wheels first."""
    try:
        import libucxx
    except ImportError as exc:  # pragma: no cover - a broken install
        raise ImportError(
            "gpushare.ucx needs the 'libucxx-cu13' package (pip install libucxx-cu13==0.52.*)"
        ) from exc
    choose_hook_mode()
    libucxx.load_library()
    from . import _native

    return _native


def keep_forever(obj: Any) -> None:
    """Never destroy native object ``obj`` in this process, not even when
    the interpreter exits and clears its modules.  For a forked child: its
    parent's UCX objects must not run their destructors there, which would
    join threads the child does not have (C++ then aborts the process) and
    close the parent's connections.  Nothing reports them as leaked."""
    native().quiet_leaks()
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
