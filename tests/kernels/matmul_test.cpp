// The wmma (tensor core) bf16 GEMM (kernels/matmul.cu) against ms::ops::ref::Gemm, and the semantics of
// nvcuda::wmma as the kernels use it (fragment round trips, fill_fragment, element-wise ops on x[], mma),
// through the one-warp probe kernel of matmul.cu. Built into test_kernels (emulator) and test_kernels_gpu;
// the emulator-only cases check that wmma misuse is reported.
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#if MS_KERNELS_SIM
#include "sim/simt.h"
#endif
#include <cuda_bf16.h>

#include "kernels.h"
#include "ops/ops.h"
#include "test_kernels.h"
#include "test_util.h"

namespace ms::kernels {
namespace {

using testing::Dev;
using testing::ExpectClose;
using testing::ExpectNoPoisonedReads;
using testing::Random;

std::vector<__nv_bfloat16> ToBf16(const std::vector<float>& v) {
  std::vector<__nv_bfloat16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16(v[i]);
  return out;
}
std::vector<float> ToFloat(const std::vector<__nv_bfloat16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}

TEST_CASE("kernels: bf16 wmma GEMM matches ops::ref::Gemm on the bf16-rounded inputs (rtol 1e-4, atol 1e-4)") {
  struct Shape {
    int64_t M, N, K;
  };
  struct Scale {
    float alpha, beta;
  };
#if MS_KERNELS_SIM
  ms::sim::ResetStats();  // earlier cases count poisoned reads on purpose
#endif
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Tails in every dimension, exact tiles, several tiles along M and N, several K stages; leading
  // dimensions tight (vector loads where they are multiples of 8) or padded by an odd amount.
  for (Shape s : {Shape{1, 1, 1}, Shape{17, 33, 9}, Shape{64, 64, 32}, Shape{70, 45, 100}, Shape{130, 72, 48}}) {
    for (int trans = 0; trans < 4; ++trans) {
      const bool ta = trans & 1, tb = trans & 2;
      for (int64_t pad : {0, 5}) {
        for (Scale sc : {Scale{1.0f, 0.0f}, Scale{0.75f, -1.5f}}) {
          CAPTURE(s.M);
          CAPTURE(s.N);
          CAPTURE(s.K);
          CAPTURE(ta);
          CAPTURE(tb);
          CAPTURE(pad);
          CAPTURE(sc.alpha);
          CAPTURE(sc.beta);
          const int64_t lda = (ta ? s.M : s.K) + pad, ldb = (tb ? s.K : s.N) + pad, ldc = s.N + pad;
          const int64_t a_rows = ta ? s.K : s.M, b_rows = tb ? s.N : s.K;
          const uint32_t seed = static_cast<uint32_t>(1000 + 16 * trans + pad);
          const auto a = ToBf16(Random(a_rows * lda, seed)), b = ToBf16(Random(b_rows * ldb, seed + 1));
          std::vector<float> c0 = Random(s.M * ldc, seed + 2);
          if (sc.beta == 0.0f) {  // beta == 0 overwrites: NaNs in C must not come through
            for (int64_t i = 0; i < s.M; ++i) {
              for (int64_t j = 0; j < s.N; ++j) c0[i * ldc + j] = nan;
            }
          }
          std::vector<float> want(c0);
          const auto af = ToFloat(a), bf = ToFloat(b);
          ops::ref::Gemm(ta, tb, s.M, s.N, s.K, sc.alpha, af.data(), lda, bf.data(), ldb, sc.beta, want.data(), ldc);

          Dev<__nv_bfloat16> d_a(a), d_b(b);
          Dev<float> d_c(c0);
          REQUIRE(GemmBf16(ta, tb, s.M, s.N, s.K, sc.alpha, d_a.get(), lda, d_b.get(), ldb, sc.beta, d_c.get(), ldc,
                           nullptr) == cudaSuccess);
          ExpectClose(d_c.Get(), want, 1e-4f, 1e-4f, "gemm_bf16 C (padding untouched)");
        }
      }
    }
  }
  ExpectNoPoisonedReads();
}

TEST_CASE("kernels: bf16 wmma GEMM edge cases: K == 0 scales C by beta, empty M/N, invalid arguments") {
  const int64_t M = 5, N = 7;
  const auto c0 = Random(M * N, 50);
  Dev<float> d_c(c0);
  Dev<__nv_bfloat16> d_ab(16);
  REQUIRE(GemmBf16(false, false, M, N, 0, 2.0f, d_ab.get(), 1, d_ab.get(), N, 0.5f, d_c.get(), N, nullptr) ==
          cudaSuccess);
  std::vector<float> want(c0);
  for (float& v : want) v *= 0.5f;
  ExpectClose(d_c.Get(), want, 0.0f, 0.0f, "K == 0: C *= beta");
  CHECK(GemmBf16(false, false, 0, N, 3, 1.0f, d_ab.get(), 3, d_ab.get(), N, 0.0f, d_c.get(), N, nullptr) ==
        cudaSuccess);
  CHECK(d_c.Get() == want);  // untouched
  CHECK(GemmBf16(false, false, M, N, 3, 1.0f, d_ab.get(), 2, d_ab.get(), N, 0.0f, d_c.get(), N, nullptr) ==
        cudaErrorInvalidValue);  // lda < K
  CHECK(GemmBf16(true, true, M, N, 3, 1.0f, d_ab.get(), M, d_ab.get(), 2, 0.0f, d_c.get(), N, nullptr) ==
        cudaErrorInvalidValue);  // ldb < K (B stored (N, K))
  CHECK(GemmBf16(false, false, M, N, 3, 1.0f, d_ab.get(), 3, d_ab.get(), N, 0.0f, d_c.get(), N - 1, nullptr) ==
        cudaErrorInvalidValue);  // ldc < N
  CHECK(GemmBf16(false, false, -1, N, 3, 1.0f, d_ab.get(), 3, d_ab.get(), N, 0.0f, d_c.get(), N, nullptr) ==
        cudaErrorInvalidValue);
  CHECK(cudaGetLastError() == cudaSuccess);
}

// ---- wmma semantics (the probe: one warp, one m16n16k16 step on tiles staged in shared memory) ----

// Element (r, c) of a 16x16 tile stored with leading dimension ld in the given layout.
size_t At(int r, int c, int ld, bool col_major) {
  return col_major ? static_cast<size_t>(c) * ld + r : static_cast<size_t>(r) * ld + c;
}

// A 16 x ld buffer: the identity in its 16x16 tile (symmetric: the same in both layouts), 0 elsewhere.
std::vector<__nv_bfloat16> IdentityBf16(int ld) {
  std::vector<__nv_bfloat16> v(16 * ld, __float2bfloat16(0.0f));
  for (int i = 0; i < 16; ++i) v[At(i, i, ld, false)] = __float2bfloat16(1.0f);
  return v;
}

struct ProbeOut {
  cudaError_t err;
  std::vector<float> d;
};

ProbeOut RunProbe(const std::vector<__nv_bfloat16>& a, const std::vector<__nv_bfloat16>& b, const std::vector<float>& c,
                  const std::vector<float>& d0, const testing::WmmaProbeArgs& args) {
  Dev<__nv_bfloat16> d_a(a), d_b(b);
  Dev<float> d_c(c), d_d(d0);
  const cudaError_t err = testing::WmmaProbe(d_d.get(), d_a.get(), d_b.get(), d_c.get(), args, nullptr);
  return ProbeOut{err, d_d.Get()};
}

TEST_CASE("wmma semantics: load/store round trips in row and col major, fill_fragment, x[] scaling (exact)") {
  // Round trip of A through the tensor core: D = A * I + 0 == A exactly, for both layouts of A and padded
  // leading dimensions; likewise B (D = I * B).
  for (bool col : {false, true}) {
    for (int ld : {16, 24}) {
      CAPTURE(col);
      CAPTURE(ld);
      const auto x = ToBf16(Random(16 * ld, static_cast<uint32_t>(60 + ld + col)));
      const std::vector<float> zero(16 * 16, 0.0f);
      testing::WmmaProbeArgs args;
      args.fill_c = true;  // fill_value 0
      {
        args.a_col = col;
        args.lda = ld;
        const auto out = RunProbe(x, IdentityBf16(16), zero, zero, args);
        REQUIRE(out.err == cudaSuccess);
        for (int r = 0; r < 16; ++r) {
          for (int c = 0; c < 16; ++c) CHECK(out.d[At(r, c, 16, false)] == __bfloat162float(x[At(r, c, ld, col)]));
        }
      }
      {
        args.a_col = false;
        args.lda = 16;
        args.b_col = col;
        args.ldb = ld;
        const auto out = RunProbe(IdentityBf16(16), x, zero, zero, args);
        REQUIRE(out.err == cudaSuccess);
        for (int r = 0; r < 16; ++r) {
          for (int c = 0; c < 16; ++c) CHECK(out.d[At(r, c, 16, false)] == __bfloat162float(x[At(r, c, ld, col)]));
        }
      }
    }
  }
  // Accumulator round trip: load C in one layout, store D in another (A = B = 0); the elements of D's
  // buffer outside the tile are not written.
  for (bool c_col : {false, true}) {
    for (bool d_col : {false, true}) {
      CAPTURE(c_col);
      CAPTURE(d_col);
      const int ld = 20;
      const auto c = Random(16 * ld, 70), d0 = Random(16 * ld, 71);
      testing::WmmaProbeArgs args;
      args.fill_a = args.fill_b = true;  // fill_value 0
      args.c_col = c_col;
      args.d_col = d_col;
      args.ldc = ld;
      const auto out = RunProbe(IdentityBf16(16), IdentityBf16(16), c, d0, args);
      REQUIRE(out.err == cudaSuccess);
      std::vector<float> want(d0);
      for (int r = 0; r < 16; ++r) {
        for (int cc = 0; cc < 16; ++cc) want[At(r, cc, ld, d_col)] = c[At(r, cc, ld, c_col)];
      }
      CHECK(out.d == want);
    }
  }
  const std::vector<float> zero(16 * 16, 0.0f);
  {  // fill_fragment of all three: every element of D is 16 * 0.5 * 0.5 + 0.5
    testing::WmmaProbeArgs args;
    args.fill_a = args.fill_b = args.fill_c = true;
    args.fill_value = 0.5f;
    const auto out = RunProbe(IdentityBf16(16), IdentityBf16(16), zero, zero, args);
    REQUIRE(out.err == cudaSuccess);
    for (float v : out.d) CHECK(v == 4.5f);
  }
  {  // x[] scaling: every a.x[i] *= 2 after the load, every d.x[i] *= -0.25 after the mma: D = -0.5 * A
    const auto x = ToBf16(Random(16 * 16, 72));
    testing::WmmaProbeArgs args;
    args.fill_c = true;
    args.scale_a = 2.0f;
    args.scale_d = -0.25f;
    const auto out = RunProbe(x, IdentityBf16(16), zero, zero, args);
    REQUIRE(out.err == cudaSuccess);
    for (int i = 0; i < 256; ++i) CHECK(out.d[i] == -0.5f * __bfloat162float(x[i]));
  }
}

TEST_CASE("wmma semantics: mma_sync D = A * B + C for all layouts (fp32 accumulation: rtol 1e-5, atol 1e-6)") {
  for (int layouts = 0; layouts < 16; ++layouts) {
    testing::WmmaProbeArgs args;
    args.a_col = layouts & 1;
    args.b_col = layouts & 2;
    args.c_col = layouts & 4;
    args.d_col = layouts & 8;
    args.lda = 24;
    args.ldb = 32;
    args.ldc = 16;
    CAPTURE(layouts);
    const uint32_t seed = static_cast<uint32_t>(80 + 3 * layouts);
    const auto a = ToBf16(Random(16 * 24, seed)), b = ToBf16(Random(16 * 32, seed + 1));
    const auto c = Random(16 * 16, seed + 2);
    const auto out = RunProbe(a, b, c, std::vector<float>(256, 0.0f), args);
    REQUIRE(out.err == cudaSuccess);
    std::vector<float> want(256);
    for (int r = 0; r < 16; ++r) {
      for (int cc = 0; cc < 16; ++cc) {
        double acc = c[At(r, cc, 16, args.c_col)];
        for (int k = 0; k < 16; ++k) {
          acc += static_cast<double>(__bfloat162float(a[At(r, k, 24, args.a_col)])) *
                 __bfloat162float(b[At(k, cc, 32, args.b_col)]);
        }
        want[At(r, cc, 16, args.d_col)] = static_cast<float>(acc);
      }
    }
    ExpectClose(out.d, want, 1e-5f, 1e-6f, "wmma mma_sync");
  }
  {  // fill A with 1: D = column sums of B + C
    testing::WmmaProbeArgs args;
    args.fill_a = true;
    args.fill_value = 1.0f;
    const auto b = ToBf16(Random(256, 90));
    const auto c = Random(256, 91);
    const auto out = RunProbe(IdentityBf16(16), b, c, std::vector<float>(256, 0.0f), args);
    REQUIRE(out.err == cudaSuccess);
    std::vector<float> want(256);
    for (int r = 0; r < 16; ++r) {
      for (int cc = 0; cc < 16; ++cc) {
        double acc = c[r * 16 + cc];
        for (int k = 0; k < 16; ++k) acc += __bfloat162float(b[k * 16 + cc]);
        want[r * 16 + cc] = static_cast<float>(acc);
      }
    }
    ExpectClose(out.d, want, 1e-5f, 1e-6f, "wmma mma_sync with a filled A");
  }
}

#if MS_KERNELS_SIM
// Emulator only (on a GPU these are faults, not reports): the wmma argument checks.
TEST_CASE("sim checkers: wmma ldm and pointer alignment violations are launch failures") {
  const std::vector<float> zero(16 * 20, 0.0f);
  const auto id = IdentityBf16(20);
  auto expect = [](const ProbeOut& out, const std::vector<std::string>& needles) {
    CHECK(out.err == cudaErrorLaunchFailure);
    const std::string msg = ms::sim::LastErrorMessage();
    INFO("message: " << msg);
    for (const auto& needle : needles) CHECK(msg.find(needle) != std::string::npos);
    CHECK(cudaGetLastError() == cudaSuccess);
  };
  testing::WmmaProbeArgs args;
  args.lda = 20;  // 40 bytes: not a multiple of 16
  expect(RunProbe(id, id, zero, zero, args),
         {"wmma_probe_kernel", "semantics.cu:", "wmma::load_matrix_sync (matrix_a)", "ldm 20", "multiple of 8"});
  args.lda = 16;
  args.a_offset = 4;  // 8 bytes into a 32-byte aligned shared array
  expect(RunProbe(id, id, zero, zero, args), {"wmma_probe_kernel", "256-bit (32-byte) aligned"});
  args.a_offset = 16;  // 32 bytes: fine
  CHECK(RunProbe(id, id, zero, zero, args).err == cudaSuccess);
}
#endif  // MS_KERNELS_SIM

}  // namespace
}  // namespace ms::kernels
