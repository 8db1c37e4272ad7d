// cuDNN's fused attention graph (lib/cuda/cudnn_sdpa.cpp), device-less: the graphs megascale builds must be
// ones that cuDNN's heuristics find engines for on an H100 (sm_90), at the GPU configs' shapes, odd shapes and with a
// sliding window — checked on a machine without a GPU through cuDNN's device properties (JSON) and the toolkit's stub
// libcuda (ctest sets LD_LIBRARY_PATH). A Volta (sm_70), where cuDNN has no fused flash attention, must get none:
// the check discriminates. The numbers themselves only a GPU computes (cuda_backend_gpu).
#include <doctest/doctest.h>

#include <string>

#include "cuda/cudnn_sdpa.h"

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
TEST_CASE("every engine's plan of the attention forward and backward compiles for an H100") {
  for (cudnn::Pass pass : {cudnn::Pass::kForward, cudnn::Pass::kBackward}) {
    CAPTURE(pass == cudnn::Pass::kForward ? "forward" : "backward");
    auto plans = cudnn::PlansDeviceless({16, 1024, 12, 64, 0}, pass, cudnn::H100DeviceProperties());
    const std::string why = plans.ok() ? std::string() : plans.status().message();
    INFO(why);
    REQUIRE(plans.ok());
    CHECK(!plans->empty());
    for (const std::string& p : *plans) {
      CAPTURE(p);
      CHECK((p == "ok" || p.find("CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER") != std::string::npos));
    }
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
  auto plans = cudnn::PlansDeviceless({2, 70, 3, 64, 0}, cudnn::Pass::kBackward, cudnn::H100DeviceProperties(), &o);
  const std::string why = plans.ok() ? std::string() : plans.status().message();
  INFO(why);
  REQUIRE(plans.ok());
  CHECK(!plans->empty());
  for (const std::string& p : *plans) {
    CAPTURE(p);
    CHECK((p == "ok" || p.find("CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER") != std::string::npos));
  }
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
