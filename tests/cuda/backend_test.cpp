// The CUDA ops backend (lib/cuda) against the CPU backend, op by op, on random inputs of odd sizes: built with
// the emulated flavor (kernels on the SIMT emulator, cuBLAS and the runtime on the CPU: ctest cuda_backend) and,
// with -DMS_GPU_TESTS=ON, with the GPU flavor (ctest -L gpu: cuda_backend_gpu, on a real GPU). Each case runs an op on
// both backends from the same inputs and compares every output. Tolerances: fp32 GEMMs and kernels rtol 1e-4 (other
// accumulation orders); bf16 GEMMs rtol 2e-2 of the output scale (operands rounded to 8-bit mantissas).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include <doctest/doctest.h>

#include "config/config.h"
#include "cuda/cuda.h"
#include "device/device.h"
#include "model/model.h"
#include "ops/ops.h"
#include "optim/optim.h"
#if !defined(MS_TEST_GPU)
#include "sim/runtime_hooks.h"
#endif

namespace ms::cuda {
namespace {

std::vector<float> Random(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// Both backends, and helpers to place host vectors on either device and read them back.
struct Pair {
  std::unique_ptr<device::Device> cpu_dev = device::MakeCpuDevice();
  std::unique_ptr<ops::Backend> cpu = ops::MakeCpuBackend(cpu_dev.get());
  std::unique_ptr<device::Device> gpu_dev;
  std::unique_ptr<ops::Backend> gpu;
  std::vector<std::pair<device::Device*, void*>> allocs;

  explicit Pair(bool bf16 = false, Bf16Operands operands = Bf16Operands::kCast,
                int64_t ds_max_bytes = kAttentionDsMaxBytes) {
    auto d = MakeCudaDevice(0);
    REQUIRE_MESSAGE(d.ok(), d.status().ToString());
    gpu_dev = std::move(d).value();
    auto b = MakeCudaBackend(gpu_dev.get(), bf16, operands, ds_max_bytes);
    REQUIRE_MESSAGE(b.ok(), b.status().ToString());
    gpu = std::move(b).value();
  }
  ~Pair() {
    for (auto& [dev, p] : allocs) dev->Free(p);
  }
  template <typename T>
  T* On(ops::Backend& be, const std::vector<T>& host) {
    auto p = be.device()->Alloc(std::max<size_t>(host.size(), 1) * sizeof(T));
    REQUIRE(p.ok());
    allocs.push_back({be.device(), p.value()});
    REQUIRE(be.CopyFromHost(p.value(), host.data(), host.size() * sizeof(T)).ok());
    return static_cast<T*>(p.value());
  }
  template <typename T>
  std::vector<T> Get(ops::Backend& be, const T* p, size_t n) {
    std::vector<T> host(n);
    REQUIRE(be.CopyToHost(host.data(), p, n * sizeof(T)).ok());
    return host;
  }
};

// |a - b| <= atol + rtol * |a| everywhere (a from the CPU backend).
void ExpectClose(const std::vector<float>& cpu, const std::vector<float>& gpu, float rtol, float atol,
                 const char* what) {
  REQUIRE(cpu.size() == gpu.size());
  size_t worst = 0;
  double worst_excess = -1e300;
  bool bad = false;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double err = std::fabs(static_cast<double>(cpu[i]) - gpu[i]);
    const double tol = atol + rtol * std::fabs(static_cast<double>(cpu[i]));
    const double excess = std::isnan(err) ? 1e300 : err - tol;
    if (excess > worst_excess) worst_excess = excess, worst = i;
    if (!(err <= tol)) bad = true;
  }
  INFO(what << ": worst element " << worst << " cpu " << cpu[worst] << " cuda " << gpu[worst]);
  CHECK_FALSE(bad);
}

// Runs fn(backend, inputs on that backend) on both backends; `outs` lists (input index, count) pairs to compare.
using Inputs = std::vector<std::vector<float>>;
void Compare(Pair& p, const Inputs& in, const std::function<void(ops::Backend&, std::vector<float*>&)>& fn,
             const std::vector<std::pair<int, size_t>>& outs, float rtol, float atol, const char* what) {
  std::vector<float*> a, b;
  for (const auto& v : in) a.push_back(p.On(*p.cpu, v));
  for (const auto& v : in) b.push_back(p.On(*p.gpu, v));
  fn(*p.cpu, a);
  fn(*p.gpu, b);
  REQUIRE(p.gpu->Synchronize().ok());
  for (auto [idx, n] : outs) ExpectClose(p.Get(*p.cpu, a[idx], n), p.Get(*p.gpu, b[idx], n), rtol, atol, what);
}

// Attention forward and backward (qkv random, dout random) on both backends, out, lse and dqkv compared.
std::vector<float> Widen16(const std::vector<uint16_t>& h) {
  std::vector<float> out(h.size());
  for (size_t i = 0; i < h.size(); ++i) {
    const uint32_t bits = static_cast<uint32_t>(h[i]) << 16;
    std::memcpy(&out[i], &bits, sizeof bits);
  }
  return out;
}
uint16_t Round16(float f) {  // nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
std::vector<uint16_t> Round16(const std::vector<float>& v) {
  std::vector<uint16_t> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = Round16(v[i]);
  return r;
}

void CompareAttention(Pair& p, int64_t B, int64_t T, int64_t H, int64_t D, int64_t window, float rtol, float atol) {
  Compare(
      p,
      {Random(B * T * 3 * H * D, 1), std::vector<float>(B * T * H * D), std::vector<float>(B * H * T),
       Random(B * T * H * D, 2), std::vector<float>(B * T * 3 * H * D)},
      [&](ops::Backend& be, std::vector<float*>& t) {
        REQUIRE(be.AttentionForward(t[1], t[2], t[0], B, T, H, D, window).ok());
        REQUIRE(be.AttentionBackward(t[4], t[3], t[0], t[1], t[2], B, T, H, D, window).ok());
      },
      {{1, B * T * H * D}, {2, B * H * T}, {4, B * T * 3 * H * D}}, rtol, atol, "attention");
}

TEST_CASE("cuda backend (emulated): linear layer forward/backward, fp32 GEMMs (rtol 1e-4) and bf16 (2e-2)") {
  for (bool bf16 : {false, true}) {
    Pair p(bf16);
    CHECK(p.gpu->bf16_gemm() == bf16);
    const float rtol = bf16 ? 2e-2f : 1e-4f, atol = bf16 ? 2e-2f : 1e-5f;
    for (auto [N, IC, OC] : {std::tuple{1, 1, 1}, {7, 13, 5}, {33, 64, 40}}) {
      Inputs in = {Random(N * IC, 1), Random(OC * IC, 2), Random(OC, 3),      Random(N * OC, 4),
                   Random(N * OC, 5), Random(N * IC, 6),  Random(OC * IC, 7), Random(OC, 8)};
      Compare(
          p, in,
          [&](ops::Backend& be, std::vector<float*>& t) {
            REQUIRE(be.MatmulForward(t[3], t[0], t[1], t[2], N, IC, OC).ok());
            REQUIRE(be.MatmulBackward(t[5], t[6], t[7], t[4], t[0], t[1], N, IC, OC).ok());
          },
          {{3, size_t(N * OC)}, {5, size_t(N * IC)}, {6, size_t(OC * IC)}, {7, size_t(OC)}}, rtol, atol, "linear");
    }
  }
}

// The CUDA backend's GEMM flavors (fp32; bf16 with cast and with kept operands), each with its tolerance against
// the CPU backend, over odd linear-layer shapes: fn(pair, rtol, atol, N, IC, OC).
template <class Fn>
void ForEachGemmFlavor(const Fn& fn) {
  for (auto [bf16, operands] :
       {std::pair{false, Bf16Operands::kCast}, {true, Bf16Operands::kCast}, {true, Bf16Operands::kKeep}}) {
    Pair p(bf16, operands);
    for (auto [N, IC, OC] : {std::tuple{1, 1, 1}, {7, 13, 5}, {33, 64, 40}}) {
      CAPTURE(N);
      fn(p, bf16 ? 2e-2f : 1e-4f, bf16 ? 2e-2f : 1e-5f, N, IC, OC);
    }
  }
}

// Bf16Copies::out_accumulate (the parallel block's MLP projection adding its product to the attention
// projection's): out += inp . w^T on both backends within the GEMM tolerance, and on each the bits of the product
// computed aside then AddInPlace (what the model ran before); a bias or a bf16 output beside it is refused.
TEST_CASE("cuda backend (emulated): linear forward accumulating into out (out_accumulate), fp32 and bf16 GEMMs") {
  ForEachGemmFlavor([](Pair& p, float rtol, float atol, int N, int IC, int OC) {
    const Inputs in = {Random(N * IC, 1), Random(OC * IC, 2), Random(N * OC, 3), Random(N * OC, 3),
                       std::vector<float>(N * OC)};
    ops::Bf16Copies acc;
    acc.out_accumulate = true;
    Compare(
        p, in,
        [&](ops::Backend& be, std::vector<float*>& t) {
          REQUIRE(be.MatmulForward(t[2], t[0], t[1], nullptr, N, IC, OC, acc).ok());  // t[2] += product
          REQUIRE(be.MatmulForward(t[4], t[0], t[1], nullptr, N, IC, OC).ok());       // the product aside
          REQUIRE(be.AddInPlace(t[3], t[4], N * OC).ok());                            // t[3] (= t[2]) += it
          CHECK(p.Get(be, t[2], size_t(N * OC)) == p.Get(be, t[3], size_t(N * OC)));
        },
        {{2, size_t(N * OC)}}, rtol, atol, "linear forward (accumulated)");
    for (ops::Backend* be : {p.gpu.get(), p.cpu.get()}) {  // with a bias: refused, nothing computed
      float* x = p.On(*be, std::vector<float>(N * std::max(IC, OC)));
      CHECK(be->MatmulForward(x, x, x, x, N, IC, OC, acc).code() == Code::kInvalidArgument);
    }
  });
}

// Bf16Copies::dinp_overwrite: dinp is written, whatever it held (the model no longer zeroes the scratch it
// accumulated into): on both backends the values of a zeroed dinp accumulated into (== as floats: a GEMM with beta
// 0 may give -0 where the zeroed sum gave +0), and the CPU backend within the GEMM tolerance of the CUDA one. Fails
// when a backend accumulates onto what dinp held.
TEST_CASE("cuda backend (emulated): linear backward writing dinp (dinp_overwrite), fp32 and bf16 GEMMs") {
  ForEachGemmFlavor([](Pair& p, float rtol, float atol, int N, int IC, int OC) {
    const Inputs in = {Random(N * IC, 1),  Random(OC * IC, 2),         Random(N * OC, 4),          Random(N * IC, 6),
                       Random(OC * IC, 7), std::vector<float>(N * IC), std::vector<float>(OC * IC)};
    ops::Bf16Copies overwrite;
    overwrite.dinp_overwrite = true;
    Compare(
        p, in,
        [&](ops::Backend& be, std::vector<float*>& t) {
          // t[3] holds garbage and is overwritten; t[5] starts at zero and is accumulated into.
          REQUIRE(be.MatmulBackward(t[3], t[4], nullptr, t[2], t[0], t[1], N, IC, OC, overwrite).ok());
          REQUIRE(be.MatmulBackward(t[5], t[6], nullptr, t[2], t[0], t[1], N, IC, OC).ok());
          const auto written = p.Get(be, t[3], size_t(N * IC)), accumulated = p.Get(be, t[5], size_t(N * IC));
          CHECK(written == accumulated);
        },
        {{3, size_t(N * IC)}}, rtol, atol, "linear dinp (overwrite)");
  });
}

TEST_CASE("cuda backend (emulated): LayerNorm, GeLU, bias + GeLU, attention, cross-entropy, embedding (rtol 1e-4)") {
  Pair p;
  const int64_t N = 37, C = 24;
  Compare(
      p,
      {Random(N * C, 1), Random(C, 2), Random(C, 3), Random(N * C, 4), std::vector<float>(N), std::vector<float>(N),
       Random(N * C, 5), Random(N * C, 6), Random(C, 7), Random(C, 8)},
      [&](ops::Backend& be, std::vector<float*>& t) {
        REQUIRE(be.LayerNormForward(t[3], t[4], t[5], t[0], t[1], t[2], N, C, 1e-5f).ok());
        REQUIRE(be.LayerNormBackward(t[7], t[8], t[9], t[6], t[0], t[1], t[4], t[5], N, C).ok());
      },
      {{3, N * C}, {4, N}, {5, N}, {7, N * C}, {8, C}, {9, C}}, 1e-4f, 1e-5f, "layernorm");
  // The LayerNorm backward summing the accumulated dx's columns into two bias gradients (the model's residual-branch
  // biases): the CPU backend's BiasGrad passes and the kernel's own order agree within 1e-4; both get the same sums.
  Compare(
      p,
      {Random(N * C, 1), Random(C, 2), Random(C, 3), Random(N * C, 4), std::vector<float>(N), std::vector<float>(N),
       Random(N * C, 5), Random(N * C, 6), Random(C, 7), Random(C, 8), Random(C, 9), Random(C, 10)},
      [&](ops::Backend& be, std::vector<float*>& t) {
        REQUIRE(be.LayerNormForward(t[3], t[4], t[5], t[0], t[1], t[2], N, C, 1e-5f).ok());
        REQUIRE(be.LayerNormBackward(t[7], t[8], t[9], t[6], t[0], t[1], t[4], t[5], N, C, nullptr, t[10], t[11]).ok());
        CHECK(be.LayerNormBackward(t[7], t[8], t[9], t[6], t[0], t[1], t[4], t[5], N, C, nullptr, nullptr, t[11])
                  .code() == Code::kInvalidArgument);
      },
      {{7, N * C}, {8, C}, {9, C}, {10, C}, {11, C}}, 1e-4f, 1e-5f, "layernorm + residual bias gradients");
  Compare(
      p, {Random(N * C, 1, -3, 3), std::vector<float>(N * C), Random(N * C, 2), std::vector<float>(N * C)},
      [&](ops::Backend& be, std::vector<float*>& t) {
        REQUIRE(be.GeluForward(t[1], t[0], N * C).ok());
        REQUIRE(be.GeluBackward(t[3], t[0], t[2], N * C).ok());
      },
      {{1, N * C}, {3, N * C}}, 1e-4f, 1e-6f, "gelu");
  Compare(
      p,
      {Random(N * C, 1, -3, 3), Random(C, 2), std::vector<float>(N * C), Random(N * C, 3), std::vector<float>(N * C),
       Random(C, 4)},
      [&](ops::Backend& be, std::vector<float*>& t) {
        REQUIRE(be.BiasGeluForward(t[2], t[0], t[1], N, C).ok());
        REQUIRE(be.BiasGeluBackward(t[4], t[5], t[0], t[1], t[3], N, C).ok());
      },
      {{2, N * C}, {4, N * C}, {5, C}}, 1e-4f, 1e-6f, "bias + gelu");
  for (int64_t window : {0, 5}) CompareAttention(p, 2, 19, 3, 8, window, 1e-4f, 1e-5f);
  // Cross-entropy and its vocab-parallel pieces (targets travel as floats' bit patterns: int32 buffers).
  const int64_t V = 29;
  std::vector<int32_t> targets(N);
  for (int64_t i = 0; i < N; ++i) targets[i] = i % 7 == 3 ? -1 : static_cast<int32_t>((i * 5) % V);
  int32_t* tc = p.On(*p.cpu, targets);
  int32_t* tg = p.On(*p.gpu, targets);
  Compare(
      p,
      {Random(N * V, 1, -4, 4), std::vector<float>(N), std::vector<float>(N), Random(N, 2, 0.1f, 1.0f),
       std::vector<float>(N * V), std::vector<float>(N), std::vector<float>(N), std::vector<float>(N),
       std::vector<float>(N), std::vector<float>(N), std::vector<float>(N * V), Random(N * V, 1, -4, 4),
       std::vector<float>(N), std::vector<float>(N), std::vector<float>(N, 5.0f)},
      [&](ops::Backend& be, std::vector<float*>& t) {
        const int32_t* tt = &be == p.cpu.get() ? tc : tg;
        REQUIRE(be.CrossEntropyForward(t[1], t[2], t[0], tt, N, V).ok());
        REQUIRE(be.CrossEntropyBackward(t[4], t[0], t[2], tt, t[3], N, V).ok());
        REQUIRE(be.VocabParallelRowStats(t[5], t[6], t[7], t[0], tt, 0, N, V).ok());
        // Rebased on a "global" max of 5 (above every logit), as after the max all-reduce.
        REQUIRE(be.VocabParallelRebase(t[6], t[5], t[14], N).ok());
        REQUIRE(be.VocabParallelFinish(t[8], t[9], t[14], t[6], t[7], tt, N).ok());
        REQUIRE(be.VocabParallelBackward(t[10], t[0], t[9], tt, 0.25f, 0, N, V).ok());
        REQUIRE(be.CrossEntropyFused(t[12], t[13], t[11], tt, t[3], N, V).ok());  // dlogits over the logits copy
      },
      {{1, N}, {2, N}, {4, N * V}, {5, N}, {6, N}, {7, N}, {8, N}, {9, N}, {10, N * V}, {11, N * V}, {12, N}, {13, N}},
      1e-4f, 1e-6f, "cross-entropy");
  std::vector<int32_t> ids(N);
  for (int64_t i = 0; i < N; ++i) ids[i] = i % 5 == 0 ? -1 : static_cast<int32_t>((i * 3) % 11);
  int32_t* ic = p.On(*p.cpu, ids);
  int32_t* ig = p.On(*p.gpu, ids);
  Compare(
      p, {Random(11 * C, 1), std::vector<float>(N * C), Random(N * C, 2), Random(11 * C, 3)},
      [&](ops::Backend& be, std::vector<float*>& t) {
        const int32_t* ii = &be == p.cpu.get() ? ic : ig;
        REQUIRE(be.EmbeddingForward(t[1], ii, t[0], N, C).ok());
        REQUIRE(be.EmbeddingBackward(t[3], ii, t[2], N, C).ok());
      },
      {{1, N * C}, {3, 11 * C}}, 1e-5f, 1e-6f, "embedding");
}

// runtime.bf16_operands: cublas: the GEMMs take the fp32 operands and cuBLAS converts them
// (CUBLAS_COMPUTE_32F_FAST_16BF). Within the bf16 tolerance of the CPU backend; under the emulator (whose
// conversion rounds to nearest even like the cast kernel) the same bits as the cast path.
TEST_CASE("cuda backend (emulated): bf16 GEMMs with cuBLAS converting the operands (rtol 2e-2; emulated: as cast)") {
  Pair cast(true), conv(true, Bf16Operands::kCublas);
  const int64_t N = 33, IC = 64, OC = 40;
  const Inputs in = {Random(N * IC, 1), Random(OC * IC, 2), Random(OC, 3),      Random(N * OC, 4),
                     Random(N * OC, 5), Random(N * IC, 6),  Random(OC * IC, 7), Random(OC, 8)};
  auto linear = [&](ops::Backend& be, std::vector<float*>& t) {
    REQUIRE(be.MatmulForward(t[3], t[0], t[1], t[2], N, IC, OC).ok());
    REQUIRE(be.MatmulBackward(t[5], t[6], t[7], t[4], t[0], t[1], N, IC, OC).ok());
  };
  const std::vector<std::pair<int, size_t>> outs = {{3, N * OC}, {5, N * IC}, {6, OC * IC}, {7, OC}};
  Compare(conv, in, linear, outs, 2e-2f, 2e-2f, "linear (cuBLAS converts)");
  if (LinkedFlavor() != Flavor::kEmulated) return;
  std::vector<float*> a, b;
  for (const auto& v : in) a.push_back(cast.On(*cast.gpu, v));
  for (const auto& v : in) b.push_back(conv.On(*conv.gpu, v));
  linear(*cast.gpu, a);
  linear(*conv.gpu, b);
  REQUIRE(cast.gpu->Synchronize().ok());
  REQUIRE(conv.gpu->Synchronize().ok());
  for (auto [idx, n] : outs) CHECK(cast.Get(*cast.gpu, a[idx], n) == conv.Get(*conv.gpu, b[idx], n));
}

// runtime.bf16_operands: keep: the caller keeps bf16 roundings (ops::Bf16Copies) — a weight cast once by
// CastToBf16, an input rounded by the forward GEMM into the caller's buffer and read again by the backward, an
// output gradient rounded by its producer. The same bits as casting at every GEMM; the backward with `inp_ready`
// (and `dout`) reads only the kept roundings (its fp32 input, weight and output gradient are zeroed here and the
// results do not change).
TEST_CASE("cuda backend: kept bf16 GEMM operands give the bits of casting at every GEMM") {
  Pair cast(true), keep(true, Bf16Operands::kKeep);
  CHECK_FALSE(cast.gpu->keeps_bf16_copies());
  CHECK(keep.gpu->keeps_bf16_copies());
  CHECK_FALSE(cast.cpu->keeps_bf16_copies());
  const int64_t N = 33, IC = 40, OC = 24;
  const Inputs in = {Random(N * IC, 1), Random(OC * IC, 2), Random(OC, 3),      std::vector<float>(N * OC),
                     Random(N * OC, 4), Random(N * IC, 5),  Random(OC * IC, 6), Random(OC, 7)};
  std::vector<float*> a, b;
  for (const auto& v : in) a.push_back(cast.On(*cast.gpu, v));
  for (const auto& v : in) b.push_back(keep.On(*keep.gpu, v));
  {
    auto st = cast.gpu->CastToBf16(a[3], a[0], 4);
    CHECK(st.code() == Code::kFailedPrecondition);
    CHECK(cast.cpu->CastToBf16(a[3], a[0], 4).code() == Code::kFailedPrecondition);
  }
  // Forward + backward, casting at every GEMM.
  REQUIRE(cast.gpu->MatmulForward(a[3], a[0], a[1], a[2], N, IC, OC).ok());
  REQUIRE(cast.gpu->MatmulBackward(a[5], a[6], a[7], a[4], a[0], a[1], N, IC, OC).ok());
  // Kept: the weight cast once, the input rounded by the forward into inp16.
  uint16_t* w16 = keep.On(*keep.gpu, std::vector<uint16_t>(OC * IC));
  uint16_t* inp16 = keep.On(*keep.gpu, std::vector<uint16_t>(N * IC, 0xFFFF));
  uint16_t* want16 = keep.On(*keep.gpu, std::vector<uint16_t>(N * IC));
  REQUIRE(keep.gpu->CastToBf16(w16, b[1], OC * IC).ok());
  REQUIRE(keep.gpu->CastToBf16(want16, b[0], N * IC).ok());
  REQUIRE(keep.gpu->MatmulForward(b[3], b[0], b[1], b[2], N, IC, OC, {w16, inp16, false}).ok());
  CHECK(keep.Get(*keep.gpu, inp16, N * IC) == keep.Get(*keep.gpu, want16, N * IC));
  REQUIRE(keep.gpu->Zero(b[0], sizeof(float) * N * IC).ok());  // only the kept roundings remain
  REQUIRE(keep.gpu->Zero(b[1], sizeof(float) * OC * IC).ok());
  REQUIRE(keep.gpu->MatmulBackward(b[5], b[6], b[7], b[4], b[0], b[1], N, IC, OC, {w16, inp16, true}).ok());
  REQUIRE(cast.gpu->Synchronize().ok());
  REQUIRE(keep.gpu->Synchronize().ok());
  for (auto [idx, n] : std::vector<std::pair<int, size_t>>{{3, N * OC}, {5, N * IC}, {6, OC * IC}, {7, OC}}) {
    CAPTURE(idx);
    CHECK(cast.Get(*cast.gpu, a[idx], n) == keep.Get(*keep.gpu, b[idx], n));
  }
  // The output gradient's rounding made by its producer (Bf16Copies::dout): read instead of the fp32 dout, which is
  // zeroed here (no bias gradient: that sums the fp32 dout).
  {
    float* dinp = keep.On(*keep.gpu, in[5]);
    float* dw = keep.On(*keep.gpu, in[6]);
    float* dinp_want = cast.On(*cast.gpu, in[5]);
    float* dw_want = cast.On(*cast.gpu, in[6]);
    REQUIRE(cast.gpu->MatmulBackward(dinp_want, dw_want, nullptr, a[4], a[0], a[1], N, IC, OC).ok());
    uint16_t* dout16 = keep.On(*keep.gpu, std::vector<uint16_t>(N * OC));
    REQUIRE(keep.gpu->CastToBf16(dout16, b[4], N * OC).ok());
    REQUIRE(keep.gpu->Zero(b[4], sizeof(float) * N * OC).ok());
    ops::Bf16Copies kept{.w = w16, .inp = inp16, .inp_ready = true, .dout = dout16};
    REQUIRE(keep.gpu->MatmulBackward(dinp, dw, nullptr, b[4], b[0], b[1], N, IC, OC, kept).ok());
    CHECK(keep.Get(*keep.gpu, dinp, N * IC) == cast.Get(*cast.gpu, dinp_want, N * IC));
    CHECK(keep.Get(*keep.gpu, dw, OC * IC) == cast.Get(*cast.gpu, dw_want, OC * IC));
  }
  // The producers' roundings (LayerNorm, bias + GeLU): the cast kernel's bits of their fp32 outputs; refused by
  // backends that keep nothing.
  float* mean = keep.On(*keep.gpu, std::vector<float>(N));
  float* rstd = keep.On(*keep.gpu, std::vector<float>(N));
  uint16_t* out16 = keep.On(*keep.gpu, std::vector<uint16_t>(N * OC));
  // Each also writes only the rounding when its fp32 output is null (what the model does where nothing else reads
  // the fp32 output): the same bits.
  uint16_t* only16 = keep.On(*keep.gpu, std::vector<uint16_t>(N * OC));
  REQUIRE(keep.gpu->LayerNormForward(b[4], mean, rstd, b[3], b[2], b[7], N, OC, 1e-5f, out16).ok());
  REQUIRE(keep.gpu->CastToBf16(want16, b[4], N * OC).ok());
  CHECK(keep.Get(*keep.gpu, out16, N * OC) == keep.Get(*keep.gpu, want16, N * OC));
  REQUIRE(keep.gpu->LayerNormForward(nullptr, mean, rstd, b[3], b[2], b[7], N, OC, 1e-5f, only16).ok());
  CHECK(keep.Get(*keep.gpu, only16, N * OC) == keep.Get(*keep.gpu, want16, N * OC));
  REQUIRE(keep.gpu->BiasGeluForward(b[4], b[3], b[2], N, OC, out16).ok());
  REQUIRE(keep.gpu->CastToBf16(want16, b[4], N * OC).ok());
  CHECK(keep.Get(*keep.gpu, out16, N * OC) == keep.Get(*keep.gpu, want16, N * OC));
  REQUIRE(keep.gpu->BiasGeluForward(nullptr, b[3], b[2], N, OC, only16).ok());
  CHECK(keep.Get(*keep.gpu, only16, N * OC) == keep.Get(*keep.gpu, want16, N * OC));
  // Neither an fp32 output nor a rounding: refused (nothing would be written).
  CHECK(keep.gpu->BiasGeluForward(nullptr, b[3], b[2], N, OC, nullptr).code() == Code::kInvalidArgument);
  CHECK(keep.gpu->LayerNormForward(nullptr, mean, rstd, b[3], b[2], b[7], N, OC, 1e-5f, nullptr).code() ==
        Code::kInvalidArgument);
  CHECK(cast.cpu->CrossEntropyFused(a[4], a[5], a[3], nullptr, a[5], N, OC, nullptr, false).code() ==
        Code::kFailedPrecondition);
  CHECK(cast.gpu->BiasGeluForward(a[4], a[3], a[2], N, OC, a[5]).code() == Code::kFailedPrecondition);
  CHECK(cast.gpu->LayerNormForward(a[4], a[5], a[5], a[3], a[2], a[7], N, OC, 1e-5f, a[6]).code() ==
        Code::kFailedPrecondition);
  CHECK(cast.cpu->BiasGeluForward(a[4], a[3], a[2], N, OC, a[5]).code() == Code::kFailedPrecondition);
}

// With bf16 GEMMs, a head dimension that is a multiple of 16 takes the tensor-core attention kernels (bf16
// operands): within 2e-2 of the CPU backend's fp32 attention; D = 24 keeps the fp32 kernels (1e-4).
TEST_CASE("cuda backend (emulated): bf16 backend attention, tensor-core head dims (16, 64) and fp32 (24)") {
  Pair p(/*bf16=*/true);
  for (int64_t D : {16, 24, 64}) {
    CAPTURE(D);
    const float tol = D % 16 == 0 ? 2e-2f : 1e-4f;
    CompareAttention(p, 2, 70, 2, D, D == 64 ? 0 : 9, tol, tol);
  }
}

// Kept operands: the attention writes the bf16 roundings of out and dqkv (the tensor-core kernels as they store,
// D = 16; after the fp32 kernels, D = 24, a cast): the cast kernel's bits of the fp32 outputs, which stay the same
// bits as without. Refused by backends that keep nothing.
// A GPT spec of the given shape for the model-level tests of this file (other fields at their defaults).
config::ModelSpec SpecOf(int layers, int hidden, int heads, int ffn, int vocab, int seq_len) {
  config::ModelSpec m;
  m.layers = layers;
  m.hidden = hidden;
  m.heads = heads;
  m.ffn_hidden = ffn;
  m.vocab = vocab;
  m.seq_len = seq_len;
  return m;
}

// A GEMM's bf16 output (bits got16) against the same GEMM's fp32 output: the nearest-even rounding of it under the
// emulator (which rounds the fp32 sum once), within one bf16 step on a GPU (cuBLAS choosing its own kernels).
// Returns got16 widened to fp32.
std::vector<float> ExpectBf16GemmOutput(const std::vector<float>& fp32, const std::vector<uint16_t>& got16,
                                        const char* what) {
  const std::vector<float> widened = Widen16(got16);
#if !defined(MS_TEST_GPU)
  for (size_t i = 0; i < got16.size(); ++i) CHECK(got16[i] == Round16(fp32[i]));
#endif
#if defined(MS_TEST_GPU)
  ExpectClose(fp32, widened, 1e-2f, 1e-2f, what);
#else
  (void)what;
#endif
  return widened;
}

// runtime.activations: bf16 — the fc GEMM writes its output rounded to bf16 (Bf16Copies::out16) and the bias + GeLU
// read it: the GEMM's bf16 output is the rounding of its fp32 output (the emulated cuBLAS rounds the fp32 sum once;
// on a GPU within one bf16 ulp, cuBLAS choosing its own kernels), and BiasGeluForward16 / BiasGeluBackward16 give the
// bits of the fp32 calls on that rounding widened. Keep and cast both take it; cuBLAS-converted operands, fp32 GEMMs
// and the CPU backend refuse, as does an fp32 out next to out16, and with cast a bias next to it (kept operands add
// it in the GEMM's epilogue: the qkv GEMM's test case below).
TEST_CASE("cuda backend: bf16 fc output (runtime.activations: bf16)") {
  for (Bf16Operands mode : {Bf16Operands::kKeep, Bf16Operands::kCast}) {
    Pair p(/*bf16=*/true, mode);
    REQUIRE(p.gpu->bf16_activations());
    const int64_t N = 37, IC = 24, OC = 40;
    float* inp = p.On(*p.gpu, Random(N * IC, 51));
    float* w = p.On(*p.gpu, Random(OC * IC, 52));
    float* bias = p.On(*p.gpu, Random(OC, 53));
    float* dout = p.On(*p.gpu, Random(N * OC, 54));
    float* out = p.On(*p.gpu, std::vector<float>(N * OC));
    uint16_t* out16 = p.On(*p.gpu, std::vector<uint16_t>(N * OC, 0xFFFF));
    REQUIRE(p.gpu->MatmulForward(out, inp, w, nullptr, N, IC, OC).ok());
    ops::Bf16Copies kc;
    kc.out16 = out16;
    REQUIRE(p.gpu->MatmulForward(nullptr, inp, w, nullptr, N, IC, OC, kc).ok());
    const std::vector<float> widened =
        ExpectBf16GemmOutput(p.Get(*p.gpu, out, N * OC), p.Get(*p.gpu, out16, N * OC), "bf16 GEMM output");
    // The bias + GeLU on the bf16 output = the fp32 calls on it widened, bit for bit.
    float* xw = p.On(*p.gpu, widened);
    std::vector<float*> y(2), dx(2), db(2);
    for (int k = 0; k < 2; ++k) {
      y[k] = p.On(*p.gpu, std::vector<float>(N * OC));
      dx[k] = p.On(*p.gpu, std::vector<float>(N * OC));
      db[k] = p.On(*p.gpu, std::vector<float>(OC));
    }
    REQUIRE(p.gpu->BiasGeluForward(y[0], xw, bias, N, OC).ok());
    REQUIRE(p.gpu->BiasGeluBackward(dx[0], db[0], xw, bias, dout, N, OC).ok());
    REQUIRE(p.gpu->BiasGeluForward16(y[1], out16, bias, N, OC, nullptr).ok());
    REQUIRE(p.gpu->BiasGeluBackward16(dx[1], db[1], out16, bias, dout, nullptr, N, OC, nullptr).ok());
    CHECK(p.Get(*p.gpu, y[1], N * OC) == p.Get(*p.gpu, y[0], N * OC));
    CHECK(p.Get(*p.gpu, dx[1], N * OC) == p.Get(*p.gpu, dx[0], N * OC));
    CHECK(p.Get(*p.gpu, db[1], OC) == p.Get(*p.gpu, db[0], OC));
    // An fp32 output next to the bf16 one: refused; a bias next to it without kept operands too.
    CHECK(p.gpu->MatmulForward(out, inp, w, nullptr, N, IC, OC, kc).code() == Code::kInvalidArgument);
    if (mode == Bf16Operands::kCast) {
      CHECK(p.gpu->MatmulForward(nullptr, inp, w, bias, N, IC, OC, kc).code() == Code::kFailedPrecondition);
    }

    // The backward's bf16 input gradient (Bf16Copies::dinp16, the fc-proj GEMM's: the GeLU output's gradient): the
    // rounding of the fp32 dinp written with dinp_overwrite (emulated: bit for bit; on a GPU within one bf16 ulp),
    // and the bias + GeLU backward reading it (dout16) = the fp32 call on it widened.
    float* dinp = p.On(*p.gpu, Random(N * IC, 55));  // garbage: overwritten
    float* dw = p.On(*p.gpu, std::vector<float>(OC * IC));
    uint16_t* dinp16 = p.On(*p.gpu, std::vector<uint16_t>(N * IC, 0xFFFF));
    ops::Bf16Copies kb;
    kb.dinp_overwrite = true;
    REQUIRE(p.gpu->MatmulBackward(dinp, dw, nullptr, dout, inp, w, N, IC, OC, kb).ok());
    kb.dinp16 = dinp16;
    REQUIRE(p.gpu->MatmulBackward(nullptr, dw, nullptr, dout, inp, w, N, IC, OC, kb).ok());
    const std::vector<float> dinpw =
        ExpectBf16GemmOutput(p.Get(*p.gpu, dinp, N * IC), p.Get(*p.gpu, dinp16, N * IC), "bf16 GEMM input gradient");
    float* xg = p.On(*p.gpu, dinpw);  // any (N, IC) x will do: the widened dinp again
    uint16_t* xg16 = dinp16;
    float* gw = p.On(*p.gpu, dinpw);
    float* biasg = p.On(*p.gpu, Random(IC, 56));
    std::vector<float*> dg(2), dbg(2);
    for (int k = 0; k < 2; ++k) {
      dg[k] = p.On(*p.gpu, std::vector<float>(N * IC));
      dbg[k] = p.On(*p.gpu, std::vector<float>(IC));
    }
    REQUIRE(p.gpu->BiasGeluBackward(dg[0], dbg[0], xg, biasg, gw, N, IC).ok());
    REQUIRE(p.gpu->BiasGeluBackward16(dg[1], dbg[1], xg16, biasg, nullptr, dinp16, N, IC, nullptr).ok());
    CHECK(p.Get(*p.gpu, dg[1], N * IC) == p.Get(*p.gpu, dg[0], N * IC));
    CHECK(p.Get(*p.gpu, dbg[1], IC) == p.Get(*p.gpu, dbg[0], IC));
    // Refused: an fp32 dinp beside the bf16 one, dinp16 accumulated, both or neither dout.
    CHECK(p.gpu->MatmulBackward(dinp, dw, nullptr, dout, inp, w, N, IC, OC, kb).code() == Code::kInvalidArgument);
    kb.dinp_overwrite = false;
    CHECK(p.gpu->MatmulBackward(nullptr, dw, nullptr, dout, inp, w, N, IC, OC, kb).code() == Code::kInvalidArgument);
    CHECK(p.gpu->BiasGeluBackward16(dg[1], dbg[1], xg16, biasg, gw, dinp16, N, IC, nullptr).code() ==
          Code::kInvalidArgument);
    CHECK(p.gpu->BiasGeluBackward16(dg[1], dbg[1], xg16, biasg, nullptr, nullptr, N, IC, nullptr).code() ==
          Code::kInvalidArgument);
  }
  Pair conv(/*bf16=*/true, Bf16Operands::kCublas), fp32;
  ops::Bf16Copies kc;
  for (ops::Backend* be : {conv.gpu.get(), fp32.gpu.get(), fp32.cpu.get()}) {
    CAPTURE(be->name());
    CHECK_FALSE(be->bf16_activations());
    Pair& owner = be == conv.gpu.get() ? conv : fp32;
    float* x = owner.On(*be, std::vector<float>(16));
    kc.out16 = x;
    CHECK(be->MatmulForward(nullptr, x, x, nullptr, 2, 2, 2, kc).code() == Code::kFailedPrecondition);
    CHECK(be->BiasGeluForward16(x, x, x, 2, 2, nullptr).code() == Code::kFailedPrecondition);
    CHECK(be->BiasGeluBackward16(x, x, x, x, x, nullptr, 2, 2, nullptr).code() == Code::kFailedPrecondition);
    ops::Bf16Copies kb;
    kb.dinp_overwrite = true;
    kb.dinp16 = x;
    CHECK(be->MatmulBackward(nullptr, x, nullptr, x, x, x, 2, 2, 2, kb).code() == Code::kFailedPrecondition);
    const int32_t* t = reinterpret_cast<const int32_t*>(x);
    CHECK(be->CrossEntropyForward16(x, x, x, t, 2, 2, 2).code() == Code::kFailedPrecondition);
    CHECK(be->CrossEntropyBackward16(x, x, x, t, x, 2, 2, 2).code() == Code::kFailedPrecondition);
    CHECK(be->CrossEntropyFused16(x, x, x, t, x, 2, 2, 2).code() == Code::kFailedPrecondition);
  }
  // The model refuses the switch where the backend cannot take it.
  const config::ModelSpec m = SpecOf(1, 16, 1, 64, 32, 8);
  model::ShardSpec shard;
  shard.bf16_fc = true;
  auto g = model::Gpt::Create(m, shard, 1, 1, fp32.cpu_dev.get(), {}, fp32.cpu.get());
  REQUIRE_FALSE(g.ok());
  CHECK(g.status().code() == Code::kFailedPrecondition);
  CHECK(g.status().ToString().find("runtime.activations") != std::string::npos);
  shard.fused_kernels = false;
  Pair keep(/*bf16=*/true, Bf16Operands::kKeep);
  auto u = model::Gpt::Create(m, shard, 1, 1, keep.gpu_dev.get(), {}, keep.gpu.get());
  CHECK(u.status().code() == Code::kFailedPrecondition);
}

TEST_CASE("cuda backend: attention's kept roundings of out and dqkv") {
  Pair keep(true, Bf16Operands::kKeep);
  for (int64_t D : {16, 24}) {
    CAPTURE(D);
    const int64_t B = 1, T = 37, H = 2, window = 5, n_out = B * T * H * D, n_qkv = 3 * n_out;
    float* qkv = keep.On(*keep.gpu, Random(n_qkv, 31));
    float* dout = keep.On(*keep.gpu, Random(n_out, 32));
    std::vector<float*> out, lse, dqkv;
    for (int k = 0; k < 2; ++k) {
      out.push_back(keep.On(*keep.gpu, std::vector<float>(n_out)));
      lse.push_back(keep.On(*keep.gpu, std::vector<float>(B * H * T)));
      dqkv.push_back(keep.On(*keep.gpu, std::vector<float>(n_qkv)));
    }
    uint16_t* out16 = keep.On(*keep.gpu, std::vector<uint16_t>(n_out, 0xFFFF));
    uint16_t* dqkv16 = keep.On(*keep.gpu, std::vector<uint16_t>(n_qkv, 0xFFFF));
    uint16_t* want16 = keep.On(*keep.gpu, std::vector<uint16_t>(n_qkv));
    REQUIRE(keep.gpu->AttentionForward(out[0], lse[0], qkv, B, T, H, D, window).ok());
    REQUIRE(keep.gpu->AttentionBackward(dqkv[0], dout, qkv, out[0], lse[0], B, T, H, D, window).ok());
    REQUIRE(keep.gpu->AttentionForward(out[1], lse[1], qkv, nullptr, B, T, H, D, window, out16).ok());
    REQUIRE(
        keep.gpu->AttentionBackward(dqkv[1], dout, qkv, nullptr, out[1], lse[1], B, T, H, D, window, dqkv16, nullptr)
            .ok());
    CHECK(keep.Get(*keep.gpu, out[1], n_out) == keep.Get(*keep.gpu, out[0], n_out));
    CHECK(keep.Get(*keep.gpu, dqkv[1], n_qkv) == keep.Get(*keep.gpu, dqkv[0], n_qkv));
    REQUIRE(keep.gpu->CastToBf16(want16, out[0], n_out).ok());
    CHECK(keep.Get(*keep.gpu, out16, n_out) == keep.Get(*keep.gpu, want16, n_out));
    REQUIRE(keep.gpu->CastToBf16(want16, dqkv[0], n_qkv).ok());
    CHECK(keep.Get(*keep.gpu, dqkv16, n_qkv) == keep.Get(*keep.gpu, want16, n_qkv));
  }
}

// The tensor-core attention adds the qkv bias as it loads q, k, v (attention_adds_qkv_bias): qkv GEMM without its
// bias + attention with it = the GEMM adding the bias + attention, bit for bit (out, lse, dqkv). Elsewhere refused.
// Its gradient, summed by the attention backward as it stores dqkv, is within 1e-5 of BiasGrad over dqkv (another
// order of the same fp32 sums), added to what the gradient held.
TEST_CASE("cuda backend: the qkv bias added by the attention gives the bits of the GEMM adding it") {
  Pair p(/*bf16=*/true);
  CHECK(p.gpu->attention_adds_qkv_bias(16));
  CHECK_FALSE(p.gpu->attention_adds_qkv_bias(24));
  CHECK_FALSE(p.cpu->attention_adds_qkv_bias(16));
  const int64_t B = 2, T = 37, H = 2, D = 16, window = 5, N = B * T, IC = 20, OC = 3 * H * D;
  float* inp = p.On(*p.gpu, Random(N * IC, 41));
  float* w = p.On(*p.gpu, Random(OC * IC, 42));
  float* bias = p.On(*p.gpu, Random(OC, 43, -1.0f, 1.0f));
  float* dout = p.On(*p.gpu, Random(N * H * D, 44));
  const std::vector<float> init = Random(OC, 45);
  std::vector<std::vector<float>> got[2];
  for (int fold = 0; fold < 2; ++fold) {
    float* qkv = p.On(*p.gpu, std::vector<float>(N * OC));
    float* out = p.On(*p.gpu, std::vector<float>(N * H * D));
    float* lse = p.On(*p.gpu, std::vector<float>(B * H * T));
    float* dqkv = p.On(*p.gpu, std::vector<float>(N * OC));
    float* dbias = p.On(*p.gpu, init);
    REQUIRE(p.gpu->MatmulForward(qkv, inp, w, fold ? nullptr : bias, N, IC, OC).ok());
    REQUIRE(p.gpu->AttentionForward(out, lse, qkv, fold ? bias : nullptr, B, T, H, D, window, nullptr).ok());
    REQUIRE(p.gpu
                ->AttentionBackward(dqkv, dout, qkv, fold ? bias : nullptr, out, lse, B, T, H, D, window, nullptr,
                                    fold ? dbias : nullptr)
                .ok());
    if (!fold) REQUIRE(p.gpu->BiasGrad(dbias, dqkv, N, OC).ok());
    got[fold] = {p.Get(*p.gpu, out, N * H * D), p.Get(*p.gpu, lse, B * H * T), p.Get(*p.gpu, dqkv, N * OC),
                 p.Get(*p.gpu, dbias, OC)};
  }
  CHECK(got[0][0] == got[1][0]);
  CHECK(got[0][1] == got[1][1]);
  CHECK(got[0][2] == got[1][2]);
  CHECK(got[1][3] != init);
  ExpectClose(got[0][3], got[1][3], 1e-5f, 1e-6f, "qkv bias gradient");
}

// runtime.activations: bf16 — the attention's inputs in bf16: qkv as the qkv GEMM wrote it (Bf16Copies::out16), dout
// in bf16 (the projection's backward GEMM's dinp16), the output read back as its kept rounding (AttentionForward16
// writing only out16, AttentionBackward16 reading it): out16, lse, dqkv16 and the bias gradient are the bits of the
// fp32 calls on the widened qkv and dout and the widened rounding of out; with `cast` (no kept roundings) the fp32
// out, rounded as it is read, gives the same dqkv. Refused on the CPU backend, with fp32 GEMMs, off the tensor-core
// path (D = 24), and with both or neither of out and its rounding.
TEST_CASE("cuda backend: attention on bf16 qkv, dout and out gives the bits of the fp32 calls on the widened values") {
  Pair p(/*bf16=*/true, Bf16Operands::kKeep), cast(/*bf16=*/true, Bf16Operands::kCast);
  REQUIRE(p.gpu->bf16_activations());
  REQUIRE(cast.gpu->bf16_activations());
  const int64_t B = 2, T = 37, H = 2, D = 16, window = 5, N = B * T, IC = 20, OC = 3 * H * D, n_out = N * H * D;
  const std::vector<float> bias_h = Random(OC, 53, -1.0f, 1.0f);
  const std::vector<uint16_t> dout16_h = Round16(Random(n_out, 54));
  float* inp = p.On(*p.gpu, Random(N * IC, 51));
  float* w = p.On(*p.gpu, Random(OC * IC, 52));
  float* bias = p.On(*p.gpu, bias_h);
  uint16_t* qkv16 = p.On(*p.gpu, std::vector<uint16_t>(N * OC));
  ops::Bf16Copies kc;
  kc.out16 = qkv16;
  REQUIRE(p.gpu->MatmulForward(nullptr, inp, w, nullptr, N, IC, OC, kc).ok());
  const std::vector<uint16_t> qkv16_h = p.Get(*p.gpu, qkv16, N * OC);
  float* widened = p.On(*p.gpu, Widen16(qkv16_h));
  float* dout_w = p.On(*p.gpu, Widen16(dout16_h));
  uint16_t* dout16 = p.On(*p.gpu, dout16_h);

  // The oracle: fp32 calls on the widened values, the backward reading out widened from its rounding.
  float* out = p.On(*p.gpu, std::vector<float>(n_out));
  float* lse = p.On(*p.gpu, std::vector<float>(B * H * T));
  float* dqkv = p.On(*p.gpu, std::vector<float>(N * OC));
  uint16_t* dqkv16 = p.On(*p.gpu, std::vector<uint16_t>(N * OC));
  float* dbias = p.On(*p.gpu, std::vector<float>(OC));
  REQUIRE(p.gpu->AttentionForward(out, lse, widened, bias, B, T, H, D, window, nullptr).ok());
  const std::vector<uint16_t> out16_want = Round16(p.Get(*p.gpu, out, n_out));
  float* out_w = p.On(*p.gpu, Widen16(out16_want));
  REQUIRE(p.gpu->AttentionBackward(dqkv, dout_w, widened, bias, out_w, lse, B, T, H, D, window, dqkv16, dbias).ok());

  // keep: only out16 written, read back by the backward.
  uint16_t* out16 = p.On(*p.gpu, std::vector<uint16_t>(n_out, 0xFFFF));
  float* lse2 = p.On(*p.gpu, std::vector<float>(B * H * T));
  uint16_t* dqkv16_2 = p.On(*p.gpu, std::vector<uint16_t>(N * OC, 0xFFFF));
  float* dbias2 = p.On(*p.gpu, std::vector<float>(OC));
  REQUIRE(p.gpu->AttentionForward16(nullptr, lse2, qkv16, bias, B, T, H, D, window, out16).ok());
  REQUIRE(p.gpu
              ->AttentionBackward16(nullptr, dout16, qkv16, bias, nullptr, out16, lse2, B, T, H, D, window, dqkv16_2,
                                    dbias2)
              .ok());
  CHECK(p.Get(*p.gpu, out16, n_out) == out16_want);
  CHECK(p.Get(*p.gpu, lse2, B * H * T) == p.Get(*p.gpu, lse, B * H * T));
  CHECK(p.Get(*p.gpu, dqkv16_2, N * OC) == p.Get(*p.gpu, dqkv16, N * OC));
  CHECK(p.Get(*p.gpu, dbias2, OC) == p.Get(*p.gpu, dbias, OC));
  CHECK(p.Get(*p.gpu, dbias2, OC) != std::vector<float>(OC));
  // Both or neither of out and its rounding: refused.
  CHECK(p.gpu->AttentionBackward16(nullptr, dout16, qkv16, bias, out, out16, lse2, B, T, H, D, window, dqkv16_2, dbias2)
            .code() == Code::kInvalidArgument);
  CHECK(p.gpu
            ->AttentionBackward16(nullptr, dout16, qkv16, bias, nullptr, nullptr, lse2, B, T, H, D, window, dqkv16_2,
                                  dbias2)
            .code() == Code::kInvalidArgument);

  // cast: the fp32 out written and rounded as the backward reads it; fp32 dqkv.
  uint16_t* c_qkv16 = cast.On(*cast.gpu, qkv16_h);
  uint16_t* c_dout16 = cast.On(*cast.gpu, dout16_h);
  float* c_bias = cast.On(*cast.gpu, bias_h);
  float* c_out = cast.On(*cast.gpu, std::vector<float>(n_out));
  float* c_lse = cast.On(*cast.gpu, std::vector<float>(B * H * T));
  float* c_dqkv = cast.On(*cast.gpu, std::vector<float>(N * OC));
  float* c_dbias = cast.On(*cast.gpu, std::vector<float>(OC));
  REQUIRE(cast.gpu->AttentionForward16(c_out, c_lse, c_qkv16, c_bias, B, T, H, D, window, nullptr).ok());
  REQUIRE(cast.gpu
              ->AttentionBackward16(c_dqkv, c_dout16, c_qkv16, c_bias, c_out, nullptr, c_lse, B, T, H, D, window,
                                    nullptr, c_dbias)
              .ok());
  CHECK(cast.Get(*cast.gpu, c_out, n_out) == p.Get(*p.gpu, out, n_out));
  CHECK(cast.Get(*cast.gpu, c_dqkv, N * OC) == p.Get(*p.gpu, dqkv, N * OC));
  CHECK(cast.Get(*cast.gpu, c_dbias, OC) == p.Get(*p.gpu, dbias, OC));

  Pair fp32(/*bf16=*/false);
  struct Refused {
    Pair* pair;
    ops::Backend* be;
    int64_t D;
  };
  for (const Refused r :
       {Refused{&p, p.cpu.get(), 16}, Refused{&fp32, fp32.gpu.get(), 16}, Refused{&p, p.gpu.get(), 24}}) {
    CAPTURE(r.be->name());
    CAPTURE(r.D);
    float* o = r.pair->On(*r.be, std::vector<float>(3 * 24));
    CHECK(r.be->AttentionForward16(o, o, o, nullptr, 1, 1, 1, r.D, 0, nullptr).code() == Code::kFailedPrecondition);
    CHECK(r.be->AttentionBackward16(o, o, o, nullptr, o, nullptr, o, 1, 1, 1, r.D, 0, nullptr, nullptr).code() ==
          Code::kFailedPrecondition);
  }
}

// The bf16 training path's attention buffers on a pair's GPU: qkv16 and dout16 as given, out16 and dqkv16 all NaN
// (0xFFFF) and lse -1, so that whatever a call leaves unwritten shows.
struct Attention16 {
  uint16_t *qkv16, *dout16, *out16, *dqkv16;
  float* lse;
  Attention16(Pair& p, const std::vector<uint16_t>& qkv_h, const std::vector<uint16_t>& dout_h, int64_t n_lse)
      : qkv16(p.On(*p.gpu, qkv_h)),
        dout16(p.On(*p.gpu, dout_h)),
        out16(p.On(*p.gpu, std::vector<uint16_t>(dout_h.size(), 0xFFFF))),
        dqkv16(p.On(*p.gpu, std::vector<uint16_t>(qkv_h.size(), 0xFFFF))),
        lse(p.On(*p.gpu, std::vector<float>(static_cast<size_t>(n_lse), -1.0f))) {}
  // The training path's forward (out16 and lse written, no qkv bias) and backward (dqkv16 written, the qkv bias
  // gradient accumulated into dbias unless null) on the backend.
  void Run(ops::Backend& be, int64_t B, int64_t T, int64_t H, int64_t D, int64_t window, float* dbias) const {
    REQUIRE(be.AttentionForward16(nullptr, lse, qkv16, nullptr, B, T, H, D, window, out16).ok());
    REQUIRE(
        be.AttentionBackward16(nullptr, dout16, qkv16, nullptr, nullptr, out16, lse, B, T, H, D, window, dqkv16, dbias)
            .ok());
  }
};

// runtime.attention_kernels: cudnn (lib/cuda/cudnn_sdpa.h). The emulator cannot run cuDNN: UseCudnnAttention is
// refused there, naming the flavor. On a GPU the bf16 training path (AttentionForward16 writing only out16, no qkv
// bias; AttentionBackward16 reading out16, writing dqkv16 and the qkv bias gradient) goes through cuDNN's fused
// attention and must agree with megascale's kernels on the same bf16 inputs — cuDNN's own out16, dQ, dK and dV (its
// first-call check kept from replacing them; each part checked and reported on its own) within bf16 rounding, lse
// (the log-sum-exp either backward recomputes P from) within 1e-3, the bias gradient within 3e-2 — on odd shapes
// (cuDNN <= 9.15 builds the backward's padding-mask form there), T a multiple of 128 (the plain form), a window and
// head dims 32, 64, 128; each shape on backends of its own (a plan that fails on one shape turns cuDNN off for its
// backend: the next shape still gets its own result); every call taken by cuDNN (GetAttentionStats: no silent
// fallback), and a call with the qkv bias to add falls back to megascale's kernel, counted with its reason.
TEST_CASE("cuda backend: the attention forward by cuDNN's fused attention (runtime.attention_kernels: cudnn)") {
  {
    Pair cud(/*bf16=*/true, Bf16Operands::kKeep);
    const Status enabled = UseCudnnAttention(*cud.gpu);
    if (LinkedFlavor() == Flavor::kEmulated) {
      CHECK(enabled.code() == Code::kUnimplemented);
      CHECK(enabled.message().find("emulated") != std::string::npos);
      return;
    }
    REQUIRE_MESSAGE(enabled.ok(), enabled.ToString());
    CHECK(UseCudnnAttention(*cud.cpu).code() == Code::kInvalidArgument);
  }
  // cuDNN's own outputs are compared here: its first-call check (which would replace a wrong result by megascale's
  // and hide it) is made to agree always for this case; the case further down tests the check.
  struct Rtol {  // restored however the case ends
    double was = CudnnCheckTolerance();
    ~Rtol() { SetCudnnCheckTolerance(was); }
  } restore;
  SetCudnnCheckTolerance(1e30);
  // max |a - b| <= rtol * max |b| + atol (a NaN in a: not close)
  auto close = [](const char* what, const std::vector<float>& a, const std::vector<float>& b, float rtol, float atol) {
    float worst = 0, scale = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      worst = std::isnan(a[i]) ? INFINITY : std::max(worst, std::fabs(a[i] - b[i]));
      scale = std::max(scale, std::fabs(b[i]));
    }
    INFO(what << ": max |cuDNN - megascale| " << worst << ", max |megascale| " << scale);
    CHECK(worst <= rtol * scale + atol);
  };
  struct Shape {
    int64_t B, T, H, D, window;
  };
  const Shape shapes[] = {{2, 70, 3, 64, 0},  {1, 129, 2, 128, 0}, {2, 300, 2, 64, 128}, {1, 77, 4, 32, 0},
                          {2, 256, 3, 64, 0}, {1, 384, 2, 128, 0}, {2, 256, 2, 64, 100}};
  for (const Shape& sh : shapes) {
    CAPTURE(sh.B);
    CAPTURE(sh.T);
    CAPTURE(sh.H);
    CAPTURE(sh.D);
    CAPTURE(sh.window);
    Pair ours(/*bf16=*/true, Bf16Operands::kKeep), cud(/*bf16=*/true, Bf16Operands::kKeep);
    REQUIRE(UseCudnnAttention(*cud.gpu).ok());
    const int64_t B = sh.B, T = sh.T, H = sh.H, D = sh.D, w = sh.window, n_qkv = B * T * 3 * H * D,
                  n_out = B * T * H * D, n_lse = B * H * T;
    const std::vector<uint16_t> qkv_h = Round16(Random(n_qkv, 71, -2.0f, 2.0f)), dout_h = Round16(Random(n_out, 72));
    std::vector<float> got[2][4];  // [ours, cudnn][out, lse, dqkv, qkv bias gradient]
    Pair* pairs[2] = {&ours, &cud};
    for (int k = 0; k < 2; ++k) {
      Pair& p = *pairs[k];
      const Attention16 a(p, qkv_h, dout_h, n_lse);
      float* dbias = p.On(*p.gpu, std::vector<float>(3 * H * D, 0.5f));  // accumulated into
      a.Run(*p.gpu, B, T, H, D, w, dbias);
      got[k][0] = Widen16(p.Get(*p.gpu, a.out16, n_out));
      got[k][1] = p.Get(*p.gpu, a.lse, n_lse);
      got[k][2] = Widen16(p.Get(*p.gpu, a.dqkv16, n_qkv));
      got[k][3] = p.Get(*p.gpu, dbias, 3 * H * D);
    }
    close("out", got[1][0], got[0][0], 2e-2f, 1e-2f);
    close("lse", got[1][1], got[0][1], 1e-3f, 1e-3f);
    for (int part = 0; part < 3; ++part) {  // dqkv (B, T, 3, H, D): dQ, dK, dV
      std::vector<float> mine, theirs;
      for (int64_t i = 0; i < n_qkv; ++i) {
        if ((i / (H * D)) % 3 != part) continue;
        theirs.push_back(got[1][2][i]);
        mine.push_back(got[0][2][i]);
      }
      close(part == 0 ? "dQ" : part == 1 ? "dK" : "dV", theirs, mine, 3e-2f, 1e-2f);
    }
    close("qkv bias gradient", got[1][3], got[0][3], 3e-2f, 1e-2f);
    const AttentionStats st = GetAttentionStats(*cud.gpu);
    INFO("first fallback: " << st.cudnn_note);  // why cuDNN did not run
    CHECK(st.cudnn_forward == 1);
    CHECK(st.cudnn_backward == 1);
    CHECK(st.cudnn_fallback == 0);
    CHECK(GetAttentionStats(*ours.gpu).cudnn_forward == 0);
  }
  // The qkv bias to add: megascale's kernel, counted, the reason kept.
  Pair cud(/*bf16=*/true, Bf16Operands::kKeep);
  REQUIRE(UseCudnnAttention(*cud.gpu).ok());
  const int64_t B = 1, T = 40, H = 2, D = 64;
  uint16_t* qkv16 = cud.On(*cud.gpu, Round16(Random(B * T * 3 * H * D, 73)));
  float* bias = cud.On(*cud.gpu, Random(3 * H * D, 74));
  uint16_t* out16 = cud.On(*cud.gpu, std::vector<uint16_t>(B * T * H * D));
  float* lse = cud.On(*cud.gpu, std::vector<float>(B * H * T));
  REQUIRE(cud.gpu->AttentionForward16(nullptr, lse, qkv16, bias, B, T, H, D, 0, out16).ok());
  const AttentionStats st = GetAttentionStats(*cud.gpu);
  CHECK(st.cudnn_forward == 0);
  CHECK(st.cudnn_fallback == 1);
  CHECK(st.cudnn_note.find("qkv bias") != std::string::npos);
}

// cuDNN's results must not depend on what its workspace and row-term scratch held (SetCudnnScratchFill: zeros before
// the first call of a shape, 0x5A bytes — ~1.5e16 read as fp32 or bf16 — before the second; the workspace holds dQ's
// fp32 accumulator, which cuDNN >= 9.6 initializes itself): at 2829a9d, whose backward graph was wrong, such a
// pattern showed up in dqkv on an H200. Out and lse of the two calls the same bits, dqkv within a few bf16 roundings
// (dQ is summed over the key blocks with atomics, in no fixed order), every call cuDNN's, no first-call check
// disagreeing.
TEST_CASE("cuda backend: cuDNN's attention does not read scratch it did not write") {
  if (LinkedFlavor() == Flavor::kEmulated) return;  // no cuDNN (the case above checks the refusal)
  Pair cud(/*bf16=*/true, Bf16Operands::kKeep);
  REQUIRE(UseCudnnAttention(*cud.gpu).ok());
  struct Fill {  // off again however the case ends
    ~Fill() { SetCudnnScratchFill(-1); }
  } restore;
  struct Shape {
    int64_t B, T, H, D, window;
  };
  const Shape shapes[] = {{2, 70, 3, 64, 0}, {1, 129, 2, 128, 0}, {2, 300, 2, 64, 128}};
  for (const Shape& sh : shapes) {
    CAPTURE(sh.T);
    CAPTURE(sh.D);
    const int64_t B = sh.B, T = sh.T, H = sh.H, D = sh.D, n_qkv = B * T * 3 * H * D, n_out = B * T * H * D,
                  n_lse = B * H * T;
    const Attention16 a(cud, Round16(Random(n_qkv, 91, -2.0f, 2.0f)), Round16(Random(n_out, 92)), n_lse);
    std::vector<uint16_t> out[2], dqkv[2];
    std::vector<float> lse[2];
    for (int call = 0; call < 2; ++call) {
      SetCudnnScratchFill(call == 0 ? 0x00 : 0x5A);
      a.Run(*cud.gpu, B, T, H, D, sh.window, nullptr);
      out[call] = cud.Get(*cud.gpu, a.out16, n_out);
      lse[call] = cud.Get(*cud.gpu, a.lse, n_lse);
      dqkv[call] = cud.Get(*cud.gpu, a.dqkv16, n_qkv);
    }
    CHECK(out[1] == out[0]);
    CHECK(lse[1] == lse[0]);
    const std::vector<float> d0 = Widen16(dqkv[0]), d1 = Widen16(dqkv[1]);
    float worst = 0, scale = 0;
    for (size_t i = 0; i < d0.size(); ++i) {
      worst = std::isnan(d1[i]) ? INFINITY : std::max(worst, std::fabs(d1[i] - d0[i]));
      scale = std::max(scale, std::fabs(d0[i]));
    }
    INFO("dqkv: max |second - first| " << worst << ", max |first| " << scale);
    CHECK(worst <= 1e-2f * scale + 1e-3f);
  }
  const AttentionStats st = GetAttentionStats(*cud.gpu);
  INFO("note: " << st.cudnn_note);
  CHECK(st.cudnn_disagreed == 0);
  CHECK(st.cudnn_forward == 6);
  CHECK(st.cudnn_backward == 6);
  CHECK(st.cudnn_fallback == 0);
}

// The check of cuDNN's first call per shape (SetCudnnCheckTolerance): where cuDNN disagrees with megascale's
// kernels — forced here by a negative tolerance — the call's outputs are megascale's, bit for bit, cuDNN is left
// off for the calls after it (counted as megascale's), and the disagreement is counted and named.
TEST_CASE("cuda backend: cuDNN's attention disagreeing with megascale's kernels is replaced and left off") {
  Pair ours(/*bf16=*/true, Bf16Operands::kKeep), cud(/*bf16=*/true, Bf16Operands::kKeep);
  if (LinkedFlavor() == Flavor::kEmulated) {
    CHECK(UseCudnnAttention(*cud.gpu).code() == Code::kUnimplemented);
    return;
  }
  REQUIRE(UseCudnnAttention(*cud.gpu).ok());
  struct Rtol {  // restored however the case ends
    double was = CudnnCheckTolerance();
    ~Rtol() { SetCudnnCheckTolerance(was); }
  } restore;
  SetCudnnCheckTolerance(-1.0);
  const int64_t B = 2, T = 70, H = 3, D = 64, n_qkv = B * T * 3 * H * D, n_out = B * T * H * D, n_lse = B * H * T;
  const std::vector<uint16_t> qkv_h = Round16(Random(n_qkv, 81, -2.0f, 2.0f)), dout_h = Round16(Random(n_out, 82));
  std::vector<uint16_t> out[2][2], dqkv[2][2];  // [ours, cud][first call, second call]
  std::vector<float> lse[2][2];
  Pair* pairs[2] = {&ours, &cud};
  for (int k = 0; k < 2; ++k) {
    Pair& p = *pairs[k];
    const Attention16 a(p, qkv_h, dout_h, n_lse);
    for (int call = 0; call < 2; ++call) {
      a.Run(*p.gpu, B, T, H, D, 0, nullptr);
      out[k][call] = p.Get(*p.gpu, a.out16, n_out);
      lse[k][call] = p.Get(*p.gpu, a.lse, n_lse);
      dqkv[k][call] = p.Get(*p.gpu, a.dqkv16, n_qkv);
    }
  }
  for (int call = 0; call < 2; ++call) {
    CAPTURE(call);
    CHECK(out[1][call] == out[0][call]);
    CHECK(lse[1][call] == lse[0][call]);
    CHECK(dqkv[1][call] == dqkv[0][call]);
  }
  const AttentionStats st = GetAttentionStats(*cud.gpu);
  CHECK(st.cudnn_forward == 1);   // cuDNN ran the first forward; the check replaced its outputs
  CHECK(st.cudnn_backward == 0);  // and was off from then on
  CHECK(st.cudnn_disagreed == 1);
  CHECK(st.cudnn_fallback == 3);  // the first backward, the second forward and backward
  CHECK(st.cudnn_note.find("disagrees with megascale's kernels") != std::string::npos);
  CHECK(st.cudnn_note.find("forward") != std::string::npos);
}

// The tensor-core attention backward keeps dS in a workspace between its kernels (5 products) where its tiles take at
// most the backend's cap (runtime.attention_stored_ds: 1 GiB; 0 when off), else forms it again (7): here 2 x 2 heads
// of T = 70, 2 64-row tiles, 3 (key, query) tile pairs of 8 KiB each = 98,304 bytes. GetAttentionStats counts each
// kind; the outputs agree — under the emulator bit for bit (the register softmax sums S and its transpose alike).
TEST_CASE("cuda backend: the attention backward keeps dS where its tiles fit the cap (runtime.attention_stored_ds)") {
  const int64_t B = 2, T = 70, H = 2, D = 16, window = 0, N = B * T, n_qkv = N * 3 * H * D, n_out = N * H * D;
  const int64_t tile_bytes = 2 * 2 * 3 * 64 * 64 * 2;
  const std::vector<float> qkv_h = Random(n_qkv, 71, -2.0f, 2.0f), dout_h = Random(n_out, 72);
  struct Run {
    std::vector<float> dqkv;
    AttentionStats stats;
  };
  auto run = [&](int64_t cap) {
    Pair p(/*bf16=*/true, Bf16Operands::kKeep, cap);
    float* qkv = p.On(*p.gpu, qkv_h);
    float* dout = p.On(*p.gpu, dout_h);
    float* out = p.On(*p.gpu, std::vector<float>(n_out));
    float* lse = p.On(*p.gpu, std::vector<float>(B * H * T));
    float* dqkv = p.On(*p.gpu, std::vector<float>(n_qkv));
    REQUIRE(p.gpu->AttentionForward(out, lse, qkv, nullptr, B, T, H, D, window, nullptr).ok());
    REQUIRE(p.gpu->AttentionBackward(dqkv, dout, qkv, nullptr, out, lse, B, T, H, D, window, nullptr, nullptr).ok());
    return Run{p.Get(*p.gpu, dqkv, n_qkv), GetAttentionStats(*p.gpu)};
  };
  const Run dflt = run(kAttentionDsMaxBytes), fits = run(tile_bytes), above = run(tile_bytes - 1), off = run(0);
  for (const Run* r : {&dflt, &fits}) {
    CHECK(r->stats.stored_ds == 1);
    CHECK(r->stats.recompute == 0);
  }
  for (const Run* r : {&above, &off}) {
    CHECK(r->stats.stored_ds == 0);
    CHECK(r->stats.recompute == 1);
  }
  ExpectClose(dflt.dqkv, off.dqkv, 2e-2f, 2e-2f, "dqkv, dS kept vs formed again");
  CHECK(fits.dqkv == dflt.dqkv);
  CHECK(above.dqkv == off.dqkv);
  if (LinkedFlavor() == Flavor::kEmulated) CHECK(dflt.dqkv == off.dqkv);
  Pair cpu_only;
  CHECK(GetAttentionStats(*cpu_only.cpu).stored_ds == 0);
}

// Refused: kept roundings of out / dqkv where nothing is kept (bf16_operands: cast, the CPU backend), the qkv bias
// and its gradient off the tensor-core path (D = 24) and on the CPU, and a null dqkv on the fp32 path (which writes
// it) even with its rounding asked for.
TEST_CASE("cuda backend: what the attention refuses") {
  Pair p(/*bf16=*/true);
  struct Call {
    ops::Backend* be;
    int64_t D;
    bool rounded, bias;
  };
  for (const Call c : {Call{p.gpu.get(), 16, true, false}, Call{p.gpu.get(), 24, false, true},
                       Call{p.cpu.get(), 16, true, false}, Call{p.cpu.get(), 16, false, true}}) {
    CAPTURE(c.be->name());
    CAPTURE(c.D);
    float* x = p.On(*c.be, std::vector<float>(3 * c.D));
    float* o = p.On(*c.be, std::vector<float>(c.D));
    void* o16 = c.rounded ? o : nullptr;
    const float* b = c.bias ? x : nullptr;
    CHECK(c.be->AttentionForward(o, o, x, b, 1, 1, 1, c.D, 0, o16).code() == Code::kFailedPrecondition);
    CHECK(c.be->AttentionBackward(x, o, x, b, o, o, 1, 1, 1, c.D, 0, o16, nullptr).code() == Code::kFailedPrecondition);
    if (c.bias) {
      CHECK(c.be->AttentionBackward(x, o, x, nullptr, o, o, 1, 1, 1, c.D, 0, nullptr, x).code() ==
            Code::kFailedPrecondition);
    }
  }
  Pair keep(/*bf16=*/true, Bf16Operands::kKeep);
  float* x = keep.On(*keep.gpu, std::vector<float>(3 * 24));
  float* o = keep.On(*keep.gpu, std::vector<float>(3 * 24));
  CHECK(keep.gpu->AttentionBackward(nullptr, o, x, nullptr, o, o, 1, 1, 1, 24, 0, o, nullptr).code() ==
        Code::kInvalidArgument);
}

// The residual add fused into the LayerNorm (Backend::ResidualLayerNormForward): the CUDA kernel within the
// kernels' tolerance of the CPU backend (whose default runs the two ops), and the bits of the CUDA backend's own
// ResidualAdd then LayerNormForward.
TEST_CASE("cuda backend (emulated): residual add + LayerNorm forward, fused") {
  Pair p;
  const int64_t R = 37, C = 45;
  const Inputs in = {Random(R * C, 1),
                     Random(R * C, 2),
                     Random(C, 3),
                     Random(C, 4),
                     Random(C, 5),
                     Random(C, 6),
                     std::vector<float>(R * C),
                     std::vector<float>(R * C),
                     std::vector<float>(R),
                     std::vector<float>(R)};
  Compare(
      p, in,
      [&](ops::Backend& be, std::vector<float*>& t) {
        REQUIRE(be.ResidualLayerNormForward(t[6], t[0], t[1], t[2], t[3], t[7], t[8], t[9], t[4], t[5], R, C, 1e-5f,
                                            nullptr)
                    .ok());
      },
      {{6, R * C}, {7, R * C}, {8, R}, {9, R}}, 1e-5f, 1e-6f, "residual + LayerNorm");
  std::vector<float*> t;
  for (const auto& v : in) t.push_back(p.On(*p.gpu, v));
  float* res2 = p.On(*p.gpu, std::vector<float>(R * C));
  float* out2 = p.On(*p.gpu, std::vector<float>(R * C));
  float* mean2 = p.On(*p.gpu, std::vector<float>(R));
  float* rstd2 = p.On(*p.gpu, std::vector<float>(R));
  REQUIRE(
      p.gpu->ResidualLayerNormForward(t[6], t[0], t[1], t[2], t[3], t[7], t[8], t[9], t[4], t[5], R, C, 1e-5f, nullptr)
          .ok());
  REQUIRE(p.gpu->ResidualAdd(res2, t[0], t[1], t[2], t[3], R, C).ok());
  REQUIRE(p.gpu->LayerNormForward(out2, mean2, rstd2, res2, t[4], t[5], R, C, 1e-5f).ok());
  CHECK(p.Get(*p.gpu, t[6], R * C) == p.Get(*p.gpu, res2, R * C));
  CHECK(p.Get(*p.gpu, t[7], R * C) == p.Get(*p.gpu, out2, R * C));
  CHECK(p.Get(*p.gpu, t[9], R) == p.Get(*p.gpu, rstd2, R));
}

TEST_CASE("cuda backend (emulated): residual, bias, positions, memory helpers, norms (rtol 1e-5)") {
  Pair p;
  const int64_t R = 13, C = 21, T = 5;
  Compare(
      p,
      {Random(R * C, 1), Random(R * C, 2), Random(C, 3), Random(C, 4), std::vector<float>(R * C), Random(C, 5),
       Random(T * C, 6), Random(R * C, 7), Random(T * C, 8), Random(R * C, 9)},
      [&](ops::Backend& be, std::vector<float*>& t) {
        REQUIRE(be.ResidualAdd(t[4], t[0], t[1], t[2], t[3], R, C).ok());
        REQUIRE(be.ResidualAdd(t[0], t[0], t[1], t[2], nullptr, R, C).ok());  // in place
        REQUIRE(be.BiasGrad(t[5], t[1], R, C).ok());
        REQUIRE(be.AddPositions(t[7], t[6], R, C, T, 3).ok());
        REQUIRE(be.PositionsBackward(t[8], t[1], R, C, T, 3).ok());
        REQUIRE(be.AddRowBias(t[9], t[2], R, C).ok());
        REQUIRE(be.AddInPlace(t[9], t[1], R * C).ok());
        REQUIRE(be.Scale(t[9], 0.5f, R * C).ok());
        REQUIRE(be.Add(t[1], t[1], t[9], R * C).ok());
        REQUIRE(be.Copy(t[2], t[3], sizeof(float) * C).ok());
        REQUIRE(be.Zero(t[3], sizeof(float) * 3).ok());
      },
      {{0, R * C}, {1, R * C}, {2, C}, {3, C}, {4, R * C}, {5, C}, {7, R * C}, {8, T * C}, {9, R * C}}, 1e-5f, 1e-6f,
      "pointwise");
  // Sums of squares of several vectors, in double.
  const auto x1 = Random(1000, 1), x2 = Random(3, 2), x3 = Random(5000, 3);
  const float* xc[] = {p.On(*p.cpu, x1), p.On(*p.cpu, x2), p.On(*p.cpu, x3)};
  const float* xg[] = {p.On(*p.gpu, x1), p.On(*p.gpu, x2), p.On(*p.gpu, x3)};
  const int64_t ns[] = {1000, 3, 5000};
  double oc[3], og[3];
  REQUIRE(p.cpu->SumSquares(xc, ns, 3, oc).ok());
  REQUIRE(p.gpu->SumSquares(xg, ns, 3, og).ok());
  for (int i = 0; i < 3; ++i) CHECK(og[i] == doctest::Approx(oc[i]).epsilon(1e-12));
}

// The bf16 tensor-parallel sums' rounding and widening (ShardSpec::tp_reduce_bf16) on both backends: the same bits,
// ties to even included (every 4th value lies exactly halfway between two bf16 neighbours).
TEST_CASE("cuda backend (emulated): RoundBf16 and WidenBf16 give the CPU backend's bits") {
  Pair p;
  const int64_t n = 1001;
  std::vector<float> x = Random(n, 31);
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::ldexp(x[i], static_cast<int>(i % 11) - 5);
    if (i % 4 == 0 && x[i] != 0.0f) {  // a tie: a bf16 value plus half of its last place
      const float b = Bf16ToFloat(FloatToBf16(x[i]));
      x[i] = b + std::copysign(std::ldexp(1.0f, std::ilogb(b) - 8), b);
    }
  }
  Compare(
      p, {x, std::vector<float>(n), std::vector<float>(n)},
      [&](ops::Backend& be, std::vector<float*>& t) {
        REQUIRE(be.RoundBf16(t[1], t[0], n).ok());  // n bf16 in the first half of t[1]
        REQUIRE(be.WidenBf16(t[2], t[1], n).ok());
      },
      {{2, n}}, 0.0f, 0.0f, "bf16 round trip");
  std::vector<float> back(n);
  for (int64_t i = 0; i < n; ++i) back[i] = Bf16ToFloat(FloatToBf16(x[i]));
  const float* g = p.On(*p.gpu, x);
  float* g16 = p.On(*p.gpu, std::vector<float>(n));
  float* gw = p.On(*p.gpu, std::vector<float>(n));
  REQUIRE(p.gpu->RoundBf16(g16, g, n).ok());
  REQUIRE(p.gpu->WidenBf16(gw, g16, n).ok());
  std::vector<float> got(n);
  REQUIRE(p.gpu->CopyToHost(got.data(), gw, sizeof(float) * n).ok());
  CHECK(got == back);
}

TEST_CASE("cuda backend (emulated): multi-tensor AdamW and LAMB (rtol 1e-5)") {
  Pair p;
  const ops::AdamParams decay{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f}, plain{1e-2f, 0.9f, 0.95f, 1e-8f, 0.0f};
  const int64_t n1 = 1, n2 = 700, n3 = 4099;
  Inputs in = {Random(n1, 1),          Random(n1, 2),          Random(n1, 3, 0, 1),   Random(n1, 4, 0, 1),
               Random(n2, 5),          Random(n2, 6),          Random(n2, 7, 0, 1),   Random(n2, 8, 0, 1),
               Random(n3, 9),          Random(n3, 10),         Random(n3, 11, 0, 1),  Random(n3, 12, 0, 1),
               std::vector<float>(n1), std::vector<float>(n2), std::vector<float>(n3)};
  Compare(
      p, in,
      [&](ops::Backend& be, std::vector<float*>& t) {
        const ops::AdamWTensor list[] = {{t[0], t[1], t[2], t[3], n1, decay},
                                         {t[4], t[5], t[6], t[7], n2, decay},
                                         {t[8], t[9], t[10], t[11], n3, plain}};
        for (int64_t step = 1; step <= 3; ++step) REQUIRE(be.AdamW(list, 3, step).ok());
        const ops::LambTensor lamb[] = {{t[12], t[0], t[1], t[2], t[3], n1, plain},
                                        {t[13], t[4], t[5], t[6], t[7], n2, decay},
                                        {t[14], t[8], t[9], t[10], t[11], n3, decay}};
        REQUIRE(be.LambDirection(lamb, 3, 4).ok());
        REQUIRE(be.LambApply(t[4], t[13], n2, 1e-2f, 0.7f).ok());
      },
      {{0, n1}, {2, n1}, {3, n1}, {4, n2}, {6, n2}, {7, n2}, {8, n3}, {10, n3}, {11, n3}, {12, n1}, {13, n2}, {14, n3}},
      1e-5f, 1e-6f, "optimizers");
}

struct GptShape {
  int hidden, heads, ffn, vocab, seq, window, B;
};

// One forward + backward of a two-layer GPT of shape sh on the CPU backend and on p.gpu (same seed and batch): the
// losses within loss_rtol, then check(name, cpu gradient, gpu gradient) for every parameter tensor.
template <class Check>
void CompareGptGradients(Pair& p, config::BlockKind block, const GptShape& sh, float init_std, double loss_rtol,
                         const Check& check) {
  config::ModelSpec m = SpecOf(2, sh.hidden, sh.heads, sh.ffn, sh.vocab, sh.seq);
  m.block = block;
  m.window = sh.window;
  m.init_std = init_std;
  const int B = sh.B;
  CAPTURE(sh.hidden);
  std::vector<int32_t> inputs, targets;
  Rng rng(5);
  for (int i = 0; i < B * m.seq_len; ++i) {
    inputs.push_back(static_cast<int32_t>(rng.NextBelow(m.vocab)));
    targets.push_back(i % 5 == 4 ? -1 : static_cast<int32_t>(rng.NextBelow(m.vocab)));
  }
  auto cpu = model::Gpt::Create(m, {}, B, 11, p.cpu_dev.get(), {}, p.cpu.get());
  auto gpu = model::Gpt::Create(m, {}, B, 11, p.gpu_dev.get(), {}, p.gpu.get());
  REQUIRE(cpu.ok());
  REQUIRE_MESSAGE(gpu.ok(), gpu.status().ToString());
  auto lc = (*cpu)->Forward(inputs.data(), targets.data());
  auto lg = (*gpu)->Forward(inputs.data(), targets.data());
  REQUIRE(lc.ok());
  REQUIRE_MESSAGE(lg.ok(), lg.status().ToString());
  CHECK(*lg == doctest::Approx(*lc).epsilon(loss_rtol));
  REQUIRE((*cpu)->Backward(0.1f).ok());
  REQUIRE((*gpu)->Backward(0.1f).ok());
  const auto n = static_cast<size_t>((*cpu)->num_params());
  const auto gc = p.Get(*p.cpu, (*cpu)->grad_data(), n), gg = p.Get(*p.gpu, (*gpu)->grad_data(), n);
  for (const auto& info : (*cpu)->params()) {
    CAPTURE(info.name);
    const std::vector<float> a(gc.begin() + info.offset, gc.begin() + info.offset + info.numel),
        b(gg.begin() + info.offset, gg.begin() + info.offset + info.numel);
    check(info.name, a, b);
  }
}

TEST_CASE(
    "cuda backend (emulated): the GPT's loss and every gradient match the CPU backend (fp32 GEMMs; rtol 1e-3, atol "
    "1e-3 x the tensor's largest |gradient|)") {
  for (auto block : {config::BlockKind::kParallel, config::BlockKind::kSequential})
    for (GptShape sh : {GptShape{12, 3, 20, 13, 7, 3, 2}, GptShape{64, 4, 256, 256, 32, 12, 1}}) {
      Pair p;
      CompareGptGradients(p, block, sh, 0.3f, 1e-5, [](const std::string&, const auto& a, const auto& b) {
        float scale = 0;
        for (float v : a) scale = std::max(scale, std::fabs(v));
        // Gradient elements are sums with cancellation: small ones are held to the tensor's scale.
        ExpectClose(a, b, 1e-3f, 1e-3f * scale + 1e-7f, "gradient");
      });
    }
}

// bf16 GEMMs with kept operands (the default GPU path: D = 16 takes the tensor-core attention, which adds the qkv
// bias and sums its gradient, and the fused bias + GeLU sums the fc bias gradient): every gradient tensor within
// a relative L2 error of 2e-2 of the CPU backend's fp32 one (bf16 operands, 2^-9 per rounding: the largest seen is
// 6.8e-3, init_std 0.05). A bias gradient left out, or summed over the wrong rows, is off by O(1).
TEST_CASE("cuda backend (emulated): with bf16 GEMMs and kept operands every GPT gradient is near the CPU backend's") {
  for (auto block : {config::BlockKind::kParallel, config::BlockKind::kSequential}) {
    Pair p(/*bf16=*/true, Bf16Operands::kKeep);
    CompareGptGradients(p, block, GptShape{64, 4, 256, 256, 32, 12, 2}, 0.05f, 1e-2,
                        [](const std::string&, const auto& a, const auto& b) {
                          double err = 0, ref = 0;
                          for (size_t i = 0; i < a.size(); ++i) {
                            err += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
                            ref += static_cast<double>(a[i]) * a[i];
                          }
                          const double rel = std::sqrt(err / std::max(ref, 1e-30));
                          if (ref > 0) CHECK(rel < 2e-2);
                        });
  }
}

float HostGelu(float v) {  // the reference op (in double)
  float out = 0;
  ops::ref::GeluForward(&out, &v, 1);
  return out;
}
float HostGeluGrad(float v) {
  float dx = 0;
  const float one = 1.0f;
  ops::ref::GeluBackward(&dx, &v, &one, 1);
  return dx;
}

// runtime.activations: bf16 at tp 1: the LayerNorm backward reads its output gradient as the GEMM wrote it, in bf16
// (LayerNormBackward16): dx, dw, db, both bias-gradient sums and (kept operands) dx16 the bits of the fp32 call on the
// widened values, with kept and with cast operands. Refused: no dout16, dsum2 without dsum, and on the backends that
// keep no bf16 activations (cuBLAS converting the operands, fp32 GEMMs, the CPU backend).
TEST_CASE("cuda backend: LayerNorm backward on a bf16 output gradient gives the bits of the fp32 call on it widened") {
  const int64_t N = 37, C = 40;
  std::vector<float> dy = Random(N * C, 61);
  std::vector<uint16_t> dy16(dy.size());
  for (size_t i = 0; i < dy.size(); ++i) dy16[i] = Round16(dy[i]);
  const std::vector<float> widened = Widen16(dy16);
  for (Bf16Operands mode : {Bf16Operands::kKeep, Bf16Operands::kCast}) {
    CAPTURE(static_cast<int>(mode));
    Pair p(/*bf16=*/true, mode);
    REQUIRE(p.gpu->bf16_activations());
    float* x = p.On(*p.gpu, Random(N * C, 62, -2.0f, 3.0f));
    float* w = p.On(*p.gpu, Random(C, 63));
    float* b = p.On(*p.gpu, Random(C, 64));
    float* out = p.On(*p.gpu, std::vector<float>(N * C));
    float* mean = p.On(*p.gpu, std::vector<float>(N));
    float* rstd = p.On(*p.gpu, std::vector<float>(N));
    REQUIRE(p.gpu->LayerNormForward(out, mean, rstd, x, w, b, N, C, 1e-5f).ok());
    float* g32 = p.On(*p.gpu, widened);
    uint16_t* g16 = p.On(*p.gpu, dy16);
    std::vector<float*> dx(2), dw(2), db(2), s1(2), s2(2);
    std::vector<uint16_t*> dx16(2);
    for (int k = 0; k < 2; ++k) {  // accumulated outputs start nonzero
      dx[k] = p.On(*p.gpu, Random(N * C, 65));
      dw[k] = p.On(*p.gpu, Random(C, 66));
      db[k] = p.On(*p.gpu, Random(C, 67));
      s1[k] = p.On(*p.gpu, Random(C, 68));
      s2[k] = p.On(*p.gpu, Random(C, 69));
      dx16[k] = p.On(*p.gpu, std::vector<uint16_t>(N * C, 0xFFFF));
    }
    const bool keep = mode == Bf16Operands::kKeep;  // dx's rounding is kept only with kept operands
    REQUIRE(p.gpu
                ->LayerNormBackward(dx[0], dw[0], db[0], g32, x, w, mean, rstd, N, C, keep ? dx16[0] : nullptr, s1[0],
                                    s2[0])
                .ok());
    REQUIRE(p.gpu
                ->LayerNormBackward16(dx[1], dw[1], db[1], g16, x, w, mean, rstd, N, C, keep ? dx16[1] : nullptr, s1[1],
                                      s2[1])
                .ok());
    CHECK(p.Get(*p.gpu, dx[1], N * C) == p.Get(*p.gpu, dx[0], N * C));
    CHECK(p.Get(*p.gpu, dx16[1], N * C) == p.Get(*p.gpu, dx16[0], N * C));
    CHECK(p.Get(*p.gpu, dw[1], C) == p.Get(*p.gpu, dw[0], C));
    CHECK(p.Get(*p.gpu, db[1], C) == p.Get(*p.gpu, db[0], C));
    CHECK(p.Get(*p.gpu, s1[1], C) == p.Get(*p.gpu, s1[0], C));
    CHECK(p.Get(*p.gpu, s2[1], C) == p.Get(*p.gpu, s2[0], C));
    CHECK(p.gpu->LayerNormBackward16(dx[1], dw[1], db[1], nullptr, x, w, mean, rstd, N, C, nullptr, nullptr, nullptr)
              .code() == Code::kInvalidArgument);
    CHECK(
        p.gpu->LayerNormBackward16(dx[1], dw[1], db[1], g16, x, w, mean, rstd, N, C, nullptr, nullptr, s2[1]).code() ==
        Code::kInvalidArgument);
  }
  Pair conv(/*bf16=*/true, Bf16Operands::kCublas), fp32;
  for (ops::Backend* be : {conv.gpu.get(), fp32.gpu.get(), fp32.cpu.get()}) {
    CAPTURE(be->name());
    Pair& owner = be == conv.gpu.get() ? conv : fp32;
    float* v = owner.On(*be, std::vector<float>(16));
    CHECK(be->LayerNormBackward16(v, v, v, v, v, v, v, v, 2, 2, nullptr, nullptr, nullptr).code() ==
          Code::kFailedPrecondition);
  }
}

// runtime.activations: bf16 at tp 1 with the sequential block: the residual add (alone, or fused into the next
// LayerNorm) reads the projection's output as its GEMM wrote it, in bf16 (ResidualAdd16, ResidualLayerNormForward16):
// the bits of the fp32 calls on the widened values (res, out, mean, rstd, and with kept operands out16), with kept and
// with cast operands. Refused: no part16, and on the backends that keep no bf16 activations.
TEST_CASE("cuda backend: the residual add on a bf16 branch output gives the bits of the fp32 calls on it widened") {
  const int64_t N = 37, C = 40;
  std::vector<float> part = Random(N * C, 71);
  std::vector<uint16_t> part16(part.size());
  for (size_t i = 0; i < part.size(); ++i) part16[i] = Round16(part[i]);
  for (Bf16Operands mode : {Bf16Operands::kKeep, Bf16Operands::kCast}) {
    CAPTURE(static_cast<int>(mode));
    Pair p(/*bf16=*/true, mode);
    const bool keep = mode == Bf16Operands::kKeep;
    float* x = p.On(*p.gpu, Random(N * C, 72, -2.0f, 3.0f));
    float* w = p.On(*p.gpu, Random(C, 73));
    float* b = p.On(*p.gpu, Random(C, 74));
    float* b1 = p.On(*p.gpu, Random(C, 75));
    float* b2 = p.On(*p.gpu, Random(C, 76));
    float* p32 = p.On(*p.gpu, Widen16(part16));
    uint16_t* p16 = p.On(*p.gpu, part16);
    std::vector<float*> res(2), out(2), mean(2), rstd(2), add(2);
    std::vector<uint16_t*> out16(2);
    for (int k = 0; k < 2; ++k) {
      res[k] = p.On(*p.gpu, std::vector<float>(N * C));
      out[k] = p.On(*p.gpu, std::vector<float>(N * C));
      mean[k] = p.On(*p.gpu, std::vector<float>(N));
      rstd[k] = p.On(*p.gpu, std::vector<float>(N));
      add[k] = p.On(*p.gpu, std::vector<float>(N * C));
      out16[k] = p.On(*p.gpu, std::vector<uint16_t>(N * C, 0xFFFF));
    }
    REQUIRE(p.gpu
                ->ResidualLayerNormForward(res[0], x, p32, b1, b2, out[0], mean[0], rstd[0], w, b, N, C, 1e-5f,
                                           keep ? out16[0] : nullptr)
                .ok());
    REQUIRE(p.gpu
                ->ResidualLayerNormForward16(res[1], x, p16, b1, b2, out[1], mean[1], rstd[1], w, b, N, C, 1e-5f,
                                             keep ? out16[1] : nullptr)
                .ok());
    REQUIRE(p.gpu->ResidualAdd(add[0], x, p32, b1, nullptr, N, C).ok());
    REQUIRE(p.gpu->ResidualAdd16(add[1], x, p16, b1, nullptr, N, C).ok());
    CHECK(p.Get(*p.gpu, res[1], N * C) == p.Get(*p.gpu, res[0], N * C));
    CHECK(p.Get(*p.gpu, out[1], N * C) == p.Get(*p.gpu, out[0], N * C));
    CHECK(p.Get(*p.gpu, mean[1], N) == p.Get(*p.gpu, mean[0], N));
    CHECK(p.Get(*p.gpu, rstd[1], N) == p.Get(*p.gpu, rstd[0], N));
    CHECK(p.Get(*p.gpu, out16[1], N * C) == p.Get(*p.gpu, out16[0], N * C));
    CHECK(p.Get(*p.gpu, add[1], N * C) == p.Get(*p.gpu, add[0], N * C));
    CHECK(p.gpu->ResidualAdd16(add[1], x, nullptr, b1, nullptr, N, C).code() == Code::kInvalidArgument);
    CHECK(p.gpu
              ->ResidualLayerNormForward16(res[1], x, nullptr, b1, b2, out[1], mean[1], rstd[1], w, b, N, C, 1e-5f,
                                           nullptr)
              .code() == Code::kInvalidArgument);
  }
  Pair conv(/*bf16=*/true, Bf16Operands::kCublas), fp32;
  for (ops::Backend* be : {conv.gpu.get(), fp32.gpu.get(), fp32.cpu.get()}) {
    CAPTURE(be->name());
    Pair& owner = be == conv.gpu.get() ? conv : fp32;
    float* v = owner.On(*be, std::vector<float>(16));
    CHECK(be->ResidualAdd16(v, v, v, v, nullptr, 2, 2).code() == Code::kFailedPrecondition);
    CHECK(be->ResidualLayerNormForward16(v, v, v, v, nullptr, v, v, v, v, v, 2, 2, 1e-5f, nullptr).code() ==
          Code::kFailedPrecondition);
  }
}

// The fc bias + GeLU in the fc GEMM (Bf16Copies::gelu16) and their gradient in the fc-proj backward GEMM
// (dgelu_aux16, dgelu_dbias), on a backend with kept operands: out16 = x w^T + b and gelu16 = gelu(x w^T + b), each
// rounded to bf16; dinp16 = gelu'(aux) (dout w) rounded, dbias += its column sums — against fp32 references within
// the bf16 roundings, by cuBLASLt's epilogues where OC is a multiple of 8 (emulated: the bits of rounding the fp32
// GEMM's sum plus the bf16 bias once) and by the fallback (GEMM, then the bias + GeLU kernel) where cuBLASLt has no
// algorithm (OC 37 emulated: an aux leading dimension not a multiple of 8; on a GPU either) — the backend's counters
// tell which ran. Refused
// without kept operands, on the CPU backend, and with a missing or extra argument.
// One GEMM with an epilogue ran, by cuBLASLt where OC is a multiple of 8 (lt). Elsewhere the emulated cuBLASLt has
// no algorithm (an aux leading dimension not a multiple of 8), so the fallback runs; the real cuBLASLt may have one
// (cuBLAS 13.1 on an H200 did, for OC 37), and either path is right there.
void CheckEpiloguePath(const EpilogueStats& before, const EpilogueStats& after, bool lt, bool bias_only = false) {
  const int64_t by_lt = bias_only ? after.bias_cublaslt - before.bias_cublaslt : after.cublaslt - before.cublaslt,
                by_fallback = bias_only ? after.bias_fallback - before.bias_fallback : after.fallback - before.fallback,
                other = bias_only
                            ? after.cublaslt + after.fallback - before.cublaslt - before.fallback
                            : after.bias_cublaslt + after.bias_fallback - before.bias_cublaslt - before.bias_fallback;
  CHECK(by_lt + by_fallback == 1);
  CHECK(other == 0);
#if defined(MS_TEST_GPU)
  if (lt) CHECK(by_lt == 1);
#else
  CHECK(by_lt == (lt ? 1 : 0));
#endif
}

// A linear layer's operands for the epilogue tests, on the kept-operand backend of `p`: inp (N x IC), w (OC x IC),
// the bias (OC; bias_h on the host), an fp32 output and acc = inp . w^T as the plain GEMM on bf16 operands gives it.
struct EpilogueLinear {
  float *inp = nullptr, *w = nullptr, *bias = nullptr, *out = nullptr;
  std::vector<float> bias_h, acc;
  EpilogueLinear(Pair& p, int64_t N, int64_t IC, int64_t OC, uint32_t seed) {
    REQUIRE(p.gpu->gemm_gelu_epilogue());
    inp = p.On(*p.gpu, Random(N * IC, seed));
    w = p.On(*p.gpu, Random(OC * IC, seed + 1));
    bias_h = Random(OC, seed + 2);
    bias = p.On(*p.gpu, bias_h);
    out = p.On(*p.gpu, std::vector<float>(N * OC));
    REQUIRE(p.gpu->MatmulForward(out, inp, w, nullptr, N, IC, OC).ok());  // x w^T, fp32 (bf16 operands)
    acc = p.Get(*p.gpu, out, N * OC);
  }
};

TEST_CASE("cuda backend: the fc bias + GeLU and its gradient in the GEMMs' epilogues (cuBLASLt, or the fallback)") {
  for (const int64_t OC : {40, 37}) {
    CAPTURE(OC);
    const bool lt = OC % 8 == 0;
    Pair p(/*bf16=*/true, Bf16Operands::kKeep);
    const int64_t N = 29, IC = 24;
    const EpilogueLinear l(p, N, IC, OC, 61);
    float *inp = l.inp, *w = l.w, *bias = l.bias, *out = l.out;
    const std::vector<float>& bias_h = l.bias_h;
    const std::vector<float>& acc = l.acc;
    uint16_t* pre16 = p.On(*p.gpu, std::vector<uint16_t>(N * OC, 0xFFFF));
    uint16_t* gelu16 = p.On(*p.gpu, std::vector<uint16_t>(N * OC, 0xFFFF));
    ops::Bf16Copies kc;
    kc.out16 = pre16;
    kc.gelu16 = gelu16;
    const EpilogueStats before = GetEpilogueStats(*p.gpu);
    REQUIRE(p.gpu->MatmulForward(nullptr, inp, w, bias, N, IC, OC, kc).ok());
    const EpilogueStats after = GetEpilogueStats(*p.gpu);
    CheckEpiloguePath(before, after, lt);
    const std::vector<uint16_t> pre_bits = p.Get(*p.gpu, pre16, N * OC);
    const std::vector<float> pre = Widen16(pre_bits), gel = Widen16(p.Get(*p.gpu, gelu16, N * OC));
    std::vector<float> ref_pre(N * OC), ref_gelu(N * OC);
    for (int64_t i = 0; i < N * OC; ++i) {
      ref_pre[i] = acc[i] + bias_h[i % OC];
      ref_gelu[i] = HostGelu(ref_pre[i]);
#if !defined(MS_TEST_GPU)
      if (lt) {  // the emulated epilogue: the fp32 sum plus the bias rounded to bf16 (its type), rounded once
        const float b16 = Widen16({Round16(bias_h[i % OC])})[0];
        CHECK(pre_bits[i] == Round16(acc[i] + b16));
      }
#endif
    }
    ExpectClose(ref_pre, pre, 1e-2f, 1e-2f, "GeLU input (aux)");
    ExpectClose(ref_gelu, gel, 1e-2f, 1e-2f, "GeLU output");

    // Backward: the fc-proj GEMM (its input: the GeLU output, IC_proj = OC) writes the gradient of the GeLU input.
    const int64_t C2 = 16;  // the projection's output width
    float* w2 = p.On(*p.gpu, Random(C2 * OC, 64));
    float* dy = p.On(*p.gpu, Random(N * C2, 65));
    float* xin = p.On(*p.gpu, Widen16(p.Get(*p.gpu, gelu16, N * OC)));
    float* dg = p.On(*p.gpu, std::vector<float>(N * OC));
    float* dw = p.On(*p.gpu, std::vector<float>(C2 * OC));
    ops::Bf16Copies plain;
    plain.dinp_overwrite = true;
    REQUIRE(p.gpu->MatmulBackward(dg, dw, nullptr, dy, xin, w2, N, OC, C2, plain).ok());  // dout w, fp32
    const std::vector<float> dgh = p.Get(*p.gpu, dg, N * OC);
    uint16_t* dfc16 = p.On(*p.gpu, std::vector<uint16_t>(N * OC, 0xFFFF));
    const std::vector<float> dbias0 = Random(OC, 66);
    float* dbias = p.On(*p.gpu, dbias0);
    ops::Bf16Copies kb;
    kb.dinp_overwrite = true;
    kb.dinp16 = dfc16;
    kb.dgelu_aux16 = pre16;
    kb.dgelu_dbias = dbias;
    const EpilogueStats b2 = GetEpilogueStats(*p.gpu);
    REQUIRE(p.gpu->MatmulBackward(nullptr, dw, nullptr, dy, xin, w2, N, OC, C2, kb).ok());
    const EpilogueStats a2 = GetEpilogueStats(*p.gpu);
    CheckEpiloguePath(b2, a2, lt);
    std::vector<float> ref_d(N * OC), ref_db = dbias0;
    for (int64_t i = 0; i < N * OC; ++i) {
      ref_d[i] = dgh[i] * HostGeluGrad(pre[i]);
      ref_db[i % OC] += ref_d[i];
    }
    ExpectClose(ref_d, Widen16(p.Get(*p.gpu, dfc16, N * OC)), 1e-2f, 1e-2f, "GeLU input gradient");
    // (cuBLASLt's path sums the rounded gradient: N roundings of up to 2^-9 relative each)
    ExpectClose(ref_db, p.Get(*p.gpu, dbias, OC), 1e-2f, 5e-2f, "fc bias gradient");

    // Refused: a missing bias or out16, an fp32 out beside them; dgelu_aux16 without dinp16 or dgelu_dbias, and
    // dgelu_dbias alone.
    CHECK(p.gpu->MatmulForward(nullptr, inp, w, nullptr, N, IC, OC, kc).code() == Code::kInvalidArgument);
    CHECK(p.gpu->MatmulForward(out, inp, w, bias, N, IC, OC, kc).code() == Code::kInvalidArgument);
    ops::Bf16Copies no_out16 = kc;
    no_out16.out16 = nullptr;
    CHECK(p.gpu->MatmulForward(nullptr, inp, w, bias, N, IC, OC, no_out16).code() == Code::kInvalidArgument);
    ops::Bf16Copies bad = kb;
    bad.dgelu_dbias = nullptr;
    CHECK(p.gpu->MatmulBackward(nullptr, dw, nullptr, dy, xin, w2, N, OC, C2, bad).code() == Code::kInvalidArgument);
    bad = kb;
    bad.dinp16 = nullptr;
    CHECK(p.gpu->MatmulBackward(nullptr, dw, nullptr, dy, xin, w2, N, OC, C2, bad).code() == Code::kInvalidArgument);
    bad = plain;
    bad.dgelu_dbias = dbias;
    CHECK(p.gpu->MatmulBackward(dg, dw, nullptr, dy, xin, w2, N, OC, C2, bad).code() == Code::kInvalidArgument);
  }
  // Without kept operands (cast) and on the CPU backend: refused.
  Pair cast(/*bf16=*/true, Bf16Operands::kCast);
  for (ops::Backend* be : {cast.gpu.get(), cast.cpu.get()}) {
    CAPTURE(be->name());
    CHECK_FALSE(be->gemm_gelu_epilogue());
    float* x = cast.On(*be, std::vector<float>(16));
    ops::Bf16Copies kc;
    kc.out16 = x;
    kc.gelu16 = x;
    CHECK(be->MatmulForward(nullptr, x, x, x, 2, 2, 2, kc).code() == Code::kFailedPrecondition);
    ops::Bf16Copies kb;
    kb.dinp_overwrite = true;
    kb.dinp16 = x;
    kb.dgelu_aux16 = x;
    kb.dgelu_dbias = x;
    CHECK(be->MatmulBackward(nullptr, x, nullptr, x, x, x, 2, 2, 2, kb).code() == Code::kFailedPrecondition);
  }
}

// The qkv GEMM with its bias and a bf16 output (MatmulForward with out16 and the bias, kept operands): cuBLASLt's
// BIAS epilogue where it has an algorithm (the fp32 sum plus the bias rounded to bf16, rounded once), else the GEMM's
// bf16 output plus the fp32 bias, rounded again (the fallback: the emulator's heuristic made to find no algorithm at
// OC = 37; on a GPU either path).
TEST_CASE("cuda backend: a GEMM's bias with its bf16 output in the epilogue (cuBLASLt, or the fallback)") {
  for (const int64_t OC : {48, 37}) {
    CAPTURE(OC);
    const bool lt = OC % 8 == 0;
    Pair p(/*bf16=*/true, Bf16Operands::kKeep);
    const int64_t N = 29, IC = 24;
    const EpilogueLinear l(p, N, IC, OC, 71);
    float *inp = l.inp, *w = l.w, *bias = l.bias, *out = l.out;
    const std::vector<float>& bias_h = l.bias_h;
    const std::vector<float>& acc = l.acc;
    uint16_t* out16 = p.On(*p.gpu, std::vector<uint16_t>(N * OC, 0xFFFF));
    ops::Bf16Copies kc;
    kc.out16 = out16;
    const EpilogueStats before = GetEpilogueStats(*p.gpu);
#if !defined(MS_TEST_GPU)
    if (!lt) ms::sim::RefuseNextLtHeuristics(1);
#endif
    REQUIRE(p.gpu->MatmulForward(nullptr, inp, w, bias, N, IC, OC, kc).ok());
    CheckEpiloguePath(before, GetEpilogueStats(*p.gpu), lt, /*bias_only=*/true);
    const std::vector<uint16_t> bits = p.Get(*p.gpu, out16, N * OC);
    std::vector<float> want(N * OC);
    int64_t differ = 0;
    for (int64_t i = 0; i < N * OC; ++i) {
      want[i] = acc[i] + bias_h[i % OC];
#if !defined(MS_TEST_GPU)
      // The emulator's roundings exactly: the epilogue's (the bias in bf16, one rounding) or the fallback's (the
      // GEMM's bf16 output widened, plus the fp32 bias, rounded).
      const uint16_t expect = lt ? Round16(acc[i] + Widen16({Round16(bias_h[i % OC])})[0])
                                 : Round16(Widen16({Round16(acc[i])})[0] + bias_h[i % OC]);
      differ += bits[i] != expect;
#endif
    }
    CHECK(differ == 0);
    ExpectClose(want, Widen16(bits), 1e-2f, 1e-2f, "out16 with the bias");
    // Refused: an fp32 out beside out16 and the bias; an accumulated output with them.
    CHECK(p.gpu->MatmulForward(out, inp, w, bias, N, IC, OC, kc).code() == Code::kInvalidArgument);
    ops::Bf16Copies acc_kc = kc;
    acc_kc.out_accumulate = true;
    CHECK(p.gpu->MatmulForward(nullptr, inp, w, bias, N, IC, OC, acc_kc).code() == Code::kInvalidArgument);
  }
}

// Kept operands change what the GPT holds in device memory: bf16 roundings (2 bytes per parameter; per micro-batch
// every linear's input, dlogits; scratch for the output gradients) in, the fp32 LayerNorm and GeLU outputs that
// only GEMMs read out, and the fp32 scratch of the qkv and fc output gradients (only their roundings are read; the
// attention and the bias + GeLU backward sum the bias gradients as they store them). Both models after one
// forward + backward (sequential block, no sequence parallelism): the difference in bytes held must be what those
// buffers account for, within the allocator's rounding (512 B per block under 1 MiB) and the cast backend's bf16
// workspaces (counted). With the fp32 activations still allocated, `keep` would hold
// 2 x (2 N C + N F) x 4 + N C x 4 bytes more than this allows; with the fp32 dqkv or dfch scratch, 3 N C x 4 or
// N F x 4 more. With runtime.activations: bf16 (the fc output and its GeLU's output gradient in bf16; qkv too, the
// attention running on tensor cores here: D = 16, and no fp32 attention output) `keep` holds
// (L + 1) N F x 2 + L 3 N C x 2 + L N C x 4 bytes less again.
TEST_CASE("cuda backend: with kept bf16 operands the GPT holds no fp32 copy of an activation only GEMMs read") {
  config::ModelSpec m = SpecOf(2, 64, 4, 256, 96, 32);
  m.block = config::BlockKind::kSequential;
  m.window = 0;
  const int B = 2;
  const int64_t N = B * m.seq_len, C = m.hidden, F = m.ffn_hidden, V = m.padded_vocab(), L = m.layers;
  std::vector<int32_t> inputs, targets;
  for (int64_t i = 0; i < N; ++i) {
    inputs.push_back(static_cast<int32_t>((i * 7) % m.vocab));
    targets.push_back(static_cast<int32_t>((i * 5 + 1) % m.vocab));
  }
  auto held = [&](Bf16Operands operands, int64_t* params, bool bf16_fc = false, bool epilogues = false,
                  const config::ModelSpec* spec = nullptr) {
    Pair p(/*bf16=*/true, operands);
    const size_t before = p.gpu_dev->bytes_in_use();
    model::ShardSpec shard;
    shard.bf16_fc = bf16_fc;
    shard.gemm_epilogues = epilogues;
    auto g = model::Gpt::Create(spec ? *spec : m, shard, B, 11, p.gpu_dev.get(), {}, p.gpu.get());
    REQUIRE_MESSAGE(g.ok(), g.status().ToString());
    REQUIRE((*g)->Forward(inputs.data(), targets.data()).ok());
    REQUIRE((*g)->Backward(0.1f).ok());
    REQUIRE(p.gpu->Synchronize().ok());
    *params = (*g)->num_params();
    return static_cast<int64_t>(p.gpu_dev->bytes_in_use() - before);
  };
  int64_t params = 0;
  const int64_t keep = held(Bf16Operands::kKeep, &params), cast = held(Bf16Operands::kCast, &params);
  const int64_t bf16_in =
      2 * (params + N * C + N * F + 3 * N * C +                    // weights; dres, dfch, dqkv scratch
           L * (3 * N * C + N * F) + N * C + N * V);               // ln1, atty, ln2, gelu per layer; lnf, dlogits
  const int64_t fp32_out = 4 * (L * (2 * N * C + N * F) + N * C +  // ln1, ln2, gelu per layer; lnf
                                3 * N * C + N * F);                // dqkv, dfch scratch
  const int64_t slack = 64 * 512;
  CAPTURE(keep);
  CAPTURE(cast);
  CAPTURE(bf16_in);
  CAPTURE(fp32_out);
  // What `cast` holds besides: its three bf16 operand workspaces (input or output gradient, weight, backward input),
  // each grown to the largest operand it casts (N F = F C here: F = 4 C, N = C).
  const int64_t cast_ws = 3 * 2 * std::max({N * F, F * C, N * V});
  CAPTURE(cast_ws);
  CHECK(keep - (cast - cast_ws) <= bf16_in - fp32_out + slack);
  CHECK(4 * 3 * N * C > slack);  // the check above sees any one fp32 buffer come back (the smallest: dqkv, 3 N C)
  // runtime.activations: bf16 holds each layer's fc output and qkv in 2 bytes per element instead of 4, and the
  // backward's scratch for the GeLU output's gradient likewise; and (tp 1) the logits in bf16 alone, their gradient
  // written over them: 2 bytes per logit instead of 4 + 2.
  const int64_t keep_bf16_fc = held(Bf16Operands::kKeep, &params, /*bf16_fc=*/true);
  CAPTURE(keep_bf16_fc);
  // With the tensor-core attention (D = 16 here) qkv is bf16 too and the attention output is held as its rounding
  // alone (no fp32 copy: 4 bytes per element).
  const int64_t qkv16 = L * 3 * N * C * 2 + L * N * C * 4;
  REQUIRE(qkv16 > slack);  // (their share is seen)
  CHECK(std::llabs(keep - keep_bf16_fc - (L + 1) * N * F * 2 - qkv16 - N * V * 4) <= slack);
  // The logits' share seen on its own: a vocabulary large enough that 4 bytes per logit exceed the slack.
  config::ModelSpec big_vocab = m;
  big_vocab.vocab = 1000;
  const int64_t V2 = big_vocab.padded_vocab();
  REQUIRE(N * V2 * 4 > 4 * slack);
  const int64_t fp32_logits = held(Bf16Operands::kKeep, &params, false, false, &big_vocab);
  const int64_t bf16_logits = held(Bf16Operands::kKeep, &params, true, false, &big_vocab);
  CHECK(std::llabs(fp32_logits - bf16_logits - (L + 1) * N * F * 2 - qkv16 - N * V2 * 4) <= slack);
  // With the GeLU in the GEMMs' epilogues the GeLU output's gradient has no scratch at all; the backend holds
  // cuBLASLt's workspace instead.
  const int64_t keep_epilogues = held(Bf16Operands::kKeep, &params, /*bf16_fc=*/true, /*epilogues=*/true);
  CAPTURE(keep_epilogues);
  CHECK(std::llabs(keep_bf16_fc - keep_epilogues + static_cast<int64_t>(kCublasLtWorkspaceBytes) - N * F * 2) <= slack);
}

// The optimizer writing the GPT's bf16 weight copies with its update (optim::SegmentData::param16, what the
// data-parallel engine hands it with zero 0) instead of the next step casting each weight at its first use: model `a`
// declares them written (Gpt::Bf16WeightsWritten), model `b` (same seed, batch, optimizer) casts as before. Over
// three steps the losses, gradients and parameters are the same bits (the copies are the roundings the casts make),
// and `a` casts its GEMM weights in the first step only; after InvalidateBf16Weights (a checkpoint restore) it casts
// them again. Fails when a copy is rounded from the parameters before the update (the losses differ), or when the
// declaration is ignored (the casts go on).
TEST_CASE("cuda backend (emulated): the optimizer writes the bf16 weight copies and the next step casts none") {
  const config::ModelSpec m = SpecOf(2, 64, 4, 256, 96, 32);
  const int B = 2;
  std::vector<int32_t> inputs, targets;
  for (int64_t i = 0; i < B * m.seq_len; ++i) {
    inputs.push_back(static_cast<int32_t>((i * 7) % m.vocab));
    targets.push_back(static_cast<int32_t>((i * 5 + 1) % m.vocab));
  }
  for (auto kind : {config::OptimizerKind::kAdamW, config::OptimizerKind::kLamb}) {
    CAPTURE(static_cast<int>(kind));
    Pair p(/*bf16=*/true, Bf16Operands::kKeep);
    config::OptimizerSpec spec;
    spec.kind = kind;
    auto a = model::Gpt::Create(m, {}, B, 11, p.gpu_dev.get(), {}, p.gpu.get());
    auto b = model::Gpt::Create(m, {}, B, 11, p.gpu_dev.get(), {}, p.gpu.get());
    REQUIRE_MESSAGE(a.ok(), a.status().ToString());
    REQUIRE(b.ok());
    REQUIRE((*a)->keeps_bf16_weights());
    REQUIRE((*a)->bf16_param_data() != nullptr);
    const auto& params = (*a)->params();
    auto oa = optim::Optimizer::Create(spec, params, optim::WholeTensorSegments(params), model::AllTensorNames(m),
                                       p.gpu.get());
    auto ob = optim::Optimizer::Create(spec, params, optim::WholeTensorSegments(params), model::AllTensorNames(m),
                                       p.gpu.get());
    REQUIRE(oa.ok());
    REQUIRE(ob.ok());
    struct Out {
      float loss;
      std::vector<float> grads, params;
    };
    auto train_step = [&](model::Gpt& g, optim::Optimizer& o, int64_t step, bool write) {
      g.BeginStep();
      auto loss = g.Forward(inputs.data(), targets.data());
      REQUIRE_MESSAGE(loss.ok(), loss.status().ToString());
      REQUIRE(g.Backward(0.1f).ok());
      REQUIRE(g.EndStep().ok());
      const auto n = static_cast<size_t>(g.num_params());
      Out out{*loss, p.Get(*p.gpu, g.grad_data(), n), {}};
      auto data = optim::WholeTensorData(params, g.param_data(), g.grad_data());
      if (write) {
        for (size_t i = 0; i < params.size(); ++i) {
          data[i].param16 = static_cast<uint16_t*>(g.bf16_param_data()) + params[i].offset;
        }
      }
      REQUIRE(o.Step(data, step, 1e-2, optim::IdentityReducer).ok());
      if (write) g.Bf16WeightsWritten();
      out.params = p.Get(*p.gpu, g.param_data(), n);
      REQUIRE(g.ZeroGrad().ok());
      return out;
    };
    int64_t first_casts = 0;
    for (int64_t step = 1; step <= 4; ++step) {
      CAPTURE(step);
      if (step == 4) (*a)->InvalidateBf16Weights();  // the parameters were restored: every copy is stale
      const int64_t casts_a = (*a)->bf16_weight_casts(), casts_b = (*b)->bf16_weight_casts();
      const Out ra = train_step(**a, **oa, step, true), rb = train_step(**b, **ob, step, false);
      CHECK(std::memcmp(&ra.loss, &rb.loss, sizeof(float)) == 0);
      CHECK(std::memcmp(ra.grads.data(), rb.grads.data(), sizeof(float) * ra.grads.size()) == 0);
      CHECK(std::memcmp(ra.params.data(), rb.params.data(), sizeof(float) * ra.params.size()) == 0);
      const int64_t made_a = (*a)->bf16_weight_casts() - casts_a, made_b = (*b)->bf16_weight_casts() - casts_b;
      if (step == 1) first_casts = made_b;
      CHECK(made_b == first_casts);  // every GEMM weight (2 x 4 linears and the classifier), once per step
      CHECK(made_a == (step == 1 || step == 4 ? first_casts : 0));
    }
    CHECK(first_casts == 2 * 4 + 1);
  }
  // The CPU backend keeps no copies and refuses to write one.
  Pair p;
  std::vector<float> x(8, 1.0f);
  float* t = p.On(*p.cpu, x);
  uint16_t p16[8];
  ops::AdamWTensor adam{t, t, t, t, 8, {1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f}, p16};
  CHECK_FALSE(p.cpu->AdamW(&adam, 1, 1).ok());
  CHECK_FALSE(p.cpu->LambApply(t, t, 8, 1e-3f, 1.0f, p16).ok());
  // Nor does a CUDA backend that keeps no bf16 operands (fp32 GEMMs here; likewise bf16_operands cast / cublas).
  float* tg = p.On(*p.gpu, x);
  adam = {tg, tg, tg, tg, 8, {1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f}, p.On(*p.gpu, std::vector<uint16_t>(8))};
  CHECK_FALSE(p.gpu->AdamW(&adam, 1, 1).ok());
}

#if !defined(MS_TEST_GPU)
// Small uploads go through the backend's ring of pinned staging buffers. Under the deferred emulated streams
// (nothing runs until something waits for it) and with pinned copies read when they run (as a DMA is): more
// uploads than staging buffers, the host source rewritten after every call, and one large (pageable) upload;
// every device buffer must hold what its call passed. Returns the first element of each.
std::vector<float> StagedUploads(bool plant_no_wait) {
  struct Deferred {
    Deferred() { ms::sim::SetStreamMode(ms::sim::StreamMode::kDeferred); }
    ~Deferred() { ms::sim::SetStreamMode(ms::sim::StreamMode::kSync); }
  } mode;
  if (plant_no_wait) setenv("MEGASCALE_PLANT", "staging_no_wait", 1);
  Pair p;
  unsetenv("MEGASCALE_PLANT");
  std::vector<float> host(1000);
  std::vector<float*> dev;
  for (int k = 0; k < 9; ++k) {
    dev.push_back(static_cast<float*>(p.gpu_dev->Alloc(host.size() * sizeof(float)).value()));
    std::fill(host.begin(), host.end(), static_cast<float>(k + 1));
    REQUIRE(p.gpu->CopyFromHost(dev.back(), host.data(), host.size() * sizeof(float)).ok());
  }
  std::vector<float> large((size_t{1} << 20) / sizeof(float) + 1, 10.0f);  // over the staging size: pageable
  dev.push_back(static_cast<float*>(p.gpu_dev->Alloc(large.size() * sizeof(float)).value()));
  REQUIRE(p.gpu->CopyFromHost(dev.back(), large.data(), large.size() * sizeof(float)).ok());
  std::fill(large.begin(), large.end(), -1.0f);
  REQUIRE(p.gpu->Synchronize().ok());
  std::vector<float> first;
  for (size_t k = 0; k < dev.size(); ++k) {
    const size_t n = k + 1 < dev.size() ? host.size() : large.size();
    const auto back = p.Get(*p.gpu, dev[k], n);
    const bool uniform = std::all_of(back.begin(), back.end(), [&](float v) { return v == back[0]; });
    first.push_back(uniform ? back[0] : -2.0f);
    p.gpu_dev->Free(dev[k]);
  }
  return first;
}

TEST_CASE("cuda backend (emulated): host-to-device uploads through the pinned staging ring") {
  const std::vector<float> want{1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  CHECK(StagedUploads(false) == want);
  // The planted bug (a staging buffer reused before its previous copy ran): the early uploads see later data.
  const auto planted = StagedUploads(true);
  CHECK(planted != want);
  CHECK(planted[0] == 9.0f);  // uploads 1, 5 and 9 share the first buffer: all three DMAs read the last
}
#endif

TEST_CASE("cuda backend (emulated): identity and errors") {
  Pair p;
#if defined(MS_TEST_GPU)
  CHECK(std::string(p.gpu->name()) == "cuda");
  CHECK(LinkedFlavor() == Flavor::kGpu);
#else
  CHECK(std::string(p.gpu->name()) == "cuda (emulated)");
  CHECK(LinkedFlavor() == Flavor::kEmulated);
#endif
  auto cpu_dev = device::MakeCpuDevice();
  auto bad = MakeCudaBackend(cpu_dev.get());
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("MakeCudaDevice") != std::string::npos);
  // A failed launch comes back as an error naming the op (attention with D > 128 is refused by the kernel).
  float* x = static_cast<float*>(p.gpu_dev->Alloc(3 * 129 * sizeof(float)).value());
  float* o = static_cast<float*>(p.gpu_dev->Alloc(129 * sizeof(float)).value());
  float* l = static_cast<float*>(p.gpu_dev->Alloc(sizeof(float)).value());
  Status s = p.gpu->AttentionForward(o, l, x, 1, 1, 1, 129, 0);
  CHECK_FALSE(s.ok());
  CHECK(s.message().find("attention forward") != std::string::npos);
  p.gpu_dev->Free(x);
  p.gpu_dev->Free(o);
  p.gpu_dev->Free(l);
}

// ---- graphs (runtime.cuda_graphs): ops recorded by BeginCapture / EndCapture, launched again ----

TEST_CASE("cuda backend: a recorded graph of ops gives the bits of running them, launch after launch") {
  Pair p(true, Bf16Operands::kCast);  // the casts' workspaces: what a capture must not grow
  ops::Backend& be = *p.gpu;
  REQUIRE(be.supports_graphs());
  const int64_t N = 37, IC = 24, OC = 40;
  float* x = p.On(be, Random(N * IC, 1));
  float* w = p.On(be, Random(OC * IC, 2));
  float* b = p.On(be, Random(OC, 3));
  float* out = p.On(be, std::vector<float>(N * OC));
  float* y = p.On(be, std::vector<float>(N * OC));
  auto ops = [&](float* dst_out, float* dst_y) {
    REQUIRE(be.MatmulForward(dst_out, x, w, b, N, IC, OC).ok());
    REQUIRE(be.GeluForward(dst_y, dst_out, N * OC).ok());
  };
  ops(out, y);  // the first run sizes the workspaces
  const std::vector<float> zeros(static_cast<size_t>(N * OC), 0.0f);
  REQUIRE(be.CopyFromHost(y, zeros.data(), zeros.size() * sizeof(float)).ok());
  REQUIRE(be.BeginCapture().ok());
  CHECK(be.capturing());
  ops(out, y);
  auto graph = be.EndCapture();
  REQUIRE_MESSAGE(graph.ok(), graph.status().ToString());
  CHECK_FALSE(be.capturing());
  CHECK((*graph)->ops() >= 3);           // the casts, the GEMM, the bias add, the GeLU
  CHECK(p.Get(be, y, N * OC) == zeros);  // recorded, not run
  float* ref_out = p.On(be, std::vector<float>(N * OC));
  float* ref_y = p.On(be, std::vector<float>(N * OC));
  for (uint32_t seed : {7u, 8u}) {  // new inputs in the same buffer: each launch reads them
    const std::vector<float> xs = Random(N * IC, seed);
    REQUIRE(be.CopyFromHost(x, xs.data(), xs.size() * sizeof(float)).ok());
    REQUIRE((*graph)->Launch().ok());
    ops(ref_out, ref_y);
    CHECK(p.Get(be, y, N * OC) == p.Get(be, ref_y, N * OC));
    CHECK(p.Get(be, out, N * OC) == p.Get(be, ref_out, N * OC));
  }
  // A workspace replaced after the capture (a larger GEMM's casts) makes the graph stale: refused, not run.
  float* big = p.On(be, Random(4 * N * IC, 9));
  float* big_out = p.On(be, std::vector<float>(4 * N * OC));
  REQUIRE(be.MatmulForward(big_out, big, w, nullptr, 4 * N, IC, OC).ok());
  CHECK((*graph)->Stale());
  const Status stale = (*graph)->Launch();
  CHECK(stale.code() == Code::kFailedPrecondition);
  CHECK(stale.message().find("stale") != std::string::npos);
}

TEST_CASE("cuda backend: what a capture cannot hold fails with a reason, and the backend works on") {
  Pair p(true, Bf16Operands::kCast);
  ops::Backend& be = *p.gpu;
  const int64_t N = 16, IC = 8, OC = 8;
  float* x = p.On(be, Random(8 * N * IC, 1));
  float* w = p.On(be, Random(OC * IC, 2));
  float* out = p.On(be, std::vector<float>(8 * N * OC));
  REQUIRE(be.MatmulForward(out, x, w, nullptr, N, IC, OC).ok());
  SUBCASE("a wait for the device") {
    REQUIRE(be.BeginCapture().ok());
    CHECK_FALSE(be.Synchronize().ok());
    auto g = be.EndCapture();
    REQUIRE_FALSE(g.ok());
    CHECK(g.status().message().find("graph capture failed") != std::string::npos);
  }
  SUBCASE("an upload from the host") {
    REQUIRE(be.BeginCapture().ok());
    const float one = 1;
    const Status s = be.CopyFromHost(x, &one, sizeof one);
    CHECK(s.code() == Code::kFailedPrecondition);
    CHECK(s.message().find("inside a graph capture") != std::string::npos);
    CHECK(be.EndCapture().ok());
  }
  SUBCASE("a workspace that has to grow") {
    REQUIRE(be.BeginCapture().ok());
    const Status s = be.MatmulForward(out, x, w, nullptr, 8 * N, IC, OC);
    CHECK(s.code() == Code::kFailedPrecondition);
    CHECK(s.message().find("would grow") != std::string::npos);
    CHECK(be.EndCapture().ok());
  }
  SUBCASE("a second BeginCapture, an EndCapture without one") {
    REQUIRE(be.BeginCapture().ok());
    CHECK_FALSE(be.BeginCapture().ok());
    CHECK(be.EndCapture().ok());
    CHECK_FALSE(be.EndCapture().ok());
  }
  REQUIRE(be.MatmulForward(out, x, w, nullptr, 8 * N, IC, OC).ok());
  REQUIRE(be.Synchronize().ok());
  // The CPU backend records no graphs.
  CHECK_FALSE(p.cpu->supports_graphs());
  CHECK(p.cpu->BeginCapture().code() == Code::kUnimplemented);
}

// Diagnosis for a GPU session (runs last: the slowest cuDNN case, ~24 plans): each form of cuDNN's attention backward
// graph (SetCudnnBackwardForm: dQ accumulated in fp32 — the default — or written straight, the deterministic form;
// the padding-mask workaround of cuDNN <= 9.15 on or off) at an odd T, a T that is a multiple of 128, and D = 128,
// against megascale's kernels on the same inputs, one line per form and shape with the largest difference of dQ, dK
// and dV (cuDNN's own outputs: the first-call check made to agree). What fails is that cuDNN takes and runs every
// form (engines found, plans built on the GPU, no fallback); whether the numbers are right is the cuDNN case above's
// check of the default form — these lines say which other form would be right where it is not.
TEST_CASE("cuda backend: cuDNN's attention backward in each graph form, against megascale's kernels") {
  if (LinkedFlavor() == Flavor::kEmulated) return;  // no cuDNN (the cuDNN case above checks the refusal)
  struct Restore {
    double was = CudnnCheckTolerance();
    ~Restore() {
      SetCudnnCheckTolerance(was);
      SetCudnnBackwardForm(-1, -1);
    }
  } restore;
  SetCudnnCheckTolerance(1e30);
  struct Shape {
    int64_t B, T, H, D, window;
  };
  const Shape shapes[] = {{2, 70, 3, 64, 0}, {2, 256, 3, 64, 0}, {1, 129, 2, 128, 0}};
  std::vector<std::vector<float>> want;  // megascale's dqkv per shape
  std::vector<std::vector<uint16_t>> qkv_in, dout_in;
  Pair ours(/*bf16=*/true, Bf16Operands::kKeep);
  for (const Shape& sh : shapes) {
    const int64_t n_qkv = sh.B * sh.T * 3 * sh.H * sh.D, n_out = sh.B * sh.T * sh.H * sh.D;
    qkv_in.push_back(Round16(Random(n_qkv, 81, -2.0f, 2.0f)));
    dout_in.push_back(Round16(Random(n_out, 82)));
    const Attention16 a(ours, qkv_in.back(), dout_in.back(), sh.B * sh.H * sh.T);
    a.Run(*ours.gpu, sh.B, sh.T, sh.H, sh.D, sh.window, nullptr);
    want.push_back(Widen16(ours.Get(*ours.gpu, a.dqkv16, n_qkv)));
  }
  for (int deterministic = 0; deterministic < 2; ++deterministic) {
    for (int padding = 0; padding < 2; ++padding) {
      CAPTURE(deterministic);
      CAPTURE(padding);
      SetCudnnBackwardForm(deterministic, padding);
      Pair cud(/*bf16=*/true, Bf16Operands::kKeep);  // a backend of its own: its plans are built in this form
      REQUIRE(UseCudnnAttention(*cud.gpu).ok());
      for (size_t i = 0; i < std::size(shapes); ++i) {
        const Shape& sh = shapes[i];
        CAPTURE(sh.T);
        CAPTURE(sh.D);
        const int64_t n_qkv = sh.B * sh.T * 3 * sh.H * sh.D;
        const Attention16 a(cud, qkv_in[i], dout_in[i], sh.B * sh.H * sh.T);
        a.Run(*cud.gpu, sh.B, sh.T, sh.H, sh.D, sh.window, nullptr);
        const std::vector<float> got = Widen16(cud.Get(*cud.gpu, a.dqkv16, n_qkv));
        float worst[3] = {0, 0, 0}, scale[3] = {0, 0, 0};
        for (int64_t j = 0; j < n_qkv; ++j) {
          const int part = static_cast<int>((j / (sh.H * sh.D)) % 3);
          const float d = std::isnan(got[j]) ? INFINITY : std::fabs(got[j] - want[i][j]);
          worst[part] = std::max(worst[part], d);
          scale[part] = std::max(scale[part], std::fabs(want[i][j]));
        }
        MESSAGE("cuDNN backward form deterministic "
                << deterministic << ", padding mask " << padding << ", B " << sh.B << " T " << sh.T << " H " << sh.H
                << " D " << sh.D << ": max |cuDNN - megascale| dQ " << worst[0] << " (of " << scale[0] << "), dK "
                << worst[1] << " (of " << scale[1] << "), dV " << worst[2] << " (of " << scale[2] << ")");
      }
      const AttentionStats st = GetAttentionStats(*cud.gpu);
      INFO("first fallback: " << st.cudnn_note);
      CHECK(st.cudnn_backward == static_cast<int64_t>(std::size(shapes)));
      CHECK(st.cudnn_fallback == 0);
    }
  }
}

}  // namespace
}  // namespace ms::cuda
