// The data-parallel engine's device waits (DataParallelOptions::device_waits), on the CPU backend: a communicator
// that says it waits on the device (comm::Communicator::waits_on_device, as NCCL does) gets WaitOnDevice for the
// step's reductions and in-step parameter gathers, no host wait, and one Drain before the optimizer, whose failure
// FinishBackward returns; without device waits (a traced run) every wait is on the host and nothing is drained.
#include <doctest/doctest.h>

#include <memory>
#include <vector>

#include "comm/comm.h"
#include "device/device.h"
#include "model/model.h"
#include "parallel/parallel.h"

namespace ms::parallel {
namespace {

struct Counts {
  int host_waits = 0, device_waits = 0, drains = 0;
};

// Forwards to another communicator (here a group of one), claims device waits and counts them.
class CountingComm : public comm::ForwardingCommunicator {
 public:
  CountingComm(comm::Communicator* inner, Counts* counts) : ForwardingCommunicator(inner), counts_(counts) {}
  bool waits_on_device() const override { return true; }
  Status Drain() override {
    ++counts_->drains;
    return drain_status;
  }

  Status drain_status;  // what Drain returns

 private:
  class CountingWork : public comm::Work {
   public:
    CountingWork(std::unique_ptr<comm::Work> w, Counts* c) : w_(std::move(w)), c_(c) {}
    Status Wait() override {
      ++c_->host_waits;
      return w_->Wait();
    }
    Status WaitOnDevice() override {
      ++c_->device_waits;
      return w_->Wait();  // the self communicator's work is done at once
    }

   private:
    std::unique_ptr<comm::Work> w_;
    Counts* c_;
  };
  std::unique_ptr<comm::Work> Wrap(std::unique_ptr<comm::Work> w, const char*, double) override {
    return std::make_unique<CountingWork>(std::move(w), counts_);
  }
  Counts* counts_;
};

config::ModelSpec SmallSpec() {
  config::ModelSpec m;
  m.layers = 2;
  m.hidden = 12;
  m.heads = 3;
  m.ffn_hidden = 20;
  m.vocab = 13;
  m.seq_len = 7;
  return m;
}

// One training step of two micro-batches: what the training loop calls, in its order. Returns FinishBackward's status.
Status Step(model::Gpt& gpt, DataParallel& dpe, const std::vector<int32_t>& tokens) {
  MS_RETURN_IF_ERROR(dpe.BeginStep());
  gpt.BeginStep();
  for (int micro = 0; micro < 2; ++micro) {
    auto before = [&](int layer) { return dpe.WaitParams(layer); };
    MS_RETURN_IF_ERROR(gpt.ForwardChunk(0, 0, tokens.data(), tokens.data(), nullptr, before).status());
    MS_RETURN_IF_ERROR(dpe.BeforeBackward(0));
    MS_RETURN_IF_ERROR(gpt.BackwardChunk(0, 0, nullptr, 0.1f, [&](int layer) { dpe.OnLayerDone(layer, micro, 2); }));
    MS_RETURN_IF_ERROR(dpe.EndMicroBatch(micro, 2));
  }
  MS_RETURN_IF_ERROR(gpt.EndStep());
  MS_RETURN_IF_ERROR(dpe.FinishBackward());
  return dpe.StartParamGather();  // after the optimizer: waited for in the next step's forward
}

}  // namespace

TEST_CASE("data-parallel waits: on the device where the communicator can, drained before the optimizer") {
  auto dev = device::MakeCpuDevice();
  const auto m = SmallSpec();
  std::vector<int32_t> tokens(2 * m.seq_len);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 5 + 1) % m.vocab);
  for (int zero : {0, 1, 2}) {
    for (bool device_waits : {true, false}) {
      CAPTURE(zero);
      CAPTURE(device_waits);
      model::ShardSpec shard;
      shard.placed_grads = zero == 2;  // ZeRO-2's gradient windows
      auto gpt = model::Gpt::Create(m, shard, 2, 3, dev.get());
      REQUIRE(gpt.ok());
      Counts counts;
      auto self = comm::MakeSelfCommunicator();
      CountingComm dp(self.get(), &counts);
      DataParallelOptions o;
      o.zero = zero;
      o.bucket_floats = 200;  // several buckets
      o.device_waits = device_waits;
      auto dpe = DataParallel::Create(gpt->get(), &dp, nullptr, o);
      REQUIRE(dpe.ok());
      for (int step = 1; step <= 2; ++step) {  // step 2 also waits for step 1's parameter gathers (ZeRO)
        CAPTURE(step);
        counts = Counts{};
        REQUIRE(Step(**gpt, **dpe, tokens).ok());
        if (device_waits) {
          CHECK(counts.host_waits == 0);
          CHECK(counts.device_waits >= (*dpe)->num_buckets() * (zero == 2 ? 2 : 1));
          CHECK(counts.drains == 1);
        } else {
          CHECK(counts.device_waits == 0);
          CHECK(counts.host_waits >= (*dpe)->num_buckets());
          CHECK(counts.drains == 0);
        }
      }
      // Before a checkpoint or an evaluation: the gathers are waited for on the host.
      counts = Counts{};
      REQUIRE((*dpe)->WaitAllParams().ok());
      CHECK(counts.device_waits == 0);
      CHECK(counts.host_waits == (zero > 0 ? (*dpe)->num_buckets() : 0));
      if (device_waits) {
        // A collective that failed on the device: FinishBackward reports it before the optimizer runs.
        dp.drain_status = Unavailable("nccl-dp[0]: the communicator was aborted after an earlier failure");
        const Status s = Step(**gpt, **dpe, tokens);
        REQUIRE(!s.ok());
        CHECK(s.message().find("waited for on the device") != std::string::npos);
        CHECK(s.message().find("aborted after an earlier failure") != std::string::npos);
      }
    }
  }
}

}  // namespace ms::parallel
