// megascale validate job.yaml: parse and check a job spec, print the resolved spec.
#include <cstdio>
#include <memory>

#include "cmd/megascale/commands.h"
#include "cmd/megascale/job_spec_args.h"

namespace ms::cmd {

CLI::App* AddValidateCommand(CLI::App& parent, RunFn* run) {
  auto* sub = parent.add_subcommand(
      "validate", "Parse and check a job spec, print it with every default resolved; exit 0 when valid, 1 when not");
  auto args = std::make_shared<JobSpecArgs>();
  auto no_files = std::make_shared<bool>(false);
  args->Bind(sub);
  sub->add_flag("--no-files", *no_files, "Skip the check that the data files exist");
  *run = [args, no_files]() -> int {
    auto spec = args->Load();
    if (!spec.ok()) return ReportError(spec.status());
    if (!*no_files) {
      Status files = config::CheckDataFiles(*spec);
      if (!files.ok()) return ReportError(files);
    }
    std::fputs(config::ToYaml(*spec).c_str(), stdout);
    std::fprintf(stderr, "%s: valid\n", args->path.c_str());
    return 0;
  };
  return sub;
}

}  // namespace ms::cmd
