// megascale ops: every operator of the GPT on the CPU, fp32, in two implementations with the same
// signatures:
//   ms::ops::ref::X  plain loops, double accumulation: the oracle that tests compare against;
//   ms::ops::X       fast: OpenMP over independent rows/heads, vectorizable inner loops, GEMMs through
//                    oneDNN (dnnl_sgemm).
//
// Conventions (all ops):
//   - Tensors are fp32 (ids/targets int32), row-major, contiguous, passed as raw pointers; shapes are
//     given in the comments, e.g. `// (B, T, 3, H, D)`. The caller owns every buffer; no op allocates
//     memory that outlives the call, none keeps a pointer.
//   - Ops cannot fail: sizes must be >= 0 and buffers must hold what the shapes say. Output buffers must
//     not alias inputs unless the comment says so ("in place").
//   - "WRITES" means the output is overwritten; "ACCUMULATES" means += into what the caller holds.
//   - Determinism: for a fixed OpenMP thread count every fast op is bitwise reproducible (static
//     schedules, no float atomics, cross-row reductions in a fixed order). Ops other than the GEMMs
//     (Gemm, MatmulForward, MatmulBackward's dinp/dw, which follow oneDNN) give the same bits whatever
//     the thread count.
//   - Thread safety: ops are reentrant; concurrent calls on disjoint outputs are safe. The fast ops open
//     OpenMP parallel regions (and oneDNN's), so calling them from inside an OpenMP region runs them
//     nested (serially by default).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/core.h"
#include "device/device.h"

namespace ms::ops {

// ---- GEMM and linear layers --------------------------------------------------------------------

// C = alpha * op(A) @ op(B) + beta * C, all row-major.
//   C: (M, N) with row stride ldc >= N.
//   A: (M, K) with row stride lda >= K, or stored (K, M) with lda >= M if trans_a.
//   B: (K, N) with row stride ldb >= N, or stored (N, K) with ldb >= K if trans_b.
// beta == 0 overwrites C (NaNs in C are not propagated). K == 0 scales C by beta.
void Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// Linear layer with PyTorch's weight layout (WRITES out):
//   out (N, OC) = inp (N, IC) @ w (OC, IC)^T + bias (OC); bias may be null.
void MatmulForward(float* out, const float* inp, const float* w, const float* bias, int64_t N, int64_t IC, int64_t OC);
// Backward of MatmulForward (ACCUMULATES all three):
//   dinp (N, IC) += dout (N, OC) @ w (OC, IC)        skipped if dinp is null;
//   dw (OC, IC)  += dout^T @ inp (N, IC);
//   dbias (OC)   += column sums of dout              skipped if dbias is null.
void MatmulBackward(float* dinp, float* dw, float* dbias, const float* dout, const float* inp, const float* w,
                    int64_t N, int64_t IC, int64_t OC);

// ---- LayerNorm -----------------------------------------------------------------------------------

// LayerNorm over the last dim (WRITES out, mean, rstd):
//   x, out: (N, C); w, b: (C); mean, rstd: (N) saved for backward, rstd = 1 / sqrt(var + eps) with the
//   biased variance (as torch.nn.LayerNorm).
void LayerNormForward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b, int64_t N,
                      int64_t C, float eps);
// Backward (ACCUMULATES dx (N, C), dw (C), db (C)); mean, rstd as saved by LayerNormForward.
void LayerNormBackward(float* dx, float* dw, float* db, const float* dout, const float* x, const float* w,
                       const float* mean, const float* rstd, int64_t N, int64_t C);

// ---- GeLU (tanh approximation: GPT-2, torch gelu(approximate="tanh")) ----------------------------

// out (n) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (WRITES; out may equal x: in place).
void GeluForward(float* out, const float* x, int64_t n);
// dx (n) = gelu'(x) * dout (WRITES, does not accumulate; dx may equal dout: in place).
void GeluBackward(float* dx, const float* x, const float* dout, int64_t n);

// ---- Attention -----------------------------------------------------------------------------------

// Causal self-attention with an optional sliding window over a fused qkv buffer (WRITES out, lse).
//   qkv: (B, T, 3, H, D)  per token: H query heads, then H key heads, then H value heads, each D wide.
//   out: (B, T, H, D);  lse: (B, H, T) log-sum-exp of the scaled scores of each query, for backward.
// Query t attends keys s with t - window < s <= t when window > 0 (min(window, t+1) keys, itself
// included), all s <= t when window == 0. Scores are scaled by 1/sqrt(D).
// Work is O(B*H*T*min(T,window)*D); no (T, T) buffer is ever formed. Precondition: D >= 1, window >= 0.
void AttentionForward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t H, int64_t D,
                      int64_t window);
// Backward (WRITES dqkv (B, T, 3, H, D) entirely). Probabilities are recomputed from lse (FlashAttention
// style); out (B, T, H, D) gives the row term D_t = sum(dout_t * out_t). The reference ignores out and lse
// and recomputes everything in double.
void AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int64_t B,
                       int64_t T, int64_t H, int64_t D, int64_t window);

// ---- Softmax cross-entropy -----------------------------------------------------------------------

// Over rows of logits (N, V) with targets (N) (WRITES losses (N) and lse (N)):
//   lse[i] = log(sum_j exp(logits[i, j])), losses[i] = lse[i] - logits[i, targets[i]].
// A target < 0 is ignored: loss 0 (lse is still written). Precondition: targets[i] < V. The caller
// averages.
void CrossEntropyForward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N, int64_t V);
// dlogits (N, V) = (softmax(logits) - onehot(targets)) * dloss[i] (WRITES; ignored rows get 0).
// lse (N) as saved by the forward; dloss (N) is a per-row scale (e.g. 1 / number of valid targets).
void CrossEntropyBackward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                          const float* dloss, int64_t N, int64_t V);
// The fused classifier loss (training, where dloss is known before the forward): CrossEntropyForward, then
// CrossEntropyBackward written over the logits, row by row (a row is read while it is still in cache):
// losses, lse (N) WRITTEN; logits (N, V) OVERWRITTEN with dlogits. Bit-identical to the two calls.
void CrossEntropyFused(float* losses, float* lse, float* logits, const int32_t* targets, const float* dloss, int64_t N,
                       int64_t V);

// ---- Embedding -----------------------------------------------------------------------------------

// out (N, C) = table (V, C)[ids[i]] (WRITES). An id < 0 gives a zero row (useful for vocab-parallel
// embeddings: shift ids into the local shard and mark the others -1). Precondition: ids[i] < V.
void EmbeddingForward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C);
// dtable (V, C) += scatter of dout (N, C) by ids (ACCUMULATES; ids < 0 skipped). Repeated ids are
// summed in row order: deterministic whatever the thread count.
void EmbeddingBackward(float* dtable, const int32_t* ids, const float* dout, int64_t N, int64_t C);

// ---- Elementwise helpers (all n-element vectors) ---------------------------------------------------

void AddInPlace(float* y, const float* x, int64_t n);             // y += x
void Axpy(float* y, float a, const float* x, int64_t n);          // y += a * x
void Add(float* out, const float* a, const float* b, int64_t n);  // out = a + b (out may equal a or b)
void Scale(float* x, float a, int64_t n);                         // x *= a
// sum(x^2) accumulated in double, in fixed-size chunks combined in order: the same bits whatever the
// thread count.
double SumSquares(const float* x, int64_t n);

// ---- Optimizers (one tensor, or one shard of it, at a time) ---------------------------------------

struct AdamParams {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
};

// torch.optim.AdamW (single-tensor path of torch 2.x), in its order of operations; step is 1-based:
//   p *= 1 - lr*wd;  m = lerp(m, g, 1 - b1);  v = v*b2 + (1 - b2)*g*g;
//   step_size = lr / (1 - b1^step);  denom = sqrt(v) / sqrt(1 - b2^step) + eps;  p -= step_size * m / denom.
// Scalars are computed in double, then rounded to float (as torch does with Python floats).
// p, m, v (n) are updated in place; g (n) is read.
void AdamWStep(float* p, const float* g, float* m, float* v, int64_t n, const AdamParams& hp, int64_t step);

// LAMB (You et al. 2019), split so that the trust ratio can use norms reduced across shards:
// LambDirection updates m, v (as AdamW) and WRITES u (n) = mhat / (sqrt(vhat) + eps) + wd * p with
// mhat = m / (1 - b1^step), vhat = v / (1 - b2^step) (hp.lr unused). The caller then computes over the
// WHOLE tensor trust = (||p|| > 0 && ||u|| > 0) ? ||p|| / ||u|| : 1 (e.g. SumSquares + all-reduce), and
// LambApply does p -= lr * trust * u.
void LambDirection(float* u, const float* p, const float* g, float* m, float* v, int64_t n, const AdamParams& hp,
                   int64_t step);
void LambApply(float* p, const float* u, int64_t n, float lr, float trust_ratio);
// The trust ratio from the squared norms of the whole tensor (sums of SumSquares over its shards):
// sqrt(param_sq / update_sq) when both are > 0, else 1.
float LambTrustRatio(double param_sq, double update_sq);

// ---- Backends: the same op set on one device ----------------------------------------------------
//
// The model, the optimizer and the data-parallel reducer call ops through a Backend, so that one model
// code path runs on the host (CpuBackend: the functions above) and on a GPU (lib/cuda: fused kernels from
// kernels/ and cuBLAS GEMMs with bf16 inputs and fp32 accumulation, on one CUDA stream).
//
// Contract: every pointer is memory of device() (host memory for the CPU backend), with the layouts and the
// WRITES / ACCUMULATES rules of the free functions of the same name. Work is enqueued in call order on the
// backend's stream; a call may return before its work has run (GPU), so the host reads results only after
// CopyToHost (which waits) or Synchronize(). Errors (a failed launch, a CUDA error) come back as a Status
// naming the op; the CPU backend never fails. Not thread safe: one thread drives a Backend.
struct AdamWTensor {  // one tensor (or shard) of a multi-tensor optimizer step
  float* p;
  const float* g;
  float* m;
  float* v;
  int64_t n;
  AdamParams hp;
  // (n bf16) unless null: the updated p rounded to bf16 as CastToBf16 does, written with the update (the weight
  // copy the GEMMs read); only where keeps_bf16_copies(), else refused.
  void* p16 = nullptr;
};
struct LambTensor {  // LambDirection arguments of one tensor (or shard)
  float* u;
  const float* p;
  const float* g;
  float* m;
  float* v;
  int64_t n;
  AdamParams hp;
};

// bf16 roundings of GEMM operands that a caller keeps between GEMMs, so each is made once rather than at every GEMM
// that reads it (backends with keeps_bf16_copies()): a weight rounded once per optimizer step, a layer input
// rounded by its producer or its forward GEMM and read again by the backward's weight-gradient GEMM, an output
// gradient rounded by the op that wrote it (the out16 / dx16 / dlogits16 arguments below). All optional.
struct Bf16Copies {
  const void* w = nullptr;  // the weight rounded to bf16 (same layout, made by CastToBf16); null: rounded at the call
  void* inp = nullptr;      // N x IC bf16 for the rounding of inp; null: rounded at the call into a workspace
  bool inp_ready = false;   // `inp` already holds the rounding of this call's inp (else the call writes it first)
  const void* dout = nullptr;  // MatmulBackward: dout (N x OC) rounded to bf16; null: rounded at the call
  // MatmulForward: write the output rounded to bf16 here (N x OC), instead of the fp32 out (null); only where
  // bf16_activations() (runtime.activations: bf16), else refused. With the bias only where gemm_gelu_epilogue()
  // (else refused): out16 = (inp . w^T + bias) rounded to bf16 — the fp32 sum rounded once where cuBLASLt's BIAS
  // epilogue runs it (with the bias rounded to bf16, the epilogue's type), or the GEMM's bf16 output plus the fp32
  // bias, then rounded, by the fallback (the qkv GEMM, whose bias the attention then need not add).
  void* out16 = nullptr;
  // MatmulBackward: dinp is WRITTEN (= dout . w), not accumulated: the caller holds no partial sum there, so it
  // need not zero it first and the GEMM reads no C. Honoured by every backend (the CPU backend zeroes, then
  // accumulates; a GEMM with beta 0: the same values, a -0 may come out where the zeroed sum gave +0).
  bool dinp_overwrite = false;
  // MatmulForward: out += inp . w^T (no bias, no out16) instead of out =: another GEMM's product summed without a
  // pass of its own. Honoured by every backend (the CPU backend adds a product computed aside: the bits of
  // AddInPlace after the GEMM; a GEMM with beta 1 adds its fp32 sum to out once, the same).
  bool out_accumulate = false;
  // MatmulBackward with dinp_overwrite: write dinp rounded to bf16 here (N x IC; fp32 accumulation rounded once)
  // instead of the fp32 dinp (null); only where bf16_activations() (runtime.activations: bf16), else refused.
  void* dinp16 = nullptr;
  // The fc GEMM fused with its bias and GeLU (only where gemm_gelu_epilogue(), else refused). MatmulForward with
  // out16, the bias and no fp32 out: out16 = (inp . w^T + bias) rounded to bf16 (the GeLU's input, kept for the
  // backward) and gelu16 (N x OC bf16) = gelu(inp . w^T + bias) rounded to bf16 — the fp32 sum rounded once where
  // cuBLASLt's GELU_AUX_BIAS epilogue runs it (with the bias rounded to bf16, the epilogue's type), or the GEMM's
  // bf16 output plus the fp32 bias, then rounded, by the fallback.
  void* gelu16 = nullptr;
  // MatmulBackward with dinp16 and dinp_overwrite: dinp16 = gelu'(dgelu_aux16) * (dout . w) rounded to bf16 — the
  // gradient of the GeLU's input, dgelu_aux16 (N x IC bf16) being the forward's out16 (cuBLASLt's DGELU epilogue,
  // or the GEMM's bf16 output times gelu' by the fallback) — and dgelu_dbias (IC) += its column sums (the fc bias
  // gradient; required with dgelu_aux16, refused without it).
  const void* dgelu_aux16 = nullptr;
  float* dgelu_dbias = nullptr;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;  // "cpu", "cuda", "cuda (emulated)"
  virtual device::Device* device() = 0;
  // Floating-point contract of the GEMMs: false = fp32 inputs (CPU), true = bf16 inputs, fp32 accumulation.
  virtual bool bf16_gemm() const = 0;

  // Memory helpers (device pointers; host pointers where named).
  virtual Status Zero(void* dst, size_t bytes) = 0;
  virtual Status Copy(void* dst, const void* src, size_t bytes) = 0;               // device -> device
  virtual Status CopyFromHost(void* dst, const void* host_src, size_t bytes) = 0;  // host -> device
  virtual Status CopyToHost(void* host_dst, const void* src, size_t bytes) = 0;    // device -> host; waits
  virtual Status Synchronize() = 0;                                                // all work done

  // Recorded sequences of ops (CUDA graphs, runtime.cuda_graphs): between BeginCapture and EndCapture the ops called
  // are recorded, not run, and the OpGraph returned runs them again, with the same pointers and scalars, each time
  // it is launched (in stream order, like any op). What a capture cannot hold fails the call that meets it and the
  // capture (EndCapture returns the reason): a wait for the device (CopyToHost, Synchronize), a copy from host memory
  // that is not the backend's own pinned staging, a workspace that has to grow. A graph is stale — Launch refuses it
  // with FailedPrecondition, to be captured again — once the backend has replaced a workspace its ops read. Only
  // where supports_graphs() (the CUDA backends); elsewhere BeginCapture is Unimplemented.
  class OpGraph {
   public:
    virtual ~OpGraph() = default;
    virtual Status Launch() = 0;
    virtual bool Stale() const = 0;   // Launch would refuse it: capture it again
    virtual int64_t ops() const = 0;  // operations recorded (kernels, copies, GEMMs)
  };
  virtual bool supports_graphs() const { return false; }
  virtual Status BeginCapture();
  virtual Result<std::unique_ptr<OpGraph>> EndCapture();
  virtual bool capturing() const { return false; }

  // True where the GEMMs round fp32 operands to bf16 with cast kernels and take kept roundings (Bf16Copies,
  // CastToBf16); the results are the same bits with and without them. False: both are refused / ignored.
  virtual bool keeps_bf16_copies() const { return false; }
  // dst (n bf16, device memory) = src rounded to nearest even; only where keeps_bf16_copies().
  virtual Status CastToBf16(void* dst, const float* src, int64_t n);
  // On every backend (the bf16 tensor-parallel sums, ShardSpec::tp_reduce_bf16): dst16 (n bf16) = src rounded to
  // nearest even (NaN stays NaN), and dst (n fp32) = src16 widened, exactly. Enqueued like every op.
  virtual Status RoundBf16(void* dst16, const float* src, int64_t n) = 0;
  virtual Status WidenBf16(float* dst, const void* src16, int64_t n) = 0;

  // The linear layers (ops::MatmulForward / MatmulBackward); `bf16` as above (ignored unless keeps_bf16_copies(),
  // but for dinp_overwrite, which every backend honours).
  virtual Status MatmulForward(float* out, const float* inp, const float* w, const float* bias, int64_t N, int64_t IC,
                               int64_t OC, const Bf16Copies& bf16) = 0;
  virtual Status MatmulBackward(float* dinp, float* dw, float* dbias, const float* dout, const float* inp,
                                const float* w, int64_t N, int64_t IC, int64_t OC, const Bf16Copies& bf16) = 0;
  Status MatmulForward(float* out, const float* inp, const float* w, const float* bias, int64_t N, int64_t IC,
                       int64_t OC) {
    return MatmulForward(out, inp, w, bias, N, IC, OC, Bf16Copies{});
  }
  Status MatmulBackward(float* dinp, float* dw, float* dbias, const float* dout, const float* inp, const float* w,
                        int64_t N, int64_t IC, int64_t OC) {
    return MatmulBackward(dinp, dw, dbias, dout, inp, w, N, IC, OC, Bf16Copies{});
  }
  // out16 (N x C bf16, device memory), unless null, = out rounded to bf16 as CastToBf16 does: the roundings a
  // following GEMM takes as kept operands without a cast; only where keeps_bf16_copies() (else refused). With
  // out16, out may be null: only the rounding is written (an output that feeds nothing but bf16 GEMMs). The same
  // holds for BiasGeluForward's out, BiasGeluBackward's dx, CrossEntropyBackward's and VocabParallelBackward's
  // dlogits, and CrossEntropyFused with fp32_dlogits false.
  virtual Status LayerNormForward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b,
                                  int64_t N, int64_t C, float eps, void* out16) = 0;
  Status LayerNormForward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b,
                          int64_t N, int64_t C, float eps) {
    return LayerNormForward(out, mean, rstd, x, w, b, N, C, eps, nullptr);
  }
  // dx16 (N x C bf16), unless null, = the accumulated dx rounded to bf16 (as out16 above).
  // dsum (C), unless null, += the column sums of the accumulated dx: the bias gradient of the residual branch whose
  // output gradient dx is (attn.proj's or mlp.proj's), summed by the LayerNorm backward as it goes (CUDA: in its
  // dw / db order) instead of a BiasGrad pass over dx; dsum2 (C), unless null, += the same sums (the parallel
  // block's second branch bias; only with dsum, else refused).
  virtual Status LayerNormBackward(float* dx, float* dw, float* db, const float* dout, const float* x, const float* w,
                                   const float* mean, const float* rstd, int64_t N, int64_t C, void* dx16, float* dsum,
                                   float* dsum2) = 0;
  Status LayerNormBackward(float* dx, float* dw, float* db, const float* dout, const float* x, const float* w,
                           const float* mean, const float* rstd, int64_t N, int64_t C) {
    return LayerNormBackward(dx, dw, db, dout, x, w, mean, rstd, N, C, nullptr, nullptr, nullptr);
  }
  virtual Status GeluForward(float* out, const float* x, int64_t n) = 0;
  virtual Status GeluBackward(float* dx, const float* x, const float* dout, int64_t n) = 0;
  // out16 (B, T, H, D bf16) / dqkv16 (B, T, 3, H, D bf16), unless null, = out / dqkv rounded to bf16 (as out16
  // above; only where keeps_bf16_copies(), else refused): attn.proj's input and qkv's output gradient.
  // qkv_bias (3, H, D), unless null: qkv holds the qkv GEMM's output without its bias, which the attention adds to
  // q, k and v as it reads them (the same fp32 add, so the same results as over qkv + bias; dqkv is unchanged, as
  // the bias gradient sums it); forward and backward take the same bias. Only where attention_adds_qkv_bias(D)
  // (else refused): it saves the bias kernel's pass over qkv.
  // dqkv_bias (3, H, D), unless null: += the column sums of dqkv over its B * T rows (the qkv bias gradient), made as
  // dqkv is stored, so that no pass reads dqkv back; dqkv may then be null when dqkv16 is given (only the rounding
  // is written). Only where attention_adds_qkv_bias(D), else refused.
  virtual bool attention_adds_qkv_bias(int64_t /*D*/) const { return false; }
  virtual Status AttentionForward(float* out, float* lse, const float* qkv, const float* qkv_bias, int64_t B, int64_t T,
                                  int64_t H, int64_t D, int64_t window, void* out16) = 0;
  virtual Status AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* qkv_bias,
                                   const float* out, const float* lse, int64_t B, int64_t T, int64_t H, int64_t D,
                                   int64_t window, void* dqkv16, float* dqkv_bias) = 0;
  // runtime.activations: bf16 with the tensor-core attention — the attention's inputs in bf16: qkv16 (B x T x 3 x H x
  // D bf16) as the qkv GEMM wrote it (Bf16Copies::out16, no bias: the attention adds it), dout16 (B x T x H x D bf16)
  // as the attention projection's backward GEMM wrote it (Bf16Copies::dinp16), and the forward's output read back
  // rounded to bf16: out16_in (its kept rounding) or out (fp32, rounded as it is read; exactly one of the two). The
  // other arguments as above; the forward's out may be null when out16 is given (only the rounding written). The
  // results of the fp32 calls on the widened qkv16 and dout16 and on out widened from its rounding, bit for bit. Only
  // where bf16_activations() and attention_adds_qkv_bias(D), else refused.
  virtual Status AttentionForward16(float* out, float* lse, const void* qkv16, const float* qkv_bias, int64_t B,
                                    int64_t T, int64_t H, int64_t D, int64_t window, void* out16);
  virtual Status AttentionBackward16(float* dqkv, const void* dout16, const void* qkv16, const float* qkv_bias,
                                     const float* out, const void* out16_in, const float* lse, int64_t B, int64_t T,
                                     int64_t H, int64_t D, int64_t window, void* dqkv16, float* dqkv_bias);
  Status AttentionForward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t H, int64_t D,
                          int64_t window) {
    return AttentionForward(out, lse, qkv, nullptr, B, T, H, D, window, nullptr);
  }
  Status AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                           int64_t B, int64_t T, int64_t H, int64_t D, int64_t window) {
    return AttentionBackward(dqkv, dout, qkv, nullptr, out, lse, B, T, H, D, window, nullptr, nullptr);
  }
  virtual Status CrossEntropyForward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                                     int64_t V) = 0;
  // dlogits16 (N x V bf16) here and in CrossEntropyFused / VocabParallelBackward, unless null, = dlogits rounded
  // to bf16 (as out16 above).
  virtual Status CrossEntropyBackward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                                      const float* dloss, int64_t N, int64_t V, void* dlogits16) = 0;
  Status CrossEntropyBackward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                              const float* dloss, int64_t N, int64_t V) {
    return CrossEntropyBackward(dlogits, logits, lse, targets, dloss, N, V, nullptr);
  }
  // Forward and backward in one pass over each row, dlogits written over the logits (ops::CrossEntropyFused);
  // with dlogits16 and !fp32_dlogits only the rounding is written and the logits are left as they are.
  virtual Status CrossEntropyFused(float* losses, float* lse, float* logits, const int32_t* targets, const float* dloss,
                                   int64_t N, int64_t V, void* dlogits16, bool fp32_dlogits) = 0;
  Status CrossEntropyFused(float* losses, float* lse, float* logits, const int32_t* targets, const float* dloss,
                           int64_t N, int64_t V) {
    return CrossEntropyFused(losses, lse, logits, targets, dloss, N, V, nullptr, true);
  }
  // Vocab-parallel cross-entropy pieces; logits (N, V) are this rank's vocab columns [vstart, vstart + V).
  //   RowStats:     one pass over the rows (V >= 1): mx (N) WRITES the local row maxima, se (N) sum_j
  //                 exp(logits - mx) with the local max, tl (N) the target logit when the target is in this rank's
  //                 columns, else 0.
  //   Rebase:       se (N) *= exp(mx_local - mx_global), mx_global the maxima reduced across ranks (max); then
  //                 se and tl are reduced (sum).
  //   Finish:       lse = mx + log(se), losses = lse - tl (0 for targets < 0), both (N) WRITTEN (mx the global
  //                 maxima, se, tl reduced).
  //   Backward:     dlogits (N, V) WRITES (exp(logits - lse) - onehot_local(target)) * dloss (scalar); 0 rows
  //                 for targets < 0.
  virtual Status VocabParallelRowStats(float* mx, float* se, float* tl, const float* logits, const int32_t* targets,
                                       int64_t vstart, int64_t N, int64_t V) = 0;
  virtual Status VocabParallelRebase(float* se, const float* mx_local, const float* mx_global, int64_t N) = 0;
  virtual Status VocabParallelFinish(float* losses, float* lse, const float* mx, const float* se, const float* tl,
                                     const int32_t* targets, int64_t N) = 0;
  virtual Status VocabParallelBackward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                                       float dloss, int64_t vstart, int64_t N, int64_t V, void* dlogits16) = 0;
  Status VocabParallelBackward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                               float dloss, int64_t vstart, int64_t N, int64_t V) {
    return VocabParallelBackward(dlogits, logits, lse, targets, dloss, vstart, N, V, nullptr);
  }
  virtual Status EmbeddingForward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C) = 0;
  virtual Status EmbeddingBackward(float* dtable, const int32_t* ids, const float* dout, int64_t N, int64_t C) = 0;

  virtual Status AddInPlace(float* y, const float* x, int64_t n) = 0;
  virtual Status Add(float* out, const float* a, const float* b, int64_t n) = 0;
  virtual Status Scale(float* x, float a, int64_t n) = 0;
  // y (R, C) += b (C) on every row.
  virtual Status AddRowBias(float* y, const float* b, int64_t R, int64_t C) = 0;
  // out (R, C) = x + part + bias[c] (+ bias2[c] when not null): the residual add fused with the row-parallel
  // biases (out may equal x or part).
  virtual Status ResidualAdd(float* out, const float* x, const float* part, const float* bias, const float* bias2,
                             int64_t R, int64_t C) = 0;
  // The residual add that feeds a LayerNorm, fused into it: res = ResidualAdd(x, part, bias, bias2), then
  // LayerNormForward(out, mean, rstd, res, w, b, eps, out16) — the same bits as the two calls, which is what this
  // default runs; the CUDA backend's one kernel normalizes the rows as it writes them (one pass less over res).
  virtual Status ResidualLayerNormForward(float* res, const float* x, const float* part, const float* bias,
                                          const float* bias2, float* out, float* mean, float* rstd, const float* w,
                                          const float* b, int64_t R, int64_t C, float eps, void* out16);
  // ResidualAdd / ResidualLayerNormForward with part16 (R x C bf16) as the projection GEMM wrote it
  // (Bf16Copies::out16: runtime.activations: bf16 where one GEMM writes the branch's output alone), widened exactly:
  // the results of the fp32 calls on the widened values, bit for bit. Only where bf16_activations(), else refused.
  virtual Status ResidualAdd16(float* out, const float* x, const void* part16, const float* bias, const float* bias2,
                               int64_t R, int64_t C);
  virtual Status ResidualLayerNormForward16(float* res, const float* x, const void* part16, const float* bias,
                                            const float* bias2, float* out, float* mean, float* rstd, const float* w,
                                            const float* b, int64_t R, int64_t C, float eps, void* out16);
  // out (R, C) = gelu(x + bias[c]) (WRITES): the fc bias fused into the GeLU (x is the GEMM output without bias);
  // out16 as LayerNormForward's.
  virtual Status BiasGeluForward(float* out, const float* x, const float* bias, int64_t R, int64_t C, void* out16) = 0;
  Status BiasGeluForward(float* out, const float* x, const float* bias, int64_t R, int64_t C) {
    return BiasGeluForward(out, x, bias, R, C, nullptr);
  }
  // dx (R, C) = gelu'(x + bias) * dout (WRITES; dx may equal dout), dbias (C) += column sums of dx (ACCUMULATES);
  // dx16 as LayerNormForward's out16.
  virtual Status BiasGeluBackward(float* dx, float* dbias, const float* x, const float* bias, const float* dout,
                                  int64_t R, int64_t C, void* dx16) = 0;
  Status BiasGeluBackward(float* dx, float* dbias, const float* x, const float* bias, const float* dout, int64_t R,
                          int64_t C) {
    return BiasGeluBackward(dx, dbias, x, bias, dout, R, C, nullptr);
  }
  // runtime.activations: bf16 — the fc output kept in bf16: MatmulForward writes it rounded to bf16
  // (Bf16Copies::out16, fp32 accumulation, rounded once) and the bias + GeLU read it (x16, R x C bf16) in place of the
  // fp32 x: the same results as the fp32 calls on x16 widened to fp32. Only where bf16_activations() (bf16 GEMMs on
  // bf16 operands: the CUDA backend with train.precision: bf16 and runtime.bf16_operands keep or cast), else
  // refused.
  virtual bool bf16_activations() const { return false; }
  // Whether MatmulForward takes Bf16Copies::gelu16 and MatmulBackward dgelu_aux16 (the bias + GeLU and its gradient
  // in the fc GEMMs' epilogues), and the bias beside Bf16Copies::out16 (in the GEMM's epilogue): the CUDA backend
  // with bf16_activations() and kept operands.
  virtual bool gemm_gelu_epilogue() const { return false; }
  virtual Status BiasGeluForward16(float* out, const void* x16, const float* bias, int64_t R, int64_t C, void* out16);
  // dout16 (R x C bf16), unless null, in place of dout (then null): the GeLU output's gradient kept in bf16 too
  // (the fc-proj backward's Bf16Copies::dinp16), widened exactly.
  virtual Status BiasGeluBackward16(float* dx, float* dbias, const void* x16, const float* bias, const float* dout,
                                    const void* dout16, int64_t R, int64_t C, void* dx16);
  // LayerNormBackward with its output gradient dout16 (N x C bf16) as the GEMM that reads the LayerNorm's output wrote
  // it (MatmulBackward's Bf16Copies::dinp16: runtime.activations: bf16 where one GEMM writes all of it), widened
  // exactly: the results of the fp32 call on the widened values, bit for bit. Only where bf16_activations(), else
  // refused.
  virtual Status LayerNormBackward16(float* dx, float* dw, float* db, const void* dout16, const float* x,
                                     const float* w, const float* mean, const float* rstd, int64_t N, int64_t C,
                                     void* dx16, float* dsum, float* dsum2);
  // runtime.activations: bf16 at tp 1 — the logits kept in bf16: the classifier's MatmulForward writes them rounded to
  // bf16 (Bf16Copies::out16, no mask bias) and these read them (logits16, N x V bf16, widened exactly) over their first
  // Vv columns (1 <= Vv <= V; the others, the vocabulary padding, are out of the softmax and get a zero gradient),
  // writing only the gradient's rounding: CrossEntropyFused16 over the logits, CrossEntropyBackward16 into dlogits16
  // (which may be logits16 itself). The results of the fp32 calls on the widened logits where Vv = V. Only where
  // bf16_activations(), else refused.
  virtual Status CrossEntropyForward16(float* losses, float* lse, const void* logits16, const int32_t* targets,
                                       int64_t N, int64_t V, int64_t Vv);
  virtual Status CrossEntropyBackward16(void* dlogits16, const void* logits16, const float* lse, const int32_t* targets,
                                        const float* dloss, int64_t N, int64_t V, int64_t Vv);
  virtual Status CrossEntropyFused16(float* losses, float* lse, void* logits16, const int32_t* targets,
                                     const float* dloss, int64_t N, int64_t V, int64_t Vv);
  // db (C) += column sums of dy (R, C), rows in order.
  virtual Status BiasGrad(float* db, const float* dy, int64_t R, int64_t C) = 0;
  // x (R, C) += wpe[((row0 + r) % T)] for each row r: learned positions.
  virtual Status AddPositions(float* x, const float* wpe, int64_t R, int64_t C, int64_t T, int64_t row0) = 0;
  // dwpe[((row0 + r) % T)] += dx[r] (ACCUMULATES), rows in order.
  virtual Status PositionsBackward(float* dwpe, const float* dx, int64_t R, int64_t C, int64_t T, int64_t row0) = 0;
  // Sums of squares of several vectors, each in double as ops::SumSquares; WRITES out[i] (host memory).
  virtual Status SumSquares(const float* const* xs, const int64_t* ns, int count, double* out) = 0;

  // Multi-tensor optimizer steps (one launch per group of tensors on the GPU).
  virtual Status AdamW(const AdamWTensor* tensors, int count, int64_t step) = 0;
  virtual Status LambDirection(const LambTensor* tensors, int count, int64_t step) = 0;
  // p16 (n bf16) unless null: the updated p rounded to bf16 (as AdamWTensor::p16; only where keeps_bf16_copies()).
  virtual Status LambApply(float* p, const float* u, int64_t n, float lr, float trust_ratio, void* p16) = 0;
  Status LambApply(float* p, const float* u, int64_t n, float lr, float trust_ratio) {
    return LambApply(p, u, n, lr, trust_ratio, nullptr);
  }
};

// The host backend over `device` (a host device: device->is_host()).
std::unique_ptr<Backend> MakeCpuBackend(device::Device* device);

// ---- Reference implementations: same contracts, plain loops ---------------------------------------
namespace ref {

void Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
void MatmulForward(float* out, const float* inp, const float* w, const float* bias, int64_t N, int64_t IC, int64_t OC);
void MatmulBackward(float* dinp, float* dw, float* dbias, const float* dout, const float* inp, const float* w,
                    int64_t N, int64_t IC, int64_t OC);
void LayerNormForward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b, int64_t N,
                      int64_t C, float eps);
void LayerNormBackward(float* dx, float* dw, float* db, const float* dout, const float* x, const float* w,
                       const float* mean, const float* rstd, int64_t N, int64_t C);
void GeluForward(float* out, const float* x, int64_t n);
void GeluBackward(float* dx, const float* x, const float* dout, int64_t n);
void AttentionForward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t H, int64_t D,
                      int64_t window);
void AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int64_t B,
                       int64_t T, int64_t H, int64_t D, int64_t window);
void CrossEntropyForward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N, int64_t V);
void CrossEntropyBackward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                          const float* dloss, int64_t N, int64_t V);
void CrossEntropyFused(float* losses, float* lse, float* logits, const int32_t* targets, const float* dloss, int64_t N,
                       int64_t V);
void EmbeddingForward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C);
void EmbeddingBackward(float* dtable, const int32_t* ids, const float* dout, int64_t N, int64_t C);
void AddInPlace(float* y, const float* x, int64_t n);
void Axpy(float* y, float a, const float* x, int64_t n);
void Add(float* out, const float* a, const float* b, int64_t n);
void Scale(float* x, float a, int64_t n);
double SumSquares(const float* x, int64_t n);
void AdamWStep(float* p, const float* g, float* m, float* v, int64_t n, const AdamParams& hp, int64_t step);
void LambDirection(float* u, const float* p, const float* g, float* m, float* v, int64_t n, const AdamParams& hp,
                   int64_t step);
void LambApply(float* p, const float* u, int64_t n, float lr, float trust_ratio);

}  // namespace ref
}  // namespace ms::ops
