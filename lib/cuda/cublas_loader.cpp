// The cuBLAS and cuBLASLt functions of the GPU flavor, forwarded to the libraries loaded at the first call
// (cublas_loader.h says why). Each definition below is the header's declaration with its body; the compiler
// refuses one whose parameters differ from the header's (two C-linkage functions of one name).
#include "cuda/cublas_loader.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <dlfcn.h>

#include <mutex>
#include <string>
#include <utility>

// The cuBLAS / cuBLASLt functions the backend calls (but cublasGetStatusString, defined by hand below): the
// forwarding definitions and LoadCublas's check are both made from this list.
#define MS_CUBLAS_FUNCTIONS(X)                                                                                         \
  X(kBlas, cublasCreate_v2, (cublasHandle_t * handle), (handle))                                                       \
  X(kBlas, cublasDestroy_v2, (cublasHandle_t handle), (handle))                                                        \
  X(kBlas, cublasSetStream_v2, (cublasHandle_t handle, cudaStream_t stream), (handle, stream))                         \
  X(kBlas, cublasSetWorkspace_v2, (cublasHandle_t handle, void* workspace, size_t bytes), (handle, workspace, bytes))  \
  X(kBlas, cublasGemmEx,                                                                                               \
    (cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,                   \
     const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B, cudaDataType Btype, int ldb,        \
     const void* beta, void* C, cudaDataType Ctype, int ldc, cublasComputeType_t computeType, cublasGemmAlgo_t algo),  \
    (handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, computeType, algo))    \
  X(kLt, cublasLtCreate, (cublasLtHandle_t * handle), (handle))                                                        \
  X(kLt, cublasLtDestroy, (cublasLtHandle_t handle), (handle))                                                         \
  X(kLt, cublasLtMatmul,                                                                                               \
    (cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* A,                             \
     cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc, const void* beta, const void* C,       \
     cublasLtMatrixLayout_t Cdesc, void* D, cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo,            \
     void* workspace, size_t workspace_bytes, cudaStream_t stream),                                                    \
    (handle, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, workspace, workspace_bytes, stream))     \
  X(kLt, cublasLtMatmulAlgoGetHeuristic,                                                                               \
    (cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc,   \
     cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc, cublasLtMatmulPreference_t preference, int requested, \
     cublasLtMatmulHeuristicResult_t results[], int* returned),                                                        \
    (handle, desc, Adesc, Bdesc, Cdesc, Ddesc, preference, requested, results, returned))                              \
  X(kLt, cublasLtMatmulDescCreate, (cublasLtMatmulDesc_t * desc, cublasComputeType_t compute, cudaDataType_t scale),   \
    (desc, compute, scale))                                                                                            \
  X(kLt, cublasLtMatmulDescDestroy, (cublasLtMatmulDesc_t desc), (desc))                                               \
  X(kLt, cublasLtMatmulDescSetAttribute,                                                                               \
    (cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const void* buf, size_t bytes),                   \
    (desc, attr, buf, bytes))                                                                                          \
  X(kLt, cublasLtMatmulPreferenceCreate, (cublasLtMatmulPreference_t * pref), (pref))                                  \
  X(kLt, cublasLtMatmulPreferenceDestroy, (cublasLtMatmulPreference_t pref), (pref))                                   \
  X(kLt, cublasLtMatmulPreferenceSetAttribute,                                                                         \
    (cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, const void* buf, size_t bytes),       \
    (pref, attr, buf, bytes))                                                                                          \
  X(kLt, cublasLtMatrixLayoutCreate,                                                                                   \
    (cublasLtMatrixLayout_t * layout, cudaDataType type, uint64_t rows, uint64_t cols, int64_t ld),                    \
    (layout, type, rows, cols, ld))                                                                                    \
  X(kLt, cublasLtMatrixLayoutDestroy, (cublasLtMatrixLayout_t layout), (layout))

namespace ms::cuda {
namespace {

struct Libraries {
  void* lt = nullptr;
  void* blas = nullptr;
  Status status;
};

// dlopen by soname first (LD_LIBRARY_PATH, the binary's run path, the loader cache), then in the toolkit's library
// folder found at build time.
void* Open(const std::string& soname, Status* status) {
  void* lib = ::dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib != nullptr) return lib;
  const char* first = ::dlerror();
  std::string why = first != nullptr ? first : "no reason given";
#if defined(MS_CUDA_LIBRARY_DIR)
  std::string path = std::string(MS_CUDA_LIBRARY_DIR) + "/" + soname;
  lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib != nullptr) return lib;
#endif
  *status = Unavailable(
      "cuBLAS is not available: dlopen({}) failed ({}); install the CUDA {} toolkit's cuBLAS or add its library "
      "folder to LD_LIBRARY_PATH",
      soname, why, CUBLAS_VER_MAJOR);
  return nullptr;
}

const Libraries& Load() {
  static Libraries libs;
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string major = std::to_string(CUBLAS_VER_MAJOR);
    libs.lt = Open("libcublasLt.so." + major, &libs.status);
    if (libs.lt != nullptr) libs.blas = Open("libcublas.so." + major, &libs.status);
  });
  return libs;
}

enum class Lib { kLt, kBlas };

// The function `name` of a loaded library; nullptr when the libraries cannot be loaded or lack it.
void* Resolve(Lib which, const char* name) {
  const Libraries& libs = Load();
  void* lib = which == Lib::kLt ? libs.lt : libs.blas;
  return lib != nullptr ? ::dlsym(lib, name) : nullptr;
}

// Every function defined below, with its library: LoadCublas checks that each resolves.
#define MS_CUBLAS_ENTRY(lib, name, params, args) std::pair{Lib::lib, #name},
constexpr std::pair<Lib, const char*> kFunctions[] = {{Lib::kBlas, "cublasGetStatusString"},
                                                      MS_CUBLAS_FUNCTIONS(MS_CUBLAS_ENTRY)};
#undef MS_CUBLAS_ENTRY

}  // namespace

Status LoadCublas() {
  const Libraries& libs = Load();
  if (!libs.status.ok()) return libs.status;
  for (const auto& [which, name] : kFunctions) {
    if (Resolve(which, name) == nullptr)
      return Unavailable("cuBLAS is not available: the loaded library has no function {}; is it CUDA {}'s?", name,
                         CUBLAS_VER_MAJOR);
  }
  return Status::Ok();
}

}  // namespace ms::cuda

using ms::cuda::Lib;
using ms::cuda::Resolve;

// One forwarding definition: `fn` is resolved at the first call; CUBLAS_STATUS_NOT_INITIALIZED without it.
#define MS_CUBLAS_FORWARD(lib, name, params, args)                                               \
  cublasStatus_t CUBLASWINAPI name params {                                                      \
    static const auto fn = reinterpret_cast<cublasStatus_t(*) params>(Resolve(Lib::lib, #name)); \
    return fn != nullptr ? fn args : CUBLAS_STATUS_NOT_INITIALIZED;                              \
  }

extern "C" {

MS_CUBLAS_FUNCTIONS(MS_CUBLAS_FORWARD)

const char* CUBLASWINAPI cublasGetStatusString(cublasStatus_t status) {
  static const auto fn =
      reinterpret_cast<decltype(&cublasGetStatusString)>(Resolve(Lib::kBlas, "cublasGetStatusString"));
  return fn != nullptr ? fn(status) : "cuBLAS is not loaded (its status strings with it)";
}

}  // extern "C"
