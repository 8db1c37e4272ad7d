#!/usr/bin/python3
"""ctest kernels_bench_roofline: `kernels_bench --roofline-only --preset gpu-configs --micro-batches 2` needs no GPU;
its output must list the launchers with bytes, FLOPs, unit and roofline time, and print the four predictions of
each GPU config with an MFU. (A script, not a CMake PASS_REGULAR_EXPRESSION: chained `(.|\\n)*` groups over this
much output made CMake's backtracking regex engine run for minutes.)

Usage: check_roofline.py KERNELS_BENCH
"""
import os
import re
import subprocess
import sys

NUM = r"[0-9.]+"
run = subprocess.run([sys.argv[1], "--roofline-only", "--preset", "gpu-configs", "--micro-batches", "2"],
                     capture_output=True, text=True, timeout=120)
out = run.stdout + run.stderr
problems = []
if run.returncode != 0:
    problems.append(f"exit {run.returncode}")
if "no CUDA device" in out or "failed" in out:
    problems.append("the output reports a failure or touched a device")
rows = {
    "tensor-core attention backward row (1.3B)":
        rf"^AttentionBackwardBf16 +B=4 T=2048 H=16 D=128 window=0 +{NUM} +{NUM} +bf16 TC +math +{NUM}$",
    "tensor-core attention forward on bf16 qkv row (GPT-2 small)":
        rf"^AttentionForwardBf16 +B=16 T=1024 H=12 D=64 window=256 bf16 qkv\+bias, out16 +{NUM} +{NUM} +bf16 TC +\w+ "
        rf"+{NUM}$",
    "LayerNorm backward on a bf16 output gradient row (GPT-2 small)":
        rf"^LayerNormBackward +N=16384 C=768 \+dsum, bf16 dout +{NUM} +{NUM} +memory +memory +{NUM}$",
    "residual add + LayerNorm on a bf16 branch output row (1.3B)":
        rf"^ResidualLayerNormForward +N=8192 C=2048 \+bias, bf16 part -> res, out16 +{NUM} +{NUM} +memory +memory "
        rf"+{NUM}$",
    "lm head GEMM row (1.3B)":
        rf"^GemmBf16 +NT M=8192 N=50304 K=2048 \(lm head fwd\) +{NUM} +{NUM} +bf16 TC +math +{NUM}$",
    "cuBLAS-converted GEMM row":
        rf"^GemmFp32Fast16bf +NT M=8192 N=50304 K=2048 \(lm head fwd\) +{NUM} +{NUM} +bf16 TC +\w+ +{NUM}$",
}
for what, pattern in rows.items():
    if not re.search(pattern, out, re.MULTILINE):
        problems.append(f"no {what}")
for config in ("gpt2-small-gpu", "gpt-1.3b"):
    at = out.find(f"PREDICTION, not a measurement: one step of {config} ")
    if at < 0:
        problems.append(f"no prediction for {config}")
        continue
    section = out[at:].split("\n\n")[0]
    for variant in ("as built (", "as built with runtime.activations: bf16", "as built with runtime.bf16_operands: cast",
                    "as built with runtime.bf16_operands: cublas", "with issue #16's items done"):
        v = section.find(variant)
        if v < 0 or not re.search(rf"^    step +{NUM} ms -> {NUM} tokens/s, .*MFU {NUM}% of", section[v:],
                                  re.MULTILINE):
            problems.append(f"{config}: no '{variant}' prediction with a step time and an MFU")
# scripts/gpu_check.sh's profile stage: its --rows regex must select training's tensor-core attention rows of each
# GPU config (the default forward and stored-dS backward, the wide forward, the split dK/dV kernel, the run-time
# product bounds; at D = 128 also the register-softmax backward: 6 + 7 rows), no more. A row renamed here would
# otherwise leave Nsight Compute profiling nothing, or the wrong rows, on the next GPU.
script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "gpu_check.sh")
m = re.search(r"^profile_rows='(.*)'$", open(script).read(), re.MULTILINE)
if m is None:
    problems.append("scripts/gpu_check.sh defines no profile_rows='...'")
else:
    sel = subprocess.run([sys.argv[1], "--roofline-only", "--preset", "gpu-configs", "--rows", m.group(1)],
                         capture_output=True, text=True, timeout=120)
    want = []
    for shape in ("B=16 T=1024 H=12 D=64 window=0", "B=4 T=2048 H=16 D=128 window=0"):
        for kernel, what in (("AttentionForwardBf16", "bf16 qkv, out16, no bias"),
                             ("AttentionForwardBf16", "bf16 qkv, out16, no bias varD"),
                             ("AttentionForwardBf16", "bf16 qkv+bias, out16 wide"),
                             ("AttentionBackwardBf16", "bf16 in, dqkv16+dbias, no bias, stored dS"),
                             ("AttentionBackwardBf16", "bf16 in, dqkv16+dbias, no bias, stored dS varD"),
                             ("AttentionBackwardBf16", "bf16 in, dqkv16+dbias, no bias, stored dS split")):
            want.append(f"{kernel} {shape} {what}")
        if "D=128" in shape:  # above D = 64 the register-softmax backward too (kAuto's is the shared-memory one)
            want.append(f"AttentionBackwardBf16 {shape} bf16 in, dqkv16+dbias, no bias, stored dS regs")
    listed = [" ".join(line.split()[:1]) + " " + line[29:].split("  ")[0].strip()
              for line in sel.stdout.splitlines() if line.startswith("Attention")]
    if sel.returncode != 0:
        problems.append(f"--rows of the profile stage: exit {sel.returncode}: {sel.stderr.strip()}")
    elif sorted(listed) != sorted(want):
        problems.append(f"the profile stage's --rows selects {listed}, not training's 13 rows {want}")
    elif not re.search(r"^rows: 13 of \d+ run", sel.stdout, re.MULTILINE):
        problems.append("no 'rows: 13 of N run' line for the profile stage's --rows")
    # A regex that selects nothing is an error that names the problem, not an empty run.
    none = subprocess.run([sys.argv[1], "--roofline-only", "--preset", "gpt2-small", "--rows", "^NoSuchRow"],
                          capture_output=True, text=True, timeout=120)
    if none.returncode == 0 or "matches none of the" not in none.stderr:
        problems.append(f"--rows matching nothing: exit {none.returncode}, stderr {none.stderr.strip()!r}")
for p in problems:
    print("FAIL", p)
if problems:
    print(out[-3000:])
    sys.exit(1)
print("ok: rows and the five predictions of both GPU configs; the profile stage's 13 rows")
