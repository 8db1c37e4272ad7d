// The host Backend: each op is the fast CPU function of the same name (lib/ops/ops.h) on host memory.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/ops.h"

namespace ms::ops {
namespace {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(device::Device* device) : device_(device) {}
  const char* name() const override { return "cpu"; }
  device::Device* device() override { return device_; }
  bool bf16_gemm() const override { return false; }

  Status Zero(void* dst, size_t bytes) override {
    if (bytes) std::memset(dst, 0, bytes);
    return Status::Ok();
  }
  Status Copy(void* dst, const void* src, size_t bytes) override {
    if (bytes && dst != src) std::memmove(dst, src, bytes);
    return Status::Ok();
  }
  Status CopyFromHost(void* dst, const void* src, size_t bytes) override { return Copy(dst, src, bytes); }
  Status CopyToHost(void* dst, const void* src, size_t bytes) override { return Copy(dst, src, bytes); }
  Status NoQkvBias(const char* op) const {
    return FailedPrecondition("{}: the cpu backend adds the qkv bias in the GEMM (attention_adds_qkv_bias() is false)",
                              op);
  }
  Status NoBf16Copies(const char* op) const {
    return FailedPrecondition("{}: the cpu backend keeps no bf16 copies (keeps_bf16_copies() is false)", op);
  }
  Status Synchronize() override { return Status::Ok(); }
  Status RoundBf16(void* dst16, const float* src, int64_t n) override {
    auto* d = static_cast<uint16_t*>(dst16);
    for (int64_t i = 0; i < n; ++i) d[i] = FloatToBf16(src[i]);
    return Status::Ok();
  }
  Status WidenBf16(float* dst, const void* src16, int64_t n) override {
    const auto* s = static_cast<const uint16_t*>(src16);
    for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(s[i]);
    return Status::Ok();
  }

  using Backend::MatmulBackward;
  using Backend::MatmulForward;
  Status MatmulForward(float* out, const float* inp, const float* w, const float* bias, int64_t N, int64_t IC,
                       int64_t OC, const Bf16Copies& kept) override {  // fp32 GEMMs: no bf16 roundings
    if (kept.out16 || kept.gelu16) {
      return FailedPrecondition("MatmulForward: the cpu backend writes no bf16 outputs (runtime.activations: bf16)");
    }
    if (kept.out_accumulate) {
      if (bias) return InvalidArgument("MatmulForward: an accumulated output takes no bias");
      std::vector<float> product(static_cast<size_t>(N * OC));
      ops::MatmulForward(product.data(), inp, w, nullptr, N, IC, OC);
      ops::AddInPlace(out, product.data(), N * OC);
      return Status::Ok();
    }
    ops::MatmulForward(out, inp, w, bias, N, IC, OC);
    return Status::Ok();
  }
  Status MatmulBackward(float* dinp, float* dw, float* dbias, const float* dout, const float* inp, const float* w,
                        int64_t N, int64_t IC, int64_t OC, const Bf16Copies& bf16) override {
    if (bf16.dinp16 || bf16.dgelu_aux16 || bf16.dgelu_dbias) {
      return FailedPrecondition("MatmulBackward: the cpu backend writes no bf16 outputs (runtime.activations: bf16)");
    }
    if (dinp && bf16.dinp_overwrite) std::memset(dinp, 0, sizeof(float) * static_cast<size_t>(N * IC));
    ops::MatmulBackward(dinp, dw, dbias, dout, inp, w, N, IC, OC);
    return Status::Ok();
  }
  using Backend::BiasGeluForward;
  using Backend::LayerNormForward;
  Status LayerNormForward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b,
                          int64_t N, int64_t C, float eps, void* out16) override {
    if (out16) return NoBf16Copies("LayerNormForward");
    ops::LayerNormForward(out, mean, rstd, x, w, b, N, C, eps);
    return Status::Ok();
  }
  using Backend::LayerNormBackward;
  Status LayerNormBackward(float* dx, float* dw, float* db, const float* dout, const float* x, const float* w,
                           const float* mean, const float* rstd, int64_t N, int64_t C, void* dx16, float* dsum,
                           float* dsum2) override {
    if (dx16) return NoBf16Copies("LayerNormBackward");
    if (dsum2 && !dsum) return InvalidArgument("LayerNormBackward: a second bias gradient (dsum2) without the first");
    ops::LayerNormBackward(dx, dw, db, dout, x, w, mean, rstd, N, C);
    if (dsum) MS_RETURN_IF_ERROR(BiasGrad(dsum, dx, N, C));  // what the model's separate pass added
    return dsum2 ? BiasGrad(dsum2, dx, N, C) : Status::Ok();
  }
  Status GeluForward(float* out, const float* x, int64_t n) override {
    ops::GeluForward(out, x, n);
    return Status::Ok();
  }
  Status GeluBackward(float* dx, const float* x, const float* dout, int64_t n) override {
    ops::GeluBackward(dx, x, dout, n);
    return Status::Ok();
  }
  using Backend::AttentionBackward;
  using Backend::AttentionForward;
  Status AttentionForward(float* out, float* lse, const float* qkv, const float* qkv_bias, int64_t B, int64_t T,
                          int64_t H, int64_t D, int64_t window, void* out16) override {
    if (out16) return NoBf16Copies("AttentionForward");
    if (qkv_bias) return NoQkvBias("AttentionForward");
    ops::AttentionForward(out, lse, qkv, B, T, H, D, window);
    return Status::Ok();
  }
  Status AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* qkv_bias, const float* out,
                           const float* lse, int64_t B, int64_t T, int64_t H, int64_t D, int64_t window, void* dqkv16,
                           float* dqkv_bias) override {
    if (dqkv16) return NoBf16Copies("AttentionBackward");
    if (qkv_bias || dqkv_bias) return NoQkvBias("AttentionBackward");
    ops::AttentionBackward(dqkv, dout, qkv, out, lse, B, T, H, D, window);
    return Status::Ok();
  }
  Status CrossEntropyForward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                             int64_t V) override {
    ops::CrossEntropyForward(losses, lse, logits, targets, N, V);
    return Status::Ok();
  }
  using Backend::CrossEntropyBackward;
  using Backend::CrossEntropyFused;
  using Backend::VocabParallelBackward;
  Status CrossEntropyBackward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                              const float* dloss, int64_t N, int64_t V, void* dlogits16) override {
    if (dlogits16) return NoBf16Copies("CrossEntropyBackward");
    ops::CrossEntropyBackward(dlogits, logits, lse, targets, dloss, N, V);
    return Status::Ok();
  }
  Status CrossEntropyFused(float* losses, float* lse, float* logits, const int32_t* targets, const float* dloss,
                           int64_t N, int64_t V, void* dlogits16, bool fp32_dlogits) override {
    if (dlogits16 || !fp32_dlogits) return NoBf16Copies("CrossEntropyFused");
    ops::CrossEntropyFused(losses, lse, logits, targets, dloss, N, V);
    return Status::Ok();
  }
  Status VocabParallelRowStats(float* mx, float* se, float* tl, const float* logits, const int32_t* targets,
                               int64_t vstart, int64_t N, int64_t V) override {
    if (N > 0 && V <= 0) return Status(Code::kInvalidArgument, "vocab-parallel row stats: a shard of 0 columns");
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* row = logits + i * V;
      float m = row[0];
      for (int64_t j = 1; j < V; ++j) m = std::max(m, row[j]);
      double sum = 0;
      for (int64_t j = 0; j < V; ++j) sum += std::exp(static_cast<double>(row[j]) - m);
      mx[i] = m;
      se[i] = static_cast<float>(sum);
      const int64_t t = targets[i] - vstart;
      tl[i] = (targets[i] >= 0 && t >= 0 && t < V) ? row[t] : 0.0f;
    }
    return Status::Ok();
  }
  Status VocabParallelRebase(float* se, const float* mx_local, const float* mx_global, int64_t N) override {
    for (int64_t i = 0; i < N; ++i) {
      se[i] = static_cast<float>(se[i] * std::exp(static_cast<double>(mx_local[i]) - mx_global[i]));
    }
    return Status::Ok();
  }
  Status VocabParallelFinish(float* losses, float* lse, const float* mx, const float* se, const float* tl,
                             const int32_t* targets, int64_t N) override {
    for (int64_t i = 0; i < N; ++i) {
      lse[i] = mx[i] + std::log(se[i]);
      losses[i] = targets[i] >= 0 ? lse[i] - tl[i] : 0.0f;
    }
    return Status::Ok();
  }
  Status VocabParallelBackward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                               float dloss, int64_t vstart, int64_t N, int64_t V, void* dlogits16) override {
    if (dlogits16) return NoBf16Copies("VocabParallelBackward");
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      float* d = dlogits + i * V;
      const float* row = logits + i * V;
      if (targets[i] < 0) {
        std::memset(d, 0, sizeof(float) * V);
        continue;
      }
      for (int64_t j = 0; j < V; ++j) d[j] = std::exp(row[j] - lse[i]) * dloss;
      const int64_t t = targets[i] - vstart;
      if (t >= 0 && t < V) d[t] -= dloss;
    }
    return Status::Ok();
  }
  Status EmbeddingForward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C) override {
    ops::EmbeddingForward(out, ids, table, N, C);
    return Status::Ok();
  }
  Status EmbeddingBackward(float* dtable, const int32_t* ids, const float* dout, int64_t N, int64_t C) override {
    ops::EmbeddingBackward(dtable, ids, dout, N, C);
    return Status::Ok();
  }
  Status AddInPlace(float* y, const float* x, int64_t n) override {
    ops::AddInPlace(y, x, n);
    return Status::Ok();
  }
  Status Add(float* out, const float* a, const float* b, int64_t n) override {
    ops::Add(out, a, b, n);
    return Status::Ok();
  }
  Status Scale(float* x, float a, int64_t n) override {
    ops::Scale(x, a, n);
    return Status::Ok();
  }
  Status AddRowBias(float* y, const float* b, int64_t R, int64_t C) override {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) ops::AddInPlace(y + r * C, b, C);
    return Status::Ok();
  }
  Status ResidualAdd(float* out, const float* x, const float* part, const float* bias, const float* bias2, int64_t R,
                     int64_t C) override {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      float* o = out + r * C;
      const float* xr = x + r * C;
      const float* pr = part + r * C;
      for (int64_t c = 0; c < C; ++c) {
        float v = xr[c] + pr[c];
        if (bias) v += bias[c];
        if (bias2) v += bias2[c];
        o[c] = v;
      }
    }
    return Status::Ok();
  }
  Status BiasGeluForward(float* out, const float* x, const float* bias, int64_t R, int64_t C, void* out16) override {
    if (out16) return NoBf16Copies("BiasGeluForward");
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      float* o = out + r * C;
      ops::Add(o, x + r * C, bias, C);  // the same float ops as a GEMM bias followed by GeLU
      ops::GeluForward(o, o, C);
    }
    return Status::Ok();
  }
  using Backend::BiasGeluBackward;
  Status BiasGeluBackward(float* dx, float* dbias, const float* x, const float* bias, const float* dout, int64_t R,
                          int64_t C, void* dx16) override {
    if (dx16) return NoBf16Copies("BiasGeluBackward");
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      std::vector<float> t(static_cast<size_t>(C));
      ops::Add(t.data(), x + r * C, bias, C);
      ops::GeluBackward(dx + r * C, t.data(), dout + r * C, C);
    }
    return BiasGrad(dbias, dx, R, C);
  }
  Status BiasGrad(float* db, const float* dy, int64_t R, int64_t C) override {
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < C; ++c) {
      float s = 0;
      for (int64_t r = 0; r < R; ++r) s += dy[r * C + c];
      db[c] += s;
    }
    return Status::Ok();
  }
  Status AddPositions(float* x, const float* wpe, int64_t R, int64_t C, int64_t T, int64_t row0) override {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) ops::AddInPlace(x + r * C, wpe + ((row0 + r) % T) * C, C);
    return Status::Ok();
  }
  Status PositionsBackward(float* dwpe, const float* dx, int64_t R, int64_t C, int64_t T, int64_t row0) override {
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < C; ++c) {
      for (int64_t r = 0; r < R; ++r) dwpe[((row0 + r) % T) * C + c] += dx[r * C + c];
    }
    return Status::Ok();
  }
  Status SumSquares(const float* const* xs, const int64_t* ns, int count, double* out) override {
    for (int i = 0; i < count; ++i) out[i] = ops::SumSquares(xs[i], ns[i]);
    return Status::Ok();
  }
  Status AdamW(const AdamWTensor* t, int count, int64_t step) override {
    for (int i = 0; i < count; ++i) {
      if (t[i].p16) return FailedPrecondition("the cpu backend keeps no bf16 weight copies (AdamW p16)");
    }
    for (int i = 0; i < count; ++i) ops::AdamWStep(t[i].p, t[i].g, t[i].m, t[i].v, t[i].n, t[i].hp, step);
    return Status::Ok();
  }
  Status LambDirection(const LambTensor* t, int count, int64_t step) override {
    for (int i = 0; i < count; ++i) ops::LambDirection(t[i].u, t[i].p, t[i].g, t[i].m, t[i].v, t[i].n, t[i].hp, step);
    return Status::Ok();
  }
  using Backend::LambApply;
  Status LambApply(float* p, const float* u, int64_t n, float lr, float trust_ratio, void* p16) override {
    if (p16) return FailedPrecondition("the cpu backend keeps no bf16 weight copies (LambApply p16)");
    ops::LambApply(p, u, n, lr, trust_ratio);
    return Status::Ok();
  }

 private:
  device::Device* device_;
};

}  // namespace

Status Backend::ResidualLayerNormForward(float* res, const float* x, const float* part, const float* bias,
                                         const float* bias2, float* out, float* mean, float* rstd, const float* w,
                                         const float* b, int64_t R, int64_t C, float eps, void* out16) {
  MS_RETURN_IF_ERROR(ResidualAdd(res, x, part, bias, bias2, R, C));
  return LayerNormForward(out, mean, rstd, res, w, b, R, C, eps, out16);
}

Status Backend::ResidualAdd16(float*, const float*, const void*, const float*, const float*, int64_t, int64_t) {
  return FailedPrecondition("ResidualAdd16: the {} backend keeps no bf16 activations (runtime.activations: bf16)",
                            name());
}
Status Backend::ResidualLayerNormForward16(float*, const float*, const void*, const float*, const float*, float*,
                                           float*, float*, const float*, const float*, int64_t, int64_t, float, void*) {
  return FailedPrecondition(
      "ResidualLayerNormForward16: the {} backend keeps no bf16 activations (runtime.activations: bf16)", name());
}

Status Backend::BeginCapture() {
  return Unimplemented("the {} backend records no graphs (runtime.cuda_graphs needs a CUDA backend)", name());
}
Result<std::unique_ptr<Backend::OpGraph>> Backend::EndCapture() {
  return Unimplemented("the {} backend records no graphs", name());
}

Status Backend::CastToBf16(void*, const float*, int64_t) {
  return FailedPrecondition("the {} backend keeps no bf16 GEMM operands (CastToBf16)", name());
}
Status Backend::BiasGeluForward16(float*, const void*, const float*, int64_t, int64_t, void*) {
  return FailedPrecondition("BiasGeluForward16: the {} backend keeps no bf16 activations (runtime.activations: bf16)",
                            name());
}
Status Backend::BiasGeluBackward16(float*, float*, const void*, const float*, const float*, const void*, int64_t,
                                   int64_t, void*) {
  return FailedPrecondition("BiasGeluBackward16: the {} backend keeps no bf16 activations (runtime.activations: bf16)",
                            name());
}
Status Backend::LayerNormBackward16(float*, float*, float*, const void*, const float*, const float*, const float*,
                                    const float*, int64_t, int64_t, void*, float*, float*) {
  return FailedPrecondition("LayerNormBackward16: the {} backend keeps no bf16 activations (runtime.activations: bf16)",
                            name());
}
Status Backend::AttentionForward16(float*, float*, const void*, const float*, int64_t, int64_t, int64_t, int64_t,
                                   int64_t, void*) {
  return FailedPrecondition(
      "AttentionForward16: the {} backend reads no bf16 attention inputs (runtime.activations: bf16 with the "
      "tensor-core attention)",
      name());
}
Status Backend::AttentionBackward16(float*, const void*, const void*, const float*, const float*, const void*,
                                    const float*, int64_t, int64_t, int64_t, int64_t, int64_t, void*, float*) {
  return FailedPrecondition(
      "AttentionBackward16: the {} backend reads no bf16 attention inputs (runtime.activations: bf16 with the "
      "tensor-core attention)",
      name());
}
Status Backend::CrossEntropyForward16(float*, float*, const void*, const int32_t*, int64_t, int64_t, int64_t) {
  return FailedPrecondition("CrossEntropyForward16: the {} backend keeps no bf16 logits (runtime.activations: bf16)",
                            name());
}
Status Backend::CrossEntropyBackward16(void*, const void*, const float*, const int32_t*, const float*, int64_t, int64_t,
                                       int64_t) {
  return FailedPrecondition("CrossEntropyBackward16: the {} backend keeps no bf16 logits (runtime.activations: bf16)",
                            name());
}
Status Backend::CrossEntropyFused16(float*, float*, void*, const int32_t*, const float*, int64_t, int64_t, int64_t) {
  return FailedPrecondition("CrossEntropyFused16: the {} backend keeps no bf16 logits (runtime.activations: bf16)",
                            name());
}

std::unique_ptr<Backend> MakeCpuBackend(device::Device* device) {
  return std::make_unique<CpuBackend>(device);
}

}  // namespace ms::ops
