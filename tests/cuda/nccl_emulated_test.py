#!/usr/bin/python3
"""Multi-rank jobs on the emulated CUDA backend with the emulated NCCL (kernels/sim/nccl.cpp: NCCL's in-order
stream semantics, receives blocking their stream, sends waiting for their receive, grouped operations), against
the CPU backend's losses:

  layouts     dp 2, tp 2, pp 2 (1F1B), pp 2 interleaved, pp 4, tp 2 x pp 2 x dp 2: every step's loss and
              gradient norm within 1e-4 relative of the one-process CPU run (fp32); pp 2, dp 2 ZeRO-2, tp 2 with
              sequence parallelism and chunked communication, and 2x2x2 ZeRO-1 once more with the deferred
              emulated streams (work runs only when waited for); pp 2 with runtime.device_comm: gloo;
  bf16 sums   parallel.tp_reduce_dtype: bf16 on tp 2 (chunked all-reduces; sequence parallelism's reduce-scatters)
              with the deferred streams, against the CPU backend's bf16 sums of the same layout (3e-4 relative);
  bf16 fused  runtime.activations: bf16 with bf16 TP sums: the GEMMs' bf16 partials and the bf16 sums read as they
              are give the bits of the rounding and widening passes (MEGASCALE_TP_SUMS16=unfused), deferred;
  bf16 kept   runtime.bf16_operands: keep gives the bits of cast (bf16 GEMMs) on tp 2 with sequence parallelism
              (chunked, and unchunked with the sequential block; keep all-gathers the LayerNorm outputs and dres in
              bf16, as the trace must show, cast in fp32), and on tp 2 x pp 2 x dp 2 ZeRO-1 (sequential block),
              with the deferred streams;
  zero bf16   ZeRO's parameter all-gathers of the kept bf16 weight copies give the bits of the fp32 gathers and
              casts (MEGASCALE_ZERO_GATHER=fp32): ZeRO-2 on tp 2 x pp 2 x dp 2 (a tied wte across the stages) and
              ZeRO-1 on dp 2 with an untied head, with the deferred streams;
  deadlock    the pipeline's former order (receive of the next action posted before the current send:
              MEGASCALE_PP_P2P=ungrouped) deadlocks on NCCL semantics; the watchdog ends the job within the
              timeout, naming the group, the operation and the peer;
  graphs      runtime.cuda_graphs at tp 2 (the collectives captured in the graphs) gives the bits of op by op, deferred;
              with every collective held 20 ms, the graphs' device waits are timed (comm_exposed_s) as op by op's;
  stuck peer  an injected stuck rank (MS_SIM_NCCL_STALL) ends the job within the timeout, naming group, op, peer;
              on tp 2, where a training step's collectives are waited for on the device (the host does not wait:
              the communicator's watchdog thread finds the timeout and aborts), the same;
  planted     with the communicator's wait for the compute stream removed (MEGASCALE_PLANT=nccl_no_compute_wait)
              the deferred streams make pp, dp and tp communicate stale buffers: the losses or the grad norms
              must differ; with the compute stream's wait for a tensor-parallel collective removed
              (MEGASCALE_PLANT=nccl_no_device_wait: Work::WaitOnDevice orders nothing) the layers read their sums
              before NCCL wrote them: tp 2 and tp 2 with sequence parallelism, chunked, must differ; so must pp 2
              (a stage computes on its receive buffer before the activations or gradients arrived), and
              dp 2 with ZeRO-1 (the forward copies the parameters before their all-gather wrote them) and ZeRO-2
              (a gradient window zeroed for its next bucket, and a shard added into its window, before the
              reduce-scatter that reads the one and writes the other completed).

Usage: nccl_emulated_test.py MEGASCALE MEGASCALE_EMU WORK_DIR [--quick] [--gpu]
  --gpu: MEGASCALE_EMU is a megascale built with nvcc and the layouts (and tp 2's bf16 sums) run on real GPUs and
         libnccl (ctest -L gpu);
         a layout needing more GPUs than the machine has is skipped, and the emulator-only cases (deferred
         streams, Gloo, buffering, stuck peer, planted bug) are not run.
"""
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpus import fortune_corpus, gpu_count  # noqa: E402

BIN, EMU, WORK = (os.path.abspath(a) for a in sys.argv[1:4])
QUICK = "--quick" in sys.argv[4:]
GPU = "--gpu" in sys.argv[4:]
failures = []
skipped = []


def ranks_of(parallel):
    n = 1
    for k in ("tp", "pp", "dp"):
        key = k + ": "
        if key in parallel:
            n *= int(parallel.split(key)[1].split(",")[0].split("}")[0])
    return n


def fits(name, parallel):
    if GPU and ranks_of(parallel) > gpu_count():
        print(f"skip {name}: {ranks_of(parallel)} ranks need as many GPUs, {gpu_count()} visible")
        skipped.append(name)
        return False
    return True


def run(binary, args, env=None, timeout=600):
    e = dict(os.environ)
    e.update(env or {})
    t0 = time.time()
    p = subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout, env=e)
    return p.returncode, p.stdout, p.stderr, time.time() - t0


def series(run_dir, key):
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {r["step"]: r[key] for r in rows if r["phase"] == "train"}


def spec(path, run_dir, parallel, layers=2, batch=8):
    with open(path, "w") as f:
        f.write(f"""name: nccl-emu
model: {{layers: {layers}, hidden: 64, heads: 4, seq_len: 32, vocab: 256, attention: {{window: 12}}}}
train: {{steps: 4, global_batch: {batch}, seed: 5, precision: fp32}}
optimizer: {{kind: adamw, lr: 3.0e-3, warmup_steps: 2}}
parallel: {parallel}
data: {{path: {DATA}}}
log: {{run_dir: {run_dir}, interval: 1}}
runtime: {{threads: 1, collective_timeout_s: 60}}
fault: {{max_restarts: 0}}
""")


def report(name, err):
    print(("ok   " if err is None else "FAIL ") + name + ("" if err is None else ": " + err), flush=True)
    if err is not None:
        failures.append(name)


cpu_references = {}  # layers -> the run dir of the one-process CPU run every layout of that depth is compared with


def cpu_reference(layers):
    """(run dir, None) of the one-process CPU backend run with `layers` layers (run once), or (None, error)."""
    if layers not in cpu_references:
        d, path = os.path.join(WORK, f"cpu-{layers}"), os.path.join(WORK, f"cpu-{layers}.yaml")
        spec(path, d, "{}", layers)
        rc, _, err, _ = run(BIN, ["train", path])
        if rc != 0:
            return None, f"cpu run failed: {err.strip()[-800:]}"
        cpu_references[layers] = d
    return cpu_references[layers], None


def compare(name, parallel, layers=2, env=None, sets=(), expect_differ=False):
    cpu_dir, err = cpu_reference(layers)  # the reference: one process on the CPU backend
    if err:
        return err
    emu_dir, path = os.path.join(WORK, name + "-emu"), os.path.join(WORK, name + ".yaml")
    spec(path, emu_dir, parallel, layers)
    args = ["train", path, "--set", "runtime.backend=cuda"]
    for s in sets:
        args += ["--set", s]
    rc, _, err, wall = run(EMU, args, env)
    if rc != 0:
        return f"emulated run failed: {err.strip()[-1200:]}"
    log = open(os.path.join(emu_dir, "logs", "rank-0.log")).read()
    want = "communicators: Gloo" if "runtime.device_comm=gloo" in sets else (
        "communicators: NCCL" if GPU else "communicators: the emulated NCCL")
    if "runtime.device_comm=gloo" in sets:
        if "emulated NCCL" in log:
            return "runtime.device_comm: gloo still created the emulated NCCL groups"
    elif want not in log:
        return f"rank 0's log does not say '{want}'"
    worst = {}
    for key in ("loss", "grad_norm"):
        a, b = series(cpu_dir, key), series(emu_dir, key)
        if sorted(a) != sorted(b) or not a:
            return f"different steps: {sorted(a)} vs {sorted(b)}"
        worst[key] = max(abs(a[s] - b[s]) / abs(a[s]) for s in a)
    print(f"     {name}: {wall:.1f} s, worst relative difference loss {worst['loss']:.2e}, grad_norm "
          f"{worst['grad_norm']:.2e}")
    if expect_differ:
        # The race a planted bug opens corrupts gradients at some step; when that is a late step, only the
        # gradient norm shows it (seen: dp2 with the loss within 4e-4 but the grad norm 0.5 off), so either counts.
        # The bar is 1e-5, 180x the correct fp32 layouts' worst (<= 5.6e-8): dp2 with ZeRO-1 reads parameters one
        # step stale, a small change (the slow NCCL below makes it 1e-2).
        caught = max(worst.values()) > 1e-5
        return None if caught else "the planted bug went unnoticed: losses and grad norms match the CPU run"
    if not max(worst.values()) <= 1e-4:
        return f"differs from the CPU run by {max(worst.values()):.3e} relative (> 1e-4)"
    return None


def tp_gathers(run_dir):
    """The tensor-parallel all-gathers on rank 0's trace: {span name without its chunk suffix}."""
    events = json.load(open(os.path.join(run_dir, "trace", "rank-0.json")))
    names = {e["name"] for e in events if e.get("ph") == "X" and e["name"].startswith("tp all-gather")}
    return {" ".join(n.split()[:-1]) if n.split()[-1][0].isdigit() and "/" in n.split()[-1] else n for n in names}


def bf16_variant(name, variant, parallel, sets, env, layers=2):
    """One bf16 run of the emulated CUDA backend (`variant` names its run dir): (run dir, None) or (None, error)."""
    d = os.path.join(WORK, f"{name}-{variant}")
    path = os.path.join(WORK, f"{name}-{variant}.yaml")
    spec(path, d, parallel, layers)
    args = ["train", path, "--set", "runtime.backend=cuda", "--set", "train.precision=bf16"]
    for s in sets:
        args += ["--set", s]
    rc, _, err, wall = run(EMU, args, env)
    if rc != 0:
        return None, f"{variant} run failed: {err.strip()[-1200:]}"
    print(f"     {name} {variant}: {wall:.1f} s")
    return d, None


def bits_differ(got, a, b):
    """None when variants a and b of got ({variant: (losses, grad norms)}) trained the same bits, else why not."""
    if not got[a][0]:
        return "no train steps"
    if got[a] != got[b]:
        return f"{a} {got[a]} != {b} {got[b]}"
    return None


def same_bits(name, parallel, sets, env=None, layers=2, gathers16=False):
    """bf16 on the CUDA backend: runtime.bf16_operands keep (the default: bf16 weights cast once per step, each
    layer input once per micro-batch and kept for the backward, through the layout's row chunks) must give the
    bits of cast (every GEMM casts its own operands).
    gathers16 (sequence parallelism): with keep the LayerNorm outputs (forward) and dres (backward) must be
    all-gathered in bf16 — rank 0's trace shows "tp all-gather (bf16) ..." spans for them and no fp32 gather of
    them — and with cast in fp32; the embedding's input gradient is gathered in fp32 by both."""
    got = {}
    for variant in ("keep", "cast"):
        d, err = bf16_variant(name, variant, parallel, [f"runtime.bf16_operands={variant}", *sets,
                                                        *(["log.trace=true"] if gathers16 else [])], env, layers)
        if err:
            return err
        got[variant] = (series(d, "loss"), series(d, "grad_norm"))
        if gathers16:
            names = tp_gathers(d)
            bf16 = {n for n in names if n.startswith("tp all-gather (bf16) ")}
            fp32 = names - bf16
            want16 = {"ln", "lnf>head", "dy>"} if variant == "keep" else set()
            want32 = {"dx>embed"} | ({"ln", "lnf>head", "dy>"} if variant == "cast" else set())
            for kind, have, want in (("bf16", bf16, want16), ("fp32", fp32, want32)):
                labels = {n.split()[-1] for n in have}
                for w in want:
                    if not any(l.startswith(w) for l in labels):
                        return f"{variant}: no {kind} all-gather of {w}* on the trace: {sorted(names)}"
                extra = [l for l in labels if not any(l.startswith(w) for w in want)]
                if extra:
                    return f"{variant}: {kind} all-gathers of {extra} on the trace: {sorted(names)}"
    return bits_differ(got, "keep", "cast")


def zero_gathers16(name, parallel, sets=(), env=None):
    """ZeRO's parameter all-gathers of the kept bf16 weight copies (the default with bf16 operands kept) give the bits
    of the fp32 gathers and casts (MEGASCALE_ZERO_GATHER=fp32), the gathers' unpacking ordered after them on the
    device; rank 0's log says which run gathered the copies."""
    got = {}
    for variant, extra_env in (("gather16", {}), ("gather32", {"MEGASCALE_ZERO_GATHER": "fp32"})):
        d, err = bf16_variant(name, variant, parallel, list(sets), dict(env or {}, **extra_env))
        if err:
            return err
        said = "parameter all-gathers move the bf16 weight copies in" in open(
            os.path.join(d, "logs", "rank-0.log")).read()
        if said != (variant == "gather16"):
            return f"{variant}: rank 0's log {'says' if said else 'does not say'} that it gathered bf16 copies"
        got[variant] = (series(d, "loss"), series(d, "grad_norm"))
    return bits_differ(got, "gather16", "gather32")


def fused_sums16(name, parallel, sets=()):
    """runtime.activations: bf16 with parallel.tp_reduce_dtype: bf16 at tp 2 (Gpt::FusedTpSums16): the GEMMs write
    their partial sums in bf16 straight into the collective's buffer and the residual LayerNorm and the LayerNorm
    backwards read the bf16 sum — must give the bits of rounding fp32 partials and widening the sums
    (MEGASCALE_TP_SUMS16=unfused), under the deferred streams; rank 0's log must name the fused sums, and only
    there."""
    got = {}
    for variant, hook in (("fused", {}), ("unfused", {"MEGASCALE_TP_SUMS16": "unfused"})):
        d, err = bf16_variant(name, variant, parallel,
                              ["runtime.activations=bf16", "parallel.tp_reduce_dtype=bf16", *sets], {**DEFERRED, **hook})
        if err:
            return err
        got[variant] = (series(d, "loss"), series(d, "grad_norm"))
        named = "tensor-parallel partial sums" in open(os.path.join(d, "logs", "rank-0.log")).read()
        if named != (variant == "fused"):
            return f"{variant}: rank 0's log {'does not name' if not named else 'names'} the bf16 partial sums"
    return bits_differ(got, "fused", "unfused")


def graphs_same_bits(name, parallel, sets=(), env=None, timed=False):
    """runtime.cuda_graphs at tp 2: each micro-batch slot's passes recorded with their tensor-parallel collectives
    (the NCCL stream forked into the capture, joined back by the device waits) and launched as graphs must give the
    bits of launching the ops one by one, under the deferred streams (env: DEFERRED unless given); rank 0's log must
    say graphs were launched.
    timed: every collective held 20 ms on its stream (MS_SIM_NCCL_DELAY_MS) in both runs, and from step 2 on (every
    micro-batch a graph's launch) the graphs' comm_exposed_s — their device waits timed by the device's clock — must
    be at least half of op by op's (timing events around each wait), which must show the delays (>= 0.1 s)."""
    got, exposed = {}, {}
    for variant in ("graphs", "eager"):
        run_env = dict(DEFERRED if env is None else env, **({"MS_SIM_NCCL_DELAY_MS": "20"} if timed else {}))
        d, err = bf16_variant(name, variant, parallel,
                              [f"runtime.cuda_graphs={'true' if variant == 'graphs' else 'false'}", *sets], run_env)
        if err:
            return err
        got[variant] = (series(d, "loss"), series(d, "grad_norm"))
        exposed[variant] = series(d, "comm_exposed_s")
        log = open(os.path.join(d, "logs", "rank-0.log")).read()
        launched = "launched as graphs" in log and " 0 forwards and backwards launched as graphs" not in log
        if launched != (variant == "graphs"):
            return f"{variant}: rank 0's log says graphs were {'not ' if not launched else ''}launched"
    if timed:
        for step in sorted(exposed["eager"])[1:]:
            g, e = exposed["graphs"].get(step, 0.0), exposed["eager"][step]
            if e < 0.1 or g < 0.5 * e:
                return (f"step {step}: comm_exposed_s {g:.3f} s with graphs, {e:.3f} s op by op (with 20 ms per "
                        "collective: the waits inside the graphs untimed?)")
        print(f"     {name}: comm_exposed_s per step with graphs {[round(v, 3) for v in exposed['graphs'].values()]}, "
              f"op by op {[round(v, 3) for v in exposed['eager'].values()]}")
    return bits_differ(got, "graphs", "eager")


def bf16_sums(name, parallel, env=None):
    """parallel.tp_reduce_dtype: bf16 on the emulated NCCL (ncclBfloat16 sums, the rounding and widening kernels
    ordered around them by events) against the same layout's bf16 sums on the CPU backend (Gloo): at tp 2 both
    communicators add round(a + b), so only the partial sums' fp32 rounding differs between the backends (the loss
    and gradient norm within 3e-4 relative: measured 4.5e-5 on both layouts; the fp32 sums are compared with the
    single-process run at 1e-4 above); rank 0's trace must show the layers' sums in bf16."""
    got = {}
    for binary, tag, extra in ((BIN, "cpu", []), (EMU, "emu", ["runtime.backend=cuda"])):
        d = os.path.join(WORK, f"{name}-{tag}")
        path = os.path.join(WORK, f"{name}-{tag}.yaml")
        spec(path, d, parallel)
        args = ["train", path]
        for s in extra + ["parallel.tp_reduce_dtype=bf16", "log.trace=true"]:
            args += ["--set", s]
        rc, _, err, wall = run(binary, args, env if tag == "emu" else None)
        if rc != 0:
            return f"{tag} run failed: {err.strip()[-1200:]}"
        got[tag] = (series(d, "loss"), series(d, "grad_norm"))
        events = json.load(open(os.path.join(d, "trace", "rank-0.json")))
        names = {e["name"] for e in events if e.get("ph") == "X" and e["name"].startswith("tp ")}
        b16 = [n for n in names if "(bf16)" in n and ("all-reduce" in n or "reduce-scatter" in n)]
        if not any(".proj" in n for n in b16) or not any(">dln" in n for n in b16):
            return f"{tag}: no bf16 sums of the layers on rank 0's trace: {sorted(names)}"
        print(f"     {name} {tag}: {wall:.1f} s, {len(b16)} kinds of bf16 sums on the trace")
    worst = 0.0
    for i in (0, 1):
        a, b = got["cpu"][i], got["emu"][i]
        if sorted(a) != sorted(b) or not a:
            return f"different steps: {sorted(a)} vs {sorted(b)}"
        worst = max(worst, max(abs(a[k] - b[k]) / abs(a[k]) for k in a))
    print(f"     {name}: worst relative difference from the CPU backend's bf16 sums {worst:.2e}")
    return None if worst <= 3e-4 else f"differs from the CPU backend's bf16 sums by {worst:.3e} relative (> 3e-4)"


def must_fail(name, parallel, env, needles, timeout_s=3, layers=2, sets=()):
    path = os.path.join(WORK, name + ".yaml")
    d = os.path.join(WORK, name)
    spec(path, d, parallel, layers)
    args = ["train", path, "--set", "runtime.backend=cuda", "--set", f"runtime.collective_timeout_s={timeout_s}"]
    for s in sets:
        args += ["--set", s]
    rc, _, err, wall = run(EMU, args, env, timeout=300)
    print(f"     {name}: exit {rc} after {wall:.1f} s")
    if rc == 0:
        return "the job succeeded"
    if wall > 90:
        return f"the job took {wall:.0f} s to end (timeout {timeout_s} s)"
    # A needle may be a tuple of alternatives (any of them will do).
    missing = [n for n in needles if not any(x in err for x in (n if isinstance(n, tuple) else (n,)))]
    if missing:
        return f"the error does not name {missing}: {err.strip()[-1200:]}"
    return None


def run_waiting(cases):
    """Runs must_fail(*args, **kwargs) for each (report name, args, kwargs) side by side; reports in their order."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(cases)) as pool:
        futures = [(name, pool.submit(must_fail, *args, **kwargs)) for name, args, kwargs in cases]
        for name, future in futures:
            report(name, future.result())


shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
corpus = fortune_corpus()
DATA = os.path.join(WORK, "fortunes")
rc, _, err, _ = run(BIN, ["prepare-data", "--doc-separator", "%", "--output", DATA, *corpus[:4]])
if rc != 0:
    sys.exit(f"prepare-data failed: {err}")

LAYOUTS = [
    ("dp2", "{dp: 2}", 2),
    ("tp2", "{tp: 2}", 2),
    ("pp2-1f1b", "{pp: 2, micro_batches: 4}", 2),
    ("pp2-interleaved", "{pp: 2, virtual_stages: 2, micro_batches: 4}", 4),
    ("pp4", "{pp: 4, micro_batches: 8}", 4),
    ("tp2-pp2-dp2", "{tp: 2, pp: 2, dp: 2, micro_batches: 2}", 2),
]
for name, par, layers in LAYOUTS:
    if QUICK and name not in ("dp2", "pp2-1f1b"):
        continue
    if fits(name, par):
        report(name, compare(name, par, layers))
if GPU:
    if fits("tp2-bf16-sums", "{tp: 2}"):  # libnccl's ncclBfloat16 sums against the CPU backend's (Gloo)
        report("tp2-bf16-sums", bf16_sums("bf16sums-tp2", "{tp: 2, tp_comm_chunks: 2, micro_batches: 2}"))
    if fits("graphs-tp2-sp-chunks-same-bits", "{tp: 2}"):  # libnccl's collectives captured in CUDA graphs
        report("graphs-tp2-sp-chunks-same-bits",
               graphs_same_bits("graphs-tp2-sp", "{tp: 2, sequence_parallel: true, tp_comm_chunks: 2, micro_batches: 2}",
                                env={}))
    if fits("deadlock-of-the-former-order", "{pp: 2}"):
        report("deadlock-of-the-former-order",
               must_fail("deadlock", "{pp: 2, micro_batches: 4}", {"MEGASCALE_PP_P2P": "ungrouped"},
                         ["no completion after 3.0 s", "nccl-pp[0]", "from peer"]))
    print(f"{len(failures)} failed, {len(skipped)} skipped")
    sys.exit(1 if failures else 0)
if not QUICK:
    # The deferred streams run the backend's work only when something waits for it: every ordering between the
    # compute stream and NCCL's must come from an event (no host synchronization precedes a collective on NCCL).
    DEFERRED = {"MS_SIM_STREAMS": "deferred"}
    for name, par, layers in [
            ("pp2-deferred", "{pp: 2, micro_batches: 4}", 2),
            ("dp2-zero2-deferred", "{dp: 2, zero: 2, micro_batches: 2}", 2),
            ("tp2-sp-chunks-deferred", "{tp: 2, sequence_parallel: true, tp_comm_chunks: 2}", 2),
            ("tp2-pp2-dp2-zero1-deferred", "{tp: 2, pp: 2, dp: 2, zero: 1, micro_batches: 2}", 2)]:
        report(name, compare(name, par, layers, env=DEFERRED))
    report("pp2-gloo", compare("pp2-gloo", "{pp: 2, micro_batches: 4}", sets=["runtime.device_comm=gloo"]))
    # bf16 TP sums on NCCL: an all-reduce layout (chunked) and a reduce-scatter one (sequence parallelism), deferred.
    report("tp2-bf16-sums-chunks-deferred",
           bf16_sums("bf16sums-tp2", "{tp: 2, tp_comm_chunks: 2, micro_batches: 2}", env=DEFERRED))
    report("tp2-sp-bf16-sums-deferred",
           bf16_sums("bf16sums-tp2-sp", "{tp: 2, sequence_parallel: true, micro_batches: 2}", env=DEFERRED))
    # Kept bf16 operands across the layouts' row chunks, stages, micro-batches and ZeRO's parameter gathers.
    # Under sequence parallelism keep gathers the GEMM inputs in bf16 and cast in fp32: the same bits, chunked
    # (parallel block) and unchunked (sequential block, in place).
    report("bf16-keep-is-cast-tp2-sp-chunks",
           same_bits("keep-tp2-sp", "{tp: 2, sequence_parallel: true, tp_comm_chunks: 2, micro_batches: 2}", [],
                     env=DEFERRED, gathers16=True))
    report("bf16-keep-is-cast-tp2-sp-sequential-unchunked",
           same_bits("keep-tp2-sp-seq", "{tp: 2, sequence_parallel: true, micro_batches: 2}",
                     ["model.block=sequential"], env=DEFERRED, gathers16=True))
    # A stage without the head: its last layer's output gradient arrives in fp32 (gathered so, the GEMMs round it),
    # the LayerNorm backwards' roundings are gathered in bf16 from there on.
    report("bf16-keep-is-cast-tp2-pp2-sp",
           same_bits("keep-tp2-pp2-sp", "{tp: 2, pp: 2, sequence_parallel: true, tp_comm_chunks: 2, micro_batches: 2}",
                     [], env=DEFERRED))
    report("bf16-keep-is-cast-tp2-pp2-dp2-zero1",
           same_bits("keep-2x2x2", "{tp: 2, pp: 2, dp: 2, zero: 1, micro_batches: 2}", ["model.block=sequential"],
                     env=DEFERRED))
    # ZeRO's parameter all-gathers move the bf16 weight copies: ZeRO-2 over tp 2 x pp 2 x dp 2 (a tied wte on both
    # stages: gathered in fp32, its copy cast), and ZeRO-1 with an untied head (its weight gathered in bf16).
    report("zero2-bf16-gathers-tp2-pp2-dp2",
           zero_gathers16("zg16-2x2x2", "{tp: 2, pp: 2, dp: 2, zero: 2, micro_batches: 2}",
                          ["model.block=sequential", "runtime.activations=bf16", "parallel.bucket_mb=0.03"],
                          env=DEFERRED))
    report("zero1-bf16-gathers-dp2-untied",
           zero_gathers16("zg16-dp2", "{dp: 2, zero: 1, micro_batches: 2}", ["model.tied_embeddings=false"],
                          env=DEFERRED))
    # runtime.activations: bf16 under tp 2 with sequence parallelism (D = 16: the tensor-core attention, so qkv, the
    # attention projection's input gradient and the attention output's rounding in bf16, over local heads and the
    # row chunks of the projection's backward; fp32 logits, the vocab-parallel loss): keep = cast, bit for bit.
    report("bf16-activations-keep-is-cast-tp2-sp",
           same_bits("bf16act-tp2-sp", "{tp: 2, sequence_parallel: true, tp_comm_chunks: 2, micro_batches: 2}",
                     ["runtime.activations=bf16", "runtime.gemm_epilogues=false"], env=DEFERRED, gathers16=True))
    # bf16 activations and bf16 TP sums: the partials written in bf16 by the GEMMs, the sums read in bf16 (the
    # sequential block: both projections forward, fc's and qkv's input gradients and the classifier's backward; the
    # parallel block: the classifier's) = rounding and widening passes, bit for bit; reduce-scatters chunked,
    # all-reduces chunked, and with a pipeline stage.
    report("bf16-sums-fused-tp2-sp-chunks",
           fused_sums16("sums16-tp2-sp", "{tp: 2, sequence_parallel: true, tp_comm_chunks: 2, micro_batches: 2}",
                        ["model.block=sequential"]))
    report("bf16-sums-fused-tp2-chunks",
           fused_sums16("sums16-tp2", "{tp: 2, tp_comm_chunks: 2, micro_batches: 2}", ["model.block=sequential"]))
    report("bf16-sums-fused-tp2-pp2-parallel-block",
           fused_sums16("sums16-tp2-pp2", "{tp: 2, pp: 2, sequence_parallel: true, micro_batches: 2}"))
    # CUDA graphs at tp 2 (the collectives inside the graphs): the parallel block with sequence parallelism, chunked;
    # all-reduces, chunked; the sequential block with the fused bf16 sums; tp 2 x pp 2 x dp 2 with ZeRO-1.
    report("graphs-tp2-sp-chunks-same-bits",
           graphs_same_bits("graphs-tp2-sp", "{tp: 2, sequence_parallel: true, tp_comm_chunks: 2, micro_batches: 2}"))
    report("graphs-tp2-chunks-same-bits-timed",
           graphs_same_bits("graphs-tp2", "{tp: 2, tp_comm_chunks: 2, micro_batches: 2}", ["model.block=sequential"],
                            timed=True))
    report("graphs-tp2-sp-fused-bf16-sums-same-bits",
           graphs_same_bits("graphs-tp2-sums16", "{tp: 2, sequence_parallel: true, micro_batches: 2}",
                            ["model.block=sequential", "runtime.activations=bf16", "parallel.tp_reduce_dtype=bf16"]))
    report("graphs-tp2-pp2-dp2-zero1-same-bits",
           graphs_same_bits("graphs-2x2x2", "{tp: 2, pp: 2, dp: 2, zero: 1, micro_batches: 2}",
                            ["model.block=sequential"]))
DEADLOCK = ["no completion after 3.0 s", "nccl-pp[0]", "from peer", "runtime.collective_timeout_s"]
UNGROUPED = {"MEGASCALE_PP_P2P": "ungrouped"}
# The cases that must fail end by a timeout and spend most of it waiting (ranks blocked in the emulated NCCL until
# the 3 s watchdog fires: ~0.5 s of CPU in 3.5 to 6.5 s): they run side by side at the end (run_waiting), reported
# in this order.
waiting = [("deadlock-of-the-former-order", ("deadlock", "{pp: 2, micro_batches: 4}", UNGROUPED, DEADLOCK), {})]
if not QUICK:
    # Without the receive posted ahead, the 1F1B crossing of two sends still deadlocks when NCCL does not buffer
    # (the emulator's default), and runs when it buffers everything: why a small test on real NCCL can miss it.
    waiting.append(("deadlock-of-the-crossing",
                    ("crossing", "{pp: 2, micro_batches: 4, pp_overlap: false}", UNGROUPED, DEADLOCK), {}))
    report("crossing-hidden-by-buffering",
           compare("buffered", "{pp: 2, micro_batches: 4, pp_overlap: false}",
                   env=dict(UNGROUPED, MS_SIM_NCCL_EAGER_BYTES="100000000")))
    # Interleaved: a rank receives from its peer in another order than the peer sends; buffering does not help.
    waiting.append(("deadlock-of-the-interleaved-order",
                    ("interleaved", "{pp: 2, virtual_stages: 2, micro_batches: 4}",
                     dict(UNGROUPED, MS_SIM_NCCL_EAGER_BYTES="100000000"), DEADLOCK), {"layers": 4}))
    waiting.append(("watchdog-stuck-peer",
                    ("stuck", "{dp: 2}", {"MS_SIM_NCCL_STALL": "1:2"},
                     # Whichever rank's watchdog fires first ends the job: the waiting rank 0 names peer 1, the
                     # stalled rank 1 (its own operation times out too; seen on a loaded machine) names peer 0.
                     ["no completion after 3.0 s", ("all-reduce (peers 1)", "all-reduce (peers 0)"), "nccl-dp[0]"]),
                    {}))
    # The tensor-parallel collectives of a training step are waited for on the device: a stuck peer is found by
    # the communicator's watchdog thread (the host is not waiting in it), which aborts the communicator; the step's
    # drain (or the next collective) reports it.
    waiting.append(("watchdog-stuck-peer-tp-device-waits",
                    ("stuck-tp", "{tp: 2}", {"MS_SIM_NCCL_STALL": "1:3"},
                     ["no completion after 3.0 s", "nccl-tp[0]", "aborted after an earlier failure",
                      "runtime.collective_timeout_s"]), {}))
    # A stuck peer inside a graph (operation 12 on is the second micro-batch's, recorded in the graphs): no Work
    # stands for the graphs' collectives, the communicator watches each launch (Communicator::WatchCompute).
    waiting.append(("watchdog-stuck-peer-tp-in-graphs",
                    ("stuck-tp-graphs", "{tp: 2, micro_batches: 2}", {"MS_SIM_NCCL_STALL": "1:12"},
                     ["no completion after 3.0 s", "graph's tensor-parallel collectives on nccl-tp[0]",
                      "runtime.collective_timeout_s"]),
                    {"sets": ["train.precision=bf16", "runtime.cuda_graphs=true"]}))
if not QUICK:
    PLANTED = {"MS_SIM_STREAMS": "deferred", "MEGASCALE_PLANT": "nccl_no_compute_wait"}
    for name, par in [("pp2", "{pp: 2, micro_batches: 4}"), ("dp2", "{dp: 2}"), ("tp2", "{tp: 2}")]:
        report(f"planted-missing-event-wait-caught-{name}",
               compare(f"planted-{name}", par, env=PLANTED, expect_differ=True))
    PLANTED_DEVICE = {"MS_SIM_STREAMS": "deferred", "MEGASCALE_PLANT": "nccl_no_device_wait"}
    # ZeRO's parameter all-gathers run on NCCL's eager stream while the next step's forward waits (deferred) for the
    # host to ask for it, so without the device wait the forward read stale parameters only when the peer happened
    # to be late: 1e-5 to 2e-3 off, and one fresh-clone .ci/run (a build beside it) matched to 4.5e-8. Each NCCL
    # operation held 100 ms (MS_SIM_NCCL_DELAY_MS) makes the forward run first every time: the loss 1.2e-2 to 2.3e-2
    # off in each of 12 runs here (6 a case, 4 of them beside two busy loops); the correct runs still match (4.5e-8).
    SLOW_NCCL = {"MS_SIM_NCCL_DELAY_MS": "100"}
    for name, par, extra in [("tp2", "{tp: 2}", {}),
                             ("tp2-sp-chunks", "{tp: 2, sequence_parallel: true, tp_comm_chunks: 2}", {}),
                             ("pp2", "{pp: 2, micro_batches: 4}", {}),
                             ("dp2-zero1", "{dp: 2, zero: 1}", SLOW_NCCL),
                             ("dp2-zero2", "{dp: 2, zero: 2, micro_batches: 2}", SLOW_NCCL)]:
        report(f"planted-missing-device-wait-caught-{name}",
               compare(f"planted-device-{name}", par, env=dict(PLANTED_DEVICE, **extra), expect_differ=True))
run_waiting(waiting)
print(f"{len(failures)} failed")
sys.exit(1 if failures else 0)
