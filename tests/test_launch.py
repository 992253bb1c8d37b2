"""Keys for launchers: torchrun ranks, separate programs, agree on one key
over their process group (gs.set_authkey_from_process_group)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "torchrun_share.py"
NO_TORCH = "torch is not a dependency of gpushare; pip install torch (CI installs the CPU build) to run torchrun"
# Looked up, not imported: torch must not load in a process where UCX may be
# loaded already (docs/ucx.md); every test runs torch in a process of its own.
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason=NO_TORCH)


def torchrun(*args: str, fails: bool = False) -> str:
    """The example's output under torchrun, which exits 0, or non-zero where it ``fails``."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(EXAMPLE), *args], check=False, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert (r.returncode != 0) == fails, f"exit status {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=False, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


@needs_torch
def test_torchrun_ranks_share_with_the_key_they_agreed_on():
    out = torchrun()
    assert "rank 1: array of rank 0 via host-fd: bytes match: True" in out
    assert "rank 1: tensor of rank 0 via cma: bytes match: True" in out
    assert out.strip().endswith("2 ranks: ok"), out


@needs_torch
def test_torchrun_ranks_without_a_common_key_are_refused():
    # What the key step is for: each rank is its own program, with its own
    # multiprocessing authkey, so the exporter cannot prove it holds the key.
    out = torchrun("--without-key", fails=True)
    assert "rank 1: array of rank 0 refused" in out
    assert "could not prove it holds this process's key" in out
    assert "bytes match" not in out
    assert "2 ranks: example failed" in out


@needs_torch
def test_the_key_is_fresh_random_and_stays_out_of_the_environment(tmp_path):
    r = python(f"""
        import multiprocessing, os
        import torch
        import torch.distributed as dist
        import gpushare as gs
        from gpushare import _auth
        keys = []
        for attempt in range(2):
            dist.init_process_group("gloo", init_method="file://{tmp_path}/store" + str(attempt), rank=0,
                                    world_size=1)
            gs.set_authkey_from_process_group()
            keys.append(_auth.key())
            dist.destroy_process_group()
        assert all(len(k) == 32 for k in keys), keys
        assert keys[0] != keys[1]
        assert bytes(multiprocessing.current_process().authkey) not in keys
        assert "GPUSHARE_AUTHKEY" not in os.environ
        print("fresh")
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["fresh"]


@needs_torch
def test_without_a_process_group_it_says_what_to_do():
    r = python("""
        import torch
        import gpushare as gs
        try:
            gs.set_authkey_from_process_group()
        except gs.InvalidInputError as exc:
            print(exc)
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no torch.distributed process group is initialized" in r.stdout
    assert "init_process_group" in r.stdout


def test_gpushare_does_not_import_torch():
    r = python("""
        import sys
        import gpushare as gs
        gs.set_authkey_from_process_group  # the attribute is there without torch
        print("torch" in sys.modules)
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["False"]
