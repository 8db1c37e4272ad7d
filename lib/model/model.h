// The GPT: parameters, hand-written forward and backward of every layer, loss — sharded for
// tensor, sequence and pipeline parallelism.
//
// Architecture (GPT-2 style, see docs/ARCHITECTURE.md):
//   x0 = wte[tokens] + wpe[positions]                      learned absolute positions
//   parallel block:   x = x + attn(ln1(x)) + mlp(ln1(x))   (one LayerNorm feeds both branches,
//                                                          as GPT-J / PaLM / MegaScale)
//   sequential block: x = x + attn(ln1(x)); x = x + mlp(ln2(x))
//   attn: causal self-attention, optional sliding window (each token sees at most `window`
//         tokens, itself included); qkv fused, rows ordered (q heads, k heads, v heads)
//   mlp:  fc (C -> F), GeLU (tanh), proj (F -> C)
//   logits = lnf(x) @ wte^T (tied; a separate lm_head when tied_embeddings is false)
//   loss = mean softmax cross-entropy over the tokens of the global batch
//
// Tensor parallelism (Megatron-style; tp ranks hold 1/tp of the heads and of the MLP width):
//   qkv, fc      column-parallel: Y = X A, A split by output rows     (input: f = identity fwd,
//                                                                       all-reduce bwd)
//   attn.proj,   row-parallel:    Y = X A, A split by input columns    (output: g = all-reduce fwd,
//   mlp.proj                                                            identity bwd)
//   With the parallel block the attention and MLP partial sums are added before ONE all-reduce
//   per layer (and ONE in backward for the LayerNorm input gradient); the sequential block needs
//   two. Row-parallel biases are added once, after the reduction.
//   wte is vocab-parallel: each rank holds V/tp rows; the embedding sums the ranks' lookups and
//   the loss is a vocab-parallel softmax cross-entropy (max, sum-exp and target logit reduced
//   across tp): no rank ever holds the full logits.
// Sequence parallelism (sequence_parallel): the residual stream, LayerNorms and biases work on
//   a 1/tp slice of the B*T rows; an all-gather precedes the column-parallel GEMMs and a
//   reduce-scatter follows the row-parallel ones (the conjugates in backward). Replicated
//   parameters then get partial gradients, summed across tp by ReduceSequenceParallelGrads().
// Chunked TP communication (tp_comm_chunks = k > 1, MegaScale §3.2): every TP collective that
//   feeds or follows a GEMM is split into k row chunks pipelined with the GEMM rows they feed or
//   come from. All-gather (SP, forward before qkv/fc/head, backward of dres before attn.proj/
//   mlp.proj): the gather of chunk j+1 is in flight while the GEMMs run on chunk j (one GEMM per
//   rank's block of chunk j rows, straight into their rows of the output). Reduce-scatter (SP)
//   and all-reduce (plain TP) after row-parallel GEMMs (forward attn.proj/mlp.proj and the
//   embedding, backward the column-parallel input gradients and the head's): the GEMM rows of
//   chunk j are computed into a buffer laid out as the collective expects and reduced while the
//   rows of chunk j+1 are computed. Rows of a GEMM are independent, so results change only by
//   rounding: weight gradients accumulate over the row blocks, and oneDNN's sgemm rounds blocks of
//   fewer than 16 rows differently (from 16 rows on, the rows are bit-identical). k = 1 is the
//   unchunked path. Staging: two buffers of tp * ceil(rows / k) rows (SP); all-reduces work in place.
// Pipeline parallelism: the layers are cut into pp * virtual_stages chunks; global chunk
//   s = c * pp + pp_rank is this rank's local chunk c. The first chunk also holds the
//   embeddings, the last the final norm and the head (a tied wte is replicated there and kept
//   equal by summing its gradient over the embedding group, see tied_replica).
//
// Initialization draws each GLOBAL tensor from Rng(seed, tensor id) and keeps this rank's
// shard, so every layout starts from identical weights.
//
// Memory: parameters and gradients are two flat buffers (param_data(), grad_data()) of
// num_params() floats with tensors at fixed, 64-byte aligned offsets — unless the gradients are placed
// (ShardSpec::placed_grads, PlaceGradients: ZeRO-2's gradient windows), where no flat gradient buffer exists.
// Activations live per (chunk, slot): a slot holds one micro-batch between its forward and its backward, so a pipeline
// schedule keeps several in flight. Thread safety: one thread drives a Gpt; ops use OpenMP inside.
#pragma once

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "comm/comm.h"
#include "config/config.h"
#include "core/core.h"
#include "device/device.h"
#include "ops/ops.h"

namespace ms::model {

// How a parameter is split across tensor-parallel ranks.
enum class ShardKind {
  kReplicated,  // every TP rank holds it whole (LayerNorm, row-parallel biases, wpe)
  kRows,        // split along dim 0 (column-parallel weights [out, in] and biases, vocab rows of wte)
  kCols,        // split along dim 1 (row-parallel weights [out, in])
  kQkvRows,     // fused qkv [3C, ...]: each of the q, k, v row blocks split by heads
};

struct ParamInfo {
  std::string name;                   // e.g. "layers.3.attn.qkv.weight" (see docs/ARCHITECTURE.md)
  std::vector<int64_t> global_shape;  // shape of the full tensor
  std::vector<int64_t> local_shape;   // shape of this rank's shard
  ShardKind shard = ShardKind::kReplicated;
  int64_t offset = 0;         // into param_data()/grad_data(), floats
  int64_t numel = 0;          // local
  bool weight_decay = false;  // matrices and embeddings decay; biases and norms do not
  int layer = -1;             // transformer layer, -1 for embeddings / final norm / head
  int chunk = 0;              // local pipeline chunk holding it
  bool tied_replica = false;  // the last stage's copy of a tied wte (pp > 1): not an independent tensor
  bool sp_partial = false;    // gradient is a partial sum over tp ranks under sequence parallelism
};

struct ShardSpec {
  int tp_size = 1, tp_rank = 0;
  int pp_size = 1, pp_rank = 0;
  int virtual_stages = 1;
  bool sequence_parallel = false;
  int tp_comm_chunks = 1;  // row chunks of each TP collective pipelined with its GEMMs; clamped to the rows
  // parallel.tp_reduce_dtype: bf16 — the layers' TP sums (TpProduceRowsReduce: each row-parallel GEMM's output, each
  // LayerNorm-output gradient of the column-parallel GEMMs; not the vocab-parallel embedding's, nor the loss's or the
  // sequence-parallel parameter gradients') go over the communicator in bf16 (Communicator::AllReduce16 /
  // ReduceScatter16): each rank's fp32 partial rounded to bf16 (Backend::RoundBf16), summed with bf16 additions, and
  // the sum widened back (Backend::WidenBf16) — or, with bf16 activations (Gpt::FusedTpSums16), the partials written
  // in bf16 by their GEMMs and the sums read in bf16, without either pass. No-op at tp 1.
  bool tp_reduce_bf16 = false;
  // Fused epilogues (the fc bias inside the GeLU, the row-parallel biases inside the residual add); false runs
  // each as a pass of its own, to measure what fusion buys (runtime.fused_kernels).
  bool fused_kernels = true;
  // runtime.activations: bf16 — the fc GEMM writes its output (the MLP's pre-GeLU activation, the largest one kept
  // for the backward) rounded to bf16, which the fused bias + GeLU reads forward and backward, and the fc
  // projection's backward GEMM writes the GeLU output's gradient rounded to bf16, which the bias + GeLU backward
  // reads (ops::Backend::bf16_activations; needs fused_kernels).
  bool bf16_fc = false;
  // With bf16_fc and kept bf16 operands: the fc bias + GeLU in the fc GEMM's epilogue and their gradient in the fc
  // projection's backward GEMM's (ops::Backend::gemm_gelu_epilogue; runtime.gemm_epilogues).
  bool gemm_epilogues = true;
  // The parameters' gradients live where the caller places them (PlaceGradients; parallel::DataParallel under
  // ZeRO-2: a few bucket-sized windows reused through backward instead of one gradient per parameter): the model
  // allocates no flat gradient buffer (grad_data() is null) and cannot zero them (ZeroGrad fails).
  bool placed_grads = false;
};

// Communicators the model uses inside a layer (TP). Null when tp_size == 1.
struct ModelComms {
  comm::Communicator* tp = nullptr;
};

// FLOPs of one training step (forward + backward) of one sequence, formula of
// docs/ARCHITECTURE.md: 6 * N_matmul * T + attention 12 * L * C * sum_t(keys seen by t).
double TrainingFlopsPerSequence(const config::ModelSpec& spec);

// Names of every global tensor of the model, in forward order (independent of the layout).
std::vector<std::string> AllTensorNames(const config::ModelSpec& spec);

// Copies this rank's shard of a global tensor (row-major, 1-D or 2-D) into `local`.
void ExtractShard(const float* global, float* local, const std::vector<int64_t>& global_shape, ShardKind kind,
                  int tp_size, int tp_rank);

// n elements of T in memory of a backend's device, zeroed when allocated (moves only).
template <typename T>
class DeviceArray {
 public:
  Status Allocate(ops::Backend* backend, int64_t n) {
    const DType dtype = sizeof(T) == 4 && !std::is_floating_point_v<T> ? DType::kI32 : DType::kF32;
    MS_ASSIGN_OR_RETURN(
        buf_, device::Buffer::Allocate(backend->device(), static_cast<size_t>(std::max<int64_t>(n, 1)), dtype));
    n_ = n;
    return backend->Zero(buf_.data(), buf_.bytes());
  }
  T* data() const { return static_cast<T*>(buf_.data()); }
  int64_t size() const { return n_; }

 private:
  device::Buffer buf_;
  int64_t n_ = 0;
};

class Gpt {
 public:
  // spec must be resolved (ffn_hidden set). micro_batch: sequences per forward call. Parameters, gradients and
  // activations live on `device`; ops run on `backend` (whose device must be `device`; null: the CPU backend, which
  // needs a host device). The backend must outlive the model.
  static Result<std::unique_ptr<Gpt>> Create(const config::ModelSpec& spec, const ShardSpec& shard, int micro_batch,
                                             uint64_t seed, device::Device* device, ModelComms comms = {},
                                             ops::Backend* backend = nullptr);
  ~Gpt();
  Gpt(const Gpt&) = delete;
  Gpt& operator=(const Gpt&) = delete;

  const config::ModelSpec& spec() const { return spec_; }
  const ShardSpec& shard() const { return shard_; }
  const std::vector<ParamInfo>& params() const { return params_; }
  const ParamInfo* FindParam(const std::string& name) const;
  float* param_data() const { return params_buf_.f32(); }
  float* grad_data() const { return grads_buf_.f32(); }  // null with ShardSpec::placed_grads
  // Where parameter i's gradient lives: grad_data() + its offset, or where PlaceGradients put it.
  float* grad(size_t i) const { return grad_ptrs_[i]; }
  // ShardSpec::placed_grads: every parameter's gradient at where[i] (numel floats; the tensors under sequence
  // parallelism's partial sums, sp_partial, contiguous at their offsets' distances: ReduceSequenceParallelGrads
  // reduces them as one range). Before the first backward; the caller zeroes them and keeps them alive.
  Status PlaceGradients(const std::vector<float*>& where);
  int64_t num_params() const { return num_params_; }
  int micro_batch() const { return B_; }

  // Pipeline structure of this rank.
  int num_chunks() const { return static_cast<int>(chunks_.size()); }
  int global_chunk(int chunk) const { return chunks_[chunk].global; }
  bool has_embedding(int chunk) const { return chunks_[chunk].embedding; }
  bool has_head(int chunk) const { return chunks_[chunk].head; }
  // Floats of the activation (or its gradient) crossing a pipeline boundary: rows x hidden.
  int64_t boundary_floats() const { return rows_ * spec_.hidden; }

  Status ZeroGrad();
  ops::Backend* backend() const { return be_; }

  // Forward of local chunk `chunk` for the micro-batch held in `slot`.
  //   embedding chunk: reads `inputs` [B, T]; otherwise `x_in` [rows, C] (the previous stage's output).
  //   head chunk: needs `targets` [B, T]; returns the mean loss over the B*T tokens.
  //   other chunks return 0; their output is ChunkOutput(chunk, slot).
  // `before_layer(layer)` runs before each layer uses its parameters (-1: embeddings, layers: head):
  // the hook where a ZeRO all-gather of the updated parameters is waited for (prefetch).
  Result<float> ForwardChunk(int chunk, int slot, const int32_t* inputs, const int32_t* targets, const float* x_in,
                             const std::function<Status(int)>& before_layer = {});
  const float* ChunkOutput(int chunk, int slot) const;
  // Backward of the same: `dout` [rows, C] is the gradient of the chunk output (ignored for
  // the head chunk, which starts from the loss with per-token weight `dloss`). Gradients
  // ACCUMULATE into grad_data(); the input gradient is InputGrad(chunk, slot) (not for the
  // embedding chunk). `on_layer_done(layer)` runs after each layer's parameter gradients are final
  // for this call (and with layer -1 after the embeddings): the hook for overlapping DP reductions.
  Status BackwardChunk(int chunk, int slot, const float* dout, float dloss,
                       const std::function<void(int)>& on_layer_done = {});
  const float* InputGrad(int chunk, int slot) const;

  // Deferred losses: between BeginDeferredLosses(n, dloss) and TakeDeferredLosses(), the head chunk's forward
  // leaves each micro-batch's per-token losses on the device (one device-to-device copy; ForwardChunk returns 0
  // for the head) instead of copying them to the host, which waits for the stream, once per micro-batch.
  // TakeDeferredLosses() copies them to the host once and returns each micro-batch's mean loss, in the order
  // the head ran them: the same sums as ForwardChunk's, so bit-identical. At most n head forwards in between.
  // dloss > 0: the per-token weight the head backward will get; at tp 1 the forward then computes the loss
  // and the logits' gradient in one pass (Backend::CrossEntropyFused, bit-identical), and BackwardChunk must be
  // called with that dloss. 0: the loss only.
  Status BeginDeferredLosses(int micro_batches, float dloss = 0.0f);
  Result<std::vector<float>> TakeDeferredLosses();

  // A training step's micro-batches run between BeginStep() and EndStep(). In between, the parameters must not
  // change except before a layer's first use in the step (its before_layer hook: ZeRO's gathers): on backends
  // that keep bf16 GEMM operands (ops::Backend::keeps_bf16_copies()) each weight is rounded to bf16 once per
  // step, at its first use, instead of at every GEMM. Forwards and backwards outside a step round at every GEMM.
  // Inside a step the tensor-parallel collectives are waited for on the device where the communicator can
  // (comm::Communicator::waits_on_device: NCCL; untraced runs): the host queues the next ops without waiting, and
  // EndStep drains them — it returns their failure (a timeout, a peer's failure) before anything reads the step's
  // results. Outside a step (evaluation, tests) the host waits for each.
  void BeginStep();
  Status EndStep();
  // The bf16 weight copies may instead be written by the optimizer step before BeginStep, with the update
  // (ops::AdamWTensor::p16, optim::SegmentData::param16): keeps_bf16_weights() says whether the model keeps them;
  // bf16_param_data() is where (bf16 at the parameters' offsets in param_data(); null where none are kept).
  // Bf16WeightsWritten() declares that the step just run wrote the rounding of EVERY parameter there, so the next
  // BeginStep takes them as made and casts none; whatever writes the parameters in between (a checkpoint restore)
  // calls InvalidateBf16Weights(). bf16_weight_casts(): the weight casts run so far (for tests).
  bool keeps_bf16_weights() const { return keep_bf16_; }
  void* bf16_param_data() const;
  void Bf16WeightsWritten();
  void InvalidateBf16Weights();
  int64_t bf16_weight_casts() const { return bf16_weight_casts_; }
  // ZeRO's parameter all-gather (parallel::DataParallel) may move a weight's bf16 copy in place of its fp32 value
  // where that copy is all a training step reads of it. Bf16OnlyInStep(i): such a parameter (with
  // keeps_bf16_weights(): the layers' four GEMM weights, an untied head's). Bf16CastInStep(i): one whose copy the
  // step casts from its fp32 value, which it also reads (a tied wte: the head's GEMM and the embedding lookup).
  // Bf16WeightWritten(i): parameter i's copy will be written before the next step's first use of it by something
  // other than a cast (the gather), so that step casts none of it; outside a step its fp32 value must be made
  // current again before anything reads it (DataParallel::WaitAllParams).
  bool Bf16OnlyInStep(int param) const;
  bool Bf16CastInStep(int param) const;
  void Bf16WeightWritten(int param);
  // The activations this model keeps in bf16 (runtime.activations: bf16), for the log: "fc output, GeLU output
  // gradient, logits, qkv, attention output gradient, attention output" as they apply (logits at tp 1; qkv and the
  // attention output's gradient with the tensor-core attention, the attention output also with kept operands); empty
  // when none.
  std::string bf16_activations() const;

  // Single-chunk convenience (pp == 1): forward + loss of slot 0, and its backward.
  Result<float> Forward(const int32_t* inputs, const int32_t* targets) {
    return ForwardChunk(0, 0, inputs, targets, nullptr);
  }
  Status Backward(float dloss) { return BackwardChunk(0, 0, nullptr, dloss); }

  // Under sequence parallelism: sums the partial gradients of replicated tensors across tp.
  Status ReduceSequenceParallelGrads();

  // CUDA graphs (runtime.cuda_graphs; graphs.cpp): each micro-batch slot's forward and backward ops recorded once as
  // graphs (ops::Backend::BeginCapture) and launched again at every later micro-batch of that slot, in place of
  // hundreds of kernel launches and GEMM calls. The host's part stays outside the graphs — token and target uploads,
  // the losses' copy, the hooks — so the graphs see the same pointers every time. A pass is recorded in segments cut
  // at its hooks (before_layer, on_layer_done): a launch runs segment, hook, segment, hook, ... in the order the ops
  // meet them, so a ZeRO parameter gather is still waited for just before its layer and a data-parallel bucket still
  // leaves as soon as its layer's gradients are final. The forward is always cut at its layers (each layer's bf16
  // weight copies for the step are made there, outside the graphs); a backward given no hook is one graph. A slot's
  // pass first runs eagerly (allocating the workspaces its ops need), is recorded at its next call, and recorded again
  // when what it was recorded for changes (the loss weight, a workspace the backend replaced). Graphs apply to the
  // training micro-batches (between BeginStep and EndStep) on a backend that records graphs — a pipeline stage's
  // received activations or gradient copied into the slot's buffers ahead of its graphs; at tp > 1 where the
  // tensor-parallel communicator waits on the device (NCCL: its collectives recorded in the graphs, each launch
  // watched by Communicator::WatchCompute) and the run is not traced —; elsewhere the ops
  // run as before. A capture that fails (an op that waits for the device or uploads inside it) turns graphs off for
  // the rest of the run, with its reason in graph_stats().failure, and the ops run eagerly.
  // EnableGraphs returns why graphs cannot apply to this model at all ("" where they can).
  std::string EnableGraphs(bool on);
  struct GraphStats {
    int64_t captures = 0;  // passes recorded
    int64_t segments = 0;  // graphs they were recorded in (the last recording of each pass)
    int64_t ops = 0;       // operations in them
    int64_t launches = 0;  // forwards and backwards run by launching their graphs
    int64_t eager = 0;     // forwards and backwards of graph-enabled slots run without (warm-up, recaptures)
    std::string failure;   // the first capture failure (graphs then off)
  };
  const GraphStats& graph_stats() const { return graph_stats_; }

  // Timeline hook (e.g. the Chrome trace; null: none): called with (name, lane, start, end) in
  // NowSeconds() for every TP collective ("tp ...", lane "tp": from its launch to the return of
  // the Wait that completed it) and every GEMM step that feeds or drains one ("gemm ...", lane
  // "tp-gemm": host-side time of issuing the ops of one chunk, or of all rows when unchunked).
  using SpanHook = std::function<void(std::string_view name, std::string_view lane, double start, double end)>;
  void set_span_hook(SpanHook hook) { span_ = std::move(hook); }

 private:
  struct Chunk {
    int global = 0;  // global chunk index
    int first_layer = 0, num_layers = 0;
    bool embedding = false, head = false;
  };
  struct Acts;
  struct LayerW;
  struct LayerBf16;

  Gpt() = default;
  Status Init(uint64_t seed);
  void AddParam(const std::string& name, std::vector<int64_t> shape, ShardKind kind, bool decay, int layer, int chunk);
  Result<Acts*> SlotActs(int chunk, int slot);
  LayerW Layer(int l) const;
  // Collective helpers over tp (no-ops at tp 1).
  Status TpCollectiveReady();
  Status TpAllReduce(float* x, int64_t n, comm::ReduceOp op, std::string_view what);
  // Waits for a TP collective (`op` of `what`, chunk `chunk` of `chunks`) launched at `posted`;
  // reports its span and names it in an error.
  Status TpWait(comm::Work& work, std::string_view op, std::string_view what, int chunk, int chunks, double posted);
  // A step of row work over rows [row0, row0 + rows) of the [N, ...] tensors: a consumer reads
  // those rows of the gathered input at `src` (rows x C, contiguous); a producer writes (or
  // accumulates) their partial output to `dst` (rows x C, contiguous).
  using ConsumeFn = std::function<Status(int64_t row0, int64_t rows, const float* src)>;
  using ProduceFn = std::function<Status(int64_t row0, int64_t rows, float* dst)>;
  // Gathers `local` [rows_, C] into the [N, C] rows and runs `consume` on them; chunked into
  // tp_comm_chunks pipelined steps under SP. `full` [N, C] receives the gathered tensor when
  // keep_full (else it is scratch for the unchunked path). Without SP, consume(0, N, local).
  // out = x + part + bias (+ bias2), fused or not (ShardSpec::fused_kernels).
  Status ResidualAdd(float* out, const float* x, const float* part, const float* bias, const float* bias2, int64_t R,
                     int64_t C);
  // res = x + part + bias (+ bias2) over the rows_ x C residual stream, then the LayerNorm of res into out / mean /
  // rstd / out16: one kernel with the fused kernels (Backend::ResidualLayerNormForward), else the ablation's passes.
  Status ResidualLayerNorm(float* res, const float* x, const float* part, const float* bias, const float* bias2,
                           float* out, float* mean, float* rstd, const float* w, const float* b, void* out16);
  // With `full16` (only under SpGather16): this rank's rows are already rounded into the [N, C] bf16 tensor
  // full16 (at tp_rank * rows_), the gather fills in the other ranks' rows in bf16 (Communicator::AllGather16, in
  // place unchunked), and `consume` gets src = null: it reads the rows' rounding in full16 (Bf16Copies::inp / dout).
  Status TpGatherRowsThen(std::string_view what, const float* local, float* full, bool keep_full,
                          const ConsumeFn& consume, void* full16 = nullptr);
  // The gather of both (T = float, uint16_t): `local` [rows_, C] of every rank into `full` [N, C], unchunked, or in
  // sp_chunks_ chunks through the two `stage` buffers, each rank block copied to its rows of `full` when `copy` (but
  // rank `keep`'s, already there) and consumed from there, else from the stage; `consume` gets the rows as src when
  // pass_src, else null. `op` names the collective in spans and errors.
  template <typename T>
  Status TpGatherLoop(std::string_view op, std::string_view what, const T* local, T* full, T* stage, bool copy,
                      int keep, bool pass_src, const ConsumeFn& consume);
  // Runs `produce` for partial outputs of all N rows (it writes every row: a producer that accumulates writes its
  // first term with MatmulBackward's dinp_overwrite) and reduces them across tp, chunked and pipelined likewise:
  // returns `local` [rows_, C] under SP (reduce-scatter), else `full` [N, C] (all-reduce in place).
  // With ShardSpec::tp_reduce_bf16 the sums go in bf16, unless may_bf16 is false (the vocab-parallel embedding's).
  Result<float*> TpProduceRowsReduce(std::string_view what, const ProduceFn& produce, float* full, float* local,
                                     bool may_bf16 = true);
  // A producer that writes its partial output rows in bf16 (a GEMM's Bf16Copies::out16 / dinp16).
  using ProduceFn16 = std::function<Status(int64_t row0, int64_t rows, uint16_t* dst16)>;
  // A sum over tp: in fp32 (f32), or in bf16 (b16: the bf16 sum in red16_, this rank's rows_ x C, valid until the
  // next reduction; read by the bf16-input kernels in place of the widened copy).
  struct TpSum {
    float* f32 = nullptr;
    const uint16_t* b16 = nullptr;
  };
  // TpProduceRowsReduce with the partials written in bf16 by `produce16` where the sums go in bf16 (FusedTpSums16):
  // no rounding pass before the collective, no widening after it; else `produce` in fp32 as above.
  Result<TpSum> TpProduceRowsReduceTo(std::string_view what, const ProduceFn& produce, const ProduceFn16& produce16,
                                      float* full, float* local);
  // Both: produce16, unless null, where the sums go in bf16.
  Result<TpSum> TpReduce(std::string_view what, const ProduceFn& produce, const ProduceFn16* produce16, float* full,
                         float* local, bool may_bf16);
  void GemmSpan(std::string_view what, int chunk, int chunks, double start);  // reports a GEMM step's span
  Status HeadForward(Acts& a, const float* x);
  Result<float> HeadLoss(Acts& a);
  Status ForwardInputs(int chunk, Acts& a, const int32_t* inputs, const int32_t* targets, const float* x_in);
  Status ForwardCompute(int chunk, Acts& a, const float* x_in, const std::function<Status(int)>& before_layer);
  Status BackwardCompute(int chunk, Acts& a, const float* dout, float dloss,
                         const std::function<void(int)>& on_layer_done);
  // Graphs (graphs.cpp).
  bool GraphsApply(int chunk) const;
  Status ForwardGraphed(int chunk, int slot, Acts& a, const float* x_in,
                        const std::function<Status(int)>& before_layer);
  Status BackwardGraphed(int chunk, int slot, Acts& a, const float* dout, float dloss,
                         const std::function<void(int)>& on_layer_done);
  Status CastKeptWeights(int layer);  // the step's bf16 copies of a layer's weights (spec_.layers: the head's)
  using Hook = std::function<Status(int)>;
  struct SlotGraph {
    struct Segment {
      std::unique_ptr<ops::Backend::OpGraph> graph;
      bool hook = false;  // the pass's hook follows, with `arg`
      int arg = 0;
    };
    std::vector<Segment> segments;  // empty: not recorded
    uint64_t cond = 0;              // what the pass was run or recorded for (loss weights)
    bool warm = false;              // the pass has run eagerly with `cond`
    bool dlogits_ready = false;     // host state the pass leaves, restored after each launch
    float dlogits_weight = 0.0f;
  };
  // Runs a pass (`body`, given the hook it calls) as graph `g`: launched where it was recorded for the same `cond`,
  // recorded (then launched) where it ran eagerly once with it, else run eagerly; `hook` (may be empty) runs where
  // the pass calls it — before the segment that follows (hooks_lead: the forward's) or after the one before. True:
  // an earlier recording was launched (the body did not run, so the caller restores the host state it leaves).
  Result<bool> RunGraphed(SlotGraph& g, const char* what, uint64_t cond, const Hook& hook, bool hooks_lead,
                          const std::function<Status(const Hook&)>& body);
  Status LaunchSegments(const SlotGraph& g, const char* what, const Hook& hook);
  // The bf16 rounding of GEMM weight `p` for the backend's kept operands (null when the backend keeps none): cast
  // into the mirror bf16_params_ at its first use in a step (BeginStep .. EndStep) and reused for the rest of the
  // step; outside a step cast at every call.
  Result<const void*> KeptWeight(const ParamInfo* p);
  Result<LayerBf16> KeptLayer(const LayerW& w, const Acts& a, int i);  // layer i of a chunk's activations a
  // The rounding of dres for the GEMMs (null: nothing kept): [N, C] bf16, whose rows the LayerNorm backwards write
  // at Dres16Mine() (this rank's rows: all of them without sequence parallelism; under it the rest come from the
  // bf16 all-gather of SpGather16).
  void* Dres16() const;
  void* Dres16Mine() const;
  // Kept bf16 operands under sequence parallelism (tp > 1): the column-parallel GEMMs' inputs (the LayerNorm outputs)
  // and the row-parallel backward GEMMs' output gradient (dres) are all-gathered in bf16 — each rank's producer
  // rounds its own rows into the [N, C] bf16 tensor, the gather fills in the others' (Communicator::AllGather16):
  // half the bytes of gathering fp32 rows, no fp32 [N, C] copy kept for the backward, and the same bits as rounding
  // the gathered fp32 rows at the GEMM (which `cast`, without kept operands, still does).
  bool SpGather16() const { return keep_bf16_ && shard_.sequence_parallel && shard_.tp_size > 1; }
  // `a` (bf16 [N, C]) where it is gathered in bf16 (SpGather16), else null: TpGatherRowsThen's full16.
  void* Gathered16(const DeviceArray<float>& a) const { return SpGather16() ? static_cast<void*>(a.data()) : nullptr; }
  // This rank's first row of an [N, C] tensor: under sequence parallelism it holds rows tp_rank * rows_ .. (+ rows_).
  int64_t LocalRow0() const { return shard_.sequence_parallel && shard_.tp_size > 1 ? shard_.tp_rank * rows_ : 0; }
  // Kept bf16 operands (keep_bf16_) whose producers write the rounding of every row the GEMMs read: the LayerNorms
  // (under sequence parallelism this rank's rows, the rest gathered in bf16: SpGather16) and the fused bias + GeLU.
  // Their fp32 outputs then feed nothing and are neither allocated nor written.
  bool RoundedLn() const { return keep_bf16_; }
  bool RoundedGelu() const { return keep_bf16_ && shard_.fused_kernels; }
  // The attention adds the qkv bias as it loads q, k, v (the backend takes it for head dimension D; a fused
  // epilogue, off in the runtime.fused_kernels: false ablation): the qkv GEMM then adds none.
  bool QkvBiasInAttention(int64_t D) const { return shard_.fused_kernels && be_->attention_adds_qkv_bias(D); }
  // With the attention's inputs in bf16 (Bf16AttnIO) and the GEMM epilogues (runtime.gemm_epilogues, ops::Backend::
  // gemm_gelu_epilogue): the qkv GEMM adds the bias in its epilogue as it writes qkv in bf16 (Bf16Copies::out16 with
  // the bias), and the attention kernels read q, k and v as they are — where they added it they did so to every K
  // and V tile each query block loads (and to the Q tiles of the dK/dV kernel): at T = 1024, causal, 8.5 times per
  // key row in the forward. The attention backward still sums the bias gradient (QkvBiasInAttention).
  bool QkvBiasInGemm(int64_t D) const { return Bf16AttnIO(D) && shard_.gemm_epilogues && be_->gemm_gelu_epilogue(); }
  // The backward's fp32 output gradients that something reads (else neither written nor given scratch): the fc
  // output's (not when the fused bias + GeLU backward keeps only its rounding and sums the bias gradient) and qkv's
  // (not when the attention keeps only its rounding and sums the qkv bias gradient as it stores it).
  bool Dfch32() const { return !(keep_bf16_ && shard_.fused_kernels); }
  bool Dqkv32(int64_t D) const { return !(keep_bf16_ && QkvBiasInAttention(D)); }
  // The bias gradients of the residual branches (attn.proj's, mlp.proj's: their output gradient is the residual
  // gradient dres) are summed by the LayerNorm backward that writes dres (a fused epilogue, off in the
  // runtime.fused_kernels: false ablation, which runs BiasGrad passes over dres).
  bool BiasGradsInLn() const { return shard_.fused_kernels; }
  // ShardSpec::bf16_fc: the fc output (y.fch) holds bf16, written by the fc GEMM; in the backward its GeLU's output
  // gradient (dfch_gelu) is bf16 too, written by the fc-proj GEMM (Bf16Copies::dinp16).
  bool Bf16Fc() const { return shard_.bf16_fc; }
  // runtime.activations: bf16 at tp 1: the classifier writes the logits in bf16 (no fp32 logits; the padding kept out
  // of the softmax by the cross-entropy, not by a bias) and the cross-entropy writes their gradient over them.
  bool Bf16Logits() const { return Bf16Fc() && shard_.tp_size == 1; }
  // runtime.activations: bf16 with the tensor-core attention (the qkv bias in it): the attention's inputs are bf16
  // (ops::Backend::AttentionForward16 / AttentionBackward16) — the qkv GEMM writes qkv in bf16 (y.qkv holds bf16, no
  // fp32 qkv), the attention projection's backward GEMM its input gradient (datty's scratch holds bf16), and the
  // backward reads the attention output rounded to bf16 (with kept operands its kept rounding, and then no fp32
  // attention output is written or held: Atty32).
  bool Bf16AttnIO(int64_t D) const { return Bf16Fc() && QkvBiasInAttention(D); }
  // runtime.activations: bf16 at tp 1: the LayerNorm input gradients that one GEMM writes alone — the sequential
  // block's (the fc and qkv backward GEMMs') and the final LayerNorm's (the classifier's) — are written in bf16
  // (Bf16Copies::dinp16, in the fp32 gradient's scratch) and read so by the LayerNorm backward
  // (ops::Backend::LayerNormBackward16). The parallel block's LayerNorm gets the sum of two GEMMs: fp32.
  bool Bf16LnGrad() const { return Bf16Fc() && shard_.tp_size == 1; }
  // runtime.activations: bf16 at tp 1 with the sequential block: the attention and MLP output projections write their
  // outputs in bf16 (Bf16Copies::out16, in the fp32 output's scratch) and the residual add (fused into the next
  // LayerNorm, or alone before the chunk's end) reads them so (ResidualLayerNormForward16 / ResidualAdd16). In the
  // parallel block the MLP projection accumulates onto the attention projection's fp32 output: fp32.
  bool Bf16BranchOut() const {
    return Bf16Fc() && shard_.tp_size == 1 && spec_.block == config::BlockKind::kSequential;
  }
  // runtime.activations: bf16 at tp > 1 with parallel.tp_reduce_dtype: bf16 — the same for the sums over tp: the
  // row-parallel projections of the sequential block (forward), the column-parallel fc and qkv GEMMs of the
  // sequential block and the vocabulary-parallel classifier (backward) write their partial outputs in bf16 straight
  // into the collective's buffer, and the residual add + LayerNorm (forward) and the LayerNorm backwards read the bf16
  // sum (TpProduceRowsReduceTo): the same bits as rounding an fp32 partial (Backend::RoundBf16) and widening the sum
  // (WidenBf16), without those two passes. Test hook MEGASCALE_TP_SUMS16=unfused: the two passes instead.
  bool FusedTpSums16() const { return Bf16Fc() && shard_.tp_size > 1 && shard_.tp_reduce_bf16 && !unfused_sums16_; }
  bool Atty32(int64_t D) const { return !(keep_bf16_ && Bf16AttnIO(D)); }
  // The scratch of the attention output's gradient, in floats: N x HlD fp32, or with Bf16AttnIO bf16 (rounded up to 256
  // bytes, so that what follows keeps its alignment).
  int64_t DattyFloats(int64_t D) const {
    const int64_t n = N_ * Hl_ * D;
    return Bf16AttnIO(D) ? ((n + 1) / 2 + 63) / 64 * 64 : n;
  }
  // The fc bias + GeLU run in the fc GEMM's epilogue and their gradient in the fc-proj backward GEMM's (Bf16Copies::
  // gelu16 / dgelu_aux16, ops::Backend::gemm_gelu_epilogue): fch then holds the GeLU input with its bias, and the
  // GeLU output's gradient is never stored.
  bool GeluInGemm() const { return Bf16Fc() && shard_.gemm_epilogues && RoundedGelu() && be_->gemm_gelu_epilogue(); }
  int64_t DfchGeluFloats() const {  // the GeLU output gradient's scratch, in floats
    return GeluInGemm() ? 0 : Bf16Fc() ? (N_ * Fl_ + 1) / 2 : N_ * Fl_;
  }
  Result<const float*> LossWeights(float dloss);  // [N] copies of dloss on the device (uploaded when it changes)
  // The final LayerNorm backward writes dres; dsum / dsum2 (the last layer's residual-branch bias gradients, or
  // null): += its column sums (ops::Backend::LayerNormBackward).
  Status HeadBackward(Acts& a, float dloss, float* dres, float* dsum, float* dsum2);

  config::ModelSpec spec_;
  ShardSpec shard_;
  ModelComms comms_;
  int B_ = 0;
  int64_t N_ = 0;                     // B * T rows of a micro-batch
  int64_t rows_ = 0;                  // rows of the residual stream on this rank (N, or N / tp under SP)
  int64_t Hl_ = 0, Fl_ = 0, Vl_ = 0;  // local heads, MLP width, vocab rows
  device::Device* device_ = nullptr;
  std::vector<ParamInfo> params_;
  std::map<std::string, size_t> param_index_;
  int64_t num_params_ = 0;
  std::vector<Chunk> chunks_;
  device::Buffer params_buf_, grads_buf_;
  std::vector<float*> grad_ptrs_;  // per parameter: where its gradient lives (null until placed)
  std::map<std::pair<int, int>, std::unique_ptr<Acts>> acts_;
  ops::Backend* be_ = nullptr;
  std::unique_ptr<ops::Backend> own_be_;
  DeviceArray<float> scratch_;
  // Kept bf16 GEMM operands (ops::Backend::keeps_bf16_copies()): the weights' roundings at the parameters' offsets
  // (2 bytes each, num_params_) and the step each was made in (0: none, recast at the next use). The layer
  // inputs' roundings live in the slots' activations.
  bool keep_bf16_ = false;
  DeviceArray<float> bf16_params_;
  // bf16 roundings of the residual [R, C], fc [N, Fl] and qkv [N, 3 HlD] output gradients (keep_bf16_)
  DeviceArray<float> dres_16_, dfch_16_, dqkv_16_;
  std::vector<uint64_t> bf16_made_in_;
  uint64_t step_id_ = 0;
  bool in_step_ = false;
  bool tp_drain_ = false;               // a tensor-parallel collective was waited on the device since BeginStep
  bool plant_stale_bf16_ = false;       // test hook MEGASCALE_PLANT=kept_bf16_stale
  bool plant_unwritten_bf16_ = false;   // test hook MEGASCALE_PLANT=optimizer_bf16_unwritten
  bool bf16_written_ = false;           // Bf16WeightsWritten() since the last BeginStep
  std::vector<char> bf16_written_one_;  // Bf16WeightWritten(i) since the last BeginStep
  std::vector<char> bf16_only_;         // Bf16OnlyInStep(i)
  int64_t bf16_weight_casts_ = 0;
  DeviceArray<float> logit_mask_;          // [Vl]: 0, or a very negative logit on vocabulary padding columns
  bool masked_logits_ = false;             // this rank's vocabulary slice holds padding (model.vocab_pad_to)
  float fused_dloss_ = 0.0f;               // BeginDeferredLosses' dloss: > 0 fuses the classifier loss
  int deferred_cap_ = 0, deferred_n_ = 0;  // BeginDeferredLosses(cap): head forwards held on the device so far
  DeviceArray<float> deferred_losses_;     // [cap, N]
  std::vector<int32_t> deferred_targets_;  // [n, N]: which tokens count in each micro-batch's mean
  DeviceArray<float> dloss_;               // [N] the head backward's per-token weight, uploaded when it changes
  float dloss_value_ = 0.0f;
  bool dloss_valid_ = false;
  int sp_chunks_ = 1, ar_chunks_ = 1;  // tp_comm_chunks clamped to the rows_ / N rows
  int64_t stage_rows_ = 0;             // rows of one SP chunk stage: tp * ceil(rows_ / sp_chunks_)
  DeviceArray<float> stage_;           // 2 stages (double buffer) of chunked SP collectives
  // bf16 TP sums (ShardSpec::tp_reduce_bf16): red16_rows_ x C bf16 rounded partials (all N rows, or the 2 SP stages),
  // then rows_ x C bf16 of the reduce-scatter's output.
  int64_t red16_rows_ = 0;
  DeviceArray<float> red16_;
  bool unfused_sums16_ = false;  // MEGASCALE_TP_SUMS16=unfused (FusedTpSums16)
  SpanHook span_;
  bool graphs_on_ = false;
  bool plant_graph_not_launched_ = false;  // test hooks (graphs.cpp)
  bool plant_capture_waits_ = false;
  std::map<std::tuple<int, int, bool>, std::unique_ptr<SlotGraph>> graphs_;  // (chunk, slot, backward)
  GraphStats graph_stats_;
};

// ---- inference ---------------------------------------------------------------------------

// Token-by-token inference of the whole (unsharded) GPT on the host, with a KV cache: Step(token)
// appends one token at the next position and returns the logits (V) of what follows it. The math is
// the training forward's (same ops, fp32): learned positions (so at most seq_len positions), the
// block kind, the sliding window (the cache keeps only the last `window` keys and values of each
// layer), tied or separate output head. Recompute() is the same without a cache: it runs the whole
// context again through the same per-token code, for checking the cache (the logits are identical).
// Not thread-safe; one decoder per sequence.
class Decoder {
 public:
  // Reads every tensor of AllTensorNames(spec) in its global shape through `read(name, out, numel)`
  // (e.g. from a checkpoint saved in any layout). spec must have passed config::ResolveAndValidate.
  using TensorReader = std::function<Status(const std::string& name, float* out, int64_t numel)>;
  static Result<std::unique_ptr<Decoder>> Create(const config::ModelSpec& spec, const TensorReader& read);

  // Logits after appending `token` at position position(); OutOfRange past seq_len, InvalidArgument
  // for a token outside the vocabulary.
  Result<std::vector<float>> Step(int32_t token);
  // The logits after the tokens so far, recomputed from the first token without the cache.
  Result<std::vector<float>> Recompute();
  int64_t position() const { return static_cast<int64_t>(tokens_.size()); }
  void Reset();

 private:
  Decoder() = default;
  Status Forward(int32_t token, int64_t pos, std::vector<float>* logits);

  config::ModelSpec spec_;
  std::map<std::string, std::vector<float>> w_;
  std::vector<int32_t> tokens_;
  // Per layer: keys and values of the cached positions, a ring of min(window, seq_len) rows (H * D each).
  std::vector<std::vector<float>> k_, v_;
  int64_t ring_ = 0;  // rows of each layer's cache
};

}  // namespace ms::model
