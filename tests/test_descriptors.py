"""Descriptors: the reference page's contract, validation of untrusted fields, pickling."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpushare as gs
from gpushare._descriptors import (
    MAX_ALLOCATIONS,
    POSIX_FD_FORMAT,
    CudaIpcBufferDescriptor,
    CudaPoolBufferDescriptor,
    PosixFdBufferDescriptor,
    VirtualMemoryFabricBufferDescriptor,
    _rebuild,
    cuda_core_fabric_descriptor_class,
)

Fabric = VirtualMemoryFabricBufferDescriptor
H = bytes(range(64))
MiB2 = 2 << 20


def roundtrip(obj):
    return pickle.loads(pickle.dumps(obj))


class Evil:
    """Pickles as a call to the descriptors' unpickling constructor with any fields."""

    def __init__(self, *fields):
        self.fields = fields

    def __reduce__(self):
        return (_rebuild, self.fields)


# -- VirtualMemoryFabricBufferDescriptor: the reference page -------------------


def test_fabric_from_handles_contract():
    d = Fabric.from_handles([H, bytearray(H[::-1])], (MiB2, MiB2), owner_uuid="GPU-1234")
    assert d.handle_type == "fabric"
    assert d.handles == (H, H[::-1]) and all(type(h) is bytes for h in d.handles)
    assert d.sizes == (MiB2, MiB2)
    assert d.size == 2 * MiB2  # the sum by default
    assert d.owner_uuid == "GPU-1234"
    assert Fabric.from_handles(iter([H]), iter([MiB2]), size=0).size == 0
    assert Fabric.from_handles([H], [np.int64(MiB2)], size=np.uint32(5)).size == 5
    assert Fabric.from_handles([H], [MiB2]).owner_uuid is None


def test_fabric_is_immutable_hashable_and_pickles():
    d = Fabric.from_handles([H, H], [MiB2, 4096], size=MiB2 + 1)
    with pytest.raises(AttributeError, match="immutable"):
        d.size = 0
    with pytest.raises(AttributeError):
        del d.handles
    e = roundtrip(d)
    assert e == d and hash(e) == hash(d) and e is not d
    assert e.handles == d.handles and e.sizes == d.sizes and e.size == d.size
    assert d != Fabric.from_handles([H, H], [MiB2, 4096])
    with pytest.raises(TypeError, match="from_handles"):
        Fabric([H], [MiB2])


@pytest.mark.parametrize(
    ("handles", "sizes", "kwargs", "match"),
    [
        ([H, H], [MiB2], {}, "2 handles but 1 sizes"),
        ([H], [MiB2, MiB2], {}, "1 handles but 2 sizes"),
        ([H, H[:63]], [1, 1], {}, "handle 1 is 63 bytes; expected 64"),
        ([H + b"x"], [1], {}, "handle 0 is 65 bytes; expected 64"),
        (["x" * 64], [1], {}, "handle 0 is str; expected 64 bytes"),
        ([123], [1], {}, "handle 0 is int"),
        (H, [1], {}, "single bytes"),
        ([], [], {}, "handles is empty"),
        (None, [1], {}, "expected an iterable"),
        ([H], [0], {}, "allocation size 0 is 0; expected a positive integer"),
        ([H, H], [1, -4096], {}, "allocation size 1 is -4096; expected a positive integer"),
        ([H], [True], {}, "allocation size 0 is a bool"),
        ([H], [np.bool_(True)], {}, "allocation size 0 is a bool"),
        ([H], [4096.0], {}, "allocation size 0 is float"),
        ([H], ["4096"], {}, "allocation size 0 is str"),
        ([H], [2**63], {}, "expected less than 2\\*\\*63"),
        ([H, H], [2**62, 2**62], {}, "add up to"),
        ([H], [4096], {"size": 4097}, "buffer size is 4097; expected between 0 and 4096"),
        ([H], [4096], {"size": -1}, "buffer size is -1"),
        ([H], [4096], {"size": True}, "buffer size is a bool"),
        ([H], [4096], {"size": 1.0}, "buffer size is float"),
        ([H], [4096], {"owner_uuid": 5}, "owner_uuid is int"),
        ([H], [4096], {"owner_uuid": "G" * 257}, "owner_uuid is 257 characters"),
    ],
)
def test_fabric_refuses(handles, sizes, kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        Fabric.from_handles(handles, sizes, **kwargs)
    assert isinstance(info.value, gs.InvalidInputError)


def test_fabric_refuses_too_many_allocations_without_reading_them_all():
    def endless():
        while True:
            yield H

    with pytest.raises(gs.InvalidInputError, match=f"more than {MAX_ALLOCATIONS}"):
        Fabric.from_handles(endless(), [1])


def test_unpickling_validates_again():
    good = Fabric.from_handles([H], [4096])
    assert roundtrip(Evil("fabric", [H], [4096], None, None)) == good
    with pytest.raises(gs.InvalidInputError, match="handle 0 is 3 bytes"):
        roundtrip(Evil("fabric", [b"abc"], [4096], None, None))
    with pytest.raises(gs.InvalidInputError, match="buffer size is 5000"):
        roundtrip(Evil("fabric", [H], [4096], 5000, None))
    with pytest.raises(gs.InvalidInputError, match="has 2 fields; expected 4"):
        roundtrip(Evil("fabric", [H], [4096]))
    with pytest.raises(gs.InvalidInputError, match="unknown descriptor handle type 'nfs'"):
        roundtrip(Evil("nfs", 1, 2))
    with pytest.raises(gs.InvalidInputError, match="unknown descriptor"):
        roundtrip(Evil(7, 1, 2))


handle_st = st.one_of(
    st.binary(min_size=64, max_size=64),
    st.binary(max_size=80),
    st.text(max_size=3),
    st.integers(),
    st.none(),
)
size_st = st.one_of(
    st.integers(min_value=-(2**64), max_value=2**64),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.none(),
)


@settings(max_examples=300, deadline=None)
@given(
    handles=st.lists(handle_st, max_size=4),
    sizes=st.lists(size_st, max_size=4),
    size=st.one_of(st.none(), size_st),
    owner=st.one_of(st.none(), st.text(max_size=300), st.integers()),
)
def test_fabric_property_valid_or_value_error(handles, sizes, size, owner):
    try:
        d = Fabric.from_handles(handles, sizes, size=size, owner_uuid=owner)
    except gs.InvalidInputError:
        return  # the only way to refuse
    # whatever was accepted honours every invariant and survives pickling
    assert len(d.handles) == len(d.sizes) >= 1
    assert all(type(h) is bytes and len(h) == 64 for h in d.handles)
    assert all(type(n) is int and 0 < n < 2**63 for n in d.sizes)
    assert 0 <= d.size <= sum(d.sizes) < 2**63
    assert owner is None or (isinstance(owner, str) and len(owner) <= 256)
    assert roundtrip(d) == d


def test_cuda_core_interop():
    theirs = cuda_core_fabric_descriptor_class()
    d = Fabric.from_handles([H], [MiB2], owner_uuid="GPU-x")
    assert Fabric._coerce(d) is d
    if theirs is None:  # cuda.core 1.2 has no such class: say so, do not pretend
        with pytest.raises(ImportError, match="no VirtualMemoryFabricBufferDescriptor"):
            d.to_cuda_core()
    else:
        c = d.to_cuda_core()
        assert isinstance(c, theirs)
        assert Fabric._coerce(c) == d
    with pytest.raises(gs.InvalidInputError):
        Fabric._coerce(object())


# -- PosixFdBufferDescriptor --------------------------------------------------

GOOD_FD = {
    "version": POSIX_FD_FORMAT,
    "address": "\0gpushare-1-abc",
    "export_id": 3,
    "token": bytes(range(32)),
    "pid": 1234,
    "node": "boot:host",
    "device": "host",
    "sizes": (4096, 8192),
    "size": 10000,
    "owner_uuid": None,
}


def posix_fd(**changes):
    return PosixFdBufferDescriptor._from_fields(*{**GOOD_FD, **changes}.values())


def test_posix_fd_is_plain_data():
    d = posix_fd()
    assert d.handle_type == "posix-fd"
    assert (d.version, d.export_id, d.pid, d.device, d.sizes, d.size) == (
        1,
        3,
        1234,
        "host",
        (4096, 8192),
        10000,
    )
    assert roundtrip(d) == d and hash(roundtrip(d)) == hash(d)
    assert posix_fd(device=2, owner_uuid="GPU-2").device == 2
    assert posix_fd(address="/run/gpushare.sock").address == "/run/gpushare.sock"
    assert posix_fd(size=None).size == 12288
    assert d.token.hex() not in repr(d) and "token" not in repr(d)
    with pytest.raises(AttributeError):
        d.token = bytes(32)
    with pytest.raises(TypeError, match="export_buffer"):
        PosixFdBufferDescriptor()


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"version": 2}, "format version 2 is not supported; this gpushare reads version 1"),
        ({"version": True}, "format version is a bool"),
        ({"address": b"\0x"}, "broker address is bytes"),
        ({"address": ""}, "broker address is 0 bytes"),
        ({"address": "/" + "a" * 107}, "broker address is 108 bytes"),
        ({"address": "\0a\0b"}, "NUL byte"),
        ({"export_id": -1}, "export id is -1"),
        ({"export_id": 2**63}, "export id"),
        ({"token": bytes(31)}, "token is 31 bytes; expected 32"),
        ({"token": "x" * 32}, "token is str; expected bytes"),
        ({"pid": 0}, "exporter pid is 0"),
        ({"pid": 2**31}, "exporter pid"),
        ({"pid": 1.0}, "exporter pid is float"),
        ({"node": None}, "node identity is NoneType"),
        ({"node": "n" * 257}, "node identity is 257 characters"),
        ({"device": "cpu"}, "device is 'cpu'"),
        ({"device": -1}, "device is -1"),
        ({"device": False}, "device is a bool"),
        ({"sizes": ()}, "sizes is empty"),
        ({"sizes": (4096, 0)}, "allocation size 1 is 0"),
        ({"size": 12289}, "buffer size is 12289"),
        ({"owner_uuid": b"GPU"}, "owner_uuid is bytes"),
    ],
)
def test_posix_fd_refuses(changes, match):
    with pytest.raises(gs.InvalidInputError, match=match):
        posix_fd(**changes)
    fields = {**GOOD_FD, **changes}
    with pytest.raises(gs.InvalidInputError, match=match):  # the same through pickle
        roundtrip(Evil("posix-fd", *fields.values()))


@pytest.mark.parametrize(("old", "new"), [("posix_fd", "posix-fd"), ("cuda_ipc", "cuda-ipc")])
def test_descriptors_pickled_with_the_old_spelling_still_load(old, new):
    fields = tuple(GOOD_FD.values()) if new == "posix-fd" else GOOD_IPC
    d = roundtrip(Evil(old, *fields))
    assert d.handle_type == new
    assert roundtrip(d) == d


def test_posix_fd_wrong_field_count():
    with pytest.raises(gs.InvalidInputError, match="has 9 fields; expected 10"):
        roundtrip(Evil("posix-fd", *list(GOOD_FD.values())[:9]))


# -- CudaIpcBufferDescriptor --------------------------------------------------

GOOD_IPC = (H, 1 << 20, 4096, 8192, 0, "GPU-0", 99, "boot:host")


def test_cuda_ipc_is_plain_data():
    d = CudaIpcBufferDescriptor._from_fields(*GOOD_IPC)
    assert d.handle_type == "cuda-ipc"
    assert (d.handle, d.base_size, d.offset, d.size, d.device, d.pid) == (H, 1 << 20, 4096, 8192, 0, 99)
    assert roundtrip(d) == d


@pytest.mark.parametrize(
    ("index", "value", "match"),
    [
        (0, H[:63], "handle is 63 bytes; expected 64"),
        (0, bytearray(H), "handle is bytearray"),
        (1, 0, "base allocation size 0 is 0"),
        (2, -1, "at offset -1 does not fit"),
        (3, (1 << 20) - 4095, "does not fit in the base allocation"),
        (4, -2, "device is -2"),
        (6, 0, "exporter pid is 0"),
    ],
)
def test_cuda_ipc_refuses(index, value, match):
    fields = list(GOOD_IPC)
    fields[index] = value
    with pytest.raises(gs.InvalidInputError, match=match):
        roundtrip(Evil("cuda-ipc", *fields))


# -- CudaPoolBufferDescriptor -------------------------------------------------

GOOD_POOL = ("\0gpushare-1-abc", 3, bytes(range(32)), 1234, "boot:host", 0, "GPU-0", H, 1 << 20, 4096, 8192)


def test_cuda_pool_is_plain_data():
    d = CudaPoolBufferDescriptor._from_fields(*GOOD_POOL)
    assert d.handle_type == "cuda-pool"
    assert (d.export_data, d.base_size, d.offset, d.size, d.device, d.pid, d.export_id) == (
        H, 1 << 20, 4096, 8192, 0, 1234, 3)
    assert roundtrip(d) == d
    assert "token" not in repr(d) and bytes(range(32)).hex() not in repr(d)


@pytest.mark.parametrize(
    ("index", "value", "match"),
    [
        (0, "", "broker address is 0 bytes"),
        (2, bytes(31), "token"),
        (3, 0, "pid"),
        (5, -1, "device is -1"),
        (7, H[:63], "export data is 63 bytes; expected 64"),
        (7, "x" * 64, "export data is str"),
        (8, 0, "allocation size 0 is 0"),
        (9, -1, "at offset -1 does not fit"),
        (10, (1 << 20) - 4095, "does not fit in the allocation"),
    ],
)
def test_cuda_pool_refuses(index, value, match):
    fields = list(GOOD_POOL)
    fields[index] = value
    with pytest.raises(gs.InvalidInputError, match=match):
        roundtrip(Evil("cuda-pool", *fields))


anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=40),
    st.lists(st.integers(min_value=-5, max_value=2**64), max_size=3),
    st.lists(st.binary(max_size=70), max_size=3),
)


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(["fabric", "posix-fd", "cuda-ipc", "cuda-pool"]),
    picks=st.lists(st.booleans(), min_size=11, max_size=11),
    noise=st.lists(anything, min_size=11, max_size=11),
)
def test_unpickling_anything_gives_a_descriptor_or_value_error(kind, picks, noise):
    good = {
        "fabric": ([H], [4096], None, None),
        "posix-fd": tuple(GOOD_FD.values()),
        "cuda-ipc": GOOD_IPC,
        "cuda-pool": GOOD_POOL,
    }[kind]
    fields = [n if p else g for g, p, n in zip(good, picks, noise, strict=False)]
    try:
        d = roundtrip(Evil(kind, *fields))
    except gs.InvalidInputError:
        return
    assert d.handle_type == kind
    assert roundtrip(d) == d


def test_a_descriptor_seen_before_is_validated_again_when_its_types_differ():
    """The importer rebuilds a further open's descriptor from fields it has
    seen once; fields that are equal but not of the same types (True for
    1) are validated anew, and refused as before."""
    import gpushare as gs
    from gpushare._paths import base

    buf = gs.allocate(4096, device="host")
    desc = gs.export_buffer(buf)
    fields = (desc.handle_type, *desc._fields())
    assert base._rebuilt(fields) == desc
    assert base._rebuilt(fields) is base._rebuilt(fields)  # seen: validated once
    forged = (fields[0], True, *fields[2:])  # the format version as a bool
    assert forged == fields
    with pytest.raises(gs.InvalidInputError):
        base._rebuilt(forged)
    with pytest.raises(gs.InvalidInputError):
        base._rebuilt((fields[0], [1], *fields[2:]))  # unhashable: refused, not cached
    buf.close()


# The pickled form (the order of each descriptor's fields) is a wire format:
# these are the bytes and orders every earlier version wrote.
FABRIC_PICKLE = bytes.fromhex(
    "800495cb000000000000008c1567707573686172652e5f64657363726970746f7273948c085f72656275696c64949394288c0666"
    "61627269639443407878787878787878787878787878787878787878787878787878787878787878787878787878787878787878"
    "78787878787878787878787878787878787878789443407979797979797979797979797979797979797979797979797979797979"
    "79797979797979797979797979797979797979797979797979797979797979797979799486944d00104d002086944d88138c0175"
    "94749452942e"
)


def test_the_pickled_form_is_unchanged():
    d = Fabric.from_handles([b"x" * 64, b"y" * 64], [4096, 8192], size=5000, owner_uuid="u")
    assert pickle.dumps(d, 4) == FABRIC_PICKLE
    assert pickle.loads(FABRIC_PICKLE) == d
    assert Fabric._FIELDS == ("handles", "sizes", "size", "owner_uuid")
    assert PosixFdBufferDescriptor._FIELDS == (
        "version", "address", "export_id", "token", "pid", "node", "device", "sizes", "size", "owner_uuid")
    assert CudaIpcBufferDescriptor._FIELDS == (
        "handle", "base_size", "offset", "size", "device", "owner_uuid", "pid", "node")
    assert CudaPoolBufferDescriptor._FIELDS == (
        "address", "export_id", "token", "pid", "node", "device", "owner_uuid", "export_data", "base_size",
        "offset", "size")


def _one_of_each():
    return [Fabric.from_handles([H], [MiB2]), PosixFdBufferDescriptor._from_fields(*GOOD_FD.values()),
            CudaIpcBufferDescriptor._from_fields(*GOOD_IPC), CudaPoolBufferDescriptor._from_fields(*GOOD_POOL)]


@pytest.mark.parametrize("index", range(4))
def test_each_descriptor_is_a_frozen_dataclass_that_only_its_constructor_builds(index):
    d = _one_of_each()[index]
    cls = type(d)
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    assert tuple(f.name for f in dataclasses.fields(cls)) == cls._FIELDS
    with pytest.raises(AttributeError):
        d.__dict__  # slotted: nothing can be added to one
    with pytest.raises(TypeError, match=f"^{cls.__name__} cannot be constructed directly"):
        dataclasses.replace(d, size=1)
    with pytest.raises(AttributeError, match=f"^{cls.__name__} is immutable$"):
        d.size = 1
    with pytest.raises(AttributeError, match=f"^{cls.__name__} is immutable$"):
        d.unknown = 1
    assert d.size == cls._from_fields(*d._fields()).size
