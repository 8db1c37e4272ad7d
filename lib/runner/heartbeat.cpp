// ProgressBoard, TrackWaits, Heartbeat, ParseHeartbeat.
#include "runner/heartbeat.h"

#include <unistd.h>

#include <charconv>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "bootstrap/bootstrap.h"

namespace ms::runner {

const char* PhaseName(Phase p) {
  switch (p) {
    case Phase::kStartup:
      return "startup";
    case Phase::kData:
      return "data";
    case Phase::kForward:
      return "forward";
    case Phase::kBackward:
      return "backward";
    case Phase::kOptimizer:
      return "optimizer";
    case Phase::kCheckpoint:
      return "checkpoint";
    case Phase::kEval:
      return "eval";
    case Phase::kDone:
      return "done";
  }
  return "?";
}

int ProgressBoard::RegisterGroup(const std::string& name) {
  groups_.push_back(name);
  return static_cast<int>(groups_.size()) - 1;
}

void ProgressBoard::SetPhase(Phase p) {
  if (phase_.load(std::memory_order_relaxed) == static_cast<int>(p)) return;
  phase_since_.store(NowSeconds(), std::memory_order_relaxed);
  phase_.store(static_cast<int>(p), std::memory_order_release);
}

void ProgressBoard::EnterWait(int group, const char* op) {
  wait_since_.store(NowSeconds(), std::memory_order_relaxed);
  wait_op_.store(op, std::memory_order_relaxed);
  wait_group_.store(group, std::memory_order_release);
}

void ProgressBoard::LeaveWait() {
  wait_group_.store(-1, std::memory_order_release);
}

void ProgressBoard::RecordStep(int64_t step, double step_s, double compute_s, double comm_s) {
  const uint64_t i = next_.load(std::memory_order_relaxed);
  Slot& s = ring_[i % kRing];
  // A seqlock: the reader retries (or skips) a slot whose sequence is odd or changed.
  s.seq.fetch_add(1, std::memory_order_acq_rel);
  s.step.store(step, std::memory_order_relaxed);
  s.step_s.store(step_s, std::memory_order_relaxed);
  s.compute_s.store(compute_s, std::memory_order_relaxed);
  s.comm_s.store(comm_s, std::memory_order_relaxed);
  s.seq.fetch_add(1, std::memory_order_acq_rel);
  next_.store(i + 1, std::memory_order_release);
}

std::string ProgressBoard::Snapshot() const {
  const double now = NowSeconds();
  std::string out;
  out += fmt::format("pp={}\ngroups=", pp_rank_);
  for (size_t g = 0; g < groups_.size(); ++g) out += (g ? "," : "") + groups_[g];
  const auto phase = static_cast<Phase>(phase_.load(std::memory_order_acquire));
  out += fmt::format("\nstep={}\nphase={}\nphase_s={:.3f}\n", step_.load(std::memory_order_relaxed), PhaseName(phase),
                     now - phase_since_.load(std::memory_order_relaxed));
  const int group = wait_group_.load(std::memory_order_acquire);
  const char* op = wait_op_.load(std::memory_order_relaxed);
  if (group >= 0 && group < static_cast<int>(groups_.size()) && op) {
    out += fmt::format("wait={} on {}\nwait_s={:.3f}\n", op, groups_[group],
                       now - wait_since_.load(std::memory_order_relaxed));
  }
  out += "steps=";
  const uint64_t end = next_.load(std::memory_order_acquire);
  bool first = true;
  for (uint64_t i = end > kRing ? end - kRing : 0; i < end; ++i) {
    const Slot& s = ring_[i % kRing];
    const uint64_t before = s.seq.load(std::memory_order_acquire);
    if (before & 1) continue;
    const int64_t step = s.step.load(std::memory_order_relaxed);
    const double a = s.step_s.load(std::memory_order_relaxed), b = s.compute_s.load(std::memory_order_relaxed),
                 c = s.comm_s.load(std::memory_order_relaxed);
    if (s.seq.load(std::memory_order_acquire) != before) continue;  // rewritten meanwhile
    out += fmt::format("{}{}:{:.6f}:{:.6f}:{:.6f}", first ? "" : ",", step, a, b, c);
    first = false;
  }
  return out + "\n";
}

namespace {

thread_local double tl_waited_s = 0;  // this thread's time inside tracked communicator calls

// Adds the time from construction to destruction to this thread's waited time.
struct WaitClock {
  double t0 = NowSeconds();
  ~WaitClock() { tl_waited_s += NowSeconds() - t0; }
};

class TrackedComm final : public comm::ForwardingCommunicator {
 public:
  TrackedComm(std::unique_ptr<comm::Communicator> inner, ProgressBoard* board, int group)
      : ForwardingCommunicator(inner.get()), owned_(std::move(inner)), board_(board), group_(group) {}
  Status Drain() override {  // the host waits here for what it waited for on the device
    return Tracked(board_, group_, "the step's device-waited collectives", [&] { return inner().Drain(); });
  }
  Status Barrier() override {
    return Tracked(board_, group_, "barrier", [&] { return inner().Barrier(); });
  }

 private:
  template <typename F>
  static Status Tracked(ProgressBoard* board, int group, const char* op, F&& wait) {
    WaitClock clock;
    board->EnterWait(group, op);
    Status s = wait();
    board->LeaveWait();
    return s;
  }
  class TrackedWork final : public comm::Work {
   public:
    TrackedWork(std::unique_ptr<comm::Work> w, ProgressBoard* board, int group, const char* op)
        : w_(std::move(w)), board_(board), group_(group), op_(op) {}
    Status Wait() override {
      return Tracked(board_, group_, op_, [&] { return w_->Wait(); });
    }
    Status WaitOnDevice() override {  // the host does not wait (where the communicator can): no wait to show
      WaitClock clock;
      return w_->WaitOnDevice();
    }

   private:
    std::unique_ptr<comm::Work> w_;
    ProgressBoard* board_;
    int group_;
    const char* op_;
  };
  // The call itself counts as waited (a Gloo collective may block in it).
  std::unique_ptr<comm::Work> Wrap(std::unique_ptr<comm::Work> w, const char* op, double call_start) override {
    tl_waited_s += NowSeconds() - call_start;
    return std::make_unique<TrackedWork>(std::move(w), board_, group_, op);
  }
  std::unique_ptr<comm::Communicator> owned_;
  ProgressBoard* board_;
  int group_;
};

}  // namespace

double ThreadWaitedSeconds() {
  return tl_waited_s;
}

std::unique_ptr<comm::Communicator> TrackWaits(std::unique_ptr<comm::Communicator> inner, ProgressBoard* board,
                                               int group) {
  if (!inner || !board) return inner;
  return std::make_unique<TrackedComm>(std::move(inner), board, group);
}

std::string HeartbeatKey(int rank) {
  return fmt::format("hb/{}", rank);
}

struct Heartbeat::Impl {
  std::unique_ptr<bootstrap::Store> store;
  int rank = 0;
  std::string host;
  double period_s = 2;
  const ProgressBoard* board = nullptr;
  std::mutex mu;  // the thread's own stop flag: never taken by the training thread's work
  std::condition_variable cv;
  bool stop = false;
  std::thread thread;
  int64_t n = 0;
  bool warned = false;

  void Beat(bool last) {
    std::string text =
        fmt::format("n={}\nt={:.6f}\nrank={}\nhost={}\npid={}\n", ++n, WallSeconds(), rank, host, getpid());
    text += board->Snapshot();
    if (last) text += "final=1\n";
    Status s = store->Set(HeartbeatKey(rank), text);
    if (!s.ok() && !warned) {
      LogWarn("heartbeat: {} (retrying every {} s)", s.message(), period_s);
      warned = true;
    } else if (s.ok()) {
      warned = false;
    }
  }
  void Loop() {
    std::unique_lock<std::mutex> lock(mu);
    const auto period = std::chrono::duration<double>(period_s);
    while (true) {
      lock.unlock();
      Beat(false);
      lock.lock();
      if (cv.wait_for(lock, period, [&] { return stop; })) break;
    }
  }
};

Heartbeat::Heartbeat(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::unique_ptr<Heartbeat> Heartbeat::Start(std::unique_ptr<bootstrap::Store> store, int rank, std::string host,
                                            double period_s, const ProgressBoard* board) {
  auto impl = std::make_unique<Impl>();
  impl->store = std::move(store);
  impl->rank = rank;
  impl->host = std::move(host);
  impl->period_s = period_s;
  impl->board = board;
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->Loop(); });
  return std::unique_ptr<Heartbeat>(new Heartbeat(std::move(impl)));
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  impl_->thread.join();
  impl_->Beat(true);
}

namespace {

template <typename T>
bool ParseNumber(std::string_view s, T* out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

std::vector<std::string_view> Split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (start < s.size()) {
    size_t end = s.find(sep, start);
    if (end == std::string_view::npos) end = s.size();
    out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace

Result<Beat> ParseHeartbeat(const std::string& text) {
  Beat b;
  bool ok = true;
  bool final_beat = false;
  for (std::string_view line : Split(text, '\n')) {
    const size_t eq = line.find('=');
    if (eq == std::string_view::npos) continue;
    const std::string_view key = line.substr(0, eq), value = line.substr(eq + 1);
    if (key == "n") {
      ok &= ParseNumber(value, &b.n);
    } else if (key == "t") {
      ok &= ParseNumber(value, &b.t);
    } else if (key == "rank") {
      ok &= ParseNumber(value, &b.rank);
    } else if (key == "host") {
      b.host = std::string(value);
    } else if (key == "pid") {
      ok &= ParseNumber(value, &b.pid);
    } else if (key == "pp") {
      ok &= ParseNumber(value, &b.pp_rank);
    } else if (key == "groups") {
      for (auto g : Split(value, ',')) b.groups.emplace_back(g);
    } else if (key == "step") {
      ok &= ParseNumber(value, &b.step);
    } else if (key == "phase") {
      b.phase = std::string(value);
    } else if (key == "phase_s") {
      ok &= ParseNumber(value, &b.phase_s);
    } else if (key == "wait") {
      const size_t on = value.find(" on ");
      if (on != std::string_view::npos) {
        b.wait_op = std::string(value.substr(0, on));
        b.wait_group = std::string(value.substr(on + 4));
      }
    } else if (key == "wait_s") {
      ok &= ParseNumber(value, &b.wait_s);
    } else if (key == "final") {
      final_beat = value == "1";
    } else if (key == "steps") {
      for (auto item : Split(value, ',')) {
        auto f = Split(item, ':');
        Beat::Step st{};
        if (f.size() != 4 || !ParseNumber(f[0], &st.step) || !ParseNumber(f[1], &st.step_s) ||
            !ParseNumber(f[2], &st.compute_s) || !ParseNumber(f[3], &st.comm_s)) {
          ok = false;
          break;
        }
        b.steps.push_back(st);
      }
    }
  }
  if (!ok || b.n <= 0 || b.rank < 0) return DataLoss("malformed heartbeat: {}", text.substr(0, 200));
  // The rank's last beat (Heartbeat's destructor): it is done, whatever phase its board last showed, and
  // its silence from now on is no fault. Decided after the loop: the key's place in the text does not matter.
  if (final_beat) {
    b.exited = true;
    b.phase = PhaseName(Phase::kDone);
    b.wait_op.clear();
    b.wait_group.clear();
  }
  return b;
}

}  // namespace ms::runner
