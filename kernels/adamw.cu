// defines: adamw_kernel and its launcher AdamWMultiTensor: one fused AdamW step over a list of tensors, in
// torch.optim.AdamW's order of operations (as ms::ops::AdamWStep's fast path, in fp32), optionally writing the
// bf16 rounding of each updated parameter (the GEMMs' weight copy) as it stores it.
#include <cmath>

#include "common.cuh"
#include "kernels.h"
#include "multi_tensor.cuh"

namespace ms::kernels {

constexpr int kAdamWMaxTensors = 24;  // tensors per launch (the list travels in the kernel parameters)
constexpr int kAdamWBlock = 256;      // threads per block
constexpr int kAdamWPerThread = 4;    // elements per thread per block chunk
constexpr int64_t kAdamWChunk = kAdamWBlock * kAdamWPerThread;

using AdamWBatch = TensorBatch<AdamWTensor, kAdamWMaxTensors>;

// Scalars computed once on the host in double and rounded to float, as torch does.
struct AdamWScalars {
  float decay;  // 1 - lr * wd
  float w1;     // 1 - beta1 (lerp weight)
  float beta2;
  float w2;             // 1 - beta2
  float neg_step_size;  // -lr / (1 - beta1^step)
  float bc2_sqrt;       // sqrt(1 - beta2^step)
  float eps;
};

// ---- kernels ----

__global__ void __launch_bounds__(kAdamWBlock) adamw_kernel(AdamWBatch batch, AdamWScalars s) {
  const int k = BatchTensorOf(batch, blockIdx.x);
  const AdamWTensor& t = batch.t[k];
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - batch.first_block[k]) * kAdamWChunk;
  const int64_t end = begin + kAdamWChunk < t.n ? begin + kAdamWChunk : t.n;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float g = t.g[i];
    const float p = t.p[i] * s.decay;                     // param.mul_(1 - lr * wd)
    const float m = TorchLerp(t.m[i], g, s.w1);           // exp_avg.lerp_(grad, 1 - beta1)
    const float v = t.v[i] * s.beta2 + s.w2 * g * g;      // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
    const float denom = sqrtf(v) / s.bc2_sqrt + s.eps;    // (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    const float p_new = p + s.neg_step_size * m / denom;  // param.addcdiv_(exp_avg, denom, value=-step_size)
    t.p[i] = p_new;
    if (t.p16 != nullptr) t.p16[i] = __float2bfloat16_rn(p_new);  // the bf16 weight copy, as CastFloatToBf16
    t.m[i] = m;
    t.v[i] = v;
  }
}

// ---- launchers ----

cudaError_t AdamWMultiTensor(const AdamWTensor* tensors, int count, const AdamWHyper& hp, int64_t step,
                             cudaStream_t stream) {
  const double b1 = hp.beta1, b2 = hp.beta2;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(step));
  AdamWScalars s;
  s.decay = static_cast<float>(1.0 - static_cast<double>(hp.lr) * hp.weight_decay);
  s.w1 = static_cast<float>(1.0 - b1);
  s.beta2 = hp.beta2;
  s.w2 = static_cast<float>(1.0 - b2);
  s.neg_step_size = static_cast<float>(-(hp.lr / bc1));
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.eps = hp.eps;
  return LaunchTensorBatches<kAdamWMaxTensors>(
      tensors, count, kAdamWChunk, [&](const AdamWBatch& batch, int64_t blocks) {
        MS_LAUNCH(adamw_kernel, static_cast<unsigned>(blocks), kAdamWBlock, 0, stream, batch, s);
        return cudaGetLastError();
      });
}

}  // namespace ms::kernels
