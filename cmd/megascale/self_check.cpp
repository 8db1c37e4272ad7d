// megascale self-check job.yaml: node diagnostics over the job's ranks (runner::RunSelfCheck).
#include <memory>

#include "cmd/megascale/commands.h"
#include "cmd/megascale/job_spec_args.h"
#include "runner/runner.h"

namespace ms::cmd {

CLI::App* AddSelfCheckCommand(CLI::App& parent, RunFn* run) {
  auto* sub = parent.add_subcommand(
      "self-check",
      "Node diagnostics on the job's ranks, launched as the job's would be (local processes, or a Slurm job step "
      "inside an allocation): GEMM rate per device, memory bandwidth per host, libfabric point-to-point latency and "
      "bandwidth between every pair of hosts (of ranks on one host), an all-reduce over the job's communicator. "
      "Prints a table and flags outliers against the median. Exit status: 0 passed, 1 a check failed or flagged");
  auto args = std::make_shared<JobSpecArgs>();
  auto options = std::make_shared<runner::SelfCheckOptions>();
  args->Bind(sub);
  auto* provider = sub->add_option("--provider", options->provider,
                                   "libfabric provider of the point-to-point test: tcp, shm, verbs, efa, ... "
                                   "(default: the spec's fault.self_check_provider, tcp)");
  auto* tolerance = sub->add_option("--tolerance", options->tolerance,
                                    "Flag a result this much worse than the median: 0.5 flags a throughput below "
                                    "median / 1.5 or a latency above 1.5 x median (default: "
                                    "fault.self_check_tolerance, 0.5)")
                        ->check(CLI::PositiveNumber);
  *run = [args, options, provider, tolerance]() -> int {
    runner::InstallStopSignals();
    auto spec = args->Load();
    if (!spec.ok()) return ReportError(spec.status());
    if (provider->count() == 0) options->provider = spec->fault.self_check_provider;
    if (tolerance->count() == 0) options->tolerance = spec->fault.self_check_tolerance;
    auto passed = runner::RunSelfCheck(*spec, *options);
    if (!passed.ok()) return ReportError(passed.status());
    return *passed ? 0 : 1;
  };
  return sub;
}

}  // namespace ms::cmd
