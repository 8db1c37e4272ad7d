#!/usr/bin/python3
"""Checkpoints end to end: bit-exact resume after SIGKILL of the whole job (layouts 1.1.1 and
2.2.2, AdamW and LAMB), resharding (saved under 2.2.2, resumed under 1.1.1 and 2.1.4), a damaged
newest checkpoint (the older one is used, with a warning), SIGTERM (checkpoint written, exit 75),
`megascale resume` without a checkpoint (clear error), and `megascale export` (safetensors that
PyTorch/numpy read with the right names and shapes).

Usage: resume_test.py MEGASCALE_BINARY WORK_DIR
"""
import glob
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import harness  # noqa: E402

BIN, WORK = sys.argv[1], sys.argv[2]
check = harness.Checks(limit=None, detail_on_pass=True)


def spec(data, optimizer):
    path = os.path.join(WORK, f"{optimizer}.yaml")
    open(path, "w").write(f"""name: ck
model: {{layers: 4, hidden: 32, heads: 4, ffn_hidden: 64, seq_len: 16, vocab: 256, block: parallel,
        attention: {{window: 6}}}}
train: {{steps: 12, global_batch: 8, micro_batch: 1, seed: 5}}
optimizer: {{kind: {optimizer}, lr: 2.0e-3, warmup_steps: 2}}
data: {{path: {data}, valid_fraction: 0.01}}
checkpoint: {{interval: 4, keep: 3}}
log: {{interval: 100, peak_flops: 1.0e10}}
runtime: {{threads: 1}}
""")
    return path


def losses(run_dir):
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in rows if r["phase"] == "train"}


def run(args, **kw):
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=300, **kw)


def layout(name):
    return {"1.1.1": [], "2.2.2": ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "parallel.zero=1"],
            "2.1.4": ["parallel.tp=2", "parallel.dp=4", "parallel.zero=2"]}[name]


def sets(lst):
    out = []
    for s in lst:
        out += ["--set", s]
    return out


def kill_after(args, run_dir, step_dir):
    """Starts a job, SIGKILLs its whole process group once `step_dir` is committed."""
    p = subprocess.Popen([BIN, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 120
    manifest = os.path.join(run_dir, "checkpoints", step_dir, "manifest.json")
    while time.time() < deadline and p.poll() is None and not os.path.exists(manifest):
        time.sleep(0.02)
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    return os.path.exists(manifest)


def main():
    harness.fresh_dir(WORK)
    data = harness.prepare_data(BIN, os.path.join(WORK, "data"), harness.fortunes(3))

    for optimizer in ("adamw", "lamb"):
        job = spec(data, optimizer)
        for lay in ("1.1.1", "2.2.2"):
            full_dir = os.path.join(WORK, f"{optimizer}-{lay}-full")
            r = run(["train", job, "--no-progress", "--set", f"log.run_dir={full_dir}", *sets(layout(lay)),
                     "--dump-params", full_dir + "-params"])
            if r.returncode != 0:
                check(f"{optimizer} {lay} uninterrupted run", False, r.stderr[-2000:])
                continue
            full = losses(full_dir)
            # Interrupted: checkpoint interval 8 so the kill lands between checkpoints.
            cut_dir = os.path.join(WORK, f"{optimizer}-{lay}-cut")
            args = ["train", job, "--no-progress", "--set", f"log.run_dir={cut_dir}", "--set",
                    "checkpoint.interval=4", *sets(layout(lay))]
            killed = kill_after(args, cut_dir, "step-00000004")
            # Drop anything after step 4 so the resume provably restarts from there.
            for d in glob.glob(os.path.join(cut_dir, "checkpoints", "step-*")):
                if not d.endswith("step-00000004"):
                    shutil.rmtree(d)
            r = run(["resume", job, "--no-progress", "--set", f"log.run_dir={cut_dir}", *sets(layout(lay)),
                     "--dump-params", cut_dir + "-params"])
            resumed = losses(cut_dir)
            same = all(resumed.get(s) == full[s] for s in range(5, 13))
            dumps = glob.glob(os.path.join(cut_dir + "-params", "*.f32"))
            params_same = len(dumps) == (1 if lay == "1.1.1" else 8) and all(
                open(f, "rb").read() == open(f.replace(cut_dir, full_dir), "rb").read() for f in dumps)
            check(f"{optimizer} {lay}: SIGKILL after step-4 checkpoint, resume is bit-exact",
                  killed and r.returncode == 0 and same and params_same,
                  f"killed={killed} exit={r.returncode} losses 5..12 identical={same} final params identical={params_same}"
                  + ("" if r.returncode == 0 else " " + r.stderr[-1500:]))

    # Resharding: saved under 2.2.2 (adamw run above), resumed under other layouts.
    job = spec(data, "adamw")
    full = losses(os.path.join(WORK, "adamw-2.2.2-full"))
    for lay in ("1.1.1", "2.1.4"):
        d = os.path.join(WORK, f"reshard-{lay}")
        os.makedirs(os.path.join(d, "checkpoints"))
        shutil.copytree(os.path.join(WORK, "adamw-2.2.2-full", "checkpoints", "step-00000008"),
                        os.path.join(d, "checkpoints", "step-00000008"))
        r = run(["resume", job, "--no-progress", "--set", f"log.run_dir={d}", *sets(layout(lay))])
        got = losses(d) if r.returncode == 0 else {}
        err = abs(got.get(9, 0) - full[9]) / full[9]
        check(f"reshard 2.2.2 -> {lay}: next-step loss as continuing unchanged", r.returncode == 0 and err < 1e-5,
              f"step 9 loss {got.get(9)} vs {full[9]} (rel {err:.1e})" + ("" if r.returncode == 0 else r.stderr[-800:]))

    # Damage: flip a byte in the newest checkpoint: the older one is used, and we are told.
    d = os.path.join(WORK, "damage")
    shutil.copytree(os.path.join(WORK, "adamw-1.1.1-full", "checkpoints"), os.path.join(d, "checkpoints"))
    newest = sorted(glob.glob(os.path.join(d, "checkpoints", "step-*")))[-1]
    f = glob.glob(os.path.join(newest, "rank-*"))[0]
    b = bytearray(open(f, "rb").read())
    b[len(b) // 2] ^= 0xFF
    open(f, "wb").write(bytes(b))
    r = run(["resume", job, "--no-progress", "--set", f"log.run_dir={d}", "--set", "train.steps=14"])
    used_older = "step-00000008" in r.stderr and os.path.basename(newest) in r.stderr
    check("damaged newest checkpoint: older one used, warning names the damaged one",
          r.returncode == 0 and used_older and os.path.exists(newest), r.stderr.strip().splitlines()[0][:300])

    # A checkpoint of another model: a clear error naming both.
    d = os.path.join(WORK, "othermodel")
    shutil.copytree(os.path.join(WORK, "adamw-1.1.1-full", "checkpoints"), os.path.join(d, "checkpoints"))
    r = run(["resume", job, "--no-progress", "--set", f"log.run_dir={d}", "--set", "model.hidden=64"])
    check("checkpoint of a different model is refused", r.returncode == 1 and "different model" in r.stderr
          and "hidden=32" in r.stderr and "hidden=64" in r.stderr, r.stderr.strip()[-300:])

    # Nothing to resume: a clear error.
    r = run(["resume", job, "--no-progress", "--set", f"log.run_dir={os.path.join(WORK, 'empty')}"])
    check("resume without a checkpoint fails clearly", r.returncode == 1 and "nothing to resume" in r.stderr,
          r.stderr.strip()[:300])

    # SIGTERM mid-run: checkpoint written, clean exit.
    d = os.path.join(WORK, "sigterm")
    p = subprocess.Popen([BIN, "train", job, "--no-progress", "--set", f"log.run_dir={d}", "--set",
                          "train.steps=100000", "--set", "checkpoint.interval=0", "--set", "parallel.dp=2"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not (os.path.exists(os.path.join(d, "metrics.jsonl")) and
                                          os.path.getsize(os.path.join(d, "metrics.jsonl")) > 200):
        time.sleep(0.05)
    # SIGUSR1 first: a checkpoint on demand while training goes on.
    p.send_signal(signal.SIGUSR1)
    deadline = time.time() + 60
    while time.time() < deadline and not glob.glob(os.path.join(d, "checkpoints", "step-*", "manifest.json")):
        time.sleep(0.05)
    on_demand = glob.glob(os.path.join(d, "checkpoints", "step-*", "manifest.json"))
    check("SIGUSR1: a checkpoint on demand, training goes on", len(on_demand) == 1 and p.poll() is None,
          f"{len(on_demand)} checkpoint(s), job {'running' if p.poll() is None else 'exited'}")
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    ckpts = glob.glob(os.path.join(d, "checkpoints", "step-*", "manifest.json"))
    check("SIGTERM: checkpoint written and exit 75 (saved, requeue me)", p.returncode == 75 and len(ckpts) == 2,
          f"exit {p.returncode}, {len(ckpts)} checkpoint(s)" + ("" if p.returncode == 75 else err[-800:]))

    # Export to safetensors, read back by hand (numpy) and by PyTorch when present.
    out = os.path.join(WORK, "model.safetensors")
    r = run(["export", os.path.join(WORK, "adamw-2.2.2-full", "checkpoints"), "--output", out])
    ok = r.returncode == 0 and os.path.exists(out)
    detail = r.stderr[-500:]
    if ok:
        raw = open(out, "rb").read()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        wte = header.get("embed.wte", {})
        qkv = header.get("layers.3.attn.qkv.weight", {})
        ok = wte.get("shape") == [256, 32] and qkv.get("shape") == [96, 32] and wte.get("dtype") == "F32"
        b, e = wte["data_offsets"]
        arr = np.frombuffer(raw[8 + n + b:8 + n + e], dtype=np.float32)
        ok &= bool(np.isfinite(arr).all()) and arr.size == 256 * 32
        try:
            import torch  # noqa: F401  (Debian's python3-torch): the file's tensors as torch tensors
            t = torch.frombuffer(bytearray(raw[8 + n + b:8 + n + e]), dtype=torch.float32).view(256, 32)
            ok &= bool(torch.isfinite(t).all())
        except ImportError:
            pass
        detail = f"{len(header) - ('__metadata__' in header)} tensors, embed.wte {wte.get('shape')}"
    check("export writes safetensors with the model's names and shapes", ok, detail)

    check.exit()


if __name__ == "__main__":
    main()
