// The training loop of one rank: data, model shard, pipeline schedule, data-parallel engine,
// optimizer, metrics.
#include <omp.h>
#include <sys/resource.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <optional>
#include <string_view>
#include <vector>

#include "bootstrap/bootstrap.h"
#include "cuda/cuda.h"
#include "data/data.h"
#include "device/device.h"
#include "metrics/metrics.h"
#include "model/model.h"
#include "optim/optim.h"
#include "parallel/parallel.h"
#include "runner/checkpointing.h"
#include "runner/fault_injection.h"
#include "runner/heartbeat.h"
#include "runner/loader.h"
#include "runner/rank.h"
#include "runner/runner.h"
#include "runner/signals.h"

namespace ms::runner {
namespace {

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

// Point-to-point traffic of the pipeline: receives posted ahead of the compute that needs them, sends completed
// lazily (before their buffer is reused, and at the end of the step).
//
// On a communicator whose sends and receives run in issue order and match in issue order between a pair, each
// blocking the stream until its peer matches it (NCCL, p2p_in_order), posting a receive ahead of a send the peer
// needs first deadlocks (stage 0 queues R(grad 0), S(act 1) while stage 1 queues R(act 1), S(grad 0)), so does
// the 1F1B crossing of two sends once messages exceed NCCL's buffering, and an interleaved schedule receives
// from a peer in another order than the peer sends. There the pipeline follows parallel::PipelineP2pPlan: after
// each action the rank issues, one group per round (GroupP2p: ncclGroupStart/End), the sends and receives of
// every message sent in the rounds up to its next action, in the plan's order; receives are taken from those
// groups. With a communicator that orders itself after the compute stream (orders_after_compute) no host
// synchronization precedes a send or a receive; in a training step none follows one either where the communicator
// waits on the device (waits_on_device: the compute stream waits for the completion event; WaitAll drains). A
// receive buffer is then freed (at the next TakeRecv) while the compute that reads it may still be queued: the
// device's allocator reuses a block only after every stream of the device, NCCL's included, has passed its Free
// (lib/cuda/cuda_device.cpp), and a send's buffer is rewritten only after WaitSend. Test hook:
// MEGASCALE_PP_P2P=ungrouped keeps the Gloo order on such a communicator (what the emulated NCCL test shows
// deadlocking).
class PipeComm {
 public:
  // Receive buffers are memory of the backend's device (the pipeline communicator moves device buffers).
  PipeComm(comm::Communicator* pp, ops::Backend* backend, int64_t floats, metrics::Trace* trace)
      : pp_(pp), be_(backend), floats_(floats), trace_(trace) {
    const char* hook = std::getenv("MEGASCALE_PP_P2P");
    in_order_ = pp && pp->p2p_in_order() && !(hook && std::string_view(hook) == "ungrouped");
    device_ordered_ = pp && pp->orders_after_compute();
    device_waits_ = pp && pp->waits_on_device() && !trace;  // a trace's spans end when the host saw completion
  }
  // Whether the plan drives the traffic (and receives are not posted ahead by the caller).
  bool in_order() const { return in_order_; }
  void SetPlan(parallel::P2pPlan plan) { plan_ = std::move(plan); }
  // Before the step's first action: the groups of the rounds before it. Until WaitAll, receives and sends are
  // waited for on the device where the communicator can (comm::Work::WaitOnDevice), and WaitAll drains them.
  Status BeginStep() {
    in_step_ = true;
    if (!in_order_ || plan_.action_round.empty()) return Status::Ok();
    return IssueRounds(0, plan_.action_round[0]);
  }
  // After action i: its send (held back by Send) and every message of the rounds up to the next action.
  Status EndAction(size_t i) {
    if (!in_order_ || i >= plan_.action_round.size()) return Status::Ok();
    const int until =
        i + 1 < plan_.action_round.size() ? plan_.action_round[i + 1] : static_cast<int>(plan_.rounds.size());
    return IssueRounds(plan_.action_round[i], until);
  }
  // Whether a send needs the backend synchronized first.
  bool needs_sync() const { return !device_ordered_; }
  // kind 0: activation (forward), 1: gradient (backward); gchunk: the receiving global chunk.
  static int Tag(int kind, int micro, int gchunk) { return (kind * 4096 + micro) * 256 + gchunk; }
  Status PostRecv(int peer, int tag) {
    if (recvs_.count(tag)) return Status::Ok();
    PendingRecv r;
    MS_RETURN_IF_ERROR_CTX(r.buf.Allocate(be_, floats_), "pipeline receive buffer");
    if (!device_ordered_) MS_RETURN_IF_ERROR(be_->Synchronize());  // the buffer is zeroed before the transfer
    FlushSend();
    r.work = std::shared_ptr<comm::Work>(pp_->Recv(r.buf.data(), floats_, peer, tag));
    r.posted = NowSeconds();
    recvs_[tag] = std::move(r);
    return Status::Ok();
  }
  // Waits for the message and returns its buffer (valid until the next TakeRecv with the same tag).
  Result<const float*> TakeRecv(int peer, int tag) {
    MS_RETURN_IF_ERROR(PostRecv(peer, tag));
    auto& r = recvs_[tag];
    const double t0 = NowSeconds();
    Status s = WaitFor(*r.work);
    wait_s_ += NowSeconds() - t0;
    if (trace_) trace_->Span(fmt::format("recv tag {}", tag), "pp", r.posted, NowSeconds());
    MS_RETURN_IF_ERROR_CTX(s, "pipeline receive from rank {} (tag {})", peer, tag);
    held_ = std::move(r.buf);
    recvs_.erase(tag);
    return held_.data();
  }
  // Sends `floats_` floats; the buffer must stay unchanged until WaitSend(key) or WaitAll().
  void Send(const float* data, int peer, int tag, std::pair<int, int> key) {
    FlushSend();
    if (in_order_) {
      pending_ = PendingSend{data, peer, tag, key, NowSeconds()};
      return;
    }
    sends_[key].push_back({std::shared_ptr<comm::Work>(pp_->Send(data, floats_, peer, tag)), NowSeconds(), tag});
  }
  // A held-back send that no plan group took (evaluation's forward chain) goes alone.
  void FlushSend() {
    if (!pending_) return;
    sends_[pending_->key].push_back(
        {std::shared_ptr<comm::Work>(pp_->Send(pending_->data, floats_, pending_->peer, pending_->tag)),
         pending_->posted, pending_->tag});
    pending_.reset();
  }
  Status WaitSend(std::pair<int, int> key) {
    if (pending_ && pending_->key == key) FlushSend();
    auto it = sends_.find(key);
    if (it == sends_.end()) return Status::Ok();
    for (auto& s : it->second) MS_RETURN_IF_ERROR(Finish(s));
    sends_.erase(it);
    return Status::Ok();
  }
  Status WaitAll() {
    FlushSend();
    for (auto& [k, v] : sends_) {
      for (auto& s : v) MS_RETURN_IF_ERROR(Finish(s));
    }
    sends_.clear();
    in_step_ = false;
    if (!drain_) return Status::Ok();
    drain_ = false;
    // The bubble is the time the device waited (what completed by now; the rest counts in the next step).
    Status s = pp_->Drain();
    wait_s_ += pp_->TakeDeviceWaitSeconds();
    return s.WithContext("the step's pipeline sends and receives (waited for on the device)");
  }
  double wait_s() const { return wait_s_; }
  void reset_wait() { wait_s_ = 0; }

 private:
  struct Pending {
    std::shared_ptr<comm::Work> work;  // shared with a receive when grouped
    double posted;
    int tag;
  };
  struct PendingSend {
    const float* data;
    int peer;
    int tag;
    std::pair<int, int> key;
    double posted;
  };
  struct PendingRecv {
    model::DeviceArray<float> buf;
    std::shared_ptr<comm::Work> work;
    double posted = 0;
  };
  // Groups of rounds [from, until): the round's messages in the plan's order; the send is the held-back one.
  Status IssueRounds(int from, int until) {
    for (int t = from; t < until && t < static_cast<int>(plan_.rounds.size()); ++t) {
      const auto& msgs = plan_.rounds[static_cast<size_t>(t)];
      if (msgs.empty()) continue;
      std::vector<comm::P2pOp> ops;
      std::vector<int> recv_tags;
      std::optional<PendingSend> sent;
      for (const parallel::P2pMessage& m : msgs) {
        const int tag = Tag(m.kind, m.micro, m.gchunk);
        if (m.send) {
          if (!pending_ || pending_->tag != tag) {
            return Internal("pipeline plan: round {} sends tag {} but the action held {}", t, tag,
                            pending_ ? std::to_string(pending_->tag) : std::string("nothing"));
          }
          ops.push_back({true, const_cast<float*>(pending_->data), floats_, m.peer, tag});
          sent = pending_;
          pending_.reset();
        } else {
          PendingRecv r;
          MS_RETURN_IF_ERROR_CTX(r.buf.Allocate(be_, floats_), "pipeline receive buffer");
          if (!device_ordered_) MS_RETURN_IF_ERROR(be_->Synchronize());
          ops.push_back({false, r.buf.data(), floats_, m.peer, tag});
          r.posted = NowSeconds();
          recvs_[tag] = std::move(r);
          recv_tags.push_back(tag);
        }
      }
      std::shared_ptr<comm::Work> w(pp_->GroupP2p(ops));
      for (int tag : recv_tags) recvs_[tag].work = w;
      if (sent) sends_[sent->key].push_back({w, sent->posted, sent->tag});
    }
    return Status::Ok();
  }
  Status WaitFor(comm::Work& w) {
    const bool on_device = in_step_ && device_waits_;
    drain_ = drain_ || on_device;
    return on_device ? w.WaitOnDevice() : w.Wait();
  }
  Status Finish(Pending& s) {
    const double t0 = NowSeconds();
    Status st = WaitFor(*s.work);
    wait_s_ += NowSeconds() - t0;
    if (trace_) trace_->Span(fmt::format("send tag {}", s.tag), "pp", s.posted, NowSeconds());
    return st.WithContext(fmt::format("pipeline send (tag {})", s.tag));
  }
  comm::Communicator* pp_;
  ops::Backend* be_;
  int64_t floats_;
  metrics::Trace* trace_;
  bool in_order_ = false;
  bool device_ordered_ = false;
  bool device_waits_ = false;
  bool in_step_ = false;  // between BeginStep and WaitAll
  bool drain_ = false;    // something was waited for on the device since BeginStep
  std::map<int, PendingRecv> recvs_;
  std::map<std::pair<int, int>, std::vector<Pending>> sends_;
  std::optional<PendingSend> pending_;
  parallel::P2pPlan plan_;
  model::DeviceArray<float> held_;
  double wait_s_ = 0;
};

// A comm wrapper that times waits: the host's (tensor-parallel collectives are waited at once), and on NCCL in a
// training step the device's (comm::Communicator::TakeDeviceWaitSeconds).
class TimedComm : public comm::ForwardingCommunicator {
 public:
  explicit TimedComm(comm::Communicator* inner) : ForwardingCommunicator(inner) {}
  // The host's waits, and the device's (device waits: measured on the backend's stream, read once they ended).
  double wait_s() {
    wait_s_ += inner().TakeDeviceWaitSeconds();
    return wait_s_;
  }
  void reset() { wait_s_ = 0; }

 private:
  template <typename F>
  static Status TimedCall(double* acc, F&& f) {
    const double t0 = NowSeconds();
    Status s = f();
    *acc += NowSeconds() - t0;
    return s;
  }
  class TimedWork : public comm::Work {
   public:
    TimedWork(std::unique_ptr<comm::Work> w, double* acc) : w_(std::move(w)), acc_(acc) {}
    Status Wait() override {
      return TimedCall(acc_, [&] { return w_->Wait(); });
    }
    Status WaitOnDevice() override {
      return TimedCall(acc_, [&] { return w_->WaitOnDevice(); });
    }

   private:
    std::unique_ptr<comm::Work> w_;
    double* acc_;
  };
  std::unique_ptr<comm::Work> Wrap(std::unique_ptr<comm::Work> w, const char*, double) override {
    return std::make_unique<TimedWork>(std::move(w), &wait_s_);
  }
  double wait_s_ = 0;
};

}  // namespace

Status DumpParams(const model::Gpt& gpt, const std::string& dir, int rank) {
  MS_RETURN_IF_ERROR(MakeDirs(dir));
  std::string index = "[";
  for (const auto& p : gpt.params()) {
    auto shape = [](const std::vector<int64_t>& s) {
      std::string o;
      for (auto d : s) o += (o.empty() ? "" : ", ") + std::to_string(d);
      return "[" + o + "]";
    };
    static const char* kinds[] = {"replicated", "rows", "cols", "qkv_rows"};
    index += fmt::format(
        "{}\n  {{\"name\": \"{}\", \"shard\": \"{}\", \"global_shape\": {}, \"local_shape\": {}, "
        "\"offset\": {}, \"numel\": {}, \"tp_size\": {}, \"tp_rank\": {}, \"tied_replica\": {}}}",
        index.size() > 1 ? "," : "", p.name, kinds[static_cast<int>(p.shard)], shape(p.global_shape),
        shape(p.local_shape), p.offset, p.numel, gpt.shard().tp_size, gpt.shard().tp_rank,
        p.tied_replica ? "true" : "false");
  }
  index += "\n]\n";
  MS_RETURN_IF_ERROR(WriteFileAtomic(fmt::format("{}/rank-{}.json", dir, rank), index));
  std::vector<float> host(static_cast<size_t>(gpt.num_params()));
  MS_RETURN_IF_ERROR(gpt.backend()->CopyToHost(host.data(), gpt.param_data(), sizeof(float) * host.size()));
  return WriteFileAtomic(fmt::format("{}/rank-{}.f32", dir, rank),
                         std::string_view(reinterpret_cast<const char*>(host.data()), sizeof(float) * host.size()));
}

int DeviceOrdinal(const Runtime& rt) {
  return rt.host.local_rank >= 0 ? rt.host.local_rank : 0;
}

std::unique_ptr<Runtime> SingleRankRuntime() {
  auto rt = std::make_unique<Runtime>();
  rt->host.name = HostName();
  rt->host.ranks = {0};
  rt->host.cpus_per_rank = cluster::CpusPerRank(1);
  rt->tp = comm::MakeSelfCommunicator();
  rt->pp = comm::MakeSelfCommunicator();
  rt->dp = comm::MakeSelfCommunicator();
  rt->world_comm = comm::MakeSelfCommunicator();
  return rt;
}

Result<TrainSummary> Train(const config::JobSpec& spec, const TrainOptions& options, Runtime& rt) {
  const auto& m = spec.model;
  const auto& par = spec.parallel;
  const int T = m.seq_len;
  const int micro = spec.train.micro_batch;
  const int n_micro = par.micro_batches;
  const bool rank0 = rt.rank == 0;
  const int threads = spec.runtime.threads > 0 ? spec.runtime.threads : std::max(1, rt.host.cpus_per_rank);
  omp_set_num_threads(threads);

  // Data first: a bad dataset fails before any output is written.
  auto tokenizer_or = data::LoadTokenizer(spec.data.tokenizer, spec.data.path);
  if (!tokenizer_or.ok()) return tokenizer_or.status().WithContext(fmt::format("{}: data.tokenizer", spec.source));
  auto tokenizer = std::move(tokenizer_or).value();
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

  // The checkpoint to start from was chosen (and verified) by the driver before launch.
  const int64_t resume_step = options.resume_step;
  // Run directory.
  const std::string& run_dir = spec.log.run_dir;
  MS_RETURN_IF_ERROR_CTX(MakeDirs(run_dir), "creating run directory log.run_dir={}", run_dir);
  if (rank0) MS_RETURN_IF_ERROR(WriteFileAtomic(run_dir + "/job.yaml", config::ToYaml(spec)));
  if (rt.world > 1) {
    MS_RETURN_IF_ERROR(MakeDirs(run_dir + "/logs"));
    MS_RETURN_IF_ERROR(SetLogFile(fmt::format("{}/logs/rank-{}.log", run_dir, rt.rank)));
  } else {
    MS_RETURN_IF_ERROR(SetLogFile(run_dir + "/train.log"));
  }
  struct CloseLog {
    ~CloseLog() { SetLogFile("").IgnoreError(); }
  } close_log;
  LogFileOnly(
      fmt::format("rank {} of {} on host {} (node {} of {}, local rank {} of {}), pid {}, {} threads, megascale {}",
                  rt.rank, rt.world, rt.host.name, rt.host.index, rt.host.num_hosts, rt.host.local_rank,
                  rt.host.local_world, getpid(), threads, Version()));

  metrics::Trace trace(rt.rank);
  trace.set_enabled(spec.log.trace);

  // Model shard, data-parallel engine, optimizer.
  MS_ASSIGN_OR_RETURN(Compute compute, MakeCompute(spec, rt));  // may swap the communicators for NCCL ones
  TimedComm tp_timed(rt.tp.get());
  ProgressBoard* board = rt.board.get();  // null without heartbeats
  auto set_phase = [board](Phase p) {
    if (board) board->SetPhase(p);
  };
  const double slow_factor = SlowFactor(rt.rank);  // test hook: a straggler
  device::Device* device = compute.device.get();
  model::ShardSpec shard;
  shard.tp_size = par.tp;
  shard.tp_rank = rt.tp_rank;
  shard.pp_size = par.pp;
  shard.pp_rank = rt.pp_rank;
  shard.virtual_stages = par.virtual_stages;
  shard.sequence_parallel = par.sequence_parallel;
  shard.tp_comm_chunks = par.tp_comm_chunks;
  shard.tp_reduce_bf16 = par.tp_reduce_dtype == "bf16";
  shard.fused_kernels = spec.runtime.fused_kernels;
  shard.bf16_fc = spec.runtime.activations == "bf16";
  shard.gemm_epilogues = spec.runtime.gemm_epilogues;
  shard.placed_grads = par.zero == 2;  // ZeRO-2's gradient windows (parallel::DataParallel)
  model::ModelComms mcomms;
  if (par.tp > 1) mcomms.tp = &tp_timed;
  MS_ASSIGN_OR_RETURN(auto gpt,
                      model::Gpt::Create(m, shard, micro, spec.train.seed, device, mcomms, compute.backend.get()));
  if (shard.bf16_fc) LogInfo("runtime.activations: bf16 — kept in bf16: {}", gpt->bf16_activations());
  if (shard.tp_reduce_bf16 && par.tp > 1) {
    LogInfo(
        "parallel.tp_reduce_dtype: bf16 — the layers' tensor-parallel sums travel and add in bf16 (half the bytes)");
  }
  if (spec.log.trace && par.tp > 1) {  // TP collectives and the GEMM chunks they overlap with
    gpt->set_span_hook([&trace](std::string_view what, std::string_view lane, double t0, double t1) {
      trace.Span(what, lane, t0, t1);
    });
  }
  bool graphs_on = false;
  if (spec.runtime.cuda_graphs) {
    const std::string why = gpt->EnableGraphs(true);
    graphs_on = why.empty();
    if (!why.empty()) {
      if (rt.rank == 0) LogWarn("runtime.cuda_graphs: not used: {}; the ops are launched one by one", why);
    } else if (rt.rank == 0) {
      LogInfo(
          "runtime.cuda_graphs: each micro-batch slot's forward and backward recorded once, then launched as CUDA "
          "graphs (cut at the layers' hooks, which run between them)");
    }
  }
  parallel::DataParallelOptions dpo;
  dpo.zero = par.zero;
  dpo.bucket_floats = std::max<int64_t>(1, static_cast<int64_t>(par.bucket_mb * 1e6 / sizeof(float)));
  dpo.overlap = par.overlap;
  dpo.device_waits = !spec.log.trace;  // a trace's spans end when the host saw each collective complete
  dpo.on_comm_span = [&trace](const std::string& what, double t0, double t1) { trace.Span(what, "dp", t0, t1); };
  MS_ASSIGN_OR_RETURN(auto dpe, parallel::DataParallel::Create(gpt.get(), rt.dp.get(), rt.embedding.get(), dpo));
  MS_ASSIGN_OR_RETURN(auto opt, optim::Optimizer::Create(spec.optimizer, gpt->params(), dpe->segments(),
                                                         model::AllTensorNames(m), gpt->backend()));
  optim::Reducer reduce_world = [&](std::vector<double>* v) -> Status {
    if (rt.world == 1) return Status::Ok();
    return rt.world_comm->AllReduce(v->data(), static_cast<int64_t>(v->size()), comm::ReduceOp::kSum)->Wait();
  };
  MS_ASSIGN_OR_RETURN(auto schedule, parallel::PipelineSchedule(par.pp, rt.pp_rank, par.virtual_stages, n_micro));
  const int slots = parallel::MaxInFlight(schedule, par.virtual_stages);
  PipeComm pipe(rt.pp.get(), gpt->backend(), gpt->boundary_floats(), spec.log.trace ? &trace : nullptr);
  if (pipe.in_order()) {
    MS_ASSIGN_OR_RETURN(auto plan, parallel::PipelineP2pPlan(par.pp, rt.pp_rank, par.virtual_stages, n_micro));
    pipe.SetPlan(std::move(plan));
  }
  const int next_rank = (rt.pp_rank + 1) % par.pp, prev_rank = (rt.pp_rank + par.pp - 1) % par.pp;

  const double flops_per_seq = model::TrainingFlopsPerSequence(m);
  // The peak of one device: configured, a GPU's datasheet, or a measured GEMM (cached per host on the CPU).
  MS_ASSIGN_OR_RETURN(DevicePeak device_peak, ResolvePeak(spec, compute, threads));
  const double peak = device_peak.flops;
  const std::string& peak_source = device_peak.source;
  if (rank0) {
    int64_t n_params = 0;
    for (const auto& p : gpt->params()) n_params += p.tied_replica ? 0 : p.numel;
    LogInfo(
        "job {}: {} layers ({} block, window {}), layout tp={} pp={} dp={} (virtual stages {}, sequence parallel "
        "{}, zero {}), {} threads per rank, global batch {} = {} x {} micro-batches x dp {}; rank 0 holds {} "
        "parameters",
        spec.name, m.layers, config::Name(m.block), m.window, par.tp, par.pp, par.dp, par.virtual_stages,
        par.sequence_parallel ? "on" : "off", par.zero, threads, spec.train.global_batch, micro, n_micro, par.dp,
        n_params);
    if (par.zero == 2) {
      LogInfo(
          "zero 2: no gradient buffer: rank 0's gradients live in {} window{} its {} buckets take in turn through "
          "backward (and buffers of their own for a tied wte and deferred buckets): {:.2f} MB where the parameters' "
          "gradients would take {:.2f} MB",
          dpe->gradient_windows(), dpe->gradient_windows() == 1 ? "" : "s", dpe->num_buckets(),
          dpe->gradient_floats() * sizeof(float) / 1e6, gpt->num_params() * sizeof(float) / 1e6);
      if (dpe->gradient_floats() >= gpt->num_params()) {
        LogWarn(
            "parallel.zero: 2 saves no gradient memory here: its windows take as much as the gradients, since "
            "three layers touch nearly every bucket; use parallel.zero: 1, or a smaller parallel.bucket_mb ({}) for "
            "more buckets (docs/job-spec.md)",
            par.bucket_mb);
      }
    }
    if (par.zero >= 1) {
      LogInfo("zero {}: rank 0's data-parallel buffers hold {:.2f} MB beside the model; {} of {} buckets staged{}",
              par.zero, dpe->buffer_floats() * sizeof(float) / 1e6, dpe->staged_buckets(), dpe->num_buckets(),
              par.zero == 1 ? " (the others reduce-scatter from the gradients and gather in place)" : "");
    }
    if (dpe->bf16_gather_buckets() > 0) {
      LogInfo(
          "zero {}: rank 0's parameter all-gathers move the bf16 weight copies in {} of {} buckets ({} floats of "
          "norms, biases and embeddings in fp32 beside them)",
          par.zero, dpe->bf16_gather_buckets(), dpe->num_buckets(), dpe->fp32_beside_bf16_floats());
    }
    LogInfo("data {}: {} tokens, {} train / {} validation samples of {} tokens; peak {:.1f} GFLOP/s per rank ({})",
            spec.data.path, ds.num_tokens(), sampler.num_train(), sampler.num_valid(), T, peak / 1e9, peak_source);
  }

  // Which inputs a chunk needs: tokens for the embedding chunk, targets for the head chunk.
  std::vector<int32_t> seq, inputs(static_cast<size_t>(micro) * T), targets(inputs.size());

  // Forward-only pass over the validation split (each dp rank its own eval_batches micro-batches).
  auto evaluate = [&]() -> Result<double> {
    set_phase(Phase::kEval);
    if (sampler.num_valid() == 0) return -1.0;
    MS_RETURN_IF_ERROR(dpe->WaitAllParams());
    double sum = 0;
    for (int b = 0; b < spec.train.eval_batches; ++b) {
      const int64_t first = (static_cast<int64_t>(rt.dp_rank) * spec.train.eval_batches + b) * micro;
      MS_RETURN_IF_ERROR(FetchBatch(sampler, false, first, micro, T, &seq, &inputs, &targets));
      for (int c = 0; c < gpt->num_chunks(); ++c) {
        const int g = gpt->global_chunk(c);
        const float* x_in = nullptr;
        if (!gpt->has_embedding(c)) {
          MS_ASSIGN_OR_RETURN(x_in, pipe.TakeRecv(prev_rank, PipeComm::Tag(2, b, g)));
        }
        MS_ASSIGN_OR_RETURN(float l, gpt->ForwardChunk(c, 0, inputs.data(), targets.data(), x_in));
        if (gpt->has_head(c)) {
          sum += l;
        } else {
          MS_RETURN_IF_ERROR(pipe.WaitSend({c, 0}));
          MS_RETURN_IF_ERROR(gpt->backend()->Synchronize());
          pipe.Send(gpt->ChunkOutput(c, 0), next_rank, PipeComm::Tag(2, b, g + 1), {c, 0});
          MS_RETURN_IF_ERROR(pipe.WaitSend({c, 0}));
        }
      }
    }
    const bool reporter = gpt->has_head(gpt->num_chunks() - 1) && rt.tp_rank == 0;
    std::vector<double> v{reporter ? sum / spec.train.eval_batches : 0.0};
    MS_RETURN_IF_ERROR(reduce_world(&v));
    return v[0] / par.dp;
  };

  // Checkpoints: the writer, and the restore of the newest valid one when resuming.
  HostStaging ckpt_staging;
  checkpoint::CheckpointerOptions co;
  co.dir = spec.checkpoint.dir;
  co.rank = rt.rank;
  co.layout = {par.tp, par.pp, par.dp};
  co.keep = spec.checkpoint.keep;
  co.policy = checkpoint::OverlapPolicy::kWait;
  co.coordination_timeout_s = spec.checkpoint.coordination_timeout_s;
  if (spec.checkpoint.interval > 0) {
    // Allocate (and fault in) the snapshot memory now, so the first checkpoint blocks as little as the rest.
    MS_ASSIGN_OR_RETURN(auto sizes, RankPieces(*gpt, *opt, rt.dp_rank, &ckpt_staging, /*stage=*/false));
    for (const auto& piece : sizes) co.reserve_bytes += (piece.end - piece.begin) * 4;
  }
  std::shared_ptr<checkpoint::Coordinator> coordinator = rt.coordinator;
  if (!coordinator) coordinator = std::make_shared<checkpoint::InProcessCoordinator>();
  MS_ASSIGN_OR_RETURN(auto checkpointer, checkpoint::AsyncCheckpointer::Create(co, coordinator.get()));
  int64_t start_step = 1;
  DataPosition position;
  position.global_batch = spec.train.global_batch;
  position.micro = micro;
  position.n_micro = n_micro;
  if (resume_step >= 0) {
    const double tr = NowSeconds();
    MS_ASSIGN_OR_RETURN(auto ckpt, checkpoint::Checkpoint::Open(
                                       fmt::format("{}/{}", spec.checkpoint.dir, checkpoint::StepDirName(resume_step)),
                                       checkpoint::Verify::kLazy));
    MS_RETURN_IF_ERROR(RestoreRank(ckpt, *gpt, *opt, rt));
    start_step = resume_step + 1;
    // The data position: checkpoints record the training samples consumed so far (older ones did not:
    // then it is the steps times this run's global batch).
    const std::string consumed = MetadataValue(ckpt.metadata(0), "consumed_samples");
    position.consumed_samples = consumed.empty() ? resume_step * spec.train.global_batch : std::stoll(consumed);
    if (rank0) {
      LogInfo("resumed from {} (step {}, saved under layout {}, now tp{}.pp{}.dp{}) in {:.2f} s", ckpt.dir(),
              resume_step, MetadataValue(ckpt.metadata(0), "layout"), par.tp, par.pp, par.dp, NowSeconds() - tr);
    }
  }

  // The batches: this rank's reader of the host's shared loader, or its own sampler (data.loader).
  position.start_step = start_step;
  const bool needs_tokens = rt.pp_rank == 0 || rt.pp_rank == par.pp - 1;  // embedding or head chunk
  MS_ASSIGN_OR_RETURN(auto batches, MakeBatchSource(spec, rt, sampler, position, needs_tokens));
  std::vector<int64_t> sample_ids(static_cast<size_t>(micro));
  std::FILE* sample_log = nullptr;  // MEGASCALE_LOG_SAMPLES=1: the sample index of every row this rank trains on
  if (GetEnv("MEGASCALE_LOG_SAMPLES").value_or("") == "1" && needs_tokens) {
    MS_RETURN_IF_ERROR(MakeDirs(run_dir + "/samples"));
    const std::string path = fmt::format("{}/samples/rank-{}.txt", run_dir, rt.rank);
    sample_log = std::fopen(path.c_str(), "a");
    if (!sample_log) return ErrnoError(fmt::format("opening {}", path), errno);
  }
  struct CloseSampleLog {
    std::FILE* f;
    ~CloseSampleLog() {
      if (f) std::fclose(f);
    }
  } close_sample_log{sample_log};

  InjectDelay("train_start", rt.rank);  // test hook: a long start-up
  const double model_ready = WallSeconds();

  // Appends: a resumed run continues the metrics of the run it continues, and a fresh run's driver
  // has kept any earlier metrics.jsonl under another name (history is never truncated).
  std::optional<metrics::JsonlWriter> jsonl;
  if (rank0) {
    MS_ASSIGN_OR_RETURN(auto w, metrics::JsonlWriter::Open(run_dir + "/metrics.jsonl", /*append=*/true));
    jsonl.emplace(std::move(w));
  }

  metrics::Progress progress(stdout, spec.train.steps, spec.log.interval);
  const bool show = options.progress && rank0;
  TrainSummary summary;
  summary.run_dir = run_dir;
  const double t_start = NowSeconds();
  double ema_step = 0;
  const float dloss = 1.0f / (static_cast<float>(spec.train.global_batch) * T);
  // What every rank must act on at the same step: each flag is reduced on its own (max), so one
  // rank's SIGUSR1 never hides another's SIGTERM.
  enum Flag { kInterrupt, kTerminate, kSave, kCheckpointsFailing, kNumFlags };
  int64_t saves_seen = 0, saves_done = 0;  // SIGUSR1 requests: received here, and acted on by the job
  bool stop_interrupt = false, stop_terminate = false;
  int failed_in_row = 0;  // consecutive failed checkpoints (rank 0's count decides)
  Status last_ckpt_error, last_outcome;
  // Rank 0 records the fate of every checkpoint write that ended (committed or failed): in
  // metrics.jsonl, and on the console when it failed.
  auto record_outcomes = [&](const std::vector<checkpoint::WriteOutcome>& outcomes) -> Status {
    for (const auto& w : outcomes) {
      last_outcome = w.status;
      if (!w.status.ok()) {
        ++failed_in_row;
        last_ckpt_error = w.status;
      } else {
        failed_in_row = 0;
      }
      if (!rank0) continue;
      metrics::JsonObject ev;
      ev.Add("phase", "checkpoint").Add("step", w.step).AddTime("unix_s", WallSeconds());
      ev.Add("status", w.status.ok() ? "committed" : "failed");
      ev.Add("write_s", w.seconds);
      if (!w.status.ok()) ev.Add("error", w.status.message());
      MS_RETURN_IF_ERROR(jsonl->Write(ev));
      if (w.status.ok()) {
        LogFileOnly(fmt::format("checkpoint step {} committed ({:.2f} s)", w.step, w.seconds));
      } else {
        std::string line = fmt::format("checkpoint step {} FAILED ({} in a row{}): {}", w.step, failed_in_row,
                                       spec.checkpoint.max_failures > 0
                                           ? fmt::format(", the job stops at {}", spec.checkpoint.max_failures)
                                           : std::string(),
                                       w.status.message());
        if (show) {
          progress.Message(line);
          LogFileOnly(line);
        } else {
          LogError("{}", line);
        }
      }
    }
    return Status::Ok();
  };
  double loss_average = 0;  // of the recent steps, for fault.loss_spike_factor
  int64_t loss_history = 0;
  for (int64_t step = start_step; step <= spec.train.steps; ++step) {
    const double t0 = NowSeconds(), waited0 = ThreadWaitedSeconds();
    if (board) board->SetStep(step);
    InjectHang(rt.rank, step);  // test hook: a rank that stops making progress
    double data_s = 0, loss_sum = 0;
    pipe.reset_wait();
    tp_timed.reset();
    dpe->ResetStats();
    MS_RETURN_IF_ERROR(dpe->BeginStep());
    MS_RETURN_IF_ERROR(pipe.BeginStep());
    gpt->BeginStep();  // the parameters stay as they are until EndStep (bf16 weight copies are kept for the step)
    // The head's losses stay on the device until the step's micro-batches are done (no wait per micro-batch).
    const bool head_rank = gpt->has_head(gpt->num_chunks() - 1);
    if (head_rank) MS_RETURN_IF_ERROR(gpt->BeginDeferredLosses(n_micro, dloss));
    for (size_t ai = 0; ai < schedule.size(); ++ai) {
      const parallel::Action& a = schedule[ai];
      // Post the receive the next action needs before computing this one (parallel.pp_overlap).
      if (par.pp_overlap && !pipe.in_order() && ai + 1 < schedule.size()) {
        const parallel::Action& nx = schedule[ai + 1];
        const int g = gpt->global_chunk(nx.chunk);
        if (nx.kind == parallel::ActionKind::kForward && !gpt->has_embedding(nx.chunk)) {
          MS_RETURN_IF_ERROR(pipe.PostRecv(prev_rank, PipeComm::Tag(0, nx.micro, g)));
        } else if (nx.kind == parallel::ActionKind::kBackward && !gpt->has_head(nx.chunk)) {
          MS_RETURN_IF_ERROR(pipe.PostRecv(next_rank, PipeComm::Tag(1, nx.micro, g)));
        }
      }
      const int c = a.chunk, g = gpt->global_chunk(c), slot = a.micro % slots;
      const bool needs_tokens = gpt->has_embedding(c) || gpt->has_head(c);
      if (a.kind == parallel::ActionKind::kForward) {
        if (needs_tokens) {
          set_phase(Phase::kData);
          const double td = NowSeconds();
          MS_RETURN_IF_ERROR(batches->Fetch(step, a.micro, inputs.data(), targets.data(), sample_ids.data()));
          data_s += NowSeconds() - td;
          if (sample_log && rt.tp_rank == 0 && gpt->has_embedding(c)) {
            for (int i = 0; i < micro; ++i) {
              std::fprintf(sample_log, "%lld %d %d %d %lld\n", static_cast<long long>(step), rt.dp_rank, a.micro, i,
                           static_cast<long long>(sample_ids[static_cast<size_t>(i)]));
            }
          }
        }
        const float* x_in = nullptr;
        if (!gpt->has_embedding(c)) {
          MS_ASSIGN_OR_RETURN(x_in, pipe.TakeRecv(prev_rank, PipeComm::Tag(0, a.micro, g)));
        }
        MS_RETURN_IF_ERROR(pipe.WaitSend({c, slot}));  // the slot's last output must have left
        set_phase(Phase::kForward);
        const double tf = NowSeconds();
        double layer_t = tf;
        int layer_prev = -2;
        auto before = [&](int layer) -> Status {
          const double now = NowSeconds();
          if (layer_prev != -2)
            trace.Span(fmt::format("fwd mb{} layer {}", a.micro, layer_prev), "compute", layer_t, now);
          layer_prev = layer;
          layer_t = now;
          return dpe->WaitParams(layer);
        };
        // The head chunk's loss is deferred (0 here): TakeDeferredLosses below.
        MS_RETURN_IF_ERROR(gpt->ForwardChunk(c, slot, inputs.data(), targets.data(), x_in, before).status());
        trace.Span(fmt::format("fwd mb{} layer {}", a.micro, layer_prev), "compute", layer_t, NowSeconds());
        if (slow_factor > 1) BurnCpu((slow_factor - 1) * (NowSeconds() - tf));
        if (!gpt->has_head(c)) {
          if (pipe.needs_sync()) MS_RETURN_IF_ERROR(gpt->backend()->Synchronize());
          pipe.Send(gpt->ChunkOutput(c, slot), next_rank, PipeComm::Tag(0, a.micro, g + 1), {c, slot});
        }
      } else {
        const float* dout = nullptr;
        if (!gpt->has_head(c)) {
          MS_ASSIGN_OR_RETURN(dout, pipe.TakeRecv(next_rank, PipeComm::Tag(1, a.micro, g)));
        }
        MS_RETURN_IF_ERROR(pipe.WaitSend({-1 - c, slot}));  // the slot's last input gradient must have left
        set_phase(Phase::kBackward);
        const double tb = NowSeconds();
        double layer_t = tb;
        auto done = [&](int layer) {
          const double now = NowSeconds();
          trace.Span(fmt::format("bwd mb{} layer {}", a.micro, layer), "compute", layer_t, now);
          layer_t = now;
          dpe->OnLayerDone(layer, a.micro, n_micro);
        };
        MS_RETURN_IF_ERROR(dpe->BeforeBackward(c));
        MS_RETURN_IF_ERROR(gpt->BackwardChunk(c, slot, dout, dloss, done));
        if (slow_factor > 1) BurnCpu((slow_factor - 1) * (NowSeconds() - tb));
        MS_RETURN_IF_ERROR(dpe->EndMicroBatch(a.micro, n_micro));
        if (!gpt->has_embedding(c)) {
          if (pipe.needs_sync()) MS_RETURN_IF_ERROR(gpt->backend()->Synchronize());
          pipe.Send(gpt->InputGrad(c, slot), prev_rank, PipeComm::Tag(1, a.micro, g - 1), {-1 - c, slot});
        }
      }
      MS_RETURN_IF_ERROR(pipe.EndAction(ai));
    }
    MS_RETURN_IF_ERROR(pipe.WaitAll());
    MS_RETURN_IF_ERROR(gpt->EndStep());
    if (head_rank) {
      // Each micro-batch's mean, in the order the head ran them (the sum of the undeferred losses, bit for bit).
      // A non-finite loss is handled once the ranks have agreed on it (fault.nan_policy).
      MS_ASSIGN_OR_RETURN(const std::vector<float> micro_losses, gpt->TakeDeferredLosses());
      for (float l : micro_losses) loss_sum += l;
    }
    MS_RETURN_IF_ERROR(gpt->ReduceSequenceParallelGrads());
    MS_RETURN_IF_ERROR(dpe->FinishBackward());
    if (InjectNan(rt.rank, step)) {  // test hook: a NaN in this rank's gradient
      const auto& segs = opt->segments();
      auto data = dpe->segment_data();
      for (size_t i = 0; i < segs.size(); ++i) {
        if (!segs[i].count || segs[i].len == 0) continue;
        const float nan = std::numeric_limits<float>::quiet_NaN();
        MS_RETURN_IF_ERROR(gpt->backend()->CopyFromHost(data[i].grad, &nan, sizeof nan));
        MS_RETURN_IF_ERROR(gpt->backend()->Synchronize());
        break;
      }
    }
    // The loss lives on the last pipeline stage: sum it over the world from one rank per dp replica.
    // Every rank learns it (and the gradient norm) before any parameter changes, so all agree on a fault.
    const bool reporter = gpt->has_head(gpt->num_chunks() - 1) && rt.tp_rank == 0;
    std::vector<double> agg{reporter ? loss_sum / n_micro : 0.0};
    MS_RETURN_IF_ERROR(reduce_world(&agg));
    const double loss = agg[0] / par.dp;
    const double lr = optim::LearningRate(spec.optimizer, step, spec.train.steps);
    set_phase(Phase::kOptimizer);
    const double t_opt = NowSeconds();
    Result<double> norm_or = std::isfinite(loss) ? opt->Step(dpe->segment_data(), step, lr, reduce_world)
                                                 : Result<double>(DataLoss("loss is {}", loss));
    std::string numeric_fault;  // non-finite loss or gradient norm: the parameters were left unchanged
    if (!norm_or.ok()) {
      if (norm_or.status().code() != Code::kDataLoss) return norm_or.status();
      numeric_fault = fmt::format("non-finite {} at step {} ({})", std::isfinite(loss) ? "gradient norm" : "loss", step,
                                  norm_or.status().message());
    }
    if (numeric_fault.empty() && spec.fault.loss_spike_factor > 0 && loss_history > 10 &&
        loss > spec.fault.loss_spike_factor * loss_average) {
      const std::string spike = fmt::format("loss spike at step {}: {:.4f}, {:.1f} x its recent average {:.4f}", step,
                                            loss, loss / loss_average, loss_average);
      if (spec.fault.spike_policy == "rollback") {
        numeric_fault = spike;
      } else if (rank0) {
        LogWarn("{} (fault.spike_policy: warn)", spike);
        metrics::JsonObject ev;
        ev.Add("phase", "fault").Add("kind", "loss_spike").Add("step", step).Add("loss", loss);
        ev.Add("average", loss_average).Add("action", "warn");
        MS_RETURN_IF_ERROR(jsonl->Write(ev));
      }
    }
    if (!numeric_fault.empty()) {
      const std::string& policy =
          numeric_fault.find("spike") != std::string::npos ? spec.fault.spike_policy : spec.fault.nan_policy;
      if (rank0) {
        metrics::JsonObject ev;
        ev.Add("phase", "fault").Add("kind", numeric_fault.find("spike") != std::string::npos ? "loss_spike" : "nan");
        ev.Add("step", step).Add("detail", numeric_fault).Add("action", policy);
        MS_RETURN_IF_ERROR(jsonl->Write(ev));
      }
      if (policy == "skip") {
        if (rank0) LogWarn("{}: step skipped, parameters unchanged (fault.nan_policy: skip)", numeric_fault);
        norm_or = std::numeric_limits<double>::quiet_NaN();
      } else {
        // rollback: every rank stops here (they all saw the same numbers) and the driver restarts
        // the job from the newest checkpoint; stop: the job ends.
        if (rank0 && rt.store) {
          rt.store->Set("fault/note", numeric_fault).IgnoreError();  // best effort: the driver's diagnosis
        }
        if (rank0) LogError("{} (policy: {})", numeric_fault, policy);
        MS_RETURN_IF_ERROR(dpe->WaitAllParams());
        checkpointer->Wait().IgnoreError();
        summary.steps_done = step - 1;
        summary.end = policy == "rollback" ? JobEnd::kRollback : JobEnd::kStoppedByPolicy;
        if (!rt.store) {  // one rank, no driver to restart it
          return DataLoss(
              "{}; stopping (fault.nan_policy {} needs a multi-rank job's driver to restart; lower "
              "optimizer.lr?)",
              numeric_fault, policy);
        }
        return summary;
      }
    } else {
      loss_average = loss_history == 0 ? loss : 0.9 * loss_average + 0.1 * loss;
      ++loss_history;
    }
    if (norm_or.ok() && std::isfinite(*norm_or)) dpe->OptimizerStepped();  // the step updated the parameters
    MS_RETURN_IF_ERROR(dpe->StartParamGather());
    trace.Span(fmt::format("optimizer step {}", step), "compute", t_opt, NowSeconds());
    const double dt = NowSeconds() - t0;
    ema_step = step == 1 ? dt : 0.9 * ema_step + 0.1 * dt;
    const double tokens = static_cast<double>(spec.train.global_batch) * T;
    const double flops = flops_per_seq * spec.train.global_batch / dt;
    const double mfu = peak > 0 ? flops / (peak * rt.world) : 0;
    const double comm_exposed = dpe->stats().dp_wait_s + tp_timed.wait_s();
    if (board) {  // every wait of this thread in a collective or transfer counts as communication
      const double waited = ThreadWaitedSeconds() - waited0;
      board->RecordStep(step, dt, std::max(0.0, dt - data_s - waited), waited);
    }
    if (step == start_step) summary.first_loss = loss;
    summary.final_loss = loss;
    summary.steps_done = step;
    summary.tokens_per_second = tokens / dt;
    summary.mfu = mfu;
    if (rank0) {
      metrics::JsonObject row;
      row.Add("phase", "train").Add("step", step).AddTime("unix_s", WallSeconds()).Add("loss", loss).Add("lr", lr);
      row.Add("grad_norm", *norm_or);
      row.Add("tokens_per_s", tokens / dt).Add("flops_per_s", flops).Add("mfu", mfu).Add("step_s", dt);
      row.Add("compute_s", dt - data_s - comm_exposed - pipe.wait_s()).Add("comm_exposed_s", comm_exposed);
      row.Add("bubble_s", pipe.wait_s()).Add("data_wait_s", data_s);
      row.Add("dp_collectives", dpe->stats().dp_launched)
          .Add("dp_launched_during_backward", dpe->stats().dp_launched_during_backward);
      // The CUDA backend's peak device memory so far on rank 0 (its caching allocator; absent on the CPU backend).
      if (const size_t peak_mem = cuda::GetAllocatorStats(*device).peak_in_use; peak_mem > 0) {
        row.Add("device_mem_peak_mib", static_cast<double>(peak_mem) / 1048576.0);
      }
      MS_RETURN_IF_ERROR(jsonl->Write(row));
      if (show) progress.Update(step, loss, tokens / dt, mfu, ema_step);
      if (step % spec.log.interval == 0 || step == 1) {
        LogFileOnly(fmt::format("step {} loss {:.4f} lr {:.3g} grad_norm {:.3f} {:.0f} tok/s", step, loss, lr, *norm_or,
                                tokens / dt));
      }
    }
    if (step == start_step && rank0) {
      // How long start-up took: the driver's and rank 0's milestones (wall clock), then the first step.
      // Seconds since the driver started (the first milestone), which is given in Unix milliseconds.
      metrics::JsonObject row;
      row.Add("phase", "startup").Add("step", step);
      auto marks = rt.startup;
      marks.emplace_back("model_ready", model_ready);
      marks.emplace_back("first_step_done", WallSeconds());
      const double origin = marks.front().second;
      row.Add("origin_unix_ms", static_cast<int64_t>(origin * 1000));
      for (const auto& [name, t] : marks) row.Add(name + "_s", t - origin);
      MS_RETURN_IF_ERROR(jsonl->Write(row));
    }
    const bool last = step == spec.train.steps;
    if ((spec.train.eval_interval > 0 && step % spec.train.eval_interval == 0) || last) {
      MS_ASSIGN_OR_RETURN(double vl, evaluate());
      if (vl >= 0) {
        summary.final_val_loss = vl;
        if (rank0) {
          metrics::JsonObject ev;
          ev.Add("phase", "eval").Add("step", step).AddTime("unix_s", WallSeconds()).Add("val_loss", vl);
          MS_RETURN_IF_ERROR(jsonl->Write(ev));
          std::string line = fmt::format("step {}: validation loss {:.4f}", step, vl);
          if (show) progress.Message(line);
          LogFileOnly(line);
        }
      }
    }
    // Signals and checkpoint failures: every rank must act on the same step, so agree first.
    MS_RETURN_IF_ERROR(record_outcomes(checkpointer->TakeOutcomes()));
    const SignalCounts got = TakeSignals();
    std::vector<int64_t> flags(kNumFlags, 0);
    flags[kInterrupt] = got.interrupt > 0;
    flags[kTerminate] = got.terminate > 0;
    // SIGUSR1 as a running count: the driver's forwarded signal reaches the ranks at slightly
    // different times, possibly on both sides of a step boundary; the max of the counts grows once
    // per request however the ranks see it, so one request makes one checkpoint.
    saves_seen += got.save;
    flags[kSave] = saves_seen;
    flags[kCheckpointsFailing] = spec.checkpoint.max_failures > 0 && failed_in_row >= spec.checkpoint.max_failures;
    if (rt.world > 1) {
      MS_RETURN_IF_ERROR(rt.world_comm->AllReduce(flags.data(), kNumFlags, comm::ReduceOp::kMax)->Wait());
    }
    if (flags[kCheckpointsFailing]) {
      if (rank0) {
        LogError("stopping: {} checkpoints in a row failed (checkpoint.max_failures = {}); the last error: {}",
                 failed_in_row, spec.checkpoint.max_failures, last_ckpt_error.message());
      }
      return Aborted(
          "stopped after step {}: {} checkpoints in a row failed (checkpoint.max_failures = {}; last: {}); training "
          "on without checkpoints would risk hours of work. The newest committed checkpoint is intact: fix the cause "
          "(disk space, the store) and `megascale resume`",
          step, spec.checkpoint.max_failures, spec.checkpoint.max_failures,
          rank0 ? last_ckpt_error.message() : std::string("see rank 0's log"));
    }
    stop_interrupt |= flags[kInterrupt] != 0;
    stop_terminate |= flags[kTerminate] != 0;
    const bool want_save = (spec.checkpoint.interval > 0 && step % spec.checkpoint.interval == 0) ||
                           flags[kTerminate] != 0 || flags[kSave] > saves_done;
    saves_done = std::max(saves_done, flags[kSave]);
    if (want_save) {
      set_phase(Phase::kCheckpoint);
      MS_RETURN_IF_ERROR(dpe->WaitAllParams());
      MS_ASSIGN_OR_RETURN(auto pieces, RankPieces(*gpt, *opt, rt.dp_rank, &ckpt_staging));
      MS_ASSIGN_OR_RETURN(auto info,
                          checkpointer->Snapshot(step, pieces, MakeMetadata(spec, step, position.ConsumedAfter(step))));
      trace.Span(fmt::format("checkpoint snapshot {}", step), "compute", NowSeconds() - info.blocked_seconds,
                 NowSeconds());
      if (rank0) {
        metrics::JsonObject ev;
        ev.Add("phase", "checkpoint")
            .Add("step", step)
            .Add("status", "snapshot")
            .Add("blocked_s", info.blocked_seconds);
        ev.Add("bytes", info.bytes).Add("skipped", info.skipped ? 1 : 0);
        MS_RETURN_IF_ERROR(jsonl->Write(ev));
        LogFileOnly(fmt::format("checkpoint step {}: snapshot blocked training {:.3f} s ({} bytes on rank 0)", step,
                                info.blocked_seconds, info.bytes));
      }
    }
    if (stop_terminate || stop_interrupt) break;
  }
  MS_RETURN_IF_ERROR(dpe->WaitAllParams());
  // Earlier failures were reported as they happened (record_outcomes); what must hold now is the
  // last write (the SIGTERM checkpoint, or the final periodic one).
  checkpointer->Wait().IgnoreError();
  MS_RETURN_IF_ERROR(record_outcomes(checkpointer->TakeOutcomes()));
  MS_RETURN_IF_ERROR_CTX(last_outcome, "writing the last checkpoint");
  if (show) progress.Finish();
  summary.seconds = NowSeconds() - t_start;
  {
    const auto ds_stats = batches->stats();
    LogFileOnly(fmt::format(
        "data ({} loader): {:.3f} s of CPU in data preparation, {} bytes read from the dataset, "
        "{} bytes of shared memory, {} bytes of memory for data",
        spec.data.loader, ds_stats.cpu_s, ds_stats.dataset_bytes, ds_stats.segment_bytes, ds_stats.memory_bytes));
  }
  {
    rusage ru{};
    if (getrusage(RUSAGE_SELF, &ru) == 0) {
      LogFileOnly(fmt::format("peak resident memory of rank {}: {:.1f} MiB", rt.rank, ru.ru_maxrss / 1024.0));
    }
    // The CUDA backend's caching allocator (also in the emulated build, whose device memory is host memory: the
    // same allocations, so the same peak as on a GPU).
    const cuda::AllocatorStats mem = cuda::GetAllocatorStats(*device);
    if (mem.peak_in_use > 0) {
      LogFileOnly(
          fmt::format("peak device memory of rank {}: {:.1f} MiB in use ({} cudaMalloc calls, {} allocations "
                      "served from the cache)",
                      rt.rank, mem.peak_in_use / 1048576.0, mem.cuda_mallocs, mem.cache_hits));
    }
  }
  if (spec.log.trace) {
    MS_RETURN_IF_ERROR(MakeDirs(run_dir + "/trace"));
    MS_RETURN_IF_ERROR(trace.Write(fmt::format("{}/trace/rank-{}.json", run_dir, rt.rank)));
  }
  if (!options.dump_params_dir.empty()) {
    MS_RETURN_IF_ERROR(DumpParams(*gpt, options.dump_params_dir, rt.rank));
  }
  if (stop_terminate) {
    if (rank0) {
      LogInfo("SIGTERM: stopped after step {} with checkpoint {}/{} committed; continue with `megascale resume`",
              summary.steps_done, spec.checkpoint.dir, checkpoint::StepDirName(summary.steps_done));
    }
    summary.end = JobEnd::kSavedOnSignal;
    return summary;
  }
  if (stop_interrupt) {
    if (rank0) LogWarn("stopped by SIGINT after step {} of {} (not saved)", summary.steps_done, spec.train.steps);
    summary.end = JobEnd::kInterrupted;
    return summary;
  }
  if (rank0) {
    // Which path ran the GeLU in the GEMMs (gpu_check.sh reads this line).
    const cuda::EpilogueStats es = compute.backend ? cuda::GetEpilogueStats(*compute.backend) : cuda::EpilogueStats{};
    if (es.cublaslt + es.fallback > 0) {
      LogInfo("fc GEMMs with the bias + GeLU epilogue: {} by cuBLASLt, {} by the GEMM + kernel fallback", es.cublaslt,
              es.fallback);
    }
    if (es.bias_cublaslt + es.bias_fallback > 0) {
      LogInfo("qkv GEMMs with the bias epilogue: {} by cuBLASLt, {} by the GEMM + kernel fallback", es.bias_cublaslt,
              es.bias_fallback);
    }
    const cuda::AttentionStats as =
        compute.backend ? cuda::GetAttentionStats(*compute.backend) : cuda::AttentionStats{};
    if (as.stored_ds + as.recompute > 0) {
      LogInfo(
          "tensor-core attention backwards: {} with dS kept (5 products), {} forming dS again (7 products); {} by "
          "the split dK/dV kernel",
          as.stored_ds, as.recompute, as.split_dkdv);
    }
    if (as.autotuned > 0) {
      LogInfo(
          "attention autotune: {} passes and shapes tuned ({} candidates left out for differing from the default's "
          "bits); chosen:",
          as.autotuned, as.autotune_disagreed);
      for (const std::string& note : as.autotune_notes) LogInfo("  {}", note);
    }
    if (as.cudnn_forward + as.cudnn_backward + as.cudnn_fallback > 0) {
      LogInfo(
          "attention by cuDNN's fused attention: {} forwards, {} backwards ({} of them checked against "
          "megascale's kernels and found wrong); {} calls by megascale's kernels{}",
          as.cudnn_forward, as.cudnn_backward, as.cudnn_disagreed, as.cudnn_fallback,
          as.cudnn_note.empty() ? "" : " (first fallback: " + as.cudnn_note + ")");
    }
    if (graphs_on) {
      const model::Gpt::GraphStats& gs = gpt->graph_stats();
      LogInfo(
          "CUDA graphs: {} recorded ({} operations in {} graphs), {} forwards and backwards launched as graphs, {} "
          "run op by op{}",
          gs.captures, gs.ops, gs.segments, gs.launches, gs.eager, gs.failure.empty() ? "" : "; " + gs.failure);
    }
    LogInfo("done: {} steps in {}, loss {:.4f} -> {:.4f}, validation {:.4f}; run directory {}", summary.steps_done,
            metrics::Progress::FormatDuration(summary.seconds), summary.first_loss, summary.final_loss,
            summary.final_val_loss, run_dir);
  }
  set_phase(Phase::kDone);            // its heartbeats from here on say so: no hang while it exits
  InjectDelay("train_end", rt.rank);  // test hook: a rank lost on its way out, after the last checkpoint
  return summary;
}

}  // namespace ms::runner
