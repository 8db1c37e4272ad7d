// defines: gelu_forward_kernel, gelu_backward_kernel and their launchers.
// The first CUDA kernels of megascale, compiled whenever nvcc is present so the CUDA part
// of the build is exercised in CI from the start. The CUDA backend issue adds the rest of
// the fused kernels, the SIMT emulation layer that runs them on the CPU in tests, and the
// CUDA Device/Communicator implementations.
#include <cuda_runtime.h>

#include <cmath>

namespace ms::kernels {

// GeLU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
__global__ void gelu_forward_kernel(float* out, const float* x, long n) {
  long i = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float k = 0.7978845608028654f;
  float v = x[i];
  out[i] = 0.5f * v * (1.0f + tanhf(k * (v + 0.044715f * v * v * v)));
}

__global__ void gelu_backward_kernel(float* dx, const float* x, const float* dout, long n) {
  long i = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float k = 0.7978845608028654f;
  float v = x[i];
  float u = k * (v + 0.044715f * v * v * v);
  float t = tanhf(u);
  float du = k * (1.0f + 3.0f * 0.044715f * v * v);
  dx[i] = dout[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
}

// ---- launchers: return the CUDA error of the launch (cudaSuccess when fine) ----

cudaError_t GeluForward(float* out, const float* x, long n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int block = 256;
  const unsigned grid = static_cast<unsigned>((n + block - 1) / block);
  gelu_forward_kernel<<<grid, block, 0, stream>>>(out, x, n);
  return cudaGetLastError();
}

cudaError_t GeluBackward(float* dx, const float* x, const float* dout, long n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int block = 256;
  const unsigned grid = static_cast<unsigned>((n + block - 1) / block);
  gelu_backward_kernel<<<grid, block, 0, stream>>>(dx, x, dout, n);
  return cudaGetLastError();
}

}  // namespace ms::kernels
