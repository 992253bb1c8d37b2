"""The GPU check's own failure handling: the GPU benchmark reports a failed
exporter at once, and ``tools/gpu_check.sh --run`` writes its report under
``$OUT`` and fails when it cannot run.  The benchmark prints each ratio with
its target on a line the check gathers (run against the CUDA driver
stand-in), says why a section needing CuPy did not run, and reads the rate
``examples/weight_sync.py`` prints.  (The whole check runs in CI as
``tools/gpu_check.sh --rehearse``, against the CUDA driver stand-in.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
from conftest import standin_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_gpu_reports_a_failed_exporter_within_seconds():
    # The exporter cannot start an Agent on a transport that does not exist;
    # the parent must see it die (it holds no copy of the child's pipe end)
    # and say why, instead of waiting for an answer that never comes.
    code = (
        "import sys; sys.path.insert(0, 'benchmarks')\n"
        "import bench_gpu\n"
        "try:\n"
        "    bench_gpu.start_exporter('no-such-transport', 1 << 20, timeout=100)\n"
        "except bench_gpu.ExporterFailed as exc:\n"
        "    print('REPORTED', exc)\n"
        "    sys.exit(0)\n"
        "sys.exit('the exporter answered')\n"
    )
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the benchmark's parent still waits for its failed exporter after 60 s\n"
                             f"{exc.stdout}{exc.stderr}") from None
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    assert "REPORTED the exporter" in r.stdout and "exited with code 1" in r.stdout, r.stdout
    # the child's stderr, with its own exception, is in the report
    assert "no-such-transport" in r.stdout and "Traceback" in r.stdout, r.stdout
    assert took < 30, f"reported only after {took:.0f} s"


def test_run_without_a_bundle_fails_and_says_so_in_the_report(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out))
    r = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh"), "--run", str(tmp_path / "none")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    report = (out / "report.txt").read_text()
    assert "no bundle" in report and "overall: FAIL" in report
    assert sorted(os.listdir(out)) == ["report.txt"]


def test_usage_errors_exit_2():
    for args in ([], ["--bundle"], ["--run", "a", "b"], ["--nonsense", "x"]):
        r = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh"), *args], capture_output=True,
                           text=True, timeout=30)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "--rehearse DIR" in r.stderr


#: A ratio line of the GPU benchmark, as the GPU check gathers it into its report.
RATIO = re.compile(r"^   ratio +(\d+\.\d\d)x  (.+)  target >= ([\d.]+)x  (PASS|FAIL)$")


@pytest.mark.cudadriver
def test_bench_gpu_prints_each_copy_ratio_with_its_target(standin_lib, tmp_path):
    # CuPy hidden (a package that fails to import): sections 6 and 7 must say why they did not run.
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    env = standin_env(standin_lib, PYTHONPATH=os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), "--quick", "--runs", "1",
                        "--sections", "1,6,7"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    ratios = [RATIO.match(line) for line in r.stdout.splitlines() if line.lstrip().startswith("ratio")]
    assert all(ratios) and len(ratios) == 4, r.stdout
    got = {(m[2], float(m[3])) for m in ratios}
    assert got == {(f"view.{kind} (posix-fd) / cuMemcpyDtoD + sync, {size}", target)
                   for kind in ("get", "put") for size, target in (("64 MiB", 0.9), ("1 MiB", 0.8))}, r.stdout
    for m in ratios:
        assert (float(m[1]) >= float(m[3])) == (m[4] == "PASS"), m[0]
    for section in ("6. hand-over against CuPy's CUDA IPC", "7. examples/weight_sync.py --cuda"):
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith(section)), "")
        assert line.endswith(": not run (CuPy is not installed: hidden by the test)"), r.stdout
    # What the GPU check copies into its report: the four ratios and both reasons.
    gathered = subprocess.run(["grep", "-E", r"(PASS|FAIL)$|: not run \(", "-"], input=r.stdout, text=True,
                              capture_output=True, timeout=10).stdout.splitlines()
    assert len(gathered) == 6, gathered


def test_bench_gpu_reads_the_rate_weight_sync_prints():
    code = (
        "import subprocess, sys; sys.path.insert(0, 'benchmarks')\n"
        "import bench_gpu\n"
        "out = subprocess.run([sys.executable, 'examples/weight_sync.py', '--steps', '3'], capture_output=True,\n"
        "                     text=True, timeout=120, check=True).stdout\n"
        "m = bench_gpu._UPDATE_LINE.search(out)\n"
        "print(*(m.groups() if m else ['no match:', out]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr
    nbytes, ms, count, lo, hi, gbps = r.stdout.split()
    # the host variant's 29 weights (4 layers, hidden 64), each of 3 versions timed
    assert (int(nbytes), int(count)) == (918_528, 3), r.stdout
    assert float(lo) <= float(ms) <= float(hi), r.stdout
    # the rate is the bytes over the median time (both as printed, rounded)
    assert int(nbytes) / float(gbps) / 1e6 == pytest.approx(float(ms), rel=0.01, abs=0.001), r.stdout
