#!/usr/bin/env python3
"""Independent reader/writer of Megatron-LM MMIDIDX (version 1) indexed datasets, numpy only.

Follows the layout of megatron/core/datasets/indexed_dataset.py (re-implemented, not copied):
  .idx = b"MMIDIDX\\x00\\x00" | version <Q = 1 | dtype code <B | sequence_count <Q | document_count <Q
         | sizes int32[S] | pointers int64[S] | document_indices int64[document_count]
  .bin = tokens back to back.

Usage:
  megatron_idx.py read PREFIX            prints a summary of the dataset (key value per line)
  megatron_idx.py write PREFIX DTYPE     writes a test dataset (DTYPE uint16 or int32) whose tokens follow
                                         token(i, j) = (i * 7919 + j * 104729) % VOCAB, and prints its summary
"""
import struct
import sys

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
VOCAB = {"uint16": 50000, "int32": 100000}


def read(prefix):
    with open(prefix + ".idx", "rb") as f:
        assert f.read(9) == HEADER, "bad magic"
        (version,) = struct.unpack("<Q", f.read(8))
        assert version == 1, version
        (code,) = struct.unpack("<B", f.read(1))
        (seqs,) = struct.unpack("<Q", f.read(8))
        (docs,) = struct.unpack("<Q", f.read(8))
        offset = f.tell()
    idx = np.memmap(prefix + ".idx", mode="r", order="C")
    sizes = np.frombuffer(idx, dtype=np.int32, count=seqs, offset=offset)
    pointers = np.frombuffer(idx, dtype=np.int64, count=seqs, offset=offset + sizes.nbytes)
    doc_idx = np.frombuffer(idx, dtype=np.int64, count=docs, offset=offset + sizes.nbytes + pointers.nbytes)
    dtype = CODES[code]
    binf = np.memmap(prefix + ".bin", mode="r", order="C")
    seq = [np.frombuffer(binf, dtype=dtype, count=int(s), offset=int(p)) for s, p in zip(sizes, pointers)]
    stream = np.concatenate(seq).astype(np.int64) if seq else np.zeros(0, np.int64)
    assert doc_idx[0] == 0 and doc_idx[-1] == seqs and np.all(np.diff(doc_idx) >= 0)
    return {
        "dtype": code,
        "sequences": seqs,
        "documents": docs - 1,
        "tokens": int(sizes.astype(np.int64).sum()),
        "sum": int(stream.sum()),
        "weighted": int((stream * (np.arange(len(stream), dtype=np.int64) % 1000 + 1)).sum()),
        "max": int(stream.max()) if len(stream) else -1,
        "head": ",".join(str(int(t)) for t in stream[:10]),
    }


def write(prefix, dtype_name):
    dtype = {"uint16": np.uint16, "int32": np.int32}[dtype_name]
    code = {np.uint16: 8, np.int32: 4}[dtype]
    vocab = VOCAB[dtype_name]
    n = 37
    sizes = [(i * 13) % 29 for i in range(n)]  # includes empty sequences
    seqs = [np.array([(i * 7919 + j * 104729) % vocab for j in range(s)], dtype=dtype) for i, s in enumerate(sizes)]
    pointers = np.concatenate([[0], np.cumsum([a.nbytes for a in seqs])[:-1]]).astype(np.int64)
    doc_idx = np.array(list(range(0, n, 3)) + [n], dtype=np.int64)  # 3 sequences per document
    with open(prefix + ".bin", "wb") as f:
        for a in seqs:
            f.write(a.tobytes(order="C"))
    with open(prefix + ".idx", "wb") as f:
        f.write(HEADER)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", n))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(np.array(sizes, dtype=np.int32).tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(doc_idx.tobytes(order="C"))


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "read":
        summary = read(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "write":
        write(sys.argv[2], sys.argv[3])
        summary = read(sys.argv[2])
    else:
        sys.exit(__doc__)
    for key, value in summary.items():
        print(key, value)


if __name__ == "__main__":
    main()
