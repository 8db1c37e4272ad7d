// Internal to the checkpoint module (not part of its API): a small JSON reader/writer, the
// shard geometry shared by the writer, the reader and the export, and file helpers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"

namespace ms::checkpoint::internal {

// ---- JSON (what manifests need: objects, arrays, strings, integers, doubles, bools) ----

struct Json {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };
  Type type = Type::kNull;
  bool boolean = false;
  bool is_int = false;  // a number written without fraction or exponent that fits int64
  int64_t integer = 0;
  double number = 0;
  std::string str;
  std::vector<Json> items;                            // kArray
  std::vector<std::pair<std::string, Json>> members;  // kObject, in file order

  const Json* Find(std::string_view key) const;
};

// Parses one JSON document (trailing whitespace only). Errors name the byte offset.
Result<Json> ParseJson(std::string_view text);
// Appends `s` as a quoted JSON string.
void AppendJsonString(std::string* out, std::string_view s);

// Typed member access; errors name `where` and the key.
Result<int64_t> GetInt(const Json& obj, std::string_view key, std::string_view where);
Result<std::string> GetString(const Json& obj, std::string_view key, std::string_view where);
Result<const Json*> GetArray(const Json& obj, std::string_view key, std::string_view where);

// FileInfo <-> JSON object (shared by FileInfo::ToJson, the rank file index and the manifest).
void AppendFileInfoJson(std::string* out, const FileInfo& info);
Result<FileInfo> FileInfoFromJson(const Json& j, std::string_view where);
Result<model::ShardKind> ParseShardKind(std::string_view name);

// CRC32C without the SSE4.2 instruction (slicing-by-8); Crc32c() uses it on other CPUs.
uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc = 0);
// CRC32C of A followed by B, from crc(A), crc(B) and B's length: lets the checksum of a file
// be built from pieces checksummed separately (or in parallel) without a second pass.
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

// ---- shard geometry ----

// A TP shard of a global tensor viewed as [rows, cols] (cols = product of the other dims).
// Local element i (row-major in the shard) maps to one global element; runs of `chunk`
// consecutive local elements are contiguous in the global tensor too.
struct ShardGeom {
  model::ShardKind kind = model::ShardKind::kReplicated;
  int tp = 1, rank = 0;
  int64_t rows = 0, cols = 0;    // global
  int64_t lrows = 0, lcols = 0;  // local
  int64_t chunk = 0;             // local elements contiguous in the global tensor

  int64_t global_numel() const { return rows * cols; }
  int64_t local_numel() const { return lrows * lcols; }
  // Global flat index of local flat index i.
  int64_t GlobalIndex(int64_t i) const;
  // Calls fn(local_index, global_index, run) over [begin, end) in maximal contiguous runs.
  template <typename F>
  void ForEachRun(int64_t begin, int64_t end, F&& fn) const {
    int64_t i = begin;
    while (i < end) {
      int64_t run = std::min(chunk - i % chunk, end - i);
      fn(i, GlobalIndex(i), run);
      i += run;
    }
  }
};

Result<ShardGeom> MakeGeom(const std::vector<int64_t>& global_shape, model::ShardKind kind, int tp_size, int tp_rank);
std::string ShapeString(const std::vector<int64_t>& shape);  // "[768, 2304]"

// ---- files ----

// write() all of it, retrying EINTR and short writes. (A file written so is finished with ms::CommitTempFile.)
Status WriteAll(int fd, const void* data, size_t n, const std::string& path);
// pread() exactly n bytes at `offset`; a short read is DataLoss ("truncated").
Status ReadAt(int fd, void* data, size_t n, int64_t offset, const std::string& path);
Status FsyncPath(const std::string& dir);
// Removes a step directory: manifest.json first (so a half-removed directory is never
// taken for a checkpoint), then the other entries, then the directory. Missing: OK.
Status RemoveStepDir(const std::string& dir);
bool PathExists(const std::string& path);
// step-NNNNNNNN directories under root as (step, path), newest first.
Result<std::vector<std::pair<int64_t, std::string>>> ListStepDirs(const std::string& root);
// True when the message is ENOSPC/EDQUOT.
bool IsDiskFull(const Status& status);

constexpr char kManifestName[] = "manifest.json";
constexpr char kFormatName[] = "megascale-checkpoint";
constexpr int kFormatVersion = 1;
constexpr char kFileMagic[8] = {'M', 'S', 'C', 'K', 'P', 'T', '0', '1'};
constexpr size_t kFileHeaderBytes = 64;
constexpr size_t kDataAlign = 4096;  // data region start
constexpr size_t kPieceAlign = 64;   // each piece within it

}  // namespace ms::checkpoint::internal
