// Causal sliding-window attention kernels (kernels/attention.cu) against ms::ops::ref::AttentionForward/Backward.
// Shapes have tails on purpose: T not a multiple of the 32-row tile (and T = 1), D not a multiple of 32 (odd,
// below a warp, between warps, the 128 limit), windows of 1, inside a tile, wider than a tile and wider than T;
// windows 2 and 34 put the first key of a query tile (q0 - window + 1 = 31) on the last key of the tile before
// it, and the last query of a key tile (k1 - 2 + window = 32, 64) on the first row of the next query tile.
// Tolerances: the kernels accumulate in fp32, the reference in double.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#if MS_KERNELS_SIM
#include "sim/simt.h"
#endif
#include "kernels.h"
#include "ldmatrix.h"
#include "ops/ops.h"
#include "test_util.h"

namespace ms::kernels {
namespace {

using testing::Dev;
using testing::ExpectClose;
using testing::ExpectNoPoisonedReads;
using testing::Random;

struct Case {
  int64_t B, T, H, D, window;
};

// "B 1 T 70 H 2 D 64 window 16", for the messages of a failed check (INFO).
std::string Describe(const Case& c) {
  return "B " + std::to_string(c.B) + " T " + std::to_string(c.T) + " H " + std::to_string(c.H) + " D " +
         std::to_string(c.D) + " window " + std::to_string(c.window);
}

// The bf16 inputs of a tensor-core backward test on device: qkv (uniform in [-2, 2)), dout and the qkv bias drawn
// from seeds seed, seed + 1, seed + 2, and the backward's scratch (the row terms and the bias gradient's chunks).
struct Bf16BackwardInputs {
  Dev<__nv_bfloat16> qkv, dout;
  Dev<float> bias, scratch;
  static std::vector<__nv_bfloat16> ToBf16(const std::vector<float>& v) {
    std::vector<__nv_bfloat16> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = __float2bfloat16(v[i]);
    return b;
  }
  Bf16BackwardInputs(const Case& c, uint32_t seed)
      : qkv(ToBf16(Random(c.B * c.T * 3 * c.H * c.D, seed, -2.0f, 2.0f))),
        dout(ToBf16(Random(c.B * c.T * c.H * c.D, seed + 1))),
        bias(Random(3 * c.H * c.D, seed + 2)),
        scratch(AttentionBackwardScratchFloats(c.B, c.T, c.H, c.D) +
                AttentionBiasGradScratchFloats(c.B, c.T, c.H, c.D)) {}
};

struct Outputs {
  std::vector<float> out, lse, dqkv;
};

// Forward, then backward from the kernel's own out and lse: the fp32 kernels, or with bf16 the tensor-core
// ones (kernels/attention_tc.cu), with `rounded` also writing out16 and dqkv16. dqkv starts as the allocator's
// 0xFF fill (NaN), so an element the backward fails to write fails the comparison.
// x and y hold the same elements bit for bit (and as many).
template <typename T>
bool SameBits(const std::vector<T>& x, const std::vector<T>& y) {
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) == 0;
}

Outputs RunKernels(const Case& c, const std::vector<float>& qkv, const std::vector<float>& dout, bool bf16 = false,
                   bool rounded = false, const float* qkv_bias = nullptr) {
  const int64_t n_out = c.B * c.T * c.H * c.D, n_qkv = static_cast<int64_t>(qkv.size());
  Dev<float> d_qkv(qkv), d_out(n_out), d_lse(c.B * c.H * c.T), d_dout(dout), d_dqkv(qkv.size());
  Dev<float> scratch(AttentionBackwardScratchFloats(c.B, c.T, c.H, c.D));
  Dev<__nv_bfloat16> out16(rounded ? n_out : 1), dqkv16(rounded ? n_qkv : 1);
  if (bf16) {
    REQUIRE(AttentionForwardBf16(d_out.get(), d_lse.get(), d_qkv.get(), c.B, c.T, c.H, c.D, c.window, nullptr,
                                 rounded ? out16.get() : nullptr, qkv_bias) == cudaSuccess);
    REQUIRE(AttentionBackwardBf16(d_dqkv.get(), scratch.get(), d_dout.get(), d_qkv.get(), d_out.get(), d_lse.get(), c.B,
                                  c.T, c.H, c.D, c.window, nullptr, rounded ? dqkv16.get() : nullptr,
                                  qkv_bias) == cudaSuccess);
  } else {
    REQUIRE(AttentionForward(d_out.get(), d_lse.get(), d_qkv.get(), c.B, c.T, c.H, c.D, c.window, nullptr) ==
            cudaSuccess);
    REQUIRE(AttentionBackward(d_dqkv.get(), scratch.get(), d_dout.get(), d_qkv.get(), d_out.get(), d_lse.get(), c.B,
                              c.T, c.H, c.D, c.window, nullptr) == cudaSuccess);
  }
  Outputs o{d_out.Get(), d_lse.Get(), d_dqkv.Get()};
  if (rounded) {
    testing::ExpectBf16CopyOf(out16, d_out, n_out, "attention out16");
    testing::ExpectBf16CopyOf(dqkv16, d_dqkv, n_qkv, "attention dqkv16");
  }
  return o;
}

// The kernels against the reference on random inputs of case c (with bf16: the tensor-core kernels against
// the reference on the bf16-rounded q, k, v and dout); tolerances rtol = atol = tol_fwd (out), tol_lse, tol_grad;
// with `twice`, a second run must give the same bits.
void CheckCase(const Case& c, bool bf16, float tol_fwd, float tol_lse, float tol_grad, bool twice) {
  CAPTURE(c.B);
  CAPTURE(c.T);
  CAPTURE(c.H);
  CAPTURE(c.D);
  CAPTURE(c.window);
  CAPTURE(bf16);
  const int64_t n_qkv = c.B * c.T * 3 * c.H * c.D, n_out = c.B * c.T * c.H * c.D;
  const auto qkv = Random(n_qkv, bf16 ? 301 : 101, -2.0f, 2.0f), dout = Random(n_out, bf16 ? 302 : 102);
  auto rounded = [&](std::vector<float> v) {
    if (bf16) {
      for (float& x : v) x = __bfloat162float(__float2bfloat16(x));
    }
    return v;
  };
  const auto qkv_ref = rounded(qkv), dout_ref = rounded(dout);
  std::vector<float> out(n_out), lse(c.B * c.H * c.T), dqkv(n_qkv);
  ops::ref::AttentionForward(out.data(), lse.data(), qkv_ref.data(), c.B, c.T, c.H, c.D, c.window);
  ops::ref::AttentionBackward(dqkv.data(), dout_ref.data(), qkv_ref.data(), out.data(), lse.data(), c.B, c.T, c.H, c.D,
                              c.window);

  const Outputs got = RunKernels(c, qkv, dout, bf16);
  ExpectClose(got.out, out, tol_fwd, tol_fwd / (bf16 ? 1.0f : 10.0f), "attention out");
  ExpectClose(got.lse, lse, tol_lse, tol_lse / (bf16 ? 1.0f : 10.0f), "attention lse");
  ExpectClose(got.dqkv, dqkv, tol_grad, tol_grad / (bf16 ? 1.0f : 10.0f), "attention dqkv");
  if (!twice) return;
  const Outputs again = RunKernels(c, qkv, dout, bf16);
  CHECK(std::memcmp(again.out.data(), got.out.data(), n_out * sizeof(float)) == 0);
  CHECK(std::memcmp(again.lse.data(), got.lse.data(), got.lse.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(again.dqkv.data(), got.dqkv.data(), n_qkv * sizeof(float)) == 0);
}

TEST_CASE("attention: forward/backward match the reference (out, lse rtol 1e-4 atol 1e-5; grads rtol 1e-3 atol 1e-4)") {
  for (Case c : {Case{1, 1, 1, 1, 0}, Case{2, 37, 3, 24, 0}, Case{2, 37, 3, 24, 5}, Case{1, 70, 2, 64, 16},
                 Case{1, 33, 1, 128, 40}, Case{1, 20, 2, 8, 1}, Case{1, 45, 1, 33, 7}, Case{1, 70, 2, 8, 2},
                 Case{1, 130, 1, 16, 34}}) {
    // Deterministic: a second run gives the same bits (one shape: the emulator under TSan is slow).
    CheckCase(c, /*bf16=*/false, 1e-4f, 1e-4f, 1e-3f, /*twice=*/c.T == 70 && c.D == 64);
  }
  ExpectNoPoisonedReads();
}

// NaN in q, k and v of some tokens: every output that does not depend on them (in the reference's
// semantics) must come out finite and equal to the reference, although the kernels do load those tokens
// into the same tiles as visible ones (and compute masked scores from them).
TEST_CASE("attention: tokens outside a query's window have no influence (NaN there; rtol 1e-4 / 1e-3)") {
  struct NanCase {
    Case c;
    int64_t nan_lo0, nan_hi0, nan_lo1, nan_hi1;  // NaN tokens: [lo0, hi0) and [lo1, hi1)
  };
  // Window 10: NaN before (tokens 0..19, inside visited key tiles of rows 29..41) and after (60..69, same
  // query tile and warp as clean rows 56..59). Window 0: only the future (40..44) can be clean of them.
  for (NanCase nc : {NanCase{{1, 70, 2, 16, 10}, 0, 20, 60, 70}, NanCase{{2, 45, 1, 8, 0}, 0, 0, 40, 45}}) {
    const Case& c = nc.c;
    CAPTURE(c.T);
    CAPTURE(c.window);
    const int64_t row = 3 * c.H * c.D, n_qkv = c.B * c.T * row, n_out = c.B * c.T * c.H * c.D;
    auto qkv = Random(n_qkv, 201, -2.0f, 2.0f);
    const auto dout = Random(n_out, 202);
    auto dirty = [&](int64_t t) { return (t >= nc.nan_lo0 && t < nc.nan_hi0) || (t >= nc.nan_lo1 && t < nc.nan_hi1); };
    auto first_key = [&](int64_t t) { return c.window > 0 && t - c.window + 1 > 0 ? t - c.window + 1 : 0; };
    for (int64_t b = 0; b < c.B; ++b) {
      for (int64_t t = 0; t < c.T; ++t) {
        if (!dirty(t)) continue;
        for (int64_t i = 0; i < row; ++i) qkv[(b * c.T + t) * row + i] = std::numeric_limits<float>::quiet_NaN();
      }
    }
    // Query t is clean when it and every key it sees are; key s's gradients when s and every query seeing it are.
    std::vector<bool> query_clean(c.T), key_clean(c.T);
    for (int64_t t = 0; t < c.T; ++t) {
      bool ok = true;
      for (int64_t s = first_key(t); s <= t; ++s) ok = ok && !dirty(s);
      query_clean[t] = ok;
    }
    for (int64_t s = 0; s < c.T; ++s) {
      bool ok = !dirty(s);
      for (int64_t t = s; t < c.T; ++t) {
        if (first_key(t) <= s) ok = ok && query_clean[t];
      }
      key_clean[s] = ok;
    }

    std::vector<float> out(n_out), lse(c.B * c.H * c.T), dqkv(n_qkv);
    ops::ref::AttentionForward(out.data(), lse.data(), qkv.data(), c.B, c.T, c.H, c.D, c.window);
    ops::ref::AttentionBackward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), c.B, c.T, c.H, c.D,
                                c.window);
    const Outputs got = RunKernels(c, qkv, dout);

    std::vector<float> got_fwd, want_fwd, got_dq, want_dq, got_dkv, want_dkv;
    int64_t clean_queries = 0, clean_keys = 0;
    for (int64_t b = 0; b < c.B; ++b) {
      for (int64_t t = 0; t < c.T; ++t) {
        clean_queries += query_clean[t];
        clean_keys += key_clean[t];
        for (int64_t h = 0; h < c.H; ++h) {
          if (query_clean[t]) {
            got_fwd.push_back(got.lse[(b * c.H + h) * c.T + t]);
            want_fwd.push_back(lse[(b * c.H + h) * c.T + t]);
          }
          for (int64_t d = 0; d < c.D; ++d) {
            const int64_t o = ((b * c.T + t) * c.H + h) * c.D + d;
            const int64_t qi = (b * c.T + t) * row + h * c.D + d;
            const int64_t ki = qi + c.H * c.D, vi = ki + c.H * c.D;
            if (query_clean[t]) {
              got_fwd.push_back(got.out[o]);
              want_fwd.push_back(out[o]);
              got_dq.push_back(got.dqkv[qi]);
              want_dq.push_back(dqkv[qi]);
            }
            if (key_clean[t]) {
              got_dkv.insert(got_dkv.end(), {got.dqkv[ki], got.dqkv[vi]});
              want_dkv.insert(want_dkv.end(), {dqkv[ki], dqkv[vi]});
            }
          }
        }
      }
    }
    CHECK(clean_queries > 0);
    if (c.window > 0) CHECK(clean_keys > 0);
    ExpectClose(got_fwd, want_fwd, 1e-4f, 1e-5f, "clean out and lse");
    ExpectClose(got_dq, want_dq, 1e-3f, 1e-4f, "clean dq");
    if (!got_dkv.empty()) ExpectClose(got_dkv, want_dkv, 1e-3f, 1e-4f, "clean dk, dv");
  }
  ExpectNoPoisonedReads();
}

// ---- bf16 tensor-core variants (kernels/attention_tc.cu) ----

// The oracle is the double-precision reference on the bf16-rounded q, k, v and dout, so what is left is the
// rounding of P and dS to bf16 (relative 2^-9 per term), the row terms' unrounded dout and fp32 sums: the
// largest errors on these shapes are 2.6e-3 (out), 1e-6 (lse) and 8e-3 (dqkv), 2.5-5x below the tolerances,
// which are far below the O(1) error of a wrong mask, tile edge or lost term. Shapes: T across
// 64-row tiles (1, 37, 64, 65, 130), D = 16..128 in both instantiations (<= 64, <= 128), windows of 1,
// inside, equal to and wider than a tile; windows 2 and 66 put the first key of a query tile on the last
// key of the previous tile, and the last query seeing a key tile on the first row of the next query tile; T = 200
// with window 150 has tiles that lie inside every row's band (the register softmax skips their mask: InsideBand) next
// to tiles that do not, with the window (T = 130 and 100, window 0: without one).
// Both softmax variants (SetAttentionTcSoftmax): in registers (the accumulator fragments' layout, which the probe must
// confirm here: the emulator's, or sm_80 / sm_90's on a GPU, else kRegisters fails) and through shared memory.
struct SoftmaxMode {
  explicit SoftmaxMode(AttentionTcSoftmax m) { SetAttentionTcSoftmax(m); }
  ~SoftmaxMode() { SetAttentionTcSoftmax(AttentionTcSoftmax::kAuto); }
  SoftmaxMode(const SoftmaxMode&) = delete;
  SoftmaxMode& operator=(const SoftmaxMode&) = delete;
};

// One of the tensor-core attention's process-wide switches (SetAttentionTcAsyncLoads, ...WideForward, ...FixedBounds,
// ...SplitDkDv) set for a scope, then back to its default.
class ScopedSwitch {
 public:
  ScopedSwitch(void (*set)(bool), bool on, bool default_on) : set_(set), default_on_(default_on) { set_(on); }
  ~ScopedSwitch() { set_(default_on_); }
  ScopedSwitch(const ScopedSwitch&) = delete;
  ScopedSwitch& operator=(const ScopedSwitch&) = delete;

 private:
  void (*set_)(bool);
  bool default_on_;
};

// The tensor-core kernels' tile copies (SetAttentionTcAsyncLoads) for a scope: asynchronous (the default) or not.
struct AsyncMode : ScopedSwitch {
  explicit AsyncMode(bool on) : ScopedSwitch(SetAttentionTcAsyncLoads, on, true) {}
};

#if defined(__SANITIZE_THREAD__)
// Under ThreadSanitizer (the slowest build: 2.3 min for these cases with both variants) the shared-memory variant runs
// in the agreement case below alone.
constexpr AttentionTcSoftmax kSoftmaxModes[] = {AttentionTcSoftmax::kRegisters};
#else
constexpr AttentionTcSoftmax kSoftmaxModes[] = {AttentionTcSoftmax::kRegisters, AttentionTcSoftmax::kShared};
#endif

// The GPU's fragment loads (kernels/attention_tc.cu, LoadFrag: ldmatrix.x4 from shared memory) run only on a GPU; their
// lane addresses are checked here against ldmatrix's semantics as the PTX ISA states them — lane l gives the address
// of row l % 8 of matrix l / 8; register j of lane t receives matrix j's row t / 4, columns 2 (t % 4) and 2 (t % 4) + 1
// (with .trans: column t / 4, rows 2 (t % 4) and 2 (t % 4) + 1) — so that every x[i] of every lane lands where the
// mma.sync m16n8k16 operand layout puts it (ldsm::FragElemRow / FragElemCol; the device probe then compares the
// result with wmma::load_matrix_sync's, FragLayoutsHold). A wrong row or column offset, a swapped matrix order or a
// missing .trans fails here.
TEST_CASE("attention bf16 (tensor cores): ldmatrix's lane addresses give the mma.sync fragment layout") {
  using ldsm::FragKind;
  for (const FragKind kind : {FragKind::kARow, FragKind::kACol, FragKind::kBCol, FragKind::kBRow}) {
    CAPTURE(static_cast<int>(kind));
    const bool trans = ldsm::LdsmTransposes(kind);
    int seen[16][16] = {};
    for (int t = 0; t < 32; ++t) {
      for (int j = 0; j < 4; ++j) {    // register j: matrix j, whose rows lanes 8 j .. 8 j + 7 address
        for (int h = 0; h < 2; ++h) {  // its lower (h 0) and upper 16 bits: x[2 j + h]
          const int mrow = trans ? 2 * (t % 4) + h : t / 4;  // row of the 8 x 8 matrix, column below
          const int mcol = trans ? t / 4 : 2 * (t % 4) + h;
          const int src = 8 * j + mrow;  // the lane that gave that row's address
          const int row = ldsm::LdsmLaneRow(kind, src), col = ldsm::LdsmLaneCol(kind, src) + mcol;
          CAPTURE(t);
          CAPTURE(j);
          CAPTURE(h);
          REQUIRE(row >= 0);
          REQUIRE(row < 16);
          REQUIRE(col >= 0);
          REQUIRE(col < 16);
          CHECK(ldsm::LdsmLaneCol(kind, src) % 8 == 0);  // each row address 16-byte aligned in a 16-byte aligned block
          CHECK(row == ldsm::FragElemRow(kind, t, 2 * j + h));
          CHECK(col == ldsm::FragElemCol(kind, t, 2 * j + h));
          ++seen[row][col];
        }
      }
    }
    for (const auto& r : seen) {
      for (const int n : r) CHECK(n == 1);  // every element of the 16 x 16 block loaded once
    }
  }
  // The matrix_a layout is the accumulator's (the register softmax rounds P into matrix_a fragments lane by lane).
  for (int t = 0; t < 32; ++t) {
    for (int i = 0; i < 8; ++i) {
      CHECK(ldsm::FragElemRow(FragKind::kARow, t, i) == t / 4 + 8 * ((i / 2) % 2));
      CHECK(ldsm::FragElemCol(FragKind::kARow, t, i) == 8 * (i / 4) + 2 * (t % 4) + i % 2);
    }
  }
}

TEST_CASE("attention bf16 (tensor cores): forward/backward match the reference on bf16-rounded inputs") {
  for (const AttentionTcSoftmax mode : kSoftmaxModes) {
    CAPTURE(static_cast<int>(mode));
    const SoftmaxMode use(mode);
    for (Case c : {Case{1, 1, 1, 16, 0}, Case{2, 37, 3, 32, 0}, Case{2, 37, 2, 48, 5}, Case{1, 130, 2, 64, 66},
                   Case{1, 65, 1, 128, 40}, Case{1, 70, 2, 80, 2}, Case{1, 64, 1, 16, 64}, Case{1, 130, 1, 16, 1},
                   Case{1, 100, 1, 112, 0}, Case{1, 200, 1, 32, 150}}) {
      CheckCase(c, /*bf16=*/true, 1e-2f, 1e-4f, 2e-2f, /*twice=*/c.T == 130 && c.D == 64);
    }
  }
  ExpectNoPoisonedReads();
}

// The two variants compute the same products from the same bf16 operands; only fp32 sums (row max / sum, P V) run
// in other orders, and a probability or dS may round to the neighbouring bf16 — far inside 1e-2 here (a wrong
// element -> row/column mapping moves values by O(1)).
TEST_CASE("attention bf16 (tensor cores): the register-resident softmax agrees with the shared-memory one") {
  for (const Case c : {Case{1, 130, 1, 64, 0}, Case{1, 100, 1, 128, 70}}) {  // 2-3 tiles; D in both instantiations
    CAPTURE(c.T);
    CAPTURE(c.D);
    const auto qkv = Random(c.B * c.T * 3 * c.H * c.D, 311, -2.0f, 2.0f), dout = Random(c.B * c.T * c.H * c.D, 312);
    Outputs regs, shared;
    {
      const SoftmaxMode use(AttentionTcSoftmax::kRegisters);
      regs = RunKernels(c, qkv, dout, /*bf16=*/true, /*rounded=*/true);
    }
    {
      const SoftmaxMode use(AttentionTcSoftmax::kShared);
      shared = RunKernels(c, qkv, dout, /*bf16=*/true, /*rounded=*/true);
    }
    ExpectClose(regs.out, shared.out, 1e-2f, 1e-2f, "out, registers vs shared");
    ExpectClose(regs.lse, shared.lse, 1e-5f, 1e-5f, "lse, registers vs shared");
    ExpectClose(regs.dqkv, shared.dqkv, 2e-2f, 2e-2f, "dqkv, registers vs shared");
  }
  ExpectNoPoisonedReads();
}

// The tile loads take 16 bytes at a time when qkv (and dout) are 16-byte aligned, one float at a time otherwise:
// both give the same bits (same products, same order).
TEST_CASE("attention bf16 (tensor cores): unaligned qkv and dout give the bits of the aligned run") {
  const Case c{1, 70, 2, 32, 9};
  const int64_t n_qkv = c.B * c.T * 3 * c.H * c.D, n_out = c.B * c.T * c.H * c.D;
  const auto qkv = Random(n_qkv, 311, -2.0f, 2.0f), dout = Random(n_out, 312);
  const Outputs aligned = RunKernels(c, qkv, dout, /*bf16=*/true);
  // The same values one float past a 16-byte boundary.
  std::vector<float> qkv1(n_qkv + 1), dout1(n_out + 1);
  std::copy(qkv.begin(), qkv.end(), qkv1.begin() + 1);
  std::copy(dout.begin(), dout.end(), dout1.begin() + 1);
  Dev<float> d_qkv(qkv1), d_dout(dout1), d_out(n_out + 1), d_lse(c.B * c.H * c.T), d_dqkv(n_qkv + 1);
  Dev<float> scratch(AttentionBackwardScratchFloats(c.B, c.T, c.H, c.D));
  REQUIRE(AttentionForwardBf16(d_out.get() + 1, d_lse.get(), d_qkv.get() + 1, c.B, c.T, c.H, c.D, c.window, nullptr) ==
          cudaSuccess);
  REQUIRE(AttentionBackwardBf16(d_dqkv.get() + 1, scratch.get(), d_dout.get() + 1, d_qkv.get() + 1, d_out.get() + 1,
                                d_lse.get(), c.B, c.T, c.H, c.D, c.window, nullptr) == cudaSuccess);
  const std::vector<float> out = d_out.Get(), lse = d_lse.Get(), dqkv = d_dqkv.Get();
  CHECK(std::memcmp(out.data() + 1, aligned.out.data(), n_out * sizeof(float)) == 0);
  CHECK(std::memcmp(lse.data(), aligned.lse.data(), lse.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(dqkv.data() + 1, aligned.dqkv.data(), n_qkv * sizeof(float)) == 0);
  ExpectNoPoisonedReads();
}

// out16 / dqkv16: the cast kernel's rounding of every element of out / dqkv (checked in RunKernels), and the fp32
// outputs bit for bit those of the run without them. Both instantiations (D <= 64, D <= 128), a partial tile.
TEST_CASE("attention bf16 (tensor cores): the bf16 roundings of out and dqkv, same fp32 bits") {
  for (Case c : {Case{2, 37, 2, 32, 5}, Case{1, 70, 1, 80, 0}}) {
    CAPTURE(c.D);
    const int64_t n_qkv = c.B * c.T * 3 * c.H * c.D, n_out = c.B * c.T * c.H * c.D;
    const auto qkv = Random(n_qkv, 321, -2.0f, 2.0f), dout = Random(n_out, 322);
    const Outputs plain = RunKernels(c, qkv, dout, /*bf16=*/true);
    const Outputs rounded = RunKernels(c, qkv, dout, /*bf16=*/true, /*rounded=*/true);
    CHECK(std::memcmp(rounded.out.data(), plain.out.data(), n_out * sizeof(float)) == 0);
    CHECK(std::memcmp(rounded.lse.data(), plain.lse.data(), plain.lse.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(rounded.dqkv.data(), plain.dqkv.data(), n_qkv * sizeof(float)) == 0);
  }
  ExpectNoPoisonedReads();
}

// The qkv GEMM's bias added as q, k, v are loaded: the bits of attention over qkv + bias (added on the host, the
// same fp32 add), forward and backward, with the bias 16-byte aligned (vector loads) and not (scalar loads).
TEST_CASE("attention bf16 (tensor cores): qkv_bias added at load gives the bits of attention over qkv + bias") {
  for (Case c : {Case{2, 37, 2, 32, 5}, Case{1, 70, 3, 80, 0}}) {
    CAPTURE(c.D);
    const int64_t n_qkv = c.B * c.T * 3 * c.H * c.D, n_out = c.B * c.T * c.H * c.D, hd3 = 3 * c.H * c.D;
    const auto qkv = Random(n_qkv, 331, -2.0f, 2.0f), dout = Random(n_out, 332), bias = Random(hd3, 333);
    std::vector<float> biased(qkv);
    for (int64_t i = 0; i < n_qkv; ++i) biased[i] += bias[i % hd3];
    const Outputs want = RunKernels(c, biased, dout, /*bf16=*/true);
    for (int64_t shift : {0, 1}) {
      CAPTURE(shift);
      std::vector<float> b(shift);
      b.insert(b.end(), bias.begin(), bias.end());
      Dev<float> d_bias(b);
      const Outputs got = RunKernels(c, qkv, dout, /*bf16=*/true, /*rounded=*/true, d_bias.get() + shift);
      CHECK(std::memcmp(got.out.data(), want.out.data(), n_out * sizeof(float)) == 0);
      CHECK(std::memcmp(got.lse.data(), want.lse.data(), want.lse.size() * sizeof(float)) == 0);
      CHECK(std::memcmp(got.dqkv.data(), want.dqkv.data(), n_qkv * sizeof(float)) == 0);
    }
    // Without the bias the outputs differ (the check above sees a bias left out).
    const Outputs unbiased = RunKernels(c, qkv, dout, /*bf16=*/true);
    CHECK(std::memcmp(unbiased.out.data(), want.out.data(), n_out * sizeof(float)) != 0);
  }
  ExpectNoPoisonedReads();
}

// dqkv_bias: += the column sums of dqkv, each warp's 16 stored rows summed in row order, then BiasGrad's tree over
// the B * ceil(T / 16) chunks — checked bit for bit against BiasGrad run on those chunk sums made on the host from
// the stored dqkv (a partial chunk at T = 37 and 70, T = 1, both instantiations, the qkv bias loaded too), and within
// 1e-5 of the double column sums. dqkv itself keeps the bits of the run without the bias gradient; with dqkv null
// only dqkv16 and the bias gradient are written, with the same bits; without the qkv bias (which the qkv GEMM then
// added) the bias gradient is summed the same way. All three null: refused.
TEST_CASE("attention bf16 (tensor cores): dqkv_bias sums the stored dqkv rows (BiasGrad's tree over 16-row chunks)") {
  for (Case c : {Case{2, 37, 2, 32, 5}, Case{1, 70, 1, 80, 0}, Case{3, 1, 1, 16, 0}}) {
    CAPTURE(c.B);
    CAPTURE(c.T);
    CAPTURE(c.D);
    const int64_t n_qkv = c.B * c.T * 3 * c.H * c.D, n_out = c.B * c.T * c.H * c.D, hd3 = 3 * c.H * c.D;
    const auto qkv = Random(n_qkv, 341, -2.0f, 2.0f), dout = Random(n_out, 342), bias = Random(hd3, 343);
    const auto init = Random(hd3, 344);  // the gradient accumulated so far: the sums are added to it
    Dev<float> d_bias(bias);
    const Outputs plain = RunKernels(c, qkv, dout, /*bf16=*/true, /*rounded=*/false, d_bias.get());

    Dev<float> d_qkv(qkv), d_dout(dout), d_out(plain.out), d_lse(plain.lse), d_dqkv(n_qkv);
    Dev<__nv_bfloat16> dqkv16(n_qkv), only16(n_qkv);
    Dev<float> scratch(AttentionBackwardScratchFloats(c.B, c.T, c.H, c.D) +
                       AttentionBiasGradScratchFloats(c.B, c.T, c.H, c.D));
    Dev<float> dbias(init), dbias_only(init);
    REQUIRE(AttentionBackwardBf16(d_dqkv.get(), scratch.get(), d_dout.get(), d_qkv.get(), d_out.get(), d_lse.get(), c.B,
                                  c.T, c.H, c.D, c.window, nullptr, dqkv16.get(), d_bias.get(),
                                  dbias.get()) == cudaSuccess);
    const std::vector<float> dqkv = d_dqkv.Get();
    CHECK(std::memcmp(dqkv.data(), plain.dqkv.data(), n_qkv * sizeof(float)) == 0);
    testing::ExpectBf16CopyOf(dqkv16, d_dqkv, n_qkv, "dqkv16 with the bias gradient");

    // The first stage on the host: per batch row b and 16-row chunk, the fp32 column sums in row order; then
    // BiasGrad over them onto init. `exact`: the double column sums.
    const int64_t per_b = (c.T + 15) / 16, chunks = c.B * per_b;
    std::vector<double> exact(init.begin(), init.end());
    auto want_sums = [&](const std::vector<float>& rows) {
      std::vector<float> part(chunks * hd3, 0.0f);
      for (int64_t b = 0; b < c.B; ++b) {
        for (int64_t t = 0; t < c.T; ++t) {
          for (int64_t j = 0; j < hd3; ++j) part[(b * per_b + t / 16) * hd3 + j] += rows[(b * c.T + t) * hd3 + j];
        }
      }
      Dev<float> d_part(part), want(init), bg_scratch(BiasGradScratchFloats(chunks, hd3));
      REQUIRE(BiasGrad(want.get(), bg_scratch.get(), d_part.get(), chunks, hd3, nullptr) == cudaSuccess);
      return want.Get();
    };
    for (int64_t i = 0; i < n_qkv; ++i) exact[i % hd3] += dqkv[i];
    const std::vector<float> got = dbias.Get();
    CHECK(std::memcmp(got.data(), want_sums(dqkv).data(), hd3 * sizeof(float)) == 0);
    ExpectClose(got, std::vector<float>(exact.begin(), exact.end()), 1e-5f, 1e-6f, "qkv bias gradient");

    // Without the bias (the qkv GEMM added it in its cuBLASLt epilogue: training's path with runtime.gemm_epilogues):
    // the gradient of that bias is summed all the same, from the dqkv of the bias-free run.
    const Outputs nob = RunKernels(c, qkv, dout, /*bf16=*/true, /*rounded=*/false, nullptr);
    Dev<float> nob_out(nob.out), nob_lse(nob.lse), nob_dqkv(n_qkv), nob_dbias(init);
    REQUIRE(AttentionBackwardBf16(nob_dqkv.get(), scratch.get(), d_dout.get(), d_qkv.get(), nob_out.get(),
                                  nob_lse.get(), c.B, c.T, c.H, c.D, c.window, nullptr, nullptr, nullptr,
                                  nob_dbias.get()) == cudaSuccess);
    CHECK(std::memcmp(nob_dqkv.Get().data(), nob.dqkv.data(), n_qkv * sizeof(float)) == 0);
    CHECK(std::memcmp(nob_dbias.Get().data(), want_sums(nob.dqkv).data(), hd3 * sizeof(float)) == 0);

    // dqkv null: the rounding and the bias gradient alone, the same bits.
    REQUIRE(AttentionBackwardBf16(nullptr, scratch.get(), d_dout.get(), d_qkv.get(), d_out.get(), d_lse.get(), c.B, c.T,
                                  c.H, c.D, c.window, nullptr, only16.get(), d_bias.get(),
                                  dbias_only.get()) == cudaSuccess);
    testing::ExpectBf16CopyOf(only16, d_dqkv, n_qkv, "dqkv16 without dqkv");
    CHECK(std::memcmp(dbias_only.Get().data(), got.data(), hd3 * sizeof(float)) == 0);
  }
  Dev<float> buf(3 * 16), scratch(64);
  float* p = buf.get();
  CHECK(AttentionBackwardBf16(nullptr, scratch.get(), p, p, p, p, 1, 1, 1, 16, 0, nullptr, nullptr, nullptr, nullptr) ==
        cudaErrorInvalidValue);
  ExpectNoPoisonedReads();
}

// bf16 inputs (runtime.activations: bf16: qkv as the qkv GEMM wrote it, dout as the projection's backward GEMM
// wrote it, the forward's output read back as its bf16 rounding): the bits of the fp32 kernels on the widened qkv and
// dout and on the widened rounding of out — out, lse, out16 (also with out null), dqkv and its rounding, and the qkv
// bias gradient, reading out16 or rounding the fp32 out as it is read — with and without the qkv bias, with qkv 8-byte
// aligned (4-element loads) and, with the bias, one element past it (scalar loads). Both instantiations (D <= 64,
// D <= 128).
TEST_CASE("attention bf16 (tensor cores): bf16 qkv, dout and out give the bits of the fp32 kernels on widened values") {
  for (Case c : {Case{2, 37, 2, 32, 5}, Case{1, 70, 1, 80, 0}}) {
    CAPTURE(c.D);
    const int64_t n_qkv = c.B * c.T * 3 * c.H * c.D, n_out = c.B * c.T * c.H * c.D, hd3 = 3 * c.H * c.D;
    const auto qkv = Random(n_qkv, 351, -2.0f, 2.0f), dout = Random(n_out, 352), bias = Random(hd3, 353);
    auto round = [](const std::vector<float>& v, std::vector<__nv_bfloat16>& b16) {
      b16.resize(v.size());
      std::vector<float> w(v.size());
      for (size_t i = 0; i < v.size(); ++i) {
        b16[i] = __float2bfloat16(v[i]);
        w[i] = __bfloat162float(b16[i]);
      }
      return w;
    };
    std::vector<__nv_bfloat16> qkv16, dout16;
    const auto qkv_w = round(qkv, qkv16), dout_w = round(dout, dout16);
    Dev<float> d_bias(bias), d_qkv_w(qkv_w), d_dout_w(dout_w);
    Dev<__nv_bfloat16> d_dout16(dout16);
    Dev<float> scratch(AttentionBackwardScratchFloats(c.B, c.T, c.H, c.D) +
                       AttentionBiasGradScratchFloats(c.B, c.T, c.H, c.D));
    for (bool with_bias : {false, true}) {
      CAPTURE(with_bias);
      const float* const b = with_bias ? d_bias.get() : nullptr;
      // The oracle: the fp32-qkv kernels on the widened values.
      Dev<float> want_out(n_out), want_lse(c.B * c.H * c.T), want_dqkv(n_qkv),
          want_dbias(std::vector<float>(hd3, 0.0f));
      Dev<__nv_bfloat16> want_dqkv16(n_qkv);
      REQUIRE(AttentionForwardBf16(want_out.get(), want_lse.get(), d_qkv_w.get(), c.B, c.T, c.H, c.D, c.window, nullptr,
                                   nullptr, b) == cudaSuccess);
      std::vector<__nv_bfloat16> out16_host;
      Dev<float> out_w(round(want_out.Get(), out16_host));  // out as the bf16 path reads it back
      REQUIRE(AttentionBackwardBf16(want_dqkv.get(), scratch.get(), d_dout_w.get(), d_qkv_w.get(), out_w.get(),
                                    want_lse.get(), c.B, c.T, c.H, c.D, c.window, nullptr, want_dqkv16.get(), b,
                                    want_dbias.get()) == cudaSuccess);
      for (int64_t shift : {0, 1}) {
        if (shift == 1 && !with_bias) continue;  // (the scalar loads once per shape: the TSan run's time)
        CAPTURE(shift);
        std::vector<__nv_bfloat16> q1(shift, __float2bfloat16(0.0f));
        q1.insert(q1.end(), qkv16.begin(), qkv16.end());
        Dev<__nv_bfloat16> d_qkv(q1), out16(n_out), only16(n_out), dqkv16(n_qkv);
        Dev<float> d_out(n_out), d_lse(c.B * c.H * c.T), d_dqkv(n_qkv), dbias(std::vector<float>(hd3, 0.0f));
        const __nv_bfloat16* const q = d_qkv.get() + shift;
        REQUIRE(AttentionForwardBf16(d_out.get(), d_lse.get(), q, c.B, c.T, c.H, c.D, c.window, nullptr, out16.get(),
                                     b) == cudaSuccess);
        CHECK(std::memcmp(d_out.Get().data(), want_out.Get().data(), n_out * sizeof(float)) == 0);
        CHECK(std::memcmp(d_lse.Get().data(), want_lse.Get().data(), want_lse.Get().size() * sizeof(float)) == 0);
        testing::ExpectBf16CopyOf(out16, want_out, n_out, "out16 from bf16 qkv");
        if (shift == 0) {  // out null: only the rounding written, the same bits
          REQUIRE(AttentionForwardBf16(nullptr, d_lse.get(), q, c.B, c.T, c.H, c.D, c.window, nullptr, only16.get(),
                                       b) == cudaSuccess);
          testing::ExpectBf16CopyOf(only16, want_out, n_out, "out16 alone from bf16 qkv");
        }
        REQUIRE(AttentionBackwardBf16(d_dqkv.get(), scratch.get(), d_dout16.get(), q, nullptr, out16.get(), d_lse.get(),
                                      c.B, c.T, c.H, c.D, c.window, nullptr, dqkv16.get(), b,
                                      dbias.get()) == cudaSuccess);
        CHECK(std::memcmp(d_dqkv.Get().data(), want_dqkv.Get().data(), n_qkv * sizeof(float)) == 0);
        testing::ExpectBf16CopyOf(dqkv16, want_dqkv, n_qkv, "dqkv16 from bf16 inputs");
        CHECK(std::memcmp(dbias.Get().data(), want_dbias.Get().data(), hd3 * sizeof(float)) == 0);
        if (shift == 0 && with_bias) {  // the fp32 out rounded as it is read: the same bits
          Dev<float> dqkv2(n_qkv);
          REQUIRE(AttentionBackwardBf16(dqkv2.get(), scratch.get(), d_dout16.get(), q, d_out.get(), nullptr,
                                        d_lse.get(), c.B, c.T, c.H, c.D, c.window, nullptr, nullptr, b) == cudaSuccess);
          CHECK(std::memcmp(dqkv2.Get().data(), want_dqkv.Get().data(), n_qkv * sizeof(float)) == 0);
        }
      }
    }
    // Exactly one of out and out16 for the backward; something to write for the forward.
    Dev<float> buf(n_out);
    const __nv_bfloat16* q = d_dout16.get();
    CHECK(AttentionBackwardBf16(buf.get(), scratch.get(), q, q, nullptr, nullptr, buf.get(), 1, 1, 1, 16, 0, nullptr) ==
          cudaErrorInvalidValue);
    CHECK(AttentionBackwardBf16(buf.get(), scratch.get(), q, q, buf.get(), q, buf.get(), 1, 1, 1, 16, 0, nullptr) ==
          cudaErrorInvalidValue);
    CHECK(AttentionForwardBf16(nullptr, buf.get(), q, 1, 1, 1, 16, 0, nullptr, nullptr) == cudaErrorInvalidValue);
  }
  ExpectNoPoisonedReads();
}

// bf16 qkv and dout, 16-byte aligned: the kernels copy their loop's tiles asynchronously into two buffers used in turn
// (SetAttentionTcAsyncLoads), adding the qkv bias in shared memory. The bits of the synchronous loads: out, lse, out16,
// dqkv, dqkv16 and the bias gradient; over several tiles in both loops (T up to 4 tiles, so both buffers are reused),
// windows that start the key loop past tile 0, with and without the bias, both softmax variants (the register one
// keeps the backward's second buffers in its fp32 area at D <= 64), and both instantiations (D <= 64, <= 128).
TEST_CASE("attention bf16 (tensor cores): asynchronous tile copies give the bits of the synchronous loads") {
  struct Result {
    std::vector<float> out, lse, dqkv, dbias;
    std::vector<__nv_bfloat16> out16, dqkv16;
  };
#if defined(__SANITIZE_THREAD__)
  // Under ThreadSanitizer (22 s for all of them): one shape per instantiation, with the bias; its barriers are what
  // TSan checks, and the other shapes run in the other builds.
  const std::vector<Case> cases = {Case{1, 200, 2, 64, 0}, Case{1, 193, 1, 128, 0}};
  const std::vector<bool> biases = {true};
#else
  const std::vector<Case> cases = {Case{1, 200, 2, 64, 0}, Case{2, 150, 1, 48, 70}, Case{1, 193, 1, 128, 0},
                                   Case{1, 130, 1, 80, 66}};
  const std::vector<bool> biases = {true, false};
#endif
  for (const AttentionTcSoftmax mode : kSoftmaxModes) {
    const SoftmaxMode use(mode);
    for (const Case c : cases) {
      CAPTURE(static_cast<int>(mode));
      CAPTURE(c.T);
      CAPTURE(c.D);
      const int64_t n_qkv = c.B * c.T * 3 * c.H * c.D, n_out = c.B * c.T * c.H * c.D, hd3 = 3 * c.H * c.D;
      Bf16BackwardInputs in(c, 361);
      auto &d_qkv = in.qkv, &d_dout = in.dout;
      auto &d_bias = in.bias, &scratch = in.scratch;
      for (const bool with_bias : biases) {
        CAPTURE(with_bias);
        const float* const b = with_bias ? d_bias.get() : nullptr;
        auto run = [&](bool async) {
          const AsyncMode am(async);
          Dev<float> out(n_out), lse(c.B * c.H * c.T), dqkv(n_qkv), dbias(std::vector<float>(hd3, 0.0f));
          Dev<__nv_bfloat16> out16(n_out), dqkv16(n_qkv);
          REQUIRE(AttentionForwardBf16(out.get(), lse.get(), d_qkv.get(), c.B, c.T, c.H, c.D, c.window, nullptr,
                                       out16.get(), b) == cudaSuccess);
          REQUIRE(AttentionBackwardBf16(dqkv.get(), scratch.get(), d_dout.get(), d_qkv.get(), nullptr, out16.get(),
                                        lse.get(), c.B, c.T, c.H, c.D, c.window, nullptr, dqkv16.get(), b,
                                        with_bias ? dbias.get() : nullptr) == cudaSuccess);
          return Result{out.Get(), lse.Get(), dqkv.Get(), dbias.Get(), out16.Get(), dqkv16.Get()};
        };
        const Result sync = run(false), async = run(true);
        CHECK(SameBits(async.out, sync.out));
        CHECK(SameBits(async.lse, sync.lse));
        CHECK(SameBits(async.out16, sync.out16));
        CHECK(SameBits(async.dqkv, sync.dqkv));
        CHECK(SameBits(async.dqkv16, sync.dqkv16));
        CHECK(SameBits(async.dbias, sync.dbias));
        // A tile read before its copies land reads the poison (NaN): caught here even where both runs would agree.
        CHECK(std::all_of(async.dqkv.begin(), async.dqkv.end(), [](float v) { return std::isfinite(v); }));
      }
    }
  }
  ExpectNoPoisonedReads();
}

// The stored-dS backward (ds_tiles: the dK/dV kernel keeps dS, the dQ kernel makes one product per tile pair from it)
// against the backward that forms dS again in the dQ kernel: dK and dV are the same bits (the dK/dV kernel only stores
// more), dQ and the bias gradient agree within the bf16 tolerance — and with the register softmax under the emulator,
// where S^T and S are summed in the same order, bit for bit. The tile buffer starts as NaN, so a tile (or a warp's rows
// of one) the dK/dV kernel fails to write, or the dQ kernel reads from the wrong place, shows. Shapes: one tile and
// T = 1; odd T over several tiles without a window (a tile per (key, query) tile pair in the lower triangle); windows
// that leave a key tile fewer query tiles than the rest (70 at T = 300: 3 of 5; 1: the diagonal alone) or mask
// inside a tile; both instantiations (D <= 64, D <= 128); fp32 and bf16 inputs, synchronous and asynchronous copies,
// the qkv bias and none. AttentionDsTileBytes is checked against a count of the pairs that meet.
TEST_CASE("attention bf16 (tensor cores): the stored-dS backward (5 products) against the one that forms dS again") {
#if defined(__SANITIZE_THREAD__)
  const std::vector<Case> cases = {Case{1, 200, 1, 64, 70}};
#else
  const std::vector<Case> cases = {Case{1, 1, 1, 16, 0},    Case{2, 37, 2, 48, 5},  Case{1, 200, 2, 64, 0},
                                   Case{1, 300, 1, 64, 70}, Case{1, 300, 1, 16, 1}, Case{1, 193, 1, 128, 0},
                                   Case{1, 130, 1, 80, 66}};
#endif
  for (const Case c : cases) {
    const std::string shape = Describe(c);
    INFO(shape);
    // The pairs of 64-row tiles in which some query sees some key, counted.
    const int64_t ntiles = (c.T + 63) / 64;
    int64_t pairs = 0;
    for (int64_t kt = 0; kt < ntiles; ++kt) {
      for (int64_t qt = kt; qt < ntiles; ++qt) {
        bool meet = false;
        for (int64_t t = qt * 64; t < std::min(c.T, qt * 64 + 64) && !meet; ++t) {
          for (int64_t k = kt * 64; k < std::min(c.T, kt * 64 + 64) && !meet; ++k) {
            meet = k <= t && (c.window == 0 || t - c.window < k);
          }
        }
        pairs += meet;
      }
    }
    const int64_t ds_bytes = AttentionDsTileBytes(c.B, c.T, c.H, c.window);
    CHECK(ds_bytes == c.B * c.H * pairs * 64 * 64 * 2);
    const int64_t n_qkv = c.B * c.T * 3 * c.H * c.D, n_out = c.B * c.T * c.H * c.D, hd3 = 3 * c.H * c.D,
                  row = 3 * c.H * c.D;
    const auto qkv = Random(n_qkv, 381, -2.0f, 2.0f), dout = Random(n_out, 382);
    std::vector<__nv_bfloat16> qkv16(n_qkv), dout16(n_out);
    for (int64_t i = 0; i < n_qkv; ++i) qkv16[i] = __float2bfloat16(qkv[i]);
    for (int64_t i = 0; i < n_out; ++i) dout16[i] = __float2bfloat16(dout[i]);
    Dev<float> f_qkv(qkv), f_dout(dout), d_bias(Random(hd3, 383));
    Dev<__nv_bfloat16> h_qkv(qkv16), h_dout(dout16);
    Dev<float> scratch(AttentionBackwardScratchFloats(c.B, c.T, c.H, c.D) +
                       AttentionBiasGradScratchFloats(c.B, c.T, c.H, c.D));
    Dev<__nv_bfloat16> ds(ds_bytes / 2 + 8);
    for (const AttentionTcSoftmax mode : kSoftmaxModes) {
      const SoftmaxMode use(mode);
      for (const int inputs : {0, 1, 2}) {  // fp32; bf16 copied synchronously; bf16 copied asynchronously
        for (const bool with_bias : {false, true}) {
          CAPTURE(static_cast<int>(mode));
          CAPTURE(inputs);
          CAPTURE(with_bias);
          const AsyncMode am(inputs == 2);
          const float* const b = with_bias ? d_bias.get() : nullptr;
          struct Result {
            std::vector<float> dqkv, dbias;
            std::vector<__nv_bfloat16> tiles;
          };
          auto run = [&](bool stored) {
            Dev<float> out(n_out), lse(c.B * c.H * c.T), dqkv(n_qkv), dbias(std::vector<float>(hd3, 0.0f));
            REQUIRE(cudaMemset(ds.get(), 0xFF, ds_bytes + 16) == cudaSuccess);  // NaN
            __nv_bfloat16* const tiles = stored ? ds.get() : nullptr;
            float* const db = with_bias ? dbias.get() : nullptr;
            if (inputs == 0) {
              REQUIRE(AttentionForwardBf16(out.get(), lse.get(), f_qkv.get(), c.B, c.T, c.H, c.D, c.window, nullptr,
                                           nullptr, b) == cudaSuccess);
              REQUIRE(AttentionBackwardBf16(dqkv.get(), scratch.get(), f_dout.get(), f_qkv.get(), out.get(), lse.get(),
                                            c.B, c.T, c.H, c.D, c.window, nullptr, nullptr, b, db,
                                            tiles) == cudaSuccess);
            } else {
              REQUIRE(AttentionForwardBf16(out.get(), lse.get(), h_qkv.get(), c.B, c.T, c.H, c.D, c.window, nullptr,
                                           nullptr, b) == cudaSuccess);
              REQUIRE(AttentionBackwardBf16(dqkv.get(), scratch.get(), h_dout.get(), h_qkv.get(), out.get(), nullptr,
                                            lse.get(), c.B, c.T, c.H, c.D, c.window, nullptr, nullptr, b, db,
                                            tiles) == cudaSuccess);
            }
            return Result{dqkv.Get(), dbias.Get(), ds.Get()};
          };
          const Result recompute = run(false), stored = run(true);
          // Every tile element written by the stored run (none NaN), none by the other.
          auto nan = [](__nv_bfloat16 v) { return std::isnan(__bfloat162float(v)); };
          CHECK(std::none_of(stored.tiles.begin(), stored.tiles.begin() + ds_bytes / 2, nan));
          CHECK(std::all_of(recompute.tiles.begin(), recompute.tiles.end(), nan));
          // dK and dV: the same bits; dQ: close (the same bits under the emulator with the register softmax).
          std::vector<float> q_re, q_st, kv_re, kv_st;
          for (int64_t i = 0; i < n_qkv; ++i) {
            const bool is_q = i % row < c.H * c.D;
            (is_q ? q_re : kv_re).push_back(recompute.dqkv[i]);
            (is_q ? q_st : kv_st).push_back(stored.dqkv[i]);
          }
          CHECK(SameBits(kv_st, kv_re));
          CHECK(std::all_of(q_st.begin(), q_st.end(), [](float v) { return std::isfinite(v); }));
          ExpectClose(q_st, q_re, 2e-2f, 2e-2f, "dq, stored dS vs formed again");
          ExpectClose(stored.dbias, recompute.dbias, 2e-2f, 2e-2f, "dbias, stored dS vs formed again");
#if MS_KERNELS_SIM
          if (mode == AttentionTcSoftmax::kRegisters) {
            CHECK(SameBits(q_st, q_re));
            CHECK(SameBits(stored.dbias, recompute.dbias));
          }
#endif
        }
      }
    }
  }
  {  // a buffer not 16-byte aligned is refused
    const Case c{1, 20, 1, 16, 0};
    Dev<float> buf(3 * 20 * 16), scratch(AttentionBackwardScratchFloats(c.B, c.T, c.H, c.D));
    Dev<__nv_bfloat16> ds(AttentionDsTileBytes(c.B, c.T, c.H, c.window) / 2 + 8);
    float* p = buf.get();
    CHECK(AttentionBackwardBf16(p, scratch.get(), p, p, p, p, c.B, c.T, c.H, c.D, c.window, nullptr, nullptr, nullptr,
                                nullptr, ds.get() + 1) == cudaErrorInvalidValue);
    CHECK(cudaGetLastError() == cudaSuccess);
  }
  CHECK(AttentionDsTileBytes(0, 5, 1, 0) == 0);
  CHECK(AttentionDsTileBytes(1, 1024, 1, 0) == 136 * 8192);  // causal, 16 tiles: 16 * 17 / 2 pairs
  ExpectNoPoisonedReads();
}

// Compile-time product bounds (SetAttentionTcFixedBounds, on by default: the forward's kFullD instance where D equals
// the instance's bound, 64 or 128, and the 4-warp dK/dV and the stored-dS dQ kernels' at D = 64) give the
// run-time-bound instances' bits — out, lse, out16, and the stored-dS backward's dqkv16 and bias gradient — over T
// that leaves warps or a block's last tile past T, several tiles, windows, with and without the qkv bias; the launch
// counter shows the fixed-bound instances ran exactly there (the forward at D = 64 and 128, dK/dV and dQ at 64; none
// at D = 48 or 80, nor when turned off).
TEST_CASE("attention bf16 (tensor cores): compile-time product bounds give the run-time bounds' bits") {
#if defined(__SANITIZE_THREAD__)
  const std::vector<Case> cases = {Case{1, 130, 1, 64, 70}};
#else
  const std::vector<Case> cases = {Case{2, 37, 2, 64, 0},   Case{1, 130, 1, 64, 70}, Case{1, 100, 1, 128, 0},
                                   Case{1, 65, 1, 128, 40}, Case{1, 70, 1, 48, 5},   Case{1, 70, 1, 80, 0}};
#endif
  for (const Case c : cases) {
    const std::string shape = Describe(c);
    INFO(shape);
    const int64_t n_qkv = c.B * c.T * 3 * c.H * c.D, n_out = c.B * c.T * c.H * c.D, hd3 = 3 * c.H * c.D;
    Bf16BackwardInputs in(c, 381);
    auto &d_qkv = in.qkv, &d_dout = in.dout;
    auto &d_bias = in.bias, &scratch = in.scratch;
    const size_t ds_elems = AttentionDsTileBytes(c.B, c.T, c.H, c.window) / sizeof(__nv_bfloat16);
    for (const bool with_bias : {false, true}) {
      CAPTURE(with_bias);
      const float* const b = with_bias ? d_bias.get() : nullptr;
      struct Result {
        std::vector<float> out, lse, dbias;
        std::vector<__nv_bfloat16> out16, dqkv16;
        int64_t fixed = 0;
      };
      auto run = [&](bool fixed) {
        const ScopedSwitch fm(SetAttentionTcFixedBounds, fixed, true);
        Dev<float> out(n_out), lse(c.B * c.H * c.T), dbias(std::vector<float>(hd3, 0.0f));
        Dev<__nv_bfloat16> out16(n_out), dqkv16(n_qkv), ds(ds_elems);
        const int64_t launches0 = AttentionTcFixedBoundsLaunches();
        REQUIRE(AttentionForwardBf16(nullptr, lse.get(), d_qkv.get(), c.B, c.T, c.H, c.D, c.window, nullptr,
                                     out16.get(), b) == cudaSuccess);
        REQUIRE(AttentionForwardBf16(out.get(), lse.get(), d_qkv.get(), c.B, c.T, c.H, c.D, c.window, nullptr, nullptr,
                                     b) == cudaSuccess);
        REQUIRE(AttentionBackwardBf16(nullptr, scratch.get(), d_dout.get(), d_qkv.get(), nullptr, out16.get(),
                                      lse.get(), c.B, c.T, c.H, c.D, c.window, nullptr, dqkv16.get(), b, dbias.get(),
                                      ds.get()) == cudaSuccess);
        return Result{out.Get(),   lse.Get(),    dbias.Get(),
                      out16.Get(), dqkv16.Get(), AttentionTcFixedBoundsLaunches() - launches0};
      };
      const Result var = run(false), fixed = run(true);
      CHECK(var.fixed == 0);
      CHECK(fixed.fixed == (c.D == 64 ? 4 : c.D == 128 ? 2 : 0));  // two forwards; at 64 also dK/dV and dQ
      CHECK(SameBits(fixed.out, var.out));
      CHECK(SameBits(fixed.lse, var.lse));
      CHECK(SameBits(fixed.out16, var.out16));
      CHECK(SameBits(fixed.dqkv16, var.dqkv16));
      CHECK(SameBits(fixed.dbias, var.dbias));
      CHECK(std::all_of(fixed.dqkv16.begin(), fixed.dqkv16.end(),
                        [](__nv_bfloat16 v) { return std::isfinite(__bfloat162float(v)); }));
    }
  }
  ExpectNoPoisonedReads();
}

// The wide forward (SetAttentionTcWideForward: blocks of 128 query rows, two 16-row fragment rows per warp sharing
// each K and V fragment load) gives the default forward's bits — out, lse, out16 — over T that leaves a block's last
// warps, or a warp's second fragment row, past T (1, 37, 100, 129), several 128-row blocks (300), windows that mask
// part of a tile, start the key loop past tile 0 or leave tiles inside the band (window 150 at T 300), with and
// without the qkv bias; with its query fragments in registers (D <= 64) and read from shared memory at each tile
// (D = 80, 96, 128). Under the emulator the launched blocks show which kernel ran: B H ceil(T / 128) blocks for the
// wide one, B H ceil(T / 64) for the default.
TEST_CASE("attention bf16 (tensor cores): the wide forward gives the default forward's bits") {
#if defined(__SANITIZE_THREAD__)
  // Its barriers and warp collectives, with the bias; at D = 128 also the output areas over the warps' query rows.
  const std::vector<Case> cases = {Case{1, 300, 1, 64, 150}, Case{1, 200, 1, 128, 66}};
  const std::vector<bool> biases = {true};
#else
  const std::vector<Case> cases = {Case{1, 1, 1, 16, 0},     Case{2, 37, 2, 32, 5},    Case{1, 100, 1, 64, 0},
                                   Case{1, 129, 2, 48, 66},  Case{1, 300, 1, 64, 150}, Case{1, 300, 1, 16, 1},
                                   Case{1, 70, 1, 80, 0},    Case{1, 200, 1, 128, 0},  Case{2, 129, 1, 96, 66},
                                   Case{1, 300, 1, 128, 150}};
  const std::vector<bool> biases = {true, false};
#endif
  {  // the first tensor-core call of the process also launches the fragment layout probe (one block)
    Dev<__nv_bfloat16> q(std::vector<__nv_bfloat16>(3 * 16, __float2bfloat16(0.0f)));
    Dev<float> o(16), l(1);
    REQUIRE(AttentionForwardBf16(o.get(), l.get(), q.get(), 1, 1, 1, 16, 0, nullptr) == cudaSuccess);
  }
  for (const Case c : cases) {
    const std::string shape = Describe(c);
    INFO(shape);
    const int64_t n_qkv = c.B * c.T * 3 * c.H * c.D, n_out = c.B * c.T * c.H * c.D;
    std::vector<__nv_bfloat16> qkv16(n_qkv);
    const auto qkv = Random(n_qkv, 371, -2.0f, 2.0f);
    for (int64_t i = 0; i < n_qkv; ++i) qkv16[i] = __float2bfloat16(qkv[i]);
    Dev<__nv_bfloat16> d_qkv(qkv16);
    Dev<float> d_bias(Random(3 * c.H * c.D, 372));
    for (const bool with_bias : biases) {
      CAPTURE(with_bias);
      struct Result {
        std::vector<float> out, lse;
        std::vector<__nv_bfloat16> out16;
        uint64_t blocks = 0;
      };
      auto run = [&](bool wide) {
        const ScopedSwitch wm(SetAttentionTcWideForward, wide, false);
        Dev<float> out(n_out), lse(c.B * c.H * c.T);
        Dev<__nv_bfloat16> out16(n_out);
#if MS_KERNELS_SIM
        const uint64_t blocks0 = ms::sim::GetStats().blocks;
#endif
        REQUIRE(AttentionForwardBf16(out.get(), lse.get(), d_qkv.get(), c.B, c.T, c.H, c.D, c.window, nullptr,
                                     out16.get(), with_bias ? d_bias.get() : nullptr) == cudaSuccess);
        Result r{out.Get(), lse.Get(), out16.Get()};
#if MS_KERNELS_SIM
        r.blocks = ms::sim::GetStats().blocks - blocks0;
#endif
        return r;
      };
      const Result base = run(false), wide = run(true);
      CHECK(SameBits(wide.out, base.out));
      CHECK(SameBits(wide.lse, base.lse));
      CHECK(SameBits(wide.out16, base.out16));
      CHECK(std::all_of(wide.out.begin(), wide.out.end(), [](float v) { return std::isfinite(v); }));
#if MS_KERNELS_SIM
      const uint64_t heads = static_cast<uint64_t>(c.B * c.H);
      CHECK(base.blocks == heads * ((c.T + 63) / 64));
      CHECK(wide.blocks == heads * ((c.T + 127) / 128));
#endif
    }
  }
  ExpectNoPoisonedReads();
}

// The split dK/dV kernel (SetAttentionTcSplitDkDv: 8 warps, each 16 keys and half of dK's and dV's columns, P^T and
// dS^T exchanged through shared memory) gives the 4-warp kernel's bits with the register softmax — dqkv, dqkv16, the
// qkv bias gradient and (stored dS) the dS tiles — over T that leaves row groups or a warp's query columns past T (1,
// 37, 100), several key tiles (129, 300), windows that mask part of a tile or start past tile 0, D = 32, 64, 96, 128
// (both instances), with and without the bias and the stored dS. Under the emulator the launched threads show which
// kernel ran: 128 more per dK/dV block for the split one; none more at D = 48 (not a multiple of 32), with fp32
// operands, or with the softmax forced through shared memory, where the default runs.
TEST_CASE("attention bf16 (tensor cores): the split dK/dV kernel gives the 4-warp kernel's bits") {
  struct Run {
    Case c;
    bool bias, stored;
  };
#if defined(__SANITIZE_THREAD__)
  const std::vector<Run> runs = {Run{Case{1, 129, 1, 64, 70}, true, true}};  // its barriers and async copies
#else
  const std::vector<Run> runs = {Run{Case{1, 1, 1, 32, 0}, true, true},     Run{Case{2, 37, 2, 32, 5}, false, true},
                                 Run{Case{1, 100, 1, 64, 0}, true, true},   Run{Case{1, 100, 1, 64, 0}, false, false},
                                 Run{Case{1, 129, 2, 96, 66}, true, true},  Run{Case{1, 300, 1, 64, 150}, true, true},
                                 Run{Case{1, 130, 1, 128, 0}, true, false}, Run{Case{1, 200, 1, 128, 70}, false, true},
                                 Run{Case{1, 70, 1, 48, 0}, true, true}};
#endif
  const SoftmaxMode regs(AttentionTcSoftmax::kRegisters);
  for (const Run& run : runs) {
    const Case c = run.c;
    const std::string shape = Describe(c);
    INFO(shape);
    CAPTURE(run.bias);
    CAPTURE(run.stored);
    const int64_t n_qkv = c.B * c.T * 3 * c.H * c.D, n_out = c.B * c.T * c.H * c.D, hd3 = 3 * c.H * c.D;
    const auto qkv = Random(n_qkv, 391, -2.0f, 2.0f), dout = Random(n_out, 392);
    std::vector<__nv_bfloat16> qkv16(n_qkv), dout16(n_out);
    for (int64_t i = 0; i < n_qkv; ++i) qkv16[i] = __float2bfloat16(qkv[i]);
    for (int64_t i = 0; i < n_out; ++i) dout16[i] = __float2bfloat16(dout[i]);
    Dev<__nv_bfloat16> h_qkv(qkv16), h_dout(dout16);
    Dev<float> d_bias(Random(hd3, 393)), out(n_out), lse(c.B * c.H * c.T);
    const float* const bias = run.bias ? d_bias.get() : nullptr;
    REQUIRE(AttentionForwardBf16(out.get(), lse.get(), h_qkv.get(), c.B, c.T, c.H, c.D, c.window, nullptr, nullptr,
                                 bias) == cudaSuccess);
    const int64_t ds_bytes = AttentionDsTileBytes(c.B, c.T, c.H, c.window);
    struct Result {
      std::vector<float> dqkv, dbias;
      std::vector<__nv_bfloat16> dqkv16, tiles;
      uint64_t threads = 0;
    };
    auto backward = [&](bool split) {
      const ScopedSwitch sm(SetAttentionTcSplitDkDv, split, false);
      Dev<float> dqkv(n_qkv), dbias(std::vector<float>(hd3, 0.0f));
      Dev<__nv_bfloat16> dqkv16(n_qkv), ds(ds_bytes / 2 + 8);
      Dev<float> scratch(AttentionBackwardScratchFloats(c.B, c.T, c.H, c.D) +
                         AttentionBiasGradScratchFloats(c.B, c.T, c.H, c.D));
      REQUIRE(cudaMemset(ds.get(), 0xFF, ds_bytes + 16) == cudaSuccess);  // NaN: a tile element not written shows
#if MS_KERNELS_SIM
      const uint64_t threads0 = ms::sim::GetStats().threads;
#endif
      REQUIRE(AttentionBackwardBf16(dqkv.get(), scratch.get(), h_dout.get(), h_qkv.get(), out.get(), nullptr, lse.get(),
                                    c.B, c.T, c.H, c.D, c.window, nullptr, dqkv16.get(), bias,
                                    run.bias ? dbias.get() : nullptr, run.stored ? ds.get() : nullptr) == cudaSuccess);
      Result r{dqkv.Get(), dbias.Get(), dqkv16.Get(), ds.Get()};
      r.tiles.resize(ds_bytes / 2);
#if MS_KERNELS_SIM
      r.threads = ms::sim::GetStats().threads - threads0;
#endif
      return r;
    };
    const Result base = backward(false), split = backward(true);
    CHECK(SameBits(split.dqkv, base.dqkv));
    CHECK(SameBits(split.dqkv16, base.dqkv16));
    CHECK(SameBits(split.dbias, base.dbias));
    CHECK(SameBits(split.tiles, base.tiles));
    CHECK(std::all_of(split.dqkv.begin(), split.dqkv.end(), [](float v) { return std::isfinite(v); }));
    if (run.stored) {
      CHECK(std::none_of(split.tiles.begin(), split.tiles.end(),
                         [](__nv_bfloat16 v) { return std::isnan(__bfloat162float(v)); }));
    }
#if MS_KERNELS_SIM
    const uint64_t dkdv_blocks = static_cast<uint64_t>(c.B * c.H * ((c.T + 63) / 64));
    CHECK(split.threads - base.threads == (c.D % 32 == 0 ? dkdv_blocks * 128 : 0));
#endif
  }
#if MS_KERNELS_SIM && !defined(__SANITIZE_THREAD__)
  {  // where the default runs: fp32 operands, or the softmax forced through shared memory
    const Case c{1, 70, 1, 64, 0};
    const int64_t n_qkv = c.B * c.T * 3 * c.H * c.D, n_out = c.B * c.T * c.H * c.D;
    Dev<float> f_qkv(Random(n_qkv, 394)), f_dout(Random(n_out, 395)), out(n_out), lse(c.B * c.H * c.T), dqkv(n_qkv);
    Dev<float> scratch(AttentionBackwardScratchFloats(c.B, c.T, c.H, c.D));
    std::vector<__nv_bfloat16> q16(n_qkv), d16(n_out);
    const auto fq = f_qkv.Get(), fd = f_dout.Get();
    for (int64_t i = 0; i < n_qkv; ++i) q16[i] = __float2bfloat16(fq[i]);
    for (int64_t i = 0; i < n_out; ++i) d16[i] = __float2bfloat16(fd[i]);
    Dev<__nv_bfloat16> h_qkv(q16), h_dout(d16);
    REQUIRE(AttentionForwardBf16(out.get(), lse.get(), f_qkv.get(), c.B, c.T, c.H, c.D, c.window, nullptr) ==
            cudaSuccess);
    auto threads = [&](bool split, bool fp32, AttentionTcSoftmax mode) {
      const ScopedSwitch sm(SetAttentionTcSplitDkDv, split, false);
      const SoftmaxMode use(mode);
      const uint64_t threads0 = ms::sim::GetStats().threads;
      if (fp32) {
        REQUIRE(AttentionBackwardBf16(dqkv.get(), scratch.get(), f_dout.get(), f_qkv.get(), out.get(), lse.get(), c.B,
                                      c.T, c.H, c.D, c.window, nullptr) == cudaSuccess);
      } else {
        REQUIRE(AttentionBackwardBf16(dqkv.get(), scratch.get(), h_dout.get(), h_qkv.get(), out.get(), nullptr,
                                      lse.get(), c.B, c.T, c.H, c.D, c.window, nullptr) == cudaSuccess);
      }
      return ms::sim::GetStats().threads - threads0;
    };
    CHECK(threads(true, true, AttentionTcSoftmax::kRegisters) == threads(false, true, AttentionTcSoftmax::kRegisters));
    CHECK(threads(true, false, AttentionTcSoftmax::kShared) == threads(false, false, AttentionTcSoftmax::kShared));
    CHECK(threads(true, false, AttentionTcSoftmax::kAuto) ==
          threads(false, false, AttentionTcSoftmax::kAuto) + 2 * 128);  // 2 key tiles
  }
#endif
  ExpectNoPoisonedReads();
}

TEST_CASE("attention bf16 (tensor cores): D not a multiple of 16 or above 128 is rejected") {
  Dev<float> buf(3 * 144 * 2), scratch(4);
  float* p = buf.get();
  CHECK(AttentionForwardBf16(p, p, p, 1, 1, 1, 24, 0, nullptr) == cudaErrorInvalidValue);
  CHECK(AttentionBackwardBf16(p, scratch.get(), p, p, p, p, 1, 1, 1, 24, 0, nullptr) == cudaErrorInvalidValue);
  CHECK(AttentionForwardBf16(p, p, p, 1, 1, 1, 144, 0, nullptr) == cudaErrorInvalidValue);
  CHECK(AttentionForwardBf16(p, p, p, 1, 1, 1, 16, -1, nullptr) == cudaErrorInvalidValue);
  CHECK(AttentionForwardBf16(p, p, p, 0, 5, 1, 16, 0, nullptr) == cudaSuccess);
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("attention: D > 128, D < 1 and window < 0 are rejected; empty problems launch nothing") {
  Dev<float> buf(3 * 129 * 2), scratch(4);
  float* p = buf.get();
  CHECK(AttentionForward(p, p, p, 1, 1, 1, 129, 0, nullptr) == cudaErrorInvalidValue);
  CHECK(AttentionBackward(p, scratch.get(), p, p, p, p, 1, 1, 1, 129, 0, nullptr) == cudaErrorInvalidValue);
  CHECK(AttentionForward(p, p, p, 1, 1, 1, 0, 0, nullptr) == cudaErrorInvalidValue);
  CHECK(AttentionForward(p, p, p, 1, 1, 1, 4, -1, nullptr) == cudaErrorInvalidValue);
  CHECK(AttentionBackward(p, scratch.get(), p, p, p, p, 1, 1, 1, 4, -1, nullptr) == cudaErrorInvalidValue);
  CHECK(AttentionForward(p, p, p, 0, 5, 1, 4, 0, nullptr) == cudaSuccess);
  CHECK(AttentionBackward(p, scratch.get(), p, p, p, p, 1, 0, 1, 4, 0, nullptr) == cudaSuccess);
  CHECK(AttentionBackwardScratchFloats(0, 5, 1, 4) == 0);
  CHECK(AttentionBackwardScratchFloats(2, 5, 3, 4) == 30);
  CHECK(cudaGetLastError() == cudaSuccess);
}

}  // namespace
}  // namespace ms::kernels
