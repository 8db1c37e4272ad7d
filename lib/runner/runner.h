// The job: the driver that launches and supervises ranks, the worker entry point, and the
// training loop every rank runs.
//
// RunJob (what `megascale train` and `megascale resume` call), in order:
//   1. PreflightCheck: everything about the spec, its files and this build that can be checked
//      before any process starts (the same checks `megascale validate` runs).
//   2. Locks log.run_dir and checkpoint.dir (flock, for the job's lifetime): a second job on the
//      same directories fails at once naming the holder.
//   3. Chooses the checkpoint to start from (checkpoint.resume: auto, or `megascale resume`):
//      the newest valid one, verified by the driver itself before launch (no rank waits on it).
//      Checkpoints that exist but none of which is usable are an error naming each, unless the
//      user asks to start over (--start-over). A run that starts from step 1 moves the step
//      directories of an earlier run aside and never truncates metrics.jsonl (see run_dir.h).
//   4. world = tp*pp*dp == 1: trains in this process. world > 1: starts the embedded
//      redis-server (unless runtime.redis names one), launches one ATTEMPT of `world` worker
//      processes (attempt.h) and supervises it: the first failing rank stops the others and is
//      named with its host and cause; SIGINT/SIGTERM/SIGUSR1 are forwarded; a second stop signal
//      during the grace kills the ranks at once; a dead embedded Redis is restarted on its port.
// RunWorker (hidden `megascale worker`): rendezvous through the store, builds the process
//   groups (Gloo), then Train().
// Train: data, model shard, data-parallel engine, optimizer, pipeline schedule; per step
//   metrics and the progress line (rank 0), evaluation, checkpoints, optional Chrome trace.
//
// Signals (caught from the first instruction, see InstallStopSignals): SIGUSR1 asks for a
// checkpoint; SIGTERM (Slurm's warning before a time limit, scancel, preemption) saves a
// checkpoint and stops: the job exits kExitSaved (75) once it is committed; SIGINT stops after
// the current step without saving (kExitInterrupted, 130). All ranks agree on the step through a
// small all-reduce of the signal flags after every step (each flag reduced on its own).
//
// Run directory (log.run_dir): job.yaml (the resolved spec), metrics.jsonl (rank 0: one JSON
// object per step, per evaluation and per checkpoint), train.log (one rank) or logs/rank-N.log,
// trace/rank-N.json (log.trace: true; open in Perfetto or chrome://tracing).
// Checkpoints (checkpoint.dir, default <run_dir>/checkpoints): every checkpoint.interval steps,
// on SIGUSR1 and on SIGTERM; a failed one is recorded in metrics.jsonl and shown on the console,
// and checkpoint.max_failures failures in a row stop the job.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "cluster/cluster.h"
#include "comm/comm.h"
#include "config/config.h"
#include "core/core.h"

namespace ms::device {
class Device;
}  // namespace ms::device
namespace ms::model {
class Gpt;
}
namespace ms::checkpoint {
class Coordinator;
}
namespace ms::bootstrap {
class Store;
}
namespace ms::runner {
class ProgressBoard;
}

namespace ms::runner {

// How a job (or one rank) ended when it did not fail.
enum class JobEnd {
  kCompleted,      // trained every step
  kSavedOnSignal,  // SIGTERM: stopped after committing a checkpoint ("saved, requeue me")
  kInterrupted,    // SIGINT: stopped after a step without saving
  // A rank (worker) only, never the job: the ranks agreed on a numeric fault (non-finite loss or
  // gradient, a loss spike) and stopped before changing the parameters.
  kRollback,         // fault policy rollback: the driver restarts from the newest checkpoint
  kStoppedByPolicy,  // fault policy stop: the driver ends the job
};
// Exit statuses of `megascale train` / `resume` and of every worker process (docs/slurm.md).
inline constexpr int kExitCompleted = 0;
inline constexpr int kExitFailed = 1;         // any error; the message names the cause
inline constexpr int kExitSaved = 75;         // EX_TEMPFAIL: stopped by SIGTERM with its checkpoint committed
inline constexpr int kExitInterrupted = 130;  // 128 + SIGINT
inline constexpr int kExitRollback = 76;      // a worker: restart me from the newest checkpoint
inline constexpr int kExitStopPolicy = 77;    // a worker: stopped on a fault whose policy is stop
int ExitCode(JobEnd end);

// Catches SIGINT, SIGTERM and SIGUSR1 for the job (counted, acted on at step boundaries), and
// ignores SIGPIPE (writes to a dead peer fail with EPIPE instead). Call it first thing in a process
// that will run a job; idempotent.
void InstallStopSignals();
// For a program that supervises megascale processes of its own (megascale bench), after InstallStopSignals: the stop
// signal received since the last call (SIGINT when both came, SIGTERM, or 0); a SIGUSR1 is dropped.
int TakeStopSignal();

struct TrainSummary {
  int64_t steps_done = 0;
  double first_loss = 0;
  double final_loss = 0;
  double final_val_loss = -1;  // -1 when no validation split
  double seconds = 0;
  double tokens_per_second = 0;
  double mfu = 0;
  std::string run_dir;
  JobEnd end = JobEnd::kCompleted;
};

struct TrainOptions {
  bool progress = true;         // show the progress line on stdout (rank 0 only)
  std::string dump_params_dir;  // testing aid: each rank writes its final parameter shards here
  bool resume = false;          // `megascale resume`: start from the newest valid checkpoint (error if none)
  bool start_over = false;      // start from step 1 although checkpoint.dir holds checkpoints (moved aside)
  // The checkpoint step to restore, -1 for none: chosen by the driver, passed to the workers.
  int64_t resume_step = -1;
};

// Where this rank sits and how it talks to the others.
struct Runtime {
  int rank = 0, world = 1;
  cluster::Host host;  // where this rank runs: its node, the ranks there, its local rank (which picks the GPU)
  int tp_rank = 0, pp_rank = 0, dp_rank = 0;
  std::unique_ptr<comm::Communicator> tp, pp, dp, embedding, world_comm;  // embedding: null if none
  std::shared_ptr<void> keepalive;                       // owns what the communicators use (process groups, store)
  std::shared_ptr<checkpoint::Coordinator> coordinator;  // checkpoint durability across ranks (null: one rank)
  std::shared_ptr<bootstrap::Store> store;               // the job's store, for waits on one rank (null: one rank)
  std::shared_ptr<ProgressBoard> board;                  // what this rank does, for its heartbeat (null: none)
  double collective_timeout_s = 60;                      // runtime.collective_timeout_s
  // Start-up milestones (name, WallSeconds()): the driver's (from MEGASCALE_STARTUP) and this rank's;
  // rank 0 writes them with the first step's as one "startup" row of metrics.jsonl.
  std::vector<std::pair<std::string, double>> startup;
  // Replaces tp, pp, dp and embedding by NCCL communicators on device memory, ordered after `compute_stream`
  // (the CUDA backend's cudaStream_t); world_comm stays on the host. Set by the worker entry in builds with
  // NCCL (MS_HAVE_NCCL); null otherwise. Used by multi-rank jobs on the CUDA backend with real GPUs.
  std::function<Status(Runtime&, void* compute_stream, device::Device* device)> use_nccl;
};
// The runtime of a single-rank job: every group is this rank alone.
std::unique_ptr<Runtime> SingleRankRuntime();
// The GPU a rank drives: its local rank (not rank % ranks per host, which collides under any
// placement other than consecutive blocks).
int DeviceOrdinal(const Runtime& rt);

// Everything that can be checked before a process is launched: the spec's cross-field rules
// (config::ResolveAndValidate must have run), this build's backends (CUDA, NCCL), the tokenizer
// against model.vocab, runtime.redis; with `files`: the data files (and their largest token id
// against model.vocab) and runtime.redis_password_file. `megascale validate` and RunJob call it.
Status PreflightCheck(const config::JobSpec& spec, bool files);

// What a launcher decides about the spec before it is validated: parallel.dp: auto becomes the
// Slurm allocation's tasks / (tp * pp) (outside an allocation it stays auto, which
// config::ResolveAndValidate then refuses with the reason). Call between --set and validation.
Status ResolveForLauncher(config::JobSpec* spec);

// `megascale generate` (docs/generate.md): loads the newest valid checkpoint of spec.checkpoint.dir
// (or step `step`), saved in any layout, into one process, encodes the prompt with the dataset's
// tokenizer (data.tokenizer against the dataset's metadata), and samples `tokens` tokens with the
// model's sliding window and a KV cache (model::Decoder; computed on the CPU whatever the backend).
struct GenerateOptions {
  std::string prompt;        // empty: generation starts after an end-of-document token
  int tokens = 64;           // to generate; prompt + tokens must fit model.seq_len (learned positions)
  double temperature = 0.8;  // <= 0: greedy (the most likely token each time)
  int top_k = 40;            // sample among the k most likely tokens; 0: all
  uint64_t seed = 1;         // same seed, same checkpoint, same prompt: same tokens
  int64_t step = -1;         // the checkpoint's step; -1: the newest valid one
  bool kv_cache = true;      // false: recompute the whole context for every token (same tokens, slower)
};
struct GenerateResult {
  std::string checkpoint;  // the step directory used
  std::string layout;      // the layout it was saved in (tp.pp.dp)
  std::vector<int32_t> prompt_ids, ids;
  std::string text;  // the decoded generated tokens (without the prompt)
  double seconds = 0, tokens_per_s = 0;
};
Result<GenerateResult> Generate(const config::JobSpec& spec, const GenerateOptions& options);

// `megascale self-check` (docs/jobs.md): node diagnostics over the job's ranks, launched as the
// job's would be (local processes, or a Slurm job step): per-device GEMM, per-host memory
// bandwidth, libfabric point-to-point latency and bandwidth between every pair of hosts (or of
// ranks on one host), an all-reduce over the job's world communicator. Prints a table; outliers
// against the median are flagged. Also run before each attempt with fault.self_check: true.
struct SelfCheckOptions {
  std::string provider = "tcp";  // libfabric provider of the point-to-point test (tcp, shm, verbs, efa, ...)
  double tolerance = 0.5;        // flagged: this much worse than the median (throughput below median / 1.5)
};
// spec must have passed config::ResolveAndValidate. true: every check passed.
Result<bool> RunSelfCheck(const config::JobSpec& spec, const SelfCheckOptions& options);
// Entry of a self-check worker process (hidden `megascale worker --self-check`).
Status RunSelfCheckWorker(const std::string& job_spec_path, const SelfCheckOptions& options);

// spec must have passed config::ResolveAndValidate. Runs PreflightCheck itself.
Result<JobEnd> RunJob(const config::JobSpec& spec, const TrainOptions& options = {});
// Entry of a worker process launched by RunJob; reads its rank from the environment.
Result<JobEnd> RunWorker(const std::string& job_spec_path, const TrainOptions& options);
// Writes the rank's parameter shards: <dir>/rank-N.f32 (the flat buffer) and rank-N.json (the
// tensor table: name, shard kind, global/local shape, offset, tp rank) — used by the layout
// equivalence test to reassemble and compare full tensors.
Status DumpParams(const model::Gpt& gpt, const std::string& dir, int rank);
// The training loop of one rank.
Result<TrainSummary> Train(const config::JobSpec& spec, const TrainOptions& options, Runtime& rt);

}  // namespace ms::runner
