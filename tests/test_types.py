"""The one copy of each validator in gpushare._types, and the modules that use it."""

from __future__ import annotations

import math
import os
import time

import pytest

import gpushare as gs
from gpushare import _connection, _descriptors, _importer, _share, _types
from gpushare._channel import handle as _channel_handle


@pytest.mark.parametrize("value", [True, 1.0, "3", None, 2.5])
def test_integer_refuses_what_is_not_an_integer(value):
    with pytest.raises(gs.InvalidInputError, match="expected an integer"):
        _types.integer(value, "size")


def test_integer_takes_index_types():
    class Index:
        def __index__(self) -> int:
            return 7

    assert _types.integer(7, "size") == 7
    assert _types.integer(Index(), "size") == 7


def test_in_range_names_the_owner_and_the_bounds():
    assert _types.in_range(5, "port", 1, 9) == 5
    with pytest.raises(gs.InvalidInputError, match=r"^share port is 0; expected 1 <= port <= 9$"):
        _types.in_range(0, "port", 1, 9, owner="share")
    with pytest.raises(gs.InvalidInputError, match=r"^port must be an int, not bool$"):
        _types.in_range(True, "port", 1, 9)


def test_text_bounds_its_length():
    assert _types.text(None, "node") is None
    with pytest.raises(gs.InvalidInputError, match="expected a str"):
        _types.text(None, "node", optional=False)
    with pytest.raises(gs.InvalidInputError, match="at most 256"):
        _types.text("x" * 257, "node")


@pytest.mark.parametrize("value", [-1, math.nan, True, "1", [1]])
def test_timeout_refuses_what_is_not_a_wait(value):
    with pytest.raises(gs.InvalidInputError, match="timeout must be a non-negative number of seconds or None"):
        _types.timeout(value)


def test_timeout_and_deadline():
    assert _types.timeout(None) is None
    assert _types.timeout(0) == 0.0
    assert _types.deadline(None) is None
    before = time.monotonic()
    assert before + 2 <= _types.deadline(2) <= time.monotonic() + 2


@pytest.mark.parametrize("value", [0, -1, math.nan, None, True, "5"])
def test_positive_timeout(value):
    with pytest.raises(gs.InvalidInputError, match="^timeout must be a positive number of seconds$"):
        _types.positive_timeout(value)
    assert _types.positive_timeout(3) == 3.0


def test_close_all_closes_the_rest_when_one_fails():
    r, w = os.pipe()
    os.close(w)
    _types.close_all([w, r])  # w is closed already: its EBADF does not keep r open
    with pytest.raises(OSError):
        os.fstat(r)


def test_each_module_uses_the_one_copy():
    # each module's own binding (read from its namespace: the name is not for import from there)
    assert vars(_descriptors)["_integer"] is _types.integer
    assert vars(_descriptors)["_text"] is _types.text
    assert vars(_importer)["_close_all"] is _types.close_all
    assert vars(_connection)["_close_all"] is _types.close_all
    # the share's and the channel handle's field checks word their errors through in_range
    with pytest.raises(gs.InvalidInputError, match=r"^share nbytes must be an int, not float$"):
        _share._int(1.0, "nbytes", 1, 2)
    with pytest.raises(gs.InvalidInputError, match=r"^channel slots is 0; expected 1 <= slots <= 64$"):
        _channel_handle._int(0, "slots", 1, 64)


def test_pickles_with_the_old_handle_type_spelling_still_load():
    from tests.test_descriptors import posix_fd

    d = posix_fd()
    rebuild, (kind, *fields) = d.__reduce__()
    assert kind == "posix-fd"
    old = rebuild("posix_fd", *fields)
    assert type(old) is type(d) and old.handle_type == "posix-fd" and old == d
    with pytest.raises(gs.InvalidInputError, match="unknown descriptor handle type"):
        rebuild("posix fd", *fields)


# ---------------------------------------------------------------- the Completion protocol

import importlib  # noqa: E402
import inspect  # noqa: E402

#: Each completion class, at the places it may live (the first that exists is checked).
COMPLETIONS = {
    "ucx Request": ["gpushare._ucx._agent:Request"],
    "CUDA CopyRequest": ["gpushare._cuda._copies:CopyRequest"],
    "cma Transfer": ["gpushare._importer:Transfer", "gpushare._paths.cma:Transfer"],
    "BatchRequest": ["gpushare._batch:BatchRequest"],
}


def _find(places: list[str]) -> type:
    for place in places:
        module, name = place.split(":")
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ModuleNotFoundError:
            continue
        if found is not None:
            return found
    raise AssertionError(f"none of {places} exists; update COMPLETIONS in tests/test_types.py")


def protocol_mismatches(cls: type, protocol: type = _types.Completion) -> list[str]:
    """What ``cls`` lacks or spells differently from ``protocol``: each member exists,
    takes the protocol's parameters (same names, kinds, defaults and annotations),
    requires no others, and returns what the protocol says."""
    problems = []
    members = [n for n, v in vars(protocol).items() if inspect.isfunction(v) and (n[0] != "_" or n == "__await__")]
    assert members, "the protocol defines no members"
    for name in sorted(members):
        want = getattr(protocol, name)
        have = getattr(cls, name, None)
        if have is None or not callable(have):
            problems.append(f"{cls.__name__} has no {name}()")
            continue
        wsig, hsig = inspect.signature(want), inspect.signature(have)
        wparams = list(wsig.parameters.values())[1:]
        hparams = dict(list(hsig.parameters.items())[1:])
        for w in wparams:
            h = hparams.get(w.name)
            if h is None:
                problems.append(f"{cls.__name__}.{name} takes no {w.name!r}")
                continue
            if h.kind != w.kind:
                problems.append(f"{cls.__name__}.{name}: {w.name!r} is {h.kind.description}, not {w.kind.description}")
            if h.default != w.default:
                problems.append(f"{cls.__name__}.{name}: {w.name!r} defaults to {h.default!r}, not {w.default!r}")
            if h.annotation != w.annotation:
                problems.append(f"{cls.__name__}.{name}: {w.name!r} is {h.annotation}, not {w.annotation}")
        for extra, h in hparams.items():
            if extra not in {w.name for w in wparams} and h.default is h.empty \
                    and h.kind not in (h.VAR_POSITIONAL, h.VAR_KEYWORD):
                problems.append(f"{cls.__name__}.{name} requires {extra!r}, which the protocol does not pass")
        if name in ("done", "wait") and hsig.return_annotation != wsig.return_annotation:
            problems.append(f"{cls.__name__}.{name} returns {hsig.return_annotation}, not {wsig.return_annotation}")
        if name == "exception" and not str(hsig.return_annotation).endswith("| None"):
            problems.append(f"{cls.__name__}.exception returns {hsig.return_annotation}, not an error or None")
    return problems


@pytest.mark.parametrize("what", sorted(COMPLETIONS))
def test_each_completion_class_follows_the_protocol(what):
    cls = _find(COMPLETIONS[what])
    assert protocol_mismatches(cls) == []


def test_the_protocol_check_sees_a_drift():
    class Drifted:
        def done(self) -> bool: ...
        def wait(self, deadline: float) -> None: ...
        def exception(self, timeout: float | None = None) -> BaseException | None: ...

    problems = protocol_mismatches(Drifted)
    assert "Drifted has no __await__()" in problems
    assert "Drifted.wait takes no 'timeout'" in problems
    assert "Drifted.wait requires 'deadline', which the protocol does not pass" in problems
    # an extra optional parameter is fine (Request.exception takes a timeout)
    assert not [p for p in problems if "exception" in p]
    assert protocol_mismatches(_find(COMPLETIONS["BatchRequest"])) == []
