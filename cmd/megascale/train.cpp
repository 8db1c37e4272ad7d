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
  sub->add_flag("--start-over", options->start_over,
                "Train from step 1 although checkpoint.dir holds checkpoints none of which can be resumed (they are "
                "moved to checkpoint.dir/superseded-<time>/, not deleted)");
  *run = [args, options, no_progress, resume]() -> int {
    runner::InstallStopSignals();  // first: a stop signal while the spec and data are checked is not lost
    auto spec = args->Load();
    if (!spec.ok()) return ReportError(spec.status());
    options->progress = !*no_progress;
    options->resume = resume;
    auto end = runner::RunJob(*spec, *options);
    if (!end.ok()) return ReportError(end.status());
    return runner::ExitCode(*end);
  };
  return sub;
}

}  // namespace

CLI::App* AddTrainCommand(CLI::App& parent, RunFn* run) {
  return AddJobCommand(
      parent, run, "train",
      "Train the model of a job spec: launches tp*pp*dp local ranks (CPU backend) and supervises them. "
      "Exit status: 0 done, 1 failed, 75 stopped by SIGTERM with a checkpoint committed, 130 stopped "
      "by SIGINT",
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
  sub->add_option("--resume-step", options->resume_step, "Restore the checkpoint of this step (chosen by the driver)");
  auto self_check = std::make_shared<bool>(false);
  auto check = std::make_shared<runner::SelfCheckOptions>();
  sub->add_flag("--self-check", *self_check, "Run the self-check's measurements instead of training");
  sub->add_option("--provider", check->provider, "libfabric provider of the self-check's point-to-point test");
  *run = [path, options, no_progress, self_check, check]() -> int {
    runner::InstallStopSignals();
    if (*self_check) {
      Status s = runner::RunSelfCheckWorker(*path, *check);
      return s.ok() ? 0 : ReportError(s);
    }
    options->progress = !*no_progress;
    auto end = runner::RunWorker(*path, *options);
    if (!end.ok()) return ReportError(end.status());
    return runner::ExitCode(*end);
  };
  return sub;
}

}  // namespace ms::cmd
