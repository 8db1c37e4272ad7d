// Helpers shared by the kernel test files (tests/kernels/*_test.cpp): device buffers, random inputs,
// tolerance checks. Header-only, in ms::kernels::testing.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <doctest/doctest.h>

#if MS_KERNELS_SIM
#include "sim/simt.h"
#endif
#include <cuda_runtime_api.h>

#include "kernels.h"

namespace ms::kernels::testing {

// A device buffer of n T's (RAII); filled from / read back to host vectors.
template <typename T>
class Dev {
 public:
  explicit Dev(size_t n) : n_(n) {
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&p_), std::max<size_t>(n, 1) * sizeof(T)) == cudaSuccess);
  }
  explicit Dev(const std::vector<T>& host) : Dev(host.size()) { Set(host); }
  ~Dev() { (void)cudaFree(p_); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  T* get() const { return p_; }
  void Set(const std::vector<T>& host) {
    REQUIRE(host.size() == n_);
    REQUIRE(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  }
  std::vector<T> Get() const {
    std::vector<T> host(n_);
    REQUIRE(cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
    return host;
  }

 private:
  size_t n_;
  T* p_ = nullptr;
};

inline std::vector<float> Random(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// |got - want| <= atol + rtol * |want| everywhere (NaN fails); reports the worst element.
inline void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, float rtol, float atol,
                        const char* what) {
  REQUIRE(got.size() == want.size());
  size_t worst = 0;
  double worst_excess = -1.0;
  bool bad = false;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    const double tol = atol + rtol * std::fabs(static_cast<double>(want[i]));
    const double excess = std::isnan(err) ? 1e30 : err - tol;
    if (excess > worst_excess) {
      worst_excess = excess;
      worst = i;
    }
    if (!(err <= tol)) bad = true;
  }
  INFO(what << ": worst element " << worst << " got " << got[worst] << " want " << want[worst] << " (rtol " << rtol
            << ", atol " << atol << ")");
  CHECK_FALSE(bad);
}

// A kernel's bf16 copy of its fp32 output (out16 / dx16 / d16 of the kernels that write one for the next GEMM)
// must hold the bits CastFloatToBf16 makes of that output.
inline void ExpectBf16CopyOf(Dev<__nv_bfloat16>& copy, Dev<float>& out, int64_t n, const char* what) {
  Dev<__nv_bfloat16> want(static_cast<size_t>(n));
  REQUIRE(CastFloatToBf16(want.get(), out.get(), n, nullptr) == cudaSuccess);
  const auto got = copy.Get(), w = want.Get();
  INFO(what);
  CHECK(std::memcmp(got.data(), w.data(), sizeof(__nv_bfloat16) * static_cast<size_t>(n)) == 0);
}

// After each op: the kernels launch whole warps, so no shuffle may read a nonexistent lane.
inline void ExpectNoPoisonedReads() {
#if MS_KERNELS_SIM
  CHECK(ms::sim::GetStats().poisoned_reads == 0);
#endif
}
}  // namespace ms::kernels::testing
