#!/usr/bin/python3
"""megascale generate end to end: a model trained a few steps under layout 1.1.1 and under
tp 2 x pp 2 x dp 2 (checkpoints saved in two layouts), then sampled: deterministic for a seed, tokens
within the vocabulary, the same tokens with and without the KV cache, the same tokens from both
layouts' checkpoints (their parameters agree to rounding); a SentencePiece dataset's model decodes
to text; clear errors for no checkpoint, a tokenizer that does not match, and too many tokens.

Usage: generate_test.py MEGASCALE WORK_DIR
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import harness  # noqa: E402

BIN, WORK = os.path.abspath(sys.argv[1]), harness.fresh_dir(sys.argv[2])
check = harness.Checks(limit=1500)


def run(*args):
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=300)


def generate(run_dir, *args):
    r = run("generate", run_dir, "--json", *args)
    return json.loads(r.stdout) if r.returncode == 0 else r


corpus = os.path.join(WORK, "corpus.txt")
open(corpus, "w").write("\n%\n".join(f"Q: what is {i} plus {i % 7}?\nA: it is {i + i % 7}." for i in range(600)))
data = os.path.join(WORK, "data")
harness.prepare_data(BIN, data, [corpus])
spec = os.path.join(WORK, "gen.yaml")
open(spec, "w").write(f"""name: gen
model: {{layers: 2, hidden: 32, heads: 4, ffn_hidden: 64, seq_len: 48, vocab: 256, block: sequential,
        attention: {{window: 16}}}}
train: {{steps: 20, global_batch: 8, micro_batch: 1, seed: 5}}
optimizer: {{lr: 3.0e-3, warmup_steps: 2}}
data: {{path: {data}}}
checkpoint: {{interval: 20}}
log: {{peak_flops: 1.0e10}}
runtime: {{threads: 1}}
""")
a, b = os.path.join(WORK, "run-111"), os.path.join(WORK, "run-222")
r = run("train", spec, "--no-progress", "--set", f"log.run_dir={a}")
check("train 1.1.1", r.returncode == 0, r.stderr[-1500:])
r = run("train", spec, "--no-progress", "--set", f"log.run_dir={b}", "--set", "parallel.tp=2", "--set", "parallel.pp=2",
        "--set", "parallel.dp=2")
check("train tp2 pp2 dp2", r.returncode == 0, r.stderr[-1500:])

prompt = ["--prompt", "Q: what is 12 plus 5?\nA:", "--tokens", "16"]
g1 = generate(a, *prompt, "--seed", "7")
check("generates", isinstance(g1, dict), getattr(g1, "stderr", ""))
if isinstance(g1, dict):
    check("16 tokens within the vocabulary", len(g1["ids"]) == 16 and all(0 <= t < 256 for t in g1["ids"]), g1)
    check("the text is the decoded tokens", g1["text"] == bytes(t for t in g1["ids"] if t).decode("utf-8", "replace"),
          g1)
    check("deterministic for a seed", generate(a, *prompt, "--seed", "7") == g1)
    other = generate(a, *prompt, "--seed", "8")
    check("another seed, other tokens", isinstance(other, dict) and other["ids"] != g1["ids"], other)
    check("the same tokens without the KV cache", generate(a, *prompt, "--seed", "7", "--no-kv-cache") == g1)
    g2 = generate(b, *prompt, "--seed", "7")
    check("from the checkpoint saved under tp2.pp2.dp2", isinstance(g2, dict) and g2["layout"] == "tp2.pp2.dp2" and
          g1["layout"] == "tp1.pp1.dp1", g2)
    check("the same tokens from both layouts' checkpoints", isinstance(g2, dict) and g2["ids"] == g1["ids"],
          (g1, g2))
    greedy = generate(a, *prompt, "--temperature", "0")
    check("greedy decoding", isinstance(greedy, dict) and greedy == generate(a, *prompt, "--temperature", "0",
                                                                             "--seed", "99"))
plain = run("generate", a, *prompt)
check("plain output: prompt and continuation", plain.returncode == 0 and plain.stdout.startswith("Q: what is 12"),
      plain.stderr)

r = run("generate", a, "--tokens", "4", "--set", f"checkpoint.dir={os.path.join(WORK, 'none')}")
check("no checkpoint: a clear error", r.returncode == 1 and "no checkpoint to generate from" in r.stderr, r.stderr)
r = run("generate", a, "--tokens", "4", "--set", "data.tokenizer=sentencepiece")
check("a tokenizer that does not match: a clear error", r.returncode == 1 and "byte tokenizer" in r.stderr, r.stderr)
r = run("generate", a, "--tokens", "60")
check("more tokens than positions: a clear error", r.returncode == 1 and "model.seq_len" in r.stderr, r.stderr)

# A SentencePiece dataset: the model's tokens decode through its tokenizer.
sp = os.path.join(WORK, "sp")
subprocess.run([BIN, "prepare-data", "--tokenizer", "bpe", "--vocab-size", "320", "--doc-separator", "%", "--output", sp,
                corpus], check=True, capture_output=True)
c = os.path.join(WORK, "run-sp")
r = run("train", spec, "--no-progress", "--set", f"log.run_dir={c}", "--set", f"data.path={sp}", "--set",
        "model.vocab=320")
check("train on a SentencePiece dataset", r.returncode == 0, r.stderr[-1500:])
g3 = generate(c, "--prompt", "Q: what is", "--tokens", "12", "--seed", "1")
check("generate with SentencePiece", isinstance(g3, dict) and len(g3["ids"]) == 12 and
      all(0 <= t < 320 for t in g3["ids"]) and g3["text"] != "", g3 if isinstance(g3, dict) else g3.stderr)
check.exit()
