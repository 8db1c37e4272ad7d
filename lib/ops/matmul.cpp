// Fast GEMM and linear layers: oneDNN's sgemm plus OpenMP loops for the bias terms.
#include <dnnl.h>  // defines: dnnl_sgemm

#include <algorithm>
#include <cstring>

#include "ops/kernels_cpu.h"
#include "ops/ops.h"

namespace ms::ops {
namespace {

constexpr int64_t kColBlock = 64;  // columns per task in column reductions

}  // namespace

void Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // op(A) @ op(B) is zero: only the beta term remains
#pragma omp parallel for schedule(static) if (M * N > internal::kParallelMin)
    for (int64_t i = 0; i < M; ++i) {
      float* c = C + i * ldc;
      if (beta == 0.0f) {
        std::fill(c, c + N, 0.0f);
      } else {
        for (int64_t j = 0; j < N; ++j) c[j] *= beta;
      }
    }
    return;
  }
  const dnnl_status_t st =
      dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  // oneDNN only refuses strides that break the documented preconditions; the reference loops give the
  // defined answer for any stride rather than leaving C untouched.
  if (st != dnnl_success) ref::Gemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void MatmulForward(float* out, const float* inp, const float* w, const float* bias, int64_t N, int64_t IC, int64_t OC) {
  if (N <= 0 || OC <= 0) return;
  if (bias) {
#pragma omp parallel for schedule(static) if (N * OC > internal::kParallelMin)
    for (int64_t i = 0; i < N; ++i) std::memcpy(out + i * OC, bias, sizeof(float) * OC);
  }
  // out (N, OC) = inp (N, IC) @ w^T, w stored (OC, IC).
  Gemm(false, true, N, OC, IC, 1.0f, inp, IC, w, IC, bias ? 1.0f : 0.0f, out, OC);
}

void MatmulBackward(float* dinp, float* dw, float* dbias, const float* dout, const float* inp, const float* w,
                    int64_t N, int64_t IC, int64_t OC) {
  // dinp (N, IC) += dout (N, OC) @ w (OC, IC)
  if (dinp) Gemm(false, false, N, IC, OC, 1.0f, dout, OC, w, IC, 1.0f, dinp, IC);
  // dw (OC, IC) += dout^T @ inp, dout stored (N, OC)
  Gemm(true, false, OC, IC, N, 1.0f, dout, OC, inp, IC, 1.0f, dw, IC);
  if (dbias && N > 0) {
    // Column sums: each task owns a block of columns and walks the rows in order (thread-count independent).
    const int64_t nblocks = (OC + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (N * OC > internal::kParallelMin)
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      const int64_t c0 = blk * kColBlock;
      const int64_t nc = std::min(kColBlock, OC - c0);
      double acc[kColBlock] = {};
      for (int64_t i = 0; i < N; ++i) {
        const float* row = dout + i * OC + c0;
#pragma omp simd
        for (int64_t j = 0; j < nc; ++j) acc[j] += row[j];
      }
      for (int64_t j = 0; j < nc; ++j) dbias[c0 + j] = static_cast<float>(dbias[c0 + j] + acc[j]);
    }
  }
}

}  // namespace ms::ops
