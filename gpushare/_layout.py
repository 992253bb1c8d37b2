"""gpushare.share_memory: lay a tree of tensors out in gpushare memory.

torch's ``share_memory_()`` for a whole state dict: every NumPy array and
torch CPU tensor of a dict, list or tuple (nested) is copied into one
:func:`gpushare.empty` buffer, and the same tree comes back with arrays and
tensors of the same types, dtypes and shapes over that buffer.  Exported, the
new tree is one allocation: one fd, one mapping and zero-copy for all of it,
where each tensor of an ordinary dict is an allocation of its own.
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
    """The same tree of tensors, laid out in one buffer other processes map.

    Parameters
    ----------
    tree : dict, list or tuple (nested), or one array
        NumPy arrays and torch CPU tensors (any dtype torch or NumPy has,
        contiguous or not); dict keys are kept, and so are the containers'
        types.  Other leaves (numbers, strings, None) stay as they are.

    Returns
    -------
    The same structure: each NumPy array a NumPy array, each torch tensor a
    torch tensor (``requires_grad`` kept), of the same dtype, shape and values,
    C-contiguous, over one :func:`gpushare.empty` buffer (each starting at a
    multiple of 64 bytes).  ``gs.export`` of it is one allocation: one fd and
    one mapping for every tensor, zero-copy where the importer maps host-fd.

    Raises
    ------
    UnsupportedError
        For a CUDA tensor or array (lay CUDA tensors out with
        :class:`gpushare.Arena` or :func:`gpushare.empty` on the device).
    InvalidInputError
        For a tree that holds no array, or nests deeper than 64 levels.
    """
    leaves: list[Any] = []
    _collect(tree, leaves, 0, "")
    if not leaves:
        raise InvalidInputError("share_memory needs a tree that holds at least one NumPy array or torch tensor")
    offsets, total = [], 0
    for leaf in leaves:
        offsets.append(total)
        total += -(-_nbytes(leaf) // ALIGN) * ALIGN
    buf = empty(max(total, 1), "uint8")  # one allocation: one offer when exported
    made = iter([_place(leaf, buf, at) for leaf, at in zip(leaves, offsets, strict=True)])
    return _rebuild(tree, made)  # type: ignore[no-any-return]


def _is_leaf(obj: Any) -> bool:
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


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
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            raise UnsupportedError(f"share_memory lays out host memory; the tree's item {where or '(the root)'} is "
                                   f"on {device}: lay CUDA tensors out with gpushare.Arena or gpushare.empty on "
                                   "the device")
        out.append(node)
    elif hasattr(node, "__cuda_array_interface__"):
        raise UnsupportedError(f"share_memory lays out host memory; the tree's item {where or '(the root)'} is CUDA "
                               "memory: lay it out with gpushare.Arena or gpushare.empty on its device")


def _nbytes(leaf: Any) -> int:
    if hasattr(leaf, "element_size"):  # torch
        return int(leaf.numel()) * int(leaf.element_size())
    return int(leaf.nbytes)


def _place(leaf: Any, buf: Any, at: int) -> Any:
    """A copy of ``leaf`` in ``buf`` at byte ``at``, of its own type."""
    n = _nbytes(leaf)
    raw = buf[at:at + n]
    if hasattr(leaf, "element_size"):  # torch: its own dtype (bfloat16 too), through the raw bytes
        import torch

        out = torch.from_numpy(raw).view(leaf.dtype).reshape(leaf.shape)
        with torch.no_grad():
            out.copy_(leaf)
        if leaf.requires_grad:
            out.requires_grad_(True)
        return out
    import numpy as np

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
