"""What the GPU variants of the tests/cuda scripts share."""
import subprocess


def gpu_count():
    """GPUs nvidia-smi lists (0 without a driver)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))
