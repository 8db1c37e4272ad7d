// kernels/attention_common.cuh: what the fp32 attention kernels (attention.cu) and the bf16 tensor-core ones
// (attention_tc.cu) share: the causal-window predicates, the shape checks of attention.h, the opt-in to more
// than 48 KiB of dynamic shared memory, and the row terms of the backward.
// defines: Sees, Meets, SeesAll, HeadRows, AttentionShape, CheckAttentionShape, AllowSharedBytes; declares
// AttentionRowTerms (defined in attention.cu).
#pragma once

#include <cstdint>

#include "common.cuh"
#include "kernels.h"

namespace ms::kernels::attention_detail {

constexpr size_t kDefaultSharedBytes = 48 * 1024;  // above this, dynamic shared memory must be opted into

// Query t sees key s (t, s >= 0).
__device__ __forceinline__ bool Sees(int t, int s, int window) {
  return s <= t && (window == 0 || s > t - window);
}

// Some query in [ra, rb] sees some key in [ka, kb] (inclusive ranges, ra <= rb, ka <= kb).
__device__ __forceinline__ bool Meets(int ra, int rb, int ka, int kb, int window) {
  return ka <= rb && (window == 0 || kb > ra - window);
}

// Every query in [ra, rb] sees every key in [ka, kb] (inclusive ranges, ra <= rb, ka <= kb): a tile inside the band
// needs no mask.
__device__ __forceinline__ bool SeesAll(int ra, int rb, int ka, int kb, int window) {
  return kb <= ra && (window == 0 || ka > rb - window);
}

// Where the rows of one (b, h) start: q, k, v of token 0 in qkv (B, T, 3, H, D) of element type S (float, or bf16
// for the tensor-core kernels: runtime.activations: bf16), each `row` elements apart, and dout (B, T, H, D) of the
// same type, `orow` elements apart (g is null when dout is).
template <typename S>
struct HeadRowsT {
  const S *q, *k, *v, *g;
  long row, orow;
};
using HeadRows = HeadRowsT<float>;
template <typename S>
__device__ __forceinline__ HeadRowsT<S> HeadRowsOf(const S* qkv, const S* dout, int b, int h, int T, int H, int D) {
  HeadRowsT<S> r;
  r.row = 3L * H * D;
  r.orow = static_cast<long>(H) * D;
  r.q = qkv + static_cast<long>(b) * T * r.row + static_cast<long>(h) * D;
  r.k = r.q + r.orow;
  r.v = r.k + r.orow;
  r.g = dout == nullptr ? nullptr : dout + static_cast<long>(b) * T * r.orow + static_cast<long>(h) * D;
  return r;
}

template <typename Kernel>
cudaError_t AllowSharedBytes(Kernel kernel, size_t bytes) {
  if (bytes <= kDefaultSharedBytes) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

// The int-sized shape of one call, for tiles of `tile` rows: ntiles per (b, h), blocks = B * H * ntiles,
// rows = B * T * H.
struct AttentionShape {
  int T, H, D, window, ntiles, blocks, rows;
  float scale;
};

// Checks the limits of attention.h; *empty for B, T or H <= 0, else *s holds the shape.
inline cudaError_t CheckAttentionShape(int64_t B, int64_t T, int64_t H, int64_t D, int64_t window, int tile,
                                       bool* empty, AttentionShape* s) {
  if (D < 1 || D > kAttentionMaxHeadDim || window < 0) return cudaErrorInvalidValue;
  *empty = B <= 0 || T <= 0 || H <= 0;
  if (*empty) return cudaSuccess;
  constexpr int64_t kIntMax = 2147483647;
  if (T > (int64_t{1} << 30) || B > kIntMax || H > kIntMax || B * H > kIntMax || B * H * T > kIntMax) {
    return cudaErrorInvalidValue;
  }
  s->T = static_cast<int>(T);
  s->H = static_cast<int>(H);
  s->D = static_cast<int>(D);
  s->window = window >= T ? 0 : static_cast<int>(window);  // a window covering every key is plain causal
  s->ntiles = static_cast<int>((T + tile - 1) / tile);
  s->blocks = static_cast<int>(B * H * s->ntiles);
  s->rows = static_cast<int>(B * T * H);
  s->scale = 1.0f / sqrtf(static_cast<float>(D));
  return cudaSuccess;
}

// drow (B, H, T) = sum_d dout * out per (b, t, h): the row terms of the backward (attention.cu). fp32 dout and out;
// or bf16 dout (runtime.activations: bf16: the attention projection's backward GEMM writes it in bf16) with out
// rounded to bf16 too — read as the forward's rounding (out16), or rounded here from the fp32 out (the same values,
// so the same bits) — each product of widened operands summed in fp32 in the same order.
cudaError_t AttentionRowTerms(float* drow, const float* dout, const float* out, const AttentionShape& s,
                              cudaStream_t stream);
cudaError_t AttentionRowTerms(float* drow, const __nv_bfloat16* dout, const float* out, const AttentionShape& s,
                              cudaStream_t stream);
cudaError_t AttentionRowTerms(float* drow, const __nv_bfloat16* dout, const __nv_bfloat16* out, const AttentionShape& s,
                              cudaStream_t stream);

}  // namespace ms::kernels::attention_detail
