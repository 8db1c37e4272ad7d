#!/usr/bin/env python3
"""Checks a safetensors file written by megascale's export against expected raw tensors.

usage: check_safetensors.py MODEL.safetensors EXPECTED_DIR
EXPECTED_DIR holds index.txt ("name dim dim ..." per line) and <name>.f32 (raw little-endian fp32).
The file is parsed by hand (the safetensors package is not needed): u64 LE header length, JSON
header, data. Exit 0: match; 1: mismatch; 77: numpy missing (skip). When torch is importable the
tensors are also loaded through torch.frombuffer and compared.
"""
import json
import os
import struct
import sys

try:
    import numpy as np
except ImportError:
    print("numpy not available: skipping")
    sys.exit(77)


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def main():
    path, expected_dir = sys.argv[1], sys.argv[2]
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    if (8 + n) % 8:
        fail(f"data start {8 + n} is not 8-byte aligned")
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        fail(f"__metadata__ must be a dict of strings: {meta!r}")
    if meta.get("source") != "megascale" or "step" not in meta:
        fail(f"unexpected metadata {meta!r}")

    # data_offsets: contiguous, in order, covering the whole data section.
    spans = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items())
    pos = 0
    for b, e, k in spans:
        if b != pos or e < b:
            fail(f"{k}: data_offsets [{b}, {e}] do not follow the previous tensor (at {pos})")
        pos = e
    if pos != len(data):
        fail(f"tensors cover {pos} bytes of a {len(data)}-byte data section")

    expected = {}
    with open(os.path.join(expected_dir, "index.txt")) as f:
        for line in f:
            parts = line.split()
            if parts:
                expected[parts[0]] = [int(x) for x in parts[1:]]
    if set(expected) != set(header):
        fail(f"tensor names differ: missing {set(expected) - set(header)}, extra {set(header) - set(expected)}")

    try:
        import torch
    except ImportError:
        torch = None
    for name, shape in expected.items():
        info = header[name]
        if info["dtype"] != "F32":
            fail(f"{name}: dtype {info['dtype']}")
        if list(info["shape"]) != shape:
            fail(f"{name}: shape {info['shape']}, expected {shape}")
        b, e = info["data_offsets"]
        got = np.frombuffer(data[b:e], dtype="<f4").reshape(shape)
        want = np.fromfile(os.path.join(expected_dir, name + ".f32"), dtype="<f4").reshape(shape)
        if got.tobytes() != want.tobytes():
            fail(f"{name}: values differ (max abs diff {np.max(np.abs(got - want))})")
        if torch is not None:
            t = torch.frombuffer(bytearray(data[b:e]), dtype=torch.float32).reshape(shape)
            if not torch.equal(t, torch.from_numpy(want.copy())):
                fail(f"{name}: torch view differs")
    print(f"ok: {len(expected)} tensors match{' (numpy and torch)' if torch is not None else ' (numpy)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
