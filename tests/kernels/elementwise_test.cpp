// The kernels of kernels/elementwise.cu and kernels/lamb.cu (declared in kernels/elementwise.h) against the CPU
// reference of their ops (ms::ops::ref, or a plain loop for the ops without one): vector helpers, row biases,
// learned positions, sums of squares, the vocab-parallel cross-entropy pieces (tp = 2 simulated by splitting
// the logits' columns) and multi-tensor LAMB. Odd shapes, aliasing, ignored and out-of-range targets; the
// tolerance of each comparison is stated in its test case's name.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include <doctest/doctest.h>

#if MS_KERNELS_SIM
#include "sim/simt.h"
#endif
#include "kernels.h"
#include "ops/ops.h"
#include "test_util.h"

namespace ms::kernels {
namespace {

using testing::Dev;
using testing::ExpectClose;
using testing::ExpectNoPoisonedReads;
using testing::Random;

TEST_CASE("kernels elementwise: AddInPlace, Add, Scale equal the reference exactly, aliasing included") {
  for (int64_t n : {1, 257, 1000}) {
    CAPTURE(n);
    const auto a = Random(n, 1), b = Random(n, 2);
    {  // y += x, and y += y
      std::vector<float> y(a);
      ops::ref::AddInPlace(y.data(), b.data(), n);
      Dev<float> dy(a), dx(b);
      REQUIRE(AddInPlace(dy.get(), dx.get(), n, nullptr) == cudaSuccess);
      CHECK(dy.Get() == y);
      std::vector<float> yy(a);
      ops::ref::AddInPlace(yy.data(), a.data(), n);
      Dev<float> dyy(a);
      REQUIRE(AddInPlace(dyy.get(), dyy.get(), n, nullptr) == cudaSuccess);
      CHECK(dyy.Get() == yy);
    }
    {  // out = a + b into a third buffer, into a, into b
      std::vector<float> want(n);
      ops::ref::Add(want.data(), a.data(), b.data(), n);
      Dev<float> da(a), db(b), dout(n);
      REQUIRE(Add(dout.get(), da.get(), db.get(), n, nullptr) == cudaSuccess);
      CHECK(dout.Get() == want);
      REQUIRE(Add(da.get(), da.get(), db.get(), n, nullptr) == cudaSuccess);
      CHECK(da.Get() == want);
      da.Set(a);
      REQUIRE(Add(db.get(), da.get(), db.get(), n, nullptr) == cudaSuccess);
      CHECK(db.Get() == want);
    }
    {  // x *= a
      std::vector<float> want(a);
      ops::ref::Scale(want.data(), -0.37f, n);
      Dev<float> dx(a);
      REQUIRE(Scale(dx.get(), -0.37f, n, nullptr) == cudaSuccess);
      CHECK(dx.Get() == want);
    }
  }
  // Empty problems launch nothing.
  CHECK(AddInPlace(nullptr, nullptr, 0, nullptr) == cudaSuccess);
  CHECK(Add(nullptr, nullptr, nullptr, 0, nullptr) == cudaSuccess);
  CHECK(Scale(nullptr, 2.0f, 0, nullptr) == cudaSuccess);
  ExpectNoPoisonedReads();
}

struct RC {
  int64_t R, C;
};

TEST_CASE("kernels elementwise: pointers that are not 16-byte aligned take the scalar kernels, same results") {
  // Every operand one float past a cudaMalloc'd (aligned) start: the float4 kernels must not be used.
  const int64_t R = 7, C = 12, n = R * C;
  const auto a = Random(n, 40), b = Random(n, 41), bias = Random(C, 42);
  auto shifted = [](const std::vector<float>& v) {
    std::vector<float> out(v.size() + 1, 0.0f);
    std::copy(v.begin(), v.end(), out.begin() + 1);
    return out;
  };
  auto unshift = [](const std::vector<float>& v) { return std::vector<float>(v.begin() + 1, v.end()); };
  Dev<float> da(shifted(a)), db(shifted(b)), dbias(shifted(bias)), dout(n + 1);
  std::vector<float> want(n);
  ops::ref::Add(want.data(), a.data(), b.data(), n);
  REQUIRE(Add(dout.get() + 1, da.get() + 1, db.get() + 1, n, nullptr) == cudaSuccess);
  CHECK(unshift(dout.Get()) == want);
  REQUIRE(AddInPlace(da.get() + 1, db.get() + 1, n, nullptr) == cudaSuccess);
  CHECK(unshift(da.Get()) == want);
  ops::ref::Scale(want.data(), 3.0f, n);
  REQUIRE(Scale(da.get() + 1, 3.0f, n, nullptr) == cudaSuccess);
  CHECK(unshift(da.Get()) == want);
  std::vector<float> rb(a), res(n);
  for (int64_t i = 0; i < n; ++i) {
    rb[i] += bias[i % C];
    res[i] = (a[i] + b[i]) + bias[i % C];
  }
  da.Set(shifted(a));
  REQUIRE(ResidualAdd(dout.get() + 1, da.get() + 1, db.get() + 1, dbias.get() + 1, nullptr, R, C, nullptr) ==
          cudaSuccess);
  CHECK(unshift(dout.Get()) == res);
  REQUIRE(AddRowBias(da.get() + 1, dbias.get() + 1, R, C, nullptr) == cudaSuccess);
  CHECK(unshift(da.Get()) == rb);
  ExpectNoPoisonedReads();
}

TEST_CASE("kernels elementwise: AddRowBias and ResidualAdd ((x + part) + bias) + bias2 equal a plain loop exactly") {
  // C % 4 == 0 (37 x 132, 5 x 4) takes the float4 kernels (cudaMalloc'd pointers are 16-byte aligned), the others
  // the scalar ones.
  for (RC s : {RC{3, 5}, RC{37, 130}, RC{1, 1}, RC{300, 3}, RC{37, 132}, RC{5, 4}}) {
    CAPTURE(s.R);
    CAPTURE(s.C);
    const int64_t n = s.R * s.C;
    const auto x = Random(n, 10), part = Random(n, 11), bias = Random(s.C, 12), bias2 = Random(s.C, 13);
    {
      std::vector<float> want(x);
      for (int64_t r = 0; r < s.R; ++r) ops::ref::AddInPlace(want.data() + r * s.C, bias.data(), s.C);
      Dev<float> dy(x), db(bias);
      REQUIRE(AddRowBias(dy.get(), db.get(), s.R, s.C, nullptr) == cudaSuccess);
      CHECK(dy.Get() == want);
      // Over bf16 y, in place: each element widened, the fp32 bias added, rounded to nearest even.
      std::vector<__nv_bfloat16> y16(n), want16(n);
      for (int64_t i = 0; i < n; ++i) {
        y16[i] = __float2bfloat16_rn(x[i]);
        want16[i] = __float2bfloat16_rn(__bfloat162float(y16[i]) + bias[i % s.C]);
      }
      Dev<__nv_bfloat16> dy16(y16);
      REQUIRE(AddRowBias(dy16.get(), db.get(), s.R, s.C, nullptr) == cudaSuccess);
      const std::vector<__nv_bfloat16> got16 = dy16.Get();
      CHECK(std::memcmp(got16.data(), want16.data(), sizeof(__nv_bfloat16) * n) == 0);
    }
    // Every bias combination, into a third buffer, into x and into part.
    for (int mask = 0; mask < 4; ++mask) {
      CAPTURE(mask);
      const bool use_b = mask & 1, use_b2 = mask & 2;
      std::vector<float> want(n);
      for (int64_t i = 0; i < n; ++i) {
        float v = x[i] + part[i];
        if (use_b) v += bias[i % s.C];
        if (use_b2) v += bias2[i % s.C];
        want[i] = v;
      }
      Dev<float> dx(x), dpart(part), db(bias), db2(bias2), dout(n);
      const float* pb = use_b ? db.get() : nullptr;
      const float* pb2 = use_b2 ? db2.get() : nullptr;
      REQUIRE(ResidualAdd(dout.get(), dx.get(), dpart.get(), pb, pb2, s.R, s.C, nullptr) == cudaSuccess);
      CHECK(dout.Get() == want);
      REQUIRE(ResidualAdd(dx.get(), dx.get(), dpart.get(), pb, pb2, s.R, s.C, nullptr) == cudaSuccess);
      CHECK(dx.Get() == want);
      dx.Set(x);
      REQUIRE(ResidualAdd(dpart.get(), dx.get(), dpart.get(), pb, pb2, s.R, s.C, nullptr) == cudaSuccess);
      CHECK(dpart.Get() == want);
    }
  }
  ExpectNoPoisonedReads();
}

TEST_CASE("kernels elementwise: BiasGrad accumulates column sums (rtol 1e-5, atol 1e-5 vs double) deterministically") {
  // R <= 64: one chunk (scratch 0, passed as null, one launch); more rows give several chunks (two launches):
  // (100, 33) 2 of 50 rows, (129, 769) 3 of 43, (515, 7) 9 of 58, (1001, 1) and (1001, 769) 16 of 63 (769 columns:
  // 25 column tiles, the last one 1 column wide).
  for (RC s : {RC{3, 5}, RC{37, 130}, RC{1, 1}, RC{100, 33}, RC{1001, 1}, RC{129, 769}, RC{1001, 769}, RC{515, 7}}) {
    CAPTURE(s.R);
    CAPTURE(s.C);
    const auto dy = Random(s.R * s.C, 20), db0 = Random(s.C, 21);
    std::vector<float> want(db0);
    for (int64_t c = 0; c < s.C; ++c) {
      double acc = 0.0;
      for (int64_t r = 0; r < s.R; ++r) acc += dy[r * s.C + c];
      want[c] = static_cast<float>(db0[c] + acc);
    }
    const int64_t scratch_n = BiasGradScratchFloats(s.R, s.C);
    CHECK((scratch_n == 0) == (s.R <= 64));
    Dev<float> ddy(dy), ddb(db0), ddb_again(db0), scratch(scratch_n);
    float* ps = scratch_n == 0 ? nullptr : scratch.get();
    REQUIRE(BiasGrad(ddb.get(), ps, ddy.get(), s.R, s.C, nullptr) == cudaSuccess);
    ExpectClose(ddb.Get(), want, 1e-5f, 1e-5f, "bias grad (accumulated)");
    REQUIRE(BiasGrad(ddb_again.get(), ps, ddy.get(), s.R, s.C, nullptr) == cudaSuccess);
    CHECK(ddb_again.Get() == ddb.Get());  // same bits run after run
    // Over a bf16 dy (the cuBLASLt GeLU-gradient epilogue's output): the bits of the fp32 launcher on dy widened
    // (on the shapes up to 10^5 elements: the TSan run of these tests is near its time limit).
    if (s.R * s.C > 100000) continue;
    std::vector<__nv_bfloat16> dy16(dy.size());
    std::vector<float> dyw(dy.size());
    for (size_t i = 0; i < dy.size(); ++i) {
      dy16[i] = __float2bfloat16_rn(dy[i]);
      dyw[i] = __bfloat162float(dy16[i]);
    }
    Dev<__nv_bfloat16> ddy16(dy16);
    Dev<float> ddyw(dyw), db16(db0), dbw(db0);
    REQUIRE(BiasGrad(db16.get(), ps, ddy16.get(), s.R, s.C, nullptr) == cudaSuccess);
    REQUIRE(BiasGrad(dbw.get(), ps, ddyw.get(), s.R, s.C, nullptr) == cudaSuccess);
    CHECK(db16.Get() == dbw.Get());
  }
  ExpectNoPoisonedReads();
}

TEST_CASE("kernels elementwise: AddPositions and PositionsBackward equal the plain row loops exactly") {
  struct Shape {
    int64_t R, C, T, row0;
  };
  // Several rows per position, wrap-around with positions left untouched (R < T), row0 = 0, a single element.
  for (Shape s :
       {Shape{37, 130, 7, 5}, Shape{3, 5, 7, 6}, Shape{10, 3, 10, 0}, Shape{1, 1, 1, 0}, Shape{40, 9, 16, 29}}) {
    CAPTURE(s.R);
    CAPTURE(s.C);
    CAPTURE(s.T);
    CAPTURE(s.row0);
    const auto x = Random(s.R * s.C, 30), wpe = Random(s.T * s.C, 31), dwpe0 = Random(s.T * s.C, 32);
    std::vector<float> want_x(x), want_dwpe(dwpe0);
    for (int64_t r = 0; r < s.R; ++r) {
      const int64_t t = (s.row0 + r) % s.T;
      for (int64_t c = 0; c < s.C; ++c) {
        want_x[r * s.C + c] += wpe[t * s.C + c];
        want_dwpe[t * s.C + c] += x[r * s.C + c];
      }
    }
    Dev<float> dx(x), dwpe(wpe), ddx(x), ddwpe(dwpe0);
    REQUIRE(AddPositions(dx.get(), dwpe.get(), s.R, s.C, s.T, s.row0, nullptr) == cudaSuccess);
    CHECK(dx.Get() == want_x);
    REQUIRE(PositionsBackward(ddwpe.get(), ddx.get(), s.R, s.C, s.T, s.row0, nullptr) == cudaSuccess);
    CHECK(ddwpe.Get() == want_dwpe);
  }
  ExpectNoPoisonedReads();
}

TEST_CASE("kernels elementwise: SumSquaresMulti matches ref::SumSquares (rtol 1e-12) over several launches") {
  // 71 vectors (more than one launch's 64): empty, single, odd, exactly one chunk (8192), one more, several
  // chunks, more chunks than the finishing warp has lanes (34).
  std::vector<int64_t> sizes = {0, 1, 257, 1000, 8192, 8193, 20000, 33 * 8192 + 5};
  for (int i = 0; i < 63; ++i) sizes.push_back(1 + 13 * i);
  sizes.push_back(0);  // an empty vector in the second launch
  const int count = static_cast<int>(sizes.size());
  std::vector<std::vector<float>> host;
  std::vector<std::unique_ptr<Dev<float>>> dev;
  std::vector<const float*> xs;
  for (int k = 0; k < count; ++k) {
    host.push_back(Random(sizes[k], 40 + k, -2.0f, 2.0f));
    dev.push_back(std::make_unique<Dev<float>>(host.back()));
    xs.push_back(sizes[k] > 0 ? dev.back()->get() : nullptr);
  }
  const int64_t scratch_n = SumSquaresScratchDoubles(sizes.data(), count);
  CHECK(scratch_n == 1 + 1 + 1 + 1 + 2 + 3 + 34 + 63);
  Dev<double> scratch(scratch_n), out(count), out_again(count);
  REQUIRE(SumSquaresMulti(out.get(), scratch.get(), xs.data(), sizes.data(), count, nullptr) == cudaSuccess);
  REQUIRE(SumSquaresMulti(out_again.get(), scratch.get(), xs.data(), sizes.data(), count, nullptr) == cudaSuccess);
  const std::vector<double> got = out.Get();
  CHECK(out_again.Get() == got);  // same bits run after run
  for (int k = 0; k < count; ++k) {
    CAPTURE(k);
    const double want = ops::ref::SumSquares(host[k].data(), sizes[k]);
    CHECK(std::fabs(got[k] - want) <= 1e-12 * std::fabs(want));
  }
  CHECK(SumSquaresMulti(nullptr, nullptr, nullptr, nullptr, 0, nullptr) == cudaSuccess);
  ExpectNoPoisonedReads();
}

TEST_CASE(
    "kernels vocab-parallel cross-entropy, tp=2 simulated: row max and target logit exact, sumexp and rebase rtol "
    "2e-6, "
    "losses/lse rtol 1e-5 atol 1e-5, dlogits rtol 1e-5 atol 1e-6") {
  struct Shape {
    int64_t N, V, V0;  // rank 0 holds columns [0, V0), rank 1 [V0, V)
  };
  // Shards whose width is a multiple of 4 take the vector path (4100: more than two quads per thread, then a tail).
  for (Shape s : {Shape{4, 1000, 517}, Shape{3, 33, 1}, Shape{5, 130, 65}, Shape{1, 2, 1}, Shape{3, 5100, 4100}}) {
    CAPTURE(s.N);
    CAPTURE(s.V);
    CAPTURE(s.V0);
    const auto logits = Random(s.N * s.V, 50, -4.0f, 4.0f);
    std::vector<int32_t> targets(s.N);
    for (int64_t i = 0; i < s.N; ++i) targets[i] = static_cast<int32_t>((i * 7919 + 3) % s.V);
    targets[0] = static_cast<int32_t>(s.V0 - 1);           // last column of rank 0
    if (s.N > 1) targets[1] = -1;                          // ignored
    if (s.N > 2) targets[2] = static_cast<int32_t>(s.V0);  // first column of rank 1
    const float dloss = 0.37f;
    std::vector<float> losses(s.N), lse(s.N), dlogits(s.N * s.V);
    const std::vector<float> dloss_rows(s.N, dloss);
    ops::ref::CrossEntropyForward(losses.data(), lse.data(), logits.data(), targets.data(), s.N, s.V);
    ops::ref::CrossEntropyBackward(dlogits.data(), logits.data(), lse.data(), targets.data(), dloss_rows.data(), s.N,
                                   s.V);

    const int64_t vstart[2] = {0, s.V0}, vlen[2] = {s.V0, s.V - s.V0};
    std::vector<float> shard[2];
    for (int k = 0; k < 2; ++k) {
      for (int64_t i = 0; i < s.N; ++i) {
        for (int64_t j = 0; j < vlen[k]; ++j) shard[k].push_back(logits[i * s.V + vstart[k] + j]);
      }
    }
    Dev<int32_t> d_targets(targets);
    std::unique_ptr<Dev<float>> d_shard[2];
    for (int k = 0; k < 2; ++k) d_shard[k] = std::make_unique<Dev<float>>(shard[k]);

    // RowStats on each rank: local max (exact), sumexp on the local max, target logit (exact).
    std::vector<float> mx(s.N, -INFINITY);
    std::vector<float> mx_local[2], se_local[2], tl_local[2];
    for (int k = 0; k < 2; ++k) {
      CAPTURE(k);
      Dev<float> d_mx(s.N), d_se(s.N), d_tl(s.N);
      REQUIRE(VocabParallelRowStats(d_mx.get(), d_se.get(), d_tl.get(), d_shard[k]->get(), d_targets.get(), vstart[k],
                                    s.N, vlen[k], nullptr) == cudaSuccess);
      std::vector<float> want_mx(s.N), want_se(s.N), want_tl(s.N);
      for (int64_t i = 0; i < s.N; ++i) {
        const auto row = shard[k].begin() + i * vlen[k];
        want_mx[i] = *std::max_element(row, row + vlen[k]);
        double acc = 0.0;
        for (int64_t j = 0; j < vlen[k]; ++j) acc += std::exp(static_cast<double>(row[j]) - want_mx[i]);
        want_se[i] = static_cast<float>(acc);
        const int64_t local = targets[i] - vstart[k];
        want_tl[i] = (targets[i] >= 0 && local >= 0 && local < vlen[k]) ? row[local] : 0.0f;
      }
      mx_local[k] = d_mx.Get();
      se_local[k] = d_se.Get();
      tl_local[k] = d_tl.Get();
      CHECK(mx_local[k] == want_mx);
      ExpectClose(se_local[k], want_se, 2e-6f, 0.0f, "vocab-parallel sumexp (local max)");
      CHECK(tl_local[k] == want_tl);
      for (int64_t i = 0; i < s.N; ++i) mx[i] = std::max(mx[i], mx_local[k][i]);  // the max "all-reduce"
    }

    // Rebase on each rank against exp in double, then the sum "all-reduce" on the host.
    Dev<float> d_mx(mx);
    std::vector<float> se(s.N, 0.0f), tl(s.N, 0.0f);
    for (int k = 0; k < 2; ++k) {
      CAPTURE(k);
      Dev<float> d_se(se_local[k]), d_mx_local(mx_local[k]);
      REQUIRE(VocabParallelRebase(d_se.get(), d_mx_local.get(), d_mx.get(), s.N, nullptr) == cudaSuccess);
      std::vector<float> want(s.N);
      for (int64_t i = 0; i < s.N; ++i) {
        want[i] = static_cast<float>(se_local[k][i] * std::exp(static_cast<double>(mx_local[k][i]) - mx[i]));
      }
      const std::vector<float> got = d_se.Get();
      ExpectClose(got, want, 2e-6f, 0.0f, "vocab-parallel rebased sumexp");
      for (int64_t i = 0; i < s.N; ++i) {
        se[i] += got[i];
        tl[i] += tl_local[k][i];
      }
    }

    // Finish (any rank: the inputs are reduced) against the unsplit reference.
    Dev<float> d_se(se), d_tl(tl), d_losses(s.N), d_lse(s.N);
    REQUIRE(VocabParallelFinish(d_losses.get(), d_lse.get(), d_mx.get(), d_se.get(), d_tl.get(), d_targets.get(), s.N,
                                nullptr) == cudaSuccess);
    ExpectClose(d_losses.Get(), losses, 1e-5f, 1e-5f, "vocab-parallel losses");
    ExpectClose(d_lse.Get(), lse, 1e-5f, 1e-5f, "vocab-parallel lse");
    if (s.N > 1) CHECK(d_losses.Get()[1] == 0.0f);

    // Backward on each rank (from the reference lse, to test the backward alone) against the reference's columns.
    Dev<float> d_ref_lse(lse);
    for (int k = 0; k < 2; ++k) {
      CAPTURE(k);
      Dev<float> d_dlogits(s.N * vlen[k]);
      REQUIRE(VocabParallelBackward(d_dlogits.get(), d_shard[k]->get(), d_ref_lse.get(), d_targets.get(), dloss,
                                    vstart[k], s.N, vlen[k], nullptr) == cudaSuccess);
      std::vector<float> want;
      for (int64_t i = 0; i < s.N; ++i) {
        for (int64_t j = 0; j < vlen[k]; ++j) want.push_back(dlogits[i * s.V + vstart[k] + j]);
      }
      ExpectClose(d_dlogits.Get(), want, 1e-5f, 1e-6f, "vocab-parallel dlogits");
      Dev<float> d_dlogits2(s.N * vlen[k]);  // with the bf16 copy: the same bits, and their rounding
      Dev<__nv_bfloat16> d16(s.N * vlen[k]);
      REQUIRE(VocabParallelBackward(d_dlogits2.get(), d_shard[k]->get(), d_ref_lse.get(), d_targets.get(), dloss,
                                    vstart[k], s.N, vlen[k], nullptr, d16.get()) == cudaSuccess);
      CHECK(d_dlogits2.Get() == d_dlogits.Get());
      testing::ExpectBf16CopyOf(d16, d_dlogits2, s.N * vlen[k], "vocab-parallel dlogits16");
      Dev<__nv_bfloat16> d16_only(s.N * vlen[k]);  // only the rounding (dlogits null): the same bf16 bits
      REQUIRE(VocabParallelBackward(nullptr, d_shard[k]->get(), d_ref_lse.get(), d_targets.get(), dloss, vstart[k], s.N,
                                    vlen[k], nullptr, d16_only.get()) == cudaSuccess);
      testing::ExpectBf16CopyOf(d16_only, d_dlogits, s.N * vlen[k], "vocab-parallel dlogits16 without dlogits");
      Dev<float> off(s.N * vlen[k] + 1);  // outputs not 16-byte aligned: element stores, the same bits
      Dev<__nv_bfloat16> off16(s.N * vlen[k] + 1);
      REQUIRE(VocabParallelBackward(off.get() + 1, d_shard[k]->get(), d_ref_lse.get(), d_targets.get(), dloss,
                                    vstart[k], s.N, vlen[k], nullptr, off16.get() + 1) == cudaSuccess);
      const auto o = off.Get();
      CHECK(std::vector<float>(o.begin() + 1, o.end()) == d_dlogits.Get());
      const auto o16 = off16.Get(), w16 = d16.Get();
      CHECK(std::memcmp(o16.data() + 1, w16.data(), sizeof(__nv_bfloat16) * w16.size()) == 0);
      CHECK(VocabParallelBackward(nullptr, d_shard[k]->get(), d_ref_lse.get(), d_targets.get(), dloss, vstart[k], s.N,
                                  vlen[k], nullptr, nullptr) == cudaErrorInvalidValue);
    }
  }
  ExpectNoPoisonedReads();
}

TEST_CASE(
    "kernels LAMB: multi-tensor direction and apply match ref::LambDirection / LambApply (rtol 1e-5, atol 1e-6), "
    "apply writing the bf16 weight copy bit for bit") {
  const ops::AdamParams hp{1e-2f, 0.9f, 0.999f, 1e-6f, 0.01f};
  const AdamWHyper khp{hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay};
  // 3 tensors of odd sizes, one bigger than a block chunk (1024); then 30 tensors (more than one launch's 24)
  // with empty and single-element ones.
  std::vector<std::vector<int64_t>> lists = {{257, 1, 2500}, {}};
  for (int i = 0; i < 30; ++i) lists[1].push_back(i % 7 == 3 ? 0 : 1 + 29 * i);
  for (const auto& sizes : lists) {
    CAPTURE(sizes.size());
    struct Host {
      std::vector<float> u, p, g, m, v;
    };
    std::vector<Host> host;
    std::vector<std::unique_ptr<Dev<float>>> dev;  // per tensor: u, p, g, m, v
    std::vector<LambTensor> list;
    for (size_t k = 0; k < sizes.size(); ++k) {
      const int64_t n = sizes[k];
      const uint32_t seed = static_cast<uint32_t>(200 + 5 * k);
      Host h{std::vector<float>(n, 0.0f), Random(n, seed), Random(n, seed + 1), Random(n, seed + 2, -0.1f, 0.1f),
             Random(n, seed + 3, 0.0f, 0.01f)};
      for (const auto* vec : {&h.u, &h.p, &h.g, &h.m, &h.v}) dev.push_back(std::make_unique<Dev<float>>(*vec));
      const size_t b = dev.size() - 5;
      list.push_back(
          LambTensor{dev[b]->get(), dev[b + 1]->get(), dev[b + 2]->get(), dev[b + 3]->get(), dev[b + 4]->get(), n});
      host.push_back(std::move(h));
    }
    for (int64_t step : {1, 2, 10}) {
      CAPTURE(step);
      REQUIRE(LambDirectionMultiTensor(list.data(), static_cast<int>(list.size()), khp, step, nullptr) == cudaSuccess);
      // The trust ratios from device sums of squares of p and u, as the optimizer computes them.
      std::vector<const float*> xs;
      std::vector<int64_t> ns;
      for (size_t k = 0; k < sizes.size(); ++k) {
        xs.push_back(list[k].p);
        xs.push_back(list[k].u);
        ns.push_back(sizes[k]);
        ns.push_back(sizes[k]);
      }
      const int nv = static_cast<int>(xs.size());
      Dev<double> scratch(SumSquaresScratchDoubles(ns.data(), nv)), sq(nv);
      REQUIRE(SumSquaresMulti(sq.get(), scratch.get(), xs.data(), ns.data(), nv, nullptr) == cudaSuccess);
      const std::vector<double> sums = sq.Get();
      for (size_t k = 0; k < sizes.size(); ++k) {
        CAPTURE(k);
        Host& h = host[k];
        const int64_t n = sizes[k];
        ops::ref::LambDirection(h.u.data(), h.p.data(), h.g.data(), h.m.data(), h.v.data(), n, hp, step);
        ExpectClose(dev[5 * k]->Get(), h.u, 1e-5f, 1e-6f, "lamb u");
        ExpectClose(dev[5 * k + 3]->Get(), h.m, 1e-5f, 1e-6f, "lamb m");
        ExpectClose(dev[5 * k + 4]->Get(), h.v, 1e-5f, 1e-6f, "lamb v");
        // Keep the reference on the kernel's state so that errors do not compound across steps.
        h.u = dev[5 * k]->Get();
        h.m = dev[5 * k + 3]->Get();
        h.v = dev[5 * k + 4]->Get();
        const float trust = ops::LambTrustRatio(sums[2 * k], sums[2 * k + 1]);
        const float ref_trust =
            ops::LambTrustRatio(ops::ref::SumSquares(h.p.data(), n), ops::ref::SumSquares(h.u.data(), n));
        CHECK(std::fabs(trust - ref_trust) <= 1e-6f * ref_trust);
        // Every other tensor also writes the bf16 copy of its updated parameters (as the cast kernel would).
        std::unique_ptr<Dev<__nv_bfloat16>> p16;
        if (k % 2 == 1 && n > 0) p16 = std::make_unique<Dev<__nv_bfloat16>>(static_cast<size_t>(n));
        REQUIRE(LambApply(dev[5 * k + 1]->get(), list[k].u, n, hp.lr, trust, nullptr, p16 ? p16->get() : nullptr) ==
                cudaSuccess);
        ops::ref::LambApply(h.p.data(), h.u.data(), n, hp.lr, trust);
        ExpectClose(dev[5 * k + 1]->Get(), h.p, 1e-5f, 1e-6f, "lamb p");
        if (p16) ExpectBf16CopyOf(*p16, *dev[5 * k + 1], n, "lamb p16");
        h.p = dev[5 * k + 1]->Get();
      }
    }
  }
  CHECK(LambDirectionMultiTensor(nullptr, 0, khp, 1, nullptr) == cudaSuccess);
  ExpectNoPoisonedReads();
}

}  // namespace
}  // namespace ms::kernels
