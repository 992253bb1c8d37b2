"""Run helper processes for tests: spawn start method, timeouts, tracebacks home."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, NoReturn

CTX = mp.get_context("spawn")


class ChildError(RuntimeError):
    """A command failed in the child with an exception that does not survive
    pickling; the message holds its traceback."""


class ChildDied(ChildError):
    """The child process died (a signal, an exit) while a command was asked of
    it; the message names how, with the end of what it wrote to stderr."""


def _error(exc: BaseException) -> tuple[bytes | None, str]:
    """What the child sends home for ``exc``: the pickled exception when it
    unpickles to the same type, and its traceback."""
    tb = traceback.format_exc()
    try:
        blob = pickle.dumps(exc)
        if type(pickle.loads(blob)) is not type(exc):
            blob = None
    except Exception:  # noqa: BLE001 - an exception that does not pickle goes home as text
        blob = None
    return blob, tb


def _raise(value: tuple[bytes | None, str]) -> NoReturn:
    """Raise the child's exception here, as its own type where it pickles
    (so tests name the type they expect), with the child's traceback as a note."""
    blob, tb = value
    if blob is not None:
        exc = pickle.loads(blob)
        exc.add_note(f"raised in the child:\n{tb}")
        raise exc
    raise ChildError(tb)


def _serve(conn: Any, setup: Callable[..., dict], args: tuple, stderr_path: str | None = None) -> None:
    if stderr_path is not None:  # the parent reads it when this process dies, and echoes it at close
        fd = os.open(stderr_path, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
    try:
        state = setup(*args)
    except BaseException as exc:
        conn.send(("error", _error(exc)))
        return
    conn.send(("ok", state.pop("_reply", None)))
    while True:
        try:
            cmd, payload = conn.recv()
        except EOFError:
            return
        if cmd == "exit":
            conn.send(("ok", None))
            return
        try:
            result = state["_handlers"][cmd](state, *payload)
            conn.send(("ok", result))
        except BaseException as exc:
            conn.send(("error", _error(exc)))


class Child:
    """A spawned process that runs ``setup(*args)`` then serves commands.

    ``setup`` returns a dict with ``_handlers`` (name -> fn(state, *args)) and
    ``_reply`` (sent back once, available as ``Child.hello``).
    """

    def __init__(self, setup: Callable[..., dict], *args: Any, timeout: float = 60.0) -> None:
        fd, self._stderr = tempfile.mkstemp(prefix="gpushare-child-", suffix=".stderr")
        os.close(fd)
        self.conn, child_conn = CTX.Pipe()
        self.proc = CTX.Process(target=_serve, args=(child_conn, setup, args, self._stderr), daemon=True)
        self.proc.start()
        child_conn.close()
        self.hello = self._reply(timeout)

    def stderr(self) -> str:
        """What the child wrote to stderr so far."""
        try:
            with open(self._stderr, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def _died(self) -> ChildDied:
        self.proc.join(5)
        code = self.proc.exitcode
        if code is None:
            how = "closed its end of the pipe and still runs"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        tail = self.stderr()[-3000:]
        return ChildDied(f"the child process {self.proc.pid} {how}" + (f"; its stderr ends:\n{tail}" if tail else
                                                                       "; it wrote nothing to stderr"))

    def _reply(self, timeout: float) -> Any:
        try:
            if not self.conn.poll(timeout):
                raise TimeoutError(f"child {self.proc.pid} did not answer within {timeout} s")
            status, value = self.conn.recv()
        except (EOFError, ConnectionError) as exc:
            raise self._died() from exc
        if status == "error":
            _raise(value)
        return value

    def call(self, cmd: str, *args: Any, timeout: float = 60.0) -> Any:
        try:
            self.conn.send((cmd, args))
        except (BrokenPipeError, ConnectionError) as exc:
            raise self._died() from exc
        return self._reply(timeout)

    def close(self, timeout: float = 10.0) -> int | None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit", ()))
                self.conn.poll(timeout)
            except (BrokenPipeError, OSError):
                pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()
        text = self.stderr()
        if text:  # shown with the test's own captured output
            sys.stderr.write(text)
        try:
            os.unlink(self._stderr)
        except OSError:
            pass
        return self.proc.exitcode


def in_thread(fn: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Run ``fn`` in a new thread (one with no CUDA context current) and
    return its result or raise its exception here."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - carried back to the caller
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"the thread did not finish within {timeout} s")
    if errors:
        raise errors[0]
    return result[0]
def in_threads(fns: list[Callable[[], Any]], timeout: float = 60.0) -> list[BaseException]:
    """Run each of ``fns`` in a thread of its own, all at once; return what they raised
    (TimeoutError if one is still running after ``timeout`` seconds)."""
    errors: list[BaseException] = []

    def run(fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - carried back to the caller
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a thread did not finish within {timeout} s")
    return errors


def wait_for(cond: Callable[[], Any], timeout: float = 20.0) -> Any:
    """Poll ``cond()`` until it is true or ``timeout`` passes; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def idle_cpu_seconds(seconds: float) -> float:
    """CPU seconds this whole process (every thread) used while it slept ``seconds``."""
    t0 = time.process_time()  # every thread, nanosecond resolution
    time.sleep(seconds)
    return time.process_time() - t0


def idle_cpu(state: dict, seconds: float) -> float:
    """The ``idle_cpu`` command of the peer processes: :func:`idle_cpu_seconds`."""
    return idle_cpu_seconds(seconds)


class Box:
    """A weak-referenceable holder of a NumPy array (for lifetime checks)."""

    def __init__(self, n: int) -> None:
        import numpy as np

        self.a = np.arange(n, dtype=np.uint64).astype(np.uint8)

    @property
    def __array_interface__(self) -> dict:
        return self.a.__array_interface__
