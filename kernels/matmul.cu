// defines: gemm_bf16_kernel and its launcher GemmBf16.
// A tiled GEMM on tensor cores through nvcuda::wmma (m16n16k16, bf16 inputs, fp32 accumulation):
//   - a block computes a 64 x 64 tile of C with 4 warps in a 2 x 2 arrangement, each warp owning a 32 x 32
//     sub-tile = 2 x 2 accumulator fragments;
//   - K advances 32 at a time: the A and B tiles are copied from global into shared memory as they are
//     stored (a transposed operand stays transposed and is read by a col_major fragment), with 16-byte
//     vector loads where the whole 8-element chunk is in bounds and aligned, and zeros past the matrix
//     edges (any M, N, K, lda, ldb); each warp then runs 2 k-steps of 2 x 2 mma_sync from shared memory;
//   - the epilogue stores the accumulators to shared memory, then every thread applies alpha/beta to
//     its elements of C with bounds checks (coalesced along N; beta == 0 never reads C).
// Rows of the shared tiles are padded by 16 bytes: ldm stays a multiple of 16 bytes, every fragment's
// first element is 32-byte aligned (the shared-array macros align arrays to 32 bytes), and consecutive
// rows start in different banks.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common.cuh"
#include "kernels.h"

namespace ms::kernels {

namespace wmma = nvcuda::wmma;

namespace {

constexpr int kBM = 64;        // block tile rows (M)
constexpr int kBN = 64;        // block tile columns (N)
constexpr int kBK = 32;        // K per shared-memory stage
constexpr int kWarpTile = 32;  // each warp: 32 x 32 of C = 2 x 2 fragments
constexpr int kFrag = 16;      // m = n = k of the wmma shape
constexpr int kFragsPerWarp = kWarpTile / kFrag;
constexpr int kWarpsN = kBN / kWarpTile;
constexpr int kThreads = 32 * (kBM / kWarpTile) * kWarpsN;  // 128
// Padding of every shared row: 16 bytes.
constexpr int kPadBf16 = 8;
constexpr int kPadF32 = 4;
// bf16 elements per 16-byte vector load.
constexpr int kChunk = 8;

static_assert(kBM % kWarpTile == 0 && kBN % kWarpTile == 0 && kBK % kFrag == 0, "tiles must split into fragments");

// Copies 16 bytes (both addresses 16-byte aligned).
__device__ __forceinline__ void Copy16Bytes(__nv_bfloat16* dst, const __nv_bfloat16* src) {
#if MS_SIM_EMULATION
  std::memcpy(dst, src, 16);
#else
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#endif
}

// Copies a kRows x kCols tile (in storage order: rows along the leading dimension) of the row-major matrix
// g (rows x cols, leading dimension ld) starting at (row0, col0) into s, zero-filling what lies outside.
// vec: ld and g allow 16-byte loads of aligned 8-element chunks.
template <int kRows, int kCols>
__device__ __forceinline__ void LoadTile(__nv_bfloat16 (*s)[kCols + kPadBf16], const __nv_bfloat16* g, int64_t ld,
                                         int64_t row0, int64_t col0, int64_t rows, int64_t cols, bool vec) {
  constexpr int kChunksPerRow = kCols / kChunk;
  const __nv_bfloat16 zero = __float2bfloat16(0.0f);
  for (int i = threadIdx.x; i < kRows * kChunksPerRow; i += kThreads) {
    const int r = i / kChunksPerRow, c = i % kChunksPerRow * kChunk;
    const int64_t gr = row0 + r, gc = col0 + c;
    __nv_bfloat16* dst = &s[r][c];
    if (gr < rows && gc + kChunk <= cols && vec) {
      Copy16Bytes(dst, g + gr * ld + gc);
    } else {
      MS_UNROLL
      for (int e = 0; e < kChunk; ++e) dst[e] = gr < rows && gc + e < cols ? g[gr * ld + gc + e] : zero;
    }
  }
}

// One block per 64 x 64 tile of C: blockIdx.x along M, blockIdx.y along N.
template <bool kTransA, bool kTransB>
__global__ void __launch_bounds__(kThreads)
    gemm_bf16_kernel(int64_t M, int64_t N, int64_t K, float alpha, const __nv_bfloat16* A, int64_t lda,
                     const __nv_bfloat16* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  // Shared tiles as stored in global memory: A (m, k) or, transposed, (k, m); B (k, n) or (n, k).
  constexpr int kARows = kTransA ? kBK : kBM, kACols = kTransA ? kBM : kBK;
  constexpr int kBRows = kTransB ? kBN : kBK, kBCols = kTransB ? kBK : kBN;
  constexpr int kLdA = kACols + kPadBf16, kLdB = kBCols + kPadBf16, kLdC = kBN + kPadF32;
  using LayoutA = std::conditional_t<kTransA, wmma::col_major, wmma::row_major>;
  using LayoutB = std::conditional_t<kTransB, wmma::col_major, wmma::row_major>;
  MS_SHARED_ARRAY2D(__nv_bfloat16, sA, kARows, kLdA);
  MS_SHARED_ARRAY2D(__nv_bfloat16, sB, kBRows, kLdB);
  MS_SHARED_ARRAY2D(float, sC, kBM, kLdC);

  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kBM, n0 = static_cast<int64_t>(blockIdx.y) * kBN;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int wm = warp / kWarpsN * kWarpTile, wn = warp % kWarpsN * kWarpTile;  // the warp's sub-tile
  const bool vec_a = lda % kChunk == 0 && reinterpret_cast<uintptr_t>(A) % 16 == 0;
  const bool vec_b = ldb % kChunk == 0 && reinterpret_cast<uintptr_t>(B) % 16 == 0;

  wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float> acc[kFragsPerWarp][kFragsPerWarp];
  MS_UNROLL
  for (int i = 0; i < kFragsPerWarp; ++i) {
    MS_UNROLL
    for (int j = 0; j < kFragsPerWarp; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
  }

  for (int64_t k0 = 0; k0 < K; k0 += kBK) {
    if constexpr (kTransA) {
      LoadTile<kARows, kACols>(sA, A, lda, k0, m0, K, M, vec_a);
    } else {
      LoadTile<kARows, kACols>(sA, A, lda, m0, k0, M, K, vec_a);
    }
    if constexpr (kTransB) {
      LoadTile<kBRows, kBCols>(sB, B, ldb, n0, k0, N, K, vec_b);
    } else {
      LoadTile<kBRows, kBCols>(sB, B, ldb, k0, n0, K, N, vec_b);
    }
    __syncthreads();
    MS_UNROLL
    for (int kk = 0; kk < kBK; kk += kFrag) {
      wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, __nv_bfloat16, LayoutA> a[kFragsPerWarp];
      wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, __nv_bfloat16, LayoutB> b[kFragsPerWarp];
      MS_UNROLL
      for (int i = 0; i < kFragsPerWarp; ++i) {
        const int m = wm + i * kFrag;
        if constexpr (kTransA) {
          wmma::load_matrix_sync(a[i], &sA[kk][m], kLdA);
        } else {
          wmma::load_matrix_sync(a[i], &sA[m][kk], kLdA);
        }
      }
      MS_UNROLL
      for (int j = 0; j < kFragsPerWarp; ++j) {
        const int n = wn + j * kFrag;
        if constexpr (kTransB) {
          wmma::load_matrix_sync(b[j], &sB[n][kk], kLdB);
        } else {
          wmma::load_matrix_sync(b[j], &sB[kk][n], kLdB);
        }
      }
      MS_UNROLL
      for (int i = 0; i < kFragsPerWarp; ++i) {
        MS_UNROLL
        for (int j = 0; j < kFragsPerWarp; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
      }
    }
    __syncthreads();  // the tiles are overwritten by the next stage
  }

  MS_UNROLL
  for (int i = 0; i < kFragsPerWarp; ++i) {
    MS_UNROLL
    for (int j = 0; j < kFragsPerWarp; ++j) {
      wmma::store_matrix_sync(&sC[wm + i * kFrag][wn + j * kFrag], acc[i][j], kLdC, wmma::mem_row_major);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kBM * kBN; i += kThreads) {
    const int r = i / kBN, c = i % kBN;
    const int64_t gm = m0 + r, gn = n0 + c;
    if (gm >= M || gn >= N) continue;
    float* out = C + gm * ldc + gn;
    const float v = alpha * sC[r][c];
    *out = beta == 0.0f ? v : v + beta * *out;
  }
}

}  // namespace

// ---- launchers ----

cudaError_t GemmBf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const __nv_bfloat16* A,
                     int64_t lda, const __nv_bfloat16* B, int64_t ldb, float beta, float* C, int64_t ldc,
                     cudaStream_t stream) {
  auto at_least_1 = [](int64_t v) { return v < 1 ? int64_t{1} : v; };
  if (M < 0 || N < 0 || K < 0 || lda < at_least_1(trans_a ? M : K) || ldb < at_least_1(trans_b ? K : N) ||
      ldc < at_least_1(N)) {
    return cudaErrorInvalidValue;
  }
  if (M == 0 || N == 0) return cudaSuccess;
  const int64_t tiles_m = (M + kBM - 1) / kBM, tiles_n = (N + kBN - 1) / kBN;
  if (tiles_m > 2147483647 || tiles_n > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(tiles_m), static_cast<unsigned>(tiles_n));
  if (trans_a) {
    if (trans_b) {
      MS_LAUNCH((gemm_bf16_kernel<true, true>), grid, kThreads, 0, stream, M, N, K, alpha, A, lda, B, ldb, beta, C,
                ldc);
    } else {
      MS_LAUNCH((gemm_bf16_kernel<true, false>), grid, kThreads, 0, stream, M, N, K, alpha, A, lda, B, ldb, beta, C,
                ldc);
    }
  } else {
    if (trans_b) {
      MS_LAUNCH((gemm_bf16_kernel<false, true>), grid, kThreads, 0, stream, M, N, K, alpha, A, lda, B, ldb, beta, C,
                ldc);
    } else {
      MS_LAUNCH((gemm_bf16_kernel<false, false>), grid, kThreads, 0, stream, M, N, K, alpha, A, lda, B, ldb, beta, C,
                ldc);
    }
  }
  return cudaGetLastError();
}

}  // namespace ms::kernels
