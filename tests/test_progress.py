"""A long copy over a copied path (cma, ucx-rma) reports its progress: DEBUG
lines on the ``gpushare.progress`` logger above 256 MiB, and a callback
(``view.get(dst, progress=...)``) after each piece; a copy nobody listens to
is one request, as before."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

import gpushare as gs
from gpushare import _progress

MiB = 1 << 20
#: Above the logging threshold, and not a whole number of pieces.
BIG = _progress.LOG_ABOVE + _progress.PIECE // 2


def _pattern(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.uint64).astype(np.uint8)  # as the peer's "numpy" export


def _check_calls(calls: list[tuple[int, int]], total: int) -> None:
    assert calls, "the callback was never called"
    assert all(t == total for _, t in calls)
    done = [d for d, _ in calls]
    assert done == sorted(set(done)), f"not strictly growing: {done}"
    assert done[-1] == total


@pytest.mark.parametrize("waited", [True, False], ids=["get", "get_async"])
@pytest.mark.parametrize("prefer", ["cma", "ucx-rma"])
def test_a_long_copy_logs_at_debug_and_calls_back_after_each_piece(peer, caplog, prefer, waited):
    share = peer.call("export", "numpy", BIG, {"lifetime": "revoked"})
    view = gs.open(share, prefer=prefer)
    try:
        assert view.path == prefer
        dst = np.zeros(BIG, np.uint8)
        calls: list[tuple[int, int]] = []

        def progress(done: int, total: int) -> None:
            calls.append((done, total))

        with caplog.at_level(logging.DEBUG, logger="gpushare.progress"):
            if waited:
                view.get(dst, progress=progress)
            else:
                asyncio.run(view.get_async(dst, progress=progress))
        assert np.array_equal(dst, _pattern(BIG))  # every byte arrived, piece by piece
        _check_calls(calls, BIG)
        pieces = -(-BIG // _progress.PIECE)
        assert len(calls) == pieces
        assert [d for d, _ in calls][:-1] == [_progress.PIECE * (k + 1) for k in range(pieces - 1)]
        lines = [r.getMessage() for r in caplog.records if r.name == "gpushare.progress"]
        assert all(r.levelno == logging.DEBUG for r in caplog.records if r.name == "gpushare.progress")
        what = f"get of share {share.share_id[:8]} over {prefer}"
        assert lines[0] == f"{what}: {BIG // MiB} MiB, starting"
        assert lines[-1].startswith(f"{what}: {BIG // MiB} MiB done in ") and lines[-1].endswith(" GB/s)")
        assert any("%" in line for line in lines[1:-1])
        assert 3 <= len(lines) <= 12, lines  # a few lines, not one per piece of a larger copy
    finally:
        view.close()
        peer.call("drop_exports")


def test_a_put_with_a_callback_and_a_small_copy_report_too(peer, caplog):
    share = peer.call("export", "numpy", 3 * MiB, {"lifetime": "revoked"})
    try:
        with gs.open(share) as view:
            assert view.path == "cma"
            calls: list[tuple[int, int]] = []
            src = np.full(3 * MiB, 7, np.uint8)
            with caplog.at_level(logging.DEBUG, logger="gpushare.progress"):
                view.put(src, progress=lambda d, t: calls.append((d, t)))
                assert calls == [(3 * MiB, 3 * MiB)]  # one piece
                got = view.get(progress=lambda d, t: calls.append((d, t)))
            assert got.tobytes() == src.tobytes()
            assert calls[-1] == (3 * MiB, 3 * MiB)
            # Small copies log nothing, whoever listens.
            assert not [r for r in caplog.records if r.name == "gpushare.progress"]
    finally:
        peer.call("drop_exports")


def test_a_mapped_copy_calls_back_once_at_its_end(peer):
    share = peer.call("export", "host", 2 * MiB, {"lifetime": "revoked"})
    try:
        with gs.open(share) as view:
            assert view.path == "host-fd"
            calls: list[tuple[int, int]] = []
            dst = np.empty(MiB, np.uint8)
            view.get(dst, MiB, progress=lambda d, t: calls.append((d, t)))
            assert calls == [(MiB, MiB)]
            assert np.array_equal(dst, _pattern(2 * MiB)[MiB:])
    finally:
        peer.call("drop_exports")


def test_a_copy_nobody_listens_to_is_one_request(peer, monkeypatch):
    share = peer.call("export", "numpy", 3 * _progress.PIECE, {"lifetime": "revoked"})
    assert not logging.getLogger("gpushare.progress").isEnabledFor(logging.DEBUG)
    try:
        with gs.open(share) as view:
            transport = view._transport
            sent: list[int] = []
            real = transport.get

            def counted(offset, buf, *args):
                sent.append(offset)
                return real(offset, buf, *args)

            monkeypatch.setattr(transport, "get", counted)
            dst = np.empty(3 * _progress.PIECE, np.uint8)
            view.get(dst)
            assert sent == [0]
            view.get(dst, progress=lambda d, t: None)
            assert sent == [0, 0, _progress.PIECE, 2 * _progress.PIECE]
            assert np.array_equal(dst, _pattern(dst.size))
    finally:
        peer.call("drop_exports")


def test_a_callback_that_raises_stops_the_copy_and_a_wrong_one_is_a_type_error(peer):
    share = peer.call("export", "numpy", 2 * _progress.PIECE, {"lifetime": "revoked"})
    try:
        with gs.open(share) as view:
            dst = np.zeros(2 * _progress.PIECE, np.uint8)

            def stop(done, total):
                raise KeyboardInterrupt(done)

            with pytest.raises(KeyboardInterrupt):
                view.get(dst, progress=stop)
            assert dst[_progress.PIECE:].max() == 0  # the second piece never went
            with pytest.raises(gs.InvalidTypeError, match=r"^progress must be a callable \(done, total\) or None, "
                                                         r"not int$"):
                view.get(dst, progress=1)
    finally:
        peer.call("drop_exports")


def test_an_awaited_long_put_logs_when_only_the_log_listens(peer, caplog):
    share = peer.call("export", "numpy", BIG, {"lifetime": "revoked"})
    try:
        with gs.open(share, prefer="cma") as view:
            with caplog.at_level(logging.DEBUG, logger="gpushare.progress"):
                asyncio.run(view.put_async(np.full(BIG, 3, np.uint8)))
            lines = [r.getMessage() for r in caplog.records if r.name == "gpushare.progress"]
            assert lines[0] == f"put of share {share.share_id[:8]} over cma: {BIG // MiB} MiB, starting", lines
            assert lines[-1].startswith(f"put of share {share.share_id[:8]} over cma: {BIG // MiB} MiB done in ")
            assert (view.get()[::_progress.PIECE // 2] == 3).all()
    finally:
        peer.call("drop_exports")


def test_an_awaited_small_or_mapped_copy_calls_back_once(peer):
    shares = [peer.call("export", kind, 2 * MiB, {"lifetime": "revoked"}) for kind in ("numpy", "host")]
    try:
        for share, path in zip(shares, ("cma", "host-fd"), strict=True):
            with gs.open(share) as view:
                assert view.path == path
                calls: list[tuple[int, int]] = []
                dst = np.empty(MiB, np.uint8)
                asyncio.run(view.get_async(dst, MiB, progress=lambda d, t: calls.append((d, t))))
                assert calls == [(MiB, MiB)]
                assert np.array_equal(dst, _pattern(2 * MiB)[MiB:])
                with pytest.raises(gs.InvalidTypeError, match="^progress must be a callable"):
                    asyncio.run(view.get_async(dst, progress="bar"))
    finally:
        peer.call("drop_exports")
