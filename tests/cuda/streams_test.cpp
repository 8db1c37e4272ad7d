// The emulated device's stream modes (kernels/sim/streams.cpp): async streams run in issue order on their own
// threads and are ordered with each other only by events; the deferred mode runs a stream's work only when
// something waits for it, so a consumer that forgot its event wait reads stale memory — always, not by luck.
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "sim/runtime_hooks.h"

namespace {

struct Mode {
  explicit Mode(ms::sim::StreamMode m) { ms::sim::SetStreamMode(m); }
  ~Mode() { ms::sim::SetStreamMode(ms::sim::StreamMode::kSync); }
};

// Producer on s1 writes 7 into a device word; consumer on s2 copies it to another; with or without the event
// wait that orders them. Returns what the consumer copied.
float ProducerConsumer(bool with_wait) {
  cudaStream_t s1 = nullptr, s2 = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking) == cudaSuccess);
  float *a = nullptr, *b = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&a), sizeof(float)) == cudaSuccess);
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&b), sizeof(float)) == cudaSuccess);
  const float zero = 0, seven = 7;
  REQUIRE(cudaMemcpy(a, &zero, sizeof zero, cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(cudaMemcpy(b, &zero, sizeof zero, cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(a, &seven, sizeof seven, cudaMemcpyHostToDevice, s1) == cudaSuccess);
  cudaEvent_t ev = nullptr;
  REQUIRE(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess);
  REQUIRE(cudaEventRecord(ev, s1) == cudaSuccess);
  if (with_wait) REQUIRE(cudaStreamWaitEvent(s2, ev, 0) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(b, a, sizeof(float), cudaMemcpyDeviceToDevice, s2) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(s2) == cudaSuccess);
  float got = -1;
  REQUIRE(cudaMemcpy(&got, b, sizeof got, cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(s1) == cudaSuccess);
  cudaEventDestroy(ev);
  cudaFree(a);
  cudaFree(b);
  cudaStreamDestroy(s1);
  cudaStreamDestroy(s2);
  return got;
}

}  // namespace

TEST_CASE("deferred streams: a missing event wait reads stale memory, the wait makes it right") {
  Mode m(ms::sim::StreamMode::kDeferred);
  CHECK(ProducerConsumer(true) == 7.0f);
  CHECK(ProducerConsumer(false) == 0.0f);  // the planted bug: deterministic, whatever the timing
}

TEST_CASE("sync streams (the default) cannot see the missing wait") {
  CHECK(ms::sim::GetStreamMode() == ms::sim::StreamMode::kSync);
  CHECK(ProducerConsumer(false) == 7.0f);
}

TEST_CASE("async streams: issue order within a stream, host sync, blocking operations, event query") {
  Mode m(ms::sim::StreamMode::kAsync);
  cudaStream_t s = nullptr, t = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking) == cudaSuccess);
  std::vector<int> order;
  std::atomic<bool> release{false};
  // A blocking operation on s (what an emulated NCCL receive is) holds s but not t nor the host.
  REQUIRE(ms::sim::EnqueueOnStream(s, "blocked", [&] {
            while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
            order.push_back(1);
            return cudaSuccess;
          }) == cudaSuccess);
  REQUIRE(ms::sim::EnqueueOnStream(s, "after", [&] {
            order.push_back(2);
            return cudaSuccess;
          }) == cudaSuccess);
  cudaEvent_t ev = nullptr;
  REQUIRE(cudaEventCreate(&ev) == cudaSuccess);
  REQUIRE(cudaEventRecord(ev, s) == cudaSuccess);
  std::atomic<bool> t_ran{false};
  REQUIRE(ms::sim::EnqueueOnStream(t, "independent", [&] {
            t_ran = true;
            return cudaSuccess;
          }) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(t) == cudaSuccess);
  CHECK(t_ran);
  CHECK(cudaEventQuery(ev) == cudaErrorNotReady);
  CHECK(cudaStreamQuery(s) == cudaErrorNotReady);
  release = true;
  REQUIRE(cudaEventSynchronize(ev) == cudaSuccess);
  CHECK(order == std::vector<int>{1, 2});
  CHECK(cudaEventQuery(ev) == cudaSuccess);
  // An operation's failure is the stream's sticky error, reported by its synchronization.
  REQUIRE(ms::sim::EnqueueOnStream(s, "fails", [] { return cudaErrorLaunchFailure; }) == cudaSuccess);
  CHECK(cudaStreamSynchronize(s) == cudaErrorLaunchFailure);
  cudaEventDestroy(ev);
  cudaStreamDestroy(s);
  cudaStreamDestroy(t);
}

TEST_CASE(
    "async streams: pageable host sources are staged at the call; the legacy stream waits for blocking "
    "streams") {
  Mode m(ms::sim::StreamMode::kDeferred);
  cudaStream_t blocking = nullptr;
  REQUIRE(cudaStreamCreate(&blocking) == cudaSuccess);
  float* d = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&d), sizeof(float)) == cudaSuccess);
  float host = 3;
  REQUIRE(cudaMemcpyAsync(d, &host, sizeof host, cudaMemcpyHostToDevice, blocking) == cudaSuccess);
  host = 4;  // allowed: the copy took its snapshot
  float back = 0;
  // cudaMemcpy runs on the legacy stream: after the blocking stream's copy, though nothing else waited for it.
  REQUIRE(cudaMemcpy(&back, d, sizeof back, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(back == 3.0f);
  cudaFree(d);
  cudaStreamDestroy(blocking);
}

TEST_CASE("pinned host memory (cudaMallocHost): copies read and write it when they run, as a DMA") {
  Mode m(ms::sim::StreamMode::kDeferred);
  cudaStream_t s = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  float* d = nullptr;
  float* pinned = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&d), sizeof(float)) == cudaSuccess);
  REQUIRE(cudaMallocHost(reinterpret_cast<void**>(&pinned), 2 * sizeof(float)) == cudaSuccess);
  pinned[0] = 3;
  pinned[1] = 0;
  REQUIRE(cudaMemcpyAsync(d, pinned, sizeof(float), cudaMemcpyHostToDevice, s) == cudaSuccess);
  pinned[0] = 4;  // before the copy ran: the copy sees 4 (a pageable source would have been staged as 3)
  REQUIRE(cudaMemcpyAsync(pinned + 1, d, sizeof(float), cudaMemcpyDeviceToHost, s) == cudaSuccess);
  CHECK(pinned[1] == 0.0f);  // device-to-pinned is asynchronous: not there before the stream runs it
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  CHECK(pinned[1] == 4.0f);
  CHECK(cudaFreeHost(pinned) == cudaSuccess);
  float pageable = 0;
  CHECK(cudaFreeHost(&pageable) == cudaErrorInvalidValue);  // not a cudaMallocHost buffer
  (void)cudaGetLastError();
  cudaFree(d);
  cudaStreamDestroy(s);
}

// ---- stream capture (CUDA graphs): recorded, not run; each launch runs the recording again ----

namespace {

struct Captured {
  cudaStream_t s = nullptr;
  float* dev = nullptr;
  float* pinned = nullptr;
  Captured() {
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&dev), 2 * sizeof(float)) == cudaSuccess);
    REQUIRE(cudaMallocHost(reinterpret_cast<void**>(&pinned), 2 * sizeof(float)) == cudaSuccess);
  }
  ~Captured() {
    cudaFreeHost(pinned);
    cudaFree(dev);
    cudaStreamDestroy(s);
  }
  float Read(int i) {
    float v = -1;
    REQUIRE(cudaMemcpy(&v, dev + i, sizeof v, cudaMemcpyDeviceToHost) == cudaSuccess);
    return v;
  }
};

}  // namespace

TEST_CASE("stream capture: the operations are recorded, not run, and every launch runs them again in order") {
  for (auto mode : {ms::sim::StreamMode::kSync, ms::sim::StreamMode::kAsync, ms::sim::StreamMode::kDeferred}) {
    CAPTURE(ms::sim::StreamModeName(mode));
    Mode m(mode);
    Captured c;
    const float three = 3;
    REQUIRE(cudaMemcpy(c.dev, &three, sizeof three, cudaMemcpyHostToDevice) == cudaSuccess);
    std::atomic<int> ran{0};
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusActive;
    REQUIRE(cudaStreamIsCapturing(c.s, &st) == cudaSuccess);
    CHECK(st == cudaStreamCaptureStatusNone);
    REQUIRE(cudaStreamBeginCapture(c.s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    REQUIRE(cudaStreamIsCapturing(c.s, &st) == cudaSuccess);
    CHECK(st == cudaStreamCaptureStatusActive);
    // dev[1] = pinned[0] (read when the graph runs), dev[0] = dev[1], then a host operation.
    REQUIRE(cudaMemcpyAsync(c.dev + 1, c.pinned, sizeof(float), cudaMemcpyHostToDevice, c.s) == cudaSuccess);
    REQUIRE(cudaMemcpyAsync(c.dev, c.dev + 1, sizeof(float), cudaMemcpyDeviceToDevice, c.s) == cudaSuccess);
    REQUIRE(ms::sim::EnqueueOnStream(c.s, "count", [&] {
              ++ran;
              return cudaSuccess;
            }) == cudaSuccess);
    cudaEvent_t ev = nullptr;
    REQUIRE(cudaEventCreate(&ev) == cudaSuccess);
    REQUIRE(cudaEventRecord(ev, c.s) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(c.s, ev, 0) == cudaSuccess);  // an event of the same capture: allowed
    cudaGraph_t graph = nullptr;
    REQUIRE(cudaStreamEndCapture(c.s, &graph) == cudaSuccess);
    REQUIRE(graph != nullptr);
    size_t nodes = 0;
    REQUIRE(cudaGraphGetNodes(graph, nullptr, &nodes) == cudaSuccess);
    CHECK(nodes == 3);
    CHECK(ran == 0);
    CHECK(c.Read(0) == 3.0f);  // nothing ran during the capture
    cudaGraphExec_t exec = nullptr;
    REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);  // the executable graph keeps its own copy
    c.pinned[0] = 5;
    REQUIRE(cudaGraphLaunch(exec, c.s) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(c.s) == cudaSuccess);
    CHECK(c.Read(0) == 5.0f);
    CHECK(ran == 1);
    c.pinned[0] = 9;
    REQUIRE(cudaGraphLaunch(exec, c.s) == cudaSuccess);
    REQUIRE(cudaGraphLaunch(exec, c.s) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(c.s) == cudaSuccess);
    CHECK(c.Read(0) == 9.0f);
    CHECK(ran == 3);
    REQUIRE(cudaGraphExecDestroy(exec) == cudaSuccess);
    cudaEventDestroy(ev);
  }
}

TEST_CASE("stream capture: what CUDA refuses during a capture fails and invalidates it") {
  Captured c;
  cudaGraph_t graph = nullptr;
  auto begin = [&] { REQUIRE(cudaStreamBeginCapture(c.s, cudaStreamCaptureModeThreadLocal) == cudaSuccess); };
  auto end_invalid = [&] {
    CHECK(cudaStreamEndCapture(c.s, &graph) == cudaErrorStreamCaptureInvalidated);
    CHECK(graph == nullptr);
    (void)cudaGetLastError();
  };
  SUBCASE("synchronizing or querying the capturing stream") {
    begin();
    CHECK(cudaStreamSynchronize(c.s) == cudaErrorStreamCaptureUnsupported);
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    REQUIRE(cudaStreamIsCapturing(c.s, &st) == cudaSuccess);
    CHECK(st == cudaStreamCaptureStatusInvalidated);
    CHECK(cudaMemsetAsync(c.dev, 0, 4, c.s) == cudaErrorStreamCaptureInvalidated);
    end_invalid();
    begin();
    CHECK(cudaStreamQuery(c.s) == cudaErrorStreamCaptureUnsupported);
    end_invalid();
  }
  SUBCASE("the capturing thread synchronizing the device") {
    begin();
    CHECK(cudaDeviceSynchronize() == cudaErrorStreamCaptureUnsupported);
    end_invalid();
  }
  SUBCASE("a copy from or to pageable host memory") {
    float pageable[2] = {1, 2};
    begin();
    CHECK(cudaMemcpyAsync(c.dev, pageable, sizeof(float), cudaMemcpyHostToDevice, c.s) ==
          cudaErrorStreamCaptureUnsupported);
    end_invalid();
    begin();
    CHECK(cudaMemcpyAsync(pageable, c.dev, sizeof(float), cudaMemcpyDeviceToHost, c.s) ==
          cudaErrorStreamCaptureUnsupported);
    end_invalid();
  }
  SUBCASE("an event recorded in the capture, queried or synchronized; waits across the capture's boundary") {
    cudaEvent_t in = nullptr, out = nullptr;
    REQUIRE(cudaEventCreate(&in) == cudaSuccess);
    REQUIRE(cudaEventCreate(&out) == cudaSuccess);
    begin();
    REQUIRE(cudaEventRecord(in, c.s) == cudaSuccess);
    CHECK(cudaEventQuery(in) == cudaErrorCapturedEvent);
    end_invalid();
    begin();
    REQUIRE(cudaEventRecord(in, c.s) == cudaSuccess);
    CHECK(cudaEventSynchronize(in) == cudaErrorCapturedEvent);
    end_invalid();
    cudaStream_t other = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking) == cudaSuccess);
    REQUIRE(cudaEventRecord(out, other) == cudaSuccess);
    begin();
    CHECK(cudaStreamWaitEvent(c.s, out, 0) == cudaErrorStreamCaptureIsolation);
    end_invalid();
    begin();  // the legacy stream cannot join a capture
    REQUIRE(cudaEventRecord(in, c.s) == cudaSuccess);
    CHECK(cudaStreamWaitEvent(nullptr, in, 0) == cudaErrorStreamCaptureUnsupported);
    end_invalid();
    cudaStreamDestroy(other);
    cudaEventDestroy(in);
    cudaEventDestroy(out);
  }
  SUBCASE("a second capture of the stream, an end without a capture, the legacy stream") {
    begin();
    CHECK(cudaStreamBeginCapture(c.s, cudaStreamCaptureModeGlobal) == cudaErrorIllegalState);
    REQUIRE(cudaStreamEndCapture(c.s, &graph) == cudaSuccess);  // the first capture is unharmed (and empty)
    REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
    CHECK(cudaStreamEndCapture(c.s, &graph) == cudaErrorIllegalState);
    CHECK(cudaStreamBeginCapture(nullptr, cudaStreamCaptureModeGlobal) == cudaErrorStreamCaptureUnsupported);
    (void)cudaGetLastError();
  }
  // Afterwards the stream works as before.
  REQUIRE(cudaMemsetAsync(c.dev, 0, sizeof(float), c.s) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(c.s) == cudaSuccess);
  CHECK(c.Read(0) == 0.0f);
}

// ---- a capture across streams: forks by event waits, joins back ----

namespace {

struct Forks {
  cudaStream_t a = nullptr, b = nullptr, c = nullptr;
  std::vector<cudaEvent_t> events;
  std::mutex mu;
  std::vector<std::string> log;
  Forks() {
    for (cudaStream_t* s : {&a, &b, &c}) REQUIRE(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking) == cudaSuccess);
  }
  ~Forks() {
    for (cudaEvent_t ev : events) cudaEventDestroy(ev);
    for (cudaStream_t s : {a, b, c}) cudaStreamDestroy(s);
  }
  // `to` waits for an event recorded on `from` now.
  void Wait(cudaStream_t to, cudaStream_t from) {
    cudaEvent_t ev = nullptr;
    REQUIRE(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess);
    events.push_back(ev);
    REQUIRE(cudaEventRecord(ev, from) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(to, ev, 0) == cudaSuccess);
  }
  void Op(cudaStream_t s, const char* name) {
    REQUIRE(ms::sim::EnqueueOnStream(s, name, [this, name] {
              std::lock_guard<std::mutex> l(mu);
              log.emplace_back(name);
              return cudaSuccess;
            }) == cudaSuccess);
  }
  cudaStreamCaptureStatus Status(cudaStream_t s) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusInvalidated;
    REQUIRE(cudaStreamIsCapturing(s, &st) == cudaSuccess);
    return st;
  }
  // Begins a capture of a with the operation a1, then forks b from a.
  void BeginA1ForkB() {
    REQUIRE(cudaStreamBeginCapture(a, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    Op(a, "a1");
    Wait(b, a);
  }
  // Ends a's capture, launches the graph once on a and waits for a (so for every branch of the launch).
  void LaunchOnce() {
    cudaGraph_t graph = nullptr;
    REQUIRE(cudaStreamEndCapture(a, &graph) == cudaSuccess);
    cudaGraphExec_t exec = nullptr;
    REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    REQUIRE(cudaGraphLaunch(exec, a) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(a) == cudaSuccess);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
};

}  // namespace

TEST_CASE("stream capture across streams: forks and joins by events; a launch runs every stream's operations") {
  for (auto mode : {ms::sim::StreamMode::kSync, ms::sim::StreamMode::kAsync, ms::sim::StreamMode::kDeferred}) {
    CAPTURE(ms::sim::StreamModeName(mode));
    Mode m(mode);
    Forks f;
    f.BeginA1ForkB();  // a1, then b forks from a
    CHECK(f.Status(f.b) == cudaStreamCaptureStatusActive);
    f.Op(f.b, "b1");
    f.Wait(f.c, f.b);  // c forks from b, and joins b back
    f.Op(f.c, "c1");
    f.Wait(f.b, f.c);
    f.Op(f.b, "b2");
    f.Op(f.a, "a2");
    f.Wait(f.a, f.b);  // b (and through it c) joins a back
    f.Op(f.a, "a3");
    cudaGraph_t graph = nullptr;
    REQUIRE(cudaStreamEndCapture(f.a, &graph) == cudaSuccess);
    CHECK(f.Status(f.b) == cudaStreamCaptureStatusNone);
    CHECK(f.Status(f.c) == cudaStreamCaptureStatusNone);
    size_t nodes = 0;
    REQUIRE(cudaGraphGetNodes(graph, nullptr, &nodes) == cudaSuccess);
    CHECK(nodes == 6);
    CHECK(f.log.empty());  // recorded, not run
    cudaGraphExec_t exec = nullptr;
    REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    REQUIRE(cudaGraphLaunch(exec, f.a) == cudaSuccess);
    REQUIRE(cudaGraphLaunch(exec, f.a) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(f.a) == cudaSuccess);
    const std::vector<std::string> once = {"a1", "b1", "c1", "b2", "a2", "a3"};  // the issue order
    REQUIRE(f.log.size() == 2 * once.size());
    if (mode == ms::sim::StreamMode::kSync) {  // one after the other, as issued
      std::vector<std::string> twice = once;
      twice.insert(twice.end(), once.begin(), once.end());
      CHECK(f.log == twice);
    }
    // Each launch runs after the one before it, in an order its forks and joins allow (a2 may run before or after
    // the forked branch b1 c1 b2, concurrently with it).
    for (size_t launch = 0; launch < 2; ++launch) {
      CAPTURE(launch);
      const std::vector<std::string> half(f.log.begin() + static_cast<long>(launch * once.size()),
                                          f.log.begin() + static_cast<long>((launch + 1) * once.size()));
      std::vector<std::string> sorted = half, want = once;
      std::sort(sorted.begin(), sorted.end());
      std::sort(want.begin(), want.end());
      REQUIRE(sorted == want);
      auto at = [&](const char* name) { return std::find(half.begin(), half.end(), name) - half.begin(); };
      for (auto [before, after] : std::vector<std::pair<const char*, const char*>>{
               {"a1", "b1"}, {"b1", "c1"}, {"c1", "b2"}, {"b2", "a3"}, {"a1", "a2"}, {"a2", "a3"}}) {
        CAPTURE(before);
        CAPTURE(after);
        CHECK(at(before) < at(after));
      }
    }
    // The forked streams work on their own again.
    f.Op(f.b, "b-after");
    REQUIRE(cudaStreamSynchronize(f.b) == cudaSuccess);
    CHECK(f.log.back() == "b-after");
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

// A graph's branches run concurrently (async and deferred modes): an operation of a forked branch that blocks until an
// operation issued after it on the origin stream has run (as a captured wait for a collective blocks its branch
// until the peer's part arrives) completes; run one after the other in issue order it would wait forever.
TEST_CASE("stream capture across streams: a launch runs the forked branches concurrently with the origin's") {
  for (auto mode : {ms::sim::StreamMode::kAsync, ms::sim::StreamMode::kDeferred}) {
    CAPTURE(ms::sim::StreamModeName(mode));
    Mode m(mode);
    Forks f;
    std::atomic<int> a2_runs{0};
    std::atomic<bool> b1_saw_a2{false};
    f.BeginA1ForkB();
    REQUIRE(ms::sim::EnqueueOnStream(f.b, "b1", [&] {  // waits (up to 10 s) for this launch's a2
              const auto t0 = std::chrono::steady_clock::now();
              while (a2_runs == 0 && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10)) {
                std::this_thread::sleep_for(std::chrono::milliseconds(1));
              }
              b1_saw_a2 = a2_runs > 0;
              return cudaSuccess;
            }) == cudaSuccess);
    REQUIRE(ms::sim::EnqueueOnStream(f.a, "a2", [&] {
              ++a2_runs;
              return cudaSuccess;
            }) == cudaSuccess);
    f.Wait(f.a, f.b);
    f.LaunchOnce();
    CHECK(b1_saw_a2);
    CHECK(a2_runs == 1);
  }
}

// A wait after a stream's last captured operation is passed on by an event recorded after it, as in CUDA: here b
// waits for c after b1 and a waits for b, so a2 comes after c1 although no operation of b follows the wait.
TEST_CASE("stream capture across streams: a join after a branch's last operation is passed on by its next event") {
  for (auto mode : {ms::sim::StreamMode::kSync, ms::sim::StreamMode::kAsync, ms::sim::StreamMode::kDeferred}) {
    CAPTURE(ms::sim::StreamModeName(mode));
    Mode m(mode);
    Forks f;
    f.BeginA1ForkB();
    f.Op(f.b, "b1");
    f.Wait(f.c, f.a);
    REQUIRE(ms::sim::EnqueueOnStream(f.c, "c1", [&f] {  // slow: a2 must still wait for it
              std::this_thread::sleep_for(std::chrono::milliseconds(50));
              std::lock_guard<std::mutex> l(f.mu);
              f.log.emplace_back("c1");
              return cudaSuccess;
            }) == cudaSuccess);
    f.Wait(f.b, f.c);  // after b1: b has no operation left
    f.Wait(f.a, f.b);
    f.Op(f.a, "a2");
    f.LaunchOnce();
    REQUIRE(f.log.size() == 4);
    auto at = [&](const char* name) { return std::find(f.log.begin(), f.log.end(), name) - f.log.begin(); };
    CHECK(at("c1") < at("a2"));
    CHECK(at("b1") < at("a2"));
    CHECK(f.log.back() == "a2");
  }
}

TEST_CASE("stream capture across streams: a fork not joined back, or the capture ended on it, fails") {
  Forks f;
  cudaGraph_t graph = nullptr;
  // Every case: a capture of a, which b joins (forks into) at once.
  REQUIRE(cudaStreamBeginCapture(f.a, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  f.Wait(f.b, f.a);
  SUBCASE("unjoined") {
    f.Op(f.b, "b1");
    CHECK(cudaStreamEndCapture(f.a, &graph) == cudaErrorStreamCaptureUnjoined);
  }
  SUBCASE("joined before its last operation") {
    f.Op(f.b, "b1");
    f.Wait(f.a, f.b);
    f.Op(f.b, "b2");
    CHECK(cudaStreamEndCapture(f.a, &graph) == cudaErrorStreamCaptureUnjoined);
  }
  SUBCASE("joined only to another forked stream that never joins back") {
    f.Wait(f.c, f.b);
    f.Op(f.c, "c1");
    f.Wait(f.b, f.c);
    f.Op(f.b, "b1");
    CHECK(cudaStreamEndCapture(f.a, &graph) == cudaErrorStreamCaptureUnjoined);
  }
  SUBCASE("ended on the forked stream") {
    CHECK(cudaStreamEndCapture(f.b, &graph) == cudaErrorStreamCaptureUnmatched);
    CHECK(cudaStreamEndCapture(f.a, &graph) == cudaErrorStreamCaptureInvalidated);
  }
  CHECK(graph == nullptr);
  (void)cudaGetLastError();
  CHECK(f.Status(f.a) == cudaStreamCaptureStatusNone);
  CHECK(f.Status(f.b) == cudaStreamCaptureStatusNone);
  CHECK(f.Status(f.c) == cudaStreamCaptureStatusNone);
  CHECK(f.log.empty());
  f.Op(f.b, "b-after");  // usable again
  REQUIRE(cudaStreamSynchronize(f.b) == cudaSuccess);
  CHECK(f.log == std::vector<std::string>{"b-after"});
}
