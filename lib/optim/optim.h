// Optimizers (AdamW, LAMB), learning-rate schedules and gradient clipping.
//
// The optimizer sees parameters and gradients as flat buffers with a tensor table (the
// model's ParamInfo list), owns its state (exp_avg, exp_avg_sq: two buffers of the same
// size), and updates the parameters in place.
//
// Gradient norm: the global L2 norm over every gradient, clipped PyTorch-style
// (clip_grad_norm_: coef = max_norm / (norm + 1e-6), applied when coef < 1).
// Weight decay applies only to tensors with weight_decay set (matrices and embeddings).
// LAMB's trust ratio is per tensor: ||p|| / ||u|| (1 when either is 0), computed over the
// whole tensor (the 3D-parallelism issue reduces the shard norms across ranks).
// Determinism: same inputs and thread count -> bitwise identical updates.
#pragma once

#include <vector>

#include "config/config.h"
#include "core/core.h"
#include "model/model.h"

namespace ms::optim {

// Learning rate at `step` (1-based): linear warm-up from lr/warmup to lr over warmup_steps,
// then cosine decay to min_lr at total_steps (or constant lr).
double LearningRate(const config::OptimizerSpec& spec, int64_t step, int64_t total_steps);

class Optimizer {
 public:
  // params: the model's tensor table over `num_floats` floats at `param`/`grad`.
  static Result<std::unique_ptr<Optimizer>> Create(const config::OptimizerSpec& spec,
                                                   const std::vector<model::ParamInfo>& params, int64_t num_floats);
  // Global gradient L2 norm (before clipping).
  double GradNorm(const float* grad) const;
  // Clips (when spec.grad_clip > 0) and applies one update with learning rate `lr`. step is
  // 1-based. Returns the gradient norm before clipping. A non-finite norm is an error
  // (DataLoss: "gradient norm is nan at step N") and leaves the parameters untouched.
  Result<double> Step(float* param, float* grad, int64_t step, double lr);

  // State for checkpoints: exp_avg and exp_avg_sq, num_floats each.
  std::vector<float>& exp_avg() { return m_; }
  std::vector<float>& exp_avg_sq() { return v_; }

 private:
  Optimizer() = default;
  config::OptimizerSpec spec_;
  std::vector<model::ParamInfo> params_;
  std::vector<float> m_, v_, u_;
};

}  // namespace ms::optim
