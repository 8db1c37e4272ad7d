#!/usr/bin/env bash
# Sets up a machine and runs every test: the Release build (with the ThreadSanitizer variant of the
# emulated kernel tests, MS_KERNELS_TSAN), then the sanitizer build (ASan + UBSan). This is the README's
# test command and what .ci/run calls. With nvcc present the Release build also compiles every CUDA
# source for sm_80 and sm_90, links the GPU flavor of the CUDA backend and builds the GPU test binaries (compile and
# link only: no GPU; the tests labelled gpu are left out).
#   scripts/test.sh            # everything
#   MS_SKIP_ASAN=1 scripts/test.sh   # Release build only (quicker, for local iteration)
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

# Each phase's wall time, printed at the end (also when a phase fails): CI has 2 cores and the project keeps this
# run well under 30 minutes (docs/PERFORMANCE.md, "Build and test time").
phase_name="setup" phase_start=$SECONDS phase_times=()
phase() {  # ends the running phase, starts the next (none: "")
  phase_times+=("$(printf '%-20s %5d s' "$phase_name" $((SECONDS - phase_start)))")
  phase_name=$1 phase_start=$SECONDS
  if [[ -n $1 ]]; then echo "== $1"; fi
}
summary() {
  local rc=$?
  if [[ -n $phase_name ]]; then phase ""; fi
  echo "== time per phase ($(nproc) cores)$( ((rc == 0)) || echo ", stopped by a failure")"
  printf '   %s\n' "${phase_times[@]}"
  printf '   %-20s %5d s\n' total "$SECONDS"
}
trap summary EXIT

bash scripts/setup.sh --with-torch

phase "Release build"
# With nvcc the GPU test binaries are built too (compiled and linked, not run: label gpu, scripts/gpu_check.sh runs
# them on a GPU), so that what a lent GPU runs first is known to build.
gpu_tests=OFF
if command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]]; then gpu_tests=ON; fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMS_KERNELS_TSAN=ON -DMS_GPU_TESTS=$gpu_tests
cmake --build build -j "$jobs"
phase "Release tests"
ctest --test-dir build --output-on-failure -j "$jobs" --timeout 600 -LE gpu

if [[ "${MS_SKIP_ASAN:-0}" != 1 ]]; then
  phase "ASan + UBSan build"
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DMS_SANITIZE=ON -DMS_WITH_CUDA=OFF
  cmake --build build-asan -j "$jobs"
  phase "ASan + UBSan tests"
  # oneDNN and the OpenMP runtime are not instrumented; their internal allocations are not ours.
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan --output-on-failure -j "$jobs" --timeout 900 -LE 'slow|oracle'
fi
phase ""
echo "== all tests passed"
