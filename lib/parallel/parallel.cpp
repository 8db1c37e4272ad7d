#include "parallel/parallel.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "ops/ops.h"

namespace ms::parallel {

// ---- pipeline schedules ------------------------------------------------------------------

Result<std::vector<Action>> PipelineSchedule(int pp, int pp_rank, int v, int m) {
  if (pp < 1 || pp_rank < 0 || pp_rank >= pp || v < 1 || m < 1) {
    return InvalidArgument("pipeline schedule: pp={} rank={} virtual_stages={} micro_batches={}", pp, pp_rank, v, m);
  }
  std::vector<Action> out;
  if (v == 1) {
    // 1F1B: warm-up forwards, then one forward and one backward in turn, then the remaining backwards.
    const int warmup = std::min(pp - pp_rank - 1, m);
    for (int i = 0; i < warmup; ++i) out.push_back({ActionKind::kForward, i, 0});
    for (int i = 0; i < m - warmup; ++i) {
      out.push_back({ActionKind::kForward, warmup + i, 0});
      out.push_back({ActionKind::kBackward, i, 0});
    }
    for (int i = m - warmup; i < m; ++i) out.push_back({ActionKind::kBackward, i, 0});
    return out;
  }
  if (m % pp != 0) {
    return InvalidArgument("the interleaved schedule needs micro_batches ({}) to be a multiple of pp ({})", m, pp);
  }
  // Interleaved 1F1B (Megatron-LM): virtual micro-batch k visits chunk (k mod pp*v) / pp, in
  // groups of pp micro-batches; backward visits the chunks in reverse.
  const int total = m * v;
  auto fwd = [&](int k) {
    const int chunk = (k % (pp * v)) / pp;
    const int micro = (k / (pp * v)) * pp + k % pp;
    return Action{ActionKind::kForward, micro, chunk};
  };
  auto bwd = [&](int k) {
    Action a = fwd(k);
    return Action{ActionKind::kBackward, a.micro, v - 1 - a.chunk};
  };
  const int warmup = m == pp ? total : std::min((pp - pp_rank - 1) * 2 + (v - 1) * pp, total);
  for (int k = 0; k < warmup; ++k) out.push_back(fwd(k));
  for (int i = 0; i < total - warmup; ++i) {
    out.push_back(fwd(warmup + i));
    out.push_back(bwd(i));
  }
  for (int k = total - warmup; k < total; ++k) out.push_back(bwd(k));
  return out;
}

Result<P2pPlan> PipelineP2pPlan(int pp, int pp_rank, int v, int m) {
  std::vector<std::vector<Action>> all(static_cast<size_t>(pp));
  for (int r = 0; r < pp; ++r) {
    MS_ASSIGN_OR_RETURN(all[static_cast<size_t>(r)], PipelineSchedule(pp, r, v, m));
  }
  const int G = pp * v;
  // Message id: (kind, micro, receiving global chunk) -> round sent (-1: not yet).
  auto id = [&](int kind, int micro, int g) { return (static_cast<size_t>(kind) * m + micro) * G + g; };
  std::vector<int> sent(2 * static_cast<size_t>(m) * G, -1);
  std::vector<size_t> next(static_cast<size_t>(pp), 0);
  std::vector<std::vector<int>> round_of(static_cast<size_t>(pp));
  struct Sent {
    int round, from, to, kind, micro, g;
  };
  std::vector<Sent> messages;
  size_t remaining = 0;
  for (auto& a : all) remaining += a.size();
  for (int t = 0; remaining > 0; ++t) {
    std::vector<Sent> now;
    bool progress = false;
    for (int r = 0; r < pp; ++r) {
      auto& i = next[static_cast<size_t>(r)];
      const auto& sched = all[static_cast<size_t>(r)];
      if (i >= sched.size()) continue;
      const Action& a = sched[i];
      const int g = a.chunk * pp + r;
      const bool fwd = a.kind == ActionKind::kForward;
      // Its input: the activation from g-1 (forward, g > 0) or the gradient from g+1 (backward, g < G-1).
      if (fwd && g > 0 && !(sent[id(0, a.micro, g)] >= 0 && sent[id(0, a.micro, g)] < t)) continue;
      if (!fwd && g < G - 1 && !(sent[id(1, a.micro, g)] >= 0 && sent[id(1, a.micro, g)] < t)) continue;
      round_of[static_cast<size_t>(r)].push_back(t);
      ++i;
      --remaining;
      progress = true;
      if (fwd && g < G - 1) now.push_back({t, r, (g + 1) % pp, 0, a.micro, g + 1});
      if (!fwd && g > 0) now.push_back({t, r, (g - 1 + pp) % pp, 1, a.micro, g - 1});
    }
    for (const Sent& x : now) {
      sent[id(x.kind, x.micro, x.g)] = t;
      messages.push_back(x);
    }
    if (!progress) {
      return Internal("pipeline p2p plan: the schedule (pp {}, virtual stages {}, {} micro-batches) stalls in round {}",
                      pp, v, m, t);
    }
  }
  P2pPlan plan;
  plan.action_round = round_of[static_cast<size_t>(pp_rank)];
  const int rounds = plan.action_round.empty() ? 0 : messages.empty() ? 0 : messages.back().round + 1;
  plan.rounds.assign(
      static_cast<size_t>(std::max(rounds, plan.action_round.empty() ? 0 : plan.action_round.back() + 1)), {});
  for (const Sent& x : messages) {  // in (round, sender, ...) order; sorted below into one order for both sides
    if (x.from == pp_rank) plan.rounds[static_cast<size_t>(x.round)].push_back({true, x.to, x.kind, x.micro, x.g});
    if (x.to == pp_rank) plan.rounds[static_cast<size_t>(x.round)].push_back({false, x.from, x.kind, x.micro, x.g});
  }
  for (auto& group : plan.rounds) {
    std::sort(group.begin(), group.end(), [](const P2pMessage& a, const P2pMessage& b) {
      return std::tie(a.kind, a.micro, a.gchunk) < std::tie(b.kind, b.micro, b.gchunk);
    });
  }
  return plan;
}

int MaxInFlight(const std::vector<Action>& schedule, int v) {
  std::vector<int> live(v, 0);
  int best = 1;
  for (const auto& a : schedule) {
    live[a.chunk] += a.kind == ActionKind::kForward ? 1 : -1;
    best = std::max(best, live[a.chunk]);
  }
  return best;
}

// ---- data parallelism ----------------------------------------------------------------------

Result<std::unique_ptr<DataParallel>> DataParallel::Create(model::Gpt* gpt, comm::Communicator* dp,
                                                           comm::Communicator* embedding,
                                                           const DataParallelOptions& options) {
  if (options.zero < 0 || options.zero > 2) return InvalidArgument("zero must be 0, 1 or 2, not {}", options.zero);
  if ((options.zero == 2) != gpt->shard().placed_grads) {
    return InvalidArgument(
        "ZeRO-2 places the model's gradients (model::ShardSpec::placed_grads), and only ZeRO-2: "
        "zero {} on a model {}",
        options.zero, gpt->shard().placed_grads ? "with placed gradients" : "holding them");
  }
  std::unique_ptr<DataParallel> d(new DataParallel());
  d->gpt_ = gpt;
  d->be_ = gpt->backend();
  d->dp_ = dp;
  d->embedding_ = embedding;
  d->options_ = options;
  const auto& params = gpt->params();
  const int n = static_cast<int>(params.size());
  const int D = dp->size(), r = dp->rank();
  const int L = gpt->spec().layers;
  const bool tied_pp = gpt->spec().tied_embeddings && gpt->shard().pp_size > 1;
  auto deferred = [&](const model::ParamInfo& p) { return p.sp_partial || (tied_pp && p.name == "embed.wte"); };
  if (tied_pp && (gpt->has_embedding(0) || gpt->has_head(gpt->num_chunks() - 1)) && embedding == nullptr) {
    return InvalidArgument("a tied embedding across pipeline stages needs the embedding-group communicator");
  }

  // Buckets in backward order (params are laid out forward; deferred tensors sit after the
  // others, see model.cpp). A bucket never spans two chunks or mixes deferred and overlapped tensors.
  d->param_bucket_.assign(n, -1);
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int a, int b) { return params[a].offset > params[b].offset; });
  int cur = -1;
  int64_t cur_size = 0;
  auto close = [&] { cur = -1; };
  for (int i : order) {
    const auto& p = params[i];
    const bool def = deferred(p);
    const bool tied = tied_pp && p.name == "embed.wte";
    bool fits = cur >= 0 && !tied && !d->buckets_[cur].tied && d->buckets_[cur].tied == tied &&
                (deferred(params[d->buckets_[cur].first]) == def) && params[d->buckets_[cur].first].chunk == p.chunk &&
                cur_size < options.bucket_floats;
    if (!fits) {
      close();
      d->buckets_.emplace_back();
      cur = static_cast<int>(d->buckets_.size()) - 1;
      d->buckets_[cur].first = d->buckets_[cur].last = i;
      d->buckets_[cur].tied = def;  // reduced after backward
      cur_size = 0;
    }
    Bucket& b = d->buckets_[cur];
    b.first = std::min(b.first, i);
    b.last = std::max(b.last, i);
    d->param_bucket_[i] = cur;
    cur_size += p.numel;
    if (tied) close();
  }
  d->layer_buckets_.assign(L + 2, {});
  for (size_t bi = 0; bi < d->buckets_.size(); ++bi) {
    Bucket& b = d->buckets_[bi];
    b.index = static_cast<int>(bi);
    int64_t lo = INT64_MAX, hi = 0;
    for (int i = 0; i < n; ++i) {
      if (d->param_bucket_[i] != static_cast<int>(bi)) continue;
      lo = std::min(lo, params[i].offset);
      hi = std::max(hi, params[i].offset + params[i].numel);
      auto& lb = d->layer_buckets_[params[i].layer + 1];
      if (lb.empty() || lb.back() != static_cast<int>(bi)) lb.push_back(static_cast<int>(bi));
      ++b.pending;
    }
    b.start = lo;
    b.end = hi;
    b.chunk = (hi - lo + D - 1) / D;
    b.even = hi - lo == b.chunk * D;
    if (options.zero >= 1) MS_RETURN_IF_ERROR(b.shard.Allocate(gpt->backend(), b.chunk));
  }
  // Segments: the owned share of every bucket (zero >= 1); all of it, counting only the owned share (zero 0).
  const int tp_rank = gpt->shard().tp_rank;
  for (size_t bi = 0; bi < d->buckets_.size(); ++bi) {
    const Bucket& b = d->buckets_[bi];
    const auto [own_lo, own_hi] = b.Share(r);
    for (int i = 0; i < n; ++i) {
      if (d->param_bucket_[i] != static_cast<int>(bi)) continue;
      const auto& p = params[i];
      const bool counts = !p.tied_replica && (p.shard != model::ShardKind::kReplicated || tp_rank == 0);
      const int64_t t_lo = p.offset, t_hi = p.offset + p.numel;
      auto add = [&](int64_t lo, int64_t hi, bool owned) {
        if (hi <= lo) return;
        d->segments_.push_back({i, lo - t_lo, hi - lo, owned && counts});
        if (options.zero >= 1) {
          d->segment_home_.push_back({static_cast<int>(bi), lo - own_lo});
        } else {
          d->segment_home_.push_back({-1, -1});
        }
      };
      if (options.zero >= 1) {
        add(std::max(t_lo, own_lo), std::min(t_hi, own_hi), true);
      } else {
        add(t_lo, std::min(t_hi, own_lo), false);
        add(std::max(t_lo, own_lo), std::min(t_hi, own_hi), true);
        add(std::max(t_lo, own_hi), t_hi, false);
      }
    }
  }
  // bf16 gathers (zero >= 1, kept bf16 weight copies the optimizer can write): a bucket holding a weight the step
  // reads only in bf16 gathers the bf16 copies of its range; its other parameters go in fp32 beside them, packed.
  const char* gather_env = std::getenv("MEGASCALE_ZERO_GATHER");  // test hook: fp32 keeps the fp32 gather
  const bool fp32_only = gather_env != nullptr && std::strcmp(gather_env, "fp32") == 0;
  // Planted bugs the tests must catch (tests/cuda/train_emulated_test.py): MEGASCALE_PLANT=zero_gather16_unmarked —
  // the gathered copies are not declared written, so the next step casts the stale fp32 values over them;
  // zero_gather16_no_refresh — WaitAllParams leaves the stale fp32 values for evaluation and checkpoints.
  const char* plant = std::getenv("MEGASCALE_PLANT");
  d->plant_unmarked_ = plant != nullptr && std::strcmp(plant, "zero_gather16_unmarked") == 0;
  d->plant_no_refresh_ = plant != nullptr && std::strcmp(plant, "zero_gather16_no_refresh") == 0;
  if (options.zero >= 1 && gpt->keeps_bf16_weights() && gpt->bf16_param_data() != nullptr && !fp32_only) {
    for (size_t bi = 0; bi < d->buckets_.size(); ++bi) {
      Bucket& b = d->buckets_[bi];
      std::vector<int> in;  // the bucket's parameters by offset
      for (int i = 0; i < n; ++i) {
        if (d->param_bucket_[i] == static_cast<int>(bi)) in.push_back(i);
      }
      std::sort(in.begin(), in.end(), [&](int x, int y) { return params[x].offset < params[y].offset; });
      b.gather16 = std::any_of(in.begin(), in.end(), [&](int i) { return gpt->Bf16OnlyInStep(i); });
      if (!b.gather16) continue;
      for (int i : in) {  // the copies land everywhere but on a copy the step casts (a tied wte's)
        if (gpt->Bf16CastInStep(i)) continue;
        const int64_t lo = params[i].offset, hi = lo + params[i].numel;
        if (!b.copy16.empty() && b.copy16.back().second == lo) {
          b.copy16.back().second = hi;
        } else {
          b.copy16.push_back({lo, hi});
        }
      }
      b.beside_runs.assign(static_cast<size_t>(D), {});
      for (int q = 0; q < D; ++q) {
        const auto [q_lo, q_hi] = b.Share(q);
        auto& runs = b.beside_runs[static_cast<size_t>(q)];
        int64_t packed = 0;
        for (int i : in) {
          if (gpt->Bf16OnlyInStep(i)) continue;
          const int64_t lo = std::max(params[i].offset, q_lo), hi = std::min(params[i].offset + params[i].numel, q_hi);
          if (hi <= lo) continue;
          if (!runs.empty() && runs.back()[0] + runs.back()[1] == lo) {
            runs.back()[1] += hi - lo;
          } else {
            runs.push_back({lo, hi - lo, packed});
          }
          packed += hi - lo;
        }
        b.beside_count = std::max(b.beside_count, packed);
      }
      if (b.beside_count > 0) {
        ops::Backend* be = gpt->backend();
        MS_RETURN_IF_ERROR(b.beside_send.Allocate(be, b.beside_count));
        MS_RETURN_IF_ERROR(b.beside_recv.Allocate(be, b.beside_count * D));
      }
    }
  }
  // Staging (zero >= 1). A bucket that divides evenly by dp (every bucket of a model whose tensor sizes are multiples
  // of dp: the GPT configs') needs none under ZeRO-1: its reduce-scatter reads the gradients where they are (nothing
  // writes them until the next step) into the owned shard, and its fp32 all-gather runs in place in the parameters.
  // ZeRO-2 reduces each bucket from its gradient window (PlaceGradients), padded there, and gathers as ZeRO-1 does;
  // its deferred buckets, which accumulate over the micro-batches in buffers of their own, reduce from a copy. An
  // even bucket's bf16 gather runs in place in the bf16 weight copies (StartParamGather).
  for (Bucket& b : d->buckets_) {
    if (options.zero == 0 || (b.even && !(options.zero == 2 && b.tied))) continue;
    ops::Backend* be = gpt->backend();
    MS_RETURN_IF_ERROR(b.staging.Allocate(be, b.chunk * D));
    MS_RETURN_IF_ERROR(b.rs_out.Allocate(be, b.chunk));
  }
  if (options.zero == 2) {
    MS_RETURN_IF_ERROR(d->PlaceGradients().WithContext("ZeRO-2's gradient windows"));
  } else {
    for (Bucket& b : d->buckets_) b.grad = gpt->grad_data() + b.start;
  }
  return d;
}

Status DataParallel::PlaceGradients() {
  const auto& params = gpt_->params();
  const int D = dp_->size(), L = gpt_->spec().layers;
  ops::Backend* be = gpt_->backend();
  // Each local chunk's layers in backward order (the head's L first, the embeddings' -1 last).
  chunk_layers_.assign(static_cast<size_t>(gpt_->num_chunks()), {});
  layer_pos_.assign(static_cast<size_t>(L + 2), {-1, -1});
  for (const auto& p : params) {
    auto& v = chunk_layers_[static_cast<size_t>(p.chunk)];
    if (std::find(v.begin(), v.end(), p.layer) == v.end()) v.push_back(p.layer);
  }
  for (size_t c = 0; c < chunk_layers_.size(); ++c) {
    auto& v = chunk_layers_[c];
    std::sort(v.begin(), v.end(), std::greater<>());
    for (size_t k = 0; k < v.size(); ++k) layer_pos_[static_cast<size_t>(v[k] + 1)] = {static_cast<int>(c), k};
  }
  // Buckets in a window of their own (a wte tied at pp 1: written by the head's backward and the embeddings'), and
  // those sharing the K windows, numbered in backward order.
  auto own_window = [&](const Bucket& b) {
    for (int i = b.first; i <= b.last; ++i) {
      if (param_bucket_[static_cast<size_t>(i)] == b.index && gpt_->spec().tied_embeddings &&
          params[static_cast<size_t>(i)].name == "embed.wte") {
        return true;
      }
    }
    return false;
  };
  std::vector<int> shared_pos(buckets_.size(), -1);
  int shared = 0;
  for (Bucket& b : buckets_) {
    if (!b.tied && !own_window(b)) shared_pos[static_cast<size_t>(b.index)] = shared++;
  }
  // K: the most buckets (as a span of that numbering) three consecutive layers of a chunk touch — the layer running,
  // the next (being written: its residual-branch bias gradients), the one after (readied now) — so a window is
  // only taken from a bucket whose layer finished before the running one, whose reduction had that layer's time.
  int K = 1;
  for (const auto& v : chunk_layers_) {
    for (size_t k = 0; k < v.size(); ++k) {
      int lo = INT32_MAX, hi = -1;
      for (size_t j = k; j < std::min(v.size(), k + 3); ++j) {
        for (int bi : layer_buckets_[static_cast<size_t>(v[j] + 1)]) {
          const int w = shared_pos[static_cast<size_t>(bi)];
          if (w < 0) continue;
          lo = std::min(lo, w);
          hi = std::max(hi, w);
        }
      }
      if (hi >= lo) K = std::max(K, hi - lo + 1);
    }
  }
  shared_windows_ = std::min(K, shared);
  windows_.clear();
  windows_.resize(static_cast<size_t>(shared_windows_));
  std::vector<int64_t> floats(static_cast<size_t>(shared_windows_), 0);
  for (Bucket& b : buckets_) {
    const int w = shared_pos[static_cast<size_t>(b.index)];
    if (w >= 0) {
      b.window = w % shared_windows_;
      floats[static_cast<size_t>(b.window)] = std::max(floats[static_cast<size_t>(b.window)], b.chunk * D);
    } else if (!b.tied) {
      b.window = static_cast<int>(windows_.size());
      windows_.emplace_back();
      floats.push_back(b.chunk * D);
    }
  }
  for (size_t w = 0; w < windows_.size(); ++w) MS_RETURN_IF_ERROR(windows_[w].data.Allocate(be, floats[w]));
  for (Bucket& b : buckets_) {
    if (b.window >= 0) b.grad = windows_[static_cast<size_t>(b.window)].data.data();
  }
  // Deferred buckets: buffers over runs of them adjacent in the flat layout (tensors sit 16-float aligned), so that
  // the sequence-parallel partial sums stay one range (model::Gpt::ReduceSequenceParallelGrads).
  std::vector<Bucket*> deferred;
  for (Bucket& b : buckets_) {
    if (b.tied) deferred.push_back(&b);
  }
  std::sort(deferred.begin(), deferred.end(), [](const Bucket* x, const Bucket* y) { return x->start < y->start; });
  for (size_t i = 0; i < deferred.size();) {
    size_t j = i + 1;
    int64_t hi = deferred[i]->end;
    while (j < deferred.size() && deferred[j]->start - hi < 16) hi = std::max(hi, deferred[j++]->end);
    const int64_t lo = deferred[i]->start;
    deferred_grads_.emplace_back();
    MS_RETURN_IF_ERROR(deferred_grads_.back().Allocate(be, hi - lo));
    for (size_t k = i; k < j; ++k) deferred[k]->grad = deferred_grads_.back().data() + (deferred[k]->start - lo);
    i = j;
  }
  std::vector<float*> where(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const Bucket& b = buckets_[static_cast<size_t>(param_bucket_[i])];
    where[i] = b.grad + (params[i].offset - b.start);
  }
  return gpt_->PlaceGradients(where);
}

int64_t DataParallel::gradient_floats() const {
  int64_t n = 0;
  for (const Window& w : windows_) n += static_cast<int64_t>(w.data.size());
  for (const auto& g : deferred_grads_) n += static_cast<int64_t>(g.size());
  return n;
}

int DataParallel::staged_buckets() const {
  return static_cast<int>(
      std::count_if(buckets_.begin(), buckets_.end(), [](const Bucket& b) { return b.staging.size() > 0; }));
}

int64_t DataParallel::buffer_floats() const {
  int64_t n = 0;
  for (const Bucket& b : buckets_) {
    n += static_cast<int64_t>(b.staging.size() + b.shard.size() + b.rs_out.size() + b.beside_send.size() +
                              b.beside_recv.size());
  }
  return n + gradient_floats();
}

int DataParallel::bf16_gather_buckets() const {
  return static_cast<int>(std::count_if(buckets_.begin(), buckets_.end(), [](const Bucket& b) { return b.gather16; }));
}

int64_t DataParallel::fp32_beside_bf16_floats() const {
  int64_t n = 0;
  for (const Bucket& b : buckets_) n += b.beside_count;
  return n;
}

std::vector<optim::SegmentData> DataParallel::segment_data() {
  std::vector<optim::SegmentData> out;
  const auto& params = gpt_->params();
  uint16_t* bf16 = static_cast<uint16_t*>(gpt_->bf16_param_data());  // bf16 elements at the parameters' offsets
  for (size_t s = 0; s < segments_.size(); ++s) {
    const auto& seg = segments_[s];
    const auto& p = params[seg.param];
    float* param = gpt_->param_data() + p.offset + seg.begin;
    float* grad = segment_home_[s].first < 0 ? gpt_->grad_data() + p.offset + seg.begin
                                             : buckets_[segment_home_[s].first].shard.data() + segment_home_[s].second;
    // zero 0: the segments cover every parameter, which nothing writes after the step (see OptimizerStepped).
    // bf16 gathers: the owned shares of the weights whose bf16 copies are gathered (StartParamGather).
    const bool gathered16 = options_.zero >= 1 && segment_home_[s].first >= 0 &&
                            buckets_[static_cast<size_t>(segment_home_[s].first)].gather16 &&
                            gpt_->Bf16OnlyInStep(seg.param);
    void* param16 = (options_.zero == 0 || gathered16) && bf16 != nullptr
                        ? static_cast<void*>(bf16 + p.offset + seg.begin)
                        : nullptr;
    out.push_back({param, grad, param16});
  }
  return out;
}

void DataParallel::OptimizerStepped() {
  if (options_.zero == 0 && gpt_->keeps_bf16_weights()) gpt_->Bf16WeightsWritten();
}

Status DataParallel::BeginStep() {
  // The shards need no zeroing: ZeRO-1 and ZeRO-2's deferred buckets write theirs once per step, and ZeRO-2's first
  // reduction of a bucket in a step writes its shard (the later ones add it in first, Launch).
  if (options_.zero == 2) {  // the windows are zeroed as they are readied; the deferred buckets' buffers here
    for (auto& g : deferred_grads_) MS_RETURN_IF_ERROR(be_->Zero(g.data(), sizeof(float) * g.size()));
    for (Bucket& b : buckets_) b.ready = b.shard_started = false;
  } else {
    MS_RETURN_IF_ERROR(gpt_->ZeroGrad());
  }
  for (auto& b : buckets_) b.pending = 0;
  for (size_t i = 0; i < param_bucket_.size(); ++i) ++buckets_[param_bucket_[i]].pending;
  in_backward_ = true;
  return Status::Ok();
}

// Before a collective reads what the backend enqueued: nothing when the communicator waits for the backend's
// stream on the device (NCCL), else the backend is synchronized (Gloo reads from its own thread).
Status DataParallel::ReadyFor(comm::Communicator& c) {
  return c.orders_after_compute() ? Status::Ok() : be_->Synchronize();
}

Status DataParallel::Launch(Bucket& b) {
  const int64_t len = b.end - b.start;
  float* grad = b.grad;
  if (options_.zero == 0) {
    // The communicator runs on its own stream or thread: the gradients the backend enqueued must be final.
    MS_RETURN_IF_ERROR(ReadyFor(*dp_));
    b.work = dp_->AllReduce(grad, len, comm::ReduceOp::kSum);
  } else if (options_.zero == 1 && b.even) {  // from the gradients into the owned shard
    MS_RETURN_IF_ERROR(ReadyFor(*dp_));
    b.work = dp_->ReduceScatter(grad, b.shard.data(), b.chunk);
  } else if (b.window >= 0) {
    // ZeRO-2: from its window (zero beyond the bucket) straight into the owned shard. From the step's second
    // reduction of the bucket on, the shard (this step's sum so far) is first added into this rank's share of the
    // window, so that the reduce-scatter yields shard + the micro-batch's sum over the ranks: no output buffer, no
    // add after it (the share's sum then adds the shard first: rounding, not bits, differ from adding it after).
    if (b.shard_started) {  // b's previous reduction, which wrote the shard, was waited for when b took the window
      MS_RETURN_IF_ERROR(be_->AddInPlace(grad + dp_->rank() * b.chunk, b.shard.data(), b.chunk));
    }
    MS_RETURN_IF_ERROR(ReadyFor(*dp_));
    b.work = dp_->ReduceScatter(grad, b.shard.data(), b.chunk);
    b.ready = false;
    b.shard_started = true;
  } else {
    MS_RETURN_IF_ERROR(be_->Copy(b.staging.data(), grad, sizeof(float) * len));
    MS_RETURN_IF_ERROR(be_->Zero(b.staging.data() + len, sizeof(float) * (b.staging.size() - len)));
    MS_RETURN_IF_ERROR(ReadyFor(*dp_));
    b.work = dp_->ReduceScatter(b.staging.data(), b.rs_out.data(), b.chunk);
    if (options_.zero == 2) {  // ZeRO-2's deferred buckets: reduced once, after the last micro-batch
      MS_RETURN_IF_ERROR(be_->Zero(grad, sizeof(float) * len));
    }
  }
  b.launched_at = NowSeconds();
  ++stats_.dp_launched;
  if (in_backward_) ++stats_.dp_launched_during_backward;
  return Status::Ok();
}

Status DataParallel::WaitWork(std::unique_ptr<comm::Work>& work, bool on_device) {
  const double t0 = NowSeconds();
  const bool dev = on_device && options_.device_waits && dp_->waits_on_device();
  Status s = dev ? work->WaitOnDevice() : work->Wait();
  drain_ = drain_ || dev;
  stats_.dp_wait_s += NowSeconds() - t0;
  work.reset();
  return s;
}

Status DataParallel::Drain() {
  if (!drain_) return Status::Ok();
  drain_ = false;
  // The exposed time is the device's (the waits that ended by now; the rest counts in the next step).
  Status s = dp_->Drain();
  stats_.dp_wait_s += dp_->TakeDeviceWaitSeconds();
  return s.WithContext("the step's data-parallel collectives (waited for on the device)");
}

Status DataParallel::WaitBucket(Bucket& b) {
  if (!b.work) return Status::Ok();
  Status s = WaitWork(b.work, /*on_device=*/true);
  if (options_.on_comm_span) {
    options_.on_comm_span(fmt::format("{} bucket {}", options_.zero ? "reduce-scatter" : "all-reduce", b.index),
                          b.launched_at, NowSeconds());
  }
  MS_RETURN_IF_ERROR_CTX(s, "data-parallel gradient reduction");
  if (options_.zero == 1 && !b.even) {
    MS_RETURN_IF_ERROR(be_->Copy(b.shard.data(), b.rs_out.data(), sizeof(float) * b.chunk));
  }
  return Status::Ok();
}

void DataParallel::OnLayerDone(int layer, int micro, int num_micro) {
  const auto& params = gpt_->params();
  for (int bi : layer_buckets_[layer + 1]) {
    Bucket& b = buckets_[bi];
    for (size_t i = 0; i < params.size(); ++i) {
      if (param_bucket_[i] == bi && params[i].layer == layer) --b.pending;
    }
    if (b.pending > 0) continue;
    b.pending = 0;
    for (size_t i = 0; i < params.size(); ++i) b.pending += param_bucket_[i] == bi;  // next micro-batch
    if (b.tied) continue;  // deferred: reduced in FinishBackward
    const bool last = micro == num_micro - 1;
    if (b.window >= 0 && !b.ready) {  // its gradient went into a window that holds another bucket's
      pending_error_ = Internal("ZeRO-2: bucket {} reduced without its gradient window ({})", b.index, b.window);
      continue;
    }
    if (options_.zero == 2 || last) {
      if (b.work) {
        Status s = WaitBucket(b);  // the previous micro-batch's reduction of this bucket (ZeRO-2)
        if (!s.ok()) {
          pending_error_ = s;
          continue;
        }
      }
      if (Status s = Launch(b); !s.ok()) {
        pending_error_ = s;
        continue;
      }
      if (!options_.overlap) {
        Status s = WaitBucket(b);
        if (!s.ok()) pending_error_ = s;
      }
    }
  }
  if (options_.zero == 2 && pending_error_.ok()) {  // the windows of the layer after the next
    const auto [c, k] = layer_pos_[static_cast<size_t>(layer + 1)];
    if (c < 0) return;
    const auto& v = chunk_layers_[static_cast<size_t>(c)];
    if (static_cast<size_t>(k) + 2 < v.size()) {
      if (Status s = ReadyLayer(v[static_cast<size_t>(k) + 2]); !s.ok()) pending_error_ = s;
    }
  }
}

Status DataParallel::Ready(Bucket& b) {
  if (b.window < 0 || b.ready) return Status::Ok();
  Window& w = windows_[static_cast<size_t>(b.window)];
  if (w.holder >= 0) {
    Bucket& h = buckets_[static_cast<size_t>(w.holder)];
    if (h.ready && w.holder != b.index) {
      return Internal("ZeRO-2: bucket {} needs gradient window {}, which still holds bucket {} (not yet reduced)",
                      b.index, b.window, h.index);
    }
    MS_RETURN_IF_ERROR(WaitBucket(h));  // its reduction (and the add into its shard) read the window
  }
  MS_RETURN_IF_ERROR(be_->Zero(w.data.data(), sizeof(float) * w.data.size()));
  w.holder = b.index;
  b.ready = true;
  return Status::Ok();
}

Status DataParallel::ReadyLayer(int layer) {
  for (int bi : layer_buckets_[static_cast<size_t>(layer + 1)])
    MS_RETURN_IF_ERROR(Ready(buckets_[static_cast<size_t>(bi)]));
  return Status::Ok();
}

Status DataParallel::BeforeBackward(int chunk) {
  if (options_.zero != 2) return Status::Ok();
  MS_RETURN_IF_ERROR(pending_error_);
  const auto& params = gpt_->params();
  for (Bucket& b : buckets_) {  // the windows of their own (a wte tied at pp 1)
    if (b.window >= shared_windows_ && params[static_cast<size_t>(b.first)].chunk == chunk)
      MS_RETURN_IF_ERROR(Ready(b));
  }
  const auto& v = chunk_layers_[static_cast<size_t>(chunk)];
  for (size_t k = 0; k < std::min<size_t>(2, v.size()); ++k) MS_RETURN_IF_ERROR(ReadyLayer(v[k]));
  return Status::Ok();
}

Status DataParallel::EndMicroBatch(int, int) {
  return pending_error_;
}

Status DataParallel::FinishBackward() {
  MS_RETURN_IF_ERROR(pending_error_);
  for (auto& b : buckets_) {
    if (!b.tied) MS_RETURN_IF_ERROR(WaitBucket(b));
  }
  in_backward_ = false;
  bool drain_embedding = false;
  for (auto& b : buckets_) {
    if (!b.tied) continue;
    const auto& params = gpt_->params();
    const bool is_wte = params[b.first].name == "embed.wte" && embedding_ != nullptr;
    if (is_wte) {
      MS_RETURN_IF_ERROR(ReadyFor(*embedding_));
      const double t0 = NowSeconds();
      auto work = embedding_->AllReduce(b.grad, b.end - b.start, comm::ReduceOp::kSum);
      // On the device where it can (the data-parallel reduction below is ordered after it there), drained below.
      const bool dev = options_.device_waits && embedding_->waits_on_device();
      Status s = dev ? work->WaitOnDevice() : work->Wait();
      drain_embedding = drain_embedding || dev;
      stats_.dp_wait_s += NowSeconds() - t0;
      MS_RETURN_IF_ERROR_CTX(s, "embedding-group all-reduce of the tied wte gradient");
    }
    MS_RETURN_IF_ERROR(Launch(b));
    if (options_.zero == 2) {
      // Deferred buckets accumulated the full gradient over the micro-batches: take it as is.
      MS_RETURN_IF_ERROR_CTX(WaitWork(b.work, /*on_device=*/true), "data-parallel gradient reduction");
      MS_RETURN_IF_ERROR(be_->Copy(b.shard.data(), b.rs_out.data(), sizeof(float) * b.chunk));
    } else {
      MS_RETURN_IF_ERROR(WaitBucket(b));
    }
  }
  // Before the optimizer reads the gradients: a collective that failed on the device says so here.
  if (drain_embedding) {
    Status s = embedding_->Drain();
    stats_.dp_wait_s += embedding_->TakeDeviceWaitSeconds();
    MS_RETURN_IF_ERROR_CTX(s, "the embedding group's all-reduce of the tied wte gradient (waited for on the device)");
  }
  return Drain();
}

Status DataParallel::LaunchGather32(Bucket& b) {
  const int r = dp_->rank();
  const auto [own_lo, own_hi] = b.Share(r);
  if (b.even) {  // in place: the owned share is this rank's slot of the bucket's parameters
    MS_RETURN_IF_ERROR(ReadyFor(*dp_));
    b.work = dp_->AllGather(gpt_->param_data() + own_lo, gpt_->param_data() + b.start, b.chunk);
  } else {
    MS_RETURN_IF_ERROR(be_->Zero(b.rs_out.data(), sizeof(float) * b.rs_out.size()));
    MS_RETURN_IF_ERROR(be_->Copy(b.rs_out.data(), gpt_->param_data() + own_lo, sizeof(float) * (own_hi - own_lo)));
    MS_RETURN_IF_ERROR(ReadyFor(*dp_));
    b.work = dp_->AllGather(b.rs_out.data(), b.staging.data(), b.chunk);
  }
  b.launched_at = NowSeconds();
  b.gather_pending = true;
  b.pending16 = false;
  ++stats_.dp_launched;
  return Status::Ok();
}

Status DataParallel::StartParamGather() {
  if (options_.zero == 0) return Status::Ok();
  const int r = dp_->rank();
  uint16_t* const bf16 = static_cast<uint16_t*>(gpt_->bf16_param_data());
  const auto& params = gpt_->params();
  for (auto it = buckets_.rbegin(); it != buckets_.rend(); ++it) {  // forward order: first needed first
    Bucket& b = *it;
    if (!b.gather16) {
      MS_RETURN_IF_ERROR(LaunchGather32(b));
      continue;
    }
    // The owned share of the bf16 copies (the optimizer wrote the update's rounding there; a skipped step left the
    // step's copies, made from the unchanged values) and, packed, the owned parts of the other parameters.
    const auto [own_lo, own_hi] = b.Share(r);
    // An even bucket gathers in place in the copies (this rank's share is its slot); its other parameters' and a
    // tied wte's slots receive their owners' values too, which nothing reads: a tied wte's copy is cast in the step,
    // after this gather has been waited for (at the embedding's layer, before the head's).
    uint16_t* const send16 = b.even ? bf16 + own_lo : reinterpret_cast<uint16_t*>(b.rs_out.data());
    uint16_t* const recv16 = b.even ? bf16 + b.start : reinterpret_cast<uint16_t*>(b.staging.data());
    if (!b.even) {
      MS_RETURN_IF_ERROR(be_->Copy(send16, bf16 + own_lo, sizeof(uint16_t) * (own_hi - own_lo)));
      if (own_hi - own_lo < b.chunk) {
        MS_RETURN_IF_ERROR(be_->Zero(send16 + (own_hi - own_lo), sizeof(uint16_t) * (b.chunk - (own_hi - own_lo))));
      }
    }
    for (const auto& run : b.beside_runs[static_cast<size_t>(r)]) {
      MS_RETURN_IF_ERROR(be_->Copy(b.beside_send.data() + run[2], gpt_->param_data() + run[0], sizeof(float) * run[1]));
    }
    MS_RETURN_IF_ERROR(ReadyFor(*dp_));
    b.work = dp_->AllGather16(send16, recv16, b.chunk);
    ++stats_.dp_launched;
    if (b.beside_count > 0) {
      b.beside_work = dp_->AllGather(b.beside_send.data(), b.beside_recv.data(), b.beside_count);
      ++stats_.dp_launched;
    }
    b.launched_at = NowSeconds();
    b.gather_pending = true;
    b.pending16 = true;
    // The gathered copies are the next step's: it casts none of them. Their fp32 values are current only where owned.
    for (size_t i = 0; i < params.size(); ++i) {
      if (param_bucket_[i] == b.index && gpt_->Bf16OnlyInStep(static_cast<int>(i)) && !plant_unmarked_) {
        gpt_->Bf16WeightWritten(static_cast<int>(i));
      }
    }
    fp32_stale_ = fp32_stale_ || dp_->size() > 1;
  }
  return Status::Ok();
}

Status DataParallel::WaitGather(Bucket& b, bool on_device) {
  if (!b.gather_pending) return Status::Ok();
  Status s = WaitWork(b.work, on_device);
  if (b.beside_work) {
    Status s2 = WaitWork(b.beside_work, on_device);
    if (s.ok()) s = s2;
  }
  b.gather_pending = false;
  if (options_.on_comm_span) {
    options_.on_comm_span(fmt::format("all-gather{} bucket {}", b.pending16 ? " (bf16)" : "", b.index), b.launched_at,
                          NowSeconds());
  }
  MS_RETURN_IF_ERROR_CTX(s, "data-parallel parameter all-gather{}", b.pending16 ? " (bf16 weight copies)" : "");
  if (!b.pending16) {
    if (b.even) return Status::Ok();  // gathered in place
    return be_->Copy(gpt_->param_data() + b.start, b.staging.data(), sizeof(float) * (b.end - b.start));
  }
  uint16_t* const bf16 = static_cast<uint16_t*>(gpt_->bf16_param_data());
  const uint16_t* const got16 = reinterpret_cast<const uint16_t*>(b.staging.data());
  for (size_t k = 0; !b.even && k < b.copy16.size(); ++k) {  // an even bucket was gathered in place
    const auto [lo, hi] = b.copy16[k];
    MS_RETURN_IF_ERROR(be_->Copy(bf16 + lo, got16 + (lo - b.start), sizeof(uint16_t) * (hi - lo)));
  }
  const int r = dp_->rank();
  for (int q = 0; q < dp_->size(); ++q) {
    if (q == r) continue;  // its own parts are where they were packed from
    for (const auto& run : b.beside_runs[static_cast<size_t>(q)]) {
      MS_RETURN_IF_ERROR(be_->Copy(gpt_->param_data() + run[0], b.beside_recv.data() + q * b.beside_count + run[2],
                                   sizeof(float) * run[1]));
    }
  }
  return Status::Ok();
}

Status DataParallel::WaitParams(int layer) {
  if (layer + 1 < 0 || layer + 1 >= static_cast<int>(layer_buckets_.size())) return Status::Ok();
  for (int bi : layer_buckets_[layer + 1]) MS_RETURN_IF_ERROR(WaitGather(buckets_[bi], /*on_device=*/true));
  return Status::Ok();
}

Status DataParallel::WaitAllParams() {
  for (auto& b : buckets_) MS_RETURN_IF_ERROR(WaitGather(b, /*on_device=*/false));
  if (fp32_stale_ && !plant_no_refresh_) {
    // The bf16-gathered weights' fp32 values, for what reads them outside a step (evaluation, checkpoints).
    for (auto& b : buckets_) {
      if (b.gather16) MS_RETURN_IF_ERROR(LaunchGather32(b));
    }
    for (auto& b : buckets_) MS_RETURN_IF_ERROR(WaitGather(b, /*on_device=*/false));
    fp32_stale_ = false;
  }
  return Drain();
}

}  // namespace ms::parallel
