#!/usr/bin/python3
"""Multi-host jobs on a real Slurm: four nodes that look like four machines (tests/slurm/testcluster.sh:
one network namespace, address, hostname and /etc/hosts per node; jobs submitted from a separate login
namespace), megascale launched inside allocations with sbatch and salloc.

  sbatch_2x4            2.2.2 on 2 nodes x 4 tasks through scripts/slurm/train-cpu.sbatch: exactly the losses
                        of the same job launched locally; rank logs name their node
  salloc_4x2            1.2.4 on 4 nodes x 2 tasks: exactly the local losses
  dp_auto               parallel.dp: auto takes dp from the allocation
  awkward_names         a job name and run directory with spaces, quotes and $(...)
  killed_rank           SIGKILL of one rank's process: the job fails within seconds naming rank and node;
                        no megascale process, redis-server or job step remains
  driver_killed         SIGKILL of the driver while its allocation lives on: its srun dies with it and Slurm ends
                        the step within seconds; no rank, redis-server or job step remains
  scancel               scancel of a job of scripts/slurm/train-cpu.sbatch: a complete checkpoint,
                        `megascale resume` continues it bit-exactly, nothing left running
  usr1_warning_then_step_cancel  the time-limit warning (B:USR1) saves and training goes on;
                        `scancel --signal=TERM <step>` saves and ends the job with 75; a plain step scancel
                        (Slurm's SIGKILL) is reported as such
  restart_as_new_step   a crashed rank: the job restarts as a new step from its checkpoint and ends with
                        the undisturbed loss
  nan_then_lost_rank    a NaN (rolled back), then a rank of the new step stopped (lost heartbeat): both
                        recovered as new job steps, the undisturbed loss
  store_lost            the embedded redis-server killed mid-run: restarted in place, the undisturbed loss
  bad_host_excluded     the same fault twice on a node, with a spare node: the next step excludes it
  self_check_excludes   `megascale self-check` flags the node of a rank with a slowed GEMM; with
                        fault.self_check: true the training step runs without that node
  misfit                layouts that do not fit the allocation fail before anything launches

If Slurm cannot start here the test fails, unless MEGASCALE_SKIP_SLURM=1 asks to skip it (exit 77,
with the reason printed). MS_TEST_CASES=a,b runs only those cases.

--quick (the sanitizer build) leaves out scancel, nan_then_lost_rank, store_lost and driver_killed (Slurm's and the
kernel's behaviour, nothing a sanitizer checks); what the first three add to the other cases is recovery logic of the driver and the ranks (a checkpoint on SIGTERM and its resume; NaN
rollback; a lost heartbeat; the store restarted) that the sanitizer build runs in the local tests
(tests/runner: fault_test.py, reliability_test.py, resume_test.py); the Slurm launch, a restart as a new job
step, exclusion of a node and the step signals stay in (there the test took 153 s, 72-84 s with --quick).

Usage: slurm_test.py MEGASCALE_BINARY SOURCE_DIR WORK_DIR [--quick]
"""
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import harness  # noqa: E402

BIN, SRC, WORK = (os.path.abspath(a) for a in sys.argv[1:4])
CLUSTER = os.path.join(SRC, "tests", "slurm", "testcluster.sh")
# The cluster's state directory: short (its Unix socket paths must fit in 108 bytes) and free of spaces.
STATE = tempfile.mkdtemp(prefix="ms-slurm-", dir="/tmp")
QUICK = "--quick" in sys.argv[4:]
QUICK_SKIPS = {"scancel", "nan_then_lost_rank", "store_lost", "driver_killed"}
# SIGTERM (a CI runner stopping the run, `kill`) unwinds like Ctrl-C, through the teardown in the finally below.
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
SLURM_ENV = dict(os.environ, SLURM_CONF=os.path.join(STATE, "slurm.conf"))


def login(*args, timeout=180, env=None):
    """Runs a command on the login host; returns (exit status, stdout + stderr)."""
    p = subprocess.run(["bash", CLUSTER, "login", STATE, "--", *args], capture_output=True, text=True,
                       timeout=timeout, env=env)
    return p.returncode, p.stdout + p.stderr


def login_background(*args, env=None):
    """Starts a command on the login host without waiting; its stdout + stderr in one pipe."""
    return subprocess.Popen(["bash", CLUSTER, "login", STATE, "--", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def wait_for(p, ready, timeout=120):
    """Polls ready() until it holds (files it reads may be missing or half-written meanwhile)."""
    deadline = time.time() + timeout
    while time.time() < deadline and p.poll() is None:
        try:
            if ready():
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)


def squeue(*args):
    return subprocess.run(["squeue", "-h", *args], capture_output=True, text=True, env=SLURM_ENV).stdout.strip()


def job_processes():
    """{pid: name} of this test's jobs' processes (drivers, workers, redis-servers, sruns): those whose
    environment names this test's cluster (every process a job of it starts inherits SLURM_CONF). Other
    tests' megascale processes, running at the same time, are never touched."""
    mark = f"SLURM_CONF={SLURM_ENV['SLURM_CONF']}".encode()
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            name = open(f"/proc/{pid}/comm").read().strip()
            if name in ("megascale", "redis-server", "srun") and mark in open(f"/proc/{pid}/environ", "rb").read():
                found[int(pid)] = name
        except OSError:
            pass
    return found


def stray():
    """What of a job is still around: job steps, and its processes."""
    found = []
    if squeue("--steps"):
        found.append("job steps: " + squeue("--steps", "-o", "%i").replace("\n", " "))
    procs = job_processes()
    if procs:
        found.append(f"processes: {procs}")
    return found


def cleanup():
    ids = squeue("-o", "%i").split()
    if ids:
        subprocess.run(["scancel", *ids], env=SLURM_ENV)
    for pid in job_processes():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    time.sleep(1)


def after_case(name):
    """A case leaves nothing behind for the next: what it did leave is named, then cancelled and killed."""
    leftovers = stray()
    if leftovers:
        print(f"     (cleaning up after {name}: {leftovers})", flush=True)
        cleanup()


case = harness.Cases(skip=QUICK_SKIPS if QUICK else (), skip_reason="--quick", after=after_case)


def spec(name, run_dir, extra="", steps=6, layout="tp: 2, pp: 2, dp: 2"):
    path = os.path.join(WORK, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(f"""name: {json.dumps(name)}
model: {{layers: 4, hidden: 32, heads: 4, ffn_hidden: 64, seq_len: 16, vocab: 256}}
train: {{steps: {steps}, global_batch: 8, micro_batch: 1, seed: 5}}
optimizer: {{lr: 2.0e-3, warmup_steps: 1, schedule: constant}}
data: {{path: {DATA}, valid_fraction: 0.01}}
log: {{interval: 1, peak_flops: 1.0e10, run_dir: {json.dumps(run_dir)}}}
runtime: {{threads: 1}}
parallel: {{{layout}}}
{extra}""")
    return path


def jsonl(path):
    """The complete lines of a JSON-lines file the job may still be appending to (a partial last line is skipped)."""
    return [json.loads(l) for l in open(path) if l.endswith("\n")] if os.path.exists(path) else []


def losses(run_dir):
    rows = jsonl(os.path.join(run_dir, "metrics.jsonl"))
    return {r["step"]: r["loss"] for r in rows if r["phase"] == "train"}


def local_losses(spec_path, *sets):
    run_dir = os.path.join(WORK, "local-" + os.path.basename(spec_path)[:-5])
    shutil.rmtree(run_dir, ignore_errors=True)
    args = [BIN, "train", spec_path, "--no-progress", "--set", f"log.run_dir={run_dir}"]
    for s in sets:
        args += ["--set", s]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, f"local run: {r.stderr[-1000:]}"
    return losses(run_dir)


def sbatch(script_text, name):
    script = os.path.join(WORK, f"{name}.sbatch")
    open(script, "w").write(script_text)
    rc, out = login("sbatch", "--parsable", script)
    assert rc == 0, f"sbatch: {out}"
    return out.strip().split(";")[0]


def example_sbatch(spec_path, name):
    """Submits scripts/slurm/train-cpu.sbatch (the documented example) as 2 nodes x 4 tasks."""
    rc, out = login("sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=4", "--cpus-per-task=1",
                    f"--output={WORK}/{name}.out", f"--export=ALL,MEGASCALE={BIN}",
                    os.path.join(SRC, "scripts", "slurm", "train-cpu.sbatch"), spec_path)
    assert rc == 0, f"sbatch: {out}"
    return out.strip().split(";")[0]


def wait_steps(run_dir, n, timeout=60):
    """Waits until the run has logged n training steps."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and len(losses(run_dir)) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"{run_dir}: fewer than {n} steps after {timeout} s")


def wait_job(job, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if job not in squeue("-o", "%i").split():
            return
        time.sleep(0.2)
    raise AssertionError(f"job {job} still in the queue after {timeout} s")


def workers():
    """{pid: (rank, node)} of this test's running megascale workers (every node's processes are visible here)."""
    out = {}
    for pid, name in job_processes().items():
        try:
            env = dict(e.split("=", 1) for e in open(f"/proc/{pid}/environ").read().split("\0") if "=" in e)
        except OSError:
            continue
        if name == "megascale" and "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
            out[pid] = (int(env["SLURM_PROCID"]), env.get("SLURMD_NODENAME", "?"))
    return out


harness.fresh_dir(WORK)
# The data first: nothing between the cluster's start and the try below may fail (a prepare-data that died here once
# left the cluster's daemons and namespaces behind: the teardown is in that try's finally).
DATA = harness.prepare_data(BIN, os.path.join(WORK, "data"), harness.fortunes(3))
subprocess.run(["bash", CLUSTER, "down", STATE], capture_output=True)
up = subprocess.run(["bash", CLUSTER, "up", STATE, "--nodes", "4", "--cpus", "8"], capture_output=True, text=True)
if up.returncode != 0:
    reason = (up.stdout + up.stderr).strip()[-2000:]
    subprocess.run(["bash", CLUSTER, "down", STATE], capture_output=True)
    if os.environ.get("MEGASCALE_SKIP_SLURM") == "1":
        print(f"SKIPPED: the test Slurm cluster could not start here (MEGASCALE_SKIP_SLURM=1): {reason}")
        sys.exit(77)
    print(f"FAIL: the test Slurm cluster could not start: {reason}\n(set MEGASCALE_SKIP_SLURM=1 to skip, loudly)")
    sys.exit(1)
print(up.stdout.strip(), flush=True)

try:
    @case
    def sbatch_2x4():
        run_dir = os.path.join(WORK, "sbatch-2x4")
        s = spec("sbatch 2x4", run_dir)
        job = example_sbatch(s, "sbatch-2x4")
        wait_job(job)
        out = open(os.path.join(WORK, "sbatch-2x4.out")).read()
        got = losses(run_dir)
        assert len(got) == 6, f"{len(got)} steps; output: {out[-1500:]}"
        assert got == local_losses(s), f"Slurm {got} vs local {local_losses(s)}"
        hosts = {re.search(r"on host (\S+) \(node (\d+)", open(f).read()).groups()
                 for f in glob.glob(os.path.join(run_dir, "logs", "rank-*.log"))}
        assert hosts == {("node0", "0"), ("node1", "1")}, f"rank log headers name {hosts}"
        assert "launching 8 ranks as a Slurm job step" in out and "127.0.0.1" not in out, out[-1500:]

    @case
    def salloc_4x2():
        run_dir = os.path.join(WORK, "salloc-4x2")
        s = spec("salloc 4x2", run_dir, layout="tp: 1, pp: 2, dp: 4")
        rc, out = login("salloc", "--nodes=4", "--ntasks-per-node=2", BIN, "train", s, "--no-progress")
        assert rc == 0, out[-1500:]
        got = losses(run_dir)
        assert got == local_losses(s), f"Slurm {got} vs local {local_losses(s)}"
        nodes = {re.search(r"on host (\S+)", open(f).read()).group(1)
                 for f in glob.glob(os.path.join(run_dir, "logs", "rank-*.log"))}
        assert nodes == {"node0", "node1", "node2", "node3"}, nodes

    @case
    def dp_auto():
        run_dir = os.path.join(WORK, "dp-auto")
        s = spec("dp auto", run_dir, layout="tp: 2, pp: 1, dp: auto")
        rc, out = login("salloc", "--nodes=2", "--ntasks-per-node=4", BIN, "train", s, "--no-progress")
        assert rc == 0 and "launching 8 ranks" in out, out[-1500:]
        assert "dp: 4" in open(os.path.join(run_dir, "job.yaml")).read()

    @case
    def awkward_names():
        run_dir = os.path.join(WORK, "run dir 'single' \"double\" $(touch pwned) `x`")
        s = spec("it's a \"job\" $(touch pwned)", run_dir, layout="tp: 1, pp: 2, dp: 2", steps=3)
        rc, out = login("salloc", "--nodes=2", "--ntasks-per-node=2", BIN, "train", s, "--no-progress")
        assert rc == 0, out[-1500:]
        assert len(losses(run_dir)) == 3
        assert not glob.glob(os.path.join(WORK, "**", "pwned"), recursive=True) and not os.path.exists("pwned")

    @case
    def killed_rank():
        run_dir = os.path.join(WORK, "killed")
        s = spec("killed", run_dir, steps=100000, extra="fault: {max_restarts: 0}\n")  # recovery: below
        job = sbatch(f"""#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=4 --output={WORK}/killed.out
exec {BIN} train {shlex.quote(s)} --no-progress
""", "killed")
        wait_steps(run_dir, 2)
        victims = {pid: rn for pid, rn in workers().items() if rn[1] == "node1"}
        assert victims, f"no worker on node1: {workers()}"
        pid, (rank, node) = sorted(victims.items())[0]
        t0 = time.time()
        os.kill(pid, signal.SIGKILL)
        wait_job(job, timeout=60)
        took = time.time() - t0
        out = open(os.path.join(WORK, "killed.out")).read()
        last = [l for l in out.splitlines() if l.startswith("error: ")][-1:]
        assert last and f"rank {rank} on {node} failed (signal 9" in last[0], f"last error: {last}; {out[-1500:]}"
        assert took < 20, f"the job took {took:.1f} s to end"
        assert not stray(), stray()

    @case
    def driver_killed():
        # The driver SIGKILLed (the OOM killer, a node agent) while its allocation lives on: its srun dies with it
        # (PR_SET_PDEATHSIG), Slurm ends the step's tasks, and nothing of the job step remains; the batch script
        # goes on (here it sleeps) and sees the driver's 137.
        run_dir = os.path.join(WORK, "driver-killed")
        s = spec("driver killed", run_dir, steps=100000, extra="fault: {max_restarts: 0}\n")
        job = sbatch(f"""#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=4 --output={WORK}/driver-killed.out
{BIN} train {shlex.quote(s)} --no-progress
echo "driver exit $?"
sleep 60
""", "driver-killed")
        wait_steps(run_dir, 2)
        drivers = [pid for pid, name in job_processes().items()
                   if name == "megascale" and b"\0train\0" in open(f"/proc/{pid}/cmdline", "rb").read()]
        assert len(drivers) == 1 and len(workers()) == 8, f"drivers {drivers}, workers {workers()}"
        def ranks_step():  # the job's steps but its batch script's
            return [i for i in squeue("--steps", "-o", "%i").split() if not i.endswith(".batch")]
        t0 = time.time()
        os.kill(drivers[0], signal.SIGKILL)
        while (workers() or ranks_step()) and time.time() - t0 < 30:
            time.sleep(0.2)
        took = time.time() - t0
        left = [workers(), ranks_step()]
        out = open(os.path.join(WORK, "driver-killed.out")).read()
        still_queued = job in squeue("-o", "%i").split()
        subprocess.run(["scancel", job], env=SLURM_ENV, check=True)
        wait_job(job, timeout=60)
        assert not left[0] and not left[1], f"{took:.1f} s after the driver's SIGKILL: workers {left[0]}, steps {left[1]}"
        assert took < 15, f"the job step took {took:.1f} s to end"
        assert still_queued and "driver exit 137" in out, f"queued {still_queued}; {out[-1000:]}"
        print(f"     driver_killed: the step's 8 ranks gone {took:.1f} s after the driver's SIGKILL", flush=True)
        assert not stray(), stray()

    @case
    def scancel():
        run_dir = os.path.join(WORK, "scancel")
        s = spec("scancel", run_dir, steps=100000)
        job = example_sbatch(s, "scancel")
        wait_steps(run_dir, 3)
        subprocess.run(["scancel", job], env=SLURM_ENV, check=True)
        wait_job(job, timeout=60)
        out = open(os.path.join(WORK, "scancel.out")).read()
        manifests = glob.glob(os.path.join(run_dir, "checkpoints", "step-*", "manifest.json"))
        assert len(manifests) == 1, f"checkpoints: {manifests}; {out[-1500:]}"
        step = int(os.path.basename(os.path.dirname(manifests[0]))[5:])
        assert not stray(), stray()
        # Resume on the cluster, then compare with one uninterrupted local run (constant learning rate: the
        # schedule does not depend on train.steps).
        rc, out = login("salloc", "--nodes=2", "--ntasks-per-node=4", BIN, "resume", s, "--no-progress", "--set",
                        f"train.steps={step + 3}")
        assert rc == 0, out[-1500:]
        got = losses(run_dir)
        ref = local_losses(s, f"train.steps={step + 3}")
        assert all(got[k] == ref[k] for k in range(1, step + 4)), \
            f"steps {step + 1}..{step + 3}: resumed {[got[k] for k in range(step + 1, step + 4)]} vs " \
            f"{[ref[k] for k in range(step + 1, step + 4)]}"
        assert not stray(), stray()

    @case
    def usr1_warning_then_step_cancel():
        # The time-limit warning reaches the batch shell only (--signal=B:USR1@N; here sent by hand the
        # same way): the example script passes it on and every rank saves, training goes on. Then
        # `scancel <job>.<step>`: the ranks save and exit 75, and so does the job.
        run_dir = os.path.join(WORK, "usr1")
        s = spec("usr1", run_dir, steps=100000)
        job = example_sbatch(s, "usr1")
        wait_steps(run_dir, 3)
        subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=SLURM_ENV, check=True)
        ckpt = os.path.join(run_dir, "checkpoints", "step-*", "manifest.json")
        deadline = time.time() + 30
        while time.time() < deadline and not glob.glob(ckpt):
            time.sleep(0.1)
        assert len(glob.glob(ckpt)) == 1, "no checkpoint after the warning"
        assert job in squeue("-o", "%i").split(), "the job did not go on after the warning"
        step = [i for i in squeue("--steps", "-o", "%i").split() if i.startswith(job + ".") and "batch" not in i]
        assert len(step) == 1, f"steps: {squeue('--steps', '-o', '%i')}"
        subprocess.run(["scancel", "--signal=TERM", step[0]], env=SLURM_ENV, check=True)
        wait_job(job, timeout=60)
        out = open(os.path.join(WORK, "usr1.out")).read()
        assert len(glob.glob(ckpt)) == 2, f"checkpoints {glob.glob(ckpt)}; {out[-1500:]}"
        assert "SIGTERM: stopped after step" in out and not re.search(r"^error: ", out, re.M), out[-1500:]
        assert not stray(), stray()
        # A plain `scancel <job>.<step>` is Slurm's SIGKILL of the step's tasks: nothing can be saved,
        # and the job says so (not "rank N failed").
        s = spec("killed step", os.path.join(WORK, "killed-step"), steps=100000)
        job = example_sbatch(s, "killed-step")
        deadline = time.time() + 60
        while time.time() < deadline and len(squeue("--steps", "-o", "%i").split()) < 2:
            time.sleep(0.1)
        time.sleep(1)
        step = [i for i in squeue("--steps", "-o", "%i").split() if i.startswith(job + ".") and "batch" not in i]
        subprocess.run(["scancel", step[0]], env=SLURM_ENV, check=True)
        wait_job(job, timeout=60)
        out = open(os.path.join(WORK, "killed-step.out")).read()
        last = [l for l in out.splitlines() if l.startswith("error: ")][-1:]
        assert last and "the job step was cancelled from outside" in last[0], f"{last}; {out[-1000:]}"
        assert not stray(), stray()

    @case
    def restart_as_new_step():
        # A rank crashing on node1: the driver restarts the job as a new job step from the newest
        # checkpoint, and it ends with exactly the loss of the undisturbed run.
        run_dir = os.path.join(WORK, "restart")
        fault = "checkpoint: {interval: 5}\nfault: {heartbeat_s: 0.25, restart_backoff_s: 0.1}\n"
        s = spec("restart", run_dir, steps=30, layout="tp: 2, pp: 1, dp: 2", extra=fault)
        env = dict(os.environ, MEGASCALE_FAULT="crash:rank=3:step=12")
        rc, out = login("salloc", "--nodes=2", "--ntasks-per-node=2", BIN, "train", s, "--no-progress", env=env)
        assert rc == 0, out[-1500:]
        events = [json.loads(l) for l in open(os.path.join(run_dir, "events.jsonl"))]
        faults = [e for e in events if e["event"] == "fault"]
        assert [(f["kind"], f["rank"], f["host"]) for f in faults] == [("crash", 3, "node1")], events
        assert [e["attempt"] for e in events if e["event"] == "attempt"] == [0, 1]
        assert any(e["event"] == "recovered" for e in events), events
        assert losses(run_dir)[30] == local_losses(s)[30]
        assert not stray(), stray()

    @case
    def nan_then_lost_rank():
        # Under Slurm too: a NaN in one rank's gradient (rolled back), then a rank of the restarted
        # step stopped with SIGSTOP (its heartbeat lost): both found, both recovered as new steps, and
        # the run ends with exactly the undisturbed loss.
        run_dir = os.path.join(WORK, "nan-stop")
        fault = ("checkpoint: {interval: 5}\n"
                 "fault: {heartbeat_s: 0.25, heartbeat_timeout_s: 2, restart_backoff_s: 0.1}\n")
        s = spec("nan stop", run_dir, steps=30, layout="tp: 2, pp: 1, dp: 2", extra=fault)
        env = dict(os.environ, MEGASCALE_FAULT="nan:rank=2:step=8")
        p = login_background("salloc", "--nodes=2", "--ntasks-per-node=2", BIN, "train", s, "--no-progress", env=env)

        def second_attempt_past_step_16():
            attempts = jsonl(os.path.join(run_dir, "events.jsonl"))
            return sum(e["event"] == "attempt" for e in attempts) == 2 and max(losses(run_dir), default=0) >= 16

        wait_for(p, second_attempt_past_step_16)
        victim = None
        for pid, name in job_processes().items():
            try:
                environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                if name == "megascale" and b"SLURM_PROCID=1" in environ and b"SLURM_STEP_ID=1" in environ:
                    victim = pid
            except OSError:
                pass
        assert victim, f"no rank 1 of the second step found: {job_processes()}"
        os.kill(victim, signal.SIGSTOP)
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out[-1500:]
        events = [json.loads(l) for l in open(os.path.join(run_dir, "events.jsonl"))]
        faults = [f for f in events if f["event"] == "fault"]
        assert [f["kind"] for f in faults] == ["nan", "lost_heartbeat"] and faults[1]["rank"] == 1, events
        assert sum(e["event"] == "recovered" for e in events) == 2, events
        assert losses(run_dir)[30] == local_losses(s)[30]
        assert not stray(), stray()

    @case
    def store_lost():
        # The embedded redis-server (on the driver's host) killed mid-run under Slurm: restarted on its
        # port, the ranks reconnect, and the run ends with exactly the undisturbed loss.
        run_dir = os.path.join(WORK, "store-lost")
        fault = "checkpoint: {interval: 5}\nfault: {heartbeat_s: 0.25}\n"
        s = spec("store lost", run_dir, steps=30, layout="tp: 2, pp: 1, dp: 2", extra=fault)
        p = login_background("salloc", "--nodes=2", "--ntasks-per-node=2", BIN, "train", s, "--no-progress")
        wait_for(p, lambda: max(losses(run_dir), default=0) >= 8)
        # The store's pid file, in the run directory (redis-server does not inherit the job's environment).
        pid_files = glob.glob(os.path.join(run_dir, "megascale-redis-*", "redis.pid"))
        assert len(pid_files) == 1, f"pid files: {pid_files}"
        os.kill(int(open(pid_files[0]).read()), signal.SIGKILL)
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out[-1500:]
        events = [json.loads(l) for l in open(os.path.join(run_dir, "events.jsonl"))]
        lost = [e for e in events if e["event"] == "store_lost"]
        assert len(lost) == 1 and lost[0]["recovered"] == 1, events
        assert losses(run_dir)[30] == local_losses(s)[30]
        assert not stray(), stray()

    @case
    def bad_host_excluded():
        # The same fault twice on node0, with a spare node in the allocation (3 nodes for a job of 2):
        # the third attempt runs without node0 and finishes with the undisturbed loss.
        run_dir = os.path.join(WORK, "bad-host")
        fault = "checkpoint: {interval: 5}\nfault: {heartbeat_s: 0.25, restart_backoff_s: 0.1}\n"
        s = spec("bad host", run_dir, steps=30, layout="tp: 2, pp: 1, dp: 2", extra=fault)
        env = dict(os.environ, MEGASCALE_FAULT="crash:rank=1:step=12;crash:rank=1:step=17:attempt=1")
        rc, out = login("salloc", "--nodes=3", "--ntasks-per-node=2", BIN, "train", s, "--no-progress", env=env)
        assert rc == 0, out[-1500:]
        events = [json.loads(l) for l in open(os.path.join(run_dir, "events.jsonl"))]
        actions = [(f["host"], f["action"]) for f in events if f["event"] == "fault"]
        assert actions == [("node0", "restart"), ("node0", "restart without host node0")], events
        assert "excluding node0" in out, out[-1500:]
        hosts = {re.findall(r"on host (\S+)", open(f).read())[-1]  # each attempt appends to the rank's log
                 for f in glob.glob(os.path.join(run_dir, "logs", "rank-*.log"))}
        assert hosts == {"node1", "node2"}, f"last attempt's ranks ran on {hosts}"
        assert losses(run_dir)[30] == local_losses(s)[30]
        assert not stray(), stray()

    @case
    def self_check_excludes():
        # `megascale self-check` in an allocation of 3 nodes for a job of 2 flags the node of the rank
        # whose GEMM is slowed 16x; with fault.self_check: true the training step then runs without it.
        # (Tolerance 1.0: only what is 2x worse than the median is flagged; tests run side by side. With 2
        # ranks the median is their mean, and 4x was not enough on 2 cores: the slowed rank's burn and a
        # concurrent test slowed rank 0's best GEMM to 35 GFLOP/s against 21.5, once in CI.)
        run_dir = os.path.join(WORK, "self-check")
        s = spec("self check", run_dir, steps=4, layout="tp: 1, pp: 1, dp: 2",
                 extra="fault: {self_check: true, self_check_tolerance: 1.0}\n")
        env = dict(os.environ, MEGASCALE_FAULT="slow_gemm:rank=1:factor=16")
        rc, out = login("salloc", "--nodes=3", "--ntasks-per-node=1", BIN, "self-check", s, env=env)
        assert rc == 1 and "rank 1 on node1: GEMM" in out and "libfabric point-to-point (tcp" in out, out[-2000:]
        rc, out = login("salloc", "--nodes=3", "--ntasks-per-node=1", BIN, "train", s, "--no-progress", env=env)
        assert rc == 0 and "excluding node1" in out, out[-2000:]
        events = [json.loads(l) for l in open(os.path.join(run_dir, "events.jsonl"))]
        checks = [(e["passed"], e["bad_hosts"]) for e in events if e["event"] == "self_check"]
        assert checks == [(0, "node1")], events
        hosts = {re.findall(r"on host (\S+)", open(f).read())[-1]
                 for f in glob.glob(os.path.join(run_dir, "logs", "rank-*.log"))}
        assert hosts == {"node0", "node2"}, f"the ranks ran on {hosts}"
        assert not stray(), stray()

    @case
    def misfit():
        s = spec("misfit", os.path.join(WORK, "misfit"))
        rc, out = login("salloc", "--nodes=2", "--ntasks-per-node=2", BIN, "train", s, "--no-progress")
        assert rc != 0 and "2*2*2 = 8 ranks" in out and "4 tasks on 2 nodes" in out and "--nodes=4" in out, out
        rc, out = login("salloc", "--nodes=4", "--ntasks-per-node=2", BIN, "train", s, "--no-progress", "--set",
                        "parallel.tp=4", "--set", "parallel.dp=1")
        assert rc != 0 and "straddle two nodes" in out and "--ntasks-per-node=4" in out, out
        assert not os.path.exists(os.path.join(WORK, "misfit")), "something was launched"
finally:
    down = subprocess.run(["bash", CLUSTER, "down", STATE], capture_output=True, text=True)
    if down.returncode != 0:
        case.fail(f"tearing the cluster down: {down.stderr}")
    # `down` itself checks that its namespaces, links and daemons are gone; nothing may still name the state.
    left = subprocess.run(["pgrep", "-af", "slurmctld|slurmd|munged"], capture_output=True, text=True).stdout
    if STATE in left or os.path.exists(STATE):
        case.fail(f"left behind after down: {left} {os.path.exists(STATE)}")

case.exit()
