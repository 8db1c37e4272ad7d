// defines: FragKind, LdsmLaneRow, LdsmLaneCol, LdsmTransposes, FragElemRow, FragElemCol.
// The address arithmetic of the tensor-core attention's fragment loads from shared memory (kernels/attention_tc.cu,
// LoadFrag), kept apart from the kernels so that a host test can check it (tests/kernels/attention_test.cpp).
//
// On the device a 16 x 16 bf16 wmma fragment (m16n16k16) is loaded from shared memory by one ldmatrix.x4: each
// lane gives the address of one 8-element row of one of four 8 x 8 matrices (lane l: row l % 8 of matrix l / 8) and
// receives, in its register j, two elements of matrix j — row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1, or with
// .trans column l / 4, rows 2 (l % 4) and 2 (l % 4) + 1 (PTX ISA, "ldmatrix"). wmma::load_matrix_sync from shared
// memory compiles to generic 32-bit loads instead (LD.E, not even LDS: wmma's builtins take generic pointers),
// four per fragment and, for a row-major B operand, a MOVM transpose per register: 4-8 instructions where
// ldmatrix needs one (measured on the SASS of attention_tc.cu, docs/PERFORMANCE.md).
//
// A fragment's element x[i] of lane l, on sm_80 and sm_90 (the operand layouts of mma.sync m16n8k16, two of which
// make one m16n16k16; AccRow / AccCol in attention_tc.cu are the accumulator's):
//   matrix_a: row m = l / 4 + 8 ((i / 2) % 2), column k = 2 (l % 4) + i % 2 + 8 (i / 4);
//   matrix_b: row k = 2 (l % 4) + i % 2 + 8 ((i / 2) % 2), column n = l / 4 + 8 (i / 4).
// Registers hold elements 2 j and 2 j + 1 (the lower 16 bits the first). The lane addresses below make ldmatrix
// deliver exactly these; the fragment layout probe (FragLayoutsHold) compares ldmatrix's fragments with
// wmma::load_matrix_sync's on the device before any kernel runs.
#pragma once

#if defined(__CUDACC__)
#define MS_LDSM_HD __host__ __device__
#else
#define MS_LDSM_HD
#endif

namespace ms::kernels::ldsm {

// How the 16 x 16 operand lies in shared memory (16 rows at p, p + ld, ...; 16 contiguous bf16 each).
enum class FragKind {
  kARow,  // matrix_a, row_major: memory row = m, column = k
  kACol,  // matrix_a, col_major: memory row = k, column = m
  kBCol,  // matrix_b, col_major: memory row = n, column = k
  kBRow,  // matrix_b, row_major: memory row = k, column = n
};

// ldmatrix transposes where the fragment's register pairs run down a memory column (consecutive k of a B operand
// stored by k rows, consecutive k of an A operand stored by k rows).
MS_LDSM_HD constexpr bool LdsmTransposes(FragKind kind) {
  return kind == FragKind::kACol || kind == FragKind::kBRow;
}

// The memory row and column (0 or 8) of the 8-element row whose address lane gives to ldmatrix.x4. Matrix j =
// lane / 8 lands in register j: for matrix_a registers 0..3 are (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15),
// (m 8-15, k 8-15); for matrix_b (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15).
MS_LDSM_HD constexpr int LdsmLaneRow(FragKind kind, int lane) {
  const int r = lane % 8, j = lane / 8;
  // Memory rows m (kARow) or k (kBRow) step by 8 with j % 2; rows k (kACol) or n (kBCol) with j / 2.
  return r + 8 * ((kind == FragKind::kARow || kind == FragKind::kBRow) ? j % 2 : j / 2);
}
MS_LDSM_HD constexpr int LdsmLaneCol(FragKind kind, int lane) {
  const int j = lane / 8;
  return 8 * ((kind == FragKind::kARow || kind == FragKind::kBRow) ? j / 2 : j % 2);
}

// Where x[i] of lane's fragment lies in memory (row, column of the 16 x 16 block), for the host test and the probe.
MS_LDSM_HD constexpr int FragElemRowOf(bool a, int lane, int i) {  // m of matrix_a, k of matrix_b
  return a ? lane / 4 + 8 * ((i / 2) % 2) : 2 * (lane % 4) + i % 2 + 8 * ((i / 2) % 2);
}
MS_LDSM_HD constexpr int FragElemColOf(bool a, int lane, int i) {  // k of matrix_a, n of matrix_b
  return a ? 2 * (lane % 4) + i % 2 + 8 * (i / 4) : lane / 4 + 8 * (i / 4);
}
MS_LDSM_HD constexpr int FragElemRow(FragKind kind, int lane, int i) {
  const bool a = kind == FragKind::kARow || kind == FragKind::kACol;
  // kARow: (m, k); kACol: (k, m); kBCol: (n, k); kBRow: (k, n).
  return (kind == FragKind::kARow || kind == FragKind::kBRow) ? FragElemRowOf(a, lane, i) : FragElemColOf(a, lane, i);
}
MS_LDSM_HD constexpr int FragElemCol(FragKind kind, int lane, int i) {
  const bool a = kind == FragKind::kARow || kind == FragKind::kACol;
  return (kind == FragKind::kARow || kind == FragKind::kBRow) ? FragElemColOf(a, lane, i) : FragElemRowOf(a, lane, i);
}

}  // namespace ms::kernels::ldsm

#undef MS_LDSM_HD
