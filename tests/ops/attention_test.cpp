// Causal sliding-window attention: fast against reference (forward, lse, backward), the reference
// backward against finite differences, and the masking semantics.
#include <doctest/doctest.h>

#include <algorithm>

#include "ops/ops.h"
#include "ops_test_util.h"

namespace ms::ops {
namespace {

using testing::BitwiseEqual;
using testing::CheckClose;
using testing::CheckGradFd;
using testing::Dot;
using testing::Randn;

struct Shape {
  int64_t B, T, H, D;
  int64_t qkv() const { return B * T * 3 * H * D; }
  int64_t out() const { return B * T * H * D; }
  int64_t lse() const { return B * H * T; }
};

void CheckFastVsRef(const Shape& s, int64_t window, uint64_t seed) {
  CAPTURE(s.B);
  CAPTURE(s.T);
  CAPTURE(s.H);
  CAPTURE(s.D);
  CAPTURE(window);
  Rng rng(seed);
  auto qkv = Randn(rng, s.qkv(), 1.5);  // peaked enough that softmax is far from uniform
  std::vector<float> out(s.out(), 9.0f), lse(s.lse(), 9.0f), out_ref(s.out()), lse_ref(s.lse());
  AttentionForward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.H, s.D, window);
  ref::AttentionForward(out_ref.data(), lse_ref.data(), qkv.data(), s.B, s.T, s.H, s.D, window);
  // fp32 softmax and D-term dots against double: a few ulps of O(1) values.
  CheckClose(out, out_ref, 1e-5, 1e-5, "attention out");
  CheckClose(lse, lse_ref, 1e-5, 1e-5, "attention lse");

  auto dout = Randn(rng, s.out());
  std::vector<float> dqkv(s.qkv(), 9.0f), dqkv_ref(s.qkv(), -9.0f);  // WRITES every element
  AttentionBackward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, s.H, s.D, window);
  ref::AttentionBackward(dqkv_ref.data(), dout.data(), qkv.data(), out_ref.data(), lse_ref.data(), s.B, s.T, s.H, s.D,
                         window);
  // Up to T terms each carrying the fp32 error of p and of (dp - D_t).
  CheckClose(dqkv, dqkv_ref, 1e-4, 2e-5, "attention dqkv");
}

TEST_CASE("attention fast matches the reference, odd sizes, every window") {
  const Shape small{2, 13, 3, 5};
  uint64_t seed = 51;
  for (int64_t window : {0, 1, 4, 12, 13, 20}) CheckFastVsRef(small, window, seed++);
  const Shape blocks{1, 67, 2, 16};  // several query blocks, a ragged last one
  for (int64_t window : {0, 17, 1}) CheckFastVsRef(blocks, window, seed++);
  CheckFastVsRef({3, 1, 1, 1}, 0, seed++);  // one token, D = 1
}

TEST_CASE("attention window >= T equals full causal attention; window 1 attends only to itself") {
  Rng rng(61);
  const Shape s{2, 13, 3, 5};
  auto qkv = Randn(rng, s.qkv());
  std::vector<float> full(s.out()), lse_full(s.lse()), win(s.out()), lse_win(s.lse());
  for (bool fast : {false, true}) {
    auto fwd = fast ? &AttentionForward : &ref::AttentionForward;
    fwd(full.data(), lse_full.data(), qkv.data(), s.B, s.T, s.H, s.D, 0);
    for (int64_t window : {s.T, s.T + 5}) {
      fwd(win.data(), lse_win.data(), qkv.data(), s.B, s.T, s.H, s.D, window);
      CHECK(BitwiseEqual(win, full));
      CHECK(BitwiseEqual(lse_win, lse_full));
    }
    // window 1: out_t = v_t, lse_t = q_t . k_t / sqrt(D)
    fwd(win.data(), lse_win.data(), qkv.data(), s.B, s.T, s.H, s.D, 1);
    std::vector<float> v_only(s.out());
    for (int64_t bt = 0; bt < s.B * s.T; ++bt) {
      for (int64_t hd = 0; hd < s.H * s.D; ++hd)
        v_only[bt * s.H * s.D + hd] = qkv[bt * 3 * s.H * s.D + 2 * s.H * s.D + hd];
    }
    CheckClose(win, v_only, 1e-6, 0, "window 1 output");
  }
}

TEST_CASE("keys outside the window and in the future have no effect") {
  Rng rng(62);
  const Shape s{1, 13, 2, 5};
  const int64_t window = 4, perturbed = 5;  // token 5 is seen by queries 5..8 only
  auto qkv = Randn(rng, s.qkv());
  auto qkv2 = qkv;
  for (int64_t j = s.H * s.D; j < 3 * s.H * s.D; ++j) qkv2[perturbed * 3 * s.H * s.D + j] += 3.0f;  // its k and v
  for (bool fast : {false, true}) {
    CAPTURE(fast);
    auto fwd = fast ? &AttentionForward : &ref::AttentionForward;
    std::vector<float> out(s.out()), lse(s.lse()), out2(s.out()), lse2(s.lse());
    fwd(out.data(), lse.data(), qkv.data(), s.B, s.T, s.H, s.D, window);
    fwd(out2.data(), lse2.data(), qkv2.data(), s.B, s.T, s.H, s.D, window);
    for (int64_t t = 0; t < s.T; ++t) {
      const bool sees = t >= perturbed && t < perturbed + window;
      bool same =
          std::equal(out.begin() + t * s.H * s.D, out.begin() + (t + 1) * s.H * s.D, out2.begin() + t * s.H * s.D);
      for (int64_t h = 0; h < s.H; ++h) same = same && lse[h * s.T + t] == lse2[h * s.T + t];
      CAPTURE(t);
      CHECK(same == !sees);
    }
  }
}

void CheckRefGradFd(int64_t window, uint64_t seed) {
  CAPTURE(window);
  Rng rng(seed);
  const Shape s{2, 7, 2, 3};
  auto qkv = Randn(rng, s.qkv());
  auto r = Randn(rng, s.out());
  std::vector<float> out(s.out()), lse(s.lse());
  auto loss = [&] {
    ref::AttentionForward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.H, s.D, window);
    return Dot(out, r);
  };
  loss();
  std::vector<float> dqkv(s.qkv());
  ref::AttentionBackward(dqkv.data(), r.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, s.H, s.D, window);
  CheckGradFd(qkv, dqkv, loss, 3e-3, 1e-2, 2e-3, "attention dqkv");
}

TEST_CASE("reference attention backward equals finite differences, with and without a window") {
  CheckRefGradFd(0, 71);
  CheckRefGradFd(3, 72);
  CheckRefGradFd(1, 73);
}

TEST_CASE("attention fast is deterministic and independent of the thread count") {
  Rng rng(81);
  const Shape s{2, 37, 3, 8};
  auto qkv = Randn(rng, s.qkv()), dout = Randn(rng, s.out());
  auto run = [&](int threads, std::vector<float>& out, std::vector<float>& lse, std::vector<float>& dqkv) {
    testing::ScopedThreads scoped(threads);
    out.assign(s.out(), 0.0f);
    lse.assign(s.lse(), 0.0f);
    dqkv.assign(s.qkv(), 0.0f);
    AttentionForward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.H, s.D, 5);
    AttentionBackward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, s.H, s.D, 5);
  };
  std::vector<float> o1, l1, d1, o2, l2, d2, o3, l3, d3;
  run(2, o1, l1, d1);
  run(2, o2, l2, d2);
  run(1, o3, l3, d3);
  CHECK(BitwiseEqual(o1, o2));
  CHECK(BitwiseEqual(l1, l2));
  CHECK(BitwiseEqual(d1, d2));
  CHECK(BitwiseEqual(o1, o3));
  CHECK(BitwiseEqual(d1, d3));
}

}  // namespace
}  // namespace ms::ops
