// defines: gelu_forward_kernel, gelu_backward_kernel, bias_gelu_forward_kernel, bias_gelu_backward_kernel,
//          bias_grad_kernel and their launchers (GeluForward, GeluBackward, BiasGeluForward, BiasGeluBackward).
// GeLU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as ms::ops::GeluForward.
#include "common.cuh"
#include "kernels.h"

namespace ms::kernels {

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

__global__ void gelu_forward_kernel(float* out, const float* x, long n) {  // out, x: (n)
  for (long i = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    out[i] = Gelu(x[i]);
  }
}

__global__ void gelu_backward_kernel(float* dx, const float* x, const float* dout, long n) {  // all (n)
  for (long i = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    dx[i] = dout[i] * GeluGrad(x[i]);
  }
}

// out, x: (N, C) flattened to n = N*C; bias: (C).
__global__ void bias_gelu_forward_kernel(float* out, const float* x, const float* bias, long n, int C) {
  for (long i = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    out[i] = Gelu(x[i] + bias[i % C]);
  }
}

// dx, x, dout: (N, C) flattened to n; bias: (C).
__global__ void bias_gelu_backward_kernel(float* dx, const float* x, const float* bias, const float* dout, long n,
                                          int C) {
  for (long i = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    dx[i] = dout[i] * GeluGrad(x[i] + bias[i % C]);
  }
}

constexpr int kBiasGradCols = 32;  // columns per block (threadIdx.x)
constexpr int kBiasGradRows = 8;   // row lanes per block (threadIdx.y)

// dbias (C) += column sums of d (N, C). Block (32, 8): column blockIdx.x*32 + threadIdx.x, rows strided by 8;
// the 8 partial sums are added in a fixed order: deterministic.
__global__ void bias_grad_kernel(float* dbias, const float* d, long N, int C) {
  MS_SHARED_ARRAY2D(float, partial, kBiasGradRows, kBiasGradCols + 1);
  const int c = blockIdx.x * kBiasGradCols + threadIdx.x;
  float acc = 0.0f;
  if (c < C) {
    for (long r = threadIdx.y; r < N; r += kBiasGradRows) acc += d[r * C + c];
  }
  partial[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float sum = 0.0f;
    for (int k = 0; k < kBiasGradRows; ++k) sum += partial[k][threadIdx.x];
    dbias[c] += sum;
  }
}

// ---- launchers: return the CUDA error of the launch (cudaSuccess when fine) ----

cudaError_t GeluForward(float* out, const float* x, long n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int block = 256;
  MS_LAUNCH(gelu_forward_kernel, GridFor(n, block), block, 0, stream, out, x, n);
  return cudaGetLastError();
}

cudaError_t GeluBackward(float* dx, const float* x, const float* dout, long n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int block = 256;
  MS_LAUNCH(gelu_backward_kernel, GridFor(n, block), block, 0, stream, dx, x, dout, n);
  return cudaGetLastError();
}

cudaError_t BiasGeluForward(float* out, const float* x, const float* bias, int64_t N, int64_t C, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return cudaSuccess;
  const int block = 256;
  const long n = static_cast<long>(N * C);
  MS_LAUNCH(bias_gelu_forward_kernel, GridFor(n, block), block, 0, stream, out, x, bias, n, static_cast<int>(C));
  return cudaGetLastError();
}

cudaError_t BiasGeluBackward(float* dx, float* dbias, const float* x, const float* bias, const float* dout, int64_t N,
                             int64_t C, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return cudaSuccess;
  const int block = 256;
  const long n = static_cast<long>(N * C);
  MS_LAUNCH(bias_gelu_backward_kernel, GridFor(n, block), block, 0, stream, dx, x, bias, dout, n, static_cast<int>(C));
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const unsigned grid = static_cast<unsigned>((C + kBiasGradCols - 1) / kBiasGradCols);
  MS_LAUNCH(bias_grad_kernel, grid, dim3(kBiasGradCols, kBiasGradRows), 0, stream, dbias, dx, static_cast<long>(N),
            static_cast<int>(C));
  return cudaGetLastError();
}

}  // namespace ms::kernels
