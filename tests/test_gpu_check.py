"""The GPU check's own failure handling: the GPU benchmark reports a failed
exporter at once, and ``tools/gpu_check.sh --run`` writes its report under
``$OUT`` and fails when it cannot run.  (The whole check runs in CI as
``tools/gpu_check.sh --rehearse``, against the CUDA driver stand-in.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

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
