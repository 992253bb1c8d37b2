"""Forged UCX worker addresses and remote keys fed to the real UCX calls.

Run as a script inside a network namespace of its own (``unshare -n``), so
that UCX listens only on its loopback and a forged IP address reaches
nobody::

    python _ucx_fuzz_child.py KIND SEED RANDOM START PROGRESS

KIND is ``address``, ``key``, ``local-address`` or ``local-key`` (the last two: an agent on
UCX's one-node transports, its peer proven as this very process, with the address and keys
forged from its own, constructed posix and sysv keys of its own segments among them).  The cases are made from this process's own
worker address or remote key: every one-byte change (0x00, 0xff, +1, -1,
each bit flipped), one-byte deletions and insertions (one right after the
worker uuid among them), truncations, random multi-byte changes (RANDOM of
them, from SEED) and structured forgeries.  Cases from START on go through
the public calls (``Client.connect``, ``Agent.connect``,
``Endpoint.unpack_remote_key``), which validate and then hand the bytes to
UCX; before each one its index and label are appended to the file
PROGRESS, so that a parent whose child died by a signal knows which case
killed it and can start a fresh child after it.  The counts are printed as
one JSON line: refused (by gpushare's checks), ucx_error (accepted, and UCX
reported an error) and accepted (connected, or unpacked and used).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator

_LIBSTDCXX_SEED, _MUL, _M64 = 0xC70F6907, 0xC6A4A7935BD1E995, (1 << 64) - 1


def std_hash(data: bytes) -> int:
    """``std::hash<std::string>`` of libstdc++ (``_Hash_bytes``, 64-bit), which
    libucxx's serialized remote key carries as its checksum."""

    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)

    n = len(data)
    h = (_LIBSTDCXX_SEED ^ (n * _MUL)) & _M64
    aligned = n & ~7
    for i in range(0, aligned, 8):
        d = (shift_mix((int.from_bytes(data[i:i + 8], "little") * _MUL) & _M64) * _MUL) & _M64
        h = ((h ^ d) * _MUL) & _M64
    if n & 7:
        h = ((h ^ int.from_bytes(data[aligned:], "little")) * _MUL) & _M64
    h = (shift_mix(h) * _MUL) & _M64
    return shift_mix(h)


def serialized_key(packed: bytes, base: int, size: int) -> bytes:
    """libucxx's serialized remote key around ``packed``, its checksum right."""
    body = len(packed).to_bytes(8, "little") + packed + base.to_bytes(8, "little") + size.to_bytes(8, "little")
    return std_hash(body).to_bytes(8, "little") + body


def one_byte_changes(blob: bytes) -> Iterator[tuple[str, bytes]]:
    # Twelve per position, whatever the byte: the cases keep their indices in every child
    # (a worker's uuid and ports differ from one process to the next).
    for pos, old in enumerate(blob):
        values = [0x00, 0xFF, (old + 1) & 0xFF, (old - 1) & 0xFF] + [old ^ (1 << bit) for bit in range(8)]
        for value in values:
            b = bytearray(blob)
            b[pos] = value
            yield f"set[{pos}]={value:#04x}", bytes(b)


def edits(blob: bytes, after_uuid: int | None) -> Iterator[tuple[str, bytes]]:
    yield from one_byte_changes(blob)
    for pos in range(len(blob)):
        yield f"delete[{pos}]", blob[:pos] + blob[pos + 1:]
    for pos in range(len(blob) + 1):
        for value in (0x00, 0xFF):
            yield f"insert[{pos}]={value:#04x}", blob[:pos] + bytes([value]) + blob[pos:]
    if after_uuid is not None:
        for value in (0x01, 0x80, 0x20):
            yield f"insert-after-uuid={value:#04x}", blob[:after_uuid] + bytes([value]) + blob[after_uuid:]
    for n in range(len(blob)):
        yield f"truncate[{n}]", blob[:n]


def random_changes(blob: bytes, rng: random.Random, count: int) -> Iterator[tuple[str, bytes]]:
    for i in range(count):
        b = bytearray(blob)
        for _ in range(rng.choice([2, 3, 5, 8, 16])):
            op = rng.random()
            if op < 0.7 or not b:
                if b:
                    b[rng.randrange(len(b))] = rng.randrange(256)
            elif op < 0.85:
                b.insert(rng.randrange(len(b) + 1), rng.randrange(256))
            else:
                del b[rng.randrange(len(b))]
        yield f"random#{i}", bytes(b)


def tcp_devices(raw: bytes) -> list[tuple[int, int]]:
    """(position of the device byte, address length) of each tcp device of a
    v1 worker address as this UCX packs it (no debug info or client id)."""
    from gpushare._ucx import _address

    out, pos = [], 1 + 8
    if raw[0] & 0x0F != 0 or raw[0] >> 4 != 0x2:
        return out  # v2, or other header flags: not walked here
    while pos < len(raw):
        md, dev = raw[pos], raw[pos + 1]
        if md & 0x80:
            break
        length = dev & 0x1F
        start = pos + 1 + 1 + bool(dev & 0x40) + bool(dev & 0x20)
        p = start + length
        is_tcp = False
        while True:
            csum = int.from_bytes(raw[p:p + 2], "little")
            is_tcp |= csum == _address.TL_CSUMS["tcp"]
            p += 2 + 16
            ifl = raw[p]
            p += 1 + (ifl & 0x3F)
            if ifl & 0x80:
                break
        if is_tcp:
            out.append((pos + 1, length))
        if dev & 0x80:
            break
        pos = p
    return out


def address_cases(raw: bytes, rng: random.Random, count: int) -> list[tuple[str, bytes]]:
    cases = list(edits(raw, 1 + 8 if raw[0] & 0x0F == 0 else 2 + 8))
    for dev_pos, length in tcp_devices(raw):
        # The research's P3: a tcp device address length set to 0 and its bytes removed.
        start = dev_pos + 1
        b = raw[:dev_pos] + bytes([raw[dev_pos] & ~0x1F & 0xFF]) + raw[start + length:]
        cases.append((f"tcp-device-length-0@{dev_pos}", b))
        for new in (2, 6, 16, 17, 19, 31):
            if new != length:
                filler = (raw[start:start + length] + bytes(31))[:new]
                cases.append((f"tcp-device-length-{new}@{dev_pos}",
                              raw[:dev_pos] + bytes([(raw[dev_pos] & ~0x1F) | new]) + filler + raw[start + length:]))
    cases += random_changes(raw, rng, count)
    return cases


def key_cases(packed: bytes, base: int, size: int, rng: random.Random, count: int) -> list[tuple[str, bytes]]:
    cases = [(f"packed:{label}", serialized_key(b, base, size)) for label, b in edits(packed, None)]
    cases += [(f"packed:{label}", serialized_key(b, base, size)) for label, b in random_changes(packed, rng, count)]
    # Structured forgeries: memory-domain maps with empty keys (accepted), posix/sysv/cuda_ipc-shaped keys
    # (refused), system devices with distances (as CUDA keys carry) or without a terminator, other memory types.
    mem_type = packed[8]
    for i in range(count // 4 + 8):
        md_map = rng.getrandbits(rng.choice([1, 3, 8, 64])) or 1
        bits = bin(md_map).count("1")
        sizes = [0] * bits if i % 2 == 0 else [rng.choice([0, 0, 12, 24, 40, 255]) for _ in range(bits)]
        body = b"".join(bytes([s]) + bytes(rng.randrange(256) for _ in range(s)) for s in sizes)
        sys_dev = 0xFF if i % 3 else rng.choice([rng.randrange(64), rng.randrange(64) | 0x80, rng.randrange(256)])
        tail = b""
        if sys_dev != 0xFF:  # distances to system devices, as for CUDA memory, mostly with a terminator
            for _ in range(rng.randrange(4)):
                tail += bytes([rng.choice([rng.randrange(64), rng.randrange(256)]), rng.randrange(256),
                               rng.randrange(256)])
            tail += b"\xff" if rng.random() < 0.75 else b""
        mt = mem_type if i % 7 else rng.randrange(16)
        b = md_map.to_bytes(8, "little") + bytes([mt]) + body + bytes([sys_dev]) + tail
        cases.append((f"forged-map#{i}", serialized_key(b, base, size)))
    serialized = serialized_key(packed, base, size)
    # The envelope itself: one-byte changes without a fixed checksum, and some random bytes.
    cases += [(f"serialized:{label}", b) for label, b in one_byte_changes(serialized)]
    cases += [(f"serialized:{label}", b) for label, b in random_changes(serialized, rng, count // 4)]
    # base and size: any range (the key must still be refused or used only inside it).
    for label, (b, s) in {"base+1": (base + 1, size), "size-1": (base, size - 1), "size0": (base, 0),
                          "huge": (base, 1 << 63), "wrap": ((1 << 64) - 8, 16)}.items():
        cases.append((label, serialized_key(packed, b, s)))
    return cases


def _mark(progress: str, index: int, label: str) -> None:
    with open(progress, "a") as f:
        f.write(f"{index} {label}\n")


def run_addresses(seed: int, count: int, start: int, progress: str) -> dict:
    import gpushare.ucx as gu
    from gpushare._ucx import _common, _peer, _server

    node_raw = _common.unpack(_server.server().address, _common.ADDRESS_MAGIC, "a", 1 << 16)[1]
    agent = gu.Agent()
    agent_raw = _common.unpack(agent.address, _common.ADDRESS_MAGIC, "a", 1 << 16)[1]
    rng = random.Random(seed)
    cases = [("node:" + label, b) for label, b in address_cases(node_raw, rng, count)]
    cases += [("agent:" + label, b) for label, b in address_cases(agent_raw, rng, count // 4)]

    def connect(label: str, address: bytes) -> None:
        if label.startswith("node:"):
            _peer.client().connect(address, timeout=1).close(timeout=1)
        else:
            agent.connect(address, timeout=1).close(timeout=1)

    return _connect_each(connect, cases, start, progress)


def _connect_each(connect, cases: list[tuple[str, bytes]], start: int, progress: str) -> dict:
    """``connect(label, address)`` for each case from ``start``, the raw address in its envelope; the counts."""
    import gpushare as gs
    from gpushare._ucx import _common

    seen = {"total": len(cases), "refused": 0, "ucx_error": 0, "accepted": 0}
    for index in range(start, len(cases)):
        label, blob = cases[index]
        _mark(progress, index, label)
        try:
            connect(label, _common.pack(_common.ADDRESS_MAGIC, 0, blob))
            seen["accepted"] += 1
        except gs.InvalidInputError:
            seen["refused"] += 1
        except gs.GpuShareError:
            seen["ucx_error"] += 1
    return seen


def run_keys(seed: int, count: int, start: int, progress: str) -> dict:
    import gpushare.ucx as gu
    from gpushare._ucx import _common, _rkey

    exporter, importer = gu.Agent(), gu.Agent()
    memory = bytearray(range(256)) * 16
    handle = exporter.create_memory_handle(len(memory), memory)
    mtype, serialized = _common.unpack(handle.create_remote_key().serialize(), _common.KEY_MAGIC, "k", 1 << 16)
    packed = _rkey.packed_key(serialized)
    base = int.from_bytes(serialized[-16:-8], "little")
    size = int.from_bytes(serialized[-8:], "little")
    assert serialized_key(packed, base, size) == serialized, "std::hash of libstdc++ differs from the key's"
    ep = importer.connect(exporter.address)
    cases = key_cases(packed, base, size, random.Random(seed), count)
    return _unpack_each(ep, mtype, cases, start, progress, (base, size), bytes(memory))


def _unpack_each(ep, mtype: int, cases: list[tuple[str, bytes]], start: int, progress: str,
                 region: tuple[int, int], memory: bytes) -> dict:
    """Each case from ``start`` through ``ep.unpack_remote_key``; a key accepted for the real
    ``region`` reads 16 bytes inside it, which must be ``memory``'s.  The counts."""
    import gpushare as gs
    from gpushare._ucx import _common

    base, size = region
    seen = {"total": len(cases), "refused": 0, "ucx_error": 0, "accepted": 0}
    for index in range(start, len(cases)):
        label, blob = cases[index]
        _mark(progress, index, label)
        try:
            key = ep.unpack_remote_key(_common.pack(_common.KEY_MAGIC, mtype, blob))
        except gs.InvalidInputError:
            seen["refused"] += 1
            continue
        except gs.GpuShareError:
            seen["ucx_error"] += 1
            continue
        try:
            if (key.base_address, key.size) == (base, size):  # use it, inside the real region only
                out = bytearray(16)
                ep.mem_get(out, base + 32, key).wait(5)
                assert bytes(out) == memory[32:48], f"a get with an accepted key ({label}) read other bytes"
            seen["accepted"] += 1
        except gs.GpuShareError:
            seen["ucx_error"] += 1
        finally:
            key.close()
    return seen


ONE_NODE_AGENT = {"transports": "posix,sysv,cma,tcp,self", "error_handling": False}


def one_node_cases(raw: bytes, rng: random.Random, count: int) -> list[tuple[str, bytes]]:
    """Forgeries of an address on the one-node transports: the fixed and random edits, and each
    4-byte run holding this pid, and each 8-byte segment id, set to other values."""
    import os

    cases = address_cases(raw, rng, count)
    pid = os.getpid().to_bytes(4, "little")
    at = raw.find(pid)
    while at >= 0:
        for other in (0, 1, os.getppid(), (os.getpid() | 1 << 31), 0xFFFFFFFF):
            cases.append((f"pid@{at}={other:#x}", raw[:at] + other.to_bytes(4, "little") + raw[at + 4:]))
        at = raw.find(pid, at + 1)
    return cases


def _own_segment_keys(md_posix: int | None, md_sysv: int | None, base: int, memory: bytes) -> list[tuple[str, bytes]]:
    """Packed keys of this process's own memfd (posix) and System V segment holding ``memory``,
    as UCX 1.21 would pack them for memory at ``base``; the objects stay alive with the process."""
    import ctypes
    import os

    out = []
    if md_posix is not None:
        fd = os.memfd_create("gpushare-fuzz")
        os.write(fd, memory)
        seg = (1 << 63) | (1 << 62) | fd << 30 | os.getpid()
        key = seg.to_bytes(8, "little") + base.to_bytes(8, "little") + len(memory).to_bytes(8, "little")
        out.append(("posix", (1 << md_posix).to_bytes(8, "little") + b"\0" + bytes([24]) + key + b"\xff"))
    if md_sysv is not None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmat.restype = ctypes.c_void_p
        shmid = libc.shmget(0, len(memory), 0o600 | 0o1000)
        addr = libc.shmat(shmid, None, 0)
        ctypes.memmove(addr, memory, len(memory))
        libc.shmctl(shmid, 0, None)  # removed once detached: gone with this process
        key = shmid.to_bytes(4, "little") + base.to_bytes(8, "little")
        out.append(("sysv", (1 << md_sysv).to_bytes(8, "little") + b"\0" + bytes([12]) + key + b"\xff"))
    return out


def run_local_addresses(seed: int, count: int, start: int, progress: str) -> dict:
    import gpushare.ucx as gu
    from gpushare._ucx import _common, _local

    agent = gu.Agent(**ONE_NODE_AGENT)
    raw = _common.unpack(agent.address, _common.ADDRESS_MAGIC, "a", 1 << 16)[1]
    peer = _local.own_peer()
    cases = one_node_cases(raw, random.Random(seed), count)
    return _connect_each(lambda label, address: agent.connect(address, timeout=1, local_peer=peer).close(timeout=1),
                         cases, start, progress)


def run_local_keys(seed: int, count: int, start: int, progress: str) -> dict:
    import gpushare.ucx as gu
    from gpushare._ucx import _address, _common, _local, _rkey

    exporter, importer = gu.Agent(**ONE_NODE_AGENT), gu.Agent(**ONE_NODE_AGENT)
    memory = bytes(range(256)) * 16
    handle = exporter.create_memory_handle(len(memory), bytearray(memory))
    mtype, serialized = _common.unpack(handle.create_remote_key().serialize(), _common.KEY_MAGIC, "k", 1 << 16)
    base = int.from_bytes(serialized[-16:-8], "little")
    size = int.from_bytes(serialized[-8:], "little")
    raw = _common.unpack(exporter.address, _common.ADDRESS_MAGIC, "a", 1 << 16)[1]
    peer = _local.own_peer()
    mds = _address.check_worker_address(raw, raw, peer).md_transports
    md_of = {name: next((md for md, names in mds.items() if name in names), None) for name in ("posix", "sysv")}
    ep = importer.connect(exporter.address, local_peer=peer)
    rng = random.Random(seed)
    genuine = [("cma", _rkey.packed_key(serialized))] + _own_segment_keys(md_of["posix"], md_of["sysv"], base, memory)
    cases: list[tuple[str, bytes]] = []
    for name, packed in genuine:
        cases += [(f"{name}:{label}", b) for label, b in key_cases(packed, base, size, rng, count // len(genuine))]
    return _unpack_each(ep, mtype, cases, start, progress, (base, size), memory)


def fuzz(kind: str, seed: int, count: int, timeout: float = 600, **env: str) -> dict:
    """Run every case of KIND in children of their own network namespace;
    when one dies by a signal, note the case that killed it and go on in a
    fresh child from the next.  The summed counts, and ``crashes``: a list of
    (index, label, exit status) of the cases that killed a child."""
    import os
    import tempfile

    here = os.path.abspath(__file__)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), *sys.path]), **env)
    totals = {"total": 0, "refused": 0, "ucx_error": 0, "accepted": 0}
    crashes: list[tuple[int, str, int]] = []
    start = 0
    with tempfile.TemporaryDirectory() as tmp:
        progress = os.path.join(tmp, "progress")
        while True:
            open(progress, "w").close()
            r = subprocess.run(["unshare", "--net", sys.executable, here, kind, str(seed), str(count), str(start),
                                progress], capture_output=True, text=True, errors="replace", timeout=timeout, env=env)
            with open(progress) as f:
                marks = f.read().split("\n")
            last = [m for m in marks if m]
            if r.returncode == 0:
                seen = json.loads(r.stdout.strip().splitlines()[-1])
                totals["total"] = seen["total"]
                for k in ("refused", "ucx_error", "accepted"):
                    totals[k] += seen[k]
                break
            if not last:
                raise RuntimeError(f"the {kind} fuzz child failed before its first case ({r.returncode}): "
                                   f"{r.stderr[-2000:]}")
            index, label = last[-1].split(" ", 1)
            crashes.append((int(index), label, r.returncode))
            if r.returncode > 0:  # a Python error, not a crash: it would repeat
                raise RuntimeError(f"the {kind} fuzz child failed at case {index} {label}: {r.stderr[-2000:]}")
            start = int(index) + 1
    totals["crashes"] = crashes
    return totals


def main() -> None:
    kind, seed, count, start, progress = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)  # a namespace of its own: nothing leaves it
    run = {"address": run_addresses, "key": run_keys, "local-address": run_local_addresses,
           "local-key": run_local_keys}[kind]
    print(json.dumps(run(seed, count, start, progress)), flush=True)


if __name__ == "__main__":
    main()
