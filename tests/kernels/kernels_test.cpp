// Every CUDA kernel against the CPU reference of its op (ms::ops::ref), plus the semantics of the CUDA
// built-ins the kernels rely on and (emulated builds only) one planted bug per checker of the SIMT emulator.
//
// Built twice: test_kernels runs the kernels under the emulator (kernels/sim, run by ctest with
// MS_SIM_SCHEDULE=fwd and =rev), test_kernels_gpu runs the same cases on a real GPU (ctest -L gpu; see
// docs/cuda.md). Shapes are small and odd on purpose: sizes that are not multiples of the block, smaller than
// a block, and single elements. Tolerances are stated per op: the kernels accumulate in fp32 where the
// reference accumulates in double.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ios>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>

#if MS_KERNELS_SIM
#include "sim/simt.h"
#endif
#include "kernels.h"
#include "ops/ops.h"
#include "test_kernels.h"
#include "test_util.h"

namespace ms::kernels {
namespace {

using testing::Dev;
using testing::ExpectBf16CopyOf;
using testing::ExpectClose;
using testing::ExpectNoPoisonedReads;
using testing::Random;

TEST_CASE("kernels: GeLU and bias+GeLU forward/backward match the reference (rtol 1e-5, atol 1e-6)") {
  for (int64_t n : {1, 257, 1000}) {
    const auto x = Random(n, 1), dout = Random(n, 2);
    Dev<float> dx_in(x), ddout(dout), dy(n), dgrad(n);
    REQUIRE(GeluForward(dy.get(), dx_in.get(), n, nullptr) == cudaSuccess);
    REQUIRE(GeluBackward(dgrad.get(), dx_in.get(), ddout.get(), n, nullptr) == cudaSuccess);
    std::vector<float> y(n), g(n);
    ops::ref::GeluForward(y.data(), x.data(), n);
    ops::ref::GeluBackward(g.data(), x.data(), dout.data(), n);
    ExpectClose(dy.Get(), y, 1e-5f, 1e-6f, "gelu out");
    ExpectClose(dgrad.Get(), g, 1e-5f, 1e-6f, "gelu dx");
  }
  struct Shape {
    int64_t N, C;
  };
  // (300, 3) and (257, 70): several row chunks in the dbias reduction (two launches, scratch); the others one.
  for (Shape s : {Shape{7, 45}, Shape{300, 3}, Shape{1, 1}, Shape{2, 70}, Shape{257, 70}}) {
    CAPTURE(s.N);
    CAPTURE(s.C);
    const int64_t n = s.N * s.C;
    const auto x = Random(n, 3, -3.0f, 3.0f), bias = Random(s.C, 4), dout = Random(n, 5);
    const auto dbias0 = Random(s.C, 6);
    Dev<float> dx_in(x), dbias_in(bias), ddout(dout), dy(n), dgrad(n), ddbias(dbias0);
    Dev<float> scratch(BiasGradScratchFloats(s.N, s.C));
    REQUIRE(BiasGeluForward(dy.get(), dx_in.get(), dbias_in.get(), s.N, s.C, nullptr) == cudaSuccess);
    REQUIRE(BiasGeluBackward(dgrad.get(), ddbias.get(), scratch.get(), dx_in.get(), dbias_in.get(), ddout.get(), s.N,
                             s.C, nullptr) == cudaSuccess);
    std::vector<float> u(n), y(n), g(n), db(dbias0);
    for (int64_t i = 0; i < n; ++i) u[i] = x[i] + bias[i % s.C];
    ops::ref::GeluForward(y.data(), u.data(), n);
    ops::ref::GeluBackward(g.data(), u.data(), dout.data(), n);
    for (int64_t c = 0; c < s.C; ++c) {
      double acc = 0;
      for (int64_t r = 0; r < s.N; ++r) acc += g[r * s.C + c];
      db[c] = static_cast<float>(db[c] + acc);
    }
    ExpectClose(dy.Get(), y, 1e-5f, 1e-6f, "bias_gelu out");
    ExpectClose(dgrad.Get(), g, 1e-5f, 1e-6f, "bias_gelu dx");
    // With the bf16 copy: the same fp32 bits, and their rounding.
    Dev<float> dy2(n);
    Dev<__nv_bfloat16> dy16(n);
    REQUIRE(BiasGeluForward(dy2.get(), dx_in.get(), dbias_in.get(), s.N, s.C, nullptr, dy16.get()) == cudaSuccess);
    CHECK(dy2.Get() == dy.Get());
    ExpectBf16CopyOf(dy16, dy2, n, "bias_gelu out16");
    Dev<float> dgrad2(n), ddbias2(dbias0);
    Dev<__nv_bfloat16> dgrad16(n);
    REQUIRE(BiasGeluBackward(dgrad2.get(), ddbias2.get(), scratch.get(), dx_in.get(), dbias_in.get(), ddout.get(), s.N,
                             s.C, nullptr, dgrad16.get()) == cudaSuccess);
    CHECK(dgrad2.Get() == dgrad.Get());
    ExpectBf16CopyOf(dgrad16, dgrad2, n, "bias_gelu dx16");
    ExpectClose(ddbias.Get(), db, 1e-5f, 1e-5f, "bias_gelu dbias (accumulated)");
    // dbias is summed as dx is computed, in BiasGrad's tree: the bits of BiasGrad over the stored dx.
    Dev<float> ddbias3(dbias0);
    REQUIRE(BiasGrad(ddbias3.get(), scratch.get(), dgrad.get(), s.N, s.C, nullptr) == cudaSuccess);
    CHECK(ddbias.Get() == ddbias3.Get());
    CHECK(ddbias2.Get() == ddbias3.Get());
    // Only the roundings (the fp32 outputs null): the same bf16 bits and dbias, nothing else written.
    Dev<__nv_bfloat16> dy16_only(n), dgrad16_only(n);
    REQUIRE(BiasGeluForward(nullptr, dx_in.get(), dbias_in.get(), s.N, s.C, nullptr, dy16_only.get()) == cudaSuccess);
    ExpectBf16CopyOf(dy16_only, dy, n, "bias_gelu out16 without out");
    Dev<float> ddbias4(dbias0);
    REQUIRE(BiasGeluBackward(nullptr, ddbias4.get(), scratch.get(), dx_in.get(), dbias_in.get(), ddout.get(), s.N, s.C,
                             nullptr, dgrad16_only.get()) == cudaSuccess);
    ExpectBf16CopyOf(dgrad16_only, dgrad, n, "bias_gelu dx16 without dx");
    CHECK(ddbias4.Get() == ddbias3.Get());
    CHECK(BiasGeluForward(nullptr, dx_in.get(), dbias_in.get(), s.N, s.C, nullptr, nullptr) == cudaErrorInvalidValue);

    // x in bf16 (runtime.activations: bf16): the bits of the fp32 launchers on x widened to fp32 (out, out16, dx,
    // dx16, dbias), and not those of the unrounded x.
    std::vector<__nv_bfloat16> x16(n);
    std::vector<float> xw(n);
    for (int64_t i = 0; i < n; ++i) {
      x16[i] = __float2bfloat16_rn(x[i]);
      xw[i] = __bfloat162float(x16[i]);
    }
    Dev<__nv_bfloat16> dx16_in(x16), wy16(n), gy16(n), wg16(n), gg16(n);
    Dev<float> dxw_in(xw), wy(n), gy(n), wg(n), gg(n), wdb(dbias0), gdb(dbias0);
    REQUIRE(BiasGeluForward(wy.get(), dxw_in.get(), dbias_in.get(), s.N, s.C, nullptr, wy16.get()) == cudaSuccess);
    REQUIRE(BiasGeluForward(gy.get(), dx16_in.get(), dbias_in.get(), s.N, s.C, nullptr, gy16.get()) == cudaSuccess);
    REQUIRE(BiasGeluBackward(wg.get(), wdb.get(), scratch.get(), dxw_in.get(), dbias_in.get(), ddout.get(), s.N, s.C,
                             nullptr, wg16.get()) == cudaSuccess);
    REQUIRE(BiasGeluBackward(gg.get(), gdb.get(), scratch.get(), dx16_in.get(), dbias_in.get(), ddout.get(), s.N, s.C,
                             nullptr, gg16.get()) == cudaSuccess);
    CHECK(gy.Get() == wy.Get());
    CHECK(gg.Get() == wg.Get());
    CHECK(gdb.Get() == wdb.Get());
    const auto gy16h = gy16.Get(), wy16h = wy16.Get(), gg16h = gg16.Get(), wg16h = wg16.Get();
    CHECK(std::memcmp(gy16h.data(), wy16h.data(), sizeof(__nv_bfloat16) * n) == 0);
    CHECK(std::memcmp(gg16h.data(), wg16h.data(), sizeof(__nv_bfloat16) * n) == 0);
    if (n > 1) CHECK(gy.Get() != dy.Get());  // the rounding of x shows

    // dout in bf16 too (the fc-proj backward GEMM's bf16 output): the bits of the fp32 launcher on the widened x and
    // dout (dx, dx16, dbias), and not those of the unrounded dout.
    const std::vector<float> dout_h = ddout.Get();
    std::vector<__nv_bfloat16> g16(n);
    std::vector<float> gw(n);
    for (int64_t i = 0; i < n; ++i) {
      g16[i] = __float2bfloat16_rn(dout_h[i]);
      gw[i] = __bfloat162float(g16[i]);
    }
    Dev<__nv_bfloat16> dg16_in(g16), wgg16(n), ggg16(n);
    Dev<float> dgw_in(gw), wgg(n), ggg(n), wgdb(dbias0), ggdb(dbias0);
    REQUIRE(BiasGeluBackward(wgg.get(), wgdb.get(), scratch.get(), dxw_in.get(), dbias_in.get(), dgw_in.get(), s.N, s.C,
                             nullptr, wgg16.get()) == cudaSuccess);
    REQUIRE(BiasGeluBackward(ggg.get(), ggdb.get(), scratch.get(), dx16_in.get(), dbias_in.get(), dg16_in.get(), s.N,
                             s.C, nullptr, ggg16.get()) == cudaSuccess);
    CHECK(ggg.Get() == wgg.Get());
    CHECK(ggdb.Get() == wgdb.Get());
    const auto ggg16h = ggg16.Get(), wgg16h = wgg16.Get();
    CHECK(std::memcmp(ggg16h.data(), wgg16h.data(), sizeof(__nv_bfloat16) * n) == 0);
    if (n > 1) CHECK(ggg.Get() != gg.Get());  // the rounding of dout shows
    // pre16: x + bias rounded to bf16 (the GeLU input, as cuBLASLt's GELU_AUX_BIAS stores it), written over x itself
    // (the backend's fallback for that epilogue); out and out16 unchanged. The backward with no bias then reads it
    // as the GeLU input: the bits of the launcher with a zero bias (bf16 x and dout: the only place a null bias is
    // taken; elsewhere refused).
    Dev<__nv_bfloat16> inplace(x16), py16(n);
    Dev<float> py(n);
    REQUIRE(BiasGeluForward(py.get(), inplace.get(), dbias_in.get(), s.N, s.C, nullptr, py16.get(), inplace.get()) ==
            cudaSuccess);
    CHECK(py.Get() == gy.Get());
    const auto py16h = py16.Get(), pre_h = inplace.Get();
    CHECK(std::memcmp(py16h.data(), gy16h.data(), sizeof(__nv_bfloat16) * n) == 0);
    std::vector<float> prew(n);
    for (int64_t i = 0; i < n; ++i) {
      CHECK(__bfloat162float(pre_h[i]) == __bfloat162float(__float2bfloat16_rn(xw[i] + bias[i % s.C])));
      prew[i] = __bfloat162float(pre_h[i]);
    }
    Dev<float> dprew(prew), zero_bias(std::vector<float>(s.C, 0.0f)), nb(n), zb(n), nbdb(dbias0), zbdb(dbias0);
    REQUIRE(BiasGeluBackward(nb.get(), nbdb.get(), scratch.get(), inplace.get(), nullptr, dg16_in.get(), s.N, s.C,
                             nullptr) == cudaSuccess);
    REQUIRE(BiasGeluBackward(zb.get(), zbdb.get(), scratch.get(), inplace.get(), zero_bias.get(), dg16_in.get(), s.N,
                             s.C, nullptr) == cudaSuccess);
    CHECK(nb.Get() == zb.Get());
    CHECK(nbdb.Get() == zbdb.Get());
    CHECK(BiasGeluBackward(nb.get(), nbdb.get(), scratch.get(), inplace.get(), nullptr, ddout.get(), s.N, s.C,
                           nullptr) == cudaErrorInvalidValue);
    CHECK(BiasGeluBackward(nb.get(), nbdb.get(), scratch.get(), dprew.get(), nullptr, ddout.get(), s.N, s.C, nullptr) ==
          cudaErrorInvalidValue);
  }
  ExpectNoPoisonedReads();
}

TEST_CASE("kernels: LayerNorm forward/backward match the reference (out rtol 1e-5; grads rtol 1e-4, atol 1e-5)") {
  struct Shape {
    int64_t N, C;
  };
  // N: one row, fewer rows than one backward block (16), many blocks with a partial last one (1001 = 62 * 16 + 9,
  // 45 = 2 * 16 + 13); C: a single element, a warp plus one, several passes of a warp and of a 256-thread block
  // (770; with 45 rows rather than 1001 to keep the emulated test fast). The accumulating outputs (dx, dw, db)
  // start nonzero. Under ThreadSanitizer (kernels_tsan), whose cost grows with the square of a block's threads at
  // every barrier, the shapes are narrower: 161 rows (10 blocks and a partial one) stand for 1001, no C = 770 and
  // C = 132 for 516 (the parameter gradients' 1024-thread blocks, one per 32 columns whatever N, were 50 s of that
  // run's 100 s); the same code paths, barriers and partial blocks.
#if defined(__SANITIZE_THREAD__)
  constexpr int64_t kManyRows = 161;
  const std::vector<int64_t> widths = {1, 33};
  constexpr int64_t kVecWidth = 132;
#else
  constexpr int64_t kManyRows = 1001;
  const std::vector<int64_t> widths = {1, 33, 770};
  constexpr int64_t kVecWidth = 516;
#endif
  std::vector<Shape> shapes;
  for (int64_t N : {int64_t{1}, int64_t{7}, kManyRows}) {
    for (int64_t C : widths) shapes.push_back({N == kManyRows && C == 770 ? 45 : N, C});
  }
  shapes.push_back({130, 20});
  // C % 4 == 0: the backward's vector path, 4 columns a lane, 128-column steps and a tail.
  shapes.push_back({45, kVecWidth});
  for (Shape s : shapes) {
    CAPTURE(s.N);
    CAPTURE(s.C);
    const int64_t n = s.N * s.C;
    const float eps = 1e-5f;
    const auto x = Random(n, 10, -2.0f, 3.0f), w = Random(s.C, 11), b = Random(s.C, 12), dout = Random(n, 13);
    const auto dx0 = Random(n, 14), dw0 = Random(s.C, 15), db0 = Random(s.C, 16);
    std::vector<float> out(n), mean(s.N), rstd(s.N), dx(dx0), dw(dw0), db(db0);
    ops::ref::LayerNormForward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), s.N, s.C, eps);
    ops::ref::LayerNormBackward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(),
                                rstd.data(), s.N, s.C);

    Dev<float> d_x(x), d_w(w), d_b(b), d_out(n), d_mean(s.N), d_rstd(s.N);
    REQUIRE(LayerNormForward(d_out.get(), d_mean.get(), d_rstd.get(), d_x.get(), d_w.get(), d_b.get(), s.N, s.C, eps,
                             nullptr) == cudaSuccess);
    ExpectClose(d_out.Get(), out, 1e-5f, 1e-5f, "layernorm out");
    ExpectClose(d_mean.Get(), mean, 1e-5f, 1e-6f, "layernorm mean");
    ExpectClose(d_rstd.Get(), rstd, 1e-5f, 1e-6f, "layernorm rstd");
    {  // With the bf16 copy: the same fp32 bits, and their rounding.
      Dev<float> d_out2(n), d_mean2(s.N), d_rstd2(s.N);
      Dev<__nv_bfloat16> d_out16(n);
      REQUIRE(LayerNormForward(d_out2.get(), d_mean2.get(), d_rstd2.get(), d_x.get(), d_w.get(), d_b.get(), s.N, s.C,
                               eps, nullptr, d_out16.get()) == cudaSuccess);
      CHECK(d_out2.Get() == d_out.Get());
      CHECK(d_rstd2.Get() == d_rstd.Get());
      ExpectBf16CopyOf(d_out16, d_out2, n, "layernorm out16");
      // Only the rounding (out null): the same bf16 bits, mean and rstd.
      Dev<float> d_mean3(s.N), d_rstd3(s.N);
      Dev<__nv_bfloat16> d_out16_only(n);
      REQUIRE(LayerNormForward(nullptr, d_mean3.get(), d_rstd3.get(), d_x.get(), d_w.get(), d_b.get(), s.N, s.C, eps,
                               nullptr, d_out16_only.get()) == cudaSuccess);
      ExpectBf16CopyOf(d_out16_only, d_out, n, "layernorm out16 without out");
      CHECK(d_mean3.Get() == d_mean.Get());
      CHECK(d_rstd3.Get() == d_rstd.Get());
      CHECK(LayerNormForward(nullptr, d_mean3.get(), d_rstd3.get(), d_x.get(), d_w.get(), d_b.get(), s.N, s.C, eps,
                             nullptr, nullptr) == cudaErrorInvalidValue);
    }

    // Grads at 1e-4 relative to |want| are too tight where a sum of 1001 terms of both signs nearly cancels, so
    // dw/db also get an absolute tolerance scaled by sqrt(N).
    const float grad_atol = 1e-5f * std::sqrt(static_cast<float>(s.N));
    Dev<float> d_dout(dout), d_dx(dx0), d_dw(dw0), d_db(db0), scratch(LayerNormBackwardScratchFloats(s.N, s.C));
    REQUIRE(LayerNormBackward(d_dx.get(), d_dw.get(), d_db.get(), scratch.get(), d_dout.get(), d_x.get(), d_w.get(),
                              d_mean.get(), d_rstd.get(), s.N, s.C, nullptr) == cudaSuccess);
    const auto got_dx = d_dx.Get(), got_dw = d_dw.Get(), got_db = d_db.Get();
    ExpectClose(got_dx, dx, 1e-4f, 1e-5f, "layernorm dx (accumulated)");
    ExpectClose(got_dw, dw, 1e-4f, grad_atol, "layernorm dw (accumulated)");
    ExpectClose(got_db, db, 1e-4f, grad_atol, "layernorm db (accumulated)");
    if (s.C % 4 == 0) {  // dx not 16-byte aligned: the element path (another sum order), still close to the reference
      std::vector<float> shifted(n + 1, 0.0f);
      std::copy(dx0.begin(), dx0.end(), shifted.begin() + 1);
      Dev<float> d_off(shifted), d_dw2(dw0), d_db2(db0);
      REQUIRE(LayerNormBackward(d_off.get() + 1, d_dw2.get(), d_db2.get(), scratch.get(), d_dout.get(), d_x.get(),
                                d_w.get(), d_mean.get(), d_rstd.get(), s.N, s.C, nullptr) == cudaSuccess);
      const auto o = d_off.Get();
      ExpectClose(std::vector<float>(o.begin() + 1, o.end()), dx, 1e-4f, 1e-5f, "layernorm dx (unaligned)");
    }

    // Same bits run after run (the scratch holds the previous run's partials: it is overwritten, not read).
    d_dx.Set(dx0);
    d_dw.Set(dw0);
    d_db.Set(db0);
    REQUIRE(LayerNormBackward(d_dx.get(), d_dw.get(), d_db.get(), scratch.get(), d_dout.get(), d_x.get(), d_w.get(),
                              d_mean.get(), d_rstd.get(), s.N, s.C, nullptr) == cudaSuccess);
    CHECK(d_dx.Get() == got_dx);
    CHECK(d_dw.Get() == got_dw);
    CHECK(d_db.Get() == got_db);
    // With the bf16 copy of the accumulated dx: the same bits, and their rounding.
    d_dx.Set(dx0);
    Dev<__nv_bfloat16> d_dx16(n);
    REQUIRE(LayerNormBackward(d_dx.get(), d_dw.get(), d_db.get(), scratch.get(), d_dout.get(), d_x.get(), d_w.get(),
                              d_mean.get(), d_rstd.get(), s.N, s.C, nullptr, d_dx16.get()) == cudaSuccess);
    CHECK(d_dx.Get() == got_dx);
    ExpectBf16CopyOf(d_dx16, d_dx, n, "layernorm dx16");

    // The column sums of the accumulated dx into dsum and dsum2 (the residual-branch bias gradients): dx, dw and db
    // keep their bits; dsum = its initial value + the sums in the kernel's order (each 16-row block in row order,
    // then lane y of 32 adds blocks y, y + 32, ... in order, then the lane sums in lane order), bit for bit, and
    // within 1e-5 of the double sums; dsum2 gets the same sums. dsum2 without dsum: refused.
    d_dx.Set(dx0);
    d_dw.Set(dw0);
    d_db.Set(db0);
    const auto init = Random(s.C, 13), init2 = Random(s.C, 14);
    Dev<float> d_sum(init), d_sum2(init2);
    REQUIRE(LayerNormBackward(d_dx.get(), d_dw.get(), d_db.get(), scratch.get(), d_dout.get(), d_x.get(), d_w.get(),
                              d_mean.get(), d_rstd.get(), s.N, s.C, nullptr, nullptr, d_sum.get(),
                              d_sum2.get()) == cudaSuccess);
    CHECK(d_dx.Get() == got_dx);
    CHECK(d_dw.Get() == got_dw);
    CHECK(d_db.Get() == got_db);
    const int64_t blocks = (s.N + 15) / 16;
    std::vector<float> want(s.C), want2(s.C), exact(s.C);
    for (int64_t c = 0; c < s.C; ++c) {
      float lanes[32] = {};
      double sum_exact = 0;
      for (int64_t g = 0; g < blocks; ++g) {
        float part = 0.0f;
        for (int64_t r = 16 * g; r < std::min(16 * g + 16, s.N); ++r) {
          part += got_dx[r * s.C + c];
          sum_exact += got_dx[r * s.C + c];
        }
        lanes[g % 32] += part;
      }
      float sum = 0.0f;
      for (float lane : lanes) sum += lane;
      want[c] = init[c] + sum;
      want2[c] = init2[c] + sum;
      exact[c] = static_cast<float>(init[c] + sum_exact);
    }
    const auto got_sum = d_sum.Get();
    CHECK(got_sum == want);
    CHECK(d_sum2.Get() == want2);
    ExpectClose(got_sum, exact, 1e-5f, grad_atol, "layernorm dx column sums");
    CHECK(LayerNormBackward(d_dx.get(), d_dw.get(), d_db.get(), scratch.get(), d_dout.get(), d_x.get(), d_w.get(),
                            d_mean.get(), d_rstd.get(), s.N, s.C, nullptr, nullptr, nullptr,
                            d_sum2.get()) == cudaErrorInvalidValue);

    // dout in bf16 (runtime.activations: bf16: the input gradient as its GEMM wrote it): dx, dx16, dw, db and dsum
    // the bits of the fp32 launcher on dout widened; a null bf16 dout refused.
    Dev<__nv_bfloat16> d_dout16(n);
    REQUIRE(CastFloatToBf16(d_dout16.get(), d_dout.get(), n, nullptr) == cudaSuccess);
    Dev<float> d_widened(n);
    REQUIRE(CastBf16ToFloat(d_widened.get(), d_dout16.get(), n, nullptr) == cudaSuccess);
    Dev<float> fx(dx0), fw(dw0), fb(db0), fs(init), hx(dx0), hw(dw0), hb(db0), hs(init);
    Dev<__nv_bfloat16> h16(n);
    REQUIRE(LayerNormBackward(fx.get(), fw.get(), fb.get(), scratch.get(), d_widened.get(), d_x.get(), d_w.get(),
                              d_mean.get(), d_rstd.get(), s.N, s.C, nullptr, nullptr, fs.get()) == cudaSuccess);
    const __nv_bfloat16* dout16 = d_dout16.get();
    REQUIRE(LayerNormBackward(hx.get(), hw.get(), hb.get(), scratch.get(), dout16, d_x.get(), d_w.get(), d_mean.get(),
                              d_rstd.get(), s.N, s.C, nullptr, h16.get(), hs.get()) == cudaSuccess);
    CHECK(hx.Get() == fx.Get());
    CHECK(hw.Get() == fw.Get());
    CHECK(hb.Get() == fb.Get());
    CHECK(hs.Get() == fs.Get());
    ExpectBf16CopyOf(h16, hx, n, "layernorm dx16 from a bf16 dout");
    ExpectClose(hx.Get(), dx, 2e-2f, 1e-2f, "layernorm dx from a bf16 dout, against the fp32 reference");
    CHECK(LayerNormBackward(hx.get(), hw.get(), hb.get(), scratch.get(), static_cast<const __nv_bfloat16*>(nullptr),
                            d_x.get(), d_w.get(), d_mean.get(), d_rstd.get(), s.N, s.C,
                            nullptr) == cudaErrorInvalidValue);
  }
  ExpectNoPoisonedReads();
}

// The residual add fused into the LayerNorm that reads it: res, out, out16, mean and rstd the bits of ResidualAdd
// then LayerNormForward (with one bias, two, none; out and out16, or only out16; res in place of x), on odd shapes
// (a single element, a warp plus one, several passes of a 256-thread block; few rows: one block per row is slow
// under the emulator's TSan build). Fails when the fused pass sums the row in another order, or normalizes other
// values.
// With part in bf16 (runtime.activations: bf16) both launchers give the bits of the fp32 ones on part widened.
// The forwards take 4 columns a lane with 16-byte accesses where C % 4 == 0 and every row is aligned, and the same
// columns one at a time, in the same order, otherwise: an input one element off the alignment gives the same bits.
TEST_CASE("kernels: LayerNorm forwards, unaligned rows (element by element) give the bits of the 16-byte path") {
  // N: one row, a block of 8 warps and a partial one (8 rows a block); C: one quad, quads a lane plus a partial pass.
  for (auto [N, C] : {std::pair<int64_t, int64_t>{1, 4}, {17, 20}, {9, 516}}) {
    CAPTURE(N);
    CAPTURE(C);
    const int64_t n = N * C;
    const float eps = 1e-5f;
    // Element 0 of each buffer is padding: from element 1 on, the rows are 4 bytes off the 16-byte alignment.
    const auto x = Random(n + 1, 30, -2.0f, 3.0f), part = Random(n + 1, 31), w = Random(C + 1, 32),
               b = Random(C + 1, 33), rb = Random(C + 1, 34);
    Dev<float> d_x(x), d_part(part), d_w(w), d_b(b), d_rb(rb);
    // Aligned copies of the same values.
    Dev<float> a_x(std::vector<float>(x.begin() + 1, x.end())),
        a_part(std::vector<float>(part.begin() + 1, part.end())), a_w(std::vector<float>(w.begin() + 1, w.end())),
        a_b(std::vector<float>(b.begin() + 1, b.end())), a_rb(std::vector<float>(rb.begin() + 1, rb.end()));
    const auto tail = [](const std::vector<float>& v) { return std::vector<float>(v.begin() + 1, v.end()); };

    Dev<float> want_out(n), want_mean(N), want_rstd(N), got_out(n + 1), got_mean(N), got_rstd(N);
    Dev<__nv_bfloat16> want16(n), got16(n + 1);
    REQUIRE(LayerNormForward(want_out.get(), want_mean.get(), want_rstd.get(), a_x.get(), a_w.get(), a_b.get(), N, C,
                             eps, nullptr, want16.get()) == cudaSuccess);
    REQUIRE(LayerNormForward(got_out.get() + 1, got_mean.get(), got_rstd.get(), d_x.get() + 1, d_w.get() + 1,
                             d_b.get() + 1, N, C, eps, nullptr, got16.get() + 1) == cudaSuccess);
    CHECK(tail(got_out.Get()) == want_out.Get());
    CHECK(got_mean.Get() == want_mean.Get());
    CHECK(got_rstd.Get() == want_rstd.Get());
    const auto g16 = got16.Get(), w16 = want16.Get();
    CHECK(std::memcmp(g16.data() + 1, w16.data(), sizeof(__nv_bfloat16) * n) == 0);

    Dev<float> want_res(n), got_res(n + 1);
    REQUIRE(ResidualLayerNormForward(want_res.get(), want_out.get(), want_mean.get(), want_rstd.get(), a_x.get(),
                                     a_part.get(), a_rb.get(), nullptr, a_w.get(), a_b.get(), N, C, eps,
                                     nullptr) == cudaSuccess);
    REQUIRE(ResidualLayerNormForward(got_res.get() + 1, got_out.get() + 1, got_mean.get(), got_rstd.get(),
                                     d_x.get() + 1, d_part.get() + 1, d_rb.get() + 1, nullptr, d_w.get() + 1,
                                     d_b.get() + 1, N, C, eps, nullptr) == cudaSuccess);
    CHECK(tail(got_res.Get()) == want_res.Get());
    CHECK(tail(got_out.Get()) == want_out.Get());
    CHECK(got_mean.Get() == want_mean.Get());
    CHECK(got_rstd.Get() == want_rstd.Get());
  }
}

TEST_CASE("kernels: ResidualLayerNormForward gives the bits of ResidualAdd then LayerNormForward") {
  for (auto [N, C] : {std::pair<int64_t, int64_t>{1, 1}, {7, 33}, {3, 770}, {67, 20}}) {
    CAPTURE(N);
    CAPTURE(C);
    const int64_t n = N * C;
    const float eps = 1e-5f;
    const auto x = Random(n, 20, -2.0f, 3.0f), part = Random(n, 21), w = Random(C, 22), b = Random(C, 23),
               rb = Random(C, 24), rb2 = Random(C, 25);
    Dev<float> d_x(x), d_part(part), d_w(w), d_b(b), d_rb(rb), d_rb2(rb2);
    for (int biases = 0; biases <= 2; ++biases) {
      CAPTURE(biases);
      const float* b1 = biases >= 1 ? d_rb.get() : nullptr;
      const float* b2 = biases >= 2 ? d_rb2.get() : nullptr;
      Dev<float> want_res(n), want_out(n), want_mean(N), want_rstd(N);
      Dev<__nv_bfloat16> want16(n);
      REQUIRE(ResidualAdd(want_res.get(), d_x.get(), d_part.get(), b1, b2, N, C, nullptr) == cudaSuccess);
      REQUIRE(LayerNormForward(want_out.get(), want_mean.get(), want_rstd.get(), want_res.get(), d_w.get(), d_b.get(),
                               N, C, eps, nullptr, want16.get()) == cudaSuccess);
      Dev<float> res(n), out(n), mean(N), rstd(N);
      Dev<__nv_bfloat16> out16(n);
      REQUIRE(ResidualLayerNormForward(res.get(), out.get(), mean.get(), rstd.get(), d_x.get(), d_part.get(), b1, b2,
                                       d_w.get(), d_b.get(), N, C, eps, nullptr, out16.get()) == cudaSuccess);
      CHECK(res.Get() == want_res.Get());
      CHECK(out.Get() == want_out.Get());
      CHECK(mean.Get() == want_mean.Get());
      CHECK(rstd.Get() == want_rstd.Get());
      const auto g16 = out16.Get(), w16 = want16.Get();
      CHECK(std::memcmp(g16.data(), w16.data(), sizeof(__nv_bfloat16) * n) == 0);
      {  // part in bf16 (the projection GEMM's output kept in bf16): both launchers give the bits of the fp32 ones
         // on part widened
        Dev<__nv_bfloat16> part16(n);
        REQUIRE(CastFloatToBf16(part16.get(), d_part.get(), n, nullptr) == cudaSuccess);
        Dev<float> widened(n), fres(n), fout(n), fmean(N), frstd(N), hres(n), hout(n), hmean(N), hrstd(N), fadd(n),
            hadd(n);
        REQUIRE(CastBf16ToFloat(widened.get(), part16.get(), n, nullptr) == cudaSuccess);
        const __nv_bfloat16* p16 = part16.get();
        REQUIRE(ResidualLayerNormForward(fres.get(), fout.get(), fmean.get(), frstd.get(), d_x.get(), widened.get(), b1,
                                         b2, d_w.get(), d_b.get(), N, C, eps, nullptr) == cudaSuccess);
        REQUIRE(ResidualLayerNormForward(hres.get(), hout.get(), hmean.get(), hrstd.get(), d_x.get(), p16, b1, b2,
                                         d_w.get(), d_b.get(), N, C, eps, nullptr) == cudaSuccess);
        CHECK(hres.Get() == fres.Get());
        CHECK(hout.Get() == fout.Get());
        CHECK(hmean.Get() == fmean.Get());
        CHECK(hrstd.Get() == frstd.Get());
        REQUIRE(ResidualAdd(fadd.get(), d_x.get(), widened.get(), b1, b2, N, C, nullptr) == cudaSuccess);
        REQUIRE(ResidualAdd(hadd.get(), d_x.get(), p16, b1, b2, N, C, nullptr) == cudaSuccess);
        CHECK(hadd.Get() == fadd.Get());
        CHECK(hadd.Get() == fres.Get());
        const __nv_bfloat16* none = nullptr;
        CHECK(ResidualAdd(hadd.get(), d_x.get(), none, b1, b2, N, C, nullptr) == cudaErrorInvalidValue);
        CHECK(ResidualLayerNormForward(hres.get(), hout.get(), hmean.get(), hrstd.get(), d_x.get(), none, b1, b2,
                                       d_w.get(), d_b.get(), N, C, eps, nullptr) == cudaErrorInvalidValue);
      }
      if (biases != 2) continue;
      // Only the rounding, the residual written over x.
      Dev<float> inplace(x), mean2(N), rstd2(N);
      Dev<__nv_bfloat16> only16(n);
      REQUIRE(ResidualLayerNormForward(inplace.get(), nullptr, mean2.get(), rstd2.get(), inplace.get(), d_part.get(),
                                       b1, b2, d_w.get(), d_b.get(), N, C, eps, nullptr, only16.get()) == cudaSuccess);
      CHECK(inplace.Get() == want_res.Get());
      CHECK(rstd2.Get() == want_rstd.Get());
      const auto o16 = only16.Get();
      CHECK(std::memcmp(o16.data(), w16.data(), sizeof(__nv_bfloat16) * n) == 0);
    }
  }
  Dev<float> one(1);
  CHECK(ResidualLayerNormForward(one.get(), nullptr, one.get(), one.get(), one.get(), one.get(), nullptr, nullptr,
                                 one.get(), one.get(), 1, 1, 1e-5f, nullptr, nullptr) == cudaErrorInvalidValue);
  ExpectNoPoisonedReads();
}

TEST_CASE("kernels: softmax cross-entropy forward/backward match the reference (rtol 1e-5, atol 1e-5 / 1e-6)") {
  struct Shape {
    int64_t N, V;
  };
  // V % 8 == 0 takes the vector path (8-column chunks; 8488: more than two chunks per thread, then a tail), the others
  // the element path.
  for (Shape s : {Shape{4, 1000}, Shape{3, 33}, Shape{2, 1}, Shape{5, 513}, Shape{2, 8488}}) {
    CAPTURE(s.N);
    CAPTURE(s.V);
    const auto logits = Random(s.N * s.V, 20, -4.0f, 4.0f);
    std::vector<int32_t> targets(s.N);
    for (int64_t i = 0; i < s.N; ++i) targets[i] = static_cast<int32_t>((i * 7919) % s.V);
    if (s.N > 1) targets[1] = -1;  // ignored
    const auto dloss = Random(s.N, 21, 0.1f, 1.0f);
    std::vector<float> losses(s.N), lse(s.N), dlogits(s.N * s.V);
    ops::ref::CrossEntropyForward(losses.data(), lse.data(), logits.data(), targets.data(), s.N, s.V);
    ops::ref::CrossEntropyBackward(dlogits.data(), logits.data(), lse.data(), targets.data(), dloss.data(), s.N, s.V);

    Dev<float> d_logits(logits), d_losses(s.N), d_lse(s.N), d_dloss(dloss), d_dlogits(s.N * s.V);
    Dev<int32_t> d_targets(targets);
    REQUIRE(CrossEntropyForward(d_losses.get(), d_lse.get(), d_logits.get(), d_targets.get(), s.N, s.V, nullptr) ==
            cudaSuccess);
    ExpectClose(d_losses.Get(), losses, 1e-5f, 1e-5f, "crossentropy losses");
    ExpectClose(d_lse.Get(), lse, 1e-5f, 1e-5f, "crossentropy lse");
    REQUIRE(CrossEntropyBackward(d_dlogits.get(), d_logits.get(), d_lse.get(), d_targets.get(), d_dloss.get(), s.N, s.V,
                                 nullptr) == cudaSuccess);
    ExpectClose(d_dlogits.Get(), dlogits, 1e-5f, 1e-6f, "crossentropy dlogits");
    // Fused: dlogits over the logits, bit-identical to the two kernels.
    Dev<float> d_inout(logits), d_losses2(s.N), d_lse2(s.N);
    REQUIRE(CrossEntropyFused(d_losses2.get(), d_lse2.get(), d_inout.get(), d_targets.get(), d_dloss.get(), s.N, s.V,
                              nullptr) == cudaSuccess);
    CHECK(d_losses2.Get() == d_losses.Get());
    CHECK(d_lse2.Get() == d_lse.Get());
    CHECK(d_inout.Get() == d_dlogits.Get());
    // With the bf16 copy of dlogits (both kernels): the same bits, and their rounding.
    Dev<float> d_inout2(logits), d_dlogits2(s.N * s.V);
    Dev<__nv_bfloat16> d16(s.N * s.V), d16b(s.N * s.V);
    REQUIRE(CrossEntropyFused(d_losses2.get(), d_lse2.get(), d_inout2.get(), d_targets.get(), d_dloss.get(), s.N, s.V,
                              nullptr, d16.get()) == cudaSuccess);
    CHECK(d_inout2.Get() == d_dlogits.Get());
    ExpectBf16CopyOf(d16, d_inout2, s.N * s.V, "crossentropy fused dlogits16");
    REQUIRE(CrossEntropyBackward(d_dlogits2.get(), d_logits.get(), d_lse.get(), d_targets.get(), d_dloss.get(), s.N,
                                 s.V, nullptr, d16b.get()) == cudaSuccess);
    CHECK(d_dlogits2.Get() == d_dlogits.Get());
    ExpectBf16CopyOf(d16b, d_dlogits2, s.N * s.V, "crossentropy backward dlogits16");
    // Only the roundings: the backward with dlogits null; the fused kernel with fp32_dlogits false leaves the
    // logits as they were.
    Dev<__nv_bfloat16> d16c(s.N * s.V), d16d(s.N * s.V);
    REQUIRE(CrossEntropyBackward(nullptr, d_logits.get(), d_lse.get(), d_targets.get(), d_dloss.get(), s.N, s.V,
                                 nullptr, d16c.get()) == cudaSuccess);
    ExpectBf16CopyOf(d16c, d_dlogits, s.N * s.V, "crossentropy backward dlogits16 without dlogits");
    Dev<float> d_inout3(logits), d_losses3(s.N), d_lse3(s.N);
    REQUIRE(CrossEntropyFused(d_losses3.get(), d_lse3.get(), d_inout3.get(), d_targets.get(), d_dloss.get(), s.N, s.V,
                              nullptr, d16d.get(), false) == cudaSuccess);
    CHECK(d_inout3.Get() == logits);
    CHECK(d_losses3.Get() == d_losses.Get());
    CHECK(d_lse3.Get() == d_lse.Get());
    ExpectBf16CopyOf(d16d, d_dlogits, s.N * s.V, "crossentropy fused dlogits16 without fp32 dlogits");
    CHECK(CrossEntropyFused(d_losses3.get(), d_lse3.get(), d_inout3.get(), d_targets.get(), d_dloss.get(), s.N, s.V,
                            nullptr, nullptr, false) == cudaErrorInvalidValue);
    CHECK(CrossEntropyBackward(nullptr, d_logits.get(), d_lse.get(), d_targets.get(), d_dloss.get(), s.N, s.V, nullptr,
                               nullptr) == cudaErrorInvalidValue);
    // Outputs that are not 16-byte aligned: element stores, the same bits. Logits that are not: the element path
    // (another column -> thread assignment, so other bits), still close to the reference.
    Dev<float> off(s.N * s.V + 1);
    Dev<__nv_bfloat16> off16(s.N * s.V + 1);
    REQUIRE(CrossEntropyBackward(off.get() + 1, d_logits.get(), d_lse.get(), d_targets.get(), d_dloss.get(), s.N, s.V,
                                 nullptr, off16.get() + 1) == cudaSuccess);
    const auto o = off.Get();
    CHECK(std::vector<float>(o.begin() + 1, o.end()) == d_dlogits.Get());
    const auto o16 = off16.Get();
    CHECK(std::memcmp(o16.data() + 1, d16b.Get().data(), sizeof(__nv_bfloat16) * s.N * s.V) == 0);
    std::vector<float> shifted(s.N * s.V + 1, 0.0f);
    std::copy(logits.begin(), logits.end(), shifted.begin() + 1);
    Dev<float> d_shifted(shifted), losses4(s.N), lse4(s.N);
    REQUIRE(CrossEntropyFused(losses4.get(), lse4.get(), d_shifted.get() + 1, d_targets.get(), d_dloss.get(), s.N, s.V,
                              nullptr) == cudaSuccess);
    ExpectClose(losses4.Get(), losses, 1e-5f, 1e-5f, "crossentropy losses, unaligned logits");
    ExpectClose(lse4.Get(), lse, 1e-5f, 1e-5f, "crossentropy lse, unaligned logits");
    const auto sh = d_shifted.Get();
    ExpectClose(std::vector<float>(sh.begin() + 1, sh.end()), dlogits, 1e-5f, 1e-6f, "crossentropy dlogits, unaligned");
  }
  ExpectNoPoisonedReads();
}

// bf16 logits (runtime.activations: bf16) over the first Vv of V columns: the bits of the fp32 kernels on the logits
// widened, with the padding columns (from Vv on) at -inf — out of the max and the sum (exp gives exactly 0, and
// adding 0 changes no partial sum), gradient 0 — for the losses, lse and the gradient's rounding; the fused kernel
// writes that rounding over the logits, the backward may too. Vv outside [1, V]: refused.
TEST_CASE("kernels: cross-entropy on bf16 logits with padding columns = the fp32 kernels on the widened logits") {
  struct Shape {
    int64_t N, V, Vv;
  };
  for (Shape s : {Shape{4, 1000, 1000}, Shape{3, 384, 300}, Shape{2, 1, 1}, Shape{5, 513, 257}, Shape{2, 8576, 8500}}) {
    CAPTURE(s.N);
    CAPTURE(s.V);
    CAPTURE(s.Vv);
    const auto raw = Random(s.N * s.V, 22, -4.0f, 4.0f);
    std::vector<__nv_bfloat16> l16(raw.size());
    std::vector<float> wide(raw.size());
    for (size_t i = 0; i < raw.size(); ++i) {
      l16[i] = __float2bfloat16_rn(raw[i]);
      wide[i] = static_cast<int64_t>(i) % s.V < s.Vv ? __bfloat162float(l16[i]) : -INFINITY;
    }
    std::vector<int32_t> targets(s.N);
    for (int64_t i = 0; i < s.N; ++i) targets[i] = static_cast<int32_t>((i * 7919) % s.Vv);
    if (s.N > 1) targets[1] = -1;  // ignored
    const auto dloss = Random(s.N, 23, 0.1f, 1.0f);
    Dev<float> d_wide(wide), d_dloss(dloss), want_losses(s.N), want_lse(s.N);
    Dev<int32_t> d_targets(targets);
    Dev<__nv_bfloat16> want16(s.N * s.V);
    REQUIRE(CrossEntropyForward(want_losses.get(), want_lse.get(), d_wide.get(), d_targets.get(), s.N, s.V, nullptr) ==
            cudaSuccess);
    REQUIRE(CrossEntropyBackward(nullptr, d_wide.get(), want_lse.get(), d_targets.get(), d_dloss.get(), s.N, s.V,
                                 nullptr, want16.get()) == cudaSuccess);
    const auto w16 = want16.Get();
    auto same16 = [&](Dev<__nv_bfloat16>& got, const char* what) {
      INFO(what);
      const auto g = got.Get();
      CHECK(std::memcmp(g.data(), w16.data(), sizeof(__nv_bfloat16) * w16.size()) == 0);
    };
    Dev<__nv_bfloat16> d_l16(l16), inout(l16), sep(s.N * s.V);
    Dev<float> losses(s.N), lse(s.N), losses2(s.N), lse2(s.N);
    REQUIRE(CrossEntropyForward(losses.get(), lse.get(), d_l16.get(), d_targets.get(), s.N, s.V, s.Vv, nullptr) ==
            cudaSuccess);
    CHECK(losses.Get() == want_losses.Get());
    CHECK(lse.Get() == want_lse.Get());
    REQUIRE(CrossEntropyBackward(sep.get(), d_l16.get(), lse.get(), d_targets.get(), d_dloss.get(), s.N, s.V, s.Vv,
                                 nullptr) == cudaSuccess);
    same16(sep, "backward, separate output");
    Dev<__nv_bfloat16> inplace(l16);
    REQUIRE(CrossEntropyBackward(inplace.get(), inplace.get(), lse.get(), d_targets.get(), d_dloss.get(), s.N, s.V,
                                 s.Vv, nullptr) == cudaSuccess);
    same16(inplace, "backward, over the logits");
    REQUIRE(CrossEntropyFused(losses2.get(), lse2.get(), inout.get(), d_targets.get(), d_dloss.get(), s.N, s.V, s.Vv,
                              nullptr) == cudaSuccess);
    CHECK(losses2.Get() == want_losses.Get());
    CHECK(lse2.Get() == want_lse.Get());
    same16(inout, "fused, over the logits");
    for (int64_t bad : {int64_t{0}, s.V + 1}) {
      CHECK(CrossEntropyForward(losses.get(), lse.get(), d_l16.get(), d_targets.get(), s.N, s.V, bad, nullptr) ==
            cudaErrorInvalidValue);
      CHECK(CrossEntropyFused(losses.get(), lse.get(), inout.get(), d_targets.get(), d_dloss.get(), s.N, s.V, bad,
                              nullptr) == cudaErrorInvalidValue);
    }
  }
  ExpectNoPoisonedReads();
}

TEST_CASE("kernels: embedding forward matches exactly; backward is bit-identical to the reference") {
  enum class Ids { kRandom, kAllEqual, kAllNegative, kDistinct };
  struct Shape {
    int64_t N, V, C;
    Ids kind;
  };
  // Random ids are -1 .. V-1: a small V repeats every id many times, a large V hardly ever. N > 2048 sorts in
  // several tiles: 2999 and 3001 (P = 4096) take one global bitonic step, 5000 (P = 8192) three.
  const Shape shapes[] = {
      {50, 11, 37, Ids::kRandom},  {9, 3, 300, Ids::kRandom},       {1, 1, 1, Ids::kRandom},
      {1, 4, 5, Ids::kDistinct},   {300, 5, 33, Ids::kAllEqual},    {70, 6, 3, Ids::kAllNegative},
      {2999, 7, 19, Ids::kRandom}, {3001, 100003, 5, Ids::kRandom}, {5000, 5001, 2, Ids::kDistinct},
      {2049, 2, 1, Ids::kRandom},
  };
  for (const Shape& s : shapes) {
    CAPTURE(s.N);
    CAPTURE(s.V);
    CAPTURE(s.C);
    std::mt19937 rng(30);
    std::vector<int32_t> ids(s.N);
    for (int64_t i = 0; i < s.N; ++i) {
      switch (s.kind) {
        case Ids::kRandom:
          ids[i] = static_cast<int32_t>(rng() % (s.V + 1)) - 1;
          break;  // -1 .. V-1
        case Ids::kAllEqual:
          ids[i] = static_cast<int32_t>(s.V / 2);
          break;
        case Ids::kAllNegative:
          ids[i] = -1 - static_cast<int32_t>(rng() % 1000);
          break;
        case Ids::kDistinct:
          ids[i] = static_cast<int32_t>((s.N - 1 - i) % s.V);
          break;  // descending
      }
    }
    const auto table = Random(s.V * s.C, 31), dout = Random(s.N * s.C, 32), dtable0 = Random(s.V * s.C, 33);
    std::vector<float> out(s.N * s.C), dtable(dtable0);
    ops::ref::EmbeddingForward(out.data(), ids.data(), table.data(), s.N, s.C);
    ops::ref::EmbeddingBackward(dtable.data(), ids.data(), dout.data(), s.N, s.C);

    Dev<int32_t> d_ids(ids);
    Dev<float> d_table(table), d_out(s.N * s.C), d_dout(dout), d_dtable(dtable0);
    Dev<unsigned char> scratch(EmbeddingBackwardScratchBytes(s.N));
    REQUIRE(EmbeddingForward(d_out.get(), d_ids.get(), d_table.get(), s.N, s.C, nullptr) == cudaSuccess);
    CHECK(d_out.Get() == out);
    REQUIRE(EmbeddingBackward(d_dtable.get(), scratch.get(), d_ids.get(), d_dout.get(), s.N, s.C, nullptr) ==
            cudaSuccess);
    CHECK(d_dtable.Get() == dtable);
  }
  ExpectNoPoisonedReads();
}

TEST_CASE(
    "kernels: multi-tensor AdamW matches the reference per tensor (rtol 1e-5, atol 1e-6), and writes the bf16 "
    "weight copy bit for bit") {
  const ops::AdamParams hp{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f};
  const AdamWHyper khp{hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay};
  // 30 tensors (more than one launch's 24), with empty, single-element and odd sizes.
  std::vector<int64_t> sizes = {1, 1000, 1025, 0, 7, 3000};
  for (int i = 0; i < 24; ++i) sizes.push_back(1 + 37 * i);
  struct Host {
    std::vector<float> p, g, m, v;
  };
  std::vector<Host> host;
  std::vector<std::unique_ptr<Dev<float>>> dev;
  std::vector<std::unique_ptr<Dev<__nv_bfloat16>>> dev16(sizes.size());  // p16 of every other non-empty tensor
  std::vector<AdamWTensor> list;
  for (size_t k = 0; k < sizes.size(); ++k) {
    const int64_t n = sizes[k];
    const uint32_t seed = static_cast<uint32_t>(100 + 4 * k);
    Host h{Random(n, seed), Random(n, seed + 1), Random(n, seed + 2, -0.1f, 0.1f), Random(n, seed + 3, 0.0f, 0.01f)};
    for (const auto* vec : {&h.p, &h.g, &h.m, &h.v}) dev.push_back(std::make_unique<Dev<float>>(*vec));
    const size_t b = dev.size() - 4;
    list.push_back(AdamWTensor{dev[b]->get(), dev[b + 1]->get(), dev[b + 2]->get(), dev[b + 3]->get(), n});
    if (k % 2 == 1 && n > 0) {
      dev16[k] = std::make_unique<Dev<__nv_bfloat16>>(static_cast<size_t>(n));
      list.back().p16 = dev16[k]->get();
    }
    host.push_back(std::move(h));
  }
  for (int64_t step : {1, 2, 10}) {
    REQUIRE(AdamWMultiTensor(list.data(), static_cast<int>(list.size()), khp, step, nullptr) == cudaSuccess);
    for (size_t k = 0; k < sizes.size(); ++k) {
      CAPTURE(k);
      CAPTURE(step);
      Host& h = host[k];
      ops::ref::AdamWStep(h.p.data(), h.g.data(), h.m.data(), h.v.data(), sizes[k], hp, step);
      ExpectClose(dev[4 * k]->Get(), h.p, 1e-5f, 1e-6f, "adamw p");
      ExpectClose(dev[4 * k + 2]->Get(), h.m, 1e-5f, 1e-6f, "adamw m");
      ExpectClose(dev[4 * k + 3]->Get(), h.v, 1e-5f, 1e-6f, "adamw v");
      // The bf16 copy: the rounding of the updated parameters, as the cast kernel would make it at the next step.
      if (dev16[k]) ExpectBf16CopyOf(*dev16[k], *dev[4 * k], sizes[k], "adamw p16");
      // Keep the reference on the kernel's state so that errors do not compound across steps.
      h.p = dev[4 * k]->Get();
      h.m = dev[4 * k + 2]->Get();
      h.v = dev[4 * k + 3]->Get();
    }
  }
}

// Reference fp32 -> bf16, round to nearest even, written independently of cuda_bf16.h.
uint16_t Bf16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays (quiet) NaN
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

TEST_CASE("kernels: fp32 <-> bf16 casts round to nearest even, exactly") {
  std::vector<float> x = Random(1001, 40, -1e3f, 1e3f);
  auto bits = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  // Ties (even and odd), values just off ties, overflow to inf, subnormals, signed zeros, inf, NaN.
  for (uint32_t u :
       {0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f817fffu, 0x7f7fffffu, 0x7f7f8000u, 0x00000001u, 0x00008000u,
        0x00018000u, 0x80000000u, 0x00000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xbf808000u}) {
    x.push_back(bits(u));
  }
  const int64_t n = static_cast<int64_t>(x.size());
  Dev<float> d_x(x), d_back(n);
  Dev<__nv_bfloat16> d_h(n);
  REQUIRE(CastFloatToBf16(d_h.get(), d_x.get(), n, nullptr) == cudaSuccess);
  REQUIRE(CastBf16ToFloat(d_back.get(), d_h.get(), n, nullptr) == cudaSuccess);
  const auto h = d_h.Get();
  const auto back = d_back.Get();
  int mismatches = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint16_t got;
    std::memcpy(&got, &h[i], 2);
    const uint16_t want = Bf16Bits(x[i]);
    const bool nan = std::isnan(x[i]);
    if (nan ? (got & 0x7fffu) <= 0x7f80u || (got & 0x7f80u) != 0x7f80u : got != want) {
      if (++mismatches < 5) INFO("element " << i << " bits " << std::hex << got << " want " << want);
    }
    uint32_t back_bits;
    std::memcpy(&back_bits, &back[i], 4);
    CHECK(back_bits == static_cast<uint32_t>(got) << 16);  // widening is exact
  }
  CHECK(mismatches == 0);
}

// The device's clock (AddDeviceClock, what times the device waits inside CUDA graphs): a subtraction and a later
// addition leave the time between the two kernels' runs — here the host's sleep between their launches, each waited
// for — and pairs accumulate; modulo 2^64, whatever the word held before.
TEST_CASE("kernels: the device clock: a subtraction, then an addition, add the time between them") {
  for (uint64_t start : {uint64_t{0}, ~uint64_t{0} - 5}) {
    CAPTURE(start);
    Dev<uint64_t> acc(std::vector<uint64_t>{start});
    uint64_t want_ns = 0;
    for (int pair = 0; pair < 2; ++pair) {
      REQUIRE(AddDeviceClock(acc.get(), /*add=*/false, nullptr) == cudaSuccess);
      REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      want_ns += 30'000'000;
      REQUIRE(AddDeviceClock(acc.get(), /*add=*/true, nullptr) == cudaSuccess);
      REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
      const uint64_t gained = acc.Get()[0] - start;  // modulo 2^64
      CHECK(gained >= want_ns);
      CHECK(gained < want_ns + 2'000'000'000ull);  // the launches' own time: far below 2 s
    }
  }
}

// ---- semantics of the built-ins (the same expectations hold on a GPU) ----

TEST_CASE("sim semantics: shuffles with widths, votes, barrier predicates") {
  namespace t = ms::kernels::testing;
  const int threads = 64;
  for (int width : {32, 16, 8, 4, 1}) {
    CAPTURE(width);
    Dev<int> out(threads * 4);
    REQUIRE(t::Shuffles(out.get(), threads, width) == cudaSuccess);
    const auto got = out.Get();
    for (int tid = 0; tid < threads; ++tid) {
      const int lane = tid % 32, seg = lane / width * width, base = tid - lane;
      const int v = 1000 + tid;
      CAPTURE(tid);
      CHECK(got[4 * tid + 0] == 1000 + base + seg + 3 % width);
      CHECK(got[4 * tid + 1] == (lane - seg >= 2 ? v - 2 : v));
      CHECK(got[4 * tid + 2] == (lane - seg + 5 < width ? v + 5 : v));
      // xor (PTX shfl.bfly): a source lane above the segment returns the caller's own value; one below it
      // (possible with width 1) is read.
      CHECK(got[4 * tid + 3] == ((lane ^ 1) <= seg + width - 1 ? 1000 + base + (lane ^ 1) : v));
    }
  }
  {
    Dev<unsigned> out(threads * 3);
    REQUIRE(t::Votes(out.get(), threads) == cudaSuccess);
    const auto got = out.Get();
    for (int tid = 0; tid < threads; ++tid) {
      const int base = tid / 32 * 32;
      unsigned ballot = 0;
      for (int l = 0; l < 32; ++l) ballot |= ((base + l) % 3 == 0 ? 1u : 0u) << l;
      CHECK(got[3 * tid + 0] == ballot);
      CHECK(got[3 * tid + 1] == (base == 0 ? 1u : 0u));
      CHECK(got[3 * tid + 2] == 1u);
    }
  }
  {
    Dev<int> out(threads);
    REQUIRE(t::HalfWarpShuffle(out.get(), threads) == cudaSuccess);
    const auto got = out.Get();
    for (int tid = 0; tid < threads; ++tid) {
      const int base = tid / 32 * 32, lane = tid % 32;
      CHECK(got[tid] == (lane < 16 ? base + 15 : base + 16 + 1));  // + the half-warp __shfl_down of 1s
    }
  }
  for (int n : {32, 96, 1024}) {
    Dev<int> out(n * 3);
    REQUIRE(t::BarrierVotes(out.get(), n) == cudaSuccess);
    const auto got = out.Get();
    for (int tid = 0; tid < n; ++tid) {
      CHECK(got[3 * tid + 0] == (n + 4) / 5);
      CHECK(got[3 * tid + 1] == 1);
      CHECK(got[3 * tid + 2] == 1);
    }
  }
}

TEST_CASE("sim semantics: atomics, 3-D indexing, dynamic shared memory above 48 KiB") {
  namespace t = ms::kernels::testing;
  {
    Dev<int> counters(std::vector<int>{0, -1, 0, 0});
    Dev<float> fsum(std::vector<float>{0.0f});
    Dev<unsigned long long> usum(std::vector<unsigned long long>{0});
    REQUIRE(t::Atomics(counters.get(), fsum.get(), usum.get(), 3, 96) == cudaSuccess);
    const auto c = counters.Get();
    CHECK(c[0] == 3 * 96);
    CHECK(c[1] == 95);
    CHECK(c[2] == 1);
    CHECK(c[3] == 1);
    CHECK(fsum.Get()[0] == 0.5f * 3 * 96);
    CHECK(usum.Get()[0] == 3ull * (95 * 96 / 2));
  }
  {
    const dim3 grid(2, 3, 2), block(4, 2, 3);
    const int n = 2 * 3 * 2 * 4 * 2 * 3;
    Dev<int> out(n);
    REQUIRE(t::Indexing(out.get(), grid, block) == cudaSuccess);
    const auto got = out.Get();
    for (int i = 0; i < n; ++i) CHECK(got[i] == i);
  }
  {
    const int threads = 128;
    const size_t bytes = 64 * 1024;
    Dev<float> out(threads);
    CHECK(t::DynamicShared(out.get(), threads, bytes, /*raise_limit=*/false) != cudaSuccess);
    REQUIRE(t::DynamicShared(out.get(), threads, bytes, /*raise_limit=*/true) == cudaSuccess);
    const auto got = out.Get();
    const int slots = static_cast<int>(bytes / sizeof(float) / threads);
    for (int tid = 0; tid < threads; ++tid) {
      const int m = threads - 1 - tid;
      CHECK(got[tid] == static_cast<float>(slots * m + slots * (slots - 1) / 2));
    }
  }
}

TEST_CASE("sim semantics: asynchronous copies (cp.async) land by __pipeline_wait_prior, zfill zeroes the tail") {
  namespace t = ms::kernels::testing;
  std::vector<float> in(704);
  for (size_t i = 0; i < in.size(); ++i) in[i] = 1.0f + static_cast<float>(i);
  Dev<float> d_in(in), out(960);
  REQUIRE(t::AsyncCopies(out.get(), d_in.get()) == cudaSuccess);
  const auto got = out.Get();
  for (int tid = 0; tid < 64; ++tid) {
    CAPTURE(tid);
    const int m = 63 - tid;
    for (int i = 0; i < 4; ++i) CHECK(got[4 * tid + i] == in[4 * tid + i]);            // own group 0
    for (int i = 0; i < 4; ++i) CHECK(got[256 + 4 * tid + i] == in[4 * m + i]);        // another's group 0
    for (int i = 0; i < 2; ++i) CHECK(got[512 + 2 * tid + i] == in[256 + 2 * m + i]);  // 8 bytes
    CHECK(got[640 + 4 * tid + 0] == in[384 + 4 * m + 0]);  // 16 bytes, zfill 8: two floats copied ...
    CHECK(got[640 + 4 * tid + 1] == in[384 + 4 * m + 1]);
    CHECK(got[640 + 4 * tid + 2] == 0.0f);  // ... two zeroed
    CHECK(got[640 + 4 * tid + 3] == 0.0f);
    CHECK(got[896 + tid] == in[640 + m]);  // 4 bytes
  }
}

#if MS_KERNELS_SIM
// ---- planted bugs: each checker of the emulator reports its bug, with the kernel and the source line ----

void ExpectLaunchError(cudaError_t err, cudaError_t code, const std::vector<std::string>& needles) {
  CHECK(err == code);
  const std::string msg = ms::sim::LastErrorMessage();
  INFO("message: " << msg);
  for (const auto& needle : needles) CHECK(msg.find(needle) != std::string::npos);
  CHECK(cudaGetLastError() == cudaSuccess);  // not sticky in the emulator
}

// cp.async: a copy is written only when its thread waits for its group, so reading one never waited for (here after a
// barrier alone) reads the shared memory's poison; misaligned and non-shared destinations fail the launch.
TEST_CASE("sim checkers: asynchronous copies read before __pipeline_wait_prior, misaligned, or not to shared memory") {
  namespace t = ms::kernels::testing;
  std::vector<float> in(64, 2.5f);
  Dev<float> d_in(in), out(64);
  REQUIRE(t::PlantedAsyncCopy(out.get(), d_in.get(), 0) == cudaSuccess);
  for (const float v : out.Get()) CHECK(std::isnan(v));
  ExpectLaunchError(t::PlantedAsyncCopy(out.get(), d_in.get(), 1), cudaErrorLaunchFailure,
                    {"planted_async_copy_kernel", "planted.cu:", "not aligned to 16 bytes"});
  ExpectLaunchError(t::PlantedAsyncCopy(out.get(), d_in.get(), 2), cudaErrorLaunchFailure,
                    {"planted_async_copy_kernel", "planted.cu:", "not in the block's shared memory"});
}

// ldmatrix (the tensor-core attention's fragment loads on the GPU) reads 16 rows of 32 bytes from shared memory, each
// 16-byte aligned: the emulator fails a load that asks anything else, naming the row.
TEST_CASE("sim checkers: a fragment load that ldmatrix could not make (global, misaligned, past shared memory)") {
  namespace t = ms::kernels::testing;
  Dev<__nv_bfloat16> in(16 * 16);
  REQUIRE(t::PlantedLdmatrix(in.get(), 0) == cudaSuccess);
  ExpectLaunchError(t::PlantedLdmatrix(in.get(), 1), cudaErrorLaunchFailure,
                    {"planted_ldmatrix_kernel", "planted.cu:", "row 0 ", "not in the block's shared memory"});
  ExpectLaunchError(t::PlantedLdmatrix(in.get(), 2), cudaErrorLaunchFailure,
                    {"planted_ldmatrix_kernel", "row 0 ", "not 16-byte aligned"});
  ExpectLaunchError(t::PlantedLdmatrix(in.get(), 3), cudaErrorLaunchFailure, {"row 1 ", "not 16-byte aligned"});
  ExpectLaunchError(t::PlantedLdmatrix(in.get(), 4), cudaErrorLaunchFailure,
                    {"row 15 ", "not in the block's shared memory"});
}

TEST_CASE("sim checkers: planted bugs are reported with kernel, block, thread and line") {
  namespace t = ms::kernels::testing;
  ms::sim::ResetStats();
  Dev<float> f(2048);
  Dev<int> i(2048);
  ExpectLaunchError(t::PlantedEarlyReturn(f.get()), cudaErrorLaunchFailure,
                    {"barrier divergence", "planted_early_return_kernel", "planted.cu:14", "block (0,0,0)", "exited"});
  ExpectLaunchError(t::PlantedTwoBarriers(f.get()), cudaErrorLaunchFailure,
                    {"different barriers", "planted.cu:20", "planted.cu:22"});
  ExpectLaunchError(t::PlantedMaskExcludesCaller(i.get()), cudaErrorLaunchFailure,
                    {"excludes the calling lane", "planted.cu:28", "0x0000ffff"});
  ExpectLaunchError(t::PlantedDeadlock(i.get()), cudaErrorLaunchFailure,
                    {"deadlock", "planted.cu:32", "planted.cu:33"});
  ExpectLaunchError(t::PlantedMismatchedCollectives(i.get()), cudaErrorLaunchFailure,
                    {"mismatched warp collectives", "__shfl_sync", "__ballot_sync"});
  ExpectLaunchError(t::PlantedTooManyThreads(f.get()), cudaErrorInvalidConfiguration, {"1025 threads"});
  ExpectLaunchError(t::PlantedTooMuchStaticShared(f.get()), cudaErrorLaunchFailure, {"48 KiB", "planted.cu:49"});
  ExpectLaunchError(t::PlantedHalfWarpMma(f.get()), cudaErrorLaunchFailure,
                    {"mismatched warp collectives", "planted_half_warp_mma_kernel", "wmma::mma_sync", "planted.cu:77",
                     "wmma::store_matrix_sync", "planted.cu:78"});

  // Not an error, but visible: a full-mask shuffle in a 48-thread block reads 16 nonexistent lanes.
  ms::sim::ResetStats();
  REQUIRE(t::PlantedPartialWarpShuffle(i.get()) == cudaSuccess);
  CHECK(ms::sim::GetStats().poisoned_reads == 16);
  const auto got = i.Get();
  CHECK(got[32] == -1);  // lane 0 of warp 1 read lane 16, which does not exist: all-ones bits
  CHECK(got[0] == 16);

  // The emulator is still usable after failed launches.
  Dev<int> out(64 * 3);
  CHECK(t::BarrierVotes(out.get(), 64) == cudaSuccess);
}

TEST_CASE("sim runtime: cudaMemcpy checks directions and bounds; cudaMalloc'd memory is poisoned") {
  Dev<float> d(4);
  std::vector<float> h(4, 1.0f);
  const auto fresh = d.Get();
  CHECK(std::isnan(fresh[0]));                                                                // not zeroed
  CHECK(cudaMemcpy(h.data(), d.get(), 16, cudaMemcpyHostToDevice) == cudaErrorInvalidValue);  // swapped
  CHECK(cudaMemcpy(d.get(), h.data(), 20, cudaMemcpyHostToDevice) == cudaErrorInvalidValue);  // past the end
  CHECK(cudaMemcpy(d.get(), h.data(), 16, cudaMemcpyHostToDevice) == cudaSuccess);
  CHECK(cudaGetLastError() == cudaErrorInvalidValue);
  CHECK(cudaGetLastError() == cudaSuccess);
}

// Overflow of a shared array: only AddressSanitizer sees it (the result looks right). Run by the ctest
// kernels_asan_shared_overflow in ASan builds only (MS_PLANTED_ASAN=1), which expects ASan's report.
TEST_CASE("sim checkers: shared-memory overflow (ASan builds, MS_PLANTED_ASAN=1)") {
  const char* env = std::getenv("MS_PLANTED_ASAN");
  if (!env || std::string(env) != "1") return;
  Dev<float> f(64);
  (void)ms::kernels::testing::PlantedSharedOverflow(f.get());
  FAIL("AddressSanitizer did not stop the overflow");
}

// A missing __syncthreads: ThreadSanitizer reports a data race on the shared array whatever the schedule.
// Run by the ctest kernels_tsan_missing_sync (MS_KERNELS_TSAN builds, MS_PLANTED_TSAN=1).
TEST_CASE("sim checkers: missing __syncthreads (TSan builds, MS_PLANTED_TSAN=1)") {
  const char* env = std::getenv("MS_PLANTED_TSAN");
  if (!env || std::string(env) != "1") return;
  Dev<float> f(64);
  CHECK(ms::kernels::testing::PlantedMissingSync(f.get()) == cudaSuccess);
}

// Warp collectives order the shared-memory accesses of their lanes (the emulator's model; in TSan builds a
// happens-before edge per collective: kernels_tsan, halt_on_error, fails on a false race here), and only those before
// them: a write after the last collective races with another lane's read (kernels_tsan_warp_race, MS_PLANTED_TSAN=2).
TEST_CASE("sim checkers: shared memory passed through warp collectives; a write after them races (MS_PLANTED_TSAN=2)") {
  const char* env = std::getenv("MS_PLANTED_TSAN");
  const bool race = env && std::string(env) == "2";
  Dev<float> f(32);
  REQUIRE(ms::kernels::testing::PlantedWarpRace(f.get(), race) == cudaSuccess);
  if (race) return;
  const auto got = f.Get();
  for (int lane = 0; lane < 32; ++lane) {
    float v = static_cast<float>((lane + 1) % 32);
    if (lane < 16) v += static_cast<float>(((lane ^ 1) + 1) % 32);
    v += static_cast<float>((lane + 5) % 32);
    if (lane == 1) v += 7.0f;  // s[7], as lane 7 wrote it
    CHECK(got[lane] == v);
  }
}
#endif  // MS_KERNELS_SIM

}  // namespace
}  // namespace ms::kernels
