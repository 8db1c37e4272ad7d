// defines: layernorm_forward_kernel, residual_layernorm_forward_kernel, layernorm_backward_kernel,
// layernorm_param_grad_kernel and their launchers (LayerNormForward, ResidualLayerNormForward, LayerNormBackward,
// LayerNormBackwardScratchFloats).
// LayerNorm over the last dim, as ms::ops::LayerNormForward/Backward (biased variance, rstd saved).
#include "common.cuh"
#include "kernels.h"

namespace ms::kernels {

// Forward: a warp per row (no block barrier, no shared memory), kLnForwardThreads / 32 rows per block.
constexpr int kLnForwardThreads = 256;
constexpr int kLnForwardRows = kLnForwardThreads / 32;
// Backward: a block of kLnBackwardThreads (8 warps) per chunk of kLnBackwardRows rows: G = ceil(N / 16) blocks,
// fixed by N only (never by the GPU), so the reduction order is too. N = 16K rows give 1024 blocks (7.75 per SM
// of an H100); the partials are 3 * G * C floats (3 N C / 16): dw, db and the column sums of dx.
constexpr int kLnBackwardThreads = 256;
constexpr int kLnBackwardWarps = kLnBackwardThreads / 32;
constexpr int64_t kLnBackwardRows = 16;
// Final dw/db reduction: blocks of 32 columns x 32 lanes over the G block partials.
constexpr int kLnParamCols = 32;
constexpr int kLnParamLanes = 32;
constexpr int kLnParamThreads = kLnParamCols * kLnParamLanes;

// ---- kernels ----

// The forward kernels give lane l of a row's warp the column quads q = l, l + 32, ... (columns 4q .. 4q + 3 below C),
// and it visits its columns in that order in every pass. kVec: C % 4 == 0 and every pointer aligned for 4 elements
// (16 bytes in fp32, 8 in bf16): a quad is one load or store; otherwise the same columns one element at a time, in
// the same order: the same bits, aligned or not.

// One element of the normalized row: the same expression in both paths (and so the same contraction into FMAs).
__device__ __forceinline__ float LnNormalize(float x, float m, float s, float w, float b) {
  return (x - m) * s * w + b;
}
__device__ __forceinline__ float LnSquare(float acc, float x, float m) {
  const float d = x - m;
  return acc + d * d;
}

// Row `row` of a LayerNorm forward, by its warp, from `sum`, this lane's sum of its columns of xr (in its order):
// mean and variance by warp butterflies (every lane the same bits), then the normalized row into out (unless null)
// and its bf16 rounding into out16 (unless null). Each lane reads back only its own columns of xr.
template <bool kVec>
__device__ __forceinline__ void LayerNormWarpRow(float sum, const float* xr, float* out, __nv_bfloat16* out16,
                                                 float* mean, float* rstd, const float* w, const float* b, int C,
                                                 float eps, long row, int lane) {
  const float m = WarpSum(sum) / C;
  float var = 0.0f;
  for (int q = lane; 4 * q < C; q += 32) {
    if constexpr (kVec) {
      const float4 v = LoadQuad(xr + 4 * q);
      var = LnSquare(LnSquare(LnSquare(LnSquare(var, v.x, m), v.y, m), v.z, m), v.w, m);
    } else {
      for (int c = 4 * q; c < 4 * q + 4 && c < C; ++c) var = LnSquare(var, xr[c], m);
    }
  }
  const float s = rsqrtf(WarpSum(var) / C + eps);
  float* o = out ? out + row * C : nullptr;
  __nv_bfloat16* o16 = out16 ? out16 + row * C : nullptr;
  for (int q = lane; 4 * q < C; q += 32) {
    if constexpr (kVec) {
      const float4 v = LoadQuad(xr + 4 * q), wv = LoadQuad(w + 4 * q), bv = LoadQuad(b + 4 * q);
      const float4 y = make_float4(LnNormalize(v.x, m, s, wv.x, bv.x), LnNormalize(v.y, m, s, wv.y, bv.y),
                                   LnNormalize(v.z, m, s, wv.z, bv.z), LnNormalize(v.w, m, s, wv.w, bv.w));
      if (o) *reinterpret_cast<float4*>(o + 4 * q) = y;
      if (o16) StoreQuadBf16(o16 + 4 * q, y);
    } else {
      for (int c = 4 * q; c < 4 * q + 4 && c < C; ++c) {
        const float y = LnNormalize(xr[c], m, s, w[c], b[c]);
        if (o) o[c] = y;
        if (o16) o16[c] = __float2bfloat16_rn(y);
      }
    }
  }
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

// A warp per row (row = blockIdx.x * kLnForwardRows + warp), LayerNormWarpRow. out, x: (N, C); w, b: (C); mean,
// rstd: (N); out16: (N, C) or null; out may be null when out16 is not.
template <bool kVec>
__global__ void __launch_bounds__(kLnForwardThreads)
    layernorm_forward_kernel(float* out, __nv_bfloat16* out16, float* mean, float* rstd, const float* x, const float* w,
                             const float* b, long N, int C, float eps) {
  const int lane = threadIdx.x % 32;
  const long row = static_cast<long>(blockIdx.x) * kLnForwardRows + threadIdx.x / 32;
  if (row >= N) return;  // the whole warp: nothing below waits for another warp
  const float* xr = x + row * C;
  float sum = 0.0f;
  for (int q = lane; 4 * q < C; q += 32) {
    if constexpr (kVec) {
      const float4 v = LoadQuad(xr + 4 * q);
      sum = (((sum + v.x) + v.y) + v.z) + v.w;
    } else {
      for (int c = 4 * q; c < 4 * q + 4 && c < C; ++c) sum += xr[c];
    }
  }
  LayerNormWarpRow<kVec>(sum, xr, out, out16, mean, rstd, w, b, C, eps, row, lane);
}

// One element of the residual stream: x + part (+ rbias) (+ rbias2), as ew_residual_add_kernel computes it.
__device__ __forceinline__ float LnResidual(float x, float part, const float* rbias, const float* rbias2, int c) {
  float v = x + part;
  if (rbias != nullptr) v += rbias[c];
  if (rbias2 != nullptr) v += rbias2[c];
  return v;
}

// The residual add fused into the LayerNorm that reads its result: res = x + part (+ rbias) (+ rbias2), as
// ew_residual_add_kernel computes it, stored and summed in one pass, then LayerNormWarpRow over the row just stored
// (each lane reads back its own columns: no barrier, and no read of res from memory by another pass). The bits
// of ResidualAdd then LayerNormForward. res: (N, C) (may equal x); part: (N, C); rbias, rbias2: (C) or null. P:
// part's type, float or __nv_bfloat16 (runtime.activations: bf16, the projection GEMM's output kept in bf16: widened
// exactly, the bits of the fp32 kernel on the widened values).
template <typename P, bool kVec>
__global__ void __launch_bounds__(kLnForwardThreads)
    residual_layernorm_forward_kernel(float* res, float* out, __nv_bfloat16* out16, float* mean, float* rstd,
                                      const float* x, const P* part, const float* rbias, const float* rbias2,
                                      const float* w, const float* b, long N, int C, float eps) {
  const int lane = threadIdx.x % 32;
  const long row = static_cast<long>(blockIdx.x) * kLnForwardRows + threadIdx.x / 32;
  if (row >= N) return;
  const float* xr = x + row * C;
  const P* pr = part + row * C;
  float* rr = res + row * C;
  float sum = 0.0f;
  for (int q = lane; 4 * q < C; q += 32) {
    if constexpr (kVec) {
      const int c = 4 * q;
      const float4 xv = LoadQuad(xr + c), pv = LoadQuad(pr + c);
      const float4 v =
          make_float4(LnResidual(xv.x, pv.x, rbias, rbias2, c), LnResidual(xv.y, pv.y, rbias, rbias2, c + 1),
                      LnResidual(xv.z, pv.z, rbias, rbias2, c + 2), LnResidual(xv.w, pv.w, rbias, rbias2, c + 3));
      *reinterpret_cast<float4*>(rr + c) = v;
      sum = (((sum + v.x) + v.y) + v.z) + v.w;
    } else {
      for (int c = 4 * q; c < 4 * q + 4 && c < C; ++c) {
        const float v = LnResidual(xr[c], Widen(pr[c]), rbias, rbias2, c);
        rr[c] = v;
        sum += v;
      }
    }
  }
  LayerNormWarpRow<kVec>(sum, rr, out, out16, mean, rstd, w, b, C, eps, row, lane);
}

// Block g handles rows [16 g, 16 g + 16) of the N: (1) warp w computes dx of rows 16 g + w, 16 g + w + 8 (lane l
// for columns l, l + 32, ...; the two row sums by warp butterflies: no block barrier); (2) thread t sums, for its
// columns c = t, t + 256, ..., dw = sum dout * xhat and db = sum dout over the block's rows in row order, in
// registers, and writes them once: partial (G, 3, C) (WRITES [g][0] and [g][1]). (2) reads only inputs (the rows (1)
// just read, so mostly cache hits), so the two parts need no barrier between them. With sum_dx, (2) also sums the
// accumulated dx the block's warps wrote in (1), after a barrier, into [g][2]. G: dout's type, float or
// __nv_bfloat16 (runtime.activations: bf16, the LayerNorm input gradient written by its GEMM in bf16: widened exactly,
// the bits of the fp32 kernel on the widened values).
template <typename G, bool kVec>
__global__ void __launch_bounds__(kLnBackwardThreads)
    layernorm_backward_kernel(float* dx, __nv_bfloat16* dx16, float* partial, const G* dout, const float* x,
                              const float* w, const float* mean, const float* rstd, int64_t N, int64_t C, bool sum_dx) {
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kLnBackwardRows;
  const int64_t r1 = r0 + kLnBackwardRows < N ? r0 + kLnBackwardRows : N;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t row = r0 + warp; row < r1; row += kLnBackwardWarps) {  // (1) dx, a warp per row
    const float* xr = x + row * C;
    const G* gr = dout + row * C;
    const float m = mean[row], s = rstd[row];
    float sum_dnorm = 0.0f, sum_dnorm_xhat = 0.0f;
    float* dxr = dx + row * C;
    if constexpr (kVec) {  // 4 columns at a time: lane l takes columns 4 l .. 4 l + 3, then 128 further on
      for (int64_t c = 4 * lane; c < C; c += 128) {
        const float4 xv = LoadQuad(xr + c), gv = LoadQuad(gr + c), wv = LoadQuad(w + c);
        const float xh[4] = {(xv.x - m) * s, (xv.y - m) * s, (xv.z - m) * s, (xv.w - m) * s};
        const float dn[4] = {gv.x * wv.x, gv.y * wv.y, gv.z * wv.z, gv.w * wv.w};
        MS_UNROLL
        for (int i = 0; i < 4; ++i) {
          sum_dnorm += dn[i];
          sum_dnorm_xhat += dn[i] * xh[i];
        }
      }
      const float mean_dnorm = WarpSum(sum_dnorm) / C;
      const float mean_dnorm_xhat = WarpSum(sum_dnorm_xhat) / C;
      for (int64_t c = 4 * lane; c < C; c += 128) {
        const float4 xv = LoadQuad(xr + c), gv = LoadQuad(gr + c), wv = LoadQuad(w + c);
        float4 d = LoadQuad(dxr + c);
        d.x += s * (gv.x * wv.x - mean_dnorm - (xv.x - m) * s * mean_dnorm_xhat);
        d.y += s * (gv.y * wv.y - mean_dnorm - (xv.y - m) * s * mean_dnorm_xhat);
        d.z += s * (gv.z * wv.z - mean_dnorm - (xv.z - m) * s * mean_dnorm_xhat);
        d.w += s * (gv.w * wv.w - mean_dnorm - (xv.w - m) * s * mean_dnorm_xhat);
        *reinterpret_cast<float4*>(dxr + c) = d;
        if (dx16) StoreQuadBf16(dx16 + row * C + c, d);  // the accumulated values
      }
    } else {
      for (int64_t c = lane; c < C; c += 32) {
        const float xhat = (xr[c] - m) * s;
        const float dnorm = Widen(gr[c]) * w[c];
        sum_dnorm += dnorm;
        sum_dnorm_xhat += dnorm * xhat;
      }
      const float mean_dnorm = WarpSum(sum_dnorm) / C;
      const float mean_dnorm_xhat = WarpSum(sum_dnorm_xhat) / C;
      for (int64_t c = lane; c < C; c += 32) {
        const float xhat = (xr[c] - m) * s;
        const float dnorm = Widen(gr[c]) * w[c];
        dxr[c] += s * (dnorm - mean_dnorm - xhat * mean_dnorm_xhat);
        if (dx16) dx16[row * C + c] = __float2bfloat16_rn(dxr[c]);  // the accumulated value
      }
    }
  }
  float* pdw = partial + static_cast<int64_t>(blockIdx.x) * 3 * C;
  float* pdb = pdw + C;
  if (sum_dx) {  // block-uniform: (2) reads the dx rows other warps wrote in (1)
    __syncthreads();
    float* pdx = pdb + C;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      float sd = 0.0f;
      for (int64_t row = r0; row < r1; ++row) sd += dx[row * C + c];
      pdx[c] = sd;
    }
  }
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {  // (2) this block's dw/db partials, rows in order
    float sw = 0.0f, sb = 0.0f;
    for (int64_t row = r0; row < r1; ++row) {
      const float g = Widen(dout[row * C + c]);
      sw += g * ((x[row * C + c] - mean[row]) * rstd[row]);
      sb += g;
    }
    pdw[c] = sw;
    pdb[c] = sb;
  }
}

// dw (blockIdx.y == 0), db (== 1) or dsum and, unless null, dsum2 (== 2) [c] += sum over g of
// partial[g][blockIdx.y][c]. Block (32, 32): column c = blockIdx.x * 32 + threadIdx.x; lane y sums g = y, y + 32, ...
// in order, thread (x, 0) adds the 32 lane sums in lane order: deterministic.
__global__ void __launch_bounds__(kLnParamThreads)
    layernorm_param_grad_kernel(float* dw, float* db, float* dsum, float* dsum2, const float* partial, int64_t G,
                                int64_t C) {
  MS_SHARED_ARRAY2D(float, lanes, kLnParamLanes, kLnParamCols + 1);
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kLnParamCols + threadIdx.x;
  const int which = blockIdx.y;
  float acc = 0.0f;
  if (c < C) {
    for (int64_t g = threadIdx.y; g < G; g += kLnParamLanes) acc += partial[(g * 3 + which) * C + c];
  }
  lanes[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float sum = 0.0f;
    for (int k = 0; k < kLnParamLanes; ++k) sum += lanes[k][threadIdx.x];
    if (which == 2) {
      dsum[c] += sum;
      if (dsum2) dsum2[c] += sum;
    } else {
      float* out = which == 0 ? dw : db;
      out[c] += sum;
    }
  }
}

// ---- launchers ----

namespace {
int64_t BackwardBlocks(int64_t N) {  // G
  return (N + kLnBackwardRows - 1) / kLnBackwardRows;
}
unsigned ForwardBlocks(int64_t N) {
  return static_cast<unsigned>((N + kLnForwardRows - 1) / kLnForwardRows);
}
// A null pointer counts as aligned (it is never dereferenced).
bool Aligned(const void* p, unsigned bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}
}  // namespace

cudaError_t LayerNormForward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b,
                             int64_t N, int64_t C, float eps, cudaStream_t stream, __nv_bfloat16* out16) {
  if (out == nullptr && out16 == nullptr) return cudaErrorInvalidValue;  // the output would be written nowhere
  if (N <= 0 || C <= 0) return cudaSuccess;
  const unsigned grid = ForwardBlocks(N);
  if (C % 4 == 0 && Aligned(x, 16) && Aligned(w, 16) && Aligned(b, 16) && Aligned(out, 16) && Aligned(out16, 8)) {
    MS_LAUNCH(layernorm_forward_kernel<true>, grid, kLnForwardThreads, 0, stream, out, out16, mean, rstd, x, w, b,
              static_cast<long>(N), static_cast<int>(C), eps);
  } else {
    MS_LAUNCH(layernorm_forward_kernel<false>, grid, kLnForwardThreads, 0, stream, out, out16, mean, rstd, x, w, b,
              static_cast<long>(N), static_cast<int>(C), eps);
  }
  return cudaGetLastError();
}

namespace {
template <typename P>
cudaError_t ResidualLayerNormForwardT(float* res, float* out, float* mean, float* rstd, const float* x, const P* part,
                                      const float* rbias, const float* rbias2, const float* w, const float* b,
                                      int64_t N, int64_t C, float eps, cudaStream_t stream, __nv_bfloat16* out16) {
  if (out == nullptr && out16 == nullptr) return cudaErrorInvalidValue;  // the output would be written nowhere
  if (N <= 0 || C <= 0) return cudaSuccess;
  const unsigned grid = ForwardBlocks(N);
  if (C % 4 == 0 && Aligned(res, 16) && Aligned(x, 16) && Aligned(part, 4 * sizeof(P)) && Aligned(rbias, 16) &&
      Aligned(rbias2, 16) && Aligned(w, 16) && Aligned(b, 16) && Aligned(out, 16) && Aligned(out16, 8)) {
    MS_LAUNCH((residual_layernorm_forward_kernel<P, true>), grid, kLnForwardThreads, 0, stream, res, out, out16, mean,
              rstd, x, part, rbias, rbias2, w, b, static_cast<long>(N), static_cast<int>(C), eps);
  } else {
    MS_LAUNCH((residual_layernorm_forward_kernel<P, false>), grid, kLnForwardThreads, 0, stream, res, out, out16, mean,
              rstd, x, part, rbias, rbias2, w, b, static_cast<long>(N), static_cast<int>(C), eps);
  }
  return cudaGetLastError();
}
}  // namespace

cudaError_t ResidualLayerNormForward(float* res, float* out, float* mean, float* rstd, const float* x,
                                     const float* part, const float* rbias, const float* rbias2, const float* w,
                                     const float* b, int64_t N, int64_t C, float eps, cudaStream_t stream,
                                     __nv_bfloat16* out16) {
  return ResidualLayerNormForwardT(res, out, mean, rstd, x, part, rbias, rbias2, w, b, N, C, eps, stream, out16);
}

cudaError_t ResidualLayerNormForward(float* res, float* out, float* mean, float* rstd, const float* x,
                                     const __nv_bfloat16* part, const float* rbias, const float* rbias2, const float* w,
                                     const float* b, int64_t N, int64_t C, float eps, cudaStream_t stream,
                                     __nv_bfloat16* out16) {
  if (part == nullptr) return cudaErrorInvalidValue;
  return ResidualLayerNormForwardT(res, out, mean, rstd, x, part, rbias, rbias2, w, b, N, C, eps, stream, out16);
}

int64_t LayerNormBackwardScratchFloats(int64_t N, int64_t C) {
  return 3 * BackwardBlocks(N) * C;
}

namespace {
template <typename T>
cudaError_t LayerNormBackwardT(float* dx, float* dw, float* db, float* scratch, const T* dout, const float* x,
                               const float* w, const float* mean, const float* rstd, int64_t N, int64_t C,
                               cudaStream_t stream, __nv_bfloat16* dx16, float* dsum, float* dsum2) {
  if (dsum2 != nullptr && dsum == nullptr) return cudaErrorInvalidValue;
  if (N <= 0 || C <= 0) return cudaSuccess;
  const int64_t G = BackwardBlocks(N);
  const bool sum_dx = dsum != nullptr;
  // The vector path: C a multiple of 4 and every row 16-byte aligned (dout and dx16 8-byte where bf16).
  if (C % 4 == 0 && Aligned(dx, 16) && Aligned(x, 16) && Aligned(w, 16) && Aligned(dout, 4 * sizeof(T)) &&
      Aligned(dx16, 8)) {
    MS_LAUNCH((layernorm_backward_kernel<T, true>), static_cast<unsigned>(G), kLnBackwardThreads, 0, stream, dx, dx16,
              scratch, dout, x, w, mean, rstd, N, C, sum_dx);
  } else {
    MS_LAUNCH((layernorm_backward_kernel<T, false>), static_cast<unsigned>(G), kLnBackwardThreads, 0, stream, dx, dx16,
              scratch, dout, x, w, mean, rstd, N, C, sum_dx);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>((C + kLnParamCols - 1) / kLnParamCols), sum_dx ? 3 : 2);
  MS_LAUNCH(layernorm_param_grad_kernel, grid, dim3(kLnParamCols, kLnParamLanes), 0, stream, dw, db, dsum, dsum2,
            static_cast<const float*>(scratch), G, C);
  return cudaGetLastError();
}
}  // namespace

cudaError_t LayerNormBackward(float* dx, float* dw, float* db, float* scratch, const float* dout, const float* x,
                              const float* w, const float* mean, const float* rstd, int64_t N, int64_t C,
                              cudaStream_t stream, __nv_bfloat16* dx16, float* dsum, float* dsum2) {
  return LayerNormBackwardT(dx, dw, db, scratch, dout, x, w, mean, rstd, N, C, stream, dx16, dsum, dsum2);
}

cudaError_t LayerNormBackward(float* dx, float* dw, float* db, float* scratch, const __nv_bfloat16* dout,
                              const float* x, const float* w, const float* mean, const float* rstd, int64_t N,
                              int64_t C, cudaStream_t stream, __nv_bfloat16* dx16, float* dsum, float* dsum2) {
  if (dout == nullptr) return cudaErrorInvalidValue;
  return LayerNormBackwardT(dx, dw, db, scratch, dout, x, w, mean, rstd, N, C, stream, dx16, dsum, dsum2);
}

}  // namespace ms::kernels
