#!/bin/sh
# Builds the CUDA driver stand-in (libcuda.so.1) and the NVML stand-in
# (libnvidia-ml.so.1) into OUTDIR and prints the absolute path of
# libcuda.so.1.  Usage: tests/cudadriver/build.sh OUTDIR
set -eu
if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$1"
out=$(cd "$1" && pwd)
cc=${CC:-cc}
$cc -std=gnu11 -O1 -g -Wall -Wextra -Werror -fPIC -shared -fvisibility=hidden \
    -Wl,-soname,libnvidia-ml.so.1 -Wl,--no-undefined \
    -o "$out/libnvidia-ml.so.1.tmp" "$here/nvml_standin.c" -lpthread
mv -f "$out/libnvidia-ml.so.1.tmp" "$out/libnvidia-ml.so.1"
$cc -std=gnu11 -O1 -g -Wall -Wextra -Werror -Wno-unused-parameter -fPIC -shared \
    -fvisibility=hidden -Wl,-soname,libcuda.so.1 -Wl,--no-undefined \
    -o "$out/libcuda.so.1.tmp" \
    "$here/standin_core.c" "$here/standin_stream.c" "$here/standin_mem.c" "$here/standin_pool.c" \
    "$here/standin_procs.c" \
    -lpthread -lrt
mv -f "$out/libcuda.so.1.tmp" "$out/libcuda.so.1"
ln -sf libcuda.so.1 "$out/libcuda.so"
echo "$out/libcuda.so.1"
