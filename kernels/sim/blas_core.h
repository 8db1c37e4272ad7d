// kernels/sim/blas_core.h: what the emulated cuBLAS (cublas.cpp) and cuBLASLt (cublaslt.cpp) share — bf16
// conversions, the packing of op(A) and op(B), and the multiplication every emulated GEMM runs (each element
// accumulates its k products in order, in fp32), which hands each finished accumulator to a sink that applies
// alpha / beta and the epilogue and stores it. Emulated builds only; not for kernels or tests.
#pragma once

#include <cuda_runtime_api.h>
#include <library_types.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace ms::sim::blas {

inline float Bf16ToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t FloatToBf16(float f) {  // round to nearest even; NaN stays a (quiet) NaN
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float RoundToBf16(float f) {
  return Bf16ToFloat(FloatToBf16(f));
}

inline size_t ElementBytes(cudaDataType t) {
  return t == CUDA_R_16BF ? 2 : 4;
}

inline float Load(const void* base, cudaDataType type, int64_t index) {
  if (type == CUDA_R_16BF) return Bf16ToFloat(static_cast<const uint16_t*>(base)[index]);
  return static_cast<const float*>(base)[index];
}

// v stored as `type` (fp32, or bf16 rounded to nearest even).
inline void StoreAs(void* base, cudaDataType type, int64_t index, float v) {
  if (type == CUDA_R_16BF) {
    static_cast<uint16_t*>(base)[index] = FloatToBf16(v);
  } else {
    static_cast<float*>(base)[index] = v;
  }
}

// Bytes spanned by a column-major rows x cols matrix with leading dimension ld (0 when empty).
inline size_t Extent(int64_t rows, int64_t cols, int64_t ld, cudaDataType type) {
  if (rows <= 0 || cols <= 0) return 0;
  return static_cast<size_t>((cols - 1) * ld + rows) * ElementBytes(type);
}

// One column-major product op(A) (m x k) . op(B) (k x n); trans_a / trans_b: the operand is stored transposed.
struct Operands {
  bool trans_a, trans_b;
  int64_t m, n, k;
  const void* A;
  cudaDataType Atype;
  int64_t lda;
  const void* B;
  cudaDataType Btype;
  int64_t ldb;
};

// op(A) packed as ap[p * m + i], op(B) as bp[j * k + p]: both contiguous in the inner loops. round_inputs: each
// element rounded to bf16 first (CUBLAS_COMPUTE_32F_FAST_16BF on fp32 operands).
inline void Pack(const Operands& g, bool round_inputs, std::vector<float>& ap, std::vector<float>& bp) {
  const int64_t m = g.m, n = g.n, k = g.k;
  ap.resize(static_cast<size_t>(m * k));
  bp.resize(static_cast<size_t>(k * n));
  if (!g.trans_a) {  // A is m x k: A(i, p) = A[i + p * lda]
    for (int64_t p = 0; p < k; ++p)
      for (int64_t i = 0; i < m; ++i) ap[p * m + i] = Load(g.A, g.Atype, i + p * g.lda);
  } else {  // A is k x m: op(A)(i, p) = A[p + i * lda]
    for (int64_t i = 0; i < m; ++i)
      for (int64_t p = 0; p < k; ++p) ap[p * m + i] = Load(g.A, g.Atype, p + i * g.lda);
  }
  if (!g.trans_b) {  // B is k x n: B(p, j) = B[p + j * ldb]
    for (int64_t j = 0; j < n; ++j)
      for (int64_t p = 0; p < k; ++p) bp[j * k + p] = Load(g.B, g.Btype, p + j * g.ldb);
  } else {  // B is n x k: op(B)(p, j) = B[j + p * ldb]
    for (int64_t p = 0; p < k; ++p)
      for (int64_t j = 0; j < n; ++j) bp[j * k + p] = Load(g.B, g.Btype, j + p * g.ldb);
  }
  if (round_inputs) {
    for (float& x : ap) x = RoundToBf16(x);
    for (float& x : bp) x = RoundToBf16(x);
  }
}

// Rows i0 .. i0 + ib of JB columns j0.. from the packed operands: each element accumulates its k products in order,
// in fp32; JB columns at a time so that every load of op(A) serves JB products. sink(i, j, acc) stores element (i, j).
constexpr int64_t kRowBlock = 64;
template <int JB, class Sink>
void Block(int64_t m, int64_t k, const float* ap, const float* bp, int64_t i0, int64_t ib, int64_t j0,
           const Sink& sink) {
  float acc[JB][kRowBlock] = {};
  const float* b[JB];
  for (int jj = 0; jj < JB; ++jj) b[jj] = bp + (j0 + jj) * k;
  for (int64_t p = 0; p < k; ++p) {
    const float* a = ap + p * m + i0;
    for (int jj = 0; jj < JB; ++jj) {
      const float bv = b[jj][p];
      float* out = acc[jj];
      for (int64_t i = 0; i < ib; ++i) out[i] += a[i] * bv;
    }
  }
  for (int jj = 0; jj < JB; ++jj)
    for (int64_t i = 0; i < ib; ++i) sink(i0 + i, j0 + jj, acc[jj][i]);
}

template <class Sink>
void Multiply(int64_t m, int64_t n, int64_t k, const float* ap, const float* bp, const Sink& sink) {
  for (int64_t i0 = 0; i0 < m; i0 += kRowBlock) {
    const int64_t ib = std::min(kRowBlock, m - i0);
    int64_t j0 = 0;
    for (; j0 + 4 <= n; j0 += 4) Block<4>(m, k, ap, bp, i0, ib, j0, sink);
    for (; j0 < n; ++j0) Block<1>(m, k, ap, bp, i0, ib, j0, sink);
  }
}

inline std::string Where(const char* api, const char* what, const void* p, size_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%p", p);
  return std::string(api) + ": " + what + " (" + std::to_string(bytes) + " bytes at " + buf +
         ") is not inside one cudaMalloc'd buffer (a GPU would fault: a host pointer, a freed buffer, or a wrong "
         "leading dimension / stride?)";
}

}  // namespace ms::sim::blas
