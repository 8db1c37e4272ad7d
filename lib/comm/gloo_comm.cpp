// defines: MakeGlooCommunicator, MakeGlooTcpDevice, ConnectGlooContext (design notes in comm.h).
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/context.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <sched.h>
#include <sys/types.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <functional>
#include <iterator>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/comm.h"

namespace ms::comm {
namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

// Slot prefixes of our own transfers; Gloo's collectives use 0x01..0x08 (gloo/types.h).
constexpr uint8_t kRingSlotPrefix = 0x40;  // ring reduce-scatter
constexpr uint8_t kP2pSlotPrefix = 0x41;   // Send/Recv, tag in the low 32 bits

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// State shared by the communicator, its thread and its Works (which may outlive it).
struct Shared {
  std::shared_ptr<gloo::Context> context;
  GlooOptions options;
  int rank = 0;
  int size = 1;

  std::mutex mu;
  Status failure;       // GUARDED_BY(mu): the first failure; sticky.
  bool closed = false;  // GUARDED_BY(mu): the communicator was destroyed.

  std::string Where() const { return fmt::format("{} (rank {} of {})", options.name, rank, size); }

  // Records the first failure and closes every connection of the context, so that the peers'
  // pending operations fail at once (the socket closes) instead of waiting for their timeout.
  void Fail(const Status& s) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!failure.ok()) return;
      failure = s;
    }
    try {
      context->closeConnections();
    } catch (const std::exception&) {
      // Already failing; the peers then notice through their own timeout.
    }
  }

  // OK, or Aborted when the communicator was destroyed or failed before.
  Status Usable(std::string_view what) {
    std::lock_guard<std::mutex> lock(mu);
    if (closed) return Aborted("{}: {} not run: the communicator was destroyed", Where(), what);
    if (!failure.ok()) {
      return Aborted("{}: {} not run: the communicator failed earlier and must be rebuilt ({})", Where(), what,
                     failure.ToString());
    }
    return Status::Ok();
  }
};

// Runs `fn` (which may throw anything Gloo throws) and turns exceptions into a Status naming
// the communicator, the operation and the peers involved.
template <typename Fn>
Status Guarded(const Shared& sh, std::string_view what, std::string_view peers, Fn&& fn) {
  const auto start = Clock::now();
  auto describe = [&](Code code, std::string_view kind, const char* detail) {
    return Status(
        code,
        fmt::format("{}: {} with {} failed after {:.2f} s (timeout {:.2f} s): {}{}. Hint: a peer rank died, "
                    "is stuck, or did not issue the same operations in the same order",
                    sh.Where(), what, peers, SecondsSince(start), sh.options.timeout.count() / 1000.0, kind, detail));
  };
  try {
    return fn();
  } catch (const gloo::IoException& e) {
    const std::string msg = e.what();
    const bool timed_out = msg.find("imed out") != std::string::npos || msg.find("imeout") != std::string::npos;
    return describe(timed_out ? Code::kTimeout : Code::kUnavailable, "", e.what());
  } catch (const gloo::EnforceNotMet& e) {
    return describe(Code::kInternal, "gloo check failed: ", e.what());
  } catch (const gloo::Exception& e) {
    return describe(Code::kUnavailable, "", e.what());
  } catch (const std::exception& e) {
    return describe(Code::kInternal, "", e.what());
  }
}

// Completion of one queued collective, shared by its Work and the communicator thread.
class OpState {
 public:
  void Finish(Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = std::move(s);
    done_ = true;
    cv_.notify_all();
  }
  Status Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
    return status_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;  // GUARDED_BY(mu_)
  Status status_;      // GUARDED_BY(mu_)
};

class CollectiveWork : public Work {
 public:
  explicit CollectiveWork(std::shared_ptr<OpState> state) : state_(std::move(state)) {}
  ~CollectiveWork() override { state_->Wait().IgnoreError(); }
  Status Wait() override { return state_->Wait(); }

 private:
  std::shared_ptr<OpState> state_;
};

// One posted send or receive; completed by Wait().
class P2pOp {
 public:
  P2pOp(std::shared_ptr<Shared> shared, std::unique_ptr<gloo::transport::UnboundBuffer> buf, bool is_send, int peer,
        std::string what)
      : shared_(std::move(shared)), buf_(std::move(buf)), is_send_(is_send), peer_(peer), what_(std::move(what)) {}

  Status Wait() {
    std::lock_guard<std::mutex> lock(mu_);
    if (waited_) return status_;
    status_ = Guarded(*shared_, what_, fmt::format("peer {}", peer_), [&]() -> Status {
      const Millis timeout = shared_->options.timeout;
      const bool completed = is_send_ ? buf_->waitSend(timeout) : buf_->waitRecv(timeout);
      if (!completed) return Aborted("{}: {} aborted: the communicator was destroyed", shared_->Where(), what_);
      return Status::Ok();
    });
    if (!status_.ok() && status_.code() != Code::kAborted) shared_->Fail(status_);
    waited_ = true;
    return status_;
  }

  // Wakes a pending Wait (or makes the next one return at once) with Aborted.
  void Abort() {
    if (is_send_) {
      buf_->abortWaitSend();
    } else {
      buf_->abortWaitRecv();
    }
  }

 private:
  const std::shared_ptr<Shared> shared_;
  const std::unique_ptr<gloo::transport::UnboundBuffer> buf_;  // never reset: Abort() may use it
  const bool is_send_;
  const int peer_;
  const std::string what_;
  std::mutex mu_;
  bool waited_ = false;  // GUARDED_BY(mu_)
  Status status_;        // GUARDED_BY(mu_)
};

class P2pWork : public Work {
 public:
  explicit P2pWork(std::shared_ptr<P2pOp> op) : op_(std::move(op)) {}
  ~P2pWork() override { op_->Wait().IgnoreError(); }
  Status Wait() override { return op_->Wait(); }

 private:
  std::shared_ptr<P2pOp> op_;
};

template <typename T>
gloo::AllreduceOptions::Func ReduceFunc(ReduceOp op) {
  using Fn = void (*)(void*, const void*, const void*, size_t);
  switch (op) {
    case ReduceOp::kSum:
      return static_cast<Fn>(&gloo::sum<T>);
    case ReduceOp::kMax:
      return static_cast<Fn>(&gloo::max<T>);
    case ReduceOp::kMin:
      return static_cast<Fn>(&gloo::min<T>);
  }
  return static_cast<Fn>(&gloo::sum<T>);
}

// c = a + b over bf16 patterns (c may be a): each sum widened exactly, added in fp32 — exact where the exponents differ
// by at most 16, and otherwise far from a bf16 rounding tie — and rounded to nearest even once, the correctly rounded
// bf16 sum that NCCL's bf16 addition also gives.
void SumBf16(void* c, const void* a, const void* b, size_t n) {
  auto* cc = static_cast<uint16_t*>(c);
  const auto* aa = static_cast<const uint16_t*>(a);
  const auto* bb = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < n; ++i) cc[i] = FloatToBf16(Bf16ToFloat(aa[i]) + Bf16ToFloat(bb[i]));
}

template <typename T>
constexpr std::string_view TypeName() {
  if constexpr (std::is_same_v<T, float>) return "floats";
  if constexpr (std::is_same_v<T, double>) return "doubles";
  return "int64s";
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<gloo::Context> context, GlooOptions options) : shared_(std::make_shared<Shared>()) {
    shared_->rank = context->rank;
    shared_->size = context->size;
    shared_->context = std::move(context);
    shared_->options = std::move(options);
    left_ = (shared_->rank + shared_->size - 1) % shared_->size;
    right_ = (shared_->rank + 1) % shared_->size;
    thread_ = std::thread([this] { Loop(); });
  }

  ~GlooCommunicator() override {
    std::deque<Task> dropped;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      dropped.swap(queue_);
    }
    cv_.notify_all();
    for (Task& task : dropped) {
      task.state->Finish(Aborted("{}: {} not run: the communicator was destroyed", shared_->Where(), task.what));
    }
    thread_.join();
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      shared_->closed = true;
    }
    std::lock_guard<std::mutex> lock(p2p_mu_);
    for (auto& weak : p2p_) {
      if (auto op = weak.lock()) op->Abort();
    }
  }

  GlooCommunicator(const GlooCommunicator&) = delete;
  GlooCommunicator& operator=(const GlooCommunicator&) = delete;

  int rank() const override { return shared_->rank; }
  int size() const override { return shared_->size; }
  std::string name() const override { return shared_->options.name; }

  std::unique_ptr<Work> AllReduce(float* data, int64_t count, ReduceOp op) override {
    return AllReduceT(data, count, op);
  }
  std::unique_ptr<Work> AllReduce(double* data, int64_t count, ReduceOp op) override {
    return AllReduceT(data, count, op);
  }
  std::unique_ptr<Work> AllReduce(int64_t* data, int64_t count, ReduceOp op) override {
    return AllReduceT(data, count, op);
  }
  std::unique_ptr<Work> AllReduce16(uint16_t* data, int64_t count) override {
    return AllReduceWith(data, count, "bf16s, bf16 sum", &SumBf16);
  }

  std::unique_ptr<Work> ReduceScatter(const float* in, float* out, int64_t count) override {
    return ReduceScatterT(in, out, count, "floats per rank, sum");
  }
  std::unique_ptr<Work> ReduceScatter16(const uint16_t* in, uint16_t* out, int64_t count) override {
    return ReduceScatterT(in, out, count, "bf16s per rank, bf16 sum");
  }

  std::unique_ptr<Work> AllGather(const float* in, float* out, int64_t count) override {
    return AllGatherT(in, out, count, "floats");
  }
  std::unique_ptr<Work> AllGather16(const uint16_t* in, uint16_t* out, int64_t count) override {
    return AllGatherT(in, out, count, "16-bit elements");
  }

  std::unique_ptr<Work> Broadcast(float* data, int64_t count, int root) override {
    if (Status s = CheckBuffer(data, count, "broadcast buffer"); !s.ok()) return Done(s);
    if (root < 0 || root >= size()) {
      return Done(
          InvalidArgument("{}: broadcast root {} is not a rank of this group of {}", shared_->Where(), root, size()));
    }
    const uint32_t tag = seq_++;
    std::string what = fmt::format("broadcast #{} ({} floats from rank {})", tag, count, root);
    const size_t n = static_cast<size_t>(count);
    return Enqueue(what, [this, data, n, root, tag, what] {
      if (n == 0) return Status::Ok();
      return Guarded(*shared_, what, fmt::format("root {} (binomial tree)", root), [&] {
        gloo::BroadcastOptions opts(shared_->context);
        opts.setOutput(data, n);
        opts.setRoot(root);
        opts.setTag(tag);
        opts.setTimeout(shared_->options.timeout);
        gloo::broadcast(opts);
        return Status::Ok();
      });
    });
  }

  std::unique_ptr<Work> Send(const float* data, int64_t count, int peer, int tag) override {
    return PostP2p(/*is_send=*/true, const_cast<float*>(data), count, peer, tag);
  }

  std::unique_ptr<Work> Recv(float* data, int64_t count, int peer, int tag) override {
    return PostP2p(/*is_send=*/false, data, count, peer, tag);
  }

  Status Barrier() override {
    const uint32_t tag = seq_++;
    std::string what = fmt::format("barrier #{}", tag);
    return Enqueue(what,
                   [this, tag, what] {
                     return Guarded(*shared_, what, "all ranks", [&] {
                       gloo::BarrierOptions opts(shared_->context);
                       opts.setTag(tag);
                       opts.setTimeout(shared_->options.timeout);
                       gloo::barrier(opts);
                       return Status::Ok();
                     });
                   })
        ->Wait();
  }

 private:
  struct Task {
    std::string what;
    std::function<Status()> run;
    std::shared_ptr<OpState> state;
  };

  static std::unique_ptr<Work> Done(Status s) { return CompletedWork(std::move(s)); }

  Status CheckBuffer(const void* data, int64_t count, std::string_view what) const {
    if (count < 0) return InvalidArgument("{}: {}: negative count {}", shared_->Where(), what, count);
    if (count > 0 && data == nullptr) return InvalidArgument("{}: {}: null pointer", shared_->Where(), what);
    return Status::Ok();
  }

  template <typename T>
  std::unique_ptr<Work> AllGatherT(const T* in, T* out, int64_t count, const char* unit) {
    if (Status s = CheckBuffer(in, count, "all-gather input"); !s.ok()) return Done(s);
    if (Status s = CheckBuffer(out, count * size(), "all-gather output"); !s.ok()) return Done(s);
    const uint32_t tag = seq_++;
    std::string what = fmt::format("all-gather #{} ({} {} per rank)", tag, count, unit);
    const size_t n = static_cast<size_t>(count);
    return Enqueue(what, [this, in, out, n, tag, what] {
      if (n == 0) return Status::Ok();
      return Guarded(*shared_, what, fmt::format("ring peers {} (recv) and {} (send)", left_, right_), [&] {
        gloo::AllgatherOptions opts(shared_->context);
        // In place when `in` is already this rank's slot of `out` (no self-overlapping memcpy).
        if (in != out + n * static_cast<size_t>(rank())) opts.setInput(const_cast<T*>(in), n);
        opts.setOutput(out, n * static_cast<size_t>(size()));
        opts.setTag(tag);
        opts.setTimeout(shared_->options.timeout);
        gloo::allgather(opts);
        return Status::Ok();
      });
    });
  }

  template <typename T>
  std::unique_ptr<Work> AllReduceT(T* data, int64_t count, ReduceOp op) {
    return AllReduceWith(data, count, fmt::format("{}, {}", TypeName<T>(), ReduceOpName(op)), ReduceFunc<T>(op));
  }

  template <typename T>
  std::unique_ptr<Work> AllReduceWith(T* data, int64_t count, const std::string& unit,
                                      gloo::AllreduceOptions::Func fn) {
    if (Status s = CheckBuffer(data, count, "all-reduce buffer"); !s.ok()) return Done(s);
    const uint32_t tag = seq_++;
    std::string what = fmt::format("all-reduce #{} ({} {})", tag, count, unit);
    const size_t n = static_cast<size_t>(count);
    return Enqueue(what, [this, data, n, fn = std::move(fn), tag, what] {
      if (n == 0) return Status::Ok();
      return Guarded(*shared_, what, fmt::format("ring peers {} (recv) and {} (send)", left_, right_), [&] {
        gloo::AllreduceOptions opts(shared_->context);
        opts.setOutput(data, n);
        opts.setReduceFunction(fn);
        opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
        opts.setTag(tag);
        opts.setTimeout(shared_->options.timeout);
        gloo::allreduce(opts);
        return Status::Ok();
      });
    });
  }

  std::unique_ptr<Work> Enqueue(const std::string& what, std::function<Status()> run) {
    if (Status s = shared_->Usable(what); !s.ok()) return Done(s);
    auto state = std::make_shared<OpState>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(Task{what, std::move(run), state});
    }
    cv_.notify_one();
    return std::make_unique<CollectiveWork>(std::move(state));
  }

  // The communicator thread: runs the queued collectives one at a time, in issue order.
  void Loop() {
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      Status s = shared_->Usable(task.what);
      if (s.ok()) {
        s = task.run();
        if (!s.ok()) shared_->Fail(s);
      }
      task.state->Finish(std::move(s));
    }
  }

  template <typename T>
  std::unique_ptr<Work> ReduceScatterT(const T* in, T* out, int64_t count, const char* unit) {
    if (Status s = CheckBuffer(in, count * size(), "reduce-scatter input"); !s.ok()) return Done(s);
    if (Status s = CheckBuffer(out, count, "reduce-scatter output"); !s.ok()) return Done(s);
    const size_t n = static_cast<size_t>(count);
    const auto in_begin = reinterpret_cast<uintptr_t>(in), out_begin = reinterpret_cast<uintptr_t>(out);
    if (count > 0 && out_begin + n * sizeof(T) > in_begin &&
        in_begin + n * sizeof(T) * static_cast<size_t>(size()) > out_begin) {
      return Done(InvalidArgument("{}: reduce-scatter: the output overlaps the input; give it its own buffer",
                                  shared_->Where()));
    }
    const uint32_t tag = seq_++;
    std::string what = fmt::format("reduce-scatter #{} ({} {})", tag, count, unit);
    return Enqueue(what, [this, in, out, n, tag, what] {
      if (n == 0) return Status::Ok();
      return Guarded(*shared_, what, fmt::format("ring peers {} (recv) and {} (send)", left_, right_),
                     [&] { return RingReduceScatter(in, out, n, tag); });
    });
  }

  // Ring reduce-scatter over unbound buffers; see comm.h. Runs on the communicator thread. T: float (fp32 sums) or
  // uint16_t (bf16 sums, SumBf16's rounding at every addition).
  template <typename T>
  Status RingReduceScatter(const T* in, T* out, size_t n, uint32_t tag) {
    const int p = size();
    const int r = rank();
    if (p == 1) {
      std::memcpy(out, in, n * sizeof(T));
      return Status::Ok();
    }
    const auto deadline = Clock::now() + shared_->options.timeout;
    auto remaining = [&] { return std::max(Millis(1), std::chrono::duration_cast<Millis>(deadline - Clock::now())); };
    auto chunk = [&](int c) { return static_cast<size_t>(((c % p) + p) % p); };
    const size_t bytes = n * sizeof(T);
    const size_t scratch_floats = (2 * bytes + sizeof(float) - 1) / sizeof(float);
    if (scratch_.size() < scratch_floats) scratch_.resize(scratch_floats);
    T* acc[2] = {reinterpret_cast<T*>(scratch_.data()), reinterpret_cast<T*>(scratch_.data()) + n};
    gloo::Context& ctx = *shared_->context;
    auto in_buf = ctx.createUnboundBuffer(const_cast<T*>(in), bytes * static_cast<size_t>(p));
    std::unique_ptr<gloo::transport::UnboundBuffer> acc_buf[2] = {ctx.createUnboundBuffer(acc[0], bytes),
                                                                  ctx.createUnboundBuffer(acc[1], bytes)};
    auto out_buf = ctx.createUnboundBuffer(out, bytes);
    const uint64_t slot = gloo::Slot::build(kRingSlotPrefix, tag);

    // Step s: send the partial sum of chunk r-s-1 to the right, receive chunk r-s-2 from the
    // left and add this rank's contribution. Step 0 sends straight from the input.
    gloo::transport::UnboundBuffer* send_buf = in_buf.get();
    size_t send_offset = chunk(r - 1) * bytes;
    for (int s = 0; s < p - 1; ++s) {
      const bool last = s == p - 2;
      gloo::transport::UnboundBuffer* recv_buf = last ? out_buf.get() : acc_buf[s % 2].get();
      T* recv_ptr = last ? out : acc[s % 2];
      recv_buf->recv(left_, slot, 0, bytes);
      send_buf->send(right_, slot, send_offset, bytes);
      recv_buf->waitRecv(remaining());
      send_buf->waitSend(remaining());
      const T* mine = in + chunk(r - s - 2) * n;
      if constexpr (std::is_same_v<T, float>) {
        for (size_t i = 0; i < n; ++i) recv_ptr[i] += mine[i];
      } else {
        SumBf16(recv_ptr, recv_ptr, mine, n);
      }
      send_buf = recv_buf;
      send_offset = 0;
    }
    return Status::Ok();
  }

  std::unique_ptr<Work> PostP2p(bool is_send, float* data, int64_t count, int peer, int tag) {
    const char* verb = is_send ? "send" : "recv";
    if (Status s = CheckBuffer(data, count, is_send ? "send buffer" : "recv buffer"); !s.ok()) return Done(s);
    if (peer < 0 || peer >= size() || peer == rank()) {
      return Done(InvalidArgument("{}: {} with peer {}: not another rank of this group of {}", shared_->Where(), verb,
                                  peer, size()));
    }
    if (tag < 0) return Done(InvalidArgument("{}: {} with tag {}: tags must be >= 0", shared_->Where(), verb, tag));
    std::string what =
        fmt::format("{} (tag {}, {} floats, {} rank {})", verb, tag, count, is_send ? "to" : "from", peer);
    if (Status s = shared_->Usable(what); !s.ok()) return Done(s);
    if (count == 0) return Done(Status::Ok());
    const uint64_t slot = gloo::Slot::build(kP2pSlotPrefix, static_cast<uint32_t>(tag));
    std::shared_ptr<P2pOp> op;
    Status posted = Guarded(*shared_, what, fmt::format("peer {}", peer), [&] {
      auto buf = shared_->context->createUnboundBuffer(data, static_cast<size_t>(count) * sizeof(float));
      if (is_send) {
        buf->send(peer, slot);
      } else {
        buf->recv(peer, slot);
      }
      op = std::make_shared<P2pOp>(shared_, std::move(buf), is_send, peer, what);
      return Status::Ok();
    });
    if (!posted.ok()) {
      shared_->Fail(posted);
      return Done(posted);
    }
    {
      std::lock_guard<std::mutex> lock(p2p_mu_);
      // Forget finished operations now and then, so the list stays as long as what is in flight.
      if (p2p_.size() >= 2 * p2p_live_ + 16) {
        std::erase_if(p2p_, [](const std::weak_ptr<P2pOp>& w) { return w.expired(); });
        p2p_live_ = p2p_.size();
      }
      p2p_.push_back(op);
    }
    return std::make_unique<P2pWork>(std::move(op));
  }

  std::shared_ptr<Shared> shared_;
  int left_ = 0;                // ring neighbours
  int right_ = 0;               //
  uint32_t seq_ = 0;            // collectives issued so far (issuing thread only); also Gloo's tag
  std::vector<float> scratch_;  // ring reduce-scatter partial sums (communicator thread only)

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;  // GUARDED_BY(mu_)
  bool stop_ = false;       // GUARDED_BY(mu_)

  std::mutex p2p_mu_;
  std::vector<std::weak_ptr<P2pOp>> p2p_;  // GUARDED_BY(p2p_mu_): posted sends/receives
  size_t p2p_live_ = 0;                    // GUARDED_BY(p2p_mu_)

  std::thread thread_;  // last: started once everything above exists
};

}  // namespace

std::unique_ptr<Communicator> MakeGlooCommunicator(std::shared_ptr<gloo::Context> context, GlooOptions options) {
  return std::make_unique<GlooCommunicator>(std::move(context), std::move(options));
}

namespace {

// The thread ids of this process (/proc/self/task).
Result<std::vector<pid_t>> ThreadIds() {
  std::vector<pid_t> ids;
  std::error_code ec;
  for (std::filesystem::directory_iterator it("/proc/self/task", ec), end; !ec && it != end; it.increment(ec)) {
    ids.push_back(static_cast<pid_t>(std::strtol(it->path().filename().c_str(), nullptr, 10)));
  }
  if (ec) return Unavailable("listing /proc/self/task: {}", ec.message());
  std::sort(ids.begin(), ids.end());
  return ids;
}

// Makes the one thread in `after` but not in `before` (the device's event loop) SCHED_BATCH; says what it did.
std::string BatchTheLoop(const Result<std::vector<pid_t>>& before, const Result<std::vector<pid_t>>& after) {
  if (!before.ok()) return "left as it was: " + before.status().message();
  if (!after.ok()) return "left as it was: " + after.status().message();
  std::vector<pid_t> fresh;
  std::set_difference(after->begin(), after->end(), before->begin(), before->end(), std::back_inserter(fresh));
  if (fresh.size() != 1) {
    return fmt::format("left as it was: {} threads started with the device, not one", fresh.size());
  }
  sched_param param{};
  param.sched_priority = 0;
  if (::sched_setscheduler(fresh[0], SCHED_BATCH, &param) != 0) {
    return fmt::format("left as it was: sched_setscheduler(SCHED_BATCH) failed: {}", std::strerror(errno));
  }
  return "SCHED_BATCH (no wakeup preemption)";
}

}  // namespace

Result<std::shared_ptr<gloo::transport::Device>> MakeGlooTcpDevice(const std::string& hostname,
                                                                   std::string* loop_note) {
  const char* policy = std::getenv("MEGASCALE_GLOO_LOOP");
  const bool batch = policy == nullptr || std::string_view(policy) != "normal";
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = hostname;
    auto before = batch ? ThreadIds() : Result<std::vector<pid_t>>(std::vector<pid_t>{});
    auto device = gloo::transport::tcp::CreateDevice(attr);
    std::string note = batch ? BatchTheLoop(before, ThreadIds()) : "left as it was (MEGASCALE_GLOO_LOOP=normal)";
    if (loop_note != nullptr) *loop_note = std::move(note);
    return device;
  } catch (const std::exception& e) {
    return Unavailable("creating a Gloo TCP device on host '{}': {}. Hint: give an address of this machine", hostname,
                       e.what());
  }
}

Result<std::shared_ptr<gloo::Context>> ConnectGlooContext(gloo::rendezvous::Store& store, int rank, int size,
                                                          std::shared_ptr<gloo::transport::Device> device,
                                                          std::chrono::milliseconds timeout,
                                                          std::string_view group_name) {
  if (size < 1 || rank < 0 || rank >= size) {
    return InvalidArgument("{}: rank {} is not in a group of {}", group_name, rank, size);
  }
  if (!device) return InvalidArgument("{}: no Gloo device", group_name);
  const auto start = Clock::now();
  try {
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(timeout);
    context->connectFullMesh(store, device);
    return std::shared_ptr<gloo::Context>(std::move(context));
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    const bool timed_out = msg.find("imeout") != std::string::npos || msg.find("imed out") != std::string::npos;
    return Status(timed_out ? Code::kTimeout : Code::kUnavailable,
                  fmt::format("{}: rank {} of {}: connecting to the other ranks failed after {:.2f} s (timeout "
                              "{:.2f} s): {}. Hint: did every rank of the group start and use the same store?",
                              group_name, rank, size, SecondsSince(start), timeout.count() / 1000.0, msg));
  }
}

}  // namespace ms::comm
