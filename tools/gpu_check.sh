#!/usr/bin/env bash
# The GPU check, for a GPU machine that has no package registry and little time.
#
#   bash tools/gpu_check.sh --bundle DIR     where PyPI is reachable: make DIR, the folder that
#                                            travels (at most 40 MiB)
#   bash tools/gpu_check.sh --run DIR        on the GPU machine: install DIR, run every step,
#                                            write the report into $OUT
#   bash tools/gpu_check.sh --rehearse DIR   here: the same --run against the CUDA driver stand-in,
#                                            with no registry and another Python version
#
# --bundle builds gpushare as a wheel for CPython 3.12 (the GPU image's Python) with its native
# module, and adds only what that image lacks: the UCX and libucxx wheels, cuda-core,
# cuda-bindings, cuda-pathfinder and the test plugins.  The image is assumed to provide python3
# (with pip), numpy, pytest, torch, CuPy, cmake, ninja, nanobind and scikit-build-core.  The
# wheels are stored uncompressed in one xz archive whose dictionary spans UCX's identical library
# copies (libucp.so, .so.0 and .so.0.0.0 are three files in the wheel); the UCX libraries are
# never stripped, only their static archives are left out.
#
# --run uses the machine's own python3 (and so its torch and CuPy), installs the wheels into a
# target folder put first on PYTHONPATH, and rebuilds gpushare's native module from this tree
# when python3 is not the bundle's version.  Steps, each under its own time limit, all within
# GPU_CHECK_BUDGET_S (default 480 s): environment, install, smoke, gpu tests, benchmark, demo,
# doctor, then the stand-in contract check with the time that is left (GPU_CHECK_STEPS=a,b: only
# those steps, for a second call; GPU_CHECK_BENCH_ARGS: the benchmark's arguments, --quick; its hand-over
# sections run with "--quick --sections 4,5,6").  The report (report.txt, with the benchmark's ratio lines,
# and one log per step group, 8 files) goes into $OUT (default ./gpu-check-out).  Exit status 1
# when a step failed.  A gpu test that skips is reported as skipped, never as passed.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUNDLE_PY="3.12"                      # the GPU image's Python
MAX_MIB="${GPU_CHECK_MAX_MIB:-40}"    # what the bundle may weigh
ARCHIVE="wheels.tar.xz"
MANIFEST="MANIFEST.txt"
# Wheels the image already has, or that nothing loads at run time: libucxx's package depends on
# librmm (and it on rapids-logger), but libucxx.so and the native module link neither; --bundle
# checks that with readelf and fails if that changes.
NOT_CARRIED="numpy pytest pluggy iniconfig packaging pygments colorama exceptiongroup tomli sybil
librmm-cu13 rapids-logger"

usage() {
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

die() { echo "gpu_check: $*" >&2; exit 1; }

# --------------------------------------------------------------------------------------------
# --bundle DIR
# --------------------------------------------------------------------------------------------

find_python312() {
  local cand
  for cand in "${GPU_CHECK_PYTHON312:-}" "$(command -v python3.12 || true)" \
              $(ls -d "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.12*/bin/python3.12 2>/dev/null | sort -rV); do
    [ -n "$cand" ] && [ -x "$cand" ] || continue
    if "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      echo "$cand"
      return 0
    fi
  done
  return 1
}

bundle() {
  local dir="$1" py work t0=$SECONDS
  py="$(find_python312)" || die "no Python 3.12 found (set GPU_CHECK_PYTHON312=/path/to/python3.12)"
  "$py" -m pip --version >/dev/null 2>&1 || die "$py has no pip"
  work="$(mktemp -d /tmp/gpu-bundle.XXXXXX)"
  WORK="$work"
  trap 'rm -rf "$WORK"' EXIT
  mkdir -p "$work/built" "$work/deps" "$work/skip"
  echo "== gpushare wheel for CPython 3.12 ($py; build requirements from PyPI)"
  "$py" -m pip wheel --no-deps -q -w "$work/built" -C build-dir="$work/build" "$ROOT" \
    || die "building the gpushare wheel failed"
  local whl
  whl="$(ls "$work/built"/gpushare-*-cp312-*.whl)" || die "no cp312 gpushare wheel was built"
  echo "   $((SECONDS - t0)) s"
  echo "== its requirements for cp312 x86_64 (with their own requirements)"
  local reqs
  reqs="$("$py" - "$whl" "$ROOT/pyproject.toml" <<'EOF'
import sys, tomllib, zipfile
whl, pyproject = sys.argv[1:]
z = zipfile.ZipFile(whl)
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
reqs = [l.split(":", 1)[1].strip() for l in z.read(meta).decode().splitlines()
        if l.startswith("Requires-Dist:") and "extra ==" not in l]
test = tomllib.load(open(pyproject, "rb"))["project"]["optional-dependencies"]["test"]
reqs += [r for r in test if not r.split(">")[0].split("=")[0].strip().lower() in ("pytest", "sybil")]
print("\n".join(reqs))
EOF
)" || die "reading the wheel's requirements failed"
  local -a args=(--only-binary=:all: --python-version "$BUNDLE_PY" --implementation cp --abi cp312
                 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
                 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
                 --platform manylinux2014_x86_64 --platform linux_x86_64 -q -d "$work/deps")
  local -a reqarr
  mapfile -t reqarr <<<"$reqs"
  echo "   ${reqarr[*]}"
  "$py" -m pip download "${args[@]}" "${reqarr[@]}" || die "downloading the requirements failed"
  echo "   $((SECONDS - t0)) s"
  echo "== packing"
  rm -rf "$dir"
  mkdir -p "$dir"
  NOT_CARRIED="$NOT_CARRIED" "$py" - "$whl" "$work/deps" "$dir" "$ARCHIVE" "$MANIFEST" "$py" <<'EOF' || die "packing failed"
import datetime, hashlib, io, lzma, os, re, subprocess, sys, tarfile, tempfile, zipfile
whl, deps, out, archive, manifest, py = sys.argv[1:]
not_carried = set(os.environ["NOT_CARRIED"].split())
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
def name_of(path):
    return norm(os.path.basename(path).split("-")[0])

wheels = [whl] + sorted(os.path.join(deps, f) for f in os.listdir(deps) if f.endswith(".whl"))
keep = [w for w in wheels if name_of(w) not in not_carried]
left = [w for w in wheels if name_of(w) not in {name_of(k) for k in keep}]

def needed(blob):
    with tempfile.NamedTemporaryFile(suffix=".so") as f:
        f.write(blob); f.flush()
        r = subprocess.run(["readelf", "-d", f.name], capture_output=True, text=True, check=True)
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", r.stdout)

# What the native module loads, and what libucxx.so loads: none of it may come from a wheel
# that is not carried.
shipped = {}
for w in wheels:
    for n in zipfile.ZipFile(w).namelist():
        if ".so" in os.path.basename(n):
            shipped.setdefault(os.path.basename(n), set()).add(name_of(w))
report = []
problems = []
for w in keep:
    z = zipfile.ZipFile(w)
    for n in z.namelist():
        b = os.path.basename(n)
        if (name_of(w) == "gpushare" and (b.startswith("_native") or b == "libgpushare_torch_alloc.so")) \
                or b == "libucxx.so":
            libs = needed(z.read(n))
            report.append(f"{n} loads: {' '.join(libs) or 'nothing'}")
            for lib in libs:
                owners = shipped.get(lib, set())
                if owners and not owners & {name_of(k) for k in keep}:
                    problems.append(f"{n} needs {lib}, found only in {sorted(owners)}, which is not carried")
# The gpushare wheel holds both of CMakeLists.txt's targets: the native module and torch's allocator library.
members = [os.path.basename(n) for n in zipfile.ZipFile(whl).namelist()]
if not any(b.startswith("_native") for b in members) or "libgpushare_torch_alloc.so" not in members:
    problems.append(f"{os.path.basename(whl)} lacks the native module or libgpushare_torch_alloc.so")
if problems:
    sys.exit("\n".join(problems))

def repack(w):
    """The wheel, its members stored uncompressed (the archive compresses them together), with
    UCX's static archives (.a, .la: build inputs nothing here links) left out."""
    src = zipfile.ZipFile(w)
    buf = io.BytesIO()
    dropped = []
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            n = info.filename
            if name_of(w) == "libucx-cu13" and (n.endswith(".a") or n.endswith(".la")):
                dropped.append(n)
                continue
            data = src.read(n)
            if n.endswith(".dist-info/RECORD") and dropped is not None:
                continue  # written last, without the dropped files
            dst.writestr(info, data, compress_type=zipfile.ZIP_STORED)
        rec = next(i for i in src.infolist() if i.filename.endswith(".dist-info/RECORD"))
        lines = [l for l in src.read(rec.filename).decode().splitlines() if l.split(",")[0] not in dropped]
        dst.writestr(rec, ("\n".join(lines) + "\n").encode(), compress_type=zipfile.ZIP_STORED)
    return buf.getvalue(), dropped

path = os.path.join(out, archive)
filters = [{"id": lzma.FILTER_LZMA2, "preset": 1, "dict_size": 16 << 20}]
lines = [f"gpushare GPU check bundle, made {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
         "python: cp312", f"built with: {py}", "", "wheels (name, size, sha256):"]
with lzma.open(path, "wb", format=lzma.FORMAT_XZ, filters=filters) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
    for w in keep:
        data, dropped = repack(w)
        info = tarfile.TarInfo(os.path.basename(w))
        info.size = len(data)
        info.mtime = 0
        tar.addfile(info, io.BytesIO(data))
        lines.append(f"  {os.path.basename(w)} {len(data)} {hashlib.sha256(data).hexdigest()}")
        if dropped:
            lines.append(f"    left out: {len(dropped)} static archives ({', '.join(os.path.basename(d) for d in dropped[:4])}, ...)")
lines += ["", "not carried (the image has them, or nothing loads them):"]
lines += [f"  {os.path.basename(w)}" for w in left]
lines += ["", "native libraries:"] + [f"  {r}" for r in report]
open(os.path.join(out, manifest), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
  local bytes mib
  bytes="$(du -sb "$dir" | cut -f1)"
  mib="$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')"
  echo "bundle: $dir: $mib MiB ($bytes bytes; limit $MAX_MIB MiB) in $((SECONDS - t0)) s"
  if [ "$bytes" -gt $((MAX_MIB * 1048576)) ]; then
    die "the bundle is $mib MiB, over the $MAX_MIB MiB limit"
  fi
}

# --------------------------------------------------------------------------------------------
# --run DIR
# --------------------------------------------------------------------------------------------

OUT_DIR=""
REPORT=""
BUDGET=0
T0=0
FAILED=0
STATUS=""  # of the last step

note() { echo "$*" | tee -a "$REPORT"; }

# step NAME LOG LIMIT CMD...: run CMD under min(LIMIT, time left in the budget), its output
# appended to $OUT_DIR/LOG; sets STATUS (PASS, FAIL, TIMEOUT or NOT RUN), RC and TOOK.
step() {
  S_NAME="$1" S_LOG="$2" S_LIMIT="$3"; shift 3
  local log="$OUT_DIR/$S_LOG" left=$((BUDGET - (SECONDS - T0)))
  [ "$S_LIMIT" -gt "$left" ] && S_LIMIT="$left"
  TOOK=0
  if [ "$S_LIMIT" -lt 10 ]; then
    STATUS="NOT RUN"; RC=-1
    echo "===== $S_NAME: not run, no time left in the ${BUDGET} s budget" >>"$log"
    return 0
  fi
  {
    echo "===== $S_NAME: $*"
    echo "===== limit ${S_LIMIT} s, started $(date -u +%H:%M:%S)"
  } >>"$log"
  local t=$SECONDS
  timeout -k 5 "$S_LIMIT" "$@" >>"$log" 2>&1 </dev/null
  RC=$?
  TOOK=$((SECONDS - t))
  echo "===== $S_NAME: exit $RC after $TOOK s" >>"$log"
  if [ "$RC" -eq 0 ]; then STATUS="PASS"
  elif [ "$RC" -eq 124 ] || [ "$RC" -eq 137 ]; then STATUS="TIMEOUT"
  else STATUS="FAIL"; fi
}

# wanted NAME: whether step NAME runs: every step, or those GPU_CHECK_STEPS names (a comma list of
# smoke, gpu-tests, benchmark, demo, doctor, contract; environment and install always run), for a
# second short call that reruns what failed.  A step left out is reported as such.
wanted() {
  [ -z "${GPU_CHECK_STEPS:-}" ] && return 0
  case ",${GPU_CHECK_STEPS// /}," in *",$1,"*) return 0 ;; esac
  printf '%-16s %-10s %s\n' "$1" "LEFT OUT" "(GPU_CHECK_STEPS=$GPU_CHECK_STEPS)" | tee -a "$REPORT"
  return 1
}

# record [STATUS] [DETAIL]: the last step's line in the report; any status but PASS, SKIPPED and
# INCOMPLETE fails the check.
record() {
  local status="${1:-$STATUS}" detail="${2:-}"
  case "$status" in PASS|SKIPPED|INCOMPLETE) ;; *) FAILED=1 ;; esac
  {
    printf '%-16s %-10s %4d s (limit %3d s)  %s' "$S_NAME" "$status" "$TOOK" "$S_LIMIT" "$S_LOG"
    [ -n "$detail" ] && printf '\n%18s %s' "" "$detail"
    echo
  } | tee -a "$REPORT"
}

# The counts in pytest's last summary line of LOG, e.g. "3 passed, 2 skipped".
pytest_counts() {
  grep -E "^=+ .*(passed|failed|skipped|error|deselected|no tests ran).* in [0-9.]+s" "$1" | tail -n 1 \
    | sed -E 's/^=+ //; s/ in [0-9.]+s.*//'
}

# The skip reasons in pytest's -rs summary of LOG, each once with how many tests it skipped.
skip_reasons() {
  sed -nE 's/^SKIPPED \[([0-9]+)\] [^:]+(:[0-9]+)?: (.*)$/\1 \3/p' "$1" \
    | awk '{ n = $1; $1 = ""; sub(/^ /, ""); count[$0] += n } END { for (r in count) printf "    skipped %3d: %s\n", count[r], r }' \
    | sort -k2,2nr
}

count_of() {  # count_of WORD COUNTS
  echo "$2" | grep -oE "[0-9]+ $1" | grep -oE "^[0-9]+" || echo 0
}

environment() {
  echo "--- date: $(date -u)"
  echo "--- host: $(uname -a)"
  echo "--- cpus: $(nproc); memory: $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB"}')"
  echo "--- nvidia-smi"
  if command -v nvidia-smi >/dev/null; then
    timeout 20 nvidia-smi || echo "(nvidia-smi failed)"
    timeout 20 nvidia-smi -L || true
  else
    echo "nvidia-smi: not found"
  fi
  echo "--- python3: $(command -v python3)"
  python3 -VV
  python3 -m pip --version || echo "pip: not available (the wheels are unpacked by hand)"
  echo "--- the image's packages"
  python3 - <<'EOF'
import importlib, importlib.metadata as md
for dist in ("numpy", "pytest", "torch", "cupy-cuda13x", "cupy-cuda12x", "cupy", "cuda-core", "cuda-bindings",
             "cuda-pathfinder", "nanobind", "scikit-build-core", "cmake", "ninja", "hypothesis", "sybil"):
    try:
        print(f"{dist}: {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist}: absent")
import platform
def v(d):
    try:
        return md.version(d)
    except md.PackageNotFoundError:
        return None
cupy = v("cupy-cuda13x") or v("cupy-cuda12x") or v("cupy")
print(f"SUMMARY: Python {platform.python_version()}, torch {v('torch') or 'absent (its tests skip)'},"
      f" CuPy {cupy or 'absent (its tests skip)'}")
EOF
  echo "--- torch"
  timeout 60 python3 -c "
import torch
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'available', torch.cuda.is_available(),
      'devices', torch.cuda.device_count())" 2>&1 | tail -n 3 || true
  echo "--- CuPy"
  timeout 60 python3 -c "
import cupy
print('CuPy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())" 2>&1 | tail -n 3 || true
  echo "--- tools"
  for t in cmake ninja "${CC:-cc}" c++ gcc; do
    printf '%s: ' "$t"; { command -v "$t" >/dev/null && "$t" --version 2>&1 | head -n 1; } || echo absent
  done
  echo "--- disk"
  df -h "$ROOT" /tmp 2>/dev/null
  echo "--- bundle"
  cat "$BUNDLE/$MANIFEST"
}

# Install the bundle's wheels that fit this python3 into $TARGET; rebuild gpushare from the tree
# when its wheel does not fit; check that what does not fit is provided by the image.
install_bundle() {
  local unpacked="$WORK/wheels"
  mkdir -p "$unpacked" "$TARGET"
  python3 - "$BUNDLE/$ARCHIVE" "$unpacked" <<'EOF' || return 1
import sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    if hasattr(tarfile, "data_filter"):
        t.extractall(sys.argv[2], filter="data")
    else:
        t.extractall(sys.argv[2])
EOF
  local plan
  plan="$(python3 - "$unpacked" <<'EOF'
import os, sys
try:
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename
except ImportError:
    try:
        from pip._vendor.packaging.tags import sys_tags
        from pip._vendor.packaging.utils import parse_wheel_filename
    except ImportError:  # neither packaging nor pip: judge by the Python tag alone (Linux x86_64)
        sys_tags = None
here = set(sys_tags()) if sys_tags else None
mine = "cp%d%d" % sys.version_info[:2]
for f in sorted(os.listdir(sys.argv[1])):
    if here is not None:
        name, _, _, tags = parse_wheel_filename(f)
        fits = bool(tags & here)
    else:
        parts = f[:-len(".whl")].split("-")
        name, pytags = parts[0].replace("_", "-").lower(), parts[-3].split(".")
        fits = mine in pytags or any(t.startswith("py3") for t in pytags)
    print("fits" if fits else "other", name, os.path.join(sys.argv[1], f))
EOF
)" || return 1
  echo "$plan"
  local -a fits=()
  local rebuild=0 other=()
  while read -r kind name path; do
    if [ "$kind" = fits ] && ! { [ "$name" = gpushare ] && [ "${GPU_CHECK_REBUILD:-0}" = 1 ]; }; then
      fits+=("$path")
    elif [ "$name" = gpushare ]; then
      rebuild=1
    else
      other+=("$name")
    fi
  done <<<"$plan"
  pip_install "${fits[@]}" || return 1
  export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
  local mod
  for name in "${other[@]}"; do
    mod="$(echo "$name" | tr - .)"
    [ "$name" = cuda-core ] && mod=cuda.core
    [ "$name" = cuda-bindings ] && mod=cuda.bindings
    if python3 -c "import $mod" 2>/dev/null; then
      echo "$name: the bundle's wheel is for cp312; using this Python's own ($(python3 -c "import importlib.metadata as m; print(m.version('$name'))"))"
    else
      echo "$name: the bundle's wheel is for cp312 and this Python has none"
      return 1
    fi
  done
  if [ "$rebuild" = 1 ]; then
    echo "--- rebuilding gpushare's native module for $(python3 -V) from $ROOT (the bundle's wheel is for cp312)"
    python3 -m pip --version >/dev/null 2>&1 || { echo "rebuilding needs pip"; return 1; }
    # scikit-build-core, nanobind, cmake and ninja are this Python's; libucxx and UCX the bundle's.
    PIP_NO_INDEX=1 python3 -m pip wheel --no-build-isolation --no-deps --no-index -w "$WORK/rebuilt" \
      -C build-dir="$WORK/build" "$ROOT" || return 1
    pip_install "$WORK"/rebuilt/gpushare-*.whl || return 1
  fi
}

pip_install() {  # pip_install WHEEL...: into $TARGET, with pip, else unpacked by hand
  [ "$#" -gt 0 ] || return 0
  if python3 -m pip --version >/dev/null 2>&1; then
    PIP_NO_INDEX=1 python3 -m pip install --no-index --no-deps --no-compile --no-warn-script-location \
      --disable-pip-version-check --upgrade --target "$TARGET" "$@"
  else
    python3 - "$TARGET" "$@" <<'EOF'
import os, shutil, sys, zipfile
target = sys.argv[1]
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(target)
    for d in [d for d in os.listdir(target) if d.endswith(".data")]:
        for sub in ("purelib", "platlib"):
            src = os.path.join(target, d, sub)
            if os.path.isdir(src):
                shutil.copytree(src, target, dirs_exist_ok=True)
        shutil.rmtree(os.path.join(target, d))
    print("unpacked", os.path.basename(w))
EOF
  fi
}

smoke() {
  cat >"$WORK/smoke.py" <<'EOF'
"""gpushare loads from the installed bundle, and one share crosses between two processes."""
import importlib.metadata
import multiprocessing as mp
import os
import sys

import numpy as np

import gpushare as gs


def importer(queue, results):
    share = queue.get()
    with gs.open(share) as view:
        view.put(np.full(view.nbytes, 7, np.uint8))
        results.put(view.path)


def one_share(device):
    buf = gs.allocate(1 << 20, device=device)
    share = gs.export(buf, lifetime="revoked")
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=importer, args=(queue, results))
    proc.start()
    queue.put(share)
    proc.join(60)
    if proc.exitcode != 0:
        sys.exit(f"device={device!r}: the importing process exited with {proc.exitcode}")
    path = results.get(timeout=5)
    back = np.zeros(1 << 20, np.uint8)
    with gs.open(share) as view:
        view.get(back)
    if not (back == 7).all():
        sys.exit(f"device={device!r}: the bytes the other process wrote over {path} did not arrive")
    print(f"one share between two processes, device={device!r}: {path}, 1 MiB arrived")
    share.revoke()
    buf.close()


if __name__ == "__main__":
    import gpushare.ucx  # noqa: F401 - the native module and UCX load
    from gpushare._cuda import _driver
    from gpushare._ucx import _loader

    _loader.native()
    libs = _loader.loaded()
    print(f"UCX {'.'.join(map(str, libs.ucx_version))} loaded from {libs.ucx_dir}; mapped: {' '.join(libs.mapped)}")

    target = os.path.realpath(sys.argv[1])
    where = os.path.realpath(gs.__file__)
    print("gpushare", importlib.metadata.version("gpushare"), "from", where)
    if not where.startswith(target + os.sep):
        sys.exit(f"gpushare was imported from {where}, not from the installed bundle in {target}")
    reason = _driver.unavailable_reason()
    print("CUDA:", "usable" if reason is None else f"not usable: {reason}")
    one_share("host")
    if reason is None:
        one_share(0)
EOF
  python3 "$WORK/smoke.py" "$TARGET"
}

run_check() {
  BUNDLE="$(cd "$1" 2>/dev/null && pwd)" || BUNDLE="$1"
  OUT_DIR="${OUT:-$PWD/gpu-check-out}"
  mkdir -p "$OUT_DIR" || die "cannot create $OUT_DIR"
  OUT_DIR="$(cd "$OUT_DIR" && pwd)"
  REPORT="$OUT_DIR/report.txt"
  : >"$REPORT"
  BUDGET="${GPU_CHECK_BUDGET_S:-480}"
  T0=$SECONDS
  WORK="$(mktemp -d /tmp/gpu-check.XXXXXX)"
  TARGET="$WORK/site"
  trap 'rm -rf "$WORK"' EXIT
  local standin="${GPU_CHECK_STANDIN:-0}"
  note "gpushare GPU check, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(hostname)"
  if [ "$standin" = 1 ]; then
    note "REHEARSAL against the CUDA driver stand-in ($LD_LIBRARY_PATH): a contract check, not GPU verification"
  fi
  note "tree: $ROOT; bundle: $BUNDLE; report: $OUT_DIR; budget ${BUDGET} s"
  if [ ! -f "$BUNDLE/$ARCHIVE" ]; then
    note "no bundle: $BUNDLE/$ARCHIVE does not exist (make it with: bash tools/gpu_check.sh --bundle DIR)"
    note "overall: FAIL"
    return 1
  fi
  command -v python3 >/dev/null || { note "no python3"; note "overall: FAIL"; return 1; }

  # Imports come from the installed bundle, never from the tree's gpushare/, which has no native
  # module: Python puts no script or current folder on sys.path, and pytest (also where a test
  # starts pytest itself) loads no conftest.py above tests/, so it neither puts the tree's root on
  # sys.path nor needs the documentation's Sybil, which the image lacks.
  export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
  export PYTEST_ADDOPTS="--confcutdir=$ROOT/tests${PYTEST_ADDOPTS:+ $PYTEST_ADDOPTS}"
  export -f environment install_bundle pip_install smoke 2>/dev/null
  export ROOT BUNDLE WORK TARGET MANIFEST ARCHIVE

  echo | tee -a "$REPORT"
  printf '%-16s %-10s %s\n' "step" "status" "time (limit)   log" | tee -a "$REPORT"

  step "environment" environment.log 60 bash -c environment
  local gpus
  gpus="$(grep -cE '^GPU [0-9]+:' "$OUT_DIR/environment.log" || true)"
  record "$STATUS" "$(grep -m1 '^SUMMARY: ' "$OUT_DIR/environment.log" | sed 's/^SUMMARY: //'); GPUs listed by nvidia-smi: $gpus"

  local limit=60
  [ "$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')" = "$BUNDLE_PY" ] \
    && [ "${GPU_CHECK_REBUILD:-0}" != 1 ] || limit=300
  # install_bundle exports PYTHONPATH in its own shell: compute it here as well.
  step "install" install.log "$limit" bash -c install_bundle
  local installed="$STATUS"
  record "$STATUS" "$(grep -E '^(--- rebuilding|[a-z-]+: the bundle)' "$OUT_DIR/install.log" | sed 's/^--- //' | tr '\n' ';' | sed 's/;$//')"
  export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$TARGET/bin:$PATH"
  if [ "$installed" != PASS ]; then
    note "the bundle did not install: the other steps cannot run (see install.log)"
    note "overall: FAIL ($((SECONDS - T0)) s)"
    return 1
  fi

  if wanted smoke; then
    step "smoke" smoke.log 90 bash -c smoke
    record "$STATUS" "$(grep -E '^(one share|UCX )' "$OUT_DIR/smoke.log" | sed 's/^one share between two processes, //' | tr '\n' ';' | sed 's/;$//')"
  fi

  cd "$ROOT" || return 1
  if wanted gpu-tests; then
    step "gpu tests" gpu-tests.log 240 python3 -m pytest tests -m gpu -v -rfEs -p no:cacheprovider
    local counts passed failed errors
    counts="$(pytest_counts "$OUT_DIR/gpu-tests.log")"
    passed="$(count_of passed "$counts")"; failed="$(count_of failed "$counts")"; errors="$(count_of error "$counts")"
    if [ "$STATUS" = PASS ] && [ "$passed" -eq 0 ]; then
      if [ "$gpus" -gt 0 ] && [ "$standin" != 1 ]; then
        record FAIL "${counts:-no summary}: nvidia-smi lists a GPU, yet no gpu test ran"
      else
        record SKIPPED "${counts:-no summary}: none ran, nothing verified on a GPU"
      fi
    elif [ "$STATUS" = FAIL ] && [ "$RC" -eq 5 ]; then
      record SKIPPED "no gpu tests were collected"
    else
      record "$STATUS" "${counts:-no summary}"
    fi
    grep -E "^(FAILED|ERROR) " "$OUT_DIR/gpu-tests.log" | head -n 40 | sed 's/^/    /' | tee -a "$REPORT"
    skip_reasons "$OUT_DIR/gpu-tests.log" | tee -a "$REPORT"
  fi

  if wanted benchmark; then
    local -a bench=(${GPU_CHECK_BENCH_ARGS:---quick})
    # Against the stand-in, UCX transfers between CUDA buffers do not complete once cuda_ipc is
    # among the transports (each waits out its limit); on a GPU cuda_ipc is what they use.
    [ "$standin" = 1 ] && bench+=(--tls tcp,cuda_copy)
    step "benchmark" benchmark.log 150 python3 benchmarks/bench_gpu.py "${bench[@]}"
    if [ "$STATUS" = FAIL ] && [ "$RC" -eq 2 ]; then
      record SKIPPED "$(grep -m1 '^no CUDA device' "$OUT_DIR/benchmark.log")"
    elif [ "$standin" = 1 ] && [ "$STATUS" = PASS ]; then
      record PASS "ran against the stand-in, ucx-rma over tcp,cuda_copy only: its figures are not GPU figures"
    else
      record "$STATUS" "$(grep -E '(ExporterFailed|Error):' "$OUT_DIR/benchmark.log" | tail -n 1)"
    fi
    # Into the report: every ratio the benchmark holds to a target, with the target and PASS or
    # FAIL (reported, not the step's verdict), and each section that could not run, with why.
    # Sections 4 and 6 run only when asked: GPU_CHECK_BENCH_ARGS="--quick --sections 4,5,6".
    grep -E '(PASS|FAIL)$|: not run \(' "$OUT_DIR/benchmark.log" | sed -E 's/^ */    /' | tee -a "$REPORT"
  fi

  if wanted demo; then
    step "demo" demo-doctor.log 90 python3 -m gpushare demo
    record "$STATUS" "$(grep -iE 'path|MiB/s|GB/s' "$OUT_DIR/demo-doctor.log" | head -n 2 | tr '\n' ';' | sed 's/;$//')"
  fi
  if wanted doctor; then
    step "doctor" demo-doctor.log 60 python3 -m gpushare doctor
    record
  fi

  local cc="${CC:-cc}"
  S_NAME="contract check" S_LOG=contract.log S_LIMIT=0 TOOK=0
  if ! wanted contract; then
    :
  elif ! command -v "$cc" >/dev/null; then
    record SKIPPED "no C compiler ($cc) to build the CUDA driver stand-in"
  elif [ $((BUDGET - (SECONDS - T0))) -lt 60 ]; then
    record SKIPPED "less than 60 s of the ${BUDGET} s budget left"
  else
    step "contract check" contract.log 600 env -u CI python3 -m pytest tests -m cudadriver -v -rfE \
      -p no:cacheprovider
    counts="$(pytest_counts "$OUT_DIR/contract.log")"
    if [ "$STATUS" = TIMEOUT ]; then
      record INCOMPLETE "stopped at the budget's end: $(grep -cE ' PASSED' "$OUT_DIR/contract.log") passed, $(grep -cE ' (FAILED|ERROR)' "$OUT_DIR/contract.log") failed so far"
      [ "$(grep -cE ' (FAILED|ERROR)' "$OUT_DIR/contract.log")" -eq 0 ] || FAILED=1
    else
      record "$STATUS" "${counts:-no summary}"
    fi
    grep -E "^(FAILED|ERROR) " "$OUT_DIR/contract.log" | head -n 30 | sed 's/^/    /' | tee -a "$REPORT"
  fi

  echo | tee -a "$REPORT"
  note "overall: $([ "$FAILED" = 0 ] && echo PASS || echo FAIL) after $((SECONDS - T0)) s (budget ${BUDGET} s)"
  note "files: $(cd "$OUT_DIR" && ls | tr '\n' ' ')"
  return "$FAILED"
}

# --------------------------------------------------------------------------------------------
# --rehearse DIR
# --------------------------------------------------------------------------------------------

rehearse() {
  local dir="$1" py="${GPU_CHECK_REHEARSE_PYTHON:-python3}" work ver
  dir="$(cd "$dir" 2>/dev/null && pwd)" || die "no bundle folder $1"
  [ -f "$dir/$MANIFEST" ] || die "$dir has no $MANIFEST: make it with --bundle"
  work="$(mktemp -d /tmp/gpu-rehearse.XXXXXX)"
  WORK="$work" NETNS=""
  trap '[ -n "$NETNS" ] && ip netns del "$NETNS" 2>/dev/null; rm -rf "$WORK"' EXIT
  ver="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" || die "no $py"
  local t0=$SECONDS
  echo "== the CUDA driver stand-in"
  local lib
  lib="$("$ROOT/tests/cudadriver/build.sh" "$work/standin")" || die "building the stand-in failed"
  echo "== an image-like Python ($py, $ver): pytest, numpy, cmake, ninja, nanobind, scikit-build-core"
  "$py" -m venv "$work/image" || die "venv failed"
  # The bundle's cp312-only wheels, for this Python, at the bundle's versions: what the image
  # would have to provide were its Python not 3.12.
  local pins
  pins="$(sed -nE 's/^  (cuda_core|cuda_bindings|hypothesis)-([^-]+)-.*/\1==\2/p' "$dir/$MANIFEST" | tr _ - | tr '\n' ' ')"
  # shellcheck disable=SC2086
  "$work/image/bin/python" -m pip install -q --disable-pip-version-check \
    pytest numpy "cmake>=4" ninja "nanobind>=2.4" "scikit-build-core>=0.10" $pins \
    || die "installing the image-like Python failed"
  echo "   $((SECONDS - t0)) s"
  local -a isolate=()
  if [ "$(id -u)" = 0 ] && command -v ip >/dev/null && ip netns add "gpucheck-$$" 2>/dev/null; then
    NETNS="gpucheck-$$"
    ip netns exec "$NETNS" ip link set lo up
    isolate=(ip netns exec "$NETNS")
    echo "== offline: a network namespace with only loopback ($NETNS)"
  else
    echo "== no network namespace (needs root and ip): offline by PIP_NO_INDEX only"
  fi
  [ "$ver" = "$BUNDLE_PY" ] && echo "== $py is $BUNDLE_PY: forcing the rebuild path" && export GPU_CHECK_REBUILD=1
  local out="${OUT:-$work/out}"
  echo "== bash tools/gpu_check.sh --run $dir   (OUT=$out)"
  "${isolate[@]}" env PATH="$work/image/bin:$PATH" PIP_NO_INDEX=1 GPU_CHECK_STANDIN=1 OUT="$out" \
    LD_LIBRARY_PATH="$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    bash "$ROOT/tools/gpu_check.sh" --run "$dir"
  local rc=$?
  echo "== rehearsal exit status $rc after $((SECONDS - t0)) s; report in $out"
  return "$rc"
}

case "${1:-}" in
  --bundle) [ $# -eq 2 ] || usage; bundle "$2" ;;
  --run) [ $# -eq 2 ] || usage; run_check "$2" ;;
  --rehearse) [ $# -eq 2 ] || usage; rehearse "$2" ;;
  *) usage ;;
esac
