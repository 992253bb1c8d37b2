"""The CUDA driver, loaded lazily, and the one place its failures become
:class:`gpushare.CUDAError`.

Nothing here runs at import of gpushare: :func:`driver` imports
``cuda.bindings`` and initialises the driver the first time a CUDA path needs
it.  Where there is no CUDA driver, :func:`driver` raises
:class:`gpushare.UnsupportedError` saying so, and :func:`unavailable_reason`
returns that sentence for :func:`gpushare.capabilities`.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from .._errors import CUDAError, UnsupportedError

__all__ = ["bytes_of", "check", "device_uuid", "driver", "set_bytes", "unavailable_reason"]

_lock = threading.Lock()
_driver: Any = None
_reason: str | None = None


def _load() -> None:
    global _driver, _reason
    try:
        from cuda.bindings import driver as drv
    except ImportError as exc:
        _reason = f"cuda-bindings is not installed ({exc}); pip install cuda-bindings"
        return
    try:
        (err,) = drv.cuInit(0)
    except RuntimeError as exc:  # cuda.pathfinder's DynamicLibNotFoundError
        _reason = f"no CUDA driver: libcuda.so.1 not found ({exc})"
        return
    if err != drv.CUresult.CUDA_SUCCESS:
        _reason = f"the CUDA driver failed to initialise [{_name(drv, err)}]"
        return
    _driver = drv


def unavailable_reason() -> str | None:
    """Why the CUDA paths cannot run here, or ``None`` when they can."""
    with _lock:
        if _driver is None and _reason is None:
            _load()
        return _reason


def driver() -> Any:
    """``cuda.bindings.driver``, initialised.

    Raises
    ------
    ImportError
        If cuda-bindings is not installed.
    UnsupportedError
        If there is no usable CUDA driver.
    """
    reason = unavailable_reason()
    if reason is not None:
        if reason.startswith("cuda-bindings"):
            raise ImportError(reason)
        raise UnsupportedError(reason)
    return _driver


def _name(drv: Any, err: Any) -> str:
    try:
        res, name = drv.cuGetErrorName(err)
        if res == drv.CUresult.CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - naming an error must not fail
        pass
    return getattr(err, "name", str(err))


def check(result: tuple[Any, ...], what: str) -> Any:
    """Raise :class:`CUDAError` unless ``result[0]`` is ``CUDA_SUCCESS``;
    return the rest (one value, a tuple, or ``None``)."""
    drv = _driver
    err, rest = result[0], result[1:]
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CUDAError(_name(drv, err), what)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def bytes_of(handle: Any, n: int) -> bytes:
    """The ``n`` bytes of a driver struct (fabric or IPC handle)."""
    data = getattr(handle, "data", None)
    if data is None:
        data = getattr(handle, "bytes", None)
    if data is not None:
        return bytes(data)[:n]
    return ctypes.string_at(handle.getPtr(), n)


def set_bytes(handle: Any, data: bytes) -> Any:
    """Fill a driver struct from bytes; returns it."""
    ctypes.memmove(handle.getPtr(), data, len(data))
    return handle


def device_uuid(ordinal: int) -> str:
    """``"GPU-xxxxxxxx-..."`` of a device ordinal."""
    drv = driver()
    dev = check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    uuid = check(drv.cuDeviceGetUuid(dev), f"cuDeviceGetUuid({ordinal})")
    raw = bytes_of(uuid, 16).hex()
    return f"GPU-{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:32]}"
