#!/usr/bin/python3
"""Reliability of the driver, signals and checkpoints, through the megascale binary: one case per
defect of issue #10, each multi-process where the defect was, each failing on the code before the fix.

  job_wide_sigterm            SIGTERM to the driver, redis-server and every rank at once (Slurm's way):
                              the checkpoint is committed, exit 75, nothing left running
  stopped_rank_then_sigterm   a rank frozen (SIGSTOP) when SIGTERM comes: the job fails naming it, not exit 0;
                              a second SIGINT during the grace stops everything at once; the grace scales
  grace_expired_names_the_ranks  every rank frozen at SIGTERM: the grace runs out, the job fails naming the
                              ranks it killed and a log
  failed_checkpoints          every checkpoint failing: recorded as failed in metrics.jsonl, shown on the
                              console, and the job stops after checkpoint.max_failures
  slow_scan_and_restore       the driver's checkpoint scan and the restore read outlast the collective timeout
  unusable_checkpoints        resume: auto with checkpoints none of which is usable: an error naming each,
                              history intact; --start-over trains from step 1 and keeps everything
  run_dir_lock                a second job on the same run directory fails at once naming the holder
  signals_during_startup      SIGUSR1 and SIGTERM while the ranks start up are honoured after the first step
  resharded_restore_memory    tp4 from a tp1.dp2 checkpoint needs about the memory of a fresh start
  usr1_and_term_together      one rank's SIGUSR1 never hides another's SIGTERM
  redis_password_never_on_disk  a password in runtime.redis is refused; a 0600 password file works and the
                              password appears in no file and no output
  redis_death_noticed         the embedded redis-server killed mid-run: noticed, restarted, checkpoints go on
  spec_errors_before_launch   names with spaces, runtime.redis host:port, vocab/dataset mismatch caught by validate

Usage: reliability_test.py MEGASCALE_BINARY WORK_DIR    (MS_TEST_CASES=a,b runs only those cases)
"""
import concurrent.futures
import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import harness  # noqa: E402

BIN, WORK = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
results = []


ONLY = [c for c in os.environ.get("MS_TEST_CASES", "").split(",") if c]  # run only these (for debugging)


cases = []  # (name, function), in the order defined; run side by side at the end (run_cases)


def case(fn):
    if not ONLY or fn.__name__ in ONLY:
        cases.append((fn.__name__, fn))
    return fn


def run_case(name, fn):
    """Runs one case: (passed, the line to print)."""
    t0 = time.time()
    try:
        fn()
        return True, f"ok   {name} ({time.time() - t0:.1f} s)"
    except (AssertionError, subprocess.TimeoutExpired, OSError, ValueError) as e:
        return False, f"FAIL {name}: {type(e).__name__}: {e}"


def run_cases(workers=4):
    """The cases spend most of their time waiting (a collective timeout, a stop grace, an injected delay: 0.2 to
    13 s each, ~0.5 s of CPU), and each has its own run directory, spec and processes: `workers` of them run side
    by side (37 s -> ~14 s on 2 cores), reported in the order defined."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(run_case, name, fn) for name, fn in cases]
        for future in futures:
            ok, line = future.result()
            results.append(ok)
            print(line, flush=True)


def write_spec(name, extra="", model="layers: 2, hidden: 32, heads: 4, seq_len: 16, vocab: 256", steps=100000,
               runtime="threads: 1"):
    path = os.path.join(WORK, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(f"""name: {name}
model: {{{model}}}
train: {{steps: {steps}, global_batch: 4, seed: 3}}
optimizer: {{lr: 1.0e-3, warmup_steps: 1}}
data: {{path: {DATA}, valid_fraction: 0.01}}
log: {{interval: 1000, peak_flops: 1.0e10, run_dir: {os.path.join(WORK, name)}}}
runtime: {{{runtime}}}
parallel: {{dp: 2}}
{extra}""")
    return path


def run(*args, env=None, timeout=300):
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=timeout, env=env)


def start(*args, env=None):
    return subprocess.Popen([BIN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)


def children(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def comm(pid):
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return ""


def alive(pid):
    try:
        os.kill(pid, 0)
        return comm(pid) not in ("",)  # a zombie still has /proc/PID/comm; good enough for our children
    except ProcessLookupError:
        return False


def ranks_and_redis(driver):
    kids = children(driver)
    return [k for k in kids if comm(k) != "redis-server"], [k for k in kids if comm(k) == "redis-server"]


def training(name, **spec_args):
    """Starts `megascale train` on write_spec(name, **spec_args) and waits for its second step: (driver, run dir,
    rank pids, redis-server pids)."""
    spec = write_spec(name, **spec_args)
    run_dir = os.path.join(WORK, name)
    p = start("train", spec, "--no-progress")
    assert wait_steps(run_dir, 2, p), f"{name}: the job did not train"
    ranks, redis = ranks_and_redis(p.pid)
    return p, run_dir, ranks, redis


def train_rows(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    for line in open(path):
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def wait_steps(run_dir, n, p, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline and p.poll() is None:
        if sum(1 for r in train_rows(run_dir) if r["phase"] == "train") >= n:
            return True
        time.sleep(0.05)
    return False


def finish(p, timeout=120):
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"job did not end within {timeout} s; stderr: {err[-1500:]}")
    return p.returncode, out, err


def manifests(run_dir):
    return sorted(glob.glob(os.path.join(run_dir, "checkpoints", "step-*", "manifest.json")))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


harness.fresh_dir(WORK)
DATA = harness.prepare_data(BIN, os.path.join(WORK, "data"), harness.fortunes(3))


@case
def job_wide_sigterm():
    # Defect 1: kill -TERM <driver> <redis-server> <rank0> <rank1>, as Slurm does at a time limit.
    p, run_dir, ranks, redis = training("sigterm all",
                                        model="layers: 4, hidden: 256, heads: 4, seq_len: 32, vocab: 256")
    assert len(ranks) == 2 and len(redis) == 1, f"children: ranks {ranks}, redis {redis}"
    for pid in [p.pid, *redis, *ranks]:
        os.kill(pid, signal.SIGTERM)
    rc, _, err = finish(p)
    assert rc == 75, f"exit {rc}, expected 75 (saved); stderr: {err[-1500:]}"
    assert len(manifests(run_dir)) == 1, f"checkpoints committed: {manifests(run_dir)}; stderr: {err[-800:]}"
    assert "committed" in err
    time.sleep(0.2)
    assert not any(alive(x) for x in [*ranks, *redis]), "a rank or redis-server is still running"


@case
def stopped_rank_then_sigterm():
    # Defect 2: kill -STOP <rank0>; kill -TERM <driver>: rank 1 times out, rank 0 is killed, no checkpoint:
    # the job must fail (it exited 0).
    runtime = "threads: 1, collective_timeout_s: 2, stop_grace_s: 20"
    p, run_dir, ranks, redis = training("frozen", runtime=runtime)
    os.kill(ranks[0], signal.SIGSTOP)
    p.send_signal(signal.SIGTERM)
    rc, _, err = finish(p, timeout=90)
    last = err.strip().splitlines()[-1]
    assert rc == 1, f"exit {rc} although rank 0 never saved; stderr: {err[-1500:]}"
    assert not manifests(run_dir), "a checkpoint was committed by a job whose rank 0 was frozen"
    # Usually rank 1 times out in a collective with the frozen rank 0 and is named. Where rank 0 froze just after its
    # part of a step's last collective had left, rank 1 finishes that step, sees the stop and waits for rank 0's
    # checkpoint file until the grace runs out (seen on a loaded machine): then the frozen rank is named.
    log = re.search(r"log: (\S+)", last)
    named = last.startswith("error: rank ") or re.search(r"ranks? 0(, 1)? did not exit within the grace", last)
    assert named and log and os.path.exists(log.group(1)), f"last line: {last}"
    assert not any(alive(x) for x in [*ranks, *redis]), "a rank or redis-server is still running"
    # A second SIGINT during the grace is not swallowed: the job ends at once.
    p, run_dir, ranks, redis = training("frozen2", runtime=runtime)
    os.kill(ranks[0], signal.SIGSTOP)
    p.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    t0 = time.time()
    p.send_signal(signal.SIGINT)
    rc, _, err = finish(p, timeout=60)
    assert time.time() - t0 < 5, f"the second signal took {time.time() - t0:.1f} s to end the job"
    assert rc == 1 and "second stop signal" in err, f"exit {rc}; stderr: {err[-1000:]}"
    assert not any(alive(x) for x in [*ranks, *redis]), "a rank or redis-server is still running"


@case
def grace_expired_names_the_ranks():
    # Every rank frozen when SIGTERM comes: none can save or exit, so runtime.stop_grace_s runs out; the job fails
    # naming the ranks it killed and a log to read, commits nothing and leaves nothing running.
    p, run_dir, ranks, redis = training("graceless",
                                        runtime="threads: 1, collective_timeout_s: 60, stop_grace_s: 2")
    for r in ranks:
        os.kill(r, signal.SIGSTOP)
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    rc, _, err = finish(p, timeout=60)
    last = err.strip().splitlines()[-1]
    assert rc == 1 and time.time() - t0 < 30, f"exit {rc} after {time.time() - t0:.1f} s; stderr: {err[-1500:]}"
    log = re.search(r"rank 0's log: (\S+)", last)
    assert ("Terminated: ranks 0, 1 did not exit within the grace of 2 s (runtime.stop_grace_s) and were killed"
            in last and log and os.path.exists(log.group(1))), f"last line: {last}"
    assert not manifests(run_dir), "a checkpoint was committed by frozen ranks"
    assert not any(alive(x) for x in [*ranks, *redis]), "a rank or redis-server is still running"


@case
def failed_checkpoints():
    # Defect 3: every checkpoint fails (here: a file where its step directory must go). Each failure is
    # recorded as failed and shown; after checkpoint.max_failures in a row the job stops.
    spec = write_spec("ckfail", "checkpoint: {interval: 2, max_failures: 3}\n", steps=200)
    run_dir = os.path.join(WORK, "ckfail")
    p = start("train", spec, "--no-progress")
    ckdir = os.path.join(run_dir, "checkpoints")
    assert wait_steps(run_dir, 1, p)
    for step in range(1, 201):  # every future step directory is blocked by a file
        try:
            open(os.path.join(ckdir, f"step-{step:08d}"), "x").close()
        except (FileExistsError, IsADirectoryError):
            pass  # written already
    rc, _, err = finish(p)
    rows = train_rows(run_dir)
    failed = [r for r in rows if r["phase"] == "checkpoint" and r.get("status") == "failed"]
    steps = max((r["step"] for r in rows if r["phase"] == "train"), default=0)
    assert rc == 1, f"exit {rc}; stderr: {err[-1200:]}"
    assert len(failed) >= 3 and all(r.get("error") for r in failed), f"failed rows: {failed}"
    assert steps < 200, f"trained all {steps} steps without a checkpoint"
    assert "FAILED" in err and "checkpoints in a row failed" in err, err[-1500:]


@case
def slow_scan_and_restore():
    # Defect 4: the driver's verification of the checkpoints (4 s) and data-parallel rank 0's restore
    # read (4 s) both outlast the collective timeout (1.5 s): no rank may time out waiting for them.
    spec = write_spec("slow", "checkpoint: {interval: 3}\n", steps=3)
    run_dir = os.path.join(WORK, "slow")
    r = run("train", spec, "--no-progress")
    assert r.returncode == 0 and manifests(run_dir), r.stderr[-1200:]
    env = dict(os.environ, MEGASCALE_FAULT="delay:at=resume_scan:s=4;delay:at=restore_read:rank=0:s=4")
    r = run("resume", spec, "--no-progress", "--set", "train.steps=5", "--set", "runtime.collective_timeout_s=1.5",
            env=env)
    assert r.returncode == 0, r.stderr[-1500:]
    assert "resumed from" in r.stderr and "MEGASCALE_FAULT" in r.stderr, r.stderr[-800:]


@case
def unusable_checkpoints():
    # Defect 5: the only checkpoint is damaged (a rank file truncated); resume: auto must not start over.
    spec = write_spec("unusable", "checkpoint: {interval: 3, resume: auto}\n", steps=3)
    run_dir = os.path.join(WORK, "unusable")
    r = run("train", spec, "--no-progress")
    assert r.returncode == 0, r.stderr[-800:]
    step_dir = os.path.dirname(manifests(run_dir)[0])
    rank_file = os.path.join(step_dir, "rank-00001.bin")
    os.truncate(rank_file, os.path.getsize(rank_file) // 2)
    before = open(os.path.join(run_dir, "metrics.jsonl")).read()
    r = run("train", spec, "--no-progress", "--set", "train.steps=6")
    assert r.returncode == 1, f"exit {r.returncode}: {r.stderr[-800:]}"
    assert "step-00000003" in r.stderr and "truncated" in r.stderr and "--start-over" in r.stderr, r.stderr[-800:]
    assert open(os.path.join(run_dir, "metrics.jsonl")).read() == before, "metrics.jsonl was changed"
    # Explicitly starting over: trains from step 1; the old checkpoint and metrics are kept aside.
    r = run("train", spec, "--no-progress", "--set", "train.steps=6", "--start-over")
    assert r.returncode == 0, r.stderr[-800:]
    aside = glob.glob(os.path.join(run_dir, "checkpoints", "superseded-*", "step-00000003"))
    assert len(aside) == 1, f"superseded: {aside}"
    assert open(os.path.join(run_dir, "metrics.jsonl.1")).read() == before
    assert train_rows(run_dir)[0]["step"] == 1
    # A checkpoint directory that cannot be used is an error, not "no checkpoint" (root reads any
    # directory, so make it a file where the directory must be).
    bad = write_spec("unreadable", "checkpoint: {resume: auto, dir: " + os.path.join(WORK, "not-a-dir") + "}\n",
                     steps=2)
    open(os.path.join(WORK, "not-a-dir"), "w").write("x")
    r = run("train", bad, "--no-progress")
    assert r.returncode == 1 and "not-a-dir" in r.stderr, r.stderr[-600:]


@case
def run_dir_lock():
    # Defect 6: two jobs on one run directory.
    spec = write_spec("locked")
    run_dir = os.path.join(WORK, "locked")
    p = start("train", spec, "--no-progress")
    assert wait_steps(run_dir, 1, p)
    t0 = time.time()
    r = run("train", spec, "--no-progress", "--set", "checkpoint.resume=auto")
    assert r.returncode == 1 and time.time() - t0 < 10, f"exit {r.returncode}: {r.stderr[-600:]}"
    assert "in use by another megascale job" in r.stderr and f"pid {p.pid}" in r.stderr, r.stderr[-600:]
    # A different run directory sharing the checkpoint directory is refused too.
    other = write_spec("locked-other", "checkpoint: {dir: " + os.path.join(run_dir, "checkpoints") + "}\n")
    r = run("train", other, "--no-progress")
    assert r.returncode == 1 and "checkpoint.dir" in r.stderr and "in use" in r.stderr, r.stderr[-600:]
    assert p.poll() is None, "the first job was disturbed"
    p.send_signal(signal.SIGINT)
    rc, _, _ = finish(p)
    assert rc == 130, f"SIGINT exit {rc}"


@case
def signals_during_startup():
    # Defect 7: the ranks are held 3 s in start-up (after the store and the model, before step 1);
    # SIGUSR1 to the driver and to the ranks during that time must not kill them.
    env = dict(os.environ, MEGASCALE_FAULT="delay:at=train_start:s=3")
    spec = write_spec("startup", steps=4)
    run_dir = os.path.join(WORK, "startup")
    p = start("train", spec, "--no-progress", env=env)
    deadline = time.time() + 20
    while time.time() < deadline and not os.path.exists(os.path.join(run_dir, "megascale.lock")):
        time.sleep(0.005)
    p.send_signal(signal.SIGUSR1)  # the driver forwards it to ranks that may not even have started
    deadline = time.time() + 20
    while time.time() < deadline and len(ranks_and_redis(p.pid)[0]) < 2:
        time.sleep(0.01)
    for pid in ranks_and_redis(p.pid)[0]:
        os.kill(pid, signal.SIGUSR1)
    rc, _, err = finish(p)
    assert rc == 0, f"exit {rc}; stderr: {err[-1500:]}"
    ck = [r["step"] for r in train_rows(run_dir) if r["phase"] == "checkpoint" and r.get("status") == "committed"]
    assert ck == [1], f"committed checkpoints {ck}, expected one after step 1"
    # SIGTERM during start-up: saved after the first step, exit 75.
    spec = write_spec("startup-term", steps=4)
    run_dir = os.path.join(WORK, "startup-term")
    p = start("train", spec, "--no-progress", env=env)
    deadline = time.time() + 20
    while time.time() < deadline and len(ranks_and_redis(p.pid)[0]) < 2:
        time.sleep(0.01)
    time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    rc, _, err = finish(p)
    assert rc == 75 and [os.path.basename(os.path.dirname(m)) for m in manifests(run_dir)] == ["step-00000001"], \
        f"exit {rc}, checkpoints {manifests(run_dir)}; stderr: {err[-1000:]}"


def peak_mib(run_dir):
    peaks = []
    for log in glob.glob(os.path.join(run_dir, "logs", "rank-*.log")):
        m = re.findall(r"peak resident memory of rank \d+: ([\d.]+) MiB", open(log).read())
        assert m, f"no peak memory line in {log}"
        peaks.append(float(m[-1]))
    return max(peaks)


@case
def resharded_restore_memory():
    # Defect 8: tp4 restoring a tp1.dp2 checkpoint held every reassembled (unsharded) tensor until the
    # restore ended: ~85 MB more per rank for this 7 M-parameter model. Now one tensor at a time.
    model = "layers: 4, hidden: 384, heads: 4, seq_len: 16, vocab: 256"
    spec = write_spec("reshard", "checkpoint: {interval: 1}\n", model=model, steps=1)
    # Under AddressSanitizer freed memory sits in its quarantine (256 MB) instead of being reused: turn it
    # off so that RSS measures what the code holds.
    env = dict(os.environ)
    if "ASAN_OPTIONS" in env:
        env["ASAN_OPTIONS"] += ":quarantine_size_mb=0:thread_local_quarantine_size_kb=0"
    run_dir = os.path.join(WORK, "reshard")
    r = run("train", spec, "--no-progress")
    assert r.returncode == 0, r.stderr[-800:]
    fresh_dir = os.path.join(WORK, "reshard-fresh")
    r = run("train", spec, "--no-progress", "--set", "parallel.dp=1", "--set", "parallel.tp=4",
            "--set", f"log.run_dir={fresh_dir}", "--set", "train.steps=2", env=env)
    assert r.returncode == 0, r.stderr[-800:]
    r = run("resume", spec, "--no-progress", "--set", "parallel.dp=1", "--set", "parallel.tp=4",
            "--set", "train.steps=2", env=env)
    assert r.returncode == 0, r.stderr[-800:]
    fresh, resumed = peak_mib(fresh_dir), peak_mib(run_dir)
    assert resumed < fresh + 30, f"peak RSS per rank: resumed {resumed:.0f} MiB, fresh {fresh:.0f} MiB"
    print(f"     peak RSS per rank: fresh {fresh:.0f} MiB, resharded resume {resumed:.0f} MiB")


@case
def usr1_and_term_together():
    # Defect 9: rank 0 gets SIGUSR1 and rank 1 SIGTERM in the same step; a max over a bit mask (4 > 2)
    # kept the save and lost the stop. Both ranks are frozen while the signals are sent, so that both
    # are pending in the same step.
    spec = write_spec("together")
    run_dir = os.path.join(WORK, "together")
    p = start("train", spec, "--no-progress")
    assert wait_steps(run_dir, 3, p)
    ranks, _ = ranks_and_redis(p.pid)
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    os.kill(ranks[0], signal.SIGUSR1)
    os.kill(ranks[1], signal.SIGTERM)
    for pid in ranks:
        os.kill(pid, signal.SIGCONT)
    rc, _, err = finish(p, timeout=30)
    assert rc == 75 and len(manifests(run_dir)) >= 1, f"exit {rc}; stderr: {err[-800:]}"


@case
def redis_password_never_on_disk():
    # Defect 10: a password in runtime.redis would be written to job.yaml and printed by validate.
    spec = write_spec("pw", steps=3)
    r = run("validate", spec, "--set", "runtime.redis=redis://:hunter2@127.0.0.1:6379")
    assert r.returncode == 1 and "hunter2" not in r.stdout + r.stderr and "password" in r.stderr, r.stderr
    # An external Redis with a password given in a 0600 file.
    port = free_port()
    secret = "pw-" + os.urandom(8).hex()
    rdir = os.path.join(WORK, "ext-redis")
    os.makedirs(rdir)
    redis = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                              "--appendonly", "no", "--requirepass", secret, "--dir", rdir],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pwfile = os.path.join(WORK, "redis.pw")
        open(pwfile, "w").write(secret + "\n")
        os.chmod(pwfile, 0o644)
        sets = ["--set", f"runtime.redis=127.0.0.1:{port}", "--set", f"runtime.redis_password_file={pwfile}"]
        r = run("validate", spec, *sets)
        assert r.returncode == 1 and "chmod 600" in r.stderr, r.stderr
        os.chmod(pwfile, 0o600)
        r = run("validate", spec, *sets)
        assert r.returncode == 0, r.stderr
        r = run("train", spec, "--no-progress", *sets)
        assert r.returncode == 0, r.stderr[-800:]
        assert secret not in r.stdout + r.stderr, "the password was printed"
        for root, _, files in os.walk(os.path.join(WORK, "pw")):
            for f in files:
                assert secret.encode() not in open(os.path.join(root, f), "rb").read(), f"password in {f}"
    finally:
        redis.kill()
        redis.wait()


@case
def redis_death_noticed():
    # Defect 11: the driver's waitpid(-1) reaped the embedded redis-server: its death went unnoticed.
    spec = write_spec("redisdeath", "checkpoint: {interval: 2}\n", steps=300)
    run_dir = os.path.join(WORK, "redisdeath")
    p = start("train", spec, "--no-progress")
    assert wait_steps(run_dir, 3, p)
    _, redis = ranks_and_redis(p.pid)
    os.kill(redis[0], signal.SIGKILL)
    rc, _, err = finish(p)
    assert rc == 0, f"exit {rc}; stderr: {err[-1500:]}"
    assert "redis-server (port" in err and "died" in err and "restarting" in err, err[-1500:]
    committed = [r["step"] for r in train_rows(run_dir) if r["phase"] == "checkpoint" and r.get("status") ==
                 "committed"]
    assert committed and committed[-1] == 300, f"checkpoints committed after the restart: {committed[-5:]}"
    # Recovered without a job restart: a checkpoint whose marks the restart may have taken is abandoned, not waited
    # for (rank 0 waited out the coordination timeout for a lost mark while the others hit the collective timeout).
    events = [json.loads(l) for l in open(os.path.join(run_dir, "events.jsonl"))]
    faults = [e for e in events if e["event"] == "fault"]
    assert not faults, f"the store's restart cost a job restart: {faults}"
    time.sleep(0.2)
    assert not [x for x in redis if alive(x)]


@case
def spec_errors_before_launch():
    # Defect 12: a job name with spaces (as docs/job-spec.md shows) failed in every rank; runtime.redis as
    # host:port (as documented) was refused; mistakes only surfaced per rank after the launch.
    spec = write_spec("named", steps=2)
    r = run("train", spec, "--no-progress", "--set", "name=tiny run 2 \"quoted\"")
    assert r.returncode == 0, r.stderr[-800:]
    r = run("validate", spec, "--set", "runtime.redis=redis-host:6379")
    assert r.returncode == 0, r.stderr
    r = run("validate", spec, "--set", "runtime.redis=redis-host")
    assert r.returncode == 1 and "host:port" in r.stderr, r.stderr
    r = run("validate", spec, "--set", "model.vocab=128")  # the byte tokenizer has 256 tokens
    assert r.returncode == 1 and "model.vocab" in r.stderr and "256 tokens" in r.stderr, r.stderr
    other = os.path.join(WORK, "named-vocab")
    r = run("train", spec, "--no-progress", "--set", "model.vocab=128", "--set", f"log.run_dir={other}")
    assert r.returncode == 1 and "256 tokens" in r.stderr and "[rank" not in r.stderr, r.stderr[-600:]
    assert not os.path.exists(other), "something was launched (the run directory exists)"


run_cases()
failed = results.count(False)
print(f"{len(results) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
