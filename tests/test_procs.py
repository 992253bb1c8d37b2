"""The suite's helper processes: a dead one is reported, with how it died and its stderr."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from _procs import Child, ChildDied


def _setup() -> dict:
    def crash(state: dict, how: str) -> None:
        sys.stderr.write(f"about to die by {how}\n")
        sys.stderr.flush()
        if how == "abort":
            os.abort()
        os._exit(3)

    return {"_handlers": {"crash": crash, "pid": lambda state: os.getpid()}}


@pytest.mark.parametrize("how, said", [("abort", "was killed by SIGABRT"), ("exit", "exited with status 3")])
def test_a_child_that_dies_mid_command_is_reported_with_its_signal_and_stderr(how, said):
    child = Child(_setup)
    with pytest.raises(ChildDied, match=said) as info:
        child.call("crash", how)
    assert f"about to die by {how}" in str(info.value)
    child.close()


def test_a_child_killed_between_commands_is_reported_at_the_next():
    child = Child(_setup)
    pid = child.call("pid")
    os.kill(pid, signal.SIGKILL)
    child.proc.join(10)
    with pytest.raises(ChildDied, match=f"the child process {pid} was killed by SIGKILL; it wrote nothing"):
        child.call("pid")
    assert child.close() == -signal.SIGKILL
