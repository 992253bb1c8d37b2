"""Ordinary state dicts as bundles: every tensor an allocation of its own (as
``np.ones``, ``torch.randn`` or a loaded checkpoint give them), in numbers
past every per-connection limit: a bundle's copies go in paced batches and
its open request and grant in as many control frames as they need."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

import gpushare as gs
from gpushare._exporter.registry import get_exporter
from gpushare._paths import cma

try:
    import torch
except ImportError:  # pragma: no cover - CI installs it
    torch = None


def _ordinary(n: int) -> dict[str, np.ndarray]:
    """``n`` uint8 arrays of 64 to 70 bytes, each its own allocation."""
    return {f"w{i}": np.full(64 + i % 7, i % 251, np.uint8) for i in range(n)}


def _digest_all(tree: dict) -> str:
    h = hashlib.sha256()
    for key in sorted(tree):
        h.update(f"/{key}".encode() + b"\0" + np.ascontiguousarray(tree[key]).tobytes())
    return h.hexdigest()


def _settled_leases() -> int:
    """The exporter's lease count once earlier tests' closes have arrived."""
    last, since = get_exporter().stats()["leases"], time.monotonic()
    while time.monotonic() - since < 0.3:
        time.sleep(0.02)
        now = get_exporter().stats()["leases"]
        if now != last:
            last, since = now, time.monotonic()
    return last


# 20,000 over ucx-rma: across network namespaces, in tests/test_ucx_netns.py
@pytest.mark.parametrize(("n", "exclude"), [(65, None), (1000, None), (20000, None), (65, ["host-fd", "cma"]),
                                            (1000, ["host-fd", "cma"])],
                         ids=["cma-65", "cma-1000", "cma-20000", "ucx-rma-65", "ucx-rma-1000"])
def test_an_ordinary_dict_of_n_arrays_arrives_and_takes_puts(bundle_peer, n, exclude):
    tree = _ordinary(n)
    share = gs.export(tree, lifetime="revoked")
    assert len(share._bundle.parts) == n  # every array an allocation: n grants, n paths asked for
    name = f"ordinary-{n}-{bool(exclude)}"
    leases = _settled_leases()
    try:
        opened = bundle_peer.call("open", name, share, {"exclude": exclude} if exclude else None, timeout=240)
        assert set(opened["paths"]) == {"ucx-rma" if exclude else "cma"} and opened["leases"] >= 1
        assert get_exporter().stats()["leases"] == leases + 1  # one lease for the n allocations
        assert bundle_peer.call("digest_all", name, timeout=240) == _digest_all(tree)
        bundle_peer.call("fill", name, 7, timeout=240)
        for i, (key, arr) in enumerate(tree.items()):
            assert (arr == (7 + i) % 251).all(), key
        assert bundle_peer.call("digest_all", name, timeout=240) == _digest_all(tree)
    finally:
        bundle_peer.call("close", name)
        share.revoke()


def test_more_copies_than_one_connection_may_queue_go_in_paced_batches(bundle_peer):
    # More batch requests than the exporter queues for one connection: the
    # importer keeps cma.WINDOW of them in flight, never cma.MAX_QUEUED.
    n = cma.MAX_ITEMS * (cma.MAX_QUEUED + 3)
    tree = {f"w{i}": np.full(8, i % 251, np.uint8) for i in range(n)}
    share = gs.export(tree, lifetime="revoked")
    try:
        bundle_peer.call("open", "paced", share, timeout=240)
        assert bundle_peer.call("digest_all", "paced", timeout=240) == _digest_all(tree)
    finally:
        bundle_peer.call("close", "paced")
        share.revoke()


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_an_ordinary_dict_of_torch_cpu_tensors_arrives(bundle_peer):
    torch.manual_seed(0)
    tree = {f"w{i}": torch.randint(0, 250, (40 + i % 5,), dtype=torch.uint8) for i in range(300)}
    share = gs.export(tree, lifetime="revoked")
    try:
        opened = bundle_peer.call("open", "torch300", share)
        assert set(opened["paths"]) == {"cma"}
        assert bundle_peer.call("digest_all", "torch300") == _digest_all({k: v.numpy() for k, v in tree.items()})
    finally:
        bundle_peer.call("close", "torch300")
        share.revoke()


def test_an_allocation_the_exporter_cannot_serve_goes_its_next_path_alone(bundle_peer, monkeypatch):
    # The refusal names the allocation as data ("part"), not in its text: the
    # importer asks again with that one allocation's next path.
    from gpushare import UnsupportedError

    tree = _ordinary(300)
    refused = id(tree["w7"])
    serve = cma.Cma.serve

    def picky(self, export, session):
        if id(export.obj) == refused:
            raise UnsupportedError("this allocation is not for cma today")
        return serve(self, export, session)

    monkeypatch.setattr(cma.Cma, "serve", picky)
    share = gs.export(tree, lifetime="revoked")
    try:
        opened = bundle_peer.call("open", "picky", share)
        paths = opened["paths"]
        assert paths[7] == "ucx-rma" and set(paths[:7] + paths[8:]) == {"cma"}, paths
        assert "not for cma today" in opened["why"].splitlines()[7]
        assert any("SlowPathWarning" in w and "allocation 7" in w for w in opened["warnings"]), opened["warnings"]
        assert bundle_peer.call("digest_all", "picky") == _digest_all(tree)
    finally:
        bundle_peer.call("close", "picky")
        share.revoke()
