// defines: embedding_forward_kernel, embedding_sort_tiles_kernel, embedding_sort_merge_tile_kernel,
//          embedding_sort_step_kernel, embedding_backward_segments_kernel and their launchers (EmbeddingForward,
//          EmbeddingBackward, EmbeddingBackwardScratchBytes), as ms::ops::EmbeddingForward/Backward.
//
// Backward, deterministic and bit-identical to the reference without atomics:
//   1. sort the N 64-bit keys (uint64(id) << 32 | token) ascending, tokens with ids < 0 (and the padding up to a
//      power of two) as kNoKey = ~0, which sorts last: a bitonic sort, tiles of kSortTile keys in shared memory
//      (embedding_sort_tiles_kernel: every merge up to the tile size in one launch), then for each larger merge
//      size k the steps of stride >= kSortTile in global memory (embedding_sort_step_kernel, one launch each) and
//      the remaining ones in shared memory (embedding_sort_merge_tile_kernel, one launch);
//   2. embedding_backward_segments_kernel: block (p, column tile) returns unless sorted position p starts a run
//      of equal ids; otherwise its threads add, for their columns, the dout rows of the run to dtable row id in
//      key (= token) order, as the reference's token loop does.
// Work: O(P log^2 P) key compare-exchanges (P = N rounded up to a power of two, >= 64) + O(N * C) adds.
// Launches: 2 + sum over k = 2T, 4T, ..., P of (log2(k / T) + 1) with T = min(P, 2048): N <= 2048: 2;
// N = 16384: 11; N = 65536: 22. The accumulation is parallel over distinct ids and columns; one id repeated
// R times is R sequential adds per column (the order the reference fixes).
#include "common.cuh"
#include "kernels.h"

namespace ms::kernels {

constexpr int kEmbeddingForwardMaxThreads = 256;  // forward: BlockThreadsFor(C, ...), one block per token
constexpr int kEmbeddingSegmentMaxThreads = 256;  // backward accumulation: BlockThreadsFor(C, ...) columns
constexpr int kSortTile = 2048;                   // keys per shared-memory tile (16 KiB)
constexpr int kSortTileThreads = kSortTile / 2;   // one compare-exchange pair per thread and step
constexpr int kSortStepThreads = 256;             // global steps: grid-stride over the P / 2 pairs
constexpr int64_t kSortMinKeys = 64;              // P >= 64: tiles of >= 32 threads (whole warps)
constexpr uint64_t kNoKey = ~static_cast<uint64_t>(0);

// ---- kernels ----

// One block per token: out (N, C) row i = table (V, C) row ids[i], or zeros when ids[i] < 0.
__global__ void __launch_bounds__(kEmbeddingForwardMaxThreads)
    embedding_forward_kernel(float* out, const int* ids, const float* table, int C) {
  const long i = blockIdx.x;
  const int id = ids[i];
  for (int c = threadIdx.x; c < C; c += blockDim.x)
    out[i * C + c] = id < 0 ? 0.0f : table[static_cast<long>(id) * C + c];
}

namespace {

// The sort key of token i: id in the high half, token in the low half; kNoKey for ids < 0 and padding (i >= N).
__device__ __forceinline__ uint64_t EmbeddingKey(const int32_t* ids, int64_t i, int64_t N) {
  if (i >= N) return kNoKey;
  const int32_t id = ids[i];
  return id < 0 ? kNoKey : (static_cast<uint64_t>(static_cast<uint32_t>(id)) << 32) | static_cast<uint64_t>(i);
}

// Position of the lower element of compare-exchange pair t for stride j (a power of two).
__device__ __forceinline__ int64_t PairLow(int64_t t, int64_t j) {
  return ((t & ~(j - 1)) << 1) | (t & (j - 1));
}

// The bitonic steps of merge size k with strides j0, j0 / 2, ..., 1 on the tile s of blockDim.x * 2 keys that
// starts at global position base (the direction of each pair comes from its global position). Every thread
// calls it (barriers).
__device__ __forceinline__ void SortTileSteps(uint64_t* s, int64_t base, int64_t k, int j0) {
  for (int j = j0; j > 0; j >>= 1) {
    const int64_t i = PairLow(threadIdx.x, j), l = i + j;
    const bool up = ((base + i) & k) == 0;
    const uint64_t a = s[i], b = s[l];
    if (up ? a > b : a < b) {
      s[i] = b;
      s[l] = a;
    }
    __syncthreads();
  }
}

}  // namespace

// Block b (blockDim.x = T / 2 threads): builds the keys of positions [b T, b T + T) and sorts them bitonically
// (merge sizes 2 .. T), each tile ascending or descending as the global bitonic network wants; keys (P) WRITTEN.
__global__ void __launch_bounds__(kSortTileThreads)
    embedding_sort_tiles_kernel(uint64_t* keys, const int32_t* ids, int64_t N) {
  MS_SHARED_ARRAY(uint64_t, s, kSortTile);
  const int tile = 2 * blockDim.x;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * tile;
  for (int i = threadIdx.x; i < tile; i += blockDim.x) s[i] = EmbeddingKey(ids, base + i, N);
  __syncthreads();
  for (int64_t k = 2; k <= tile; k <<= 1) SortTileSteps(s, base, k, static_cast<int>(k / 2));
  for (int i = threadIdx.x; i < tile; i += blockDim.x) keys[base + i] = s[i];
}

// Merge size k > T, strides T / 2 .. 1 on each tile in shared memory.
__global__ void __launch_bounds__(kSortTileThreads) embedding_sort_merge_tile_kernel(uint64_t* keys, int64_t k) {
  MS_SHARED_ARRAY(uint64_t, s, kSortTile);
  const int tile = 2 * blockDim.x;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * tile;
  for (int i = threadIdx.x; i < tile; i += blockDim.x) s[i] = keys[base + i];
  __syncthreads();
  SortTileSteps(s, base, k, tile / 2);
  for (int i = threadIdx.x; i < tile; i += blockDim.x) keys[base + i] = s[i];
}

// One bitonic step (merge size k, stride j >= T) over all P / 2 pairs, in global memory.
__global__ void __launch_bounds__(kSortStepThreads)
    embedding_sort_step_kernel(uint64_t* keys, int64_t pairs, int64_t k, int64_t j) {
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < pairs;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = PairLow(t, j), l = i + j;
    const bool up = (i & k) == 0;
    const uint64_t a = keys[i], b = keys[l];
    if (up ? a > b : a < b) {
      keys[i] = b;
      keys[l] = a;
    }
  }
}

// Block (p, y): if sorted position p holds a valid key that starts a run of equal ids, thread x adds for column
// c = y * blockDim.x + x the dout rows of the run's tokens, in token order, to dtable row id (ACCUMULATES; one
// block per (id, column tile), so no two blocks touch the same element).
__global__ void __launch_bounds__(kEmbeddingSegmentMaxThreads)
    embedding_backward_segments_kernel(float* dtable, const uint64_t* keys, const float* dout, int64_t N, int64_t C) {
  const int64_t p = blockIdx.x;
  const uint64_t key = keys[p];
  if (key == kNoKey) return;
  const uint64_t id = key >> 32;
  if (p > 0 && (keys[p - 1] >> 32) == id) return;  // not the first of its run
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float* row = dtable + static_cast<int64_t>(id) * C;
  float acc = row[c];
  for (int64_t q = p; q < N; ++q) {
    const uint64_t kq = keys[q];
    if ((kq >> 32) != id) break;  // also ends at kNoKey (ids < 2^31)
    acc += dout[static_cast<int64_t>(kq & 0xffffffffu) * C + c];
  }
  row[c] = acc;
}

// ---- launchers ----

namespace {
int64_t SortKeys(int64_t N) {  // P: N rounded up to a power of two, at least kSortMinKeys
  int64_t p = kSortMinKeys;
  while (p < N) p <<= 1;
  return p;
}
}  // namespace

cudaError_t EmbeddingForward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C,
                             cudaStream_t stream) {
  if (N <= 0 || C <= 0) return cudaSuccess;
  MS_LAUNCH(embedding_forward_kernel, static_cast<unsigned>(N), BlockThreadsFor(C, kEmbeddingForwardMaxThreads), 0,
            stream, out, ids, table, static_cast<int>(C));
  return cudaGetLastError();
}

int64_t EmbeddingBackwardScratchBytes(int64_t N) {
  return N <= 0 ? 0 : SortKeys(N) * static_cast<int64_t>(sizeof(uint64_t));
}

cudaError_t EmbeddingBackward(float* dtable, void* scratch, const int32_t* ids, const float* dout, int64_t N, int64_t C,
                              cudaStream_t stream) {
  if (N <= 0 || C <= 0) return cudaSuccess;
  uint64_t* keys = static_cast<uint64_t*>(scratch);
  const int64_t P = SortKeys(N);
  const int64_t tile = P < kSortTile ? P : kSortTile;
  const unsigned tiles = static_cast<unsigned>(P / tile);
  const int tile_threads = static_cast<int>(tile / 2);
  MS_LAUNCH(embedding_sort_tiles_kernel, tiles, tile_threads, 0, stream, keys, ids, N);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  for (int64_t k = 2 * tile; k <= P; k <<= 1) {
    for (int64_t j = k / 2; j >= tile; j >>= 1) {
      MS_LAUNCH(embedding_sort_step_kernel, GridFor(P / 2, kSortStepThreads), kSortStepThreads, 0, stream, keys, P / 2,
                k, j);
      err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
    MS_LAUNCH(embedding_sort_merge_tile_kernel, tiles, tile_threads, 0, stream, keys, k);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const int block = BlockThreadsFor(C, kEmbeddingSegmentMaxThreads);
  const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>((C + block - 1) / block));
  MS_LAUNCH(embedding_backward_segments_kernel, grid, block, 0, stream, dtable, static_cast<const uint64_t*>(keys),
            dout, N, C);
  return cudaGetLastError();
}

}  // namespace ms::kernels
