// kernels/common.cuh: device helpers shared by the kernels (warp and block reductions, launch sizing).
// defines: WarpSum, WarpMax, BlockSum, BlockMax, BlockThreadsFor, GridFor, Widen, LoadQuad, Bf16Bits, StoreQuadBf16
#pragma once

#include <cstdint>
#include <cstring>

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
// Under the SIMT emulator GridFor launches at most this many blocks: every emulated CUDA thread is a fiber whose start
// and two switches cost far more than a grid-stride iteration, so an emulated launch over a whole weight (1.65M
// elements: 6,446 blocks of 256 fibers) ran mostly the scheduler. Capped, each thread loops, as on a GPU when n
// exceeds the grid — the path the kernels' tests then cover at every size above kSimMaxGridBlocks blocks' threads
// (and a kernel that is not grid-stride fails them). Not in the nvcc build: the GPU gets the whole grid.
constexpr int64_t kSimMaxGridBlocks = 8;

// Blocks of `block` threads covering n elements, capped (kernels use grid-stride loops).
inline unsigned GridFor(int64_t n, int block, int64_t max_blocks = 65535) {
#if MS_SIM_EMULATION
  if (max_blocks > kSimMaxGridBlocks) max_blocks = kSimMaxGridBlocks;
#endif
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

// Four consecutive elements widened to fp32 (exactly: a bf16's bits are the high half of its fp32 value), from a
// 16-byte (fp32) or 8-byte (bf16) aligned address: one load.
__device__ __forceinline__ float4 LoadQuad(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ float4 LoadQuad(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);  // little-endian: element 0 in the low half of u.x
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                     __uint_as_float(u.y & 0xffff0000u));
}

// The bits of x rounded to bf16 (nearest even, as __float2bfloat16), in the low half.
__device__ __forceinline__ uint32_t Bf16Bits(float x) {
  const __nv_bfloat16 h = __float2bfloat16(x);
  uint16_t u;
  memcpy(&u, &h, sizeof(u));
  return u;
}

// dst[0..3] = v rounded to bf16 (nearest even), as one 8-byte store (dst 8-byte aligned); element 0 in the low half,
// as in memory.
__device__ __forceinline__ void StoreQuadBf16(__nv_bfloat16* dst, float4 v) {
  *reinterpret_cast<uint2*>(dst) =
      make_uint2(Bf16Bits(v.x) | (Bf16Bits(v.y) << 16), Bf16Bits(v.z) | (Bf16Bits(v.w) << 16));
}

}  // namespace ms::kernels
