#!/usr/bin/env bash
# Benchmark: the peak memory of a data-parallel rank (VmHWM, the resident high-water mark of the
# largest worker process, sampled every 0.1 s until the job ends) for zero 0, 1 and 2 at dp 2, on
# configs/gpt2-small.yaml (85M parameters at the byte vocabulary) shrunk to seq 32 and 2 steps:
# the model's buffers, the optimizer state and the data-parallel engine's, not activations.
#   scripts/bench_zero_memory.sh [megascale binary] [extra --set overrides...]
# Environment: MS_BUILD=<build dir> (default build) when no binary is given.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${MS_BUILD:-build}
bin=${1:-$build/megascale}
shift || true
if [ "$bin" = "$build/megascale" ]; then cmake --build "$build" --target megascale >/dev/null; fi
bash scripts/make_demo_data.sh "$bin" >/dev/null
work=$(mktemp -d)  # removed on exit
trap 'rm -rf "$work"' EXIT
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); binary $bin"
for zero in 0 1 2; do
  "$bin" train configs/gpt2-small.yaml --no-progress --set parallel.dp=2 --set parallel.zero=$zero \
    --set runtime.threads=1 --set model.seq_len=32 --set train.steps=2 --set log.run_dir="$work/run-$zero" "$@" \
    >"$work/log-$zero" 2>&1 &
  driver=$! peak=0
  while kill -0 $driver 2>/dev/null; do
    for p in $(pgrep -P $driver || true); do
      kb=$(awk '/^VmHWM/ {print $2}' "/proc/$p/status" 2>/dev/null || true)
      if [ -n "$kb" ] && [ "$kb" -gt "$peak" ]; then peak=$kb; fi
    done
    sleep 0.1
  done
  if ! wait $driver; then echo "zero $zero: the job failed:"; tail -5 "$work/log-$zero"; exit 1; fi
  buffers=$(grep -o "data-parallel buffers hold .*" "$work/log-$zero" || echo "(no data-parallel buffers line)")
  printf 'zero %d: rank peak %5d MiB; %s\n' "$zero" $((peak / 1024)) "$buffers"
  grep -o "zero 2: no gradient buffer.*" "$work/log-$zero" | sed 's/^/        /' || true
done
