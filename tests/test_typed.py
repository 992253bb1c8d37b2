"""Typed shares end to end: dtype, shape and offset travel with a share, and
every view gives them to NumPy and DLPack consumers in another process."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import pickle
import traceback

import numpy as np
import pytest

import gpushare as gs
from gpushare import _dlpack
from gpushare._share import Share

CTX = mp.get_context("spawn")


class DLPackOnly:
    """A CPU tensor of a dtype only DLPack names (like torch's bfloat16)."""

    def __init__(self, raw: np.ndarray, code: int, bits: int) -> None:
        self.raw, self.dl = raw, (code, bits, 1)

    def __dlpack__(self, stream=None, max_version=None, **kw):
        return _dlpack.capsule(self.raw.ctypes.data, self.raw.shape, f"|V{self.raw.itemsize}", (1, 0),
                               readonly=False, owner=self, max_version=max_version, dl_dtype=self.dl)

    def __dlpack_device__(self):
        return (1, 0)


def _importer(shares, results) -> None:
    """Open each share; report what NumPy and a DLPack consumer see."""
    try:
        out = []
        for share in shares:
            with gs.open(share, timeout=30) as view:
                if view.path in ("cma", "ucx-rma"):
                    arr = np.empty(view.shape, view.typestr)
                    view.get(arr)
                    dl = None
                else:
                    arr = np.asarray(view)
                    tensor = _dlpack.borrow(view)
                    dl = (tensor.dtype, tensor.shape, tensor.readonly)
                    if share.dlpack_dtype is None:
                        via_dlpack = np.from_dlpack(view)
                        assert via_dlpack.dtype == arr.dtype and np.array_equal(via_dlpack, arr)
                        del via_dlpack
                    del tensor
                out.append({"path": view.path, "why": view.why, "typestr": arr.dtype.str, "shape": arr.shape,
                            "bytes": arr.tobytes(), "dlpack": dl, "writeable": arr.flags.writeable})
                if view.path not in ("cma", "ucx-rma") and not share.readonly:
                    arr.view(np.uint8).reshape(-1)[0] ^= 0xFF  # the exporter must see this
                del arr
        results.put(("ok", out))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def _open_elsewhere(*shares) -> list[dict]:
    return _in_child(_importer, shares)


def _in_child(target, *args):
    """Run ``target(*args, results)`` in a spawned process; its ("ok", value)."""
    results = CTX.Queue()
    p = CTX.Process(target=target, args=(*args, results))
    p.start()
    try:
        status, value = results.get(timeout=90)
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    if status == "error":
        pytest.fail(f"importer failed:\n{value}")
    assert p.exitcode == 0
    return value


def test_a_typed_view_of_allocated_memory_keeps_host_fd_with_its_offset():
    buf = gs.allocate(1 << 16, device="host")
    words = np.asarray(buf).view(np.float32)
    words[:] = np.arange(words.size, dtype=np.float32)
    part = words[100:130].reshape(5, 6)
    share = gs.export(part)
    assert share.offers == ("same-process", "host-fd", "ucx-rma")
    assert (share.shape, share.typestr, share.offset, share.nbytes) == ((5, 6), "<f4", 400, 120)
    [seen] = _open_elsewhere(share)
    assert seen["path"] == "host-fd" and (seen["typestr"], seen["shape"]) == ("<f4", (5, 6))
    assert seen["bytes"] == np.arange(100, 130, dtype=np.float32).tobytes()  # as read before writing
    assert seen["dlpack"] == ((2, 32, 1), (5, 6), False)
    assert part.view(np.uint8)[0, 0] == np.float32(100).tobytes()[0] ^ 0xFF  # the importer wrote through its mapping
    assert (words[99], words[130]) == (99.0, 130.0)  # and nothing outside its part
    share.revoke()
    del words, part
    buf.close()  # no array of the share is left on it


def test_shareable_arrays_take_every_path_typed():
    a = gs.zeros((4, 8), np.int16)
    assert isinstance(a, np.ndarray) and a.dtype == np.int16 and not a.any()
    a[...] = np.arange(32, dtype=np.int16).reshape(4, 8)
    b = gs.empty_like(a)
    b[...] = -a
    shares = [gs.export(a, readonly=True), gs.export(b[2:]), gs.export(gs.empty(3, np.complex128) * 0 + 1j)]
    assert [s.offers for s in shares[:2]] == [("same-process", "host-fd", "ucx-rma")] * 2
    assert shares[2].offers == ("same-process", "cma", "ucx-rma")  # arithmetic made a plain NumPy array
    seen = _open_elsewhere(*shares)
    assert [s["path"] for s in seen] == ["host-fd", "host-fd", "cma"]
    assert seen[0]["bytes"] == a.tobytes() and seen[0]["writeable"] is False
    assert seen[0]["dlpack"] == ((0, 16, 1), (4, 8), True)  # read-only reaches DLPack consumers too
    assert (seen[1]["shape"], seen[1]["typestr"]) == ((2, 8), "<i2")
    assert seen[1]["bytes"] == (-np.arange(16, 32, dtype=np.int16)).tobytes()
    assert seen[2]["typestr"] == "<c16" and seen[2]["bytes"] == (np.zeros(3) + 1j).tobytes()
    for s in shares:
        s.revoke()


def test_dlpack_only_dtypes_round_trip_through_dlpack():
    mem = gs.empty((2, 4), np.uint16)
    mem[...] = np.arange(8, dtype=np.uint16).reshape(2, 4) + 0x3F80  # bfloat16 bit patterns
    bf16 = DLPackOnly(mem, 4, 16)
    f8 = DLPackOnly(np.arange(6, dtype=np.uint8), 12, 8)  # float8_e5m2, memory gpushare did not allocate
    shares = [gs.export(bf16), gs.export(f8)]
    assert (shares[0].typestr, shares[0].dtype_name, shares[0].dlpack_dtype) == ("|V2", "bfloat16", (4, 16, 1))
    assert shares[0].offers == ("same-process", "host-fd", "ucx-rma")
    assert (shares[1].typestr, shares[1].dtype_name, shares[1].shape) == ("|V1", "float8_e5m2", (6,))
    seen = _open_elsewhere(*shares)
    assert seen[0]["path"] == "host-fd" and seen[0]["dlpack"][:2] == ((4, 16, 1), (2, 4))
    assert seen[0]["bytes"] == (np.arange(8, dtype=np.uint16) + 0x3F80).tobytes()  # as read before writing
    assert "dtype bfloat16 travels as DLPack (4, 16, 1)" in seen[0]["why"]
    assert seen[1]["path"] == "cma" and seen[1]["bytes"] == bytes(range(6))
    for s in shares:
        s.revoke()


def _strided_importer(share, results) -> None:
    try:
        with gs.open(share, timeout=30) as view:
            a = np.asarray(view)
            d = np.from_dlpack(view)
            refused = None
            try:
                view.get(bytearray(8))
            except gs.UnsupportedError as exc:
                refused = str(exc)
            out = (view.path, a.shape, a.strides, a.tolist(), d.strides, d.tolist(), refused)
            a[0, 0] = -1.0  # through the mapping, at that element only
            del a, d
        results.put(("ok", out))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def test_a_strided_view_travels_with_its_strides_where_it_is_mapped():
    x = gs.empty((4, 6), np.float32)
    x[...] = np.arange(24, dtype=np.float32).reshape(4, 6)
    cols = x[1:, ::2]
    share = gs.export(cols, lifetime="revoked")
    assert share.offers == ("same-process", "host-fd")  # get/put move bytes: no cma, no ucx-rma
    assert (share.shape, share.strides, share.offset, share.nbytes) == ((3, 3), (24, 8), 24, 68)
    assert Share.from_bytes(share.to_bytes()) == share and pickle.loads(pickle.dumps(share)) == share
    path, shape, strides, values, dl_strides, dl_values, refused = _in_child(_strided_importer, share)
    assert (path, shape, strides, dl_strides) == ("host-fd", (3, 3), (24, 8), (24, 8))
    expected = [[6.0, 8.0, 10.0], [12.0, 14.0, 16.0], [18.0, 20.0, 22.0]]
    assert values == dl_values == expected
    assert "strided array (strides (24, 8))" in refused and "numpy.asarray(view)" in refused
    assert x[1, 0] == -1.0 and x[1, 1] == 7.0 and x[0, 5] == 5.0  # one element changed, its neighbours not
    with gs.open(share) as view:  # in the exporting process: the same elements
        assert np.asarray(view).tolist() == [[-1.0, 8.0, 10.0], [12.0, 14.0, 16.0], [18.0, 20.0, 22.0]]
    share.revoke()
    with pytest.raises(gs.InvalidInputError, match="negative or not whole"):
        gs.export(x[::-1])
    with pytest.raises(gs.InvalidInputError, match="only over gpushare.allocate host memory"):
        gs.export(np.zeros((4, 4))[:, 1])
    fields = list(share._fields_)
    for strides, match in [((24,), "strides must be a tuple of 2 ints"), ((24, 6), "not a whole number"),
                           ((24, 4), "spans 60 bytes; nbytes says 68")]:
        fields[Share._NAMES.index("strides")] = strides
        with pytest.raises(gs.InvalidInputError, match=match):
            Share._make(*fields)


class RaisingCudaInterface(DLPackOnly):
    """Like a torch bfloat16 tensor: ``__cuda_array_interface__`` raises TypeError."""

    @property
    def __cuda_array_interface__(self):
        raise TypeError("dtype bfloat16 is not supported by __cuda_array_interface__")


def test_a_producer_whose_array_interface_raises_is_read_through_dlpack():
    t = RaisingCudaInterface(np.arange(4, dtype=np.uint16), 4, 16)
    share = gs.export(t)
    assert (share.typestr, share.dtype_name, share.shape) == ("|V2", "bfloat16", (4,))
    with gs.open(share) as view:  # same process: the object itself
        out = np.empty(8, np.uint8)
        view.get(out)
    assert out.tobytes() == np.arange(4, dtype=np.uint16).tobytes()
    share.revoke()


@pytest.mark.parametrize("arr", [np.array(["2024-01-01", "2025-06-30"], dtype="M8[s]"),
                                 np.array([1, 2], dtype="m8[ms]"),
                                 np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")])],
                         ids=["datetime64", "timedelta64", "structured"])
def test_a_dtype_with_no_portable_form_goes_as_bytes_with_a_note(arr):
    share = gs.export(arr)
    assert (share.typestr, share.shape, share.nbytes) == ("|u1", (arr.nbytes,), arr.nbytes)
    assert share.dtype_name == str(arr.dtype) or share.dtype_name.startswith("|V")
    [seen] = _open_elsewhere(share)
    assert seen["bytes"] == arr.tobytes()
    assert f"exported as bytes: dtype {share.dtype_name} has no portable form" in seen["why"]
    share.revoke()


def test_object_arrays_go_as_bytes_and_never_crash():
    share = gs.export(np.array([1, "a"], dtype=object))
    assert share.typestr == "|u1" and share.dtype_name == "object"
    share.revoke()


def test_host_views_give_numpy_and_dlpack_the_exporters_dtype_in_process():
    src = gs.zeros((3, 5), np.float64)
    share = gs.export(src, paths=["host-fd", "ucx-rma"])
    with gs.open(share, exclude=["same-process"]) as view:
        assert view.path == "host-fd" and view.__dlpack_device__() == (1, 0)
        a = np.from_dlpack(view)
        assert a.dtype == np.float64 and a.shape == (3, 5)
        src[1, 2] = 7.5
        assert a[1, 2] == 7.5  # the same memory
        with pytest.raises(BufferError, match="copy=True is not supported"):
            view.__dlpack__(copy=True)
    assert a[1, 2] == 7.5  # the mapping outlives the view while the array lives
    del a
    share.revoke()


def test_optional_share_fields_travel_and_are_validated():
    a = gs.empty(10, np.int32)
    share = gs.export(a[3:])
    assert share.offset == 12
    assert pickle.loads(pickle.dumps(share)) == share
    assert Share.from_bytes(share.to_bytes()) == share
    plain = gs.export(np.zeros(4))
    assert b"offset" not in plain.to_bytes() and b"dlpack" not in plain.to_bytes()  # older peers read it
    assert len(plain.__reduce__()[1]) == len(Share._BASE)
    fields = list(share._fields_)
    names = Share._NAMES
    for name, value, match in [("offset", -1, "offset is -1"), ("offset", True, "offset must be an int"),
                               ("dtype_name", "x" * 65, "not a dtype name"),
                               ("dtype_name", "a'b", "not a dtype name"),
                               ("dlpack_dtype", (4, 16), "must be a \\(code, bits, lanes\\)"),
                               ("dlpack_dtype", (4, 16, 1), "does not fit typestr <i4")]:
        bad = list(fields)
        bad[names.index(name)] = value
        with pytest.raises(gs.InvalidInputError, match=match):
            Share._make(*bad)
    gpu = list(fields)
    gpu[names.index("device")] = 0
    assert Share._make(*gpu).offset == fields[names.index("offset")]  # part of a CUDA buffer, too
    for s in (share, plain):
        s.revoke()


def test_bad_array_arguments_say_what_is_expected():
    with pytest.raises(gs.InvalidInputError, match="no portable form"):
        gs.empty(3, object)
    with pytest.raises(gs.InvalidInputError, match="not a NumPy dtype"):
        gs.zeros(3, "no-such-dtype")
    with pytest.raises(gs.InvalidInputError, match="shape entries must be ints"):
        gs.empty((2, 2.5))
    with pytest.raises(gs.InvalidInputError, match="expected 'host'"):
        gs.empty(3, device="gpu")
    with pytest.raises(gs.InvalidInputError, match="needs an array with shape and dtype"):
        gs.empty_like([1, 2])


# ---------------------------------------------------------------- asyncio


def _async_importer(share, results) -> None:
    async def main():
        async with await gs.open_async(share, timeout=30) as view:
            out = np.empty(view.shape, view.typestr)
            await view.get_async(out, timeout=30)
            closed_inside = view.closed
        # without the await: the open's own async context manager
        async with gs.open_async(share, timeout=30) as again:
            twice = np.empty(again.shape, again.typestr)
            await again.get_async(twice, timeout=30)
            assert not again.closed and twice.tobytes() == out.tobytes()
        return out.tobytes(), view.path, closed_inside, view.closed and again.closed

    try:
        results.put(("ok", asyncio.run(main())))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def test_open_async_and_async_with_in_another_process():
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    share = gs.export(arr)
    assert _in_child(_async_importer, share) == (arr.tobytes(), "cma", False, True)
    share.revoke()


def test_open_async_keeps_the_loop_running_and_reports_errors():
    share = gs.export(np.zeros(8))
    share.revoke()

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.ensure_future(tick())
        try:
            with pytest.raises(gs.ClosedError, match="revoked"):
                await gs.open_async(share)
        finally:
            ticker.cancel()
        return ticks

    assert asyncio.run(main()) > 0


# ---------------------------------------------------------------- a view as an array


def _describe_views(shares, results) -> None:
    try:
        out = []
        for share in shares:
            with gs.open(share, timeout=30) as view:
                fresh = view.get()
                try:
                    length = len(view)
                except TypeError as exc:
                    length = str(exc)
                out.append({"path": view.path, "dtype": str(view.dtype), "ndim": view.ndim, "len": length,
                            "repr": repr(view), "bool": bool(view), "type": type(fresh).__name__,
                            "fresh": (fresh.dtype.str, fresh.shape, fresh.tobytes(), fresh.flags.c_contiguous)})
                try:
                    view.get(offset=8)
                    out[-1]["offset"] = "allowed"
                except gs.InvalidInputError as exc:
                    out[-1]["offset"] = str(exc)
        results.put(("ok", out))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def test_a_view_has_dtype_ndim_len_and_gets_into_a_fresh_array():
    plain = np.arange(12, dtype=np.float32).reshape(3, 4)          # cma: copied
    grid = gs.empty((8, 6), "float64")
    grid[:] = np.arange(48.0).reshape(8, 6)                        # host-fd, strided: mapped
    scalar = np.array(5, dtype=np.int16)                           # 0-d
    shares = [gs.export(plain), gs.export(grid[:, 2]), gs.export(scalar)]
    got = _in_child(_describe_views, shares)
    for want, seen in zip((plain, grid[:, 2], scalar), got, strict=True):
        assert seen["dtype"] == str(want.dtype) and seen["ndim"] == want.ndim and seen["bool"] is True
        assert seen["type"] == "ndarray" and seen["fresh"] == (want.dtype.str, want.shape,
                                                               np.ascontiguousarray(want).tobytes(), True)
        assert str(want.dtype) in seen["repr"] and "bytes" in seen["repr"]
        assert seen["offset"].startswith("view.get() with no destination copies the whole view")
    assert [s["path"] for s in got] == ["cma", "host-fd", "cma"]
    assert [s["len"] for s in got] == [3, 8, "len() of a 0-d view"]
    assert "3x4" in got[0]["repr"] and "scalar" in got[2]["repr"]
    for share in shares:
        share.revoke()


def _keep_until_exit(share) -> None:
    _KEPT.append(gs.open(share))
    _KEPT.append(np.from_dlpack(_KEPT[0]))  # released in the interpreter's last collection


_KEPT: list = []


def test_a_dlpack_array_alive_at_interpreter_exit_does_not_crash_the_process():
    # Its deleter ran after this module's globals were gone: SIGSEGV at exit.
    a = gs.zeros(8, dtype=np.int64)
    share = gs.export(a)
    p = mp.get_context("spawn").Process(target=_keep_until_exit, args=(share,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
