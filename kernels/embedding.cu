// defines: embedding_forward_kernel, embedding_backward_kernel and their launchers (EmbeddingForward,
// EmbeddingBackward), as ms::ops::EmbeddingForward/Backward.
#include "common.cuh"
#include "kernels.h"

namespace ms::kernels {

// ---- kernels ----

// One block per token: out (N, C) row i = table (V, C) row ids[i], or zeros when ids[i] < 0.
__global__ void embedding_forward_kernel(float* out, const int* ids, const float* table, int C) {
  const long i = blockIdx.x;
  const int id = ids[i];
  for (int c = threadIdx.x; c < C; c += blockDim.x)
    out[i * C + c] = id < 0 ? 0.0f : table[static_cast<long>(id) * C + c];
}

// One block per token i. The block first asks (__syncthreads_or) whether ids[i] occurs at an earlier token; if
// not, token i owns row ids[i] and adds the dout rows of every occurrence j >= i, in token order, each
// thread for its columns. So every row of dtable is written by exactly one block, with the same sequence of
// float additions as the reference: deterministic and bit-identical, no atomics.
__global__ void embedding_backward_kernel(float* dtable, const int* ids, const float* dout, int N, int C) {
  const int i = blockIdx.x;
  const int id = ids[i];
  if (id < 0) return;  // uniform across the block: nobody waits at the barrier below
  bool earlier = false;
  for (int j = threadIdx.x; j < i; j += blockDim.x) earlier = earlier || ids[j] == id;
  if (__syncthreads_or(earlier)) return;  // uniform: the barrier's result is the same for all threads
  float* row = dtable + static_cast<long>(id) * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = row[c];
    for (int j = i; j < N; ++j) {
      if (ids[j] == id) acc += dout[static_cast<long>(j) * C + c];
    }
    row[c] = acc;
  }
}

// ---- launchers ----

cudaError_t EmbeddingForward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C,
                             cudaStream_t stream) {
  if (N <= 0 || C <= 0) return cudaSuccess;
  MS_LAUNCH(embedding_forward_kernel, static_cast<unsigned>(N), BlockThreadsFor(C, 256), 0, stream, out, ids, table,
            static_cast<int>(C));
  return cudaGetLastError();
}

cudaError_t EmbeddingBackward(float* dtable, const int32_t* ids, const float* dout, int64_t N, int64_t C,
                              cudaStream_t stream) {
  if (N <= 0 || C <= 0) return cudaSuccess;
  MS_LAUNCH(embedding_backward_kernel, static_cast<unsigned>(N), BlockThreadsFor(C, 256), 0, stream, dtable, ids, dout,
            static_cast<int>(N), static_cast<int>(C));
  return cudaGetLastError();
}

}  // namespace ms::kernels
