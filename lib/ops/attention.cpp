// Fast causal sliding-window attention, forward and backward, FlashAttention style: the forward keeps
// only one row of scores per query (length <= window), the backward recomputes probabilities from lse.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/kernels_cpu.h"
#include "ops/ops.h"

namespace ms::ops {
namespace {

using internal::AxpyF;
using internal::DotF;
using internal::ExpF;
using internal::FirstKey;

constexpr int64_t kQueryBlock = 16;  // queries per forward task

// Queries t0 <= t < t1 of one (b, h). Pointers are at token 0 of this sequence and head:
//   q, k, v: token stride `row` (3*H*D); o: token stride `orow` (H*D); lse: contiguous over t.
// p: scratch of at least min(T, window) floats.
MS_OPS_CLONES void ForwardQueries(float* o, float* lse, const float* q, const float* k, const float* v, int64_t t0,
                                  int64_t t1, int64_t D, int64_t row, int64_t orow, int64_t window, float scale,
                                  float* p) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t s0 = FirstKey(t, window);
    const int64_t n = t - s0 + 1;
    const float* qt = q + t * row;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      p[j] = DotF(qt, k + (s0 + j) * row, D) * scale;
      mx = std::max(mx, p[j]);
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      p[j] = ExpF(p[j] - mx);
      sum += p[j];
    }
    float* ot = o + t * orow;
    std::fill(ot, ot + D, 0.0f);
    for (int64_t j = 0; j < n; ++j) AxpyF(ot, p[j], v + (s0 + j) * row, D);
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) ot[d] *= inv;
    lse[t] = mx + std::log(sum);
  }
}

// All queries of one (b, h). dq, dk, dv, q, k, v: token stride `row`; dout, out: token stride `orow`.
// p, ds: scratch of at least min(T, window) floats.
MS_OPS_CLONES void BackwardHead(float* dq, float* dk, float* dv, const float* q, const float* k, const float* v,
                                const float* dout, const float* out, const float* lse, int64_t T, int64_t D,
                                int64_t row, int64_t orow, int64_t window, float scale, float* p, float* ds) {
  for (int64_t t = 0; t < T; ++t) {
    std::fill(dk + t * row, dk + t * row + D, 0.0f);
    std::fill(dv + t * row, dv + t * row + D, 0.0f);
  }
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s0 = FirstKey(t, window);
    const int64_t n = t - s0 + 1;
    const float* qt = q + t * row;
    const float* gt = dout + t * orow;
    const float di = DotF(gt, out + t * orow, D);  // D_t = sum(dout_t * out_t)
    const float lt = lse[t];
    for (int64_t j = 0; j < n; ++j) {
      p[j] = DotF(qt, k + (s0 + j) * row, D) * scale - lt;
      ds[j] = DotF(gt, v + (s0 + j) * row, D);  // dP = dout_t . v_s
    }
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      p[j] = ExpF(p[j]);                    // probabilities, recomputed from lse
      ds[j] = p[j] * (ds[j] - di) * scale;  // gradient of the raw dot product q_t . k_s
    }
    float* dqt = dq + t * row;
    std::fill(dqt, dqt + D, 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t off = (s0 + j) * row;
      AxpyF(dqt, ds[j], k + off, D);
      AxpyF(dk + off, ds[j], qt, D);
      AxpyF(dv + off, p[j], gt, D);
    }
  }
}

}  // namespace

void AttentionForward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t H, int64_t D,
                      int64_t window) {
  if (B <= 0 || T <= 0 || H <= 0) return;
  const int64_t row = 3 * H * D, orow = H * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t keys = window > 0 ? std::min(window, T) : T;
  const int64_t nqb = (T + kQueryBlock - 1) / kQueryBlock;
  const int64_t ntasks = B * H * nqb;
  // Tasks (b, h, query block) dealt round-robin: causal blocks differ in cost, neighbours even out.
#pragma omp parallel if (ntasks > 1)
  {
    std::vector<float> p(keys);
#pragma omp for schedule(static, 1)
    for (int64_t task = 0; task < ntasks; ++task) {
      const int64_t b = task / (H * nqb), h = (task / nqb) % H, qb = task % nqb;
      const float* base = qkv + b * T * row + h * D;
      ForwardQueries(out + b * T * orow + h * D, lse + (b * H + h) * T, base, base + H * D, base + 2 * H * D,
                     qb * kQueryBlock, std::min(T, (qb + 1) * kQueryBlock), D, row, orow, window, scale, p.data());
    }
  }
}

void AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int64_t B,
                       int64_t T, int64_t H, int64_t D, int64_t window) {
  if (B <= 0 || T <= 0 || H <= 0) return;
  const int64_t row = 3 * H * D, orow = H * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t keys = window > 0 ? std::min(window, T) : T;
  // One task per (b, h): it owns the dq, dk, dv slices of its head, so accumulation needs no sharing.
#pragma omp parallel if (B * H > 1)
  {
    std::vector<float> p(keys), ds(keys);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const float* base = qkv + b * T * row + h * D;
      float* dbase = dqkv + b * T * row + h * D;
      BackwardHead(dbase, dbase + H * D, dbase + 2 * H * D, base, base + H * D, base + 2 * H * D,
                   dout + b * T * orow + h * D, out + b * T * orow + h * D, lse + bh * T, T, D, row, orow, window,
                   scale, p.data(), ds.data());
    }
  }
}

}  // namespace ms::ops
