#!/usr/bin/env python3
"""scripts/gpu_tests.py on a fake bundle: how scripts/gpu_check.sh runs a bundle's GPU tests on the GPU machine,
which has neither the build directory nor the source directory of the machine that built the bundle.

  gpu_tests_test.py GPU_TESTS_PY WORK

Checks: build-directory paths of bundled programs become bin/<name>, other build paths scratch folders under --work
(created), source paths the repository, paths inside an argument and in ENVIRONMENT too, the working directory, MS_TEST_CORPUS = the bundle's corpus/; the
build machine's python3 this Python; a missing program (compute-sanitizer) found by name in PATH; -L / -LE select by
label; a pass whose last line counts skipped cases shows it; a test without a command (ctest found no program for it) is
FAIL, and the others still run; a failing test is FAIL with its exit status, one past its TIMEOUT is TIMEOUT (killed with its children), one
past --deadline is SKIP; the exit status is 1 when any test did not pass, 0 when all did, 2 for a folder that is not
a bundle; --list prints the mapped commands and runs nothing.
"""
import json
import os
import shutil
import stat
import subprocess
import sys
import time

runner, work = sys.argv[1], os.path.abspath(sys.argv[2])
shutil.rmtree(work, ignore_errors=True)
bundle, repo, tools = (os.path.join(work, d) for d in ("bundle", "repo", "tools"))
for d in (os.path.join(bundle, "bin"), os.path.join(bundle, "corpus"), os.path.join(repo, "configs"), tools):
    os.makedirs(d)
SRC, BUILD = "/nonexistent-src", "/nonexistent-build"


def script(path, body):
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)


# ok_prog checks every mapping it is given and says so; the others fail, hang or stand in for compute-sanitizer.
script(os.path.join(bundle, "bin", "ok_prog"), f"""set -e
[ "$1" = "{repo}/README.md" ] && [ -f "$1" ] || {{ echo "bad source path $1"; exit 11; }}
[ "$2" = "{work}/run/build/tests/cuda/work-dir/x" ] && [ -d "$(dirname "$2")" ] || {{ echo "bad build path $2"; exit 12; }}
[ "$3" = "--configs={repo}/configs" ] || {{ echo "bad embedded path $3"; exit 13; }}
[ "$MS_X" = "{repo}/configs" ] || {{ echo "bad environment $MS_X"; exit 14; }}
[ "$(pwd)" = "{work}/run/build/tests/cuda" ] || {{ echo "bad working directory $(pwd)"; exit 15; }}
[ "$MS_TEST_CORPUS" = "{bundle}/corpus" ] || {{ echo "bad MS_TEST_CORPUS $MS_TEST_CORPUS"; exit 16; }}
echo all mapped
""")
script(os.path.join(bundle, "bin", "fail_prog"), "exit 3\n")
script(os.path.join(bundle, "bin", "skip_prog"), "echo case one; echo '0 failed, 7 skipped'\n")
script(os.path.join(bundle, "bin", "slow_prog"), "sleep 60 & sleep 60\n")
script(os.path.join(tools, "fake-sanitizer"), 'exec "$@"\n')
open(os.path.join(repo, "README.md"), "w").write("repo\n")
open(os.path.join(repo, "check.py"), "w").write("import sys\nprint('python', sys.executable)\n")


def test(name, command, labels, **props):
    p = [{"name": "LABELS", "value": labels}] + [{"name": k, "value": v} for k, v in props.items()]
    return {"name": name, "command": command, "properties": p}


tests = [
    test("t_ok", [f"{BUILD}/tests/cuda/ok_prog", f"{SRC}/README.md", f"{BUILD}/tests/cuda/work-dir/x",
                  f"--configs={SRC}/configs"], ["gpu"], WORKING_DIRECTORY=f"{BUILD}/tests/cuda",
         ENVIRONMENT=[f"MS_X={SRC}/configs"]),
    test("t_python", ["/usr/bin/python3", f"{SRC}/check.py"], ["gpu"]),
    test("t_fail", [f"{BUILD}/fail_prog"], ["gpu"]),
    test("t_skips", [f"{BUILD}/skip_prog"], ["gpu"]),
    test("t_slow", [f"{BUILD}/slow_prog"], ["gpu"], TIMEOUT=1.0),
    test("t_sanitizer", ["/usr/local/cuda-99/bin/fake-sanitizer", f"{BUILD}/tests/cuda/fail_prog"], ["gpu", "sanitizer"]),
    test("t_other", ["/usr/bin/python3", f"{SRC}/check.py"], ["cpu"]),
]
# What ctest writes for a test whose program it could not find when the bundle was made: no command.
tests.append({"name": "t_nocmd", "properties": [{"name": "LABELS", "value": ["gpu", "sanitizer"]}]})
json.dump({"kind": "ctestInfo", "tests": tests}, open(os.path.join(bundle, "tests.json"), "w"))
json.dump({"source_dir": SRC, "build_dir": BUILD}, open(os.path.join(bundle, "MANIFEST.json"), "w"))

env = dict(os.environ, PATH=tools + ":" + os.environ["PATH"])
env.pop("MS_TEST_CORPUS", None)


def run(*args, expect):
    t0 = time.time()
    p = subprocess.run([sys.executable, runner, "--bundle", bundle, "--repo", repo, "--work", os.path.join(work, "run"),
                        *args], capture_output=True, text=True, env=env, timeout=60)
    out = p.stdout + p.stderr
    print(f"$ gpu_tests.py {' '.join(args)}  -> exit {p.returncode} in {time.time() - t0:.1f} s\n{out}")
    assert p.returncode == expect, f"exit status {p.returncode}, expected {expect}"
    return out, time.time() - t0


def line(out, name):
    found = [l for l in out.splitlines() if l.split()[1:2] == [name]]
    assert len(found) == 1, f"no single line for {name}"
    return found[0]


out, took = run("-L", "gpu", "-LE", "sanitizer", expect=1)
assert line(out, "t_ok").startswith("PASS"), "the mapped paths (ok_prog's checks)"
assert "all mapped" in open(os.path.join(work, "run", "t_ok.log")).read()
assert line(out, "t_python").startswith("PASS")
assert f"python {sys.executable}" in open(os.path.join(work, "run", "t_python.log")).read()
assert line(out, "t_fail").startswith("FAIL") and "exit status 3" in line(out, "t_fail")
assert line(out, "t_slow").startswith("TIMEOUT")
assert line(out, "t_skips").startswith("PASS") and "(0 failed, 7 skipped)" in line(out, "t_skips")
assert "(" not in line(out, "t_ok"), "a pass without skips has no note"
assert "t_sanitizer" not in out and "t_other" not in out, "-L gpu -LE sanitizer"
assert took < 20, f"the timed-out test was not stopped at its 1 s ({took:.0f} s)"

out, _ = run("-L", "sanitizer", expect=1)  # fake-sanitizer found in PATH runs fail_prog (exit 3)
assert line(out, "t_sanitizer").startswith("FAIL") and "exit status 3" in line(out, "t_sanitizer")
assert line(out, "t_nocmd").startswith("FAIL") and "no command" in line(out, "t_nocmd"), "no command: FAIL, no crash"
assert "fake-sanitizer" in open(os.path.join(work, "run", "t_sanitizer.log")).readline()

out, _ = run("-L", "gpu", "--deadline", str(time.time()), expect=1)
assert all(line(out, n).startswith("SKIP") for n in ("t_ok", "t_fail", "t_sanitizer", "t_nocmd"))

out, _ = run("-L", "cpu", expect=0)
assert line(out, "t_other").startswith("PASS") and "t_ok" not in out
out, _ = run("-L", "gpu", "--list", expect=0)
assert f"{bundle}/bin/ok_prog {repo}/README.md" in out and "PASS" not in out

shutil.rmtree(os.path.join(bundle, "bin"))
os.remove(os.path.join(bundle, "tests.json"))
out, _ = run("-L", "gpu", expect=2)
assert "is not a bundle" in out
print("gpu_tests.py: mapping, labels, failures, time limits, deadline and --list as documented")
