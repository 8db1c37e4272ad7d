// kernels/multi_tensor.cuh: one launch over a list of tensors (the optimizers' multi-tensor steps).
// defines: TensorBatch, BatchTensorOf, LaunchTensorBatches, TorchLerp
#pragma once

#include <cstdint>

#include "sim/simt.h"

namespace ms::kernels {

// Up to kMax tensors of one launch, by value in the kernel's parameters: block b works on chunk
// b - first_block[k] of tensor t[k], where first_block[k] <= b < first_block[k + 1].
template <typename Tensor, int kMax>
struct TensorBatch {
  Tensor t[kMax];
  int64_t first_block[kMax + 1];
  int count;
};

// The index k of the tensor block `block` works on (count >= 1; a linear scan: kMax is small).
template <typename Tensor, int kMax>
__device__ __forceinline__ int BatchTensorOf(const TensorBatch<Tensor, kMax>& batch, int64_t block) {
  int k = 0;
  while (k + 1 < batch.count && block >= batch.first_block[k + 1]) ++k;
  return k;
}

// Host side: splits tensors[0, count) into batches of up to kMax non-empty tensors (each tensor's `n` elements in
// blocks of `chunk`, at most 2^31 - 1 blocks a launch; an empty tensor is skipped) and calls
// launch(batch, blocks) -> cudaError_t for each, in order; stops at the first error and returns it.
template <int kMax, typename Tensor, typename Launch>
cudaError_t LaunchTensorBatches(const Tensor* tensors, int count, int64_t chunk, Launch&& launch) {
  int i = 0;
  while (i < count) {
    TensorBatch<Tensor, kMax> batch{};
    int64_t blocks = 0;
    while (i < count && batch.count < kMax) {
      if (tensors[i].n <= 0) {
        ++i;
        continue;
      }
      const int64_t nb = (tensors[i].n + chunk - 1) / chunk;
      if (batch.count > 0 && blocks + nb > 2147483647) break;
      batch.first_block[batch.count] = blocks;
      batch.t[batch.count++] = tensors[i++];
      blocks += nb;
    }
    if (batch.count == 0) break;
    batch.first_block[batch.count] = blocks;
    const cudaError_t err = launch(batch, blocks);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// torch.lerp for floats: start + weight * (end - start), computed from the nearer end (as torch does).
__device__ __forceinline__ float TorchLerp(float start, float end, float weight) {
  return weight < 0.5f ? start + weight * (end - start) : end - (end - start) * (1.0f - weight);
}

}  // namespace ms::kernels
