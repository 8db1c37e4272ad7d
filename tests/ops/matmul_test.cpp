// Gemm and the linear layer: fast (oneDNN) against the reference loops, and the reference backward
// against finite differences.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "ops/ops.h"
#include "ops_test_util.h"

namespace ms::ops {
namespace {

using testing::CheckClose;
using testing::CheckGradFd;
using testing::Dot;
using testing::Randn;

// fp32 GEMM with K <= 64 terms of O(1): both sides round to ~1e-6 of the result.
constexpr double kGemmRtol = 1e-5, kGemmAtol = 2e-5;

TEST_CASE("Gemm matches the reference for every transpose, with strides, alpha and beta") {
  Rng rng(11);
  const int64_t M = 7, N = 33, K = 13;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (float beta : {0.0f, 0.3f, 1.0f}) {
        CAPTURE(ta);
        CAPTURE(tb);
        CAPTURE(beta);
        // Padded row strides: the padding must be neither read into C nor written.
        const int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 2, ldc = N + 5;
        auto A = Randn(rng, (ta ? K : M) * lda);
        auto B = Randn(rng, (tb ? N : K) * ldb);
        auto C = Randn(rng, M * ldc);
        if (beta == 0.0f) C[0] = std::numeric_limits<float>::quiet_NaN();  // beta 0: C is not read
        auto C_ref = C;
        Gemm(ta, tb, M, N, K, 0.7f, A.data(), lda, B.data(), ldb, beta, C.data(), ldc);
        ref::Gemm(ta, tb, M, N, K, 0.7f, A.data(), lda, B.data(), ldb, beta, C_ref.data(), ldc);
        for (int64_t i = 0; i < M; ++i) {  // padding columns untouched (both start equal except C[0])
          for (int64_t j = N; j < ldc; ++j) CHECK(C[i * ldc + j] == C_ref[i * ldc + j]);
        }
        CHECK_FALSE(std::isnan(C[0]));
        CheckClose(C, C_ref, kGemmRtol, kGemmAtol, "Gemm");
      }
    }
  }
}

TEST_CASE("Gemm edge sizes: K == 0 scales C by beta, empty M or N is a no-op") {
  Rng rng(12);
  auto C = Randn(rng, 5 * 3);
  auto C0 = C;
  Gemm(false, false, 5, 3, 0, 1.0f, nullptr, 1, nullptr, 3, 0.5f, C.data(), 3);
  for (size_t i = 0; i < C.size(); ++i) CHECK(C[i] == C0[i] * 0.5f);
  Gemm(false, false, 5, 3, 0, 1.0f, nullptr, 1, nullptr, 3, 0.0f, C.data(), 3);
  for (float c : C) CHECK(c == 0.0f);
  C = C0;
  Gemm(false, false, 0, 3, 4, 1.0f, nullptr, 4, nullptr, 3, 0.0f, C.data(), 3);
  CHECK(testing::BitwiseEqual(C, C0));
}

TEST_CASE("Gemm on a larger odd shape") {
  Rng rng(13);
  const int64_t M = 131, N = 77, K = 301;
  auto A = Randn(rng, M * K), B = Randn(rng, N * K), C = Randn(rng, M * N);
  auto C_ref = C;
  Gemm(false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 1.0f, C.data(), N);
  ref::Gemm(false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 1.0f, C_ref.data(), N);
  CheckClose(C, C_ref, 1e-5, 1e-4, "Gemm 131x77x301");  // sums of 301 terms of O(1)
}

TEST_CASE("MatmulForward and MatmulBackward match the reference, with and without bias") {
  Rng rng(21);
  const int64_t N = 7, IC = 33, OC = 19;
  for (bool with_bias : {true, false}) {
    CAPTURE(with_bias);
    auto inp = Randn(rng, N * IC), w = Randn(rng, OC * IC), bias = Randn(rng, OC);
    const float* b = with_bias ? bias.data() : nullptr;
    std::vector<float> out(N * OC, 7.0f), out_ref(N * OC, -7.0f);  // WRITES: old contents must not matter
    MatmulForward(out.data(), inp.data(), w.data(), b, N, IC, OC);
    ref::MatmulForward(out_ref.data(), inp.data(), w.data(), b, N, IC, OC);
    CheckClose(out, out_ref, kGemmRtol, kGemmAtol, "MatmulForward");

    // Backward ACCUMULATES into whatever the gradients hold.
    auto dout = Randn(rng, N * OC);
    auto dinp = Randn(rng, N * IC), dw = Randn(rng, OC * IC), dbias = Randn(rng, OC);
    auto dinp_ref = dinp, dw_ref = dw, dbias_ref = dbias;
    MatmulBackward(dinp.data(), dw.data(), with_bias ? dbias.data() : nullptr, dout.data(), inp.data(), w.data(), N, IC,
                   OC);
    ref::MatmulBackward(dinp_ref.data(), dw_ref.data(), with_bias ? dbias_ref.data() : nullptr, dout.data(), inp.data(),
                        w.data(), N, IC, OC);
    CheckClose(dinp, dinp_ref, kGemmRtol, kGemmAtol, "MatmulBackward dinp");
    CheckClose(dw, dw_ref, kGemmRtol, kGemmAtol, "MatmulBackward dw");
    CheckClose(dbias, dbias_ref, kGemmRtol, kGemmAtol, "MatmulBackward dbias");
  }
}

TEST_CASE("MatmulBackward with dinp null leaves it alone; large shapes use the parallel bias sum") {
  Rng rng(22);
  const int64_t N = 301, IC = 45, OC = 130;  // N * OC > the parallel threshold, OC spans 3 column blocks
  auto inp = Randn(rng, N * IC), w = Randn(rng, OC * IC), dout = Randn(rng, N * OC);
  std::vector<float> dw(OC * IC, 0.0f), dbias(OC, 1.0f), dw_ref = dw, dbias_ref = dbias;
  MatmulBackward(nullptr, dw.data(), dbias.data(), dout.data(), inp.data(), w.data(), N, IC, OC);
  ref::MatmulBackward(nullptr, dw_ref.data(), dbias_ref.data(), dout.data(), inp.data(), w.data(), N, IC, OC);
  CheckClose(dw, dw_ref, 1e-5, 1e-4, "dw");
  CheckClose(dbias, dbias_ref, 1e-5, 1e-4, "dbias");
}

TEST_CASE("reference MatmulBackward equals finite differences of sum(out * r)") {
  Rng rng(23);
  const int64_t N = 5, IC = 9, OC = 7;
  auto inp = Randn(rng, N * IC), w = Randn(rng, OC * IC), bias = Randn(rng, OC), r = Randn(rng, N * OC);
  std::vector<float> out(N * OC);
  auto loss = [&] {
    ref::MatmulForward(out.data(), inp.data(), w.data(), bias.data(), N, IC, OC);
    return Dot(out, r);
  };
  std::vector<float> dinp(N * IC, 0.0f), dw(OC * IC, 0.0f), dbias(OC, 0.0f);
  ref::MatmulBackward(dinp.data(), dw.data(), dbias.data(), r.data(), inp.data(), w.data(), N, IC, OC);
  // The loss is linear in each input: only float rounding of out (~1e-7 * 35 terms) limits the check.
  CheckGradFd(inp, dinp, loss, 1e-2, 1e-3, 1e-4, "dinp");
  CheckGradFd(w, dw, loss, 1e-2, 1e-3, 1e-4, "dw");
  CheckGradFd(bias, dbias, loss, 1e-2, 1e-3, 1e-4, "dbias");
}

}  // namespace
}  // namespace ms::ops
