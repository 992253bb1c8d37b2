"""Run the sharing-API examples as users would, each in its own interpreter."""

from __future__ import annotations

import ast
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


def _producer_and_consumer(env: dict[str, str], steps: int = 5, expected: int = 5) -> tuple[str, str, list[int]]:
    """The two roles of training_exchange.py as separate programs, the
    handle passed on as the docstring's handle.txt passes it (the producer
    publishes ``steps``, the consumer expects ``expected``); returns what
    each printed, and their exit statuses (consumer, producer)."""
    script = str(EXAMPLES / "training_exchange.py")
    with subprocess.Popen([sys.executable, script, "--role", "producer", "--consumers", "1", "--steps", str(steps)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as producer:
        assert producer.stdout is not None
        handle = producer.stdout.readline()
        consumer = subprocess.run([sys.executable, script, "--role", "consumer", "--steps", str(expected)],
                                  input=handle, capture_output=True, text=True, env=env, timeout=120, check=False)
        if consumer.returncode != 0 and "AccessDeniedError" in consumer.stderr:
            producer.kill()  # it would wait for a consumer that is not coming
        out, err = producer.communicate(timeout=120)
    return consumer.stdout + consumer.stderr, out + err, [consumer.returncode, producer.returncode]


def test_training_exchange_separate_programs_with_a_common_key():
    env = {k: v for k, v in os.environ.items() if k != "GPUSHARE_AUTHKEY"}
    consumer, producer, statuses = _producer_and_consumer({**env, "GPUSHARE_AUTHKEY": secrets.token_hex(32)})
    assert "consumer 0: 5 steps, 0 wrong, via host-fd, zero-copy True" in consumer
    assert consumer.strip().endswith("ok"), consumer
    assert statuses == [0, 0]
    assert "producer: 5 steps of (256, 1024) float32 on 1 consumers" in producer
    assert producer.strip().endswith("ok"), producer


def test_training_exchange_separate_programs_without_a_key_are_refused():
    env = {k: v for k, v in os.environ.items() if k != "GPUSHARE_AUTHKEY"}
    consumer, _, statuses = _producer_and_consumer(env)
    assert "AccessDeniedError" in consumer
    assert "GPUSHARE_AUTHKEY" in consumer
    assert statuses[0] != 0


def test_weight_sync_reads_every_version_with_one_open():
    out = run_example("weight_sync.py", "--steps", "30")
    assert "inference: opened 31 tensors in 2 allocations over host-fd" in out
    assert "trainer: 30 steps of 29 tensors" in out and "exported once" in out
    assert "inference: 30 versions read, 0 wrong tensors" in out
    assert re.search(r"inference: an update of 918528 bytes read in [\d.]+ ms \(median of 30, [\d.]+-[\d.]+\): "
                     r"[\d.]+ GB/s", out), out


@pytest.mark.gpu
@pytest.mark.kernels
def test_weight_sync_with_weights_in_cuda_memory():
    pytest.importorskip("cupy", reason="the CUDA variant needs cupy (pip install 'gpushare[cupy]')")
    out = run_example("weight_sync.py", "--steps", "10", "--cuda")
    assert "inference: opened 31 tensors in 2 allocations over host-fd, posix-fd" in out
    assert "inference: 10 versions read, 0 wrong tensors" in out


# ---------------------------------------------------------------- failures exit non-zero


def test_torchrun_share_without_a_key_fails_with_a_non_zero_status():
    # The ranks are separate programs: without the key step rank 1's opens
    # are refused, and the example must say so *and* fail (torchrun then
    # reports the failed ranks).
    pytest.importorskip("torch", reason="torch is not a dependency of gpushare; pip install torch to run this example")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLES / "torchrun_share.py")]
    failed = subprocess.run([*cmd, "--without-key"], check=False, capture_output=True, text=True, timeout=180)
    assert "refused" in failed.stdout and "example failed" in failed.stdout, failed.stdout + failed.stderr
    assert failed.returncode != 0, failed.stdout + failed.stderr
    good = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=180)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "2 ranks: ok" in good.stdout and good.stdout.count("bytes match: True") == 2, good.stdout


def test_training_exchange_consumer_that_sees_too_few_steps_fails_with_a_non_zero_status():
    # The consumer expects 5 steps; the producer publishes 3 and ends the channel.
    consumer, producer, statuses = _producer_and_consumer(
        {**os.environ, "GPUSHARE_AUTHKEY": secrets.token_hex(32)}, steps=3, expected=5)
    assert "consumer 0: 3 steps, 0 wrong" in consumer, consumer
    assert consumer.strip().endswith("example failed")
    assert statuses == [1, 0], (statuses, consumer, producer)


def _says_failed(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and "failed" in n.value.lower()
               for n in ast.walk(node))


def _is_exit_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "exit"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "sys")


def _zero(node: ast.AST | None) -> bool:
    return node is None or (isinstance(node, ast.Constant) and node.value in (0, None, False))


def _ends(stmt: ast.stmt) -> bool | None:
    """Whether ``stmt`` ends the function or program with a failure status
    (True), with success (False), or does not end it (None)."""
    if isinstance(stmt, ast.Return):
        return not _zero(stmt.value)
    if isinstance(stmt, ast.Raise):
        exc = stmt.exc
        if isinstance(exc, ast.Call) and isinstance(exc.func, ast.Name) and exc.func.id == "SystemExit":
            return bool(exc.args) and not _zero(exc.args[0])
        return True
    if isinstance(stmt, ast.Expr) and _is_exit_call(stmt.value):
        return bool(stmt.value.args) and not _zero(stmt.value.args[0])
    return None


def _failure_paths(tree: ast.Module) -> list[tuple[int, bool]]:
    """(line, exits non-zero) for each statement that reports a failure:
    a print of "... failed ...", or a SystemExit/sys.exit/return carrying it.
    What follows a print is read in order, up through the enclosing blocks,
    to the first return, raise or sys.exit; falling off the end of the
    function (None: status 0) is a failure path that exits zero."""
    parent: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parent[child] = node
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt) or isinstance(node, (ast.FunctionDef, ast.If, ast.For, ast.While,
                                                                ast.With, ast.Try, ast.ClassDef)):
            continue
        if _ends(node) is not None and _says_failed(node):
            found.append((node.lineno, bool(_ends(node))))
            continue
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id == "print"
                and _says_failed(node)):
            continue
        stmt: ast.AST = node
        verdict = False  # off the end of the function
        while not isinstance(stmt, (ast.FunctionDef, ast.Module)):
            up = parent[stmt]
            block = next(b for b in (getattr(up, f, None) for f in ("body", "orelse", "finalbody", "handlers"))
                         if isinstance(b, list) and stmt in b)
            ends = [e for e in (_ends(s) for s in block[block.index(stmt) + 1:]) if e is not None]
            if ends:
                verdict = ends[0]
                break
            stmt = up
        found.append((node.lineno, verdict))
    return found


def _main_status_reaches_the_exit(tree: ast.Module) -> list[str]:
    """Functions annotated ``-> int`` called under ``if __name__ == "__main__"``
    whose result is not the program's exit status."""
    returns_int = {f.name for f in tree.body if isinstance(f, ast.FunctionDef)
                   and isinstance(f.returns, ast.Name) and f.returns.id == "int"}
    wrong = []
    for stmt in tree.body:
        if not (isinstance(stmt, ast.If) and "__main__" in ast.unparse(stmt.test)):
            continue
        for node in ast.walk(stmt):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) \
                    and isinstance(node.value.func, ast.Name) and node.value.func.id in returns_int:
                wrong.append(f"line {node.lineno}: {node.value.func.id}()'s status is dropped")
    return wrong


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_failure_path_of_every_example_exits_non_zero(name):
    tree = ast.parse((EXAMPLES / name).read_text())
    paths = _failure_paths(tree)
    assert paths, f"{name} reports no failure: an example checks its outcome and says 'example failed'"
    zero = [line for line, non_zero in paths if not non_zero]
    assert not zero, f"{name}: a failure reported at line(s) {zero} ends with exit status 0"
    assert not _main_status_reaches_the_exit(tree), _main_status_reaches_the_exit(tree)


def test_the_failure_path_check_finds_a_failure_that_exits_zero():
    # The check itself: the forms the examples had before they were fixed.
    before = ast.parse(
        "def main() -> int:\n"
        "    if rank == 0:\n"
        "        print('ok' if ok else 'example failed')\n"
        "    cleanup()\n"
        "    return 0\n"
        "def consumer() -> int:\n"
        "    print('example failed')\n"
        "def child():\n"
        "    print('example failed')\n"
        "    raise SystemExit(0)\n"
        "if __name__ == '__main__':\n"
        "    main()\n"
    )
    assert [v for _, v in _failure_paths(before)] == [False, False, False]
    assert _main_status_reaches_the_exit(before) == ["line 12: main()'s status is dropped"]
    after = ast.parse(
        "import sys\n"
        "def main() -> int:\n"
        "    print('ok' if ok else 'example failed')\n"
        "    return 0 if ok else 1\n"
        "def child():\n"
        "    if bad:\n"
        "        print('example failed')\n"
        "        sys.exit(1)\n"
        "    raise SystemExit('example failed: data did not match')\n"
        "if __name__ == '__main__':\n"
        "    sys.exit(main())\n"
    )
    assert [v for _, v in _failure_paths(after)] == [True, True, True]
    assert _main_status_reaches_the_exit(after) == []
