#include "model/model.h"

#include <omp.h>

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
uint64_t NameHash(const std::string& s) {  // FNV-1a: a tensor's RNG stream, whatever the layout
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
  return h;
}
}  // namespace

std::vector<std::string> AllTensorNames(const config::ModelSpec& spec) {
  std::vector<std::string> names = {"embed.wte", "embed.wpe"};
  for (int l = 0; l < spec.layers; ++l) {
    const std::string p = fmt::format("layers.{}.", l);
    for (const char* n :
         {"ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias"}) {
      names.push_back(p + n);
    }
    if (spec.block == config::BlockKind::kSequential) {
      names.push_back(p + "ln2.weight");
      names.push_back(p + "ln2.bias");
    }
    for (const char* n : {"mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight", "mlp.proj.bias"}) names.push_back(p + n);
  }
  names.push_back("final_norm.weight");
  names.push_back("final_norm.bias");
  if (!spec.tied_embeddings) names.push_back("lm_head.weight");
  return names;
}

double TrainingFlopsPerSequence(const config::ModelSpec& s) {
  const double C = s.hidden, F = s.ffn_hidden > 0 ? s.ffn_hidden : 4.0 * s.hidden, L = s.layers, V = s.vocab;
  const double T = s.seq_len;
  const double n_matmul = L * (4 * C * C + 2 * C * F) + V * C;
  double keys = 0;  // sum over query positions of the keys each one attends
  for (int64_t t = 0; t < s.seq_len; ++t) keys += s.window > 0 ? std::min<int64_t>(t + 1, s.window) : t + 1;
  return 6.0 * n_matmul * T + 12.0 * L * C * keys;
}

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

// Activations of one micro-batch in one chunk (R = rows_, N = B*T).
// All device memory (host memory on the CPU backend); only inputs_host / targets_host live on the host.
struct Gpt::Acts {
  std::vector<int32_t> inputs_host, targets_host;  // [N]
  DeviceArray<int32_t> inputs, targets;  // [N]; inputs as local vocab ids under tp (-1: another rank's row)
  DeviceArray<float> res;                // (layers+1) x [R, C]
  struct Layer {
    DeviceArray<float> ln1, ln1_mean, ln1_rstd, ln1_full, qkv, atty, lse, fch, fch_gelu;
    DeviceArray<float> mid, ln2, ln2_mean, ln2_rstd, ln2_full;
  };
  std::vector<Layer> layers;
  DeviceArray<float> lnf, lnf_mean, lnf_rstd, lnf_full, logits, ce_lse, losses;
  DeviceArray<float> dx_in;  // [R, C] gradient of the chunk input (to send upstream)
  bool forward_done = false;
};

struct Gpt::LayerW {
  const ParamInfo *ln1w, *ln1b, *qkvw, *qkvb, *projw, *projb, *ln2w, *ln2b, *fcw, *fcb, *mprojw, *mprojb;
};

Gpt::~Gpt() = default;

void Gpt::AddParam(const std::string& name, std::vector<int64_t> shape, ShardKind kind, bool decay, int layer,
                   int chunk) {
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
  p.chunk = chunk;
  p.sp_partial = shard_.sequence_parallel && tp > 1 && kind == ShardKind::kReplicated;
  num_params_ += (p.numel + 15) / 16 * 16;  // 64-byte aligned tensors
  param_index_[name] = params_.size();
  params_.push_back(std::move(p));
}

const ParamInfo* Gpt::FindParam(const std::string& name) const {
  auto it = param_index_.find(name);
  return it == param_index_.end() ? nullptr : &params_[it->second];
}

Result<std::unique_ptr<Gpt>> Gpt::Create(const config::ModelSpec& spec, const ShardSpec& shard, int micro_batch,
                                         uint64_t seed, device::Device* device, ModelComms comms,
                                         ops::Backend* backend) {
  const int tp = shard.tp_size, pp = shard.pp_size, v = shard.virtual_stages;
  if (spec.ffn_hidden <= 0 || spec.hidden % spec.heads != 0 || micro_batch < 1) {
    return InvalidArgument("model spec not resolved: ffn_hidden={}, hidden={}, heads={}, micro_batch={}",
                           spec.ffn_hidden, spec.hidden, spec.heads, micro_batch);
  }
  if (tp < 1 || pp < 1 || v < 1 || spec.heads % tp || spec.ffn_hidden % tp || spec.vocab % tp ||
      spec.layers % (pp * v) || shard.tp_rank < 0 || shard.tp_rank >= tp || shard.pp_rank < 0 || shard.pp_rank >= pp) {
    return InvalidArgument(
        "layout tp={} (rank {}) pp={} (rank {}) virtual_stages={} does not divide the model "
        "(heads {}, ffn_hidden {}, vocab {}, layers {})",
        tp, shard.tp_rank, pp, shard.pp_rank, v, spec.heads, spec.ffn_hidden, spec.vocab, spec.layers);
  }
  if (tp > 1 && comms.tp == nullptr) return InvalidArgument("tp={} needs a tensor-parallel communicator", tp);
  if (tp > 1 && comms.tp->size() != tp) {
    return InvalidArgument("tensor-parallel communicator has {} ranks, layout says tp={}", comms.tp->size(), tp);
  }
  const int64_t N = static_cast<int64_t>(micro_batch) * spec.seq_len;
  if (shard.sequence_parallel && N % tp) {
    return InvalidArgument("sequence parallelism needs micro_batch*seq_len = {} divisible by tp={}", N, tp);
  }
  std::unique_ptr<Gpt> g(new Gpt());
  g->spec_ = spec;
  g->shard_ = shard;
  g->comms_ = comms;
  g->B_ = micro_batch;
  g->N_ = N;
  g->rows_ = shard.sequence_parallel ? N / tp : N;
  g->Hl_ = spec.heads / tp;
  g->Fl_ = spec.ffn_hidden / tp;
  g->Vl_ = spec.vocab / tp;
  g->device_ = device;
  if (backend) {
    if (backend->device() != device) return InvalidArgument("the ops backend ({}) works on another device", backend->name());
    g->be_ = backend;
  } else {
    if (!device->is_host()) return InvalidArgument("device {} needs an ops backend", device->name());
    g->own_be_ = ops::MakeCpuBackend(device);
    g->be_ = g->own_be_.get();
  }
  const int64_t C = spec.hidden, F = spec.ffn_hidden, V = spec.vocab, T = spec.seq_len;
  const bool seq = spec.block == config::BlockKind::kSequential;
  const int G = pp * v, per_chunk = spec.layers / G;
  for (int c = 0; c < v; ++c) {
    Chunk ch;
    ch.global = c * pp + shard.pp_rank;
    ch.first_layer = ch.global * per_chunk;
    ch.num_layers = per_chunk;
    ch.embedding = ch.global == 0;
    ch.head = ch.global == G - 1;
    g->chunks_.push_back(ch);
    if (ch.embedding) {
      g->AddParam("embed.wte", {V, C}, ShardKind::kRows, true, -1, c);
      g->AddParam("embed.wpe", {T, C}, ShardKind::kReplicated, true, -1, c);
    }
    for (int l = ch.first_layer; l < ch.first_layer + per_chunk; ++l) {
      std::string p = fmt::format("layers.{}.", l);
      g->AddParam(p + "ln1.weight", {C}, ShardKind::kReplicated, false, l, c);
      g->AddParam(p + "ln1.bias", {C}, ShardKind::kReplicated, false, l, c);
      g->AddParam(p + "attn.qkv.weight", {3 * C, C}, ShardKind::kQkvRows, true, l, c);
      g->AddParam(p + "attn.qkv.bias", {3 * C}, ShardKind::kQkvRows, false, l, c);
      g->AddParam(p + "attn.proj.weight", {C, C}, ShardKind::kCols, true, l, c);
      g->AddParam(p + "attn.proj.bias", {C}, ShardKind::kReplicated, false, l, c);
      if (seq) {
        g->AddParam(p + "ln2.weight", {C}, ShardKind::kReplicated, false, l, c);
        g->AddParam(p + "ln2.bias", {C}, ShardKind::kReplicated, false, l, c);
      }
      g->AddParam(p + "mlp.fc.weight", {F, C}, ShardKind::kRows, true, l, c);
      g->AddParam(p + "mlp.fc.bias", {F}, ShardKind::kRows, false, l, c);
      g->AddParam(p + "mlp.proj.weight", {C, F}, ShardKind::kCols, true, l, c);
      g->AddParam(p + "mlp.proj.bias", {C}, ShardKind::kReplicated, false, l, c);
    }
    if (ch.head) {
      g->AddParam("final_norm.weight", {C}, ShardKind::kReplicated, false, spec.layers, c);
      g->AddParam("final_norm.bias", {C}, ShardKind::kReplicated, false, spec.layers, c);
      if (!spec.tied_embeddings) {
        g->AddParam("lm_head.weight", {V, C}, ShardKind::kRows, true, spec.layers, c);
      } else if (!ch.embedding) {
        g->AddParam("embed.wte", {V, C}, ShardKind::kRows, true, spec.layers, c);
        g->params_.back().tied_replica = true;
      }
    }
  }
  // Tensors whose gradient is a partial sum over tp (sequence parallelism) go after the others,
  // so that the data-parallel engine can reduce them as one deferred range (parallel.h).
  int64_t at = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (auto& p : g->params_) {
      if (p.sp_partial != (pass == 1)) continue;
      p.offset = at;
      at += (p.numel + 15) / 16 * 16;
    }
  }
  MS_ASSIGN_OR_RETURN(g->params_buf_, device::Buffer::Allocate(device, std::max<int64_t>(g->num_params_, 1)));
  MS_ASSIGN_OR_RETURN(g->grads_buf_, device::Buffer::Allocate(device, std::max<int64_t>(g->num_params_, 1)));
  MS_RETURN_IF_ERROR(g->Init(seed));
  MS_RETURN_IF_ERROR(g->ZeroGrad());
  const int64_t R = g->rows_, HlD = g->Hl_ * (C / spec.heads);
  // Scratch: dres, partR, dln [R,C]; part, part2, dy_full, dln_full, e_full [N,C]; datty [N,HlD];
  // dqkv [N,3HlD]; dfch_gelu, dfch [N,Fl]; dlogits [N,Vl]; dl, vstats [N] x 4.
  MS_RETURN_IF_ERROR(g->scratch_.Allocate(
      g->be_, 3 * R * C + 5 * N * C + N * HlD + 3 * N * HlD + 2 * N * g->Fl_ + N * g->Vl_ + 4 * N));
  return g;
}

Status Gpt::Init(uint64_t seed) {
  const double std_base = spec_.init_std;
  const double std_proj = spec_.init_std / std::sqrt(2.0 * spec_.layers);  // GPT-2 residual scaling
  std::vector<float> global, local;
  MS_RETURN_IF_ERROR(be_->Zero(param_data(), sizeof(float) * num_params_));  // the alignment gaps too
  for (const ParamInfo& p : params_) {
    const int64_t n = Numel(p.global_shape);
    global.assign(n, 0.0f);
    const std::string& nm = p.name;
    auto ends_with = [&](std::string_view s) { return nm.ends_with(s); };
    if (ends_with("ln1.weight") || ends_with("ln2.weight") || ends_with("final_norm.weight")) {
      std::fill(global.begin(), global.end(), 1.0f);
    } else if (ends_with(".bias")) {
      // zeros
    } else {
      Rng rng(seed, NameHash(nm));
      double std = (ends_with("attn.proj.weight") || ends_with("mlp.proj.weight")) ? std_proj : std_base;
      for (auto& x : global) x = static_cast<float>(rng.NextNormal() * std);
    }
    local.assign(p.numel, 0.0f);
    ExtractShard(global.data(), local.data(), p.global_shape, p.shard, shard_.tp_size, shard_.tp_rank);
    MS_RETURN_IF_ERROR(be_->CopyFromHost(param_data() + p.offset, local.data(), sizeof(float) * p.numel));
  }
  return be_->Synchronize();
}

Status Gpt::ZeroGrad() {
  return be_->Zero(grad_data(), sizeof(float) * num_params_).WithContext("zeroing the gradients");
}

Gpt::LayerW Gpt::Layer(int l) const {
  const std::string p = fmt::format("layers.{}.", l);
  const bool seq = spec_.block == config::BlockKind::kSequential;
  LayerW w{};
  w.ln1w = FindParam(p + "ln1.weight");
  w.ln1b = FindParam(p + "ln1.bias");
  w.qkvw = FindParam(p + "attn.qkv.weight");
  w.qkvb = FindParam(p + "attn.qkv.bias");
  w.projw = FindParam(p + "attn.proj.weight");
  w.projb = FindParam(p + "attn.proj.bias");
  w.ln2w = seq ? FindParam(p + "ln2.weight") : nullptr;
  w.ln2b = seq ? FindParam(p + "ln2.bias") : nullptr;
  w.fcw = FindParam(p + "mlp.fc.weight");
  w.fcb = FindParam(p + "mlp.fc.bias");
  w.mprojw = FindParam(p + "mlp.proj.weight");
  w.mprojb = FindParam(p + "mlp.proj.bias");
  return w;
}

Result<Gpt::Acts*> Gpt::SlotActs(int chunk, int slot) {
  auto& ptr = acts_[{chunk, slot}];
  if (ptr) return ptr.get();
  auto acts = std::make_unique<Acts>();
  Acts& a = *acts;
  const int64_t C = spec_.hidden, N = N_, R = rows_, HlD = Hl_ * (C / spec_.heads);
  const bool seq = spec_.block == config::BlockKind::kSequential, sp = shard_.sequence_parallel && shard_.tp_size > 1;
  const Chunk& ch = chunks_[chunk];
  ops::Backend* be = be_;
  a.inputs_host.assign(N, 0);
  a.targets_host.assign(N, 0);
  MS_RETURN_IF_ERROR(a.inputs.Allocate(be, N));
  MS_RETURN_IF_ERROR(a.targets.Allocate(be, N));
  MS_RETURN_IF_ERROR(a.res.Allocate(be, (ch.num_layers + 1) * R * C));
  a.layers.resize(ch.num_layers);
  for (auto& y : a.layers) {
    MS_RETURN_IF_ERROR(y.ln1.Allocate(be, R * C));
    MS_RETURN_IF_ERROR(y.ln1_mean.Allocate(be, R));
    MS_RETURN_IF_ERROR(y.ln1_rstd.Allocate(be, R));
    if (sp) MS_RETURN_IF_ERROR(y.ln1_full.Allocate(be, N * C));
    MS_RETURN_IF_ERROR(y.qkv.Allocate(be, N * 3 * HlD));
    MS_RETURN_IF_ERROR(y.atty.Allocate(be, N * HlD));
    MS_RETURN_IF_ERROR(y.lse.Allocate(be, B_ * Hl_ * spec_.seq_len));
    MS_RETURN_IF_ERROR(y.fch.Allocate(be, N * Fl_));
    MS_RETURN_IF_ERROR(y.fch_gelu.Allocate(be, N * Fl_));
    if (seq) {
      MS_RETURN_IF_ERROR(y.mid.Allocate(be, R * C));
      MS_RETURN_IF_ERROR(y.ln2.Allocate(be, R * C));
      MS_RETURN_IF_ERROR(y.ln2_mean.Allocate(be, R));
      MS_RETURN_IF_ERROR(y.ln2_rstd.Allocate(be, R));
      if (sp) MS_RETURN_IF_ERROR(y.ln2_full.Allocate(be, N * C));
    }
  }
  if (ch.head) {
    MS_RETURN_IF_ERROR(a.lnf.Allocate(be, R * C));
    MS_RETURN_IF_ERROR(a.lnf_mean.Allocate(be, R));
    MS_RETURN_IF_ERROR(a.lnf_rstd.Allocate(be, R));
    if (sp) MS_RETURN_IF_ERROR(a.lnf_full.Allocate(be, N * C));
    MS_RETURN_IF_ERROR(a.logits.Allocate(be, N * Vl_));
    MS_RETURN_IF_ERROR(a.ce_lse.Allocate(be, N));
    MS_RETURN_IF_ERROR(a.losses.Allocate(be, N));
  }
  if (!ch.embedding) MS_RETURN_IF_ERROR(a.dx_in.Allocate(be, R * C));
  ptr = std::move(acts);
  return ptr.get();
}

const float* Gpt::ChunkOutput(int chunk, int slot) const {
  const Acts& a = *acts_.at({chunk, slot});
  return a.res.data() + chunks_[chunk].num_layers * rows_ * spec_.hidden;
}
const float* Gpt::InputGrad(int chunk, int slot) const {
  return acts_.at({chunk, slot})->dx_in.data();
}

Status Gpt::TpCollectiveReady() {
  // The communicator works on its own stream (NCCL) or the host (Gloo): what the backend enqueued must be done.
  return be_->Synchronize().WithContext("waiting for the ops before a tensor-parallel collective");
}
Status Gpt::TpAllReduce(float* x, int64_t n) {
  if (shard_.tp_size == 1) return Status::Ok();
  MS_RETURN_IF_ERROR(TpCollectiveReady());
  return comms_.tp->AllReduce(x, n, comm::ReduceOp::kSum)->Wait().WithContext("tensor-parallel all-reduce");
}
Status Gpt::TpAllGatherRows(const float* local, float* full) {
  MS_RETURN_IF_ERROR(TpCollectiveReady());
  return comms_.tp->AllGather(local, full, rows_ * spec_.hidden)->Wait().WithContext("sequence-parallel all-gather");
}
Status Gpt::TpReduceScatterRows(const float* full, float* local) {
  MS_RETURN_IF_ERROR(TpCollectiveReady());
  return comms_.tp->ReduceScatter(full, local, rows_ * spec_.hidden)
      ->Wait()
      .WithContext("sequence-parallel reduce-scatter");
}

Result<float> Gpt::ForwardChunk(int chunk, int slot, const int32_t* inputs, const int32_t* targets, const float* x_in,
                                const std::function<Status(int)>& before_layer) {
  auto before = [&](int layer) { return before_layer ? before_layer(layer) : Status::Ok(); };
  if (chunk < 0 || chunk >= num_chunks()) return InvalidArgument("chunk {} of {}", chunk, num_chunks());
  const Chunk& ch = chunks_[chunk];
  const int64_t B = B_, T = spec_.seq_len, C = spec_.hidden, V = spec_.vocab, N = N_, R = rows_;
  const int64_t D = C / spec_.heads, HlD = Hl_ * D, Fl = Fl_;
  const bool seq = spec_.block == config::BlockKind::kSequential;
  const bool tp = shard_.tp_size > 1, sp = shard_.sequence_parallel && tp;
  MS_ASSIGN_OR_RETURN(Acts * acts, SlotActs(chunk, slot));
  Acts& a = *acts;
  float* s = scratch_.data();
  float* partR = s + R * C;
  float* part = s + 3 * R * C;
  float* part2 = part + N * C;
  float* e_full = part + 4 * N * C;
  auto P = [&](const ParamInfo* p) { return param_data() + p->offset; };

  if (ch.embedding) {
    if (!inputs) return InvalidArgument("the embedding chunk needs input tokens");
    MS_RETURN_IF_ERROR(before(-1));
    const int64_t vstart = shard_.tp_rank * Vl_;
    for (int64_t i = 0; i < N; ++i) {
      if (inputs[i] < 0 || inputs[i] >= V) {
        return InvalidArgument("token id {} at position {} is outside the vocabulary [0, {})", inputs[i], i, V);
      }
      const int64_t local = inputs[i] - vstart;
      a.inputs_host[i] = (local >= 0 && local < Vl_) ? static_cast<int32_t>(local) : -1;
    }
    MS_RETURN_IF_ERROR(be_->CopyFromHost(a.inputs.data(), a.inputs_host.data(), sizeof(int32_t) * N));
    float* x0 = a.res.data();
    if (!tp) {
      MS_RETURN_IF_ERROR(be_->EmbeddingForward(x0, a.inputs.data(), P(FindParam("embed.wte")), N, C));
    } else {
      MS_RETURN_IF_ERROR(be_->EmbeddingForward(e_full, a.inputs.data(), P(FindParam("embed.wte")), N, C));  // other ranks' rows: 0
      if (sp) {
        MS_RETURN_IF_ERROR(TpReduceScatterRows(e_full, x0));
      } else {
        MS_RETURN_IF_ERROR(TpAllReduce(e_full, N * C));
        MS_RETURN_IF_ERROR(be_->Copy(x0, e_full, sizeof(float) * N * C));
      }
    }
    const float* wpe = P(FindParam("embed.wpe"));
    const int64_t row0 = sp ? shard_.tp_rank * R : 0;
    MS_RETURN_IF_ERROR(be_->AddPositions(x0, wpe, R, C, T, row0));
  } else {
    if (!x_in) return InvalidArgument("chunk {} needs the previous stage's activations", ch.global);
    MS_RETURN_IF_ERROR(be_->Copy(a.res.data(), x_in, sizeof(float) * R * C));
  }
  if (ch.head) {
    if (!targets) return InvalidArgument("the head chunk needs targets");
    for (int64_t i = 0; i < N; ++i) {
      if (targets[i] >= V) return InvalidArgument("target id {} at position {} is >= vocab {}", targets[i], i, V);
    }
    std::memcpy(a.targets_host.data(), targets, sizeof(int32_t) * N);
    MS_RETURN_IF_ERROR(be_->CopyFromHost(a.targets.data(), targets, sizeof(int32_t) * N));
  }

  auto reduce_part = [&](float* full) -> Result<float*> {  // partial [N,C] -> summed [R,C]
    if (!tp) return full;
    if (sp) {
      MS_RETURN_IF_ERROR(TpReduceScatterRows(full, partR));
      return partR;
    }
    MS_RETURN_IF_ERROR(TpAllReduce(full, N * C));
    return full;
  };
  for (int i = 0; i < ch.num_layers; ++i) {
    MS_RETURN_IF_ERROR(before(ch.first_layer + i));
    const LayerW w = Layer(ch.first_layer + i);
    auto& y = a.layers[i];
    const float* x = a.res.data() + i * R * C;
    float* out = a.res.data() + (i + 1) * R * C;
    MS_RETURN_IF_ERROR(be_->LayerNormForward(y.ln1.data(), y.ln1_mean.data(), y.ln1_rstd.data(), x, P(w.ln1w), P(w.ln1b), R, C,
                          spec_.norm_eps));
    const float* ln1in = y.ln1.data();
    if (sp) {
      MS_RETURN_IF_ERROR(TpAllGatherRows(y.ln1.data(), y.ln1_full.data()));
      ln1in = y.ln1_full.data();
    }
    MS_RETURN_IF_ERROR(be_->MatmulForward(y.qkv.data(), ln1in, P(w.qkvw), P(w.qkvb), N, C, 3 * HlD));
    MS_RETURN_IF_ERROR(be_->AttentionForward(y.atty.data(), y.lse.data(), y.qkv.data(), B, T, Hl_, D, spec_.window));
    MS_RETURN_IF_ERROR(be_->MatmulForward(part, y.atty.data(), P(w.projw), nullptr, N, HlD, C));
    if (seq) {
      MS_ASSIGN_OR_RETURN(float* attn_out, reduce_part(part));
      MS_RETURN_IF_ERROR(be_->ResidualAdd(y.mid.data(), x, attn_out, P(w.projb), nullptr, R, C));
      MS_RETURN_IF_ERROR(be_->LayerNormForward(y.ln2.data(), y.ln2_mean.data(), y.ln2_rstd.data(), y.mid.data(), P(w.ln2w), P(w.ln2b), R,
                            C, spec_.norm_eps));
      const float* ln2in = y.ln2.data();
      if (sp) {
        MS_RETURN_IF_ERROR(TpAllGatherRows(y.ln2.data(), y.ln2_full.data()));
        ln2in = y.ln2_full.data();
      }
      MS_RETURN_IF_ERROR(be_->MatmulForward(y.fch.data(), ln2in, P(w.fcw), P(w.fcb), N, C, Fl));
      MS_RETURN_IF_ERROR(be_->GeluForward(y.fch_gelu.data(), y.fch.data(), N * Fl));
      MS_RETURN_IF_ERROR(be_->MatmulForward(part, y.fch_gelu.data(), P(w.mprojw), nullptr, N, Fl, C));
      MS_ASSIGN_OR_RETURN(float* mlp_out, reduce_part(part));
      MS_RETURN_IF_ERROR(be_->ResidualAdd(out, y.mid.data(), mlp_out, P(w.mprojb), nullptr, R, C));
    } else {
      MS_RETURN_IF_ERROR(be_->MatmulForward(y.fch.data(), ln1in, P(w.fcw), P(w.fcb), N, C, Fl));
      MS_RETURN_IF_ERROR(be_->GeluForward(y.fch_gelu.data(), y.fch.data(), N * Fl));
      MS_RETURN_IF_ERROR(be_->MatmulForward(part2, y.fch_gelu.data(), P(w.mprojw), nullptr, N, Fl, C));
      MS_RETURN_IF_ERROR(be_->AddInPlace(part, part2, N * C));  // attention + MLP partial sums: ONE reduction below
      MS_ASSIGN_OR_RETURN(float* both, reduce_part(part));
      MS_RETURN_IF_ERROR(be_->ResidualAdd(out, x, both, P(w.projb), P(w.mprojb), R, C));
    }
  }
  a.forward_done = true;
  if (!ch.head) return 0.0f;
  MS_RETURN_IF_ERROR(before(spec_.layers));
  return HeadForward(a, a.res.data() + ch.num_layers * R * C);
}

Result<float> Gpt::HeadForward(Acts& a, const float* x) {
  const int64_t C = spec_.hidden, N = N_, R = rows_, Vl = Vl_;
  const bool tp = shard_.tp_size > 1, sp = shard_.sequence_parallel && tp;
  auto P = [&](const char* name) { return param_data() + FindParam(name)->offset; };
  MS_RETURN_IF_ERROR(be_->LayerNormForward(a.lnf.data(), a.lnf_mean.data(), a.lnf_rstd.data(), x, P("final_norm.weight"),
                        P("final_norm.bias"), R, C, spec_.norm_eps));
  const float* lnfin = a.lnf.data();
  if (sp) {
    MS_RETURN_IF_ERROR(TpAllGatherRows(a.lnf.data(), a.lnf_full.data()));
    lnfin = a.lnf_full.data();
  }
  const float* head = P(spec_.tied_embeddings ? "embed.wte" : "lm_head.weight");
  MS_RETURN_IF_ERROR(be_->MatmulForward(a.logits.data(), lnfin, head, nullptr, N, C, Vl));
  if (!tp) {
    MS_RETURN_IF_ERROR(be_->CrossEntropyForward(a.losses.data(), a.ce_lse.data(), a.logits.data(), a.targets.data(), N, Vl));
  } else {
    // Vocab-parallel cross-entropy: global max, sum of exponentials and target logit by all-reduce.
    float* stats = scratch_.data() + scratch_.size() - 3 * N;  // max | sumexp | target logit
    float *mx = stats, *se = stats + N, *tl = stats + 2 * N;
    const int64_t vstart = shard_.tp_rank * Vl;
    MS_RETURN_IF_ERROR(be_->VocabParallelRowMax(mx, a.logits.data(), N, Vl));
    MS_RETURN_IF_ERROR(TpCollectiveReady());
    MS_RETURN_IF_ERROR(
        comms_.tp->AllReduce(mx, N, comm::ReduceOp::kMax)->Wait().WithContext("vocab-parallel loss: max"));
    MS_RETURN_IF_ERROR(be_->VocabParallelSumExpTarget(se, tl, a.logits.data(), mx, a.targets.data(), vstart, N, Vl));
    MS_RETURN_IF_ERROR(TpAllReduce(se, 2 * N));  // sumexp and target logit together
    MS_RETURN_IF_ERROR(be_->VocabParallelFinish(a.losses.data(), a.ce_lse.data(), mx, se, tl, a.targets.data(), N));
  }
  std::vector<float> losses(N);
  MS_RETURN_IF_ERROR(be_->CopyToHost(losses.data(), a.losses.data(), sizeof(float) * N));
  double sum = 0;
  int64_t counted = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (a.targets_host[i] >= 0) {
      sum += losses[i];
      ++counted;
    }
  }
  return static_cast<float>(counted ? sum / counted : 0.0);
}

Status Gpt::HeadBackward(Acts& a, float dloss, float* dres) {
  const int64_t C = spec_.hidden, N = N_, R = rows_, Vl = Vl_;
  const bool tp = shard_.tp_size > 1, sp = shard_.sequence_parallel && tp;
  auto P = [&](const char* name) { return param_data() + FindParam(name)->offset; };
  auto G = [&](const char* name) { return grad_data() + FindParam(name)->offset; };
  float* s = scratch_.data();
  float* dln = s + 2 * R * C;
  float* dln_full = s + 3 * R * C + 3 * N * C;
  const int64_t HlD = Hl_ * (C / spec_.heads);
  float* dlogits = s + 3 * R * C + 5 * N * C + 4 * N * HlD + 2 * N * Fl_;
  float* dl = dlogits + N * Vl;
  if (!tp) {
    const std::vector<float> dl_host(N, dloss);
    MS_RETURN_IF_ERROR(be_->CopyFromHost(dl, dl_host.data(), sizeof(float) * N));
    MS_RETURN_IF_ERROR(be_->CrossEntropyBackward(dlogits, a.logits.data(), a.ce_lse.data(), a.targets.data(), dl, N, Vl));
  } else {
    MS_RETURN_IF_ERROR(be_->VocabParallelBackward(dlogits, a.logits.data(), a.ce_lse.data(), a.targets.data(), dloss,
                                                  shard_.tp_rank * Vl, N, Vl));
  }
  const char* head = spec_.tied_embeddings ? "embed.wte" : "lm_head.weight";
  const float* lnfin = sp ? a.lnf_full.data() : a.lnf.data();
  float* dlnf = tp ? dln_full : dln;
  MS_RETURN_IF_ERROR(be_->Zero(dlnf, sizeof(float) * (N * C)));
  MS_RETURN_IF_ERROR(be_->MatmulBackward(dlnf, G(head), nullptr, dlogits, lnfin, P(head), N, C, Vl));
  if (sp) {
    MS_RETURN_IF_ERROR(TpReduceScatterRows(dln_full, dln));
    dlnf = dln;
  } else if (tp) {
    MS_RETURN_IF_ERROR(TpAllReduce(dln_full, N * C));
  }
  const Chunk& ch = chunks_[static_cast<size_t>(num_chunks() - 1)];
  const float* x = a.res.data() + ch.num_layers * R * C;
  MS_RETURN_IF_ERROR(be_->Zero(dres, sizeof(float) * (R * C)));
  MS_RETURN_IF_ERROR(be_->LayerNormBackward(dres, G("final_norm.weight"), G("final_norm.bias"), dlnf, x, P("final_norm.weight"),
                         a.lnf_mean.data(), a.lnf_rstd.data(), R, C));
  return Status::Ok();
}

Status Gpt::BackwardChunk(int chunk, int slot, const float* dout, float dloss,
                          const std::function<void(int)>& on_layer_done) {
  if (chunk < 0 || chunk >= num_chunks()) return InvalidArgument("chunk {} of {}", chunk, num_chunks());
  auto it = acts_.find({chunk, slot});
  if (it == acts_.end() || !it->second->forward_done) {
    return FailedPrecondition("backward of chunk {} slot {} without its forward", chunk, slot);
  }
  Acts& a = *it->second;
  a.forward_done = false;
  const Chunk& ch = chunks_[chunk];
  const int64_t B = B_, T = spec_.seq_len, C = spec_.hidden, N = N_, R = rows_;
  const int64_t D = C / spec_.heads, HlD = Hl_ * D, Fl = Fl_;
  const bool seq = spec_.block == config::BlockKind::kSequential;
  const bool tp = shard_.tp_size > 1, sp = shard_.sequence_parallel && tp;
  float* s = scratch_.data();
  float* dres = s;
  float* dln = s + 2 * R * C;
  float* dy_full_buf = s + 3 * R * C + 2 * N * C;
  float* dln_full = dy_full_buf + N * C;
  float* datty = s + 3 * R * C + 5 * N * C;
  float* dqkv = datty + N * HlD;
  float* dfch_gelu = dqkv + 3 * N * HlD;
  float* dfch = dfch_gelu + N * Fl;
  auto P = [&](const ParamInfo* p) { return param_data() + p->offset; };
  auto G = [&](const ParamInfo* p) { return grad_data() + p->offset; };
  auto done = [&](int layer) {
    if (on_layer_done) on_layer_done(layer);
  };

  if (ch.head) {
    MS_RETURN_IF_ERROR(HeadBackward(a, dloss, dres));
    done(spec_.layers);
  } else {
    if (!dout) return InvalidArgument("chunk {} needs the gradient of its output", ch.global);
    MS_RETURN_IF_ERROR(be_->Copy(dres, dout, sizeof(float) * R * C));
  }
  // dres [R,C] -> the full-row gradient the column/row GEMMs see.
  auto full_rows = [&]() -> Result<float*> {
    if (!sp) return dres;
    MS_RETURN_IF_ERROR(TpAllGatherRows(dres, dy_full_buf));
    return dy_full_buf;
  };
  // dln_full [N,C] partial over tp -> dln [R,C] summed (the conjugate of the forward gather).
  auto reduce_dln = [&]() -> Result<float*> {
    if (!tp) return dln_full;
    if (sp) {
      MS_RETURN_IF_ERROR(TpReduceScatterRows(dln_full, dln));
      return dln;
    }
    MS_RETURN_IF_ERROR(TpAllReduce(dln_full, N * C));
    return dln_full;
  };
  for (int i = ch.num_layers - 1; i >= 0; --i) {
    const int l = ch.first_layer + i;
    const LayerW w = Layer(l);
    auto& y = a.layers[i];
    const float* x = a.res.data() + i * R * C;
    const float* ln1in = sp ? y.ln1_full.data() : y.ln1.data();
    if (seq) {
      const float* ln2in = sp ? y.ln2_full.data() : y.ln2.data();
      MS_RETURN_IF_ERROR(be_->BiasGrad(G(w.mprojb), dres, R, C));
      MS_ASSIGN_OR_RETURN(float* dy, full_rows());
      MS_RETURN_IF_ERROR(be_->Zero(dfch_gelu, sizeof(float) * (N * Fl)));
      MS_RETURN_IF_ERROR(be_->MatmulBackward(dfch_gelu, G(w.mprojw), nullptr, dy, y.fch_gelu.data(), P(w.mprojw), N, Fl, C));
      MS_RETURN_IF_ERROR(be_->GeluBackward(dfch, y.fch.data(), dfch_gelu, N * Fl));
      MS_RETURN_IF_ERROR(be_->Zero(dln_full, sizeof(float) * (N * C)));
      MS_RETURN_IF_ERROR(be_->MatmulBackward(dln_full, G(w.fcw), G(w.fcb), dfch, ln2in, P(w.fcw), N, C, Fl));
      MS_ASSIGN_OR_RETURN(float* dln2, reduce_dln());
      MS_RETURN_IF_ERROR(be_->LayerNormBackward(dres, G(w.ln2w), G(w.ln2b), dln2, y.mid.data(), P(w.ln2w), y.ln2_mean.data(),
                             y.ln2_rstd.data(), R, C));  // dres is now dL/d(mid)
      MS_RETURN_IF_ERROR(be_->BiasGrad(G(w.projb), dres, R, C));
      MS_ASSIGN_OR_RETURN(float* dy2, full_rows());
      MS_RETURN_IF_ERROR(be_->Zero(datty, sizeof(float) * (N * HlD)));
      MS_RETURN_IF_ERROR(be_->MatmulBackward(datty, G(w.projw), nullptr, dy2, y.atty.data(), P(w.projw), N, HlD, C));
      MS_RETURN_IF_ERROR(be_->AttentionBackward(dqkv, datty, y.qkv.data(), y.atty.data(), y.lse.data(), B, T, Hl_, D, spec_.window));
      MS_RETURN_IF_ERROR(be_->Zero(dln_full, sizeof(float) * (N * C)));
      MS_RETURN_IF_ERROR(be_->MatmulBackward(dln_full, G(w.qkvw), G(w.qkvb), dqkv, ln1in, P(w.qkvw), N, C, 3 * HlD));
    } else {
      MS_RETURN_IF_ERROR(be_->BiasGrad(G(w.mprojb), dres, R, C));
      MS_RETURN_IF_ERROR(be_->BiasGrad(G(w.projb), dres, R, C));
      MS_ASSIGN_OR_RETURN(float* dy, full_rows());
      MS_RETURN_IF_ERROR(be_->Zero(dfch_gelu, sizeof(float) * (N * Fl)));
      MS_RETURN_IF_ERROR(be_->MatmulBackward(dfch_gelu, G(w.mprojw), nullptr, dy, y.fch_gelu.data(), P(w.mprojw), N, Fl, C));
      MS_RETURN_IF_ERROR(be_->GeluBackward(dfch, y.fch.data(), dfch_gelu, N * Fl));
      MS_RETURN_IF_ERROR(be_->Zero(dln_full, sizeof(float) * (N * C)));
      MS_RETURN_IF_ERROR(be_->MatmulBackward(dln_full, G(w.fcw), G(w.fcb), dfch, ln1in, P(w.fcw), N, C, Fl));
      MS_RETURN_IF_ERROR(be_->Zero(datty, sizeof(float) * (N * HlD)));
      MS_RETURN_IF_ERROR(be_->MatmulBackward(datty, G(w.projw), nullptr, dy, y.atty.data(), P(w.projw), N, HlD, C));
      MS_RETURN_IF_ERROR(be_->AttentionBackward(dqkv, datty, y.qkv.data(), y.atty.data(), y.lse.data(), B, T, Hl_, D, spec_.window));
      // Both branches' LayerNorm-input gradients add up in dln_full: ONE reduction below.
      MS_RETURN_IF_ERROR(be_->MatmulBackward(dln_full, G(w.qkvw), G(w.qkvb), dqkv, ln1in, P(w.qkvw), N, C, 3 * HlD));
    }
    // The key bias shifts every score of a query by the same amount, which softmax ignores: its
    // gradient is exactly zero. Computed, it is rounding noise that Adam would amplify into
    // lr-sized random steps, different for every layout; keep it at its exact value.
    MS_RETURN_IF_ERROR(be_->Zero(G(w.qkvb) + HlD, sizeof(float) * HlD));
    MS_ASSIGN_OR_RETURN(float* dln1, reduce_dln());
    MS_RETURN_IF_ERROR(be_->LayerNormBackward(dres, G(w.ln1w), G(w.ln1b), dln1, x, P(w.ln1w), y.ln1_mean.data(), y.ln1_rstd.data(), R, C));
    done(l);
  }
  if (ch.embedding) {
    float* dwpe = G(FindParam("embed.wpe"));
    const int64_t row0 = sp ? shard_.tp_rank * R : 0;
    MS_RETURN_IF_ERROR(be_->PositionsBackward(dwpe, dres, R, C, T, row0));
    MS_ASSIGN_OR_RETURN(float* dx0, full_rows());
    MS_RETURN_IF_ERROR(be_->EmbeddingBackward(G(FindParam("embed.wte")), a.inputs.data(), dx0, N, C));
    done(-1);
  } else {
    MS_RETURN_IF_ERROR(be_->Copy(a.dx_in.data(), dres, sizeof(float) * R * C));
  }
  return Status::Ok();
}

Status Gpt::ReduceSequenceParallelGrads() {
  if (!(shard_.sequence_parallel && shard_.tp_size > 1)) return Status::Ok();
  // The sp_partial tensors are laid out last and contiguously (see Create): one all-reduce over the range.
  int64_t first = num_params_, last = 0;
  for (const auto& p : params_) {
    if (!p.sp_partial) continue;
    first = std::min(first, p.offset);
    last = std::max(last, p.offset + p.numel);
  }
  if (last <= first) return Status::Ok();
  return TpAllReduce(grad_data() + first, last - first);
}

}  // namespace ms::model
