"""Both processes of a ucx-rma put/get with librmm hidden, as an image without it has them.

Run as a script: ``python _ucx_library_peer.py``.  librmm is hidden at the top of the module,
so the spawned importer, which runs this module again as ``__mp_main__``, has it hidden too.
Prints one JSON line: each process's mapped UCX files and whether the bytes arrived.
"""

import sys

sys.modules["librmm"] = None  # import librmm raises ImportError, as where it is not installed

import json  # noqa: E402
import multiprocessing as mp  # noqa: E402


def mapped() -> list[str]:
    from gpushare._ucx import _libraries

    return _libraries.mapped_ucx()


def importer(share, conn) -> None:
    import numpy as np

    import gpushare as gs

    with gs.open(share, prefer=["ucx-rma"]) as view:
        got = np.empty(view.nbytes, np.uint8)
        view.get(got)
        view.put(got + 1)
        conn.send({"path": view.path, "first": int(got[0]), "mapped": mapped()})


def main() -> None:
    import numpy as np

    import gpushare as gs

    buf = gs.allocate(1 << 20, device="host")
    arr = np.asarray(buf)
    arr[:] = 41
    share = gs.export(buf, lifetime="revoked")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=importer, args=(share, child))
    proc.start()
    child.close()
    if not parent.poll(120):
        sys.exit(f"the importer did not answer (exit status {proc.exitcode})")
    theirs = parent.recv()
    proc.join(30)
    print(json.dumps({"importer": theirs, "exporter": {"mapped": mapped(), "after_put": int(arr[0])},
                      "importer_exit": proc.exitcode}))
    share.revoke()
    del arr
    buf.close()


if __name__ == "__main__":
    main()
