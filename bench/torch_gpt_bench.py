#!/usr/bin/env python3
"""The PyTorch baseline of megascale's GPU benchmarks: the model of a megascale job spec, trained as PyTorch users
train it, timed the way `megascale train` times itself, and the attention of its shape through each of PyTorch's
fused attention backends (FlashAttention-2, cuDNN, memory-efficient) -- what megascale's step and its tensor-core
attention kernels (`kernels_bench`) are measured against on the same GPU (docs/PERFORMANCE.md).

The model: megascale's GPT of the spec's `model:` section (block parallel or sequential, LayerNorm, GeLU tanh, tied
embeddings unless `tied_embeddings: false`, the vocabulary held as `vocab_pad_to` rows with the padding out of the
loss, causal attention with the spec's window), fp32 parameters, the forward and backward under bf16 autocast
(matmuls and attention in bf16 with fp32 accumulation, LayerNorm, softmax and the loss in fp32), attention through
`F.scaled_dot_product_attention` (is_causal; with a window, a boolean mask), AdamW (fused on a GPU) after clipping
the gradient norm, `train.global_batch / train.micro_batch` micro-batches a step (dp 1), random tokens. Step time:
the wall time of each step between two device synchronizations; the median over steps --skip + 1 .. (as
scripts/gpu_check.sh reads megascale's). MFU: megascale's model FLOPs (`model::TrainingFlopsPerSequence`:
6 * matmul parameters * T + 12 * L * C * sum_t keys(t), the classifier over the padded vocabulary) per step over the
step time and the GPU's datasheet dense bf16 peak (the table of lib/runner/compute.cpp), or --peak.

Attention (--attention, on a GPU): B = train.micro_batch, the spec's T, H and D, bf16, causal; q, k and v strided
views of one (B, T, 3, H, D) tensor as megascale's qkv; per backend the forward and the backward (forward + backward
less forward) timed with CUDA events, median of --attention-iters; FLOPs as kernels_bench counts them (forward
4 * B * H * D * sum_t keys(t), backward 2.5 times that).

Usage:
  bench/torch_gpt_bench.py --config configs/gpt2-small-gpu.yaml [--steps 12] [--skip 3] [--attention]
                           [--compile] [--peak FLOPS] [--json FILE] [--device cuda|cpu]
On a machine without a GPU it trains on the CPU (tests/bench/torch_gpt_bench_test.py: a tiny spec, its FLOPs and
parameter count against `megascale train`'s).
Prints one line per step and a summary; --json writes the same as JSON. Exit 0, or 2 on bad arguments.
"""
import argparse
import json
import math
import platform
import statistics
import sys
import time

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError as e:  # pragma: no cover
    print(f"SKIP: {e} (install python3-torch: scripts/setup.sh --with-torch)")
    sys.exit(77)
try:
    import yaml
except ImportError as e:  # pragma: no cover
    print(f"SKIP: {e} (install python3-yaml: scripts/setup.sh --with-torch)")
    sys.exit(77)


def datasheet_peak(name):
    """Dense bf16 FLOP/s of a GPU by name: the table of lib/runner/compute.cpp (DatasheetPeak)."""
    if "B200" in name:
        return 2250e12
    if "H200" in name:
        return 989e12
    if "H100" in name:
        return 756e12 if "PCIe" in name else 835e12 if "NVL" in name else 989e12
    if "A100" in name:
        return 312e12
    return 0.0


def sum_keys(T, window):
    return sum(min(t + 1, window) if window > 0 else t + 1 for t in range(T))


def training_flops_per_sequence(m):
    """model::TrainingFlopsPerSequence (lib/model/model.cpp)."""
    C, L, T, V = m["hidden"], m["layers"], m["seq_len"], m["padded_vocab"]
    Fh = m["ffn_hidden"]
    n_matmul = L * (4 * C * C + 2 * C * Fh) + V * C
    return 6.0 * n_matmul * T + 12.0 * L * C * sum_keys(T, m["window"])


def read_spec(path):
    try:
        spec = yaml.safe_load(open(path)) or {}
    except (OSError, yaml.YAMLError) as e:
        raise SystemExit(f"torch_gpt_bench: cannot read {path}: {e}")
    model, train = spec.get("model") or {}, spec.get("train") or {}
    m = {
        "layers": int(model.get("layers", 4)),
        "hidden": int(model.get("hidden", 256)),
        "heads": int(model.get("heads", 4)),
        "ffn_hidden": int(model.get("ffn_hidden", 0)),
        "vocab": int(model.get("vocab", 256)),
        "vocab_pad_to": int(model.get("vocab_pad_to", 1)),
        "seq_len": int(model.get("seq_len", 256)),
        "block": str(model.get("block", "parallel")),
        "window": int((model.get("attention") or {}).get("window", 0)),
        "norm_eps": float(model.get("norm_eps", 1e-5)),
        "tied_embeddings": bool(model.get("tied_embeddings", True)),
    }
    micro = int(train.get("micro_batch", 0))
    glob = int(train.get("global_batch", 0))
    par = spec.get("parallel") or {}
    if int(par.get("tp", 1)) != 1 or int(par.get("pp", 1)) != 1 or par.get("dp", 1) not in (1, None):
        raise SystemExit(f"torch_gpt_bench: {path}: the baseline runs one device (parallel.tp, pp and dp 1)")
    if micro <= 0:
        micro = glob
    if glob <= 0 or glob % micro:
        raise SystemExit(f"torch_gpt_bench: {path}: train.global_batch ({glob}) must be a positive multiple of "
                         f"train.micro_batch ({micro})")
    if m["block"] not in ("parallel", "sequential") or m["hidden"] % m["heads"]:
        raise SystemExit(f"torch_gpt_bench: {path}: model.block must be parallel or sequential and model.hidden a "
                         f"multiple of model.heads")
    if m["ffn_hidden"] <= 0:
        m["ffn_hidden"] = 4 * m["hidden"]
    pad = max(m["vocab_pad_to"], 1)
    m["padded_vocab"] = (m["vocab"] + pad - 1) // pad * pad
    return spec.get("name", path), m, micro, glob // micro


def attention(q, k, v, window, T):
    """Causal attention over (B, H, T, D) views; with a window, key s seen by query t when t - window < s <= t."""
    sdpa = getattr(F, "scaled_dot_product_attention", None)
    if window <= 0 or window >= T:
        if sdpa is not None:
            return sdpa(q, k, v, is_causal=True)
        allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    else:
        t = torch.arange(T, device=q.device)
        allowed = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < window)
        if sdpa is not None:
            return sdpa(q, k, v, attn_mask=allowed)
    # PyTorch before 2.0 (Debian's 1.13 on the CPU test machine): the same, unfused.
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return s.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


class Block(nn.Module):
    def __init__(self, m):
        super().__init__()
        C, Fh = m["hidden"], m["ffn_hidden"]
        self.H, self.window, self.sequential = m["heads"], m["window"], m["block"] == "sequential"
        self.ln1 = nn.LayerNorm(C, eps=m["norm_eps"])
        self.ln2 = nn.LayerNorm(C, eps=m["norm_eps"]) if self.sequential else None
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.fc_proj = nn.Linear(C, Fh), nn.Linear(Fh, C)

    def attn(self, h):
        B, T, C = h.shape
        q, k, v = self.qkv(h).view(B, T, 3, self.H, C // self.H).permute(2, 0, 3, 1, 4)
        y = attention(q, k, v, self.window, T)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

    def mlp(self, h):
        return self.fc_proj(F.gelu(self.fc(h), approximate="tanh"))

    def forward(self, x):
        if self.sequential:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        h = self.ln1(x)
        return x + self.attn(h) + self.mlp(h)


class Gpt(nn.Module):
    def __init__(self, m):
        super().__init__()
        C, self.V = m["hidden"], m["vocab"]
        self.wte = nn.Embedding(m["padded_vocab"], C)
        self.wpe = nn.Embedding(m["seq_len"], C)
        self.layers = nn.ModuleList(Block(m) for _ in range(m["layers"]))
        self.final_norm = nn.LayerNorm(C, eps=m["norm_eps"])
        self.lm_head = None if m["tied_embeddings"] else nn.Linear(C, m["padded_vocab"], bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        with torch.no_grad():
            self.wte.weight[self.V:].zero_()

    def forward(self, tokens, targets):
        T = tokens.shape[1]
        x = self.wte(tokens) + self.wpe.weight[:T]
        for layer in self.layers:
            x = layer(x)
        x = self.final_norm(x)
        logits = F.linear(x, self.wte.weight if self.lm_head is None else self.lm_head.weight)
        if logits.shape[-1] != self.V:  # the padding rows: computed (their FLOPs counted), out of the loss
            logits = logits[..., :self.V]
        return F.cross_entropy(logits.reshape(-1, self.V).float(), targets.reshape(-1))


def make_optimizer(model, device):
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() != 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if device.type == "cuda":
        try:
            return torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), fused=True), "AdamW (fused)"
        except (TypeError, RuntimeError):
            pass
    return torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95)), "AdamW"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def train(m, micro, n_micro, args, device):
    torch.manual_seed(1234)
    try:  # built on the device (PyTorch >= 2.0): a 1.3B model's initialization on the host takes tens of seconds
        with device:
            model = Gpt(m)
    except (AttributeError, TypeError):
        model = Gpt(m).to(device)
    opt, opt_name = make_optimizer(model, device)
    step_fn_model = torch.compile(model) if args.compile else model
    B, T = micro, m["seq_len"]
    gen = torch.Generator(device="cpu").manual_seed(7)
    batches = [(torch.randint(0, m["vocab"], (B, T), generator=gen).to(device),
                torch.randint(0, m["vocab"], (B, T), generator=gen).to(device)) for _ in range(n_micro)]
    flops_step = training_flops_per_sequence(m) * micro * n_micro
    peak = args.peak if args.peak > 0 else (datasheet_peak(torch.cuda.get_device_name(device))
                                            if device.type == "cuda" else 0.0)
    steps = []
    for step in range(1, args.steps + 1):
        sync(device)
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for tokens, targets in batches:
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                loss = step_fn_model(tokens, targets)
            (loss / n_micro).backward()
            total += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        dt = time.perf_counter() - t0
        loss_v = float(total) / n_micro
        steps.append({"step": step, "loss": loss_v, "grad_norm": float(norm), "step_s": dt,
                      "tokens_per_s": micro * n_micro * T / dt, "mfu": flops_step / dt / peak if peak else None})
        mfu = f", MFU {100 * flops_step / dt / peak:.1f} %" if peak else ""
        print(f"step {step}: loss {loss_v:.4f}, {1e3 * dt:.1f} ms, {micro * n_micro * T / dt:,.0f} tokens/s{mfu}",
              flush=True)
        if not math.isfinite(loss_v):
            raise SystemExit(f"torch_gpt_bench: loss {loss_v} at step {step}")
    timed = [s["step_s"] for s in steps[args.skip:]] or [s["step_s"] for s in steps]
    med = statistics.median(timed)
    return {
        "optimizer": opt_name,
        "compiled": bool(args.compile),
        "parameters": sum(p.numel() for p in model.parameters()),
        "flops_per_step": flops_step,
        "peak_flops": peak or None,
        "steps": steps,
        "median_step_s": med,
        "median_over_steps": [s["step"] for s in steps[args.skip:]] or [s["step"] for s in steps],
        "tokens_per_s": micro * n_micro * T / med,
        "mfu": flops_step / med / peak if peak else None,
        "max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }


def attention_bench(m, micro, args, device):
    """Each fused backend of F.scaled_dot_product_attention at the spec's attention shape (causal, no window)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return {"skipped": "torch.nn.attention.sdpa_kernel needs PyTorch 2.3 or later"}
    B, T, H = micro, m["seq_len"], m["heads"]
    D = m["hidden"] // H
    if 0 < m["window"] < T:
        return {"skipped": f"window {m['window']}: PyTorch's fused backends take no sliding window"}
    fwd_flops = 4.0 * B * H * D * sum_keys(T, 0)
    gen = torch.Generator(device="cpu").manual_seed(11)
    qkv = (torch.randn(B, T, 3, H, D, generator=gen) * 0.5).to(device=device, dtype=torch.bfloat16)
    dout = torch.randn(B, H, T, D, generator=gen).to(device=device, dtype=torch.bfloat16)
    peak = args.peak if args.peak > 0 else datasheet_peak(torch.cuda.get_device_name(device))
    out = {"shape": {"B": B, "T": T, "H": H, "D": D, "causal": True}, "forward_flops": fwd_flops, "backends": {}}

    def timed(fn, iters):
        for _ in range(3):
            fn()
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)

    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            out["backends"][name] = {"skipped": "not in this PyTorch"}
            continue
        x = qkv.detach().clone().requires_grad_(True)
        q, k, v = x.permute(2, 0, 3, 1, 4)

        def fwd():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd():
            y = fwd()
            (gq,) = torch.autograd.grad(y, x, dout)
            return gq

        try:
            with torch.no_grad():
                t_f = timed(fwd, args.attention_iters)
            t_fb = timed(fwd_bwd, args.attention_iters)
        except RuntimeError as e:  # the backend refuses the shape or is not built in
            out["backends"][name] = {"skipped": str(e).splitlines()[0][:300]}
            print(f"attention {name}: not run ({str(e).splitlines()[0][:200]})", flush=True)
            continue
        t_b = max(t_fb - t_f, 1e-9)
        r = {"forward_s": t_f, "backward_s": t_b, "forward_tflops": fwd_flops / t_f / 1e12,
             "backward_tflops": 2.5 * fwd_flops / t_b / 1e12}
        if peak:
            r["forward_of_peak"], r["backward_of_peak"] = fwd_flops / t_f / peak, 2.5 * fwd_flops / t_b / peak
        out["backends"][name] = r
        print(f"attention {name} B={B} T={T} H={H} D={D} causal: forward {1e3 * t_f:.4f} ms "
              f"({r['forward_tflops']:.1f} TFLOP/s), backward {1e3 * t_b:.4f} ms ({r['backward_tflops']:.1f} "
              f"TFLOP/s)", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a megascale job spec (model:, train:)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=3, help="steps left out of the median (warm-up)")
    ap.add_argument("--device", default=None, help="cuda (default when a GPU is present) or cpu")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--attention", action="store_true", help="also time PyTorch's fused attention backends")
    ap.add_argument("--attention-iters", type=int, default=20)
    ap.add_argument("--peak", type=float, default=0.0, help="peak FLOP/s for the MFU (default: the GPU's datasheet)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if args.steps < 1 or args.skip < 0 or args.attention_iters < 1:
        ap.error("--steps and --attention-iters must be positive, --skip not negative")
    if args.compile and not hasattr(torch, "compile"):
        ap.error(f"--compile needs PyTorch 2.0 or later (this is {torch.__version__})")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: PyTorch sees no GPU")
    name, m, micro, n_micro = read_spec(args.config)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    cudnn = torch.backends.cudnn.version() if device.type == "cuda" else None
    print(f"torch {torch.__version__} on {dev_name} (CUDA {torch.version.cuda}, cuDNN {cudnn}); {name}: "
          f"{m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, {m['block']} block, window {m['window']}, "
          f"vocab {m['vocab']} held as {m['padded_vocab']}, T {m['seq_len']}, {n_micro} micro-batches of {micro}",
          flush=True)
    result = {"spec": name, "model": m, "micro_batch": micro, "micro_batches": n_micro, "device": dev_name,
              "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": cudnn}
    result["train"] = train(m, micro, n_micro, args, device)
    t = result["train"]
    mfu = f", MFU {100 * t['mfu']:.1f} % of {t['peak_flops'] / 1e12:.0f} TFLOP/s" if t["mfu"] else ""
    print(f"PyTorch {name}: median step {1e3 * t['median_step_s']:.1f} ms over steps "
          f"{t['median_over_steps'][0]}..{t['median_over_steps'][-1]}, {t['tokens_per_s']:,.0f} tokens/s{mfu} "
          f"({'compiled' if args.compile else 'eager'}, bf16 autocast, {t['optimizer']})", flush=True)
    if args.attention:
        if device.type != "cuda":
            result["attention"] = {"skipped": "needs a GPU"}
        else:
            result["attention"] = attention_bench(m, micro, args, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
