"""Bundles: many tensors as one share, one open, one lease.

Each test checks what arrived in another process tensor by tensor (values,
dtype, shape, zero-copy where mapped) and what it cost (allocations offered,
mappings made, leases held)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import pickle
import time
import warnings

import numpy as np
import pytest

import gpushare as gs
from _procs import Child
from gpushare._exporter.registry import get_exporter

try:  # torch is optional; imported before UCX loads (see docs/ucx.md)
    import torch
except ImportError:  # pragma: no cover - CI installs it
    torch = None


@pytest.fixture(scope="module")
def bpeer():
    import _bundle_peer

    child = Child(_bundle_peer.setup)
    yield child
    child.close()


def _digest(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _host_tree() -> tuple[dict, dict]:
    """A tree of every kind of host memory gs.export takes, and per key the array it should arrive as."""
    pool = gs.empty(4096, "float32")
    pool[:] = np.arange(4096, dtype=np.float32)
    base = np.arange(64, dtype=np.int64) * 3
    grid = gs.empty((8, 6), "float64")
    grid[:] = np.arange(48.0).reshape(8, 6)
    tree = {
        "pool": {"w": pool[:1000].reshape(10, 100), "b": pool[1000:1100], "tail": pool[1100:]},
        "base": [base[:10], base[10:30].reshape(4, 5), base[40:]],
        "solo": np.full((3, 3), 7, dtype=np.int16),
        "column": grid[:, 2],  # strided, over gpushare memory
        "numpy_column": np.arange(12.0).reshape(3, 4)[:, 1],  # strided, over a NumPy base
        "pair": (np.array([1.5, 2.5], dtype=np.float32), pool[2000:2004]),
        "u8": np.frombuffer(bytes(range(200)), dtype=np.uint8),
    }
    expected = {"/pool/w": tree["pool"]["w"], "/pool/b": tree["pool"]["b"], "/pool/tail": tree["pool"]["tail"],
                "/base/0": base[:10], "/base/1": base[10:30].reshape(4, 5), "/base/2": base[40:],
                "/solo": tree["solo"], "/column": grid[:, 2], "/numpy_column": tree["numpy_column"],
                "/pair/0": tree["pair"][0], "/pair/1": tree["pair"][1], "/u8": tree["u8"]}
    return tree, expected


def _check_arrived(seen: dict, expected: dict) -> None:
    assert set(seen) == set(expected)
    for key, want in expected.items():
        got = seen[key]
        assert got["dtype"] == str(want.dtype), key
        assert tuple(got["shape"]) == want.shape, key
        assert got["digest"] == _digest(want), key
        if "zero_copy" in got:
            assert got["zero_copy"] and got["mapped_digest"] == _digest(want), key


@pytest.mark.parametrize("exclude", [None, ["host-fd"], ["host-fd", "cma"]], ids=["best", "no-host-fd", "ucx-rma"])
def test_every_host_kind_arrives_tensor_by_tensor_over_each_path(bpeer, exclude):
    tree, expected = _host_tree()
    share = gs.export(tree)
    assert isinstance(share, gs.BundleShare) and share.is_bundle and share.count == len(expected)
    # pool (one gs.allocate buffer), grid, base, solo, numpy_column's base, pair[0], u8: one offer each
    assert len(share._bundle.parts) == 7
    name = f"kinds-{exclude}"
    opened = bpeer.call("open", name, share, {"exclude": exclude} if exclude else None)
    assert opened["count"] == len(expected)
    # gpushare memory goes over host-fd, other host memory over cma; ucx-rma where those are excluded
    assert set(opened["paths"]) == {None: {"host-fd", "cma"}, 1: {"cma", "ucx-rma"}, 2: {"ucx-rma"}}[
        exclude and len(exclude)]
    assert opened["paths"][0] == ("host-fd" if exclude is None else "ucx-rma")
    assert len(opened["why"].splitlines()) == 7 and "allocation 0" in opened["why"]
    _check_arrived(bpeer.call("describe", name), expected)
    bpeer.call("close", name)


def test_tensors_of_one_allocation_share_one_offer_one_mapping_and_one_lease(bpeer):
    pool = gs.empty(1 << 16, "float32")
    pool[:] = np.arange(1 << 16, dtype=np.float32)
    tree = {f"layer{i}": pool[i * 64:(i + 1) * 64] for i in range(1000)}
    share = gs.export(tree)
    assert len(share._bundle.parts) == 1 and share.count == 1000
    leases_before = get_exporter().stats()["leases"]
    opened = bpeer.call("open", "one", share)
    assert opened["paths"] == ("host-fd",)
    assert opened["mappings"] == 1  # one memfd mapped for 1000 tensors
    assert opened["fds"] <= 1  # the memfd's fd, at most: none per tensor
    assert opened["leases"] == 1
    assert get_exporter().stats()["leases"] == leases_before + 1
    assert np.frombuffer(bpeer.call("get_one", "one", "layer999"), np.float32).tolist() == list(
        np.arange(999 * 64, 1000 * 64, dtype=np.float32))
    assert bpeer.call("close", "one")["leases"] == 0
    deadline = time.monotonic() + 10  # the close message is on its way to the service thread
    while get_exporter().stats()["leases"] != leases_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert get_exporter().stats()["leases"] == leases_before


def test_batched_put_lands_in_the_exporters_memory(bpeer):
    pool = gs.zeros(300, "int32")
    other = np.zeros(5, dtype=np.float64)
    share = gs.export({"a": pool[:100], "b": pool[100:300].reshape(10, 20), "c": other})
    bpeer.call("open", "put", share)
    bpeer.call("write", "put", {"a": np.arange(100, dtype=np.int32), "c": np.full(5, 2.5)})
    assert pool[:100].tolist() == list(range(100)) and not pool[100:].any()
    assert other.tolist() == [2.5] * 5
    bpeer.call("close", "put")


def test_read_only_bundle_refuses_puts_and_maps_read_only(bpeer):
    pool = gs.empty(64, "uint8")
    pool[:] = 9
    share = gs.export({"x": pool[:32], "y": np.ones(4)}, readonly=True)
    assert share.readonly and all(p.readonly for p in share._bundle.parts)
    bpeer.call("open", "ro", share)
    seen = bpeer.call("describe", "ro")
    assert seen["/x"]["writeable"] is False
    with pytest.raises(gs.InvalidInputError, match="read-only"):
        bpeer.call("write", "ro", {"y": np.zeros(4)})
    assert pool.tolist() == [9] * 64
    bpeer.call("close", "ro")


def test_bundle_travels_as_pickle_and_as_bytes_and_stays_small():
    pool = gs.empty(20000 * 4, "float32")
    tree = {f"model.layers.{i // 10}.mlp.w{i % 10}": pool[i * 4:(i + 1) * 4] for i in range(20000)}
    share = gs.export(tree, lifetime="revoked")
    try:
        again = pickle.loads(pickle.dumps(share))
        assert again == share and type(again) is gs.BundleShare and again.count == 20000
        assert gs.Share.from_bytes(share.to_bytes()) == share
        per_tensor = len(pickle.dumps(share)) / 20000
        assert per_tensor <= 64, per_tensor
    finally:
        share.revoke()


def _pool_open(share):
    import gpushare as gs

    with gs.open(share) as bundle:
        got = bundle.get()
        return bundle.paths, {k: v.tolist() for k, v in got.items()}


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_bundle_opens_under_every_start_method(method):
    pool = gs.empty(16, "int64")
    pool[:] = np.arange(16)
    tree = {"a": pool[:8], "b": pool[8:], "c": np.array([3, 4], dtype=np.int8)}
    share = gs.export(tree)
    with mp.get_context(method).Pool(2) as workers:
        results = workers.map(_pool_open, [share, share])
    for paths, got in results:
        assert paths == ("host-fd", "cma")
        assert got == {"a": list(range(8)), "b": list(range(8, 16)), "c": [3, 4]}


def test_same_process_open_sees_the_exporters_own_tensors():
    a = np.arange(10.0)
    share = gs.export({"a": a, "t": (a[2:4],)})
    with gs.open(share) as bundle:
        assert bundle.paths == ("same-process",)
        view = bundle["a"]
        np.asarray(view)[0] = 42.0
        assert a[0] == 42.0
        assert bundle.get()["t"][0].tolist() == [2.0, 3.0]
        assert isinstance(bundle["t"], gs.Bundle) and bundle["t"].kind is tuple


def test_bundle_get_into_destinations_and_async_forms(bpeer):
    pool = gs.empty(100, "float32")
    pool[:] = np.arange(100, dtype=np.float32)
    share = gs.export({"x": pool[:50], "nest": {"y": pool[50:]}})
    with gs.open(share, exclude=["same-process"]) as bundle:
        assert bundle.paths == ("host-fd",)
        dst = {"nest": {"y": np.empty(50, np.float32)}}
        assert bundle.get(dst) is dst
        assert dst["nest"]["y"].tolist() == list(range(50, 100))
        bundle.put({"x": np.zeros(50, np.float32)})
        assert not pool[:50].any()

        import asyncio

        async def roundtrip():
            await bundle.put_async({"x": np.ones(50, np.float32)})
            return await bundle.get_async()

        got = asyncio.run(roundtrip())
        assert got["x"].tolist() == [1.0] * 50 and got["nest"]["y"].tolist() == list(range(50, 100))
        with pytest.raises(gs.InvalidInputError, match="no item"):
            bundle.get({"z": np.empty(1)})
        with pytest.raises(gs.InvalidInputError, match="is a dict"):
            bundle.get({"nest": np.empty(1)})
    with pytest.raises(gs.ClosedError):
        bundle["x"]


def test_closing_the_bundle_closes_its_views_but_not_a_dlpack_tensor():
    pool = gs.empty(8, "float64")
    pool[:] = 5.0
    share = gs.export({"x": pool})
    bundle = gs.open(share, exclude=["same-process"])
    view = bundle["x"]
    held = np.from_dlpack(view)
    bundle.close()
    assert view.closed and bundle.closed
    assert held.tolist() == [5.0] * 8  # still mapped under the tensor
    del held


def test_bundle_lifetime_and_revocation():
    pool = gs.empty(32, "uint8")
    share = gs.export({"a": pool[:16], "b": pool[16:]}, lifetime=1)
    bundle = gs.open(share, exclude=["same-process"])
    bundle.close()
    with pytest.raises(gs.ClosedError, match="lifetime=1 allows 1 import"):
        gs.open(share, exclude=["same-process"])
    other = np.arange(8, dtype=np.uint8)
    share2 = gs.export({"a": other}, lifetime="revoked")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gs.SlowPathWarning)
        bundle2 = gs.open(share2, exclude=["same-process", "cma"])
    assert bundle2.paths == ("ucx-rma",)
    assert bundle2.get()["a"].tolist() == list(range(8))
    share2.revoke()
    with pytest.raises(gs.GpuShareError):
        bundle2.get()
    bundle2.close()


def test_bad_trees_are_refused_with_a_clear_error():
    with pytest.raises(gs.InvalidInputError, match="empty bundle"):
        gs.export({})
    with pytest.raises(gs.InvalidInputError, match="keys are str"):
        gs.export({1: np.ones(2)})
    with pytest.raises(gs.InvalidInputError, match="lifetime='none'"):
        gs.export({"a": np.ones(2)}, lifetime="none")
    loop: list = []
    loop.append(loop)
    with pytest.raises(gs.InvalidInputError, match="deeper"):
        gs.export(loop)
    with pytest.raises(gs.InvalidInputError, match=r"^object is not a buffer.*\(the tree's item \['a'\]\)$"):
        gs.export({"a": object()})
    # the refusal leads with its reason and names the item by the keys that lead to it
    with pytest.raises(gs.InvalidInputError, match=r"^float is not a buffer.*\(the tree's item \['lr'\]\)$"):
        gs.export({"a": np.zeros(3), "lr": 0.1})
    with pytest.raises(gs.InvalidInputError, match=r"str is not a buffer.*item \['layers'\]\[1\]\['w'\]\)$"):
        gs.export({"layers": [{"w": np.zeros(2)}, {"w": "x"}], "b": np.ones(1)})


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_torch_tensors_of_one_storage_share_one_offer(bpeer):
    base = torch.arange(100, dtype=torch.float32)
    tree = {"a": base[:10], "b": base[10:60].view(5, 10), "c": torch.ones(3, dtype=torch.bfloat16)}
    share = gs.export(tree)
    assert len(share._bundle.parts) == 2
    bpeer.call("open", "torch", share)
    seen = bpeer.call("describe", "torch")
    assert seen["/a"]["digest"] == _digest(base[:10].numpy()) and tuple(seen["/b"]["shape"]) == (5, 10)
    assert seen["/c"]["typestr"] == "|V2" and seen["/c"]["digest"] == _digest(tree["c"].view(torch.uint16).numpy())
    bpeer.call("close", "torch")


def test_bundle_views_and_plain_views_batch_together_over_ucx_rma():
    base = np.arange(64, dtype=np.uint8)
    plain = np.arange(100, 132, dtype=np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gs.SlowPathWarning)
        bundle = gs.open(gs.export({"a": base[:32], "b": base[32:]}), exclude=["same-process", "cma"])
        view = gs.open(gs.export(plain), exclude=["same-process", "cma"])
    assert bundle.paths == ("ucx-rma",) and view.path == "ucx-rma"
    outs = [np.empty(32, np.uint8) for _ in range(3)]
    gs.get_batch([(bundle["b"], 0, outs[0]), (view, 0, outs[1]), (bundle["a"], 0, outs[2])]).wait(30)
    assert outs[0].tolist() == list(range(32, 64)) and outs[1].tolist() == list(range(100, 132))
    assert outs[2].tolist() == list(range(32))
    # the whole allocation in one transfer, sliced here
    assert [a.tolist() for a in bundle.get().values()] == [list(range(32)), list(range(32, 64))]
    bundle.close()
    view.close()


@pytest.mark.parametrize("exclude", [["same-process"], ["same-process", "host-fd"]], ids=["host-fd", "ucx-rma"])
def test_get_into_many_numpy_destinations_takes_the_allocation_at_once(exclude):
    pool = gs.empty(64 * 50, "int32")
    pool[:] = np.arange(64 * 50, dtype=np.int32)
    share = gs.export({f"t{i}": pool[i * 64:(i + 1) * 64] for i in range(50)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gs.SlowPathWarning)
        bundle = gs.open(share, exclude=exclude)
    with bundle:
        assert bundle.paths == (("host-fd",) if len(exclude) == 1 else ("ucx-rma",))
        dests = {f"t{i}": np.zeros(64, np.int32) for i in range(0, 50, 2)}
        dests["t1"] = np.zeros(10, np.int32)  # fewer bytes than the tensor: its first 40
        dests["t3"] = np.zeros(64, np.float32)  # bytes, whatever the dtype
        assert bundle.get(dests) is dests
        for i in range(0, 50, 2):
            assert dests[f"t{i}"].tolist() == list(range(i * 64, (i + 1) * 64)), i
        assert dests["t1"].tolist() == list(range(64, 74))
        assert dests["t3"].view(np.int32).tolist() == list(range(192, 256))
        fresh = bundle.get()
        assert all(fresh[f"t{i}"].tolist() == list(range(i * 64, (i + 1) * 64)) for i in range(50))


def test_a_bundle_share_without_its_manifest_is_refused_in_the_exporting_process_too():
    share = gs.export({"a": np.ones(4), "b": np.zeros(2)})
    stripped = gs.Share._make(*share._fields_[:-1], None)
    assert not stripped.is_bundle
    with pytest.raises(gs.InvalidInputError, match="carries no manifest"):
        gs.open(stripped)


def test_a_bundle_no_open_could_carry_is_refused_at_export(monkeypatch):
    """More host-fd memfds than one grant carries: gs.export says so (leading
    with the reason, naming the way out), not the first open; the same tree
    without host-fd exports, and leaves no registration behind."""
    from gpushare import _export_tree
    from gpushare._paths import broker

    monkeypatch.setattr(_export_tree, "MAX_BACKLOG_FDS", 4)
    tree = {f"a{i}": gs.empty(16, "uint8", device="host") for i in range(5)}
    before = set(broker.get_broker()._exports)
    with pytest.raises(gs.InvalidInputError, match=r"^this bundle cannot be opened: its allocations need 5 file "
                       r"descriptors in one grant \(host-fd\).*gs.share_memory.*paths= leaving host-fd out"):
        gs.export(tree)
    # The refused export's registrations were released.  (Compared by id, not by count: an
    # earlier test's share may end meanwhile and release its own.)
    assert not set(broker.get_broker()._exports) - before
    share = gs.export(tree, paths=["cma", "ucx-rma"])
    assert share.allocations == 5 and "host-fd" not in share.offers
    share.revoke()
    four = gs.export({k: tree[k] for k in ("a0", "a1", "a2", "a3")}, lifetime="revoked")  # four fit
    assert "host-fd" in four.offers
    four.revoke()


def _export_over_ucx_rma(conn) -> None:
    """In another process: a bundle offered on ucx-rma only, sent as bytes; kept until told."""
    import numpy as np

    import gpushare as gs

    tree = {"a": np.arange(16, dtype=np.uint8), "b": np.ones(8, np.float32)}
    share = gs.export(tree, paths=["ucx-rma"], lifetime="revoked")
    conn.send(share.to_bytes())
    conn.recv()


def test_a_bundles_slow_path_warning_points_at_the_caller_of_open():
    """The SlowPathWarning of a bundle (here: ucx-rma to a peer on this node,
    not asked for) is reported at the line that called gs.open."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_export_over_ucx_rma, args=(theirs,))
    proc.start()
    try:
        share = gs.Share.from_bytes(mine.recv())
        with pytest.warns(gs.SlowPathWarning, match="over ucx-rma, a network transport") as record:
            bundle = gs.open(share)
        assert record[0].filename == __file__
        with bundle:
            assert bundle.paths == ("ucx-rma", "ucx-rma")
            assert bundle.get()["a"].tolist() == list(range(16))
    finally:
        mine.send(None)
        proc.join(30)


def test_a_dict_nodes_keys_are_looked_up_in_a_table_made_once():
    """Each key of a 5,000-key dict (and of a nested one) found by a table the manifest makes
    once per node, not by a pass over the keys; missing and unhashable keys are KeyErrors (and
    not ``in``)."""
    tree = {"layers": {f"w{i}": np.full(4, i % 256, np.uint8) for i in range(5000)}, "step": np.arange(3)}
    share = gs.export(tree)
    b = gs.open(share)
    try:
        layers = b["layers"]
        for i in range(0, 5000, 7):
            assert np.asarray(layers[f"w{i}"].get())[0] == i % 256
            assert f"w{i}" in layers
        assert np.array_equal(np.asarray(b["step"].get()), np.arange(3))
        assert len(b._state.manifest._names) == 2  # one table per dict node looked in
        for missing in ("nope", 3, ("w1",)):
            with pytest.raises(KeyError):
                layers[missing]
            assert missing not in layers
        with pytest.raises(KeyError):
            layers[["w1"]]
        assert ["w1"] not in layers
    finally:
        b.close()
