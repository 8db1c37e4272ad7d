// megascale validate job.yaml: parse and check a job spec, print the resolved spec.
#include <cstdio>
#include <memory>

#include "cmd/megascale/commands.h"
#include "cmd/megascale/job_spec_args.h"
#include "runner/runner.h"

namespace ms::cmd {

CLI::App* AddValidateCommand(CLI::App& parent, RunFn* run) {
  auto* sub = parent.add_subcommand(
      "validate", "Parse and check a job spec, print it with every default resolved; exit 0 when valid, 1 when not");
  auto args = std::make_shared<JobSpecArgs>();
  auto no_files = std::make_shared<bool>(false);
  args->Bind(sub);
  sub->add_flag("--no-files", *no_files, "Skip the checks of the data files and of runtime.redis_password_file");
  *run = [args, no_files]() -> int {
    auto spec = args->Load();
    if (!spec.ok()) return ReportError(spec.status());
    // What the driver checks before it launches anything: the build's backends, the tokenizer, the
    // store address; and (unless --no-files) the data files and the password file.
    Status pre = runner::PreflightCheck(*spec, !*no_files);
    if (!pre.ok()) return ReportError(pre);
    std::fputs(config::ToYaml(*spec).c_str(), stdout);
    std::fprintf(stderr, "%s: valid\n", args->path.c_str());
    return 0;
  };
  return sub;
}

}  // namespace ms::cmd
