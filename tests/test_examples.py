"""Run the sharing-API examples as users would, each in its own interpreter."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str, timeout: float = 120) -> str:
    r = subprocess.run([sys.executable, str(EXAMPLES / name), *args],
                       check=False, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"exit status {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert r.stdout.strip().endswith("ok"), r.stdout + r.stderr
    assert "example failed" not in r.stdout
    return r.stdout


def test_share_arrays_host_memory():
    # --host: the NumPy variant, which is also what runs without CuPy or a GPU.
    out = run_example("share_arrays.py", "--host")
    assert "exporter: arrays are numpy" in out
    assert "importer: allocated: path=host-fd" in out
    assert "importer: plain: path=cma" in out
    assert re.search(r"importer: plain: why=cma: .*not host-fd: not offered", out)
    assert out.count("match=True") == 2
    assert out.count("sees the importer's writes: True") == 2


@pytest.mark.gpu
@pytest.mark.kernels
def test_share_arrays_cupy():
    pytest.importorskip("cupy", reason="the CuPy variant needs cupy (pip install cupy-cuda12x or similar)")
    out = run_example("share_arrays.py")
    assert "exporter: arrays are cupy" in out
    assert "importer: allocated: path=posix-fd" in out
    assert "importer: plain: path=cuda-ipc" in out
    assert out.count("sees the importer's writes: True") == 2


def test_multiprocessing_pool_and_queue():
    out = run_example("multiprocessing_pool_queue.py")
    assert out.count("input via host-fd, output via cma, checksum ok") == 8
    assert "pool: parent sees every chunk doubled: True" in out
    for k in range(3):
        assert f"queue: item{k} via cma: consumer read it: True, parent sees its write: True" in out


def test_torch_distributed_exchange():
    pytest.importorskip("torch", reason="torch is not a dependency of gpushare; pip install torch to run this example")
    out = run_example("torch_distributed.py", "--world-size", "2", "--cpu", timeout=180)
    assert "2 ranks, backend gloo, host memory" in out
    for rank, owner in ((0, 1), (1, 0)):
        assert (f"rank {rank}: allocated of rank {owner} via host-fd: slot ok: True, "
                "zero-copy read ok: True") in out
        assert f"rank {rank}: tensor of rank {owner} via cma: slot ok: True" in out
        for name in ("allocated", "tensor"):
            assert f"rank {rank}: {name}: all 2 slots filled: True" in out


def test_training_exchange_one_producer_three_consumers():
    out = run_example("training_exchange.py", "--steps", "100", "--consumers", "3")
    assert "producer: 100 steps of (256, 1024) float32 on 3 consumers, start method spawn" in out
    for k in range(3):
        assert f"consumer {k}: 100 steps, 0 wrong, via host-fd, zero-copy True" in out
