#!/usr/bin/env bash
# Build here what a lent GPU machine runs, and pack it into one file to carry there (docs/PERFORMANCE.md, "When a
# GPU is lent"). The device tool's machines have the CUDA 13 toolkit, CMake, ninja and Python, but none of the
# Debian libraries megascale links (yaml-cpp, fmt, hiredis, Gloo, oneDNN, libfabric, sentencepiece) and no
# redis-server, and nothing can be installed there; a build there would also spend minutes of a 15-minute budget.
# So the CUDA build is made here (nvcc 13, sm_80 + sm_90) and packed with what it needs beyond the C and C++
# runtimes and the CUDA libraries, which the GPU machine has:
#   bin/           megascale, kernels_bench, test_kernels_gpu, test_cuda_backend_gpu, redis-server
#   lib/           every shared library those load, but glibc's, libstdc++ / libgcc_s and CUDA's (cudart, cuBLAS,
#                  cuBLASLt, NCCL, the driver); libfabric too, which megascale loads at run time (dlopen)
#   lib/fallback/  this machine's libstdc++ and libgcc_s, for a GPU machine whose own are older
#   tests.json     ctest -L gpu --show-only=json-v1 of the build (scripts/gpu_tests.py runs them there)
#   corpus/        the fortune files the training tests prepare their data from (tests/cuda/gpus.py; the GPU
#                  machine has no /usr/share/games/fortunes): the first 4 in name order, ~0.6 MB
#   MANIFEST.json  commit, build and source directories, glibc, CUDA, the libraries and their sizes
# and makes data/ (the demo corpus, scripts/make_demo_data.sh with the build's megascale) when it is missing or stale.
# Then it checks the bundle in a root that has glibc, libstdc++ and the CUDA libraries alone (chroot, when run as
# root): every program loads, and megascale trains configs/tiny.yaml for two steps on the CPU backend (two ranks:
# redis-server, Gloo, the data loader).
#   scripts/gpu_bundle.sh [--build-dir DIR] [--out FILE] [--no-build] [--no-check]
#     --build-dir  the CUDA build (default build-gpu: Release, -DMS_GPU_TESTS=ON)
#     --out        the packed bundle (default gpu-bundle.tar.xz; at most 40 MiB, so that it, the tree and data/
#                  travel within the device tool's 64 MiB)
#     --no-build   pack the build directory as it is
#     --no-check   skip the chroot check
set -euo pipefail
cd "$(dirname "$0")/.."
build=build-gpu
out=gpu-bundle.tar.xz
do_build=1
do_check=1
while (($#)); do
  case "$1" in
    --build-dir) build="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --no-build) do_build=0; shift ;;
    --no-check) do_check=0; shift ;;
    *) echo "gpu_bundle: unknown argument '$1' (usage: scripts/gpu_bundle.sh [--build-dir DIR] [--out FILE]" \
         "[--no-build] [--no-check])" >&2; exit 2 ;;
  esac
done
die() { echo "gpu_bundle: $*" >&2; exit 1; }
command -v /usr/local/cuda/bin/nvcc >/dev/null || die "nvcc is not at /usr/local/cuda/bin/nvcc: the bundle is a CUDA build"
redis=$(command -v redis-server) || die "redis-server is not installed (scripts/setup.sh)"
programs=(megascale kernels_bench test_kernels_gpu test_cuda_backend_gpu)
if ((do_build)); then
  echo "== building ${build}/ (Release, CUDA, GPU tests): ${programs[*]}"
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMS_WITH_CUDA=ON -DMS_GPU_TESTS=ON >/dev/null
  cmake --build "$build" -j "$(nproc)" --target "${programs[@]}"
fi
[[ -f $build/CMakeCache.txt ]] || die "$build is not a CMake build directory (drop --no-build)"
grep -q '^MS_GPU_TESTS:BOOL=ON' "$build/CMakeCache.txt" || die "$build was configured without -DMS_GPU_TESTS=ON"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
b=$stage/gpu-bundle
mkdir -p "$b/bin" "$b/lib/fallback"
for p in "${programs[@]}"; do
  f=$(find "$build" -name "$p" -type f -perm -u+x -print -quit)
  [[ -n $f ]] || die "$p was not built in $build"
  cp "$f" "$b/bin/$p"
done
# redis-server is a link to redis-check-rdb, which acts on the name it is started by: copy it as redis-server.
cp "$(readlink -f "$redis")" "$b/bin/redis-server"

# What the GPU machine provides: glibc, the C++ runtime and CUDA's libraries (the driver's libcuda included).
provided='^(linux-vdso\.so|ld-linux-x86-64\.so|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libresolv\.so|libutil\.so|libstdc\+\+\.so|libgcc_s\.so|libcuda\.so|libcudart\.so|libcublas\.so|libcublasLt\.so|libnccl\.so|libcudnn[a-z_]*\.so)'
copy_needed() {  # the libraries file $1 loads, but those the GPU machine provides, into lib/
  local missing
  missing=$(ldd "$1" | grep 'not found' || true)
  [[ -z $missing ]] || die "$(basename "$1") has libraries not found here: $missing"
  while read -r name _ path _; do
    [[ $name =~ $provided ]] && continue
    [[ -n $path && -f $path ]] || continue
    [[ -f $b/lib/$name ]] || cp "$(readlink -f "$path")" "$b/lib/$name"
  done < <(ldd "$1" | grep '=>')
}
for p in "$b"/bin/*; do copy_needed "$p"; done
# Loaded at run time (dlopen), so ldd does not list it: libfabric (lib/fabric, megascale self-check) and what it loads.
for name in libfabric.so.1; do
  path=$(ldconfig -p | awk -v n="$name" '$1 == n && /x86-64/ {print $NF; exit}')
  [[ -n $path ]] || die "$name is not installed here (scripts/setup.sh)"
  cp "$(readlink -f "$path")" "$b/lib/$name"
  copy_needed "$b/lib/$name"
done
for name in libstdc++.so.6 libgcc_s.so.1; do
  cp "$(readlink -f "$(ldconfig -p | awk -v n="$name" '$1 == n && /x86-64/ {print $NF; exit}')")" "$b/lib/fallback/$name"
done

ctest --test-dir "$build" -L gpu --show-only=json-v1 >"$b/tests.json"
mkdir -p "$b/corpus"
mapfile -t fortunes < <(find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' | LC_ALL=C sort |
  head -n 4)
((${#fortunes[@]} == 4)) || die "fewer than 4 fortune files in /usr/share/games/fortunes (scripts/setup.sh)"
cp "${fortunes[@]}" "$b/corpus/"
python3 - "$b" "$build" "$(pwd)" <<'PY'
import json, os, platform, subprocess, sys
b, build, src = sys.argv[1], os.path.abspath(sys.argv[2]), sys.argv[3]
def run(*c):
    try:
        return subprocess.run(c, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""
tests = json.load(open(os.path.join(b, "tests.json")))["tests"]
libs = {n: os.path.getsize(os.path.join(b, "lib", n)) for n in sorted(os.listdir(os.path.join(b, "lib")))
        if os.path.isfile(os.path.join(b, "lib", n))}
manifest = {
    "commit": run("git", "rev-parse", "HEAD"), "dirty": bool(run("git", "status", "--porcelain", "-uno")),
    "built_on": platform.node(), "source_dir": src, "build_dir": build,
    "glibc": platform.libc_ver()[1], "nvcc": run("/usr/local/cuda/bin/nvcc", "--version").splitlines()[-1],
    "cuda_architectures": "80;90", "programs": sorted(os.listdir(os.path.join(b, "bin"))), "libraries": libs,
    "tests": [t["name"] for t in tests],
}
json.dump(manifest, open(os.path.join(b, "MANIFEST.json"), "w"), indent=1)
print(f"gpu_bundle: {len(manifest['programs'])} programs, {len(libs)} libraries, {len(tests)} GPU tests "
      f"({', '.join(manifest['tests'])}); built from {manifest['commit'][:12]}{' (dirty tree)' if manifest['dirty'] else ''}")
PY
tar -C "$stage" -cJf "$out.tmp" gpu-bundle
mv "$out.tmp" "$out"
size=$(stat -c %s "$out")
echo "gpu_bundle: $out, $((size / 1024 / 1024)) MiB ($(du -sh "$b" | cut -f1) unpacked)"
((size <= 40 * 1024 * 1024)) || die "$out is over 40 MiB: it would not travel with the tree and data/ (64 MiB)"
# data/: the corpus gpu_check.sh's train stage reads (carried beside the bundle), made with this build's megascale
# (a new machine has no build/).
scripts/make_demo_data.sh "$build/megascale" >/dev/null || die "making data/ with $build/megascale failed (above)"
echo "gpu_bundle: data/fortunes.{bin,idx} ready ($(du -sh data | cut -f1)): carry [\"data\", \"$out\"]"

if ((do_check)); then
  if [[ $(id -u) != 0 ]] || ! command -v unshare >/dev/null; then
    echo "gpu_bundle: not root: the chroot check is skipped (run as root, or check on the GPU machine)"
    exit 0
  fi
  # A root with glibc, the C++ runtime and CUDA's libraries alone (hard links where the file system allows),
  # the bundle unpacked in /b, the demo corpus and a two-step CPU job: what the GPU machine has, less its GPU.
  root=$stage/root
  mkdir -p "$root"/{lib64,lib/x86_64-linux-gnu,cuda,b,tmp,proc,dev,etc}
  chmod 1777 "$root/tmp"
  cp /lib64/ld-linux-x86-64.so.2 "$root/lib64/"
  for p in "$b"/bin/*; do
    ldd "$p" | awk '/=>/ {print $1, $3}'
  done | sort -u | while read -r name path; do
    [[ $name =~ $provided && -n $path ]] || continue
    case $name in
      libc\.so*|libm\.so*|libdl\.so*|libpthread\.so*|librt\.so*|libresolv\.so*|libutil\.so*|libstdc++*|libgcc_s*)
        cp "$(readlink -f "$path")" "$root/lib/x86_64-linux-gnu/$name" ;;
      *) ln "$(readlink -f "$path")" "$root/cuda/$name" 2>/dev/null || cp "$(readlink -f "$path")" "$root/cuda/$name" ;;
    esac
  done
  tar -C "$root" -xJf "$out"
  mv "$root/gpu-bundle"/* "$root/b/"
  mkdir -p "$root/job/configs" "$root/job/data"
  cp data/fortunes.* "$root/job/data/"
  cp configs/tiny.yaml "$root/job/configs/"
  cp /etc/passwd /etc/group /etc/hosts "$root/etc/"
  echo "== chroot check: the bundle in a root with glibc, libstdc++ and CUDA's libraries alone"
  unshare -m --propagation private bash -c '
    set -e
    root=$1
    mount -t proc proc "$root/proc"
    mount --rbind /dev "$root/dev"
    in_root() { LD_LIBRARY_PATH=/b/lib:/cuda PATH=/b/bin HOME=/tmp "$(command -v chroot)" "$root" "$@"; }
    in_root /b/bin/megascale --version
    in_root /b/bin/redis-server --version
    in_root /b/bin/kernels_bench --roofline-only --preset gpu-configs | tail -n 2
    in_root /b/bin/test_kernels_gpu --list-test-cases | tail -n 1
    in_root /b/bin/test_cuda_backend_gpu --list-test-cases | tail -n 1
    in_root /b/bin/megascale train /job/configs/tiny.yaml --no-progress --set train.steps=2 \
      --set optimizer.warmup_steps=0 --set log.run_dir=/tmp/run
  ' _ "$root" || die "the chroot check failed (above): the bundle lacks something the GPU machine will not have"
  echo "gpu_bundle: chroot check passed"
fi
