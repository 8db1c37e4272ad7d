#!/usr/bin/python3
"""One line per profiled launch from Nsight Compute's CSV (`ncu --csv --page details`, as scripts/gpu_check.sh's
profile stage writes it into profile.csv): the kernel (namespaces and parameter list dropped, template arguments
kept, true/false as 1/0, __nv_bfloat16 as bf16), the grid, the duration, the SM throughput, achieved and theoretical
occupancy with what limits it (the smallest of the block limits: registers, shared memory, warps, the SM's block
count; ties joined by +), registers per thread, dynamic shared memory per block (KB: 1000 bytes, as ncu counts),
warp cycles per issued instruction, the L2 hit rate, the tensor pipe's share of active cycles and the three largest
stall reasons (warps stalled per issued instruction) where the CSV has those metrics (gpu_check.sh asks for them),
and where it carries ncu's rule results, its two largest estimated speedups. The lines the profiled program printed before the CSV are skipped.

Usage: ncu_summary.py PROFILE_CSV [--kernels REGEX]
Exit status 0; 2 when the file has no ncu CSV header or no launch (the message says which).
"""
import argparse
import csv
import re
import sys

HEADER_START = '"ID","Process ID"'

# Metric display names of the details page (sections SpeedOfLight, Occupancy, LaunchStats, WarpStateStats,
# MemoryWorkloadAnalysis).
DURATION = "Duration"
SM = "Compute (SM) Throughput"
MEM = "Memory Throughput"
ACHIEVED = "Achieved Occupancy"
THEORETICAL = "Theoretical Occupancy"
REGS = "Registers Per Thread"
SMEM = "Dynamic Shared Memory Per Block"
CYCLES = "Warp Cycles Per Issued Instruction"
L2HIT = "L2 Hit Rate"
LIMITS = {"Block Limit Registers": "regs", "Block Limit Shared Mem": "smem", "Block Limit Warps": "warps",
          "Block Limit SM": "SM"}

# --metrics of gpu_check.sh's profile stage (its "Command line profiler metrics" section): the tensor pipe's busy
# cycles and the warps stalled per issued instruction, by reason.
TENSOR = re.compile(r"sm__pipe_tensor\w*cycles_active\.avg\.pct_of_peak_sustained_active")
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio")
STALL_SHORT = {"long_scoreboard": "long_sb", "short_scoreboard": "short_sb", "mio_throttle": "mio",
               "math_pipe_throttle": "math", "not_selected": "not_sel", "lg_throttle": "lg"}

SCALE = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "K": 1e3, "M": 1e6, "G": 1e9}


def number(text):
    """ncu's numbers: thousands separated by commas ("53,261,312"); None where there is none ("n/a", "")."""
    t = text.strip().replace(",", "")
    try:
        return float(t)
    except ValueError:
        return None


def seconds(value, unit):
    """A duration in seconds from ncu's units: ns/us/ms/s or nsecond/usecond/msecond/second."""
    m = re.fullmatch(r"([num]?)s(?:econd)?", unit.strip())
    if m is None:
        raise ValueError(f"unknown duration unit '{unit}'")
    return value * SCALE[m.group(1)]


def byte_count(value, unit):
    """Bytes from ncu's byte units (decimal prefixes: Kbyte = 1000 bytes), per block or not."""
    m = re.fullmatch(r"([KMG]?)byte(?:/block)?", unit.strip())
    if m is None:
        raise ValueError(f"unknown byte unit '{unit}'")
    return value * SCALE[m.group(1)]


def short_name(demangled):
    """`void ns::(anonymous namespace)::k<64, __nv_bfloat16, true>(float *, int)` -> `k<64, bf16, 1>`."""
    name = demangled.strip().replace("(anonymous namespace)", "anonymous")
    if name.startswith("void "):
        name = name[5:]
    # Cut the parameter list: the first '(' outside template brackets.
    depth, cut = 0, len(name)
    for i, c in enumerate(name):
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif c == "(" and depth == 0:
            cut = i
            break
    name = name[:cut]
    lt = name.find("<")
    base, args = (name, "") if lt < 0 else (name[:lt], name[lt:])
    base = base.split("::")[-1]
    args = re.sub(r"\btrue\b", "1", re.sub(r"\bfalse\b", "0", args)).replace("__nv_bfloat16", "bf16")
    return base + args


def read_launches(path):
    with open(path, newline="", errors="replace") as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(HEADER_START)), None)
    if start is None:
        print(f"ncu_summary: {path}: no ncu CSV header (a line starting {HEADER_START}): was it written by "
              "`ncu --csv --page details`, and did ncu profile anything?", file=sys.stderr)
        sys.exit(2)
    launches = {}  # ID -> dict, in the CSV's order
    for row in csv.DictReader(lines[start:]):
        if not row.get("ID") or row.get("ID") == "ID" or not row["ID"].strip().isdigit():
            continue
        launch = launches.setdefault(row["ID"], {"kernel": row.get("Kernel Name", "?"),
                                                 "grid": row.get("Grid Size", "?").replace(" ", ""),
                                                 "block": row.get("Block Size", "?").replace(" ", ""),
                                                 "metrics": {}, "rules": []})
        metric = (row.get("Metric Name") or "").strip()
        if metric:
            launch["metrics"][metric] = (number(row.get("Metric Value", "")), (row.get("Metric Unit") or "").strip())
        rule, speedup = (row.get("Rule Name") or "").strip(), number(row.get("Estimated Speedup") or "")
        if rule and speedup is not None and speedup > 0:
            if all(r != rule for r, _ in launch["rules"]):
                launch["rules"].append((rule, speedup))
    return launches


def converted(metrics, key, convert, factor):
    """metrics[key] in the unit `convert` gives times factor; None where missing, or (said once on stderr) in a unit
    this script does not know: one odd cell, not a lost table."""
    value, unit = metrics.get(key, (None, ""))
    if value is None:
        return None
    try:
        return convert(value, unit) * factor
    except ValueError as e:
        if (key, unit) not in WARNED:
            WARNED.add((key, unit))
            print(f"ncu_summary: {key}: {e}; shown as -", file=sys.stderr)
        return None


WARNED = set()


def fmt(value, spec, missing="-"):
    return missing if value is None else format(value, spec)


def summarize(launches, kernels=None):
    out = [f"{'kernel':<58} {'grid':>12} {'us':>9} {'SM %':>6} {'occ %':>6} {'theo %':>6} {'limit':>9} "
           f"{'regs':>5} {'smem KB':>8} {'cyc/iss':>7} {'L2 hit':>6} {'TC %':>6}  largest stalls (warps per issue) | "
           "ncu's largest estimated speedups"]
    shown = 0
    for launch in launches.values():
        name = short_name(launch["kernel"])
        if kernels and not re.search(kernels, name):
            continue
        shown += 1
        m = launch["metrics"]
        val = lambda key: m.get(key, (None, ""))[0]
        us = converted(m, DURATION, seconds, 1e6)
        smem = converted(m, SMEM, byte_count, 1e-3)
        limits = [(val(k), what) for k, what in LIMITS.items() if val(k) is not None]
        low = min(v for v, _ in limits) if limits else None
        limit = "+".join(what for v, what in limits if v == low) if limits else "-"
        rules = sorted(launch["rules"], key=lambda r: -r[1])[:2]
        tensor = next((v for k, (v, _) in m.items() if TENSOR.fullmatch(k) and v is not None), None)
        stalls = sorted(((v, STALL_SHORT.get(g.group(1), g.group(1))) for k, (v, _) in m.items()
                         if (g := STALL.fullmatch(k)) and v is not None), key=lambda x: -x[0])[:3]
        out.append(f"{name[:58]:<58} {launch['grid'][:12]:>12} {fmt(us, '9.1f'):>9} {fmt(val(SM), '6.2f'):>6} "
                   f"{fmt(val(ACHIEVED), '6.2f'):>6} {fmt(val(THEORETICAL), '6.2f'):>6} {limit:>9} "
                   f"{fmt(val(REGS), '5.0f'):>5} {fmt(smem, '8.2f'):>8} {fmt(val(CYCLES), '7.2f'):>7} "
                   f"{fmt(val(L2HIT), '6.2f'):>6} {fmt(tensor, '6.2f'):>6}  " +
                   ", ".join(f"{what} {v:.2f}" for v, what in stalls) + " | " +
                   ", ".join(f"{r} {sp:.0f}%" for r, sp in rules))
    return out, shown


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--kernels", help="only the launches whose short kernel name this regex finds")
    a = ap.parse_args()
    launches = read_launches(a.csv)
    lines, shown = summarize(launches, a.kernels)
    if shown == 0:
        print(f"ncu_summary: {a.csv}: no launch{' matching --kernels ' + a.kernels if a.kernels else ''} "
              f"({len(launches)} in the file)", file=sys.stderr)
        sys.exit(2)
    print("\n".join(lines))


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except OSError as e:
        print(f"ncu_summary: {e}", file=sys.stderr)
        sys.exit(2)
