// megascale bench: MFU sweeps over configurations (lib/bench).
#include <signal.h>

#include <cstdio>
#include <memory>

#include "bench/bench.h"
#include "cmd/megascale/commands.h"

namespace ms::cmd {

CLI::App* AddBenchCommand(CLI::App& parent, RunFn* run) {
  auto* sub = parent.add_subcommand(
      "bench",
      "MFU sweep: train every combination of the varied keys for a few steps (each in its own processes) and "
      "print step time, tokens/s, FLOP/s per device, MFU and the step's split; writes CSV, JSON and SVG charts");
  auto opts = std::make_shared<bench::BenchOptions>();
  auto vary = std::make_shared<std::vector<std::string>>();
  sub->add_option("spec", opts->spec_path,
                  "Job spec (YAML), optionally with a bench: section {vary: {key: [values]}, steps: N, warmup: N}")
      ->required()
      ->check(CLI::ExistingFile);
  sub->add_option("--vary", *vary, "A key and its values, e.g. --vary parallel.tp=1,2 (repeatable; every combination)")
      ->take_all();
  sub->add_option("--set", opts->overrides, "Override a key of the job spec for every point")->take_all();
  sub->add_option("--steps", opts->steps, "Measured steps per point (default: bench.steps, else 5)");
  sub->add_option("--warmup", opts->warmup, "Warm-up steps dropped per point (default: bench.warmup, else 2)");
  sub->add_option("-o,--output", opts->output, "Output folder (default: bench-<name>-<UTC time>)");
  sub->add_option("--point-timeout", opts->point_timeout_s, "Seconds after which a point is stopped and failed")
      ->capture_default_str();
  auto quiet = std::make_shared<bool>(false);
  sub->add_flag("--no-progress", *quiet, "No progress line on stderr");
  *run = [opts, vary, quiet]() -> int {
    opts->progress = !*quiet;
    for (const auto& v : *vary) {
      auto axis = bench::ParseAxis(v);
      if (!axis.ok()) return ReportError(axis.status());
      opts->vary.push_back(std::move(axis).value());
    }
    auto result = bench::RunBench(*opts);
    if (!result.ok()) return ReportError(result.status());
    if (result->interrupted != 0) {  // the table and files of the points up to it are written
      size_t measured = 0;
      for (const auto& p : result->points) measured += p.status == "ok";
      std::fprintf(stderr, "error: bench stopped by %s after %zu measured point%s; outputs in %s\n",
                   result->interrupted == SIGINT ? "SIGINT" : "SIGTERM", measured, measured == 1 ? "" : "s",
                   result->output.c_str());
      return 128 + result->interrupted;
    }
    for (const auto& p : result->points) {
      if (p.status != "ok") return 2;  // the sweep ran, some points did not: say so in the exit status
    }
    return 0;
  };
  return sub;
}

}  // namespace ms::cmd
