"""What this node can share, and why not: :func:`capabilities`."""

from __future__ import annotations

import os
from typing import Any

from ._cuda import _driver, fabric
from ._paths.handles import CUDA_HANDLE_TYPES, HOST_HANDLE_TYPES
from ._process import node_identity
from ._types import public_handle_types
from ._version import __version__

__all__ = ["capabilities"]


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _devices(device: int | None, imex: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None, int | None]:
    reason = _driver.unavailable_reason()
    if reason is not None:
        return [], reason, None
    drv = _driver.driver()
    version = int(_driver.check(drv.cuDriverGetVersion(), "cuDriverGetVersion"))
    count = int(_driver.check(drv.cuDeviceGetCount(), "cuDeviceGetCount"))
    if count == 0:
        return [], _driver.NO_DEVICE, version
    ordinals = list(range(count)) if device is None else [device]
    uuids = {i: _driver.device_uuid(i) for i in ordinals if 0 <= i < count}
    found, fabric_reason = fabric.fabric_info(uuids)
    devices = []
    for i in ordinals:
        if not 0 <= i < count:
            devices.append({"ordinal": i, "reason": f"no device {i}; the driver sees {count}"})
            continue
        types, why_not = fabric.handle_types(i, imex)
        devices.append(
            {
                "ordinal": i,
                "name": _driver.device_name(i),
                "uuid": uuids[i],
                "handle_types": public_handle_types(types) + list(CUDA_HANDLE_TYPES),
                "fabric_reason": why_not,
                "fabric": found.get(i, {"reason": fabric_reason}),
            }
        )
    return devices, None, version


def capabilities(device: int | None = None) -> dict[str, Any]:
    """What this node can share, as plain data, with the reason for each thing
    it cannot.

    Never raises for missing hardware: on a machine without a CUDA driver the
    answer says so (``cuda["reason"]``).  Loads the CUDA driver and NVML (the
    first time), so it is not free; nothing is cached across calls but the
    driver itself.

    Parameters
    ----------
    device : int, optional
        Describe only this CUDA device; all by default.

    Returns
    -------
    dict
        ``node`` (identity), ``host`` (``handle_types``: ``["posix-fd"]``
        where memfd and fd passing work), ``cuda`` (``available``, ``reason``,
        ``driver_version``, ``devices``: one entry per device with
        ``ordinal`` (this process's), ``name`` (the driver's), ``uuid`` (as cuda.core's
        ``Device.uuid`` writes it), ``handle_types`` (of ``"posix-fd"``,
        ``"fabric"``, ``"cuda-ipc"``), ``fabric_reason`` and ``fabric``
        (NVML cluster UUID and clique id once the fabric is ready on the
        device, else ``reason``)), ``imex``
        (``present``, ``channels``, ``reason``), ``versions`` (gpushare,
        cuda-core, cuda-bindings) and ``ucx``.
    """
    host_ok = hasattr(os, "memfd_create")
    imex = fabric.imex()
    devices, reason, driver_version = _devices(device, imex)
    return {
        "node": node_identity(),
        "host": {
            "handle_types": list(HOST_HANDLE_TYPES) if host_ok else [],
            "reason": None if host_ok else "os.memfd_create is unavailable on this platform",
        },
        "cuda": {
            "available": reason is None,
            "reason": reason,
            "driver_version": driver_version,
            "devices": devices,
        },
        "imex": imex,
        "versions": {
            "gpushare": __version__,
            "cuda-core": _version("cuda-core"),
            "cuda-bindings": _version("cuda-bindings"),
        },
        "ucx": {
            "transports": None,
            "reason": "UCX is not loaded by capabilities(); gpushare.ucx reports its transports",
        },
    }
