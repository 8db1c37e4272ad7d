#!/usr/bin/env bash
# Installs every Debian package megascale's build, tests and demo need.
# Usage: scripts/setup.sh [--with-torch]   (--with-torch adds python3-torch and python3-yaml: the test oracle, the PyTorch baseline)
# Idempotent: packages already installed are skipped without touching apt.
set -euo pipefail

pkgs=(
  cmake ninja-build g++ pkg-config         # build
  clang-format                             # ctest format: scripts/check_format.sh against .clang-format
  libcli11-dev libyaml-cpp-dev libfmt-dev   # CLI, job spec, formatting
  libhiredis-dev redis-server               # bootstrap store
  libgloo-dev libfabric-dev libfabric-bin   # CPU collectives, fabric (fi_pingpong: scripts/bench_fault.sh)
  libdnnl-dev                               # CPU GEMMs (oneDNN)
  doctest-dev                               # unit tests
  libsentencepiece-dev                      # subword tokenizer (prepare-data --tokenizer bpe|unigram|X.model)
  fortunes-min fortunes                     # demo corpus
  python3                                   # test scripts
  slurmctld slurmd slurm-client munge       # the multi-node Slurm test cluster (tests/slurm)
  iproute2 util-linux procps                # its network namespaces (ip, nsenter, unshare), pgrep
  chromium                                  # headless browser: tests/report opens megascale report's page
)
if [[ "${1:-}" == "--with-torch" ]]; then
  pkgs+=(python3-torch python3-numpy python3-yaml)
fi

# NVIDIA's cuobjdump (with the nvdisasm it runs), from PyPI (the CUDA toolkit here has none), where nvcc is present:
# ctest kernels_sass reads the tensor-core attention's SASS with it (scripts/sass_mix.py). Installed once into
# /opt/megascale/cuobjdump (root) or ~/.cache/megascale/cuobjdump (python3-pip, below, brings pip where python3 has
# none); a machine without nvcc skips it.
have_nvcc=0
if command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]]; then have_nvcc=1; fi
install_cuobjdump() {
  local dir=/opt/megascale/cuobjdump
  if [[ $(id -u) -ne 0 ]]; then dir=$HOME/.cache/megascale/cuobjdump; fi
  if ((have_nvcc == 0)) || command -v cuobjdump >/dev/null || [[ -x /usr/local/cuda/bin/cuobjdump ]] ||
     [[ -x $dir/nvidia/cu13/bin/cuobjdump && -x $dir/nvidia/cu13/bin/nvdisasm ]]; then
    return 0
  fi
  echo "setup: installing cuobjdump and nvdisasm (PyPI nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm) into $dir"
  python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore --break-system-packages \
    --upgrade --target "$dir" nvidia-cuda-cuobjdump==13.5.37 nvidia-cuda-nvdisasm==13.5.37
}
if ((have_nvcc == 1)) && ! python3 -m pip --version >/dev/null 2>&1; then pkgs+=(python3-pip); fi

missing=()
for p in "${pkgs[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]} == 0)); then
  echo "setup: all ${#pkgs[@]} packages present"
  install_cuobjdump
  exit 0
fi
echo "setup: installing ${missing[*]}"
sudo_cmd=()
if [[ $(id -u) -ne 0 ]]; then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
install_cuobjdump
