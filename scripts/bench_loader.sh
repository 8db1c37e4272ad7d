#!/usr/bin/env bash
# Benchmark of the data path (issue #13):
#  1. One loader per host (data.loader: shared) against one per rank (per_rank), 4 local ranks (dp 4, and
#     tp 2 x dp 2, where tensor-parallel peers need the same tokens), a tiny model so that the step is
#     short and data preparation shows: host memory for data, bytes
#     read from the dataset, CPU time in data preparation (all ranks summed, from their logs), and the
#     median data_wait_s and step_s of rank 0 (metrics.jsonl, steps after the first 10). REPEAT runs each,
#     interleaved; the median over runs.
#  2. Tokenizer throughput of prepare-data on the demo corpus (every Debian fortune file, ~2.5 MB):
#     byte, and SentencePiece bpe and unigram of VOCAB pieces (training time, encode MB/s, tokens per byte).
#   scripts/bench_loader.sh            # both;  PARTS=1 scripts/bench_loader.sh for one
set -euo pipefail
cd "$(dirname "$0")/.."
build=${MS_BUILD:-build}
repeat=${REPEAT:-3}
steps=${STEPS:-300}
vocab=${VOCAB:-4096}
parts=${PARTS:-1 2}
cmake --build "$build" --target megascale >/dev/null
bin=$(realpath "$build/megascale")
work=$(mktemp -d /tmp/ms-bench-loader-XXXXXX)
trap 'rm -rf "$work"' EXIT
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); $(git rev-parse --short HEAD)"
mapfile -t corpus < <(ls /usr/share/games/fortunes/* | grep -v '\.dat$\|\.u8$')
"$bin" prepare-data --doc-separator % --output "$work/data" "${corpus[@]}" >/dev/null

if [[ " $parts " == *" 1 "* ]]; then
  cat >"$work/job.yaml" <<YAML
name: loader-bench
model: {layers: 1, hidden: 16, heads: 2, ffn_hidden: 32, seq_len: 256, vocab: 256}
train: {steps: $steps, global_batch: 16, micro_batch: 2, seed: 3}
data: {path: $work/data, valid_fraction: 0.01}
log: {interval: 100000, peak_flops: 1.0e10}
runtime: {threads: 1}
YAML
  for layout in "1 4" "2 2"; do
  read -r tp dp <<<"$layout"
  echo "1. 4 ranks (tp $tp x dp $dp), layers 1 hidden 16 seq_len 256, global batch 16 (micro 2), $steps steps, $repeat runs each"
  for r in $(seq "$repeat"); do
    for mode in shared per_rank; do
      "$bin" train "$work/job.yaml" --no-progress --set data.loader=$mode --set parallel.tp=$tp --set parallel.dp=$dp \
        --set log.run_dir="$work/$mode-$tp-$r" >/dev/null 2>&1
    done
  done
  python3 - "$work" "$repeat" "$tp" <<'PY'
import glob, json, re, statistics, sys
work, repeat, tp = sys.argv[1], int(sys.argv[2]), sys.argv[3]
print(f"{'loader':10} {'memory for data':>16} {'dataset bytes read':>19} {'data CPU s':>11} {'data_wait_s/step':>17} {'step_s':>9}")
for mode in ("shared", "per_rank"):
    mem, read, cpu, wait, step = [], [], [], [], []
    for r in range(1, repeat + 1):
        m = rd = c = 0
        for log in glob.glob(f"{work}/{mode}-{tp}-{r}/logs/rank-*.log"):
            for line in open(log):
                g = re.search(r"data \(\w+ loader\): ([\d.]+) s of CPU in data preparation, (\d+) bytes read from the dataset, \d+ bytes of shared memory, (\d+) bytes of memory", line)
                if g:
                    c += float(g.group(1)); rd += int(g.group(2)); m += int(g.group(3))
        rows = [json.loads(l) for l in open(f"{work}/{mode}-{tp}-{r}/metrics.jsonl")]
        train = [x for x in rows if x["phase"] == "train" and x["step"] > 10]
        mem.append(m); read.append(rd); cpu.append(c)
        wait.append(statistics.median(x["data_wait_s"] for x in train))
        step.append(statistics.median(x["step_s"] for x in train))
    med = statistics.median
    print(f"{mode:10} {med(mem) / 2**20:13.2f} MiB {med(read) / 2**20:15.2f} MiB {med(cpu):11.3f} {med(wait) * 1e6:14.1f} us {med(step) * 1e3:6.2f} ms")
PY
  done
fi

if [[ " $parts " == *" 2 "* ]]; then
  echo "2. prepare-data on ${#corpus[@]} fortune files ($(cat "${corpus[@]}" | wc -c) bytes), $(nproc) cores"
  for tok in byte bpe unigram; do
    out=$("$bin" prepare-data --doc-separator % --overwrite --tokenizer $tok --vocab-size "$vocab" \
      --output "$work/tok-$tok" "${corpus[@]}")
    python3 - "$tok" "$out" <<'PY'
import re, sys
tok, out = sys.argv[1], sys.argv[2]
g = re.search(r"(\d+) tokens from (\d+) bytes \(([\d.]+) tokens per byte, \w+ tokenizer of (\d+) pieces\) in ([\d.]+) s", out)
train = re.search(r"\(([\d.]+) s training the tokenizer\)", out)
tokens, nbytes, tpb, pieces, total = int(g.group(1)), int(g.group(2)), float(g.group(3)), int(g.group(4)), float(g.group(5))
t_train = float(train.group(1)) if train else 0.0
encode = max(total - t_train, 1e-9)
print(f"  {tok:8} {pieces:5} pieces: {tpb:.3f} tokens/byte, training {t_train:5.2f} s, tokenize + write {encode:5.2f} s = {nbytes / encode / 1e6:6.1f} MB/s")
PY
  done
fi
