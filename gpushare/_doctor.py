"""``gpushare doctor``: what this machine can do, and which path each peer would get."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
from pathlib import Path
from typing import Any

from . import _by_descriptor, _export, _open, _paths
from ._capabilities import capabilities
from ._errors import UCXLibraryError
from ._paths.base import KINDS
from ._ucx import _loader
from ._open_plan import choose
from ._process import node_key
from ._share import Share

__all__ = ["run_doctor", "ucx_library", "ucx_transports", "live_check"]


def ucx_library() -> dict[str, Any]:
    """The UCX and libucxx this process loads: versions and files, or why they do not load."""
    import importlib.metadata as md

    try:
        ucxx_version = md.version("libucxx-cu13")
    except md.PackageNotFoundError:  # pragma: no cover - a broken install
        ucxx_version = None
    try:
        built = tuple(_loader.native().ucx_built_version())
        libs = _loader.loaded()
    except (UCXLibraryError, ImportError) as exc:
        return {"loaded": False, "reason": str(exc), "ucxx_version": ucxx_version}
    return {"loaded": True, "version": ".".join(map(str, libs.ucx_version)),
            "built_against": ".".join(map(str, built)), "directory": libs.ucx_dir, "files": list(libs.mapped),
            "ucxx_version": ucxx_version, "ucxx_file": libs.ucxx_file, "reason": None}


def ucx_transports() -> dict[str, Any]:
    """Transports and devices UCX finds here (from the wheel's ucx_info)."""
    try:
        import libucx
    except ImportError:
        return {"transports": [], "reason": "libucx is not installed"}
    root = Path(libucx.__file__).parent
    env = dict(os.environ, LD_LIBRARY_PATH=f"{root / 'lib'}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    try:
        r = subprocess.run([str(root / "bin" / "ucx_info"), "-d"], capture_output=True, text=True,
                           timeout=60, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"transports": [], "reason": f"ucx_info failed: {exc}"}
    found, tl = [], None
    for line in r.stdout.splitlines():
        line = line.strip("# ").strip()
        if line.startswith("Transport:"):
            tl = line.split(":", 1)[1].strip()
        elif line.startswith("Device:") and tl:
            entry = f"{tl}/{line.split(':', 1)[1].strip()}"
            if entry not in found:
                found.append(entry)
    return {"transports": found, "reason": None if found else "ucx_info listed no transport"}


def _decide(node: str, device: Any, offers: tuple[str, ...]) -> tuple[str, str]:
    share = Share._make(*Share._fields_of(
        share_id="0" * 32, token=b"\0" * 32, exporter_pid=1, node=node, control=(("127.0.0.1", 1),), nbytes=4096,
        device=device, shape=(4096,), typestr="|u1", offers=offers, lifetime="closed", fabric=None, readonly=False))
    order, left_out, _ = choose(share, None, None)
    if not order:
        return "none", "; ".join(left_out)
    return order[0], "; ".join(left_out)


def _probe(conn: Any, tries: list[tuple[str, bytes]], expected: bytes) -> None:
    """The second process of :func:`live_check`: open each share over its path."""
    results = {}
    for path, data in tries:
        share = Share.from_bytes(data)
        try:
            with _open.open(share, prefer=[path], timeout=20) as view:
                if view.path != path:
                    results[path] = f"not taken (got {view.path})"
                    continue
                got = bytearray(view.nbytes)
                view.get(got)
                results[path] = "works" if bytes(got) == expected else "FAILED: the bytes differ"
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            results[path] = f"FAILED: {type(exc).__name__}: {exc}"
    conn.send(results)


def live_check(timeout: float = 60.0) -> dict[str, str]:
    """Share 4 KiB of host memory with a second process on this node over each
    path host memory can take; return what happened on each ("works" or why not)."""
    buf = _by_descriptor.allocate(4096, device="host")
    expected = bytes(range(256)) * 16
    buf.memoryview()[:] = expected
    plain = bytearray(expected)  # memory gpushare did not allocate
    share, plain_share = _export.export(buf, lifetime="revoked"), _export.export(plain, lifetime="revoked")
    tries = []  # each path another process can take, over the first of the two shares that offers it
    for path in _paths.PATHS:
        offering = [s for s in (share, plain_share) if path.name in s.offers]
        if offering and not path.in_process:
            tries.append((path.name, offering[0].to_bytes()))
    paths = [name for name, _ in tries]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_probe, args=(child, tries, expected), daemon=True)
    try:
        proc.start()
        child.close()
        if not parent.poll(timeout):
            return dict.fromkeys(paths, f"FAILED: the second process did not answer within {timeout:.0f} s")
        try:
            return parent.recv()
        except EOFError:
            return dict.fromkeys(paths, f"FAILED: the second process exited (status {proc.exitcode})")
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        parent.close()
        share.revoke()
        plain_share.revoke()
        buf.close()


def run_doctor(out: Any = print, as_json: bool = False) -> int:
    """Print capabilities, path decisions and a live check; return 1 if no path
    works between two processes on this node, else 0."""
    caps = capabilities()
    caps["ucx"] = ucx_transports()
    caps["ucx"]["library"] = ucx_library()
    here, elsewhere = node_key(), "another-node"
    cuda_devices = caps["cuda"]["devices"] or []
    types = cuda_devices[0].get("handle_types", []) if cuda_devices else []
    scenarios = []
    for kind in KINDS:  # each kind of memory, offered as each path that serves it would offer it
        if kind.cuda and not cuda_devices:
            continue
        offers = tuple(p.name for p in _paths.PATHS if kind in p.serves and not p.in_process
                       and (not kind.cuda or p.device_handle is None or p.device_handle in types))
        scenarios.append((kind.label, 0 if kind.cuda else "host", offers))
    decisions = []
    for label, device, offers in scenarios:
        for where, node in (("same node", here), ("another node", elsewhere)):
            path, why = _decide(node, device, offers)
            decisions.append({"memory": label, "peer": where, "path": path, "why": why})
    live = live_check()
    status = 0 if any(v == "works" for v in live.values()) else 1
    if as_json:
        out(json.dumps({"capabilities": caps, "decisions": decisions, "live_check": live, "ok": status == 0},
                       indent=2, default=str))
        return status
    out(f"node: {caps['node']}")
    cuda = caps["cuda"]
    if cuda["available"]:
        out(f"CUDA driver {cuda['driver_version']}, {len(cuda_devices)} device(s)")
        for d in cuda_devices:
            out(f"  device {d.get('ordinal')}: {d.get('name', '')} handle types {d.get('handle_types')}"
                + (f"; fabric: {d.get('fabric_reason')}" if d.get("fabric_reason") else ""))
    else:
        out(f"CUDA: not available ({cuda['reason']})")
    imex = caps["imex"]
    out(f"IMEX channel: {'present' if imex.get('present') else 'absent'}"
        + (f" ({imex.get('reason')})" if imex.get("reason") else ""))
    ucx = caps["ucx"]
    lib = ucx["library"]
    if lib["loaded"]:
        out(f"UCX {lib['version']} (built against {lib['built_against']}) from {lib['directory']}; "
            f"libucxx {lib['ucxx_version']} from {lib['ucxx_file']}")
        out(f"  UCX files mapped: {' '.join(lib['files'])}")
    else:
        out(f"UCX: does not load: {lib['reason']}")
    out(f"UCX transports: {', '.join(ucx['transports']) or ucx['reason']}")
    out(f"versions: {', '.join(f'{k} {v}' for k, v in caps['versions'].items())}")
    out("")
    out("path a peer would get:")
    for d in decisions:
        out(f"  {d['memory']}, peer on {d['peer']}: {d['path']}")
        if d["why"]:
            out(f"      why not faster: {d['why']}")
    out("")
    out("host memory shared with a second process on this node:")
    for path, result in live.items():
        out(f"  {path}: {result}")
    if status:
        out("no path works between two processes on this node: see the reasons above")
    return status
