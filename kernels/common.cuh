// kernels/common.cuh: device helpers shared by the kernels (warp and block reductions, launch sizing).
// defines: WarpSum, WarpMax, BlockSum, BlockMax, BlockThreadsFor, GridFor
#pragma once

#include "sim/simt.h"

namespace ms::kernels {

constexpr unsigned kFullMask = 0xffffffffu;

// Sum / max over the 32 lanes of a full warp (butterfly: every lane gets the result, in the same order).
__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Sum / max over a 1-D block whose size is a multiple of 32; every thread gets the result (each warp reduces
// the per-warp partials itself, so no broadcast is needed). scratch: 32 floats of shared memory. Every thread
// of the block must call it (it contains barriers); scratch may be reused as soon as it returns.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = WarpSum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = WarpSum(lane < nwarps ? scratch[lane] : 0.0f);
  __syncthreads();
  return v;
}
__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = WarpMax(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = WarpMax(lane < nwarps ? scratch[lane] : -INFINITY);
  __syncthreads();
  return v;
}

// Host side: threads for a block working along a row of `width` elements: whole warps, at most `max_threads`.
inline int BlockThreadsFor(int64_t width, int max_threads) {
  int64_t t = (width + 31) / 32 * 32;
  if (t < 32) t = 32;
  return static_cast<int>(t < max_threads ? t : max_threads);
}
// Blocks of `block` threads covering n elements, capped (kernels use grid-stride loops).
inline unsigned GridFor(int64_t n, int block, int64_t max_blocks = 65535) {
  int64_t g = (n + block - 1) / block;
  return static_cast<unsigned>(g < 1 ? 1 : (g > max_blocks ? max_blocks : g));
}

// An element as fp32: itself, or a bf16 widened exactly (its bits are the high half of the fp32 value). For kernels
// templated on an input kept in fp32 or in bf16 (runtime.activations: bf16).
__device__ __forceinline__ float Widen(float v) {
  return v;
}
__device__ __forceinline__ float Widen(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

}  // namespace ms::kernels
