// defines: attention_forward_tc_kernel, attention_forward_wide_tc_kernel, attention_dkdv_tc_kernel,
// attention_dkdv_split_tc_kernel, attention_dq_tc_kernel, attention_dq_ds_tc_kernel, the fragment layout probe and
// their launchers (AttentionForwardBf16, AttentionBackwardBf16, AttentionDsTileBytes, SetAttentionTcSoftmax,
// SetAttentionTcAsyncLoads, SetAttentionTcWideForward, SetAttentionTcFixedBounds, SetAttentionTcSplitDkDv).
// Causal sliding-window attention on tensor cores (nvcuda::wmma m16n16k16, bf16 operands, fp32
// accumulation), FlashAttention-2 style; contract in kernels/attention.h, oracle: the fp32 kernels of
// attention.cu and ms::ops::ref::AttentionForward/Backward.
//
// Tiles: a block has 4 warps and owns 64 query rows (forward, dQ) or 64 keys (dK/dV) of one (b, h); each
// warp owns 16 of them, and the block loops over 64-wide tiles of the other side, visiting only those that
// meet the band t - window < s <= t of some row of its tile. q, k, v and dout are rounded to bf16 as they
// are copied into shared memory (rows past T are zero; q, k, v and dout may also be read in bf16, widened
// exactly: the GEMMs' outputs kept in bf16, then only the bias add rounds; the two tiles of a step loaded together,
// each thread's loads issued in batches; with bf16 rows 16-byte aligned, the kAsync instances double-buffer the
// loop's tiles with asynchronous copies instead: see "kAsync" below); the warp's own 16 x D operand rows stay in
// wmma fragments for the whole loop. Per tile a warp forms its 16 x 64 scores (and dP) with mma_sync. With the
// register-resident softmax (kRegs: where the fragment layout probe holds, AttentionTcSoftmax) they stay in the
// accumulator fragments: each lane masks (not at all on a tile inside every row's band: InsideBand), scales and
// exponentiates its own elements (AccRow, AccCol), the lanes of a row reduce its max and sum by shuffles, the
// probabilities (or dS) are rounded to bf16 straight into matrix_a fragments — which hold the same elements in the same
// lanes and registers as the accumulators, as in FlashAttention-2 — and mma_sync'd against the V, dout, K or Q tile,
// and the forward's output accumulates in fragments, rescaled by exp(m_old - m_new) as the row max grows. Otherwise
// they go through a per-warp fp32 area where two lanes per row apply the mask and the softmax terms, P (or dS) is
// rounded to bf16 into a per-warp area and loaded back as matrix_a fragments, and the forward's P V product goes
// through the fp32 area too, added by the lanes to their running outputs (two lanes per row, d = 2 j + lane % 2).
// Backward (the dK/dV and dQ kernels, as in attention.cu; no atomics): dK, dV and dQ accumulate in fragments. Either
// the scores and dP are formed in both (7 products instead of FlashAttention-2's 5), or, with a dS buffer (ds_tiles),
// the dK/dV kernel also stores the bf16 dS^T it forms, tile by tile, and attention_dq_ds_tc_kernel makes dQ = dS K from
// it (5 products, still deterministic). Outputs are staged through the fp32 area and written row by row (coalesced).
//
// Rounding: every product has bf16 operands (q, k, v, dout, P, dS) and an fp32 sum; scores, softmax
// statistics (max, sum, lse), dS before rounding and every output stay fp32. Unlike the fp32 kernels, masked
// pairs are multiplied by an exact 0 inside a 16 x 16 product, so a NaN or Inf in a key, value, query or
// dout row of the same tile does reach the rows that cannot see it (0 * NaN); finite inputs are unaffected.
//
// Layout of dynamic shared memory (bf16 rows padded by 8 elements, fp32 rows by 4: every fragment pointer
// stays 32-byte aligned and ldm a multiple of 16 bytes):
//   forward: K [64][D+8], V [64][D+8] (bf16), then per warp P [16][72] bf16 and S/PV [16][kMaxD|64 + 4] fp32;
//   dQ:      K, V as above, per warp dS [16][72] bf16 and S|dP [16][132] fp32;
//   dK/dV:   Q, dout as above, per warp P and dS [16][72] bf16, lse [64], drow [64] fp32, per warp S|dP [16][132] fp32.
//   The kRegs instances have no P or dS areas (PAreaElems); their fp32 areas stage the outputs at the end.
//   kAsync adds a second K, V (Q, dout, lse, drow) after all that — or, in the backward kernels with the register
//   softmax where it fits (D <= 64), inside the per-warp fp32 areas, used then only after the loop — and the qkv bias
//   staged for the in-place add (2 x kMaxD fp32).
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_common.cuh"
#include "ldmatrix.h"

namespace ms::kernels {

namespace wmma = nvcuda::wmma;
using attention_detail::AllowSharedBytes;
using attention_detail::HeadRowsOf;
using attention_detail::HeadRowsT;
using attention_detail::Meets;
using attention_detail::Sees;
using attention_detail::SeesAll;

namespace {
constexpr int kRows = 64;                  // rows (or keys) a block owns, and the width of the tiles it loops over
constexpr int kWarps = 4;                  // warps per block
constexpr int kThreads = kWarps * 32;      // threads per block
constexpr int kF = 16;                     // the wmma shape m = n = k
constexpr int kWarpRows = kRows / kWarps;  // = kF: one fragment row per warp
constexpr int kTileFrags = kRows / kF;     // fragments across a tile
constexpr int kPadH = 8;                   // bf16 row padding (16 bytes)
constexpr int kPadF = 4;                   // fp32 row padding (16 bytes)
constexpr int kLdP = kRows + kPadH;        // P / dS areas: [16][72] bf16
constexpr int kLdSdP = 2 * kRows + kPadF;  // backward fp32 area: S in columns 0..63, dP in 64..127
static_assert(kWarpRows == kF, "each warp owns one fragment row");
// The softmax runs in base 2, as FlashAttention does: exp(scale s - m) = exp2(scale log2(e) s - m log2(e)), so each
// probability is one multiply-add and exp2f (ex2 with its range handling) where expf adds its own reduction to base 2;
// the row maxima are kept in base-2 units and the lse written (and read back) in natural units, m ln 2 + ln l. The
// forward and dQ kernels, and the dK/dV kernel with the register softmax (the lse of a column times log2(e) as it is
// used); the dK/dV kernel with the softmax through shared memory keeps expf: at D = 128 it holds 254 registers, and
// the base-2 form (its lse rows staged times log2(e)) made ptxas spill there (sm_90, with kAsync: 32 bytes).
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

using FragA = wmma::fragment<wmma::matrix_a, kF, kF, kF, __nv_bfloat16, wmma::row_major>;
using FragBRow = wmma::fragment<wmma::matrix_b, kF, kF, kF, __nv_bfloat16, wmma::row_major>;
using FragBCol = wmma::fragment<wmma::matrix_b, kF, kF, kF, __nv_bfloat16, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, kF, kF, kF, float>;
// dS as the left operand of the stored-dS dQ kernel, read from the dS^T tile the dK/dV kernel stored (key rows).
using FragACol = wmma::fragment<wmma::matrix_a, kF, kF, kF, __nv_bfloat16, wmma::col_major>;

// Every bf16 operand fragment a kernel reads from shared memory (16 x 16 at p, leading dimension ld: rows 16-byte
// aligned) is loaded by LoadFrag: on the device one ldmatrix.x4 per fragment (kernels/ldmatrix.h: wmma's own
// load_matrix_sync makes 4 generic 32-bit loads of it, plus 4 MOVM transposes for a row-major B operand), in the
// emulator wmma::load_matrix_sync, whose fragment layout is the emulator's. FragLayoutsHold checks on the device,
// once per process before any kernel runs, that ldmatrix's fragments are wmma's, element for element, for all four
// kinds; where they are not the tensor-core attention refuses to run (cudaErrorNotSupported).
#if MS_SIM_EMULATION
// The emulator checks what ldmatrix asks of the rows (shared memory, 16-byte aligned) and loads with wmma, naming the
// kernel's line in its reports.
#define MS_FRAG_SITE , std::source_location loc = MS_SIM_CALLER
#else
#define MS_FRAG_SITE
#endif
template <ldsm::FragKind kKind, typename Frag>
__device__ __forceinline__ void LoadFragKind(Frag& f, const __nv_bfloat16* p, int ld MS_FRAG_SITE) {
#if MS_SIM_EMULATION
  ::ms::sim::LdmatrixRows(::ms::sim::CallerSite(loc), p, static_cast<unsigned>(ld));
  wmma::load_matrix_sync(f, p, static_cast<unsigned>(ld), loc);
#else
  static_assert(sizeof(f.x) == 4 * sizeof(uint32_t), "a 16 x 16 bf16 fragment is four registers");
  const int lane = static_cast<int>(threadIdx.x % 32);
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p)) +
                        static_cast<uint32_t>(ldsm::LdsmLaneRow(kKind, lane) * ld + ldsm::LdsmLaneCol(kKind, lane)) *
                            static_cast<uint32_t>(sizeof(__nv_bfloat16));
  auto* const r = reinterpret_cast<uint32_t*>(&f.x[0]);  // as wmma's own loads view a fragment's elements
  if constexpr (ldsm::LdsmTransposes(kKind)) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
#endif
}
#if MS_SIM_EMULATION
#define MS_FRAG_LOAD(kind) LoadFragKind<ldsm::FragKind::kind>(f, p, ld, loc)
#else
#define MS_FRAG_LOAD(kind) LoadFragKind<ldsm::FragKind::kind>(f, p, ld)
#endif
__device__ __forceinline__ void LoadFrag(FragA& f, const __nv_bfloat16* p, int ld MS_FRAG_SITE) {
  MS_FRAG_LOAD(kARow);
}
__device__ __forceinline__ void LoadFrag(FragACol& f, const __nv_bfloat16* p, int ld MS_FRAG_SITE) {
  MS_FRAG_LOAD(kACol);
}
__device__ __forceinline__ void LoadFrag(FragBCol& f, const __nv_bfloat16* p, int ld MS_FRAG_SITE) {
  MS_FRAG_LOAD(kBCol);
}
__device__ __forceinline__ void LoadFrag(FragBRow& f, const __nv_bfloat16* p, int ld MS_FRAG_SITE) {
  MS_FRAG_LOAD(kBRow);
}
#undef MS_FRAG_LOAD
// LoadFrag, or (kLdsm false) wmma::load_matrix_sync on the device: the split dK/dV kernel's choice on sm_80, where its
// fragments loaded by ldmatrix made ptxas spill at the kernel's 128-register bound (8 warps, 2 blocks per SM).
template <bool kLdsm, typename Frag>
__device__ __forceinline__ void LoadFragIf(Frag& f, const __nv_bfloat16* p, int ld MS_FRAG_SITE) {
#if MS_SIM_EMULATION
  LoadFrag(f, p, ld, loc);
#else
  if constexpr (kLdsm) {
    LoadFrag(f, p, ld);
  } else {
    wmma::load_matrix_sync(f, p, static_cast<unsigned>(ld));
  }
#endif
}
#undef MS_FRAG_SITE

// Where the elements of an fp32 accumulator fragment lie, for the register-resident softmax (kRegs). CUDA leaves the
// lane -> element mapping of a wmma fragment unspecified. On sm_80 and sm_90 an m16n16k16 fp32 accumulator is the C
// operand of two mma.sync m16n8k16, so lane 4 g + c holds x[i] = element (g + 8 ((i / 2) % 2), 8 (i / 4) + 2 c + i %
// 2): two rows (slots) per lane, each row spread over 4 consecutive lanes; the emulator's is (lane / 2, 8 (lane % 2) +
// i) (kernels/sim/simt.h): one row per lane, over 2 lanes. The kRegs kernels run only where the probe kernel below has
// found this mapping on the device, and the same one in the bf16 matrix_a fragments (once per process:
// FragLayoutsHold).
constexpr int kAccElems = 8;  // FragC::num_elements
#if MS_SIM_EMULATION
constexpr int kAccSlots = 1;     // rows per lane
constexpr int kAccRowLanes = 2;  // consecutive lanes that share a row
__host__ __device__ constexpr int AccRow(int lane, int /*i*/) {
  return lane / 2;
}
__host__ __device__ constexpr int AccCol(int lane, int i) {
  return 8 * (lane % 2) + i;
}
__host__ __device__ constexpr int AccSlot(int /*i*/) {
  return 0;
}
#else
constexpr int kAccSlots = 2;
constexpr int kAccRowLanes = 4;
__host__ __device__ constexpr int AccRow(int lane, int i) {
  return lane / 4 + 8 * ((i / 2) % 2);
}
__host__ __device__ constexpr int AccCol(int lane, int i) {
  return 8 * (i / 4) + 2 * (lane % 4) + i % 2;
}
__host__ __device__ constexpr int AccSlot(int i) {
  return (i / 2) % 2;
}
#endif
// The row of the lane's slot s (x[2 s] lies in it on both mappings).
__host__ __device__ constexpr int AccSlotRow(int lane, int s) {
  return AccRow(lane, 2 * s);
}
// The max and the sum of v over the lanes that share the lane's row (each lane passes its part of one slot).
__device__ __forceinline__ float AccRowMax(float v) {
  MS_UNROLL
  for (int m = 1; m < kAccRowLanes; m *= 2) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, m));
  return v;
}
__device__ __forceinline__ float AccRowSum(float v) {
  MS_UNROLL
  for (int m = 1; m < kAccRowLanes; m *= 2) v += __shfl_xor_sync(kFullMask, v, m);
  return v;
}

__host__ __device__ constexpr int LdH(int D) {
  return D + kPadH;
}
// Forward fp32 area: scores (64 wide) and the P V product (D wide).
__host__ __device__ constexpr int LdForward(int max_d) {
  return (max_d > kRows ? max_d : kRows) + kPadF;
}

// The bias of one head's q, k and v columns in qkv_bias (3, H, D), laid out as a row of qkv; all null without one.
struct HeadBias {
  const float *q, *k, *v;
};
__device__ __forceinline__ HeadBias HeadBiasOf(const float* qkv_bias, int h, int H, int D) {
  if (qkv_bias == nullptr) return {nullptr, nullptr, nullptr};
  const float* q = qkv_bias + static_cast<long>(h) * D;
  return {q, q + static_cast<long>(H) * D, q + 2L * H * D};
}

// dst[0..3] = bf16(v + b) (add false: v alone, so a -0 stays -0), as one 8-byte store (dst 8-byte aligned: the
// tiles' ld and d are multiples of 4 elements); element 0 in the low half, as in memory.
__device__ __forceinline__ void StoreQuadBf16(__nv_bfloat16* dst, float4 v, bool add, float4 b) {
  if (add) v = make_float4(v.x + b.x, v.y + b.y, v.z + b.z, v.w + b.w);
  ms::kernels::StoreQuadBf16(dst, v);
}
// The same with the bias quad loaded here: bias[d..d + 3] (16-byte aligned), or nothing added where bias is null.
__device__ __forceinline__ void StoreQuadBf16(__nv_bfloat16* dst, float4 v, const float* bias, int d) {
  if (bias) {
    StoreQuadBf16(dst, v, true, __ldca(reinterpret_cast<const float4*>(bias + d)));
  } else {
    StoreQuadBf16(dst, v, false, v);
  }
}

// i / n for 0 <= i < 2^16 and 2 <= n <= 2^16 as a multiply-high by m = ceil(2^32 / n) (m < 2^32 since n >= 2):
// i m / 2^32 = i / n + i e / (n 2^32) with m n = 2^32 + e, 0 <= e < n, and i e < 2^32 keeps that second term below
// 1 / n, the least gap from any i / n to the next integer above it, so the floor is i / n exactly. The tile loaders
// map each group index of their loop (quads of 4 elements, 16-byte chunks of 8) to its row by dividing by the groups
// per row, D / 4 or D / 8, which is not a compile-time constant (D is a kernel argument): as a division that is a
// routine of a dozen-odd instructions per element group (the forward's async loads ran 16 per key tile and thread at
// D = 64, 32 at D = 128); this is one IMAD.HI, with one division per call for m. On the GPU that division is inline PTX
// (asm volatile), so it stays at the call: hoisted out of the kernels' tile loops, as the compiler does with a plain
// one, m held one more register across them and the dK/dV kernel at D = 128 (shared-memory softmax, kAsync; 254
// registers) spilled. (Making D a compile-time constant where D == kMaxD instead duplicated the loaders' code: the dQ
// kernel at D = 64 went from 3 blocks per SM to 2, and that dK/dV kernel spilled too.)
struct GroupDiv {
  unsigned m;
  __device__ __forceinline__ explicit GroupDiv(int n) {
#if MS_SIM_EMULATION
    m = 0xFFFFFFFFu / static_cast<unsigned>(n);
#else
    asm volatile("div.u32 %0, %1, %2;" : "=r"(m) : "r"(0xFFFFFFFFu), "r"(static_cast<unsigned>(n)));
#endif
    m += 1u;
  }
  __device__ __forceinline__ int operator()(int i) const {
    return static_cast<int>(__umulhi(static_cast<unsigned>(i), m));
  }
};

// bias[d..d + 3] (16-byte aligned; a global load by name, __ldca: see StageBias), or zeros where bias is null.
__device__ __forceinline__ float4 BiasQuad(const float* bias, int d) {
  return bias ? __ldca(reinterpret_cast<const float4*>(bias + d)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// dst[r][d] = bf16(src[(t0 + r) * stride + d] + bias[d]) for r < 64, d < D (bias null: + 0 left out); rows
// t0 + r >= T are zero. src holds fp32, or bf16 (S = __nv_bfloat16: the qkv GEMM's output kept in bf16, widened
// exactly: without a bias the tile holds its bits). The bias add is the fp32 add the separate bias kernel
// (AddRowBias) would have made, so the tile holds the same bits as over src + bias. All threads of the block take
// part; the caller synchronizes. D is a multiple of 16 and stride of 4 (elements), so when src is aligned to 4
// elements (and bias to 16 bytes) every row is: then each thread loads 4 elements at once (one 16- or 8-byte
// load), else one at a time. kT: the block's threads (all of which call it).
template <typename S, int kT = kThreads>
__device__ __forceinline__ void LoadTileBf16(__nv_bfloat16* dst, int ld, const S* src, const float* bias, long stride,
                                             int t0, int T, int D) {
  if (reinterpret_cast<uintptr_t>(src) % (4 * sizeof(S)) == 0 &&
      reinterpret_cast<uintptr_t>(bias) % 16 == 0) {  // uniform across the block
    const int quads = D / 4;
    const GroupDiv div(quads);
    for (int i = threadIdx.x; i < kRows * quads; i += kT) {
      const int r = div(i), d = 4 * (i - r * quads);
      const int t = t0 + r;
      float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (t < T) v = LoadQuad(src + static_cast<long>(t) * stride + d);
      StoreQuadBf16(dst + r * ld + d, v, t < T ? bias : nullptr, d);
    }
    return;
  }
  const GroupDiv div(D);
  for (int i = threadIdx.x; i < kRows * D; i += kT) {
    const int r = div(i), d = i - r * D;
    const int t = t0 + r;
    float v = 0.0f;
    if (t < T) {
      v = Widen(src[static_cast<long>(t) * stride + d]);
      if (bias) v += __ldca(bias + d);
    }
    dst[r * ld + d] = __float2bfloat16(v);
  }
}

// One operand of a pair of tiles LoadTilesBf16 loads: rows t0.. of src (fp32 or bf16), stride elements apart, plus
// bias (or null), into dst.
template <typename S>
struct TileSrc {
  __nv_bfloat16* dst;
  const S* src;
  const float* bias;
  long stride;
};

// Two tiles of the same rows t0 .. t0 + 63 (K and V, or Q and dout) as LoadTileBf16 each, the same bits, with each
// thread's global loads issued in batches before any conversion or store (2 x kBatch loads in flight per thread,
// rather than one load, its conversion and its store at a time, serialized by the loop's possible aliasing of
// global and shared memory). Where kT is a multiple of D / 4 (D = 16, 32, 64, 128) a thread's quads all lie in
// the same columns, so its bias quads are loaded once per batch, with the batch's loads, not once per quad after
// them (each waited for in turn: the compiler cannot move them above the shared-memory stores). Falls back to
// LoadTileBf16 where a source is not aligned to 4 elements. kT: the block's threads.
template <int kMaxD, typename S, int kT = kThreads>
__device__ __forceinline__ void LoadTilesBf16(const TileSrc<S>& a, const TileSrc<S>& b, int ld, int t0, int T, int D) {
  auto aligned = [](const TileSrc<S>& x) {
    return reinterpret_cast<uintptr_t>(x.src) % (4 * sizeof(S)) == 0 && reinterpret_cast<uintptr_t>(x.bias) % 16 == 0;
  };
  if (!aligned(a) || !aligned(b)) {  // uniform across the block
    LoadTileBf16<S, kT>(a.dst, ld, a.src, a.bias, a.stride, t0, T, D);
    LoadTileBf16<S, kT>(b.dst, ld, b.src, b.bias, b.stride, t0, T, D);
    return;
  }
  constexpr int kPer = kRows * (kMaxD / 4) / kT;  // quads per thread and tile at D = kMaxD: 8 or 16 (4 warps)
  constexpr int kBatch = 4;
  static_assert(kPer % kBatch == 0, "whole batches");
  const int quads = D / 4, n = kRows * quads;
  const GroupDiv div(quads);
  const bool same_cols = div(kT) * quads == kT;  // kT % quads == 0: uniform across the block
  const int d_own = 4 * (static_cast<int>(threadIdx.x) - div(threadIdx.x) * quads);
  MS_UNROLL
  for (int b0 = 0; b0 < kPer; b0 += kBatch) {
    if (static_cast<int>(threadIdx.x) + b0 * kT >= n) break;  // D < kMaxD: fewer quads
    float4 va[kBatch], vb[kBatch];
    MS_UNROLL
    for (int j = 0; j < kBatch; ++j) {
      const int i = static_cast<int>(threadIdx.x) + (b0 + j) * kT;
      const int r = div(i), d = 4 * (i - r * quads), t = t0 + r;
      const bool in = i < n && t < T;
      va[j] = in ? LoadQuad(a.src + static_cast<long>(t) * a.stride + d) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      vb[j] = in ? LoadQuad(b.src + static_cast<long>(t) * b.stride + d) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    const float4 ba = BiasQuad(same_cols ? a.bias : nullptr, d_own), bb = BiasQuad(same_cols ? b.bias : nullptr, d_own);
    MS_UNROLL
    for (int j = 0; j < kBatch; ++j) {
      const int i = static_cast<int>(threadIdx.x) + (b0 + j) * kT;
      if (i >= n) break;
      const int r = div(i), d = 4 * (i - r * quads);
      const bool in = t0 + r < T;
      if (same_cols) {
        StoreQuadBf16(a.dst + r * ld + d, va[j], in && a.bias, ba);
        StoreQuadBf16(b.dst + r * ld + d, vb[j], in && b.bias, bb);
      } else {
        StoreQuadBf16(a.dst + r * ld + d, va[j], in ? a.bias : nullptr, d);
        StoreQuadBf16(b.dst + r * ld + d, vb[j], in ? b.bias : nullptr, d);
      }
    }
  }
}

// ---- kAsync: the loops' tiles copied asynchronously (cp.async), double-buffered ----
// Where the loop's operands are bf16 in global memory (runtime.activations: bf16) and 16-byte aligned, the kernels'
// kAsync instances copy the next tile's rows into a second buffer with __pipeline_memcpy_async while the block
// computes on this one (one commit group per tile: the copies of tile i + 1 are issued right after the barrier that
// frees their buffer, and waited for — __pipeline_wait_prior(1) — at the next step), instead of loading each tile
// between two barriers with nothing to overlap the loads' latency. The bits are those of LoadTilesBf16: the copies
// move the bf16 rows unchanged and the bias (kept in shared memory) is added in place after they land, by the thread
// that copied them, with the same fp32 add and rounding.

// Issues this thread's asynchronous copies of rows t0 .. t0 + 63 of src (bf16, stride elements apart, D columns)
// into dst (leading dimension ld): 16 bytes (8 elements) a copy, copy i = threadIdx.x + j kThreads; rows past T are
// zeroed by plain stores. src 16-byte aligned (the launcher checks it), D a multiple of 16 and stride of 8 keep every
// copy aligned. kT: the block's threads.
template <int kT = kThreads>
__device__ __forceinline__ void IssueTileAsync(__nv_bfloat16* dst, int ld, const __nv_bfloat16* src, long stride,
                                               int t0, int T, int D) {
  const int chunks = D / 8, n = kRows * chunks;
  const GroupDiv div(chunks);
  for (int i = threadIdx.x; i < n; i += kT) {
    const int r = div(i), c = 8 * (i - r * chunks);
    __nv_bfloat16* const d = dst + r * ld + c;
    if (t0 + r < T) {
      __pipeline_memcpy_async(d, src + static_cast<long>(t0 + r) * stride + c, 16);
    } else {
      *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// Once this thread's copies of the tile (rows t0 ..) have landed: adds bias (fp32 in shared memory, D values; null:
// nothing to add) to the elements of rows t0 + r < T that IssueTileAsync gave it, in place — bf16(x + b), the add and
// rounding of LoadTileBf16, so the tile holds the same bits. kT: the block's threads (IssueTileAsync's).
template <int kT = kThreads>
__device__ __forceinline__ void AddBiasOwnChunks(__nv_bfloat16* dst, int ld, const float* bias, int t0, int T, int D) {
  if (bias == nullptr) return;  // uniform
  const int chunks = D / 8, n = kRows * chunks;
  const GroupDiv div(chunks);
  for (int i = threadIdx.x; i < n; i += kT) {
    const int r = div(i), c = 8 * (i - r * chunks);
    if (t0 + r >= T) continue;
    __nv_bfloat16* const d = dst + r * ld + c;
    const float4 lo = LoadQuad(d), hi = LoadQuad(d + 4);
    StoreQuadBf16(d, lo, true, *reinterpret_cast<const float4*>(bias + c));
    StoreQuadBf16(d + 4, hi, true, *reinterpret_cast<const float4*>(bias + c + 4));
  }
}

// bias[0 .. D) into dst (shared memory), or nothing where bias is null. All threads take part; a later barrier
// publishes it. kT: the block's threads. The loads are global ones by name (__ldca, ld.global.ca): as plain reads of
// bias they compiled to generic loads (LD.E; ctest kernels_sass), and by __ldg (the read-only path) ptxas settled the
// stored-dS dQ kernel at D = 64 on sm_90 at 64 registers with 40 bytes of spill; by __ldca 72 and none (its shared
// memory holds it to 6 blocks per SM on an H100 either way).
template <int kT = kThreads>
__device__ __forceinline__ void StageBias(float* dst, const float* bias, int D) {
  if (bias == nullptr) return;
  for (int i = threadIdx.x; i < D; i += kT) dst[i] = __ldca(bias + i);
}

// The dK/dV kernels' query tile at row i0: this thread's asynchronous copies of its Q and dout rows (IssueTileAsync,
// into Qd and Gd) and of its lse and drow values (lse and drow: the head's rows; into Ld and Rd, 64 floats each), rows
// past T zeroed. kT: the block's threads. (attention_dkdv_tc_kernel keeps its own copy of these lines: through this
// function ptxas gave its measured instances other registers — D = 64 with the shared-memory softmax 218 -> 226 on
// sm_80, D = 128 232 -> 254 —, a change no GPU has timed.)
template <int kT = kThreads>
__device__ __forceinline__ void IssueQueryTileAsync(__nv_bfloat16* Qd, __nv_bfloat16* Gd, float* Ld, float* Rd, int ld,
                                                    const __nv_bfloat16* q, const __nv_bfloat16* g, long row, long orow,
                                                    const float* lse, const float* drow, int i0, int T, int D) {
  IssueTileAsync<kT>(Qd, ld, q, row, i0, T, D);
  IssueTileAsync<kT>(Gd, ld, g, orow, i0, T, D);
  for (int i = threadIdx.x; i < kRows; i += kT) {
    if (i0 + i < T) {
      __pipeline_memcpy_async(Ld + i, lse + i0 + i, sizeof(float));
      __pipeline_memcpy_async(Rd + i, drow + i0 + i, sizeof(float));
    } else {
      Ld[i] = 0.0f;
      Rd[i] = 0.0f;
    }
  }
}

// The K and V tile buffers of the forward and dQ loops: one pair, or (kAsync) two used in turn; bk and bv the k and v
// bias staged in shared memory (kAsync with a bias; else null).
// (Selected by a condition, not an index: an array indexed at run time would live in local memory.)
struct KvBuffers {
  __nv_bfloat16 *k0, *k1, *v0, *v1;
  const float* bk;
  const float* bv;
  __device__ __forceinline__ __nv_bfloat16* K(int b) const { return b ? k1 : k0; }
  __device__ __forceinline__ __nv_bfloat16* V(int b) const { return b ? v1 : v0; }
};

// The first key tile the query tile [q0, ..) sees.
__device__ __forceinline__ int FirstKeyTile(int q0, int window) {
  return (window > 0 ? max(0, q0 - window + 1) : 0) / kRows;
}

// The register softmax's unmasked tiles: the warp's 16 rows [ra, rb] all exist (rb = ra + 15, not cut by T) and each
// sees every key of the 64-key tile at k0 (all of which then exist too). Warp-uniform.
__device__ __forceinline__ bool InsideBand(int ra, int rb, int k0, int window) {
  return rb == ra + kWarpRows - 1 && SeesAll(ra, rb, k0, k0 + kRows - 1, window);
}

// kAsync: issues the copies of the first key tile (FirstKeyTile) into buffer 0 and commits them; the caller calls it
// before staging its own rows in buffer 1.
__device__ __forceinline__ void StartKeyTilesAsync(const __nv_bfloat16* k, const __nv_bfloat16* v, long row, int T,
                                                   int D, int window, int q0, const KvBuffers& kv, int ld) {
  const int k0 = FirstKeyTile(q0, window) * kRows;
  IssueTileAsync(kv.k0, ld, k, row, k0, T, D);
  IssueTileAsync(kv.v0, ld, v, row, k0, T, D);
  __pipeline_commit();
}

// The forward and dQ kernels' K and V buffers: Ks and Vs, and with kAsync the second pair at K1 (K, then V) and the
// k and v bias staged at Bs (2 x kMaxD floats; none without a bias) — kAsync then also issues the first key tile's
// copies (StartKeyTilesAsync). All threads of the block call it.
template <int kMaxD, bool kAsync, typename S>
__device__ __forceinline__ KvBuffers KeyTileBuffers(__nv_bfloat16* Ks, __nv_bfloat16* Vs, __nv_bfloat16* K1, float* Bs,
                                                    const HeadBias& hb, const S* k, const S* v, long row, int T, int D,
                                                    int window, int q0, int ld) {
  KvBuffers kv{Ks, Ks, Vs, Vs, nullptr, nullptr};
  if constexpr (kAsync) {
    kv.k1 = K1;
    kv.v1 = K1 + kRows * ld;
    if (hb.k) {
      StageBias(Bs, hb.k, D);
      StageBias(Bs + kMaxD, hb.v, D);
      kv.bk = Bs;
      kv.bv = Bs + kMaxD;
    }
    StartKeyTilesAsync(k, v, row, T, D, window, q0, kv, ld);
  }
  return kv;
}

// The loop of the forward and dQ kernels over the key tiles their query tile [q0, q1) sees; each warp whose rows
// [ra, rb] meet a tile runs body(k0, K, V) (warp-uniform) on its K and V rows in shared memory. Without kAsync all
// threads load the tile into buffer 0 between two barriers (the previous tile, or the Q staging, no longer read);
// with it (StartKeyTilesAsync has issued the first tile) each step issues the next tile's copies into the other
// buffer right after the barrier that frees it, waits for this tile's, adds the bias and meets the others at a
// barrier. All threads of the block call it.
template <int kMaxD, typename S, bool kAsync, typename Body>
__device__ __forceinline__ void ForKeyTiles(const S* k, const S* v, const HeadBias& hb, long row, int T, int D,
                                            int window, int q0, int q1, int ra, int rb, const KvBuffers& kv, int ld,
                                            Body&& body) {
  const int kt_lo = FirstKeyTile(q0, window), kt_hi = (q1 - 1) / kRows;
  for (int kt = kt_lo; kt <= kt_hi; ++kt) {
    const int k0 = kt * kRows;
    int cur = 0;
    __syncthreads();
    if constexpr (kAsync) {
      static_assert(std::is_same_v<S, __nv_bfloat16>, "asynchronous copies move bf16 rows");
      cur = (kt - kt_lo) & 1;
      if (kt < kt_hi) {
        IssueTileAsync(kv.K(cur ^ 1), ld, k, row, k0 + kRows, T, D);
        IssueTileAsync(kv.V(cur ^ 1), ld, v, row, k0 + kRows, T, D);
      }
      __pipeline_commit();
      __pipeline_wait_prior(1);  // this thread's copies of tile kt have landed
      AddBiasOwnChunks(kv.K(cur), ld, kv.bk, k0, T, D);
      AddBiasOwnChunks(kv.V(cur), ld, kv.bv, k0, T, D);
    } else {
      LoadTilesBf16<kMaxD, S>({kv.k0, k, hb.k, row}, {kv.v0, v, hb.v, row}, ld, k0, T, D);
    }
    __syncthreads();
    if (rb >= ra && Meets(ra, rb, k0, k0 + kRows - 1, window)) body(k0, kv.K(cur), kv.V(cur));
  }
}

// acc[j] = A_w (16 x D) times the transpose of the tile's rows (n0 + j) * 16 .. + 15 (bf16 at tile, leading
// dimension ld), for j < kN: acc[j][i][c] = sum_d A[i][d] tile[(n0 + j) * 16 + c][d]. A_w is the warp's fragments a
// (kAShared false), or its rows in shared memory at a_shared (bf16, leading dimension ld), read per fragment.
template <int kMaxD, bool kAShared, int kN, bool kLdsm = true>
__device__ __forceinline__ void RowsTimesTileTFrags(FragC (&acc)[kN], int n0, const FragA* a,
                                                    const __nv_bfloat16* a_shared, const __nv_bfloat16* tile, int ld,
                                                    int D) {
  MS_UNROLL
  for (int j = 0; j < kN; ++j) wmma::fill_fragment(acc[j], 0.0f);
  MS_UNROLL
  for (int f = 0; f < kMaxD / kF; ++f) {
    if (f * kF >= D) break;
    FragA af;
    if constexpr (kAShared) {
      LoadFragIf<kLdsm>(af, a_shared + f * kF, ld);
    } else {
      af = a[f];
    }
    MS_UNROLL
    for (int j = 0; j < kN; ++j) {
      FragBCol b;
      LoadFragIf<kLdsm>(b, tile + (n0 + j) * kF * ld + f * kF, ld);
      wmma::mma_sync(acc[j], af, b, acc[j]);
    }
  }
}

// C (16 x 64, fp32 at c with leading dimension ldc) = A_w (16 x D) times the transpose of the tile's rows
// (64 x D bf16 at tile, leading dimension ld): C[i][j] = sum_d A[i][d] tile[j][d] (RowsTimesTileTFrags, stored).
template <int kMaxD, bool kAShared>
__device__ __forceinline__ void RowsTimesTileT(float* c, int ldc, const FragA* a, const __nv_bfloat16* a_shared,
                                               const __nv_bfloat16* tile, int ld, int D) {
  FragC acc[kTileFrags];
  RowsTimesTileTFrags<kMaxD, kAShared>(acc, 0, a, a_shared, tile, ld, D);
  MS_UNROLL
  for (int n = 0; n < kTileFrags; ++n) wmma::store_matrix_sync(c + n * kF, acc[n], ldc, wmma::mem_row_major);
}

// acc[n] (+)= P (16 x 64 bf16 at p, leading dimension kLdP) times the tile (64 x D bf16, leading dimension ld),
// for the D / 16 column fragments n.
template <int kMaxD>
__device__ __forceinline__ void PTimesTile(FragC (&acc)[kMaxD / kF], const __nv_bfloat16* p, const __nv_bfloat16* tile,
                                           int ld, int D) {
  FragA a[kTileFrags];
  MS_UNROLL
  for (int k = 0; k < kTileFrags; ++k) LoadFrag(a[k], p + k * kF, kLdP);
  MS_UNROLL
  for (int n = 0; n < kMaxD / kF; ++n) {
    if (n * kF >= D) break;
    MS_UNROLL
    for (int k = 0; k < kTileFrags; ++k) {
      FragBRow b;
      LoadFrag(b, tile + k * kF * ld + n * kF, ld);
      wmma::mma_sync(acc[n], a[k], b, acc[n]);
    }
  }
}

// acc[n] += a (16 x 16, columns kb * 16 .. + 15 of a 16 x 64 left operand) times rows kb * 16 .. + 15 of the tile
// (64 x D bf16, leading dimension ld), for the D / 16 column fragments n: the register-resident softmax's form of
// PTimesTile, whose left operand it builds in matrix_a fragments (FragLayoutsHold) rather than in shared memory.
// Called for kb = 0, 1, 2, 3 in turn it makes PTimesTile's products in PTimesTile's order: the same sums.
template <int kMaxD, bool kLdsm = true, typename A>
__device__ __forceinline__ void AddATimesTileRows(FragC (&acc)[kMaxD / kF], const A& a, const __nv_bfloat16* tile,
                                                  int kb, int ld, int D) {
  MS_UNROLL
  for (int n = 0; n < kMaxD / kF; ++n) {
    if (n * kF >= D) break;
    FragBRow b;
    LoadFragIf<kLdsm>(b, tile + kb * kF * ld + n * kF, ld);
    wmma::mma_sync(acc[n], a, b, acc[n]);
  }
}

// Writes the warp's 16 x D fp32 rows (at c, leading dimension ldc) to dst row r at dst + (t0 + r) * stride unless
// dst is null, rows t0 + r < T only, and their bf16 roundings (nearest even, as CastFloatToBf16) to dst16 at the
// same element offsets unless dst16 is null; the warp's lanes run along d (coalesced).
__device__ __forceinline__ void StoreRows(float* dst, __nv_bfloat16* dst16, long stride, const float* c, int ldc,
                                          int t0, int T, int D) {
  const int lane = threadIdx.x % 32;
  const GroupDiv div(D);
  for (int i = lane; i < kWarpRows * D; i += 32) {
    const int r = div(i), d = i - r * D;
    if (t0 + r >= T) continue;
    const long at = static_cast<long>(t0 + r) * stride + d;
    const float v = c[r * ldc + d];
    if (dst) dst[at] = v;
    if (dst16) dst16[at] = __float2bfloat16_rn(v);
  }
}

// The qkv bias gradient's first stage: part[d] = the sum of the warp's rows r (t0 + r < T) at c, column d < D, in
// row order (WRITES): the column sums of one 16-row chunk, which BiasGrad then adds up over the chunks.
__device__ __forceinline__ void StoreColumnSums(float* part, const float* c, int ldc, int t0, int T, int D) {
  const int rows = min(kWarpRows, T - t0);
  for (int d = threadIdx.x % 32; d < D; d += 32) {
    float sum = 0.0f;
    for (int r = 0; r < rows; ++r) sum += c[r * ldc + d];
    part[d] = sum;
  }
}

// Stores the fragments acc (16 x D) to the warp's fp32 area c, then writes its rows as StoreRows and, unless part
// is null, their column sums as StoreColumnSums.
template <int kMaxD>
__device__ __forceinline__ void StoreFragRows(float* dst, __nv_bfloat16* dst16, float* part, long stride, float* c,
                                              int ldc, const FragC (&acc)[kMaxD / kF], int t0, int T, int D) {
  MS_UNROLL
  for (int n = 0; n < kMaxD / kF; ++n) {
    if (n * kF < D) wmma::store_matrix_sync(c + n * kF, acc[n], ldc, wmma::mem_row_major);
  }
  __syncwarp();
  StoreRows(dst, dst16, stride, c, ldc, t0, T, D);
  if (part) StoreColumnSums(part, c, ldc, t0, T, D);
  __syncwarp();
}

// Where the bias-gradient chunk of the warp whose rows start at t0 (a multiple of 16) of batch b writes the
// columns of part (0 q, 1 k, 2 v) of head h: row b * ceil(T / 16) + t0 / 16 of the (chunks, 3 H D) partial sums;
// null without them.
__device__ __forceinline__ float* BiasPart(float* dbias_part, int b, int t0, int T, int part, int h, int H, int D) {
  if (dbias_part == nullptr) return nullptr;
  const long chunk = static_cast<long>(b) * ((T + kWarpRows - 1) / kWarpRows) + t0 / kWarpRows;
  return dbias_part + chunk * 3L * H * D + (static_cast<long>(part) * H + h) * D;
}

// ---- The stored-dS backward (5 products): dS^T tiles kept between the dK/dV kernel and the dQ kernel ----
// With a dS buffer the dK/dV kernel, which forms dS^T for every (key tile, query tile) pair it visits anyway, also
// writes it, rounded to bf16 — the left operand of dQ = dS K in either kernel —, as a 64 x 64 tile (key rows, query
// columns, row-major; 8 KiB): zeros where a key or query lies past T or outside the band, and a whole warp's 16 rows
// of zeros where the warp skips the pair. The dQ kernel then reads those tiles and K, and makes one product per pair
// (attention_dq_ds_tc_kernel) where it formed S, dP and dS again (3 products and the softmax): 5 products in all, as
// in FlashAttention-2, without its float atomics on dQ (each dQ element is still summed by one thread in a fixed
// order). Key tile kt is visited by query tiles kt .. kt + w - 1 (fewer at the end): w = ntiles without a window,
// else 1 + (62 + window) / 64 (the queries t <= k1 - 2 + window that see a key of [k0, k1)); a head's tiles lie key
// tile by key tile, query tile by query tile.
__host__ __device__ constexpr int DsTilesPerKey(int ntiles, long window) {
  return window > 0 && 1 + (62 + window) / kRows < ntiles ? static_cast<int>(1 + (62 + window) / kRows) : ntiles;
}
// Tiles of the key tiles before kt in one head: sum over j < kt of min(ntiles - j, w).
__host__ __device__ constexpr long DsTilesBefore(int kt, int ntiles, int w) {
  const long m = static_cast<long>(kt) - 1 - (ntiles - w);  // key tiles j > ntiles - w before kt visit fewer than w
  return static_cast<long>(kt) * w - (m > 0 ? m * (m + 1) / 2 : 0);
}
constexpr int kDsTileElems = kRows * kRows;
// The tile of (key tile kt, query tile qt) of head bh (kt <= qt < kt + w).
__device__ __forceinline__ long DsTileOffset(int bh, int kt, int qt, int ntiles, int w) {
  return (static_cast<long>(bh) * DsTilesBefore(ntiles, ntiles, w) + DsTilesBefore(kt, ntiles, w) + (qt - kt)) *
         kDsTileElems;
}
// Two bf16 at dst (4-byte aligned), a in the low half (as in memory): one store.
__device__ __forceinline__ void StorePairBf16(__nv_bfloat16* dst, __nv_bfloat16 a, __nv_bfloat16 b) {
  uint16_t ua, ub;
  memcpy(&ua, &a, sizeof(ua));
  memcpy(&ub, &b, sizeof(ub));
  *reinterpret_cast<uint32_t*>(dst) = static_cast<uint32_t>(ua) | (static_cast<uint32_t>(ub) << 16);
}
// The warp's 16 rows of a dS^T tile (row-major, 64 wide) from 16 rows of bf16 at src (leading dimension lds), or zeros
// where src is null: 16-byte stores, the lanes along the rows.
__device__ __forceinline__ void StoreDsRows(__nv_bfloat16* dst, const __nv_bfloat16* src, int lds) {
  for (int i = threadIdx.x % 32; i < kWarpRows * kRows / 8; i += 32) {
    const int r = i / (kRows / 8), c = 8 * (i % (kRows / 8));
    *reinterpret_cast<uint4*>(dst + r * kRows + c) =
        src ? *reinterpret_cast<const uint4*>(src + r * lds + c) : make_uint4(0u, 0u, 0u, 0u);
  }
}

// Bytes of one K and V (or Q and dout) tile pair, of the backward kernels' fp32 area, and of the second buffers of
// the dK/dV kernel (kAsync: the Q and dout tiles and their lse and drow rows).
__host__ __device__ constexpr size_t TilePairBytes(int D) {
  return sizeof(__nv_bfloat16) * 2 * kRows * LdH(D);
}
constexpr size_t kSdPBytes = sizeof(float) * kWarps * kWarpRows * kLdSdP;
__host__ __device__ constexpr size_t DkDvSecondBytes(int D) {
  return TilePairBytes(D) + sizeof(float) * 2 * kRows;
}
// kAsync with the register softmax: the backward kernels' second buffers (of `bytes`) lie in the fp32 area, which
// that softmax uses only after the loop (a barrier then separates the two uses), where they fit (D <= 64).
__host__ __device__ constexpr bool SecondInSdP(bool regs, size_t bytes) {
  return regs && bytes <= kSdPBytes;
}
// bf16 elements of the per-warp P (or dS) areas: none with the register softmax, which rounds P and dS into
// matrix_a fragments instead (FragLayoutsHold).
__host__ __device__ constexpr int PAreaElems(bool regs) {
  return regs ? 0 : kWarps * kWarpRows * kLdP;
}
// kAsync: the bias staged in shared memory (two of kMaxD floats), after everything else.
template <int kMaxD, bool kAsync>
constexpr size_t kBiasStageBytes = kAsync ? sizeof(float) * 2 * kMaxD : 0;

// Forward: K V [P] [fp32 area], then with kAsync the second K V and the k, v bias.
template <int kMaxD, bool kRegs, bool kAsync>
size_t ForwardTcSharedBytes(int D) {
  return sizeof(__nv_bfloat16) * (2 * kRows * LdH(D) + PAreaElems(kRegs)) +
         sizeof(float) * kWarps * kWarpRows * LdForward(kMaxD) + (kAsync ? TilePairBytes(D) : 0) +
         kBiasStageBytes<kMaxD, kAsync>;
}
// dQ: K V [dS] [fp32 area], then with kAsync the second K V (unless in the fp32 area) and the k, v bias.
template <int kMaxD, bool kRegs, bool kAsync>
size_t DqTcSharedBytes(int D) {
  const bool second = kAsync && !SecondInSdP(kRegs, TilePairBytes(D));
  return sizeof(__nv_bfloat16) * (2 * kRows * LdH(D) + PAreaElems(kRegs)) + kSdPBytes +
         (second ? TilePairBytes(D) : 0) + kBiasStageBytes<kMaxD, kAsync>;
}
// The dK/dV kernel keeps its K and V operand rows in shared memory rather than registers above D = 64 (with
// them in registers beside the dK and dV accumulators, ptxas spills at D = 128).
__host__ __device__ constexpr bool DkDvOperandsShared(int max_d) {
  return max_d > 64;
}
// The dK/dV kernel's fp32 area: S^T and dP^T in the loop (the shared-memory softmax), the dK and dV rows stored after
// it. With the register softmax and kAsync the second Q, dout, lse and drow always lie there, the area grown to hold
// them where they are larger (D > 64): at D = 128 1.5 KiB more makes the block's shared memory 104 KiB where a
// second buffer of its own made it 137, so that two blocks share an SM of 228 KiB (H100, H200) as their registers
// (ptxas: 192 on sm_80, 230 on sm_90) allow, where one did.
__host__ __device__ constexpr size_t DkDvFBytes(bool regs, bool async, int D) {
  return regs && async && DkDvSecondBytes(D) > kSdPBytes ? DkDvSecondBytes(D) : kSdPBytes;
}
// dK/dV: Q dout [P] [dS] lse drow [fp32 area] (K V where DkDvOperandsShared), then with kAsync the second Q, dout,
// lse and drow (the shared-memory softmax: the register one keeps them in the fp32 area) and the q bias.
template <int kMaxD, bool kRegs, bool kAsync>
size_t DkDvTcSharedBytes(int D) {
  const bool second = kAsync && !kRegs;
  return sizeof(__nv_bfloat16) * ((DkDvOperandsShared(kMaxD) ? 4 : 2) * kRows * LdH(D) + 2 * PAreaElems(kRegs)) +
         sizeof(float) * 2 * kRows + DkDvFBytes(kRegs, kAsync, D) + (second ? DkDvSecondBytes(D) : 0) +
         kBiasStageBytes<kMaxD, kAsync>;
}
}  // namespace

// One key tile of the register forward's online softmax for a warp's 16 rows [ra, rb] (rows past rb, or past T,
// masked): scales the scores sc (16 x 64, fp32 accumulators) by scale2 and masks them in place (-inf; not at all on a
// tile inside every row's band: InsideBand, warp-uniform), updates the running max m and sum l of the lane's row
// slots, rescales the output accumulators of by exp(m_old - m_new), and rounds P = exp(x - m) (masked: exp(-inf) = 0)
// to bf16 straight into the matrix_a fragments pa of the P V product (FragLayoutsHold: x[i] of both kinds hold the
// same element), without a trip through shared memory. The caller then adds pa times the V tile to of.
template <int kMaxD>
__device__ __forceinline__ void SoftmaxTileRegs(FragC (&sc)[kTileFrags], FragA (&pa)[kTileFrags],
                                                FragC (&of)[kMaxD / kF], float (&m)[kAccSlots], float (&l)[kAccSlots],
                                                int ra, int rb, int k0, int window, float scale2) {
  const int lane = threadIdx.x % 32;
  float mx[kAccSlots];
  MS_UNROLL
  for (int s = 0; s < kAccSlots; ++s) mx[s] = -INFINITY;
  auto scale_mask = [&](auto masked) {
    MS_UNROLL
    for (int n = 0; n < kTileFrags; ++n) {
      MS_UNROLL
      for (int i = 0; i < kAccElems; ++i) {
        const int t = ra + AccRow(lane, i), key = k0 + n * kF + AccCol(lane, i);
        const bool seen = !decltype(masked)::value || (t <= rb && Sees(t, key, window));
        const float x = seen ? sc[n].x[i] * scale2 : -INFINITY;
        sc[n].x[i] = x;
        mx[AccSlot(i)] = fmaxf(mx[AccSlot(i)], x);
      }
    }
  };
  if (InsideBand(ra, rb, k0, window)) {
    scale_mask(std::false_type{});
  } else {
    scale_mask(std::true_type{});
  }
  float m_use[kAccSlots], alpha[kAccSlots], sum[kAccSlots];
  MS_UNROLL
  for (int s = 0; s < kAccSlots; ++s) {
    const float m_new = fmaxf(m[s], AccRowMax(mx[s]));
    m_use[s] = m_new == -INFINITY ? 0.0f : m_new;  // no key seen yet: p = 0, alpha = 0
    alpha[s] = exp2f(m[s] - m_use[s]);
    m[s] = m_new;
    sum[s] = 0.0f;
  }
  MS_UNROLL
  for (int n = 0; n < kTileFrags; ++n) {
    MS_UNROLL
    for (int i = 0; i < kAccElems; ++i) {
      const float p = exp2f(sc[n].x[i] - m_use[AccSlot(i)]);
      sum[AccSlot(i)] += p;
      pa[n].x[i] = __float2bfloat16(p);
    }
  }
  MS_UNROLL
  for (int s = 0; s < kAccSlots; ++s) l[s] = l[s] * alpha[s] + AccRowSum(sum[s]);
  MS_UNROLL
  for (int n = 0; n < kMaxD / kF; ++n) {
    MS_UNROLL
    for (int i = 0; i < kAccElems; ++i) of[n].x[i] *= alpha[AccSlot(i)];
  }
}

// The register forward's epilogue for a warp's 16 rows from ra (rows past rb are not written): divides the output
// accumulators of by the row sums l, stages them in the warp's fp32 area Fw (leading dimension ldf), writes each
// row's lse (m + log2 l, in natural units) and the rows of out and out16 (StoreRows). Ends with the area read.
template <int kMaxD>
__device__ __forceinline__ void StoreForwardRowsRegs(float* out, __nv_bfloat16* out16, float* lse,
                                                     FragC (&of)[kMaxD / kF], const float (&m)[kAccSlots],
                                                     const float (&l)[kAccSlots], float* Fw, int ldf, int ra, int rb,
                                                     int T, int H, int D, int b, int h, int bh) {
  const int lane = threadIdx.x % 32;
  float inv[kAccSlots];
  MS_UNROLL
  for (int s = 0; s < kAccSlots; ++s) inv[s] = 1.0f / l[s];
  MS_UNROLL
  for (int n = 0; n < kMaxD / kF; ++n) {
    if (n * kF >= D) break;
    MS_UNROLL
    for (int i = 0; i < kAccElems; ++i) of[n].x[i] *= inv[AccSlot(i)];
    wmma::store_matrix_sync(Fw + n * kF, of[n], ldf, wmma::mem_row_major);
  }
  if (lane % kAccRowLanes == 0) {  // one lane of each row writes its lse
    MS_UNROLL
    for (int s = 0; s < kAccSlots; ++s) {
      const int t = ra + AccSlotRow(lane, s);
      if (t <= rb) lse[static_cast<long>(bh) * T + t] = (m[s] + log2f(l[s])) * kLn2;
    }
  }
  __syncwarp();
  const long obase = (static_cast<long>(b) * T * H + h) * D;
  StoreRows(out ? out + obase : nullptr, out16 ? out16 + obase : nullptr, static_cast<long>(H) * D, Fw, ldf, ra, T, D);
  __syncwarp();  // the fp32 area is read before it is written again
}

// The forward's loop over the key tiles and its epilogue with the register-resident softmax
// (attention_forward_tc_kernel, kRegs): all threads of the block run it (it has the block's barriers); qf are the
// warp's query fragments. kFullD: D == kMaxD, so the products' loops over D's fragments have compile-time bounds
// (attention_forward_tc_kernel).
template <int kMaxD, typename S, bool kAsync, bool kFullD>
__device__ __forceinline__ void ForwardRegs(float* out, __nv_bfloat16* out16, float* lse, const S* k, const S* v,
                                            const HeadBias& hb, long row, int T, int H, int D, int window, float scale2,
                                            int b, int h, int bh, int q0, int q1, int ra, int rb,
                                            const FragA (&qf)[kMaxD / kF], const KvBuffers& kv, float* Fw, int ldf,
                                            int ld) {
  float m[kAccSlots], l[kAccSlots];
  MS_UNROLL
  for (int s = 0; s < kAccSlots; ++s) m[s] = -INFINITY, l[s] = 0.0f;
  FragC of[kMaxD / kF];
  MS_UNROLL
  for (int n = 0; n < kMaxD / kF; ++n) wmma::fill_fragment(of[n], 0.0f);
  const int dp = kFullD ? kMaxD : D;  // the products' D

  ForKeyTiles<kMaxD, S, kAsync>(k, v, hb, row, T, D, window, q0, q1, ra, rb, kv, ld,
                                [&](int k0, const __nv_bfloat16* Ks, const __nv_bfloat16* Vs) {
                                  FragC sc[kTileFrags];
                                  RowsTimesTileTFrags<kMaxD, false>(sc, 0, qf, nullptr, Ks, ld, dp);
                                  FragA pa[kTileFrags];
                                  SoftmaxTileRegs<kMaxD>(sc, pa, of, m, l, ra, rb, k0, window, scale2);
                                  MS_UNROLL
                                  for (int n = 0; n < kTileFrags; ++n)
                                    AddATimesTileRows<kMaxD>(of, pa[n], Vs, n, ld, dp);
                                });

  if (rb < ra) return;  // after the last barrier
  StoreForwardRowsRegs<kMaxD>(out, out16, lse, of, m, l, Fw, ldf, ra, rb, T, H, D, b, h, bh);
}

// ---- kernels ----

// One block per (b, h, query tile of 64); blockIdx.x = bh * ntiles + (ntiles - 1 - tile): the longest causal
// rows start first. Two lanes per row (r = lane / 2) keep the running max m and sum l (identical in both) and
// the row's outputs d = 2 j + lane % 2.
// out (B, T, H, D), lse (B, H, T), qkv (B, T, 3, H, D); D a multiple of 16, D <= kMaxD; out16 (B, T, H, D) bf16, out
// rounded, or null; qkv_bias (3, H, D) added to q, k, v as they are loaded, or null.
// (kThreads, 2): with (kThreads) alone ptxas gave the D <= 128 instance 168 registers on sm_80 and spilled
// (scripts/check_ptxas.py); 2 blocks per SM allow up to 255. (kThreads, 3) for D <= 64: with the qkv bias loads
// ptxas chose 174 registers on sm_90 (2 blocks per SM); held to 168 it keeps 3 blocks without spilling.
// kRegs: the register-resident softmax: the scores stay in accumulator fragments, each lane applies the mask, scale and
// exp to its elements (AccRow, AccCol) and the lanes of a row reduce its max and sum by shuffles; the output
// accumulates in fragments (rescaled there as the max grows) and goes through the fp32 area once at the end. Else
// the scores go through the fp32 area and two lanes per row run the softmax over it (and the P V product too).
// kAsync (bf16 qkv, 16-byte aligned): the key tiles double-buffered with asynchronous copies (ForKeyTiles); the
// query rows are then staged in the second buffer while the first key tile's copies are in flight.
// kFullD (kRegs only; the launcher's choice where D == kMaxD, the training path's case): the loop's two products run
// over kMaxD / 16 fragments known at compile time, with no test of D between their k-steps, so that ptxas can issue
// the next fragments' ldmatrix ahead of the current MMAs — with D a run-time bound each k-step's loads waited for
// the branch, its MMAs for those loads (sm_90 SASS at D = 64: Q K^T as 4 LDSM then 8 HMMA, 4 times over, behind a
// branch each, and P V behind 12 branches; with kFullD 9 of Q K^T's 16 LDSM ahead of its first HMMA, the rest
// interleaved, and no branch in either product; 160 registers instead of 156, still 3 blocks per SM). The same
// products in the same order: the same bits. (The backward's dK/dV and stored-dS dQ kernels have such instances at
// D = 64 on sm_90 only: elsewhere fixed bounds made ptxas spill or lose a block per SM.)
template <int kMaxD, typename S, bool kRegs, bool kAsync, bool kFullD = false>
__global__ void __launch_bounds__(kThreads, kMaxD <= 64 ? 3 : 2)
    attention_forward_tc_kernel(float* out, __nv_bfloat16* out16, float* lse, const S* qkv, const float* qkv_bias,
                                int T, int H, int D, int window, int ntiles, float scale) {
  constexpr int kLdF = LdForward(kMaxD);
  const float scale2 = scale * kLog2e;  // the base-2 softmax
  MS_DYNAMIC_SHARED(__nv_bfloat16, smem);
  const int ld = LdH(D);
  __nv_bfloat16* const Ks = smem;
  __nv_bfloat16* const Vs = Ks + kRows * ld;
  __nv_bfloat16* const Ps = Vs + kRows * ld;
  float* const Fs = reinterpret_cast<float*>(Ps + PAreaElems(kRegs));
  __nv_bfloat16* const K1 = reinterpret_cast<__nv_bfloat16*>(Fs + kWarps * kWarpRows * kLdF);  // kAsync
  float* const Bs = reinterpret_cast<float*>(K1 + 2 * kRows * ld);                             // kAsync: k, v bias

  const int bh = blockIdx.x / ntiles, qt = ntiles - 1 - static_cast<int>(blockIdx.x % ntiles);
  const int b = bh / H, h = bh % H;
  const HeadRowsT<S> hr = HeadRowsOf(qkv, static_cast<const S*>(nullptr), b, h, T, H, D);
  const long row = hr.row;
  const S *q = hr.q, *k = hr.k, *v = hr.v;
  const HeadBias hb = HeadBiasOf(qkv_bias, h, H, D);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int q0 = qt * kRows, q1 = min(q0 + kRows, T);
  const int ra = q0 + warp * kWarpRows, rb = min(ra + kWarpRows, T) - 1;  // this warp's rows; none if rb < ra
  __nv_bfloat16* const Pw = Ps + warp * kWarpRows * kLdP;
  float* const Fw = Fs + warp * kWarpRows * kLdF;
  const int r = lane / 2, half = lane % 2, t = ra + r;  // the lane's row
  const KvBuffers kv = KeyTileBuffers<kMaxD, kAsync>(Ks, Vs, K1, Bs, hb, k, v, row, T, D, window, q0, ld);

  // The warp's query rows as fragments (staged through the K area; kAsync: the second one).
  __nv_bfloat16* const Qstage = (kAsync ? kv.k1 : kv.k0);
  LoadTileBf16(Qstage, ld, q, hb.q, row, q0, T, D);
  __syncthreads();
  FragA qf[kMaxD / kF];
  MS_UNROLL
  for (int f = 0; f < kMaxD / kF; ++f) {
    if (f * kF < D) LoadFrag(qf[f], Qstage + warp * kWarpRows * ld + f * kF, ld);
  }

  if constexpr (kRegs) {
    ForwardRegs<kMaxD, S, kAsync, kFullD>(out, out16, lse, k, v, hb, row, T, H, D, window, scale2, b, h, bh, q0, q1, ra,
                                          rb, qf, kv, Fw, kLdF, ld);
    return;
  }
  float m = -INFINITY, l = 0.0f, o[kMaxD / 2];
  MS_UNROLL
  for (int j = 0; j < kMaxD / 2; ++j) o[j] = 0.0f;

  ForKeyTiles<kMaxD, S, kAsync>(
      k, v, hb, row, T, D, window, q0, q1, ra, rb, kv, ld,
      [&](int k0, const __nv_bfloat16* Ks, const __nv_bfloat16* Vs) {
        RowsTimesTileT<kMaxD, false>(Fw, kLdF, qf, nullptr, Ks, ld, D);
        __syncwarp();
        // Online softmax of row r over keys k0 + 32 half + i.
        const float* s = Fw + r * kLdF + 32 * half;
        const int key0 = k0 + 32 * half;
        float mx = -INFINITY;
        for (int i = 0; i < 32; ++i) {
          if (t <= rb && Sees(t, key0 + i, window)) mx = fmaxf(mx, s[i] * scale2);
        }
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
        const float m_new = fmaxf(m, mx);
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // no key seen yet: p = 0, alpha = 0
        const float alpha = exp2f(m - m_use);
        float sum = 0.0f;
        __nv_bfloat16* const pr = Pw + r * kLdP + 32 * half;
        for (int i = 0; i < 32; ++i) {
          const float p = (t <= rb && Sees(t, key0 + i, window)) ? exp2f(s[i] * scale2 - m_use) : 0.0f;
          sum += p;
          pr[i] = __float2bfloat16(p);
        }
        sum += __shfl_xor_sync(kFullMask, sum, 1);
        l = l * alpha + sum;
        m = m_new;
        __syncwarp();  // P written, S read: the fp32 area takes P V

        {
          FragA pa[kTileFrags];
          MS_UNROLL
          for (int kk = 0; kk < kTileFrags; ++kk) LoadFrag(pa[kk], Pw + kk * kF, kLdP);
          MS_UNROLL
          for (int n = 0; n < kMaxD / kF; ++n) {
            if (n * kF >= D) break;
            FragC pv;
            wmma::fill_fragment(pv, 0.0f);
            MS_UNROLL
            for (int kk = 0; kk < kTileFrags; ++kk) {
              FragBRow vb;
              LoadFrag(vb, Vs + kk * kF * ld + n * kF, ld);
              wmma::mma_sync(pv, pa[kk], vb, pv);
            }
            wmma::store_matrix_sync(Fw + n * kF, pv, kLdF, wmma::mem_row_major);
          }
        }
        __syncwarp();
        const float* pvr = Fw + r * kLdF;
        MS_UNROLL
        for (int j = 0; j < kMaxD / 2; ++j) {
          if (2 * j < D) o[j] = o[j] * alpha + pvr[2 * j + half];
        }
        __syncwarp();  // the fp32 area is read before the next tile's scores
      });

  if (rb < ra) return;  // after the last barrier
  const float inv = 1.0f / l;
  float* const orow = Fw + r * kLdF;
  MS_UNROLL
  for (int j = 0; j < kMaxD / 2; ++j) {
    if (2 * j < D) orow[2 * j + half] = o[j] * inv;
  }
  if (half == 0 && t <= rb) lse[static_cast<long>(bh) * T + t] = (m + log2f(l)) * kLn2;
  __syncwarp();
  const long obase = (static_cast<long>(b) * T * H + h) * D;
  StoreRows(out ? out + obase : nullptr, out16 ? out16 + obase : nullptr, static_cast<long>(H) * D, Fw, kLdF, ra, T, D);
}

// ---- the wide forward (SetAttentionTcWideForward): two 16-row fragments per warp ----
// The forward as FlashAttention-2 tiles it: a block of 4 warps owns 128 query rows, each warp 32 of them as two
// fragment rows, and each K or V fragment a warp loads from shared memory feeds the MMAs of both (half the K and V
// fragment loads per product of the kernel above, whose warps own one). Only the training path's instances: bf16 qkv
// with 16-byte aligned rows (the tiles copied asynchronously, double-buffered), the register softmax. Up to D = 64
// the warp's query rows stay in fragments for the whole loop, as above; above it (WideQueriesShared) the two
// fragment rows' P V accumulators alone take 128 registers a lane at D = 128, so the query rows stay in shared memory
// and each Q fragment is loaded per tile, once for the four K fragments it meets (FlashAttention-2's choice at D = 128
// too): per tile 16 + 32 + 32 fragment loads for 128 MMAs, where the kernel above makes 32 + 32 for 64. Each fragment
// row runs exactly the register forward's arithmetic in its order, so the outputs are the same bits (tested).
// kFullD: D == kMaxD, the products' loops with compile-time bounds, as the kernel above's.
namespace {
constexpr int kWideFrags = 2;                          // fragment rows per warp
constexpr int kWideWarpRows = kWideFrags * kWarpRows;  // 32 query rows a warp owns
constexpr int kWideRows = kWarps * kWideWarpRows;      // 128 query rows a block owns

// The wide forward reads its query fragments from shared memory at each tile above D = 64 (see above).
__host__ __device__ constexpr bool WideQueriesShared(int max_d) {
  return max_d > 64;
}
// The leading dimension (floats) of a warp's fp32 output area: LdForward(kMaxD), or with the queries shared
// LdForward(D), whose 16 rows (64 (D + 4) + 256 bytes for 64 < D) fit in the warp's own 32 query rows (64 (D + 8)
// bytes), where the area then lies: those rows are read only by the warp, and only in the loop.
__host__ __device__ constexpr int WideLdF(int max_d, int D) {
  return WideQueriesShared(max_d) ? LdForward(D) : LdForward(max_d);
}
constexpr bool WideAreasFit() {
  for (int D = 64 + kF; D <= 128; D += kF) {
    if (kWarpRows * sizeof(float) * WideLdF(128, D) > kWideWarpRows * sizeof(__nv_bfloat16) * LdH(D)) return false;
  }
  return true;
}
static_assert(WideAreasFit(), "a warp's fp32 output area fits in its 32 query rows");

// Forward, wide: K V, the second K V, then either (queries in fragments) a fp32 area of 16 rows per warp for the
// output, the block's 128 query rows staged first in the second K V; or (WideQueriesShared) the 128 query rows, each
// warp's 32 holding its output area after the loop. Then the k, v bias.
template <int kMaxD>
size_t ForwardWideSharedBytes(int D) {
  const size_t tail = WideQueriesShared(kMaxD) ? sizeof(__nv_bfloat16) * kWideRows * LdH(D)
                                               : sizeof(float) * kWarps * kWarpRows * LdForward(kMaxD);
  return 2 * TilePairBytes(D) + tail + kBiasStageBytes<kMaxD, true>;
}
}  // namespace

// One block per (b, h, query tile of 128); blockIdx.x = bh * ntiles + (ntiles - 1 - tile) (ntiles: of 128 rows).
// out, out16, lse, qkv, qkv_bias as attention_forward_tc_kernel; D a multiple of 16, D <= kMaxD (64 < D with
// kMaxD = 128). Launch bounds: with the queries in fragments (kThreads, 2): the two fragment rows' scores, P V
// accumulators and query fragments take about twice the registers; with them shared (kThreads, 1): at D = 128 the
// output accumulators alone take 128 registers a lane.
template <int kMaxD, bool kFullD>
__global__ void __launch_bounds__(kThreads, WideQueriesShared(kMaxD) ? 1 : 2)
    attention_forward_wide_tc_kernel(float* out, __nv_bfloat16* out16, float* lse, const __nv_bfloat16* qkv,
                                     const float* qkv_bias, int T, int H, int D, int window, int ntiles, float scale) {
  constexpr bool kQShared = WideQueriesShared(kMaxD);
  constexpr int kDF = kMaxD / kF;
  const float scale2 = scale * kLog2e;
  MS_DYNAMIC_SHARED(__nv_bfloat16, smem);
  const int ld = LdH(D), ldf = WideLdF(kMaxD, D);
  const int dp = kFullD ? kMaxD : D;  // the products' D
  __nv_bfloat16* const Ks = smem;
  __nv_bfloat16* const Vs = Ks + kRows * ld;
  __nv_bfloat16* const K1 = Vs + kRows * ld;  // the second K, V (queries in fragments: the query staging first)
  __nv_bfloat16* const Qs = kQShared ? K1 + 2 * kRows * ld : K1;    // the block's 128 query rows
  float* const Fs = reinterpret_cast<float*>(K1 + 2 * kRows * ld);  // queries in fragments: the output areas
  float* const Bs = kQShared ? reinterpret_cast<float*>(Qs + kWideRows * ld) : Fs + kWarps * kWarpRows * ldf;

  const int bh = blockIdx.x / ntiles, qt = ntiles - 1 - static_cast<int>(blockIdx.x % ntiles);
  const int b = bh / H, h = bh % H;
  const HeadRowsT<__nv_bfloat16> hr = HeadRowsOf(qkv, static_cast<const __nv_bfloat16*>(nullptr), b, h, T, H, D);
  const long row = hr.row;
  const HeadBias hb = HeadBiasOf(qkv_bias, h, H, D);
  const int warp = threadIdx.x / 32;
  const int q0 = qt * kWideRows, q1 = min(q0 + kWideRows, T);
  const int ra = q0 + warp * kWideWarpRows, rb = min(ra + kWideWarpRows, T) - 1;  // the warp's rows; none if rb < ra
  int fa[kWideFrags], fb[kWideFrags];  // each fragment row's rows (fb < fa: past T)
  MS_UNROLL
  for (int fr = 0; fr < kWideFrags; ++fr) {
    fa[fr] = ra + fr * kWarpRows;
    fb[fr] = min(fa[fr] + kWarpRows, T) - 1;
  }
  const __nv_bfloat16* const Qw = Qs + warp * kWideWarpRows * ld;  // the warp's 32 query rows
  float* const Fw = kQShared ? reinterpret_cast<float*>(Qs + warp * kWideWarpRows * ld) : Fs + warp * kWarpRows * ldf;
  const KvBuffers kv = KeyTileBuffers<kMaxD, true>(Ks, Vs, K1, Bs, hb, hr.k, hr.v, row, T, D, window, q0, ld);

  // The block's 128 query rows (contiguous) while the first key tile flies: staged in the second K, V buffer and
  // loaded into fragments, or kept (kQShared; the loop's first barrier publishes them).
  LoadTileBf16(Qs, ld, hr.q, hb.q, row, q0, T, D);
  LoadTileBf16(Qs + kRows * ld, ld, hr.q, hb.q, row, q0 + kRows, T, D);
  FragA qf[kWideFrags][kQShared ? 1 : kDF];
  if constexpr (!kQShared) {
    __syncthreads();
    MS_UNROLL
    for (int fr = 0; fr < kWideFrags; ++fr) {
      MS_UNROLL
      for (int f = 0; f < kDF; ++f) {
        if (f * kF < D) LoadFrag(qf[fr][f], Qw + fr * kWarpRows * ld + f * kF, ld);
      }
    }
  }

  float m[kWideFrags][kAccSlots], l[kWideFrags][kAccSlots];
  FragC of[kWideFrags][kDF];
  MS_UNROLL
  for (int fr = 0; fr < kWideFrags; ++fr) {
    MS_UNROLL
    for (int s = 0; s < kAccSlots; ++s) m[fr][s] = -INFINITY, l[fr][s] = 0.0f;
    MS_UNROLL
    for (int n = 0; n < kDF; ++n) wmma::fill_fragment(of[fr][n], 0.0f);
  }

  ForKeyTiles<kMaxD, __nv_bfloat16, true>(hr.k, hr.v, hb, row, T, D, window, q0, q1, ra, rb, kv, ld,
                                          [&](int k0, const __nv_bfloat16* Kt, const __nv_bfloat16* Vt) {
                                            // S of both fragment rows: each K fragment loaded once, for two MMAs
                                            // (RowsTimesTileTFrags's order per row).
                                            FragC sc[kWideFrags][kTileFrags];
                                            MS_UNROLL
                                            for (int fr = 0; fr < kWideFrags; ++fr) {
                                              MS_UNROLL
                                              for (int j = 0; j < kTileFrags; ++j) wmma::fill_fragment(sc[fr][j], 0.0f);
                                            }
                                            MS_UNROLL
                                            for (int f = 0; f < kDF; ++f) {
                                              if (f * kF >= dp) break;
                                              FragA qa[kWideFrags];
                                              MS_UNROLL
                                              for (int fr = 0; fr < kWideFrags; ++fr) {
                                                if constexpr (kQShared) {
                                                  LoadFrag(qa[fr], Qw + fr * kWarpRows * ld + f * kF, ld);
                                                } else {
                                                  qa[fr] = qf[fr][f];
                                                }
                                              }
                                              MS_UNROLL
                                              for (int j = 0; j < kTileFrags; ++j) {
                                                FragBCol kb;
                                                LoadFrag(kb, Kt + j * kF * ld + f * kF, ld);
                                                MS_UNROLL
                                                for (int fr = 0; fr < kWideFrags; ++fr)
                                                  wmma::mma_sync(sc[fr][j], qa[fr], kb, sc[fr][j]);
                                              }
                                            }
                                            // The softmax of each fragment row, as ForwardRegs: P rounded into matrix_a
                                            // fragments.
                                            FragA pa[kWideFrags][kTileFrags];
                                            MS_UNROLL
                                            for (int fr = 0; fr < kWideFrags; ++fr) {
                                              SoftmaxTileRegs<kMaxD>(sc[fr], pa[fr], of[fr], m[fr], l[fr], fa[fr],
                                                                     fb[fr], k0, window, scale2);
                                            }
                                            // P V of both fragment rows: each V fragment loaded once, for two MMAs
                                            // (PTimesTile's order per row).
                                            MS_UNROLL
                                            for (int n = 0; n < kDF; ++n) {
                                              if (n * kF >= dp) break;
                                              MS_UNROLL
                                              for (int kk = 0; kk < kTileFrags; ++kk) {
                                                FragBRow vb;
                                                LoadFrag(vb, Vt + kk * kF * ld + n * kF, ld);
                                                MS_UNROLL
                                                for (int fr = 0; fr < kWideFrags; ++fr)
                                                  wmma::mma_sync(of[fr][n], pa[fr][kk], vb, of[fr][n]);
                                              }
                                            }
                                          });

  if (rb < ra) return;                   // after the last barrier
  if constexpr (kQShared) __syncwarp();  // every lane's last query fragment load is done before Fw overwrites them
  MS_UNROLL
  for (int fr = 0; fr < kWideFrags; ++fr) {
    if (fb[fr] < fa[fr]) break;  // warp-uniform: this fragment row and the next lie past T
    StoreForwardRowsRegs<kMaxD>(out, out16, lse, of[fr], m[fr], l[fr], Fw, ldf, fa[fr], fb[fr], T, H, D, b, h, bh);
  }
}

// One block per (b, h, query tile of 64); blockIdx.x = bh * ntiles + (ntiles - 1 - tile). Loops over the key
// tiles the query tile sees. dS = P (dP - drow) scale with P = exp(scale q.k - lse), dP = dout.v;
// dQ_t = sum_s dS_ts k_s.
// kRegs: S and dP stay in accumulator fragments (32 keys at a time at D <= 64 with kAsync, else 16), each lane forms
// dS of its elements, rounded into the matrix_a fragments of dS K.
// kAsync (bf16 qkv and dout, 16-byte aligned): the key tiles double-buffered with asynchronous copies
// (ForKeyTiles), the query and dout rows staged in the second buffer meanwhile; with kRegs at D <= 64 the second
// buffer lies in the fp32 area (SecondInSdP), which is then written only after a barrier that ends the loop.
template <int kMaxD, typename S, bool kRegs, bool kAsync>
__global__ void __launch_bounds__(kThreads)
    attention_dq_tc_kernel(float* dqkv, __nv_bfloat16* dqkv16, float* dbias_part, const S* dout, const S* qkv,
                           const float* qkv_bias, const float* lse, const float* drow, int T, int H, int D, int window,
                           int ntiles, float scale) {
  MS_DYNAMIC_SHARED(__nv_bfloat16, smem);
  const int ld = LdH(D);
  __nv_bfloat16* const Ks = smem;
  __nv_bfloat16* const Vs = Ks + kRows * ld;
  __nv_bfloat16* const Ps = Vs + kRows * ld;
  float* const Fs = reinterpret_cast<float*>(Ps + PAreaElems(kRegs));
  const bool second_in_f = SecondInSdP(kRegs, TilePairBytes(D));  // kAsync
  __nv_bfloat16* const K1 = reinterpret_cast<__nv_bfloat16*>(second_in_f ? Fs : Fs + kWarps * kWarpRows * kLdSdP);
  float* const Bs = reinterpret_cast<float*>(Fs + kWarps * kWarpRows * kLdSdP) +
                    (second_in_f ? 0 : TilePairBytes(D) / sizeof(float));  // kAsync: the k, v bias

  const int bh = blockIdx.x / ntiles, qt = ntiles - 1 - static_cast<int>(blockIdx.x % ntiles);
  const int b = bh / H, h = bh % H;
  const HeadRowsT<S> hr = HeadRowsOf(qkv, dout, b, h, T, H, D);
  const long row = hr.row, orow = hr.orow;
  const S *q = hr.q, *k = hr.k, *v = hr.v, *g = hr.g;
  const HeadBias hb = HeadBiasOf(qkv_bias, h, H, D);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int q0 = qt * kRows, q1 = min(q0 + kRows, T);
  const int ra = q0 + warp * kWarpRows, rb = min(ra + kWarpRows, T) - 1;
  __nv_bfloat16* const Pw = Ps + warp * kWarpRows * kLdP;
  float* const Fw = Fs + warp * kWarpRows * kLdSdP;
  const int r = lane / 2, half = lane % 2, t = ra + r;
  const float scale2 = scale * kLog2e;  // the base-2 softmax: lse read back in base-2 units too
  const float lr = t <= rb ? lse[static_cast<long>(bh) * T + t] * kLog2e : 0.0f;
  const float dr = t <= rb ? drow[static_cast<long>(bh) * T + t] : 0.0f;
  float lrs[kAccSlots], drs[kAccSlots];  // kRegs: the same for the rows of the lane's slots
  MS_UNROLL
  for (int s = 0; s < kAccSlots; ++s) {
    const int ts = ra + AccSlotRow(lane, s);
    lrs[s] = ts <= rb ? lse[static_cast<long>(bh) * T + ts] * kLog2e : 0.0f;
    drs[s] = ts <= rb ? drow[static_cast<long>(bh) * T + ts] : 0.0f;
  }

  const KvBuffers kv = KeyTileBuffers<kMaxD, kAsync>(Ks, Vs, K1, Bs, hb, k, v, row, T, D, window, q0, ld);

  // The warp's query and dout rows as fragments (staged through the K and V areas; kAsync: the second ones).
  __nv_bfloat16* const Qstage = (kAsync ? kv.k1 : kv.k0);
  __nv_bfloat16* const Gstage = (kAsync ? kv.v1 : kv.v0);
  LoadTilesBf16<kMaxD, S>({Qstage, q, hb.q, row}, {Gstage, g, nullptr, orow}, ld, q0, T, D);
  __syncthreads();
  FragA qf[kMaxD / kF], gf[kMaxD / kF];
  FragC dq[kMaxD / kF];
  MS_UNROLL
  for (int f = 0; f < kMaxD / kF; ++f) {
    wmma::fill_fragment(dq[f], 0.0f);
    if (f * kF >= D) continue;
    LoadFrag(qf[f], Qstage + warp * kWarpRows * ld + f * kF, ld);
    LoadFrag(gf[f], Gstage + warp * kWarpRows * ld + f * kF, ld);
  }

  ForKeyTiles<kMaxD, S, kAsync>(
      k, v, hb, row, T, D, window, q0, q1, ra, rb, kv, ld,
      [&](int k0, const __nv_bfloat16* Ks, const __nv_bfloat16* Vs) {
        if constexpr (kRegs) {
          // S and dP fragments at a time, beside q, dout and dQ in registers: 2 only at D <= 64 with kAsync (ptxas
          // then fits the kernel in 156-164 registers; without kAsync it gave 2 fragments 168 registers and spilled
          // 80 bytes on sm_80 — 1 fragment: 161, no spill — and 1 fragment with kAsync spilled 24 bytes).
          constexpr int kN = kMaxD <= 64 && kAsync ? 2 : 1;
          // masked false: the tile lies inside every row's band (InsideBand, warp-uniform).
          auto tile = [&](auto masked) {
            MS_UNROLL
            for (int n0 = 0; n0 < kTileFrags; n0 += kN) {
              FragC sc[kN], dpc[kN];
              RowsTimesTileTFrags<kMaxD, false>(sc, n0, qf, nullptr, Ks, ld, D);
              RowsTimesTileTFrags<kMaxD, false>(dpc, n0, gf, nullptr, Vs, ld, D);
              FragA ds[kN];  // dS rounded to bf16 in matrix_a fragments (FragLayoutsHold), the left operand of dS K
              MS_UNROLL
              for (int j = 0; j < kN; ++j) {
                MS_UNROLL
                for (int i = 0; i < kAccElems; ++i) {
                  const int tr = ra + AccRow(lane, i), c = (n0 + j) * kF + AccCol(lane, i);
                  const bool seen = !decltype(masked)::value || (tr <= rb && Sees(tr, k0 + c, window));
                  const float p = seen ? exp2f(sc[j].x[i] * scale2 - lrs[AccSlot(i)]) : 0.0f;
                  ds[j].x[i] = __float2bfloat16(seen ? p * (dpc[j].x[i] - drs[AccSlot(i)]) * scale : 0.0f);
                }
              }
              MS_UNROLL
              for (int j = 0; j < kN; ++j) AddATimesTileRows<kMaxD>(dq, ds[j], Ks, n0 + j, ld, D);
            }
          };
          if (InsideBand(ra, rb, k0, window)) {
            tile(std::false_type{});
          } else {
            tile(std::true_type{});
          }
        } else {
          RowsTimesTileT<kMaxD, false>(Fw, kLdSdP, qf, nullptr, Ks, ld, D);          // S
          RowsTimesTileT<kMaxD, false>(Fw + kRows, kLdSdP, gf, nullptr, Vs, ld, D);  // dP
          __syncwarp();
          const float* s = Fw + r * kLdSdP + 32 * half;
          const float* dp = s + kRows;
          const int key0 = k0 + 32 * half;
          __nv_bfloat16* const dsr = Pw + r * kLdP + 32 * half;
          for (int i = 0; i < 32; ++i) {
            const bool seen = t <= rb && Sees(t, key0 + i, window);
            const float p = seen ? exp2f(s[i] * scale2 - lr) : 0.0f;
            dsr[i] = __float2bfloat16(seen ? p * (dp[i] - dr) * scale : 0.0f);
          }
          __syncwarp();
          PTimesTile<kMaxD>(dq, Pw, Ks, ld, D);
          __syncwarp();  // dS is read before the next tile's
        }
      });
  if (kAsync && second_in_f) __syncthreads();  // the last tile may lie in the fp32 area, written next

  if (rb < ra) return;
  const long qbase = static_cast<long>(b) * T * row + static_cast<long>(h) * D;
  StoreFragRows<kMaxD>(dqkv ? dqkv + qbase : nullptr, dqkv16 ? dqkv16 + qbase : nullptr,
                       BiasPart(dbias_part, b, ra, T, 0, h, H, D), row, Fw, kLdSdP, dq, ra, T, D);
}

// The dK/dV kernel's blocks per SM, as its launch bounds ask ptxas to allow: 3 for the training path's instance
// (register softmax, asynchronous copies) at D <= 64 on sm_80, whose 52 KiB of shared memory let an A100 hold 3
// (ptxas, left at 2, chose 166 registers and later 172, which allow 2), else 2 (on sm_90 3 made that instance spill:
// 52 bytes, 2026-11-28).
template <int kMaxD, bool kRegs, bool kAsync>
__host__ __device__ constexpr int DkDvMinBlocks() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 800
  return kMaxD <= 64 && kRegs && kAsync ? 3 : 2;
#else
  return 2;
#endif
}

// One block per (b, h, key tile of 64); blockIdx.x = bh * ntiles + tile. Loops over the query tiles that can
// see the key tile; a warp owns 16 keys and forms the transposed scores S^T = K_w Q^T and dP^T = V_w dout^T.
// dV_s = sum_t P_ts dout_t, dK_s = sum_t dS_ts q_t.
// kRegs: S^T and dP^T stay in accumulator fragments (32 queries at a time at D <= 64, else 16), each lane forms P and
// dS of its elements, rounded into the matrix_a fragments of P^T dout and dS^T Q.
// kAsync (bf16 qkv and dout, 16-byte aligned): the query tiles (Q, dout, lse, drow) double-buffered with asynchronous
// copies, as ForKeyTiles does for the key tiles; with kRegs the second buffers lie in the fp32 area (grown to hold
// them at D > 64: DkDvFBytes), and the key and value rows are staged in them while the first query tile's copies fly.
// kFullD (the launcher's choice for the training path's instance at D == kMaxD <= 64, as the forward's): the
// products' loops over D's fragments with compile-time bounds — on sm_90 (and the emulator) only: sm_90's SASS then
// has no branch between the k-steps of S^T, dP^T, P^T dout and dS^T Q, where the run-time bounds made every 4 HMMA
// wait behind a branch for the 2 LDSM before them; 212 -> 246 registers, still 2 blocks per SM. On sm_80 the
// instance keeps the run-time bounds: its 3-block launch bound (DkDvMinBlocks) leaves no registers for the loads
// ptxas would hoist. At D = 128, and in the 7-product backward's dQ kernel, fixed bounds made ptxas spill.
template <int kMaxD, typename S, bool kRegs, bool kAsync, bool kFullD = false>
__global__ void __launch_bounds__(kThreads, DkDvMinBlocks<kMaxD, kRegs, kAsync>())
    attention_dkdv_tc_kernel(float* dqkv, __nv_bfloat16* dqkv16, float* dbias_part, const S* dout, const S* qkv,
                             const float* qkv_bias, const float* lse, const float* drow, int T, int H, int D,
                             int window, int ntiles, float scale, __nv_bfloat16* ds_tiles, int ds_w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  constexpr bool kFixed = false;
#else
  constexpr bool kFixed = kFullD;
#endif
  const int dp = kFixed ? kMaxD : D;  // the products' D
  constexpr bool kOperandsShared = DkDvOperandsShared(kMaxD);
  MS_DYNAMIC_SHARED(__nv_bfloat16, smem);
  const int ld = LdH(D);
  __nv_bfloat16* const Qs = smem;
  __nv_bfloat16* const Gs = Qs + kRows * ld;
  __nv_bfloat16* const Ps = Gs + kRows * ld;
  __nv_bfloat16* const Ds = Ps + PAreaElems(kRegs);
  float* const Ls = reinterpret_cast<float*>(Ds + PAreaElems(kRegs));
  float* const Rs = Ls + kRows;
  float* const Fs = Rs + kRows;
  // kOperandsShared: the K and V tiles stay here (else they are staged through Q, dout and kept in registers).
  __nv_bfloat16* const KVs = reinterpret_cast<__nv_bfloat16*>(Fs + DkDvFBytes(kRegs, kAsync, D) / sizeof(float));
  // kAsync: the second Q, dout, lse and drow (in the fp32 area with the register softmax, DkDvFBytes, else after
  // KVs) and the q bias.
  constexpr bool second_in_f = kRegs;
  __nv_bfloat16* const Q1 =
      second_in_f ? reinterpret_cast<__nv_bfloat16*>(Fs) : KVs + (kOperandsShared ? 2 * kRows * ld : 0);
  float* const L1 = reinterpret_cast<float*>(Q1 + 2 * kRows * ld);
  float* const Bs =
      second_in_f ? reinterpret_cast<float*>(KVs + (kOperandsShared ? 2 * kRows * ld : 0)) : L1 + 2 * kRows;
  // Buffer b of each (selected by a condition: an array indexed at run time would live in local memory).
  auto Qb = [&](int b) { return kAsync && b ? Q1 : Qs; };
  auto Gb = [&](int b) { return kAsync && b ? Q1 + kRows * ld : Gs; };
  auto Lb = [&](int b) { return kAsync && b ? L1 : Ls; };
  auto Rb = [&](int b) { return kAsync && b ? L1 + kRows : Rs; };

  const int bh = blockIdx.x / ntiles, kt = blockIdx.x % ntiles;
  const int b = bh / H, h = bh % H;
  const HeadRowsT<S> hr = HeadRowsOf(qkv, dout, b, h, T, H, D);
  const long row = hr.row, orow = hr.orow;
  const S *q = hr.q, *k = hr.k, *v = hr.v, *g = hr.g;
  const HeadBias hb = HeadBiasOf(qkv_bias, h, H, D);
  const float* lse_bh = lse + static_cast<long>(bh) * T;
  const float* drow_bh = drow + static_cast<long>(bh) * T;
  const float scale2 = scale * kLog2e;  // kRegs: the base-2 softmax
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int k0 = kt * kRows, k1 = min(k0 + kRows, T);
  const int ja = k0 + warp * kWarpRows, jb = min(ja + kWarpRows, T) - 1;  // this warp's keys; none if jb < ja
  __nv_bfloat16* const Pw = Ps + warp * kWarpRows * kLdP;
  __nv_bfloat16* const Dw = Ds + warp * kWarpRows * kLdP;
  float* const Fw = Fs + warp * kWarpRows * kLdSdP;
  const int r = lane / 2, half = lane % 2, s_key = ja + r;  // the lane's key
  // The stored-dS backward: the dS^T tile of (kt, it) is tile ds_it0 + it of ds_tiles. (An int, the pointer formed
  // at each use: a pointer held across the loop made the shared-memory instance at D = 128 spill.)
  const int ds_it0 = ds_tiles ? static_cast<int>(DsTileOffset(bh, kt, kt, ntiles, ds_w) / kDsTileElems) - kt : 0;

  // Queries that see a key of [k0, k1): t in [k0, k1 - 1 + window - 1] (window > 0), else [k0, T).
  const int t_hi = window > 0 ? min(T - 1, k1 - 2 + window) : T - 1;
  const int it_lo = k0 / kRows, it_hi = t_hi / kRows;
  // kAsync: this thread's copies of query tile `it` (Q, dout, lse, drow) into buffer `buf`; rows past T zeroed.
  auto issue = [&](int it, int buf) {
    if constexpr (kAsync) {
      const int i0 = it * kRows;
      IssueTileAsync(Qb(buf), ld, q, row, i0, T, D);
      IssueTileAsync(Gb(buf), ld, g, orow, i0, T, D);
      for (int i = threadIdx.x; i < kRows; i += kThreads) {
        if (i0 + i < T) {
          __pipeline_memcpy_async(Lb(buf) + i, lse_bh + i0 + i, sizeof(float));
          __pipeline_memcpy_async(Rb(buf) + i, drow_bh + i0 + i, sizeof(float));
        } else {
          Lb(buf)[i] = 0.0f;
          Rb(buf)[i] = 0.0f;
        }
      }
    }
  };
  if constexpr (kAsync) {
    StageBias(Bs, hb.q, D);
    issue(it_lo, 0);
    __pipeline_commit();
  }

  // The warp's key and value rows: resident in shared memory (kOperandsShared), or as fragments staged
  // through the Q and dout areas (kAsync: the second ones).
  __nv_bfloat16* const Kt = kOperandsShared ? KVs : Qb(kAsync ? 1 : 0);
  __nv_bfloat16* const Vt = kOperandsShared ? KVs + kRows * ld : Gb(kAsync ? 1 : 0);
  const __nv_bfloat16* const Kw = Kt + warp * kWarpRows * ld;
  const __nv_bfloat16* const Vw = Vt + warp * kWarpRows * ld;
  LoadTilesBf16<kMaxD, S>({Kt, k, hb.k, row}, {Vt, v, hb.v, row}, ld, k0, T, D);
  __syncthreads();
  FragA kf[kOperandsShared ? 1 : kMaxD / kF], vf[kOperandsShared ? 1 : kMaxD / kF];
  FragC dk[kMaxD / kF], dv[kMaxD / kF];
  MS_UNROLL
  for (int f = 0; f < kMaxD / kF; ++f) {
    wmma::fill_fragment(dk[f], 0.0f);
    wmma::fill_fragment(dv[f], 0.0f);
    if constexpr (!kOperandsShared) {
      if (f * kF >= D) continue;
      LoadFrag(kf[f], Kw + f * kF, ld);
      LoadFrag(vf[f], Vw + f * kF, ld);
    }
  }

  for (int it = it_lo; it <= it_hi; ++it) {
    const int i0 = it * kRows;
    int cur = 0;
    __syncthreads();  // the staging and the previous Q, dout, lse, drow are no longer read
    if constexpr (kAsync) {
      cur = (it - it_lo) & 1;
      if (it < it_hi) issue(it + 1, cur ^ 1);
      __pipeline_commit();
      __pipeline_wait_prior(1);  // this thread's copies of query tile `it` have landed
      AddBiasOwnChunks(Qb(cur), ld, hb.q ? Bs : nullptr, i0, T, D);
    } else {
      LoadTilesBf16<kMaxD, S>({Qs, q, hb.q, row}, {Gs, g, nullptr, orow}, ld, i0, T, D);
      for (int i = threadIdx.x; i < kRows; i += kThreads) {
        Ls[i] = i0 + i < T ? lse_bh[i0 + i] : 0.0f;
        Rs[i] = i0 + i < T ? drow_bh[i0 + i] : 0.0f;
      }
    }
    __syncthreads();
    // The warp's 16 rows of the (kt, it) tile.
    __nv_bfloat16* const dst_tile =
        ds_tiles ? ds_tiles + static_cast<long>(ds_it0 + it) * kDsTileElems + warp * kWarpRows * kRows : nullptr;
    if (jb < ja || !Meets(i0, i0 + kRows - 1, ja, jb, window)) {  // warp-uniform
      if (dst_tile) StoreDsRows(dst_tile, nullptr, 0);            // the dQ kernel reads whole tiles
      continue;
    }
    const __nv_bfloat16* const Qc = Qb(cur);
    const __nv_bfloat16* const Gc = Gb(cur);
    const float* const Lc = Lb(cur);
    const float* const Rc = Rb(cur);

    if constexpr (kRegs) {
      constexpr int kN = kOperandsShared ? 1 : 2;  // S^T and dP^T fragments at a time (D > 64: 1, or sm_90 spills)
      // masked false: the warp's 16 keys all exist and every query of the tile (all before T) sees each of them
      // (warp-uniform).
      auto tile = [&](auto masked) {
        MS_UNROLL
        for (int n0 = 0; n0 < kTileFrags; n0 += kN) {
          FragC sc[kN], dpc[kN];
          RowsTimesTileTFrags<kMaxD, kOperandsShared>(sc, n0, kf, Kw, Qc, ld, dp);   // S^T
          RowsTimesTileTFrags<kMaxD, kOperandsShared>(dpc, n0, vf, Vw, Gc, ld, dp);  // dP^T
          // P^T and dS^T rounded to bf16 in matrix_a fragments (FragLayoutsHold): the left operands of dV and dK.
          FragA pt[kN], dst[kN];
          MS_UNROLL
          for (int j = 0; j < kN; ++j) {
            MS_UNROLL
            for (int i = 0; i < kAccElems; ++i) {
              const int sk = ja + AccRow(lane, i), c = (n0 + j) * kF + AccCol(lane, i), t = i0 + c;
              const bool seen = !decltype(masked)::value || (t < T && sk <= jb && Sees(t, sk, window));
              const float p = seen ? exp2f(sc[j].x[i] * scale2 - Lc[c] * kLog2e) : 0.0f;
              pt[j].x[i] = __float2bfloat16(p);
              dst[j].x[i] = __float2bfloat16(seen ? p * (dpc[j].x[i] - Rc[c]) * scale : 0.0f);
            }
          }
          if (dst_tile) {  // x[i] and x[i + 1] (i even) lie in one row, adjacent columns, on both mappings
            MS_UNROLL
            for (int j = 0; j < kN; ++j) {
              MS_UNROLL
              for (int i = 0; i < kAccElems; i += 2) {
                StorePairBf16(dst_tile + AccRow(lane, i) * kRows + (n0 + j) * kF + AccCol(lane, i), dst[j].x[i],
                              dst[j].x[i + 1]);
              }
            }
          }
          MS_UNROLL
          for (int j = 0; j < kN; ++j) {
            AddATimesTileRows<kMaxD>(dv, pt[j], Gc, n0 + j, ld, dp);
            AddATimesTileRows<kMaxD>(dk, dst[j], Qc, n0 + j, ld, dp);
          }
        }
      };
      if (jb == ja + kWarpRows - 1 && i0 + kRows <= T && SeesAll(i0, i0 + kRows - 1, ja, jb, window)) {
        tile(std::false_type{});
      } else {
        tile(std::true_type{});
      }
    } else {
      RowsTimesTileT<kMaxD, kOperandsShared>(Fw, kLdSdP, kf, Kw, Qc, ld, D);          // S^T
      RowsTimesTileT<kMaxD, kOperandsShared>(Fw + kRows, kLdSdP, vf, Vw, Gc, ld, D);  // dP^T
      __syncwarp();
      const float* s = Fw + r * kLdSdP + 32 * half;
      const float* dp = s + kRows;
      __nv_bfloat16* const pr = Pw + r * kLdP + 32 * half;
      __nv_bfloat16* const dsr = Dw + r * kLdP + 32 * half;
      for (int i = 0; i < 32; ++i) {
        const int c = 32 * half + i, t = i0 + c;
        const bool seen = t < T && s_key <= jb && Sees(t, s_key, window);
        const float p = seen ? expf(s[i] * scale - Lc[c]) : 0.0f;
        pr[i] = __float2bfloat16(p);
        dsr[i] = __float2bfloat16(seen ? p * (dp[i] - Rc[c]) * scale : 0.0f);
      }
      __syncwarp();
      if (dst_tile) StoreDsRows(dst_tile, Dw, kLdP);
      PTimesTile<kMaxD>(dv, Pw, Gc, ld, D);
      PTimesTile<kMaxD>(dk, Dw, Qc, ld, D);
      __syncwarp();  // P and dS are read before the next tile's
    }
  }
  if (kAsync && second_in_f) __syncthreads();  // the last tile may lie in the fp32 area, written next

  if (jb < ja) return;
  const long kbase = static_cast<long>(b) * T * row + static_cast<long>(H + h) * D,
             vbase = kbase + static_cast<long>(H) * D;
  StoreFragRows<kMaxD>(dqkv ? dqkv + kbase : nullptr, dqkv16 ? dqkv16 + kbase : nullptr,
                       BiasPart(dbias_part, b, ja, T, 1, h, H, D), row, Fw, kLdSdP, dk, ja, T, D);
  StoreFragRows<kMaxD>(dqkv ? dqkv + vbase : nullptr, dqkv16 ? dqkv16 + vbase : nullptr,
                       BiasPart(dbias_part, b, ja, T, 2, h, H, D), row, Fw, kLdSdP, dv, ja, T, D);
}

// The stored-dS dQ kernel: dQ = sum over the key tiles kt of dS_{qt,kt} K_kt, from the dS^T tiles the dK/dV kernel
// stored (DsTileOffset) — one product per pair where attention_dq_tc_kernel forms S, dP and dS again first. One block
// per (b, h, query tile), the heads in reverse order (the query tiles longest first, as attention_dq_tc_kernel); each
// warp takes its 16 query columns of each dS^T tile as a col_major matrix_a fragment and multiplies it into the K
// tile's rows as that kernel does (AddATimesTileRows for the 4 key fragments in turn: the same products in the same
// order, so where both kernels round dS alike — the register softmax — the same dQ). Shared memory: K [64][D + 8] and
// dS^T [64][72] (bf16), twice with kAsync (the next pair's copies in flight), then the k bias (kAsync with a bias);
// after the loop the per-warp fp32 output rows [16][kMaxD + 4] overlay them.
template <int kMaxD, bool kAsync>
__host__ __device__ constexpr size_t DqDsTileBytes(int D) {
  return (kAsync ? 2 : 1) * sizeof(__nv_bfloat16) * kRows * (LdH(D) + kLdP);
}
template <int kMaxD, bool kAsync>
size_t DqDsTcSharedBytes(int D) {
  const size_t tiles = DqDsTileBytes<kMaxD, kAsync>(D) + (kAsync ? sizeof(float) * kMaxD : 0),
               rows = sizeof(float) * kWarps * kWarpRows * (kMaxD + kPadF);
  return tiles > rows ? tiles : rows;
}

// kFullD (the launcher's choice at D == kMaxD <= 64 with asynchronous copies, as the dK/dV kernel's): dS K's loop
// over D's fragments with compile-time bounds, on sm_90 (and the emulator) only (sm_90 SASS: no branch between the
// column fragments, which made every 2 HMMA wait for the LDSM before them; 72 -> 64 registers). On sm_80 it spilled
// 8 bytes, and at D = 128 it took 130 registers on sm_90 (122: 4 -> 3 blocks per SM), so those keep run-time bounds.
template <int kMaxD, typename S, bool kAsync, bool kFullD = false>
__global__ void __launch_bounds__(kThreads)
    attention_dq_ds_tc_kernel(float* dqkv, __nv_bfloat16* dqkv16, float* dbias_part, const S* qkv,
                              const float* qkv_bias, const __nv_bfloat16* ds_tiles, int ds_w, int T, int H, int D,
                              int window, int ntiles) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  constexpr bool kFixed = false;
#else
  constexpr bool kFixed = kFullD;
#endif
  MS_DYNAMIC_SHARED(__nv_bfloat16, smem);
  const int ld = LdH(D);
  __nv_bfloat16* const K0 = smem;
  __nv_bfloat16* const S0 = K0 + kRows * ld;
  __nv_bfloat16* const K1 = S0 + kRows * kLdP;  // kAsync
  __nv_bfloat16* const S1 = K1 + kRows * ld;
  float* const Bs = reinterpret_cast<float*>(smem + DqDsTileBytes<kMaxD, kAsync>(D) / sizeof(__nv_bfloat16));
  auto Kb = [&](int b) { return kAsync && b ? K1 : K0; };
  auto Sb = [&](int b) { return kAsync && b ? S1 : S0; };

  // Heads in reverse: the dK/dV kernel ran them in order, so the last heads' tiles are the ones still in L2 (tens of
  // MB: a few dozen heads at GPT-2 small) when this kernel starts. Which block takes which head changes no result.
  const int bh = static_cast<int>(gridDim.x) / ntiles - 1 - static_cast<int>(blockIdx.x / ntiles),
            qt = ntiles - 1 - static_cast<int>(blockIdx.x % ntiles);
  const int b = bh / H, h = bh % H;
  const HeadRowsT<S> hr = HeadRowsOf(qkv, static_cast<const S*>(nullptr), b, h, T, H, D);
  const long row = hr.row;
  const S* const k = hr.k;
  const float* const bk = HeadBiasOf(qkv_bias, h, H, D).k;
  const int warp = threadIdx.x / 32;
  const int q0 = qt * kRows, ra = q0 + warp * kWarpRows, rb = min(ra + kWarpRows, T) - 1;
  const int kt_lo = FirstKeyTile(q0, window), kt_hi = qt;
  auto ds_of = [&](int kt) { return ds_tiles + DsTileOffset(bh, kt, qt, ntiles, ds_w); };
  // kAsync: this thread's copies of key tile kt's K rows and dS^T tile into buffer `buf` (K rows past T zeroed; the
  // dS^T tile is whole).
  auto issue = [&](int kt, int buf) {
    if constexpr (kAsync) {
      IssueTileAsync(Kb(buf), ld, k, row, kt * kRows, T, D);
      IssueTileAsync(Sb(buf), kLdP, ds_of(kt), kRows, 0, kRows, kRows);
    }
  };
  if constexpr (kAsync) {
    static_assert(std::is_same_v<S, __nv_bfloat16>, "asynchronous copies move bf16 rows");
    StageBias(Bs, bk, D);
    issue(kt_lo, 0);
    __pipeline_commit();
  }

  FragC dq[kMaxD / kF];
  MS_UNROLL
  for (int f = 0; f < kMaxD / kF; ++f) wmma::fill_fragment(dq[f], 0.0f);
  for (int kt = kt_lo; kt <= kt_hi; ++kt) {
    const int k0 = kt * kRows;
    int cur = 0;
    __syncthreads();  // the previous tiles are no longer read
    if constexpr (kAsync) {
      cur = (kt - kt_lo) & 1;
      if (kt < kt_hi) issue(kt + 1, cur ^ 1);
      __pipeline_commit();
      __pipeline_wait_prior(1);  // this thread's copies of tile kt have landed
      AddBiasOwnChunks(Kb(cur), ld, bk ? Bs : nullptr, k0, T, D);
    } else {
      LoadTileBf16(K0, ld, k, bk, row, k0, T, D);
      const __nv_bfloat16* const src = ds_of(kt);
      for (int i = threadIdx.x; i < kRows * kRows / 8; i += kThreads) {
        const int r = i / (kRows / 8), c = 8 * (i % (kRows / 8));
        *reinterpret_cast<uint4*>(S0 + r * kLdP + c) = *reinterpret_cast<const uint4*>(src + r * kRows + c);
      }
    }
    __syncthreads();
    if (rb < ra || !Meets(ra, rb, k0, k0 + kRows - 1, window)) continue;  // warp-uniform
    const __nv_bfloat16* const Ks = Kb(cur);
    const __nv_bfloat16* const St = Sb(cur) + warp * kWarpRows;  // the warp's query columns
    MS_UNROLL
    for (int n = 0; n < kTileFrags; ++n) {
      FragACol a;  // dS[ra .. ra + 15][k0 + 16 n ..] = dS^T[16 n ..][the warp's columns]
      LoadFrag(a, St + n * kF * kLdP, kLdP);
      AddATimesTileRows<kMaxD>(dq, a, Ks, n, ld, kFixed ? kMaxD : D);
    }
  }
  __syncthreads();  // the output rows overlay the tiles

  if (rb < ra) return;
  float* const Fw = reinterpret_cast<float*>(smem) + warp * kWarpRows * (kMaxD + kPadF);
  const long qbase = static_cast<long>(b) * T * row + static_cast<long>(h) * D;
  StoreFragRows<kMaxD>(dqkv ? dqkv + qbase : nullptr, dqkv16 ? dqkv16 + qbase : nullptr,
                       BiasPart(dbias_part, b, ra, T, 0, h, H, D), row, Fw, kMaxD + kPadF, dq, ra, T, D);
}

// ---- the split dK/dV kernel (SetAttentionTcSplitDkDv): 8 warps, dK and dV split by columns ----
// attention_dkdv_tc_kernel gives each of its 4 warps 16 keys with their whole dK and dV rows in accumulator fragments
// (16 x D each) beside the S^T and dP^T fragments and their key and value operands: 218 registers at D = 64, 2 blocks
// per SM, 12.5 % occupancy on an H200 (Nsight Compute, docs/PERFORMANCE.md). Here, as in FlashAttention-2's backward,
// a block of 64 keys has 8 warps: warp w takes the 16 keys of row group w % 4 and the half w / 4 — the query columns
// 32 half .. + 31 of each query tile for S^T, dP^T, P^T and dS^T, and the head columns D / 2 half .. + D / 2 - 1 of dK
// and dV. Per query tile each warp forms S^T and dP^T of its 16 keys x 32 queries (key and value rows read from
// shared memory), rounds P^T and dS^T to bf16 into the block's [64][72] P^T and dS^T tiles in shared memory (lane by
// lane, AccRow / AccCol: the register softmax's layout, FragLayoutsHold), and after a barrier multiplies its row
// group's 16 x 64 P^T and dS^T (4 matrix_a fragments each) into its half of the dout and Q tiles: dV and dK are
// 16 x D / 2 per warp, half the accumulators, and each warp makes half the products of the 4-warp kernel's per
// tile. The dS^T tile, whole in shared memory after that barrier, is copied to ds_tiles in 16-byte rows (zeros where
// a row group skips the pair). The same products as attention_dkdv_tc_kernel's register softmax in the same order
// per output fragment (S^T summed over d in order, dV and dK over the query fragments 0..3 in order), so the same
// bits. For the training path only: bf16 qkv and dout with 16-byte aligned rows (the query tiles double-buffered
// with asynchronous copies), the layout probe holding, D a multiple of 32. Shared memory: Q, dout (two buffers each),
// K, V [64][D + 8], P^T, dS^T [64][72] (bf16), lse, drow (two each, 64 floats), the q bias (kMaxD floats); after the
// loop the per-warp fp32 output rows [16][kMaxD / 2 + 4] overlay the start. 73.3 KiB at D = 64 (2 blocks of 8 warps
// per SM), 121.5 KiB at D = 128 (1).
namespace {
constexpr int kSplitWarps = 2 * kWarps;
constexpr int kSplitThreads = kSplitWarps * 32;
constexpr int kSplitCols = kRows / 2;  // query columns of a tile per warp
template <int kMaxD>
size_t DkDvSplitSharedBytes(int D) {
  return sizeof(__nv_bfloat16) * (6 * kRows * LdH(D) + 2 * kRows * kLdP) + sizeof(float) * (4 * kRows + kMaxD);
}
}  // namespace

template <int kMaxD>
__global__ void __launch_bounds__(kSplitThreads, kMaxD <= 64 ? 2 : 1)
    attention_dkdv_split_tc_kernel(float* dqkv, __nv_bfloat16* dqkv16, float* dbias_part, const __nv_bfloat16* dout,
                                   const __nv_bfloat16* qkv, const float* qkv_bias, const float* lse, const float* drow,
                                   int T, int H, int D, int window, int ntiles, float scale, __nv_bfloat16* ds_tiles,
                                   int ds_w) {
  using S = __nv_bfloat16;
  constexpr int kHalfD = kMaxD / 2;
  // S^T and dP^T fragments at a time, of the warp's 2 (its 32 queries): 1 at D <= 64, where 2 made ptxas spill
  // (sm_90: 16 bytes) in the 128 registers 2 blocks of 8 warps per SM allow (with 1: 102 / 126 on sm_80 / sm_90).
  constexpr int kN = kMaxD <= 64 ? 1 : kSplitCols / kF;
  // Fragments by ldmatrix (LoadFrag), but at D <= 64 on sm_80 by wmma's own loads: there ldmatrix's took ptxas from
  // 102 registers to the bound's 128 and 12 bytes of spill (CUDA 13; sm_90: 126 -> 128, no spill).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  constexpr bool kLdsm = kMaxD > 64;
#else
  constexpr bool kLdsm = true;
#endif
  MS_DYNAMIC_SHARED(__nv_bfloat16, smem);
  const int ld = LdH(D), hd = D / 2;
  __nv_bfloat16* const Q0 = smem;
  __nv_bfloat16* const G0 = Q0 + kRows * ld;
  __nv_bfloat16* const Q1 = G0 + kRows * ld;
  __nv_bfloat16* const G1 = Q1 + kRows * ld;
  __nv_bfloat16* const Ks = G1 + kRows * ld;
  __nv_bfloat16* const Vs = Ks + kRows * ld;
  __nv_bfloat16* const Pt = Vs + kRows * ld;
  __nv_bfloat16* const Dt = Pt + kRows * kLdP;
  float* const L0 = reinterpret_cast<float*>(Dt + kRows * kLdP);
  float* const R0 = L0 + kRows;
  float* const L1 = R0 + kRows;
  float* const R1 = L1 + kRows;
  float* const Bs = R1 + kRows;  // the q bias
  // Buffer b of each (selected by a condition: an array indexed at run time would live in local memory).
  auto Qb = [&](int b) { return b ? Q1 : Q0; };
  auto Gb = [&](int b) { return b ? G1 : G0; };
  auto Lb = [&](int b) { return b ? L1 : L0; };
  auto Rb = [&](int b) { return b ? R1 : R0; };

  const int bh = blockIdx.x / ntiles, kt = blockIdx.x % ntiles;
  const int b = bh / H, h = bh % H;
  const HeadRowsT<S> hr = HeadRowsOf(qkv, dout, b, h, T, H, D);
  const long row = hr.row, orow = hr.orow;
  const S *q = hr.q, *k = hr.k, *v = hr.v, *g = hr.g;
  const HeadBias hb = HeadBiasOf(qkv_bias, h, H, D);
  const float* lse_bh = lse + static_cast<long>(bh) * T;
  const float* drow_bh = drow + static_cast<long>(bh) * T;
  const float scale2 = scale * kLog2e;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, rg = warp % kWarps, half = warp / kWarps;
  const int k0 = kt * kRows, k1 = min(k0 + kRows, T);
  const int ja = k0 + rg * kWarpRows, jb = min(ja + kWarpRows, T) - 1;  // the row group's keys; none if jb < ja
  const int c0 = half * kSplitCols;                                     // the warp's query columns of a tile
  const int ds_it0 = ds_tiles ? static_cast<int>(DsTileOffset(bh, kt, kt, ntiles, ds_w) / kDsTileElems) - kt : 0;
  const int t_hi = window > 0 ? min(T - 1, k1 - 2 + window) : T - 1;
  const int it_lo = k0 / kRows, it_hi = t_hi / kRows;
  // This thread's copies of query tile `it` (Q, dout, lse, drow) into buffer `buf`; rows past T zeroed.
  auto issue = [&](int it, int buf) {
    IssueQueryTileAsync<kSplitThreads>(Qb(buf), Gb(buf), Lb(buf), Rb(buf), ld, q, g, row, orow, lse_bh, drow_bh,
                                       it * kRows, T, D);
  };
  StageBias<kSplitThreads>(Bs, hb.q, D);
  issue(it_lo, 0);
  __pipeline_commit();
  LoadTilesBf16<kMaxD, S, kSplitThreads>({Ks, k, hb.k, row}, {Vs, v, hb.v, row}, ld, k0, T, D);  // published below
  const __nv_bfloat16* const Kw = Ks + rg * kWarpRows * ld;
  const __nv_bfloat16* const Vw = Vs + rg * kWarpRows * ld;
  __nv_bfloat16* const Pw = Pt + rg * kWarpRows * kLdP;  // the row group's 16 rows of P^T and dS^T
  __nv_bfloat16* const Dw = Dt + rg * kWarpRows * kLdP;
  FragC dk[kHalfD / kF], dv[kHalfD / kF];
  MS_UNROLL
  for (int f = 0; f < kHalfD / kF; ++f) {
    wmma::fill_fragment(dk[f], 0.0f);
    wmma::fill_fragment(dv[f], 0.0f);
  }

  for (int it = it_lo; it <= it_hi; ++it) {
    const int i0 = it * kRows, cur = (it - it_lo) & 1;
    __syncthreads();  // K, V and the bias published; the previous tile's buffers, P^T and dS^T no longer read
    if (it < it_hi) issue(it + 1, cur ^ 1);
    __pipeline_commit();
    __pipeline_wait_prior(1);  // this thread's copies of query tile `it` have landed
    AddBiasOwnChunks<kSplitThreads>(Qb(cur), ld, hb.q ? Bs : nullptr, i0, T, D);
    __syncthreads();
    const __nv_bfloat16* const Qc = Qb(cur);
    const __nv_bfloat16* const Gc = Gb(cur);
    const float* const Lc = Lb(cur);
    const float* const Rc = Rb(cur);
    const bool active = jb >= ja && Meets(i0, i0 + kRows - 1, ja, jb, window);  // uniform over the row group
    if (active) {
      // masked false: the row group's 16 keys all exist and each of the warp's 32 queries (all before T) sees them.
      auto tile = [&](auto masked) {
        MS_UNROLL
        for (int j0 = 0; j0 < kSplitCols / kF; j0 += kN) {
          FragC sc[kN], dpc[kN];
          RowsTimesTileTFrags<kMaxD, true, kN, kLdsm>(sc, c0 / kF + j0, nullptr, Kw, Qc, ld, D);   // S^T
          RowsTimesTileTFrags<kMaxD, true, kN, kLdsm>(dpc, c0 / kF + j0, nullptr, Vw, Gc, ld, D);  // dP^T
          MS_UNROLL
          for (int j = 0; j < kN; ++j) {
            MS_UNROLL
            for (int i = 0; i < kAccElems; i += 2) {  // x[i] and x[i + 1] (i even): one row, adjacent columns
              const int sk = ja + AccRow(lane, i), c = c0 + (j0 + j) * kF + AccCol(lane, i);
              __nv_bfloat16 p2[2], d2[2];
              MS_UNROLL
              for (int e = 0; e < 2; ++e) {
                const int t = i0 + c + e;
                const bool seen = !decltype(masked)::value || (t < T && sk <= jb && Sees(t, sk, window));
                const float p = seen ? exp2f(sc[j].x[i + e] * scale2 - Lc[c + e] * kLog2e) : 0.0f;
                p2[e] = __float2bfloat16(p);
                d2[e] = __float2bfloat16(seen ? p * (dpc[j].x[i + e] - Rc[c + e]) * scale : 0.0f);
              }
              const int at = AccRow(lane, i) * kLdP + c;
              StorePairBf16(Pw + at, p2[0], p2[1]);
              StorePairBf16(Dw + at, d2[0], d2[1]);
            }
          }
        }
      };
      if (jb == ja + kWarpRows - 1 && i0 + c0 + kSplitCols <= T &&
          SeesAll(i0 + c0, i0 + c0 + kSplitCols - 1, ja, jb, window)) {
        tile(std::false_type{});
      } else {
        tile(std::true_type{});
      }
    } else if (ds_tiles) {  // the dQ kernel reads whole tiles: zeros for the row group's rows
      for (int i = lane; i < kWarpRows * kSplitCols / 8; i += 32) {
        const int r = i / (kSplitCols / 8), c = c0 + 8 * (i % (kSplitCols / 8));
        *reinterpret_cast<uint4*>(Dw + r * kLdP + c) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    __syncthreads();  // P^T and dS^T of the tile complete
    if (ds_tiles) {
      __nv_bfloat16* const dst_tile = ds_tiles + static_cast<long>(ds_it0 + it) * kDsTileElems;
      for (int i = threadIdx.x; i < kRows * kRows / 8; i += kSplitThreads) {
        const int r = i / (kRows / 8), c = 8 * (i % (kRows / 8));
        *reinterpret_cast<uint4*>(dst_tile + r * kRows + c) = *reinterpret_cast<const uint4*>(Dt + r * kLdP + c);
      }
    }
    if (active) {  // dV, then dK (interleaved, ptxas spilled at D = 64 on sm_90: 8-16 bytes)
      MS_UNROLL
      for (int kb = 0; kb < kTileFrags; ++kb) {
        FragA pa;
        LoadFragIf<kLdsm>(pa, Pw + kb * kF, kLdP);
        AddATimesTileRows<kHalfD, kLdsm>(dv, pa, Gc + half * hd, kb, ld, hd);
      }
      MS_UNROLL
      for (int kb = 0; kb < kTileFrags; ++kb) {
        FragA da;
        LoadFragIf<kLdsm>(da, Dw + kb * kF, kLdP);
        AddATimesTileRows<kHalfD, kLdsm>(dk, da, Qc + half * hd, kb, ld, hd);
      }
    }
  }
  __syncthreads();  // the output rows overlay the tiles

  if (jb < ja) return;
  float* const Fw = reinterpret_cast<float*>(smem) + warp * kWarpRows * (kHalfD + kPadF);
  const long kbase = static_cast<long>(b) * T * row + static_cast<long>(H + h) * D + half * hd,
             vbase = kbase + static_cast<long>(H) * D;
  float* const pk = BiasPart(dbias_part, b, ja, T, 1, h, H, D);
  float* const pv = BiasPart(dbias_part, b, ja, T, 2, h, H, D);
  StoreFragRows<kHalfD>(dqkv ? dqkv + kbase : nullptr, dqkv16 ? dqkv16 + kbase : nullptr, pk ? pk + half * hd : nullptr,
                        row, Fw, kHalfD + kPadF, dk, ja, T, hd);
  StoreFragRows<kHalfD>(dqkv ? dqkv + vbase : nullptr, dqkv16 ? dqkv16 + vbase : nullptr, pv ? pv + half * hd : nullptr,
                        row, Fw, kHalfD + kPadF, dv, ja, T, hd);
}

// ---- launchers ----

namespace {
cudaError_t CheckShapeTc(int64_t B, int64_t T, int64_t H, int64_t D, int64_t window, bool* empty,
                         attention_detail::AttentionShape* s) {
  if (D % kF != 0) return cudaErrorInvalidValue;
  return attention_detail::CheckAttentionShape(B, T, H, D, window, kRows, empty, s);
}

// The fragment layout probe: one warp loads the 16 x 16 matrix m[r][c] = 16 r + c into an accumulator fragment (from
// in, fp32) and into a bf16 matrix_a fragment (from in16; 0 .. 255 are exact in bf16) and writes their x[i] to
// out[lane * 8 + i] and out[256 + lane * 8 + i]; FragLayoutsHold compares them with AccRow and AccCol. Then, from a
// copy of in16 in shared memory, each of the four operand kinds (ldsm::FragKind) by wmma::load_matrix_sync and by
// LoadFrag: kind k's x[i] at out[512 + 512 k + lane * 8 + i] (wmma) and 256 further on (LoadFrag).
constexpr int kProbeKinds = 4;
constexpr int kProbeFloats = 2 * 32 * kAccElems + kProbeKinds * 2 * 32 * kAccElems;
template <typename Frag>
__device__ __forceinline__ void ProbeWrite(float* out, const Frag& f, int lane) {
  for (int i = 0; i < kAccElems; ++i) out[lane * kAccElems + i] = i < f.num_elements ? __bfloat162float(f.x[i]) : -1.0f;
}
template <typename Frag>
__device__ __forceinline__ void ProbeKind(float* out, const __nv_bfloat16* tile, int lane) {
  Frag w, l;
  wmma::load_matrix_sync(w, tile, kF);
  LoadFrag(l, tile, kF);
  ProbeWrite(out, w, lane);
  ProbeWrite(out + 32 * kAccElems, l, lane);
}
__global__ void __launch_bounds__(32)
    attention_frag_layout_probe_kernel(float* out, const float* in, const __nv_bfloat16* in16) {
  MS_SHARED_ARRAY(__nv_bfloat16, tile, kF * kF);
  FragC f;
  FragA a;
  wmma::load_matrix_sync(f, in, kF, wmma::mem_row_major);
  wmma::load_matrix_sync(a, in16, kF);
  const int lane = threadIdx.x % 32;
  for (int i = 0; i < kAccElems; ++i) {
    out[lane * kAccElems + i] = i < f.num_elements ? f.x[i] : -1.0f;
    out[32 * kAccElems + lane * kAccElems + i] = i < a.num_elements ? __bfloat162float(a.x[i]) : -1.0f;
  }
  for (int i = lane; i < kF * kF; i += 32) tile[i] = in16[i];
  __syncwarp();
  float* const kinds = out + 2 * 32 * kAccElems;
  constexpr int kStride = 2 * 32 * kAccElems;
  ProbeKind<FragA>(kinds, tile, lane);
  ProbeKind<FragACol>(kinds + kStride, tile, lane);
  ProbeKind<FragBCol>(kinds + 2 * kStride, tile, lane);
  ProbeKind<FragBRow>(kinds + 3 * kStride, tile, lane);
}

std::atomic<int> g_softmax{static_cast<int>(AttentionTcSoftmax::kAuto)};
std::atomic<int> g_layout_holds{-1};  // -1: not probed yet; else bit 0: the AccRow / AccCol layout, bit 1: LoadFrag

// *holds: on the current device, the fp32 accumulator fragments and the bf16 matrix_a fragments hold their elements
// where AccRow and AccCol say — x[i] of both the same element, so the kRegs kernels round their P and dS into
// matrix_a fragments lane by lane (probed on `stream` once per process; the first call synchronizes it). On sm_80
// and sm_90 both are the mma.sync m16n8k16 operand layouts (a 16 x 16 bf16 matrix_a fragment is exactly the A
// operand of the two m16n8k16 products one wmma m16n16k16 makes), as FlashAttention-2 uses them.
// *loads: LoadFrag's fragments (ldmatrix on the device) are wmma::load_matrix_sync's, element for element, for all
// four operand kinds; every tensor-core attention kernel needs it (ForwardTc, BackwardTc).
cudaError_t FragLayoutsHold(cudaStream_t stream, bool* holds, bool* loads = nullptr) {
  int known = g_layout_holds.load();
  if (known < 0) {
    constexpr int kN = kF * kF, kGot = kProbeFloats;
    static_assert(FragA::num_elements == kAccElems, "matrix_a and accumulator fragments hold as many elements");
    float host[kN];
    std::vector<float> got(kGot);
    __nv_bfloat16 host16[kN];
    for (int i = 0; i < kN; ++i) {
      host[i] = static_cast<float>(i);
      host16[i] = __float2bfloat16(host[i]);
    }
    float* dev = nullptr;
    cudaError_t err = cudaMalloc(&dev, sizeof(float) * (kN + kGot) + sizeof(host16));
    if (err != cudaSuccess) return err;
    auto* const dev16 = reinterpret_cast<__nv_bfloat16*>(dev + kN + kGot);
    err = cudaMemcpyAsync(dev, host, sizeof(host), cudaMemcpyHostToDevice, stream);
    if (err == cudaSuccess) err = cudaMemcpyAsync(dev16, host16, sizeof(host16), cudaMemcpyHostToDevice, stream);
    if (err == cudaSuccess) {
      MS_LAUNCH(attention_frag_layout_probe_kernel, 1, 32, 0, stream, dev + kN, dev, dev16);
      err = cudaGetLastError();
    }
    if (err == cudaSuccess)
      err = cudaMemcpyAsync(got.data(), dev + kN, sizeof(float) * kGot, cudaMemcpyDeviceToHost, stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    const cudaError_t freed = cudaFree(dev);
    if (err == cudaSuccess) err = freed;
    if (err != cudaSuccess) return err;
    int layout = 1, ldsm_ok = 1;
    for (int lane = 0; lane < 32; ++lane) {
      for (int i = 0; i < kAccElems; ++i) {
        const float want = static_cast<float>(kF * AccRow(lane, i) + AccCol(lane, i));
        if (got[lane * kAccElems + i] != want || got[32 * kAccElems + lane * kAccElems + i] != want) layout = 0;
        for (int k = 0; k < kProbeKinds; ++k) {
          const float* const w = got.data() + 2 * 32 * kAccElems + k * 2 * 32 * kAccElems;
          if (w[lane * kAccElems + i] != w[32 * kAccElems + lane * kAccElems + i]) ldsm_ok = 0;
        }
      }
    }
    known = layout | (ldsm_ok << 1);
    g_layout_holds.store(known);
  }
  *holds = (known & 1) != 0;
  if (loads) *loads = (known & 2) != 0;
  return cudaSuccess;
}

// cudaErrorNotSupported where LoadFrag's fragments are not wmma's on this device (FragLayoutsHold).
cudaError_t FragLoadsHold(cudaStream_t stream) {
  bool holds = false, loads = false;
  const cudaError_t err = FragLayoutsHold(stream, &holds, &loads);
  if (err != cudaSuccess) return err;
  return loads ? cudaSuccess : cudaErrorNotSupported;
}

// *regs: run the kRegs kernels (SetAttentionTcSoftmax; kAuto: where the layout holds, unless shared_by_default —
// the backward where AttentionTcBackwardSharedByDefault(D), D > 64, where the shared-memory kernels measured faster on
// an H200: 5.11 vs 5.50 ms at B 4, T 2048, H 16, D 128; the register dK/dV kernel then formed S and dP 32 queries at a
// time beside its 128 accumulator registers; measured before P and dS went into matrix_a fragments in registers, and
// it now forms them 16 at a time there).
cudaError_t UseRegisters(cudaStream_t stream, bool shared_by_default, bool* regs) {
  const auto mode = static_cast<AttentionTcSoftmax>(g_softmax.load());
  *regs = false;
  if (mode == AttentionTcSoftmax::kShared || (mode == AttentionTcSoftmax::kAuto && shared_by_default))
    return cudaSuccess;
  bool holds = false;
  const cudaError_t err = FragLayoutsHold(stream, &holds);
  if (err != cudaSuccess) return err;
  if (!holds && mode == AttentionTcSoftmax::kRegisters) return cudaErrorNotSupported;
  *regs = holds;
  return cudaSuccess;
}

template <int kMaxD, typename S, bool kRegs, bool kAsync, bool kFullD>
cudaError_t LaunchForwardKernel(float* out, __nv_bfloat16* out16, float* lse, const S* qkv, const float* qkv_bias,
                                const attention_detail::AttentionShape& s, cudaStream_t stream) {
  const size_t smem = ForwardTcSharedBytes<kMaxD, kRegs, kAsync>(s.D);
  cudaError_t err = AllowSharedBytes(attention_forward_tc_kernel<kMaxD, S, kRegs, kAsync, kFullD>, smem);
  if (err != cudaSuccess) return err;
  MS_LAUNCH((attention_forward_tc_kernel<kMaxD, S, kRegs, kAsync, kFullD>), s.blocks, kThreads, smem, stream, out,
            out16, lse, qkv, qkv_bias, s.T, s.H, s.D, s.window, s.ntiles, s.scale);
  return cudaGetLastError();
}

std::atomic<bool> g_fixed_bounds{true};    // SetAttentionTcFixedBounds
std::atomic<int64_t> g_fixed_launches{0};  // AttentionTcFixedBoundsLaunches

// The kFullD instance for the training path's kernel (register softmax, asynchronous copies) where D == kMaxD
// (unless SetAttentionTcFixedBounds(false)).
template <int kMaxD, typename S, bool kRegs, bool kAsync>
cudaError_t LaunchForward(float* out, __nv_bfloat16* out16, float* lse, const S* qkv, const float* qkv_bias,
                          const attention_detail::AttentionShape& s, cudaStream_t stream) {
  if constexpr (kRegs && kAsync) {
    if (s.D == kMaxD && g_fixed_bounds.load()) {
      g_fixed_launches.fetch_add(1);
      return LaunchForwardKernel<kMaxD, S, kRegs, kAsync, true>(out, out16, lse, qkv, qkv_bias, s, stream);
    }
  }
  return LaunchForwardKernel<kMaxD, S, kRegs, kAsync, false>(out, out16, lse, qkv, qkv_bias, s, stream);
}

template <int kMaxD, typename S, bool kRegs, bool kAsync, bool kFullD>
cudaError_t LaunchDkDvKernel(float* dqkv, __nv_bfloat16* dqkv16, float* dbias_part, const float* drow, const S* dout,
                             const S* qkv, const float* qkv_bias, const float* lse, __nv_bfloat16* ds_tiles, int ds_w,
                             const attention_detail::AttentionShape& s, cudaStream_t stream) {
  const size_t smem = DkDvTcSharedBytes<kMaxD, kRegs, kAsync>(s.D);
  cudaError_t err = AllowSharedBytes(attention_dkdv_tc_kernel<kMaxD, S, kRegs, kAsync, kFullD>, smem);
  if (err != cudaSuccess) return err;
  MS_LAUNCH((attention_dkdv_tc_kernel<kMaxD, S, kRegs, kAsync, kFullD>), s.blocks, kThreads, smem, stream, dqkv, dqkv16,
            dbias_part, dout, qkv, qkv_bias, lse, drow, s.T, s.H, s.D, s.window, s.ntiles, s.scale, ds_tiles, ds_w);
  return cudaGetLastError();
}

// The 4-warp dK/dV kernel, its kFullD instance for the training path's kernel at D == kMaxD <= 64 (unless
// SetAttentionTcFixedBounds(false)).
template <int kMaxD, typename S, bool kRegs, bool kAsync>
cudaError_t LaunchDkDv(float* dqkv, __nv_bfloat16* dqkv16, float* dbias_part, const float* drow, const S* dout,
                       const S* qkv, const float* qkv_bias, const float* lse, __nv_bfloat16* ds_tiles, int ds_w,
                       const attention_detail::AttentionShape& s, cudaStream_t stream) {
  if constexpr (kRegs && kAsync && kMaxD <= 64) {
    if (s.D == kMaxD && g_fixed_bounds.load()) {
      g_fixed_launches.fetch_add(1);
      return LaunchDkDvKernel<kMaxD, S, kRegs, kAsync, true>(dqkv, dqkv16, dbias_part, drow, dout, qkv, qkv_bias, lse,
                                                             ds_tiles, ds_w, s, stream);
    }
  }
  return LaunchDkDvKernel<kMaxD, S, kRegs, kAsync, false>(dqkv, dqkv16, dbias_part, drow, dout, qkv, qkv_bias, lse,
                                                          ds_tiles, ds_w, s, stream);
}

template <int kMaxD, typename S, bool kAsync, bool kFullD>
cudaError_t LaunchDqDsKernel(float* dqkv, __nv_bfloat16* dqkv16, float* dbias_part, const S* qkv, const float* qkv_bias,
                             const __nv_bfloat16* ds_tiles, int ds_w, const attention_detail::AttentionShape& s,
                             cudaStream_t stream) {
  const size_t smem = DqDsTcSharedBytes<kMaxD, kAsync>(s.D);
  cudaError_t err = AllowSharedBytes(attention_dq_ds_tc_kernel<kMaxD, S, kAsync, kFullD>, smem);
  if (err != cudaSuccess) return err;
  MS_LAUNCH((attention_dq_ds_tc_kernel<kMaxD, S, kAsync, kFullD>), s.blocks, kThreads, smem, stream, dqkv, dqkv16,
            dbias_part, qkv, qkv_bias, ds_tiles, ds_w, s.T, s.H, s.D, s.window, s.ntiles);
  return cudaGetLastError();
}

// split: the dK/dV kernel is attention_dkdv_split_tc_kernel (bf16 operands, kAsync; the caller checks the rest).
// The stored-dS dQ kernel: its kFullD instance at D == kMaxD <= 64 with asynchronous copies (unless
// SetAttentionTcFixedBounds(false)).
template <int kMaxD, typename S, bool kRegs, bool kAsync>
cudaError_t LaunchBackward(float* dqkv, __nv_bfloat16* dqkv16, float* dbias_part, const float* drow, const S* dout,
                           const S* qkv, const float* qkv_bias, const float* lse, __nv_bfloat16* ds_tiles, bool split,
                           const attention_detail::AttentionShape& s, cudaStream_t stream) {
  const int ds_w = DsTilesPerKey(s.ntiles, s.window);
  cudaError_t err = cudaSuccess;
  if constexpr (std::is_same_v<S, __nv_bfloat16> && kAsync) {
    if (split) {
      const size_t smem = DkDvSplitSharedBytes<kMaxD>(s.D);
      if ((err = AllowSharedBytes(attention_dkdv_split_tc_kernel<kMaxD>, smem)) != cudaSuccess) return err;
      MS_LAUNCH((attention_dkdv_split_tc_kernel<kMaxD>), s.blocks, kSplitThreads, smem, stream, dqkv, dqkv16,
                dbias_part, dout, qkv, qkv_bias, lse, drow, s.T, s.H, s.D, s.window, s.ntiles, s.scale, ds_tiles, ds_w);
    }
  }
  if (!split && (err = LaunchDkDv<kMaxD, S, kRegs, kAsync>(dqkv, dqkv16, dbias_part, drow, dout, qkv, qkv_bias, lse,
                                                           ds_tiles, ds_w, s, stream)) != cudaSuccess) {
    return err;
  }
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if (ds_tiles) {  // the stored-dS dQ kernel (5 products)
    if constexpr (kAsync && kMaxD <= 64) {
      if (s.D == kMaxD && g_fixed_bounds.load()) {
        g_fixed_launches.fetch_add(1);
        return LaunchDqDsKernel<kMaxD, S, kAsync, true>(dqkv, dqkv16, dbias_part, qkv, qkv_bias, ds_tiles, ds_w, s,
                                                        stream);
      }
    }
    return LaunchDqDsKernel<kMaxD, S, kAsync, false>(dqkv, dqkv16, dbias_part, qkv, qkv_bias, ds_tiles, ds_w, s,
                                                     stream);
  }
  const size_t dq_smem = DqTcSharedBytes<kMaxD, kRegs, kAsync>(s.D);
  if ((err = AllowSharedBytes(attention_dq_tc_kernel<kMaxD, S, kRegs, kAsync>, dq_smem)) != cudaSuccess) return err;
  MS_LAUNCH((attention_dq_tc_kernel<kMaxD, S, kRegs, kAsync>), s.blocks, kThreads, dq_smem, stream, dqkv, dqkv16,
            dbias_part, dout, qkv, qkv_bias, lse, drow, s.T, s.H, s.D, s.window, s.ntiles, s.scale);
  return cudaGetLastError();
}

std::atomic<bool> g_async_loads{true};
std::atomic<bool> g_wide_forward{false};
std::atomic<int64_t> g_wide_launches{0};  // AttentionTcWideForwardLaunches
std::atomic<bool> g_split_dkdv{false};
std::atomic<int64_t> g_split_launches{0};  // AttentionTcSplitDkDvLaunches

// The wide forward (attention_forward_wide_tc_kernel) over blocks of 128 query rows.
template <int kMaxD, bool kFullD>
cudaError_t LaunchForwardWideKernel(float* out, __nv_bfloat16* out16, float* lse, const __nv_bfloat16* qkv,
                                    const float* qkv_bias, const attention_detail::AttentionShape& s,
                                    cudaStream_t stream) {
  const int heads = s.blocks / s.ntiles, ntiles = (s.T + kWideRows - 1) / kWideRows;  // B H, and tiles of 128 rows
  const size_t smem = ForwardWideSharedBytes<kMaxD>(s.D);
  cudaError_t err = AllowSharedBytes(attention_forward_wide_tc_kernel<kMaxD, kFullD>, smem);
  if (err != cudaSuccess) return err;
  MS_LAUNCH((attention_forward_wide_tc_kernel<kMaxD, kFullD>), heads * ntiles, kThreads, smem, stream, out, out16, lse,
            qkv, qkv_bias, s.T, s.H, s.D, s.window, ntiles, s.scale);
  return cudaGetLastError();
}

// The wide forward's instance for D: kMaxD 64, its kFullD one at D = 64 (unless SetAttentionTcFixedBounds(false);
// counted as the other kernels' are), or kMaxD 128 with run-time bounds only — its kFullD instance spilled (sm_90:
// 48 bytes stored, 68 loaded at 255 registers; ptxas then issues the next fragments' loads ahead of the MMAs).
cudaError_t LaunchForwardWide(float* out, __nv_bfloat16* out16, float* lse, const __nv_bfloat16* qkv,
                              const float* qkv_bias, const attention_detail::AttentionShape& s, cudaStream_t stream) {
  if (s.D > 64) return LaunchForwardWideKernel<128, false>(out, out16, lse, qkv, qkv_bias, s, stream);
  if (s.D == 64 && g_fixed_bounds.load()) {
    g_fixed_launches.fetch_add(1);
    return LaunchForwardWideKernel<64, true>(out, out16, lse, qkv, qkv_bias, s, stream);
  }
  return LaunchForwardWideKernel<64, false>(out, out16, lse, qkv, qkv_bias, s, stream);
}

// The kAsync kernels run for bf16 operands whose rows are 16-byte aligned (every copy then is), unless turned off
// (SetAttentionTcAsyncLoads).
template <typename S>
bool UseAsync(const void* a, const void* b) {
  if constexpr (std::is_same_v<S, __nv_bfloat16>) {
    return g_async_loads.load() && reinterpret_cast<uintptr_t>(a) % 16 == 0 && reinterpret_cast<uintptr_t>(b) % 16 == 0;
  } else {
    return false;
  }
}

// The template arguments of one kernel instance (nvcc compiles these sources as C++17: no template lambdas).
template <int kMaxDArg, bool kRegsArg, bool kAsyncArg>
struct Instance {
  static constexpr int kMaxD = kMaxDArg;
  static constexpr bool kRegs = kRegsArg;
  static constexpr bool kAsync = kAsyncArg;
};

// f(Instance<kMaxD, kRegs, kAsync>{}) for the instance the head dimension and the modes choose; kAsync only for bf16
// operands (S).
template <typename S, typename F>
cudaError_t Dispatch(int D, bool regs, bool async, F&& f) {
  if constexpr (std::is_same_v<S, __nv_bfloat16>) {
    if (async && regs) return D <= 64 ? f(Instance<64, true, true>{}) : f(Instance<128, true, true>{});
    if (async) return D <= 64 ? f(Instance<64, false, true>{}) : f(Instance<128, false, true>{});
  }
  if (regs) return D <= 64 ? f(Instance<64, true, false>{}) : f(Instance<128, true, false>{});
  return D <= 64 ? f(Instance<64, false, false>{}) : f(Instance<128, false, false>{});
}
}  // namespace

void SetAttentionTcSoftmax(AttentionTcSoftmax mode) {
  g_softmax.store(static_cast<int>(mode));
}
void SetAttentionTcAsyncLoads(bool on) {
  g_async_loads.store(on);
}
void SetAttentionTcWideForward(bool on) {
  g_wide_forward.store(on);
}
int64_t AttentionTcWideForwardLaunches() {
  return g_wide_launches.load();
}
void SetAttentionTcFixedBounds(bool on) {
  g_fixed_bounds.store(on);
}
int64_t AttentionTcFixedBoundsLaunches() {
  return g_fixed_launches.load();
}
void SetAttentionTcSplitDkDv(bool on) {
  g_split_dkdv.store(on);
}
int64_t AttentionTcSplitDkDvLaunches() {
  return g_split_launches.load();
}

namespace {
template <typename S>
cudaError_t ForwardTc(float* out, float* lse, const S* qkv, int64_t B, int64_t T, int64_t H, int64_t D, int64_t window,
                      cudaStream_t stream, __nv_bfloat16* out16, const float* qkv_bias) {
  bool empty = false;
  attention_detail::AttentionShape s{};
  cudaError_t err = CheckShapeTc(B, T, H, D, window, &empty, &s);
  if (err != cudaSuccess || empty) return err;
  if ((err = FragLoadsHold(stream)) != cudaSuccess) return err;
  bool regs = false;
  if ((err = UseRegisters(stream, /*shared_by_default=*/false, &regs)) != cudaSuccess) return err;
  const bool async = UseAsync<S>(qkv, qkv);
  if constexpr (std::is_same_v<S, __nv_bfloat16>) {
    if (g_wide_forward.load() && regs && async) {
      err = LaunchForwardWide(out, out16, lse, qkv, qkv_bias, s, stream);
      if (err == cudaSuccess) g_wide_launches.fetch_add(1);
      return err;
    }
  }
  return Dispatch<S>(s.D, regs, async, [&](auto inst) {
    using I = decltype(inst);
    return LaunchForward<I::kMaxD, S, I::kRegs, I::kAsync>(out, out16, lse, qkv, qkv_bias, s, stream);
  });
}
}  // namespace

cudaError_t AttentionForwardBf16(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t H, int64_t D,
                                 int64_t window, cudaStream_t stream, __nv_bfloat16* out16, const float* qkv_bias) {
  return ForwardTc(out, lse, qkv, B, T, H, D, window, stream, out16, qkv_bias);
}
cudaError_t AttentionForwardBf16(float* out, float* lse, const __nv_bfloat16* qkv, int64_t B, int64_t T, int64_t H,
                                 int64_t D, int64_t window, cudaStream_t stream, __nv_bfloat16* out16,
                                 const float* qkv_bias) {
  if (out == nullptr && out16 == nullptr) return cudaErrorInvalidValue;  // nothing to write
  return ForwardTc(out, lse, qkv, B, T, H, D, window, stream, out16, qkv_bias);
}

namespace {
int64_t BiasChunks(int64_t B, int64_t T) {  // 16-row chunks of the qkv bias gradient: one per warp that stores rows
  return B * ((T + kWarpRows - 1) / kWarpRows);
}
}  // namespace

int64_t AttentionDsTileBytes(int64_t B, int64_t T, int64_t H, int64_t window) {
  if (B <= 0 || T <= 0 || H <= 0 || window < 0) return 0;
  const int64_t ntiles = (T + kRows - 1) / kRows;
  const int w = DsTilesPerKey(static_cast<int>(ntiles), window);
  return B * H * DsTilesBefore(static_cast<int>(ntiles), static_cast<int>(ntiles), w) * kDsTileElems *
         static_cast<int64_t>(sizeof(__nv_bfloat16));
}

int64_t AttentionBiasGradScratchFloats(int64_t B, int64_t T, int64_t H, int64_t D) {
  if (B <= 0 || T <= 0 || H <= 0 || D <= 0) return 0;
  const int64_t chunks = BiasChunks(B, T), cols = 3 * H * D;
  return chunks * cols + BiasGradScratchFloats(chunks, cols);
}

namespace {
// out16: the forward's output as its bf16 rounding, in place of out (null), where dout is bf16 (S).
template <typename S>
cudaError_t BackwardTc(float* dqkv, float* scratch, const S* dout, const S* qkv, const float* out,
                       const __nv_bfloat16* out16, const float* lse, int64_t B, int64_t T, int64_t H, int64_t D,
                       int64_t window, cudaStream_t stream, __nv_bfloat16* dqkv16, const float* qkv_bias,
                       float* dqkv_bias, __nv_bfloat16* ds_tiles) {
  if (dqkv == nullptr && dqkv16 == nullptr && dqkv_bias == nullptr) return cudaErrorInvalidValue;  // nothing to write
  if (reinterpret_cast<uintptr_t>(ds_tiles) % 16 != 0) return cudaErrorInvalidValue;  // copied 16 bytes at a time
  bool empty = false;
  attention_detail::AttentionShape s{};
  cudaError_t err = CheckShapeTc(B, T, H, D, window, &empty, &s);
  if (err != cudaSuccess || empty) return err;
  if ((err = FragLoadsHold(stream)) != cudaSuccess) return err;
  float* const drow = scratch;
  float* const part = dqkv_bias ? scratch + AttentionBackwardScratchFloats(B, T, H, D) : nullptr;
  if constexpr (std::is_same_v<S, float>) {
    err = attention_detail::AttentionRowTerms(drow, dout, out, s, stream);
  } else {
    err = out16 ? attention_detail::AttentionRowTerms(drow, dout, out16, s, stream)
                : attention_detail::AttentionRowTerms(drow, dout, out, s, stream);
  }
  if (err != cudaSuccess) return err;
  bool regs = false;
  if ((err = UseRegisters(stream, AttentionTcBackwardSharedByDefault(s.D), &regs)) != cudaSuccess) return err;
  const bool async = UseAsync<S>(qkv, dout);
  // The split dK/dV kernel (SetAttentionTcSplitDkDv) is a register-softmax kernel at every D: it runs where the
  // layout holds and the softmax is not forced through shared memory (kAuto's D > 64 choice is the 4-warp kernel's).
  bool split = false;
  if (g_split_dkdv.load() && async && s.D % (2 * kF) == 0) {
    if ((err = UseRegisters(stream, /*shared_by_default=*/false, &split)) != cudaSuccess) return err;
  }
  err = Dispatch<S>(s.D, regs, async, [&](auto inst) {
    using I = decltype(inst);
    return LaunchBackward<I::kMaxD, S, I::kRegs, I::kAsync>(dqkv, dqkv16, part, drow, dout, qkv, qkv_bias, lse,
                                                            ds_tiles, split, s, stream);
  });
  if (err == cudaSuccess && split) g_split_launches.fetch_add(1);
  if (err != cudaSuccess || dqkv_bias == nullptr) return err;
  // Stage 2: the chunks' column sums added up in BiasGrad's fixed tree (its scratch follows the partial sums).
  const int64_t chunks = BiasChunks(B, T), cols = 3 * H * D;
  return BiasGrad(dqkv_bias, part + chunks * cols, part, chunks, cols, stream);
}
}  // namespace

cudaError_t AttentionBackwardBf16(float* dqkv, float* scratch, const float* dout, const float* qkv, const float* out,
                                  const float* lse, int64_t B, int64_t T, int64_t H, int64_t D, int64_t window,
                                  cudaStream_t stream, __nv_bfloat16* dqkv16, const float* qkv_bias, float* dqkv_bias,
                                  __nv_bfloat16* ds_tiles) {
  return BackwardTc(dqkv, scratch, dout, qkv, out, static_cast<const __nv_bfloat16*>(nullptr), lse, B, T, H, D, window,
                    stream, dqkv16, qkv_bias, dqkv_bias, ds_tiles);
}
cudaError_t AttentionBackwardBf16(float* dqkv, float* scratch, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                                  const float* out, const __nv_bfloat16* out16, const float* lse, int64_t B, int64_t T,
                                  int64_t H, int64_t D, int64_t window, cudaStream_t stream, __nv_bfloat16* dqkv16,
                                  const float* qkv_bias, float* dqkv_bias, __nv_bfloat16* ds_tiles) {
  if ((out == nullptr) == (out16 == nullptr)) return cudaErrorInvalidValue;  // exactly one of them is read
  return BackwardTc(dqkv, scratch, dout, qkv, out, out16, lse, B, T, H, D, window, stream, dqkv16, qkv_bias, dqkv_bias,
                    ds_tiles);
}

}  // namespace ms::kernels
