// NCCL communicators of the CUDA backend (cuda.h, "NCCL communicators"): compiled into both flavors, against
// libnccl (GPU) or the emulated NCCL of kernels/sim/nccl.cpp (megascale-emu), when nccl.h was found
// (MS_CUDA_HAVE_NCCL); otherwise the factories say NCCL is missing.
#include "cuda/cuda.h"

#if defined(MS_CUDA_HAVE_NCCL)
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels.h"

namespace ms::cuda {
namespace {

#define MS_CUDA_CHECK(expr, what)                                                                        \
  do {                                                                                                   \
    cudaError_t ms_e_ = (expr);                                                                          \
    if (ms_e_ != cudaSuccess) {                                                                          \
      return Internal("{} ({}:{}): {}: {}", what, __FILE__, __LINE__, #expr, cudaGetErrorString(ms_e_)); \
    }                                                                                                    \
  } while (0)
#define MS_NCCL_CHECK(expr, what)                                                                           \
  do {                                                                                                      \
    ncclResult_t ms_r_ = (expr);                                                                            \
    if (ms_r_ != ncclSuccess) {                                                                             \
      return Unavailable("{} ({}:{}): {}: {}", what, __FILE__, __LINE__, #expr, ncclGetErrorString(ms_r_)); \
    }                                                                                                       \
  } while (0)

ncclRedOp_t ToNccl(comm::ReduceOp op) {
  switch (op) {
    case comm::ReduceOp::kSum:
      return ncclSum;
    case comm::ReduceOp::kMax:
      return ncclMax;
    case comm::ReduceOp::kMin:
      return ncclMin;
  }
  return ncclSum;
}

// Test hook (docs/cuda.md): MEGASCALE_PLANT=nccl_no_compute_wait drops the communicator stream's wait for the
// compute stream — the planted bug the deferred emulated streams must catch.
// MEGASCALE_PLANT=nccl_no_device_wait drops the backend stream's wait for a collective waited on the device
// (Work::WaitOnDevice): the consumer reads the buffer before the collective has written it.
bool Planted(const char* what) {
  const char* v = std::getenv("MEGASCALE_PLANT");
  return v && std::strcmp(v, what) == 0;
}
bool PlantedNoComputeWait() {
  return Planted("nccl_no_compute_wait");
}

// An operation waited on the device (NcclWork::WaitOnDevice): its completion event, for the watchdog.
// A completion event, destroyed by its last holder (the Work, the watchdog).
using SharedEvent = std::shared_ptr<CUevent_st>;
SharedEvent OwnEvent(cudaEvent_t ev) {
  return SharedEvent(ev, [](cudaEvent_t e) {
    if (e) cudaEventDestroy(e);
  });
}

struct Watched {
  SharedEvent done;
  std::string what;
  // Its timeout counts from here: when the backend's stream was made to wait for it, or when the one before it
  // completed if that was later.
  std::chrono::steady_clock::time_point since;
};

// What a communicator's Works share: the NCCL handle (aborted once, by the first failure), the first error, and
// the operations waited on the device that the communicator's watchdog thread checks.
struct Shared {
  ncclComm_t comm = nullptr;
  std::mutex mu;
  std::condition_variable cv;  // the watchdog's: `watched` grew, or it is to stop
  bool aborted = false;
  Status failure;  // sticky: every later operation fails with it
  std::string name;
  int rank = 0, size = 0;
  std::chrono::milliseconds timeout{60'000};
  // Oldest first; they complete in this order: operations on the one NCCL stream, each waited for by the compute
  // stream, and launches watched on the compute stream (WatchCompute), each operation issued after them ordered
  // after them.
  std::deque<Watched> watched;
  bool stop = false;
  // Timing events around each device wait on the backend's stream (recorded before and after the wait), until
  // TakeDeviceWaitSeconds reads them.
  std::vector<std::pair<SharedEvent, SharedEvent>> timings;
  // The device waits recorded in CUDA graphs, where an event has no timestamp: a device word of nanoseconds that a
  // clock kernel before each captured wait decreases by the device's clock and one after it increases
  // (kernels::AddDeviceClock), so that each launch adds how long the stream was blocked in the graph's waits;
  // `graph_clock_taken` is its value TakeDeviceWaitSeconds counted already (modulo 2^64: it is never reset, nothing
  // has to be ordered with the graphs on the host). `captured_timed`: the captured waits timed so. `last_watched`:
  // the newest launch watched by WatchCompute — once it completed, no graph holding those clock kernels is half run.
  uint64_t* graph_clock = nullptr;
  uint64_t graph_clock_taken = 0;
  int64_t captured_timed = 0;
  SharedEvent last_watched;

  ~Shared() {
    if (graph_clock) cudaFree(graph_clock);
  }

  // Aborts the communicator after a failure (the first one wins; later calls fail at once).
  Status Abort(Status why) {
    std::lock_guard<std::mutex> l(mu);
    return AbortLocked(std::move(why));
  }
  Status AbortLocked(Status why) {
    if (!aborted) {
      aborted = true;
      failure = why;
      LogError("{}", why.message());
      ncclCommAbort(comm);  // unblocks the stream; the handle is gone
      comm = nullptr;
      cv.notify_all();
    }
    return why;
  }
  Status Failed() {
    std::lock_guard<std::mutex> l(mu);
    if (!aborted) return Status::Ok();
    return Aborted("{}: the communicator was aborted after an earlier failure: {}", name, failure.message());
  }
};

Status NoCompletion(const std::string& what, std::chrono::milliseconds timeout) {
  return Timeout(
      "{}: no completion after {:.1f} s (runtime.collective_timeout_s): the peer is stuck, dead or waiting for "
      "something else (a send/receive issued in an order that deadlocks on NCCL's in-order stream?); the "
      "communicator was aborted",
      what, std::chrono::duration<double>(timeout).count());
}

// The watchdog of the operations waited on the device (one thread per communicator, asleep while there are none):
// polls the oldest one's completion event and NCCL's asynchronous error, and aborts the communicator — which
// unblocks its stream, and so the backend's stream waiting on it — when one fails or exceeds the group's timeout.
void WatchdogLoop(Shared* sh) {
  std::unique_lock<std::mutex> l(sh->mu);
  auto pause = std::chrono::microseconds(20);
  for (;;) {
    sh->cv.wait(l, [&] { return sh->stop || !sh->watched.empty(); });
    if (sh->stop) return;
    if (sh->aborted) {  // nothing more will be waited for: the events go
      sh->watched.clear();
      continue;
    }
    Watched& w = sh->watched.front();
    const cudaError_t q = cudaEventQuery(w.done.get());
    ncclResult_t async = ncclSuccess;
    if (sh->comm) ncclCommGetAsyncError(sh->comm, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      sh->AbortLocked(Unavailable("{}: NCCL reported an asynchronous error: {}", w.what, ncclGetErrorString(async)))
          .IgnoreError();
    } else if (q == cudaSuccess) {
      sh->watched.pop_front();
      // The next one's clock starts now at the earliest: the host may have issued it long before the device got
      // there (it runs up to a step ahead), which is no sign of a stuck peer.
      if (!sh->watched.empty()) {
        sh->watched.front().since = std::max(sh->watched.front().since, std::chrono::steady_clock::now());
      }
      pause = std::chrono::microseconds(20);
    } else if (q != cudaErrorNotReady) {
      sh->AbortLocked(Internal("{}: waiting for completion: {}", w.what, cudaGetErrorString(q))).IgnoreError();
    } else if (std::chrono::steady_clock::now() - w.since > sh->timeout) {
      sh->AbortLocked(NoCompletion(w.what, sh->timeout)).IgnoreError();
    } else {
      sh->cv.wait_for(l, pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }
}

class NcclWork : public comm::Work {
 public:
  NcclWork(std::shared_ptr<Shared> shared, cudaEvent_t ev, std::string what, Status launch,
           cudaStream_t compute = nullptr)
      : shared_(std::move(shared)),
        ev_(OwnEvent(ev)),
        what_(std::move(what)),
        status_(std::move(launch)),
        compute_(compute) {}
  // Never waited for: the host waits (a buffer the operation uses may be freed next).
  ~NcclWork() override {
    if (!on_device_) Wait().IgnoreError();
  }
  // The watchdog: polls the completion event and NCCL's asynchronous error, with the group's timeout.
  Status Wait() override {
    if (!status_.ok() || !ev_ || waited_) return status_;
    waited_ = true;
    const auto start = std::chrono::steady_clock::now();
    // Spin (yielding) for the first millisecond, then back off to 1 ms sleeps: short operations return
    // promptly, long waits cost no CPU.
    auto pause = std::chrono::microseconds(10);
    for (;;) {
      cudaError_t q = cudaEventQuery(ev_.get());
      if (Status f = shared_->Failed(); !f.ok()) return status_ = f;
      ncclResult_t async = ncclSuccess;
      {
        std::lock_guard<std::mutex> l(shared_->mu);
        if (shared_->comm) ncclCommGetAsyncError(shared_->comm, &async);
      }
      if (async != ncclSuccess && async != ncclInProgress) {
        return status_ = shared_->Abort(
                   Unavailable("{}: NCCL reported an asynchronous error: {}", what_, ncclGetErrorString(async)));
      }
      if (q == cudaSuccess) return status_;
      if (q != cudaErrorNotReady) {
        return status_ = shared_->Abort(Internal("{}: waiting for completion: {}", what_, cudaGetErrorString(q)));
      }
      const auto waited = std::chrono::steady_clock::now() - start;
      if (waited > shared_->timeout) return status_ = shared_->Abort(NoCompletion(what_, shared_->timeout));
      if (waited < std::chrono::milliseconds(1)) {
        std::this_thread::yield();
        continue;
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }
  // The backend's stream waits for the completion event; the watchdog watches it. A later Wait() still blocks the
  // host until completion.
  Status WaitOnDevice() override {
    if (!status_.ok() || !ev_ || waited_ || on_device_) return status_;
    if (Status f = shared_->Failed(); !f.ok()) return status_ = f;
    // Inside a stream capture (a CUDA graph recording the operation: the NCCL stream forked into it) the wait is the
    // graph's join back; its events cannot be queried or timed, so nothing is watched here — the graph's launcher
    // watches each launch (Communicator::WatchCompute) — and the wait is timed by the device's clock: a clock
    // kernel before the join and one after it (Shared::graph_clock), run at each launch.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(compute_, &capture) == cudaSuccess && capture != cudaStreamCaptureStatusNone) {
      const bool timed = shared_->graph_clock != nullptr;
      if (timed) {
        if (cudaError_t e = kernels::AddDeviceClock(shared_->graph_clock, /*add=*/false, compute_); e != cudaSuccess) {
          return status_ = Internal("{}: timing the graph's wait for it: {}", what_, cudaGetErrorString(e));
        }
      }
      if (cudaError_t e = cudaStreamWaitEvent(compute_, ev_.get(), 0); e != cudaSuccess) {
        return status_ = Internal("{}: joining the graph's compute stream after it: {}", what_, cudaGetErrorString(e));
      }
      if (timed) {
        if (cudaError_t e = kernels::AddDeviceClock(shared_->graph_clock, /*add=*/true, compute_); e != cudaSuccess) {
          return status_ = Internal("{}: timing the graph's wait for it: {}", what_, cudaGetErrorString(e));
        }
        std::lock_guard<std::mutex> l(shared_->mu);
        ++shared_->captured_timed;
      }
      on_device_ = true;
      return status_;
    }
    // Timing events before and after the wait measure how long the stream was blocked in it (best effort: without
    // them the wait is the same, only unmeasured).
    cudaEvent_t reached = nullptr, resumed = nullptr;
    if (cudaEventCreate(&reached) != cudaSuccess || cudaEventRecord(reached, compute_) != cudaSuccess) {
      if (reached) cudaEventDestroy(reached);
      reached = nullptr;
    }
    if (!Planted("nccl_no_device_wait")) {
      if (cudaError_t e = cudaStreamWaitEvent(compute_, ev_.get(), 0); e != cudaSuccess) {
        if (reached) cudaEventDestroy(reached);
        return status_ = Internal("{}: ordering the compute stream after it: {}", what_, cudaGetErrorString(e));
      }
    }
    if (reached && (cudaEventCreate(&resumed) != cudaSuccess || cudaEventRecord(resumed, compute_) != cudaSuccess)) {
      if (resumed) cudaEventDestroy(resumed);
      resumed = nullptr;
    }
    on_device_ = true;
    bool aborted = false;
    {
      std::lock_guard<std::mutex> l(shared_->mu);
      aborted = shared_->aborted;
      if (!aborted) {
        shared_->watched.push_back({ev_, what_, std::chrono::steady_clock::now()});
        shared_->cv.notify_all();
      }
      if (reached && resumed) {
        shared_->timings.emplace_back(OwnEvent(reached), OwnEvent(resumed));
      } else if (reached) {
        cudaEventDestroy(reached);
      }
    }
    if (aborted) return status_ = shared_->Failed();
    return status_;
  }

 private:
  std::shared_ptr<Shared> shared_;
  SharedEvent ev_;
  std::string what_;
  Status status_;
  cudaStream_t compute_;
  bool waited_ = false;     // on the host (Wait)
  bool on_device_ = false;  // WaitOnDevice: the watchdog watches it
};

class NcclCommunicator : public comm::Communicator {
 public:
  NcclCommunicator(std::shared_ptr<Shared> shared, NcclOptions options, cudaStream_t stream)
      : shared_(std::move(shared)), options_(std::move(options)), stream_(stream) {
    // The caching allocator must not hand out a freed block while this stream may still use it.
    if (options_.device) unregister_ = RegisterExternalStream(*options_.device, stream_);
    options_.device = nullptr;  // not used after this (the device may go first)
    watchdog_ = std::thread(WatchdogLoop, shared_.get());
  }
  ~NcclCommunicator() override {
    // Work still in flight (a job ending on another error with a receive outstanding) gets the watchdog's
    // timeout to finish, then the communicator is aborted: destruction never hangs on a peer.
    const auto start = std::chrono::steady_clock::now();
    while (cudaStreamQuery(stream_) == cudaErrorNotReady) {
      if (std::chrono::steady_clock::now() - start > shared_->timeout) {
        shared_
            ->Abort(Timeout("{}: destroyed with operations still in flight after {:.1f} s", options_.name,
                            std::chrono::duration<double>(shared_->timeout).count()))
            .IgnoreError();
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    cudaStreamSynchronize(stream_);
    {
      std::lock_guard<std::mutex> l(shared_->mu);
      shared_->stop = true;
      shared_->cv.notify_all();
    }
    watchdog_.join();
    {
      std::lock_guard<std::mutex> l(shared_->mu);
      shared_->watched.clear();  // complete: the stream was synchronized
      if (shared_->comm) ncclCommDestroy(shared_->comm);
      shared_->comm = nullptr;
    }
    if (unregister_) unregister_();
    if (barrier_buf_) cudaFree(barrier_buf_);
    cudaStreamDestroy(stream_);
  }
  int rank() const override { return shared_->rank; }
  int size() const override { return shared_->size; }
  std::string name() const override { return options_.name; }
  bool p2p_in_order() const override { return true; }
  bool orders_after_compute() const override { return true; }
  bool waits_on_device() const override { return true; }
  // The completed waits' times (the stream reached the wait .. the stream resumed); the others stay for later. Those
  // recorded in graphs: what the graph clock gained since the last call, once the newest watched launch completed.
  double TakeDeviceWaitSeconds() override {
    std::lock_guard<std::mutex> l(shared_->mu);
    double s = 0;
    auto& t = shared_->timings;
    auto done = std::remove_if(t.begin(), t.end(), [&](const std::pair<SharedEvent, SharedEvent>& p) {
      if (cudaEventQuery(p.second.get()) != cudaSuccess) return false;
      float ms = 0;
      if (cudaEventElapsedTime(&ms, p.first.get(), p.second.get()) == cudaSuccess) s += ms / 1e3;
      return true;
    });
    t.erase(done, t.end());
    // Not while the backend's stream captures (a synchronous copy from the capturing thread would invalidate it).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (shared_->captured_timed > 0 && shared_->last_watched &&
        cudaStreamIsCapturing(static_cast<cudaStream_t>(options_.compute_stream), &capture) == cudaSuccess &&
        capture == cudaStreamCaptureStatusNone && cudaEventQuery(shared_->last_watched.get()) == cudaSuccess) {
      // 8 bytes on the legacy stream, which the backend's non-blocking streams do not wait for (nor it for them).
      uint64_t clock = 0;
      if (cudaMemcpy(&clock, shared_->graph_clock, sizeof clock, cudaMemcpyDeviceToHost) == cudaSuccess) {
        // Negative: a launch no WatchCompute followed is half run (a clock kernel before a wait ran, the one after it
        // not yet); left for a later call.
        const auto gained = static_cast<int64_t>(clock - shared_->graph_clock_taken);
        if (gained >= 0) {
          s += static_cast<double>(gained) / 1e9;
          shared_->graph_clock_taken = clock;
        }
      }
    }
    return s;
  }
  Status WatchCompute(const std::string& what) override {
    if (Status f = shared_->Failed(); !f.ok()) return f;
    cudaEvent_t ev = nullptr;
    cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(ev, static_cast<cudaStream_t>(options_.compute_stream));
    if (e != cudaSuccess) {
      if (ev) cudaEventDestroy(ev);
      return Internal("{}: watching {}: {}", options_.name, what, cudaGetErrorString(e));
    }
    std::lock_guard<std::mutex> l(shared_->mu);
    SharedEvent owned = OwnEvent(ev);
    if (shared_->aborted) return Status::Ok();  // Drain returns the failure
    shared_->last_watched = owned;
    shared_->watched.push_back(
        {std::move(owned), fmt::format("{} on {} (rank {} of {})", what, options_.name, shared_->rank, shared_->size),
         std::chrono::steady_clock::now()});
    shared_->cv.notify_all();
    return Status::Ok();
  }
  // Polls the newest operation waited on the device (the stream completes them in order) itself, spinning for
  // the first millisecond as Wait does, so that the step's end is not late by the watchdog's poll; the watchdog
  // still owns the events and the timeout (its abort ends this loop).
  Status Drain() override {
    const auto start = std::chrono::steady_clock::now();
    auto pause = std::chrono::microseconds(10);
    for (;;) {
      {
        std::lock_guard<std::mutex> l(shared_->mu);
        if (shared_->aborted) break;
        ncclResult_t async = ncclSuccess;
        if (shared_->comm) ncclCommGetAsyncError(shared_->comm, &async);
        if (async != ncclSuccess && async != ncclInProgress) {
          shared_
              ->AbortLocked(Unavailable("{}: NCCL reported an asynchronous error while the step's operations were "
                                        "drained: {}",
                                        options_.name, ncclGetErrorString(async)))
              .IgnoreError();
          break;
        }
        if (shared_->watched.empty() || cudaEventQuery(shared_->watched.back().done.get()) == cudaSuccess) break;
      }
      if (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(1)) {
        std::this_thread::yield();
        continue;
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
    return shared_->Failed();
  }

  std::unique_ptr<comm::Work> AllReduce(float* d, int64_t n, comm::ReduceOp op) override {
    return Run("all-reduce", n, -1, [&](ncclComm_t c) {
      return ncclAllReduce(d, d, static_cast<size_t>(n), ncclFloat, ToNccl(op), c, stream_);
    });
  }
  std::unique_ptr<comm::Work> AllReduce(double* d, int64_t n, comm::ReduceOp op) override {
    return Run("all-reduce", n, -1, [&](ncclComm_t c) {
      return ncclAllReduce(d, d, static_cast<size_t>(n), ncclDouble, ToNccl(op), c, stream_);
    });
  }
  std::unique_ptr<comm::Work> AllReduce(int64_t* d, int64_t n, comm::ReduceOp op) override {
    return Run("all-reduce", n, -1, [&](ncclComm_t c) {
      return ncclAllReduce(d, d, static_cast<size_t>(n), ncclInt64, ToNccl(op), c, stream_);
    });
  }
  std::unique_ptr<comm::Work> ReduceScatter(const float* in, float* out, int64_t n) override {
    return Run("reduce-scatter", n, -1, [&](ncclComm_t c) {
      return ncclReduceScatter(in, out, static_cast<size_t>(n), ncclFloat, ncclSum, c, stream_);
    });
  }
  std::unique_ptr<comm::Work> AllGather(const float* in, float* out, int64_t n) override {
    return Run("all-gather", n, -1,
               [&](ncclComm_t c) { return ncclAllGather(in, out, static_cast<size_t>(n), ncclFloat, c, stream_); });
  }
  std::unique_ptr<comm::Work> AllGather16(const uint16_t* in, uint16_t* out, int64_t n) override {
    return Run(
        "all-gather", n, -1,
        [&](ncclComm_t c) { return ncclAllGather(in, out, static_cast<size_t>(n), ncclBfloat16, c, stream_); },
        "bf16 elements");
  }
  std::unique_ptr<comm::Work> AllReduce16(uint16_t* d, int64_t n) override {
    return Run(
        "all-reduce", n, -1,
        [&](ncclComm_t c) { return ncclAllReduce(d, d, static_cast<size_t>(n), ncclBfloat16, ncclSum, c, stream_); },
        "bf16 elements, bf16 sum");
  }
  std::unique_ptr<comm::Work> ReduceScatter16(const uint16_t* in, uint16_t* out, int64_t n) override {
    return Run(
        "reduce-scatter", n, -1,
        [&](ncclComm_t c) {
          return ncclReduceScatter(in, out, static_cast<size_t>(n), ncclBfloat16, ncclSum, c, stream_);
        },
        "bf16 elements, bf16 sum");
  }
  std::unique_ptr<comm::Work> Broadcast(float* d, int64_t n, int root) override {
    return Run("broadcast", n, -1,
               [&](ncclComm_t c) { return ncclBroadcast(d, d, static_cast<size_t>(n), ncclFloat, root, c, stream_); });
  }
  std::unique_ptr<comm::Work> Send(const float* d, int64_t n, int peer, int tag) override {
    return Run(fmt::format("send (tag {}) to", tag), n, peer,
               [&](ncclComm_t c) { return ncclSend(d, static_cast<size_t>(n), ncclFloat, peer, c, stream_); });
  }
  std::unique_ptr<comm::Work> Recv(float* d, int64_t n, int peer, int tag) override {
    return Run(fmt::format("recv (tag {}) from", tag), n, peer,
               [&](ncclComm_t c) { return ncclRecv(d, static_cast<size_t>(n), ncclFloat, peer, c, stream_); });
  }
  std::unique_ptr<comm::Work> GroupP2p(const std::vector<comm::P2pOp>& ops) override {
    std::string what = "grouped";
    int64_t total = 0;
    for (const comm::P2pOp& o : ops) {
      what += fmt::format(" {} (tag {}) {} peer {};", o.send ? "send" : "recv", o.tag, o.send ? "to" : "from", o.peer);
      total += o.count;
    }
    if (!what.empty() && what.back() == ';') what.pop_back();
    return Run(what, total, -2, [&](ncclComm_t c) {
      ncclResult_t r = ncclGroupStart();
      for (const comm::P2pOp& o : ops) {
        if (r != ncclSuccess) break;
        r = o.send ? ncclSend(o.data, static_cast<size_t>(o.count), ncclFloat, o.peer, c, stream_)
                   : ncclRecv(o.data, static_cast<size_t>(o.count), ncclFloat, o.peer, c, stream_);
      }
      const ncclResult_t e = ncclGroupEnd();
      return r != ncclSuccess ? r : e;
    });
  }
  Status Barrier() override {
    if (!barrier_buf_) {
      MS_CUDA_CHECK(cudaMalloc(&barrier_buf_, sizeof(float)), "barrier buffer");
    }
    return AllReduce(barrier_buf_, 1, comm::ReduceOp::kSum)->Wait();
  }

 private:
  // peer >= 0: point to point with that group rank; -1: a collective; -2: a group naming its peers itself.
  template <typename F>
  std::unique_ptr<comm::Work> Run(const std::string& op_name, int64_t count, int peer, F&& op,
                                  const char* unit = "floats") {
    const uint64_t seq = ++seq_;
    std::string peers;
    if (peer >= 0) {
      peers = fmt::format(" peer {}", peer);
    } else if (peer == -1) {
      std::vector<int> others;
      for (int r = 0; r < shared_->size; ++r) {
        if (r != shared_->rank) others.push_back(r);
      }
      if (!others.empty()) peers = fmt::format(" (peers {})", fmt::join(others, ","));
    }
    const std::string what = fmt::format("{}{} #{} of {} {} on {} (rank {} of {})", op_name, peers, seq, count, unit,
                                         options_.name, shared_->rank, shared_->size);
    auto fail = [&](Status s) { return std::make_unique<NcclWork>(shared_, nullptr, what, std::move(s)); };
    if (Status f = shared_->Failed(); !f.ok()) return fail(f.WithContext(what));
    cudaEvent_t ready = nullptr, done = nullptr;
    cudaError_t e = cudaSuccess;
    if (!PlantedNoComputeWait()) {
      const auto compute = static_cast<cudaStream_t>(options_.compute_stream);
      e = cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
      if (e == cudaSuccess) e = cudaEventRecord(ready, compute);
      if (e == cudaSuccess) e = cudaStreamWaitEvent(stream_, ready, 0);
      if (ready) cudaEventDestroy(ready);
    }
    if (e != cudaSuccess)
      return fail(Internal("{}: ordering after the compute stream: {}", what, cudaGetErrorString(e)));
    ncclResult_t r;
    {
      std::lock_guard<std::mutex> l(shared_->mu);
      r = shared_->comm ? op(shared_->comm) : ncclInvalidUsage;
    }
    if (r != ncclSuccess) return fail(Unavailable("{}: {}", what, ncclGetErrorString(r)));
    e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(done, stream_);
    if (e != cudaSuccess) return fail(Internal("{}: completion event: {}", what, cudaGetErrorString(e)));
    return std::make_unique<NcclWork>(shared_, done, what, Status::Ok(),
                                      static_cast<cudaStream_t>(options_.compute_stream));
  }

  std::shared_ptr<Shared> shared_;
  NcclOptions options_;
  cudaStream_t stream_;
  float* barrier_buf_ = nullptr;
  uint64_t seq_ = 0;
  std::function<void()> unregister_;
  std::thread watchdog_;
};

}  // namespace

bool NcclAvailable() {
  return true;
}

Result<std::string> NewNcclUniqueId() {
  ncclUniqueId id;
  MS_NCCL_CHECK(ncclGetUniqueId(&id), "creating an NCCL unique id");
  return std::string(reinterpret_cast<const char*>(&id), sizeof id);
}

Result<std::unique_ptr<comm::Communicator>> MakeNcclCommunicator(const std::string& id_bytes, int rank, int size,
                                                                 NcclOptions options) {
  ncclUniqueId id;
  if (id_bytes.size() != sizeof id) {
    return InvalidArgument("{}: NCCL unique id has {} bytes, expected {}", options.name, id_bytes.size(), sizeof id);
  }
  std::memcpy(&id, id_bytes.data(), sizeof id);
  ncclComm_t c = nullptr;
  MS_NCCL_CHECK(ncclCommInitRank(&c, size, id, rank),
                fmt::format("{}: ncclCommInitRank (rank {} of {})", options.name, rank, size));
  cudaStream_t stream = nullptr;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    ncclCommDestroy(c);
    return Internal("{}: creating the communication stream: {}", options.name, cudaGetErrorString(e));
  }
  auto shared = std::make_shared<Shared>();
  // The graph clock, zeroed before any stream can use it (the memset is the legacy stream's, waited for here).
  uint64_t* clock = nullptr;
  cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&clock), sizeof(uint64_t));
  if (e == cudaSuccess) e = cudaMemset(clock, 0, sizeof(uint64_t));
  if (e == cudaSuccess) e = cudaStreamSynchronize(nullptr);
  if (e != cudaSuccess) {
    if (clock) cudaFree(clock);
    cudaStreamDestroy(stream);
    ncclCommDestroy(c);
    return Internal("{}: allocating the graph clock (8 bytes): {}", options.name, cudaGetErrorString(e));
  }
  shared->graph_clock = clock;
  shared->comm = c;
  shared->name = options.name;
  shared->rank = rank;
  shared->size = size;
  shared->timeout = options.timeout;
  return std::unique_ptr<comm::Communicator>(new NcclCommunicator(std::move(shared), std::move(options), stream));
}

}  // namespace ms::cuda

#else  // no nccl.h

namespace ms::cuda {
bool NcclAvailable() {
  return false;
}
Result<std::string> NewNcclUniqueId() {
  return Unavailable("this megascale was built without NCCL (nccl.h was not found)");
}
Result<std::unique_ptr<comm::Communicator>> MakeNcclCommunicator(const std::string&, int, int, NcclOptions) {
  return Unavailable("this megascale was built without NCCL (nccl.h was not found)");
}
}  // namespace ms::cuda

#endif
