// The CUDA ops backend: every op of ops::Backend enqueued on one stream of a CUDA device — the fused kernels
// of kernels/ (launchers in kernels/kernels.h) and cuBLAS GEMMs with bf16 operands and fp32 accumulation.
// Compiled twice (lib/cuda/CMakeLists.txt): against libcudart + cuBLAS + the nvcc-built kernels, and against
// the SIMT emulator's runtime + cuBLAS subset + the emulated kernels.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <set>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cuda/attention_tune.h"
#include "cuda/cuda.h"
#include "kernels.h"
#if defined(MS_CUDA_HAVE_CUDNN)
#include "cuda/cudnn_sdpa.h"
#endif
#if defined(MS_CUDA_FLAVOR_GPU)
#include "cuda/cublas_loader.h"
#endif

namespace ms::cuda {

Flavor LinkedFlavor() {
#if defined(MS_CUDA_FLAVOR_EMULATED)
  return Flavor::kEmulated;
#else
  return Flavor::kGpu;
#endif
}

namespace {

Status CudaStatus(cudaError_t e, std::string_view what) {
  if (e == cudaSuccess) return Status::Ok();
  return Internal("{}: CUDA error {} ({})", what, cudaGetErrorName(e), cudaGetErrorString(e));
}
Status BlasStatus(cublasStatus_t e, std::string_view what) {
  if (e == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  return Internal("{}: cuBLAS error {} ({})", what, static_cast<int>(e), cublasGetStatusString(e));
}
#define MS_CUDA_OK(expr, what) MS_RETURN_IF_ERROR(CudaStatus((expr), (what)))
#define MS_BLAS_OK(expr, what) MS_RETURN_IF_ERROR(BlasStatus((expr), (what)))

// A device buffer that only grows; growing waits for the stream first (kernels may still read the old one). It
// cannot grow inside a stream capture (the wait, and the old buffer that the graph would keep reading), and
// counts its uses and growths: a graph that used it is stale after it grows (CudaGraph::Stale).
class Workspace {
 public:
  Workspace() = default;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  ~Workspace() {
    if (ptr_) device_->Free(ptr_);
  }
  Result<void*> Get(device::Device* device, cudaStream_t stream, size_t bytes) {
    ++gets_;
    bytes = std::max<size_t>(bytes, 256);
    if (bytes <= bytes_) return ptr_;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    MS_CUDA_OK(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
    if (capture != cudaStreamCaptureStatusNone) {
      return FailedPrecondition(
          "a backend workspace would grow from {} to {} bytes inside a graph capture (runtime.cuda_graphs): the "
          "captured ops must have run once, at the same sizes, before the capture",
          bytes_, bytes);
    }
    ++growths_;
    if (ptr_) {
      MS_CUDA_OK(cudaStreamSynchronize(stream), "growing a backend workspace");
      device_->Free(ptr_);
      ptr_ = nullptr;
      bytes_ = 0;
    }
    device_ = device;
    MS_ASSIGN_OR_RETURN(ptr_, device->Alloc(bytes));
    bytes_ = bytes;
    return ptr_;
  }
  int64_t growths() const { return growths_; }
  int64_t gets() const { return gets_; }

 private:
  int64_t growths_ = 0, gets_ = 0;
  device::Device* device_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class CudaBackend final : public ops::Backend {
 public:
  static Result<std::unique_ptr<ops::Backend>> Create(device::Device* device, bool bf16, Bf16Operands operands,
                                                      int64_t attention_ds_max_bytes) {
    std::unique_ptr<CudaBackend> b(new CudaBackend());
    b->device_ = device;
    b->bf16_ = bf16;
    b->ds_max_bytes_ = attention_ds_max_bytes;
    b->cublas_converts_ = bf16 && operands == Bf16Operands::kCublas;
    b->keep_ = bf16 && operands == Bf16Operands::kKeep;
    b->stream_ = device->CreateStream();
    b->s_ = NativeStream(*b->stream_);
    // Test hook (docs/cuda.md): MEGASCALE_PLANT=staging_no_wait reuses a staging buffer without waiting for its
    // previous copy — the planted bug the deferred emulated streams must catch.
    const char* plant = std::getenv("MEGASCALE_PLANT");
    b->plant_no_stage_wait_ = plant && std::strcmp(plant, "staging_no_wait") == 0;
    if (!b->s_)
      return InvalidArgument("the CUDA backend needs a device made by MakeCudaDevice, got {}", device->name());
#if defined(MS_CUDA_FLAVOR_GPU)
    MS_RETURN_IF_ERROR(LoadCublas());  // loaded at the first backend, not at start (cublas_loader.h)
#endif
    MS_BLAS_OK(cublasCreate(&b->blas_), "cublasCreate");
    MS_BLAS_OK(cublasSetStream(b->blas_, b->s_), "cublasSetStream");
    MS_BLAS_OK(cublasLtCreate(&b->lt_), "cublasLtCreate");
    // cuBLAS's workspace is ours, allocated once: what a captured GEMM may use (cuBLAS would otherwise take its own
    // per stream, which a graph cannot rely on), the same for every GEMM with or without graphs.
    MS_ASSIGN_OR_RETURN(void* blas_ws, b->ws_[kBlas].Get(device, b->s_, kCublasWorkspaceBytes));
    MS_BLAS_OK(cublasSetWorkspace(b->blas_, blas_ws, kCublasWorkspaceBytes), "cublasSetWorkspace");
    return std::unique_ptr<ops::Backend>(std::move(b));
  }
  ~CudaBackend() override {
    if (s_) (void)cudaStreamSynchronize(s_);
    for (Stage& st : stage_) {
      if (st.done) (void)cudaEventDestroy(st.done);
      if (st.host) (void)cudaFreeHost(st.host);
    }
    if (blas_) (void)cublasDestroy(blas_);
    if (lt_) (void)cublasLtDestroy(lt_);
    for (void* p : cudnn_kept_) device_->Free(p);
  }

  const char* name() const override {
    return LinkedFlavor() == Flavor::kEmulated ? "cuda (emulated)" : "cuda";
  }
  device::Device* device() override {
    return device_;
  }
  bool bf16_gemm() const override {
    return bf16_;
  }
  bool keeps_bf16_copies() const override {
    return keep_;
  }
  cudaStream_t stream() const {
    return s_;
  }

  Status Zero(void* dst, size_t bytes) override {
    if (!bytes) return Status::Ok();
    MS_CUDA_OK(cudaMemsetAsync(dst, 0, bytes, s_), "cudaMemsetAsync");
    return Status::Ok();
  }
  Status Copy(void* dst, const void* src, size_t bytes) override {
    if (!bytes || dst == src) return Status::Ok();
    MS_CUDA_OK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s_), "device-to-device copy");
    return Status::Ok();
  }
  Status CopyFromHost(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return Status::Ok();
    if (capture_) {  // a graph would copy whatever the staging buffer holds when it runs
      return FailedPrecondition("an upload from the host ({} bytes) inside a graph capture (runtime.cuda_graphs)",
                                bytes);
    }
    if (bytes <= kStageBytes) {
      // Through the next pinned staging buffer: wait only for that buffer's previous copy (kStageSlots uploads
      // ago), copy the source into it and enqueue the DMA; the caller may reuse `src` at once, and the call
      // never waits for the stream's other work (a pageable source may make the driver synchronize with it).
      Stage& st = stage_[static_cast<size_t>(next_stage_)];
      next_stage_ = (next_stage_ + 1) % kStageSlots;
      if (!st.host) {
        MS_CUDA_OK(cudaMallocHost(&st.host, kStageBytes), "allocating a pinned staging buffer (cudaMallocHost)");
        MS_CUDA_OK(cudaEventCreateWithFlags(&st.done, cudaEventDisableTiming), "staging buffer event");
      } else if (!plant_no_stage_wait_) {
        MS_CUDA_OK(cudaEventSynchronize(st.done), "waiting for a staging buffer's previous copy");
      }
      std::memcpy(st.host, src, bytes);
      MS_CUDA_OK(cudaMemcpyAsync(dst, st.host, bytes, cudaMemcpyHostToDevice, s_), "host-to-device copy (staged)");
      MS_CUDA_OK(cudaEventRecord(st.done, s_), "host-to-device copy (staged)");
      return Status::Ok();
    }
    // Large uploads (initial weights, restored checkpoints): pageable; the call returns once the source has
    // been staged by the driver, so the caller may reuse it.
    MS_CUDA_OK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s_), "host-to-device copy");
    return Status::Ok();
  }
  Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return Status::Ok();
    MS_CUDA_OK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s_), "device-to-host copy");
    MS_CUDA_OK(cudaStreamSynchronize(s_), "device-to-host copy");
    return Status::Ok();
  }
  Status Synchronize() override {
    MS_CUDA_OK(cudaStreamSynchronize(s_), "cudaStreamSynchronize");
    return Status::Ok();
  }

  // ---- graphs: stream capture of the backend's stream (ops::Backend::BeginCapture) ----
  bool supports_graphs() const override {
    return true;
  }
  bool capturing() const override {
    return capture_;
  }
  Status BeginCapture() override {
    if (capture_) return FailedPrecondition("BeginCapture: the backend is already capturing");
    // Thread-local: other threads' CUDA calls (a communicator's watchdog) are not the capture's business.
    MS_CUDA_OK(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    capture_ = true;
    capture_epi_ = epilogue_stats_;
    capture_att_ = attention_stats_;
    for (int i = 0; i < kNumWorkspaces; ++i) capture_gets_[i] = ws_[i].gets();
    return Status::Ok();
  }
  Result<std::unique_ptr<OpGraph>> EndCapture() override;
  // The growths of the workspaces in `used` (a bit per workspace): what a graph that used them was recorded with.
  int64_t WorkspaceGrowths(uint32_t used) const {
    int64_t n = 0;
    for (int i = 0; i < kNumWorkspaces; ++i) {
      if (used & (1u << i)) n += ws_[i].growths();
    }
    return n;
  }
  // What a launch of a graph adds to the statistics: the calls its capture recorded.
  void AddStats(const EpilogueStats& e, const AttentionStats& a) {
    epilogue_stats_.cublaslt += e.cublaslt;
    epilogue_stats_.fallback += e.fallback;
    epilogue_stats_.bias_cublaslt += e.bias_cublaslt;
    epilogue_stats_.bias_fallback += e.bias_fallback;
    attention_stats_.stored_ds += a.stored_ds;
    attention_stats_.recompute += a.recompute;
    attention_stats_.cudnn_forward += a.cudnn_forward;
    attention_stats_.cudnn_backward += a.cudnn_backward;
    attention_stats_.cudnn_fallback += a.cudnn_fallback;
    attention_stats_.split_dkdv += a.split_dkdv;
  }

  // ---- GEMMs: row-major problems mapped onto column-major cuBLAS (a row-major X is a column-major X^T) ----
  Status CastToBf16(void* dst, const float* src, int64_t n) override {
    if (!keep_) return ops::Backend::CastToBf16(dst, src, n);
    if (n == 0) return Status::Ok();
    return Launch(kernels::CastFloatToBf16(static_cast<__nv_bfloat16*>(dst), src, n, s_), "fp32 -> bf16 cast");
  }
  Status RoundBf16(void* dst16, const float* src, int64_t n) override {
    if (n == 0) return Status::Ok();
    return Launch(kernels::CastFloatToBf16(static_cast<__nv_bfloat16*>(dst16), src, n, s_), "fp32 -> bf16 rounding");
  }
  Status WidenBf16(float* dst, const void* src16, int64_t n) override {
    if (n == 0) return Status::Ok();
    return Launch(kernels::CastBf16ToFloat(dst, static_cast<const __nv_bfloat16*>(src16), n, s_), "bf16 -> fp32");
  }
  using ops::Backend::MatmulBackward;
  using ops::Backend::MatmulForward;
  Status MatmulForward(float* out, const float* inp, const float* w, const float* bias, int64_t N, int64_t IC,
                       int64_t OC, const ops::Bf16Copies& kept) override {
    if (kept.gelu16) return MatmulBiasGelu(inp, w, bias, N, IC, OC, kept, out);
    if (kept.out16) {
      if (!bf16_activations()) {
        return FailedPrecondition(
            "MatmulForward: a bf16 output (runtime.activations: bf16) needs bf16 GEMMs on bf16 operands "
            "(train.precision: bf16, runtime.bf16_operands: keep or cast)");
      }
      if (out) return InvalidArgument("MatmulForward: with a bf16 output, out must be null");
      if (bias && !gemm_gelu_epilogue()) {
        return FailedPrecondition(
            "MatmulForward: a bias with a bf16 output (in the GEMM's epilogue) needs runtime.bf16_operands: keep");
      }
    }
    if (kept.out_accumulate && (bias || kept.out16)) {
      return InvalidArgument("MatmulForward: an accumulated output takes no bias and no bf16 output");
    }
    if (N == 0 || OC == 0) return Status::Ok();
    MS_ASSIGN_OR_RETURN(auto* a, Input(inp, N * IC, kept));
    MS_ASSIGN_OR_RETURN(auto* b, Weight(w, OC * IC, kept));
    if (kept.out16 && bias) return MatmulBias16(a, b, bias, N, IC, OC, kept.out16);
    if (kept.out16) {  // out16^T (OC, N), rounded once from the fp32 accumulation
      return Gemm(CUBLAS_OP_T, CUBLAS_OP_N, OC, N, IC, b, IC, a, IC, 0.0f, kept.out16, OC, "linear forward (bf16 out)",
                  CUDA_R_16BF);
    }
    // out^T (OC, N) = w (OC, IC) . inp^T (IC, N): A = w stored column-major (IC, OC) -> op T.
    MS_RETURN_IF_ERROR(Gemm(CUBLAS_OP_T, CUBLAS_OP_N, OC, N, IC, b, IC, a, IC, kept.out_accumulate ? 1.0f : 0.0f, out,
                            OC, "linear forward"));
    if (bias) MS_RETURN_IF_ERROR(Launch(kernels::AddRowBias(out, bias, N, OC, s_), "bias add"));
    return Status::Ok();
  }
  Status MatmulBackward(float* dinp, float* dw, float* dbias, const float* dout, const float* inp, const float* w,
                        int64_t N, int64_t IC, int64_t OC, const ops::Bf16Copies& kept) override {
    if (kept.dgelu_aux16) {
      if (!gemm_gelu_epilogue()) {
        return FailedPrecondition(
            "MatmulBackward: the GeLU gradient in the GEMM (dgelu_aux16) needs runtime.bf16_operands: keep and "
            "runtime.activations: bf16");
      }
      if (!kept.dinp16 || !kept.dgelu_dbias) {
        return InvalidArgument("MatmulBackward: dgelu_aux16 needs dinp16 (the output) and dgelu_dbias");
      }
    } else if (kept.dgelu_dbias) {
      return InvalidArgument("MatmulBackward: dgelu_dbias without dgelu_aux16");
    }
    if (kept.dinp16) {
      if (!bf16_activations()) {
        return FailedPrecondition(
            "MatmulBackward: a bf16 input gradient (runtime.activations: bf16) needs bf16 GEMMs on bf16 operands "
            "(train.precision: bf16, runtime.bf16_operands: keep or cast)");
      }
      if (dinp || !kept.dinp_overwrite) {
        return InvalidArgument(
            "MatmulBackward: a bf16 input gradient is written, not accumulated (dinp null, dinp_overwrite set)");
      }
    }
    if (N == 0 || OC == 0 || IC == 0) return Status::Ok();
    // The output gradient's rounding, made by its producer: taken with kept operands, and wherever there is no fp32
    // dout (the bf16 logits' gradient, runtime.activations: bf16, also with `cast`).
    const void* g = keep_ || !dout ? kept.dout : nullptr;
    if (!g && !dout) return InvalidArgument("MatmulBackward: no output gradient (dout or its bf16 rounding)");
    if (dbias && !dout) return InvalidArgument("MatmulBackward: a bias gradient needs the fp32 dout");
    if (!g) {
      MS_ASSIGN_OR_RETURN(g, Bf16(0, dout, N * OC));
    }
    if (kept.dgelu_aux16) {  // dinp16 = gelu'(aux) * (dout . w): the GeLU gradient in the GEMM's epilogue
      MS_ASSIGN_OR_RETURN(auto* wb, Weight(w, OC * IC, kept));
      MS_RETURN_IF_ERROR(DgeluGemm(wb, g, N, IC, OC, kept));
    } else if (kept.dinp16) {  // dinp16^T (IC, N) = w^T (IC, OC) . dout^T (OC, N), rounded once from the fp32 sum
      MS_ASSIGN_OR_RETURN(auto* wb, Weight(w, OC * IC, kept));
      MS_RETURN_IF_ERROR(Gemm(CUBLAS_OP_N, CUBLAS_OP_N, IC, N, OC, wb, IC, g, OC, 0.0f, kept.dinp16, IC,
                              "linear dinp (bf16 out)", CUDA_R_16BF));
    } else if (dinp) {
      MS_ASSIGN_OR_RETURN(auto* wb, Weight(w, OC * IC, kept));
      // dinp^T (IC, N) += w^T (IC, OC) . dout^T (OC, N); with dinp_overwrite = (beta 0: C not read)
      MS_RETURN_IF_ERROR(Gemm(CUBLAS_OP_N, CUBLAS_OP_N, IC, N, OC, wb, IC, g, OC, kept.dinp_overwrite ? 0.0f : 1.0f,
                              dinp, IC, "linear dinp"));
    }
    MS_ASSIGN_OR_RETURN(auto* x, Input(inp, N * IC, kept, 2));
    // dw^T (IC, OC) += inp^T (IC, N) . dout (N, OC)
    MS_RETURN_IF_ERROR(Gemm(CUBLAS_OP_N, CUBLAS_OP_T, IC, OC, N, x, IC, g, OC, 1.0f, dw, IC, "linear dweight"));
    if (dbias) MS_RETURN_IF_ERROR(BiasGrad(dbias, dout, N, OC));
    return Status::Ok();
  }

  using ops::Backend::BiasGeluForward;
  using ops::Backend::LayerNormForward;
  Status LayerNormForward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b,
                          int64_t N, int64_t C, float eps, void* out16) override {
    MS_ASSIGN_OR_RETURN(auto* o16, KeptOutput(out16, "LayerNormForward", out));
    return Launch(kernels::LayerNormForward(out, mean, rstd, x, w, b, N, C, eps, s_, o16), "LayerNorm forward");
  }
  using ops::Backend::LayerNormBackward;
  Status LayerNormBackward(float* dx, float* dw, float* db, const float* dout, const float* x, const float* w,
                           const float* mean, const float* rstd, int64_t N, int64_t C, void* dx16, float* dsum,
                           float* dsum2) override {
    if (!dx) return InvalidArgument("LayerNormBackward: dx (accumulated) is needed");
    if (dsum2 && !dsum) return InvalidArgument("LayerNormBackward: a second bias gradient (dsum2) without the first");
    MS_ASSIGN_OR_RETURN(auto* d16, KeptOutput(dx16, "LayerNormBackward", dx));
    MS_ASSIGN_OR_RETURN(void* scratch,
                        ws_[kScratch].Get(device_, s_, sizeof(float) * kernels::LayerNormBackwardScratchFloats(N, C)));
    return Launch(kernels::LayerNormBackward(dx, dw, db, static_cast<float*>(scratch), dout, x, w, mean, rstd, N, C, s_,
                                             d16, dsum, dsum2),
                  "LayerNorm backward");
  }
  Status LayerNormBackward16(float* dx, float* dw, float* db, const void* dout16, const float* x, const float* w,
                             const float* mean, const float* rstd, int64_t N, int64_t C, void* dx16, float* dsum,
                             float* dsum2) override {
    if (!bf16_activations()) {
      return ops::Backend::LayerNormBackward16(dx, dw, db, dout16, x, w, mean, rstd, N, C, dx16, dsum, dsum2);
    }
    if (!dx || !dout16) return InvalidArgument("LayerNormBackward16: dx (accumulated) and dout16 are needed");
    if (dsum2 && !dsum) return InvalidArgument("LayerNormBackward16: a second bias gradient (dsum2) without the first");
    MS_ASSIGN_OR_RETURN(auto* d16, KeptOutput(dx16, "LayerNormBackward16", dx));
    MS_ASSIGN_OR_RETURN(void* scratch,
                        ws_[kScratch].Get(device_, s_, sizeof(float) * kernels::LayerNormBackwardScratchFloats(N, C)));
    return Launch(
        kernels::LayerNormBackward(dx, dw, db, static_cast<float*>(scratch), static_cast<const __nv_bfloat16*>(dout16),
                                   x, w, mean, rstd, N, C, s_, d16, dsum, dsum2),
        "LayerNorm backward (bf16 output gradient)");
  }
  Status GeluForward(float* out, const float* x, int64_t n) override {
    return Launch(kernels::GeluForward(out, x, n, s_), "GeLU forward");
  }
  Status GeluBackward(float* dx, const float* x, const float* dout, int64_t n) override {
    return Launch(kernels::GeluBackward(dx, x, dout, n, s_), "GeLU backward");
  }
  // With bf16 GEMMs and a head dimension the tensor-core kernels take (a multiple of 16), attention runs on
  // tensor cores too (kernels/attention_tc.cu: bf16 operands, fp32 sums); else the fp32 kernels. Forward and
  // backward always take the same path.
  // out16 / dqkv16 (kept roundings): written by the tensor-core kernels as they store; after the fp32 kernels, by a
  // cast (the same bits). The qkv bias: added by the tensor-core kernels as they load q, k, v; its gradient summed by
  // them as they store dqkv.
  bool TensorCoreAttention(int64_t D) const {
    return bf16_ && D % 16 == 0;
  }
  bool attention_adds_qkv_bias(int64_t D) const override {
    return TensorCoreAttention(D);
  }
  Status QkvBiasTaken(const float* qkv_bias, int64_t D, const char* op) const {
    if (qkv_bias && !TensorCoreAttention(D)) {
      return FailedPrecondition(
          "{}: the qkv bias (or its gradient) is handled in attention only on tensor cores (bf16, D = {} a multiple "
          "of 16); leave it to the GEMM",
          op, D);
    }
    return Status::Ok();
  }
  using ops::Backend::AttentionBackward;
  using ops::Backend::AttentionForward;
  Status AttentionForward(float* out, float* lse, const float* qkv, const float* qkv_bias, int64_t B, int64_t T,
                          int64_t H, int64_t D, int64_t window, void* out16) override {
    MS_ASSIGN_OR_RETURN(auto* o16, KeptOutput(out16, "AttentionForward", out));
    MS_RETURN_IF_ERROR(QkvBiasTaken(qkv_bias, D, "AttentionForward"));
    if (TensorCoreAttention(D)) {
      return TunedForward(AttentionKey("forward", B, T, H, D, window, "fp32 qkv",
                                       {{"qkv", qkv}, {"bias", qkv_bias}, {"out", out}, {"out16", o16}, {"lse", lse}}),
                          B, T, H, D, out, o16, lse, "attention forward (bf16 tensor cores)", [=, this] {
                            return kernels::AttentionForwardBf16(out, lse, qkv, B, T, H, D, window, s_, o16, qkv_bias);
                          });
    }
    MS_RETURN_IF_ERROR(Launch(kernels::AttentionForward(out, lse, qkv, B, T, H, D, window, s_), "attention forward"));
    return o16 ? CastToBf16(o16, out, B * T * H * D) : Status::Ok();
  }
  Status AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* qkv_bias, const float* out,
                           const float* lse, int64_t B, int64_t T, int64_t H, int64_t D, int64_t window, void* dqkv16,
                           float* dqkv_bias) override {
    MS_ASSIGN_OR_RETURN(auto* d16, KeptOutput(dqkv16, "AttentionBackward", dqkv));
    MS_RETURN_IF_ERROR(QkvBiasTaken(qkv_bias, D, "AttentionBackward"));
    MS_RETURN_IF_ERROR(QkvBiasTaken(dqkv_bias, D, "AttentionBackward"));
    if (!dqkv && !TensorCoreAttention(D)) {  // (KeptOutput refused it unless dqkv16 is asked for)
      return InvalidArgument("AttentionBackward: the fp32 kernels (D = {}) write dqkv; it cannot be null", D);
    }
    MS_ASSIGN_OR_RETURN(float* drow, AttentionScratch(B, T, H, D, dqkv_bias != nullptr));
    if (TensorCoreAttention(D)) {
      MS_ASSIGN_OR_RETURN(__nv_bfloat16 * ds, DsTiles(B, T, H, window));
      return TunedBackward(AttentionKey("backward", B, T, H, D, window, "fp32 inputs",
                                        {{"dout", dout},
                                         {"qkv", qkv},
                                         {"bias", qkv_bias},
                                         {"out", out},
                                         {"dqkv", dqkv},
                                         {"dqkv16", d16},
                                         {"dbias", dqkv_bias},
                                         {"ds", ds}}),
                           B, T, H, D, dqkv, d16, dqkv_bias, "attention backward (bf16 tensor cores)",
                           [=, this](float* bias_grad) {
                             return kernels::AttentionBackwardBf16(dqkv, drow, dout, qkv, out, lse, B, T, H, D, window,
                                                                   s_, d16, qkv_bias, bias_grad, ds);
                           });
    }
    MS_RETURN_IF_ERROR(Launch(kernels::AttentionBackward(dqkv, drow, dout, qkv, out, lse, B, T, H, D, window, s_),
                              "attention backward"));
    return d16 ? CastToBf16(d16, dqkv, B * T * 3 * H * D) : Status::Ok();
  }
  // The tensor-core attention under runtime.attention_autotune (lib/cuda/attention_tune.h): the call's key — the
  // pass, the shape, its inputs' type and which inputs and outputs are given, and whether all are 16-byte aligned
  // (what the kernels' choice depends on).
  std::string AttentionKey(const char* pass, int64_t B, int64_t T, int64_t H, int64_t D, int64_t window,
                           const char* inputs, std::initializer_list<std::pair<const char*, const void*>> given) const {
    if (!tuner_.on()) return {};
    std::string names;
    bool aligned = true;
    for (const auto& [name, p] : given) {
      if (!p) continue;
      names += fmt::format("{}{}", names.empty() ? "" : " ", name);
      aligned = aligned && reinterpret_cast<uintptr_t>(p) % 16 == 0;
    }
    return fmt::format("{} B={} T={} H={} D={} window={} ({}: {}{})", pass, B, T, H, D, window, inputs, names,
                       aligned ? "" : "; not all 16-byte aligned");
  }
  // The forward `launch` makes (writing out, o16, lse) under the tuner's variant for `key`; with the tuner off, as it
  // is (the kernels' switches as they were set).
  template <typename L>
  Status TunedForward(const std::string& key, int64_t B, int64_t T, int64_t H, int64_t D, const float* out,
                      const void* o16, const float* lse, const char* what, const L& launch) {
    if (!tuner_.on()) return Launch(launch(), what);
    const size_t n = static_cast<size_t>(B * T * H * D);
    const AttentionVariant def;
    MS_ASSIGN_OR_RETURN(const AttentionVariant v,
                        tuner_.Choose(key, /*backward=*/false, D, def, s_, capture_,
                                      {{"out", out, out ? sizeof(float) * n : 0},
                                       {"out16", o16, o16 ? 2 * n : 0},
                                       {"lse", lse, sizeof(float) * static_cast<size_t>(B * H * T)}},
                                      launch, [] { return cudaSuccess; }));
    v.Apply();
    const cudaError_t err = launch();
    def.Apply();
    return Launch(err, what);
  }
  // The backward `launch(bias_grad)` makes (writing dqkv, d16, adding the qkv bias gradient into bias_grad: the
  // caller's dqkv_bias, or in tuning runs a scratch zeroed before each) with the tuner's variant for `key`, else with
  // runtime.attention_split_dkdv's dK/dV kernel; counting the calls the split kernel ran (AttentionStats::split_dkdv;
  // the kernels decide where it applies). The kernels' switches are process-wide: set before every call, so that two
  // backends of a process keep their own.
  template <typename L>
  Status TunedBackward(const std::string& key, int64_t B, int64_t T, int64_t H, int64_t D, const float* dqkv,
                       const void* d16, float* dqkv_bias, const char* what, const L& launch) {
    AttentionVariant def;
    def.split = split_dkdv_;
    AttentionVariant v = def;
    if (tuner_.on()) {
      const size_t n = static_cast<size_t>(B * T * 3 * H * D), nb = static_cast<size_t>(3 * H * D);
      float* tune_bias = nullptr;
      if (dqkv_bias && !capture_) {
        MS_ASSIGN_OR_RETURN(void* p, ws_[kTune].Get(device_, s_, sizeof(float) * nb));
        tune_bias = static_cast<float*>(p);
      }
      MS_ASSIGN_OR_RETURN(
          v, tuner_.Choose(
                 key, /*backward=*/true, D, def, s_, capture_,
                 {{"dqkv", dqkv, dqkv ? sizeof(float) * n : 0},
                  {"dqkv16", d16, d16 ? 2 * n : 0},
                  {"qkv bias gradient", tune_bias, tune_bias ? sizeof(float) * nb : 0}},
                 [&] { return launch(tune_bias); },
                 [&] { return tune_bias ? cudaMemsetAsync(tune_bias, 0, sizeof(float) * nb, s_) : cudaSuccess; }));
      v.Apply();
    } else {
      kernels::SetAttentionTcSplitDkDv(split_dkdv_);
    }
    const int64_t before = kernels::AttentionTcSplitDkDvLaunches();
    const cudaError_t err = launch(dqkv_bias);
    attention_stats_.split_dkdv += kernels::AttentionTcSplitDkDvLaunches() - before;
    if (tuner_.on()) def.Apply();
    return Launch(err, what);
  }
  // The attention backward's scratch: the row terms, then (with the qkv bias gradient) its 16-row chunk sums.
  Result<float*> AttentionScratch(int64_t B, int64_t T, int64_t H, int64_t D, bool bias_grad) {
    const int64_t floats = kernels::AttentionBackwardScratchFloats(B, T, H, D) +
                           (bias_grad ? kernels::AttentionBiasGradScratchFloats(B, T, H, D) : 0);
    MS_ASSIGN_OR_RETURN(void* scratch, ws_[kScratch].Get(device_, s_, sizeof(float) * floats));
    return static_cast<float*>(scratch);
  }
  // The tensor-core attention backward's dS tiles (runtime.attention_stored_ds: kept between its dK/dV and dQ
  // kernels, 5 products instead of 7; kernels/attention.h), or null where it forms dS again (off, or the tiles above
  // ds_max_bytes_); counted either way.
  Result<__nv_bfloat16*> DsTiles(int64_t B, int64_t T, int64_t H, int64_t window) {
    const int64_t bytes = kernels::AttentionDsTileBytes(B, T, H, window);
    if (bytes > ds_max_bytes_) {
      ++attention_stats_.recompute;
      return static_cast<__nv_bfloat16*>(nullptr);
    }
    MS_ASSIGN_OR_RETURN(void* tiles, ws_[kDsTiles].Get(device_, s_, static_cast<size_t>(bytes)));
    ++attention_stats_.stored_ds;
    return static_cast<__nv_bfloat16*>(tiles);
  }
  // The attention's inputs read in bf16 (runtime.activations: bf16): the tensor-core kernels' bf16 instantiations.
  bool Bf16AttentionInputs(int64_t D) const {
    return bf16_activations() && TensorCoreAttention(D);
  }
  Status AttentionForward16(float* out, float* lse, const void* qkv16, const float* qkv_bias, int64_t B, int64_t T,
                            int64_t H, int64_t D, int64_t window, void* out16) override {
    if (!Bf16AttentionInputs(D))
      return ops::Backend::AttentionForward16(out, lse, qkv16, qkv_bias, B, T, H, D, window, out16);
    MS_ASSIGN_OR_RETURN(auto* o16, KeptOutput(out16, "AttentionForward16", out));
    MS_ASSIGN_OR_RETURN(const bool by_cudnn, CudnnAttentionForward(out, lse, qkv16, qkv_bias, B, T, H, D, window, o16));
    if (by_cudnn) return Status::Ok();
    const auto* q16 = static_cast<const __nv_bfloat16*>(qkv16);
    return TunedForward(AttentionKey("forward", B, T, H, D, window, "bf16 qkv",
                                     {{"qkv", q16}, {"bias", qkv_bias}, {"out", out}, {"out16", o16}, {"lse", lse}}),
                        B, T, H, D, out, o16, lse, "attention forward (bf16 inputs, tensor cores)", [=, this] {
                          return kernels::AttentionForwardBf16(out, lse, q16, B, T, H, D, window, s_, o16, qkv_bias);
                        });
  }
  // runtime.attention_kernels: cudnn — the attention through cuDNN's fused attention (lib/cuda/cudnn_sdpa.h) where it
  // takes the call: bf16 outputs only (cuDNN writes out16 and dqkv16, not fp32), no qkv bias to add (it is in the qkv
  // GEMM's epilogue), the backward reading the forward's bf16 output, a head dim cuDNN takes, 16-byte aligned rows.
  // Else, or when cuDNN fails (no library, no engine, a plan that does not build), megascale's kernel runs, counted,
  // the first reason kept for the run's log, and cuDNN is left off after a failure. The forward's lse is the
  // log-sum-exp of the scaled scores either way, so either backward follows either forward.
#if defined(MS_CUDA_HAVE_CUDNN)
  // Empty when cuDNN can run this call (its Sdpa made), else why not.
  std::string CudnnRefusal(bool fp32_out, const float* qkv_bias, const void* qkv16, const void* out16, int64_t B,
                           int64_t T, int64_t H, int64_t D, int64_t window) {
    if (fp32_out || out16 == nullptr) return "the fp32 output is asked for (cuDNN writes only its bf16 rounding)";
    if (qkv_bias != nullptr) return "the attention adds the qkv bias (runtime.gemm_epilogues: false)";
    if (std::string why = cudnn::Unsupported({B, T, H, D, window}); !why.empty()) return why;
    const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    if (!aligned(qkv16) || !aligned(out16) || (H * D) % 8 != 0) return "rows not 16-byte aligned";
    if (!cudnn_sdpa_) {
      cudnn::Sdpa::Memory memory;
      memory.workspace = [this](size_t bytes) -> Result<void*> { return CudnnScratch(kCudnn, bytes); };
      memory.zero = [this](void* p, size_t bytes) -> Status {
        MS_CUDA_OK(cudaMemsetAsync(p, 0, bytes, s_), "zeroing cuDNN's dQ accumulator");
        return Status::Ok();
      };
      memory.keep = [this](const void* host, size_t bytes) -> Result<void*> {
        MS_ASSIGN_OR_RETURN(void* p, device_->Alloc(bytes));
        cudnn_kept_.push_back(p);
        MS_CUDA_OK(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice), "uploading cuDNN's sequence lengths");
        return p;
      };
      auto made = cudnn::Sdpa::Create(s_, std::move(memory));
      if (!made.ok()) {
        cudnn_attention_ = false;
        return made.status().message();
      }
      cudnn_sdpa_ = std::move(made).value();
    }
    return "";
  }
  // cuDNN's workspace and row-term scratch; with SetCudnnScratchFill (tests) 1 MiB longer and filled, slack too.
  Result<void*> CudnnScratch(int which, size_t bytes) {
    const int fill = CudnnScratchFill();
    const size_t n = bytes + (fill >= 0 ? size_t{1} << 20 : 0);
    MS_ASSIGN_OR_RETURN(void* p, ws_[which].Get(device_, s_, n));
    if (fill >= 0) MS_CUDA_OK(cudaMemsetAsync(p, fill, n, s_), "filling cuDNN's scratch (SetCudnnScratchFill)");
    return p;
  }
  // After a call cuDNN ran (ok) or could not: counts it, logs the first plan and the first fallback.
  bool CudnnRan(const Status& ran, std::string why, cudnn::Pass pass, const cudnn::SdpaShape& shape) {
    if (why.empty() && ran.ok()) {
      int64_t& n = pass == cudnn::Pass::kForward ? attention_stats_.cudnn_forward : attention_stats_.cudnn_backward;
      if (n++ == 0) {
        LogInfo("attention {}: cuDNN's fused attention (B {}, T {}, H {}, D {}, window {}): {}",
                pass == cudnn::Pass::kForward ? "forward" : "backward", shape.B, shape.T, shape.H, shape.D,
                shape.window, cudnn_sdpa_->Describe(shape, pass));
      }
      return true;
    }
    if (why.empty()) {
      why = ran.message();
      cudnn_attention_ = false;  // a plan that does not build or run: megascale's kernels from here on
    }
    if (attention_stats_.cudnn_fallback++ == 0) {
      attention_stats_.cudnn_note = why;
      LogWarn("runtime.attention_kernels: cudnn: this attention {} runs on megascale's kernels: {}",
              pass == cudnn::Pass::kForward ? "forward" : "backward", why);
    }
    return false;
  }
  // cuDNN's first call of each shape and pass is checked against megascale's kernels on the same inputs (a fused
  // engine that computes something else must not train a model: on an H200 one did, 2026-11-28). Where they
  // disagree, megascale's result replaces cuDNN's, cuDNN is left off for the rest of the run, and the run's log
  // says why.
  static std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t> CheckKey(const cudnn::SdpaShape& s,
                                                                               cudnn::Pass pass) {
    return {static_cast<int>(pass), s.B, s.T, s.H, s.D, s.window};
  }
  void CudnnDisagreed(const cudnn::SdpaShape& s, cudnn::Pass pass, const std::string& what) {
    ++attention_stats_.cudnn_disagreed;
    cudnn_attention_ = false;
    const std::string why =
        fmt::format("cuDNN's attention {} disagrees with megascale's kernels (B {}, T {}, H {}, D {}, window {}): {}",
                    pass == cudnn::Pass::kForward ? "forward" : "backward", s.B, s.T, s.H, s.D, s.window, what);
    if (attention_stats_.cudnn_note.empty()) attention_stats_.cudnn_note = why;
    LogWarn("runtime.attention_kernels: cudnn: {}; megascale's kernels run the attention from here on", why);
  }
#endif
  // How far a device result `got` is from `want` (n elements each, bf16 or fp32): read back to the host, which
  // synchronizes the stream (the cuDNN checks: once per shape).
  struct Discrepancy {
    double worst = 0, scale = 0;  // max |got - want| (infinite where got is not finite), max |want|
    bool Within(double rtol) const { return worst <= rtol * scale + 1e-6; }
    std::string ToString() const {
      return fmt::format("differs by up to {:.4g} where the values reach {:.4g}", worst, scale);
    }
  };
  template <typename T>
  Result<Discrepancy> Compare(const T* got, const T* want, int64_t n) {
    std::vector<T> g(static_cast<size_t>(n)), w(static_cast<size_t>(n));
    MS_CUDA_OK(cudaMemcpyAsync(g.data(), got, sizeof(T) * n, cudaMemcpyDeviceToHost, s_), "reading a checked result");
    MS_CUDA_OK(cudaMemcpyAsync(w.data(), want, sizeof(T) * n, cudaMemcpyDeviceToHost, s_), "reading a checked result");
    MS_CUDA_OK(cudaStreamSynchronize(s_), "reading a checked result");
    const auto value = [](T x) -> double {
      if constexpr (std::is_same_v<T, float>) {
        return x;
      } else {
        uint16_t half;
        std::memcpy(&half, &x, sizeof half);
        const uint32_t bits = static_cast<uint32_t>(half) << 16;
        float f;
        std::memcpy(&f, &bits, sizeof f);
        return f;
      }
    };
    Discrepancy d;
    for (int64_t i = 0; i < n; ++i) {
      const double a = value(g[i]), b = value(w[i]);
      const double diff = std::isfinite(a) ? std::fabs(a - b) : std::numeric_limits<double>::infinity();
      d.worst = std::max(d.worst, diff);
      if (std::isfinite(b)) d.scale = std::max(d.scale, std::fabs(b));
    }
    return d;
  }
  // True when cuDNN ran the forward.
  Result<bool> CudnnAttentionForward(const float* out, float* lse, const void* qkv16, const float* qkv_bias, int64_t B,
                                     int64_t T, int64_t H, int64_t D, int64_t window, __nv_bfloat16* o16) {
    if (!cudnn_attention_) {
      if (cudnn_wanted_) ++attention_stats_.cudnn_fallback;  // left off after a failure or a disagreement
      return false;
    }
#if defined(MS_CUDA_HAVE_CUDNN)
    const cudnn::SdpaShape shape{B, T, H, D, window};
    const std::string why = CudnnRefusal(out != nullptr, qkv_bias, qkv16, o16, B, T, H, D, window);
    Status ran;
    if (why.empty()) ran = cudnn_sdpa_->Forward(qkv16, o16, lse, shape);
    if (!CudnnRan(ran, why, cudnn::Pass::kForward, shape)) return false;
    if (!cudnn_checked_.insert(CheckKey(shape, cudnn::Pass::kForward)).second) return true;
    // The first forward of this shape: megascale's kernel on the same inputs, into the check buffer.
    const int64_t n_out = B * T * H * D, n_lse = B * H * T;
    const size_t lse_at = (static_cast<size_t>(n_out) * 2 + 255) / 256 * 256;
    MS_ASSIGN_OR_RETURN(void* buf, ws_[kCudnnCheck].Get(device_, s_, lse_at + sizeof(float) * n_lse));
    auto* o_ref = static_cast<__nv_bfloat16*>(buf);
    auto* lse_ref = reinterpret_cast<float*>(static_cast<char*>(buf) + lse_at);
    MS_RETURN_IF_ERROR(Launch(kernels::AttentionForwardBf16(nullptr, lse_ref, static_cast<const __nv_bfloat16*>(qkv16),
                                                            B, T, H, D, window, s_, o_ref, nullptr),
                              "attention forward (checking cuDNN's)"));
    MS_ASSIGN_OR_RETURN(const Discrepancy d_out, Compare(o16, o_ref, n_out));
    MS_ASSIGN_OR_RETURN(const Discrepancy d_lse, Compare(lse, lse_ref, n_lse));
    std::string bad;
    if (!d_out.Within(CudnnCheckTolerance())) bad = fmt::format("the output {}", d_out.ToString());
    if (!d_lse.Within(CudnnCheckTolerance()))
      bad += fmt::format("{}the log-sum-exp {}", bad.empty() ? "" : "; ", d_lse.ToString());
    if (bad.empty()) return true;
    MS_CUDA_OK(cudaMemcpyAsync(o16, o_ref, sizeof(uint16_t) * n_out, cudaMemcpyDeviceToDevice, s_),
               "taking megascale's attention output");
    MS_CUDA_OK(cudaMemcpyAsync(lse, lse_ref, sizeof(float) * n_lse, cudaMemcpyDeviceToDevice, s_),
               "taking megascale's attention log-sum-exp");
    CudnnDisagreed(shape, cudnn::Pass::kForward, bad);
    return true;  // this call's outputs are written (megascale's)
#else
    (void)out, (void)lse, (void)qkv16, (void)qkv_bias, (void)B, (void)T, (void)H, (void)D, (void)window, (void)o16;
    return Internal("runtime.attention_kernels: cudnn in a build without cuDNN support");
#endif
  }
  // True when cuDNN ran the backward (dqkv16 written; dqkv_bias += its column sums, by BiasGrad over dqkv16).
  Result<bool> CudnnAttentionBackward(const float* dqkv, const void* dout16, const void* qkv16, const float* qkv_bias,
                                      const void* out16_in, const float* lse, int64_t B, int64_t T, int64_t H,
                                      int64_t D, int64_t window, __nv_bfloat16* d16, float* dqkv_bias) {
    if (!cudnn_attention_) {
      if (cudnn_wanted_) ++attention_stats_.cudnn_fallback;  // left off after a failure or a disagreement
      return false;
    }
#if defined(MS_CUDA_HAVE_CUDNN)
    const cudnn::SdpaShape shape{B, T, H, D, window};
    std::string why = CudnnRefusal(dqkv != nullptr, qkv_bias, qkv16, d16, B, T, H, D, window);
    if (why.empty() && out16_in == nullptr) why = "the backward reads the fp32 attention output";
    if (why.empty() && reinterpret_cast<uintptr_t>(dout16) % 16 != 0) why = "dout rows not 16-byte aligned";
    Status ran;
    if (why.empty()) {
      auto rows = CudnnScratch(kCudnnRows, sizeof(float) * static_cast<size_t>(B * H * T));
      ran = rows.ok() ? cudnn_sdpa_->Backward(qkv16, out16_in, dout16, lse, d16, static_cast<float*>(*rows), shape)
                      : rows.status();
    }
    if (!CudnnRan(ran, why, cudnn::Pass::kBackward, shape)) return false;
    if (cudnn_checked_.insert(CheckKey(shape, cudnn::Pass::kBackward)).second) {
      // The first backward of this shape: megascale's kernels on the same inputs, into the check buffer.
      const int64_t n_qkv = B * T * 3 * H * D;
      MS_ASSIGN_OR_RETURN(void* buf, ws_[kCudnnCheck].Get(device_, s_, sizeof(uint16_t) * n_qkv));
      auto* ref = static_cast<__nv_bfloat16*>(buf);
      MS_ASSIGN_OR_RETURN(float* drow, AttentionScratch(B, T, H, D, false));
      MS_ASSIGN_OR_RETURN(__nv_bfloat16 * ds, DsTiles(B, T, H, window));
      kernels::SetAttentionTcSplitDkDv(split_dkdv_);
      MS_RETURN_IF_ERROR(Launch(kernels::AttentionBackwardBf16(nullptr, drow, static_cast<const __nv_bfloat16*>(dout16),
                                                               static_cast<const __nv_bfloat16*>(qkv16), nullptr,
                                                               static_cast<const __nv_bfloat16*>(out16_in), lse, B, T,
                                                               H, D, window, s_, ref, nullptr, nullptr, ds),
                                "attention backward (checking cuDNN's)"));
      MS_ASSIGN_OR_RETURN(const Discrepancy d, Compare(d16, ref, n_qkv));
      if (!d.Within(CudnnCheckTolerance())) {
        MS_CUDA_OK(cudaMemcpyAsync(d16, ref, sizeof(uint16_t) * n_qkv, cudaMemcpyDeviceToDevice, s_),
                   "taking megascale's attention gradient");
        CudnnDisagreed(shape, cudnn::Pass::kBackward, "the gradient dqkv " + d.ToString());
      }
    }
    if (dqkv_bias != nullptr) {
      const int64_t R = B * T, C = 3 * H * D;
      MS_ASSIGN_OR_RETURN(void* scratch,
                          ws_[kScratch].Get(device_, s_, sizeof(float) * kernels::BiasGradScratchFloats(R, C)));
      MS_RETURN_IF_ERROR(Launch(kernels::BiasGrad(dqkv_bias, static_cast<float*>(scratch), d16, R, C, s_),
                                "qkv bias gradient (after cuDNN's attention backward)"));
    }
    return true;
#else
    (void)dqkv, (void)dout16, (void)qkv16, (void)qkv_bias, (void)out16_in, (void)lse, (void)B, (void)T, (void)H,
        (void)D, (void)window, (void)d16, (void)dqkv_bias;
    return Internal("runtime.attention_kernels: cudnn in a build without cuDNN support");
#endif
  }
  Status AttentionBackward16(float* dqkv, const void* dout16, const void* qkv16, const float* qkv_bias,
                             const float* out, const void* out16_in, const float* lse, int64_t B, int64_t T, int64_t H,
                             int64_t D, int64_t window, void* dqkv16, float* dqkv_bias) override {
    if (!Bf16AttentionInputs(D)) {
      return ops::Backend::AttentionBackward16(dqkv, dout16, qkv16, qkv_bias, out, out16_in, lse, B, T, H, D, window,
                                               dqkv16, dqkv_bias);
    }
    if ((out == nullptr) == (out16_in == nullptr)) {
      return InvalidArgument("AttentionBackward16: exactly one of out (fp32) and its bf16 rounding is read");
    }
    MS_ASSIGN_OR_RETURN(auto* d16, KeptOutput(dqkv16, "AttentionBackward16", dqkv));
    MS_ASSIGN_OR_RETURN(const bool by_cudnn, CudnnAttentionBackward(dqkv, dout16, qkv16, qkv_bias, out16_in, lse, B, T,
                                                                    H, D, window, d16, dqkv_bias));
    if (by_cudnn) return Status::Ok();
    MS_ASSIGN_OR_RETURN(float* drow, AttentionScratch(B, T, H, D, dqkv_bias != nullptr));
    MS_ASSIGN_OR_RETURN(__nv_bfloat16 * ds, DsTiles(B, T, H, window));
    const auto* g16 = static_cast<const __nv_bfloat16*>(dout16);
    const auto* q16 = static_cast<const __nv_bfloat16*>(qkv16);
    const auto* o16 = static_cast<const __nv_bfloat16*>(out16_in);
    return TunedBackward(AttentionKey("backward", B, T, H, D, window, "bf16 inputs",
                                      {{"dout", g16},
                                       {"qkv", q16},
                                       {"bias", qkv_bias},
                                       {"out", out},
                                       {"out16", o16},
                                       {"dqkv", dqkv},
                                       {"dqkv16", d16},
                                       {"dbias", dqkv_bias},
                                       {"ds", ds}}),
                         B, T, H, D, dqkv, d16, dqkv_bias, "attention backward (bf16 inputs, tensor cores)",
                         [=, this](float* bias_grad) {
                           return kernels::AttentionBackwardBf16(dqkv, drow, g16, q16, out, o16, lse, B, T, H, D,
                                                                 window, s_, d16, qkv_bias, bias_grad, ds);
                         });
  }
  Status CrossEntropyForward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                             int64_t V) override {
    return Launch(kernels::CrossEntropyForward(losses, lse, logits, targets, N, V, s_), "cross-entropy forward");
  }
  using ops::Backend::CrossEntropyBackward;
  using ops::Backend::CrossEntropyFused;
  using ops::Backend::VocabParallelBackward;
  Status CrossEntropyFused(float* losses, float* lse, float* logits, const int32_t* targets, const float* dloss,
                           int64_t N, int64_t V, void* dlogits16, bool fp32_dlogits) override {
    MS_ASSIGN_OR_RETURN(auto* d16, KeptOutput(dlogits16, "CrossEntropyFused", fp32_dlogits ? logits : nullptr));
    return Launch(kernels::CrossEntropyFused(losses, lse, logits, targets, dloss, N, V, s_, d16, fp32_dlogits),
                  "fused cross-entropy");
  }
  Status CrossEntropyBackward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                              const float* dloss, int64_t N, int64_t V, void* dlogits16) override {
    MS_ASSIGN_OR_RETURN(auto* d16, KeptOutput(dlogits16, "CrossEntropyBackward", dlogits));
    return Launch(kernels::CrossEntropyBackward(dlogits, logits, lse, targets, dloss, N, V, s_, d16),
                  "cross-entropy backward");
  }
  Status VocabParallelRowStats(float* mx, float* se, float* tl, const float* logits, const int32_t* targets,
                               int64_t vstart, int64_t N, int64_t V) override {
    return Launch(kernels::VocabParallelRowStats(mx, se, tl, logits, targets, vstart, N, V, s_),
                  "vocab-parallel row max and sum of exponentials");
  }
  Status VocabParallelRebase(float* se, const float* mx_local, const float* mx_global, int64_t N) override {
    return Launch(kernels::VocabParallelRebase(se, mx_local, mx_global, N, s_), "vocab-parallel rebase");
  }
  Status VocabParallelFinish(float* losses, float* lse, const float* mx, const float* se, const float* tl,
                             const int32_t* targets, int64_t N) override {
    return Launch(kernels::VocabParallelFinish(losses, lse, mx, se, tl, targets, N, s_), "vocab-parallel loss");
  }
  Status VocabParallelBackward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                               float dloss, int64_t vstart, int64_t N, int64_t V, void* dlogits16) override {
    MS_ASSIGN_OR_RETURN(auto* d16, KeptOutput(dlogits16, "VocabParallelBackward", dlogits));
    return Launch(kernels::VocabParallelBackward(dlogits, logits, lse, targets, dloss, vstart, N, V, s_, d16),
                  "vocab-parallel cross-entropy backward");
  }
  Status EmbeddingForward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C) override {
    return Launch(kernels::EmbeddingForward(out, ids, table, N, C, s_), "embedding forward");
  }
  Status EmbeddingBackward(float* dtable, const int32_t* ids, const float* dout, int64_t N, int64_t C) override {
    MS_ASSIGN_OR_RETURN(void* scratch, ws_[kScratch].Get(device_, s_, kernels::EmbeddingBackwardScratchBytes(N)));
    return Launch(kernels::EmbeddingBackward(dtable, scratch, ids, dout, N, C, s_), "embedding backward");
  }
  Status AddInPlace(float* y, const float* x, int64_t n) override {
    return Launch(kernels::AddInPlace(y, x, n, s_), "add");
  }
  Status Add(float* out, const float* a, const float* b, int64_t n) override {
    return Launch(kernels::Add(out, a, b, n, s_), "add");
  }
  Status Scale(float* x, float a, int64_t n) override {
    return Launch(kernels::Scale(x, a, n, s_), "scale");
  }
  Status AddRowBias(float* y, const float* b, int64_t R, int64_t C) override {
    return Launch(kernels::AddRowBias(y, b, R, C, s_), "bias add");
  }
  Status ResidualAdd(float* out, const float* x, const float* part, const float* bias, const float* bias2, int64_t R,
                     int64_t C) override {
    return Launch(kernels::ResidualAdd(out, x, part, bias, bias2, R, C, s_), "residual add");
  }
  Status ResidualLayerNormForward(float* res, const float* x, const float* part, const float* bias, const float* bias2,
                                  float* out, float* mean, float* rstd, const float* w, const float* b, int64_t R,
                                  int64_t C, float eps, void* out16) override {
    MS_ASSIGN_OR_RETURN(auto* o16, KeptOutput(out16, "ResidualLayerNormForward", out));
    return Launch(
        kernels::ResidualLayerNormForward(res, out, mean, rstd, x, part, bias, bias2, w, b, R, C, eps, s_, o16),
        "residual add + LayerNorm forward");
  }
  Status ResidualAdd16(float* out, const float* x, const void* part16, const float* bias, const float* bias2, int64_t R,
                       int64_t C) override {
    if (!bf16_activations()) return ops::Backend::ResidualAdd16(out, x, part16, bias, bias2, R, C);
    if (!part16) return InvalidArgument("ResidualAdd16: part16 is needed");
    return Launch(kernels::ResidualAdd(out, x, static_cast<const __nv_bfloat16*>(part16), bias, bias2, R, C, s_),
                  "residual add (bf16 branch output)");
  }
  Status ResidualLayerNormForward16(float* res, const float* x, const void* part16, const float* bias,
                                    const float* bias2, float* out, float* mean, float* rstd, const float* w,
                                    const float* b, int64_t R, int64_t C, float eps, void* out16) override {
    if (!bf16_activations()) {
      return ops::Backend::ResidualLayerNormForward16(res, x, part16, bias, bias2, out, mean, rstd, w, b, R, C, eps,
                                                      out16);
    }
    if (!part16) return InvalidArgument("ResidualLayerNormForward16: part16 is needed");
    MS_ASSIGN_OR_RETURN(auto* o16, KeptOutput(out16, "ResidualLayerNormForward16", out));
    return Launch(kernels::ResidualLayerNormForward(res, out, mean, rstd, x, static_cast<const __nv_bfloat16*>(part16),
                                                    bias, bias2, w, b, R, C, eps, s_, o16),
                  "residual add + LayerNorm forward (bf16 branch output)");
  }
  Status BiasGeluForward(float* out, const float* x, const float* bias, int64_t R, int64_t C, void* out16) override {
    MS_ASSIGN_OR_RETURN(auto* o16, KeptOutput(out16, "BiasGeluForward", out));
    return Launch(kernels::BiasGeluForward(out, x, bias, R, C, s_, o16), "bias + GeLU forward");
  }
  using ops::Backend::BiasGeluBackward;
  Status BiasGeluBackward(float* dx, float* dbias, const float* x, const float* bias, const float* dout, int64_t R,
                          int64_t C, void* dx16) override {
    MS_ASSIGN_OR_RETURN(auto* d16, KeptOutput(dx16, "BiasGeluBackward", dx));
    MS_ASSIGN_OR_RETURN(void* scratch,
                        ws_[kScratch].Get(device_, s_, sizeof(float) * kernels::BiasGradScratchFloats(R, C)));
    return Launch(kernels::BiasGeluBackward(dx, dbias, static_cast<float*>(scratch), x, bias, dout, R, C, s_, d16),
                  "bias + GeLU backward");
  }
  bool bf16_activations() const override {
    return bf16_ && !cublas_converts_;
  }
  bool gemm_gelu_epilogue() const override {
    return keep_;
  }
  EpilogueStats epilogue_stats() const {
    return epilogue_stats_;
  }
  AttentionStats attention_stats() const {
    AttentionStats a = attention_stats_;
    a.autotuned = tuner_.tuned();
    a.autotune_disagreed = tuner_.disagreed();
    a.autotune_notes = tuner_.notes();
    return a;
  }
  void EnableSplitDkDv(bool on) {
    split_dkdv_ = on;
  }
  void EnableAttentionAutotune(bool on) {
    tuner_.set_on(on);
  }
  Status EnableCudnnAttention() {
#if defined(MS_CUDA_HAVE_CUDNN)
    if (!bf16_) return InvalidArgument("runtime.attention_kernels: cudnn needs train.precision: bf16");
    cudnn_attention_ = cudnn_wanted_ = true;
    return Status::Ok();
#else
    return Unimplemented(
        "runtime.attention_kernels: cudnn needs the GPU build of megascale with cuDNN's headers (cudnn.h) found at "
        "build time; this is the {} flavor{}",
        FlavorName(LinkedFlavor()), LinkedFlavor() == Flavor::kEmulated ? " (the emulator cannot run cuDNN)" : "");
#endif
  }

  Status BiasGeluForward16(float* out, const void* x16, const float* bias, int64_t R, int64_t C, void* out16) override {
    if (!bf16_activations()) return ops::Backend::BiasGeluForward16(out, x16, bias, R, C, out16);
    MS_ASSIGN_OR_RETURN(auto* o16, KeptOutput(out16, "BiasGeluForward16", out));
    return Launch(kernels::BiasGeluForward(out, static_cast<const __nv_bfloat16*>(x16), bias, R, C, s_, o16),
                  "bias + GeLU forward (bf16 input)");
  }
  Status BiasGeluBackward16(float* dx, float* dbias, const void* x16, const float* bias, const float* dout,
                            const void* dout16, int64_t R, int64_t C, void* dx16) override {
    if (!bf16_activations()) return ops::Backend::BiasGeluBackward16(dx, dbias, x16, bias, dout, dout16, R, C, dx16);
    if ((dout == nullptr) == (dout16 == nullptr)) {
      return InvalidArgument("BiasGeluBackward16: exactly one of dout (fp32) and dout16 (bf16) is read");
    }
    MS_ASSIGN_OR_RETURN(auto* d16, KeptOutput(dx16, "BiasGeluBackward16", dx));
    MS_ASSIGN_OR_RETURN(void* scratch,
                        ws_[kScratch].Get(device_, s_, sizeof(float) * kernels::BiasGradScratchFloats(R, C)));
    const auto* x = static_cast<const __nv_bfloat16*>(x16);
    if (dout16) {
      return Launch(kernels::BiasGeluBackward(dx, dbias, static_cast<float*>(scratch), x, bias,
                                              static_cast<const __nv_bfloat16*>(dout16), R, C, s_, d16),
                    "bias + GeLU backward (bf16 input and output gradient)");
    }
    return Launch(kernels::BiasGeluBackward(dx, dbias, static_cast<float*>(scratch), x, bias, dout, R, C, s_, d16),
                  "bias + GeLU backward (bf16 input)");
  }
  Status CrossEntropyForward16(float* losses, float* lse, const void* logits16, const int32_t* targets, int64_t N,
                               int64_t V, int64_t Vv) override {
    if (!bf16_activations()) return ops::Backend::CrossEntropyForward16(losses, lse, logits16, targets, N, V, Vv);
    return Launch(
        kernels::CrossEntropyForward(losses, lse, static_cast<const __nv_bfloat16*>(logits16), targets, N, V, Vv, s_),
        "cross-entropy forward (bf16 logits)");
  }
  Status CrossEntropyBackward16(void* dlogits16, const void* logits16, const float* lse, const int32_t* targets,
                                const float* dloss, int64_t N, int64_t V, int64_t Vv) override {
    if (!bf16_activations()) {
      return ops::Backend::CrossEntropyBackward16(dlogits16, logits16, lse, targets, dloss, N, V, Vv);
    }
    return Launch(
        kernels::CrossEntropyBackward(static_cast<__nv_bfloat16*>(dlogits16),
                                      static_cast<const __nv_bfloat16*>(logits16), lse, targets, dloss, N, V, Vv, s_),
        "cross-entropy backward (bf16 logits)");
  }
  Status CrossEntropyFused16(float* losses, float* lse, void* logits16, const int32_t* targets, const float* dloss,
                             int64_t N, int64_t V, int64_t Vv) override {
    if (!bf16_activations()) return ops::Backend::CrossEntropyFused16(losses, lse, logits16, targets, dloss, N, V, Vv);
    return Launch(
        kernels::CrossEntropyFused(losses, lse, static_cast<__nv_bfloat16*>(logits16), targets, dloss, N, V, Vv, s_),
        "cross-entropy fused (bf16 logits)");
  }
  Status BiasGrad(float* db, const float* dy, int64_t R, int64_t C) override {
    MS_ASSIGN_OR_RETURN(void* scratch,
                        ws_[kScratch].Get(device_, s_, sizeof(float) * kernels::BiasGradScratchFloats(R, C)));
    return Launch(kernels::BiasGrad(db, static_cast<float*>(scratch), dy, R, C, s_), "bias gradient");
  }
  Status AddPositions(float* x, const float* wpe, int64_t R, int64_t C, int64_t T, int64_t row0) override {
    return Launch(kernels::AddPositions(x, wpe, R, C, T, row0, s_), "position embedding");
  }
  Status PositionsBackward(float* dwpe, const float* dx, int64_t R, int64_t C, int64_t T, int64_t row0) override {
    return Launch(kernels::PositionsBackward(dwpe, dx, R, C, T, row0, s_), "position embedding backward");
  }
  Status SumSquares(const float* const* xs, const int64_t* ns, int count, double* out) override {
    if (count == 0) return Status::Ok();
    MS_ASSIGN_OR_RETURN(void* res, ws_[kNorms].Get(device_, s_, sizeof(double) * count));
    MS_ASSIGN_OR_RETURN(void* scratch,
                        ws_[kScratch].Get(device_, s_, sizeof(double) * kernels::SumSquaresScratchDoubles(ns, count)));
    MS_RETURN_IF_ERROR(
        Launch(kernels::SumSquaresMulti(static_cast<double*>(res), static_cast<double*>(scratch), xs, ns, count, s_),
               "sums of squares"));
    return CopyToHost(out, res, sizeof(double) * count);
  }
  Status AdamW(const ops::AdamWTensor* t, int count, int64_t step) override {
    for (int i = 0; i < count; ++i) {
      if (t[i].p16 && !keep_) {
        return FailedPrecondition("the {} backend keeps no bf16 weight copies (AdamW p16)", name());
      }
    }
    // One multi-tensor launch per run of tensors with the same hyper-parameters (weight decay on/off).
    std::vector<kernels::AdamWTensor> group;
    for (int i = 0; i < count;) {
      const ops::AdamParams& hp = t[i].hp;
      group.clear();
      int j = i;
      for (; j < count && SameHp(t[j].hp, hp); ++j) {
        group.push_back({t[j].p, t[j].g, t[j].m, t[j].v, t[j].n, static_cast<__nv_bfloat16*>(t[j].p16)});
      }
      const kernels::AdamWHyper h{hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay};
      MS_RETURN_IF_ERROR(
          Launch(kernels::AdamWMultiTensor(group.data(), static_cast<int>(group.size()), h, step, s_), "AdamW step"));
      i = j;
    }
    return Status::Ok();
  }
  Status LambDirection(const ops::LambTensor* t, int count, int64_t step) override {
    std::vector<kernels::LambTensor> group;
    for (int i = 0; i < count;) {
      const ops::AdamParams& hp = t[i].hp;
      group.clear();
      int j = i;
      for (; j < count && SameHp(t[j].hp, hp); ++j) {
        group.push_back({t[j].u, t[j].p, t[j].g, t[j].m, t[j].v, t[j].n});
      }
      const kernels::AdamWHyper h{hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay};
      MS_RETURN_IF_ERROR(
          Launch(kernels::LambDirectionMultiTensor(group.data(), static_cast<int>(group.size()), h, step, s_),
                 "LAMB direction"));
      i = j;
    }
    return Status::Ok();
  }
  using ops::Backend::LambApply;
  Status LambApply(float* p, const float* u, int64_t n, float lr, float trust_ratio, void* p16) override {
    if (p16 && !keep_) {
      return FailedPrecondition("the {} backend keeps no bf16 weight copies (LambApply p16)", name());
    }
    return Launch(kernels::LambApply(p, u, n, lr, trust_ratio, s_, static_cast<__nv_bfloat16*>(p16)), "LAMB update");
  }

 private:
  enum {
    kBf16A,
    kBf16B,
    kBf16C,
    kScratch,
    kNorms,
    kBias16,
    kLt,
    kDsTiles,
    kCudnn,
    kCudnnRows,
    kCudnnCheck,
    kBlas,
    kTune,
    kNumWorkspaces
  };
  static constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;
  static constexpr size_t kLtWorkspaceBytes = kCublasLtWorkspaceBytes;
  // Pinned staging of small host-to-device copies (token ids, targets, loss weights): a ring of kStageSlots
  // page-locked buffers of kStageBytes, each with the event of its last copy. Allocated on first use.
  static constexpr int kStageSlots = 4;
  static constexpr size_t kStageBytes = size_t{1} << 20;
  struct Stage {
    void* host = nullptr;
    cudaEvent_t done = nullptr;
  };
  CudaBackend() = default;

  static bool SameHp(const ops::AdamParams& a, const ops::AdamParams& b) {
    return a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps &&
           a.weight_decay == b.weight_decay;
  }
  Status Launch(cudaError_t e, std::string_view what) {
    return CudaStatus(e, what);
  }
  // A GEMM operand: `src` (n floats) rounded to bf16 in workspace `slot` (0..2) when bf16_ (unless cuBLAS
  // converts it), else src itself.
  Result<const void*> Bf16(int slot, const float* src, int64_t n) {
    if (!bf16_ || cublas_converts_) return static_cast<const void*>(src);
    MS_ASSIGN_OR_RETURN(void* p, ws_[kBf16A + slot].Get(device_, s_, sizeof(__nv_bfloat16) * n));
    auto* dst = static_cast<__nv_bfloat16*>(p);
    MS_RETURN_IF_ERROR(Launch(kernels::CastFloatToBf16(dst, src, n, s_), "fp32 -> bf16 cast"));
    return static_cast<const void*>(dst);
  }
  // A bf16 copy an op writes next to its fp32 output for the caller to keep (null: none); only when keep_. The
  // fp32 output (`out`) may be null when the copy is asked for: then only the rounding is written.
  Result<__nv_bfloat16*> KeptOutput(void* out16, const char* op, const void* out) const {
    if (out16 && !keep_) {
      return FailedPrecondition("{}: a bf16 copy asked of a backend that keeps none (runtime.bf16_operands: keep)", op);
    }
    if (!out16 && !out) return InvalidArgument("{}: neither an fp32 output nor its bf16 rounding to write", op);
    return static_cast<__nv_bfloat16*>(out16);
  }
  // A GEMM's weight and input operands: the caller's kept roundings where it keeps them (keep_), else Bf16.
  Result<const void*> Weight(const float* w, int64_t n, const ops::Bf16Copies& kept) {
    if (keep_ && kept.w) return kept.w;
    return Bf16(1, w, n);
  }
  Result<const void*> Input(const float* inp, int64_t n, const ops::Bf16Copies& kept, int slot = 0) {
    if (!keep_ || !kept.inp) return Bf16(slot, inp, n);
    if (!kept.inp_ready) {
      MS_RETURN_IF_ERROR(
          Launch(kernels::CastFloatToBf16(static_cast<__nv_bfloat16*>(kept.inp), inp, n, s_), "fp32 -> bf16 cast"));
    }
    return static_cast<const void*>(kept.inp);
  }
  // Column-major C (m, n) = op(A) op(B) + beta C: A, B bf16 (or fp32: fp32 math, or converted to bf16 by cuBLAS
  // when cublas_converts_), C fp32, fp32 accumulation.
  // ctype CUDA_R_16BF (bf16 operands only): C rounded to bf16 (runtime.activations: bf16).
  Status Gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda,
              const void* B, int64_t ldb, float beta, void* C, int64_t ldc, const char* what,
              cudaDataType_t ctype = CUDA_R_32F) {
    const float alpha = 1.0f;
    const cudaDataType_t in = bf16_ && !cublas_converts_ ? CUDA_R_16BF : CUDA_R_32F;
    const cublasComputeType_t compute = cublas_converts_ ? CUBLAS_COMPUTE_32F_FAST_16BF : CUBLAS_COMPUTE_32F;
    MS_BLAS_OK(cublasGemmEx(blas_, ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), &alpha, A, in,
                            static_cast<int>(lda), B, in, static_cast<int>(ldb), &beta, C, ctype, static_cast<int>(ldc),
                            compute, CUBLAS_GEMM_DEFAULT),
               what);
    return Status::Ok();
  }

  // The fc GEMM with its bias and GeLU (MatmulForward with Bf16Copies::gelu16): cuBLASLt's GELU_AUX_BIAS epilogue
  // where cuBLASLt has an algorithm for it, else the GEMM writing its bf16 output and the bias + GeLU kernel
  // writing the GeLU input with its bias back over it (the same contract, rounded twice instead of once).
  Status MatmulBiasGelu(const float* inp, const float* w, const float* bias, int64_t N, int64_t IC, int64_t OC,
                        const ops::Bf16Copies& kept, const float* out) {
    if (!gemm_gelu_epilogue()) {
      return FailedPrecondition(
          "MatmulForward: the bias + GeLU in the GEMM (gelu16) needs runtime.bf16_operands: keep and "
          "runtime.activations: bf16");
    }
    if (!kept.out16 || !bias || out || kept.out_accumulate) {
      return InvalidArgument("MatmulForward: gelu16 needs out16 (the GeLU input) and the bias, and no fp32 out");
    }
    if (N == 0 || OC == 0) return Status::Ok();
    MS_ASSIGN_OR_RETURN(auto* a, Input(inp, N * IC, kept));
    MS_ASSIGN_OR_RETURN(auto* b, Weight(w, OC * IC, kept));
    auto* pre16 = static_cast<__nv_bfloat16*>(kept.out16);
    auto* gelu16 = static_cast<__nv_bfloat16*>(kept.gelu16);
    // cuBLASLt's bias has D's type (bf16): the fp32 bias rounded into a small workspace.
    MS_ASSIGN_OR_RETURN(void* b16, ws_[kBias16].Get(device_, s_, sizeof(__nv_bfloat16) * OC));
    MS_RETURN_IF_ERROR(Launch(kernels::CastFloatToBf16(static_cast<__nv_bfloat16*>(b16), bias, OC, s_), "bias cast"));
    // D^T (OC, N) = w (OC, IC) . inp^T (IC, N), as the plain forward.
    MS_ASSIGN_OR_RETURN(const bool ran, LtGemm(CUBLAS_OP_T, OC, N, IC, b, IC, a, IC, gelu16, OC,
                                               CUBLASLT_EPILOGUE_GELU_AUX_BIAS, b16, pre16, "linear + bias + GeLU"));
    if (ran) return Status::Ok();
    MS_RETURN_IF_ERROR(Gemm(CUBLAS_OP_T, CUBLAS_OP_N, OC, N, IC, b, IC, a, IC, 0.0f, pre16, OC,
                            "linear forward (bf16 out)", CUDA_R_16BF));
    return Launch(kernels::BiasGeluForward(nullptr, pre16, bias, N, OC, s_, gelu16, pre16),
                  "bias + GeLU forward (after the GEMM)");
  }
  // A GEMM with its bias and a bf16 output (MatmulForward with out16 and the bias: the qkv GEMM, whose bias the
  // attention then need not add): cuBLASLt's BIAS epilogue where it has an algorithm — out16 = bf16(sum + bias16),
  // the fp32 sum rounded once, the bias rounded to bf16 (the epilogue's type) —, else the GEMM writing its bf16
  // output and the fp32 bias added over it, then rounded again (kernels::AddRowBias on bf16).
  Status MatmulBias16(const void* a, const void* b, const float* bias, int64_t N, int64_t IC, int64_t OC, void* out16) {
    auto* o16 = static_cast<__nv_bfloat16*>(out16);
    MS_ASSIGN_OR_RETURN(void* b16, ws_[kBias16].Get(device_, s_, sizeof(__nv_bfloat16) * OC));
    MS_RETURN_IF_ERROR(Launch(kernels::CastFloatToBf16(static_cast<__nv_bfloat16*>(b16), bias, OC, s_), "bias cast"));
    // D^T (OC, N) = w (OC, IC) . inp^T (IC, N) + bias, as the plain forward.
    MS_ASSIGN_OR_RETURN(const bool ran, LtGemm(CUBLAS_OP_T, OC, N, IC, b, IC, a, IC, o16, OC, CUBLASLT_EPILOGUE_BIAS,
                                               b16, nullptr, "linear + bias (bf16 out)"));
    if (ran) return Status::Ok();
    MS_RETURN_IF_ERROR(Gemm(CUBLAS_OP_T, CUBLAS_OP_N, OC, N, IC, b, IC, a, IC, 0.0f, o16, OC,
                            "linear forward (bf16 out)", CUDA_R_16BF));
    return Launch(kernels::AddRowBias(o16, bias, N, OC, s_), "bias add (bf16, after the GEMM)");
  }
  // The fc-proj backward's input gradient with the GeLU gradient (MatmulBackward with dgelu_aux16): cuBLASLt's
  // DGELU epilogue, then the fc bias gradient over the bf16 result; else the GEMM writing its bf16 output and the
  // GeLU backward over it in place (summing the bias gradient as it goes).
  Status DgeluGemm(const void* wb, const void* g, int64_t N, int64_t IC, int64_t OC, const ops::Bf16Copies& kept) {
    auto* d16 = static_cast<__nv_bfloat16*>(kept.dinp16);
    const auto* aux = static_cast<const __nv_bfloat16*>(kept.dgelu_aux16);
    MS_ASSIGN_OR_RETURN(void* scratch,
                        ws_[kScratch].Get(device_, s_, sizeof(float) * kernels::BiasGradScratchFloats(N, IC)));
    // dinp16^T (IC, N) = gelu'(aux) * (w^T (IC, OC) . dout^T (OC, N))
    MS_ASSIGN_OR_RETURN(const bool ran,
                        LtGemm(CUBLAS_OP_N, IC, N, OC, wb, IC, g, OC, d16, IC, CUBLASLT_EPILOGUE_DGELU, nullptr,
                               const_cast<__nv_bfloat16*>(aux), "linear dinp + GeLU backward"));
    if (ran) {
      return Launch(kernels::BiasGrad(kept.dgelu_dbias, static_cast<float*>(scratch), d16, N, IC, s_),
                    "bias gradient (bf16)");
    }
    MS_RETURN_IF_ERROR(
        Gemm(CUBLAS_OP_N, CUBLAS_OP_N, IC, N, OC, wb, IC, g, OC, 0.0f, d16, IC, "linear dinp (bf16 out)", CUDA_R_16BF));
    return Launch(kernels::BiasGeluBackward(nullptr, kept.dgelu_dbias, static_cast<float*>(scratch), aux, nullptr, d16,
                                            N, IC, s_, d16),
                  "GeLU backward (after the GEMM)");
  }
  // Column-major D (m, n) = epilogue(op(A) . B) by cuBLASLt, A and B bf16 (op(A) = A^T for ta = T), D bf16, fp32
  // accumulation; `aux` (m, n, ld m) and `bias16` (m) as the epilogue takes them. Returns false, having run nothing,
  // where cuBLASLt has no algorithm for the problem (the caller runs its fallback); an error for a failed call.
  Result<bool> LtGemm(cublasOperation_t ta, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda, const void* B,
                      int64_t ldb, void* D, int64_t ldd, cublasLtEpilogue_t epilogue, const void* bias16, void* aux,
                      const char* what) {
    struct Guard {  // the descriptors of one call
      cublasLtMatmulDesc_t desc = nullptr;
      cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
      cublasLtMatmulPreference_t pref = nullptr;
      ~Guard() {
        if (pref) (void)cublasLtMatmulPreferenceDestroy(pref);
        if (d) (void)cublasLtMatrixLayoutDestroy(d);
        if (b) (void)cublasLtMatrixLayoutDestroy(b);
        if (a) (void)cublasLtMatrixLayoutDestroy(a);
        if (desc) (void)cublasLtMatmulDescDestroy(desc);
      }
    } g;
    auto set = [&](cublasLtMatmulDescAttributes_t attr, const auto& v) {
      return BlasStatus(cublasLtMatmulDescSetAttribute(g.desc, attr, &v, sizeof v), what);
    };
    MS_BLAS_OK(cublasLtMatmulDescCreate(&g.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), what);
    const cublasOperation_t tb = CUBLAS_OP_N;
    MS_RETURN_IF_ERROR(set(CUBLASLT_MATMUL_DESC_TRANSA, ta));
    MS_RETURN_IF_ERROR(set(CUBLASLT_MATMUL_DESC_TRANSB, tb));
    MS_RETURN_IF_ERROR(set(CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue));
    if (bias16) MS_RETURN_IF_ERROR(set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias16));
    if (aux) {
      MS_RETURN_IF_ERROR(set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux));
      MS_RETURN_IF_ERROR(set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, m));
    }
    const bool at = ta == CUBLAS_OP_T;
    MS_BLAS_OK(cublasLtMatrixLayoutCreate(&g.a, CUDA_R_16BF, at ? k : m, at ? m : k, lda), what);
    MS_BLAS_OK(cublasLtMatrixLayoutCreate(&g.b, CUDA_R_16BF, k, n, ldb), what);
    MS_BLAS_OK(cublasLtMatrixLayoutCreate(&g.d, CUDA_R_16BF, m, n, ldd), what);
    MS_BLAS_OK(cublasLtMatmulPreferenceCreate(&g.pref), what);
    MS_ASSIGN_OR_RETURN(void* ws, ws_[kLt].Get(device_, s_, kLtWorkspaceBytes));
    const uint64_t ws_bytes = kLtWorkspaceBytes;
    MS_BLAS_OK(cublasLtMatmulPreferenceSetAttribute(g.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                    sizeof ws_bytes),
               what);
    // The alignment the pointers have (an algorithm otherwise assumes 256 bytes).
    const void* ptrs[4] = {A, B, D, D};
    const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; ++i) {
      uint32_t align = 256;
      while (align > 1 && reinterpret_cast<uintptr_t>(ptrs[i]) % align != 0) align /= 2;
      MS_BLAS_OK(cublasLtMatmulPreferenceSetAttribute(g.pref, align_attr[i], &align, sizeof align), what);
    }
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t hs =
        cublasLtMatmulAlgoGetHeuristic(lt_, g.desc, g.a, g.b, g.d, g.d, g.pref, 1, &result, &found);
    if (hs != CUBLAS_STATUS_SUCCESS || found == 0) {
      ++(epilogue == CUBLASLT_EPILOGUE_BIAS ? epilogue_stats_.bias_fallback : epilogue_stats_.fallback);
      return false;
    }
    const float alpha = 1.0f, beta = 0.0f;
    MS_BLAS_OK(cublasLtMatmul(lt_, g.desc, &alpha, A, g.a, B, g.b, &beta, D, g.d, D, g.d, &result.algo, ws,
                              kLtWorkspaceBytes, s_),
               what);
    ++(epilogue == CUBLASLT_EPILOGUE_BIAS ? epilogue_stats_.bias_cublaslt : epilogue_stats_.cublaslt);
    return true;
  }

  device::Device* device_ = nullptr;
  std::unique_ptr<device::Stream> stream_;
  cudaStream_t s_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  EpilogueStats epilogue_stats_;
  AttentionStats attention_stats_;
  bool cudnn_attention_ = false;   // runtime.attention_kernels: cudnn (EnableCudnnAttention), until cuDNN fails
  bool cudnn_wanted_ = false;      // asked for (EnableCudnnAttention), whether or not cuDNN is still on
  bool split_dkdv_ = false;        // runtime.attention_split_dkdv (EnableSplitDkDv)
  AttentionTuner tuner_;           // runtime.attention_autotune (EnableAttentionAutotune)
  std::vector<void*> cudnn_kept_;  // device memory cuDNN's plans keep (cudnn::Sdpa::Memory::keep)
#if defined(MS_CUDA_HAVE_CUDNN)
  std::unique_ptr<cudnn::Sdpa> cudnn_sdpa_;  // made at the first forward cuDNN takes
  std::set<std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t>> cudnn_checked_;  // (pass, shape) checked
#endif
  bool bf16_ = true;
  int64_t ds_max_bytes_ = kAttentionDsMaxBytes;  // runtime.attention_stored_ds (0: off)
  bool cublas_converts_ = false;                 // bf16 GEMMs on fp32 operands, CUBLAS_COMPUTE_32F_FAST_16BF
  bool keep_ = false;  // bf16 GEMMs take the caller's kept operand roundings (ops::Bf16Copies)
  Workspace ws_[kNumWorkspaces];
  bool capture_ = false;  // between BeginCapture and EndCapture
  EpilogueStats capture_epi_;
  AttentionStats capture_att_;
  int64_t capture_gets_[kNumWorkspaces] = {};  // each workspace's uses when the capture began
  Stage stage_[kStageSlots];
  int next_stage_ = 0;
  bool plant_no_stage_wait_ = false;
};

// An instantiated capture of the backend's stream.
class CudaGraph final : public ops::Backend::OpGraph {
 public:
  CudaGraph(CudaBackend* backend, cudaGraphExec_t exec, int64_t ops, uint32_t used, EpilogueStats epi,
            AttentionStats att)
      : backend_(backend),
        exec_(exec),
        ops_(ops),
        used_(used),
        growths_(backend->WorkspaceGrowths(used)),
        epi_(epi),
        att_(std::move(att)) {}
  ~CudaGraph() override { (void)cudaGraphExecDestroy(exec_); }
  bool Stale() const override { return backend_->WorkspaceGrowths(used_) != growths_; }
  Status Launch() override {
    if (Stale()) {
      return FailedPrecondition("a stale graph: a backend workspace it reads has been replaced since its capture");
    }
    MS_CUDA_OK(cudaGraphLaunch(exec_, backend_->stream()), "cudaGraphLaunch");
    backend_->AddStats(epi_, att_);
    return Status::Ok();
  }
  int64_t ops() const override { return ops_; }

 private:
  CudaBackend* backend_;
  cudaGraphExec_t exec_;
  int64_t ops_;
  uint32_t used_;    // the workspaces its ops read or write (a bit each)
  int64_t growths_;  // theirs when it was recorded
  EpilogueStats epi_;
  AttentionStats att_;
};

Result<std::unique_ptr<ops::Backend::OpGraph>> CudaBackend::EndCapture() {
  if (!capture_) return FailedPrecondition("EndCapture without BeginCapture");
  capture_ = false;
  cudaGraph_t graph = nullptr;
  if (const cudaError_t e = cudaStreamEndCapture(s_, &graph); e != cudaSuccess) {
    (void)cudaGetLastError();
    return FailedPrecondition(
        "the graph capture failed ({}: {}): an op in it waited for the device, copied to or from pageable host "
        "memory, or used another stream",
        cudaGetErrorName(e), cudaGetErrorString(e));
  }
  size_t nodes = 0;
  const cudaError_t ne = cudaGraphGetNodes(graph, nullptr, &nodes);
  cudaGraphExec_t exec = nullptr;
  const cudaError_t ie = cudaGraphInstantiate(&exec, graph, 0);
  (void)cudaGraphDestroy(graph);
  MS_CUDA_OK(ne, "cudaGraphGetNodes");
  MS_CUDA_OK(ie, "cudaGraphInstantiate");
  EpilogueStats epi;
  epi.cublaslt = epilogue_stats_.cublaslt - capture_epi_.cublaslt;
  epi.fallback = epilogue_stats_.fallback - capture_epi_.fallback;
  epi.bias_cublaslt = epilogue_stats_.bias_cublaslt - capture_epi_.bias_cublaslt;
  epi.bias_fallback = epilogue_stats_.bias_fallback - capture_epi_.bias_fallback;
  AttentionStats att;
  att.stored_ds = attention_stats_.stored_ds - capture_att_.stored_ds;
  att.recompute = attention_stats_.recompute - capture_att_.recompute;
  att.cudnn_forward = attention_stats_.cudnn_forward - capture_att_.cudnn_forward;
  att.cudnn_backward = attention_stats_.cudnn_backward - capture_att_.cudnn_backward;
  att.cudnn_fallback = attention_stats_.cudnn_fallback - capture_att_.cudnn_fallback;
  att.split_dkdv = attention_stats_.split_dkdv - capture_att_.split_dkdv;
  uint32_t used = 0;
  for (int i = 0; i < kNumWorkspaces; ++i) {
    if (ws_[i].gets() != capture_gets_[i]) used |= 1u << i;
  }
  return std::unique_ptr<ops::Backend::OpGraph>(
      new CudaGraph(this, exec, static_cast<int64_t>(nodes), used, epi, std::move(att)));
}

}  // namespace

void* BackendStream(ops::Backend& backend) {
  auto* b = dynamic_cast<CudaBackend*>(&backend);
  return b ? static_cast<void*>(b->stream()) : nullptr;
}

EpilogueStats GetEpilogueStats(ops::Backend& backend) {
  auto* b = dynamic_cast<CudaBackend*>(&backend);
  return b ? b->epilogue_stats() : EpilogueStats{};
}

namespace {
std::atomic<double> cudnn_check_rtol{0.05};
std::atomic<int> cudnn_scratch_fill{-1};
}  // namespace

void SetCudnnScratchFill(int byte) {
  cudnn_scratch_fill.store(byte < 0 ? -1 : byte & 0xFF);
}
int CudnnScratchFill() {
  return cudnn_scratch_fill.load();
}

void SetCudnnBackwardForm(int deterministic, int padding_mask) {
#if defined(MS_CUDA_HAVE_CUDNN)
  cudnn::SetFormOverride(deterministic, padding_mask);
#else
  (void)deterministic, (void)padding_mask;
#endif
}

void SetCudnnCheckTolerance(double rtol) {
  cudnn_check_rtol.store(rtol);
}
double CudnnCheckTolerance() {
  return cudnn_check_rtol.load();
}

Status UseCudnnAttention(ops::Backend& backend) {
  auto* b = dynamic_cast<CudaBackend*>(&backend);
  if (!b) return InvalidArgument("runtime.attention_kernels: cudnn needs runtime.backend: cuda");
  return b->EnableCudnnAttention();
}

Status UseSplitDkDvAttention(ops::Backend& backend, bool on) {
  auto* b = dynamic_cast<CudaBackend*>(&backend);
  if (!b) return InvalidArgument("runtime.attention_split_dkdv needs runtime.backend: cuda");
  b->EnableSplitDkDv(on);
  return Status::Ok();
}

Status UseAttentionAutotune(ops::Backend& backend, bool on) {
  auto* b = dynamic_cast<CudaBackend*>(&backend);
  if (!b) return InvalidArgument("runtime.attention_autotune needs runtime.backend: cuda");
  b->EnableAttentionAutotune(on);
  return Status::Ok();
}

AttentionStats GetAttentionStats(ops::Backend& backend) {
  auto* b = dynamic_cast<CudaBackend*>(&backend);
  return b ? b->attention_stats() : AttentionStats{};
}

Result<std::unique_ptr<ops::Backend>> MakeCudaBackend(device::Device* device, bool bf16_gemm, Bf16Operands operands,
                                                      int64_t attention_ds_max_bytes) {
  if (!device) return InvalidArgument("MakeCudaBackend: no device");
  return CudaBackend::Create(device, bf16_gemm, operands, attention_ds_max_bytes);
}

}  // namespace ms::cuda
