#!/usr/bin/env bash
# Benchmark: tokens/s and achieved model FLOP/s of training steps of a job spec (default:
# the GPT-2-small shape of configs/gpt2-small.yaml), next to this machine's measured fp32
# GEMM peak (ops_bench). Prints what it measured and the machine it ran on.
#   scripts/bench_step.sh [job.yaml] [extra --set overrides...]
# Needs the Release build (scripts/test.sh or cmake --build build) and data/fortunes.
set -euo pipefail
cd "$(dirname "$0")/.."
spec=${1:-configs/gpt2-small.yaml}
shift || true
threads=${MS_BENCH_THREADS:-$(nproc)}
cmake --build build --target megascale ops_bench >/dev/null
bash scripts/make_demo_data.sh build/megascale >/dev/null
run_dir=$(mktemp -d /tmp/ms-bench-XXXXXX)
trap 'rm -rf "$run_dir"' EXIT

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), threads $threads"
# The peak: best of three runs (this VM's throughput varies from run to run).
peak=$(for _ in 1 2 3; do OMP_NUM_THREADS=$threads build/tests/ops/ops_bench --peak-only 2>/dev/null; done |
  sort -g | tail -1)
build/megascale train "$spec" --no-progress --set "log.run_dir=$run_dir" --set "runtime.threads=$threads" "$@" \
  2> "$run_dir/stderr" > /dev/null || { cat "$run_dir/stderr"; exit 1; }
/usr/bin/python3 - "$run_dir/metrics.jsonl" "$spec" "$peak" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"train"' in l]
spec, peak = sys.argv[2], sys.argv[3]
steady = rows[1:] if len(rows) > 1 else rows  # step 1 includes warm-up
med = lambda k: statistics.median(r[k] for r in steady)
print(f"job: {spec}, {len(rows)} steps (median of steps 2..{len(rows)})")
print(f"step time      {med('step_s') * 1e3:9.1f} ms")
print(f"tokens/s       {med('tokens_per_s'):9.0f}")
print(f"model FLOP/s   {med('flops_per_s') / 1e9:9.1f} GFLOP/s")
if peak:
    p = float(peak)
    print(f"GEMM peak      {p / 1e9:9.1f} GFLOP/s (ops_bench --peak-only: best of 3, fp32 2048^3 GEMM)")
    print(f"fraction       {med('flops_per_s') / p * 100:9.1f} % of the GEMM peak")
PY
