#include "runner/checkpointing.h"

#include <mutex>
#include <sstream>

#include "bootstrap/bootstrap.h"

namespace ms::runner {
namespace {

class StoreCoordinator : public checkpoint::Coordinator {
 public:
  explicit StoreCoordinator(std::unique_ptr<bootstrap::Store> store) : store_(std::move(store)) {}
  Status MarkDurable(int64_t step, int rank, const checkpoint::FileInfo& info) override {
    std::lock_guard<std::mutex> lock(mu_);
    return store_->Set(Key(step, rank), info.ToJson());
  }
  Status MarkFailed(int64_t step, int rank, const Status& why) override {
    std::lock_guard<std::mutex> lock(mu_);
    return store_->Set(Key(step, rank), "!error " + why.ToString());
  }
  Result<std::vector<checkpoint::FileInfo>> WaitAllDurable(int64_t step, int world, double timeout_s) override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> keys;
    for (int r = 0; r < world; ++r) keys.push_back(Key(step, r));
    MS_ASSIGN_OR_RETURN(auto values, store_->WaitGet(keys, bootstrap::Millis(static_cast<int64_t>(timeout_s * 1000))));
    std::vector<checkpoint::FileInfo> infos;
    for (int r = 0; r < world; ++r) {
      if (values[r].rfind("!error ", 0) == 0) {
        return Aborted("rank {} did not write its part of checkpoint step {}: {}", r, step, values[r].substr(7));
      }
      MS_ASSIGN_OR_RETURN(auto info, checkpoint::FileInfo::FromJson(values[r]));
      infos.push_back(std::move(info));
    }
    store_->DeletePrefix(fmt::format("ckpt/{}/", step)).status().IgnoreError();
    return infos;
  }

 private:
  static std::string Key(int64_t step, int rank) { return fmt::format("ckpt/{}/{}", step, rank); }
  std::mutex mu_;
  std::unique_ptr<bootstrap::Store> store_;
};

}  // namespace

std::shared_ptr<checkpoint::Coordinator> MakeStoreCoordinator(std::unique_ptr<bootstrap::Store> store) {
  return std::make_shared<StoreCoordinator>(std::move(store));
}

std::string ModelSignature(const config::ModelSpec& m) {
  return fmt::format("layers={} hidden={} heads={} ffn_hidden={} vocab={} seq_len={} block={} tied_embeddings={}",
                     m.layers, m.hidden, m.heads, m.ffn_hidden, m.vocab, m.seq_len, config::Name(m.block),
                     m.tied_embeddings);
}

std::string MakeMetadata(const config::JobSpec& spec, int64_t step) {
  return fmt::format("step={}\nconsumed_samples={}\nseed={}\nmodel={}\nlayout=tp{}.pp{}.dp{}\n", step,
                     step * spec.train.global_batch, spec.train.seed, ModelSignature(spec.model), spec.parallel.tp,
                     spec.parallel.pp, spec.parallel.dp);
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

Status RestoreRank(const checkpoint::Checkpoint& ckpt, model::Gpt& gpt, optim::Optimizer& opt, Runtime& rt) {
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
  // Parameters: every data-parallel replica needs the same shard: read once, broadcast.
  if (rt.dp_rank == 0) {
    for (const auto& p : params) {
      MS_RETURN_IF_ERROR_CTX(ckpt.Read("param", p.name, target(p, 0, p.numel), param_base + p.offset), "restoring {}",
                             p.name);
    }
    if (!host) {
      MS_RETURN_IF_ERROR_CTX(be->CopyFromHost(gpt.param_data(), param_base, sizeof(float) * gpt.num_params()),
                             "copying restored parameters to the device");
    }
  }
  MS_RETURN_IF_ERROR(be->Synchronize());
  if (rt.dp && rt.dp->size() > 1) {
    MS_RETURN_IF_ERROR_CTX(rt.dp->Broadcast(gpt.param_data(), gpt.num_params(), 0)->Wait(),
                           "broadcasting restored parameters over data-parallel ranks");
  }
  // Optimizer state: each rank reads the ranges it updates.
  const auto& segs = opt.segments();
  for (size_t i = 0; i < segs.size(); ++i) {
    const auto& p = params[segs[i].param];
    const auto t = target(p, segs[i].begin, segs[i].begin + segs[i].len);
    const int64_t o = opt.state_offset(i);
    MS_RETURN_IF_ERROR_CTX(ckpt.Read("exp_avg", p.name, t, m_base + o), "restoring exp_avg of {}", p.name);
    MS_RETURN_IF_ERROR_CTX(ckpt.Read("exp_avg_sq", p.name, t, v_base + o), "restoring exp_avg_sq of {}", p.name);
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
