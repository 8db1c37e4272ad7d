#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "device/device.h"

namespace ms::device {
namespace {

class CpuStream : public Stream {
 public:
  CpuStream() : worker_([this] { Loop(); }) {}
  ~CpuStream() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    worker_.join();
  }
  void Enqueue(std::function<void()> fn) override {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(fn));
    ++enqueued_;
    cv_.notify_all();
  }
  void WaitEvent(const std::shared_ptr<Event>& event) override {
    Enqueue([event] { event->Synchronize(); });
  }
  void Synchronize() override {
    std::unique_lock<std::mutex> lock(mu_);
    uint64_t target = enqueued_;
    done_cv_.wait(lock, [&] { return completed_ >= target; });
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and drained
        fn = std::move(queue_.front());
        queue_.pop_front();
      }
      fn();
      std::lock_guard<std::mutex> lock(mu_);
      ++completed_;
      done_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<std::function<void()>> queue_;
  uint64_t enqueued_ = 0, completed_ = 0;
  bool stop_ = false;
  std::thread worker_;  // last: starts after the members above exist
};

class CpuDevice : public Device {
 public:
  std::string name() const override { return "cpu"; }
  bool is_host() const override { return true; }
  Result<void*> Alloc(size_t bytes) override {
    size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    if (!p) return Internal("host allocation of {} bytes failed (out of memory?)", bytes);
    in_use_ += rounded;
    {
      std::lock_guard<std::mutex> lock(mu_);
      sizes_[p] = rounded;
    }
    return p;
  }
  void Free(void* ptr) override {
    if (!ptr) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = sizes_.find(ptr);
      if (it != sizes_.end()) {
        in_use_ -= it->second;
        sizes_.erase(it);
      }
    }
    std::free(ptr);
  }
  Status CopyHostToDevice(void* dst, const void* src, size_t bytes) override { return Copy(dst, src, bytes); }
  Status CopyDeviceToHost(void* dst, const void* src, size_t bytes) override { return Copy(dst, src, bytes); }
  Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes) override { return Copy(dst, src, bytes); }
  Status Memset(void* dst, int value, size_t bytes) override {
    if (bytes && !dst) return InvalidArgument("memset of {} bytes to a null pointer", bytes);
    if (bytes) std::memset(dst, value, bytes);
    return Status::Ok();
  }
  std::unique_ptr<Stream> CreateStream() override { return std::make_unique<CpuStream>(); }
  std::shared_ptr<Event> RecordEvent(Stream& stream) override {
    auto ev = std::make_shared<HostEvent>();
    stream.Enqueue([ev] { ev->Complete(); });
    return ev;
  }
  size_t bytes_in_use() const override { return in_use_.load(); }

 private:
  static Status Copy(void* dst, const void* src, size_t bytes) {
    if (bytes && (!dst || !src)) return InvalidArgument("copy of {} bytes with a null pointer", bytes);
    if (bytes) std::memmove(dst, src, bytes);
    return Status::Ok();
  }
  std::atomic<size_t> in_use_{0};
  std::mutex mu_;
  std::unordered_map<void*, size_t> sizes_;
};

}  // namespace

void HostEvent::Complete() {
  std::lock_guard<std::mutex> lock(mu_);
  done_ = true;
  cv_.notify_all();
}
bool HostEvent::Query() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}
void HostEvent::Synchronize() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_; });
}

std::unique_ptr<Device> MakeCpuDevice() {
  return std::make_unique<CpuDevice>();
}

Result<Buffer> Buffer::Allocate(Device* device, size_t count, DType dtype) {
  Buffer b;
  MS_ASSIGN_OR_RETURN(b.ptr_, device->Alloc(count * DTypeSize(dtype)));
  b.device_ = device;
  b.count_ = count;
  b.dtype_ = dtype;
  Status s = device->Memset(b.ptr_, 0, b.bytes());
  if (!s.ok()) return s;
  return b;
}

Buffer::~Buffer() {
  if (device_ && ptr_) device_->Free(ptr_);
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    if (device_ && ptr_) device_->Free(ptr_);
    device_ = o.device_;
    ptr_ = o.ptr_;
    count_ = o.count_;
    dtype_ = o.dtype_;
    o.device_ = nullptr;
    o.ptr_ = nullptr;
    o.count_ = 0;
  }
  return *this;
}

}  // namespace ms::device
