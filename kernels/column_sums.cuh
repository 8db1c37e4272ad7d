// kernels/column_sums.cuh: the deterministic column sums of an (R, C) matrix that every bias gradient uses
// (BiasGrad, kernels/elementwise.cu; the bias + GeLU backward, kernels/gelu.cu), shared so that a kernel which
// computes the matrix on the fly adds it up in exactly BiasGrad's order (the same bits).
// defines: kColSumCols, kColSumLanes, kColSumThreads, ColumnSumPlan, PlanColumnSums, ColumnSumChunk; declares
//          FinishColumnSums (kernels/elementwise.cu).
#pragma once

#include <cstdint>

#include "common.cuh"

namespace ms::kernels {

// Two stages: blocks of kColSumCols columns x kColSumLanes row lanes, one per (row chunk, column tile), write
// per-chunk column sums; a finishing kernel adds them in chunk order.
constexpr int kColSumCols = 32;                             // columns per block (threadIdx.x): one warp row
constexpr int kColSumLanes = 8;                             // row lanes per block (threadIdx.y)
constexpr int kColSumThreads = kColSumCols * kColSumLanes;  // 256
constexpr int64_t kColSumMinChunkRows = 64;                 // a chunk has at least this many rows (8 per lane)...
constexpr int64_t kColSumTargetBlocks = 1024;  // ...and chunks x column tiles aims at ~8 blocks per SM (H100: 132)

// The tree is fixed by (R, C) only.
struct ColumnSumPlan {
  int64_t chunk_rows, chunks, tiles;
};
inline ColumnSumPlan PlanColumnSums(int64_t R, int64_t C) {
  const int64_t tiles = (C + kColSumCols - 1) / kColSumCols;
  const int64_t want = (kColSumTargetBlocks + tiles - 1) / tiles;            // chunks to fill the GPU
  const int64_t most = (R + kColSumMinChunkRows - 1) / kColSumMinChunkRows;  // chunks of >= 64 rows
  const int64_t chunks = want < most ? want : most;
  const int64_t chunk_rows = (R + chunks - 1) / chunks;
  return {chunk_rows, (R + chunk_rows - 1) / chunk_rows, tiles};
}

// Stage 1, the body of a kernel launched on grid (plan.chunks, plan.tiles) with blocks of (kColSumCols,
// kColSumLanes) threads: column c = blockIdx.y * 32 + threadIdx.x; row lane y adds value(load(r, c), r, c) for rows
// r0 + y, r0 + y + 8, ... < r1 of the chunk in order (value may store what it computes: it is called once per
// element), then thread (x, 0) adds the 8 lane sums in lane order. load(r, c) reads the element's inputs (and only
// reads): a lane issues the loads of kColSumBatch rows before it computes any of them, so their latencies overlap
// where value's stores would otherwise keep each load behind the previous row's store (possible aliasing); the sums
// keep their order. With partial != null the chunk sum goes to partial[chunk * C + c] (WRITES); with a single chunk
// (partial == null) it is added to db[c] directly. lanes: the block's shared [kColSumLanes][kColSumCols + 1] floats.
constexpr int kColSumBatch = 4;  // rows a lane loads before computing them
template <class Load, class Value>
__device__ __forceinline__ void ColumnSumChunk(float (*lanes)[kColSumCols + 1], float* db, float* partial, int64_t R,
                                               int64_t C, int64_t chunk_rows, const Load& load, const Value& value) {
  const int64_t c = static_cast<int64_t>(blockIdx.y) * kColSumCols + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < R ? r0 + chunk_rows : R;
  float acc = 0.0f;
  if (c < C) {
    int64_t r = r0 + threadIdx.y;
    for (; r + (kColSumBatch - 1) * kColSumLanes < r1; r += kColSumBatch * kColSumLanes) {
      decltype(load(r, c)) in[kColSumBatch];
      MS_UNROLL
      for (int j = 0; j < kColSumBatch; ++j) in[j] = load(r + j * kColSumLanes, c);
      MS_UNROLL
      for (int j = 0; j < kColSumBatch; ++j) acc += value(in[j], r + j * kColSumLanes, c);
    }
    for (; r < r1; r += kColSumLanes) acc += value(load(r, c), r, c);
  }
  lanes[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float sum = 0.0f;
    for (int k = 0; k < kColSumLanes; ++k) sum += lanes[k][threadIdx.x];
    if (partial != nullptr) {
      partial[static_cast<int64_t>(blockIdx.x) * C + c] = sum;
    } else {
      db[c] += sum;
    }
  }
}

// Stage 2 (when plan.chunks > 1): db[c] += sum of partial[k * C + c] over the chunks k in order.
cudaError_t FinishColumnSums(float* db, const float* partial, int64_t chunks, int64_t C, cudaStream_t stream);

}  // namespace ms::kernels
