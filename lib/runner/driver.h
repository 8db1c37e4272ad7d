// Internal to the runner: the driver's small decisions, exposed for unit tests.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bootstrap/bootstrap.h"
#include "cluster/cluster.h"
#include "config/config.h"
#include "core/core.h"
#include "runner/attempt.h"

namespace ms::runner {

// The store namespace of a job: its name (free text in the spec: spaces, quotes, anything) cut
// down to [A-Za-z0-9._-] (at most 40 characters), plus "-" and 12 random hex digits, so that two
// jobs never share keys.
std::string JobId(const std::string& name);
// Parameters of the model (all shards together), from its shape.
double ApproxParams(const config::ModelSpec& m);
// The time ranks get after SIGTERM to finish their step, commit the checkpoint and exit:
// runtime.stop_grace_s, or (0) 60 s plus 1 s per 100 MB of checkpoint (parameters and both Adam
// moments in fp32), so that a large model's save is not cut short by a fixed timeout.
double StopGraceSeconds(const config::JobSpec& spec);

// How a job's ranks go on a Slurm allocation: `nodes` nodes with `tasks_per_node` ranks each.
struct SlurmFit {
  int nodes = 0;  // used by a job step (the allocation may have spare ones)
  int tasks_per_node = 0;
};
// Checks that the job fits the allocation, before anything launches: as many tasks as ranks (or
// more, by whole spare nodes, which replace a bad node), the same number on every node, tensor-parallel groups inside a
// node (tasks per node a multiple of tp), no more ranks per node than GPUs on the CUDA backend. FailedPrecondition
// naming both sides and a fix (--ntasks-per-node, --nodes, parallel.dp).
Result<SlurmFit> FitSlurmAllocation(const config::JobSpec& spec, const cluster::SlurmAllocation& alloc);
// The address the embedded redis-server listens on: runtime.address, else runtime.interface's
// address, else (inside an allocation) this host's address toward the allocation's other nodes,
// else 127.0.0.1.
Result<std::string> ChooseStoreAddress(const config::JobSpec& spec, const cluster::SlurmAllocation* alloc);

// The store of a job's ranks: the embedded redis-server the driver starts (on ChooseStoreAddress's
// address, its pid file and log in the run directory), or runtime.redis.
struct JobStore {
  std::optional<bootstrap::EmbeddedRedis> redis;  // empty: runtime.redis names an external one
  std::string url, password;
};
Result<JobStore> StartJobStore(const config::JobSpec& spec, const cluster::SlurmAllocation* alloc, int world);

// Where and how the ranks of an attempt run: this host (no allocation) or one Slurm job step.
struct Placement {
  const cluster::SlurmAllocation* alloc = nullptr;  // null: local processes
  SlurmFit fit;                                     // with alloc: nodes and tasks per node
  std::vector<std::string> exclude;                 // with alloc: hosts found bad
  int threads = 1;                                  // local: OMP_NUM_THREADS of each rank
};
// Launches `plan` (whose env already holds what every rank needs) as `what` (for the console):
// one Slurm job step named `step_name`, or local processes with their rank variables.
Result<std::unique_ptr<Attempt>> LaunchAttempt(LaunchPlan plan, const Placement& where, const std::string& step_name,
                                               const std::string& what);
// The variables every rank of an attempt gets: world, store URL and password (only ever in the
// environment), job id, attempt number.
std::vector<std::string> RankEnvironment(int world, const JobStore& store, const std::string& job_id, int attempt);

}  // namespace ms::runner
