// megascale train / resume job.yaml: validate the job spec, then run the job (driver + ranks);
// and the hidden `worker` subcommand each rank runs.
#include <memory>

#include "cmd/megascale/commands.h"
#include "cmd/megascale/job_spec_args.h"
#include "runner/runner.h"

namespace ms::cmd {
namespace {

// Binds the flags `train` and `resume` share; `resume` sets options.resume.
CLI::App* AddJobCommand(CLI::App& parent, RunFn* run, const char* name, const char* help, bool resume) {
  auto* sub = parent.add_subcommand(name, help);
  auto args = std::make_shared<JobSpecArgs>();
  auto options = std::make_shared<runner::TrainOptions>();
  auto no_progress = std::make_shared<bool>(false);
  args->Bind(sub);
  sub->add_flag("--no-progress", *no_progress, "Do not draw the progress line on stdout");
  sub->add_option("--dump-params", options->dump_params_dir,
                  "Testing aid: each rank writes its final parameter shards (rank-N.f32 + rank-N.json) to DIR");
  *run = [args, options, no_progress, resume]() -> int {
    auto spec = args->Load();
    if (!spec.ok()) return ReportError(spec.status());
    Status files = config::CheckDataFiles(*spec);
    if (!files.ok()) return ReportError(files);
    options->progress = !*no_progress;
    options->resume = resume;
    Status s = runner::RunJob(*spec, *options);
    if (!s.ok()) return ReportError(s);
    return 0;
  };
  return sub;
}

}  // namespace

CLI::App* AddTrainCommand(CLI::App& parent, RunFn* run) {
  return AddJobCommand(parent, run, "train",
                       "Train the model of a job spec: launches tp*pp*dp local ranks (CPU backend) and supervises them",
                       /*resume=*/false);
}

CLI::App* AddResumeCommand(CLI::App& parent, RunFn* run) {
  return AddJobCommand(
      parent, run, "resume",
      "Carry on a job from the newest valid checkpoint in checkpoint.dir (any parallel layout of the model)",
      /*resume=*/true);
}

CLI::App* AddWorkerCommand(CLI::App& parent, RunFn* run) {
  auto* sub = parent.add_subcommand("worker", "One rank of a job (started by `megascale train`; not for direct use)");
  sub->group("");  // hidden from --help
  auto path = std::make_shared<std::string>();
  auto options = std::make_shared<runner::TrainOptions>();
  auto no_progress = std::make_shared<bool>(false);
  sub->add_option("job", *path, "Resolved job spec written by the driver")->required();
  sub->add_flag("--no-progress", *no_progress, "Do not draw the progress line");
  sub->add_option("--dump-params", options->dump_params_dir, "Write final parameter shards to DIR");
  sub->add_flag("--resume", options->resume, "Start from the newest valid checkpoint");
  *run = [path, options, no_progress]() -> int {
    options->progress = !*no_progress;
    Status s = runner::RunWorker(*path, *options);
    if (!s.ok()) return ReportError(s);
    return 0;
  };
  return sub;
}

}  // namespace ms::cmd
