// Fast row-wise and elementwise ops: layernorm, GeLU, softmax cross-entropy, embedding, vector helpers.
// Rows are independent and split statically over threads; reductions across rows are split over
// columns, each column summed over the rows in order, so results do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/kernels_cpu.h"
#include "ops/ops.h"

namespace ms::ops {
namespace {

using internal::ExpF;
using internal::kParallelMin;

constexpr int64_t kColBlock = 64;                  // columns per task in column reductions
constexpr int64_t kChunk = 1 << 14;                // elements per task in elementwise loops and SumSquares
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCube = 0.044715f;

MS_OPS_CLONES void LayerNormRow(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b,
                                int64_t C, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < C; ++c) sum += x[c];
  const float m = sum / static_cast<float>(C);
  float var = 0.0f;
#pragma omp simd reduction(+ : var)
  for (int64_t c = 0; c < C; ++c) var += (x[c] - m) * (x[c] - m);
  const float s = 1.0f / std::sqrt(var / static_cast<float>(C) + eps);
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) out[c] = (x[c] - m) * s * w[c] + b[c];
  *mean = m;
  *rstd = s;
}

// dx += rstd * (dnorm - mean(dnorm) - xhat * mean(dnorm * xhat)), dnorm = dout * w.
MS_OPS_CLONES void LayerNormBackwardRow(float* dx, const float* dout, const float* x, const float* w, float mean,
                                        float rstd, int64_t C) {
  float sum_dnorm = 0.0f, sum_dnorm_xhat = 0.0f;
#pragma omp simd reduction(+ : sum_dnorm, sum_dnorm_xhat)
  for (int64_t c = 0; c < C; ++c) {
    const float dnorm = dout[c] * w[c];
    sum_dnorm += dnorm;
    sum_dnorm_xhat += dnorm * (x[c] - mean) * rstd;
  }
  const float a = sum_dnorm / static_cast<float>(C);
  const float bcoef = sum_dnorm_xhat / static_cast<float>(C);
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) dx[c] += rstd * (dout[c] * w[c] - a - (x[c] - mean) * rstd * bcoef);
}

// dw[c0:c0+nc] += sum_i dout * xhat, db[c0:c0+nc] += sum_i dout, rows in order.
MS_OPS_CLONES void LayerNormParamGrads(float* dw, float* db, const float* dout, const float* x, const float* mean,
                                       const float* rstd, int64_t N, int64_t C, int64_t c0, int64_t nc) {
  float accw[kColBlock] = {}, accb[kColBlock] = {};
  for (int64_t i = 0; i < N; ++i) {
    const float* g = dout + i * C + c0;
    const float* xi = x + i * C + c0;
    const float m = mean[i], s = rstd[i];
#pragma omp simd
    for (int64_t j = 0; j < nc; ++j) {
      accw[j] += g[j] * ((xi[j] - m) * s);
      accb[j] += g[j];
    }
  }
  for (int64_t j = 0; j < nc; ++j) {
    dw[c0 + j] += accw[j];
    db[c0 + j] += accb[j];
  }
}

// 0.5 (1 + tanh(u)) = sigmoid(2u) and 1 - tanh(u)^2 = 4 sigmoid(2u) sigmoid(-2u): the sigmoid form keeps
// its relative accuracy in the negative tail, where 1 + tanh(u) cancels. 2u is clamped so exp stays finite
// (sigmoid is already exactly 0 or 1 in float there).
inline float GeluU2(float v) {
  return std::clamp(2.0f * kGeluScale * (v + kGeluCube * v * v * v), -80.0f, 80.0f);
}

MS_OPS_CLONES void GeluChunk(float* out, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    out[i] = v / (1.0f + ExpF(-GeluU2(v)));
  }
}

MS_OPS_CLONES void GeluBackwardChunk(float* dx, const float* x, const float* dout, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float e = ExpF(-GeluU2(v));
    const float s = 1.0f / (1.0f + e);  // sigmoid(2u)
    const float sm = e * s;             // sigmoid(-2u) = 1 - s, without cancellation
    const float du = kGeluScale * (1.0f + 3.0f * kGeluCube * v * v);
    dx[i] = (s + 2.0f * v * s * sm * du) * dout[i];
  }
}

// Log-sum-exp of one row of V logits: the exponentials are summed in float over blocks of 1024 (vector
// lanes), the block sums in double.
MS_OPS_CLONES float LogSumExpRow(const float* l, int64_t V) {
  float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < V; ++j) mx = std::max(mx, l[j]);
  double sum = 0.0;
  for (int64_t j0 = 0; j0 < V; j0 += 1024) {
    const int64_t j1 = std::min(V, j0 + 1024);
    float block = 0.0f;
#pragma omp simd reduction(+ : block)
    for (int64_t j = j0; j < j1; ++j) block += ExpF(l[j] - mx);
    sum += block;
  }
  return mx + static_cast<float>(std::log(sum));
}

MS_OPS_CLONES void CrossEntropyBackwardRow(float* dl, const float* l, float lse, int32_t target, float scale,
                                           int64_t V) {
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) dl[j] = ExpF(l[j] - lse) * scale;
  dl[target] -= scale;
}

// Runs f(begin, end) over [0, n) in chunks of kChunk, in parallel when n is large.
template <typename F>
void ForChunks(int64_t n, F f) {
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t k = 0; k < nchunks; ++k) f(k * kChunk, std::min(n, (k + 1) * kChunk));
}

}  // namespace

void LayerNormForward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b, int64_t N,
                      int64_t C, float eps) {
#pragma omp parallel for schedule(static) if (N * C > kParallelMin)
  for (int64_t i = 0; i < N; ++i) LayerNormRow(out + i * C, mean + i, rstd + i, x + i * C, w, b, C, eps);
}

void LayerNormBackward(float* dx, float* dw, float* db, const float* dout, const float* x, const float* w,
                       const float* mean, const float* rstd, int64_t N, int64_t C) {
  const int64_t nblocks = (C + kColBlock - 1) / kColBlock;
#pragma omp parallel if (N * C > kParallelMin)
  {
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < N; ++i) LayerNormBackwardRow(dx + i * C, dout + i * C, x + i * C, w, mean[i], rstd[i], C);
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      const int64_t c0 = blk * kColBlock;
      LayerNormParamGrads(dw, db, dout, x, mean, rstd, N, C, c0, std::min(kColBlock, C - c0));
    }
  }
}

void GeluForward(float* out, const float* x, int64_t n) {
  ForChunks(n, [&](int64_t i0, int64_t i1) { GeluChunk(out + i0, x + i0, i1 - i0); });
}

void GeluBackward(float* dx, const float* x, const float* dout, int64_t n) {
  ForChunks(n, [&](int64_t i0, int64_t i1) { GeluBackwardChunk(dx + i0, x + i0, dout + i0, i1 - i0); });
}

void CrossEntropyForward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N, int64_t V) {
#pragma omp parallel for schedule(static) if (N * V > kParallelMin)
  for (int64_t i = 0; i < N; ++i) {
    const float* l = logits + i * V;
    lse[i] = LogSumExpRow(l, V);
    losses[i] = targets[i] < 0 ? 0.0f : lse[i] - l[targets[i]];
  }
}

void CrossEntropyBackward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                          const float* dloss, int64_t N, int64_t V) {
#pragma omp parallel for schedule(static) if (N * V > kParallelMin)
  for (int64_t i = 0; i < N; ++i) {
    if (targets[i] < 0) {
      std::fill(dlogits + i * V, dlogits + (i + 1) * V, 0.0f);
    } else {
      CrossEntropyBackwardRow(dlogits + i * V, logits + i * V, lse[i], targets[i], dloss[i], V);
    }
  }
}

void CrossEntropyFused(float* losses, float* lse, float* logits, const int32_t* targets, const float* dloss, int64_t N,
                       int64_t V) {
#pragma omp parallel for schedule(static) if (N * V > kParallelMin)
  for (int64_t i = 0; i < N; ++i) {
    float* l = logits + i * V;
    lse[i] = LogSumExpRow(l, V);
    if (targets[i] < 0) {
      losses[i] = 0.0f;
      std::fill(l, l + V, 0.0f);
    } else {
      losses[i] = lse[i] - l[targets[i]];
      CrossEntropyBackwardRow(l, l, lse[i], targets[i], dloss[i], V);  // same element in and out
    }
  }
}

void EmbeddingForward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static) if (N * C > kParallelMin)
  for (int64_t i = 0; i < N; ++i) {
    if (ids[i] < 0) {
      std::fill(out + i * C, out + (i + 1) * C, 0.0f);
    } else {
      std::memcpy(out + i * C, table + ids[i] * C, sizeof(float) * C);
    }
  }
}

void EmbeddingBackward(float* dtable, const int32_t* ids, const float* dout, int64_t N, int64_t C) {
  // Each task owns a block of columns of every table row: no two tasks touch the same element, and each
  // element receives its rows in order.
  const int64_t nblocks = (C + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (N * C > kParallelMin)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t c0 = blk * kColBlock;
    const int64_t nc = std::min(kColBlock, C - c0);
    for (int64_t i = 0; i < N; ++i) {
      if (ids[i] < 0) continue;
      internal::AxpyF(dtable + ids[i] * C + c0, 1.0f, dout + i * C + c0, nc);
    }
  }
}

void AddInPlace(float* y, const float* x, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void Axpy(float* y, float a, const float* x, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void Add(float* out, const float* a, const float* b, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void Scale(float* x, float a, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) x[i] *= a;
}

double SumSquares(const float* x, int64_t n) {
  if (n <= 0) return 0.0;
  // Fixed chunks, each summed on its own, then the partial sums in chunk order: the result does not
  // depend on how chunks are spread over threads.
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(nchunks);
  ForChunks(n, [&](int64_t i0, int64_t i1) {
    double acc = 0.0;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = i0; i < i1; ++i) acc += static_cast<double>(x[i]) * x[i];
    partial[i0 / kChunk] = acc;
  });
  double total = 0.0;
  for (double s : partial) total += s;
  return total;
}

}  // namespace ms::ops
