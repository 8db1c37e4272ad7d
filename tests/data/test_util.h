// Helpers shared by the data tests: a temp directory under /tmp named with the pid, removed at
// the end, and small file utilities.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "core/core.h"

namespace ms::data::testing {

class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = fmt::format("/tmp/ms-data-test-{}-{}", ::getpid(), counter.fetch_add(1));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }
  // Sorted names of the entries in the directory.
  std::vector<std::string> List() const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(path_)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  std::string path_;
};

// Reads a whole file; empty string if it cannot.
inline std::string Slurp(const std::string& path) {
  auto r = ReadFile(path);
  return r.ok() ? *r : std::string();
}

// Writes a file (not atomically; tests only).
inline void Spit(const std::string& path, const std::string& contents) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return;
  std::fwrite(contents.data(), 1, contents.size(), f);
  std::fclose(f);
}

}  // namespace ms::data::testing
