// Fast optimizer updates: AdamW (torch.optim.AdamW's order of operations) and the two halves of LAMB.
#include <cmath>

#include "ops/kernels_cpu.h"
#include "ops/ops.h"

namespace ms::ops {
namespace {

using internal::kParallelMin;

// torch.lerp(start, end, weight) for float tensors.
inline float Lerp(float start, float end, float weight) {
  return weight < 0.5f ? start + weight * (end - start) : end - (end - start) * (1.0f - weight);
}

}  // namespace

void AdamWStep(float* p, const float* g, float* m, float* v, int64_t n, const AdamParams& hp, int64_t step) {
  // Scalars as torch computes them from Python floats (double), then rounded to float in the kernels.
  const double b1 = hp.beta1, b2 = hp.beta2;
  const float decay = static_cast<float>(1.0 - static_cast<double>(hp.lr) * hp.weight_decay);
  const float w1 = static_cast<float>(1.0 - b1);
  const float fb2 = hp.beta2;
  const float w2 = static_cast<float>(1.0 - b2);
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(step));
  const float neg_step_size = static_cast<float>(-(hp.lr / bc1));
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float eps = hp.eps;
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float pi = p[i] * decay;                       // param.mul_(1 - lr * wd)
    const float mi = Lerp(m[i], g[i], w1);               // exp_avg.lerp_(grad, 1 - beta1)
    const float vi = v[i] * fb2 + w2 * g[i] * g[i];      // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;  // (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    p[i] = pi + neg_step_size * mi / denom;              // param.addcdiv_(exp_avg, denom, value=-step_size)
    m[i] = mi;
    v[i] = vi;
  }
}

void LambDirection(float* u, const float* p, const float* g, float* m, float* v, int64_t n, const AdamParams& hp,
                   int64_t step) {
  const double b1 = hp.beta1, b2 = hp.beta2;
  const float w1 = static_cast<float>(1.0 - b1);
  const float fb2 = hp.beta2;
  const float w2 = static_cast<float>(1.0 - b2);
  const float inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(b1, static_cast<double>(step))));
  const float inv_bc2 = static_cast<float>(1.0 / (1.0 - std::pow(b2, static_cast<double>(step))));
  const float eps = hp.eps, wd = hp.weight_decay;
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float mi = Lerp(m[i], g[i], w1);
    const float vi = v[i] * fb2 + w2 * g[i] * g[i];
    u[i] = (mi * inv_bc1) / (std::sqrt(vi * inv_bc2) + eps) + wd * p[i];
    m[i] = mi;
    v[i] = vi;
  }
}

void LambApply(float* p, const float* u, int64_t n, float lr, float trust_ratio) {
  const float a = -lr * trust_ratio;
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) p[i] += a * u[i];
}

float LambTrustRatio(double param_sq, double update_sq) {
  return param_sq > 0.0 && update_sq > 0.0 ? static_cast<float>(std::sqrt(param_sq / update_sq)) : 1.0f;
}

}  // namespace ms::ops
