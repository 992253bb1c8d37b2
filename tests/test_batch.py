"""Batched transfers on the sharing API: many (view, offset, buffer), one completion."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import gpushare as gs

from _procs import Child
import _share_peer

KiB = 1 << 10


@pytest.fixture(scope="module")
def exporter():
    child = Child(_share_peer.setup)
    yield child
    child.close()


def _data(share_kind: str, size: int) -> bytes:
    return (np.arange(size, dtype=np.uint64).astype(np.uint8)).tobytes()  # what _share_peer exports


def test_one_batch_moves_items_of_many_shares_on_every_path(exporter):
    shares = [exporter.call("export", kind, 64 * KiB, {"lifetime": "revoked"})
              for kind in ("numpy", "numpy", "host")]
    views = [gs.open(s, prefer=p) for s, p in zip(shares, ("ucx-rma", None, None))]
    try:
        assert [v.path for v in views] == ["ucx-rma", "cma", "host-fd"]
        outs = [bytearray(4 * KiB) for _ in range(6)]
        items = [(v, off, outs[i * 2 + j]) for i, v in enumerate(views) for j, off in enumerate((0, 8 * KiB))]
        req = gs.get_batch(items)
        assert len(req) == 6
        req.wait(30)
        assert req.done() and req.exception() is None
        expected = _data("numpy", 64 * KiB)
        for (view, off, out) in items:
            assert bytes(out) == expected[off:off + 4 * KiB], (view.path, off)
        put = gs.put_batch([(v, 100, b"batched!") for v in views])
        put.wait(30)
        for v in views:
            out = bytearray(8)
            v.get(out, 100)
            assert out == b"batched!"
    finally:
        for v in views:
            v.close()


def test_puts_into_a_host_share_over_ucx_rma_travel_gathered(exporter):
    share = exporter.call("export", "numpy", 256 * KiB, {"lifetime": "revoked"})
    with gs.open(share, prefer="ucx-rma") as view:
        assert view.path == "ucx-rma"
        chunks = [bytes([i]) * (3 * KiB + i) for i in range(40)]
        offsets = [i * 6 * KiB for i in range(40)]
        before = exporter.call("ucx_messages")
        gs.put_batch(list(zip([view] * 40, offsets, chunks))).wait(30)
        assert exporter.call("ucx_messages") - before < 5  # 40 puts, 120 KiB: gathered into one or two
        for off, chunk in zip(offsets, chunks):
            out = bytearray(len(chunk))
            view.get(out, off)
            assert bytes(out) == chunk


def test_a_bad_item_stops_the_batch_before_anything_moves(exporter):
    share = exporter.call("export", "numpy", 4 * KiB, {"lifetime": "revoked"})
    readonly = exporter.call("export", "numpy", 4 * KiB, {"lifetime": "revoked", "readonly": True})
    with gs.open(share) as view, gs.open(readonly) as ro:
        with pytest.raises(gs.OutOfBoundsError):
            gs.put_batch([(view, 0, b"first"), (view, 4 * KiB - 2, b"runs past")])
        with pytest.raises(gs.InvalidInputError, match="read-only"):
            gs.put_batch([(view, 0, b"first"), (ro, 0, b"refused")])
        with pytest.raises(gs.InvalidInputError, match="not a \\(view, offset, buffer\\) tuple"):
            gs.get_batch([(view, 0)])
        out = bytearray(5)
        view.get(out)
        assert out == bytes(range(5))  # the first item of each refused batch never moved


def test_a_batch_can_be_awaited(exporter):
    share = exporter.call("export", "numpy", 16 * KiB, {"lifetime": "revoked"})

    async def main() -> list[bytes]:
        view = await gs.open_async(share)
        async with view:
            outs = [bytearray(16) for _ in range(8)]
            await gs.get_batch([(view, i * 1024, out) for i, out in enumerate(outs)])
            return [bytes(o) for o in outs]

    got = asyncio.run(main())
    expected = _data("numpy", 16 * KiB)
    assert got == [expected[i * 1024:i * 1024 + 16] for i in range(8)]
