"""The seed API's prepared batches (``Endpoint.prepare_put_batch``/``prepare_get_batch``): items
resolved and checked once, posted many times (real processes, loopback, host memory)."""

from __future__ import annotations

import hashlib
import os
import signal
import time

import numpy as np
import pytest

import gpushare
from gpushare import ucx

import _rma_peer
from _procs import Child

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(scope="module")
def sides():
    """(this process's agent, an endpoint to the peer, the peer's key, the peer)."""
    with _rma_peer.connected(8 * MiB) as sides:
        yield sides


def _digest(*parts: np.ndarray) -> str:
    return hashlib.sha256(b"".join(p.tobytes() for p in parts)).hexdigest()


@pytest.mark.parametrize("size", [8, 4 * KiB, 64 * KiB, MiB])
def test_each_post_of_a_put_plan_sends_the_buffers_bytes_of_that_moment(sides, size):
    agent, ep, rk, peer = sides
    n = min(16, (8 * MiB) // size)
    data = [np.zeros(size, np.uint8) for _ in range(n)]
    with ep.prepare_put_batch([(d, rk.base_address + i * size) for i, d in enumerate(data)], rk) as plan:
        assert (plan.kind, len(plan), plan.closed) == ("put", n, False)
        for round_ in range(3):
            for i, d in enumerate(data):
                d[:] = (round_ * 31 + i) % 256
            plan.post().wait(60)
            ep.flush().wait(60)
            assert peer.call("digest", 0, n * size) == _digest(*data), round_
    assert plan.closed


def test_each_post_of_a_get_plan_reads_the_peers_bytes_of_that_moment(sides):
    agent, ep, rk, peer = sides
    outs = [np.zeros(4 * KiB, np.uint8) for _ in range(8)]
    with ep.prepare_get_batch([(o, rk.base_address + (7 - i) * 4 * KiB) for i, o in enumerate(outs)], rk) as plan:
        for round_ in range(3):
            written = bytes((round_ * 7 + i // (4 * KiB)) % 256 for i in range(32 * KiB))
            peer.call("write", 0, written)
            plan.post().wait(60)
            for i, o in enumerate(outs):
                assert o.tobytes() == written[(7 - i) * 4 * KiB:(8 - i) * 4 * KiB], (round_, i)


def test_a_plan_refuses_at_prepare_what_a_batch_refuses_and_keeps_nothing(sides):
    agent, ep, rk, peer = sides
    first = bytearray(4096)
    with pytest.raises(gpushare.OutOfBoundsError, match="item 1"):
        ep.prepare_put_batch([(first, rk.base_address), (b"x" * 4096, rk.base_address + rk.size - 4095)], rk)
    with pytest.raises(gpushare.InvalidInputError, match="read-only"):
        ep.prepare_get_batch([(first, rk.base_address), (b"read-only", rk.base_address)], rk)
    with pytest.raises(gpushare.InvalidInputError, match="at most"):
        ep.prepare_put_batch([(first, rk.base_address)] * (ucx.MAX_BATCH_ITEMS + 1), rk)
    with pytest.raises(gpushare.InvalidInputError, match="unpacked on this endpoint"):
        ep.prepare_put_batch([(first, 0)], object())
    first.extend(b"more")  # a bytearray that still lent its buffer could not grow


def test_a_plan_holds_its_buffers_until_it_is_closed_and_then_refuses_to_post(sides):
    agent, ep, rk, peer = sides
    buf = bytearray(b"\x11" * 4096)
    plan = ep.prepare_put_batch([(buf, rk.base_address)], rk)
    with pytest.raises(BufferError):
        buf.extend(b"x")  # pinned: UCX may read it at any post
    req = plan.post()
    plan.close()
    plan.close()  # idempotent
    req.wait(60)  # the request held the buffer while in flight
    ep.flush().wait(30)
    assert peer.call("read", 0, 4096) == b"\x11" * 4096
    del req
    buf.extend(b"x")  # released
    with pytest.raises(gpushare.ClosedError, match="batch plan is closed"):
        plan.post()
    assert "closed" in repr(plan)


def test_a_plan_refuses_to_post_once_its_key_or_its_endpoint_is_closed(sides):
    agent, ep, rk, peer = sides
    other = agent.connect(peer.hello["address"])
    key = other.unpack_remote_key(peer.hello["key"])
    plan = other.prepare_put_batch([(b"\x01" * 64, key.base_address)], key)
    plan.post().wait(30)
    key.close()
    with pytest.raises(gpushare.ClosedError, match="remote key is closed"):
        plan.post()
    key = other.unpack_remote_key(peer.hello["key"])
    plan = other.prepare_get_batch([(bytearray(64), key.base_address)], key)
    other.close()
    with pytest.raises(gpushare.ClosedError, match="endpoint is closed"):
        plan.post()
    with pytest.raises(gpushare.ClosedError, match="endpoint is closed"):
        other.prepare_put_batch([(b"x", key.base_address)], key)


def test_a_posts_callback_runs_once_and_a_bad_one_is_refused(sides):
    agent, ep, rk, peer = sides
    callback, seen, done = _rma_peer.recorder()
    data = [np.full(64 * KiB, i, np.uint8) for i in range(8)]
    plan = ep.prepare_put_batch([(d, rk.base_address + i * 64 * KiB) for i, d in enumerate(data)], rk)
    with pytest.raises(gpushare.InvalidInputError, match="callable"):
        plan.post("not callable")
    plan.post(callback, "tag").wait(60)
    assert done.wait(30)
    assert seen == [(None, "tag")]
    plan.close()


def test_an_empty_plan_posts_requests_done_at_once(sides):
    agent, ep, rk, peer = sides
    with ep.prepare_put_batch([], rk) as plan:
        req = plan.post()
        assert req.done()
        req.wait(0)


def test_plans_are_made_by_endpoints_only():
    with pytest.raises(TypeError, match="prepare_put_batch"):
        ucx.BatchPlan()


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it has stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat", "rb") as f:
                    states.append(f.read().rsplit(b")", 1)[1].split()[0])
            except FileNotFoundError:
                continue  # a thread that ended meanwhile
        if all(state == b"T" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


@pytest.mark.parametrize("one_shot", [False, True], ids=["plan", "batch"])
def test_a_put_posted_with_flush_completes_only_once_the_peer_has_the_bytes(sides, one_shot):
    """A stopped peer holds a request posted with ``flush=True`` back; once it runs again, its
    memory holds every item's bytes when the request completes."""
    agent, ep, rk, peer = sides
    data = [np.full(8, 40 + i, np.uint8) for i in range(16)]
    items = [(d, rk.base_address + i * 8) for i, d in enumerate(data)]
    with ep.prepare_put_batch(items, rk) as plan:
        plan.post(flush=True).wait(60)  # wired up and warm
        for d in data:
            d += 100
        try:
            _stop(peer.proc.pid)
            req = plan.post(flush=True) if not one_shot else ep.mem_put_batch(items, rk, flush=True)
            time.sleep(0.5)
            assert not req.done(), "a flushed put completed while the peer was stopped"
        finally:
            os.kill(peer.proc.pid, signal.SIGCONT)
        req.wait(60)
        assert peer.call("digest", 0, 16 * 8) == _digest(*data)


def test_flush_true_posts_a_flush_an_empty_batch_shows_it(sides):
    """Over TCP a put's own completion waits for the peer's acknowledgement too, so puts alone
    cannot tell a flushed batch from another; an empty batch can.  With the peer stopped and a
    put in flight, an empty batch completes at once, and one with ``flush=True`` waits for
    that put (a flush of the endpoint) until the peer runs again."""
    agent, ep, rk, peer = sides
    ep.mem_put(b"warm", rk.base_address, rk).wait(60)
    try:
        _stop(peer.proc.pid)
        pending = ep.mem_put(b"held back", rk.base_address, rk)
        assert ep.mem_put_batch([], rk).done()
        flushed = ep.mem_put_batch([], rk, flush=True)
        time.sleep(0.5)
        assert not pending.done()
        assert not flushed.done(), "flush=True posted no flush"
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    flushed.wait(60)
    assert pending.done()
    assert peer.call("read", 0, 9) == b"held back"


def test_flush_is_for_puts_and_a_bool(sides):
    agent, ep, rk, peer = sides
    out = bytearray(8)
    with ep.prepare_get_batch([(out, rk.base_address)], rk) as plan:
        with pytest.raises(gpushare.InvalidInputError, match="puts only"):
            plan.post(flush=True)
    with ep.prepare_put_batch([(out, rk.base_address)], rk) as plan:
        with pytest.raises(gpushare.InvalidInputError, match="must be a bool"):
            plan.post(flush=1)
    with pytest.raises(gpushare.InvalidInputError, match="must be a bool"):
        ep.mem_put_batch([(out, rk.base_address)], rk, flush="yes")
    out.extend(b"x")  # nothing kept pinned by the refusals


def test_a_peer_killed_under_a_flushed_post_fails_it_and_the_posts_after_it():
    child = Child(_rma_peer.setup, 8 * MiB)
    try:
        with ucx.Agent() as agent:
            ep = agent.connect(child.hello["address"])
            rk = ep.unpack_remote_key(child.hello["key"])
            data = [np.full(MiB, i, np.uint8) for i in range(8)]
            with ep.prepare_put_batch([(d, rk.base_address + i * MiB) for i, d in enumerate(data)], rk) as plan:
                plan.post(flush=True).wait(60)
                _stop(child.proc.pid)  # the post cannot finish before the kill
                req = plan.post(flush=True)
                os.kill(child.proc.pid, signal.SIGKILL)
                child.proc.join(10)
                assert isinstance(req.exception(timeout=60), gpushare.UCXError)
                assert isinstance(plan.post(flush=True).exception(timeout=30), gpushare.UCXConnectionError)
                ep.close()
                with pytest.raises(gpushare.ClosedError):
                    plan.post(flush=True)
    finally:
        if child.proc.is_alive():
            os.kill(child.proc.pid, signal.SIGKILL)
        child.close()
