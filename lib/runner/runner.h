// The training loop, and the job entry point that `megascale train` calls.
//
// Train() runs a whole job in this process for the 1x1x1 layout: opens the dataset,
// builds the model and optimizer, writes the run directory, and trains with gradient
// accumulation over micro-batches, evaluation at train.eval_interval and at the end, and
// the progress display. Multi-rank layouts, checkpoints and the driver (rank launch,
// Redis, restarts) are added by the bootstrap, 3D-parallelism and checkpoint issues; a
// spec that needs them is refused with Unimplemented before anything runs.
//
// Run directory (log.run_dir): job.yaml (the resolved spec), metrics.jsonl (one JSON
// object per step and per evaluation), train.log (every log line, time-stamped).
// SIGINT/SIGTERM stop the loop after the current step; Train then returns Aborted.
#pragma once

#include <string>

#include "config/config.h"
#include "core/core.h"

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
  bool progress = true;  // show the progress line on stdout
};

// spec must have passed config::ResolveAndValidate.
Result<TrainSummary> Train(const config::JobSpec& spec, const TrainOptions& options = {});

}  // namespace ms::runner
