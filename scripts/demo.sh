#!/usr/bin/env bash
# Sets up a machine, builds megascale, makes the demo corpus (Debian's fortunes) and trains
# configs/tiny.yaml on the CPU backend. This is the README's first command.
#   scripts/demo.sh [extra args for `megascale train`, e.g. --set train.steps=50]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target megascale
bash scripts/make_demo_data.sh build/megascale
exec build/megascale train configs/tiny.yaml "$@"
