// SVG charts: axes with "nice" ticks, lines, grouped bars, legends.
#include <algorithm>
#include <cmath>

#include "core/core.h"
#include "report/report.h"

namespace ms::report {
namespace {

const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"};

std::string Esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '&':
        o += "&amp;";
        break;
      case '"':
        o += "&quot;";
        break;
      case '\'':
        o += "&apos;";
        break;
      default:
        o += c;
    }
  }
  return o;
}

// Ticks at 1, 2 or 5 x 10^k covering [lo, hi].
std::vector<double> Ticks(double lo, double hi, int target) {
  if (!(hi > lo)) hi = lo + 1;
  const double raw = (hi - lo) / std::max(1, target);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  }
  // From the multiple at or below lo to the first at or above hi, so that the axis covers the data.
  std::vector<double> t;
  const long first = static_cast<long>(std::floor(lo / step + 1e-9));
  const long last = static_cast<long>(std::ceil(hi / step - 1e-9));
  for (long k = first; k <= std::max(last, first + 1); ++k) t.push_back(static_cast<double>(k) * step);
  return t;
}

std::string Num(double v) {
  if (std::fabs(v) < 1e-12) v = 0;  // no "-0" tick
  const double a = std::fabs(v);
  if (a >= 1e9) return fmt::format("{:g}G", v / 1e9);
  if (a >= 1e6) return fmt::format("{:g}M", v / 1e6);
  if (a >= 1e4) return fmt::format("{:g}k", v / 1e3);
  return fmt::format("{:g}", v);
}

struct Frame {
  double x0, y0, w, h;  // the plot area
  double ylo, yhi;
  double Y(double v) const { return y0 + h - (v - ylo) / (yhi - ylo) * h; }
};

std::string Head(const ChartSpec& spec) {
  return fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"{0}\" height=\"{1}\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"20\" text-anchor=\"middle\" font-size=\"15\" font-weight=\"bold\">{3}</text>\n",
      spec.width, spec.height, spec.width / 2, Esc(spec.title));
}

// The y axis (ticks, grid) and both labels; returns the frame.
Frame YAxis(const ChartSpec& spec, double lo, double hi, double bottom, std::string* svg) {
  if (!(hi > lo)) {
    hi = lo == 0 ? 1 : lo + std::fabs(lo) * 0.1 + 1e-12;
  }
  auto ticks = Ticks(lo, hi, 5);
  Frame f{70,
          34,
          static_cast<double>(spec.width) - 90,
          static_cast<double>(spec.height) - 34 - bottom,
          ticks.front(),
          ticks.back()};
  if (f.yhi <= f.ylo) f.yhi = f.ylo + 1;
  for (double t : ticks) {
    *svg += fmt::format(
        "<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#e0e0e0\"/>"
        "<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n",
        f.x0, f.Y(t), f.x0 + f.w, f.Y(t), f.x0 - 6, f.Y(t) + 4, Esc(Num(t)));
  }
  *svg += fmt::format(
      "<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"black\"/>"
      "<line x1=\"{0:.1f}\" y1=\"{2:.1f}\" x2=\"{3:.1f}\" y2=\"{2:.1f}\" stroke=\"black\"/>\n",
      f.x0, f.y0, f.y0 + f.h, f.x0 + f.w);
  *svg +=
      fmt::format("<text x=\"16\" y=\"{:.1f}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {:.1f})\">{}</text>\n",
                  f.y0 + f.h / 2, f.y0 + f.h / 2, Esc(spec.y_label));
  *svg += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", f.x0 + f.w / 2, spec.height - 8,
                      Esc(spec.x_label));
  return f;
}

void Legend(const std::vector<Series>& series, const Frame& f, std::string* svg) {
  double x = f.x0 + 8;
  for (size_t s = 0; s < series.size(); ++s) {
    *svg += fmt::format(
        "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{:.1f}\" "
        "y=\"{:.1f}\">{}</text>\n",
        x, f.y0 + 2, kColors[s % 8], x + 14, f.y0 + 11, Esc(series[s].name));
    x += 30 + 7.0 * static_cast<double>(series[s].name.size());
  }
}

void Range(const std::vector<Series>& series, double* lo, double* hi) {
  *lo = INFINITY;
  *hi = -INFINITY;
  for (const auto& s : series) {
    for (double v : s.y) {
      if (std::isfinite(v)) {
        *lo = std::min(*lo, v);
        *hi = std::max(*hi, v);
      }
    }
  }
  if (!std::isfinite(*lo)) *lo = 0, *hi = 1;
}

}  // namespace

std::string LineChartSvg(const ChartSpec& spec, const std::vector<Series>& series) {
  std::string svg = Head(spec);
  double lo, hi;
  Range(series, &lo, &hi);
  const Frame f = YAxis(spec, lo, hi, 56, &svg);
  double xlo = INFINITY, xhi = -INFINITY;
  for (const auto& s : series) {
    for (double v : s.x) xlo = std::min(xlo, v), xhi = std::max(xhi, v);
  }
  if (!std::isfinite(xlo)) xlo = 0, xhi = 1;
  const auto xt = Ticks(xlo, xhi, 8);
  const double xa = xt.front(), xb = xt.back() > xt.front() ? xt.back() : xt.front() + 1;
  auto X = [&](double v) { return f.x0 + (v - xa) / (xb - xa) * f.w; };
  for (double t : xt) {
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n", X(t), f.y0 + f.h + 16,
                       Esc(Num(t)));
  }
  for (size_t s = 0; s < series.size(); ++s) {
    std::string pts;
    const size_t n = std::min(series[s].x.size(), series[s].y.size());
    for (size_t i = 0; i < n; ++i) {
      if (!std::isfinite(series[s].y[i])) continue;
      pts += fmt::format("{:.1f},{:.1f} ", X(series[s].x[i]), f.Y(series[s].y[i]));
    }
    svg += fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" points=\"{}\"/>\n", kColors[s % 8],
                       pts);
    for (size_t i = 0; i < n; ++i) {
      if (!std::isfinite(series[s].y[i])) continue;
      svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2.5\" fill=\"{}\"/>\n", X(series[s].x[i]),
                         f.Y(series[s].y[i]), kColors[s % 8]);
    }
  }
  Legend(series, f, &svg);
  return svg + "</svg>\n";
}

std::string BarChartSvg(const ChartSpec& spec, const std::vector<std::string>& categories,
                        const std::vector<Series>& series) {
  std::string svg = Head(spec);
  double lo, hi;
  Range(series, &lo, &hi);
  // Room below for the category names, written at a slant.
  size_t longest = 0;
  for (const auto& c : categories) longest = std::max(longest, c.size());
  const double bottom = 40 + 4.5 * static_cast<double>(std::min<size_t>(longest, 40));
  const Frame f = YAxis(spec, std::min(0.0, lo), hi, bottom, &svg);
  const double group = f.w / static_cast<double>(std::max<size_t>(1, categories.size()));
  const double bar = group * 0.8 / static_cast<double>(std::max<size_t>(1, series.size()));
  for (size_t c = 0; c < categories.size(); ++c) {
    const double gx = f.x0 + group * static_cast<double>(c) + group * 0.1;
    for (size_t s = 0; s < series.size(); ++s) {
      const double v = c < series[s].y.size() ? series[s].y[c] : NAN;
      if (!std::isfinite(v)) {  // a gap, marked
        svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" fill=\"#888\">n/a</text>\n",
                           gx + bar * (static_cast<double>(s) + 0.5), f.Y(0) - 4);
        continue;
      }
      const double top = f.Y(std::max(v, 0.0)), bottom = f.Y(std::min(v, 0.0));
      svg += fmt::format(
          "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"{}\"><title>{}: "
          "{}</title></rect>\n",
          gx + bar * static_cast<double>(s), top, bar * 0.95, std::max(0.5, bottom - top), kColors[s % 8],
          Esc(categories[c]), Esc(fmt::format("{:.4g}", v)));
    }
    svg += fmt::format(
        "<text x=\"{0:.1f}\" y=\"{1:.1f}\" text-anchor=\"end\" transform=\"rotate(-30 {0:.1f} {1:.1f})\">{2}</text>\n",
        gx + group * 0.4, f.y0 + f.h + 14, Esc(categories[c]));
  }
  Legend(series, f, &svg);
  return svg + "</svg>\n";
}

}  // namespace ms::report
