#!/usr/bin/env python3
"""The instruction mix of compiled kernels, from their SASS (no GPU needed).

Counts, per kernel of a cubin, object or static library, the instructions that say how a kernel feeds its tensor
cores: HMMA (tensor-core products), LDSM (ldmatrix fragment loads), LD and ST (generic loads and stores: through a
generic pointer, which costs an address-space check and, for shared memory, gives no 16-byte matrix loads; global
memory's own are LDG / STG), LDS (shared loads), MOVM (register transposes) and the total. Static counts over the whole kernel, not a profile: docs/PERFORMANCE.md,
"Fragment loads by ldmatrix".

    nvcc -std=c++17 -O3 -cubin -arch=sm_90 -I kernels -I . -o /tmp/att.cubin kernels/attention_tc.cu
    python3 scripts/sass_mix.py /tmp/att.cubin [--filter attention_forward_tc] [--cuobjdump PATH]
    python3 scripts/sass_mix.py --check build/.../attention_tc.cu.o   # ctest kernels_sass: exit 1 on a violation

--check: every tensor-core attention kernel (a name ending in _tc_kernel, with HMMA) loads its operand fragments
by ldmatrix — at least one LDSM and no MOVM (the transpose wmma::load_matrix_sync adds to a row-major B operand read
from shared memory, with its generic 32-bit loads) — and makes no generic load or store at all (LD, ST: shared memory
by LDS / STS / LDSM, global by LDG / STG, e.g. __ldg for a pointer the compiler cannot place) — except the one
documented exception: the split dK/dV kernel at D <= 64 on sm_80 (kernels/attention_tc.cu: there ldmatrix's loads
made ptxas spill, so it keeps wmma's).

cuobjdump is not in the CUDA toolkit this project installs; NVIDIA ships it on PyPI
(`python3 -m venv /tmp/cuobj && /tmp/cuobj/bin/pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`; scripts/setup.sh installs both into
/opt/megascale/cuobjdump); the script looks on PATH, in /usr/local/cuda/bin, /opt/megascale/cuobjdump and /tmp/cuobj.
"""
import argparse
import collections
import glob
import re
import shutil
import subprocess
import sys

KEYS = ("HMMA", "LDSM", "LD", "ST", "LDS", "MOVM")
# (kernel name prefix, arch) pairs that keep wmma's own loads on purpose.
WMMA_LOADS_KEPT = (("ms::kernels::attention_dkdv_split_tc_kernel<64>", "sm_80"),)


def find_cuobjdump(given):
    if given:
        return given
    for cand in (shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump",
                 "/opt/megascale/cuobjdump/nvidia/cu13/bin/cuobjdump",
                 *glob.glob("/tmp/cuobj/lib/python3*/site-packages/nvidia/cu*/bin/cuobjdump")):
        if cand and shutil.which(cand):
            return cand
    sys.exit("sass_mix: no cuobjdump (scripts/setup.sh installs it, or pass --cuobjdump)")


def demangle(names):
    filt = shutil.which("c++filt")
    if not filt:
        return names
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("binary", help="a cubin, an object with device code, or a static library")
    ap.add_argument("--check", action="store_true",
                    help="fail unless every tensor-core attention kernel loads its fragments by ldmatrix")
    ap.add_argument("--filter", default="", help="only kernels whose demangled name contains this")
    ap.add_argument("--cuobjdump", help="the cuobjdump to run")
    args = ap.parse_args()
    sass = subprocess.run([find_cuobjdump(args.cuobjdump), "-sass", args.binary], capture_output=True, text=True,
                          check=True).stdout
    arch = "?"
    rows = []
    for chunk in re.split(r"\n(?=\s*(?:code for |Function : ))", sass):
        m = re.match(r"\s*code for (sm_\d+)", chunk)
        if m:
            arch = m.group(1)
            continue
        m = re.match(r"\s*Function : (\S+)", chunk)
        if not m:
            continue
        counts = collections.Counter()
        total = 0
        for op in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", chunk):
            total += 1
            if op.group(1) in KEYS:
                counts[op.group(1)] += 1
        rows.append((m.group(1), arch, counts, total))
    names = demangle([r[0] for r in rows])
    if args.check:
        return check(names, rows)
    print(f"{'kernel':70} {'arch':6} " + " ".join(f"{k:>5}" for k in KEYS) + "  total")
    for name, (_, arch, counts, total) in zip(names, rows):
        if args.filter in name:
            print(f"{name[:70]:70} {arch:6} " + " ".join(f"{counts[k]:5d}" for k in KEYS) + f"  {total:5d}")


def check(names, rows):
    problems, checked = [], 0
    for name, (_, arch, counts, _) in zip(names, rows):
        short = name.split("(")[0].removeprefix("void ")
        if not re.search(r"_tc_kernel(<|$)", short) or counts["HMMA"] == 0:
            continue
        if any(short.startswith(prefix) and arch == a for prefix, a in WMMA_LOADS_KEPT):
            continue
        checked += 1
        if counts["MOVM"] or not counts["LDSM"]:
            problems.append(f"{short} ({arch}): {counts['MOVM']} MOVM, {counts['LDSM']} LDSM for {counts['HMMA']} HMMA: "
                            "an operand fragment loaded without ldmatrix (use LoadFrag, kernels/attention_tc.cu)")
        elif counts["LD"] or counts["ST"]:
            problems.append(f"{short} ({arch}): {counts['LD']} generic LD, {counts['ST']} generic ST: an access through "
                            "a pointer the compiler could not place in shared or global memory (read global memory "
                            "by __ldg, shared by LoadFrag or a pointer into the block's shared memory)")
    for p in sorted(problems):
        print(p)
    if not checked:
        print("sass_mix: no tensor-core kernel found to check")
        return 1
    print(f"sass_mix: {checked} tensor-core kernel(s) checked, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
