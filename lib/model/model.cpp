#include "model/model.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <utility>

#include "model/acts.h"
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
// The logit of a vocabulary padding row: exp(kMaskedLogit - max) is exactly 0 (std::exp, expf, ops' ExpF), so the
// padding is out of the softmax and gets a zero gradient; finite, so no inf - inf ever makes a NaN.
constexpr float kMaskedLogit = -1e30f;
// The mean loss of a micro-batch over the tokens that have a target (>= 0), summed in token order in double.
float MeanLoss(const float* losses, const int32_t* targets, int64_t N) {
  double sum = 0;
  int64_t counted = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (targets[i] >= 0) {
      sum += losses[i];
      ++counted;
    }
  }
  return static_cast<float>(counted ? sum / counted : 0.0);
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
  // The classifier computes every row of the padded vocabulary (model.vocab_pad_to): those are its FLOPs.
  const double C = s.hidden, F = s.ffn_hidden > 0 ? s.ffn_hidden : 4.0 * s.hidden, L = s.layers,
               V = static_cast<double>(s.padded_vocab());
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

Gpt::~Gpt() = default;

std::string Gpt::bf16_activations() const {
  if (!Bf16Fc()) return "";
  std::string s = "fc output, GeLU output gradient";
  if (Bf16Logits()) s += ", logits";
  const int64_t D = spec_.hidden / spec_.heads;
  if (Bf16AttnIO(D)) s += ", qkv, attention output gradient";
  if (!Atty32(D)) s += ", attention output";
  if (Bf16BranchOut()) s += ", attention and MLP projection outputs";
  if (Bf16LnGrad()) {
    s += spec_.block == config::BlockKind::kSequential ? ", LayerNorm input gradients"
                                                       : ", final LayerNorm input gradient";
  }
  if (FusedTpSums16()) {
    s += spec_.block == config::BlockKind::kSequential
             ? ", tensor-parallel partial sums (projection outputs, LayerNorm input gradients)"
             : ", tensor-parallel partial sums (final LayerNorm input gradient)";
  }
  return s;
}

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
  if (tp < 1 || pp < 1 || v < 1 || spec.heads % tp || spec.ffn_hidden % tp || spec.padded_vocab() % tp ||
      spec.layers % (pp * v) || shard.tp_rank < 0 || shard.tp_rank >= tp || shard.pp_rank < 0 || shard.pp_rank >= pp) {
    return InvalidArgument(
        "layout tp={} (rank {}) pp={} (rank {}) virtual_stages={} does not divide the model "
        "(heads {}, ffn_hidden {}, vocab {} padded to {}, layers {})",
        tp, shard.tp_rank, pp, shard.pp_rank, v, spec.heads, spec.ffn_hidden, spec.vocab, spec.padded_vocab(),
        spec.layers);
  }
  if (tp > 1 && comms.tp == nullptr) return InvalidArgument("tp={} needs a tensor-parallel communicator", tp);
  if (tp > 1 && comms.tp->size() != tp) {
    return InvalidArgument("tensor-parallel communicator has {} ranks, layout says tp={}", comms.tp->size(), tp);
  }
  const int64_t N = static_cast<int64_t>(micro_batch) * spec.seq_len;
  if (shard.tp_comm_chunks < 1) {
    return InvalidArgument("tp_comm_chunks = {} must be >= 1 (1: unchunked tensor-parallel collectives)",
                           shard.tp_comm_chunks);
  }
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
  g->Vl_ = spec.padded_vocab() / tp;
  g->device_ = device;
  if (backend) {
    if (backend->device() != device)
      return InvalidArgument("the ops backend ({}) works on another device", backend->name());
    g->be_ = backend;
  } else {
    if (!device->is_host()) return InvalidArgument("device {} needs an ops backend", device->name());
    g->own_be_ = ops::MakeCpuBackend(device);
    g->be_ = g->own_be_.get();
  }
  if (shard.bf16_fc && !(g->be_->bf16_activations() && shard.fused_kernels)) {
    return FailedPrecondition(
        "runtime.activations: bf16 needs bf16 GEMMs on bf16 operands (runtime.backend: cuda, train.precision: bf16, "
        "runtime.bf16_operands: keep or cast; this is the {} backend{}) and runtime.fused_kernels: true (the fused "
        "bias + GeLU reads the bf16 fc output); use runtime.activations: fp32",
        g->be_->name(), g->be_->bf16_gemm() ? "" : " with fp32 GEMMs");
  }
  const int64_t C = spec.hidden, F = spec.ffn_hidden, V = spec.padded_vocab(), T = spec.seq_len;
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
  g->grad_ptrs_.assign(g->params_.size(), nullptr);
  if (!shard.placed_grads) {
    MS_ASSIGN_OR_RETURN(g->grads_buf_, device::Buffer::Allocate(device, std::max<int64_t>(g->num_params_, 1)));
    for (size_t i = 0; i < g->params_.size(); ++i) g->grad_ptrs_[i] = g->grads_buf_.f32() + g->params_[i].offset;
  }
  MS_RETURN_IF_ERROR(g->Init(seed));
  // The padded vocabulary's logits are masked out of the softmax by the classifier GEMM's bias: 0 for a real
  // column, kMaskedLogit for a padding one (only on a rank whose vocabulary slice holds padding).
  const int64_t v0 = static_cast<int64_t>(shard.tp_rank) * g->Vl_;
  if (v0 + g->Vl_ > spec.vocab) {
    std::vector<float> mask(static_cast<size_t>(g->Vl_), 0.0f);
    for (int64_t j = std::max<int64_t>(0, spec.vocab - v0); j < g->Vl_; ++j)
      mask[static_cast<size_t>(j)] = kMaskedLogit;
    MS_RETURN_IF_ERROR(g->logit_mask_.Allocate(g->be_, g->Vl_).WithContext("vocabulary padding mask"));
    MS_RETURN_IF_ERROR(g->be_->CopyFromHost(g->logit_mask_.data(), mask.data(), sizeof(float) * mask.size()));
    g->masked_logits_ = true;
  }
  if (!shard.placed_grads) MS_RETURN_IF_ERROR(g->ZeroGrad());
  if (g->be_->keeps_bf16_copies()) {
    g->keep_bf16_ = true;
    MS_RETURN_IF_ERROR(AllocateBf16(g->bf16_params_, g->be_, g->num_params_).WithContext("bf16 weight copies"));
    g->bf16_made_in_.assign(g->params_.size(), 0);
    g->bf16_written_one_.assign(g->params_.size(), 0);
    // The weights a step reads only through their copies: those KeptLayer and the head's KeptWeight hand the GEMMs
    // (a tied wte excepted: the embedding reads its fp32 value).
    g->bf16_only_.assign(g->params_.size(), 0);
    auto mark_only = [&](const ParamInfo* p) {
      if (p != nullptr) g->bf16_only_[static_cast<size_t>(p - g->params_.data())] = 1;
    };
    for (int l = 0; l < spec.layers; ++l) {
      const LayerW w = g->Layer(l);
      for (const ParamInfo* p : {w.qkvw, w.projw, w.fcw, w.mprojw}) mark_only(p);
    }
    if (!spec.tied_embeddings) mark_only(g->FindParam("lm_head.weight"));
    MS_RETURN_IF_ERROR(AllocateBf16(g->dres_16_, g->be_, N * C));  // all N rows: gathered under SP
    MS_RETURN_IF_ERROR(AllocateBf16(g->dfch_16_, g->be_, N * g->Fl_));
    MS_RETURN_IF_ERROR(AllocateBf16(g->dqkv_16_, g->be_, N * 3 * g->Hl_ * (C / spec.heads)));
    // Test hook (docs/cuda.md): MEGASCALE_PLANT=kept_bf16_stale keeps the first step's bf16 weights for every
    // later step — the planted bug tests/cuda/train_emulated_test.py must catch.
    // MEGASCALE_PLANT=optimizer_bf16_unwritten: the optimizer is handed no bf16 weight copies to write
    // (bf16_param_data() is null) but the step still declares them written — caught by the same test.
    const char* plant = std::getenv("MEGASCALE_PLANT");
    g->plant_stale_bf16_ = plant && std::strcmp(plant, "kept_bf16_stale") == 0;
    g->plant_unwritten_bf16_ = plant && std::strcmp(plant, "optimizer_bf16_unwritten") == 0;
  }
  const int64_t R = g->rows_, HlD = g->Hl_ * (C / spec.heads);
  // Scratch: dres, partR, dln [R,C]; part, dy_full, dln_full, e_full [N,C]; datty [N,HlD] (bf16 with Bf16AttnIO);
  // dqkv [N,3HlD] (if Dqkv32); dfch_gelu [N,Fl] (bf16 with Bf16Fc: DfchGeluFloats), dfch [N,Fl] (if Dfch32);
  // vstats [N] x 4 (at the end: vocab-parallel loss). dlogits are written over each slot's logits.
  MS_RETURN_IF_ERROR(g->scratch_.Allocate(g->be_, 3 * R * C + 4 * N * C + g->DattyFloats(C / spec.heads) +
                                                      (g->Dqkv32(C / spec.heads) ? 3 * N * HlD : 0) +
                                                      g->DfchGeluFloats() + (g->Dfch32() ? N * g->Fl_ : 0) + 4 * N));
  // Chunked TP collectives: at most one chunk per row; SP chunks are staged in two buffers of
  // tp blocks of ceil(R / chunks) rows (all-reduce chunks work in place).
  const bool sp = shard.sequence_parallel && tp > 1;
  if (tp > 1) {
    const int64_t k = shard.tp_comm_chunks;
    g->sp_chunks_ = sp ? static_cast<int>(std::min<int64_t>(k, R)) : 1;
    g->ar_chunks_ = sp ? 1 : static_cast<int>(std::min<int64_t>(k, N));
  }
  if (g->sp_chunks_ > 1) {
    g->stage_rows_ = tp * ((R + g->sp_chunks_ - 1) / g->sp_chunks_);
    MS_RETURN_IF_ERROR(g->stage_.Allocate(g->be_, 2 * g->stage_rows_ * C));
  }
  if (tp > 1 && shard.tp_reduce_bf16) {
    g->red16_rows_ = std::max<int64_t>(N, 2 * g->stage_rows_);
    MS_RETURN_IF_ERROR(g->red16_.Allocate(g->be_, (g->red16_rows_ + R) * C / 2 + 1));
    const char* hook = std::getenv("MEGASCALE_TP_SUMS16");  // test hook: FusedTpSums16 off
    g->unfused_sums16_ = hook && std::strcmp(hook, "unfused") == 0;
  }
  return g;
}

Status Gpt::Init(uint64_t seed) {
  const double std_base = spec_.init_std;
  const double std_proj = spec_.init_std / std::sqrt(2.0 * spec_.layers);  // GPT-2 residual scaling
  InvalidateBf16Weights();
  MS_RETURN_IF_ERROR(be_->Zero(param_data(), sizeof(float) * num_params_));  // the alignment gaps too
  // The rank's shard of tensor i, drawn on the host: its own RNG stream (seed, name), so the values depend neither on
  // the order nor on the thread that draws them.
  auto draw = [&](const ParamInfo& p, std::vector<float>& local) {
    const int64_t n = Numel(p.global_shape);
    std::vector<float> global(static_cast<size_t>(n), 0.0f);
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
      if (nm == "embed.wte" || nm == "lm_head.weight") {  // padding rows (model.vocab_pad_to): zero, and stay so
        std::fill(global.begin() + static_cast<int64_t>(spec_.vocab) * spec_.hidden, global.end(), 0.0f);
      }
    }
    local.assign(static_cast<size_t>(p.numel), 0.0f);
    ExtractShard(global.data(), local.data(), p.global_shape, p.shard, shard_.tp_size, shard_.tp_rank);
  };
  // Groups of tensors of at most kGroupFloats (or one larger tensor) drawn in parallel — the OpenMP threads of the
  // rank, a tensor each (a 1.3B model took 34 s drawn one tensor after another) — then copied to the device in
  // order by this thread (one thread drives the backend).
  constexpr int64_t kGroupFloats = int64_t{1} << 28;  // 1 GiB of host memory
  const size_t count = params_.size();
  for (size_t i0 = 0; i0 < count;) {
    size_t i1 = i0 + 1;
    int64_t floats = params_[i0].numel;
    while (i1 < count && floats + params_[i1].numel <= kGroupFloats) floats += params_[i1++].numel;
    std::vector<std::vector<float>> local(i1 - i0);
    const int64_t group = static_cast<int64_t>(i1 - i0);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t j = 0; j < group; ++j) draw(params_[i0 + static_cast<size_t>(j)], local[static_cast<size_t>(j)]);
    for (size_t i = i0; i < i1; ++i) {
      const ParamInfo& p = params_[i];
      MS_RETURN_IF_ERROR(be_->CopyFromHost(param_data() + p.offset, local[i - i0].data(), sizeof(float) * p.numel));
    }
    i0 = i1;
  }
  return be_->Synchronize();
}

Status Gpt::ZeroGrad() {
  if (shard_.placed_grads) return FailedPrecondition("the model's gradients are placed: their owner zeroes them");
  return be_->Zero(grad_data(), sizeof(float) * num_params_).WithContext("zeroing the gradients");
}

Status Gpt::PlaceGradients(const std::vector<float*>& where) {
  if (!shard_.placed_grads) return FailedPrecondition("gradients placed on a model that holds them (placed_grads)");
  if (where.size() != params_.size()) {
    return InvalidArgument("{} gradient places for {} parameters", where.size(), params_.size());
  }
  const ParamInfo* sp0 = nullptr;  // the first sp_partial tensor: the others at their offsets' distances from it
  for (size_t i = 0; i < params_.size(); ++i) {
    if (where[i] == nullptr) return InvalidArgument("no gradient place for {}", params_[i].name);
    if (!params_[i].sp_partial) continue;
    if (sp0 == nullptr || params_[i].offset < sp0->offset) sp0 = &params_[i];
  }
  for (size_t i = 0; sp0 != nullptr && i < params_.size(); ++i) {
    const size_t i0 = static_cast<size_t>(sp0 - params_.data());
    if (params_[i].sp_partial && where[i] - where[i0] != params_[i].offset - sp0->offset) {
      return InvalidArgument("the sequence-parallel gradients must be placed as one range: {} is not", params_[i].name);
    }
  }
  grad_ptrs_ = where;
  return Status::Ok();
}

Result<const void*> Gpt::KeptWeight(const ParamInfo* p) {
  if (!keep_bf16_) return static_cast<const void*>(nullptr);
  const size_t i = static_cast<size_t>(p - params_.data());
  void* dst = Bf16At(bf16_params_, p->offset);
  if (!in_step_ || bf16_made_in_[i] != step_id_) {
    if (be_->capturing()) {  // the graph would repeat the cast at every launch, unseen by the step's bookkeeping
      return Status(Code::kInternal,
                    fmt::format("the bf16 copy of {} would be made inside a graph capture (graphs.cpp: "
                                "CastKeptWeights makes them before)",
                                p->name));
    }
    MS_RETURN_IF_ERROR(be_->CastToBf16(dst, param_data() + p->offset, p->numel).WithContext("bf16 copy of " + p->name));
    bf16_made_in_[i] = in_step_ ? step_id_ : 0;
    ++bf16_weight_casts_;
  }
  return static_cast<const void*>(dst);
}

Result<Gpt::LayerBf16> Gpt::KeptLayer(const LayerW& w, const Acts& a, int i) {
  LayerBf16 k;
  const Acts::Layer& y = a.layers[static_cast<size_t>(i)];
  if (!keep_bf16_) return k;
  const int64_t C = spec_.hidden, HlD = Hl_ * (C / spec_.heads);
  k.C = C;
  k.HlD = HlD;
  k.Fl = Fl_;
  k.mine = LocalRow0();
  k.ln1 = &y.ln1_16;
  k.fc_in = spec_.block == config::BlockKind::kSequential ? &y.ln2_16 : &y.ln1_16;
  k.atty = &y.atty_16;
  k.fch_gelu = &y.fch_gelu_16;
  const ParamInfo* ps[4] = {w.qkvw, w.projw, w.fcw, w.mprojw};
  for (int j = 0; j < 4; ++j) {
    MS_ASSIGN_OR_RETURN(k.w[j], KeptWeight(ps[j]));
  }
  return k;
}

void Gpt::BeginStep() {
  // The parameters may have changed since the last step: every kept bf16 weight is stale, unless the optimizer
  // wrote them all with its update (Bf16WeightsWritten).
  if (!(plant_stale_bf16_ && step_id_ > 0)) ++step_id_;
  for (size_t i = 0; i < bf16_made_in_.size(); ++i) {
    if (bf16_written_ || bf16_written_one_[i]) bf16_made_in_[i] = step_id_;
  }
  std::fill(bf16_written_one_.begin(), bf16_written_one_.end(), 0);
  bf16_written_ = false;
  in_step_ = true;
  tp_drain_ = false;
}
void* Gpt::bf16_param_data() const {
  // Under either bf16 plant the optimizer writes no copies: the kept_bf16_stale plant keeps exercising the casts.
  if (!keep_bf16_ || plant_stale_bf16_ || plant_unwritten_bf16_) return nullptr;
  return Bf16At(bf16_params_, 0);
}
void Gpt::Bf16WeightsWritten() {
  bf16_written_ = keep_bf16_;
}
void Gpt::InvalidateBf16Weights() {
  bf16_written_ = false;
  std::fill(bf16_made_in_.begin(), bf16_made_in_.end(), 0);
  std::fill(bf16_written_one_.begin(), bf16_written_one_.end(), 0);
}
bool Gpt::Bf16OnlyInStep(int param) const {
  return keep_bf16_ && param >= 0 && param < static_cast<int>(bf16_only_.size()) &&
         bf16_only_[static_cast<size_t>(param)] != 0;
}
bool Gpt::Bf16CastInStep(int param) const {
  if (!keep_bf16_ || param < 0 || param >= static_cast<int>(params_.size())) return false;
  return spec_.tied_embeddings && params_[static_cast<size_t>(param)].name == "embed.wte";
}
void Gpt::Bf16WeightWritten(int param) {
  if (keep_bf16_ && param >= 0 && param < static_cast<int>(bf16_written_one_.size())) {
    bf16_written_one_[static_cast<size_t>(param)] = 1;
  }
}
Status Gpt::EndStep() {
  in_step_ = false;
  if (!tp_drain_) return Status::Ok();
  tp_drain_ = false;
  return comms_.tp->Drain().WithContext("the step's tensor-parallel collectives (waited for on the device)");
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
  const bool ln_fp32 = !RoundedLn(), gelu_fp32 = !RoundedGelu();  // else only their bf16 roundings are kept
  for (auto& y : a.layers) {
    if (ln_fp32) MS_RETURN_IF_ERROR(y.ln1.Allocate(be, R * C));
    MS_RETURN_IF_ERROR(y.ln1_mean.Allocate(be, R));
    MS_RETURN_IF_ERROR(y.ln1_rstd.Allocate(be, R));
    if (sp && ln_fp32) MS_RETURN_IF_ERROR(y.ln1_full.Allocate(be, N * C));  // SpGather16: ln1_16 gathered
    if (Bf16AttnIO(spec_.hidden / spec_.heads)) {  // written by the qkv GEMM in bf16, read by the attention
      MS_RETURN_IF_ERROR(AllocateBf16(y.qkv, be, N * 3 * HlD));
    } else {
      MS_RETURN_IF_ERROR(y.qkv.Allocate(be, N * 3 * HlD));
    }
    if (Atty32(spec_.hidden / spec_.heads)) MS_RETURN_IF_ERROR(y.atty.Allocate(be, N * HlD));
    MS_RETURN_IF_ERROR(y.lse.Allocate(be, B_ * Hl_ * spec_.seq_len));
    if (Bf16Fc()) {  // written by the fc GEMM in bf16, read by the bias + GeLU forward and backward
      MS_RETURN_IF_ERROR(AllocateBf16(y.fch, be, N * Fl_));
    } else {
      MS_RETURN_IF_ERROR(y.fch.Allocate(be, N * Fl_));
    }
    if (gelu_fp32) MS_RETURN_IF_ERROR(y.fch_gelu.Allocate(be, N * Fl_));
    if (keep_bf16_) {
      MS_RETURN_IF_ERROR(AllocateBf16(y.ln1_16, be, N * C));
      MS_RETURN_IF_ERROR(AllocateBf16(y.atty_16, be, N * HlD));
      MS_RETURN_IF_ERROR(AllocateBf16(y.fch_gelu_16, be, N * Fl_));
      if (seq) MS_RETURN_IF_ERROR(AllocateBf16(y.ln2_16, be, N * C));
    }
    if (seq) {
      MS_RETURN_IF_ERROR(y.mid.Allocate(be, R * C));
      if (ln_fp32) MS_RETURN_IF_ERROR(y.ln2.Allocate(be, R * C));
      MS_RETURN_IF_ERROR(y.ln2_mean.Allocate(be, R));
      MS_RETURN_IF_ERROR(y.ln2_rstd.Allocate(be, R));
      if (sp && ln_fp32) MS_RETURN_IF_ERROR(y.ln2_full.Allocate(be, N * C));
    }
  }
  if (ch.head) {
    if (ln_fp32) MS_RETURN_IF_ERROR(a.lnf.Allocate(be, R * C));
    MS_RETURN_IF_ERROR(a.lnf_mean.Allocate(be, R));
    MS_RETURN_IF_ERROR(a.lnf_rstd.Allocate(be, R));
    if (sp && ln_fp32) MS_RETURN_IF_ERROR(a.lnf_full.Allocate(be, N * C));
    if (Bf16Logits()) {
      MS_RETURN_IF_ERROR(AllocateBf16(a.logits_16, be, N * Vl_));
    } else {
      MS_RETURN_IF_ERROR(a.logits.Allocate(be, N * Vl_));
    }
    if (keep_bf16_) {
      MS_RETURN_IF_ERROR(AllocateBf16(a.lnf_16, be, N * C));
      if (!Bf16Logits()) MS_RETURN_IF_ERROR(AllocateBf16(a.dlogits_16, be, N * Vl_));
    }
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
  // The communicator works on its own stream (NCCL) or the host (Gloo): what the backend enqueued must be done
  // first. NCCL communicators wait for the backend's stream on the device: no host synchronization.
  if (comms_.tp && comms_.tp->orders_after_compute()) return Status::Ok();
  return be_->Synchronize().WithContext("waiting for the ops before a tensor-parallel collective");
}
Status Gpt::TpWait(comm::Work& work, std::string_view op, std::string_view what, int chunk, int chunks, double posted) {
  // In a step, on NCCL: the backend's stream waits for the collective, the host goes on (EndStep drains). A traced
  // run waits on the host, so that each collective's span ends when it completed.
  const bool on_device = in_step_ && !span_ && comms_.tp->waits_on_device();
  tp_drain_ = tp_drain_ || on_device;
  Status s = on_device ? work.WaitOnDevice() : work.Wait();
  if (span_ || !s.ok()) {
    const std::string name =
        chunks > 1 ? fmt::format("{} {} {}/{}", op, what, chunk + 1, chunks) : fmt::format("{} {}", op, what);
    if (span_) span_("tp " + name, "tp", posted, NowSeconds());
    if (!s.ok()) return s.WithContext("tensor-parallel " + name);
  }
  return s;
}
void Gpt::GemmSpan(std::string_view what, int chunk, int chunks, double start) {
  if (span_) {
    span_(chunks > 1 ? fmt::format("gemm {} {}/{}", what, chunk + 1, chunks) : fmt::format("gemm {}", what), "tp-gemm",
          start, NowSeconds());
  }
}
Status Gpt::TpAllReduce(float* x, int64_t n, comm::ReduceOp op, std::string_view what) {
  if (shard_.tp_size == 1) return Status::Ok();
  MS_RETURN_IF_ERROR(TpCollectiveReady());
  const double posted = NowSeconds();
  auto work = comms_.tp->AllReduce(x, n, op);
  return TpWait(*work, "all-reduce", what, 0, 1, posted);
}

namespace {
// First row of chunk j when `rows` rows are cut into `chunks` near-equal chunks (chunks <= rows).
int64_t ChunkBegin(int64_t rows, int chunks, int j) {
  return rows * j / chunks;
}
}  // namespace

namespace {
std::unique_ptr<comm::Work> AllGatherOf(comm::Communicator& c, const float* in, float* out, int64_t n) {
  return c.AllGather(in, out, n);
}
std::unique_ptr<comm::Work> AllGatherOf(comm::Communicator& c, const uint16_t* in, uint16_t* out, int64_t n) {
  return c.AllGather16(in, out, n);
}
}  // namespace

Status Gpt::TpGatherRowsThen(std::string_view what, const float* local, float* full, bool keep_full,
                             const ConsumeFn& consume, void* full16) {
  if (full16 && SpGather16()) {
    // In place: this rank's rows are already its slot of full16; the GEMMs read the rounding there (src null).
    uint16_t* const f16 = static_cast<uint16_t*>(full16);
    return TpGatherLoop<uint16_t>("all-gather (bf16)", what, f16 + shard_.tp_rank * rows_ * spec_.hidden, f16,
                                  reinterpret_cast<uint16_t*>(stage_.data()), /*copy=*/true, /*keep=*/shard_.tp_rank,
                                  /*pass_src=*/false, consume);
  }
  if (!(shard_.sequence_parallel && shard_.tp_size > 1)) {  // `local` already holds all N rows
    const double t0 = NowSeconds();
    MS_RETURN_IF_ERROR(consume(0, N_, local));
    GemmSpan(what, 0, 1, t0);
    return Status::Ok();
  }
  return TpGatherLoop<float>("all-gather", what, local, full, stage_.data(), keep_full, /*keep=*/-1,
                             /*pass_src=*/true, consume);
}

template <typename T>
Status Gpt::TpGatherLoop(std::string_view op, std::string_view what, const T* local, T* full, T* stage, bool copy,
                         int keep, bool pass_src, const ConsumeFn& consume) {
  const int tp = shard_.tp_size;
  const int64_t C = spec_.hidden, R = rows_;
  auto src_of = [&](const T* p) { return pass_src ? reinterpret_cast<const float*>(p) : nullptr; };
  const int k = sp_chunks_;
  if (k == 1) {
    MS_RETURN_IF_ERROR(TpCollectiveReady());
    const double posted = NowSeconds();
    auto work = AllGatherOf(*comms_.tp, local, full, R * C);
    MS_RETURN_IF_ERROR(TpWait(*work, op, what, 0, 1, posted));
    const double t0 = NowSeconds();
    MS_RETURN_IF_ERROR(consume(0, N_, src_of(full)));
    GemmSpan(what, 0, 1, t0);
    return Status::Ok();
  }
  // Chunk j = local rows [r0, r0 + rc) of every rank, gathered rank-major into stage j % 2 (bf16: the first half of
  // the fp32 staging buffer): rank r's block is rows r * R + r0 .. of the full tensor. The gather of chunk j + 1
  // runs while chunk j is consumed; stage (j + 1) % 2 was last read by chunk j - 1, finished by the backend sync
  // before the gather is posted.
  const int64_t S = stage_rows_ * C;
  std::unique_ptr<comm::Work> work;
  double posted = 0;
  auto post = [&](int j) -> Status {
    const int64_t r0 = ChunkBegin(R, k, j), rc = ChunkBegin(R, k, j + 1) - r0;
    MS_RETURN_IF_ERROR(TpCollectiveReady());
    posted = NowSeconds();
    work = AllGatherOf(*comms_.tp, local + r0 * C, stage + (j % 2) * S, rc * C);
    return Status::Ok();
  };
  MS_RETURN_IF_ERROR(post(0));
  for (int j = 0; j < k; ++j) {
    const int64_t r0 = ChunkBegin(R, k, j), rc = ChunkBegin(R, k, j + 1) - r0;
    const T* st = stage + (j % 2) * S;
    MS_RETURN_IF_ERROR(TpWait(*work, op, what, j, k, posted));
    if (j + 1 < k) MS_RETURN_IF_ERROR(post(j + 1));
    const double t0 = NowSeconds();
    for (int r = 0; r < tp; ++r) {
      const int64_t row0 = r * R + r0;
      const T* src = st + r * rc * C;
      if (copy) {  // each block to its rows of `full` (but rank `keep`'s, already there), consumed from there
        if (r != keep) MS_RETURN_IF_ERROR(be_->Copy(full + row0 * C, src, sizeof(T) * rc * C));
        src = full + row0 * C;
      }
      MS_RETURN_IF_ERROR(consume(row0, rc, src_of(src)));
    }
    GemmSpan(what, j, k, t0);
  }
  return Status::Ok();
}

Result<float*> Gpt::TpProduceRowsReduce(std::string_view what, const ProduceFn& produce, float* full, float* local,
                                        bool may_bf16) {
  MS_ASSIGN_OR_RETURN(TpSum sum, TpReduce(what, produce, nullptr, full, local, may_bf16));
  return sum.f32;
}

Result<Gpt::TpSum> Gpt::TpProduceRowsReduceTo(std::string_view what, const ProduceFn& produce,
                                              const ProduceFn16& produce16, float* full, float* local) {
  return TpReduce(what, produce, FusedTpSums16() ? &produce16 : nullptr, full, local, true);
}

Result<Gpt::TpSum> Gpt::TpReduce(std::string_view what, const ProduceFn& produce, const ProduceFn16* produce16,
                                 float* full, float* local, bool may_bf16) {
  const int tp = shard_.tp_size;
  const bool sp = shard_.sequence_parallel && tp > 1;
  const bool b16 = may_bf16 && tp > 1 && shard_.tp_reduce_bf16;
  // Partials written in bf16 by the producer, straight into the collective's buffer (FusedTpSums16).
  const bool p16 = b16 && produce16 != nullptr;
  const int64_t C = spec_.hidden, N = N_, R = rows_;
  const char* op = sp ? (b16 ? "reduce-scatter (bf16)" : "reduce-scatter") : (b16 ? "all-reduce (bf16)" : "all-reduce");
  const int k = tp == 1 ? 1 : sp ? sp_chunks_ : ar_chunks_;
  // bf16 sums (ShardSpec::tp_reduce_bf16): each chunk's fp32 partial rounded into red16_'s first area (its rows of
  // all N; SP: the chunk's stage, as `stage_`), summed over the communicator in bf16 (all-reduce: in place there;
  // SP: into the second area, this rank's R rows), and the sum widened into `full` / `local` after the wait.
  uint16_t* const in16 = b16 ? reinterpret_cast<uint16_t*>(red16_.data()) : nullptr;
  uint16_t* const out16 = b16 ? in16 + red16_rows_ * C : nullptr;
  // Posts the collective of rows [r0, r0 + rc) of each rank's slice (SP) or of all N rows, from `buf` (fp32; SP:
  // rank-major, the reduce-scatter's input layout) staged in `stage16` (bf16 only).
  // `posted`: when the collective itself was posted (its trace span's start).
  auto post = [&](float* buf, uint16_t* stage16, int64_t r0, int64_t rc,
                  double& posted) -> Result<std::unique_ptr<comm::Work>> {
    const int64_t n = (sp ? tp : 1) * rc * C;
    if (b16 && !p16) {
      MS_RETURN_IF_ERROR(be_->RoundBf16(stage16, buf, n).WithContext("rounding a tensor-parallel partial sum"));
    }
    MS_RETURN_IF_ERROR(TpCollectiveReady());
    posted = NowSeconds();
    if (!b16) {
      return sp ? comms_.tp->ReduceScatter(buf, local + r0 * C, rc * C)
                : comms_.tp->AllReduce(buf, rc * C, comm::ReduceOp::kSum);
    }
    return sp ? comms_.tp->ReduceScatter16(stage16, out16 + r0 * C, rc * C) : comms_.tp->AllReduce16(stage16, rc * C);
  };
  // After chunk [r0, r0 + rc)'s wait: the bf16 sum widened to where the fp32 one would be.
  auto widen = [&](int64_t r0, int64_t rc) -> Status {
    if (!b16 || p16) return Status::Ok();
    return sp ? be_->WidenBf16(local + r0 * C, out16 + r0 * C, rc * C)
              : be_->WidenBf16(full + r0 * C, in16 + r0 * C, rc * C);
  };
  // The sum: this rank's rows in bf16 (p16: SP's reduce-scatter output, else the all-reduce's, in place), or fp32.
  const TpSum sum = p16 ? TpSum{nullptr, sp ? out16 : in16} : TpSum{sp ? local : full, nullptr};
  if (k == 1) {
    const double t0 = NowSeconds();
    MS_RETURN_IF_ERROR(p16 ? (*produce16)(0, N, in16) : produce(0, N, full));
    GemmSpan(what, 0, 1, t0);
    if (tp == 1) return TpSum{full, nullptr};
    double posted = 0;
    MS_ASSIGN_OR_RETURN(auto work, post(full, in16, 0, sp ? R : N, posted));
    MS_RETURN_IF_ERROR(TpWait(*work, op, what, 0, 1, posted));
    MS_RETURN_IF_ERROR(widen(0, sp ? R : N));
    return sum;
  }
  // Chunk j = rows [r0, r0 + rc) of each rank's slice (SP: computed rank-major into stage j % 2, the
  // reduce-scatter's input layout; its output is local rows r0..) or of all N rows (all-reduce in
  // place in `full`). The collective of chunk j - 1 runs while chunk j computes; the reduce-scatter
  // that last read stage j % 2 (chunk j - 2) was waited for in the previous iteration.
  const int64_t rows = sp ? R : N;
  std::unique_ptr<comm::Work> prev;
  double prev_posted = 0;
  int64_t prev_r0 = 0, prev_rc = 0;
  for (int j = 0; j < k; ++j) {
    const int64_t r0 = ChunkBegin(rows, k, j), rc = ChunkBegin(rows, k, j + 1) - r0;
    const double t0 = NowSeconds();
    float* buf = sp ? stage_.data() + (j % 2) * stage_rows_ * C : full + r0 * C;
    uint16_t* stage16 = b16 ? (sp ? in16 + (j % 2) * stage_rows_ * C : in16 + r0 * C) : nullptr;
    if (p16) {  // rank-major under SP, as the fp32 stage
      for (int r = 0; r < (sp ? tp : 1); ++r) {
        MS_RETURN_IF_ERROR((*produce16)((sp ? r * R : 0) + r0, rc, stage16 + r * rc * C));
      }
    } else if (sp) {
      for (int r = 0; r < tp; ++r) MS_RETURN_IF_ERROR(produce(r * R + r0, rc, buf + r * rc * C));
    } else {
      MS_RETURN_IF_ERROR(produce(r0, rc, buf));
    }
    GemmSpan(what, j, k, t0);
    double posted = 0;
    MS_ASSIGN_OR_RETURN(auto work, post(buf, stage16, r0, rc, posted));
    if (prev) {
      MS_RETURN_IF_ERROR(TpWait(*prev, op, what, j - 1, k, prev_posted));
      MS_RETURN_IF_ERROR(widen(prev_r0, prev_rc));
    }
    prev = std::move(work);
    prev_posted = posted;
    prev_r0 = r0;
    prev_rc = rc;
  }
  MS_RETURN_IF_ERROR(TpWait(*prev, op, what, k - 1, k, prev_posted));
  MS_RETURN_IF_ERROR(widen(prev_r0, prev_rc));
  return sum;
}

Status Gpt::ResidualAdd(float* out, const float* x, const float* part, const float* bias, const float* bias2, int64_t R,
                        int64_t C) {
  if (shard_.fused_kernels) return be_->ResidualAdd(out, x, part, bias, bias2, R, C);
  // Ablation (runtime.fused_kernels: false): the residual add and each bias as passes of their own.
  MS_RETURN_IF_ERROR(be_->Add(out, x, part, R * C));
  MS_RETURN_IF_ERROR(be_->AddRowBias(out, bias, R, C));
  return bias2 ? be_->AddRowBias(out, bias2, R, C) : Status::Ok();
}

Status Gpt::ResidualLayerNorm(float* res, const float* x, const float* part, const float* bias, const float* bias2,
                              float* out, float* mean, float* rstd, const float* w, const float* b, void* out16) {
  const int64_t R = rows_, C = spec_.hidden;
  if (shard_.fused_kernels) {
    return be_->ResidualLayerNormForward(res, x, part, bias, bias2, out, mean, rstd, w, b, R, C, spec_.norm_eps, out16);
  }
  MS_RETURN_IF_ERROR(ResidualAdd(res, x, part, bias, bias2, R, C));  // the ablation's passes
  return be_->LayerNormForward(out, mean, rstd, res, w, b, R, C, spec_.norm_eps, out16);
}

Result<float> Gpt::ForwardChunk(int chunk, int slot, const int32_t* inputs, const int32_t* targets, const float* x_in,
                                const std::function<Status(int)>& before_layer) {
  if (chunk < 0 || chunk >= num_chunks()) return InvalidArgument("chunk {} of {}", chunk, num_chunks());
  MS_ASSIGN_OR_RETURN(Acts * acts, SlotActs(chunk, slot));
  MS_RETURN_IF_ERROR(ForwardInputs(chunk, *acts, inputs, targets, x_in));
  if (GraphsApply(chunk)) {
    MS_RETURN_IF_ERROR(ForwardGraphed(chunk, slot, *acts, x_in, before_layer));
  } else {
    MS_RETURN_IF_ERROR(ForwardCompute(chunk, *acts, x_in, before_layer));
  }
  if (!chunks_[chunk].head) return 0.0f;
  return HeadLoss(*acts);
}

// The host's part of a forward: the token ids checked and uploaded (as local vocabulary ids under tp), the targets
// checked, kept and uploaded.
Status Gpt::ForwardInputs(int chunk, Acts& a, const int32_t* inputs, const int32_t* targets, const float* x_in) {
  const Chunk& ch = chunks_[chunk];
  const int64_t V = spec_.vocab, N = N_;
  if (ch.embedding) {
    if (!inputs) return InvalidArgument("the embedding chunk needs input tokens");
    const int64_t vstart = shard_.tp_rank * Vl_;
    for (int64_t i = 0; i < N; ++i) {
      if (inputs[i] < 0 || inputs[i] >= V) {
        return InvalidArgument("token id {} at position {} is outside the vocabulary [0, {})", inputs[i], i, V);
      }
      const int64_t local = inputs[i] - vstart;
      a.inputs_host[i] = (local >= 0 && local < Vl_) ? static_cast<int32_t>(local) : -1;
    }
    MS_RETURN_IF_ERROR(be_->CopyFromHost(a.inputs.data(), a.inputs_host.data(), sizeof(int32_t) * N));
  } else if (!x_in) {
    return InvalidArgument("chunk {} needs the previous stage's activations", ch.global);
  }
  if (ch.head) {
    if (!targets) return InvalidArgument("the head chunk needs targets");
    for (int64_t i = 0; i < N; ++i) {
      if (targets[i] >= V) return InvalidArgument("target id {} at position {} is >= vocab {}", targets[i], i, V);
    }
    std::memcpy(a.targets_host.data(), targets, sizeof(int32_t) * N);
    MS_RETURN_IF_ERROR(be_->CopyFromHost(a.targets.data(), targets, sizeof(int32_t) * N));
  }
  return Status::Ok();
}

// The device's part of a forward (ForwardInputs has run): only backend ops and, under tp, the collectives. The head
// chunk leaves its per-token losses in a.losses (HeadLoss takes them).
Status Gpt::ForwardCompute(int chunk, Acts& a, const float* x_in, const std::function<Status(int)>& before_layer) {
  auto before = [&](int layer) { return before_layer ? before_layer(layer) : Status::Ok(); };
  const Chunk& ch = chunks_[chunk];
  const int64_t B = B_, T = spec_.seq_len, C = spec_.hidden, N = N_, R = rows_;
  const int64_t D = C / spec_.heads, HlD = Hl_ * D, Fl = Fl_;
  const bool seq = spec_.block == config::BlockKind::kSequential;
  const bool tp = shard_.tp_size > 1, sp = shard_.sequence_parallel && tp;
  float* s = scratch_.data();
  float* partR = s + R * C;
  float* part = s + 3 * R * C;
  float* e_full = part + 3 * N * C;
  auto P = [&](const ParamInfo* p) { return param_data() + p->offset; };

  if (ch.embedding) {
    MS_RETURN_IF_ERROR(before(-1));
    float* x0 = a.res.data();
    if (!tp) {
      MS_RETURN_IF_ERROR(be_->EmbeddingForward(x0, a.inputs.data(), P(FindParam("embed.wte")), N, C));
    } else {
      const float* wte = P(FindParam("embed.wte"));
      const int32_t* ids = a.inputs.data();
      auto lookup = [&](int64_t row0, int64_t rows, float* dst) {  // other ranks' vocab rows: 0
        return be_->EmbeddingForward(dst, ids + row0, wte, rows, C);
      };
      MS_ASSIGN_OR_RETURN(float* e, TpProduceRowsReduce("embed", lookup, e_full, x0, /*may_bf16=*/false));
      if (!sp) MS_RETURN_IF_ERROR(be_->Copy(x0, e, sizeof(float) * N * C));
    }
    const float* wpe = P(FindParam("embed.wpe"));
    const int64_t row0 = sp ? shard_.tp_rank * R : 0;
    MS_RETURN_IF_ERROR(be_->AddPositions(x0, wpe, R, C, T, row0));
  } else if (x_in) {  // (none: a graph's pass, whose caller copied it there first)
    MS_RETURN_IF_ERROR(be_->Copy(a.res.data(), x_in, sizeof(float) * R * C));
  }

  // Column-parallel GEMMs consume the gathered LayerNorm output (kept in ln*_full for backward), row-parallel
  // ones produce partial sums reduced across tp into partR (SP) or part (all-reduce): chunked and pipelined
  // with the collectives, see TpGatherRowsThen / TpProduceRowsReduce.
  // With the fused kernels a layer's last residual add also runs the next layer's first LayerNorm (one kernel:
  // ResidualLayerNorm), after that layer's before_layer hook; `ln1_done` then tells the next layer.
  bool ln1_done = false;
  for (int i = 0; i < ch.num_layers; ++i) {
    if (!ln1_done) MS_RETURN_IF_ERROR(before(ch.first_layer + i));
    const LayerW w = Layer(ch.first_layer + i);
    auto& y = a.layers[i];
    const float* x = a.res.data() + i * R * C;
    float* out = a.res.data() + (i + 1) * R * C;
    MS_ASSIGN_OR_RETURN(const LayerBf16 k16, KeptLayer(w, a, i));
    // Each GEMM input is rounded to bf16 once and read again by the backward's weight-gradient GEMM: by its
    // producer where that writes all the GEMM's rows (the LayerNorms without sequence parallelism, whose GEMMs
    // read gathered rows; the fused bias + GeLU; the attention), else by the forward GEMM (the parallel block's fc
    // then reads qkv's rounding of the same LayerNorm rows).
    const bool ln_rounds = RoundedLn(), gelu_rounds = RoundedGelu();  // fp32 outputs then null (not written)
    // Where the attention adds the qkv bias as it loads q, k, v (the tensor-core kernels; a fused epilogue, so not
    // in the unfused ablation), qkv holds the GEMM's output alone: no bias pass over it — unless the qkv GEMM adds
    // it in its epilogue as it writes qkv in bf16 (QkvBiasInGemm), which saves the attention kernels the adds.
    const float* const attn_bias = QkvBiasInAttention(D) && !QkvBiasInGemm(D) ? P(w.qkvb) : nullptr;
    const bool attn16 = Bf16AttnIO(D);  // the GEMM writes qkv in bf16, the attention reads it
    auto qkv_rows = [&](int64_t row0, int64_t rows, const float* src) {
      ops::Bf16Copies kc = k16.Qkv(row0, ln_rounds);
      if (attn16) kc.out16 = Bf16At(y.qkv, row0 * 3 * HlD);
      return be_->MatmulForward(attn16 ? nullptr : y.qkv.data() + row0 * 3 * HlD, src, P(w.qkvw),
                                attn_bias ? nullptr : P(w.qkvb), rows, C, 3 * HlD, kc);
    };
    auto attention = [&]() {
      if (attn16) {
        return be_->AttentionForward16(y.atty.data(), y.lse.data(), Bf16At(y.qkv, 0), attn_bias, B, T, Hl_, D,
                                       spec_.window, k16.AttyOut());
      }
      return be_->AttentionForward(y.atty.data(), y.lse.data(), y.qkv.data(), attn_bias, B, T, Hl_, D, spec_.window,
                                   k16.AttyOut());
    };
    auto fc_rows = [&](int64_t row0, int64_t rows, const float* src) -> Status {
      // fch holds the GEMM output without its bias: the bias is fused into the GeLU (and its gradient into the
      // GeLU backward). With Bf16Fc the GEMM writes it rounded to bf16 (and there is no fp32 fch).
      if (Bf16Fc()) {
        ops::Bf16Copies kc = k16.Fc(row0, !seq || ln_rounds);
        kc.out16 = Bf16At(y.fch, row0 * Fl);
        if (GeluInGemm()) {  // the bias and GeLU in the GEMM's epilogue: fch holds the GeLU input with the bias
          kc.gelu16 = k16.GeluOut(row0);
          return be_->MatmulForward(nullptr, src, P(w.fcw), P(w.fcb), rows, C, Fl, kc);
        }
        MS_RETURN_IF_ERROR(be_->MatmulForward(nullptr, src, P(w.fcw), nullptr, rows, C, Fl, kc));
        return be_->BiasGeluForward16(Off(y.fch_gelu.data(), row0 * Fl), kc.out16, P(w.fcb), rows, Fl,
                                      gelu_rounds ? k16.GeluOut(row0) : nullptr);
      }
      MS_RETURN_IF_ERROR(be_->MatmulForward(y.fch.data() + row0 * Fl, src, P(w.fcw), nullptr, rows, C, Fl,
                                            k16.Fc(row0, !seq || ln_rounds)));
      if (!shard_.fused_kernels) {  // ablation: the bias, then the GeLU, each a pass over memory (fch keeps the bias)
        MS_RETURN_IF_ERROR(be_->AddRowBias(y.fch.data() + row0 * Fl, P(w.fcb), rows, Fl));
        return be_->GeluForward(y.fch_gelu.data() + row0 * Fl, y.fch.data() + row0 * Fl, rows * Fl);
      }
      return be_->BiasGeluForward(Off(y.fch_gelu.data(), row0 * Fl), y.fch.data() + row0 * Fl, P(w.fcb), rows, Fl,
                                  gelu_rounds ? k16.GeluOut(row0) : nullptr);
    };
    // The branches' output projections; dst16 (those rows), unless null, in place of dst: the output in bf16
    // (Bf16BranchOut).
    auto proj_rows = [&](int64_t row0, int64_t rows, float* dst, uint16_t* dst16 = nullptr) {  // input: attention's
      ops::Bf16Copies kc = k16.Proj(row0, true);
      kc.out16 = dst16;
      return be_->MatmulForward(dst16 ? nullptr : dst, Off(y.atty.data(), row0 * HlD), P(w.projw), nullptr, rows, HlD,
                                C, kc);
    };
    auto mproj_rows = [&](int64_t row0, int64_t rows, float* dst, bool accumulate, uint16_t* dst16 = nullptr) {
      ops::Bf16Copies kc = k16.Mproj(row0, gelu_rounds);
      kc.out_accumulate = accumulate;
      kc.out16 = dst16;
      return be_->MatmulForward(dst16 ? nullptr : dst, Off(y.fch_gelu.data(), row0 * Fl), P(w.mprojw), nullptr, rows,
                                Fl, C, kc);
    };
    if (!ln1_done) {
      MS_RETURN_IF_ERROR(be_->LayerNormForward(y.ln1.data(), y.ln1_mean.data(), y.ln1_rstd.data(), x, P(w.ln1w),
                                               P(w.ln1b), R, C, spec_.norm_eps, ln_rounds ? k16.Ln1Out() : nullptr));
    }
    // The layer's output out = base + part + biases; with the fused kernels and another layer of this chunk next,
    // fused with that layer's first LayerNorm.
    // part_out16, unless null, in place of part_out: the branch output in bf16 (Bf16BranchOut; fused kernels).
    auto finish = [&](const float* base, const float* part_out, const float* b1, const float* b2,
                      const void* part_out16 = nullptr) -> Status {
      ln1_done = shard_.fused_kernels && i + 1 < ch.num_layers;
      if (!ln1_done) {
        return part_out16 ? be_->ResidualAdd16(out, base, part_out16, b1, b2, R, C)
                          : ResidualAdd(out, base, part_out, b1, b2, R, C);
      }
      MS_RETURN_IF_ERROR(before(ch.first_layer + i + 1));  // its parameters (ZeRO: waits for their all-gather)
      const LayerW wn = Layer(ch.first_layer + i + 1);
      auto& yn = a.layers[static_cast<size_t>(i + 1)];
      MS_ASSIGN_OR_RETURN(const LayerBf16 kn, KeptLayer(wn, a, i + 1));
      if (part_out16) {
        return be_->ResidualLayerNormForward16(out, base, part_out16, b1, b2, yn.ln1.data(), yn.ln1_mean.data(),
                                               yn.ln1_rstd.data(), P(wn.ln1w), P(wn.ln1b), R, C, spec_.norm_eps,
                                               ln_rounds ? kn.Ln1Out() : nullptr);
      }
      return ResidualLayerNorm(out, base, part_out, b1, b2, yn.ln1.data(), yn.ln1_mean.data(), yn.ln1_rstd.data(),
                               P(wn.ln1w), P(wn.ln1b), ln_rounds ? kn.Ln1Out() : nullptr);
    };
    if (seq) {
      MS_RETURN_IF_ERROR(
          TpGatherRowsThen("ln1>qkv", y.ln1.data(), y.ln1_full.data(), true, qkv_rows, Gathered16(y.ln1_16)));
      MS_RETURN_IF_ERROR(attention());
      // Bf16BranchOut: each projection writes its output in bf16 alone (part16, in part's scratch), which the
      // residual add reads.
      uint16_t* const part16 = Bf16BranchOut() ? reinterpret_cast<uint16_t*>(part) : nullptr;
      if (part16) {
        const double t0 = NowSeconds();
        MS_RETURN_IF_ERROR(proj_rows(0, N, nullptr, part16));
        GemmSpan("attn.proj", 0, 1, t0);
        MS_RETURN_IF_ERROR(be_->ResidualLayerNormForward16(y.mid.data(), x, part16, P(w.projb), nullptr, y.ln2.data(),
                                                           y.ln2_mean.data(), y.ln2_rstd.data(), P(w.ln2w), P(w.ln2b),
                                                           R, C, spec_.norm_eps, ln_rounds ? k16.FcInOut() : nullptr));
      } else {
        // FusedTpSums16: the partials written in bf16, the residual add reading the bf16 sum.
        auto proj16 = [&](int64_t row0, int64_t rows, uint16_t* dst16) {
          return proj_rows(row0, rows, nullptr, dst16);
        };
        MS_ASSIGN_OR_RETURN(const TpSum attn_out, TpProduceRowsReduceTo("attn.proj", proj_rows, proj16, part, partR));
        if (attn_out.b16) {
          MS_RETURN_IF_ERROR(be_->ResidualLayerNormForward16(
              y.mid.data(), x, attn_out.b16, P(w.projb), nullptr, y.ln2.data(), y.ln2_mean.data(), y.ln2_rstd.data(),
              P(w.ln2w), P(w.ln2b), R, C, spec_.norm_eps, ln_rounds ? k16.FcInOut() : nullptr));
        } else {
          MS_RETURN_IF_ERROR(ResidualLayerNorm(y.mid.data(), x, attn_out.f32, P(w.projb), nullptr, y.ln2.data(),
                                               y.ln2_mean.data(), y.ln2_rstd.data(), P(w.ln2w), P(w.ln2b),
                                               ln_rounds ? k16.FcInOut() : nullptr));
        }
      }
      MS_RETURN_IF_ERROR(
          TpGatherRowsThen("ln2>fc", y.ln2.data(), y.ln2_full.data(), true, fc_rows, Gathered16(y.ln2_16)));
      if (part16) {
        const double t0 = NowSeconds();
        MS_RETURN_IF_ERROR(mproj_rows(0, N, nullptr, false, part16));
        GemmSpan("mlp.proj", 0, 1, t0);
        MS_RETURN_IF_ERROR(finish(y.mid.data(), nullptr, P(w.mprojb), nullptr, part16));
      } else {
        auto mproj_only = [&](int64_t row0, int64_t rows, float* dst) { return mproj_rows(row0, rows, dst, false); };
        auto mproj16 = [&](int64_t row0, int64_t rows, uint16_t* dst16) {
          return mproj_rows(row0, rows, nullptr, false, dst16);
        };
        MS_ASSIGN_OR_RETURN(const TpSum mlp_out, TpProduceRowsReduceTo("mlp.proj", mproj_only, mproj16, part, partR));
        MS_RETURN_IF_ERROR(finish(y.mid.data(), mlp_out.f32, P(w.mprojb), nullptr, mlp_out.b16));
      }
    } else {
      // One gather feeds both branches' GEMMs.
      auto qkv_fc_rows = [&](int64_t row0, int64_t rows, const float* src) -> Status {
        MS_RETURN_IF_ERROR(qkv_rows(row0, rows, src));
        return fc_rows(row0, rows, src);
      };
      MS_RETURN_IF_ERROR(
          TpGatherRowsThen("ln1>qkv+fc", y.ln1.data(), y.ln1_full.data(), true, qkv_fc_rows, Gathered16(y.ln1_16)));
      MS_RETURN_IF_ERROR(attention());
      // Attention + MLP partial sums: ONE reduction; the MLP's GEMM adds its product to the attention's.
      auto both_rows = [&](int64_t row0, int64_t rows, float* dst) -> Status {
        MS_RETURN_IF_ERROR(proj_rows(row0, rows, dst));
        return mproj_rows(row0, rows, dst, true);
      };
      MS_ASSIGN_OR_RETURN(float* both, TpProduceRowsReduce("attn.proj+mlp.proj", both_rows, part, partR));
      MS_RETURN_IF_ERROR(finish(x, both, P(w.projb), P(w.mprojb)));
    }
  }
  a.forward_done = true;
  if (!ch.head) return Status::Ok();
  MS_RETURN_IF_ERROR(before(spec_.layers));
  return HeadForward(a, a.res.data() + ch.num_layers * R * C);
}

Status Gpt::HeadForward(Acts& a, const float* x) {
  const int64_t C = spec_.hidden, N = N_, R = rows_, Vl = Vl_;
  const bool tp = shard_.tp_size > 1;
  auto P = [&](const char* name) { return param_data() + FindParam(name)->offset; };
  // The classifier's input rounded to bf16 by the LayerNorm (all rows, without sequence parallelism) or by the
  // GEMM, kept for the backward.
  const bool ln_rounds = RoundedLn();  // then lnf is not allocated: only its rounding is written
  MS_RETURN_IF_ERROR(be_->LayerNormForward(a.lnf.data(), a.lnf_mean.data(), a.lnf_rstd.data(), x,
                                           P("final_norm.weight"), P("final_norm.bias"), R, C, spec_.norm_eps,
                                           ln_rounds ? Bf16At(a.lnf_16, LocalRow0() * C) : nullptr));
  const float* head = P(spec_.tied_embeddings ? "embed.wte" : "lm_head.weight");
  const float* mask = masked_logits_ ? logit_mask_.data() : nullptr;  // the vocabulary padding, as a bias
  MS_ASSIGN_OR_RETURN(const void* head16,
                      KeptWeight(FindParam(spec_.tied_embeddings ? "embed.wte" : "lm_head.weight")));
  auto logit_rows = [&](int64_t row0, int64_t rows, const float* src) {
    ops::Bf16Copies kc{head16, keep_bf16_ ? Bf16At(a.lnf_16, row0 * C) : nullptr, ln_rounds};
    if (Bf16Logits()) {  // the logits in bf16 only; the padding is kept out of the softmax by the cross-entropy
      kc.out16 = Bf16At(a.logits_16, row0 * Vl);
      return be_->MatmulForward(nullptr, src, head, nullptr, rows, C, Vl, kc);
    }
    return be_->MatmulForward(a.logits.data() + row0 * Vl, src, head, mask, rows, C, Vl, kc);
  };
  MS_RETURN_IF_ERROR(
      TpGatherRowsThen("lnf>head", a.lnf.data(), a.lnf_full.data(), true, logit_rows, Gathered16(a.lnf_16)));
  a.dlogits_ready = false;
  const int64_t Vv = std::min<int64_t>(Vl, spec_.vocab);        // at tp 1: the columns that are not padding
  if (Bf16Logits() && deferred_cap_ > 0 && fused_dloss_ > 0) {  // as below, the gradient written over the logits
    MS_ASSIGN_OR_RETURN(const float* dl, LossWeights(fused_dloss_));
    MS_RETURN_IF_ERROR(be_->CrossEntropyFused16(a.losses.data(), a.ce_lse.data(), Bf16At(a.logits_16, 0),
                                                a.targets.data(), dl, N, Vl, Vv));
    a.dlogits_ready = true;
    a.dlogits_weight = fused_dloss_;
  } else if (Bf16Logits()) {
    MS_RETURN_IF_ERROR(be_->CrossEntropyForward16(a.losses.data(), a.ce_lse.data(), Bf16At(a.logits_16, 0),
                                                  a.targets.data(), N, Vl, Vv));
  } else if (!tp && deferred_cap_ > 0 && fused_dloss_ > 0) {
    // Training with the backward's loss weight known: the fused classifier loss writes dlogits over the logits
    // in the same pass over each row (with kept bf16 operands only their rounding, which is all the classifier's
    // backward GEMMs read); HeadBackward starts from them.
    MS_ASSIGN_OR_RETURN(const float* dl, LossWeights(fused_dloss_));
    MS_RETURN_IF_ERROR(be_->CrossEntropyFused(a.losses.data(), a.ce_lse.data(), a.logits.data(), a.targets.data(), dl,
                                              N, Vl, keep_bf16_ ? Bf16At(a.dlogits_16, 0) : nullptr, !keep_bf16_));
    a.dlogits_ready = true;
    a.dlogits_weight = fused_dloss_;
  } else if (!tp) {
    MS_RETURN_IF_ERROR(
        be_->CrossEntropyForward(a.losses.data(), a.ce_lse.data(), a.logits.data(), a.targets.data(), N, Vl));
  } else {
    // Vocab-parallel cross-entropy, one pass over the local logits: each rank's row max, sum of exponentials
    // (on its own max) and target logit; the maxima reduced (max) into a copy, the sums rebased on them, the
    // sums and target logits reduced (sum) together.
    float* stats = scratch_.data() + scratch_.size() - 4 * N;  // global max | local max | sumexp | target logit
    float *mx = stats, *mx_local = stats + N, *se = stats + 2 * N, *tl = stats + 3 * N;
    const int64_t vstart = shard_.tp_rank * Vl;
    MS_RETURN_IF_ERROR(be_->VocabParallelRowStats(mx_local, se, tl, a.logits.data(), a.targets.data(), vstart, N, Vl));
    MS_RETURN_IF_ERROR(be_->Copy(mx, mx_local, sizeof(float) * N));
    MS_RETURN_IF_ERROR(TpAllReduce(mx, N, comm::ReduceOp::kMax, "loss max"));
    MS_RETURN_IF_ERROR(be_->VocabParallelRebase(se, mx_local, mx, N));
    MS_RETURN_IF_ERROR(TpAllReduce(se, 2 * N, comm::ReduceOp::kSum, "loss sumexp+target"));  // both together
    MS_RETURN_IF_ERROR(be_->VocabParallelFinish(a.losses.data(), a.ce_lse.data(), mx, se, tl, a.targets.data(), N));
  }
  return Status::Ok();
}

// The head forward's per-token losses (a.losses): held on the device between BeginDeferredLosses and
// TakeDeferredLosses (0 returned), else read back and averaged over the counted targets.
Result<float> Gpt::HeadLoss(Acts& a) {
  const int64_t N = N_;
  if (deferred_cap_ > 0) {
    if (deferred_n_ >= deferred_cap_) {
      return Status(Code::kInternal, fmt::format("head forward {} of a step begun for {} deferred micro-batch losses",
                                                 deferred_n_ + 1, deferred_cap_));
    }
    MS_RETURN_IF_ERROR(be_->Copy(deferred_losses_.data() + deferred_n_ * N, a.losses.data(), sizeof(float) * N));
    deferred_targets_.insert(deferred_targets_.end(), a.targets_host.begin(), a.targets_host.end());
    ++deferred_n_;
    return 0.0f;
  }
  std::vector<float> losses(N);
  MS_RETURN_IF_ERROR(be_->CopyToHost(losses.data(), a.losses.data(), sizeof(float) * N));
  return MeanLoss(losses.data(), a.targets_host.data(), N);
}

Result<const float*> Gpt::LossWeights(float dloss) {
  // The per-token weight is the same every micro-batch of a step (and usually every step): upload it only when it
  // changes, not every micro-batch.
  if (!dloss_valid_ || std::memcmp(&dloss_value_, &dloss, sizeof dloss) != 0) {
    if (dloss_.size() < N_) MS_RETURN_IF_ERROR(dloss_.Allocate(be_, N_).WithContext("loss weight buffer"));
    const std::vector<float> dl_host(static_cast<size_t>(N_), dloss);
    MS_RETURN_IF_ERROR(be_->CopyFromHost(dloss_.data(), dl_host.data(), sizeof(float) * N_));
    dloss_value_ = dloss;
    dloss_valid_ = true;
  }
  return static_cast<const float*>(dloss_.data());
}

Status Gpt::BeginDeferredLosses(int micro_batches, float dloss) {
  if (micro_batches <= 0) return Status(Code::kInvalidArgument, "BeginDeferredLosses: micro_batches must be positive");
  fused_dloss_ = dloss;
  if (deferred_losses_.size() < micro_batches * N_) {
    MS_RETURN_IF_ERROR(deferred_losses_.Allocate(be_, micro_batches * N_).WithContext("deferred loss buffer"));
  }
  deferred_cap_ = micro_batches;
  deferred_n_ = 0;
  deferred_targets_.clear();
  return Status::Ok();
}

Result<std::vector<float>> Gpt::TakeDeferredLosses() {
  if (deferred_cap_ == 0) return Status(Code::kInternal, "TakeDeferredLosses without BeginDeferredLosses");
  const int64_t N = N_;
  std::vector<float> losses(static_cast<size_t>(deferred_n_ * N));
  deferred_cap_ = 0;
  if (deferred_n_ > 0) {
    MS_RETURN_IF_ERROR(be_->CopyToHost(losses.data(), deferred_losses_.data(), sizeof(float) * losses.size()));
  }
  std::vector<float> means(static_cast<size_t>(deferred_n_));
  for (int k = 0; k < deferred_n_; ++k) {
    means[static_cast<size_t>(k)] = MeanLoss(losses.data() + k * N, deferred_targets_.data() + k * N, N);
  }
  return means;
}

Status Gpt::HeadBackward(Acts& a, float dloss, float* dres, float* dsum, float* dsum2) {
  const int64_t C = spec_.hidden, N = N_, R = rows_, Vl = Vl_;
  const bool tp = shard_.tp_size > 1, sp = shard_.sequence_parallel && tp;
  auto P = [&](const char* name) { return param_data() + FindParam(name)->offset; };
  auto G = [&](const char* name) { return grad(static_cast<size_t>(FindParam(name) - params_.data())); };
  float* s = scratch_.data();
  float* dln = s + 2 * R * C;
  float* dln_full = s + 3 * R * C + 2 * N * C;
  // dlogits are written over the logits (the logits are not needed again): no second [N, Vl] buffer. With kept
  // bf16 operands only their rounding (dlogits_16) is written: the GEMMs below read nothing else.
  float* dlogits = keep_bf16_ || Bf16Logits() ? nullptr : a.logits.data();
  // Bf16Logits: the gradient's rounding is written over the bf16 logits (by the fused loss or here).
  void* const dlogits16 = Bf16Logits() ? Bf16At(a.logits_16, 0) : keep_bf16_ ? Bf16At(a.dlogits_16, 0) : nullptr;
  if (a.dlogits_ready) {  // the fused classifier loss of the forward already wrote them
    if (std::memcmp(&a.dlogits_weight, &dloss, sizeof dloss) != 0) {
      return Status(Code::kInternal, fmt::format("head backward with loss weight {} after a fused forward for {}",
                                                 dloss, a.dlogits_weight));
    }
  } else if (Bf16Logits()) {
    MS_ASSIGN_OR_RETURN(const float* dl, LossWeights(dloss));
    MS_RETURN_IF_ERROR(be_->CrossEntropyBackward16(dlogits16, dlogits16, a.ce_lse.data(), a.targets.data(), dl, N, Vl,
                                                   std::min<int64_t>(Vl, spec_.vocab)));
  } else if (!tp) {
    MS_ASSIGN_OR_RETURN(const float* dl, LossWeights(dloss));
    MS_RETURN_IF_ERROR(be_->CrossEntropyBackward(dlogits, a.logits.data(), a.ce_lse.data(), a.targets.data(), dl, N, Vl,
                                                 keep_bf16_ ? Bf16At(a.dlogits_16, 0) : nullptr));
  } else {
    MS_RETURN_IF_ERROR(be_->VocabParallelBackward(dlogits, a.logits.data(), a.ce_lse.data(), a.targets.data(), dloss,
                                                  shard_.tp_rank * Vl, N, Vl,
                                                  keep_bf16_ ? Bf16At(a.dlogits_16, 0) : nullptr));
  }
  a.dlogits_ready = false;
  const char* head = spec_.tied_embeddings ? "embed.wte" : "lm_head.weight";
  const float* lnfin = sp ? a.lnf_full.data() : a.lnf.data();
  MS_ASSIGN_OR_RETURN(const void* head16, KeptWeight(FindParam(head)));
  // With kept bf16 operands every cross-entropy path above also wrote the rounding of dlogits.
  // dst16 (those rows), unless null, in place of dst: the input gradient written in bf16 (Bf16LnGrad).
  auto dlnf_rows = [&](int64_t row0, int64_t rows, float* dst, uint16_t* dst16 = nullptr) {
    return be_->MatmulBackward(dst16 ? nullptr : dst, G(head), nullptr, Off(dlogits, row0 * Vl), Off(lnfin, row0 * C),
                               P(head), rows, C, Vl,
                               {.w = head16,
                                .inp = keep_bf16_ ? Bf16At(a.lnf_16, row0 * C) : nullptr,
                                .inp_ready = true,
                                .dout = dlogits16 ? static_cast<uint16_t*>(dlogits16) + row0 * Vl : nullptr,
                                .dinp_overwrite = true,
                                .dinp16 = dst16});
  };
  const Chunk& ch = chunks_[static_cast<size_t>(num_chunks() - 1)];
  const float* x = a.res.data() + ch.num_layers * R * C;
  if (Bf16LnGrad()) {  // the classifier's GEMM writes the final LayerNorm's input gradient in bf16 alone
    uint16_t* const dlnf16 = reinterpret_cast<uint16_t*>(dln);
    const double t0 = NowSeconds();
    MS_RETURN_IF_ERROR(dlnf_rows(0, N, nullptr, dlnf16));
    GemmSpan("head>dlnf", 0, 1, t0);
    MS_RETURN_IF_ERROR(be_->Zero(dres, sizeof(float) * (R * C)));
    return be_->LayerNormBackward16(dres, G("final_norm.weight"), G("final_norm.bias"), dlnf16, x,
                                    P("final_norm.weight"), a.lnf_mean.data(), a.lnf_rstd.data(), R, C, Dres16Mine(),
                                    dsum, dsum2);
  }
  // FusedTpSums16: the classifier's partial input gradients written in bf16, the LayerNorm backward reading the sum.
  auto dlnf16_rows = [&](int64_t row0, int64_t rows, uint16_t* dst16) { return dlnf_rows(row0, rows, nullptr, dst16); };
  MS_ASSIGN_OR_RETURN(const TpSum dlnf,
                      TpProduceRowsReduceTo("head>dlnf", dlnf_rows, dlnf16_rows, tp ? dln_full : dln, dln));
  MS_RETURN_IF_ERROR(be_->Zero(dres, sizeof(float) * (R * C)));
  if (dlnf.b16) {
    return be_->LayerNormBackward16(dres, G("final_norm.weight"), G("final_norm.bias"), dlnf.b16, x,
                                    P("final_norm.weight"), a.lnf_mean.data(), a.lnf_rstd.data(), R, C, Dres16Mine(),
                                    dsum, dsum2);
  }
  MS_RETURN_IF_ERROR(be_->LayerNormBackward(dres, G("final_norm.weight"), G("final_norm.bias"), dlnf.f32, x,
                                            P("final_norm.weight"), a.lnf_mean.data(), a.lnf_rstd.data(), R, C,
                                            Dres16Mine(), dsum, dsum2));
  return Status::Ok();
}

void* Gpt::Dres16() const {
  return keep_bf16_ ? Bf16At(dres_16_, 0) : nullptr;
}
void* Gpt::Dres16Mine() const {
  return keep_bf16_ ? Bf16At(dres_16_, LocalRow0() * spec_.hidden) : nullptr;
}

Status Gpt::BackwardChunk(int chunk, int slot, const float* dout, float dloss,
                          const std::function<void(int)>& on_layer_done) {
  if (chunk < 0 || chunk >= num_chunks()) return InvalidArgument("chunk {} of {}", chunk, num_chunks());
  auto it = acts_.find({chunk, slot});
  if (it == acts_.end() || !it->second->forward_done) {
    return FailedPrecondition("backward of chunk {} slot {} without its forward", chunk, slot);
  }
  if (!params_.empty() && grad_ptrs_[0] == nullptr) {
    return FailedPrecondition("backward before the gradients are placed (PlaceGradients)");
  }
  Acts& a = *it->second;
  a.forward_done = false;
  if (!chunks_[chunk].head && !dout) {
    return InvalidArgument("chunk {} needs the gradient of its output", chunks_[chunk].global);
  }
  if (GraphsApply(chunk)) return BackwardGraphed(chunk, slot, a, dout, dloss, on_layer_done);
  return BackwardCompute(chunk, a, dout, dloss, on_layer_done);
}

// The backward's ops (BackwardChunk has checked its arguments).
Status Gpt::BackwardCompute(int chunk, Acts& a, const float* dout, float dloss,
                            const std::function<void(int)>& on_layer_done) {
  const Chunk& ch = chunks_[chunk];
  const int64_t B = B_, T = spec_.seq_len, C = spec_.hidden, N = N_, R = rows_;
  const int64_t D = C / spec_.heads, HlD = Hl_ * D, Fl = Fl_;
  const bool seq = spec_.block == config::BlockKind::kSequential;
  const bool tp = shard_.tp_size > 1, sp = shard_.sequence_parallel && tp;
  float* s = scratch_.data();
  float* dres = s;
  float* dln = s + 2 * R * C;
  float* dy_full_buf = s + 3 * R * C + N * C;
  float* dln_full = dy_full_buf + N * C;
  float* datty = s + 3 * R * C + 4 * N * C;
  // Output gradients nothing reads in fp32 have no scratch (Dqkv32, Dfch32): their pointers are null.
  float* dqkv = Dqkv32(D) ? datty + DattyFloats(D) : nullptr;
  float* dfch_gelu = datty + DattyFloats(D) + (dqkv ? 3 * N * HlD : 0);
  float* dfch = Dfch32() ? dfch_gelu + DfchGeluFloats() : nullptr;
  auto P = [&](const ParamInfo* p) { return param_data() + p->offset; };
  auto G = [&](const ParamInfo* p) { return grad(static_cast<size_t>(p - params_.data())); };
  auto done = [&](int layer) {
    if (on_layer_done) on_layer_done(layer);
  };

  // Kept bf16 operands: the output gradients' roundings, written by the ops that make them — dres's by the
  // LayerNorm backwards (this rank's rows, at dres16; under SP the others' gathered in bf16 into dres16_all), the fc
  // output gradient's by the bias + GeLU backward, qkv's by the attention backward — and read by the GEMMs that take
  // them as dout. `dres_rounded`: dres16 holds dres's rounding now.
  void* const dres16 = Dres16Mine();
  void* const dres16_all = Dres16();
  void* const dfch16 = Dfch32() ? nullptr : Bf16At(dfch_16_, 0);
  void* const dqkv16 = keep_bf16_ ? Bf16At(dqkv_16_, 0) : nullptr;  // written by the attention backward
  // Bf16LnGrad and the sequential block: the LayerNorm input gradients in bf16, in dln_full's scratch.
  uint16_t* const dln16 = Bf16LnGrad() && seq ? reinterpret_cast<uint16_t*>(dln_full) : nullptr;
  bool dres_rounded = false;
  // A backward GEMM's operand options: the output gradient's rounding `d`, and whether dinp is written (the only
  // producer of those rows: no zeroing pass, no read of C) or accumulated onto another producer's.
  auto with_dout = [](ops::Bf16Copies c, const void* d, bool overwrite) {
    c.dout = d;
    c.dinp_overwrite = overwrite;
    return c;
  };
  // The residual-branch bias gradients of layer l that the LayerNorm backward writing dres (the gradient of layer
  // l's output) sums as it goes (BiasGradsInLn): mlp.proj's, and attn.proj's too in the parallel block (whose
  // branches both add to the layer's output); {null, null} without the fold. `dres_summed`: the current layer's
  // have been summed so.
  auto output_bias_grads = [&](int l) -> std::pair<float*, float*> {
    if (!BiasGradsInLn()) return {nullptr, nullptr};
    const LayerW lw = Layer(l);
    return {G(lw.mprojb), seq ? nullptr : G(lw.projb)};
  };
  bool dres_summed = false;
  if (ch.head) {
    float *dsum = nullptr, *dsum2 = nullptr;
    if (ch.num_layers > 0) std::tie(dsum, dsum2) = output_bias_grads(ch.first_layer + ch.num_layers - 1);
    // Its final LayerNorm backward writes dres16 (and sums the last layer's residual-branch bias gradients).
    MS_RETURN_IF_ERROR(HeadBackward(a, dloss, dres, dsum, dsum2));
    dres_rounded = dres16 != nullptr;
    dres_summed = dsum != nullptr;
    done(spec_.layers);
  } else {
    // (No dout: a graph's pass, whose caller copied it there first.)
    if (dout) MS_RETURN_IF_ERROR(be_->Copy(dres, dout, sizeof(float) * R * C));
  }
  auto dres_at = [&](int64_t row0) -> const void* {
    return dres_rounded ? static_cast<const void*>(static_cast<uint16_t*>(dres16_all) + row0 * C) : nullptr;
  };
  // The gathered rows' rounding, where it is gathered in bf16 (SpGather16, once dres16 holds this rank's rows).
  auto dres_gathered16 = [&]() { return dres_rounded ? Gathered16(dres_16_) : nullptr; };
  // dres [R,C] (all N rows without SP) is gathered to the row-parallel backward GEMMs (attn.proj, mlp.proj:
  // identity conjugate of their forward reduction); the column-parallel GEMMs produce partial LayerNorm-input
  // gradients reduced across tp into dln [R,C] (SP) or dln_full (the conjugate of the forward gather). Both
  // chunked and pipelined with the GEMMs (TpGatherRowsThen / TpProduceRowsReduce); weight gradients accumulate
  // over the row chunks.
  for (int i = ch.num_layers - 1; i >= 0; --i) {
    const int l = ch.first_layer + i;
    const LayerW w = Layer(l);
    auto& y = a.layers[i];
    const float* x = a.res.data() + i * R * C;
    const float* ln1in = sp ? y.ln1_full.data() : y.ln1.data();
    const float* ln2in = seq ? (sp ? y.ln2_full.data() : y.ln2.data()) : ln1in;
    MS_ASSIGN_OR_RETURN(const LayerBf16 k16, KeptLayer(w, a, i));  // the inputs' roundings made in the forward
    const float* const attn_bias = QkvBiasInAttention(D) && !QkvBiasInGemm(D) ? P(w.qkvb) : nullptr;  // as forward
    // Summed by the attention as it stores dqkv (also where the qkv GEMM added the bias).
    float* const attn_dbias = QkvBiasInAttention(D) ? G(w.qkvb) : nullptr;
    auto attention =
        [&]() {  // with Bf16AttnIO: qkv and datty in bf16, the output read as its kept rounding (or rounded)
          if (Bf16AttnIO(D)) {
            return be_->AttentionBackward16(dqkv, datty, Bf16At(y.qkv, 0), attn_bias, y.atty.data(),
                                            Atty32(D) ? nullptr : k16.AttyOut(), y.lse.data(), B, T, Hl_, D,
                                            spec_.window, dqkv16, attn_dbias);
          }
          return be_->AttentionBackward(dqkv, datty, y.qkv.data(), attn_bias, y.atty.data(), y.lse.data(), B, T, Hl_, D,
                                        spec_.window, dqkv16, attn_dbias);
        };
    auto mproj_rows = [&](int64_t row0, int64_t rows, const float* dy) -> Status {  // then GeLU backward
      // With Bf16Fc the GEMM writes the GeLU output's gradient rounded to bf16 (dg16, in dfch_gelu's scratch), which
      // the bias + GeLU backward reads; else in fp32.
      ops::Bf16Copies kc = with_dout(k16.Mproj(row0, true), dres_at(row0), true);
      if (GeluInGemm()) {  // the GeLU gradient in the GEMM's epilogue: it writes the fc gradient's rounding
        kc.dinp16 = static_cast<uint16_t*>(dfch16) + row0 * Fl;
        kc.dgelu_aux16 = Bf16At(y.fch, row0 * Fl);
        kc.dgelu_dbias = G(w.fcb);
        return be_->MatmulBackward(nullptr, G(w.mprojw), nullptr, dy, Off(y.fch_gelu.data(), row0 * Fl), P(w.mprojw),
                                   rows, Fl, C, kc);
      }
      uint16_t* const dg16 = Bf16Fc() ? reinterpret_cast<uint16_t*>(dfch_gelu) + row0 * Fl : nullptr;
      kc.dinp16 = dg16;
      MS_RETURN_IF_ERROR(be_->MatmulBackward(dg16 ? nullptr : dfch_gelu + row0 * Fl, G(w.mprojw), nullptr, dy,
                                             Off(y.fch_gelu.data(), row0 * Fl), P(w.mprojw), rows, Fl, C, kc));
      if (!shard_.fused_kernels) {
        MS_RETURN_IF_ERROR(
            be_->GeluBackward(dfch + row0 * Fl, y.fch.data() + row0 * Fl, dfch_gelu + row0 * Fl, rows * Fl));
        return be_->BiasGrad(G(w.fcb), dfch + row0 * Fl, rows, Fl);
      }
      // With dfch16 the fc GEMMs read only the rounding: the fp32 fc gradient is not written.
      if (Bf16Fc()) {
        return be_->BiasGeluBackward16(Off(dfch, row0 * Fl), G(w.fcb), Bf16At(y.fch, row0 * Fl), P(w.fcb), nullptr,
                                       dg16, rows, Fl, dfch16 ? static_cast<uint16_t*>(dfch16) + row0 * Fl : nullptr);
      }
      return be_->BiasGeluBackward(Off(dfch, row0 * Fl), G(w.fcb), y.fch.data() + row0 * Fl, P(w.fcb),
                                   dfch_gelu + row0 * Fl, rows, Fl,
                                   dfch16 ? static_cast<uint16_t*>(dfch16) + row0 * Fl : nullptr);
    };
    auto proj_rows = [&](int64_t row0, int64_t rows, const float* dy) {  // with Bf16AttnIO datty holds bf16
      ops::Bf16Copies kc = with_dout(k16.Proj(row0, true), dres_at(row0), true);
      if (Bf16AttnIO(D)) kc.dinp16 = reinterpret_cast<uint16_t*>(datty) + row0 * HlD;
      return be_->MatmulBackward(Bf16AttnIO(D) ? nullptr : datty + row0 * HlD, G(w.projw), nullptr, dy,
                                 Off(y.atty.data(), row0 * HlD), P(w.projw), rows, HlD, C, kc);
    };
    // fc's and qkv's input gradients: each writes dst (overwrite), or the parallel block's qkv adds to fc's.
    // dst16 (those rows), unless null, in place of dst: the input gradient written in bf16 (Bf16LnGrad).
    auto fc_rows = [&](int64_t row0, int64_t rows, float* dst, bool overwrite, uint16_t* dst16 = nullptr) {
      ops::Bf16Copies kc =  // dfch16: by the bias + GeLU backward
          with_dout(k16.Fc(row0, true), dfch16 ? static_cast<uint16_t*>(dfch16) + row0 * Fl : nullptr, overwrite);
      kc.dinp16 = dst16;
      return be_->MatmulBackward(dst16 ? nullptr : dst, G(w.fcw), nullptr, Off(dfch, row0 * Fl), Off(ln2in, row0 * C),
                                 P(w.fcw), rows, C, Fl, kc);
    };
    auto qkv_rows = [&](int64_t row0, int64_t rows, float* dst, bool overwrite, uint16_t* dst16 = nullptr) {
      ops::Bf16Copies kc =
          with_dout(k16.Qkv(row0, true), dqkv16 ? static_cast<uint16_t*>(dqkv16) + row0 * 3 * HlD : nullptr, overwrite);
      kc.dinp16 = dst16;
      return be_->MatmulBackward(dst16 ? nullptr : dst, G(w.qkvw), attn_dbias ? nullptr : G(w.qkvb),
                                 Off(dqkv, row0 * 3 * HlD), Off(ln1in, row0 * C), P(w.qkvw), rows, C, 3 * HlD, kc);
    };
    auto fc_only = [&](int64_t row0, int64_t rows, float* dst) { return fc_rows(row0, rows, dst, true); };
    auto qkv_only = [&](int64_t row0, int64_t rows, float* dst) { return qkv_rows(row0, rows, dst, true); };
    float* dln1 = nullptr;
    const uint16_t* dln1_16 = nullptr;  // the first LayerNorm's input gradient in bf16 (FusedTpSums16)
    if (seq) {
      if (!dres_summed) MS_RETURN_IF_ERROR(be_->BiasGrad(G(w.mprojb), dres, R, C));
      MS_RETURN_IF_ERROR(TpGatherRowsThen("dy>mlp.proj", dres, dy_full_buf, false, mproj_rows, dres_gathered16()));
      // dres is then dL/d(mid): attn.proj's output gradient, whose bias gradient the LayerNorm backward sums
      float* const dsum_proj = BiasGradsInLn() ? G(w.projb) : nullptr;
      if (dln16) {  // the fc GEMM writes the LayerNorm input gradient in bf16 alone
        const double t0 = NowSeconds();
        MS_RETURN_IF_ERROR(fc_rows(0, N, nullptr, true, dln16));
        GemmSpan("mlp.fc>dln2", 0, 1, t0);
        MS_RETURN_IF_ERROR(be_->LayerNormBackward16(dres, G(w.ln2w), G(w.ln2b), dln16, y.mid.data(), P(w.ln2w),
                                                    y.ln2_mean.data(), y.ln2_rstd.data(), R, C, dres16, dsum_proj,
                                                    nullptr));
      } else {  // FusedTpSums16: the fc GEMM's partials written in bf16, the LayerNorm backward reading the sum
        auto fc16 = [&](int64_t row0, int64_t rows, uint16_t* dst16) {
          return fc_rows(row0, rows, nullptr, true, dst16);
        };
        MS_ASSIGN_OR_RETURN(const TpSum dln2, TpProduceRowsReduceTo("mlp.fc>dln2", fc_only, fc16, dln_full, dln));
        if (dln2.b16) {
          MS_RETURN_IF_ERROR(be_->LayerNormBackward16(dres, G(w.ln2w), G(w.ln2b), dln2.b16, y.mid.data(), P(w.ln2w),
                                                      y.ln2_mean.data(), y.ln2_rstd.data(), R, C, dres16, dsum_proj,
                                                      nullptr));
        } else {
          MS_RETURN_IF_ERROR(be_->LayerNormBackward(dres, G(w.ln2w), G(w.ln2b), dln2.f32, y.mid.data(), P(w.ln2w),
                                                    y.ln2_mean.data(), y.ln2_rstd.data(), R, C, dres16, dsum_proj,
                                                    nullptr));
        }
      }
      dres_rounded = dres16 != nullptr;
      if (!BiasGradsInLn()) MS_RETURN_IF_ERROR(be_->BiasGrad(G(w.projb), dres, R, C));
      MS_RETURN_IF_ERROR(TpGatherRowsThen("dy>attn.proj", dres, dy_full_buf, false, proj_rows, dres_gathered16()));
      MS_RETURN_IF_ERROR(attention());
      if (dln16) {  // the qkv GEMM likewise, read by the first LayerNorm's backward below
        const double t0 = NowSeconds();
        MS_RETURN_IF_ERROR(qkv_rows(0, N, nullptr, true, dln16));
        GemmSpan("qkv>dln1", 0, 1, t0);
      } else {  // likewise
        auto qkv16 = [&](int64_t row0, int64_t rows, uint16_t* dst16) {
          return qkv_rows(row0, rows, nullptr, true, dst16);
        };
        MS_ASSIGN_OR_RETURN(const TpSum sum, TpProduceRowsReduceTo("qkv>dln1", qkv_only, qkv16, dln_full, dln));
        dln1 = sum.f32;
        dln1_16 = sum.b16;
      }
    } else {
      if (!dres_summed) {
        MS_RETURN_IF_ERROR(be_->BiasGrad(G(w.mprojb), dres, R, C));
        MS_RETURN_IF_ERROR(be_->BiasGrad(G(w.projb), dres, R, C));
      }
      // One gather of dres feeds both branches' GEMMs.
      auto both_dy_rows = [&](int64_t row0, int64_t rows, const float* dy) -> Status {
        MS_RETURN_IF_ERROR(mproj_rows(row0, rows, dy));
        return proj_rows(row0, rows, dy);
      };
      MS_RETURN_IF_ERROR(
          TpGatherRowsThen("dy>mlp.proj+attn.proj", dres, dy_full_buf, false, both_dy_rows, dres_gathered16()));
      MS_RETURN_IF_ERROR(attention());
      // Both branches' LayerNorm-input gradients add up per row: ONE reduction.
      auto both_dln_rows = [&](int64_t row0, int64_t rows, float* dst) -> Status {
        MS_RETURN_IF_ERROR(fc_rows(row0, rows, dst, true));
        return qkv_rows(row0, rows, dst, false);
      };
      MS_ASSIGN_OR_RETURN(dln1, TpProduceRowsReduce("mlp.fc+qkv>dln1", both_dln_rows, dln_full, dln));
    }
    // The key bias shifts every score of a query by the same amount, which softmax ignores: its
    // gradient is exactly zero. Computed, it is rounding noise that Adam would amplify into
    // lr-sized random steps, different for every layout; keep it at its exact value.
    MS_RETURN_IF_ERROR(be_->Zero(G(w.qkvb) + HlD, sizeof(float) * HlD));
    // dres becomes the gradient of the layer below's output: its residual-branch bias gradients summed here too.
    float *dsum = nullptr, *dsum2 = nullptr;
    if (i > 0) std::tie(dsum, dsum2) = output_bias_grads(l - 1);
    if (seq && (dln16 || dln1_16)) {
      MS_RETURN_IF_ERROR(be_->LayerNormBackward16(dres, G(w.ln1w), G(w.ln1b), dln16 ? dln16 : dln1_16, x, P(w.ln1w),
                                                  y.ln1_mean.data(), y.ln1_rstd.data(), R, C, dres16, dsum, dsum2));
    } else {
      MS_RETURN_IF_ERROR(be_->LayerNormBackward(dres, G(w.ln1w), G(w.ln1b), dln1, x, P(w.ln1w), y.ln1_mean.data(),
                                                y.ln1_rstd.data(), R, C, dres16, dsum, dsum2));
    }
    dres_rounded = dres16 != nullptr;
    dres_summed = dsum != nullptr;
    done(l);
  }
  if (ch.embedding) {
    float* dwpe = G(FindParam("embed.wpe"));
    const int64_t row0 = sp ? shard_.tp_rank * R : 0;
    MS_RETURN_IF_ERROR(be_->PositionsBackward(dwpe, dres, R, C, T, row0));
    float* dwte = G(FindParam("embed.wte"));
    auto wte_rows = [&](int64_t first, int64_t rows, const float* dx) {
      return be_->EmbeddingBackward(dwte, a.inputs.data() + first, dx, rows, C);
    };
    MS_RETURN_IF_ERROR(TpGatherRowsThen("dx>embed", dres, dy_full_buf, false, wte_rows));
    done(-1);
  } else {
    MS_RETURN_IF_ERROR(be_->Copy(a.dx_in.data(), dres, sizeof(float) * R * C));
  }
  return Status::Ok();
}

Status Gpt::ReduceSequenceParallelGrads() {
  if (!(shard_.sequence_parallel && shard_.tp_size > 1)) return Status::Ok();
  // The sp_partial tensors are laid out last and contiguously (see Create): one all-reduce over the range.
  // Placed gradients keep them so (PlaceGradients checks).
  int64_t first = num_params_, last = 0;
  float* at = nullptr;
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamInfo& p = params_[i];
    if (!p.sp_partial) continue;
    if (p.offset < first) at = grad(i);
    first = std::min(first, p.offset);
    last = std::max(last, p.offset + p.numel);
  }
  if (last <= first) return Status::Ok();
  if (at == nullptr) return FailedPrecondition("the sequence-parallel gradients are not placed");
  return TpAllReduce(at, last - first, comm::ReduceOp::kSum, "sequence-parallel grads");
}

}  // namespace ms::model
