// SVG charts: element counts, escaping of names, NaN points and bars left out, heat-map rows.
#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include "report/report.h"

namespace ms::report {
namespace {

size_t Count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("line chart: one polyline per series, a marker per finite point, names escaped") {
  Series a{"loss <train> & \"more\"", {1, 2, 3, 4}, {3.0, 2.5, std::nan(""), 2.0}, "pt-a"};
  Series b{"b", {1, 2}, {1, 1}, ""};
  const std::string svg = LineChartSvg({"t & <t>", "x", "y"}, {a, b}, {{2, "ckpt", "#0a0"}});
  CHECK(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0) == 0);
  CHECK(Count(svg, "<polyline") == 2);
  CHECK(Count(svg, "class=\"pt-a\"") == 3);  // the NaN point has no marker
  CHECK(Count(svg, "<circle") == 5);
  CHECK(svg.find("loss &lt;train&gt; &amp; &quot;more&quot;") != std::string::npos);
  CHECK(svg.find("t &amp; &lt;t&gt;") != std::string::npos);
  CHECK(svg.find("<train>") == std::string::npos);
  CHECK(svg.find("ckpt") != std::string::npos);
  CHECK(svg.find("nan") == std::string::npos);
}

TEST_CASE("bar chart: a bar per finite value, gaps marked, the axis covers the data") {
  Series s{"MFU", {}, {10, std::nan(""), 63}, ""};
  const std::string svg = BarChartSvg({"MFU", "point", "%"}, {"a", "b<c", "d"}, {s});
  CHECK(Count(svg, "<rect x=") == 2 + 1);  // two bars and the legend's swatch
  CHECK(svg.find("n/a") != std::string::npos);
  CHECK(svg.find("b&lt;c") != std::string::npos);
  CHECK(svg.find(">80<") != std::string::npos);  // the axis goes past the largest bar (63)
  CHECK(svg.find("-0") == std::string::npos);
}

TEST_CASE("heat map: one row group per label; timeline: a rect per span") {
  const std::string heat = HeatMapSvg({"h", "step", "rank"}, {"rank 0", "rank 1", "rank 2"}, {1, 2, 3},
                                      {{1, 1, 1}, {1, std::nan(""), 5}, {1, 1, 1}}, {{2, "fault", "#d00"}});
  CHECK(Count(heat, "class=\"heat-row\"") == 3);
  CHECK(heat.find("data-row=\"2\"") != std::string::npos);
  const std::string tl = TimelineSvg({"t", "ms", ""}, {"r0 compute", "r1 compute"},
                                     {{0, 0.0, 0.01, "fwd", "forward"}, {1, 0.005, 0.02, "bwd <1>", "backward"}});
  CHECK(Count(tl, "class=\"span\"") == 2);
  CHECK(tl.find("bwd &lt;1&gt;") != std::string::npos);
}

}  // namespace ms::report
