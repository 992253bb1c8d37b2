"""Fixed costs a user pays: what loads, and when."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_host_to_host_sharing_never_loads_ucx(tmp_path):
    # Export, open over host-fd from another process, get and put: none of
    # it needs UCX, whose load costs a good part of a second.
    code = textwrap.dedent("""
        import multiprocessing as mp, sys
        import numpy as np
        import gpushare as gs

        def importer(q, out):
            with gs.open(q.get(), exclude=["ucx-rma"]) as view:
                buf = bytearray(view.nbytes)
                view.get(buf)
                view.put(bytes(buf[:8]), 8)
                out.put((view.path, bytes(buf[:4]), [m for m in sys.modules if "_ucx._native" in m]))

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            b = gs.allocate(1 << 16, device="host")
            np.asarray(b)[:] = 7
            share = gs.export(b)
            q, out = ctx.Queue(), ctx.Queue()
            p = ctx.Process(target=importer, args=(q, out))
            p.start()
            q.put(share)
            path, head, loaded = out.get(timeout=60)
            p.join(60)
            assert path == "host-fd", path
            assert head == b"\\x07" * 4
            assert loaded == [], loaded
            assert not [m for m in sys.modules if "_ucx._native" in m]
            print("ok")
    """)
    script = tmp_path / "host_only.py"  # spawn re-imports the main module: a file, not -c
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
