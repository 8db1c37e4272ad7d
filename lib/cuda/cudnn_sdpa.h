// cuDNN's fused attention (scaled dot-product attention, SDPA) for the CUDA backend's training path — internal to
// lib/cuda (the module's public header is cuda.h).
//
// cuDNN is loaded at run time (dlopen of libcudnn.so.9), only when a job asks for it (`runtime.attention_kernels:
// cudnn`): megascale builds, starts and trains without it. cuDNN 9's backend API has no single operation for causal
// or sliding-window attention before 9.21 (and none for its backward), so both passes are built as the composite
// operation graphs its fused flash-attention engines recognize, as NVIDIA's cudnn-frontend composes them:
//   forward:  S = Q Kᵀ (fp32) · scale;  S = (row >= col) ? S : -inf;  with a window W also (col + W > row) ? S : -inf;
//             m = max_row S;  E = exp(S - m);  l = sum_row E;  Stats = m + log l;  O = (E / l) V
//   backward: D = sum_d dO O;  P = exp(mask(scale Q Kᵀ) - Stats);  dV = Pᵀ dO;  dS = P (dO Vᵀ - D) scale;
//             dK = dSᵀ Q;  dQ = dS K  (dQ written directly, not accumulated in fp32: the dP-workspace form the
//             frontend uses for deterministic backwards)
// with Q, K, V strided views of megascale's qkv (B, T, 3, H, D) in bf16, O its attention output (B, T, H, D) in bf16,
// dQ, dK, dV views of dqkv (B, T, 3, H, D) in bf16, and Stats the log-sum-exp of the scaled, masked scores — exactly
// the `lse` (B, H, T) megascale's own kernels write and read, so either backward follows either forward.
//
// Device-less check: `EngineConfigs` asks cuDNN's heuristics, for a device described by properties (JSON,
// `H100DeviceProperties()`), how many engine configurations support a graph, and `PlansDeviceless` builds their plans
// (cuDNN compiles the kernels) — on a machine without a GPU too, given a libcuda.so.1 to load (the toolkit's stub).
// They say whether the fused engines take the graphs as built; only a GPU says whether they compute the right
// numbers (tests/cuda/backend_test.cpp, run by cuda_backend_gpu).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/core.h"

namespace ms::cuda::cudnn {

// One attention problem: B sequences of T tokens, H heads of D, causal, keys within `window` of the query (0: all).
struct SdpaShape {
  int64_t B = 0, T = 0, H = 0, D = 0, window = 0;
  bool operator==(const SdpaShape&) const = default;
};

// The loaded library's version (e.g. 91900), or why it does not load (names the library and the loader's error).
Result<int64_t> Version();

// Why cuDNN's fused attention cannot take this problem (empty: it can): D a multiple of 8 up to 128 (bf16 rows 16-byte
// aligned), T >= 1, window >= 0.
std::string Unsupported(const SdpaShape& s);

// The device properties of an H100 SXM (132 SMs, sm_90) as cuDNN's JSON, for the device-less checks below.
std::string H100DeviceProperties();

enum class Pass { kForward, kBackward };

// Engine configurations cuDNN's heuristics (mode A) find for the graph of `pass` on the device described by
// `deviceprop_json`; an error names what cuDNN refused (the descriptor, the attribute, cuDNN's message).
Result<int> EngineConfigs(const SdpaShape& s, Pass pass, const std::string& deviceprop_json);
// For each of those configurations, what finalizing its execution plan for that device says: "ok", or cuDNN's error.
// Without a GPU (the stub libcuda) a plan whose kernel cuDNN compiled fails only when the driver is asked to load
// it (CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER); any other error is a plan cuDNN could not build.
Result<std::vector<std::string>> PlansDeviceless(const SdpaShape& s, Pass pass, const std::string& deviceprop_json);

// On a GPU: one cuDNN handle on one stream, an execution plan per pass and shape (built at its first use).
class Sdpa {
 public:
  // workspace(bytes): device memory of at least that many bytes, valid until the next call (the backend's scratch).
  using Workspace = std::function<Result<void*>(size_t bytes)>;
  static Result<std::unique_ptr<Sdpa>> Create(void* cuda_stream, Workspace workspace);
  ~Sdpa();
  Sdpa(const Sdpa&) = delete;
  Sdpa& operator=(const Sdpa&) = delete;

  // out16 (B, T, H, D) bf16 and lse (B, H, T) fp32 WRITTEN from qkv16 (B, T, 3, H, D) bf16; device pointers,
  // 16-byte aligned. Launched on the stream; nothing synchronizes.
  Status Forward(const void* qkv16, void* out16, float* lse, const SdpaShape& s);
  // dqkv16 (B, T, 3, H, D) bf16 WRITTEN (dQ, dK, dV) from qkv16, the forward's out16 and lse, and dout16 (B, T, H, D)
  // bf16; row_terms: B * H * T floats of device scratch (overwritten: sum_d dout * out per query). The dP workspace
  // form of the backward (no atomics: deterministic); its workspace is the plan's (B H T^2 * 6 bytes with cuDNN 9.14
  // on an H200: 1.2 GB at GPT-2 small's 16 x 1024 tokens).
  Status Backward(const void* qkv16, const void* out16, const void* dout16, const float* lse, void* dqkv16,
                  float* row_terms, const SdpaShape& s);
  // What the first call for a pass and shape chose: the engine configuration, its workspace (for the run's log).
  std::string Describe(const SdpaShape& s, Pass pass) const;

  struct Impl;

 private:
  explicit Sdpa(std::unique_ptr<Impl> impl);
  // Executes the plan of (pass, s) — built at its first use — with these tensors bound and the scalars added.
  Status Run(Pass pass, const SdpaShape& s, std::vector<int64_t> uids, std::vector<void*> ptrs);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ms::cuda::cudnn
