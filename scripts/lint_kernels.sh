#!/usr/bin/env bash
# Lint for CUDA kernel sources (kernels/*.cu, kernels/*.cuh, tests/kernels/*.cu), the rules that keep them
# runnable under the SIMT emulator (kernels/sim/simt.h, docs/cuda.md):
#   - no bare __shared__: shared memory only through MS_SHARED_ARRAY / MS_SHARED_ARRAY2D / MS_DYNAMIC_SHARED
#     (a bare one is one object per block on the GPU but a per-thread local or a cross-block static on the host);
#   - no thread_local, no mutable static (static variables other than const/constexpr): state that the
#     emulator would share across blocks and launches, and AddressSanitizer would not see;
#   - no <<< launch outside the MS_LAUNCH macro definition (launches go through MS_LAUNCH so the emulator
#     can run them).
# Usage: scripts/lint_kernels.sh [files...]   (default: the project's kernel sources). Exit 1 on a violation.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
if [[ $# -gt 0 ]]; then
  files=("$@")
else
  shopt -s nullglob
  files=("$root"/kernels/*.cu "$root"/kernels/*.cuh "$root"/tests/kernels/*.cu)
fi

status=0
for f in "${files[@]}"; do
  # Strip // comments and string literals, then check line by line (line numbers preserved).
  while IFS=: read -r line text; do
    why=""
    if [[ "$text" =~ (^|[^A-Za-z0-9_])__shared__([^A-Za-z0-9_]|$) ]]; then
      why="bare __shared__ (use MS_SHARED_ARRAY, MS_SHARED_ARRAY2D or MS_DYNAMIC_SHARED)"
    elif [[ "$text" =~ (^|[^A-Za-z0-9_])thread_local([^A-Za-z0-9_]|$) ]]; then
      why="thread_local in kernel code"
    elif [[ "$text" == *"<<<"* ]]; then
      why="<<< launch outside MS_LAUNCH (use MS_LAUNCH(kernel, grid, block, smem, stream, args...))"
    elif [[ "$text" =~ (^|[^A-Za-z0-9_])static[[:space:]] ]] && ! [[ "$text" =~ static_(cast|assert) ]]; then
      # static const/constexpr data and static functions are fine; anything else is mutable static state.
      if ! [[ "$text" =~ static[[:space:]]+((inline|__device__|__host__|__forceinline__|__global__)[[:space:]]+)*(const|constexpr)[[:space:]] ]] &&
         ! [[ "$text" =~ static[[:space:]][^=\;]*\( ]]; then
        why="mutable static variable in kernel code"
      fi
    fi
    if [[ -n "$why" ]]; then
      echo "$f:$line: $why" >&2
      echo "    $(sed -n "${line}p" "$f" | sed 's/^[[:space:]]*//')" >&2
      status=1
    fi
  done < <(sed -e 's|//.*$||' -e 's|"[^"]*"|""|g' "$f" | grep -n '')
done
if [[ $status -ne 0 ]]; then
  echo "lint_kernels: violations found (see docs/cuda.md, 'Rules for kernel sources')" >&2
fi
exit $status
