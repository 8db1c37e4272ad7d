// Internal to the runner: `megascale self-check`, node diagnostics run as an attempt of the job's
// own ranks (the same launch path as training: local processes or one Slurm job step).
//
// Each rank (RunSelfCheckWorker) measures, in this order, with a barrier of the job's world
// communicator between the parts so that no test disturbs another:
//   gemm       its device's GEMM rate (on the CPU backend the ranks of a host share the device, so
//              they take turns; on GPUs all run at once)
//   memory     per host (local rank 0): host memory bandwidth, a memcpy of 2 x 64 MiB
//   links      point-to-point over libfabric (the provider is an option): one-way latency (8-byte
//              ping-pong) and bandwidth (1 MiB messages, both directions, the lower counts) between
//              every pair of hosts (local rank 0 of each), or of ranks when the job has one host; pairs
//              of a round-robin schedule run at once across hosts, one at a time on one host
//   all-reduce the job's world communicator (Gloo on the host): 16 MiB of floats, the sum checked
// and writes its result to the store (selfcheck/<rank>, "key=value" lines). The driver
// (RunSelfCheckAttempt) gathers them, flags outliers against the median (AnalyzeSelfCheck), prints
// the table and writes <run_dir>/self_check.jsonl.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "core/core.h"
#include "runner/driver.h"
#include "runner/runner.h"

namespace ms::runner {

// What one rank measured (0 where it did not measure).
struct RankCheck {
  int rank = -1;
  std::string host;
  int local_rank = 0;
  std::string provider;  // the libfabric provider its endpoint got, e.g. "tcp;ofi_rxm"
  double gemm_flops = 0;
  double memory_bytes_per_s = 0;  // local rank 0 of a host only
  struct Link {
    int peer = -1;
    std::string peer_host;
    double latency_s = 0, bytes_per_s = 0;
  };
  std::vector<Link> links;  // the pairs this rank led (it is the lower rank)
  double allreduce_s = 0, allreduce_bus_bytes_per_s = 0;
  std::vector<std::string> errors;  // checks that failed on this rank
};
std::string FormatRankCheck(const RankCheck& r);
Result<RankCheck> ParseRankCheck(const std::string& text);

struct SelfCheckReport {
  std::vector<RankCheck> ranks;       // by rank
  std::vector<std::string> failures;  // one line each: what, where, the value and the median
  std::set<std::string> bad_hosts;    // the hosts of the failures
  std::string table;                  // for the console
  bool passed() const { return failures.empty(); }
};
// Flags a value `tolerance` times worse than the median of its kind: throughput below
// median / (1 + tolerance), latency above median * (1 + tolerance). GEMM per rank, memory per host,
// links per endpoint (the median over its pairs, against the median over endpoints: needs three
// endpoints; with two, a slow link cannot be told from a slow endpoint and nothing is flagged), and
// any check that failed.
SelfCheckReport AnalyzeSelfCheck(std::vector<RankCheck> ranks, double tolerance);

// Launches the self-check as an attempt of `world` ranks in `where` (store namespace `job_id`,
// attempt number `attempt`, step name suffix "selfcheck"), waits for it (a stop signal kills it:
// Aborted), gathers and analyzes the results, prints the table and writes
// <run_dir>/self_check.jsonl. The spec must have been written to <run_dir>/job.yaml.
Result<SelfCheckReport> RunSelfCheckAttempt(const config::JobSpec& spec, const JobStore& store, const Placement& where,
                                            const std::string& job_id, int attempt, const SelfCheckOptions& options);

}  // namespace ms::runner
