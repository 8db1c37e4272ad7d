// defines: Crc32c, LocalShape, ShardKindName, the shard geometry and the file helpers.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>

#include <fmt/ranges.h>

#include "checkpoint/internal.h"

namespace ms::checkpoint {

// ---- CRC32C ----

namespace {

// Slicing-by-8 tables for the reflected Castagnoli polynomial 0x82F63B78.
struct CrcTables {
  uint32_t t[8][256];
  CrcTables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
  }
};

const CrcTables& Tables() {
  static const CrcTables tables;
  return tables;
}

uint32_t Crc32cSoftware(const uint8_t* p, size_t n, uint32_t c) {
  const auto& t = Tables().t;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = t[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    --n;
  }
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= c;
    c = t[7][w & 0xFF] ^ t[6][(w >> 8) & 0xFF] ^ t[5][(w >> 16) & 0xFF] ^ t[4][(w >> 24) & 0xFF] ^
        t[3][(w >> 32) & 0xFF] ^ t[2][(w >> 40) & 0xFF] ^ t[1][(w >> 48) & 0xFF] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = t[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Crc32cHardware(const uint8_t* p, size_t n, uint32_t c) {
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = __builtin_ia32_crc32qi(c, *p++);
    --n;
  }
  uint64_t c64 = c;
  while (n >= 32) {  // unrolled; one dependency chain (latency-bound, ~8 bytes / 3 cycles)
    uint64_t w[4];
    std::memcpy(w, p, 32);
    c64 = __builtin_ia32_crc32di(c64, w[0]);
    c64 = __builtin_ia32_crc32di(c64, w[1]);
    c64 = __builtin_ia32_crc32di(c64, w[2]);
    c64 = __builtin_ia32_crc32di(c64, w[3]);
    p += 32;
    n -= 32;
  }
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = __builtin_ia32_crc32di(c64, w);
    p += 8;
    n -= 8;
  }
  c = static_cast<uint32_t>(c64);
  while (n--) c = __builtin_ia32_crc32qi(c, *p++);
  return c;
}
bool HaveHardwareCrc() {
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
}
#endif

}  // namespace

uint32_t Crc32c(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
#if defined(__x86_64__)
  if (HaveHardwareCrc()) return ~Crc32cHardware(p, n, ~crc);
#endif
  return ~Crc32cSoftware(p, n, ~crc);
}

namespace internal {

// CRC combination as zlib does it: polynomials over GF(2) modulo P, reflected bit order.
static uint32_t MultModP(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ 0x82F63B78u : b >> 1;
  }
  return p;
}

uint32_t Crc32cCombine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
  static const auto x2n = [] {  // x^(2^k) mod P
    std::array<uint32_t, 64> t{};
    uint32_t p = 1u << 30;  // x^1
    t[0] = p;
    for (size_t k = 1; k < t.size(); ++k) t[k] = p = MultModP(p, p);
    return t;
  }();
  uint32_t xp = 1u << 31;  // x^0
  unsigned k = 3;          // bytes -> bits: x^(8 * len2)
  for (uint64_t n = len2; n; n >>= 1, ++k) {
    if (n & 1) xp = MultModP(x2n[k & 63], xp);
  }
  return MultModP(xp, crc1) ^ crc2;
}

uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc) {
  return ~Crc32cSoftware(static_cast<const uint8_t*>(data), n, ~crc);
}
}  // namespace internal

// ---- shards ----

std::string_view ShardKindName(model::ShardKind shard) {
  switch (shard) {
    case model::ShardKind::kReplicated:
      return "replicated";
    case model::ShardKind::kRows:
      return "rows";
    case model::ShardKind::kCols:
      return "cols";
    case model::ShardKind::kQkvRows:
      return "qkv_rows";
  }
  return "?";
}

Result<std::vector<int64_t>> LocalShape(const std::vector<int64_t>& global_shape, model::ShardKind shard, int tp_size) {
  MS_ASSIGN_OR_RETURN(internal::ShardGeom g, internal::MakeGeom(global_shape, shard, tp_size, 0));
  std::vector<int64_t> local = global_shape;
  if (shard == model::ShardKind::kRows || shard == model::ShardKind::kQkvRows) local[0] = g.lrows;
  if (shard == model::ShardKind::kCols) local[1] = g.lcols;
  return local;
}

std::string StepDirName(int64_t step) {
  return fmt::format("step-{:08d}", step);
}
std::string RankFileName(int rank) {
  return fmt::format("rank-{:05d}.bin", rank);
}

namespace internal {

std::string ShapeString(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

Result<ShardGeom> MakeGeom(const std::vector<int64_t>& shape, model::ShardKind kind, int tp_size, int tp_rank) {
  using model::ShardKind;
  if (shape.empty()) return InvalidArgument("empty global shape (scalars are saved as shape [1])");
  for (int64_t d : shape) {
    if (d <= 0) return InvalidArgument("global shape {} has a non-positive dimension", ShapeString(shape));
  }
  if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size) {
    return InvalidArgument("tp_rank {} is not in [0, tp_size {})", tp_rank, tp_size);
  }
  ShardGeom g;
  g.kind = kind;
  g.tp = tp_size;
  g.rank = tp_rank;
  g.rows = shape[0];
  g.cols = 1;
  for (size_t i = 1; i < shape.size(); ++i) g.cols *= shape[i];
  g.lrows = g.rows;
  g.lcols = g.cols;
  switch (kind) {
    case ShardKind::kReplicated:
      g.chunk = g.rows * g.cols;
      break;
    case ShardKind::kRows:
      if (g.rows % tp_size) {
        return InvalidArgument("shape {} split by rows: {} rows do not divide by tp {}", ShapeString(shape), g.rows,
                               tp_size);
      }
      g.lrows = g.rows / tp_size;
      g.chunk = g.lrows * g.cols;
      break;
    case ShardKind::kCols:
      if (shape.size() != 2) return InvalidArgument("shape {} split by columns must be 2-D", ShapeString(shape));
      if (g.cols % tp_size) {
        return InvalidArgument("shape {} split by columns: {} columns do not divide by tp {}", ShapeString(shape),
                               g.cols, tp_size);
      }
      g.lcols = g.cols / tp_size;
      g.chunk = g.lcols;
      break;
    case ShardKind::kQkvRows:
      if (g.rows % (3 * static_cast<int64_t>(tp_size))) {
        return InvalidArgument("shape {} split as fused q/k/v rows: {} rows do not divide by 3 * tp {}",
                               ShapeString(shape), g.rows, tp_size);
      }
      g.lrows = g.rows / tp_size;
      g.chunk = g.lrows / 3 * g.cols;
      break;
  }
  return g;
}

int64_t ShardGeom::GlobalIndex(int64_t i) const {
  using model::ShardKind;
  switch (kind) {
    case ShardKind::kReplicated:
      return i;
    case ShardKind::kRows:
      return rank * lrows * cols + i;
    case ShardKind::kCols: {
      int64_t row = i / lcols, col = i % lcols;
      return row * cols + rank * lcols + col;
    }
    case ShardKind::kQkvRows: {
      int64_t block = i / chunk, off = i % chunk;  // q, k or v
      int64_t r = lrows / 3;
      return (block * (rows / 3) + rank * r) * cols + off;
    }
  }
  return -1;
}

// ---- files ----

Status WriteAll(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(fmt::format("writing {}", path), errno);
    }
    if (w == 0) return IoError("writing {}: write returned 0", path);
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

Status ReadAt(int fd, void* data, size_t n, int64_t offset, const std::string& path) {
  char* p = static_cast<char*>(data);
  size_t done = 0;
  while (done < n) {
    ssize_t r = ::pread(fd, p + done, std::min<size_t>(n - done, size_t{1} << 30), offset + done);
    if (r < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(fmt::format("reading {}", path), errno);
    }
    if (r == 0) {
      return DataLoss("truncated file {}: wanted {} bytes at offset {}, the file ends at {}", path, n, offset,
                      offset + static_cast<int64_t>(done));
    }
    done += static_cast<size_t>(r);
  }
  return Status::Ok();
}

Status FsyncPath(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(fmt::format("opening directory {}", dir), errno);
  int rc = ::fsync(fd);
  int err = errno;
  if (::close(fd) != 0 && rc == 0) return ErrnoError(fmt::format("closing directory {}", dir), errno);
  if (rc != 0) return ErrnoError(fmt::format("fsync of directory {}", dir), err);
  return Status::Ok();
}

bool PathExists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

static Status RemoveTree(const std::string& path) {
  DIR* d = ::opendir(path.c_str());
  if (!d) {
    if (errno == ENOENT) return Status::Ok();
    if (errno == ENOTDIR) {
      if (::unlink(path.c_str()) != 0 && errno != ENOENT) return ErrnoError(fmt::format("removing {}", path), errno);
      return Status::Ok();
    }
    return ErrnoError(fmt::format("opening directory {}", path), errno);
  }
  std::vector<std::string> names;
  errno = 0;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
    errno = 0;
  }
  int read_err = errno;
  if (::closedir(d) != 0) return ErrnoError(fmt::format("closing directory {}", path), errno);
  if (read_err) return ErrnoError(fmt::format("listing {}", path), read_err);
  for (const auto& name : names) {
    std::string child = path + "/" + name;
    struct stat st {};
    if (::lstat(child.c_str(), &st) != 0) {
      if (errno == ENOENT) continue;
      return ErrnoError(fmt::format("stat of {}", child), errno);
    }
    if (S_ISDIR(st.st_mode)) {
      MS_RETURN_IF_ERROR(RemoveTree(child));
    } else if (::unlink(child.c_str()) != 0 && errno != ENOENT) {
      return ErrnoError(fmt::format("removing {}", child), errno);
    }
  }
  if (::rmdir(path.c_str()) != 0 && errno != ENOENT) return ErrnoError(fmt::format("removing {}", path), errno);
  return Status::Ok();
}

Status RemoveStepDir(const std::string& dir) {
  std::string manifest = dir + "/" + kManifestName;
  if (::unlink(manifest.c_str()) != 0 && errno != ENOENT && errno != ENOTDIR) {
    return ErrnoError(fmt::format("removing {}", manifest), errno);
  }
  return RemoveTree(dir);
}

Result<std::vector<std::pair<int64_t, std::string>>> ListStepDirs(const std::string& root) {
  DIR* d = ::opendir(root.c_str());
  if (!d) return ErrnoError(fmt::format("opening checkpoint directory {}", root), errno);
  std::vector<std::pair<int64_t, std::string>> out;
  errno = 0;
  while (dirent* e = ::readdir(d)) {
    std::string_view name = e->d_name;
    errno = 0;
    if (name.size() < 6 || name.substr(0, 5) != "step-") continue;
    std::string_view digits = name.substr(5);
    if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    if (digits.size() > 18) continue;
    int64_t step = std::stoll(std::string(digits));
    std::string path = root + "/" + std::string(name);
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) out.emplace_back(step, path);
    errno = 0;
  }
  int read_err = errno;
  if (::closedir(d) != 0) return ErrnoError(fmt::format("closing directory {}", root), errno);
  if (read_err) return ErrnoError(fmt::format("listing {}", root), read_err);
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

bool IsDiskFull(const Status& status) {
  const std::string& m = status.message();
  return m.find(std::strerror(ENOSPC)) != std::string::npos || m.find(std::strerror(EDQUOT)) != std::string::npos;
}

}  // namespace internal
}  // namespace ms::checkpoint
