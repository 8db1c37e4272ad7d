// kernels/sim/internal.h: what the scheduler (simt.cpp) and the CUDA runtime subset (runtime.cpp) share.
// Not for kernels or tests.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

namespace ms::sim::internal {

constexpr size_t kDefaultSharedLimit = 48 * 1024;  // static shared, and dynamic without opt-in
constexpr size_t kMaxSharedOptIn = 227 * 1024;     // sm_90's opt-in maximum per block
constexpr unsigned char kPoisonByte = 0xFF;        // fill of cudaMalloc'd and shared memory (NaN, -1)

// The calling host thread's last CUDA error (what cudaGetLastError returns and clears).
void SetLastError(cudaError_t error);
// The dynamic shared memory a kernel may use: kDefaultSharedLimit unless raised with cudaFuncSetAttribute.
size_t MaxDynamicSharedBytes(const void* kernel);
// Records the message for ms::sim::LastErrorMessage() and prints it on stderr ("ms-sim: error: ...")
// unless MS_SIM_QUIET=1; aborts the process if MS_SIM_ABORT=1 (to get a core file or a debugger stop).
void ReportError(const std::string& message);

}  // namespace ms::sim::internal
