#include "runner/checkpointing.h"

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "bootstrap/bootstrap.h"
#include "runner/fault_injection.h"

namespace ms::runner {
namespace {

// Two connections: the marks (any thread, short) and rank 0's wait (its writer thread, up to the
// coordination timeout) never share a lock, so a MarkFailed from the training thread (a skipped
// snapshot) is never held up by a wait in progress.
class StoreCoordinator : public checkpoint::Coordinator {
 public:
  // `server`: the store's server instance when the coordinator was made (before the job's first step).
  StoreCoordinator(std::unique_ptr<bootstrap::Store> marks, std::unique_ptr<bootstrap::Store> waits, std::string server)
      : marks_(std::move(marks)), waits_(std::move(waits)), last_server_(std::move(server)) {}
  // If the store restarts before a step is committed, the marks written to it before the restart are lost, and the
  // wait must not hang for them. Another rank marks `step` once it has passed that training step, which needs this
  // rank's part of it, so any mark of `step` follows this rank's previous BeginStep (on its training thread, before
  // its next step: AsyncCheckpointer::Snapshot), not necessarily this one: a restart between the two can take a mark
  // that this BeginStep's own look at the server cannot show. So `step` is coordinated against the server seen at
  // the previous BeginStep (at the coordinator's creation for the first), and a restart since then abandons it.
  Status BeginStep(int64_t step) override {
    std::lock_guard<std::mutex> lock(marks_mu_);
    MS_ASSIGN_OR_RETURN(std::string id, marks_->ServerId());
    std::lock_guard<std::mutex> ids(ids_mu_);
    server_at_begin_[step] = last_server_;
    last_server_ = std::move(id);
    while (server_at_begin_.size() > 16) server_at_begin_.erase(server_at_begin_.begin());
    return Status::Ok();
  }
  Status MarkDurable(int64_t step, int rank, const checkpoint::FileInfo& info) override {
    std::lock_guard<std::mutex> lock(marks_mu_);
    return marks_->Set(Key(step, rank), info.ToJson());
  }
  Status MarkFailed(int64_t step, int rank, const Status& why) override {
    std::lock_guard<std::mutex> lock(marks_mu_);
    return marks_->Set(Key(step, rank), "!error " + why.ToString());
  }
  Result<std::vector<checkpoint::FileInfo>> WaitAllDurable(int64_t step, int world, double timeout_s) override {
    std::lock_guard<std::mutex> lock(waits_mu_);
    std::vector<std::string> keys;
    for (int r = 0; r < world; ++r) keys.push_back(Key(step, r));
    std::string begin_id;
    {
      std::lock_guard<std::mutex> ids(ids_mu_);
      begin_id = server_at_begin_[step];
    }
    // Waits in slices, checking between them that the server is the one the step began on.
    const double deadline = NowSeconds() + timeout_s;
    Result<std::vector<std::string>> got = Timeout("not waited");
    while (true) {
      MS_ASSIGN_OR_RETURN(std::string id, waits_->ServerId());
      if (!begin_id.empty() && id != begin_id) {
        return Unavailable(
            "the store (redis) was restarted while checkpoint step {} was being coordinated: the ranks' marks "
            "written before the restart may be lost, so this checkpoint is abandoned (the next one is coordinated on "
            "the new server)",
            step);
      }
      const double left = deadline - NowSeconds();
      if (left <= 0) break;
      got = waits_->WaitGet(keys, bootstrap::Millis(static_cast<int64_t>(std::min(left, 1.0) * 1000) + 1));
      if (got.ok() || got.status().code() != Code::kTimeout) break;
    }
    if (!got.ok()) {
      return got.status().WithContext(
          fmt::format("checkpoint step {}: waiting {:.0f} s for every rank's file", step, timeout_s));
    }
    auto& values = *got;
    std::vector<checkpoint::FileInfo> infos;
    for (int r = 0; r < world; ++r) {
      if (values[r].rfind("!error ", 0) == 0) {
        return Aborted("rank {} did not write its part of checkpoint step {}: {}", r, step, values[r].substr(7));
      }
      MS_ASSIGN_OR_RETURN(auto info, checkpoint::FileInfo::FromJson(values[r]));
      infos.push_back(std::move(info));
    }
    waits_->DeletePrefix(fmt::format("ckpt/{}/", step)).status().IgnoreError();
    return infos;
  }

 private:
  static std::string Key(int64_t step, int rank) { return fmt::format("ckpt/{}/{}", step, rank); }
  std::mutex marks_mu_, waits_mu_, ids_mu_;
  std::unique_ptr<bootstrap::Store> marks_, waits_;
  std::map<int64_t, std::string> server_at_begin_;  // the server each step is coordinated against
  std::string last_server_;                         // the server seen at the latest BeginStep
};

}  // namespace

Result<std::shared_ptr<checkpoint::Coordinator>> MakeStoreCoordinator(const bootstrap::Store& store) {
  MS_ASSIGN_OR_RETURN(auto marks, store.Clone());
  MS_ASSIGN_OR_RETURN(auto waits, store.Clone());
  MS_ASSIGN_OR_RETURN(std::string server, marks->ServerId());
  return std::shared_ptr<checkpoint::Coordinator>(
      std::make_shared<StoreCoordinator>(std::move(marks), std::move(waits), std::move(server)));
}

std::string ModelSignature(const config::ModelSpec& m) {
  // vocab_pad_to only when set: checkpoints written before the key existed keep their signature.
  return fmt::format("layers={} hidden={} heads={} ffn_hidden={} vocab={}{} seq_len={} block={} tied_embeddings={}",
                     m.layers, m.hidden, m.heads, m.ffn_hidden, m.vocab,
                     m.vocab_pad_to > 1 ? fmt::format(" vocab_pad_to={}", m.vocab_pad_to) : std::string(), m.seq_len,
                     config::Name(m.block), m.tied_embeddings);
}

std::string MakeMetadata(const config::JobSpec& spec, int64_t step, int64_t consumed_samples) {
  return fmt::format("step={}\nconsumed_samples={}\nseed={}\nmodel={}\nlayout=tp{}.pp{}.dp{}\n", step, consumed_samples,
                     spec.train.seed, ModelSignature(spec.model), spec.parallel.tp, spec.parallel.pp, spec.parallel.dp);
}

std::string MetadataValue(const std::string& metadata, const std::string& key) {
  std::istringstream in(metadata);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(key + "=", 0) == 0) return line.substr(key.size() + 1);
  }
  return "";
}

Result<int64_t> MetadataStep(const std::string& metadata) {
  const std::string v = MetadataValue(metadata, "step");
  if (v.empty()) return DataLoss("checkpoint metadata has no step");
  return std::stoll(v);
}

Status CheckCompatible(const checkpoint::Checkpoint& ckpt, const config::JobSpec& spec) {
  const std::string saved = MetadataValue(ckpt.metadata(0), "model");
  const std::string want = ModelSignature(spec.model);
  if (saved != want) {
    return InvalidArgument(
        "checkpoint {} holds a different model: saved [{}], job spec [{}]; use a checkpoint.dir of this model",
        ckpt.dir(), saved, want);
  }
  if (MetadataValue(ckpt.metadata(0), "seed") != std::to_string(spec.train.seed)) {
    LogWarn("checkpoint {} was trained with seed {}, the job spec says {}: the data order changes from here",
            ckpt.dir(), MetadataValue(ckpt.metadata(0), "seed"), spec.train.seed);
  }
  return Status::Ok();
}

Result<std::vector<checkpoint::PieceRef>> RankPieces(const model::Gpt& gpt, optim::Optimizer& opt, int dp_rank,
                                                     HostStaging* staging, bool stage) {
  std::vector<checkpoint::PieceRef> pieces;
  ops::Backend* be = gpt.backend();
  const float* param_base = gpt.param_data();
  const float* m_base = opt.exp_avg().data();
  const float* v_base = opt.exp_avg_sq().data();
  if (!be->device()->is_host()) {
    staging->params.resize(gpt.num_params());
    staging->exp_avg.resize(opt.exp_avg().size());
    staging->exp_avg_sq.resize(opt.exp_avg_sq().size());
    if (stage) {
      MS_RETURN_IF_ERROR_CTX(be->CopyToHost(staging->params.data(), param_base, sizeof(float) * gpt.num_params()),
                             "staging parameters for a checkpoint");
      MS_RETURN_IF_ERROR_CTX(be->CopyToHost(staging->exp_avg.data(), m_base, sizeof(float) * staging->exp_avg.size()),
                             "staging exp_avg for a checkpoint");
      MS_RETURN_IF_ERROR_CTX(
          be->CopyToHost(staging->exp_avg_sq.data(), v_base, sizeof(float) * staging->exp_avg_sq.size()),
          "staging exp_avg_sq for a checkpoint");
    }
    param_base = staging->params.data();
    m_base = staging->exp_avg.data();
    v_base = staging->exp_avg_sq.data();
  }
  const auto& params = gpt.params();
  const int tp = gpt.shard().tp_size, tp_rank = gpt.shard().tp_rank;
  auto piece = [&](const model::ParamInfo& p, const char* kind, int64_t begin, int64_t end, const float* data) {
    checkpoint::PieceRef r;
    r.tensor = p.name;
    r.kind = kind;
    r.global_shape = p.global_shape;
    r.shard = p.shard;
    r.tp_size = tp;
    r.tp_rank = tp_rank;
    r.begin = begin;
    r.end = end;
    r.data = data;
    return r;
  };
  if (dp_rank == 0) {
    for (const auto& p : params) {
      if (p.tied_replica || (p.shard == model::ShardKind::kReplicated && tp_rank != 0)) continue;
      pieces.push_back(piece(p, "param", 0, p.numel, param_base + p.offset));
    }
  }
  const auto& segs = opt.segments();
  for (size_t i = 0; i < segs.size(); ++i) {
    if (!segs[i].count) continue;
    const auto& p = params[segs[i].param];
    const int64_t o = opt.state_offset(i);
    pieces.push_back(piece(p, "exp_avg", segs[i].begin, segs[i].begin + segs[i].len, m_base + o));
    pieces.push_back(piece(p, "exp_avg_sq", segs[i].begin, segs[i].begin + segs[i].len, v_base + o));
  }
  return pieces;
}

Status WaitForLeader(bootstrap::Store* store, const std::string& key, bool leader, double silence_s,
                     const std::function<Status()>& work) {
  if (!store) return leader ? work() : Status::Ok();
  const std::string done_key = key + "/done", beat_key = key + "/beat";
  if (leader) {
    MS_ASSIGN_OR_RETURN(std::unique_ptr<bootstrap::Store> beat_store, store->Clone());
    std::mutex mu;
    std::condition_variable cv;
    bool finished = false;
    std::thread beat([&] {
      const auto period = std::chrono::duration<double>(std::clamp(silence_s / 4, 0.05, 1.0));
      std::unique_lock<std::mutex> lock(mu);
      for (int64_t n = 1; !cv.wait_for(lock, period, [&] { return finished; }); ++n) {
        Status s = beat_store->Set(beat_key, std::to_string(n));
        if (!s.ok()) LogWarn("{}: progress beat: {}", key, s.message());
      }
    });
    Status s = work();
    {
      std::lock_guard<std::mutex> lock(mu);
      finished = true;
    }
    cv.notify_all();
    beat.join();
    MS_RETURN_IF_ERROR(store->Set(done_key, s.ok() ? std::string("ok") : "!error " + s.message()));
    return s;
  }
  std::string last_beat;
  double last_progress = NowSeconds();
  while (true) {
    auto v = store->WaitGet({done_key}, bootstrap::Millis(1000));
    if (v.ok()) {
      if ((*v)[0].rfind("!error ", 0) == 0) return Aborted("{}: the leader failed: {}", key, (*v)[0].substr(7));
      return Status::Ok();
    }
    if (v.status().code() != Code::kTimeout) return v.status().WithContext(fmt::format("waiting for {}", key));
    auto beat = store->Get(beat_key);
    if (beat.ok() && *beat != last_beat) {
      last_beat = *beat;
      last_progress = NowSeconds();
    } else if (!beat.ok() && beat.status().code() != Code::kNotFound) {
      return beat.status().WithContext(fmt::format("waiting for {}", key));
    }
    if (NowSeconds() - last_progress > silence_s) {
      return Timeout("{}: the leader made no progress for {:.0f} s (runtime.collective_timeout_s); is it alive?", key,
                     silence_s);
    }
  }
}

Status RestoreRank(const checkpoint::Checkpoint& ckpt, model::Gpt& gpt, optim::Optimizer& opt, Runtime& rt) {
  gpt.InvalidateBf16Weights();  // the parameters change here: no bf16 weight copy written before holds
  const auto& params = gpt.params();
  ops::Backend* be = gpt.backend();
  const bool host = be->device()->is_host();
  HostStaging st;  // non-host devices: read into host memory, then copy over
  float* param_base = gpt.param_data();
  float* m_base = opt.exp_avg().data();
  float* v_base = opt.exp_avg_sq().data();
  if (!host) {
    st.params.assign(gpt.num_params(), 0.0f);
    st.exp_avg.assign(opt.exp_avg().size(), 0.0f);
    st.exp_avg_sq.assign(opt.exp_avg_sq().size(), 0.0f);
    param_base = st.params.data();
    m_base = st.exp_avg.data();
    v_base = st.exp_avg_sq.data();
  }
  auto target = [&](const model::ParamInfo& p, int64_t begin, int64_t end) {
    checkpoint::ShardTarget t;
    t.global_shape = p.global_shape;
    t.shard = p.shard;
    t.tp_size = gpt.shard().tp_size;
    t.tp_rank = gpt.shard().tp_rank;
    t.begin = begin;
    t.end = end;
    return t;
  };
  // Tensor by tensor: a resharded read reassembles the global tensor, which is dropped as soon as
  // this rank has cut out what it needs, so at most one global tensor is held at a time.
  const auto& segs = opt.segments();
  std::vector<std::vector<size_t>> segs_of(params.size());
  for (size_t i = 0; i < segs.size(); ++i) segs_of[segs[i].param].push_back(i);
  auto read_state = [&](size_t pi) -> Status {
    const auto& p = params[pi];
    for (const char* kind : {"exp_avg", "exp_avg_sq"}) {
      float* base = std::string_view(kind) == "exp_avg" ? m_base : v_base;
      for (size_t i : segs_of[pi]) {
        const auto t = target(p, segs[i].begin, segs[i].begin + segs[i].len);
        MS_RETURN_IF_ERROR_CTX(ckpt.Read(kind, p.name, t, base + opt.state_offset(i)), "restoring {} of {}", kind,
                               p.name);
      }
      ckpt.DropCache(kind, p.name);
    }
    return Status::Ok();
  };
  // Parameters: every data-parallel replica needs the same shard: data-parallel rank 0 reads it and
  // broadcasts it. The others read their optimizer state meanwhile, then wait for it through the
  // store (not in a collective: a long read is not a hang while it makes progress).
  const bool reader = rt.dp_rank == 0;
  if (!reader) {
    for (size_t pi = 0; pi < params.size(); ++pi) MS_RETURN_IF_ERROR(read_state(pi));
  }
  const std::string key = fmt::format("restore/{}/{}", ckpt.step(), rt.pp_rank * gpt.shard().tp_size + rt.tp_rank);
  MS_RETURN_IF_ERROR(WaitForLeader(rt.store.get(), key, reader, rt.collective_timeout_s, [&]() -> Status {
    InjectDelay("restore_read", rt.rank);
    for (size_t pi = 0; pi < params.size(); ++pi) {
      const auto& p = params[pi];
      MS_RETURN_IF_ERROR_CTX(ckpt.Read("param", p.name, target(p, 0, p.numel), param_base + p.offset), "restoring {}",
                             p.name);
      ckpt.DropCache("param", p.name);
      MS_RETURN_IF_ERROR(read_state(pi));
    }
    if (!host) {
      MS_RETURN_IF_ERROR_CTX(be->CopyFromHost(gpt.param_data(), param_base, sizeof(float) * gpt.num_params()),
                             "copying restored parameters to the device");
    }
    return be->Synchronize();
  }));
  if (rt.dp && rt.dp->size() > 1) {
    MS_RETURN_IF_ERROR_CTX(rt.dp->Broadcast(gpt.param_data(), gpt.num_params(), 0)->Wait(),
                           "broadcasting restored parameters over data-parallel ranks");
  }
  if (!host) {
    MS_RETURN_IF_ERROR_CTX(be->CopyFromHost(opt.exp_avg().data(), m_base, sizeof(float) * st.exp_avg.size()),
                           "copying restored exp_avg to the device");
    MS_RETURN_IF_ERROR_CTX(be->CopyFromHost(opt.exp_avg_sq().data(), v_base, sizeof(float) * st.exp_avg_sq.size()),
                           "copying restored exp_avg_sq to the device");
    MS_RETURN_IF_ERROR(be->Synchronize());
  }
  ckpt.DropCache();
  return Status::Ok();
}

}  // namespace ms::runner
