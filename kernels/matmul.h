// Launcher of kernels/matmul.cu: a tiled bf16 GEMM on tensor cores (nvcuda::wmma m16n16k16, fp32
// accumulation), and the wmma probe the kernel tests use to check the wmma semantics (emulator and GPU).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace ms::kernels {

// C (M, N) = alpha * op(A) @ op(B) + beta * C, all row-major, A and B bf16, C fp32, fp32 accumulation; same
// transpose and leading-dimension conventions as ms::ops::Gemm (lib/ops/ops.h). beta == 0 overwrites C.
//   A: (M, K) with lda >= K, or stored (K, M) with lda >= M if trans_a;
//   B: (K, N) with ldb >= N, or stored (N, K) with ldb >= K if trans_b;  C: ldc >= N.
// Any sizes and leading dimensions (tails are zero-padded in shared memory); 16-byte vector loads where
// the rows allow them. K == 0 scales C by beta. Returns cudaErrorInvalidValue for negative sizes or too
// small leading dimensions (nothing launched); M == 0 or N == 0 is a no-op.
cudaError_t GemmBf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const __nv_bfloat16* A,
                     int64_t lda, const __nv_bfloat16* B, int64_t ldb, float beta, float* C, int64_t ldc,
                     cudaStream_t stream);

}  // namespace ms::kernels
