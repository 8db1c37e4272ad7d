"""What the end-to-end Python tests share: running cases (or a script's named checks), a fresh work folder, the
Debian fortunes corpus as a dataset, reading a run's JSON-lines files, waiting for a step, finding a job's rank
processes.

A test script imports it after putting this folder on its path:

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
    import harness

    case = harness.Cases()

    @case
    def crash():
        ...

    case.exit()
"""
import glob
import json
import os
import shutil
import subprocess
import sys
import time

# What a failing case may raise and still leave the cases after it to run: an assertion, a command that ran past
# its time, a file that is not there or not what it should be (a JSON line cut short, a missing key or rank).
CASE_ERRORS = (AssertionError, subprocess.TimeoutExpired, OSError, ValueError, KeyError, IndexError)


class Cases:
    """A decorator that runs each case as it is defined and prints `ok   NAME (S s)` or `FAIL NAME: ERROR`.

    MS_TEST_CASES=a,b (the environment) runs only those cases, plus the ones named in `always` (cases the others
    read from). A case in `skip` is printed as skipped with `skip_reason`. `after(name)`, if given, runs after
    every case that ran, passed or not (a cleanup). exit() prints "N passed, M failed" and exits 1 when a case
    failed or none ran (MS_TEST_CASES naming no case is a mistake, not a pass)."""

    def __init__(self, always=(), skip=(), skip_reason="", after=None):
        self.only = [c for c in os.environ.get("MS_TEST_CASES", "").split(",") if c]
        self.always, self.skip, self.skip_reason, self.after = set(always), set(skip), skip_reason, after
        self.results = []

    def __call__(self, fn):
        name = fn.__name__
        if self.only and name not in self.only and name not in self.always:
            return fn
        if name in self.skip:
            print(f"skip {name}{f' ({self.skip_reason})' if self.skip_reason else ''}", flush=True)
            return fn
        t0 = time.time()
        try:
            fn()
            self.results.append(True)
            print(f"ok   {name} ({time.time() - t0:.1f} s)", flush=True)
        except CASE_ERRORS as e:
            self.results.append(False)
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
        finally:
            if self.after:
                self.after(name)
        return fn

    def fail(self, message):
        """A failure outside any case (a teardown that went wrong)."""
        self.results.append(False)
        print(f"FAIL: {message}", flush=True)

    def exit(self):
        failed = self.results.count(False)
        print(f"{len(self.results) - failed} passed, {failed} failed", flush=True)
        if not self.results:
            print("no case ran (MS_TEST_CASES names none of this test's cases?)", flush=True)
        sys.exit(1 if failed or not self.results else 0)


class Checks:
    """The named checks of a script that runs straight through: check(name, ok, detail) prints `ok   NAME` or
    `FAIL NAME: DETAIL` (the detail cut to `limit` characters unless None; shown on a pass too with
    detail_on_pass, for figures worth reading either way) and returns ok; exit() prints "N passed, M failed" with
    the failures' names and exits 1 when one failed or none ran."""

    def __init__(self, limit=2000, detail_on_pass=False):
        self.limit, self.detail_on_pass, self.passed, self.failed = limit, detail_on_pass, 0, []

    def __call__(self, name, ok, detail=""):
        text = str(detail) if self.limit is None else str(detail)[:self.limit]
        shown = f": {text}" if detail and (not ok or self.detail_on_pass) else ""
        print(f"{'ok  ' if ok else 'FAIL'} {name}{shown}", flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed.append(name)
        return ok

    def exit(self):
        print(f"{self.passed} passed, {len(self.failed)} failed" +
              (f": {', '.join(self.failed)}" if self.failed else ""), flush=True)
        if not self.passed and not self.failed:
            print("no check ran", flush=True)
        sys.exit(1 if self.failed or not self.passed else 0)


def fresh_dir(path):
    """`path` made absolute, emptied (what an earlier run left) and created."""
    path = os.path.abspath(path)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


FORTUNES = "/usr/share/games/fortunes"


def fortunes(count=None, required=True):
    """The text files of Debian's fortunes packages (scripts/setup.sh installs them) in name order, the first
    `count` of them unless None; when there are none an AssertionError, or [] if not `required`."""
    files = sorted(f for f in glob.glob(os.path.join(FORTUNES, "*"))
                   if os.path.isfile(f) and not f.endswith((".dat", ".u8")))
    assert files or not required, f"no fortunes files in {FORTUNES}: run scripts/setup.sh"
    return files[:count]


def prepare_data(binary, output, files):
    """`megascale prepare-data` of text `files` whose documents are separated by `%` lines (as fortunes files are)
    into the dataset `output` (output.bin, output.idx); returns `output`. A failure raises CalledProcessError."""
    subprocess.run([binary, "prepare-data", "--doc-separator", "%", "--output", output, *files], check=True,
                   capture_output=True)
    return output


def jsonl(path):
    """The complete lines of a JSON-lines file (metrics.jsonl, events.jsonl) as dicts; [] while it does not exist.
    Polled while a job appends: a last line still being written (no newline yet) is not read."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip() and line.endswith("\n")]


def wait_step(metrics, step, p, timeout=60):
    """Waits until the metrics file `metrics` has a training row of step >= `step`, while process `p` runs."""
    deadline = time.time() + timeout
    while time.time() < deadline and p.poll() is None:
        if any(r["phase"] == "train" and r["step"] >= step for r in jsonl(metrics)):
            return
        time.sleep(0.02)
    raise AssertionError(f"{metrics} did not reach step {step}" + (f" (exit {p.returncode})" if p.poll() is not None else ""))


def job_children(p):
    """The children of a local `megascale train` driver `p`: {rank: pid} from each child's MEGASCALE_RANK, and
    "redis": pid for an embedded redis-server."""
    out = {}
    for pid in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split():
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "redis-server":
                    out["redis"] = int(pid)
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            out[next(int(e.split(b"=")[1]) for e in env if e.startswith(b"MEGASCALE_RANK="))] = int(pid)
        except (OSError, StopIteration):  # gone meanwhile, or not a rank
            pass
    return out


def start_train(binary, spec, *args, env=None):
    """`megascale train SPEC --no-progress ARGS` in a session of its own, stdout and stderr piped."""
    return subprocess.Popen([binary, "train", spec, "--no-progress", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
