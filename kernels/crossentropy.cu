// defines: crossentropy_forward_kernel, crossentropy_backward_kernel, crossentropy_fused_kernel and their
// launchers (CrossEntropyForward, CrossEntropyBackward, CrossEntropyFused): softmax cross-entropy over rows of
// logits, with the per-row log-sum-exp saved for the backward pass, as ms::ops::CrossEntropyForward/Backward/Fused.
#include "common.cuh"
#include "kernels.h"

namespace ms::kernels {

constexpr int kCeMaxBlock = 512;  // the most threads a row block gets (BlockThreadsFor(V, kCeMaxBlock))

// ---- kernels ----

namespace {
// log(sum_j exp(l[j])) of a row of V, by the whole block: block max, then block sum of exp(l - max); every thread
// gets it (the block reductions end with a barrier). scratch: 32 floats of shared memory.
__device__ __forceinline__ float RowLogSumExp(const float* l, int V, float* scratch) {
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, l[j]);
  mx = BlockMax(mx, scratch);
  float sum = 0.0f;
  for (int j = threadIdx.x; j < V; j += blockDim.x) sum += expf(l[j] - mx);
  return mx + logf(BlockSum(sum, scratch));
}
}  // namespace

// One block per row: the row's log-sum-exp and loss. losses, lse: (N); logits: (N, V); targets: (N), < 0 ignored
// (loss 0, lse still written).
__global__ void __launch_bounds__(kCeMaxBlock)
    crossentropy_forward_kernel(float* losses, float* lse, const float* logits, const int* targets, int V) {
  MS_SHARED_ARRAY(float, scratch, 32);
  const long row = blockIdx.x;
  const float* l = logits + row * V;
  const float z = RowLogSumExp(l, V, scratch);
  if (threadIdx.x == 0) {
    const int t = targets[row];
    lse[row] = z;
    losses[row] = t < 0 ? 0.0f : z - l[t];
  }
}

// One block per row: dlogits (N, V) = (exp(l - lse) - onehot(target)) * dloss[row]; ignored rows get 0; d16 (N, V),
// unless null, = dlogits rounded to bf16; dlogits may be null when d16 is not.
__global__ void __launch_bounds__(kCeMaxBlock)
    crossentropy_backward_kernel(float* dlogits, __nv_bfloat16* d16, const float* logits, const float* lse,
                                 const int* targets, const float* dloss, int V) {
  const long row = blockIdx.x;
  const int t = targets[row];
  const float z = lse[row], scale = dloss[row];
  const float* l = logits + row * V;
  float* d = dlogits ? dlogits + row * V : nullptr;
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    const float v = t < 0 ? 0.0f : (expf(l[j] - z) - (j == t ? 1.0f : 0.0f)) * scale;
    if (d) d[j] = v;
    if (d16) d16[row * V + j] = __float2bfloat16_rn(v);
  }
}

// One block per row: the forward above, then the backward written over the row (dlogits in place of the logits):
// losses, lse (N) WRITTEN; logits (N, V) OVERWRITTEN (left as they are when !fp32: then only d16 is written). The
// same arithmetic as the two kernels (bit-identical); the block reads its row three times, the last two normally
// from L2, and writes it once, where the pair of kernels read it three times from HBM (the backward a whole pass
// later) and wrote a separate dlogits.
__global__ void __launch_bounds__(kCeMaxBlock)
    crossentropy_fused_kernel(float* losses, float* lse, float* logits, __nv_bfloat16* d16, const int* targets,
                              const float* dloss, int V, bool fp32) {
  MS_SHARED_ARRAY(float, scratch, 32);
  const long row = blockIdx.x;
  float* l = logits + row * V;
  const float z = RowLogSumExp(l, V, scratch);
  const int t = targets[row];
  if (threadIdx.x == 0) {
    lse[row] = z;
    losses[row] = t < 0 ? 0.0f : z - l[t];
  }
  __syncthreads();  // the target logit is read before any thread overwrites it
  const float scale = dloss[row];
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    const float v = t < 0 ? 0.0f : (expf(l[j] - z) - (j == t ? 1.0f : 0.0f)) * scale;
    if (fp32) l[j] = v;
    if (d16) d16[row * V + j] = __float2bfloat16_rn(v);
  }
}

// ---- launchers ----

cudaError_t CrossEntropyForward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                                int64_t V, cudaStream_t stream) {
  if (N <= 0 || V <= 0) return cudaSuccess;
  MS_LAUNCH(crossentropy_forward_kernel, static_cast<unsigned>(N), BlockThreadsFor(V, kCeMaxBlock), 0, stream, losses,
            lse, logits, targets, static_cast<int>(V));
  return cudaGetLastError();
}

cudaError_t CrossEntropyBackward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                                 const float* dloss, int64_t N, int64_t V, cudaStream_t stream, __nv_bfloat16* d16) {
  if (dlogits == nullptr && d16 == nullptr) return cudaErrorInvalidValue;  // the gradient would be written nowhere
  if (N <= 0 || V <= 0) return cudaSuccess;
  MS_LAUNCH(crossentropy_backward_kernel, static_cast<unsigned>(N), BlockThreadsFor(V, kCeMaxBlock), 0, stream, dlogits,
            d16, logits, lse, targets, dloss, static_cast<int>(V));
  return cudaGetLastError();
}

cudaError_t CrossEntropyFused(float* losses, float* lse, float* logits, const int32_t* targets, const float* dloss,
                              int64_t N, int64_t V, cudaStream_t stream, __nv_bfloat16* d16, bool fp32_dlogits) {
  if (!fp32_dlogits && d16 == nullptr) return cudaErrorInvalidValue;  // the gradient would be written nowhere
  if (N <= 0 || V <= 0) return cudaSuccess;
  MS_LAUNCH(crossentropy_fused_kernel, static_cast<unsigned>(N), BlockThreadsFor(V, kCeMaxBlock), 0, stream, losses,
            lse, logits, d16, targets, dloss, static_cast<int>(V), fp32_dlogits);
  return cudaGetLastError();
}

}  // namespace ms::kernels
