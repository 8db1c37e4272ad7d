#!/usr/bin/env bash
# Benchmark: start-up on the four-node test Slurm (tests/slurm/testcluster.sh) against the local launcher.
#  1. From `sbatch` to the first training step of a 2.2.2 job on 4 nodes x 2 tasks, split into
#     allocation wait (submit -> batch script starts), driver (batch start -> driver ready to launch:
#     checks, locks, redis-server), step launch (srun -> worker processes running), bootstrap (store
#     connect, rendezvous, process groups), model build, first step; and the same job launched locally.
#  2. `megascale init-test --mode real` as a Slurm step of 8 and of 32 tasks (salloc -O) against the
#     local launcher.
# Each figure is the median of REPEAT runs (default 3). Needs root (the test cluster).
#   scripts/bench_slurm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=${MS_BUILD:-build}
repeat=${REPEAT:-3}
cmake --build "$build" --target megascale >/dev/null
bin=$(realpath "$build/megascale")
work=$(mktemp -d "$PWD/.bench-slurm-XXXXXX")  # shared by the nodes (same file system), unlike /tmp on a cluster
cluster=$(mktemp -d /tmp/ms-cluster-XXXXXX)  # short and without spaces (socket paths under it)
trap 'bash tests/slurm/testcluster.sh down "$cluster" >/dev/null 2>&1; rm -rf "$work" "$cluster"' EXIT
bash tests/slurm/testcluster.sh up "$cluster" --nodes 4 --cpus 8
export SLURM_CONF=$cluster/slurm.conf
login() { bash "$root/tests/slurm/testcluster.sh" login "$cluster" -- "$@"; }
"$bin" prepare-data --doc-separator % --output "$work/data" \
  $(ls /usr/share/games/fortunes/* | grep -v '\.dat$\|\.u8$' | head -3) >/dev/null
cat >"$work/job.yaml" <<EOF
name: startup
model: {layers: 4, hidden: 64, heads: 4, seq_len: 32, vocab: 256}
train: {steps: 2, global_batch: 8, micro_batch: 1, seed: 5}
optimizer: {lr: 1.0e-3, warmup_steps: 0}
data: {path: $work/data}
log: {interval: 1, peak_flops: 1.0e10}
runtime: {threads: 1}
parallel: {tp: 2, pp: 2, dp: 2}
EOF
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); slurm $(sinfo -V)"

for ((i = 0; i < repeat; i++)); do
  # Slurm: submit time here, batch start in the script, the rest in rank 0's "startup" row.
  cat >"$work/job-$i.sbatch" <<EOF
#!/bin/bash
#SBATCH --nodes=4 --ntasks-per-node=2 --output=$work/slurm-$i.out
date +%s.%N >"$work/batch-start-$i"
exec "$bin" train "$work/job.yaml" --no-progress --set log.run_dir=$work/slurm-$i
EOF
  date +%s.%N >"$work/submit-$i"
  job=$(login sbatch --parsable "$work/job-$i.sbatch")
  while squeue -h -j "$job" 2>/dev/null | grep -q .; do sleep 0.05; done
  env -u SLURM_CONF "$bin" train "$work/job.yaml" --no-progress --set "log.run_dir=$work/local-$i" >/dev/null 2>&1
done
/usr/bin/python3 - "$work" "$repeat" <<'PY'
import json, statistics, sys
work, n = sys.argv[1], int(sys.argv[2])
def startup(run):
    return next(json.loads(l) for l in open(f"{work}/{run}/metrics.jsonl") if '"startup"' in l)
def split(run, submit=None, batch=None):
    s = startup(run)
    origin = s["origin_unix_ms"] / 1000
    out = {}
    if submit is not None:
        out["allocation wait"] = batch - submit
        out["driver (checks, lock, redis)"] = origin + s["launch_s"] - batch
    else:
        out["allocation wait"] = 0.0
        out["driver (checks, lock, redis)"] = s["launch_s"]
    out["step launch"] = s["worker_start_s"] - s["launch_s"]
    out["bootstrap (rendezvous, groups)"] = s["bootstrap_done_s"] - s["worker_start_s"]
    out["model build"] = s["model_ready_s"] - s["bootstrap_done_s"]
    out["first step"] = s["first_step_done_s"] - s["model_ready_s"]
    out["total to first step"] = sum(out.values())
    return out
rows = {"slurm": [], "local": []}
for i in range(n):
    submit = float(open(f"{work}/submit-{i}").read())
    batch = float(open(f"{work}/batch-start-{i}").read())
    rows["slurm"].append(split(f"slurm-{i}", submit, batch))
    rows["local"].append(split(f"local-{i}"))
print(f"\n2.2.2 job, sbatch on 4 nodes x 2 tasks vs local launch (median of {n}, seconds)")
print(f"{'phase':34s} {'sbatch':>9s} {'local':>9s}")
for k in rows["slurm"][0]:
    med = lambda r: statistics.median(x[k] for x in rows[r])
    print(f"{k:34s} {med('slurm'):9.3f} {med('local'):9.3f}")
PY

echo
echo "init-test --mode real (tp 2, pp 2; seconds, median of $repeat): Slurm step vs local launcher"
printf '%-8s %16s %16s\n' ranks "srun step" "local"
for ranks in 8 32; do
  s=() l=()
  for ((i = 0; i < repeat; i++)); do
    json=$work/init-srun-$ranks-$i.json
    (cd "$work" && login salloc -O --nodes=4 --ntasks="$ranks" "$bin" init-test --mode real --ranks "$ranks" \
      --tp 2 --pp 2 --launcher srun --no-baseline --json "$json" -q >/dev/null 2>&1)
    s+=("$(/usr/bin/python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['runs'][0]['total']['seconds'])" "$json")")
    json=$work/init-local-$ranks-$i.json
    env -u SLURM_CONF "$bin" init-test --mode real --ranks "$ranks" --tp 2 --pp 2 --no-baseline --json "$json" -q \
      >/dev/null 2>&1
    l+=("$(/usr/bin/python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['runs'][0]['total']['seconds'])" "$json")")
  done
  med() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
  printf '%-8s %16.3f %16.3f\n' "$ranks" "$(med "${s[@]}")" "$(med "${l[@]}")"
done
