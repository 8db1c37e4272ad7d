// Shared flag binding for subcommands that take a job spec: the file and --set overrides.
#pragma once

#include <string>
#include <vector>

#include "cmd/megascale/commands.h"
#include "config/config.h"
#include "runner/runner.h"

namespace ms::cmd {

struct JobSpecArgs {
  std::string path;
  std::vector<std::string> overrides;

  void Bind(CLI::App* sub) {
    sub->add_option("job", path, "Job spec (YAML); see docs/job-spec.md")->required();
    sub->add_option("--set", overrides,
                    "Override a key of the job spec, dotted: --set train.steps=10 --set model.attention.window=64")
        ->take_all();
  }
  // Loads, applies overrides, resolves and validates.
  Result<config::JobSpec> Load() const {
    MS_ASSIGN_OR_RETURN(config::JobSpec spec, config::LoadJobSpec(path));
    for (const auto& o : overrides) MS_RETURN_IF_ERROR(config::ApplyOverride(&spec, o));
    MS_RETURN_IF_ERROR(runner::ResolveForLauncher(&spec));  // parallel.dp: auto inside a Slurm allocation
    MS_RETURN_IF_ERROR(config::ResolveAndValidate(&spec));
    return spec;
  }
};

}  // namespace ms::cmd
