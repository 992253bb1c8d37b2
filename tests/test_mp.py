"""gpushare.multiprocessing: tensors and arrays through Queue, Pipe, Pool and
ProcessPoolExecutor as gpushare shares, one producer and several receivers,
in every start method (the fan-out combinations of tests/test_fanout.py)."""

from __future__ import annotations

import concurrent.futures
import gc
import multiprocessing
import pickle
import subprocess
import sys
import threading
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="torch is an optional extra: these tests send torch tensors through gpushare.multiprocessing: "
    "pip install torch")

import gpushare as gs  # noqa: E402
import gpushare.multiprocessing as gmp  # noqa: E402
from gpushare import _pickling  # noqa: E402
from gpushare._exporter.registry import get_exporter  # noqa: E402

import _fanout_worker  # noqa: E402
from _fanout_worker import METHODS, describe  # noqa: E402
from _procs import wait_for  # noqa: E402

# Importing gpushare.multiprocessing registered the reducers for the whole
# pytest process; they are this module's alone (other tests pickle arrays by value).
_pickling.uninstall()


@pytest.fixture(scope="module", autouse=True)
def _reducers():
    gmp.init_reductions()
    yield
    _pickling.uninstall()


def _message() -> dict:
    """A torch tensor, a Parameter, a gpushare array and a nested dict of them."""
    mark = gs.zeros(8, dtype=np.int64)
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "t": torch.arange(16, dtype=torch.float32) * 0.5,
        "p": torch.nn.Parameter(torch.ones(3, 3, dtype=torch.float64)),
        "mark": mark,
        "layers": {"w": w, "wt": w.t(), "b": torch.full((5,), 2, dtype=torch.bfloat16),
                   "i": torch.arange(7, dtype=torch.int16), "x": torch.arange(3.0).reshape(3, 1).expand(3, 4)},
        "gs": {"cols": mark_array()[:, 1:3]},  # strided
    }


def mark_array() -> np.ndarray:
    a = gs.empty((5, 4), "float32")
    a[:] = np.arange(20, dtype=np.float32).reshape(5, 4)
    return a


def _let_go(procs: list, go, outbox) -> None:
    """Tell each receiver to drop what it holds, check that each did, and reap them all."""
    for _ in procs:
        go.put(True)
    try:
        dropped = [outbox.get(timeout=60) for _ in procs]
        assert all(d.get("dropped") for d in dropped), dropped
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)


def _settled() -> bool:
    gc.collect()
    return gmp.outstanding() == 0


@pytest.fixture(autouse=True)
def _nothing_outstanding():
    assert wait_for(_settled), "a bundle of an earlier test is still held"
    yield
    assert wait_for(_settled, 30), f"{gmp.outstanding()} bundles still held after the test"


def test_the_module_is_multiprocessing_with_the_reducers():
    assert set(multiprocessing.__all__) <= set(gmp.__all__)
    assert gmp.get_context is multiprocessing.get_context and gmp.Queue is multiprocessing.Queue
    assert {"init_reductions", "outstanding"} <= set(gmp.__all__)
    gmp.init_reductions()  # idempotent
    assert _pickling.installed()
    assert gmp.rebuild.__module__ == "gpushare.multiprocessing"  # pickles make a child import this module


@pytest.mark.parametrize("method", METHODS)
def test_queue_fan_out_maps_tensors_and_arrays_and_releases_them(method):
    msg = _message()
    want = describe(msg)
    ctx = gmp.get_context(method)
    inboxes = [ctx.Queue() for _ in range(3)]
    outbox, go = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_fanout_worker.consume, args=(inboxes[i], outbox, go, i)) for i in range(3)]
    for p in procs:
        p.start()
    try:
        for inbox in inboxes:
            inbox.put(msg)
        reports = sorted((outbox.get(timeout=60) for _ in procs), key=lambda r: r["index"])
        for r in reports:
            assert "error" not in r, r
            # "t" and "mark" are one memory that every receiver writes into as it goes
            assert {k: v for k, v in r["what"].items() if k not in ("t", "mark")} == {
                k: v for k, v in want.items() if k not in ("t", "mark")}
            for k in ("t", "mark"):
                assert {**r["what"][k], "sha": None} == {**want[k], "sha": None}
            assert r["requires_grad"] is True  # a Parameter comes back a Parameter
        # One bundle per message, each held while its receiver holds what it got.
        assert gmp.outstanding() == 3
        # Mapped both ways: each receiver's writes are in the producer's tensor and array.
        assert msg["mark"][:3].tolist() == [100, 101, 102]
        assert msg["t"][:3].tolist() == [-1.0, -2.0, -3.0]
        # The tensor was moved into gpushare memory in place, once: views of one
        # storage stay views of one storage.
        assert msg["layers"]["wt"].untyped_storage().data_ptr() == msg["layers"]["w"].untyped_storage().data_ptr()
    finally:
        _let_go(procs, go, outbox)
    assert wait_for(_settled)  # every receiver done: the producer holds nothing for them
    assert get_exporter().stats()["leases"] == 0


@pytest.mark.parametrize("method", METHODS)
def test_pipes_carry_a_dict_as_one_bundle_each(method):
    msg = _message()
    ctx = gmp.get_context(method)
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    outbox, go = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_fanout_worker.consume, args=(reader, outbox, go, 4 + i))
             for i, (reader, _) in enumerate(pipes)]
    for p in procs:
        p.start()
    try:
        before = get_exporter().stats()["exports"]
        for _, writer in pipes:
            writer.send(msg)
        reports = [outbox.get(timeout=60) for _ in procs]
        for report in reports:
            assert "error" not in report, report
            assert report["what"]["layers"] == describe(msg)["layers"]
        assert msg["mark"][4:6].tolist() == [104, 105]
        # one share for the whole dict per message: the registry grew by one bundle each
        assert get_exporter().stats()["exports"] - before == 2 and gmp.outstanding() == 2
    finally:
        _let_go(procs, go, outbox)


def test_a_dict_of_tensors_costs_no_fd_or_thread_per_tensor():
    ctx = gmp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_fanout_worker.fds_per_message, args=(inbox, outbox))
    p.start()
    try:
        threads = threading.active_count()
        for n in range(2):  # 200 tensors of their own storages each
            inbox.put({f"t{i}": torch.full((256,), float(i + n)) for i in range(200)})
        report = outbox.get(timeout=60)
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert report["sizes"] == [200, 200] and report["first"] == 200.0
    (fd0, th0), (fd1, th1), (fd2, th2) = report["counts"]
    # the first message: the connection to the producer and one mapping's memfd at most;
    # the second: that message's memfd at most (the connection is reused)
    assert fd1 - fd0 <= 4 and fd2 - fd1 <= 2, report["counts"]
    assert th2 - th0 <= 1, report["counts"]  # the receiver's service thread, once
    assert threading.active_count() - threads <= 2  # the producer: its service thread and a queue feeder


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_spawned_process_gets_its_arguments_as_shares(method):
    msg = _message()
    want = describe(msg)
    ctx = gmp.get_context(method)
    outbox = ctx.Queue()
    p = ctx.Process(target=_fanout_worker.report, args=(msg, outbox))
    p.start()
    try:
        assert outbox.get(timeout=60) == want
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0
    assert msg["mark"][7] == 107  # mapped: the child's write is here


@pytest.mark.parametrize("method", METHODS)
def test_pool_arguments_and_results_travel_both_ways(method):
    msg = _message()
    want = describe(msg)
    with gmp.get_context(method).Pool(2) as pool:
        results = pool.map(_fanout_worker.task, [msg] * 4, chunksize=1)
    for what, made, installed in results:
        assert what == want
        assert installed  # the worker registered the reducers (spawn: on unpickling its task)
        # results made in the worker come back as their own types, readable after the pool is gone
        assert type(made["tensor"]) is torch.Tensor and made["tensor"].dtype == torch.float64
        assert made["tensor"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        assert type(made["gs"]) is np.ndarray and made["gs"].dtype == np.int32 and made["gs"].shape == (4, 2)
        assert (made["gs"] == 7).all()
    del results, made


@pytest.mark.parametrize("method", METHODS)
def test_process_pool_executor_arguments_and_results(method):
    msg = _message()
    want = describe(msg)
    with ProcessPoolExecutor(2, mp_context=gmp.get_context(method)) as ex:
        results = list(ex.map(_fanout_worker.task, [msg] * 3))
    assert [what for what, _, _ in results] == [want] * 3
    assert all(made["tensor"].sum().item() == 15.0 and installed for _, made, installed in results)
    del results


@pytest.mark.parametrize("method", METHODS)
def test_a_receiver_that_dies_is_reported_and_its_lease_ends(method):
    t = torch.arange(1000, dtype=torch.float32)
    with ProcessPoolExecutor(1, mp_context=gmp.get_context(method)) as ex:
        with pytest.raises(concurrent.futures.process.BrokenProcessPool):
            ex.submit(_fanout_worker.die, {"t": t}).result(timeout=60)
    # the dead receiver's connection ended its lease: nothing is held for it
    assert wait_for(_settled)


@pytest.mark.parametrize("method", METHODS)
def test_every_child_has_the_reducers_before_it_receives_anything(method):
    # spawn, forkserver: the Process object, pickled for the child, names gpushare.multiprocessing
    with gmp.get_context(method).Pool(1) as pool:
        assert pool.apply(_fanout_worker.installed_here) is True
    with ProcessPoolExecutor(1, mp_context=gmp.get_context(method)) as ex:
        assert ex.submit(_fanout_worker.installed_here).result(timeout=60) is True


def test_a_message_whose_producer_exited_says_so():
    ctx = gmp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_fanout_worker.put_and_exit, args=(queue,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    with pytest.raises(gs.ExporterUnreachableError, match="has exited"):
        queue.get(timeout=60)


def test_what_is_not_shared_travels_as_before():
    plain = np.arange(10)  # not gpushare memory: by value, as plain pickling does
    empty = torch.empty(0, 3)
    reversed_ = mark_array()[::-1]  # gpushare memory, but no share can say negative strides
    before = get_exporter().stats()["exports"]
    for obj in (plain, empty, reversed_, [1, "x"]):
        back = pickle.loads(ForkingPickler.dumps(obj))
        assert type(back) is type(obj)
    assert (pickle.loads(ForkingPickler.dumps(plain)) == plain).all()
    assert pickle.loads(ForkingPickler.dumps(empty)).shape == (0, 3)
    assert (pickle.loads(ForkingPickler.dumps(reversed_)) == reversed_).all()
    assert get_exporter().stats()["exports"] == before


def test_torch_multiprocessing_imported_after_does_not_take_tensors_back():
    # In a fresh interpreter: torch.multiprocessing's reducers would stay for the whole pytest process.
    code = ("import gpushare.multiprocessing, torch.multiprocessing, torch\n"
            "from multiprocessing.reduction import ForkingPickler\n"
            "assert b'gpushare.multiprocessing' in bytes(ForkingPickler.dumps(torch.ones(4)))\n"
            "assert gpushare.multiprocessing.outstanding() == 1\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_outstanding_starts_no_exporter():
    code = ("import threading, gpushare.multiprocessing as m\n"
            "assert m.outstanding() == 0 and threading.active_count() == 1\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_a_non_leaf_tensor_that_requires_grad_is_refused_as_torch_does():
    x = torch.ones(3, requires_grad=True) * 2
    with pytest.raises(RuntimeError, match="non-leaf tensor which requires_grad"):
        ForkingPickler.dumps(x)


def test_the_same_process_unpickles_the_message_zero_copy():
    msg = _message()
    back = pickle.loads(ForkingPickler.dumps(msg))
    assert describe(back) == describe(msg)
    back["t"][0] = 99.0  # the same memory (same-process path)
    assert msg["t"][0] == 99.0
    del back


@pytest.mark.gpu
@pytest.mark.kernels
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_cupy_arrays_and_cuda_tensors_through_a_queue(method):
    cupy = pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    msg = {"c": cupy.arange(1 << 20, dtype=cupy.float32), "t": torch.arange(1 << 20, dtype=torch.int32, device="cuda")}
    ctx = gmp.get_context(method)
    inbox, outbox = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_fanout_worker.cuda_consume, args=(inbox, outbox))
    p.start()
    try:
        inbox.put(msg)
        report = outbox.get(timeout=120)
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
    assert "error" not in report, report
    assert report == {"c": ("ndarray", "cupy", "float32", (1 << 20,), float(((1 << 20) - 1) * (1 << 20) // 2)),
                      "t": ("Tensor", "cuda", "torch.int32", (1 << 20,), ((1 << 20) - 1) * (1 << 20) // 2)}
    # the receiver wrote through: the producer's memory shows it where the path maps
    assert float(msg["c"][0]) == -1.0 and int(msg["t"][0]) == -1


def test_a_sender_that_never_asks_how_many_are_held_keeps_no_record_of_ended_bundles():
    """300 messages, each received (here) and dropped, so that its bundle ends; nobody calls
    ``outstanding()``: the sender's record of the bundles it sent stays small."""
    a = gs.empty(64, dtype=np.uint8)
    a[:] = 9
    for _ in range(300):
        b = pickle.loads(ForkingPickler.dumps(a))
        assert int(b[0]) == 9
        del b
    gc.collect()
    assert len(_pickling._sent) <= 70, len(_pickling._sent)
    assert gmp.outstanding() == 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
