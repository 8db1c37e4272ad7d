#!/usr/bin/env bash
# Benchmark of the fault-tolerance machinery (issue #12):
#  1. Heartbeat and monitoring overhead: the same 2-rank job with fault.heartbeat_s 0.25 (8x the
#     default rate) and 0 (no heartbeat thread, no monitoring), interleaved REPEAT times; the median
#     step time of steps 6..STEPS of each run, then the median over runs.
#  2. Detection and recovery time per injected fault kind: tests/runner/fault_test.py's table.
#  3. libfabric point-to-point between two ranks on this machine: `megascale self-check` (2 ranks)
#     against fi_pingpong (libfabric-bin) on the same provider, 8-byte latency and 1 MiB bandwidth.
#   scripts/bench_fault.sh            # all three;  PARTS="1 3" scripts/bench_fault.sh for some
set -euo pipefail
cd "$(dirname "$0")/.."
build=${MS_BUILD:-build}
repeat=${REPEAT:-3}
steps=${STEPS:-40}
provider=${PROVIDER:-tcp}
parts=${PARTS:-1 2 3}
cmake --build "$build" --target megascale >/dev/null
bin=$(realpath "$build/megascale")
work=$(mktemp -d /tmp/ms-bench-fault-XXXXXX)
trap 'rm -rf "$work"' EXIT
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); $(git rev-parse --short HEAD)"
"$bin" prepare-data --doc-separator % --output "$work/data" \
  $(ls /usr/share/games/fortunes/* | grep -v '\.dat$\|\.u8$' | head -3) >/dev/null
spec() {  # name heartbeat_s
  cat >"$work/$1.yaml" <<YAML
name: $1
model: {layers: 4, hidden: 128, heads: 4, seq_len: 128, vocab: 256}
train: {steps: $steps, global_batch: 8, seed: 3}
data: {path: $work/data}
log: {interval: 1000, peak_flops: 1.0e10, run_dir: $work/$1}
runtime: {threads: 1}
parallel: {dp: 2}
fault: {heartbeat_s: $2, straggler_steps: 0}
YAML
  echo "$work/$1.yaml"
}
median_step() {  # run_dir -> median step_s of steps > 5
  python3 -c "
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1] + '/metrics.jsonl')]
print(statistics.median(r['step_s'] for r in rows if r.get('phase') == 'train' and r['step'] > 5))" "$1"
}

if [[ " $parts " == *" 1 "* ]]; then
  echo "== 1. heartbeat overhead: 2 ranks, $steps steps, $repeat interleaved runs each"
  on=() off=()
  for ((i = 0; i < repeat; i++)); do
    for hb in 0.25 0; do
      name=hb-$hb-$i
      "$bin" train "$(spec "$name" "$hb")" --no-progress >/dev/null 2>&1
      m=$(median_step "$work/$name")
      if [[ $hb == 0 ]]; then off+=("$m"); else on+=("$m"); fi
      rm -rf "${work:?}/$name"
    done
  done
  python3 - "${on[*]}" "${off[*]}" <<'PY'
import statistics, sys
on = [float(x) for x in sys.argv[1].split()]
off = [float(x) for x in sys.argv[2].split()]
m_on, m_off = statistics.median(on), statistics.median(off)
print(f"step time, heartbeats every 0.25 s: {m_on*1e3:.2f} ms (runs: {', '.join(f'{x*1e3:.2f}' for x in on)})")
print(f"step time, no heartbeats:          {m_off*1e3:.2f} ms (runs: {', '.join(f'{x*1e3:.2f}' for x in off)})")
print(f"overhead: {100 * (m_on - m_off) / m_off:+.2f}%")
PY
fi

if [[ " $parts " == *" 2 "* ]]; then
  echo "== 2. detection and recovery per fault kind (tests/runner/fault_test.py)"
  python3 tests/runner/fault_test.py "$bin" "$work/faults" 2>/dev/null | sed -n '/^fault /,$p'
fi

if [[ " $parts " == *" 3 "* ]]; then
  echo "== 3. libfabric point-to-point, provider $provider: megascale self-check (2 ranks) vs fi_pingpong"
  "$bin" self-check "$(spec selfcheck 2)" --provider "$provider" >/dev/null 2>&1 || true
  python3 -c "
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    for l in filter(None, r['links'].split(',')):
        peer, lat, bw = l.split(':')
        print(f'megascale self-check: rank {r[\"rank\"]} - rank {peer}: latency {float(lat)*1e6:.1f} us (8 B), bandwidth {float(bw)/1e6:.0f} MB/s (1 MiB)')
" "$work/selfcheck/self_check.jsonl"
  if command -v fi_pingpong >/dev/null; then
    for size in 8 1048576; do
      iters=$((size == 8 ? 10000 : 1000))
      port=$((20000 + RANDOM % 20000))
      fi_pingpong -p "$provider" -e rdm -B "$port" -I "$iters" -S "$size" >/dev/null 2>&1 &
      server=$!
      sleep 0.5
      echo "fi_pingpong -p $provider -e rdm -S $size -I $iters (usec/xfer: one-way time of a ping-pong):"
      fi_pingpong -p "$provider" -e rdm -P "$port" -I "$iters" -S "$size" 127.0.0.1 2>&1 | tail -n 2 | sed 's/^/  /'
      wait "$server" || true
    done
  else
    echo "fi_pingpong not installed (apt-get install libfabric-bin): no comparison"
  fi
fi
