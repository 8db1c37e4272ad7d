// defines: lamb_direction_kernel, lamb_apply_kernel and their launchers (LambDirectionMultiTensor, LambApply,
// declared in kernels/elementwise.h): LAMB (You et al. 2019) split as ms::ops::LambDirection / LambApply, so that
// the trust ratio can use norms reduced across shards (SumSquaresMulti + an all-reduce in between); LambApply may
// write the bf16 rounding of the updated parameters (the GEMMs' weight copy) as it stores them.
#include <cmath>

#include "common.cuh"
#include "kernels.h"
#include "multi_tensor.cuh"

namespace ms::kernels {

constexpr int kLambMaxTensors = 24;  // tensors per launch (the list travels in the kernel parameters)
constexpr int kLambBlock = 256;      // threads per block
constexpr int kLambPerThread = 4;    // elements per thread per block chunk
constexpr int64_t kLambChunk = kLambBlock * kLambPerThread;

using LambBatch = TensorBatch<LambTensor, kLambMaxTensors>;

// Scalars computed once on the host in double and rounded to float, as ms::ops::LambDirection does.
struct LambScalars {
  float w1;  // 1 - beta1 (lerp weight)
  float beta2;
  float w2;       // 1 - beta2
  float inv_bc1;  // 1 / (1 - beta1^step)
  float inv_bc2;  // 1 / (1 - beta2^step)
  float eps;
  float weight_decay;
};

// ---- kernels ----

__global__ void __launch_bounds__(kLambBlock) lamb_direction_kernel(LambBatch batch, LambScalars s) {
  const int k = BatchTensorOf(batch, blockIdx.x);
  const LambTensor& t = batch.t[k];
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - batch.first_block[k]) * kLambChunk;
  const int64_t end = begin + kLambChunk < t.n ? begin + kLambChunk : t.n;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float g = t.g[i];
    const float m = TorchLerp(t.m[i], g, s.w1);       // m = lerp(m, g, 1 - beta1)
    const float v = t.v[i] * s.beta2 + s.w2 * g * g;  // v = v * beta2 + (1 - beta2) * g * g
    t.u[i] = (m * s.inv_bc1) / (sqrtf(v * s.inv_bc2) + s.eps) + s.weight_decay * t.p[i];
    t.m[i] = m;
    t.v[i] = v;
  }
}

// p (n) += a * u (n), a = -lr * trust_ratio (rounded to float on the host); p16 (n), unless null, = the updated p
// rounded to bf16 (as CastFloatToBf16).
__global__ void __launch_bounds__(kLambBlock)
    lamb_apply_kernel(float* p, const float* u, float a, int64_t n, __nv_bfloat16* p16) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float p_new = p[i] + a * u[i];
    p[i] = p_new;
    if (p16 != nullptr) p16[i] = __float2bfloat16_rn(p_new);
  }
}

// ---- launchers ----

cudaError_t LambDirectionMultiTensor(const LambTensor* tensors, int count, const AdamWHyper& hp, int64_t step,
                                     cudaStream_t stream) {
  const double b1 = hp.beta1, b2 = hp.beta2;
  LambScalars s;
  s.w1 = static_cast<float>(1.0 - b1);
  s.beta2 = hp.beta2;
  s.w2 = static_cast<float>(1.0 - b2);
  s.inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(b1, static_cast<double>(step))));
  s.inv_bc2 = static_cast<float>(1.0 / (1.0 - std::pow(b2, static_cast<double>(step))));
  s.eps = hp.eps;
  s.weight_decay = hp.weight_decay;
  return LaunchTensorBatches<kLambMaxTensors>(tensors, count, kLambChunk, [&](const LambBatch& batch, int64_t blocks) {
    MS_LAUNCH(lamb_direction_kernel, static_cast<unsigned>(blocks), kLambBlock, 0, stream, batch, s);
    return cudaGetLastError();
  });
}

cudaError_t LambApply(float* p, const float* u, int64_t n, float lr, float trust_ratio, cudaStream_t stream,
                      __nv_bfloat16* p16) {
  if (n <= 0) return cudaSuccess;
  const float a = -lr * trust_ratio;
  MS_LAUNCH(lamb_apply_kernel, GridFor(n, kLambBlock), kLambBlock, 0, stream, p, u, a, n, p16);
  return cudaGetLastError();
}

}  // namespace ms::kernels
