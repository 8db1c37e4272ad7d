#!/usr/bin/env python3
"""check_ptxas.py: register, spill and occupancy check of every CUDA kernel, as ptxas compiles it.

    scripts/check_ptxas.py [--nvcc PATH] [--arch 80,90] [--json FILE] [FILE.cu ...]
    scripts/check_ptxas.py --from-build BUILD/ptxas-report [--arch 80,90] [--json FILE] [kernels/FILE.cu ...]

For each kernel source (default: kernels/*.cu) and each architecture (default sm_80 and sm_90) the source is
compiled to PTX by nvcc (-ptx, the flags of ms_kernels_cuda) and the PTX assembled by ptxas -v. With --from-build
nothing is compiled: the check reads what the build's own compilation of ms_kernels_cuda left (its compiler
launcher, scripts/nvcc_report.sh, keeps each source's PTX and ptxas -v's report), so it checks the very code
the build produced; a source without a report is an error. For every kernel entry it checks:

  - the kernel declares __launch_bounds__ (PTX .maxntid): the launch configuration its launcher uses is then a
    fact ptxas knows, and a launch above it fails instead of running out of registers at some shapes;
  - no spill stores or loads (local-memory traffic on every access of a spilled value);
  - the registers of one block fit an SM: ceil(regs, 8) x ceil(threads, 32) <= 65536 (the register file of
    sm_80/sm_90; allocation is per warp in units of 256 registers), regs <= 255;
  - static shared memory <= 48 KiB (above it a kernel must use dynamic shared memory and opt in);
  - the tensor-core attention kernels (attention_*_tc_kernel) have no integer division or remainder (div / rem in
    the PTX, outside inline asm) inside a loop: D is a kernel argument, so an index divided by D / 8 is a division
    routine of a dozen-odd instructions per element, which their tile loaders once ran 16 to 32 times per tile and
    thread (kernels/attention_tc.cu: GroupDiv). A loop is the code between a label and a branch back to it.

It prints one line per kernel and architecture (registers, threads, blocks per SM the registers allow, stack,
spills, shared memory) and exits 1 naming every kernel that fails a check, 2 when nvcc or ptxas cannot run.
ctest runs it as `kernels_ptxas` (--from-build) whenever nvcc is found (tests/kernels/CMakeLists.txt); a planted
kernel without launch bounds and with spills (tests/kernels/ptxas_bad.cu.txt, compiled here) must fail it
(`kernels_ptxas_catches`).
"""

import argparse
import concurrent.futures
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

REGISTER_FILE = 65536  # 32-bit registers per SM, sm_80 and sm_90
NO_LOOP_DIVISION = re.compile(r"^attention_\w+_tc_kernel\b")  # held to no division inside a loop
MAX_REGS = 255
STATIC_SHARED_LIMIT = 48 * 1024


def die(msg, code=2):
    print(f"check_ptxas: {msg}", file=sys.stderr)
    sys.exit(code)


class CommandFailed(Exception):
    pass


def run(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        raise CommandFailed(f"{' '.join(cmd)} failed (exit {p.returncode}):\n{p.stdout}")
    return p.stdout


def demangle(names):
    filt = shutil.which("c++filt") or shutil.which("cu++filt")
    if not filt or not names:
        return {n: n for n in names}
    out = subprocess.run([filt], input="\n".join(names), stdout=subprocess.PIPE, text=True).stdout.splitlines()
    if len(out) != len(names):
        return {n: n for n in names}
    return dict(zip(names, out))


def max_threads(ptx):
    """Entry name -> threads per block declared with __launch_bounds__ (.maxntid x*y*z), None without."""
    bounds = {}
    entries = list(re.finditer(r"\.entry\s+([A-Za-z0-9_$]+)\s*\(", ptx))
    for i, m in enumerate(entries):
        # The directives sit between the parameter list and the body's opening brace.
        end = entries[i + 1].start() if i + 1 < len(entries) else len(ptx)
        head = ptx[m.end():end]
        brace = head.find("{")
        head = head[:brace] if brace >= 0 else head
        nt = re.search(r"\.maxntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", head)
        if nt:
            n = 1
            for g in nt.groups():
                if g:
                    n *= int(g)
            bounds[m.group(1)] = n
        else:
            bounds[m.group(1)] = None
    return bounds


def loop_divisions(ptx):
    """Entry name -> how many integer divisions / remainders (div, rem; inline asm excluded) lie inside its loops."""
    counts = {}
    entries = list(re.finditer(r"\.entry\s+([A-Za-z0-9_$]+)\s*\(", ptx))
    for i, m in enumerate(entries):
        end = entries[i + 1].start() if i + 1 < len(entries) else len(ptx)
        lines = ptx[m.end():end].splitlines()
        labels, in_asm, asm = {}, [], False
        for j, line in enumerate(lines):
            lm = re.match(r"^(\$L__\w+):", line)
            if lm:
                labels[lm.group(1)] = j
            if "begin inline asm" in line:
                asm = True
            in_asm.append(asm)
            if "end inline asm" in line:
                asm = False
        inside = set()
        for j, line in enumerate(lines):
            bm = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", line)
            if bm and labels.get(bm.group(1), j) < j:  # a branch back: lines label .. j are a loop
                for k in range(labels[bm.group(1)], j):
                    if not in_asm[k] and re.search(r"^\s*(?:@!?%p\d+\s+)?(?:div|rem)\.[su](?:32|64)\b", lines[k]):
                        inside.add(k)
        counts[m.group(1)] = len(inside)
    return counts


def split_by_arch(text):
    """ptxas -v's report of a compilation for several architectures -> {"80": its lines for sm_80, ...}."""
    parts, cur = {}, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '[^']+' for 'sm_(\d+a?)'", line)
        if m:
            cur = m.group(1)
        if cur is not None:
            parts.setdefault(cur, []).append(line)
    return {a: "\n".join(lines) for a, lines in parts.items()}


def ptxas_usage(text):
    """Entry name -> {regs, stack, spill_stores, spill_loads, smem} from ptxas -v output."""
    usage = {}
    cur = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = usage.setdefault(m.group(1), {"regs": 0, "stack": 0, "spill_stores": 0, "spill_loads": 0,
                                                "smem": 0})
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur["stack"], cur["spill_stores"], cur["spill_loads"] = (int(g) for g in m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["regs"] = int(m.group(1))
        m = re.search(r"(\d+) bytes smem", line)
        if m:
            cur["smem"] = int(m.group(1))
    return usage


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nvcc", default=shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    ap.add_argument("--arch", default="80,90", help="comma-separated compute capabilities (default 80,90)")
    ap.add_argument("--json", help="also write the figures as JSON to this file")
    ap.add_argument("--from-build", metavar="DIR",
                    help="read the PTX and ptxas reports the build left in DIR (BUILD/ptxas-report) instead of "
                         "compiling")
    ap.add_argument("sources", nargs="*", help="kernel sources (default: kernels/*.cu)")
    args = ap.parse_args()

    ptxas = None
    if not args.from_build:
        if not os.path.exists(args.nvcc):
            die(f"nvcc not found at {args.nvcc}: pass --nvcc or put the CUDA toolkit on PATH")
        ptxas = os.path.join(os.path.dirname(args.nvcc), "ptxas")
        if not os.path.exists(ptxas):
            die(f"ptxas not found beside nvcc ({ptxas})")
    sources = args.sources or sorted(glob.glob(os.path.join(root, "kernels", "*.cu")))
    if not sources:
        die("no kernel sources")
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    include = os.path.join(root, "kernels")

    rows, failures = [], []
    with tempfile.TemporaryDirectory(prefix="check_ptxas.") as tmp:
        # A planted file may be named *.cu.txt (so that the build never compiles it): nvcc needs .cu.
        cus = {}
        for src in sources:
            cus[src] = src
            if not src.endswith(".cu"):
                cus[src] = os.path.join(tmp, os.path.basename(src).split(".")[0] + "_planted.cu")
                shutil.copyfile(src, cus[src])

        def compile_one(job):  # (source, arch) -> (its PTX, ptxas -v's report)
            src, arch = job
            cu = cus[src]
            ptx_file = os.path.join(tmp, f"{os.path.basename(cu)}.{arch}.ptx")
            run([args.nvcc, "-std=c++17", "-O3", "-DNDEBUG", "-ptx", f"-arch=compute_{arch}", "-I", include,
                 "-o", ptx_file, cu])
            with open(ptx_file) as f:
                ptx = f.read()
            return ptx, run([ptxas, "-v", f"-arch=sm_{arch}", ptx_file, "-o", os.devnull])

        def from_build(src):  # source -> {arch: (its PTX, ptxas -v's report)} as the build left them
            stem = os.path.basename(src)
            report_file = os.path.join(args.from_build, f"{stem}.ptxas.txt")
            if not os.path.exists(report_file):
                die(f"{report_file} not found: build ms_kernels_cuda first (its launcher, scripts/nvcc_report.sh, "
                    f"writes it), and list {os.path.relpath(src, root)} in kernels/CMakeLists.txt")
            if os.path.getmtime(report_file) < os.path.getmtime(src):
                die(f"{report_file} is older than {os.path.relpath(src, root)}: rebuild ms_kernels_cuda first")
            with open(report_file) as f:
                reports = split_by_arch(f.read())
            out = {}
            for arch in archs:
                ptx_file = os.path.join(args.from_build, f"{stem}.compute_{arch}.ptx")
                if not os.path.exists(ptx_file):
                    die(f"{ptx_file} not found: the build did not compile {stem} for sm_{arch} "
                        f"(CUDA_ARCHITECTURES of ms_kernels_cuda)")
                with open(ptx_file) as f:
                    out[arch] = (f.read(), reports.get(arch, ""))
            return out

        if args.from_build:
            compiled = {(src, arch): got for src in sources for arch, got in from_build(src).items()}
        else:
            # The compilations run in parallel (one per core: most of the check's time), reported in order.
            jobs = [(src, arch) for src in sources for arch in archs]
            with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                futures = [pool.submit(compile_one, job) for job in jobs]
                try:
                    compiled = dict(zip(jobs, [f.result() for f in futures]))
                except CommandFailed as e:
                    die(str(e))
        for src in sources:
            for arch in archs:
                ptx, report = compiled[(src, arch)]
                bounds = max_threads(ptx)
                loop_divs = loop_divisions(ptx)
                usage = ptxas_usage(report)
                names = demangle(sorted(bounds))
                for entry in sorted(bounds):
                    u = usage.get(entry)
                    if u is None:
                        failures.append(f"{names[entry]} (sm_{arch}): ptxas reported nothing for it")
                        continue
                    threads = bounds[entry]
                    name = names[entry]
                    short = name.replace("(anonymous namespace)::", "")
                    short = re.sub(r"^void\s+", "", short)  # templates demangle with their return type
                    short = re.sub(r"\(.*", "", short).replace("ms::kernels::", "")
                    row = dict(source=os.path.relpath(src, root), arch=f"sm_{arch}", kernel=short, threads=threads,
                               **u)
                    regs_alloc = -(-max(u["regs"], 1) // 8) * 8
                    why = []
                    if threads is None:
                        why.append("no __launch_bounds__ (declare the largest block its launcher uses)")
                        row["blocks_per_sm_by_regs"] = None
                    else:
                        warps = -(-threads // 32)
                        per_block = regs_alloc * 32 * warps
                        row["blocks_per_sm_by_regs"] = REGISTER_FILE // per_block if per_block else None
                        if per_block > REGISTER_FILE:
                            why.append(f"{u['regs']} registers x {threads} threads need {per_block} > {REGISTER_FILE}")
                    if u["spill_stores"] or u["spill_loads"]:
                        why.append(f"spills {u['spill_stores']} bytes stored, {u['spill_loads']} bytes loaded")
                    if u["regs"] > MAX_REGS:
                        why.append(f"{u['regs']} registers > {MAX_REGS}")
                    if u["smem"] > STATIC_SHARED_LIMIT:
                        why.append(f"{u['smem']} bytes of static shared memory > {STATIC_SHARED_LIMIT}")
                    if NO_LOOP_DIVISION.match(short) and loop_divs.get(entry, 0):
                        why.append(f"{loop_divs[entry]} integer division(s) inside a loop (a tensor-core attention "
                                   "kernel: divide by a run-time value outside the loop, e.g. GroupDiv)")
                    row["ok"] = not why
                    rows.append(row)
                    if why:
                        failures.append(f"{row['source']}: {short} (sm_{arch}): " + "; ".join(why))

    print(f"{'kernel':<40} {'arch':<6} {'regs':>4} {'threads':>7} {'blk/SM':>6} {'stack':>5} {'spill':>5} "
          f"{'smem':>6}  source")
    for r in rows:
        bps = "-" if r["blocks_per_sm_by_regs"] is None else str(r["blocks_per_sm_by_regs"])
        thr = "none" if r["threads"] is None else str(r["threads"])
        print(f"{r['kernel'][:40]:<40} {r['arch']:<6} {r['regs']:>4} {thr:>7} {bps:>6} {r['stack']:>5} "
              f"{r['spill_stores'] + r['spill_loads']:>5} {r['smem']:>6}  {r['source']}"
              + ("" if r["ok"] else "  FAIL"))
    print(f"blk/SM: blocks per SM the registers allow ({REGISTER_FILE} registers, allocated per warp in units of "
          f"256); stack, spill (stores + loads), smem in bytes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if failures:
        print(f"check_ptxas: {len(failures)} problem(s):", file=sys.stderr)
        for f in failures:
            print(f"  {f}", file=sys.stderr)
        sys.exit(1)
    print(f"check_ptxas: {len(rows)} kernel builds checked ({len(sources)} sources x {len(archs)} architectures): "
          "launch bounds declared, no spills, registers within the launch configuration, no division inside the "
          "tensor-core attention kernels' loops")


if __name__ == "__main__":
    main()
