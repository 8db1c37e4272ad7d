// The CUDA device (lib/cuda/cuda_device.cpp) and the cuBLAS subset (kernels/sim/cublas.cpp), on the SIMT
// emulator's CUDA runtime: allocator (rounding, reuse, stats, release-and-retry, errors), copies, streams and
// events; cuBLAS GEMMs against a double-precision reference, and its argument checks.
#include <doctest/doctest.h>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "cuda/cuda.h"
#include "device/device.h"
#include "ops/ops.h"
#include "sim/runtime_hooks.h"

#if defined(__SANITIZE_ADDRESS__)
#define MS_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MS_TEST_ASAN 1
#endif
#endif
#if MS_TEST_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace ms::cuda {
namespace {

std::unique_ptr<device::Device> MakeDevice() {
  auto dev = MakeCudaDevice(0);
  REQUIRE_MESSAGE(dev.ok(), dev.status().ToString());
  return std::move(dev).value();
}

void* MustAlloc(device::Device& dev, size_t bytes) {
  auto p = dev.Alloc(bytes);
  REQUIRE_MESSAGE(p.ok(), p.status().ToString());
  return *p;
}

bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST_CASE("cuda device: name, kind and ordinal checks") {
  auto dev = MakeDevice();
  CHECK(dev->name() == "cuda:0 (megascale SIMT emulator (CPU))");
  CHECK_FALSE(dev->is_host());
  CHECK(dev->bytes_in_use() == 0);

  auto bad = MakeCudaDevice(1);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == Code::kUnavailable);
  CHECK_MESSAGE(Contains(bad.status().message(), "CUDA device 1 does not exist: 1 device(s) visible"),
                bad.status().message());
  auto negative = MakeCudaDevice(-1);
  REQUIRE_FALSE(negative.ok());
  CHECK(negative.status().code() == Code::kUnavailable);

  // Other devices' objects are not CUDA ones.
  auto cpu = device::MakeCpuDevice();
  auto cpu_stream = cpu->CreateStream();
  CHECK(NativeStream(*cpu_stream) == nullptr);
  CHECK(GetAllocatorStats(*cpu).cuda_mallocs == 0);
  ReleaseCachedMemory(*cpu);  // a no-op
}

TEST_CASE("cuda allocator: rounding, reuse from the free lists, statistics") {
  const auto before = sim::LiveDeviceAllocations();
  {
    auto dev = MakeDevice();
    struct Case {
      size_t request, block;
    };
    const Case cases[] = {{1, 512},
                          {512, 512},
                          {513, 1024},
                          {1000, 1024},
                          {(1u << 20) - 1, 1u << 20},
                          {1u << 20, 2u << 20},
                          {(3u << 20) + 1, 4u << 20}};
    size_t expected_in_use = 0;
    std::vector<void*> ptrs;
    for (const Case& c : cases) {
      void* p = MustAlloc(*dev, c.request);
      CHECK(reinterpret_cast<uintptr_t>(p) % 256 == 0);
      expected_in_use += c.block;
      CHECK_MESSAGE(dev->bytes_in_use() == expected_in_use, "request ", c.request);
      ptrs.push_back(p);
    }
    AllocatorStats s = GetAllocatorStats(*dev);
    CHECK(s.bytes_in_use == expected_in_use);
    CHECK(s.peak_in_use == expected_in_use);
    CHECK(s.bytes_cached == 0);
    CHECK(s.cuda_mallocs == 7);
    CHECK(s.cache_hits == 0);
    CHECK(sim::LiveDeviceAllocations().count == before.count + 7);

    // Free the 1000-byte block: cached, then handed out again for a request that rounds to 1024 or 512.
    dev->Free(ptrs[3]);
    s = GetAllocatorStats(*dev);
    CHECK(s.bytes_in_use == expected_in_use - 1024);
    CHECK(s.bytes_cached == 1024);
    void* again = MustAlloc(*dev, 700);
    CHECK(again == ptrs[3]);
    s = GetAllocatorStats(*dev);
    CHECK(s.cache_hits == 1);
    CHECK(s.cuda_mallocs == 7);
    CHECK(s.bytes_cached == 0);
    CHECK(s.peak_in_use == expected_in_use);
    dev->Free(again);
    CHECK(MustAlloc(*dev, 100) == ptrs[3]);  // 1024 <= 2 * 512: reused
    CHECK(GetAllocatorStats(*dev).cache_hits == 2);

    // A block more than twice the rounded request is not used for it (no splitting); twice is.
    dev->Free(ptrs[6]);                         // 4 MiB
    void* small = MustAlloc(*dev, 512u << 10);  // 512 KiB: a fresh cudaMalloc
    CHECK(small != ptrs[6]);
    s = GetAllocatorStats(*dev);
    CHECK(s.cuda_mallocs == 8);
    CHECK(s.bytes_cached == (4u << 20));
    CHECK(s.peak_in_use == expected_in_use);
    void* big = MustAlloc(*dev, 1u << 20);  // rounds to 2 MiB: the cached 4 MiB block
    CHECK(big == ptrs[6]);
    CHECK(GetAllocatorStats(*dev).bytes_in_use == dev->bytes_in_use());

    // The best fit is taken among cached blocks.
    dev->Free(ptrs[0]);  // 512
    dev->Free(ptrs[2]);  // 1024
    CHECK(MustAlloc(*dev, 400) == ptrs[0]);
    CHECK(MustAlloc(*dev, 900) == ptrs[2]);

    // ReleaseCachedMemory returns the free lists to cudaFree; blocks in use stay.
    dev->Free(big);
    dev->Free(small);
    const size_t live = sim::LiveDeviceAllocations().count;
    ReleaseCachedMemory(*dev);
    s = GetAllocatorStats(*dev);
    CHECK(s.bytes_cached == 0);
    CHECK(sim::LiveDeviceAllocations().count == live - 2);
    CHECK(s.bytes_in_use == dev->bytes_in_use());
    CHECK(s.bytes_in_use > 0);
    // Some blocks are still in use: the destructor returns them too (with a warning).
  }
  const auto after = sim::LiveDeviceAllocations();
  CHECK(after.count == before.count);
  CHECK(after.bytes == before.bytes);
}

TEST_CASE("cuda allocator: a reused block is refilled with 0xFF in the emulator") {
  auto dev = MakeDevice();
  void* p = MustAlloc(*dev, 64);
  std::vector<uint8_t> host(64, 7), back(64, 0);
  REQUIRE(dev->CopyHostToDevice(p, host.data(), 64).ok());
  dev->Free(p);
  void* q = MustAlloc(*dev, 64);
  REQUIRE(q == p);
  REQUIRE(dev->CopyDeviceToHost(back.data(), q, 64).ok());
  for (uint8_t b : back) CHECK(b == 0xFF);
  dev->Free(q);
}

TEST_CASE("cuda allocator: cudaMalloc failure releases the cache and retries once") {
  auto dev = MakeDevice();
  std::vector<void*> ptrs;
  for (size_t bytes : {size_t{4096}, size_t{8192}, size_t{3} << 20}) ptrs.push_back(MustAlloc(*dev, bytes));
  for (void* p : ptrs) dev->Free(p);
  const size_t cached = GetAllocatorStats(*dev).bytes_cached;
  CHECK(cached == 4096 + 8192 + (4u << 20));
  const auto live = sim::LiveDeviceAllocations();

  sim::FailNextMallocs(1);
  void* p = MustAlloc(*dev, 20u << 20);  // not cached: cudaMalloc fails once, the cache is released, the retry works
  AllocatorStats s = GetAllocatorStats(*dev);
  CHECK(s.bytes_cached == 0);
  CHECK(s.bytes_in_use == (20u << 20));
  CHECK(s.cuda_mallocs == 4);
  CHECK(sim::LiveDeviceAllocations().count == live.count - 3 + 1);
  CHECK(cudaGetLastError() == cudaSuccess);  // the handled failure does not linger
  dev->Free(p);

  // Two failures in a row: an error naming the size, what is in use and what was cached.
  void* held = MustAlloc(*dev, 5000);
  dev->Free(MustAlloc(*dev, 600));
  sim::FailNextMallocs(2);
  auto r = dev->Alloc(12345);
  REQUIRE_FALSE(r.ok());
  const std::string msg = r.status().message();
  CHECK_MESSAGE(Contains(msg, "cuda:0"), msg);
  CHECK_MESSAGE(Contains(msg, "out of memory: cannot allocate 12345 bytes (rounded to 12800)"), msg);
  CHECK_MESSAGE(Contains(msg, "cudaErrorMemoryAllocation"), msg);
  CHECK_MESSAGE(Contains(msg, "5120 bytes in use"), msg);
  CHECK_MESSAGE(Contains(msg, "0 cached"), msg);
  CHECK(cudaGetLastError() == cudaSuccess);
  sim::FailNextMallocs(0);
  // The device still works afterwards.
  void* ok = MustAlloc(*dev, 12345);
  dev->Free(ok);
  dev->Free(held);
  CHECK(dev->bytes_in_use() == 0);
}

TEST_CASE("cuda allocator: more than the device has is an out-of-memory error") {
  auto dev = MakeDevice();
  size_t free_bytes = 0, total = 0;
  REQUIRE(cudaMemGetInfo(&free_bytes, &total) == cudaSuccess);
  REQUIRE(total > 0);
  const size_t huge = total + (size_t{1} << 30);
  auto r = dev->Alloc(huge);
  REQUIRE_FALSE(r.ok());
  CHECK_MESSAGE(Contains(r.status().message(), "cannot allocate " + std::to_string(huge) + " bytes"),
                r.status().message());
  CHECK_MESSAGE(Contains(r.status().message(), "bytes free"), r.status().message());
  CHECK(cudaGetLastError() == cudaSuccess);
  auto too_large = dev->Alloc(std::numeric_limits<size_t>::max());
  CHECK_FALSE(too_large.ok());
  CHECK(dev->bytes_in_use() == 0);
}

TEST_CASE("cuda allocator: Free of unknown pointers and double frees are logged and ignored") {
  auto dev = MakeDevice();
  void* p = MustAlloc(*dev, 1000);
  int local = 0;
  dev->Free(&local);
  dev->Free(static_cast<char*>(p) + 8);  // inside a block, not its start
  dev->Free(nullptr);
  CHECK(dev->bytes_in_use() == 1024);
  dev->Free(p);
  const AllocatorStats s = GetAllocatorStats(*dev);
  dev->Free(p);  // double free
  const AllocatorStats t = GetAllocatorStats(*dev);
  CHECK(t.bytes_in_use == 0);
  CHECK(t.bytes_cached == s.bytes_cached);
  CHECK(MustAlloc(*dev, 1000) == p);  // handed out once, not twice
  CHECK(MustAlloc(*dev, 1000) != p);
}

TEST_CASE("cuda allocator: concurrent allocations and frees") {
  auto dev = MakeDevice();
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      std::vector<void*> held;
      for (int i = 0; i < 500; ++i) {
        if (held.size() < 8 && (rng() % 3 != 0 || held.empty())) {
          auto p = dev->Alloc(1 + rng() % 70000);
          if (!p.ok()) {
            ++failures;
            continue;
          }
          held.push_back(*p);
        } else {
          const size_t k = rng() % held.size();
          dev->Free(held[k]);
          held.erase(held.begin() + static_cast<std::ptrdiff_t>(k));
        }
      }
      for (void* p : held) dev->Free(p);
    });
  }
  for (auto& th : threads) th.join();
  CHECK(failures == 0);
  const AllocatorStats s = GetAllocatorStats(*dev);
  CHECK(s.bytes_in_use == 0);
  CHECK(s.cache_hits > 0);
  CHECK(s.peak_in_use <= static_cast<size_t>(4 * 8 * 70144));
}

TEST_CASE("cuda device: copies and memset round trips") {
  auto dev = MakeDevice();
  const size_t n = 1001;
  auto a = device::Buffer::Allocate(dev.get(), n);
  auto b = device::Buffer::Allocate(dev.get(), n);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  std::vector<float> host(n), back(n, -1.0f);
  REQUIRE(dev->CopyDeviceToHost(back.data(), a->data(), a->bytes()).ok());
  for (float x : back) CHECK(x == 0.0f);  // Buffer::Allocate zeroes through Memset
  for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i) * 0.25f - 3.0f;
  REQUIRE(dev->CopyHostToDevice(a->data(), host.data(), a->bytes()).ok());
  REQUIRE(dev->CopyDeviceToDevice(b->data(), a->data(), a->bytes()).ok());
  REQUIRE(dev->CopyDeviceToHost(back.data(), b->data(), b->bytes()).ok());
  CHECK(back == host);
  // A part of a buffer, at an offset.
  REQUIRE(dev->CopyDeviceToDevice(b->f32() + 10, a->f32() + 500, 20 * sizeof(float)).ok());
  REQUIRE(dev->CopyDeviceToHost(back.data(), b->data(), b->bytes()).ok());
  for (size_t i = 0; i < 20; ++i) CHECK(back[10 + i] == host[500 + i]);
  CHECK(back[9] == host[9]);
  CHECK(back[30] == host[30]);

  REQUIRE(dev->Memset(a->data(), 0x3F, a->bytes()).ok());
  std::vector<uint8_t> bytes(a->bytes());
  REQUIRE(dev->CopyDeviceToHost(bytes.data(), a->data(), bytes.size()).ok());
  for (uint8_t x : bytes) CHECK(x == 0x3F);
  CHECK(dev->Memset(a->data(), 0, 0).ok());
  CHECK(dev->CopyHostToDevice(a->data(), host.data(), 0).ok());

  // Errors name the operation and the bytes.
  Status s = dev->CopyHostToDevice(nullptr, host.data(), 16);
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK_MESSAGE(Contains(s.message(), "CopyHostToDevice of 16 bytes with a null pointer"), s.message());
  CHECK(dev->Memset(nullptr, 0, 8).code() == Code::kInvalidArgument);
  std::vector<float> big(2 * n);
  s = dev->CopyDeviceToHost(big.data(), a->data(), big.size() * sizeof(float));  // past the end of the block
  REQUIRE_FALSE(s.ok());
  CHECK_MESSAGE(Contains(s.message(), "CopyDeviceToHost of 8008 bytes"), s.message());
  CHECK_MESSAGE(Contains(s.message(), "cudaErrorInvalidValue"), s.message());
  s = dev->CopyHostToDevice(big.data(), host.data(), 64);  // destination is host memory
  REQUIRE_FALSE(s.ok());
  CHECK_MESSAGE(Contains(s.message(), "CopyHostToDevice of 64 bytes"), s.message());
  s = dev->Memset(host.data(), 0, 64);
  REQUIRE_FALSE(s.ok());
  CHECK_MESSAGE(Contains(s.message(), "Memset of 64 bytes"), s.message());
  CHECK(cudaGetLastError() == cudaSuccess);
  // The device still works after the errors.
  REQUIRE(dev->CopyDeviceToHost(back.data(), b->data(), 4).ok());
}

TEST_CASE("cuda streams: Enqueue order, events, WaitEvent, Synchronize") {
  auto dev = MakeDevice();
  auto s1 = dev->CreateStream();
  auto s2 = dev->CreateStream();
  cudaStream_t n1 = NativeStream(*s1), n2 = NativeStream(*s2);
  CHECK(n1 != nullptr);
  CHECK(n2 != nullptr);
  CHECK(n1 != n2);
  CHECK(sim::IsKnownStream(n1));

  std::mutex mu;
  std::vector<int> order;
  auto push = [&](int v) {
    return [&, v] {
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(v);
    };
  };
  for (int i = 1; i <= 5; ++i) s1->Enqueue(push(i));
  auto ev = dev->RecordEvent(*s1);
  s2->WaitEvent(ev);
  s2->Enqueue(push(6));
  s2->Synchronize();
  s1->Synchronize();
  CHECK(ev->Query());
  ev->Synchronize();
  CHECK(order == std::vector<int>{1, 2, 3, 4, 5, 6});

  // Work on a stream and copies into device memory it uses.
  auto buf = device::Buffer::Allocate(dev.get(), 4);
  REQUIRE(buf.ok());
  float host[4] = {1, 2, 3, 4};
  REQUIRE(dev->CopyHostToDevice(buf->data(), host, sizeof host).ok());
  std::atomic<int> ran{0};
  s1->Enqueue([&] { ++ran; });
  s1->Synchronize();
  CHECK(ran == 1);

  // Enqueued work must not call CUDA (nor the device): in the emulator such calls fail.
  Status inside = Status::Ok();
  s1->Enqueue([&] { inside = dev->Alloc(12345).status(); });
  s1->Synchronize();
  CHECK_MESSAGE(Contains(inside.message(), "cudaErrorNotPermitted"), inside.ToString());
  CHECK(cudaGetLastError() == cudaSuccess);

  // Frees while streams exist are stream-ordered, and the blocks are reused once the streams' work is done.
  void* p = MustAlloc(*dev, 3000);
  dev->Free(p);
  CHECK(GetAllocatorStats(*dev).bytes_cached >= 3072);
  CHECK(MustAlloc(*dev, 3000) == p);
  dev->Free(p);

  // A destroyed stream is gone from the runtime; events of other devices' streams work too.
  s2.reset();
  CHECK_FALSE(sim::IsKnownStream(n2));
  auto cpu = device::MakeCpuDevice();
  auto cpu_stream = cpu->CreateStream();
  auto cpu_event = cpu->RecordEvent(*cpu_stream);
  s1->WaitEvent(cpu_event);
  CHECK(cpu_event->Query());
  auto foreign = dev->RecordEvent(*cpu_stream);  // a CUDA device recording on a CPU stream
  cpu_stream->Synchronize();
  CHECK(foreign->Query());
  foreign->Synchronize();
}

// A block freed by the host while work enqueued before the Free still uses it (the pipeline frees its receive
// buffers so): the work runs on the block, the block is handed out again only after the stream passed the Free,
// and in the AddressSanitizer build it is poisoned then, not at the host's Free.
TEST_CASE("cuda allocator: a Free is stream-ordered, and so is the emulator's poisoning") {
  sim::SetStreamMode(sim::StreamMode::kDeferred);  // the stream runs only when something needs it
  {
    auto dev = MakeDevice();
    auto stream = dev->CreateStream();
    auto* p = static_cast<float*>(MustAlloc(*dev, 4096));
    float seen = 0;
    stream->Enqueue([p, &seen] {  // enqueued before the Free: writes and reads the block when the stream runs
      p[0] = 1.5f;
      p[1023] = 2.5f;
      seen = p[0] + p[1023];
    });
    dev->Free(p);
#if MS_TEST_ASAN
    CHECK_FALSE(__asan_address_is_poisoned(p));  // the stream has not passed the Free
#endif
    void* q = MustAlloc(*dev, 4096);  // the freed block is not reusable yet
    CHECK(q != p);
    stream->Synchronize();
    CHECK(seen == 4.0f);
#if MS_TEST_ASAN
    CHECK(__asan_address_is_poisoned(p));
    CHECK(__asan_address_is_poisoned(p + 1023));
#endif
    CHECK(MustAlloc(*dev, 4096) == p);  // now it is
    dev->Free(p);
    dev->Free(q);
    stream->Synchronize();
  }
  sim::SetStreamMode(sim::StreamMode::kSync);
}

TEST_CASE("cuda streams and events outlive their device") {
  std::unique_ptr<device::Stream> stream;
  std::shared_ptr<device::Event> event;
  {
    auto dev = MakeDevice();
    stream = dev->CreateStream();
    event = dev->RecordEvent(*stream);
  }
  int ran = 0;
  stream->Enqueue([&] { ran = 1; });
  stream->WaitEvent(event);
  stream->Synchronize();
  CHECK(ran == 1);
  CHECK(event->Query());
  stream.reset();
  event.reset();
}

// Planted bugs for AddressSanitizer builds (ctest cuda_device_asan_*, run with --no-skip): in the emulated build a
// cached block and the rounding tail of a block in use are poisoned, so these reads are reported.
TEST_CASE("planted: reading a freed block" * doctest::skip()) {
  auto dev = MakeDevice();
  void* p = MustAlloc(*dev, 4096);
  dev->Free(p);  // cached, not returned to cudaFree: only the poisoning can catch this
  std::vector<char> host(4096);
  (void)dev->CopyDeviceToHost(host.data(), p, host.size());
}

TEST_CASE("planted: a stream reading a block after its Free" * doctest::skip()) {
  auto dev = MakeDevice();
  auto stream = dev->CreateStream();
  void* p = MustAlloc(*dev, 2048);
  dev->Free(p);  // the stream passes the Free here (sync streams): work enqueued from now on must not touch it
  std::vector<char> host(2048);
  stream->Enqueue([&] { std::memcpy(host.data(), p, host.size()); });
  stream->Synchronize();
}

TEST_CASE("planted: reading past the requested size" * doctest::skip()) {
  auto dev = MakeDevice();
  void* p = MustAlloc(*dev, 1000);  // a 1024-byte block
  std::vector<char> host(1024);
  (void)dev->CopyDeviceToHost(host.data(), p, host.size());
  dev->Free(p);
}

// ---- cuBLAS subset --------------------------------------------------------------------------------------------

uint16_t ToBf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float FromBf16(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A device buffer filled from a host vector, through the CUDA device.
template <typename T>
struct DevVec {
  DevVec(device::Device& dev, const std::vector<T>& host) : dev(dev), n(host.size()) {
    ptr = MustAlloc(dev, std::max<size_t>(n, 1) * sizeof(T));
    if (n) REQUIRE(dev.CopyHostToDevice(ptr, host.data(), n * sizeof(T)).ok());
  }
  ~DevVec() { dev.Free(ptr); }
  std::vector<T> Get() const {
    std::vector<T> out(n);
    if (n) REQUIRE(dev.CopyDeviceToHost(out.data(), ptr, n * sizeof(T)).ok());
    return out;
  }
  device::Device& dev;
  size_t n;
  void* ptr = nullptr;
};

std::vector<float> RandomFloats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// Column-major reference in double: C = alpha op(A) op(B) + beta C; also the magnitude sum for tolerances.
struct Ref {
  std::vector<double> c, mag;
};
Ref Reference(bool ta, bool tb, int m, int n, int k, double alpha, const std::vector<float>& A, int lda,
              const std::vector<float>& B, int ldb, double beta, const std::vector<float>& C, int ldc) {
  Ref r;
  r.c.assign(static_cast<size_t>(ldc) * n, 0.0);
  r.mag.assign(r.c.size(), 0.0);
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < m; ++i) {
      double acc = 0, mag = 0;
      for (int p = 0; p < k; ++p) {
        const double a = ta ? A[p + static_cast<size_t>(i) * lda] : A[i + static_cast<size_t>(p) * lda];
        const double b = tb ? B[j + static_cast<size_t>(p) * ldb] : B[p + static_cast<size_t>(j) * ldb];
        acc += a * b;
        mag += std::fabs(a * b);
      }
      const size_t idx = i + static_cast<size_t>(j) * ldc;
      const double cin = beta == 0 ? 0.0 : beta * C[idx];
      r.c[idx] = alpha * acc + cin;
      r.mag[idx] = std::fabs(alpha) * mag + std::fabs(cin);
    }
  }
  return r;
}

void CheckClose(const std::vector<float>& got, const Ref& ref, int m, int n, int ldc, double rtol, const char* what) {
  int bad = 0;
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < m; ++i) {
      const size_t idx = i + static_cast<size_t>(j) * ldc;
      const double err = std::fabs(got[idx] - ref.c[idx]);
      const double tol = rtol * std::fabs(ref.c[idx]) + 1e-6 * ref.mag[idx];
      if (!(err <= tol) && bad++ < 5) {
        FAIL_CHECK(what << ": C(" << i << ", " << j << ") = " << got[idx] << ", want " << ref.c[idx]);
      }
    }
  }
  CHECK_MESSAGE(bad == 0, what << ": " << bad << " elements out of tolerance");
}

struct Cublas {
  Cublas() { REQUIRE(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS); }
  ~Cublas() { CHECK(cublasDestroy(h) == CUBLAS_STATUS_SUCCESS); }
  cublasHandle_t h = nullptr;
};

TEST_CASE("cublas emulation: GemmEx bf16 x bf16 -> fp32 and Sgemm, every transpose, odd sizes") {
  auto dev = MakeDevice();
  auto stream = dev->CreateStream();
  Cublas cb;
  REQUIRE(cublasSetStream(cb.h, NativeStream(*stream)) == CUBLAS_STATUS_SUCCESS);
  cudaStream_t got_stream = nullptr;
  REQUIRE(cublasGetStream(cb.h, &got_stream) == CUBLAS_STATUS_SUCCESS);
  CHECK(got_stream == NativeStream(*stream));

  const int m = 37, n = 23, k = 19;
  const cublasOperation_t ops[] = {CUBLAS_OP_N, CUBLAS_OP_T};
  for (cublasOperation_t opa : ops) {
    for (cublasOperation_t opb : ops) {
      for (float beta : {0.0f, 0.5f}) {
        const bool ta = opa == CUBLAS_OP_T, tb = opb == CUBLAS_OP_T;
        const int a_rows = ta ? k : m, a_cols = ta ? m : k, b_rows = tb ? n : k, b_cols = tb ? k : n;
        const int lda = a_rows + 3, ldb = b_rows + 1, ldc = m + 2;
        std::vector<float> A = RandomFloats(static_cast<size_t>(lda) * a_cols, 1 + opa * 2 + opb);
        std::vector<float> B = RandomFloats(static_cast<size_t>(ldb) * b_cols, 11 + opa * 2 + opb);
        std::vector<float> C0 = RandomFloats(static_cast<size_t>(ldc) * n, 21);
        if (beta == 0.0f) C0.assign(C0.size(), std::nanf(""));  // beta == 0: C is not read
        const float alpha = 1.5f;

        // bf16 inputs: the reference sees the rounded values.
        std::vector<uint16_t> A16(A.size()), B16(B.size());
        std::vector<float> Ar(A.size()), Br(B.size());
        for (size_t i = 0; i < A.size(); ++i) Ar[i] = FromBf16(A16[i] = ToBf16(A[i]));
        for (size_t i = 0; i < B.size(); ++i) Br[i] = FromBf16(B16[i] = ToBf16(B[i]));
        DevVec<uint16_t> dA(*dev, A16), dB(*dev, B16);
        DevVec<float> dC(*dev, C0);
        REQUIRE(cublasGemmEx(cb.h, opa, opb, m, n, k, &alpha, dA.ptr, CUDA_R_16BF, lda, dB.ptr, CUDA_R_16BF, ldb, &beta,
                             dC.ptr, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F,
                             CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
        std::vector<float> got = dC.Get();
        CheckClose(got, Reference(ta, tb, m, n, k, alpha, Ar, lda, Br, ldb, beta, C0, ldc), m, n, ldc, 1e-4,
                   "GemmEx bf16");
        for (int j = 0; j < n; ++j)  // the padding rows of C are untouched
          for (int i = m; i < ldc; ++i) CHECK(std::memcmp(&got[i + j * ldc], &C0[i + j * ldc], 4) == 0);

        // fp32 Sgemm on the unrounded inputs.
        DevVec<float> fA(*dev, A), fB(*dev, B), fC(*dev, C0);
        REQUIRE(cublasSgemm(cb.h, opa, opb, m, n, k, &alpha, static_cast<const float*>(fA.ptr), lda,
                            static_cast<const float*>(fB.ptr), ldb, &beta, static_cast<float*>(fC.ptr),
                            ldc) == CUBLAS_STATUS_SUCCESS);
        CheckClose(fC.Get(), Reference(ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C0, ldc), m, n, ldc, 1e-4,
                   "Sgemm");

        // fp32 data with CUBLAS_COMPUTE_32F_FAST_16BF: the inputs are rounded to bf16 first.
        DevVec<float> gC(*dev, C0);
        REQUIRE(cublasGemmEx(cb.h, opa, opb, m, n, k, &alpha, fA.ptr, CUDA_R_32F, lda, fB.ptr, CUDA_R_32F, ldb, &beta,
                             gC.ptr, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F_FAST_16BF,
                             CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
        CheckClose(gC.Get(), Reference(ta, tb, m, n, k, alpha, Ar, lda, Br, ldb, beta, C0, ldc), m, n, ldc, 1e-4,
                   "GemmEx fp32 FAST_16BF");
      }
    }
  }
}

TEST_CASE("cublas emulation: bf16 output, strided batches, k == 0 and alpha == 0") {
  auto dev = MakeDevice();
  Cublas cb;
  const int m = 13, n = 9, k = 21;
  std::vector<float> A = RandomFloats(static_cast<size_t>(m) * k, 5), B = RandomFloats(static_cast<size_t>(k) * n, 6);
  std::vector<uint16_t> A16(A.size()), B16(B.size());
  for (size_t i = 0; i < A.size(); ++i) A[i] = FromBf16(A16[i] = ToBf16(A[i]));
  for (size_t i = 0; i < B.size(); ++i) B[i] = FromBf16(B16[i] = ToBf16(B[i]));
  DevVec<uint16_t> dA(*dev, A16), dB(*dev, B16);
  const float alpha = 1.0f, beta = 0.0f;

  // bf16 C: the fp32 result rounded once to bf16.
  DevVec<uint16_t> dC(*dev, std::vector<uint16_t>(static_cast<size_t>(m) * n, 0));
  REQUIRE(cublasGemmEx(cb.h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, dA.ptr, CUDA_R_16BF, m, dB.ptr, CUDA_R_16BF, k,
                       &beta, dC.ptr, CUDA_R_16BF, m, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  const Ref ref = Reference(false, false, m, n, k, alpha, A, m, B, k, beta, {}, m);
  const std::vector<uint16_t> c16 = dC.Get();
  for (size_t i = 0; i < c16.size(); ++i) {
    CHECK(std::fabs(FromBf16(c16[i]) - ref.c[i]) <= std::ldexp(1.0, -8) * std::fabs(ref.c[i]) + 1e-6 * ref.mag[i]);
  }

  // Three batches with strides (A's batches overlap: stride smaller than a matrix is allowed).
  const int batches = 3;
  const long long sa = 7, sb = static_cast<long long>(k) * n + 5, sc = static_cast<long long>(m) * n + 4;
  std::vector<float> BA = RandomFloats(static_cast<size_t>(sa * (batches - 1) + m * k), 7);
  std::vector<float> BB = RandomFloats(static_cast<size_t>(sb * batches), 8);
  std::vector<float> BC = RandomFloats(static_cast<size_t>(sc * batches), 9);
  DevVec<float> bA(*dev, BA), bB(*dev, BB), bC(*dev, BC);
  const float half = 0.5f;
  REQUIRE(cublasGemmStridedBatchedEx(cb.h, CUBLAS_OP_N, CUBLAS_OP_T, m, n, k, &alpha, bA.ptr, CUDA_R_32F, m, sa, bB.ptr,
                                     CUDA_R_32F, n, sb, &half, bC.ptr, CUDA_R_32F, m, sc, batches, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  const std::vector<float> got = bC.Get();
  for (int t = 0; t < batches; ++t) {
    std::vector<float> a(BA.begin() + t * sa, BA.begin() + t * sa + m * k);
    std::vector<float> b(BB.begin() + t * sb, BB.begin() + t * sb + k * n);
    std::vector<float> c(BC.begin() + t * sc, BC.begin() + t * sc + m * n);
    std::vector<float> g(got.begin() + t * sc, got.begin() + t * sc + m * n);
    CheckClose(g, Reference(false, true, m, n, k, alpha, a, m, b, n, half, c, m), m, n, m, 1e-4, "strided batch");
    for (long long i = m * n; i < sc && t + 1 < batches; ++i) CHECK(got[t * sc + i] == BC[t * sc + i]);
  }

  // k == 0 and alpha == 0: C = beta C, A and B are not read (here: not even valid memory).
  std::vector<float> C0 = RandomFloats(static_cast<size_t>(m) * n, 10);
  DevVec<float> zC(*dev, C0);
  const float two = 2.0f, zero = 0.0f;
  int host_dummy = 0;
  REQUIRE(cublasGemmEx(cb.h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, 0, &alpha, &host_dummy, CUDA_R_32F, m, &host_dummy,
                       CUDA_R_32F, 1, &two, zC.ptr, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  std::vector<float> z = zC.Get();
  for (size_t i = 0; i < z.size(); ++i) CHECK(z[i] == 2.0f * C0[i]);
  REQUIRE(cublasGemmEx(cb.h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &zero, &host_dummy, CUDA_R_32F, m, &host_dummy,
                       CUDA_R_32F, k, &zero, zC.ptr, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  for (float x : zC.Get()) CHECK(x == 0.0f);
  // m == 0 / n == 0 / batchCount == 0: nothing to do.
  CHECK(cublasGemmEx(cb.h, CUBLAS_OP_N, CUBLAS_OP_N, 0, n, k, &alpha, nullptr, CUDA_R_32F, 1, nullptr, CUDA_R_32F, k,
                     &beta, nullptr, CUDA_R_32F, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
}

TEST_CASE("cublas emulation: a training-sized GEMM") {
  auto dev = MakeDevice();
  Cublas cb;
  const int m = 384, n = 1024, k = 128;  // e.g. (B*T = 1024) x (C = 128) @ (128 x 3C = 384), column-major
  std::vector<uint16_t> A16(static_cast<size_t>(k) * m), B16(static_cast<size_t>(k) * n);
  std::vector<float> A(A16.size()), B(B16.size());
  std::vector<float> ra = RandomFloats(A.size(), 31), rb = RandomFloats(B.size(), 32);
  for (size_t i = 0; i < A.size(); ++i) A[i] = FromBf16(A16[i] = ToBf16(ra[i]));
  for (size_t i = 0; i < B.size(); ++i) B[i] = FromBf16(B16[i] = ToBf16(rb[i]));
  DevVec<uint16_t> dA(*dev, A16), dB(*dev, B16);
  DevVec<float> dC(*dev, std::vector<float>(static_cast<size_t>(m) * n, 0.0f));
  const float alpha = 1.0f, beta = 0.0f;
  REQUIRE(cublasGemmEx(cb.h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, dA.ptr, CUDA_R_16BF, k, dB.ptr, CUDA_R_16BF, k,
                       &beta, dC.ptr, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  const std::vector<float> got = dC.Get();
  std::mt19937 rng(3);
  for (int s = 0; s < 500; ++s) {  // sampled entries against the double reference
    const int i = static_cast<int>(rng() % m), j = static_cast<int>(rng() % n);
    double acc = 0, mag = 0;
    for (int p = 0; p < k; ++p) {
      const double v = static_cast<double>(A[p + static_cast<size_t>(i) * k]) * B[p + static_cast<size_t>(j) * k];
      acc += v;
      mag += std::fabs(v);
    }
    CHECK(std::fabs(got[i + static_cast<size_t>(j) * m] - acc) <= 1e-4 * std::fabs(acc) + 1e-6 * mag);
  }
}

TEST_CASE("cublas emulation: argument checks and status codes") {
  auto dev = MakeDevice();
  Cublas cb;
  const int m = 8, n = 6, k = 5;
  DevVec<float> A(*dev, RandomFloats(64, 1)), B(*dev, RandomFloats(64, 2)), C(*dev, RandomFloats(64, 3));
  const float one = 1.0f, zero = 0.0f;
  auto gemm = [&](cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int mm, int nn, int kk, int lda,
                  int ldb, int ldc, cudaDataType at = CUDA_R_32F, cudaDataType bt = CUDA_R_32F,
                  cudaDataType ct = CUDA_R_32F, cublasComputeType_t comp = CUBLAS_COMPUTE_32F, const void* a = nullptr,
                  const float* alpha = nullptr) {
    return cublasGemmEx(h, ta, tb, mm, nn, kk, alpha ? alpha : &one, a ? a : A.ptr, at, lda, B.ptr, bt, ldb, &zero,
                        C.ptr, ct, ldc, comp, CUBLAS_GEMM_DEFAULT);
  };
  const auto N = CUBLAS_OP_N, T = CUBLAS_OP_T;
  CHECK(gemm(cb.h, N, N, m, n, k, m, k, m) == CUBLAS_STATUS_SUCCESS);
  CHECK(gemm(cb.h, CUBLAS_OP_C, N, m, n, k, k, k, m) == CUBLAS_STATUS_SUCCESS);  // C = T for real types
  // Handles.
  CHECK(gemm(nullptr, N, N, m, n, k, m, k, m) == CUBLAS_STATUS_NOT_INITIALIZED);
  CHECK(cublasCreate(nullptr) == CUBLAS_STATUS_INVALID_VALUE);
  CHECK(cublasDestroy(nullptr) == CUBLAS_STATUS_NOT_INITIALIZED);
  cublasHandle_t gone = nullptr;
  REQUIRE(cublasCreate(&gone) == CUBLAS_STATUS_SUCCESS);
  REQUIRE(cublasDestroy(gone) == CUBLAS_STATUS_SUCCESS);
  CHECK(gemm(gone, N, N, m, n, k, m, k, m) == CUBLAS_STATUS_NOT_INITIALIZED);
  // Sizes and leading dimensions.
  CHECK(gemm(cb.h, N, N, -1, n, k, m, k, m) == CUBLAS_STATUS_INVALID_VALUE);
  CHECK(gemm(cb.h, N, N, m, -1, k, m, k, m) == CUBLAS_STATUS_INVALID_VALUE);
  CHECK(gemm(cb.h, N, N, m, n, -1, m, k, m) == CUBLAS_STATUS_INVALID_VALUE);
  CHECK(gemm(cb.h, N, N, m, n, k, m - 1, k, m) == CUBLAS_STATUS_INVALID_VALUE);            // lda < m
  CHECK(gemm(cb.h, T, N, m, n, k, k - 1, k, m) == CUBLAS_STATUS_INVALID_VALUE);            // lda < k (transposed)
  CHECK(gemm(cb.h, N, N, m, n, k, m, k - 1, m) == CUBLAS_STATUS_INVALID_VALUE);            // ldb < k
  CHECK(gemm(cb.h, N, T, m, n, k, m, n - 1, m) == CUBLAS_STATUS_INVALID_VALUE);            // ldb < n (transposed)
  CHECK(gemm(cb.h, N, N, m, n, k, m, k, m - 1) == CUBLAS_STATUS_INVALID_VALUE);            // ldc < m
  CHECK(gemm(cb.h, N, N, 0, n, k, 0, k, 0) == CUBLAS_STATUS_INVALID_VALUE);                // ld >= 1 even when empty
  CHECK(gemm(cb.h, CUBLAS_OP_CONJG, N, m, n, k, m, k, m) == CUBLAS_STATUS_INVALID_VALUE);  // a placeholder in cuBLAS
  CHECK(cublasGemmStridedBatchedEx(cb.h, N, N, m, n, k, &one, A.ptr, CUDA_R_32F, m, 0, B.ptr, CUDA_R_32F, k, 0, &zero,
                                   C.ptr, CUDA_R_32F, m, 0, -1, CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_INVALID_VALUE);
  // Type combinations.
  CHECK(gemm(cb.h, N, N, m, n, k, m, k, m, CUDA_R_16BF, CUDA_R_32F) == CUBLAS_STATUS_NOT_SUPPORTED);
  CHECK(gemm(cb.h, N, N, m, n, k, m, k, m, CUDA_R_32F, CUDA_R_32F, CUDA_R_16BF) == CUBLAS_STATUS_NOT_SUPPORTED);
  CHECK(gemm(cb.h, N, N, m, n, k, m, k, m, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_16BF) ==
        CUBLAS_STATUS_NOT_SUPPORTED);
  CHECK(gemm(cb.h, N, N, m, n, k, m, k, m, CUDA_R_16F, CUDA_R_16F) == CUBLAS_STATUS_NOT_SUPPORTED);
  CHECK(gemm(cb.h, N, N, m, n, k, m, k, m, CUDA_R_32F, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_16F) ==
        CUBLAS_STATUS_NOT_SUPPORTED);
  CHECK(gemm(cb.h, N, N, m, n, k, m, k, m, CUDA_R_32F, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32) ==
        CUBLAS_STATUS_NOT_SUPPORTED);
  CHECK(gemm(cb.h, N, N, m, n, k, m, k, m, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, CUBLAS_COMPUTE_32F_PEDANTIC) ==
        CUBLAS_STATUS_SUCCESS);
  // Memory that is not device memory, or too small for the leading dimension: the GPU would fault.
  std::vector<float> host(64);
  CHECK(gemm(cb.h, N, N, m, n, k, m, k, m, CUDA_R_32F, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F, host.data()) ==
        CUBLAS_STATUS_EXECUTION_FAILED);
  CHECK(gemm(cb.h, N, N, m, n, k, 60, k, m) == CUBLAS_STATUS_EXECUTION_FAILED);  // A spans 4*60+8 floats > 64
  // alpha/beta through the pointer mode.
  CHECK(gemm(cb.h, N, N, m, n, k, m, k, m, CUDA_R_32F, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F, nullptr,
             static_cast<const float*>(C.ptr)) == CUBLAS_STATUS_INVALID_VALUE);  // device alpha, HOST mode
  REQUIRE(cublasSetPointerMode(cb.h, CUBLAS_POINTER_MODE_DEVICE) == CUBLAS_STATUS_SUCCESS);
  DevVec<float> dev_one(*dev, std::vector<float>{1.0f});
  CHECK(cublasGemmEx(cb.h, N, N, m, n, k, dev_one.ptr, A.ptr, CUDA_R_32F, m, B.ptr, CUDA_R_32F, k, C.ptr, C.ptr,
                     CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  CHECK(gemm(cb.h, N, N, m, n, k, m, k, m) == CUBLAS_STATUS_EXECUTION_FAILED);  // host alpha, DEVICE mode
  cublasPointerMode_t mode;
  REQUIRE(cublasGetPointerMode(cb.h, &mode) == CUBLAS_STATUS_SUCCESS);
  CHECK(mode == CUBLAS_POINTER_MODE_DEVICE);
  REQUIRE(cublasSetPointerMode(cb.h, CUBLAS_POINTER_MODE_HOST) == CUBLAS_STATUS_SUCCESS);
  // A destroyed stream.
  auto stream = dev->CreateStream();
  REQUIRE(cublasSetStream(cb.h, NativeStream(*stream)) == CUBLAS_STATUS_SUCCESS);
  stream.reset();
  CHECK(gemm(cb.h, N, N, m, n, k, m, k, m) == CUBLAS_STATUS_EXECUTION_FAILED);
  REQUIRE(cublasSetStream(cb.h, nullptr) == CUBLAS_STATUS_SUCCESS);
  CHECK(gemm(cb.h, N, N, m, n, k, m, k, m) == CUBLAS_STATUS_SUCCESS);

  // Math modes, workspace, status strings.
  CHECK(cublasSetMathMode(cb.h, CUBLAS_DEFAULT_MATH) == CUBLAS_STATUS_SUCCESS);
  CHECK(cublasSetMathMode(cb.h, static_cast<cublasMath_t>(CUBLAS_TF32_TENSOR_OP_MATH |
                                                          CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)) ==
        CUBLAS_STATUS_SUCCESS);
  cublasMath_t math;
  REQUIRE(cublasGetMathMode(cb.h, &math) == CUBLAS_STATUS_SUCCESS);
  CHECK(math == (CUBLAS_TF32_TENSOR_OP_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
  CHECK(cublasSetMathMode(cb.h, static_cast<cublasMath_t>(5)) == CUBLAS_STATUS_INVALID_VALUE);
  CHECK(cublasSetMathMode(nullptr, CUBLAS_DEFAULT_MATH) == CUBLAS_STATUS_NOT_INITIALIZED);
  void* ws = MustAlloc(*dev, 4096);
  CHECK(cublasSetWorkspace(cb.h, ws, 4096) == CUBLAS_STATUS_SUCCESS);
  CHECK(cublasSetWorkspace(cb.h, static_cast<char*>(ws) + 16, 1024) == CUBLAS_STATUS_INVALID_VALUE);  // alignment
  CHECK(cublasSetWorkspace(cb.h, host.data(), 0) == CUBLAS_STATUS_SUCCESS);                           // none
  CHECK(cublasSetWorkspace(nullptr, ws, 4096) == CUBLAS_STATUS_NOT_INITIALIZED);
  dev->Free(ws);
  CHECK(std::string(cublasGetStatusString(CUBLAS_STATUS_SUCCESS)) == "the operation completed successfully");
  CHECK(std::string(cublasGetStatusString(CUBLAS_STATUS_NOT_SUPPORTED)) ==
        "the functionality requested is not supported");
  CHECK(std::string(cublasGetStatusName(CUBLAS_STATUS_INVALID_VALUE)) == "CUBLAS_STATUS_INVALID_VALUE");
}

// ---- cuBLASLt subset -----------------------------------------------------------------------------------------

// One cublasLtMatmul problem: D (m, n) = epilogue(op(A) B), A stored (k, m) (op T), B (k, n), bf16, column-major.
struct LtCall {
  cublasLtHandle_t h = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  LtCall(int m, int n, int k, cudaDataType dtype, cublasLtEpilogue_t epi) {
    REQUIRE(cublasLtCreate(&h) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS);
    const cublasOperation_t t = CUBLAS_OP_T;
    REQUIRE(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi) ==
            CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, k, m, k) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, k, n, k) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasLtMatrixLayoutCreate(&d, dtype, m, n, m) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS);
  }
  ~LtCall() {
    CHECK(cublasLtMatmulPreferenceDestroy(pref) == CUBLAS_STATUS_SUCCESS);
    CHECK(cublasLtMatrixLayoutDestroy(d) == CUBLAS_STATUS_SUCCESS);
    CHECK(cublasLtMatrixLayoutDestroy(b) == CUBLAS_STATUS_SUCCESS);
    CHECK(cublasLtMatrixLayoutDestroy(a) == CUBLAS_STATUS_SUCCESS);
    CHECK(cublasLtMatmulDescDestroy(desc) == CUBLAS_STATUS_SUCCESS);
    CHECK(cublasLtDestroy(h) == CUBLAS_STATUS_SUCCESS);
  }
  template <class T>
  cublasStatus_t Set(cublasLtMatmulDescAttributes_t attr, const T& v) {
    return cublasLtMatmulDescSetAttribute(desc, attr, &v, sizeof v);
  }
  // The heuristic's answer (count of algorithms), and the matmul with its algorithm when there is one.
  int Algos(cublasLtMatmulHeuristicResult_t* r) {
    int found = -1;
    (void)cublasLtMatmulAlgoGetHeuristic(h, desc, a, b, d, d, pref, 1, r, &found);
    return found;
  }
  cublasStatus_t Run(const void* A, const void* B, void* D) {
    cublasLtMatmulHeuristicResult_t r{};
    if (Algos(&r) != 1) return CUBLAS_STATUS_NOT_SUPPORTED;
    const float one = 1.0f, zero = 0.0f;
    return cublasLtMatmul(h, desc, &one, A, a, B, b, &zero, D, d, D, d, &r.algo, nullptr, 0, nullptr);
  }
};

// The emulated cuBLASLt: its DEFAULT epilogue is cublasGemmEx to the bit (the same fp32 sums, rounded once); the
// GELU_AUX_BIAS epilogue stores v = sum + bias (bf16: D's type) as the aux matrix (to the bit) and gelu(v) as D; DGELU
// multiplies the sum by gelu'(aux) — against cublasGemmEx's fp32 sums and the reference GeLU (within one bf16 step).
// Refused as cuBLASLt documents: an aux leading dimension not a multiple of 8, a bias of another type than D's, fp32 A
// and B (NOT_SUPPORTED, no algorithm), and a D pointer aligned less than the algorithm was chosen for (INVALID_VALUE).
TEST_CASE("cublaslt emulation: the DEFAULT, GELU_AUX_BIAS and DGELU epilogues, and what it refuses") {
  auto dev = MakeDevice();
  Cublas cb;
  const int m = 24, n = 13, k = 19;
  std::vector<float> A = RandomFloats(static_cast<size_t>(k) * m, 71), B = RandomFloats(static_cast<size_t>(k) * n, 72);
  const std::vector<float> bias = RandomFloats(m, 73);
  std::vector<uint16_t> A16(A.size()), B16(B.size()), bias16(m);
  for (size_t i = 0; i < A.size(); ++i) A16[i] = ToBf16(A[i]);
  for (size_t i = 0; i < B.size(); ++i) B16[i] = ToBf16(B[i]);
  for (int i = 0; i < m; ++i) bias16[i] = ToBf16(bias[i]);
  DevVec<uint16_t> dA(*dev, A16), dB(*dev, B16), dbias(*dev, bias16);
  const size_t mn = static_cast<size_t>(m) * n;
  const float one = 1.0f, zero = 0.0f;
  // cublasGemmEx's fp32 sums and bf16 output, for comparison.
  DevVec<float> sum(*dev, std::vector<float>(mn));
  DevVec<uint16_t> sum16(*dev, std::vector<uint16_t>(mn));
  REQUIRE(cublasGemmEx(cb.h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, dA.ptr, CUDA_R_16BF, k, dB.ptr, CUDA_R_16BF, k,
                       &zero, sum.ptr, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  REQUIRE(cublasGemmEx(cb.h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, dA.ptr, CUDA_R_16BF, k, dB.ptr, CUDA_R_16BF, k,
                       &zero, sum16.ptr, CUDA_R_16BF, m, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  const std::vector<float> s = sum.Get();
  auto gelu = [](float v) {  // the reference ops, in double
    float out = 0;
    ops::ref::GeluForward(&out, &v, 1);
    return out;
  };
  auto gelu_grad = [](float v) {
    float dx = 0;
    const float one = 1.0f;
    ops::ref::GeluBackward(&dx, &v, &one, 1);
    return dx;
  };
  // got (bf16) is want rounded to bf16, give or take the fp32 arithmetic of the epilogue: within one bf16 step.
  auto near = [](uint16_t got, float want) {
    return std::fabs(FromBf16(got) - want) <= std::ldexp(1.0f, -7) * std::fabs(want) + 1e-6f;
  };
  {
    LtCall lt(m, n, k, CUDA_R_16BF, CUBLASLT_EPILOGUE_DEFAULT);
    DevVec<uint16_t> d(*dev, std::vector<uint16_t>(mn, 0xFFFF));
    REQUIRE(lt.Run(dA.ptr, dB.ptr, d.ptr) == CUBLAS_STATUS_SUCCESS);
    CHECK(d.Get() == sum16.Get());
  }
  DevVec<uint16_t> aux(*dev, std::vector<uint16_t>(mn, 0xFFFF));
  {
    LtCall lt(m, n, k, CUDA_R_16BF, CUBLASLT_EPILOGUE_GELU_AUX_BIAS);
    REQUIRE(lt.Set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(dbias.ptr)) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(lt.Set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux.ptr) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(lt.Set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, int64_t{m}) == CUBLAS_STATUS_SUCCESS);
    DevVec<uint16_t> d(*dev, std::vector<uint16_t>(mn, 0xFFFF));
    REQUIRE(lt.Run(dA.ptr, dB.ptr, d.ptr) == CUBLAS_STATUS_SUCCESS);
    const std::vector<uint16_t> got = d.Get(), got_aux = aux.Get();
    for (size_t i = 0; i < mn; ++i) {
      const float v = s[i] + FromBf16(bias16[i % m]);
      CHECK(got_aux[i] == ToBf16(v));
      CHECK(near(got[i], gelu(v)));
    }
    // Refused: an aux leading dimension not a multiple of 8; a bias in fp32 next to a bf16 D.
    cublasLtMatmulHeuristicResult_t r{};
    REQUIRE(lt.Set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, int64_t{m + 4}) == CUBLAS_STATUS_SUCCESS);
    CHECK(lt.Algos(&r) == 0);
    REQUIRE(lt.Set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, int64_t{m}) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(lt.Set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, int32_t{CUDA_R_32F}) == CUBLAS_STATUS_SUCCESS);
    CHECK(lt.Algos(&r) == 0);
  }
  {
    LtCall lt(m, n, k, CUDA_R_16BF, CUBLASLT_EPILOGUE_DGELU);
    REQUIRE(lt.Set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux.ptr) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(lt.Set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, int64_t{m}) == CUBLAS_STATUS_SUCCESS);
    DevVec<uint16_t> d(*dev, std::vector<uint16_t>(mn, 0xFFFF));
    REQUIRE(lt.Run(dA.ptr, dB.ptr, d.ptr) == CUBLAS_STATUS_SUCCESS);
    const std::vector<uint16_t> got = d.Get(), got_aux = aux.Get();
    for (size_t i = 0; i < mn; ++i) CHECK(near(got[i], s[i] * gelu_grad(FromBf16(got_aux[i]))));
    // A D pointer 2 bytes off the 256-byte alignment an algorithm chosen without a preference assumes: refused.
    cublasLtMatmulHeuristicResult_t r{};
    REQUIRE(lt.Algos(&r) == 1);
    CHECK(cublasLtMatmul(lt.h, lt.desc, &one, dA.ptr, lt.a, dB.ptr, lt.b, &zero, static_cast<uint16_t*>(d.ptr) + 1,
                         lt.d, static_cast<uint16_t*>(d.ptr) + 1, lt.d, &r.algo, nullptr, 0,
                         nullptr) == CUBLAS_STATUS_INVALID_VALUE);
  }
  {  // fp32 A and B: not emulated (the backend's epilogue GEMMs are bf16).
    LtCall lt(m, n, k, CUDA_R_32F, CUBLASLT_EPILOGUE_DEFAULT);
    REQUIRE(cublasLtMatrixLayoutDestroy(lt.a) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasLtMatrixLayoutCreate(&lt.a, CUDA_R_32F, k, m, k) == CUBLAS_STATUS_SUCCESS);
    cublasLtMatmulHeuristicResult_t r{};
    CHECK(lt.Algos(&r) == 0);
  }
}

TEST_CASE("emulated runtime: device queries, host functions, events") {
  cudaDeviceProp prop{};
  REQUIRE(cudaGetDeviceProperties(&prop, 0) == cudaSuccess);
  CHECK(std::string(prop.name) == "megascale SIMT emulator (CPU)");
  CHECK(prop.warpSize == 32);
  CHECK(prop.totalGlobalMem > 0);
  CHECK(cudaGetDeviceProperties(&prop, 1) == cudaErrorInvalidDevice);
  CHECK(cudaGetLastError() == cudaErrorInvalidDevice);
  int v = 0;
  REQUIRE(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0) == cudaSuccess);
  CHECK(v == 227 * 1024);
  REQUIRE(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, 0) == cudaSuccess);
  CHECK(v >= 1);
  size_t free_bytes = 0, total = 0;
  REQUIRE(cudaMemGetInfo(&free_bytes, &total) == cudaSuccess);
  CHECK(total == prop.totalGlobalMem);
  CHECK(free_bytes <= total);

  cudaStream_t s;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  int calls = 0;
  REQUIRE(cudaLaunchHostFunc(
              s, [](void* p) { ++*static_cast<int*>(p); }, &calls) == cudaSuccess);
  CHECK(calls == 1);
  cudaEvent_t e;
  REQUIRE(cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess);
  REQUIRE(cudaEventRecord(e, s) == cudaSuccess);
  CHECK(cudaEventQuery(e) == cudaSuccess);
  CHECK(cudaStreamWaitEvent(s, e, 0) == cudaSuccess);
  CHECK(cudaEventSynchronize(e) == cudaSuccess);
  CHECK(cudaStreamQuery(s) == cudaSuccess);
  // CUDA calls from a host function are forbidden: the emulator makes them fail.
  struct Inside {
    cudaError_t malloc_result = cudaSuccess, record_result = cudaSuccess;
    bool flagged = false;
    cudaStream_t stream;
    cudaEvent_t event;
  } inside{cudaSuccess, cudaSuccess, false, s, e};
  REQUIRE(cudaLaunchHostFunc(
              s,
              [](void* p) {
                auto* in = static_cast<Inside*>(p);
                void* q = nullptr;
                in->malloc_result = cudaMalloc(&q, 16);
                in->record_result = cudaEventRecord(in->event, in->stream);
                in->flagged = sim::InHostFunction();
              },
              &inside) == cudaSuccess);
  CHECK(inside.malloc_result == cudaErrorNotPermitted);
  CHECK(inside.record_result == cudaErrorNotPermitted);
  CHECK(inside.flagged);
  CHECK_FALSE(sim::InHostFunction());
  CHECK(cudaGetLastError() == cudaErrorNotPermitted);
  REQUIRE(cudaEventDestroy(e) == cudaSuccess);
  CHECK(cudaEventQuery(e) == cudaErrorInvalidResourceHandle);  // destroyed
  CHECK(cudaEventDestroy(e) == cudaErrorInvalidResourceHandle);
  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
  CHECK(cudaLaunchHostFunc(
            s, [](void*) {}, nullptr) == cudaErrorInvalidResourceHandle);
  CHECK(std::string(cudaGetErrorName(cudaErrorNotReady)) == "cudaErrorNotReady");
  CHECK(std::string(cudaGetErrorString(cudaErrorNoDevice)) == "no CUDA-capable device is detected");
  (void)cudaGetLastError();

  void* p = nullptr;
  sim::FailNextMallocs(1);
  CHECK(cudaMalloc(&p, 16) == cudaErrorMemoryAllocation);
  CHECK(cudaGetLastError() == cudaErrorMemoryAllocation);
  REQUIRE(cudaMalloc(&p, 16) == cudaSuccess);
  CHECK(sim::IsDeviceRange(p, 16));
  CHECK_FALSE(sim::IsDeviceRange(p, 17));
  CHECK(sim::IsDeviceRange(static_cast<char*>(p) + 8, 8));
  CHECK_FALSE(sim::IsDeviceRange(&v, 4));
  REQUIRE(cudaFree(p) == cudaSuccess);
  CHECK_FALSE(sim::IsDeviceRange(p, 1));
}

}  // namespace
}  // namespace ms::cuda
