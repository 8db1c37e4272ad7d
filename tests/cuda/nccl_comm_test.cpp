// The NCCL communicator's device waits (lib/cuda/nccl_comm.cpp: Work::WaitOnDevice, the watchdog thread, Drain, the
// time the stream spent blocked: TakeDeviceWaitSeconds) on the emulated NCCL, two ranks as two threads of this
// process, under the deferred emulated streams (a stream runs its work only when something waits for it, so a
// consumer not ordered after the collective reads stale memory); and the emulated NCCL captured in a CUDA graph.
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cuda/cuda.h"
#include "sim/runtime_hooks.h"

namespace ms::cuda {
namespace {

struct Mode {
  explicit Mode(sim::StreamMode m) { sim::SetStreamMode(m); }
  ~Mode() { sim::SetStreamMode(sim::StreamMode::kSync); }
};

constexpr int kN = 8;

// One rank: its compute stream, a device buffer of kN floats, its communicator.
struct Rank {
  cudaStream_t compute = nullptr;
  float* buf = nullptr;
  float* out = nullptr;
  std::unique_ptr<comm::Communicator> comm;

  // buf = value everywhere (the host waits for it).
  void Fill(float value) {
    std::vector<float> h(kN, value);
    REQUIRE(cudaMemcpy(buf, h.data(), sizeof(float) * kN, cudaMemcpyHostToDevice) == cudaSuccess);
  }
  // What a consumer enqueued on the compute stream now reads from buf (out = buf, then the host waits).
  std::vector<float> Consume() {
    REQUIRE(cudaMemcpyAsync(out, buf, sizeof(float) * kN, cudaMemcpyDeviceToDevice, compute) == cudaSuccess);
    std::vector<float> h(kN, -1.0f);
    REQUIRE(cudaMemcpyAsync(h.data(), out, sizeof(float) * kN, cudaMemcpyDeviceToHost, compute) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(compute) == cudaSuccess);
    return h;
  }
};

// Two ranks of one group, `timeout` their watchdog's.
std::vector<Rank> MakeGroup(std::chrono::milliseconds timeout) {
  auto id = NewNcclUniqueId();
  REQUIRE(id.ok());
  std::vector<Rank> ranks(2);
  std::vector<Status> made(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    Rank& k = ranks[static_cast<size_t>(r)];
    REQUIRE(cudaStreamCreateWithFlags(&k.compute, cudaStreamNonBlocking) == cudaSuccess);
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&k.buf), sizeof(float) * kN) == cudaSuccess);
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&k.out), sizeof(float) * kN) == cudaSuccess);
    NcclOptions o;
    o.name = "nccl-test[0]";
    o.compute_stream = k.compute;
    o.timeout = timeout;
    threads.emplace_back([&, r, o] {  // ncclCommInitRank blocks until both ranks joined
      auto c = MakeNcclCommunicator(*id, r, 2, o);
      made[static_cast<size_t>(r)] = c.status();
      if (c.ok()) ranks[static_cast<size_t>(r)].comm = std::move(*c);
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : made) REQUIRE_MESSAGE(s.ok(), s.ToString());
  return ranks;
}

void Free(std::vector<Rank>& ranks) {
  for (Rank& k : ranks) {
    k.comm.reset();
    cudaFree(k.buf);
    cudaFree(k.out);
    cudaStreamDestroy(k.compute);
  }
}

}  // namespace

TEST_CASE("WaitOnDevice orders the compute stream after the collective; Drain; a later Wait still waits") {
  Mode mode(sim::StreamMode::kDeferred);
  auto ranks = MakeGroup(std::chrono::milliseconds(60'000));
  for (bool planted : {false, true}) {
    CAPTURE(planted);
    // MEGASCALE_PLANT=nccl_no_device_wait: WaitOnDevice orders nothing — the consumer must then read stale data.
    if (planted) setenv("MEGASCALE_PLANT", "nccl_no_device_wait", 1);
    ranks[0].Fill(1);
    ranks[1].Fill(2);
    std::vector<float> got[2];
    // Rank 1 contributes only once rank 0's WaitOnDevice has returned (so it returned without waiting for the
    // collective) and, planted, once rank 0's consumer has read (what it read is then necessarily stale). A wait of
    // more than 10 s means rank 0's host blocked: rank 1 goes on and the check below fails.
    std::atomic<bool> returned{false}, consumed{false};
    auto await = [](const std::atomic<bool>& flag) {
      const auto t0 = std::chrono::steady_clock::now();
      while (!flag && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      return flag.load();
    };
    bool rank0_went_on = false;
    std::thread late([&] {
      rank0_went_on = await(returned);
      if (planted) await(consumed);
      // Not planted: 100 ms late, which rank 0's compute stream spends blocked in its wait (measured below).
      if (!planted) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      auto w = ranks[1].comm->AllReduce(ranks[1].buf, kN, comm::ReduceOp::kSum);
      REQUIRE(w->WaitOnDevice().ok());
      got[1] = ranks[1].Consume();
      REQUIRE(ranks[1].comm->Drain().ok());
    });
    auto w = ranks[0].comm->AllReduce(ranks[0].buf, kN, comm::ReduceOp::kSum);
    REQUIRE(w->WaitOnDevice().ok());
    returned = true;
    got[0] = ranks[0].Consume();
    consumed = true;
    REQUIRE(ranks[0].comm->Drain().ok());
    REQUIRE(w->Wait().ok());  // after WaitOnDevice, Wait still blocks until completion: it is complete here
    late.join();
    unsetenv("MEGASCALE_PLANT");
    CHECK(rank0_went_on);
    const double blocked = ranks[0].comm->TakeDeviceWaitSeconds();
    CHECK(ranks[0].comm->TakeDeviceWaitSeconds() == 0);  // taken
    if (!planted) {
      CHECK(got[0] == std::vector<float>(kN, 3.0f));
      CHECK(got[1] == std::vector<float>(kN, 3.0f));
      // The compute stream reached the wait at once (the consumer demanded it) and resumed when the sum arrived.
      CHECK(blocked >= 0.05);
      CHECK(blocked < 5.0);
    } else {
      CHECK(got[0] == std::vector<float>(kN, 1.0f));  // read before the sum arrived
    }
  }
  Free(ranks);
}

TEST_CASE("a collective waited on the device that never completes: the watchdog aborts, Drain says so") {
  Mode mode(sim::StreamMode::kDeferred);
  auto ranks = MakeGroup(std::chrono::milliseconds(300));
  ranks[0].Fill(1);
  // Rank 1 never takes part: rank 0's all-reduce cannot complete.
  auto w = ranks[0].comm->AllReduce(ranks[0].buf, kN, comm::ReduceOp::kSum);
  REQUIRE(w->WaitOnDevice().ok());
  // The compute stream waits behind it; the abort unblocks it (no hang here).
  REQUIRE(cudaMemcpyAsync(ranks[0].out, ranks[0].buf, sizeof(float) * kN, cudaMemcpyDeviceToDevice, ranks[0].compute) ==
          cudaSuccess);
  const auto t0 = std::chrono::steady_clock::now();
  const Status drained = ranks[0].comm->Drain();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  REQUIRE(!drained.ok());
  CHECK(drained.message().find("no completion after 0.3 s") != std::string::npos);
  CHECK(drained.message().find("all-reduce (peers 1) #1 of 8 floats on nccl-test[0]") != std::string::npos);
  CHECK(drained.message().find("aborted after an earlier failure") != std::string::npos);
  CHECK(waited >= 0.25);
  CHECK(waited < 10.0);
  CHECK(cudaStreamSynchronize(ranks[0].compute) == cudaSuccess);
  // Every later operation fails at once.
  auto later = ranks[0].comm->AllReduce(ranks[0].buf, kN, comm::ReduceOp::kSum);
  const Status s = later->WaitOnDevice();
  CHECK(!s.ok());
  CHECK(s.message().find("aborted after an earlier failure") != std::string::npos);
  Free(ranks);
}

// The communicator inside a CUDA graph: an operation issued while the compute stream captures forks the NCCL stream
// into the capture, WaitOnDevice joins it back (nothing watched: a captured event cannot be queried), and each
// launch is watched by WatchCompute — the drain waits for it, and a peer that never launches its graph is a timeout
// naming the launch. The captured wait is timed by the device's clock: rank 1 launching 100 ms late, rank 0's
// stream spends them blocked in its graph, which TakeDeviceWaitSeconds reports once the launch completed.
TEST_CASE("the communicator in a CUDA graph: captured device waits, timed, launches watched by WatchCompute") {
  Mode mode(sim::StreamMode::kDeferred);
  auto ranks = MakeGroup(std::chrono::milliseconds(300));
  auto record = [](Rank& k) {
    REQUIRE(cudaStreamBeginCapture(k.compute, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    auto w = k.comm->AllReduce(k.buf, kN, comm::ReduceOp::kSum);
    REQUIRE(w->WaitOnDevice().ok());
    cudaGraph_t graph = nullptr;
    REQUIRE(cudaStreamEndCapture(k.compute, &graph) == cudaSuccess);  // joined back: no unjoined fork
    cudaGraphExec_t exec = nullptr;
    REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    cudaGraphDestroy(graph);
    return exec;
  };
  std::vector<cudaGraphExec_t> execs(2);
  std::vector<std::vector<float>> got(2);
  std::vector<double> blocked(2, -1.0);
  auto run = [&](int r) {
    Rank& k = ranks[static_cast<size_t>(r)];
    k.Fill(static_cast<float>(r + 1));
    execs[static_cast<size_t>(r)] = record(k);
    CHECK(k.comm->TakeDeviceWaitSeconds() == 0);  // recorded, not yet run
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    REQUIRE(cudaGraphLaunch(execs[static_cast<size_t>(r)], k.compute) == cudaSuccess);
    REQUIRE(k.comm->WatchCompute("the test graph").ok());
    REQUIRE(k.comm->Drain().ok());
    blocked[static_cast<size_t>(r)] = k.comm->TakeDeviceWaitSeconds();
    CHECK(k.comm->TakeDeviceWaitSeconds() == 0);  // taken
    got[static_cast<size_t>(r)] = k.Consume();
  };
  std::thread other(run, 1);
  run(0);
  other.join();
  CHECK(got[0] == std::vector<float>(kN, 3.0f));
  CHECK(got[1] == std::vector<float>(kN, 3.0f));
  // Rank 0's stream reached its graph's wait at once (its drain demanded it) and resumed when rank 1 took part.
  CHECK(blocked[0] >= 0.05);
  CHECK(blocked[0] < 5.0);
  CHECK(blocked[1] >= 0.0);
  CHECK(blocked[1] < blocked[0]);
  // Rank 0 launches again, rank 1 does not: the watched launch times out, the drain says so.
  REQUIRE(cudaGraphLaunch(execs[0], ranks[0].compute) == cudaSuccess);
  REQUIRE(ranks[0].comm->WatchCompute("the test graph").ok());
  const Status drained = ranks[0].comm->Drain();
  REQUIRE(!drained.ok());
  CHECK(drained.message().find("the test graph on nccl-test[0] (rank 0 of 2): no completion after 0.3 s") !=
        std::string::npos);
  CHECK(cudaStreamSynchronize(ranks[0].compute) == cudaSuccess);  // the abort unblocked it
  for (cudaGraphExec_t e : execs) cudaGraphExecDestroy(e);
  Free(ranks);
}

// The emulated NCCL inside a CUDA graph (kernels/sim/nccl.cpp, streams.cpp), at the level of the NCCL API: each rank
// forks an NCCL stream into a capture of its compute stream by an event, all-reduces there in place and joins back;
// every launch of the graph sums again — two launches queued back to back included, whose messages carry the same
// sequence numbers and must match in launch order.
TEST_CASE("the emulated NCCL in a CUDA graph: every launch all-reduces again, in launch order") {
  Mode mode(sim::StreamMode::kDeferred);
  ncclUniqueId id;
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  std::vector<std::vector<float>> got(2);
  auto rank = [&](int r) {
    ncclComm_t comm = nullptr;
    REQUIRE(ncclCommInitRank(&comm, 2, id, r) == ncclSuccess);  // blocks until both ranks joined
    cudaStream_t compute = nullptr, side = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking) == cudaSuccess);
    REQUIRE(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking) == cudaSuccess);
    float* buf = nullptr;
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&buf), sizeof(float) * kN) == cudaSuccess);
    std::vector<float> h(kN, static_cast<float>(r + 1));
    REQUIRE(cudaMemcpy(buf, h.data(), sizeof(float) * kN, cudaMemcpyHostToDevice) == cudaSuccess);
    cudaEvent_t fork = nullptr, join = nullptr;
    REQUIRE(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming) == cudaSuccess);
    REQUIRE(cudaEventCreateWithFlags(&join, cudaEventDisableTiming) == cudaSuccess);
    REQUIRE(cudaStreamBeginCapture(compute, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    REQUIRE(cudaEventRecord(fork, compute) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(side, fork, 0) == cudaSuccess);
    REQUIRE(ncclAllReduce(buf, buf, kN, ncclFloat32, ncclSum, comm, side) == ncclSuccess);
    REQUIRE(cudaEventRecord(join, side) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(compute, join, 0) == cudaSuccess);
    cudaGraph_t graph = nullptr;
    REQUIRE(cudaStreamEndCapture(compute, &graph) == cudaSuccess);
    cudaGraphExec_t exec = nullptr;
    REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    auto read = [&] {
      std::vector<float> v(kN, -1.0f);
      REQUIRE(cudaStreamSynchronize(compute) == cudaSuccess);
      REQUIRE(cudaMemcpy(v.data(), buf, sizeof(float) * kN, cudaMemcpyDeviceToHost) == cudaSuccess);
      return v;
    };
    const std::vector<float> before = read();  // the capture ran nothing
    REQUIRE(cudaGraphLaunch(exec, compute) == cudaSuccess);
    const std::vector<float> once = read();
    REQUIRE(cudaGraphLaunch(exec, compute) == cudaSuccess);
    REQUIRE(cudaGraphLaunch(exec, compute) == cudaSuccess);
    std::vector<float> thrice = read();
    CHECK(before == std::vector<float>(kN, static_cast<float>(r + 1)));
    CHECK(once == std::vector<float>(kN, 3.0f));
    got[static_cast<size_t>(r)] = std::move(thrice);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaEventDestroy(fork);
    cudaEventDestroy(join);
    CHECK(ncclCommDestroy(comm) == ncclSuccess);
    cudaFree(buf);
    cudaStreamDestroy(side);
    cudaStreamDestroy(compute);
  };
  std::thread other(rank, 1);
  rank(0);
  other.join();
  CHECK(got[0] == std::vector<float>(kN, 12.0f));  // 3 + 3, then 6 + 6
  CHECK(got[1] == std::vector<float>(kN, 12.0f));
}

}  // namespace ms::cuda
