// cuDNN's fused attention (scaled dot-product attention, SDPA) for the CUDA backend's training path — internal to
// lib/cuda (the module's public header is cuda.h).
//
// cuDNN is loaded at run time (dlopen of libcudnn.so.9), only when a job asks for it (`runtime.attention_kernels:
// cudnn`): megascale builds, starts and trains without it. cuDNN 9's backend API has no single operation for causal
// or sliding-window attention before 9.21 (and none for its backward), so both passes are built as the composite
// operation graphs its fused flash-attention engines recognize, operation for operation as NVIDIA's cudnn-frontend
// (include/cudnn_frontend/node/scaled_dot_product_flash_attention.h, cuDNN >= 9, not deterministic) composes them —
// the graphs PyTorch's cuDNN attention runs:
//   forward:  S = Q Kᵀ (fp32) · scale;  S = (row >= col) ? S : -inf;  with a window W also (col + W > row) ? S : -inf;
//             m = max_row S;  E = exp(S - m);  l = sum_row E;  Stats = m + log l;  O = (E / l) V
//   backward: D = 1 · sum_d dO O (into the caller's row terms);  P = exp(mask(scale Q Kᵀ) - Stats);  dV = Pᵀ dO;
//             dS = P (dO Vᵀ - D) scale;  dK = dSᵀ Q;  dQacc = dS K (fp32, in the workspace);  dQ = dQacc
//             where cuDNN <= 9.15 gets T % 128 != 0 wrong without a padding mask, the frontend's workaround: a
//             padding mask (row < T and col < T, from device tensors of the sequence lengths) before the causal
//             one (on 9.0 - 9.9 again after the statistics), and the sequence lengths as the matmuls' M / N / K
//             overrides (GraphOptions); 9.10.0 and 9.10.1, whose backward the frontend refuses, are refused too.
// with Q, K, V strided views of megascale's qkv (B, T, 3, H, D) in bf16, O its attention output (B, T, H, D) in bf16,
// dQ, dK, dV views of dqkv (B, T, 3, H, D) in bf16, and Stats the log-sum-exp of the scaled, masked scores — exactly
// the `lse` (B, H, T) megascale's own kernels write and read, so either backward follows either forward.
// (Up to 2829a9d the backward wrote dQ straight from dS K — the form the frontend keeps for deterministic backwards,
// with a B H T^2 dP workspace —, subtracted Stats before the causal mask and reduced the row terms straight into
// their tensor; on an H200 with cuDNN 9.14 it computed a wrong dqkv at every shape tried, the forward right.)
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
// aligned), T >= 2 (one query and one key cudnn-frontend refuses), window >= 0.
std::string Unsupported(const SdpaShape& s);

// The device properties of an H100 SXM (132 SMs, sm_90) as cuDNN's JSON, for the device-less checks below.
std::string H100DeviceProperties();

enum class Pass { kForward, kBackward };

// Choices in building the graphs that depend on the cuDNN release.
struct GraphOptions {
  bool padding_mask = false;  // the backward's padding-mask workaround (cuDNN <= 9.15 at T % 128 != 0)
  // The frontend's deterministic form of the backward: dQ written straight from dS K, no fp32 accumulator (cuDNN
  // keeps dP in a workspace of B H T^2 size). Never GraphFor's choice; megascale's graph up to 2829a9d had it.
  bool deterministic = false;
  bool lowest_for_inf = false;       // the masks write the lowest float, not -inf (cuDNN < 9.10 prefers it)
  bool zero_dq_accum = false;        // dQacc zeroed before each backward (before 9.6 cuDNN does not do it itself)
  bool second_padding_mask = false;  // with the padding mask on cuDNN 9.0 - 9.9: again after the statistics
};
// What cudnn-frontend does for cuDNN `version` (e.g. 91400) at shape s, with SetFormOverride's overrides applied.
GraphOptions GraphFor(const SdpaShape& s, int64_t version);
// Tests (diagnosis on a GPU): GraphFor's `deterministic` and `padding_mask` overridden for the plans built after the
// call, process-wide; each -1 (GraphFor's own choice), 0 or 1.
void SetFormOverride(int deterministic, int padding_mask);

// The graph of `pass` as megascale builds it, recorded beside the cuDNN descriptors (building it loads cuDNN): its
// tensors and operations in order, for a reference interpreter that checks what the graph computes without a GPU
// (tests/cuda/cudnn_sdpa_test.cpp). A reshape keeps its input's memory and reads it with its output's dims and
// strides (how the graphs express a transpose).
struct GraphRecord {
  enum class Type { kFloat, kBf16, kInt32, kBool };
  enum class Op {
    kMul,
    kAdd,
    kSub,
    kDiv,
    kExp,
    kLog,
    kIdentity,
    kGenIndex,
    kCmpGe,
    kCmpGt,
    kCmpLt,
    kLogicalAnd,
    kBinarySelect,
    kReduceAdd,
    kReduceMax,
    kMatmul,
    kReshape
  };
  struct Tensor {
    int64_t uid = 0;
    std::vector<int64_t> dims, strides;
    Type type = Type::kFloat;
    bool is_virtual = true, by_value = false;
    std::string name;
  };
  struct Operation {
    Op op = Op::kMul;
    std::vector<int64_t> in;  // uids: x[, b[, t]] (pointwise), x (reduction, reshape), a, b (matmul)
    int64_t out = 0;
    int64_t axis = -1;  // GEN_INDEX
    std::string name;
  };
  std::vector<Tensor> tensors;
  std::vector<Operation> ops;
};
Result<GraphRecord> RecordGraph(const SdpaShape& s, Pass pass, const GraphOptions& options);

// Engine configurations cuDNN's heuristics (mode A) find for the graph of `pass` on the device described by
// `deviceprop_json`; an error names what cuDNN refused (the descriptor, the attribute, cuDNN's message).
// `options`: GraphFor(s, the loaded version) unless given.
Result<int> EngineConfigs(const SdpaShape& s, Pass pass, const std::string& deviceprop_json,
                          const GraphOptions* options = nullptr);
// For each of those configurations, what finalizing its execution plan for that device says: "ok", or cuDNN's error.
// Without a GPU (the stub libcuda) a plan whose kernel cuDNN compiled fails only when the driver is asked to load
// it (CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER); any other error is a plan cuDNN could not build.
Result<std::vector<std::string>> PlansDeviceless(const SdpaShape& s, Pass pass, const std::string& deviceprop_json,
                                                 const GraphOptions* options = nullptr);

// On a GPU: one cuDNN handle on one stream, an execution plan per pass and shape (built at its first use).
class Sdpa {
 public:
  // What the backend gives it, all on the stream's device:
  struct Memory {
    // Device memory of at least `bytes`, valid until the next call (the backend's scratch).
    std::function<Result<void*>(size_t bytes)> workspace;
    // `bytes` at p set to zero, enqueued on the stream.
    std::function<Status(void* p, size_t bytes)> zero;
    // Device memory holding a copy of `bytes` at host, kept as long as the backend (the sequence lengths of the
    // padding-mask workaround, uploaded once per shape when its plan is built).
    std::function<Result<void*>(const void* host, size_t bytes)> keep;
  };
  static Result<std::unique_ptr<Sdpa>> Create(void* cuda_stream, Memory memory);
  ~Sdpa();
  Sdpa(const Sdpa&) = delete;
  Sdpa& operator=(const Sdpa&) = delete;

  // out16 (B, T, H, D) bf16 and lse (B, H, T) fp32 WRITTEN from qkv16 (B, T, 3, H, D) bf16; device pointers,
  // 16-byte aligned. Launched on the stream; nothing synchronizes.
  Status Forward(const void* qkv16, void* out16, float* lse, const SdpaShape& s);
  // dqkv16 (B, T, 3, H, D) bf16 WRITTEN (dQ, dK, dV) from qkv16, the forward's out16 and lse, and dout16 (B, T, H, D)
  // bf16; row_terms: B * H * T floats of device scratch (overwritten: sum_d dout * out per query). The workspace
  // is the plan's and dQacc's (B H T D fp32 after it: 50 MB at GPT-2 small's 16 x 1024 tokens); dQ is accumulated
  // over key blocks (atomics: not bit-for-bit deterministic).
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
