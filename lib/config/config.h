// megascale config: the job spec (YAML) as plain structs, parsed, resolved and validated.
// defines: JobSpec and its sections, ParseJobSpec, LoadJobSpec, ApplyOverride, ResolveAndValidate,
//          CheckDataFiles, ToYaml, KeyLocation, Name(<enum>)
//
// The chain, as the CLI runs it:
//   MS_ASSIGN_OR_RETURN(JobSpec spec, LoadJobSpec(path));   // syntax, unknown keys, types, ranges
//   for (auto& s : sets) MS_RETURN_IF_ERROR(ApplyOverride(&spec, s));  // --set model.heads=8
//   MS_RETURN_IF_ERROR(ResolveAndValidate(&spec));           // derived values, cross-field rules
//   MS_RETURN_IF_ERROR(CheckDataFiles(spec));                // skipped by `validate --no-files`
//
// Every error is Code::kInvalidArgument (kNotFound for missing files) with a message that names
// where the value came from ("configs/x.yaml:7:11" or "--set model.heads=7"), the dotted key, what
// was expected, what was found, and a hint for the fix ("did you mean ...", valid values, e.g. a
// divisor that works). Keys and values are described in docs/job-spec.md.
//
// Thread safety: functions are pure (no globals); a JobSpec is a plain value.
// Failure: no exceptions escape (yaml-cpp's are caught here).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/core.h"

namespace ms::config {

enum class BlockKind { kParallel, kSequential };  // yaml: parallel | sequential
enum class OptimizerKind { kAdamW, kLamb };       // adamw | lamb
enum class ScheduleKind { kCosine, kConstant };   // cosine | constant
enum class Backend { kCpu, kCuda, kAuto };        // cpu | cuda | auto
enum class Precision { kFp32, kBf16 };            // fp32 | bf16

struct ModelSpec {
  int layers = 4;        // transformer blocks
  int hidden = 256;      // model width C
  int heads = 4;         // attention heads; head dim = hidden / heads
  int ffn_hidden = 0;    // MLP width; 0 -> 4 * hidden (resolved by ResolveAndValidate)
  int vocab = 256;       // vocabulary size V (256 = byte-level)
  int vocab_pad_to = 1;  // the embedding and classifier hold V rounded up to a multiple of this (128: aligned
                         // GEMMs); the padding rows are zero, out of the softmax, never a target, never sampled
  int seq_len = 256;     // tokens per sequence T
  BlockKind block = BlockKind::kParallel;  // parallel: x + attn(ln(x)) + mlp(ln(x)); sequential: GPT-2
  int window = 0;                          // yaml: attention: {window: N}; 0 = full causal attention
  std::string norm = "layernorm";          // only layernorm for now
  float norm_eps = 1e-5f;
  bool tied_embeddings = true;  // output projection shares the token embedding
  float init_std = 0.02f;       // std of the normal init of weights
  // Rows of the embedding and classifier: vocab rounded up to a multiple of vocab_pad_to.
  int64_t padded_vocab() const {
    const int64_t pad = vocab_pad_to > 0 ? vocab_pad_to : 1;
    return (static_cast<int64_t>(vocab) + pad - 1) / pad * pad;
  }
  bool operator==(const ModelSpec&) const = default;
};

struct ParallelSpec {
  int tp = 1;                      // tensor-parallel degree
  int pp = 1;                      // pipeline-parallel degree
  int dp = 1;                      // data-parallel degree; world size = tp * pp * dp; 0 = auto (yaml: auto):
                                   // the Slurm allocation's tasks / (tp * pp), see ResolveAutoDataParallel
  int micro_batches = 0;           // per step and dp rank; 0 -> derived (see ResolveAndValidate)
  bool sequence_parallel = false;  // no-op at tp 1
  int virtual_stages = 1;          // interleaved 1F1B when > 1 (needs pp > 1)
  int zero = 0;                    // 0: off, 1: optimizer state sharded over dp, 2: + gradients; no-op at dp 1
  double bucket_mb = 4;            // data-parallel gradient bucket size, MB of fp32
  bool overlap = true;             // start each bucket's reduction during backward (false: measure without)
  int tp_comm_chunks = 1;          // row chunks of each TP collective, pipelined with its GEMMs; 1 = unchunked
  // fp32 | bf16: the tensor-parallel sums of the layers' activations and activation gradients (the all-reduce or
  // reduce-scatter after each row-parallel GEMM, and of the LayerNorm-output gradients in backward) summed in bf16
  // (model::ShardSpec::tp_reduce_bf16): half the bytes, each rank's partial sum and every addition rounded to bf16.
  std::string tp_reduce_dtype = "fp32";
  bool pp_overlap = true;  // pipeline receives posted ahead, sends completed lazily (false: each waited at once)
  bool operator==(const ParallelSpec&) const = default;
};

struct TrainSpec {
  int64_t steps = 100;
  int global_batch = 8;  // sequences per optimizer step (all dp ranks together)
  int micro_batch = 0;   // sequences per micro-batch; 0 -> global_batch / (dp * micro_batches)
  uint64_t seed = 1234;
  Precision precision = Precision::kFp32;
  int eval_interval = 0;  // steps between evaluations; 0 = never
  int eval_batches = 4;   // batches per evaluation
  bool operator==(const TrainSpec&) const = default;
};

struct OptimizerSpec {
  OptimizerKind kind = OptimizerKind::kAdamW;
  float lr = 3e-4f;          // peak learning rate
  float min_lr = 0.0f;       // floor of the cosine schedule
  int64_t warmup_steps = 0;  // linear warm-up from 0 to lr
  ScheduleKind schedule = ScheduleKind::kCosine;
  float weight_decay = 0.1f;  // decoupled; applied to matrices only
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float grad_clip = 1.0f;  // max global gradient norm; 0 = off
  bool operator==(const OptimizerSpec&) const = default;
};

struct DataSpec {
  // Prefix of <path>.bin / <path>.idx. Relative paths resolve against the job spec's folder (or
  // the current directory when the spec did not come from a file); ResolveAndValidate makes it
  // absolute.
  std::string path;
  std::string tokenizer = "auto";
  double valid_fraction = 0.05;   // share of documents held out for evaluation, in [0, 0.5]
  std::string loader = "shared";  // shared: one loader per host into shared memory | per_rank
  int prefetch = 4;               // steps the shared loader runs ahead (slots of its ring)
  double loader_timeout_s = 60;   // a rank fails when the host's loader published nothing for this long
  bool operator==(const DataSpec&) const = default;
};

struct CheckpointSpec {
  std::string dir;                      // empty -> <run_dir>/checkpoints (filled by ResolveAndValidate)
  int64_t interval = 0;                 // steps between checkpoints; 0 = never
  int keep = 3;                         // newest checkpoints kept on disk
  std::string resume = "none";          // none | auto (newest valid checkpoint in dir, if any)
  int max_failures = 3;                 // consecutive failed checkpoints that stop the job; 0 = never stop
  double coordination_timeout_s = 600;  // rank 0's wait for every rank's file of one checkpoint
  bool operator==(const CheckpointSpec&) const = default;
};

struct RuntimeSpec {
  Backend backend = Backend::kCpu;    // cuda on a build without CUDA is rejected by the runner, not here
  int threads = 0;                    // per rank; 0 -> all cores / ranks per host
  std::string redis;                  // host:port or redis://[user@]host:port[/db]; empty -> embedded redis-server
  std::string redis_password_file;    // file (mode 0600) holding the password of runtime.redis; empty -> none, or
                                      // MEGASCALE_REDIS_PASSWORD
  double collective_timeout_s = 60;   // a collective (or a wait on a peer) with no progress for this long fails
  double rendezvous_timeout_s = 120;  // rank registration and process-group creation
  double stop_grace_s = 0;            // time ranks get to save and exit after SIGTERM; 0 -> sized from the model
  std::string interface;      // network interface the job's sockets use on every host (e.g. ib0); empty -> the one
                              // that routes to the driver's host
  std::string address;        // address of the driver's host the embedded redis-server listens on; empty -> chosen
  bool fused_kernels = true;  // fused epilogues (bias + GeLU, residual + biases); false: unfused, an ablation
  bool attention_stored_ds = true;    // the tensor-core attention backward keeps dS for its dQ kernel (5 products)
  bool attention_split_dkdv = false;  // its dK/dV kernel with 8 warps, each half of D (FlashAttention-2's split)
  bool attention_autotune = false;    // the fastest of its same-bits kernel variants per pass and shape, timed at the
                                      // first call (CUDA backend)
  bool cuda_graphs = false;           // each micro-batch slot's forward and backward launched as a recorded CUDA graph
  bool gemm_epilogues = true;  // with activations bf16 and bf16_operands keep: the fc bias + GeLU and its gradient
                               // in the fc GEMMs' cuBLASLt epilogues, the qkv bias in the qkv GEMM's (not added by
                               // the attention); false: in the fused kernel and the attention (an ablation)
  std::string device_comm = "auto";             // tp/pp/dp communicators of a multi-rank CUDA job: auto | nccl | gloo
                                                // (auto: NCCL, on GPUs or the emulated NCCL of megascale-emu; gloo:
                                                // megascale-emu only, device memory being host memory there)
  std::string bf16_operands = "keep";           // how bf16 GEMMs on the CUDA backend get bf16 operands: keep (cast
                                                // kernels; the model keeps the bf16 weights for a step and each layer
                                                // input for its backward) | cast (cast kernels at every GEMM, nothing
                                                // kept) | cublas (fp32 operands, cuBLAS converts:
                                                // CUBLAS_COMPUTE_32F_FAST_16BF); no effect on fp32 GEMMs or the CPU
                                                // backend
  std::string attention_kernels = "megascale";  // megascale | cudnn: the attention of bf16 activations, forward
                                                // and backward, by cuDNN's fused attention (GPU build with cuDNN;
                                                // megascale's kernels where cuDNN does not take a call)
  std::string activations = "fp32";  // fp32 | bf16: the fc GEMM's output (pre-GeLU) kept in bf16 (CUDA backend, bf16
                                     // GEMMs on bf16 operands, fused kernels)
  bool operator==(const RuntimeSpec&) const = default;
};

struct LogSpec {
  std::string run_dir = "runs/default";  // relative resolves against the current directory
  int interval = 1;                      // steps between progress lines
  double peak_flops = 0;                 // per rank, FLOP/s, for MFU; 0 -> measured
  bool trace = false;                    // per-rank Chrome traces under <run_dir>/trace/
  bool operator==(const LogSpec&) const = default;
};

// Fault tolerance (docs/jobs.md): heartbeats, detection, automatic restarts, stragglers.
struct FaultSpec {
  double heartbeat_s = 2;               // every rank publishes a heartbeat this often; 0 = no heartbeats
  double heartbeat_timeout_s = 15;      // a rank whose heartbeat stops for this long is lost (e.g. SIGSTOP, dead host)
  double hang_timeout_s = 300;          // no step progress on any rank for this long is a hang
  int max_restarts = 3;                 // new attempts after faults (from the newest checkpoint); 0 = none
  double restart_backoff_s = 2;         // wait before attempt k: backoff * 2^(k-1), at most 60 s
  std::string nan_policy = "rollback";  // non-finite loss or gradient norm: stop | skip | rollback
  double loss_spike_factor = 0;         // loss above factor * its recent average is a spike; 0 = off
  std::string spike_policy = "warn";    // warn | rollback
  double straggler_ratio = 0.5;         // median compute time this much above the median of its peers ...
  int straggler_steps = 10;             // ... over this many steps: a straggler; 0 = off
  bool self_check = false;              // run `megascale self-check` before each attempt (multi-rank jobs)
  std::string self_check_provider = "tcp";  // libfabric provider of its point-to-point test: tcp, shm, verbs, efa
  double self_check_tolerance = 0.5;        // a result this much worse than the median (1 + x times) is flagged
  bool operator==(const FaultSpec&) const = default;
};

struct JobSpec {
  std::string name = "job";
  ModelSpec model;
  ParallelSpec parallel;
  TrainSpec train;
  OptimizerSpec optimizer;
  DataSpec data;
  CheckpointSpec checkpoint;
  RuntimeSpec runtime;
  LogSpec log;
  FaultSpec fault;

  // Provenance (not settings; ToYaml does not write them, SameSettings ignores them).
  std::string source = "<string>";  // file it came from, or "<string>"
  // Dotted key ("model.heads", also sections "model", "model.attention") -> 1-based (line, column)
  // of the key in `source`, for every key that was parsed.
  std::map<std::string, std::pair<int, int>> marks;
  // Dotted key -> the override text that last set it ("model.heads=8").
  std::map<std::string, std::string> overrides;

  bool operator==(const JobSpec&) const = default;
};

// Parses YAML text (source_name is used in messages and stored in JobSpec::source). Rejects syntax
// errors, a document that is not a map, an empty document, several documents, unknown keys,
// duplicate keys, wrong types and out-of-range values. Does not derive values or check cross-field
// rules: call ResolveAndValidate for that.
Result<JobSpec> ParseJobSpec(std::string_view yaml_text, std::string_view source_name);

// Reads the file and parses it. Missing file -> NotFound naming the path.
Result<JobSpec> LoadJobSpec(const std::string& path);

// Applies one --set override in dotted form ("train.steps=10", "model.attention.window=64",
// "data.path=/data/x"); the value is a plain scalar, optionally quoted. Call before
// ResolveAndValidate. Errors read like parse errors, located at "--set <text>".
Status ApplyOverride(JobSpec* spec, std::string_view dotted_key_equals_value);

// parallel.dp: auto -> tasks / (tp * pp) for a launcher that offers `tasks` ranks (`where` names
// them in messages, e.g. "the Slurm allocation (SLURM_NTASKS=8)"). No-op when dp is set.
// InvalidArgument when tp * pp does not divide the tasks. Call before ResolveAndValidate.
Status ResolveAutoDataParallel(JobSpec* spec, int tasks, std::string_view where);

// Fills derived values and checks every single-field range and cross-field rule; call after
// parsing and overrides (and ResolveAutoDataParallel). Idempotent.
//   model.ffn_hidden    0 -> 4 * hidden
//   batch arithmetic    global_batch == micro_batch * micro_batches * dp; a 0 is derived:
//                       both 0: pp == 1 -> micro_batches 1; pp > 1 -> micro_batch 1
//   data.path           relative -> absolute, against the folder of `source` when it names a file
//                       (anything but "<...>"), else the current directory; lexically normalized
//   checkpoint.dir      empty -> <log.run_dir>/checkpoints
// Rules are listed in docs/job-spec.md. Errors are located at the key most responsible.
Status ResolveAndValidate(JobSpec* spec);

// Checks that <data.path>.bin and <data.path>.idx exist (relative paths as ResolveAndValidate
// resolves them). NotFound names the missing file and hints at scripts/make_demo_data.sh and
// `megascale prepare-data`. Then CheckPasswordFile.
Status CheckDataFiles(const JobSpec& spec);
// runtime.redis_password_file, when set, is a regular file only its owner can read (mode 0600 or
// stricter): NotFound / InvalidArgument naming the file and the fix.
Status CheckPasswordFile(const JobSpec& spec);

// The spec as YAML: every field, defaults included, sections in the order above. ParseJobSpec of
// the result gives a spec with SameSettings(...) == true.
std::string ToYaml(const JobSpec& spec);

// True when every setting is equal (ignores source, marks and overrides).
bool SameSettings(const JobSpec& a, const JobSpec& b);

// Where a key's value came from: "--set model.heads=8", "configs/x.yaml:7:3", or, for a key not
// given, its section's location or just the source name. For errors raised outside this module
// (e.g. runtime.backend cuda on a CPU-only build).
std::string KeyLocation(const JobSpec& spec, std::string_view dotted_key);

// Every settable dotted key, in ToYaml order ("name", "model.layers", ..., "model.attention.window").
std::vector<std::string> AllKeys();

// Total ranks: tp * pp * dp.
inline int64_t WorldSize(const ParallelSpec& p) {
  return int64_t{p.tp} * p.pp * p.dp;
}

// YAML spelling of each enum value ("parallel", "adamw", "cosine", "cuda", "bf16").
std::string_view Name(BlockKind v);
std::string_view Name(OptimizerKind v);
std::string_view Name(ScheduleKind v);
std::string_view Name(Backend v);
std::string_view Name(Precision v);

}  // namespace ms::config
