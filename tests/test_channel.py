"""Channels: a ring of shared slots with publish/wait between real processes."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import threading
import time

import numpy as np
import pytest

import gpushare as gs
from gpushare._channel.handle import ChannelHandle

import _channel_peer as peer


def _fds() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # the directory's own fd
    return out


def _leaked(before: dict[str, str], wait: float = 5.0) -> dict[str, str]:
    """Fds opened since ``before`` (leases end in the exporter's threads: give them a moment)."""
    deadline = time.monotonic() + wait
    while True:
        extra = {fd: what for fd, what in _fds().items() if before.get(fd) != what}
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.05)


def _get(results, timeout: float = 60.0):
    item = results.get(timeout=timeout)
    if item[0] == "error":
        pytest.fail(f"child failed:\n{item[1]}")
    return item


def _join(procs, timeout: float = 30.0) -> list[int | None]:
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(5)
    codes = [p.exitcode for p in procs]
    for p in procs:
        p.close()
    return codes


# ---------------------------------------------------------------- the loop


def _warm_up(ctx) -> None:
    """Start what lives as long as the process (exporter, fd broker, forkserver)."""
    with gs.channel(1, consumers=1) as producer, gs.subscribe(producer.handle):
        producer.send(np.zeros(1, np.uint8))
    p = ctx.Process(target=int)
    p.start()
    p.join(30)


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_every_consumer_reads_every_step_zero_copy_in_every_start_method(method):
    ctx = mp.get_context(method)
    shape, dtype, steps = (64, 33), np.int16, 40
    results = ctx.Queue()
    _warm_up(ctx)
    before = _fds()
    producer = gs.channel(shape, dtype, consumers=3, slots=2)
    procs = [ctx.Process(target=peer.consume, args=(producer.handle, results)) for _ in range(3)]
    for p in procs:
        p.start()
    try:
        with producer:
            for t in range(steps):
                with producer.slot(timeout=60) as x:
                    assert x.shape == shape and x.dtype == dtype and x.flags.writeable
                    x[...] = peer.expected(t, shape, dtype)
        reports = sorted(_get(results)[1:] for _ in procs)
    finally:
        codes = _join(procs)
    assert codes == [0, 0, 0]
    assert [r[0] for r in reports] == [0, 1, 2]
    for _, seen, bad, paths, zero_copy, pid in reports:
        assert seen == list(range(steps)) and bad == []
        assert paths == ("host-fd", "host-fd") and zero_copy
    assert producer.closed and producer.step == steps
    assert _leaked(before) == {}  # sockets, eventfd, pipes and memfds are closed


def test_the_producer_never_overwrites_a_slot_a_consumer_still_reads():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with gs.channel(16, np.uint8, consumers=1, slots=1) as producer:
        p = ctx.Process(target=peer.join_and_hold, args=(producer.handle, results, False))
        p.start()
        try:
            producer.send(np.full(16, 1, np.uint8), timeout=30)
            assert _get(results)[:3] == ("holding", 0, 0)
            t0 = time.monotonic()
            with pytest.raises(gs.WaitTimeoutError, match=r"consumer 0 \(pid \d+\) to release step 0"):
                producer.acquire(timeout=0.5)
            assert time.monotonic() - t0 >= 0.45
            assert producer.step == 1
        finally:
            producer.close(timeout=0)
            outcome = _get(results)
            _join([p])
    # the consumer, still waiting for step 1, learns the channel ended
    assert outcome[:2] == ("raised", "ClosedError") and "after 1 steps" in outcome[2]


def test_a_slow_consumer_paces_the_producer_and_sees_every_step():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    steps = 12
    producer = gs.channel((5, 5), np.float64, consumers=2, slots=2)
    procs = [ctx.Process(target=peer.consume, args=(producer.handle, results, hold))
             for hold in (0.0, 0.05)]
    for p in procs:
        p.start()
    try:
        with producer:
            t0 = time.monotonic()
            for t in range(steps):
                producer.send(peer.expected(t, (5, 5), np.float64), timeout=60)
            elapsed = time.monotonic() - t0
        reports = [_get(results) for _ in procs]
    finally:
        _join(procs)
    for r in reports:
        assert r[2] == list(range(steps)) and r[3] == []
    assert elapsed >= (steps - 2) * 0.05 * 0.9  # two slots ahead of the slow one at most


# ---------------------------------------------------------------- deaths


def test_a_consumer_that_dies_breaks_the_channel_for_everyone_within_seconds():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    producer = gs.channel(8, np.int32, consumers=2, slots=1)
    dying = ctx.Process(target=peer.join_and_hold, args=(producer.handle, results, True))
    living = ctx.Process(target=peer.join_and_hold, args=(producer.handle, results, False))
    dying.start()
    living.start()
    try:
        producer.send(np.arange(8, dtype=np.int32), timeout=30)
        held = sorted(_get(results)[1:] for _ in range(2))
        assert [h[1] for h in held] == [0, 0]
        dying_pid = dying.pid
        assert _join([dying]) == [3]
        t0 = time.monotonic()
        with pytest.raises(gs.ChannelBrokenError, match=rf"pid {dying_pid}\) (exited|broke|.*closed)"):
            producer.acquire(timeout=None)  # no timeout: the death itself ends the wait
        assert time.monotonic() - t0 < 5
        with pytest.raises(gs.ChannelBrokenError):
            producer.publish()
        outcome = _get(results)
        assert outcome[:2] == ("raised", "ChannelBrokenError")
        assert "died or closed its connection without leaving" in outcome[2]
    finally:
        producer.close()
        codes = _join([p for p in (dying, living) if p._closed is False])
    assert codes[-1] == 0


def test_a_producer_that_dies_wakes_a_consumer_waiting_without_timeout():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    prod = ctx.Process(target=peer.produce_then_die, args=(results, 3))
    prod.start()
    try:
        handle = _get(results)[1]
        assert isinstance(handle, ChannelHandle)
        with gs.subscribe(handle, timeout=30) as ch:
            assert _get(results) == ("published", 3)
            got = [ch.wait(timeout=30) for _ in range(3)]  # what was published is still read
            assert [s.step for s in got] == [0, 1, 2]
            assert [int(s.array[0]) for s in got] == [0, 1, 2]
            t0 = time.monotonic()
            with pytest.raises(gs.ChannelBrokenError, match=rf"producer \(pid {prod.pid}\) exited"):
                ch.wait()
            assert time.monotonic() - t0 < 5
    finally:
        _join([prod])


def test_a_consumer_waiting_for_ever_learns_of_the_producers_end():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    producer = gs.channel(4, consumers=1)
    p = ctx.Process(target=peer.wait_for_ever, args=(producer.handle, results))
    p.start()
    try:
        assert _get(results) == ("joined", 0)
        producer.acquire(timeout=30)  # joined: the acquire returns
        producer.close()
        outcome = _get(results)
    finally:
        codes = _join([p])
    assert outcome[:2] == ("raised", "ClosedError") and outcome[3] < 5
    assert codes == [0]


def test_a_forked_child_releasing_its_copy_leaves_the_parents_channel_alone():
    with gs.channel(4, np.int32, consumers=1) as producer:
        pid = os.fork()
        if pid == 0:  # the child's copy ends as at its interpreter's exit
            try:
                producer._finalizer()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        with gs.subscribe(producer.handle, timeout=10) as consumer:  # the listener still serves
            producer.send(np.arange(4, dtype=np.int32), timeout=10)
            with consumer.wait(timeout=10) as step:
                assert step.array.tolist() == [0, 1, 2, 3]


# ---------------------------------------------------------------- one process


def test_steps_in_order_wait_for_a_step_and_the_end():
    with gs.channel((3,), np.float32, consumers=1, slots=4) as producer:
        with gs.subscribe(producer.handle) as consumer:
            assert consumer.index == 0 and consumer.zero_copy
            for t in range(4):
                assert producer.send(np.full(3, t, np.float32)) == t
            with consumer.wait(step=2, timeout=5) as step:  # 0 and 1 are released unread
                assert step.step == 2 and step.array.tolist() == [2.0, 2.0, 2.0]
                assert step.array.dtype == np.float32 and not step.array.flags.writeable
            assert step.released
            with pytest.raises(gs.InvalidInputError, match="step 1 was already taken; the next step is 3"):
                consumer.wait(step=1)
            with pytest.raises(gs.InvalidInputError, match="non-negative int"):
                consumer.wait(step=-1)
            with pytest.raises(gs.WaitTimeoutError, match="step 4 was not published within 0.1 s"):
                consumer.wait(step=4, timeout=0.1)
            producer.close()  # waiting for step 4 released step 3 unread: nothing is held
            with pytest.raises(gs.ClosedError, match="closed the channel after 4 steps"):
                consumer.wait(timeout=5)
            assert list(consumer) == []


def test_a_producer_leaving_on_an_error_breaks_the_channel_for_its_consumers():
    consumer = None
    with pytest.raises(RuntimeError, match="loader failed"):
        with gs.channel(4, np.int64, consumers=1) as producer:
            consumer = gs.subscribe(producer.handle, timeout=5)
            producer.send(np.arange(4), timeout=5)
            raise RuntimeError("loader failed")
    with consumer:
        with consumer.wait(timeout=5) as step:  # what was published is still delivered
            assert step.array.tolist() == [0, 1, 2, 3]
        with pytest.raises(gs.ChannelBrokenError, match=r"producer \(pid \d+\) gave up on an error after 1 steps"):
            consumer.wait(timeout=5)


def test_a_consumer_that_leaves_is_no_longer_waited_for():
    with gs.channel(2, np.int8, consumers=2, slots=1) as producer:
        stays, leaves = gs.subscribe(producer.handle), gs.subscribe(producer.handle)
        with stays:
            producer.send(np.array([1, 1], np.int8), timeout=5)
            leaves.wait(timeout=5)  # taken and never released...
            leaves.close()  # ...until it leaves
            for t in range(2, 5):
                stays.wait(timeout=5).release()
                producer.send(np.array([t, t], np.int8), timeout=5)
            with stays.wait(timeout=5) as step:
                assert (step.step, step.array.tolist()) == (3, [4, 4])
            with pytest.raises(gs.ClosedError, match="consumer is closed"):
                leaves.wait(timeout=1)


def test_a_failed_fill_publishes_nothing():
    with gs.channel(4, np.int64, consumers=1) as producer, gs.subscribe(producer.handle) as consumer:
        with pytest.raises(RuntimeError, match="fill failed"), producer.slot(timeout=5) as x:
            x[...] = 99
            raise RuntimeError("fill failed")
        assert producer.step == 0
        with pytest.raises(gs.InvalidInputError, match="publish\\(\\) needs a slot"):
            producer.publish()
        with pytest.raises(gs.InvalidInputError, match="data has shape \\(3,\\)"):
            producer.send(np.zeros(3, np.int64), timeout=5)
        producer.send(np.arange(4), timeout=5)
        with consumer.wait(timeout=5) as step:
            assert step.step == 0 and step.array.tolist() == [0, 1, 2, 3]


async def _produce_five(producer, then) -> None:
    for t in range(5):
        await producer.send_async(np.full((2, 2), t + 1j, np.complex64), timeout=10)
    await then()


def test_async_for_yields_every_step_until_the_producer_closes():
    async def main():
        with gs.channel((2, 2), np.complex64, consumers=1, slots=2) as producer:
            async with gs.subscribe(producer.handle) as consumer:
                task = asyncio.ensure_future(_produce_five(producer, lambda: asyncio.to_thread(producer.close, 10)))
                seen = []
                async for step in consumer:
                    assert step.array.dtype == np.complex64 and step.array.shape == (2, 2)
                    seen.append(complex(step.array[1, 1]))
                await task
            assert consumer.closed
            with pytest.raises(gs.ClosedError, match="consumer is closed"):
                await consumer.wait_async(timeout=0.05)
        return seen

    assert asyncio.run(main()) == [t + 1j for t in range(5)]


def test_asyncio_steps_arrive_in_order():
    async def main():
        with gs.channel((2, 2), np.complex64, consumers=1, slots=2) as producer:
            async with gs.subscribe(producer.handle) as consumer:
                task = asyncio.ensure_future(_produce_five(producer, lambda: producer.drain_async(timeout=10)))
                seen = []
                for _ in range(5):
                    step = await consumer.wait_async(timeout=10)
                    assert step.array.dtype == np.complex64 and step.array.shape == (2, 2)
                    seen.append(complex(step.array[1, 1]))
                    step.release()
                with pytest.raises(gs.WaitTimeoutError, match="step 5 was not published"):
                    await consumer.wait_async(timeout=0.05)
                await task
                return seen

    assert asyncio.run(main()) == [t + 1j for t in range(5)]


# ---------------------------------------------------------------- trust


def test_the_handle_is_plain_data_validated_when_unpickled():
    with gs.channel((2, 3), "<f8", consumers=2, slots=3) as producer:
        h = producer.handle
        assert (h.shape, h.typestr, h.consumers, h.slots, h.device, h.nbytes) == ((2, 3), "<f8", 2, 3, "host", 48)
        assert pickle.loads(pickle.dumps(h)) == h
        assert ChannelHandle.from_bytes(h.to_bytes()) == h
        fields = list(h._fields_)
        names = ChannelHandle._NAMES

        def forged(**changes):
            f = list(fields)
            for k, v in changes.items():
                f[names.index(k)] = v
            return _pickled(f)

        for change, match in [
            (dict(version=2), "format 2"),
            (dict(token=b"x" * 31), "token is 31 bytes"),
            (dict(slots=0), "slots is 0"),
            (dict(slots=2), "2 slots but its handle names 3 shares"),
            (dict(consumers=True), "consumers must be an int"),
            (dict(shape=(2, -3)), "out of range"),
            (dict(shape=(1 << 20, 1 << 20)), "is 8796093022208 bytes|a step needs"),
            (dict(typestr="|O8"), "no portable form"),
            (dict(tcp=(("example.com", 1),)), "not an IPv4 address"),
            (dict(tcp=(("127.0.0.1", 0),)), "tcp port is 0"),
            (dict(unix="gpushare-channel-" + "0" * 32), "does not match the channel id"),
            (dict(shares=("x", "y", "z")), "slot 0 is a str"),
            (dict(device=0), "slot 0 is on host; the channel says 0"),
        ]:
            with pytest.raises(gs.InvalidInputError, match=match):
                forged(**change)
        for bad in (b"", b"{}", b"[1]", h.to_bytes().replace(b'"slots":3', b'"slots":3.0'), b"\xff" * 10,
                    b" " * ((1 << 20) + 1)):
            with pytest.raises(gs.InvalidInputError):
                ChannelHandle.from_bytes(bad)
        with pytest.raises(TypeError, match="made by gpushare.channel"):
            ChannelHandle()
        with pytest.raises(AttributeError):
            h.slots = 4


def _pickled(fields):
    from gpushare._channel import _rebuild_handle

    return _rebuild_handle(*fields)


def test_a_forged_token_is_refused_and_a_fourth_consumer_too():
    with gs.channel(4, consumers=1) as producer:
        fields = list(producer.handle._fields_)
        fields[ChannelHandle._NAMES.index("token")] = bytes(32)
        forged = _pickled(fields)
        with pytest.raises(gs.AccessDeniedError, match="did not prove it holds the channel's token"):
            gs.subscribe(forged, timeout=5)
        with gs.subscribe(producer.handle, timeout=5):
            with pytest.raises(gs.AccessDeniedError, match="already has its 1 consumers"):
                gs.subscribe(producer.handle, timeout=5)


def test_a_silent_connection_delays_no_one_elses_join():
    with gs.channel(4, consumers=1) as producer:
        host, port = next(a for a in producer.handle._field("tcp") if a[0] == "127.0.0.1")
        with socket.create_connection((host, port)) as silent:  # connects, says nothing
            silent.settimeout(10)
            t0 = time.monotonic()
            with gs.subscribe(producer.handle, timeout=10) as consumer:
                assert time.monotonic() - t0 < 2
                assert consumer.index == 0
            assert silent.recv(16) == b""  # dropped after the handshake timeout, given nothing


def test_a_consumer_sending_garbage_breaks_the_channel_not_the_producer():
    from gpushare._channel.join import _connect, _handshake
    from gpushare._channel.records import _MSG

    with gs.channel(4, consumers=1, slots=1) as producer:
        sock = _connect(producer.handle, 5)  # a consumer that holds the handle but speaks nonsense
        with sock:
            assert _handshake(sock, producer.handle) == 0
            producer.send(np.zeros(4, np.uint8), timeout=5)
            sock.sendall(_MSG.pack(4, 0, 7) + _MSG.pack(4, 3, 0))  # releases of steps it was not given
            with pytest.raises(gs.WaitTimeoutError, match="to release step 0"):
                producer.acquire(timeout=0.3)  # change nothing
            sock.sendall(_MSG.pack(99, 0, 0) + b"\xff" * 5)
            with pytest.raises(gs.ChannelBrokenError, match=r"consumer 0 \(pid \d+\) sent a malformed message \(op 99\)"):
                producer.acquire(timeout=5)
        with pytest.raises(gs.ChannelBrokenError):
            producer.acquire(timeout=0)


def test_bad_arguments_say_what_is_expected():
    with pytest.raises(gs.InvalidInputError, match="consumers must be an int from 1"):
        gs.channel(4, consumers=0)
    with pytest.raises(gs.InvalidInputError, match="slots must be an int from 1 to 64"):
        gs.channel(4, consumers=1, slots=65)
    with pytest.raises(gs.InvalidInputError, match="holds no bytes"):
        gs.channel((0, 4), consumers=1)
    with pytest.raises(gs.InvalidInputError, match="no portable form"):
        gs.channel(4, "M8[s]", consumers=1)
    with pytest.raises(gs.InvalidInputError, match="expected 'host'"):
        gs.channel(4, consumers=1, device="gpu")
    with pytest.raises(gs.InvalidInputError, match="expects a gpushare.ChannelHandle"):
        gs.subscribe({"channel": 1})
    with pytest.raises(gs.InvalidInputError, match="timeout must be"):
        with gs.channel(4, consumers=1) as producer:
            producer.acquire(timeout=-1)


def test_keyless_connections_dripping_bytes_never_delay_a_join_and_are_dropped_at_the_join_deadline():
    from gpushare import _control

    with gs.channel(4, consumers=1) as producer:
        host, port = next(a for a in producer.handle._field("tcp") if a[0] == "127.0.0.1")
        # A join that would pass the first checks, sent a byte every second: it never completes.
        frame = _control.pack({"op": "join", "v": 2, "channel": producer.handle.channel_id, "pid": os.getpid(),
                               "nonce": bytes(16)})
        drips = [socket.create_connection((host, port)) for _ in range(64)]
        t_connected = time.monotonic()
        stop = threading.Event()

        def drip() -> None:
            for i in range(len(frame)):
                for s in drips:
                    try:
                        s.send(frame[i : i + 1])
                    except OSError:
                        pass
                if stop.wait(1.0):
                    return

        dripper = threading.Thread(target=drip, daemon=True)
        dripper.start()
        try:
            time.sleep(0.5)  # every dripping connection is accepted and in its join
            t0 = time.monotonic()
            with gs.subscribe(producer.handle, timeout=10) as consumer:
                assert time.monotonic() - t0 < 3
                assert consumer.index == 0
                producer.send(np.arange(4, dtype=np.uint8), timeout=5)
                with consumer.wait(timeout=5) as step:
                    assert step.array.tolist() == [0, 1, 2, 3]
            # The join has a deadline as a whole (5 s), however the bytes are paced.
            for s in drips:
                s.settimeout(max(0.1, t_connected + 9 - time.monotonic()))
                try:
                    assert s.recv(4096) == b""  # dropped, given nothing
                except ConnectionResetError:
                    pass  # dropped while a byte of ours was on its way
            dropped = time.monotonic() - t_connected
            assert 4.5 < dropped < 9
        finally:
            stop.set()
            dripper.join(5)
            for s in drips:
                s.close()


def _task_count() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_producer_with_eight_consumers_has_no_more_threads_than_with_one():
    with gs.channel(1, consumers=1) as warm, gs.subscribe(warm.handle):  # the service thread is running
        warm.send(np.zeros(1, np.uint8), timeout=5)
    counts = {}
    for n in (1, 8):
        with gs.channel(4, consumers=n, slots=2) as producer:
            host, port = next(a for a in producer.handle._field("tcp") if a[0] == "127.0.0.1")
            joining = [socket.create_connection((host, port)) for _ in range(n)]  # in their join, silent
            consumers = [gs.subscribe(producer.handle, timeout=10) for _ in range(n)]
            try:
                producer.send(np.arange(4, dtype=np.uint8), timeout=5)
                for c in consumers:
                    c.wait(timeout=5).release()
                time.sleep(0.3)
                counts[n] = (threading.active_count(), _task_count())
            finally:
                for c in consumers:
                    c.close()
                for s in joining:
                    s.close()
    assert counts[8][0] <= counts[1][0] and counts[8][1] <= counts[1][1], counts


def _frozen_then_killed(pid: int, after: float) -> threading.Timer:
    """SIGSTOP ``pid`` now; SIGKILL it after ``after`` seconds (ends a wait
    that the freeze alone would not)."""
    os.kill(pid, signal.SIGSTOP)
    killer = threading.Timer(after, lambda: os.kill(pid, signal.SIGKILL))
    killer.daemon = True
    killer.start()
    return killer


def test_a_frozen_consumer_breaks_the_producers_wait_without_timeout_within_the_peer_timeout(monkeypatch):
    monkeypatch.setenv("GPUSHARE_PEER_TIMEOUT", "1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    producer = gs.channel(8, np.int32, consumers=1, slots=1)
    p = ctx.Process(target=peer.join_and_hold, args=(producer.handle, results, False))
    p.start()
    killer = None
    try:
        producer.send(np.arange(8, dtype=np.int32), timeout=30)
        assert _get(results)[:3] == ("holding", 0, 0)
        time.sleep(1.5)  # a consumer busy for longer than the peer timeout is not frozen...
        with pytest.raises(gs.WaitTimeoutError):
            producer.acquire(timeout=1.5)  # ...it answers while it holds the step
        killer = _frozen_then_killed(p.pid, 15)
        t0 = time.monotonic()
        with pytest.raises(gs.ChannelBrokenError,
                           match=rf"consumer 0 \(pid {p.pid}\) has not answered for .* stopped by a signal"):
            producer.send(np.arange(8, dtype=np.int32), timeout=None)
        assert time.monotonic() - t0 < 1 + 2.5  # the peer timeout, and a margin
    finally:
        if killer is not None:
            killer.cancel()
        p.kill()
        producer.close(timeout=0)
        _join([p])


def test_a_frozen_producer_breaks_a_consumers_wait_without_timeout_within_the_peer_timeout(monkeypatch):
    monkeypatch.setenv("GPUSHARE_PEER_TIMEOUT", "1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    prod = ctx.Process(target=peer.produce_pausing_then_stay, args=(results, 2.5))
    prod.start()
    killer = None
    try:
        handle = _get(results)[1]
        with gs.subscribe(handle, timeout=30) as ch:
            ch.wait(timeout=30).release()
            # The producer is busy for longer than the peer timeout, in no wait:
            # it still answers, and its next step arrives.
            with ch.wait() as step:
                assert step.step == 1 and int(step.array[0]) == 1
            assert _get(results) == ("published", 2)
            killer = _frozen_then_killed(prod.pid, 15)
            t0 = time.monotonic()
            with pytest.raises(gs.ChannelBrokenError,
                               match=rf"producer \(pid {prod.pid}\) has not answered for .* stopped by a signal"):
                ch.wait()
            assert time.monotonic() - t0 < 1 + 2.5  # the peer timeout, and a margin
            with pytest.raises(gs.ChannelBrokenError):
                ch.wait(timeout=0)
    finally:
        if killer is not None:
            killer.cancel()
        prod.kill()
        _join([prod])


def test_the_handle_pickles_as_before_and_a_join_of_another_protocol_is_refused_saying_why():
    from gpushare import _control
    from gpushare._channel.join import _connect

    with gs.channel(4, consumers=1) as producer:
        for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
            data = pickle.dumps(producer.handle, protocol)
            assert b"gpushare._channel" in data and b"_rebuild_handle" in data and b"_channel.handle" not in data
            assert pickle.loads(data) == producer.handle
        with _connect(producer.handle, 5) as sock:
            _control.send(sock, {"op": "join", "v": 1, "channel": producer.handle.channel_id, "pid": os.getpid(),
                                 "nonce": bytes(16)})
            reply = _control.recv(sock, 5)
            assert reply["ok"] is False and "this producer speaks 2" in reply["message"]
            assert sock.recv(16) == b""
        with _connect(producer.handle, 5) as sock:  # the join of releases before this one
            sock.sendall(b"GSCHAN01" + bytes.fromhex(producer.handle.channel_id) + bytes(36))
            sock.settimeout(5)
            assert sock.recv(16) == b""
        with gs.subscribe(producer.handle, timeout=5) as consumer:
            assert consumer.index == 0


def test_beyond_the_joins_in_progress_a_new_connection_drops_the_oldest(monkeypatch):
    from gpushare._channel import hub

    monkeypatch.setattr(hub, "_MAX_HANDSHAKES", 4)
    with gs.channel(4, consumers=1) as producer:
        host, port = next(a for a in producer.handle._field("tcp") if a[0] == "127.0.0.1")
        silent = []
        try:
            for _ in range(4):
                silent.append(socket.create_connection((host, port)))
                time.sleep(0.05)  # accepted in this order
            t0 = time.monotonic()
            with gs.subscribe(producer.handle, timeout=10) as consumer:  # the fifth join in progress
                assert consumer.index == 0 and time.monotonic() - t0 < 3
            silent[0].settimeout(3)
            assert silent[0].recv(16) == b""  # the oldest went, long before its deadline
            assert time.monotonic() - t0 < 3
            for s in silent[1:]:
                s.setblocking(False)
                with pytest.raises(BlockingIOError):
                    s.recv(16)  # the others are still in their join
        finally:
            for s in silent:
                s.close()


def test_a_connection_reset_by_a_process_that_exited_is_said_as_its_exit():
    """A process that exits with records to it unread resets its connections before its pidfd
    turns readable: the reset is reported as the exit it is, not as a broken connection."""
    import subprocess
    import sys

    from gpushare._channel.waits import _why_gone

    reset = "broke its connection ([Errno 104] Connection reset by peer)"
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    pidfd = os.pidfd_open(proc.pid)
    try:
        proc.wait(30)
        assert _why_gone(reset, pidfd) == "exited"
        assert _why_gone("exited or closed its end", pidfd) == "exited or closed its end"
    finally:
        os.close(pidfd)
    live = os.pidfd_open(os.getpid())
    try:
        t0 = time.monotonic()
        assert _why_gone(reset, live) == reset  # a live process: the reset stands, after a short look
        assert time.monotonic() - t0 < 1
    finally:
        os.close(live)
    assert _why_gone(reset, None) == reset  # a process of another node: nothing to ask
