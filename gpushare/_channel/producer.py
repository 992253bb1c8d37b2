"""A channel's producer: :func:`channel` and :class:`Producer`."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
import weakref
from collections.abc import Iterator
from typing import Any

from .. import _buffers, _types
from .._cuda import _copies, _driver
from .._export import export
from .._arrays import CudaArray, check_shape, nbytes_of, portable_typestr
from .._errors import ChannelBrokenError, ClosedError, GpuShareError, InvalidInputError, UnsupportedError
from .._errors import WaitTimeoutError
from .._by_descriptor import allocate
from .._process import node_key
from .waits import _until, _passed, _exited, _why_gone, _run, _run_async
from .handle import HANDLE_FORMAT, MAX_CONSUMERS, MAX_SLOTS, ChannelHandle
from .records import _PUBLISH, _END, _ABORT, _FAILED, _record
from .hub import _Peer, _Hub

__all__ = ["channel", "Producer"]

log = logging.getLogger("gpushare.channel")


def _release_producer(hub: _Hub, shares: list, buffers: list) -> None:
    """Everything a producer holds, released once (also by its finalizer)."""
    hub.stop()
    if hub.pid != os.getpid():
        shares.clear()  # the parent's exports and memory: not this process's to end
        buffers.clear()
        return
    for share in shares:
        with contextlib.suppress(GpuShareError):
            share.revoke()
    shares.clear()
    for buf in buffers:
        close = getattr(buf, "close", None)
        if close is not None:
            with contextlib.suppress(BufferError, GpuShareError):
                close()
    buffers.clear()


def channel(shape: Any, dtype: Any = "u1", *, consumers: int, slots: int = 2,
            device: Any = "host") -> Producer:
    """Make a channel for a step loop; this process is its producer.

    Parameters
    ----------
    shape : int or tuple of int
        Shape of the array each step carries.
    dtype : numpy dtype, default ``"u1"``
        Its element type: bool, integer, floating-point or complex.
    consumers : int
        How many consumers join (with :func:`gpushare.subscribe`).  The
        first :meth:`Producer.acquire` waits until all of them have, so no
        step is published before every consumer can see it.
    slots : int, default 2
        Slots in the ring: how many steps can be in flight (filled by the
        producer and not yet released by every consumer).  2 is a double
        buffer.
    device : "host" or int, default "host"
        Host memory (from :func:`gpushare.allocate`, mapped by consumers on
        this node), or a CUDA device ordinal.

    Returns
    -------
    Producer
        Pass :attr:`Producer.handle` to the consumers.

    Raises
    ------
    InvalidInputError
        A shape, dtype, count or device out of range.

    Examples
    --------
    >>> import numpy as np, gpushare as gs
    >>> with gs.channel((4,), np.float32, consumers=1) as producer:
    ...     with gs.subscribe(producer.handle) as consumer:
    ...         producer.send(np.arange(4, dtype=np.float32))
    ...         with consumer.wait(timeout=10) as step:
    ...             print(step.step, step.array)
    0 [0. 1. 2. 3.]
    """
    shape = check_shape(shape)
    typestr = portable_typestr(dtype)
    nbytes = nbytes_of(shape, typestr)
    if nbytes < 1:
        raise InvalidInputError(f"a step of shape {shape} holds no bytes; a channel carries at least one")
    if isinstance(consumers, bool) or not isinstance(consumers, int) or not 1 <= consumers <= MAX_CONSUMERS:
        raise InvalidInputError(f"consumers must be an int from 1 to {MAX_CONSUMERS}, not {consumers!r}")
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise InvalidInputError(f"slots must be an int from 1 to {MAX_SLOTS}, not {slots!r}")
    if _types.is_host(device):
        device = "host"
    elif isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise InvalidInputError(f"device is {device!r}; expected 'host' (or 'cpu') or a CUDA device ordinal")
    return Producer._create(shape, typestr, consumers, slots, device)



class Producer:
    """The producing end of a channel: made by :func:`gpushare.channel`.

    Each step: :meth:`acquire` the next slot (it waits while a consumer
    still reads the step that used it last), fill the array, :meth:`publish`.
    :meth:`slot` does both around a ``with`` block; :meth:`send` copies an
    array in.  Waiting is done by the kernel: no polling, no sleeping.

    Attributes
    ----------
    handle : ChannelHandle
        Plain data for the consumers.
    step : int
        The number the next published step gets (0 first).
    """

    handle: ChannelHandle
    step: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Producer objects are made by gpushare.channel")

    @classmethod
    def _create(cls, shape: tuple[int, ...], typestr: str, consumers: int, slots: int, device: Any) -> Producer:
        self = object.__new__(cls)
        self._shape, self._typestr, self._consumers, self._slots = shape, typestr, consumers, slots
        self.step = 0
        self._closed = False
        self._acquired: int | None = None
        self._broken: str | None = None
        self._peers: dict[int, _Peer] = {}  # those the producer's thread took in from the hub
        self._busy: list[set[int]] = [set() for _ in range(slots)]
        self._slot_step = [-1] * slots
        self._buffers: list = []
        self._shares: list = []
        self._arrays: list = []
        channel_id, token = secrets.token_hex(16), secrets.token_bytes(32)
        nbytes = nbytes_of(shape, typestr)
        hub = self._hub = _Hub(channel_id, token, consumers)
        self._finalizer = weakref.finalize(self, _release_producer, hub, self._shares, self._buffers)
        try:
            for _ in range(slots):
                buf = allocate(nbytes, device=device)
                self._buffers.append(buf)
                if device == "host":
                    # Consumers read: the kernel keeps their mappings read-only.
                    with contextlib.suppress(UnsupportedError):  # a kernel before 5.1
                        buf.seal()
                self._shares.append(export(buf, lifetime="revoked", readonly=True))
                self._arrays.append(_array_of(buf, shape, typestr, device))
        except BaseException:
            self._arrays.clear()
            self._finalizer()
            raise
        self.handle = ChannelHandle._make(HANDLE_FORMAT, channel_id, token, os.getpid(), node_key(),
                                          f"gpushare-channel-{channel_id}", hub.addresses, shape, typestr,
                                          consumers, slots, device, tuple(self._shares))
        log.info("channel %s: %d slots of %s %s on %s for %d consumers", channel_id[:8], slots, shape, typestr,
                 device, consumers)
        return self

    # -- state -------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def _check(self) -> None:
        if self._closed:
            raise ClosedError("the channel is closed")
        if self._broken is not None:
            raise ChannelBrokenError(self._broken)

    def _live(self) -> list[_Peer]:
        return [p for p in self._peers.values() if not p.left]

    def _fds(self, slot: int) -> list[int]:
        """What to wait on for ``slot``: consumers joining, or the first
        consumer that still holds it (waking for the others' releases would
        only mean waking again), and every consumer's death."""
        fds = [self._hub.wake.fd] if len(self._peers) < self._consumers else []
        holders = sorted(self._busy[slot])
        for peer in self._live():
            if peer.pidfd is not None:
                fds.append(peer.pidfd)
            if not holders or peer.index == holders[0] or peer.pidfd is None:
                fds.append(peer.wire.sock.fileno())  # without a pidfd, the socket is how death shows
        return fds

    def _break(self, why: str, index: int = -1) -> None:
        """A consumer is gone: tell the others, and fail from now on."""
        self._broken = why
        log.warning("channel %s broken: %s", self.handle.channel_id[:8], why)
        abort = _record(_ABORT, max(index, 0), self.step)
        for peer in self._live():
            if peer.index != index:
                peer.wire.send(abort)
        raise ChannelBrokenError(why)

    def _pump(self, woken: frozenset[int] = frozenset()) -> None:
        """Take in new consumers and every release that arrived; never blocks.
        ``woken``: the fds a wait found readable (a pidfd there: a process exited)."""
        self._check()
        hub = self._hub
        if len(self._peers) < self._consumers:
            hub.wake.clear()
            with hub.lock:
                self._peers.update(hub.peers)
        for peer in self._live():
            records, eof = peer.wire.read()
            self._messages(peer, records)
            if peer.left:
                continue
            if eof is not None:
                self._break(f"{peer.name()} {_why_gone(eof, peer.pidfd)} without leaving the channel", peer.index)
            if peer.pidfd in woken and _exited(peer.pidfd):
                self._messages(peer, peer.wire.read()[0])  # a leave it sent before exiting counts
                if not peer.left:
                    self._break(f"{peer.name()} exited without leaving the channel", peer.index)

    def _messages(self, peer: _Peer, records: list[tuple[int, int, int]]) -> None:
        malformed = peer.apply(records, self._busy, self._slot_step)
        if malformed is not None:
            self._break(malformed, peer.index)

    def _check_holders(self, slots: list[int]) -> None:
        """Fail when a consumer this wait needs has stopped answering."""
        now = time.monotonic()
        for index in sorted({i for s in slots for i in self._busy[s]}):
            peer = self._peers[index]
            why = peer.wire.frozen(now, peer.name(), peer.pid, peer.local)
            if why is not None:
                self._break(why, index)

    def _ready(self, slot: int) -> bool:
        return len(self._peers) == self._consumers and not self._busy[slot]

    def _waiting_for(self, slot: int) -> str:
        if len(self._peers) < self._consumers:
            return f"{self._consumers - len(self._peers)} of {self._consumers} consumers to join"
        names = ", ".join(self._peers[i].name() for i in sorted(self._busy[slot]))
        return f"{names} to release step {self._slot_step[slot]}"

    def _begin_acquire(self) -> int:
        self._check()
        if self._acquired is not None:
            raise InvalidInputError(f"slot {self._acquired} is acquired and not yet published; publish it first")
        return self.step % self._slots

    def acquire(self, timeout: float | None = None) -> Any:
        """Wait for the next slot to be free and return its array to fill.

        Parameters
        ----------
        timeout : float or None
            Seconds to wait; ``None`` waits as long as the consumers live.

        Returns
        -------
        numpy.ndarray or CudaArray
            The slot's memory, of the channel's shape and dtype (not zeroed:
            it holds an older step).  Publish it with :meth:`publish`.

        Raises
        ------
        WaitTimeoutError
            The consumers did not join, or did not release the slot, in time.
        ChannelBrokenError
            A consumer died, closed its connection without leaving, or
            stopped answering for ``GPUSHARE_PEER_TIMEOUT`` seconds (stopped,
            frozen, cut off), ``timeout=None`` included.
        """
        return _run(self._acquiring(timeout))

    async def acquire_async(self, timeout: float | None = None) -> Any:
        """:meth:`acquire` for asyncio: the event loop watches the connections."""
        return await _run_async(self._acquiring(timeout))

    def _acquiring(self, timeout: float | None) -> Any:
        slot = self._begin_acquire()
        deadline = _types.deadline(timeout)
        woken: frozenset[int] = frozenset()
        while True:
            self._pump(woken)
            if self._ready(slot):
                self._acquired = slot
                return self._arrays[slot]
            self._check_holders([slot])
            woken = yield self._fds(slot), _until(deadline)
            if not woken and _passed(deadline):
                self._pump()
                if self._ready(slot):
                    continue
                raise WaitTimeoutError(f"no free slot within {timeout} s: waiting for {self._waiting_for(slot)}")

    def publish(self) -> int:
        """Publish the acquired slot as the next step; returns its number.

        For CUDA memory, the caller must have finished writing (synchronize
        the stream that wrote the slot) before publishing.

        Raises
        ------
        InvalidInputError
            No slot is acquired.
        ChannelBrokenError
            A consumer is gone.
        """
        self._check()
        slot = self._acquired
        if slot is None:
            raise InvalidInputError("publish() needs a slot from acquire() first")
        self._acquired = None
        step = self.step
        self._slot_step[slot] = step
        live = self._live()
        self._busy[slot] = {p.index for p in live}
        message = _record(_PUBLISH, slot, step)
        for peer in live:
            if not peer.wire.send(message):
                self._break(f"{peer.name()} cannot be notified (it stopped reading, or its connection closed)",
                            peer.index)
        self.step += 1
        return step

    @contextlib.contextmanager
    def slot(self, timeout: float | None = None) -> Iterator[Any]:
        """``with producer.slot() as arr:`` acquire, fill, publish on a clean exit.

        An exception in the block publishes nothing; the slot is used for the
        next step instead.
        """
        arr = self.acquire(timeout)
        try:
            yield arr
        except BaseException:
            self._acquired = None
            raise
        self.publish()

    def send(self, data: Any, timeout: float | None = None) -> int:
        """Copy ``data`` (an array of the channel's shape) into the next slot and publish it.

        Parameters
        ----------
        data : array-like
            Host data for a host channel; for a CUDA channel, anything with
            ``__cuda_array_interface__`` or DLPack, or host data.
        timeout : float or None
            As for :meth:`acquire`.

        Returns
        -------
        int
            The step number.
        """
        return self._fill_and_publish(self.acquire(timeout), data)

    async def send_async(self, data: Any, timeout: float | None = None) -> int:
        """:meth:`send` for asyncio."""
        return self._fill_and_publish(await self.acquire_async(timeout), data)

    def _fill_and_publish(self, arr: Any, data: Any) -> int:
        try:
            _fill(arr, data)
        except BaseException:
            self._acquired = None  # nothing published: the slot serves the next step
            raise
        return self.publish()

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every consumer released every published step.

        Raises
        ------
        WaitTimeoutError
            Some step is still held after ``timeout`` seconds.
        ChannelBrokenError
            A consumer is gone.
        """
        _run(self._draining(timeout))

    async def drain_async(self, timeout: float | None = None) -> None:
        """:meth:`drain` for asyncio."""
        await _run_async(self._draining(timeout))

    def _draining(self, timeout: float | None) -> Any:
        self._check()
        deadline = _types.deadline(timeout)
        woken: frozenset[int] = frozenset()
        while True:
            self._pump(woken)
            held = [s for s in range(self._slots) if self._busy[s]]
            if not held:
                return
            self._check_holders(held)
            woken = yield self._fds(held[0]), _until(deadline)
            if not woken and _passed(deadline):
                raise WaitTimeoutError(f"the consumers did not release every step within {timeout} s: "
                                       f"waiting for {self._waiting_for(held[0])}")

    def close(self, timeout: float | None = 30.0, *, failed: bool = False) -> None:
        """End the channel: wait (up to ``timeout``) until the consumers
        released every step, tell them it ended, and free the slots.

        Consumers see the end after the last step (their iteration stops).
        Idempotent.  The channel is closed even when waiting fails; the error
        is raised after.

        Parameters
        ----------
        timeout : float or None
            Seconds to wait for the consumers; 0 does not wait.
        failed : bool
            The producer gives up on an error: consumers get
            :class:`ChannelBrokenError` instead of a normal end (leaving a
            ``with`` block on an exception does this).

        Raises
        ------
        WaitTimeoutError, ChannelBrokenError
            From waiting for the consumers (see :meth:`drain`).
        """
        if self._closed:
            return
        error: BaseException | None = None
        if self._broken is None and timeout != 0:
            try:
                self.drain(timeout)
            except (WaitTimeoutError, ChannelBrokenError) as exc:
                error = exc
        self._closed = True
        if self._broken is None:
            end = _record(_FAILED if failed else _END, 0, self.step)
            with self._hub.lock:
                self._peers.update(self._hub.peers)  # consumers that joined since hear of the end too
            for peer in self._live():
                peer.wire.send(end)
        self._arrays.clear()
        self._finalizer()
        log.info("channel %s closed after %d steps", self.handle.channel_id[:8], self.step)
        if error is not None:
            raise error

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            with contextlib.suppress(GpuShareError):
                self.close(timeout=0, failed=True)
    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else f"at step {self.step}")
        return (f"<gpushare.Producer {self.handle.channel_id[:8]} {self._slots} slots of {self._shape} "
                f"{self._typestr}, {state}>")


def _array_of(buf: Any, shape: tuple[int, ...], typestr: str, device: Any, *, readonly: bool = False) -> Any:
    """A typed array over the first bytes of ``buf``."""
    nbytes = nbytes_of(shape, typestr)
    if device == "host":
        import numpy as np

        mv = buf.memoryview() if hasattr(buf, "memoryview") else memoryview(buf)
        arr = np.frombuffer(mv, dtype=np.dtype(typestr), count=nbytes // int(typestr[2:])).reshape(shape)
        if readonly:
            arr.flags.writeable = False
        return arr
    return CudaArray._make(buf, int(buf.handle), shape, typestr, device, readonly)



def _fill(arr: Any, data: Any) -> None:
    if isinstance(arr, CudaArray):
        local = _buffers.resolve(data, writable=False, stream=_driver.LEGACY_STREAM)
        try:
            if local.nbytes != arr.nbytes:
                raise InvalidInputError(f"data is {local.nbytes} bytes; a step is {arr.nbytes}")
            _copies.copy_async(arr.ptr, local.address, arr.nbytes, ordinal=arr.device, stream=None,
                               producer=local.stream, keep=local, what="copy into a channel slot").wait(60.0)
        except BaseException:
            local.release()
            raise
        return
    import numpy as np

    src = np.asarray(data)
    if src.shape != arr.shape:
        raise InvalidInputError(f"data has shape {src.shape}; the channel carries {arr.shape}")
    np.copyto(arr, src, casting="same_kind")
