#!/usr/bin/env bash
# Download, on a machine with registry access, the wheels tools/gpu_check.sh
# needs on a GPU machine without it:
#
#   bash tools/gpu_wheels.sh OUTDIR [PYTHON_VERSION]   (default 3.12)
#
# then carry OUTDIR there and run `bash tools/gpu_check.sh OUTDIR`.
set -euo pipefail
out="${1:?usage: tools/gpu_wheels.sh OUTDIR [PYTHON_VERSION]}"
pyver="${2:-3.12}"
mkdir -p "$out"
common=(--only-binary=:all: --python-version "$pyver" --platform manylinux_2_28_x86_64
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --implementation cp -d "$out")
pip download "${common[@]}" \
  "libucxx-cu13==0.52.*" libucx-cu13 "cuda-core>=1.2" "cuda-bindings>=13" numpy \
  pytest pytest-timeout hypothesis scikit-build-core nanobind cmake
pip download "${common[@]}" cupy-cuda13x || echo "cupy-cuda13x not downloaded"
du -sh "$out"
