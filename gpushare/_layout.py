"""gpushare.share_memory: lay a tree of tensors out in gpushare memory.

torch's ``share_memory_()`` for a whole state dict: every NumPy array and
torch CPU tensor of a dict, list or tuple (nested) is copied into one
:func:`gpushare.empty` buffer, and every torch CUDA tensor and CuPy array
into one :func:`gpushare.empty` buffer on its device; the same tree comes
back with arrays and tensors of the same types, dtypes and shapes over those
buffers.  Exported, the new tree is one allocation per device: one fd (or
handle), one mapping and zero-copy for all of it, where each tensor of an
ordinary dict is an allocation of its own.
"""

from __future__ import annotations

import sys
from typing import Any, TypeVar

from ._arrays import empty
from ._errors import InvalidInputError, UnsupportedError

__all__ = ["share_memory"]

#: Where each tensor starts in the buffer: as torch's and NumPy's allocators align.
ALIGN = 64

_T = TypeVar("_T")


def share_memory(tree: _T) -> _T:
    """The same tree of tensors, laid out in memory other processes map.

    Parameters
    ----------
    tree : dict, list or tuple (nested), or one array
        NumPy arrays, torch tensors (CPU and CUDA; any dtype torch or NumPy
        has, contiguous or not) and CuPy arrays; dict keys are kept, and so
        are the containers' types.  Other leaves (numbers, strings, None)
        stay as they are.

    Returns
    -------
    The same structure: each NumPy array a NumPy array, each torch tensor a
    torch tensor on its device (``requires_grad`` kept), each CuPy array a
    CuPy array, of the same dtype, shape and values, C-contiguous, over one
    :func:`gpushare.empty` buffer per device, host memory included (each
    starting at a multiple of 64 bytes).  ``gs.export`` of it is one
    allocation per device: one fd or handle and one mapping for every
    tensor, zero-copy where the importer maps memory (host-fd, posix-fd,
    fabric).  CUDA copies are queued on torch's or CuPy's current stream,
    as ``tensor.clone()`` would be.

    Raises
    ------
    UnsupportedError
        For other CUDA memory (a ``gs.CudaArray`` is laid out already; lay a
        cuda.core ``Buffer`` out with :func:`gpushare.empty` on its device).
    InvalidInputError
        For a tree that holds no array, or nests deeper than 64 levels.
    """
    leaves: list[Any] = []
    _collect(tree, leaves, 0, "")
    if not leaves:
        raise InvalidInputError("share_memory needs a tree that holds at least one NumPy array, torch tensor or "
                                "CuPy array")
    # One buffer per device (host memory is "host"), each leaf at its offset in its device's buffer.
    places, totals = [], {}
    for leaf in leaves:
        where = _device_of(leaf)
        places.append((where, totals.get(where, 0)))
        totals[where] = totals.get(where, 0) + -(-_nbytes(leaf) // ALIGN) * ALIGN
    bufs = {where: _Whole(empty(max(total, 1), "uint8", device=where), where == "host")  # one offer each, exported
            for where, total in totals.items()}
    made = iter([_place(leaf, bufs[where], at) for leaf, (where, at) in zip(leaves, places, strict=True)])
    return _rebuild(tree, made)  # type: ignore[no-any-return]


def _is_leaf(obj: Any) -> bool:
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return True
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(obj, cupy.ndarray)


def _device_of(leaf: Any) -> Any:
    """"host", or the CUDA device ordinal of a leaf."""
    device = getattr(leaf, "device", None)
    if hasattr(leaf, "element_size"):  # torch
        return "host" if device.type == "cpu" else int(device.index)
    if hasattr(leaf, "__cuda_array_interface__"):  # CuPy
        return int(device.id)
    return "host"


def _collect(node: Any, out: list[Any], depth: int, where: str) -> None:
    if depth > 64:
        raise InvalidInputError("share_memory: the tree nests deeper than 64 levels (or holds itself)")
    if isinstance(node, dict):
        for k, v in node.items():
            _collect(v, out, depth + 1, f"{where}[{k!r}]")
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _collect(v, out, depth + 1, f"{where}[{i}]")
    elif _is_leaf(node):
        device = getattr(node, "device", None)
        if hasattr(node, "element_size") and device.type not in ("cpu", "cuda"):
            raise UnsupportedError(f"share_memory lays out host and CUDA memory; the tree's item "
                                   f"{where or '(the root)'} is on {device}")
        out.append(node)
    elif hasattr(node, "__cuda_array_interface__"):
        raise UnsupportedError(f"share_memory lays out NumPy arrays, torch tensors and CuPy arrays; the tree's item "
                               f"{where or '(the root)'} is other CUDA memory ({type(node).__name__}): lay it out "
                               "with gpushare.empty on its device")


def _nbytes(leaf: Any) -> int:
    if hasattr(leaf, "element_size"):  # torch
        return int(leaf.numel()) * int(leaf.element_size())
    return int(leaf.nbytes)


class _Whole:
    """One buffer of :func:`share_memory` and, made once, its bytes as torch
    or CuPy sees them (the views of every leaf are slices of those)."""

    __slots__ = ("buf", "host", "seen")

    def __init__(self, buf: Any, host: bool) -> None:
        self.buf = buf
        self.host = host  # a NumPy array of host memory; else a gs.CudaArray
        self.seen: dict[str, Any] = {}

    def as_(self, library: str) -> Any:
        got = self.seen.get(library)
        if got is None:
            mod = sys.modules[library]
            got = mod.from_numpy(self.buf) if self.host else mod.from_dlpack(self.buf)
            self.seen[library] = got
        return got


def _place(leaf: Any, whole: _Whole, at: int) -> Any:
    """A copy of ``leaf`` in ``whole``'s buffer at byte ``at``, of its own type."""
    n = _nbytes(leaf)
    if hasattr(leaf, "element_size"):  # torch: its own dtype (bfloat16 too), through the raw bytes
        import torch

        out = whole.as_("torch")[at:at + n].view(leaf.dtype).reshape(leaf.shape)
        with torch.no_grad():
            out.copy_(leaf)
        if leaf.requires_grad:
            out.requires_grad_(True)
        return out
    if hasattr(leaf, "__cuda_array_interface__"):  # CuPy, on its current stream
        out = whole.as_("cupy")[at:at + n].view(leaf.dtype).reshape(leaf.shape)
        out[...] = leaf
        return out
    import numpy as np

    raw = whole.buf[at:at + n]
    out = raw.view(leaf.dtype).reshape(leaf.shape) if n else np.empty(leaf.shape, leaf.dtype)
    np.copyto(out, leaf, casting="no")
    return out


def _rebuild(node: Any, made: Any) -> Any:
    if isinstance(node, dict):
        return type(node)((k, _rebuild(v, made)) for k, v in node.items())
    if isinstance(node, (list, tuple)):
        items = [_rebuild(v, made) for v in node]
        if type(node) in (list, tuple):
            return type(node)(items)
        if hasattr(node, "_fields"):  # a named tuple
            return type(node)(*items)
        return type(node)(items)
    if _is_leaf(node):
        return next(made)
    return node
