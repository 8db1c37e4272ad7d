#include "runner/fault_injection.h"

#include <chrono>
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
      bool ok = f.kind == "delay";
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
          } else {
            ok = false;
          }
        } catch (...) {
          ok = false;
        }
      }
      if (!ok || f.at.empty()) {
        LogWarn("MEGASCALE_FAULT: ignoring malformed entry '{}'", entry);
        continue;
      }
      out.push_back(std::move(f));
    }
    return out;
  }();
  return faults;
}

}  // namespace

void InjectDelay(std::string_view point, int rank) {
  for (const Fault& f : Faults()) {
    if (f.kind != "delay" || f.at != point || (f.rank >= 0 && f.rank != rank)) continue;
    LogWarn("MEGASCALE_FAULT: delaying {} by {} s (test hook)", point, f.seconds);
    std::this_thread::sleep_for(std::chrono::duration<double>(f.seconds));
  }
}

}  // namespace ms::runner
