#!/usr/bin/python3
"""PyTorch oracle for megascale's GPT: loss, every parameter gradient, one AdamW step and
one LAMB step, compared with what tests/model/model_dump wrote.

Usage: torch_oracle.py MODEL_DUMP_BINARY WORK_DIR
Runs model_dump for {parallel, sequential} x {window 0, window 4}, rebuilds the same model
in PyTorch (float64) from the dumped weights and batch, and checks:
  - loss relative error < 1e-5
  - every gradient: max |ours - torch| / max |torch| < 1e-4
  - one AdamW step (torch.optim.AdamW) and one LAMB step (reference below): < 1e-5 relative
Exit 0 when everything matches, 1 on a mismatch, 77 when torch is not installed (skip).
"""
import json
import math
import os
import subprocess
import sys

try:
    import numpy as np
    import torch
    import torch.nn.functional as F
except ImportError as e:  # pragma: no cover
    print(f"SKIP: {e} (install python3-torch: scripts/setup.sh --with-torch)")
    sys.exit(77)

torch.set_default_dtype(torch.float64)


def load(work):
    meta = json.load(open(os.path.join(work, "meta.json")))
    raw = lambda name, dt: np.fromfile(os.path.join(work, name), dtype=dt)
    flat = {k: raw(k + ".f32", np.float32) for k in ("params", "grads", "adamw", "lamb")}
    tensors = {}
    for key, arr in flat.items():
        tensors[key] = {}
        for name, off, shape in zip(meta["names"], meta["offsets"], meta["shapes"]):
            n = int(np.prod(shape))
            tensors[key][name] = torch.tensor(arr[off:off + n].astype(np.float64).reshape(shape))
    B, T = meta["batch"], meta["seq_len"]
    inputs = torch.tensor(raw("inputs.i32", np.int32).astype(np.int64).reshape(B, T))
    targets = torch.tensor(raw("targets.i32", np.int32).astype(np.int64).reshape(B, T))
    return meta, tensors, inputs, targets


def gpt_loss(meta, P, inputs, targets):
    B, T = inputs.shape
    C, H, L = meta["hidden"], meta["heads"], meta["layers"]
    D = C // H
    eps = meta["eps"]
    window = meta["window"]
    sequential = meta["block"] == "sequential"
    t = torch.arange(T)
    allowed = t[None, :] <= t[:, None]  # [query, key]
    if window > 0:
        allowed &= (t[:, None] - t[None, :]) < window

    def ln(x, name):
        return F.layer_norm(x, (C,), P[name + ".weight"], P[name + ".bias"], eps)

    def attn(x, p):
        qkv = F.linear(x, P[p + "attn.qkv.weight"], P[p + "attn.qkv.bias"])  # B,T,3C  (3, H, D)
        q, k, v = qkv.view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)  # each B,H,T,D
        att = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        att = att.masked_fill(~allowed, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return F.linear(y, P[p + "attn.proj.weight"], P[p + "attn.proj.bias"])

    def mlp(x, p):
        h = F.gelu(F.linear(x, P[p + "mlp.fc.weight"], P[p + "mlp.fc.bias"]), approximate="tanh")
        return F.linear(h, P[p + "mlp.proj.weight"], P[p + "mlp.proj.bias"])

    x = P["embed.wte"][inputs] + P["embed.wpe"][:T][None]
    for l in range(L):
        p = f"layers.{l}."
        if sequential:
            x = x + attn(ln(x, p + "ln1"), p)
            x = x + mlp(ln(x, p + "ln2"), p)
        else:
            h = ln(x, p + "ln1")
            x = x + attn(h, p) + mlp(h, p)
    x = ln(x, "final_norm")
    head = P.get("lm_head.weight", P["embed.wte"])
    logits = x @ head.T
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def rel(a, b):
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-12))


def check_case(binary, work, block, window):
    os.makedirs(work, exist_ok=True)
    subprocess.run([binary, work, block, str(window)], check=True, stdout=subprocess.DEVNULL)
    meta, Tn, inputs, targets = load(work)
    P = {k: v.clone().requires_grad_(True) for k, v in Tn["params"].items()}
    loss = gpt_loss(meta, P, inputs, targets)
    loss.backward()
    failures = []
    lerr = abs(meta["loss"] - loss.item()) / abs(loss.item())
    if lerr > 1e-5:
        failures.append(f"loss {meta['loss']} vs torch {loss.item()} (rel {lerr:.2e})")
    worst = 0.0
    for name in meta["names"]:
        e = rel(Tn["grads"][name], P[name].grad)
        worst = max(worst, e)
        if e > 1e-4:
            failures.append(f"grad {name}: rel error {e:.2e}")

    # One AdamW step with torch's own optimizer (decay only where megascale decays).
    lr, wd, b1, b2, eps = meta["lr"], meta["weight_decay"], meta["beta1"], meta["beta2"], meta["opt_eps"]
    ours_grads = {n: Tn["grads"][n] for n in meta["names"]}
    W = {n: Tn["params"][n].clone().requires_grad_(True) for n in meta["names"]}
    groups = [{"params": [W[n] for n, d in zip(meta["names"], meta["decay"]) if d], "weight_decay": wd},
              {"params": [W[n] for n, d in zip(meta["names"], meta["decay"]) if not d], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(b1, b2), eps=eps)
    for n in meta["names"]:
        W[n].grad = ours_grads[n].clone()
    opt.step()
    for n in meta["names"]:
        e = rel(Tn["adamw"][n] - Tn["params"][n], W[n].detach() - Tn["params"][n])
        if e > 1e-4:
            failures.append(f"adamw update {n}: rel error {e:.2e}")

    # One LAMB step, reference implementation (You et al. 2019, with bias correction).
    for n, d in zip(meta["names"], meta["decay"]):
        p, g = Tn["params"][n], ours_grads[n]
        m = (1 - b1) * g
        v = (1 - b2) * g * g
        u = (m / (1 - b1)) / ((v / (1 - b2)).sqrt() + eps) + (wd if d else 0.0) * p
        pn, un = p.norm(), u.norm()
        trust = pn / un if pn > 0 and un > 0 else 1.0
        ref = p - lr * trust * u
        e = rel(Tn["lamb"][n] - p, ref - p)
        if e > 1e-4:
            failures.append(f"lamb update {n}: rel error {e:.2e}")
    status = "ok" if not failures else "MISMATCH"
    print(f"{block:10s} window={window}: loss {loss.item():.6f} (rel {lerr:.1e}), worst grad rel error {worst:.1e}: {status}")
    for f in failures:
        print("   ", f)
    return not failures


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    binary, work = sys.argv[1], sys.argv[2]
    ok = True
    for block in ("parallel", "sequential"):
        for window in (0, 4):
            ok &= check_case(binary, os.path.join(work, f"{block}-{window}"), block, window)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
