"""examples/ray_weight_sync.py, run as users would (each in its own interpreter, with a local Ray)."""

from __future__ import annotations

import re

import pytest
from test_examples import run_example

pytest.importorskip("torch", reason="torch is an optional extra: the Ray example carries torch tensors: pip install torch")
pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'gpushare[ray]'")


def _median_ms(out: str) -> float:
    found = re.search(r"median (\d+\.\d+) ms", out)
    assert found, out
    return float(found.group(1))


def test_ray_weight_sync_over_gpushare_memory():
    out = run_example("ray_weight_sync.py", "--steps", "10", timeout=240)
    assert ("trainer: 10 steps of 29 tensors (918528 bytes), exported 10 times as one bundle each, revoked 10, "
            "0 left") in out
    assert "inference: 10 versions received (host-fd 290 tensors; 290 copied, 0 zero-copy), 0 wrong tensors" in out
    assert _median_ms(out) > 0


def test_ray_weight_sync_plain_torch_tensors_zero_copy_requested():
    # torch's own memory goes over cma, which maps nothing: copied even when zero-copy is asked for
    out = run_example("ray_weight_sync.py", "--steps", "5", "--plain", "--zero-copy", timeout=240)
    assert "exported 5 times as one bundle each, revoked 5, 0 left" in out
    assert "inference: 5 versions received (cma 145 tensors; 145 copied, 0 zero-copy), 0 wrong tensors" in out


def test_ray_weight_sync_plain_with_more_tensors_than_one_connection_queues():
    # 281 tensors a version, each an allocation of its own (torch's): more than the 64 cma copies one
    # connection may queue, which failed every get before copies went in paced batches
    out = run_example("ray_weight_sync.py", "--steps", "3", "--plain", "--layers", "40", timeout=240)
    assert "trainer: 3 steps of 281 tensors" in out and "revoked 3, 0 left" in out
    assert "inference: 3 versions received (cma 843 tensors; 843 copied, 0 zero-copy), 0 wrong tensors" in out
