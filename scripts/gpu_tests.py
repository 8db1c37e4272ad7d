#!/usr/bin/env python3
"""Run the GPU tests of a bundle (scripts/gpu_bundle.sh) on a machine that has no build directory.

The bundle holds `ctest --show-only=json-v1` of the build that made it (tests.json) and MANIFEST.json, which names
that build's source and build directories. A test's command, working directory and environment are mapped onto
this machine: a bundled program (bin/<name>) for a path in the build directory with that name, the repository
root (--repo) for a path in the source directory, a scratch folder under --work for other build paths, this
Python for the build machine's python3, and a program of the build machine that is missing here (compute-sanitizer)
by its name in PATH or under /usr/local/cuda/bin.

  scripts/gpu_tests.py --bundle DIR [--repo DIR] --work DIR [-L LABEL]... [-LE LABEL]... [--deadline EPOCH]
                       [--list]

Each test's output goes to <work>/<test>.log; one line per test says PASS, FAIL (exit status), TIMEOUT or SKIP
(no time left), with its seconds. Exit status: 0 when every selected test passed, 1 when one did not, 2 on bad
usage or a bundle without tests.json / MANIFEST.json.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time


def load(bundle):
    try:
        with open(os.path.join(bundle, "MANIFEST.json")) as f:
            manifest = json.load(f)
        with open(os.path.join(bundle, "tests.json")) as f:
            tests = json.load(f)["tests"]
    except (OSError, ValueError, KeyError) as e:
        print(f"gpu_tests: {bundle} is not a bundle of scripts/gpu_bundle.sh ({e}); make one with "
              "scripts/gpu_bundle.sh and pass its unpacked folder", file=sys.stderr)
        sys.exit(2)
    return manifest, tests


class Mapper:
    def __init__(self, manifest, bundle, repo, work):
        self.src = manifest["source_dir"].rstrip("/") + "/"
        self.build = manifest["build_dir"].rstrip("/") + "/"
        self.bin = os.path.join(bundle, "bin")
        self.repo = os.path.abspath(repo)
        self.scratch = os.path.join(os.path.abspath(work), "build")

    def arg(self, a):
        if a.startswith(self.build):
            name = os.path.basename(a)
            if os.path.isfile(os.path.join(self.bin, name)):
                return os.path.join(self.bin, name)
            return os.path.join(self.scratch, a[len(self.build):])
        if a.startswith(self.src):
            return os.path.join(self.repo, a[len(self.src):])
        # Paths inside a longer argument (--flag=/path/...): the directories alone.
        return a.replace(self.build, self.scratch + "/").replace(self.src, self.repo + "/")

    def program(self, p):
        if os.path.basename(p).startswith("python"):
            return sys.executable
        mapped = self.arg(p)
        if os.path.isfile(mapped):
            return mapped
        found = shutil.which(os.path.basename(p)) or shutil.which(os.path.basename(p), path="/usr/local/cuda/bin")
        return found or mapped


def properties(test):
    props = {p["name"]: p["value"] for p in test.get("properties", [])}
    return props.get("LABELS", []), props


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", required=True, help="the unpacked bundle (bin/, lib/, tests.json, MANIFEST.json)")
    ap.add_argument("--repo", default=".", help="this machine's copy of the repository (default: .)")
    ap.add_argument("--work", required=True, help="logs and the tests' scratch folders go here")
    ap.add_argument("-L", dest="labels", action="append", default=[], help="run tests with this label (all given)")
    ap.add_argument("-LE", dest="exclude", action="append", default=[], help="skip tests with this label")
    ap.add_argument("--deadline", type=float, default=0, help="Unix time after which no test starts or runs on")
    ap.add_argument("--list", action="store_true", help="print the mapped commands, run nothing")
    args = ap.parse_args()
    manifest, tests = load(args.bundle)
    m = Mapper(manifest, os.path.abspath(args.bundle), args.repo, args.work)
    os.makedirs(args.work, exist_ok=True)
    selected = []
    for t in tests:
        labels, props = properties(t)
        if all(l in labels for l in args.labels) and not any(l in labels for l in args.exclude):
            selected.append((t, props))
    if not selected:
        print(f"gpu_tests: no test has the labels {args.labels} without {args.exclude}", file=sys.stderr)
        return 1
    failed = 0
    for t, props in selected:
        name = t["name"]
        if not t.get("command") and not args.list:
            if args.deadline and args.deadline - time.time() < 10:
                print(f"SKIP    {name:32s}      - s  (no time left)", flush=True)
            else:  # ctest writes none where it found no program when the bundle was made
                print(f"FAIL    {name:32s}      - s  (no command in tests.json: ctest found no program for it when "
                      "the bundle was made)", flush=True)
            failed = 1
            continue
        cmd = [m.program(t["command"][0])] + [m.arg(a) for a in t["command"][1:]] if t.get("command") else ["?"]
        cwd = m.arg(props.get("WORKING_DIRECTORY", "")) if props.get("WORKING_DIRECTORY") else args.work
        env = dict(os.environ)
        if os.path.isdir(os.path.join(args.bundle, "corpus")):  # the fortune files (tests/cuda/gpus.py)
            env.setdefault("MS_TEST_CORPUS", os.path.join(args.bundle, "corpus"))
        for kv in props.get("ENVIRONMENT", []):
            k, _, v = kv.partition("=")
            env[k] = m.arg(v)
        if args.list:
            print(f"{name}: (cd {cwd} && {' '.join(cmd)})")
            continue
        limit = float(props.get("TIMEOUT", 1500))
        if args.deadline:
            left = args.deadline - time.time()
            if left < 10:
                print(f"SKIP    {name:32s}      - s  (no time left)", flush=True)
                failed = 1
                continue
            limit = min(limit, left)
        os.makedirs(cwd, exist_ok=True)
        for a in cmd[1:]:  # the scratch folders the build directory would have held
            if a.startswith(m.scratch):
                os.makedirs(os.path.dirname(a), exist_ok=True)
        log = os.path.join(args.work, f"{name}.log")
        t0 = time.time()
        with open(log, "w") as out:
            out.write(f"$ (cd {cwd} && {' '.join(cmd)})\n")
            out.flush()
            try:
                p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
            except OSError as e:
                out.write(f"gpu_tests: cannot start {cmd[0]}: {e}\n")
                print(f"FAIL    {name:32s} {0:6.0f} s  (cannot start {cmd[0]}: {e.strerror})", flush=True)
                failed = 1
                continue
            try:
                rc = p.wait(timeout=limit)
                what = "PASS" if rc == 0 else "FAIL"
                detail = "" if rc == 0 else f"  (exit status {rc}; {log})"
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()
                what, detail = "TIMEOUT", f"  (after {limit:.0f} s; {log})"
        if what != "PASS":
            failed = 1
        else:  # a pass that skipped cases (multi-GPU layouts on one GPU) says so
            last = [l.strip() for l in open(log, errors="replace").read().splitlines() if l.strip()][-1:]
            if last and "skip" in last[0].lower():
                detail = f"  ({last[0][:100]})"
        print(f"{what:7s} {name:32s} {time.time() - t0:6.0f} s{detail}", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
