#include "optim/optim.h"

#include <cmath>

#include "ops/ops.h"

namespace ms::optim {

double LearningRate(const config::OptimizerSpec& spec, int64_t step, int64_t total_steps) {
  const double lr = spec.lr, min_lr = spec.min_lr;
  if (spec.warmup_steps > 0 && step <= spec.warmup_steps) return lr * static_cast<double>(step) / spec.warmup_steps;
  if (spec.schedule == config::ScheduleKind::kConstant) return lr;
  const int64_t decay_steps = total_steps - spec.warmup_steps;
  if (decay_steps <= 0) return lr;
  double progress = static_cast<double>(step - spec.warmup_steps) / decay_steps;
  progress = std::clamp(progress, 0.0, 1.0);
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

Result<std::unique_ptr<Optimizer>> Optimizer::Create(const config::OptimizerSpec& spec,
                                                     const std::vector<model::ParamInfo>& params, int64_t num_floats) {
  for (const auto& p : params) {
    if (p.offset < 0 || p.offset + p.numel > num_floats) {
      return Internal("tensor {} [{}, +{}) lies outside the {} floats of the parameter buffer", p.name, p.offset,
                      p.numel, num_floats);
    }
  }
  std::unique_ptr<Optimizer> o(new Optimizer());
  o->spec_ = spec;
  o->params_ = params;
  o->m_.assign(num_floats, 0.0f);
  o->v_.assign(num_floats, 0.0f);
  if (spec.kind == config::OptimizerKind::kLamb) o->u_.assign(num_floats, 0.0f);
  return o;
}

double Optimizer::GradNorm(const float* grad) const {
  double sq = 0;
  for (const auto& p : params_) sq += ops::SumSquares(grad + p.offset, p.numel);
  return std::sqrt(sq);
}

Result<double> Optimizer::Step(float* param, float* grad, int64_t step, double lr) {
  const double norm = GradNorm(grad);
  if (!std::isfinite(norm)) return DataLoss("gradient norm is {} at step {}; parameters left unchanged", norm, step);
  if (spec_.grad_clip > 0) {
    const double coef = spec_.grad_clip / (norm + 1e-6);
    if (coef < 1.0) {
      for (const auto& p : params_) ops::Scale(grad + p.offset, static_cast<float>(coef), p.numel);
    }
  }
  for (const auto& p : params_) {
    ops::AdamParams hp{static_cast<float>(lr), spec_.beta1, spec_.beta2, spec_.eps,
                       p.weight_decay ? spec_.weight_decay : 0.0f};
    float* w = param + p.offset;
    const float* g = grad + p.offset;
    float* m = m_.data() + p.offset;
    float* v = v_.data() + p.offset;
    if (spec_.kind == config::OptimizerKind::kAdamW) {
      ops::AdamWStep(w, g, m, v, p.numel, hp, step);
    } else {
      float* u = u_.data() + p.offset;
      ops::LambDirection(u, w, g, m, v, p.numel, hp, step);
      const double wn = std::sqrt(ops::SumSquares(w, p.numel));
      const double un = std::sqrt(ops::SumSquares(u, p.numel));
      const double trust = (wn > 0 && un > 0) ? wn / un : 1.0;
      ops::LambApply(w, u, p.numel, static_cast<float>(lr), static_cast<float>(trust));
    }
  }
  return norm;
}

}  // namespace ms::optim
