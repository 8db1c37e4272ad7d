// The tensor-core attention's autotuning (attention_tune.h): compiled into both flavors of the CUDA backend.
#include "cuda/attention_tune.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <tuple>

#include "kernels.h"

namespace ms::cuda {
namespace {

constexpr int kTimedRuns = 3;  // per candidate, after one run whose outputs are compared

// Test hook (docs/cuda.md): MEGASCALE_PLANT=autotune_disagree flips a bit of every candidate's outputs but the
// default's as they are read back, as a kernel giving other bits would: each must be left out.
bool PlantedDisagree() {
  const char* v = std::getenv("MEGASCALE_PLANT");
  return v && std::strcmp(v, "autotune_disagree") == 0;
}

Status Cuda(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return Status::Ok();
  return Internal("attention autotune: {}: {}", what, cudaGetErrorString(e));
}

// Which switches a run actually used (a switch where it does not apply runs the default's kernel): the launch
// counters' growth over the run.
struct Ran {
  bool wide, fixed, split;
  bool operator==(const Ran& o) const { return wide == o.wide && fixed == o.fixed && split == o.split; }
};
struct Counters {
  int64_t wide, fixed, split;
  static Counters Now() {
    return {kernels::AttentionTcWideForwardLaunches(), kernels::AttentionTcFixedBoundsLaunches(),
            kernels::AttentionTcSplitDkDvLaunches()};
  }
};

// Events around each timed run, destroyed with it.
struct Events {
  std::vector<cudaEvent_t> ev;
  ~Events() {
    for (cudaEvent_t e : ev) cudaEventDestroy(e);
  }
  Status Make(size_t n) {
    while (ev.size() < n) {
      cudaEvent_t e = nullptr;
      MS_RETURN_IF_ERROR(Cuda(cudaEventCreate(&e), "creating a timing event"));
      ev.push_back(e);
    }
    return Status::Ok();
  }
};

}  // namespace

std::string AttentionVariant::Name() const {
  std::string n;
  if (wide) n += "wide";
  if (split) n += n.empty() ? "split" : "+split";
  if (!fixed) n += n.empty() ? "varD" : "+varD";
  return n.empty() ? "default" : n;
}

void AttentionVariant::Apply() const {
  kernels::SetAttentionTcWideForward(wide);
  kernels::SetAttentionTcFixedBounds(fixed);
  kernels::SetAttentionTcSplitDkDv(split);
}

Result<AttentionVariant> AttentionTuner::Choose(const std::string& key, bool backward, int64_t D,
                                                const AttentionVariant& def, cudaStream_t stream, bool capturing,
                                                const std::vector<TuneOutput>& outputs,
                                                const std::function<cudaError_t()>& run,
                                                const std::function<cudaError_t()>& reset) {
  if (auto it = chosen_.find(key); it != chosen_.end()) return it->second;
  if (!on_ || capturing) return def;  // a capture cannot wait for the device; the default runs, untuned
  // The candidates, the default first: the switches the default leaves off, where they give its bits.
  std::vector<AttentionVariant> candidates;
  for (bool fixed : {def.fixed, !def.fixed}) {
    for (bool other : {false, true}) {
      AttentionVariant v = def;
      v.fixed = fixed;
      if (other) {
        if (backward) {
          if (kernels::AttentionTcBackwardSharedByDefault(D)) continue;  // the default's softmax: other bits
          if (def.split) continue;                                       // forced by runtime.attention_split_dkdv
          v.split = true;
        } else {
          v.wide = true;
        }
      }
      candidates.push_back(v);
    }
  }
  struct Tried {
    AttentionVariant v;
    Ran ran;
    double ms = -1;    // median of the timed runs; -1: not timed
    std::string note;  // why not
  };
  std::vector<Tried> tried;
  std::vector<std::vector<char>> base;  // the default's outputs
  Events events;
  MS_RETURN_IF_ERROR(events.Make(2 * kTimedRuns));
  for (const AttentionVariant& v : candidates) {
    v.Apply();
    const Counters before = Counters::Now();
    MS_RETURN_IF_ERROR(Cuda(reset(), fmt::format("{}: zeroing the tuning scratch", key)));
    MS_RETURN_IF_ERROR(Cuda(run(), fmt::format("{}: the {} kernels", key, v.Name())));
    const Counters after = Counters::Now();
    Tried t{v, {after.wide > before.wide, after.fixed > before.fixed, after.split > before.split}, -1, {}};
    const auto same_kernels = std::find_if(tried.begin(), tried.end(), [&](const Tried& o) { return o.ran == t.ran; });
    if (same_kernels != tried.end()) continue;  // a switch that does not apply here: the same kernels as before
    MS_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(stream), fmt::format("{}: the {} kernels", key, v.Name())));
    std::vector<std::vector<char>> got;
    for (const TuneOutput& o : outputs) {
      got.emplace_back(o.data ? o.bytes : 0);
      if (o.data && o.bytes > 0) {
        MS_RETURN_IF_ERROR(Cuda(cudaMemcpy(got.back().data(), o.data, o.bytes, cudaMemcpyDeviceToHost),
                                fmt::format("{}: reading the {} kernels' outputs", key, v.Name())));
      }
    }
    if (!tried.empty() && PlantedDisagree()) {
      for (std::vector<char>& g : got) {
        if (g.empty()) continue;
        g[0] = static_cast<char>(g[0] ^ 1);
        break;
      }
    }
    if (tried.empty()) {
      base = std::move(got);
    } else if (got != base) {
      size_t which = 0;
      while (which + 1 < got.size() && got[which] == base[which]) ++which;
      t.note = fmt::format("left out: its {} differs from the default's bits", outputs[which].name);
      ++disagreed_;
      LogWarn(
          "attention autotune: {}: the {} kernels' {} differs from the default's bits, which they must give (a "
          "kernel bug on this device: please report it); they are left out",
          key, v.Name(), outputs[which].name);
      tried.push_back(std::move(t));
      continue;
    }
    for (int i = 0; i < kTimedRuns; ++i) {
      MS_RETURN_IF_ERROR(Cuda(cudaEventRecord(events.ev[2 * i], stream), "recording a timing event"));
      MS_RETURN_IF_ERROR(Cuda(run(), fmt::format("{}: the {} kernels", key, v.Name())));
      MS_RETURN_IF_ERROR(Cuda(cudaEventRecord(events.ev[2 * i + 1], stream), "recording a timing event"));
    }
    MS_RETURN_IF_ERROR(Cuda(cudaEventSynchronize(events.ev.back()), fmt::format("{}: timing {}", key, v.Name())));
    std::vector<double> ms;
    for (int i = 0; i < kTimedRuns; ++i) {
      float t_ms = 0;
      MS_RETURN_IF_ERROR(
          Cuda(cudaEventElapsedTime(&t_ms, events.ev[2 * i], events.ev[2 * i + 1]), "reading a timing event"));
      ms.push_back(t_ms);
    }
    std::sort(ms.begin(), ms.end());
    t.ms = ms[ms.size() / 2];
    tried.push_back(std::move(t));
  }
  def.Apply();
  // The fastest that agreed (the default agrees with itself; on a tie the earlier, so the default).
  const Tried* best = &tried.front();
  for (const Tried& t : tried) {
    if (t.ms >= 0 && t.ms < best->ms) best = &t;
  }
  std::string all;
  for (const Tried& t : tried) {
    all += fmt::format("{}{} {}", all.empty() ? "" : ", ", t.v.Name(),
                       t.ms >= 0 ? fmt::format("{:.4f} ms", t.ms) : t.note);
  }
  notes_.push_back(fmt::format("{}: {} ({})", key, best->v.Name(), all));
  LogInfo("attention autotune: {}", notes_.back());
  chosen_[key] = best->v;
  return best->v;
}

}  // namespace ms::cuda
