// megascale report: charts as standalone SVG documents written by the project (no renderer to
// install, nothing downloaded), used by `megascale bench` for its plots.
#pragma once

#include <string>
#include <vector>

namespace ms::report {

struct ChartSpec {
  std::string title, x_label, y_label;
  int width = 800, height = 360;
};
struct Series {
  std::string name;
  std::vector<double> x, y;  // NaN y = missing point
};

// A standalone SVG document (xmlns set, valid XML, text escaped): one polyline + point markers per series,
// axes with ticks, legend.
std::string LineChartSvg(const ChartSpec& spec, const std::vector<Series>& series);
// Grouped bars: one group per category (x ignored; series[s].y[i] is the bar of category i; NaN = no bar,
// shown as a gap).
std::string BarChartSvg(const ChartSpec& spec, const std::vector<std::string>& categories,
                        const std::vector<Series>& series);

}  // namespace ms::report
