"""get/put on a mapped host view with NumPy arrays (the short path) check
what the general path checks and move the right bytes."""

from __future__ import annotations

import numpy as np
import pytest

import gpushare as gs


@pytest.fixture
def view():
    src = gs.empty(4096, np.uint8)
    src[:] = np.arange(4096) % 251
    share = gs.export(src)
    v = gs.open(share, exclude=["same-process"])
    assert v.path == "host-fd"
    yield v, src
    v.close()


def test_numpy_arrays_of_any_dtype_and_shape_move_their_bytes(view):
    v, src = view
    out = np.empty((4, 8), np.float32)  # 128 bytes
    v.get(out, 100)
    assert out.tobytes() == src[100:228].tobytes()
    v.put(np.arange(6, dtype=np.int16).reshape(2, 3), 10)
    assert src[10:22].tobytes() == np.arange(6, dtype=np.int16).tobytes()
    empty = np.empty(0, np.uint8)
    v.get(empty, 4096)  # nothing, at the very end: allowed
    v.put(empty, 4096)


def test_the_short_path_refuses_what_the_general_path_refuses(view):
    v, src = view
    with pytest.raises(gs.OutOfBoundsError):
        v.get(np.empty(16, np.uint8), 4090)
    with pytest.raises(gs.OutOfBoundsError):
        v.put(np.empty(16, np.uint8), 4090)
    with pytest.raises(gs.InvalidInputError):
        v.get(np.empty(16, np.uint8), -1)
    frozen = np.empty(16, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(gs.InvalidInputError, match="read-only|writable"):
        v.get(frozen)
    strided = np.empty((8, 8), np.uint8)[:, ::2]
    with pytest.raises(gs.InvalidInputError, match="C-contiguous"):
        v.get(strided)
    before = src.copy()
    assert (src == before).all()  # nothing moved
    v.close()
    with pytest.raises(gs.ClosedError):
        v.get(np.empty(16, np.uint8))


def test_a_read_only_share_refuses_puts_on_the_short_path():
    src = gs.zeros(64, np.uint8)
    share = gs.export(src, readonly=True)
    with gs.open(share, exclude=["same-process"]) as v:
        with pytest.raises(gs.InvalidInputError, match="read-only"):
            v.put(np.ones(8, np.uint8))
        out = np.ones(8, np.uint8)
        v.get(out)
        assert not out.any()
    assert not src.any()
