#!/usr/bin/python3
"""megascale report end to end: a 4-rank run (tp 2 x dp 2, traces on, evaluations, checkpoints) is
reported; the page is opened in a real headless browser (Debian's chromium) with no network, which
loads it without errors; the rendered DOM holds one heat-map row per rank and one loss point per
logged step; a screenshot shows non-trivial content; every chart is a valid SVG image; the merged
trace of one step holds every rank; a truncated last line of metrics.jsonl is skipped with a warning;
a directory that is not a run is a clear error.

Usage: report_test.py MEGASCALE WORK_DIR
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import harness  # noqa: E402

BIN, WORK = os.path.abspath(sys.argv[1]), harness.fresh_dir(sys.argv[2])
check = harness.Checks(limit=1500)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if not CHROMIUM:
    print("FAIL chromium is not installed: run scripts/setup.sh (it installs Debian's chromium)")
    sys.exit(1)

corpus = os.path.join(WORK, "corpus.txt")
open(corpus, "w").write("\n%\n".join(f"line {i}: all work and no play makes jack a dull boy {i % 11}" for i in range(800)))
data = os.path.join(WORK, "data")
harness.prepare_data(BIN, data, [corpus])
run_dir = os.path.join(WORK, "run")
spec = os.path.join(WORK, "job.yaml")
open(spec, "w").write(f"""name: report test
model: {{layers: 2, hidden: 32, heads: 4, ffn_hidden: 64, seq_len: 32, vocab: 256}}
train: {{steps: 12, global_batch: 8, micro_batch: 2, seed: 3, eval_interval: 4, eval_batches: 1}}
optimizer: {{lr: 1.0e-3, warmup_steps: 2}}
data: {{path: {data}}}
checkpoint: {{interval: 6}}
log: {{run_dir: {run_dir}, trace: true, peak_flops: 1.0e10}}
runtime: {{threads: 1}}
parallel: {{tp: 2, dp: 2}}
fault: {{heartbeat_s: 0.05}}
""")
r = subprocess.run([BIN, "train", spec, "--no-progress"], capture_output=True, text=True, timeout=300)
check("the 4-rank run", r.returncode == 0, r.stderr[-1500:])
steps = sorted({json.loads(l)["step"] for l in open(os.path.join(run_dir, "metrics.jsonl"))
                if json.loads(l)["phase"] == "train"})

r = subprocess.run([BIN, "report", run_dir], capture_output=True, text=True, timeout=120)
check("report: exit 0", r.returncode == 0, r.stderr)
out = os.path.join(run_dir, "report")
page = os.path.join(out, "index.html")
check("the page and its charts", os.path.exists(page) and all(
    os.path.exists(os.path.join(out, f)) for f in
    ("loss.svg", "throughput.svg", "mfu.svg", "breakdown.svg", "heatmap.svg", "timeline.svg")), os.listdir(out))
for f in sorted(os.listdir(out)):
    if f.endswith(".svg"):
        try:
            root = ET.parse(os.path.join(out, f)).getroot()
            check(f"{f} is an SVG image", root.tag.endswith("svg") and len(list(root.iter())) > 10)
        except ET.ParseError as e:
            check(f"{f} is an SVG image", False, e)
html = open(page).read()
check("self-contained: no script, no external reference", "<script" not in html and "http://" not in
      html.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in html)
merged = [f for f in os.listdir(out) if f.startswith("timeline-step-") and f.endswith(".json")]
check("a merged trace of one step", len(merged) == 1, os.listdir(out))
if merged:
    ev = json.load(open(os.path.join(out, merged[0])))
    pids = {e["pid"] for e in ev if e.get("ph") == "X"}
    names = {e["args"]["name"] for e in ev if e.get("name") == "process_name"}
    check("every rank in the merged trace, named by its coordinates", pids == {0, 1, 2, 3} and
          "rank 3 (dp 1, pp 0, tp 1)" in names, (pids, names))

# A real browser, no network.
netns = subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0
prefix = ["unshare", "-n"] if netns else []
profile = os.path.join(WORK, "chromium-profile")
base = [*prefix, CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
        f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--window-size=1200,2400"]
dom = subprocess.run([*base, "--dump-dom", "file://" + page], capture_output=True, text=True, timeout=120)
check("chromium loads the page", dom.returncode == 0 and "</html>" in dom.stdout, dom.stderr[-1500:])
check("one heat-map row per rank", dom.stdout.count('class="heat-row"') == 4, dom.stdout.count('class="heat-row"'))
check("one loss point per logged step", dom.stdout.count('class="pt-loss"') == len(steps) == 12,
      (dom.stdout.count('class="pt-loss"'), len(steps)))


def page_errors(stderr):
    return [l for l in stderr.splitlines() if "Uncaught" in l or "net::ERR" in l or "Failed to load" in l]


check("no errors loading the page", not page_errors(dom.stderr), page_errors(dom.stderr))
# The check can fail: a control page with a script error and a missing image is caught by it.
control = os.path.join(WORK, "control.html")
open(control, "w").write('<html><body><img src="missing.png"><script>throw new Error("planted")</script></body></html>')
ctl = subprocess.run([*base, "--dump-dom", "file://" + control], capture_output=True, text=True, timeout=120)
check("the error check catches a planted script error and missing file", len(page_errors(ctl.stderr)) >= 1,
      ctl.stderr[-1500:])
png = os.path.join(WORK, "page.png")
shot = subprocess.run([*base, f"--screenshot={png}", "file://" + page], capture_output=True, text=True, timeout=120)
ok_png = shot.returncode == 0 and os.path.exists(png) and open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
check("a PNG screenshot", ok_png, shot.stderr[-800:])
if ok_png:
    blob = open(png, "rb").read()
    width, height = struct.unpack(">II", blob[16:24])
    idat, at = b"", 8
    while at < len(blob):
        n, kind = struct.unpack(">I4s", blob[at:at + 8])
        if kind == b"IDAT":
            idat += blob[at + 8:at + 8 + n]
        at += 12 + n
    raw = zlib.decompress(idat)
    stride = len(raw) // height
    colors = {raw[y * stride + 1 + x * 3:y * stride + 4 + x * 3] for y in range(0, height, 7) for x in
              range(0, min(width, (stride - 1) // 3), 5)}
    check("the screenshot shows non-trivial content", width >= 1000 and height >= 1000 and len(colors) > 20,
          (width, height, len(colors)))

# A run that stopped mid-line: the truncated last line is skipped with a warning.
with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
    f.write('{"phase": "train", "step": 13, "loss": 4.1, "tok')
r = subprocess.run([BIN, "report", run_dir, "--output", os.path.join(WORK, "again")], capture_output=True, text=True)
check("truncated last line: skipped with a warning", r.returncode == 0 and "not a complete JSON object" in r.stderr and
      "metrics.jsonl:" in r.stderr, r.stderr)
again = open(os.path.join(WORK, "again", "index.html")).read()
check("truncated last line: the page still has every complete step", again.count('class="pt-loss"') == 12)
r = subprocess.run([BIN, "report", WORK], capture_output=True, text=True)
check("not a run directory: a clear error", r.returncode == 1 and "metrics.jsonl does not exist" in r.stderr, r.stderr)
check.exit()
