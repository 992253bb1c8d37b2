"""Progress of a long copy over a copied path (cma, ucx-rma): a copy that
someone listens to moves in pieces, and each piece done is reported.

Nobody listens unless a caller passes ``progress=`` to :meth:`View.get` /
:meth:`View.put` or the ``gpushare.progress`` logger is enabled at DEBUG;
then a copy larger than :data:`LOG_ABOVE` logs a few lines (its start, each
tenth or each second, its end with the rate), and the callback hears
``(bytes done, total)`` after each piece.  A copy nobody listens to is one
request, as before: it pays one ``isEnabledFor`` check.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from ._errors import InvalidTypeError

__all__ = ["LOG_ABOVE", "PIECE", "Progress", "check_callback", "listening", "piece_of", "pieces"]

log = logging.getLogger("gpushare.progress")

#: A copy of more bytes than this over cma or ucx-rma logs its progress at
#: DEBUG (on the ``gpushare.progress`` logger).
LOG_ABOVE = 256 << 20
#: Bytes a copy moves per request while someone listens: each piece is a
#: request of its own (about 0.1 ms more a piece over cma, against some 10 ms
#: to copy it), and its end is reported.
PIECE = 64 << 20
#: At most one log line per this many seconds, besides one per tenth.
LOG_EVERY = 1.0

ProgressCallback = Callable[[int, int], Any]


def check_callback(progress: Any) -> ProgressCallback | None:
    """``progress=`` of a copy: None or a callable, else :class:`InvalidTypeError`."""
    if progress is not None and not callable(progress):
        raise InvalidTypeError(f"progress must be a callable (done, total) or None, not {type(progress).__name__}")
    return progress


def listening(progress: ProgressCallback | None) -> bool:
    """Whether a copy should be moved in pieces and reported."""
    return progress is not None or log.isEnabledFor(logging.DEBUG)


class Progress:
    """Reports one copy: the callback after each piece, and DEBUG lines when
    the copy is larger than :data:`LOG_ABOVE` (at its start, at each tenth or
    after :data:`LOG_EVERY` seconds, and at its end)."""

    __slots__ = ("callback", "logs", "next_tenth", "last", "start", "total", "what")

    def __init__(self, what: str, total: int, callback: ProgressCallback | None) -> None:
        self.what = what
        self.total = total
        self.callback = callback
        self.logs = total > LOG_ABOVE and log.isEnabledFor(logging.DEBUG)
        self.start = self.last = time.monotonic()
        self.next_tenth = 1
        if self.logs:
            log.debug("%s: %d MiB, starting", what, total >> 20)

    def __call__(self, done: int) -> None:
        if self.callback is not None:
            self.callback(done, self.total)
        if not self.logs:
            return
        now = time.monotonic()
        tenth = done * 10 // self.total
        if done == self.total:
            took = max(now - self.start, 1e-9)
            log.debug("%s: %d MiB done in %.2f s (%.2f GB/s)", self.what, self.total >> 20, took,
                      self.total / took / 1e9)
        elif tenth >= self.next_tenth or now - self.last >= LOG_EVERY:
            log.debug("%s: %d%% (%d of %d MiB)", self.what, done * 100 // self.total, done >> 20, self.total >> 20)
        else:
            return
        self.last = now
        self.next_tenth = tenth + 1


class _CudaPiece:
    """A range of CUDA memory, as ``__cuda_array_interface__`` bytes, after
    the work its producer left on ``stream``."""

    __slots__ = ("__cuda_array_interface__", "keep")

    def __init__(self, address: int, nbytes: int, readonly: bool, stream: int | None, keep: Any) -> None:
        self.__cuda_array_interface__ = {"data": (address, readonly), "shape": (nbytes,), "typestr": "|u1",
                                         "version": 3, "strides": None, "stream": stream}
        self.keep = keep


def piece_of(local: Any, start: int, nbytes: int) -> Any:
    """``nbytes`` of a resolved buffer (a ``LocalBuffer``) from ``start``,
    as an object a copy takes: it names the stream of the buffer's producer
    (CUDA memory) and holds ``local``, so that a piece still in flight when
    its caller gives up (a timeout, a cancelled await) keeps the memory
    pinned and alive; the caller releases ``local`` only once every piece
    is done."""
    address = local.address + start
    if local.memory_type == "host":
        piece = (ctypes.c_uint8 * nbytes).from_address(address)
        piece.keep = local  # type: ignore[attr-defined]
        return piece
    return _CudaPiece(address, nbytes, local.readonly, local.stream, local)


def pieces(local: Any, what: str, progress: ProgressCallback | None) -> Iterator[tuple[int, int, Any, Progress]]:
    """The pieces a reported copy of ``local`` (a resolved buffer the caller
    holds) moves in: ``(start, end, piece, report)``, the caller calling
    ``report(end)`` once each piece is done.  None at all when only
    the log listens and the copy is too small to log (the caller then moves
    it whole); one report of 0 for an empty copy."""
    total = local.nbytes
    if progress is None and total <= LOG_ABOVE:
        return
    report = Progress(what, total, progress)
    if total == 0:
        report(0)
    for start in range(0, total, PIECE):
        end = min(start + PIECE, total)
        yield start, end, piece_of(local, start, end - start), report
