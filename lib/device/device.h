// Device: memory, streams and events behind one interface, so that the model and the
// runtime are written once for the CPU and CUDA backends.
//
// CPU implementation (always built): host memory aligned to 64 bytes; a Stream is a worker
// thread that runs enqueued work in order; an Event marks a point in a stream that other
// streams or the host can wait for. The CUDA implementation (CUDA issue) maps these onto
// cudaMalloc, cudaStream_t and cudaEvent_t.
//
// Thread safety: Device methods may be called from any thread. A Stream is used by one
// producer thread at a time. Work enqueued on a stream must not throw.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "core/core.h"

namespace ms::device {

class Event;

class Stream {
 public:
  virtual ~Stream() = default;
  // Runs `fn` after everything enqueued before it (CPU: on the stream's worker thread).
  virtual void Enqueue(std::function<void()> fn) = 0;
  // Makes later work on this stream wait until `event` has completed.
  virtual void WaitEvent(const std::shared_ptr<Event>& event) = 0;
  // Blocks the calling thread until all enqueued work has run.
  virtual void Synchronize() = 0;
};

class Event {
 public:
  virtual ~Event() = default;
  virtual bool Query() const = 0;  // completed?
  virtual void Synchronize() = 0;  // block the host until completed
};

// An event completed by the host: Complete() is called by a function enqueued on a stream (the CPU
// device's events, and a CUDA device's events recorded on streams of other devices).
class HostEvent final : public Event {
 public:
  void Complete();
  bool Query() const override;
  void Synchronize() override;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual std::string name() const = 0;
  virtual bool is_host() const = 0;  // memory directly addressable by the CPU
  // Allocates `bytes` (>= 1) of device memory; OutOfRange-free: failure is an error naming the size.
  virtual Result<void*> Alloc(size_t bytes) = 0;
  virtual void Free(void* ptr) = 0;
  virtual Status CopyHostToDevice(void* dst, const void* src, size_t bytes) = 0;
  virtual Status CopyDeviceToHost(void* dst, const void* src, size_t bytes) = 0;
  virtual Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes) = 0;
  virtual Status Memset(void* dst, int value, size_t bytes) = 0;
  virtual std::unique_ptr<Stream> CreateStream() = 0;
  // Records an event at the current end of `stream`.
  virtual std::shared_ptr<Event> RecordEvent(Stream& stream) = 0;
  // Bytes currently allocated through this device.
  virtual size_t bytes_in_use() const = 0;
};

// The host backend.
std::unique_ptr<Device> MakeCpuDevice();

// An owning buffer of floats on a device (moves only).
class Buffer {
 public:
  Buffer() = default;
  static Result<Buffer> Allocate(Device* device, size_t count, DType dtype = DType::kF32);
  ~Buffer();
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return ptr_; }
  float* f32() const { return static_cast<float*>(ptr_); }
  int32_t* i32() const { return static_cast<int32_t*>(ptr_); }
  size_t count() const { return count_; }
  size_t bytes() const { return count_ * DTypeSize(dtype_); }

 private:
  Device* device_ = nullptr;
  void* ptr_ = nullptr;
  size_t count_ = 0;
  DType dtype_ = DType::kF32;
};

}  // namespace ms::device
