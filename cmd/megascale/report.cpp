// megascale report RUN_DIR: one self-contained HTML page of a run (lib/report).
#include <cstdio>
#include <memory>

#include "cmd/megascale/commands.h"
#include "report/report.h"

namespace ms::cmd {

CLI::App* AddReportCommand(CLI::App& parent, RunFn* run) {
  auto* sub = parent.add_subcommand(
      "report",
      "Write one self-contained HTML page of a run (loss, throughput, MFU, step breakdown, per-rank heat map, one "
      "step's timeline on every rank) and its charts as SVG files; works on a run still going or one that crashed");
  auto o = std::make_shared<report::ReportOptions>();
  sub->add_option("run_dir", o->run_dir, "The run directory (log.run_dir)")->required();
  sub->add_option("-o,--output", o->output, "Output folder (default: RUN_DIR/report)");
  sub->add_option("--step", o->step, "The step of the merged timeline (default: the last step every trace holds)");
  *run = [o]() -> int {
    auto r = report::WriteReport(*o);
    if (!r.ok()) return ReportError(r.status());
    for (const auto& w : r->warnings) std::fprintf(stderr, "warning: %s\n", w.c_str());
    std::printf("wrote %s (%zu files)\n", r->page.c_str(), r->files.size());
    return 0;
  };
  return sub;
}

}  // namespace ms::cmd
