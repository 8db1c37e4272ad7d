// AdamW and LAMB: closed forms, fast against reference, sharded LAMB equal to unsharded.
#include <doctest/doctest.h>

#include <cmath>

#include "ops/ops.h"
#include "ops_test_util.h"

namespace ms::ops {
namespace {

using testing::BitwiseEqual;
using testing::CheckClose;
using testing::Randn;

TEST_CASE("AdamW first step equals the closed form p(1 - lr wd) - lr g / (|g| + eps)") {
  // From m = v = 0, step 1: mhat = g, vhat = g^2 exactly.
  Rng rng(131);
  const int64_t n = 1001;
  const AdamParams hp{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f};
  auto p0 = Randn(rng, n), g = Randn(rng, n, 0.1);
  for (bool fast : {false, true}) {
    CAPTURE(fast);
    auto p = p0;
    std::vector<float> m(n, 0.0f), v(n, 0.0f);
    (fast ? &AdamWStep : &ref::AdamWStep)(p.data(), g.data(), m.data(), v.data(), n, hp, 1);
    std::vector<float> want(n), want_m(n), want_v(n);
    for (int64_t i = 0; i < n; ++i) {
      const double gi = g[i];
      want[i] = static_cast<float>(p0[i] * (1.0 - 1e-2 * 0.1) - 1e-2 * gi / (std::fabs(gi) + 1e-8));
      want_m[i] = static_cast<float>(0.1 * gi);
      want_v[i] = static_cast<float>(0.05 * gi * gi);
    }
    CheckClose(p, want, 1e-6, 1e-7, "p");
    CheckClose(m, want_m, 1e-6, 0, "m");
    CheckClose(v, want_v, 1e-5, 0, "v");
  }
  // One scalar by hand: p = 1, g = 0.5, lr 0.1, wd 0.01: 1 * 0.999 - 0.1 * 0.5 / 0.5 = 0.899.
  float p = 1.0f, gs = 0.5f, m = 0.0f, v = 0.0f;
  AdamWStep(&p, &gs, &m, &v, 1, AdamParams{0.1f, 0.9f, 0.999f, 1e-8f, 0.01f}, 1);
  CHECK(p == doctest::Approx(0.899).epsilon(1e-6));
}

TEST_CASE("AdamW fast matches the reference over several steps") {
  Rng rng(132);
  const int64_t n = 70001;  // parallel path
  const AdamParams hp{3e-3f, 0.9f, 0.999f, 1e-8f, 0.05f};
  auto p = Randn(rng, n);
  auto m = Randn(rng, n, 0.01);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(1e-4 * rng.NextDouble());
  auto p_ref = p, m_ref = m, v_ref = v;
  for (int64_t step = 1; step <= 5; ++step) {
    auto g = Randn(rng, n, 0.01);
    AdamWStep(p.data(), g.data(), m.data(), v.data(), n, hp, step);
    ref::AdamWStep(p_ref.data(), g.data(), m_ref.data(), v_ref.data(), n, hp, step);
  }
  // fp32 vs double arithmetic of the same formula; the update is lr-sized, so errors are ~1e-7 * lr.
  CheckClose(p, p_ref, 1e-6, 1e-7, "p");
  CheckClose(m, m_ref, 1e-5, 1e-9, "m");
  CheckClose(v, v_ref, 1e-5, 1e-12, "v");
}

TEST_CASE("LAMB: fast matches the reference; the update has norm lr * ||p||; sharding does not matter") {
  Rng rng(141);
  const int64_t n = 50021;
  const AdamParams hp{0.0f, 0.9f, 0.999f, 1e-6f, 0.01f};
  const float lr = 0.02f;
  auto p = Randn(rng, n, 0.5), g = Randn(rng, n, 0.01);
  auto m = Randn(rng, n, 0.001);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(1e-4 * rng.NextDouble());
  const int64_t step = 3;

  auto m1 = m, v1 = v, m_ref = m, v_ref = v;
  std::vector<float> u(n), u_ref(n);
  LambDirection(u.data(), p.data(), g.data(), m1.data(), v1.data(), n, hp, step);
  ref::LambDirection(u_ref.data(), p.data(), g.data(), m_ref.data(), v_ref.data(), n, hp, step);
  CheckClose(u, u_ref, 1e-5, 1e-7, "u");
  CheckClose(m1, m_ref, 1e-5, 1e-10, "m");
  CheckClose(v1, v_ref, 1e-5, 1e-12, "v");

  const float trust = LambTrustRatio(SumSquares(p.data(), n), SumSquares(u.data(), n));
  CHECK(trust > 0.0f);
  auto p1 = p, p_ref = p;
  LambApply(p1.data(), u.data(), n, lr, trust);
  ref::LambApply(p_ref.data(), u.data(), n, lr, trust);
  CheckClose(p1, p_ref, 1e-6, 1e-8, "p");
  double step_sq = 0;
  for (int64_t i = 0; i < n; ++i) step_sq += (static_cast<double>(p1[i]) - p[i]) * (static_cast<double>(p1[i]) - p[i]);
  CHECK(std::sqrt(step_sq) == doctest::Approx(lr * std::sqrt(SumSquares(p.data(), n))).epsilon(1e-4));

  // Two shards with norms summed across them give the same result as the whole tensor.
  const int64_t cut = 20011;
  auto m2 = m, v2 = v, p2 = p;
  std::vector<float> u2(n);
  LambDirection(u2.data(), p.data(), g.data(), m2.data(), v2.data(), cut, hp, step);
  LambDirection(u2.data() + cut, p.data() + cut, g.data() + cut, m2.data() + cut, v2.data() + cut, n - cut, hp, step);
  CHECK(BitwiseEqual(u2, u));
  const float trust2 = LambTrustRatio(SumSquares(p.data(), cut) + SumSquares(p.data() + cut, n - cut),
                                      SumSquares(u2.data(), cut) + SumSquares(u2.data() + cut, n - cut));
  CHECK(trust2 == doctest::Approx(trust).epsilon(1e-6));

  // Degenerate norms give a trust ratio of 1.
  CHECK(LambTrustRatio(0.0, 4.0) == 1.0f);
  CHECK(LambTrustRatio(4.0, 0.0) == 1.0f);
  CHECK(LambTrustRatio(9.0, 4.0) == doctest::Approx(1.5));
}

TEST_CASE("LAMB with zero weights and zero decay applies the plain Adam direction (trust 1)") {
  const int64_t n = 9;
  std::vector<float> p(n, 0.0f), g(n), m(n, 0.0f), v(n, 0.0f), u(n);
  for (int64_t i = 0; i < n; ++i) g[i] = static_cast<float>(i) - 4.0f;
  const AdamParams hp{0.0f, 0.9f, 0.999f, 1e-6f, 0.0f};
  LambDirection(u.data(), p.data(), g.data(), m.data(), v.data(), n, hp, 1);
  const float trust = LambTrustRatio(SumSquares(p.data(), n), SumSquares(u.data(), n));
  CHECK(trust == 1.0f);
  LambApply(p.data(), u.data(), n, 0.1f, trust);
  for (int64_t i = 0; i < n; ++i) {
    const double gi = g[i];
    CHECK(p[i] == doctest::Approx(-0.1 * gi / (std::fabs(gi) + 1e-6)).epsilon(1e-5));
  }
}

}  // namespace
}  // namespace ms::ops
