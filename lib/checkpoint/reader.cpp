// defines: Checkpoint (open, verify, reassemble, reshard), FindLatestValid.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include <fmt/ranges.h>

#include "checkpoint/internal.h"

namespace ms::checkpoint {

using internal::Json;
using internal::kManifestName;

namespace {

struct TensorEntry {
  std::vector<int64_t> global_shape;
  std::vector<std::pair<int, int>> pieces;  // (file index, piece index)
};

Result<Manifest> ParseManifest(const std::string& text, const std::string& path) {
  MS_ASSIGN_OR_RETURN(Json j, internal::ParseJson(text));
  if (j.type != Json::Type::kObject) return DataLoss("{}: not a JSON object", path);
  MS_ASSIGN_OR_RETURN(std::string format, internal::GetString(j, "format", path));
  if (format != internal::kFormatName)
    return DataLoss("{}: format is '{}', not {}", path, format, internal::kFormatName);
  Manifest m;
  MS_ASSIGN_OR_RETURN(int64_t version, internal::GetInt(j, "version", path));
  if (version != internal::kFormatVersion) {
    return DataLoss("{}: format version {} (this megascale reads version {})", path, version, internal::kFormatVersion);
  }
  m.version = static_cast<int>(version);
  MS_ASSIGN_OR_RETURN(m.step, internal::GetInt(j, "step", path));
  MS_ASSIGN_OR_RETURN(m.created, internal::GetString(j, "created", path));
  const Json* layout = j.Find("layout");
  if (!layout || layout->type != Json::Type::kObject) return DataLoss("{}: missing 'layout'", path);
  std::string lwhere = fmt::format("{}: layout", path);
  MS_ASSIGN_OR_RETURN(int64_t tp, internal::GetInt(*layout, "tp", lwhere));
  MS_ASSIGN_OR_RETURN(int64_t pp, internal::GetInt(*layout, "pp", lwhere));
  MS_ASSIGN_OR_RETURN(int64_t dp, internal::GetInt(*layout, "dp", lwhere));
  if (tp < 1 || pp < 1 || dp < 1 || tp * pp * dp > (1 << 24)) {
    return DataLoss("{}: bad layout tp={} pp={} dp={}", path, tp, pp, dp);
  }
  m.layout = Layout{static_cast<int>(tp), static_cast<int>(pp), static_cast<int>(dp)};
  MS_ASSIGN_OR_RETURN(const Json* files, internal::GetArray(j, "files", path));
  if (static_cast<int>(files->items.size()) != m.layout.world()) {
    return DataLoss("{}: {} files listed for a world of {} ranks", path, files->items.size(), m.layout.world());
  }
  for (size_t i = 0; i < files->items.size(); ++i) {
    MS_ASSIGN_OR_RETURN(FileInfo f, internal::FileInfoFromJson(files->items[i], path));
    if (f.rank != static_cast<int>(i) || f.name != RankFileName(f.rank)) {
      return DataLoss("{}: file entry {} is '{}' of rank {}, expected {}", path, i, f.name, f.rank,
                      RankFileName(static_cast<int>(i)));
    }
    for (const PieceInfo& p : f.pieces) {
      auto g = internal::MakeGeom(p.global_shape, p.shard, p.tp_size, p.tp_rank);
      if (!g.ok()) return DataLoss("{}: {} piece of {} ({}): {}", path, f.name, p.tensor, p.kind, g.status().message());
      int64_t bytes = (p.end - p.begin) * static_cast<int64_t>(sizeof(float));
      if (p.begin < 0 || p.end < p.begin || p.end > g->local_numel() ||
          p.offset < static_cast<int64_t>(internal::kFileHeaderBytes) || p.offset + bytes > f.size) {
        return DataLoss("{}: {} piece of {} ({}) has range [{}, {}) at offset {} outside its shard or file", path,
                        f.name, p.tensor, p.kind, p.begin, p.end, p.offset);
      }
    }
    m.files.push_back(std::move(f));
  }
  return m;
}

// CRC32C of bytes [offset, offset + n) of a file.
Result<uint32_t> ChecksumRange(const std::string& path, int64_t offset, int64_t n) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(fmt::format("opening {}", path), errno);
  ::posix_fadvise(fd, offset, n, POSIX_FADV_SEQUENTIAL);
  std::vector<char> buf(static_cast<size_t>(std::min<int64_t>(n, 4 << 20)));
  uint32_t crc = 0;
  Status s;
  for (int64_t done = 0; done < n;) {
    size_t k = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(buf.size()), n - done));
    s = internal::ReadAt(fd, buf.data(), k, offset + done, path);
    if (!s.ok()) break;
    crc = Crc32c(buf.data(), k, crc);
    done += static_cast<int64_t>(k);
  }
  if (::close(fd) != 0 && s.ok()) s = ErrnoError(fmt::format("closing {}", path), errno);
  MS_RETURN_IF_ERROR(s);
  return crc;
}

// Whole-file checksums of every file, split into segments checksummed in parallel on all cores
// and combined, so that one large rank file is not verified by a single core.
Status VerifyChecksums(const std::string& dir, const std::vector<FileInfo>& files) {
  constexpr int64_t kSegment = 64 << 20;
  struct Task {
    size_t file;
    int64_t offset, len;
    Result<uint32_t> crc = Status(Code::kInternal, "not run");
  };
  std::vector<Task> tasks;
  for (size_t i = 0; i < files.size(); ++i) {
    for (int64_t off = 0; off < files[i].size || off == 0; off += kSegment) {
      tasks.push_back(Task{i, off, std::min(kSegment, files[i].size - off)});
      if (files[i].size == 0) break;
    }
  }
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t t = next++; t < tasks.size(); t = next++) {
      tasks[t].crc = ChecksumRange(dir + "/" + files[tasks[t].file].name, tasks[t].offset, tasks[t].len);
    }
  };
  const size_t threads = std::min<size_t>(tasks.size(), static_cast<size_t>(std::max(1, NumCores())));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  std::vector<uint32_t> crc(files.size(), 0);
  for (const Task& t : tasks) {
    if (!t.crc.ok()) return t.crc.status();
    crc[t.file] = internal::Crc32cCombine(crc[t.file], *t.crc, static_cast<uint64_t>(t.len));
  }
  for (size_t i = 0; i < files.size(); ++i) {
    if (crc[i] != files[i].crc32c) {
      return DataLoss("checksum mismatch in {}: crc32c {:#010x} computed, manifest says {:#010x}", files[i].name,
                      crc[i], files[i].crc32c);
    }
  }
  return Status::Ok();
}

}  // namespace

struct Checkpoint::Impl {
  std::string dir;
  Manifest manifest;
  Verify verify = Verify::kFull;
  std::map<std::string, std::map<std::string, TensorEntry>> index;  // kind -> tensor -> pieces

  mutable std::mutex mu;
  mutable std::vector<int> fds;  // per file, opened on first read
  mutable std::map<std::pair<std::string, std::string>, std::shared_ptr<const float[]>> cache;

  ~Impl() {
    for (int fd : fds) {
      if (fd >= 0) ::close(fd);  // read-only descriptors: nothing to lose
    }
  }

  Result<const TensorEntry*> Find(const std::string& kind, const std::string& tensor) const {
    auto k = index.find(kind);
    if (k == index.end()) {
      std::vector<std::string> kinds;
      for (const auto& [name, unused] : index) kinds.push_back(name);
      return NotFound("checkpoint {} has no tensors of kind '{}' (it has: {})", dir, kind, fmt::join(kinds, ", "));
    }
    auto t = k->second.find(tensor);
    if (t == k->second.end()) {
      return NotFound(
          "tensor '{}' ({}) is not in checkpoint {} ({} tensors of that kind); does the model spec match "
          "the one that saved it?",
          tensor, kind, dir, k->second.size());
    }
    return &t->second;
  }

  // The descriptor of file `fi`, opened on first use (caller holds mu).
  Result<int> Fd(int fi) const {
    if (fds[fi] < 0) {
      const std::string path = dir + "/" + manifest.files[fi].name;
      fds[fi] = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fds[fi] < 0) return ErrnoError(fmt::format("opening {}", path), errno);
    }
    return fds[fi];
  }

  // Reads piece (fi, pi) whole into `out` and checks its CRC32C.
  Status ReadPiece(int fi, int pi, float* out) const {
    const FileInfo& f = manifest.files[fi];
    const PieceInfo& p = f.pieces[pi];
    const std::string path = dir + "/" + f.name;
    int fd;
    {
      std::lock_guard<std::mutex> lock(mu);
      MS_ASSIGN_OR_RETURN(fd, Fd(fi));
    }
    const size_t bytes = static_cast<size_t>(p.end - p.begin) * sizeof(float);
    MS_RETURN_IF_ERROR(internal::ReadAt(fd, out, bytes, p.offset, path));
    uint32_t crc = Crc32c(out, bytes);
    if (crc != p.crc32c) {
      return DataLoss("checksum mismatch in {} ({} of {} at offset {}): crc32c {:#010x}, manifest says {:#010x}", path,
                      p.kind, p.tensor, p.offset, crc, p.crc32c);
    }
    return Status::Ok();
  }

  // The same layout saved it: the target range is exactly a union of whole saved pieces of the
  // same shard, read straight into `out`. False when it is not (then the tensor is reassembled).
  Result<bool> ReadDirect(const TensorEntry& e, const internal::ShardGeom& g, int64_t begin, int64_t end,
                          float* out) const {
    auto canon = [](model::ShardKind k, int tp, int rank) {
      return (k == model::ShardKind::kReplicated || tp == 1) ? std::make_tuple(model::ShardKind::kReplicated, 1, 0)
                                                             : std::make_tuple(k, tp, rank);
    };
    const auto want = canon(g.kind, g.tp, g.rank);
    std::vector<std::pair<int, int>> use;
    for (auto [fi, pi] : e.pieces) {
      const PieceInfo& p = manifest.files[fi].pieces[pi];
      if (canon(p.shard, p.tp_size, p.tp_rank) == want && p.begin >= begin && p.end <= end && p.end > p.begin) {
        use.emplace_back(fi, pi);
      }
    }
    auto piece = [&](const std::pair<int, int>& x) -> const PieceInfo& {
      return manifest.files[x.first].pieces[x.second];
    };
    std::sort(use.begin(), use.end(), [&](const auto& a, const auto& b) { return piece(a).begin < piece(b).begin; });
    std::vector<std::pair<int, int>> chosen;
    int64_t cursor = begin;
    for (const auto& x : use) {
      const PieceInfo& p = piece(x);
      if (p.end <= cursor) continue;        // a replica of what is chosen already
      if (p.begin != cursor) return false;  // a gap, or a partial overlap
      chosen.push_back(x);
      cursor = p.end;
    }
    if (cursor != end) return false;
    for (const auto& x : chosen) MS_RETURN_IF_ERROR(ReadPiece(x.first, x.second, out + (piece(x).begin - begin)));
    return true;
  }

  // The global tensor, reassembled from every piece that covers it (caller holds assemble_mu).
  Result<std::shared_ptr<const float[]>> Assemble(const std::string& kind, const std::string& tensor,
                                                  const TensorEntry& e) const {
    auto key = std::make_pair(kind, tensor);
    {
      std::lock_guard<std::mutex> lock(mu);
      auto hit = cache.find(key);
      if (hit != cache.end()) return hit->second;
    }
    MS_ASSIGN_OR_RETURN(internal::ShardGeom whole,
                        internal::MakeGeom(e.global_shape, model::ShardKind::kReplicated, 1, 0));
    const int64_t numel = whole.global_numel();
    std::shared_ptr<float[]> global(new float[static_cast<size_t>(numel)]);
    std::vector<std::pair<int64_t, int64_t>> runs;  // global [begin, end) written
    std::vector<float> buf;
    for (auto [fi, pi] : e.pieces) {
      const PieceInfo& p = manifest.files[fi].pieces[pi];
      if (p.end == p.begin) continue;
      MS_ASSIGN_OR_RETURN(internal::ShardGeom g, internal::MakeGeom(p.global_shape, p.shard, p.tp_size, p.tp_rank));
      if (p.begin / g.chunk == (p.end - 1) / g.chunk) {  // one contiguous global run: read in place
        const int64_t gi = g.GlobalIndex(p.begin);
        MS_RETURN_IF_ERROR(ReadPiece(fi, pi, global.get() + gi));
        runs.emplace_back(gi, gi + (p.end - p.begin));
        continue;
      }
      buf.resize(static_cast<size_t>(p.end - p.begin));
      MS_RETURN_IF_ERROR(ReadPiece(fi, pi, buf.data()));
      g.ForEachRun(p.begin, p.end, [&](int64_t li, int64_t gi, int64_t run) {
        std::memcpy(global.get() + gi, buf.data() + (li - p.begin), static_cast<size_t>(run) * sizeof(float));
        runs.emplace_back(gi, gi + run);
      });
    }
    std::sort(runs.begin(), runs.end());
    int64_t covered = 0, missing = 0, first_missing = -1;
    for (const auto& [b, e2] : runs) {
      if (b > covered) {
        if (first_missing < 0) first_missing = covered;
        missing += b - covered;
      }
      covered = std::max(covered, e2);
    }
    if (covered < numel) {
      if (first_missing < 0) first_missing = covered;
      missing += numel - covered;
    }
    if (missing > 0) {
      return DataLoss(
          "tensor '{}' ({}) is incomplete in checkpoint {}: {} of its {} elements were saved by no rank "
          "(first missing: global element {}); were some ranks' pieces left out when saving?",
          tensor, kind, dir, missing, numel, first_missing);
    }
    std::lock_guard<std::mutex> lock(mu);
    cache.emplace(key, global);
    return std::shared_ptr<const float[]>(global);
  }

  mutable std::mutex assemble_mu;  // one reassembly at a time (bounds memory); taken before mu
};

Checkpoint::Checkpoint() : impl_(std::make_unique<Impl>()) {}
Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;
Checkpoint::~Checkpoint() = default;

const std::string& Checkpoint::dir() const {
  return impl_->dir;
}
int64_t Checkpoint::step() const {
  return impl_->manifest.step;
}
const Manifest& Checkpoint::manifest() const {
  return impl_->manifest;
}

const std::string& Checkpoint::metadata(int rank) const {
  static const std::string kEmpty;
  if (rank < 0 || rank >= static_cast<int>(impl_->manifest.files.size())) return kEmpty;
  return impl_->manifest.files[rank].metadata;
}

std::vector<std::string> Checkpoint::kinds() const {
  std::vector<std::string> out;
  for (const auto& [kind, unused] : impl_->index) out.push_back(kind);
  return out;
}

std::vector<std::string> Checkpoint::tensors(const std::string& kind) const {
  std::vector<std::string> out;
  auto k = impl_->index.find(kind);
  if (k == impl_->index.end()) return out;
  for (const auto& [name, unused] : k->second) out.push_back(name);
  return out;
}

Result<std::vector<int64_t>> Checkpoint::GlobalShape(const std::string& kind, const std::string& tensor) const {
  MS_ASSIGN_OR_RETURN(const TensorEntry* e, impl_->Find(kind, tensor));
  return e->global_shape;
}

Status Checkpoint::Read(const std::string& kind, const std::string& tensor, const ShardTarget& target,
                        float* out) const {
  MS_ASSIGN_OR_RETURN(const TensorEntry* e, impl_->Find(kind, tensor));
  if (e->global_shape != target.global_shape) {
    return InvalidArgument(
        "model spec does not match checkpoint {}: tensor '{}' ({}) has global shape {} in the "
        "checkpoint but {} in the model",
        impl_->dir, tensor, kind, internal::ShapeString(e->global_shape), internal::ShapeString(target.global_shape));
  }
  auto g = internal::MakeGeom(target.global_shape, target.shard, target.tp_size, target.tp_rank);
  if (!g.ok()) return g.status().WithContext(fmt::format("reading '{}' ({})", tensor, kind));
  const int64_t end = target.end < 0 ? g->local_numel() : target.end;
  if (target.begin < 0 || target.begin > end || end > g->local_numel()) {
    return InvalidArgument("reading '{}' ({}): range [{}, {}) is not within the {} elements of the TP shard", tensor,
                           kind, target.begin, end, g->local_numel());
  }
  if (end == target.begin) return Status::Ok();
  std::shared_ptr<const float[]> global;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto hit = impl_->cache.find(std::make_pair(kind, tensor));
    if (hit != impl_->cache.end()) global = hit->second;
  }
  if (!global) {
    MS_ASSIGN_OR_RETURN(bool direct, impl_->ReadDirect(*e, *g, target.begin, end, out));
    if (direct) return Status::Ok();
    std::lock_guard<std::mutex> lock(impl_->assemble_mu);
    MS_ASSIGN_OR_RETURN(global, impl_->Assemble(kind, tensor, *e));
  }
  g->ForEachRun(target.begin, end, [&](int64_t li, int64_t gi, int64_t run) {
    std::memcpy(out + (li - target.begin), global.get() + gi, static_cast<size_t>(run) * sizeof(float));
  });
  return Status::Ok();
}

Status Checkpoint::ReadGlobal(const std::string& kind, const std::string& tensor, float* out) const {
  MS_ASSIGN_OR_RETURN(std::vector<int64_t> shape, GlobalShape(kind, tensor));
  ShardTarget t;
  t.global_shape = shape;
  return Read(kind, tensor, t, out);
}

void Checkpoint::DropCache() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->cache.clear();
}

void Checkpoint::DropCache(const std::string& kind, const std::string& tensor) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->cache.erase(std::make_pair(kind, tensor));
}

Result<Checkpoint> Checkpoint::Open(const std::string& step_dir_in, Verify verify) {
  std::string step_dir = step_dir_in;
  while (step_dir.size() > 1 && step_dir.back() == '/') step_dir.pop_back();
  const std::string mpath = step_dir + "/" + kManifestName;
  if (!internal::PathExists(mpath)) {
    if (!internal::PathExists(step_dir)) return NotFound("checkpoint directory {} does not exist", step_dir);
    return NotFound(
        "missing manifest.json in {} (an incomplete checkpoint: its write was interrupted or is still "
        "running)",
        step_dir);
  }
  auto text = ReadFile(mpath);
  if (!text.ok()) return text.status();
  auto parsed = ParseManifest(*text, mpath);
  if (!parsed.ok()) return DataLoss("unparsable manifest: {}", parsed.status().message());

  Checkpoint c;
  Impl& m = *c.impl_;
  m.dir = step_dir;
  m.manifest = std::move(parsed).value();
  m.verify = verify;
  m.fds.assign(m.manifest.files.size(), -1);
  for (size_t fi = 0; fi < m.manifest.files.size(); ++fi) {
    const FileInfo& f = m.manifest.files[fi];
    for (size_t pi = 0; pi < f.pieces.size(); ++pi) {
      const PieceInfo& p = f.pieces[pi];
      TensorEntry& e = m.index[p.kind][p.tensor];
      if (e.pieces.empty()) {
        e.global_shape = p.global_shape;
      } else if (e.global_shape != p.global_shape) {
        return DataLoss("unparsable manifest: {}: tensor '{}' ({}) is saved with global shapes {} and {}", mpath,
                        p.tensor, p.kind, internal::ShapeString(e.global_shape), internal::ShapeString(p.global_shape));
      }
      e.pieces.emplace_back(static_cast<int>(fi), static_cast<int>(pi));
    }
  }
  // Sizes always; whole-file checksums when asked (in parallel, one file per thread).
  for (const FileInfo& f : m.manifest.files) {
    std::string path = step_dir + "/" + f.name;
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      if (errno == ENOENT) return DataLoss("missing file {} (listed in the manifest)", f.name);
      return ErrnoError(fmt::format("stat of {}", path), errno);
    }
    if (st.st_size < f.size) {
      return DataLoss("truncated file {}: {} bytes, manifest says {}", f.name, st.st_size, f.size);
    }
    if (st.st_size != f.size)
      return DataLoss("size mismatch of {}: {} bytes, manifest says {}", f.name, st.st_size, f.size);
  }
  if (verify == Verify::kFull) MS_RETURN_IF_ERROR(VerifyChecksums(step_dir, m.manifest.files));
  return c;
}

Result<Checkpoint> FindLatestValid(const std::string& root_in, Verify verify) {
  std::string root = root_in;
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  if (internal::PathExists(root + "/" + kManifestName)) return Checkpoint::Open(root, verify);
  auto dirs = internal::ListStepDirs(root);
  if (!dirs.ok()) {
    if (dirs.status().code() == Code::kNotFound) return NotFound("no checkpoint: {}", dirs.status().message());
    return dirs.status();  // EACCES, EIO: not the same as "no checkpoint"
  }
  if (dirs->empty()) return NotFound("no checkpoint in {} (no step-* directories)", root);
  std::vector<std::string> rejected;
  for (const auto& [step, path] : *dirs) {
    auto c = Checkpoint::Open(path, verify);
    if (!c.ok() && c.status().code() == Code::kIo) {
      // An I/O or permission error says nothing about the checkpoint's contents: falling back to
      // an older one would silently discard this one's progress.
      return c.status().WithContext(fmt::format(
          "checkpoint {} cannot be read (fix its access, or remove it to fall back to an older checkpoint)", path));
    }
    if (c.ok()) {
      if (!rejected.empty()) {
        LogWarn("checkpoint: using {} after rejecting {} newer one(s)", path, rejected.size());
      }
      return c;
    }
    LogWarn("checkpoint {} rejected: {}; falling back to an older checkpoint", path, c.status().message());
    rejected.push_back(fmt::format("{}: {}", path, c.status().message()));
  }
  return NotFound("no valid checkpoint in {}; rejected: {}", root, fmt::join(rejected, "; "));
}

}  // namespace ms::checkpoint
