"""The path interface is closed: a path is one module of ``gpushare/_paths/``
plus one entry in ``PATHS``, and nothing outside that package names one.

* No module outside ``gpushare/_paths/`` refers to one particular path or
  handle type: no string naming one (docstrings aside), no import of a path's
  module, no ``_paths.<path module>`` attribute.  Below the paths (the
  engines and the wire, which cannot import them) a name may appear only in
  a named table (a module-level constant such as ``HANDLE_TYPES``) or as a
  descriptor's ``handle_type`` tag.  The check reads the source with
  :mod:`ast`, so a docstring or a comment does not trip it.
* A dummy path, defined here and added to ``PATHS``, shows up in
  ``gpushare doctor``, in ``candidates()`` and in ``view.why``'s text.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import typing

import pytest

import gpushare as gs
from gpushare import _doctor, _paths, _types
from gpushare._paths.base import ALLOCATED_HOST, Grant, Here, Memory, Offer, Opened, Options, Path

PACKAGE = pathlib.Path(gs.__file__).resolve().parent

#: Modules below the paths layer (L0-L2: they cannot import ``_paths``), where
#: the spellings live in named tables.
BELOW = ("_version", "_errors", "_types", "_process", "_memory", "_descriptors", "_manifest", "_torch_alloc",
         "_share", "_buffers", "_dlpack", "_auth", "_control", "_launch", "_reopen", "_service", "_cuda/", "_ucx/")
#: Words that equal a spelling but name something else, by module: UCX's own
#: transports ("cma", "cuda_ipc") in the UCX engine; the share's field
#: ``fabric`` (the exporter's NVLink clique) and the same key of
#: :func:`gpushare.capabilities`' report.
OTHER_MEANINGS = {"_ucx/": {"cma", "cuda_ipc"}, "_share": {"fabric"}, "_capabilities": {"fabric"}}


def _names() -> set[str]:
    """Every spelling of a path or handle type."""
    return ({p.name for p in _paths.PATHS} | set(_types.HANDLE_TYPES) | set(_types.OLD_HANDLE_TYPES)
            | set(_types.OLD_HANDLE_TYPES.values()))


def _path_modules() -> set[str]:
    """The short names of the paths' modules (``cma``, ``host_fd``...)."""
    return {type(p).__module__.rsplit(".", 1)[1] for p in _paths.PATHS}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants in ``tree``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                out.add(id(body[0].value))
    return out


def _tabled(tree: ast.Module) -> set[int]:
    """ids of the constants in named tables: module-level assignments to a
    capitalised name, and classes' ``handle_type`` tags."""
    out: set[int] = set()

    def targets(node: ast.stmt) -> list[ast.expr]:
        if isinstance(node, ast.Assign):
            return node.targets
        if isinstance(node, ast.AnnAssign):
            return [node.target]
        return []

    def names(target: ast.expr) -> list[str]:
        if isinstance(target, ast.Name):
            return [target.id]
        if isinstance(target, ast.Tuple):
            return [n for t in target.elts for n in names(t)]
        return []

    for node in tree.body:
        if any(re.match(r"_?[A-Z]", n) for t in targets(node) for n in names(t)):
            out.update(id(c) for c in ast.walk(node))
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if any(n == "handle_type" or re.match(r"_?[A-Z]", n) for t in targets(item) for n in names(t)):
                    out.update(id(c) for c in ast.walk(item))
    return out


def violations(source: str, module: str, names: set[str], modules: set[str]) -> list[str]:
    """Where ``source`` (module ``module``, relative to the package, e.g.
    ``_exporter`` or ``_ucx/_server``) names a path or handle type."""
    tree = ast.parse(source)
    below = any(module == b or (b.endswith("/") and module.startswith(b)) for b in BELOW)
    skip = _docstrings(tree) | (_tabled(tree) if below else set())
    allowed = set().union(*(words for m, words in OTHER_MEANINGS.items()
                            if module == m or (m.endswith("/") and module.startswith(m))))
    found = []
    for node in ast.walk(tree):
        where = f"{module}.py:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names \
                and id(node) not in skip and node.value not in allowed:
            found.append(f"{where}: names {node.value!r}")
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            mod = node.module.split(".")
            if "_paths" in mod:
                after = mod[mod.index("_paths") + 1:]
                if after and after[0] in modules:
                    found.append(f"{where}: imports from the path module {after[0]}")
                elif not after:
                    found += [f"{where}: imports the path module {a.name}" for a in node.names if a.name in modules]
        elif isinstance(node, ast.Import):
            for a in node.names:
                mod = a.name.split(".")
                if "_paths" in mod and mod[mod.index("_paths") + 1:mod.index("_paths") + 2] \
                        and mod[mod.index("_paths") + 1] in modules:
                    found.append(f"{where}: imports {a.name}")
        elif isinstance(node, ast.Attribute) and node.attr in modules and isinstance(node.value, ast.Name) \
                and node.value.id in ("_paths", "_paths_mod", "paths"):
            found.append(f"{where}: reaches the path module {node.attr} past the registry")
    return found


def test_no_module_outside_the_paths_names_a_path_or_handle_type():
    names, modules = _names(), _path_modules()
    found = []
    for file in sorted(PACKAGE.rglob("*.py")):
        module = file.relative_to(PACKAGE).with_suffix("").as_posix()
        if module.startswith("_paths/"):
            continue
        found += violations(file.read_text(), module, names, modules)
    assert not found, "outside gpushare/_paths/, ask a path's traits instead:\n" + "\n".join(found)


@pytest.mark.parametrize(("source", "module", "expected"), [
    ('"""Docs may say host-fd."""\nx = 1\n', "_open", []),
    ('if name == "ucx-rma":\n    pass\n', "_open", ["_open.py:1: names 'ucx-rma'"]),
    ('from ._paths import cma\n', "_exporter", ["_exporter.py:1: imports the path module cma"]),
    ('from ._paths.host_fd import HostBuffer\n', "_by_descriptor", ["_by_descriptor.py:1: imports from the path module host_fd"]),
    ('x = _paths.fabric.PATH\n', "_export", ["_export.py:1: reaches the path module fabric past the registry"]),
    ('from ._paths import Opened, by_name\n', "_bundle", []),
    ('FABRIC = "fabric"\n', "_cuda/vmm", []),
    ('FABRIC = "fabric"\n', "_doctor", ["_doctor.py:1: names 'fabric'"]),
    ('if t == "fabric":\n    pass\n', "_cuda/vmm", ["_cuda/vmm.py:1: names 'fabric'"]),
    ('class D:\n    handle_type = "posix-fd"\n', "_descriptors", []),
    ('T = ("tcp", "cma")\nok = tl == "cma"\n', "_ucx/_local", []),
    ('ok = tl == "cma"\n', "_open_plan", ["_open_plan.py:1: names 'cma'"]),
    ('class S:\n    _BASE = ("offers", "fabric")\n', "_share", []),
])
def test_the_check_sees_what_it_should_and_no_more(source, module, expected):
    assert violations(source, module, _names(), _path_modules()) == expected


def test_the_names_a_share_carries_are_the_paths_in_order():
    # a share carries path names, and a bundle's manifest one bit per name
    # in this order: they come from PATHS, and follow it when it changes
    assert _types.path_names() == tuple(p.name for p in _paths.PATHS)
    assert typing.get_args(_types.PathName) == _types.path_names()  # what type checkers are told


def test_each_path_is_a_path():
    for p in _paths.PATHS:
        assert Path in type(p).__mro__, p  # it subclasses the protocol (mypy checks its members)
        assert p.serves, f"{p.name} serves no kind of memory"


# ------------------------------------------------------------------ a dummy path


class Dummy(Path):
    """A path in one class: offered for gpushare.allocate host memory, taken
    by any process on the exporter's node."""

    name = "dummy"
    rank = 7
    reason = "a dummy path added by a test"
    mapped = False
    holds_memory = False
    reopens = False
    maps_strided = False
    serves = frozenset({ALLOCATED_HOST})

    def offer(self, memory: Memory) -> Offer | None:
        return Offer() if memory.memory_type == "host" and not memory.strided else None

    def serve(self, export, session) -> Grant | None:
        raise AssertionError("not served in this test")

    def grant_fds(self, export) -> int:
        return 0

    def not_offered(self, share) -> str | None:
        return None

    def unavailable(self, share, here: Here) -> str | None:
        return None if share.node == here.node else "the dummy needs the exporter's node"

    def open(self, share, grant: dict, fds: list[int], lease, how: Options) -> Opened:
        raise AssertionError("not opened in this test")


@pytest.fixture
def dummy(monkeypatch):
    path = Dummy()
    monkeypatch.setattr(_paths, "PATHS", (path, *_paths.PATHS))  # all it takes
    assert _types.path_names()[0] == "dummy"
    return path


def test_a_dummy_path_is_offered_chosen_and_explained(dummy):
    buf = gs.allocate(4096)
    share = gs.export(buf, lifetime="revoked")
    try:
        assert share.offers[0] == "dummy"  # offered at export
        node = share.node
        order, left_out, natural = _paths.candidates(share, Here(node, os.getpid() + 1), [], [])
        assert order[0] == "dummy" and natural[0] == "dummy"
        assert _paths.explain(order[0], left_out, []).startswith("dummy: a dummy path added by a test")
        order, left_out, _ = _paths.candidates(share, Here("another-node", 1), [], [])
        assert "dummy" not in order
        assert "not dummy: the dummy needs the exporter's node" in _paths.explain(order[0], left_out, [])
    finally:
        share.revoke()
        buf.close()


def test_a_dummy_path_appears_in_gpushare_doctor(dummy, monkeypatch):
    monkeypatch.setattr(_doctor, "live_check", lambda: {"dummy": "works"})
    monkeypatch.setattr(_doctor, "ucx_transports", lambda: {"transports": [], "reason": "not asked"})
    monkeypatch.setattr(_doctor, "ucx_library", lambda: {"loaded": False, "reason": "not asked"})
    lines: list[str] = []
    assert _doctor.run_doctor(out=lines.append) == 0
    text = "\n".join(lines)
    assert "host memory from gpushare.allocate, peer on same node: dummy" in text, text
    assert "not dummy: the dummy needs the exporter's node" in text, text
    # memory the dummy does not serve goes as before
    assert "other host memory (a NumPy array), peer on same node: cma" in text, text
