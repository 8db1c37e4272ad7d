// defines: ew_add_inplace_kernel, ew_add_kernel, ew_scale_kernel, ew_add_row_bias_kernel, ew_residual_add_kernel
//          (and their float4 variants ew_*_vec4_kernel, used for 16-byte aligned pointers, C % 4 == 0 for rows),
//          ew_bias_grad_chunks_kernel, ew_bias_grad_finish_kernel,
//          ew_add_positions_kernel, ew_positions_backward_kernel, ew_sumsq_chunks_kernel,
//          ew_sumsq_finish_kernel, ew_vp_row_stats_kernel, ew_vp_rebase_kernel, ew_vp_finish_kernel,
//          ew_vp_backward_kernel and their launchers (declared in kernels/elementwise.h): the vector helpers,
//          row biases, learned positions, sums of squares and vocab-parallel cross-entropy pieces of
//          ms::ops::Backend.
#include <cmath>
#include <cstdint>

#include "column_sums.cuh"
#include "common.cuh"
#include "kernels.h"

namespace ms::kernels {

constexpr int kEwBlock = 256;  // threads per block of the elementwise kernels (grid-stride loops)

constexpr int kBiasGradFinishThreads = 256;  // finishing kernel: one column per thread (column_sums.cuh)

constexpr int kVpMaxThreads = 512;            // vocab-parallel row kernels: BlockThreadsFor(V, kVpMaxThreads)
constexpr int kSumSquaresFinishThreads = 32;  // one warp per vector

constexpr int kSumSquaresMaxTensors = 64;   // vectors per launch pair (the list travels in the kernel parameters)
constexpr int kSumSquaresBlock = 256;       // threads per chunk block
constexpr int64_t kSumSquaresChunk = 8192;  // elements per chunk (one block, one partial sum in scratch)

// The vectors of one SumSquaresMulti launch pair, by value: chunk block b works on vector k where
// first_chunk[k] <= b < first_chunk[k + 1]; the finishing block k sums chunks [first_chunk[k], first_chunk[k+1]).
struct SumSquaresBatch {
  const float* x[kSumSquaresMaxTensors];
  int64_t n[kSumSquaresMaxTensors];
  int64_t first_chunk[kSumSquaresMaxTensors + 1];
  int count;
};

// ---- device helpers ----

namespace {

// Sum over the 32 lanes of a full warp, in double (butterfly: the same order on every lane).
__device__ __forceinline__ double WarpSumDouble(double v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// Sum over a 1-D block (a multiple of 32 threads) in double: a warp butterfly, then thread 0 adds the warp sums
// in warp order. The result is valid in thread 0 only. scratch: 32 doubles of shared memory; every thread of
// the block must call it (it contains a barrier).
__device__ __forceinline__ double BlockSumDoubleToThread0(double v, double* scratch) {
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = WarpSumDouble(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  double sum = 0.0;
  if (threadIdx.x == 0) {
    for (unsigned w = 0; w < nwarps; ++w) sum += scratch[w];
  }
  return sum;
}

__device__ __forceinline__ int64_t GlobalThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t GridThreads() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

}  // namespace

// ---- kernels: elementwise vectors ----

__global__ void __launch_bounds__(kEwBlock) ew_add_inplace_kernel(float* y, const float* x, int64_t n) {  // y, x: (n)
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) y[i] += x[i];
}

__global__ void __launch_bounds__(kEwBlock)
    ew_add_kernel(float* out, const float* a, const float* b, int64_t n) {  // all (n); out may be a or b
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) out[i] = a[i] + b[i];
}

__global__ void __launch_bounds__(kEwBlock) ew_scale_kernel(float* x, float a, int64_t n) {  // x: (n)
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) x[i] *= a;
}

// float4 variants, launched when every pointer is 16-byte aligned (and, for the row kernels, C % 4 == 0): the same
// float operations per element, so the same bits as the scalar kernels. n4 = n / 4 vectors, then the n % 4 tail
// elements one per thread.

__device__ __forceinline__ float4 Add4(float4 a, float4 b) {
  a.x += b.x;
  a.y += b.y;
  a.z += b.z;
  a.w += b.w;
  return a;
}

__global__ void __launch_bounds__(kEwBlock) ew_add_inplace_vec4_kernel(float* y, const float* x, int64_t n) {
  const int64_t n4 = n / 4;
  float4* y4 = reinterpret_cast<float4*>(y);
  const float4* x4 = reinterpret_cast<const float4*>(x);
  for (int64_t i = GlobalThread(); i < n4; i += GridThreads()) y4[i] = Add4(y4[i], x4[i]);
  for (int64_t i = 4 * n4 + GlobalThread(); i < n; i += GridThreads()) y[i] += x[i];
}

__global__ void __launch_bounds__(kEwBlock) ew_add_vec4_kernel(float* out, const float* a, const float* b, int64_t n) {
  const int64_t n4 = n / 4;
  float4* o4 = reinterpret_cast<float4*>(out);
  const float4* a4 = reinterpret_cast<const float4*>(a);
  const float4* b4 = reinterpret_cast<const float4*>(b);
  for (int64_t i = GlobalThread(); i < n4; i += GridThreads()) o4[i] = Add4(a4[i], b4[i]);
  for (int64_t i = 4 * n4 + GlobalThread(); i < n; i += GridThreads()) out[i] = a[i] + b[i];
}

__global__ void __launch_bounds__(kEwBlock) ew_scale_vec4_kernel(float* x, float a, int64_t n) {
  const int64_t n4 = n / 4;
  float4* x4 = reinterpret_cast<float4*>(x);
  for (int64_t i = GlobalThread(); i < n4; i += GridThreads()) {
    float4 v = x4[i];
    v.x *= a;
    v.y *= a;
    v.z *= a;
    v.w *= a;
    x4[i] = v;
  }
  for (int64_t i = 4 * n4 + GlobalThread(); i < n; i += GridThreads()) x[i] *= a;
}

// ---- kernels: rows and biases ----

// y (R, C) flattened to n = R * C; b: (C).
__global__ void __launch_bounds__(kEwBlock) ew_add_row_bias_kernel(float* y, const float* b, int64_t n, int64_t C) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) y[i] += b[i % C];
}

// y (R, C) bf16, b: (C); a block per row at a time (no 64-bit remainder per element), the threads along it.
__global__ void __launch_bounds__(kEwBlock)
    ew_add_row_bias16_kernel(__nv_bfloat16* y, const float* b, int64_t R, int64_t C) {
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    __nv_bfloat16* const row = y + r * C;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) row[c] = __float2bfloat16_rn(Widen(row[c]) + b[c]);
  }
}

// out, x, part: (R, C) flattened to n; bias, bias2: (C) or null. out = ((x + part) + bias) + bias2. P: part's type,
// float or __nv_bfloat16 (widened exactly).
template <typename P>
__global__ void __launch_bounds__(kEwBlock)
    ew_residual_add_kernel(float* out, const float* x, const P* part, const float* bias, const float* bias2, int64_t n,
                           int64_t C) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    float v = x[i] + Widen(part[i]);
    if (bias != nullptr) v += bias[i % C];
    if (bias2 != nullptr) v += bias2[i % C];
    out[i] = v;
  }
}

// float4 variants of the two above (C % 4 == 0, so rows hold whole vectors): n4 = R * C / 4, c4 = C / 4.
__global__ void __launch_bounds__(kEwBlock)
    ew_add_row_bias_vec4_kernel(float* y, const float* b, int64_t n4, int64_t c4) {
  float4* y4 = reinterpret_cast<float4*>(y);
  const float4* b4 = reinterpret_cast<const float4*>(b);
  for (int64_t i = GlobalThread(); i < n4; i += GridThreads()) y4[i] = Add4(y4[i], b4[i % c4]);
}

__global__ void __launch_bounds__(kEwBlock)
    ew_residual_add_vec4_kernel(float* out, const float* x, const float* part, const float* bias, const float* bias2,
                                int64_t n4, int64_t c4) {
  float4* o4 = reinterpret_cast<float4*>(out);
  const float4* x4 = reinterpret_cast<const float4*>(x);
  const float4* p4 = reinterpret_cast<const float4*>(part);
  const float4* b4 = reinterpret_cast<const float4*>(bias);
  const float4* bb4 = reinterpret_cast<const float4*>(bias2);
  for (int64_t i = GlobalThread(); i < n4; i += GridThreads()) {
    const int64_t c = i % c4;  // once: a 64-bit remainder is a subroutine call
    float4 v = Add4(x4[i], p4[i]);
    if (b4 != nullptr) v = Add4(v, b4[c]);
    if (bb4 != nullptr) v = Add4(v, bb4[c]);
    o4[i] = v;
  }
}

// Stage 1 of the bias gradient: ColumnSumChunk (column_sums.cuh) over dy (fp32, or bf16 widened exactly).
template <class T>
__global__ void __launch_bounds__(kColSumThreads)
    ew_bias_grad_chunks_kernel(float* db, float* partial, const T* dy, int64_t R, int64_t C, int64_t chunk_rows) {
  MS_SHARED_ARRAY2D(float, lanes, kColSumLanes, kColSumCols + 1);
  ColumnSumChunk(
      lanes, db, partial, R, C, chunk_rows, [dy, C](int64_t r, int64_t c) { return Widen(dy[r * C + c]); },
      [](float v, int64_t, int64_t) { return v; });
}

// Stage 2: db[c] += sum of partial[k * C + c] over the chunks k in order (one thread per column).
__global__ void __launch_bounds__(kBiasGradFinishThreads)
    ew_bias_grad_finish_kernel(float* db, const float* partial, int64_t chunks, int64_t C) {
  for (int64_t c = GlobalThread(); c < C; c += GridThreads()) {
    float sum = 0.0f;
    for (int64_t k = 0; k < chunks; ++k) sum += partial[k * C + c];
    db[c] += sum;
  }
}

// ---- kernels: learned positions ----

// x (R, C) += wpe (T, C)[(row0 + r) % T].
__global__ void __launch_bounds__(kEwBlock)
    ew_add_positions_kernel(float* x, const float* wpe, int64_t R, int64_t C, int64_t T, int64_t row0) {
  const int64_t n = R * C;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int64_t r = i / C, c = i - r * C;
    x[i] += wpe[((row0 + r) % T) * C + c];
  }
}

// dwpe (T, C)[t] += dx (R, C)[r] for every r with (row0 + r) % T == t: thread (t, c) adds its rows in order.
__global__ void __launch_bounds__(kEwBlock)
    ew_positions_backward_kernel(float* dwpe, const float* dx, int64_t R, int64_t C, int64_t T, int64_t row0) {
  const int64_t n = T * C;
  const int64_t shift = row0 % T;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int64_t t = i / C, c = i - t * C;
    int64_t r = (t - shift + T) % T;  // the first row with (row0 + r) % T == t
    if (r >= R) continue;
    float acc = dwpe[i];
    for (; r < R; r += T) acc += dx[r * C + c];
    dwpe[i] = acc;
  }
}

// ---- kernels: sums of squares ----

// Block b: the squares of one chunk of one vector, in double, into partial[b].
__global__ void __launch_bounds__(kSumSquaresBlock) ew_sumsq_chunks_kernel(SumSquaresBatch batch, double* partial) {
  MS_SHARED_ARRAY(double, scratch, 32);
  int k = 0;
  while (k + 1 < batch.count && static_cast<int64_t>(blockIdx.x) >= batch.first_chunk[k + 1]) ++k;
  const float* x = batch.x[k];
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - batch.first_chunk[k]) * kSumSquaresChunk;
  const int64_t end = begin + kSumSquaresChunk < batch.n[k] ? begin + kSumSquaresChunk : batch.n[k];
  double acc = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const double v = x[i];
    acc += v * v;  // exact product (24-bit mantissas), so a fused multiply-add rounds the same
  }
  const double sum = BlockSumDoubleToThread0(acc, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

// Block k (one warp): out[k] = the chunk sums of vector k, lane l adding chunks l, l + 32, ... in order, then a
// warp butterfly.
__global__ void __launch_bounds__(kSumSquaresFinishThreads)
    ew_sumsq_finish_kernel(SumSquaresBatch batch, const double* partial, double* out) {
  const int k = blockIdx.x;
  double acc = 0.0;
  for (int64_t j = batch.first_chunk[k] + threadIdx.x; j < batch.first_chunk[k + 1]; j += 32) acc += partial[j];
  acc = WarpSumDouble(acc);
  if (threadIdx.x == 0) out[k] = acc;
}

// ---- kernels: vocab-parallel cross-entropy (one block per row for the row reductions) ----

// The vector path of the two row kernels (kVec: the shard's width V a multiple of 4 and the logits 16-byte aligned):
// each thread takes 4 consecutive columns at a time with 16-byte loads, two quads per loop step with both loads
// issued first, where 4-byte loads one at a time left the H200 at 25 % of its bandwidth (docs/PERFORMANCE.md).
__device__ __forceinline__ float Max4(float m, float4 v) {
  return fmaxf(fmaxf(fmaxf(m, v.x), v.y), fmaxf(v.z, v.w));
}
__device__ __forceinline__ double SumExp4(double acc, float4 v, float m) {
  return acc + (static_cast<double>(expf(v.x - m)) + static_cast<double>(expf(v.y - m)) +
                static_cast<double>(expf(v.z - m)) + static_cast<double>(expf(v.w - m)));
}

// One block per row: mx = the local row max; se = sum_j expf(l - mx) accumulated in double; tl = the local target
// logit or 0. The second pass reads the row again (normally from L2, right after the first).
template <bool kVec>
__global__ void __launch_bounds__(kVpMaxThreads)
    ew_vp_row_stats_kernel(float* mx, float* se, float* tl, const float* logits, const int32_t* targets, int64_t vstart,
                           int64_t V) {
  MS_SHARED_ARRAY(float, fscratch, 32);
  MS_SHARED_ARRAY(double, dscratch, 32);
  const int64_t row = blockIdx.x;
  const float* l = logits + row * V;
  float m = -INFINITY;
  double acc = 0.0;
  if constexpr (kVec) {
    const float4* l4 = reinterpret_cast<const float4*>(l);
    const int64_t quads = V / 4, step = blockDim.x;
    int64_t c = threadIdx.x;
    for (; c + step < quads; c += 2 * step) {
      const float4 a = l4[c], b = l4[c + step];
      m = Max4(Max4(m, a), b);
    }
    if (c < quads) m = Max4(m, l4[c]);
    m = BlockMax(m, fscratch);
    for (c = threadIdx.x; c + step < quads; c += 2 * step) {
      const float4 a = l4[c], b = l4[c + step];
      acc = SumExp4(SumExp4(acc, a, m), b, m);
    }
    if (c < quads) acc = SumExp4(acc, l4[c], m);
  } else {
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, l[j]);
    m = BlockMax(m, fscratch);
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) acc += static_cast<double>(expf(l[j] - m));
  }
  const double sum = BlockSumDoubleToThread0(acc, dscratch);
  if (threadIdx.x == 0) {
    mx[row] = m;
    se[row] = static_cast<float>(sum);
    const int64_t t = targets[row];
    const int64_t local = t - vstart;
    tl[row] = (t >= 0 && local >= 0 && local < V) ? l[local] : 0.0f;
  }
}

// se (N) *= expf(mx_local - mx_global).
__global__ void __launch_bounds__(kEwBlock)
    ew_vp_rebase_kernel(float* se, const float* mx_local, const float* mx_global, int64_t N) {
  for (int64_t i = GlobalThread(); i < N; i += GridThreads()) se[i] *= expf(mx_local[i] - mx_global[i]);
}

// lse = mx + logf(se); losses = lse - tl (0 for ignored targets); all (N).
__global__ void __launch_bounds__(kEwBlock)
    ew_vp_finish_kernel(float* losses, float* lse, const float* mx, const float* se, const float* tl,
                        const int32_t* targets, int64_t N) {
  for (int64_t i = GlobalThread(); i < N; i += GridThreads()) {
    const float z = mx[i] + logf(se[i]);
    lse[i] = z;
    losses[i] = targets[i] >= 0 ? z - tl[i] : 0.0f;
  }
}

// One block per row: dlogits (N, V) = expf(l - lse) * dloss, minus dloss at the local target column. kVec (and the
// outputs 16-byte aligned, vec_out): a quad of columns at a time, 16-byte loads and stores (8-byte for d16).
template <bool kVec>
__global__ void __launch_bounds__(kVpMaxThreads)
    ew_vp_backward_kernel(float* dlogits, __nv_bfloat16* d16, const float* logits, const float* lse,
                          const int32_t* targets, float dloss, int64_t vstart, int64_t V, bool vec_out) {
  const int64_t row = blockIdx.x;
  const int64_t t = targets[row];
  const int64_t local = t < 0 ? -1 : t - vstart;  // outside [0, V) when not this rank's column
  const float z = lse[row];
  const float* l = logits + row * V;
  float* d = dlogits ? dlogits + row * V : nullptr;
  __nv_bfloat16* h = d16 ? d16 + row * V : nullptr;
  auto grad = [&](float x, int64_t j) {
    float v = 0.0f;
    if (t >= 0) {
      v = expf(x - z) * dloss;
      if (j == local) v -= dloss;
    }
    return v;
  };
  if constexpr (kVec) {
    const int64_t quads = V / 4;
    for (int64_t c = threadIdx.x; c < quads; c += blockDim.x) {
      const float4 x = reinterpret_cast<const float4*>(l)[c];
      const int64_t j = 4 * c;
      const float v[4] = {grad(x.x, j), grad(x.y, j + 1), grad(x.z, j + 2), grad(x.w, j + 3)};
      if (vec_out) {
        if (d) reinterpret_cast<float4*>(d)[c] = make_float4(v[0], v[1], v[2], v[3]);
        if (h) StoreQuadBf16(h + j, make_float4(v[0], v[1], v[2], v[3]));
      } else {
        for (int i = 0; i < 4; ++i) {
          if (d) d[j + i] = v[i];
          if (h) h[j + i] = __float2bfloat16_rn(v[i]);
        }
      }
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      const float v = grad(l[j], j);
      if (d) d[j] = v;
      if (h) h[j] = __float2bfloat16_rn(v);
    }
  }
}

// ---- launchers: return the CUDA error of the launch (cudaSuccess when fine) ----

namespace {
// The float4 kernels need 16-byte aligned pointers (null counts as aligned: an absent bias).
bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}
unsigned Vec4Grid(int64_t n) {
  return GridFor(n / 4 > 0 ? n / 4 : 1, kEwBlock);
}
}  // namespace

cudaError_t AddInPlace(float* y, const float* x, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (Aligned16(y) && Aligned16(x)) {
    MS_LAUNCH(ew_add_inplace_vec4_kernel, Vec4Grid(n), kEwBlock, 0, stream, y, x, n);
    return cudaGetLastError();
  }
  MS_LAUNCH(ew_add_inplace_kernel, GridFor(n, kEwBlock), kEwBlock, 0, stream, y, x, n);
  return cudaGetLastError();
}

cudaError_t Add(float* out, const float* a, const float* b, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (Aligned16(out) && Aligned16(a) && Aligned16(b)) {
    MS_LAUNCH(ew_add_vec4_kernel, Vec4Grid(n), kEwBlock, 0, stream, out, a, b, n);
    return cudaGetLastError();
  }
  MS_LAUNCH(ew_add_kernel, GridFor(n, kEwBlock), kEwBlock, 0, stream, out, a, b, n);
  return cudaGetLastError();
}

cudaError_t Scale(float* x, float a, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (Aligned16(x)) {
    MS_LAUNCH(ew_scale_vec4_kernel, Vec4Grid(n), kEwBlock, 0, stream, x, a, n);
    return cudaGetLastError();
  }
  MS_LAUNCH(ew_scale_kernel, GridFor(n, kEwBlock), kEwBlock, 0, stream, x, a, n);
  return cudaGetLastError();
}

cudaError_t AddRowBias(float* y, const float* b, int64_t R, int64_t C, cudaStream_t stream) {
  if (R <= 0 || C <= 0) return cudaSuccess;
  const int64_t n = R * C;
  if (C % 4 == 0 && Aligned16(y) && Aligned16(b)) {
    MS_LAUNCH(ew_add_row_bias_vec4_kernel, Vec4Grid(n), kEwBlock, 0, stream, y, b, n / 4, C / 4);
    return cudaGetLastError();
  }
  MS_LAUNCH(ew_add_row_bias_kernel, GridFor(n, kEwBlock), kEwBlock, 0, stream, y, b, n, C);
  return cudaGetLastError();
}

cudaError_t AddRowBias(__nv_bfloat16* y, const float* b, int64_t R, int64_t C, cudaStream_t stream) {
  if (R <= 0 || C <= 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(R < 65535 ? R : 65535);
  MS_LAUNCH(ew_add_row_bias16_kernel, blocks, kEwBlock, 0, stream, y, b, R, C);
  return cudaGetLastError();
}

cudaError_t ResidualAdd(float* out, const float* x, const float* part, const float* bias, const float* bias2, int64_t R,
                        int64_t C, cudaStream_t stream) {
  if (R <= 0 || C <= 0) return cudaSuccess;
  const int64_t n = R * C;
  if (C % 4 == 0 && Aligned16(out) && Aligned16(x) && Aligned16(part) && Aligned16(bias) && Aligned16(bias2)) {
    MS_LAUNCH(ew_residual_add_vec4_kernel, Vec4Grid(n), kEwBlock, 0, stream, out, x, part, bias, bias2, n / 4, C / 4);
    return cudaGetLastError();
  }
  MS_LAUNCH(ew_residual_add_kernel<float>, GridFor(n, kEwBlock), kEwBlock, 0, stream, out, x, part, bias, bias2, n, C);
  return cudaGetLastError();
}

cudaError_t ResidualAdd(float* out, const float* x, const __nv_bfloat16* part, const float* bias, const float* bias2,
                        int64_t R, int64_t C, cudaStream_t stream) {
  if (part == nullptr) return cudaErrorInvalidValue;
  if (R <= 0 || C <= 0) return cudaSuccess;
  const int64_t n = R * C;
  MS_LAUNCH(ew_residual_add_kernel<__nv_bfloat16>, GridFor(n, kEwBlock), kEwBlock, 0, stream, out, x, part, bias, bias2,
            n, C);
  return cudaGetLastError();
}

namespace {
// Row chunks of the bias gradient: fixed by (R, C) only (never by the GPU), so the sums are deterministic.
}  // namespace

int64_t BiasGradScratchFloats(int64_t R, int64_t C) {
  if (R <= 0 || C <= 0) return 0;
  const ColumnSumPlan plan = PlanColumnSums(R, C);
  return plan.chunks > 1 ? plan.chunks * C : 0;
}

namespace {
template <class T>
cudaError_t LaunchBiasGrad(float* db, float* scratch, const T* dy, int64_t R, int64_t C, cudaStream_t stream) {
  if (R <= 0 || C <= 0) return cudaSuccess;
  const ColumnSumPlan plan = PlanColumnSums(R, C);
  float* partial = plan.chunks > 1 ? scratch : nullptr;
  const dim3 grid(static_cast<unsigned>(plan.chunks), static_cast<unsigned>(plan.tiles));
  MS_LAUNCH(ew_bias_grad_chunks_kernel<T>, grid, dim3(kColSumCols, kColSumLanes), 0, stream, db, partial, dy, R, C,
            plan.chunk_rows);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || partial == nullptr) return err;
  return FinishColumnSums(db, partial, plan.chunks, C, stream);
}
}  // namespace

cudaError_t BiasGrad(float* db, float* scratch, const float* dy, int64_t R, int64_t C, cudaStream_t stream) {
  return LaunchBiasGrad(db, scratch, dy, R, C, stream);
}
cudaError_t BiasGrad(float* db, float* scratch, const __nv_bfloat16* dy, int64_t R, int64_t C, cudaStream_t stream) {
  return LaunchBiasGrad(db, scratch, dy, R, C, stream);
}

cudaError_t FinishColumnSums(float* db, const float* partial, int64_t chunks, int64_t C, cudaStream_t stream) {
  MS_LAUNCH(ew_bias_grad_finish_kernel, GridFor(C, kBiasGradFinishThreads), kBiasGradFinishThreads, 0, stream, db,
            partial, chunks, C);
  return cudaGetLastError();
}

cudaError_t AddPositions(float* x, const float* wpe, int64_t R, int64_t C, int64_t T, int64_t row0,
                         cudaStream_t stream) {
  if (R <= 0 || C <= 0 || T <= 0) return cudaSuccess;
  MS_LAUNCH(ew_add_positions_kernel, GridFor(R * C, kEwBlock), kEwBlock, 0, stream, x, wpe, R, C, T, row0);
  return cudaGetLastError();
}

cudaError_t PositionsBackward(float* dwpe, const float* dx, int64_t R, int64_t C, int64_t T, int64_t row0,
                              cudaStream_t stream) {
  if (R <= 0 || C <= 0 || T <= 0) return cudaSuccess;
  MS_LAUNCH(ew_positions_backward_kernel, GridFor(T * C, kEwBlock), kEwBlock, 0, stream, dwpe, dx, R, C, T, row0);
  return cudaGetLastError();
}

int64_t SumSquaresScratchDoubles(const int64_t* ns, int count) {
  int64_t chunks = 0;
  for (int i = 0; i < count; ++i) {
    if (ns[i] > 0) chunks += (ns[i] + kSumSquaresChunk - 1) / kSumSquaresChunk;
  }
  return chunks;
}

cudaError_t SumSquaresMulti(double* out_dev, double* scratch, const float* const* xs_host_array,
                            const int64_t* ns_host_array, int count, cudaStream_t stream) {
  int64_t scratch_offset = 0;
  for (int i0 = 0; i0 < count;) {
    // A batch: up to kSumSquaresMaxTensors consecutive vectors (empty ones too: their result is 0) and at
    // most 2^31 - 1 chunk blocks.
    SumSquaresBatch batch{};
    int64_t chunks = 0;
    while (i0 + batch.count < count && batch.count < kSumSquaresMaxTensors) {
      const int64_t n = ns_host_array[i0 + batch.count] > 0 ? ns_host_array[i0 + batch.count] : 0;
      const int64_t nc = (n + kSumSquaresChunk - 1) / kSumSquaresChunk;
      if (batch.count > 0 && chunks + nc > 2147483647) break;
      batch.x[batch.count] = xs_host_array[i0 + batch.count];
      batch.n[batch.count] = n;
      batch.first_chunk[batch.count] = chunks;
      chunks += nc;
      ++batch.count;
    }
    batch.first_chunk[batch.count] = chunks;
    double* partial = scratch + scratch_offset;
    if (chunks > 0) {
      MS_LAUNCH(ew_sumsq_chunks_kernel, static_cast<unsigned>(chunks), kSumSquaresBlock, 0, stream, batch, partial);
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
    MS_LAUNCH(ew_sumsq_finish_kernel, static_cast<unsigned>(batch.count), kSumSquaresFinishThreads, 0, stream, batch,
              static_cast<const double*>(partial), out_dev + i0);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    scratch_offset += chunks;
    i0 += batch.count;
  }
  return cudaSuccess;
}

cudaError_t VocabParallelRowStats(float* mx, float* se, float* tl, const float* logits, const int32_t* targets,
                                  int64_t vstart, int64_t N, int64_t V, cudaStream_t stream) {
  if (N <= 0) return cudaSuccess;
  if (V <= 0) return cudaErrorInvalidValue;
  if (V % 4 == 0 && Aligned16(logits)) {
    MS_LAUNCH(ew_vp_row_stats_kernel<true>, static_cast<unsigned>(N), BlockThreadsFor(V / 4, kVpMaxThreads), 0, stream,
              mx, se, tl, logits, targets, vstart, V);
  } else {
    MS_LAUNCH(ew_vp_row_stats_kernel<false>, static_cast<unsigned>(N), BlockThreadsFor(V, kVpMaxThreads), 0, stream, mx,
              se, tl, logits, targets, vstart, V);
  }
  return cudaGetLastError();
}

cudaError_t VocabParallelRebase(float* se, const float* mx_local, const float* mx_global, int64_t N,
                                cudaStream_t stream) {
  if (N <= 0) return cudaSuccess;
  MS_LAUNCH(ew_vp_rebase_kernel, GridFor(N, kEwBlock), kEwBlock, 0, stream, se, mx_local, mx_global, N);
  return cudaGetLastError();
}

cudaError_t VocabParallelFinish(float* losses, float* lse, const float* mx, const float* se, const float* tl,
                                const int32_t* targets, int64_t N, cudaStream_t stream) {
  if (N <= 0) return cudaSuccess;
  MS_LAUNCH(ew_vp_finish_kernel, GridFor(N, kEwBlock), kEwBlock, 0, stream, losses, lse, mx, se, tl, targets, N);
  return cudaGetLastError();
}

cudaError_t VocabParallelBackward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                                  float dloss, int64_t vstart, int64_t N, int64_t V, cudaStream_t stream,
                                  __nv_bfloat16* d16) {
  if (dlogits == nullptr && d16 == nullptr) return cudaErrorInvalidValue;  // the gradient would be written nowhere
  if (N <= 0 || V <= 0) return cudaSuccess;
  if (V % 4 == 0 && Aligned16(logits)) {
    MS_LAUNCH(ew_vp_backward_kernel<true>, static_cast<unsigned>(N), BlockThreadsFor(V / 4, kVpMaxThreads), 0, stream,
              dlogits, d16, logits, lse, targets, dloss, vstart, V,
              Aligned16(dlogits) && reinterpret_cast<uintptr_t>(d16) % 8 == 0);
  } else {
    MS_LAUNCH(ew_vp_backward_kernel<false>, static_cast<unsigned>(N), BlockThreadsFor(V, kVpMaxThreads), 0, stream,
              dlogits, d16, logits, lse, targets, dloss, vstart, V, false);
  }
  return cudaGetLastError();
}

}  // namespace ms::kernels
