"""Shares are built from named fields (``Share._fields_of``, ``share._replace``),
never by a field's position: reordering the fields cannot silently break
another module."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

import gpushare as gs
from gpushare._share import Share

PACKAGE = pathlib.Path(gs.__file__).resolve().parent


@pytest.fixture
def share():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    s = gs.export(a, lifetime="revoked")
    yield s
    s.revoke()


def test_replace_changes_the_named_fields_only(share):
    part = share._replace(nbytes=16, shape=(4,), typestr="<f4", offset=8)
    assert (part.nbytes, part.shape, part.typestr, part.offset) == (16, (4,), "<f4", 8)
    for name, old, new in zip(Share._NAMES, share._fields_, part._fields_, strict=True):
        if name not in ("nbytes", "shape", "typestr", "offset"):
            assert new == old, name
    assert type(part) is Share and share.nbytes == 48  # the original is untouched


def test_replace_refuses_an_unknown_field(share):
    with pytest.raises(TypeError, match="a share has no field 'size'"):
        share._replace(size=3)


def test_fields_of_puts_named_fields_in_wire_order(share):
    named = dict(zip(Share._NAMES, share._fields_, strict=True))
    del named["version"]  # the current format, by default
    again = Share._make(*Share._fields_of(**named))
    assert again.to_bytes() == share.to_bytes()
    with pytest.raises(TypeError, match=r"missing \['token'\]"):
        Share._fields_of(**{k: v for k, v in named.items() if k != "token"})
    with pytest.raises(TypeError, match=r"unknown \['size'\]"):
        Share._fields_of(size=1, **named)


def _positional(tree: ast.AST) -> list[int]:
    """Lines that index a share's ``_fields_`` or pass ``_make`` fields by position."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "_fields_" and isinstance(node.slice, (ast.Constant, ast.Slice)):
            out.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("_make", "_make_bundle", "_trusted") \
                and isinstance(node.func.value, ast.Name) and node.func.value.id in ("Share", "BundleShare") \
                and any(not isinstance(a, ast.Starred) for a in node.args[:1]) \
                and not (node.args and isinstance(node.args[0], ast.Call)):
            out.append(node.lineno)
    return out


def test_no_module_builds_a_share_by_field_position():
    found = []
    for file in sorted(PACKAGE.rglob("*.py")):
        if file.name == "_share.py":
            continue  # the class itself
        found += [f"{file.relative_to(PACKAGE)}:{line}" for line in _positional(ast.parse(file.read_text()))]
    assert not found, "name the fields (Share._fields_of, share._replace): " + ", ".join(found)


def test_the_check_sees_positional_construction():
    assert _positional(ast.parse("s = Share._trusted(f[:6] + (1,))\nt = x._fields_[3]\n")) == [1, 2]
    assert _positional(ast.parse("s = Share._make(*Share._fields_of(nbytes=1))\nu = s._replace(nbytes=2)\n"
                                 "v = self._fields_[self._NAMES.index(name)]\n")) == []
