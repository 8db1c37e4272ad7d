// The batch sources of data.loader: per_rank (the sampler in the rank) and shared (one loader thread
// per host writing a POSIX shared-memory ring, see loader.h).
#include "runner/loader.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>

#include "bootstrap/bootstrap.h"
#include "runner/fault_injection.h"

namespace ms::runner {
namespace {

double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}
int64_t MonotonicNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}
// Waits (at most timeout_s) while *word == seen; another process wakes it with Wake after changing the word.
// The segment is a shared mapping, so the futexes are not process-private.
void WaitChange(std::atomic<uint32_t>* word, uint32_t seen, double timeout_s) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout_s);
  ts.tv_nsec = static_cast<long>((timeout_s - static_cast<double>(ts.tv_sec)) * 1e9);
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}
void Bump(std::atomic<uint32_t>* word) {
  word->fetch_add(1, std::memory_order_acq_rel);
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}
bool ProcessGone(int pid) {
  return pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH;
}

uint64_t Checksum(const void* data, size_t n) {
  // FNV-1a over 8-byte words (the tail byte-wise): cheap, and any torn or stale write shows.
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = 1469598103934665603ULL;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * 1099511628211ULL;
  }
  for (; i < n; ++i) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}

// ---- per_rank ---------------------------------------------------------------------------

class PerRankSource final : public BatchSource {
 public:
  PerRankSource(const data::Sampler& sampler, const DataPosition& pos, int dp_rank)
      : sampler_(sampler), pos_(pos), dp_(dp_rank), seq_(static_cast<size_t>(sampler.seq_len()) + 1) {}
  Status Fetch(int64_t step, int mb, int32_t* inputs, int32_t* targets, int64_t* sample_ids) override {
    const double c0 = ThreadCpuSeconds();
    const int T = sampler_.seq_len();
    const int64_t first = pos_.FirstSample(step, dp_, mb);
    for (int i = 0; i < pos_.micro; ++i) {
      MS_ASSIGN_OR_RETURN(sample_ids[i], sampler_.TrainSampleIndex(first + i));
      MS_RETURN_IF_ERROR(sampler_.GetTrain(first + i, seq_.data()));
      std::copy(seq_.begin(), seq_.begin() + T, inputs + static_cast<int64_t>(i) * T);
      std::copy(seq_.begin() + 1, seq_.end(), targets + static_cast<int64_t>(i) * T);
    }
    stats_.dataset_bytes += static_cast<int64_t>(pos_.micro) * (T + 1) * sampler_.itemsize();
    stats_.cpu_s += ThreadCpuSeconds() - c0;
    return Status::Ok();
  }
  Stats stats() const override {
    Stats s = stats_;
    s.memory_bytes = sampler_.cache_bytes() + static_cast<int64_t>(4 * seq_.capacity());
    return s;
  }

 private:
  const data::Sampler& sampler_;
  DataPosition pos_;
  int dp_;
  std::vector<int32_t> seq_;
  Stats stats_;
};

// ---- shared: the segment ------------------------------------------------------------------

constexpr uint64_t kMagic = 0x4d534c4f41444552ULL;  // "MSLOADER"
constexpr int kMaxLocal = 512;
constexpr int kStateBuilding = 0, kStateReady = 1, kStateFailed = 2;

struct alignas(64) ReaderSlot {
  std::atomic<int64_t> copied;  // the last step this reader copied out of the ring
  std::atomic<int32_t> pid;     // 0 until attached
  int32_t needs = 0;            // 1: the loader waits for this reader
};

struct Header {
  uint64_t magic;
  char nonce[256];  // the segment name (job id, attempt): a reader never attaches to another run's segment
  int32_t micro, n_micro, seq_len, depth, n_dp, local_world;
  int64_t slot_bytes, part_bytes, data_offset, first_step, last_step;
  std::atomic<int32_t> state;
  std::atomic<int32_t> loader_pid;
  std::atomic<int64_t> heartbeat_ns;  // CLOCK_MONOTONIC of the loader's last sign of life
  std::atomic<int64_t> published;     // the last step written
  std::atomic<uint32_t> publish_gen;  // futex: bumped by the loader after each slot and on failure
  std::atomic<uint32_t> copy_gen;     // futex: bumped by a reader after each copy out of the ring
  char error[1024];
  int32_t dp_index[kMaxLocal];  // the data-parallel indices of the slot parts, ascending
  ReaderSlot readers[kMaxLocal];
};
static_assert(std::atomic<int64_t>::is_always_lock_free && std::atomic<int32_t>::is_always_lock_free &&
                  sizeof(std::atomic<uint32_t>) == 4,
              "the ring's atomics must work across processes");

// A slot: its header, then one part per data-parallel index: n_micro * micro rows of
// (sample id int64, seq_len + 1 tokens int32).
// (The slot header is followed by one checksum (uint64) per part, see Checksums.)
struct SlotHeader {
  std::atomic<int64_t> seq;  // 2 * step + 1 while written, 2 * step + 2 once complete
  int64_t step;
};
uint64_t* Checksums(SlotHeader* slot) {
  return reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(slot) + 16);
}

int64_t RowBytes(int T) {
  return 8 + 4 * (static_cast<int64_t>(T) + 1);
}
int64_t Align(int64_t n, int64_t a) {
  return (n + a - 1) / a * a;
}

class Segment {
 public:
  Segment() = default;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment() {
    if (base_ && base_ != MAP_FAILED) ::munmap(base_, size_);
    if (owner_) ::shm_unlink(name_.c_str());
  }
  Status Create(const std::string& name, size_t size) {
    name_ = name;
    int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) return ErrnoError(fmt::format("creating the data loader's shared memory /dev/shm{}", name), errno);
    owner_ = true;
    if (::fchmod(fd, 0600) != 0 || ::ftruncate(fd, static_cast<off_t>(size)) != 0) {
      const int err = errno;
      ::close(fd);
      return ErrnoError(fmt::format("sizing /dev/shm{} to {} bytes (is /dev/shm large enough?)", name, size), err);
    }
    return Map(fd, size);
  }
  // NotFound while the segment does not exist yet.
  Status Open(const std::string& name) {
    name_ = name;
    int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) {
      if (errno == ENOENT) return NotFound("/dev/shm{} does not exist yet", name);
      return ErrnoError(fmt::format("opening /dev/shm{}", name), errno);
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      return ErrnoError(fmt::format("stat of /dev/shm{}", name), err);
    }
    if (static_cast<size_t>(st.st_size) < sizeof(Header)) {
      ::close(fd);
      return NotFound("/dev/shm{} is not sized yet", name);
    }
    return Map(fd, static_cast<size_t>(st.st_size));
  }
  Header* header() const { return static_cast<Header*>(base_); }
  char* base() const { return static_cast<char*>(base_); }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  Status Map(int fd, size_t size) {
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int err = errno;
    ::close(fd);
    if (p == MAP_FAILED) return ErrnoError(fmt::format("mapping /dev/shm{}", name_), err);
    base_ = p;
    size_ = size;
    return Status::Ok();
  }
  std::string name_;
  void* base_ = nullptr;
  size_t size_ = 0;
  bool owner_ = false;
};

SlotHeader* SlotAt(const Segment& seg, int64_t step) {
  const Header* h = seg.header();
  return reinterpret_cast<SlotHeader*>(seg.base() + h->data_offset + (step % h->depth) * h->slot_bytes);
}
int64_t SlotHeaderBytes(int n_dp) {
  return Align(16 + 8 * static_cast<int64_t>(n_dp), 64);
}
char* PartAt(const Segment& seg, int64_t step, int part) {
  const Header* h = seg.header();
  return reinterpret_cast<char*>(SlotAt(seg, step)) + SlotHeaderBytes(h->n_dp) + part * h->part_bytes;
}

std::string SegmentName(const std::string& run_dir, int host_index) {
  const std::string job = GetEnv("MEGASCALE_JOB_ID").value_or(fmt::format("solo{}", getpid()));
  const std::string attempt = GetEnv("MEGASCALE_ATTEMPT").value_or("0");
  // At most ~110 characters (the job id is at most 40 + 13): under NAME_MAX, and it fits Header::nonce.
  return fmt::format("/{}{}-a{}-h{}", LoaderSegmentPrefix(run_dir), job.substr(0, 64), attempt, host_index);
}

// ---- shared: the loader thread --------------------------------------------------------------

class HostLoader {
 public:
  HostLoader(const data::Sampler& sampler, const DataPosition& pos, std::shared_ptr<Segment> seg, int rank)
      : sampler_(sampler), pos_(pos), seg_(std::move(seg)), rank_(rank) {}
  ~HostLoader() { Stop(); }
  void Start() {
    thread_ = std::thread([this] { Run(); });
  }
  void Stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  double cpu_s() const { return cpu_s_.load(); }
  int64_t dataset_bytes() const { return bytes_.load(); }
  int64_t cache_bytes() const { return sampler_.cache_bytes(); }

 private:
  void Fail(const std::string& why) {
    Header* h = seg_->header();
    std::snprintf(h->error, sizeof h->error, "%s", why.c_str());
    h->state.store(kStateFailed, std::memory_order_release);
    Bump(&h->publish_gen);
    LogError("data loader: {}", why);
  }
  void Beat() { seg_->header()->heartbeat_ns.store(MonotonicNs(), std::memory_order_release); }
  // Waits until every reader that needs data has copied step - depth (the slot's previous use).
  bool WaitForSlot(int64_t step) {
    Header* h = seg_->header();
    double next_check = 0;
    for (;;) {
      if (stop_.load()) return false;
      const uint32_t gen = h->copy_gen.load(std::memory_order_acquire);
      bool free = true;
      for (int l = 0; l < h->local_world; ++l) {
        if (h->readers[l].needs && h->readers[l].copied.load(std::memory_order_acquire) < step - h->depth) {
          free = false;
          break;
        }
      }
      if (free) return true;
      if (NowSeconds() >= next_check) {
        next_check = NowSeconds() + 0.1;
        Beat();
        for (int l = 0; l < h->local_world; ++l) {
          const int pid = h->readers[l].pid.load();
          const bool finished = h->readers[l].copied.load() == INT64_MAX;
          if (h->readers[l].needs && !finished && ProcessGone(pid)) {
            Fail(fmt::format("local rank {} (pid {}) is gone while the loader waited for it to take step {}", l, pid,
                             step - h->depth));
            return false;
          }
        }
      }
      // The loader is ahead when it waits here: it sleeps until a reader copies (or 0.1 s, for the checks).
      WaitChange(&h->copy_gen, gen, 0.1);
    }
  }
  void Run() {
    const double c0 = ThreadCpuSeconds();
    Header* h = seg_->header();
    const int T = h->seq_len;
    std::vector<int32_t> row(static_cast<size_t>(T) + 1);
    for (int64_t step = h->first_step; step <= h->last_step; ++step) {
      if (!WaitForSlot(step)) break;
      if (InjectLoaderStall(rank_, step)) {  // test hook: the loader stops as a dead one would
        while (!stop_.load()) ::usleep(10000);
        break;
      }
      SlotHeader* slot = SlotAt(*seg_, step);
      slot->seq.store(2 * step + 1, std::memory_order_release);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      slot->step = step;
      for (int part = 0; part < h->n_dp; ++part) {
        char* out = PartAt(*seg_, step, part);
        for (int mb = 0; mb < h->n_micro; ++mb) {
          const int64_t first = pos_.FirstSample(step, h->dp_index[part], mb);
          for (int i = 0; i < h->micro; ++i) {
            auto j = sampler_.TrainSampleIndex(first + i);
            Status s = j.ok() ? sampler_.GetTrain(first + i, row.data()) : j.status();
            if (!s.ok()) {
              Fail(fmt::format("reading training sample {} for step {}: {}", first + i, step, s.message()));
              cpu_s_.store(ThreadCpuSeconds() - c0);
              return;
            }
            std::memcpy(out, &*j, 8);
            std::memcpy(out + 8, row.data(), 4 * row.size());
            out += RowBytes(T);
          }
        }
        Checksums(slot)[part] = Checksum(PartAt(*seg_, step, part), static_cast<size_t>(h->part_bytes));
        bytes_.fetch_add(static_cast<int64_t>(h->n_micro) * h->micro * (T + 1) * sampler_.itemsize());
      }
      slot->seq.store(2 * step + 2, std::memory_order_release);
      h->published.store(step, std::memory_order_release);
      Beat();
      Bump(&h->publish_gen);
      cpu_s_.store(ThreadCpuSeconds() - c0);
    }
    cpu_s_.store(ThreadCpuSeconds() - c0);
  }

  const data::Sampler& sampler_;
  DataPosition pos_;
  std::shared_ptr<Segment> seg_;
  int rank_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<double> cpu_s_{0};
  std::atomic<int64_t> bytes_{0};
};

// ---- shared: a reader ---------------------------------------------------------------------------

class SharedSource final : public BatchSource {
 public:
  SharedSource(std::shared_ptr<Segment> seg, std::unique_ptr<HostLoader> loader, int local, int part, std::string host,
               double timeout_s)
      : seg_(std::move(seg)),
        loader_(std::move(loader)),
        local_(local),
        part_(part),
        host_(std::move(host)),
        timeout_s_(timeout_s) {
    const Header* h = seg_->header();
    copy_.resize(static_cast<size_t>(h->part_bytes));
  }
  ~SharedSource() override {
    if (local_ >= 0) {  // never hold the loader back once gone
      seg_->header()->readers[local_].copied.store(INT64_MAX, std::memory_order_release);
      Bump(&seg_->header()->copy_gen);
    }
    loader_.reset();  // the loader thread stops before the segment goes
  }

  Status Fetch(int64_t step, int mb, int32_t* inputs, int32_t* targets, int64_t* sample_ids) override {
    const Header* h = seg_->header();
    if (part_ < 0) return Internal("rank without token inputs fetched a batch");
    if (step != have_step_) MS_RETURN_IF_ERROR(CopyStep(step));
    const double c0 = ThreadCpuSeconds();
    const int T = h->seq_len;
    const char* row = copy_.data() + static_cast<int64_t>(mb) * h->micro * RowBytes(T);
    for (int i = 0; i < h->micro; ++i, row += RowBytes(T)) {
      std::memcpy(&sample_ids[i], row, 8);
      const auto* tokens = reinterpret_cast<const int32_t*>(row + 8);
      std::memcpy(inputs + static_cast<int64_t>(i) * T, tokens, 4 * static_cast<size_t>(T));
      std::memcpy(targets + static_cast<int64_t>(i) * T, tokens + 1, 4 * static_cast<size_t>(T));
    }
    stats_.cpu_s += ThreadCpuSeconds() - c0;
    return Status::Ok();
  }
  Stats stats() const override {
    Stats s = stats_;
    s.memory_bytes = static_cast<int64_t>(copy_.capacity());
    if (loader_) {
      s.cpu_s += loader_->cpu_s();
      s.dataset_bytes += loader_->dataset_bytes();
      s.segment_bytes = static_cast<int64_t>(seg_->size());
      s.memory_bytes += s.segment_bytes + loader_->cache_bytes();
    }
    return s;
  }

 private:
  std::string LoaderName() const {
    return fmt::format("the data loader of host {} (a thread of its local rank 0, pid {}; /dev/shm{})", host_,
                       seg_->header()->loader_pid.load(), seg_->name());
  }
  Status CopyStep(int64_t step) {
    Header* h = seg_->header();
    SlotHeader* slot = SlotAt(*seg_, step);
    const int64_t want = 2 * step + 2;
    double next_check = NowSeconds() + 0.1;
    for (;;) {
      const uint32_t gen = h->publish_gen.load(std::memory_order_acquire);
      const int64_t seq = slot->seq.load(std::memory_order_acquire);
      if (seq == want) break;
      if (seq > want) {
        return Internal("{}: the slot of step {} was rewritten (sequence {}) before this rank read it", LoaderName(),
                        step, seq);
      }
      if (h->state.load(std::memory_order_acquire) == kStateFailed) {
        return Aborted("{} failed: {}", LoaderName(), std::string(h->error, strnlen(h->error, sizeof h->error)));
      }
      if (NowSeconds() >= next_check) {
        next_check = NowSeconds() + 0.1;
        if (ProcessGone(h->loader_pid.load())) {
          return Aborted("{} is gone (its process exited) while this rank waited for step {}", LoaderName(), step);
        }
        const double silent = 1e-9 * static_cast<double>(MonotonicNs() - h->heartbeat_ns.load());
        if (silent > timeout_s_) {
          return Timeout(
              "{} published nothing for {:.0f} s (data.loader_timeout_s = {}) while this rank waited for "
              "step {} (last published: step {})",
              LoaderName(), silent, timeout_s_, step, h->published.load());
        }
      }
      // Behind: sleep until the loader publishes (or 0.1 s, for the checks).
      WaitChange(&h->publish_gen, gen, 0.1);
    }
    const double c0 = ThreadCpuSeconds();
    std::memcpy(copy_.data(), PartAt(*seg_, step, part_), copy_.size());
    std::atomic_thread_fence(std::memory_order_acquire);
    const int64_t after = slot->seq.load(std::memory_order_acquire);
    if (after != want) {
      return Internal("{}: the slot of step {} changed (sequence {} -> {}) while this rank copied it", LoaderName(),
                      step, want, after);
    }
    if (Checksum(copy_.data(), copy_.size()) != Checksums(slot)[part_]) {
      return DataLoss("{}: the data of step {} fails its checksum", LoaderName(), step);
    }
    h->readers[local_].copied.store(step, std::memory_order_release);  // the slot is free for the loader
    Bump(&h->copy_gen);
    have_step_ = step;
    stats_.cpu_s += ThreadCpuSeconds() - c0;
    return Status::Ok();
  }

  std::shared_ptr<Segment> seg_;
  std::unique_ptr<HostLoader> loader_;  // local rank 0 only
  int local_;                           // this rank's reader slot (-1: not a reader)
  int part_;                            // its data-parallel part of a slot (-1: needs no tokens)
  std::string host_;
  double timeout_s_;
  int64_t have_step_ = -1;
  std::vector<char> copy_;
  Stats stats_;
};

// The host's loader without a reader in this rank (local rank 0 of a stage that needs no tokens).
class LoaderOnly final : public BatchSource {
 public:
  LoaderOnly(std::shared_ptr<Segment> seg, std::unique_ptr<HostLoader> loader)
      : seg_(std::move(seg)), loader_(std::move(loader)) {}
  ~LoaderOnly() override { loader_.reset(); }
  Status Fetch(int64_t, int, int32_t*, int32_t*, int64_t*) override {
    return Internal("rank without token inputs fetched a batch");
  }
  Stats stats() const override {
    Stats s;
    s.cpu_s = loader_->cpu_s();
    s.dataset_bytes = loader_->dataset_bytes();
    s.segment_bytes = static_cast<int64_t>(seg_->size());
    s.memory_bytes = s.segment_bytes + loader_->cache_bytes();
    return s;
  }

 private:
  std::shared_ptr<Segment> seg_;
  std::unique_ptr<HostLoader> loader_;
};

class NoTokens final : public BatchSource {
 public:
  Status Fetch(int64_t, int, int32_t*, int32_t*, int64_t*) override {
    return Internal("rank without token inputs fetched a batch");
  }
  Stats stats() const override { return {}; }
};

}  // namespace

std::string LoaderSegmentPrefix(const std::string& run_dir) {
  return fmt::format("megascale-{}-{}-", getuid(), data::Fingerprint(run_dir).substr(0, 12));
}

int RemoveLoaderSegments(const std::string& run_dir, const std::string& keep, int host_index) {
  const std::string prefix = LoaderSegmentPrefix(run_dir);
  const std::string suffix = host_index >= 0 ? fmt::format("-h{}", host_index) : std::string();
  DIR* d = ::opendir("/dev/shm");
  if (d == nullptr) return 0;
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind(prefix, 0) == 0 && "/" + name != keep && name.ends_with(suffix)) names.push_back(name);
  }
  ::closedir(d);
  int removed = 0;
  for (const auto& name : names) {
    if (::shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  return removed;
}

Result<std::unique_ptr<BatchSource>> MakeBatchSource(const config::JobSpec& spec, const Runtime& rt,
                                                     const data::Sampler& sampler, const DataPosition& pos,
                                                     bool needs_tokens) {
  if (spec.data.loader == "per_rank") {
    if (!needs_tokens) return std::unique_ptr<BatchSource>(std::make_unique<NoTokens>());
    return std::unique_ptr<BatchSource>(std::make_unique<PerRankSource>(sampler, pos, rt.dp_rank));
  }
  // shared: which ranks of this host need tokens, and their data-parallel indices.
  const auto& par = spec.parallel;
  MS_ASSIGN_OR_RETURN(auto grid, bootstrap::ParallelGrid::Make(rt.world, par.tp, par.pp));
  std::vector<int> ranks = rt.host.ranks;
  if (ranks.empty()) ranks = {rt.rank};
  if (static_cast<int>(ranks.size()) > kMaxLocal) {
    return InvalidArgument("data.loader: shared supports at most {} ranks per host, this host has {}", kMaxLocal,
                           ranks.size());
  }
  const int local = std::max(0, rt.host.local_rank);
  std::vector<int> needs(ranks.size(), 0), dps;
  for (size_t l = 0; l < ranks.size(); ++l) {
    const auto c = grid.CoordsOf(ranks[l]);
    needs[l] = c.pp == 0 || c.pp == par.pp - 1;
    if (needs[l]) dps.push_back(c.dp);
  }
  std::sort(dps.begin(), dps.end());
  dps.erase(std::unique(dps.begin(), dps.end()), dps.end());
  const int my_part = needs_tokens ? static_cast<int>(std::find(dps.begin(), dps.end(), rt.dp_rank) - dps.begin()) : -1;
  if (dps.empty()) return std::unique_ptr<BatchSource>(std::make_unique<NoTokens>());
  if (!needs_tokens && local != 0) return std::unique_ptr<BatchSource>(std::make_unique<NoTokens>());

  const std::string name = SegmentName(spec.log.run_dir, rt.host.index);
  const int T = sampler.seq_len();
  const int n_dp = static_cast<int>(dps.size());
  const int64_t part_bytes = static_cast<int64_t>(pos.n_micro) * pos.micro * RowBytes(T);
  const int64_t slot_bytes = Align(SlotHeaderBytes(n_dp) + n_dp * part_bytes, 64);
  const int64_t data_offset = Align(sizeof(Header), 4096);
  auto seg = std::make_shared<Segment>();
  std::unique_ptr<HostLoader> loader;
  if (local == 0) {
    const int stale = RemoveLoaderSegments(spec.log.run_dir, name, rt.host.index);
    if (stale > 0) LogInfo("removed {} stale data loader segment(s) of this job from /dev/shm", stale);
    const size_t size = static_cast<size_t>(data_offset + spec.data.prefetch * slot_bytes);
    MS_RETURN_IF_ERROR(seg->Create(name, size));
    Header* h = seg->header();  // the mapping is zero-filled
    h->magic = kMagic;
    std::snprintf(h->nonce, sizeof h->nonce, "%s", name.c_str());
    h->micro = pos.micro;
    h->n_micro = pos.n_micro;
    h->seq_len = T;
    h->depth = spec.data.prefetch;
    h->n_dp = n_dp;
    h->local_world = static_cast<int>(ranks.size());
    h->slot_bytes = slot_bytes;
    h->part_bytes = part_bytes;
    h->data_offset = data_offset;
    h->first_step = pos.start_step;
    h->last_step = spec.train.steps;
    for (int i = 0; i < n_dp; ++i) h->dp_index[i] = dps[static_cast<size_t>(i)];
    for (size_t l = 0; l < ranks.size(); ++l) {
      h->readers[l].needs = needs[l];
      h->readers[l].copied.store(pos.start_step - 1);
    }
    for (int64_t s = 0; s < spec.data.prefetch; ++s) SlotAt(*seg, s)->seq.store(0);
    h->loader_pid.store(getpid());
    h->heartbeat_ns.store(MonotonicNs());
    h->published.store(pos.start_step - 1);
    if (needs_tokens) h->readers[local].pid.store(getpid());
    h->state.store(kStateReady, std::memory_order_release);
    loader = std::make_unique<HostLoader>(sampler, pos, seg, rt.rank);
    loader->Start();
    if (!needs_tokens) return std::unique_ptr<BatchSource>(std::make_unique<LoaderOnly>(seg, std::move(loader)));
  } else {
    // Attach: the segment appears once local rank 0 has made it (after its own start-up).
    const double deadline = NowSeconds() + spec.data.loader_timeout_s;
    for (;;) {
      Status s = seg->Open(name);
      if (s.ok() && seg->header()->state.load(std::memory_order_acquire) != kStateBuilding) break;
      if (!s.ok() && s.code() != Code::kNotFound) return s.WithContext("attaching to the host's data loader");
      if (NowSeconds() > deadline) {
        return Timeout(
            "no data loader on host {} after {:.0f} s: local rank 0 (rank {}) did not make /dev/shm{} "
            "(data.loader_timeout_s; data.loader: per_rank reads without it)",
            rt.host.name, spec.data.loader_timeout_s, ranks[0], name);
      }
      seg = std::make_shared<Segment>();
      ::usleep(20000);
    }
    Header* h = seg->header();
    if (h->magic != kMagic || std::string(h->nonce) != name || h->micro != pos.micro || h->n_micro != pos.n_micro ||
        h->seq_len != T || h->n_dp != n_dp || seg->size() < static_cast<size_t>(data_offset + h->depth * slot_bytes)) {
      return DataLoss("/dev/shm{}: the data loader's segment does not match this rank's layout", name);
    }
    if (h->state.load() == kStateFailed) {
      return Aborted("the data loader of host {} failed: {}", rt.host.name, std::string(h->error));
    }
    h->readers[local].pid.store(getpid());
  }
  return std::unique_ptr<BatchSource>(
      std::make_unique<SharedSource>(seg, std::move(loader), local, my_part, rt.host.name, spec.data.loader_timeout_s));
}

}  // namespace ms::runner
