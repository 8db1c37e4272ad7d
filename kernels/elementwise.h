// megascale CUDA kernels: launchers of the elementwise / row-bias / position / norm / vocab-parallel
// cross-entropy kernels (kernels/elementwise.cu) and of the multi-tensor LAMB kernels (kernels/lamb.cu): the ops
// of ms::ops::Backend (lib/ops/ops.h) that are not covered by kernels.h. Included at the end of kernels.h.
//
// Conventions as in kernels.h: device pointers, fp32 unless stated, row-major and contiguous; each launcher
// enqueues on `stream` and returns the CUDA error of its launch(es) (cudaSuccess when fine; an empty problem
// launches nothing); nothing allocates (scratch sized by the *Scratch*() helpers); every kernel is
// deterministic (no float atomics; reductions in fixed orders that depend only on the shapes).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace ms::kernels {

struct AdamWHyper;  // kernels.h

// ---- elementwise vectors (n elements) ---- (kernels/elementwise.cu)

// y += x (as ms::ops::AddInPlace).
cudaError_t AddInPlace(float* y, const float* x, int64_t n, cudaStream_t stream);
// out = a + b (WRITES; out may equal a or b).
cudaError_t Add(float* out, const float* a, const float* b, int64_t n, cudaStream_t stream);
// x *= a.
cudaError_t Scale(float* x, float a, int64_t n, cudaStream_t stream);

// ---- rows and biases ---- (kernels/elementwise.cu)

// y (R, C) += b (C) on every row.
cudaError_t AddRowBias(float* y, const float* b, int64_t R, int64_t C, cudaStream_t stream);
// The same over a bf16 y, in place: y = bf16(float(y) + b), rounded to nearest even (the fallback of the bf16 GEMM
// with its bias: the GEMM's bf16 output, then the bias).
cudaError_t AddRowBias(__nv_bfloat16* y, const float* b, int64_t R, int64_t C, cudaStream_t stream);
// out (R, C) = ((x + part) + bias[c]) + bias2[c], in that float order; a null bias or bias2 is skipped (both may
// be null). WRITES out; out may equal x or part. The residual add fused with the row-parallel biases.
cudaError_t ResidualAdd(float* out, const float* x, const float* part, const float* bias, const float* bias2, int64_t R,
                        int64_t C, cudaStream_t stream);
// The same with part (R, C) in bf16 (runtime.activations: bf16: the projection GEMM's output as it wrote it), widened
// exactly: the bits of the fp32 launcher on the widened values. A null part: cudaErrorInvalidValue.
cudaError_t ResidualAdd(float* out, const float* x, const __nv_bfloat16* part, const float* bias, const float* bias2,
                        int64_t R, int64_t C, cudaStream_t stream);
// Floats of scratch BiasGrad (and BiasGeluBackward, kernels.h) need for dy (R, C): chunks * C per-chunk column
// sums, 0 when one chunk covers all rows (then scratch may be null).
int64_t BiasGradScratchFloats(int64_t R, int64_t C);
// db (C) += column sums of dy (R, C) (ACCUMULATES). Deterministic two-stage tree fixed by (R, C) only: the rows are
// cut into chunks (>= 64 rows each, about 1024 / ceil(C / 32) chunks so that chunks x column tiles fill the GPU);
// a block per (chunk, 32-column tile) with 8 row lanes: lane k sums rows k, k + 8, ... of the chunk in order
// (float), the 8 lane sums are added in lane order into the chunk sum (scratch), then the chunk sums are added in
// chunk order and the total is added to db (with one chunk: directly). Not bit-identical to a plain row loop (rtol
// ~1e-6 on well-conditioned sums). scratch: BiasGradScratchFloats(R, C) floats of device memory (overwritten).
// Launches 1 kernel (one chunk) or 2. C < 2^21.
cudaError_t BiasGrad(float* db, float* scratch, const float* dy, int64_t R, int64_t C, cudaStream_t stream);
// The same over a bf16 dy (widened exactly; the fc gradient the cuBLASLt GeLU-gradient epilogue writes in bf16).
cudaError_t BiasGrad(float* db, float* scratch, const __nv_bfloat16* dy, int64_t R, int64_t C, cudaStream_t stream);

// ---- learned positions ---- (kernels/elementwise.cu)

// x (R, C) += wpe[(row0 + r) % T] for each row r (wpe (T, C); row0 >= 0, T >= 1).
cudaError_t AddPositions(float* x, const float* wpe, int64_t R, int64_t C, int64_t T, int64_t row0,
                         cudaStream_t stream);
// dwpe[(row0 + r) % T] += dx[r] (ACCUMULATES; dx (R, C), dwpe (T, C)). One thread per (t, c) adds its rows
// r = t - row0 (mod T), then + T, ... to dwpe in row order: bit-identical to the plain loop over rows, no atomics.
cudaError_t PositionsBackward(float* dwpe, const float* dx, int64_t R, int64_t C, int64_t T, int64_t row0,
                              cudaStream_t stream);

// ---- sums of squares of several vectors ---- (kernels/elementwise.cu)

// Doubles of scratch SumSquaresMulti needs for vectors of sizes ns (count of them): one per chunk of
// kSumSquaresChunk = 8192 elements of each vector.
int64_t SumSquaresScratchDoubles(const int64_t* ns, int count);
// out_dev[i] (device memory, double) WRITTEN = sum_j xs[i][j]^2 for i < count, accumulated in double:
// each chunk of 8192 elements by one block (thread t sums elements t, t + 256, ... of the chunk; the 256
// partials by a fixed warp-shuffle tree, then the 8 warp sums in order) into scratch, then one warp per vector
// adds its chunk sums (lane l sums chunks l, l + 32, ... in order, then a fixed shuffle tree). Not bit-identical
// to ops::SumSquares (tests: rtol 1e-12). xs_host_array / ns_host_array are HOST arrays of count device pointers and
// sizes (n == 0 gives 0; its pointer is not read); they travel by value in the kernel parameters, up to 64
// vectors per launch pair. scratch: SumSquaresScratchDoubles(ns, count) doubles of device memory (overwritten).
cudaError_t SumSquaresMulti(double* out_dev, double* scratch, const float* const* xs_host_array,
                            const int64_t* ns_host_array, int count, cudaStream_t stream);

// ---- vocab-parallel softmax cross-entropy ---- (kernels/elementwise.cu)
// As ms::ops::Backend::VocabParallel*: logits (N, V) are this rank's vocab columns [vstart, vstart + V);
// targets (N) are global vocab ids (< 0 ignored). Between the pieces the caller reduces mx (max) and se, tl
// (sum) across the tensor-parallel ranks: RowStats, then the max reduced (into a copy), Rebase, the sums
// reduced, Finish. One block per row for the row reductions.

// One pass over each row (a block per row: the max, then the row again, normally from L2): mx (N) WRITES the
// local row maxima (exact); se (N) WRITES sum_j exp(logits[i, j] - mx[i]) with the local max: expf in float,
// accumulated in double (per thread, then a fixed shuffle tree and the warp sums in order), rounded to float
// (rtol ~1e-6 vs a double reference); tl (N) WRITES logits[i, targets[i] - vstart] when targets[i] >= 0 and that
// column is in this rank's range, else 0. V >= 1.
cudaError_t VocabParallelRowStats(float* mx, float* se, float* tl, const float* logits, const int32_t* targets,
                                  int64_t vstart, int64_t N, int64_t V, cudaStream_t stream);
// se (N) *= expf(mx_local - mx_global): the local sums rebased on the max reduced across ranks (before the sums
// are reduced).
cudaError_t VocabParallelRebase(float* se, const float* mx_local, const float* mx_global, int64_t N,
                                cudaStream_t stream);
// lse (N) WRITES mx + logf(se); losses (N) WRITES lse - tl, 0 for targets < 0 (se, tl reduced across ranks).
cudaError_t VocabParallelFinish(float* losses, float* lse, const float* mx, const float* se, const float* tl,
                                const int32_t* targets, int64_t N, cudaStream_t stream);
// dlogits (N, V) WRITES expf(logits - lse[i]) * dloss, minus dloss at the target's column when it is in this
// rank's range; rows with targets < 0 are 0. dloss is a scalar (e.g. 1 / number of valid targets). d16 (N, V),
// unless null, = dlogits rounded to bf16 (as CastFloatToBf16); dlogits may be null when d16 is not (only the
// rounding is written; cudaErrorInvalidValue when both are).
cudaError_t VocabParallelBackward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                                  float dloss, int64_t vstart, int64_t N, int64_t V, cudaStream_t stream,
                                  __nv_bfloat16* d16 = nullptr);

// ---- LAMB, multi-tensor ---- (kernels/lamb.cu)

struct LambTensor {
  float* u;        // (n) update direction, WRITTEN
  const float* p;  // (n) parameters, read
  const float* g;  // (n) gradients, read
  float* m;        // (n) first moment, updated
  float* v;        // (n) second moment, updated
  int64_t n;
};
// As ms::ops::LambDirection for each tensor (fp32, the fast path's order: m = lerp(m, g, 1 - b1),
// v = v * b2 + (1 - b2) * g * g, u = (m / bc1) / (sqrt(v / bc2) + eps) + wd * p with 1/bc1, 1/bc2 computed in
// double and rounded to float; hp.lr unused, hp.weight_decay for every tensor of the call; step is 1-based).
// Up to 24 tensors per launch, in as few launches as the list allows. u must not alias p, g, m or v.
cudaError_t LambDirectionMultiTensor(const LambTensor* tensors, int count, const AdamWHyper& hp, int64_t step,
                                     cudaStream_t stream);
// p (n) += (-lr * trust_ratio) * u, as ms::ops::LambApply (the scalar product rounded to float first); p16 (n),
// unless null, = the updated p rounded to bf16 as CastFloatToBf16 does (the GEMMs' weight copy).
cudaError_t LambApply(float* p, const float* u, int64_t n, float lr, float trust_ratio, cudaStream_t stream,
                      __nv_bfloat16* p16 = nullptr);

}  // namespace ms::kernels
