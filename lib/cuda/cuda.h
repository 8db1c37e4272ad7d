// The CUDA backend: a Device on the CUDA runtime (streams, events, a caching allocator) and an ops::Backend
// whose ops are the fused kernels of kernels/ plus cuBLAS GEMMs (bf16 inputs, fp32 accumulation).
//
// The same sources build two libraries (docs/cuda.md):
//   ms_cuda_gpu  with nvcc: linked against libcudart, cuBLAS and the nvcc-compiled kernels (the `megascale`
//                binary). Without nvcc it is a library whose factories return Unavailable.
//   ms_cuda_sim  with only the CUDA headers: the kernels run on the SIMT emulator (kernels/sim), the runtime
//                and cuBLAS calls on its CPU implementation (the `megascale-emu` binary and the tests).
// Which one a program has is fixed when it is linked; Flavor() tells.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "core/core.h"
#include "device/device.h"
#include "ops/ops.h"

typedef struct CUstream_st* cudaStream_t;  // as cuda_runtime_api.h declares it

namespace ms::cuda {

enum class Flavor { kNone, kGpu, kEmulated };
Flavor LinkedFlavor();
const char* FlavorName(Flavor f);  // "none", "gpu", "emulated"

// Caching allocator statistics of a CUDA device.
struct AllocatorStats {
  size_t bytes_in_use = 0;  // handed out to callers
  size_t bytes_cached = 0;  // held in the free lists (cudaMalloc'd, not handed out)
  size_t peak_in_use = 0;
  int64_t cuda_mallocs = 0;  // calls of cudaMalloc made (misses)
  int64_t cache_hits = 0;    // allocations served from the free lists
};

// A Device on CUDA device `ordinal` (cudaSetDevice). Memory comes from a caching allocator: blocks are
// rounded up (512 B under 1 MiB, 2 MiB granules above), kept in size-ordered free lists on Free and reused;
// on cudaMalloc failure the cache is released and the allocation retried once; the error names the size,
// the bytes in use and cached. Streams are non-blocking cudaStreams; Stream::Enqueue runs a host function on
// the stream (cudaLaunchHostFunc); events are cudaEvents (timing disabled).
// Errors: no CUDA device, a bad ordinal, or a runtime without a driver give Unavailable naming the cause.
Result<std::unique_ptr<device::Device>> MakeCudaDevice(int ordinal);
// The native stream of a Stream created by a CUDA device (nullptr for streams of other devices).
cudaStream_t NativeStream(device::Stream& stream);
// Allocator statistics of a device made by MakeCudaDevice (zeros for other devices).
AllocatorStats GetAllocatorStats(device::Device& device);
// Returns every cached block to cudaFree (blocks in use stay).
void ReleaseCachedMemory(device::Device& device);

// The ops backend on `device` (made by MakeCudaDevice; not owned): every op enqueued on one stream of the
// device, GEMMs by cuBLAS (cublasGemmEx; with bf16_gemm the fp32 operands are first cast to bf16 in a workspace
// and multiplied with fp32 accumulation into fp32 outputs, else fp32 throughout), everything else by the kernels
// of kernels/. Parameters, gradients and optimizer state stay fp32 (the masters).
Result<std::unique_ptr<ops::Backend>> MakeCudaBackend(device::Device* device, bool bf16_gemm = true);
// The cudaStream_t a backend made by MakeCudaBackend enqueues on (as void*, so that callers need no CUDA
// headers); nullptr for other backends. Communicators order their work after it (comm::NcclOptions).
void* BackendStream(ops::Backend& backend);

}  // namespace ms::cuda
