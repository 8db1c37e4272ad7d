// kernels/sim/runtime.cpp: the subset of the CUDA runtime API that the kernel tests use, on the CPU, for
// emulated builds only (never linked with the real libcudart). Declarations come from the real
// cuda_runtime_api.h, so types, enum values and signatures are NVIDIA's.
//
//   cudaMalloc        malloc, filled with 0xFF (device memory is not zeroed; NaN/-1 make reads of
//                     unwritten memory visible), registered so that copies can be checked;
//   cudaMemcpy(Async) checks the pointer kinds against `kind` and that device ranges lie inside one
//                     allocation, then copies (eagerly); cudaMemset likewise;
//   streams, events   executed eagerly, in order: synchronization always succeeds (so a missing one is
//                     never caught here); events record host time;
//   cudaFuncSetAttribute  MaxDynamicSharedMemorySize is honoured by the launch check, others accepted.
// Thread safety: the allocation registry is locked; the last error is per host thread, as in CUDA.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "sim/internal.h"

namespace ms::sim::internal {
namespace {

thread_local cudaError_t tls_last_error = cudaSuccess;

struct Registry {
  std::mutex mu;
  std::map<uintptr_t, size_t> allocations;  // base -> bytes
  std::set<const void*> streams;
  std::map<const void*, size_t> max_dynamic_smem;  // kernel -> bytes
};
Registry& Reg() {
  static Registry* r = new Registry;  // never destroyed: usable from other static destructors
  return *r;
}

struct Event {
  std::chrono::steady_clock::time_point time;
  bool recorded = false;
};

enum class Where { kHost, kDevice, kStraddles };

// Where [p, p + n) lies: host memory, inside one device allocation, or partly in one (an error).
Where Locate(const void* p, size_t n) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  Registry& r = Reg();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.allocations.upper_bound(a);
  if (it == r.allocations.begin()) return Where::kHost;
  --it;
  if (a >= it->first + it->second) return Where::kHost;
  return a + n <= it->first + it->second ? Where::kDevice : Where::kStraddles;
}

cudaError_t Fail(cudaError_t code, const std::string& message) {
  ReportError(message);
  tls_last_error = code;
  return code;
}

const char* KindName(cudaMemcpyKind kind) {
  switch (kind) {
    case cudaMemcpyHostToHost:
      return "cudaMemcpyHostToHost";
    case cudaMemcpyHostToDevice:
      return "cudaMemcpyHostToDevice";
    case cudaMemcpyDeviceToHost:
      return "cudaMemcpyDeviceToHost";
    case cudaMemcpyDeviceToDevice:
      return "cudaMemcpyDeviceToDevice";
    case cudaMemcpyDefault:
      return "cudaMemcpyDefault";
  }
  return "?";
}

cudaError_t Copy(void* dst, const void* src, size_t count, cudaMemcpyKind kind, const char* api) {
  if (count == 0) return cudaSuccess;
  if (!dst || !src) return Fail(cudaErrorInvalidValue, std::string(api) + ": null pointer");
  const Where d = Locate(dst, count), s = Locate(src, count);
  if (d == Where::kStraddles || s == Where::kStraddles) {
    return Fail(cudaErrorInvalidValue, std::string(api) + ": " + std::to_string(count) +
                                           " bytes run past the end of a cudaMalloc'd buffer (" +
                                           (d == Where::kStraddles ? "destination" : "source") + ")");
  }
  bool ok = true;
  switch (kind) {
    case cudaMemcpyHostToHost:
      ok = d == Where::kHost && s == Where::kHost;
      break;
    case cudaMemcpyHostToDevice:
      ok = d == Where::kDevice && s == Where::kHost;
      break;
    case cudaMemcpyDeviceToHost:
      ok = d == Where::kHost && s == Where::kDevice;
      break;
    case cudaMemcpyDeviceToDevice:
      ok = d == Where::kDevice && s == Where::kDevice;
      break;
    case cudaMemcpyDefault:
      break;
    default:
      return Fail(cudaErrorInvalidMemcpyDirection, std::string(api) + ": invalid cudaMemcpyKind");
  }
  if (!ok) {
    return Fail(cudaErrorInvalidValue, std::string(api) + ": " + KindName(kind) + " but the destination is " +
                                           (d == Where::kDevice ? "device" : "host") + " memory and the source is " +
                                           (s == Where::kDevice ? "device" : "host") +
                                           " memory (hint: swapped arguments or wrong kind?)");
  }
  std::memcpy(dst, src, count);
  return cudaSuccess;
}

cudaError_t Set(void* p, int value, size_t count, const char* api) {
  if (count == 0) return cudaSuccess;
  if (Locate(p, count) != Where::kDevice) {
    return Fail(cudaErrorInvalidValue, std::string(api) + ": the range is not inside one cudaMalloc'd buffer");
  }
  std::memset(p, value, count);
  return cudaSuccess;
}

bool KnownStream(cudaStream_t s) {
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return true;
  Registry& r = Reg();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.streams.count(s) != 0;
}

}  // namespace

void SetLastError(cudaError_t error) {
  tls_last_error = error;
}

size_t MaxDynamicSharedBytes(const void* kernel) {
  Registry& r = Reg();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.max_dynamic_smem.find(kernel);
  return it == r.max_dynamic_smem.end() ? kDefaultSharedLimit : it->second;
}

}  // namespace ms::sim::internal

using ms::sim::internal::Fail;
using ms::sim::internal::Reg;

cudaError_t cudaMalloc(void** ptr, size_t size) {
  if (!ptr) return Fail(cudaErrorInvalidValue, "cudaMalloc: null output pointer");
  void* p = std::malloc(size == 0 ? 1 : size);
  if (!p) return Fail(cudaErrorMemoryAllocation, "cudaMalloc: out of memory");
  std::memset(p, ms::sim::internal::kPoisonByte, size);
  {
    auto& r = Reg();
    std::lock_guard<std::mutex> lock(r.mu);
    r.allocations[reinterpret_cast<uintptr_t>(p)] = size == 0 ? 1 : size;
  }
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (!ptr) return cudaSuccess;
  bool known = false;
  {
    auto& r = Reg();
    std::lock_guard<std::mutex> lock(r.mu);
    known = r.allocations.erase(reinterpret_cast<uintptr_t>(ptr)) == 1;
  }
  if (!known) return Fail(cudaErrorInvalidValue, "cudaFree: not the start of a cudaMalloc'd buffer");
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** ptr, size_t size) {
  if (!ptr) return Fail(cudaErrorInvalidValue, "cudaMallocHost: null output pointer");
  *ptr = std::malloc(size == 0 ? 1 : size);
  return *ptr ? cudaSuccess : Fail(cudaErrorMemoryAllocation, "cudaMallocHost: out of memory");
}

cudaError_t cudaFreeHost(void* ptr) {
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  return ms::sim::internal::Copy(dst, src, count, kind, "cudaMemcpy");
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream) {
  if (!ms::sim::internal::KnownStream(stream))
    return Fail(cudaErrorInvalidResourceHandle, "cudaMemcpyAsync: bad stream");
  return ms::sim::internal::Copy(dst, src, count, kind, "cudaMemcpyAsync");
}

cudaError_t cudaMemset(void* ptr, int value, size_t count) {
  return ms::sim::internal::Set(ptr, value, count, "cudaMemset");
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t stream) {
  if (!ms::sim::internal::KnownStream(stream))
    return Fail(cudaErrorInvalidResourceHandle, "cudaMemsetAsync: bad stream");
  return ms::sim::internal::Set(ptr, value, count, "cudaMemsetAsync");
}

cudaError_t cudaGetLastError(void) {
  cudaError_t e = ms::sim::internal::tls_last_error;
  ms::sim::internal::tls_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) {
  return ms::sim::internal::tls_last_error;
}

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidMemcpyDirection:
      return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    default:
      return "cudaErrorUnknown";
  }
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidMemcpyDirection:
      return "invalid copy direction for memcpy";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure (emulated; see the ms-sim error message)";
    default:
      return "unknown error";
  }
}

cudaError_t cudaDeviceSynchronize(void) {
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  if (!device) return Fail(cudaErrorInvalidValue, "cudaGetDevice: null pointer");
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : Fail(cudaErrorInvalidDevice, "cudaSetDevice: the emulator has one device, 0");
}

cudaError_t cudaGetDeviceCount(int* count) {
  if (!count) return Fail(cudaErrorInvalidValue, "cudaGetDeviceCount: null pointer");
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int /*flags*/) {
  if (!stream) return Fail(cudaErrorInvalidValue, "cudaStreamCreate: null pointer");
  auto* s = reinterpret_cast<cudaStream_t>(new char);
  auto& r = Reg();
  std::lock_guard<std::mutex> lock(r.mu);
  r.streams.insert(s);
  *stream = s;
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, 0);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  auto& r = Reg();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (r.streams.erase(stream) == 1) {
      delete reinterpret_cast<char*>(stream);
      return cudaSuccess;
    }
  }
  return Fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy: not a stream");
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  return ms::sim::internal::KnownStream(stream)
             ? cudaSuccess
             : Fail(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize: not a stream");
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int /*flags*/) {
  if (!event || !ms::sim::internal::KnownStream(stream)) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: bad stream or event");
  }
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int /*flags*/) {
  if (!event) return Fail(cudaErrorInvalidValue, "cudaEventCreate: null pointer");
  *event = reinterpret_cast<cudaEvent_t>(new ms::sim::internal::Event);
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, 0);
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (!event || !ms::sim::internal::KnownStream(stream)) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: bad stream or event");
  }
  auto* e = reinterpret_cast<ms::sim::internal::Event*>(event);
  e->time = std::chrono::steady_clock::now();
  e->recorded = true;
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  return event ? cudaSuccess : Fail(cudaErrorInvalidResourceHandle, "cudaEventSynchronize: null event");
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  auto* a = reinterpret_cast<ms::sim::internal::Event*>(start);
  auto* b = reinterpret_cast<ms::sim::internal::Event*>(end);
  if (!ms || !a || !b || !a->recorded || !b->recorded) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: events not recorded");
  }
  *ms = std::chrono::duration<float, std::milli>(b->time - a->time).count();
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete reinterpret_cast<ms::sim::internal::Event*>(event);
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (!func) return Fail(cudaErrorInvalidDeviceFunction, "cudaFuncSetAttribute: null function");
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || static_cast<size_t>(value) > ms::sim::internal::kMaxSharedOptIn) {
      return Fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: MaxDynamicSharedMemorySize above 227 KiB");
    }
    auto& r = Reg();
    std::lock_guard<std::mutex> lock(r.mu);
    r.max_dynamic_smem[func] = static_cast<size_t>(value);
  }
  return cudaSuccess;
}
