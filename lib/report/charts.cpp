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

std::string LineChartSvg(const ChartSpec& spec, const std::vector<Series>& series, const std::vector<Marker>& markers) {
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
      const std::string cls = series[s].point_class.empty() ? std::string()
                                                            : fmt::format(" class=\"{}\" data-x=\"{:g}\"",
                                                                          Esc(series[s].point_class), series[s].x[i]);
      svg += fmt::format("<circle{} cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2.5\" fill=\"{}\"/>\n", cls, X(series[s].x[i]),
                         f.Y(series[s].y[i]), kColors[s % 8]);
    }
  }
  for (const auto& mk : markers) {
    if (mk.x < xa || mk.x > xb) continue;
    svg += fmt::format(
        "<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"{3}\" stroke-dasharray=\"3,3\"/>"
        "<text x=\"{0:.1f}\" y=\"{4:.1f}\" fill=\"{3}\" font-size=\"10\" text-anchor=\"middle\">{5}</text>\n",
        X(mk.x), f.y0, f.y0 + f.h, mk.color, f.y0 - 3, Esc(mk.label));
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

std::string HeatMapSvg(const ChartSpec& spec, const std::vector<std::string>& row_labels,
                       const std::vector<double>& columns, const std::vector<std::vector<double>>& rows,
                       const std::vector<Marker>& markers) {
  std::string svg = Head(spec);
  // The color range: the 2nd to 98th percentile, so that one slow first step does not wash out the rest
  // (values beyond it take the end colors).
  std::vector<double> all;
  for (const auto& r : rows) {
    for (double v : r) {
      if (std::isfinite(v)) all.push_back(v);
    }
  }
  std::sort(all.begin(), all.end());
  double lo = all.empty() ? 0 : all[all.size() * 2 / 100];
  double hi = all.empty() ? 1 : all[std::min(all.size() - 1, all.size() * 98 / 100)];
  if (hi <= lo) hi = lo + 1e-12;
  const double x0 = 170, y0 = 40, w = spec.width - x0 - 90, h = spec.height - y0 - 50;
  const double cw = w / static_cast<double>(std::max<size_t>(1, columns.size()));
  const double rh = h / static_cast<double>(std::max<size_t>(1, rows.size()));
  // White (fast) to dark red (slow) over [lo, hi].
  auto color = [&](double v) {
    const double t = std::clamp((v - lo) / (hi - lo), 0.0, 1.0);
    const int r = static_cast<int>(255 - 80 * t), g = static_cast<int>(245 - 225 * t),
              b = static_cast<int>(235 - 215 * t);
    return fmt::format("#{:02x}{:02x}{:02x}", r, g, b);
  };
  for (size_t r = 0; r < rows.size(); ++r) {
    const double y = y0 + rh * static_cast<double>(r);
    svg += fmt::format(
        "<g class=\"heat-row\" data-row=\"{}\">\n<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n", r,
        x0 - 6, y + rh / 2 + 4, Esc(r < row_labels.size() ? row_labels[r] : ""));
    for (size_t c = 0; c < columns.size() && c < rows[r].size(); ++c) {
      const double v = rows[r][c];
      if (!std::isfinite(v)) continue;
      svg += fmt::format(
          "<rect x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" height=\"{:.2f}\" fill=\"{}\"><title>{}, step {:g}: "
          "{}</title></rect>\n",
          x0 + cw * static_cast<double>(c), y, std::max(cw, 0.5), std::max(rh - 1, 0.5), color(v),
          Esc(r < row_labels.size() ? row_labels[r] : ""), columns[c], Esc(fmt::format("{:.4g} s", v)));
    }
    svg += "</g>\n";
  }
  // Column ticks (steps) and markers.
  const auto ticks = columns.empty() ? std::vector<double>{} : Ticks(columns.front(), columns.back(), 8);
  auto X = [&](double step) {
    if (columns.empty()) return x0;
    const auto it = std::lower_bound(columns.begin(), columns.end(), step);
    return x0 + cw * static_cast<double>(it - columns.begin()) + cw / 2;
  };
  for (double t : ticks) {
    if (columns.empty() || t < columns.front() || t > columns.back()) continue;
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n", X(t), y0 + h + 16,
                       Esc(Num(t)));
  }
  svg += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", x0 + w / 2, spec.height - 6,
                     Esc(spec.x_label));
  for (const auto& mk : markers) {
    svg += fmt::format(
        "<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"{3}\" stroke-width=\"1.5\"/>"
        "<text x=\"{0:.1f}\" y=\"{4:.1f}\" fill=\"{3}\" font-size=\"10\" text-anchor=\"middle\">{5}</text>\n",
        X(mk.x), y0, y0 + h, mk.color, y0 - 3, Esc(mk.label));
  }
  // The color scale.
  for (int i = 0; i < 10; ++i) {
    svg += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"14\" height=\"{:.1f}\" fill=\"{}\"/>\n", x0 + w + 20,
                       y0 + h - (i + 1) * h / 10, h / 10, color(lo + (hi - lo) * (i + 0.5) / 10));
  }
  svg +=
      fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\">{}</text><text x=\"{:.1f}\" y=\"{:.1f}\">{}</text>\n", x0 + w + 38,
                  y0 + 10, Esc(fmt::format("{:.3g} s", hi)), x0 + w + 38, y0 + h, Esc(fmt::format("{:.3g} s", lo)));
  return svg + "</svg>\n";
}

std::string TimelineSvg(const ChartSpec& spec, const std::vector<std::string>& row_labels,
                        const std::vector<Span>& spans) {
  std::string svg = Head(spec);
  double t0 = INFINITY, t1 = -INFINITY;
  for (const auto& s : spans) t0 = std::min(t0, s.start), t1 = std::max(t1, s.end);
  if (!std::isfinite(t0)) t0 = 0, t1 = 1;
  if (t1 <= t0) t1 = t0 + 1e-6;
  const double x0 = 200, y0 = 40, w = spec.width - x0 - 20, h = spec.height - y0 - 50;
  const double rh = h / static_cast<double>(std::max<size_t>(1, row_labels.size()));
  auto X = [&](double t) { return x0 + (t - t0) / (t1 - t0) * w; };
  std::vector<std::string> keys;
  for (size_t r = 0; r < row_labels.size(); ++r) {
    const double y = y0 + rh * static_cast<double>(r);
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\" font-size=\"10\">{}</text>\n", x0 - 6,
                       y + rh / 2 + 3, Esc(row_labels[r]));
    if (r % 2) {
      svg += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"#f4f4f4\"/>\n", x0,
                         y, w, rh);
    }
  }
  for (const auto& s : spans) {
    auto it = std::find(keys.begin(), keys.end(), s.key);
    if (it == keys.end()) it = keys.insert(keys.end(), s.key);
    const size_t k = static_cast<size_t>(it - keys.begin());
    svg += fmt::format(
        "<rect class=\"span\" x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" height=\"{:.2f}\" fill=\"{}\"><title>{} "
        "({:.3f} ms)</title></rect>\n",
        X(s.start), y0 + rh * s.row + 1, std::max(0.5, X(s.end) - X(s.start)), std::max(0.5, rh - 2), kColors[k % 8],
        Esc(s.name), (s.end - s.start) * 1e3);
  }
  for (double t : Ticks(0, (t1 - t0) * 1e3, 8)) {
    if (t > (t1 - t0) * 1e3) continue;
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n", X(t0 + t / 1e3),
                       y0 + h + 16, Esc(Num(t)));
  }
  svg += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", x0 + w / 2, spec.height - 6,
                     Esc(spec.x_label));
  double lx = x0;
  for (size_t k = 0; k < keys.size(); ++k) {
    svg += fmt::format(
        "<rect x=\"{:.1f}\" y=\"26\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{:.1f}\" y=\"35\">{}</text>\n",
        lx, kColors[k % 8], lx + 14, Esc(keys[k]));
    lx += 30 + 7.0 * static_cast<double>(keys[k].size());
  }
  return svg + "</svg>\n";
}

}  // namespace ms::report
