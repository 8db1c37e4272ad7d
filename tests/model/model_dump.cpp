// Dumps one forward/backward of a small GPT, and one AdamW and one LAMB step, for the
// PyTorch oracle (tests/model/torch_oracle.py).
// Usage: model_dump OUT_DIR parallel|sequential WINDOW
// Writes OUT_DIR/meta.json, params.f32, grads.f32, inputs.i32, targets.i32,
// adamw.f32 and lamb.f32 (parameters after one step from the same gradients).
#include <omp.h>

#include <cstdio>
#include <string>
#include <vector>

#include "config/config.h"
#include "device/device.h"
#include "metrics/metrics.h"
#include "model/model.h"
#include "optim/optim.h"

using namespace ms;

static bool WriteRaw(const std::string& path, const void* data, size_t bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  bool ok = std::fwrite(data, 1, bytes, f) == bytes;
  return std::fclose(f) == 0 && ok;
}

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s OUT_DIR parallel|sequential WINDOW\n", argv[0]);
    return 2;
  }
  const std::string out = argv[1];
  config::ModelSpec m;
  m.layers = 2;
  m.hidden = 24;
  m.heads = 3;
  m.ffn_hidden = 40;
  m.vocab = 37;
  m.seq_len = 11;
  m.block = std::string(argv[2]) == "sequential" ? config::BlockKind::kSequential : config::BlockKind::kParallel;
  m.window = std::atoi(argv[3]);
  m.init_std = 0.2f;  // large weights: every term of the gradient matters
  const int B = 3;
  auto dev = device::MakeCpuDevice();
  auto gpt_or = model::Gpt::Create(m, {}, B, 7, dev.get());
  if (!gpt_or.ok()) {
    std::fprintf(stderr, "%s\n", gpt_or.status().ToString().c_str());
    return 1;
  }
  auto& gpt = *gpt_or;
  // Non-trivial LayerNorm affine parameters and biases, so their gradients are exercised.
  Rng rng(99);
  for (const auto& p : gpt->params()) {
    if (p.name.find("bias") != std::string::npos || p.name.find("norm") != std::string::npos ||
        p.name.find("ln") != std::string::npos) {
      for (int64_t i = 0; i < p.numel; ++i)
        gpt->param_data()[p.offset + i] += static_cast<float>(rng.NextNormal() * 0.1);
    }
  }
  std::vector<int32_t> inputs(B * m.seq_len), targets(B * m.seq_len);
  for (auto& t : inputs) t = static_cast<int32_t>(rng.NextBelow(m.vocab));
  for (auto& t : targets) t = static_cast<int32_t>(rng.NextBelow(m.vocab));
  std::vector<float> params0(gpt->param_data(), gpt->param_data() + gpt->num_params());
  auto loss = gpt->Forward(inputs.data(), targets.data());
  if (!loss.ok() || !gpt->Backward(1.0f / (B * m.seq_len)).ok()) return 1;
  std::vector<float> grads(gpt->grad_data(), gpt->grad_data() + gpt->num_params());

  metrics::JsonObject meta;
  meta.Add("layers", m.layers).Add("hidden", m.hidden).Add("heads", m.heads).Add("ffn_hidden", m.ffn_hidden);
  meta.Add("vocab", m.vocab).Add("seq_len", m.seq_len).Add("window", m.window).Add("batch", B);
  meta.Add("block", argv[2]).Add("eps", static_cast<double>(m.norm_eps)).Add("loss", static_cast<double>(*loss));
  std::string names, offsets, shapes, decay;
  for (const auto& p : gpt->params()) {
    names += (names.empty() ? "" : ",") + std::string("\"") + p.name + "\"";
    offsets += (offsets.empty() ? "" : ",") + std::to_string(p.offset);
    std::string sh;
    for (auto d : p.local_shape) sh += (sh.empty() ? "" : ",") + std::to_string(d);
    shapes += (shapes.empty() ? "[" : ",[") + sh + "]";
    decay += (decay.empty() ? "" : ",") + std::string(p.weight_decay ? "true" : "false");
  }
  // Optimizer steps from the same state and gradients.
  config::OptimizerSpec os;
  os.lr = 1e-2f;
  os.weight_decay = 0.1f;
  os.beta1 = 0.9f;
  os.beta2 = 0.95f;
  os.eps = 1e-8f;
  os.grad_clip = 0;
  std::vector<float> stepped[2];
  for (int k = 0; k < 2; ++k) {
    os.kind = k == 0 ? config::OptimizerKind::kAdamW : config::OptimizerKind::kLamb;
    std::vector<float> p = params0, g = grads;
    auto opt = optim::Optimizer::Create(os, gpt->params(), optim::WholeTensorSegments(gpt->params()),
                                        model::AllTensorNames(m));
    if (!opt.ok() ||
        !(*opt)->Step(optim::WholeTensorData(gpt->params(), p.data(), g.data()), 1, os.lr, optim::IdentityReducer).ok())
      return 1;
    stepped[k] = p;
  }
  std::string json = meta.str();
  json.pop_back();
  json += ", \"names\": [" + names + "], \"offsets\": [" + offsets + "], \"shapes\": [" + shapes + "]" +
          ", \"decay\": [" + decay + "], \"lr\": 0.01, \"weight_decay\": 0.1, \"beta1\": 0.9, \"beta2\": 0.95" +
          ", \"opt_eps\": 1e-8}\n";
  bool ok = WriteRaw(out + "/meta.json", json.data(), json.size()) &&
            WriteRaw(out + "/params.f32", params0.data(), params0.size() * 4) &&
            WriteRaw(out + "/grads.f32", grads.data(), grads.size() * 4) &&
            WriteRaw(out + "/inputs.i32", inputs.data(), inputs.size() * 4) &&
            WriteRaw(out + "/targets.i32", targets.data(), targets.size() * 4) &&
            WriteRaw(out + "/adamw.f32", stepped[0].data(), stepped[0].size() * 4) &&
            WriteRaw(out + "/lamb.f32", stepped[1].data(), stepped[1].size() * 4);
  if (!ok) {
    std::fprintf(stderr, "cannot write to %s\n", out.c_str());
    return 1;
  }
  std::printf("loss %.6f, %lld floats\n", *loss, static_cast<long long>(gpt->num_params()));
  return 0;
}
