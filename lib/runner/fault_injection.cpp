#include "runner/fault_injection.h"

#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "core/core.h"

namespace ms::runner {
namespace {

struct Fault {
  std::string kind, at;
  int rank = -1;
  double seconds = 0;
  int64_t step = -1;
  double factor = 1;
  int attempt = 0;
};

std::vector<std::string_view> Split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(sep, start);
    if (end == std::string_view::npos) end = s.size();
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

const std::vector<Fault>& Faults() {
  static const std::vector<Fault> faults = [] {
    std::vector<Fault> out;
    const auto env = GetEnv("MEGASCALE_FAULT");
    if (!env) return out;
    for (std::string_view entry : Split(*env, ';')) {
      auto fields = Split(entry, ':');
      Fault f;
      f.kind = std::string(fields[0]);
      bool ok = f.kind == "delay" || f.kind == "nan" || f.kind == "slow" || f.kind == "hang" || f.kind == "crash" ||
                f.kind == "slow_gemm" || f.kind == "slow_link" || f.kind == "loader_stall";
      for (size_t i = 1; i < fields.size() && ok; ++i) {
        const size_t eq = fields[i].find('=');
        if (eq == std::string_view::npos) {
          ok = false;
          break;
        }
        const std::string key(fields[i].substr(0, eq)), value(fields[i].substr(eq + 1));
        try {
          if (key == "at") {
            f.at = value;
          } else if (key == "rank") {
            f.rank = std::stoi(value);
          } else if (key == "s") {
            f.seconds = std::stod(value);
          } else if (key == "step") {
            f.step = std::stoll(value);
          } else if (key == "factor") {
            f.factor = std::stod(value);
          } else if (key == "attempt") {
            f.attempt = std::stoi(value);
          } else {
            ok = false;
          }
        } catch (...) {
          ok = false;
        }
      }
      if (!ok || (f.kind == "delay" && f.at.empty()) || (f.kind != "delay" && f.rank < 0) ||
          ((f.kind == "nan" || f.kind == "hang" || f.kind == "crash" || f.kind == "loader_stall") && f.step < 0)) {
        LogWarn("MEGASCALE_FAULT: ignoring malformed entry '{}'", entry);
        continue;
      }
      out.push_back(std::move(f));
    }
    return out;
  }();
  return faults;
}

int Attempt() {
  static const int attempt = [] {
    auto a = GetEnv("MEGASCALE_ATTEMPT");
    return a ? std::atoi(a->c_str()) : 0;
  }();
  return attempt;
}

const Fault* Find(std::string_view kind, int rank, int64_t step) {
  for (const Fault& f : Faults()) {
    if (f.kind == kind && f.rank == rank && f.attempt == Attempt() && (step < 0 || f.step == step)) return &f;
  }
  return nullptr;
}

}  // namespace

bool InjectLoaderStall(int rank, int64_t step) {
  if (!Find("loader_stall", rank, step)) return false;
  LogWarn("MEGASCALE_FAULT: the data loader of rank {} stops publishing at step {} (test hook)", rank, step);
  return true;
}

bool InjectNan(int rank, int64_t step) {
  if (!Find("nan", rank, step)) return false;
  LogWarn("MEGASCALE_FAULT: a NaN in rank {}'s gradient at step {} (test hook)", rank, step);
  return true;
}

double SlowFactor(int rank) {
  return InjectedFactor("slow", rank);
}

double InjectedFactor(std::string_view kind, int rank) {
  const Fault* f = Find(kind, rank, -1);
  if (!f) return 1;
  LogWarn("MEGASCALE_FAULT: {} of rank {}: {} times as long (test hook)", kind, rank, f->factor);
  return f->factor;
}

void InjectHang(int rank, int64_t step) {
  if (Find("crash", rank, step)) {
    LogWarn("MEGASCALE_FAULT: rank {} crashes at step {} (test hook)", rank, step);
    raise(SIGKILL);
  }
  if (!Find("hang", rank, step)) return;
  LogWarn("MEGASCALE_FAULT: rank {} hangs at step {} (test hook)", rank, step);
  while (true) std::this_thread::sleep_for(std::chrono::seconds(3600));
}

void BurnCpu(double seconds) {
  const double end = NowSeconds() + seconds;
  volatile double sink = 0;
  while (NowSeconds() < end) {
    for (int i = 0; i < 1000; ++i) sink = sink + i * 1e-9;
  }
}

void InjectDelay(std::string_view point, int rank) {
  for (const Fault& f : Faults()) {
    if (f.kind != "delay" || f.at != point || (f.rank >= 0 && f.rank != rank)) continue;
    LogWarn("MEGASCALE_FAULT: delaying {} by {} s (test hook)", point, f.seconds);
    std::this_thread::sleep_for(std::chrono::duration<double>(f.seconds));
  }
}

}  // namespace ms::runner
