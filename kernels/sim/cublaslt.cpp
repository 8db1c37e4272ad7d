// kernels/sim/cublaslt.cpp: the subset of cuBLASLt that the CUDA backend uses (GEMMs with fused epilogues), on the
// CPU, for emulated builds only (never linked with the real libcublasLt). Declarations come from the real
// cublasLt.h, so types, enum values and signatures are NVIDIA's; argument checks follow its documentation.
//
//   handles       cublasLtCreate / Destroy, status names and strings;
//   descriptors   cublasLtMatmulDescCreate (compute CUBLAS_COMPUTE_32F, scale CUDA_R_32F) / Destroy / SetAttribute
//                 for TRANSA, TRANSB, EPILOGUE, BIAS_POINTER, BIAS_DATA_TYPE, EPILOGUE_AUX_POINTER, EPILOGUE_AUX_LD,
//                 EPILOGUE_AUX_DATA_TYPE and POINTER_MODE (host only); any other attribute is
//                 CUBLAS_STATUS_NOT_SUPPORTED ("not emulated");
//   layouts       cublasLtMatrixLayoutCreate / Destroy: column-major, one matrix (no attributes are emulated);
//   preferences   cublasLtMatmulPreferenceCreate / Destroy / SetAttribute (MAX_WORKSPACE_BYTES, MIN_ALIGNMENT_*);
//   heuristics    cublasLtMatmulAlgoGetHeuristic: one algorithm (no workspace) for a problem this emulator runs,
//                 else CUBLAS_STATUS_NOT_SUPPORTED and no result — what cuBLASLt answers when no kernel fits (also
//                 for the next calls a test names with ms::sim::RefuseNextLtHeuristics, sim/runtime_hooks.h);
//   cublasLtMatmul  D = epilogue(alpha op(A) op(B) + beta C), column-major, on the given stream.
// Problems: A = B bf16; C = D, both bf16 or both fp32; products accumulated in fp32 in k order exactly as the
// emulated cublasGemmEx does (kernels/sim/blas_core.h), then, per element v = alpha acc + beta C (C not read when
// beta == 0):
//   DEFAULT        D = v
//   BIAS           D = v + bias[row]
//   GELU_AUX_BIAS  aux = v + bias[row] (stored as the aux type), D = gelu(v + bias[row])
//   DGELU          D = v * gelu'(aux)        (aux: the GELU input a GELU_AUX_BIAS forward stored)
// gelu is the tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in fp32, from the unrounded v.
// As documented: the bias has as many elements as D has rows and, by default, D's type; the aux matrix has D's type
// by default, a leading dimension >= D's rows and divisible by 8, and is required by the aux epilogues. This
// emulator takes no other bias or aux type (NOT_SUPPORTED: the documented exceptions are fp8 and int8 kernels). An
// algorithm is chosen for the alignment the preference promises (256 bytes unless MIN_ALIGNMENT_*_BYTES says less):
// cublasLtMatmul refuses (CUBLAS_STATUS_INVALID_VALUE) A, B, C or D pointers aligned less than that. Matrices,
// bias and aux must lie inside cudaMalloc'd buffers (else CUBLAS_STATUS_EXECUTION_FAILED, reported as a failed
// kernel, as the GPU would fault).
#include <cublasLt.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "sim/blas_core.h"
#include "sim/internal.h"
#include "sim/runtime_hooks.h"

namespace ms::sim::cublaslt {
namespace {

using blas::Extent;
using blas::Load;
using blas::StoreAs;
using blas::Where;

constexpr int32_t kDefaultType = -1;  // BIAS_DATA_TYPE / EPILOGUE_AUX_DATA_TYPE unset: D's type

struct Desc {
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  cudaDataType_t scale = CUDA_R_32F;
  cublasOperation_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  int32_t bias_type = kDefaultType;
  const void* aux = nullptr;
  int64_t aux_ld = 0;
  int32_t aux_type = kDefaultType;
};
struct Layout {
  cudaDataType type;
  int64_t rows, cols, ld;
};
struct Pref {
  uint64_t max_workspace = 0;
  uint32_t align[4] = {256, 256, 256, 256};  // A, B, C, D
};

// Every live object, by handle (the opaque structs are allocated only to give each a unique address).
struct Registry {
  std::mutex mu;
  std::map<const void*, bool> handles;
  std::map<const void*, Desc> descs;
  std::map<const void*, Layout> layouts;
  std::map<const void*, Pref> prefs;
};
Registry& Live() {
  static Registry* r = new Registry;  // never destroyed: usable from static destructors
  return *r;
}

template <class T>
bool Find(std::map<const void*, T>& m, const void* key, T* out) {
  std::lock_guard<std::mutex> lock(Live().mu);
  auto it = m.find(key);
  if (it == m.end()) return false;
  if (out) *out = it->second;
  return true;
}

// A new object of the opaque type Obj (allocated only to give it a unique address), registered with its record.
template <class Obj, class Rec>
Obj* Register(std::map<const void*, Rec>& m, const Rec& rec) {
  auto* obj = new Obj{};
  std::lock_guard<std::mutex> lock(Live().mu);
  m[obj] = rec;
  return obj;
}
// Unregisters and frees an object Register made; false for one it did not (or a null one).
template <class Obj, class Rec>
bool Unregister(std::map<const void*, Rec>& m, Obj* obj) {
  {
    std::lock_guard<std::mutex> lock(Live().mu);
    if (!obj || m.erase(obj) != 1) return false;
  }
  delete obj;
  return true;
}

cublasStatus_t Fail(cublasStatus_t status, const std::string& message) {
  internal::ReportError(message);
  return status;
}

bool IsTrans(cublasOperation_t op) {
  return op == CUBLAS_OP_T || op == CUBLAS_OP_C;
}
bool HasBias(cublasLtEpilogue_t e) {
  return e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
}
bool HasAux(cublasLtEpilogue_t e) {
  return e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || e == CUBLASLT_EPILOGUE_DGELU;
}

float Gelu(float v) {
  const float k = 0.7978845608028654f;
  return 0.5f * v * (1.0f + std::tanh(k * (v + 0.044715f * v * v * v)));
}
float GeluGrad(float v) {
  const float k = 0.7978845608028654f;
  const float t = std::tanh(k * (v + 0.044715f * v * v * v));
  const float du = k * (1.0f + 3.0f * 0.044715f * v * v);
  return 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du;
}

uint32_t AlignmentOf(const void* p) {  // the largest power of two <= 256 dividing the address
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}

// The problem of a descriptor and four layouts, checked: CUBLAS_STATUS_SUCCESS where this emulator runs it.
struct Problem {
  Desc d;
  Layout a, b, c, dl;
  int64_t m, n, k;
};
cublasStatus_t Check(const char* api, const Problem& p, std::string* why) {
  const Desc& d = p.d;
  const bool ta = IsTrans(d.transa), tb = IsTrans(d.transb);
  if (p.a.rows != (ta ? p.k : p.m) || p.a.cols != (ta ? p.m : p.k) || p.b.rows != (tb ? p.n : p.k) ||
      p.b.cols != (tb ? p.k : p.n) || p.c.rows != p.m || p.c.cols != p.n) {
    *why = std::string(api) + ": the layouts of A, B, C and D do not make one m x n x k product";
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (d.compute != CUBLAS_COMPUTE_32F || d.scale != CUDA_R_32F || p.a.type != CUDA_R_16BF || p.b.type != CUDA_R_16BF ||
      p.c.type != p.dl.type || (p.dl.type != CUDA_R_16BF && p.dl.type != CUDA_R_32F)) {
    *why = std::string(api) + ": only bf16 A and B, C = D bf16 or fp32, compute 32F, scale 32F are emulated";
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  switch (d.epilogue) {
    case CUBLASLT_EPILOGUE_DEFAULT:
    case CUBLASLT_EPILOGUE_BIAS:
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS:
    case CUBLASLT_EPILOGUE_DGELU:
      break;
    default:
      *why = std::string(api) + ": epilogue " + std::to_string(static_cast<int>(d.epilogue)) + " is not emulated";
      return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (HasBias(d.epilogue)) {
    if (!d.bias) {
      *why = std::string(api) + ": the epilogue adds a bias but CUBLASLT_MATMUL_DESC_BIAS_POINTER is null";
      return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (d.bias_type != kDefaultType && d.bias_type != static_cast<int32_t>(p.dl.type)) {
      *why = std::string(api) + ": a bias of another type than D's (documented only for fp8 and int8 kernels)";
      return CUBLAS_STATUS_NOT_SUPPORTED;
    }
  }
  if (HasAux(d.epilogue)) {
    if (!d.aux) {
      *why = std::string(api) + ": the epilogue needs CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER";
      return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (d.aux_ld < p.m || d.aux_ld % 8 != 0) {
      *why = std::string(api) + ": CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD " + std::to_string(d.aux_ld) +
             " must be a multiple of 8 and at least D's " + std::to_string(p.m) + " rows";
      return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (d.aux_type != kDefaultType && d.aux_type != static_cast<int32_t>(p.dl.type)) {
      *why = std::string(api) + ": an aux matrix of another type than D's (documented only for fp8 kernels)";
      return CUBLAS_STATUS_NOT_SUPPORTED;
    }
  }
  for (const Layout* l : {&p.a, &p.b, &p.c, &p.dl}) {
    if (l->ld < (l->rows > 1 ? l->rows : 1)) {
      *why = std::string(api) + ": a leading dimension is less than its matrix's rows";
      return CUBLAS_STATUS_INVALID_VALUE;
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}

// The algorithm's record in cublasLtMatmulAlgo_t::data: a tag, then the alignment (bytes) it was chosen for.
constexpr uint64_t kAlgoTag = 0x6d732d73696d6c74ull;  // "ms-simlt"

std::atomic<int> g_refuse_heuristics{0};  // RefuseNextLtHeuristics

}  // namespace
}  // namespace ms::sim::cublaslt

namespace ms::sim {
void RefuseNextLtHeuristics(int count) {
  cublaslt::g_refuse_heuristics.store(count > 0 ? count : 0);
}
}  // namespace ms::sim

using namespace ms::sim::cublaslt;  // NOLINT(google-build-using-namespace): this file implements its C API

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
  // Any unique address serves: the handle is never dereferenced.
  *handle = reinterpret_cast<cublasLtHandle_t>(Register<char>(Live().handles, true));
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  return Unregister(Live().handles, reinterpret_cast<char*>(handle)) ? CUBLAS_STATUS_SUCCESS
                                                                     : CUBLAS_STATUS_NOT_INITIALIZED;
}

const char* cublasLtGetStatusName(cublasStatus_t status) {
  return cublasGetStatusName(status);
}
const char* cublasLtGetStatusString(cublasStatus_t status) {
  return cublasGetStatusString(status);
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute, cudaDataType_t scale) {
  if (!desc) return CUBLAS_STATUS_INVALID_VALUE;
  Desc rec;
  rec.compute = compute;
  rec.scale = scale;
  *desc = Register<cublasLtMatmulDescOpaque_t>(Live().descs, rec);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  return Unregister(Live().descs, desc) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t bytes) {
  std::lock_guard<std::mutex> lock(Live().mu);
  auto it = Live().descs.find(desc);
  if (it == Live().descs.end() || !buf) return CUBLAS_STATUS_INVALID_VALUE;
  Desc& d = it->second;
  auto take = [&](auto* field) {
    if (bytes != sizeof *field) return CUBLAS_STATUS_INVALID_VALUE;
    std::memcpy(field, buf, bytes);
    return CUBLAS_STATUS_SUCCESS;
  };
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
      return take(&d.transa);
    case CUBLASLT_MATMUL_DESC_TRANSB:
      return take(&d.transb);
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      return take(&d.epilogue);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
      return take(&d.bias);
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
      return take(&d.bias_type);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER:
      return take(&d.aux);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD:
      return take(&d.aux_ld);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE:
      return take(&d.aux_type);
    case CUBLASLT_MATMUL_DESC_POINTER_MODE: {
      int32_t mode = 0;
      if (bytes != sizeof mode) return CUBLAS_STATUS_INVALID_VALUE;
      std::memcpy(&mode, buf, bytes);
      return mode == CUBLASLT_POINTER_MODE_HOST ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_SUPPORTED;
    }
    default:
      return Fail(CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatmulDescSetAttribute: attribute " +
                                                   std::to_string(static_cast<int>(attr)) + " is not emulated");
  }
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
  if (!layout || rows > (1ull << 62) || cols > (1ull << 62)) return CUBLAS_STATUS_INVALID_VALUE;
  *layout = Register<cublasLtMatrixLayoutOpaque_t>(
      Live().layouts, Layout{type, static_cast<int64_t>(rows), static_cast<int64_t>(cols), ld});
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  return Unregister(Live().layouts, layout) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  if (!pref) return CUBLAS_STATUS_INVALID_VALUE;
  *pref = Register<cublasLtMatmulPreferenceOpaque_t>(Live().prefs, Pref{});
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  return Unregister(Live().prefs, pref) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t bytes) {
  std::lock_guard<std::mutex> lock(Live().mu);
  auto it = Live().prefs.find(pref);
  if (it == Live().prefs.end() || !buf) return CUBLAS_STATUS_INVALID_VALUE;
  Pref& p = it->second;
  if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
    if (bytes != sizeof p.max_workspace) return CUBLAS_STATUS_INVALID_VALUE;
    std::memcpy(&p.max_workspace, buf, bytes);
    return CUBLAS_STATUS_SUCCESS;
  }
  const int slot = attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES   ? 0
                   : attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES ? 1
                   : attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES ? 2
                   : attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES ? 3
                                                                        : -1;
  if (slot < 0) {
    return Fail(CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatmulPreferenceSetAttribute: attribute " +
                                                 std::to_string(static_cast<int>(attr)) + " is not emulated");
  }
  if (bytes != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(&p.align[slot], buf, bytes);
  return CUBLAS_STATUS_SUCCESS;
}

namespace {
// The problem of a heuristic or matmul call, from the registry: INVALID_VALUE for an unknown object.
cublasStatus_t Gather(cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t A, cublasLtMatrixLayout_t B,
                      cublasLtMatrixLayout_t C, cublasLtMatrixLayout_t D, Problem* p) {
  if (!Find(Live().descs, desc, &p->d) || !Find(Live().layouts, A, &p->a) || !Find(Live().layouts, B, &p->b) ||
      !Find(Live().layouts, C, &p->c) || !Find(Live().layouts, D, &p->dl)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  p->m = p->dl.rows;
  p->n = p->dl.cols;
  p->k = IsTrans(p->d.transa) ? p->a.rows : p->a.cols;
  return CUBLAS_STATUS_SUCCESS;
}
}  // namespace

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t A, cublasLtMatrixLayout_t B,
                                              cublasLtMatrixLayout_t C, cublasLtMatrixLayout_t D,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int* returned) {
  if (!Find(Live().handles, handle, static_cast<bool*>(nullptr))) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!returned || !results || requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
  *returned = 0;
  Problem p;
  Pref pr;
  if (Gather(desc, A, B, C, D, &p) != CUBLAS_STATUS_SUCCESS || !Find(Live().prefs, pref, &pr)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  std::string why;
  if (const cublasStatus_t s = Check("cublasLtMatmulAlgoGetHeuristic", p, &why); s != CUBLAS_STATUS_SUCCESS) {
    return s;  // no algorithm: not reported as an error (the caller decides what to do without one)
  }
  for (int left = g_refuse_heuristics.load(); left > 0;) {  // RefuseNextLtHeuristics: no algorithm, this time
    if (g_refuse_heuristics.compare_exchange_weak(left, left - 1)) return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  std::memset(&results[0], 0, sizeof results[0]);
  results[0].algo.data[0] = kAlgoTag;
  uint32_t align = 256;
  for (uint32_t a : pr.align) align = a < align ? a : align;
  results[0].algo.data[1] = align;
  results[0].workspaceSize = 0;
  results[0].state = CUBLAS_STATUS_SUCCESS;
  results[0].wavesCount = 1.0f;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha_p, const void* A,
                              cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc,
                              const void* beta_p, const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream) {
  static const char* kApi = "cublasLtMatmul";
  if (!Find(Live().handles, handle, static_cast<bool*>(nullptr))) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (ms::sim::InHostFunction()) {
    return Fail(CUBLAS_STATUS_NOT_SUPPORTED,
                "cublasLtMatmul: called from a host function (cudaLaunchHostFunc), which must not make CUDA calls");
  }
  Problem p;
  if (Gather(desc, Adesc, Bdesc, Cdesc, Ddesc, &p) != CUBLAS_STATUS_SUCCESS) {
    return Fail(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmul: an unknown descriptor or layout");
  }
  std::string why;
  if (const cublasStatus_t s = Check(kApi, p, &why); s != CUBLAS_STATUS_SUCCESS) return Fail(s, why);
  uint32_t align = 256;  // what an algorithm chosen without a preference assumes
  if (algo) {
    if (algo->data[0] != kAlgoTag) return Fail(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmul: not an algorithm");
    align = static_cast<uint32_t>(algo->data[1]);
  }
  const void* mats[4] = {A, B, C, D};
  for (int i = 0; i < 4; ++i) {
    if (mats[i] && AlignmentOf(mats[i]) < align) {
      return Fail(CUBLAS_STATUS_INVALID_VALUE,
                  std::string(kApi) + ": matrix " + "ABCD"[i] + " is aligned to " +
                      std::to_string(AlignmentOf(mats[i])) + " bytes, less than the algorithm was chosen for (" +
                      std::to_string(align) + "; set CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*)");
    }
  }
  if (!alpha_p || !beta_p) return Fail(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmul: alpha or beta is null");
  if (ms::sim::IsDeviceRange(alpha_p, sizeof(float)) || ms::sim::IsDeviceRange(beta_p, sizeof(float))) {
    return Fail(CUBLAS_STATUS_INVALID_VALUE,
                "cublasLtMatmul: alpha or beta is device memory but the pointer mode is HOST (the host would fault)");
  }
  float alpha, beta;
  std::memcpy(&alpha, alpha_p, sizeof alpha);
  std::memcpy(&beta, beta_p, sizeof beta);
  if (workspace_bytes > 0 && !ms::sim::IsDeviceRange(workspace, workspace_bytes)) {
    return Fail(CUBLAS_STATUS_EXECUTION_FAILED, Where(kApi, "the workspace", workspace, workspace_bytes));
  }
  if (!ms::sim::IsKnownStream(stream)) {
    return Fail(CUBLAS_STATUS_EXECUTION_FAILED, "cublasLtMatmul: the stream is not a live stream");
  }
  if (p.m == 0 || p.n == 0) return CUBLAS_STATUS_SUCCESS;
  const bool reads_ab = p.k > 0 && alpha != 0.0f;
  const size_t a_bytes = Extent(p.a.rows, p.a.cols, p.a.ld, p.a.type);
  const size_t b_bytes = Extent(p.b.rows, p.b.cols, p.b.ld, p.b.type);
  const size_t c_bytes = Extent(p.m, p.n, p.c.ld, p.c.type), d_bytes = Extent(p.m, p.n, p.dl.ld, p.dl.type);
  const Desc& d = p.d;
  if (reads_ab && !ms::sim::IsDeviceRange(A, a_bytes)) {
    return Fail(CUBLAS_STATUS_EXECUTION_FAILED, Where(kApi, "A", A, a_bytes));
  }
  if (reads_ab && !ms::sim::IsDeviceRange(B, b_bytes)) {
    return Fail(CUBLAS_STATUS_EXECUTION_FAILED, Where(kApi, "B", B, b_bytes));
  }
  if (beta != 0.0f && !ms::sim::IsDeviceRange(C, c_bytes)) {
    return Fail(CUBLAS_STATUS_EXECUTION_FAILED, Where(kApi, "C", C, c_bytes));
  }
  if (!ms::sim::IsDeviceRange(D, d_bytes)) return Fail(CUBLAS_STATUS_EXECUTION_FAILED, Where(kApi, "D", D, d_bytes));
  const size_t bias_bytes = static_cast<size_t>(p.m) * ms::sim::blas::ElementBytes(p.dl.type);
  if (HasBias(d.epilogue) && !ms::sim::IsDeviceRange(d.bias, bias_bytes)) {
    return Fail(CUBLAS_STATUS_EXECUTION_FAILED, Where(kApi, "the bias", d.bias, bias_bytes));
  }
  const size_t aux_bytes = Extent(p.m, p.n, d.aux_ld, p.dl.type);
  if (HasAux(d.epilogue) && !ms::sim::IsDeviceRange(d.aux, aux_bytes)) {
    return Fail(CUBLAS_STATUS_EXECUTION_FAILED, Where(kApi, "the aux matrix", d.aux, aux_bytes));
  }

  const cudaError_t queued = ms::sim::EnqueueOnStream(stream, kApi, [p, A, B, C, D, alpha, beta, reads_ab]() {
    const Desc& d = p.d;
    const cudaDataType t = p.dl.type;  // D's = C's = the bias's = the aux's type
    auto finish = [&](int64_t i, int64_t j, float acc) {
      float v = alpha * acc;
      if (beta != 0.0f) v += beta * Load(C, t, i + j * p.c.ld);
      if (HasBias(d.epilogue)) v += Load(d.bias, t, i);
      if (d.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS) {
        StoreAs(const_cast<void*>(d.aux), t, i + j * d.aux_ld, v);
        v = Gelu(v);
      } else if (d.epilogue == CUBLASLT_EPILOGUE_DGELU) {
        v *= GeluGrad(Load(d.aux, t, i + j * d.aux_ld));
      }
      StoreAs(D, t, i + j * p.dl.ld, v);
    };
    if (!reads_ab) {
      for (int64_t j = 0; j < p.n; ++j)
        for (int64_t i = 0; i < p.m; ++i) finish(i, j, 0.0f);
      return cudaSuccess;
    }
    thread_local std::vector<float> ap, bp;
    const ms::sim::blas::Operands ops{
        IsTrans(d.transa), IsTrans(d.transb), p.m, p.n, p.k, A, p.a.type, p.a.ld, B, p.b.type, p.b.ld};
    ms::sim::blas::Pack(ops, false, ap, bp);
    ms::sim::blas::Multiply(p.m, p.n, p.k, ap.data(), bp.data(), finish);
    return cudaSuccess;
  });
  if (queued != cudaSuccess) return Fail(CUBLAS_STATUS_EXECUTION_FAILED, "cublasLtMatmul: the stream is not live");
  return CUBLAS_STATUS_SUCCESS;
}
