"""Two network namespaces standing in for two nodes: a share crosses over ucx-rma.

Needs root and iproute2. Creates namespaces gs-node-a and gs-node-b joined
by a veth pair (198.18.0.1/24 and 198.18.0.2/24, a range reserved for
testing), exports a NumPy array in node b, opens the share in node a, reads
and writes it, and removes the namespaces again.

Run: sudo python examples/two_namespaces.py
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import secrets
import subprocess
import sys

A, B = f"gs-node-a-{os.getpid()}", f"gs-node-b-{os.getpid()}"
SIZE = 4 << 20


def exporter() -> None:
    import numpy as np

    import gpushare as gs

    arr = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
    share = gs.export(arr, lifetime=1)
    digest = hashlib.sha256(arr.data).hexdigest()
    print(json.dumps({"share": pickle.dumps(share).hex(), "digest": digest}), flush=True)
    sys.stdin.readline()  # the importer is done
    print(hashlib.sha256(arr.data).hexdigest(), flush=True)


def importer() -> None:
    import numpy as np

    import gpushare as gs

    hello = json.loads(sys.stdin.readline())
    share = pickle.loads(bytes.fromhex(hello["share"]))
    with gs.open(share) as view:
        data = np.empty(view.nbytes, np.uint8)
        view.get(data)
        reply = np.full(view.nbytes, 7, np.uint8)
        view.put(reply)
        print(json.dumps({"path": view.path, "why": view.why,
                          "read_ok": hashlib.sha256(data.data).hexdigest() == hello["digest"],
                          "wrote": hashlib.sha256(reply.data).hexdigest()}), flush=True)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def main() -> int:
    ip("netns", "add", A)
    ip("netns", "add", B)
    try:
        veth_a, veth_b = f"gsa{os.getpid() % 100000}", f"gsb{os.getpid() % 100000}"
        ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        ip("link", "set", veth_a, "netns", A)
        ip("link", "set", veth_b, "netns", B)
        for ns, dev, addr in ((A, veth_a, "198.18.0.1/24"), (B, veth_b, "198.18.0.2/24")):
            ip("-n", ns, "addr", "add", addr, "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        # Two separate programs: they share a key to prove to each other who
        # they are (a program and its multiprocessing children need none).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        env.setdefault("GPUSHARE_AUTHKEY", secrets.token_hex(16))
        me = os.path.abspath(__file__)

        def run_in(ns: str, role: str) -> subprocess.Popen:
            return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, me, role], env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

        exp = run_in(B, "export")
        assert exp.stdin is not None and exp.stdout is not None  # both are pipes
        try:
            hello = exp.stdout.readline()
            imp = run_in(A, "import")
            out, _ = imp.communicate(hello, timeout=120)
            result = json.loads(out)
            exp.stdin.write("done\n")
            exp.stdin.flush()
            seen = exp.stdout.readline().strip()
            exp.wait(30)
        finally:
            if exp.poll() is None:
                exp.kill()
        print(f"node a opened node b's share over {result['path']}: {result['why']}")
        print(f"read matches: {result['read_ok']}; node b sees node a's write: {seen == result['wrote']}")
        ok = result["path"] == "ucx-rma" and result["read_ok"] and seen == result["wrote"] and exp.returncode == 0
        print("ok" if ok else "example failed")
        return 0 if ok else 1
    finally:
        subprocess.run(["ip", "netns", "del", A], capture_output=True)
        subprocess.run(["ip", "netns", "del", B], capture_output=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "export":
        exporter()
    elif len(sys.argv) > 1 and sys.argv[1] == "import":
        importer()
    else:
        sys.exit(main())
