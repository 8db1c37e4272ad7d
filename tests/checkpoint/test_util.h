// Helpers for the checkpoint tests: temp directories, log capture, a small fake GPT whose
// tensors use every ShardKind, and saving it from a simulated (tp, pp, dp) job with ZeRO-style
// optimizer ranges, one AsyncCheckpointer per rank on its own thread.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "core/core.h"
#include "model/model.h"
#include "support/temp_dir.h"

namespace ms::checkpoint::testing {

using model::ShardKind;

using ms::testing::TempDir;

// Sends every log line to a file while alive; Text() closes it and returns what was logged.
class LogCapture {
 public:
  LogCapture() : path_(fmt::format("/tmp/ms-ckpt-log-{}-{}.txt", ::getpid(), counter_++)) {
    std::filesystem::remove(path_);
    SetLogFile(path_).IgnoreError();
  }
  ~LogCapture() {
    SetLogFile("").IgnoreError();
    std::filesystem::remove(path_);
  }
  std::string Text() {
    SetLogFile("").IgnoreError();  // flushes
    auto r = ReadFile(path_);
    SetLogFile(path_).IgnoreError();
    return r.ok() ? *r : std::string();
  }

 private:
  static inline int counter_ = 0;
  std::string path_;
};

inline bool Exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

inline int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

struct FakeTensor {
  std::string name;
  std::vector<int64_t> shape;
  ShardKind shard;
  int stage;  // pipeline stage (of 2)
};

// A 2-layer GPT with the model's tensor names; every dimension splits by tp 1, 2 and 4.
inline std::vector<FakeTensor> FakeModel() {
  const int64_t C = 16, F = 64, V = 40, T = 12;
  std::vector<FakeTensor> t = {{"embed.wte", {V, C}, ShardKind::kRows, 0},
                               {"embed.wpe", {T, C}, ShardKind::kReplicated, 0}};
  for (int l = 0; l < 2; ++l) {
    std::string p = fmt::format("layers.{}.", l);
    t.push_back({p + "ln1.weight", {C}, ShardKind::kReplicated, l});
    t.push_back({p + "ln1.bias", {C}, ShardKind::kReplicated, l});
    t.push_back({p + "attn.qkv.weight", {3 * C, C}, ShardKind::kQkvRows, l});
    t.push_back({p + "attn.qkv.bias", {3 * C}, ShardKind::kQkvRows, l});
    t.push_back({p + "attn.proj.weight", {C, C}, ShardKind::kCols, l});
    t.push_back({p + "attn.proj.bias", {C}, ShardKind::kReplicated, l});
    t.push_back({p + "mlp.fc.weight", {F, C}, ShardKind::kRows, l});
    t.push_back({p + "mlp.fc.bias", {F}, ShardKind::kRows, l});
    t.push_back({p + "mlp.proj.weight", {C, F}, ShardKind::kCols, l});
    t.push_back({p + "mlp.proj.bias", {C}, ShardKind::kReplicated, l});
  }
  t.push_back({"final_norm.weight", {C}, ShardKind::kReplicated, 1});
  t.push_back({"final_norm.bias", {C}, ShardKind::kReplicated, 1});
  return t;
}

inline const std::vector<std::string>& Kinds() {
  static const std::vector<std::string> kinds = {"param", "exp_avg", "exp_avg_sq"};
  return kinds;
}

// kind -> tensor -> global values (seeded normal floats; distinct per kind and tensor).
using Truth = std::map<std::string, std::map<std::string, std::vector<float>>>;

inline Truth MakeTruth(uint64_t seed) {
  Truth truth;
  uint64_t stream = 0;
  for (const auto& kind : Kinds()) {
    for (const auto& t : FakeModel()) {
      Rng rng(seed, ++stream);
      auto& v = truth[kind][t.name];
      v.resize(static_cast<size_t>(Numel(t.shape)));
      for (auto& x : v) x = static_cast<float>(rng.NextNormal());
    }
  }
  return truth;
}

// What rank `rank` of a (tp, pp, dp) job saves, as the runner does: its pipeline stage's
// tensors, TP-local (cut with model::ExtractShard); params from DP rank 0 only; replicated
// tensors from TP rank 0 only; optimizer state split ZeRO-1 style over the DP ranks as
// contiguous ranges of the stage's flat TP-local buffer (so ranges cross tensor boundaries).
// `locals` keeps the buffers the pieces point into.
inline std::vector<PieceRef> RankPieces(const Truth& truth, Layout layout, int rank,
                                        std::vector<std::vector<float>>* locals) {
  const int tp_i = rank % layout.tp, pp_i = (rank / layout.tp) % layout.pp, dp_i = rank / (layout.tp * layout.pp);
  std::vector<FakeTensor> stage;
  for (const auto& t : FakeModel()) {
    if (t.stage * layout.pp / 2 == pp_i) stage.push_back(t);
  }
  int64_t flat = 0;
  std::vector<int64_t> starts;
  for (const auto& t : stage) {
    starts.push_back(flat);
    flat += Numel(*LocalShape(t.shape, t.shard, layout.tp));
  }
  const int64_t z0 = flat * dp_i / layout.dp, z1 = flat * (dp_i + 1) / layout.dp;
  std::vector<PieceRef> pieces;
  locals->reserve(locals->size() + stage.size() * Kinds().size());
  for (const auto& kind : Kinds()) {
    for (size_t i = 0; i < stage.size(); ++i) {
      const FakeTensor& t = stage[i];
      if (t.shard == ShardKind::kReplicated && tp_i != 0) continue;
      const int64_t n = Numel(*LocalShape(t.shape, t.shard, layout.tp));
      int64_t b = 0, e = n;
      if (kind == "param") {
        if (dp_i != 0) continue;
      } else {
        b = std::max<int64_t>(0, z0 - starts[i]);
        e = std::min<int64_t>(n, z1 - starts[i]);
        if (e <= b) continue;
      }
      locals->emplace_back(static_cast<size_t>(n));
      model::ExtractShard(truth.at(kind).at(t.name).data(), locals->back().data(), t.shape, t.shard, layout.tp, tp_i);
      pieces.push_back(PieceRef{t.name, kind, t.shape, t.shard, layout.tp, tp_i, b, e, locals->back().data() + b});
    }
  }
  return pieces;
}

// Saves `truth` at `step` from every rank of `layout`, concurrently (one thread and one
// AsyncCheckpointer per rank, one shared coordinator). Returns rank 0's Wait() status.
inline Status SaveJob(const std::string& dir, const Truth& truth, Layout layout, int64_t step, int keep = 0) {
  InProcessCoordinator coord;
  const int world = layout.world();
  std::vector<Status> results(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      CheckpointerOptions opt;
      opt.dir = dir;
      opt.rank = r;
      opt.layout = layout;
      opt.keep = keep;
      opt.coordination_timeout_s = 30;
      auto ck = AsyncCheckpointer::Create(opt, &coord);
      if (!ck.ok()) {
        results[r] = ck.status();
        return;
      }
      std::vector<std::vector<float>> locals;
      auto pieces = RankPieces(truth, layout, r, &locals);
      std::string meta = fmt::format("{{\"step\": {}, \"rank\": {}, \"rng\": [1, 2, 3]}}", step, r);
      auto snap = (*ck)->Snapshot(step, pieces, meta);
      if (!snap.ok()) {
        results[r] = snap.status();
        return;
      }
      locals.clear();  // the checkpointer owns its copy now
      results[r] = (*ck)->Wait();
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : results) MS_RETURN_IF_ERROR(s);
  return Status::Ok();
}

}  // namespace ms::checkpoint::testing
