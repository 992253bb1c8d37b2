"""An importer that starts UCX with a ucx-rma get, then loads a library, then gets again.

Run as a script: ``python _import_order_peer.py WHAT [ARG]``, with the share and the exporter's
key on standard input (two hex lines), where WHAT is
``clibs`` (ARG: a folder holding libgsalloc.so and libgsfree.so), ``torch``, ``cupy`` or
``numba``.  Prints "ok <path> <first byte> <first byte again>" when both gets moved the exporter's
bytes and the process lived through the load between them.
"""

import ctypes
import os
import sys

import numpy as np

import gpushare as gs


def get(view) -> int:
    out = np.empty(view.nbytes, np.uint8)
    view.get(out)
    if not (out == out[0]).all():
        sys.exit("the bytes of a get differ from the exporter's")
    return int(out[0])


def load(what: str, arg: str | None) -> None:
    if what == "clibs":
        # libgsalloc allocates a block when asked; libgsfree's constructor frees it: a library
        # loaded after UCX freeing memory that an earlier one allocated, before anyone could patch it.
        alloc = ctypes.CDLL(os.path.join(arg, "libgsalloc.so"), ctypes.RTLD_GLOBAL)
        alloc.gs_alloc(4 << 20)
        ctypes.CDLL(os.path.join(arg, "libgsfree.so"))
        if alloc.gs_kept_is_freed() != 1:
            sys.exit("libgsfree's constructor did not run")
    elif what == "torch":
        import torch

        if int(torch.ones(3).sum()) != 3:
            sys.exit("torch computes wrong after loading")
    elif what == "cupy":
        import cupy  # noqa: F401
    elif what == "numba":
        import numba  # noqa: F401
    else:
        sys.exit(f"unknown library {what!r}")


def main() -> None:
    share_hex, key_hex = sys.stdin.read().split()
    gs.set_authkey(bytes.fromhex(key_hex))
    share = gs.Share.from_bytes(bytes.fromhex(share_hex))
    what, arg = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    with gs.open(share, prefer=["ucx-rma"]) as view:
        first = get(view)  # UCX starts here, and moves a rendezvous-sized reply
        load(what, arg)
        again = get(view)
        view.put(np.full(view.nbytes, first + 1, np.uint8))
        print("ok", view.path, first, again, flush=True)


if __name__ == "__main__":
    main()
