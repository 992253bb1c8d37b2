"""What this node can share, and why not: :func:`capabilities`."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["capabilities"]

IMEX_CHANNELS = "/dev/nvidia-caps-imex-channels"


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _imex() -> dict[str, Any]:
    try:
        channels = sorted(os.listdir(IMEX_CHANNELS))
    except FileNotFoundError:
        return {"present": False, "channels": [], "reason": f"{IMEX_CHANNELS} does not exist"}
    except OSError as exc:
        return {"present": False, "channels": [], "reason": f"cannot list {IMEX_CHANNELS}: {exc}"}
    usable = [c for c in channels if os.access(os.path.join(IMEX_CHANNELS, c), os.R_OK | os.W_OK)]
    reason = None if usable else f"no channel in {IMEX_CHANNELS} is readable and writable by this user"
    return {"present": bool(usable), "channels": usable, "reason": reason}


def _fabric_info(ordinals: list[int]) -> tuple[dict[int, dict[str, Any]], str | None]:
    """NVML's fabric cluster UUID and clique id per device, or why not."""
    try:
        from cuda.bindings import nvml
    except ImportError as exc:
        return {}, f"NVML bindings unavailable ({exc})"
    try:
        nvml.init_v2()
    except Exception as exc:  # noqa: BLE001 - NVML missing is a normal answer here
        return {}, f"NVML unavailable: {exc}"
    out: dict[int, dict[str, Any]] = {}
    try:
        for i in ordinals:
            try:
                info = nvml.device_get_gpu_fabric_info_v(nvml.device_get_handle_by_index_v2(i))
                cluster = bytes(info.cluster_uuid)
                out[i] = {
                    "cluster_uuid": cluster.hex() if any(cluster) else None,
                    "clique_id": int(info.clique_id),
                    "state": int(info.state),
                    "reason": None,
                }
            except Exception as exc:  # noqa: BLE001
                out[i] = {"cluster_uuid": None, "clique_id": None, "state": None, "reason": str(exc)}
    finally:
        try:
            nvml.shutdown()
        except Exception:  # noqa: BLE001, S110
            pass
    return out, None


def _devices(device: int | None) -> tuple[list[dict[str, Any]], str | None, int | None]:
    from ._paths import _cuda

    reason = _cuda.unavailable_reason()
    if reason is not None:
        return [], reason, None
    from ._paths.cuda_vmm import device_handle_types
    from ._types import public_handle_types

    drv = _cuda.driver()
    version = int(_cuda.check(drv.cuDriverGetVersion(), "cuDriverGetVersion"))
    count = int(_cuda.check(drv.cuDeviceGetCount(), "cuDeviceGetCount"))
    if count == 0:
        return [], "the CUDA driver sees no device", version
    ordinals = list(range(count)) if device is None else [device]
    fabric, fabric_reason = _fabric_info(ordinals)
    devices = []
    for i in ordinals:
        if not 0 <= i < count:
            devices.append({"ordinal": i, "reason": f"no device {i}; the driver sees {count}"})
            continue
        types, why_not = device_handle_types(i)
        devices.append(
            {
                "ordinal": i,
                "uuid": _cuda.device_uuid(i),
                "handle_types": public_handle_types(types) + ["cuda-ipc"],
                "fabric_reason": why_not,
                "fabric": fabric.get(i, {"reason": fabric_reason}),
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
        ``ordinal``, ``uuid``, ``handle_types`` (of ``"posix-fd"``,
        ``"fabric"``, ``"cuda-ipc"``), ``fabric_reason`` and ``fabric``
        (NVML cluster UUID and clique id, or ``reason``)), ``imex``
        (``present``, ``channels``, ``reason``), ``versions`` (gpushare,
        cuda-core, cuda-bindings) and ``ucx``.
    """
    from . import __version__
    from ._paths.broker import node_identity

    host_ok = hasattr(os, "memfd_create")
    devices, reason, driver_version = _devices(device)
    return {
        "node": node_identity(),
        "host": {
            "handle_types": ["posix-fd"] if host_ok else [],
            "reason": None if host_ok else "os.memfd_create is unavailable on this platform",
        },
        "cuda": {
            "available": reason is None,
            "reason": reason,
            "driver_version": driver_version,
            "devices": devices,
        },
        "imex": _imex(),
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
