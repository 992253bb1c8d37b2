"""Names the API takes, as ``Literal`` types, the one place spellings are
normalised, the one copy of each argument validator, and :class:`Completion`,
what every operation in flight follows.

Path names and handle types are spelled with hyphens (``"posix-fd"``,
``"cuda-ipc"``); the older underscore spellings of handle types
(``"posix_fd"``, ``"cuda_ipc"``) still work and warn with
:class:`DeprecationWarning`.  ``device="cpu"`` is a synonym of ``"host"``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import operator
import os
import time
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

from ._errors import InvalidInputError, InvalidTypeError

__all__ = [
    "round_up",
    "collection_paused",
    "PathName",
    "HandleType",
    "LifetimeName",
    "Lifetime",
    "Device",
    "path_names",
    "set_path_names",
    "HANDLE_TYPES",
    "handle_type",
    "internal_handle_type",
    "public_handle_types",
    "is_host",
    "integer",
    "in_range",
    "text",
    "timeout",
    "deadline",
    "positive_timeout",
    "close_all",
    "strict_json",
    "OLD_HANDLE_TYPES",
    "Completion",
]

#: A path between two processes, as type checkers know them (at run time the
#: paths themselves tell their names: :func:`path_names`).
PathName: TypeAlias = Literal["same-process", "fabric", "posix-fd", "cuda-ipc", "host-fd", "cma", "ucx-rma"]
#: How same-node memory is handed over by :func:`gpushare.export_buffer`.
HandleType: TypeAlias = Literal["posix-fd", "fabric", "cuda-ipc"]
#: A named lifetime policy of :func:`gpushare.export`.
LifetimeName: TypeAlias = Literal["auto", "closed", "revoked", "none"]
#: A lifetime policy: a name, or a number of imports.
Lifetime: TypeAlias = LifetimeName | int
#: Where memory lives: a CUDA device ordinal, or host memory (``"cpu"`` is a synonym of ``"host"``).
Device: TypeAlias = int | Literal["host", "cpu"]



def _no_paths() -> tuple[str, ...]:
    return ()


_path_names_of: Callable[[], tuple[str, ...]] = _no_paths


def path_names() -> tuple[str, ...]:
    """The names of the paths, fastest first: what a share's offers may
    name, and the order of a bundle manifest's bits (one per name).
    :mod:`gpushare._paths` tells them, from its ``PATHS``
    (:func:`set_path_names`), so that a path added there is known here."""
    return _path_names_of()


def set_path_names(source: Callable[[], tuple[str, ...]]) -> None:
    """Where :func:`path_names` asks (``gpushare._paths``, at its import)."""
    global _path_names_of
    _path_names_of = source


HANDLE_TYPES: tuple[HandleType, ...] = ("posix-fd", "fabric", "cuda-ipc")
#: The older underscore spellings of handle types, and the one each now is.
OLD_HANDLE_TYPES = {"posix_fd": "posix-fd", "cuda_ipc": "cuda-ipc"}


def handle_type(value: object, *, stacklevel: int = 3) -> HandleType | None:
    """The canonical spelling of a handle type given by a caller (``None`` stays ``None``).

    Raises
    ------
    InvalidInputError
        Not a handle type.
    """
    if value is None:
        return None
    if isinstance(value, str) and value in OLD_HANDLE_TYPES:
        new = OLD_HANDLE_TYPES[value]
        warnings.warn(f"handle_type={value!r} is deprecated; spell it {new!r}, like the path of the same name",
                      DeprecationWarning, stacklevel=stacklevel)
        return new  # type: ignore[return-value]
    if isinstance(value, str) and value in HANDLE_TYPES:
        return value  # type: ignore[return-value]
    raise InvalidInputError(f"handle_type is {value!r:.40}; expected one of {', '.join(HANDLE_TYPES)} or None")


def internal_handle_type(value: str | None) -> str | None:
    """The spelling the CUDA modules use internally (``"posix_fd"``, ``"cuda_ipc"``)."""
    return None if value is None else value.replace("-", "_")


def public_handle_types(names: list[str]) -> list[str]:
    """Internal handle-type names in the public spelling."""
    return [n.replace("_", "-") for n in names]


def is_host(device: object) -> bool:
    """True for ``"host"`` and its synonym ``"cpu"``."""
    return isinstance(device, str) and device in ("host", "cpu")


# ---------------------------------------------------------------- validators
#
# Each check exists once, here.  The error texts name the argument (and, for
# fields of a wire object, the object: ``owner="share"`` gives "share nbytes
# must be an int"); tests and users match on them, so they stay as they are.

#: The most characters :func:`text` accepts.
MAX_TEXT = 256


def integer(value: object, what: str) -> int:
    """``value`` as an ``int``, refusing bools, floats and anything without ``__index__``
    (numpy integers are accepted, numpy bools are not)."""
    if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):  # numpy.bool_ too
        raise InvalidInputError(f"{what} is a bool ({value!r}); expected an integer")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidInputError(
            f"{what} is {type(value).__name__} {value!r:.60}; expected an integer"
        ) from None


def in_range(value: object, what: str, lo: int = 0, hi: int = (1 << 64) - 1, *, owner: str = "") -> int:
    """``value`` itself if it is an ``int`` (not a bool) with ``lo <= value <= hi``.

    For fields read from the wire, where only a plain ``int`` is valid; ``owner``
    names the object the field belongs to in the message.
    """
    name = f"{owner} {what}" if owner else what
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"{name} must be an int, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise InvalidInputError(f"{name} is {value}; expected {lo} <= {what} <= {hi}")
    return value


def text(value: object, what: str, *, optional: bool = True) -> str | None:
    """``value`` if it is a ``str`` of at most :data:`MAX_TEXT` characters (or ``None``
    when ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise InvalidInputError(f"{what} is {type(value).__name__}; expected a str")
    if len(value) > MAX_TEXT:
        raise InvalidInputError(f"{what} is {len(value)} characters; expected at most {MAX_TEXT}")
    return value


def _seconds(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and not math.isnan(value)


def timeout(value: object) -> float | None:
    """A wait's ``timeout``: ``None`` (no limit) or a non-negative number of seconds."""
    if value is None:
        return None
    if (type(value) is float or type(value) is int) and value >= 0:  # the usual case (NaN: below)
        return float(value)
    if not _seconds(value) or value < 0:  # type: ignore[operator]
        raise InvalidInputError(f"timeout must be a non-negative number of seconds or None, not {value!r}")
    return float(value)  # type: ignore[arg-type]


def deadline(value: object) -> float | None:
    """The :func:`time.monotonic` instant a wait of ``timeout=value`` ends at (``None``: never)."""
    seconds = timeout(value)
    return None if seconds is None else time.monotonic() + seconds


def positive_timeout(value: object) -> float:
    """The ``timeout`` of a call that must end: a positive number of seconds."""
    if not _seconds(value) or not value > 0:  # type: ignore[operator]
        raise InvalidInputError("timeout must be a positive number of seconds")
    return float(value)  # type: ignore[arg-type]


@contextlib.contextmanager
def collection_paused(items: int = 1 << 30) -> Iterator[None]:
    """No garbage collection while ``items`` objects that all stay reachable
    are made (from 1,000 up; fewer are left alone): a collection then frees
    nothing and, in a process holding many objects, costs as much as making
    them.  The collector is left as it was."""
    was = items >= 1000 and gc.isenabled()
    if was:
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def round_up(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


class Regrowth:
    """When to prune a collection that only grows between prunings: once it holds more than
    twice what the last pruning kept (``kept``, set by the pruner) plus ``slack``.  Pruning then
    costs O(1) an addition, amortized, and the collection holds at most about twice its live
    entries, plus ``slack``."""

    __slots__ = ("kept", "slack")

    def __init__(self, slack: int) -> None:
        self.kept = 0
        self.slack = slack

    def due(self, size: int) -> bool:
        return size > 2 * self.kept + self.slack


def close_all(fds: Iterable[int]) -> None:
    """Close every file descriptor in ``fds``; one that fails to close does not keep
    the others open."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# ---------------------------------------------------------------- completions


@runtime_checkable
class Completion(Protocol):
    """An operation in flight: a UCX request (:class:`gpushare.ucx.Request`), a
    stream-ordered CUDA copy, a cma transfer, a batch.

    Each of them follows this; ``tests/test_types.py`` checks their signatures
    against it, so that one cannot drift from the others.
    """

    def done(self) -> bool:
        """Whether the operation has completed (or failed); never blocks."""
        ...

    def wait(self, timeout: float | None = None) -> None:
        """Block until it completes and raise its error; :class:`~gpushare.WaitTimeoutError`
        if ``timeout`` seconds pass first (the operation stays in flight)."""
        ...

    def exception(self) -> BaseException | None:
        """Its error, or ``None`` if it succeeded: ask once :meth:`done` is true.
        (Before then :meth:`gpushare.ucx.Request.exception` waits, as
        :meth:`concurrent.futures.Future.exception` does, and the others answer ``None``.)"""
        ...

    def __await__(self) -> Generator[Any, None, Any]:
        """``await`` it: the asyncio form of :meth:`wait`, without blocking the loop."""
        ...


def strict_json(data: Any, limit: int, caller: str, what: str) -> Any:
    """Bytes from another process read as bounded, strict JSON: ASCII, at most
    ``limit`` bytes, no duplicate keys, floats or constants (``NaN``)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidTypeError(f"{caller} expects bytes, not {type(data).__name__}")
    data = bytes(data)
    if len(data) > limit:
        raise InvalidInputError(f"{what} is {len(data)} bytes; at most {limit}")
    try:
        return json.loads(data.decode("ascii"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant,
                          parse_float=_no_float)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise InvalidInputError(f"{what} bytes are not ASCII JSON from {caller.split('.')[0]}.to_bytes") from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key")
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _no_float(text: str) -> Any:
    raise ValueError("floats are not allowed")
