"""Run the sharing-API examples as users would, each in its own interpreter."""

from __future__ import annotations

import os
import re
import secrets
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


def test_training_exchange_cross_node_commands_set_a_key():
    # The producer and the consumers are separate programs: without one key
    # in GPUSHARE_AUTHKEY their opens are refused.
    doc = (EXAMPLES / "training_exchange.py").read_text().split('"""')[1]
    commands = [line.strip() for line in doc.splitlines() if "training_exchange.py --role" in line]
    assert len(commands) == 2
    assert all(c.startswith("GPUSHARE_AUTHKEY=$(cat ~/.gpushare-key) python ") for c in commands), commands


def _producer_and_consumer(env: dict[str, str]) -> tuple[str, str]:
    """The two roles of training_exchange.py as separate programs, the
    handle passed on as the docstring's handle.txt passes it; returns what
    each printed."""
    script = str(EXAMPLES / "training_exchange.py")
    with subprocess.Popen([sys.executable, script, "--role", "producer", "--consumers", "1", "--steps", "5"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as producer:
        assert producer.stdout is not None
        handle = producer.stdout.readline()
        consumer = subprocess.run([sys.executable, script, "--role", "consumer", "--steps", "5"], input=handle,
                                  capture_output=True, text=True, env=env, timeout=120, check=False)
        if consumer.returncode != 0:
            producer.kill()  # it would wait for a consumer that is not coming
        out, err = producer.communicate(timeout=120)
    return consumer.stdout + consumer.stderr, out + err


def test_training_exchange_separate_programs_with_a_common_key():
    env = {k: v for k, v in os.environ.items() if k != "GPUSHARE_AUTHKEY"}
    consumer, producer = _producer_and_consumer({**env, "GPUSHARE_AUTHKEY": secrets.token_hex(32)})
    assert "consumer 0: 5 steps, 0 wrong, via host-fd, zero-copy True" in consumer
    assert consumer.strip().endswith("ok"), consumer
    assert "producer: 5 steps of (256, 1024) float32 on 1 consumers" in producer
    assert producer.strip().endswith("ok"), producer


def test_training_exchange_separate_programs_without_a_key_are_refused():
    env = {k: v for k, v in os.environ.items() if k != "GPUSHARE_AUTHKEY"}
    consumer, _ = _producer_and_consumer(env)
    assert "AccessDeniedError" in consumer
    assert "GPUSHARE_AUTHKEY" in consumer


def test_weight_sync_reads_every_version_with_one_open():
    out = run_example("weight_sync.py", "--steps", "30")
    assert "inference: opened 31 tensors in 2 allocations over host-fd" in out
    assert "trainer: 30 steps of 29 tensors" in out and "exported once" in out
    assert "inference: 30 versions read, 0 wrong tensors" in out


@pytest.mark.gpu
@pytest.mark.kernels
def test_weight_sync_with_weights_in_cuda_memory():
    pytest.importorskip("cupy", reason="the CUDA variant needs cupy (pip install 'gpushare[cupy]')")
    out = run_example("weight_sync.py", "--steps", "10", "--cuda")
    assert "inference: opened 31 tensors in 2 allocations over host-fd, posix-fd" in out
    assert "inference: 10 versions read, 0 wrong tensors" in out
