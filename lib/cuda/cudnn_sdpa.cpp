// cuDNN's fused attention through the backend API, libcudnn loaded at run time (cudnn_sdpa.h).
#include "cuda/cudnn_sdpa.h"

#include <cudnn.h>
#include <dlfcn.h>

#include <atomic>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

namespace ms::cuda::cudnn {
namespace {

using Desc = cudnnBackendDescriptor_t;

// The handle attributes cuDNN 9.19 deprecates in favour of device-property descriptors, which older cuDNN 9 releases
// (such as the one a GPU machine's PyTorch may bring) do not have: on a GPU megascale sets the handle.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
constexpr cudnnBackendAttributeName_t kGraphHandle = CUDNN_ATTR_OPERATIONGRAPH_HANDLE;
constexpr cudnnBackendAttributeName_t kPlanHandle = CUDNN_ATTR_EXECUTION_PLAN_HANDLE;
#pragma GCC diagnostic pop

// The library's entry points, resolved once.
struct Api {
  decltype(&cudnnGetVersion) GetVersion = nullptr;
  decltype(&cudnnGetErrorString) GetErrorString = nullptr;
  decltype(&cudnnGetLastErrorString) GetLastErrorString = nullptr;
  decltype(&cudnnCreate) Create = nullptr;
  decltype(&cudnnDestroy) Destroy = nullptr;
  decltype(&cudnnSetStream) SetStream = nullptr;
  decltype(&cudnnBackendCreateDescriptor) CreateDescriptor = nullptr;
  decltype(&cudnnBackendDestroyDescriptor) DestroyDescriptor = nullptr;
  decltype(&cudnnBackendSetAttribute) SetAttribute = nullptr;
  decltype(&cudnnBackendGetAttribute) GetAttribute = nullptr;
  decltype(&cudnnBackendFinalize) Finalize = nullptr;
  decltype(&cudnnBackendExecute) Execute = nullptr;
};

Result<const Api*> LoadApi() {
  static std::once_flag once;
  static Api api;
  static Status status;
  std::call_once(once, [] {
    void* lib = ::dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = ::dlerror();
      status = Unavailable(
          "cuDNN is not available: dlopen(libcudnn.so.9) failed ({}); install cuDNN 9 or add its folder to "
          "LD_LIBRARY_PATH (on the GPU machine scripts/gpu_check.sh finds PyTorch's)",
          why ? why : "no reason given");
      return;
    }
    auto resolve = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(lib, name));
      if (fn == nullptr && status.ok()) status = Unavailable("cuDNN: libcudnn.so.9 has no symbol {}", name);
    };
    resolve(api.GetVersion, "cudnnGetVersion");
    resolve(api.GetErrorString, "cudnnGetErrorString");
    resolve(api.GetLastErrorString, "cudnnGetLastErrorString");
    resolve(api.Create, "cudnnCreate");
    resolve(api.Destroy, "cudnnDestroy");
    resolve(api.SetStream, "cudnnSetStream");
    resolve(api.CreateDescriptor, "cudnnBackendCreateDescriptor");
    resolve(api.DestroyDescriptor, "cudnnBackendDestroyDescriptor");
    resolve(api.SetAttribute, "cudnnBackendSetAttribute");
    resolve(api.GetAttribute, "cudnnBackendGetAttribute");
    resolve(api.Finalize, "cudnnBackendFinalize");
    resolve(api.Execute, "cudnnBackendExecute");
    if (status.ok() && api.GetVersion() < 90000) {
      status = Unavailable("cuDNN {} is loaded; megascale's fused attention needs cuDNN 9", api.GetVersion());
    }
  });
  if (!status.ok()) return status;
  return &api;
}

// A cuDNN status as a Status naming the call, with cuDNN's own last message.
Status Check(const Api& api, cudnnStatus_t s, std::string_view what) {
  if (s == CUDNN_STATUS_SUCCESS) return Status::Ok();
  char detail[1024] = {0};
  api.GetLastErrorString(detail, sizeof detail);
  return Internal("cuDNN {}: {}{}{}", what, api.GetErrorString(s), detail[0] ? ": " : "", detail);
}

// Owns descriptors; destroys them in reverse order.
class Descs {
 public:
  explicit Descs(const Api& api) : api_(api) {}
  ~Descs() {
    for (auto it = all_.rbegin(); it != all_.rend(); ++it) api_.DestroyDescriptor(*it);
  }
  Descs(const Descs&) = delete;
  Descs& operator=(const Descs&) = delete;

  Result<Desc> Make(cudnnBackendDescriptorType_t type, std::string_view what) {
    Desc d = nullptr;
    MS_RETURN_IF_ERROR(Check(api_, api_.CreateDescriptor(type, &d), fmt::format("creating the {} descriptor", what)));
    all_.push_back(d);
    return d;
  }
  template <typename T>
  Status Set(Desc d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t n, const T* values,
             std::string_view what) {
    return Check(api_, api_.SetAttribute(d, name, type, n, values),
                 fmt::format("setting attribute {} of {}", static_cast<int>(name), what));
  }
  Status Finalize(Desc d, std::string_view what) {
    return Check(api_, api_.Finalize(d), fmt::format("finalizing {}", what));
  }
  const Api& api() const { return api_; }

 private:
  const Api& api_;
  std::vector<Desc> all_;
};

struct TensorSpec {
  std::vector<int64_t> dims, strides;
  cudnnDataType_t type = CUDNN_DATA_FLOAT;
  bool is_virtual = true;
  bool by_value = false;
};

GraphRecord::Type RecordType(cudnnDataType_t t) {
  switch (t) {
    case CUDNN_DATA_BFLOAT16:
      return GraphRecord::Type::kBf16;
    case CUDNN_DATA_INT32:
      return GraphRecord::Type::kInt32;
    case CUDNN_DATA_BOOLEAN:
      return GraphRecord::Type::kBool;
    default:
      return GraphRecord::Type::kFloat;
  }
}
GraphRecord::Op RecordOp(cudnnPointwiseMode_t m) {
  using O = GraphRecord::Op;
  switch (m) {
    case CUDNN_POINTWISE_ADD:
      return O::kAdd;
    case CUDNN_POINTWISE_SUB:
      return O::kSub;
    case CUDNN_POINTWISE_DIV:
      return O::kDiv;
    case CUDNN_POINTWISE_EXP:
      return O::kExp;
    case CUDNN_POINTWISE_LOG:
      return O::kLog;
    case CUDNN_POINTWISE_IDENTITY:
      return O::kIdentity;
    case CUDNN_POINTWISE_GEN_INDEX:
      return O::kGenIndex;
    case CUDNN_POINTWISE_CMP_GE:
      return O::kCmpGe;
    case CUDNN_POINTWISE_CMP_GT:
      return O::kCmpGt;
    case CUDNN_POINTWISE_CMP_LT:
      return O::kCmpLt;
    case CUDNN_POINTWISE_LOGICAL_AND:
      return O::kLogicalAnd;
    case CUDNN_POINTWISE_BINARY_SELECT:
      return O::kBinarySelect;
    default:
      return O::kMul;  // the one mode left among those the graphs use
  }
}

// Builds an operation graph: tensors get their uids here (virtual ones from 1000 on); with a record, each tensor
// and operation is also written into it (GraphRecord).
class GraphBuilder {
 public:
  explicit GraphBuilder(Descs& d, GraphRecord* record = nullptr) : d_(d), record_(record) {}

  Result<Desc> Tensor(const TensorSpec& t, int64_t uid, std::string_view what) {
    MS_ASSIGN_OR_RETURN(Desc desc, d_.Make(CUDNN_BACKEND_TENSOR_DESCRIPTOR, what));
    const int64_t n = static_cast<int64_t>(t.dims.size());
    const int64_t align = 16;
    const bool v = t.is_virtual, bv = t.by_value;
    MS_RETURN_IF_ERROR(d_.Set(desc, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &t.type, what));
    MS_RETURN_IF_ERROR(d_.Set(desc, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, n, t.dims.data(), what));
    MS_RETURN_IF_ERROR(d_.Set(desc, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, n, t.strides.data(), what));
    MS_RETURN_IF_ERROR(d_.Set(desc, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, what));
    MS_RETURN_IF_ERROR(d_.Set(desc, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, what));
    MS_RETURN_IF_ERROR(d_.Set(desc, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &v, what));
    if (bv) MS_RETURN_IF_ERROR(d_.Set(desc, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &bv, what));
    MS_RETURN_IF_ERROR(d_.Finalize(desc, what));
    uids_[desc] = uid;
    if (record_) {
      record_->tensors.push_back({uid, t.dims, t.strides, RecordType(t.type), v, bv, std::string(what)});
    }
    return desc;
  }
  // A virtual intermediate of the given dims (packed, row-major) and type.
  Result<Desc> Virtual(std::vector<int64_t> dims, cudnnDataType_t type, std::string_view what) {
    TensorSpec t;
    t.dims = std::move(dims);
    t.strides.assign(t.dims.size(), 1);
    for (int i = static_cast<int>(t.dims.size()) - 2; i >= 0; --i) t.strides[i] = t.strides[i + 1] * t.dims[i + 1];
    t.type = type;
    return Tensor(t, next_virtual_++, what);
  }
  // A scalar passed by value at execution (its uid bound to a host pointer in the variant pack).
  Result<Desc> Scalar(int64_t uid, cudnnDataType_t type, std::string_view what) {
    TensorSpec t;
    t.dims = {1, 1, 1, 1};
    t.strides = {1, 1, 1, 1};
    t.type = type;
    t.is_virtual = false;
    t.by_value = true;
    return Tensor(t, uid, what);
  }
  // An operation of `type` with its descriptor-valued attributes (null ones left out), finalized and added.
  Status Operation(cudnnBackendDescriptorType_t type,
                   std::initializer_list<std::pair<cudnnBackendAttributeName_t, Desc>> attributes,
                   std::string_view what) {
    MS_ASSIGN_OR_RETURN(Desc op, d_.Make(type, what));
    for (const auto& [name, value] : attributes) {
      if (value != nullptr) MS_RETURN_IF_ERROR(d_.Set(op, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value, what));
    }
    MS_RETURN_IF_ERROR(d_.Finalize(op, what));
    ops_.push_back(op);
    return Status::Ok();
  }
  // y = mode(x[, b][, t]) elementwise (broadcasting), computed in `math`; GEN_INDEX takes `axis`.
  Status Pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t math, Desc x, Desc b, Desc t, Desc y,
                   std::string_view what, int64_t axis = -1) {
    MS_ASSIGN_OR_RETURN(Desc pw, d_.Make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, what));
    MS_RETURN_IF_ERROR(d_.Set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, what));
    MS_RETURN_IF_ERROR(d_.Set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math, what));
    if (axis >= 0) MS_RETURN_IF_ERROR(d_.Set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, what));
    MS_RETURN_IF_ERROR(d_.Finalize(pw, what));
    Record(RecordOp(mode), {x, b, t}, y, what, axis);
    return Operation(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR,
                     {{CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw},
                      {CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x},
                      {CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b},
                      {CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t},
                      {CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y}},
                     what);
  }
  Status Reduction(cudnnReduceTensorOp_t mode, Desc x, Desc y, std::string_view what) {
    MS_ASSIGN_OR_RETURN(Desc r, d_.Make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, what));
    const cudnnDataType_t f = CUDNN_DATA_FLOAT;
    MS_RETURN_IF_ERROR(d_.Set(r, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, what));
    MS_RETURN_IF_ERROR(d_.Set(r, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f, what));
    MS_RETURN_IF_ERROR(d_.Finalize(r, what));
    Record(mode == CUDNN_REDUCE_TENSOR_MAX ? GraphRecord::Op::kReduceMax : GraphRecord::Op::kReduceAdd, {x}, y, what);
    return Operation(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR,
                     {{CUDNN_ATTR_OPERATION_REDUCTION_DESC, r},
                      {CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x},
                      {CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y}},
                     what);
  }
  // c = a b; m, n, k: tensors of the problem's true sizes per batch (the padding-mask form), or null.
  Status Matmul(Desc a, Desc b, Desc c, std::string_view what, Desc m_override = nullptr, Desc n_override = nullptr,
                Desc k_override = nullptr) {
    MS_ASSIGN_OR_RETURN(Desc m, d_.Make(CUDNN_BACKEND_MATMUL_DESCRIPTOR, what));
    const cudnnDataType_t f = CUDNN_DATA_FLOAT;
    MS_RETURN_IF_ERROR(d_.Set(m, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f, what));
    MS_RETURN_IF_ERROR(d_.Finalize(m, what));
    Record(GraphRecord::Op::kMatmul, {a, b}, c, what);  // the overrides (sequence lengths = T) change nothing here
    return Operation(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR,
                     {{CUDNN_ATTR_OPERATION_MATMUL_ADESC, a},
                      {CUDNN_ATTR_OPERATION_MATMUL_BDESC, b},
                      {CUDNN_ATTR_OPERATION_MATMUL_CDESC, c},
                      {CUDNN_ATTR_OPERATION_MATMUL_DESC, m},
                      {CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, m_override},
                      {CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, n_override},
                      {CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, k_override}},
                     what);
  }
  // y = x with other dims and strides (a transpose, as cuDNN's attention graphs express one), or another type.
  Status Reshape(Desc x, Desc y, std::string_view what) {
    Record(GraphRecord::Op::kReshape, {x}, y, what);
    return Operation(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR,
                     {{CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x}, {CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y}}, what);
  }
  // A virtual intermediate with explicit strides.
  Result<Desc> VirtualStrided(std::vector<int64_t> dims, std::vector<int64_t> strides, cudnnDataType_t type,
                              std::string_view what) {
    TensorSpec t{std::move(dims), std::move(strides), type, true};
    return Tensor(t, next_virtual_++, what);
  }
  // The graph of the operations added; on a GPU with the handle (cuDNN before 9.x's device-property descriptors
  // needs it; later ones accept it, deprecated), device-less without.
  Result<Desc> Graph(cudnnHandle_t handle) {
    MS_ASSIGN_OR_RETURN(Desc g, d_.Make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph"));
    if (handle != nullptr) {
      MS_RETURN_IF_ERROR(d_.Set(g, kGraphHandle, CUDNN_TYPE_HANDLE, 1, &handle, "operation graph (its handle)"));
    }
    MS_RETURN_IF_ERROR(d_.Set(g, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                              static_cast<int64_t>(ops_.size()), ops_.data(), "operation graph"));
    MS_RETURN_IF_ERROR(d_.Finalize(g, "the attention operation graph"));
    return g;
  }

 private:
  void Record(GraphRecord::Op op, std::initializer_list<Desc> in, Desc out, std::string_view what, int64_t axis = -1) {
    if (!record_) return;
    GraphRecord::Operation o{op, {}, uids_.at(out), axis, std::string(what)};
    for (Desc d : in) {
      if (d != nullptr) o.in.push_back(uids_.at(d));
    }
    record_->ops.push_back(std::move(o));
  }

  Descs& d_;
  GraphRecord* record_ = nullptr;
  std::map<Desc, int64_t> uids_;
  std::vector<Desc> ops_;
  int64_t next_virtual_ = 1000;
};

// The uids the variant pack binds.
enum Uid : int64_t {
  kQ = 1,
  kK = 2,
  kV = 3,
  kO = 4,
  kStats = 5,
  kDO = 6,
  kDQ = 7,
  kDK = 8,
  kDV = 9,
  kScale = 10,
  kNegInf = 11,
  kWindow = 12,
  kRowTerms = 13,  // the backward's sum_d dO O per query (fp32, in the caller's scratch)
  kOne = 14,       // 1.0 (the frontend's "one_tensor": the row terms are the reduction times it)
  kDQAccum = 15,   // dQ in fp32, accumulated over the key blocks (in the workspace, after the plan's)
  kSeqQ = 16,      // the padding-mask form's sequence lengths, (B, 1, 1, 1) int32: T each
  kSeqKV = 17,
};

// The row and column indices (int32) of scores x (B, H, T, T), generated in `math` (as the frontend does for the mask
// they serve).
Result<std::pair<Desc, Desc>> RowColumn(GraphBuilder& g, Desc x, cudnnDataType_t math, const SdpaShape& s,
                                        std::string_view what) {
  const std::vector<int64_t> bhtt = {s.B, s.H, s.T, s.T};
  const std::string r = fmt::format("row index ({})", what), c = fmt::format("column index ({})", what);
  MS_ASSIGN_OR_RETURN(Desc row, g.Virtual(bhtt, CUDNN_DATA_INT32, r));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, math, x, nullptr, nullptr, row, r, 2));
  MS_ASSIGN_OR_RETURN(Desc col, g.Virtual(bhtt, CUDNN_DATA_INT32, c));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, math, x, nullptr, nullptr, col, c, 3));
  return std::make_pair(row, col);
}

// The causal (and window) mask of scores x (B, H, T, T): kept where row >= col (and col + window > row), else -inf.
Result<Desc> Mask(GraphBuilder& g, Desc x, Desc neg_inf, const SdpaShape& s) {
  const auto F = CUDNN_DATA_FLOAT;
  const std::vector<int64_t> bhtt = {s.B, s.H, s.T, s.T};
  MS_ASSIGN_OR_RETURN(const auto rc, RowColumn(g, x, F, s, "causal"));
  const auto [row, col] = rc;
  MS_ASSIGN_OR_RETURN(Desc keep, g.Virtual(bhtt, CUDNN_DATA_BOOLEAN, "row >= col"));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, nullptr, keep, "row >= col"));
  MS_ASSIGN_OR_RETURN(Desc masked, g.Virtual(bhtt, F, "causal mask"));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_BINARY_SELECT, F, x, neg_inf, keep, masked, "causal mask"));
  if (s.window <= 0 || s.window >= s.T) return masked;
  // Sliding window: keep col + window > row (megascale's t - window < s).
  MS_ASSIGN_OR_RETURN(Desc w, g.Scalar(kWindow, F, "window"));
  MS_ASSIGN_OR_RETURN(const auto rc2, RowColumn(g, masked, F, s, "window"));
  const auto [row2, col2] = rc2;
  MS_ASSIGN_OR_RETURN(Desc colw, g.Virtual(bhtt, F, "col + window"));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_ADD, F, col2, w, nullptr, colw, "col + window", 3));
  MS_ASSIGN_OR_RETURN(Desc inwin, g.Virtual(bhtt, CUDNN_DATA_BOOLEAN, "col + window > row"));
  MS_RETURN_IF_ERROR(
      g.Pointwise(CUDNN_POINTWISE_CMP_GT, CUDNN_DATA_BOOLEAN, colw, row2, nullptr, inwin, "col + window > row"));
  MS_ASSIGN_OR_RETURN(Desc windowed, g.Virtual(bhtt, F, "window mask"));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_BINARY_SELECT, F, masked, neg_inf, inwin, windowed, "window mask"));
  return windowed;
}

// The forward graph of cudnn_sdpa.h's header comment; Q, K, V, O in megascale's layouts.
Result<Desc> BuildForward(Descs& d, const SdpaShape& s, cudnnHandle_t handle, GraphRecord* record) {
  GraphBuilder g(d, record);
  const int64_t B = s.B, T = s.T, H = s.H, D = s.D, C = H * D;
  const auto F = CUDNN_DATA_FLOAT, BF = CUDNN_DATA_BFLOAT16;
  // qkv (B, T, 3, H, D): head h's query at t * 3C + h * D, its key C further, its value 2C further.
  TensorSpec q{{B, H, T, D}, {T * 3 * C, D, 3 * C, 1}, BF, false};
  TensorSpec kt{{B, H, D, T}, {T * 3 * C, D, 1, 3 * C}, BF, false};  // Kᵀ: the same memory, T and D swapped
  TensorSpec v = q;
  TensorSpec o{{B, H, T, D}, {T * C, D, C, 1}, BF, false};  // out (B, T, H, D)
  TensorSpec stats{{B, H, T, 1}, {H * T, T, 1, 1}, F, false};
  MS_ASSIGN_OR_RETURN(Desc Q, g.Tensor(q, kQ, "Q"));
  MS_ASSIGN_OR_RETURN(Desc K, g.Tensor(kt, kK, "K (transposed)"));
  MS_ASSIGN_OR_RETURN(Desc V, g.Tensor(v, kV, "V"));
  MS_ASSIGN_OR_RETURN(Desc O, g.Tensor(o, kO, "O"));
  MS_ASSIGN_OR_RETURN(Desc Stats, g.Tensor(stats, kStats, "Stats"));
  MS_ASSIGN_OR_RETURN(Desc scale, g.Scalar(kScale, F, "attention scale"));
  MS_ASSIGN_OR_RETURN(Desc neg_inf, g.Scalar(kNegInf, F, "-inf"));
  const std::vector<int64_t> bhtt = {B, H, T, T}, bht1 = {B, H, T, 1};

  MS_ASSIGN_OR_RETURN(Desc S, g.Virtual(bhtt, F, "S = Q K^T"));
  MS_RETURN_IF_ERROR(g.Matmul(Q, K, S, "S = Q K^T"));
  MS_ASSIGN_OR_RETURN(Desc Ss, g.Virtual(bhtt, F, "S * scale"));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_MUL, F, S, scale, nullptr, Ss, "S * scale"));
  MS_ASSIGN_OR_RETURN(Desc Sm, Mask(g, Ss, neg_inf, s));
  // Softmax with its statistics.
  MS_ASSIGN_OR_RETURN(Desc m, g.Virtual(bht1, F, "row max"));
  MS_RETURN_IF_ERROR(g.Reduction(CUDNN_REDUCE_TENSOR_MAX, Sm, m, "row max"));
  MS_ASSIGN_OR_RETURN(Desc sub, g.Virtual(bhtt, F, "S - max"));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_SUB, F, Sm, m, nullptr, sub, "S - max"));
  MS_ASSIGN_OR_RETURN(Desc e, g.Virtual(bhtt, F, "exp(S - max)"));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_EXP, F, sub, nullptr, nullptr, e, "exp(S - max)"));
  MS_ASSIGN_OR_RETURN(Desc l, g.Virtual(bht1, F, "row sum"));
  MS_RETURN_IF_ERROR(g.Reduction(CUDNN_REDUCE_TENSOR_ADD, e, l, "row sum"));
  MS_ASSIGN_OR_RETURN(Desc logl, g.Virtual(bht1, F, "log(row sum)"));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_LOG, F, l, nullptr, nullptr, logl, "log(row sum)"));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_ADD, F, m, logl, nullptr, Stats, "Stats = max + log(sum)"));
  MS_ASSIGN_OR_RETURN(Desc P, g.Virtual(bhtt, BF, "P"));  // bf16: the P V product's operands share a type
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_DIV, F, e, l, nullptr, P, "P = exp / sum"));
  MS_RETURN_IF_ERROR(g.Matmul(P, V, O, "O = P V"));
  return g.Graph(handle);
}

// The padding mask of the frontend's workaround for cuDNN <= 9.15 at T % 128 != 0: scores x (B, H, T, T) kept where
// row < seq_q and col < seq_kv (both T: the mask changes no value; it steers cuDNN's engine), else -inf.
Result<Desc> PaddingMask(GraphBuilder& g, Desc x, Desc neg_inf, Desc seq_q, Desc seq_kv, const SdpaShape& s) {
  const auto BOOL = CUDNN_DATA_BOOLEAN;
  const std::vector<int64_t> bhtt = {s.B, s.H, s.T, s.T};
  MS_ASSIGN_OR_RETURN(const auto rc, RowColumn(g, x, CUDNN_DATA_INT32, s, "padding"));
  const auto [row, col] = rc;
  MS_ASSIGN_OR_RETURN(Desc row_in, g.Virtual(bhtt, BOOL, "row < seq_q"));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_CMP_LT, BOOL, row, seq_q, nullptr, row_in, "row < seq_q"));
  MS_ASSIGN_OR_RETURN(Desc col_in, g.Virtual(bhtt, BOOL, "col < seq_kv"));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_CMP_LT, BOOL, col, seq_kv, nullptr, col_in, "col < seq_kv"));
  MS_ASSIGN_OR_RETURN(Desc keep, g.Virtual(bhtt, BOOL, "padding mask"));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_LOGICAL_AND, BOOL, row_in, col_in, nullptr, keep, "padding mask"));
  MS_ASSIGN_OR_RETURN(Desc masked, g.Virtual(bhtt, CUDNN_DATA_FLOAT, "padding-masked scores"));
  MS_RETURN_IF_ERROR(
      g.Pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, x, neg_inf, keep, masked, "padding-masked scores"));
  return masked;
}

// The backward graph of cudnn_sdpa.h's header comment, as cudnn-frontend's CompositeSDPABackwardNode builds it for
// cuDNN >= 9 (not deterministic: dQ through the fp32 dQacc): from Q, K, V, O, dO (bf16, megascale's layouts) and
// Stats; dQ, dK, dV written in bf16 into megascale's dqkv (B, T, 3, H, D).
Result<Desc> BuildBackward(Descs& d, const SdpaShape& s, const GraphOptions& o, cudnnHandle_t handle,
                           GraphRecord* record) {
  GraphBuilder g(d, record);
  const int64_t B = s.B, T = s.T, H = s.H, D = s.D, C = H * D;
  const auto F = CUDNN_DATA_FLOAT, BF = CUDNN_DATA_BFLOAT16;
  const std::vector<int64_t> qkv_bhtd = {T * 3 * C, D, 3 * C, 1}, qkv_bhdt = {T * 3 * C, D, 1, 3 * C};
  const std::vector<int64_t> out_bhtd = {T * C, D, C, 1};
  MS_ASSIGN_OR_RETURN(Desc Q, (g.Tensor({{B, H, T, D}, qkv_bhtd, BF, false}, kQ, "Q")));
  MS_ASSIGN_OR_RETURN(Desc Kt, (g.Tensor({{B, H, D, T}, qkv_bhdt, BF, false}, kK, "K (transposed)")));
  MS_ASSIGN_OR_RETURN(Desc Vt, (g.Tensor({{B, H, D, T}, qkv_bhdt, BF, false}, kV, "V (transposed)")));
  MS_ASSIGN_OR_RETURN(Desc O, (g.Tensor({{B, H, T, D}, out_bhtd, BF, false}, kO, "O")));
  MS_ASSIGN_OR_RETURN(Desc dO, (g.Tensor({{B, H, T, D}, out_bhtd, BF, false}, kDO, "dO")));
  MS_ASSIGN_OR_RETURN(Desc Stats, (g.Tensor({{B, H, T, 1}, {H * T, T, 1, 1}, F, false}, kStats, "Stats")));
  MS_ASSIGN_OR_RETURN(Desc dQ, (g.Tensor({{B, H, T, D}, qkv_bhtd, BF, false}, kDQ, "dQ")));
  MS_ASSIGN_OR_RETURN(Desc dK, (g.Tensor({{B, H, T, D}, qkv_bhtd, BF, false}, kDK, "dK")));
  MS_ASSIGN_OR_RETURN(Desc dV, (g.Tensor({{B, H, T, D}, qkv_bhtd, BF, false}, kDV, "dV")));
  MS_ASSIGN_OR_RETURN(Desc rows, (g.Tensor({{B, H, T, 1}, {H * T, T, 1, 1}, F, false}, kRowTerms, "row terms")));
  Desc dQacc = nullptr;
  if (!o.deterministic) {
    MS_ASSIGN_OR_RETURN(dQacc, (g.Tensor({{B, H, T, D}, {H * T * D, T * D, D, 1}, F, false}, kDQAccum, "dQacc")));
  }
  MS_ASSIGN_OR_RETURN(Desc scale, g.Scalar(kScale, F, "attention scale"));
  MS_ASSIGN_OR_RETURN(Desc neg_inf, g.Scalar(kNegInf, F, "-inf"));
  MS_ASSIGN_OR_RETURN(Desc one, g.Scalar(kOne, F, "one"));
  Desc seq_q = nullptr, seq_kv = nullptr;  // the padding-mask form's sequence lengths
  if (o.padding_mask) {
    MS_ASSIGN_OR_RETURN(seq_q, (g.Tensor({{B, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_INT32, false}, kSeqQ, "seq_q")));
    MS_ASSIGN_OR_RETURN(seq_kv, (g.Tensor({{B, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_INT32, false}, kSeqKV, "seq_kv")));
  }
  const std::vector<int64_t> bhtt = {B, H, T, T}, transposed = {H * T * T, T * T, 1, T};

  // D = 1 · sum_d dO O: the product (B, H, T, D) with the frontend's strides (O's row stride H D, head stride T D),
  // the sum virtual, its product with one the row terms.
  MS_ASSIGN_OR_RETURN(Desc dOO, (g.VirtualStrided({B, H, T, D}, {H * T * D, T * D, H * D, 1}, F, "dO O")));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_MUL, F, dO, O, nullptr, dOO, "dO O"));
  MS_ASSIGN_OR_RETURN(Desc sum, g.Virtual({B, H, T, 1}, F, "sum_d dO O"));
  MS_RETURN_IF_ERROR(g.Reduction(CUDNN_REDUCE_TENSOR_ADD, dOO, sum, "sum_d dO O"));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_MUL, F, sum, one, nullptr, rows, "row terms"));
  // P = exp(mask(scale Q Kᵀ) - Stats)
  MS_ASSIGN_OR_RETURN(Desc S, g.Virtual(bhtt, F, "S = Q K^T"));
  MS_RETURN_IF_ERROR(g.Matmul(Q, Kt, S, "S = Q K^T", seq_q, seq_kv));
  MS_ASSIGN_OR_RETURN(Desc Ss, g.Virtual(bhtt, F, "S * scale"));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_MUL, F, S, scale, nullptr, Ss, "S * scale"));
  Desc Sp = Ss;
  if (o.padding_mask) {
    MS_ASSIGN_OR_RETURN(Sp, PaddingMask(g, Ss, neg_inf, seq_q, seq_kv, s));
  }
  MS_ASSIGN_OR_RETURN(Desc Sm, Mask(g, Sp, neg_inf, s));
  MS_ASSIGN_OR_RETURN(Desc Sl, g.Virtual(bhtt, F, "S - Stats"));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_SUB, F, Sm, Stats, nullptr, Sl, "S - Stats"));
  Desc Sl2 = Sl;  // cuDNN 9.0 - 9.9: the padding mask again after the statistics, as the frontend does there
  if (o.second_padding_mask) {
    MS_ASSIGN_OR_RETURN(Sl2, PaddingMask(g, Sl, neg_inf, seq_q, seq_kv, s));
  }
  MS_ASSIGN_OR_RETURN(Desc P, g.Virtual(bhtt, F, "P"));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_EXP, F, Sl2, nullptr, nullptr, P, "P = exp"));
  // dV = Pᵀ dO
  MS_ASSIGN_OR_RETURN(Desc Pt, g.VirtualStrided(bhtt, transposed, BF, "P^T"));
  MS_RETURN_IF_ERROR(g.Reshape(P, Pt, "P^T"));
  MS_RETURN_IF_ERROR(g.Matmul(Pt, dO, dV, "dV = P^T dO", seq_kv, nullptr, seq_q));
  // dS = P (dO Vᵀ - D) scale
  MS_ASSIGN_OR_RETURN(Desc dP, g.Virtual(bhtt, F, "dP = dO V^T"));
  MS_RETURN_IF_ERROR(g.Matmul(dO, Vt, dP, "dP = dO V^T", seq_q, seq_kv));
  MS_ASSIGN_OR_RETURN(Desc dPd, g.Virtual(bhtt, F, "dP - D"));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_SUB, F, dP, rows, nullptr, dPd, "dP - D"));
  MS_ASSIGN_OR_RETURN(Desc dSu, g.Virtual(bhtt, F, "P (dP - D)"));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_MUL, F, dPd, P, nullptr, dSu, "P (dP - D)"));
  MS_ASSIGN_OR_RETURN(Desc dS, g.Virtual(bhtt, F, "dS"));
  MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_MUL, F, dSu, scale, nullptr, dS, "dS = P (dP - D) scale"));
  // dK = dSᵀ Q
  MS_ASSIGN_OR_RETURN(Desc dSt, g.VirtualStrided(bhtt, transposed, BF, "dS^T"));
  MS_RETURN_IF_ERROR(g.Reshape(dS, dSt, "dS^T"));
  MS_RETURN_IF_ERROR(g.Matmul(dSt, Q, dK, "dK = dS^T Q", seq_kv, nullptr, seq_q));
  // dQ = dS K (K: Kᵀ transposed back), accumulated in fp32, then rounded
  MS_ASSIGN_OR_RETURN(Desc K, (g.VirtualStrided({B, H, T, D}, qkv_bhtd, BF, "K")));
  MS_RETURN_IF_ERROR(g.Reshape(Kt, K, "K"));
  if (o.deterministic) {  // the frontend's deterministic form: dQ written straight
    MS_RETURN_IF_ERROR(g.Matmul(dS, K, dQ, "dQ = dS K", seq_q, nullptr, seq_kv));
  } else {
    MS_RETURN_IF_ERROR(g.Matmul(dS, K, dQacc, "dQacc = dS K", seq_q, nullptr, seq_kv));
    MS_RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_IDENTITY, F, dQacc, nullptr, nullptr, dQ, "dQ = dQacc"));
  }
  return g.Graph(handle);
}

// Heuristics' engine configurations for a graph, on a handle's device or a deviceprop descriptor's.
Result<std::vector<Desc>> EngineConfigs(Descs& d, Desc graph, Desc deviceprop) {
  const Api& api = d.api();
  MS_ASSIGN_OR_RETURN(Desc heur, d.Make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "heuristics"));
  const auto D = CUDNN_TYPE_BACKEND_DESCRIPTOR;
  MS_RETURN_IF_ERROR(d.Set(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, D, 1, &graph, "heuristics"));
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  MS_RETURN_IF_ERROR(d.Set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics"));
  if (deviceprop) MS_RETURN_IF_ERROR(d.Set(heur, CUDNN_ATTR_ENGINEHEUR_DEVICEPROP, D, 1, &deviceprop, "heuristics"));
  MS_RETURN_IF_ERROR(d.Finalize(heur, "the heuristics for the attention graph"));
  int64_t count = 0;
  MS_RETURN_IF_ERROR(
      Check(api, api.GetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, D, 0, &count, nullptr), "heuristics count"));
  std::vector<Desc> configs;
  for (int64_t i = 0; i < count; ++i) {
    MS_ASSIGN_OR_RETURN(Desc c, d.Make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config"));
    configs.push_back(c);
  }
  int64_t got = 0;
  if (count > 0) {
    MS_RETURN_IF_ERROR(Check(api, api.GetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, D, count, &got, configs.data()),
                             "heuristics results"));
  }
  configs.resize(static_cast<size_t>(std::max<int64_t>(got, 0)));
  return configs;
}

}  // namespace

std::string Unsupported(const SdpaShape& s) {
  if (s.B < 1 || s.T < 1 || s.H < 1) return fmt::format("an empty problem (B {}, T {}, H {})", s.B, s.T, s.H);
  if (s.D < 8 || s.D > 128 || s.D % 8 != 0) {
    return fmt::format("head dim {}: cuDNN's fused attention takes a multiple of 8 up to 128", s.D);
  }
  if (s.window < 0) return fmt::format("window {} < 0", s.window);
  if (s.T == 1) return "T 1: cuDNN's fused attention does not take one query and one key (cudnn-frontend refuses it)";
  return "";
}

namespace {
std::atomic<int> override_deterministic{-1}, override_padding_mask{-1};
}  // namespace

void SetFormOverride(int deterministic, int padding_mask) {
  override_deterministic.store(deterministic < 0 ? -1 : deterministic != 0);
  override_padding_mask.store(padding_mask < 0 ? -1 : padding_mask != 0);
}

GraphOptions GraphFor(const SdpaShape& s, int64_t version) {
  GraphOptions o;
  o.padding_mask = version <= 91500 && s.T % 128 != 0;
  o.lowest_for_inf = version < 91000;
  o.zero_dq_accum = version < 90600;
  o.second_padding_mask = o.padding_mask && version >= 90000 && version < 91000;
  if (const int d = override_deterministic.load(); d >= 0) o.deterministic = d != 0;
  if (const int p = override_padding_mask.load(); p >= 0) o.padding_mask = p != 0;
  o.second_padding_mask = o.second_padding_mask && o.padding_mask;
  return o;
}

Result<int64_t> Version() {
  MS_ASSIGN_OR_RETURN(const Api* api, LoadApi());
  return static_cast<int64_t>(api->GetVersion());
}

std::string H100DeviceProperties() {
  return R"({"maxGridSize":[2147483647,65535,65535],"maxBlockSize":[1024,1024,64],"regsPerBlock":65536,)"
         R"("multiProcessorCount":132,"warpSize":32,"maxSharedMemoryPerBlock":49152,)"
         R"("maxSharedMemoryPerBlockOptin":232448,"reservedSharedMemoryPerBlock":1024,"maxRegistersPerSM":65536,)"
         R"("maxCtasPerSM":32,"maxThreadsPerBlock":1024,"maxThreadsPerSM":2048,"pciDeviceId":0,"isTccDriver":0,)"
         R"("supportCoopLaunch":1,"totalGlobalMem":85520809984,"smClockRateKHz":1980000,"memClockRateKHz":2619000,)"
         R"("l2CacheSize":52428800,"cudaDeviceId":0,"deviceVer":900,"driverVer":13000,)"
         R"("deviceName":"NVIDIA H100 80GB HBM3"})";
}

namespace {

Result<Desc> Build(Descs& d, const SdpaShape& s, Pass pass, const GraphOptions& o, cudnnHandle_t handle = nullptr,
                   GraphRecord* record = nullptr) {
  return pass == Pass::kForward ? BuildForward(d, s, handle, record) : BuildBackward(d, s, o, handle, record);
}

Result<Desc> JsonDevice(Descs& d, const std::string& json) {
  MS_ASSIGN_OR_RETURN(Desc prop, d.Make(CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR, "device properties"));
  MS_RETURN_IF_ERROR(d.Set(prop, CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION, CUDNN_TYPE_CHAR,
                           static_cast<int64_t>(json.size()), json.data(), "device properties"));
  MS_RETURN_IF_ERROR(d.Finalize(prop, "the device properties"));
  return prop;
}

}  // namespace

namespace {

// The graph of `pass` for `s` and the heuristics' configurations for it on the JSON-described device.
struct Deviceless {
  std::unique_ptr<Descs> d;
  Desc prop = nullptr;
  std::vector<Desc> configs;
};
Result<Deviceless> HeuristicsFor(const SdpaShape& s, Pass pass, const std::string& deviceprop_json,
                                 const GraphOptions* options) {
  if (std::string why = Unsupported(s); !why.empty()) return InvalidArgument("cuDNN attention: {}", why);
  MS_ASSIGN_OR_RETURN(const Api* api, LoadApi());
  const GraphOptions o = options ? *options : GraphFor(s, static_cast<int64_t>(api->GetVersion()));
  Deviceless out;
  out.d = std::make_unique<Descs>(*api);
  MS_ASSIGN_OR_RETURN(out.prop, JsonDevice(*out.d, deviceprop_json));
  MS_ASSIGN_OR_RETURN(Desc graph, Build(*out.d, s, pass, o));
  MS_ASSIGN_OR_RETURN(out.configs, EngineConfigs(*out.d, graph, out.prop));
  return out;
}

}  // namespace

Result<GraphRecord> RecordGraph(const SdpaShape& s, Pass pass, const GraphOptions& options) {
  if (std::string why = Unsupported(s); !why.empty()) return InvalidArgument("cuDNN attention: {}", why);
  MS_ASSIGN_OR_RETURN(const Api* api, LoadApi());
  Descs d(*api);
  GraphRecord record;
  MS_RETURN_IF_ERROR(Build(d, s, pass, options, nullptr, &record).status());
  return record;
}

Result<int> EngineConfigs(const SdpaShape& s, Pass pass, const std::string& deviceprop_json,
                          const GraphOptions* options) {
  MS_ASSIGN_OR_RETURN(Deviceless h, HeuristicsFor(s, pass, deviceprop_json, options));
  return static_cast<int>(h.configs.size());
}

Result<std::vector<std::string>> PlansDeviceless(const SdpaShape& s, Pass pass, const std::string& deviceprop_json,
                                                 const GraphOptions* options) {
  MS_ASSIGN_OR_RETURN(Deviceless h, HeuristicsFor(s, pass, deviceprop_json, options));
  std::vector<std::string> out;
  for (Desc config : h.configs) {
    Descs& d = *h.d;
    MS_ASSIGN_OR_RETURN(Desc plan, d.Make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan"));
    const auto D = CUDNN_TYPE_BACKEND_DESCRIPTOR;
    MS_RETURN_IF_ERROR(d.Set(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, D, 1, &config, "execution plan"));
    MS_RETURN_IF_ERROR(d.Set(plan, CUDNN_ATTR_EXECUTION_PLAN_DEVICEPROP, D, 1, &h.prop, "execution plan"));
    Status st = d.Finalize(plan, "plan");
    out.push_back(st.ok() ? "ok" : st.message());
  }
  return out;
}

// ---- on a GPU ----

namespace {
const char* PassName(Pass pass) {
  return pass == Pass::kForward ? "forward" : "backward";
}
}  // namespace

struct Sdpa::Impl {
  const Api* api = nullptr;
  cudnnHandle_t handle = nullptr;
  Memory memory;
  struct Plan {
    std::unique_ptr<Descs> descs;  // keeps the graph, the config and the plan alive
    Desc plan = nullptr;
    int64_t workspace_bytes = 0;  // the plan's own
    int64_t engine = -1;
    GraphOptions options;
    int64_t accum_at = 0, accum_bytes = 0;  // the backward's dQacc: its offset in the workspace, its size
    int32_t* seq_lens = nullptr;            // the padding-mask form: B of T for seq_q, then B for seq_kv (kept)
  };
  std::map<std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t>, Plan> plans;

  ~Impl() {
    plans.clear();
    if (handle) api->Destroy(handle);
  }
  static auto Key(const SdpaShape& s, Pass pass) {
    return std::make_tuple(static_cast<int>(pass), s.B, s.T, s.H, s.D, s.window);
  }

  Result<Plan*> PlanFor(const SdpaShape& s, Pass pass) {
    auto it = plans.find(Key(s, pass));
    if (it != plans.end()) return &it->second;
    const int64_t version = static_cast<int64_t>(api->GetVersion());
    if (pass == Pass::kBackward && (version == 91000 || version == 91001)) {
      return FailedPrecondition(
          "cuDNN {} has known bugs in its fused attention backward (cudnn-frontend refuses 9.10.0 and 9.10.1): use "
          "9.10.2 or newer",
          version);
    }
    Plan p;
    p.descs = std::make_unique<Descs>(*api);
    p.options = GraphFor(s, version);
    Descs& d = *p.descs;
    MS_ASSIGN_OR_RETURN(Desc graph, Build(d, s, pass, p.options, handle));
    MS_ASSIGN_OR_RETURN(std::vector<Desc> configs, EngineConfigs(d, graph, nullptr));
    if (configs.empty()) {
      return FailedPrecondition(
          "cuDNN's heuristics found no engine for the attention {} (B {}, T {}, H {}, D {}, window {}); "
          "CUDNN_LOGWARN_DBG=1 CUDNN_LOGDEST_DBG=stderr shows why",
          PassName(pass), s.B, s.T, s.H, s.D, s.window);
    }
    // The first configuration whose plan builds on this GPU (heuristics order: the predicted fastest first).
    Status last;
    for (size_t i = 0; i < configs.size(); ++i) {
      Desc config = configs[i];
      MS_ASSIGN_OR_RETURN(Desc plan, d.Make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan"));
      const auto D = CUDNN_TYPE_BACKEND_DESCRIPTOR;
      MS_RETURN_IF_ERROR(d.Set(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, D, 1, &config, "execution plan"));
      MS_RETURN_IF_ERROR(d.Set(plan, kPlanHandle, CUDNN_TYPE_HANDLE, 1, &handle, "execution plan (its handle)"));
      last = d.Finalize(plan, fmt::format("the attention {}'s execution plan", PassName(pass)));
      if (!last.ok()) continue;
      int64_t n = 0;
      MS_RETURN_IF_ERROR(Check(*api,
                               api->GetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1,
                                                 &n, &p.workspace_bytes),
                               "workspace size"));
      p.plan = plan;
      p.engine = static_cast<int64_t>(i);
      break;
    }
    if (p.plan == nullptr) {
      return last.WithContext(fmt::format("no engine configuration of the attention {} builds", PassName(pass)));
    }
    if (pass == Pass::kBackward && !p.options.deterministic) {
      p.accum_at = (p.workspace_bytes + 255) / 256 * 256;
      p.accum_bytes = static_cast<int64_t>(sizeof(float)) * s.B * s.H * s.T * s.D;
    }
    if (pass == Pass::kBackward && p.options.padding_mask) {
      const std::vector<int32_t> lens(static_cast<size_t>(2 * s.B), static_cast<int32_t>(s.T));
      MS_ASSIGN_OR_RETURN(void* kept, memory.keep(lens.data(), sizeof(int32_t) * lens.size()));
      p.seq_lens = static_cast<int32_t*>(kept);
    }
    return &plans.emplace(Key(s, pass), std::move(p)).first->second;
  }
};

Sdpa::Sdpa(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Sdpa::~Sdpa() = default;

Result<std::unique_ptr<Sdpa>> Sdpa::Create(void* cuda_stream, Memory memory) {
  MS_ASSIGN_OR_RETURN(const Api* api, LoadApi());
  if (!memory.workspace || !memory.zero || !memory.keep) return InvalidArgument("cuDNN attention: Memory incomplete");
  auto impl = std::make_unique<Impl>();
  impl->api = api;
  impl->memory = std::move(memory);
  MS_RETURN_IF_ERROR(Check(*api, api->Create(&impl->handle), "creating a handle (cudnnCreate)"));
  MS_RETURN_IF_ERROR(
      Check(*api, api->SetStream(impl->handle, static_cast<cudaStream_t>(cuda_stream)), "cudnnSetStream"));
  return std::unique_ptr<Sdpa>(new Sdpa(std::move(impl)));
}

namespace {

// Runs `plan` with the tensors uids[i] at ptrs[i] and the plan's workspace.
Status Execute(const Api& api, cudnnHandle_t handle, Desc plan, std::vector<int64_t> uids, std::vector<void*> ptrs,
               void* workspace, const char* what) {
  Descs d(api);
  MS_ASSIGN_OR_RETURN(Desc pack, d.Make(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "variant pack"));
  const auto n = static_cast<int64_t>(uids.size());
  MS_RETURN_IF_ERROR(d.Set(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids.data(), "variant pack"));
  MS_RETURN_IF_ERROR(
      d.Set(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, ptrs.data(), "variant pack"));
  MS_RETURN_IF_ERROR(
      d.Set(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace, "variant pack"));
  MS_RETURN_IF_ERROR(d.Finalize(pack, "the variant pack"));
  return Check(api, api.Execute(handle, plan, pack), what);
}

}  // namespace

namespace {
// The scalars a plan's variant pack points at (host memory, read when the plan is executed).
struct Scalars {
  float scale, neg_inf, window, one = 1.0f;
  Scalars(const SdpaShape& s, const GraphOptions& o)
      : scale(1.0f / std::sqrt(static_cast<float>(s.D))),
        neg_inf(o.lowest_for_inf ? std::numeric_limits<float>::lowest() : -std::numeric_limits<float>::infinity()),
        window(static_cast<float>(s.window)) {}
  // Their uids and pointers appended (the window only where the graph masks by it, one only in the backward).
  void Bind(Pass pass, const SdpaShape& s, std::vector<int64_t>& uids, std::vector<void*>& ptrs) {
    uids.insert(uids.end(), {kScale, kNegInf});
    ptrs.insert(ptrs.end(), {&scale, &neg_inf});
    if (s.window > 0 && s.window < s.T) {
      uids.push_back(kWindow);
      ptrs.push_back(&window);
    }
    if (pass == Pass::kBackward) {
      uids.push_back(kOne);
      ptrs.push_back(&one);
    }
  }
};
}  // namespace

Status Sdpa::Run(Pass pass, const SdpaShape& s, std::vector<int64_t> uids, std::vector<void*> ptrs) {
  if (std::string why = Unsupported(s); !why.empty()) return InvalidArgument("cuDNN attention: {}", why);
  MS_ASSIGN_OR_RETURN(Impl::Plan * p, impl_->PlanFor(s, pass));
  void* ws = nullptr;
  const int64_t ws_bytes = p->accum_bytes > 0 ? p->accum_at + p->accum_bytes : p->workspace_bytes;
  if (ws_bytes > 0) {
    MS_ASSIGN_OR_RETURN(ws, impl_->memory.workspace(static_cast<size_t>(ws_bytes)));
  }
  if (p->accum_bytes > 0) {
    void* accum = static_cast<char*>(ws) + p->accum_at;
    if (p->options.zero_dq_accum) MS_RETURN_IF_ERROR(impl_->memory.zero(accum, static_cast<size_t>(p->accum_bytes)));
    uids.push_back(kDQAccum);
    ptrs.push_back(accum);
  }
  if (p->seq_lens != nullptr) {
    uids.insert(uids.end(), {kSeqQ, kSeqKV});
    ptrs.insert(ptrs.end(), {p->seq_lens, p->seq_lens + s.B});
  }
  Scalars scalars(s, p->options);
  scalars.Bind(pass, s, uids, ptrs);
  return Execute(*impl_->api, impl_->handle, p->plan, std::move(uids), std::move(ptrs), ws,
                 pass == Pass::kForward ? "executing the attention forward" : "executing the attention backward");
}

Status Sdpa::Forward(const void* qkv16, void* out16, float* lse, const SdpaShape& s) {
  auto* q = const_cast<uint16_t*>(static_cast<const uint16_t*>(qkv16));
  const int64_t C = s.H * s.D;
  return Run(Pass::kForward, s, {kQ, kK, kV, kO, kStats}, {q, q + C, q + 2 * C, out16, lse});
}

Status Sdpa::Backward(const void* qkv16, const void* out16, const void* dout16, const float* lse, void* dqkv16,
                      float* row_terms, const SdpaShape& s) {
  auto* q = const_cast<uint16_t*>(static_cast<const uint16_t*>(qkv16));
  auto* dq = static_cast<uint16_t*>(dqkv16);
  const int64_t C = s.H * s.D;
  return Run(Pass::kBackward, s, {kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kRowTerms},
             {q, q + C, q + 2 * C, const_cast<void*>(out16), const_cast<void*>(dout16), const_cast<float*>(lse), dq,
              dq + C, dq + 2 * C, row_terms});
}

std::string Sdpa::Describe(const SdpaShape& s, Pass pass) const {
  auto it = impl_->plans.find(Impl::Key(s, pass));
  if (it == impl_->plans.end()) return "no plan yet";
  const Impl::Plan& p = it->second;
  const int64_t v = static_cast<int64_t>(impl_->api->GetVersion());
  return fmt::format("cuDNN {}.{}.{}, engine configuration {} of the heuristics' list, {} bytes of workspace{}{}{}",
                     v / 10000, v / 100 % 100, v % 100, p.engine, p.workspace_bytes,
                     p.accum_bytes > 0 ? fmt::format(" and {} of dQacc", p.accum_bytes) : std::string(),
                     p.options.padding_mask ? ", the padding-mask form" : "",
                     p.options.deterministic ? ", the deterministic form" : "");
}

}  // namespace ms::cuda::cudnn
