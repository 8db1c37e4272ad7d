// Helpers shared by the data tests: the shared temp directory (support/temp_dir.h) and small file utilities.
#pragma once

#include <cstdio>
#include <string>

#include "core/core.h"
#include "support/temp_dir.h"

namespace ms::data::testing {

using ms::testing::TempDir;

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
