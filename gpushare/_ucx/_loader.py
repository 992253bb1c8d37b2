"""Load the native module once, after the UCX libraries it links to."""

from __future__ import annotations

import functools
import types

__all__ = ["native"]


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
