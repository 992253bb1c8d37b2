"""What this node's NVLink fabric allows: the IMEX channels this process can
open, each device's fabric clique (from NVML), and the one rule that joins
them: fabric handles need an IMEX channel.

The fabric path offers and takes memory by these answers, and
:func:`gpushare.capabilities` reports them.  NVML is loaded (and shut down
again) by each call that asks it; nothing is cached.
"""

from __future__ import annotations

import os
import re
from typing import Any

from . import _driver, vmm

__all__ = ["IMEX_CHANNELS", "cliques", "fabric_info", "handle_types", "imex"]

IMEX_CHANNELS = "/dev/nvidia-caps-imex-channels"

_CHANNEL = re.compile(r"channel[0-9]+", re.ASCII)


def imex() -> dict[str, Any]:
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


def _no_imex(found: dict[str, Any]) -> str | None:
    """Why fabric handles cannot be used in this process (``None``: they
    can): the driver creates and imports none without an IMEX channel
    (``CUDA_ERROR_NOT_PERMITTED``)."""
    return None if found["present"] else f"no IMEX channel for fabric handles ({found['reason']})"


def handle_types(ordinal: int, found: dict[str, Any]) -> tuple[list[str], str | None]:
    """The handle types device ``ordinal``'s VMM memory can be shared with
    here, given the IMEX channels :func:`imex` ``found``, and why fabric is
    not one of them (``None`` when it is)."""
    types, why_not = vmm.device_handle_types(ordinal)
    if vmm.FABRIC in types:
        why_not = _no_imex(found)
        if why_not is not None:
            types = [t for t in types if t != vmm.FABRIC]
    return types, why_not


def fabric_info(uuids: dict[int, str]) -> tuple[dict[int, dict[str, Any]], str | None]:
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


def cliques() -> tuple[dict[int, str], str | None]:
    """This node's fabric clique per device ("cluster:clique"), or why there is none."""
    reason = _driver.unavailable_reason()
    count = _driver.device_count() if reason is None else 0
    if reason is None and count == 0:
        reason = _driver.NO_DEVICE
    if reason is not None:
        return {}, f"no CUDA here ({reason})"
    why_not = _no_imex(imex())
    if why_not is not None:
        return {}, why_not
    found, _ = fabric_info({i: _driver.device_uuid(i) for i in range(count)})
    out = {i: f"{fab['cluster_uuid']}:{fab['clique_id']}" for i, fab in found.items() if fab["cluster_uuid"]}
    return out, None if out else "no device reports an NVLink fabric clique"
