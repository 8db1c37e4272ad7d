#!/usr/bin/python3
"""megascale bench end to end: a 2 x 2 sweep of a tiny model (one axis from the spec's bench:
section, one from --vary), one of its points invalid. The table, CSV and JSON hold every point with
sane values, the invalid one with its reason, the others measured; the charts are valid SVG images;
a spec whose learning-rate warm-up is longer than the bench's steps benches unedited; SIGINT to the
bench stops its running point (no process left) and ends the sweep with exit 130.

Usage: bench_test.py MEGASCALE WORK_DIR
"""
import csv
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import harness  # noqa: E402

BIN, WORK = os.path.abspath(sys.argv[1]), harness.fresh_dir(sys.argv[2])
check = harness.Checks()


text = "\n%\n".join(f"fortune {i}: the quick brown fox {i * 7 % 13} jumps over the lazy dog" for i in range(400))
open(os.path.join(WORK, "corpus.txt"), "w").write(text)
harness.prepare_data(BIN, os.path.join(WORK, "data"), [os.path.join(WORK, "corpus.txt")])
spec = os.path.join(WORK, "sweep.yaml")
open(spec, "w").write(f"""name: bench test
model: {{layers: 2, hidden: 48, heads: 4, ffn_hidden: 96, seq_len: 32, vocab: 256}}
train: {{steps: 1000, global_batch: 4, seed: 3}}
optimizer: {{lr: 1.0e-3, warmup_steps: 20}}
data: {{path: data}}
log: {{peak_flops: 1.0e12}}
runtime: {{threads: 1}}
bench:
  vary:
    model.heads: [4, 3]
  steps: 4
  warmup: 1
""")
out_dir = os.path.join(WORK, "out")
r = subprocess.run([BIN, "bench", spec, "--vary", "parallel.tp=1,2", "--output", out_dir], capture_output=True,
                   text=True, timeout=600, cwd=WORK)
print(r.stdout)
check("exit 2: the sweep ran, a point did not", r.returncode == 2, f"exit {r.returncode}: {r.stderr[-2000:]}")
check("progress lines with the point and ETA", "[2/4]" in r.stderr and "ETA" in r.stderr, r.stderr[-1500:])
lines = [l for l in r.stdout.splitlines() if l.strip()]
head = next((i for i, l in enumerate(lines) if "MFU" in l and "tokens/s" in l), None)
check("a table with its header", head is not None, r.stdout)
rows = lines[head + 1:head + 5] if head is not None else []
check("four rows", len(rows) == 4 and all(("%" in l) or ("invalid" in l) for l in rows), rows)
check("the invalid point's row gives the reason", any("invalid" in l and "heads" in l for l in rows), rows)
check("the machine is printed", "machine:" in r.stdout and "cores" in r.stdout, r.stdout[-500:])

with open(os.path.join(out_dir, "bench.csv")) as f:
    table = list(csv.DictReader(f))
check("CSV: four rows", len(table) == 4, table)
for col in ("model.heads", "parallel.tp", "status", "reason", "step_s", "step_spread", "tokens_per_s",
            "flops_per_device", "mfu", "compute_s", "comm_exposed_s", "bubble_s", "data_wait_s"):
    check(f"CSV column {col}", table and col in table[0], table[0].keys() if table else None)
check("CSV column device_mem_peak_mib, empty on the CPU backend",
      table and all(t.get("device_mem_peak_mib", None) == "" for t in table), table[0] if table else None)
ok = [t for t in table if t["status"] == "ok"]
bad = [t for t in table if t["status"] != "ok"]
check("three measured points", len(ok) == 3, table)
check("the invalid one is heads 3 x tp 2", len(bad) == 1 and bad[0]["model.heads"] == "3" and
      bad[0]["parallel.tp"] == "2" and bad[0]["status"] == "invalid" and "heads" in bad[0]["reason"], bad)
for t in ok:
    step, tps, flops, mfu = (float(t[k]) for k in ("step_s", "tokens_per_s", "flops_per_device", "mfu"))
    parts = sum(float(t[k]) for k in ("compute_s", "comm_exposed_s", "bubble_s", "data_wait_s"))
    check(f"sane values {t['model.heads']}x{t['parallel.tp']}",
          0 < step < 10 and tps > 0 and flops > 0 and 0 < mfu < 1 and int(t["measured_steps"]) == 4 and
          abs(tps * step - 4 * 32) < 0.35 * 4 * 32 and 0 < parts <= 1.5 * step, t)  # medians of the parts need not add up exactly
    check(f"MFU = FLOP/s per device / peak {t['model.heads']}x{t['parallel.tp']}",
          abs(mfu - flops / 1e12) < 0.2 * mfu, t)
doc = json.load(open(os.path.join(out_dir, "bench.json")))
check("JSON: four points, settings and statuses", len(doc["points"]) == 4 and
      [p["status"] for p in doc["points"]].count("ok") == 3 and
      all(set(p["settings"]) == {"model.heads", "parallel.tp"} for p in doc["points"]), doc)
for name in ("mfu.svg", "tokens_per_s.svg"):
    try:
        root = ET.parse(os.path.join(out_dir, name)).getroot()
        bars = [e for e in root.iter() if e.tag.endswith("rect")]
        check(f"{name} is an SVG image with bars", root.tag.endswith("svg") and len(bars) >= 3, len(bars))
    except (ET.ParseError, OSError) as e:
        check(f"{name} is an SVG image", False, e)
# The point ran with the bench's own steps and no learning-rate warm-up, the spec unedited.
point_spec = open(os.path.join(out_dir, "points", "000", "job.yaml")).read()
check("a point trains warmup + steps, with no LR warm-up", "steps: 5" in point_spec and "warmup_steps: 0" in point_spec,
      point_spec[:800])
check("the spec file is unedited", "warmup_steps: 20" in open(spec).read())

# Cases: named sets of overrides (one ablation each), e.g. fused kernels off.
cases = os.path.join(WORK, "cases.yaml")
open(cases, "w").write(open(spec).read().split("bench:")[0] + """bench:
  steps: 2
  warmup: 1
  cases:
    - {name: all on}
    - {name: unfused kernels, set: {runtime.fused_kernels: false}}
""")
r = subprocess.run([BIN, "bench", cases, "--output", os.path.join(WORK, "cases"), "--no-progress"],
                   capture_output=True, text=True, timeout=600, cwd=WORK)
check("cases: exit 0", r.returncode == 0, r.stderr[-1500:] + r.stdout)
check("cases: a case column, one row per case", "case" in r.stdout and "all on" in r.stdout and
      "unfused kernels" in r.stdout, r.stdout)
doc = json.load(open(os.path.join(WORK, "cases", "bench.json")))
check("cases: JSON names them", [p["case"] for p in doc["points"]] == ["all on", "unfused kernels"], doc)
check("cases: the unfused point ran unfused", "fused_kernels: false" in
      open(os.path.join(WORK, "cases", "points", "001", "job.yaml")).read())

r = subprocess.run([BIN, "bench", spec, "--vary", "parallel.tpp=1,2"], capture_output=True, text=True, cwd=WORK)
check("a --vary key that does not exist is refused", r.returncode == 1 and "parallel.tpp" in r.stderr, r.stderr)
# Ctrl-C (SIGINT to the bench; the terminal's group does not hold the point's processes, which run in their own
# group): the running point is stopped, no later point starts, no process of it is left, and the outputs hold it.
stop_dir = os.path.join(WORK, "stopped")
p = subprocess.Popen([BIN, "bench", spec, "--vary", "parallel.dp=2,1", "--steps", "1000000", "--output", stop_dir],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=WORK)
point = os.path.join(stop_dir, "points", "000", "run", "job.yaml")
deadline = time.time() + 60
while time.time() < deadline:  # both ranks of the first point are up
    if len(subprocess.run(["pgrep", "-f", f"worker {point}"], capture_output=True, text=True).stdout.split()) == 2:
        break
    time.sleep(0.2)
p.send_signal(signal.SIGINT)
try:
    out, err = p.communicate(timeout=60)
except subprocess.TimeoutExpired:
    p.kill()
    out, err = p.communicate()
left = subprocess.run(["pgrep", "-af", os.path.join(stop_dir, "points")], capture_output=True, text=True).stdout
check("SIGINT: exit 130, the point stopped and named", p.returncode == 130 and "stopped by SIGINT" in err,
      f"exit {p.returncode}: {err[-1500:]}")
check("SIGINT: no process of the point is left", not left.strip(), left)
rows = list(csv.DictReader(open(os.path.join(stop_dir, "bench.csv")))) if os.path.exists(
    os.path.join(stop_dir, "bench.csv")) else []
check("SIGINT: the CSV holds the stopped point, and no later point ran",
      [r["status"] for r in rows] == ["interrupted"] and not os.path.exists(os.path.join(stop_dir, "points", "001")),
      rows)
check.exit()
