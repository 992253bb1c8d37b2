"""The ``gpu`` tests that need no kernels, run against the CUDA driver
stand-in on every run of the suite, so that a broken GPU test shows before
a GPU is lent.

A contract check of the GPU tests (and of gpushare's side of the driver's
contract), never GPU verification: the stand-in runs no kernel, so the
tests marked ``kernels`` skip there, and only a run on a GPU says that the
code works on one.  The tests run in a pytest subprocess that loads the
stand-in (``LD_LIBRARY_PATH``) with ``GPUSHARE_TEST_STANDIN_GPU=1``, under
which ``cuda_device_reason()`` takes the stand-in for the device; this
process never loads it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
from conftest import STANDIN_GPU_ENV, standin_env, standin_gpu_run

pytestmark = [pytest.mark.cudadriver, pytest.mark.timeout(420)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: How many kernel-free gpu tests there are (parametrised cases counted):
#: fewer passing means some were skipped or never collected.
KERNEL_FREE_GPU_TESTS = 25


def _counts(summary: str) -> dict[str, int]:
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)", summary)}


@pytest.mark.skipif(standin_gpu_run(), reason="already inside the run against the stand-in")
def test_kernel_free_gpu_tests_pass_against_the_stand_in(standin_lib):
    # Two devices (the stand-in's default), so the tests that need two run
    # too; no fabric knob: fabric allocations are refused as on one H200.
    env = standin_env(standin_lib, GPUSHARE_STANDIN_DEVICES="2", **{STANDIN_GPU_ENV: "1"})
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "tests", "-m", "gpu and not kernels", "-p", "no:cacheprovider",
         "-q", "-rfEs", "--timeout", "240"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400, stdin=subprocess.DEVNULL,
    )
    took = time.monotonic() - t0
    out = f"--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    lines = [line for line in r.stdout.splitlines() if re.search(r"\d+ (passed|failed|skipped|deselected)", line)]
    counts = _counts(lines[-1] if lines else "")
    assert r.returncode == 0, f"the gpu tests failed against the stand-in (exit {r.returncode}, {took:.0f} s)\n{out}"
    assert counts.get("failed", 0) == 0 and counts.get("error", 0) == 0 and counts.get("errors", 0) == 0, out
    # A module that needs an optional extra this Python lacks (torch) skips when it is collected,
    # whatever the marker: that is no gpu test skipped.
    optional = sum(int(n) for n in re.findall(r"^SKIPPED \[(\d+)\] [^\n]*: [^\n]* is an optional extra", r.stdout,
                                              re.MULTILINE))
    assert counts.get("skipped", 0) == optional, f"kernel-free gpu tests skipped against the stand-in\n{out}"
    assert counts.get("passed", 0) >= KERNEL_FREE_GPU_TESTS, (
        f"{counts.get('passed', 0)} kernel-free gpu tests passed, expected {KERNEL_FREE_GPU_TESTS}\n{out}")
    with open("/proc/self/maps") as maps:
        assert standin_lib not in maps.read()  # this process never loaded the stand-in
