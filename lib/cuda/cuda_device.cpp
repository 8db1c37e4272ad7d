// The CUDA Device (lib/cuda/cuda.h): memory from a caching allocator on cudaMalloc, non-blocking cudaStreams,
// cudaEvents. Built twice from this one source: against libcudart (ms_cuda_gpu) and against the SIMT emulator's
// runtime subset (ms_cuda_sim, MS_CUDA_FLAVOR_EMULATED=1, where "device" memory is host memory and streams run
// eagerly). docs/cuda.md, "The CUDA device and the cuBLAS subset", describes the design.
//
// Allocator: requests are rounded up (512 B below 1 MiB, 2 MiB granules above); a freed block goes to a
// size-ordered free list (std::multimap) and serves a later request of at most its size and at least half of it
// (blocks are not split). Frees are stream-safe: a block freed while streams of this device exist is reused
// only after the work enqueued on them before the Free has completed (an event per live stream, polled at the
// next Alloc). When cudaMalloc fails, pending blocks are waited for, every cached block is returned with
// cudaFree, and the allocation is retried once.
//
// Calls that cannot return an error through the Device interface (Free, Stream and Event methods) log a CUDA
// failure and keep it: the next Alloc, Copy or Memset of the device returns it (the first one only).
// CreateStream and RecordEvent, which must return an object, abort the process if CUDA cannot create one even
// after the cache is released (the context is unusable then).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cuda/cuda.h"

#if MS_CUDA_FLAVOR_EMULATED && defined(__has_include)
#if __has_include(<sanitizer/asan_interface.h>)
#include <sanitizer/asan_interface.h>  // no-op macros without AddressSanitizer
#endif
#endif
#ifndef ASAN_POISON_MEMORY_REGION
#define ASAN_POISON_MEMORY_REGION(addr, size) ((void)(addr), (void)(size))
#define ASAN_UNPOISON_MEMORY_REGION(addr, size) ((void)(addr), (void)(size))
#endif

namespace ms::cuda {
namespace {

constexpr size_t kSmallLimit = size_t{1} << 20;  // below: 512-byte rounding; above: 2 MiB granules
constexpr size_t kSmallRound = 512;
constexpr size_t kLargeRound = size_t{2} << 20;
constexpr size_t kMaxRequest = size_t{1} << 62;

std::string ErrorText(cudaError_t e) {
  return fmt::format("{} ({})", cudaGetErrorName(e), cudaGetErrorString(e));
}

size_t RoundSize(size_t bytes) {
  bytes = std::max<size_t>(bytes, 1);
  const size_t unit = bytes < kSmallLimit ? kSmallRound : kLargeRound;
  return (bytes + unit - 1) / unit * unit;
}

// In the emulated build, device memory is host memory: a block handed out again is refilled with 0xFF (as the
// emulator's cudaMalloc fills fresh memory), and under AddressSanitizer cached blocks and the rounding tail of a
// block in use are poisoned, so that use after Free and overflows past the requested size are reported.
void OnHandOut([[maybe_unused]] void* p, [[maybe_unused]] size_t bytes, [[maybe_unused]] size_t block,
               [[maybe_unused]] bool reused) {
#if MS_CUDA_FLAVOR_EMULATED
  ASAN_UNPOISON_MEMORY_REGION(p, bytes);
  if (reused) std::memset(p, 0xFF, bytes);
  ASAN_POISON_MEMORY_REGION(static_cast<char*>(p) + bytes, block - bytes);
#endif
}
void OnCache([[maybe_unused]] void* p, [[maybe_unused]] size_t block) {
#if MS_CUDA_FLAVOR_EMULATED
  ASAN_POISON_MEMORY_REGION(p, block);
#endif
}
void OnRelease([[maybe_unused]] void* p, [[maybe_unused]] size_t block) {
#if MS_CUDA_FLAVOR_EMULATED
  ASAN_UNPOISON_MEMORY_REGION(p, block);
#endif
}

// A block freed while streams exist may still be read or written by work enqueued on them before the Free (legal:
// the block is reused only after that work). In the emulated build it is poisoned only when every stream has
// passed the Free: a host function enqueued on each (ahead of the release event, so the block cannot be handed
// out again before the last one ran) counts down, and the last one poisons it. Work enqueued after the Free that
// touches the block is reported; so is any touch once the streams have passed it.
#if MS_CUDA_FLAVOR_EMULATED
struct PoisonWhenPassed {
  void* p;
  size_t block;
  std::atomic<size_t> left;
  static void Arrive(void* self) {
    auto* w = static_cast<PoisonWhenPassed*>(self);
    if (w->left.fetch_sub(1) != 1) return;
    OnCache(w->p, w->block);
    delete w;
  }
};
// Enqueues the arrival of `w` on `stream` (in stream order); where it cannot (a capturing stream, an error) the
// stream counts as passed now.
void ArriveInStreamOrder(PoisonWhenPassed* w, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) == cudaSuccess && capture == cudaStreamCaptureStatusNone &&
      cudaLaunchHostFunc(stream, &PoisonWhenPassed::Arrive, w) == cudaSuccess) {
    return;
  }
  (void)cudaGetLastError();
  PoisonWhenPassed::Arrive(w);
}
#endif

// What a device shares with its streams and events (which may outlive it).
struct DeviceState {
  explicit DeviceState(int ordinal) : ordinal(ordinal) {}
  const int ordinal;
  std::mutex mu;
  std::vector<cudaStream_t> streams;  // live streams created by the device
  Status deferred;                    // the first failure of a call that could not return it

  // Logs a failure and keeps it for the next Status-returning call of the device.
  void Defer(const Status& s) {
    LogError("cuda:{}: {}", ordinal, s.message());
    std::lock_guard<std::mutex> lock(mu);
    if (deferred.ok()) deferred = s.WithContext("an earlier CUDA call failed");
  }
  void DeferCuda(cudaError_t e, std::string_view what) {
    Defer(Internal("{}: {}", what, ErrorText(e)));
    (void)cudaGetLastError();  // reported here; do not let it resurface in an unrelated check
  }
  Status TakeDeferred() {
    std::lock_guard<std::mutex> lock(mu);
    Status s = std::move(deferred);
    deferred = Status::Ok();
    return s;
  }
  Status MakeCurrent() const {
    cudaError_t e = cudaSetDevice(ordinal);
    if (e != cudaSuccess) return Internal("cudaSetDevice({}) failed: {}", ordinal, ErrorText(e));
    return Status::Ok();
  }
  std::vector<cudaStream_t> Streams() {
    std::lock_guard<std::mutex> lock(mu);
    return streams;
  }
};

[[noreturn]] void Fatal(const std::string& message) {
  LogError("{}", message);
  std::abort();
}

class CudaEvent : public device::Event {
 public:
  CudaEvent(std::shared_ptr<DeviceState> state, cudaEvent_t event) : state_(std::move(state)), event_(event) {}
  ~CudaEvent() override {
    cudaError_t e = cudaEventDestroy(event_);
    if (e != cudaSuccess) state_->DeferCuda(e, "cudaEventDestroy");
  }
  bool Query() const override {
    cudaError_t e = cudaEventQuery(event_);
    if (e == cudaSuccess) return true;
    if (e == cudaErrorNotReady) return false;
    state_->DeferCuda(e, "cudaEventQuery");
    return true;  // it will never complete: do not let a poll loop spin forever
  }
  void Synchronize() override {
    cudaError_t e = cudaEventSynchronize(event_);
    if (e != cudaSuccess) state_->DeferCuda(e, "cudaEventSynchronize");
  }
  cudaEvent_t native() const { return event_; }

 private:
  std::shared_ptr<DeviceState> state_;
  cudaEvent_t event_;
};

class CudaStream : public device::Stream {
 public:
  CudaStream(std::shared_ptr<DeviceState> state, cudaStream_t stream) : state_(std::move(state)), stream_(stream) {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->streams.push_back(stream_);
  }
  ~CudaStream() override {
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      auto& v = state_->streams;
      v.erase(std::remove(v.begin(), v.end(), stream_), v.end());
    }
    // Work still enqueued completes; the stream's resources are released afterwards (CUDA semantics).
    cudaError_t e = cudaStreamDestroy(stream_);
    if (e != cudaSuccess) state_->DeferCuda(e, "cudaStreamDestroy");
  }

  void Enqueue(std::function<void()> fn) override {
    auto* heap = new std::function<void()>(std::move(fn));
    cudaError_t e = cudaLaunchHostFunc(stream_, &RunHostFunction, heap);
    if (e != cudaSuccess) {
      delete heap;
      state_->DeferCuda(e, "Stream::Enqueue: cudaLaunchHostFunc (the function was not run)");
    }
  }

  void WaitEvent(const std::shared_ptr<device::Event>& event) override {
    if (!event) return;
    if (auto* ce = dynamic_cast<CudaEvent*>(event.get())) {
      cudaError_t e = cudaStreamWaitEvent(stream_, ce->native(), 0);
      if (e != cudaSuccess) state_->DeferCuda(e, "Stream::WaitEvent: cudaStreamWaitEvent");
      return;
    }
    // An event of another device: the host waits for it, so that later work is enqueued after it completed.
    event->Synchronize();
  }

  void Synchronize() override {
    cudaError_t e = cudaStreamSynchronize(stream_);
    if (e != cudaSuccess) state_->DeferCuda(e, "Stream::Synchronize: cudaStreamSynchronize");
  }

  cudaStream_t native() const { return stream_; }

 private:
  static void CUDART_CB RunHostFunction(void* p) {
    std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(p));
    (*fn)();
  }

  std::shared_ptr<DeviceState> state_;
  cudaStream_t stream_;
};

class CudaDevice : public device::Device {
 public:
  CudaDevice(std::shared_ptr<DeviceState> state, std::string name, cudaStream_t copy_stream)
      : state_(std::move(state)), name_(std::move(name)), copy_stream_(copy_stream) {}

  ~CudaDevice() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!in_use_.empty()) {
      LogWarn("{}: {} block(s), {} bytes, still allocated when the device is destroyed; returning them", name_,
              in_use_.size(), stats_.bytes_in_use);
    }
    if (Status s = state_->MakeCurrent(); !s.ok()) LogError("{}: {}", name_, s.message());
    for (auto& [ptr, block] : in_use_) {
      OnCache(ptr, block.size);
      free_.emplace(block.size, ptr);
      stats_.bytes_cached += block.size;
    }
    in_use_.clear();
    stats_.bytes_in_use = 0;
    CollectPendingLocked(/*wait=*/true);
    ReleaseCachedLocked();
    for (cudaEvent_t e : spare_events_) {
      cudaError_t err = cudaEventDestroy(e);
      if (err != cudaSuccess) LogError("{}: cudaEventDestroy: {}", name_, ErrorText(err));
    }
    cudaError_t err = cudaStreamDestroy(copy_stream_);
    if (err != cudaSuccess) LogError("{}: cudaStreamDestroy: {}", name_, ErrorText(err));
  }

  std::string name() const override { return name_; }
  bool is_host() const override { return false; }

  Result<void*> Alloc(size_t bytes) override {
    MS_RETURN_IF_ERROR(state_->TakeDeferred());
    if (bytes > kMaxRequest) return InvalidArgument("{}: cannot allocate {} bytes (too large)", name_, bytes);
    const size_t size = RoundSize(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    CollectPendingLocked(/*wait=*/false);
    void* p = nullptr;
    size_t block = 0;
    bool reused = false;
    auto it = free_.lower_bound(size);
    if (it != free_.end() && it->first / 2 <= size) {  // at most twice the rounded request: no splitting
      block = it->first;
      p = it->second;
      free_.erase(it);
      stats_.bytes_cached -= block;
      ++stats_.cache_hits;
      reused = true;
    } else {
      MS_RETURN_IF_ERROR(state_->MakeCurrent());
      cudaError_t e = cudaMalloc(&p, size);
      if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();  // handled here
        const size_t cached = stats_.bytes_cached;
        CollectPendingLocked(/*wait=*/true);
        ReleaseCachedLocked();
        LogWarn("{}: cudaMalloc of {} bytes failed; released {} cached bytes and retrying", name_, size, cached);
        e = cudaMalloc(&p, size);
        if (e == cudaErrorMemoryAllocation) {
          (void)cudaGetLastError();
          return Internal(
              "{}: out of memory: cannot allocate {} bytes (rounded to {}): {}; {} bytes in use, {} "
              "cached (released before a retry){}",
              name_, bytes, size, ErrorText(e), stats_.bytes_in_use, stats_.bytes_cached, MemInfo());
        }
      }
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return Internal("{}: cudaMalloc of {} bytes (rounded to {}) failed: {}", name_, bytes, size, ErrorText(e));
      }
      block = size;
      ++stats_.cuda_mallocs;
      blocks_[p] = block;
    }
    in_use_[p] = Block{block, bytes};
    stats_.bytes_in_use += block;
    stats_.peak_in_use = std::max(stats_.peak_in_use, stats_.bytes_in_use);
    OnHandOut(p, bytes, block, reused);
    return p;
  }

  void Free(void* ptr) override {
    if (!ptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = in_use_.find(ptr);
    if (it == in_use_.end()) {
      if (blocks_.count(ptr)) {
        LogError("{}: Free of {} which is already free (double free; ignored)", name_, ptr);
      } else {
        LogError("{}: Free of {} which this device did not allocate (ignored)", name_, ptr);
      }
      return;
    }
    const size_t block = it->second.size;
    in_use_.erase(it);
    stats_.bytes_in_use -= block;
    stats_.bytes_cached += block;
    // Work already enqueued on any stream of the device may still use the block: it is reused only after
    // events recorded now on every live stream have completed (and, emulated, poisoned once they passed it).
    const std::vector<cudaStream_t> streams = state_->Streams();
    if (streams.empty()) {
      OnCache(ptr, block);
      free_.emplace(block, ptr);
      return;
    }
    Pending pending{ptr, block, {}};
    if (Status s = state_->MakeCurrent(); !s.ok()) state_->Defer(s);
#if MS_CUDA_FLAVOR_EMULATED
    auto* poison = new PoisonWhenPassed{ptr, block, streams.size()};
#endif
    for (cudaStream_t s : streams) {
#if MS_CUDA_FLAVOR_EMULATED
      ArriveInStreamOrder(poison, s);  // ahead of the event: its completion implies the arrival
#endif
      cudaEvent_t ev = nullptr;
      cudaError_t e = SpareEventLocked(&ev);
      if (e == cudaSuccess) e = cudaEventRecord(ev, s);
      if (e == cudaSuccess) {
        pending.events.push_back(ev);
        continue;
      }
      state_->DeferCuda(e, "Free: recording the block's release event");
      if (ev) spare_events_.push_back(ev);
      e = cudaStreamSynchronize(s);  // no event: wait for the stream instead
      if (e != cudaSuccess) state_->DeferCuda(e, "Free: cudaStreamSynchronize");
    }
    pending_.push_back(std::move(pending));
  }

  Status CopyHostToDevice(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyHostToDevice, "CopyHostToDevice");
  }
  Status CopyDeviceToHost(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyDeviceToHost, "CopyDeviceToHost");
  }
  Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyDeviceToDevice, "CopyDeviceToDevice");
  }

  Status Memset(void* dst, int value, size_t bytes) override {
    if (bytes == 0) return Status::Ok();
    if (!dst) return InvalidArgument("{}: Memset of {} bytes to a null pointer", name_, bytes);
    MS_RETURN_IF_ERROR(state_->TakeDeferred());
    MS_RETURN_IF_ERROR(state_->MakeCurrent());
    cudaError_t e = cudaMemsetAsync(dst, value, bytes, copy_stream_);
    if (e == cudaSuccess) e = cudaStreamSynchronize(copy_stream_);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return Internal("{}: Memset of {} bytes at {} to {}: {}", name_, bytes, dst, value, ErrorText(e));
    }
    return Status::Ok();
  }

  const std::shared_ptr<DeviceState>& state() const {
    return state_;
  }

  std::unique_ptr<device::Stream> CreateStream() override {
    if (Status s = state_->MakeCurrent(); !s.ok()) Fatal(fmt::format("{}: CreateStream: {}", name_, s.message()));
    cudaStream_t stream = nullptr;
    cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e == cudaErrorMemoryAllocation) {  // the cache may hold the memory a stream needs
      (void)cudaGetLastError();
      ReleaseCachedMemory();
      e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    }
    if (e != cudaSuccess) Fatal(fmt::format("{}: CreateStream: cudaStreamCreateWithFlags: {}", name_, ErrorText(e)));
    return std::make_unique<CudaStream>(state_, stream);
  }

  std::shared_ptr<device::Event> RecordEvent(device::Stream& stream) override {
    auto* cs = dynamic_cast<CudaStream*>(&stream);
    if (!cs) {  // a stream of another device
      auto ev = std::make_shared<device::HostEvent>();
      stream.Enqueue([ev] { ev->Complete(); });
      return ev;
    }
    if (Status s = state_->MakeCurrent(); !s.ok()) Fatal(fmt::format("{}: RecordEvent: {}", name_, s.message()));
    cudaEvent_t event = nullptr;
    cudaError_t e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      ReleaseCachedMemory();
      e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    }
    if (e != cudaSuccess) Fatal(fmt::format("{}: RecordEvent: cudaEventCreateWithFlags: {}", name_, ErrorText(e)));
    auto ev = std::make_shared<CudaEvent>(state_, event);
    e = cudaEventRecord(event, cs->native());
    if (e != cudaSuccess) state_->DeferCuda(e, "RecordEvent: cudaEventRecord");
    return ev;
  }

  size_t bytes_in_use() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_.bytes_in_use;
  }

  AllocatorStats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  void ReleaseCachedMemory() {
    std::lock_guard<std::mutex> lock(mu_);
    if (Status s = state_->MakeCurrent(); !s.ok()) state_->Defer(s);
    CollectPendingLocked(/*wait=*/true);
    ReleaseCachedLocked();
  }

 private:
  struct Block {
    size_t size;       // cudaMalloc'd bytes
    size_t requested;  // what the caller asked for
  };
  struct Pending {  // freed, waiting for the streams' work enqueued before the Free
    void* ptr;
    size_t size;
    std::vector<cudaEvent_t> events;
  };

  Status Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, const char* what) {
    if (bytes == 0) return Status::Ok();
    if (!dst || !src) return InvalidArgument("{}: {} of {} bytes with a null pointer", name_, what, bytes);
    MS_RETURN_IF_ERROR(state_->TakeDeferred());
    MS_RETURN_IF_ERROR(state_->MakeCurrent());
    // On the device's own non-blocking stream, then synchronized: complete on return (a plain cudaMemcpy from
    // pageable memory may return before its DMA is done, and the legacy stream does not order non-blocking ones).
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, copy_stream_);
    if (e == cudaSuccess) e = cudaStreamSynchronize(copy_stream_);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return Internal("{}: {} of {} bytes ({} -> {}): {}", name_, what, bytes, src, dst, ErrorText(e));
    }
    return Status::Ok();
  }

  cudaError_t SpareEventLocked(cudaEvent_t* ev) {
    if (!spare_events_.empty()) {
      *ev = spare_events_.back();
      spare_events_.pop_back();
      return cudaSuccess;
    }
    return cudaEventCreateWithFlags(ev, cudaEventDisableTiming);
  }

  // Moves pending blocks whose events have completed (all of them, waiting, if `wait`) to the free lists.
  // Stops at the first incomplete one: later ones were recorded after it on the same streams.
  void CollectPendingLocked(bool wait) {
    while (!pending_.empty()) {
      Pending& p = pending_.front();
      for (cudaEvent_t ev : p.events) {
        cudaError_t e = wait ? cudaEventSynchronize(ev) : cudaEventQuery(ev);
        if (e == cudaErrorNotReady) return;
        if (e != cudaSuccess) state_->DeferCuda(e, "waiting for a freed block's streams");
      }
      spare_events_.insert(spare_events_.end(), p.events.begin(), p.events.end());
      free_.emplace(p.size, p.ptr);
      pending_.pop_front();
    }
  }

  // Returns every block of the free lists to cudaFree.
  void ReleaseCachedLocked() {
    for (auto& [size, ptr] : free_) {
      OnRelease(ptr, size);
      cudaError_t e = cudaFree(ptr);
      if (e != cudaSuccess) state_->DeferCuda(e, fmt::format("cudaFree of a cached block of {} bytes", size));
      blocks_.erase(ptr);
      stats_.bytes_cached -= size;
    }
    free_.clear();
  }

  std::string MemInfo() const {
    size_t free_bytes = 0, total = 0;
    if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) {
      (void)cudaGetLastError();
      return "";
    }
    return fmt::format("; the device has {} of {} bytes free", free_bytes, total);
  }

  const std::shared_ptr<DeviceState> state_;
  const std::string name_;
  const cudaStream_t copy_stream_;  // Copy* and Memset, synchronized before they return

  mutable std::mutex mu_;  // everything below
  std::unordered_map<void*, Block> in_use_;
  std::multimap<size_t, void*> free_;  // size -> block, ready for reuse
  std::deque<Pending> pending_;
  std::unordered_map<void*, size_t> blocks_;  // every block cudaMalloc'd and not yet cudaFree'd
  std::vector<cudaEvent_t> spare_events_;
  AllocatorStats stats_;
};

std::string UnavailableCause(cudaError_t e) {
  switch (e) {
    case cudaErrorNoDevice:
      return "no CUDA-capable device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)";
    case cudaErrorInsufficientDriver:
      return fmt::format("the NVIDIA driver is missing or older than this CUDA runtime ({}.{})", CUDART_VERSION / 1000,
                         CUDART_VERSION % 1000 / 10);
    case cudaErrorSystemDriverMismatch:
      return "the NVIDIA kernel driver and the user-space driver library have different versions (reboot or "
             "reinstall the driver)";
    case cudaErrorDevicesUnavailable:
      return "the devices are busy or unavailable (exclusive-process compute mode?)";
    default:
      return "the CUDA runtime could not be initialized";
  }
}

}  // namespace

Result<std::unique_ptr<device::Device>> MakeCudaDevice(int ordinal) {
  const std::string visible = GetEnv("CUDA_VISIBLE_DEVICES").value_or("<unset>");
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return Unavailable("CUDA device {}: {}: cudaGetDeviceCount failed: {}", ordinal, UnavailableCause(e), ErrorText(e));
  }
  if (count <= 0) {
    return Unavailable("CUDA device {}: no CUDA-capable device is visible (CUDA_VISIBLE_DEVICES={})", ordinal, visible);
  }
  if (ordinal < 0 || ordinal >= count) {
    return Unavailable("CUDA device {} does not exist: {} device(s) visible, ordinals 0..{} (CUDA_VISIBLE_DEVICES={})",
                       ordinal, count, count - 1, visible);
  }
  auto state = std::make_shared<DeviceState>(ordinal);
  e = cudaSetDevice(ordinal);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return Unavailable("CUDA device {}: cudaSetDevice failed: {}: {}", ordinal, UnavailableCause(e), ErrorText(e));
  }
  cudaDeviceProp prop{};
  e = cudaGetDeviceProperties(&prop, ordinal);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return Unavailable("CUDA device {}: cudaGetDeviceProperties failed: {}", ordinal, ErrorText(e));
  }
  cudaStream_t copy_stream = nullptr;
  e = cudaStreamCreateWithFlags(&copy_stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return Unavailable("CUDA device {} ({}): cannot create a stream: {}", ordinal, prop.name, ErrorText(e));
  }
  std::string name = fmt::format("cuda:{} ({})", ordinal, prop.name);
  return std::unique_ptr<device::Device>(std::make_unique<CudaDevice>(std::move(state), std::move(name), copy_stream));
}

cudaStream_t NativeStream(device::Stream& stream) {
  auto* cs = dynamic_cast<CudaStream*>(&stream);
  return cs ? cs->native() : nullptr;
}

AllocatorStats GetAllocatorStats(device::Device& device) {
  auto* cd = dynamic_cast<CudaDevice*>(&device);
  return cd ? cd->stats() : AllocatorStats{};
}

void ReleaseCachedMemory(device::Device& device) {
  if (auto* cd = dynamic_cast<CudaDevice*>(&device)) cd->ReleaseCachedMemory();
}

std::function<void()> RegisterExternalStream(device::Device& device, cudaStream_t stream) {
  auto* cd = dynamic_cast<CudaDevice*>(&device);
  if (!cd) return [] {};
  std::shared_ptr<DeviceState> state = cd->state();  // outlives the device if need be
  {
    std::lock_guard<std::mutex> lock(state->mu);
    state->streams.push_back(stream);
  }
  return [state, stream] {
    std::lock_guard<std::mutex> lock(state->mu);
    auto& v = state->streams;
    v.erase(std::remove(v.begin(), v.end(), stream), v.end());
  };
}

}  // namespace ms::cuda
