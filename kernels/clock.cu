// defines: wait_clock_kernel and its launcher (AddDeviceClock): the device's clock (%globaltimer, nanoseconds)
// added to or subtracted from a 64-bit accumulator, one thread. A pair of launches around a stream's wait for an
// event, subtracting before it and adding after, adds how long the stream was blocked there: what times the device
// waits recorded inside CUDA graphs, where an event has no timestamp (lib/cuda/nccl_comm.cpp).
#include "common.cuh"
#include "kernels.h"

#if MS_SIM_EMULATION
#include <chrono>
#endif

namespace ms::kernels {
namespace {

// The device's global nanosecond clock. The GPU's %globaltimer counts nanoseconds of wall time (updated about every
// microsecond); the emulator's is the host's steady clock, on which its streams run.
__device__ __forceinline__ unsigned long long GlobalTimerNs() {
#if MS_SIM_EMULATION
  return static_cast<unsigned long long>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
#else
  unsigned long long t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}

}  // namespace

// ---- kernels ----

// *acc += now (add) or -= now, modulo 2^64: a subtraction and a later addition leave their difference in it.
__global__ void __launch_bounds__(1) wait_clock_kernel(unsigned long long* acc, int add) {  // (1 thread)
  const unsigned long long now = GlobalTimerNs();
  *acc = add ? *acc + now : *acc - now;
}

// ---- launchers ----

cudaError_t AddDeviceClock(uint64_t* acc, bool add, cudaStream_t stream) {
  static_assert(sizeof(unsigned long long) == sizeof(uint64_t));
  MS_LAUNCH(wait_clock_kernel, 1, 1, 0, stream, reinterpret_cast<unsigned long long*>(acc), add ? 1 : 0);
  return cudaGetLastError();
}

}  // namespace ms::kernels
