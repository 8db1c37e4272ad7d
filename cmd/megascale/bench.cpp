// megascale bench: MFU sweeps (not built yet: scripts/bench_step.sh measures one step today).
#include <memory>

#include "cmd/megascale/commands.h"

namespace ms::cmd {

CLI::App* AddBenchCommand(CLI::App& parent, RunFn* run) {
  auto* sub = parent.add_subcommand("bench", "MFU sweep over configurations (not built yet)");
  auto sweep = std::make_shared<std::string>();
  sub->add_option("sweep", *sweep, "Sweep spec (YAML)");
  *run = []() -> int {
    return ReportError(Unimplemented(
        "bench sweeps are not built yet; scripts/bench_step.sh measures one training step of a job spec today"));
  };
  return sub;
}

}  // namespace ms::cmd
