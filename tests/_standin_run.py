"""What the tests of the CUDA driver stand-in share: a fixture that runs code
in a child process loading the stand-in, with its helpers imported."""

from __future__ import annotations

import os
import textwrap

import pytest

HEADER = (
    "import sys, os; sys.path.insert(0, os.path.join({tests!r}, 'cudadriver'))\n"
    "from standin_child import *\n"
)


@pytest.fixture
def run(run_standin):
    tests = os.path.dirname(os.path.abspath(__file__))

    def go(code: str, **env: str | None) -> str:
        return run_standin(HEADER.format(tests=tests) + textwrap.dedent(code), **env)

    return go


def lines(out: str) -> list[str]:
    return out.strip().splitlines()
