"""What an endpoint keeps of its requests in flight: each request's buffer until it completes,
and no more, even behind a request that never completes (real processes, loopback)."""

from __future__ import annotations

import os
import signal
import threading
import weakref

import numpy as np

from gpushare import ucx
from gpushare._ucx._common import wake_timeout_ms

import _rma_peer
from _procs import Child

KiB, MiB = 1 << 10, 1 << 20


def test_a_request_that_never_completes_keeps_no_finished_request_behind_it():
    """The request at the head of an endpoint's list is a real get from a stopped peer (posted on
    another endpoint, so that it stays pending while this one's puts complete).  1,000 puts
    posted and never waited for, each from an array of its own, then a flush; then 2,100 small
    puts waited for, which take the list past any length it sweeps at (at most twice the 1,001
    requests ever in flight): every array of the 1,000 is freed, and the list is not 3,100 long."""
    stopped = Child(_rma_peer.setup, MiB)
    try:
        with _rma_peer.connected(MiB) as (agent, ep, rk, peer):
            ep_stopped = agent.connect(stopped.hello["address"])
            rk_stopped = ep_stopped.unpack_remote_key(stopped.hello["key"])
            os.kill(stopped.proc.pid, signal.SIGSTOP)
            try:
                stuck = ep_stopped.mem_get(bytearray(64 * KiB), rk_stopped.base_address, rk_stopped)
                assert not stuck.done()
                ep._track(stuck)  # at the head of this endpoint's list
                arrays = []
                for i in range(1000):
                    a = np.full(4 * KiB, i % 256, np.uint8)
                    arrays.append(weakref.ref(a))
                    ep.mem_put(a, rk.base_address + (i % 16) * 4 * KiB, rk)
                    del a
                ep.flush().wait(60)
                assert peer.call("read", (999 % 16) * 4 * KiB, 4) == bytes([999 % 256] * 4)
                for _ in range(2100):
                    ep.mem_put(b"x", rk.base_address + MiB - 1, rk).wait(60)
                assert not stuck.done()
                alive = sum(r() is not None for r in arrays)
                assert alive == 0, f"{alive} arrays of puts done long ago are still referenced"
                assert len(ep._inflight) < 2100, len(ep._inflight)
            finally:
                os.kill(stopped.proc.pid, signal.SIGCONT)
            stuck.wait(60)
            ep_stopped.close()
    finally:
        stopped.close()


def test_requests_waited_for_leave_nothing_kept():
    with _rma_peer.connected(MiB) as (agent, ep, rk, peer):
        for i in range(200):
            ep.mem_put(np.full(64, i, np.uint8), rk.base_address, rk).wait(60)
        ep.mem_put(b"y", rk.base_address, rk).wait(60)
        assert len(ep._inflight) <= 1


def test_an_agent_on_tcp_and_self_sleeps_without_a_timer_and_still_completes_unwaited_requests():
    """``tcp,self`` sleeps with no epoll timeout (self delivers in the poster's thread): requests
    to itself, never waited for, still run their callbacks, with and without error handling
    (UCX's lanes for them: TCP for the transfers either way, self for wire-up without error
    handling)."""

    assert wake_timeout_ms("tcp,self") == -1
    for error_handling in (False, True):  # self and tcp lanes (error handling rules self out)
        with ucx.Agent(transports="tcp,self", error_handling=error_handling) as agent:
            mh = agent.create_memory_handle(MiB)
            ep = agent.connect(agent.address)
            rk = ep.unpack_remote_key(mh.create_remote_key().serialize())
            for size in (8, 4 * KiB, MiB):
                put_done, get_done = threading.Event(), threading.Event()
                ep.mem_put(np.full(size, size % 251, np.uint8), rk.base_address, rk,
                           callback=lambda e, d: put_done.set())
                assert put_done.wait(10), (error_handling, size)
                dst = np.zeros(size, np.uint8)
                ep.mem_get(dst, rk.base_address, rk, callback=lambda e, d: get_done.set())
                assert get_done.wait(10), (error_handling, size)
                assert (dst == size % 251).all()
            ep.close()
