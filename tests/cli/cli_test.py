#!/usr/bin/python3
"""End-to-end tests of the megascale binary: flags, job-spec errors, data errors, and a short
training run whose loss must fall.

Usage: cli_test.py MEGASCALE_BINARY SOURCE_DIR WORK_DIR
Prints one line per case and a closing "N passed, M failed"; exit 1 on any failure (MS_TEST_CASES=a,b runs only
those cases).
"""
import glob
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import harness  # noqa: E402

BIN, SRC, WORK = (os.path.abspath(a) for a in sys.argv[1:4])
case = harness.Cases()


def run(*args, cwd=None):
    p = subprocess.run([BIN, *args], capture_output=True, text=True, cwd=cwd, timeout=600)
    return p.returncode, p.stdout, p.stderr


def expect_error(args, needle, code=1):
    rc, out, err = run(*args)
    assert rc == code, f"{args}: exit {rc}, expected {code}; stderr: {err.strip()}"
    assert needle in err, f"{args}: stderr lacks {needle!r}: {err.strip()}"
    assert err.startswith("error: "), f"{args}: stderr does not start with 'error: ': {err.strip()}"


def write_spec(path, data_prefix, run_dir, extra=""):
    with open(path, "w") as f:
        f.write(f"""name: cli
model: {{layers: 2, hidden: 64, heads: 4, seq_len: 64, vocab: 256, block: sequential, attention: {{window: 16}}}}
train: {{steps: 60, global_batch: 8, seed: 7, eval_interval: 30}}
optimizer: {{kind: adamw, lr: 3.0e-3, min_lr: 3.0e-4, warmup_steps: 5}}
data: {{path: {data_prefix}}}
log: {{run_dir: {run_dir}, interval: 20, peak_flops: 1.0e11}}
runtime: {{threads: 2}}
{extra}""")


harness.fresh_dir(WORK)
corpus = harness.fortunes(required=False)  # a case asserts they are there
DATA = os.path.join(WORK, "fortunes")


@case
def version_and_help():
    rc, out, _ = run("--version")
    assert rc == 0 and out.startswith("megascale "), out
    for sub in ("train", "resume", "validate", "prepare-data", "init-test", "bench"):
        rc, out, err = run(sub, "--help")
        assert rc == 0 and "Usage" in out + err, f"{sub} --help: exit {rc}"
    rc, _, _ = run()
    assert rc != 0, "no subcommand must fail"


@case
def startup_loads_neither_libfabric_nor_cublas():
    # Both are loaded at their first use (lib/fabric: self-check; lib/cuda/cublas_loader.h: the CUDA backend).
    # Loaded at start, libfabric ran a provider's constructor that sleeps about 0.2 s and libcublasLt cost about
    # 0.1 s of CPU, in every megascale process (every rank, every command).
    p = subprocess.run([BIN, "--version"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "LD_DEBUG": "libs"})
    assert p.returncode == 0, p.stderr[-2000:]
    loaded = [l for l in p.stderr.splitlines() if "calling init:" in l]
    assert any("libc.so" in l for l in loaded), "LD_DEBUG=libs listed no libraries: " + p.stderr[-2000:]
    for lib in ("libfabric", "libcublas"):
        assert not any(lib in l for l in loaded), f"{lib} is loaded at start:\n" + "\n".join(loaded)


@case
def prepare_data_from_debian_fortunes():
    assert corpus, "no fortunes files: run scripts/setup.sh"
    rc, out, err = run("prepare-data", "--doc-separator", "%", "--output", DATA, *corpus[:6])
    assert rc == 0, err
    assert os.path.getsize(DATA + ".idx") > 0 and os.path.getsize(DATA + ".bin") > 0
    expect_error(["prepare-data", "--doc-separator", "%", "--output", DATA, corpus[0]], "--overwrite")


@case
def validate_shipped_configs():
    for spec in glob.glob(os.path.join(SRC, "configs", "*.yaml")):
        rc, out, err = run("validate", "--no-files", spec)
        if rc != 0 and "built without nvcc" in err:
            # A GPU config (runtime.backend: cuda) on a build without CUDA is refused with that message; every
            # other key of it must still be valid (on the CPU backend, whose GEMMs are fp32).
            rc, out, err = run("validate", "--no-files", spec, "--set", "runtime.backend=cpu", "--set",
                               "train.precision=fp32")
        assert rc == 0, f"{spec}: {err}"
        assert "model:" in out and "window:" in out, "resolved spec not printed"


@case
def bad_specs_each_give_their_error():
    fixtures = glob.glob(os.path.join(SRC, "tests", "config", "bad", "*.yaml"))
    assert len(fixtures) >= 4
    for spec in fixtures:
        first = open(spec).readline()
        assert first.startswith("# expect: "), spec
        expect_error(["validate", "--no-files", spec], first[len("# expect: "):].strip())


@case
def missing_data_and_corrupt_index():
    spec = os.path.join(WORK, "missing.yaml")
    write_spec(spec, os.path.join(WORK, "nope"), os.path.join(WORK, "run-missing"))
    expect_error(["train", spec], "nope.bin")
    bad = os.path.join(WORK, "bad")
    shutil.copy(DATA + ".bin", bad + ".bin")
    with open(DATA + ".idx", "rb") as f:
        head = f.read(100)
    with open(bad + ".idx", "wb") as f:
        f.write(head)  # truncated index
    spec = os.path.join(WORK, "corrupt.yaml")
    write_spec(spec, bad, os.path.join(WORK, "run-corrupt"))
    expect_error(["train", spec], "bad.idx")
    assert not os.path.exists(os.path.join(WORK, "run-corrupt")), "a failed start must not leave a run directory"


@case
def bad_layouts_and_bad_sweeps_refuse():
    spec = os.path.join(WORK, "ok.yaml")
    write_spec(spec, DATA, os.path.join(WORK, "run-refuse"))
    expect_error(["train", spec, "--set", "parallel.tp=3"], "not divisible by parallel.tp = 3")
    expect_error(["resume", spec], "nothing to resume")
    expect_error(["bench", spec, "--vary", "model.hiden=1,2"], "not a key of the job spec")
    expect_error(["train", spec, "--set", "model.hiden=3"], "did you mean")


@case
def short_training_run_loss_falls():
    spec = os.path.join(WORK, "train.yaml")
    run_dir = os.path.join(WORK, "run-train")
    write_spec(spec, DATA, run_dir)
    rc, out, err = run("train", spec)
    assert rc == 0, err
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    train = [r for r in rows if r["phase"] == "train"]
    evals = [r for r in rows if r["phase"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 61)), "one metrics row per step"
    assert [r["step"] for r in evals] == [30, 60], evals
    first, last = train[0]["loss"], sum(r["loss"] for r in train[-5:]) / 5
    assert first > 5.0, f"initial loss {first} should be near ln(256) = 5.55"
    assert last < first - 2.0, f"loss did not fall enough: {first} -> {last}"
    for key in ("lr", "grad_norm", "tokens_per_s", "flops_per_s", "mfu", "step_s"):
        assert all(key in r for r in train), key
    assert "step 60/60" in out, "progress lines missing when stdout is not a terminal"
    # The resolved spec in the run directory is itself a valid job spec.
    rc, _, err = run("validate", os.path.join(run_dir, "job.yaml"))
    assert rc == 0, err
    assert os.path.getsize(os.path.join(run_dir, "train.log")) > 0
    # Same seed, same thread count: the same losses, bit for bit.
    rc, _, err = run("train", spec, "--set", f"log.run_dir={run_dir}-again")
    assert rc == 0, err
    again = [json.loads(l)["loss"] for l in open(os.path.join(run_dir + "-again", "metrics.jsonl")) if '"train"' in l]
    assert again == [r["loss"] for r in train], "training is not deterministic"


@case
def two_ranks_with_a_relative_run_directory():
    spec = os.path.join(WORK, "rel.yaml")
    write_spec(spec, DATA, "placeholder")
    rc, out, err = run("train", spec, "--set", "parallel.dp=2", "--set", "train.steps=3", "--set",
                       "optimizer.warmup_steps=1", "--set", "train.eval_interval=0", "--set", "log.run_dir=rel/run",
                       "--set", "runtime.threads=1", cwd=WORK)
    assert rc == 0, err
    run_dir = os.path.join(WORK, "rel", "run")
    assert os.path.exists(os.path.join(run_dir, "logs", "rank-1.log")), "per-rank logs missing"
    assert not glob.glob(os.path.join(run_dir, "megascale-redis-*")), "embedded redis directory left behind"
    assert "started redis-server" in err, "no embedded redis-server"


case.exit()
