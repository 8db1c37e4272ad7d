// The job: the driver that launches and supervises ranks, the worker entry point, and the
// training loop every rank runs.
//
// RunJob (what `megascale train` calls):
//   world = tp*pp*dp == 1: trains in this process (no Redis, no sockets).
//   world > 1, no Slurm: starts the embedded redis-server (unless runtime.redis names one),
//     launches `world` local worker processes of this binary (`megascale worker`), like
//     torchrun, with OMP threads split so the ranks do not oversubscribe the cores, and
//     supervises them: one failing rank stops the others; SIGINT/SIGTERM stop every rank; the
//     job's exit status is the first failure's. Redis is stopped by its PID at the end.
// RunWorker (hidden `megascale worker`): rendezvous through the store, builds the process
//   groups (Gloo), then Train().
// Train: data, model shard, data-parallel engine, optimizer, pipeline schedule; per step
//   metrics and the progress line (rank 0), evaluation, optional Chrome trace per rank.
//
// Run directory (log.run_dir): job.yaml (the resolved spec), metrics.jsonl (rank 0: one JSON
// object per step and per evaluation), train.log (rank 0's log), logs/rank-N.log (world > 1),
// trace/rank-N.json (log.trace: true; open in Perfetto or chrome://tracing).
// Checkpoints (checkpoint.dir, default <run_dir>/checkpoints): every checkpoint.interval steps,
// on SIGUSR1, and on SIGTERM (Slurm's warning before a time limit or preemption: the job saves
// and exits with status 0). All ranks agree on the step through a tiny all-reduce of the
// signal flags after every step. SIGINT stops after the current step without saving (Aborted).
// checkpoint.resume: auto (or `megascale resume`) starts from the newest valid checkpoint, in any
// parallel layout of the same model.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "comm/comm.h"
#include "config/config.h"
#include "core/core.h"

namespace ms::model {
class Gpt;
}
namespace ms::checkpoint {
class Coordinator;
}

namespace ms::runner {

struct TrainSummary {
  int64_t steps_done = 0;
  double first_loss = 0;
  double final_loss = 0;
  double final_val_loss = -1;  // -1 when no validation split
  double seconds = 0;
  double tokens_per_second = 0;
  double mfu = 0;
  std::string run_dir;
};

struct TrainOptions {
  bool progress = true;         // show the progress line on stdout (rank 0 only)
  std::string dump_params_dir;  // testing aid: each rank writes its final parameter shards here
  bool resume = false;          // `megascale resume`: start from the newest valid checkpoint (error if none)
};

// Where this rank sits and how it talks to the others.
struct Runtime {
  int rank = 0, world = 1;
  int local_world = 1;  // ranks on this host
  int tp_rank = 0, pp_rank = 0, dp_rank = 0;
  std::unique_ptr<comm::Communicator> tp, pp, dp, embedding, world_comm;  // embedding: null if none
  std::shared_ptr<void> keepalive;                       // owns what the communicators use (process groups, store)
  std::shared_ptr<checkpoint::Coordinator> coordinator;  // checkpoint durability across ranks (null: one rank)
  // Replaces tp, pp, dp and embedding by NCCL communicators on device memory, ordered after `compute_stream`
  // (the CUDA backend's cudaStream_t); world_comm stays on the host. Set by the worker entry in builds with
  // NCCL (MS_HAVE_NCCL); null otherwise. Used by multi-rank jobs on the CUDA backend with real GPUs.
  std::function<Status(Runtime&, void* compute_stream)> use_nccl;
};
// The runtime of a single-rank job: every group is this rank alone.
std::unique_ptr<Runtime> SingleRankRuntime();

// spec must have passed config::ResolveAndValidate and config::CheckDataFiles.
Status RunJob(const config::JobSpec& spec, const TrainOptions& options = {});
// Entry of a worker process launched by RunJob; reads its rank from the environment.
Status RunWorker(const std::string& job_spec_path, const TrainOptions& options);
// Writes the rank's parameter shards: <dir>/rank-N.f32 (the flat buffer) and rank-N.json (the
// tensor table: name, shard kind, global/local shape, offset, tp rank) — used by the layout
// equivalence test to reassemble and compare full tensors.
Status DumpParams(const model::Gpt& gpt, const std::string& dir, int rank);
// The training loop of one rank.
Result<TrainSummary> Train(const config::JobSpec& spec, const TrainOptions& options, Runtime& rt);

}  // namespace ms::runner
