// megascale report: charts as standalone SVG documents written by the project (no renderer to
// install, nothing downloaded), used by `megascale bench` for its plots.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/core.h"

namespace ms::report {

struct ChartSpec {
  std::string title, x_label, y_label;
  int width = 800, height = 360;
};
struct Series {
  std::string name;
  std::vector<double> x, y;  // NaN y = missing point
  std::string point_class;   // LineChartSvg: when set, each point marker is class="<it>" data-x="<x>"
};
// Vertical markers across a line chart (checkpoints, faults) at x, with a short label.
struct Marker {
  double x = 0;
  std::string label, color = "#888";
};

// A standalone SVG document (xmlns set, valid XML, text escaped): one polyline + point markers per series,
// axes with ticks, legend.
std::string LineChartSvg(const ChartSpec& spec, const std::vector<Series>& series,
                         const std::vector<Marker>& markers = {});
// Grouped bars: one group per category (x ignored; series[s].y[i] is the bar of category i; NaN = no bar,
// shown as a gap).
std::string BarChartSvg(const ChartSpec& spec, const std::vector<std::string>& categories,
                        const std::vector<Series>& series);

// A heat map: one row per label (rows[r] has one value per column, NaN = no data), colored from the
// row-independent range [lo, hi]; each row is <g class="heat-row" data-row="r">. Markers over columns.
std::string HeatMapSvg(const ChartSpec& spec, const std::vector<std::string>& row_labels,
                       const std::vector<double>& columns, const std::vector<std::vector<double>>& rows,
                       const std::vector<Marker>& markers = {});
// A timeline: one row per label, spans [start, end) with a name and a color key (same key, same color).
struct Span {
  int row = 0;
  double start = 0, end = 0;
  std::string name, key;
};
std::string TimelineSvg(const ChartSpec& spec, const std::vector<std::string>& row_labels,
                        const std::vector<Span>& spans);

// ---- megascale report RUN_DIR -------------------------------------------------------------------

struct ReportOptions {
  std::string run_dir;
  std::string output;  // empty: <run_dir>/report
  int64_t step = -1;   // the step of the merged timeline; -1: the last step present in every trace
};
struct ReportResult {
  std::string page;                   // <output>/index.html
  std::vector<std::string> files;     // every file written
  std::vector<std::string> warnings;  // skipped lines, missing inputs
};
// Writes one self-contained HTML page (inline SVG and CSS, no script, no network) and the same charts
// as .svg files, plus the merged Chrome trace of one step (timeline-step-N.json) when the run has
// traces (log.trace: true). Reads metrics.jsonl (required), job.yaml, rank_timings.jsonl,
// events.jsonl and trace/rank-*.json when present. A line that does not parse (a run still writing,
// or one that crashed mid-line) is skipped with a warning. No metrics.jsonl: NotFound naming it.
Result<ReportResult> WriteReport(const ReportOptions& options);

}  // namespace ms::report
