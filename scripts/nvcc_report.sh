#!/usr/bin/env bash
# nvcc_report.sh REPORT_DIR NVCC ARGS...: compiler launcher of ms_kernels_cuda (CUDA_COMPILER_LAUNCHER).
#
# Runs the compilation as given, plus `-Xptxas=-v --keep`, and leaves in REPORT_DIR what
# scripts/check_ptxas.py --from-build reads, so that the kernels_ptxas test checks the very code the build
# produced instead of compiling every kernel a second time (that took 2.5 minutes of CI's 2 cores):
#   REPORT_DIR/<object stem>.ptxas.txt          ptxas -v's report (every architecture of the compilation)
#   REPORT_DIR/<object stem>.compute_NN.ptx     the PTX of each architecture (its .maxntid = launch bounds)
# The object stem is the object's file name less .o (kernels/gelu.cu -> gelu.cu). Every other line nvcc
# writes to stderr (warnings, errors) still goes to stderr; the exit status is nvcc's.
set -uo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: nvcc_report.sh REPORT_DIR NVCC ARGS..." >&2
  exit 2
fi
report_dir=$1
shift

obj=""
prev=""
for a in "$@"; do
  [[ "$prev" == "-o" ]] && obj=$a
  prev=$a
done
if [[ -z "$obj" ]]; then  # not a compilation to an object (never the case for ms_kernels_cuda): run it as is
  exec "$@"
fi
stem=$(basename "$obj" .o)

mkdir -p "$report_dir" || exit 1
# nvcc's intermediate files go to a directory of this compilation's own (mktemp's random suffix), removed on exit.
keep=$(mktemp -d -p "$report_dir" ".keep.$stem.tmp.XXXXXXXX") || exit 1
trap 'rm -rf "$keep"' EXIT
"$@" -Xptxas=-v --keep "--keep-dir=$keep" 2>"$keep/stderr"
rc=$?
# ptxas -v's lines (and the property lines that follow them, indented) go to the report; the rest to stderr.
grep -E '^(ptxas info|    [0-9]+ bytes stack frame)' "$keep/stderr" >"$keep/report" || true
grep -v -E '^(ptxas info|    [0-9]+ bytes stack frame)' "$keep/stderr" >&2 || true
if [[ $rc -eq 0 ]]; then
  rm -f "$report_dir/$stem".compute_*.ptx
  for ptx in "$keep"/*.compute_*.ptx; do
    [[ -e "$ptx" ]] || continue
    arch=${ptx##*.compute_}
    mv "$ptx" "$report_dir/$stem.compute_$arch" || rc=1
  done
  mv "$keep/report" "$report_dir/$stem.ptxas.txt" || rc=1
fi
exit $rc
