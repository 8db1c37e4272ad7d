// kernels/sim/runtime_hooks.h: what the emulated CUDA runtime (runtime.cpp) offers beyond the CUDA API, for the
// emulator's cuBLAS subset (cublas.cpp) and for tests of code that sits on the runtime (lib/cuda, tests/cuda).
// Emulated builds only (the functions are defined in ms_sim, never in libcudart).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>

namespace ms::sim {

// Makes the next `count` calls of cudaMalloc fail with cudaErrorMemoryAllocation, as an exhausted GPU would
// (count <= 0 cancels). For testing out-of-memory handling; process-wide.
void FailNextMallocs(int count);

// Makes the next `count` calls of cublasLtMatmulAlgoGetHeuristic find no algorithm (count <= 0 cancels), as the
// real one answers where no kernel fits a problem: for testing the callers' fallbacks; process-wide.
void RefuseNextLtHeuristics(int count);

// Whether [p, p + bytes) lies inside one live cudaMalloc'd allocation (bytes == 0: whether p does, or is its end).
bool IsDeviceRange(const void* p, size_t bytes);

// Whether `stream` is a live stream of the runtime (or the default / legacy / per-thread stream).
bool IsKnownStream(cudaStream_t stream);

// Whether the calling thread is running a host function of cudaLaunchHostFunc (where CUDA calls are forbidden).
bool InHostFunction();

// The cudaMalloc'd allocations alive now: how many, and their bytes (as requested).
struct DeviceAllocations {
  size_t count = 0;
  size_t bytes = 0;
};
DeviceAllocations LiveDeviceAllocations();

// ---- streams (kernels/sim/streams.cpp) ----
// How the emulated device runs its streams: kSync (the default: every operation at once on the calling thread),
// kAsync (a worker thread per stream; operations in issue order, concurrent with the host and other streams,
// ordered only by events, the legacy stream's barrier and host synchronization), kDeferred (kAsync, and a
// stream runs an operation only once a host synchronization or another stream's event wait needs it; streams
// marked eager run at once). Read from MS_SIM_STREAMS=sync|async|deferred at first use. In the async modes a
// kernel's launch and execution errors are reported by the next synchronization of its stream (sticky), not by
// cudaGetLastError after the launch.
enum class StreamMode { kSync, kAsync, kDeferred };
StreamMode GetStreamMode();
const char* StreamModeName(StreamMode mode);
// Waits for every stream, then switches (the emulated NCCL needs an async mode: its receives block a stream).
void SetStreamMode(StreamMode mode);
// An operation on `stream`, run after everything issued on it before (at once in kSync). It may block (the
// emulated NCCL's receives wait for their peer); its error becomes the stream's sticky error.
using StreamOp = std::function<cudaError_t()>;
cudaError_t EnqueueOnStream(cudaStream_t stream, const char* what, StreamOp op);
// kDeferred: `stream` runs its operations as soon as they are issued (communication streams, which peers wait on).
void SetStreamEager(cudaStream_t stream);

}  // namespace ms::sim
