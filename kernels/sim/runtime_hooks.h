// kernels/sim/runtime_hooks.h: what the emulated CUDA runtime (runtime.cpp) offers beyond the CUDA API, for the
// emulator's cuBLAS subset (cublas.cpp) and for tests of code that sits on the runtime (lib/cuda, tests/cuda).
// Emulated builds only (the functions are defined in ms_sim, never in libcudart).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace ms::sim {

// Makes the next `count` calls of cudaMalloc fail with cudaErrorMemoryAllocation, as an exhausted GPU would
// (count <= 0 cancels). For testing out-of-memory handling; process-wide.
void FailNextMallocs(int count);

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

}  // namespace ms::sim
