"""UCX RMA between two real processes on loopback, host memory."""

from __future__ import annotations

import asyncio
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

MiB = 1 << 20
REGION = 65 * MiB


@pytest.fixture(scope="module")
def peer():
    child = Child(_rma_peer.setup, REGION)
    yield child
    child.close()


@pytest.fixture(scope="module")
def agent():
    a = ucx.Agent()
    yield a
    a.close()


@pytest.fixture(scope="module")
def link(agent, peer):
    """(endpoint, remote key) from this process to the peer's region."""
    ep = agent.connect(peer.hello["address"])
    rk = ep.unpack_remote_key(peer.hello["key"])
    yield ep, rk


def _pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_idle_agent_sleeps_without_a_timer(link, peer):
    # The default agent uses TCP only, whose events wake the progress
    # thread: it sleeps in the kernel with no periodic wake-up.
    ep, _ = link
    assert "tcp" in ep.transport_info()
    cpu = peer.call("idle_cpu", 3.0, timeout=30)
    assert cpu < 0.010, f"an idle agent used {cpu * 1000:.1f} ms of CPU in 3 s"


def test_wake_timeout_follows_the_transports():
    from gpushare._ucx._common import default_transports, wake_timeout_ms

    assert wake_timeout_ms("tcp") == -1
    assert wake_timeout_ms("tcp,cuda_copy") == -1
    assert wake_timeout_ms(default_transports()) == -1
    # self delivers in the sender's own thread.
    for tls in ("tcp,self", "self,tcp,cuda_copy"):
        assert wake_timeout_ms(tls) == -1, tls
    # Shared memory does not wake a sleeping thread; an exclusion list or
    # UCX's own choice may include it.
    for tls in ("sm,self", "tcp,posix", "^cma", "self", "", None):
        assert wake_timeout_ms(tls) == 1


_CUDA_IPC_GETS = """
import os, sys
from gpushare import ucx
from gpushare._ucx._common import cuda_ipc_config
with ucx.Agent() as agent:
    print(repr(cuda_ipc_config()), len(agent.address))
"""


def _agent_with_cuda_ipc_config(env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in env.items() if k != "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"}
    return subprocess.run([sys.executable, "-c", _CUDA_IPC_GETS], capture_output=True, text=True, timeout=120,
                          env=env)


def test_cuda_ipc_gets_are_asked_for_only_where_ucx_has_cuda_ipc():
    # No CUDA driver here: UCX has no cuda_ipc module, whose setting would fail ucp_init (and set
    # in the environment, draw UCX's unused-variable warning).
    r = _agent_with_cuda_ipc_config(dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "{}" and "unused environment variable" not in r.stderr, r.stdout + r.stderr


@pytest.mark.cudadriver
def test_cuda_ipc_gets_are_asked_for_where_ucx_has_cuda_ipc(standin_lib):
    from conftest import standin_env

    r = _agent_with_cuda_ipc_config(standin_env(standin_lib))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("{'CUDA_IPC_ENABLE_GET_ZCOPY': 'y'}"), r.stdout + r.stderr
    assert "unused environment variable" not in r.stderr and "WARN" not in r.stderr, r.stderr


def test_remote_key_reports_the_peer_region(link, peer):
    ep, rk = link
    assert rk.is_remote
    assert rk.base_address == peer.hello["base"]
    assert rk.size == peer.hello["size"] == REGION
    assert rk.handle != 0


@pytest.mark.parametrize(
    "size,offset",
    [(1, 0), (7, 13), (4096, 4096), (65536 + 3, 1), (MiB, 12345), (64 * MiB, 0), (64 * MiB, MiB - 1)],
)
def test_put_then_get_round_trip(link, peer, size, offset):
    ep, rk = link
    data = _pattern(size, size + offset)
    ep.mem_put(data, rk.base_address + offset, rk).wait(60)
    ep.flush().wait(60)
    # The bytes are in the peer's memory, checked by the peer itself.
    assert peer.call("digest", offset, size) == hashlib.sha256(data).hexdigest()
    # And they come back with a get.
    out = np.zeros(size, np.uint8)
    ep.mem_get(out, rk.base_address + offset, rk).wait(60)
    assert np.array_equal(out, data)


@pytest.mark.parametrize("size", [1, 4096, 3 * MiB + 5])
def test_get_reads_what_the_peer_wrote(link, peer, size):
    ep, rk = link
    offset = 999
    digest = peer.call("fill", offset, size, 7)
    out = bytearray(size)
    ep.mem_get(out, rk.base_address + offset, rk).wait(60)
    assert hashlib.sha256(out).hexdigest() == digest


def test_put_and_get_from_the_peer_into_this_process(agent, peer):
    """The other direction: the peer writes into and reads from memory here."""
    mh = agent.create_memory_handle(2 * MiB)
    key = mh.create_remote_key()
    try:
        peer.call("connect", agent.address, key.serialize())
        peer.call("put", 100, b"written by the peer")
        assert bytes(mh.buffer[100:119]) == b"written by the peer"
        mh.buffer[5000:5011] = b"from parent"
        assert peer.call("get", 5000, 11) == b"from parent"
    finally:
        mh.close()


def test_registering_a_numpy_array_exposes_it(agent, peer):
    arr = np.zeros(10000, dtype=np.int32)
    with agent.create_memory_handle(arr.nbytes, arr) as mh:
        assert mh.memory_type == "host"
        assert mh.size == arr.nbytes
        assert mh.base_address == arr.ctypes.data
        assert mh.buffer is arr


def test_callback_runs_with_error_none_and_data(link):
    ep, rk = link
    seen = []
    done = threading.Event()

    def cb(error, data):
        seen.append((error, data))
        done.set()

    req = ep.mem_put(b"abc", rk.base_address, rk, cb, {"tag": 1})
    assert done.wait(30)
    req.wait(30)
    assert seen == [(None, {"tag": 1})]
    assert req.done() and req.exception() is None


def test_add_done_callback_before_and_after_completion(link):
    ep, rk = link
    out = bytearray(MiB)
    req = ep.mem_get(out, rk.base_address, rk)
    calls = []
    req.add_done_callback(lambda r: calls.append(("first", r)))
    req.wait(30)
    # Already complete: runs at once, in this thread.
    req.add_done_callback(lambda r: calls.append(("second", threading.current_thread())))
    deadline = time.monotonic() + 10
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls[0] == ("first", req)
    assert calls[1] == ("second", threading.current_thread())


def test_callback_exception_is_reported_not_swallowed(link, monkeypatch):
    ep, rk = link
    reports = []
    monkeypatch.setattr(sys, "unraisablehook", lambda args: reports.append(args))
    done = threading.Event()

    def bad(error, data):
        try:
            raise RuntimeError("boom in callback")
        finally:
            done.set()

    ep.mem_put(b"x", rk.base_address, rk, bad).wait(30)
    assert done.wait(30)
    deadline = time.monotonic() + 10
    while not reports and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(reports) == 1
    assert isinstance(reports[0].exc_value, RuntimeError)
    assert "boom in callback" in str(reports[0].exc_value)


def test_await_put_and_get(link, peer):
    ep, rk = link

    async def main():
        data = _pattern(100_000, 3)
        req = ep.mem_put(data, rk.base_address + 10, rk)
        assert (await req) is req
        await ep.flush()
        out = np.zeros_like(data)
        await ep.mem_get(out, rk.base_address + 10, rk)
        return data, out

    data, out = asyncio.run(main())
    assert np.array_equal(data, out)
    assert peer.call("digest", 10, data.size) == hashlib.sha256(data).hexdigest()


def test_many_outstanding_requests_all_complete(link):
    ep, rk = link
    chunks = [_pattern(4096, i) for i in range(64)]
    reqs = [ep.mem_put(c, rk.base_address + i * 4096, rk) for i, c in enumerate(chunks)]
    ep.flush().wait(30)
    for r in reqs:
        r.wait(30)
    out = np.zeros(64 * 4096, np.uint8)
    ep.mem_get(out, rk.base_address, rk).wait(30)
    assert np.array_equal(out, np.concatenate(chunks))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "offset,size",
    [(-1, 1), (REGION, 1), (REGION - 1, 2), (0, REGION + 1), (-(1 << 20), 16)],
)
def test_out_of_bounds_is_refused_before_ucx(link, peer, offset, size):
    ep, rk = link
    peer.call("write", 0, b"\x11" * 16)
    peer.call("write", REGION - 16, b"\x22" * 16)
    data = np.full(size, 0xEE, np.uint8)
    with pytest.raises(gpushare.OutOfBoundsError, match="outside the key's region"):
        ep.mem_put(data, rk.base_address + offset, rk)
    with pytest.raises(gpushare.OutOfBoundsError):
        ep.mem_get(np.zeros(size, np.uint8), rk.base_address + offset, rk)
    # Nothing reached the peer.
    assert peer.call("read", 0, 16) == b"\x11" * 16
    assert peer.call("read", REGION - 16, 16) == b"\x22" * 16


def test_bad_remote_address_types(link):
    ep, rk = link
    for bad in (None, 1.5, "0x10", True):
        with pytest.raises(gpushare.InvalidInputError):
            ep.mem_put(b"x", bad, rk)
    with pytest.raises(gpushare.InvalidInputError):
        ep.mem_put(b"x", 1 << 64, rk)


def test_nbytes_larger_than_buffer_is_refused(link):
    ep, rk = link
    with pytest.raises(gpushare.InvalidInputError, match="buffer holds 10 bytes; the get needs 11"):
        ep.mem_get(bytearray(10), rk.base_address, rk, nbytes=11)
    with pytest.raises(gpushare.InvalidInputError, match="the put needs 100"):
        ep.mem_put(b"short", rk.base_address, rk, nbytes=100)


def test_nbytes_smaller_than_buffer_moves_only_that(link, peer):
    ep, rk = link
    peer.call("write", 0, b"." * 8)
    ep.mem_put(b"ABCDEFGH", rk.base_address, rk, nbytes=3).wait(30)
    ep.flush().wait(30)
    assert peer.call("read", 0, 8) == b"ABC....."


def test_get_into_readonly_buffer_is_refused(link):
    ep, rk = link
    with pytest.raises(gpushare.InvalidInputError, match="read-only"):
        ep.mem_get(b"immutable", rk.base_address, rk)
    ro = np.zeros(16, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(gpushare.InvalidInputError, match="read-only"):
        ep.mem_get(ro, rk.base_address, rk)


def test_non_buffers_and_strided_arrays_are_refused(link):
    ep, rk = link
    with pytest.raises(gpushare.InvalidInputError, match="not a buffer"):
        ep.mem_put(object(), rk.base_address, rk)
    strided = np.zeros(100, np.uint8)[::2]
    with pytest.raises(gpushare.InvalidInputError):
        ep.mem_put(strided, rk.base_address, rk)


def _key_variants(blob: bytes) -> dict[str, bytes]:
    body = bytearray(blob)
    body[-5] ^= 0xFF
    header = bytearray(blob)
    header[0:4] = b"XXXX"
    version = bytearray(blob)
    version[4] = 99
    return {
        "empty": b"",
        "truncated-header": blob[:10],
        "truncated-body": blob[:-1],
        "extended": blob + b"\0",
        "corrupted": bytes(body),
        "foreign": bytes(header),
        "future-version": bytes(version),
        "random": os.urandom(len(blob)),
    }


@pytest.mark.parametrize(
    "variant",
    ["empty", "truncated-header", "truncated-body", "extended", "corrupted", "foreign", "future-version", "random"],
)
def test_malformed_key_blobs_raise_clearly(link, peer, variant):
    ep, rk = link
    blob = _key_variants(peer.hello["key"])[variant]
    with pytest.raises(gpushare.InvalidInputError):
        ep.unpack_remote_key(blob)
    # The endpoint still works afterwards.
    ep.mem_put(b"ok", rk.base_address, rk).wait(30)


def test_key_with_valid_envelope_but_broken_ucxx_layout(link, peer):
    """A blob whose outer checksum is right but whose inner layout lies."""
    import struct
    import zlib

    ep, _ = link
    blob = peer.hello["key"]
    payload = bytearray(blob[16:])
    payload[8:16] = struct.pack("<Q", 1 << 40)  # packed key length far beyond the blob
    forged = struct.pack("<4sHHII", b"GSRK", 1, 0, len(payload), zlib.crc32(payload)) + bytes(payload)
    with pytest.raises(gpushare.InvalidInputError, match="packed key"):
        ep.unpack_remote_key(forged)


def test_non_bytes_key_is_refused(link):
    ep, _ = link
    with pytest.raises(gpushare.InvalidInputError, match="must be bytes"):
        ep.unpack_remote_key("not bytes")


def test_key_from_another_endpoint_is_refused(agent, peer, link):
    _, rk = link
    other = agent.connect(peer.hello["address"])
    try:
        with pytest.raises(gpushare.InvalidInputError, match="unpacked on this endpoint"):
            other.mem_put(b"x", rk.base_address, rk)
        with pytest.raises(gpushare.InvalidInputError, match="unpacked on this endpoint"):
            other.mem_put(b"x", rk.base_address, "not a key")
    finally:
        other.close()


def test_local_key_cannot_be_used_for_transfers(agent, link):
    ep, _ = link
    with agent.create_memory_handle(4096) as mh:
        local = mh.create_remote_key()
        assert not local.is_remote and local.handle == 0
        with pytest.raises(gpushare.InvalidInputError):
            ep.mem_put(b"x", local.base_address, local)


@pytest.mark.parametrize("blob", [b"", b"GSUA", b"garbage" * 10, 12345])
def test_connect_to_garbage_address_is_refused(agent, blob):
    with pytest.raises(gpushare.InvalidInputError):
        agent.connect(blob)


def test_handles_cannot_be_built_directly():
    for cls in (ucx.Endpoint, ucx.MemoryHandle, ucx.RemoteKey, ucx.Request):
        with pytest.raises(TypeError):
            cls()


def test_create_memory_handle_argument_checks(agent):
    with pytest.raises(gpushare.InvalidInputError):
        agent.create_memory_handle(0)
    with pytest.raises(gpushare.InvalidInputError):
        agent.create_memory_handle(-5)
    with pytest.raises(gpushare.InvalidInputError):
        agent.create_memory_handle(True)
    with pytest.raises(gpushare.InvalidInputError, match="holds only 8 bytes"):
        agent.create_memory_handle(9, bytearray(8))
    with pytest.raises(gpushare.InvalidInputError, match="buffer is host memory"):
        agent.create_memory_handle(8, bytearray(8), memory_type="cuda")
    with pytest.raises(gpushare.InvalidInputError, match="memory_type"):
        agent.create_memory_handle(8, memory_type="gpu")


def test_allocated_size_rounds_up_to_pages(agent):
    with agent.create_memory_handle(10) as mh:
        assert mh.size >= 10 and mh.size % 4096 == 0
        assert len(mh.buffer) == mh.size


def test_agent_argument_checks():
    with pytest.raises(gpushare.InvalidInputError):
        ucx.Agent(progress="sometimes")
    with pytest.raises(gpushare.InvalidInputError):
        ucx.Agent(error_handling="yes")
    with pytest.raises(gpushare.InvalidInputError):
        ucx.Agent(config={"TLS": 5})


# ---------------------------------------------------------------- lifetimes


def test_use_after_close_raises(peer):
    a = ucx.Agent()
    ep = a.connect(peer.hello["address"])
    rk = ep.unpack_remote_key(peer.hello["key"])
    mh = a.create_memory_handle(4096)
    mh.close()
    mh.close()  # idempotent
    with pytest.raises(gpushare.ClosedError):
        mh.create_remote_key()
    with pytest.raises(gpushare.ClosedError):
        _ = mh.base_address
    ep.close()
    ep.close()
    with pytest.raises(gpushare.ClosedError):
        ep.mem_put(b"x", rk.base_address, rk)
    with pytest.raises(gpushare.ClosedError):
        ep.flush()
    rk.close()
    with pytest.raises(gpushare.ClosedError):
        _ = rk.size
    a.close()
    a.close()
    assert a.closed
    with pytest.raises(gpushare.ClosedError):
        a.connect(peer.hello["address"])
    with pytest.raises(gpushare.ClosedError):
        a.create_memory_handle(10)
    with pytest.raises(gpushare.ClosedError):
        _ = a.address


def test_agent_close_closes_its_endpoints_and_handles(peer):
    with ucx.Agent() as a:
        ep = a.connect(peer.hello["address"])
        mh = a.create_memory_handle(4096)
    assert a.closed and ep.closed and mh.closed
    with pytest.raises(gpushare.ClosedError):
        ep.flush()


def test_closed_handle_memory_is_zeroed_and_stays_mapped(agent, peer):
    """A peer holding a stale key cannot read old data nor corrupt reused memory."""
    mh = agent.create_memory_handle(8192)
    key = mh.create_remote_key()
    view = mh.buffer
    view[:6] = b"secret"
    peer.call("connect", agent.address, key.serialize())
    assert peer.call("get", 0, 6) == b"secret"
    mh.close()
    # The range is still mapped (no crash) and holds zeros now.
    assert bytes(view[:6]) == b"\0" * 6
    assert peer.call("get", 0, 6) == b"\0" * 6


def test_wait_timeout_while_peer_is_stopped(agent):
    child = Child(_rma_peer.setup, MiB)
    try:
        ep = agent.connect(child.hello["address"])
        rk = ep.unpack_remote_key(child.hello["key"])
        os.kill(child.proc.pid, signal.SIGSTOP)
        try:
            out = bytearray(256 * 1024)
            req = ep.mem_get(out, rk.base_address, rk)
            with pytest.raises(gpushare.WaitTimeoutError):
                req.wait(0.5)
            assert not req.done()
        finally:
            os.kill(child.proc.pid, signal.SIGCONT)
        req.wait(30)
        assert req.done()
        ep.close()
    finally:
        child.close()


def test_dead_peer_fails_outstanding_and_new_requests(agent):
    child = Child(_rma_peer.setup, 8 * MiB)
    ep = agent.connect(child.hello["address"])
    rk = ep.unpack_remote_key(child.hello["key"])
    os.kill(child.proc.pid, signal.SIGSTOP)
    pending = ep.mem_get(bytearray(8 * MiB), rk.base_address, rk)
    os.kill(child.proc.pid, signal.SIGKILL)
    child.proc.join(10)
    child.close()
    err = pending.exception(timeout=60)
    assert isinstance(err, gpushare.UCXError), err
    # The endpoint is dead: new requests fail too, within a bounded time.
    start = time.monotonic()
    with pytest.raises(gpushare.UCXError):
        ep.mem_get(bytearray(16), rk.base_address, rk).wait(60)
    assert time.monotonic() - start < 60
    assert not ep.alive
    ep.close()


_FAILED_ENDPOINT = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, sys.argv[1])
    from _procs import Child
    import _rma_peer
    import gpushare
    from gpushare import ucx

    agent = ucx.Agent()
    child = Child(_rma_peer.setup, 1 << 20)
    ep = agent.connect(child.hello["address"])
    rk = ep.unpack_remote_key(child.hello["key"])
    ep.mem_get(bytearray(16), rk.base_address, rk).wait(30)
    os.kill(child.proc.pid, signal.SIGKILL)
    child.proc.join(10)
    child.close()
    deadline = time.monotonic() + 30
    while ep.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not ep.alive
    for request in (ep.mem_get(bytearray(16), rk.base_address, rk), ep.mem_put(b"x" * 16, rk.base_address, rk),
                    ep.flush()):
        assert request.done(), "a request on a failed endpoint did not fail at once"
        assert isinstance(request.exception(timeout=5), gpushare.UCXConnectionError), request.exception()
    ep.close()
    agent.close()
    print("done")
""")


def test_requests_on_a_failed_endpoint_fail_at_once_and_leave_nothing_behind():
    """Once an endpoint's peer has failed, gets, puts and flushes on it fail
    at once without reaching UCX: posted there, each left an operation UCX
    never completed (it warned of it when the worker went)."""
    out = subprocess.run([sys.executable, "-c", _FAILED_ENDPOINT, os.path.dirname(__file__)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("done")
    assert "not flushed" not in out.stderr, out.stderr


def test_connect_to_dead_peer_fails_within_timeout(agent):
    child = Child(_rma_peer.setup, 4096)
    address = child.hello["address"]
    child.call("close_agent")
    child.close()
    start = time.monotonic()
    with pytest.raises(gpushare.UCXConnectionError):
        agent.connect(address, timeout=20)
    assert time.monotonic() - start < 30


def test_agent_refuses_use_after_fork(peer):
    a = ucx.Agent()
    try:
        pid = os.fork()
        if pid == 0:  # child
            code = 1
            try:
                _ = a.address
            except gpushare.ClosedError as exc:
                code = 0 if "does not survive fork" in str(exc) else 2
            except BaseException:
                code = 3
            finally:
                a.close()  # must not touch the parent's UCX state or hang
            if code == 0:  # nor does a new agent start UCX here: it would hang
                try:
                    ucx.Agent()
                    code = 4
                except gpushare.UnsupportedError as exc:
                    code = 0 if f"forked from process {os.getppid()}" in str(exc) else 5
                except BaseException:
                    code = 6
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        # The parent's agent still works.
        ep = a.connect(peer.hello["address"])
        ep.flush().wait(10)
    finally:
        a.close()


def test_objects_dropped_without_close_exit_cleanly(peer):
    code = textwrap.dedent(
        f"""
        from gpushare import ucx
        a = ucx.Agent()
        ep = a.connect({peer.hello['address']!r})
        rk = ep.unpack_remote_key({peer.hello['key']!r})
        mh = a.create_memory_handle(1 << 20)
        key = mh.create_remote_key()
        req = ep.mem_get(bytearray(1 << 20), rk.base_address, rk)
        print("leaving without close")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "leaving without close" in r.stdout
    assert "Traceback" not in r.stderr


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_repeated_agents_do_not_leak_fds_or_threads(peer):
    def cycle():
        with ucx.Agent() as a:
            ep = a.connect(peer.hello["address"])
            rk = ep.unpack_remote_key(peer.hello["key"])
            ep.mem_get(bytearray(4096), rk.base_address, rk).wait(30)
            with a.create_memory_handle(4096) as mh:
                mh.create_remote_key()

    cycle()  # UCX sets up process-wide state on first use
    fds, threads = _fd_count(), threading.active_count()
    for _ in range(5):
        cycle()
    assert _fd_count() <= fds
    assert threading.active_count() <= threads


def _native_threads() -> dict[int, str]:
    """Every thread of this process, Python's or not: {tid: name}."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out[int(tid)] = f.read().strip()
        except FileNotFoundError:
            pass  # it ended meanwhile
    return out


def test_agents_run_on_the_progress_engine_not_on_libucxx_threads(link, peer):
    # An agent's worker is progressed as the region server's is: by one
    # progress thread of gpushare's engine, and by the thread waiting for a
    # request; libucxx starts no progress thread of its own, and waiting
    # starts none either.
    ep0, rk0 = link  # UCX's threads of the whole process exist by now
    at = rk0.base_address + REGION - 65536
    ep0.mem_get(bytearray(4096), at, rk0).wait(30)
    before = _native_threads()
    agents = [ucx.Agent() for _ in range(3)]
    try:
        for i, a in enumerate(agents):
            ep = a.connect(peer.hello["address"])
            rk = ep.unpack_remote_key(peer.hello["key"])
            data = _pattern(65536, 100 + i)
            ep.mem_put(data, at, rk).wait(30)
            ep.flush().wait(30)
            out = bytearray(65536)
            ep.mem_get(out, at, rk).wait(30)
            assert bytes(out) == data.tobytes()
        new = {tid: name for tid, name in _native_threads().items() if tid not in before}
        assert sorted(new.values()) == ["gpushare-ucx"] * 3, new
    finally:
        for a in agents:
            a.close()
    # close() joins the thread; the kernel drops its task entry a moment after the join returns
    deadline = time.monotonic() + 10
    while set(new) & set(_native_threads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(new) & set(_native_threads()), "an agent's progress thread outlived its close"
