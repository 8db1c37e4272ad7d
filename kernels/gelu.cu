// defines: gelu_forward_kernel, gelu_backward_kernel, bias_gelu_forward_kernel, bias_gelu_backward_kernel and
//          their launchers (GeluForward, GeluBackward, BiasGeluForward, BiasGeluBackward; the bias + GeLU backward
//          adds up dbias as it computes dx, in BiasGrad's order: kernels/column_sums.cuh).
// GeLU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as ms::ops::GeluForward.
#include <type_traits>

#include "column_sums.cuh"
#include "common.cuh"
#include "kernels.h"

namespace ms::kernels {

constexpr int kGeluBlock = 256;  // threads per block of every kernel here (launchers and __launch_bounds__)

// ---- kernels ----

__device__ __forceinline__ float Gelu(float v) {
  const float k = 0.7978845608028654f;
  return 0.5f * v * (1.0f + tanhf(k * (v + 0.044715f * v * v * v)));
}

__device__ __forceinline__ float GeluGrad(float v) {
  const float k = 0.7978845608028654f;
  const float t = tanhf(k * (v + 0.044715f * v * v * v));
  const float du = k * (1.0f + 3.0f * 0.044715f * v * v);
  return 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du;
}

__global__ void __launch_bounds__(kGeluBlock) gelu_forward_kernel(float* out, const float* x, long n) {  // out, x: (n)
  for (long i = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    out[i] = Gelu(x[i]);
  }
}

__global__ void __launch_bounds__(kGeluBlock)
    gelu_backward_kernel(float* dx, const float* x, const float* dout, long n) {  // all (n)
  for (long i = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    dx[i] = dout[i] * GeluGrad(x[i]);
  }
}

// out, x: (N, C) flattened to n = N*C; bias: (C); out16: (N, C), out rounded to bf16, or null; out may be null
// when out16 is not (only the rounding is written). X: float, or __nv_bfloat16 (the fc output kept in bf16).
// pre16 (N, C), unless null, = x + bias rounded to bf16 (the GeLU's input, as the cuBLASLt GELU_AUX_BIAS epilogue
// stores it; pre16 may equal x: each element is read before it is written, by the same thread).
template <class X>
__global__ void __launch_bounds__(kGeluBlock)
    bias_gelu_forward_kernel(float* out, __nv_bfloat16* out16, __nv_bfloat16* pre16, const X* x, const float* bias,
                             long n, int C) {
  for (long i = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    const float pre = Widen(x[i]) + bias[i % C];
    const float v = Gelu(pre);
    if (pre16) pre16[i] = __float2bfloat16_rn(pre);
    if (out) out[i] = v;
    if (out16) out16[i] = __float2bfloat16_rn(v);
  }
}

// ColumnSumChunk (column_sums.cuh) over dx (N, C) = gelu'(x + bias) * dout, each element computed once, stored to dx
// and / or dx16 (bf16) where not null, and added into the bias gradient: the dbias of BiasGrad over the stored dx,
// bit for bit, without reading dx again. X, G: float, or __nv_bfloat16 (x: the fc output, dout: its GeLU's output
// gradient, kept in bf16), widened exactly. kBias false: no bias (x is the GeLU input itself).
template <class X, class G, bool kBias>
__global__ void __launch_bounds__(kColSumThreads)
    bias_gelu_backward_kernel(float* dx, __nv_bfloat16* dx16, float* dbias, float* partial, const X* x,
                              const float* bias, const G* dout, int64_t N, int64_t C, int64_t chunk_rows) {
  MS_SHARED_ARRAY2D(float, lanes, kColSumLanes, kColSumCols + 1);
  const int64_t col = static_cast<int64_t>(blockIdx.y) * kColSumCols + threadIdx.x;  // the thread's (ColumnSumChunk's)
  const float b = kBias && col < C ? bias[col] : 0.0f;
  auto load = [=](int64_t r, int64_t c) { return float2{Widen(x[r * C + c]), Widen(dout[r * C + c])}; };
  ColumnSumChunk(lanes, dbias, partial, N, C, chunk_rows, load, [=](float2 in, int64_t r, int64_t c) {
    const int64_t i = r * C + c;
    // __fmul_rn: the product is rounded before the sum adds it (never contracted into an FMA with the sum), so
    // dbias adds exactly the stored values.
    float u = in.x;
    if constexpr (kBias) u += b;
    const float v = __fmul_rn(in.y, GeluGrad(u));
    if (dx) dx[i] = v;
    if (dx16) dx16[i] = __float2bfloat16_rn(v);
    return v;
  });
}

// ---- launchers: return the CUDA error of the launch (cudaSuccess when fine) ----

cudaError_t GeluForward(float* out, const float* x, long n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int block = kGeluBlock;
  MS_LAUNCH(gelu_forward_kernel, GridFor(n, block), block, 0, stream, out, x, n);
  return cudaGetLastError();
}

cudaError_t GeluBackward(float* dx, const float* x, const float* dout, long n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int block = kGeluBlock;
  MS_LAUNCH(gelu_backward_kernel, GridFor(n, block), block, 0, stream, dx, x, dout, n);
  return cudaGetLastError();
}

namespace {
template <class X>
cudaError_t LaunchBiasGeluForward(float* out, const X* x, const float* bias, int64_t N, int64_t C, cudaStream_t stream,
                                  __nv_bfloat16* out16, __nv_bfloat16* pre16) {
  if (out == nullptr && out16 == nullptr) return cudaErrorInvalidValue;  // the output would be written nowhere
  if (N <= 0 || C <= 0) return cudaSuccess;
  const int block = kGeluBlock;
  const long n = static_cast<long>(N * C);
  MS_LAUNCH(bias_gelu_forward_kernel<X>, GridFor(n, block), block, 0, stream, out, out16, pre16, x, bias, n,
            static_cast<int>(C));
  return cudaGetLastError();
}

template <class X, class G>
cudaError_t LaunchBiasGeluBackward(float* dx, float* dbias, float* scratch, const X* x, const float* bias,
                                   const G* dout, int64_t N, int64_t C, cudaStream_t stream, __nv_bfloat16* dx16) {
  if (N <= 0 || C <= 0) return cudaSuccess;
  const ColumnSumPlan plan = PlanColumnSums(N, C);  // BiasGrad's tree (BiasGradScratchFloats)
  float* partial = plan.chunks > 1 ? scratch : nullptr;
  const dim3 grid(static_cast<unsigned>(plan.chunks), static_cast<unsigned>(plan.tiles));
  if (bias) {
    MS_LAUNCH((bias_gelu_backward_kernel<X, G, true>), grid, dim3(kColSumCols, kColSumLanes), 0, stream, dx, dx16,
              dbias, partial, x, bias, dout, N, C, plan.chunk_rows);
  } else if constexpr (std::is_same_v<X, __nv_bfloat16> && std::is_same_v<G, __nv_bfloat16>) {
    MS_LAUNCH((bias_gelu_backward_kernel<X, G, false>), grid, dim3(kColSumCols, kColSumLanes), 0, stream, dx, dx16,
              dbias, partial, x, bias, dout, N, C, plan.chunk_rows);
  } else {
    return cudaErrorInvalidValue;  // a null bias only where x and dout are bf16 (the cuBLASLt-epilogue fallback)
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || partial == nullptr) return err;
  return FinishColumnSums(dbias, partial, plan.chunks, C, stream);
}
}  // namespace

cudaError_t BiasGeluForward(float* out, const float* x, const float* bias, int64_t N, int64_t C, cudaStream_t stream,
                            __nv_bfloat16* out16) {
  return LaunchBiasGeluForward(out, x, bias, N, C, stream, out16, static_cast<__nv_bfloat16*>(nullptr));
}
cudaError_t BiasGeluForward(float* out, const __nv_bfloat16* x, const float* bias, int64_t N, int64_t C,
                            cudaStream_t stream, __nv_bfloat16* out16, __nv_bfloat16* pre16) {
  return LaunchBiasGeluForward(out, x, bias, N, C, stream, out16, pre16);
}

cudaError_t BiasGeluBackward(float* dx, float* dbias, float* scratch, const float* x, const float* bias,
                             const float* dout, int64_t N, int64_t C, cudaStream_t stream, __nv_bfloat16* dx16) {
  return LaunchBiasGeluBackward(dx, dbias, scratch, x, bias, dout, N, C, stream, dx16);
}
cudaError_t BiasGeluBackward(float* dx, float* dbias, float* scratch, const __nv_bfloat16* x, const float* bias,
                             const float* dout, int64_t N, int64_t C, cudaStream_t stream, __nv_bfloat16* dx16) {
  return LaunchBiasGeluBackward(dx, dbias, scratch, x, bias, dout, N, C, stream, dx16);
}
cudaError_t BiasGeluBackward(float* dx, float* dbias, float* scratch, const __nv_bfloat16* x, const float* bias,
                             const __nv_bfloat16* dout, int64_t N, int64_t C, cudaStream_t stream,
                             __nv_bfloat16* dx16) {
  return LaunchBiasGeluBackward(dx, dbias, scratch, x, bias, dout, N, C, stream, dx16);
}

}  // namespace ms::kernels
