#!/usr/bin/env bash
# Builds the demo corpus data/fortunes.{bin,idx} (byte tokenizer) from Debian's fortune files
# (packages fortunes-min and fortunes, /usr/share/games/fortunes/*: the text files, not *.dat/*.u8).
# Usage: scripts/make_demo_data.sh [MEGASCALE]   (default: build/megascale)
# Idempotent: does nothing when both outputs exist and are newer than every input.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
megascale="${1:-$repo/build/megascale}"
src=/usr/share/games/fortunes
out="$repo/data/fortunes"

# Regular files only (the *.u8 entries are symlinks to them); sorted for a deterministic order.
mapfile -t inputs < <(find "$src" -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' | LC_ALL=C sort)
if ((${#inputs[@]} == 0)); then
  echo "make_demo_data: no fortune files in $src; install them: sudo apt-get install fortunes-min fortunes" >&2
  exit 1
fi

if [[ -f "$out.bin" && -f "$out.idx" ]]; then
  stale=0
  for f in "${inputs[@]}"; do
    if [[ "$f" -nt "$out.bin" || "$f" -nt "$out.idx" ]]; then
      stale=1
      break
    fi
  done
  if ((stale == 0)); then
    echo "make_demo_data: $out.{bin,idx} up to date (${#inputs[@]} input files)"
    exit 0
  fi
fi

if [[ ! -x "$megascale" ]]; then
  echo "make_demo_data: $megascale is not an executable; build it first (cmake -S . -B build -G Ninja && ninja -C build)" >&2
  exit 1
fi
mkdir -p "$repo/data"
echo "make_demo_data: ${#inputs[@]} files, $(cat "${inputs[@]}" | wc -c) bytes -> $out.{bin,idx}"
"$megascale" prepare-data --doc-separator % --overwrite --output "$out" "${inputs[@]}"
