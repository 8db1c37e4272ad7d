// megascale CUDA kernels: the launchers (host functions) of every kernel in kernels/*.cu.
//
// The same sources are compiled by nvcc for sm_80/sm_90 (library ms_kernels_cuda) and, for tests on machines
// without a GPU, by the host compiler against the SIMT emulator in kernels/sim (library ms_kernels_sim); see
// docs/cuda.md. Semantics follow the CPU ops in lib/ops/ops.h (same names, same layouts, same WRITES /
// ACCUMULATES contract); tests compare each launcher with ms::ops::ref.
//
// Conventions:
//   - every pointer is device memory (cudaMalloc'd), fp32 unless stated, row-major and contiguous;
//   - a launcher enqueues its kernel(s) on `stream` and returns the CUDA error of the launch
//     (cudaGetLastError), cudaSuccess when fine; an empty problem launches nothing;
//   - no launcher allocates: workspaces are passed in, sized by the *ScratchFloats() helpers;
//   - determinism: every kernel gives the same bits run after run (no float atomics; reductions in a fixed
//     order that depends only on the shapes).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace ms::kernels {

// ---- GeLU (tanh approximation), plain and fused with a bias ---- (kernels/gelu.cu)

// out (n) = gelu(x) (WRITES; out may equal x).
cudaError_t GeluForward(float* out, const float* x, long n, cudaStream_t stream);
// dx (n) = gelu'(x) * dout (WRITES; dx may equal dout).
cudaError_t GeluBackward(float* dx, const float* x, const float* dout, long n, cudaStream_t stream);
// out (N, C) = gelu(x (N, C) + bias (C)) (WRITES; out may equal x); out16 (N, C), unless null, = out rounded to bf16
// (nearest even, as CastFloatToBf16): the next GEMM's operand without a cast kernel. out may be null when out16 is
// not (only the rounding is written; cudaErrorInvalidValue when both are).
cudaError_t BiasGeluForward(float* out, const float* x, const float* bias, int64_t N, int64_t C, cudaStream_t stream,
                            __nv_bfloat16* out16 = nullptr);
// dx (N, C) = gelu'(x + bias) * dout (WRITES; dx may equal dout), dbias (C) += column sums of dx (ACCUMULATES; the
// deterministic tree of BiasGrad, kernels/elementwise.h, bit for bit, summed as dx is computed: one pass, dx not
// read again). scratch: BiasGradScratchFloats(N, C) floats of device memory (overwritten; may be null when that is
// 0). dx16 (N, C), unless null, = dx rounded to bf16 (as CastFloatToBf16: the fc GEMMs' output gradient without a
// cast). dx may be null (then dx is not stored: only dx16, where given, and dbias). Launches 1 kernel or 2.
cudaError_t BiasGeluBackward(float* dx, float* dbias, float* scratch, const float* x, const float* bias,
                             const float* dout, int64_t N, int64_t C, cudaStream_t stream,
                             __nv_bfloat16* dx16 = nullptr);
// The same two with x in bf16 (runtime.activations: bf16, the fc GEMM writing its output rounded to bf16): x is
// widened to fp32 exactly, so the results are those of the fp32 launchers on the widened x, bit for bit. pre16
// (N, C), unless null, = x + bias rounded to bf16 (the GeLU input, as cuBLASLt's GELU_AUX_BIAS epilogue stores
// it; pre16 may equal x).
cudaError_t BiasGeluForward(float* out, const __nv_bfloat16* x, const float* bias, int64_t N, int64_t C,
                            cudaStream_t stream, __nv_bfloat16* out16 = nullptr, __nv_bfloat16* pre16 = nullptr);
cudaError_t BiasGeluBackward(float* dx, float* dbias, float* scratch, const __nv_bfloat16* x, const float* bias,
                             const float* dout, int64_t N, int64_t C, cudaStream_t stream,
                             __nv_bfloat16* dx16 = nullptr);
// ... and with dout in bf16 too (runtime.activations: bf16: the fc-proj backward GEMM writes the GeLU output's
// gradient rounded to bf16): the fp32 launcher's results on the widened x and dout, bit for bit. Here bias may be
// null (x is then the GeLU input itself, as the GELU_AUX_BIAS epilogue stores it: the cuBLASLt fallback); elsewhere
// a null bias is cudaErrorInvalidValue.
cudaError_t BiasGeluBackward(float* dx, float* dbias, float* scratch, const __nv_bfloat16* x, const float* bias,
                             const __nv_bfloat16* dout, int64_t N, int64_t C, cudaStream_t stream,
                             __nv_bfloat16* dx16 = nullptr);

// ---- LayerNorm ---- (kernels/layernorm.cu)

// As ms::ops::LayerNormForward: out (N, C), mean (N), rstd (N) WRITTEN; w, b (C); out16 (N, C), unless null, = out
// rounded to bf16 (nearest even, as CastFloatToBf16). out may be null when out16 is not (only the rounding is
// written; cudaErrorInvalidValue when both are).
cudaError_t LayerNormForward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b,
                             int64_t N, int64_t C, float eps, cudaStream_t stream, __nv_bfloat16* out16 = nullptr);
// The residual add that feeds a LayerNorm, fused into it: res (N, C) = x + part (+ rbias) (+ rbias2) (WRITES; as
// ResidualAdd, kernels/elementwise.h; rbias, rbias2: (C) or null; res may equal x), then LayerNormForward of res
// (out, mean, rstd, out16 as above), which reads the rows it has just written instead of reading res again: the
// bits of the two launchers, one pass less over res.
cudaError_t ResidualLayerNormForward(float* res, float* out, float* mean, float* rstd, const float* x,
                                     const float* part, const float* rbias, const float* rbias2, const float* w,
                                     const float* b, int64_t N, int64_t C, float eps, cudaStream_t stream,
                                     __nv_bfloat16* out16 = nullptr);
// The same with part (N, C) in bf16 (runtime.activations: bf16: the projection GEMM's output as it wrote it), widened
// exactly: the bits of the fp32 launcher on the widened values. A null part: cudaErrorInvalidValue.
cudaError_t ResidualLayerNormForward(float* res, float* out, float* mean, float* rstd, const float* x,
                                     const __nv_bfloat16* part, const float* rbias, const float* rbias2, const float* w,
                                     const float* b, int64_t N, int64_t C, float eps, cudaStream_t stream,
                                     __nv_bfloat16* out16 = nullptr);
// Floats of scratch LayerNormBackward needs: the per-block partial sums of dw, db and dx, 3 * ceil(N / 16) * C.
int64_t LayerNormBackwardScratchFloats(int64_t N, int64_t C);
// As ms::ops::LayerNormBackward: dx (N, C), dw (C), db (C) ACCUMULATE. scratch: device memory of
// LayerNormBackwardScratchFloats(N, C) floats (overwritten). A block of 8 warps per 16 rows (dx: a warp per row;
// dw/db: per-column sums over the block's rows in row order, written once per block), then the block partials
// are added in a fixed order (32 lanes over the blocks, lane sums in lane order). Two launches.
// dx16 (N, C), unless null, = the accumulated dx rounded to bf16 (as CastFloatToBf16).
// dsum (C), unless null, += the column sums of the accumulated dx (the bias gradient of a layer whose output
// gradient dx is: a residual branch's), summed as dw and db are (each block's rows in row order after a block
// barrier, then the blocks in the same fixed order), so that no BiasGrad pass reads dx back; dsum2 (C), unless
// null, += the same sums (a second such bias; only with dsum, else cudaErrorInvalidValue).
cudaError_t LayerNormBackward(float* dx, float* dw, float* db, float* scratch, const float* dout, const float* x,
                              const float* w, const float* mean, const float* rstd, int64_t N, int64_t C,
                              cudaStream_t stream, __nv_bfloat16* dx16 = nullptr, float* dsum = nullptr,
                              float* dsum2 = nullptr);
// The same with dout (N, C) in bf16 (runtime.activations: bf16: the LayerNorm input gradient as its GEMM wrote it),
// widened exactly: the bits of the fp32 launcher on the widened values.
cudaError_t LayerNormBackward(float* dx, float* dw, float* db, float* scratch, const __nv_bfloat16* dout,
                              const float* x, const float* w, const float* mean, const float* rstd, int64_t N,
                              int64_t C, cudaStream_t stream, __nv_bfloat16* dx16 = nullptr, float* dsum = nullptr,
                              float* dsum2 = nullptr);

// ---- Softmax cross-entropy ---- (kernels/crossentropy.cu)

// As ms::ops::CrossEntropyForward: losses (N), lse (N) WRITTEN from logits (N, V), targets (N) (< 0 ignored).
cudaError_t CrossEntropyForward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                                int64_t V, cudaStream_t stream);
// As ms::ops::CrossEntropyBackward: dlogits (N, V) WRITTEN = (softmax - onehot) * dloss[i]; d16 (N, V), unless
// null, = dlogits rounded to bf16 (as CastFloatToBf16: the classifier GEMMs' operand without a cast). dlogits may
// be null when d16 is not (only the rounding is written; cudaErrorInvalidValue when both are).
cudaError_t CrossEntropyBackward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                                 const float* dloss, int64_t N, int64_t V, cudaStream_t stream,
                                 __nv_bfloat16* d16 = nullptr);
// As ms::ops::CrossEntropyFused: the two above in one launch, dlogits written over the logits (N, V); losses, lse
// (N) WRITTEN; d16 as CrossEntropyBackward's. Bit-identical to CrossEntropyForward then
// CrossEntropyBackward(logits, logits, ...). !fp32_dlogits (needs d16): only d16 is written, the logits are left
// as they are (cudaErrorInvalidValue without d16).
cudaError_t CrossEntropyFused(float* losses, float* lse, float* logits, const int32_t* targets, const float* dloss,
                              int64_t N, int64_t V, cudaStream_t stream, __nv_bfloat16* d16 = nullptr,
                              bool fp32_dlogits = true);
// The same three on bf16 logits (runtime.activations: bf16, the classifier GEMM writing them rounded to bf16), widened
// exactly (the bits of the fp32 launchers on the widened logits where Vv = V), over the first Vv of the V columns
// (1 <= Vv <= V, else cudaErrorInvalidValue): the others (the vocabulary padding) are out of the softmax and get a
// zero gradient. The gradient is written in bf16 only (d16; the backward's may be the logits themselves), and the
// fused launcher writes it over the logits.
cudaError_t CrossEntropyForward(float* losses, float* lse, const __nv_bfloat16* logits, const int32_t* targets,
                                int64_t N, int64_t V, int64_t Vv, cudaStream_t stream);
cudaError_t CrossEntropyBackward(__nv_bfloat16* d16, const __nv_bfloat16* logits, const float* lse,
                                 const int32_t* targets, const float* dloss, int64_t N, int64_t V, int64_t Vv,
                                 cudaStream_t stream);
cudaError_t CrossEntropyFused(float* losses, float* lse, __nv_bfloat16* logits, const int32_t* targets,
                              const float* dloss, int64_t N, int64_t V, int64_t Vv, cudaStream_t stream);

// ---- Embedding ---- (kernels/embedding.cu)

// As ms::ops::EmbeddingForward: out (N, C) WRITTEN = table (V, C)[ids]; ids < 0 give zero rows.
cudaError_t EmbeddingForward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C,
                             cudaStream_t stream);
// Bytes of scratch EmbeddingBackward needs: 8 * P, P = N rounded up to a power of two (>= 64).
int64_t EmbeddingBackwardScratchBytes(int64_t N);
// As ms::ops::EmbeddingBackward: dtable (V, C) += scatter of dout (N, C) by ids (ACCUMULATES; ids < 0
// skipped). Deterministic and bit-identical to the reference, no atomics: the (id, token) keys are sorted
// (bitonic, in scratch), then one block per distinct id and column tile adds the dout rows of the id's
// occurrences in token order. Work O(P log^2 P) key compares + O(N * C); launches: 2 for N <= 2048, 11 for
// N = 16384, 22 for N = 65536 (kernels/embedding.cu). N < 2^31. scratch: device memory of
// EmbeddingBackwardScratchBytes(N) bytes, 8-byte aligned (overwritten).
cudaError_t EmbeddingBackward(float* dtable, void* scratch, const int32_t* ids, const float* dout, int64_t N, int64_t C,
                              cudaStream_t stream);

// ---- AdamW, multi-tensor ---- (kernels/adamw.cu)

struct AdamWTensor {
  float* p;        // (n) parameters, updated
  const float* g;  // (n) gradients
  float* m;        // (n) first moment, updated
  float* v;        // (n) second moment, updated
  int64_t n;
  // (n) unless null: the updated parameters rounded to bf16 as CastFloatToBf16 does (the weight copy the bf16
  // GEMMs read, written with the update instead of by a cast kernel at the next step's first use).
  __nv_bfloat16* p16 = nullptr;
};
struct AdamWHyper {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
};
// One AdamW step (torch order, as ms::ops::AdamWStep; step is 1-based) over a list of tensors (or shards)
// in as few launches as the list allows (up to kAdamWMaxTensors tensors per launch); each tensor's p16, unless
// null, gets the bf16 rounding of its updated p.
cudaError_t AdamWMultiTensor(const AdamWTensor* tensors, int count, const AdamWHyper& hp, int64_t step,
                             cudaStream_t stream);

// ---- Casts ---- (kernels/cast.cu)

// out (n) = in rounded to bf16, round-to-nearest-even (NaN stays NaN).
cudaError_t CastFloatToBf16(__nv_bfloat16* out, const float* in, int64_t n, cudaStream_t stream);
// out (n) = in widened to fp32 (exact).
cudaError_t CastBf16ToFloat(float* out, const __nv_bfloat16* in, int64_t n, cudaStream_t stream);

// ---- The device's clock ---- (kernels/clock.cu)

// *acc (one 64-bit word of device memory) += the device's nanosecond clock (%globaltimer) when the kernel runs
// (add), or -= it, modulo 2^64; one thread. A subtraction enqueued before a stream's wait and an addition after it
// leave how long the stream was blocked there (plus the two launches' own time) — inside a CUDA graph too, where
// events carry no timestamp. The one kernel here whose result is not the same from run to run: it reads a clock.
cudaError_t AddDeviceClock(uint64_t* acc, bool add, cudaStream_t stream);

}  // namespace ms::kernels

// Launchers of the newer kernel families, one header each.
#include "attention.h"    // kernels/attention.cu: FlashAttention-2 style sliding-window attention
#include "elementwise.h"  // kernels/elementwise.cu, kernels/lamb.cu: residual/bias adds, norms, vocab-parallel CE, LAMB
#include "matmul.h"       // kernels/matmul.cu: wmma (tensor core) bf16 GEMM
