// Softmax cross-entropy, embedding and the elementwise helpers: fast against reference, gradients
// against finite differences, determinism.
#include <doctest/doctest.h>

#include <cmath>

#include "ops/kernels_cpu.h"  // internal: ExpF
#include "ops/ops.h"
#include "ops_test_util.h"

namespace ms::ops {
namespace {

using testing::BitwiseEqual;
using testing::CheckClose;
using testing::CheckGradFd;
using testing::Randn;

void CheckCrossEntropy(int64_t N, int64_t V, uint64_t seed) {
  CAPTURE(N);
  CAPTURE(V);
  Rng rng(seed);
  auto logits = Randn(rng, N * V, 3.0);
  std::vector<int32_t> targets(N);
  for (auto& t : targets) t = static_cast<int32_t>(rng.NextBelow(V));
  targets[N / 2] = -1;  // ignored
  targets[0] = static_cast<int32_t>(V - 1);
  std::vector<float> losses(N, 5.0f), lse(N), losses_ref(N), lse_ref(N);
  CrossEntropyForward(losses.data(), lse.data(), logits.data(), targets.data(), N, V);
  ref::CrossEntropyForward(losses_ref.data(), lse_ref.data(), logits.data(), targets.data(), N, V);
  CheckClose(losses, losses_ref, 1e-5, 1e-5, "cross-entropy losses");  // lse of O(10) in fp32
  CheckClose(lse, lse_ref, 1e-6, 1e-6, "cross-entropy lse");
  CHECK(losses[N / 2] == 0.0f);
  for (int64_t i = 0; i < N; ++i) {
    if (targets[i] >= 0) CHECK(losses[i] >= 0.0f);
  }

  auto dloss = Randn(rng, N);
  std::vector<float> dlogits(N * V, 5.0f), dlogits_ref(N * V);  // WRITES
  CrossEntropyBackward(dlogits.data(), logits.data(), lse.data(), targets.data(), dloss.data(), N, V);
  ref::CrossEntropyBackward(dlogits_ref.data(), logits.data(), lse.data(), targets.data(), dloss.data(), N, V);
  CheckClose(dlogits, dlogits_ref, 1e-5, 1e-7, "cross-entropy dlogits");
  for (int64_t j = 0; j < V; ++j) CHECK(dlogits[(N / 2) * V + j] == 0.0f);
  // Each valid row sums to (1 - 1) * dloss = 0.
  for (int64_t i = 0; i < N; ++i) {
    double s = 0;
    for (int64_t j = 0; j < V; ++j) s += dlogits[i * V + j];
    CHECK(std::fabs(s) < 1e-5);
  }
  // Fused (the training classifier): the same losses, lse and dlogits bit for bit, dlogits over the logits; and
  // the reference's fused version is its own two calls.
  std::vector<float> inout(logits), losses_f(N), lse_f(N);
  CrossEntropyFused(losses_f.data(), lse_f.data(), inout.data(), targets.data(), dloss.data(), N, V);
  CHECK(losses_f == losses);
  CHECK(lse_f == lse);
  CHECK(inout == dlogits);
  std::vector<float> inout_ref(logits), dlogits_ref2(N * V);
  ref::CrossEntropyFused(losses_f.data(), lse_f.data(), inout_ref.data(), targets.data(), dloss.data(), N, V);
  ref::CrossEntropyBackward(dlogits_ref2.data(), logits.data(), lse_f.data(), targets.data(), dloss.data(), N, V);
  CHECK(losses_f == losses_ref);
  CHECK(inout_ref == dlogits_ref2);
}

TEST_CASE("cross-entropy fast matches the reference, with ignored targets") {
  CheckCrossEntropy(7, 37, 91);
  CheckCrossEntropy(3, 5003, 92);  // parallel path, long rows
  CheckCrossEntropy(2, 1, 93);     // a single class: loss 0, gradient 0
}

TEST_CASE("reference cross-entropy backward equals finite differences of sum(losses * dloss)") {
  Rng rng(94);
  const int64_t N = 5, V = 11;
  auto logits = Randn(rng, N * V, 2.0);
  std::vector<int32_t> targets = {3, -1, 0, 10, 7};
  auto dloss = Randn(rng, N);
  std::vector<float> losses(N), lse(N);
  auto loss = [&] {
    ref::CrossEntropyForward(losses.data(), lse.data(), logits.data(), targets.data(), N, V);
    return testing::Dot(losses, dloss);
  };
  loss();
  std::vector<float> dlogits(N * V);
  ref::CrossEntropyBackward(dlogits.data(), logits.data(), lse.data(), targets.data(), dloss.data(), N, V);
  CheckGradFd(logits, dlogits, loss, 3e-3, 1e-2, 5e-4, "dlogits");
}

TEST_CASE("embedding forward and backward match the reference exactly, repeated and negative ids") {
  Rng rng(101);
  for (int64_t C : {int64_t{33}, int64_t{150}}) {
    CAPTURE(C);
    const int64_t N = 301, V = 11;  // many repeats; N * C > the parallel threshold for C = 150
    std::vector<int32_t> ids(N);
    for (auto& id : ids) id = static_cast<int32_t>(rng.NextBelow(V));
    ids[3] = -1;
    ids[4] = ids[5] = ids[6] = 2;
    auto table = Randn(rng, V * C);
    std::vector<float> out(N * C, 1.0f), out_ref(N * C);
    EmbeddingForward(out.data(), ids.data(), table.data(), N, C);
    ref::EmbeddingForward(out_ref.data(), ids.data(), table.data(), N, C);
    CHECK(BitwiseEqual(out, out_ref));
    for (int64_t c = 0; c < C; ++c) CHECK(out[3 * C + c] == 0.0f);
    auto dout = Randn(rng, N * C);
    auto dtable = Randn(rng, V * C);  // ACCUMULATES
    auto dtable_ref = dtable;
    EmbeddingBackward(dtable.data(), ids.data(), dout.data(), N, C);
    ref::EmbeddingBackward(dtable_ref.data(), ids.data(), dout.data(), N, C);
    CHECK(BitwiseEqual(dtable, dtable_ref));  // same additions in the same order
    auto dtable1 = Randn(rng, V * C);
    auto dtable2 = dtable1;
    {
      testing::ScopedThreads one(1);
      EmbeddingBackward(dtable1.data(), ids.data(), dout.data(), N, C);
    }
    EmbeddingBackward(dtable2.data(), ids.data(), dout.data(), N, C);
    CHECK(BitwiseEqual(dtable1, dtable2));
  }
}

TEST_CASE("elementwise helpers match the reference; SumSquares is thread-count independent") {
  Rng rng(111);
  for (int64_t n : {1, 17, 100003}) {
    CAPTURE(n);
    auto x = Randn(rng, n), y = Randn(rng, n);
    auto a = y, b = y;
    AddInPlace(a.data(), x.data(), n);
    ref::AddInPlace(b.data(), x.data(), n);
    CheckClose(a, b, 1e-7, 0, "AddInPlace");
    a = y, b = y;
    Axpy(a.data(), -0.37f, x.data(), n);
    ref::Axpy(b.data(), -0.37f, x.data(), n);
    CheckClose(a, b, 1e-6, 1e-7, "Axpy");
    std::vector<float> o(n), o_ref(n);
    Add(o.data(), x.data(), y.data(), n);
    ref::Add(o_ref.data(), x.data(), y.data(), n);
    CheckClose(o, o_ref, 1e-7, 0, "Add");
    a = x, b = x;
    Scale(a.data(), 1.7f, n);
    ref::Scale(b.data(), 1.7f, n);
    CheckClose(a, b, 1e-7, 0, "Scale");
    const double ss = SumSquares(x.data(), n), ss_ref = ref::SumSquares(x.data(), n);
    CHECK(ss == doctest::Approx(ss_ref).epsilon(1e-12));
    double ss1;
    {
      testing::ScopedThreads one(1);
      ss1 = SumSquares(x.data(), n);
    }
    CHECK(ss1 == ss);
  }
  CHECK(SumSquares(nullptr, 0) == 0.0);
}

TEST_CASE("fast row ops are deterministic and independent of the thread count") {
  Rng rng(121);
  const int64_t N = 97, C = 389, V = 389;  // above the parallel threshold
  auto x = Randn(rng, N * C), w = Randn(rng, C), b = Randn(rng, C), dout = Randn(rng, N * C);
  std::vector<int32_t> targets(N);
  for (auto& t : targets) t = static_cast<int32_t>(rng.NextBelow(V));
  auto dloss = Randn(rng, N);
  auto run = [&](int threads) {
    testing::ScopedThreads scoped(threads);
    std::vector<float> out(N * C), mean(N), rstd(N), dx(N * C, 0.0f), dw(C, 0.0f), db(C, 0.0f);
    LayerNormForward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, 1e-5f);
    LayerNormBackward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
    std::vector<float> losses(N), lse(N), dlogits(N * V);
    CrossEntropyForward(losses.data(), lse.data(), x.data(), targets.data(), N, V);
    CrossEntropyBackward(dlogits.data(), x.data(), lse.data(), targets.data(), dloss.data(), N, V);
    std::vector<float> g(N * C);
    GeluForward(g.data(), x.data(), N * C);
    std::vector<float> all;
    for (const auto* v : {&out, &mean, &rstd, &dx, &dw, &db, &losses, &lse, &dlogits, &g}) {
      all.insert(all.end(), v->begin(), v->end());
    }
    return all;
  };
  const auto first = run(2);
  CHECK(BitwiseEqual(first, run(2)));
  CHECK(BitwiseEqual(first, run(1)));
  CHECK(BitwiseEqual(first, run(3)));
}

TEST_CASE("the vectorizable ExpF behind softmax, GeLU and attention is within 2 ulp of exp") {
  double worst = 0;
  for (double x = -87.0; x < 88.0; x += 0.0137) {
    const float xf = static_cast<float>(x);
    const double want = std::exp(static_cast<double>(xf));
    worst = std::max(worst, std::fabs(internal::ExpF(xf) - want) / want);
  }
  CHECK(worst < 2 * 5.97e-8);
  CHECK(internal::ExpF(0.0f) == 1.0f);
  CHECK(internal::ExpF(-87.0f) > 0.0f);
  CHECK(internal::ExpF(-88.0f) == 0.0f);  // below FLT_MIN: 0 (a masked logit must leave the softmax)
  CHECK(internal::ExpF(-1e30f) == 0.0f);
  CHECK(internal::ExpF(-INFINITY) == 0.0f);
  CHECK(std::isnan(internal::ExpF(NAN)));
}

}  // namespace
}  // namespace ms::ops
