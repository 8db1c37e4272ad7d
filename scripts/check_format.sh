#!/usr/bin/env bash
# Checks that C++ and CUDA sources follow the committed .clang-format (ctest format; docs/ARCHITECTURE.md,
# "Conventions"). It changes nothing: a file that is off is named with the lines clang-format would change, and
# the command that fixes it.
# Usage: scripts/check_format.sh [files...]   (default: every *.cpp, *.h, *.cu, *.cuh git tracks, or, outside a
# git checkout, every such file under cmd/ lib/ kernels/ bench/ tests/). Exit 1 when a file is off, 2 when
# clang-format is missing (scripts/setup.sh installs Debian's clang-format).
# MS_CLANG_FORMAT picks the program (default: clang-format on PATH).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
fmt=${MS_CLANG_FORMAT:-clang-format}
if ! command -v "$fmt" >/dev/null; then
  echo "check_format: $fmt not found; install it with scripts/setup.sh (Debian package clang-format)" >&2
  exit 2
fi

files=()
if [[ $# -gt 0 ]]; then
  files=("$@")
elif git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  while IFS= read -r -d '' f; do files+=("$root/$f"); done < <(git -C "$root" ls-files -z -- \
    '*.cpp' '*.h' '*.cu' '*.cuh')
else
  while IFS= read -r -d '' f; do files+=("$f"); done < <(find "$root"/cmd "$root"/lib "$root"/kernels \
    "$root"/bench "$root"/tests \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) -print0)
fi
if ((${#files[@]} == 0)); then
  echo "check_format: no source files found under $root" >&2
  exit 1
fi

# The style file is the project's, also for a file given from elsewhere (the planted one of format_catches).
style="file:$root/.clang-format"
off=()
for f in "${files[@]}"; do
  if [[ ! -f $f ]]; then
    echo "check_format: $f: no such file" >&2
    exit 1
  fi
  # --assume-filename keeps the language clang-format infers from the real name (a planted .cu.txt is CUDA).
  name=${f%.txt}
  if ! out=$("$fmt" --style="$style" --assume-filename="$name" <"$f"); then
    echo "check_format: $fmt failed on $f" >&2
    exit 1
  fi
  if [[ "$out" != "$(cat "$f")" ]]; then
    off+=("$f")
    echo "${f#"$root"/}: not formatted; clang-format would change:" >&2
    diff <(cat "$f") <(printf '%s\n' "$out") | head -20 | sed 's/^/    /' >&2 || true
  fi
done

if ((${#off[@]} > 0)); then
  echo "check_format: ${#off[@]} of ${#files[@]} files are not formatted ($("$fmt" --version | head -1))." >&2
  echo "  Fix (from $root): clang-format -i ${off[*]#"$root"/}" >&2
  exit 1
fi
echo "check_format: ${#files[@]} files formatted as .clang-format says ($("$fmt" --version | head -1))"
