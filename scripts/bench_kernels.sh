#!/usr/bin/env bash
# Benchmark of the CUDA kernels (bench/kernels_bench.cpp) on this machine's GPU: every launcher of kernels/ is
# first checked against the CPU reference on a small shape, then timed (cudaEvents, warm-up, median) at the
# gpt2-small and gpt2-xl shapes; reported: time, GB/s vs the GPU's peak memory bandwidth, and for the GEMM and
# attention FLOP/s vs cuBLAS. Needs nvcc (to build) and a GPU (to run). Prints the machine first.
#   scripts/bench_kernels.sh [kernels_bench flags...]    e.g. --preset gpt2-small --iters 100
# Writes runs/bench/kernels-<host>-<time>.log (everything printed) and .json next to it (MS_BENCH_OUT=prefix to
# choose); builds with cmake -DMS_WITH_CUDA=ON in build/ (MS_BENCH_BUILD=dir to choose).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${MS_BENCH_BUILD:-build}
out=${MS_BENCH_OUT:-runs/bench/kernels-$(hostname -s)-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$(dirname "$out")"

cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMS_WITH_CUDA=ON >/dev/null
if ! ninja -C "$build" -t query kernels_bench >/dev/null 2>&1; then
  echo "bench_kernels: no kernels_bench target in $build: nvcc was not found (the CUDA part is not compiled)" >&2
  exit 1
fi
cmake --build "$build" -j "$(nproc)" --target kernels_bench >/dev/null

{
  echo "machine: $(hostname -s), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit \
      --format=csv || true
  fi
  echo "command: $build/kernels_bench --json $out.json $*"
  echo
} | tee "$out.log"
"$build/kernels_bench" --json "$out.json" "$@" 2>&1 | tee -a "$out.log"
echo "log: $out.log"
echo "json: $out.json"
