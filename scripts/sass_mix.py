#!/usr/bin/env python3
"""The instruction mix of compiled kernels, from their SASS (no GPU needed).

Counts, per kernel of a cubin, object or static library, the instructions that say how a kernel feeds its tensor
cores: HMMA (tensor-core products), LDSM (ldmatrix fragment loads), LD (generic loads: through a generic pointer,
which for shared memory costs an address-space check and gives no 16-byte matrix loads), LDS (shared loads), MOVM
(register transposes) and the total. Static counts over the whole kernel, not a profile: docs/PERFORMANCE.md,
"Fragment loads by ldmatrix".

    nvcc -std=c++17 -O3 -cubin -arch=sm_90 -I kernels -I . -o /tmp/att.cubin kernels/attention_tc.cu
    python3 scripts/sass_mix.py /tmp/att.cubin [--filter attention_forward_tc] [--cuobjdump PATH]

cuobjdump is not in the CUDA toolkit this project installs; NVIDIA ships it on PyPI
(`python3 -m venv /tmp/cuobj && /tmp/cuobj/bin/pip install nvidia-cuda-cuobjdump`); the script looks on PATH, in
/usr/local/cuda/bin and in /tmp/cuobj.
"""
import argparse
import collections
import glob
import re
import shutil
import subprocess
import sys

KEYS = ("HMMA", "LDSM", "LD", "LDS", "MOVM")


def find_cuobjdump(given):
    if given:
        return given
    for cand in (shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump",
                 *glob.glob("/tmp/cuobj/lib/python3*/site-packages/nvidia/cu*/bin/cuobjdump")):
        if cand and shutil.which(cand):
            return cand
    sys.exit("sass_mix: no cuobjdump (pip install nvidia-cuda-cuobjdump into a venv, or pass --cuobjdump)")


def demangle(names):
    filt = shutil.which("c++filt")
    if not filt:
        return names
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("binary", help="a cubin, an object with device code, or a static library")
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
    print(f"{'kernel':70} {'arch':6} " + " ".join(f"{k:>5}" for k in KEYS) + "  total")
    for name, (_, arch, counts, total) in zip(names, rows):
        if args.filter in name:
            print(f"{name[:70]:70} {arch:6} " + " ".join(f"{counts[k]:5d}" for k in KEYS) + f"  {total:5d}")


if __name__ == "__main__":
    main()
