"""What this node can share, and why not: :func:`capabilities`."""

from __future__ import annotations

import os
import re
from typing import Any

from ._paths import _cuda, cuda_vmm
from ._process import node_identity
from ._types import public_handle_types
from ._version import __version__

__all__ = ["capabilities"]

IMEX_CHANNELS = "/dev/nvidia-caps-imex-channels"


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


_CHANNEL = re.compile(r"channel[0-9]+", re.ASCII)


def _imex() -> dict[str, Any]:
    """The IMEX channels this process can open: the ``channelN`` device
    files under :data:`IMEX_CHANNELS` that it may read and write.  Fabric
    handles need one: without it the driver refuses to create or import
    memory with them."""
    try:
        channels = sorted(c for c in os.listdir(IMEX_CHANNELS) if _CHANNEL.fullmatch(c))
    except FileNotFoundError:
        return {"present": False, "channels": [], "reason": f"{IMEX_CHANNELS} does not exist"}
    except OSError as exc:
        return {"present": False, "channels": [], "reason": f"cannot list {IMEX_CHANNELS}: {exc}"}
    usable = [c for c in channels if os.access(os.path.join(IMEX_CHANNELS, c), os.R_OK | os.W_OK)]
    if usable:
        reason = None
    elif channels:
        reason = f"no channel in {IMEX_CHANNELS} is readable and writable by this user"
    else:
        reason = f"{IMEX_CHANNELS} holds no channel"
    return {"present": bool(usable), "channels": usable, "reason": reason}


def _fabric_info(uuids: dict[int, str]) -> tuple[dict[int, dict[str, Any]], str | None]:
    """NVML's fabric cluster UUID and clique id per CUDA ordinal, or why not.

    NVML numbers devices its own way and ignores ``CUDA_VISIBLE_DEVICES``, so
    each CUDA device is found in NVML by its UUID.  A clique counts only
    once the fabric manager has finished with the device (state COMPLETED,
    status success); before that the entry says why it does not count.
    """
    try:
        from cuda.bindings import nvml
    except ImportError as exc:
        return {}, f"NVML bindings unavailable ({exc})"
    try:
        nvml.init_v2()
    except Exception as exc:  # noqa: BLE001 - NVML missing is a normal answer here
        return {}, f"NVML unavailable: {exc}"
    out: dict[int, dict[str, Any]] = {}
    completed = int(nvml.GpuFabricState.COMPLETED)
    try:
        for i, uuid in uuids.items():
            entry: dict[str, Any] = {"cluster_uuid": None, "clique_id": None, "state": None, "reason": None}
            out[i] = entry
            try:
                info = nvml.device_get_gpu_fabric_info_v(nvml.device_get_handle_by_uuid(f"GPU-{uuid}"))
                cluster = bytes(info.cluster_uuid)
                entry["state"] = int(info.state)
                status = int(info.status)
                if entry["state"] != completed:
                    entry["reason"] = f"the NVLink fabric is not ready on this device (state {entry['state']})"
                elif status != 0:
                    entry["reason"] = f"the NVLink fabric reported an error on this device (status {status})"
                elif not any(cluster):
                    entry["reason"] = "the device is in no NVLink fabric cluster"
                else:
                    entry["cluster_uuid"] = cluster.hex()
                    entry["clique_id"] = int(info.clique_id)
            except Exception as exc:  # noqa: BLE001
                entry["reason"] = str(exc)
    finally:
        try:
            nvml.shutdown()
        except Exception:  # noqa: BLE001, S110
            pass
    return out, None


def _devices(device: int | None, imex: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None, int | None]:
    reason = _cuda.unavailable_reason()
    if reason is not None:
        return [], reason, None
    drv = _cuda.driver()
    version = int(_cuda.check(drv.cuDriverGetVersion(), "cuDriverGetVersion"))
    count = int(_cuda.check(drv.cuDeviceGetCount(), "cuDeviceGetCount"))
    if count == 0:
        return [], "the CUDA driver sees no device", version
    ordinals = list(range(count)) if device is None else [device]
    uuids = {i: _cuda.device_uuid(i) for i in ordinals if 0 <= i < count}
    fabric, fabric_reason = _fabric_info(uuids)
    devices = []
    for i in ordinals:
        if not 0 <= i < count:
            devices.append({"ordinal": i, "reason": f"no device {i}; the driver sees {count}"})
            continue
        types, why_not = cuda_vmm.device_handle_types(i)
        if "fabric" in types and not imex["present"]:
            # The device supports fabric handles, but without an IMEX channel
            # the driver creates and imports none (CUDA_ERROR_NOT_PERMITTED).
            types = [t for t in types if t != "fabric"]
            why_not = f"no IMEX channel for fabric handles ({imex['reason']})"
        devices.append(
            {
                "ordinal": i,
                "name": _cuda.device_name(i),
                "uuid": uuids[i],
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
        ``ordinal`` (this process's), ``name`` (the driver's), ``uuid`` (as cuda.core's
        ``Device.uuid`` writes it), ``handle_types`` (of ``"posix-fd"``,
        ``"fabric"``, ``"cuda-ipc"``), ``fabric_reason`` and ``fabric``
        (NVML cluster UUID and clique id once the fabric is ready on the
        device, else ``reason``)), ``imex``
        (``present``, ``channels``, ``reason``), ``versions`` (gpushare,
        cuda-core, cuda-bindings) and ``ucx``.
    """
    host_ok = hasattr(os, "memfd_create")
    imex = _imex()
    devices, reason, driver_version = _devices(device, imex)
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
