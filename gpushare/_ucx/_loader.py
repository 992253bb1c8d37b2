"""Load the native module once, after the UCX libraries it links to."""

from __future__ import annotations

import ctypes
import fcntl
import functools
import os
import socket
import struct
import sys
import types
from typing import Any

from .._control import bind_host
from .._errors import InvalidInputError, UCXLibraryError
from . import _libraries

__all__ = ["native", "loaded", "system_id_of_host", "knows_setting", "keep_forever", "infiniband_present",
           "choose_hook_mode", "choose_memtype_cache", "choose_net_devices", "interface_of", "native_memtype_cache",
           "check_memtype_config"]


def infiniband_present() -> bool:
    """Whether this node has InfiniBand or RoCE devices."""
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def choose_hook_mode() -> None:
    """Keep UCX from patching any library, before its libraries load.

    UCX's memory events feed its registration cache.  To hear of memory
    going away, libucm hooks ``mmap``, ``munmap`` and six other libc
    functions, and where those hooks miss what ``malloc`` does it installs
    an allocator of its own: by default (``bistro``) it rewrites the first
    bytes of the functions while the process runs (and waits 50 ms after
    each, 0.4 s per process); in ``reloc`` mode, the one gpushare chose
    before, it also puts its ``malloc`` and ``free`` into every loaded
    library's relocation table, and a library loaded later runs its
    constructors before it is patched: one that frees a block another
    library allocated hands libucm's block to glibc's ``free``, and the
    process aborts (CuPy and torch imported after UCX started did).

    Only a registration cache of host memory needs those events, and on
    UCX 1.21 that is InfiniBand/RoCE's (TCP registers nothing; ``cuda_copy``
    caches no host registrations).  So without such devices gpushare turns
    the events off (``UCX_MEM_EVENTS=n``): libucm patches nothing and
    replaces no allocator, whatever loads later.  UCX then has no
    registration cache, and UCX 1.21 crashes when a peer fails during a
    rendezvous transfer whose memory handle UCX registered itself; gpushare
    gives every rendezvous transfer a memory handle of its own (the
    region's, or ``OwnMemh`` in the native module), which that path skips.
    With InfiniBand or RoCE devices UCX's default stays (``bistro``, which
    replaces no allocator either).  ``UCX_MEM_EVENTS`` or
    ``UCX_MEM_MMAP_HOOK_MODE`` in the environment wins.  Set in the
    environment, the choice is inherited by child processes on this
    node, which would make the same one."""
    if "UCX_MEM_EVENTS" in os.environ or "UCX_MEM_MMAP_HOOK_MODE" in os.environ:
        return
    if not infiniband_present():
        os.environ["UCX_MEM_EVENTS"] = "n"


_TERNARY = {"y": "y", "yes": "y", "on": "y", "1": "y", "true": "y",
            "n": "n", "no": "n", "off": "n", "0": "n", "false": "n",
            "try": "try", "auto": "try"}


def _ternary(value: str) -> str:
    return _TERNARY.get(value.strip().lower(), value.strip().lower())


def without_registration_cache(cfg: dict[str, str]) -> bool:
    """Whether a context made with settings ``cfg`` (and this environment) runs without
    UCX's registration cache: memory events off (a setting of the whole process), or
    ``RCACHE_ENABLE`` off in ``cfg`` or, where ``cfg`` does not say, in the environment."""
    rcache = cfg.get("RCACHE_ENABLE", os.environ.get("UCX_RCACHE_ENABLE", "try"))
    return _ternary(os.environ.get("UCX_MEM_EVENTS", "y")) == "n" or _ternary(rcache) == "n"


def choose_memtype_cache() -> None:
    """Turn UCX's memory-type cache off for the process, before its libraries load.

    Local buffers reach UCX as bare pointers, so UCX infers their memory
    type.  Its cache learns of CUDA memory only from allocations it saw
    being made, so it can take device memory made before UCX loaded (or
    mapped through VMM) for host memory and copy it with the CPU; without
    the cache every pointer is asked of the driver.  ``UCX_MEMTYPE_CACHE``
    is one setting of the whole process in UCX (a global option of libucs,
    read from the environment when libucs loads; a worker's configuration
    that names it changes it for every worker of the process), so gpushare
    sets it once, here, in the environment (inherited by child processes),
    and refuses Agent configurations that ask for another value
    (:func:`check_memtype_config`).  ``UCX_MEMTYPE_CACHE`` in the
    environment wins."""
    os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")


_SIOCGIFADDR = 0x8915
#: The control address for which gpushare chose ``UCX_NET_DEVICES`` (absent: the user set it, or nobody).
_NET_DEVICES_FOR = "GPUSHARE_UCX_NET_DEVICES_FOR"


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds IPv4 ``address``, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def choose_net_devices() -> None:
    """Let UCX listen only where the control channel does, before its libraries load.

    Every UCX TCP interface listens on a port of its own that anyone who
    reaches it can use, with no key (docs/security.md, "Who reaches UCX").
    When ``GPUSHARE_CONTROL_HOST`` names one address of this host, the
    processes are meant to be reached there only: UCX is then given that
    address's interface alone (``UCX_NET_DEVICES``; ``lo`` for
    127.0.0.1).  ``UCX_NET_DEVICES`` set by the user wins; so does
    ``0.0.0.0`` (every interface, the default).  Set in the environment, the
    choice is inherited by child processes; one whose
    ``GPUSHARE_CONTROL_HOST`` differs makes its own."""
    host = bind_host()
    chosen_for = os.environ.get(_NET_DEVICES_FOR)
    if "UCX_NET_DEVICES" in os.environ and (chosen_for is None or chosen_for == host):
        return  # the user's setting, or the one made here for the same address
    if chosen_for is not None:  # inherited from a parent that listened elsewhere
        os.environ.pop("UCX_NET_DEVICES", None)
        del os.environ[_NET_DEVICES_FOR]
    name = None if host == "0.0.0.0" else interface_of(host)
    if name is not None:
        os.environ["UCX_NET_DEVICES"] = name
        os.environ[_NET_DEVICES_FOR] = host


def check_memtype_config(cfg: dict[str, str]) -> None:
    """Drop ``MEMTYPE_CACHE`` from a worker's settings ``cfg`` when it agrees
    with the process's; refuse it otherwise (it would change the setting of
    every worker in the process)."""
    value = cfg.pop("MEMTYPE_CACHE", None)
    if value is None:
        return
    process = native_memtype_cache()
    if _ternary(value) != process:
        raise InvalidInputError(
            f"config asks for MEMTYPE_CACHE={value!r}, but this process's UCX memory-type cache is "
            f"{process!r}: UCX has one such setting per process, shared by every worker (gpushare's own "
            "included), so one agent cannot have its own. Set UCX_MEMTYPE_CACHE in the environment "
            "before gpushare loads UCX instead"
        )


def native_memtype_cache() -> str:
    """The process's memory-type cache setting (``"y"``, ``"n"`` or
    ``"try"``) as libucs holds it; loads UCX."""
    native()
    try:
        libucs = ctypes.CDLL(os.path.join(loaded().ucx_dir, "libucs.so.0"))  # the copy loaded
        get = libucs.ucs_global_opts_get_value
    except (OSError, AttributeError):  # pragma: no cover - a libucs without the call
        return _ternary(os.environ.get("UCX_MEMTYPE_CACHE", "try"))
    get.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    get.restype = ctypes.c_int
    out = ctypes.create_string_buffer(32)
    if get(b"MEMTYPE_CACHE", out, len(out)) != 0:  # pragma: no cover - UCS_OK is 0
        return _ternary(os.environ.get("UCX_MEMTYPE_CACHE", "try"))
    return _ternary(out.value.decode())


@functools.cache
def native() -> types.ModuleType:
    """Return ``gpushare._ucx._native``, loading UCX and libucxx from their wheels
    first, by path (:mod:`._libraries`), and checking what was loaded."""
    choose_hook_mode()
    choose_memtype_cache()
    choose_net_devices()
    libs = loaded()
    try:
        from . import _native
    except ImportError as exc:  # a UCX without the symbols the module links to
        raise UCXLibraryError(
            f"gpushare's native module does not load with UCX {'.'.join(map(str, libs.ucx_version))} "
            f"from {libs.ucx_dir}: {exc}"
        ) from exc
    _libraries.check_built(libs, tuple(_native.ucx_built_version()))
    return _native


@functools.cache
def system_id_of_host() -> int:
    """This host's system id as UCX computes it (``ucs_get_system_id``), all 64 bits: ``cuda_ipc``
    packs it as it is; shared memory and cma pack it with bit 63 cleared (that bit flags a
    namespace).  Loads UCX."""
    native()
    get = ctypes.CDLL(os.path.join(loaded().ucx_dir, "libucs.so.0")).ucs_get_system_id
    get.restype = ctypes.c_uint64
    return int(get())


@functools.cache
def knows_setting(name: str, value: str) -> bool:
    """Whether this process's UCX takes setting ``name`` (without ``UCX_``) with ``value``: a
    setting of a transport whose module did not load (``cuda_ipc`` without a CUDA driver) makes
    ``ucp_init`` fail, and set in the environment it draws UCX's unused-variable warning.  Reads
    UCX's configuration table only (``ucp_config_read`` / ``ucp_config_modify``); loads UCX."""
    native()
    ucp = ctypes.CDLL(os.path.join(loaded().ucx_dir, "libucp.so.0"))
    cfg = ctypes.c_void_p()
    ucp.ucp_config_read.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
    ucp.ucp_config_modify.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
    ucp.ucp_config_release.argtypes = [ctypes.c_void_p]
    if ucp.ucp_config_read(None, None, ctypes.byref(cfg)) != 0:
        return False
    try:
        return ucp.ucp_config_modify(cfg, name.encode(), value.encode()) == 0
    finally:
        ucp.ucp_config_release(cfg)


@functools.cache
def loaded() -> _libraries.UcxLibraries:
    """UCX and libucxx, loaded once by path; what was loaded."""
    return _libraries.load()


def refusal() -> str | None:
    """Why UCX cannot start in this process, or None: it was forked from a
    process that had started UCX, whose state of the whole process does not
    survive fork (making an Agent or the region server's worker here raises
    :class:`UnsupportedError` with this message).  Loads nothing: a process
    whose ancestors never loaded the native module has not started UCX."""
    mod = sys.modules.get(__package__ + "._native")
    return (mod.ucx_refusal() or None) if mod is not None else None


def keep_forever(obj: Any) -> None:
    """Never destroy native object ``obj`` in this process, not even when
    the interpreter exits and clears its modules.  For a forked child: its
    parent's UCX objects must not run their destructors there, which would
    join threads the child does not have (C++ then aborts the process) and
    close the parent's connections.  Nothing reports them as leaked."""
    native().quiet_leaks()
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
