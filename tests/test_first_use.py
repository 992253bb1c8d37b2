"""First use of CUDA memory costs what the driver costs: the first export
and the first open of a CUDA array load no cuda.core (whose import alone
took 291 ms of a 298 ms first export on an H200).  Against the CUDA driver
stand-in: ``benchmarks/bench_first.py --cuda`` is run and its targets read
(a CuPy-style array over cuda-ipc, a ``gs.allocate`` buffer over posix-fd;
an exportable pool's memory over cuda-ipc too, whose exporter has loaded
cuda.core to make it),
and the modules a first export and a first open import, beyond ``import
gpushare`` and the CUDA context, are listed with ``-X importtime`` and held
to a budget.  (A contract check of what is loaded; the GPU check runs the
benchmark on a GPU.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import standin_env

pytestmark = pytest.mark.cudadriver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Packages the first export and the first open of CUDA memory must not load.
NOT_ON_THE_WAY = ("cuda.core", "torch", "cupy", "ucxx", "libucxx", "gpushare._ucx._native")
#: What the modules they do load may cost to import (cumulative, microseconds): a tenth of
#: cuda.core's import on this kind of machine.
IMPORT_BUDGET_US = 30_000

_FIRST_USE = """
import os, sys, time
import gpushare as gs
from gpushare._cuda import _driver

drv = _driver.driver()
with _driver.on_device(0):
    ptr = int(_driver.check(drv.cuMemAlloc(1 << 20), "cuMemAlloc"))

class Cai:
    def __init__(self, p, n):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (p, False), "version": 3,
                                         "strides": None, "stream": None}

def pool_memory():
    # An exportable stream-ordered pool's memory, made with cuda.core before the clock (the
    # exporter's user has it loaded anyway); the importer's open must not need it.
    from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions

    dev = Device(0)
    dev.set_current()
    mr = DeviceMemoryResource(dev, options=DeviceMemoryResourceOptions(ipc_enabled=True, max_size=64 << 20))
    stream = dev.create_stream()
    buf = mr.allocate(1 << 20, stream=stream)
    stream.sync()
    return buf, (mr, stream)

if sys.argv[1].startswith("export"):
    if sys.argv[1] == "export-pool":
        obj, keep = pool_memory()
    else:
        obj = gs.allocate(2 << 20, device=0) if sys.argv[1] == "export-allocate" else Cai(ptr, 1 << 20)
    sys.stderr.write("--- first use\\n")
    share = gs.export(obj)
    sys.stderr.write("--- done\\n")
    sys.stdout.write(share.to_bytes().hex() + "\\n")
    sys.stdout.flush()
    sys.stdin.readline()
else:
    share = gs.Share.from_bytes(bytes.fromhex(sys.argv[2]))
    sys.stderr.write("--- first use\\n")
    view = gs.open(share)
    sys.stderr.write("--- done\\n")
    print(view.path)
    view.close()
"""


def _first_use_imports(stderr: str) -> list[tuple[int, str]]:
    """(cumulative microseconds, module) of each import between the markers."""
    part = stderr.split("--- first use\n", 1)[1].split("--- done\n", 1)[0]
    out = []
    for line in part.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if m and not m.group(3)[1:].startswith(" "):  # top-level imports only: the cumulative counts the rest
            out.append((int(m.group(2)), m.group(4)))
    return out


@pytest.mark.parametrize(("kind", "path"), [("export", "cuda-ipc"), ("export-allocate", "posix-fd"),
                                           ("export-pool", "cuda-ipc")])
def test_the_first_export_and_open_of_cuda_memory_load_no_cuda_core(standin_lib, kind, path):
    env = standin_env(standin_lib, GPUSHARE_AUTHKEY="first-use-" + "k" * 24)
    exporter = subprocess.Popen([sys.executable, "-X", "importtime", "-c", _FIRST_USE, kind], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        hexed = exporter.stdout.readline().strip()
        assert hexed, exporter.stderr.read()[-3000:]
        importer = subprocess.run([sys.executable, "-X", "importtime", "-c", _FIRST_USE, "open", hexed], env=env,
                                  capture_output=True, text=True, timeout=120)
        assert importer.returncode == 0, importer.stderr[-3000:]
        assert importer.stdout.strip() == path
    finally:
        out, err = exporter.communicate("\n", timeout=60)
    for who, stderr in (("export", err), ("open", importer.stderr)):
        loaded = _first_use_imports(stderr)
        names = [name for _, name in loaded]
        assert not [n for n in names if n.startswith(NOT_ON_THE_WAY)], (who, names)
        cost = sum(us for us, _ in loaded)
        assert cost <= IMPORT_BUDGET_US, (who, cost, loaded)


def test_the_first_use_benchmark_holds_its_targets_on_the_stand_in(standin_lib):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_first.py"), "--cuda", "--runs", "3"],
                       env=standin_env(standin_lib), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    targets = r.stdout.split("targets\n", 1)[1].splitlines()
    assert len(targets) == 3 and all(line.endswith("PASS") for line in targets), r.stdout
    assert " cuda-ipc " in r.stdout and " posix-fd " in r.stdout, r.stdout
