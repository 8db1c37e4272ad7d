#!/usr/bin/python3
"""The shared-memory data loader (one per host) end to end, against per-rank loading.

  layouts         over ~2.4 epochs and the layouts 1.1.1, 1.1.2, 1.1.4, 1.2.2 and 2.1.2 with sequence
                  parallelism (tp.pp.dp): every training sample is consumed exactly once per epoch,
                  sample k goes where the single-process sampler puts it, and the shared loader gives
                  exactly the losses of data.loader: per_rank
  segments        one segment per host and job while it runs, mode 0600, none after it
  sigkill_job     SIGKILL of the whole job leaves its segment; the next run removes it, and none
                  remains after that run
  loader_stall    the loader stops publishing (MEGASCALE_FAULT loader_stall): the readers fail within
                  data.loader_timeout_s naming the loader, the driver restarts, the run ends with the
                  undisturbed loss
  reader_killed   SIGKILL of a reader: restarted, undisturbed loss, no segment left
  loader_killed   SIGKILL of the loader's rank (local rank 0): the same
  resume_layout   a run stopped mid-epoch and resumed in another layout continues the sample
                  sequence exactly (sample indices compared, not only losses)
  subword_dataset a SentencePiece-tokenized dataset trains; data.tokenizer and model.vocab are checked
                  against its metadata before launch

Usage: loader_test.py MEGASCALE WORK_DIR (MS_TEST_CASES=a,b runs only those cases).
"""
import glob
import json
import os
import random
import signal
import stat
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import harness  # noqa: E402

BIN, WORK = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
case = harness.Cases()
GB, STEPS = 8, 30
LAYOUTS = {"1.1.1": [], "1.1.2": ["parallel.dp=2"], "1.1.4": ["parallel.dp=4"],
           "1.2.2": ["parallel.pp=2", "parallel.dp=2"],
           "2.1.2": ["parallel.tp=2", "parallel.dp=2", "parallel.sequence_parallel=true"]}


def fnv1a(s):
    h = 1469598103934665603
    for b in s.encode():
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def segments(run_dir):
    prefix = f"megascale-{os.getuid()}-{fnv1a(run_dir)[:12]}-"
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(prefix))


def spec(name, steps=STEPS, extra="", job_name=None):
    path = os.path.join(WORK, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(f"""name: {json.dumps(job_name or name)}
model: {{layers: 2, hidden: 32, heads: 4, ffn_hidden: 64, seq_len: 16, vocab: 256, attention: {{window: 6}}}}
train: {{steps: {steps}, global_batch: {GB}, micro_batch: 1, seed: 5}}
optimizer: {{lr: 2.0e-3, warmup_steps: 2}}
data: {{path: {DATA}, valid_fraction: 0.05}}
log: {{interval: 1000, peak_flops: 1.0e10, run_dir: {os.path.join(WORK, name)}}}
runtime: {{threads: 1, collective_timeout_s: 20}}
fault: {{heartbeat_s: 0.25, heartbeat_timeout_s: 3, hang_timeout_s: 5, restart_backoff_s: 0.1}}
{extra}""")
    return path


ENV = dict(os.environ, MEGASCALE_LOG_SAMPLES="1")


def run(args, env=ENV, timeout=300):
    quiet = ["--no-progress"] if args[0] in ("train", "resume") else []
    return subprocess.run([BIN, *args, *quiet], capture_output=True, text=True, timeout=timeout, env=env)


def start(path, *args, env=ENV):
    return harness.start_train(BIN, path, *args, env=env)


def rows(name, fname="metrics.jsonl"):
    return harness.jsonl(os.path.join(WORK, name, fname))


def losses(name):
    return {r["step"]: r["loss"] for r in rows(name) if r["phase"] == "train"}


def sets(layout):
    return [a for kv in LAYOUTS[layout] for a in ("--set", kv)]


def samples(name):
    """k -> j over every rank's log (k: the run's training sample number, j: the sampler's sample index)."""
    out = {}
    for path in glob.glob(os.path.join(WORK, name, "samples", "rank-*.txt")):
        for line in open(path):
            step, dp, mb, i, j = map(int, line.split())
            n_micro = GB // DPS[name]
            k = (step - 1) * GB + (dp * n_micro + mb) + i
            assert k not in out or out[k] == j, f"{name}: sample {k} logged as {out[k]} and {j}"
            out[k] = j
    return out


def num_train(name):
    for log in glob.glob(os.path.join(WORK, name, "logs", "rank-0.log")) + [os.path.join(WORK, name, "train.log")]:
        if os.path.exists(log):
            for line in open(log):
                if " train / " in line:
                    return int(line.split(" train / ")[0].split()[-1])
    raise AssertionError(f"{name}: no sample counts in the log")


def wait_step(name, step, p, timeout=60):
    harness.wait_step(os.path.join(WORK, name, "metrics.jsonl"), step, p, timeout)


def ranks(p):
    return harness.job_children(p)


harness.fresh_dir(WORK)
# ~1,700 bytes of text made here: about 100 training samples of 16 tokens, so 30 steps of 8 are 2.4 epochs.
rng = random.Random(11)
text = "\n%\n".join(" ".join("".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7)))
                              for _ in range(rng.randint(5, 25))) for _ in range(16))
open(os.path.join(WORK, "corpus.txt"), "w").write(text[:1700])
DATA = os.path.join(WORK, "data")
subprocess.run([BIN, "prepare-data", "--doc-separator", "%", "--output", DATA, os.path.join(WORK, "corpus.txt")],
               check=True, capture_output=True)
DPS = {}
REFERENCE = {}


@case
def layouts():
    for layout in LAYOUTS:
        for loader in ("shared", "per_rank"):
            name = f"{layout}-{loader}"
            DPS[name] = int(layout.split(".")[2])
            r = run(["train", spec(name), *sets(layout), "--set", f"data.loader={loader}"])
            assert r.returncode == 0, f"{name}: exit {r.returncode}: {r.stderr[-1500:]}"
            assert not segments(os.path.join(WORK, name)), f"{name}: segments left: {segments(os.path.join(WORK, name))}"
        shared, per_rank = losses(f"{layout}-shared"), losses(f"{layout}-per_rank")
        assert len(shared) == STEPS and shared == per_rank, f"{layout}: shared {shared} per_rank {per_rank}"
        got = samples(f"{layout}-shared")
        assert got == samples(f"{layout}-per_rank"), f"{layout}: the two loaders trained on other samples"
        assert sorted(got) == list(range(STEPS * GB)), f"{layout}: samples {sorted(got)[:5]}... of {STEPS * GB}"
        if layout == "1.1.1":
            REFERENCE.update(got)
        assert got == REFERENCE, f"{layout}: samples differ from the single-process sampler's"
    n = num_train("1.1.1-shared")
    assert STEPS * GB >= 2 * n, f"only {STEPS * GB} samples of {n} per epoch"
    for e in range(STEPS * GB // n):
        epoch = sorted(REFERENCE[k] for k in range(e * n, (e + 1) * n))
        assert epoch == list(range(n)), f"epoch {e}: samples not each exactly once"
    assert [REFERENCE[k] for k in range(n)] != [REFERENCE[k] for k in range(n, 2 * n)], "epochs in the same order"


@case
def segments_during_run():
    name = "seg"
    run_dir = os.path.join(WORK, name)
    # A long job name with quotes: the segment's name (which holds the job id) is longer than 64 characters.
    p = start(spec(name, steps=400, extra="parallel: {dp: 2}\n",
                   job_name="it's a \"long\" job name $(touch pwned) with more words than forty characters"))
    try:
        wait_step(name, 20, p)
        seen = segments(run_dir)
        assert len(seen) == 1, f"segments during the run: {seen}"
        mode = stat.S_IMODE(os.stat(os.path.join("/dev/shm", seen[0])).st_mode)
        assert mode == 0o600, f"mode {oct(mode)}"
    finally:
        out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-1500:]
    assert not segments(run_dir), f"after the run: {segments(run_dir)}"


@case
def sigkill_job():
    name = "kill"
    run_dir = os.path.join(WORK, name)
    path = spec(name, steps=300, extra="parallel: {dp: 2}\n")
    p = start(path)
    wait_step(name, 10, p)
    os.killpg(p.pid, signal.SIGKILL)
    p.communicate(timeout=30)
    time.sleep(0.3)
    assert len(segments(run_dir)) == 1, f"after SIGKILL: {segments(run_dir)}"
    p = start(path, "--set", "train.steps=60", "--set", "checkpoint.resume=none")
    try:
        wait_step(name, 5, p)
        seen = segments(run_dir)
        assert len(seen) == 1, f"during the next run: {seen}"
    finally:
        out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-1500:]
    assert not segments(run_dir), f"after the next run: {segments(run_dir)}"


def recovered(name, p_or_rc, reference):
    out, err = p_or_rc.communicate(timeout=300)
    assert p_or_rc.returncode == 0, f"exit {p_or_rc.returncode}: {err[-1500:]}"
    got = losses(name)
    assert got.get(STEPS_FT) == reference, f"final loss {got.get(STEPS_FT)}, undisturbed {reference}"
    assert not segments(os.path.join(WORK, name)), f"segments left: {segments(os.path.join(WORK, name))}"
    return [e for e in rows(name, "events.jsonl") if e["event"] == "fault"]


STEPS_FT = 40
FT_EXTRA = "parallel: {dp: 2}\ncheckpoint: {interval: 5}\n"
FT_REFERENCE = {}


def undisturbed():
    if "loss" not in FT_REFERENCE:
        r = run(["train", spec("ft-ref", steps=STEPS_FT, extra=FT_EXTRA)])
        assert r.returncode == 0, r.stderr[-1500:]
        FT_REFERENCE["loss"] = losses("ft-ref")[STEPS_FT]
    return FT_REFERENCE["loss"]


@case
def loader_stall():
    ref = undisturbed()
    env = dict(ENV, MEGASCALE_FAULT="loader_stall:rank=0:step=12")
    t0 = time.time()
    p = start(spec("stall", steps=STEPS_FT, extra=FT_EXTRA), "--set", "data.loader_timeout_s=2", env=env)
    faults = recovered("stall", p, ref)
    assert faults, "no fault recorded"
    detail = faults[0]["detail"]
    assert "published nothing for 2 s" in detail and "data loader of host" in detail and "step 12" in detail, detail
    assert time.time() - t0 < 60, f"took {time.time() - t0:.0f} s"


def kill_rank(name, rank):
    ref = undisturbed()
    # The rank stops at step 14 of the first attempt (MEGASCALE_FAULT hang), so the kill cannot come after the run
    # has finished, however loaded the machine; the restart resumes from the checkpoint of step 10.
    env = dict(ENV, MEGASCALE_FAULT=f"hang:rank={rank}:step=14")
    p = start(spec(name, steps=STEPS_FT, extra=FT_EXTRA), env=env)
    wait_step(name, 12, p)
    os.kill(ranks(p)[rank], signal.SIGKILL)
    faults = recovered(name, p, ref)
    assert faults and faults[0]["kind"] == "crash" and faults[0]["rank"] == rank, faults


@case
def reader_killed():
    kill_rank("reader", 1)


@case
def loader_killed():
    kill_rank("loaderk", 0)


@case
def resume_layout():
    if not REFERENCE:
        DPS["1.1.1-shared"] = 1
        assert run(["train", spec("1.1.1-shared")]).returncode == 0
        REFERENCE.update(samples("1.1.1-shared"))
    name = "resume"
    DPS[name] = 2
    path = spec(name, extra="checkpoint: {interval: 7}\n")
    r = run(["train", path, "--set", "parallel.dp=2", "--set", "train.steps=14"])
    assert r.returncode == 0, r.stderr[-1500:]
    # Mid-epoch (14 * 8 = 112 samples of about 100 per epoch), into pipeline x data parallelism.
    r = run(["resume", path, "--set", "parallel.pp=2", "--set", "parallel.dp=2", "--set", f"train.steps={STEPS}"])
    assert r.returncode == 0, r.stderr[-1500:]
    got = samples(name)
    assert sorted(got) == list(range(STEPS * GB)), f"samples {len(got)} of {STEPS * GB}"
    wrong = [k for k in got if got[k] != REFERENCE[k]]
    assert not wrong, f"{len(wrong)} samples differ from the uninterrupted run's, first at k={wrong[0]}"
    # The checkpoint holds the position: 14 steps of 8 samples.
    meta = subprocess.run(["grep", "-rah", "consumed_samples=", os.path.join(WORK, name, "checkpoints", "step-00000014")],
                          capture_output=True).stdout.decode(errors="replace")
    assert "consumed_samples=112" in meta, meta[:300]

@case
def subword_dataset():
    """A SentencePiece dataset trains, and a job's data.tokenizer / model.vocab are checked against it."""
    corpus = os.path.join(WORK, "corpus.txt")
    sp = os.path.join(WORK, "sp")
    r = subprocess.run([BIN, "prepare-data", "--tokenizer", "unigram", "--vocab-size", "300", "--doc-separator", "%",
                        "--output", sp, corpus], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "tokens per byte" in r.stdout and os.path.exists(sp + ".model") and os.path.exists(sp + ".json"), r.stdout
    path = spec("subword", steps=3)
    small = run(["validate", path, "--set", f"data.path={sp}"])
    assert small.returncode != 0 and "model.vocab" in small.stderr and "300" in small.stderr, small.stderr
    byte = run(["validate", path, "--set", f"data.path={sp}", "--set", "model.vocab=320", "--set",
                "data.tokenizer=byte"])
    assert byte.returncode != 0 and "data.tokenizer: auto" in byte.stderr, byte.stderr
    ok = run(["train", path, "--set", f"data.path={sp}", "--set", "model.vocab=320", "--set", "parallel.dp=2"])
    assert ok.returncode == 0, ok.stderr[-1500:]
    assert len(losses("subword")) == 3


case.exit()
