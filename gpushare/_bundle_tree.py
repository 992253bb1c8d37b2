"""A bundle's tree: the arrays a bundle gives back, built in the shape of
the exported dict, list or tuple (``Manifest`` nodes: a tensor's number, or
``(kind, items)``), and a caller's tree walked along it."""

from __future__ import annotations

from typing import Any

from ._errors import InvalidInputError
from ._manifest import Manifest

__all__ = ["leaf_indices", "build_list", "build", "build_from", "pair"]


def leaf_indices(node: Any) -> list[int]:
    if type(node) is int:
        return [node]
    kind, items = node
    out: list[int] = []
    for item in items:
        out.extend(leaf_indices(item[1] if kind == "d" else item))
    return out


def build_list(node: Any, arrays: list[Any], m: Manifest) -> Any:
    """:func:`build` with ``arrays`` by tensor; a node of tensors numbered
    one after another (a state dict's) made in one step."""
    if type(node) is int:
        return arrays[node]
    run = m.run_of(node)
    if run is not None:
        keys, first = run
        values = arrays[first:first + len(keys if keys is not None else node[1])]
        kind = node[0]
        return dict(zip(keys, values, strict=True)) if kind == "d" else values if kind == "l" else tuple(values)
    kind, items = node
    if kind == "d":
        return {name: arrays[sub] if type(sub) is int else build_list(sub, arrays, m) for name, sub in items}
    out = [arrays[sub] if type(sub) is int else build_list(sub, arrays, m) for sub in items]
    return out if kind == "l" else tuple(out)


def build(node: Any, leaf: Any) -> Any:
    if type(node) is int:
        return leaf(node)
    kind, items = node
    if kind == "d":
        return {name: leaf(sub) if type(sub) is int else build(sub, leaf) for name, sub in items}
    out = [leaf(sub) if type(sub) is int else build(sub, leaf) for sub in items]
    return out if kind == "l" else tuple(out)


def build_from(given: Any, leaf: Any) -> Any:
    if isinstance(given, dict):
        return {k: build_from(v, leaf) for k, v in given.items()}
    if isinstance(given, list):
        return [build_from(v, leaf) for v in given]
    if isinstance(given, tuple):
        return tuple(build_from(v, leaf) for v in given)
    return leaf(given)


def pair(node: Any, given: Any, add: Any, where: str) -> None:
    """Walk ``given`` (part of the tree's structure) along ``node``."""
    if type(node) is int:
        if isinstance(given, (dict, list, tuple)):
            raise InvalidInputError(f"bundle item {where or '[]'} is a tensor; got a {type(given).__name__}")
        add(node, given)
        return
    kind, items = node
    if kind == "d":
        if not isinstance(given, dict):
            raise InvalidInputError(f"bundle item {where or '[]'} is a dict; got a {type(given).__name__}")
        names = dict(items)
        for key, value in given.items():
            sub = names.get(key)
            if sub is None:
                raise InvalidInputError(f"the bundle has no item {where}[{key!r}]")
            if type(sub) is int and not isinstance(value, (dict, list, tuple)):
                add(sub, value)  # a tensor's buffer, the common case: no walk down
            else:
                pair(sub, value, add, f"{where}[{key!r}]")
        return
    if not isinstance(given, (list, tuple)) or len(given) != len(items):
        raise InvalidInputError(f"bundle item {where or '[]'} is a {'list' if kind == 'l' else 'tuple'} of "
                                f"{len(items)}; got {type(given).__name__} of {len(given) if hasattr(given, '__len__') else '?'}")
    for j, (sub, value) in enumerate(zip(items, given, strict=True)):
        pair(sub, value, add, f"{where}[{j}]")
