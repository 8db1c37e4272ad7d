// Optimizers (AdamW, LAMB), learning-rate schedules and gradient clipping, for whole tensors
// or for the shards a rank owns under ZeRO.
//
// The optimizer updates SEGMENTS: contiguous element ranges [begin, begin+len) of the
// rank-local (TP-sharded) tensors of the model. Single rank: one segment per tensor. ZeRO:
// the ranges this data-parallel rank owns. It owns the state of its segments (exp_avg,
// exp_avg_sq), in segment order.
//
// Norms that span ranks are reduced by a caller-supplied Reducer (an all-reduce sum over
// the world; the identity on one rank). Each element of the model must be counted exactly
// once over the world, so a segment says whether it counts (`count`): replicas (a tied
// embedding's copy on the last pipeline stage, replicated tensors on tp ranks > 0, data-
// parallel copies) do not.
//   gradient norm: global L2 norm, clipped PyTorch-style (clip_grad_norm_: coef =
//     max_norm / (norm + 1e-6), applied when coef < 1);
//   LAMB: trust ratio per GLOBAL tensor, ||p|| / ||u|| over the whole tensor (1 when either
//     is 0), from per-tensor partial sums reduced across every shard.
// Weight decay applies only to tensors with weight_decay set (matrices and embeddings).
// Determinism: same inputs, layout and thread count -> bitwise identical updates.
#pragma once

#include <functional>
#include <map>
#include <vector>

#include "config/config.h"
#include "core/core.h"
#include "model/model.h"

namespace ms::optim {

// Learning rate at `step` (1-based): linear warm-up from lr/warmup to lr over warmup_steps,
// then cosine decay to min_lr at total_steps (or constant lr).
double LearningRate(const config::OptimizerSpec& spec, int64_t step, int64_t total_steps);

struct Segment {
  int param = 0;      // index into the model's params()
  int64_t begin = 0;  // element range within the rank-local tensor
  int64_t len = 0;
  bool count = true;  // contributes to global norms (see above)
};

// Where a step finds the segments' data: parameters and (reduced) gradients; param16, unless null, where the
// step writes the bf16 rounding of the updated parameters (the model's bf16 weight copy, model::Gpt::
// bf16_param_data(); backends that keep bf16 copies only), so that no cast kernel makes it at the next step.
struct SegmentData {
  float* param = nullptr;
  float* grad = nullptr;
  void* param16 = nullptr;
};

// All-reduce (sum) of a vector of doubles over every rank of the job; identity on one rank.
using Reducer = std::function<Status(std::vector<double>*)>;
Status IdentityReducer(std::vector<double>*);

// One segment per tensor, every one counted: the single-rank layout.
std::vector<Segment> WholeTensorSegments(const std::vector<model::ParamInfo>& params);

// SegmentData for WholeTensorSegments over the model's flat buffers.
std::vector<SegmentData> WholeTensorData(const std::vector<model::ParamInfo>& params, float* param, float* grad);

class Optimizer {
 public:
  // all_tensor_names: model::AllTensorNames(spec), the index space of per-tensor norms. The state (exp_avg,
  // exp_avg_sq, LAMB's update) lives on the backend's device and every update runs on the backend as
  // multi-tensor steps; null: the CPU backend on host memory. The backend must outlive the optimizer.
  static Result<std::unique_ptr<Optimizer>> Create(const config::OptimizerSpec& spec,
                                                   const std::vector<model::ParamInfo>& params,
                                                   std::vector<Segment> segments,
                                                   const std::vector<std::string>& all_tensor_names,
                                                   ops::Backend* backend = nullptr);
  // Clips (when grad_clip > 0) and applies one update with learning rate `lr` (step is 1-based)
  // to every segment; data[i] locates segment i. Returns the global gradient norm before
  // clipping. A non-finite norm is DataLoss ("gradient norm is nan at step N") and changes nothing.
  Result<double> Step(const std::vector<SegmentData>& data, int64_t step, double lr, const Reducer& reduce);

  const std::vector<Segment>& segments() const { return segments_; }
  // State for checkpoints: exp_avg and exp_avg_sq of segment i start at state_offset(i).
  // (memory of the backend's device).
  model::DeviceArray<float>& exp_avg() { return m_; }
  model::DeviceArray<float>& exp_avg_sq() { return v_; }
  int64_t state_offset(size_t i) const { return state_offsets_[i]; }

 private:
  Optimizer() = default;
  config::OptimizerSpec spec_;
  std::vector<model::ParamInfo> params_;
  std::vector<Segment> segments_;
  std::vector<int64_t> state_offsets_;
  std::vector<int> tensor_id_;  // per segment: index into all_tensor_names
  int num_tensors_ = 0;
  std::unique_ptr<device::Device> own_device_;
  std::unique_ptr<ops::Backend> own_be_;
  ops::Backend* be_ = nullptr;
  model::DeviceArray<float> m_, v_, u_;
};

}  // namespace ms::optim
