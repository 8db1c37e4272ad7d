// kernels_bench: GPU timings of every kernel launcher of kernels/ (kernels.h, attention.h, elementwise.h,
// matmul.h) at GPT-2-sized shapes. For each launcher: the median (and minimum) time of its launches measured with
// cudaEvents after a warm-up, the achieved bytes/s against the device's peak memory bandwidth, and for the GEMM and
// attention the achieved FLOP/s against cuBLAS (cublasGemmEx, bf16 in, fp32 out, CUBLAS_COMPUTE_32F) on the same
// GEMM shapes. Not a test: it needs a GPU (without one it exits with status 1 and says so).
//
// Roofline: every row also gives the time the roofline GPU (the detected one's datasheet, or --roofline) needs for
// the launcher's bytes at peak HBM bandwidth or its FLOPs at the peak of its unit (bf16 tensor cores for the GEMM,
// fp32 CUDA cores for today's attention kernels), whichever is larger, and the measured time's share of it. After
// each shape a PREDICTION of one training step of that GPT shape from these figures: the launch sequence of the
// CUDA backend as built, and with issue #16's items done (bench/kernels_bench.cpp StepLaunches), with the MFU it
// bounds. --roofline-only prints the bytes, FLOPs, roofline times and the prediction without a GPU.
//
// Before any timing, every launcher is run once on a small shape and compared with the CPU reference of its op
// (ms::ops::ref, lib/ops/ops.h), with the tolerances of tests/kernels; a disagreement stops the run with status 1,
// so a broken kernel is never benchmarked. Every CUDA and cuBLAS call is checked.
//
//   kernels_bench [--preset all|gpt2-small|gpt2-xl|gpu-configs|gpt2-small-gpu|gpt-1.3b] [--tokens N --hidden C
//                 --heads H --vocab V --seq T --window W --layers L --tp P] [--iters I] [--warmup W] [--device D]
//                 [--json FILE] [--roofline h100|h100-pcie|h200|a100] [--roofline-only] [--micro-batches M]
//                 [--rows REGEX] [--no-sanity]
//
// --rows runs (or with --roofline-only lists) only the rows whose "kernel shape" label the ECMAScript regex finds;
// --no-sanity skips the sanity checks (for a profiler run after a checked one: scripts/gpu_check.sh's profile stage
// selects training's attention rows of both GPU configs so that Nsight Compute sees only their launches).
//
// docs/PERFORMANCE.md ("GPU kernels (kernels_bench)"), docs/cuda.md ("Benchmark"), scripts/bench_kernels.sh.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels.h"
#include "ops/ops.h"
#if defined(MS_BENCH_HAVE_CUDNN)
#include "cuda/cudnn_sdpa.h"
#endif

namespace {

namespace k = ms::kernels;
namespace ref = ms::ops::ref;
using bf16 = __nv_bfloat16;

// ---- errors --------------------------------------------------------------------------------------------------

[[noreturn]] void Die(const std::string& msg) {
  std::fflush(stdout);
  std::fprintf(stderr, "kernels_bench: %s\n", msg.c_str());
  std::exit(1);
}

std::string CudaError(cudaError_t e) {
  return fmt::format("{} ({})", cudaGetErrorName(e), cudaGetErrorString(e));
}

void CheckCuda(cudaError_t e, const char* expr, const char* file, int line) {
  if (e != cudaSuccess) Die(fmt::format("{}:{}: {} failed: {}", file, line, expr, CudaError(e)));
}

void CheckCublas(cublasStatus_t s, const char* expr, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    Die(fmt::format("{}:{}: {} failed: {} ({})", file, line, expr, cublasGetStatusName(s), cublasGetStatusString(s)));
  }
}

#define BENCH_CUDA(expr) CheckCuda((expr), #expr, __FILE__, __LINE__)
#define BENCH_CUBLAS(expr) CheckCublas((expr), #expr, __FILE__, __LINE__)

// The launch error a launcher returned, then (sync) the errors of its execution, named after the kernel.
void CheckLaunch(const std::string& what, cudaError_t e) {
  if (e != cudaSuccess) Die(fmt::format("{}: launch failed: {}", what, CudaError(e)));
}
void SyncAfter(const std::string& what, cudaStream_t stream) {
  const cudaError_t e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) Die(fmt::format("{}: execution failed: {}", what, CudaError(e)));
}

// ---- roofline ---------------------------------------------------------------------------------------------------

// --roofline-only: no device is touched (buffers are not allocated, nothing is launched or timed); the tables show
// each launcher's bytes, FLOPs and the time the roofline GPU needs for them. Set once in main, before any work.
bool g_dry = false;

// --rows: the rows to run (their "kernel shape" label searched), and how many rows were offered / run. Set in main.
std::unique_ptr<std::regex> g_rows;
int64_t g_rows_offered = 0, g_rows_run = 0;

// Datasheet figures of a GPU (dense, no sparsity), the roofline the kernels are compared with.
struct Roofline {
  const char* key;
  const char* name;
  double bandwidth;  // bytes/s, HBM
  double bf16;       // FLOP/s, dense bf16 tensor cores
  double fp32;       // FLOP/s, fp32 on CUDA cores (non-tensor)
};
constexpr Roofline kRooflines[] = {
    {"h100", "NVIDIA H100 SXM5 80GB (datasheet)", 3.35e12, 989.4e12, 66.9e12},
    {"h100-pcie", "NVIDIA H100 PCIe 80GB (datasheet)", 2.0e12, 756.0e12, 51.2e12},
    {"h200", "NVIDIA H200 SXM 141GB (datasheet)", 4.8e12, 989.4e12, 66.9e12},
    {"a100", "NVIDIA A100 SXM4 80GB (datasheet)", 2.039e12, 312.0e12, 19.5e12},
};

const Roofline* FindRoofline(const std::string& key) {
  for (const Roofline& r : kRooflines) {
    if (key == r.key) return &r;
  }
  return nullptr;
}

// The roofline of a detected GPU by its name ("NVIDIA H100 80GB HBM3"); nullptr when not in the table.
const Roofline* RooflineOfGpu(const std::string& gpu) {
  if (gpu.find("H200") != std::string::npos) return FindRoofline("h200");
  if (gpu.find("H100") != std::string::npos) {
    return FindRoofline(gpu.find("PCIe") != std::string::npos ? "h100-pcie" : "h100");
  }
  if (gpu.find("A100") != std::string::npos) return FindRoofline("a100");
  return nullptr;
}

// Which peak a launcher's FLOPs run at: the GEMM and the bf16 attention kernels (kernels/attention_tc.cu) on bf16
// tensor cores, the fp32 attention kernels (kernels/attention.cu) on CUDA cores, everything else is memory-bound
// (no FLOPs counted).
enum class Unit { kMemory, kTensorBf16, kCudaCoreFp32 };

Unit UnitOf(const std::string& kernel) {
  if (kernel.rfind("Gemm", 0) == 0) return Unit::kTensorBf16;
  if (kernel.rfind("Attention", 0) == 0) {
    return kernel.find("Bf16") != std::string::npos ? Unit::kTensorBf16 : Unit::kCudaCoreFp32;
  }
  return Unit::kMemory;
}

const char* UnitName(Unit u) {
  switch (u) {
    case Unit::kTensorBf16:
      return "bf16 TC";
    case Unit::kCudaCoreFp32:
      return "fp32 CC";
    case Unit::kMemory:
      break;
  }
  return "memory";
}

// Seconds the roofline GPU needs for `bytes` of HBM traffic and `flops` at the peak of `unit`: the larger of the two.
double RoofSeconds(const Roofline& r, double bytes, double flops, Unit unit) {
  const double peak = unit == Unit::kTensorBf16 ? r.bf16 : r.fp32;
  return std::max(bytes / r.bandwidth, unit == Unit::kMemory ? 0.0 : flops / peak);
}

// ---- device buffers and inputs ---------------------------------------------------------------------------------

template <typename T>
class DevBuf {
 public:
  DevBuf(size_t n, const std::string& what) : n_(n), what_(what) {
    if (g_dry) return;
    const size_t bytes = std::max<size_t>(n, 1) * sizeof(T);
    const cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&p_), bytes);
    if (e != cudaSuccess) {
      Die(fmt::format("cudaMalloc of {} ({:.1f} MiB) failed: {}", what, static_cast<double>(bytes) / (1 << 20),
                      CudaError(e)));
    }
  }
  DevBuf(const std::vector<T>& host, const std::string& what) : DevBuf(host.size(), what) { Upload(host); }
  ~DevBuf() {
    if (p_ != nullptr) (void)cudaFree(p_);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;

  T* get() const { return p_; }
  size_t size() const { return n_; }
  void Upload(const std::vector<T>& host) {
    if (g_dry) return;
    if (host.size() != n_) Die(fmt::format("upload of {} elements into {} ({} elements)", host.size(), what_, n_));
    BENCH_CUDA(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  // Synchronous with respect to the whole device (the benchmark's stream is a blocking stream).
  std::vector<T> Download() const {
    std::vector<T> host(n_);
    BENCH_CUDA(cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  size_t n_;
  std::string what_;
  T* p_ = nullptr;
};

std::vector<float> Random(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

std::vector<bf16> ToBf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16_rn(v[i]);
  return out;
}

std::vector<float> FromBf16(const std::vector<bf16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}

// Large inputs: a host-generated block of up to 4 Mi random values, repeated over the buffer by device-to-device
// copies (the values only have to be realistic, not unique, for timing).
constexpr size_t kFillBlock = size_t{1} << 22;

template <typename T>
void FillTiled(T* dst, size_t n, const std::vector<T>& block) {
  if (n == 0) return;
  const size_t first = std::min(n, block.size());
  BENCH_CUDA(cudaMemcpy(dst, block.data(), first * sizeof(T), cudaMemcpyHostToDevice));
  for (size_t done = first; done < n;) {
    const size_t count = std::min(done, n - done);
    BENCH_CUDA(cudaMemcpy(dst + done, dst, count * sizeof(T), cudaMemcpyDeviceToDevice));
    done += count;
  }
}

void Fill(const DevBuf<float>& buf, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  if (g_dry) return;
  FillTiled(buf.get(), buf.size(), Random(std::min(buf.size(), kFillBlock), seed, lo, hi));
}

void Fill(const DevBuf<bf16>& buf, uint32_t seed) {
  if (g_dry) return;
  FillTiled(buf.get(), buf.size(), ToBf16(Random(std::min(buf.size(), kFillBlock), seed)));
}

std::vector<int32_t> RandomIds(size_t n, int64_t V, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(n);
  for (auto& id : ids) id = static_cast<int32_t>(rng() % static_cast<uint64_t>(V));
  return ids;
}

// ---- cuBLAS, row-major ------------------------------------------------------------------------------------------

// Row-major C (M, N) = alpha * op(A) @ op(B) + beta * C (the conventions of ms::ops::Gemm and kernels::GemmBf16) is
// column-major C^T (N, M) = op(B)^T @ op(A)^T: cuBLAS gets B first, with m = N and n = M.
// Row-major C (M, N) = op(A) op(B) on cuBLAS (column-major: computes C^T = op(B)^T op(A)^T), A and B of type `in`,
// C fp32, with `compute`.
cublasStatus_t GemmRowMajorTyped(cublasHandle_t h, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                                 const float* alpha, const void* A, int64_t lda, const void* B, int64_t ldb,
                                 const float* beta, float* C, int64_t ldc, cudaDataType_t in,
                                 cublasComputeType_t compute) {
  return cublasGemmEx(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(N),
                      static_cast<int>(M), static_cast<int>(K), alpha, B, in, static_cast<int>(ldb), A, in,
                      static_cast<int>(lda), beta, C, CUDA_R_32F, static_cast<int>(ldc), compute, CUBLAS_GEMM_DEFAULT);
}

cublasStatus_t GemmRowMajor(cublasHandle_t h, bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* alpha,
                            const bf16* A, int64_t lda, const bf16* B, int64_t ldb, const float* beta, float* C,
                            int64_t ldc) {
  return GemmRowMajorTyped(h, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, CUDA_R_16BF, CUBLAS_COMPUTE_32F);
}

// The same GEMM on fp32 A and B with CUBLAS_COMPUTE_32F_FAST_16BF: cuBLAS converts the operands to bf16 itself
// (tensor cores, fp32 accumulation), so no cast kernel runs before it. The alternative to the backend's casts that
// the GemmFp32Fast16bf rows measure.
cublasStatus_t GemmRowMajorFast16bf(cublasHandle_t h, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                                    const float* alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
                                    const float* beta, float* C, int64_t ldc) {
  return GemmRowMajorTyped(h, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, CUDA_R_32F,
                           CUBLAS_COMPUTE_32F_FAST_16BF);
}

cublasStatus_t GemmBatchedRowMajor(cublasHandle_t h, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                                   const float* alpha, const bf16* A, int64_t lda, int64_t stride_a, const bf16* B,
                                   int64_t ldb, int64_t stride_b, const float* beta, float* C, int64_t ldc,
                                   int64_t stride_c, int64_t batch) {
  return cublasGemmStridedBatchedEx(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                    static_cast<int>(N), static_cast<int>(M), static_cast<int>(K), alpha, B,
                                    CUDA_R_16BF, static_cast<int>(ldb), stride_b, A, CUDA_R_16BF, static_cast<int>(lda),
                                    stride_a, beta, C, CUDA_R_32F, static_cast<int>(ldc), stride_c,
                                    static_cast<int>(batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

// ---- sanity checks against ms::ops::ref -------------------------------------------------------------------------

class Sanity {
 public:
  Sanity(cudaStream_t stream, cublasHandle_t blas) : stream_(stream), blas_(blas) {}
  cudaStream_t stream() const { return stream_; }
  cublasHandle_t blas() const { return blas_; }
  int checks() const { return checks_; }

  // A launcher's launch error, then its execution (synchronously), both named.
  void Run(const std::string& what, cudaError_t launch_error) {
    CheckLaunch(what, launch_error);
    SyncAfter(what, stream_);
  }

  // |got - want| <= atol + rtol * |want| everywhere (NaN fails).
  void Close(const std::string& what, const std::vector<float>& got, const std::vector<float>& want, double rtol,
             double atol) {
    if (got.size() != want.size())
      Die(fmt::format("sanity check {}: {} values, expected {}", what, got.size(), want.size()));
    size_t worst = 0, bad = 0;
    double worst_excess = -std::numeric_limits<double>::infinity(), max_err = 0.0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
      const double excess = std::isnan(err) ? std::numeric_limits<double>::infinity()
                                            : err - (atol + rtol * std::fabs(static_cast<double>(want[i])));
      if (excess > worst_excess) {
        worst_excess = excess;
        worst = i;
      }
      if (!(excess <= 0.0)) ++bad;
      if (!std::isnan(err)) max_err = std::max(max_err, err);
    }
    if (bad > 0) {
      Die(fmt::format(
          "SANITY CHECK FAILED: {}: {} of {} values out of tolerance; worst: element {} is {:.9g}, the CPU reference "
          "(ms::ops::ref) gives {:.9g} (rtol {:g}, atol {:g}). The kernel is broken: nothing is benchmarked.",
          what, bad, got.size(), worst, got[worst], want[worst], rtol, atol));
    }
    Passed(what, fmt::format("max |err| {:.2e} (rtol {:g}, atol {:g})", max_err, rtol, atol));
  }

  // Bitwise equality (floats, bf16 bits, ids).
  template <typename T>
  void Exact(const std::string& what, const std::vector<T>& got, const std::vector<T>& want) {
    if (got.size() != want.size())
      Die(fmt::format("sanity check {}: {} values, expected {}", what, got.size(), want.size()));
    for (size_t i = 0; i < got.size(); ++i) {
      if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
        Die(
            fmt::format("SANITY CHECK FAILED: {}: element {} differs from the reference (exact match required). The "
                        "kernel is broken: nothing is benchmarked.",
                        what, i));
      }
    }
    Passed(what, "bit-identical");
  }

  void Passed(const std::string& what, const std::string& detail) {
    ++checks_;
    fmt::print("  ok  {:<66} {}\n", what, detail);
  }

 private:
  cudaStream_t stream_;
  cublasHandle_t blas_;
  int checks_ = 0;
};

void SanityGelu(Sanity& s) {
  const int64_t n = 1000;
  const auto x = Random(n, 1, -3.0f, 3.0f), dout = Random(n, 2);
  DevBuf<float> dx(x, "x"), ddout(dout, "dout"), dy(n, "y"), dgrad(n, "dx");
  s.Run("GeluForward", k::GeluForward(dy.get(), dx.get(), n, s.stream()));
  s.Run("GeluBackward", k::GeluBackward(dgrad.get(), dx.get(), ddout.get(), n, s.stream()));
  std::vector<float> y(n), g(n);
  ref::GeluForward(y.data(), x.data(), n);
  ref::GeluBackward(g.data(), x.data(), dout.data(), n);
  s.Close("GeluForward (n=1000)", dy.Download(), y, 1e-5, 1e-6);
  s.Close("GeluBackward (n=1000)", dgrad.Download(), g, 1e-5, 1e-6);

  const int64_t N = 7, C = 45, m = N * C;
  const auto xb = Random(m, 3, -3.0f, 3.0f), bias = Random(C, 4), doutb = Random(m, 5), dbias0 = Random(C, 6);
  DevBuf<float> d_x(xb, "x"), d_bias(bias, "bias"), d_dout(doutb, "dout"), d_y(m, "y"), d_dx(m, "dx"),
      d_dbias(dbias0, "dbias"), d_bg_scratch(static_cast<size_t>(k::BiasGradScratchFloats(N, C)), "bias-grad scratch");
  s.Run("BiasGeluForward", k::BiasGeluForward(d_y.get(), d_x.get(), d_bias.get(), N, C, s.stream()));
  s.Run("BiasGeluBackward", k::BiasGeluBackward(d_dx.get(), d_dbias.get(), d_bg_scratch.get(), d_x.get(), d_bias.get(),
                                                d_dout.get(), N, C, s.stream()));
  std::vector<float> u(m), yb(m), gb(m), db(dbias0);
  for (int64_t i = 0; i < m; ++i) u[i] = xb[i] + bias[i % C];
  ref::GeluForward(yb.data(), u.data(), m);
  ref::GeluBackward(gb.data(), u.data(), doutb.data(), m);
  for (int64_t c = 0; c < C; ++c) {
    double acc = 0.0;
    for (int64_t r = 0; r < N; ++r) acc += gb[r * C + c];
    db[c] = static_cast<float>(db[c] + acc);
  }
  s.Close("BiasGeluForward (N=7, C=45)", d_y.Download(), yb, 1e-5, 1e-6);
  s.Close("BiasGeluBackward dx", d_dx.Download(), gb, 1e-5, 1e-6);
  s.Close("BiasGeluBackward dbias (accumulated)", d_dbias.Download(), db, 1e-5, 1e-5);
}

void SanityLayerNorm(Sanity& s) {
  const int64_t N = 130, C = 300, n = N * C;
  const float eps = 1e-5f;
  const auto x = Random(n, 10, -2.0f, 3.0f), w = Random(C, 11), b = Random(C, 12), dout = Random(n, 13);
  const auto dx0 = Random(n, 14), dw0 = Random(C, 15), db0 = Random(C, 16);
  std::vector<float> out(n), mean(N), rstd(N), dx(dx0), dw(dw0), db(db0);
  ref::LayerNormForward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, eps);
  ref::LayerNormBackward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(), rstd.data(), N,
                         C);
  DevBuf<float> d_x(x, "x"), d_w(w, "w"), d_b(b, "b"), d_out(n, "out"), d_mean(N, "mean"), d_rstd(N, "rstd");
  // dsum: the accumulated dx's column sums added to a residual branch's bias gradient (as the model runs it).
  const auto dsum0 = Random(C, 17);
  std::vector<float> dsum(dsum0);
  for (int64_t c = 0; c < C; ++c) {
    double acc = 0.0;
    for (int64_t r = 0; r < N; ++r) acc += dx[r * C + c];
    dsum[c] = static_cast<float>(dsum0[c] + acc);
  }
  DevBuf<float> d_dout(dout, "dout"), d_dx(dx0, "dx"), d_dw(dw0, "dw"), d_db(db0, "db"), d_dsum(dsum0, "dsum");
  DevBuf<float> scratch(k::LayerNormBackwardScratchFloats(N, C), "scratch");
  s.Run("LayerNormForward", k::LayerNormForward(d_out.get(), d_mean.get(), d_rstd.get(), d_x.get(), d_w.get(),
                                                d_b.get(), N, C, eps, s.stream()));
  s.Run("LayerNormBackward",
        k::LayerNormBackward(d_dx.get(), d_dw.get(), d_db.get(), scratch.get(), d_dout.get(), d_x.get(), d_w.get(),
                             d_mean.get(), d_rstd.get(), N, C, s.stream(), nullptr, d_dsum.get()));
  s.Close("LayerNormForward out (N=130, C=300)", d_out.Download(), out, 1e-5, 1e-5);
  s.Close("LayerNormForward mean", d_mean.Download(), mean, 1e-5, 1e-6);
  s.Close("LayerNormForward rstd", d_rstd.Download(), rstd, 1e-5, 1e-6);
  s.Close("LayerNormBackward dx (accumulated)", d_dx.Download(), dx, 1e-4, 1e-5);
  s.Close("LayerNormBackward dw (accumulated)", d_dw.Download(), dw, 1e-4, 1e-5);
  s.Close("LayerNormBackward db (accumulated)", d_db.Download(), db, 1e-4, 1e-5);
  s.Close("LayerNormBackward dsum (column sums of dx, accumulated)", d_dsum.Download(), dsum, 1e-4, 1e-4);
  {  // dout in bf16 (runtime.activations: bf16): the bits of the fp32 launcher on it widened
    DevBuf<bf16> d_dout16(n, "dout bf16");
    DevBuf<float> d_widened(n, "dout widened"), d_dx1(dx0, "dx"), d_dw1(dw0, "dw"), d_db1(db0, "db"), d_dx2(dx0, "dx"),
        d_dw2(dw0, "dw"), d_db2(db0, "db");
    s.Run("CastFloatToBf16", k::CastFloatToBf16(d_dout16.get(), d_dout.get(), n, s.stream()));
    s.Run("CastBf16ToFloat", k::CastBf16ToFloat(d_widened.get(), d_dout16.get(), n, s.stream()));
    s.Run("LayerNormBackward",
          k::LayerNormBackward(d_dx1.get(), d_dw1.get(), d_db1.get(), scratch.get(), d_widened.get(), d_x.get(),
                               d_w.get(), d_mean.get(), d_rstd.get(), N, C, s.stream()));
    const bf16* dout16 = d_dout16.get();
    s.Run("LayerNormBackward (bf16 dout)",
          k::LayerNormBackward(d_dx2.get(), d_dw2.get(), d_db2.get(), scratch.get(), dout16, d_x.get(), d_w.get(),
                               d_mean.get(), d_rstd.get(), N, C, s.stream()));
    s.Exact("LayerNormBackward bf16 dout: dx (= fp32 on it widened)", d_dx2.Download(), d_dx1.Download());
    s.Exact("LayerNormBackward bf16 dout: dw", d_dw2.Download(), d_dw1.Download());
    s.Exact("LayerNormBackward bf16 dout: db", d_db2.Download(), d_db1.Download());
  }
  {  // the residual add fused into the LayerNorm: the bits of the unfused pair
    DevBuf<float> d_part(Random(N * C, 48), "part"), d_res(N * C, "res"), d_out2(N * C, "out"), d_mean2(N, "mean"),
        d_rstd2(N, "rstd"), d_res_ref(N * C, "res ref");
    s.Run("ResidualAdd",
          k::ResidualAdd(d_res_ref.get(), d_x.get(), d_part.get(), d_b.get(), nullptr, N, C, s.stream()));
    s.Run("LayerNormForward", k::LayerNormForward(d_out.get(), d_mean.get(), d_rstd.get(), d_res_ref.get(), d_w.get(),
                                                  d_b.get(), N, C, eps, s.stream()));
    s.Run("ResidualLayerNormForward",
          k::ResidualLayerNormForward(d_res.get(), d_out2.get(), d_mean2.get(), d_rstd2.get(), d_x.get(), d_part.get(),
                                      d_b.get(), nullptr, d_w.get(), d_b.get(), N, C, eps, s.stream()));
    s.Exact("ResidualLayerNormForward res (= ResidualAdd)", d_res.Download(), d_res_ref.Download());
    // (the emulated tests check these bit for bit; here a tolerance, should nvcc contract the two inlined copies
    // of the normalization differently)
    s.Close("ResidualLayerNormForward out (= LayerNormForward of it)", d_out2.Download(), d_out.Download(), 1e-6, 1e-6);
    s.Close("ResidualLayerNormForward rstd", d_rstd2.Download(), d_rstd.Download(), 1e-6, 1e-7);
    // part in bf16 (runtime.activations: bf16): the bits of the fp32 launcher on it widened
    DevBuf<bf16> d_part16(N * C, "part bf16");
    DevBuf<float> d_widened(N * C, "part widened"), d_res3(N * C, "res"), d_out3(N * C, "out"), d_mean3(N, "mean"),
        d_rstd3(N, "rstd");
    s.Run("CastFloatToBf16", k::CastFloatToBf16(d_part16.get(), d_part.get(), N * C, s.stream()));
    s.Run("CastBf16ToFloat", k::CastBf16ToFloat(d_widened.get(), d_part16.get(), N * C, s.stream()));
    s.Run(
        "ResidualLayerNormForward",
        k::ResidualLayerNormForward(d_res.get(), d_out2.get(), d_mean2.get(), d_rstd2.get(), d_x.get(), d_widened.get(),
                                    d_b.get(), nullptr, d_w.get(), d_b.get(), N, C, eps, s.stream()));
    const bf16* part16 = d_part16.get();
    s.Run("ResidualLayerNormForward (bf16 part)",
          k::ResidualLayerNormForward(d_res3.get(), d_out3.get(), d_mean3.get(), d_rstd3.get(), d_x.get(), part16,
                                      d_b.get(), nullptr, d_w.get(), d_b.get(), N, C, eps, s.stream()));
    s.Exact("ResidualLayerNormForward bf16 part: res (= fp32 on it widened)", d_res3.Download(), d_res.Download());
    s.Exact("ResidualLayerNormForward bf16 part: out", d_out3.Download(), d_out2.Download());
  }
}

void SanityAttention(Sanity& s) {
  const int64_t B = 1, T = 70, H = 2, D = 64;
  for (int64_t window : {int64_t{0}, int64_t{16}}) {
    const int64_t n_qkv = B * T * 3 * H * D, n_out = B * T * H * D, n_lse = B * H * T;
    const auto qkv = Random(n_qkv, 101, -2.0f, 2.0f), dout = Random(n_out, 102);
    std::vector<float> out(n_out), lse(n_lse), dqkv(n_qkv);
    ref::AttentionForward(out.data(), lse.data(), qkv.data(), B, T, H, D, window);
    ref::AttentionBackward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, H, D, window);
    DevBuf<float> d_qkv(qkv, "qkv"), d_out(n_out, "out"), d_lse(n_lse, "lse"), d_dout(dout, "dout"),
        d_dqkv(n_qkv, "dqkv");
    DevBuf<float> scratch(k::AttentionBackwardScratchFloats(B, T, H, D), "scratch");
    const std::string shape = fmt::format("(B=1, T=70, H=2, D=64, window={})", window);
    s.Run("AttentionForward",
          k::AttentionForward(d_out.get(), d_lse.get(), d_qkv.get(), B, T, H, D, window, s.stream()));
    s.Run("AttentionBackward", k::AttentionBackward(d_dqkv.get(), scratch.get(), d_dout.get(), d_qkv.get(), d_out.get(),
                                                    d_lse.get(), B, T, H, D, window, s.stream()));
    s.Close("AttentionForward out " + shape, d_out.Download(), out, 1e-4, 1e-5);
    s.Close("AttentionForward lse", d_lse.Download(), lse, 1e-4, 1e-5);
    s.Close("AttentionBackward dqkv", d_dqkv.Download(), dqkv, 1e-3, 1e-4);
    // The tensor-core kernels against the reference on bf16-rounded inputs (tolerances of
    // tests/kernels/attention_test.cpp).
    auto rounded = [](std::vector<float> v) {
      for (float& x : v) x = __bfloat162float(__float2bfloat16(x));
      return v;
    };
    const auto qkv_r = rounded(qkv), dout_r = rounded(dout);
    ref::AttentionForward(out.data(), lse.data(), qkv_r.data(), B, T, H, D, window);
    ref::AttentionBackward(dqkv.data(), dout_r.data(), qkv_r.data(), out.data(), lse.data(), B, T, H, D, window);
    s.Run("AttentionForwardBf16",
          k::AttentionForwardBf16(d_out.get(), d_lse.get(), d_qkv.get(), B, T, H, D, window, s.stream()));
    s.Run("AttentionBackwardBf16", k::AttentionBackwardBf16(d_dqkv.get(), scratch.get(), d_dout.get(), d_qkv.get(),
                                                            d_out.get(), d_lse.get(), B, T, H, D, window, s.stream()));
    s.Close("AttentionForwardBf16 out " + shape, d_out.Download(), out, 1e-2, 1e-2);
    s.Close("AttentionForwardBf16 lse", d_lse.Download(), lse, 1e-4, 1e-4);
    const std::vector<float> got_dqkv = d_dqkv.Download();
    s.Close("AttentionBackwardBf16 dqkv", got_dqkv, dqkv, 2e-2, 2e-2);
    // The 5-product backward (dS kept in bf16 tiles between its kernels: runtime.attention_stored_ds, training's
    // default) against the same reference.
    DevBuf<bf16> ds_tiles(static_cast<size_t>(k::AttentionDsTileBytes(B, T, H, window) / 2), "attention dS tiles");
    DevBuf<float> d_dqkv_ds(n_qkv, "dqkv");
    s.Run("AttentionBackwardBf16 (stored dS)",
          k::AttentionBackwardBf16(d_dqkv_ds.get(), scratch.get(), d_dout.get(), d_qkv.get(), d_out.get(), d_lse.get(),
                                   B, T, H, D, window, s.stream(), nullptr, nullptr, nullptr, ds_tiles.get()));
    s.Close("AttentionBackwardBf16 dqkv (stored dS)", d_dqkv_ds.Download(), dqkv, 2e-2, 2e-2);
    // As the model runs it with kept operands: no fp32 dqkv, the qkv bias gradient summed as the rows are stored;
    // against the column sums (double) of the dqkv just checked.
    const int64_t cols = 3 * H * D;
    std::vector<float> dbias(cols, 0.0f);
    std::vector<double> sums(cols, 0.0);
    for (int64_t i = 0; i < n_qkv; ++i) sums[i % cols] += got_dqkv[i];
    for (int64_t j = 0; j < cols; ++j) dbias[j] = static_cast<float>(sums[j]);
    DevBuf<bf16> d_dqkv16(n_qkv, "dqkv16");
    DevBuf<float> d_dbias(std::vector<float>(cols, 0.0f), "qkv bias gradient"),
        bias_scratch(k::AttentionBackwardScratchFloats(B, T, H, D) + k::AttentionBiasGradScratchFloats(B, T, H, D),
                     "scratch");
    s.Run("AttentionBackwardBf16 (dqkv16 + qkv bias gradient)",
          k::AttentionBackwardBf16(nullptr, bias_scratch.get(), d_dout.get(), d_qkv.get(), d_out.get(), d_lse.get(), B,
                                   T, H, D, window, s.stream(), d_dqkv16.get(), nullptr, d_dbias.get()));
    s.Close("AttentionBackwardBf16 qkv bias gradient", d_dbias.Download(), dbias, 1e-4, 1e-4);
    // bf16 inputs (runtime.activations: bf16: qkv, dout, and out read back as its rounding), with the qkv bias: the
    // bits of the fp32 kernels on the widened values (the tiles hold the same bf16 values either way).
    auto round = [](const std::vector<float>& v, std::vector<bf16>& b16) {
      b16.resize(v.size());
      std::vector<float> w(v.size());
      for (size_t i = 0; i < v.size(); ++i) {
        b16[i] = __float2bfloat16(v[i]);
        w[i] = __bfloat162float(b16[i]);
      }
      return w;
    };
    std::vector<bf16> q16, g16, o16;
    const std::vector<float> qkv_w = round(qkv, q16), dout_w = round(dout, g16);
    DevBuf<bf16> d_q16(q16, "qkv16"), d_g16(g16, "dout16"), d_o16(n_out, "out16"), d_dq16(n_qkv, "dqkv16 (bf16)");
    DevBuf<float> d_qkv_w(qkv_w, "widened qkv"), d_dout_w(dout_w, "widened dout"),
        d_bias(Random(cols, 103), "qkv bias"), d_lse2(n_lse, "lse"),
        d_db1(std::vector<float>(cols, 0.0f), "qkv bias gradient"),
        d_db2(std::vector<float>(cols, 0.0f), "qkv bias gradient (bf16)");
    s.Run("AttentionForwardBf16 (widened qkv + bias)",
          k::AttentionForwardBf16(d_out.get(), d_lse.get(), d_qkv_w.get(), B, T, H, D, window, s.stream(), nullptr,
                                  d_bias.get()));
    s.Run("AttentionForwardBf16 (bf16 qkv + bias, out16 only)",
          k::AttentionForwardBf16(nullptr, d_lse2.get(), d_q16.get(), B, T, H, D, window, s.stream(), d_o16.get(),
                                  d_bias.get()));
    DevBuf<float> d_out_w(round(d_out.Download(), o16), "out widened from its rounding");
    s.Exact("AttentionForwardBf16 bf16 qkv: out16 (= the rounding of out on the widened qkv)", d_o16.Download(), o16);
    s.Exact("AttentionForwardBf16 bf16 qkv: lse (= on the widened qkv)", d_lse2.Download(), d_lse.Download());
    s.Run(
        "AttentionBackwardBf16 (widened qkv, dout, out + bias)",
        k::AttentionBackwardBf16(nullptr, bias_scratch.get(), d_dout_w.get(), d_qkv_w.get(), d_out_w.get(), d_lse.get(),
                                 B, T, H, D, window, s.stream(), d_dqkv16.get(), d_bias.get(), d_db1.get()));
    s.Run(
        "AttentionBackwardBf16 (bf16 qkv, dout, out16 + bias)",
        k::AttentionBackwardBf16(nullptr, bias_scratch.get(), d_g16.get(), d_q16.get(), nullptr, d_o16.get(),
                                 d_lse.get(), B, T, H, D, window, s.stream(), d_dq16.get(), d_bias.get(), d_db2.get()));
    s.Exact("AttentionBackwardBf16 bf16 inputs: dqkv16 (= on the widened values)", d_dq16.Download(),
            d_dqkv16.Download());
    s.Exact("AttentionBackwardBf16 bf16 inputs: qkv bias gradient", d_db2.Download(), d_db1.Download());
  }
}

void SanityCrossEntropy(Sanity& s) {
  const int64_t N = 5, V = 1000, V0 = 517;  // vocab-parallel: rank 0 holds columns [0, V0), rank 1 [V0, V)
  const auto logits = Random(N * V, 20, -4.0f, 4.0f);
  std::vector<int32_t> targets(N);
  for (int64_t i = 0; i < N; ++i) targets[i] = static_cast<int32_t>((i * 7919 + 3) % V);
  targets[0] = static_cast<int32_t>(V0 - 1);  // last column of rank 0
  targets[1] = -1;                            // ignored
  targets[2] = static_cast<int32_t>(V0);      // first column of rank 1
  const float dloss = 0.37f;
  const std::vector<float> dloss_rows(N, dloss);
  std::vector<float> losses(N), lse(N), dlogits(N * V);
  ref::CrossEntropyForward(losses.data(), lse.data(), logits.data(), targets.data(), N, V);
  ref::CrossEntropyBackward(dlogits.data(), logits.data(), lse.data(), targets.data(), dloss_rows.data(), N, V);

  DevBuf<float> d_logits(logits, "logits"), d_losses(N, "losses"), d_lse(N, "lse"), d_dloss(dloss_rows, "dloss"),
      d_dlogits(N * V, "dlogits");
  DevBuf<int32_t> d_targets(targets, "targets");
  s.Run("CrossEntropyForward",
        k::CrossEntropyForward(d_losses.get(), d_lse.get(), d_logits.get(), d_targets.get(), N, V, s.stream()));
  s.Run("CrossEntropyBackward", k::CrossEntropyBackward(d_dlogits.get(), d_logits.get(), d_lse.get(), d_targets.get(),
                                                        d_dloss.get(), N, V, s.stream()));
  s.Close("CrossEntropyForward losses (N=5, V=1000)", d_losses.Download(), losses, 1e-5, 1e-5);
  s.Close("CrossEntropyForward lse", d_lse.Download(), lse, 1e-5, 1e-5);
  s.Close("CrossEntropyBackward dlogits", d_dlogits.Download(), dlogits, 1e-5, 1e-6);
  DevBuf<float> d_inout(logits, "logits (fused)"), d_losses2(N, "losses"), d_lse2(N, "lse");
  s.Run("CrossEntropyFused", k::CrossEntropyFused(d_losses2.get(), d_lse2.get(), d_inout.get(), d_targets.get(),
                                                  d_dloss.get(), N, V, s.stream()));
  s.Close("CrossEntropyFused losses", d_losses2.Download(), losses, 1e-5, 1e-5);
  s.Close("CrossEntropyFused dlogits (over the logits)", d_inout.Download(), dlogits, 1e-5, 1e-6);
  // On bf16 logits over the first V0 columns: the bits of the fp32 kernel on the widened logits with the rest at -inf
  // (losses, and the gradient's rounding, written over the logits).
  {
    const std::vector<bf16> l16 = ToBf16(logits);
    std::vector<float> wide(logits.size());
    std::vector<int32_t> t16(targets);
    for (auto& t : t16) t = t >= V0 ? static_cast<int32_t>(t % V0) : t;
    for (size_t i = 0; i < wide.size(); ++i) {
      wide[i] = static_cast<int64_t>(i) % V < V0 ? __bfloat162float(l16[i]) : -INFINITY;
    }
    DevBuf<bf16> d_l16(l16, "logits16"), want16(N * V, "dlogits16 (fp32 kernel)");
    DevBuf<float> d_wide(wide, "widened logits"), l3(N, "losses"), z3(N, "lse"), l4(N, "losses"), z4(N, "lse");
    DevBuf<int32_t> d_t16(t16, "targets");
    s.Run("CrossEntropyFused (fp32, widened)", k::CrossEntropyFused(l3.get(), z3.get(), d_wide.get(), d_t16.get(),
                                                                    d_dloss.get(), N, V, s.stream(), want16.get()));
    s.Run("CrossEntropyFused (bf16 logits)",
          k::CrossEntropyFused(l4.get(), z4.get(), d_l16.get(), d_t16.get(), d_dloss.get(), N, V, V0, s.stream()));
    s.Exact("CrossEntropyFused bf16 logits: losses (= fp32 on the widened logits)", l4.Download(), l3.Download());
    s.Exact("CrossEntropyFused bf16 logits: dlogits16 over the logits", d_l16.Download(), want16.Download());
  }

  // Vocab-parallel pieces, tensor parallelism 2 simulated: the cross-rank reductions are done on the host.
  const int64_t vstart[2] = {0, V0}, vlen[2] = {V0, V - V0};
  std::vector<float> shard[2];
  for (int r = 0; r < 2; ++r) {
    for (int64_t i = 0; i < N; ++i) {
      shard[r].insert(shard[r].end(), logits.begin() + i * V + vstart[r], logits.begin() + i * V + vstart[r] + vlen[r]);
    }
  }
  std::vector<float> mx(N, -std::numeric_limits<float>::infinity());
  std::vector<float> mx_local[2], se_local[2], tl_local[2];
  for (int r = 0; r < 2; ++r) {
    DevBuf<float> d_shard(shard[r], "shard"), d_mx(N, "mx"), d_se(N, "se"), d_tl(N, "tl");
    s.Run("VocabParallelRowStats", k::VocabParallelRowStats(d_mx.get(), d_se.get(), d_tl.get(), d_shard.get(),
                                                            d_targets.get(), vstart[r], N, vlen[r], s.stream()));
    std::vector<float> want_mx(N), want_se(N), want_tl(N);
    for (int64_t i = 0; i < N; ++i) {
      const auto row = shard[r].begin() + i * vlen[r];
      want_mx[i] = *std::max_element(row, row + vlen[r]);
      double acc = 0.0;
      for (int64_t j = 0; j < vlen[r]; ++j) acc += std::exp(static_cast<double>(row[j]) - want_mx[i]);
      want_se[i] = static_cast<float>(acc);
      const int64_t local = targets[i] - vstart[r];
      want_tl[i] = (targets[i] >= 0 && local >= 0 && local < vlen[r]) ? row[local] : 0.0f;
    }
    mx_local[r] = d_mx.Download();
    se_local[r] = d_se.Download();
    tl_local[r] = d_tl.Download();
    s.Exact(fmt::format("VocabParallelRowStats max (rank {} of 2)", r), mx_local[r], want_mx);
    s.Close(fmt::format("VocabParallelRowStats sumexp (rank {} of 2)", r), se_local[r], want_se, 2e-6, 0.0);
    s.Exact(fmt::format("VocabParallelRowStats target logit (rank {} of 2)", r), tl_local[r], want_tl);
    for (int64_t i = 0; i < N; ++i) mx[i] = std::max(mx[i], mx_local[r][i]);
  }
  DevBuf<float> d_mx(mx, "mx");
  std::vector<float> se(N, 0.0f), tl(N, 0.0f);
  for (int r = 0; r < 2; ++r) {
    DevBuf<float> d_se(se_local[r], "se"), d_mx_local(mx_local[r], "mx (local)");
    s.Run("VocabParallelRebase", k::VocabParallelRebase(d_se.get(), d_mx_local.get(), d_mx.get(), N, s.stream()));
    std::vector<float> want(N);
    for (int64_t i = 0; i < N; ++i) {
      want[i] = static_cast<float>(se_local[r][i] * std::exp(static_cast<double>(mx_local[r][i]) - mx[i]));
    }
    const std::vector<float> got = d_se.Download();
    s.Close(fmt::format("VocabParallelRebase sumexp (rank {} of 2)", r), got, want, 2e-6, 0.0);
    for (int64_t i = 0; i < N; ++i) {
      se[i] += got[i];
      tl[i] += tl_local[r][i];
    }
  }
  DevBuf<float> d_se(se, "se"), d_tl(tl, "tl"), d_vlosses(N, "losses"), d_vlse(N, "lse");
  s.Run("VocabParallelFinish", k::VocabParallelFinish(d_vlosses.get(), d_vlse.get(), d_mx.get(), d_se.get(), d_tl.get(),
                                                      d_targets.get(), N, s.stream()));
  s.Close("VocabParallelFinish losses (vs unsplit reference)", d_vlosses.Download(), losses, 1e-5, 1e-5);
  s.Close("VocabParallelFinish lse", d_vlse.Download(), lse, 1e-5, 1e-5);
  DevBuf<float> d_ref_lse(lse, "lse");
  for (int r = 0; r < 2; ++r) {
    DevBuf<float> d_shard(shard[r], "shard"), d_dshard(N * vlen[r], "dlogits");
    s.Run("VocabParallelBackward", k::VocabParallelBackward(d_dshard.get(), d_shard.get(), d_ref_lse.get(),
                                                            d_targets.get(), dloss, vstart[r], N, vlen[r], s.stream()));
    std::vector<float> want;
    for (int64_t i = 0; i < N; ++i) {
      want.insert(want.end(), dlogits.begin() + i * V + vstart[r], dlogits.begin() + i * V + vstart[r] + vlen[r]);
    }
    s.Close(fmt::format("VocabParallelBackward dlogits (rank {} of 2)", r), d_dshard.Download(), want, 1e-5, 1e-6);
  }
}

void SanityEmbedding(Sanity& s) {
  const int64_t N = 50, V = 11, C = 37;
  std::mt19937 rng(30);
  std::vector<int32_t> ids(N);
  for (auto& id : ids) id = static_cast<int32_t>(rng() % (V + 1)) - 1;  // -1 .. V-1, many repeats
  const auto table = Random(V * C, 31), dout = Random(N * C, 32), dtable0 = Random(V * C, 33);
  std::vector<float> out(N * C), dtable(dtable0);
  ref::EmbeddingForward(out.data(), ids.data(), table.data(), N, C);
  ref::EmbeddingBackward(dtable.data(), ids.data(), dout.data(), N, C);
  DevBuf<int32_t> d_ids(ids, "ids");
  DevBuf<float> d_table(table, "table"), d_out(N * C, "out"), d_dout(dout, "dout"), d_dtable(dtable0, "dtable");
  s.Run("EmbeddingForward", k::EmbeddingForward(d_out.get(), d_ids.get(), d_table.get(), N, C, s.stream()));
  DevBuf<uint64_t> d_scratch(static_cast<size_t>((k::EmbeddingBackwardScratchBytes(N) + 7) / 8), "embedding scratch");
  s.Run("EmbeddingBackward",
        k::EmbeddingBackward(d_dtable.get(), d_scratch.get(), d_ids.get(), d_dout.get(), N, C, s.stream()));
  s.Exact("EmbeddingForward (N=50, V=11, C=37)", d_out.Download(), out);
  s.Exact("EmbeddingBackward (accumulated)", d_dtable.Download(), dtable);
}

// Per tensor: p, g, m, v, u on the host and the device.
struct OptTensor {
  std::vector<float> p, g, m, v, u;
  std::unique_ptr<DevBuf<float>> dp, dg, dm, dv, du;
};

std::vector<OptTensor> MakeOptTensors(const std::vector<int64_t>& sizes, uint32_t seed) {
  std::vector<OptTensor> ts(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    const size_t n = static_cast<size_t>(sizes[i]);
    const uint32_t sd = seed + 5 * static_cast<uint32_t>(i);
    OptTensor& t = ts[i];
    t.p = Random(n, sd);
    t.g = Random(n, sd + 1);
    t.m = Random(n, sd + 2, -0.1f, 0.1f);
    t.v = Random(n, sd + 3, 0.0f, 0.01f);
    t.u.assign(n, 0.0f);
    t.dp = std::make_unique<DevBuf<float>>(t.p, "p");
    t.dg = std::make_unique<DevBuf<float>>(t.g, "g");
    t.dm = std::make_unique<DevBuf<float>>(t.m, "m");
    t.dv = std::make_unique<DevBuf<float>>(t.v, "v");
    t.du = std::make_unique<DevBuf<float>>(t.u, "u");
  }
  return ts;
}

uint16_t Bf16Bits(float f);  // below

void SanityOptimizers(Sanity& s) {
  // 30 tensors (more than one launch's 24), with an empty, a single-element and odd sizes.
  std::vector<int64_t> sizes = {257, 1, 2500, 0, 9000};
  for (int i = 0; i < 25; ++i) sizes.push_back(1 + 37 * i);
  const ms::ops::AdamParams hp{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f};
  const k::AdamWHyper khp{hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay};
  const int64_t step = 3;
  {
    auto ts = MakeOptTensors(sizes, 100);
    std::vector<k::AdamWTensor> list;
    std::vector<std::unique_ptr<DevBuf<bf16>>> p16;  // the bf16 weight copies, as the model's optimizer writes them
    for (auto& t : ts) {
      list.push_back({t.dp->get(), t.dg->get(), t.dm->get(), t.dv->get(), static_cast<int64_t>(t.p.size())});
      p16.push_back(std::make_unique<DevBuf<bf16>>(std::max<size_t>(t.p.size(), 1), "p16"));
      list.back().p16 = p16.back()->get();
    }
    s.Run("AdamWMultiTensor", k::AdamWMultiTensor(list.data(), static_cast<int>(list.size()), khp, step, s.stream()));
    std::vector<uint16_t> got_p16, want_p16;
    for (size_t i = 0; i < ts.size(); ++i) {
      const std::vector<float> p = ts[i].dp->Download();
      const std::vector<bf16> h = p16[i]->Download();
      for (size_t j = 0; j < ts[i].p.size(); ++j) {
        uint16_t bits;
        std::memcpy(&bits, &h[j], 2);
        got_p16.push_back(bits);
        want_p16.push_back(Bf16Bits(p[j]));
      }
    }
    s.Exact("AdamWMultiTensor p16 (the rounding of the updated p)", got_p16, want_p16);
    std::vector<float> got_p, got_m, got_v, want_p, want_m, want_v;
    for (auto& t : ts) {
      ref::AdamWStep(t.p.data(), t.g.data(), t.m.data(), t.v.data(), static_cast<int64_t>(t.p.size()), hp, step);
      for (auto [got, want, dev, host] :
           {std::tuple{&got_p, &want_p, t.dp.get(), &t.p}, std::tuple{&got_m, &want_m, t.dm.get(), &t.m},
            std::tuple{&got_v, &want_v, t.dv.get(), &t.v}}) {
        const auto d = dev->Download();
        got->insert(got->end(), d.begin(), d.end());
        want->insert(want->end(), host->begin(), host->end());
      }
    }
    s.Close("AdamWMultiTensor p (30 tensors)", got_p, want_p, 1e-5, 1e-6);
    s.Close("AdamWMultiTensor m", got_m, want_m, 1e-5, 1e-6);
    s.Close("AdamWMultiTensor v", got_v, want_v, 1e-5, 1e-6);
  }
  {
    const ms::ops::AdamParams lhp{1e-2f, 0.9f, 0.999f, 1e-6f, 0.01f};
    const k::AdamWHyper lkhp{lhp.lr, lhp.beta1, lhp.beta2, lhp.eps, lhp.weight_decay};
    auto ts = MakeOptTensors(sizes, 200);
    std::vector<k::LambTensor> list;
    for (auto& t : ts) {
      list.push_back(
          {t.du->get(), t.dp->get(), t.dg->get(), t.dm->get(), t.dv->get(), static_cast<int64_t>(t.p.size())});
    }
    s.Run("LambDirectionMultiTensor",
          k::LambDirectionMultiTensor(list.data(), static_cast<int>(list.size()), lkhp, step, s.stream()));
    std::vector<float> got_u, got_m, got_v, want_u, want_m, want_v;
    for (auto& t : ts) {
      ref::LambDirection(t.u.data(), t.p.data(), t.g.data(), t.m.data(), t.v.data(), static_cast<int64_t>(t.p.size()),
                         lhp, step);
      for (auto [got, want, dev, host] :
           {std::tuple{&got_u, &want_u, t.du.get(), &t.u}, std::tuple{&got_m, &want_m, t.dm.get(), &t.m},
            std::tuple{&got_v, &want_v, t.dv.get(), &t.v}}) {
        const auto d = dev->Download();
        got->insert(got->end(), d.begin(), d.end());
        want->insert(want->end(), host->begin(), host->end());
      }
    }
    s.Close("LambDirectionMultiTensor u (30 tensors)", got_u, want_u, 1e-5, 1e-6);
    s.Close("LambDirectionMultiTensor m", got_m, want_m, 1e-5, 1e-6);
    s.Close("LambDirectionMultiTensor v", got_v, want_v, 1e-5, 1e-6);

    // Sums of squares of p, u and g of every tensor: 90 vectors, more than one launch pair's 64.
    std::vector<const float*> xs;
    std::vector<int64_t> ns;
    std::vector<const std::vector<float>*> hosts;
    for (auto& t : ts) {
      t.u = t.du->Download();  // the kernel's u, so that the norms below check SumSquaresMulti alone
      for (auto [dev, host] : {std::pair{t.dp.get(), &t.p}, std::pair{t.du.get(), &t.u}, std::pair{t.dg.get(), &t.g}}) {
        xs.push_back(dev->get());
        ns.push_back(static_cast<int64_t>(host->size()));
        hosts.push_back(host);
      }
    }
    const int nv = static_cast<int>(xs.size());
    DevBuf<double> scratch(static_cast<size_t>(k::SumSquaresScratchDoubles(ns.data(), nv)), "scratch"),
        d_sq(static_cast<size_t>(nv), "sums");
    s.Run("SumSquaresMulti", k::SumSquaresMulti(d_sq.get(), scratch.get(), xs.data(), ns.data(), nv, s.stream()));
    const std::vector<double> sq = d_sq.Download();
    double worst = 0.0;
    for (int i = 0; i < nv; ++i) {
      const double want = ref::SumSquares(hosts[i]->data(), ns[i]);
      const double err = std::fabs(sq[i] - want);
      if (!(err <= 1e-12 * std::fabs(want))) {
        Die(
            fmt::format("SANITY CHECK FAILED: SumSquaresMulti: vector {} (n={}) gives {:.17g}, the CPU reference "
                        "(ms::ops::ref::SumSquares) gives {:.17g} (rtol 1e-12). The kernel is broken: nothing is "
                        "benchmarked.",
                        i, ns[i], sq[i], want));
      }
      worst = std::max(worst, want != 0.0 ? err / std::fabs(want) : err);
    }
    s.Passed("SumSquaresMulti (90 vectors, double)", fmt::format("max rel err {:.2e} (rtol 1e-12)", worst));

    // LambApply with each tensor's trust ratio from those sums.
    std::vector<float> got_p, want_p;
    for (size_t i = 0; i < ts.size(); ++i) {
      OptTensor& t = ts[i];
      const int64_t n = static_cast<int64_t>(t.p.size());
      const float trust = ms::ops::LambTrustRatio(sq[3 * i], sq[3 * i + 1]);
      s.Run("LambApply", k::LambApply(t.dp->get(), t.du->get(), n, lhp.lr, trust, s.stream()));
      ref::LambApply(t.p.data(), t.u.data(), n, lhp.lr, trust);
      const auto d = t.dp->Download();
      got_p.insert(got_p.end(), d.begin(), d.end());
      want_p.insert(want_p.end(), t.p.begin(), t.p.end());
    }
    s.Close("LambApply p (30 tensors)", got_p, want_p, 1e-5, 1e-6);
  }
}

// fp32 -> bf16 round to nearest even, written independently of cuda_bf16.h (as tests/kernels does).
uint16_t Bf16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays (quiet) NaN
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

void SanityCasts(Sanity& s) {
  auto x = Random(4099, 40, -1e3f, 1e3f);
  const float specials[] = {0.0f,
                            -0.0f,
                            1.0f,
                            1.00390625f /* tie: to 1 */,
                            1.01171875f /* tie: up to even */,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::denorm_min(),
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::quiet_NaN()};
  std::copy(std::begin(specials), std::end(specials), x.begin());
  DevBuf<float> d_x(x, "x"), d_back(x.size(), "back");
  DevBuf<bf16> d_b(x.size(), "bf16");
  s.Run("CastFloatToBf16", k::CastFloatToBf16(d_b.get(), d_x.get(), static_cast<int64_t>(x.size()), s.stream()));
  const auto got = d_b.Download();
  std::vector<uint16_t> got_bits(x.size()), want_bits(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    std::memcpy(&got_bits[i], &got[i], 2);
    want_bits[i] = Bf16Bits(x[i]);
    if (std::isnan(x[i]) && std::isnan(__bfloat162float(got[i]))) got_bits[i] = want_bits[i];  // any NaN is fine
  }
  s.Exact("CastFloatToBf16 (round to nearest even, n=4099)", got_bits, want_bits);
  s.Run("CastBf16ToFloat", k::CastBf16ToFloat(d_back.get(), d_b.get(), static_cast<int64_t>(x.size()), s.stream()));
  std::vector<float> want_back(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const uint32_t u = static_cast<uint32_t>(got_bits[i]) << 16;
    std::memcpy(&want_back[i], &u, 4);
  }
  auto back = d_back.Download();
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(back[i]) && std::isnan(want_back[i])) back[i] = want_back[i];
  }
  s.Exact("CastBf16ToFloat (exact widening)", back, want_back);
  // The device's clock: a subtraction, 2 ms of the host's sleep, an addition: at least 2 ms gained (and far below 1 s).
  DevBuf<uint64_t> word(std::vector<uint64_t>{0}, "clock word");
  s.Run("AddDeviceClock (subtract)", k::AddDeviceClock(word.get(), /*add=*/false, s.stream()));
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  s.Run("AddDeviceClock (add)", k::AddDeviceClock(word.get(), /*add=*/true, s.stream()));
  const double gained_ms = static_cast<double>(word.Download()[0]) / 1e6;
  if (!(gained_ms >= 2.0 && gained_ms < 1000.0)) {
    Die(fmt::format("SANITY CHECK FAILED: AddDeviceClock: a pair around a 2 ms sleep gained {:.3f} ms", gained_ms));
  }
  s.Passed("AddDeviceClock (a pair around a 2 ms sleep)", fmt::format("{:.3f} ms gained", gained_ms));
}

void SanityElementwise(Sanity& s) {
  const int64_t n = 1001;
  const auto a = Random(n, 50), b = Random(n, 51);
  {
    DevBuf<float> d_a(a, "a"), d_b(b, "b"), d_out(n, "out");
    std::vector<float> want(a);
    ref::AddInPlace(want.data(), b.data(), n);
    s.Run("AddInPlace", k::AddInPlace(d_a.get(), d_b.get(), n, s.stream()));
    s.Exact("AddInPlace (n=1001)", d_a.Download(), want);
    d_a.Upload(a);
    ref::Add(want.data(), a.data(), b.data(), n);
    s.Run("Add", k::Add(d_out.get(), d_a.get(), d_b.get(), n, s.stream()));
    s.Exact("Add", d_out.Download(), want);
    want = a;
    ref::Scale(want.data(), -0.37f, n);
    s.Run("Scale", k::Scale(d_a.get(), -0.37f, n, s.stream()));
    s.Exact("Scale", d_a.Download(), want);
  }
  const int64_t R = 37, C = 130, m = R * C;
  const auto x = Random(m, 52), part = Random(m, 53), bias = Random(C, 54), bias2 = Random(C, 55), db0 = Random(C, 56);
  {
    DevBuf<float> d_x(x, "x"), d_part(part, "part"), d_bias(bias, "bias"), d_bias2(bias2, "bias2"), d_out(m, "out");
    std::vector<float> want(x);
    for (int64_t r = 0; r < R; ++r) ref::AddInPlace(want.data() + r * C, bias.data(), C);
    s.Run("AddRowBias", k::AddRowBias(d_x.get(), d_bias.get(), R, C, s.stream()));
    s.Exact("AddRowBias (R=37, C=130)", d_x.Download(), want);
    d_x.Upload(x);
    for (int64_t i = 0; i < m; ++i) want[i] = ((x[i] + part[i]) + bias[i % C]) + bias2[i % C];
    s.Run("ResidualAdd",
          k::ResidualAdd(d_out.get(), d_x.get(), d_part.get(), d_bias.get(), d_bias2.get(), R, C, s.stream()));
    s.Exact("ResidualAdd ((x + part) + bias) + bias2", d_out.Download(), want);
    for (int64_t i = 0; i < m; ++i) want[i] = x[i] + part[i];
    s.Run("ResidualAdd", k::ResidualAdd(d_out.get(), d_x.get(), d_part.get(), nullptr, nullptr, R, C, s.stream()));
    s.Exact("ResidualAdd x + part (no biases)", d_out.Download(), want);
  }
  {
    std::vector<float> want(db0);
    for (int64_t c = 0; c < C; ++c) {
      double acc = 0.0;
      for (int64_t r = 0; r < R; ++r) acc += x[r * C + c];
      want[c] = static_cast<float>(db0[c] + acc);
    }
    DevBuf<float> d_dy(x, "dy"), d_db(db0, "db"),
        d_scratch(static_cast<size_t>(k::BiasGradScratchFloats(R, C)), "scratch");
    s.Run("BiasGrad", k::BiasGrad(d_db.get(), d_scratch.get(), d_dy.get(), R, C, s.stream()));
    s.Close("BiasGrad (accumulated, vs double)", d_db.Download(), want, 1e-5, 1e-5);
  }
  {
    const int64_t T = 7, row0 = 5;
    const auto wpe = Random(T * C, 57), dwpe0 = Random(T * C, 58);
    std::vector<float> want_x(x), want_dwpe(dwpe0);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t t = (row0 + r) % T;
      for (int64_t c = 0; c < C; ++c) {
        want_x[r * C + c] += wpe[t * C + c];
        want_dwpe[t * C + c] += x[r * C + c];
      }
    }
    DevBuf<float> d_x(x, "x"), d_wpe(wpe, "wpe"), d_dwpe(dwpe0, "dwpe"), d_dx(x, "dx");
    s.Run("AddPositions", k::AddPositions(d_x.get(), d_wpe.get(), R, C, T, row0, s.stream()));
    s.Exact("AddPositions (R=37, C=130, T=7, row0=5)", d_x.Download(), want_x);
    s.Run("PositionsBackward", k::PositionsBackward(d_dwpe.get(), d_dx.get(), R, C, T, row0, s.stream()));
    s.Exact("PositionsBackward (accumulated)", d_dwpe.Download(), want_dwpe);
  }
}

void SanityGemm(Sanity& s) {
  struct Case {
    bool ta, tb;
    int64_t M, N, K;
    float alpha, beta;
  };
  uint32_t seed = 60;
  for (const Case& c : {Case{false, false, 37, 50, 70, 1.0f, 0.0f}, Case{false, true, 37, 50, 70, 0.75f, 0.5f},
                        Case{true, false, 33, 17, 129, 1.0f, 0.0f}}) {
    const int64_t lda = c.ta ? c.M : c.K, ldb = c.tb ? c.K : c.N, ldc = c.N;
    const int64_t a_rows = c.ta ? c.K : c.M, b_rows = c.tb ? c.N : c.K;
    const auto a = ToBf16(Random(a_rows * lda, seed++)), b = ToBf16(Random(b_rows * ldb, seed++));
    const auto c0 = Random(c.M * ldc, seed++);
    std::vector<float> want(c0);
    const auto af = FromBf16(a), bf = FromBf16(b);
    ref::Gemm(c.ta, c.tb, c.M, c.N, c.K, c.alpha, af.data(), lda, bf.data(), ldb, c.beta, want.data(), ldc);
    DevBuf<bf16> d_a(a, "A"), d_b(b, "B");
    DevBuf<float> d_c(c0, "C"), d_cb(c0, "C (cuBLAS)");
    const std::string shape = fmt::format("{}{} M={} N={} K={} alpha={:g} beta={:g}", c.ta ? 'T' : 'N',
                                          c.tb ? 'T' : 'N', c.M, c.N, c.K, c.alpha, c.beta);
    s.Run("GemmBf16", k::GemmBf16(c.ta, c.tb, c.M, c.N, c.K, c.alpha, d_a.get(), lda, d_b.get(), ldb, c.beta, d_c.get(),
                                  ldc, s.stream()));
    s.Close("GemmBf16 " + shape, d_c.Download(), want, 1e-4, 1e-4);
    BENCH_CUBLAS(GemmRowMajor(s.blas(), c.ta, c.tb, c.M, c.N, c.K, &c.alpha, d_a.get(), lda, d_b.get(), ldb, &c.beta,
                              d_cb.get(), ldc));
    SyncAfter("cublasGemmEx", s.stream());
    s.Close("cuBLAS reference cublasGemmEx " + shape, d_cb.Download(), want, 1e-4, 1e-4);
    // fp32 operands with CUBLAS_COMPUTE_32F_FAST_16BF: the operands here are bf16 values already, so the
    // down-conversion is exact whatever its rounding, and the result is the bf16 GEMM's.
    DevBuf<float> d_af(af, "A fp32"), d_bf(bf, "B fp32"), d_cf(c0, "C (FAST_16BF)");
    BENCH_CUBLAS(GemmRowMajorFast16bf(s.blas(), c.ta, c.tb, c.M, c.N, c.K, &c.alpha, d_af.get(), lda, d_bf.get(), ldb,
                                      &c.beta, d_cf.get(), ldc));
    SyncAfter("cublasGemmEx (FAST_16BF)", s.stream());
    s.Close("cublasGemmEx fp32 in, CUBLAS_COMPUTE_32F_FAST_16BF " + shape, d_cf.Download(), want, 1e-4, 1e-4);
  }
  // The batched reference of attention: S = Q K^T per batch (row-major, as in the benchmark).
  const int64_t batch = 3, T = 33, D = 16;
  const auto q = ToBf16(Random(batch * T * D, seed++)), kk = ToBf16(Random(batch * T * D, seed++));
  const auto qf = FromBf16(q), kf = FromBf16(kk);
  std::vector<float> want(batch * T * T, 0.0f);
  for (int64_t i = 0; i < batch; ++i) {
    ref::Gemm(false, true, T, T, D, 1.0f, qf.data() + i * T * D, D, kf.data() + i * T * D, D, 0.0f,
              want.data() + i * T * T, T);
  }
  DevBuf<bf16> d_q(q, "Q"), d_k(kk, "K");
  DevBuf<float> d_s(want.size(), "S");
  const float one = 1.0f, zero = 0.0f;
  BENCH_CUBLAS(GemmBatchedRowMajor(s.blas(), false, true, T, T, D, &one, d_q.get(), D, T * D, d_k.get(), D, T * D,
                                   &zero, d_s.get(), T, T * T, batch));
  SyncAfter("cublasGemmStridedBatchedEx", s.stream());
  s.Close("cuBLAS reference cublasGemmStridedBatchedEx (3 x NT 33x33x16)", d_s.Download(), want, 1e-4, 1e-4);
}

// ---- timing -----------------------------------------------------------------------------------------------------

struct Timing {
  double median_ms = 0, min_ms = 0, max_ms = 0;
};

class Timer {
 public:
  Timer(cudaStream_t stream, int warmup, int iters) : stream_(stream), warmup_(warmup), iters_(iters) {
    if (g_dry) return;
    events_.resize(2 * static_cast<size_t>(iters));
    for (auto& e : events_) BENCH_CUDA(cudaEventCreate(&e));
  }
  ~Timer() {
    for (auto e : events_) (void)cudaEventDestroy(e);
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

  // warmup launches, then iters launches each between a pair of events on the stream; median of the iters.
  Timing Time(const std::string& what, const std::function<cudaError_t()>& launch) {
    if (g_dry) return {};
    for (int i = 0; i < warmup_; ++i) CheckLaunch(what, launch());
    SyncAfter(what + " (warm-up)", stream_);
    for (int i = 0; i < iters_; ++i) {
      BENCH_CUDA(cudaEventRecord(events_[2 * i], stream_));
      CheckLaunch(what, launch());
      BENCH_CUDA(cudaEventRecord(events_[2 * i + 1], stream_));
    }
    SyncAfter(what, stream_);
    std::vector<double> ms(static_cast<size_t>(iters_));
    for (int i = 0; i < iters_; ++i) {
      float t = 0.0f;
      BENCH_CUDA(cudaEventElapsedTime(&t, events_[2 * i], events_[2 * i + 1]));
      ms[i] = t;
    }
    std::sort(ms.begin(), ms.end());
    const size_t h = ms.size() / 2;
    return {ms.size() % 2 ? ms[h] : 0.5 * (ms[h - 1] + ms[h]), ms.front(), ms.back()};
  }

 private:
  cudaStream_t stream_;
  int warmup_, iters_;
  std::vector<cudaEvent_t> events_;
};

struct Row {
  std::string set, kernel, shape;
  Timing t;
  double bytes = 0, flops = 0;
  Timing ref;  // cuBLAS reference; ref.median_ms == 0: none
  double ref_flops = 0;
  std::string ref_what;
  Unit unit = Unit::kMemory;
  double roof_ms = 0;    // the roofline GPU's time for bytes and flops (RoofSeconds)
  bool skipped = false;  // left out by --rows: not launched, not printed

  double gbps() const { return bytes / (t.median_ms * 1e-3) / 1e9; }
  double tflops() const { return flops / (t.median_ms * 1e-3) / 1e12; }
  double ref_tflops() const { return ref_flops / (ref.median_ms * 1e-3) / 1e12; }
};

struct Shape {
  std::string name;
  int64_t tokens, hidden, heads, vocab, seq, window, layers, tp;
};

class Bench {
 public:
  Bench(cudaStream_t stream, cublasHandle_t blas, int warmup, int iters, double peak_bw, const Roofline& roof)
      : stream_(stream), blas_(blas), timer_(stream, warmup, iters), peak_bw_(peak_bw), roof_(roof) {}
  cudaStream_t stream() const { return stream_; }
  cublasHandle_t blas() const { return blas_; }
  Timer& timer() { return timer_; }
  const std::vector<Row>& rows() const { return rows_; }
  void set_name(const std::string& name) { set_ = name; }

  Row Measure(const std::string& kernel, const std::string& shape, double bytes, double flops,
              const std::function<cudaError_t()>& launch) {
    Row r;
    r.set = set_;
    r.kernel = kernel;
    r.shape = shape;
    r.bytes = bytes;
    r.flops = flops;
    r.unit = UnitOf(kernel);
    r.roof_ms = 1e3 * RoofSeconds(roof_, bytes, flops, r.unit);
    ++g_rows_offered;
    if (!Wanted(kernel, shape)) {
      r.skipped = true;
      return r;
    }
    ++g_rows_run;
    r.t = timer_.Time(kernel + " " + shape, launch);
    return r;
  }
  // Whether --rows selects the row (every row without --rows).
  static bool Wanted(const std::string& kernel, const std::string& shape) {
    return !g_rows || std::regex_search(kernel + " " + shape, *g_rows);
  }
  void Emit(Row r) {
    if (r.skipped) return;
    if (g_dry) {
      fmt::print("{:<28} {:<56} {:>10.2f} {:>10.3f} {:>8} {:>6} {:>9.4f}\n", r.kernel, r.shape, r.bytes / 1e6,
                 r.flops / 1e9, UnitName(r.unit),
                 r.unit != Unit::kMemory &&
                         r.flops / (r.roof_ms * 1e-3) > 0.999 * (r.unit == Unit::kTensorBf16 ? roof_.bf16 : roof_.fp32)
                     ? "math"
                     : "memory",
                 r.roof_ms);
      std::fflush(stdout);
      rows_.push_back(std::move(r));
      return;
    }
    std::string flops = "-", ref = "-", ratio = "-";
    if (r.flops > 0) flops = fmt::format("{:.2f}", r.tflops());
    if (r.ref.median_ms > 0) {
      ref = fmt::format("{:.2f}", r.ref_tflops());
      ratio = fmt::format("{:.1f}%", 100.0 * r.tflops() / r.ref_tflops());
    }
    fmt::print("{:<28} {:<56} {:>9.4f} {:>9.4f} {:>8.1f} {:>6.1f}% {:>8} {:>8} {:>9} {:>9.4f} {:>6.1f}%\n", r.kernel,
               r.shape, r.t.median_ms, r.t.min_ms, r.gbps(), 100.0 * r.gbps() * 1e9 / peak_bw_, flops, ref, ratio,
               r.roof_ms, 100.0 * r.roof_ms / r.t.median_ms);
    std::fflush(stdout);
    rows_.push_back(std::move(r));
  }
  void Run(const std::string& kernel, const std::string& shape, double bytes, double flops,
           const std::function<cudaError_t()>& launch) {
    Emit(Measure(kernel, shape, bytes, flops, launch));
  }

 private:
  cudaStream_t stream_;
  cublasHandle_t blas_;
  Timer timer_;
  double peak_bw_;
  const Roofline& roof_;
  std::string set_;
  std::vector<Row> rows_;
};

constexpr double F = 4.0;  // bytes of a float (and of an int32 id)

void BenchLayerNormGelu(Bench& b, const Shape& s) {
  const int64_t N = s.tokens, C = s.hidden, n = N * C;
  {
    DevBuf<float> x(n, "x"), w(C, "w"), bb(C, "b"), out(n, "out"), mean(N, "mean"), rstd(N, "rstd"), dout(n, "dout"),
        dx(n, "dx"), dw(C, "dw"), db(C, "db"), dsum(C, "dsum");
    // The partials: dw and db, and with dsum the column sums of dx (a third of the scratch).
    const int64_t scratch_n = k::LayerNormBackwardScratchFloats(N, C), dwdb_n = scratch_n / 3 * 2;
    DevBuf<float> scratch(static_cast<size_t>(scratch_n), "LayerNorm scratch");
    Fill(x, 1, -2.0f, 3.0f);
    Fill(w, 2);
    Fill(bb, 3);
    Fill(dout, 4);
    Fill(dx, 5);
    Fill(dw, 6);
    Fill(db, 7);
    const std::string shape = fmt::format("N={} C={}", N, C);
    b.Run("LayerNormForward", shape, F * (2 * n + 2 * C + 2 * N), 0, [&] {
      return k::LayerNormForward(out.get(), mean.get(), rstd.get(), x.get(), w.get(), bb.get(), N, C, 1e-5f,
                                 b.stream());
    });
    // As the model runs every LayerNorm but the first and the final one, with the residual add before it (one
    // bias; sequential block): x and part read, the residual written, the LayerNorm's rounding only (keep).
    DevBuf<float> part(n, "part"), res(n, "res");
    DevBuf<bf16> out16(n, "out bf16");
    Fill(part, 8);
    b.Run("ResidualLayerNormForward", shape + " +bias -> res, out16", F * (3 * n + 3 * C + 2 * N) + 2.0 * n, 0, [&] {
      return k::ResidualLayerNormForward(res.get(), nullptr, mean.get(), rstd.get(), x.get(), part.get(), bb.get(),
                                         nullptr, w.get(), bb.get(), N, C, 1e-5f, b.stream(), out16.get());
    });
    // runtime.activations: bf16 at tp 1 (sequential block): part as its projection GEMM wrote it, in bf16.
    DevBuf<bf16> part16(n, "part bf16");
    Fill(part16, 8);
    const bf16* p16 = part16.get();
    b.Run("ResidualLayerNormForward", shape + " +bias, bf16 part -> res, out16", F * (2 * n + 3 * C + 2 * N) + 4.0 * n,
          0, [&] {
            return k::ResidualLayerNormForward(res.get(), nullptr, mean.get(), rstd.get(), x.get(), p16, bb.get(),
                                               nullptr, w.get(), bb.get(), N, C, 1e-5f, b.stream(), out16.get());
          });
    b.Run("LayerNormBackward", shape, F * (2 * n + C + 2 * N + 2 * n + 4 * C + 2 * dwdb_n), 0, [&] {
      return k::LayerNormBackward(dx.get(), dw.get(), db.get(), scratch.get(), dout.get(), x.get(), w.get(), mean.get(),
                                  rstd.get(), N, C, b.stream());
    });
    // As the model runs it: also summing the accumulated dx's columns into a residual branch's bias gradient (dx
    // read back from the rows the block just wrote: not counted, as the second reads of dout and x are not).
    b.Run("LayerNormBackward", shape + " +dsum", F * (2 * n + C + 2 * N + 2 * n + 6 * C + 2 * scratch_n), 0, [&] {
      return k::LayerNormBackward(dx.get(), dw.get(), db.get(), scratch.get(), dout.get(), x.get(), w.get(), mean.get(),
                                  rstd.get(), N, C, b.stream(), nullptr, dsum.get());
    });
    // runtime.activations: bf16 at tp 1 (sequential block): dout as its GEMM wrote it, in bf16.
    DevBuf<bf16> dout16(n, "dout bf16");
    Fill(dout16, 4);
    const bf16* d16 = dout16.get();
    b.Run("LayerNormBackward", shape + " +dsum, bf16 dout",
          F * (n + C + 2 * N + 2 * n + 6 * C + 2 * scratch_n) + 2.0 * n, 0, [&] {
            return k::LayerNormBackward(dx.get(), dw.get(), db.get(), scratch.get(), d16, x.get(), w.get(), mean.get(),
                                        rstd.get(), N, C, b.stream(), nullptr, dsum.get());
          });
  }
  {
    const int64_t C4 = 4 * C, m = N * C4;  // the MLP activation
    DevBuf<float> x(m, "x"), dout(m, "dout"), y(m, "y"), dx(m, "dx"), bias(C4, "bias"), dbias(C4, "dbias");
    const int64_t bg_n = k::BiasGradScratchFloats(N, C4);
    DevBuf<float> bg_scratch(static_cast<size_t>(bg_n), "bias-grad scratch");
    Fill(x, 8, -3.0f, 3.0f);
    Fill(dout, 9);
    Fill(bias, 10);
    Fill(dbias, 11);
    const std::string shape_n = fmt::format("n={} (N={} x 4C={})", m, N, C4);
    const std::string shape = fmt::format("N={} C={}", N, C4);
    b.Run("GeluForward", shape_n, F * 2 * m, 0, [&] { return k::GeluForward(y.get(), x.get(), m, b.stream()); });
    b.Run("GeluBackward", shape_n, F * 3 * m, 0,
          [&] { return k::GeluBackward(dx.get(), x.get(), dout.get(), m, b.stream()); });
    b.Run("BiasGeluForward", shape, F * (2 * m + C4), 0,
          [&] { return k::BiasGeluForward(y.get(), x.get(), bias.get(), N, C4, b.stream()); });
    b.Run("BiasGeluBackward", shape, F * (3 * m + 3 * C4 + 2 * bg_n), 0, [&] {
      return k::BiasGeluBackward(dx.get(), dbias.get(), bg_scratch.get(), x.get(), bias.get(), dout.get(), N, C4,
                                 b.stream());
    });
    // As the model runs it with runtime.activations: bf16: x (the fc output) and dout (the fc projection's input
    // gradient) in bf16, only dx's rounding written (the fc GEMMs' output gradient).
    DevBuf<bf16> x16(m, "x bf16"), dout16(m, "dout bf16"), dx16(m, "dx bf16");
    Fill(x16, 12);
    Fill(dout16, 13);
    b.Run("BiasGeluBackward", shape + " bf16 x, dout -> dx16", 2.0 * 3 * m + F * (3 * C4 + 2 * bg_n), 0, [&] {
      return k::BiasGeluBackward(nullptr, dbias.get(), bg_scratch.get(), x16.get(), bias.get(), dout16.get(), N, C4,
                                 b.stream(), dx16.get());
    });
  }
}

// sum over t < T of the keys query t sees: min(t + 1, window), or t + 1 without a window.
double KeysSeen(int64_t T, int64_t window) {
  double sum = 0;
  for (int64_t t = 0; t < T; ++t) sum += static_cast<double>(window > 0 ? std::min(t + 1, window) : t + 1);
  return sum;
}

#if defined(MS_BENCH_HAVE_CUDNN)
// cuDNN's fused attention as runtime.attention_kernels: cudnn runs it (lib/cuda/cudnn_sdpa.h: the graphs built as
// cudnn-frontend builds them), on device memory of its own; null (the reason kept) where cuDNN does not load here.
struct CudnnAttention {
  std::unique_ptr<ms::cuda::cudnn::Sdpa> sdpa;
  std::string why;
  void* ws = nullptr;
  size_t ws_bytes = 0;
  std::vector<void*> kept;
  cudaStream_t stream = nullptr;

  explicit CudnnAttention(cudaStream_t s) : stream(s) {
    if (g_dry) return;
    ms::cuda::cudnn::Sdpa::Memory m;
    m.workspace = [this](size_t n) -> ms::Result<void*> {
      if (n > ws_bytes) {  // grown between measurements only (the first call of a shape, before its timing)
        if (cudaStreamSynchronize(stream) != cudaSuccess) return ms::Internal("cuDNN workspace: stream failed");
        if (ws) cudaFree(ws);
        ws = nullptr;
        ws_bytes = 0;
        if (cudaMalloc(&ws, n) != cudaSuccess) return ms::Internal("cuDNN workspace: cudaMalloc of {} bytes", n);
        ws_bytes = n;
      }
      return ws;
    };
    m.zero = [this](void* p, size_t n) -> ms::Status {
      if (cudaMemsetAsync(p, 0, n, stream) != cudaSuccess) return ms::Internal("cuDNN dQacc: cudaMemsetAsync");
      return ms::Status::Ok();
    };
    m.keep = [this](const void* host, size_t n) -> ms::Result<void*> {
      void* p = nullptr;
      if (cudaMalloc(&p, n) != cudaSuccess) return ms::Internal("cuDNN: cudaMalloc of {} bytes", n);
      kept.push_back(p);
      if (cudaMemcpy(p, host, n, cudaMemcpyHostToDevice) != cudaSuccess) return ms::Internal("cuDNN: cudaMemcpy");
      return p;
    };
    auto made = ms::cuda::cudnn::Sdpa::Create(s, std::move(m));
    if (made.ok()) {
      sdpa = std::move(made).value();
    } else {
      why = made.status().message();
    }
  }
  ~CudnnAttention() {
    if (g_dry) return;  // nothing was made
    (void)cudaStreamSynchronize(stream);
    sdpa.reset();
    if (ws) cudaFree(ws);
    for (void* p : kept) cudaFree(p);
  }
  // A call's Status as the timer's launch result (the message printed where it failed).
  static cudaError_t Launched(const ms::Status& st) {
    if (st.ok()) return cudaSuccess;
    fmt::print(stderr, "cuDNN attention: {}\n", st.message());
    return cudaErrorUnknown;
  }
};
#endif

void BenchAttention(Bench& b, const Shape& s) {
  const int64_t T = s.seq, B = s.tokens / s.seq, H = s.heads, D = s.hidden / s.heads;
  const int64_t n_qkv = B * T * 3 * H * D, n_out = B * T * H * D, n_lse = B * H * T;
  const int64_t scratch_n = k::AttentionBackwardScratchFloats(B, T, H, D);

  // cuBLAS reference: the two batched GEMMs of dense (unfused) attention, S = Q K^T (T x T x D) and O = P V
  // (T x D x T), batch B*H, bf16 in, fp32 out; its FLOP rate is what the fused fp32 kernels are compared with.
  Timing ref;
  const int64_t BH = B * H;
  const double ref_flops = 4.0 * static_cast<double>(BH) * T * T * D;
  {
    DevBuf<bf16> q(BH * T * D, "Q"), kk(BH * T * D, "K"), v(BH * T * D, "V"), p(BH * T * T, "P");
    DevBuf<float> sc(BH * T * T, "S"), o(BH * T * D, "O");
    Fill(q, 20);
    Fill(kk, 21);
    Fill(v, 22);
    Fill(p, 23);
    const float one = 1.0f, zero = 0.0f;
    ref = b.timer().Time("cuBLAS attention reference", [&] {
      BENCH_CUBLAS(GemmBatchedRowMajor(b.blas(), false, true, T, T, D, &one, q.get(), D, T * D, kk.get(), D, T * D,
                                       &zero, sc.get(), T, T * T, BH));
      BENCH_CUBLAS(GemmBatchedRowMajor(b.blas(), false, false, T, D, T, &one, p.get(), T, T * T, v.get(), D, T * D,
                                       &zero, o.get(), D, T * D, BH));
      return cudaSuccess;
    });
  }

  DevBuf<float> qkv(n_qkv, "qkv"), out(n_out, "out"), lse(n_lse, "lse"), dout(n_out, "dout"), dqkv(n_qkv, "dqkv"),
      scratch(static_cast<size_t>(scratch_n), "attention scratch");
  const int64_t bias_n = k::AttentionBiasGradScratchFloats(B, T, H, D);
  DevBuf<float> keep_scratch(static_cast<size_t>(scratch_n + bias_n), "attention scratch (qkv bias gradient)"),
      dbias(3 * H * D, "qkv bias gradient");
  DevBuf<bf16> dqkv16(n_qkv, "dqkv16"), qkv16(n_qkv, "qkv16"), dout16(n_out, "dout16"), out16(n_out, "out16");
  DevBuf<float> qkv_bias(3 * H * D, "qkv bias");
  // The stored-dS backward's tiles (the most: without a window).
  DevBuf<bf16> ds_tiles(static_cast<size_t>(k::AttentionDsTileBytes(B, T, H, 0) / 2 + 8), "attention dS tiles");
  Fill(qkv, 24, -2.0f, 2.0f);
  Fill(qkv16, 26);
  Fill(dout16, 28);
  Fill(out16, 29);
  Fill(qkv_bias, 27);
  Fill(dout, 25);
  Fill(lse, 30, 0.0f, 7.0f);  // finite row statistics for a backward row whose forward rows --rows left out
  std::vector<int64_t> windows = {0};
  if (s.window > 0) windows.push_back(s.window);
#if defined(MS_BENCH_HAVE_CUDNN)
  CudnnAttention cudnn(b.stream());
  bool cudnn_checked = false;
  DevBuf<float> cudnn_rows(n_lse, "cuDNN row terms");
#endif
  for (int64_t window : windows) {
    const double fwd_flops = 4.0 * B * H * D * KeysSeen(T, window);
    const std::string shape = fmt::format("B={} T={} H={} D={} window={}", B, T, H, D, window);
    Row f = b.Measure("AttentionForward", shape, F * (n_qkv + n_out + n_lse), fwd_flops, [&] {
      return k::AttentionForward(out.get(), lse.get(), qkv.get(), B, T, H, D, window, b.stream());
    });
    f.ref = ref;
    f.ref_flops = ref_flops;
    f.ref_what = "cublasGemmStridedBatchedEx S = Q K^T and O = P V";
    b.Emit(f);
    // Both backwards form the scores and dP twice (dK/dV and dQ kernels): 7 products of the forward's 2.
    const double bwd_flops = 3.5 * fwd_flops, bwd_bytes = F * (n_out + n_qkv + n_out + n_lse + n_qkv + 2 * scratch_n);
    Row r = b.Measure("AttentionBackward", shape, bwd_bytes, bwd_flops, [&] {
      return k::AttentionBackward(dqkv.get(), scratch.get(), dout.get(), qkv.get(), out.get(), lse.get(), B, T, H, D,
                                  window, b.stream());
    });
    r.ref = ref;
    r.ref_flops = ref_flops;
    r.ref_what = f.ref_what;
    b.Emit(r);
    if (D % 16 != 0) continue;  // the tensor-core kernels need D a multiple of 16
    Row tf = b.Measure("AttentionForwardBf16", shape, F * (n_qkv + n_out + n_lse), fwd_flops, [&] {
      return k::AttentionForwardBf16(out.get(), lse.get(), qkv.get(), B, T, H, D, window, b.stream());
    });
    tf.ref = ref;
    tf.ref_flops = ref_flops;
    tf.ref_what = f.ref_what;
    b.Emit(tf);
    Row tb = b.Measure("AttentionBackwardBf16", shape, bwd_bytes, bwd_flops, [&] {
      return k::AttentionBackwardBf16(dqkv.get(), scratch.get(), dout.get(), qkv.get(), out.get(), lse.get(), B, T, H,
                                      D, window, b.stream());
    });
    tb.ref = ref;
    tb.ref_flops = ref_flops;
    tb.ref_what = f.ref_what;
    b.Emit(tb);
    // As the model runs it with kept operands: dqkv's bf16 rounding instead of its fp32 value, and the qkv bias
    // gradient summed as the rows are stored (16-row chunk sums written and read once).
    const double keep_bytes = bwd_bytes - F * n_qkv + 2.0 * n_qkv + 2 * F * bias_n;
    Row tk = b.Measure("AttentionBackwardBf16", shape + " dqkv16+dbias", keep_bytes, bwd_flops, [&] {
      return k::AttentionBackwardBf16(nullptr, keep_scratch.get(), dout.get(), qkv.get(), out.get(), lse.get(), B, T, H,
                                      D, window, b.stream(), dqkv16.get(), nullptr, dbias.get());
    });
    tk.ref = ref;
    tk.ref_flops = ref_flops;
    tk.ref_what = f.ref_what;
    b.Emit(tk);
    // runtime.activations: bf16: qkv, dout and (backward) out in bf16, as the model runs them with kept operands:
    // the forward writes only out's rounding, the backward reads it; the qkv bias added at load — as training runs
    // them with runtime.gemm_epilogues: false. With the epilogues (the default) the qkv GEMM adds the bias and
    // training runs the `... no bias` rows below (the backward still summing the bias gradient).
    const double q16_fwd_bytes = 2.0 * (n_qkv + n_out) + F * n_lse,
                 q16_bwd_bytes = 2.0 * (n_out + n_qkv + n_out + n_qkv) + F * (n_lse + 2 * scratch_n + 2 * bias_n);
    Row qf = b.Measure("AttentionForwardBf16", shape + " bf16 qkv+bias, out16", q16_fwd_bytes, fwd_flops, [&] {
      return k::AttentionForwardBf16(nullptr, lse.get(), qkv16.get(), B, T, H, D, window, b.stream(), out16.get(),
                                     qkv_bias.get());
    });
    qf.ref = ref;
    qf.ref_flops = ref_flops;
    qf.ref_what = f.ref_what;
    b.Emit(qf);
    // Where the bf16 path's extra time goes (on the H200 it was slower than fp32 qkv without a bias, cause not
    // isolated): the same without the bias, and fp32 qkv with it.
    Row qn = b.Measure("AttentionForwardBf16", shape + " bf16 qkv, out16, no bias", q16_fwd_bytes, fwd_flops, [&] {
      return k::AttentionForwardBf16(nullptr, lse.get(), qkv16.get(), B, T, H, D, window, b.stream(), out16.get(),
                                     nullptr);
    });
    Row fq = b.Measure("AttentionForwardBf16", shape + " qkv+bias", F * (n_qkv + n_out + n_lse), fwd_flops, [&] {
      return k::AttentionForwardBf16(out.get(), lse.get(), qkv.get(), B, T, H, D, window, b.stream(), nullptr,
                                     qkv_bias.get());
    });
    for (Row* r : {&qn, &fq}) {
      r->ref = ref;
      r->ref_flops = ref_flops;
      r->ref_what = f.ref_what;
      b.Emit(*r);
    }
    Row qb = b.Measure("AttentionBackwardBf16", shape + " bf16 in, dqkv16+dbias", q16_bwd_bytes, bwd_flops, [&] {
      return k::AttentionBackwardBf16(nullptr, keep_scratch.get(), dout16.get(), qkv16.get(), nullptr, out16.get(),
                                      lse.get(), B, T, H, D, window, b.stream(), dqkv16.get(), qkv_bias.get(),
                                      dbias.get());
    });
    Row qbn =
        b.Measure("AttentionBackwardBf16", shape + " bf16 in, dqkv16+dbias, no bias", q16_bwd_bytes, bwd_flops, [&] {
          return k::AttentionBackwardBf16(nullptr, keep_scratch.get(), dout16.get(), qkv16.get(), nullptr, out16.get(),
                                          lse.get(), B, T, H, D, window, b.stream(), dqkv16.get(), nullptr,
                                          dbias.get());
        });
    // What training runs by default (runtime.attention_stored_ds): the dK/dV kernel keeps dS in bf16 tiles and the dQ
    // kernel makes one product per tile pair from them — 5 products (counted as such), plus the tiles written and read.
    const double ds_bytes = static_cast<double>(k::AttentionDsTileBytes(B, T, H, window));
    Row qbs = b.Measure("AttentionBackwardBf16", shape + " bf16 in, dqkv16+dbias, no bias, stored dS",
                        q16_bwd_bytes + 2 * ds_bytes, bwd_flops * 5.0 / 7.0, [&] {
                          return k::AttentionBackwardBf16(
                              nullptr, keep_scratch.get(), dout16.get(), qkv16.get(), nullptr, out16.get(), lse.get(),
                              B, T, H, D, window, b.stream(), dqkv16.get(), nullptr, dbias.get(), ds_tiles.get());
                        });
    for (Row* r : {&qb, &qbn, &qbs}) {
      r->ref = ref;
      r->ref_flops = ref_flops;
      r->ref_what = f.ref_what;
      b.Emit(*r);
    }
    // The same two with the softmax through shared memory (k::SetAttentionTcSoftmax): what the register-resident
    // one (the default where the fragment layout probe holds) gains.
    k::SetAttentionTcSoftmax(k::AttentionTcSoftmax::kShared);
    Row sf = b.Measure("AttentionForwardBf16", shape + " bf16 qkv+bias, out16 smem", q16_fwd_bytes, fwd_flops, [&] {
      return k::AttentionForwardBf16(nullptr, lse.get(), qkv16.get(), B, T, H, D, window, b.stream(), out16.get(),
                                     qkv_bias.get());
    });
    Row sb = b.Measure("AttentionBackwardBf16", shape + " bf16 in, dqkv16+dbias smem", q16_bwd_bytes, bwd_flops, [&] {
      return k::AttentionBackwardBf16(nullptr, keep_scratch.get(), dout16.get(), qkv16.get(), nullptr, out16.get(),
                                      lse.get(), B, T, H, D, window, b.stream(), dqkv16.get(), qkv_bias.get(),
                                      dbias.get());
    });
    k::SetAttentionTcSoftmax(k::AttentionTcSoftmax::kAuto);
    // Training's two rows with the tiles loaded synchronously (k::SetAttentionTcAsyncLoads(false)): what the
    // double-buffered asynchronous copies of the rows above gain.
    k::SetAttentionTcAsyncLoads(false);
    Row yf = b.Measure("AttentionForwardBf16", shape + " bf16 qkv+bias, out16 sync", q16_fwd_bytes, fwd_flops, [&] {
      return k::AttentionForwardBf16(nullptr, lse.get(), qkv16.get(), B, T, H, D, window, b.stream(), out16.get(),
                                     qkv_bias.get());
    });
    Row yb = b.Measure("AttentionBackwardBf16", shape + " bf16 in, dqkv16+dbias sync", q16_bwd_bytes, bwd_flops, [&] {
      return k::AttentionBackwardBf16(nullptr, keep_scratch.get(), dout16.get(), qkv16.get(), nullptr, out16.get(),
                                      lse.get(), B, T, H, D, window, b.stream(), dqkv16.get(), qkv_bias.get(),
                                      dbias.get());
    });
    k::SetAttentionTcAsyncLoads(true);
    // Training's forward with FlashAttention-2's tiling (k::SetAttentionTcWideForward: 128-row blocks, two fragment
    // rows per warp; above D = 64 its query fragments read from shared memory at each key tile).
    k::SetAttentionTcWideForward(true);
    Row wf = b.Measure("AttentionForwardBf16", shape + " bf16 qkv+bias, out16 wide", q16_fwd_bytes, fwd_flops, [&] {
      return k::AttentionForwardBf16(nullptr, lse.get(), qkv16.get(), B, T, H, D, window, b.stream(), out16.get(),
                                     qkv_bias.get());
    });
    k::SetAttentionTcWideForward(false);
    // Training's forward (no bias: the qkv GEMM's epilogue adds it) and backward with the products' loops bounded by D
    // at run time (k::SetAttentionTcFixedBounds(false)), beside `... out16, no bias` and `... no bias, stored dS`:
    // what the compile-time bounds at D == kMaxD gain (the backward's dK/dV kernel has them at D = 64 only).
    k::SetAttentionTcFixedBounds(false);
    Row vf = b.Measure("AttentionForwardBf16", shape + " bf16 qkv, out16, no bias varD", q16_fwd_bytes, fwd_flops, [&] {
      return k::AttentionForwardBf16(nullptr, lse.get(), qkv16.get(), B, T, H, D, window, b.stream(), out16.get(),
                                     nullptr);
    });
    Row vb = b.Measure("AttentionBackwardBf16", shape + " bf16 in, dqkv16+dbias, no bias, stored dS varD",
                       q16_bwd_bytes + 2 * ds_bytes, bwd_flops * 5.0 / 7.0, [&] {
                         return k::AttentionBackwardBf16(
                             nullptr, keep_scratch.get(), dout16.get(), qkv16.get(), nullptr, out16.get(), lse.get(), B,
                             T, H, D, window, b.stream(), dqkv16.get(), nullptr, dbias.get(), ds_tiles.get());
                       });
    k::SetAttentionTcFixedBounds(true);
    // Training's backward (stored dS) and the 7-product one with the split dK/dV kernel (k::SetAttentionTcSplitDkDv:
    // 8 warps of 16 keys x half of D): beside `... no bias, stored dS` and `... no bias`.
    k::SetAttentionTcSplitDkDv(true);
    Row ps = b.Measure("AttentionBackwardBf16", shape + " bf16 in, dqkv16+dbias, no bias, stored dS split",
                       q16_bwd_bytes + 2 * ds_bytes, bwd_flops * 5.0 / 7.0, [&] {
                         return k::AttentionBackwardBf16(
                             nullptr, keep_scratch.get(), dout16.get(), qkv16.get(), nullptr, out16.get(), lse.get(), B,
                             T, H, D, window, b.stream(), dqkv16.get(), nullptr, dbias.get(), ds_tiles.get());
                       });
    Row pn = b.Measure("AttentionBackwardBf16", shape + " bf16 in, dqkv16+dbias, no bias split", q16_bwd_bytes,
                       bwd_flops, [&] {
                         return k::AttentionBackwardBf16(nullptr, keep_scratch.get(), dout16.get(), qkv16.get(),
                                                         nullptr, out16.get(), lse.get(), B, T, H, D, window,
                                                         b.stream(), dqkv16.get(), nullptr, dbias.get());
                       });
    k::SetAttentionTcSplitDkDv(false);
    for (Row* r : {&sf, &sb, &yf, &yb, &wf, &vf, &vb, &ps, &pn}) {
      r->ref = ref;
      r->ref_flops = ref_flops;
      r->ref_what = f.ref_what;
      b.Emit(*r);
    }
    // Above D = 64 kAuto runs the backward's softmax through shared memory, so there the default rows and their
    // `... smem` rows run the same kernels: the 4-warp backward with the register softmax (k::SetAttentionTcSoftmax(
    // kRegisters)), beside `... dqkv16+dbias` and training's `... stored dS`, is what decides whether kAuto should
    // run it in registers again (and with it whether the split dK/dV kernel gives the default's bits there). Where
    // the fragment layout probe does not hold, kRegisters cannot run: a line says so.
    if (D > 64) {
      const std::string rb_shape = shape + " bf16 in, dqkv16+dbias regs",
                        rs_shape = shape + " bf16 in, dqkv16+dbias, no bias, stored dS regs";
      k::SetAttentionTcSoftmax(k::AttentionTcSoftmax::kRegisters);
      auto regs_backward = [&](const float* bias, bf16* tiles) {
        return k::AttentionBackwardBf16(nullptr, keep_scratch.get(), dout16.get(), qkv16.get(), nullptr, out16.get(),
                                        lse.get(), B, T, H, D, window, b.stream(), dqkv16.get(), bias, dbias.get(),
                                        tiles);
      };
      cudaError_t holds = cudaSuccess;
      if (!g_dry &&
          (Bench::Wanted("AttentionBackwardBf16", rb_shape) || Bench::Wanted("AttentionBackwardBf16", rs_shape))) {
        holds = regs_backward(nullptr, nullptr);  // untimed: does the register softmax run on this GPU?
        if (holds != cudaErrorNotSupported) CheckLaunch("AttentionBackwardBf16 " + rb_shape, holds);
      }
      if (holds == cudaErrorNotSupported) {
        fmt::print("AttentionBackwardBf16 {} rows: not run: the fragment layout probe does not hold on this GPU\n",
                   shape + " ... regs");
      } else {
        Row rb = b.Measure("AttentionBackwardBf16", rb_shape, q16_bwd_bytes, bwd_flops,
                           [&] { return regs_backward(qkv_bias.get(), nullptr); });
        Row rs = b.Measure("AttentionBackwardBf16", rs_shape, q16_bwd_bytes + 2 * ds_bytes, bwd_flops * 5.0 / 7.0,
                           [&] { return regs_backward(nullptr, ds_tiles.get()); });
        for (Row* r : {&rb, &rs}) {
          r->ref = ref;
          r->ref_flops = ref_flops;
          r->ref_what = f.ref_what;
          b.Emit(*r);
        }
      }
      k::SetAttentionTcSoftmax(k::AttentionTcSoftmax::kAuto);
    }
#if defined(MS_BENCH_HAVE_CUDNN)
    // runtime.attention_kernels: cudnn, beside training's rows above (`... no bias` forward, `... stored dS`
    // backward): cuDNN's fused forward (out16 and lse) and backward (dqkv16; its row terms and dQ's fp32
    // accumulator written and read: 5 products). A first call of each, untimed, builds the plans (and says which);
    // where cuDNN does not load or take the shape, a line says why and the rows are left out.
    if (!cudnn_checked) {
      cudnn_checked = true;
      if (!g_dry && !cudnn.sdpa) fmt::print("cuDNN attention rows: not run: {}\n", cudnn.why);
    }
    if (g_dry || cudnn.sdpa) {
      const ms::cuda::cudnn::SdpaShape cs{B, T, H, D, window};
      std::string why = ms::cuda::cudnn::Unsupported(cs);
      const std::string cf_shape = shape + " bf16 qkv, out16, no bias cudnn",
                        cb_shape = shape + " bf16 in, dqkv16, no bias cudnn";
      const bool wanted =
          Bench::Wanted("AttentionForwardBf16", cf_shape) || Bench::Wanted("AttentionBackwardBf16", cb_shape);
      if (why.empty() && !g_dry && wanted) {  // (--rows without them: not even the plans built)
        ms::Status st = cudnn.sdpa->Forward(qkv16.get(), out16.get(), lse.get(), cs);
        if (st.ok()) {
          st = cudnn.sdpa->Backward(qkv16.get(), out16.get(), dout16.get(), lse.get(), dqkv16.get(), cudnn_rows.get(),
                                    cs);
        }
        if (st.ok() && cudaStreamSynchronize(b.stream()) != cudaSuccess) st = ms::Internal("execution failed");
        if (st.ok()) {
          fmt::print("cuDNN attention {}: forward {}; backward {}\n", shape,
                     cudnn.sdpa->Describe(cs, ms::cuda::cudnn::Pass::kForward),
                     cudnn.sdpa->Describe(cs, ms::cuda::cudnn::Pass::kBackward));
        } else {
          why = st.message();
        }
      }
      if (!why.empty()) {
        fmt::print("cuDNN attention {}: not run: {}\n", shape, why);
      } else {
        const double cudnn_bwd_bytes = 2.0 * (n_out + n_qkv + n_out + n_qkv) + F * (2 * n_lse + 2 * n_out);
        Row cf = b.Measure("AttentionForwardBf16", cf_shape, q16_fwd_bytes, fwd_flops, [&] {
          return CudnnAttention::Launched(cudnn.sdpa->Forward(qkv16.get(), out16.get(), lse.get(), cs));
        });
        Row cb = b.Measure("AttentionBackwardBf16", cb_shape, cudnn_bwd_bytes, bwd_flops * 5.0 / 7.0, [&] {
          return CudnnAttention::Launched(cudnn.sdpa->Backward(qkv16.get(), out16.get(), dout16.get(), lse.get(),
                                                               dqkv16.get(), cudnn_rows.get(), cs));
        });
        for (Row* r : {&cf, &cb}) {
          r->ref = ref;
          r->ref_flops = ref_flops;
          r->ref_what = f.ref_what;
          b.Emit(*r);
        }
      }
    }
#endif
  }
}

void BenchCrossEntropy(Bench& b, const Shape& s) {
  const int64_t N = s.tokens, V = s.vocab;
  DevBuf<float> logits(N * V, "logits"), dlogits(N * V, "dlogits"), losses(N, "losses"), lse(N, "lse"),
      dloss(N, "dloss"), mx(N, "mx"), se(N, "se"), tl(N, "tl");
  DevBuf<int32_t> targets(RandomIds(N, V, 30), "targets");
  Fill(logits, 31, -4.0f, 4.0f);
  Fill(dloss, 32, 0.1f, 1.0f);
  const std::string shape = fmt::format("N={} V={}", N, V);
  b.Run("CrossEntropyForward", shape, F * (N * V + 3 * N), 0,
        [&] { return k::CrossEntropyForward(losses.get(), lse.get(), logits.get(), targets.get(), N, V, b.stream()); });
  b.Run("CrossEntropyBackward", shape, F * (2 * N * V + 3 * N), 0, [&] {
    return k::CrossEntropyBackward(dlogits.get(), logits.get(), lse.get(), targets.get(), dloss.get(), N, V,
                                   b.stream());
  });
  // Fused: minimum traffic one read and one write of the row (the block's re-reads normally come from L2). It
  // overwrites its input with dlogits; repeated launches run on those (small) values, as fast.
  b.Run("CrossEntropyFused", shape, F * (2 * N * V + 4 * N), 0, [&] {
    return k::CrossEntropyFused(losses.get(), lse.get(), dlogits.get(), targets.get(), dloss.get(), N, V, b.stream());
  });
  // On bf16 logits (runtime.activations: bf16, tp 1), the gradient's rounding written over them: 2 bytes read and 2
  // written per logit. Repeated launches run on the gradients of the first, as fast.
  DevBuf<bf16> logits16(N * V, "logits16");
  Fill(logits16, 33);
  b.Run("CrossEntropyFused", shape + " bf16 logits, dlogits16 over them", 4.0 * N * V + F * 4 * N, 0, [&] {
    return k::CrossEntropyFused(losses.get(), lse.get(), logits16.get(), targets.get(), dloss.get(), N, V, V,
                                b.stream());
  });
  // This rank's shard (vstart 0): the first N * (V / tp) floats of the logits buffer as an (N, V / tp) matrix.
  const int64_t Vl = V / s.tp;
  const std::string vshape = fmt::format("N={} V/tp={} (tp={})", N, Vl, s.tp);
  // Row stats: minimum traffic one read of the shard (the block's second pass normally comes from L2).
  b.Run("VocabParallelRowStats", vshape, F * (N * Vl + 4 * N), 0, [&] {
    return k::VocabParallelRowStats(mx.get(), se.get(), tl.get(), logits.get(), targets.get(), 0, N, Vl, b.stream());
  });
  b.Run("VocabParallelRebase", fmt::format("N={}", N), F * 4 * N, 0,
        [&] { return k::VocabParallelRebase(se.get(), mx.get(), mx.get(), N, b.stream()); });
  b.Run("VocabParallelFinish", fmt::format("N={}", N), F * 6 * N, 0, [&] {
    return k::VocabParallelFinish(losses.get(), lse.get(), mx.get(), se.get(), tl.get(), targets.get(), N, b.stream());
  });
  b.Run("VocabParallelBackward", vshape, F * (2 * N * Vl + 2 * N), 0, [&] {
    return k::VocabParallelBackward(dlogits.get(), logits.get(), lse.get(), targets.get(), 1.0f / N, 0, N, Vl,
                                    b.stream());
  });
}

void BenchEmbeddingPositions(Bench& b, const Shape& s) {
  const int64_t N = s.tokens, C = s.hidden, V = s.vocab, T = s.seq, n = N * C;
  const auto host_ids = RandomIds(N, V, 40);
  const double unique = static_cast<double>(std::set<int32_t>(host_ids.begin(), host_ids.end()).size());
  DevBuf<int32_t> ids(host_ids, "ids");
  DevBuf<float> table(V * C, "table"), dtable(V * C, "dtable"), out(n, "out"), dout(n, "dout"), wpe(T * C, "wpe"),
      dwpe(T * C, "dwpe");
  Fill(table, 41);
  Fill(dtable, 42);
  Fill(dout, 43);
  Fill(wpe, 44);
  Fill(dwpe, 45);
  const std::string shape = fmt::format("N={} C={} V={}", N, C, V);
  b.Run("EmbeddingForward", shape, F * (N + 2 * n), 0,
        [&] { return k::EmbeddingForward(out.get(), ids.get(), table.get(), N, C, b.stream()); });
  // The sort passes over the 8-byte keys (about log2(P)^2 / 2 of them, mostly in shared memory) are left out of
  // the byte count: the roofline is the gradient's own traffic.
  const int64_t emb_scratch = k::EmbeddingBackwardScratchBytes(N);
  DevBuf<uint64_t> scratch(static_cast<size_t>((emb_scratch + 7) / 8), "embedding scratch");
  b.Run("EmbeddingBackward", shape + fmt::format(" ({:.0f} ids)", unique), F * (N + n + 2 * unique * C), 0,
        [&] { return k::EmbeddingBackward(dtable.get(), scratch.get(), ids.get(), dout.get(), N, C, b.stream()); });
  const std::string pshape = fmt::format("R={} C={} T={}", N, C, T);
  b.Run("AddPositions", pshape, F * (2 * n + T * C), 0,
        [&] { return k::AddPositions(out.get(), wpe.get(), N, C, T, 0, b.stream()); });
  b.Run("PositionsBackward", pshape, F * (n + 2 * T * C), 0,
        [&] { return k::PositionsBackward(dwpe.get(), dout.get(), N, C, T, 0, b.stream()); });
}

void BenchElementwise(Bench& b, const Shape& s) {
  const int64_t N = s.tokens, C = s.hidden, n = N * C;
  {
    DevBuf<float> x(n, "x"), y(n, "y"), out(n, "out"), part(n, "part"), bias(C, "bias"), bias2(C, "bias2"), db(C, "db");
    const int64_t bg_n = k::BiasGradScratchFloats(N, C);
    DevBuf<float> bg_scratch(static_cast<size_t>(bg_n), "bias-grad scratch");
    Fill(x, 50);
    Fill(y, 51);
    Fill(part, 52);
    Fill(bias, 53);
    Fill(bias2, 54);
    Fill(db, 55);
    const std::string shape_n = fmt::format("n={} (N x C)", n);
    const std::string shape = fmt::format("R={} C={}", N, C);
    b.Run("AddInPlace", shape_n, F * 3 * n, 0, [&] { return k::AddInPlace(y.get(), x.get(), n, b.stream()); });
    b.Run("Add", shape_n, F * 3 * n, 0, [&] { return k::Add(out.get(), x.get(), y.get(), n, b.stream()); });
    // x *= -1: exact, so repeated launches neither grow nor shrink the values.
    b.Run("Scale", shape_n, F * 2 * n, 0, [&] { return k::Scale(x.get(), -1.0f, n, b.stream()); });
    b.Run("AddRowBias", shape, F * (2 * n + C), 0,
          [&] { return k::AddRowBias(y.get(), bias.get(), N, C, b.stream()); });
    b.Run("ResidualAdd", shape + " +bias +bias2", F * (3 * n + 2 * C), 0,
          [&] { return k::ResidualAdd(out.get(), x.get(), part.get(), bias.get(), bias2.get(), N, C, b.stream()); });
    b.Run("BiasGrad", shape, F * (n + 2 * C + 2 * bg_n), 0,
          [&] { return k::BiasGrad(db.get(), bg_scratch.get(), x.get(), N, C, b.stream()); });
  }
  {
    const int64_t m = N * 4 * C;
    DevBuf<float> x(m, "x"), back(m, "back");
    DevBuf<bf16> h(m, "bf16");
    Fill(x, 56);
    const std::string shape = fmt::format("n={} (N x 4C)", m);
    b.Run("CastFloatToBf16", shape, 6.0 * m, 0, [&] { return k::CastFloatToBf16(h.get(), x.get(), m, b.stream()); });
    b.Run("CastBf16ToFloat", shape, 6.0 * m, 0, [&] { return k::CastBf16ToFloat(back.get(), h.get(), m, b.stream()); });
    // The fc bias gradient over the fc gradient in bf16, as the model runs it after the cuBLASLt DGELU epilogue.
    const int64_t bg_n = k::BiasGradScratchFloats(N, 4 * C);
    DevBuf<float> db(4 * C, "db"), bg_scratch(static_cast<size_t>(std::max<int64_t>(bg_n, 1)), "bias-grad scratch");
    Fill(h, 57);
    b.Run("BiasGrad", fmt::format("R={} C={} bf16 dy (fc)", N, 4 * C), 2.0 * m + F * (2 * 4 * C + 2 * bg_n), 0,
          [&] { return k::BiasGrad(db.get(), bg_scratch.get(), h.get(), N, 4 * C, b.stream()); });
  }
  {
    // The clock kernels that time the device waits inside CUDA graphs (runtime.cuda_graphs at tp > 1: a pair around
    // each of a micro-batch's 4 L tensor-parallel sums, lib/cuda/nccl_comm.cpp), alone in one graph: what they add to
    // a graphed micro-batch's critical path at most (the time of one launch of the graph).
    const int64_t pairs = 4 * s.layers;
    DevBuf<uint64_t> word(1, "clock word");
    cudaGraphExec_t exec = nullptr;
    if (!g_dry) {
      cudaGraph_t graph = nullptr;
      BENCH_CUDA(cudaStreamBeginCapture(b.stream(), cudaStreamCaptureModeThreadLocal));
      for (int64_t i = 0; i < pairs; ++i) {
        CheckLaunch("AddDeviceClock (captured)", k::AddDeviceClock(word.get(), /*add=*/false, b.stream()));
        CheckLaunch("AddDeviceClock (captured)", k::AddDeviceClock(word.get(), /*add=*/true, b.stream()));
      }
      BENCH_CUDA(cudaStreamEndCapture(b.stream(), &graph));
      BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      BENCH_CUDA(cudaGraphDestroy(graph));
    }
    b.Run("AddDeviceClock", fmt::format("{} pairs in one CUDA graph (4 L)", pairs), 0, 0,
          [&] { return cudaGraphLaunch(exec, b.stream()); });
    if (exec) BENCH_CUDA(cudaGraphExecDestroy(exec));
  }
}

// The parameter tensors of a GPT-2 with s.layers layers (wte, wpe, per layer: ln1 w/b, qkv w/b, proj w/b,
// ln2 w/b, fc w/b, fc proj w/b; final ln w/b).
std::vector<int64_t> Gpt2ParamSizes(const Shape& s) {
  const int64_t C = s.hidden;
  std::vector<int64_t> sizes = {s.vocab * C, s.seq * C};
  for (int64_t l = 0; l < s.layers; ++l) {
    for (int64_t n : {C, C, 3 * C * C, 3 * C, C * C, C, C, C, 4 * C * C, 4 * C, 4 * C * C, C}) sizes.push_back(n);
  }
  sizes.push_back(C);
  sizes.push_back(C);
  return sizes;
}

void BenchOptimizers(Bench& b, const Shape& s) {
  const std::vector<int64_t> sizes = Gpt2ParamSizes(s);
  // One allocation per state; each tensor starts at a multiple of 64 floats (256 bytes), as an allocator would.
  std::vector<int64_t> offsets;
  int64_t total = 0, params = 0;
  for (int64_t n : sizes) {
    offsets.push_back(total);
    total += (n + 63) / 64 * 64;
    params += n;
  }
  DevBuf<float> p(total, "params"), g(total, "grads"), m(total, "adam m"), v(total, "adam v"), u(total, "lamb u");
  Fill(p, 60);
  Fill(g, 61);
  Fill(m, 62, -0.1f, 0.1f);
  Fill(v, 63, 0.0f, 0.01f);
  const int count = static_cast<int>(sizes.size());
  std::vector<k::AdamWTensor> adam;
  std::vector<k::LambTensor> lamb;
  std::vector<const float*> xs;
  std::vector<int64_t> ns;
  for (int i = 0; i < count; ++i) {
    const int64_t o = offsets[i], n = sizes[i];
    adam.push_back({p.get() + o, g.get() + o, m.get() + o, v.get() + o, n});
    lamb.push_back({u.get() + o, p.get() + o, g.get() + o, m.get() + o, v.get() + o, n});
    xs.push_back(p.get() + o);  // the trust ratios need ||p|| and ||u|| of every tensor
    xs.push_back(u.get() + o);
    ns.push_back(n);
    ns.push_back(n);
  }
  const k::AdamWHyper hp{3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f};
  const double P = static_cast<double>(params);
  const std::string shape = fmt::format("{} tensors, {:.1f} M params (L={})", count, P / 1e6, s.layers);
  b.Run("AdamWMultiTensor", shape, F * 7 * P, 0,
        [&] { return k::AdamWMultiTensor(adam.data(), count, hp, 10, b.stream()); });
  // As the model's optimizer runs it with runtime.bf16_operands: keep and zero 0: also writing the bf16 weight
  // copies (2 bytes per parameter) that the next step's GEMMs read, instead of a cast per weight.
  DevBuf<bf16> p16(total, "bf16 weight copies");
  std::vector<k::AdamWTensor> adam16 = adam;
  for (int i = 0; i < count; ++i) adam16[static_cast<size_t>(i)].p16 = p16.get() + offsets[i];
  b.Run("AdamWMultiTensor", shape + " +p16", F * 7 * P + 2 * P, 0,
        [&] { return k::AdamWMultiTensor(adam16.data(), count, hp, 10, b.stream()); });
  b.Run("LambDirectionMultiTensor", shape, F * 7 * P, 0,
        [&] { return k::LambDirectionMultiTensor(lamb.data(), count, hp, 10, b.stream()); });
  const int nv = static_cast<int>(xs.size());
  DevBuf<double> scratch(static_cast<size_t>(k::SumSquaresScratchDoubles(ns.data(), nv)), "sumsq scratch"),
      sums(static_cast<size_t>(nv), "sums");
  b.Run("SumSquaresMulti", fmt::format("{} vectors (p, u), {:.1f} M floats", nv, 2 * P / 1e6), F * 2 * P, 0,
        [&] { return k::SumSquaresMulti(sums.get(), scratch.get(), xs.data(), ns.data(), nv, b.stream()); });
  b.Run("LambApply", fmt::format("{} launches (1 per tensor), {:.1f} M params", count, P / 1e6), F * 3 * P, 0, [&] {
    for (int i = 0; i < count; ++i) {
      const cudaError_t e = k::LambApply(p.get() + offsets[i], lamb[i].u, sizes[i], hp.lr, 0.9f, b.stream());
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  });
}

void BenchGemm(Bench& b, const Shape& s) {
  const int64_t N = s.tokens, C = s.hidden, V = s.vocab;
  struct G {
    const char* what;
    bool ta, tb;
    int64_t M, N, K;
  };
  const G gemms[] = {
      {"qkv fwd", false, true, N, 3 * C, C},         {"attn proj fwd", false, true, N, C, C},
      {"fc fwd", false, true, N, 4 * C, C},          {"fc proj fwd", false, true, N, C, 4 * C},
      {"fc proj bwd dx", false, false, N, 4 * C, C}, {"fc proj bwd dW", true, false, C, 4 * C, N},
      {"lm head fwd", false, true, N, V, C},         {"lm head bwd dx", false, false, N, C, V},
      {"lm head bwd dW", true, false, V, C, N},
  };
  uint32_t seed = 70;
  for (const G& g : gemms) {
    const int64_t lda = g.ta ? g.M : g.K, ldb = g.tb ? g.K : g.N, ldc = g.N;
    DevBuf<bf16> a(g.M * g.K, "A"), bm(g.K * g.N, "B");
    DevBuf<float> c(g.M * g.N, "C");
    Fill(a, seed++);
    Fill(bm, seed++);
    const double flops = 2.0 * g.M * g.N * g.K;
    const double bytes = 2.0 * (g.M * g.K + g.K * g.N) + F * g.M * g.N;
    const std::string shape =
        fmt::format("{}{} M={} N={} K={} ({})", g.ta ? 'T' : 'N', g.tb ? 'T' : 'N', g.M, g.N, g.K, g.what);
    Row r = b.Measure("GemmBf16", shape, bytes, flops, [&] {
      return k::GemmBf16(g.ta, g.tb, g.M, g.N, g.K, 1.0f, a.get(), lda, bm.get(), ldb, 0.0f, c.get(), ldc, b.stream());
    });
    const float one = 1.0f, zero = 0.0f;
    auto cublas_bf16 = [&]() -> cudaError_t {
      BENCH_CUBLAS(
          GemmRowMajor(b.blas(), g.ta, g.tb, g.M, g.N, g.K, &one, a.get(), lda, bm.get(), ldb, &zero, c.get(), ldc));
      return cudaSuccess;
    };
    if (!r.skipped) r.ref = b.timer().Time("cublasGemmEx " + shape, cublas_bf16);
    r.ref_flops = flops;
    r.ref_what = "cublasGemmEx, same shape";
    b.Emit(r);

    // The backend's bf16 GEMM as built (its fp32 operands cast by CastFloatToBf16, then cublasGemmEx) against
    // cuBLAS converting fp32 operands itself (CUBLAS_COMPUTE_32F_FAST_16BF): whether the casts can go without
    // bf16 activations. Bytes: the fp32 operands read once.
    DevBuf<float> a32(g.M * g.K, "A fp32"), b32(g.K * g.N, "B fp32");
    Fill(a32, seed++);
    Fill(b32, seed++);
    Row f = b.Measure("GemmFp32Fast16bf", shape, F * (g.M * g.K + g.K * g.N + g.M * g.N), flops, [&] {
      BENCH_CUBLAS(GemmRowMajorFast16bf(b.blas(), g.ta, g.tb, g.M, g.N, g.K, &one, a32.get(), lda, b32.get(), ldb,
                                        &zero, c.get(), ldc));
      return cudaSuccess;
    });
    if (!f.skipped) {
      f.ref = b.timer().Time("casts + cublasGemmEx " + shape, [&] {
        cudaError_t err = k::CastFloatToBf16(a.get(), a32.get(), g.M * g.K, b.stream());
        if (err == cudaSuccess) err = k::CastFloatToBf16(bm.get(), b32.get(), g.K * g.N, b.stream());
        return err != cudaSuccess ? err : cublas_bf16();
      });
    }
    f.ref_flops = flops;
    f.ref_what = "CastFloatToBf16 of A and B, then cublasGemmEx (the backend's bf16 GEMM as built)";
    b.Emit(f);
  }
}

// ---- step prediction --------------------------------------------------------------------------------------------

// One launch of the modelled step: its group, HBM bytes, FLOPs and unit.
struct Launch {
  const char* group;
  double bytes, flops;
  Unit unit;
  double count;  // launches per micro-batch (or per step for the optimizer)
};

// The kernels one training step of a GPT-2 (sequential block, fused bias/GeLU/residual kernels, tp = pp = dp = 1,
// full causal attention) launches on the CUDA backend as built (lib/cuda/cuda_backend.cpp, lib/model/model.cpp)
// with the default runtime.bf16_operands: keep: every linear's input is rounded to bf16 once, by its producer (a
// LayerNorm, the fused bias + GeLU, the attention: 2 more bytes written per element), and the rounding kept for the
// backward's weight gradient; its output gradient likewise by its producer (the LayerNorm backwards, the bias + GeLU
// backward, the attention backward, the cross-entropy); its weight by the optimizer, which writes the bf16 copy with
// its update (zero 0; OptimizerLaunches) instead of a cast kernel per weight per step; an fp32 output
// that nothing but GEMMs reads (the LayerNorm and bias + GeLU outputs, the fc output gradient, dlogits) is not
// written at all, only its rounding (so is dqkv's fp32 value, with the tensor-core attention); the bias + GeLU
// backward sums the bias gradient as it goes, and the tensor-core attention adds the qkv bias as it loads q, k, v (no
// bias pass over qkv) and sums its gradient as it stores dqkv (no pass over dqkv) (every variant);
// cublasGemmEx with fp32 output, the input gradients written (beta 0, no zeroing pass before), the weight gradients
// accumulated;
// attention runs on bf16 tensor cores with fp32 inputs and outputs when D is a multiple of 16
// (kernels/attention_tc.cu), its backward making 5 products with dS kept in bf16 tiles between its two kernels
// (runtime.attention_stored_ds: the tiles written and read once), else on the fp32 kernels, their backward forming 7
// products (S and dP formed twice). `after16`: the target of issue #16 instead: no casts (bf16 activations and a bf16
// weight copy written by the optimizer), bf16 GEMM outputs and activations (half the bytes of every memory-bound
// kernel), attention on bf16 tensor cores with FlashAttention-2's 5-product backward. The launch sequences PredictStep
// sums: as built (keep), as built with runtime.bf16_operands: cast (every GEMM casts its input and weight, the backward
// its output gradient, weight and input again), with cuBLAS converting the fp32 operands (runtime.bf16_operands:
// cublas, assuming the conversion happens in cuBLAS's operand loads: the GEMMs read 4 bytes per operand element, no
// cast kernels), and with issue #16's items done. kBf16Fc: as built with runtime.activations: bf16 (at tp 1 the logits
// in bf16 too, the cross-entropy writing their gradient's rounding over them; with the tensor-core attention its inputs
// in bf16: qkv written by its GEMM, dout by the projection's backward GEMM, out read back as its rounding, its fp32
// value not written) and runtime.gemm_epilogues (the default): the fc GEMM's cuBLASLt epilogue adds the bias (a bf16
// copy cast per call) and applies the GeLU, writing the GeLU input (kept for the backward) and output in bf16; the fc
// projection's backward GEMM's applies gelu' to its input gradient and writes it in bf16; a BiasGrad over it sums the
// fc bias gradient. No bias + GeLU kernel. kBf16FcKernels: the same with runtime.gemm_epilogues: false (the fc GEMM
// writes its output in bf16, which the bias
// + GeLU reads forward and backward; the fc projection's backward writes its input gradient in bf16, which the bias +
// GeLU backward reads).
enum class StepVariant { kAsBuilt, kBf16Fc, kBf16FcKernels, kCastEveryGemm, kCublasOperands, kAfter16 };

std::vector<Launch> StepLaunches(const Shape& s, StepVariant variant) {
  const bool after16 = variant == StepVariant::kAfter16, cublas_converts = variant == StepVariant::kCublasOperands;
  const double N = static_cast<double>(s.tokens), C = static_cast<double>(s.hidden), V = static_cast<double>(s.vocab);
  const double T = static_cast<double>(s.seq), B = N / T, H = static_cast<double>(s.heads), D = C / H, F4 = 4.0 * C;
  const double L = static_cast<double>(s.layers);
  const double act = after16 ? 2.0 : 4.0;  // bytes of an activation element
  std::vector<Launch> out;
  auto mem = [&](const char* group, double elems_act, double elems_fp32, double count) {
    out.push_back({group, act * elems_act + F * elems_fp32, 0.0, Unit::kMemory, count});
  };
  const bool epilogues = variant == StepVariant::kBf16Fc;
  const bool bf16_fc = epilogues || variant == StepVariant::kBf16FcKernels;
  const bool keep = variant == StepVariant::kAsBuilt || bf16_fc;
  // A linear layer, IC -> OC, over N rows: forward (bias: a separate bias add) and backward (dinp, dW, dbias).
  // `rounded_input`, `rounded_dout`: with keep, the input's / output gradient's producer writes its bf16 rounding
  // (no cast kernel).
  // out_bytes / dinp_bytes: bytes of an output element the forward GEMM / the backward's input-gradient GEMM
  // writes (0: an activation's, act).
  auto linear = [&](double IC, double OC, bool bias_add, bool dbias, double count, bool rounded_input,
                    bool rounded_dout, double out_bytes = 0, double dinp_bytes = 0) {
    if (out_bytes == 0) out_bytes = act;
    if (dinp_bytes == 0) dinp_bytes = act;
    if (variant == StepVariant::kCastEveryGemm) {
      mem("casts fp32 -> bf16", 0, 1.5 * (N * IC + OC * IC), count);  // read 4 bytes, write 2 per element
      mem("casts fp32 -> bf16", 0, 1.5 * (N * OC + OC * IC + N * IC), count);
    } else if (keep) {  // the input in forward, the output gradient in backward, unless their producers rounded them
      if (!rounded_input) mem("casts fp32 -> bf16", 0, 1.5 * N * IC, count);
      if (!rounded_dout) mem("casts fp32 -> bf16", 0, 1.5 * N * OC, count);
    }
    const double f = 2.0 * N * IC * OC, op = cublas_converts ? F : 2.0;  // bytes of a GEMM operand element
    out.push_back(
        {"GEMM (bf16 tensor cores)", op * (N * IC + OC * IC) + out_bytes * N * OC, f, Unit::kTensorBf16, count});
    // dinp written, not accumulated (Bf16Copies::dinp_overwrite: no zeroing pass, C not read)
    out.push_back(
        {"GEMM (bf16 tensor cores)", op * (N * OC + OC * IC) + dinp_bytes * N * IC, f, Unit::kTensorBf16, count});
    out.push_back({"GEMM (bf16 tensor cores)", op * (N * IC + N * OC) + 2 * F * OC * IC, f, Unit::kTensorBf16, count});
    if (bias_add) mem("bias, GeLU, residual, bias grad", 2 * N * OC, OC, count);
    if (dbias) mem("bias, GeLU, residual, bias grad", N * OC, 2 * OC, count);
  };
  double keys = 0;
  for (int64_t t = 0; t < s.seq; ++t) keys += static_cast<double>(t + 1);
  const double attn_fwd = 4.0 * B * H * D * keys, n_qkv = 3 * N * C, n_lse = B * H * T;
  const double scratch =
      static_cast<double>(k::AttentionBackwardScratchFloats(s.tokens / s.seq, s.seq, s.heads, s.hidden / s.heads));
  // LayerNorm backward writes and reads its per-block partial sums of dw, db and dx (the column sums of dx: the
  // bias gradients of the residual branches, attn.proj and mlp.proj) once.
  const double ln_scratch = static_cast<double>(k::LayerNormBackwardScratchFloats(s.tokens, s.hidden));
  const bool tc_attention = after16 || static_cast<int64_t>(D) % 16 == 0;
  const Unit attn_unit = tc_attention ? Unit::kTensorBf16 : Unit::kCudaCoreFp32;
  const char* attn = tc_attention ? "attention (bf16 tensor cores)" : "attention (fp32 CUDA cores)";
  // Backward products / forward products: FlashAttention-2's 5 (after16); the tensor-core kernels' 5 too as built
  // (runtime.attention_stored_ds, the default), with the dS tiles written and read once; the fp32 kernels' 7.
  const double attn_bwd = after16 || tc_attention ? 2.5 : 3.5;
  const double ds_tiles = !after16 && tc_attention
                              ? static_cast<double>(k::AttentionDsTileBytes(s.tokens / s.seq, s.seq, s.heads, 0))
                              : 0.0;
  // With bf16_fc and the tensor-core attention (kept operands in these variants) the attention's inputs are bf16:
  // qkv (written by its GEMM), dout (by the projection's backward GEMM) and out, whose fp32 value is not written (the
  // backward reads its rounding).
  const bool attn16 = bf16_fc && tc_attention;
  // With bf16_fc (tp 1, the sequential block of the GPU configs) the LayerNorm input gradients are bf16: written so by
  // the qkv, fc and classifier backward GEMMs and read so by the LayerNorm backwards.
  const bool ln_grad16 = bf16_fc;
  const double ln_dy_act = ln_grad16 ? 0.0 : 1.0, ln_dy_fp32 = ln_grad16 ? 0.5 : 0.0, ln_dinp = ln_grad16 ? 2.0 : act;
  // ... and the attention and MLP projections write their outputs in bf16, which the residual adds read.
  const bool branch16 = bf16_fc;
  const double branch_out = branch16 ? 2.0 : 0.0, part_act = branch16 ? 0.0 : 1.0, part_fp32 = branch16 ? 0.5 : 0.0;
  const double qkv_bytes = attn16 ? 2.0 : act, attn_in = attn16 ? 2.0 : act, out_fp32 = attn16 ? 0.0 : act;
  // keep: the LayerNorms, bias + GeLU (forward and backward) and the cross-entropy write bf16 (2 bytes); where
  // nothing but a GEMM reads the output (the LayerNorm and bias + GeLU forwards, the bias + GeLU backward, dlogits)
  // only the rounding, not the fp32 value (`fp32_out`: 0 with keep, 1 else).
  const double rounding = keep ? 0.5 : 0.0, fp32_out = keep ? 0.0 : 1.0;
  // Per layer.
  // forward x2: each LayerNorm but the chunk's first takes its input from the residual add before it, fused
  // (ResidualLayerNormForward: the row it has just written, not read again; the add's traffic is counted below)
  mem("LayerNorm", (1 + fp32_out) * N * C, 2 * C + 2 * N + rounding * N * C, 1);
  mem("LayerNorm", fp32_out * N * C, 2 * C + 2 * N + rounding * N * C, 2 * L - 1);
  mem("LayerNorm", (3 + ln_dy_act) * N * C, 5 * C + 2 * N + 2 * ln_scratch + (rounding + ln_dy_fp32) * N * C,
      2 * L);  // backward x2
  // qkv (input: ln1; output gradient: attention backward); its bias added by the tensor-core attention as it loads
  // q, k, v (with attn16 and the epilogues by the GEMM's cuBLASLt epilogue as it writes qkv: a bf16 copy of the
  // bias cast per call, not counted), and its bias gradient summed by it as it stores dqkv; with ln_grad16 its input
  // gradient in bf16
  linear(C, 3 * C, !tc_attention, !tc_attention, L, true, true, qkv_bytes, ln_dinp);
  // attention projection (input: attention; dout: ln2 backward); with attn16 its input gradient written in bf16,
  // with branch16 its output
  linear(C, C, false, false, L, true, true, branch_out, attn16 ? 2.0 : act);
  // fc (input: ln2; dout: bias + GeLU backward); with bf16_fc its output written in bf16; with the epilogue also
  // the GeLU output (2 + 2 bytes per element)
  linear(C, F4, false, false, L, true, true, epilogues ? 4.0 : bf16_fc ? 2.0 : act, ln_dinp);
  // fc projection (input: bias + GeLU; dout: ln1 backward); with bf16_fc its input gradient and output written in
  // bf16; with the epilogue it also reads the GeLU input (2 + 2 bytes per element)
  linear(F4, C, false, false, L, true, true, branch_out, epilogues ? 4.0 : bf16_fc ? 2.0 : act);
  // keep: the attention also writes the roundings of out (forward) and dqkv (backward).
  out.push_back({attn, qkv_bytes * n_qkv + out_fp32 * N * C + F * (n_lse + rounding * N * C), attn_fwd, attn_unit, L});
  // With tensor cores the attention backward also sums the qkv bias gradient as it stores dqkv (16-row chunk sums
  // written and read once; no pass over dqkv); with keep it then writes only dqkv's rounding, not its fp32 value.
  const double dqkv_fp32 = keep && tc_attention ? 0.0 : 1.0, bias_parts = tc_attention ? 2.0 * n_qkv / 16 : 0.0;
  out.push_back({attn,
                 attn_in * 2 * N * C + act * dqkv_fp32 * n_qkv + qkv_bytes * n_qkv +
                     F * (n_lse + 2 * scratch + rounding * n_qkv + bias_parts) + 2 * ds_tiles,
                 attn_bwd * attn_fwd, attn_unit, L});
  // The fc output the bias + GeLU reads: an activation (act bytes), or with bf16_fc 2 bytes (half an fp32 element).
  const double fch_act = bf16_fc ? 0.0 : 1.0, fch_fp32 = bf16_fc ? 0.5 : 0.0;
  if (epilogues) {
    mem("bias, GeLU, residual, bias grad", 0, 1.5 * F4, L);               // the fc bias cast to bf16 for the epilogue
    mem("bias, GeLU, residual, bias grad", 0, 0.5 * N * F4 + 2 * F4, L);  // fc bias gradient: BiasGrad over bf16
  } else {
    mem("bias, GeLU, residual, bias grad", (fch_act + fp32_out) * N * F4, F4 + (rounding + fch_fp32) * N * F4,
        L);  // bias + GeLU fwd
    // bias + GeLU backward, the bias gradient summed as dx is computed (BiasGradScratchFloats partials: ignored);
    // with bf16_fc its dout (the fc projection's input gradient) is bf16 too
    mem("bias, GeLU, residual, bias grad", (2 * fch_act + fp32_out) * N * F4,
        3 * F4 + (rounding + 2 * fch_fp32) * N * F4, L);
  }
  // residual adds (+ bias); with branch16 the branch output read in bf16
  mem("bias, GeLU, residual, bias grad", (2 + part_act) * N * C, 2 * C + part_fp32 * N * C, 2 * L);
  // (the bias gradients of proj and fc proj: summed by the LayerNorm backwards that write their output gradient,
  // counted in their scratch)
  // Embedding, final LayerNorm, head, loss (once per micro-batch).
  mem("embedding, positions, loss", 2 * N * C, N, 1);                       // embedding forward
  mem("embedding, positions, loss", 2 * N * C, T * C, 1);                   // positions forward
  mem("embedding, positions, loss", N * C, 2 * T * C, 1);                   // positions backward
  mem("embedding, positions, loss", N * C, N + 2 * std::min(N, V) * C, 1);  // embedding backward
  mem("LayerNorm", (1 + fp32_out) * N * C, 2 * C + 2 * N + rounding * N * C, 1);
  mem("LayerNorm", (3 + ln_dy_act) * N * C, 5 * C + 2 * N + 2 * ln_scratch + (rounding + ln_dy_fp32) * N * C, 1);
  // classifier (input: final LayerNorm; dout: the cross-entropy); with bf16_fc (tp 1) its logits written in bf16, and
  // its input gradient (ln_grad16)
  linear(C, V, false, false, 1, true, true, bf16_fc ? 2.0 : act, ln_dinp);
  // fused cross-entropy over the logits; with bf16_fc it reads bf16 logits and writes the gradient's rounding over them
  if (bf16_fc) {
    mem("embedding, positions, loss", 0, 4 * N + 0.5 * N * V + 0.5 * N * V, 1);
  } else {
    mem("embedding, positions, loss", (1 + fp32_out) * N * V, 4 * N + rounding * N * V, 1);
  }
  return out;
}

// The optimizer of one step: gradient norm (sum of squares) and AdamW over all parameters (fp32 master weights
// and moments); `writes_bf16`: also the bf16 weight copy the next step's GEMMs read (runtime.bf16_operands: keep
// with zero 0, and after #16), 2 bytes per parameter.
std::vector<Launch> OptimizerLaunches(const Shape& s, bool writes_bf16) {
  double P = 0;
  for (int64_t n : Gpt2ParamSizes(s)) P += static_cast<double>(n);
  std::vector<Launch> out;
  out.push_back({"optimizer (AdamW + grad norm)", F * P, 0.0, Unit::kMemory, 1});
  out.push_back({"optimizer (AdamW + grad norm)", F * 7 * P + (writes_bf16 ? 2 * P : 0.0), 0.0, Unit::kMemory, 1});
  return out;
}

// Model FLOPs of one micro-batch, the formula of model::TrainingFlopsPerSequence (docs/ARCHITECTURE.md):
// 6 * N_matmul * tokens + attention 12 * L * C * sum_t keys(t) per sequence; full causal attention here.
double ModelFlops(const Shape& s) {
  const double C = static_cast<double>(s.hidden), L = static_cast<double>(s.layers), V = static_cast<double>(s.vocab);
  const double n_matmul = L * (4 * C * C + 2 * C * 4 * C) + V * C;
  double keys = 0;
  for (int64_t t = 0; t < s.seq; ++t) keys += static_cast<double>(t + 1);
  const double seqs = static_cast<double>(s.tokens / s.seq);
  return 6.0 * n_matmul * static_cast<double>(s.tokens) + 12.0 * L * C * keys * seqs;
}

// Prints the predicted step time and MFU on the roofline GPU: every launch at the roofline (the larger of its
// bytes at peak bandwidth and its FLOPs at the peak of its unit), one after another (no overlap, no launch
// latency, no communication): a lower bound on the step time, so an upper bound on the MFU, of the launch sequence.
void PredictStep(const Shape& s, const Roofline& r, int64_t micro_batches) {
  fmt::print(
      "\nPREDICTION, not a measurement: one step of {} = {} micro-batch(es) x {} tokens (B {} x T {}), "
      "full causal attention, one GPU, at the roofline of {}\n",
      s.name, micro_batches, s.tokens, s.tokens / s.seq, s.seq, r.name);
  const double model = ModelFlops(s) * static_cast<double>(micro_batches);
  for (StepVariant variant : {StepVariant::kAsBuilt, StepVariant::kBf16Fc, StepVariant::kBf16FcKernels,
                              StepVariant::kCastEveryGemm, StepVariant::kCublasOperands, StepVariant::kAfter16}) {
    const bool after16 = variant == StepVariant::kAfter16;
    std::vector<std::pair<std::string, double>> groups;  // insertion order
    double total = 0;
    auto add = [&](const std::vector<Launch>& launches, double times) {
      for (const Launch& l : launches) {
        const double sec = RoofSeconds(r, l.bytes, l.flops, l.unit) * l.count * times;
        auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == l.group; });
        if (it == groups.end()) {
          groups.emplace_back(l.group, sec);
        } else {
          it->second += sec;
        }
        total += sec;
      }
    };
    add(StepLaunches(s, variant), static_cast<double>(micro_batches));
    add(OptimizerLaunches(s, after16 || variant == StepVariant::kAsBuilt || variant == StepVariant::kBf16Fc ||
                                 variant == StepVariant::kBf16FcKernels),
        1.0);
    fmt::print(
        "  {}:\n",
        after16 ? "with issue #16's items done (bf16 activations and GEMM outputs, no casts, 5-product "
                  "attention backward)"
        : variant == StepVariant::kCublasOperands
            ? "as built with runtime.bf16_operands: cublas (no cast kernels; GEMMs read fp32 operands, "
              "assuming cuBLAS converts them as it loads them)"
        : variant == StepVariant::kCastEveryGemm
            ? "as built with runtime.bf16_operands: cast (every GEMM casts its fp32 operands, nothing kept)"
        : variant == StepVariant::kBf16Fc
            ? "as built with runtime.activations: bf16 (as above; the logits and the attention's inputs in bf16; "
              "the fc bias + GeLU in the fc GEMM's cuBLASLt epilogue, writing the GeLU input and output in bf16, and "
              "gelu' in the fc projection's backward GEMM's, runtime.gemm_epilogues)"
        : variant == StepVariant::kBf16FcKernels
            ? "as built with runtime.activations: bf16, runtime.gemm_epilogues: false (the logits and the "
              "attention's inputs in bf16; the fc GEMM writing its output and the fc projection's backward its input "
              "gradient in bf16 for the bias + GeLU kernels)"
            : "as built (bf16 weight copies written by the optimizer with its update, each GEMM input and "
              "output gradient rounded once per micro-batch by the op that writes it, inputs kept for the "
              "backward; "
              "activations fp32 except those only GEMMs read, kept as bf16 alone; tensor-core attention with "
              "fp32 I/O and a 5-product backward keeping dS in bf16 tiles)");
    for (const auto& [group, sec] : groups) {
      fmt::print("    {:<40} {:>9.3f} ms {:>6.1f}%\n", group, sec * 1e3, 100.0 * sec / total);
    }
    fmt::print(
        "    {:<40} {:>9.3f} ms -> {:.0f} tokens/s, model {:.1f} TFLOP/s, MFU {:.1f}% of {:.0f} TFLOP/s "
        "(upper bound: kernels at the roofline)\n",
        "step", total * 1e3, static_cast<double>(s.tokens * micro_batches) / total, model / total / 1e12,
        100.0 * model / total / r.bf16, r.bf16 / 1e12);
  }
}

// ---- machine ----------------------------------------------------------------------------------------------------

struct Machine {
  std::string gpu;
  int device = 0, cc_major = 0, cc_minor = 0, sms = 0, l2_bytes = 0;
  size_t mem_bytes = 0;
  int driver = 0, runtime = 0, cublas = 0;
  int sm_clock_khz = 0, mem_clock_khz = 0, bus_bits = 0;
  double peak_bw = 0;  // bytes/s, from the memory clock and bus width
  double copy_bw = 0;  // bytes/s, measured device-to-device copy
  std::string peak_how;
};

std::string CudaVersion(int v) {
  return fmt::format("{}.{}", v / 1000, (v % 1000) / 10);
}

Machine DescribeMachine(int device, cublasHandle_t blas) {
  Machine m;
  m.device = device;
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, device));
  m.gpu = prop.name;
  m.cc_major = prop.major;
  m.cc_minor = prop.minor;
  m.sms = prop.multiProcessorCount;
  m.mem_bytes = prop.totalGlobalMem;
  m.l2_bytes = prop.l2CacheSize;
  BENCH_CUDA(cudaDriverGetVersion(&m.driver));
  BENCH_CUDA(cudaRuntimeGetVersion(&m.runtime));
  BENCH_CUBLAS(cublasGetVersion(blas, &m.cublas));
  BENCH_CUDA(cudaDeviceGetAttribute(&m.sm_clock_khz, cudaDevAttrClockRate, device));
  BENCH_CUDA(cudaDeviceGetAttribute(&m.mem_clock_khz, cudaDevAttrMemoryClockRate, device));
  BENCH_CUDA(cudaDeviceGetAttribute(&m.bus_bits, cudaDevAttrGlobalMemoryBusWidth, device));
  m.peak_bw = 2.0 * m.mem_clock_khz * 1e3 * m.bus_bits / 8.0;
  m.peak_how = fmt::format(
      "2 (double data rate) x {} MHz memory clock (cudaDevAttrMemoryClockRate) x {} bit bus "
      "(cudaDevAttrGlobalMemoryBusWidth) / 8",
      m.mem_clock_khz / 1000, m.bus_bits);
  return m;
}

// Device-to-device copy bandwidth (read + write bytes / median time) of a 1 GiB buffer (or a quarter of the free
// memory): a practical ceiling for streaming kernels, printed next to the nominal peak.
double MeasureCopyBandwidth(Timer& timer, cudaStream_t stream) {
  size_t free_b = 0, total_b = 0;
  BENCH_CUDA(cudaMemGetInfo(&free_b, &total_b));
  const size_t bytes = std::min<size_t>(size_t{1} << 30, free_b / 4) / 2 * 2;
  DevBuf<char> buf(bytes, "copy bandwidth buffer");
  BENCH_CUDA(cudaMemset(buf.get(), 1, bytes));
  const size_t half = bytes / 2;
  const Timing t = timer.Time("cudaMemcpyAsync device to device", [&] {
    return cudaMemcpyAsync(buf.get() + half, buf.get(), half, cudaMemcpyDeviceToDevice, stream);
  });
  return 2.0 * static_cast<double>(half) / (t.median_ms * 1e-3);
}

// ---- JSON -------------------------------------------------------------------------------------------------------

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<int>(c));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string JsonNumber(double v) {
  return std::isfinite(v) ? fmt::format("{:.6g}", v) : "null";
}

void WriteJson(const std::string& path, const Machine& m, const std::vector<Shape>& shapes, int warmup, int iters,
               const std::vector<Row>& rows, const std::string& rows_regex, bool sanity) {
  std::string j = "{\n  \"machine\": {";
  j += fmt::format(
      "\"gpu\": {}, \"device\": {}, \"compute_capability\": \"{}.{}\", \"sms\": {}, \"memory_bytes\": {}, "
      "\"l2_bytes\": {}, \"driver\": \"{}\", \"runtime\": \"{}\", \"cublas\": {}, \"sm_clock_mhz\": {}, "
      "\"memory_clock_mhz\": {}, \"bus_width_bits\": {}, \"peak_bandwidth_gbps\": {}, \"peak_bandwidth_derivation\": "
      "{}, \"copy_bandwidth_gbps\": {}}},\n",
      JsonString(m.gpu), m.device, m.cc_major, m.cc_minor, m.sms, m.mem_bytes, m.l2_bytes, CudaVersion(m.driver),
      CudaVersion(m.runtime), m.cublas, m.sm_clock_khz / 1000, m.mem_clock_khz / 1000, m.bus_bits,
      JsonNumber(m.peak_bw / 1e9), JsonString(m.peak_how), JsonNumber(m.copy_bw / 1e9));
  j += fmt::format("  \"timing\": {{\"warmup\": {}, \"iters\": {}, \"statistic\": \"median of cudaEvent pairs\"}},\n",
                   warmup, iters);
  // What was run: every row, or those --rows selected; whether the sanity checks ran first (--no-sanity).
  j += fmt::format(
      "  \"selection\": {{\"rows\": {}, \"rows_run\": {}, \"rows_offered\": {}, \"sanity_checked\": {}}},\n",
      rows_regex.empty() ? "null" : JsonString(rows_regex), g_rows_run, g_rows_offered, sanity ? "true" : "false");
  j += "  \"formulas\": {\"gemm_flops\": \"2*M*N*K\", \"attention_forward_flops\": \"4*B*H*D*sum_t keys(t), keys(t) = "
       "min(t+1, window) or t+1 without a window\", \"attention_backward_flops\": \"2.5 x forward\", "
       "\"attention_cublas_reference\": \"cublasGemmStridedBatchedEx of S = Q K^T and O = P V, batch B*H, "
       "4*B*H*T^2*D FLOPs\", \"bytes\": \"minimum traffic: inputs read once, outputs written once, accumulated "
       "outputs read and written, scratch written and read\"},\n";
  j += "  \"shapes\": [";
  for (size_t i = 0; i < shapes.size(); ++i) {
    const Shape& s = shapes[i];
    j += fmt::format(
        "{}{{\"name\": {}, \"tokens\": {}, \"hidden\": {}, \"heads\": {}, \"vocab\": {}, \"seq\": {}, "
        "\"window\": {}, \"layers\": {}, \"tp\": {}}}",
        i ? ", " : "", JsonString(s.name), s.tokens, s.hidden, s.heads, s.vocab, s.seq, s.window, s.layers, s.tp);
  }
  j += "],\n  \"results\": [\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    j += fmt::format(
        "    {{\"set\": {}, \"kernel\": {}, \"shape\": {}, \"median_ms\": {}, \"min_ms\": {}, \"max_ms\": {}, "
        "\"bytes\": {}, \"gbps\": {}, \"fraction_of_peak_bandwidth\": {}",
        JsonString(r.set), JsonString(r.kernel), JsonString(r.shape), JsonNumber(r.t.median_ms), JsonNumber(r.t.min_ms),
        JsonNumber(r.t.max_ms), JsonNumber(r.bytes), JsonNumber(r.gbps()), JsonNumber(r.gbps() * 1e9 / m.peak_bw));
    if (r.flops > 0) j += fmt::format(", \"flops\": {}, \"tflops\": {}", JsonNumber(r.flops), JsonNumber(r.tflops()));
    j += fmt::format(", \"unit\": {}, \"roofline_ms\": {}, \"fraction_of_roofline\": {}", JsonString(UnitName(r.unit)),
                     JsonNumber(r.roof_ms), JsonNumber(r.roof_ms / r.t.median_ms));
    if (r.ref.median_ms > 0) {
      j += fmt::format(
          ", \"cublas\": {{\"what\": {}, \"median_ms\": {}, \"flops\": {}, \"tflops\": {}}}, "
          "\"fraction_of_cublas\": {}",
          JsonString(r.ref_what), JsonNumber(r.ref.median_ms), JsonNumber(r.ref_flops), JsonNumber(r.ref_tflops()),
          JsonNumber(r.tflops() / r.ref_tflops()));
    }
    j += i + 1 < rows.size() ? "},\n" : "}\n";
  }
  j += "  ]\n}\n";
  std::ofstream f(path);
  f << j;
  f.close();
  if (!f) Die("cannot write " + path);
}

// One shape: its header, the table (measured, or in the dry mode bytes / FLOPs / roofline only) and the step
// prediction.
void BenchShape(Bench& bench, const Shape& s, const Roofline& roof, int micro_batches) {
  bench.set_name(s.name);
  fmt::print("\n== {}: tokens {} (B {} x seq {}), hidden {}, heads {} (D {}), vocab {}, window {}, layers {}, tp {}\n",
             s.name, s.tokens, s.tokens / s.seq, s.seq, s.hidden, s.heads, s.hidden / s.heads, s.vocab, s.window,
             s.layers, s.tp);
  if (g_dry) {
    fmt::print("{:<28} {:<56} {:>10} {:>10} {:>8} {:>6} {:>9}\n", "kernel", "shape", "MB", "GFLOP", "unit", "bound",
               "roof ms");
  } else {
    fmt::print("{:<28} {:<56} {:>9} {:>9} {:>8} {:>7} {:>8} {:>8} {:>9} {:>9} {:>7}\n", "kernel", "shape", "median ms",
               "min ms", "GB/s", "%peak", "TFLOP/s", "cuBLAS", "vs cuBLAS", "roof ms", "%roof");
  }
  BenchLayerNormGelu(bench, s);
  BenchAttention(bench, s);
  BenchCrossEntropy(bench, s);
  BenchEmbeddingPositions(bench, s);
  BenchElementwise(bench, s);
  BenchOptimizers(bench, s);
  BenchGemm(bench, s);
  PredictStep(s, roof, micro_batches);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "kernels_bench: GPU timings of the megascale kernels (kernels/*.cu) vs the peak memory bandwidth and cuBLAS.\n"
      "Without shape flags both presets run (gpt2-small, gpt2-xl); any shape flag gives one shape: the preset of\n"
      "--preset (default gpt2-small) with the flags' values."};
  std::string preset = "all", json, roofline;
  int iters = 50, warmup = 5, device = 0;
  bool roofline_only = false, no_sanity = false;
  int64_t micro_batches = 1;
  std::string rows;
  Shape custom{"custom", 8192, 768, 12, 50304, 1024, 256, 12, 1};
  app.add_option("--preset", preset,
                 "all (gpt2-small, gpt2-xl) | gpt2-small | gpt2-xl | gpu-configs (gpt2-small-gpu, gpt-1.3b: "
                 "configs/gpt2-small-gpu.yaml, configs/gpt-1.3b-gpu.yaml) | gpt2-small-gpu | gpt-1.3b")
      ->check(CLI::IsMember({"all", "gpt2-small", "gpt2-xl", "gpu-configs", "gpt2-small-gpu", "gpt-1.3b"}));
  app.add_flag("--roofline-only", roofline_only,
               "no GPU needed: print each launcher's bytes, FLOPs and roofline time, and the predicted step, without "
               "allocating, launching or timing anything");
  app.add_option("--roofline", roofline,
                 "the GPU whose datasheet peaks give the roofline: h100 | h100-pcie | h200 | a100 (default: the "
                 "detected GPU, h100 with --roofline-only)")
      ->check(CLI::IsMember({"h100", "h100-pcie", "h200", "a100"}));
  app.add_option("--micro-batches", micro_batches, "micro-batches per step in the step prediction (1)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  auto* o_tokens = app.add_option("--tokens", custom.tokens, "tokens per step N = B * seq (gpt2-small: 8192)");
  auto* o_hidden = app.add_option("--hidden", custom.hidden, "hidden size C (768)");
  auto* o_heads = app.add_option("--heads", custom.heads, "attention heads H; head size D = C / H <= 128 (12)");
  auto* o_vocab = app.add_option("--vocab", custom.vocab, "vocabulary V (50304)");
  auto* o_seq = app.add_option("--seq", custom.seq, "sequence length T (1024)");
  auto* o_window = app.add_option("--window", custom.window,
                                  "sliding window of the windowed attention rows; 0: full causal only (256)");
  auto* o_layers = app.add_option("--layers", custom.layers, "layers of the optimizer's parameter list (12)");
  auto* o_tp = app.add_option("--tp", custom.tp, "tensor parallelism: vocab-parallel pieces on V / tp columns (1)");
  app.add_option("--iters", iters, "timed launches per kernel (median reported)")->check(CLI::Range(1, 100000));
  app.add_option("--warmup", warmup, "untimed launches first")->check(CLI::Range(0, 100000));
  app.add_option("--device", device, "CUDA device ordinal")->check(CLI::NonNegativeNumber);
  app.add_option("--json", json, "also write the results as JSON to this file");
  app.add_option("--rows", rows,
                 "only the rows whose \"kernel shape\" label this ECMAScript regex finds (the label is a row's "
                 "first two columns; --roofline-only lists them all)");
  app.add_flag("--no-sanity", no_sanity,
               "skip the sanity checks against the CPU reference (for a profiler run after a checked run: the "
               "times are then of launchers not checked on this machine)");
  CLI11_PARSE(app, argc, argv);
  if (!rows.empty()) {
    try {
      g_rows = std::make_unique<std::regex>(rows, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      Die(fmt::format("--rows '{}': not a regular expression: {}", rows, e.what()));
    }
  }
  // After the shapes ran: --rows must have selected something (a typo would otherwise measure nothing, silently).
  auto report_rows = [&] {
    if (!g_rows) return;
    if (g_rows_run == 0) {
      Die(fmt::format("--rows '{}' matches none of the {} rows; kernels_bench --roofline-only lists them", rows,
                      g_rows_offered));
    }
    fmt::print("\nrows: {} of {} run (--rows '{}')\n", g_rows_run, g_rows_offered, rows);
  };

  const Shape small{"gpt2-small", 8192, 768, 12, 50304, 1024, 256, 12, 1};
  const Shape xl{"gpt2-xl", 8192, 1600, 25, 50304, 1024, 256, 48, 1};
  // The GPU benchmark configs' micro-batches: configs/gpt2-small-gpu.yaml (16 x 1024 tokens), configs/gpt-1.3b-gpu.yaml
  // (4 x 2048 tokens); the step prediction then takes --micro-batches 2 for both.
  const Shape small_gpu{"gpt2-small-gpu", 16384, 768, 12, 50304, 1024, 256, 12, 1};
  const Shape b13{"gpt-1.3b", 8192, 2048, 16, 50304, 2048, 256, 24, 1};
  std::vector<Shape> shapes;
  bool custom_given = false;
  for (auto* o : {o_tokens, o_hidden, o_heads, o_vocab, o_seq, o_window, o_layers, o_tp}) {
    custom_given = custom_given || o->count() > 0;
  }
  if (custom_given) {
    Shape s = preset == "gpt2-xl" ? xl : preset == "gpt2-small-gpu" ? small_gpu : preset == "gpt-1.3b" ? b13 : small;
    s.name = "custom";
    if (o_tokens->count()) s.tokens = custom.tokens;
    if (o_hidden->count()) s.hidden = custom.hidden;
    if (o_heads->count()) s.heads = custom.heads;
    if (o_vocab->count()) s.vocab = custom.vocab;
    if (o_seq->count()) s.seq = custom.seq;
    if (o_window->count()) s.window = custom.window;
    if (o_layers->count()) s.layers = custom.layers;
    if (o_tp->count()) s.tp = custom.tp;
    shapes.push_back(s);
  } else {
    if (preset == "all" || preset == "gpt2-small") shapes.push_back(small);
    if (preset == "all" || preset == "gpt2-xl") shapes.push_back(xl);
    if (preset == "gpu-configs" || preset == "gpt2-small-gpu") shapes.push_back(small_gpu);
    if (preset == "gpu-configs" || preset == "gpt-1.3b") shapes.push_back(b13);
  }
  for (const Shape& s : shapes) {
    std::string bad;
    if (s.tokens < 1 || s.hidden < 1 || s.heads < 1 || s.vocab < 1 || s.seq < 1 || s.window < 0 || s.layers < 0 ||
        s.tp < 1) {
      bad = "sizes must be positive (window, layers >= 0)";
    } else if (s.tokens % s.seq != 0) {
      bad = "--tokens must be a multiple of --seq";
    } else if (s.hidden % s.heads != 0 || s.hidden / s.heads > k::kAttentionMaxHeadDim) {
      bad = fmt::format("--hidden must be --heads x D with D <= {}", k::kAttentionMaxHeadDim);
    } else if (s.vocab < s.tp) {
      bad = "--vocab must be >= --tp";
    } else if (s.vocab > std::numeric_limits<int32_t>::max() ||
               s.tokens * std::max(s.hidden * 4, s.vocab) >= (int64_t{1} << 40)) {
      bad = "shape too large";
    }
    if (!bad.empty()) Die(fmt::format("shape {}: {}", s.name, bad));
  }

  if (roofline_only) {
    g_dry = true;
    const Roofline& roof = *FindRoofline(roofline.empty() ? "h100" : roofline);
    fmt::print(
        "kernels_bench --roofline-only: no GPU used; roofline of {}: {:.2f} TB/s HBM, {:.1f} TFLOP/s dense "
        "bf16 tensor cores, {:.1f} TFLOP/s fp32 CUDA cores\n",
        roof.name, roof.bandwidth / 1e12, roof.bf16 / 1e12, roof.fp32 / 1e12);
    fmt::print(
        "bytes: the minimum traffic of each launcher (inputs read once, outputs written once, accumulated outputs "
        "read and written, scratch written and read); roof ms = max(bytes / bandwidth, FLOPs / peak of the unit)\n");
    Bench bench(nullptr, nullptr, 0, 1, roof.bandwidth, roof);
    for (const Shape& s : shapes) BenchShape(bench, s, roof, micro_batches);
    report_rows();
    return 0;
  }

  // A GPU first: without one, say so and fail.
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess) Die(fmt::format("no CUDA device: {} — this benchmark needs a GPU", CudaError(e)));
  if (devices == 0) Die("no CUDA device: cudaGetDeviceCount found 0 devices — this benchmark needs a GPU");
  if (device >= devices) Die(fmt::format("--device {}: only {} CUDA device(s)", device, devices));
  BENCH_CUDA(cudaSetDevice(device));

  cudaStream_t stream = nullptr;
  BENCH_CUDA(cudaStreamCreate(&stream));  // blocking: ordered with the synchronous copies of the default stream
  cublasHandle_t blas = nullptr;
  BENCH_CUBLAS(cublasCreate(&blas));
  BENCH_CUBLAS(cublasSetStream(blas, stream));

  Machine m = DescribeMachine(device, blas);
  {
    Timer t(stream, warmup, iters);
    m.copy_bw = MeasureCopyBandwidth(t, stream);
  }
  const int cb = m.cublas;
  fmt::print("machine: {} (device {}), compute capability {}.{}, {} SMs, {:.1f} GiB, L2 {:.0f} MiB\n", m.gpu, device,
             m.cc_major, m.cc_minor, m.sms, static_cast<double>(m.mem_bytes) / (1 << 30),
             static_cast<double>(m.l2_bytes) / (1 << 20));
  fmt::print("  driver (CUDA) {}, runtime {}, cuBLAS {}.{}.{}\n", CudaVersion(m.driver), CudaVersion(m.runtime),
             cb / 10000, cb % 10000 / 100, cb % 100);
  fmt::print("  clocks (peak, as reported by the runtime): SM {} MHz, memory {} MHz; memory bus {} bit\n",
             m.sm_clock_khz / 1000, m.mem_clock_khz / 1000, m.bus_bits);
  if (m.peak_bw <= 0) {
    m.peak_bw = m.copy_bw;
    m.peak_how = "the runtime reports no memory clock / bus width: the measured copy bandwidth is used as the peak";
  }
  fmt::print("  peak memory bandwidth {:.1f} GB/s = {}\n", m.peak_bw / 1e9, m.peak_how);
  fmt::print(
      "  measured device-to-device copy {:.1f} GB/s ({:.1f}% of that peak; cudaMemcpyAsync, read + write bytes "
      "/ median time)\n\n",
      m.copy_bw / 1e9, 100.0 * m.copy_bw / m.peak_bw);

  if (no_sanity) {
    fmt::print("sanity: skipped (--no-sanity): the launchers below were not checked against the CPU reference\n\n");
  } else {
    fmt::print("sanity: every launcher once on a small shape against the CPU reference (ms::ops::ref)\n");
    Sanity san(stream, blas);
    SanityGelu(san);
    SanityLayerNorm(san);
    SanityAttention(san);
    SanityCrossEntropy(san);
    SanityEmbedding(san);
    SanityOptimizers(san);
    SanityCasts(san);
    SanityElementwise(san);
    SanityGemm(san);
    fmt::print("sanity: all {} checks passed\n\n", san.checks());
  }

  fmt::print(
      "timing: {} warm-up launches, then the median (and min) of {} launches, each between cudaEvents on one "
      "stream\n",
      warmup, iters);
  fmt::print(
      "bytes: the minimum traffic of each launcher (inputs read once, outputs written once, accumulated "
      "outputs read and written, scratch written and read); GB/s = bytes / median; %peak vs {:.1f} GB/s\n",
      m.peak_bw / 1e9);
  fmt::print(
      "FLOPs: GEMM 2*M*N*K; attention forward 4*B*H*D*sum_t keys(t) with keys(t) = min(t+1, window) "
      "(t+1 without a window), backward 2.5x the forward\n");
  fmt::print(
      "cuBLAS: cublasGemmEx (bf16 A, B; fp32 C; CUBLAS_COMPUTE_32F; CUBLAS_GEMM_DEFAULT) of the same shape; "
      "for attention, cublasGemmStridedBatchedEx of dense attention's S = Q K^T and O = P V (batch B*H, "
      "4*B*H*T^2*D FLOPs); vs cuBLAS = kernel FLOP/s / cuBLAS FLOP/s\n");

  const Roofline* detected = RooflineOfGpu(m.gpu);
  const Roofline& roof = *(roofline.empty() ? (detected ? detected : FindRoofline("h100")) : FindRoofline(roofline));
  fmt::print(
      "roofline: {} ({:.2f} TB/s, {:.1f} TFLOP/s bf16 tensor cores, {:.1f} TFLOP/s fp32){}; roof ms = "
      "max(bytes / bandwidth, FLOPs / peak of the unit), %roof = roof ms / median\n",
      roof.name, roof.bandwidth / 1e12, roof.bf16 / 1e12, roof.fp32 / 1e12,
      roofline.empty() && !detected ? " — this GPU is not in the table, H100 figures used" : "");
  Bench bench(stream, blas, warmup, iters, m.peak_bw, roof);
  for (const Shape& s : shapes) BenchShape(bench, s, roof, micro_batches);
  report_rows();
  if (!json.empty()) {
    WriteJson(json, m, shapes, warmup, iters, bench.rows(), rows, !no_sanity);
    fmt::print("\nwrote {}\n", json);
  }
  BENCH_CUBLAS(cublasDestroy(blas));
  BENCH_CUDA(cudaStreamDestroy(stream));
  return 0;
}
