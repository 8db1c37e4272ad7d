// ops_bench: timings of the fast CPU ops (not a test). Run e.g. `OMP_NUM_THREADS=2 ./ops_bench`.
// Each line is the best of several runs after a warm-up; numbers on a busy machine are noisy.
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "core/core.h"
#include "ops/ops.h"

namespace {

using ms::NowSeconds;

std::vector<float> Randn(ms::Rng& rng, int64_t n, double scale = 1.0) {
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.NextNormal() * scale);
  return v;
}

// Best wall time of f() over repetitions: one warm-up, then at least 3 runs and at least 0.4 s.
double BestSeconds(const std::function<void()>& f) {
  f();
  double best = 1e30, total = 0;
  for (int rep = 0; rep < 3 || total < 0.4; ++rep) {
    const double t0 = NowSeconds();
    f();
    const double dt = NowSeconds() - t0;
    best = std::min(best, dt);
    total += dt;
    if (rep >= 50) break;
  }
  return best;
}

std::string CpuModel() {
  auto text = ms::ReadFile("/proc/cpuinfo");
  if (!text.ok()) return "unknown";
  std::istringstream in(*text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

void Row(const std::string& what, double seconds, double work, const char* unit) {
  std::printf("%-52s %10.3f ms %10.1f %s\n", what.c_str(), seconds * 1e3, work / seconds * 1e-9, unit);
}

void BenchGemm(ms::Rng& rng) {
  for (int64_t n : {1024, 2048}) {
    auto a = Randn(rng, n * n), b = Randn(rng, n * n);
    std::vector<float> c(n * n);
    const double t =
        BestSeconds([&] { ms::ops::Gemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n); });
    Row("Gemm NN " + std::to_string(n) + "^3", t, 2.0 * n * n * n, "GFLOP/s");
  }
  // GPT-2 small, B*T = 2048 tokens.
  const int64_t N = 2048;
  const std::pair<int64_t, int64_t> shapes[] = {{768, 2304}, {768, 3072}, {3072, 768}, {768, 768}};
  for (auto [IC, OC] : shapes) {
    auto inp = Randn(rng, N * IC), w = Randn(rng, OC * IC, 0.02), bias = Randn(rng, OC), dout = Randn(rng, N * OC);
    std::vector<float> out(N * OC), dinp(N * IC), dw(OC * IC), dbias(OC);
    const std::string shape = std::to_string(N) + "x" + std::to_string(IC) + "->" + std::to_string(OC);
    const double flops = 2.0 * N * IC * OC;
    Row("MatmulForward " + shape,
        BestSeconds([&] { ms::ops::MatmulForward(out.data(), inp.data(), w.data(), bias.data(), N, IC, OC); }), flops,
        "GFLOP/s");
    Row("  backward dinp += dout @ w", BestSeconds([&] {
          ms::ops::Gemm(false, false, N, IC, OC, 1.0f, dout.data(), OC, w.data(), IC, 1.0f, dinp.data(), IC);
        }),
        flops, "GFLOP/s");
    Row("  backward dw += dout^T @ inp", BestSeconds([&] {
          ms::ops::Gemm(true, false, OC, IC, N, 1.0f, dout.data(), OC, inp.data(), IC, 1.0f, dw.data(), IC);
        }),
        flops, "GFLOP/s");
    Row("  MatmulBackward (both + dbias)", BestSeconds([&] {
          ms::ops::MatmulBackward(dinp.data(), dw.data(), dbias.data(), dout.data(), inp.data(), w.data(), N, IC, OC);
        }),
        2 * flops, "GFLOP/s");
  }
}

void BenchAttention(ms::Rng& rng) {
  const int64_t B = 8, T = 256, H = 12, D = 64;
  auto qkv = Randn(rng, B * T * 3 * H * D), dout = Randn(rng, B * T * H * D);
  std::vector<float> out(B * T * H * D), lse(B * H * T), dqkv(qkv.size());
  for (int64_t window : {0, 64}) {
    double pairs = 0;  // (query, key) pairs per (b, h)
    for (int64_t t = 0; t < T; ++t) pairs += window > 0 ? std::min(window, t + 1) : t + 1;
    pairs *= B * H;
    const std::string name = "attention B8 T256 H12 D64 window " + std::to_string(window);
    Row(name + " fwd",
        BestSeconds([&] { ms::ops::AttentionForward(out.data(), lse.data(), qkv.data(), B, T, H, D, window); }),
        4.0 * D * pairs, "GFLOP/s");
    Row(name + " bwd", BestSeconds([&] {
          ms::ops::AttentionBackward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, H, D, window);
        }),
        10.0 * D * pairs, "GFLOP/s");
  }
}

void BenchRowOps(ms::Rng& rng) {
  const int64_t N = 2048, C = 768;
  auto x = Randn(rng, N * C), w = Randn(rng, C), b = Randn(rng, C), dout = Randn(rng, N * C);
  std::vector<float> out(N * C), mean(N), rstd(N), dx(N * C), dw(C), db(C);
  const double bytes = 4.0 * N * C;
  Row("LayerNormForward 2048x768 (x + out)", BestSeconds([&] {
        ms::ops::LayerNormForward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, 1e-5f);
      }),
      2 * bytes, "GB/s");
  Row("LayerNormBackward 2048x768 (dout, x, dx r+w)", BestSeconds([&] {
        ms::ops::LayerNormBackward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(),
                                   rstd.data(), N, C);
      }),
      4 * bytes, "GB/s");
  const int64_t n = N * 3072;
  auto h = Randn(rng, n), dh = Randn(rng, n);
  std::vector<float> g(n), dg(n);
  Row("GeluForward 2048x3072", BestSeconds([&] { ms::ops::GeluForward(g.data(), h.data(), n); }), n, "Gelem/s");
  Row("GeluBackward 2048x3072", BestSeconds([&] { ms::ops::GeluBackward(dg.data(), h.data(), dh.data(), n); }), n,
      "Gelem/s");
  const int64_t rows = 256, V = 50257;
  auto logits = Randn(rng, rows * V);
  std::vector<int32_t> targets(rows);
  for (auto& t : targets) t = static_cast<int32_t>(rng.NextBelow(V));
  std::vector<float> losses(rows), lse(rows), dlogits(rows * V), dloss(rows, 1.0f / rows);
  Row("CrossEntropyForward 256x50257", BestSeconds([&] {
        ms::ops::CrossEntropyForward(losses.data(), lse.data(), logits.data(), targets.data(), rows, V);
      }),
      1.0 * rows * V, "Gelem/s");
  Row("CrossEntropyBackward 256x50257", BestSeconds([&] {
        ms::ops::CrossEntropyBackward(dlogits.data(), logits.data(), lse.data(), targets.data(), dloss.data(), rows, V);
      }),
      1.0 * rows * V, "Gelem/s");
  const int64_t np = 1 << 22;
  auto p = Randn(rng, np), gr = Randn(rng, np, 0.01);
  std::vector<float> m(np), v(np);
  int64_t step = 0;
  Row("AdamWStep 4M params", BestSeconds([&] {
        ms::ops::AdamWStep(p.data(), gr.data(), m.data(), v.data(), np, {1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f}, ++step);
      }),
      1.0 * np, "Gelem/s");
}

}  // namespace

int main(int argc, char** argv) {
  // --peak-only: print just the best fp32 GEMM rate (FLOP/s, square 2048) for scripts.
  if (argc > 1 && std::string(argv[1]) == "--peak-only") {
    ms::Rng rng(1);
    const int64_t n = 2048;
    auto a = Randn(rng, n * n), b = Randn(rng, n * n);
    std::vector<float> c(n * n);
    const double t =
        BestSeconds([&] { ms::ops::Gemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n); });
    std::printf("%.6g\n", 2.0 * n * n * n / t);
    return 0;
  }
  std::printf("ops_bench: nproc %d, OMP threads %d, CPU %s\n", ms::NumCores(), omp_get_max_threads(),
              CpuModel().c_str());
  std::printf("%-52s %13s %10s\n", "op", "best time", "rate");
  ms::Rng rng(2024);
  BenchGemm(rng);
  BenchAttention(rng);
  BenchRowOps(rng);
  return 0;
}
