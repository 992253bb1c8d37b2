"""Run helper processes for tests: spawn start method, timeouts, tracebacks home."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import threading
import time
import traceback
from typing import Any, Callable, NoReturn

CTX = mp.get_context("spawn")


class ChildError(RuntimeError):
    """A command failed in the child with an exception that does not survive
    pickling; the message holds its traceback."""


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


def _serve(conn: Any, setup: Callable[..., dict], args: tuple) -> None:
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
        self.conn, child_conn = CTX.Pipe()
        self.proc = CTX.Process(target=_serve, args=(child_conn, setup, args), daemon=True)
        self.proc.start()
        child_conn.close()
        self.hello = self._reply(timeout)

    def _reply(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"child {self.proc.pid} did not answer within {timeout} s")
        status, value = self.conn.recv()
        if status == "error":
            _raise(value)
        return value

    def call(self, cmd: str, *args: Any, timeout: float = 60.0) -> Any:
        self.conn.send((cmd, args))
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
