// The GPT: parameters, hand-written forward and backward of every layer, loss.
//
// Architecture (GPT-2 style, documented in docs/ARCHITECTURE.md):
//   x0 = wte[tokens] + wpe[positions]                  learned absolute positions
//   parallel block:   x = x + attn(ln1(x)) + mlp(ln1(x))   (one LayerNorm feeds both branches,
//                                                          as GPT-J / PaLM / MegaScale)
//   sequential block: x = x + attn(ln1(x)); x = x + mlp(ln2(x))
//   attn: causal self-attention, optional sliding window (each token sees at most `window`
//         tokens, itself included); qkv fused (rows ordered q heads, k heads, v heads)
//   mlp:  fc (C -> F), GeLU (tanh), proj (F -> C)
//   logits = lnf(x) @ wte^T (tied; a separate lm_head when tied_embeddings is false)
//   loss = mean softmax cross-entropy over the tokens of the global batch
//
// Parameters are held "as if sharded": each Param records its global shape and how it is
// split across tensor-parallel ranks (rows, columns, or the q/k/v row blocks of the fused
// qkv weight). Initialization draws the GLOBAL tensor from Rng(seed, param id) and keeps
// this rank's shard, so every layout starts from identical weights. This issue runs
// tp = pp = 1 (a shard is the whole tensor); the 3D-parallelism issue adds the collectives.
//
// Memory: parameters and gradients are two flat buffers (param_data(), grad_data()) of
// num_params() floats, tensors at fixed offsets — what optimizers and checkpoints want.
// Activations for one micro-batch are kept between Forward and Backward.
// Thread safety: one thread drives a Gpt; ops use OpenMP inside.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "core/core.h"
#include "device/device.h"

namespace ms::model {

// How a parameter is split across tensor-parallel ranks.
enum class ShardKind {
  kReplicated,  // every TP rank holds it whole (LayerNorm, row-parallel biases, wpe)
  kRows,        // split along dim 0 (column-parallel weights [out, in], their biases, vocab rows of wte)
  kCols,        // split along dim 1 (row-parallel weights [out, in])
  kQkvRows,     // fused qkv [3C, C]: each of the q, k, v row blocks split by heads
};

struct ParamInfo {
  std::string name;                   // e.g. "layers.3.attn.qkv.weight" (see docs/ARCHITECTURE.md)
  std::vector<int64_t> global_shape;  // shape of the full tensor
  std::vector<int64_t> local_shape;   // shape of this rank's shard
  ShardKind shard = ShardKind::kReplicated;
  int64_t offset = 0;         // into param_data()/grad_data(), floats
  int64_t numel = 0;          // local
  bool weight_decay = false;  // matrices and embeddings decay; biases and norms do not
  int layer = -1;             // transformer layer, -1 for embeddings / final norm
  int64_t local_numel() const { return numel; }
};

struct ShardSpec {
  int tp_size = 1, tp_rank = 0;
  int pp_size = 1, pp_rank = 0;
};

// FLOPs of one training step (forward + backward) for `tokens` tokens with the formula of
// docs/ARCHITECTURE.md: 6 * N_matmul * tokens + attention 12 * L * C * sum_t(keys seen by t).
double TrainingFlopsPerSequence(const config::ModelSpec& spec);

// Copies this rank's shard of a global tensor (row-major, 1-D or 2-D) into `local`.
void ExtractShard(const float* global, float* local, const std::vector<int64_t>& global_shape, ShardKind kind,
                  int tp_size, int tp_rank);

class Gpt {
 public:
  // spec must be resolved (ffn_hidden set). micro_batch: sequences per Forward call.
  static Result<std::unique_ptr<Gpt>> Create(const config::ModelSpec& spec, const ShardSpec& shard, int micro_batch,
                                             uint64_t seed, device::Device* device);

  const config::ModelSpec& spec() const { return spec_; }
  const std::vector<ParamInfo>& params() const { return params_; }
  const ParamInfo* FindParam(const std::string& name) const;
  float* param_data() const { return params_buf_.f32(); }
  float* grad_data() const { return grads_buf_.f32(); }
  int64_t num_params() const { return num_params_; }
  int micro_batch() const { return B_; }

  void ZeroGrad();
  // inputs, targets: [B, T] token ids for this micro-batch (B = micro_batch()).
  // Runs the forward pass, keeps activations, returns the mean loss over the B*T tokens.
  Result<float> Forward(const int32_t* inputs, const int32_t* targets);
  // Backpropagates the last Forward. Gradients ACCUMULATE into grad_data(); each token's loss
  // is weighted by `dloss` (1 / tokens in the global batch for gradient accumulation).
  Status Backward(float dloss);

 private:
  Gpt() = default;
  Status Init(uint64_t seed);
  void AddParam(const std::string& name, std::vector<int64_t> shape, ShardKind kind, bool decay, int layer);

  config::ModelSpec spec_;
  ShardSpec shard_;
  int B_ = 0;
  device::Device* device_ = nullptr;
  std::vector<ParamInfo> params_;
  int64_t num_params_ = 0;
  device::Buffer params_buf_, grads_buf_, acts_buf_, scratch_buf_;
  std::vector<int32_t> inputs_, targets_;
  bool have_forward_ = false;
};

}  // namespace ms::model
