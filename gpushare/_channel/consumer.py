"""A channel's consumer: :func:`subscribe`, :class:`Consumer` and :class:`Step`."""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

from .. import _paths, _types
from .._open import open as open_share
from .._arrays import CudaArray
from .._errors import ChannelBrokenError, ClosedError, GpuShareError, InvalidInputError, InvalidTypeError
from .._errors import WaitTimeoutError
from .._by_descriptor import allocate
from .waits import _close_fd, _until, _passed, _run, _run_async
from .handle import ChannelHandle
from .records import _RELEASE, _LEAVE, _record
from .join import _Inbox, _join
from .producer import _array_of

__all__ = ["subscribe", "Step", "Consumer"]

log = logging.getLogger("gpushare.channel")


def subscribe(handle: ChannelHandle, *, timeout: float = 30.0, device: int | None = None) -> Consumer:
    """Join a channel as one of its consumers.

    Connects to the producer (a Unix socket on its node, TCP from another
    node), proves it holds the handle, and opens every slot: mapped where
    the path maps memory (host-fd, posix-fd: zero-copy), otherwise read with
    ucx-rma into a local array at each step.

    Parameters
    ----------
    handle : ChannelHandle
        From :attr:`Producer.handle`, probably unpickled: it is validated.
    timeout : float
        Seconds to reach the producer and open the slots.
    device : int, optional
        For CUDA channels: the device to map the slots on (see
        :func:`gpushare.open`), and from another node the device the
        steps are copied to (0 by default).

    Returns
    -------
    Consumer

    Raises
    ------
    AccessDeniedError
        The producer refused: the handle is forged, or every consumer place is taken.
    ChannelBrokenError
        The producer is gone.
    """
    if not isinstance(handle, ChannelHandle):
        fix = ("; read bytes from ChannelHandle.to_bytes() back with gpushare.ChannelHandle.from_bytes(data)"
               if isinstance(handle, (bytes, bytearray, memoryview)) else "")
        raise InvalidTypeError(f"subscribe expects a gpushare.ChannelHandle, not {type(handle).__name__}{fix}")
    return Consumer._create(handle, _types.positive_timeout(timeout), device)


class Step:
    """One published step, as a consumer holds it: made by :meth:`Consumer.wait`.

    ``array`` is the slot's memory (read-only; zero-copy where the path
    maps it) until :meth:`release`, which lets the producer reuse the slot:
    do not touch ``array`` after that (copy what you keep).  Leaving a
    ``with`` block releases.

    Attributes
    ----------
    step : int
        The step number.
    slot : int
        The slot it is in.
    array : numpy.ndarray or CudaArray
        Its data, of the channel's shape and dtype.
    """

    __slots__ = ("_consumer", "_released", "array", "slot", "step")
    step: int
    slot: int
    array: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Step objects are made by Consumer.wait")

    @classmethod
    def _make(cls, consumer: Consumer, step: int, slot: int, array: Any) -> Step:
        self = object.__new__(cls)
        self._consumer, self.step, self.slot, self.array, self._released = consumer, step, slot, array, False
        return self

    @property
    def released(self) -> bool:
        """Whether :meth:`release` ran."""
        return self._released

    def release(self) -> None:
        """Tell the producer this consumer is done with the step (idempotent)."""
        if not self._released:
            self._released = True
            self._consumer._release(self.slot, self.step)

    def __enter__(self) -> Step:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<gpushare.Step {self.step} in slot {self.slot}{' released' if self._released else ''}>"


class Consumer:
    """A consuming end of a channel: made by :func:`gpushare.subscribe`.

    :meth:`wait` (or :meth:`wait_async`) returns each published step in
    order; iterating (``for step in consumer``, ``async for``) yields every
    step until the producer closes the channel, releasing each step when the
    next is asked for.  :meth:`close` leaves the channel: the producer stops
    waiting for this consumer.  A consumer process that exits without
    closing breaks the channel for the others (:class:`ChannelBrokenError`).

    Attributes
    ----------
    handle : ChannelHandle
        The channel.
    index : int
        This consumer's place, 0 to ``consumers - 1``.
    paths : tuple of str
        The path each slot was opened over (``"host-fd"``, ``"ucx-rma"``...).
    zero_copy : bool
        Whether the steps are read in place (every slot mapped).
    """

    handle: ChannelHandle
    index: int
    paths: tuple[str, ...]
    zero_copy: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Consumer objects are made by gpushare.subscribe")

    @classmethod
    def _create(cls, handle: ChannelHandle, timeout: float, device: int | None) -> Consumer:
        deadline = time.monotonic() + timeout
        self = object.__new__(cls)
        self.handle = handle
        self._in = _Inbox(handle)
        self._next = 0
        self._closed = False
        self._held: Step | None = None
        self._views: list = []
        self._arrays: list = []
        self._staging: list = []
        self._device = device
        held: list = [None, None]  # the connection and the producer's pidfd, once made
        self._finalizer = weakref.finalize(self, _release_consumer, held, self._views)
        try:
            # Every slot is open before the producer counts this consumer in:
            # no step is published that it could not read.
            for share in handle._field("shares"):
                view = open_share(share, timeout=max(0.1, deadline - time.monotonic()), device=device)
                self._views.append(view)
                self._arrays.append(_consumer_array(view, handle))
                self._staging.append(None)
            self._wire, self.index, self._pidfd = _join(handle, max(0.1, deadline - time.monotonic()))
            held[:] = [self._wire, self._pidfd]
        except BaseException:
            self._arrays.clear()
            self._finalizer()
            raise
        self.paths = tuple(v.path for v in self._views)
        self.zero_copy = all(a is not None for a in self._arrays)
        log.info("channel %s: joined as consumer %d over %s", handle.channel_id[:8], self.index,
                 ", ".join(sorted(set(self.paths))))
        return self

    # -- state -------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def _fds(self) -> list[int]:
        return [self._wire.sock.fileno()] + ([self._pidfd] if self._pidfd is not None else [])

    def _pump(self, woken: frozenset[int] = frozenset()) -> None:
        if not self._closed:
            self._in.pump(self._wire, woken, self._pidfd)

    def _take(self, want: int | None) -> tuple[int, int] | None:
        """The wanted step if it arrived (releasing the ones skipped), else None."""
        if self._closed:
            raise ClosedError("the consumer is closed")
        if want is not None and want < self._next:
            raise InvalidInputError(f"step {want} was already taken; the next step is {self._next}")
        while self._in.queue:
            step, slot = self._in.queue.popleft()
            self._next = step + 1
            if want is None or step == want:
                return step, slot
            if step > want:
                raise ChannelBrokenError(f"the producer published step {step} where step {want} was due")
            self._release(slot, step)
        if self._in.broken is not None:
            raise ChannelBrokenError(self._in.broken)
        if self._in.end is not None and (want is None or want >= self._in.end):
            raise ClosedError(f"the producer closed the channel after {self._in.end} steps")
        return None

    def wait(self, step: int | None = None, timeout: float | None = None) -> Step:
        """Wait for a step and return it.

        Parameters
        ----------
        step : int, optional
            The step to wait for (earlier ones not yet taken are released
            unread); by default the next one.
        timeout : float or None
            Seconds to wait; ``None`` waits as long as the producer lives.

        Returns
        -------
        Step
            Release it (or leave its ``with`` block) once done reading.

        Raises
        ------
        WaitTimeoutError
            The step was not published in time.
        ClosedError
            The producer closed the channel before that step (or this consumer is closed).
        ChannelBrokenError
            The producer, or another consumer, died; or the producer
            stopped answering for ``GPUSHARE_PEER_TIMEOUT`` seconds (stopped,
            frozen, cut off), ``timeout=None`` included.
        """
        return self._deliver(*_run(self._waiting(step, timeout)))

    async def wait_async(self, step: int | None = None, timeout: float | None = None) -> Step:
        """:meth:`wait` for asyncio: the event loop watches the connection (no thread)."""
        return await self._deliver_async(*await _run_async(self._waiting(step, timeout)))

    def _waiting(self, step: int | None, timeout: float | None) -> Any:
        self._check_step(step)
        deadline = _types.deadline(timeout)
        woken: frozenset[int] = frozenset()
        while True:
            self._pump(woken)
            got = self._take(step)
            if got is not None:
                return got
            if self._in.check_alive(self._wire, self.handle.producer_pid, self._pidfd is not None):
                continue  # the producer stopped answering: the next _take says so
            woken = yield self._fds(), _until(deadline)
            if not woken and _passed(deadline):
                self._pump()
                if self._in.queue or self._in.broken or self._in.end is not None:
                    continue
                raise WaitTimeoutError(f"step {self._next if step is None else step} was not published "
                                       f"within {timeout} s")

    @staticmethod
    def _check_step(step: Any) -> None:
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise InvalidInputError(f"step must be a non-negative int or None, not {step!r}")

    def _staged(self, slot: int) -> Any:
        if self._staging[slot] is None:
            self._staging[slot] = _staging_array(self.handle, self._device)
        return self._staging[slot]

    def _deliver(self, step: int, slot: int) -> Step:
        arr = self._arrays[slot]
        if arr is None:
            arr = self._staged(slot)
            try:
                self._views[slot].get(arr, timeout=60.0)
            except BaseException:
                self._release(slot, step)
                raise
        return Step._make(self, step, slot, arr)

    async def _deliver_async(self, step: int, slot: int) -> Step:
        arr = self._arrays[slot]
        if arr is None:
            arr = self._staged(slot)
            try:
                await self._views[slot].get_async(arr, timeout=60.0)
            except BaseException:
                self._release(slot, step)
                raise
        return Step._make(self, step, slot, arr)

    def _release(self, slot: int, step: int) -> None:
        if self._closed or self._in.broken is not None:
            return
        if not self._wire.send(_record(_RELEASE, slot, step)):
            self._in.gone("stopped reading")

    # -- iteration ---------------------------------------------------------
    def __iter__(self) -> Iterator[Step]:
        while (got := _run(self._iterating())) is not None:
            self._held = self._deliver(*got)
            yield self._held

    async def __aiter__(self) -> AsyncIterator[Step]:
        while (got := await _run_async(self._iterating())) is not None:
            self._held = await self._deliver_async(*got)
            yield self._held

    def _iterating(self) -> Any:
        """The next step for iteration (the previous one released), or None at the end."""
        if self._held is not None:
            self._held.release()
            self._held = None
        try:
            return (yield from self._waiting(None, None))
        except ClosedError:
            if self._closed:
                raise
            return None

    def close(self) -> None:
        """Leave the channel: release what this consumer holds, tell the
        producer, close the slots (idempotent)."""
        if self._closed:
            return
        if self._in.broken is None:
            self._wire.send(_record(_LEAVE))
        self._closed = True
        self._held = None
        self._arrays.clear()
        self._staging.clear()
        self._finalizer()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Consumer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"next step {self._next}"
        return f"<gpushare.Consumer {self.index} of channel {self.handle.channel_id[:8]}, {state}>"


def _release_consumer(held: list, views: list) -> None:
    wire, pidfd = held
    held[:] = [None, None]
    if wire is not None:
        wire.close()
    _close_fd(pidfd)
    for view in views:
        with contextlib.suppress(GpuShareError):
            view.close()
    views.clear()


def _consumer_array(view: Any, handle: ChannelHandle) -> Any:
    """A typed array over a mapped slot, or None when the slot is read by copy."""
    if not _paths.by_name(view.path).mapped:
        return None
    if view.device == "host":
        return _array_of(view, handle.shape, handle.typestr, "host", readonly=True)
    cai = view.__cuda_array_interface__
    return CudaArray._make(view, cai["data"][0], handle.shape, handle.typestr, view.device, readonly=True)


def _staging_array(handle: ChannelHandle, device: int | None) -> Any:
    """Local memory a ucx-rma slot is read into at each step."""
    import numpy as np

    if handle.device == "host":
        return np.empty(handle.shape, np.dtype(handle.typestr))
    device = device if device is not None else 0
    buf = allocate(handle.nbytes, device=device)
    return CudaArray._make(buf, int(buf.handle), handle.shape, handle.typestr, device)
