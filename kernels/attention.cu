// defines: attention_forward_kernel, attention_row_term_kernel, attention_dkdv_kernel, attention_dq_kernel and
// their launchers (AttentionForward, AttentionBackwardScratchFloats, AttentionBackward).
// Causal sliding-window attention over a fused qkv buffer, FlashAttention-2 style, fp32; semantics of
// ms::ops::AttentionForward/Backward (lib/ops/ops.h), contract in kernels/attention.h.
//
// Tiles are 32 rows/keys wide (kTile), blocks have 4 warps; a warp owns 8 rows (forward, dQ) or 8 keys
// (dK/dV) of the block's tile, and its 32 lanes run over the other side's tile (one key or one query row per
// lane) to form scores, then over the head dimension (d = lane + 32 j, j < 4, so D <= 128) to accumulate.
// Scores of rows a warp owns stay in registers; probabilities / dS go through a small per-warp shared area
// to be broadcast. A row or key tile stride of D | 1 (odd) keeps the lane-per-row reads free of bank
// conflicts. Only the tiles meeting the band t - window < s <= t are loaded; warps skip the tiles their own
// rows/keys do not meet. Masked pairs contribute exactly nothing (their products are skipped, not multiplied
// by 0), so a NaN or Inf outside a query's window never reaches its outputs.
#include <type_traits>

#include "attention_common.cuh"

namespace ms::kernels {

using attention_detail::AllowSharedBytes;
using attention_detail::HeadRows;
using attention_detail::HeadRowsOf;
using attention_detail::Meets;
using attention_detail::Sees;

namespace {
constexpr int kTile = 32;                     // Br = Bc: query rows per tile, keys per tile (one per lane)
constexpr int kWarps = 4;                     // warps per block
constexpr int kThreads = kWarps * 32;         // threads per block
constexpr int kRowsPerWarp = kTile / kWarps;  // rows (or keys) of the block's tile owned by one warp
constexpr int kDPerLane = 4;                  // accumulator columns per lane: d = lane + 32 j
constexpr int kMaxD = kDPerLane * 32;         // = kAttentionMaxHeadDim
constexpr int kRowTermThreads = 256;          // attention_row_term_kernel: 8 rows per block
static_assert(kTile == 32, "the score loops put one key (or query row) of the tile on each lane");
static_assert(kRowsPerWarp * kWarps == kTile, "the warps must cover the tile");
static_assert(kMaxD == kAttentionMaxHeadDim, "head-dim limit and per-lane accumulators disagree");

// dst[r * ld + d] = src[(t0 + r) * stride + d] for r < kTile, d < D; rows t0 + r >= T are zero-filled.
// All threads of the block take part; the caller synchronizes.
__device__ __forceinline__ void LoadTile(float* dst, int ld, const float* src, long stride, int t0, int T, int D) {
  for (int i = threadIdx.x; i < kTile * D; i += blockDim.x) {
    const int r = i / D, d = i - r * D;
    const int t = t0 + r;
    dst[r * ld + d] = t < T ? src[static_cast<long>(t) * stride + d] : 0.0f;
  }
}
}  // namespace

// ---- kernels ----

// One block per (b, h, query tile); blockIdx.x = bh * ntiles + (ntiles - 1 - tile): the longest causal rows
// start first. Online softmax: each warp keeps, for each of its 8 rows, the running max m, a per-lane partial
// of the running sum l and the lane's 4 output columns, all rescaled when the max grows.
// Shared (floats): Q [32][D], K [32][D|1], V [32][D], P [32][32].
// out (B, T, H, D), lse (B, H, T), qkv (B, T, 3, H, D). window: 0 (causal) or 0 < window < T.
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(float* out, float* lse, const float* qkv, int T, int H, int D, int window, int ntiles,
                             float scale) {
  MS_DYNAMIC_SHARED(float, smem);
  const int ks = D | 1;
  float* const Qs = smem;
  float* const Ks = Qs + kTile * D;
  float* const Vs = Ks + kTile * ks;
  float* const Ps = Vs + kTile * D;

  const int bh = blockIdx.x / ntiles, qt = ntiles - 1 - static_cast<int>(blockIdx.x % ntiles);
  const int b = bh / H, h = bh % H;
  const HeadRows hr = HeadRowsOf(qkv, static_cast<const float*>(nullptr), b, h, T, H, D);
  const long row = hr.row;
  const float *q = hr.q, *k = hr.k, *v = hr.v;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int q0 = qt * kTile, q1 = min(q0 + kTile, T);
  const int ra = q0 + warp * kRowsPerWarp, rb = min(ra + kRowsPerWarp, T) - 1;  // this warp's rows; none if rb < ra
  float* const Pw = Ps + warp * kRowsPerWarp * kTile;
  const float* const Qw = Qs + warp * kRowsPerWarp * D;

  LoadTile(Qs, D, q, row, q0, T, D);

  float m[kRowsPerWarp], l[kRowsPerWarp], o[kRowsPerWarp][kDPerLane];
  MS_UNROLL
  for (int r = 0; r < kRowsPerWarp; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
    MS_UNROLL
    for (int j = 0; j < kDPerLane; ++j) o[r][j] = 0.0f;
  }

  const int kt_lo = (window > 0 ? max(0, q0 - window + 1) : 0) / kTile, kt_hi = (q1 - 1) / kTile;
  for (int kt = kt_lo; kt <= kt_hi; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();  // the previous K, V, P are no longer read
    LoadTile(Ks, ks, k, row, k0, T, D);
    LoadTile(Vs, D, v, row, k0, T, D);
    __syncthreads();
    if (rb < ra || !Meets(ra, rb, k0, k0 + kTile - 1, window)) continue;  // warp-uniform

    // Scores of this warp's rows against key k0 + lane.
    float s[kRowsPerWarp];
    MS_UNROLL
    for (int r = 0; r < kRowsPerWarp; ++r) s[r] = 0.0f;
    const float* kr = Ks + lane * ks;
    for (int d = 0; d < D; ++d) {
      const float kd = kr[d];
      MS_UNROLL
      for (int r = 0; r < kRowsPerWarp; ++r) s[r] += Qw[r * D + d] * kd;
    }
    const int key = k0 + lane;
    MS_UNROLL
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int t = ra + r;
      const float sc = (t <= rb && Sees(t, key, window)) ? s[r] * scale : -INFINITY;
      const float m_new = fmaxf(m[r], WarpMax(sc));
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // no key seen yet: p = 0, alpha = 0
      const float alpha = expf(m[r] - m_use);
      const float p = expf(sc - m_use);
      l[r] = l[r] * alpha + p;
      MS_UNROLL
      for (int j = 0; j < kDPerLane; ++j) o[r][j] *= alpha;
      m[r] = m_new;
      Pw[r * kTile + lane] = p;
    }
    __syncwarp();
    // o += P V over the tile's keys, lanes over d.
    for (int c = 0; c < kTile; ++c) {
      float vv[kDPerLane];
      MS_UNROLL
      for (int j = 0; j < kDPerLane; ++j) {
        const int d = lane + 32 * j;
        vv[j] = d < D ? Vs[c * D + d] : 0.0f;
      }
      MS_UNROLL
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float p = Pw[r * kTile + c];  // same for every lane: a uniform branch
        if (p != 0.0f) {
          MS_UNROLL
          for (int j = 0; j < kDPerLane; ++j) o[r][j] += p * vv[j];
        }
      }
    }
  }

  MS_UNROLL
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const float sum = WarpSum(l[r]);
    const int t = ra + r;
    if (t <= rb) {
      const float inv = 1.0f / sum;
      float* ot = out + ((static_cast<long>(b) * T + t) * H + h) * D;
      MS_UNROLL
      for (int j = 0; j < kDPerLane; ++j) {
        const int d = lane + 32 * j;
        if (d < D) ot[d] = o[r][j] * inv;
      }
      if (lane == 0) lse[static_cast<long>(bh) * T + t] = m[r] + logf(sum);
    }
  }
}

// The row term's out operand: fp32 with fp32 dout; with bf16 dout rounded to bf16 (a bf16 out as it is).
template <typename G>
__device__ __forceinline__ float RowTermOut(float o) {
  if constexpr (std::is_same_v<G, float>) {
    return o;
  } else {
    return __bfloat162float(__float2bfloat16_rn(o));
  }
}
template <typename G>
__device__ __forceinline__ float RowTermOut(__nv_bfloat16 o) {
  return __bfloat162float(o);
}

// drow (B, H, T) = sum_d dout * out per (b, t, h); a warp per row, rows taken in (B, T, H) order. G, O: the types of
// dout and out (float, float; bf16, float; bf16, bf16: AttentionRowTerms).
template <typename G, typename O>
__global__ void __launch_bounds__(kRowTermThreads)
    attention_row_term_kernel(float* drow, const G* dout, const O* out, int T, int H, int D, int rows) {
  const int lane = threadIdx.x % 32;
  const int n = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (n >= rows) return;  // whole warps
  const G* g = dout + static_cast<long>(n) * D;
  const O* o = out + static_cast<long>(n) * D;
  float acc = 0.0f;
  for (int d = lane; d < D; d += 32) acc += Widen(g[d]) * RowTermOut<G>(o[d]);
  acc = WarpSum(acc);
  if (lane == 0) {
    const int h = n % H, bt = n / H;
    const int b = bt / T, t = bt % T;
    drow[(static_cast<long>(b) * H + h) * T + t] = acc;
  }
}

// One block per (b, h, key tile); blockIdx.x = bh * ntiles + tile. Loops over the query tiles that can see
// the key tile; a warp owns 8 keys, a lane is a query row of the current tile. With P = exp(scale q.k - lse)
// and dS = P (dout.v - drow) scale: dV_s = sum_t P_ts dout_t, dK_s = sum_t dS_ts q_t, each summed in t order
// by the lane owning column d.
// Shared (floats): K [32][D], V [32][D], Q [32][D|1], dout [32][D|1], lse [32], drow [32], P [32][32],
// dS [32][32].
__global__ void __launch_bounds__(kThreads)
    attention_dkdv_kernel(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* drow, int T,
                          int H, int D, int window, int ntiles, float scale) {
  MS_DYNAMIC_SHARED(float, smem);
  const int qs = D | 1;
  float* const Ks = smem;
  float* const Vs = Ks + kTile * D;
  float* const Qs = Vs + kTile * D;
  float* const Gs = Qs + kTile * qs;
  float* const Ls = Gs + kTile * qs;
  float* const Ds = Ls + kTile;
  float* const Ps = Ds + kTile;
  float* const Ss = Ps + kTile * kTile;

  const int bh = blockIdx.x / ntiles, kt = blockIdx.x % ntiles;
  const int b = bh / H, h = bh % H;
  const HeadRows hr = HeadRowsOf(qkv, dout, b, h, T, H, D);
  const long row = hr.row, orow = hr.orow;
  const float *q = hr.q, *k = hr.k, *v = hr.v, *g = hr.g;
  const float* lse_bh = lse + static_cast<long>(bh) * T;
  const float* drow_bh = drow + static_cast<long>(bh) * T;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int k0 = kt * kTile, k1 = min(k0 + kTile, T);
  const int ja = k0 + warp * kRowsPerWarp, jb = min(ja + kRowsPerWarp, T) - 1;  // this warp's keys; none if jb < ja
  float* const Pw = Ps + warp * kRowsPerWarp * kTile;
  float* const Sw = Ss + warp * kRowsPerWarp * kTile;
  const float* const Kw = Ks + warp * kRowsPerWarp * D;
  const float* const Vw = Vs + warp * kRowsPerWarp * D;

  LoadTile(Ks, D, k, row, k0, T, D);
  LoadTile(Vs, D, v, row, k0, T, D);

  float dk[kRowsPerWarp][kDPerLane], dv[kRowsPerWarp][kDPerLane];
  MS_UNROLL
  for (int r = 0; r < kRowsPerWarp; ++r) {
    MS_UNROLL
    for (int j = 0; j < kDPerLane; ++j) dk[r][j] = dv[r][j] = 0.0f;
  }

  // Queries that see a key of [k0, k1): t in [k0, k1 - 1 + window - 1] (window > 0), else [k0, T).
  const int t_hi = window > 0 ? min(T - 1, k1 - 2 + window) : T - 1;
  for (int it = k0 / kTile; it <= t_hi / kTile; ++it) {
    const int i0 = it * kTile;
    __syncthreads();  // the previous Q, dout, lse, drow, P, dS are no longer read
    LoadTile(Qs, qs, q, row, i0, T, D);
    LoadTile(Gs, qs, g, orow, i0, T, D);
    if (threadIdx.x < kTile) {
      const int t = i0 + threadIdx.x;
      Ls[threadIdx.x] = t < T ? lse_bh[t] : 0.0f;
      Ds[threadIdx.x] = t < T ? drow_bh[t] : 0.0f;
    }
    __syncthreads();
    if (jb < ja || !Meets(i0, i0 + kTile - 1, ja, jb, window)) continue;  // warp-uniform

    // Scores and dout.v of query i0 + lane against this warp's keys.
    float s[kRowsPerWarp], dp[kRowsPerWarp];
    MS_UNROLL
    for (int r = 0; r < kRowsPerWarp; ++r) s[r] = dp[r] = 0.0f;
    const float* qr = Qs + lane * qs;
    const float* gr = Gs + lane * qs;
    for (int d = 0; d < D; ++d) {
      const float qd = qr[d], gd = gr[d];
      MS_UNROLL
      for (int r = 0; r < kRowsPerWarp; ++r) {
        s[r] += qd * Kw[r * D + d];
        dp[r] += gd * Vw[r * D + d];
      }
    }
    const int t = i0 + lane;
    const float lt = Ls[lane], dt = Ds[lane];
    MS_UNROLL
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const bool seen = t < T && ja + r <= jb && Sees(t, ja + r, window);
      const float p = seen ? expf(s[r] * scale - lt) : 0.0f;
      Pw[r * kTile + lane] = p;
      Sw[r * kTile + lane] = seen ? p * (dp[r] - dt) * scale : 0.0f;
    }
    __syncwarp();
    // dV += P^T dout, dK += dS^T Q over the tile's queries, lanes over d.
    for (int i = 0; i < kTile; ++i) {
      float gv[kDPerLane], qv[kDPerLane];
      MS_UNROLL
      for (int j = 0; j < kDPerLane; ++j) {
        const int d = lane + 32 * j;
        gv[j] = d < D ? Gs[i * qs + d] : 0.0f;
        qv[j] = d < D ? Qs[i * qs + d] : 0.0f;
      }
      MS_UNROLL
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float p = Pw[r * kTile + i], ds = Sw[r * kTile + i];  // uniform across the warp
        if (p != 0.0f) {
          MS_UNROLL
          for (int j = 0; j < kDPerLane; ++j) dv[r][j] += p * gv[j];
        }
        if (ds != 0.0f) {
          MS_UNROLL
          for (int j = 0; j < kDPerLane; ++j) dk[r][j] += ds * qv[j];
        }
      }
    }
  }

  MS_UNROLL
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int s = ja + r;
    if (s > jb) continue;
    float* dkt = dqkv + (static_cast<long>(b) * T + s) * row + static_cast<long>(H + h) * D;
    float* dvt = dkt + static_cast<long>(H) * D;
    MS_UNROLL
    for (int j = 0; j < kDPerLane; ++j) {
      const int d = lane + 32 * j;
      if (d < D) {
        dkt[d] = dk[r][j];
        dvt[d] = dv[r][j];
      }
    }
  }
}

// One block per (b, h, query tile); blockIdx.x = bh * ntiles + (ntiles - 1 - tile). Loops over the key tiles
// the query tile sees; a warp owns 8 query rows, a lane is a key of the current tile.
// dQ_t = sum_s dS_ts k_s, summed in s order by the lane owning column d.
// Shared (floats): Q [32][D], dout [32][D], K [32][D|1], V [32][D|1], dS [32][32].
// (kThreads, 4): at most 128 registers; with (kThreads) alone ptxas picks 96 on sm_80 and spills
// (scripts/check_ptxas.py).
__global__ void __launch_bounds__(kThreads, 4)
    attention_dq_kernel(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* drow, int T,
                        int H, int D, int window, int ntiles, float scale) {
  MS_DYNAMIC_SHARED(float, smem);
  const int ks = D | 1;
  float* const Qs = smem;
  float* const Gs = Qs + kTile * D;
  float* const Ks = Gs + kTile * D;
  float* const Vs = Ks + kTile * ks;
  float* const Ss = Vs + kTile * ks;

  const int bh = blockIdx.x / ntiles, qt = ntiles - 1 - static_cast<int>(blockIdx.x % ntiles);
  const int b = bh / H, h = bh % H;
  const HeadRows hr = HeadRowsOf(qkv, dout, b, h, T, H, D);
  const long row = hr.row, orow = hr.orow;
  const float *q = hr.q, *k = hr.k, *v = hr.v, *g = hr.g;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int q0 = qt * kTile, q1 = min(q0 + kTile, T);
  const int ra = q0 + warp * kRowsPerWarp, rb = min(ra + kRowsPerWarp, T) - 1;
  float* const Sw = Ss + warp * kRowsPerWarp * kTile;
  const float* const Qw = Qs + warp * kRowsPerWarp * D;
  const float* const Gw = Gs + warp * kRowsPerWarp * D;

  LoadTile(Qs, D, q, row, q0, T, D);
  LoadTile(Gs, D, g, orow, q0, T, D);

  float lr[kRowsPerWarp], dr[kRowsPerWarp], dq[kRowsPerWarp][kDPerLane];
  MS_UNROLL
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int t = ra + r;
    lr[r] = t <= rb ? lse[static_cast<long>(bh) * T + t] : 0.0f;
    dr[r] = t <= rb ? drow[static_cast<long>(bh) * T + t] : 0.0f;
    MS_UNROLL
    for (int j = 0; j < kDPerLane; ++j) dq[r][j] = 0.0f;
  }

  const int kt_lo = (window > 0 ? max(0, q0 - window + 1) : 0) / kTile, kt_hi = (q1 - 1) / kTile;
  for (int kt = kt_lo; kt <= kt_hi; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();  // the previous K, V, dS are no longer read
    LoadTile(Ks, ks, k, row, k0, T, D);
    LoadTile(Vs, ks, v, row, k0, T, D);
    __syncthreads();
    if (rb < ra || !Meets(ra, rb, k0, k0 + kTile - 1, window)) continue;  // warp-uniform

    float s[kRowsPerWarp], dp[kRowsPerWarp];
    MS_UNROLL
    for (int r = 0; r < kRowsPerWarp; ++r) s[r] = dp[r] = 0.0f;
    const float* kr = Ks + lane * ks;
    const float* vr = Vs + lane * ks;
    for (int d = 0; d < D; ++d) {
      const float kd = kr[d], vd = vr[d];
      MS_UNROLL
      for (int r = 0; r < kRowsPerWarp; ++r) {
        s[r] += Qw[r * D + d] * kd;
        dp[r] += Gw[r * D + d] * vd;
      }
    }
    const int key = k0 + lane;
    MS_UNROLL
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int t = ra + r;
      const bool seen = t <= rb && Sees(t, key, window);
      const float p = seen ? expf(s[r] * scale - lr[r]) : 0.0f;
      Sw[r * kTile + lane] = seen ? p * (dp[r] - dr[r]) * scale : 0.0f;
    }
    __syncwarp();
    for (int c = 0; c < kTile; ++c) {
      float kv[kDPerLane];
      MS_UNROLL
      for (int j = 0; j < kDPerLane; ++j) {
        const int d = lane + 32 * j;
        kv[j] = d < D ? Ks[c * ks + d] : 0.0f;
      }
      MS_UNROLL
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float ds = Sw[r * kTile + c];  // uniform across the warp
        if (ds != 0.0f) {
          MS_UNROLL
          for (int j = 0; j < kDPerLane; ++j) dq[r][j] += ds * kv[j];
        }
      }
    }
  }

  MS_UNROLL
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int t = ra + r;
    if (t > rb) continue;
    float* dqt = dqkv + (static_cast<long>(b) * T + t) * row + static_cast<long>(h) * D;
    MS_UNROLL
    for (int j = 0; j < kDPerLane; ++j) {
      const int d = lane + 32 * j;
      if (d < D) dqt[d] = dq[r][j];
    }
  }
}

// ---- launchers ----

namespace {
size_t ForwardSharedBytes(int D) {
  return sizeof(float) * (static_cast<size_t>(kTile) * (2 * D + (D | 1)) + kTile * kTile);
}
size_t DkDvSharedBytes(int D) {
  return sizeof(float) * (static_cast<size_t>(kTile) * (2 * D + 2 * (D | 1)) + 2 * kTile + 2 * kTile * kTile);
}
size_t DqSharedBytes(int D) {
  return sizeof(float) * (static_cast<size_t>(kTile) * (2 * D + 2 * (D | 1)) + kTile * kTile);
}

using Shape = attention_detail::AttentionShape;
cudaError_t CheckShape(int64_t B, int64_t T, int64_t H, int64_t D, int64_t window, bool* empty, Shape* s) {
  return attention_detail::CheckAttentionShape(B, T, H, D, window, kTile, empty, s);
}
}  // namespace

cudaError_t AttentionForward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t H, int64_t D,
                             int64_t window, cudaStream_t stream) {
  bool empty = false;
  Shape s{};
  cudaError_t err = CheckShape(B, T, H, D, window, &empty, &s);
  if (err != cudaSuccess || empty) return err;
  const size_t smem = ForwardSharedBytes(s.D);
  if ((err = AllowSharedBytes(attention_forward_kernel, smem)) != cudaSuccess) return err;
  MS_LAUNCH(attention_forward_kernel, s.blocks, kThreads, smem, stream, out, lse, qkv, s.T, s.H, s.D, s.window,
            s.ntiles, s.scale);
  return cudaGetLastError();
}

int64_t AttentionBackwardScratchFloats(int64_t B, int64_t T, int64_t H, int64_t /*D*/) {
  return B > 0 && T > 0 && H > 0 ? B * H * T : 0;
}

cudaError_t AttentionBackward(float* dqkv, float* scratch, const float* dout, const float* qkv, const float* out,
                              const float* lse, int64_t B, int64_t T, int64_t H, int64_t D, int64_t window,
                              cudaStream_t stream) {
  bool empty = false;
  Shape s{};
  cudaError_t err = CheckShape(B, T, H, D, window, &empty, &s);
  if (err != cudaSuccess || empty) return err;
  const size_t dkdv_smem = DkDvSharedBytes(s.D), dq_smem = DqSharedBytes(s.D);
  if ((err = AllowSharedBytes(attention_dkdv_kernel, dkdv_smem)) != cudaSuccess) return err;
  if ((err = AllowSharedBytes(attention_dq_kernel, dq_smem)) != cudaSuccess) return err;
  if ((err = attention_detail::AttentionRowTerms(scratch, dout, out, s, stream)) != cudaSuccess) return err;
  MS_LAUNCH(attention_dkdv_kernel, s.blocks, kThreads, dkdv_smem, stream, dqkv, dout, qkv, lse, scratch, s.T, s.H, s.D,
            s.window, s.ntiles, s.scale);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  MS_LAUNCH(attention_dq_kernel, s.blocks, kThreads, dq_smem, stream, dqkv, dout, qkv, lse, scratch, s.T, s.H, s.D,
            s.window, s.ntiles, s.scale);
  return cudaGetLastError();
}

namespace attention_detail {
namespace {
template <typename G, typename O>
cudaError_t LaunchRowTerms(float* drow, const G* dout, const O* out, const AttentionShape& s, cudaStream_t stream) {
  const int blocks =
      static_cast<int>((static_cast<int64_t>(s.rows) + kRowTermThreads / 32 - 1) / (kRowTermThreads / 32));
  MS_LAUNCH((attention_row_term_kernel<G, O>), blocks, kRowTermThreads, 0, stream, drow, dout, out, s.T, s.H, s.D,
            s.rows);
  return cudaGetLastError();
}
}  // namespace
cudaError_t AttentionRowTerms(float* drow, const float* dout, const float* out, const AttentionShape& s,
                              cudaStream_t stream) {
  return LaunchRowTerms(drow, dout, out, s, stream);
}
cudaError_t AttentionRowTerms(float* drow, const __nv_bfloat16* dout, const float* out, const AttentionShape& s,
                              cudaStream_t stream) {
  return LaunchRowTerms(drow, dout, out, s, stream);
}
cudaError_t AttentionRowTerms(float* drow, const __nv_bfloat16* dout, const __nv_bfloat16* out, const AttentionShape& s,
                              cudaStream_t stream) {
  return LaunchRowTerms(drow, dout, out, s, stream);
}
}  // namespace attention_detail

}  // namespace ms::kernels
