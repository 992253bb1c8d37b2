"""gs.share_memory: an ordinary state dict (every tensor an allocation of its
own) laid out in one gpushare buffer: the same tree back, then one offer, one
fd and one mapping for every tensor in another process."""

from __future__ import annotations

import collections

import numpy as np
import pytest

import gpushare as gs

try:
    import torch
except ImportError:  # pragma: no cover - CI installs it
    torch = None


def test_numpy_trees_come_back_alike_over_one_buffer():
    Pair = collections.namedtuple("Pair", "a b")
    base = np.arange(24, dtype=np.int32).reshape(4, 6)
    tree = {"w": np.linspace(0, 1, 7), "cols": base[:, ::2], "pair": Pair(np.ones(3, np.int8), np.zeros(0)),
            "list": [np.array(3.5), np.frombuffer(b"abc", np.uint8)], "step": 7, "name": "run"}
    out = gs.share_memory(tree)
    assert type(out["pair"]) is Pair and out["step"] == 7 and out["name"] == "run"
    leaves = [out["w"], out["cols"], out["pair"].a, out["pair"].b, out["list"][0], out["list"][1]]
    wants = [tree["w"], tree["cols"], tree["pair"].a, tree["pair"].b, tree["list"][0], tree["list"][1]]
    for got, want in zip(leaves, wants, strict=True):
        assert type(got) is np.ndarray and got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got, want) and got.flags.c_contiguous and got.flags.writeable
    # every one over the same gpushare buffer, 64-byte aligned, none over its source
    roots = {id(_root(a)) for a in leaves if a.nbytes}
    assert len(roots) == 1
    assert all(a.ctypes.data % 64 == 0 for a in leaves if a.nbytes)
    assert not np.shares_memory(out["cols"], base)
    out["w"][0] = 9.0
    assert tree["w"][0] == 0.0  # a copy: the source is untouched


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_an_ordinary_torch_state_dict_becomes_one_allocation_mapped_zero_copy(bundle_peer):
    torch.manual_seed(1)
    sd = collections.OrderedDict()
    for i in range(40):  # each tensor its own allocation, as a model's state_dict()
        sd[f"layers.{i}.weight"] = torch.randn(32, 16)
        sd[f"layers.{i}.norm"] = torch.randn(16).to(torch.bfloat16)
    sd["head.weight"] = torch.randn(16, 32).t()  # not contiguous
    sd["steps"] = torch.tensor(5)
    contiguous = {k: v for k, v in sd.items() if v.is_contiguous()}  # export takes no strided CPU tensor
    ordinary = gs.export(contiguous, lifetime="revoked")
    assert len(ordinary._bundle.parts) == len(contiguous)  # an allocation each
    ordinary.revoke()

    laid = gs.share_memory(sd)
    assert type(laid) is collections.OrderedDict and list(laid) == list(sd)
    for k, v in sd.items():
        assert type(laid[k]) is torch.Tensor and laid[k].dtype == v.dtype and laid[k].shape == v.shape, k
        assert torch.equal(laid[k], v) and laid[k].is_contiguous(), k
    share = gs.export(laid, lifetime="revoked")
    assert len(share._bundle.parts) == 1  # one allocation for all of them
    try:
        opened = bundle_peer.call("open", "laid", share)
        # one memfd mapped for 82 tensors; the fds the open added are the connection's, not one per tensor
        assert opened["paths"] == ("host-fd",) and opened["mappings"] == 1 and opened["fds"] <= 4
        seen = bundle_peer.call("describe", "laid")
        assert len(seen) == len(sd) and all(entry["zero_copy"] for entry in seen.values())
        # the importer maps the laid-out memory: the exporter's later writes show
        laid["layers.0.weight"][0, 0] = 123.0
        assert np.frombuffer(bundle_peer.call("get_one", "laid", "layers.0.weight"), np.float32)[0] == 123.0
    finally:
        bundle_peer.call("close", "laid")
        share.revoke()


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_requires_grad_is_kept_and_grads_do_not_flow_into_the_copy():
    w = torch.randn(4, requires_grad=True)
    out = gs.share_memory({"w": w})
    assert out["w"].requires_grad and out["w"].is_leaf and torch.equal(out["w"].detach(), w.detach())


class _FakeCuda:
    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (1 << 20, False), "version": 3}


def test_what_share_memory_cannot_lay_out_is_refused_naming_it():
    with pytest.raises(gs.UnsupportedError, match=r"^share_memory lays out NumPy arrays, torch tensors and CuPy "
                                                  r"arrays; the tree's item \['a'\]\[1\] is other CUDA memory "
                                                  r"\(_FakeCuda\)"):
        gs.share_memory({"a": [np.zeros(2), _FakeCuda()]})
    with pytest.raises(gs.InvalidInputError, match="at least one NumPy array, torch tensor or CuPy array"):
        gs.share_memory({"lr": 0.1, "name": "x"})
    loop: list = []
    loop.append(loop)
    with pytest.raises(gs.InvalidInputError, match="deeper than 64"):
        gs.share_memory(loop)


@pytest.mark.gpu
@pytest.mark.kernels
def test_share_memory_lays_torch_cuda_tensors_out_on_their_device():
    torch_ = pytest.importorskip("torch")
    if not torch_.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    state = {"w": torch_.randn(64, 32, device="cuda"), "b": torch_.arange(7, device="cuda", dtype=torch_.int64),
             "t": torch_.randn(8, 4, device="cuda").t(), "cpu": torch_.ones(3), "step": 5}
    laid = gs.share_memory(state)
    assert laid["step"] == 5 and laid["cpu"].device.type == "cpu"
    for k in ("w", "b", "t"):
        assert laid[k].device == state[k].device and laid[k].dtype == state[k].dtype
        assert laid[k].is_contiguous() and torch_.equal(laid[k].cpu(), state[k].cpu())
    share = gs.export({k: laid[k] for k in ("w", "b", "t")})
    try:
        assert share.allocations == 1  # one buffer on the device
    finally:
        share.revoke()


@pytest.mark.gpu
@pytest.mark.kernels
def test_share_memory_lays_cupy_arrays_out_on_their_device():
    cupy = pytest.importorskip("cupy")
    state = {"a": cupy.arange(100, dtype=cupy.float32), "b": cupy.ones((3, 5), dtype=cupy.int16)}
    laid = gs.share_memory(state)
    for k, v in state.items():
        assert isinstance(laid[k], cupy.ndarray) and laid[k].dtype == v.dtype and laid[k].shape == v.shape
        assert bool((laid[k] == v).all())
    share = gs.export(laid)
    try:
        assert share.allocations == 1
    finally:
        share.revoke()
