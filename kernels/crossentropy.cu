// defines: crossentropy_forward_kernel, crossentropy_backward_kernel, crossentropy_fused_kernel and their
// launchers (CrossEntropyForward, CrossEntropyBackward, CrossEntropyFused): softmax cross-entropy over rows of
// logits, with the per-row log-sum-exp saved for the backward pass, as ms::ops::CrossEntropyForward/Backward/Fused.
// The kernels are templates on the logits' type: fp32, or bf16 (runtime.activations: bf16, the classifier GEMM
// writing its logits in bf16; widened exactly), and take the number of valid columns Vv <= V (the stride): columns
// from Vv on (the vocabulary padding) are out of the softmax and get a zero gradient.
#include <type_traits>

#include "common.cuh"
#include "kernels.h"

namespace ms::kernels {

constexpr int kCeMaxBlock = 512;  // the most threads a row block gets (BlockThreadsFor(V, kCeMaxBlock))

// ---- kernels ----

namespace {
__device__ __forceinline__ float Logit(float v) {
  return v;
}
__device__ __forceinline__ float Logit(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

// log(sum_j exp(l[j])) over the first Vv of a row, by the whole block: block max, then block sum of exp(l - max);
// every thread gets it (the block reductions end with a barrier). scratch: 32 floats of shared memory.
template <class L>
__device__ __forceinline__ float RowLogSumExp(const L* l, int Vv, float* scratch) {
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < Vv; j += blockDim.x) mx = fmaxf(mx, Logit(l[j]));
  mx = BlockMax(mx, scratch);
  float sum = 0.0f;
  for (int j = threadIdx.x; j < Vv; j += blockDim.x) sum += expf(Logit(l[j]) - mx);
  return mx + logf(BlockSum(sum, scratch));
}
}  // namespace

// One block per row: the row's log-sum-exp and loss. losses, lse: (N); logits: (N, V); targets: (N), < 0 ignored
// (loss 0, lse still written).
template <class L>
__global__ void __launch_bounds__(kCeMaxBlock)
    crossentropy_forward_kernel(float* losses, float* lse, const L* logits, const int* targets, int V, int Vv) {
  MS_SHARED_ARRAY(float, scratch, 32);
  const long row = blockIdx.x;
  const L* l = logits + row * V;
  const float z = RowLogSumExp(l, Vv, scratch);
  if (threadIdx.x == 0) {
    const int t = targets[row];
    lse[row] = z;
    losses[row] = t < 0 ? 0.0f : z - Logit(l[t]);
  }
}

// One block per row: dlogits (N, V) = (exp(l - lse) - onehot(target)) * dloss[row]; ignored rows and padding columns
// get 0; d16 (N, V), unless null, = dlogits rounded to bf16; dlogits may be null when d16 is not. d16 may be the
// bf16 logits themselves (each element read before it is written, by the same thread).
template <class L>
__global__ void __launch_bounds__(kCeMaxBlock)
    crossentropy_backward_kernel(float* dlogits, __nv_bfloat16* d16, const L* logits, const float* lse,
                                 const int* targets, const float* dloss, int V, int Vv) {
  const long row = blockIdx.x;
  const int t = targets[row];
  const float z = lse[row], scale = dloss[row];
  const L* l = logits + row * V;
  float* d = dlogits ? dlogits + row * V : nullptr;
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    const float v = t < 0 || j >= Vv ? 0.0f : (expf(Logit(l[j]) - z) - (j == t ? 1.0f : 0.0f)) * scale;
    if (d) d[j] = v;
    if (d16) d16[row * V + j] = __float2bfloat16_rn(v);
  }
}

// One block per row: the forward above, then the backward written over the row (dlogits in place of the logits):
// losses, lse (N) WRITTEN; fp32 logits (N, V) OVERWRITTEN (left as they are when !fp32: then only d16 is written);
// bf16 logits: d16 may be the logits themselves. The same arithmetic as the two kernels (bit-identical); the block
// reads its row three times, the last two normally from L2, and writes it once, where the pair of kernels read it
// three times from HBM (the backward a whole pass later) and wrote a separate dlogits.
template <class L>
__global__ void __launch_bounds__(kCeMaxBlock)
    crossentropy_fused_kernel(float* losses, float* lse, L* logits, __nv_bfloat16* d16, const int* targets,
                              const float* dloss, int V, int Vv, bool fp32) {
  MS_SHARED_ARRAY(float, scratch, 32);
  const long row = blockIdx.x;
  L* l = logits + row * V;
  const float z = RowLogSumExp(l, Vv, scratch);
  const int t = targets[row];
  if (threadIdx.x == 0) {
    lse[row] = z;
    losses[row] = t < 0 ? 0.0f : z - Logit(l[t]);
  }
  __syncthreads();  // the target logit is read before any thread overwrites it
  const float scale = dloss[row];
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    const float v = t < 0 || j >= Vv ? 0.0f : (expf(Logit(l[j]) - z) - (j == t ? 1.0f : 0.0f)) * scale;
    if constexpr (std::is_same_v<L, float>) {
      if (fp32) l[j] = v;
    }
    if (d16) d16[row * V + j] = __float2bfloat16_rn(v);
  }
}

// ---- launchers ----

namespace {
bool BadColumns(int64_t V, int64_t Vv) {
  return Vv < 1 || Vv > V;
}
}  // namespace

cudaError_t CrossEntropyForward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                                int64_t V, cudaStream_t stream) {
  if (N <= 0 || V <= 0) return cudaSuccess;
  MS_LAUNCH(crossentropy_forward_kernel<float>, static_cast<unsigned>(N), BlockThreadsFor(V, kCeMaxBlock), 0, stream,
            losses, lse, logits, targets, static_cast<int>(V), static_cast<int>(V));
  return cudaGetLastError();
}

cudaError_t CrossEntropyBackward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                                 const float* dloss, int64_t N, int64_t V, cudaStream_t stream, __nv_bfloat16* d16) {
  if (dlogits == nullptr && d16 == nullptr) return cudaErrorInvalidValue;  // the gradient would be written nowhere
  if (N <= 0 || V <= 0) return cudaSuccess;
  MS_LAUNCH(crossentropy_backward_kernel<float>, static_cast<unsigned>(N), BlockThreadsFor(V, kCeMaxBlock), 0, stream,
            dlogits, d16, logits, lse, targets, dloss, static_cast<int>(V), static_cast<int>(V));
  return cudaGetLastError();
}

cudaError_t CrossEntropyFused(float* losses, float* lse, float* logits, const int32_t* targets, const float* dloss,
                              int64_t N, int64_t V, cudaStream_t stream, __nv_bfloat16* d16, bool fp32_dlogits) {
  if (!fp32_dlogits && d16 == nullptr) return cudaErrorInvalidValue;  // the gradient would be written nowhere
  if (N <= 0 || V <= 0) return cudaSuccess;
  MS_LAUNCH(crossentropy_fused_kernel<float>, static_cast<unsigned>(N), BlockThreadsFor(V, kCeMaxBlock), 0, stream,
            losses, lse, logits, d16, targets, dloss, static_cast<int>(V), static_cast<int>(V), fp32_dlogits);
  return cudaGetLastError();
}

cudaError_t CrossEntropyForward(float* losses, float* lse, const __nv_bfloat16* logits, const int32_t* targets,
                                int64_t N, int64_t V, int64_t Vv, cudaStream_t stream) {
  if (N <= 0 || V <= 0) return cudaSuccess;
  if (BadColumns(V, Vv)) return cudaErrorInvalidValue;
  MS_LAUNCH(crossentropy_forward_kernel<__nv_bfloat16>, static_cast<unsigned>(N), BlockThreadsFor(V, kCeMaxBlock), 0,
            stream, losses, lse, logits, targets, static_cast<int>(V), static_cast<int>(Vv));
  return cudaGetLastError();
}

cudaError_t CrossEntropyBackward(__nv_bfloat16* d16, const __nv_bfloat16* logits, const float* lse,
                                 const int32_t* targets, const float* dloss, int64_t N, int64_t V, int64_t Vv,
                                 cudaStream_t stream) {
  if (d16 == nullptr) return cudaErrorInvalidValue;
  if (N <= 0 || V <= 0) return cudaSuccess;
  if (BadColumns(V, Vv)) return cudaErrorInvalidValue;
  MS_LAUNCH(crossentropy_backward_kernel<__nv_bfloat16>, static_cast<unsigned>(N), BlockThreadsFor(V, kCeMaxBlock), 0,
            stream, static_cast<float*>(nullptr), d16, logits, lse, targets, dloss, static_cast<int>(V),
            static_cast<int>(Vv));
  return cudaGetLastError();
}

cudaError_t CrossEntropyFused(float* losses, float* lse, __nv_bfloat16* logits, const int32_t* targets,
                              const float* dloss, int64_t N, int64_t V, int64_t Vv, cudaStream_t stream) {
  if (N <= 0 || V <= 0) return cudaSuccess;
  if (BadColumns(V, Vv)) return cudaErrorInvalidValue;
  MS_LAUNCH(crossentropy_fused_kernel<__nv_bfloat16>, static_cast<unsigned>(N), BlockThreadsFor(V, kCeMaxBlock), 0,
            stream, losses, lse, logits, logits, targets, dloss, static_cast<int>(V), static_cast<int>(Vv), false);
  return cudaGetLastError();
}

}  // namespace ms::kernels
