"""The layers of gpushare and its import rule, checked from the source.

A module may import modules of its own layer (without a cycle) or of lower
layers, never of a higher one.  Imports under ``if TYPE_CHECKING:`` are exempt.
Everything here reads the files with :mod:`ast`; no module of gpushare is
imported, so a cycle or a broken import cannot hide itself.

docs/design.md ("Layers") has the same table in prose (a test checks that the two agree).  A new module must be
added to :data:`LAYERS`; the test says so when it finds one that is not there.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import textwrap
from collections.abc import Callable, Iterable, Mapping

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "gpushare"

#: Layer of each module, lowest first.  A name ending in "/" is a subpackage:
#: every module in it has that layer.  Modules of the same layer may import
#: each other (without a cycle).
LAYERS: dict[str, int] = {
    # L0 base: stdlib only
    "_version": 0, "_errors": 0, "_types": 0, "_process": 0, "_memory": 0, "_ranges": 0,
    # L1 data and wire
    "_descriptors": 1, "_manifest": 1, "_torch_alloc": 1, "_share": 1, "_buffers": 1, "_dlpack": 1, "_auth": 1, "_control": 1, "_launch": 1, "_reopen": 1,
    "_progress": 1,
    # L2 engines
    "_connection": 2, "_service": 2, "_cuda/": 2, "_ucx/": 2,
    # L3 paths
    "_paths/": 3,
    # L4 endpoints
    "_exporter/": 4, "_hello": 4, "_importer": 4, "_by_descriptor": 4, "_arrays": 4, "_arena": 4,
    # L5 sharing API
    "_view_use": 5, "_view": 5, "_offering": 5, "_export_tree": 5, "_export": 5, "_open_plan": 5, "_opening": 5, "_open": 5,
    "_batch": 5, "_bundle_tree": 5, "_bundle": 5, "_layout": 5,
    # L6 built on the API
    "_channel/": 6, "_capabilities": 6, "_doctor": 6, "_demo": 6, "_pickling": 6,
    # L7 surface: may import everything
    "__init__": 7, "ucx": 7, "ray": 7, "multiprocessing": 7, "__main__": 7,
}

#: Imports that go up a layer today, as (importer, imported).  The list may
#: only shrink: a new upward import fails the test, and so does an entry here
#: that no longer happens (remove it then).
KNOWN_UPWARD: frozenset[tuple[str, str]] = frozenset()

#: Import cycles today, each as the sorted modules of one strongly connected
#: component.  Same rule: it may only shrink.
KNOWN_CYCLES: frozenset[tuple[str, ...]] = frozenset()

#: The most function-level imports of gpushare's own modules.  Own modules
#: need no lazy import (none touches the GPU, starts a thread or loads UCX at
#: import); one that must stay says why in a ``# lazy: ...`` comment on its
#: line or the line above (:data:`LAZY_REASON`).  The number may only go down.
MAX_FUNCTION_LEVEL = 0

#: The comment a function-level import of an own module carries: ``# lazy:``
#: and its reason (it loads the native module or UCX, the CUDA bindings, or
#: breaks a cycle that cannot be broken otherwise).
LAZY_REASON = "# lazy:"


@dataclasses.dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted ("gpushare._share")
    target: str  # imported module of the package, dotted
    path: str  # file of the importing module, relative to the package's parent
    line: int
    in_function: bool

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def module_names(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted name of every module in the package at ``root``."""
    out = {}
    for file in sorted(root.rglob("*.py")):
        parts = list(file.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = file
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, in_function: bool) -> Iterable[tuple[ast.AST, bool]]:
    """Every import statement under ``node`` and whether it runs in a function;
    ``if TYPE_CHECKING:`` bodies are skipped (their ``else`` is not)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), in_function)
        else:
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from _walk(child, inner)


#: Compiled modules of the package: not Python source, and they import nothing of it.
NATIVE = frozenset({"gpushare._ucx._native"})


def imports(root: pathlib.Path, native: Iterable[str] = NATIVE) -> list[Import]:
    """Every import of one of the package's own modules by another, from the source
    (one per statement and imported module)."""
    modules = module_names(root)
    package = root.name
    skip = frozenset(native)
    out: dict[tuple[str, str, int], Import] = {}
    for name, file in modules.items():
        is_package = file.name == "__init__.py"
        rel = str(file.relative_to(root.parent))
        tree = ast.parse(file.read_text(), filename=str(file))
        for node, in_function in _walk(tree, False):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                assert isinstance(node, ast.ImportFrom)
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                # ``from X import y`` imports the module X.y when there is one, else X
                for alias in node.names:
                    sub = f"{stem}.{alias.name}"
                    targets.append(sub if sub in modules or sub in skip else stem)
            for target in targets:
                if target in skip or not (target == package or target.startswith(package + ".")):
                    continue
                # ``import a.b.c`` of a module that does not exist: its nearest existing parent
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target != name:
                    out.setdefault((name, target, node.lineno), Import(name, target, rel, node.lineno, in_function))
    return list(out.values())


def _parents(module: str, of: str) -> list[str]:
    """The packages whose ``__init__`` importing ``module`` runs first, seen from
    module ``of`` (those that contain ``of`` are already being imported)."""
    parts = module.split(".")
    return [p for p in (".".join(parts[:n]) for n in range(2, len(parts)))
            if not (of == p or of.startswith(p + "."))]


def layer_of(module: str, layers: Mapping[str, int]) -> int | None:
    """The layer of a dotted module name (``None``: not in the table)."""
    parts = module.split(".")[1:]  # without the package
    if not parts:
        return layers.get("__init__")
    if len(parts) > 1 or f"{parts[0]}/" in layers:
        return layers.get(f"{parts[0]}/")
    return layers.get(parts[0])


def cycles(edges: Iterable[tuple[str, str]]) -> list[tuple[str, ...]]:
    """The strongly connected components with more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


@dataclasses.dataclass
class Report:
    unknown: list[str]  # modules with no layer
    upward: list[Import]  # imports of a higher layer
    cycles: list[tuple[str, ...]]
    function_level: list[Import]

    def upward_pairs(self) -> set[tuple[str, str]]:
        return {(i.source, i.target) for i in self.upward}


def check(root: pathlib.Path, layers: Mapping[str, int], native: Iterable[str] = NATIVE) -> Report:
    found = imports(root, native)
    unknown = sorted(m for m in module_names(root) if layer_of(m, layers) is None)
    upward = []
    for imp in found:
        src, dst = layer_of(imp.source, layers), layer_of(imp.target, layers)
        if src is not None and dst is not None and dst > src:
            upward.append(imp)
    return Report(
        unknown=unknown,
        upward=upward,
        # importing pkg._sub.mod runs pkg._sub's __init__ first: that is an edge too
        cycles=cycles([(i.source, i.target) for i in found]
                      + [(i.source, p) for i in found for p in _parents(i.target, i.source)]),
        function_level=[i for i in found if i.in_function],
    )


def without_reason(imps: Iterable[Import], root: pathlib.Path) -> list[Import]:
    """The function-level imports in ``imps`` with no :data:`LAZY_REASON`
    comment, followed by a reason, on their line or the line above."""
    out = []
    for imp in imps:
        if not imp.in_function:
            continue
        lines = (root.parent / imp.path).read_text().splitlines()
        near = [lines[imp.line - 1]] + ([lines[imp.line - 2]] if imp.line > 1 else [])
        if not any(LAZY_REASON in line and line.split(LAZY_REASON, 1)[1].strip() for line in near):
            out.append(imp)
    return out


def _describe(imps: Iterable[Import], layers: Mapping[str, int]) -> str:
    return "\n".join(
        f"  {i.where()}: {i.source} (L{layer_of(i.source, layers)}) imports {i.target} "
        f"(L{layer_of(i.target, layers)}){' in a function' if i.in_function else ''}"
        for i in sorted(imps, key=lambda i: (i.path, i.line))
    )


# ---------------------------------------------------------------- gpushare's own tree


@pytest.fixture(scope="module")
def report() -> Report:
    return check(PACKAGE, LAYERS)


def test_every_module_has_a_layer(report):
    assert not report.unknown, (
        "modules not in the layer table: " + ", ".join(report.unknown)
        + "; add each to LAYERS in tests/test_layers.py (and to the table in docs/design.md)"
    )


def test_no_import_goes_up_a_layer(report):
    new = [i for i in report.upward if (i.source, i.target) not in KNOWN_UPWARD]
    assert not new, "imports of a higher layer (import from a lower layer, or move the code):\n" + _describe(
        new, LAYERS
    )
    gone = KNOWN_UPWARD - report.upward_pairs()
    assert not gone, f"no longer imported upwards, remove from KNOWN_UPWARD: {sorted(gone)}"


def test_no_import_cycle(report):
    new = [c for c in report.cycles if c not in KNOWN_CYCLES]
    assert not new, "import cycles (top-level and function-level imports both count):\n" + "\n".join(
        "  " + " -> ".join(c) for c in new
    )
    gone = KNOWN_CYCLES - set(report.cycles)
    assert not gone, f"cycles that are gone, remove from KNOWN_CYCLES: {sorted(gone)}"


def test_function_level_imports_of_own_modules_only_decrease(report):
    count = len(report.function_level)
    assert count <= MAX_FUNCTION_LEVEL, (
        f"{count} function-level imports of gpushare's own modules (at most {MAX_FUNCTION_LEVEL}); "
        "import own modules at the top of the file:\n" + _describe(report.function_level, LAYERS)
    )


def test_each_function_level_import_of_an_own_module_says_why(report):
    missing = without_reason(report.function_level, PACKAGE)
    assert not missing, (
        f"function-level imports of gpushare's own modules without a '{LAZY_REASON} <reason>' comment on "
        "their line or the line above (import at the top of the file, or say why not):\n"
        + _describe(missing, LAYERS)
    )


# ---------------------------------------------------------------- the checker itself


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


TABLE = {"_base": 0, "_low": 1, "_high": 2, "_sub/": 1, "__init__": 3}


def test_checker_reports_an_upward_import_and_a_cycle(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "from . import _high\n",
        "_base.py": "import os\n",
        # upward, in a function: L1 imports L2; and a cycle _low -> _high -> _low
        "_low.py": "from . import _base\n\ndef f():\n    from ._high import g\n    return g\n",
        "_high.py": "from ._low import f\n\ndef g():\n    return f\n",
        "_sub/__init__.py": "",
        # upward at the top, absolute spelling
        "_sub/mod.py": "import pkg._high\nfrom .._base import x\n",
    })
    report = check(root, TABLE)
    assert report.unknown == []
    assert report.upward_pairs() == {("pkg._low", "pkg._high"), ("pkg._sub.mod", "pkg._high")}
    assert report.cycles == [("pkg._high", "pkg._low")]
    assert [(i.source, i.target, i.line) for i in report.function_level] == [("pkg._low", "pkg._high", 4)]


def test_checker_exempts_type_checking_and_names_unknown_modules(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "_base.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._high import g\n"
            "else:\n    from ._low import f\n"
        ),
        "_low.py": "import typing\nif typing.TYPE_CHECKING:\n    from . import _high\n",
        "_high.py": "",
        "_new.py": "",
    })
    report = check(root, TABLE)
    assert report.unknown == ["pkg._new"]
    # only the else branch counts: _base (L0) imports _low (L1)
    assert report.upward_pairs() == {("pkg._base", "pkg._low")}
    assert report.cycles == []


def test_checker_resolves_package_relative_imports(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "_base.py": "",
        "_high.py": "",
        "_sub/__init__.py": "from . import a\nfrom .b import h\nfrom .. import _high\n",
        "_sub/a.py": "from . import b\n",
        "_sub/b.py": "from pkg._sub import a\n",
    })
    report = check(root, TABLE)
    assert report.upward_pairs() == {("pkg._sub", "pkg._high")}
    assert report.cycles == [("pkg._sub.a", "pkg._sub.b")]


def test_checker_counts_a_subpackage_init_that_a_submodule_import_runs(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "_base.py": "",
        "_low.py": "",
        "_high.py": "from ._sub import mod\n",
        # importing pkg._sub.mod from _high runs _sub/__init__, which imports _high back
        "_sub/__init__.py": "def f():\n    from .. import _high\n",
        "_sub/mod.py": "from . import helper\n",
        "_sub/helper.py": "from ._native import call\n",
    })
    report = check(root, {**TABLE, "_sub/": 2}, native={"pkg._sub._native"})
    assert report.cycles == [("pkg._high", "pkg._sub")]
    assert [(i.source, i.target) for i in report.function_level] == [("pkg._sub", "pkg._high")]


def test_checker_finds_function_level_imports_without_a_reason(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "_base.py": "",
        "_low.py": (
            "def a():\n    from . import _base\n\n"  # no reason
            "def b():\n    # lazy: loads the native module\n    from . import _base\n\n"
            "def c():\n    from . import _base  # lazy: cuda bindings\n\n"
            "def d():\n    from . import _base  # lazy:\n\n"  # a bare marker is no reason
            "def e():\n    from . import _base  # noqa\n"
        ),
        "_high.py": "",
    })
    report = check(root, TABLE)
    assert [i.line for i in report.function_level] == [2, 6, 9, 12, 15]
    assert [i.line for i in without_reason(report.function_level, root)] == [2, 12, 15]


#: Most lines in one Python file of the package: a file that outgrows it is
#: split by role (moving whole coherent pieces), not squeezed.
MAX_LINES = 700

#: Files over :data:`MAX_LINES` today, with their length: the list may only
#: shrink, and a listed file may only get shorter.
KNOWN_LONG: dict[str, int] = {}


def long_files(root: pathlib.Path, limit: int, patterns: tuple[str, ...] = ("*.py",)) -> dict[str, int]:
    """Files under ``root`` longer than ``limit`` lines, by path relative to it."""
    out = {}
    for file in sorted(f for pattern in patterns for f in root.rglob(pattern)):
        n = len(file.read_text().splitlines())
        if n > limit:
            out[file.relative_to(root).as_posix()] = n
    return out


def test_no_python_file_is_over_700_lines():
    found = long_files(PACKAGE, MAX_LINES)
    new = {f: n for f, n in found.items() if f not in KNOWN_LONG or n > KNOWN_LONG[f]}
    assert not new, f"over {MAX_LINES} lines (split by role): {new}"
    gone = {f for f in KNOWN_LONG if f not in found or found[f] < KNOWN_LONG[f]}
    assert not gone, f"shorter now: lower or remove their KNOWN_LONG entries: {sorted(gone)}"


def test_no_native_file_is_over_700_lines():
    src = PACKAGE.parent / "src"
    found = long_files(src, MAX_LINES, ("*.cpp", "*.hpp", "*.c", "*.h"))
    assert not found, f"over {MAX_LINES} lines (split by role): {found}"
    assert long_files(src, 100, ("*.cpp",)), "no C++ file found: the check looks in the wrong place"


def test_long_files_counts_lines(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n" * 3)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("x = 1\n" * 5)
    assert long_files(tmp_path, 3) == {"sub/b.py": 5}


DESIGN = PACKAGE.parent / "docs" / "design.md"


def design_layers(text: str) -> dict[str, int]:
    """The layer of each module in docs/design.md's table (rows ``| L<n> ... | `mod`, ... |``)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        row = re.match(r"\| L(\d) [^|]*\| ([^|]*)\|", line)
        if row:
            for name in re.findall(r"`([^`]+)`", row.group(2)):
                out[name] = int(row.group(1))
    return out


def test_the_design_table_is_this_table():
    assert design_layers(DESIGN.read_text()) == LAYERS, "docs/design.md's layer table and LAYERS disagree"


def test_design_layers_reads_the_table():
    text = "| layer | modules |\n| --- | --- |\n| L0 base | `_a`, `_b/` | stdlib |\n| L3 paths | `_c` | L0 |\n"
    assert design_layers(text) == {"_a": 0, "_b/": 0, "_c": 3}


# ---------------------------------------------------------------- names imported from where they are defined

#: Modules whose job is to re-export: the public surface (``gpushare`` and
#: the public modules beside it).  Importing from them is what users do.
SURFACE = frozenset({"gpushare", "gpushare.ucx", "gpushare.ray", "gpushare.multiprocessing"})

#: Re-exports that must stay, as ``(module, name)``, each with the reason.
KEEP_REEXPORTS: dict[tuple[str, str], str] = {
    ("gpushare._channel", "_rebuild_handle"): "pickles of a ChannelHandle name it there (its __module__)",
    # nothing above gpushare/_paths/ may import a path module (tests/test_paths_closed.py)
    ("gpushare._paths.handles", "HostBuffer"): "host-fd's buffer, for the modules above the paths",
    ("gpushare._paths.handles", "allocate_host"): "host-fd's allocator, for the modules above the paths",
}

#: Where the checker looks for importers besides the package itself.
IMPORTER_DIRS = ("tests", "benchmarks", "tools", "examples", "docs")


def _module_level(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """The statements that run at a module's top level (into ``if``/``try``/``with``, not functions)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody"):
                yield from _module_level(getattr(stmt, field, []))
            for handler in getattr(stmt, "handlers", []):
                yield from _module_level(handler.body)


def _bound_names(target: ast.expr) -> Iterable[str]:
    for node in ast.walk(target):
        if isinstance(node, ast.Name):
            yield node.id


def reexports(root: pathlib.Path) -> dict[str, set[str]]:
    """For each module of the package, the names it binds only by ``from X import
    name`` (not a module of the package, not defined in it by ``def``, ``class`` or
    an assignment)."""
    modules = module_names(root)
    out: dict[str, set[str]] = {}
    for name, file in modules.items():
        imported: set[str] = set()
        defined: set[str] = set()
        for stmt in _module_level(ast.parse(file.read_text(), filename=str(file)).body):
            if isinstance(stmt, ast.ImportFrom) and stmt.module != "__future__":
                stem = _resolve_from(stmt, name, file.name == "__init__.py")
                # ``from . import sub`` binds a module: not a name taken from one
                imported.update(alias.asname or alias.name for alias in stmt.names
                                if alias.name != "*" and f"{stem}.{alias.name}" not in modules)
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(stmt.name)
            elif isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    defined.update(_bound_names(target))
            elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) and stmt.value is not None:
                defined.update(_bound_names(stmt.target))
        out[name] = imported - defined
    return out


@dataclasses.dataclass(frozen=True)
class Use:
    where: str  # file:line
    module: str  # the module the name was taken from
    name: str

    def __str__(self) -> str:
        return f"  {self.where}: {self.name} from {self.module}"


def _resolve_from(node: ast.ImportFrom, this: str | None, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    assert this is not None, "a relative import outside the package"
    base = this.split(".") if is_package else this.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _code_in_strings(tree: ast.AST, package: str) -> Iterable[tuple[ast.Module, int]]:
    """Python programs written as string constants (a child's ``python -c``), each
    parsed, with the line its string starts on."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and package in node.value:
            try:
                yield ast.parse(textwrap.dedent(node.value)), node.lineno
            except SyntaxError:
                continue


def uses_of_reexports(root: pathlib.Path, files: Iterable[pathlib.Path]) -> list[Use]:
    """Every place in ``files`` (the package's and others) that takes a name from a
    module of the package that only re-exports it: ``from M import name``, or
    ``M.name`` where ``M`` is a module imported by ``import`` or ``from``; in the
    code and in programs written as strings (for a child process)."""
    modules = module_names(root)
    by_file = {file: name for name, file in modules.items()}
    again = reexports(root)
    out: list[Use] = []
    for file in files:
        this = by_file.get(file)
        is_package = file.name == "__init__.py"
        try:
            rel = str(file.relative_to(root.parent))
        except ValueError:
            rel = str(file)
        tree = ast.parse(file.read_text(), filename=str(file))
        for code, first in [(tree, 1), *_code_in_strings(tree, root.name)]:
            out += _uses_in(code, this if code is tree else None, is_package, modules, again,
                            lambda line, first=first: f"{rel}:{first + line - 1}")
    return sorted(set(out), key=lambda u: (u.where, u.name))


def _uses_in(tree: ast.AST, this: str | None, is_package: bool, modules: Mapping[str, pathlib.Path],
             again: Mapping[str, set[str]], where: Callable[[int], str]) -> list[Use]:
    out = []
    aliases: dict[str, str] = {}  # a local name bound to a module of the package
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            stem = _resolve_from(node, this, is_package)
            for alias in node.names:
                sub = f"{stem}.{alias.name}"
                if sub in modules:
                    aliases[alias.asname or alias.name] = sub
                elif stem in again and alias.name in again[stem]:
                    out.append(Use(where(node.lineno), stem, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in modules:
                    aliases[alias.asname] = alias.name
                elif not alias.asname:
                    top = alias.name.split(".")[0]
                    if top in modules:
                        aliases[top] = top
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = [node.attr]
        value = node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in aliases:
            continue
        chain.append(aliases[value.id])
        chain.reverse()  # [module, attr, attr...]
        module = chain[0]
        rest = chain[1:]
        while rest and f"{module}.{rest[0]}" in modules:
            module = f"{module}.{rest.pop(0)}"
        # each attribute node is seen once: the one right after the module names the module's attribute
        if len(rest) == 1 and module in again and rest[0] in again[module]:
            out.append(Use(where(node.lineno), module, rest[0]))
    return out


def _importer_files() -> list[pathlib.Path]:
    top = PACKAGE.parent
    files = sorted(PACKAGE.rglob("*.py")) + [top / "conftest.py"]
    for folder in IMPORTER_DIRS:
        files += sorted((top / folder).rglob("*.py"))
    return files


def test_checker_finds_names_taken_from_a_module_that_only_reexports_them(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "from ._low import f\n",
        "_base.py": "from __future__ import annotations\nimport os\nx = 1\n",
        # g is defined here; f is bound by import only; os is a module import; _sub is its own submodule
        "_low.py": ("from __future__ import annotations\nfrom ._base import x as f\nfrom . import _sub\n"
                    "import os\ndef g():\n    return f\n"),
        "_sub/__init__.py": "from .mod import h\n",
        "_sub/mod.py": "h = 2\n",
        "_high.py": ("from ._low import f, g\nfrom . import _low, _sub\nimport pkg._sub\n\n"
                     "def k():\n    from ._sub import h\n    return _low.f, _low.g, pkg._sub.h, _sub.mod.h, _low._sub\n"),
    })
    assert reexports(root)["pkg._low"] == {"f"}
    assert reexports(root)["pkg._sub"] == {"h"}
    other = tmp_path / "user.py"
    other.write_text("import pkg\nimport pkg._low as low\nfrom pkg._sub.mod import h\nlow.f\npkg.f\n"
                     "CHILD = \"\"\"\nfrom pkg import _low\n_low.f()\n\"\"\"\n")
    found = uses_of_reexports(root, sorted(root.rglob("*.py")) + [other])
    assert [(u.where.rsplit("/", 1)[-1], u.module, u.name) for u in found] == [
        ("__init__.py:1", "pkg._low", "f"),  # f is _base's x
        ("_high.py:1", "pkg._low", "f"),
        ("_high.py:6", "pkg._sub", "h"),
        ("_high.py:7", "pkg._low", "f"),
        ("_high.py:7", "pkg._sub", "h"),
        ("user.py:4", "pkg._low", "f"),
        ("user.py:5", "pkg", "f"),
        ("user.py:8", "pkg._low", "f"),  # in the child's program
    ]


def test_names_are_imported_from_the_module_that_defines_them():
    found = [u for u in uses_of_reexports(PACKAGE, _importer_files())
             if u.module not in SURFACE and (u.module, u.name) not in KEEP_REEXPORTS]
    assert not found, (
        "names taken from a module that only re-exports them (import each from the module that defines "
        "it, or list it in KEEP_REEXPORTS with the reason):\n" + "\n".join(map(str, found))
    )
