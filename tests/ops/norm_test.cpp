// LayerNorm and GeLU: fast against reference, and the hand-derived reference gradients against finite
// differences.
#include <doctest/doctest.h>

#include "ops/ops.h"
#include "ops_test_util.h"

namespace ms::ops {
namespace {

using testing::BitwiseEqual;
using testing::CheckClose;
using testing::CheckGradFd;
using testing::Dot;
using testing::Randn;

void CheckLayerNorm(int64_t N, int64_t C, uint64_t seed) {
  CAPTURE(N);
  CAPTURE(C);
  Rng rng(seed);
  auto x = Randn(rng, N * C, 2.0), w = Randn(rng, C), b = Randn(rng, C);
  for (int64_t i = 0; i < N; ++i) x[i * C] += 3.0f * static_cast<float>(i);  // rows with a nonzero mean
  std::vector<float> out(N * C), mean(N), rstd(N), out_ref(N * C), mean_ref(N), rstd_ref(N);
  const float eps = 1e-5f;
  LayerNormForward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, eps);
  ref::LayerNormForward(out_ref.data(), mean_ref.data(), rstd_ref.data(), x.data(), w.data(), b.data(), N, C, eps);
  // fp32 row statistics over C <= 300 terms: a few ulps of the O(1) outputs.
  CheckClose(out, out_ref, 1e-5, 1e-5, "layernorm out");
  CheckClose(mean, mean_ref, 1e-5, 1e-6, "layernorm mean");
  CheckClose(rstd, rstd_ref, 1e-5, 0, "layernorm rstd");

  auto dout = Randn(rng, N * C);
  auto dx = Randn(rng, N * C), dw = Randn(rng, C), db = Randn(rng, C);  // ACCUMULATES
  auto dx_ref = dx, dw_ref = dw, db_ref = db;
  LayerNormBackward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
  ref::LayerNormBackward(dx_ref.data(), dw_ref.data(), db_ref.data(), dout.data(), x.data(), w.data(), mean.data(),
                         rstd.data(), N, C);
  CheckClose(dx, dx_ref, 1e-4, 1e-5, "layernorm dx");  // dx cancels two sums of C terms
  CheckClose(dw, dw_ref, 1e-5, 5e-5, "layernorm dw");  // sums over N rows
  CheckClose(db, db_ref, 1e-5, 5e-5, "layernorm db");
}

TEST_CASE("LayerNorm fast matches the reference") {
  CheckLayerNorm(7, 33, 31);
  CheckLayerNorm(1, 3, 32);
  CheckLayerNorm(173, 211, 33);  // parallel path, several column blocks, a ragged last block
}

TEST_CASE("reference LayerNorm backward equals finite differences") {
  Rng rng(34);
  const int64_t N = 4, C = 9;
  auto x = Randn(rng, N * C), w = Randn(rng, C), b = Randn(rng, C), r = Randn(rng, N * C);
  std::vector<float> out(N * C), mean(N), rstd(N);
  auto loss = [&] {
    ref::LayerNormForward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, 1e-5f);
    return Dot(out, r);
  };
  loss();
  std::vector<float> dx(N * C, 0.0f), dw(C, 0.0f), db(C, 0.0f);
  ref::LayerNormBackward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
  // Step 3e-3: truncation error ~1e-5, float rounding of the loss ~1e-6 / 6e-3.
  CheckGradFd(x, dx, loss, 3e-3, 1e-2, 2e-3, "dx");
  CheckGradFd(w, dw, loss, 3e-3, 1e-2, 2e-3, "dw");
  CheckGradFd(b, db, loss, 3e-3, 1e-2, 2e-3, "db");
}

TEST_CASE("GeLU fast matches the reference, forward and backward, in place too") {
  Rng rng(41);
  for (int64_t n : {1, 7, 1001, 40009}) {
    CAPTURE(n);
    auto x = Randn(rng, n, 3.0);
    x[0] = -9.0f;  // tails: tanh saturates
    if (n > 1) x[1] = 9.0f;
    std::vector<float> y(n), y_ref(n);
    GeluForward(y.data(), x.data(), n);
    ref::GeluForward(y_ref.data(), x.data(), n);
    CheckClose(y, y_ref, 2e-6, 1e-6, "gelu");  // float tanh vs double tanh
    auto dout = Randn(rng, n);
    std::vector<float> dx(n, 5.0f), dx_ref(n);  // WRITES
    GeluBackward(dx.data(), x.data(), dout.data(), n);
    ref::GeluBackward(dx_ref.data(), x.data(), dout.data(), n);
    CheckClose(dx, dx_ref, 1e-5, 1e-6, "gelu backward");
    auto inplace = x;
    GeluForward(inplace.data(), inplace.data(), n);
    CHECK(BitwiseEqual(inplace, y));
    auto inplace_d = dout;
    GeluBackward(inplace_d.data(), x.data(), inplace_d.data(), n);
    CHECK(BitwiseEqual(inplace_d, dx));
  }
}

TEST_CASE("reference GeLU backward equals finite differences") {
  Rng rng(42);
  const int64_t n = 301;
  auto x = Randn(rng, n, 2.5);
  std::vector<float> ones(n, 1.0f), grad(n);
  ref::GeluBackward(grad.data(), x.data(), ones.data(), n);
  int64_t i_cur = 0;
  auto loss = [&] {  // gelu is elementwise: perturbing x[i] moves only out[i]
    float y;
    ref::GeluForward(&y, &x[i_cur], 1);
    return static_cast<double>(y);
  };
  int failures = 0;
  for (i_cur = 0; i_cur < n; ++i_cur) {
    const double fd = testing::CentralDiff(x, i_cur, 1e-3, loss);
    if (std::fabs(fd - grad[i_cur]) > 5e-4 + 1e-3 * std::fabs(fd)) ++failures;
  }
  CHECK(failures == 0);
}

}  // namespace
}  // namespace ms::ops
