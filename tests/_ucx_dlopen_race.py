"""Start this process's UCX worker in one thread while this thread loads and
unloads shared libraries without pause; print "ok" once the worker is up.

Run as a script by tests/test_ucx_server.py, with UCX's "reloc" memory
hooks: ucp_init then patches every loaded library, and a dlopen in another
thread at that moment could leave both threads waiting for each other's
loader lock."""

from __future__ import annotations

import ctypes
import glob
import os
import threading

import numpy

from gpushare._ucx import _peer

libc = ctypes.CDLL(None)
libc.dlopen.restype = ctypes.c_void_p
libc.dlopen.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.dlclose.argtypes = [ctypes.c_void_p]
paths = [p.encode() for p in glob.glob(os.path.join(os.path.dirname(numpy.__file__), "**", "*.so"), recursive=True)]
assert paths, "no shared libraries to load"
RTLD_NOW = 2

up = threading.Event()
threading.Thread(target=lambda: (_peer.client(), up.set()), daemon=True).start()
loads = 0
while not up.is_set():
    for path in paths:
        handle = libc.dlopen(path, RTLD_NOW)
        if handle:
            libc.dlclose(handle)
        loads += 1
        if up.is_set():
            break
print("ok", loads, flush=True)
os._exit(0)
