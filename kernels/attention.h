// megascale CUDA kernels: causal sliding-window attention, FlashAttention-2 style, fp32 (kernels/attention.cu)
// and bf16 on tensor cores (kernels/attention_tc.cu).
//
// Same contract as ms::ops::AttentionForward / AttentionBackward (lib/ops/ops.h); conventions as in
// kernels/kernels.h (device pointers, launch on `stream`, return the launch error, no allocation,
// deterministic: no float atomics, fixed reduction orders).
//
//   qkv:  (B, T, 3, H, D) per token: H query heads, then H key heads, then H value heads, each D wide.
//   out:  (B, T, H, D);  lse: (B, H, T) log-sum-exp of the scaled scores of each query.
//   Query t attends keys s with t - window < s <= t when window > 0 (window >= T is plain causal), all
//   s <= t when window == 0. Scores are scaled by 1/sqrt(D).
//
// Tiling: a block takes 32 query rows (forward, dQ) or 32 keys (dK/dV) of one (b, h) and loops over the
// 32-wide tiles of the other side held in shared memory, visiting only the tiles that intersect the causal
// window of some row of its tile; the (T, T) matrix is never formed. Keys outside a query's window have no
// influence at all on its outputs, even when they hold NaN or Inf.
//
// Limits: 1 <= D <= kAttentionMaxHeadDim (128) and window >= 0, else cudaErrorInvalidValue (nothing is
// launched); also when T > 2^30 or B*T*H >= 2^31. B, T or H <= 0 is an empty problem (cudaSuccess).
// Dynamic shared memory per block: up to 73 KiB at D = 128 (the launchers raise the kernels' limit with
// cudaFuncSetAttribute when above 48 KiB).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ms::kernels {

constexpr int64_t kAttentionMaxHeadDim = 128;

// As ms::ops::AttentionForward: out (B, T, H, D) and lse (B, H, T) WRITTEN from qkv (B, T, 3, H, D).
cudaError_t AttentionForward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t H, int64_t D,
                             int64_t window, cudaStream_t stream);
// Floats of scratch AttentionBackward needs (the row terms D_t = sum_d dout * out, one per (b, h, t)).
int64_t AttentionBackwardScratchFloats(int64_t B, int64_t T, int64_t H, int64_t D);
// As ms::ops::AttentionBackward: dqkv (B, T, 3, H, D) WRITTEN entirely, from dout (B, T, H, D), qkv, and
// the forward's out (B, T, H, D) and lse (B, H, T); probabilities are recomputed from lse. scratch: device
// memory of AttentionBackwardScratchFloats(B, T, H, D) floats (overwritten). Three kernels: the row terms,
// dK/dV (a block per key tile, looping over the query tiles that can see it) and dQ (a block per query
// tile, looping over the key tiles it can see); each gradient element is summed by one thread in a fixed order.
cudaError_t AttentionBackward(float* dqkv, float* scratch, const float* dout, const float* qkv, const float* out,
                              const float* lse, int64_t B, int64_t T, int64_t H, int64_t D, int64_t window,
                              cudaStream_t stream);

// bf16 tensor-core variants (kernels/attention_tc.cu): the same contract, arguments and scratch, with every
// product on tensor cores (nvcuda::wmma m16n16k16): q, k, v, dout, the probabilities P and dS are rounded to
// bf16 as operands, sums and softmax statistics (max, sum, lse) stay fp32, outputs are fp32. Tiles are 64
// rows/keys wide (4 warps of 16). Extra limit: D a multiple of 16 (else cudaErrorInvalidValue). Unlike the
// fp32 kernels, a NaN or Inf in a token that shares a 64-row tile with a query's window reaches that query
// (0 * NaN in the product); finite inputs give the same masking. Dynamic shared memory per block, with the
// softmax through shared memory (kShared below) and without the asynchronous copies' second buffers: at D = 64,
// 44 KiB (forward), 60 KiB (dQ), 70 KiB (dK/dV); at D = 128, 76, 76 and 120 KiB (the dK/dV kernel keeps its K and V
// operands in shared memory there); with the softmax in registers, which needs no P or dS areas, 9 KiB less (18 KiB
// less in the dK/dV kernel). out16 (B, T, H, D) / dqkv16 (B, T, 3, H, D) bf16, unless
// null: the outputs also rounded to bf16 (nearest even, as CastFloatToBf16) — the GEMMs' operands that read them
// (attn.proj's input, qkv's output gradient) without a cast kernel. qkv_bias (3, H, D), unless null: the qkv
// GEMM's bias, added to q, k and v as they are loaded (the fp32 add of a separate bias kernel, so the same bits as
// attention over qkv + bias), when qkv holds the GEMM output without it; the forward and the backward both need it.
cudaError_t AttentionForwardBf16(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t H, int64_t D,
                                 int64_t window, cudaStream_t stream, __nv_bfloat16* out16 = nullptr,
                                 const float* qkv_bias = nullptr);
//
// Where the tensor-core kernels run their softmax. kAuto (the default): in registers — the scores (and dP) stay in
// the wmma accumulator fragments, each lane masks (only on tiles that are not inside every row's band), scales and
// exponentiates its own elements and the lanes of a row reduce its max and sum by shuffles, P and dS are rounded to
// bf16 straight into the matrix_a fragments of the next product, and the forward's output accumulates in fragments —
// where a probe kernel, run once per process at the first call (synchronizing its stream), finds the fragment layouts
// the code assumes (accumulator and bf16 matrix_a fragments holding the same elements in each lane: sm_80 and sm_90's
// mma.sync m16n8k16 operand layouts, and the emulator's); else through shared memory (the scores stored as fp32, two
// lanes per row). The two give the same results within fp32 rounding (sums in other orders). kAuto's backward at D > 64
// runs through shared memory: faster there on an H200 with bf16 inputs (docs/PERFORMANCE.md). kRegisters and kShared
// force one (tests, kernels_bench); kRegisters where the layout differs: cudaErrorNotSupported. Process-wide.
enum class AttentionTcSoftmax { kAuto, kRegisters, kShared };
void SetAttentionTcSoftmax(AttentionTcSoftmax mode);
// kAuto's rule for the backward: the shared-memory softmax at this head size (the one place it is decided; the
// autotune, lib/cuda/attention_tune.cpp, follows it: the register-softmax split dK/dV kernel gives the default's bits
// only where this is false). kernels_bench's `... regs` rows time the other choice at D > 64.
constexpr bool AttentionTcBackwardSharedByDefault(int64_t D) {
  return D > 64;
}
//
// With bf16 operands (qkv, and dout in the backward) whose rows are 16-byte aligned, the tensor-core kernels copy the
// tiles of their loop (K and V in the forward and dQ kernels, Q, dout, lse and drow in the dK/dV kernel) with
// asynchronous copies (cp.async) into two buffers used in turn, the next tile's copies in flight while the block
// computes on this one; the qkv bias is then added in shared memory. The same bits as the synchronous loads, which
// SetAttentionTcAsyncLoads(false) selects (tests, kernels_bench). Process-wide; on by default.
void SetAttentionTcAsyncLoads(bool on);
//
// The forward with FlashAttention-2's tiling: blocks of 128 query rows, each warp 32 of them as two 16-row fragment
// rows, so that each K or V fragment a warp loads from shared memory feeds two MMAs (the default forward's warps own
// one fragment row: a fragment load per MMA). Where the default would run the register softmax with asynchronous
// copies (bf16 qkv with 16-byte aligned rows, the layout probe holding); elsewhere the default runs. Up to D = 64 a
// warp's query fragments stay in registers; above, they are read from shared memory at each key tile (the two
// fragment rows' output accumulators take 128 registers a lane at D = 128). The same bits as the default forward;
// 2 blocks of 4 warps per SM by registers (the default: 3 at D <= 64, 2 above). Off by default
// until a GPU measurement (kernels_bench's `... wide` row) shows it faster, or the CUDA backend's autotuning
// (runtime.attention_autotune) picks it. Process-wide. AttentionTcWideForwardLaunches: the forwards the process has
// launched so.
void SetAttentionTcWideForward(bool on);
int64_t AttentionTcWideForwardLaunches();
//
// Where D equals the instance's head-dimension bound (64 or 128: the GPT configs) the register forward with
// asynchronous copies runs an instance whose two products loop over D's fragments with compile-time bounds, so that
// the next fragments' ldmatrix can be issued ahead of the current MMAs (no branch on D between them); so do the
// backward's 4-warp dK/dV kernel and stored-dS dQ kernel at D = 64 (on sm_90 and later). The same bits as the
// run-time-bound instances, which SetAttentionTcFixedBounds(false) selects (tests, kernels_bench's `... varD` rows).
// Process-wide; on by default. AttentionTcFixedBoundsLaunches: the forward, dK/dV and dQ kernels launched so, in
// this process.
void SetAttentionTcFixedBounds(bool on);
int64_t AttentionTcFixedBoundsLaunches();
//
// The backward's dK/dV kernel with FlashAttention-2's split: blocks of 64 keys with 8 warps, each warp 16 keys and
// half of the head's columns of dK and dV (half the accumulator registers of the default's 4 warps, which hold whole
// 16 x D rows), P^T and dS^T exchanged through shared memory between the two warps of a row group. Where the
// backward's operands are bf16 with 16-byte aligned rows (the asynchronous copies run), the layout probe holds and
// the softmax is not forced through shared memory (SetAttentionTcSoftmax(kShared)), at D a multiple of 32 (at
// D > 64 too, where kAuto's 4-warp dK/dV kernel runs its softmax through shared memory); elsewhere the default runs.
// The same bits as the 4-warp kernel with the register softmax (dqkv, dqkv16, the bias gradient, the dS tiles). Off
// by default until a GPU measurement (kernels_bench's `... split` rows) shows it faster, or the CUDA backend's
// autotuning (runtime.attention_autotune) picks it. Process-wide.
void SetAttentionTcSplitDkDv(bool on);
// The backwards the process has launched with the split dK/dV kernel: what a caller reads before and after its call
// to learn which kernel ran (where no other thread of the process launches an attention backward meanwhile: a
// training rank's backend runs its ops from one thread).
int64_t AttentionTcSplitDkDvLaunches();
//
// dqkv_bias (3, H, D), unless null: += the column sums of dqkv over its B * T rows — the qkv bias gradient, made as
// the gradient rows are stored (each warp sums its 16 rows in row order, then BiasGrad's tree adds up the
// B * ceil(T / 16) chunks: deterministic), so that no pass reads dqkv back. It needs scratch of
// AttentionBackwardScratchFloats + AttentionBiasGradScratchFloats floats. dqkv may then be null (only its rounding
// dqkv16 and the bias gradient are written); dqkv, dqkv16 and dqkv_bias all null: cudaErrorInvalidValue.
int64_t AttentionBiasGradScratchFloats(int64_t B, int64_t T, int64_t H, int64_t D);
//
// ds_tiles, unless null: device memory of AttentionDsTileBytes(B, T, H, window) bytes, 16-byte aligned (else
// cudaErrorInvalidValue; overwritten), where the backward keeps dS between its two kernels: the dK/dV kernel, which
// forms dS for every (key tile, query tile) pair it visits, also stores it (bf16, the rounding the dQ product takes
// anyway; 8 KiB a pair), and the dQ kernel makes dQ = dS K from it — one product per pair where, with ds_tiles null,
// it forms S, dP and dS again: 5 products instead of 7, FlashAttention-2's count, still without float atomics (each
// dQ element summed by one thread in a fixed order: deterministic). With the register softmax the same bits as
// without ds_tiles under the emulator (on a GPU within fp32 rounding: S^T and S are summed by the tensor cores in
// their own orders); through shared memory the dK/dV kernel's dS takes expf where the dQ kernel's takes exp2f (within
// fp32 rounding too). Causal without a window at T = 1024 that is 136 tiles, 1.1 MB, per (b, h). That dQ kernel's
// dynamic shared memory: 18 KiB at D = 64 (36.25 KiB with the asynchronous copies), 33 KiB at D = 128 (52.5 KiB).
int64_t AttentionDsTileBytes(int64_t B, int64_t T, int64_t H, int64_t window);
cudaError_t AttentionBackwardBf16(float* dqkv, float* scratch, const float* dout, const float* qkv, const float* out,
                                  const float* lse, int64_t B, int64_t T, int64_t H, int64_t D, int64_t window,
                                  cudaStream_t stream, __nv_bfloat16* dqkv16 = nullptr, const float* qkv_bias = nullptr,
                                  float* dqkv_bias = nullptr, __nv_bfloat16* ds_tiles = nullptr);

// The same two with bf16 inputs (runtime.activations: bf16): qkv (B, T, 3, H, D) as the qkv GEMM wrote it, dout
// (B, T, H, D) as the attention projection's backward GEMM wrote it, and the forward's output read back as its bf16
// rounding — out16, or out rounded as it is read (exactly one of them non-null: the same bits). The results of the
// fp32 calls on the widened qkv and dout and on out widened from its rounding, bit for bit (q, k, v and dout are
// rounded to bf16 anyway; with qkv_bias the fp32 add, then the rounding, as above); the loads take half the bytes.
// The forward's out may be null when out16 is not (only the rounding is written).
cudaError_t AttentionForwardBf16(float* out, float* lse, const __nv_bfloat16* qkv, int64_t B, int64_t T, int64_t H,
                                 int64_t D, int64_t window, cudaStream_t stream, __nv_bfloat16* out16 = nullptr,
                                 const float* qkv_bias = nullptr);
cudaError_t AttentionBackwardBf16(float* dqkv, float* scratch, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                                  const float* out, const __nv_bfloat16* out16, const float* lse, int64_t B, int64_t T,
                                  int64_t H, int64_t D, int64_t window, cudaStream_t stream,
                                  __nv_bfloat16* dqkv16 = nullptr, const float* qkv_bias = nullptr,
                                  float* dqkv_bias = nullptr, __nv_bfloat16* ds_tiles = nullptr);

}  // namespace ms::kernels
