// defines: cast_float_to_bf16_kernel, cast_bf16_to_float_kernel and their launchers (CastFloatToBf16,
// CastBf16ToFloat). fp32 -> bf16 rounds to nearest even (cuda_bf16.h's __float2bfloat16_rn).
#include "common.cuh"
#include "kernels.h"

namespace ms::kernels {

constexpr int kCastBlock = 256;  // threads per block (the launchers and __launch_bounds__)

// ---- kernels ----

__global__ void __launch_bounds__(kCastBlock)
    cast_float_to_bf16_kernel(__nv_bfloat16* out, const float* in, long n) {  // (n)
  for (long i = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    out[i] = __float2bfloat16_rn(in[i]);
  }
}

__global__ void __launch_bounds__(kCastBlock)
    cast_bf16_to_float_kernel(float* out, const __nv_bfloat16* in, long n) {  // (n)
  for (long i = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    out[i] = __bfloat162float(in[i]);
  }
}

// ---- launchers ----

cudaError_t CastFloatToBf16(__nv_bfloat16* out, const float* in, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int block = kCastBlock;
  MS_LAUNCH(cast_float_to_bf16_kernel, GridFor(n, block), block, 0, stream, out, in, static_cast<long>(n));
  return cudaGetLastError();
}

cudaError_t CastBf16ToFloat(float* out, const __nv_bfloat16* in, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int block = kCastBlock;
  MS_LAUNCH(cast_bf16_to_float_kernel, GridFor(n, block), block, 0, stream, out, in, static_cast<long>(n));
  return cudaGetLastError();
}

}  // namespace ms::kernels
