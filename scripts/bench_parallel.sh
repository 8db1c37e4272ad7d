#!/usr/bin/env bash
# Benchmark: one training step of a model that fits one rank, under 1.1.1 (2 threads), 1.1.2
# (2 ranks x 1 thread) and 2.1.1 (2 ranks x 1 thread), with data-parallel overlap on and off, and
# tensor-parallel communication unchunked and chunked (parallel.tp_comm_chunks=4).
# Prints step time, tokens/s and the exposed-communication fraction (median of steps 2..N).
#   scripts/bench_parallel.sh [job.yaml] [extra --set overrides...]
# Environment: MS_BUILD=<build dir> (default build); LAYOUTS=<regex> runs only the layouts whose
# name matches (e.g. LAYOUTS='^2\.1\.1 seq'); REPEAT=<n> runs each selected layout n times.
set -euo pipefail
cd "$(dirname "$0")/.."
spec=${1:-configs/gpt2-small.yaml}
shift || true
build=${MS_BUILD:-build}
cmake --build "$build" --target megascale >/dev/null
bash scripts/make_demo_data.sh "$build/megascale" >/dev/null
work=$(mktemp -d /tmp/ms-bench-par-XXXXXX)
trap 'rm -rf "$work"' EXIT
common=(--no-progress --set train.steps=8 --set model.layers=4 --set model.hidden=512 --set model.heads=8
        --set train.global_batch=8 --set parallel.bucket_mb=2 --set log.peak_flops=1e11 "$@")
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
echo "job: $spec with ${common[*]:1}"
printf '%-28s %10s %10s %12s %12s\n' layout "step ms" "tokens/s" "exposed comm" "dp launched in bwd"
run() {
  local name=$1 dir=${1// /_}  # no spaces in the run directory (the embedded redis config would break)
  shift
  [[ "$name" =~ ${LAYOUTS:-.} ]] || return 0
  for ((rep = 0; rep < ${REPEAT:-1}; ++rep)); do
    "$build/megascale" train "$spec" "${common[@]}" --set "log.run_dir=$work/$dir" "$@" >/dev/null \
      2>"$work/$dir.err" || { cat "$work/$dir.err"; exit 1; }
    /usr/bin/python3 - "$work/$dir/metrics.jsonl" "$name" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"train"' in l][1:]
med = lambda k: statistics.median(r[k] for r in rows)
print(f"{sys.argv[2]:28s} {med('step_s') * 1e3:10.1f} {med('tokens_per_s'):10.0f} "
      f"{med('comm_exposed_s') / med('step_s') * 100:11.1f}% {med('dp_launched_during_backward'):12.0f}")
PY
  done
}
run "1.1.1 (2 threads)" --set runtime.threads=2
run "1.1.2 overlap" --set parallel.dp=2 --set runtime.threads=1
run "1.1.2 no overlap" --set parallel.dp=2 --set runtime.threads=1 --set parallel.overlap=false
run "1.1.2 zero2 overlap" --set parallel.dp=2 --set parallel.zero=2 --set runtime.threads=1
run "2.1.1" --set parallel.tp=2 --set runtime.threads=1
run "2.1.1 seq-parallel" --set parallel.tp=2 --set parallel.sequence_parallel=true --set runtime.threads=1
run "2.1.1 chunks 4" --set parallel.tp=2 --set parallel.tp_comm_chunks=4 --set runtime.threads=1
run "2.1.1 seq-parallel chunks 4" --set parallel.tp=2 --set parallel.sequence_parallel=true \
  --set parallel.tp_comm_chunks=4 --set runtime.threads=1
