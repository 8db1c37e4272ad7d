// CUDA graphs of the training micro-batches (runtime.cuda_graphs): Gpt::EnableGraphs and what ForwardChunk /
// BackwardChunk do with it (model.h). The forward and backward ops of a slot are recorded once through the backend
// (ops::Backend::BeginCapture / EndCapture) and the recording launched at the slot's later micro-batches; the host's
// work around them (uploads, hooks, the losses' copy) runs as without graphs.
#include <cstdlib>
#include <cstring>

#include "model/acts.h"
#include "model/model.h"

namespace ms::model {
namespace {

uint64_t Bits(float f) {
  uint32_t u = 0;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

}  // namespace

std::string Gpt::EnableGraphs(bool on) {
  std::string why;
  if (!be_->supports_graphs()) {
    why = fmt::format("the {} backend records no graphs", be_->name());
  } else if (shard_.tp_size > 1) {
    why = fmt::format("tensor parallelism (tp {}) communicates inside each micro-batch", shard_.tp_size);
  } else if (num_chunks() != 1 || !chunks_[0].embedding || !chunks_[0].head) {
    why = "pipeline parallelism: a stage's micro-batch waits for its neighbours' activations and gradients";
  }
  graphs_on_ = on && why.empty();
  if (!graphs_on_) graphs_.clear();
  // Test hooks (docs/cuda.md): MEGASCALE_PLANT=graph_not_launched counts a graph's launches without launching it;
  // graph_capture_waits makes every capture wait for the device (which a capture cannot hold).
  const char* plant = std::getenv("MEGASCALE_PLANT");
  plant_graph_not_launched_ = plant && std::strcmp(plant, "graph_not_launched") == 0;
  plant_capture_waits_ = plant && std::strcmp(plant, "graph_capture_waits") == 0;
  return why;
}

bool Gpt::GraphsApply(int chunk) const {
  // Training micro-batches only (their losses deferred), with the kept bf16 weights made per step.
  return graphs_on_ && graph_stats_.failure.empty() && deferred_cap_ > 0 && (in_step_ || !keep_bf16_) &&
         chunks_[chunk].embedding && chunks_[chunk].head;
}

Status Gpt::PrepareKeptWeights(int chunk) {
  if (!keep_bf16_) return Status::Ok();
  const Chunk& ch = chunks_[chunk];
  for (int l = ch.first_layer; l < ch.first_layer + ch.num_layers; ++l) {
    const LayerW w = Layer(l);
    for (const ParamInfo* p : {w.qkvw, w.projw, w.fcw, w.mprojw}) MS_RETURN_IF_ERROR(KeptWeight(p).status());
  }
  if (ch.head) {
    MS_RETURN_IF_ERROR(KeptWeight(FindParam(spec_.tied_embeddings ? "embed.wte" : "lm_head.weight")).status());
  }
  return Status::Ok();
}

Result<bool> Gpt::RunGraphed(SlotGraph& g, const char* what, uint64_t cond, const std::function<Status()>& body) {
  if (g.graph && (g.cond != cond || g.graph->Stale())) {
    g.graph.reset();
    g.warm = false;  // run once more before recording again (a replaced workspace may be replaced again)
  }
  if (g.graph) {
    if (!plant_graph_not_launched_) {
      MS_RETURN_IF_ERROR(g.graph->Launch().WithContext(fmt::format("launching the {} graph", what)));
    }
    ++graph_stats_.launches;
    return true;
  }
  if (!g.warm || g.cond != cond) {
    g.cond = cond;
    MS_RETURN_IF_ERROR(body());
    g.warm = true;
    ++graph_stats_.eager;
    return false;
  }
  MS_RETURN_IF_ERROR(be_->BeginCapture().WithContext(fmt::format("recording the {} graph", what)));
  const Status ran = plant_capture_waits_ ? be_->Synchronize() : body();
  Result<std::unique_ptr<ops::Backend::OpGraph>> graph = be_->EndCapture();
  if (!ran.ok() || !graph.ok()) {
    // Nothing of the body ran: run it eagerly, and from now on without graphs.
    graph_stats_.failure =
        fmt::format("recording the {} graph failed: {}", what, (ran.ok() ? graph.status() : ran).message());
    LogWarn("runtime.cuda_graphs: {}; the run goes on without graphs", graph_stats_.failure);
    graphs_.clear();  // g too: return without touching it
    MS_RETURN_IF_ERROR(body());
    ++graph_stats_.eager;
    return false;
  }
  g.graph = std::move(*graph);
  ++graph_stats_.captures;
  graph_stats_.ops += g.graph->ops();
  MS_RETURN_IF_ERROR(g.graph->Launch().WithContext(fmt::format("launching the {} graph", what)));
  ++graph_stats_.launches;
  return false;
}

Status Gpt::ForwardGraphed(int chunk, int slot, Acts& a, const std::function<Status(int)>& before_layer) {
  const Chunk& ch = chunks_[chunk];
  // The hooks first, in the order the ops would meet them (ZeRO's parameter gathers waited for).
  if (before_layer) {
    MS_RETURN_IF_ERROR(before_layer(-1));
    for (int l = ch.first_layer; l < ch.first_layer + ch.num_layers; ++l) MS_RETURN_IF_ERROR(before_layer(l));
    MS_RETURN_IF_ERROR(before_layer(spec_.layers));
  }
  // What the ops would upload or cast on their first use, made before the graph.
  MS_RETURN_IF_ERROR(PrepareKeptWeights(chunk));
  if (fused_dloss_ > 0) MS_RETURN_IF_ERROR(LossWeights(fused_dloss_).status());
  auto& g = graphs_[{chunk, slot, false}];
  if (!g) g = std::make_unique<SlotGraph>();
  SlotGraph* sg = g.get();
  const std::string what = fmt::format("forward (chunk {}, slot {})", chunk, slot);
  MS_ASSIGN_OR_RETURN(const bool replayed, RunGraphed(*sg, what.c_str(), Bits(fused_dloss_),
                                                      [&] { return ForwardCompute(chunk, a, nullptr, {}); }));
  if (replayed) {
    a.forward_done = true;
    a.dlogits_ready = sg->dlogits_ready;
    a.dlogits_weight = sg->dlogits_weight;
  } else if (graphs_.count({chunk, slot, false})) {
    sg->dlogits_ready = a.dlogits_ready;
    sg->dlogits_weight = a.dlogits_weight;
  }
  return Status::Ok();
}

Status Gpt::BackwardGraphed(int chunk, int slot, Acts& a, float dloss, const std::function<void(int)>& on_layer_done) {
  const Chunk& ch = chunks_[chunk];
  if (!a.dlogits_ready) MS_RETURN_IF_ERROR(LossWeights(dloss).status());  // the head backward's weights
  auto& g = graphs_[{chunk, slot, true}];
  if (!g) g = std::make_unique<SlotGraph>();
  SlotGraph* sg = g.get();
  const uint64_t cond = Bits(dloss) | (uint64_t{a.dlogits_ready} << 32);
  const std::string what = fmt::format("backward (chunk {}, slot {})", chunk, slot);
  MS_ASSIGN_OR_RETURN(const bool replayed, RunGraphed(*sg, what.c_str(), cond,
                                                      [&] { return BackwardCompute(chunk, a, nullptr, dloss, {}); }));
  if (replayed) {
    a.dlogits_ready = sg->dlogits_ready;
  } else if (graphs_.count({chunk, slot, true})) {
    sg->dlogits_ready = a.dlogits_ready;
  }
  // The hooks after the ops, in the order the ops would meet them (the data-parallel reductions' buckets).
  if (on_layer_done) {
    on_layer_done(spec_.layers);
    for (int l = ch.first_layer + ch.num_layers - 1; l >= ch.first_layer; --l) on_layer_done(l);
    on_layer_done(-1);
  }
  return Status::Ok();
}

}  // namespace ms::model
