#include <omp.h>

#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <vector>

#include "data/data.h"
#include "device/device.h"
#include "metrics/metrics.h"
#include "model/model.h"
#include "optim/optim.h"
#include "runner/runner.h"

namespace ms::runner {
namespace {

std::atomic<int> g_stop_signal{0};
extern "C" void OnStopSignal(int sig) {
  g_stop_signal.store(sig);
}

// Installs SIGINT/SIGTERM handlers for the lifetime of the object, restoring the old ones.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = OnStopSignal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
  }
  ~StopSignals() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }

 private:
  struct sigaction old_int_ {
  }, old_term_{};
};

Status CheckSupported(const config::JobSpec& spec) {
  const auto& p = spec.parallel;
  if (p.tp * p.pp * p.dp != 1) {
    return Unimplemented(
        "{}: parallel layout tp={} pp={} dp={} needs {} ranks; multi-rank training is not built yet "
        "(3D-parallelism issue). Use tp: 1, pp: 1, dp: 1",
        spec.source, p.tp, p.pp, p.dp, p.tp * p.pp * p.dp);
  }
  if (spec.runtime.backend == config::Backend::kCuda) {
    return Unimplemented("{}: runtime.backend: cuda is not built yet (CUDA backend issue); use backend: cpu or auto",
                         spec.source);
  }
  if (spec.checkpoint.interval > 0 || spec.checkpoint.resume == "auto") {
    return Unimplemented(
        "{}: checkpoints are not built yet (checkpoint issue); set checkpoint.interval: 0 and checkpoint.resume: none",
        spec.source);
  }
  return Status::Ok();
}

// Fills inputs/targets [count, T] from samples first..first+count-1 of a split.
Status FetchBatch(const data::Sampler& sampler, bool train, int64_t first, int count, int T, std::vector<int32_t>* seq,
                  std::vector<int32_t>* inputs, std::vector<int32_t>* targets) {
  seq->resize(T + 1);
  for (int i = 0; i < count; ++i) {
    Status s = train ? sampler.GetTrain(first + i, seq->data()) : sampler.GetValid(first + i, seq->data());
    MS_RETURN_IF_ERROR(s);
    std::copy(seq->begin(), seq->begin() + T, inputs->begin() + static_cast<int64_t>(i) * T);
    std::copy(seq->begin() + 1, seq->end(), targets->begin() + static_cast<int64_t>(i) * T);
  }
  return Status::Ok();
}

}  // namespace

Result<TrainSummary> Train(const config::JobSpec& spec, const TrainOptions& options) {
  MS_RETURN_IF_ERROR(CheckSupported(spec));
  const auto& m = spec.model;
  const int T = m.seq_len;
  const int micro = spec.train.micro_batch;
  const int n_micro = spec.parallel.micro_batches;
  const int threads = spec.runtime.threads > 0 ? spec.runtime.threads : NumCores();
  omp_set_num_threads(threads);

  // Data first: a bad dataset fails before any output is written.
  MS_ASSIGN_OR_RETURN(auto tokenizer, data::MakeTokenizer(spec.data.tokenizer));
  if (tokenizer->vocab_size() > m.vocab) {
    return InvalidArgument("{}: tokenizer '{}' has {} tokens but model.vocab is {}; set model.vocab >= {}", spec.source,
                           tokenizer->name(), tokenizer->vocab_size(), m.vocab, tokenizer->vocab_size());
  }
  auto ds_or = data::IndexedDataset::Open(spec.data.path);
  if (!ds_or.ok()) return ds_or.status().WithContext(fmt::format("opening dataset data.path={}", spec.data.path));
  data::IndexedDataset ds = std::move(ds_or).value();
  if (ds.max_token() >= m.vocab) {
    return InvalidArgument("dataset {} holds token id {} but model.vocab is {}; raise model.vocab or re-tokenize",
                           spec.data.path, ds.max_token(), m.vocab);
  }
  MS_ASSIGN_OR_RETURN(auto sampler, data::Sampler::Create(&ds, T, spec.data.valid_fraction, spec.train.seed));

  // Run directory.
  const std::string& run_dir = spec.log.run_dir;
  MS_RETURN_IF_ERROR_CTX(MakeDirs(run_dir), "creating run directory log.run_dir={}", run_dir);
  MS_RETURN_IF_ERROR(WriteFileAtomic(run_dir + "/job.yaml", config::ToYaml(spec)));
  MS_RETURN_IF_ERROR(SetLogFile(run_dir + "/train.log"));
  struct CloseLog {
    ~CloseLog() { SetLogFile("").IgnoreError(); }
  } close_log;
  MS_ASSIGN_OR_RETURN(auto jsonl, metrics::JsonlWriter::Open(run_dir + "/metrics.jsonl", /*append=*/false));

  auto device = device::MakeCpuDevice();
  model::ShardSpec shard;
  MS_ASSIGN_OR_RETURN(auto gpt, model::Gpt::Create(m, shard, micro, spec.train.seed, device.get()));
  MS_ASSIGN_OR_RETURN(auto opt, optim::Optimizer::Create(spec.optimizer, gpt->params(), gpt->num_params()));

  const double flops_per_seq = model::TrainingFlopsPerSequence(m);
  const double peak = spec.log.peak_flops > 0 ? spec.log.peak_flops : metrics::MeasureGemmPeakFlops();
  int64_t n_params = 0;
  for (const auto& p : gpt->params()) n_params += p.numel;
  LogInfo("job {}: {} parameters, {} layers ({} block, window {}), {} threads, global batch {} = {} x {} x dp {}",
          spec.name, n_params, m.layers, config::Name(m.block), m.window, threads, spec.train.global_batch, micro,
          n_micro, spec.parallel.dp);
  LogInfo("data {}: {} tokens, {} train / {} validation samples of {} tokens; peak {:.1f} GFLOP/s ({})", spec.data.path,
          ds.num_tokens(), sampler.num_train(), sampler.num_valid(), T, peak / 1e9,
          spec.log.peak_flops > 0 ? "configured" : "measured fp32 GEMM");

  std::vector<int32_t> seq, inputs(static_cast<size_t>(micro) * T), targets(inputs.size());
  auto evaluate = [&]() -> Result<double> {
    if (sampler.num_valid() == 0) return -1.0;
    double sum = 0;
    for (int b = 0; b < spec.train.eval_batches; ++b) {
      MS_RETURN_IF_ERROR(
          FetchBatch(sampler, false, static_cast<int64_t>(b) * micro, micro, T, &seq, &inputs, &targets));
      MS_ASSIGN_OR_RETURN(float l, gpt->Forward(inputs.data(), targets.data()));
      sum += l;
    }
    return sum / spec.train.eval_batches;
  };

  StopSignals signals;
  metrics::Progress progress(stdout, spec.train.steps, spec.log.interval);
  TrainSummary summary;
  summary.run_dir = run_dir;
  const double t_start = NowSeconds();
  double ema_step = 0;
  const float dloss = 1.0f / (static_cast<float>(micro) * T * n_micro);
  for (int64_t step = 1; step <= spec.train.steps; ++step) {
    if (g_stop_signal.load()) break;
    const double t0 = NowSeconds();
    double data_s = 0, loss_sum = 0;
    gpt->ZeroGrad();
    for (int mb = 0; mb < n_micro; ++mb) {
      const double td = NowSeconds();
      const int64_t first = (step - 1) * spec.train.global_batch + static_cast<int64_t>(mb) * micro;
      MS_RETURN_IF_ERROR(FetchBatch(sampler, true, first, micro, T, &seq, &inputs, &targets));
      data_s += NowSeconds() - td;
      MS_ASSIGN_OR_RETURN(float l, gpt->Forward(inputs.data(), targets.data()));
      MS_RETURN_IF_ERROR(gpt->Backward(dloss));
      loss_sum += l;
    }
    const double loss = loss_sum / n_micro;
    if (!std::isfinite(loss)) return DataLoss("loss is {} at step {}; stopping (lower optimizer.lr?)", loss, step);
    const double lr = optim::LearningRate(spec.optimizer, step, spec.train.steps);
    auto norm_or = opt->Step(gpt->param_data(), gpt->grad_data(), step, lr);
    if (!norm_or.ok()) return norm_or.status();
    const double dt = NowSeconds() - t0;
    ema_step = step == 1 ? dt : 0.9 * ema_step + 0.1 * dt;
    const double tokens = static_cast<double>(spec.train.global_batch) * T;
    const double flops = flops_per_seq * spec.train.global_batch / dt;
    const double mfu = peak > 0 ? flops / peak : 0;
    if (step == 1) summary.first_loss = loss;
    summary.final_loss = loss;
    summary.steps_done = step;
    summary.tokens_per_second = tokens / dt;
    summary.mfu = mfu;
    metrics::JsonObject row;
    row.Add("phase", "train").Add("step", step).Add("loss", loss).Add("lr", lr).Add("grad_norm", *norm_or);
    row.Add("tokens_per_s", tokens / dt).Add("flops_per_s", flops).Add("mfu", mfu).Add("step_s", dt);
    row.Add("compute_s", dt - data_s).Add("comm_exposed_s", 0.0).Add("data_wait_s", data_s);
    MS_RETURN_IF_ERROR(jsonl.Write(row));
    if (options.progress) progress.Update(step, loss, tokens / dt, mfu, ema_step);
    if (step % spec.log.interval == 0 || step == 1) {
      LogFileOnly(fmt::format("step {} loss {:.4f} lr {:.3g} grad_norm {:.3f} {:.0f} tok/s", step, loss, lr, *norm_or,
                              tokens / dt));
    }
    const bool last = step == spec.train.steps;
    if ((spec.train.eval_interval > 0 && step % spec.train.eval_interval == 0) || last) {
      MS_ASSIGN_OR_RETURN(double vl, evaluate());
      if (vl >= 0) {
        summary.final_val_loss = vl;
        metrics::JsonObject ev;
        ev.Add("phase", "eval").Add("step", step).Add("val_loss", vl);
        MS_RETURN_IF_ERROR(jsonl.Write(ev));
        std::string line = fmt::format("step {}: validation loss {:.4f}", step, vl);
        if (options.progress) progress.Message(line);
        LogFileOnly(line);
      }
    }
  }
  if (options.progress) progress.Finish();
  summary.seconds = NowSeconds() - t_start;
  if (int sig = g_stop_signal.load()) {
    LogWarn("stopped by signal {} after step {}", sig, summary.steps_done);
    return Aborted("training stopped by signal {} after step {} of {}", sig, summary.steps_done, spec.train.steps);
  }
  LogInfo("done: {} steps in {}, loss {:.4f} -> {:.4f}, validation {:.4f}; run directory {}", summary.steps_done,
          metrics::Progress::FormatDuration(summary.seconds), summary.first_loss, summary.final_loss,
          summary.final_val_loss, run_dir);
  return summary;
}

}  // namespace ms::runner
