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
// y[R, C] += b[C] on every row.
void AddRowBias(float* y, const float* b, int64_t R, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) ops::AddInPlace(y + r * C, b, C);
}
// db[C] += column sums of dy[R, C], rows summed in order (deterministic).
void BiasGrad(float* db, const float* dy, int64_t R, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < C; ++c) {
    float s = 0;
    for (int64_t r = 0; r < R; ++r) s += dy[r * C + c];
    db[c] += s;
  }
}
void Zero(float* p, int64_t n) {
  std::memset(p, 0, sizeof(float) * n);
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
struct Gpt::Acts {
  std::vector<int32_t> inputs, targets;  // [N]; inputs as local vocab ids under tp (-1: another rank's row)
  std::vector<float> res;                // (layers+1) x [R, C]
  struct Layer {
    std::vector<float> ln1, ln1_mean, ln1_rstd, ln1_full, qkv, atty, lse, fch, fch_gelu;
    std::vector<float> mid, ln2, ln2_mean, ln2_rstd, ln2_full;
  };
  std::vector<Layer> layers;
  std::vector<float> lnf, lnf_mean, lnf_rstd, lnf_full, logits, ce_lse, losses;
  std::vector<float> dx_in;  // [R, C] gradient of the chunk input (to send upstream)
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
                                         uint64_t seed, device::Device* device, ModelComms comms) {
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
  if (!device->is_host()) return Unimplemented("the GPT runs on host memory only in this build");
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
  const int64_t R = g->rows_, HlD = g->Hl_ * (C / spec.heads);
  // Scratch: dres, partR, dln [R,C]; part, part2, dy_full, dln_full, e_full [N,C]; datty [N,HlD];
  // dqkv [N,3HlD]; dfch_gelu, dfch [N,Fl]; dlogits [N,Vl]; dl, vstats [N] x 4.
  g->scratch_.assign(3 * R * C + 5 * N * C + N * HlD + 3 * N * HlD + 2 * N * g->Fl_ + N * g->Vl_ + 4 * N, 0.0f);
  return g;
}

Status Gpt::Init(uint64_t seed) {
  const double std_base = spec_.init_std;
  const double std_proj = spec_.init_std / std::sqrt(2.0 * spec_.layers);  // GPT-2 residual scaling
  std::vector<float> global;
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
    ExtractShard(global.data(), param_data() + p.offset, p.global_shape, p.shard, shard_.tp_size, shard_.tp_rank);
  }
  ZeroGrad();
  return Status::Ok();
}

void Gpt::ZeroGrad() {
  Zero(grad_data(), num_params_);
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

Gpt::Acts& Gpt::SlotActs(int chunk, int slot) {
  auto& ptr = acts_[{chunk, slot}];
  if (!ptr) {
    ptr = std::make_unique<Acts>();
    Acts& a = *ptr;
    const int64_t C = spec_.hidden, N = N_, R = rows_, HlD = Hl_ * (C / spec_.heads);
    const bool seq = spec_.block == config::BlockKind::kSequential, sp = shard_.sequence_parallel && shard_.tp_size > 1;
    const Chunk& ch = chunks_[chunk];
    a.inputs.assign(N, 0);
    a.targets.assign(N, 0);
    a.res.assign((ch.num_layers + 1) * R * C, 0.0f);
    a.layers.resize(ch.num_layers);
    for (auto& y : a.layers) {
      y.ln1.resize(R * C);
      y.ln1_mean.resize(R);
      y.ln1_rstd.resize(R);
      if (sp) y.ln1_full.resize(N * C);
      y.qkv.resize(N * 3 * HlD);
      y.atty.resize(N * HlD);
      y.lse.resize(B_ * Hl_ * spec_.seq_len);
      y.fch.resize(N * Fl_);
      y.fch_gelu.resize(N * Fl_);
      if (seq) {
        y.mid.resize(R * C);
        y.ln2.resize(R * C);
        y.ln2_mean.resize(R);
        y.ln2_rstd.resize(R);
        if (sp) y.ln2_full.resize(N * C);
      }
    }
    if (ch.head) {
      a.lnf.resize(R * C);
      a.lnf_mean.resize(R);
      a.lnf_rstd.resize(R);
      if (sp) a.lnf_full.resize(N * C);
      a.logits.resize(N * Vl_);
      a.ce_lse.resize(N);
      a.losses.resize(N);
    }
    if (!ch.embedding) a.dx_in.resize(R * C);
  }
  return *ptr;
}

const float* Gpt::ChunkOutput(int chunk, int slot) const {
  const Acts& a = *acts_.at({chunk, slot});
  return a.res.data() + chunks_[chunk].num_layers * rows_ * spec_.hidden;
}
const float* Gpt::InputGrad(int chunk, int slot) const {
  return acts_.at({chunk, slot})->dx_in.data();
}

Status Gpt::TpAllReduce(float* x, int64_t n) {
  if (shard_.tp_size == 1) return Status::Ok();
  return comms_.tp->AllReduce(x, n, comm::ReduceOp::kSum)->Wait().WithContext("tensor-parallel all-reduce");
}
Status Gpt::TpAllGatherRows(const float* local, float* full) {
  return comms_.tp->AllGather(local, full, rows_ * spec_.hidden)->Wait().WithContext("sequence-parallel all-gather");
}
Status Gpt::TpReduceScatterRows(const float* full, float* local) {
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
  Acts& a = SlotActs(chunk, slot);
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
      a.inputs[i] = (local >= 0 && local < Vl_) ? static_cast<int32_t>(local) : -1;
    }
    float* x0 = a.res.data();
    if (!tp) {
      ops::EmbeddingForward(x0, a.inputs.data(), P(FindParam("embed.wte")), N, C);
    } else {
      ops::EmbeddingForward(e_full, a.inputs.data(), P(FindParam("embed.wte")), N, C);  // other ranks' rows: 0
      if (sp) {
        MS_RETURN_IF_ERROR(TpReduceScatterRows(e_full, x0));
      } else {
        MS_RETURN_IF_ERROR(TpAllReduce(e_full, N * C));
        std::memcpy(x0, e_full, sizeof(float) * N * C);
      }
    }
    const float* wpe = P(FindParam("embed.wpe"));
    const int64_t row0 = sp ? shard_.tp_rank * R : 0;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) ops::AddInPlace(x0 + r * C, wpe + ((row0 + r) % T) * C, C);
  } else {
    if (!x_in) return InvalidArgument("chunk {} needs the previous stage's activations", ch.global);
    std::memcpy(a.res.data(), x_in, sizeof(float) * R * C);
  }
  if (ch.head) {
    if (!targets) return InvalidArgument("the head chunk needs targets");
    for (int64_t i = 0; i < N; ++i) {
      if (targets[i] >= V) return InvalidArgument("target id {} at position {} is >= vocab {}", targets[i], i, V);
    }
    std::memcpy(a.targets.data(), targets, sizeof(int32_t) * N);
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
    ops::LayerNormForward(y.ln1.data(), y.ln1_mean.data(), y.ln1_rstd.data(), x, P(w.ln1w), P(w.ln1b), R, C,
                          spec_.norm_eps);
    const float* ln1in = y.ln1.data();
    if (sp) {
      MS_RETURN_IF_ERROR(TpAllGatherRows(y.ln1.data(), y.ln1_full.data()));
      ln1in = y.ln1_full.data();
    }
    ops::MatmulForward(y.qkv.data(), ln1in, P(w.qkvw), P(w.qkvb), N, C, 3 * HlD);
    ops::AttentionForward(y.atty.data(), y.lse.data(), y.qkv.data(), B, T, Hl_, D, spec_.window);
    ops::MatmulForward(part, y.atty.data(), P(w.projw), nullptr, N, HlD, C);
    if (seq) {
      MS_ASSIGN_OR_RETURN(float* attn_out, reduce_part(part));
      ops::Add(y.mid.data(), x, attn_out, R * C);
      AddRowBias(y.mid.data(), P(w.projb), R, C);
      ops::LayerNormForward(y.ln2.data(), y.ln2_mean.data(), y.ln2_rstd.data(), y.mid.data(), P(w.ln2w), P(w.ln2b), R,
                            C, spec_.norm_eps);
      const float* ln2in = y.ln2.data();
      if (sp) {
        MS_RETURN_IF_ERROR(TpAllGatherRows(y.ln2.data(), y.ln2_full.data()));
        ln2in = y.ln2_full.data();
      }
      ops::MatmulForward(y.fch.data(), ln2in, P(w.fcw), P(w.fcb), N, C, Fl);
      ops::GeluForward(y.fch_gelu.data(), y.fch.data(), N * Fl);
      ops::MatmulForward(part, y.fch_gelu.data(), P(w.mprojw), nullptr, N, Fl, C);
      MS_ASSIGN_OR_RETURN(float* mlp_out, reduce_part(part));
      ops::Add(out, y.mid.data(), mlp_out, R * C);
      AddRowBias(out, P(w.mprojb), R, C);
    } else {
      ops::MatmulForward(y.fch.data(), ln1in, P(w.fcw), P(w.fcb), N, C, Fl);
      ops::GeluForward(y.fch_gelu.data(), y.fch.data(), N * Fl);
      ops::MatmulForward(part2, y.fch_gelu.data(), P(w.mprojw), nullptr, N, Fl, C);
      ops::AddInPlace(part, part2, N * C);  // attention + MLP partial sums: ONE reduction below
      MS_ASSIGN_OR_RETURN(float* both, reduce_part(part));
      ops::Add(out, x, both, R * C);
      AddRowBias(out, P(w.projb), R, C);
      AddRowBias(out, P(w.mprojb), R, C);
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
  ops::LayerNormForward(a.lnf.data(), a.lnf_mean.data(), a.lnf_rstd.data(), x, P("final_norm.weight"),
                        P("final_norm.bias"), R, C, spec_.norm_eps);
  const float* lnfin = a.lnf.data();
  if (sp) {
    MS_RETURN_IF_ERROR(TpAllGatherRows(a.lnf.data(), a.lnf_full.data()));
    lnfin = a.lnf_full.data();
  }
  const float* head = P(spec_.tied_embeddings ? "embed.wte" : "lm_head.weight");
  ops::MatmulForward(a.logits.data(), lnfin, head, nullptr, N, C, Vl);
  if (!tp) {
    ops::CrossEntropyForward(a.losses.data(), a.ce_lse.data(), a.logits.data(), a.targets.data(), N, Vl);
  } else {
    // Vocab-parallel cross-entropy: global max, sum of exponentials and target logit by all-reduce.
    float* stats = scratch_.data() + scratch_.size() - 3 * N;  // max | sumexp | target logit
    float *mx = stats, *se = stats + N, *tl = stats + 2 * N;
    const int64_t vstart = shard_.tp_rank * Vl;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* row = a.logits.data() + i * Vl;
      float m = row[0];
      for (int64_t j = 1; j < Vl; ++j) m = std::max(m, row[j]);
      mx[i] = m;
    }
    MS_RETURN_IF_ERROR(
        comms_.tp->AllReduce(mx, N, comm::ReduceOp::kMax)->Wait().WithContext("vocab-parallel loss: max"));
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* row = a.logits.data() + i * Vl;
      double sum = 0;
      for (int64_t j = 0; j < Vl; ++j) sum += std::exp(static_cast<double>(row[j]) - mx[i]);
      se[i] = static_cast<float>(sum);
      const int64_t t = a.targets[i] - vstart;
      tl[i] = (a.targets[i] >= 0 && t >= 0 && t < Vl) ? row[t] : 0.0f;
    }
    MS_RETURN_IF_ERROR(TpAllReduce(se, 2 * N));  // sumexp and target logit together
    for (int64_t i = 0; i < N; ++i) {
      a.ce_lse[i] = mx[i] + std::log(se[i]);
      a.losses[i] = a.targets[i] >= 0 ? a.ce_lse[i] - tl[i] : 0.0f;
    }
  }
  double sum = 0;
  int64_t counted = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (a.targets[i] >= 0) {
      sum += a.losses[i];
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
  for (int64_t i = 0; i < N; ++i) dl[i] = dloss;
  if (!tp) {
    ops::CrossEntropyBackward(dlogits, a.logits.data(), a.ce_lse.data(), a.targets.data(), dl, N, Vl);
  } else {
    const int64_t vstart = shard_.tp_rank * Vl;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      float* d = dlogits + i * Vl;
      const float* row = a.logits.data() + i * Vl;
      if (a.targets[i] < 0) {
        Zero(d, Vl);
        continue;
      }
      for (int64_t j = 0; j < Vl; ++j) d[j] = std::exp(row[j] - a.ce_lse[i]) * dl[i];
      const int64_t t = a.targets[i] - vstart;
      if (t >= 0 && t < Vl) d[t] -= dl[i];
    }
  }
  const char* head = spec_.tied_embeddings ? "embed.wte" : "lm_head.weight";
  const float* lnfin = sp ? a.lnf_full.data() : a.lnf.data();
  float* dlnf = tp ? dln_full : dln;
  Zero(dlnf, N * C);
  ops::MatmulBackward(dlnf, G(head), nullptr, dlogits, lnfin, P(head), N, C, Vl);
  if (sp) {
    MS_RETURN_IF_ERROR(TpReduceScatterRows(dln_full, dln));
    dlnf = dln;
  } else if (tp) {
    MS_RETURN_IF_ERROR(TpAllReduce(dln_full, N * C));
  }
  const Chunk& ch = chunks_[static_cast<size_t>(num_chunks() - 1)];
  const float* x = a.res.data() + ch.num_layers * R * C;
  Zero(dres, R * C);
  ops::LayerNormBackward(dres, G("final_norm.weight"), G("final_norm.bias"), dlnf, x, P("final_norm.weight"),
                         a.lnf_mean.data(), a.lnf_rstd.data(), R, C);
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
    std::memcpy(dres, dout, sizeof(float) * R * C);
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
      BiasGrad(G(w.mprojb), dres, R, C);
      MS_ASSIGN_OR_RETURN(float* dy, full_rows());
      Zero(dfch_gelu, N * Fl);
      ops::MatmulBackward(dfch_gelu, G(w.mprojw), nullptr, dy, y.fch_gelu.data(), P(w.mprojw), N, Fl, C);
      ops::GeluBackward(dfch, y.fch.data(), dfch_gelu, N * Fl);
      Zero(dln_full, N * C);
      ops::MatmulBackward(dln_full, G(w.fcw), G(w.fcb), dfch, ln2in, P(w.fcw), N, C, Fl);
      MS_ASSIGN_OR_RETURN(float* dln2, reduce_dln());
      ops::LayerNormBackward(dres, G(w.ln2w), G(w.ln2b), dln2, y.mid.data(), P(w.ln2w), y.ln2_mean.data(),
                             y.ln2_rstd.data(), R, C);  // dres is now dL/d(mid)
      BiasGrad(G(w.projb), dres, R, C);
      MS_ASSIGN_OR_RETURN(float* dy2, full_rows());
      Zero(datty, N * HlD);
      ops::MatmulBackward(datty, G(w.projw), nullptr, dy2, y.atty.data(), P(w.projw), N, HlD, C);
      ops::AttentionBackward(dqkv, datty, y.qkv.data(), y.atty.data(), y.lse.data(), B, T, Hl_, D, spec_.window);
      Zero(dln_full, N * C);
      ops::MatmulBackward(dln_full, G(w.qkvw), G(w.qkvb), dqkv, ln1in, P(w.qkvw), N, C, 3 * HlD);
    } else {
      BiasGrad(G(w.mprojb), dres, R, C);
      BiasGrad(G(w.projb), dres, R, C);
      MS_ASSIGN_OR_RETURN(float* dy, full_rows());
      Zero(dfch_gelu, N * Fl);
      ops::MatmulBackward(dfch_gelu, G(w.mprojw), nullptr, dy, y.fch_gelu.data(), P(w.mprojw), N, Fl, C);
      ops::GeluBackward(dfch, y.fch.data(), dfch_gelu, N * Fl);
      Zero(dln_full, N * C);
      ops::MatmulBackward(dln_full, G(w.fcw), G(w.fcb), dfch, ln1in, P(w.fcw), N, C, Fl);
      Zero(datty, N * HlD);
      ops::MatmulBackward(datty, G(w.projw), nullptr, dy, y.atty.data(), P(w.projw), N, HlD, C);
      ops::AttentionBackward(dqkv, datty, y.qkv.data(), y.atty.data(), y.lse.data(), B, T, Hl_, D, spec_.window);
      // Both branches' LayerNorm-input gradients add up in dln_full: ONE reduction below.
      ops::MatmulBackward(dln_full, G(w.qkvw), G(w.qkvb), dqkv, ln1in, P(w.qkvw), N, C, 3 * HlD);
    }
    // The key bias shifts every score of a query by the same amount, which softmax ignores: its
    // gradient is exactly zero. Computed, it is rounding noise that Adam would amplify into
    // lr-sized random steps, different for every layout; keep it at its exact value.
    std::memset(G(w.qkvb) + HlD, 0, sizeof(float) * HlD);
    MS_ASSIGN_OR_RETURN(float* dln1, reduce_dln());
    ops::LayerNormBackward(dres, G(w.ln1w), G(w.ln1b), dln1, x, P(w.ln1w), y.ln1_mean.data(), y.ln1_rstd.data(), R, C);
    done(l);
  }
  if (ch.embedding) {
    float* dwpe = G(FindParam("embed.wpe"));
    const int64_t row0 = sp ? shard_.tp_rank * R : 0;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < C; ++c) {
      for (int64_t r = 0; r < R; ++r) dwpe[((row0 + r) % T) * C + c] += dres[r * C + c];
    }
    MS_ASSIGN_OR_RETURN(float* dx0, full_rows());
    ops::EmbeddingBackward(G(FindParam("embed.wte")), a.inputs.data(), dx0, N, C);
    done(-1);
  } else {
    std::memcpy(a.dx_in.data(), dres, sizeof(float) * R * C);
  }
  return Status::Ok();
}

Status Gpt::ReduceSequenceParallelGrads() {
  if (!(shard_.sequence_parallel && shard_.tp_size > 1)) return Status::Ok();
  std::vector<float> packed;
  for (const auto& p : params_) {
    if (p.sp_partial) packed.insert(packed.end(), grad_data() + p.offset, grad_data() + p.offset + p.numel);
  }
  MS_RETURN_IF_ERROR(TpAllReduce(packed.data(), static_cast<int64_t>(packed.size())));
  size_t at = 0;
  for (const auto& p : params_) {
    if (!p.sp_partial) continue;
    std::memcpy(grad_data() + p.offset, packed.data() + at, sizeof(float) * p.numel);
    at += p.numel;
  }
  return Status::Ok();
}

}  // namespace ms::model
