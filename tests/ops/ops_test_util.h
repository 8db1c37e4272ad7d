// Helpers for the ops tests: seeded random tensors, tolerance checks, finite differences.
#pragma once

#include <doctest/doctest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/core.h"

namespace ms::ops::testing {

inline std::vector<float> Randn(Rng& rng, int64_t n, double scale = 1.0) {
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.NextNormal() * scale);
  return v;
}

inline std::vector<float> Uniform(Rng& rng, int64_t n, double lo, double hi) {
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(lo + (hi - lo) * rng.NextDouble());
  return v;
}

// Every element: |got - want| <= atol + rtol * |want|. Reports the worst element.
inline void CheckClose(const std::vector<float>& got, const std::vector<float>& want, double rtol, double atol,
                       const std::string& what) {
  REQUIRE(got.size() == want.size());
  int64_t worst = -1;
  double worst_excess = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    const double excess = err - (atol + rtol * std::fabs(static_cast<double>(want[i])));
    if (!(excess <= worst_excess) || std::isnan(got[i]) != std::isnan(want[i])) {
      worst_excess = std::isnan(excess) ? INFINITY : excess;
      worst = static_cast<int64_t>(i);
    }
  }
  INFO(what << ": worst element " << worst << " got " << (worst >= 0 ? got[worst] : 0.0f) << " want "
            << (worst >= 0 ? want[worst] : 0.0f) << " (rtol " << rtol << ", atol " << atol << ")");
  CHECK(worst == -1);
}

inline bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Central difference of loss() with respect to x[i]; the step actually taken is what float can represent.
inline double CentralDiff(std::vector<float>& x, int64_t i, double h, const std::function<double()>& loss) {
  const float orig = x[i];
  const float xp = static_cast<float>(orig + h), xm = static_cast<float>(orig - h);
  x[i] = xp;
  const double lp = loss();
  x[i] = xm;
  const double lm = loss();
  x[i] = orig;
  return (lp - lm) / (static_cast<double>(xp) - xm);
}

// Compares an analytic gradient against central differences at the given indices (all if empty).
inline void CheckGradFd(std::vector<float>& x, const std::vector<float>& grad, const std::function<double()>& loss,
                        double h, double rtol, double atol, const std::string& what,
                        std::vector<int64_t> indices = {}) {
  if (indices.empty()) {
    for (int64_t i = 0; i < static_cast<int64_t>(x.size()); ++i) indices.push_back(i);
  }
  int failures = 0;
  for (int64_t i : indices) {
    const double fd = CentralDiff(x, i, h, loss);
    if (std::fabs(fd - grad[i]) > atol + rtol * std::fabs(fd)) {
      if (failures++ < 3) MESSAGE(what << "[" << i << "]: analytic " << grad[i] << " vs finite difference " << fd);
    }
  }
  CHECK_MESSAGE(failures == 0, what << ": " << failures << " of " << indices.size() << " gradients off");
}

// sum(out * r) in double: the scalar loss used for gradient checks.
inline double Dot(const std::vector<float>& out, const std::vector<float>& r) {
  double s = 0;
  for (size_t i = 0; i < out.size(); ++i) s += static_cast<double>(out[i]) * r[i];
  return s;
}

// Runs the body with a given OpenMP thread count, then restores the previous one.
struct ScopedThreads {
  explicit ScopedThreads(int n) : saved(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~ScopedThreads() { omp_set_num_threads(saved); }
  int saved;
};

}  // namespace ms::ops::testing
