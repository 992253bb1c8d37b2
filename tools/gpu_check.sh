#!/usr/bin/env bash
# The GPU check: one command for a machine with a CUDA device.
#
#   bash tools/gpu_check.sh [WHEELS]
#
# Builds gpushare in a fresh virtual environment (from PyPI, or offline from
# the wheels in WHEELS, as tools/gpu_wheels.sh downloads them), runs the
# `gpu` tests, the GPU benchmark, `gpushare doctor` and `gpushare demo`, and
# prints one report (also written to gpu-check-report.txt).  Exits non-zero
# when any step failed.  On a machine without a device the `gpu` tests skip,
# saying why, and the report says so: that is not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
wheels="${1:-}"
report="${GPU_CHECK_REPORT:-gpu-check-report.txt}"
venv="${GPU_CHECK_VENV:-.venv-gpu}"
py="${PYTHON:-python3}"
: > "$report"
status=0

step() {  # step NAME COMMAND...: run, tee into the report, remember failures
  local name="$1"; shift
  echo "===== $name: $*" | tee -a "$report"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$report"
  local rc=${PIPESTATUS[0]}
  echo "===== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$report"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

pip_args=()
if [ -n "$wheels" ]; then
  pip_args=(--no-index --find-links "$wheels")
fi

step "environment" bash -c "nvidia-smi -L || true; $py --version; uname -a"
step "venv" "$py" -m venv "$venv" || exit 1
if [ -n "$wheels" ]; then
  # Offline: the build backend and its requirements come from the wheels too.
  step "build requirements" "$venv/bin/pip" install "${pip_args[@]}" \
    scikit-build-core nanobind cmake "libucxx-cu13==0.52.*" || exit 1
  step "install" "$venv/bin/pip" install "${pip_args[@]}" --no-build-isolation -e '.[test]' || exit 1
else
  step "install" "$venv/bin/pip" install -e '.[test]' || exit 1
fi
"$venv/bin/pip" install "${pip_args[@]}" cupy-cuda13x >/dev/null 2>&1 \
  && echo "CuPy installed" | tee -a "$report" \
  || echo "CuPy not installed: its gpu tests will skip" | tee -a "$report"

step "doctor" "$venv/bin/gpushare" doctor
step "gpu tests" "$venv/bin/python" -m pytest -m gpu -v -rs -p no:cacheprovider
step "cudadriver contract check" "$venv/bin/python" -m pytest -m cudadriver -q -p no:cacheprovider
step "gpu benchmark" "$venv/bin/python" benchmarks/bench_gpu.py --quick
step "demo" "$venv/bin/gpushare" demo

echo
echo "===== summary" | tee -a "$report"
grep -E "^===== .*: exit|passed|failed|skipped|error" "$report" | grep -vE "^===== (summary)" | tail -n 40
echo "report: $report; overall: $([ $status -eq 0 ] && echo PASS || echo FAIL)" | tee -a "$report"
exit $status
