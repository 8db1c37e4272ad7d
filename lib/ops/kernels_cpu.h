// Internal to lib/ops: helpers shared by the fast CPU implementations. Not part of the module API.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>

// Hot per-row kernels are compiled for several ISAs (baseline x86-64, AVX2+FMA, AVX-512) and the best one
// is picked once at load time (GCC function multiversioning through ifunc). Results are bitwise
// reproducible on a given machine; they may differ in the last bits between machines of different ISAs.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define MS_OPS_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define MS_OPS_CLONES
#endif

namespace ms::ops::internal {

// Elementwise loops shorter than this run on the calling thread (an OpenMP region costs a few us).
constexpr int64_t kParallelMin = 1 << 15;

inline float DotF(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += a * x
inline void AxpyF(float* __restrict y, float a, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// exp(x) for float, branch-free so that loops calling it vectorize (glibc's expf does not without
// -ffast-math). Cephes' expf: x = n ln2 + r, |r| <= ln2/2, a degree-7 polynomial for e^r, 2^n from the
// exponent bits. Relative error below 2 ulp on the clamped range; inputs below -87.33 return 0 (a select:
// still branch-free), inputs above 88.37 return about 2^127; NaN gives NaN.
inline float ExpF(float x) {
  const bool underflow = x < -87.33654475f;  // below FLT_MIN: 0, as expf (a masked logit, -1e30, must vanish)
  x = std::clamp(x, -87.33654475f, 88.37626266f);
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding and subtracting rounds to an integer
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  const float e = y * std::bit_cast<float>(bits);
  return underflow ? 0.0f : e;
}

// First key a query at position t attends to (window 0: all keys).
inline int64_t FirstKey(int64_t t, int64_t window) {
  const int64_t s0 = t - window + 1;
  return window > 0 && s0 > 0 ? s0 : 0;
}

}  // namespace ms::ops::internal
