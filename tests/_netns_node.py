"""One 'node' of the network-namespace test: run as a script inside a namespace.

    python _netns_node.py export SIZE        # prints one JSON line, then serves stdin
    python _netns_node.py import             # reads the exporter's JSON line on stdin
    python _netns_node.py server-export SIZE # the same through the per-process region server
    python _netns_node.py server-import
    python _netns_node.py bundle-export N    # an ordinary dict of N arrays as one bundle
    python _netns_node.py bundle-open
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

from gpushare import ucx


def export(size: int) -> None:
    with ucx.Agent(transports="tcp") as agent, agent.create_memory_handle(size) as mh:
        data = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
        mh.buffer[:size] = data.tobytes()
        key = mh.create_remote_key()
        print(json.dumps({"address": agent.address.hex(), "key": key.serialize().hex(),
                          "digest": hashlib.sha256(data).hexdigest()}), flush=True)
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "digest":
                print(hashlib.sha256(mh.buffer[:size]).hexdigest(), flush=True)
            elif cmd == "exit":
                break


def import_() -> None:
    hello = json.loads(sys.stdin.readline())
    size = int(hello["size"])
    with ucx.Agent(transports="tcp") as agent:
        ep = agent.connect(bytes.fromhex(hello["address"]), timeout=30)
        rk = ep.unpack_remote_key(bytes.fromhex(hello["key"]))
        lane = next(ln for ln in ep.transport_info().splitlines() if "lane[0]" in ln)
        out = np.empty(size, np.uint8)
        ep.mem_get(out, rk.base_address, rk).wait(60)
        got = hashlib.sha256(out).hexdigest()
        reply = np.random.default_rng(6).integers(0, 256, size, dtype=np.uint8)
        ep.mem_put(reply, rk.base_address, rk).wait(60)
        ep.flush().wait(60)
        print(json.dumps({"lane": lane, "get_digest": got, "put_digest": hashlib.sha256(reply).hexdigest()}),
              flush=True)


def share_export(size: int) -> None:
    import pickle

    import gpushare as gs

    arr = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    share = gs.export(arr, lifetime="revoked")
    print(json.dumps({"share": pickle.dumps(share).hex(), "digest": hashlib.sha256(arr).hexdigest()}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "digest":
            print(hashlib.sha256(arr).hexdigest(), flush=True)
        elif cmd == "exit":
            break


def guard_export() -> None:
    """Three shares for one importer on another node: "a" and "b" writable,
    "ro" read-only; revokes one when told, reports the bytes when asked."""
    import gpushare as gs

    arrays = {name: np.full(4096, i + 1, np.uint8) for i, name in enumerate(("a", "b", "ro"))}
    shares = {name: gs.export(arr, lifetime="revoked", readonly=(name == "ro")) for name, arr in arrays.items()}
    print(json.dumps({name: s.to_bytes().hex() for name, s in shares.items()}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "revoke":
            shares[cmd[1]].revoke()
            print(json.dumps({"revoked": cmd[1]}), flush=True)
        elif cmd[0] == "bytes":
            print(json.dumps({n: sorted(set(a.tolist())) for n, a in arrays.items()}), flush=True)
        elif cmd[0] == "exit":
            break


def guard_import() -> None:
    """Open the three shares over ucx-rma and try, through the exporter's
    own checks (the region server, not the view's good manners), every way
    around them; report what the exporter allowed."""
    import gpushare as gs

    shares = {n: gs.Share.from_bytes(bytes.fromhex(h)) for n, h in json.loads(sys.stdin.readline()).items()}
    views = {n: gs.open(s) for n, s in shares.items()}
    result: dict = {"paths": {n: v.path for n, v in views.items()}}

    def attempt(fn) -> str:
        try:
            fn()
            return "allowed"
        except gs.GpuShareError as exc:
            return type(exc).__name__

    peer = views["a"]._transport.peer
    (ra, ka), (rb, kb), (rr, kr) = views["a"]._transport.region, views["b"]._transport.region, views["ro"]._transport.region
    buf = np.zeros(16, np.uint8)
    result["own"] = attempt(lambda: peer.get(ra, ka, 0, buf, 30))
    result["other_region_with_own_key"] = attempt(lambda: peer.get(rb, ka, 0, buf, 30))
    result["forged_key"] = attempt(lambda: peer.get(ra, bytes(16), 0, buf, 30))
    result["past_the_end"] = attempt(lambda: peer.get(ra, ka, 4090, buf, 30))
    result["put_read_only"] = attempt(lambda: peer.put(rr, kr, 0, np.full(16, 9, np.uint8), 30))
    result["put_writable"] = attempt(lambda: peer.put(rb, kb, 0, np.full(16, 7, np.uint8), 30))
    print(json.dumps({"step": "checked"}), flush=True)
    sys.stdin.readline()  # the exporter revoked "a"
    result["revoked_share"] = attempt(lambda: views["a"].get(buf))
    result["revoked_key_directly"] = attempt(lambda: peer.get(ra, ka, 0, buf, 30))
    result["other_share_after"] = attempt(lambda: views["b"].get(buf))
    result["b_bytes"] = sorted(set(buf.tolist()))
    views["b"].close()  # the lease ends: the exporter revokes its key on hearing so
    import time

    deadline = time.monotonic() + 10
    while (outcome := attempt(lambda: peer.get(rb, kb, 0, buf, 30))) == "allowed" and time.monotonic() < deadline:
        time.sleep(0.05)
    result["closed_views_key"] = outcome
    print(json.dumps(result), flush=True)


def _bundle_digest(tree: dict) -> str:
    h = hashlib.sha256()
    for key in sorted(tree):
        h.update(key.encode() + b"\0" + np.ascontiguousarray(tree[key]).tobytes())
    return h.hexdigest()


def bundle_export(count: int) -> None:
    """An ordinary dict of ``count`` arrays, each its own allocation, as one bundle."""
    import pickle

    import gpushare as gs

    tree = {f"w{i}": np.full(64 + i % 7, i % 251, np.uint8) for i in range(count)}
    share = gs.export(tree, lifetime="revoked")
    print(json.dumps({"share": pickle.dumps(share).hex(), "digest": _bundle_digest(tree)}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "digest":
            print(_bundle_digest(tree), flush=True)
        elif cmd == "exit":
            break


def bundle_open() -> None:
    """Open the bundle, get every array, put new values into every one."""
    import pickle

    import gpushare as gs

    share = pickle.loads(bytes.fromhex(json.loads(sys.stdin.readline())["share"]))
    with gs.open(share, timeout=120) as bundle:
        got = bundle.get()
        reply = {k: np.full(v.shape, (int(k[1:]) + 3) % 251, np.uint8) for k, v in got.items()}
        bundle.put(reply)
        print(json.dumps({"paths": sorted(set(bundle.paths)), "get_digest": _bundle_digest(got),
                          "put_digest": _bundle_digest(reply)}), flush=True)


def share_open() -> None:
    import pickle

    import gpushare as gs

    share = pickle.loads(bytes.fromhex(json.loads(sys.stdin.readline())["share"]))
    with gs.open(share) as view:
        out = np.empty(view.nbytes, np.uint8)
        view.get(out)
        reply = np.random.default_rng(8).integers(0, 256, view.nbytes, dtype=np.uint8)
        view.put(reply)
        print(json.dumps({"path": view.path, "why": view.why, "get_digest": hashlib.sha256(out).hexdigest(),
                          "put_digest": hashlib.sha256(reply).hexdigest()}), flush=True)


def server_export(size: int) -> None:
    from gpushare._ucx import _server

    data = np.random.default_rng(9).integers(0, 256, size, dtype=np.uint8)
    region = _server.server().add_region(data)
    rid, key = region.grant()
    print(json.dumps({"address": _server.server().address.hex(), "region": rid, "key": key.hex(),
                      "digest": hashlib.sha256(data).hexdigest()}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "digest":
            print(hashlib.sha256(data).hexdigest(), flush=True)
        elif cmd == "exit":
            region.close()
            break


def server_import() -> None:
    import gpushare
    from gpushare._ucx import _peer

    hello = json.loads(sys.stdin.readline())
    size, rid, key = int(hello["size"]), int(hello["region"]), bytes.fromhex(hello["key"])
    peer = _peer.client().connect(bytes.fromhex(hello["address"]), timeout=30)
    lane = next(ln for ln in peer.transport_info().splitlines() if "lane[0]" in ln)
    out = np.empty(size, np.uint8)
    peer.get(rid, key, 0, out, timeout=60)
    try:
        peer.put(rid, bytes(16), 0, np.zeros(size, np.uint8), timeout=60)
        refused = False
    except gpushare.AccessDeniedError:
        refused = True
    reply = np.random.default_rng(10).integers(0, 256, size, dtype=np.uint8)
    peer.put(rid, key, 0, reply, timeout=60)
    print(json.dumps({"lane": lane, "refused": refused, "get_digest": hashlib.sha256(out).hexdigest(),
                      "put_digest": hashlib.sha256(reply).hexdigest()}), flush=True)


def channel_produce(die: bool) -> None:
    """Publish steps for one consumer on another node; report how the loop ends
    (or, with ``die``, exit without closing after the first step)."""
    import os
    import time

    import gpushare as gs

    producer = gs.channel(16, np.int64, consumers=1, slots=1)
    print(json.dumps({"handle": producer.handle.to_bytes().hex()}), flush=True)
    producer.send(np.arange(16), timeout=60)
    if die:
        sys.stdin.readline()  # the consumer has the step
        os._exit(0)
    t0 = time.monotonic()
    try:
        producer.send(np.arange(16) + 1, timeout=None)  # waits for a release that never comes
        print(json.dumps({"error": None}), flush=True)
    except gs.GpuShareError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0}),
              flush=True)
    producer.close(timeout=0)


def channel_consume(die: bool) -> None:
    """Join from another node, take step 0, then die (or wait for step 1)."""
    import os
    import time

    import gpushare as gs

    handle = gs.ChannelHandle.from_bytes(bytes.fromhex(json.loads(sys.stdin.readline())["handle"]))
    ch = gs.subscribe(handle, timeout=60)
    step = ch.wait(timeout=60)
    print(json.dumps({"step": step.step, "first": int(step.array[1]), "paths": ch.paths}), flush=True)
    if die:
        os._exit(3)  # no leave: as if the node's process crashed
    sys.stdin.readline()  # the producer is gone
    t0 = time.monotonic()
    try:
        ch.wait(timeout=None)
        print(json.dumps({"error": None}), flush=True)
    except gs.GpuShareError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0}),
              flush=True)


def listens() -> None:
    """Print the IPv4 addresses this process's TCP sockets listen on, once its
    region server (a UCX worker) runs: UCX's listeners and the control channel's."""
    import os

    from gpushare._ucx import _server

    _server.server()
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = set()
    with open("/proc/net/tcp") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                raw = bytes.fromhex(fields[1].split(":")[0])[::-1]
                found.add(".".join(map(str, raw)))
    print(json.dumps(sorted(found)), flush=True)


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "listens":
        listens()
        sys.exit(0)
    if role == "export":
        export(int(sys.argv[2]))
    elif role == "share-export":
        share_export(int(sys.argv[2]))
    elif role == "share-open":
        share_open()
    elif role == "bundle-export":
        bundle_export(int(sys.argv[2]))
    elif role == "bundle-open":
        bundle_open()
    elif role == "guard-export":
        guard_export()
    elif role == "guard-import":
        guard_import()
    elif role == "server-export":
        server_export(int(sys.argv[2]))
    elif role == "server-import":
        server_import()
    elif role.startswith("channel-"):
        kind, fate = role.split("-")[1:]
        (channel_produce if kind == "produce" else channel_consume)(fate == "dies")
    else:
        import_()
