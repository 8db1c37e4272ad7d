"""What the GPU variants of the tests/cuda scripts share."""
import glob
import os
import subprocess
import sys


def fortune_corpus(n=4):
    """The first n fortune text files in name order: from $MS_TEST_CORPUS (a GPU machine without Debian's fortunes:
    scripts/gpu_bundle.sh packs them, scripts/gpu_tests.py sets it), else /usr/share/games/fortunes."""
    src = os.environ.get("MS_TEST_CORPUS") or "/usr/share/games/fortunes"
    files = sorted(f for f in glob.glob(os.path.join(src, "*")) if os.path.isfile(f) and not f.endswith((".dat", ".u8")))
    if len(files) < n:
        sys.exit(f"{len(files)} fortune files in {src}, {n} needed: install fortunes-min and fortunes "
                 "(scripts/setup.sh), or set MS_TEST_CORPUS to a folder of text files")
    return files[:n]


def gpu_count():
    """GPUs nvidia-smi lists (0 without a driver)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))
