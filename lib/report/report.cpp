// megascale report RUN_DIR: a run's files -> one self-contained HTML page and its charts (report.h).
#include <dirent.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <set>

#include "config/config.h"
#include "report/report.h"

namespace ms::report {
namespace {

// One parsed JSON object of a .jsonl file: string and number values of its top-level keys (nested
// values are skipped).
struct Row {
  std::map<std::string, std::string> s;
  std::map<std::string, double> n;
  double Num(const std::string& k, double dflt = std::nan("")) const {
    auto it = n.find(k);
    return it == n.end() ? dflt : it->second;
  }
  std::string Str(const std::string& k) const {
    auto it = s.find(k);
    return it == s.end() ? std::string() : it->second;
  }
};

class JsonScanner {
 public:
  explicit JsonScanner(std::string_view t) : t_(t) {}
  bool Object(Row* row) {
    Ws();
    if (!Eat('{')) return false;
    Ws();
    if (Eat('}')) return AtEnd();
    for (;;) {
      std::string key;
      Ws();
      if (!String(&key)) return false;
      Ws();
      if (!Eat(':')) return false;
      Ws();
      if (Peek() == '"') {
        std::string v;
        if (!String(&v)) return false;
        row->s[key] = v;
      } else if (Peek() == '{' || Peek() == '[') {
        if (!Skip()) return false;
      } else {
        size_t start = i_;
        while (i_ < t_.size() && std::string_view(",}] \t\r\n").find(t_[i_]) == std::string_view::npos) ++i_;
        const std::string lit(t_.substr(start, i_ - start));
        if (lit.empty()) return false;
        if (lit == "true" || lit == "false" || lit == "null") {
          row->n[key] = lit == "true" ? 1 : lit == "false" ? 0 : std::nan("");
        } else {
          char* end = nullptr;
          const double v = std::strtod(lit.c_str(), &end);
          if (end == lit.c_str() || *end != '\0') return false;
          row->n[key] = v;
        }
      }
      Ws();
      if (Eat(',')) continue;
      if (Eat('}')) return AtEnd();
      return false;
    }
  }

 private:
  char Peek() const { return i_ < t_.size() ? t_[i_] : '\0'; }
  bool Eat(char c) {
    if (Peek() != c) return false;
    ++i_;
    return true;
  }
  void Ws() {
    while (i_ < t_.size() && std::isspace(static_cast<unsigned char>(t_[i_]))) ++i_;
  }
  bool AtEnd() {
    Ws();
    return i_ == t_.size();
  }
  bool String(std::string* out) {
    if (!Eat('"')) return false;
    while (i_ < t_.size() && t_[i_] != '"') {
      char c = t_[i_++];
      if (c == '\\') {
        if (i_ >= t_.size()) return false;
        const char e = t_[i_++];
        if (e == 'u') {
          if (i_ + 4 > t_.size()) return false;
          const unsigned cp = static_cast<unsigned>(std::stoul(std::string(t_.substr(i_, 4)), nullptr, 16));
          i_ += 4;
          if (cp < 0x80) {
            *out += static_cast<char>(cp);
          } else if (cp < 0x800) {
            *out += static_cast<char>(0xC0 | (cp >> 6));
            *out += static_cast<char>(0x80 | (cp & 0x3F));
          } else {
            *out += static_cast<char>(0xE0 | (cp >> 12));
            *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            *out += static_cast<char>(0x80 | (cp & 0x3F));
          }
          continue;
        }
        c = e == 'n' ? '\n' : e == 't' ? '\t' : e == 'r' ? '\r' : e == 'b' ? '\b' : e == 'f' ? '\f' : e;
      }
      *out += c;
    }
    return Eat('"');
  }
  bool Skip() {  // a nested object or array, strings respected
    int depth = 0;
    while (i_ < t_.size()) {
      const char c = t_[i_];
      if (c == '"') {
        std::string ignored;
        if (!String(&ignored)) return false;
        continue;
      }
      ++i_;
      if (c == '{' || c == '[') ++depth;
      if (c == '}' || c == ']') {
        if (--depth == 0) return true;
      }
    }
    return false;
  }
  std::string_view t_;
  size_t i_ = 0;
};

// The rows of a .jsonl file; unparsable lines are skipped with a warning. Missing file: empty.
std::vector<Row> ReadJsonl(const std::string& path, std::vector<std::string>* warnings, bool* exists = nullptr) {
  std::vector<Row> rows;
  std::ifstream in(path);
  if (exists) *exists = static_cast<bool>(in);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    Row row;
    if (JsonScanner(line).Object(&row)) {
      rows.push_back(std::move(row));
    } else {
      warnings->push_back(fmt::format(
          "{}:{}: not a complete JSON object (a run still writing, or one that stopped mid-line): skipped", path, n));
    }
  }
  return rows;
}

std::string Esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<') {
      o += "&lt;";
    } else if (c == '>') {
      o += "&gt;";
    } else if (c == '&') {
      o += "&amp;";
    } else if (c == '"') {
      o += "&quot;";
    } else {
      o += c;
    }
  }
  return o;
}

double Median(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return !std::isfinite(x); }), v.end());
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// A rank's place in the 3D grid (rank = (dp * pp + pp_idx) * tp + tp_idx).
struct Coords {
  int tp = 0, pp = 0, dp = 0;
};
Coords CoordsOf(int rank, int tp, int pp) {
  Coords c;
  c.tp = rank % tp;
  c.pp = (rank / tp) % pp;
  c.dp = rank / (tp * pp);
  return c;
}
std::string RankLabel(int rank, int tp, int pp) {
  const Coords c = CoordsOf(rank, tp, pp);
  return fmt::format("rank {} (dp {}, pp {}, tp {})", rank, c.dp, c.pp, c.tp);
}

// One rank's trace: its spans (seconds on the wall clock) and where each optimizer step ended.
struct RankTrace {
  int rank = 0;
  std::vector<std::pair<std::string, std::string>> lanes;  // tid -> lane name
  struct Ev {
    std::string name;
    int tid = 0;
    double start = 0, end = 0;
  };
  std::vector<Ev> events;
  std::map<int64_t, double> step_end;  // "optimizer step N" end
};

Result<RankTrace> ReadTrace(const std::string& path, std::vector<std::string>* warnings) {
  MS_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  RankTrace t;
  double origin = 0;
  std::map<int, std::string> lanes;
  // The writer puts one event per line (metrics::Trace::Write).
  size_t at = 0;
  int line_no = 0;
  while (at < text.size()) {
    size_t nl = text.find('\n', at);
    if (nl == std::string::npos) nl = text.size();
    std::string line = text.substr(at, nl - at);
    at = nl + 1;
    ++line_no;
    while (!line.empty() && (line.back() == ',' || line.back() == '\r')) line.pop_back();
    if (line.empty() || line == "[" || line == "]") continue;
    Row row;
    if (!JsonScanner(line).Object(&row)) {
      warnings->push_back(fmt::format("{}:{}: not a complete trace event: skipped", path, line_no));
      continue;
    }
    const std::string ph = row.Str("ph"), name = row.Str("name");
    t.rank = static_cast<int>(row.Num("pid", t.rank));
    if (ph == "M") {
      const size_t u = line.find("\"unix_s\": ");
      if (name == "clock_origin" && u != std::string::npos) origin = std::strtod(line.c_str() + u + 10, nullptr);
      const size_t nm = line.find("\"args\": {\"name\": \"");
      if (name == "thread_name" && nm != std::string::npos) {
        const size_t b = nm + 18, e = line.find('"', b);
        lanes[static_cast<int>(row.Num("tid", 0))] = line.substr(b, e - b);
      }
      continue;
    }
    if (ph != "X") continue;
    RankTrace::Ev ev;
    ev.name = name;
    ev.tid = static_cast<int>(row.Num("tid", 0));
    ev.start = row.Num("ts", 0) * 1e-6;
    ev.end = ev.start + row.Num("dur", 0) * 1e-6;
    t.events.push_back(ev);
  }
  if (origin == 0)
    warnings->push_back(fmt::format("{}: no clock_origin (an older trace): ranks may not line up", path));
  for (auto& e : t.events) {
    e.start += origin;
    e.end += origin;
    if (e.name.rfind("optimizer step ", 0) == 0) t.step_end[std::stoll(e.name.substr(15))] = e.end;
  }
  for (const auto& [tid, name] : lanes) t.lanes.emplace_back(std::to_string(tid), name);
  return t;
}

std::string LaneName(const RankTrace& t, int tid) {
  for (const auto& [id, name] : t.lanes) {
    if (id == std::to_string(tid)) return name;
  }
  return fmt::format("lane {}", tid);
}

}  // namespace

Result<ReportResult> WriteReport(const ReportOptions& options) {
  ReportResult out;
  const std::string& run = options.run_dir;
  const std::string dir = options.output.empty() ? run + "/report" : options.output;
  bool have_metrics = false;
  std::vector<Row> metrics = ReadJsonl(run + "/metrics.jsonl", &out.warnings, &have_metrics);
  if (!have_metrics) {
    return NotFound(
        "{}/metrics.jsonl does not exist: is {} the log.run_dir of a run (it holds job.yaml and "
        "metrics.jsonl)?",
        run, run);
  }
  // The layout.
  int tp = 1, pp = 1, dp = 1;
  std::string name = run;
  auto spec = config::LoadJobSpec(run + "/job.yaml");
  if (spec.ok()) {
    tp = spec->parallel.tp;
    pp = spec->parallel.pp;
    dp = spec->parallel.dp > 0 ? spec->parallel.dp : 1;
    name = spec->name;
  } else {
    out.warnings.push_back(
        fmt::format("{}/job.yaml: {}: the ranks' coordinates are not shown", run, spec.status().message()));
  }
  const int world = tp * pp * dp;

  // Training rows by step (a step recomputed after a restart: its last row), evaluations, checkpoints.
  std::map<int64_t, Row> train;
  std::vector<Row> evals, ckpts, faults_in_metrics;
  for (auto& r : metrics) {
    const std::string phase = r.Str("phase");
    if (phase == "train" && std::isfinite(r.Num("step"))) train[static_cast<int64_t>(r.Num("step"))] = r;
    if (phase == "eval") evals.push_back(r);
    if (phase == "checkpoint" && r.Str("status") == "committed") ckpts.push_back(r);
    if (phase == "fault") faults_in_metrics.push_back(r);
  }
  if (train.empty()) out.warnings.push_back(fmt::format("{}/metrics.jsonl has no training step yet", run));
  bool have_timings = false, have_events = false;
  std::vector<Row> timings = ReadJsonl(run + "/rank_timings.jsonl", &out.warnings, &have_timings);
  std::vector<Row> events = ReadJsonl(run + "/events.jsonl", &out.warnings, &have_events);

  MS_RETURN_IF_ERROR_CTX(MakeDirs(dir), "creating the report folder");
  std::vector<std::pair<std::string, std::string>> charts;  // (file, svg)
  auto add = [&](const std::string& file, std::string svg) { charts.emplace_back(file, std::move(svg)); };

  // Markers: checkpoints (committed) and faults, on the step axis.
  std::vector<Marker> step_markers;
  for (const auto& c : ckpts) step_markers.push_back({c.Num("step"), "ckpt", "#2ca02c"});
  for (const auto& e : events) {
    if (e.Str("event") == "fault") step_markers.push_back({e.Num("steps_reached", 0), e.Str("kind"), "#d62728"});
    if (e.Str("event") == "straggler") step_markers.push_back({e.Num("step", 0), "straggler", "#ff7f0e"});
  }

  // 1. Loss and validation loss.
  {
    Series loss{"loss", {}, {}, "pt-loss"}, val{"validation loss", {}, {}, "pt-val"};
    for (const auto& [step, r] : train) {
      loss.x.push_back(static_cast<double>(step));
      loss.y.push_back(r.Num("loss"));
    }
    for (const auto& e : evals) {
      val.x.push_back(e.Num("step"));
      val.y.push_back(e.Num("val_loss"));
    }
    std::vector<Series> s{loss};
    if (!val.x.empty()) s.push_back(val);
    add("loss.svg", LineChartSvg({"Loss", "step", "loss (nats per token)"}, s, step_markers));
  }
  // 2. Throughput and MFU over time (seconds since the first logged step), checkpoints marked.
  {
    double t0 = INFINITY;
    for (const auto& [step, r] : train) t0 = std::min(t0, r.Num("unix_s", INFINITY));
    const bool timed = std::isfinite(t0);
    Series tps{"tokens/s", {}, {}, ""}, mfu{"MFU (%)", {}, {}, ""};
    for (const auto& [step, r] : train) {
      const double x = timed ? r.Num("unix_s") - t0 : static_cast<double>(step);
      tps.x.push_back(x);
      tps.y.push_back(r.Num("tokens_per_s"));
      mfu.x.push_back(x);
      mfu.y.push_back(100 * r.Num("mfu"));
    }
    std::vector<Marker> time_markers;
    for (const auto& c : ckpts) {
      const double x = timed ? c.Num("unix_s") - t0 : c.Num("step");
      if (std::isfinite(x)) time_markers.push_back({x, fmt::format("ckpt {:g}", c.Num("step")), "#2ca02c"});
    }
    for (const auto& e : events) {
      if (e.Str("event") != "fault" || !timed) continue;
      time_markers.push_back({e.Num("unix_s") - t0, e.Str("kind"), "#d62728"});
    }
    const std::string xl = timed ? "seconds since the first step" : "step (the rows have no time)";
    add("throughput.svg", LineChartSvg({"Throughput", xl, "tokens/s"}, {tps}, time_markers));
    add("mfu.svg", LineChartSvg({"Model FLOPs utilization", xl, "MFU (%)"}, {mfu}, time_markers));
  }
  // 3. The step-time breakdown.
  {
    std::vector<Series> parts = {{"compute", {}, {}, ""},
                                 {"exposed communication", {}, {}, ""},
                                 {"pipeline bubble", {}, {}, ""},
                                 {"data wait", {}, {}, ""}};
    const char* keys[] = {"compute_s", "comm_exposed_s", "bubble_s", "data_wait_s"};
    for (const auto& [step, r] : train) {
      for (int i = 0; i < 4; ++i) {
        parts[i].x.push_back(static_cast<double>(step));
        parts[i].y.push_back(1e3 * r.Num(keys[i]));
      }
    }
    add("breakdown.svg", LineChartSvg({"Where a step's time goes", "step", "ms per step"}, parts));
  }
  // 4. The per-rank x step heat map of compute time.
  std::vector<int> order(world);  // ranks grouped by (dp, pp, tp): the 3D view
  for (int r = 0; r < world; ++r) order[r] = r;
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    const Coords x = CoordsOf(a, tp, pp), y = CoordsOf(b, tp, pp);
    return std::tie(x.dp, x.pp, x.tp) < std::tie(y.dp, y.pp, y.tp);
  });
  size_t heat_rows = 0;
  {
    std::set<int64_t> steps;
    std::map<std::pair<int, int64_t>, double> compute;
    int max_rank = world - 1;
    for (const auto& t : timings) {
      const int rank = static_cast<int>(t.Num("rank", -1));
      const int64_t step = static_cast<int64_t>(t.Num("step", -1));
      if (rank < 0 || step < 0) continue;
      steps.insert(step);
      compute[{rank, step}] = t.Num("compute_s");
      max_rank = std::max(max_rank, rank);
    }
    if (steps.empty()) {
      out.warnings.push_back(
          fmt::format("{}/rank_timings.jsonl {}: no per-rank heat map (multi-rank runs with heartbeats write it)", run,
                      have_timings ? "is empty" : "does not exist"));
    } else {
      std::vector<double> cols(steps.begin(), steps.end());
      std::vector<std::string> labels;
      std::vector<std::vector<double>> rows;
      std::vector<int> ranks = order;
      for (int r = world; r <= max_rank; ++r) ranks.push_back(r);
      for (int r : ranks) {
        labels.push_back(RankLabel(r, tp, pp));
        std::vector<double> row;
        for (int64_t s : steps) {
          auto it = compute.find({r, s});
          row.push_back(it == compute.end() ? std::nan("") : it->second);
        }
        rows.push_back(std::move(row));
      }
      heat_rows = rows.size();
      ChartSpec cs{"Compute time per rank and step (stragglers are dark)", "step", "rank"};
      cs.width = 1000;
      cs.height = std::max(220, 90 + 22 * static_cast<int>(rows.size()));
      add("heatmap.svg", HeatMapSvg(cs, labels, cols, rows, step_markers));
    }
  }
  // 5. The merged timeline of one step, from the ranks' traces.
  std::string timeline_note;
  int64_t timeline_step = -1;
  {
    std::vector<RankTrace> traces;
    if (DIR* d = ::opendir((run + "/trace").c_str())) {
      while (dirent* e = ::readdir(d)) {
        const std::string f = e->d_name;
        if (f.rfind("rank-", 0) == 0 && f.ends_with(".json")) {
          auto t = ReadTrace(run + "/trace/" + f, &out.warnings);
          if (t.ok()) {
            traces.push_back(std::move(t).value());
          } else {
            out.warnings.push_back(t.status().message());
          }
        }
      }
      ::closedir(d);
    }
    if (traces.empty()) {
      timeline_note = "No traces in this run (set log.trace: true to record them): no timeline.";
    } else {
      // The chosen step, else the last one every rank has.
      int64_t common = INT64_MAX;
      for (const auto& t : traces) common = std::min(common, t.step_end.empty() ? -1 : t.step_end.rbegin()->first);
      timeline_step = options.step >= 0 ? options.step : common;
      std::sort(traces.begin(), traces.end(), [&](const RankTrace& a, const RankTrace& b) {
        return std::find(order.begin(), order.end(), a.rank) < std::find(order.begin(), order.end(), b.rank);
      });
      std::vector<std::string> labels;
      std::vector<Span> spans;
      std::string chrome = "[\n";
      int sort_index = 0;
      bool any = false;
      for (const auto& t : traces) {
        auto end_it = t.step_end.find(timeline_step);
        if (end_it == t.step_end.end()) continue;
        auto prev = t.step_end.find(timeline_step - 1);
        const double begin = prev != t.step_end.end() ? prev->second : -INFINITY;
        const double end = end_it->second;
        std::map<int, int> row_of_lane;
        for (const auto& e : t.events) {
          if (e.end <= begin || e.start > end) continue;
          if (!row_of_lane.count(e.tid)) {
            row_of_lane[e.tid] = static_cast<int>(labels.size());
            labels.push_back(fmt::format("{} {}", RankLabel(t.rank, tp, pp), LaneName(t, e.tid)));
          }
          Span s;
          s.row = row_of_lane[e.tid];
          s.start = std::max(e.start, begin);
          s.end = e.end;
          s.name = e.name;
          s.key = e.name.rfind("fwd", 0) == 0                                    ? "forward"
                  : e.name.rfind("bwd", 0) == 0                                  ? "backward"
                  : e.name.rfind("optimizer", 0) == 0                            ? "optimizer"
                  : e.name.rfind("recv", 0) == 0 || e.name.rfind("send", 0) == 0 ? "pipeline p2p"
                  : e.name.rfind("checkpoint", 0) == 0                           ? "checkpoint"
                                                                                 : LaneName(t, e.tid);
          spans.push_back(s);
          any = true;
          chrome += fmt::format(
              "{}{{\"name\": \"{}\", \"ph\": \"X\", \"pid\": {}, \"tid\": {}, \"ts\": {:.3f}, \"dur\": {:.3f}}}",
              chrome.size() > 2 ? ",\n" : "", JsonEscape(e.name), t.rank, e.tid, s.start * 1e6,
              (s.end - s.start) * 1e6);
        }
        chrome += fmt::format(
            "{0}{{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": {1}, \"args\": {{\"name\": \"{2}\"}}}},\n"
            "{{\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": {1}, \"args\": {{\"sort_index\": {3}}}}}",
            chrome.size() > 2 ? ",\n" : "", t.rank, JsonEscape(RankLabel(t.rank, tp, pp)), sort_index++);
        for (const auto& [tid, lane] : t.lanes) {
          chrome += fmt::format(
              ",\n{{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": {}, \"tid\": {}, \"args\": {{\"name\": "
              "\"{}\"}}}}",
              t.rank, tid, JsonEscape(lane));
        }
      }
      chrome += "\n]\n";
      if (!any) {
        timeline_note = fmt::format("The traces hold no step {}: no timeline.", timeline_step);
      } else {
        ChartSpec cs{fmt::format("Step {} on every rank (grouped by dp, pp, tp)", timeline_step), "milliseconds", ""};
        cs.width = 1100;
        cs.height = std::max(240, 100 + 18 * static_cast<int>(labels.size()));
        add("timeline.svg", TimelineSvg(cs, labels, spans));
        const std::string file = fmt::format("{}/timeline-step-{}.json", dir, timeline_step);
        MS_RETURN_IF_ERROR(WriteFileAtomic(file, chrome));
        out.files.push_back(file);
      }
    }
  }

  // The page.
  auto median_of = [&](const char* key) {
    std::vector<double> v;
    for (const auto& [s, r] : train) v.push_back(r.Num(key));
    return Median(v);
  };
  std::string html = fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>megascale report: {0}</title>\n"
      "<style>body{{font-family:sans-serif;margin:24px;color:#222;max-width:1200px}}h1{{font-size:22px}}"
      "h2{{font-size:17px;margin-top:28px}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:3px "
      "8px;font-size:13px;text-align:left}}.warn{{color:#a33}}.chart{{margin:8px 0}}</style></head><body>\n"
      "<h1>megascale report: {0}</h1>\n<p>Run directory <code>{1}</code>; layout tp {2} &times; pp {3} &times; dp {4} "
      "({5} ranks).</p>\n",
      Esc(name), Esc(run), tp, pp, dp, world);
  if (!train.empty()) {
    const auto& last = train.rbegin()->second;
    html += fmt::format(
        "<table id=\"summary\"><tr><th>steps logged</th><th>last step</th><th>last loss</th><th>median "
        "tokens/s</th><th>median MFU</th><th>median step</th><th>checkpoints</th><th>faults</th></tr>"
        "<tr><td>{}</td><td>{}</td><td>{:.4f}</td><td>{:.0f}</td><td>{:.2f} %</td><td>{:.1f} ms</td><td>{}</td>"
        "<td>{}</td></tr></table>\n",
        train.size(), train.rbegin()->first, last.Num("loss"), median_of("tokens_per_s"), 100 * median_of("mfu"),
        1e3 * median_of("step_s"), ckpts.size(),
        std::count_if(events.begin(), events.end(), [](const Row& e) { return e.Str("event") == "fault"; }));
  }
  if (!out.warnings.empty()) {
    html += "<h2>Warnings</h2><ul>";
    for (const auto& w : out.warnings) html += "<li class=\"warn\">" + Esc(w) + "</li>";
    html += "</ul>\n";
  }
  const std::map<std::string, std::string> titles = {{"loss.svg", "Loss"},
                                                     {"throughput.svg", "Throughput (checkpoints and faults marked)"},
                                                     {"mfu.svg", "MFU"},
                                                     {"breakdown.svg", "Step-time breakdown"},
                                                     {"heatmap.svg", "Compute time per rank and step"},
                                                     {"timeline.svg", "Timeline of one step, all ranks"}};
  for (const auto& [file, svg] : charts) {
    const std::string path = dir + "/" + file;
    MS_RETURN_IF_ERROR(WriteFileAtomic(path, svg));
    out.files.push_back(path);
    html += fmt::format("<h2>{}</h2>\n<div class=\"chart\" id=\"{}\">\n{}</div>\n", Esc(titles.at(file)),
                        file.substr(0, file.size() - 4), svg);
    if (file == "timeline.svg") {
      html += fmt::format("<p>The same step as one Chrome/Perfetto trace: <code>timeline-step-{}.json</code>.</p>\n",
                          timeline_step);
    }
  }
  if (!timeline_note.empty()) html += "<h2>Timeline</h2><p>" + Esc(timeline_note) + "</p>\n";
  // Events of the driver.
  html += "<h2>Events</h2>\n";
  if (!have_events || events.empty()) {
    html += "<p>No events.jsonl (single-rank runs have no driver events).</p>\n";
  } else {
    html += "<table id=\"events\"><tr><th>time</th><th>event</th><th>detail</th></tr>\n";
    for (const auto& e : events) {
      std::string detail;
      for (const auto& [k, v] : e.s) {
        if (k != "time" && k != "event") detail += k + "=" + v + " ";
      }
      for (const auto& [k, v] : e.n) {
        if (k != "unix_s") detail += fmt::format("{}={:g} ", k, v);
      }
      html += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td></tr>\n", Esc(e.Str("time")), Esc(e.Str("event")),
                          Esc(detail));
    }
    html += "</table>\n";
  }
  html += fmt::format("<p>{} heat-map rows; written by megascale {}.</p>\n</body></html>\n", heat_rows, Version());
  out.page = dir + "/index.html";
  MS_RETURN_IF_ERROR(WriteFileAtomic(out.page, html));
  out.files.push_back(out.page);
  return out;
}

}  // namespace ms::report
