// defines: InProcessCoordinator, AsyncCheckpointer (stage 1 copy, stage 2 writer thread,
// manifest commit, retention).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/ranges.h>

#include "checkpoint/internal.h"

namespace ms::checkpoint {

static_assert(std::endian::native == std::endian::little, "checkpoint files are little-endian");

using internal::FsyncPath;
using internal::kDataAlign;
using internal::kFileHeaderBytes;
using internal::kManifestName;
using internal::kPieceAlign;

namespace {
int64_t AlignUp(int64_t x, int64_t a) {
  return (x + a - 1) / a * a;
}
}  // namespace

// ---- InProcessCoordinator ----

struct InProcessCoordinator::State {
  struct Step {
    std::map<int, FileInfo> durable;
    std::optional<Status> failed;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::map<int64_t, Step> steps;
};

InProcessCoordinator::InProcessCoordinator() : state_(std::make_unique<State>()) {}
InProcessCoordinator::~InProcessCoordinator() = default;

Status InProcessCoordinator::MarkDurable(int64_t step, int rank, const FileInfo& info) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->steps[step].durable[rank] = info;
  state_->cv.notify_all();
  return Status::Ok();
}

Status InProcessCoordinator::MarkFailed(int64_t step, int rank, const Status& why) {
  std::lock_guard<std::mutex> lock(state_->mu);
  auto& s = state_->steps[step];
  if (!s.failed) s.failed = why.WithContext(fmt::format("rank {}", rank));
  state_->cv.notify_all();
  return Status::Ok();
}

Result<std::vector<FileInfo>> InProcessCoordinator::WaitAllDurable(int64_t step, int world, double timeout_s) {
  std::unique_lock<std::mutex> lock(state_->mu);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  auto done = [&] {
    auto& s = state_->steps[step];
    return s.failed.has_value() || static_cast<int>(s.durable.size()) >= world;
  };
  bool ok = state_->cv.wait_until(lock, deadline, done);
  State::Step s = std::move(state_->steps[step]);
  state_->steps.erase(step);
  if (s.failed) return *s.failed;
  if (!ok) {
    std::vector<int> missing;
    for (int r = 0; r < world && missing.size() < 16; ++r) {
      if (!s.durable.count(r)) missing.push_back(r);
    }
    return Timeout("checkpoint step {}: timed out after {:.0f} s waiting for rank(s) {} to write their files", step,
                   timeout_s, fmt::join(missing, ", "));
  }
  std::vector<FileInfo> out;
  for (int r = 0; r < world; ++r) {
    auto it = s.durable.find(r);
    if (it == s.durable.end()) return Internal("checkpoint step {}: rank {} missing", step, r);
    out.push_back(std::move(it->second));
  }
  return out;
}

// ---- AsyncCheckpointer ----

namespace {

// Host memory for snapshots: anonymous mmap, transparent huge pages asked for (fewer page
// faults on the first snapshot), grown when a snapshot needs more.
class Staging {
 public:
  Staging() = default;
  ~Staging() { Release(); }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  char* data() const { return p_; }
  size_t capacity() const { return cap_; }
  // Makes room for `bytes`; `touch` faults the pages in now.
  Status Reserve(size_t bytes, bool touch) {
    if (bytes <= cap_) return Status::Ok();
    Release();
    const size_t cap = (bytes + (size_t{2} << 20) - 1) / (size_t{2} << 20) * (size_t{2} << 20);
    void* p = ::mmap(nullptr, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return ErrnoError(fmt::format("allocating {} bytes of host memory for snapshots", cap), errno);
    ::madvise(p, cap, MADV_HUGEPAGE);  // advice only: fine if THP is off
    p_ = static_cast<char*>(p);
    cap_ = cap;
    if (touch) {
      for (size_t i = 0; i < cap; i += 4096) p_[i] = 0;
    }
    return Status::Ok();
  }

 private:
  void Release() {
    if (p_) ::munmap(p_, cap_);  // cannot fail for a mapping we made
    p_ = nullptr;
    cap_ = 0;
  }
  char* p_ = nullptr;
  size_t cap_ = 0;
};

struct Job {
  int64_t step = 0;
  std::vector<PieceInfo> pieces;  // offsets relative to the data region
  std::string metadata;
  size_t data_bytes = 0;
  Status begun;  // Coordinator::BeginStep's outcome, on the training thread: the writer fails the step with it
};

}  // namespace

struct AsyncCheckpointer::Impl {
  CheckpointerOptions opt;
  Coordinator* coord = nullptr;
  std::unique_ptr<InProcessCoordinator> own_coord;  // world == 1 without a coordinator

  mutable std::mutex mu;
  std::condition_variable cv;
  bool busy = false;  // a job is queued or being written; the staging buffer belongs to the writer
  bool stop = false;
  std::optional<Job> job;
  int64_t writing_step = -1;
  Status wait_error;  // first error since the last Wait()
  Status last_error;
  std::vector<int64_t> completed;
  std::vector<WriteOutcome> outcomes;  // not yet taken
  double last_write_s = 0;

  Staging staging;  // the data region of the next file
  std::thread thread;

  void Loop();
  Status WriteJob(const Job& job);
  Status WriteRankFile(const Job& job, const std::string& step_dir, FileInfo* info);
  Status CommitManifest(const Job& job, const std::string& step_dir, std::vector<FileInfo> files);
  void ApplyRetention(int64_t committed_step);
  void Hook(std::string_view stage, int64_t step) {
    if (opt.fault_hook) opt.fault_hook(stage, step);
  }
};

AsyncCheckpointer::AsyncCheckpointer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<AsyncCheckpointer>> AsyncCheckpointer::Create(CheckpointerOptions options,
                                                                     Coordinator* coordinator) {
  const int world = options.layout.world();
  if (options.layout.tp < 1 || options.layout.pp < 1 || options.layout.dp < 1) {
    return InvalidArgument("checkpoint layout tp={} pp={} dp={} must be positive", options.layout.tp, options.layout.pp,
                           options.layout.dp);
  }
  if (options.rank < 0 || options.rank >= world) {
    return InvalidArgument("checkpoint rank {} is not in [0, world {})", options.rank, world);
  }
  if (options.keep < 0) return InvalidArgument("checkpoint keep {} must be >= 0 (0 keeps all)", options.keep);
  if (options.dir.empty()) return InvalidArgument("checkpoint directory is empty");
  if (options.write_chunk_bytes < 4096) options.write_chunk_bytes = 4096;
  if (!coordinator && world != 1) {
    return InvalidArgument("a checkpoint of {} ranks needs a Coordinator (only single-rank runs may omit it)", world);
  }
  while (options.dir.size() > 1 && options.dir.back() == '/') options.dir.pop_back();

  // Prove the directory writable now, not at the first checkpoint hours into the run.
  Status made = MakeDirs(options.dir);
  if (!made.ok()) {
    return FailedPrecondition("checkpoint directory {} cannot be created: {}; pick a writable checkpoint directory",
                              options.dir, made.message());
  }
  std::string probe = fmt::format("{}/.write-probe-rank-{}-{}", options.dir, options.rank, ::getpid());
  int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return FailedPrecondition("checkpoint directory {} is not writable: {}; pick a writable checkpoint directory",
                              options.dir, std::strerror(errno));
  }
  Status wrote = internal::WriteAll(fd, "ok", 2, probe);
  int close_rc = ::close(fd);
  int close_err = errno;
  int unlink_rc = ::unlink(probe.c_str());
  int unlink_err = errno;
  if (!wrote.ok()) {
    return FailedPrecondition("checkpoint directory {} is not writable: {}", options.dir, wrote.message());
  }
  if (close_rc != 0) {
    return FailedPrecondition("checkpoint directory {} is not writable: closing {}: {}", options.dir, probe,
                              std::strerror(close_err));
  }
  if (unlink_rc != 0) {
    return FailedPrecondition("checkpoint directory {}: cannot remove {}: {}", options.dir, probe,
                              std::strerror(unlink_err));
  }

  auto impl = std::make_unique<Impl>();
  impl->opt = std::move(options);
  impl->coord = coordinator;
  if (!coordinator) {
    impl->own_coord = std::make_unique<InProcessCoordinator>();
    impl->coord = impl->own_coord.get();
  }
  if (impl->opt.reserve_bytes > 0) MS_RETURN_IF_ERROR(impl->staging.Reserve(impl->opt.reserve_bytes, true));
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->Loop(); });
  return std::unique_ptr<AsyncCheckpointer>(new AsyncCheckpointer(std::move(impl)));
}

AsyncCheckpointer::~AsyncCheckpointer() {
  {
    std::unique_lock<std::mutex> lock(impl_->mu);
    impl_->stop = true;
    impl_->cv.notify_all();
  }
  impl_->thread.join();
}

Result<SnapshotInfo> AsyncCheckpointer::Snapshot(int64_t step, const std::vector<PieceRef>& pieces,
                                                 std::string metadata) {
  const double t0 = NowSeconds();
  Impl& m = *impl_;
  if (step < 0) return InvalidArgument("checkpoint step {} is negative", step);
  // Validate and lay out the data region before blocking on anything.
  Job job;
  job.step = step;
  job.metadata = std::move(metadata);
  job.pieces.reserve(pieces.size());
  int64_t offset = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const PieceRef& p = pieces[i];
    auto where = [&] { return fmt::format("checkpoint step {}: piece {} ({} of {})", step, i, p.kind, p.tensor); };
    if (p.tensor.empty() || p.kind.empty()) return InvalidArgument("{}: empty tensor or kind name", where());
    auto geom = internal::MakeGeom(p.global_shape, p.shard, p.tp_size, p.tp_rank);
    if (!geom.ok()) return geom.status().WithContext(where());
    if (p.begin < 0 || p.end < p.begin || p.end > geom->local_numel()) {
      return InvalidArgument("{}: range [{}, {}) is not within the {} elements of the TP shard", where(), p.begin,
                             p.end, geom->local_numel());
    }
    if (p.end > p.begin && !p.data) return InvalidArgument("{}: data is null", where());
    PieceInfo info;
    info.tensor = p.tensor;
    info.kind = p.kind;
    info.global_shape = p.global_shape;
    info.shard = p.shard;
    info.tp_size = p.tp_size;
    info.tp_rank = p.tp_rank;
    info.begin = p.begin;
    info.end = p.end;
    info.offset = offset;
    offset = AlignUp(offset + (p.end - p.begin) * static_cast<int64_t>(sizeof(float)), kPieceAlign);
    job.pieces.push_back(std::move(info));
  }
  job.data_bytes = static_cast<size_t>(AlignUp(offset, kDataAlign));  // whole blocks, for O_DIRECT

  SnapshotInfo result;
  {
    std::unique_lock<std::mutex> lock(m.mu);
    if (m.busy) {
      if (m.opt.policy == OverlapPolicy::kSkip) {
        int64_t writing = m.writing_step;
        lock.unlock();
        LogWarn("checkpoint step {} skipped: step {} is still being written (overlap policy: skip)", step, writing);
        Status told = m.coord->MarkFailed(
            step, m.opt.rank,
            Aborted("skipped step {}: the previous checkpoint (step {}) was still being written (policy skip)", step,
                    writing));
        if (!told.ok()) LogWarn("checkpoint step {}: telling the coordinator about the skip: {}", step, told.message());
        result.skipped = true;
        result.blocked_seconds = NowSeconds() - t0;
        return result;
      }
      LogInfo("checkpoint step {}: waiting for step {} to finish writing (overlap policy: wait)", step, m.writing_step);
      const double w0 = NowSeconds();
      m.cv.wait(lock, [&] { return !m.busy; });
      result.wait_seconds = NowSeconds() - w0;
    }
  }
  // Told on this thread, before the next training step: every rank's marks of a later checkpoint come after it,
  // which a store coordinator needs to tell whether a marks-losing restart of its server may have hit this step.
  job.begun = m.coord->BeginStep(step);
  // Not busy: only this thread touches the staging buffer until the job is handed over.
  if (Status st = m.staging.Reserve(job.data_bytes, false); !st.ok()) {
    return st.WithContext(fmt::format("checkpoint step {}", step));
  }
  char* base = m.staging.data();
  int64_t prev_end = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const PieceInfo& info = job.pieces[i];
    size_t n = static_cast<size_t>(pieces[i].end - pieces[i].begin) * sizeof(float);
    if (info.offset > prev_end) std::memset(base + prev_end, 0, static_cast<size_t>(info.offset - prev_end));
    if (n) std::memcpy(base + info.offset, pieces[i].data, n);
    prev_end = info.offset + static_cast<int64_t>(n);
  }
  if (static_cast<int64_t>(job.data_bytes) > prev_end) {
    std::memset(base + prev_end, 0, job.data_bytes - static_cast<size_t>(prev_end));
  }
  result.bytes = prev_end;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.job = std::move(job);
    m.busy = true;
    m.writing_step = step;
    m.cv.notify_all();
  }
  result.blocked_seconds = NowSeconds() - t0;
  LogDebug("checkpoint step {}: snapshot of {} bytes blocked training {:.3f} s", step, result.bytes,
           result.blocked_seconds);
  return result;
}

Status AsyncCheckpointer::Wait() {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->cv.wait(lock, [&] { return !impl_->busy; });
  Status s = impl_->wait_error;
  impl_->wait_error = Status::Ok();
  return s;
}

Status AsyncCheckpointer::LastError() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->last_error;
}

std::vector<int64_t> AsyncCheckpointer::CompletedSteps() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->completed;
}

std::vector<WriteOutcome> AsyncCheckpointer::TakeOutcomes() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return std::exchange(impl_->outcomes, {});
}

double AsyncCheckpointer::LastWriteSeconds() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->last_write_s;
}

void AsyncCheckpointer::Impl::Loop() {
  while (true) {
    Job j;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return stop || job.has_value(); });
      if (!job) return;  // stop, nothing queued
      j = std::move(*job);
      job.reset();
    }
    const double t0 = NowSeconds();
    Status s = WriteJob(j);
    const double dt = NowSeconds() - t0;
    if (!s.ok()) LogError("{}", s.message());
    std::lock_guard<std::mutex> lock(mu);
    outcomes.push_back({j.step, s, dt});
    if (s.ok()) {
      completed.push_back(j.step);
      last_write_s = dt;
    } else {
      if (wait_error.ok()) wait_error = s;
      last_error = s;
    }
    busy = false;
    writing_step = -1;
    cv.notify_all();
  }
}

Status AsyncCheckpointer::Impl::WriteRankFile(const Job& j, const std::string& step_dir, FileInfo* info) {
  const std::string path = step_dir + "/" + RankFileName(opt.rank);
  const std::string tmp = path + ".tmp";
  info->rank = opt.rank;
  info->name = RankFileName(opt.rank);
  info->metadata = j.metadata;
  info->pieces = j.pieces;
  const char* data = staging.data();

  // The index (with absolute offsets and piece checksums) precedes the data, but the checksums
  // are computed while the data is written: the data goes first at a data offset chosen from an
  // upper bound of the index length, the header and index last. One pass over the data.
  int64_t data_offset = 0;
  {
    FileInfo bound = *info;
    for (auto& p : bound.pieces) {
      p.offset = INT64_MAX / 2;
      p.crc32c = 0xFFFFFFFFu;
    }
    bound.size = INT64_MAX / 2;
    std::string text;
    internal::AppendFileInfoJson(&text, bound);
    data_offset = AlignUp(static_cast<int64_t>(kFileHeaderBytes + text.size()), kDataAlign);
  }

  // O_DIRECT where the file system takes it (the data is block-aligned in page-aligned memory):
  // no second copy through the page cache, and the cache is not flooded with checkpoint data.
  int fd = opt.direct_io ? ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644) : -1;
  if (fd < 0) fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError(fmt::format("creating {}", tmp), errno);
  auto fail = [&](Status s) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return s;
  };
  if (::lseek(fd, data_offset, SEEK_SET) != data_offset) return fail(ErrnoError(fmt::format("seeking {}", tmp), errno));
  std::vector<uint32_t> crcs(info->pieces.size(), 0);
  size_t next = 0;  // first piece not yet fully checksummed
  for (size_t pos = 0; pos < j.data_bytes;) {
    const size_t n = std::min(opt.write_chunk_bytes, j.data_bytes - pos);
    // Checksum the parts of pieces inside this chunk just before writing it (it is in cache).
    for (size_t i = next; i < j.pieces.size(); ++i) {
      const size_t b = static_cast<size_t>(j.pieces[i].offset);
      const size_t e = b + static_cast<size_t>(j.pieces[i].end - j.pieces[i].begin) * sizeof(float);
      if (b >= pos + n) break;
      const size_t sb = std::max(b, pos), se = std::min(e, pos + n);
      if (se > sb) crcs[i] = Crc32c(data + sb, se - sb, crcs[i]);
      if (e <= pos + n) next = i + 1;
      if (e > pos + n) break;
    }
    Status s = internal::WriteAll(fd, data + pos, n, tmp);
    if (!s.ok()) return fail(s);
    pos += n;
  }
  // The data region's checksum from the pieces' and the zero padding's.
  static const char kZeros[kPieceAlign] = {};
  uint32_t data_crc = 0;
  int64_t cursor = 0;
  auto add_padding = [&](int64_t upto) {
    while (cursor < upto) {
      size_t pad = static_cast<size_t>(std::min<int64_t>(upto - cursor, kPieceAlign));
      data_crc = internal::Crc32cCombine(data_crc, Crc32c(kZeros, pad), pad);
      cursor += static_cast<int64_t>(pad);
    }
  };
  for (size_t i = 0; i < info->pieces.size(); ++i) {
    PieceInfo& p = info->pieces[i];
    const int64_t len = (p.end - p.begin) * static_cast<int64_t>(sizeof(float));
    add_padding(p.offset);
    data_crc = internal::Crc32cCombine(data_crc, crcs[i], static_cast<uint64_t>(len));
    cursor = p.offset + len;
    p.crc32c = crcs[i];
    p.offset += data_offset;
  }
  add_padding(static_cast<int64_t>(j.data_bytes));
  info->size = data_offset + static_cast<int64_t>(j.data_bytes);
  info->crc32c = 0;  // the file cannot hold its own checksum; the manifest does
  std::string index;
  internal::AppendFileInfoJson(&index, *info);
  if (static_cast<int64_t>(kFileHeaderBytes + index.size()) > data_offset) {
    return fail(Internal("checkpoint index of {} bytes overflows its {}-byte bound", index.size(), data_offset));
  }
  const size_t head_size = static_cast<size_t>(data_offset);
  std::unique_ptr<char, void (*)(void*)> head_buf(static_cast<char*>(std::aligned_alloc(kDataAlign, head_size)),
                                                  std::free);
  if (!head_buf) return fail(Internal("cannot allocate {} bytes for the checkpoint header", head_size));
  std::memset(head_buf.get(), 0, head_size);
  {
    char* h = head_buf.get();
    std::memcpy(h, internal::kFileMagic, 8);
    uint32_t version = internal::kFormatVersion, rank = static_cast<uint32_t>(opt.rank);
    uint64_t index_offset = kFileHeaderBytes, index_bytes = index.size(), doff = data_offset, dbytes = j.data_bytes;
    std::memcpy(h + 8, &version, 4);
    std::memcpy(h + 12, &rank, 4);
    std::memcpy(h + 16, &j.step, 8);
    std::memcpy(h + 24, &index_offset, 8);
    std::memcpy(h + 32, &index_bytes, 8);
    std::memcpy(h + 40, &doff, 8);
    std::memcpy(h + 48, &dbytes, 8);
    uint32_t hcrc = Crc32c(h, 56);
    std::memcpy(h + 56, &hcrc, 4);
    std::memcpy(h + kFileHeaderBytes, index.data(), index.size());
  }
  if (::lseek(fd, 0, SEEK_SET) != 0) return fail(ErrnoError(fmt::format("seeking {}", tmp), errno));
  Status s = internal::WriteAll(fd, head_buf.get(), head_size, tmp);
  if (!s.ok()) return fail(s);
  MS_RETURN_IF_ERROR(CommitTempFile(fd, tmp, path));
  MS_RETURN_IF_ERROR(FsyncPath(step_dir));
  info->crc32c = internal::Crc32cCombine(Crc32c(head_buf.get(), head_size), data_crc, j.data_bytes);
  return Status::Ok();
}

Status AsyncCheckpointer::Impl::CommitManifest(const Job& j, const std::string& step_dir, std::vector<FileInfo> files) {
  std::string out = "{\n";
  out += fmt::format("\"format\": \"{}\",\n\"version\": {},\n\"step\": {},\n\"created\": \"{}\",\n",
                     internal::kFormatName, internal::kFormatVersion, j.step, WallClockIso8601());
  out += fmt::format("\"layout\": {{\"tp\": {}, \"pp\": {}, \"dp\": {}, \"world\": {}}},\n\"files\": [\n",
                     opt.layout.tp, opt.layout.pp, opt.layout.dp, opt.layout.world());
  for (size_t i = 0; i < files.size(); ++i) {
    if (i) out += ",\n";
    internal::AppendFileInfoJson(&out, files[i]);
  }
  out += "\n]\n}\n";
  return WriteFileAtomic(step_dir + "/" + kManifestName, out);
}

Status AsyncCheckpointer::Impl::WriteJob(const Job& j) {
  const std::string step_dir = opt.dir + "/" + StepDirName(j.step);
  const bool leader = opt.rank == 0;
  auto fail = [&](Status s) {
    Status out = s;
    if (internal::IsDiskFull(s)) {
      out = IoError("disk full writing checkpoint step {} in {}: {}; {}", j.step, opt.dir, s.message(),
                    leader ? "the partial step directory was removed and the earlier checkpoints are intact"
                           : "this rank's partial file was removed; the earlier checkpoints are intact");
    } else {
      out = s.WithContext(fmt::format("checkpoint step {} in {} (rank {})", j.step, opt.dir, opt.rank));
    }
    Status told = coord->MarkFailed(j.step, opt.rank, out);
    if (!told.ok())
      LogWarn("checkpoint step {}: telling the coordinator about the failure: {}", j.step, told.message());
    if (leader) {
      Status removed = internal::RemoveStepDir(step_dir);
      if (!removed.ok())
        LogWarn("checkpoint step {}: removing the partial {}: {}", j.step, step_dir, removed.message());
    }
    return out;
  };

  Hook("write", j.step);
  if (!j.begun.ok()) return fail(j.begun);
  Status s = MakeDirs(step_dir);
  if (!s.ok()) return fail(s);
  s = FsyncPath(opt.dir);
  if (!s.ok()) return fail(s);
  // A manifest left by an earlier attempt at this step (a restarted job) must not vouch for
  // files that are about to be replaced: it goes before any file does.
  std::string manifest = step_dir + "/" + kManifestName;
  if (::unlink(manifest.c_str()) != 0 && errno != ENOENT) {
    return fail(ErrnoError(fmt::format("removing the stale {}", manifest), errno));
  }
  FileInfo info;
  s = WriteRankFile(j, step_dir, &info);
  if (!s.ok()) return fail(s);
  Hook("durable", j.step);
  s = coord->MarkDurable(j.step, opt.rank, info);
  if (!s.ok()) return fail(s);
  if (!leader) return Status::Ok();

  auto files = coord->WaitAllDurable(j.step, opt.layout.world(), opt.coordination_timeout_s);
  if (!files.ok()) return fail(files.status());
  Hook("manifest", j.step);
  s = CommitManifest(j, step_dir, std::move(files).value());
  if (!s.ok()) {
    ::unlink((manifest + ".tmp").c_str());
    return fail(s);
  }
  LogInfo("checkpoint step {} committed: {}", j.step, step_dir);
  ApplyRetention(j.step);
  return Status::Ok();
}

void AsyncCheckpointer::Impl::ApplyRetention(int64_t committed_step) {
  if (opt.keep <= 0) return;
  auto dirs = internal::ListStepDirs(opt.dir);
  if (!dirs.ok()) {
    LogWarn("checkpoint retention: {}", dirs.status().message());
    return;
  }
  int complete_seen = 0;
  int64_t newest_complete = -1;
  for (const auto& [step, path] : *dirs) {  // newest first
    bool complete = internal::PathExists(path + "/" + kManifestName);
    if (complete) {
      if (newest_complete < 0) newest_complete = step;
      if (++complete_seen <= opt.keep || step == committed_step) continue;
    } else if (newest_complete < 0 || step >= committed_step) {
      continue;  // newer than every complete checkpoint: may still be being written
    }
    LogInfo("checkpoint retention: removing {} ({})", path,
            complete ? fmt::format("older than the newest {} complete checkpoints", opt.keep)
                     : std::string("incomplete, older than the newest complete checkpoint"));
    Status removed = internal::RemoveStepDir(path);
    if (!removed.ok()) LogWarn("checkpoint retention: {}", removed.message());
  }
}

}  // namespace ms::checkpoint
