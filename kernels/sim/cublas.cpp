// kernels/sim/cublas.cpp: the subset of cuBLAS that the CUDA backend uses, on the CPU, for emulated builds only
// (never linked with the real libcublas). Declarations come from the real cublas_v2.h, so types, enum values and
// signatures are NVIDIA's; argument checks and status codes follow cuBLAS's documentation.
//
//   handles       cublasCreate/Destroy, Set/GetStream, Set/GetMathMode, Set/GetPointerMode, SetWorkspace
//                 (checked: 256-byte alignment, inside one cudaMalloc'd buffer; not used), status names/strings;
//   GEMMs         cublasGemmEx, cublasGemmStridedBatchedEx, cublasSgemm: C = alpha op(A) op(B) + beta C, column-major,
//                 transa/transb N, T or C (= T for real types). Types (A = B, C, compute):
//                   bf16, fp32, 32F | 32F_PEDANTIC            bf16, bf16, 32F | 32F_PEDANTIC
//                   fp32, fp32, 32F | 32F_PEDANTIC | 32F_FAST_16BF (inputs rounded to bf16 first, as the tensor
//                   cores may do)
//                 anything else is CUBLAS_STATUS_NOT_SUPPORTED. Products accumulate in fp32, in k order (no FMA
//                 contraction on x86-64 without -mfma); then C = alpha * acc + beta * C in fp32, rounded to bf16
//                 (nearest even) for bf16 C. beta == 0 does not read C; alpha == 0 or k == 0 does not read A, B.
//                 Sgemm computes in fp32 whatever the math mode (TF32 is not emulated).
// Every call is checked at once on the calling thread and runs in its stream's order (at once by default). Matrices
// must lie inside cudaMalloc'd buffers (checked with the emulated runtime: an access outside is
// CUBLAS_STATUS_EXECUTION_FAILED, reported like a failed kernel, as the GPU would fault); alpha and beta are read
// through the pointer mode (host memory for CUBLAS_POINTER_MODE_HOST, device memory for _DEVICE). Thread safety:
// handles are registered under a lock; one handle is used by one thread at a time, as in cuBLAS.
#include <cublas_v2.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "sim/blas_core.h"
#include "sim/internal.h"
#include "sim/runtime_hooks.h"

struct cublasContext {
  cudaStream_t stream = nullptr;
  cublasMath_t math_mode = CUBLAS_DEFAULT_MATH;
  cublasPointerMode_t pointer_mode = CUBLAS_POINTER_MODE_HOST;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

namespace ms::sim::cublas {
namespace {

struct Handles {
  std::mutex mu;
  std::set<const cublasContext*> live;
};
Handles& Live() {
  static Handles* h = new Handles;  // never destroyed: usable from static destructors
  return *h;
}

bool Known(cublasHandle_t handle) {
  if (!handle) return false;
  Handles& h = Live();
  std::lock_guard<std::mutex> lock(h.mu);
  return h.live.count(handle) != 0;
}

// Reported as the emulator reports a failed kernel (stderr unless MS_SIM_QUIET=1, ms::sim::LastErrorMessage()).
cublasStatus_t Fail(cublasStatus_t status, const std::string& message) {
  internal::ReportError(message);
  return status;
}

using blas::ElementBytes;
using blas::Extent;
using blas::Load;
using blas::Where;

bool IsTrans(cublasOperation_t op) {
  return op == CUBLAS_OP_T || op == CUBLAS_OP_C;
}

struct Gemm {
  const char* api;
  cublasOperation_t transa, transb;
  int64_t m, n, k;
  const void* alpha;
  const void* A;
  cudaDataType Atype;
  int64_t lda, strideA;
  const void* B;
  cudaDataType Btype;
  int64_t ldb, strideB;
  const void* beta;
  void* C;
  cudaDataType Ctype;
  int64_t ldc, strideC;
  int64_t batch;
  cublasComputeType_t compute;
};

// C(i, j) = alpha * acc + beta * C(i, j) (C not read when beta == 0), stored as Ctype.
void Store(const Gemm& g, void* C, int64_t i, int64_t j, float acc, float alpha, float beta) {
  const int64_t idx = i + j * g.ldc;
  float v = alpha * acc;
  if (beta != 0.0f) v += beta * Load(C, g.Ctype, idx);
  blas::StoreAs(C, g.Ctype, idx, v);
}

// C = beta * C (alpha == 0 or k == 0): C is not read when beta == 0.
void Scale(const Gemm& g, void* C, float beta) {
  for (int64_t j = 0; j < g.n; ++j)
    for (int64_t i = 0; i < g.m; ++i) Store(g, C, i, j, 0.0f, 0.0f, beta);
}

cublasStatus_t ReadScalar(const char* api, const cublasContext* h, const void* p, const char* what, float* out) {
  if (!p) return Fail(CUBLAS_STATUS_INVALID_VALUE, std::string(api) + ": " + what + " is null");
  const bool on_device = IsDeviceRange(p, sizeof(float));
  if (h->pointer_mode == CUBLAS_POINTER_MODE_DEVICE && !on_device) {
    return Fail(CUBLAS_STATUS_EXECUTION_FAILED,
                std::string(api) + ": " + what + " is not device memory but the pointer mode is DEVICE");
  }
  if (h->pointer_mode == CUBLAS_POINTER_MODE_HOST && on_device) {
    return Fail(
        CUBLAS_STATUS_INVALID_VALUE,
        std::string(api) + ": " + what + " is device memory but the pointer mode is HOST (the host would fault)");
  }
  std::memcpy(out, p, sizeof(float));
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t Run(cublasHandle_t handle, const Gemm& g) {
  if (!Known(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (InHostFunction()) {
    return Fail(
        CUBLAS_STATUS_NOT_SUPPORTED,
        std::string(g.api) + ": called from a host function (cudaLaunchHostFunc), which must not make CUDA calls");
  }
  // Argument checks (CUBLAS_STATUS_INVALID_VALUE), as documented for cublas<t>gemm / cublasGemmEx.
  auto valid_op = [](cublasOperation_t op) { return op == CUBLAS_OP_N || op == CUBLAS_OP_T || op == CUBLAS_OP_C; };
  if (!valid_op(g.transa) || !valid_op(g.transb) || g.m < 0 || g.n < 0 || g.k < 0 || g.batch < 0) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const int64_t a_rows = IsTrans(g.transa) ? g.k : g.m, a_cols = IsTrans(g.transa) ? g.m : g.k;
  const int64_t b_rows = IsTrans(g.transb) ? g.n : g.k, b_cols = IsTrans(g.transb) ? g.k : g.n;
  if (g.lda < std::max<int64_t>(1, a_rows) || g.ldb < std::max<int64_t>(1, b_rows) ||
      g.ldc < std::max<int64_t>(1, g.m)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  // Supported type combinations (CUBLAS_STATUS_NOT_SUPPORTED otherwise).
  const bool plain32 = g.compute == CUBLAS_COMPUTE_32F || g.compute == CUBLAS_COMPUTE_32F_PEDANTIC;
  bool supported = false;
  if (g.Atype == CUDA_R_16BF && g.Btype == CUDA_R_16BF) {
    supported = plain32 && (g.Ctype == CUDA_R_32F || g.Ctype == CUDA_R_16BF);
  } else if (g.Atype == CUDA_R_32F && g.Btype == CUDA_R_32F && g.Ctype == CUDA_R_32F) {
    supported = plain32 || g.compute == CUBLAS_COMPUTE_32F_FAST_16BF;
  }
  if (!supported) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (!IsKnownStream(handle->stream)) {
    return Fail(CUBLAS_STATUS_EXECUTION_FAILED, std::string(g.api) + ": the handle's stream is not a live stream");
  }
  if (g.m == 0 || g.n == 0 || g.batch == 0) return CUBLAS_STATUS_SUCCESS;

  float alpha = 0, beta = 0;
  if (cublasStatus_t s = ReadScalar(g.api, handle, g.alpha, "alpha", &alpha); s != CUBLAS_STATUS_SUCCESS) return s;
  if (cublasStatus_t s = ReadScalar(g.api, handle, g.beta, "beta", &beta); s != CUBLAS_STATUS_SUCCESS) return s;
  const bool reads_ab = g.k > 0 && alpha != 0.0f;

  // Every matrix of every batch inside one allocation, before anything is written.
  const size_t a_bytes = Extent(a_rows, a_cols, g.lda, g.Atype), b_bytes = Extent(b_rows, b_cols, g.ldb, g.Btype);
  const size_t c_bytes = Extent(g.m, g.n, g.ldc, g.Ctype);
  for (int64_t t = 0; t < g.batch; ++t) {
    const char* a = static_cast<const char*>(g.A) + t * g.strideA * static_cast<int64_t>(ElementBytes(g.Atype));
    const char* b = static_cast<const char*>(g.B) + t * g.strideB * static_cast<int64_t>(ElementBytes(g.Btype));
    const char* c = static_cast<const char*>(g.C) + t * g.strideC * static_cast<int64_t>(ElementBytes(g.Ctype));
    if (reads_ab && !IsDeviceRange(a, a_bytes)) {
      return Fail(CUBLAS_STATUS_EXECUTION_FAILED, Where(g.api, "A", a, a_bytes));
    }
    if (reads_ab && !IsDeviceRange(b, b_bytes)) {
      return Fail(CUBLAS_STATUS_EXECUTION_FAILED, Where(g.api, "B", b, b_bytes));
    }
    if (!IsDeviceRange(c, c_bytes)) return Fail(CUBLAS_STATUS_EXECUTION_FAILED, Where(g.api, "C", c, c_bytes));
  }

  // The multiplication itself runs in the order of the handle's stream (at once unless MS_SIM_STREAMS is async).
  const cudaError_t queued = EnqueueOnStream(handle->stream, g.api, [g, alpha, beta, reads_ab]() {
    thread_local std::vector<float> ap, bp;
    const bool round_inputs = g.compute == CUBLAS_COMPUTE_32F_FAST_16BF;
    for (int64_t t = 0; t < g.batch; ++t) {
      const char* a = static_cast<const char*>(g.A) + t * g.strideA * static_cast<int64_t>(ElementBytes(g.Atype));
      const char* b = static_cast<const char*>(g.B) + t * g.strideB * static_cast<int64_t>(ElementBytes(g.Btype));
      char* c = static_cast<char*>(g.C) + t * g.strideC * static_cast<int64_t>(ElementBytes(g.Ctype));
      if (!reads_ab) {
        Scale(g, c, beta);
        continue;
      }
      const blas::Operands ops{
          IsTrans(g.transa), IsTrans(g.transb), g.m, g.n, g.k, a, g.Atype, g.lda, b, g.Btype, g.ldb};
      blas::Pack(ops, round_inputs, ap, bp);
      blas::Multiply(g.m, g.n, g.k, ap.data(), bp.data(),
                     [&](int64_t i, int64_t j, float acc) { Store(g, c, i, j, acc, alpha, beta); });
    }
    return cudaSuccess;
  });
  if (queued != cudaSuccess) {
    return Fail(CUBLAS_STATUS_EXECUTION_FAILED, std::string(g.api) + ": the handle's stream is not a live stream");
  }
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t Dispatch(const char* api, cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                        int64_t m, int64_t n, int64_t k, const void* alpha, const void* A, cudaDataType Atype,
                        int64_t lda, int64_t strideA, const void* B, cudaDataType Btype, int64_t ldb, int64_t strideB,
                        const void* beta, void* C, cudaDataType Ctype, int64_t ldc, int64_t strideC, int64_t batch,
                        cublasComputeType_t compute) {
  Gemm g;
  g.api = api;
  g.transa = transa;
  g.transb = transb;
  g.m = m;
  g.n = n;
  g.k = k;
  g.alpha = alpha;
  g.beta = beta;
  g.A = A;
  g.Atype = Atype;
  g.lda = lda;
  g.strideA = strideA;
  g.B = B;
  g.Btype = Btype;
  g.ldb = ldb;
  g.strideB = strideB;
  g.C = C;
  g.Ctype = Ctype;
  g.ldc = ldc;
  g.strideC = strideC;
  g.batch = batch;
  g.compute = compute;
  return Run(handle, g);
}

}  // namespace
}  // namespace ms::sim::cublas

using ms::sim::cublas::Known;

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
  auto* h = new cublasContext;
  auto& live = ms::sim::cublas::Live();
  std::lock_guard<std::mutex> lock(live.mu);
  live.live.insert(h);
  *handle = h;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  {
    auto& live = ms::sim::cublas::Live();
    std::lock_guard<std::mutex> lock(live.mu);
    if (live.live.erase(handle) != 1) return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  if (!Known(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream_v2(cublasHandle_t handle, cudaStream_t* stream) {
  if (!Known(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!stream) return CUBLAS_STATUS_INVALID_VALUE;
  *stream = handle->stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  if (!Known(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  const int base = static_cast<int>(mode) & ~static_cast<int>(CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION);
  switch (base) {
    case CUBLAS_DEFAULT_MATH:
    case CUBLAS_TENSOR_OP_MATH:
    case CUBLAS_PEDANTIC_MATH:
    case CUBLAS_TF32_TENSOR_OP_MATH:
    case CUBLAS_FP32_EMULATED_BF16X9_MATH:
    case CUBLAS_FP64_EMULATED_FIXEDPOINT_MATH:
      handle->math_mode = mode;
      return CUBLAS_STATUS_SUCCESS;
    default:
      return CUBLAS_STATUS_INVALID_VALUE;
  }
}

cublasStatus_t cublasGetMathMode(cublasHandle_t handle, cublasMath_t* mode) {
  if (!Known(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!mode) return CUBLAS_STATUS_INVALID_VALUE;
  *mode = handle->math_mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t mode) {
  if (!Known(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode != CUBLAS_POINTER_MODE_HOST && mode != CUBLAS_POINTER_MODE_DEVICE) return CUBLAS_STATUS_INVALID_VALUE;
  handle->pointer_mode = mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t* mode) {
  if (!Known(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!mode) return CUBLAS_STATUS_INVALID_VALUE;
  *mode = handle->pointer_mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t bytes) {
  if (!Known(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (bytes > 0 && (!workspace || reinterpret_cast<uintptr_t>(workspace) % 256 != 0)) {
    return CUBLAS_STATUS_INVALID_VALUE;  // cuBLAS requires 256-byte alignment
  }
  if (bytes > 0 && !ms::sim::IsDeviceRange(workspace, bytes)) {
    return ms::sim::cublas::Fail(CUBLAS_STATUS_INVALID_VALUE,
                                 ms::sim::cublas::Where("cublasSetWorkspace", "the workspace", workspace, bytes));
  }
  handle->workspace = bytes > 0 ? workspace : nullptr;
  handle->workspace_bytes = bytes;
  return CUBLAS_STATUS_SUCCESS;
}

const char* cublasGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

const char* cublasGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "the operation completed successfully";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "an absent device architectural feature is required";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "an access to GPU memory space failed";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "the functionality requested is not supported";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "error detected trying to check the license";
  }
  return "unknown error";
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t /*algo*/) {
  return ms::sim::cublas::Dispatch("cublasGemmEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype,
                                   ldb, 0, beta, C, Ctype, ldc, 0, 1, computeType);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                          int m, int n, int k, const void* alpha, const void* A, cudaDataType Atype,
                                          int lda, long long int strideA, const void* B, cudaDataType Btype, int ldb,
                                          long long int strideB, const void* beta, void* C, cudaDataType Ctype, int ldc,
                                          long long int strideC, int batchCount, cublasComputeType_t computeType,
                                          cublasGemmAlgo_t /*algo*/) {
  return ms::sim::cublas::Dispatch("cublasGemmStridedBatchedEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda,
                                   strideA, B, Btype, ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount,
                                   computeType);
}

cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                              int k, const float* alpha, const float* A, int lda, const float* B, int ldb,
                              const float* beta, float* C, int ldc) {
  return ms::sim::cublas::Dispatch("cublasSgemm", handle, transa, transb, m, n, k, alpha, A, CUDA_R_32F, lda, 0, B,
                                   CUDA_R_32F, ldb, 0, beta, C, CUDA_R_32F, ldc, 0, 1, CUBLAS_COMPUTE_32F);
}
