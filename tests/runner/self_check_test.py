#!/usr/bin/python3
"""`megascale self-check` through the binary, on local ranks (issue #12):

  passes            4 ranks, provider tcp: exit 0; the table has every rank's GEMM, the host's memory
                    bandwidth, all 6 links and the all-reduce; self_check.jsonl has one row per rank
  slow_gemm         one rank's GEMM slowed 4x by injection: exit 1, that rank (and no other) flagged
  slow_link         one rank's libfabric sends slowed 10x: exit 1, that rank (and no other) flagged
  bad_provider      a provider libfabric does not have: exit 1, naming the providers it has
  before_training   fault.self_check: true: a clean check, then training; with a slow GEMM the job
                    stops before training with the finding (the local launcher has no other host)

Usage: self_check_test.py MEGASCALE WORK_DIR (MS_TEST_CASES=a,b runs only those cases).
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import harness  # noqa: E402

BIN, WORK = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
case = harness.Cases()


# Tolerance 1.0: flag results more than 2x worse than the median. The injections slow 4x; a 2-core
# machine's noise stays well under 2x (the test runs alone: RUN_SERIAL).
def spec(name, dp=4, extra="fault: {self_check_tolerance: 1.0}\n"):
    path = os.path.join(WORK, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(f"""name: {name}
model: {{layers: 2, hidden: 64, heads: 4, seq_len: 64, vocab: 256}}
train: {{steps: 4, global_batch: 8, seed: 3}}
data: {{path: {DATA}, valid_fraction: 0.01}}
log: {{peak_flops: 1.0e10, run_dir: {os.path.join(WORK, name)}}}
runtime: {{threads: 1}}
parallel: {{dp: {dp}}}
{extra}""")
    return path


def run(*args, env=None, timeout=240):
    p = subprocess.run([BIN, *args], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, **(env or {})))
    return p.returncode, p.stdout, p.stderr


def flagged(out):
    """The lines of the FAILED section."""
    return [l.strip() for l in out.split("self-check FAILED", 1)[-1].splitlines()[1:] if l.startswith("  ")]


harness.fresh_dir(WORK)
DATA = harness.prepare_data(BIN, os.path.join(WORK, "data"), harness.fortunes(2))


@case
def passes():
    rc, out, err = run("self-check", spec("passes"))
    assert rc == 0, f"exit {rc}\n{out}\n{err[-1500:]}"
    assert "self-check passed" in out and "GEMM GFLOP/s" in out and "memory (memcpy)" in out, out
    assert "libfabric point-to-point (tcp" in out and "all-reduce over the job's world communicator" in out, out
    links = [l for l in out.splitlines() if l.startswith("rank ") and " - rank " in l]
    assert len(links) == 6, out
    rows = [json.loads(l) for l in open(os.path.join(WORK, "passes", "self_check.jsonl"))]
    assert [r["rank"] for r in rows] == [0, 1, 2, 3] and all(r["gemm_flops"] > 0 for r in rows), rows
    assert rows[0]["memory_bytes_per_s"] > 0 and all(r["errors"] == "" for r in rows), rows
    assert sum(len(r["links"].split(",")) for r in rows if r["links"]) == 6, rows


@case
def slow_gemm():
    rc, out, err = run("self-check", spec("slow_gemm"), env={"MEGASCALE_FAULT": "slow_gemm:rank=2:factor=4"})
    lines = flagged(out)
    # Only rank 2 is flagged, its GEMM among its lines. On a loaded 2-core machine the rank whose GEMM burns 4x the
    # CPU may also show a link latency above the tolerance (seen in CI: 36 us against a median of 18): still rank 2.
    assert rc == 1 and lines and all(l.startswith("rank 2 on ") for l in lines) and \
        any("GEMM" in l for l in lines), f"{out}\n{err[-800:]}"


@case
def slow_link():
    # Factor 10, not 4: on loopback the healthy links alone spread 3x (seen in a fresh-clone run: 1.37-4.18 GB/s), and
    # rank 1's links slowed 4x (464-719 MB/s) then stayed above the flagging line of tolerance 1.0 — "self-check passed".
    rc, out, err = run("self-check", spec("slow_link"), env={"MEGASCALE_FAULT": "slow_link:rank=1:factor=10"})
    lines = flagged(out)
    assert rc == 1 and lines and all(l.startswith("rank 1 on ") and "link" in l for l in lines), f"{out}\n{err[-800:]}"


@case
def bad_provider():
    rc, out, err = run("self-check", spec("bad_provider", dp=2), "--provider", "nosuch")
    assert rc == 1 and "libfabric provider nosuch" in out and "tcp" in out, f"{out}\n{err[-800:]}"


@case
def before_training():
    s = spec("before_training", dp=2, extra="fault: {self_check: true, self_check_tolerance: 1.0}\n")
    rc, out, err = run("train", s, "--no-progress")
    assert rc == 0 and "self-check passed" in out, f"exit {rc}\n{out}\n{err[-1500:]}"
    events = [json.loads(l) for l in open(os.path.join(WORK, "before_training", "events.jsonl"))]
    assert [e["passed"] for e in events if e["event"] == "self_check"] == [1], events
    s = spec("before_training_slow", dp=2, extra="fault: {self_check: true, self_check_tolerance: 1.0}\n")
    # Two ranks: the median is the mean of both, so the slow one is flagged (tolerance 1.0) only when the other is
    # over 3x faster; factor 4 left too thin a margin on a loaded 2-core machine (seen: 2.9x, not flagged).
    rc, out, err = run("train", s, "--no-progress", env={"MEGASCALE_FAULT": "slow_gemm:rank=0:factor=10"})
    assert rc == 1 and "self-check before attempt 0 failed: rank 0 on" in err and "no other host" in err, \
        f"exit {rc}\n{out}\n{err[-1500:]}"
    assert not os.path.exists(os.path.join(WORK, "before_training_slow", "metrics.jsonl")), "it trained"


case.exit()
