"""Load the native module once, after the UCX libraries it links to."""

from __future__ import annotations

import ctypes
import functools
import types
from typing import Any

__all__ = ["native", "keep_forever"]


@functools.cache
def native() -> types.ModuleType:
    """Return ``gpushare._ucx._native``, loading libucx/libucxx from their wheels first."""
    try:
        import libucxx
    except ImportError as exc:  # pragma: no cover - a broken install
        raise ImportError(
            "gpushare.ucx needs the 'libucxx-cu13' package (pip install libucxx-cu13==0.52.*)"
        ) from exc
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
