"""The items of a batch of the seed API's puts or gets (``Endpoint.mem_put_batch`` and
``mem_get_batch``): resolved and checked, every one, before anything is posted.

A batch is one request for many local buffers against one remote key: one Python call
and one native call post them all, which is what a caller moving many small buffers pays
per buffer otherwise (see docs/ucx.md, "Batches").
"""

from __future__ import annotations

import itertools
from typing import Any

from .. import _buffers, _types
from .._errors import InvalidInputError, OutOfBoundsError
from . import _device

__all__ = ["MAX_BATCH_ITEMS", "check_range", "resolve_items", "release_all"]

#: Items one batch may hold (docs/limits.md).
MAX_BATCH_ITEMS = 1 << 16


def check_range(op: str, address: int, nbytes: int, lo: int, hi: int, item: int | None = None) -> None:
    """Refuse a transfer of ``nbytes`` at ``address`` that does not lie inside the key's region
    ``[lo, hi)``: a single request's (``item`` None) or a batch's item ``item``."""
    if address < lo or address + nbytes > hi:
        where, then = ("", "") if item is None else (f"item {item}: ", "; nothing of the batch was sent")
        raise OutOfBoundsError(f"{where}{op} of {nbytes} bytes at 0x{address:x} falls outside the key's "
                               f"region [0x{lo:x}, 0x{hi:x}){then}")


def release_all(locals_: list[_buffers.LocalBuffer]) -> None:
    for local in locals_:
        local.release()


def _pairs(items: Any) -> list | tuple:
    if isinstance(items, (list, tuple)):
        pairs = items
    else:
        try:
            it = iter(items)
        except TypeError:
            raise InvalidInputError(
                f"items must be an iterable of (buffer, remote_address) pairs, not {type(items).__name__}"
            ) from None
        pairs = list(itertools.islice(it, MAX_BATCH_ITEMS + 1))  # the iterator's own errors go on
    if len(pairs) > MAX_BATCH_ITEMS:
        raise InvalidInputError(f"a batch holds at most {MAX_BATCH_ITEMS} items; this one has more "
                                "(split it into several batches)")
    return pairs


def resolve_items(items: Any, op: str, lo: int, hi: int,
                  consumer: int | None) -> tuple[list[_buffers.LocalBuffer], list[int]]:
    """The local buffers and the remote addresses of a batch's ``(buffer, remote_address)``
    items, each checked as a single request's is (a get's buffers writable, every range inside
    the key's region ``[lo, hi)``), all of one memory type and, for CUDA memory, one device.

    Raises before anything is posted, releasing what it resolved."""
    pairs = _pairs(items)
    writable = op == "get"
    locals_: list[_buffers.LocalBuffer] = []
    remote: list[int] = []
    try:
        for i, item in enumerate(pairs):
            if not isinstance(item, tuple) or len(item) != 2:
                raise InvalidInputError(f"item {i} of the batch must be a (buffer, remote_address) pair, "
                                        f"not {type(item).__name__}")
            buffer, address = item
            if type(address) is not int or not 0 <= address < 1 << 64:
                _types.in_range(address, f"item {i}'s remote_address")  # raises
            local = _device.resolve(buffer, writable=writable, stream=consumer)
            locals_.append(local)
            check_range(op, address, local.nbytes, lo, hi, i)
            first = locals_[0]
            if local.memory_type != first.memory_type:
                raise InvalidInputError(f"item {i} is {local.memory_type} memory and item 0 {first.memory_type} "
                                        "memory: a batch's buffers are all host or all CUDA memory")
            if local.memory_type == "cuda" and _device.ordinal_of(local) != _device.ordinal_of(first):
                raise InvalidInputError(f"item {i} is on device {_device.ordinal_of(local)} and item 0 on "
                                        f"device {_device.ordinal_of(first)}: a batch's CUDA buffers are on one device")
            remote.append(address)
    except BaseException:
        release_all(locals_)
        raise
    return locals_, remote
