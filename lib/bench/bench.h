// megascale bench: MFU sweeps. Every combination of the varied keys (a point) is trained for a few
// steps by its own `megascale train` processes (the same code path as a real run; one point cannot
// disturb the next), its first steps dropped as warm-up, and summarized from its metrics.jsonl:
// step time (median and spread), tokens/s, model FLOP/s per device, MFU against the device peak
// (runner::ResolvePeak: the GPU datasheet figure, or the host's cached CPU GEMM calibration, the same
// for every point), and the split of the step into compute, exposed communication, pipeline bubble
// and data wait. A point whose spec is invalid, or whose run fails, is reported in its row with the
// reason, and the sweep goes on.
//
// What a point changes in the spec, besides the varied keys: train.steps = warmup + steps,
// optimizer.warmup_steps = 0 (the learning-rate schedule is not what a bench measures, and a spec's
// long warm-up, 20 steps for the demo, must not need editing), no checkpoints, no resume, no
// periodic evaluation, its own run directory under the output folder.
//
// Outputs in the output folder: bench.csv, bench.json, mfu.svg and tokens_per_s.svg (bar charts
// across the points), points/NNN/ (each point's spec, log and run directory).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/core.h"

namespace ms::bench {

// One varied key and its values.
struct Axis {
  std::string key;
  std::vector<std::string> values;
};
// "parallel.tp=1,2" -> {parallel.tp, [1, 2]}. No '=', an empty key or no value: InvalidArgument.
Result<Axis> ParseAxis(std::string_view text);

struct BenchOptions {
  // A job spec, optionally with a `bench:` section: {vary: {key: [values]}, cases: [{name: ..., set: {key:
  // value}}], steps: N, warmup: N}. The points are every case (each a named set of overrides, e.g. one
  // ablation) times every combination of the varied keys.
  std::string spec_path;
  std::vector<std::string> overrides;  // --set, applied to every point before the varied keys
  std::vector<Axis> vary;              // --vary, after the spec's bench.vary (a key given in both: --vary wins)
  int steps = 0;                       // measured steps per point (0: the spec's bench.steps, else 5)
  int warmup = -1;                     // dropped steps per point (-1: the spec's bench.warmup, else 2)
  std::string output;                  // empty: bench-<name>-<UTC time> in the current directory
  double point_timeout_s = 900;        // a point that runs longer is stopped and reported as failed
  bool progress = true;                // a progress line (point, ETA) on stderr
  std::string executable;              // the megascale binary that trains a point (empty: this program)
};

// The measurements of one point; status is "ok", "invalid", "failed" or "interrupted" (with `reason`).
struct PointResult {
  std::string case_name;                                      // bench.cases: the case ("" without cases)
  std::vector<std::pair<std::string, std::string>> settings;  // the varied keys' values
  std::string status = "ok", reason;
  int world = 0;
  int measured_steps = 0;
  double step_s = 0, step_spread = 0;  // median; (max - min) / median of the measured steps
  double tokens_per_s = 0, flops_per_device = 0, mfu = 0, peak_flops = 0;
  std::string peak_source;
  double compute_s = 0, comm_exposed_s = 0, bubble_s = 0, data_wait_s = 0;  // medians per step
  double device_mem_peak_mib = 0;  // rank 0's peak device memory (CUDA backend); 0: not reported (CPU backend)
  double wall_s = 0;
};

struct BenchResult {
  std::string output;
  std::vector<PointResult> points;
  // SIGINT or SIGTERM when a stop signal ended the sweep early: the running point was stopped (status
  // "interrupted"), no later point ran, and the outputs hold the points up to it.
  int interrupted = 0;
};

// Runs the sweep; prints the table on stdout. Fails only when the sweep itself cannot run (bad spec
// file, bad --vary, no output folder); failed points are in the result. Catches SIGINT and SIGTERM
// (runner::InstallStopSignals) and passes them on to the running point (BenchResult::interrupted).
Result<BenchResult> RunBench(const BenchOptions& options);

}  // namespace ms::bench
