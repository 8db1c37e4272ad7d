// cuDNN's fused attention graph (lib/cuda/cudnn_sdpa.cpp), device-less: the graphs megascale builds must be
// ones that cuDNN's heuristics find engines for on an H100 (sm_90), at the GPU configs' shapes, odd shapes and with a
// sliding window — checked on a machine without a GPU through cuDNN's device properties (JSON) and the toolkit's stub
// libcuda (ctest sets LD_LIBRARY_PATH). A Volta (sm_70), where cuDNN has no fused flash attention, must get none:
// the check discriminates. What the graphs compute is checked by interpreting them on the CPU against
// ms::ops::ref's attention (the last case); what cuDNN's engines make of them only a GPU says (cuda_backend_gpu).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda/cudnn_sdpa.h"
#include "ops/ops.h"

namespace cudnn = ms::cuda::cudnn;

namespace {

std::string Volta() {
  std::string j = cudnn::H100DeviceProperties();
  auto swap = [&](const std::string& from, const std::string& to) {
    const auto at = j.find(from);
    REQUIRE(at != std::string::npos);
    j.replace(at, from.size(), to);
  };
  swap(R"("deviceVer":900)", R"("deviceVer":700)");
  swap(R"("multiProcessorCount":132)", R"("multiProcessorCount":80)");
  swap(R"("maxSharedMemoryPerBlockOptin":232448)", R"("maxSharedMemoryPerBlockOptin":98304)");
  swap(R"("NVIDIA H100 80GB HBM3")", R"("Tesla V100-SXM2-32GB")");
  return j;
}

}  // namespace

TEST_CASE("cuDNN loads (libcudnn.so.9, version 9)") {
  auto v = cudnn::Version();
  const std::string why = v.ok() ? std::string() : v.status().message();
  INFO(why);
  REQUIRE(v.ok());
  CHECK(*v >= 90000);
  MESSAGE("cuDNN " << *v);
}

TEST_CASE("the attention forward and backward graphs have engines on an H100") {
  const cudnn::SdpaShape shapes[] = {
      {16, 1024, 12, 64, 0},  // configs/gpt2-small-gpu.yaml
      {4, 2048, 16, 128, 0},  // configs/gpt-1.3b-gpu.yaml
      {2, 70, 3, 64, 0},      // T not a multiple of 64
      {1, 77, 2, 32, 0},      // another head dim
      {2, 300, 4, 64, 128},   // a sliding window
      {3, 33, 5, 128, 7},     // odd everything, window below one tile
  };
  for (const auto& s : shapes) {
    CAPTURE(s.B);
    CAPTURE(s.T);
    CAPTURE(s.H);
    CAPTURE(s.D);
    CAPTURE(s.window);
    for (cudnn::Pass pass : {cudnn::Pass::kForward, cudnn::Pass::kBackward}) {
      CAPTURE(pass == cudnn::Pass::kForward ? "forward" : "backward");
      auto n = cudnn::EngineConfigs(s, pass, cudnn::H100DeviceProperties());
      const std::string why = n.ok() ? std::string() : n.status().message();
      INFO(why);
      REQUIRE(n.ok());
      // None: cuDNN refused the graph (or libcuda.so.1, the stub, did not load): rerun with
      // CUDNN_LOGWARN_DBG=1 CUDNN_LOGDEST_DBG=stderr for its reasons.
      CHECK(*n >= 1);
    }
  }
}

// The plans' kernels (cuDNN compiles them at run time, NVRTC): each plan of GPT-2 small's shape gets as far as the
// driver's module load, which the stub cannot do — so cuDNN built and compiled every one.
namespace {
// Every engine configuration's plan of the graph compiles for an H100 (the stub libcuda stops it at the module load).
void CheckPlansCompile(const cudnn::SdpaShape& s, cudnn::Pass pass, const cudnn::GraphOptions* o = nullptr) {
  auto plans = cudnn::PlansDeviceless(s, pass, cudnn::H100DeviceProperties(), o);
  const std::string why = plans.ok() ? std::string() : plans.status().message();
  INFO(why);
  REQUIRE(plans.ok());
  CHECK(!plans->empty());
  for (const std::string& p : *plans) {
    CAPTURE(p);
    CHECK((p == "ok" || p.find("CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER") != std::string::npos));
  }
}
}  // namespace

TEST_CASE("every engine's plan of the attention forward and backward compiles for an H100") {
  for (cudnn::Pass pass : {cudnn::Pass::kForward, cudnn::Pass::kBackward}) {
    CAPTURE(pass == cudnn::Pass::kForward ? "forward" : "backward");
    CheckPlansCompile({16, 1024, 12, 64, 0}, pass);
  }
}

// What cudnn-frontend does per cuDNN release, which the backward follows (cudnn_sdpa.h, GraphOptions).
TEST_CASE("the graphs' release-dependent choices follow cudnn-frontend's") {
  const auto o914 = cudnn::GraphFor({2, 70, 3, 64, 0}, 91400);
  CHECK(o914.padding_mask);  // cuDNN <= 9.15 and T % 128 != 0
  CHECK_FALSE(o914.lowest_for_inf);
  CHECK_FALSE(o914.zero_dq_accum);
  CHECK_FALSE(cudnn::GraphFor({16, 1024, 12, 64, 0}, 91400).padding_mask);  // T a multiple of 128
  CHECK(cudnn::GraphFor({2, 300, 2, 64, 128}, 91500).padding_mask);
  CHECK_FALSE(cudnn::GraphFor({2, 70, 3, 64, 0}, 91600).padding_mask);
  CHECK_FALSE(cudnn::GraphFor({2, 70, 3, 64, 0}, 91900).padding_mask);
  const auto o905 = cudnn::GraphFor({2, 128, 3, 64, 0}, 90500);
  CHECK(o905.lowest_for_inf);  // before 9.10
  CHECK(o905.zero_dq_accum);   // before 9.6
  CHECK_FALSE(o905.padding_mask);
  CHECK_FALSE(o905.second_padding_mask);
  CHECK(cudnn::GraphFor({2, 70, 3, 64, 0}, 90500).second_padding_mask);  // 9.0 - 9.9 with the padding mask
  CHECK_FALSE(o914.second_padding_mask);
}

// The padding-mask form of the backward (what a GPU machine's cuDNN 9.14 gets at T % 128 != 0: the sequence lengths
// as device tensors, the mask before the causal one, the matmuls' M / N / K overrides) is built and taken by the
// fused engines of this machine's cuDNN too, and its plans compile.
TEST_CASE("the backward's padding-mask form has engines on an H100, and its plans compile") {
  cudnn::GraphOptions o;
  o.padding_mask = true;
  const cudnn::SdpaShape shapes[] = {{2, 70, 3, 64, 0}, {1, 129, 2, 128, 0}, {2, 300, 4, 64, 128}, {1, 77, 4, 32, 0}};
  {  // cuDNN 9.0 - 9.9's form: the padding mask again after the statistics (taken by this release's engines too)
    cudnn::GraphOptions o2 = o;
    o2.second_padding_mask = true;
    auto n = cudnn::EngineConfigs(shapes[0], cudnn::Pass::kBackward, cudnn::H100DeviceProperties(), &o2);
    REQUIRE(n.ok());
    CHECK(*n >= 1);
  }
  for (const auto& s : shapes) {
    CAPTURE(s.T);
    CAPTURE(s.D);
    CAPTURE(s.window);
    auto n = cudnn::EngineConfigs(s, cudnn::Pass::kBackward, cudnn::H100DeviceProperties(), &o);
    const std::string why = n.ok() ? std::string() : n.status().message();
    INFO(why);
    REQUIRE(n.ok());
    CHECK(*n >= 1);
  }
  CheckPlansCompile({2, 70, 3, 64, 0}, cudnn::Pass::kBackward, &o);
}

// The deterministic form (dQ written straight, the frontend's for deterministic backwards; megascale's graph up to
// 2829a9d) is kept for diagnosis on a GPU (SetCudnnBackwardForm): the engines take it too, with and without the
// padding mask; SetFormOverride sets GraphFor's choices and -1 gives them back.
TEST_CASE("the backward's deterministic form has engines on an H100; the form override") {
  for (const bool padding : {false, true}) {
    cudnn::GraphOptions o;
    o.deterministic = true;
    o.padding_mask = padding;
    CAPTURE(padding);
    auto n = cudnn::EngineConfigs({2, 70, 3, 64, 0}, cudnn::Pass::kBackward, cudnn::H100DeviceProperties(), &o);
    const std::string why = n.ok() ? std::string() : n.status().message();
    INFO(why);
    REQUIRE(n.ok());
    CHECK(*n >= 1);
  }
  cudnn::SetFormOverride(1, 0);
  auto o = cudnn::GraphFor({2, 70, 3, 64, 0}, 91400);
  CHECK(o.deterministic);
  CHECK_FALSE(o.padding_mask);
  cudnn::SetFormOverride(-1, 1);
  o = cudnn::GraphFor({2, 256, 3, 64, 0}, 91900);
  CHECK_FALSE(o.deterministic);
  CHECK(o.padding_mask);
  cudnn::SetFormOverride(-1, -1);
  o = cudnn::GraphFor({2, 70, 3, 64, 0}, 91400);
  CHECK_FALSE(o.deterministic);
  CHECK(o.padding_mask);
}

TEST_CASE("no fused-attention engine on a Volta: the check discriminates") {
  auto b = cudnn::EngineConfigs({2, 128, 4, 64, 0}, cudnn::Pass::kBackward, Volta());
  REQUIRE(b.ok());
  CHECK(*b == 0);
  auto n = cudnn::EngineConfigs({2, 128, 4, 64, 0}, cudnn::Pass::kForward, Volta());
  const std::string why = n.ok() ? std::string() : n.status().message();
  INFO(why);
  REQUIRE(n.ok());
  CHECK(*n == 0);
}

TEST_CASE("shapes cuDNN's fused attention does not take are named, not built") {
  CHECK(cudnn::Unsupported({2, 64, 4, 64, 0}).empty());
  CHECK(cudnn::Unsupported({2, 64, 4, 60, 0}).find("head dim 60") != std::string::npos);
  CHECK(cudnn::Unsupported({2, 64, 4, 256, 0}).find("head dim 256") != std::string::npos);
  CHECK(cudnn::Unsupported({0, 64, 4, 64, 0}).find("empty") != std::string::npos);
  CHECK(cudnn::Unsupported({2, 1, 4, 64, 0}).find("T 1") != std::string::npos);
  CHECK(cudnn::Unsupported({2, 2, 4, 64, 0}).empty());
  auto r = cudnn::EngineConfigs({2, 64, 4, 60, 0}, cudnn::Pass::kBackward, cudnn::H100DeviceProperties());
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message().find("head dim 60") != std::string::npos);
}

// ---- what the graphs compute: a reference interpreter of the recorded graph (cudnn::RecordGraph) ----
//
// Each tensor is a view (offset, dims, strides) of a memory: the user tensors of qkv (Q, Kᵀ, Vᵀ at offsets 0, C, 2C)
// and of dqkv (dQ, dK, dV) share theirs, a reshape's output shares its input's and reads it with its own strides;
// every other virtual tensor has a memory of its own, laid out densely by its dims (its declared strides are a
// layout hint to cuDNN: cudnn-frontend gives the dO O product strides under which heads' rows overlap). Pointwise
// operations broadcast (a dim of 1 against any), reductions sum or take the max over the dims their output has as 1,
// matmuls multiply the last two dims per (B, H); a value stored into a bf16 tensor is rounded to bf16, into a float one
// to float; the arithmetic is double. So the graph megascale hands cuDNN is checked against ms::ops::ref's attention
// here, without a GPU: its strides, transposes, mask, scale and the order of its operations.
namespace {

using Rec = cudnn::GraphRecord;

float RoundBf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return x;  // inf, nan
  u += 0x7fffu + ((u >> 16) & 1u);                 // round to nearest even
  u &= 0xffff0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

struct View {
  std::shared_ptr<std::vector<double>> mem;
  int64_t offset = 0;
  const Rec::Tensor* t = nullptr;
  std::vector<int64_t> strides;  // empty: the tensor's own
  double& at(const int64_t* idx) const {
    const std::vector<int64_t>& st = strides.empty() ? t->strides : strides;
    int64_t o = offset;
    for (size_t i = 0; i < t->dims.size(); ++i) o += (t->dims[i] == 1 ? 0 : idx[i]) * st[i];
    return (*mem)[static_cast<size_t>(o)];
  }
};

std::vector<int64_t> Dense(const std::vector<int64_t>& dims) {
  std::vector<int64_t> st(dims.size(), 1);
  for (int i = static_cast<int>(dims.size()) - 2; i >= 0; --i) st[i] = st[i + 1] * dims[i + 1];
  return st;
}

double Store(const Rec::Tensor& t, double v) {
  if (t.type == Rec::Type::kBf16) return RoundBf16(static_cast<float>(v));
  if (t.type == Rec::Type::kFloat) return static_cast<float>(v);
  return v;
}

// Calls f(idx) for every index of dims (4 of them).
template <typename F>
void ForEach(const std::vector<int64_t>& dims, F f) {
  int64_t idx[4] = {0, 0, 0, 0};
  for (idx[0] = 0; idx[0] < dims[0]; ++idx[0])
    for (idx[1] = 0; idx[1] < dims[1]; ++idx[1])
      for (idx[2] = 0; idx[2] < dims[2]; ++idx[2])
        for (idx[3] = 0; idx[3] < dims[3]; ++idx[3]) f(idx);
}

// Runs the record with `bound` (uid -> view of user memory or a scalar's one-element memory; uids the graph lacks are
// ignored); returns every view.
std::map<int64_t, View> Interpret(const Rec& rec, std::map<int64_t, View> bound) {
  std::map<int64_t, const Rec::Tensor*> tensors;
  for (const auto& t : rec.tensors) tensors[t.uid] = &t;
  std::map<int64_t, View> v;
  for (auto& [uid, view] : bound) {  // what the graph has no tensor for (a form without it) is left out
    if (auto it = tensors.find(uid); it != tensors.end()) v[uid] = View{view.mem, view.offset, it->second, {}};
  }
  auto view_of = [&](int64_t uid) -> View& {
    auto it = v.find(uid);
    if (it == v.end()) {  // an intermediate: memory of its own, dense
      const Rec::Tensor* t = tensors.at(uid);
      const std::vector<int64_t> st = Dense(t->dims);
      it = v.emplace(uid, View{std::make_shared<std::vector<double>>(st[0] * t->dims[0], 0.0), 0, t, st}).first;
    }
    return it->second;
  };
  for (const auto& op : rec.ops) {
    if (op.op == Rec::Op::kReshape) {  // the input's memory, read with the output's dims and strides
      const View x = view_of(op.in[0]);
      REQUIRE((x.strides.empty() || x.strides == x.t->strides));  // the input laid out as declared
      v[op.out] = View{x.mem, x.offset, tensors.at(op.out), {}};
      continue;
    }
    View& y = view_of(op.out);
    std::vector<View*> in;
    for (int64_t u : op.in) in.push_back(&view_of(u));
    const Rec::Tensor& yt = *y.t;
    if (op.op == Rec::Op::kReduceAdd || op.op == Rec::Op::kReduceMax) {
      const bool max = op.op == Rec::Op::kReduceMax;
      ForEach(yt.dims, [&](const int64_t* i) { y.at(i) = max ? -INFINITY : 0.0; });
      ForEach(in[0]->t->dims, [&](const int64_t* i) {
        double& acc = y.at(i);  // y's dims of 1 index 0
        const double x = in[0]->at(i);
        acc = max ? std::max(acc, x) : acc + x;
      });
      ForEach(yt.dims, [&](const int64_t* i) { y.at(i) = Store(yt, y.at(i)); });
      continue;
    }
    if (op.op == Rec::Op::kMatmul) {
      const View &a = *in[0], &b = *in[1];
      const int64_t K = a.t->dims[3];
      REQUIRE(b.t->dims[2] == K);
      ForEach(yt.dims, [&](const int64_t* i) {
        double acc = 0;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t ia[4] = {i[0], i[1], i[2], k}, ib[4] = {i[0], i[1], k, i[3]};
          acc += a.at(ia) * b.at(ib);
        }
        y.at(i) = Store(yt, acc);
      });
      continue;
    }
    ForEach(yt.dims, [&](const int64_t* i) {
      auto arg = [&](size_t k) { return in[k]->at(i); };
      double r = 0;
      switch (op.op) {
        case Rec::Op::kMul:
          r = arg(0) * arg(1);
          break;
        case Rec::Op::kAdd:
          r = arg(0) + arg(1);
          break;
        case Rec::Op::kSub:
          r = arg(0) - arg(1);
          break;
        case Rec::Op::kDiv:
          r = arg(0) / arg(1);
          break;
        case Rec::Op::kExp:
          r = std::exp(arg(0));
          break;
        case Rec::Op::kLog:
          r = std::log(arg(0));
          break;
        case Rec::Op::kIdentity:
          r = arg(0);
          break;
        case Rec::Op::kGenIndex:
          r = static_cast<double>(i[op.axis]);
          break;
        case Rec::Op::kCmpGe:
          r = arg(0) >= arg(1);
          break;
        case Rec::Op::kCmpGt:
          r = arg(0) > arg(1);
          break;
        case Rec::Op::kCmpLt:
          r = arg(0) < arg(1);
          break;
        case Rec::Op::kLogicalAnd:
          r = arg(0) != 0 && arg(1) != 0;
          break;
        case Rec::Op::kBinarySelect:
          r = arg(2) != 0 ? arg(0) : arg(1);
          break;
        default:
          FAIL("operation not interpreted: " << op.name);
      }
      y.at(i) = Store(yt, r);
    });
  }
  return v;
}

std::vector<float> RandomValues(size_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = RoundBf16(u(g));  // bf16 values: the graphs' inputs are bf16
  return v;
}

View Memory(const std::vector<float>& values, int64_t offset = 0) {
  return View{std::make_shared<std::vector<double>>(values.begin(), values.end()), offset, nullptr, {}};
}
View Scalar(double x) {
  return View{std::make_shared<std::vector<double>>(1, x), 0, nullptr, {}};
}

// max |a - b| <= rtol * max |b| + atol, with the figures for the log.
bool Close(const std::vector<float>& a, const std::vector<float>& b, double rtol, double atol, std::string* what) {
  double worst = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::isnan(a[i]) ? INFINITY : std::max(worst, std::fabs(double(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(double(b[i])));
  }
  *what = "max |graph - reference| " + std::to_string(worst) + ", max |reference| " + std::to_string(scale);
  return worst <= rtol * scale + atol;
}

// The forward and backward graphs of `s` built with `o`, interpreted, against ms::ops::ref's attention with window
// `ref_window` (the shape's own, or another to show the comparison discriminates). Returns whether out, lse and
// dQ, dK, dV all agree, and the figures.
std::pair<bool, std::string> GraphsMatchReference(const cudnn::SdpaShape& s, const cudnn::GraphOptions& o,
                                                  int64_t ref_window) {
  const int64_t B = s.B, T = s.T, H = s.H, D = s.D, C = H * D;
  const std::vector<float> qkv = RandomValues(B * T * 3 * C, 11, -2.0f, 2.0f),
                           dout = RandomValues(B * T * C, 12, -1, 1);
  std::vector<float> out(B * T * C), lse(B * H * T), dqkv(B * T * 3 * C);
  ms::ops::ref::AttentionForward(out.data(), lse.data(), qkv.data(), B, T, H, D, ref_window);
  ms::ops::ref::AttentionBackward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, H, D, ref_window);
  auto fwd = cudnn::RecordGraph(s, cudnn::Pass::kForward, o);
  auto bwd = cudnn::RecordGraph(s, cudnn::Pass::kBackward, o);
  REQUIRE(fwd.ok());
  REQUIRE(bwd.ok());
  const double neg_inf = o.lowest_for_inf ? std::numeric_limits<float>::lowest() : -INFINITY;
  auto scalars = [&](std::map<int64_t, View>& m) {
    m[10] = Scalar(1.0 / std::sqrt(static_cast<float>(D)));  // kScale
    m[10].mem->at(0) = static_cast<float>(m[10].mem->at(0));
    m[11] = Scalar(neg_inf);
    m[12] = Scalar(static_cast<double>(s.window));
    m[14] = Scalar(1.0);                                                                             // kOne
    m[16] = View{std::make_shared<std::vector<double>>(B, static_cast<double>(T)), 0, nullptr, {}};  // seq_q
    m[17] = m[16];                                                                                   // seq_kv
  };
  // Forward: Q, Kᵀ, V from qkv; O and Stats written.
  std::map<int64_t, View> f;
  const View q = Memory(qkv);
  f[1] = q, f[2] = View{q.mem, C, nullptr, {}}, f[3] = View{q.mem, 2 * C, nullptr, {}};
  f[4] = Memory(std::vector<float>(B * T * C));
  f[5] = Memory(std::vector<float>(B * H * T));
  scalars(f);
  const auto fv = Interpret(*fwd, f);
  const std::vector<float> got_out(fv.at(4).mem->begin(), fv.at(4).mem->end()),
      got_lse(fv.at(5).mem->begin(), fv.at(5).mem->end());
  // Backward: Q, Kᵀ, Vᵀ, O (the reference's, rounded to bf16 as megascale keeps it), dO, Stats (the reference's lse);
  // dQ, dK, dV written into one dqkv memory, the row terms into their own, dQacc (where the form has it).
  std::vector<float> out16(out.size());
  for (size_t i = 0; i < out.size(); ++i) out16[i] = RoundBf16(out[i]);
  std::map<int64_t, View> b;
  b[1] = q, b[2] = View{q.mem, C, nullptr, {}}, b[3] = View{q.mem, 2 * C, nullptr, {}};
  b[4] = Memory(out16);
  b[5] = Memory(lse);
  b[6] = Memory(dout);
  const View dq = Memory(std::vector<float>(B * T * 3 * C, NAN));
  b[7] = dq, b[8] = View{dq.mem, C, nullptr, {}}, b[9] = View{dq.mem, 2 * C, nullptr, {}};
  b[13] = Memory(std::vector<float>(B * H * T, NAN));
  b[15] = Memory(std::vector<float>(B * H * T * D, 0.0f));
  scalars(b);
  Interpret(*bwd, b);
  const std::vector<float> got_dqkv(dq.mem->begin(), dq.mem->end());
  std::string what, all;
  bool ok = true;
  ok = Close(got_out, out, 2e-2, 1e-3, &what) && ok;
  all += "out: " + what;
  ok = Close(got_lse, lse, 1e-5, 1e-5, &what) && ok;
  all += "; lse: " + what;
  for (int part = 0; part < 3; ++part) {
    std::vector<float> g, w;
    for (int64_t i = 0; i < B * T * 3 * C; ++i) {
      if ((i / C) % 3 != part) continue;
      g.push_back(got_dqkv[i]);
      w.push_back(dqkv[i]);
    }
    ok = Close(g, w, 3e-2, 1e-3, &what) && ok;
    all += std::string(part == 0 ? "; dQ: " : part == 1 ? "; dK: " : "; dV: ") + what;
  }
  return {ok, all};
}

}  // namespace

TEST_CASE("what the attention graphs compute, interpreted on the CPU, is ms::ops::ref's attention") {
  // (T 8, H 2: rows of the dO O product collide under its declared strides.)
  const cudnn::SdpaShape shapes[] = {{2, 9, 2, 8, 0}, {1, 13, 3, 16, 4}, {2, 7, 1, 8, 7}, {1, 8, 2, 8, 0}};
  cudnn::GraphOptions forms[5];
  forms[1].padding_mask = true;
  forms[2].padding_mask = true, forms[2].second_padding_mask = true;
  forms[3].deterministic = true;
  forms[4].deterministic = true, forms[4].padding_mask = true, forms[4].lowest_for_inf = true;
  for (const auto& s : shapes) {
    for (int f = 0; f < 5; ++f) {
      CAPTURE(s.T);
      CAPTURE(s.D);
      CAPTURE(s.window);
      CAPTURE(f);
      const auto [ok, figures] = GraphsMatchReference(s, forms[f], s.window);
      CHECK_MESSAGE(ok, figures);
    }
  }
  // The comparison discriminates: the graphs of a window of 4 are not the attention without one.
  CHECK_FALSE(GraphsMatchReference({1, 13, 3, 16, 4}, forms[0], 0).first);
}
