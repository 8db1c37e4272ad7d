#!/usr/bin/python3
"""bench/torch_gpt_bench.py, the PyTorch baseline of the GPU benchmarks, on the CPU: for tiny specs (the parallel
block with a window, the sequential block with an untied classifier, the vocabulary padded) it must train (finite
losses from about ln(vocab), falling on its repeated batches), and count what `megascale train` counts on the same
spec: the same parameters (so the same model: blocks, biases, LayerNorms, padded and tied embeddings) and the same
model FLOPs per step (so its MFU is megascale's) — megascale's from its metrics.jsonl (flops_per_s * step_s) and its
log ("rank 0 holds N parameters"). Also: a spec with tp 2 and a global batch that micro_batch does not divide are
refused with exit status 1 and the key named.

Usage: torch_gpt_bench_test.py MEGASCALE WORK_DIR        (exit 77: no torch or yaml, skipped)
"""
import json
import math
import os
import re
import subprocess
import sys

try:
    import torch  # noqa: F401
    import yaml  # noqa: F401
except ImportError as e:
    print(f"SKIP: {e} (scripts/setup.sh --with-torch)")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import harness  # noqa: E402

BIN, WORK = os.path.abspath(sys.argv[1]), harness.fresh_dir(sys.argv[2])
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "torch_gpt_bench.py")
check = harness.Checks()


text = "\n%\n".join(f"fortune {i}: the quick brown fox {i * 7 % 13} jumps over the lazy dog" for i in range(300))
open(os.path.join(WORK, "corpus.txt"), "w").write(text)
harness.prepare_data(BIN, os.path.join(WORK, "data"), [os.path.join(WORK, "corpus.txt")])

CASES = {
    "parallel-window": "block: parallel, attention: {window: 8}",
    "sequential-untied": "block: sequential, tied_embeddings: false, ffn_hidden: 96",
}
for name, extra in CASES.items():
    spec = os.path.join(WORK, f"{name}.yaml")
    open(spec, "w").write(f"""name: {name}
model: {{layers: 2, hidden: 48, heads: 4, seq_len: 24, vocab: 300, vocab_pad_to: 128, {extra}}}
train: {{steps: 3, global_batch: 4, micro_batch: 2, seed: 5}}
optimizer: {{lr: 1.0e-3, warmup_steps: 1}}
data: {{path: data}}
log: {{run_dir: run-{name}, interval: 1, peak_flops: 1.0e12}}
runtime: {{threads: 1}}
""")
    out_json = os.path.join(WORK, f"{name}.json")
    r = subprocess.run(["/usr/bin/python3", SCRIPT, "--config", spec, "--steps", "4", "--skip", "1", "--device", "cpu",
                        "--peak", "1e12", "--json", out_json], capture_output=True, text=True, timeout=300, cwd=WORK)
    check(f"{name}: torch_gpt_bench exit 0", r.returncode == 0, r.stdout + r.stderr)
    if r.returncode != 0:
        continue
    res = json.load(open(out_json))
    t = res["train"]
    losses = [s["loss"] for s in t["steps"]]
    check(f"{name}: 4 steps, finite losses", len(losses) == 4 and all(map(math.isfinite, losses)), losses)
    check(f"{name}: first loss ~ ln(300)", abs(losses[0] - math.log(300)) < 0.3, losses)
    check(f"{name}: loss falls on the repeated batches", losses[-1] < losses[0], losses)
    check(f"{name}: median over steps 2..4", t["median_over_steps"] == [2, 3, 4], t["median_over_steps"])
    check(f"{name}: MFU = FLOPs / median step / peak",
          t["mfu"] is not None and abs(t["mfu"] - t["flops_per_step"] / t["median_step_s"] / 1e12) < 1e-9 * t["mfu"],
          t)
    check(f"{name}: summary line", "PyTorch " + name + ": median step" in r.stdout, r.stdout)

    # The same spec through megascale: parameters and FLOPs per step.
    m = subprocess.run([BIN, "train", spec], capture_output=True, text=True, timeout=300, cwd=WORK)
    check(f"{name}: megascale train exit 0", m.returncode == 0, m.stdout + m.stderr)
    if m.returncode != 0:
        continue
    held = re.search(r"rank 0 holds (\d+) parameters", m.stdout + m.stderr)
    check(f"{name}: the same parameter count as megascale", held and int(held.group(1)) == t["parameters"],
          f"megascale {held.group(1) if held else '?'}, torch {t['parameters']}")
    rows = [json.loads(line) for line in open(os.path.join(WORK, f"run-{name}", "metrics.jsonl"))]
    steps = [x for x in rows if "flops_per_s" in x and "step_s" in x]
    check(f"{name}: megascale logged steps", len(steps) >= 1, rows[:3])
    if steps:
        ms_flops = steps[-1]["flops_per_s"] * steps[-1]["step_s"]
        check(f"{name}: the same FLOPs per step as megascale", abs(ms_flops - t["flops_per_step"]) < 1e-6 * ms_flops,
              f"megascale {ms_flops:.6g}, torch {t['flops_per_step']:.6g}")

# Refusals: exit 1 (SystemExit with a message) naming the problem.
bad = {
    "tp": ("parallel: {tp: 2}\ntrain: {global_batch: 4, micro_batch: 2}", "parallel.tp"),
    "batch": ("train: {global_batch: 5, micro_batch: 2}", "train.global_batch"),
}
for name, (body, key) in bad.items():
    spec = os.path.join(WORK, f"bad-{name}.yaml")
    open(spec, "w").write(f"name: bad\nmodel: {{layers: 1, hidden: 16, heads: 2, seq_len: 8}}\n{body}\n")
    r = subprocess.run(["/usr/bin/python3", SCRIPT, "--config", spec, "--steps", "1", "--device", "cpu"],
                       capture_output=True, text=True, timeout=120)
    check(f"refused: {name}", r.returncode == 1 and key in r.stderr, f"exit {r.returncode}: {r.stdout + r.stderr}")

check.exit()
