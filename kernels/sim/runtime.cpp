// kernels/sim/runtime.cpp: the subset of the CUDA runtime API that the kernel tests and lib/cuda use, on the CPU,
// for emulated builds only (never linked with the real libcudart). Declarations come from the real
// cuda_runtime_api.h, so types, enum values and signatures are NVIDIA's.
//
//   cudaMalloc        malloc, filled with 0xFF (device memory is not zeroed; NaN/-1 make reads of
//                     unwritten memory visible), registered so that copies can be checked;
//   cudaMemcpy(Async) checks the pointer kinds against `kind` and that device ranges lie inside one
//                     allocation, then copies (eagerly); cudaMemset likewise;
//   streams, events   streams.cpp: eagerly on the calling thread (MS_SIM_STREAMS=sync, the default), or on a
//                     thread per stream (async), or only when needed (deferred): see runtime_hooks.h;
//                     events record host time;
//   cudaFuncSetAttribute  MaxDynamicSharedMemorySize is honoured by the launch check, others accepted;
//   cudaLaunchHostFunc    runs the function in stream order (sync mode: at once); CUDA calls made from inside it fail
//                     with cudaErrorNotPermitted (CUDA forbids them: on a GPU they may fail or deadlock);
//   graphs            cudaStreamBeginCapture / EndCapture / IsCapturing, cudaGraphInstantiate / Launch / GetNodes
//                     (the count) / Destroy; a capture spans the streams that wait for its events (fork) and
//                     must be joined back before it ends (streams.cpp);
//   device queries    one device, 0, "megascale SIMT emulator (CPU)": sm_90's launch limits, the host's RAM as
//                     its memory (cudaMalloc fails above it), the host's cores as its multiprocessors.
// Allocations are 256-byte aligned, as cudaMalloc's; runtime_hooks.h adds failure injection and range checks.
// Thread safety: the registries are locked; the last error is per host thread, as in CUDA.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "sim/internal.h"
#include "sim/runtime_hooks.h"

namespace ms::sim::internal {
namespace {

thread_local cudaError_t tls_last_error = cudaSuccess;
std::atomic<int> failing_mallocs{0};           // FailNextMallocs
thread_local int tls_host_function_depth = 0;  // inside cudaLaunchHostFunc's function

struct Registry {
  std::mutex mu;
  std::map<uintptr_t, size_t> allocations;         // base -> bytes
  std::map<uintptr_t, size_t> pinned;              // cudaMallocHost: base -> bytes
  std::map<const void*, size_t> max_dynamic_smem;  // kernel -> bytes
};
Registry& Reg() {
  static Registry* r = new Registry;  // never destroyed: usable from other static destructors
  return *r;
}

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

// Whether [p, p + n) lies inside one cudaMallocHost buffer (page-locked: copies from and to it are asynchronous).
bool InPinned(const void* p, size_t n) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  Registry& r = Reg();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.pinned.upper_bound(a);
  if (it == r.pinned.begin()) return false;
  --it;
  return a >= it->first && a + n <= it->first + it->second;
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
  return KnownStreamHandle(s);
}

bool KnownEvent(cudaEvent_t e) {
  return KnownEventHandle(e);
}

// The checks of a copy at its call, and the copy itself as a stream operation (async modes). Host-to-device
// copies take a snapshot of their pageable source (CUDA returns once it is staged, so the caller may reuse it);
// device-to-host copies into pageable memory return once complete (as CUDA's do). Copies from and to pinned
// memory (cudaMallocHost) are plain stream operations, as CUDA's DMA: the source is read when the copy runs
// and the destination is written then, so the caller must not touch the buffer until an event or a
// synchronization says the copy is done.
cudaError_t CopyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream,
                      const char* api) {
  if (!AsyncStreams() && !AnyCapture()) return Copy(dst, src, count, kind, api);  // captured copies are recorded
  if (count == 0) return cudaSuccess;
  if (!dst || !src) return Fail(cudaErrorInvalidValue, std::string(api) + ": null pointer");
  const Where d = Locate(dst, count), s = Locate(src, count);
  if (d == Where::kHost && s == Where::kHost) return Copy(dst, src, count, kind, api);  // host to host: at once
  // Validate now (the same checks as a synchronous copy), against a scratch destination if needed.
  if (d == Where::kStraddles || s == Where::kStraddles || (kind == cudaMemcpyHostToDevice && d != Where::kDevice) ||
      (kind == cudaMemcpyDeviceToHost && s != Where::kDevice) ||
      (kind == cudaMemcpyDeviceToDevice && (d != Where::kDevice || s != Where::kDevice)) ||
      (kind == cudaMemcpyHostToDevice && s != Where::kHost) || (kind == cudaMemcpyDeviceToHost && d != Where::kHost) ||
      kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) {
    return Copy(dst, src, count, kind, api);  // reports the error without copying anything valid
  }
  if ((d == Where::kHost && !InPinned(dst, count)) || (s == Where::kHost && !InPinned(src, count))) {
    // A capture cannot record a copy with pageable memory (CUDA stages it at the call).
    if (cudaError_t r = RefuseInCapture(stream, std::string(api) + " with pageable host memory"); r != cudaSuccess) {
      return Fail(r, std::string(api) + ": pageable host memory in a stream capture (use cudaMallocHost memory)");
    }
  }
  if (d == Where::kHost && !InPinned(dst, count)) {  // device to pageable host memory: complete before returning
    if (cudaError_t r = SynchronizeStream(stream); r != cudaSuccess) return r;
    std::memcpy(dst, src, count);
    return cudaSuccess;
  }
  if (s == Where::kHost && !InPinned(src, count)) {
    auto staged =
        std::make_shared<std::vector<char>>(static_cast<const char*>(src), static_cast<const char*>(src) + count);
    return Enqueue(stream, api, [dst, staged]() {
      std::memcpy(dst, staged->data(), staged->size());
      return cudaSuccess;
    });
  }
  return Enqueue(stream, api, [dst, src, count]() {
    std::memcpy(dst, src, count);
    return cudaSuccess;
  });
}

// The host's physical memory: what the emulated device offers as its global memory.
size_t HostMemoryBytes(bool available_only) {
  const long pages = sysconf(available_only ? _SC_AVPHYS_PAGES : _SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : 0;
}

int HostCores() {
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

void FillProperties(cudaDeviceProp* p) {
  *p = cudaDeviceProp{};
  std::snprintf(p->name, sizeof(p->name), "%s", "megascale SIMT emulator (CPU)");
  p->totalGlobalMem = HostMemoryBytes(false);
  p->sharedMemPerBlock = kDefaultSharedLimit;
  p->sharedMemPerBlockOptin = kMaxSharedOptIn;
  p->sharedMemPerMultiprocessor = kMaxSharedOptIn + 1024;
  p->reservedSharedMemPerBlock = 1024;
  p->regsPerBlock = 65536;
  p->regsPerMultiprocessor = 65536;
  p->warpSize = 32;
  p->memPitch = 2147483647;
  p->maxThreadsPerBlock = 1024;
  p->maxThreadsDim[0] = 1024;
  p->maxThreadsDim[1] = 1024;
  p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 2147483647;
  p->maxGridSize[1] = 65535;
  p->maxGridSize[2] = 65535;
  p->totalConstMem = 65536;
  p->major = 9;  // the limits checked are sm_90's
  p->minor = 0;
  p->textureAlignment = 512;
  p->texturePitchAlignment = 32;
  p->multiProcessorCount = HostCores();
  p->maxThreadsPerMultiProcessor = 2048;
  p->maxBlocksPerMultiProcessor = 32;
  p->concurrentKernels = 0;  // streams run eagerly, one thing at a time
  p->unifiedAddressing = 1;
  p->canMapHostMemory = 1;
  p->memoryBusWidth = 64;
  p->asyncEngineCount = 0;
  p->hostNumaId = -1;
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

// CUDA forbids CUDA calls in a host function (cudaLaunchHostFunc); the emulator, which runs it at once on the
// calling thread, makes them fail instead of silently working.
#define MS_SIM_NOT_IN_HOST_FUNCTION(api)                                                                               \
  do {                                                                                                                 \
    if (ms::sim::internal::tls_host_function_depth > 0) {                                                              \
      return ms::sim::internal::Fail(cudaErrorNotPermitted, std::string(api) +                                         \
                                                                ": called from a host function (cudaLaunchHostFunc), " \
                                                                "which must not make CUDA calls");                     \
    }                                                                                                                  \
  } while (0)

namespace ms::sim {

bool InHostFunction() {
  return internal::tls_host_function_depth > 0;
}

void FailNextMallocs(int count) {
  internal::failing_mallocs.store(count > 0 ? count : 0);
}

bool IsDeviceRange(const void* p, size_t bytes) {
  return bytes == 0 || (p != nullptr && internal::Locate(p, bytes) == internal::Where::kDevice);
}

bool IsKnownStream(cudaStream_t stream) {
  return internal::KnownStream(stream);
}

DeviceAllocations LiveDeviceAllocations() {
  internal::Registry& r = internal::Reg();
  std::lock_guard<std::mutex> lock(r.mu);
  DeviceAllocations out;
  out.count = r.allocations.size();
  for (const auto& [base, bytes] : r.allocations) out.bytes += bytes;
  return out;
}

}  // namespace ms::sim

using ms::sim::internal::Fail;
using ms::sim::internal::Reg;

cudaError_t cudaMalloc(void** ptr, size_t size) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaMalloc");
  if (!ptr) return Fail(cudaErrorInvalidValue, "cudaMalloc: null output pointer");
  *ptr = nullptr;
  // Out of memory is not reported on stderr: callers (caching allocators) handle it, as on a GPU.
  int pending = ms::sim::internal::failing_mallocs.load();
  while (pending > 0 && !ms::sim::internal::failing_mallocs.compare_exchange_weak(pending, pending - 1)) {
  }
  if (pending > 0) {
    ms::sim::internal::SetLastError(cudaErrorMemoryAllocation);  // injected by ms::sim::FailNextMallocs
    return cudaErrorMemoryAllocation;
  }
  const size_t bytes = size == 0 ? 1 : size;
  const size_t total = ms::sim::internal::HostMemoryBytes(false);
  void* p = nullptr;
  // Never more than the device (the host) has; 256-byte aligned as cudaMalloc's, exactly `bytes` for ASan.
  if ((total != 0 && bytes > total) || posix_memalign(&p, 256, bytes) != 0 || !p) {
    ms::sim::internal::SetLastError(cudaErrorMemoryAllocation);
    return cudaErrorMemoryAllocation;
  }
  std::memset(p, ms::sim::internal::kPoisonByte, size);
  {
    auto& r = Reg();
    std::lock_guard<std::mutex> lock(r.mu);
    r.allocations[reinterpret_cast<uintptr_t>(p)] = bytes;
  }
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaFree");
  if (!ptr) return cudaSuccess;
  // cudaFree synchronizes the device (work still in flight may use the buffer).
  if (ms::sim::internal::AsyncStreams()) ms::sim::internal::SynchronizeDevice();
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
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaMallocHost");
  if (!ptr) return Fail(cudaErrorInvalidValue, "cudaMallocHost: null output pointer");
  *ptr = std::malloc(size == 0 ? 1 : size);
  if (!*ptr) return Fail(cudaErrorMemoryAllocation, "cudaMallocHost: out of memory");
  auto& r = Reg();
  std::lock_guard<std::mutex> lock(r.mu);
  r.pinned[reinterpret_cast<uintptr_t>(*ptr)] = size == 0 ? 1 : size;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* ptr) {
  if (!ptr) return cudaSuccess;
  // cudaFreeHost synchronizes the device (a copy in flight may still read or write the buffer).
  if (ms::sim::internal::AsyncStreams()) ms::sim::internal::SynchronizeDevice();
  bool known = false;
  {
    auto& r = Reg();
    std::lock_guard<std::mutex> lock(r.mu);
    known = r.pinned.erase(reinterpret_cast<uintptr_t>(ptr)) == 1;
  }
  if (!known) return Fail(cudaErrorInvalidValue, "cudaFreeHost: not the start of a cudaMallocHost'd buffer");
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaMemcpy");
  // On the legacy stream: after everything issued to it and to the blocking streams.
  if (cudaError_t r = ms::sim::internal::SynchronizeStream(nullptr); r != cudaSuccess) return r;
  return ms::sim::internal::Copy(dst, src, count, kind, "cudaMemcpy");
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaMemcpyAsync");
  if (!ms::sim::internal::KnownStream(stream))
    return Fail(cudaErrorInvalidResourceHandle, "cudaMemcpyAsync: bad stream");
  return ms::sim::internal::CopyAsync(dst, src, count, kind, stream, "cudaMemcpyAsync");
}

cudaError_t cudaMemset(void* ptr, int value, size_t count) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaMemset");
  if (cudaError_t r = ms::sim::internal::SynchronizeStream(nullptr); r != cudaSuccess) return r;
  return ms::sim::internal::Set(ptr, value, count, "cudaMemset");
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t stream) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaMemsetAsync");
  if (!ms::sim::internal::KnownStream(stream))
    return Fail(cudaErrorInvalidResourceHandle, "cudaMemsetAsync: bad stream");
  if ((!ms::sim::internal::AsyncStreams() && !ms::sim::internal::AnyCapture()) || count == 0)
    return ms::sim::internal::Set(ptr, value, count, "cudaMemsetAsync");
  if (!ms::sim::IsDeviceRange(ptr, count)) return ms::sim::internal::Set(ptr, value, count, "cudaMemsetAsync");
  return ms::sim::internal::Enqueue(stream, "cudaMemsetAsync", [ptr, value, count]() {
    std::memset(ptr, value, count);
    return cudaSuccess;
  });
}

cudaError_t cudaGetLastError(void) {
  cudaError_t e = ms::sim::internal::tls_last_error;
  ms::sim::internal::tls_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) {
  return ms::sim::internal::tls_last_error;
}

namespace ms::sim::internal {
namespace {

struct ErrorText {
  cudaError_t code;
  const char* name;
  const char* text;  // as the real runtime words it
};
constexpr ErrorText kErrors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration", "invalid configuration argument"},
    {cudaErrorInvalidDevicePointer, "cudaErrorInvalidDevicePointer", "invalid device pointer"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection", "invalid copy direction for memcpy"},
    {cudaErrorInsufficientDriver, "cudaErrorInsufficientDriver",
     "CUDA driver version is insufficient for CUDA runtime version"},
    {cudaErrorInvalidDeviceFunction, "cudaErrorInvalidDeviceFunction", "invalid device function"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress", "an illegal memory access was encountered"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure",
     "unspecified launch failure (emulated; see the ms-sim error message)"},
    {cudaErrorNotPermitted, "cudaErrorNotPermitted", "operation not permitted"},
    {cudaErrorNotSupported, "cudaErrorNotSupported", "operation not supported"},
    {cudaErrorIllegalState, "cudaErrorIllegalState", "the operation cannot be performed in the present state"},
    {cudaErrorStreamCaptureUnsupported, "cudaErrorStreamCaptureUnsupported",
     "operation not permitted when stream is capturing"},
    {cudaErrorStreamCaptureInvalidated, "cudaErrorStreamCaptureInvalidated",
     "operation failed due to a previous error during capture"},
    {cudaErrorStreamCaptureIsolation, "cudaErrorStreamCaptureIsolation",
     "dependency created on uncaptured work in another stream"},
    {cudaErrorStreamCaptureImplicit, "cudaErrorStreamCaptureImplicit",
     "operation would make the legacy stream depend on a capturing blocking stream"},
    {cudaErrorCapturedEvent, "cudaErrorCapturedEvent",
     "operation not permitted on an event last recorded in a capturing stream"},
    {cudaErrorStreamCaptureWrongThread, "cudaErrorStreamCaptureWrongThread",
     "attempt to terminate a thread-local capture sequence from another thread"},
};

const ErrorText* FindError(cudaError_t error) {
  for (const ErrorText& e : kErrors) {
    if (e.code == error) return &e;
  }
  return nullptr;
}

// Reports an error of the capture rules (streams.cpp) with the API that met it; other codes pass through.
cudaError_t CaptureRule(cudaError_t r, const char* api) {
  switch (r) {
    case cudaErrorStreamCaptureUnsupported:
    case cudaErrorStreamCaptureInvalidated:
    case cudaErrorStreamCaptureIsolation:
    case cudaErrorStreamCaptureImplicit:
    case cudaErrorCapturedEvent:
      return Fail(r, std::string(api) + ": " + FindError(r)->text);
    default:
      return r;
  }
}

}  // namespace
}  // namespace ms::sim::internal

using ms::sim::internal::CaptureRule;

const char* cudaGetErrorName(cudaError_t error) {
  const auto* e = ms::sim::internal::FindError(error);
  return e ? e->name : "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t error) {
  const auto* e = ms::sim::internal::FindError(error);
  return e ? e->text : "unknown error";
}

cudaError_t cudaDeviceSynchronize(void) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaDeviceSynchronize");
  return CaptureRule(ms::sim::internal::SynchronizeDevice(), "cudaDeviceSynchronize");
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

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (!prop) return Fail(cudaErrorInvalidValue, "cudaGetDeviceProperties: null pointer");
  if (device != 0) return Fail(cudaErrorInvalidDevice, "cudaGetDeviceProperties: the emulator has one device, 0");
  ms::sim::internal::FillProperties(prop);
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (!value) return Fail(cudaErrorInvalidValue, "cudaDeviceGetAttribute: null pointer");
  if (device != 0) return Fail(cudaErrorInvalidDevice, "cudaDeviceGetAttribute: the emulator has one device, 0");
  cudaDeviceProp p;
  ms::sim::internal::FillProperties(&p);
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock:
      *value = p.maxThreadsPerBlock;
      break;
    case cudaDevAttrMaxBlockDimX:
    case cudaDevAttrMaxBlockDimY:
    case cudaDevAttrMaxBlockDimZ:
      *value = p.maxThreadsDim[attr - cudaDevAttrMaxBlockDimX];
      break;
    case cudaDevAttrMaxGridDimX:
    case cudaDevAttrMaxGridDimY:
    case cudaDevAttrMaxGridDimZ:
      *value = p.maxGridSize[attr - cudaDevAttrMaxGridDimX];
      break;
    case cudaDevAttrMaxSharedMemoryPerBlock:
      *value = static_cast<int>(p.sharedMemPerBlock);
      break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = static_cast<int>(p.sharedMemPerBlockOptin);
      break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor:
      *value = static_cast<int>(p.sharedMemPerMultiprocessor);
      break;
    case cudaDevAttrTotalConstantMemory:
      *value = static_cast<int>(p.totalConstMem);
      break;
    case cudaDevAttrWarpSize:
      *value = p.warpSize;
      break;
    case cudaDevAttrMaxRegistersPerBlock:
      *value = p.regsPerBlock;
      break;
    case cudaDevAttrMultiProcessorCount:
      *value = p.multiProcessorCount;
      break;
    case cudaDevAttrMaxThreadsPerMultiProcessor:
      *value = p.maxThreadsPerMultiProcessor;
      break;
    case cudaDevAttrComputeCapabilityMajor:
      *value = p.major;
      break;
    case cudaDevAttrComputeCapabilityMinor:
      *value = p.minor;
      break;
    case cudaDevAttrConcurrentKernels:
      *value = p.concurrentKernels;
      break;
    case cudaDevAttrUnifiedAddressing:
      *value = p.unifiedAddressing;
      break;
    default:
      return Fail(cudaErrorInvalidValue,
                  "cudaDeviceGetAttribute: attribute " + std::to_string(static_cast<int>(attr)) + " is not emulated");
  }
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  if (!free || !total) return Fail(cudaErrorInvalidValue, "cudaMemGetInfo: null pointer");
  *free = ms::sim::internal::HostMemoryBytes(true);
  *total = ms::sim::internal::HostMemoryBytes(false);
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* version) {
  if (!version) return Fail(cudaErrorInvalidValue, "cudaDriverGetVersion: null pointer");
  *version = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* version) {
  if (!version) return Fail(cudaErrorInvalidValue, "cudaRuntimeGetVersion: null pointer");
  *version = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaStreamCreate");
  if (!stream) return Fail(cudaErrorInvalidValue, "cudaStreamCreate: null pointer");
  if (flags & ~static_cast<unsigned>(cudaStreamNonBlocking)) {
    return Fail(cudaErrorInvalidValue, "cudaStreamCreateWithFlags: unknown flags");
  }
  *stream = ms::sim::internal::NewStream((flags & cudaStreamNonBlocking) == 0);
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, 0);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaStreamDestroy");
  if (ms::sim::internal::DestroyStream(stream) == cudaSuccess) return cudaSuccess;
  return Fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy: not a stream");
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaStreamSynchronize");
  if (!ms::sim::internal::KnownStream(stream))
    return Fail(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize: not a stream");
  return CaptureRule(ms::sim::internal::SynchronizeStream(stream), "cudaStreamSynchronize");
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaStreamQuery");
  if (!ms::sim::internal::KnownStream(stream))
    return Fail(cudaErrorInvalidResourceHandle, "cudaStreamQuery: not a stream");
  return CaptureRule(ms::sim::internal::QueryStream(stream), "cudaStreamQuery");
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int /*flags*/) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaStreamWaitEvent");
  if (!ms::sim::internal::KnownEvent(event) || !ms::sim::internal::KnownStream(stream)) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: bad stream or event");
  }
  return CaptureRule(ms::sim::internal::StreamWaitEvent(stream, event), "cudaStreamWaitEvent");
}

// ---- stream capture and graphs (streams.cpp: what is emulated and what is refused) ----
cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaStreamBeginCapture");
  if (mode != cudaStreamCaptureModeGlobal && mode != cudaStreamCaptureModeThreadLocal &&
      mode != cudaStreamCaptureModeRelaxed) {
    return Fail(cudaErrorInvalidValue, "cudaStreamBeginCapture: unknown mode");
  }
  switch (ms::sim::internal::BeginCapture(stream, mode)) {
    case cudaSuccess:
      return cudaSuccess;
    case cudaErrorInvalidResourceHandle:
      return Fail(cudaErrorInvalidResourceHandle, "cudaStreamBeginCapture: not a stream");
    case cudaErrorIllegalState:
      return Fail(cudaErrorIllegalState, "cudaStreamBeginCapture: the stream is already capturing");
    default:
      return Fail(cudaErrorStreamCaptureUnsupported, "cudaStreamBeginCapture: the legacy stream cannot be captured");
  }
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* pGraph) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaStreamEndCapture");
  if (!pGraph) return Fail(cudaErrorInvalidValue, "cudaStreamEndCapture: null pointer");
  std::string why;
  const cudaError_t r = ms::sim::internal::EndCapture(stream, pGraph, &why);
  if (r == cudaErrorStreamCaptureInvalidated) {
    return Fail(r, "cudaStreamEndCapture: the capture was invalidated by " + why);
  }
  if (r == cudaErrorStreamCaptureUnjoined) {
    return Fail(r, "cudaStreamEndCapture: " + why +
                       " (record an event on it after its last operation and make the "
                       "capturing stream wait for it)");
  }
  if (r == cudaErrorStreamCaptureUnmatched) {
    return Fail(r,
                "cudaStreamEndCapture: called on a stream forked into the capture; end it on the stream that began it");
  }
  if (r != cudaSuccess) return Fail(r, "cudaStreamEndCapture: not a capturing stream, or another thread's capture");
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus* pCaptureStatus) {
  if (!pCaptureStatus) return Fail(cudaErrorInvalidValue, "cudaStreamIsCapturing: null pointer");
  if (ms::sim::internal::CaptureStatus(stream, pCaptureStatus) != cudaSuccess) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaStreamIsCapturing: not a stream");
  }
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* pGraphExec, cudaGraph_t graph, unsigned long long flags) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaGraphInstantiate");
  if (!pGraphExec) return Fail(cudaErrorInvalidValue, "cudaGraphInstantiate: null pointer");
  if (flags != 0) return Fail(cudaErrorInvalidValue, "cudaGraphInstantiate: flags are not emulated");
  void* exec = nullptr;
  if (ms::sim::internal::CopyGraph(graph, &exec) != cudaSuccess) {
    return Fail(cudaErrorInvalidValue, "cudaGraphInstantiate: not a graph");
  }
  *pGraphExec = static_cast<cudaGraphExec_t>(exec);
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaGraphLaunch");
  const cudaError_t r = ms::sim::internal::LaunchGraph(graphExec, stream);
  if (r == cudaErrorInvalidValue) return Fail(r, "cudaGraphLaunch: not an executable graph");
  if (r == cudaErrorInvalidResourceHandle) return Fail(r, "cudaGraphLaunch: not a stream");
  if (r != cudaSuccess)
    ms::sim::internal::SetLastError(r);  // an operation of the graph failed (sync mode): its own error
  return r;
}

// The nodes of a captured graph: one per recorded operation (only the count: `nodes` must be null).
cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t* nodes, size_t* numNodes) {
  if (!numNodes) return Fail(cudaErrorInvalidValue, "cudaGraphGetNodes: null count");
  if (nodes) return Fail(cudaErrorNotSupported, "cudaGraphGetNodes: only the count is emulated (nodes must be null)");
  if (ms::sim::internal::GraphOps(graph, numNodes) != cudaSuccess) {
    return Fail(cudaErrorInvalidValue, "cudaGraphGetNodes: not a graph");
  }
  return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec) {
  if (ms::sim::internal::DestroyGraph(graphExec) != cudaSuccess) {
    return Fail(cudaErrorInvalidValue, "cudaGraphExecDestroy: not an executable graph");
  }
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  if (ms::sim::internal::DestroyGraph(graph) != cudaSuccess) {
    return Fail(cudaErrorInvalidValue, "cudaGraphDestroy: not a graph");
  }
  return cudaSuccess;
}

cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* user_data) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaLaunchHostFunc");
  if (!fn) return Fail(cudaErrorInvalidValue, "cudaLaunchHostFunc: null function");
  if (!ms::sim::internal::KnownStream(stream)) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaLaunchHostFunc: not a stream");
  }
  // After everything before it on the stream (at once in sync mode; on the stream's thread otherwise).
  return ms::sim::internal::Enqueue(stream, "cudaLaunchHostFunc", [fn, user_data]() {
    ++ms::sim::internal::tls_host_function_depth;
    fn(user_data);
    --ms::sim::internal::tls_host_function_depth;
    return cudaSuccess;
  });
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaEventCreate");
  if (!event) return Fail(cudaErrorInvalidValue, "cudaEventCreate: null pointer");
  constexpr unsigned kKnown = cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess;
  if (flags & ~kKnown) return Fail(cudaErrorInvalidValue, "cudaEventCreateWithFlags: unknown flags");
  *event = ms::sim::internal::NewEvent();
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, 0);
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaEventRecord");
  const cudaError_t r = ms::sim::internal::RecordEvent(event, stream);
  if (r == cudaErrorStreamCaptureInvalidated) return Fail(r, "cudaEventRecord: the stream's capture was invalidated");
  if (r != cudaSuccess) return Fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: bad stream or event");
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaEventQuery");
  if (!ms::sim::internal::KnownEvent(event))
    return Fail(cudaErrorInvalidResourceHandle, "cudaEventQuery: not an event");
  return CaptureRule(ms::sim::internal::QueryEvent(event), "cudaEventQuery");
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaEventSynchronize");
  if (!ms::sim::internal::KnownEvent(event))
    return Fail(cudaErrorInvalidResourceHandle, "cudaEventSynchronize: not an event");
  return CaptureRule(ms::sim::internal::SynchronizeEvent(event), "cudaEventSynchronize");
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  std::chrono::steady_clock::time_point a, b;
  if (!ms) return Fail(cudaErrorInvalidValue, "cudaEventElapsedTime: null pointer");
  for (cudaEvent_t ev : {start, end}) {
    if (const cudaError_t r = ms::sim::internal::EventTime(ev, &a); r == cudaErrorCapturedEvent) {
      return CaptureRule(r, "cudaEventElapsedTime");
    }
  }
  if (ms::sim::internal::EventTime(start, &a) != cudaSuccess || ms::sim::internal::EventTime(end, &b) != cudaSuccess) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: not an event, or not recorded");
  }
  *ms = std::chrono::duration<float, std::milli>(b - a).count();
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  MS_SIM_NOT_IN_HOST_FUNCTION("cudaEventDestroy");
  if (ms::sim::internal::DestroyEvent(event) != cudaSuccess) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaEventDestroy: not an event");
  }
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
