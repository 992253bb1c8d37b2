"""Real PyTorch (CPU) tensors through the sharing API, to another process:
dtypes (bfloat16 included), shapes, zero-copy where mapped, copies where not,
and shares sent through torch.multiprocessing."""

from __future__ import annotations

import numpy as np
import pytest

import gpushare as gs


@pytest.fixture
def torch():
    """torch, imported by the first test that needs it, not when the suite is collected: by then
    other tests of the run have started UCX in this process (any import order must work)."""
    return pytest.importorskip("torch", reason="torch is an optional extra: pip install torch to run these tests")


def _raw(t) -> bytes:
    import torch

    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", ["float32", "int64", "bfloat16"])
def test_a_plain_cpu_tensor_arrives_with_its_dtype_and_shape(peer, dtype, torch):
    t = (torch.arange(24, dtype=torch.float32) * 1.5).to(getattr(torch, dtype)).reshape(2, 3, 4)
    share = gs.export(t)
    assert share.shape == (2, 3, 4)
    assert peer.call("open", f"plain-{dtype}", share)["path"] == "cma"
    got = peer.call("torch_read", f"plain-{dtype}")
    assert got["copy"] == (f"torch.{dtype}", (2, 3, 4), _raw(t)) and got["mapped"] is None
    peer.call("close", f"plain-{dtype}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tensor_over_gpushare_memory_is_mapped_zero_copy(peer, dtype, torch):
    base = gs.empty((4, 8), np.float32 if dtype == "float32" else np.uint16)
    t = torch.from_numpy(base)
    if dtype == "bfloat16":
        t = t.view(torch.bfloat16)
    t.copy_(torch.arange(32, dtype=torch.float32).reshape(4, 8).to(t.dtype))
    share = gs.export(t)
    assert share.offers[:2] == ("same-process", "host-fd")
    assert peer.call("open", f"mapped-{dtype}", share)["path"] == "host-fd"
    before = _raw(t)
    got = peer.call("torch_read", f"mapped-{dtype}")
    assert got["copy"] == (f"torch.{dtype}", (4, 8), before)
    assert got["mapped"] == (f"torch.{dtype}", (4, 8), before)
    assert t[0, 0].item() == 7  # the importer's store through torch.from_dlpack, seen here
    peer.call("close", f"mapped-{dtype}")


def _tmp_consumer(queue, results) -> None:
    import gpushare as gs
    import torch

    share = queue.get(timeout=60)
    with gs.open(share) as view:
        t = torch.empty(view.shape, dtype=torch.float64)
        view.get(t)
        view.put(t * 2)
        results.put((view.path, t.sum().item()))


def test_shares_travel_through_torch_multiprocessing(torch):
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_tmp_consumer, args=(queue, results))
    proc.start()
    t = torch.arange(1000, dtype=torch.float64)
    share = gs.export(t)
    queue.put(share)
    path, total = results.get(timeout=60)
    proc.join(30)
    assert proc.exitcode == 0 and path == "cma" and total == sum(range(1000))
    assert torch.equal(t, torch.arange(1000, dtype=torch.float64) * 2)  # its put landed here
