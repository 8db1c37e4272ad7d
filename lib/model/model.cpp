#include "model/model.h"

#include <cmath>
#include <cstring>

#include "ops/ops.h"

namespace ms::model {

namespace {
int64_t Numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}
}  // namespace

double TrainingFlopsPerSequence(const config::ModelSpec& s) {
  const double C = s.hidden, F = s.ffn_hidden > 0 ? s.ffn_hidden : 4.0 * s.hidden, L = s.layers, V = s.vocab;
  const double T = s.seq_len;
  const double n_matmul = L * (4 * C * C + 2 * C * F) + V * C;
  double keys = 0;  // sum over query positions of the keys each one attends
  for (int64_t t = 0; t < s.seq_len; ++t) keys += s.window > 0 ? std::min<int64_t>(t + 1, s.window) : t + 1;
  return 6.0 * n_matmul * T + 12.0 * L * C * keys;
}

// Copies this rank's shard of a global tensor. heads is used for kQkvRows.
void ExtractShard(const float* global, float* local, const std::vector<int64_t>& gshape, ShardKind kind, int tp_size,
                  int tp_rank) {
  const int64_t rows = gshape[0];
  const int64_t cols = gshape.size() > 1 ? gshape[1] : 1;
  switch (kind) {
    case ShardKind::kReplicated:
      std::memcpy(local, global, sizeof(float) * rows * cols);
      return;
    case ShardKind::kRows: {
      int64_t r = rows / tp_size;
      std::memcpy(local, global + tp_rank * r * cols, sizeof(float) * r * cols);
      return;
    }
    case ShardKind::kCols: {
      int64_t c = cols / tp_size;
      for (int64_t i = 0; i < rows; ++i) std::memcpy(local + i * c, global + i * cols + tp_rank * c, sizeof(float) * c);
      return;
    }
    case ShardKind::kQkvRows: {
      int64_t block = rows / 3, r = block / tp_size;
      for (int k = 0; k < 3; ++k) {
        std::memcpy(local + k * r * cols, global + (k * block + tp_rank * r) * cols, sizeof(float) * r * cols);
      }
      return;
    }
  }
}

void Gpt::AddParam(const std::string& name, std::vector<int64_t> shape, ShardKind kind, bool decay, int layer) {
  ParamInfo p;
  p.name = name;
  p.global_shape = shape;
  p.local_shape = shape;
  const int tp = shard_.tp_size;
  if (kind == ShardKind::kRows || kind == ShardKind::kQkvRows) p.local_shape[0] /= tp;
  if (kind == ShardKind::kCols) p.local_shape[1] /= tp;
  p.shard = kind;
  p.numel = Numel(p.local_shape);
  p.offset = num_params_;
  p.weight_decay = decay;
  p.layer = layer;
  num_params_ += (p.numel + 15) / 16 * 16;  // 64-byte aligned tensors
  params_.push_back(std::move(p));
}

const ParamInfo* Gpt::FindParam(const std::string& name) const {
  for (const auto& p : params_) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

Result<std::unique_ptr<Gpt>> Gpt::Create(const config::ModelSpec& spec, const ShardSpec& shard, int micro_batch,
                                         uint64_t seed, device::Device* device) {
  if (shard.tp_size != 1 || shard.pp_size != 1) {
    return Unimplemented("tensor/pipeline-parallel model shards (tp={}, pp={}) are not built yet; use tp: 1, pp: 1",
                         shard.tp_size, shard.pp_size);
  }
  if (spec.ffn_hidden <= 0 || spec.hidden % spec.heads != 0 || micro_batch < 1) {
    return InvalidArgument("model spec not resolved: ffn_hidden={}, hidden={}, heads={}, micro_batch={}",
                           spec.ffn_hidden, spec.hidden, spec.heads, micro_batch);
  }
  if (!device->is_host()) return Unimplemented("the GPT runs on host memory only in this build");
  std::unique_ptr<Gpt> g(new Gpt());
  g->spec_ = spec;
  g->shard_ = shard;
  g->B_ = micro_batch;
  g->device_ = device;
  const int64_t C = spec.hidden, F = spec.ffn_hidden, V = spec.vocab, T = spec.seq_len;
  const bool seq = spec.block == config::BlockKind::kSequential;
  g->AddParam("embed.wte", {V, C}, ShardKind::kRows, true, -1);
  g->AddParam("embed.wpe", {T, C}, ShardKind::kReplicated, true, -1);
  for (int l = 0; l < spec.layers; ++l) {
    std::string p = fmt::format("layers.{}.", l);
    g->AddParam(p + "ln1.weight", {C}, ShardKind::kReplicated, false, l);
    g->AddParam(p + "ln1.bias", {C}, ShardKind::kReplicated, false, l);
    g->AddParam(p + "attn.qkv.weight", {3 * C, C}, ShardKind::kQkvRows, true, l);
    g->AddParam(p + "attn.qkv.bias", {3 * C}, ShardKind::kQkvRows, false, l);
    g->AddParam(p + "attn.proj.weight", {C, C}, ShardKind::kCols, true, l);
    g->AddParam(p + "attn.proj.bias", {C}, ShardKind::kReplicated, false, l);
    if (seq) {
      g->AddParam(p + "ln2.weight", {C}, ShardKind::kReplicated, false, l);
      g->AddParam(p + "ln2.bias", {C}, ShardKind::kReplicated, false, l);
    }
    g->AddParam(p + "mlp.fc.weight", {F, C}, ShardKind::kRows, true, l);
    g->AddParam(p + "mlp.fc.bias", {F}, ShardKind::kRows, false, l);
    g->AddParam(p + "mlp.proj.weight", {C, F}, ShardKind::kCols, true, l);
    g->AddParam(p + "mlp.proj.bias", {C}, ShardKind::kReplicated, false, l);
  }
  g->AddParam("final_norm.weight", {C}, ShardKind::kReplicated, false, -1);
  g->AddParam("final_norm.bias", {C}, ShardKind::kReplicated, false, -1);
  if (!spec.tied_embeddings) g->AddParam("lm_head.weight", {V, C}, ShardKind::kRows, true, -1);

  MS_ASSIGN_OR_RETURN(g->params_buf_, device::Buffer::Allocate(device, g->num_params_));
  MS_ASSIGN_OR_RETURN(g->grads_buf_, device::Buffer::Allocate(device, g->num_params_));
  MS_RETURN_IF_ERROR(g->Init(seed));

  // Activations (see Forward for their meaning).
  const int64_t N = static_cast<int64_t>(micro_batch) * T, H = spec.heads, L = spec.layers;
  int64_t per_layer = N * C /*ln1*/ + 2 * N /*ln1 stats*/ + N * 3 * C /*qkv*/ + N * C /*atty*/ +
                      micro_batch * H * T /*lse*/ + 2 * N * F /*fch, fch_gelu*/;
  if (seq) per_layer += 2 * N * C /*mid, ln2*/ + 2 * N;
  int64_t acts = (L + 1) * N * C /*residual stream*/ + L * per_layer + N * C + 2 * N /*lnf*/ + N * V /*logits*/ +
                 2 * N /*losses, ce lse*/;
  MS_ASSIGN_OR_RETURN(g->acts_buf_, device::Buffer::Allocate(device, acts));
  // Backward scratch: dres, dln, datty, tmp [N,C]; dqkv [N,3C]; dfch_gelu, dfch [N,F]; dlogits [N,V]; dloss [N].
  int64_t scratch = 4 * N * C + 3 * N * C + 2 * N * F + N * V + N;
  MS_ASSIGN_OR_RETURN(g->scratch_buf_, device::Buffer::Allocate(device, scratch));
  g->inputs_.resize(N);
  g->targets_.resize(N);
  return g;
}

Status Gpt::Init(uint64_t seed) {
  const double std_base = spec_.init_std;
  const double std_proj = spec_.init_std / std::sqrt(2.0 * spec_.layers);  // GPT-2 residual scaling
  std::vector<float> global;
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamInfo& p = params_[i];
    const int64_t n = Numel(p.global_shape);
    global.assign(n, 0.0f);
    const std::string& nm = p.name;
    auto ends_with = [&](std::string_view s) { return nm.size() >= s.size() && nm.ends_with(s); };
    if (ends_with("ln1.weight") || ends_with("ln2.weight") || ends_with("final_norm.weight")) {
      std::fill(global.begin(), global.end(), 1.0f);
    } else if (ends_with(".bias")) {
      // zeros
    } else {
      // Each global tensor has its own stream: identical whatever the layout.
      Rng rng(seed, 1000 + i);
      double std = (ends_with("attn.proj.weight") || ends_with("mlp.proj.weight")) ? std_proj : std_base;
      for (auto& v : global) v = static_cast<float>(rng.NextNormal() * std);
    }
    ExtractShard(global.data(), param_data() + p.offset, p.global_shape, p.shard, shard_.tp_size, shard_.tp_rank);
  }
  ZeroGrad();
  return Status::Ok();
}

void Gpt::ZeroGrad() {
  std::memset(grad_data(), 0, sizeof(float) * num_params_);
}

namespace {
struct Acts {
  std::vector<float*> res;  // L+1 residual streams [N,C]
  struct Layer {
    float *ln1, *ln1_mean, *ln1_rstd, *qkv, *atty, *lse, *fch, *fch_gelu, *mid, *ln2, *ln2_mean, *ln2_rstd;
  };
  std::vector<Layer> layers;
  float *lnf, *lnf_mean, *lnf_rstd, *logits, *losses, *ce_lse;
};
struct Scratch {
  float *dres, *dln, *datty, *tmp, *tmp2, *dmid, *dqkv, *dfch_gelu, *dfch, *dlogits, *dloss, *spare;
};

Acts LayoutActs(float* base, int64_t B, int64_t T, int64_t C, int64_t F, int64_t H, int64_t V, int L, bool seq) {
  const int64_t N = B * T;
  Acts a;
  float* p = base;
  auto take = [&](int64_t n) {
    float* r = p;
    p += n;
    return r;
  };
  for (int l = 0; l <= L; ++l) a.res.push_back(take(N * C));
  for (int l = 0; l < L; ++l) {
    Acts::Layer y{};
    y.ln1 = take(N * C);
    y.ln1_mean = take(N);
    y.ln1_rstd = take(N);
    y.qkv = take(N * 3 * C);
    y.atty = take(N * C);
    y.lse = take(B * H * T);
    y.fch = take(N * F);
    y.fch_gelu = take(N * F);
    if (seq) {
      y.mid = take(N * C);
      y.ln2 = take(N * C);
      y.ln2_mean = take(N);
      y.ln2_rstd = take(N);
    }
    a.layers.push_back(y);
  }
  a.lnf = take(N * C);
  a.lnf_mean = take(N);
  a.lnf_rstd = take(N);
  a.logits = take(N * V);
  a.losses = take(N);
  a.ce_lse = take(N);
  return a;
}

Scratch LayoutScratch(float* base, int64_t N, int64_t C, int64_t F, int64_t V) {
  Scratch s{};
  float* p = base;
  auto take = [&](int64_t n) {
    float* r = p;
    p += n;
    return r;
  };
  s.dres = take(N * C);
  s.dln = take(N * C);
  s.datty = take(N * C);
  s.tmp = take(N * C);
  s.dqkv = take(N * 3 * C);
  s.dfch_gelu = take(N * F);
  s.dfch = take(N * F);
  s.dlogits = take(N * V);
  s.dloss = take(N);
  s.tmp2 = s.dln;  // forward-only reuse
  s.dmid = nullptr;
  s.spare = nullptr;
  return s;
}
}  // namespace

Result<float> Gpt::Forward(const int32_t* inputs, const int32_t* targets) {
  const int64_t B = B_, T = spec_.seq_len, C = spec_.hidden, F = spec_.ffn_hidden, H = spec_.heads, V = spec_.vocab;
  const int64_t N = B * T, D = C / H;
  const int L = spec_.layers;
  const bool seq = spec_.block == config::BlockKind::kSequential;
  for (int64_t i = 0; i < N; ++i) {
    if (inputs[i] < 0 || inputs[i] >= V) {
      return InvalidArgument("token id {} at position {} is outside the vocabulary [0, {})", inputs[i], i, V);
    }
    if (targets[i] >= V) return InvalidArgument("target id {} at position {} is >= vocab {}", targets[i], i, V);
  }
  std::memcpy(inputs_.data(), inputs, sizeof(int32_t) * N);
  std::memcpy(targets_.data(), targets, sizeof(int32_t) * N);
  Acts a = LayoutActs(acts_buf_.f32(), B, T, C, F, H, V, L, seq);
  Scratch s = LayoutScratch(scratch_buf_.f32(), N, C, F, V);
  auto W = [&](const std::string& name) { return param_data() + FindParam(name)->offset; };

  const float* wte = W("embed.wte");
  const float* wpe = W("embed.wpe");
  ops::EmbeddingForward(a.res[0], inputs_.data(), wte, N, C);
  for (int64_t b = 0; b < B; ++b) ops::AddInPlace(a.res[0] + b * T * C, wpe, T * C);

  for (int l = 0; l < L; ++l) {
    const std::string p = fmt::format("layers.{}.", l);
    auto& y = a.layers[l];
    const float* x = a.res[l];
    float* out = a.res[l + 1];
    ops::LayerNormForward(y.ln1, y.ln1_mean, y.ln1_rstd, x, W(p + "ln1.weight"), W(p + "ln1.bias"), N, C,
                          spec_.norm_eps);
    ops::MatmulForward(y.qkv, y.ln1, W(p + "attn.qkv.weight"), W(p + "attn.qkv.bias"), N, C, 3 * C);
    ops::AttentionForward(y.atty, y.lse, y.qkv, B, T, H, D, spec_.window);
    ops::MatmulForward(s.tmp, y.atty, W(p + "attn.proj.weight"), W(p + "attn.proj.bias"), N, C, C);
    const float* mlp_in = y.ln1;
    const float* resid = x;
    if (seq) {
      ops::Add(y.mid, x, s.tmp, N * C);
      ops::LayerNormForward(y.ln2, y.ln2_mean, y.ln2_rstd, y.mid, W(p + "ln2.weight"), W(p + "ln2.bias"), N, C,
                            spec_.norm_eps);
      mlp_in = y.ln2;
      resid = y.mid;
    }
    ops::MatmulForward(y.fch, mlp_in, W(p + "mlp.fc.weight"), W(p + "mlp.fc.bias"), N, C, F);
    ops::GeluForward(y.fch_gelu, y.fch, N * F);
    ops::MatmulForward(s.tmp2, y.fch_gelu, W(p + "mlp.proj.weight"), W(p + "mlp.proj.bias"), N, F, C);
    ops::Add(out, resid, s.tmp2, N * C);
    if (!seq) ops::AddInPlace(out, s.tmp, N * C);  // parallel block: x + attn + mlp
  }
  ops::LayerNormForward(a.lnf, a.lnf_mean, a.lnf_rstd, a.res[L], W("final_norm.weight"), W("final_norm.bias"), N, C,
                        spec_.norm_eps);
  const float* head = spec_.tied_embeddings ? wte : W("lm_head.weight");
  ops::MatmulForward(a.logits, a.lnf, head, nullptr, N, C, V);
  ops::CrossEntropyForward(a.losses, a.ce_lse, a.logits, targets_.data(), N, V);
  double sum = 0;
  int64_t counted = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (targets_[i] >= 0) {
      sum += a.losses[i];
      ++counted;
    }
  }
  have_forward_ = true;
  return static_cast<float>(counted ? sum / counted : 0.0);
}

Status Gpt::Backward(float dloss) {
  if (!have_forward_) return FailedPrecondition("Backward called without a Forward");
  have_forward_ = false;
  const int64_t B = B_, T = spec_.seq_len, C = spec_.hidden, F = spec_.ffn_hidden, H = spec_.heads, V = spec_.vocab;
  const int64_t N = B * T, D = C / H;
  const int L = spec_.layers;
  const bool seq = spec_.block == config::BlockKind::kSequential;
  Acts a = LayoutActs(acts_buf_.f32(), B, T, C, F, H, V, L, seq);
  Scratch s = LayoutScratch(scratch_buf_.f32(), N, C, F, V);
  auto W = [&](const std::string& name) { return param_data() + FindParam(name)->offset; };
  auto G = [&](const std::string& name) { return grad_data() + FindParam(name)->offset; };
  auto zero = [](float* p, int64_t n) { std::memset(p, 0, sizeof(float) * n); };

  for (int64_t i = 0; i < N; ++i) s.dloss[i] = dloss;
  ops::CrossEntropyBackward(s.dlogits, a.logits, a.ce_lse, targets_.data(), s.dloss, N, V);
  const std::string head = spec_.tied_embeddings ? "embed.wte" : "lm_head.weight";
  zero(s.dln, N * C);
  ops::MatmulBackward(s.dln, G(head), nullptr, s.dlogits, a.lnf, W(head), N, C, V);
  zero(s.dres, N * C);
  ops::LayerNormBackward(s.dres, G("final_norm.weight"), G("final_norm.bias"), s.dln, a.res[L], W("final_norm.weight"),
                         a.lnf_mean, a.lnf_rstd, N, C);

  for (int l = L - 1; l >= 0; --l) {
    const std::string p = fmt::format("layers.{}.", l);
    auto& y = a.layers[l];
    const float* x = a.res[l];
    // s.dres holds dL/d(out); on exit it holds dL/dx.
    // MLP branch (its output was added to `resid`: x for parallel, mid for sequential).
    zero(s.dfch_gelu, N * F);
    ops::MatmulBackward(s.dfch_gelu, G(p + "mlp.proj.weight"), G(p + "mlp.proj.bias"), s.dres, y.fch_gelu,
                        W(p + "mlp.proj.weight"), N, F, C);
    ops::GeluBackward(s.dfch, y.fch, s.dfch_gelu, N * F);
    zero(s.dln, N * C);
    ops::MatmulBackward(s.dln, G(p + "mlp.fc.weight"), G(p + "mlp.fc.bias"), s.dfch, seq ? y.ln2 : y.ln1,
                        W(p + "mlp.fc.weight"), N, C, F);
    if (seq) {
      // dres becomes dL/d(mid); the attention branch starts from a fresh dln.
      ops::LayerNormBackward(s.dres, G(p + "ln2.weight"), G(p + "ln2.bias"), s.dln, y.mid, W(p + "ln2.weight"),
                             y.ln2_mean, y.ln2_rstd, N, C);
      zero(s.dln, N * C);
    }
    // Attention branch.
    zero(s.datty, N * C);
    ops::MatmulBackward(s.datty, G(p + "attn.proj.weight"), G(p + "attn.proj.bias"), s.dres, y.atty,
                        W(p + "attn.proj.weight"), N, C, C);
    ops::AttentionBackward(s.dqkv, s.datty, y.qkv, y.atty, y.lse, B, T, H, D, spec_.window);
    // Parallel block: dln already holds the MLP branch's gradient, the two add up here.
    ops::MatmulBackward(s.dln, G(p + "attn.qkv.weight"), G(p + "attn.qkv.bias"), s.dqkv, y.ln1,
                        W(p + "attn.qkv.weight"), N, C, 3 * C);
    ops::LayerNormBackward(s.dres, G(p + "ln1.weight"), G(p + "ln1.bias"), s.dln, x, W(p + "ln1.weight"), y.ln1_mean,
                           y.ln1_rstd, N, C);
  }
  ops::EmbeddingBackward(G("embed.wte"), inputs_.data(), s.dres, N, C);
  float* dwpe = G("embed.wpe");
  for (int64_t b = 0; b < B; ++b) ops::AddInPlace(dwpe, s.dres + b * T * C, T * C);
  return Status::Ok();
}

}  // namespace ms::model
