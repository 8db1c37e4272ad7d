#include <doctest/doctest.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "device/device.h"
#include "model/model.h"
#include "optim/optim.h"

namespace ms::model {
namespace {

config::ModelSpec SmallSpec(config::BlockKind block, int window) {
  config::ModelSpec m;
  m.layers = 2;
  m.hidden = 12;
  m.heads = 3;
  m.ffn_hidden = 20;
  m.vocab = 13;
  m.seq_len = 7;
  m.block = block;
  m.window = window;
  m.init_std = 0.3f;
  return m;
}

struct Batch {
  std::vector<int32_t> inputs, targets;
};
Batch RandomBatch(const config::ModelSpec& m, int B, uint64_t seed) {
  Rng rng(seed);
  Batch b;
  for (int i = 0; i < B * m.seq_len; ++i) {
    b.inputs.push_back(static_cast<int32_t>(rng.NextBelow(m.vocab)));
    b.targets.push_back(static_cast<int32_t>(rng.NextBelow(m.vocab)));
  }
  return b;
}

}  // namespace

TEST_CASE("placed gradients: the backward writes each parameter's gradient where it was placed") {
  auto dev = device::MakeCpuDevice();
  for (auto block : {config::BlockKind::kParallel, config::BlockKind::kSequential}) {
    CAPTURE(static_cast<int>(block));
    const auto m = SmallSpec(block, 3);
    const int B = 2;
    const Batch batch = RandomBatch(m, B, 5);
    auto flat = Gpt::Create(m, {}, B, 11, dev.get());
    REQUIRE(flat.ok());
    ShardSpec placed_spec;
    placed_spec.placed_grads = true;
    auto placed = Gpt::Create(m, placed_spec, B, 11, dev.get());
    REQUIRE(placed.ok());
    Gpt& g = **placed;
    CHECK(g.grad_data() == nullptr);
    CHECK(!g.ZeroGrad().ok());
    // No backward before the gradients are placed; a placement of the wrong size or with a hole is refused.
    REQUIRE(g.Forward(batch.inputs.data(), batch.targets.data()).ok());
    const Status early = g.Backward(1.0f / (B * m.seq_len));
    CHECK(!early.ok());
    CHECK(early.message().find("placed") != std::string::npos);
    const size_t n = g.params().size();
    CHECK(!g.PlaceGradients(std::vector<float*>(n - 1, nullptr)).ok());
    CHECK(!g.PlaceGradients(std::vector<float*>(n, nullptr)).ok());
    CHECK(!(*flat)->PlaceGradients(std::vector<float*>(n, nullptr)).ok());  // a model holding its gradients
    // Each tensor in a buffer of its own, in reverse order, with a guard value after it that must survive.
    std::vector<std::vector<float>> own(n);
    std::vector<float*> where(n);
    for (size_t k = n; k-- > 0;) {
      own[k].assign(static_cast<size_t>(g.params()[k].numel) + 1, 0.0f);
      own[k].back() = 1234.5f;
      where[k] = own[k].data();
    }
    REQUIRE(g.PlaceGradients(where).ok());
    for (int micro = 0; micro < 2; ++micro) {  // two micro-batches accumulate
      REQUIRE((*flat)->Forward(batch.inputs.data(), batch.targets.data()).ok());
      REQUIRE((*flat)->Backward(1.0f / (B * m.seq_len)).ok());
      REQUIRE(g.Forward(batch.inputs.data(), batch.targets.data()).ok());
      REQUIRE(g.Backward(1.0f / (B * m.seq_len)).ok());
    }
    for (size_t k = 0; k < n; ++k) {
      const auto& p = g.params()[k];
      CAPTURE(p.name);
      CHECK(std::memcmp(own[k].data(), (*flat)->grad_data() + p.offset, sizeof(float) * p.numel) == 0);
      CHECK(own[k].back() == 1234.5f);
      CHECK(g.grad(k) == own[k].data());
    }
  }
}

TEST_CASE("gradients match central finite differences of the loss") {
  auto dev = device::MakeCpuDevice();
  for (auto block : {config::BlockKind::kParallel, config::BlockKind::kSequential}) {
    for (int window : {0, 3}) {
      CAPTURE(static_cast<int>(block));
      CAPTURE(window);
      auto m = SmallSpec(block, window);
      const int B = 2;
      auto gpt_or = Gpt::Create(m, {}, B, 11, dev.get());
      REQUIRE(gpt_or.ok());
      auto& gpt = *gpt_or;
      Batch batch = RandomBatch(m, B, 5);
      REQUIRE(gpt->Forward(batch.inputs.data(), batch.targets.data()).ok());
      REQUIRE(gpt->Backward(1.0f / (B * m.seq_len)).ok());
      std::vector<float> grad(gpt->grad_data(), gpt->grad_data() + gpt->num_params());
      Rng pick(3);
      int checked = 0;
      for (const auto& p : gpt->params()) {
        for (int k = 0; k < 3; ++k) {
          int64_t i = p.offset + static_cast<int64_t>(pick.NextBelow(p.numel));
          float* w = gpt->param_data() + i;
          const float orig = *w;
          const float h = 1e-2f;
          *w = orig + h;
          double lp = *gpt->Forward(batch.inputs.data(), batch.targets.data());
          *w = orig - h;
          double lm = *gpt->Forward(batch.inputs.data(), batch.targets.data());
          *w = orig;
          double fd = (lp - lm) / (2 * h);
          CAPTURE(p.name);
          CHECK(std::abs(fd - grad[i]) <= 2e-3 + 5e-2 * std::abs(fd));
          ++checked;
        }
      }
      CHECK(checked == 3 * static_cast<int>(gpt->params().size()));
    }
  }
}

TEST_CASE("training steps are deterministic and the loss falls on a repeated batch") {
  auto dev = device::MakeCpuDevice();
  auto m = SmallSpec(config::BlockKind::kParallel, 4);
  m.init_std = 0.02f;
  config::OptimizerSpec os;
  os.lr = 1e-2f;
  os.warmup_steps = 0;
  std::vector<float> finals[2];
  std::vector<double> losses[2];
  for (int run = 0; run < 2; ++run) {
    auto gpt = std::move(Gpt::Create(m, {}, 2, 1, dev.get())).value();
    auto opt = std::move(optim::Optimizer::Create(os, gpt->params(), optim::WholeTensorSegments(gpt->params()),
                                                  AllTensorNames(m)))
                   .value();
    Batch batch = RandomBatch(m, 2, 9);
    for (int step = 1; step <= 20; ++step) {
      REQUIRE(gpt->ZeroGrad().ok());
      float loss = *gpt->Forward(batch.inputs.data(), batch.targets.data());
      REQUIRE(gpt->Backward(1.0f / (2 * m.seq_len)).ok());
      REQUIRE(opt->Step(optim::WholeTensorData(gpt->params(), gpt->param_data(), gpt->grad_data()), step, os.lr,
                        optim::IdentityReducer)
                  .ok());
      losses[run].push_back(loss);
    }
    finals[run].assign(gpt->param_data(), gpt->param_data() + gpt->num_params());
  }
  CHECK(losses[0] == losses[1]);
  CHECK(finals[0] == finals[1]);
  CHECK(losses[0].back() < 0.5 * losses[0].front());
}

TEST_CASE("a padded vocabulary trains as the unpadded one; the padding rows stay zero, out of the softmax") {
  auto dev = device::MakeCpuDevice();
  for (bool tied : {true, false}) {
    CAPTURE(tied);
    config::OptimizerSpec os;
    os.lr = 1e-2f;
    os.warmup_steps = 0;
    os.weight_decay = 0.1f;
    std::vector<float> losses[2];
    std::vector<std::vector<float>> real_rows[2];
    for (int run = 0; run < 2; ++run) {
      auto m = SmallSpec(config::BlockKind::kSequential, 0);
      m.tied_embeddings = tied;
      m.vocab_pad_to = run == 0 ? 1 : 8;  // 13 -> 16 rows
      CHECK(m.padded_vocab() == (run == 0 ? 13 : 16));
      auto gpt = std::move(Gpt::Create(m, {}, 2, 3, dev.get())).value();
      auto opt = std::move(optim::Optimizer::Create(os, gpt->params(), optim::WholeTensorSegments(gpt->params()),
                                                    AllTensorNames(m)))
                     .value();
      for (int step = 1; step <= 6; ++step) {
        Batch batch = RandomBatch(m, 2, 40 + step);
        REQUIRE(gpt->ZeroGrad().ok());
        losses[run].push_back(*gpt->Forward(batch.inputs.data(), batch.targets.data()));
        REQUIRE(gpt->Backward(1.0f / (2 * m.seq_len)).ok());
        for (const auto& p : gpt->params()) {  // the padding rows' gradient is exactly zero
          if (p.name != "embed.wte" && p.name != "lm_head.weight") continue;
          const float* g = gpt->grad_data() + p.offset;
          for (int64_t i = m.vocab * m.hidden; i < p.numel; ++i) REQUIRE(g[i] == 0.0f);
        }
        REQUIRE(opt->Step(optim::WholeTensorData(gpt->params(), gpt->param_data(), gpt->grad_data()), step, os.lr,
                          optim::IdentityReducer)
                    .ok());
      }
      for (const auto& p : gpt->params()) {
        const float* w = gpt->param_data() + p.offset;
        int64_t n = p.numel;
        if (p.name == "embed.wte" || p.name == "lm_head.weight") {
          CHECK(p.global_shape[0] == m.padded_vocab());
          n = m.vocab * m.hidden;
          for (int64_t i = n; i < p.numel; ++i) REQUIRE(w[i] == 0.0f);  // zero at init, still zero (weight decay too)
        }
        real_rows[run].emplace_back(w, w + n);
      }
    }
    // The same model: the GEMMs only gain columns, so each loss and weight agrees to float rounding.
    REQUIRE(losses[0].size() == losses[1].size());
    for (size_t i = 0; i < losses[0].size(); ++i) CHECK(losses[1][i] == doctest::Approx(losses[0][i]).epsilon(1e-6));
    REQUIRE(real_rows[0].size() == real_rows[1].size());
    double worst = 0;
    for (size_t t = 0; t < real_rows[0].size(); ++t) {
      REQUIRE(real_rows[0][t].size() == real_rows[1][t].size());
      for (size_t i = 0; i < real_rows[0][t].size(); ++i) {
        worst = std::max(worst, static_cast<double>(std::fabs(real_rows[0][t][i] - real_rows[1][t][i])));
      }
    }
    CHECK(worst < 1e-5);
  }
}

TEST_CASE("deferred losses are the immediate losses, bit for bit, and the step's count is enforced") {
  auto dev = device::MakeCpuDevice();
  auto m = SmallSpec(config::BlockKind::kSequential, 0);
  auto gpt = std::move(Gpt::Create(m, {}, 2, 5, dev.get())).value();
  std::vector<Batch> batches;
  for (uint64_t seed = 20; seed < 23; ++seed) batches.push_back(RandomBatch(m, 2, seed));
  batches[1].targets[3] = -1;  // an ignored token: not in that micro-batch's mean
  for (int i = 0; i < 2 * m.seq_len; ++i) batches[2].targets[i] = -1;  // no token counts: mean 0
  std::vector<float> immediate;
  for (const auto& b : batches) immediate.push_back(*gpt->Forward(b.inputs.data(), b.targets.data()));
  CHECK(immediate[2] == 0.0f);

  REQUIRE(gpt->BeginDeferredLosses(3).ok());
  for (const auto& b : batches) CHECK(*gpt->Forward(b.inputs.data(), b.targets.data()) == 0.0f);
  auto deferred = gpt->TakeDeferredLosses();
  REQUIRE(deferred.ok());
  CHECK(*deferred == immediate);
  // Off again after the take: the loss comes back immediately.
  CHECK(*gpt->Forward(batches[0].inputs.data(), batches[0].targets.data()) == immediate[0]);
  CHECK(!gpt->TakeDeferredLosses().ok());

  // More head forwards than the step was begun for is a bug, reported as one.
  REQUIRE(gpt->BeginDeferredLosses(1).ok());
  REQUIRE(gpt->Forward(batches[0].inputs.data(), batches[0].targets.data()).ok());
  auto extra = gpt->Forward(batches[1].inputs.data(), batches[1].targets.data());
  REQUIRE(!extra.ok());
  CHECK(extra.status().message().find("deferred micro-batch losses") != std::string::npos);
  deferred = gpt->TakeDeferredLosses();
  REQUIRE(deferred.ok());
  CHECK(*deferred == std::vector<float>{immediate[0]});
  CHECK(!gpt->BeginDeferredLosses(0).ok());

  // With the backward's loss weight given, the forward fuses the loss and the logits' gradient: the same loss
  // and the same parameter gradients, bit for bit; a backward with another weight is refused.
  const float dl = 1.0f / (2 * m.seq_len);
  REQUIRE(gpt->ZeroGrad().ok());
  const float loss_plain = *gpt->Forward(batches[1].inputs.data(), batches[1].targets.data());
  REQUIRE(gpt->Backward(dl).ok());
  const std::vector<float> grads_plain(gpt->grad_data(), gpt->grad_data() + gpt->num_params());
  REQUIRE(gpt->ZeroGrad().ok());
  REQUIRE(gpt->BeginDeferredLosses(2, dl).ok());
  REQUIRE(gpt->Forward(batches[1].inputs.data(), batches[1].targets.data()).ok());
  REQUIRE(gpt->Backward(dl).ok());
  const std::vector<float> grads_fused(gpt->grad_data(), gpt->grad_data() + gpt->num_params());
  REQUIRE(gpt->Forward(batches[1].inputs.data(), batches[1].targets.data()).ok());
  const Status wrong = gpt->Backward(2 * dl);
  CHECK(!wrong.ok());
  CHECK(wrong.message().find("fused forward") != std::string::npos);
  deferred = gpt->TakeDeferredLosses();
  REQUIRE(deferred.ok());
  CHECK(*deferred == std::vector<float>{loss_plain, loss_plain});
  CHECK(grads_fused == grads_plain);
}

TEST_CASE("initialization is identical whatever the seed stream and shard extraction tiles the tensor") {
  const std::vector<int64_t> shape{6, 4};
  std::vector<float> global(24);
  for (int i = 0; i < 24; ++i) global[i] = static_cast<float>(i);
  for (auto kind : {ShardKind::kRows, ShardKind::kCols, ShardKind::kQkvRows}) {
    std::vector<float> a(12), b(12);
    ExtractShard(global.data(), a.data(), shape, kind, 2, 0);
    ExtractShard(global.data(), b.data(), shape, kind, 2, 1);
    std::vector<float> all(a);
    all.insert(all.end(), b.begin(), b.end());
    std::sort(all.begin(), all.end());
    CHECK(all == global);  // the two shards partition the tensor
  }
  std::vector<float> q(12);
  ExtractShard(global.data(), q.data(), shape, ShardKind::kQkvRows, 2, 1);
  CHECK(q[0] == 4.0f);   // row 1 of the q block
  CHECK(q[4] == 12.0f);  // row 1 of the k block
  CHECK(q[8] == 20.0f);  // row 1 of the v block
}

// Gpt::Init draws the tensors on the rank's OpenMP threads, a tensor each (in groups of at most 1 GiB): each has its
// own RNG stream, so one thread and three give the same bits.
TEST_CASE("initialization gives the same bits on one OpenMP thread and on several") {
  auto dev = device::MakeCpuDevice();
  const int threads = omp_get_max_threads();
  std::vector<float> got[2];
  for (int run = 0; run < 2; ++run) {
    omp_set_num_threads(run == 0 ? 1 : 3);
    auto created = Gpt::Create(SmallSpec(config::BlockKind::kSequential, 0), {}, 2, 1, dev.get());
    REQUIRE_MESSAGE(created.ok(), created.status().ToString());
    auto gpt = std::move(created).value();
    got[run].assign(gpt->param_data(), gpt->param_data() + gpt->num_params());
  }
  omp_set_num_threads(threads);
  REQUIRE(got[0].size() == got[1].size());
  CHECK(std::memcmp(got[0].data(), got[1].data(), got[0].size() * sizeof(float)) == 0);
  CHECK(std::count(got[0].begin(), got[0].end(), 0.0f) < static_cast<std::ptrdiff_t>(got[0].size() / 2));
}

TEST_CASE("bad inputs are rejected with clear errors") {
  auto dev = device::MakeCpuDevice();
  auto m = SmallSpec(config::BlockKind::kParallel, 0);
  auto gpt = std::move(Gpt::Create(m, {}, 1, 1, dev.get())).value();
  std::vector<int32_t> in(m.seq_len, 1), tg(m.seq_len, 1);
  in[3] = m.vocab;
  auto r = gpt->Forward(in.data(), tg.data());
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message().find("outside the vocabulary") != std::string::npos);
  CHECK_FALSE(gpt->Backward(1.0f).ok());  // no forward
  ShardSpec tp2;
  tp2.tp_size = 2;
  auto no_comm = Gpt::Create(m, tp2, 1, 1, dev.get());  // tp 2 without a communicator
  CHECK(no_comm.status().code() == Code::kInvalidArgument);
  ShardSpec bad;
  bad.pp_size = 3;  // 2 layers do not split into 3 stages
  CHECK(Gpt::Create(m, bad, 1, 1, dev.get()).status().message().find("does not divide") != std::string::npos);
}

TEST_CASE("learning-rate schedule: warm-up, cosine, constant") {
  config::OptimizerSpec s;
  s.lr = 1.0f;
  s.min_lr = 0.1f;
  s.warmup_steps = 10;
  CHECK(optim::LearningRate(s, 1, 110) == doctest::Approx(0.1));
  CHECK(optim::LearningRate(s, 10, 110) == doctest::Approx(1.0));
  CHECK(optim::LearningRate(s, 60, 110) == doctest::Approx(0.55));
  CHECK(optim::LearningRate(s, 110, 110) == doctest::Approx(0.1));
  s.schedule = config::ScheduleKind::kConstant;
  CHECK(optim::LearningRate(s, 60, 110) == doctest::Approx(1.0));
}

TEST_CASE("flop formula against hand-computed values (docs/ARCHITECTURE.md, FLOPs and MFU)") {
  // 6 x matmul parameters x tokens + 12 x layers x hidden x (keys attended, summed over positions).
  config::ModelSpec a;
  a.layers = 2, a.hidden = 64, a.heads = 4, a.ffn_hidden = 256, a.vocab = 256, a.seq_len = 8, a.window = 0;
  // matmul parameters 2 * (4 * 64^2 + 2 * 64 * 256) + 256 * 64 = 114688; keys 1 + 2 + ... + 8 = 36
  // 6 * 114688 * 8 + 12 * 2 * 64 * 36 = 5505024 + 55296
  CHECK(TrainingFlopsPerSequence(a) == 5560320.0);
  config::ModelSpec b;
  b.layers = 3, b.hidden = 32, b.heads = 2, b.ffn_hidden = 0, b.vocab = 100, b.seq_len = 10, b.window = 4;
  // ffn 4 * 32; matmul parameters 3 * (4 * 32^2 + 2 * 32 * 128) + 100 * 32 = 40064; a window of 4 shorter than
  // the sequence: keys 1 + 2 + 3 + 4 * 7 = 34; 6 * 40064 * 10 + 12 * 3 * 32 * 34 = 2403840 + 39168
  CHECK(TrainingFlopsPerSequence(b) == 2443008.0);
}

TEST_CASE("flop formula counts windowed attention keys") {
  config::ModelSpec m = SmallSpec(config::BlockKind::kParallel, 0);
  double full = TrainingFlopsPerSequence(m);
  m.window = 1;
  double w1 = TrainingFlopsPerSequence(m);
  const double C = m.hidden, T = m.seq_len, L = m.layers;
  CHECK(full - w1 == doctest::Approx(12.0 * L * C * (T * (T + 1) / 2 - T)));
}

}  // namespace ms::model

namespace ms::model {

TEST_CASE("decoder: token-by-token logits with a KV cache give the training forward's loss") {
  auto dev = device::MakeCpuDevice();
  for (auto block : {config::BlockKind::kParallel, config::BlockKind::kSequential}) {
    for (int window : {0, 3}) {  // 3: a window shorter than the sequence (7)
      for (int pad : {1, 8})     // 8: the 13-token vocabulary held as 16 rows, 3 of them masked padding
        for (bool tied : {true, false}) {
          CAPTURE(static_cast<int>(block));
          CAPTURE(window);
          CAPTURE(tied);
          CAPTURE(pad);
          auto m = SmallSpec(block, window);
          m.tied_embeddings = tied;
          m.vocab_pad_to = pad;
          auto gpt = std::move(Gpt::Create(m, {}, 1, 17, dev.get())).value();
          Batch batch = RandomBatch(m, 1, 9);
          const double loss = *gpt->Forward(batch.inputs.data(), batch.targets.data());
          auto read = [&](const std::string& name, float* out, int64_t numel) -> Status {
            for (const auto& p : gpt->params()) {
              if (p.name != name || p.tied_replica) continue;
              if (p.numel != numel) return InvalidArgument("{}: {} floats, decoder wants {}", name, p.numel, numel);
              std::copy(gpt->param_data() + p.offset, gpt->param_data() + p.offset + numel, out);
              return Status::Ok();
            }
            return NotFound("no tensor {}", name);
          };
          auto dec_or = Decoder::Create(m, read);
          REQUIRE(dec_or.ok());
          auto& dec = *dec_or;
          double sum = 0;
          std::vector<float> last;
          for (int t = 0; t < m.seq_len; ++t) {
            auto logits = dec->Step(batch.inputs[t]);
            REQUIRE(logits.ok());
            REQUIRE(logits->size() == static_cast<size_t>(m.vocab));  // the padding is never a candidate
            double mx = -1e30, se = 0;
            for (float v : *logits) mx = std::max(mx, static_cast<double>(v));
            for (float v : *logits) se += std::exp(v - mx);
            sum += mx + std::log(se) - (*logits)[batch.targets[t]];
            last = *logits;
          }
          CHECK(sum / m.seq_len == doctest::Approx(loss).epsilon(1e-5));
          // Without the cache, the same logits bit for bit; past seq_len, a clear error.
          auto again = dec->Recompute();
          REQUIRE(again.ok());
          CHECK(*again == last);
          auto full = dec->Step(1);
          CHECK(full.status().code() == Code::kOutOfRange);
          CHECK(full.status().message().find("model.seq_len") != std::string::npos);
          dec->Reset();
          CHECK(dec->Step(m.vocab).status().code() == Code::kInvalidArgument);
        }
    }
  }
}

}  // namespace ms::model
