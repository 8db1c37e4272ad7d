#!/usr/bin/env bash
# What to run when a GPU is lent (docs/PERFORMANCE.md, "When a GPU is lent"), sized for the device tool: one call
# runs at most 600 s, the session has 15 minutes of device time (the machine's start included), and at most 8 files
# come back from $OUT. The machine has CUDA, CMake and Python but none of the Debian libraries megascale links and no
# redis-server: carry the binaries built here (scripts/gpu_bundle.sh -> gpu-bundle.tar.xz) and data/, and keep each
# call short, so that device time is left for a call that checks a fix (docs/PERFORMANCE.md, the H200 run):
#   scripts/gpu_check.sh --bundle gpu-bundle.tar.xz --stages tests,kernels,train --budget 240 \
#     --limits tests=100,kernels=60,train=15
#   scripts/gpu_check.sh --bundle gpu-bundle.tar.xz --stages sanitizer --budget 115 --limits sanitizer=105
# Stages (each under its own time limit, in this order, each run whether or not an earlier one failed):
#   build      without --bundle: Release with -DMS_GPU_TESTS=ON in build-gpu/ (needs the Debian libraries)
#   bundle     with --bundle: unpack it, find the machine's CUDA libraries, check that every program loads
#   tests      the tests labelled gpu, not sanitizer (kernels, backend, one-rank and NCCL training against the
#              references): ctest, or scripts/gpu_tests.py on the bundle's tests.json
#   kernels    kernels_bench --preset gpu-configs: every launcher timed against its H100 roofline (+ JSON)
#   train      megascale train configs/gpt2-small-gpu.yaml (12 steps) and configs/gpt-1.3b-gpu.yaml (8 steps) with
#              runtime.bf16_operands: keep, with and without runtime.activations: bf16 (the fc bias + GeLU in the
#              cuBLASLt epilogues), and with it the attention by cuDNN (-cudnn) and the 8-warp dK/dV kernel
#              (-split, runtime.attention_split_dkdv), GPT-2 small's micro-batches as CUDA graphs (-graphs,
#              runtime.cuda_graphs); then GPT-2 small with
#              runtime.attention_stored_ds: false, runtime.gemm_epilogues: false, cast and cublas: step time
#              and MFU against the detected GPU's datasheet bf16 peak, which path ran the GeLU epilogues and what
#              was kept in bf16
#   torch      the PyTorch baseline on the same GPU (bench/torch_gpt_bench.py, the machine's own PyTorch): both GPU
#              configs trained eagerly under bf16 autocast with fused AdamW — step time and MFU by megascale's FLOPs
#              and peak — and their attention through PyTorch's FlashAttention-2, cuDNN and memory-efficient
#              backends beside kernels_bench's tensor-core attention rows (torch-*.json in logs.tar.gz)
#   torch_compile  (only when named) the same for GPT-2 small with torch.compile (its compilation takes a minute or
#              more of device time): the baseline torchtitan-style trainers reach
#   profile    Nsight Compute (ncu --clock-control none; it reads the counters on Firecracker machines, not on gVisor)
#              over one launch of each of training's tensor-core attention rows of kernels_bench at both GPU
#              configs' shapes without a window ($profile_rows: the default forward and stored-dS backward, the
#              wide forward, the split dK/dV kernel, the run-time product bounds, at D = 128 the register-softmax
#              backward; --no-sanity, the kernels stage checks them): per launch its duration, SM / memory / L1
#              throughput, occupancy, registers, shared memory and warp states (profile.csv in logs.tar.gz), one
#              line each in summary.txt (scripts/ncu_summary.py) — where the attention's time goes
#              (docs/PERFORMANCE.md: half the step)
#   sanitizer  the tests labelled sanitizer (compute-sanitizer memcheck, racecheck, synccheck)
# The machine (nvidia-smi) is printed first; after every stage $OUT/summary.txt (the table of stages, exit status and
# seconds, and per training run its median step time, tokens/s and MFU) and $OUT/logs.tar.gz (the text files: logs,
# metrics, specs) are rewritten, so a call cut short still brings back what ran; kernels_bench's JSON is
# $OUT/kernels.json.
# Without $OUT (not on the device tool) the logs stay in runs/gpu-check-<host>-<time>/. Exit status 1 when a stage
# failed.
#   scripts/gpu_check.sh [--bundle FILE] [--stages LIST] [--budget SECONDS] [--limits LIST] [--no-build]
#     --bundle    gpu-bundle.tar.xz from scripts/gpu_bundle.sh (no build on the GPU machine)
#     --stages    comma-separated among tests,kernels,train,torch,torch_compile,profile,sanitizer (default: all
#                 but torch_compile and profile, in that order; those two only when named)
#     --budget    seconds for all stages (default 540: one call's 600 s, less the start and the transfers)
#     --limits    per-stage caps in seconds, e.g. tests=120,kernels=60,train=30 (train: each training run), for a
#                 short first call that leaves device time to rerun after a fix (defaults: tests 290, kernels 150,
#                 train 90 (+50 for the 1.3B runs), torch 90 (each of its two runs), torch_compile 240,
#                 sanitizer 890; each also capped by what the budget has left)
#     --no-build  without --bundle: use build-gpu/ as it is (MS_GPU_BUILD=dir to choose another)
set -uo pipefail
cd "$(dirname "$0")/.."
budget=540
build_it=1
bundle_file=""
stages="tests,kernels,train,torch,sanitizer"  # torch_compile and profile only when named
# The profile stage's kernels_bench rows (their "kernel shape" labels; bench/check_roofline.py checks that this selects
# the 6 rows of GPT-2 small's shape and the 7 of the 1.3B's) and the kernels Nsight Compute profiles: the row terms
# and every tensor-core attention kernel, the layout probe left out. 6 forward and 24 backward launches (3 a backward
# row: row terms, dK/dV, dQ; and the untimed call that checks the register softmax runs at D = 128).
profile_rows='^Attention(Forward|Backward)Bf16 B=[0-9]+ T=[0-9]+ H=[0-9]+ D=[0-9]+ window=0 bf16 (qkv, out16, no bias( varD)?|qkv\+bias, out16 wide|in, dqkv16\+dbias, no bias, stored dS( split| varD| regs)?)$'
profile_kernels='regex:attention_(row_term|forward_tc|forward_wide_tc|dq_tc|dq_ds_tc|dkdv_tc|dkdv_split_tc)_kernel'
usage="usage: scripts/gpu_check.sh [--bundle FILE] [--stages LIST] [--budget SECONDS] [--limits LIST] [--no-build]"
declare -A cap=([tests]=290 [kernels]=150 [train]=90 [torch]=90 [torch_compile]=240 [sanitizer]=890 [profile]=120)
while (($#)); do
  case "$1" in
    --budget) budget="$2"; shift 2 ;;
    --bundle) bundle_file="$2"; shift 2 ;;
    --stages) stages="$2"; shift 2 ;;
    --limits)
      for kv in ${2//,/ }; do
        k=${kv%%=*} v=${kv#*=}
        [[ -n ${cap[$k]+x} && $v =~ ^[0-9]+$ && $v -gt 0 ]] || {
          echo "gpu_check: bad --limits entry '$kv' (STAGE=SECONDS, STAGE among tests, kernels, train, torch," \
            "torch_compile, profile, sanitizer)" >&2
          exit 2
        }
        cap[$k]=$v
      done
      shift 2 ;;
    --no-build) build_it=0; shift ;;
    *) echo "gpu_check: unknown argument '$1' ($usage)" >&2; exit 2 ;;
  esac
done
for s in ${stages//,/ }; do
  case "$s" in
    tests | kernels | train | torch | torch_compile | sanitizer | profile) ;;
    *) echo "gpu_check: unknown stage '$s' in --stages (tests, kernels, train, torch, torch_compile, profile," \
      "sanitizer)" >&2; exit 2 ;;
  esac
done
want() { [[ ",$stages," == *",$1,"* ]]; }
if [[ -n $bundle_file && ! -f $bundle_file ]]; then
  echo "gpu_check: $bundle_file not found: make it here with scripts/gpu_bundle.sh and carry it (carry:" \
    "[\"data\", \"gpu-bundle.tar.xz\"])" >&2
  exit 2
fi
out=${OUT:-}
if [[ -n $out ]]; then
  work=$(mktemp -d /tmp/gpu-check.XXXXXX)
else
  work=runs/gpu-check-$(hostname -s)-$(date +%Y%m%d-%H%M%S)
  out=$work
fi
mkdir -p "$work" "$out"
start=$(date +%s)
summary=()
failed=0

left() { echo $((budget - ($(date +%s) - start))); }

# The summary so far and every log, where the device tool brings them back (at most 8 files: these 2 and
# kernels.json). The machine's own Python and tar, without the bundle's libraries.
publish() {
  {
    cat "$work/machine.txt"
    echo
    echo "stage                    result   seconds"
    printf '%s\n' "${summary[@]}"
    if compgen -G "$work/train-*/metrics.jsonl" >/dev/null; then
      echo "training (median over steps 4..: step time, tokens/s, MFU against the detected GPU's datasheet peak; peak device memory;"
      echo "  the loss at the first and last step: runs of one config on megascale's kernels agree to ~1e-3, a path that computes"
      echo "  something else leaves them — the cuDNN backward of 2829a9d ended GPT-2 small 0.02 and the 1.3B model 0.29 away):"
      for m in "$work"/train-*/metrics.jsonl; do
        env -u LD_LIBRARY_PATH python3 - "$m" <<'PY' || true
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"mfu"' in l]
rows = [r for r in rows if r.get("step", 0) >= 4] or rows
med = lambda k: statistics.median(r[k] for r in rows if k in r)
if rows:
    mem = max((r.get("device_mem_peak_mib", 0) for r in rows), default=0)
    losses = [json.loads(l)["loss"] for l in open(sys.argv[1]) if '"phase": "train"' in l and '"loss"' in l]
    loss = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no loss"
    print(f"  {sys.argv[1].split('/')[-2]:24s} {med('step_s') * 1e3:8.1f} ms  {med('tokens_per_s'):10.0f} tokens/s  "
          f"MFU {100 * med('mfu'):5.1f} %  {mem / 1024:6.2f} GiB  ({len(rows)} steps)  {loss}")
PY
      done
      # Which path ran the fc GEMMs' GeLU epilogues and the qkv GEMMs' bias epilogues (cuBLASLt, or the GEMM +
      # kernel fallback where it had no algorithm), what runtime.activations: bf16 kept in bf16, and which attention
      # backward ran (dS kept or formed again), whether the -graphs run launched graphs.
      grep -h -e "fc GEMMs with the bias + GeLU epilogue" -e "qkv GEMMs with the bias epilogue" -e "kept in bf16:" \
        -e "tensor-core attention backwards:" -e "attention by cuDNN" -e "attention_kernels: cudnn" \
        -e "fused attention (B" -e "CUDA graphs:" -e "runtime.cuda_graphs:" \
        "$work"/train-*/train.log \
        "$work"/train-*/logs/rank-0.log 2>/dev/null | sed 's/^/  /' || true
    fi
    if compgen -G "$work/torch-*.log" >/dev/null; then
      echo "PyTorch on the same GPU (bench/torch_gpt_bench.py: median over steps 4..; attention per backend):"
      grep -h -e "^torch .* on " -e "^PyTorch .*median step" -e "^attention .*causal" -e "^attention .*not run" \
        "$work"/torch-*.log 2>/dev/null | sed 's/^/  /' || true
    fi
    if grep -qs -e "cudnn " -e "^cuDNN attention" "$work/kernels.log"; then
      echo "cuDNN's attention per call (kernels_bench: the plans chosen, then median ms; beside training's rows"
      echo "  '... no bias' (forward) and '... stored dS' (backward) in kernels.log):"
      grep -h -e "^cuDNN attention" -e " cudnn " "$work/kernels.log" | cut -c1-150 | sed 's/^/  /' || true
    fi
    if grep -qs "cuDNN backward form" "$work"/tests/*.log; then
      echo "cuDNN's attention backward per graph form (cuda_backend_gpu; the default: deterministic 0, padding mask 1"
      echo "  at T % 128 != 0 on cuDNN <= 9.15, else 0):"
      grep -h -o "cuDNN backward form.*" "$work"/tests/*.log | sed 's/^/  /' || true
    fi
    if [[ -s $work/profile-summary.txt ]]; then
      echo "Nsight Compute over training's attention rows (scripts/ncu_summary.py of profile.csv; GPT-2 small's"
      echo "  launches, then the 1.3B model's; the kernels' template arguments as in docs/PERFORMANCE.md's ptxas table):"
      sed 's/^/  /' "$work/profile-summary.txt"
    fi
    echo "logs: $work${OUT:+ (and $OUT/logs.tar.gz)}"
  } >"$work/summary.txt"
  if [[ $out != "$work" ]]; then
    cp "$work/summary.txt" "$out/summary.txt"
    [[ -f $work/kernels.json ]] && cp "$work/kernels.json" "$out/kernels.json"
    # Text alone (logs, metrics, summaries, specs), not datasets or checkpoints: it must stay under 16 MiB.
    (cd "$work" && find . -type f \( -name '*.log' -o -name '*.txt' -o -name '*.json' -o -name '*.jsonl' \
      -o -name '*.yaml' -o -name '*.csv' \) -size -4M -print0 | env -u LD_LIBRARY_PATH tar -czf "$out/logs.tar.gz.tmp" --null -T -) &&
      mv "$out/logs.tar.gz.tmp" "$out/logs.tar.gz"
  fi
}

# stage NAME LIMIT CMD...: runs CMD with at most LIMIT seconds (less when the budget has less), output to
# $work/NAME.log and the terminal's tail; records the exit status.
stage() {
  local name=$1 limit=$2
  shift 2
  local room
  room=$(left)
  if ((room < 20)); then
    summary+=("$(printf '%-24s %-8s %6s' "$name" skipped "-")")
    echo "== $name: skipped, $room s of the budget left"
    publish
    return
  fi
  ((limit > room)) && limit=$room
  echo "== $name (at most ${limit}s): $*"
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$work/$name.log" 2>&1
  rc=$?
  tail -n 15 "$work/$name.log"
  local what="rc $rc"
  ((rc == 124 || rc == 137)) && what="timeout"
  ((rc == 77)) && what="skipped"  # a test program's "cannot run here" (no torch, no GPU): not a failure
  ((rc != 0 && rc != 77)) && failed=1
  summary+=("$(printf '%-24s %-8s %6d' "$name" "$what" $(($(date +%s) - t0)))")
  publish
}

{
  echo "machine: $(hostname -s), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
  echo "glibc $(ldd --version 2>/dev/null | head -n 1 | awk '{print $NF}'); $(nvcc --version 2>/dev/null | tail -n 1 ||
    echo 'nvcc not in PATH')"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit --format=csv
  else
    echo "nvidia-smi: not found (no NVIDIA driver on this machine)"
  fi
  # cuDNN: which library the machine has and its version (runtime.attention_kernels: cudnn loads it; the -cudnn
  # training runs use it). The bundle cannot carry it (its engines are ~250 MB).
  env -u LD_LIBRARY_PATH python3 - <<'PY' 2>/dev/null || echo "cudnn: probe failed"
import ctypes, glob, os, subprocess
found = []
try:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    found += [l.split("=>")[-1].strip() for l in out.splitlines() if "libcudnn.so.9" in l]
except OSError:
    pass
for pat in ("/usr/local/cuda*/lib*/libcudnn.so.9", "/usr/lib/x86_64-linux-gnu/libcudnn.so.9",
            "/opt/*/.venv/lib/python3*/site-packages/nvidia/cudnn/lib/libcudnn.so.9",
            "/usr/local/lib/python3*/dist-packages/nvidia/cudnn/lib/libcudnn.so.9"):
    found += glob.glob(pat)
seen = []
for p in found:
    r = os.path.realpath(p)
    if r in seen:
        continue
    seen.append(r)
    try:
        v = ctypes.CDLL(p).cudnnGetVersion()
        print(f"cudnn: {p} version {v // 10000}.{v // 100 % 100}.{v % 100}")
    except OSError as e:
        print(f"cudnn: {p} does not load ({e})")
if not seen:
    print("cudnn: no libcudnn.so.9 found")
PY
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown); stages $stages; budget ${budget}s"
} | tee "$work/machine.txt"

if [[ -n $bundle_file ]]; then
  # The binaries built here, the machine's CUDA libraries (the toolkit's, or the wheels of its PyTorch) after the
  # bundle's own; the bundle's libstdc++ only if the machine's is too old for them.
  # Unpacked by Python (the machine may have no xz program): /tmp/ms-gpu-bundle/gpu-bundle/{bin,lib,...}
  rm -rf /tmp/ms-gpu-bundle
  python3 -c 'import sys, tarfile
t = tarfile.open(sys.argv[1])
t.extractall(sys.argv[2], **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))' "$bundle_file" \
    /tmp/ms-gpu-bundle
  bdir=/tmp/ms-gpu-bundle/gpu-bundle
  cuda_dirs=""
  for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2 libcudnn.so.9; do
    p=$(ldconfig -p 2>/dev/null | awk -v n="$lib" '$1 == n {print $NF; exit}')
    [[ -n $p ]] || p=$(find /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets /usr/lib/x86_64-linux-gnu \
      /usr/local/lib /opt -name "$lib" 2>/dev/null | head -n 1)
    [[ -n $p && ":$cuda_dirs:" != *":$(dirname "$p"):"* ]] && cuda_dirs="$cuda_dirs:$(dirname "$p")"
  done
  orig=${LD_LIBRARY_PATH:-}
  export LD_LIBRARY_PATH="$bdir/lib$cuda_dirs${orig:+:$orig}"
  if ! "$bdir/bin/megascale" --version >/dev/null 2>"$work/loader.txt" && grep -q GLIBCXX "$work/loader.txt"; then
    export LD_LIBRARY_PATH="$bdir/lib:$bdir/lib/fallback$cuda_dirs${orig:+:$orig}"
  fi
  export PATH="$bdir/bin:$PATH:/usr/local/cuda/bin"  # redis-server for the job's bootstrap; compute-sanitizer
  bin=$bdir/bin
  stage bundle 60 bash -c 'cat "$1/MANIFEST.json" | head -n 12; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    rc=0; for p in "$1"/bin/*; do m=$(ldd "$p" | grep "not found"); [[ -z $m ]] || { echo "$p: $m"; rc=1; }; done
    megascale --version && redis-server --version && exit $rc' _ "$bdir"
  # tests_cmd WORK SECONDS LABEL-ARGS...: the bundle's tests.json through scripts/gpu_tests.py
  tests_cmd() { cmd=(python3 scripts/gpu_tests.py --bundle "$bdir" --work "$work/$1" --deadline $(($(date +%s) + $2)) "${@:3}"); }
else
  build=${MS_GPU_BUILD:-build-gpu}
  bin=$build
  if ((build_it)); then
    stage build 420 bash -c "cmake -S . -B '$build' -G Ninja -DCMAKE_BUILD_TYPE=Release -DMS_WITH_CUDA=ON \
      -DMS_GPU_TESTS=ON && cmake --build '$build' -j $(nproc) --target megascale kernels_bench test_cuda_backend_gpu \
      test_kernels_gpu"
  fi
  tests_cmd() { cmd=(ctest --test-dir "$build" "${@:3}" --no-tests=error --output-on-failure --timeout "$2"); }
fi

# The tests' own limit: the stage's, or what the budget has left, less 10 s to record the result.
room() { local r=$(($(left) - 10)); echo $((r < $1 ? r : $1)); }
if want tests; then
  tests_cmd tests "$(room "${cap[tests]}")" -L gpu -LE sanitizer
  stage tests $((cap[tests] + 10)) "${cmd[@]}"
fi
want kernels && stage kernels "${cap[kernels]}" "$bin/kernels_bench" --preset gpu-configs --json "$work/kernels.json"
if want train; then
  if [[ -f data/fortunes.bin ]]; then
    # The likely fastest path first, then as built, the 1.3B config, and the ablations.
    # -nods: the attention backward forming dS again (runtime.attention_stored_ds: false, 7 products).
    # -cudnn: the attention by cuDNN's fused attention (runtime.attention_kernels: cudnn).
    # -split: the attention backward's 8-warp dK/dV kernel (runtime.attention_split_dkdv: true; the same bits).
    # -graphs: each micro-batch's forward and backward launched as a CUDA graph (runtime.cuda_graphs: true).
    # (-cudnn-graphs: both; cuDNN's plans are built and checked in the first, eager, micro-batch.)
    # -autotune: the attention's same-bits kernel variants timed per pass and shape at the first call, the fastest
    # kept (runtime.attention_autotune: true; its log lists every variant's time and any that gave other bits).
    for run in keep-bf16act keep-bf16act-cudnn keep-bf16act-autotune keep-bf16act-split keep-bf16act-graphs \
      keep-bf16act-cudnn-graphs keep-bf16act-nods keep \
      1.3b-keep-bf16act 1.3b-keep-bf16act-cudnn 1.3b-keep-bf16act-autotune 1.3b-keep-bf16act-split 1.3b-keep \
      keep-bf16act-noepi cast cublas; do
      cfg=configs/gpt2-small-gpu.yaml steps=12 mode=$run
      [[ $run == 1.3b-* ]] && cfg=configs/gpt-1.3b-gpu.yaml steps=8 mode=${run#1.3b-}
      extra=()
      [[ $mode == *-bf16act* ]] && extra+=(--set runtime.activations=bf16)
      [[ $mode == *-noepi ]] && extra+=(--set runtime.gemm_epilogues=false)
      [[ $mode == *-nods ]] && extra+=(--set runtime.attention_stored_ds=false)
      [[ $mode == *-cudnn* ]] && extra+=(--set runtime.attention_kernels=cudnn)
      [[ $mode == *-split ]] && extra+=(--set runtime.attention_split_dkdv=true)
      [[ $mode == *-autotune ]] && extra+=(--set runtime.attention_autotune=true)
      [[ $mode == *-graphs* ]] && extra+=(--set runtime.cuda_graphs=true)
      limit=${cap[train]}
      [[ $run == 1.3b-* ]] && limit=$((limit + 50))  # its startup: ~35 s on an H200 (1.3 B parameters drawn on the host)
      stage "train-$run" "$limit" "$bin/megascale" train "$cfg" --no-progress --set train.steps=$steps \
        --set runtime.bf16_operands="${mode%%-*}" ${extra[@]+"${extra[@]}"} --set log.run_dir="$work/train-$run"
    done
    # With two GPUs or more (no lent machine has had them yet), GPT-2 small across two: data parallelism with ZeRO-1,
    # its parameter all-gathers moving the bf16 weight copies and (-gather32) the fp32 parameters as before; tensor
    # parallelism with sequence parallelism, its sums in fp32 and (-sums16) in bf16 fused into the GEMMs, and
    # (-graphs) launched as CUDA graphs, collectives included. Each pair differs in one switch: docs/PERFORMANCE.md's
    # "What is left" items 2 and 4 expect these gains and none is measured.
    ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    if ((ngpu >= 2)); then
      for run in dp2-zero1 dp2-zero1-gather32 tp2-sp tp2-sp-sums16 tp2-sp-graphs; do
        extra=(--set runtime.activations=bf16) envs=()
        [[ $run == dp2-* ]] && extra+=(--set parallel.dp=2 --set parallel.zero=1)
        [[ $run == tp2-* ]] && extra+=(--set parallel.tp=2 --set parallel.sequence_parallel=true)
        [[ $run == *-gather32 ]] && envs+=(MEGASCALE_ZERO_GATHER=fp32)
        [[ $run == *-sums16 ]] && extra+=(--set parallel.tp_reduce_dtype=bf16)
        [[ $run == *-graphs ]] && extra+=(--set runtime.cuda_graphs=true)
        stage "train-$run" "$((cap[train] + 20))" env ${envs[@]+"${envs[@]}"} "$bin/megascale" train \
          configs/gpt2-small-gpu.yaml --no-progress --set train.steps=12 --set runtime.bf16_operands=keep "${extra[@]}" \
          --set log.run_dir="$work/train-$run"
      done
    fi
  else
    summary+=("$(printf '%-24s %-8s %6s' train "no data" "-")")
    echo "== train: data/fortunes.bin is missing (scripts/make_demo_data.sh; carry data/ to the device machine)"
    failed=1
  fi
fi
if want torch; then
  # The machine's own PyTorch (not the bundle's libraries); the same configs and step counts as the train stage.
  for run in gpt2-small:configs/gpt2-small-gpu.yaml:12 1.3b:configs/gpt-1.3b-gpu.yaml:8; do
    IFS=: read -r tag cfg steps <<<"$run"
    stage "torch-$tag" "${cap[torch]}" env -u LD_LIBRARY_PATH PYTHONUNBUFFERED=1 python3 bench/torch_gpt_bench.py \
      --config "$cfg" --steps "$steps" --attention --json "$work/torch-$tag.json"
  done
fi
if want torch_compile; then
  stage torch-gpt2-small-compiled "${cap[torch_compile]}" env -u LD_LIBRARY_PATH PYTHONUNBUFFERED=1 python3 \
    bench/torch_gpt_bench.py --config configs/gpt2-small-gpu.yaml --steps 12 --compile \
    --json "$work/torch-gpt2-small-compiled.json"
fi
if want profile; then
  # One launch of each selected row (--iters 1, no warm-up, no sanity launches), GPT-2 small's shape first (B 16,
  # T 1024, H 12, D 64), then the 1.3B model's (B 4, T 2048, H 16, D 128); the CSV's Grid Size tells them apart.
  ncu_bin=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
  if [[ -z $ncu_bin ]]; then
    summary+=("$(printf '%-24s %-8s %6s' profile "no ncu" "-")")
    echo "== profile: ncu (Nsight Compute) is not on this machine"
    failed=1
  else
    # Besides the sections: the tensor pipe's busy share and the warps stalled per issue by reason — those of them
    # this ncu knows on this GPU (--query-metrics; an unknown metric would stop the whole profile).
    known=$(timeout 60 "$ncu_bin" --query-metrics --csv 2>/dev/null | awk -F, 'NR > 1 {gsub(/"/, "", $1); print $1}')
    metrics=()
    for mt in sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
      sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active; do
      if grep -qx "${mt%%.*}" <<<"$known"; then metrics+=("$mt"); break; fi
    done
    for r in long_scoreboard short_scoreboard barrier mio_throttle math_pipe_throttle wait not_selected lg_throttle \
      membar dispatch_stall no_instruction branch_resolving; do
      mt=smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
      grep -qx "${mt%%.*}" <<<"$known" && metrics+=("$mt")
    done
    echo "== profile: ${#metrics[@]} metrics besides the sections: ${metrics[*]:-none}"
    metric_args=()
    ((${#metrics[@]})) && metric_args=(--metrics "$(IFS=,; echo "${metrics[*]}")")
    stage profile "${cap[profile]}" bash -c '"$1" --clock-control none --kernel-name "$4" --launch-count 48 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis "${@:7}" --csv --page details "$2" --preset gpu-configs --rows "$5" \
      --no-sanity --iters 1 --warmup 0 >"$3/profile.csv" &&
      env -u LD_LIBRARY_PATH python3 "$6" "$3/profile.csv" >"$3/profile-summary.txt" && cat "$3/profile-summary.txt"' \
      _ "$ncu_bin" "$bin/kernels_bench" "$work" "$profile_kernels" "$profile_rows" "$PWD/scripts/ncu_summary.py" \
      "${metric_args[@]}"
  fi
fi
if want sanitizer; then
  tests_cmd sanitizer "$(room "${cap[sanitizer]}")" -L sanitizer
  stage sanitizer $((cap[sanitizer] + 10)) "${cmd[@]}"
fi
publish
cat "$work/summary.txt"
exit $failed
