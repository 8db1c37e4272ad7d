// EventLog, Monitor: heartbeats read by the driver, faults and stragglers found in them.
#include "runner/monitor.h"

#include <algorithm>
#include <cstdio>
#include <map>

#include "bootstrap/bootstrap.h"

namespace ms::runner {

void EventLog::Write(std::string_view kind, const std::function<void(metrics::JsonObject&)>& fill) {
  metrics::JsonObject o;
  o.Add("time", WallClockIso8601()).AddTime("unix_s", WallSeconds()).Add("event", kind);
  fill(o);
  auto w = metrics::JsonlWriter::Open(path_, /*append=*/true);
  Status s = w.ok() ? w->Write(o) : w.status();
  if (!s.ok()) LogWarn("event log {}: {}", path_, s.message());
}

Monitor::Monitor(std::unique_ptr<bootstrap::Store> store, int world, const config::FaultSpec& spec, std::string run_dir,
                 int attempt, EventLog* events)
    : store_(std::move(store)),
      world_(world),
      spec_(spec),
      timings_path_(run_dir + "/rank_timings.jsonl"),
      attempt_(attempt),
      events_(events),
      ranks_(static_cast<size_t>(world)),
      started_(NowSeconds()),
      progress_at_(NowSeconds()) {}

std::string Monitor::Note(const std::string& key) {
  auto v = store_->Get(key);
  return v.ok() ? *v : std::string();
}

std::string Monitor::HostOf(int rank) const {
  if (rank < 0 || rank >= world_ || !ranks_[rank].beat) return "";
  return ranks_[rank].beat->host;
}

std::string Monitor::Where(int rank) const {
  if (rank < 0 || rank >= world_ || !ranks_[rank].beat) return "no heartbeat yet";
  const Beat& b = *ranks_[rank].beat;
  std::string s = fmt::format("step {}, {}", b.step, b.phase);
  if (!b.wait_op.empty()) s += fmt::format(", waiting {:.0f} s in {} on {}", b.wait_s, b.wait_op, b.wait_group);
  return s;
}

bool Monitor::ReadBeats() {
  std::vector<std::string> keys;
  for (int r = 0; r < world_; ++r) keys.push_back(HeartbeatKey(r));
  auto values = store_->MultiGet(keys);
  if (!values.ok()) {
    // The store itself is down: the driver restarts an embedded one; heartbeats resume after.
    if (!store_warned_) LogWarn("reading heartbeats: {}", values.status().message());
    store_warned_ = true;
    for (auto& r : ranks_) r.changed_at = NowSeconds();  // no beat can be judged meanwhile
    return false;
  }
  store_warned_ = false;
  const double now = NowSeconds();
  for (int r = 0; r < world_; ++r) {
    RankState& st = ranks_[r];
    if (!(*values)[r]) continue;
    auto beat = ParseHeartbeat(*(*values)[r]);
    if (!beat.ok()) continue;
    if (!st.beat || st.beat->n != beat->n) st.changed_at = now;
    for (const auto& step : beat->steps) {
      if (step.step > judged_through_) st.steps[step.step] = step;
      first_step_done_ = true;
    }
    if (beat->step > max_step_) {
      max_step_ = beat->step;
      progress_at_ = now;
    }
    st.beat = std::move(beat).value();
  }
  return true;
}

void Monitor::Finish() {
  if (spec_.heartbeat_s > 0 && ReadBeats()) Stragglers(NowSeconds());
}

std::optional<Fault> Monitor::Poll() {
  if (spec_.heartbeat_s <= 0 || !ReadBeats()) return std::nullopt;
  const double now = NowSeconds();
  // Lost heartbeat: a rank that beat and stopped (one that never beat is still starting up: the
  // rendezvous timeout covers it).
  for (int r = 0; r < world_; ++r) {
    const RankState& st = ranks_[r];
    if (!st.beat || st.beat->phase == "done") continue;
    const double silent = now - st.changed_at;
    if (silent > spec_.heartbeat_timeout_s) {
      Fault f;
      f.kind = "lost_heartbeat";
      f.rank = r;
      f.host = st.beat->host;
      f.detail = fmt::format(
          "rank {} on {} sent no heartbeat for {:.0f} s (fault.heartbeat_timeout_s = {}); its last: "
          "{}",
          r, f.host, silent, spec_.heartbeat_timeout_s, Where(r));
      f.detect_latency_s = silent;
      return f;
    }
  }
  // Every rank finished its last step, yet one has not exited for fault.hang_timeout_s: stuck on its way out
  // (a destructor, a flush). Its last checkpoint is committed; the driver stops it.
  const bool training = std::any_of(ranks_.begin(), ranks_.end(),
                                    [](const RankState& st) { return !st.beat || st.beat->phase != "done"; });
  if (first_step_done_ && !training && now - progress_at_ > spec_.hang_timeout_s) {
    for (int r = 0; r < world_; ++r) {
      if (ranks_[r].beat->exited) continue;
      Fault f;
      f.kind = "hang";
      f.rank = r;
      f.host = ranks_[r].beat->host;
      f.detect_latency_s = now - progress_at_;
      f.detail = fmt::format(
          "every rank finished its last step, but rank {} on {} has not exited {:.0f} s after the last step began "
          "(fault.hang_timeout_s = {}); its last: {}",
          r, f.host, now - progress_at_, spec_.hang_timeout_s, Where(r));
      return f;
    }
  }
  // Hang: everyone beats, nobody progresses (after the first step: start-up has its own timeouts).
  if (first_step_done_ && training && now - progress_at_ > spec_.hang_timeout_s) {
    std::map<std::string, std::vector<int>> waiting;  // group -> ranks waiting in it
    for (int r = 0; r < world_; ++r) {
      if (ranks_[r].beat && !ranks_[r].beat->wait_group.empty()) waiting[ranks_[r].beat->wait_group].push_back(r);
    }
    std::string group;
    size_t most = 0;
    for (const auto& [g, rs] : waiting) {
      if (rs.size() > most) most = rs.size(), group = g;
    }
    Fault f;
    f.kind = "hang";
    f.detect_latency_s = now - progress_at_;
    if (group.empty()) {
      f.detail = fmt::format(
          "no rank finished a step for {:.0f} s (fault.hang_timeout_s = {}) and none waits in a "
          "collective",
          now - progress_at_, spec_.hang_timeout_s);
      return f;
    }
    std::vector<int> absent;  // members of the group that are not waiting in it
    for (int r = 0; r < world_; ++r) {
      const auto& b = ranks_[r].beat;
      if (!b) continue;
      const bool member = std::find(b->groups.begin(), b->groups.end(), group) != b->groups.end();
      if (member && b->wait_group != group) absent.push_back(r);
    }
    const std::vector<int>& in = waiting[group];
    std::string who;
    for (int r : absent) who += fmt::format("{}rank {} on {} ({})", who.empty() ? "" : "; ", r, HostOf(r), Where(r));
    f.detail = fmt::format(
        "no step for {:.0f} s (fault.hang_timeout_s = {}): {} rank(s) wait in {} on {}, {}", now - progress_at_,
        spec_.hang_timeout_s, in.size(), ranks_[in[0]].beat->wait_op, group,
        absent.empty() ? std::string("and every member is in it (a transport stall)") : "held up by " + who);
    if (!absent.empty()) {
      f.rank = absent[0];
      f.host = HostOf(absent[0]);
    }
    return f;
  }
  Stragglers(now);
  return std::nullopt;
}

void Monitor::Stragglers(double now) {
  (void)now;
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  };
  // Judge the steps every rank has reported, in order.
  while (true) {
    const int64_t step = judged_through_ + 1;
    bool all = true, everyone_past = true;
    for (const auto& st : ranks_) {
      if (!st.steps.count(step)) all = false;
      everyone_past &= !st.steps.empty() && st.steps.rbegin()->first > step;
    }
    if (!all) {
      // A step some rank's ring no longer holds (steps faster than the heartbeat): skip it once
      // every rank has reported a later one; else wait for more heartbeats.
      if (!everyone_past) return;
      for (auto& st : ranks_) st.steps.erase(step);
      judged_through_ = step;
      continue;
    }
    auto out = metrics::JsonlWriter::Open(timings_path_, /*append=*/true);
    for (int r = 0; r < world_; ++r) {
      const Beat::Step& s = ranks_[r].steps[step];
      if (out.ok()) {
        metrics::JsonObject o;
        o.Add("attempt", attempt_).Add("step", step).Add("rank", r).Add("host", HostOf(r));
        o.Add("step_s", s.step_s).Add("compute_s", s.compute_s).Add("comm_s", s.comm_s);
        out->Write(o).IgnoreError();
      }
    }
    if (spec_.straggler_steps > 0) {
      const size_t window = static_cast<size_t>(spec_.straggler_steps);
      for (auto& st : ranks_) {
        st.recent.push_back(st.steps[step].compute_s);
        if (st.recent.size() > window) st.recent.erase(st.recent.begin());
      }
      for (int r = 0; r < world_; ++r) {
        RankState& st = ranks_[r];
        if (st.flagged || st.recent.size() < window || !st.beat) continue;
        std::vector<double> peers;
        for (int q = 0; q < world_; ++q) {
          if (q != r && ranks_[q].beat && ranks_[q].beat->pp_rank == st.beat->pp_rank &&
              ranks_[q].recent.size() == window) {
            peers.push_back(median(ranks_[q].recent));
          }
        }
        if (peers.empty()) continue;
        const double theirs = median(peers), mine = median(st.recent);
        if (mine > (1 + spec_.straggler_ratio) * theirs && mine - theirs > 0.002) {
          st.flagged = true;
          LogWarn(
              "straggler: rank {} on {} computed {:.1f} ms per step (median of its last {} steps) against {:.1f} ms "
              "for its {} peer(s), through step {}",
              r, HostOf(r), mine * 1e3, window, theirs * 1e3, peers.size(), step);
          events_->Write("straggler", [&](metrics::JsonObject& o) {
            o.Add("attempt", attempt_).Add("rank", r).Add("host", HostOf(r)).Add("step", step);
            o.Add("compute_s", mine).Add("peer_median_s", theirs).Add("steps", static_cast<int64_t>(window));
          });
        }
      }
    }
    for (auto& st : ranks_) st.steps.erase(step);
    judged_through_ = step;
  }
}

}  // namespace ms::runner
