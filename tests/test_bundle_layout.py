"""A bundle's layout, made fast: the facts read off NumPy arrays at export,
the manifest the exporter keeps (made, not decoded), and fresh arrays made
a run of tensors at a time.  Each is checked against the slow way."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import gpushare as gs
from gpushare import _buffers, _manifest


def test_host_address_reader_agrees_with_the_array_interface():
    read = _buffers.host_address_reader()
    base = np.arange(1000, dtype=np.float64)
    readonly = np.arange(10, dtype=np.int8)
    readonly.flags.writeable = False
    arrays = [base, base[7:], base[::3], base.reshape(10, 100)[3:, 5:].T, base[10:20].view(np.uint8)[1:],
              np.frombuffer(b"0123456789", dtype=np.uint8)[4:], readonly, readonly[2:], np.zeros(0),
              np.zeros((0, 5), np.int32), np.array(3.5), np.zeros(4, dtype=">i4"),
              np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]), gs.empty(100, "uint8")[17:]]
    for a in arrays:
        assert read(a) == a.__array_interface__["data"][0], a


def _mixed_tree() -> dict:
    pool = gs.empty(4096, "float32")
    pool[:] = np.arange(4096, dtype=np.float32)
    frozen = np.arange(16, dtype=np.int16)
    frozen.flags.writeable = False
    return {
        "runs": [pool[i * 8:(i + 1) * 8] for i in range(20)],
        "mixed": (pool[200:208].reshape(4, 2), pool[208:216].view(np.int32), pool[300:301].reshape(()),
                  pool[400:400], {"deep": [pool[500:600:5], np.full((2, 3), 9, ">i8")]}),
        "frozen": frozen,
        "record": np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]),
        "flags": np.array([True, False, True]),
        "complex": np.arange(4, dtype=np.complex64),
    }


def test_the_exporters_manifest_is_the_one_its_bytes_decode_to():
    share = gs.export(_mixed_tree())
    made = share._bundle
    decoded = _manifest.decode(share._fields_[-1])
    assert made.digest == decoded.digest
    assert made.parts == decoded.parts and made.tree == decoded.tree
    for a, b in zip(made.arrays, decoded.arrays, strict=True):
        assert a.tolist() == b.tolist()
    assert made.spans.tolist() == decoded.spans.tolist() and made.dims_at.tolist() == decoded.dims_at.tolist()
    assert made.dtypes() == decoded.dtypes() and made.strided() == decoded.strided()
    assert [made.leaf(i) for i in range(made.count)] == [decoded.leaf(i) for i in range(decoded.count)]


def _expected(tree):
    if isinstance(tree, dict):
        return {k: _expected(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_expected(v) for v in tree)
    return tree.copy()


def _check_same(got, want, where=""):
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for k in want:
            _check_same(got[k], want[k], f"{where}/{k}")
        return
    if isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _check_same(g, w, f"{where}/{i}")
        return
    assert type(got) is np.ndarray, where
    assert got.shape == want.shape and got.dtype == want.dtype, where
    assert got.tobytes() == want.tobytes(), where


@pytest.mark.parametrize("exclude", [["same-process"], ["same-process", "host-fd"]], ids=["host-fd", "ucx-rma"])
def test_fresh_arrays_made_a_run_at_a_time_hold_each_tensor(exclude):
    pool = gs.empty(8192, "float32")
    pool[:] = np.arange(8192, dtype=np.float32)
    tree = {
        "run": [pool[i * 16:(i + 1) * 16] for i in range(40)],  # one run of 40
        "grid": [pool[640 + i * 6:640 + (i + 1) * 6].reshape(2, 3) for i in range(10)],  # a run of 2-D tensors
        "breaks": [pool[800:808], pool[808:816].reshape(2, 4), pool[816:824].view(np.int32),  # shape, dtype
                   pool[830:838], pool[838:839].reshape(()), pool[839:840].reshape(()),  # a gap; 0-d ones
                   pool[840:848], pool[844:852], pool[840:848],  # overlapping, and the same bytes twice
                   pool[852:860], pool[860:864], pool[864:870].reshape(2, 3), pool[870:876].reshape(3, 2)],  # dims
        "backwards": [pool[1000 + i * 4:1000 + (i + 1) * 4] for i in reversed(range(12))],
        "column": pool[2000:2100].reshape(20, 5)[:, 1],  # strided, between runs
        "after": [pool[3000 + i * 8:3000 + (i + 1) * 8] for i in range(5)],
        "wide": pool[4000:4032].reshape(2, 2, 2, 2, 2),  # more dimensions than a run is joined for
    }
    want = _expected(tree)
    share = gs.export(tree)
    assert len(share._bundle.parts) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gs.SlowPathWarning)
        bundle = gs.open(share, exclude=exclude)
    with bundle:
        fresh = bundle.get()
        _check_same(fresh, want)
        pool[:] = -1  # fresh arrays hold their own bytes, not the exporter's
        _check_same(fresh, want)
        assert all(a.flags.writeable for a in fresh["run"])
        fresh["run"][3][:] = 0  # one tensor's array is its own: its neighbours keep their values
        assert fresh["run"][2].tolist() == want["run"][2].tolist()
        assert fresh["run"][4].tolist() == want["run"][4].tolist()
        _check_same(bundle["breaks"].get(), _expected(tree["breaks"]))  # a node's get: the values now
        _check_same(bundle["run"].get(), _expected(tree["run"]))


def _forged_tree(mutate) -> bytes:
    import json
    import zlib

    share = gs.export({f"t{i}": np.zeros(2) for i in range(100)})
    doc = json.loads(zlib.decompress(share._fields_[-1]))
    mutate(doc["tree"])
    return zlib.compress(json.dumps(doc).encode())


@pytest.mark.parametrize("mutate, message", [
    (lambda t: t.__setitem__(200, 5), "twice"),  # tensor 5 named twice, and 99 never
    (lambda t: t.__setitem__(200, 100), "past the 100"),
    (lambda t: t.__setitem__(200, -1), "past the 100"),
    (lambda t: t.__setitem__(200, 1 << 70), "past the 100"),
    (lambda t: t.__setitem__(200, True), "neither a tensor"),
    (lambda t: t.__setitem__(200, 99.0), "neither a tensor|JSON"),
    (lambda t: t.__setitem__(199, "t0"), "unique str"),
    (lambda t: t.__setitem__(199, 7), "unique str"),
    (lambda t: t.__setitem__(199, "k" * 2000), "unique str"),
    (lambda t: t.pop(), "key without a value"),
    (lambda t: (t.pop(), t.pop()), "leaves out tensor 99"),
], ids=["twice", "past", "negative", "huge", "bool", "float", "dup-key", "int-key", "long-key", "odd", "missing"])
def test_a_forged_dict_of_many_tensors_is_refused(mutate, message):
    with pytest.raises(gs.InvalidInputError, match=message):
        _manifest.decode(_forged_tree(mutate))


def test_a_run_of_tensors_numbered_out_of_order_gets_each_its_own_row():
    from gpushare import _bundle

    # tensor 1 lies first and tensor 0 right after it; the tree lists them in address order
    leaves = [_manifest.Leaf(0, 256, 256, (64,), "<f4", None, None, None),
              _manifest.Leaf(0, 0, 256, (64,), "<f4", None, None, None),
              _manifest.Leaf(0, 512, 256, (64,), "<f4", None, None, None)]
    _, m = _manifest.encode_made([_manifest.Part("host", 768, ("host-fd",), False, None)], leaves,
                                 ("l", [1, 0, 2]))
    raw = np.arange(192, dtype=np.float32).view(np.uint8)
    arrays = [None] * 3
    order = np.array([1, 0, 2])
    _bundle._rows(m, raw, order, m.arrays[1][order], arrays)
    assert arrays[1].tolist() == list(range(64)) and arrays[0].tolist() == list(range(64, 128))
    assert arrays[2].tolist() == list(range(128, 192))
    assert m.run_of(m.tree) is None  # not numbered one after another: built item by item
    _, m2 = _manifest.encode_made([_manifest.Part("host", 768, ("host-fd",), False, None)], leaves,
                                  ("d", [("a", 0), ("b", 1), ("c", 2)]))
    assert m2.run_of(m2.tree) == (["a", "b", "c"], 0)


@pytest.mark.parametrize("exclude", [["same-process"], ["same-process", "host-fd"]], ids=["host-fd", "ucx-rma"])
def test_a_bundle_of_0d_tensors_only_gets_each_its_value(exclude):
    pool = gs.empty(16, "float64")
    pool[:] = np.arange(16.0)
    share = gs.export({f"s{i}": pool[i:i + 1].reshape(()) for i in range(16)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gs.SlowPathWarning)
        bundle = gs.open(share, exclude=exclude)
    with bundle:
        fresh = bundle.get()
    assert [(a.shape, float(a)) for a in fresh.values()] == [((), float(i)) for i in range(16)]
    assert all(type(a) is np.ndarray for a in fresh.values())


def _random_tree(rng: np.random.Generator, pool: np.ndarray) -> dict:
    """Tensors cut from ``pool`` (bytes) at random: runs of one shape, gaps,
    overlaps, 0-d and strided ones, several dtypes, nested containers."""
    tree: dict = {}
    at = 0
    for k in range(int(rng.integers(1, 40))):
        dtype = np.dtype(rng.choice(["<f4", "<i2", "|u1", "<f8", ">i4"]))
        shape = tuple(int(d) for d in rng.integers(1, 5, size=int(rng.integers(0, 4))))
        count = int(rng.integers(1, 6))  # a run of this many of that shape
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        kind = rng.choice(["after", "gap", "overlap"])
        at = max(0, at + {"after": 0, "gap": int(rng.integers(1, 64)), "overlap": -int(rng.integers(1, 16))}[kind])
        items = []
        for _ in range(count):
            if at + nbytes > len(pool):
                break
            items.append(pool[at:at + nbytes].view(dtype).reshape(shape))
            at += nbytes
        if rng.random() < 0.2 and at + 64 <= len(pool):
            tree[f"strided{k}"] = pool[at:at + 64].view("<i4")[::3]
        tree[f"n{k}"] = items if rng.random() < 0.5 else tuple(items) if rng.random() < 0.5 else {
            f"x{j}": a for j, a in enumerate(items)}
    return tree


@pytest.mark.parametrize("seed", range(12))
def test_random_layouts_get_the_same_values_as_the_exporter_holds(seed):
    rng = np.random.default_rng(seed)
    pool = gs.empty(1 << 14, "uint8")
    pool[:] = rng.integers(0, 256, size=1 << 14, dtype=np.uint8)
    tree = _random_tree(rng, pool)
    tree["one"] = pool[:8]
    share = gs.export(tree)
    exclude = ["same-process"] if seed % 3 else ["same-process", "host-fd"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gs.SlowPathWarning)
        bundle = gs.open(share, exclude=exclude)
    with bundle:
        _check_same(bundle.get(), _expected(tree))
        dests = {k: v for k, v in _expected(tree).items() if not k.startswith("strided")}  # get(dests) takes no strided
        for v in dests.values():
            for a in (v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]):
                a[...] = 0
        assert bundle.get(dests) is dests
        tree = {k: v for k, v in tree.items() if not k.startswith("strided")}
        _check_same(dests, _expected(tree))
