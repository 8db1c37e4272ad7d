// defines: layernorm_forward_kernel, layernorm_backward_kernel, layernorm_param_grad_kernel and their
// launchers (LayerNormForward, LayerNormBackward, LayerNormBackwardScratchFloats).
// LayerNorm over the last dim, as ms::ops::LayerNormForward/Backward (biased variance, rstd saved).
#include "common.cuh"
#include "kernels.h"

namespace ms::kernels {

// ---- kernels ----

// One block per row (blockDim.x a multiple of 32): mean and variance by two block reductions (warp
// shuffles, then shared memory across warps), then the normalized row.
// out, x: (N, C); w, b: (C); mean, rstd: (N).
__global__ void layernorm_forward_kernel(float* out, float* mean, float* rstd, const float* x, const float* w,
                                         const float* b, int C, float eps) {
  MS_SHARED_ARRAY(float, scratch, 32);
  const long row = blockIdx.x;
  const float* xr = x + row * C;
  float sum = 0.0f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) sum += xr[c];
  const float m = BlockSum(sum, scratch) / C;
  float var = 0.0f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float d = xr[c] - m;
    var += d * d;
  }
  const float s = rsqrtf(BlockSum(var, scratch) / C + eps);
  float* o = out + row * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = (xr[c] - m) * s * w[c] + b[c];
  if (threadIdx.x == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

// Block g handles rows g, g + G, ... (G = gridDim.x): dx of each row, and per-column partial sums of
// dw = sum(dout * xhat) and db = sum(dout) in partial (G, 2, C) (each column owned by one thread).
__global__ void layernorm_backward_kernel(float* dx, float* partial, const float* dout, const float* x, const float* w,
                                          const float* mean, const float* rstd, int N, int C) {
  MS_SHARED_ARRAY(float, scratch, 32);
  float* pdw = partial + static_cast<long>(blockIdx.x) * 2 * C;
  float* pdb = pdw + C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    pdw[c] = 0.0f;
    pdb[c] = 0.0f;
  }
  for (long row = blockIdx.x; row < N; row += gridDim.x) {
    const float* xr = x + row * C;
    const float* gr = dout + row * C;
    const float m = mean[row], s = rstd[row];
    float sum_dnorm = 0.0f, sum_dnorm_xhat = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      const float xhat = (xr[c] - m) * s;
      const float dnorm = gr[c] * w[c];
      sum_dnorm += dnorm;
      sum_dnorm_xhat += dnorm * xhat;
    }
    const float mean_dnorm = BlockSum(sum_dnorm, scratch) / C;
    const float mean_dnorm_xhat = BlockSum(sum_dnorm_xhat, scratch) / C;
    float* dxr = dx + row * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      const float xhat = (xr[c] - m) * s;
      const float dnorm = gr[c] * w[c];
      dxr[c] += s * (dnorm - mean_dnorm - xhat * mean_dnorm_xhat);
      pdw[c] += gr[c] * xhat;
      pdb[c] += gr[c];
    }
  }
}

// dw[c] += sum_g partial[g][0][c], db[c] += sum_g partial[g][1][c], in g order: deterministic.
__global__ void layernorm_param_grad_kernel(float* dw, float* db, const float* partial, int G, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float sw = 0.0f, sb = 0.0f;
  for (int g = 0; g < G; ++g) {
    sw += partial[static_cast<long>(g) * 2 * C + c];
    sb += partial[static_cast<long>(g) * 2 * C + C + c];
  }
  dw[c] += sw;
  db[c] += sb;
}

// ---- launchers ----

namespace {
constexpr int64_t kBackwardBlocks = 128;  // G: fixed by the shapes only, so results do not depend on the GPU
int64_t BackwardBlocks(int64_t N) {
  return N < kBackwardBlocks ? N : kBackwardBlocks;
}
}  // namespace

cudaError_t LayerNormForward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b,
                             int64_t N, int64_t C, float eps, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return cudaSuccess;
  const int block = BlockThreadsFor(C, 256);
  MS_LAUNCH(layernorm_forward_kernel, static_cast<unsigned>(N), block, 0, stream, out, mean, rstd, x, w, b,
            static_cast<int>(C), eps);
  return cudaGetLastError();
}

int64_t LayerNormBackwardScratchFloats(int64_t N, int64_t C) {
  return 2 * BackwardBlocks(N) * C;
}

cudaError_t LayerNormBackward(float* dx, float* dw, float* db, float* scratch, const float* dout, const float* x,
                              const float* w, const float* mean, const float* rstd, int64_t N, int64_t C,
                              cudaStream_t stream) {
  if (N <= 0 || C <= 0) return cudaSuccess;
  const int block = BlockThreadsFor(C, 256);
  const int G = static_cast<int>(BackwardBlocks(N));
  MS_LAUNCH(layernorm_backward_kernel, G, block, 0, stream, dx, scratch, dout, x, w, mean, rstd, static_cast<int>(N),
            static_cast<int>(C));
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  MS_LAUNCH(layernorm_param_grad_kernel, GridFor(C, 256), 256, 0, stream, dw, db, scratch, G, static_cast<int>(C));
  return cudaGetLastError();
}

}  // namespace ms::kernels
