// Reference implementations of every op: plain loops, double accumulation, no parallelism.
// They are the oracle for the fast versions (tests compare against them); clarity over speed.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/ops.h"

namespace ms::ops::ref {
namespace {

constexpr double kGeluScale = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluCube = 0.044715;

// First key a query at position t attends to.
int64_t FirstKey(int64_t t, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, t - window + 1) : 0;
}

}  // namespace

void Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double a = trans_a ? A[k * lda + i] : A[i * lda + k];
        const double b = trans_b ? B[j * ldb + k] : B[k * ldb + j];
        acc += a * b;
      }
      const double c = beta == 0.0f ? 0.0 : static_cast<double>(beta) * C[i * ldc + j];
      C[i * ldc + j] = static_cast<float>(alpha * acc + c);
    }
  }
}

void MatmulForward(float* out, const float* inp, const float* w, const float* bias, int64_t N, int64_t IC, int64_t OC) {
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t o = 0; o < OC; ++o) {
      double acc = bias ? bias[o] : 0.0;
      for (int64_t c = 0; c < IC; ++c) acc += static_cast<double>(inp[i * IC + c]) * w[o * IC + c];
      out[i * OC + o] = static_cast<float>(acc);
    }
  }
}

void MatmulBackward(float* dinp, float* dw, float* dbias, const float* dout, const float* inp, const float* w,
                    int64_t N, int64_t IC, int64_t OC) {
  if (dinp) {
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t c = 0; c < IC; ++c) {
        double acc = 0;
        for (int64_t o = 0; o < OC; ++o) acc += static_cast<double>(dout[i * OC + o]) * w[o * IC + c];
        dinp[i * IC + c] = static_cast<float>(dinp[i * IC + c] + acc);
      }
    }
  }
  for (int64_t o = 0; o < OC; ++o) {
    for (int64_t c = 0; c < IC; ++c) {
      double acc = 0;
      for (int64_t i = 0; i < N; ++i) acc += static_cast<double>(dout[i * OC + o]) * inp[i * IC + c];
      dw[o * IC + c] = static_cast<float>(dw[o * IC + c] + acc);
    }
  }
  if (dbias) {
    for (int64_t o = 0; o < OC; ++o) {
      double acc = 0;
      for (int64_t i = 0; i < N; ++i) acc += dout[i * OC + o];
      dbias[o] = static_cast<float>(dbias[o] + acc);
    }
  }
}

void LayerNormForward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b, int64_t N,
                      int64_t C, float eps) {
  for (int64_t i = 0; i < N; ++i) {
    const float* xi = x + i * C;
    double m = 0;
    for (int64_t c = 0; c < C; ++c) m += xi[c];
    m /= static_cast<double>(C);
    double var = 0;
    for (int64_t c = 0; c < C; ++c) var += (xi[c] - m) * (xi[c] - m);
    var /= static_cast<double>(C);
    const double s = 1.0 / std::sqrt(var + eps);
    for (int64_t c = 0; c < C; ++c) out[i * C + c] = static_cast<float>((xi[c] - m) * s * w[c] + b[c]);
    mean[i] = static_cast<float>(m);
    rstd[i] = static_cast<float>(s);
  }
}

void LayerNormBackward(float* dx, float* dw, float* db, const float* dout, const float* x, const float* w,
                       const float* mean, const float* rstd, int64_t N, int64_t C) {
  std::vector<double> dw_acc(C, 0.0), db_acc(C, 0.0);
  for (int64_t i = 0; i < N; ++i) {
    const float* xi = x + i * C;
    const float* gi = dout + i * C;
    // xhat = (x - mean) * rstd; dnorm = dout * w;
    // dx = rstd * (dnorm - mean(dnorm) - xhat * mean(dnorm * xhat)).
    double sum_dnorm = 0, sum_dnorm_xhat = 0;
    for (int64_t c = 0; c < C; ++c) {
      const double xhat = (static_cast<double>(xi[c]) - mean[i]) * rstd[i];
      const double dnorm = static_cast<double>(gi[c]) * w[c];
      sum_dnorm += dnorm;
      sum_dnorm_xhat += dnorm * xhat;
      dw_acc[c] += gi[c] * xhat;
      db_acc[c] += gi[c];
    }
    const double mean_dnorm = sum_dnorm / static_cast<double>(C);
    const double mean_dnorm_xhat = sum_dnorm_xhat / static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c) {
      const double xhat = (static_cast<double>(xi[c]) - mean[i]) * rstd[i];
      const double dnorm = static_cast<double>(gi[c]) * w[c];
      dx[i * C + c] = static_cast<float>(dx[i * C + c] + rstd[i] * (dnorm - mean_dnorm - xhat * mean_dnorm_xhat));
    }
  }
  for (int64_t c = 0; c < C; ++c) {
    dw[c] = static_cast<float>(dw[c] + dw_acc[c]);
    db[c] = static_cast<float>(db[c] + db_acc[c]);
  }
}

void GeluForward(float* out, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i];
    out[i] = static_cast<float>(0.5 * v * (1.0 + std::tanh(kGeluScale * (v + kGeluCube * v * v * v))));
  }
}

void GeluBackward(float* dx, const float* x, const float* dout, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i];
    const double th = std::tanh(kGeluScale * (v + kGeluCube * v * v * v));
    const double sech2 = 1.0 - th * th;
    const double grad = 0.5 * (1.0 + th) + 0.5 * v * sech2 * kGeluScale * (1.0 + 3.0 * kGeluCube * v * v);
    dx[i] = static_cast<float>(grad * dout[i]);
  }
}

void AttentionForward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t H, int64_t D,
                      int64_t window) {
  const int64_t row = 3 * H * D;  // stride between tokens in qkv
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> p(T);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t = 0; t < T; ++t) {
        const float* q = qkv + (b * T + t) * row + h * D;
        const int64_t s0 = FirstKey(t, window);
        double mx = -INFINITY;
        for (int64_t s = s0; s <= t; ++s) {
          const float* k = qkv + (b * T + s) * row + H * D + h * D;
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(q[d]) * k[d];
          p[s] = dot * scale;
          mx = std::max(mx, p[s]);
        }
        double sum = 0;
        for (int64_t s = s0; s <= t; ++s) {
          p[s] = std::exp(p[s] - mx);
          sum += p[s];
        }
        float* o = out + ((b * T + t) * H + h) * D;
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0;
          for (int64_t s = s0; s <= t; ++s) acc += p[s] * qkv[(b * T + s) * row + 2 * H * D + h * D + d];
          o[d] = static_cast<float>(acc / sum);
        }
        lse[(b * H + h) * T + t] = static_cast<float>(mx + std::log(sum));
      }
    }
  }
}

void AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* /*out*/, const float* /*lse*/,
                       int64_t B, int64_t T, int64_t H, int64_t D, int64_t window) {
  // Recomputes the probabilities and the output in double instead of trusting out and lse.
  const int64_t row = 3 * H * D;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> p(T), dq(T * D), dk(T * D), dv(T * D), o(D);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      auto q_at = [&](int64_t t, int64_t d) -> double { return qkv[(b * T + t) * row + h * D + d]; };
      auto k_at = [&](int64_t t, int64_t d) -> double { return qkv[(b * T + t) * row + H * D + h * D + d]; };
      auto v_at = [&](int64_t t, int64_t d) -> double { return qkv[(b * T + t) * row + 2 * H * D + h * D + d]; };
      std::fill(dq.begin(), dq.end(), 0.0);
      std::fill(dk.begin(), dk.end(), 0.0);
      std::fill(dv.begin(), dv.end(), 0.0);
      for (int64_t t = 0; t < T; ++t) {
        const int64_t s0 = FirstKey(t, window);
        const float* g = dout + ((b * T + t) * H + h) * D;
        double mx = -INFINITY;
        for (int64_t s = s0; s <= t; ++s) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += q_at(t, d) * k_at(s, d);
          p[s] = dot * scale;
          mx = std::max(mx, p[s]);
        }
        double sum = 0;
        for (int64_t s = s0; s <= t; ++s) {
          p[s] = std::exp(p[s] - mx);
          sum += p[s];
        }
        for (int64_t s = s0; s <= t; ++s) p[s] /= sum;
        double di = 0;  // sum_d dout * out
        for (int64_t d = 0; d < D; ++d) {
          o[d] = 0;
          for (int64_t s = s0; s <= t; ++s) o[d] += p[s] * v_at(s, d);
          di += g[d] * o[d];
        }
        for (int64_t s = s0; s <= t; ++s) {
          double dp = 0;
          for (int64_t d = 0; d < D; ++d) dp += g[d] * v_at(s, d);
          const double ds = p[s] * (dp - di) * scale;  // gradient of the raw dot product q.k
          for (int64_t d = 0; d < D; ++d) {
            dq[t * D + d] += ds * k_at(s, d);
            dk[s * D + d] += ds * q_at(t, d);
            dv[s * D + d] += p[s] * g[d];
          }
        }
      }
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t d = 0; d < D; ++d) {
          dqkv[(b * T + t) * row + h * D + d] = static_cast<float>(dq[t * D + d]);
          dqkv[(b * T + t) * row + H * D + h * D + d] = static_cast<float>(dk[t * D + d]);
          dqkv[(b * T + t) * row + 2 * H * D + h * D + d] = static_cast<float>(dv[t * D + d]);
        }
      }
    }
  }
}

void CrossEntropyForward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N, int64_t V) {
  for (int64_t i = 0; i < N; ++i) {
    const float* l = logits + i * V;
    double mx = -INFINITY;
    for (int64_t j = 0; j < V; ++j) mx = std::max(mx, static_cast<double>(l[j]));
    double sum = 0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(l[j] - mx);
    const double z = mx + std::log(sum);
    lse[i] = static_cast<float>(z);
    losses[i] = targets[i] < 0 ? 0.0f : static_cast<float>(z - l[targets[i]]);
  }
}

void CrossEntropyBackward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                          const float* dloss, int64_t N, int64_t V) {
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t j = 0; j < V; ++j) {
      if (targets[i] < 0) {
        dlogits[i * V + j] = 0.0f;
        continue;
      }
      const double p = std::exp(static_cast<double>(logits[i * V + j]) - lse[i]);
      dlogits[i * V + j] = static_cast<float>((p - (j == targets[i] ? 1.0 : 0.0)) * dloss[i]);
    }
  }
}

void CrossEntropyFused(float* losses, float* lse, float* logits, const int32_t* targets, const float* dloss, int64_t N,
                       int64_t V) {
  CrossEntropyForward(losses, lse, logits, targets, N, V);
  CrossEntropyBackward(logits, logits, lse, targets, dloss, N, V);  // elementwise: in place is exact
}

void EmbeddingForward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C) {
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t c = 0; c < C; ++c) out[i * C + c] = ids[i] < 0 ? 0.0f : table[ids[i] * C + c];
  }
}

void EmbeddingBackward(float* dtable, const int32_t* ids, const float* dout, int64_t N, int64_t C) {
  for (int64_t i = 0; i < N; ++i) {
    if (ids[i] < 0) continue;
    for (int64_t c = 0; c < C; ++c) dtable[ids[i] * C + c] += dout[i * C + c];
  }
}

void AddInPlace(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}
void Axpy(float* y, float a, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}
void Add(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}
void Scale(float* x, float a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] *= a;
}
double SumSquares(const float* x, int64_t n) {
  double acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(x[i]) * x[i];
  return acc;
}

void AdamWStep(float* p, const float* g, float* m, float* v, int64_t n, const AdamParams& hp, int64_t step) {
  const double b1 = hp.beta1, b2 = hp.beta2;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(step));
  for (int64_t i = 0; i < n; ++i) {
    const double pi = p[i] * (1.0 - static_cast<double>(hp.lr) * hp.weight_decay);
    const double mi = b1 * m[i] + (1.0 - b1) * g[i];
    const double vi = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
    const double denom = std::sqrt(vi / bc2) + hp.eps;
    p[i] = static_cast<float>(pi - hp.lr * (mi / bc1) / denom);
    m[i] = static_cast<float>(mi);
    v[i] = static_cast<float>(vi);
  }
}

void LambDirection(float* u, const float* p, const float* g, float* m, float* v, int64_t n, const AdamParams& hp,
                   int64_t step) {
  const double b1 = hp.beta1, b2 = hp.beta2;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(step));
  for (int64_t i = 0; i < n; ++i) {
    const double mi = b1 * m[i] + (1.0 - b1) * g[i];
    const double vi = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
    u[i] =
        static_cast<float>((mi / bc1) / (std::sqrt(vi / bc2) + hp.eps) + static_cast<double>(hp.weight_decay) * p[i]);
    m[i] = static_cast<float>(mi);
    v[i] = static_cast<float>(vi);
  }
}

void LambApply(float* p, const float* u, int64_t n, float lr, float trust_ratio) {
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(p[i] - static_cast<double>(lr) * trust_ratio * u[i]);
}

}  // namespace ms::ops::ref
