#!/usr/bin/python3
"""The CUDA backend, built in emulated mode (megascale-emu: every kernel on the SIMT emulator, cuBLAS and the
CUDA runtime on their CPU implementations), trains a tiny GPT and must match the CPU backend's losses:

  fp32 GEMMs (train.precision fp32): every step's loss within 1e-4 relative (kernels accumulate in fp32 in
                                     other orders than the CPU ops);
  bf16 GEMMs (train.precision bf16): within 5e-3 relative (operands rounded to bf16, fp32 accumulation);
  the gradient norms of every step within the same tolerances;

on one rank (1.1.1, also with a padded vocabulary, and bf16 with runtime.bf16_operands: cublas) and on two
data-parallel ranks (1.1.2, the emulated NCCL; bootstrap through the embedded Redis), with the parallel and the
sequential block, AdamW and LAMB, and a sliding window. Also: a checkpoint written by the emulated CUDA run
(parameters and optimizer state staged from device memory) resumes on the CPU backend, and a CPU checkpoint
resumes on the emulated CUDA backend, both continuing on the uninterrupted run's losses; and the kept bf16 GEMM
operands (runtime.bf16_operands: keep, the default: roundings written by the LayerNorms and the bias + GeLU or by
the GEMMs, weights once per step, or by the optimizer with its update) give the bits of casting at every GEMM
(`cast`), fused and unfused, on one rank and on two, while a planted stale copy (MEGASCALE_PLANT=kept_bf16_stale,
MEGASCALE_PLANT=optimizer_bf16_unwritten) is caught; runtime.attention_autotune gives the bits of a run without
it, and leaves out candidates made to differ (MEGASCALE_PLANT=autotune_disagree); runtime.attention_kernels: cudnn is refused by megascale-emu and,
on a GPU, trains on the CPU backend's losses with every attention call cuDNN's (none found wrong by its check). Every CUDA-backend train row carries rank 0's peak device
memory so far (device_mem_peak_mib, never falling; none on the CPU backend), and `megascale bench` on the CUDA
backend reports it per point (table, CSV, JSON).

Usage: train_emulated_test.py MEGASCALE MEGASCALE_EMU WORK_DIR [--gpu] [--quick] [--sanitizer COMPUTE_SANITIZER]
  (--gpu: MEGASCALE_EMU is a megascale built with nvcc and the runs use the real GPU: the `gpu` ctest label; the
   two-rank cases then use NCCL groups and two GPUs, and are skipped on a machine with one;
   --sanitizer: every run of MEGASCALE_EMU under compute-sanitizer --tool memcheck, its child processes included)
"""
import csv
import glob
import json
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpus import fortune_corpus, gpu_count  # noqa: E402

BIN, EMU, WORK = (os.path.abspath(a) for a in sys.argv[1:4])
# With --gpu, EMU is the GPU build of megascale and the same comparisons run on a real GPU (ctest -L gpu).
GPU = "--gpu" in sys.argv[4:]
QUICK = "--quick" in sys.argv[4:]  # the sanitizer build: one case per layout, plus the checkpoint crossover
SANITIZER = sys.argv[sys.argv.index("--sanitizer") + 1] if "--sanitizer" in sys.argv else None
EXPECT = "cuda on" if GPU else "cuda (emulated)"
failures = []
skipped = []
passed = []


def run(binary, *args, env=None):
    cmd = [binary, *args]
    if SANITIZER and binary == EMU:
        cmd = [SANITIZER, "--tool", "memcheck", "--target-processes", "all", "--report-api-errors", "no",
               "--error-exitcode", "99", *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=dict(os.environ, **(env or {})))
    return p.returncode, p.stdout, p.stderr


def series(run_dir, key):
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {r["step"]: r[key] for r in rows if r["phase"] == "train"}


def spec(path, run_dir, extra):
    with open(path, "w") as f:
        f.write(f"""name: emu
model: {{layers: 2, hidden: 64, heads: 4, seq_len: 32, vocab: 256, attention: {{window: 12}}}}
train: {{steps: 6, global_batch: 4, seed: 5}}
optimizer: {{kind: adamw, lr: 3.0e-3, warmup_steps: 2}}
data: {{path: {DATA}}}
log: {{run_dir: {run_dir}, interval: 1}}
runtime: {{threads: 1}}
{extra}""")


def compare(name, extra, sets, rtol, emu_sets=(), log_has=None):
    """The CPU backend (fp32 GEMMs) and the emulated CUDA backend (sets, then emu_sets: keys only it takes) give
    the same losses and gradient norms within rtol (and the emulated run's log holds log_has, if given: a string, or
    a list of strings that must all be there)."""
    cpu_dir, emu_dir = os.path.join(WORK, name + "-cpu"), os.path.join(WORK, name + "-emu")
    path = os.path.join(WORK, name + ".yaml")
    spec(path, cpu_dir, extra)
    args = ["train", path]
    for s in sets:
        args += ["--set", s]
    rc, _, err = run(BIN, *args, "--set", "train.precision=fp32")
    if rc != 0:
        return f"cpu run failed: {err.strip()[-800:]}"
    emu_args = [a for s in emu_sets for a in ("--set", s)]
    rc, out, err = run(EMU, *args, *emu_args, "--set", f"log.run_dir={emu_dir}", "--set", "runtime.backend=cuda")
    if rc != 0:
        return f"emulated cuda run failed: {err.strip()[-800:]}"
    log = open(os.path.join(emu_dir, "train.log" if os.path.exists(os.path.join(emu_dir, "train.log"))
                            else "logs/rank-0.log")).read()
    if f"compute: {EXPECT}" not in log:
        return f"the run's log does not say it computed on the backend '{EXPECT}'"
    for want in [log_has] if isinstance(log_has, str) else log_has or []:
        alternatives = want if isinstance(want, tuple) else (want,)  # a tuple: any one of them
        if not any(w in log for w in alternatives):
            return f"the run's log has no line with '{' or '.join(alternatives)}'"
    # Rank 0's peak device memory so far, in every train row of the CUDA backend (never falling), none on the CPU's.
    mem = [r.get("device_mem_peak_mib") for r in map(json.loads, open(os.path.join(emu_dir, "metrics.jsonl")))
           if r["phase"] == "train"]
    if not mem or not all(isinstance(m, float) and m > 0 for m in mem) or mem != sorted(mem):
        return f"the CUDA backend's train rows do not all carry a growing device_mem_peak_mib: {mem}"
    if any("device_mem_peak_mib" in l for l in open(os.path.join(cpu_dir, "metrics.jsonl"))):
        return "the CPU backend's metrics carry a device_mem_peak_mib"
    for key, tol in (("loss", rtol), ("grad_norm", rtol)):
        a, b = series(cpu_dir, key), series(emu_dir, key)
        if sorted(a) != sorted(b) or not a:
            return f"different steps: {sorted(a)} vs {sorted(b)}"
        worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in a)
        print(f"     {name}: {len(a)} steps, worst relative {key} difference {worst:.2e} (tolerance {tol:g})")
        if not worst <= tol:
            return f"{key} differs by {worst:.3e} relative (> {tol}): cpu {a} cuda {b}"
    return None


def same_bits(name, extra, sets, a, b, env_b=None, expect_differ=False, logs=()):
    """Two runs of the CUDA backend that must give the same bits (`expect_differ`: a planted bug must not); logs:
    (run 0 or 1, a string its log must hold) pairs."""
    dirs = [os.path.join(WORK, f"{name}-{i}") for i in (0, 1)]
    path = os.path.join(WORK, name + ".yaml")
    spec(path, dirs[0], extra)
    for d, variant, env in ((dirs[0], a, None), (dirs[1], b, env_b)):
        args = ["train", path, "--set", f"log.run_dir={d}", "--set", "runtime.backend=cuda"]
        for s in [*sets, *variant]:
            args += ["--set", s]
        rc, _, err = run(EMU, *args, env=env)
        if rc != 0:
            return f"run {' '.join(variant)} failed: {err.strip()[-800:]}"
    for i, want in logs:
        log = open(os.path.join(dirs[i], "train.log" if os.path.exists(os.path.join(dirs[i], "train.log"))
                                else "logs/rank-0.log")).read()
        if want not in log:
            return f"the log of run {' '.join((a, b)[i])} has no line with '{want}'"
    differ = []
    for key in ("loss", "grad_norm"):
        x, y = series(dirs[0], key), series(dirs[1], key)
        if sorted(x) != sorted(y) or not x:
            return f"different steps: {sorted(x)} vs {sorted(y)}"
        steps = [s for s in sorted(x) if x[s] != y[s]]
        print(f"     {name}: {len(x)} steps, {key} {'identical' if not steps else f'differs at steps {steps}'}")
        if steps:
            differ.append(f"{key}: {' '.join(a)} {x} vs {' '.join(b)} {y}")
    if expect_differ:
        return None if differ else "the planted bug went unnoticed: losses and grad norms are the same bits"
    return "; ".join(differ) or None


def case(name, *a, check=compare):
    if QUICK and name not in ("fp32-111-parallel", "bf16-112-sequential-zero1"):
        skipped.append(name)
        return
    layout = re.search(r"-(\d)(\d)(\d)-", name)  # tp pp dp: one GPU a rank
    need = int(layout[1]) * int(layout[2]) * int(layout[3]) if layout else 1
    if GPU and gpu_count() < need:
        # The ranks of a host use devices 0, 1, ... (NCCL groups): not possible on a machine with fewer GPUs.
        print(f"skip {name}: {need} ranks need {need} GPUs, {gpu_count()} visible")
        skipped.append(name)
        return
    err = check(name, *a)
    print(("ok   " if err is None else "FAIL ") + name + ("" if err is None else ": " + err))
    if err is not None:
        failures.append(name)
    else:
        passed.append(name)


shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
corpus = fortune_corpus()
DATA = os.path.join(WORK, "fortunes")
rc, _, err = run(BIN, "prepare-data", "--doc-separator", "%", "--output", DATA, *corpus[:4])
if rc != 0:
    sys.exit(f"prepare-data failed: {err}")

case("fp32-111-parallel", "", ["train.precision=fp32"], 1e-4)
case("fp32-111-sequential-lamb", "", ["train.precision=fp32", "model.block=sequential", "optimizer.kind=lamb"], 1e-4)
case("bf16-111-parallel", "", ["train.precision=bf16"], 5e-3)
# cuBLAS converting the fp32 operands itself (CUBLAS_COMPUTE_32F_FAST_16BF) instead of the cast kernels.
case("bf16-111-cublas-operands", "", ["train.precision=bf16", "runtime.bf16_operands=cublas"], 5e-3)
case("fp32-112-parallel", "parallel: {dp: 2}", ["train.precision=fp32"], 1e-4)
case("bf16-112-sequential-zero1", "parallel: {dp: 2, zero: 1}", ["train.precision=bf16", "model.block=sequential"], 5e-3)
# A padded vocabulary (300 tokens held as 384 rows): the classifier's padding mask goes through the backend's
# GEMM bias on the device.
case("fp32-111-padded-vocab", "", ["train.precision=fp32", "model.vocab=300", "model.vocab_pad_to=128"], 1e-4)
# runtime.bf16_operands: keep (the default: bf16 weights cast once per step, each layer input once per micro-batch,
# kept for the backward) gives the bits of `cast` (every GEMM casts its operands), over 2 micro-batches a step; with
# the kept weights never recast after the first step (a planted bug) the runs part.
KEEP = ["runtime.bf16_operands=keep"]
case("bf16-111-keep-is-cast", "parallel: {micro_batches: 2}", ["train.precision=bf16"], KEEP,
     ["runtime.bf16_operands=cast"], check=same_bits)
# The unfused ablation (runtime.fused_kernels: false): the GeLU writes no rounding, the fc-proj GEMM casts.
case("bf16-111-keep-is-cast-unfused", "parallel: {micro_batches: 2}",
     ["train.precision=bf16", "model.block=sequential", "runtime.fused_kernels=false"], KEEP,
     ["runtime.bf16_operands=cast"], check=same_bits)
# runtime.activations: bf16 (the fc GEMM writes its output in bf16, which the bias + GeLU reads forward and
# backward; the fc projection's backward writes the GeLU output's gradient in bf16, which the bias + GeLU backward
# reads; at tp 1 the logits are bf16): within the bf16 tolerance of the CPU backend's fp32 losses, and `keep` =
# `cast` bit for bit with it.
# With `keep` the fc bias + GeLU run in the fc GEMM's cuBLASLt epilogue (GELU_AUX_BIAS) and their gradient in the
# fc projection's backward GEMM's (DGELU; runtime.gemm_epilogues, on by default): within the same tolerance. Where
# cuBLASLt has no algorithm (here: 4C = 180 columns, an aux leading dimension that is not a multiple of 8) the
# backend's fallback (the GEMM, then the bias + GeLU kernel) keeps the same contract.
# With the tensor-core attention (D = 16 here) the attention's inputs are bf16 too (qkv written by its GEMM, the output
# gradient by the projection's backward GEMM, the output read back as its kept rounding); with the fp32 attention
# (D = 15 in the fallback case) they stay fp32. At tp 1 the LayerNorm input gradients that one GEMM writes are bf16
# too (the sequential block's two and the final LayerNorm's; the parallel block's first LayerNorm sums two GEMMs and
# stays fp32), and with the sequential block the attention and MLP projections' outputs, which the residual adds read.
# With bf16 attention inputs the qkv GEMM adds its bias in its epilogue too (BIAS: 20 forwards, validation's
# included), so the attention kernels add none; on a GPU either path passes.
EPI = "fc GEMMs with the bias + GeLU epilogue: "
QKV = "qkv GEMMs with the bias epilogue: "
QKV_LT = QKV + "20 by cuBLASLt, 0 by the GEMM + kernel fallback"
# ... and its backward keeps dS between its two kernels (runtime.attention_stored_ds: 5 products), 12 times.
ATT = "tensor-core attention backwards: "
KEPT = "kept in bf16: fc output, GeLU output gradient, logits"
case("bf16-111-bf16-activations", "", ["train.precision=bf16", "model.block=sequential"], 5e-3,
     ["runtime.activations=bf16"],
     [EPI + "32 by cuBLASLt, 0 by the GEMM + kernel fallback",
      (QKV_LT, QKV + "0 by cuBLASLt, 20 by the GEMM + kernel fallback") if GPU else QKV_LT,
      ATT + "12 with dS kept (5 products), 0 forming dS again (7 products)",
      KEPT + ", qkv, attention output gradient, attention output, attention and MLP projection outputs, "
      "LayerNorm input gradients\n"])
# ... and at tp 1 the logits in bf16 too (the classifier GEMM writes them rounded, the cross-entropy reads them and
# writes their gradient over them), with a padded vocabulary kept out of the softmax by the cross-entropy itself.
case("bf16-111-bf16-logits-padded-vocab", "", ["train.precision=bf16", "model.vocab=300", "model.vocab_pad_to=128"],
     5e-3, ["runtime.activations=bf16"])
# (The emulated cuBLASLt has no algorithm for fc widths that are not a multiple of 8; the real one may have: cuBLAS
# 13.1 on an H200 ran all 32 there, so on a GPU either path passes.)
FALLBACK = EPI + "0 by cuBLASLt, 32 by the GEMM + kernel fallback"
case("bf16-111-gemm-epilogue-fallback", "", ["train.precision=bf16", "model.heads=3", "model.hidden=45"], 5e-3,
     ["runtime.activations=bf16"],
     [(FALLBACK, EPI + "32 by cuBLASLt, 0 by the GEMM + kernel fallback") if GPU else FALLBACK,
      KEPT + ", final LayerNorm input gradient\n"])
case("bf16-111-bf16-activations-keep-is-cast", "parallel: {micro_batches: 2}",
     ["train.precision=bf16", "runtime.activations=bf16"], [*KEEP, "runtime.gemm_epilogues=false"],
     ["runtime.bf16_operands=cast"], check=same_bits)
case("bf16-111-bf16-activations-keep-is-cast-sequential", "parallel: {micro_batches: 2}",
     ["train.precision=bf16", "runtime.activations=bf16", "model.block=sequential"],
     [*KEEP, "runtime.gemm_epilogues=false"], ["runtime.bf16_operands=cast"], check=same_bits)
# The tensor-core attention backward with dS kept between its kernels (runtime.attention_stored_ds, the default: 5
# products) gives the bits of the one that forms dS again (7) under the emulator, where the register softmax's S^T and
# S are summed in the same order (on a GPU the tensor cores' own orders may differ in the last bits: skipped there); the
# logs say which ran.
if GPU:
    print("skip attention-stored-ds-same-bits: the same bits only under the emulator")
    skipped.append("attention-stored-ds-same-bits")
else:
    case("attention-stored-ds-same-bits", "parallel: {micro_batches: 2}", ["train.precision=bf16",
         "runtime.activations=bf16"], ["runtime.attention_stored_ds=false"], ["runtime.attention_stored_ds=true"],
         None, False, [(0, ATT + "0 with dS kept (5 products), 24 forming dS again (7 products)"),
                       (1, ATT + "24 with dS kept (5 products), 0 forming dS again (7 products)")], check=same_bits)
# The split dK/dV kernel (runtime.attention_split_dkdv: 8 warps to a block of 64 keys, each with half of D) gives the
# 4-warp kernel's bits, under the emulator and on a GPU (the same products in the same order per output fragment);
# 2 heads make D = 32, a multiple of 32 as it needs. The logs say which ran.
SPLIT_ATT = ATT + "24 with dS kept (5 products), 0 forming dS again (7 products); {} by the split dK/dV kernel"
case("attention-split-dkdv-same-bits", "parallel: {micro_batches: 2}", ["train.precision=bf16",
     "runtime.activations=bf16", "model.heads=2"], ["runtime.attention_split_dkdv=false"],
     ["runtime.attention_split_dkdv=true"], None, False,
     [(0, SPLIT_ATT.format(0)), (1, SPLIT_ATT.format(24))], check=same_bits)
# runtime.attention_autotune: at the first call of each pass and shape every variant of the tensor-core attention
# that gives the default's bits (the wide forward; the split dK/dV kernel, at D = 32 here) runs on the call's inputs,
# its outputs compared with the default's, and the fastest runs from then on: the bits of a run without it, whichever
# it chose; the log lists the candidates. With every candidate but the default made to differ in the comparison
# (MEGASCALE_PLANT=autotune_disagree) both are left out, with a warning, and the default runs: the same bits again.
TUNED = "attention autotune: 2 passes and shapes tuned ({} candidates left out for differing from the default's bits)"
TUNE_SETS = ["train.precision=bf16", "runtime.activations=bf16", "model.heads=2"]
case("attention-autotune-same-bits", "parallel: {micro_batches: 2}", TUNE_SETS, ["runtime.attention_autotune=false"],
     ["runtime.attention_autotune=true"], None, False,
     [(1, TUNED.format(0)), (1, "(default "), (1, ", wide "), (1, ", split ")], check=same_bits)
case("attention-autotune-leaves-out-other-bits", "parallel: {micro_batches: 2}", TUNE_SETS,
     ["runtime.attention_autotune=false"], ["runtime.attention_autotune=true"], {"MEGASCALE_PLANT": "autotune_disagree"},
     False, [(1, TUNED.format(2)), (1, "differs from the default's bits, which they must give"),
             (1, "wide left out: its out16 differs"), (1, "split left out: its dqkv16 differs")], check=same_bits)
# At D = 128 (one head of 128) the wide forward is a candidate too (its query fragments read from shared memory at
# each tile), the split dK/dV kernel not (the default backward's softmax runs through shared memory there).
case("attention-autotune-d128-same-bits", "parallel: {micro_batches: 2}",
     [*TUNE_SETS, "model.hidden=128", "model.heads=1"], ["runtime.attention_autotune=false"],
     ["runtime.attention_autotune=true"], None, False,
     [(1, TUNED.format(0)), (1, "(default "), (1, ", wide ")], check=same_bits)
# ... and the epilogues do change the numerics (the switch is not ignored).
case("gemm-epilogues-take-effect", "", ["train.precision=bf16", "runtime.activations=bf16"],
     ["runtime.gemm_epilogues=false"], ["runtime.gemm_epilogues=true"], None, True, check=same_bits)
# ... and it does change the numerics (the switch is not ignored).
case("bf16-activations-take-effect", "", ["train.precision=bf16"], ["runtime.activations=fp32"],
     ["runtime.activations=bf16"], None, True, check=same_bits)
case("planted-stale-bf16-weights-caught", "parallel: {micro_batches: 2}",
     ["train.precision=bf16", "model.block=sequential"], ["runtime.bf16_operands=cast"], KEEP,
     {"MEGASCALE_PLANT": "kept_bf16_stale"}, True, check=same_bits)
# With zero 0 the optimizer writes the bf16 weight copies with its update (no casts after the first step): the
# bits of `cast` on two data-parallel ranks with LAMB (the trust ratios reduced across ranks, then the copies
# written by its apply step), and a step that declares the copies written without handing them to the optimizer
# (a planted bug) is caught.
case("bf16-112-lamb-keep-is-cast", "parallel: {dp: 2}", ["train.precision=bf16", "optimizer.kind=lamb"], KEEP,
     ["runtime.bf16_operands=cast"], check=same_bits)
case("planted-unwritten-optimizer-bf16-caught", "", ["train.precision=bf16"], ["runtime.bf16_operands=cast"], KEEP,
     {"MEGASCALE_PLANT": "optimizer_bf16_unwritten"}, True, check=same_bits)
# CUDA graphs (runtime.cuda_graphs): each micro-batch slot's forward and backward recorded once, then launched as one
# graph, give the bits of launching the ops one by one (the one slot of pp 1: its forward and backward run op by op at
# the first micro-batch, recorded at the second, launched for the 22 after); on two data-parallel ranks with ZeRO-1
# too (the optimizer's parameter gathers waited for before the forward's launch, the gradient buckets reduced after
# the backward's); under the emulator the one-rank graph run has the deferred streams (work runs only when waited
# for: an upload not ordered before a launch would read stale memory). Graphs counted but not launched (a planted
# bug) change the losses; a capture that fails (planted: it waits for the device) leaves the run op by op, with the
# same bits, and says why.
GRAPHS = ["train.precision=bf16", "runtime.activations=bf16"]
GRAPHS_RAN = "22 forwards and backwards launched as graphs, 2 run op by op"
case("cuda-graphs-same-bits", "parallel: {micro_batches: 2}", GRAPHS, ["runtime.cuda_graphs=false"],
     ["runtime.cuda_graphs=true"], None if GPU else {"MS_SIM_STREAMS": "deferred"}, False,
     [(1, "CUDA graphs: 2 recorded ("), (1, GRAPHS_RAN)], check=same_bits)
case("cuda-graphs-112-zero1-same-bits", "parallel: {dp: 2, zero: 1, micro_batches: 2}",
     [*GRAPHS, "model.block=sequential"], ["runtime.cuda_graphs=false"], ["runtime.cuda_graphs=true"], None, False,
     [(1, GRAPHS_RAN)], check=same_bits)
# ... and on two pipeline stages with 2 virtual stages each (4 micro-batches a step: the stages' activations and
# gradients copied from the pipeline's receive buffers into the slot's ahead of the graphs).
case("cuda-graphs-121-interleaved-same-bits", "parallel: {pp: 2, virtual_stages: 2, micro_batches: 4}",
     [*GRAPHS, "model.layers=4"], ["runtime.cuda_graphs=false"], ["runtime.cuda_graphs=true"], None, False,
     [(1, "CUDA graphs: 16 recorded ("), (1, "80 forwards and backwards launched as graphs")], check=same_bits)
case("planted-graphs-not-launched-caught", "parallel: {micro_batches: 2}", GRAPHS, ["runtime.cuda_graphs=false"],
     ["runtime.cuda_graphs=true"], {"MEGASCALE_PLANT": "graph_not_launched"}, True, check=same_bits)
case("cuda-graphs-failed-capture-runs-op-by-op", "parallel: {micro_batches: 2}", GRAPHS, ["runtime.cuda_graphs=false"],
     ["runtime.cuda_graphs=true"], {"MEGASCALE_PLANT": "graph_capture_waits"}, False,
     [(1, "runtime.cuda_graphs: recording the forward (chunk 0, slot 0) graph failed"),
      (1, "CUDA graphs: 0 recorded (0 operations in 0 graphs), 0 forwards and backwards launched as graphs")],
     check=same_bits)


# ZeRO's parameter all-gathers in bf16: with zero >= 1 and kept bf16 weight copies the optimizer writes the owned
# shares' roundings with its update and the gathers move those (the layers' GEMM weights, an untied head's), the other
# parameters in fp32 beside them; the fp32 values of the gathered weights are gathered once before evaluation and
# checkpoints. Against MEGASCALE_ZERO_GATHER=fp32 (the fp32 gather, then a cast per weight and step): the same bits
# in every step's loss, gradient norm and validation loss; a checkpoint of the bf16-gathering run resumes on its own
# bits. Planted bugs: the gathered copies not declared written (the next step casts stale fp32 values over them)
# parts the training losses; no fp32 gather before evaluation and checkpoints parts the validation losses or the
# resumed steps.
GATHER16 = "parameter all-gathers move the bf16 weight copies in"


def zero_gather16(name, extra, sets, plant=None, env=None):
    dirs = [os.path.join(WORK, f"{name}-{v}") for v in ("bf16", "fp32")]
    path = os.path.join(WORK, name + ".yaml")
    spec(path, dirs[0], extra + "checkpoint: {interval: 3}\n")
    base = ["--set", "runtime.backend=cuda", "--set", "train.eval_interval=2", "--set", "train.eval_batches=2"]
    for s in sets:
        base += ["--set", s]
    env0 = dict(env or {}, **({"MEGASCALE_PLANT": plant} if plant else {}))
    for d, e in ((dirs[0], env0), (dirs[1], dict(env or {}, MEGASCALE_ZERO_GATHER="fp32"))):
        rc, _, err = run(EMU, "train", path, "--set", f"log.run_dir={d}", *base, env=e)
        if rc != 0:
            return f"run {os.path.basename(d)} failed: {err.strip()[-800:]}"
    logs = [open(os.path.join(d, "logs/rank-0.log")).read() for d in dirs]
    if GATHER16 not in logs[0] or GATHER16 in logs[1]:
        return f"the logs do not say which runs gathered bf16 copies ('{GATHER16}': bf16 run {GATHER16 in logs[0]}, " \
               f"fp32 run {GATHER16 in logs[1]})"
    # At dp 2 (every bucket divides by 2 here) no bucket is staged: ZeRO-1's reduce-scatters read the gradients,
    # ZeRO-2's their windows, and the gathers, bf16 and fp32, run in place.
    staged = re.search(r"(\d+) of (\d+) buckets staged", logs[0])
    want = 0 if "dp: 2" in extra else None
    if not staged or (want is not None and int(staged.group(1)) != want):
        return f"rank 0's log: {staged.group(0) if staged else 'no staged-bucket count'}; expected {want} staged"
    print(f"     {name}: {staged.group(0)}")
    rows = [[json.loads(l) for l in open(os.path.join(d, "metrics.jsonl"))] for d in dirs]
    got = {}
    for key, phase in (("loss", "train"), ("grad_norm", "train"), ("val_loss", "eval")):
        x, y = ({r["step"]: r[key] for r in rs if r["phase"] == phase} for rs in rows)
        if sorted(x) != sorted(y) or not x:
            return f"different {phase} steps: {sorted(x)} vs {sorted(y)}"
        got[key] = [s for s in sorted(x) if x[s] != y[s]]
        print(f"     {name}: {len(x)} steps, {key} {'identical' if not got[key] else f'differs at steps {got[key]}'}")
    # The bf16-gathering run's checkpoint of step 3 resumes on its own bits (steps 4-6).
    shutil.rmtree(os.path.join(dirs[0], "checkpoints", "step-00000006"), ignore_errors=True)
    rc, _, err = run(EMU, "resume", path, "--set", f"log.run_dir={dirs[0]}", *base, env=env0)
    if rc != 0:
        return f"resume failed: {err.strip()[-800:]}"
    train = [json.loads(l) for l in open(os.path.join(dirs[0], "metrics.jsonl"))]
    train = [(r["step"], r["loss"]) for r in train if r["phase"] == "train"]
    if [s for s, _ in train] != [1, 2, 3, 4, 5, 6, 4, 5, 6]:
        return f"train steps in metrics.jsonl after the resume: {[s for s, _ in train]}"
    resumed = [s for (s, l), (_, l0) in zip(train[6:], train[3:6]) if l != l0]
    print(f"     {name}: resumed steps 4-6 {'identical' if not resumed else f'differ at steps {resumed}'}")
    if plant == "zero_gather16_unmarked":
        return None if got["loss"] else "the planted bug went unnoticed: the training losses are the same bits"
    if plant == "zero_gather16_no_refresh":
        return None if got["val_loss"] or resumed else "the planted bug went unnoticed: validation and resume agree"
    differ = [f"{k} at steps {v}" for k, v in got.items() if v] + ([f"resumed steps {resumed}"] if resumed else [])
    return ("differ: " + ", ".join(differ)) if differ else None


ZG = ["train.precision=bf16", "runtime.activations=bf16", "model.block=sequential"]
case("zero1-112-bf16-gathers-same-bits", "parallel: {dp: 2, zero: 1, micro_batches: 2}\n", ZG, check=zero_gather16)
# Buckets of 0.03 MB (7,864 floats; the model's weights 4,096-16,384): 6 of 7 buckets gather bf16 copies, cut between
# the ranks mid-tensor, with norms and biases packed beside them; the tied wte's bucket is gathered in fp32 alone.
case("zero1-112-bf16-gathers-small-buckets", "parallel: {dp: 2, zero: 1, micro_batches: 2}\n",
     [*ZG, "parallel.bucket_mb=0.03"], check=zero_gather16)
# ZeRO-2, LAMB (its trust ratios over the owned shares), an untied head (its weight gathered in bf16 too).
case("zero2-112-bf16-gathers-same-bits-lamb-untied", "parallel: {dp: 2, zero: 2, micro_batches: 2}\n",
     [*ZG, "optimizer.kind=lamb", "model.tied_embeddings=false"], check=zero_gather16)
# A step skipped for a NaN gradient (fault.nan_policy: skip): the optimizer writes nothing, the copies the step used
# are gathered again.
case("zero1-112-bf16-gathers-nan-skip", "parallel: {dp: 2, zero: 1, micro_batches: 2}\nfault: {nan_policy: skip}\n",
     ZG, None, {"MEGASCALE_FAULT": "nan:rank=1:step=2"}, check=zero_gather16)
# Three data-parallel ranks: shares of unequal length (the last rank's padded), small buckets, ZeRO-2.
case("zero2-113-bf16-gathers-small-buckets", "parallel: {dp: 3, zero: 2, micro_batches: 2}\n",
     [*ZG, "train.global_batch=6", "parallel.bucket_mb=0.03"], check=zero_gather16)
case("planted-112-zero-gather16-unmarked-caught", "parallel: {dp: 2, zero: 1}\n", ZG, "zero_gather16_unmarked",
     check=zero_gather16)
case("planted-112-zero-gather16-no-refresh-caught", "parallel: {dp: 2, zero: 1}\n", ZG, "zero_gather16_no_refresh",
     check=zero_gather16)


def cudnn_attention(name, extra, sets, rtol, emu_sets):
    """runtime.attention_kernels: cudnn. The emulated backend cannot run cuDNN: megascale-emu refuses the key at
    start, naming it and the flavor. On a GPU the run trains on the CPU backend's losses within rtol with every
    attention call cuDNN's: none checked against megascale's kernels and found wrong, none by megascale's kernels."""
    if not GPU:
        run_dir = os.path.join(WORK, name + "-emu")
        path = os.path.join(WORK, name + ".yaml")
        spec(path, run_dir, extra)
        args = ["train", path, "--set", "runtime.backend=cuda"]
        for s in [*sets, *emu_sets]:
            args += ["--set", s]
        rc, out, err = run(EMU, *args)
        if rc == 0:
            return "megascale-emu trained with runtime.attention_kernels: cudnn"
        if "attention_kernels" not in err or "emulated" not in err:
            return f"the refusal names neither the key nor the flavor: {err.strip()[-600:]}"
        print(f"     {name}: refused: {err.strip().splitlines()[-1][:200]}")
        return None
    return compare(name, extra, sets, rtol, emu_sets,
                   ["attention by cuDNN's fused attention: ",
                    "(0 of them checked against megascale's kernels and found wrong); 0 calls by megascale's kernels"])


# cuDNN's fused attention (head dim 16, T 32: on cuDNN <= 9.15 the backward's padding-mask form; a window of 12).
case("cudnn-attention", "parallel: {micro_batches: 2}", ["train.precision=bf16"], 1e-2,
     ["runtime.activations=bf16", "runtime.attention_kernels=cudnn"], check=cudnn_attention)


def checkpoint_crossover():
    """A checkpoint written from device memory (staged through the host) resumes on the CPU backend, and a CPU
    checkpoint resumes on the CUDA backend (restored through the host): steps 4-6 continue on the losses of
    the uninterrupted CPU run (fp32 tolerance)."""
    path = os.path.join(WORK, "ckpt.yaml")
    spec(path, os.path.join(WORK, "ckpt-ref"), "checkpoint: {interval: 3}")
    rc, _, err = run(BIN, "train", path)
    if rc != 0:
        return f"reference run failed: {err.strip()[-800:]}"
    ref = series(os.path.join(WORK, "ckpt-ref"), "loss")
    for first, then, first_args, then_args in (
            (EMU, BIN, ["--set", "runtime.backend=cuda"], []),
            (BIN, EMU, [], ["--set", "runtime.backend=cuda"])):
        d = os.path.join(WORK, f"ckpt-{os.path.basename(first)}-then-{os.path.basename(then)}")
        rc, _, err = run(first, "train", path, "--set", f"log.run_dir={d}", *first_args)
        if rc != 0:
            return f"{os.path.basename(first)} run failed: {err.strip()[-800:]}"
        steps = sorted(glob.glob(os.path.join(d, "checkpoints", "step-*")))
        if [os.path.basename(x) for x in steps] != ["step-00000003", "step-00000006"]:
            return f"expected checkpoints at steps 3 and 6, found {steps}"
        shutil.rmtree(steps[-1])
        rc, _, err = run(then, "resume", path, "--set", f"log.run_dir={d}", *then_args)
        if rc != 0:
            return f"{os.path.basename(then)} resume failed: {err.strip()[-800:]}"
        rows = [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl"))]
        train = [r for r in rows if r["phase"] == "train"]
        # metrics.jsonl is appended to: steps 1-6 of the first run, then 4-6 of the resumed one.
        if [r["step"] for r in train] != [1, 2, 3, 4, 5, 6, 4, 5, 6]:
            return f"train steps in metrics.jsonl: {[r['step'] for r in train]}"
        resumed = {r["step"]: r["loss"] for r in train[6:]}
        worst = max(abs(resumed[k] - ref[k]) / abs(ref[k]) for k in resumed)
        print(f"     {os.path.basename(first)} -> {os.path.basename(then)}: resumed steps 4-6, worst relative loss "
              f"difference {worst:.2e} (tolerance 1e-4)")
        if not worst <= 1e-4:
            return f"resumed losses {resumed} differ from the uninterrupted run {ref}"
    return None


def bench_memory():
    """`megascale bench` on the CUDA backend reports each point's peak device memory (table, CSV, JSON)."""
    path, out = os.path.join(WORK, "bench.yaml"), os.path.join(WORK, "bench-out")
    spec(path, os.path.join(WORK, "bench-run"), "")
    rc, stdout, err = run(EMU, "bench", path, "--set", "runtime.backend=cuda", "--set", "train.precision=fp32",
                          "--steps", "2", "--warmup", "0", "--no-progress", "--output", out)
    if rc != 0:
        return f"bench failed (exit {rc}): {err.strip()[-800:]}"
    if "mem MiB" not in stdout:
        return f"the table has no memory column: {stdout}"
    row = next(csv.DictReader(open(os.path.join(out, "bench.csv"))))
    point = json.load(open(os.path.join(out, "bench.json")))["points"][0]
    if not (float(row["device_mem_peak_mib"] or 0) > 0 and point["device_mem_peak_mib"] == float(row["device_mem_peak_mib"])):
        return f"CSV {row.get('device_mem_peak_mib')!r} / JSON {point.get('device_mem_peak_mib')!r}: no peak memory"
    return None


if not GPU:
    for name, fn in (("checkpoint-crossover", checkpoint_crossover), ("bench-reports-device-memory", bench_memory)):
        err = fn()
        print(("ok   " if err is None else "FAIL ") + name + ("" if err is None else ": " + err))
        (passed if err is None else failures).append(name)
print(f"{len(passed)} passed, {len(failures)} failed, {len(skipped)} skipped")
sys.exit(1 if failures else 0)
