// megascale bench: the sweep (points, their processes, their measurements, the outputs).
#include "bench/bench.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <map>
#include <sstream>

#include "config/config.h"
#include "report/report.h"
#include "runner/runner.h"

extern char** environ;

namespace ms::bench {
namespace {

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The number after "key": in a flat JSON line (NaN when absent).
double NumberField(const std::string& line, std::string_view key) {
  const std::string pat = fmt::format("\"{}\": ", key);
  const size_t at = line.find(pat);
  if (at == std::string::npos) return std::nan("");
  return std::strtod(line.c_str() + at + pat.size(), nullptr);
}
bool IsPhase(const std::string& line, std::string_view phase) {
  return line.find(fmt::format("\"phase\": \"{}\"", phase)) != std::string::npos;
}

std::string ShortKey(const std::string& key) {
  const size_t dot = key.rfind('.');
  return dot == std::string::npos ? key : key.substr(dot + 1);
}
std::string Label(const PointResult& p) {
  std::string s = p.case_name;
  for (const auto& [k, v] : p.settings) s += (s.empty() ? "" : " ") + ShortKey(k) + "=" + v;
  return s.empty() ? "base" : s;
}

std::string CsvQuote(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string o = "\"";
  for (char c : s) o += c == '"' ? std::string("\"\"") : std::string(1, c);
  return o + "\"";
}

std::string Duration(double s) {
  const int t = static_cast<int>(std::lround(std::max(0.0, s)));
  return t >= 3600 ? fmt::format("{}:{:02d}:{:02d}", t / 3600, t / 60 % 60, t % 60)
                   : fmt::format("{}:{:02d}", t / 60, t % 60);
}

// The spec file without its bench: section, and that section.
struct Case {
  std::string name;
  std::vector<std::pair<std::string, std::string>> settings;
};

struct SweepFile {
  std::string spec_yaml;
  std::vector<Axis> vary;
  std::vector<Case> cases;
  int steps = 0, warmup = -1;
};

Result<SweepFile> ReadSweepFile(const std::string& path) {
  MS_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  SweepFile out;
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return InvalidArgument("{}:{}:{}: {}", path, e.mark.line + 1, e.mark.column + 1, e.msg);
  }
  if (!root.IsMap() || !root["bench"]) {
    out.spec_yaml = text;
    return out;
  }
  const YAML::Node b = root["bench"];
  const auto where = [&](const YAML::Node& n) { return fmt::format("{}:{}", path, n.Mark().line + 1); };
  if (!b.IsMap())
    return InvalidArgument("{}: bench: must be a map {{vary: {{key: [values]}}, steps, warmup}}", where(b));
  for (const auto& kv : b) {
    const std::string key = kv.first.as<std::string>();
    if (key == "vary") {
      if (!kv.second.IsMap())
        return InvalidArgument("{}: bench.vary: must map keys to lists of values", where(kv.second));
      for (const auto& axis : kv.second) {
        Axis a;
        a.key = axis.first.as<std::string>();
        if (axis.second.IsSequence()) {
          for (const auto& v : axis.second) a.values.push_back(v.as<std::string>());
        } else if (axis.second.IsScalar()) {
          a.values.push_back(axis.second.as<std::string>());
        }
        if (a.values.empty()) return InvalidArgument("{}: bench.vary.{}: no values", where(axis.second), a.key);
        out.vary.push_back(std::move(a));
      }
    } else if (key == "cases") {
      if (!kv.second.IsSequence()) {
        return InvalidArgument("{}: bench.cases: a list of {{name: ..., set: {{key: value}}}}", where(kv.second));
      }
      for (const auto& c : kv.second) {
        Case one;
        if (!c.IsMap() || !c["name"]) return InvalidArgument("{}: bench.cases: each case needs a name", where(c));
        one.name = c["name"].as<std::string>();
        for (const auto& f : c) {
          const std::string fk = f.first.as<std::string>();
          if (fk == "name") continue;
          if (fk != "set" || !f.second.IsMap()) {
            return InvalidArgument("{}: bench.cases[{}]: unknown key {}; a case is {{name: ..., set: {{key: value}}}}",
                                   where(f.first), one.name, fk);
          }
          for (const auto& kvs : f.second) {
            one.settings.emplace_back(kvs.first.as<std::string>(), kvs.second.as<std::string>());
          }
        }
        out.cases.push_back(std::move(one));
      }
    } else if (key == "steps" || key == "warmup") {
      int v = 0;
      try {
        v = kv.second.as<int>();
      } catch (const YAML::Exception&) {
        return InvalidArgument("{}: bench.{}: not an integer", where(kv.second), key);
      }
      if (v < (key == "steps" ? 1 : 0))
        return InvalidArgument("{}: bench.{} = {} is too small", where(kv.second), key, v);
      (key == "steps" ? out.steps : out.warmup) = v;
    } else {
      return InvalidArgument("{}: bench.{}: unknown key; known: vary, cases, steps, warmup", where(kv.first), key);
    }
  }
  root.remove("bench");
  YAML::Emitter em;
  em << root;
  out.spec_yaml = em.c_str();
  return out;
}

// Runs argv with stdout and stderr into `log`, in its own process group; kills the group after timeout_s. A stop
// signal to the bench (runner::InstallStopSignals; Ctrl-C reaches only the terminal's foreground group, the bench's)
// is passed on to the point's group as SIGINT — the point stops after its current step, saving nothing — and the
// point's processes are killed at a second signal or after kStopGraceS; the result is then Aborted and *stopped_by
// the signal, so that no point's processes outlive the bench.
constexpr double kStopGraceS = 60;

Result<int> RunProcess(const std::vector<std::string>& argv, const std::string& log, double timeout_s, double* wall_s,
                       int* stopped_by) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t dfl;  // ignored here (InstallStopSignals), and SIG_IGN survives exec
  sigemptyset(&dfl);
  sigaddset(&dfl, SIGPIPE);
  posix_spawnattr_setsigdefault(&attr, &dfl);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGDEF);
  posix_spawnattr_setpgroup(&attr, 0);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, args[0], &fa, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) return ErrnoError(fmt::format("starting {}", argv[0]), rc);
  const double t0 = NowSeconds();
  int status = 0;
  bool killed = false;
  int stop_signal = 0;
  double stop_deadline = 0;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0 && errno != EINTR) return ErrnoError("waiting for a bench point", errno);
    if (const int sig = runner::TakeStopSignal(); sig != 0) {
      if (stop_signal == 0) {
        stop_signal = sig;
        stop_deadline = NowSeconds() + kStopGraceS;
        std::fprintf(stderr, "bench: got %s: stopping the running point (send it again to kill it now)\n",
                     sig == SIGINT ? "SIGINT" : "SIGTERM");
        ::kill(-pid, SIGINT);
      } else {
        ::kill(-pid, SIGKILL);
      }
    }
    if (stop_signal != 0 && NowSeconds() > stop_deadline) {
      ::kill(-pid, SIGKILL);
      stop_deadline = 1e300;
    }
    if (!killed && NowSeconds() - t0 > timeout_s) {
      ::kill(-pid, SIGTERM);
      ::usleep(2000000);
      ::kill(-pid, SIGKILL);
      killed = true;
    }
    ::usleep(50000);
  }
  *wall_s = NowSeconds() - t0;
  *stopped_by = stop_signal;
  if (stop_signal != 0) return Aborted("stopped by {} to the bench", stop_signal == SIGINT ? "SIGINT" : "SIGTERM");
  if (killed) return Timeout("stopped after {:.0f} s (the point timeout)", timeout_s);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return WEXITSTATUS(status);
}

// The last "error: ..." line of a point's log (else its last line).
std::string FailureReason(const std::string& log, int code) {
  std::ifstream in(log);
  std::string line, last, error;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    last = line;
    if (line.rfind("error: ", 0) == 0) error = line.substr(7);
  }
  std::string why = !error.empty() ? error : last;
  if (why.size() > 400) why = why.substr(0, 400) + "...";
  return fmt::format("exit {}: {}", code, why);
}

void Summarize(const std::string& run_dir, const std::string& log, int warmup, PointResult* p) {
  std::ifstream in(run_dir + "/metrics.jsonl");
  std::string line;
  std::vector<double> step, tps, flops, mfu, compute, comm, bubble, data;
  while (std::getline(in, line)) {
    if (!IsPhase(line, "train") || NumberField(line, "step") <= warmup) continue;
    step.push_back(NumberField(line, "step_s"));
    tps.push_back(NumberField(line, "tokens_per_s"));
    flops.push_back(NumberField(line, "flops_per_s"));
    mfu.push_back(NumberField(line, "mfu"));
    compute.push_back(NumberField(line, "compute_s"));
    comm.push_back(NumberField(line, "comm_exposed_s"));
    bubble.push_back(NumberField(line, "bubble_s"));
    data.push_back(NumberField(line, "data_wait_s"));
    const double mem = NumberField(line, "device_mem_peak_mib");  // NaN where absent
    if (mem > p->device_mem_peak_mib) p->device_mem_peak_mib = mem;
  }
  p->measured_steps = static_cast<int>(step.size());
  if (step.empty()) {
    p->status = "failed";
    p->reason = "no measured step in metrics.jsonl";
    return;
  }
  p->step_s = Median(step);
  p->step_spread = (*std::max_element(step.begin(), step.end()) - *std::min_element(step.begin(), step.end())) /
                   std::max(1e-12, p->step_s);
  // Rates at the median step: each step's rate times its time is its amount of work (tokens, FLOPs, peak
  // fraction x seconds: the same every step), divided by the median step time. (Medians of the per-step rates
  // would not match the median step: with 4 noisy steps they were 40 % apart.)
  auto at_median_step = [&](const std::vector<double>& rate) {
    std::vector<double> work(rate.size());
    for (size_t i = 0; i < rate.size(); ++i) work[i] = rate[i] * step[i];
    return Median(work) / std::max(1e-12, p->step_s);
  };
  p->tokens_per_s = at_median_step(tps);
  p->flops_per_device = at_median_step(flops) / std::max(1, p->world);
  p->mfu = at_median_step(mfu);
  p->compute_s = Median(compute);
  p->comm_exposed_s = Median(comm);
  p->bubble_s = Median(bubble);
  p->data_wait_s = Median(data);
  // The peak rank 0 divided by: "peak 80.7 GFLOP/s per rank (source)".
  std::ifstream lg(log);
  while (std::getline(lg, line)) {
    const size_t at = line.find("; peak ");
    if (at == std::string::npos) continue;
    p->peak_flops = std::strtod(line.c_str() + at + 7, nullptr) * 1e9;
    const size_t open = line.find('(', at), close = line.rfind(')');
    if (open != std::string::npos && close != std::string::npos && close > open) {
      p->peak_source = line.substr(open + 1, close - open - 1);
    }
  }
}

std::string Rate(double flops) {
  if (flops >= 1e12) return fmt::format("{:.2f} T", flops / 1e12);
  return fmt::format("{:.2f} G", flops / 1e9);
}

void PrintTable(const std::vector<PointResult>& points, const std::vector<Axis>& axes, bool cases) {
  std::vector<std::string> head;
  for (const auto& a : axes) head.push_back(ShortKey(a.key));
  std::vector<int> w;
  for (size_t i = 0; i < axes.size(); ++i) {
    int m = static_cast<int>(head[i].size());
    for (const auto& p : points) m = std::max(m, static_cast<int>(p.settings[i].second.size()));
    w.push_back(m);
  }
  int wc = 4;
  for (const auto& p : points) wc = std::max(wc, static_cast<int>(p.case_name.size()));
  std::string line = cases ? fmt::format("{:<{}}  ", "case", wc) : std::string();
  for (size_t i = 0; i < axes.size(); ++i) line += fmt::format("{:<{}}  ", head[i], w[i]);
  line += fmt::format("{:>16} {:>11} {:>14} {:>7} {:>8} {:>7} {:>7} {:>7}", "step ms (spread)", "tokens/s",
                      "FLOP/s/device", "MFU", "compute", "comm", "bubble", "data");
  // Peak device memory, where some point reports it (the CUDA backend).
  const bool mem = std::any_of(points.begin(), points.end(),
                               [](const PointResult& p) { return p.status == "ok" && p.device_mem_peak_mib > 0; });
  if (mem) line += fmt::format(" {:>9}", "mem MiB");
  std::printf("%s\n", line.c_str());
  for (const auto& p : points) {
    line = cases ? fmt::format("{:<{}}  ", p.case_name, wc) : std::string();
    for (size_t i = 0; i < axes.size(); ++i) line += fmt::format("{:<{}}  ", p.settings[i].second, w[i]);
    if (p.status != "ok") {
      line += fmt::format("{}: {}", p.status, p.reason);
    } else {
      const double s = std::max(1e-12, p.step_s);
      line += fmt::format("{:>9.2f} (±{:>3.0f}%) {:>11.0f} {:>14} {:>6.2f}% {:>7.0f}% {:>6.0f}% {:>6.0f}% {:>6.0f}%",
                          p.step_s * 1e3, 50 * p.step_spread, p.tokens_per_s, Rate(p.flops_per_device) + "FLOP/s",
                          100 * p.mfu, 100 * p.compute_s / s, 100 * p.comm_exposed_s / s, 100 * p.bubble_s / s,
                          100 * p.data_wait_s / s);
      if (mem)
        line +=
            p.device_mem_peak_mib > 0 ? fmt::format(" {:>9.0f}", p.device_mem_peak_mib) : fmt::format(" {:>9}", "-");
    }
    std::printf("%s\n", line.c_str());
  }
  std::fflush(stdout);
}

Status WriteOutputs(const std::string& dir, const std::vector<PointResult>& points, const std::vector<Axis>& axes) {
  std::string csv = "case,";
  for (const auto& a : axes) csv += CsvQuote(a.key) + ",";
  csv +=
      "status,reason,world,measured_steps,step_s,step_spread,tokens_per_s,flops_per_device,mfu,peak_flops,peak_source,"
      "compute_s,comm_exposed_s,bubble_s,data_wait_s,wall_s,device_mem_peak_mib\n";
  std::string json = "{\n  \"machine\": {\"host\": \"" + JsonEscape(HostName()) +
                     fmt::format("\", \"cores\": {}}},\n  \"points\": [", NumCores());
  for (size_t i = 0; i < points.size(); ++i) {
    const auto& p = points[i];
    csv += CsvQuote(p.case_name) + ",";
    for (const auto& [k, v] : p.settings) csv += CsvQuote(v) + ",";
    // Peak device memory: empty in the CSV and null in the JSON where not reported (the CPU backend).
    const std::string mem = p.device_mem_peak_mib > 0 ? fmt::format("{:.1f}", p.device_mem_peak_mib) : "";
    csv +=
        fmt::format("{},{},{},{},{:.6g},{:.4g},{:.6g},{:.6g},{:.6g},{:.6g},{},{:.6g},{:.6g},{:.6g},{:.6g},{:.3f},{}\n",
                    p.status, CsvQuote(p.reason), p.world, p.measured_steps, p.step_s, p.step_spread, p.tokens_per_s,
                    p.flops_per_device, p.mfu, p.peak_flops, CsvQuote(p.peak_source), p.compute_s, p.comm_exposed_s,
                    p.bubble_s, p.data_wait_s, p.wall_s, mem);
    std::string settings;
    for (const auto& [k, v] : p.settings) {
      settings += fmt::format("{}\"{}\": \"{}\"", settings.empty() ? "" : ", ", JsonEscape(k), JsonEscape(v));
    }
    json += fmt::format(
        "{}\n    {{\"case\": \"{}\", \"settings\": {{{}}}, \"status\": \"{}\", \"reason\": \"{}\", \"world\": {}, "
        "\"measured_steps\": {}, "
        "\"step_s\": {:.6g}, \"step_spread\": {:.4g}, \"tokens_per_s\": {:.6g}, \"flops_per_device\": {:.6g}, "
        "\"mfu\": {:.6g}, \"peak_flops\": {:.6g}, \"peak_source\": \"{}\", \"compute_s\": {:.6g}, "
        "\"comm_exposed_s\": {:.6g}, \"bubble_s\": {:.6g}, \"data_wait_s\": {:.6g}, \"wall_s\": {:.3f}, "
        "\"device_mem_peak_mib\": {}}}",
        i ? "," : "", JsonEscape(p.case_name), settings, p.status, JsonEscape(p.reason), p.world, p.measured_steps,
        p.step_s, p.step_spread, p.tokens_per_s, p.flops_per_device, p.mfu, p.peak_flops, JsonEscape(p.peak_source),
        p.compute_s, p.comm_exposed_s, p.bubble_s, p.data_wait_s, p.wall_s, mem.empty() ? "null" : mem);
  }
  json += "\n  ]\n}\n";
  MS_RETURN_IF_ERROR(WriteFileAtomic(dir + "/bench.csv", csv));
  MS_RETURN_IF_ERROR(WriteFileAtomic(dir + "/bench.json", json));
  // Bar charts across the points (a failed point is a gap).
  std::vector<std::string> labels;
  report::Series mfu{"MFU (%)", {}, {}, ""}, tps{"tokens/s", {}, {}, ""};
  for (const auto& p : points) {
    labels.push_back(Label(p));
    const bool ok = p.status == "ok";
    mfu.y.push_back(ok ? 100 * p.mfu : std::nan(""));
    tps.y.push_back(ok ? p.tokens_per_s : std::nan(""));
  }
  report::ChartSpec cs;
  cs.title = "MFU across the sweep";
  cs.x_label = "point";
  cs.y_label = "MFU (%)";
  cs.width = std::max(800, 110 * static_cast<int>(points.size()));
  MS_RETURN_IF_ERROR(WriteFileAtomic(dir + "/mfu.svg", report::BarChartSvg(cs, labels, {mfu})));
  cs.title = "Training throughput across the sweep";
  cs.y_label = "tokens/s";
  MS_RETURN_IF_ERROR(WriteFileAtomic(dir + "/tokens_per_s.svg", report::BarChartSvg(cs, labels, {tps})));
  return Status::Ok();
}

}  // namespace

Result<Axis> ParseAxis(std::string_view text) {
  const size_t eq = text.find('=');
  if (eq == std::string_view::npos || eq == 0 || eq + 1 >= text.size()) {
    return InvalidArgument("--vary {}: use key=value1,value2,... (e.g. --vary parallel.tp=1,2)", text);
  }
  Axis a;
  a.key = std::string(text.substr(0, eq));
  std::string_view rest = text.substr(eq + 1);
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string_view v = rest.substr(0, comma);
    if (v.empty()) return InvalidArgument("--vary {}: an empty value", text);
    a.values.emplace_back(v);
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
    if (rest.empty()) return InvalidArgument("--vary {}: an empty value", text);
  }
  const auto keys = config::AllKeys();
  if (std::find(keys.begin(), keys.end(), a.key) == keys.end()) {
    return InvalidArgument("--vary {}: {} is not a key of the job spec (docs/job-spec.md)", text, a.key);
  }
  return a;
}

Result<BenchResult> RunBench(const BenchOptions& options) {
  runner::InstallStopSignals();  // passed on to a running point (RunProcess); none is started after one
  MS_ASSIGN_OR_RETURN(SweepFile sweep, ReadSweepFile(options.spec_path));
  // The axes: the file's, then --vary (which replaces a key the file also varies).
  std::vector<Axis> axes = sweep.vary;
  for (const auto& a : options.vary) {
    auto it = std::find_if(axes.begin(), axes.end(), [&](const Axis& x) { return x.key == a.key; });
    if (it != axes.end()) {
      *it = a;
    } else {
      axes.push_back(a);
    }
  }
  for (const auto& a : axes) {
    const auto keys = config::AllKeys();
    if (std::find(keys.begin(), keys.end(), a.key) == keys.end()) {
      return InvalidArgument("{}: bench.vary: {} is not a key of the job spec (docs/job-spec.md)", options.spec_path,
                             a.key);
    }
  }
  const int steps = options.steps > 0 ? options.steps : sweep.steps > 0 ? sweep.steps : 5;
  const int warmup = options.warmup >= 0 ? options.warmup : sweep.warmup >= 0 ? sweep.warmup : 2;
  MS_ASSIGN_OR_RETURN(config::JobSpec base, config::ParseJobSpec(sweep.spec_yaml, options.spec_path));
  for (const auto& o : options.overrides) MS_RETURN_IF_ERROR(config::ApplyOverride(&base, o));

  BenchResult result;
  result.output = options.output;
  if (result.output.empty()) {
    std::time_t now = std::time(nullptr);
    std::tm tm{};
    gmtime_r(&now, &tm);
    char stamp[32];
    std::strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%SZ", &tm);
    std::string name;
    for (char c : base.name) name += std::isalnum(static_cast<unsigned char>(c)) || c == '-' ? c : '_';
    result.output = fmt::format("bench-{}-{}", name, stamp);
  }
  MS_RETURN_IF_ERROR_CTX(MakeDirs(result.output + "/points"), "creating the bench output folder");
  std::string exe = options.executable;
  if (exe.empty()) {
    MS_ASSIGN_OR_RETURN(std::string self, SelfExecutable());
    exe = self;
  }

  // Every case (one empty case when none) times every combination of the axes, the first varying slowest.
  for (const auto& c : sweep.cases) {
    for (const auto& [k, v] : c.settings) {
      const auto keys = config::AllKeys();
      if (std::find(keys.begin(), keys.end(), k) == keys.end()) {
        return InvalidArgument("{}: bench.cases[{}]: {} is not a key of the job spec (docs/job-spec.md)",
                               options.spec_path, c.name, k);
      }
    }
  }
  std::vector<Case> cases = sweep.cases;
  if (cases.empty()) cases.push_back({});
  size_t grid = 1;
  for (const auto& a : axes) grid *= a.values.size();
  const size_t total = grid * cases.size();
  std::fprintf(stderr, "bench: %zu point%s x (%d warm-up + %d measured steps), output %s\n", total,
               total == 1 ? "" : "s", warmup, steps, result.output.c_str());
  const double t_start = NowSeconds();
  for (size_t i = 0; i < total && result.interrupted == 0; ++i) {
    if (const int sig = runner::TakeStopSignal(); sig != 0) {
      result.interrupted = sig;
      break;
    }
    PointResult p;
    const Case& the_case = cases[i / grid];
    p.case_name = the_case.name;
    size_t rest = i % grid;
    std::vector<size_t> idx(axes.size());
    for (size_t k = axes.size(); k-- > 0;) {
      idx[k] = rest % axes[k].values.size();
      rest /= axes[k].values.size();
    }
    for (size_t k = 0; k < axes.size(); ++k) p.settings.emplace_back(axes[k].key, axes[k].values[idx[k]]);
    const std::string dir = fmt::format("{}/points/{:03d}", result.output, i);
    if (options.progress) {
      const double elapsed = NowSeconds() - t_start;
      std::fprintf(
          stderr, "[%zu/%zu] %s: running (%s elapsed%s)\n", i + 1, total, Label(p).c_str(), Duration(elapsed).c_str(),
          i > 0 ? fmt::format(", ETA {}", Duration(elapsed / static_cast<double>(i) * static_cast<double>(total - i)))
                      .c_str()
                : "");
    }
    // The point's spec: the varied values, then what a bench point is.
    config::JobSpec spec = base;
    Status s;
    for (const auto& [k, v] : the_case.settings) {
      if (s.ok()) s = config::ApplyOverride(&spec, k + "=" + v);
    }
    for (const auto& [k, v] : p.settings) {
      if (s.ok()) s = config::ApplyOverride(&spec, k + "=" + v);
    }
    const std::vector<std::string> fixed = {fmt::format("train.steps={}", warmup + steps),
                                            "optimizer.warmup_steps=0",
                                            "checkpoint.interval=0",
                                            "checkpoint.resume=none",
                                            "train.eval_interval=0",
                                            "log.interval=1000000",
                                            fmt::format("log.run_dir={}/run", dir)};
    for (const auto& f : fixed) {
      if (s.ok()) s = config::ApplyOverride(&spec, f);
    }
    if (s.ok()) s = runner::ResolveForLauncher(&spec);
    if (s.ok()) s = config::ResolveAndValidate(&spec);
    if (s.ok()) s = runner::PreflightCheck(spec, /*files=*/true);
    if (!s.ok()) {
      p.status = "invalid";
      p.reason = s.message();
      result.points.push_back(p);
      continue;
    }
    p.world = static_cast<int>(config::WorldSize(spec.parallel));
    MS_RETURN_IF_ERROR(MakeDirs(dir));
    const std::string spec_file = dir + "/job.yaml", log = dir + "/train.log";
    MS_RETURN_IF_ERROR(WriteFileAtomic(spec_file, config::ToYaml(spec)));
    auto code = RunProcess({exe, "train", spec_file, "--no-progress"}, log, options.point_timeout_s, &p.wall_s,
                           &result.interrupted);
    if (!code.ok()) {
      p.status = result.interrupted != 0 ? "interrupted" : "failed";
      p.reason = code.status().message();
    } else if (*code != 0) {
      p.status = "failed";
      p.reason = FailureReason(log, *code);
    } else {
      Summarize(spec.log.run_dir, log, warmup, &p);
    }
    result.points.push_back(p);
  }
  if (options.progress) {
    std::fprintf(stderr, "bench: %zu of %zu points in %s\n", result.points.size(), total,
                 Duration(NowSeconds() - t_start).c_str());
  }
  PrintTable(result.points, axes, !sweep.cases.empty());
  MS_RETURN_IF_ERROR(WriteOutputs(result.output, result.points, axes));
  const auto& first_ok =
      std::find_if(result.points.begin(), result.points.end(), [](const PointResult& p) { return p.status == "ok"; });
  std::printf(
      "machine: %s, %d cores; peak per device %s (%s)\nwrote %s/bench.csv, bench.json, mfu.svg, "
      "tokens_per_s.svg\n",
      HostName().c_str(), NumCores(),
      first_ok != result.points.end() ? (Rate(first_ok->peak_flops) + "FLOP/s").c_str() : "-",
      first_ok != result.points.end() ? first_ok->peak_source.c_str() : "no point ran", result.output.c_str());
  return result;
}

}  // namespace ms::bench
