"""The seed API's batches (``Endpoint.mem_put_batch``/``mem_get_batch``): many buffers as one
request, every item checked before anything is sent (real processes, loopback, host memory)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import gpushare
from gpushare import ucx

from _procs import Child
import _rma_peer

KiB, MiB = 1 << 10, 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def sides():
    """(this process's agent, an endpoint to the peer, the peer's key, the peer)."""
    with _rma_peer.connected(8 * MiB) as sides:
        yield sides


def _pieces(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


@pytest.mark.parametrize("size", [8, 4 * KiB, 64 * KiB, MiB])
def test_a_batch_of_puts_then_of_gets_moves_every_byte(sides, size):
    agent, ep, rk, peer = sides
    n = min(64, (8 * MiB) // size)
    data = _pieces(n, size, size)
    req = ep.mem_put_batch([(d, rk.base_address + i * size) for i, d in enumerate(data)], rk)
    req.wait(60)
    ep.flush().wait(60)
    assert peer.call("digest", 0, n * size) == hashlib.sha256(b"".join(d.tobytes() for d in data)).hexdigest()
    outs = [np.zeros(size, np.uint8) for _ in range(n)]
    ep.mem_get_batch([(o, rk.base_address + (n - 1 - i) * size) for i, o in enumerate(outs)], rk).wait(60)
    for i, o in enumerate(outs):
        assert np.array_equal(o, data[n - 1 - i]), i


def test_registered_and_plain_buffers_mix_in_one_batch(sides):
    agent, ep, rk, peer = sides
    with agent.create_memory_handle(MiB) as mh:
        reg = np.frombuffer(mh.buffer, np.uint8)
        reg[:4096] = 7
        plain = np.full(4096, 9, np.uint8)
        ep.mem_put_batch([(reg[:4096], rk.base_address), (plain, rk.base_address + 4096),
                          (bytes(range(256)) * 16, rk.base_address + 8192)], rk).wait(30)
        ep.flush().wait(30)
        assert peer.call("read", 0, 3 * 4096) == b"\x07" * 4096 + b"\x09" * 4096 + bytes(range(256)) * 16
        del reg


def test_an_empty_batch_is_done_at_once(sides):
    agent, ep, rk, peer = sides
    req = ep.mem_put_batch([], rk)
    assert req.done()
    req.wait(0)
    ep.mem_get_batch(iter(()), rk).wait(0)


def test_an_item_out_of_bounds_refuses_the_whole_batch_before_anything_moves(sides):
    agent, ep, rk, peer = sides
    peer.call("write", 0, b"\x00" * 8192)
    before = peer.call("digest", 0, 8192)
    items = [(b"\x01" * 4096, rk.base_address), (b"\x02" * 4096, rk.base_address + rk.size - 4095)]
    with pytest.raises(gpushare.OutOfBoundsError, match="item 1: put of 4096 bytes .* nothing of the batch was sent"):
        ep.mem_put_batch(items, rk)
    with pytest.raises(gpushare.OutOfBoundsError):
        ep.mem_put_batch([(b"x", rk.base_address - 1)], rk)
    ep.flush().wait(30)
    assert peer.call("digest", 0, 8192) == before


@pytest.mark.parametrize("make, match", [
    (lambda base: [b"abc"], "item 0 of the batch must be a \\(buffer, remote_address\\) pair, not bytes"),
    (lambda base: [(b"abc",)], "item 0 of the batch must be a"),
    (lambda base: [(b"abc", base, 2)], "item 0 of the batch must be a"),
    (lambda base: [(b"abc", base), (b"abc", str(base))], "item 1's remote_address"),
    (lambda base: [(b"abc", -1)], "item 0's remote_address"),
    (lambda base: [(b"abc", 1 << 64)], "item 0's remote_address"),
    (lambda base: [(b"abc", base), (object(), base)], None),
    (lambda base: 42, "items must be an iterable of \\(buffer, remote_address\\) pairs, not int"),
])
def test_bad_items_are_refused_clearly(sides, make, match):
    agent, ep, rk, peer = sides
    with pytest.raises(gpushare.InvalidInputError, match=match):
        ep.mem_put_batch(make(rk.base_address), rk)


def test_more_items_than_a_batch_holds_are_refused(sides):
    agent, ep, rk, peer = sides
    one = (b"x", rk.base_address)
    with pytest.raises(gpushare.InvalidInputError, match=f"at most {ucx.MAX_BATCH_ITEMS} items"):
        ep.mem_put_batch([one] * (ucx.MAX_BATCH_ITEMS + 1), rk)
    with pytest.raises(gpushare.InvalidInputError, match=f"at most {ucx.MAX_BATCH_ITEMS} items"):
        ep.mem_put_batch((one for _ in range(10 ** 9)), rk)  # never drawn to its end
    # As many as it holds: one request, every byte there.
    ep.mem_put_batch([(b"\x05", rk.base_address + i % 4096) for i in range(ucx.MAX_BATCH_ITEMS)], rk).wait(120)
    ep.flush().wait(30)
    assert peer.call("read", 0, 4096) == b"\x05" * 4096


def test_a_refused_batch_releases_the_buffers_it_had_resolved(sides):
    agent, ep, rk, peer = sides
    first = bytearray(4096)
    with pytest.raises(gpushare.InvalidInputError, match="read-only"):
        ep.mem_get_batch([(first, rk.base_address), (b"read-only", rk.base_address)], rk)
    first.extend(b"more")  # a bytearray that still lent its buffer could not grow


def test_a_get_batch_refuses_read_only_buffers(sides):
    agent, ep, rk, peer = sides
    with pytest.raises(gpushare.InvalidInputError, match="read-only"):
        ep.mem_get_batch([(np.zeros(8, np.uint8), rk.base_address), (bytes(8), rk.base_address)], rk)


def test_a_key_of_another_endpoint_is_refused(sides):
    agent, ep, rk, peer = sides
    child = Child(_rma_peer.setup, MiB)
    try:
        other = agent.connect(child.hello["address"])
        with pytest.raises(gpushare.InvalidInputError, match="unpacked on this endpoint"):
            other.mem_put_batch([(b"x", rk.base_address)], rk)
        other.close()
    finally:
        child.close()


def test_the_callback_runs_once_when_every_part_is_done(sides):
    agent, ep, rk, peer = sides
    callback, seen, done = _rma_peer.recorder()
    data = _pieces(32, 64 * KiB, 5)
    req = ep.mem_put_batch([(d, rk.base_address + i * 64 * KiB) for i, d in enumerate(data)], rk,
                           callback, "tag")
    req.wait(60)
    assert done.wait(30)
    assert seen == [(None, "tag")]


def test_a_peer_killed_under_a_batch_fails_it_and_crashes_nothing():
    child = Child(_rma_peer.setup, 8 * MiB)
    with ucx.Agent() as agent:
        ep = agent.connect(child.hello["address"])
        rk = ep.unpack_remote_key(child.hello["key"])
        ep.mem_put(b"warm", rk.base_address, rk).wait(30)
        os.kill(child.proc.pid, signal.SIGSTOP)  # the batch cannot finish before the kill
        outs = [bytearray(MiB) for _ in range(8)]
        req = ep.mem_get_batch([(o, rk.base_address + i * MiB) for i, o in enumerate(outs)], rk)
        os.kill(child.proc.pid, signal.SIGKILL)
        child.proc.join(10)
        child.close()
        err = req.exception(timeout=60)
        assert isinstance(err, gpushare.UCXError), err
        # The endpoint is dead: a new batch fails too, at once.
        late = ep.mem_put_batch([(b"x", rk.base_address)], rk)
        assert isinstance(late.exception(timeout=30), gpushare.UCXConnectionError)
        ep.close()


def test_closing_the_endpoint_while_a_batch_is_posted_crashes_nothing():
    """close() in another thread waits for a batch being posted (65,536 puts, without the GIL), and
    no post starts after it: each batch ends, done, failed, or refused as closed, and the endpoint
    is closed.  The closes come at fractions of a whole batch's time, so that some meet it in
    Python, some while it is posted, some after."""
    with _rma_peer.connected(MiB) as (agent, ep, rk, peer):
        items = [(b"\x06", rk.base_address + i % 4096) for i in range(ucx.MAX_BATCH_ITEMS)]
        start = time.monotonic()
        ep.mem_put_batch(items, rk).wait(60)
        took = time.monotonic() - start
        ep.close()
        for fraction in (0.0, 0.5, 0.8, 0.9, 0.95, 1.0, 1.2):
            ep = agent.connect(peer.hello["address"])
            rk = ep.unpack_remote_key(peer.hello["key"])
            items = [(item, rk.base_address + at - items[0][1]) for item, at in items]
            closer = threading.Timer(fraction * took, ep.close)
            closer.start()
            try:
                req = ep.mem_put_batch(items, rk)
            except (gpushare.ClosedError, gpushare.UCXConnectionError) as exc:  # closed before it was posted
                assert "closed" in str(exc), exc
            else:
                err = req.exception(timeout=60)
                assert err is None or isinstance(err, gpushare.UCXError), err
            closer.join()
            assert ep.closed
            with pytest.raises(gpushare.ClosedError):
                ep.mem_put_batch(items[:1], rk)
        assert peer.call("read", 0, 4) == b"\x06" * 4  # the peer served them all


_OWN_HANDLES = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    from _procs import Child
    import _rma_peer
    from gpushare import ucx
    from gpushare._ucx._loader import native

    child = Child(_rma_peer.setup, 1 << 20)
    with ucx.Agent(config={"RCACHE_ENABLE": "n"}) as agent:
        ep = agent.connect(child.hello["address"])
        rk = ep.unpack_remote_key(child.hello["key"])
        with agent.create_memory_handle(1 << 16) as mh:
            parts = [np.full(64 * 1024, i, np.uint8) for i in range(3)]  # in none of the agent's handles
            items = [(p, rk.base_address + i * 65536) for i, p in enumerate(parts)]
            items.append((np.frombuffer(mh.buffer, np.uint8)[:4096], rk.base_address + 3 * 65536))
            before = native().own_memh_made()
            ep.mem_put_batch(items, rk).wait(30)
            ep.flush().wait(30)
            made = native().own_memh_made() - before
        assert child.call("read", 0, 3 * 65536) == b"".join(p.tobytes() for p in parts)
        print(made)
        ep.close()
    child.close()
""")


def test_a_batch_without_a_registration_cache_gives_each_plain_part_a_handle():
    """As a single request does (tests/test_ucx_rma_registered.py): with UCX's registration
    cache off, each part in none of the agent's handles comes with a handle of gpushare's own,
    and the part in one of them uses it."""
    env = dict(os.environ, UCX_MEM_EVENTS="y")
    env.pop("UCX_RCACHE_ENABLE", None)
    r = subprocess.run([sys.executable, "-c", _OWN_HANDLES, HERE], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == "3", r.stdout
