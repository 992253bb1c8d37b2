"""The per-process region server: one worker, capabilities checked per request.

The exporter is a spawned process (tests/_server_peer.py); this process is
the importer.  Everything runs over real UCX (TCP on loopback).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import numpy as np
import pytest

import gpushare
from gpushare._ucx import _peer, _server

from _procs import Child, in_threads
import _server_peer

MiB = 1 << 20
BIG = 64 * MiB


@pytest.fixture(scope="module")
def exporter():
    child = Child(_server_peer.setup_exporter)
    child.call("add", "big", BIG, 1)
    yield child
    child.close()


@pytest.fixture(scope="module")
def peer(exporter):
    return _peer.client().connect(exporter.hello["address"], timeout=30)


@pytest.fixture(scope="module")
def big(exporter):
    return exporter.call("grant", "big")


def _pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize(
    "size,offset", [(1, 0), (8, 3), (4095, 1), (65536, 4096), (65537, 7), (MiB + 3, 11), (BIG, 0)]
)
def test_put_then_get_round_trip(exporter, peer, big, size, offset):
    data = _pattern(size, size)
    peer.put(*big, offset, data, timeout=60)
    # The bytes are in the exporter's memory, checked there.
    assert exporter.call("digest", "big", offset, size) == hashlib.sha256(data).hexdigest()
    out = np.zeros(size, np.uint8)
    peer.get(*big, offset, out, timeout=60)
    assert np.array_equal(out, data)


def test_connect_is_cached_per_exporter(exporter, peer):
    assert _peer.client().connect(exporter.hello["address"]) is peer
    assert peer.alive
    assert "tcp" in peer.transport_info()


def test_get_async_and_await(exporter, peer, big):
    digest = exporter.call("digest", "big", 100, 5000)
    out = bytearray(5000)
    req = peer.get_async(*big, 100, out)
    req.wait(30)
    assert req.done() and req.exception() is None
    assert hashlib.sha256(out).hexdigest() == digest

    async def main():
        data = _pattern(300_000, 9)
        await peer.put_async(*big, 1000, data)
        back = np.zeros_like(data)
        await peer.get_async(*big, 1000, back)
        return data, back

    data, back = asyncio.run(main())
    assert np.array_equal(data, back)


def test_a_wait_that_times_out_leaves_the_transfer_running(exporter, peer, big):
    out = np.zeros(BIG, np.uint8)
    with pytest.raises(gpushare.WaitTimeoutError, match="did not complete within 0"):
        peer.get(*big, 0, out, timeout=0)
    # The buffer stays referenced by the peer until the transfer ends; the
    # peer goes on serving.
    assert any(r._buffer is not None for r in peer._inflight)
    small = bytearray(16)
    peer.get(*big, 0, small, timeout=60)
    assert bytes(small) == exporter.call("read", "big", 0, 16)


def test_threads_share_one_peer(exporter, peer, big):
    """Callers in several threads post and wait at once (each waiter drives
    the worker for a while); every byte lands where it was meant to."""
    def work(t: int) -> None:
        for i in range(50):
            data = _pattern(1000 + 37 * i, 100 * t + i)
            off = t * MiB + 8192 * i
            peer.put(*big, off, data, timeout=60)
            back = np.zeros_like(data)
            peer.get_async(*big, off, back).wait(60)
            assert np.array_equal(back, data)

    errors = in_threads([lambda t=t: work(t) for t in range(4)], 120)
    assert not errors, errors
    data = _pattern(1000 + 37 * 49, 100 * 3 + 49)
    assert exporter.call("read", "big", 3 * MiB + 8192 * 49, data.size) == data.tobytes()


def test_a_batch_larger_than_one_request_message(exporter, peer, big):
    # Gets of a batch travel 4,096 to a request message; 5,000 take two.
    out = np.zeros(5000 * 16, np.uint8)
    items = [(*big, 16 * i, out[16 * i : 16 * (i + 1)]) for i in range(5000)]
    peer.get_batch(items).wait(60)
    assert out.tobytes() == exporter.call("read", "big", 0, out.size)


def test_a_callback_may_wait_on_its_own_request(peer, big):
    # The callback runs inside UCX's progress (in the progress thread or a
    # waiting one); waiting there returns at once and progresses nothing.
    seen = []
    out = np.zeros(BIG, np.uint8)
    req = peer.get_async(*big, 0, out)
    req.add_done_callback(lambda r: seen.append(r.exception(5)))
    req.wait(60)
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [None]


def test_await_a_batch(exporter, peer, big):
    outs = [bytearray(4096) for _ in range(8)]

    async def main():
        req = peer.get_batch([(*big, i * 4096, o) for i, o in enumerate(outs)])
        assert (await req) is req

    asyncio.run(main())
    assert b"".join(outs) == exporter.call("read", "big", 0, 8 * 4096)


# -------------------------------------------------------------- access checks


def test_forged_capabilities_are_refused_and_touch_nothing(exporter, peer, big):
    rid, key = big
    other_rid, other_key = exporter.call("add", "other", 4096, 2), None
    other_rid, other_key = exporter.call("grant", "other")
    before = exporter.call("digest", "big")
    forged = [
        (rid + 1000, key),               # a region that does not exist
        (rid, bytes(16)),                # a key never granted
        (rid, other_key),                # a key of another region
        (other_rid, key),                # the other way round
        (rid, key[:15] + bytes([key[15] ^ 1])),  # one bit off
    ]
    for cap in forged:
        out = np.full(64, 0xAB, np.uint8)
        with pytest.raises(gpushare.AccessDeniedError, match="refused access"):
            peer.get(*cap, 0, out, timeout=30)
        assert (out == 0xAB).all()  # nothing was written here
        with pytest.raises(gpushare.AccessDeniedError):
            peer.put(*cap, 0, np.zeros(64, np.uint8), timeout=30)
    # Large puts (rendezvous) are refused before their data is read, too.
    with pytest.raises(gpushare.AccessDeniedError):
        peer.put(rid, bytes(16), 0, np.zeros(4 * MiB, np.uint8), timeout=30)
    assert exporter.call("digest", "big") == before
    assert exporter.call("stats")["refused"] >= 2 * len(forged) + 1


@pytest.mark.parametrize("keep", [False, True], ids=["copied-once", "kept-by-ucx"])
def test_malformed_requests_are_refused_and_the_server_goes_on(exporter, peer, big, keep):
    """Requests crafted byte by byte (as a hostile importer would) touch
    nothing, on either of the server's request ids (payload copied from
    UCX's receive buffer, or kept by UCX first)."""
    import struct

    rid, key = big
    k0, k1 = struct.unpack("<QQ", key)
    magic = 0x32585347  # "GSX2"

    def header(op=1, req=(1 << 62), region=rid, keys=(k0, k1), offset=0, length=8, m=magic):
        return struct.pack("<IB3xQQQQQQ", m, op, req, region, *keys, offset, length)

    def item(region=rid, keys=(k0, k1), offset=0, length=8):
        return struct.pack("<QQQQQ", region, *keys, offset, length)

    def part(offset):
        return struct.pack("<Q", offset)

    bad = [
        (b"short", b""),                                     # a header of the wrong size
        (header(m=0xDEADBEEF), b""),                          # wrong magic
        (header(op=9), b""),                                  # unknown operation
        (header(op=1), b"x" * 8),                             # a get carrying data
        (header(op=2, length=100), b"x" * 10),                # a put whose data is not its length
        (header(op=1, offset=(1 << 64) - 1, length=2), b""),  # a range that wraps around
        (header(op=2, keys=(k0, k1 ^ 1), length=4), b"evil"), # a put with a forged key
        (header(op=3, length=0), b""),                        # a batch of no items
        (header(op=3, length=5000), item() * 5000),           # more items than one message may hold
        (header(op=3, length=2), item()),                     # fewer items than the header says
        (header(op=3, req=(1 << 64) - 1, length=2), item() * 2),  # request ids that wrap around
        (header(op=3, length=1), item(keys=(0, 0))),          # a batch item with a forged key
        # Gathered puts: the items, then their data.
        (header(op=4, length=0), b""),                        # a batch of no items
        (header(op=4, length=2), item(length=4) + b"evil"),   # fewer items than the header says
        (header(op=4, length=1), item(length=100) + b"x" * 10),  # less data than the items say
        (header(op=4, length=1), item(length=4) + b"x" * 10),    # more data than the items say
        (header(op=4, length=2), item(length=(1 << 64) - 1) + item(length=2) + b"x"),  # lengths that wrap
        (header(op=4, length=1), item(keys=(0, 0), length=4) + b"evil"),  # a forged key
        (header(op=4, req=(1 << 64) - 1, length=2), item(length=1) * 2 + b"ab"),  # request ids that wrap
        (header(op=4, length=5000), item(length=1) * 5000 + b"x" * 5000),  # too many items
        # Parts of a put: the header names the whole put, then the part's offset in it.
        (header(op=5, length=16), b"x" * 8),                  # a part without its offset
        (header(op=2, length=8) + part(0), b"x" * 8),          # a whole put with a part's header
        (header(op=5, length=16) + part(16), b"x" * 8),        # a part starting past the whole
        (header(op=5, length=16) + part(12), b"x" * 8),        # a part running past the whole
        (header(op=5, length=16) + part((1 << 64) - 4), b"x" * 8),  # a part offset that wraps
        (header(op=5, length=16) + part(0), b""),              # an empty part
        (header(op=5, keys=(k0, k1 ^ 1), length=16) + part(0), b"x" * 8),  # a forged key
        (header(op=5, offset=BIG - 8, length=16) + part(0), b"x" * 8),  # in bounds, its whole is not
    ]
    before = exporter.call("digest", "big")
    refused = exporter.call("stats")["refused"]
    for h, payload in bad:
        peer._native._send_raw(h, payload, keep).wait(30.0)
    deadline = time.monotonic() + 30
    while exporter.call("stats")["refused"] < refused + len(bad) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exporter.call("stats")["refused"] >= refused + len(bad)
    assert exporter.call("digest", "big") == before
    out = bytearray(64)
    peer.get(rid, key, 0, out, timeout=30)
    assert bytes(out) == exporter.call("read", "big", 0, 64)


def test_fuzzed_batch_messages_never_touch_what_they_may_not(exporter, peer, big):
    """Random batch messages (gets and gathered puts) with items that name
    the granted region, a region never granted, forged keys, ranges and
    lengths of every kind: the server answers or refuses each and goes on,
    the region no key here names stays untouched, and writes land only
    where an item with the right key pointed."""
    import struct

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    rid, key = big
    k0, k1 = struct.unpack("<QQ", key)
    exporter.call("add", "sentinel", 4096, 21)
    srid, _ = exporter.call("grant", "sentinel")
    sentinel = exporter.call("digest", "sentinel")
    magic = 0x32585347  # "GSX2"
    u64 = st.integers(0, (1 << 64) - 1)
    items = st.lists(st.tuples(
        st.sampled_from([rid, srid, rid + 999, 0]),
        st.sampled_from([(k0, k1), (k0, k1 ^ 1), (0, 0)]),
        st.one_of(st.integers(0, BIG + 10), u64),
        st.one_of(st.integers(0, 300), u64)), min_size=0, max_size=12)

    @settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.sampled_from([3, 4]), items, st.integers(-3, 3), st.integers(-20, 20), u64, st.booleans())
    def fuzz(op, its, count_off, data_off, req, keep):
        body = b"".join(struct.pack("<QQQQQ", r, *k, o, n) for r, k, o, n in its)
        data = b"\xa5" * max(0, sum(min(n, 300) for *_, n in its) + data_off) if op == 4 else b""
        count = max(0, len(its) + count_off)
        h = struct.pack("<IB3xQQQQQQ", magic, op, req, 0, 0, 0, 0, count)
        peer._native._send_raw(h, body + data, keep).wait(30.0)

    fuzz()
    out = bytearray(64)
    peer.get(rid, key, 0, out, timeout=30)  # still serving
    assert bytes(out) == exporter.call("read", "big", 0, 64)
    assert exporter.call("digest", "sentinel") == sentinel


def test_a_put_in_parts_lands_whole_or_not_at_all(exporter, peer, big):
    """Over TCP a put of 512 KiB to 1 MiB travels in parts of 512 KiB, each
    naming the whole put's range: the exporter checks that range (bounds,
    key, writability) for every part, so a refused put writes nothing even
    where a part alone would have fitted."""
    from gpushare._ucx._node import PUT_PART

    rid, key = big
    data = _pattern(MiB - 3, 31)
    stats = exporter.call("stats")
    peer.put(rid, key, 5, data, timeout=30)
    after = exporter.call("stats")
    assert after["messages"] - stats["messages"] == 2  # in two parts
    assert after["served"] - stats["served"] == 2
    assert exporter.call("digest", "big", 5, MiB - 3) == hashlib.sha256(data).hexdigest()

    exporter.call("add", "parts", MiB, 33)
    cap = exporter.call("grant", "parts")
    before = exporter.call("digest", "parts")
    # The first part would fit the region; the whole put does not.
    with pytest.raises(gpushare.OutOfBoundsError):
        peer.put(*cap, MiB - PUT_PART - 10, np.ones(PUT_PART + 100, np.uint8), timeout=30)
    with pytest.raises(gpushare.AccessDeniedError):
        peer.put(cap[0], bytes(16), 0, np.ones(MiB, np.uint8), timeout=30)
    assert exporter.call("digest", "parts") == before
    exporter.call("add", "parts_ro", MiB, 34, True)
    ro = exporter.call("grant", "parts_ro")
    ro_before = exporter.call("digest", "parts_ro")
    with pytest.raises(gpushare.AccessDeniedError, match="read-only"):
        peer.put(*ro, 0, np.ones(MiB, np.uint8), timeout=30)
    assert exporter.call("digest", "parts_ro") == ro_before


def test_fuzzed_parts_write_only_inside_their_whole_put(exporter, peer):
    """Random part messages (whole ranges, part offsets and lengths of every
    kind, right and forged keys, a read-only region): each part lands at its
    whole put's offset plus its own, only where the whole range, the key and
    the region allow; a model of the region written by the same rules
    matches the exporter's memory byte for byte."""
    import struct

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    size = 64 * 1024
    exporter.call("add", "fuzzparts", size, 41)
    rid, key = exporter.call("grant", "fuzzparts")
    exporter.call("add", "fuzzparts_ro", 4096, 42, True)
    ro_rid, ro_key = exporter.call("grant", "fuzzparts_ro")
    ro_before = exporter.call("digest", "fuzzparts_ro")
    model = np.frombuffer(exporter.call("read", "fuzzparts", 0, size), np.uint8).copy()
    k = struct.unpack("<QQ", key)
    magic = 0x32585347  # "GSX2"
    u64 = st.integers(0, (1 << 64) - 1)
    counter = iter(range(1, 1 << 20))

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.sampled_from(["good", "forged", "ro"]), st.one_of(st.integers(0, size + 10), u64),
           st.one_of(st.integers(0, size + 10), u64), st.one_of(st.integers(0, size + 10), u64),
           st.integers(0, 2000), st.booleans())
    def fuzz(who, offset, length, part, n, keep):
        region, keys = {"good": (rid, k), "forged": (rid, (k[0], k[1] ^ 1)),
                        "ro": (ro_rid, struct.unpack("<QQ", ro_key))}[who]
        fill = next(counter) % 251 + 1
        h = struct.pack("<IB3xQQQQQQQ", magic, 5, 1 << 62, region, *keys, offset, length, part)
        peer._native._send_raw(h, bytes([fill]) * n, keep).wait(30.0)
        if (who == "good" and length > 0 and offset <= size and length <= size - offset
                and n > 0 and part <= length and n <= length - part):
            model[offset + part: offset + part + n] = fill

    fuzz()
    out = np.zeros(8, np.uint8)
    peer.get(rid, key, 0, out, timeout=30)  # still serving, and every message served
    assert exporter.call("read", "fuzzparts", 0, size) == model.tobytes()
    assert exporter.call("digest", "fuzzparts_ro") == ro_before


def test_puts_to_a_host_region_are_copied_once_at_the_exporter(exporter, peer):
    """The first put to a region travels on the request id whose payload
    UCX keeps (copying it into a buffer of its own); its answer says the
    region is host memory, and every later put to it travels on the id
    whose payload the server copies straight from UCX's receive buffer into
    the region.  Gets never travel on the keeping id."""
    exporter.call("add", "once", MiB, 5)
    rid, key = exporter.call("grant", "once")
    before = exporter.call("stats")
    sizes = [4096, 65536, 300_000, 1, 65536, 4096]
    for i, size in enumerate(sizes):
        data = _pattern(size, 50 + i)
        peer.put(rid, key, 8 * i, data, timeout=60)
        assert exporter.call("read", "once", 8 * i, size) == data.tobytes()
        out = np.zeros(size, np.uint8)
        peer.get(rid, key, 8 * i, out, timeout=60)
        assert np.array_equal(out, data)
    after = exporter.call("stats")
    assert after["messages"] - before["messages"] == 2 * len(sizes)
    assert after["kept"] - before["kept"] == 1  # the first put only
    # Another region of the same exporter is unknown again: kept once.
    exporter.call("add", "once2", 4096, 6)
    rid2, key2 = exporter.call("grant", "once2")
    for i in range(3):
        peer.put(rid2, key2, 0, _pattern(100, i), timeout=60)
    assert exporter.call("stats")["kept"] - after["kept"] == 1
    assert exporter.call("read", "once2", 0, 100) == _pattern(100, 2).tobytes()


def test_requests_nobody_waits_for_complete_while_another_thread_waits(exporter, peer, big):
    """A thread waiting for its own request progresses the worker while the
    progress thread stands aside; requests that nobody waits for (their
    callbacks only) still complete, during and after those waits, and after
    the progress thread has gone to sleep."""
    import threading

    stop = threading.Event()
    errors = []

    def waiter() -> None:
        out = np.zeros(4096, np.uint8)
        try:
            while not stop.is_set():
                peer.get(*big, 0, out, timeout=60)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def post_many(n: int, offset: int) -> list:
        done = threading.Semaphore(0)
        outs = []
        for i in range(n):
            out = np.zeros(8192, np.uint8)
            outs.append(out)
            req = peer.get_async(*big, offset + 8192 * i, out)
            req.add_done_callback(lambda r: done.release())
        deadline = time.monotonic() + 30
        for _ in range(n):
            assert done.acquire(timeout=max(0.0, deadline - time.monotonic())), "a request never completed"
        return outs

    th = threading.Thread(target=waiter)
    th.start()
    try:
        outs = post_many(200, 0)
    finally:
        stop.set()
        th.join(60)
    assert not errors, errors
    assert b"".join(o.tobytes() for o in outs) == exporter.call("read", "big", 0, 200 * 8192)
    time.sleep(0.5)  # the progress thread sleeps in the kernel again
    outs = post_many(3, 5 * MiB)
    big_put = _pattern(8 * MiB, 77)  # queued by UCX: the sleeping thread is woken for it
    done = []
    peer.put_async(*big, 16 * MiB, big_put).add_done_callback(lambda r: done.append(r.exception(0)))
    deadline = time.monotonic() + 30
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done == [None]
    assert exporter.call("digest", "big", 16 * MiB, big_put.size) == hashlib.sha256(big_put).hexdigest()
    assert b"".join(o.tobytes() for o in outs) == exporter.call("read", "big", 5 * MiB, 3 * 8192)


def test_callbacks_run_in_the_progress_thread_not_in_a_waiting_one(exporter, peer, big):
    """A thread waiting for its own request progresses the worker, and may
    so complete other requests; their callbacks still run in the node's
    progress thread (a callback that blocked, on a lock its caller holds or
    by closing the node, would otherwise stall the worker for everyone).
    Here each callback takes a lock that the waiting thread holds until its
    own get is done, and that get completes."""
    import threading

    lock = threading.Lock()
    where = []
    for i in range(20):
        out = np.zeros(4096, np.uint8)
        registered = []
        ran = threading.Event()

        def callback(req, registered=registered, ran=ran):
            if registered:  # not run at once by add_done_callback (already complete)
                where.append(threading.get_ident())
                with lock:  # held by the thread below until its own get is done
                    pass
            ran.set()

        with lock:
            r = peer.get_async(*big, 4096 * i, out)
            r.add_done_callback(callback)
            registered.append(True)
            mine = np.zeros(64, np.uint8)
            peer.get(*big, 0, mine, timeout=30)
            assert mine.tobytes() == exporter.call("read", "big", 0, 64)
        assert ran.wait(30)
        assert out.tobytes() == exporter.call("read", "big", 4096 * i, 4096)
    assert where, "no callback ran after its registration"
    assert threading.get_ident() not in where


def test_a_callback_may_make_a_synchronous_transfer(exporter, peer, big):
    """Callbacks run in the progress thread outside UCX's progress: one may
    move data synchronously itself (it drives the worker as any waiting
    thread does)."""
    import threading

    got = []
    done = threading.Event()

    def callback(req):
        try:
            inner = np.zeros(256, np.uint8)
            peer.get(*big, 1024, inner, timeout=30)
            got.append(inner.tobytes())
        except BaseException as exc:  # noqa: BLE001 - asserted below
            got.append(exc)
        done.set()

    out = np.zeros(64 * 1024, np.uint8)
    peer.get_async(*big, 0, out).add_done_callback(callback)
    assert done.wait(60)
    assert got == [exporter.call("read", "big", 1024, 256)]


def test_a_callback_may_wait_for_a_request_with_callbacks_of_its_own(exporter, peer, big):
    """A callback (in the progress thread) waits for another request whose
    own callbacks were handed to that same thread: it runs them itself
    instead of waiting for itself."""
    import threading

    seen = []
    done = threading.Event()
    big_out = np.zeros(32 * MiB, np.uint8)
    r2 = peer.get_async(*big, 0, big_out)
    r2.add_done_callback(lambda r: seen.append("r2's callback"))

    def callback(req):
        try:
            r2.wait(30)
            seen.append("waited")
        except BaseException as exc:  # noqa: BLE001 - asserted below
            seen.append(exc)
        done.set()

    peer.get_async(*big, 0, np.zeros(64, np.uint8)).add_done_callback(callback)
    assert done.wait(60)
    assert seen[-1] == "waited" and "r2's callback" in seen, seen
    assert exporter.call("digest", "big", 0, 32 * MiB) == hashlib.sha256(big_out).hexdigest()


def test_gathered_puts_land_and_are_checked_one_by_one(exporter, peer, big):
    rid, key = big
    rng = np.random.default_rng(7)
    # Small ones travel several to a message; the 512 KiB one alone.
    sizes = [1, 7, 4096, 65536, 100, 3, 256 * 1024, 512 * 1024, 65536, 9] + [1000] * 40
    items, offset = [], 2 * MiB
    for n in sizes:
        items.append((rid, key, offset, rng.integers(0, 256, n, dtype=np.uint8)))
        offset += n + 5
    stats = exporter.call("stats")
    peer.put_batch(items, host_regions=True).wait(30)
    after = exporter.call("stats")
    assert after["served"] - stats["served"] == len(items)
    # 50 items, 1.3 MiB: two or three messages of gathered puts and the 512 KiB put alone.
    assert after["messages"] - stats["messages"] <= 4
    for _, _, at, data in items:
        assert exporter.call("read", "big", at, len(data)) == data.tobytes()

    # One forged key among them: the batch fails, that item alone is refused.
    before = exporter.call("read", "big", 0, 64)
    fresh = [(rid, key, 8 * MiB + i * 64, np.full(64, i, np.uint8)) for i in range(10)]
    fresh[4] = (rid, bytes(16), 0, np.full(64, 0xEE, np.uint8))
    with pytest.raises(gpushare.AccessDeniedError):
        peer.put_batch(fresh, host_regions=True).wait(30)
    assert exporter.call("read", "big", 0, 64) == before
    for i, (_, _, at, data) in enumerate(fresh):
        if i != 4:
            assert exporter.call("read", "big", at, 64) == data.tobytes()
    with pytest.raises(gpushare.InvalidInputError, match="bool"):
        peer.put_batch(fresh, host_regions=1)


def test_gathered_puts_to_a_read_only_region_are_refused(exporter, peer):
    exporter.call("add", "ro2", 8192, 13, True)
    cap = exporter.call("grant", "ro2")
    before = exporter.call("digest", "ro2")
    with pytest.raises(gpushare.AccessDeniedError, match="read-only"):
        peer.put_batch([(*cap, i * 100, np.ones(100, np.uint8)) for i in range(5)], host_regions=True).wait(30)
    assert exporter.call("digest", "ro2") == before


@pytest.mark.parametrize("offset,size", [(BIG, 1), (BIG - 1, 2), (BIG - 4096, 8192), (0, BIG + 1),
                                         ((1 << 64) - 16, 8)])
def test_out_of_bounds_is_refused(exporter, peer, big, offset, size):
    before = exporter.call("digest", "big")
    with pytest.raises(gpushare.OutOfBoundsError, match="outside the region"):
        peer.get(*big, offset, np.zeros(size, np.uint8), timeout=30)
    with pytest.raises(gpushare.OutOfBoundsError):
        peer.put(*big, offset, np.ones(size, np.uint8), timeout=30)
    assert exporter.call("digest", "big") == before


def test_bad_arguments_are_refused_before_sending(peer, big):
    rid, key = big
    out = np.zeros(8, np.uint8)
    for bad in [(0, key, 0), (-1, key, 0), (rid, b"short", 0), (rid, "str" * 6, 0), (rid, key, -1),
                (True, key, 0)]:
        with pytest.raises(gpushare.InvalidInputError):
            peer.get(*bad, out, timeout=5)
    with pytest.raises(gpushare.InvalidInputError, match="read-only"):
        peer.get(rid, key, 0, b"immutable", timeout=5)
    with pytest.raises(gpushare.InvalidInputError, match="at least one byte"):
        peer.get(rid, key, 0, bytearray(0), timeout=5)
    with pytest.raises(gpushare.InvalidInputError, match="tuples"):
        peer.get_batch([(rid, key, 0)])


def test_host_buffers_are_pinned_while_in_flight_and_let_go_after(exporter, peer, big):
    """NumPy arrays and Python byte buffers are pinned through the buffer
    protocol for as long as their request is in flight, and let go after."""
    rid, key = big
    data = _pattern(4096, 51)
    peer.put(rid, key, 0, memoryview(data.tobytes()), timeout=30)
    out = bytearray(4096)
    peer.get(rid, key, 0, out, timeout=30)
    assert bytes(out) == data.tobytes()
    out.extend(b"x")  # not pinned any more: it may be resized
    large = bytearray(16 * MiB)
    req = peer.get_async(rid, key, 0, large)
    in_flight = not req.done()
    if in_flight:
        with pytest.raises(BufferError):
            large.extend(b"y")  # pinned while the get is in flight
    req.wait(30)
    assert in_flight  # 16 MiB do not arrive before get_async returns
    large.extend(b"y")
    ro = np.zeros(16, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(gpushare.InvalidInputError, match="read-only"):
        peer.get(rid, key, 0, ro, timeout=5)
    with pytest.raises(gpushare.InvalidInputError, match="contiguous"):
        peer.get(rid, key, 0, np.zeros(32, np.uint8)[::2], timeout=5)


def test_read_only_region_refuses_puts(exporter, peer):
    exporter.call("add", "ro", 8192, 3, True)
    cap = exporter.call("grant", "ro")
    before = exporter.call("digest", "ro")
    with pytest.raises(gpushare.AccessDeniedError, match="read-only"):
        peer.put(*cap, 0, np.ones(100, np.uint8), timeout=30)
    with pytest.raises(gpushare.AccessDeniedError, match="read-only"):
        peer.put(*cap, 0, np.ones(8192, np.uint8), timeout=30)
    assert exporter.call("digest", "ro") == before
    out = bytearray(8192)
    peer.get(*cap, 0, out, timeout=30)
    assert hashlib.sha256(out).hexdigest() == before


def test_revoking_one_importer_leaves_the_others(exporter, peer):
    exporter.call("add", "shared", 1 << 16, 4)
    exporter.call("add", "mine", 1 << 16, 5)
    mine = exporter.call("grant", "shared")
    mine_too = exporter.call("grant", "mine")
    theirs = exporter.call("grant", "shared")
    other = Child(_server_peer.setup_importer)
    try:
        addr = exporter.hello["address"]
        out = bytearray(100)
        peer.get(*mine, 0, out, timeout=30)
        assert other.call("get", addr, theirs, 0, 100) == bytes(out)
        assert exporter.call("revoke", "shared", mine[1]) is True
        # At once: the very next request is refused, reads and writes alike.
        with pytest.raises(gpushare.AccessDeniedError):
            peer.get(*mine, 0, bytearray(100), timeout=30)
        with pytest.raises(gpushare.AccessDeniedError):
            peer.put(*mine, 0, b"x" * 100, timeout=30)
        # The other importer keeps its access, and so do this importer's other regions.
        other.call("put", addr, theirs, 10, b"still here")
        assert exporter.call("read", "shared", 10, 10) == b"still here"
        peer.put(*mine_too, 0, b"mine too", timeout=30)
        assert exporter.call("read", "mine", 0, 8) == b"mine too"
        assert exporter.call("revoke", "shared", mine[1]) is False  # twice is harmless
    finally:
        other.close()


def test_revoking_fails_the_transfers_in_flight_and_returns_after_them(exporter, peer):
    exporter.call("add", "busy", BIG, 8)
    mine, theirs = exporter.call("grant", "busy"), exporter.call("grant", "busy")
    outs = [np.zeros(BIG, np.uint8) for _ in range(4)]
    req = peer.get_batch([(*mine, 0, o) for o in outs])
    # revoke returns once none of the key's transfers touches the region.
    assert exporter.call("revoke", "busy", mine[1]) is True
    with pytest.raises(gpushare.AccessDeniedError):
        req.wait(60)
    with pytest.raises(gpushare.AccessDeniedError):
        peer.get(*mine, 0, bytearray(8), timeout=30)
    out = bytearray(4096)
    peer.get(*theirs, 0, out, timeout=30)
    assert bytes(out) == exporter.call("read", "busy", 0, 4096)
    exporter.call("close", "busy")


def test_closing_a_region_fails_inflight_and_later_requests(exporter, peer):
    exporter.call("add", "doomed", BIG, 6)
    cap = exporter.call("grant", "doomed")
    outs = [np.zeros(BIG, np.uint8) for _ in range(4)]
    req = peer.get_batch([(*cap, 0, o) for o in outs])
    exporter.call("close", "doomed")  # returns once nothing touches the memory any more
    with pytest.raises(gpushare.ClosedError, match="closed"):
        req.wait(60)
    with pytest.raises(gpushare.ClosedError):
        peer.get(*cap, 0, bytearray(8), timeout=30)
    with pytest.raises(gpushare.ClosedError):
        peer.put(*cap, 0, bytes(8), timeout=30)
    assert exporter.call("stats")["regions"] >= 1  # the others are still served
    peer.get(*exporter.call("grant", "big"), 0, bytearray(8), timeout=30)


def test_batched_get_of_64_regions_completes_once(exporter, peer):
    rids = exporter.call("add_many", "b", 64, 65536)
    caps = exporter.call("grant_many", "b", 64)
    assert [c[0] for c in caps] == rids
    outs = [np.zeros(65536, np.uint8) for _ in caps]
    calls = []
    req = peer.get_batch([(rid, key, 0, out) for (rid, key), out in zip(caps, outs, strict=True)])
    req.add_done_callback(lambda r: calls.append(r))
    req.wait(60)
    assert req.kind == "get_batch"
    for i, out in enumerate(outs):
        assert hashlib.sha256(out).hexdigest() == exporter.call("digest", f"b{i}")
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls == [req]
    # put_batch the other way, then one refused item fails the whole batch.
    data = [_pattern(4096, i) for i in range(64)]
    peer.put_batch([(rid, key, 100, d) for (rid, key), d in zip(caps, data, strict=True)]).wait(60)
    assert exporter.call("read", "b63", 100, 4096) == data[63].tobytes()
    bad = [(rid, key, 0, bytearray(16)) for rid, key in caps[:3]] + [(caps[3][0], bytes(16), 0, bytearray(16))]
    with pytest.raises(gpushare.AccessDeniedError):
        peer.get_batch(bad).wait(30)


# -------------------------------------------------------------- scale and idle


def test_thousand_regions_take_no_threads_or_fds(exporter, peer):
    before = exporter.call("counts")
    rids = exporter.call("add_many", "k", 1000, 4096)
    caps = exporter.call("grant_many", "k", 1000)
    after = exporter.call("counts")
    assert after["threads"] == before["threads"]
    assert after["fds"] <= before["fds"] + 2
    assert exporter.call("stats")["regions"] >= 1000
    for i in (0, 499, 999):
        out = bytearray(4096)
        peer.get(*caps[i], 0, out, timeout=30)
        assert hashlib.sha256(out).hexdigest() == exporter.call("digest", f"k{i}")
    assert rids == [c[0] for c in caps]


def test_the_server_costs_two_threads_and_a_few_fds(exporter):
    before, made = exporter.hello["before"], exporter.hello["counts"]
    # UCX's progress thread and its async-event thread, whatever is served later.
    assert made["threads"] - before["threads"] <= 2, (before, made)
    assert made["fds"] - before["fds"] <= 16, (before, made)
    now = exporter.call("counts")
    assert now["threads"] == made["threads"]


def test_idle_server_burns_no_cpu(exporter, peer):
    exporter.call("add_many", "idle", 100, 4096)
    caps = exporter.call("grant_many", "idle", 100)
    for cap in caps[:10]:
        peer.get(*cap, 0, bytearray(64), timeout=30)
    cpu = exporter.call("idle_cpu", 5.0, timeout=30)
    assert cpu < 0.010, f"the idle exporter used {cpu * 1000:.1f} ms of CPU in 5 s"


# -------------------------------------------------------------- failures


def test_dead_exporter_fails_requests_instead_of_hanging():
    child = Child(_server_peer.setup_exporter)
    try:
        child.call("add", "r", 4096, 1)
        cap = child.call("grant", "r")
        p = _peer.client().connect(child.hello["address"], timeout=30)
        p.get(*cap, 0, bytearray(8), timeout=30)
        child.conn.send(("die", ()))
        child.proc.join(10)
        with pytest.raises((gpushare.UCXConnectionError, gpushare.UCXCanceledError, gpushare.UCXError)):
            for _ in range(100):
                p.get(*cap, 0, bytearray(8), timeout=30)
                time.sleep(0.05)
    finally:
        child.close()


def test_a_forked_child_refuses_ucx_and_leaves_the_parents_server(exporter, peer, big):
    # UCX's state of the whole process (its event thread, its locks) does
    # not survive fork: a child of a process that started UCX refuses to
    # start it, clearly, instead of hanging on its first connection.
    srv = _server.server()
    region = srv.add_region(bytearray(b"parent's bytes"))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit code
        code = 1
        try:
            try:
                region.grant()
            except gpushare.ClosedError:
                try:
                    _server.server()
                except gpushare.UnsupportedError as e:
                    if f"forked from process {os.getppid()}" in str(e) and "'spawn'" in str(e):
                        code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    # The parent's objects still work.
    rid, key = region.grant()
    out = bytearray(8)
    peer.get(*big, 0, out, timeout=30)
    region.close()
    with pytest.raises(gpushare.ClosedError):
        region.grant()


def test_starting_ucx_while_another_thread_loads_libraries_does_not_hang():
    """UCX's memory hooks ("reloc" mode) patch every loaded library inside
    dl_iterate_phdr while ucp_init runs; a library loaded by another thread
    at that moment used to leave both threads waiting for each other's
    loader lock forever (a first ucx-rma open racing an import hung so)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent / "_ucx_dlopen_race.py"
    env = dict(os.environ, UCX_MEM_MMAP_HOOK_MODE="reloc")
    for _ in range(3):
        r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.startswith("ok "), r.stdout + r.stderr
        assert int(r.stdout.split()[1]) > 0  # libraries were loaded while UCX started
