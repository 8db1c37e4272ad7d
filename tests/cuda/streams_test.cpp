// The emulated device's stream modes (kernels/sim/streams.cpp): async streams run in issue order on their own
// threads and are ordered with each other only by events; the deferred mode runs a stream's work only when
// something waits for it, so a consumer that forgot its event wait reads stale memory — always, not by luck.
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <thread>
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
