// CUDA graphs of the training micro-batches (runtime.cuda_graphs): Gpt::EnableGraphs and what ForwardChunk /
// BackwardChunk do with it (model.h). The forward and backward ops of a slot are recorded once through the backend
// (ops::Backend::BeginCapture / EndCapture), in segments cut at the pass's hooks, and launched at the slot's later
// micro-batches, the hooks between the segments; the host's work around them (uploads, the losses' copy) runs as
// without graphs.
#include <algorithm>
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
  } else if (shard_.tp_size > 1 && !(comms_.tp && comms_.tp->waits_on_device())) {
    why = fmt::format(
        "tensor parallelism (tp {}) communicates inside each micro-batch, and its communicator ({}) "
        "waits on the host",
        shard_.tp_size, comms_.tp ? comms_.tp->name() : "none");
  } else if (shard_.tp_size > 1 && span_) {
    why =
        "a traced run (log.trace) waits for each tensor-parallel collective on the host, so that its span ends "
        "when it completed";
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

bool Gpt::GraphsApply(int /*chunk*/) const {
  // Training micro-batches only (between BeginStep and EndStep: the kept bf16 weights made once per step).
  return graphs_on_ && graph_stats_.failure.empty() && in_step_;
}

Status Gpt::CastKeptWeights(int layer) {
  if (!keep_bf16_ || layer < 0) return Status::Ok();
  if (layer == spec_.layers) {  // the head's
    return KeptWeight(FindParam(spec_.tied_embeddings ? "embed.wte" : "lm_head.weight")).status();
  }
  const LayerW w = Layer(layer);
  for (const ParamInfo* p : {w.qkvw, w.projw, w.fcw, w.mprojw}) MS_RETURN_IF_ERROR(KeptWeight(p).status());
  return Status::Ok();
}

Status Gpt::LaunchSegments(const SlotGraph& g, const char* what, const Hook& hook) {
  for (const SlotGraph::Segment& seg : g.segments) {
    if (seg.graph->ops() > 0 && !plant_graph_not_launched_) {
      MS_RETURN_IF_ERROR(seg.graph->Launch().WithContext(fmt::format("launching the {} graph", what)));
    }
    if (seg.hook && hook) MS_RETURN_IF_ERROR(hook(seg.arg));
  }
  // Tensor parallelism: the graphs hold the pass's collectives (the NCCL stream forked into each capture, joined back
  // by the device waits); no Work stands for them at a launch, so the communicator watches the launch itself — the
  // step's drain waits for it and the watchdog times out a stuck peer.
  if (shard_.tp_size > 1) {
    MS_RETURN_IF_ERROR(comms_.tp->WatchCompute(fmt::format("the {} graph's tensor-parallel collectives", what)));
    tp_drain_ = true;
  }
  ++graph_stats_.launches;
  return Status::Ok();
}

Result<bool> Gpt::RunGraphed(SlotGraph& g, const char* what, uint64_t cond, const Hook& hook, bool hooks_lead,
                             const std::function<Status(const Hook&)>& body) {
  const bool stale = std::any_of(g.segments.begin(), g.segments.end(),
                                 [](const SlotGraph::Segment& seg) { return seg.graph->Stale(); });
  if (!g.segments.empty() && (g.cond != cond || stale)) {
    g.segments.clear();
    g.warm = false;  // run once more before recording again (a replaced workspace may be replaced again)
  }
  if (!g.segments.empty()) {
    MS_RETURN_IF_ERROR(LaunchSegments(g, what, hook));
    return true;
  }
  if (!g.warm || g.cond != cond) {
    g.cond = cond;
    MS_RETURN_IF_ERROR(body(hook));
    g.warm = true;
    ++graph_stats_.eager;
    return false;
  }
  // Record: at each hook the segment so far is closed and the next one begun. Leading hooks (the forward's: what a
  // layer's ops need first) run there, between the captures, and not again at the launch that follows the
  // recording; trailing ones (the backward's: what follows a layer's ops) run at the launch, after their segment.
  std::vector<SlotGraph::Segment> segments;
  std::string failure;
  Status hook_error;
  bool lost = false;  // a capture could not be begun again: the body's later ops ran
  const Hook split = [&](int arg) -> Status {
    Result<std::unique_ptr<ops::Backend::OpGraph>> seg = be_->EndCapture();
    if (seg.ok()) {
      segments.push_back({std::move(*seg), true, arg});
    } else if (failure.empty()) {
      failure = seg.status().message();
    }
    if (hooks_lead && failure.empty() && hook_error.ok()) hook_error = hook(arg);
    // Capturing again whatever happened: the rest of the pass must not run now (a failed recording runs it all
    // eagerly below).
    if (Status st = be_->BeginCapture(); !st.ok()) {
      lost = true;
      if (failure.empty()) failure = st.message();
      return st;
    }
    if (!hook_error.ok()) return hook_error;
    return failure.empty() ? Status::Ok() : FailedPrecondition("{}", failure);
  };
  MS_RETURN_IF_ERROR(be_->BeginCapture().WithContext(fmt::format("recording the {} graph", what)));
  const Status ran = plant_capture_waits_ ? be_->Synchronize() : body(hook ? split : Hook{});
  if (lost) {
    return Status(Code::kInternal, fmt::format("recording the {} graph: a capture could not be begun again after a "
                                               "hook ({}); part of the pass ran outside it",
                                               what, failure));
  }
  Result<std::unique_ptr<ops::Backend::OpGraph>> last = be_->EndCapture();
  if (!hook_error.ok()) return hook_error;  // the pass's own failure, not the recording's
  if (failure.empty() && !ran.ok()) failure = ran.message();
  if (failure.empty() && !last.ok()) failure = last.status().message();
  if (!failure.empty()) {
    // Nothing of the body ran: run it eagerly, and from now on without graphs.
    graph_stats_.failure = fmt::format("recording the {} graph failed: {}", what, failure);
    LogWarn("runtime.cuda_graphs: {}; the run goes on without graphs", graph_stats_.failure);
    graphs_.clear();  // g too: return without touching it
    MS_RETURN_IF_ERROR(body(hook));
    ++graph_stats_.eager;
    return false;
  }
  segments.push_back({std::move(*last), false, 0});
  g.segments = std::move(segments);
  ++graph_stats_.captures;
  graph_stats_.segments += static_cast<int64_t>(g.segments.size());
  for (const SlotGraph::Segment& seg : g.segments) graph_stats_.ops += seg.graph->ops();
  MS_RETURN_IF_ERROR(LaunchSegments(g, what, hooks_lead ? Hook{} : hook));
  return false;
}

Status Gpt::ForwardGraphed(int chunk, int slot, Acts& a, const float* x_in,
                           const std::function<Status(int)>& before_layer) {
  // What the ops would upload or cast at their first use, made before them: the loss weights now, each layer's bf16
  // weights for the step at its hook, after the caller's (a ZeRO gather of the parameters waited for).
  const bool deferred = deferred_cap_ > 0;  // the head's loss: fused with its gradient where dloss > 0
  if (chunks_[chunk].head && deferred && fused_dloss_ > 0) MS_RETURN_IF_ERROR(LossWeights(fused_dloss_).status());
  // The previous stage's activations (from the pipeline's receive buffer) into the slot's, ahead of the graphs.
  if (!chunks_[chunk].embedding)
    MS_RETURN_IF_ERROR(be_->Copy(a.res.data(), x_in, sizeof(float) * rows_ * spec_.hidden));
  const Hook hook = [&](int layer) -> Status {
    if (before_layer) MS_RETURN_IF_ERROR(before_layer(layer));
    return CastKeptWeights(layer);
  };
  auto& g = graphs_[{chunk, slot, false}];
  if (!g) g = std::make_unique<SlotGraph>();
  SlotGraph* sg = g.get();
  const std::string what = fmt::format("forward (chunk {}, slot {})", chunk, slot);
  MS_ASSIGN_OR_RETURN(
      const bool replayed,
      RunGraphed(*sg, what.c_str(), Bits(fused_dloss_) | (uint64_t{deferred} << 32), hook, /*hooks_lead=*/true,
                 [&](const Hook& h) { return ForwardCompute(chunk, a, nullptr, h); }));
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

Status Gpt::BackwardGraphed(int chunk, int slot, Acts& a, const float* dout, float dloss,
                            const std::function<void(int)>& on_layer_done) {
  if (chunks_[chunk].head && !a.dlogits_ready) MS_RETURN_IF_ERROR(LossWeights(dloss).status());  // its weights
  // The next stage's gradient (from the pipeline's receive buffer) into the residual gradient, ahead of the graphs.
  if (!chunks_[chunk].head) {
    MS_RETURN_IF_ERROR(be_->Copy(scratch_.data(), dout, sizeof(float) * rows_ * spec_.hidden));
  }
  auto& g = graphs_[{chunk, slot, true}];
  if (!g) g = std::make_unique<SlotGraph>();
  SlotGraph* sg = g.get();
  const uint64_t cond = Bits(dloss) | (uint64_t{a.dlogits_ready} << 32);
  const std::string what = fmt::format("backward (chunk {}, slot {})", chunk, slot);
  Hook hook;
  if (on_layer_done) {
    hook = [&](int layer) {
      on_layer_done(layer);
      return Status::Ok();
    };
  }
  // The backward's hooks return nothing: a hook's failure to cut a segment is seen by RunGraphed, which keeps the
  // rest of the pass captured.
  MS_ASSIGN_OR_RETURN(const bool replayed,
                      RunGraphed(*sg, what.c_str(), cond, hook, /*hooks_lead=*/false, [&](const Hook& h) {
                        std::function<void(int)> done;
                        if (h) done = [&h](int layer) { (void)h(layer); };
                        return BackwardCompute(chunk, a, nullptr, dloss, done);
                      }));
  if (replayed) {
    a.dlogits_ready = sg->dlogits_ready;
  } else if (graphs_.count({chunk, slot, true})) {
    sg->dlogits_ready = a.dlogits_ready;
  }
  return Status::Ok();
}

}  // namespace ms::model
