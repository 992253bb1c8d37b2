"""Consumer processes of the channel tests (importable, so spawn can run them)."""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

import numpy as np

import gpushare as gs


def expected(step: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    n = int(np.prod(shape))
    return ((np.arange(n) * 7 + step) % 251).astype(dtype).reshape(shape)


def consume(handle: gs.ChannelHandle, results: Any, hold: float = 0.0) -> None:
    """Read every step; report (index, steps, checks, paths, zero_copy, pid)."""
    try:
        with gs.subscribe(handle, timeout=30) as ch:
            steps, bad = [], []
            for step in ch:
                x = step.array
                if (x.dtype != np.dtype(handle.typestr) or x.shape != handle.shape
                        or not np.array_equal(x, expected(step.step, handle.shape, x.dtype))):
                    bad.append(step.step)
                if x.flags.writeable:
                    bad.append("writeable")
                steps.append(step.step)
                if hold:
                    time.sleep(hold)  # a slow consumer: the producer must wait for it
            results.put(("ok", ch.index, steps, bad, ch.paths, ch.zero_copy, os.getpid()))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def join_and_hold(handle: gs.ChannelHandle, results: Any, die: bool) -> None:
    """Take the first step, report, then die (or wait) without releasing."""
    try:
        ch = gs.subscribe(handle, timeout=30)
        step = ch.wait(timeout=30)
        results.put(("holding", ch.index, step.step, os.getpid()))
        if die:
            results.close()
            results.join_thread()  # the report is out before the process dies
            os._exit(3)  # no close, no leave: as if killed
        try:
            ch.wait(timeout=60)
            results.put(("unexpected", "a second step arrived"))
        except gs.GpuShareError as exc:
            results.put(("raised", type(exc).__name__, str(exc)))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def wait_for_ever(handle: gs.ChannelHandle, results: Any) -> None:
    """Join, then wait with no timeout for a step that never comes."""
    try:
        ch = gs.subscribe(handle, timeout=30)
        results.put(("joined", ch.index))
        t0 = time.monotonic()
        try:
            ch.wait()
            results.put(("unexpected", "a step arrived"))
        except gs.GpuShareError as exc:
            results.put(("raised", type(exc).__name__, str(exc), time.monotonic() - t0))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def produce_then_die(results: Any, steps: int) -> None:
    """A producer that publishes ``steps`` steps and exits without closing."""
    try:
        producer = gs.channel((8,), np.int64, consumers=1, slots=4)
        results.put(("handle", producer.handle))
        for t in range(steps):
            producer.send(np.full(8, t, np.int64), timeout=30)
        results.put(("published", steps))
        results.close()
        results.join_thread()
        os._exit(0)
    except BaseException:
        results.put(("error", traceback.format_exc()))


def produce_pausing_then_stay(results: Any, pause: float) -> None:
    """A producer that publishes step 0, is busy for ``pause`` seconds (in no
    wait), publishes step 1, then stays alive without waiting."""
    try:
        producer = gs.channel((8,), np.int64, consumers=1, slots=4)
        results.put(("handle", producer.handle))
        producer.send(np.full(8, 0, np.int64), timeout=30)
        time.sleep(pause)
        producer.send(np.full(8, 1, np.int64), timeout=30)
        results.put(("published", 2))
        time.sleep(120)  # the test stops (SIGSTOP) and then kills this process
    except BaseException:
        results.put(("error", traceback.format_exc()))
