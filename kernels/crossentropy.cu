// defines: crossentropy_forward_kernel, crossentropy_backward_kernel, crossentropy_fused_kernel and their
// launchers (CrossEntropyForward, CrossEntropyBackward, CrossEntropyFused): softmax cross-entropy over rows of
// logits, with the per-row log-sum-exp saved for the backward pass, as ms::ops::CrossEntropyForward/Backward/Fused.
// The kernels are templates on the logits' type: fp32, or bf16 (runtime.activations: bf16, the classifier GEMM
// writing its logits in bf16; widened exactly), and take the number of valid columns Vv <= V (the stride): columns
// from Vv on (the vocabulary padding) are out of the softmax and get a zero gradient.
//
// Memory traffic is the whole cost (one exp per element): the log-sum-exp is an online one (each thread keeps a
// running max and a sum rescaled when the max grows, the block merges the pairs), so a row is read once for it, not
// twice (max, then sum), and where V is a multiple of 8 and the logits 16-byte aligned (kVec: always in training,
// where V is padded to 128) each thread takes 8 consecutive columns at a time with 16-byte loads and stores (two
// chunks per loop step, both loads issued first), where 2- or 4-byte accesses left the H200 at 15-26 % of its
// bandwidth (docs/PERFORMANCE.md). The column -> thread assignment depends only on V and that alignment, the same
// for both logit types, so the bf16 kernels give the bits of the fp32 ones on the widened logits, and the fused
// kernel those of the pair.
#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "kernels.h"

namespace ms::kernels {

constexpr int kCeMaxBlock = 512;  // the most threads a row block gets
constexpr int kCeChunk = 8;       // columns a thread takes at a time on the vector path (16 bytes of bf16)

// ---- kernels ----

namespace {
// Online log-sum-exp state of a set of logits: m its max (-inf while empty), s = sum exp(l - m) (0 while empty).
struct Lse {
  float m = -INFINITY, s = 0.0f;
};

// Adds n logits (masked ones at -inf add nothing: exp(-inf - m) = 0 and adding 0 changes no sum).
template <int n>
__device__ __forceinline__ void LseAdd(Lse& a, const float (&x)[n]) {
  float cm = x[0];
  MS_UNROLL
  for (int i = 1; i < n; ++i) cm = fmaxf(cm, x[i]);
  if (cm == -INFINITY) return;  // all masked: nothing to add (and m - cm would be NaN while a is empty)
  if (cm > a.m) {
    a.s *= expf(a.m - cm);  // 0 while a is empty
    a.m = cm;
  }
  float cs = 0.0f;
  MS_UNROLL
  for (int i = 0; i < n; ++i) cs += expf(x[i] - a.m);
  a.s += cs;
}

// a merged with b; symmetric in its bits (max, products and one sum all commute), so both lanes of a butterfly get
// the same pair.
__device__ __forceinline__ Lse LseMerge(Lse a, Lse b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return a;  // both empty
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

// The row's log-sum-exp from each thread's state, by the whole block (a 1-D block of whole warps); every thread gets
// it. scratch: 64 floats of shared memory, free again when it returns (ends with a barrier).
__device__ __forceinline__ float BlockLogSumExp(Lse a, float* scratch) {
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  for (int o = 16; o > 0; o >>= 1)
    a = LseMerge(a, {__shfl_xor_sync(kFullMask, a.m, o), __shfl_xor_sync(kFullMask, a.s, o)});
  if (lane == 0) {
    scratch[warp] = a.m;
    scratch[32 + warp] = a.s;
  }
  __syncthreads();
  a = lane < nwarps ? Lse{scratch[lane], scratch[32 + lane]} : Lse{};
  for (int o = 16; o > 0; o >>= 1)
    a = LseMerge(a, {__shfl_xor_sync(kFullMask, a.m, o), __shfl_xor_sync(kFullMask, a.s, o)});
  __syncthreads();
  return a.m + logf(a.s);
}

// 8 consecutive logits from a 16-byte aligned address, widened.
__device__ __forceinline__ void LoadChunk(const float* p, float (&x)[kCeChunk]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}
__device__ __forceinline__ void LoadChunk(const __nv_bfloat16* p, float (&x)[kCeChunk]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);  // little-endian: element 2 i in the low half of word i
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
  MS_UNROLL
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = __uint_as_float(w[i] << 16);
    x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
// Columns c0.. c0 + 7 past Vv to -inf (out of the softmax).
__device__ __forceinline__ void MaskChunk(float (&x)[kCeChunk], int c0, int Vv) {
  if (c0 + kCeChunk <= Vv) return;
  MS_UNROLL
  for (int i = 0; i < kCeChunk; ++i)
    if (c0 + i >= Vv) x[i] = -INFINITY;
}

// The row's log-sum-exp over its first Vv columns, by the whole block (vector path: V a multiple of 8, l 16-byte
// aligned). scratch: 64 floats.
template <bool kVec, class L>
__device__ __forceinline__ float RowLogSumExp(const L* l, int V, int Vv, float* scratch) {
  Lse a;
  if constexpr (kVec) {
    const int chunks = V / kCeChunk, step = blockDim.x;
    int c = threadIdx.x;
    for (; c + step < chunks; c += 2 * step) {  // two chunks per step, both loads first
      float x[kCeChunk], y[kCeChunk];
      LoadChunk(l + c * kCeChunk, x);
      LoadChunk(l + (c + step) * kCeChunk, y);
      MaskChunk(x, c * kCeChunk, Vv);
      MaskChunk(y, (c + step) * kCeChunk, Vv);
      LseAdd(a, x);
      LseAdd(a, y);
    }
    if (c < chunks) {
      float x[kCeChunk];
      LoadChunk(l + c * kCeChunk, x);
      MaskChunk(x, c * kCeChunk, Vv);
      LseAdd(a, x);
    }
  } else {
    for (int j = threadIdx.x; j < Vv; j += blockDim.x) {
      const float x[1] = {Widen(l[j])};
      LseAdd(a, x);
    }
  }
  return BlockLogSumExp(a, scratch);
}

// The gradient of one column: (exp(l - z) - [j == t]) * scale; 0 for ignored rows (t < 0) and columns past Vv.
__device__ __forceinline__ float Grad(float x, int j, int t, int Vv, float z, float scale) {
  return t < 0 || j >= Vv ? 0.0f : (expf(x - z) - (j == t ? 1.0f : 0.0f)) * scale;
}

// Writes the gradient of a row (the logits l of V columns): d (fp32, unless null) and d16 (its bf16 rounding, unless
// null); either may be l itself (each chunk, or element, is read by the thread that writes it, before it does).
// kVec: 16-byte stores where the destination allows (vec_out; element stores otherwise: the values do not depend on
// it).
template <bool kVec, class L>
__device__ __forceinline__ void RowGradient(float* d, __nv_bfloat16* d16, const L* l, int V, int Vv, int t, float z,
                                            float scale, bool vec_out) {
  if constexpr (kVec) {
    const int chunks = V / kCeChunk;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      const int c0 = c * kCeChunk;
      float x[kCeChunk], v[kCeChunk];
      LoadChunk(l + c0, x);
      MS_UNROLL
      for (int i = 0; i < kCeChunk; ++i) v[i] = Grad(x[i], c0 + i, t, Vv, z, scale);
      if (vec_out) {
        if (d) {
          reinterpret_cast<float4*>(d + c0)[0] = make_float4(v[0], v[1], v[2], v[3]);
          reinterpret_cast<float4*>(d + c0)[1] = make_float4(v[4], v[5], v[6], v[7]);
        }
        if (d16) {  // one 16-byte store; element 0 in the low half of the first word
          uint32_t w[4];
          MS_UNROLL
          for (int i = 0; i < 4; ++i) w[i] = Bf16Bits(v[2 * i]) | (Bf16Bits(v[2 * i + 1]) << 16);
          *reinterpret_cast<uint4*>(d16 + c0) = make_uint4(w[0], w[1], w[2], w[3]);
        }
      } else {
        MS_UNROLL
        for (int i = 0; i < kCeChunk; ++i) {
          if (d) d[c0 + i] = v[i];
          if (d16) d16[c0 + i] = __float2bfloat16_rn(v[i]);
        }
      }
    }
  } else {
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
      const float v = Grad(Widen(l[j]), j, t, Vv, z, scale);
      if (d) d[j] = v;
      if (d16) d16[j] = __float2bfloat16_rn(v);
    }
  }
}
}  // namespace

// One block per row: the row's log-sum-exp and loss. losses, lse: (N); logits: (N, V); targets: (N), < 0 ignored
// (loss 0, lse still written).
template <bool kVec, class L>
__global__ void __launch_bounds__(kCeMaxBlock)
    crossentropy_forward_kernel(float* losses, float* lse, const L* logits, const int* targets, int V, int Vv) {
  MS_SHARED_ARRAY(float, scratch, 64);
  const long row = blockIdx.x;
  const L* l = logits + row * V;
  const float z = RowLogSumExp<kVec>(l, V, Vv, scratch);
  if (threadIdx.x == 0) {
    const int t = targets[row];
    lse[row] = z;
    losses[row] = t < 0 ? 0.0f : z - Widen(l[t]);
  }
}

// One block per row: dlogits (N, V) = (exp(l - lse) - onehot(target)) * dloss[row]; ignored rows and padding columns
// get 0; d16 (N, V), unless null, = dlogits rounded to bf16; dlogits may be null when d16 is not. d16 may be the
// bf16 logits themselves.
template <bool kVec, class L>
__global__ void __launch_bounds__(kCeMaxBlock)
    crossentropy_backward_kernel(float* dlogits, __nv_bfloat16* d16, const L* logits, const float* lse,
                                 const int* targets, const float* dloss, int V, int Vv, bool vec_out) {
  const long row = blockIdx.x;
  RowGradient<kVec>(dlogits ? dlogits + row * V : nullptr, d16 ? d16 + row * V : nullptr, logits + row * V, V, Vv,
                    targets[row], lse[row], dloss[row], vec_out);
}

// One block per row: the forward above, then the backward written over the row (dlogits in place of the logits):
// losses, lse (N) WRITTEN; fp32 logits (N, V) OVERWRITTEN (left as they are when !fp32: then only d16 is written);
// bf16 logits: d16 may be the logits themselves. The same arithmetic as the two kernels (bit-identical); the block
// reads its row twice (the second time normally from L2) and writes it once, where the pair of kernels read it twice
// from HBM (the backward a whole pass later) and wrote a separate dlogits.
template <bool kVec, class L>
__global__ void __launch_bounds__(kCeMaxBlock)
    crossentropy_fused_kernel(float* losses, float* lse, L* logits, __nv_bfloat16* d16, const int* targets,
                              const float* dloss, int V, int Vv, bool fp32, bool vec_out) {
  MS_SHARED_ARRAY(float, scratch, 64);
  const long row = blockIdx.x;
  L* l = logits + row * V;
  const float z = RowLogSumExp<kVec>(l, V, Vv, scratch);
  const int t = targets[row];
  if (threadIdx.x == 0) {
    lse[row] = z;
    losses[row] = t < 0 ? 0.0f : z - Widen(l[t]);
  }
  __syncthreads();  // the target logit is read before any thread overwrites it
  float* d = nullptr;
  if constexpr (std::is_same_v<L, float>) {
    if (fp32) d = l;
  }
  RowGradient<kVec>(d, d16 ? d16 + row * V : nullptr, l, V, Vv, t, z, dloss[row], vec_out);
}

// ---- launchers ----

namespace {
bool BadColumns(int64_t V, int64_t Vv) {
  return Vv < 1 || Vv > V;
}
bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}
// The vector path: 8-column chunks, 16-byte loads (a function of V and the logits' address only: the forward, the
// backward and the fused kernel assign the columns alike).
bool VecPath(const void* logits, int64_t V) {
  return V % kCeChunk == 0 && Aligned16(logits);
}
// 16-byte stores too (the outputs' rows start 16-byte aligned: V % 8 == 0 on the vector path).
bool VecOut(const void* a, const void* b) {
  return (a == nullptr || Aligned16(a)) && (b == nullptr || Aligned16(b));
}
int RowThreads(int64_t V, bool vec) {
  return BlockThreadsFor(vec ? V / kCeChunk : V, kCeMaxBlock);
}

template <class L>
cudaError_t Forward(float* losses, float* lse, const L* logits, const int32_t* targets, int64_t N, int64_t V,
                    int64_t Vv, cudaStream_t stream) {
  if (N <= 0 || V <= 0) return cudaSuccess;
  if (BadColumns(V, Vv)) return cudaErrorInvalidValue;
  const unsigned rows = static_cast<unsigned>(N);
  if (VecPath(logits, V)) {
    MS_LAUNCH((crossentropy_forward_kernel<true, L>), rows, RowThreads(V, true), 0, stream, losses, lse, logits,
              targets, static_cast<int>(V), static_cast<int>(Vv));
  } else {
    MS_LAUNCH((crossentropy_forward_kernel<false, L>), rows, RowThreads(V, false), 0, stream, losses, lse, logits,
              targets, static_cast<int>(V), static_cast<int>(Vv));
  }
  return cudaGetLastError();
}

template <class L>
cudaError_t Backward(float* dlogits, __nv_bfloat16* d16, const L* logits, const float* lse, const int32_t* targets,
                     const float* dloss, int64_t N, int64_t V, int64_t Vv, cudaStream_t stream) {
  if (dlogits == nullptr && d16 == nullptr) return cudaErrorInvalidValue;  // the gradient would be written nowhere
  if (N <= 0 || V <= 0) return cudaSuccess;
  if (BadColumns(V, Vv)) return cudaErrorInvalidValue;
  const unsigned rows = static_cast<unsigned>(N);
  if (VecPath(logits, V)) {
    MS_LAUNCH((crossentropy_backward_kernel<true, L>), rows, RowThreads(V, true), 0, stream, dlogits, d16, logits, lse,
              targets, dloss, static_cast<int>(V), static_cast<int>(Vv), VecOut(dlogits, d16));
  } else {
    MS_LAUNCH((crossentropy_backward_kernel<false, L>), rows, RowThreads(V, false), 0, stream, dlogits, d16, logits,
              lse, targets, dloss, static_cast<int>(V), static_cast<int>(Vv), false);
  }
  return cudaGetLastError();
}

template <class L>
cudaError_t Fused(float* losses, float* lse, L* logits, __nv_bfloat16* d16, const int32_t* targets, const float* dloss,
                  int64_t N, int64_t V, int64_t Vv, bool fp32, cudaStream_t stream) {
  if (N <= 0 || V <= 0) return cudaSuccess;
  if (BadColumns(V, Vv)) return cudaErrorInvalidValue;
  const unsigned rows = static_cast<unsigned>(N);
  if (VecPath(logits, V)) {
    MS_LAUNCH((crossentropy_fused_kernel<true, L>), rows, RowThreads(V, true), 0, stream, losses, lse, logits, d16,
              targets, dloss, static_cast<int>(V), static_cast<int>(Vv), fp32, VecOut(d16, nullptr));
  } else {
    MS_LAUNCH((crossentropy_fused_kernel<false, L>), rows, RowThreads(V, false), 0, stream, losses, lse, logits, d16,
              targets, dloss, static_cast<int>(V), static_cast<int>(Vv), fp32, false);
  }
  return cudaGetLastError();
}
}  // namespace

cudaError_t CrossEntropyForward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                                int64_t V, cudaStream_t stream) {
  return Forward(losses, lse, logits, targets, N, V, V, stream);
}

cudaError_t CrossEntropyBackward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                                 const float* dloss, int64_t N, int64_t V, cudaStream_t stream, __nv_bfloat16* d16) {
  return Backward(dlogits, d16, logits, lse, targets, dloss, N, V, V, stream);
}

cudaError_t CrossEntropyFused(float* losses, float* lse, float* logits, const int32_t* targets, const float* dloss,
                              int64_t N, int64_t V, cudaStream_t stream, __nv_bfloat16* d16, bool fp32_dlogits) {
  if (!fp32_dlogits && d16 == nullptr) return cudaErrorInvalidValue;  // the gradient would be written nowhere
  return Fused(losses, lse, logits, d16, targets, dloss, N, V, V, fp32_dlogits, stream);
}

cudaError_t CrossEntropyForward(float* losses, float* lse, const __nv_bfloat16* logits, const int32_t* targets,
                                int64_t N, int64_t V, int64_t Vv, cudaStream_t stream) {
  return Forward(losses, lse, logits, targets, N, V, Vv, stream);
}

cudaError_t CrossEntropyBackward(__nv_bfloat16* d16, const __nv_bfloat16* logits, const float* lse,
                                 const int32_t* targets, const float* dloss, int64_t N, int64_t V, int64_t Vv,
                                 cudaStream_t stream) {
  if (d16 == nullptr) return cudaErrorInvalidValue;
  return Backward(static_cast<float*>(nullptr), d16, logits, lse, targets, dloss, N, V, Vv, stream);
}

cudaError_t CrossEntropyFused(float* losses, float* lse, __nv_bfloat16* logits, const int32_t* targets,
                              const float* dloss, int64_t N, int64_t V, int64_t Vv, cudaStream_t stream) {
  return Fused(losses, lse, logits, logits, targets, dloss, N, V, Vv, false, stream);
}

}  // namespace ms::kernels
