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

Status IdentityReducer(std::vector<double>*) {
  return Status::Ok();
}

std::vector<Segment> WholeTensorSegments(const std::vector<model::ParamInfo>& params) {
  std::vector<Segment> segs;
  for (size_t i = 0; i < params.size(); ++i) segs.push_back({static_cast<int>(i), 0, params[i].numel, true});
  return segs;
}

std::vector<SegmentData> WholeTensorData(const std::vector<model::ParamInfo>& params, float* param, float* grad) {
  std::vector<SegmentData> d;
  for (const auto& p : params) d.push_back({param + p.offset, grad + p.offset});
  return d;
}

Result<std::unique_ptr<Optimizer>> Optimizer::Create(const config::OptimizerSpec& spec,
                                                     const std::vector<model::ParamInfo>& params,
                                                     std::vector<Segment> segments,
                                                     const std::vector<std::string>& all_tensor_names,
                                                     ops::Backend* backend) {
  std::unique_ptr<Optimizer> o(new Optimizer());
  if (backend) {
    o->be_ = backend;
  } else {
    o->own_device_ = device::MakeCpuDevice();
    o->own_be_ = ops::MakeCpuBackend(o->own_device_.get());
    o->be_ = o->own_be_.get();
  }
  std::map<std::string, int> ids;
  for (size_t i = 0; i < all_tensor_names.size(); ++i) ids[all_tensor_names[i]] = static_cast<int>(i);
  int64_t total = 0;
  for (const auto& s : segments) {
    if (s.param < 0 || static_cast<size_t>(s.param) >= params.size()) {
      return Internal("optimizer segment names parameter {} of {}", s.param, params.size());
    }
    const auto& p = params[s.param];
    if (s.begin < 0 || s.len < 0 || s.begin + s.len > p.numel) {
      return Internal("optimizer segment [{}, +{}) outside tensor {} of {} elements", s.begin, s.len, p.name, p.numel);
    }
    auto it = ids.find(p.name);
    if (it == ids.end()) return Internal("tensor {} is not among the model's tensor names", p.name);
    o->tensor_id_.push_back(it->second);
    o->state_offsets_.push_back(total);
    total += s.len;
  }
  o->spec_ = spec;
  o->params_ = params;
  o->segments_ = std::move(segments);
  o->num_tensors_ = static_cast<int>(all_tensor_names.size());
  MS_RETURN_IF_ERROR_CTX(o->m_.Allocate(o->be_, total), "optimizer state exp_avg");
  MS_RETURN_IF_ERROR_CTX(o->v_.Allocate(o->be_, total), "optimizer state exp_avg_sq");
  if (spec.kind == config::OptimizerKind::kLamb) {
    MS_RETURN_IF_ERROR_CTX(o->u_.Allocate(o->be_, total), "LAMB update buffer");
  }
  return o;
}

Result<double> Optimizer::Step(const std::vector<SegmentData>& data, int64_t step, double lr, const Reducer& reduce) {
  if (data.size() != segments_.size()) {
    return Internal("optimizer step got {} segments, expected {}", data.size(), segments_.size());
  }
  // Squared norms of the gradient segments, in segment order (each in double, as ops::SumSquares).
  std::vector<const float*> xs;
  std::vector<int64_t> ns;
  for (size_t i = 0; i < segments_.size(); ++i) {
    if (!segments_[i].count) continue;
    xs.push_back(data[i].grad);
    ns.push_back(segments_[i].len);
  }
  std::vector<double> parts(xs.size());
  MS_RETURN_IF_ERROR_CTX(be_->SumSquares(xs.data(), ns.data(), static_cast<int>(xs.size()), parts.data()),
                         "gradient norm");
  std::vector<double> sq(1, 0.0);
  for (double v : parts) sq[0] += v;
  MS_RETURN_IF_ERROR_CTX(reduce(&sq), "reducing the gradient norm");
  const double norm = std::sqrt(sq[0]);
  if (!std::isfinite(norm)) return DataLoss("gradient norm is {} at step {}; parameters left unchanged", norm, step);
  if (spec_.grad_clip > 0) {
    const double coef = spec_.grad_clip / (norm + 1e-6);
    if (coef < 1.0) {
      for (size_t i = 0; i < segments_.size(); ++i) {
        MS_RETURN_IF_ERROR(be_->Scale(data[i].grad, static_cast<float>(coef), segments_[i].len));
      }
    }
  }
  auto hparams = [&](size_t i) {
    const auto& p = params_[segments_[i].param];
    return ops::AdamParams{static_cast<float>(lr), spec_.beta1, spec_.beta2, spec_.eps,
                           p.weight_decay ? spec_.weight_decay : 0.0f};
  };
  if (spec_.kind == config::OptimizerKind::kAdamW) {
    std::vector<ops::AdamWTensor> list;
    for (size_t i = 0; i < segments_.size(); ++i) {
      const int64_t o = state_offsets_[i];
      list.push_back(
          {data[i].param, data[i].grad, m_.data() + o, v_.data() + o, segments_[i].len, hparams(i), data[i].param16});
    }
    MS_RETURN_IF_ERROR_CTX(be_->AdamW(list.data(), static_cast<int>(list.size()), step), "AdamW step");
    return norm;
  }
  // LAMB: directions, then per-tensor ||p||^2 and ||u||^2 summed over every shard of the tensor.
  std::vector<ops::LambTensor> list;
  for (size_t i = 0; i < segments_.size(); ++i) {
    const int64_t o = state_offsets_[i];
    list.push_back(
        {u_.data() + o, data[i].param, data[i].grad, m_.data() + o, v_.data() + o, segments_[i].len, hparams(i)});
  }
  MS_RETURN_IF_ERROR_CTX(be_->LambDirection(list.data(), static_cast<int>(list.size()), step), "LAMB direction");
  xs.clear();
  ns.clear();
  std::vector<size_t> counted;
  for (size_t i = 0; i < segments_.size(); ++i) {
    if (!segments_[i].count) continue;
    counted.push_back(i);
    xs.push_back(data[i].param);
    xs.push_back(u_.data() + state_offsets_[i]);
    ns.push_back(segments_[i].len);
    ns.push_back(segments_[i].len);
  }
  parts.assign(xs.size(), 0.0);
  MS_RETURN_IF_ERROR_CTX(be_->SumSquares(xs.data(), ns.data(), static_cast<int>(xs.size()), parts.data()),
                         "LAMB tensor norms");
  std::vector<double> norms(2 * num_tensors_, 0.0);
  for (size_t k = 0; k < counted.size(); ++k) {
    norms[2 * tensor_id_[counted[k]]] += parts[2 * k];
    norms[2 * tensor_id_[counted[k]] + 1] += parts[2 * k + 1];
  }
  MS_RETURN_IF_ERROR_CTX(reduce(&norms), "reducing LAMB tensor norms");
  for (size_t i = 0; i < segments_.size(); ++i) {
    const double wn = std::sqrt(norms[2 * tensor_id_[i]]), un = std::sqrt(norms[2 * tensor_id_[i] + 1]);
    const double trust = (wn > 0 && un > 0) ? wn / un : 1.0;
    MS_RETURN_IF_ERROR(be_->LambApply(data[i].param, u_.data() + state_offsets_[i], segments_[i].len,
                                      static_cast<float>(lr), static_cast<float>(trust), data[i].param16));
  }
  return norm;
}

}  // namespace ms::optim
