#!/usr/bin/env bash
# What to run first when a GPU is lent (docs/PERFORMANCE.md, "When a GPU is lent"): one script for one call of the
# device tool, sized for its 15-minute budget. Each stage has its own time limit, runs whether or not an earlier one
# failed, and leaves its log in $OUT (the device tool's output folder; else runs/gpu-check-<host>-<time>):
#   build      Release with -DMS_GPU_TESTS=ON (build-gpu/): megascale, kernels_bench and the GPU test binaries
#   tests      ctest -L gpu -LE sanitizer: the kernels, the backend and training on the GPU against the references
#   kernels    kernels_bench --preset gpu-configs: every launcher timed against its H100 roofline (+ JSON)
#   train-*    megascale train configs/gpt2-small-gpu.yaml with runtime.bf16_operands keep, keep with
#              runtime.activations: bf16 (the fc bias + GeLU in the GEMMs' cuBLASLt epilogues), the same with
#              runtime.gemm_epilogues: false (the bias + GeLU kernels), cast and cublas: step time and MFU against the
#              detected GPU's datasheet bf16 peak, which path ran the GeLU epilogues and what was kept in bf16
#   sanitizer  with the time left: ctest -L sanitizer (compute-sanitizer memcheck, racecheck, synccheck)
# The machine (nvidia-smi) is printed first, a table of stages (exit status, seconds) last; the exit status is 1
# when a stage failed. The training stages need data/fortunes.* (scripts/make_demo_data.sh): carry data/ to the
# device machine.
#   scripts/gpu_check.sh [--budget SECONDS] [--no-build]
#     --budget    seconds for all stages (default 780: 2 minutes of a 15-minute device budget left to spare)
#     --no-build  use build-gpu/ as it is (MS_GPU_BUILD=dir to choose another)
set -uo pipefail
cd "$(dirname "$0")/.."
budget=780
build_it=1
while (($#)); do
  case "$1" in
    --budget) budget="$2"; shift 2 ;;
    --no-build) build_it=0; shift ;;
    *) echo "gpu_check: unknown argument '$1' (usage: scripts/gpu_check.sh [--budget SECONDS] [--no-build])" >&2; exit 2 ;;
  esac
done
build=${MS_GPU_BUILD:-build-gpu}
out=${OUT:-runs/gpu-check-$(hostname -s)-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
start=$(date +%s)
summary=()
failed=0

left() { echo $((budget - ($(date +%s) - start))); }

# stage NAME LIMIT CMD...: runs CMD with at most LIMIT seconds (less when the budget has less), output to
# $out/NAME.log and the terminal's tail; records the exit status.
stage() {
  local name=$1 limit=$2
  shift 2
  local room
  room=$(left)
  if ((room < 20)); then
    summary+=("$(printf '%-24s %-8s %6s' "$name" skipped "-")")
    echo "== $name: skipped, $room s of the budget left"
    return
  fi
  ((limit > room)) && limit=$room
  echo "== $name (at most ${limit}s): $*"
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  tail -n 25 "$out/$name.log"
  ((rc != 0)) && failed=1
  local what="rc $rc"
  ((rc == 124 || rc == 137)) && what="timeout"
  summary+=("$(printf '%-24s %-8s %6d' "$name" "$what" $(($(date +%s) - t0)))")
}

{
  echo "machine: $(hostname -s), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit --format=csv
  else
    echo "nvidia-smi: not found (no NVIDIA driver on this machine)"
  fi
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown); budget ${budget}s; logs in $out"
} | tee "$out/machine.txt"

if ((build_it)); then
  stage build 420 bash -c "cmake -S . -B '$build' -G Ninja -DCMAKE_BUILD_TYPE=Release -DMS_WITH_CUDA=ON \
    -DMS_GPU_TESTS=ON && cmake --build '$build' -j $(nproc) --target megascale kernels_bench test_cuda_backend_gpu \
    test_kernels_gpu"
fi
stage tests 240 ctest --test-dir "$build" -L gpu -LE sanitizer --no-tests=error --output-on-failure --timeout 200
stage kernels 150 "$build/kernels_bench" --preset gpu-configs --json "$out/kernels.json"
if [[ -f data/fortunes.bin ]]; then
  for run in keep keep-bf16act keep-bf16act-noepi cast cublas; do
    extra=()
    [[ $run == *-bf16act* ]] && extra+=(--set runtime.activations=bf16)
    [[ $run == *-noepi ]] && extra+=(--set runtime.gemm_epilogues=false)
    stage "train-$run" 90 "$build/megascale" train configs/gpt2-small-gpu.yaml --no-progress \
      --set train.steps=12 --set runtime.bf16_operands="${run%%-*}" ${extra[@]+"${extra[@]}"} \
      --set log.run_dir="$out/train-$run"
  done
else
  summary+=("$(printf '%-24s %-8s %6s' train "no data" "-")")
  echo "== train: data/fortunes.bin is missing (scripts/make_demo_data.sh; carry data/ to the device machine)"
  failed=1
fi
stage sanitizer 900 ctest --test-dir "$build" -L sanitizer --no-tests=error --output-on-failure

{
  echo
  echo "stage                    result   seconds"
  printf '%s\n' "${summary[@]}"
  echo "training (median over steps 4..: step time, tokens/s, MFU against the detected GPU's datasheet peak):"
  for m in "$out"/train-*/metrics.jsonl; do
    [[ -f $m ]] || continue
    python3 - "$m" <<'PY' || true
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"mfu"' in l]
rows = [r for r in rows if r.get("step", 0) >= 4] or rows
med = lambda k: statistics.median(r[k] for r in rows if k in r)
print(f"  {sys.argv[1].split('/')[-2]:24s} {med('step_s') * 1e3:8.1f} ms  {med('tokens_per_s'):10.0f} tokens/s  "
      f"MFU {100 * med('mfu'):5.1f} %  ({len(rows)} steps)")
PY
  done
  # Which path ran the fc GEMMs' GeLU epilogues (cuBLASLt, or the GEMM + kernel fallback where it had no algorithm).
  # And what runtime.activations: bf16 kept in bf16 (the attention's inputs with the tensor-core attention).
  grep -h -e "fc GEMMs with the bias + GeLU epilogue" -e "kept in bf16:" "$out"/train-*/train.log \
    "$out"/train-*/logs/rank-0.log 2>/dev/null | sed 's/^/  /' || true
  echo "logs: $out"
} | tee "$out/summary.txt"
exit $failed
