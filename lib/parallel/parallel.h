// Parallel execution: pipeline schedules and the data-parallel engine (gradient buckets
// overlapped with backward, ZeRO-1/2 sharding of optimizer state and gradients, parameter
// all-gathers prefetched for the next forward).
//
// Pipeline schedules are pure functions from (pp, pp_rank, virtual_stages, micro_batches) to
// the ordered list of forward/backward actions of one rank, in three phases (warm-up, steady
// 1F1B, cool-down), as Megatron-LM's schedules.py does; virtual_stages > 1 gives the
// interleaved schedule. The runner executes them and moves activations between stages.
//
// DataParallel (one per rank, over the data-parallel communicator):
//   buckets   the rank-local parameter buffer cut into contiguous ranges of about
//             bucket_floats, in the order backward produces gradients (head first); a bucket's
//             reduction starts as soon as all its tensors' gradients are final (the model's
//             on_layer_done hook), on the communicator's own thread, while backward goes on.
//   zero 0    all-reduce of each bucket; every rank updates all parameters.
//   zero 1    reduce-scatter of each bucket on the last micro-batch; each rank owns 1/dp of
//             every bucket (optimizer state and update); updated parameters are all-gathered.
//   zero 2    as 1, but gradients are reduce-scattered after EVERY micro-batch and accumulated
//             in the owned shard, so no gradient outlives its bucket's reduction: the model holds no
//             gradient buffer (model::ShardSpec::placed_grads). Its buckets' gradients live in a few
//             bucket-sized windows, reused in backward order: window w % K for the w-th bucket, K the most
//             buckets three consecutive layers of a chunk touch. A window is readied (its previous holder's
//             reduction waited for, then zeroed) two layers ahead of the backward (BeforeBackward, then each
//             OnLayerDone), since a layer's backward also writes the next layer's residual-branch bias
//             gradients; so a layer's reduction overlaps with the next layer's backward. A window is
//             reduce-scattered straight into the bucket's shard (from the step's second reduction of the
//             bucket on, the shard is first added into this rank's share of the window). Deferred buckets
//             (sequence parallelism's partial sums, a tied wte across stages) hold their gradient for the
//             whole step in buffers of their own (reduced through staging in FinishBackward), as does a wte
//             tied at pp 1 (the head's backward writes it first, the embedding's last: a window of its own).
//   bf16      with zero >= 1 on a model that keeps bf16 weight copies (model::Gpt::keeps_bf16_weights), the
//   gathers   all-gather moves the bf16 copies of the weights a step reads only in bf16 (Gpt::Bf16OnlyInStep),
//             which the optimizer writes with the update, as Megatron-LM's distributed optimizer gathers its
//             bf16 parameters: half the bytes, no fp32 copy and no cast after it. The other parameters of a
//             bucket (norms, biases, embeddings) are gathered in fp32 beside it, packed. The fp32 values of
//             the bf16-gathered weights are then current only where owned: WaitAllParams (before evaluation,
//             checkpoints, the end) gathers them in fp32 once. The same bits as the fp32 gather.
//             MEGASCALE_ZERO_GATHER=fp32 (test hook) keeps the fp32 gather.
//   tied wte  with pp > 1 the first and last stages each hold wte; its gradient is summed over
//             the embedding group before the data-parallel reduction (own bucket, not overlapped).
// Norm accounting: every element counts once over the world (see optim::Segment::count).
// Thread safety: one thread drives it (the training loop).
#pragma once

#include <algorithm>
#include <array>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/comm.h"
#include "core/core.h"
#include "model/model.h"
#include "optim/optim.h"

namespace ms::parallel {

// ---- pipeline schedules --------------------------------------------------------------------

enum class ActionKind { kForward, kBackward };
struct Action {
  ActionKind kind;
  int micro;  // micro-batch index
  int chunk;  // local chunk (virtual stage) index
  bool operator==(const Action&) const = default;
};
// InvalidArgument when interleaving is asked with micro_batches not a multiple of pp.
Result<std::vector<Action>> PipelineSchedule(int pp, int pp_rank, int virtual_stages, int micro_batches);
// Most micro-batches whose forward ran and backward did not yet, per chunk, over the schedule.
int MaxInFlight(const std::vector<Action>& schedule, int virtual_stages);

// The point-to-point plan of one pipeline rank for communicators whose sends and receives run in issue order
// and match in issue order between a pair (NCCL: no tags, a receive blocks the stream until its data arrives).
// Every rank simulates the schedules of all pp ranks in rounds (in a round, each rank runs its next action if its
// input was sent in an earlier round; global chunk g = chunk * pp + rank, forward output to g+1, input gradient
// to g-1). Messages sent in round t are sent and received in one group per rank issued at the end of round t, on
// both sides, in one order (by message id): per pair the n-th send matches the n-th receive, every group of a
// round completes once its peers issue theirs, and a rank only waits for messages of earlier rounds, so the plan
// cannot deadlock. A receive is thereby posted as soon as its message is sent, however much later it is used.
struct P2pMessage {
  bool send;  // this rank sends it, or receives it
  int peer;   // pp rank
  int kind;   // 0 activation, 1 gradient
  int micro;
  int gchunk;  // the receiving global chunk
};
struct P2pPlan {
  std::vector<int> action_round;                // per action of this rank's schedule
  std::vector<std::vector<P2pMessage>> rounds;  // per round: this rank's group (possibly empty), in match order
};
Result<P2pPlan> PipelineP2pPlan(int pp, int pp_rank, int virtual_stages, int micro_batches);

// ---- data parallelism ----------------------------------------------------------------------

struct DataParallelOptions {
  int zero = 0;                     // 0, 1, 2
  int64_t bucket_floats = 1 << 20;  // ~4 MB buckets
  bool overlap = true;              // false: every reduction waited at once (for measurements)
  // Where the communicator can (comm::Communicator::waits_on_device: NCCL), the training step's collectives are
  // waited for on the device — the backend's stream waits, the host goes on queueing — and FinishBackward drains
  // them. False (a traced run: its spans end when the host saw each collective complete): the host waits for each.
  bool device_waits = true;
  // Called when a collective completes: (what, launch time, time its wait returned), NowSeconds().
  std::function<void(const std::string&, double, double)> on_comm_span;
};

struct CommStats {
  double dp_wait_s = 0;  // time the training thread blocked on data-parallel collectives (device waits: the device's)
  int64_t dp_launched = 0;  // collectives launched
  int64_t dp_launched_during_backward = 0;
};

class DataParallel {
 public:
  // dp may be a group of one; embedding is null unless this rank holds a tied wte and pp > 1.
  static Result<std::unique_ptr<DataParallel>> Create(model::Gpt* gpt, comm::Communicator* dp,
                                                      comm::Communicator* embedding,
                                                      const DataParallelOptions& options);

  // The segments this rank updates, for optim::Optimizer::Create, and where their data is.
  const std::vector<optim::Segment>& segments() const { return segments_; }
  std::vector<optim::SegmentData> segment_data();

  // Start of a training step: zeroes the gradients (ZeRO-2: its deferred buckets' buffers; the windows are zeroed as
  // they are readied) and resets the per-step state. The shards are not zeroed: each step's first reduction of a
  // bucket writes its shard.
  Status BeginStep();
  // Before each backward of local chunk `chunk` (ZeRO-2: readies the gradient windows of its first two layers and
  // of a wte tied at pp 1; nothing otherwise).
  Status BeforeBackward(int chunk);
  // The model's on_layer_done hook during backward of micro-batch `micro` of `num_micro`.
  void OnLayerDone(int layer, int micro, int num_micro);
  // After a backward: returns an error a reduction launched from the hook ran into.
  Status EndMicroBatch(int micro, int num_micro);
  // After the last backward: completes every reduction. Gradients of the owned segments are final.
  Status FinishBackward();
  // After an optimizer step over segment_data() that updated the parameters (not one skipped for a fault): with
  // zero 0 on a model that keeps bf16 weight copies, segment_data() handed the optimizer every parameter's copy
  // (SegmentData::param16) and the model is told they were written (model::Gpt::Bf16WeightsWritten), so the
  // next step casts none. ZeRO's all-gathers write the parameters after the step: there the model casts them.
  void OptimizerStepped();
  // After the optimizer step: starts the all-gathers of updated parameters (zero >= 1).
  Status StartParamGather();
  // Before forward uses `layer`'s parameters (-1 embeddings, L head): waits for its all-gather (on the device
  // where DataParallelOptions::device_waits allows; FinishBackward drains).
  Status WaitParams(int layer);
  // Waits for every outstanding all-gather on the host (before evaluation or checkpoints); after bf16 gathers, then
  // gathers the bf16-gathered weights' fp32 values, so that every parameter's fp32 value is current.
  Status WaitAllParams();
  // Buckets whose all-gather moves bf16 weight copies (0 unless zero >= 1 on a model keeping them), and the floats
  // of other parameters gathered in fp32 beside them (per rank, the most any rank owns), over all buckets.
  int bf16_gather_buckets() const;
  int64_t fp32_beside_bf16_floats() const;
  // Buckets reduced and gathered through staging buffers (zero >= 1; ZeRO-1 stages only the buckets that do not
  // divide evenly by dp), and the floats of every buffer the engine holds beside the model's (staging, shards,
  // the packing of the fp32 parameters gathered beside bf16 copies).
  int staged_buckets() const;
  int64_t buffer_floats() const;
  // ZeRO-2: the gradient windows (the windows of buckets in backward order, not those of their own), and the floats
  // of every gradient buffer: the windows and the deferred buckets' buffers (0 otherwise).
  int gradient_windows() const { return shared_windows_; }
  int64_t gradient_floats() const;

  const CommStats& stats() const { return stats_; }
  void ResetStats() { stats_ = CommStats(); }
  int num_buckets() const { return static_cast<int>(buckets_.size()); }

 private:
  struct Bucket {
    int first = 0, last = 0;     // param index range [first, last]
    int64_t start = 0, end = 0;  // float range in the flat buffers
    int64_t chunk = 0;           // ceil((end-start)/dp): the owned share
    bool even = false;           // end - start == chunk * dp: every rank's share is whole
    // Rank q's share [lo, hi) of the flat range (the last ranks' may be shorter, or empty).
    std::pair<int64_t, int64_t> Share(int q) const {
      return {std::min(start + q * chunk, end), std::min(start + (q + 1) * chunk, end)};
    }
    bool tied = false;  // the tied wte (pp > 1): reduced after backward
    int pending = 0;    // tensors whose gradient is not final yet (this micro-batch)
    // Device memory. staging: dp*chunk floats, rs_out: chunk floats; both empty where the bucket needs no staging
    // (zero 0; ZeRO-1 on an even bucket: reduce-scatter and all-gathers run in place).
    model::DeviceArray<float> staging;
    model::DeviceArray<float> shard;  // chunk floats: the owned reduced gradient (zero >= 1)
    model::DeviceArray<float> rs_out;
    std::unique_ptr<comm::Work> work;
    double launched_at = 0;
    int index = 0;
    bool gather_pending = false;
    // bf16 gathers: the bucket holds weights gathered as their bf16 copies (staging and rs_out then hold bf16).
    bool gather16 = false;
    bool pending16 = false;                           // the pending gather is the bf16 one
    std::vector<std::pair<int64_t, int64_t>> copy16;  // flat [lo, hi) ranges the gathered bf16 copies land in
    // The bucket's other parameters, gathered in fp32 beside them: per rank, its owned parts (flat offset, floats,
    // offset in the packed buffer), beside_count floats a rank (the most any rank owns; 0: none).
    std::vector<std::vector<std::array<int64_t, 3>>> beside_runs;
    int64_t beside_count = 0;
    model::DeviceArray<float> beside_send, beside_recv;  // beside_count, dp * beside_count floats
    std::unique_ptr<comm::Work> beside_work;
    // Where its gradient lives (the float at start): the model's gradient buffer, or under ZeRO-2 its window
    // (`window` >= 0: windows_[window], `ready` while it holds this bucket's gradient of the running micro-batch)
    // or a deferred bucket's own buffer.
    float* grad = nullptr;
    int window = -1;
    bool ready = false;
    bool shard_started = false;  // ZeRO-2: the shard holds this step's sum of earlier micro-batches
  };
  // ZeRO-2: a gradient window — the gradient of the bucket that holds it (zero beyond the bucket, up to the
  // reduce-scatter's dp * chunk floats), reduce-scattered straight into the holder's shard (Launch).
  struct Window {
    model::DeviceArray<float> data;
    int holder = -1;  // the bucket it holds or last held (-1: none)
  };
  DataParallel() = default;
  Status ReadyFor(comm::Communicator& c);
  Status Launch(Bucket& b);
  Status WaitBucket(Bucket& b);
  Status WaitGather(Bucket& b, bool on_device);
  // The fp32 all-gather of b's parameters (launched; WaitGather copies them in).
  Status LaunchGather32(Bucket& b);
  // Waits for `work`: on the device where DataParallelOptions::device_waits allows and `on_device`, else on the host.
  Status WaitWork(std::unique_ptr<comm::Work>& work, bool on_device);
  Status Drain();
  // ZeRO-2: places the model's gradients (windows, deferred buffers; Create).
  Status PlaceGradients();
  // ZeRO-2: b's window, holding b zeroed (its previous holder's reduction waited for); nothing if it already does.
  Status Ready(Bucket& b);
  // ZeRO-2: readies the windows of `layer`'s buckets.
  Status ReadyLayer(int layer);

  model::Gpt* gpt_ = nullptr;
  ops::Backend* be_ = nullptr;  // the model's
  comm::Communicator* dp_ = nullptr;
  comm::Communicator* embedding_ = nullptr;
  DataParallelOptions options_;
  std::vector<Bucket> buckets_;                  // backward order
  std::vector<std::vector<int>> layer_buckets_;  // layer+1 -> buckets holding its tensors
  std::vector<int> param_bucket_;
  std::vector<optim::Segment> segments_;
  std::vector<std::pair<int, int64_t>> segment_home_;  // (bucket, offset in its shard) or (-1, -1) for flat
  // ZeRO-2: the windows (the first shared_windows_ shared in backward order, then those of a bucket of their own),
  // the deferred buckets' buffers, and per local chunk its layers in backward order (layer_pos_: layer + 1 -> its
  // index there).
  std::vector<Window> windows_;
  int shared_windows_ = 0;
  std::vector<model::DeviceArray<float>> deferred_grads_;
  std::vector<std::vector<int>> chunk_layers_;
  std::vector<std::pair<int, int>> layer_pos_;  // layer + 1 -> (chunk, index in chunk_layers_[chunk])
  bool in_backward_ = false;
  bool drain_ = false;       // a collective was waited for on the device since the last Drain
  bool fp32_stale_ = false;  // bf16 gathers left non-owned fp32 values of bf16-gathered weights stale
  bool plant_unmarked_ = false, plant_no_refresh_ = false;  // test hooks (MEGASCALE_PLANT, parallel.cpp)
  Status pending_error_;
  CommStats stats_;
};

}  // namespace ms::parallel
