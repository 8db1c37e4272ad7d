#!/usr/bin/python3
"""ctest ncu_summary: scripts/ncu_summary.py on profile.csv files in Nsight Compute's `--csv --page details` form
(the profiled program's own output first, as gpu_check.sh's profile stage writes it; ncu's numbers with thousands
separators and its units; with and without the rule columns of newer releases): one line per launch with the right
values, the kernels' names shortened, the block limit named, the tensor pipe's share and the three largest stall
reasons where the CSV has those metrics, the largest rule speedups; a file without ncu's header
and a --kernels regex matching nothing fail with exit 2 and say why; a unit it does not know empties that cell alone.

Usage: ncu_summary_test.py SCRIPT WORKDIR
"""
import os
import subprocess
import sys

script, work = sys.argv[1], sys.argv[2]
os.makedirs(work, exist_ok=True)
problems = []

BASE = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size", "Grid Size",
        "Device", "CC", "Section Name", "Metric Name", "Metric Unit", "Metric Value"]
RULES = ["Rule Name", "Rule Type", "Rule Description", "Estimated Speedup Type", "Estimated Speedup"]
DKDV = ("void ms::kernels::(anonymous namespace)::attention_dkdv_tc_kernel<64, __nv_bfloat16, true, true, true>"
        "(float *, __nv_bfloat16 *, float *, const __nv_bfloat16 *, const __nv_bfloat16 *, const float *, const float "
        "*, const float *, int, int, int, int, int, float, __nv_bfloat16 *, int)")
SPLIT = ("void ms::kernels::(anonymous namespace)::attention_dkdv_split_tc_kernel<128>(float *, __nv_bfloat16 *, "
         "float *, const __nv_bfloat16 *, const __nv_bfloat16 *, const float *, const float *, const float *, int, "
         "int, int, int, int, float, __nv_bfloat16 *, int)")


def q(v):
    return '"' + str(v).replace('"', '""') + '"'


def launch_rows(launch_id, kernel, block, grid, metrics, rules=()):
    rows = []
    for section, name, unit, value in metrics:
        rows.append([launch_id, "4242", "kernels_bench", "127.0.0.1", kernel, "1", "13", block, grid, "0", "9.0",
                     section, name, unit, value])
    for name, speedup in rules:
        rows.append([launch_id, "4242", "kernels_bench", "127.0.0.1", kernel, "1", "13", block, grid, "0", "9.0",
                     "Occupancy", "", "", "", name, "OPT", "This kernel's theoretical occupancy ...", "global",
                     speedup])
    return rows


def metrics(duration, sm, theo, occ, limits, regs, smem, cycles, l2, extra=()):
    """A launch's rows of the five sections; duration and smem as (unit, value), limits as (regs, smem, warps, SM)."""
    sol, occs, launch = "GPU Speed Of Light Throughput", "Occupancy", "Launch Statistics"
    rows = [(sol, "Duration", *duration), (sol, "Compute (SM) Throughput", "%", sm),
            (occs, "Theoretical Occupancy", "%", theo), (occs, "Achieved Occupancy", "%", occ)]
    for name, value in zip(("Registers", "Shared Mem", "Warps", "SM"), limits):
        if value is not None:
            rows.append((occs, f"Block Limit {name}", "block", value))
    rows += [(launch, "Registers Per Thread", "register/thread", regs),
             (launch, "Dynamic Shared Memory Per Block", *smem),
             ("Warp State Statistics", "Warp Cycles Per Issued Instruction", "cycle", cycles),
             ("Memory Workload Analysis", "L2 Hit Rate", "%", l2)]
    return rows + list(extra)


dkdv = metrics(("usecond", "805.60"), "29.71", "12.50", "12.27", ("2", "4", "16", "32"), "218",
               ("Kbyte/block", "53.25"), "6.20", "72.50",
               extra=[("GPU Speed Of Light Throughput", "Memory Throughput", "%", "41.02"),
                      ("Launch Statistics", "Grid Size", "", "3,072")])
# What gpu_check.sh's --metrics add (ncu's "Command line profiler metrics" section; unit "" for the ratios).
CLI = "Command line profiler metrics"
stalls = [(CLI, f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio", "", v)
          for r, v in (("long_scoreboard", "2.10"), ("barrier", "1.50"), ("short_scoreboard", "0.90"),
                       ("mio_throttle", "0.30"), ("wait", "0.50"), ("math_pipe_throttle", "0.05"))]
tensor = [(CLI, "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", "%", "41.30")]
split = metrics(("msecond", "1.23"), "n/a", "12.50", "12.40", ("1", "1", "8", None), "191",
                ("byte/block", "124,416"), "7.01", "80.10")
preface = ["machine: NVIDIA H200 (device 0), compute capability 9.0, 132 SMs, 139.8 GiB, L2 60 MiB",
           "sanity: skipped (--no-sanity): the launchers below were not checked against the CPU reference",
           "==PROF== Connected to process 4242 (/tmp/bundle/bin/kernels_bench)",
           "AttentionBackwardBf16        B=16 T=1024 H=12 D=64 window=0 bf16 in, dqkv16+dbias, no bias, stored dS"]


def write(name, header, rows):
    path = os.path.join(work, name)
    with open(path, "w") as f:
        f.write("\n".join(preface) + "\n")
        f.write(",".join(q(h) for h in header) + "\n")
        for r in rows:
            f.write(",".join(q(v) for v in r[:len(header)]) + "\n")
    return path


def run(*args):
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=60)


rules = [("AchievedOccupancy", "81.25"), ("IssueSlotUtilization", "34.10"), ("SOLBottleneck", "12")]
with_rules = write("with-rules.csv", BASE + RULES,
                   launch_rows("0", DKDV, "(128, 1, 1)", "(3072, 1, 1)", dkdv + stalls + tensor, rules) +
                   launch_rows("1", SPLIT, "(256, 1, 1)", "(2048, 1, 1)", split))
old = write("old.csv", BASE, launch_rows("0", DKDV, "(128, 1, 1)", "(3072, 1, 1)", dkdv) +
            launch_rows("1", SPLIT, "(256, 1, 1)", "(2048, 1, 1)", split))

for path, want_rules in ((with_rules, True), (old, False)):
    r = run(path)
    lines = r.stdout.splitlines()
    if r.returncode != 0 or len(lines) != 3:
        problems.append(f"{path}: exit {r.returncode}, {len(lines)} lines (want a header and 2): {r.stdout}{r.stderr}")
        continue
    (a, a_tail), (b, b_tail) = [(line.split(" | ")[0].split(), line.split(" | ")[1]) for line in lines[1:]]
    # kernel, grid, us, SM %, occ %, theo %, limit, regs, smem KB, cyc/iss, L2 hit, TC %, then the stalls
    want_a = ["attention_dkdv_tc_kernel<64,", "bf16,", "1,", "1,", "1>", "(3072,1,1)", "805.6", "29.71", "12.27",
              "12.50", "regs", "218", "53.25", "6.20", "72.50"]
    want_a += ["41.30", "long_sb", "2.10,", "barrier", "1.50,", "short_sb", "0.90"] if want_rules else ["-"]
    want_b = ["attention_dkdv_split_tc_kernel<128>", "(2048,1,1)", "1230.0", "-", "12.40", "12.50", "regs+smem",
              "191", "124.42", "7.01", "80.10", "-"]
    if a != want_a:
        problems.append(f"{path}: first launch {a}, want {want_a}")
    if b != want_b:
        problems.append(f"{path}: second launch {b}, want {want_b}")
    want_tail = "AchievedOccupancy 81%, IssueSlotUtilization 34%" if want_rules else ""
    if a_tail != want_tail or b_tail != "":
        problems.append(f"{path}: rules '{a_tail}' / '{b_tail}', want '{want_tail}' (the two largest estimated "
                        "speedups, none without rule columns or rules)")

r = run(with_rules, "--kernels", "split")
if r.returncode != 0 or len(r.stdout.splitlines()) != 2 or "split" not in r.stdout.splitlines()[1]:
    problems.append(f"--kernels split: exit {r.returncode}: {r.stdout}{r.stderr}")
r = run(with_rules, "--kernels", "^nothing")
if r.returncode != 2 or "no launch matching --kernels" not in r.stderr:
    problems.append(f"--kernels matching nothing: exit {r.returncode}, stderr {r.stderr!r}")
# A unit the script does not know costs that cell, said on stderr, not the table.
odd = os.path.join(work, "odd-unit.csv")
with open(old) as f, open(odd, "w") as g:
    g.write(f.read().replace('"usecond"', '"fortnight"'))
r = run(odd)
cells = r.stdout.splitlines()[1].split() if r.returncode == 0 and len(r.stdout.splitlines()) == 3 else []
if cells[6:8] != ["-", "29.71"] or "unknown duration unit 'fortnight'" not in r.stderr:
    problems.append(f"an unknown unit: exit {r.returncode}, {cells}, stderr {r.stderr!r}")
bare = os.path.join(work, "no-header.csv")
with open(bare, "w") as f:
    f.write("\n".join(preface) + "\n==PROF== No kernels were profiled.\n")
r = run(bare)
if r.returncode != 2 or "no ncu CSV header" not in r.stderr:
    problems.append(f"a file without ncu's header: exit {r.returncode}, stderr {r.stderr!r}")

for p in problems:
    print("FAIL", p)
if problems:
    sys.exit(1)
print("ok: both CSV forms summarized, --kernels, and the two errors")
